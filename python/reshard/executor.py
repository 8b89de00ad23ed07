"""Execute a plan on live buffers: preflight, then rounds of pack -> send/recv -> unpack.

    report = execute(plan, src_buffers, dst_buffers, group=None)     # one-off
    sync = Transfer(src_layout, dst_layout, budget_bytes_per_peer, group)
    report = sync(src_buffers, dst_buffers)                          # every step: no re-plan,
                                                                     # arenas reused
Per round k (global order, the same on every rank): pack this rank's messages of round k with
`copy_runs` into a send arena, post all sends and receives of the round in one
`batch_isend_irecv`, wait, unpack with `copy_runs` out of the receive arena. Two arenas per
direction: round k+1 is packed while round k is in flight. A message that is one contiguous
range of one buffer in the wire dtype is sent straight from the source (or received straight
into the target) instead: no copy, no arena bytes. Local runs skip transport and arenas.

Transports: gloo (CPU buffers, host arenas), NCCL (arenas in device memory; CUDA buffers are
packed on the device; CPU buffers are packed/scattered on the host and moved through one bounded
pinned ring by the stage_h2d/stage_d2h ops, docs/cuda.md), and "local"
(no process group initialized: every storage must be on rank 0; no collectives).

Failure model: every failure before the first write (argument types and the timeout
included) is a collective `PreflightError` with nothing written; the agreement is followed by
a commit step, so a rank whose peers gave up on it never writes (docs/executor.md states the
one window left). Any failure after the commit is a `TransferError`: targets may be partially
written. Waits are bounded by `timeout` (gloo) or the group's own timeout (NCCL watchdog):
never a hang. Calls on one Transfer, and on one process group, run one at a time.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import math
import threading
import time

import numpy as np
import torch
import torch.distributed as dist

from . import _ops
from . import preflight as pf
from .errors import PreflightError, TransferError
from .planning import align as _align
from .report import Report

_ops.require_built()  # every torch.ops.reshard op is used here: say how to build, up front
log = logging.getLogger("reshard")

DEFAULT_TIMEOUT_S = 300.0
# The longest wait a timeout may ask for (a year): beyond it datetime arithmetic overflows.
_MAX_TIMEOUT_S = 365 * 86400.0
# Largest pinned ring of the stage ops. Bounced (pageable or cast) CPU<->GPU copies reach the
# PCIe ceiling only with chunks large enough to hide the per-chunk host fork/join and event
# wait (benchmarks/gpu_bench.py --only ring); a 64 MiB ring gives four 16 MiB slots.
_RING_MAX_BYTES = 64 << 20


def _copy_runs_op():
    return torch.ops.reshard.copy_runs


def resolve_group(group):
    """(group, rank, world_size, transport) with rank and size taken from the group itself."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return None, 0, 1, "local"
    if group is None:
        group = dist.group.WORLD
    if group is dist.GroupMember.NON_GROUP_MEMBER or dist.get_rank(group) < 0:
        raise ValueError(
            f"global rank {dist.get_rank()} is not a member of the process group it was given: "
            "only the group's members call a transfer on that group"
        )
    backend = str(dist.get_backend(group)).lower()
    if backend == "gloo":
        transport = "gloo"
    elif backend == "nccl" or ("nccl" in backend and torch.cuda.is_available()):
        transport = "nccl"
    elif "gloo" in backend:
        transport = "gloo"
    else:
        transport = backend
    return group, dist.get_rank(group), dist.get_world_size(group), transport


class _Desc:
    """A descriptor table kept as a CPU int64 tensor, converted once.

    Tables stay on the CPU: the CUDA copy_runs caches its device copy keyed by this tensor's
    identity, so keeping the tensor alive keeps that cache hot across syncs."""

    __slots__ = ("desc_np", "desc_t", "loc")

    def __init__(self, loc, desc):
        self.loc = loc
        self.desc_np = np.ascontiguousarray(desc, dtype=np.int64).reshape(-1, 6)
        self.desc_t = torch.from_numpy(self.desc_np)


class _Group(_Desc):
    """All packed segments of one round that share a storage and a wire dtype, fused into one
    table over the whole arena (viewed as the wire dtype): one copy_runs call per (round,
    storage, dtype) instead of one per segment. Built once; the arenas never move."""

    __slots__ = ("view",)

    def __init__(self, loc, desc, view):
        super().__init__(loc, desc)
        self.view = view  # the arena as the wire dtype (transport device)


