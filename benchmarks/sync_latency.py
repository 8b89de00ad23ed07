"""Repeated-sync benchmark: reshard vs what people do today, measured in the same run.

Scenarios (benchmarks/_scenarios.py; synthetic sharded state with DeepSpeed's layouts):
- rl_weight_sync: ZeRO-3 bf16 param shards -> TP=2 bf16 rollout buffers (fused QKV,
  row/column splits, replicated norms).
- offload_fp32 / offload_bf16 / offload_back: CPU-offloaded fp32 master + exp_avg + exp_avg_sq
  -> device-side partitions (fp32 or bf16 targets; bf16 travels as bf16) and back. With
  --world 1 and --device cuda: CPU -> GPU in one process. With --world N > 1 on a CPU-only box,
  "device" is the next rank: every byte crosses the transport.
- dp_change: fp32 master + Adam moments, ZeRO-3 partitions DP=W -> ZeRO-1/2 flat DP=W-1.

Methods (same run, each checked bitwise against an independent reference after its syncs):
- reshard: one `reshard.Transfer` reused for every sync (planning is excluded from the per-sync
  time; the first sync, plan included, is reported separately as first_sync_s).
- reshard_registered (CUDA, one process): the same with the CPU buffers page-locked in place
  (register_host_sources=True, register_host_targets=True).
- gather_broadcast (world > 1): per tensor, dist.gather of the ZeRO chunks on rank 0, rank 0
  rebuilds it and broadcasts it (skipped when only rank 0 needs it), every rank slices.
- full_gather (world > 1): per tensor, all-gather of the chunks on every rank, then slice.
- to_device (one process): per tensor `target.copy_(source.to(target.device))`.

Metrics per (scenario, model, method): median / p90 / p10 of >= --iters syncs after warm-up
(per sync, the slowest rank's time; with --world > 1 the methods' timed syncs are interleaved,
one sync of each in turn, so a load burst on a shared machine hits every method alike), peak
extra memory (measured per method alone, before the timed syncs; host: RSS delta per rank
sampled by a thread during extra syncs, and the bytes the method holds by its own account, max of both;
device: max_memory_allocated delta), pinned bytes, bytes moved over the transport, GB/s of the
payload, the physical floor (max of wire bytes / link bandwidth and local bytes / copy
bandwidth on the slowest rank; PCIe bytes / pinned PCIe bandwidth for CPU<->GPU; bandwidths
measured in the same run, best of 7) and ratios to reshard.

    python benchmarks/sync_latency.py --quick --json benchmarks/results/cpu/sync_latency_quick.json
    python benchmarks/sync_latency.py --world 1 --device cuda --json out/sync_latency.json \\
        --scenarios offload_fp32,offload_bf16,offload_back --models gpt-125m,gpt-350m

--json PATH also writes PATH with .md (tables) and _latency.png / _memory.png (plots).
On the CPU a (scenario, model) whose buffers would not fit in the host's available memory is
skipped, and the tables say so: `--models` can name sizes up to the largest config and the run
covers as many as the machine holds.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import gc
import json
import math
import os
import platform
import statistics
import sys
import threading
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _scenarios as S  # noqa: E402

import reshard as rs  # noqa: E402
from reshard._launch import RanksFailed, launch  # noqa: E402

QUICK_MODELS = ("gpt-micro", "gpt-mini")
FULL_MODELS = ("gpt-nano", "gpt-micro", "gpt-mini", "gpt-small", "gpt-125m")
# The CPU budget rule (gloo): about 1/64 of the source bytes the busiest rank holds, so a full
# sync takes at most ~64 rounds whatever the model (each round costs gloo a fixed handshake),
# never below 512 KiB, and at most 16 MiB per peer. Staging (2 send + 2 receive arenas) is then
# at most 1/16 of that rank's state.
CPU_BUDGET_RULE = "1/64 of the busiest rank's source bytes, clamped to [512 KiB, 16 MiB]"
CPU_BUDGET_MIN, CPU_BUDGET_MAX, CPU_BUDGET_ROUNDS = 512 << 10, 16 << 20, 64


def cpu_budget(case) -> int:
    """CPU_BUDGET_RULE for this case, the same on every rank (computed from the layout)."""
    held: dict = {}
    for st in case.src_layout.storages.values():
        held[st.rank] = held.get(st.rank, 0) + st.numel * st.dtype.itemsize
    budget = max(held.values()) // CPU_BUDGET_ROUNDS // 4096 * 4096
    return min(CPU_BUDGET_MAX, max(CPU_BUDGET_MIN, budget))


MULTI_SCENARIOS = ("rl_weight_sync", "offload_fp32", "offload_bf16", "offload_back", "dp_change")
SINGLE_SCENARIOS = ("offload_fp32", "offload_bf16", "offload_back")
MiB = 1 << 20
GiB = 1 << 30


def progress(msg):
    print(f"[sync_latency {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


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


class _Acct:
    """Temporaries a baseline holds, tensor by tensor: live bytes and their peak."""

    def __init__(self):
        self.live = self.peak = 0
        self.recv = 0

    def reset(self):
        self.live = self.peak = self.recv = 0

    def alloc(self, t):
        self.live += t.numel() * t.element_size()
        self.peak = max(self.peak, self.live)
        return t

    def free(self, t):
        self.live -= t.numel() * t.element_size()


# ------------------------------------------------------------------ methods
# make(case, ctx) -> (step(bufs), info() -> dict); info of the last step:
# accounted_extra_bytes, pinned_bytes, recv_bytes (this rank, over the transport), local_bytes.


def m_reshard(case, ctx, register=False):
    t0 = time.perf_counter()
    sync = rs.Transfer(
        case.src_layout,
        case.dst_layout,
        budget_bytes_per_peer=ctx["budget"] or cpu_budget(case),
        group=None if ctx["world"] == 1 else dist.group.WORLD,
        register_host_sources=register,
        register_host_targets=register,
    )
    ctx["plan_s"] = time.perf_counter() - t0
    last = {}

    def step(bufs):
        last["r"] = sync(case.src_buffers, bufs)

    def info():
        r = last["r"]
        return {
            "accounted_extra_bytes": sum(r.peak_staging_bytes.values()),
            "pinned_bytes": r.peak_staging_bytes.get("host_pinned", 0),
            "staging_bound": r.staging_bound,
            "recv_bytes": r.total_bytes_received,
            "local_bytes": r.local_bytes,
            "rounds": r.rounds,
            "budget_bytes_per_peer": sync.plan.budget_bytes_per_peer,
            "zero_copy_bytes": r.zero_copy_bytes,
            "seconds": r.seconds,
            "registered_bytes": (getattr(r, "host_registration", None) or {}).get(
                "registered_bytes", 0
            ),
        }

    step.close = sync.close
    return step, info


def m_reshard_registered(case, ctx):
    return m_reshard(case, ctx, register=True)


def _full_from_flat(case, flat, name):
    """The world rank-ordered chunks in `flat` -> the logical tensor: a view when ranks hold
    partitions in order (no copy), else one reordering copy."""
    order = sorted(range(case.world), key=case.partition_of_rank)
    if order != list(range(case.world)):
        flat = flat.view(case.world, -1)[order].reshape(-1)
    return flat[: math.prod(case.shapes[name])].view(case.shapes[name])


def m_gather_broadcast(case, ctx):
    acct = _Acct()
    rank, world = case.rank, case.world

    def step(bufs):
        acct.reset()
        for t, s, n in case.names:
            c, mine = case.chunk_view(t, s, n)
            need_bcast = case.target_ranks[t] != [0]
            shape = case.shapes[n]
            esz = mine.element_size()
            if rank == 0:
                flat = acct.alloc(torch.empty(world * c, dtype=mine.dtype))
                dist.gather(mine, list(flat.view(world, c)), dst=0)
                full = _full_from_flat(case, flat, n)
                acct.recv += (world - 1) * c * esz
            else:
                dist.gather(mine, None, dst=0)
                full = acct.alloc(torch.empty(shape, dtype=mine.dtype)) if need_bcast else None
                if need_bcast:
                    acct.recv += full.numel() * esz
            if need_bcast:
                dist.broadcast(full, src=0)
            if full is not None:
                case.write(t, s, n, full, bufs)
                acct.free(flat if rank == 0 else full)
            # drop this tensor's temporaries before the next one is allocated (else two live)
            flat = full = None

    def info():
        return {"accounted_extra_bytes": acct.peak, "pinned_bytes": 0, "recv_bytes": acct.recv}

    return step, info


# torch 2.13 deprecates all_gather_into_tensor for all_gather_single; older torch lacks it.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def m_full_gather(case, ctx):
    acct = _Acct()
    world = case.world

    def step(bufs):
        acct.reset()
        for t, s, n in case.names:
            c, mine = case.chunk_view(t, s, n)
            flat = acct.alloc(torch.empty(c * world, dtype=mine.dtype))
            _all_gather_flat(flat, mine)
            acct.recv += (world - 1) * c * mine.element_size()
            full = _full_from_flat(case, flat, n)
            case.write(t, s, n, full, bufs)
            acct.free(flat)
            flat = full = None  # freed before the next tensor's buffer is allocated

    def info():
        return {"accounted_extra_bytes": acct.peak, "pinned_bytes": 0, "recv_bytes": acct.recv}

    return step, info


def m_to_device(case, ctx):
    acct = _Acct()
    pairs = {}

    def step(bufs):
        acct.reset()
        key = id(bufs)
        if key not in pairs:
            pairs.clear()
            pairs[key] = case.per_tensor_pairs(bufs)
        for sv, dv in pairs[key]:
            tmp = acct.alloc(sv.to(dv.device))
            dv.copy_(tmp)
            acct.free(tmp)
            tmp = None  # freed before the next tensor's copy is allocated
            acct.recv += sv.numel() * sv.element_size() if sv.device != dv.device else 0

    def info():
        return {"accounted_extra_bytes": acct.peak, "pinned_bytes": 0, "recv_bytes": acct.recv}

    return step, info


METHODS = {
    "reshard": m_reshard,
    "reshard_registered": m_reshard_registered,
    "gather_broadcast": m_gather_broadcast,
    "full_gather": m_full_gather,
    "to_device": m_to_device,
}


def methods_for(world, device):
    if world > 1:
        return ["reshard", "gather_broadcast", "full_gather"]
    out = ["reshard"]
    if device == "cuda":
        out.append("reshard_registered")
    return [*out, "to_device"]


# ------------------------------------------------------------------ measurement


def _equal(a, b):
    a = a.cpu()
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    iv = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.view(iv), b.view(iv))


def _barrier(world):
    if world > 1:
        dist.barrier()


def _dev_sync(cuda):
    if cuda:
        torch.cuda.synchronize()


def timed_sync(step, bufs, world, cuda):
    """One sync, timed as the slowest rank sees it (device work and every rank fenced on both
    sides). Returns (seconds, what the step returned)."""
    _dev_sync(cuda)
    _barrier(world)
    t = time.perf_counter()
    out = step(bufs)
    _dev_sync(cuda)
    _barrier(world)
    return time.perf_counter() - t, out


def targets_correct(case, bufs) -> bool:
    """Every target buffer bitwise equal to the reference, and no other buffer."""
    return set(bufs) == set(case.reference) and all(
        _equal(bufs[k], v) for k, v in case.reference.items()
    )


def _close(step):
    if hasattr(step, "close"):
        step.close()


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
        steps[m], _ = METHODS[m](case, ctx)
        for _ in range(ctx["warmup"]):
            steps[m](bufs[m])
    times = {m: [] for m in methods}
    for _ in range(ctx["iters"]):
        for m in methods:
            times[m].append(timed_sync(steps[m], bufs[m], world, cuda)[0])
    correct = {m: targets_correct(case, bufs[m]) for m in methods}
    for step in steps.values():
        _close(step)
    del steps, bufs
    _trim()
    return times, correct


def measure_method(case, method, ctx, timed=True):
    """One method alone: first sync, warm-up, timed syncs (unless `timed` is False: the
    interleaved timing then follows), the memory syncs and the correctness check."""
    world, cuda = ctx["world"], ctx["cuda"]
    bufs = case.targets()
    _trim()
    _dev_sync(cuda)
    base_rss = _rss()
    if cuda:
        base_dev = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    ctx.pop("plan_s", None)
    _barrier(world)
    t0 = time.perf_counter()
    step, info = METHODS[method](case, ctx)
    step(bufs)
    _dev_sync(cuda)
    _barrier(world)
    first = time.perf_counter() - t0
    for _ in range(max(0, ctx["warmup"] - 1)):
        step(bufs)
    times = [timed_sync(step, bufs, world, cuda)[0] for _ in range(ctx["iters"] if timed else 0)]
    with ctx["sampler"].window() as sampler:
        for _ in range(3):
            step(bufs)
            _dev_sync(cuda)
    out = {
        "times": times,
        "first_sync_s": first,
        "plan_s": ctx.get("plan_s"),
        "rss_extra_bytes": max(0, sampler.peak - base_rss),
        "device_extra_bytes": (torch.cuda.max_memory_allocated() - base_dev) if cuda else 0,
        "correct": targets_correct(case, bufs),
        **info(),
    }
    _close(step)
    del step, info, bufs
    _trim()
    return out


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
    }
    out = {"rank": rank, "links": link_bandwidth(rank, world, cuda), "cases": []}
    # One-time process costs (loading the extension, lazy imports, first use of each
    # collective, the CUDA context) are paid here, not charged to whichever method runs first.
    warm = S.SCENARIOS[cfg["scenarios"][0]]("gpt-nano", rank, world, cfg["device"])
    for m in cfg["methods"]:
        step, _ = METHODS[m](warm, ctx)
        step(warm.targets())
        _close(step)
    del warm, step
    _trim()
    total = len(cfg["scenarios"]) * len(cfg["models"])
    t_start = time.perf_counter()
    i = 0
    # scenario-major: under a time budget the first scenario gets every model size
    for scen in cfg["scenarios"]:
        for model in cfg["models"]:
            i += 1
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
                "build_s": build_s,
                "methods": {},
            }
            # memory (and the first sync) per method alone, as if it ran by itself; then the
            # timed syncs, interleaved over the methods where cfg["interleave"]
            for m in cfg["methods"]:
                if rank == 0:
                    progress(f"[{i}/{total}] {scen} {model} ({case.params / 1e6:.1f}M) {m} ...")
                rec["methods"][m] = measure_method(case, m, ctx, timed=not cfg["interleave"])
            if cfg["interleave"]:
                if rank == 0:
                    progress(f"[{i}/{total}] {scen} {model}: timed syncs, methods interleaved")
                times, correct = interleaved_times(case, cfg["methods"], ctx)
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
    with open(path, "w") as f:
        json.dump({"meta": meta, "results": rows}, f, indent=1)
    stem = path[:-5] if path.endswith(".json") else path
    with open(stem + ".md", "w") as f:
        f.write(markdown(meta, rows))
    with contextlib.suppress(Exception):  # plots are a convenience; the JSON is the record
        plot(stem, meta, rows)


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
    """Each baseline against reshard: latency and peak-extra-memory ratios (the issue's goals:
    >= 2x faster and >= 4x less memory than gather_broadcast on CPU)."""
    out = [
        "## Baselines / reshard",
        "",
        "| scenario | model | method | latency x | memory x | reshard x floor |",
        "|---|---|---|---:|---:|---:|",
    ]
    for r in rows:
        b = reshard_rows.get((r["scenario"], r["model"]))
        if b is None or r["method"] == "reshard":
            continue
        out.append(
            f"| {r['scenario']} | {r['model']} | {r['method']} "
            f"| {r['median_s'] / b['median_s']:.2f} "
            f"| {_mem_x(r['peak_extra_bytes'], b)} "
            f"| {b['vs_floor'] or float('nan'):.2f} |"
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
        help=f"reshard budget per peer (default: 64 on CUDA; on CPU {CPU_BUDGET_RULE})",
    )
    ap.add_argument("--time-budget", type=float, default=0, help="seconds; skip later cases")
    ap.add_argument("--quick", action="store_true", help=f"models {', '.join(QUICK_MODELS)}")
    ap.add_argument("--methods", default=None, help="comma list (default: all that apply)")
    ap.add_argument("--json", default=None, help="write PATH (+ .md, _latency/_memory.png)")
    ap.add_argument("--from-json", default=None, help="re-render PATH's .md and plots only")
    args = ap.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            data = json.load(f)
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
        if s == "dp_change" and args.world < 2:
            ap.error("dp_change needs --world >= 2")
    models = (
        args.models.split(",") if args.models else list(QUICK_MODELS if args.quick else FULL_MODELS)
    )
    for m in models:
        if m not in S.MODELS:
            ap.error(f"unknown model {m!r}; choose from {', '.join(S.MODELS)}")
    methods = methods_for(args.world, args.device)
    if args.methods:
        for m in args.methods.split(","):
            if m not in methods:
                ap.error(f"method {m!r} does not apply here; choose from {', '.join(methods)}")
        methods = args.methods.split(",")
    budget_mib = args.budget_mib or (64 if args.device == "cuda" else None)
    cfg = {
        "device": args.device,
        "scenarios": scenarios,
        "models": models,
        "methods": methods,
        "iters": args.iters,
        "warmup": max(1, args.warmup),
        "budget": int(budget_mib * MiB) if budget_mib else None,  # None: cpu_budget(case)
        "time_budget": args.time_budget,
        # On the shared CPU box the timed syncs go round-robin over the methods. In one
        # process on a GPU they stay per method: reshard_registered page-locks the very
        # sources the others read, which would change what they measure.
        "interleave": args.world > 1,
    }
    meta = {
        "host": platform.node() if args.device == "cpu" else torch.cuda.get_device_name(),
        "device": args.device,
        "transport": "gloo" if args.world > 1 else f"one process ({args.device})",
        "world": args.world,
        "torch": torch.__version__,
        "reshard": getattr(rs, "__version__", "?"),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        "iters": args.iters,
        "warmup": cfg["warmup"],
        "budget_bytes_per_peer": cfg["budget"],
        "budget_rule": None if cfg["budget"] else CPU_BUDGET_RULE,
        "interleaved": cfg["interleave"],
        "source": "synthetic (DeepSpeed ZeRO-3 / ZeRO-1/2 layouts; no engines)",
        "command": "python benchmarks/sync_latency.py " + " ".join(argv or sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    progress(
        f"{len(scenarios)} scenarios x {len(models)} models x {len(cfg['methods'])} methods, "
        f"world {args.world}, {args.device}"
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
