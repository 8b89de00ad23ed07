"""Planning benchmark: time and memory of `reshard.plan` on model-shaped layouts.

    python benchmarks/planning.py            # full run: 70B dense, 1T MoE, scaling sweeps
    python benchmarks/planning.py --quick    # small sweep only

Writes benchmarks/results/cpu/planning.{json,md,png}. Memory is the peak of tracemalloc
(numpy reports its buffers to it) during `plan()`, plus the process RSS for reference.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import subprocess
import sys
import time
import tracemalloc

import numpy as np
import psutil
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402

import reshard as rs  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "cpu")


def zero3(shapes, world, dtype=torch.float32):
    """DeepSpeed ZeRO-3 style: each tensor padded to a multiple of `world`, rank r holds
    partition r of every tensor, back to back in one flat buffer per rank."""
    tensors = {}
    used = np.zeros(world, np.int64)
    ranks = np.arange(world, dtype=np.int64)
    for name, shp in shapes.items():
        n = int(np.prod(shp))
        part = -(-n // world)
        lo = ranks * part
        hi = np.minimum(n, lo + part)
        keep = hi > lo
        runs = np.stack([ranks, lo, hi, used], axis=1)[keep]
        tensors[name] = rs.flat(shp, runs, name=name)
        used += part
    storages = {r: rs.Storage(r, dtype, int(used[r])) for r in range(world)}
    return rs.Layout(tensors, storages)


def tp_layout(shapes, spec, groups, tp, dtype=torch.bfloat16):
    """Rollout engine: `groups` replicas (or EP groups) of TP=`tp`; rank = group*tp + t.

    spec[name] = (dim or None, group list): split `dim` over the tp ranks of each listed
    group (None: replicated on those ranks). One flat buffer per rank, shards back to back.
    """
    world = groups * tp
    used = [0] * world
    tensors = {}
    for name, shp in shapes.items():
        dim, gl = spec[name]
        if dim is None:
            locs = [g * tp + t for g in gl for t in range(tp)]
            n = int(np.prod(shp))
            offs = [used[r] for r in locs]
            for r in locs:
                used[r] += n
            # one block replicated on every rank (same pieces as one Piece per rank)
            tensors[name] = rs.split(shp, 0, [shp[0]], [locs], offsets=[offs], name=name)
            continue
        base, rem = divmod(shp[dim], tp)
        sizes = [base + (t < rem) for t in range(tp)]
        locs, offs = [], []
        for t in range(tp):
            ranks = [g * tp + t for g in gl]
            locs.append(ranks)
            offs.append([used[r] for r in ranks])
            numel = int(np.prod(shp)) // shp[dim] * sizes[t]
            for r in ranks:
                used[r] += numel
        tensors[name] = rs.split(shp, dim, sizes, locs, offsets=offs, name=name)
    storages = {r: rs.Storage(r, dtype, used[r]) for r in range(world)}
    return rs.Layout(tensors, storages)


def dense_shapes(layers=80, hidden=8192, ffn=28672, kv=1024, vocab=128256):
    shapes = {"embed": (vocab, hidden)}
    spec = {"embed": 0}
    for i in range(layers):
        p = f"layers.{i}."
        for n, s, d in (
            ("q", (hidden, hidden), 0),
            ("k", (kv, hidden), 0),
            ("v", (kv, hidden), 0),
            ("o", (hidden, hidden), 1),
            ("gate", (ffn, hidden), 0),
            ("up", (ffn, hidden), 0),
            ("down", (hidden, ffn), 1),
            ("in_norm", (hidden,), None),
            ("post_norm", (hidden,), None),
        ):
            shapes[p + n] = s
            spec[p + n] = d
    shapes["norm"] = (hidden,)
    spec["norm"] = None
    shapes["lm_head"] = (vocab, hidden)
    spec["lm_head"] = 0
    return shapes, spec


def dense_case(layers=80, src_ranks=64, tp=8, dp=8):
    shapes, spec = dense_shapes(layers)
    t0 = time.perf_counter()
    src = zero3(shapes, src_ranks)
    dst = tp_layout(shapes, {k: (d, list(range(dp))) for k, d in spec.items()}, dp, tp)
    return src, dst, time.perf_counter() - t0


def moe_shapes(layers=61, experts=384, hidden=7168, moe_ffn=2048, dense_ffn=18432, vocab=163840):
    """Kimi-K2/DeepSeek-V3-like: MLA attention, 1 dense layer, then MoE layers."""
    shapes, spec = {"embed": (vocab, hidden)}, {"embed": (0, "all")}
    for i in range(layers):
        p = f"layers.{i}."
        attn = (
            ("q_a", (1536, hidden), 0),
            ("q_b", (12288, 1536), 0),
            ("kv_a", (576, hidden), None),
            ("kv_b", (16384, 512), 0),
            ("o", (hidden, 8192), 1),
            ("in_norm", (hidden,), None),
            ("post_norm", (hidden,), None),
            ("q_norm", (1536,), None),
            ("kv_norm", (512,), None),
        )
        for n, s, d in attn:
            shapes[p + n], spec[p + n] = s, (d, "all")
        if i == 0:
            for n, s, d in (
                ("gate", (dense_ffn, hidden), 0),
                ("up", (dense_ffn, hidden), 0),
                ("down", (hidden, dense_ffn), 1),
            ):
                shapes[p + n], spec[p + n] = s, (d, "all")
            continue
        shapes[p + "router"], spec[p + "router"] = (experts, hidden), (None, "all")
        for n, s, d in (
            ("gate", (moe_ffn, hidden), 0),
            ("up", (moe_ffn, hidden), 0),
            ("down", (hidden, moe_ffn), 1),
        ):
            shapes[p + "shared." + n], spec[p + "shared." + n] = s, (d, "all")
            for e in range(experts):
                shapes[f"{p}experts.{e}.{n}"] = s
                spec[f"{p}experts.{e}.{n}"] = (d, e)
    shapes["norm"], spec["norm"] = (hidden,), (None, "all")
    shapes["lm_head"], spec["lm_head"] = (vocab, hidden), (0, "all")
    return shapes, spec


def moe_case(layers=61, experts=384, src_ranks=256, ep=32, tp=8):
    shapes, spec = moe_shapes(layers, experts)
    per_group = -(-experts // ep)
    full = {}
    for k, (d, g) in spec.items():
        full[k] = (d, list(range(ep)) if g == "all" else [g // per_group])
    t0 = time.perf_counter()
    src = zero3(shapes, src_ranks)
    dst = tp_layout(shapes, full, ep, tp)
    return src, dst, time.perf_counter() - t0


def busiest_rank(p, pair_bytes):
    """The rank that moves the most bytes (sent + received + copied locally)."""
    load = dict(p.local_bytes())
    for (s, r), b in pair_bytes.items():
        load[s] = load.get(s, 0) + b
        load[r] = load.get(r, 0) + b
    return max(sorted(load), key=lambda r: load[r]) if load else 0


def schedule_runs(sc):
    """Descriptor rows of one rank's schedule (local copies, sends, receives)."""
    n = sum(len(lc.desc) for lc in sc.local)
    for msgs in sc.sends + sc.recvs:
        n += sum(len(s.desc) for m in msgs for s in m.segments)
    return n


