"""EXPERIMENT (removed once a variant is chosen): copy_runs kernel variants, same run, interleaved.

RESHARD_CR_VARIANT is read by the CUDA launch (raw 4-byte and fp32 -> bf16 only).
python benchmarks/cuda_ab.py OUT.json [variants, default 0,1,2,3,4,5]
"""

import ctypes
import json
import os
import statistics
import sys

import numpy as np
import torch

import reshard._ops as ops

GB = 1e9
DEV = "cuda"


def time_events(fn, reps=10, warm=3):
    for _ in range(warm):
        fn()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / 1e3 / reps


def gather_table(n_runs, run_elems, src_elems, rng):
    starts = rng.choice(src_elems // run_elems, n_runs, replace=False) * run_elems
    dst = np.arange(n_runs, dtype=np.int64) * run_elems
    z = np.zeros(n_runs, np.int64)
    return np.stack([starts, z, dst, z, np.full(n_runs, run_elems), np.ones(n_runs, np.int64)], 1)


def strided_table(n_rows, run_elems, count, src_elems, rng):
    """Rows of `count` runs of run_elems, source stride 2 runs (a block of a 2-D tensor)."""
    stride = 2 * run_elems
    blocks = src_elems // (stride * count)
    starts = rng.choice(blocks, n_rows, replace=False) * stride * count
    dst = np.arange(n_rows, dtype=np.int64) * run_elems * count
    z = np.zeros(n_rows, np.int64)
    return np.stack([starts, z + stride, dst, z + run_elems, z + run_elems, z + count], 1)


def main():
    out_path = sys.argv[1]
    variants = [int(v) for v in (sys.argv[2] if len(sys.argv) > 2 else "0").split(",")]
    ceil = ctypes.CDLL(sys.argv[3]) if len(sys.argv) > 3 else None
    rng = np.random.default_rng(0)
    total = 256 << 20
    src = torch.randn(2 * total // 4, device=DEV)
    a = torch.empty((1 << 30) // 4, device=DEV)
    b = torch.empty_like(a)
    cases = {}
    for run_bytes in (256, 1024, 4096, 65536):
        re_ = run_bytes // 4
        n = total // run_bytes
        cases[(f"{run_bytes}", n * re_)] = torch.from_numpy(gather_table(n, re_, src.numel(), rng))
    n = total // (256 * 16)
    cases[("256x16 strided", n * 64 * 16)] = torch.from_numpy(
        strided_table(n, 64, 16, src.numel(), rng)
    )
    dsts = {
        ddt: torch.empty(total // 4, dtype=ddt, device=DEV)
        for ddt in (torch.float32, torch.bfloat16)
    }
    res = {}
    ceil_calls = {}
    if ceil is not None:
        for (name, elems), desc in cases.items():
            if "strided" in name:
                continue
            rows = desc.to(DEV)
            lens = desc[:, 4] * desc[:, 5]
            prefix = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]).to(DEV)
            run_el = int(desc[0, 4])
            n_runs = desc.shape[0]
            off = (desc[:, 0] // 4).to(DEV)
            for ddt, dst in dsts.items():
                words = run_el * (2 if ddt == torch.bfloat16 else 4) // 16
                lw = words.bit_length() - 1
                for full in (0, 1):

                    def call(ddt=ddt, dst=dst, full=full, off=off, rows=rows, prefix=prefix,
                             n_runs=n_runs, lw=lw):  # fmt: skip
                        rc = ceil.ceiling_gather(
                            int(ddt == torch.bfloat16), full, ctypes.c_void_p(src.data_ptr()),
                            ctypes.c_void_p(off.data_ptr()), ctypes.c_void_p(rows.data_ptr()),
                            ctypes.c_void_p(prefix.data_ptr()), ctypes.c_void_p(dst.data_ptr()),
                            ctypes.c_longlong(n_runs), ctypes.c_int(lw),
                        )  # fmt: skip
                        assert rc == 0, rc

                    ceil_calls[(name, elems, ddt, "desc56" if full else "desc8")] = call
    # correctness of every variant on every case against variant 0 (bitwise)
    checks = {}
    for (name, elems), desc in cases.items():
        for ddt, dst in dsts.items():
            ref = None
            for v in [0] + [x for x in variants if x != 0]:
                os.environ["RESHARD_CR_VARIANT"] = str(v)
                dst.fill_(float("nan"))
                ops.copy_runs(src, desc, dst[:elems])
                got = dst[:elems].clone()
                if ref is None:
                    ref = got
                else:
                    checks[f"{name}/{str(ddt)[6:]}/v{v}"] = bool(torch.equal(got.view(-1), ref))
            for (cn, _, cd, kind), call in ceil_calls.items():
                if cn == name and cd == ddt:
                    dst.fill_(float("nan"))
                    call()
                    checks[f"{name}/{str(ddt)[6:]}/{kind}"] = bool(torch.equal(dst[:elems], ref))
    print("checks", json.dumps(checks), flush=True)
    for rnd in range(3):
        d2d = 2 * a.nbytes / time_events(lambda: b.copy_(a)) / GB
        res.setdefault("d2d", []).append(d2d)
        order = variants[rnd % len(variants) :] + variants[: rnd % len(variants)]
        for (name, elems), desc in cases.items():
            for ddt, dst in dsts.items():
                if "strided" in name and ddt != torch.float32:
                    continue
                for v in order:
                    os.environ["RESHARD_CR_VARIANT"] = str(v)
                    d = dst[:elems]
                    s = time_events(lambda d=d, desc=desc: ops.copy_runs(src, desc, d))
                    moved = elems * (4 + d.element_size())
                    key = f"{name}/{str(ddt)[6:]}/v{v}"
                    res.setdefault(key, []).append(moved / s / GB / d2d)
        for (name, elems, ddt, kind), call in ceil_calls.items():
            s = time_events(call)
            moved = elems * (4 + ddt.itemsize)
            res.setdefault(f"{name}/{str(ddt)[6:]}/{kind}", []).append(moved / s / GB / d2d)
        print("round", rnd, "d2d", round(d2d), flush=True)
    os.environ.pop("RESHARD_CR_VARIANT", None)
    summary = {k: {"median": statistics.median(v), "samples": v} for k, v in res.items()}
    for k, v in summary.items():
        print(f"{k:32s} {v['median']:.3f}  {[round(x, 3) for x in v['samples']]}", flush=True)
    json.dump({"checks": checks, "results": summary}, open(out_path, "w"), indent=1)


if __name__ == "__main__":
    main()
