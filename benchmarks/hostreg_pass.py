"""The host registries' per-call cost on a repeated registered call, REV vs this checkout.

    python benchmarks/hostreg_pass.py REV --json benchmarks/results/cpu/hostreg_pass.json

A Transfer made with register_host_sources / register_host_targets syncs two `HostRegistry`s
after every call. Registration needs CUDA, so on a box without it the registries do nothing;
this measures what a steady-state call costs them here anyway: both registries hold an entry
for every source storage (as a pass that registered them leaves them; `available` reports
True), the sources are N CPU tensors and the targets N meta tensors (they stand for the CUDA
targets the pass skips), and the two versions are called alternately in one process: REV's
`sync(buffers)` and this checkout's `sync(buffers, unchanged=True)` (what a Transfer passes
when preflight's key object is the one of the registries' last sync). N: 294 and 582, the
storage counts of gpt-125m and gpt-350m's fp32 params + exp_avg + exp_avg_sq. Not part of the
suite: run by hand.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402


def _rev_module(rev):
    text = C.git_output("show", f"{rev}:python/reshard/hostreg.py")
    spec = importlib.util.spec_from_loader("reshard._rev_hostreg", loader=None)
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = "reshard"
    exec(compile(text, f"<rev {rev} hostreg.py>", "exec"), mod.__dict__)
    return mod


def _registries(mod, srcs, dsts):
    """A (sources, targets) pair of `mod.HostRegistry` holding an entry per source storage."""
    regs = mod.HostRegistry(background=True), mod.HostRegistry(background=True)
    for loc, t in srcs.items():
        st = t.untyped_storage()
        regs[0]._regs[loc] = (st, st.data_ptr(), st.nbytes(), False)
    return regs


def measure(rev_mod, cur_mod, n, iters) -> list:
    import torch

    srcs = {i: torch.empty(64 + i) for i in range(n)}
    dsts = {100000 + i: torch.empty(64 + i, device="meta") for i in range(n)}
    regs = {"rev": _registries(rev_mod, srcs, dsts), "current": _registries(cur_mod, srcs, dsts)}
    kw = {"rev": {}, "current": {"unchanged": True}}
    for rs_, rd in regs.values():  # one full pass each: the current one is then settled
        rs_.sync(srcs), rd.sync(dsts)
    times = {name: [] for name in regs}
    for i in range(iters):
        for name in ("rev", "current") if i % 2 else ("current", "rev"):
            rs_, rd = regs[name]
            t0 = time.perf_counter()
            a, b = rs_.sync(srcs, **kw[name]), rd.sync(dsts, **kw[name])
            times[name].append(time.perf_counter() - t0)
            assert a["registered"] == [] and a["unregistered"] == [] and b["registered"] == []
    for rs_, rd in regs.values():
        rs_._regs.clear(), rd._regs.clear()  # nothing was registered: nothing to undo
    return [
        {"storages": n, "variant": name, "median_s": statistics.median(ts), "calls": len(ts)}
        for name, ts in times.items()
    ]


def markdown(record) -> str:
    meta, rows = record["meta"], record["results"]
    out = [
        f"# hostreg_pass: {meta['rev']} vs the current host registries, {meta['host']}",
        "",
        f"torch {meta['torch']}, {meta['cpus']} CPUs, load average {meta['loadavg']}; "
        f"{meta['iters']} steady-state syncs of both registries (sources + targets) per "
        "variant, alternating. See the script's docstring for what stands in for CUDA.",
        "",
        f"Command: `{meta['command']}`",
        "",
        "| storages per side | variant | median ms |",
        "|---:|---|---:|",
    ]
    for r in rows:
        out.append(f"| {r['storages']} | {r['variant']} | {r['median_s'] * 1e3:.3f} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("rev", help="git revision whose hostreg.py is the 'rev' variant")
    ap.add_argument("--iters", type=int, default=400)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import torch

    from reshard import hostreg as cur_mod

    torch.set_num_threads(1)
    rev_mod = _rev_module(args.rev)
    for mod in (rev_mod, cur_mod):
        mod.available = lambda: True
    rows = [r for n in (294, 582) for r in measure(rev_mod, cur_mod, n, args.iters)]
    rev = C.git_output("rev-parse", "--short", args.rev).strip()
    meta = {
        **C.environment("cpu"),
        "rev": rev,
        "iters": args.iters,
        "command": C.command_line("hostreg_pass.py", argv),
    }
    record = {"meta": meta, "results": rows}
    if args.json:
        C.write_results(args.json, record, markdown)
    print(markdown(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