def measure(src, dst, budget=64 << 20, trace=False, materialize=False):
    """What one process of the job pays: `plan()` (every rank runs it), then
    `schedule(rank)` for the busiest rank. Timed untraced; with `trace`, once more under
    tracemalloc (numpy reports its buffers to it; it slows allocation, so not timed) for
    the peak and retained memory of each step. `materialize`: also build every rank's runs
    (`plan.runs`: what materializing every rank's runs would cost) for reference."""
    gc.collect()
    rss0 = psutil.Process().memory_info().rss
    t0 = time.perf_counter()
    p = rs.plan(src, dst, budget_bytes_per_peer=budget)
    t_plan = time.perf_counter() - t0
    pair_bytes = p.pair_bytes()
    busiest = busiest_rank(p, pair_bytes)
    t0 = time.perf_counter()
    sc = p.schedule(busiest)
    t_sched = time.perf_counter() - t0
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    sent = {}
    for (s, _r), b in pair_bytes.items():
        sent[s] = sent.get(s, 0) + b
    out = {
        "plan_s": round(t_plan, 3),
        "busiest_rank": busiest,
        "schedule_busiest_s": round(t_sched, 3),
        "plan_plus_schedule_s": round(t_plan + t_sched, 3),
        "schedule_busiest_runs": schedule_runs(sc),
        "rss_before_plan_bytes": rss0,
        "peak_rss_bytes": maxrss,
        "tensors": len(dst.tensors),
        "src_pieces": sum(len(t) for t in src.tensors.values()),
        "dst_pieces": sum(len(t) for t in dst.tensors.values()),
        "jobs": p.num_jobs,
        "storage_pairs": p.num_storage_pairs,
        "rounds": p.num_rounds,
        "remote_wire_bytes": sum(sent.values()),
        "max_sender_bytes": max(sent.values()) if sent else 0,
        "senders": len(sent),
        "staging_busiest_nccl": p.staging_bytes(busiest),
        "fingerprint": p.fingerprint[:16],
    }
    if materialize:
        t0 = time.perf_counter()
        out["runs"] = len(p.runs)
        out["materialize_all_ranks_s"] = round(time.perf_counter() - t0, 3)
    del p, sc
    if trace:
        gc.collect()
        tracemalloc.start()
        p = rs.plan(src, dst, budget_bytes_per_peer=budget)
        cur, peak = tracemalloc.get_traced_memory()
        out["plan_peak_tracemalloc_bytes"] = int(peak)
        out["plan_retained_tracemalloc_bytes"] = int(cur)
        tracemalloc.reset_peak()
        p.schedule(busiest)
        cur2, peak = tracemalloc.get_traced_memory()
        out["schedule_peak_tracemalloc_bytes"] = int(peak - cur)
        out["schedule_retained_tracemalloc_bytes"] = int(cur2 - cur)
        tracemalloc.stop()
    return out


