"""Benchmark `reshard::copy_runs` against the torch ways of doing the same copy.

Workload: `count` runs of `run_bytes` each (float32), scattered through a source buffer in a
random order. "pack" gathers them into one dense buffer (what a sender does); "unpack"
scatters a dense buffer back into such runs (what a receiver does). Baselines, all measured
in the same process on the same buffers:

  foreach      torch._foreach_copy_ over narrowed views (views built outside the timing)
  cat          torch.cat(narrowed views, out=dense)                     (pack only)
  index        torch.index_select(src, 0, idx, out=dense) / dense-> index_copy_ (unpack)
  contiguous   one dst.copy_(src) of the same number of bytes: the memory-bandwidth ceiling

Reported: the median of repeats, GB/s of payload (bytes copied, counted once), and the ratio
of copy_runs to each baseline (> 1: copy_runs is faster). Output: JSON + a markdown table
under benchmarks/results/<device>/. This is a script for people, never run in CI.

  python benchmarks/kernels.py            # full sweep (~10 min on 2 cores)
  python benchmarks/kernels.py --quick    # a few points, includes the done-when targets
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import numpy as np
import torch

import reshard
from reshard import _ops

HERE = os.path.dirname(os.path.abspath(__file__))
KIB, MIB = 1 << 10, 1 << 20
FULL_RUN_BYTES = [64, 512, 4 * KIB, 64 * KIB, 512 * KIB, 4 * MIB]
FULL_COUNTS = [1, 10, 100, 1_000, 10_000, 100_000, 1_000_000]
QUICK_POINTS = [(64, 100_000), (4 * KIB, 100_000), (64 * KIB, 2_000), (4 * MIB, 32)]
MAX_TOTAL_BYTES = 512 * MIB  # per buffer; the sweep skips larger products
MAX_VIEWS = 1_000_000  # foreach/cat baselines build one view per run
MAX_INDEX_ELEMS = 64 * MIB  # index baselines need an int64 index per element


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_group(fns, device, repeats, warmup=2):
    """Median seconds of each function in `fns` ({name: fn}), measured round-robin: repeat r
    times every function once, so a burst of load from other processes hits all of them alike
    and the ratios stay fair. CUDA events on the GPU, perf_counter on the CPU."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    sync(device)
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            if device.type == "cuda":
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times[name].append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def workload(run_bytes, count, device, seed=0):
    """Source with `count` runs laid out in a random order (so pack is a real gather)."""
    length = run_bytes // 4
    total = length * count
    gen = np.random.default_rng(seed)
    perm = gen.permutation(count).astype(np.int64)
    src_off = perm * length  # run i of the dense order lives at slot perm[i] of the source
    dense_off = np.arange(count, dtype=np.int64) * length
    pack = np.zeros((count, 6), dtype=np.int64)
    pack[:, 0], pack[:, 2], pack[:, 4], pack[:, 5] = src_off, dense_off, length, 1
    unpack = pack[:, [2, 1, 0, 3, 4, 5]].copy()  # dense -> runs
    src = torch.randn(total, device=device)
    dense = torch.empty(total, device=device)
    idx = None
    if total <= MAX_INDEX_ELEMS:
        idx = (src_off[:, None] + np.arange(length)[None, :]).reshape(-1)
        idx = torch.from_numpy(idx).to(device)
    # desc stays on the CPU on every device: the CUDA op validates it on the host and caches
    # its device copy (docs/cuda.md).
    return {
        "length": length,
        "total": total,
        "src_off": src_off,
        "pack": _ops.as_desc(pack),
        "unpack": _ops.as_desc(unpack),
        "src": src,
        "dense": dense,
        "idx": idx,
    }


def measure_point(run_bytes, count, device, repeats):
    w = workload(run_bytes, count, device)
    length, total, src, dense = w["length"], w["total"], w["src"], w["dense"]
    nbytes = total * 4
    res = {"run_bytes": run_bytes, "count": count, "bytes": nbytes}
    out = torch.empty_like(src)

    def gbps(seconds):
        return nbytes / seconds / 1e9

    op = torch.ops.reshard.copy_runs.default
    fns = {
        "pack/copy_runs": lambda: op(src, w["pack"], dense),
        "unpack/copy_runs": lambda: op(dense, w["unpack"], out),
        "contiguous": lambda: out.copy_(src),
    }
    op(src, w["pack"], dense)
    op(dense, w["unpack"], out)
    assert torch.equal(out, src), "copy_runs pack + unpack did not round-trip"
    if count <= MAX_VIEWS:
        srcs = [src.narrow(0, int(o), length) for o in w["src_off"]]
        dsts = [dense.narrow(0, i * length, length) for i in range(count)]
        outs = [out.narrow(0, int(o), length) for o in w["src_off"]]
        fns["pack/foreach"] = lambda: torch._foreach_copy_(dsts, srcs)
        fns["pack/cat"] = lambda: torch.cat(srcs, out=dense)
        fns["unpack/foreach"] = lambda: torch._foreach_copy_(outs, dsts)
    if w["idx"] is not None:
        idx = w["idx"]
        fns["pack/index"] = lambda: torch.index_select(src, 0, idx, out=dense)
        fns["unpack/index"] = lambda: out.index_copy_(0, idx, dense)
    t = timed_group(fns, device, repeats)
    del fns

    res["seconds"] = t
    res["gbps"] = {k: gbps(v) for k, v in t.items()}
    ratios = {}
    for direction in ("pack", "unpack"):
        mine = t[f"{direction}/copy_runs"]
        for base in ("foreach", "cat", "index"):
            key = f"{direction}/{base}"
            if key in t:
                ratios[f"{direction} vs {base}"] = t[key] / mine
        ratios[f"{direction} vs contiguous"] = t["contiguous"] / mine
    res["ratio"] = ratios
    return res


