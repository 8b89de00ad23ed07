"""The methods a sync benchmark compares, written once for every benchmark (sync_latency.py,
gpu_bench.py --mode multi): reshard and what people do without it. Each method is
`make(case, ctx) -> (step, info)`: `step(targets)` runs one sync of the benchmark `Case`
(benchmarks/_scenarios.py) into `targets`; `info()` describes the last step:
accounted_extra_bytes (what the method holds by its own account), pinned_bytes, recv_bytes
(this rank, over the transport), and for reshard its report's figures. ctx: {"world", "budget" (bytes per peer; None: cpu_budget)}; reshard
puts the seconds its Transfer took to build (plan included) into ctx["plan_s"].

- reshard: one `reshard.Transfer` reused for every sync.
- reshard_registered (CUDA, one process): the same with the CPU buffers page-locked in place.
- gather_broadcast (world > 1): per tensor, dist.gather of the ZeRO-3 chunks on rank 0, which
  rebuilds the tensor and broadcasts it (skipped when only rank 0 needs it); every rank slices.
- full_gather (world > 1): per tensor, all-gather of the chunks on every rank, then slice.
- to_device (one process): per tensor `target.copy_(source.to(target.device))`.
- stream_then_shard (rollout_tp): an rs.Stream of full tensors to every rank that
  holds a target, each then taking its part (an engine's load_weights on full tensors).
For a case with `stream` set (rollout_stream, stream_offload) the reshard method is an rs.Stream
whose tensors are handed to the targets as they arrive, and the baselines carry names that say
exactly what they do (the same code as above where it is the same thing):
- per_param_allgather (rollout_stream): `full_gather` then the receiver's hand-off: per
  parameter, `deepspeed.zero.GatheredParameters([p])`'s all-gather on every rank, then the
  receiver hands the full tensor to the engine (TRL / OpenRLHF with ZeRO-3).
- per_param_gather_to_receiver (rollout_stream): `gather_broadcast`: per parameter, the chunks
  gathered to the receiver only, then the hand-off (less traffic than GatheredParameters).
- whole_model_allgather (rollout_stream): every tensor all-gathered on every rank and kept
  (the whole-model gather), then the hand-off.
- per_tensor_to_device (stream_offload, one process): per tensor `master.to(device, dtype)` of
  the CPU fp32 master, then the hand-off.
- reshard_transfer (stream_offload): one rs.Transfer straight into the engine's weights (no
  stream, no full tensors by name): the executor's own path on the same bytes.
- reshard_registered (stream_offload): the stream with `register_host_sources=True`.
- reshard_b64 (stream_offload, CUDA): the stream with 64 MiB buckets instead of the Stream's
  default 256 MiB (more buckets: more per-bucket starts, a smaller receiver buffer).
- stream_before (rollout_stream, stream_offload; sync_latency.py --stream-before PATH): the
  same stream built by `Stream` from another revision's stream.py, or from every stream*.py in
  a directory of that revision's (ctx["stream_before"]), for a before/after comparison in one
  run.
- full_tensor (FSDP2 scenarios): per tensor `DTensor.full_tensor()` on every rank, then slice
  (what FSDP2 weight syncs do today); with one rank the local tensor is the whole one.
- dcp (fsdp_resize): torch.distributed.checkpoint save of the source DTensors to a temporary
  directory, then load into the target DTensors (DCP reshards on load).
"""

from __future__ import annotations

import math
import os
import time

import _common as C
import torch
import torch.distributed as dist
from _scenarios import STREAM_GPU_SMALL_BUCKET_BYTES, TP_STREAM_BUCKET_BYTES

import reshard as rs

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
    if case.stream is not None:
        return _m_stream(case, ctx, register=register, **case.stream)
    return _m_transfer(case, ctx, register)


def m_reshard_b64(case, ctx):
    return _m_stream(case, ctx, **{**case.stream, "bucket_bytes": STREAM_GPU_SMALL_BUCKET_BYTES})


def m_reshard_transfer(case, ctx):
    return _m_transfer(case, ctx, False)


def _m_transfer(case, ctx, register):
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
    last = {"calls": 0}

    def step(bufs):
        wait = getattr(sync, "wait_host_registration", None)
        if register and last["calls"] == 1 and wait is not None:
            # the first sync started the registration on a thread and did not wait for it; the
            # second (a warm-up) waits, so the timed syncs are the registered steady state
            last["registration"] = wait()
        last["r"] = sync(case.src_buffers, bufs)
        last["calls"] += 1

    def info():
        r = last["r"]
        reg = last.get("registration") or {}
        return _report_info(r) | {
            "budget_bytes_per_peer": sync.plan.budget_bytes_per_peer,
            "host_registration_s": max(
                (v.get("background_seconds", 0.0) for v in reg.values()), default=0.0
            ),
            "local_h2d": _local_h2d(sync),
        }

    step.close = sync.close
    return step, info