def run_case(kind, layers, src_ranks, tp, dp, trace, materialize):
    """One case in this process (called in a fresh subprocess, so peak RSS is its own)."""
    if kind == "dense":
        src, dst, tb = dense_case(layers, src_ranks, tp, dp)
    else:
        src, dst, tb = moe_case(layers, src_ranks=src_ranks, ep=dp, tp=tp)
    m = measure(src, dst, trace=trace, materialize=materialize)
    m.update(
        kind=kind,
        layers=layers,
        src_ranks=src_ranks,
        tp=tp,
        dp_or_ep=dp,
        build_layouts_s=round(tb, 3),
    )
    return m


def sub(kind, layers, src_ranks, tp, dp, trace=False, materialize=False, env=None):
    cmd = [sys.executable, os.path.abspath(__file__), "--case", kind]
    cmd += [str(layers), str(src_ranks), str(tp), str(dp)]
    cmd += ["--trace"] if trace else []
    cmd += ["--materialize"] if materialize else []
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if out.returncode:
        return {"kind": kind, "layers": layers, "error": out.stderr[-2000:]}
    m = json.loads(out.stdout.strip().splitlines()[-1])
    print(
        kind,
        layers,
        src_ranks,
        f"{tp}x{dp}",
        "plan",
        m["plan_s"],
        "s, schedule(busiest)",
        m["schedule_busiest_s"],
        "s, peak RSS",
        m["peak_rss_bytes"] >> 20,
        "MiB",
        flush=True,
    )
    return m


# glibc returns big freed blocks to the OS, so every large numpy temporary is fresh,
# page-faulting memory; these settings keep it in the heap (a deployment knob, not ours).
TUNED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(1 << 32), "MALLOC_TRIM_THRESHOLD_": str(1 << 33)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--case", nargs=5)
    ap.add_argument("--trace", action="store_true")
    ap.add_argument("--materialize", action="store_true")
    ap.add_argument("--moe-layers", type=int, nargs="*", default=[2, 4, 8, 16, 61])
    ap.add_argument("--from-json", default=None, help="re-render PATH's .md and .png only")
    args = ap.parse_args()
    if args.from_json:
        with open(args.from_json) as f:
            C.write_results(args.from_json, json.load(f), markdown, plot)
        return
    if args.case:
        # a shared machine: fail with MemoryError rather than invite the OOM killer
        cap = int(os.environ.get("PLANNING_BENCH_MAX_GIB", "14")) << 30
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
        kind, *nums = args.case
        nums = map(int, nums)
        print(json.dumps(run_case(kind, *nums, trace=args.trace, materialize=args.materialize)))
        return
    os.makedirs(OUT, exist_ok=True)
    res = {
        "machine": {
            "python": sys.version.split()[0],
            "numpy": np.__version__,
            "torch": torch.__version__,
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "loadavg_at_start": os.getloadavg(),
        }
    }
    if not args.quick:
        res["dense70b"] = sub("dense", 80, 64, 8, 8, trace=True, materialize=True)
        res["dense70b_tuned_malloc"] = sub("dense", 80, 64, 8, 8, env=TUNED_MALLOC)
        # every rank's runs of the MoE shape (256 schedules) only where that stays cheap
        res["moe1t_layers"] = [
            sub("moe", n, 256, 8, 32, trace=True, materialize=n <= 2, env=TUNED_MALLOC)
            for n in args.moe_layers
        ]
    layers_sweep = [2, 5, 10] if args.quick else [5, 10, 20, 40, 80]
    res["sweep_layers"] = [sub("dense", n, 64, 8, 8, materialize=True) for n in layers_sweep]
    ranks_sweep = [(8, 2, 4), (16, 4, 4), (32, 8, 4), (64, 8, 8)]
    if not args.quick:
        ranks_sweep += [(128, 8, 16), (256, 8, 32)]
    res["sweep_ranks"] = [
        sub("dense", 10, w, tp, dp, materialize=True) for w, tp, dp in ranks_sweep
    ]
    res["machine"]["loadavg_at_end"] = os.getloadavg()
    suffix = "_quick" if args.quick else ""
    C.write_results(os.path.join(OUT, f"planning{suffix}.json"), res, markdown, plot)


