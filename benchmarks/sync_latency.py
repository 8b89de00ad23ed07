"""Repeated-sync benchmark: reshard vs what people do today, measured in the same run.

Scenarios (benchmarks/_scenarios.py, on the shared geometry of reshard.scenarios; synthetic
sharded state with DeepSpeed's layouts):
- rl_weight_sync: ZeRO-3 bf16 param shards -> TP=2 bf16 rollout buffers (fused QKV,
  row/column splits, replicated norms).
- offload_fp32 / offload_bf16 / offload_back: CPU-offloaded fp32 master + exp_avg + exp_avg_sq
  -> device-side partitions (fp32 or bf16 targets; bf16 travels as bf16) and back. With
  --world 1 and --device cuda: CPU -> GPU in one process. With --world N > 1 on a CPU-only box,
  "device" is the next rank: every byte crosses the transport.
- dp_change: fp32 master + Adam moments, ZeRO-3 partitions DP=W -> ZeRO-1/2 flat DP=W-1.
- lora_sync (tiny syncs): LoRA adapters, a few MB in hundreds of tensors, ZeRO-3 shards -> TP
  rollout buffers; its own models (gpt-125m, gpt-350m adapters) unless --models names some.
  The "Tiny syncs" table gives the fixed cost per sync next to the per-tensor baselines.
- rollout_stream / rollout_tp / stream_offload (on request, --scenarios; docs/rollout.md):
  full tensors by name to rank 0 through an rs.Stream (against per-parameter gathers and the
  whole-model gather); vLLM's TP layout through tp_layout (against stream_then_shard); with
  --world 1 --device cuda, CPU fp32 masters streamed as bf16 into GPU tensors.
- fsdp_weight_sync: FSDP2 fp32 sharded params (DTensors, Shard(0), torch.chunk rows) -> TP=2
  bf16 rollout buffers; reshard reads them through reshard.integrations.dtensor.
- fsdp_resize: FSDP2 params + both Adam moments, DP=W -> DP=W-1 (DTensors on a sub-mesh).
- fsdp_offload: FSDP2 CPU-offloaded params + moments -> fp32 device-side partitions.
  The FSDP2 scenarios' sources are CPU DTensors. With --world 1 fsdp_offload and
  fsdp_weight_sync run by default (after the others); on the CPU with --world > 1 name them:
  `--scenarios fsdp_weight_sync,fsdp_resize`.

Methods (benchmarks/_baselines.py; same run, each checked bitwise against an independent
reference after its syncs): reshard (one `Transfer` reused), reshard_registered (CUDA),
gather_broadcast and full_gather (world > 1), to_device (one process); for the FSDP2
scenarios full_tensor (`DTensor.full_tensor()` then slice) and, for fsdp_resize, dcp
(torch.distributed.checkpoint save + load with resharding, through a temporary directory).

Metrics per (scenario, model, method): median / p90 / p10 of >= --iters syncs after warm-up
(per sync, the slowest rank's time; with --world > 1 the methods' timed syncs are interleaved,
one sync of each in turn, so a load burst on a shared machine hits every method alike); the
first sync on its own (`first ms`: for reshard the Transfer's construction, planning included,
its tables, arenas and host registration, plus the sync), in every table; peak extra memory
(measured per method alone, before the timed syncs; host: RSS delta per rank sampled by a
thread during extra syncs, and the bytes the method holds by its own account, max of both;
device: max_memory_allocated delta), pinned bytes, bytes moved over the transport, GB/s of the
payload, the physical floor (max of wire bytes / link bandwidth and local bytes / copy
bandwidth on the slowest rank; PCIe bytes / pinned PCIe bandwidth for CPU<->GPU; bandwidths
measured in the same run, best of 7) and ratios to reshard.

    python benchmarks/sync_latency.py --quick --json benchmarks/results/cpu/sync_latency_quick.json
    python benchmarks/sync_latency.py --world 1 --device cuda --json out/sync_latency.json \\
        --scenarios offload_fp32,offload_bf16,offload_back --models gpt-125m,gpt-350m
    python benchmarks/sync_latency.py --budgets-kib 256,512,1280,4096,16384 \\
        --json benchmarks/results/cpu/sync_latency_budget.json     # reshard alone per budget
    python benchmarks/sync_latency.py --from-json benchmarks/results/cpu/sync_latency_quick.json

--json PATH also writes PATH with .md (tables) and _latency.png / _memory.png (plots);
--from-json re-renders those from a results file. On the CPU a (scenario, model) whose buffers
would not fit in the host's available memory is skipped, and the tables say so.

Adding a case:
- a scenario: a function `(model, rank, world, device) -> Case` in `_scenarios.SCENARIOS`
  (sides from reshard.scenarios, or a new `Side` with `layout()` and a plain-torch `write()`),
  then its name in MULTI_SCENARIOS / SINGLE_SCENARIOS here if it runs by default, and in
  `_scenarios.SCENARIO_MODELS` if it has its own model sizes;
- a method (a baseline): `make(case, ctx) -> (step, info)` in `_baselines.METHODS` and its
  name in `_baselines.methods_for` where it applies; a row, the ratio columns and the
  correctness check come with it.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import math
import os
import re
import statistics
import sys
import threading
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _baselines as B  # noqa: E402
import _common as C  # noqa: E402
import _scenarios as S  # noqa: E402

import reshard as rs  # noqa: E402
from reshard._launch import RanksFailed, launch  # noqa: E402

QUICK_MODELS = ("gpt-micro", "gpt-mini")
FULL_MODELS = ("gpt-nano", "gpt-micro", "gpt-mini", "gpt-small", "gpt-125m")
MULTI_SCENARIOS = (
    "rl_weight_sync",
    "offload_fp32",
    "offload_bf16",
    "offload_back",
    "dp_change",
    "lora_sync",
)
TINY_SCENARIOS = ("lora_sync",)
SINGLE_SCENARIOS = (
    "offload_fp32",
    "offload_bf16",
    "offload_back",
    "fsdp_offload",
    "fsdp_weight_sync",
)
MiB, GiB = C.MiB, C.GiB
progress = C.progress_logger("sync_latency")


# ------------------------------------------------------------------ memory


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) << 10
    return 0


_PROCESS_BYTES = 1 << 29  # torch, the extension and Python per rank, roughly
_nano_bytes: dict = {}


def host_bytes_needed(scen, model, world, n_methods):
    """Host bytes a CPU case holds at its peak over all ranks (they share this machine): the
    sources, the reference and one target set per method (the interleaved timing keeps them
    all), plus each process. Scaled by parameter count from gpt-nano's storages."""
    if scen not in _nano_bytes:
        nano = S.SCENARIOS[scen]("gpt-nano", 0, world, "cpu")
        _nano_bytes[scen] = tuple(
            sum(st.numel * st.dtype.itemsize for st in layout.storages.values())
            for layout in (nano.src_layout, nano.dst_layout)
        )
    src, dst = _nano_bytes[scen]
    scale = S.model_params(model) / S.model_params("gpt-nano")
    return int(scale * (src + (n_methods + 1) * dst) + world * _PROCESS_BYTES)