def _local_h2d(sync):
    """What the batched CPU -> CUDA path did on the last call (reshard.h2d), if it ran."""
    path = getattr(getattr(sync, "_engine", None), "local_h2d", None)
    if path is None:
        return None
    return {
        **path.last,
        "tables": len(path.tables),
        "host_s_per_elem": path.host_s_per_elem,
        "link_bytes_per_s": path.link_bytes_per_s,
    }


def m_stream_before(case, ctx):
    path = ctx["stream_before"]
    if os.path.isdir(path):  # every stream*.py of that revision
        return _m_stream(case, ctx, cls=C.load_stream_before(path), **case.stream)
    import importlib.util

    spec = importlib.util.spec_from_file_location("reshard.stream_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # relative imports resolve in the reshard package
    return _m_stream(case, ctx, cls=module.Stream, **case.stream)


def _m_stream(
    case,
    ctx,
    receivers,
    bucket_bytes,
    staging_bytes_per_rank=None,
    register=False,
    cls=rs.Stream,
):
    """An rs.Stream of full tensors to `receivers`, each tensor handed to the 'engine' as it
    arrives (case.write: a receiver copies its part of the tensor into its weights)."""
    t0 = time.perf_counter()
    extra = {"register_host_sources": True} if register else {}
    stream = cls(
        case.src_layout,
        receivers,
        bucket_bytes,
        dtype=case.dst.dtype,
        group=None if ctx["world"] == 1 else dist.group.WORLD,
        device=case.dst_device,
        staging_bytes_per_rank=staging_bytes_per_rank,
        **extra,
    )
    ctx["plan_s"] = time.perf_counter() - t0
    last = {}

    def step(bufs):
        for name, full in stream(case.src_buffers):
            case.write(name, full, bufs)
        last["r"] = stream.report

    def info():
        r = last["r"]
        return _report_info(r) | {
            "buckets": r.buckets,
            "wait_seconds": getattr(r, "wait_seconds", 0.0),
        }

    if hasattr(stream, "close"):
        step.close = stream.close
    return step, info


def _report_info(r) -> dict:
    """What a reshard Report (of a Transfer or a Stream) says of the last step."""
    return {
        "accounted_extra_bytes": sum(r.peak_staging_bytes.values()),
        "pinned_bytes": r.peak_staging_bytes.get("host_pinned", 0),
        "staging_bytes": dict(r.peak_staging_bytes),
        "staging_bound": r.staging_bound,
        "recv_bytes": r.total_bytes_received,
        "local_bytes": r.local_bytes,
        "rounds": r.rounds,
        "zero_copy_bytes": r.zero_copy_bytes,
        "seconds": r.seconds,
        "registered_bytes": (getattr(r, "host_registration", None) or {}).get(
            "registered_bytes", 0
        ),
    }


def m_stream_then_shard(case, ctx):
    """Full tensors to every rank that holds a target (rs.Stream), each rank then taking its
    part (what an engine's load_weights does with full tensors on every TP rank)."""
    receivers = sorted({r for ranks in case.target_ranks.values() for r in ranks})
    return _m_stream(case, ctx, receivers, TP_STREAM_BUCKET_BYTES)


def m_whole_model_allgather(case, ctx):
    """The whole model first (every tensor all-gathered on every rank and kept), then the
    hand-off: what a trainer that gathers all ZeRO-3 params at once does."""
    acct = _Acct()
    world = case.world

    def step(bufs):
        acct.reset()
        flats = {}
        for t in case.names:
            c, mine = case.chunk_view(t)
            flats[t] = acct.alloc(torch.empty(c * world, dtype=mine.dtype, device=mine.device))
            _all_gather_flat(flats[t], mine)
            acct.recv += (world - 1) * c * mine.element_size()
        for t, flat in flats.items():
            case.write(t, _full_from_flat(case, flat, t), bufs)
        for flat in flats.values():
            acct.free(flat)
        flats.clear()

    def info():
        return {"accounted_extra_bytes": acct.peak, "pinned_bytes": 0, "recv_bytes": acct.recv}

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
        for t in case.names:
            c, mine = case.chunk_view(t)
            need_bcast = case.target_ranks[t] != [0]
            shape = case.shapes[t]
            esz = mine.element_size()
            if rank == 0:
                flat = acct.alloc(torch.empty(world * c, dtype=mine.dtype, device=mine.device))
                dist.gather(mine, list(flat.view(world, c)), dst=0)
                full = _full_from_flat(case, flat, t)
                acct.recv += (world - 1) * c * esz
            else:
                dist.gather(mine, None, dst=0)
                full = (
                    acct.alloc(torch.empty(shape, dtype=mine.dtype, device=mine.device))
                    if need_bcast
                    else None
                )
                if need_bcast:
                    acct.recv += full.numel() * esz
            if need_bcast:
                dist.broadcast(full, src=0)
            if full is not None:
                case.write(t, full, bufs)
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
        for t in case.names:
            c, mine = case.chunk_view(t)
            flat = acct.alloc(torch.empty(c * world, dtype=mine.dtype, device=mine.device))
            _all_gather_flat(flat, mine)
            acct.recv += (world - 1) * c * mine.element_size()
            full = _full_from_flat(case, flat, t)
            case.write(t, full, bufs)
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


def m_per_tensor_to_device(case, ctx):
    """Per tensor: the CPU fp32 master `.to(device, dtype)`, then the hand-off (case.write)."""
    acct = _Acct()

    def step(bufs):
        acct.reset()
        for t in case.names:
            numel = math.prod(case.shapes[t])
            master = case.chunk_view(t)[1][:numel].view(case.shapes[t])
            full = acct.alloc(master.to(case.dst_device, case.dst.dtype))
            acct.recv += full.numel() * full.element_size()
            case.write(t, full, bufs)
            acct.free(full)
            full = None  # freed before the next tensor's copy is allocated

    def info():
        return {"accounted_extra_bytes": acct.peak, "pinned_bytes": 0, "recv_bytes": acct.recv}

    return step, info


def m_full_tensor(case, ctx):
    acct = _Acct()

    def step(bufs):
        acct.reset()
        for t in case.names:
            dt = case.src_dtensors[t]
            # one rank: the local tensor is the whole tensor (no collective to run)
            full = acct.alloc(dt.full_tensor() if dt.device_mesh.size() > 1 else dt.to_local())
            acct.recv += (full.numel() - dt.to_local().numel()) * full.element_size()
            case.write(t, full, bufs)
            acct.free(full)
            full = None  # freed before the next tensor's gather

    def info():
        return {"accounted_extra_bytes": acct.peak, "pinned_bytes": 0, "recv_bytes": acct.recv}

    return step, info


def m_dcp(case, ctx):
    """Save the source DTensors with torch.distributed.checkpoint, load them into the targets.

    One directory per step under a temporary directory rank 0 creates (its path broadcast);
    removed after the load. The checkpoint's bytes are files, not this process's memory."""
    import os
    import shutil
    import tempfile

    import torch.distributed.checkpoint as dcp

    box = [tempfile.mkdtemp(prefix="reshard-dcp-") if case.rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    root, count = box[0], [0]
    last = {}

    def step(bufs):
        path = os.path.join(root, f"step{count[0]}")
        count[0] += 1
        dcp.save(case.src_dtensors, checkpoint_id=path)
        dcp.load(case.dst_dtensors(bufs), checkpoint_id=path)
        dist.barrier()
        if case.rank == 0:
            last["file_bytes"] = sum(
                os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs
            )
            shutil.rmtree(path)

    def info():
        return {
            "accounted_extra_bytes": 0,
            "pinned_bytes": 0,
            "recv_bytes": 0,
            "checkpoint_file_bytes": last.get("file_bytes", 0),
        }

    def close():
        dist.barrier()
        if case.rank == 0:
            shutil.rmtree(root, ignore_errors=True)

    step.close = close
    return step, info


METHODS = {
    "reshard": m_reshard,
    "reshard_registered": m_reshard_registered,
    "gather_broadcast": m_gather_broadcast,
    "full_gather": m_full_gather,
    "to_device": m_to_device,
    "stream_then_shard": m_stream_then_shard,
    "full_tensor": m_full_tensor,
    "dcp": m_dcp,
    "per_param_allgather": m_full_gather,
    "per_param_gather_to_receiver": m_gather_broadcast,
    "whole_model_allgather": m_whole_model_allgather,
    "per_tensor_to_device": m_per_tensor_to_device,
    "reshard_transfer": m_reshard_transfer,
    "reshard_b64": m_reshard_b64,
    "stream_before": m_stream_before,
}


def methods_for(world, device, scenario=None):
    """The methods that apply to `scenario` (None: the ZeRO-layout scenarios)."""
    if scenario in ("fsdp_weight_sync", "fsdp_offload"):
        registered = ["reshard_registered"] if world == 1 and device == "cuda" else []
        return ["reshard", *registered, "full_tensor"]
    if scenario == "fsdp_resize":
        return ["reshard", "full_tensor", "dcp"]
    if scenario == "rollout_stream":
        return [
            "reshard",
            "per_param_allgather",
            "per_param_gather_to_receiver",
            "whole_model_allgather",
        ]
    if scenario == "rollout_tp":
        return ["reshard", "stream_then_shard", "full_gather"]
    if scenario == "stream_offload":
        registered = ["reshard_registered"] if device == "cuda" else []
        small = ["reshard_b64"] if device == "cuda" else []
        return ["reshard", *registered, *small, "reshard_transfer", "per_tensor_to_device"]
    if world > 1:
        return ["reshard", "gather_broadcast", "full_gather"]
    out = ["reshard"]
    if device == "cuda":
        out.append("reshard_registered")
    return [*out, "to_device"]


def _equal(a, b):
    a = a.cpu()
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    iv = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.view(iv), b.view(iv))


def targets_correct(case, bufs) -> bool:
    """Every target buffer bitwise equal to the reference, and no other buffer."""
    return set(bufs) == set(case.reference) and all(
        _equal(bufs[k], v) for k, v in case.reference.items()
    )


def close(step):
    """Release what a method holds between syncs (reshard's Transfer)."""
    if hasattr(step, "close"):
        step.close()