def markdown(res):
    mib = 1 << 20

    def cell(m, key, scale=1):
        v = m.get(key)
        return "" if v is None else v // scale if scale > 1 else v

    lines = [
        "# reshard planning benchmark (CPU)",
        "",
        f"machine: {res['machine']}",
        "",
        "Wall seconds on a shared 2-core box. `plan` is `rs.plan()` (every rank runs it);",
        "`schedule` is `plan.schedule(rank)` for the busiest rank (most bytes sent + received",
        "+ copied): together, what one process of the job pays. `all ranks' runs` builds the",
        "runs of every rank, one rank at a time (`plan.runs`), for reference: what a planner",
        "that materialized every rank's runs in every rank's `plan()` would pay.",
        "Peak RSS is the whole process (layouts included); tracemalloc peaks are of the step",
        "alone. `tuned malloc` = glibc MALLOC_MMAP/TRIM thresholds raised (see planning.py).",
        "",
        "| case | layers | tensors | src pieces | jobs | storage pairs | rounds | plan s |"
        " schedule s | plan + schedule s | busiest rank's runs | all ranks' runs (s) |"
        " peak RSS MiB | plan peak MiB | schedule peak MiB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    rows = []
    for key in ("dense70b", "dense70b_tuned_malloc"):
        if key in res:
            rows.append((key, res[key]))
    for m in res.get("moe1t_layers", []):
        rows.append(("moe1t (tuned malloc)", m))
    for key, m in rows:
        if "error" in m:
            lines.append(f"| {key} | {m['layers']} | error: {m['error'][-200:]!r} |")
            continue
        allr = f"{m['runs']} ({m['materialize_all_ranks_s']})" if "runs" in m else ""
        lines.append(
            f"| {key} | {m['layers']} | {m['tensors']} | {m['src_pieces']} | {m['jobs']} | "
            f"{m['storage_pairs']} | {m['rounds']} | {m['plan_s']} | "
            f"{m['schedule_busiest_s']} | {m['plan_plus_schedule_s']} | "
            f"{m['schedule_busiest_runs']} | {allr} | {m['peak_rss_bytes'] // mib} | "
            f"{cell(m, 'plan_peak_tracemalloc_bytes', mib)} | "
            f"{cell(m, 'schedule_peak_tracemalloc_bytes', mib)} |"
        )
    for title, key, first in (
        ("layers (ZeRO-3 x64 -> TP8 x DP8)", "sweep_layers", "layers"),
        ("src ranks (10 dense layers)", "sweep_ranks", "src_ranks"),
    ):
        lines += [
            "",
            f"| {title} | tensors | plan s | schedule s | all ranks' runs | all ranks' runs s |"
            " peak RSS MiB |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for m in res[key]:
            if "error" not in m:
                lines.append(
                    f"| {m[first]} | {m['tensors']} | {m['plan_s']} | "
                    f"{m['schedule_busiest_s']} | {m['runs']} | "
                    f"{m['materialize_all_ranks_s']} | {m['peak_rss_bytes'] // mib} |"
                )
    return "\n".join(lines) + "\n"


def plot(stem, res):
    plt = C.pyplot()
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    panels = (
        ("sweep_layers", "tensors", "tensors (dense, ZeRO-3 x64 -> TP8 x DP8)"),
        ("sweep_ranks", "src_ranks", "ranks (10 dense layers)"),
    )
    for a, (key, x, label) in zip(ax, panels):
        ms = [m for m in res[key] if "error" not in m]
        xs = [m[x] for m in ms]
        a.plot(xs, [m["plan_s"] for m in ms], "o-", label="plan()")
        a.plot(xs, [m["schedule_busiest_s"] for m in ms], "s-", label="schedule(busiest rank)")
        a.plot(
            xs, [m["materialize_all_ranks_s"] for m in ms], "^--", label="every rank's runs (ref.)"
        )
        a.set_xlabel(label)
        a.set_ylabel("seconds")
        a.grid(True, alpha=0.3)
        a.legend()
    fig.tight_layout()
    fig.savefig(stem + ".png", dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
