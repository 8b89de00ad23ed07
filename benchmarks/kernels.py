"""Benchmark `reshard::copy_runs` against the torch ways of doing the same copy.

Workload: `count` runs of `run_bytes` each (float32), scattered through a source buffer in a
random order. "pack" gathers them into one dense buffer (what a sender does); "unpack"
scatters a dense buffer back into such runs (what a receiver does). Baselines, all measured
in the same process on the same buffers:

  foreach      torch._foreach_copy_ over narrowed views (views built outside the timing)
  cat          torch.cat(narrowed views, out=dense)                     (pack only)
  index        torch.index_select(src, 0, idx, out=dense) / dense-> index_copy_ (unpack)
  same-size    one out.copy_(src) of the same number of bytes
  large copy   (runs >= 64 KiB) one contiguous copy of LARGE_BYTES, the faster per repeat of
               torch's copy_ and glibc's memcpy on every thread: the reference
               "bandwidth of a single large contiguous copy"

Method: buffers are filled (so pre-faulted) before timing; each op runs untimed twice; then
every repeat times each op once, round-robin, starting at a different op each repeat (so a
burst of load hits all ops alike). Fast ops (under SAMPLE_SECONDS a call) are timed as a batch
of calls per sample. A batch, and every sample of a point whose src and dst fit in the
last-level cache together, follows one untimed call of the same op: the sample measures the
op's steady state (what repeated copies of that table see), not the cache the previous op
(the large copy, say) left behind. Points whose total exceeds the LLC run cold by size. Repeats continue until the point has used `--min-time` seconds
(at least MIN_REPEATS). Reported: the median time per op with its spread (half the
interquartile range, in % of the median), GB/s of payload (bytes copied, counted once), and
ratios computed per repeat from the times of that same repeat, then their median
(> 1: copy_runs is faster). Garbage collection is off while timing. The load average and the
CPU steal time of the run are recorded. Output: JSON + a markdown table under
benchmarks/results/<device>/. This is a script for people, never run in CI.

  python benchmarks/kernels.py            # full sweep (~2.5 min on 2 cores)
  python benchmarks/kernels.py --quick    # a few points, includes the done-when targets
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402

import reshard  # noqa: E402
from reshard import _ops  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
KIB, MIB = 1 << 10, 1 << 20
FULL_RUN_BYTES = [64, 512, 4 * KIB, 64 * KIB, 512 * KIB, 4 * MIB]
FULL_COUNTS = [1, 10, 100, 1_000, 10_000, 100_000, 1_000_000]
QUICK_POINTS = [
    (64, 100_000),
    (4 * KIB, 100_000),
    (64 * KIB, 1),
    (64 * KIB, 10_000),
    (4 * MIB, 100),
]
MAX_TOTAL_BYTES = 640 * MIB  # per buffer; the sweep skips larger products (keeps 10k x 64 KiB)
MAX_VIEWS = 1_000_000  # foreach/cat baselines build one view per run
MAX_INDEX_ELEMS = 64 * MIB  # index baselines need an int64 index per element
LARGE_BYTES = 512 * MIB  # the large contiguous reference copy, out of this machine's LLC
LARGE_FROM_RUN_BYTES = 64 * KIB  # points with runs this long are judged against it
MIN_REPEATS = 5
SAMPLE_SECONDS = 200e-6  # ops faster than this are timed as a batch of calls per sample


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def quantiles(xs):
    """(median, half the interquartile range in % of the median)."""
    xs = sorted(xs)
    if len(xs) < 2:
        return xs[0], 0.0
    q1, med, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return med, 50.0 * (q3 - q1) / med


def time_once(fn, calls, device, warm):
    if warm:  # untimed: the sample measures the op's steady state, not the previous op's cache
        fn()
        sync(device)
    if device.type == "cuda":
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / calls
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def timed_group(fns, device, min_time, in_cache):
    """Per-call seconds of every repeat of each function in `fns` ({name: fn}), round-robin
    with a rotating start, so each repeat holds one sample of every op taken within moments
    of each other. Batched samples, and every sample of an in-cache point, follow an untimed
    call. Returns ({name: [seconds per repeat]}, {name: calls per sample})."""
    names = list(fns)
    calls = {}
    for name in names:  # an untimed call (lazy init), then one to pick the batch size
        fns[name]()
        sync(device)
        one = time_once(fns[name], 1, device, False)
        calls[name] = max(1, min(1000, int(SAMPLE_SECONDS / max(one, 1e-9))))
    times = {name: [] for name in names}
    gc_was_enabled = gc.isenabled()
    gc.disable()  # 1M views make a full collection take seconds, inside some op's sample
    try:
        start, rep = time.perf_counter(), 0
        while rep < MIN_REPEATS or time.perf_counter() - start < min_time:
            for i in range(len(names)):
                name = names[(rep + i) % len(names)]
                warm = in_cache and not name.startswith("large/") or calls[name] > 1
                times[name].append(time_once(fns[name], calls[name], device, warm))
            rep += 1
    finally:
        if gc_was_enabled:
            gc.enable()
    return times, calls


class LargeCopy:
    """The reference: one contiguous copy of LARGE_BYTES (filled, so pre-faulted), by torch's
    copy_ and, on the CPU, by glibc's memcpy split over torch's thread count (ctypes drops the
    GIL, so the halves run in parallel; each half is above glibc's streaming threshold)."""

    def __init__(self, device):
        self.nbytes = LARGE_BYTES
        self.src = torch.ones(LARGE_BYTES // 4, device=device)
        self.dst = torch.zeros_like(self.src)
        self.fns = {"large/copy_": lambda: self.dst.copy_(self.src)}
        if device.type == "cpu":
            memcpy = ctypes.CDLL(None).memcpy
            memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
            threads = torch.get_num_threads()
            pool = ThreadPoolExecutor(threads)
            s0, d0, step = self.src.data_ptr(), self.dst.data_ptr(), LARGE_BYTES // threads

            def parallel_memcpy():
                list(pool.map(lambda i: memcpy(d0 + i * step, s0 + i * step, step), range(threads)))

            self.fns["large/memcpy"] = parallel_memcpy


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
    dense = torch.zeros(total, device=device)  # filled: its pages fault now, not in a sample
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


def measure_point(run_bytes, count, device, min_time, large, llc):
    w = workload(run_bytes, count, device)
    length, total, src, dense = w["length"], w["total"], w["src"], w["dense"]
    nbytes = total * 4
    res = {"run_bytes": run_bytes, "count": count, "bytes": nbytes}
    out = torch.zeros_like(src)

    op = torch.ops.reshard.copy_runs.default
    fns = {
        "pack/copy_runs": lambda: op(src, w["pack"], dense),
        "unpack/copy_runs": lambda: op(dense, w["unpack"], out),
        "same-size": lambda: out.copy_(src),
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
    judged = run_bytes >= LARGE_FROM_RUN_BYTES
    if judged:
        fns.update(large.fns)
    in_cache = llc > 0 and 2 * nbytes <= llc
    res["cache"] = "in" if in_cache else "out" if nbytes > llc > 0 else "partly"
    t, calls = timed_group(fns, device, min_time, in_cache)
    del fns
    reps = len(t["pack/copy_runs"])

    res["repeats"] = reps
    res["calls_per_sample"] = calls
    res["seconds"] = {k: quantiles(v)[0] for k, v in t.items()}
    res["spread_pct"] = {k: quantiles(v)[1] for k, v in t.items()}
    res["quartiles"] = {k: statistics.quantiles(v, n=4, method="inclusive") for k, v in t.items()}
    res["samples"] = t  # dropped before the JSON is written (MBs for the fast points)
    res["gbps"] = {
        k: (large.nbytes if k.startswith("large/") else nbytes) / v / 1e9
        for k, v in res["seconds"].items()
    }
    ratios = {}
    for direction in ("pack", "unpack"):
        mine = t[f"{direction}/copy_runs"]
        for base in ("foreach", "cat", "index"):
            key = f"{direction}/{base}"
            if key in t:
                ratios[f"{direction} vs {base}"] = [b / m for b, m in zip(t[key], mine)]
        ratios[f"{direction} vs same-size"] = [b / m for b, m in zip(t["same-size"], mine)]
        if judged:  # bandwidth ratio: (nbytes / mine) / (large bytes / fastest large copy)
            fastest = [min(ts) for ts in zip(*(t[k] for k in large.fns))]
            ratios[f"{direction} vs large copy"] = [
                nbytes * f / (large.nbytes * m) for f, m in zip(fastest, mine)
            ]
    res["ratio"] = {k: quantiles(v)[0] for k, v in ratios.items()}
    res["ratio_spread_pct"] = {k: quantiles(v)[1] for k, v in ratios.items()}
    return res


def cpu_times():
    """(steal, total) jiffies from /proc/stat, or None."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        return fields[7], sum(fields)
    except (OSError, IndexError, ValueError):
        return None


def llc_bytes():
    """Size of the last-level cache, from sysfs (0 when unknown)."""
    best = 0
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for entry in os.listdir(base):
            try:
                with open(os.path.join(base, entry, "size")) as f:
                    text = f.read().strip()
            except OSError:
                continue
            scale = {"K": KIB, "M": MIB}.get(text[-1:], 1)
            best = max(best, int(text.rstrip("KM")) * scale)
    except (OSError, ValueError):
        pass
    return best


def environment(device):
    from reshard import info

    env = C.environment(device.type) | {
        "reshard": reshard.__version__,
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpus": os.cpu_count(),
        "llc_bytes": llc_bytes(),
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
    for unit, size in (("GiB", 1 << 30), ("MiB", MIB), ("KiB", KIB)):
        if n >= size:
            return f"{n // size} {unit}" if n % size == 0 else f"{n / size:.1f} {unit}"
    return f"{n} B"


def markdown(results, env, checks):
    llc = fmt_bytes(env["llc_bytes"]) if env["llc_bytes"] else "unknown"
    large = env["large_copy"]
    large_desc = ", ".join(f"{k.split('/')[1]} {v:.2f} GB/s" for k, v in large.items())
    lines = [
        f"# copy_runs on {env['device']}: {env.get('gpu') or env['cpu']}",
        "",
        f"torch {env['torch']}, {env['threads']} threads on {env['cpus']} CPUs, reshard "
        f"{env['reshard']}, last-level cache {llc}. Load average {env['load_before']} before, "
        f"{env['load_after']} after; CPU steal {env['steal_pct']:.1f}% of the run; "
        f"{env['wall_s']:.0f} s.",
        "",
        "GB/s of payload (bytes copied, counted once): the median over repeats, ± half the "
        "interquartile range in % of it. Ratios are baseline time / copy_runs time "
        "(> 1: copy_runs faster), taken within each repeat and then the median. Every op of a "
        "point is timed round-robin in the same repeats. *same-size*: one contiguous "
        "`copy_` of the same bytes as the point (in cache when the point is). *large copy*: "
        f"the bandwidth of one contiguous copy of {fmt_bytes(LARGE_BYTES)}, the faster per "
        f"repeat of torch's `copy_` and glibc's `memcpy` on {env['threads']} threads, timed "
        f"in the same repeats (medians over the run: {large_desc}); only for runs ≥ "
        f"{fmt_bytes(LARGE_FROM_RUN_BYTES)}. *cache*: `out` when the point's total exceeds "
        "the last-level cache (src and dst each: cold by size), `in` when src and dst fit in "
        "it together (each sample follows an untimed call of the same op: warm). An in-cache "
        "point against the out-of-cache large copy flatters copy_runs; the out-of-cache "
        "points are the real test.",
        "",
        "| run | runs | total | cache | reps | pack GB/s | vs foreach | vs cat | vs index "
        "| vs same-size | vs large copy | unpack GB/s | vs foreach | vs index | vs same-size "
        "| vs large copy | same-size GB/s |",
        "|---:|---:|---:|:-:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def r(res, key):
        v = res["ratio"].get(key)
        return "—" if v is None else f"{v:.2f}×"

    def g(res, key):
        return f"{res['gbps'][key]:.2f} ±{res['spread_pct'][key]:.0f}%"

    for res in results:
        lines.append(
            f"| {fmt_bytes(res['run_bytes'])} | {res['count']:,} | {fmt_bytes(res['bytes'])} "
            f"| {res['cache']} | {res['repeats']} "
            f"| {g(res, 'pack/copy_runs')} | {r(res, 'pack vs foreach')} | {r(res, 'pack vs cat')} "
            f"| {r(res, 'pack vs index')} | {r(res, 'pack vs same-size')} "
            f"| {r(res, 'pack vs large copy')} | {g(res, 'unpack/copy_runs')} "
            f"| {r(res, 'unpack vs foreach')} | {r(res, 'unpack vs index')} "
            f"| {r(res, 'unpack vs same-size')} | {r(res, 'unpack vs large copy')} "
            f"| {g(res, 'same-size')} |"
        )
    lines += ["", "Targets:", ""]
    lines += [f"- {line}" for line in target_lines(checks)]
    return "\n".join(lines) + "\n"


def targets(results):
    """The targets, checked on the measured points: every point
    with runs >= 64 KiB counts, in cache or not, pack and unpack."""
    out = {"foreach": None, "large": [], "large_min": None, "large_min_out_of_cache": None}
    for res in results:
        if res["run_bytes"] == 4 * KIB and res["count"] == 100_000:
            v = res["ratio"].get("pack vs foreach")
            out["foreach"] = v and {
                "ratio": v,
                "spread_pct": res["ratio_spread_pct"]["pack vs foreach"],
                "unpack": res["ratio"].get("unpack vs foreach"),
            }
        if res["run_bytes"] >= LARGE_FROM_RUN_BYTES and "pack vs large copy" in res["ratio"]:
            for direction in ("pack", "unpack"):
                out["large"].append(
                    {
                        "point": f"{direction} {res['count']:,} x {fmt_bytes(res['run_bytes'])}",
                        "ratio": res["ratio"][f"{direction} vs large copy"],
                        "out_of_cache": res["cache"] == "out",
                    }
                )
    if out["large"]:
        worst = min(out["large"], key=lambda e: e["ratio"])
        out["large_min"] = worst
        cold = [e for e in out["large"] if e["out_of_cache"]]
        out["large_min_out_of_cache"] = cold and min(cold, key=lambda e: e["ratio"])
    return out


def target_lines(checks):
    lines = []
    f = checks["foreach"]
    if f:
        ok = "met" if f["ratio"] >= 3 else "NOT met"
        lines.append(
            f"copy_runs vs `_foreach_copy_` at 100,000 x 4 KiB (want >= 3): pack "
            f"{f['ratio']:.2f}x ±{f['spread_pct']:.0f}% (unpack {f['unpack']:.2f}x): {ok}"
        )
    w = checks["large_min"]
    if w:
        ok = "met" if w["ratio"] >= 0.8 else "NOT met"
        line = (
            f"copy_runs vs one large contiguous copy, runs >= 64 KiB (want >= 0.8): worst of "
            f"{len(checks['large'])} ratios (pack and unpack) {w['ratio']:.2f} ({w['point']}): {ok}"
        )
        c = checks["large_min_out_of_cache"]
        if c:
            line += f"; worst out-of-cache point {c['ratio']:.2f} ({c['point']})"
        lines.append(line)
    return lines


def validation_times(rows=64_000, repeats=5):
    """Seconds of `rs_validate` (the C core's check of a whole table, overlap included, run
    before every copy) on tables of `rows` rows, each 8 runs of one float32 (2 MiB in all):
    sorted by dst; a transpose (every row's runs interleave with every other row's) in row
    order and in random order; and the transpose with every 7th row split in two rows of twice
    the stride. The median of `repeats` calls each, through ctypes on the loaded extension."""
    lib = ctypes.CDLL(_ops.library_path())
    lib.rs_validate.restype = ctypes.c_int
    lib.rs_validate.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
    lib.rs_validate.argtypes += [ctypes.c_uint, ctypes.c_void_p]
    err = ctypes.create_string_buffer(512)  # rs_error
    count = 8
    transpose = np.zeros((rows, 6), np.int64)
    transpose[:, 0] = np.arange(rows) * count
    transpose[:, 1] = 1
    transpose[:, 2] = np.arange(rows)
    transpose[:, 3] = rows
    transpose[:, 4] = 1
    transpose[:, 5] = count
    # every 7th row as two rows of twice the stride (its even and its odd runs): the same
    # elements, but the interleaved rows no longer share one stride
    split = transpose[::7].copy()
    split[:, 1] = 2
    split[:, 3] *= 2
    split[:, 5] //= 2
    odd = split.copy()
    odd[:, 0] += 1
    odd[:, 2] += rows
    keep = np.ones(rows, bool)
    keep[::7] = False
    two_strides = np.concatenate([transpose[keep], split, odd])
    sorted_rows = transpose.copy()  # the same runs, each row's 8 elements contiguous in dst
    sorted_rows[:, 2] = np.arange(rows) * count
    sorted_rows[:, 3] = 1
    tables = {
        "sorted by dst": sorted_rows,
        "transpose": transpose,
        "transpose, random row order": transpose[np.random.default_rng(0).permutation(rows)],
        "transpose + a second stride": two_strides,
    }
    out = {}
    for name, table in tables.items():
        table = np.ascontiguousarray(table, np.int64)
        dst_numel = int((table[:, 2] + (table[:, 5] - 1) * table[:, 3] + table[:, 4]).max())
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            status = lib.rs_validate(table.ctypes.data, len(table), rows * count, dst_numel, 1, err)
            times.append(time.perf_counter() - t0)
            assert status == 0, (name, err.raw[24:].split(b"\0")[0])
        out[name] = statistics.median(times)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a few points (about half a minute)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:n]")
    ap.add_argument("--min-time", type=float, default=None, help="seconds of repeats per point")
    ap.add_argument("--out", default=None, help="output directory")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    device = torch.device(args.device)
    min_time = args.min_time if args.min_time is not None else (0.3 if args.quick else 1.0)
    if args.quick:
        points = QUICK_POINTS
    else:
        points = [(b, c) for b in FULL_RUN_BYTES for c in FULL_COUNTS if b * c <= MAX_TOTAL_BYTES]
    env = environment(device)
    env["load_before"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    steal0, t_start = cpu_times(), time.perf_counter()
    print(
        f"device {device} ({env.get('gpu') or env['cpu']}), torch {env['torch']}, "
        f"{env['threads']} threads, load average {env['load_before']}",
        flush=True,
    )
    large = LargeCopy(device)
    results = []
    for i, (run_bytes, count) in enumerate(points):
        res = measure_point(run_bytes, count, device, min_time, large, env["llc_bytes"])
        results.append(res)
        g = res["gbps"]
        print(
            f"[{i + 1}/{len(points)} {time.perf_counter() - t_start:5.0f}s load "
            f"{os.getloadavg()[0]:.2f}] {fmt_bytes(run_bytes):>8} x {count:>9,}: "
            f"pack {g['pack/copy_runs']:6.2f} GB/s ±{res['spread_pct']['pack/copy_runs']:.0f}% "
            f"({res['repeats']} reps) "
            + " ".join(f"{k}={v:.2f}x" for k, v in res["ratio"].items()),
            flush=True,
        )
    steal1 = cpu_times()
    env["load_after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    env["wall_s"] = time.perf_counter() - t_start
    env["steal_pct"] = (
        100.0 * (steal1[0] - steal0[0]) / max(1, steal1[1] - steal0[1])
        if steal0 and steal1
        else 0.0
    )
    judged = [r for r in results if r["run_bytes"] >= LARGE_FROM_RUN_BYTES]
    env["large_copy"] = {}
    for name in large.fns if judged else ():
        samples = [LARGE_BYTES / s for r in judged for s in r["samples"][name]]
        env["large_copy"][name] = statistics.median(samples) / 1e9
    checks = targets(results)
    for line in target_lines(checks):
        print("target:", line)
    validation = validation_times()
    validation_md = "\nDescriptor validation (`rs_validate`), 64,000 rows of 8 runs:\n\n" + "".join(
        f"- {name}: {sec * 1e3:.1f} ms\n" for name, sec in validation.items()
    )
    print(validation_md.strip())

    out_dir = args.out or os.path.join(HERE, "results", device.type)
    stem = "kernels_quick" if args.quick else "kernels"
    for res in results:
        del res["samples"]
    C.write_results(
        os.path.join(out_dir, stem + ".json"),
        {"env": env, "results": results, "targets": checks, "validation_s": validation},
        lambda rec: markdown(rec["results"], rec["env"], rec["targets"]) + validation_md,
    )
    print(f"wrote {out_dir}/{stem}.json and .md")


if __name__ == "__main__":
    main()
