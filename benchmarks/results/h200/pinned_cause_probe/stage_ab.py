"""stage_h2d / stage_d2h from/to pinned memory, 4 KiB and 64 KiB runs: the per-call row split
cached (the fix) against re-scanned every call (RESHARD_SPLIT_NOCACHE=1, the code before), with
the same table from pageable memory, each against a pinned memcpy of 256 MiB in the same round.

1 GiB of float32 in random runs from/to a 1.25 GiB host buffer and a dense device buffer,
ring 64 MiB (as gpu_bench.py's staging section); medians of 5 interleaved rounds.
`python stage_ab.py OUT.json` (PYTHONPATH=python; the EXPERIMENT build reads the variable).
"""

import json
import os
import statistics
import sys
import time

import numpy as np
import torch

import reshard._ops as ops

GB = 1e9
TOTAL = 1 << 30


def fill(t):
    flat = t.view(-1)
    block = min(flat.numel(), 1 << 20)
    pat = torch.randn(block)
    n = flat.numel() // block
    flat[: n * block].view(n, block).copy_(pat.expand(n, block))
    flat[n * block :].copy_(pat[: flat.numel() - n * block])
    return t


def main():
    rng = np.random.default_rng(1)
    span = 5 * TOTAL // 16  # elements of the host buffers
    pinned = fill(torch.empty(span, pin_memory=True))
    pageable = fill(torch.empty(span))
    ring = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(TOTAL // 4, device="cuda")
    big = fill(torch.empty((256 << 20) // 4, pin_memory=True))
    dbig = torch.empty_like(big, device="cuda")
    cases = {
        "floor h2d": (lambda: dbig.copy_(big, non_blocking=True), None, 256 << 20),
        "floor d2h": (lambda: big.copy_(dbig, non_blocking=True), None, 256 << 20),
    }
    for run in (4 << 10, 64 << 10):
        re_ = run // 4
        n = TOTAL // run
        starts = rng.choice(span // re_, n, replace=False) * re_
        z = np.zeros(n, np.int64)
        d = np.stack([starts, z, np.arange(n, dtype=np.int64) * re_, z, z + re_, z + 1], 1)
        desc = torch.from_numpy(d)
        rev = torch.from_numpy(d[:, [2, 3, 0, 1, 4, 5]].copy())
        k = f"{run >> 10}KiB"
        for cache in ("cached", "rescan"):
            env = None if cache == "cached" else "1"
            cases[f"h2d pinned {cache} {k}"] = (
                lambda desc=desc: ops.stage_h2d(pinned, desc, ring, dev),
                env,
                TOTAL,
            )
            cases[f"d2h pinned {cache} {k}"] = (
                lambda rev=rev: ops.stage_d2h(dev, rev, ring, pinned), env, TOTAL)  # fmt: skip
        cases[f"h2d pageable {k}"] = (lambda desc=desc: ops.stage_h2d(pageable, desc, ring, dev),
                                      None, TOTAL)  # fmt: skip
        cases[f"d2h pageable {k}"] = (lambda rev=rev: ops.stage_d2h(dev, rev, ring, pageable),
                                      None, TOTAL)  # fmt: skip
    times = {k: [] for k in cases}
    for f, _env, _ in cases.values():
        f()
    torch.cuda.synchronize()
    for _ in range(5):
        for k, (f, env, _) in cases.items():
            if env:
                os.environ["RESHARD_SPLIT_NOCACHE"] = env
            torch.cuda.synchronize()
            t = time.perf_counter()
            f()
            torch.cuda.synchronize()
            times[k].append(time.perf_counter() - t)
            os.environ.pop("RESHARD_SPLIT_NOCACHE", None)
    out = {}
    for k, v in times.items():
        nbytes = cases[k][2]
        floor = (256 << 20) / statistics.median(times["floor " + k[:3]]) / GB
        gbps = nbytes / statistics.median(v) / GB
        out[k] = {"GBps": gbps, "of_pinned_memcpy": gbps / floor, "samples_s": v}
        print(f"{k:28s} {gbps:6.2f} GB/s  {gbps / floor:.3f}", flush=True)
    json.dump(out, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
