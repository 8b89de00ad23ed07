"""Is stage_h2d's shortfall on 4 KiB runs from pinned memory the source's page size?

Same random table of 4 KiB (and 64 KiB) runs, 256 MiB in all, from: cudaHostAlloc'd memory
(torch pin_memory), pageable memory, and pageable memory advised MADV_HUGEPAGE before first touch
then registered in place (cudaHostRegister). Rounds interleave the cases; medians of 5 rounds.
"""

import ctypes
import json
import statistics
import sys
import time

import numpy as np
import torch

import reshard._ops as ops

GB = 1e9
dev = "cuda"
libc = ctypes.CDLL("libc.so.6", use_errno=True)
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
MADV_HUGEPAGE = 14


def thp_info():
    try:
        en = open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip()
    except OSError as e:
        en = str(e)
    anon = [ln for ln in open("/proc/meminfo") if ln.startswith("AnonHugePages")]
    return en, anon[0].strip() if anon else "?"


def fill(t):
    flat = t.view(-1)
    block = min(flat.numel(), 1 << 20)
    pat = torch.randn(block)
    n = flat.numel() // block
    flat[: n * block].view(n, block).copy_(pat.expand(n, block))
    flat[n * block :].copy_(pat[: flat.numel() - n * block])
    return t


def huge_registered(n_elems):
    align = 2 << 20
    raw = torch.empty(n_elems + align // 4)  # untouched: malloc's mmap
    addr = raw.data_ptr()
    off = (-addr) % align
    t = raw[off // 4 : off // 4 + n_elems]
    rc = libc.madvise(t.data_ptr(), t.nbytes, MADV_HUGEPAGE)
    fill(t)
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.nbytes, 0)
    return raw, t, rc, int(err)


def main():
    total = 256 << 20
    src_elems = (5 * total // 4) // 4
    print("thp before", thp_info(), flush=True)
    pinned = fill(torch.empty(src_elems, pin_memory=True))
    pageable = fill(torch.empty(src_elems))
    raw, huge, rc, err = huge_registered(src_elems)
    print("madvise rc", rc, "register err", err, "is_pinned", huge.is_pinned(), flush=True)
    print("thp after", thp_info(), flush=True)
    ring = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True)
    out = torch.empty(total // 4, device=dev)
    # contiguous floors
    res = {"thp": thp_info(), "cases": {}}
    cases = {}
    rng = np.random.default_rng(1)
    for run_bytes in (4 << 10, 64 << 10):
        re_ = run_bytes // 4
        n = total // run_bytes
        starts = rng.choice(src_elems // re_, n, replace=False) * re_
        z = np.zeros(n, np.int64)
        d = np.stack([starts, z, np.arange(n, dtype=np.int64) * re_, z, np.full(n, re_), z + 1], 1)
        desc = torch.from_numpy(d)
        for name, src in (
            ("cudaHostAlloc", pinned),
            ("pageable", pageable),
            ("thp_registered", huge),
        ):
            cases[f"{run_bytes >> 10}KiB {name}"] = lambda s=src, dd=desc: ops.stage_h2d(
                s, dd, ring, out
            )
    for name, src in (("cudaHostAlloc", pinned), ("thp_registered", huge)):
        cases[f"contiguous {name}"] = lambda s=src: out.copy_(s[: total // 4], non_blocking=True)
    times = {k: [] for k in cases}
    for f in cases.values():
        f()
    torch.cuda.synchronize()
    for _ in range(5):
        for k, f in cases.items():
            torch.cuda.synchronize()
            t = time.perf_counter()
            f()
            torch.cuda.synchronize()
            times[k].append(time.perf_counter() - t)
    floor = total / statistics.median(times["contiguous cudaHostAlloc"]) / GB
    for k, v in times.items():
        gbps = total / statistics.median(v) / GB
        res["cases"][k] = {
            "GBps": round(gbps, 2),
            "of_pinned_contiguous": round(gbps / floor, 3),
            "spread": round((max(v) - min(v)) / statistics.median(v), 3),
        }
        print(
            f"{k:32s} {gbps:7.2f} GB/s  {gbps / floor:.3f} of the contiguous cudaHostAlloc copy",
            flush=True,
        )
    json.dump(res, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