_libc = None


def _trim():
    """Give freed heap back to the OS so one method's garbage is not another's headroom."""
    global _libc
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        _libc = _libc or ctypes.CDLL("libc.so.6")
        _libc.malloc_trim(0)


class RssSampler:
    """Max RSS seen by one thread polling /proc/self/statm every 0.5 ms while a window is open
    (only around the memory syncs, never the timed ones). The thread is started once, before
    any baseline RSS is read, so its own stack and malloc arena are not charged to a method."""

    def __init__(self):
        self.peak = 0
        self._on = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self):
        while True:
            self._on.wait()
            self.peak = max(self.peak, _rss())
            time.sleep(0.0005)

    @contextlib.contextmanager
    def window(self):
        self.peak = _rss()
        self._on.set()
        try:
            yield self
        finally:
            self._on.clear()
            time.sleep(0.002)  # let a sample in progress land
            self.peak = max(self.peak, _rss())


def link_bandwidth(rank, world, cuda):
    """Bytes/s of the transports, measured here: gloo send/recv between ranks 0 and 1 (both
    directions at once, per direction), host copy (bytes copied / s), pinned H2D / D2H. Best
    of several repeats: a floor is what the hardware can do, not what a busy moment allowed."""
    out = {}
    n = 64 * MiB
    a, b = torch.ones(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
    ts = []
    for _ in range(7):
        t = time.perf_counter()
        b.copy_(a)
        ts.append(time.perf_counter() - t)
    out["host_copy_Bps"] = n / min(ts)
    if world > 1:
        ts = []
        for _ in range(7):
            dist.barrier()
            t = time.perf_counter()
            if rank < 2:
                peer = 1 - rank
                ops = [dist.P2POp(dist.isend, a, peer), dist.P2POp(dist.irecv, b, peer)]
                for w in dist.batch_isend_irecv(ops):
                    w.wait()
            ts.append(time.perf_counter() - t)
        out["gloo_p2p_Bps"] = n / min(ts)
    if cuda:
        pinned = torch.ones(256 * MiB, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty_like(pinned, device="cuda")
        for key, fn in (
            ("pinned_h2d_Bps", lambda: dev.copy_(pinned, non_blocking=True)),
            ("pinned_d2h_Bps", lambda: pinned.copy_(dev, non_blocking=True)),
        ):
            fn()
            torch.cuda.synchronize()
            ts = []
            for _ in range(10):
                t = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                ts.append(time.perf_counter() - t)
            out[key] = pinned.numel() / min(ts)
        del pinned, dev
    return out


def interleaved_times(case, methods, ctx):
    """Timed syncs of every method in turn (m0, m1, m2, m0, m1, ...), each method on its own
    targets after its warm-up: a burst of load on a shared machine then hits every method
    alike, so the ratios compare like with like. Returns ({method: [seconds]}, {method:
    targets correct})."""
    world, cuda = ctx["world"], ctx["cuda"]
    steps, bufs = {}, {}
    for m in methods:
        bufs[m] = case.targets()
        steps[m], _ = B.METHODS[m](case, ctx)
        for _ in range(ctx["warmup"]):
            steps[m](bufs[m])
    times = {m: [] for m in methods}
    for _ in range(ctx["iters"]):
        for m in methods:
            times[m].append(C.timed_sync(steps[m], bufs[m], world, cuda)[0])
    correct = {m: B.targets_correct(case, bufs[m]) for m in methods}
    for step in steps.values():
        B.close(step)
    del steps, bufs
    _trim()
    return times, correct


def measure_method(case, method, ctx, timed=True):
    """One method alone: first sync, warm-up, timed syncs (unless `timed` is False: the
    interleaved timing then follows), the memory syncs and the correctness check."""
    world, cuda = ctx["world"], ctx["cuda"]
    bufs = case.targets()
    _trim()
    C.fence(1, cuda)
    base_rss = _rss()
    if cuda:
        base_dev = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    ctx.pop("plan_s", None)
    C.fence(world, False)
    t0 = time.perf_counter()
    step, info = B.METHODS[method](case, ctx)
    step(bufs)
    C.fence(world, cuda)
    first = time.perf_counter() - t0
    for _ in range(max(0, ctx["warmup"] - 1)):
        step(bufs)
    times = [C.timed_sync(step, bufs, world, cuda)[0] for _ in range(ctx["iters"] if timed else 0)]
    with ctx["sampler"].window() as sampler:
        for _ in range(3):
            step(bufs)
            C.fence(1, cuda)
    out = {
        "times": times,
        "first_sync_s": first,
        "plan_s": ctx.get("plan_s"),
        "rss_extra_bytes": max(0, sampler.peak - base_rss),
        "device_extra_bytes": (torch.cuda.max_memory_allocated() - base_dev) if cuda else 0,
        "correct": B.targets_correct(case, bufs),
        **info(),
    }
    B.close(step)
    del step, info, bufs
    _trim()
    return out


def _case_methods(cfg, world, scenario):
    """The run's methods that apply to `scenario`."""
    applies = B.methods_for(world, cfg["device"], scenario)
    if cfg.get("stream_before") and scenario in ("rollout_stream", "stream_offload"):
        applies = [applies[0], "stream_before", *applies[1:]]
    return [m for m in cfg["methods"] if m in applies]


def run_cases(rank, world, cfg, sink):
    """Every (scenario, model, method) in order; sink(results so far) after each case."""
    cuda = cfg["device"] == "cuda"
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    ctx = {
        "world": world,
        "cuda": cuda,
        "budget": cfg["budget"],
        "iters": cfg["iters"],
        "warmup": cfg["warmup"],
        "sampler": RssSampler(),
        "stream_before": cfg.get("stream_before"),
    }
    out = {"rank": rank, "links": link_bandwidth(rank, world, cuda), "cases": []}
    # One-time process costs (loading the extension, lazy imports, first use of each
    # collective, the CUDA context) are paid here, not charged to whichever method runs first.
    scen0 = cfg["cases"][0][0]
    warm = S.SCENARIOS[scen0]("gpt-nano", rank, world, cfg["device"])
    for m in _case_methods(cfg, world, scen0):
        step, _ = B.METHODS[m](warm, ctx)
        step(warm.targets())
        B.close(step)
    del warm, step
    _trim()
    total = len(cfg["cases"])
    t_start = time.perf_counter()
    # scenario-major: under a time budget the first scenario gets every model size
    for i, (scen, model) in enumerate(cfg["cases"], 1):
        over = cfg["time_budget"] and time.perf_counter() - t_start > cfg["time_budget"]
        # rank 0 decides (broadcast below): the ranks share this machine's memory
        need = 0 if cuda or rank else host_bytes_needed(scen, model, world, len(cfg["methods"]))
        avail = _mem_available()
        nofit = need > 0.9 * avail
        if world > 1:  # every rank must agree to stop at (or skip) the same case
            flag = torch.tensor([int(bool(over)), int(nofit)])
            dist.broadcast(flag, src=0)
            over, nofit = bool(flag[0]), bool(flag[1])
        if nofit:
            if rank == 0:
                progress(
                    f"[{i}/{total}] {scen} {model}: skipped, needs ~{need / GiB:.1f} GiB of "
                    f"host memory, {avail / GiB:.1f} GiB available"
                )
            out.setdefault("unfit", []).append(
                {"scenario": scen, "model": model, "need_bytes": need, "avail_bytes": avail}
            )
            sink(out)
            continue
        if over:
            if rank == 0:
                progress(f"time budget {cfg['time_budget']} s spent: skipping the rest")
            out["skipped_after"] = f"{scen} {model}"
            sink(out)
            return out
        t_case = time.perf_counter()
        case = S.SCENARIOS[scen](model, rank, world, cfg["device"])
        build_s = time.perf_counter() - t_case
        rec = {
            "scenario": scen,
            "model": model,
            "params": case.params,
            "description": case.description,
            "payload_bytes": case.payload_bytes,
            "tensors": len(case.names),
            "build_s": build_s,
            "methods": {},
        }
        # memory (and the first sync) per method alone, as if it ran by itself; then the
        # timed syncs, interleaved over the methods where cfg["interleave"]
        methods = _case_methods(cfg, world, scen)
        for m in methods:
            if rank == 0:
                progress(f"[{i}/{total}] {scen} {model} ({case.params / 1e6:.1f}M) {m} ...")
            rec["methods"][m] = measure_method(case, m, ctx, timed=not cfg["interleave"])
        if cfg["interleave"]:
            if rank == 0:
                progress(f"[{i}/{total}] {scen} {model}: timed syncs, methods interleaved")
            times, correct = interleaved_times(case, methods, ctx)
            for m, r in rec["methods"].items():
                r["times"] = times[m]
                r["correct"] = r["correct"] and correct[m]
        for m, r in rec["methods"].items():
            if rank == 0:
                med = statistics.median(r["times"])
                progress(
                    f"[{i}/{total}] {scen} {model} {m}: median {med * 1e3:.2f} ms, "
                    f"extra {max(r['rss_extra_bytes'], r['accounted_extra_bytes']) / MiB:.1f}"
                    f" MiB, correct {r['correct']}"
                )
        out["cases"].append(rec)
        del case
        _trim()
        sink(out)
    return out


# ------------------------------------------------------------------ aggregation


def aggregate(per_rank, meta):
    """Per-rank raw records -> the result rows (one per scenario, model, method)."""
    links = per_rank[0]["links"]
    rows = []
    n_cases = min(len(x["cases"]) for x in per_rank)
    for ci in range(n_cases):
        recs = [x["cases"][ci] for x in per_rank]
        rec0 = recs[0]
        floor = None
        if "reshard" in rec0["methods"]:
            terms = []
            for rec in recs:
                r = rec["methods"]["reshard"]
                if meta["device"] == "cuda":
                    back = rec0["scenario"] == "offload_back"
                    bw = links["pinned_d2h_Bps" if back else "pinned_h2d_Bps"]
                    terms.append(r["local_bytes"] / bw)
                else:
                    # local copies run while round 0 is in flight: they overlap the wire
                    wire = r["recv_bytes"] / links["gloo_p2p_Bps"] if meta["world"] > 1 else 0
                    terms.append(max(wire, r["local_bytes"] / links["host_copy_Bps"]))
            floor = max(terms)
        base = None
        for m in rec0["methods"]:
            per = [rec["methods"][m] for rec in recs]
            iters = min(len(p["times"]) for p in per)
            # one sync's latency is its slowest rank's
            times = sorted(max(p["times"][k] for p in per) for k in range(iters))
            med = statistics.median(times)
            p90 = times[min(iters - 1, math.ceil(0.9 * iters) - 1)]
            p10 = times[max(0, math.ceil(0.1 * iters) - 1)]
            host_extra = max(max(p["rss_extra_bytes"], p["accounted_extra_bytes"]) for p in per)
            dev_extra = max(p["device_extra_bytes"] for p in per)
            peak = dev_extra if meta["device"] == "cuda" else host_extra
            row = {
                "scenario": rec0["scenario"],
                "method": m,
                "model": rec0["model"],
                "world": meta["world"],
                "median_s": med,
                "p90_s": p90,
                "peak_extra_bytes": peak,
                "bytes_moved": sum(p["recv_bytes"] for p in per),
                "params": rec0["params"],
                "payload_bytes": rec0["payload_bytes"],
                "tensors": rec0.get("tensors"),
                "p10_s": p10,
                "spread": (p90 - p10) / med if med > 0 else 0.0,
                "iters": iters,
                "gbps": rec0["payload_bytes"] / med / 1e9 if med > 0 else 0.0,
                "host_extra_bytes": host_extra,
                "rss_extra_bytes": max(p["rss_extra_bytes"] for p in per),
                "accounted_extra_bytes": max(p["accounted_extra_bytes"] for p in per),
                "device_extra_bytes": dev_extra,
                "pinned_bytes": max(p["pinned_bytes"] for p in per),
                "max_rank_recv_bytes": max(p["recv_bytes"] for p in per),
                "first_sync_s": max(p["first_sync_s"] for p in per),
                "floor_s": floor,
                "vs_floor": med / floor if floor else None,
                "correct": all(p["correct"] for p in per),
                "source": "synthetic",
                "description": rec0["description"],
            }
            if m.startswith("reshard"):
                row["plan_s"] = max(p["plan_s"] or 0.0 for p in per)
                row["staging_bound"] = per[0].get("staging_bound")
                row["rounds"] = per[0].get("rounds")
                row["budget_bytes_per_peer"] = per[0].get("budget_bytes_per_peer")
                row["zero_copy_bytes"] = sum(p.get("zero_copy_bytes", 0) for p in per)
                row["phases_s"] = per[0].get("seconds")
                row["registered_bytes"] = max(p.get("registered_bytes", 0) for p in per)
                row["host_registration_s"] = max(p.get("host_registration_s", 0.0) for p in per)
                row["local_h2d"] = per[0].get("local_h2d")
            if m == "reshard":
                base = row
            rows.append(row)
        for row in rows[-len(rec0["methods"]) :]:
            if base:
                row["median_vs_reshard"] = row["median_s"] / base["median_s"]
                row["peak_extra_vs_reshard"] = row["peak_extra_bytes"] / max(
                    1, base["peak_extra_bytes"]
                )
    return rows


def write_outputs(path, meta, rows):
    C.write_results(
        path,
        {"meta": meta, "results": rows},
        lambda rec: markdown(rec["meta"], rec["results"]),
        lambda stem, rec: plot(stem, rec["meta"], rec["results"]),
    )


def _mib(b):
    return f"{b / MiB:.2f}"


def _mem_x(b, base):
    """Peak extra memory `b` of a method against reshard's row `base` (None: no reshard row): a
    ratio only where reshard's peak is at least 64 KiB (on the H200 reshard's staging exists
    before the timed syncs and its peak extra is a few KiB: a ratio over that says nothing)."""
    floor = 64 << 10
    if base is None:
        return "-"
    base = base["peak_extra_bytes"]
    if base >= floor:
        return f"{b / base:.2f}"
    return "both < 64 KiB" if b < floor else f"{b / MiB:.0f} MiB vs < 64 KiB"


def _kib(b):
    return f"{b >> 10}" if b else "-"


def _bound(r, meta):
    """reshard's stated staging bound on the side `peak extra` measures (device on CUDA)."""
    b = r.get("staging_bound")
    if not b:
        return "-"
    return _mib(b["device"] if meta["device"] == "cuda" else b["host"] + b["host_pinned"])


def markdown(meta, rows):
    lines = [
        f"# sync_latency: {meta['host']}, world {meta['world']}, {meta['transport']}",
        "",
        f"torch {meta['torch']}, python {meta['python']}, {meta['cpus']} CPUs, "
        f"load average at start {meta['loadavg']}, {meta['iters']} timed syncs after "
        f"{meta['warmup']} warm-up"
        + (
            " (interleaved: the methods take turns, one sync each, so load bursts hit all alike)"
            if meta.get("interleaved")
            else ""
        )
        + ", reshard budget per peer "
        + (
            f"{meta['budget_bytes_per_peer'] / MiB:g} MiB"
            if meta.get("budget_bytes_per_peer")
            else f"by rule: {meta['budget_rule']} (`budget` column)"
        )
        + ". Links measured in this run: "
        + ", ".join(f"{k[:-4]} {v / 1e9:.2f} GB/s" for k, v in meta["links"].items())
        + ".",
        "",
        "Per-sync latency of reshard excludes planning (one Transfer reused); its first sync "
        "(plan + staging allocation + sync) is the `first ms` column. State is synthetic with "
        "DeepSpeed's layouts. `peak extra` = "
        + (
            "max_memory_allocated delta on the device"
            if meta["device"] == "cuda"
            else "max over ranks of max(RSS delta, bytes held by the method's own account)"
        )
        + "; `bound` = reshard's stated staging bound (plan.staging_bytes); `zero-copy` = "
        "reshard's wire bytes that went straight from a source or into a target (no arena), "
        "counted on the sending and on the receiving rank (so up to 2x `moved`); `floor` = max(wire "
        "bytes / link, local bytes / copy bandwidth) on the slowest rank (PCIe bytes / pinned "
        "PCIe bandwidth for CPU<->GPU), bandwidths best-of-7 in this run.",
        "",
        f"Command: `{meta['command']}`",
        "",
    ]
    by_scen: dict = {}
    for r in rows:
        by_scen.setdefault(r["scenario"], []).append(r)
    reshard_rows = {(r["scenario"], r["model"]): r for r in rows if r["method"] == "reshard"}
    lines += goal_table(rows, reshard_rows)
    lines += tiny_table(rows, reshard_rows)
    if meta.get("unfit"):
        lines += [
            "Not run, would not fit in this machine's memory (estimate: sources + reference + "
            "one target set per method, over all ranks): "
            + "; ".join(
                f"{u['scenario']} {u['model']} needs ~{u['need_bytes'] / GiB:.1f} GiB, "
                f"{u['avail_bytes'] / GiB:.1f} GiB available"
                for u in meta["unfit"]
            )
            + ".",
            "",
        ]
    for scen, rs_ in by_scen.items():
        lines += [f"## {scen}", "", rs_[0]["description"], ""]
        lines += [
            "| model | params | method | median ms | p90 ms | spread | x reshard | first ms "
            "| peak extra MiB | x reshard | budget KiB | bound MiB | pinned MiB | moved MiB "
            "| zero-copy MiB | GB/s | floor ms | x floor | ok |",
            "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:"
            "|---:|---|",
        ]
        for r in rs_:
            lines.append(
                f"| {r['model']} | {r['params'] / 1e6:.1f}M | {r['method']} "
                f"| {r['median_s'] * 1e3:.2f} | {r['p90_s'] * 1e3:.2f} | {r['spread']:.2f} "
                f"| {r.get('median_vs_reshard', float('nan')):.2f} "
                f"| {r['first_sync_s'] * 1e3:.1f} "
                f"| {_mib(r['peak_extra_bytes'])} "
                f"| {_mem_x(r['peak_extra_bytes'], reshard_rows.get((r['scenario'], r['model'])))} "
                f"| {_kib(r.get('budget_bytes_per_peer'))} "
                f"| {_bound(r, meta)} | {_mib(r['pinned_bytes'])} | {_mib(r['bytes_moved'])} "
                f"| {_mib(r['zero_copy_bytes']) if 'zero_copy_bytes' in r else '-'} "
                f"| {r['gbps']:.2f} "
                f"| {(r['floor_s'] or 0) * 1e3:.2f} | {r['vs_floor'] or float('nan'):.2f} "
                f"| {'yes' if r['correct'] else 'NO'} |"
            )
        lines.append("")
    return "\n".join(lines) + "\n"


def goal_table(rows, reshard_rows):
    """Each baseline against reshard: latency and peak-extra-memory ratios, and reshard's
    first sync (plan, tables, arenas, registration) apart from its repeated ones."""
    out = [
        "## Baselines / reshard",
        "",
        "| scenario | model | method | latency x | memory x | reshard x floor "
        "| reshard first ms | reshard median ms |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        b = reshard_rows.get((r["scenario"], r["model"]))
        if b is None or r["method"] == "reshard":
            continue
        out.append(
            f"| {r['scenario']} | {r['model']} | {r['method']} "
            f"| {r['median_s'] / b['median_s']:.2f} "
            f"| {_mem_x(r['peak_extra_bytes'], b)} "
            f"| {b['vs_floor'] or float('nan'):.2f} "
            f"| {b['first_sync_s'] * 1e3:.1f} | {b['median_s'] * 1e3:.2f} |"
        )
    return [*out, ""]


def tiny_table(rows, reshard_rows):
    """Syncs of many small tensors, where a fixed cost per sync (reshard: one preflight
    exchange and the round protocol; a per-tensor baseline: collectives per tensor) dominates.
    `fixed ms` = median - floor: the time not spent moving bytes."""
    tiny = [r for r in rows if r["scenario"] in TINY_SCENARIOS]
    if not tiny:
        return []
    out = [
        "## Tiny syncs: fixed cost per sync",
        "",
        "| model | tensors | MB | method | median ms | per tensor us | fixed ms | preflight ms "
        "| x reshard | reshard first ms |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in tiny:
        b = reshard_rows.get((r["scenario"], r["model"]))
        floor = (b or {}).get("floor_s") or 0.0
        pre = (r.get("phases_s") or {}).get("preflight")
        out.append(
            f"| {r['model']} | {r['tensors']} | {r['payload_bytes'] / 1e6:.1f} | {r['method']} "
            f"| {r['median_s'] * 1e3:.2f} | {r['median_s'] / r['tensors'] * 1e6:.1f} "
            f"| {(r['median_s'] - floor) * 1e3:.2f} "
            f"| {'-' if pre is None else f'{pre * 1e3:.2f}'} "
            f"| {r['median_s'] / b['median_s'] if b else float('nan'):.2f} "
            f"| {b['first_sync_s'] * 1e3 if b else float('nan'):.1f} |"
        )
    return [*out, ""]


def plot(stem, meta, rows):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scens = list(dict.fromkeys(r["scenario"] for r in rows))
    for key, ylabel, suffix in (
        ("median_s", "median sync latency (s)", "_latency.png"),
        ("peak_extra_bytes", "peak extra memory (bytes)", "_memory.png"),
    ):
        ncol = min(3, len(scens))
        nrow = math.ceil(len(scens) / ncol)
        fig, axes = plt.subplots(nrow, ncol, figsize=(4.4 * ncol, 3.4 * nrow), squeeze=False)
        flat_axes = list(axes.flat)
        for ax in flat_axes[len(scens) :]:
            ax.set_visible(False)
        lo = 1 if key.endswith("bytes") else 1e-6  # log axes: keep zero-byte points visible
        for ax, scen in zip(flat_axes, scens, strict=False):
            for m in dict.fromkeys(r["method"] for r in rows if r["scenario"] == scen):
                pts = sorted(
                    (r["params"], max(r[key], lo))
                    for r in rows
                    if r["scenario"] == scen and r["method"] == m
                )
                ax.plot(*zip(*pts, strict=True), marker="o", label=m)
            if key == "median_s":
                pts = sorted(
                    (r["params"], r["floor_s"])
                    for r in rows
                    if r["scenario"] == scen and r["method"] == "reshard" and r["floor_s"]
                )
                if pts:
                    ax.plot(*zip(*pts, strict=True), "k--", label="floor")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_title(scen, fontsize=9)
            ax.set_xlabel("parameters")
            ax.set_ylabel(ylabel, fontsize=8)
            ax.grid(True, which="both", alpha=0.3)
        flat_axes[0].legend(fontsize=7)
        fig.suptitle(
            f"sync_latency, {meta['host']}, world {meta['world']}, {meta['transport']}",
            fontsize=9,
        )
        fig.tight_layout()
        fig.savefig(stem + suffix, dpi=110)
        plt.close(fig)


def summary_table(meta, rows):
    """One line per (scenario, model): reshard's median (p90) and first sync, each other
    method's median and its ratio to reshard, peak extra memory, and reshard's floor: the
    compact form docs/performance.md shows."""
    methods = list(dict.fromkeys(r["method"] for r in rows))
    others = [m for m in methods if m != "reshard"]
    by_case: dict = {}
    for r in rows:
        by_case.setdefault((r["scenario"], r["model"]), {})[r["method"]] = r
    head = ["scenario", "model", "params", "budget KiB", "reshard ms (p90)", "reshard first ms"]
    head += [f"{m} ms" for m in others] + [f"{m} / reshard" for m in others]
    head += ["reshard extra MiB (bound)"] + [f"{m} extra MiB" for m in others]
    head += ["floor ms", "reshard x floor", "ok"]
    out = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 3) + "---|"]
    for (scen, model), case in by_case.items():
        b = case.get("reshard")
        if b is None:
            continue
        cells = [scen, model, f"{b['params'] / 1e6:.1f}M", _kib(b.get("budget_bytes_per_peer"))]
        cells += [f"{b['median_s'] * 1e3:.2f} ({b['p90_s'] * 1e3:.2f})"]
        cells += [f"{b['first_sync_s'] * 1e3:.1f}"]
        cells += [f"{case[m]['median_s'] * 1e3:.2f}" if m in case else "-" for m in others]
        cells += [
            f"{case[m]['median_s'] / b['median_s']:.2f}" if m in case else "-" for m in others
        ]
        cells += [f"{_mib(b['peak_extra_bytes'])} ({_bound(b, meta)})"]
        cells += [_mib(case[m]["peak_extra_bytes"]) if m in case else "-" for m in others]
        cells += [f"{(b['floor_s'] or 0) * 1e3:.2f}", f"{b['vs_floor'] or float('nan'):.2f}"]
        cells += ["yes" if all(r["correct"] for r in case.values()) else "NO"]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


_DOC_BLOCK = re.compile(
    r"(<!-- sync_latency (summary|tiny|budget) (\S+) -->\n)(.*?)(<!-- end -->)", re.S
)


def update_docs(path) -> int:
    """Regenerate every `<!-- sync_latency KIND RESULTS.json -->` ... `<!-- end -->` block of
    a markdown file from that results file (KIND: summary, tiny or budget)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def render(m):
        with open(os.path.join(root, m.group(3))) as f:
            data = json.load(f)
        if m.group(2) == "budget":
            table = "\n".join(budget_markdown(data).splitlines()[-len(data["results"]) - 2 :])
            text = table + "\n"
        elif m.group(2) == "tiny":
            reshard_rows = {
                (r["scenario"], r["model"]): r for r in data["results"] if r["method"] == "reshard"
            }
            text = "\n".join(tiny_table(data["results"], reshard_rows)[2:])
        else:
            text = summary_table(data["meta"], data["results"])
        return m.group(1) + text + m.group(5)

    with open(path) as f:
        doc = f.read()
    new, n = _DOC_BLOCK.subn(render, doc)
    with open(path, "w") as f:
        f.write(new)
    print(f"{path}: {n} generated tables")
    return 0


# ------------------------------------------------------------------ budget sweep


def _budget_rank(rank, world, cfg):
    """reshard alone at several budgets: one Transfer per budget, syncs round-robin over the
    budgets (b0, b1, ..., b0, b1, ...) so each budget sees the same load."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    # one-time process costs (the extension, the first collectives) paid before any budget
    warm = S.SCENARIOS[cfg["scenario"]]("gpt-nano", rank, world)
    step, _ = B.METHODS["reshard"](warm, {"world": world, "budget": None})
    step(warm.targets())
    B.close(step)
    case = S.SCENARIOS[cfg["scenario"]](cfg["model"], rank, world)
    steps, bufs, times, first, infos = {}, {}, {}, {}, {}
    for kib in cfg["budgets"]:
        ctx = {"world": world, "budget": kib << 10}
        bufs[kib] = case.targets()
        C.fence(world, False)
        t0 = time.perf_counter()
        steps[kib], infos[kib] = B.METHODS["reshard"](case, ctx)
        steps[kib](bufs[kib])
        C.fence(world, False)
        first[kib] = time.perf_counter() - t0
        steps[kib](bufs[kib])  # one warm-up
        times[kib] = []
    for _ in range(cfg["iters"]):
        for kib in cfg["budgets"]:
            times[kib].append(C.timed_sync(steps[kib], bufs[kib], world, False)[0])
    out = {}
    for kib in cfg["budgets"]:
        info = infos[kib]()
        out[kib] = {
            "times": times[kib],
            "first_sync_s": first[kib],
            "rounds": info["rounds"],
            "staging_bytes": info["accounted_extra_bytes"],
            "phases_s": info["seconds"],
            "correct": B.targets_correct(case, bufs[kib]),
        }
        B.close(steps[kib])
    return {"params": case.params, "budgets": out}


def budget_sweep(args, argv, scenarios, models) -> int:
    """--budgets-kib: reshard's latency/memory trade-off against the per-peer budget."""
    budgets = [int(x) for x in args.budgets_kib.split(",")]
    if any(b <= 0 for b in budgets) or args.world < 2:
        print("--budgets-kib: budgets must be positive and --world >= 2", file=sys.stderr)
        return 2
    scenario = scenarios[0] if scenarios else "offload_fp32"
    model = models[0] if models else "gpt-mini"
    cfg = {"scenario": scenario, "model": model, "budgets": budgets, "iters": args.iters}
    try:
        per = launch(_budget_rank, args.world, args=(cfg,), prefix="reshard-budget-")
    except RanksFailed as exc:
        print(exc, file=sys.stderr)
        return 1
    rows = []
    for kib in budgets:
        recs = [x["budgets"][kib] for x in per]
        t = sorted(max(rec["times"][i] for rec in recs) for i in range(args.iters))
        rows.append(
            {
                "budget_bytes_per_peer": kib << 10,
                "median_s": statistics.median(t),
                "p90_s": t[int(0.9 * (len(t) - 1))],
                "first_sync_s": max(rec["first_sync_s"] for rec in recs),
                "rounds": recs[0]["rounds"],
                "staging_bytes": max(rec["staging_bytes"] for rec in recs),
                "phases_s": recs[0]["phases_s"],
                "correct": all(rec["correct"] for rec in recs),
            }
        )
    env = C.environment()
    meta = {
        "scenario": scenario,
        "model": model,
        "params": per[0]["params"],
        "world": args.world,
        "iters": args.iters,
        "loadavg": env["loadavg"],
        "torch": env["torch"],
        "host": env["host"],
        "date": env["date"],
        "command": C.command_line("sync_latency.py", argv),
    }
    record = {"meta": meta, "results": rows}
    if args.json:
        C.write_results(args.json, record, budget_markdown)
    print(budget_markdown(record))
    return 0 if all(r["correct"] for r in rows) else 1


def budget_markdown(record):
    meta, rows = record["meta"], record["results"]
    lines = [
        f"# sync_latency budget sweep: {meta['scenario']} {meta['model']}, world "
        f"{meta['world']}, budgets interleaved, {meta['iters']} syncs each",
        "",
        f"Command: `{meta['command']}`",
        "",
        "`first ms`: the Transfer's first sync (planning, tables, arenas) on its own.",
        "",
        "| budget KiB | rounds | staging MiB | median ms | p90 ms | first ms | ok |",
        "|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        first = r.get("first_sync_s")
        lines.append(
            f"| {r['budget_bytes_per_peer'] >> 10} | {r['rounds']} | "
            f"{r['staging_bytes'] / MiB:.2f} | {r['median_s'] * 1e3:.1f} | "
            f"{r['p90_s'] * 1e3:.1f} | {'-' if first is None else f'{first * 1e3:.1f}'} "
            f"| {'yes' if r['correct'] else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ processes


def _rank_body(rank, world, cfg):
    last = {}
    run_cases(rank, world, cfg, last.update)  # the sink gets the cumulative output per case
    return last


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2, help="ranks (1: one process, no group)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--scenarios", default=None, help="comma list (default: all that apply)")
    ap.add_argument("--models", default=None, help=f"comma list of {', '.join(S.MODELS)}")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument(
        "--budget-mib",
        type=float,
        default=None,
        help=f"reshard budget per peer (default: 64 on CUDA; on CPU {B.CPU_BUDGET_RULE})",
    )
    ap.add_argument(
        "--budgets-kib",
        default=None,
        help="comma list: reshard alone at each of these budgets per peer, interleaved "
        "(one scenario and model; default offload_fp32 gpt-mini)",
    )
    ap.add_argument("--time-budget", type=float, default=0, help="seconds; skip later cases")
    ap.add_argument("--quick", action="store_true", help=f"models {', '.join(QUICK_MODELS)}")
    ap.add_argument("--methods", default=None, help="comma list (default: all that apply)")
    ap.add_argument(
        "--stream-before",
        default=None,
        help="another revision's stream.py (git show REV:python/reshard/stream.py > PATH), or a "
        "directory of its stream*.py (every module of its Stream): adds that Stream as method "
        "stream_before to rollout_stream / stream_offload",
    )
    ap.add_argument("--json", default=None, help="write PATH (+ .md, _latency/_memory.png)")
    ap.add_argument("--from-json", default=None, help="re-render PATH's .md and plots only")
    ap.add_argument(
        "--docs",
        default=None,
        help="regenerate the results tables of a markdown file (docs/performance.md)",
    )
    args = ap.parse_args(argv)
    if args.docs:
        return update_docs(args.docs)
    if args.from_json:
        with open(args.from_json) as f:
            data = json.load(f)
        if "method" not in data["results"][0]:  # a --budgets-kib sweep
            C.write_results(args.from_json, data, budget_markdown)
            print(budget_markdown(data))
        else:
            write_outputs(args.from_json, data["meta"], data["results"])
            print(markdown(data["meta"], data["results"]))
        return 0
    if args.world < 1:
        ap.error("--world must be >= 1")
    if args.device == "cuda" and (args.world != 1 or not torch.cuda.is_available()):
        ap.error("--device cuda needs --world 1 and a visible GPU (one-process CPU<->GPU)")
    if args.iters < 20:
        print(
            f"note: --iters {args.iters} < 20: fewer syncs than the suite's standard",
            file=sys.stderr,
        )
    default_scen = MULTI_SCENARIOS if args.world > 1 else SINGLE_SCENARIOS
    scenarios = args.scenarios.split(",") if args.scenarios else list(default_scen)
    for s in scenarios:
        if s not in S.SCENARIOS:
            ap.error(f"unknown scenario {s!r}; choose from {', '.join(S.SCENARIOS)}")
        if s in ("dp_change", "fsdp_resize") and args.world < 2:
            ap.error(f"{s} needs --world >= 2")
    models = args.models.split(",") if args.models else None
    for m in models or ():
        if m not in S.MODELS:
            ap.error(f"unknown model {m!r}; choose from {', '.join(S.MODELS)}")
    if args.budgets_kib:
        return budget_sweep(args, argv, scenarios if args.scenarios else None, models)
    sweep = list(QUICK_MODELS if args.quick else FULL_MODELS)
    cases = [[s, m] for s in scenarios for m in models or S.SCENARIO_MODELS.get(s, sweep)]
    methods = []  # every method of some scenario, in order; each case runs its own
    for s in scenarios:
        methods += [m for m in B.methods_for(args.world, args.device, s) if m not in methods]
    if args.stream_before:
        methods.insert(1, "stream_before")
    if args.methods:
        for m in args.methods.split(","):
            if m not in methods:
                ap.error(f"method {m!r} does not apply here; choose from {', '.join(methods)}")
        methods = args.methods.split(",")
    budget_mib = args.budget_mib or (64 if args.device == "cuda" else None)
    cfg = {
        "device": args.device,
        "cases": cases,
        "methods": methods,
        "iters": args.iters,
        "warmup": max(1, args.warmup),
        "budget": int(budget_mib * MiB) if budget_mib else None,  # None: B.cpu_budget(case)
        "time_budget": args.time_budget,
        "stream_before": args.stream_before,
        # On the shared CPU box the timed syncs go round-robin over the methods. In one
        # process on a GPU they stay per method: reshard_registered page-locks the very
        # sources the others read, which would change what they measure.
        "interleave": args.world > 1,
    }
    env = C.environment(args.device)
    meta = {
        **env,
        "host": env["host"] if args.device == "cpu" else torch.cuda.get_device_name(),
        "device": args.device,
        "transport": "gloo" if args.world > 1 else f"one process ({args.device})",
        "world": args.world,
        "reshard": getattr(rs, "__version__", "?"),
        "iters": args.iters,
        "warmup": cfg["warmup"],
        "budget_bytes_per_peer": cfg["budget"],
        "budget_rule": None if cfg["budget"] else B.CPU_BUDGET_RULE,
        "interleaved": cfg["interleave"],
        "source": "synthetic (DeepSpeed ZeRO-3 / ZeRO-1/2 layouts; no engines)",
        "command": C.command_line("sync_latency.py", argv),
    }
    progress(
        f"{len(cases)} cases x {len(cfg['methods'])} methods, world {args.world}, {args.device}"
    )

    def finish(per_rank):
        meta["links"] = per_rank[0]["links"]
        meta["unfit"] = per_rank[0].get("unfit", [])
        rows = aggregate(per_rank, meta)
        if args.json:
            write_outputs(args.json, meta, rows)
        return rows

    if args.world == 1:
        rows = []

        def sink(out):
            nonlocal rows
            rows = finish([out])

        run_cases(0, 1, cfg, sink)
    else:
        try:
            per_rank = launch(_rank_body, args.world, args=(cfg,), prefix="reshard-bench-")
        except RanksFailed as exc:
            print(exc, file=sys.stderr)
            return 1
        rows = finish(per_rank)
    print(markdown(meta, rows))
    bad = [f"{r['scenario']}/{r['model']}/{r['method']}" for r in rows if not r["correct"]]
    if bad:
        print(f"WRONG TARGETS: {', '.join(bad)}", file=sys.stderr)
    return 1 if bad or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