def _wire_view(arena: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    isz = dtype.itemsize
    return arena[: arena.numel() // isz * isz].view(dtype)


def _direct_range(msg, side: str, storage_dtype) -> tuple[int, int, int] | None:
    """(location, first element, elements) when the message is a byte-exact image of one
    contiguous range of one storage on this side ("send": the source, "recv": the target)
    in the wire dtype, else None. Such a message travels straight from / into the buffer:
    no pack or unpack copy and no arena bytes. A cast (bf16 on the wire from fp32), a gap or
    reordering, a second storage, or alignment padding between segments all disqualify it."""
    segs = msg.segments
    nbytes = int(msg.nbytes)
    if not segs or nbytes == 0:
        return None
    attr = "src_location" if side == "send" else "dst_location"
    loc, wire = getattr(segs[0], attr), segs[0].wire_dtype
    isz = wire.itemsize
    if storage_dtype(loc) != wire or nbytes % isz:
        return None
    sc, mc = (0, 2) if side == "send" else (2, 0)  # storage / message columns of a desc row
    rows = []
    for seg in segs:
        if getattr(seg, attr) != loc or seg.wire_dtype != wire:
            return None
        d = np.asarray(seg.desc, dtype=np.int64).reshape(-1, 6)
        d = d[(d[:, 4] > 0) & (d[:, 5] > 0)]
        repeated = d[:, 5] > 1  # a repeated run is one range only if its strides are its length
        if (repeated & ((d[:, sc + 1] != d[:, 4]) | (d[:, mc + 1] != d[:, 4]))).any():
            return None
        msg_at = d[:, mc] + int(seg.byte_offset) // isz
        rows.append(np.stack([msg_at, d[:, sc], d[:, 4] * d[:, 5]], axis=1))
    r = np.concatenate(rows)
    r = r[np.argsort(r[:, 0], kind="stable")]
    ends = r[:, 0] + r[:, 2]
    n = nbytes // isz
    # the rows must tile message elements [0, n) exactly, each at the same storage shift
    if len(r) == 0 or r[0, 0] != 0 or ends[-1] != n or (r[1:, 0] != ends[:-1]).any():
        return None
    shift = r[:, 1] - r[:, 0]
    if (shift != shift[0]).any():
        return None
    return int(loc), int(shift[0]), n


class _Engine:
    """Everything one rank keeps for one plan: schedule, desc tensors, arenas, views.

    Built once per Transfer (or per execute call); arenas are allocated on first use and
    reused afterwards, so repeated syncs allocate nothing."""

    def __init__(self, plan, group, rank, world_size, transport):
        self.plan, self.group, self.rank = plan, group, rank
        self.world_size, self.transport = world_size, transport
        if transport == "nccl":
            self.arena_device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.arena_device = torch.device("cpu")
        self.sched = None  # built by prepare(), inside the collective preflight
        self.arenas = None  # {"send": [..], "recv": [..]} once allocated
        self.ring = None  # pinned ring of the stage_h2d/stage_d2h ops (CPU buffers + CUDA)
        self.inflight = ([], [])  # the round in flight: (its p2p works, the tensors they use)
        self.broken = False  # a call failed after preflight: never reuse these arenas

    def prepare(self) -> list[str]:
        """Build this rank's schedule and everything derived from it (once); return the
        reasons the schedule cannot run here (pf.check_schedule). Anything this raises is a
        preflight reason of this rank: it runs before the collective exchange."""
        if self.sched is not None:
            return self.schedule_reasons
        sched = self.plan.schedule(self.rank)
        self.schedule_reasons = pf.check_schedule(
            sched, self.rank, self.world_size, self.plan.src.storages, self.plan.dst.storages
        )
        s = sched
        self.num_rounds = int(s.num_rounds)
        self.nbuf = min(2, self.num_rounds)
        self.global_peer = {}
        peers = {m.peer for msgs in [*s.sends, *s.recvs] for m in msgs}
        for p in peers:
            if not 0 <= p < self.world_size:
                continue  # a reason of check_schedule
            group = self.group
            self.global_peer[p] = dist.get_global_rank(group, p) if group is not None else p
        self.bytes_sent, self.bytes_received = {}, {}
        for msgs, acc in ((s.sends, self.bytes_sent), (s.recvs, self.bytes_received)):
            for round_msgs in msgs:
                for m in round_msgs:
                    acc[m.peer] = acc.get(m.peer, 0) + int(m.nbytes)
        # the locations messages read / write: per call, only their buffers' devices matter
        self.message_locations = tuple(
            frozenset(getattr(seg, attr) for rm in msgs for m in rm for seg in m.segments)
            for msgs, attr in ((s.sends, "src_location"), (s.recvs, "dst_location"))
        )
        self.local = [
            (lc.src_location, lc.dst_location, _Desc(lc.src_location, lc.desc)) for lc in s.local
        ]
        self.local_elems = [
            (dloc, int((d.desc_np[:, 4] * d.desc_np[:, 5]).sum())) for _, dloc, d in self.local
        ]
        # every target location this rank writes: their version counters move after a call
        self.written_locations = frozenset(
            [dloc for _, dloc, _ in self.local] + list(self.message_locations[1])
        )
        # per round: (pack groups, unpack groups, p2p list, bytes sent, bytes received); a p2p
        # entry is (peer, is_send, arena slice, None, 0, 0) or, for a message that travels
        # straight from / into a buffer, (peer, is_send, None, location, first byte, end byte)
        self.rounds = None
        self.direct_locations = None  # the (side, location) set the rounds were laid out for
        self.zero_copy_bytes = 0  # wire bytes per call that skip the arenas (sent + received)
        self._written = None
        self.sched = sched
        return self.schedule_reasons

    # ------------------------------------------------------------ staging

    def written(self):
        if self._written is None:
            self._written = pf.written_elements(self.sched)
        return self._written

    def ring_bytes(self) -> int:
        """The local-copy ring: the per-peer budget, clamped to [4 KiB, 64 MiB]."""
        budget = int(getattr(self.plan, "budget_bytes_per_peer", _RING_MAX_BYTES))
        return max(4096, min(budget, _RING_MAX_BYTES)) // 16 * 16

    def bound(self, ring: bool) -> dict:
        # The in-process ("local") transport has no arenas; its only staging is the ring,
        # which the plan's formula counts as host_pinned under "nccl".
        transport = (
            "nccl" if self.transport == "nccl" or (ring and self.transport == "local") else "gloo"
        )
        ring_bytes = self.ring_bytes() if ring else 0
        b = self.plan.staging_bytes(self.rank, transport=transport, host_ring_bytes=ring_bytes)
        out = {k: int(b.get(k, 0)) for k in ("device", "host_pinned", "host")}
        out["device"] += self.stage_device_bytes()
        return out

    def held(self) -> dict:
        held = {"device": 0, "host_pinned": 0, "host": 0}
        kind = "device" if self.arena_device.type == "cuda" else "host"
        for arenas in (self.arenas or {}).values():
            held[kind] += sum(a.numel() for a in arenas)
        if self.ring is not None:
            held["host_pinned"] += self.ring.numel()
            held["device"] += self.stage_device_bytes()
        return held

    def stage_device_bytes(self) -> int:
        """Device staging one stage_h2d/stage_d2h call may take with this ring (the ring's
        slots mirrored on the device; none when the device side is a packed arena segment).
        Counted in both the bound and the held bytes while the ring exists."""
        if self.ring is None or not torch.cuda.is_available():
            return 0
        return int(torch.ops.reshard.stage_device_bytes(self.ring.numel()))

    def allocate(self, need_ring: bool, src: dict, dst: dict):
        """Lay out the rounds and allocate the arenas (once), then check against the plan's
        bound; raising here is a preflight reason on this rank, not a crash. `src` / `dst` are
        the validated buffers: a message can skip the arena only where its buffer lives on the
        arena's device (under NCCL a CPU buffer goes through the ring instead), so the layout
        is redone only if that set of buffers ever changes."""
        direct = frozenset(
            [("send", loc) for loc, t in src.items() if t.device == self.arena_device]
            + [("recv", loc) for loc, t in dst.items() if t.device == self.arena_device]
        )
        if self.arenas is None or direct != self.direct_locations:
            self.arenas = None
            self._build_rounds(direct, src, dst)
        if need_ring and self.ring is None:
            self.ring = self._alloc(self.ring_bytes(), True)
        held, bound = self.held(), self.bound(self.ring is not None)
        over = {k: (held[k], bound[k]) for k in held if held[k] > bound[k]}
        if over:
            raise RuntimeError(f"staging held {held} exceeds the plan's bound {bound}")

    def _alloc(self, nbytes, pinned):
        if pinned:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return torch.empty(nbytes, dtype=torch.uint8, device=self.arena_device)

    def _build_rounds(self, direct, src, dst):
        """Per round: which messages travel straight from a source / into a target (one
        contiguous same-dtype range there, `_direct_range`), where the others sit in a compacted
        arena, then the arenas themselves, the fused pack / unpack groups and the p2p list.
        The arenas hold only the packed messages of a round, so they are never larger than the
        plan's `send_arena_bytes` / `recv_arena_bytes` (the staging bound) and may be empty."""
        s = self.sched
        plan_arena = {"send": int(s.send_arena_bytes), "recv": int(s.recv_arena_bytes)}
        layout, need = [], {"send": 0, "recv": 0}
        for k in range(self.num_rounds):
            per_dir = {}
            for key, msgs, bufs in (("send", s.sends[k], src), ("recv", s.recvs[k], dst)):
                attr = "src_location" if key == "send" else "dst_location"
                items, cursor = [], 0
                for m in msgs:
                    mo, nb = int(m.arena_offset), int(m.nbytes)
                    if mo < 0 or mo + nb > plan_arena[key]:
                        raise RuntimeError(
                            f"plan bug: round {k} {key} message to/from rank {m.peer} spans "
                            f"arena bytes [{mo}, {mo + nb}) beyond the arena's {plan_arena[key]}"
                        )
                    rng = None
                    if m.segments and (key, getattr(m.segments[0], attr)) in direct:
                        rng = _direct_range(m, key, lambda loc, b=bufs: b[loc].dtype)
                    if rng is None:
                        items.append((m, None, cursor))
                        need[key] = max(need[key], cursor + nb)
                        cursor = _align(cursor + nb)
                    else:
                        items.append((m, rng, None))
                per_dir[key] = items
            layout.append(per_dir)

        self.arenas = {
            key: [self._alloc(need[key], False) for _ in range(self.nbuf)] for key in need
        }
        self.rounds, self.zero_copy_bytes = [], 0
        for k, per_dir in enumerate(layout):
            groups, p2p, nbytes = {}, [], {"send": 0, "recv": 0}
            for key, items in per_dir.items():
                arena = self.arenas[key][k % 2]
                # (location, wire dtype) -> [desc rows shifted into the arena]
                fused: dict = {}
                # the arena-side columns: pack writes the arena (dst), unpack reads it (src)
                col = 2 if key == "send" else 0
                for m, rng, mo in items:
                    nb = int(m.nbytes)
                    nbytes[key] += nb
                    if rng is not None:
                        loc, first, n = rng
                        isz = nb // n
                        p2p.append(
                            (m.peer, key == "send", None, loc, first * isz, (first + n) * isz)
                        )
                        self.zero_copy_bytes += nb
                        continue
                    for seg in m.segments:
                        wire = seg.wire_dtype
                        off = mo + int(seg.byte_offset)
                        if off % wire.itemsize:
                            raise RuntimeError(
                                f"plan bug: round {k} segment at arena byte {off} is not aligned "
                                f"to its wire dtype {wire}"
                            )
                        loc = seg.src_location if key == "send" else seg.dst_location
                        d = np.array(seg.desc, dtype=np.int64, copy=True).reshape(-1, 6)
                        d[:, col] += off // wire.itemsize
                        fused.setdefault((loc, wire), []).append(d)
                    if nb:
                        p2p.append((m.peer, key == "send", arena[mo : mo + nb], None, 0, 0))
                groups[key] = [
                    _Group(loc, np.concatenate(descs), _wire_view(arena, wire))
                    for (loc, wire), descs in fused.items()
                ]
            self.rounds.append(
                (groups["send"], groups["recv"], p2p, nbytes["send"], nbytes["recv"])
            )
        self.direct_locations = direct

    # ------------------------------------------------------------ the rounds

    def run(self, src, dst, report, timeout_s):
        copy_runs = _copy_runs_op()
        sec = report.seconds
        cuda = self.arena_device.type == "cuda"
        tmo = datetime.timedelta(seconds=timeout_s)

        def pack(k):
            t0 = time.perf_counter()
            h2d = 0.0
            for g in self.rounds[k][0]:
                buf = src[g.loc]
                if buf.device == self.arena_device:
                    copy_runs(buf, g.desc_t, g.view)
                else:  # CPU source under NCCL: packed on the host, DMA'd through the ring
                    t1 = time.perf_counter()
                    torch.ops.reshard.stage_h2d(buf, g.desc_t, self.ring, g.view)
                    h2d += time.perf_counter() - t1
            sec["pack"] += time.perf_counter() - t0 - h2d
            sec["h2d"] += h2d

        def post(k):
            ops, bufs = [], []
            for peer, is_send, buf, loc, a, b in self.rounds[k][2]:
                if buf is None:  # straight from the source / into the target
                    buf = (src if is_send else dst)[loc].view(torch.uint8)[a:b]
                fn = dist.isend if is_send else dist.irecv
                ops.append(dist.P2POp(fn, buf, self.global_peer[peer], self.group))
                bufs.append(buf)
            return (dist.batch_isend_irecv(ops) if ops else [], bufs)

        def wait(works):
            t0 = time.perf_counter()
            for w in works:
                if self.transport == "gloo":
                    w.wait(tmo)
                else:
                    w.wait()
            sec["transport"] += time.perf_counter() - t0

        def unpack(k):
            groups = self.rounds[k][1]
            t0 = time.perf_counter()
            d2h = 0.0
            for g in groups:
                buf = dst[g.loc]
                if buf.device == self.arena_device:
                    copy_runs(g.view, g.desc_t, buf)
                else:  # CPU target under NCCL: DMA'd through the ring, scattered on the host
                    t1 = time.perf_counter()
                    torch.ops.reshard.stage_d2h(g.view, g.desc_t, self.ring, buf)
                    d2h += time.perf_counter() - t1
            sec["unpack"] += time.perf_counter() - t0 - d2h
            sec["d2h"] += d2h

        def local():
            t0 = time.perf_counter()
            for sloc, dloc, d in self.local:
                s, t = src[sloc], dst[dloc]
                if s.device == t.device:
                    copy_runs(s, d.desc_t, t)
                elif s.device.type == "cpu":  # e.g. CPU-offloaded fp32 masters -> GPU buffers
                    torch.ops.reshard.stage_h2d(s, d.desc_t, self.ring, t)
                else:
                    torch.ops.reshard.stage_d2h(s, d.desc_t, self.ring, t)
            sec["local"] += time.perf_counter() - t0

        # Arena k % 2 serves round k. Round k+1 is packed while round k is in flight and posted
        # before round k is unpacked, so neither pack nor unpack sits between two transports.
        # (Posting round k+1 before waiting for round k, two rounds in flight, was measured
        # slower under load on the 2-core gloo box, so one round waits at a time.)
        R = self.num_rounds
        if R == 0:
            local()
        else:
            pack(0)
            self.inflight = post(0)  # kept if we fail before they complete (see _retire)
        for k in range(R):
            if k == 0:
                local()  # overlaps round 0's transport
            if k + 1 < R:
                pack(k + 1)  # its send arena's last user, round k-1, completed before post(k)
            wait(self.inflight[0])
            # round k+1's receive arena was last unpacked by round k-1 (ordered before this)
            self.inflight = post(k + 1) if k + 1 < R else ([], [])
            unpack(k)
            if log.isEnabledFor(logging.DEBUG):
                log.debug(
                    "reshard rank %d round %d/%d: sent %d B, received %d B",
                    self.rank,
                    k + 1,
                    R,
                    self.rounds[k][3],
                    self.rounds[k][4],
                )
        if cuda:
            torch.cuda.current_stream().synchronize()


# Engines of failed transfers: a receive posted before the failure may still complete into
# their arenas (a peer that was only late), so that memory must outlive the error. Bounded:
# each entry is at most one plan's staging, and failures are rare and usually fatal.
_GRAVEYARD: list = []
_GRAVEYARD_MAX = 8


def _retire(engine) -> None:
    engine.broken = True
    if engine.inflight[0]:
        _GRAVEYARD.append(engine)
        del _GRAVEYARD[:-_GRAVEYARD_MAX]


def _needs_ring(engine, src_ok, dst_ok) -> bool:
    """CPU buffers in messages under NCCL go through stage_h2d/stage_d2h and the ring."""
    if engine.transport != "nccl":
        return False
    return any(
        bufs[loc].device.type == "cpu"
        for locs, bufs in zip(engine.message_locations, (src_ok, dst_ok), strict=True)
        for loc in locs
        if loc in bufs
    )


def _local_cross_device(engine, src_ok, dst_ok) -> tuple[bool, list[str]]:
    """Local copies whose source and target live on different devices: CPU<->CUDA goes through
    the stage ops and a pinned ring (returns need_ring); anything else is a reason."""
    need_ring, reasons = False, []
    for sloc, dloc, _ in engine.local:
        s, d = src_ok.get(sloc), dst_ok.get(dloc)
        if s is None or d is None or s.device == d.device:
            continue
        if {s.device.type, d.device.type} == {"cpu", "cuda"} and torch.cuda.is_available():
            need_ring = True
        else:
            reasons.append(
                f"source location {sloc} ({s.device}) -> target location {dloc} ({d.device}): "
                "local copies across devices are supported only between CPU and CUDA"
            )
    return need_ring, reasons


def timeout_error(timeout) -> Exception | None:
    """The error an unusable `timeout` (seconds for any one wait) deserves, else None."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        return TypeError(
            f"timeout must be a number of seconds, got {type(timeout).__name__} {timeout!r}"
        )
    if not math.isfinite(timeout) or timeout <= 0:
        return ValueError(
            f"timeout must be a finite number of seconds > 0, got {timeout!r} (every wait is "
            "bounded: a dead peer must become an error, never a hang)"
        )
    if timeout > _MAX_TIMEOUT_S:
        return ValueError(f"timeout must be at most {_MAX_TIMEOUT_S:.0f} seconds, got {timeout!r}")
    return None


def _local_reasons(engine, plan, src_buffers, dst_buffers, checks, timeout):
    """Every check of this rank before the collective exchange: (reasons, src_ok, dst_ok).
    Nothing here may raise: an exception (a list where a dict belongs, a schedule that
    cannot be built, an allocation) is a reason of this rank, so every rank learns of it."""
    reasons, src_ok, dst_ok = [], {}, {}
    bad_timeout = timeout_error(timeout)
    if bad_timeout:
        reasons.append(f"{type(bad_timeout).__name__}: {bad_timeout}")
    try:
        reasons += engine.prepare()
        src = pf.as_buffer_set(src_buffers, "src")
        dst = pf.as_buffer_set(dst_buffers, "dst")
        local_pairs = [(sloc, dloc) for sloc, dloc, _ in engine.local]
        more, src_ok, dst_ok = pf.local_checks(
            plan,
            engine.rank,
            engine.world_size,
            engine.transport,
            src,
            dst,
            checks,
            engine.written,
            local_pairs,
        )
        reasons += more
        # Staging is allocated after every other local check passed (it needs validated
        # buffers to know whether the pinned ring is needed).
        need_ring = False
        if not reasons:
            need_ring, more = _local_cross_device(engine, src_ok, dst_ok)
            reasons += more
        if not reasons:
            try:
                engine.allocate(need_ring or _needs_ring(engine, src_ok, dst_ok), src_ok, dst_ok)
            except (torch.OutOfMemoryError, RuntimeError, MemoryError) as exc:
                reasons.append(f"staging allocation failed: {type(exc).__name__}: {exc}")
    except Exception as exc:  # noqa: BLE001 - collective: every rank must hear of it
        reasons.append(f"{type(exc).__name__}: {exc}")
    return reasons, src_ok, dst_ok


def _bump_versions(engine, dst_ok) -> None:
    """Autograd sees the writes: the version counter of every target this rank's schedule
    writes moves, as after a torch in-place op (the transport's zero-copy receives write
    targets outside any op)."""
    for loc in engine.written_locations:
        t = dst_ok.get(loc)
        if t is not None:
            torch.autograd.graph.increment_version(t)


def _run(engine, plan, src_buffers, dst_buffers, checks, timeout, plan_seconds):
    t_start = time.perf_counter()
    rank, world = engine.rank, engine.world_size
    reasons, src_ok, dst_ok = _local_reasons(
        engine, plan, src_buffers, dst_buffers, checks, timeout
    )
    # an unusable timeout is one of the reasons; the exchange itself waits the default
    timeout_s = DEFAULT_TIMEOUT_S if timeout_error(timeout) else float(timeout)
    try:
        fingerprint = plan.fingerprint
    except Exception as exc:  # noqa: BLE001 - a reason like any other
        fingerprint = f"unavailable on rank {rank}"
        reasons.append(f"plan fingerprint: {type(exc).__name__}: {exc}")
    try:
        pf.agree(
            reasons,
            fingerprint,
            engine.group,
            rank,
            world,
            engine.arena_device if engine.transport == "nccl" else torch.device("cpu"),
            timeout_s,
        )
    except PreflightError:
        raise
    except Exception as exc:  # the exchange itself failed: a peer died or timed out
        raise PreflightError(
            f"preflight exchange failed on rank {rank} ({type(exc).__name__}: {exc}); "
            "nothing was written on this rank",
            {rank: [str(exc)]},
        ) from exc
    t_pre = time.perf_counter()
    report = Report(
        rank=rank,
        world_size=world,
        transport=engine.transport,
        rounds=engine.num_rounds,
        fingerprint=str(fingerprint),
        bytes_sent=dict(engine.bytes_sent),
        bytes_received=dict(engine.bytes_received),
    )
    report.seconds["plan"] = plan_seconds
    report.seconds["preflight"] = t_pre - t_start
    report.staging_bound = engine.bound(engine.ring is not None)
    try:
        engine.run(src_ok, dst_ok, report, timeout_s)
    except Exception as exc:
        _retire(engine)
        raise TransferError(
            f"transfer failed on rank {rank} after writes began ({type(exc).__name__}: {exc}); "
            "targets may be partially written"
        ) from exc
    finally:
        _bump_versions(engine, dst_ok)
    report.peak_staging_bytes = engine.held()
    report.zero_copy_bytes = engine.zero_copy_bytes
    report.local_bytes = sum(n * dst_ok[dloc].element_size() for dloc, n in engine.local_elems)
    report.seconds["total"] = time.perf_counter() - t_start + plan_seconds
    log.info(
        "reshard rank %d/%d [%s]: %d rounds, sent %d B, received %d B, local %d B, "
        "%.3f ms, %.3f GB/s",
        rank,
        world,
        engine.transport,
        engine.num_rounds,
        report.total_bytes_sent,
        report.total_bytes_received,
        report.local_bytes,
        report.seconds["total"] * 1e3,
        report.gbps,
    )
    return report


class _CallLock:
    """Serializes calls; a call from the thread that already holds it (a readiness hook that
    calls the transfer it runs in) is refused instead of waiting for itself forever."""

    def __init__(self):
        self._lock = threading.Lock()
        self._owner = None

    def __enter__(self):
        if self._owner == threading.get_ident():
            raise RuntimeError(
                "a reshard transfer was called again from inside a call on the same thread "
                "(e.g. from a readiness hook); calls on one Transfer or one process group "
                "run one at a time"
            )
        self._lock.acquire()
        self._owner = threading.get_ident()
        return self

    def __exit__(self, *exc):
        self._owner = None
        self._lock.release()
        return False


# One lock per process group: the collectives of two calls on one group from two threads would
# interleave (gloo pairs operations in issue order), so calls on a group run one at a time.
_GROUP_LOCKS: dict = {}  # id(group) -> (group, _CallLock); the group is kept so ids stay unique
_GROUP_LOCKS_GUARD = threading.Lock()


def _group_lock(group):
    if group is None:  # in-process ("local"): no collectives to keep in order
        return contextlib.nullcontext()
    with _GROUP_LOCKS_GUARD:
        entry = _GROUP_LOCKS.get(id(group))
        if entry is None or entry[0] is not group:
            entry = _GROUP_LOCKS[id(group)] = (group, _CallLock())
        return entry[1]


def execute(plan, src_buffers, dst_buffers, group=None, *, checks=(), timeout=DEFAULT_TIMEOUT_S):
    """Run `plan` once: preflight (collective), then the rounds. Collective over `group`.

    src_buffers / dst_buffers: {location: 1-D contiguous tensor} for the locations this rank
    owns (ranks of `group`), or objects with `.buffers` and an optional `.check()` readiness
    hook. checks: extra callables raising to veto the transfer. timeout: seconds any wait may
    take (gloo; NCCL uses the group's timeout). Returns this rank's `Report`.
    """
    group, rank, world, transport = resolve_group(group)
    engine = _Engine(plan, group, rank, world, transport)
    with _group_lock(group):
        return _run(engine, plan, src_buffers, dst_buffers, checks, timeout, 0.0)


class Transfer:
    """A planned transfer for repeated syncs: plans once, keeps arenas and descriptor tensors.

    `Transfer(src, dst, budget_bytes_per_peer, group)` plans (pure, local: no collective);
    each call runs preflight + the rounds and returns a `Report`. The first call allocates the
    staging arenas; later calls allocate nothing.
    """

    def __init__(
        self,
        src,
        dst,
        budget_bytes_per_peer=64 << 20,
        group=None,
        *,
        budget_bytes_per_rank=None,
        timeout=DEFAULT_TIMEOUT_S,
        register_host_sources=False,
        register_host_targets=False,
    ):
        """budget_bytes_per_rank: cap each rank's total staging instead of (or as well as)
        the per-peer budget (see `reshard.plan`). register_host_sources: page-lock the CPU
        source buffers in place (cudaHostRegister) on the first call, so every sync DMAs
        straight from them (reshard.hostreg);
        register_host_targets: the same for CPU target buffers (GPU -> CPU syncs DMA straight
        into them). Undone by `close()`, on context exit, when a location's storage changes, or
        on collection; each Report says what was done in `host_registration` (targets under its
        "targets" key)."""
        from .planning import plan as make_plan

        t0 = time.perf_counter()
        p = make_plan(
            src,
            dst,
            budget_bytes_per_peer=budget_bytes_per_peer,
            budget_bytes_per_rank=budget_bytes_per_rank,
        )
        self._setup(
            p,
            time.perf_counter() - t0,
            group,
            timeout,
            register_host_sources,
            register_host_targets,
        )

    @classmethod
    def from_plan(
        cls,
        plan,
        group=None,
        *,
        timeout=DEFAULT_TIMEOUT_S,
        register_host_sources=False,
        register_host_targets=False,
    ) -> Transfer:
        """A Transfer around an existing plan (e.g. one shared by several groups' Transfers)."""
        self = cls.__new__(cls)
        self._setup(plan, 0.0, group, timeout, register_host_sources, register_host_targets)
        return self

    def _setup(
        self, plan, plan_seconds, group, timeout, register_host_sources, register_host_targets
    ):
        from .hostreg import HostRegistry

        self._hostreg = HostRegistry() if register_host_sources else None
        self._hostreg_targets = HostRegistry() if register_host_targets else None
        self.plan, self._plan_seconds = plan, plan_seconds
        bad_timeout = timeout_error(timeout)
        if bad_timeout:
            raise bad_timeout
        self.group, self.timeout = group, timeout
        self._engine = None
        self._lock = _CallLock()

    @property
    def engine_allocations(self) -> int:
        """How many staging tensors this Transfer holds (constant after the first call)."""
        e = self._engine
        if e is None:
            return 0
        return sum(len(v) for v in (e.arenas or {}).values()) + (e.ring is not None)

    def __call__(self, src_buffers, dst_buffers, *, checks=()) -> Report:
        """One sync (collective over the group). Calls on one Transfer never interleave:
        a call made while another runs (another thread) waits for it to finish."""
        with self._lock:
            return self._call(src_buffers, dst_buffers, checks)

    def _call(self, src_buffers, dst_buffers, checks) -> Report:
        if self._engine is not None and self._engine.broken:
            self._engine = None  # a failed call's arenas may still be written: start afresh
        if self._engine is None:
            group, rank, world, transport = resolve_group(self.group)
            self._engine = _Engine(self.plan, group, rank, world, transport)
            plan_s, self._plan_seconds = self._plan_seconds, 0.0
        else:
            plan_s = 0.0
        reg = _register(self._hostreg, src_buffers)
        reg_targets = _register(self._hostreg_targets, dst_buffers)
        if reg_targets is not None:
            reg = dict(reg or {}, targets=reg_targets)
        with _group_lock(self._engine.group):
            report = _run(
                self._engine, self.plan, src_buffers, dst_buffers, checks, self.timeout, plan_s
            )
        if reg is not None:
            report.host_registration = reg
        return report

    def close(self) -> None:
        """Undo host registrations (if any). The Transfer stays usable (it re-registers)."""
        for registry in (self._hostreg, self._hostreg_targets):
            if registry is not None:
                registry.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def _register(registry, buffers):
    """Page-lock `buffers`' CPU storages through `registry` (None: not asked for). An
    optimization only: on failure the sync still runs, bounced through the ring."""
    if registry is None:
        return None
    bufs = getattr(buffers, "buffers", buffers)
    try:
        return registry.sync(bufs if isinstance(bufs, dict) else {})
    except RuntimeError as exc:
        return {"error": str(exc)}
