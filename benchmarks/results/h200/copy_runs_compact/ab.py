"""copy_runs gathers of short runs: the general kernels (RESHARD_CUDA_COMPACT=0) against the
compact form (default: tables averaging <= 2 KiB per run; "all": every table within the
bound), interleaved in the same process, each figure over a device copy timed in the same round.

    PYTHONPATH=python python3 benchmarks/results/h200/copy_runs_compact/ab.py OUT.json

Float32 sources, random 16-byte-aligned source places, a dense destination (float32 or
bfloat16); every mode's output is checked bit for bit against mode "0"'s.
"""

from __future__ import annotations

import json
import os
import statistics
import sys

import numpy as np
import torch

from reshard import _ops as ops

DEV = "cuda"
MODES = ("0", "", "all")
ROUNDS = 3


def time_events(fn, reps=10, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return statistics.median(ts)


def table(rng, lens, src_elems, count=1, sstride=0):
    """Rows of the given run lengths (elements, multiples of 4) from random aligned places."""
    lens = np.asarray(lens, np.int64)
    n = len(lens)
    ext = (count - 1) * sstride + lens
    starts = rng.integers(0, (src_elems - ext) // 4) * 4
    dst = np.concatenate([[0], np.cumsum(lens * count)[:-1]])
    return np.stack([starts, np.full(n, sstride), dst, lens, lens, np.full(n, count)], 1).astype(
        np.int64
    ), int((lens * count).sum())


def main(out_path):
    rng = np.random.default_rng(0)
    total = 256 << 20  # bytes of source per case
    src = torch.empty(2 * total // 4, device=DEV).uniform_(-1, 1)
    se = src.numel()
    cases = {}
    for rb in (256, 1024, 4096, 16384, 65536):
        cases[f"{rb} B"] = table(rng, [rb // 4] * (total // rb), se)
    cases["16 B (32 MiB)"] = table(rng, [4] * (2 << 20), se)
    cases["64 B"] = table(rng, [16] * (total // 64 // 2), se)
    mixed = rng.choice([16, 64, 100, 256, 1024], total // 4 // 292)
    cases["mixed 64 B..4 KiB"] = table(rng, mixed, se)
    cases["256x16 strided"] = table(rng, [64] * (total // 4096), se, count=16, sstride=128)
    descs = {k: (torch.from_numpy(d), w) for k, (d, w) in cases.items()}
    a = torch.empty(1 << 28, device=DEV).uniform_()
    b = torch.empty_like(a)
    dsts = {}
    res = {"rounds": [], "cases": list(cases)}
    for r in range(ROUNDS):
        d2d = 2 * a.nbytes / time_events(lambda: b.copy_(a))
        rnd = {"d2d_GBps": d2d / 1e9, "rows": []}
        for name, (desc, work) in descs.items():
            for ddt in (torch.float32, torch.bfloat16):
                key = (name, str(ddt))
                if key not in dsts:
                    dsts[key] = torch.empty(work, dtype=ddt, device=DEV)
                dst = dsts[key]
                ref = None
                for mode in MODES:
                    os.environ["RESHARD_CUDA_COMPACT"] = mode
                    dst.fill_(-7.0)
                    ops.copy_runs(src, desc, dst)
                    if mode == "0":
                        ref = dst.clone()
                    same = bool(
                        torch.equal(
                            dst.view(torch.int16 if ddt != torch.float32 else torch.int32),
                            ref.view(torch.int16 if ddt != torch.float32 else torch.int32),
                        )
                    )
                    s = time_events(lambda d=desc, o=dst: ops.copy_runs(src, d, o))
                    moved = work * (4 + dst.element_size())
                    row = {
                        "case": name,
                        "dst": str(ddt)[6:],
                        "mode": mode or "default",
                        "GBps": moved / s / 1e9,
                        "ratio": moved / s / d2d,
                        "same_as_0": same,
                    }
                    rnd["rows"].append(row)
                    print(r, json.dumps(row), flush=True)
        res["rounds"].append(rnd)
    os.environ.pop("RESHARD_CUDA_COMPACT", None)
    med = {}
    for row in [x for rnd in res["rounds"] for x in rnd["rows"]]:
        med.setdefault((row["case"], row["dst"], row["mode"]), []).append(row["ratio"])
    res["median_ratio"] = [
        {"case": c, "dst": d, "mode": m, "ratio": statistics.median(v)}
        for (c, d, m), v in med.items()
    ]
    res["device"] = torch.cuda.get_device_name()
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)
    print("| case | dst | main kernel (0) | default | all |")
    for c in res["cases"]:
        for d in ("float32", "bfloat16"):
            v = {m: statistics.median(med[(c, d, m)]) for m in ("0", "default", "all")}
            print(f"| {c} | {d} | {v['0']:.3f} | {v['default']:.3f} | {v['all']:.3f} |")


if __name__ == "__main__":
    main(sys.argv[1])
