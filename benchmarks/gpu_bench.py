"""GPU benchmarks of reshard, each against baselines measured in the same run: one GPU or two.

    python benchmarks/gpu_bench.py --out DIR [--quick] [--skip-model] [--only copy_runs,ring]
    python benchmarks/gpu_bench.py --mode multi --out DIR [--quick] [--time-cap 170]
    python benchmarks/gpu_bench.py --mode multi --backend gloo --quick --out DIR  # CPU dry run
    python benchmarks/gpu_bench.py [--mode multi] --from-json DIR/gpu_bench.json  # re-render

`--mode single` (the default; benchmarks/_gpu_single.py): the CUDA half on one GPU: ceilings,
copy_runs, stage_h2d/stage_d2h, the ring-size sweep, a 1.5B-parameter offloaded optimizer
state -> GPU sync; writes DIR/gpu_bench.{json,md,png}.
`--mode multi` (benchmarks/_gpu_multi.py): two ranks over NCCL: the point-to-point ceiling,
reshard GPU<->GPU against it, the ZeRO-3 -> TP=2 weight sync against the per-tensor baselines;
writes DIR/gpu_bench_multi.{json,md,png}, progress on stderr, a summary on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402

MODES = ("single", "multi")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=MODES, default="single", help="one GPU or two (NCCL)")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results/h200"))
    ap.add_argument("--quick", action="store_true", help="small sizes and model")
    ap.add_argument("--from-json", default=None, help="re-render PATH's .md and .png only")
    single = ap.add_argument_group("--mode single")
    single.add_argument("--skip-model", action="store_true", help="no 1.5B model sync")
    single.add_argument("--only", default=None, help="comma list of: copy_runs,staging,ring,model")
    multi = ap.add_argument_group("--mode multi")
    multi.add_argument("--backend", choices=["nccl", "gloo"], default="nccl",
                       help="gloo: a CPU dry run of the same code (no GPU needed)")  # fmt: skip
    multi.add_argument("--time-cap", type=float, default=170.0, help="seconds; later steps shrink")
    args = ap.parse_args(argv)
    if args.only is not None:
        from _gpu_single import SECTIONS

        args.only = args.only.split(",")
        unknown = set(args.only) - set(SECTIONS)
        if unknown:
            ap.error(f"--only: unknown sections {sorted(unknown)}; choose from {list(SECTIONS)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.mode == "single":
        import _gpu_single as bench
    else:
        import _gpu_multi as bench
    if args.from_json:
        with open(args.from_json) as f:
            C.write_results(args.from_json, json.load(f), bench.markdown, bench.plot)
        return 0
    return bench.run(args)


if __name__ == "__main__":
    sys.exit(main())