def environment(device):
    from reshard import info

    env = {
        "torch": torch.__version__,
        "reshard": reshard.__version__,
        "threads": torch.get_num_threads(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "device": str(device),
        "build": info.build_info(),
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    return env


def _cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def fmt_bytes(n):
    for unit, size in (("MiB", MIB), ("KiB", KIB)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


def markdown(results, env):
    lines = [
        f"# copy_runs on {env['device']}: {env.get('gpu') or env['cpu']}",
        "",
        f"torch {env['torch']}, {env['threads']} threads, reshard {env['reshard']}. "
        "GB/s of payload; ratio = baseline time / copy_runs time (> 1: copy_runs faster). "
        "Median of repeats, all ops of a point timed round-robin.",
        "",
        "| run | runs | pack GB/s | vs foreach | vs cat | vs index | vs contiguous "
        "| unpack GB/s | vs foreach | vs index | vs contiguous | contiguous GB/s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def r(res, key):
        v = res["ratio"].get(key)
        return "—" if v is None else f"{v:.2f}×"

    for res in results:
        g = res["gbps"]
        lines.append(
            f"| {fmt_bytes(res['run_bytes'])} | {res['count']:,} | {g['pack/copy_runs']:.2f} "
            f"| {r(res, 'pack vs foreach')} | {r(res, 'pack vs cat')} | {r(res, 'pack vs index')} "
            f"| {r(res, 'pack vs contiguous')} | {g['unpack/copy_runs']:.2f} "
            f"| {r(res, 'unpack vs foreach')} | {r(res, 'unpack vs index')} "
            f"| {r(res, 'unpack vs contiguous')} | {g['contiguous']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def targets(results):
    """The done-when checks of the foundation issue, from the measured points."""
    out = {}
    for res in results:
        if res["run_bytes"] == 4 * KIB and res["count"] == 100_000:
            out["pack vs foreach at 100k x 4 KiB (want >= 3)"] = res["ratio"].get("pack vs foreach")
        if res["run_bytes"] >= 64 * KIB:
            key = f"pack vs contiguous at {res['count']:,} x {fmt_bytes(res['run_bytes'])} (>= 0.8)"
            out[key] = res["ratio"]["pack vs contiguous"]
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a few points (about a minute)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:n]")
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats per measurement")
    ap.add_argument("--out", default=None, help="output directory")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    device = torch.device(args.device)
    repeats = args.repeats or (7 if args.quick else 11)
    if args.quick:
        points = QUICK_POINTS
    else:
        points = [(b, c) for b in FULL_RUN_BYTES for c in FULL_COUNTS if b * c <= MAX_TOTAL_BYTES]
    env = environment(device)
    print(
        f"device {device} ({env.get('gpu') or env['cpu']}), torch {env['torch']}, "
        f"{env['threads']} threads",
        flush=True,
    )
    results = []
    for run_bytes, count in points:
        res = measure_point(run_bytes, count, device, repeats)
        results.append(res)
        g = res["gbps"]
        print(
            f"{fmt_bytes(run_bytes):>8} x {count:>9,}: pack {g['pack/copy_runs']:6.2f} GB/s "
            + " ".join(f"{k}={v:.2f}x" for k, v in res["ratio"].items()),
            flush=True,
        )
    checks = targets(results)
    for k, v in checks.items():
        print(f"target: {k}: {'n/a' if v is None else f'{v:.2f}'}")

    out_dir = args.out or os.path.join(HERE, "results", device.type)
    os.makedirs(out_dir, exist_ok=True)
    stem = "kernels_quick" if args.quick else "kernels"
    with open(os.path.join(out_dir, stem + ".json"), "w") as f:
        json.dump({"env": env, "results": results, "targets": checks}, f, indent=1)
    with open(os.path.join(out_dir, stem + ".md"), "w") as f:
        f.write(markdown(results, env))
        f.write("\nTargets: " + "; ".join(f"{k}: {v:.2f}" for k, v in checks.items() if v) + "\n")
    print(f"wrote {out_dir}/{stem}.json and .md")


if __name__ == "__main__":
    main()
