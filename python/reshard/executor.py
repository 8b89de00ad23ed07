"""Execute a plan on live buffers: preflight, then rounds of pack -> send/recv -> unpack.

    report = execute(plan, src_buffers, dst_buffers, group=None)     # one-off
    sync = Transfer(src_layout, dst_layout, budget_bytes_per_peer, group)
    report = sync(src_buffers, dst_buffers)                          # every step: no re-plan,
                                                                     # arenas reused
The flow of one call: `preflight.run` (this rank's schedule built and checked, buffers
checked, staging allocated, then the collective agreement), then `_RoundLoop`
over the typed rounds of `reshard.rounds`: per round k (global order, the same on every
rank) pack this rank's messages of round k with `copy_runs` into a send arena, post the
round's receives and sends, wait, unpack out of the receive arena. Two arenas per direction
(`reshard.staging`): rounds are posted ahead as far as they allow, so the next round is packed
and in flight while one is unpacked. A message (or a part of one that both ends cut alike)
that is one contiguous range of one buffer in the wire dtype is sent straight from the source
(or received straight into the target) instead: no copy, no arena bytes. Local runs skip
transport and arenas.

Transports: gloo (CPU buffers, host arenas), NCCL (arenas in device memory; CUDA buffers are
packed on the device; CPU buffers are packed/scattered on the host and moved through one bounded
pinned ring by the stage_h2d/stage_d2h ops, docs/cuda.md), and "local"
(no process group initialized: every storage must be on rank 0; no collectives).

Failure model: every failure before the first write (argument types and the timeout
included) is a collective `PreflightError` with nothing written, except what leaves this rank
no group to agree over (a `group` that is not a usable process group, a missing
init_process_group under a launcher): raised on this rank before any collective (a plan that
fails on one rank raises LayoutError there: `Transfer.refusing` lets that rank join its
peers' preflight instead); when the ranks reached the
agreement far apart, a commit step follows, so a rank whose peers gave up on it never writes
(docs/executor.md states the windows left). Any failure after the agreement is a
`TransferError`: targets may be partially written; an interrupt there (or one that leaves this
rank out of its exchange) marks the group out of step. Waits are bounded by `timeout` (gloo) or the group's own timeout (NCCL watchdog):
never a hang. Calls on one Transfer, and on one process group, run one at a time.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import logging
import os
import sys
import threading
import time
import weakref

import torch
import torch.distributed as dist

from . import _ops, staging
from . import preflight as pf
from .errors import PreflightError, TransferError
from .h2d import HostToDevice, LocalSpans, contiguous_spans, current_progress
from .report import STAGING_KINDS, Report
from .rounds import RECV, SEND, build_rounds, local_tables, wire_parts

_ops.require_built()  # every torch.ops.reshard op is used here: say how to build, up front
log = logging.getLogger("reshard")

DEFAULT_TIMEOUT_S = pf.DEFAULT_TIMEOUT_S


def _copy_runs_op():
    return torch.ops.reshard.copy_runs


def check_group_type(group) -> None:
    """A TypeError for a `group` that is no process group at all (a name such as "world"),
    raised on this rank before any collective: the ranks that share the bug raise it at once;
    a peer that passed a real group waits out its timeout (it cannot know which group this
    rank meant) and raises PreflightError."""
    if group is None or group is _NON_MEMBER:
        return
    if not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
        raise TypeError(
            "group must be a torch.distributed ProcessGroup (dist.new_group(...), "
            f"dist.group.WORLD) or None for the default group, got {type(group).__name__} "
            f"{group!r}"
        )


_NON_MEMBER = dist.GroupMember.NON_GROUP_MEMBER if dist.is_available() else object()


def _launched_world_size() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def resolve_group(group):
    """(group, rank, world_size, transport) with rank and size taken from the group itself.
    group=None is the default group as it is now (a group built again after
    destroy_process_group is a new one), or in-process execution when none is initialized."""
    check_group_type(group)
    if group is None and not (dist.is_available() and dist.is_initialized()):
        world = _launched_world_size()
        if world > 1:  # torchrun & co. set WORLD_SIZE; each process would run alone as rank 0
            raise RuntimeError(
                f"WORLD_SIZE={world} in the environment (a launcher started {world} processes) "
                "but torch.distributed is not initialized: call "
                "torch.distributed.init_process_group(...) before the transfer, or each "
                "process would run it alone as rank 0"
            )
        return None, 0, 1, "local"
    if group is None:
        group = dist.group.WORLD
    if group is _NON_MEMBER:
        raise ValueError(
            f"global rank {dist.get_rank()} is not a member of the process group it was given: "
            "only the group's members call a transfer on that group"
        )
    try:
        rank = dist.get_rank(group)
    except (ValueError, RuntimeError) as exc:  # destroyed, or of an earlier init
        raise ValueError(
            f"the process group passed ({group!r}) is not usable here: it was destroyed "
            "(destroy_process_group) or belongs to an earlier init_process_group; build the "
            f"group again and pass the new one ({exc})"
        ) from exc
    if rank < 0:
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
    return group, rank, dist.get_world_size(group), transport


class _Engine:
    """What one rank keeps for one plan (per Transfer, or per execute call): the schedule's
    derived tables, the typed rounds for the current set of buffers and the staging. It is
    the context `preflight.run` checks: `prepare()` builds the schedule inside the collective
    step, `allocate()` lays out the rounds and allocates the staging."""

    def __init__(self, plan, group, rank, world_size, transport, make_staging=None):
        self.plan, self.group, self.rank = plan, group, rank
        self.make_staging = make_staging or staging.Staging
        self.world_size, self.transport = world_size, transport
        if transport == "nccl":
            self.arena_device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.arena_device = torch.device("cpu")
        # the collective preflight's tensors live where the transport wants them
        self.exchange_device = self.arena_device
        self.sched = None  # built by prepare()
        # preflight: where the last passing call's buffers were, and whether they need the ring
        self.verified_placement, self.verified_need_ring = None, False
        self.staging = None
        self.rounds = None  # rounds.Rounds for `direct_locations`
        self.direct_locations = None
        self._direct_key = None  # the preflight key `direct_locations` was made for
        self.inflight = ()  # the rounds in flight: (round, p2p works, the tensors they use)
        self.broken = False  # a call failed after the agreement: never reuse these arenas
        # (devices and dtypes, the preflight key object last seen with them, (HostToDevice or
        # None, other local tables)): the paths and what their HostToDevice learned are kept
        # while the devices and dtypes stay, whichever way a call reaches them
        self._local_paths = (None, None, None)
        self._spans = None  # per local table: its contiguous spans, or None
        self._bound = None  # (ring held, the bound with / without it)

    def prepare(self) -> list[str]:
        """Build this rank's schedule and everything derived from it (once); return why it
        cannot run here (`preflight.check_schedule`)."""
        if self.sched is not None:
            return self.schedule_reasons
        sched = self.plan.schedule(self.rank)
        self.schedule_reasons = pf.check_schedule(
            sched, self.rank, self.world_size, self.plan.src.storages, self.plan.dst.storages
        )
        self.local = local_tables(sched)
        self.local_pairs = tuple((t.src_location, t.dst_location) for t in self.local)
        # target dtypes are the storages' (preflight checks every buffer against them)
        self.local_bytes = sum(
            t.elements * self.plan.dst.storages[t.dst_location].dtype.itemsize for t in self.local
        )
        self.bytes_sent, self.bytes_received = {}, {}
        self.global_peer = {}
        for msgs, acc in ((sched.sends, self.bytes_sent), (sched.recvs, self.bytes_received)):
            for m in (m for round_msgs in msgs for m in round_msgs):
                # the bytes that travel: padding between a message's wires does not
                acc[m.peer] = acc.get(m.peer, 0) + sum(part.nbytes for part in wire_parts(m))
                if 0 <= m.peer < self.world_size:  # else a reason of check_schedule
                    self.global_peer[m.peer] = (
                        dist.get_global_rank(self.group, m.peer)
                        if self.group is not None
                        else m.peer
                    )
        # the locations messages read / write: per call, only their buffers' devices matter
        self.message_locations = {
            side: frozenset(getattr(seg, attr) for rm in msgs for m in rm for seg in m.segments)
            for side, msgs, attr in (
                (SEND, sched.sends, "src_location"),
                (RECV, sched.recvs, "dst_location"),
            )
        }
        # every target location this rank writes: their version counters move after a call
        self.written_locations = tuple(
            frozenset(self.message_locations[RECV]) | {dloc for _, dloc in self.local_pairs}
        )
        self._written = None
        self.staging = self.make_staging(self.arena_device, sched.num_rounds)
        self.sched = sched
        return self.schedule_reasons

    @property
    def num_rounds(self) -> int:
        return int(self.sched.num_rounds)

    def written(self) -> dict:
        """{target location: merged element intervals this rank writes} (for aliasing)."""
        if self._written is None:
            self._written = pf.written_elements(self.sched)
        return self._written

    def ring_bytes(self) -> int:
        return staging.ring_bytes(getattr(self.plan, "budget_bytes_per_peer", None))

    def bound(self) -> dict:
        """The plan's staging bound for what this rank holds (a fresh dict; computed again
        only when the ring comes or goes). The in-process ("local") transport has no arenas;
        its only staging is the ring, counted as under NCCL."""
        ring = self.staging.ring is not None
        if self._bound is None or self._bound[0] != ring:
            self._bound = (ring, self._compute_bound(ring))
        return dict(self._bound[1])

    def _compute_bound(self, ring: bool) -> dict:
        nccl = self.transport == "nccl" or (ring and self.transport == "local")
        ring_bytes = self.ring_bytes() if ring else 0
        b = self.plan.staging_bytes(
            self.rank, transport="nccl" if nccl else "gloo", host_ring_bytes=ring_bytes
        )
        out = {k: int(b.get(k, 0)) for k in STAGING_KINDS}
        out["device"] += self.staging.stage_device_bytes()
        return out

    @property
    def local_h2d(self):
        """The batched CPU -> CUDA path (reshard.h2d) of the local tables as the last call
        used it, or None (benchmarks read what it did: `.last`)."""
        paths = self._local_paths[2]
        return paths[0] if paths else None

    def local_paths(self, src: dict, dst: dict, buffers_key=None):
        """(the batched CPU -> CUDA path of the local tables that qualify or None, the other
        local tables), for the devices and dtypes of this call's buffers (reshard.h2d).
        buffers_key: the preflight key these buffers cleared with (`verified_buffers`); the
        same object as the last call's means the same devices and dtypes, location by
        location, so the paths are that call's."""
        cached_key, cached_buffers_key, cached = self._local_paths
        if buffers_key is not None and buffers_key is cached_buffers_key:
            return cached
        if self.transport == "gloo":  # preflight: every buffer of a gloo transfer is on the CPU
            key = "cpu"
        else:
            key = tuple(
                (src[a].device, src[a].dtype, dst[b].device, dst[b].dtype)
                for a, b in self.local_pairs
            )
        if cached_key == key:
            if buffers_key is not None:
                self._local_paths = (key, buffers_key, cached)
            return cached
        if self._spans is None:
            self._spans = [contiguous_spans(t.desc.numpy()) for t in self.local]
        here = torch.cuda.current_device() if torch.cuda.is_available() else None
        batched, rest = [], []
        for t, spans in zip(self.local, self._spans, strict=True):
            s, d = src[t.src_location], dst[t.dst_location]
            ok = (
                spans is not None
                and self.staging.ring is not None
                and s.device.type == "cpu"
                and d.device.type == "cuda"
                and d.device.index == here
                and d.element_size() <= s.element_size()
            )
            (batched if ok else rest).append(LocalSpans(t, spans) if ok else t)
        paths = (HostToDevice(batched) if batched else None, tuple(rest))
        self._local_paths = (key, buffers_key, paths)
        return paths

    def allocate(self, src: dict, dst: dict, need_ring: bool, buffers_key=None) -> None:
        """Lay out the rounds and allocate the staging (once), then check it against the
        plan's bound. `src` / `dst`: the validated buffers. A message skips the arena only
        where its buffer lives on the arena's device (under NCCL a CPU buffer goes through
        the ring instead), so the layout is redone only if that set of buffers changes (never
        under gloo: preflight holds every buffer of this rank's locations to the CPU).
        buffers_key: the preflight key of these buffers (`preflight._call_key`); the same
        object as the one the current layout was made for means the same devices, location by
        location, so the set is not read again."""
        if self.transport == "gloo" and self.direct_locations is not None:
            direct = self.direct_locations
        elif buffers_key is not None and buffers_key is self._direct_key:
            direct = self.direct_locations
        else:
            direct = frozenset(
                [(SEND, loc) for loc, t in src.items() if t.device == self.arena_device]
                + [(RECV, loc) for loc, t in dst.items() if t.device == self.arena_device]
            )
        if self.staging.arenas is None or (
            direct is not self.direct_locations and direct != self.direct_locations
        ):
            dtype_of = {SEND: lambda loc: src[loc].dtype, RECV: lambda loc: dst[loc].dtype}
            self.rounds = build_rounds(self.sched, direct, dtype_of)
            self.staging.allocate_arenas(self.rounds.send_arena_bytes, self.rounds.recv_arena_bytes)
            self.direct_locations = direct
        self._direct_key = buffers_key
        if need_ring:
            self.staging.allocate_ring(self.ring_bytes())
        held, bound = self.staging.held(), self.bound()
        if any(held[k] > bound[k] for k in held):
            raise RuntimeError(f"staging held {held} exceeds the plan's bound {bound}")


class _RoundLoop:
    """One call's run over the rounds: pack -> post -> wait -> unpack, double-buffered."""

    def __init__(self, engine, src, dst, seconds, timeout_s, buffers_key=None):
        self.e, self.src, self.dst, self.sec = engine, src, dst, seconds
        self.buffers_key = buffers_key  # the preflight key the buffers cleared with
        self.copy_runs = _copy_runs_op()
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.ring = engine.staging.ring
        # device work of this call still queued on the current stream when the rounds end
        # (the stage ops and reshard.h2d return once their copies are done)
        self.queued = engine.num_rounds > 0

    def _copy(self, src, desc, dst, phase, staged=None):
        """copy_runs when both sides share a device, else the stage op through the ring
        (a CPU side under NCCL); that time moves from `phase` to `staged` ("h2d" / "d2h")."""
        if src.device == dst.device:
            self.copy_runs(src, desc, dst)
            self.queued = self.queued or src.device.type == "cuda"
            return
        t1 = time.perf_counter()
        if src.device.type == "cpu":
            torch.ops.reshard.stage_h2d(src, desc, self.ring, dst)
        else:
            torch.ops.reshard.stage_d2h(src, desc, self.ring, dst)
        if staged is not None:
            dt = time.perf_counter() - t1
            self.sec[staged] += dt
            self.sec[phase] -= dt

    def pack(self, rnd):
        t0 = time.perf_counter()
        arena = self.e.staging.arena(SEND, rnd.index)
        for t in rnd.pack:
            self._copy(self.src[t.location], t.desc, _wire_view(arena, t.wire_dtype), "pack", "h2d")
        self.sec["pack"] += time.perf_counter() - t0

    def unpack(self, rnd):
        t0 = time.perf_counter()
        arena = self.e.staging.arena(RECV, rnd.index)
        for t in rnd.unpack:
            self._copy(
                _wire_view(arena, t.wire_dtype), t.desc, self.dst[t.location], "unpack", "d2h"
            )
        self.sec["unpack"] += time.perf_counter() - t0

    def local(self):
        t0 = time.perf_counter()
        if self.e.local:
            batched, rest = self.e.local_paths(self.src, self.dst, self.buffers_key)
            if batched is not None:
                # progress (a Stream's bucket) only where the batched path writes every target
                # byte of the call: no rounds from peers, no other local table
                progress = current_progress() if not rest and self.e.num_rounds == 0 else None
                batched.run(
                    self.src,
                    self.dst,
                    self.ring,
                    self.e.staging.stage_device_bytes(),
                    progress=progress,
                )
            for t in rest:
                self._copy(self.src[t.src_location], t.desc, self.dst[t.dst_location], "local")
        self.sec["local"] += time.perf_counter() - t0

    def post(self, rnd, wires, works, bufs):
        """Post `wires` of `rnd`, appending each work and the tensor it uses to `works` /
        `bufs` as it is posted (already in flight when a later post fails). Under gloo
        straight on the process group (no per-op checks); under NCCL as one batch (its grouped
        launch keeps opposite sends from deadlocking)."""
        t0 = time.perf_counter()
        e = self.e
        start = len(bufs)
        for w in wires:
            if w.direct is not None:  # straight from the source / into the target
                r = w.direct
                buf = (self.src if w.send else self.dst)[r.location].view(torch.uint8)
                bufs.append(buf[r.first_byte : r.end_byte])
            else:
                arena = e.staging.arena(SEND if w.send else RECV, rnd.index)
                bufs.append(arena[w.arena_offset : w.arena_offset + w.nbytes])
        if e.transport == "gloo":
            pg = e.group
            for w, b in zip(wires, bufs[start:], strict=True):
                works.append(pg.send([b], w.peer, 0) if w.send else pg.recv([b], w.peer, 0))
        elif wires:
            ops = [
                dist.P2POp(dist.isend if w.send else dist.irecv, b, e.global_peer[w.peer], e.group)
                for w, b in zip(wires, bufs[start:], strict=True)
            ]
            works += dist.batch_isend_irecv(ops)
        self.sec["transport"] += time.perf_counter() - t0

    def start(self, rnd, flight):
        """Pack and post `rnd`, in flight from its first post. Under gloo its receives are
        posted before the packing (a message moves only once its receive is posted: the
        peer's sends then find theirs waiting and go out at once); under NCCL one batch after
        the packing."""
        works, bufs = [], []
        flight.append((rnd, works, bufs))
        if self.e.transport == "gloo":
            self.post(rnd, rnd.wires[: rnd.first_send], works, bufs)
            self.pack(rnd)
            self.post(rnd, rnd.wires[rnd.first_send :], works, bufs)
        else:
            self.pack(rnd)
            self.post(rnd, rnd.wires, works, bufs)

    def wait(self, works):
        t0 = time.perf_counter()
        for w in works:
            if self.e.transport == "gloo":
                w.wait(self.timeout)
            else:
                w.wait()
        self.sec["transport"] += time.perf_counter() - t0

    def run(self):
        # Arena k % 2 of a direction serves round k. Rounds are posted ahead, in global order,
        # as far as the arenas allow: round j waits only for an earlier round of its parity
        # that uses the same arena to be done with it (its sends waited, its receives
        # unpacked), so with packed messages two rounds are in flight, and rounds whose
        # messages all go straight between buffers are all posted before the first wait.
        # Packing the next round and unpacking the last one overlap the rounds in flight, and
        # the local copies overlap every round posted before them.
        e, rounds = self.e, self.e.rounds.rounds
        flight = e.inflight = collections.deque()  # (round, works, tensors) posted, not unpacked
        nxt = 0

        def fill():
            nonlocal nxt
            while nxt < len(rounds) and _arenas_free(rounds[nxt], flight):
                self.start(rounds[nxt], flight)
                nxt += 1

        fill()
        self.local()
        while flight:
            rnd, works, _ = flight[0]
            self.wait(works)
            self.unpack(rnd)
            flight.popleft()
            fill()
            if log.isEnabledFor(logging.DEBUG):
                log.debug(
                    "reshard rank %d round %d/%d: sent %d B, received %d B",
                    e.rank,
                    rnd.index + 1,
                    len(rounds),
                    rnd.bytes_sent,
                    rnd.bytes_received,
                )
        if self.queued and e.arena_device.type == "cuda":
            torch.cuda.current_stream().synchronize()


def _arenas_free(rnd, flight) -> bool:
    """Whether `rnd` may be packed and posted now: no round in flight uses an arena of the
    same index (round parity) in a direction `rnd` packs into."""
    for other, _, _ in flight:
        if (other.index - rnd.index) % 2 == 0 and (
            (rnd.uses_send_arena and other.uses_send_arena)
            or (rnd.uses_recv_arena and other.uses_recv_arena)
        ):
            return False
    return True


def _wire_view(arena: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    isz = dtype.itemsize
    return arena[: arena.numel() // isz * isz].view(dtype)


# Engines of failed transfers: a receive posted before the failure may still complete into
# their arenas (a peer that was only late), so that memory must outlive the error. Bounded:
# each entry is at most one plan's staging, and failures are rare and usually fatal.
_GRAVEYARD: list = []
_GRAVEYARD_MAX = 8


def _retire(engine) -> None:
    engine.broken = True
    if engine.inflight:
        _GRAVEYARD.append(engine)
        del _GRAVEYARD[:-_GRAVEYARD_MAX]


def _bump_versions(engine, dst_ok) -> None:
    """Autograd sees the writes: the version counter of every target this rank's schedule
    writes moves, as after a torch in-place op (zero-copy receives write targets outside any
    op)."""
    try:  # a cleared call passed every target this rank writes
        written = list(map(dst_ok.__getitem__, engine.written_locations))
    except KeyError:
        written = [dst_ok[loc] for loc in engine.written_locations if loc in dst_ok]
    if written:
        torch.autograd.graph.increment_version(written)


def _in_step(exc, outer) -> bool:
    """Whether `exc`, raised by a call's preflight, leaves the ranks in step: a PreflightError
    (every rank raised it, or this rank's failed exchange marked the group itself), or the
    interrupt of a hook that the preflight raises again once every rank raised its
    PreflightError (the interrupt's context). An interrupt anywhere else (as the preflight
    returns: its peers go on to the rounds) leaves them out of step. `outer`: what the caller
    was handling when it called, the context of an interrupt that arrives outside that
    PreflightError."""
    if isinstance(exc, PreflightError):
        return True
    return isinstance(exc.__context__, PreflightError) and exc.__context__ is not outer


def _run(engine, src_buffers, dst_buffers, checks, timeout, plan_seconds):
    """One call on `engine`: (its Report, what preflight cleared)."""
    t_start = time.perf_counter()
    outer = sys.exc_info()[1]  # what the caller is handling: no refusal of this call
    cleared = None
    # One try from the preflight to the end of the rounds: once the ranks agreed, a rank that
    # stops anywhere (an interrupt as the preflight returns, an error building the Report)
    # leaves its peers in the rounds, so its group is out of step like after a stop mid-rounds
    try:
        cleared = pf.run(engine, src_buffers, dst_buffers, checks, timeout)
        report = Report(
            rank=engine.rank,
            world_size=engine.world_size,
            transport=engine.transport,
            rounds=engine.num_rounds,
            fingerprint=cleared.fingerprint,
            bytes_sent=dict(engine.bytes_sent),
            bytes_received=dict(engine.bytes_received),
        )
        report.seconds["plan"] = plan_seconds
        report.seconds.update(cleared.seconds)
        report.staging_bound = engine.bound()
        verified = getattr(engine, "verified_buffers", None)
        key = verified[0] if verified is not None else None
        # a transfer moves values, never gradients: sources that require grad (a model's
        # parameters) must not give the targets an autograd history
        with torch.no_grad():
            _RoundLoop(
                engine, cleared.src, cleared.dst, report.seconds, cleared.timeout_s, key
            ).run()
    except BaseException as exc:  # KeyboardInterrupt too: arenas may still be written
        if cleared is None:  # raised by the preflight, or as it returned
            if engine.world_size > 1 and not _in_step(exc, outer):
                pf.mark_out_of_step(
                    engine.group,
                    f"a transfer stopped around its preflight exchange on rank {engine.rank} "
                    f"({exc!r})",
                )
            raise
        _retire(engine)
        if engine.world_size > 1:  # rounds abandoned part-way, posted to peers
            pf.mark_out_of_step(
                engine.group, f"a transfer stopped mid-rounds on rank {engine.rank} ({exc!r})"
            )
        if not isinstance(exc, Exception):
            raise
        hint = f"; {pf.REBUILD}" if engine.world_size > 1 else ""
        raise TransferError(
            f"transfer failed on rank {engine.rank} after writes began "
            f"({type(exc).__name__}: {exc}); targets may be partially written{hint}"
        ) from exc
    finally:
        if cleared is not None:
            _bump_versions(engine, cleared.dst)
    report.peak_staging_bytes = engine.staging.held()
    report.zero_copy_bytes = engine.rounds.zero_copy_bytes if engine.rounds else 0
    report.local_bytes = engine.local_bytes
    report.seconds["total"] = time.perf_counter() - t_start + plan_seconds
    if log.isEnabledFor(logging.INFO):
        log.info(
            "reshard rank %d/%d [%s]: %d rounds, sent %d B, received %d B, local %d B, "
            "%.3f ms, %.3f GB/s",
            engine.rank,
            engine.world_size,
            engine.transport,
            engine.num_rounds,
            report.total_bytes_sent,
            report.total_bytes_received,
            report.local_bytes,
            report.seconds["total"] * 1e3,
            report.gbps,
        )
    return report, cleared


class _CallLock:
    """Serializes calls. A call from the thread that already holds it (a readiness hook that
    calls the transfer it runs in, a Transfer inside a Stream's loop body) is refused instead
    of waiting for itself forever; a call from another thread waits at most its timeout.
    Either error names what holds the lock."""

    def __init__(self):
        self._lock = threading.Lock()
        self._owner = None
        self._holder = None

    def acquire(self, holder: str, timeout: float | None = None) -> _CallLock:
        if self._owner == threading.get_ident():
            raise RuntimeError(
                f"a reshard call was made on the thread where {self._holder} holds this "
                "process group (or Transfer), e.g. from a readiness hook or a Stream's loop "
                "body: calls on one Transfer or one process group run one at a time, so it "
                "would wait for itself; finish or close the other call first"
            )
        if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
            raise TimeoutError(
                f"waited {timeout:g} s for {self._holder} on another thread to release this "
                "process group: calls on a group run one at a time (an rs.Stream iteration "
                "holds it until its loop ends or the generator is closed)"
            )
        self._owner, self._holder = threading.get_ident(), holder
        return self

    def __enter__(self):
        return self.acquire("a reshard call")

    def __exit__(self, *exc):
        self._owner = self._holder = None
        self._lock.release()
        return False


@contextlib.contextmanager
def _holding(lock, holder: str, timeout: float):
    """Hold `lock` (a _CallLock, or a nullcontext when there is nothing to order) for a call.
    A bad timeout (the call's preflight refuses it, on every rank) waits the default one."""
    if isinstance(lock, _CallLock):
        lock.acquire(holder, DEFAULT_TIMEOUT_S if pf.timeout_error(timeout) else timeout)
        try:
            yield
        finally:
            lock.__exit__()
    else:
        with lock:
            yield


# One lock per process group: the collectives of two calls on one group from two threads would
# interleave (gloo pairs operations in issue order), so calls on a group run one at a time.
# Weak keys: a destroyed group (and its sockets) is freed once its users drop it.
_GROUP_LOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_GROUP_LOCKS_GUARD = threading.Lock()


def _call_lock(group, in_process):
    """The lock a call holds: its process group's (shared by every Transfer and execute call
    on the group), or `in_process` when there is no group (nothing collective to order)."""
    if group is None:
        return in_process
    with _GROUP_LOCKS_GUARD:
        lock = _GROUP_LOCKS.get(group)
        if lock is None:
            lock = _GROUP_LOCKS[group] = _CallLock()
        return lock


def execute(plan, src_buffers, dst_buffers, group=None, *, checks=(), timeout=DEFAULT_TIMEOUT_S):
    """Run `plan` once: preflight (collective), then the rounds. Collective over `group`.

    src_buffers / dst_buffers: {location: 1-D contiguous tensor} for the locations this rank
    owns (ranks of `group`), or objects with `.buffers` and an optional `.check()` readiness
    hook. checks: extra callables raising to veto the transfer. timeout: seconds any wait may
    take (gloo; NCCL uses the group's timeout). Returns this rank's `Report`.
    """
    group, rank, world, transport = resolve_group(group)
    engine = _Engine(plan, group, rank, world, transport)
    lock = _call_lock(group, contextlib.nullcontext())  # a fresh engine: nothing else shared
    with _holding(lock, "a reshard.execute call", timeout):
        return _run(engine, src_buffers, dst_buffers, checks, timeout, 0.0)[0]


def refuse(plan, reasons, group=None, *, timeout=DEFAULT_TIMEOUT_S) -> None:
    """This rank's side of a call of `plan` that its peers make and it cannot (it failed to
    get its buffers ready): joins their preflight with `reasons`, so every rank raises the
    same PreflightError naming this rank and them, and nothing is written. `plan` may be None
    when this rank could not plan. Collective over `group`; always raises."""
    group, rank, world, transport = resolve_group(group)
    engine = _Engine(plan, group, rank, world, transport)
    lock = _call_lock(group, contextlib.nullcontext())
    with _holding(lock, "a reshard.refuse call", timeout):
        pf.refuse(engine, reasons, timeout)


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
        source buffers in place (cudaHostRegister), so syncs DMA straight from them
        (reshard.hostreg); register_host_targets: the same for CPU target buffers (GPU -> CPU
        syncs DMA straight into them). A call starts the registration on a thread after its
        copies and no call waits for it: syncs bounce through the pinned ring until it is done
        (`wait_host_registration()` waits for it). Undone by `close()`, on context exit, when a
        location's storage changes, or on collection; each Report says what was done in
        `host_registration` (targets under its "targets" key; "pending" while the thread
        runs)."""
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
        staging=None,
    ) -> Transfer:
        """A Transfer around an existing plan (e.g. one shared by several groups' Transfers).
        staging: a callable `(device, num_rounds) -> reshard.staging.Staging` (default: the
        class itself), so Transfers that never run at the same time can share arenas."""
        self = cls.__new__(cls)
        self._setup(plan, 0.0, group, timeout, register_host_sources, register_host_targets)
        self._make_staging = staging
        return self

    @classmethod
    def refusing(cls, error, group=None, *, timeout=DEFAULT_TIMEOUT_S) -> Transfer:
        """A Transfer for a rank that could not build its own: every call (collective, as
        any call) joins its peers' call with `error` as this rank's reason, so every rank
        raises the same PreflightError naming this rank, and nothing is written anywhere.

            try:
                sync = rs.Transfer(live.layout, dst_layout, group=g)
            except rs.LayoutError as exc:  # this rank's layout may differ from its peers'
                sync = rs.Transfer.refusing(exc, group=g)
            sync(live, dst_buffers)         # every rank: PreflightError naming this rank

        error: the exception construction raised, a reason, or a list of reasons. It has no
        plan (`.plan` is None): its fingerprint is not compared with its peers', and the
        `notes` of the buffer objects a call passes are listed under its reasons."""
        if isinstance(error, BaseException):
            reasons = [f"{type(error).__name__}: {error}"]
        elif isinstance(error, str):
            reasons = [error]
        elif isinstance(error, (list, tuple)) and all(isinstance(r, str) for r in error):
            reasons = list(error)
        else:
            raise TypeError(
                "Transfer.refusing(error): expected the exception this rank's Transfer(...) "
                f"raised, a reason or a list of reasons, got {type(error).__name__}"
            )
        self = cls.__new__(cls)
        self._setup(None, 0.0, group, timeout, False, False)
        self._refusal = reasons or ["this rank could not build its Transfer"]
        return self

    def _setup(
        self, plan, plan_seconds, group, timeout, register_host_sources, register_host_targets
    ):
        from .hostreg import HostRegistry

        for what, value in (
            ("register_host_sources", register_host_sources),
            ("register_host_targets", register_host_targets),
        ):
            if not isinstance(value, bool):  # "no" would turn it on
                raise TypeError(f"{what} must be True or False, got {value!r}")
        self._hostreg = HostRegistry(background=True) if register_host_sources else None
        self._hostreg_targets = HostRegistry(background=True) if register_host_targets else None
        self.plan, self._plan_seconds = plan, plan_seconds
        bad_timeout = pf.timeout_error(timeout)
        if bad_timeout:
            raise bad_timeout
        check_group_type(group)  # resolved per call: the default group may be built later
        self.group, self.timeout = group, timeout
        self._engine = None
        self._make_staging = None
        self._lock = _CallLock()
        self._registered_key = None  # preflight's key of the buffers the registries last saw
        self._refusal = None  # Transfer.refusing: the reasons every call refuses with

    @property
    def engine_allocations(self) -> int:
        """How many staging tensors this Transfer holds (constant after the first call)."""
        e = self._engine
        return 0 if e is None or e.staging is None else e.staging.allocations

    def __call__(self, src_buffers, dst_buffers, *, checks=()) -> Report:
        """One sync (collective over the group). Calls never interleave: a call made while
        another runs on the same group (or, without a group, on this Transfer) waits for it."""
        if self._refusal is not None:
            self._refuse(self._refusal, _notes(src_buffers, dst_buffers))
        resolved = resolve_group(self.group)
        with _holding(_call_lock(resolved[0], self._lock), "a Transfer call", self.timeout):
            return self._call(resolved, src_buffers, dst_buffers, checks)

    def refuse(self, reasons) -> None:
        """This rank's side of a call its peers make on this Transfer when it cannot make
        it (it failed to get its buffers ready): every rank raises the same PreflightError
        naming this rank and `reasons`; nothing is written. Collective; always raises."""
        self._refuse([*(self._refusal or ()), *map(str, reasons)], ())

    def _refuse(self, reasons, notes) -> None:
        resolved = resolve_group(self.group)
        with _holding(_call_lock(resolved[0], self._lock), "a Transfer call", self.timeout):
            group, rank, world, transport = resolved
            e = self._engine
            if e is None or e.broken or (e.group, e.rank, e.world_size) != resolved[:3]:
                e = _Engine(self.plan, group, rank, world, transport, self._make_staging)
            pf.refuse(e, reasons, self.timeout, notes)

    def _call(self, resolved, src_buffers, dst_buffers, checks) -> Report:
        e = self._engine
        if e is not None and (e.broken or (e.group, e.rank, e.world_size) != resolved[:3]):
            # a failed call's arenas may still be written; or group=None now resolves to
            # another group (destroy_process_group and init again, or a first call made before
            # init_process_group): start afresh
            self._engine = None
        if self._engine is None:
            group, rank, world, transport = resolved
            self._engine = _Engine(self.plan, group, rank, world, transport, self._make_staging)
            plan_s, self._plan_seconds = self._plan_seconds, 0.0
        else:
            plan_s = 0.0
        report, cleared = _run(self._engine, src_buffers, dst_buffers, checks, self.timeout, plan_s)
        if self._hostreg is None and self._hostreg_targets is None:
            return report
        # After the copies: page-locking holds the driver, so a registration running during
        # them would delay this call's copies as much as registering first. The registries
        # saw the buffers of the last call they synced; preflight's key object for them is
        # the same only when every buffer is, location by location, that call's storage.
        key = getattr(self._engine, "verified_buffers", None)
        unchanged = key is not None and key is self._registered_key
        self._registered_key = key
        reg = _register(self._hostreg, cleared.src, unchanged)
        reg_targets = _register(self._hostreg_targets, cleared.dst, unchanged)
        if reg_targets is not None:
            reg = dict(reg or {}, targets=reg_targets)
        if reg is not None:
            report.host_registration = reg
        return report

    def wait_host_registration(self) -> dict:
        """Wait for the background host registration of this Transfer's buffers (if any) and
        return what it did ({"sources": ..., "targets": ...}, as HostRegistry.wait says)."""
        lock = _call_lock(resolve_group(self.group)[0], self._lock)
        with _holding(lock, "a Transfer call", self.timeout):
            return {
                side: registry.wait()
                for side, registry in (
                    ("sources", self._hostreg),
                    ("targets", self._hostreg_targets),
                )
                if registry is not None
            }

    def __reduce_ex__(self, protocol):
        # its arenas, locks, host registrations and group are this process's own
        raise TypeError(
            "a reshard.Transfer cannot be pickled or copied (it holds this process's staging, "
            "locks and process group): pickle its .plan and build "
            "reshard.Transfer.from_plan(plan, group=...) where it is needed"
        )

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


def _notes(*buffer_sets) -> list:
    """The `notes` of buffer objects (an integration's describe() result: how this rank's
    state shaped its layout); none for mappings or objects that cannot be read."""
    notes = []
    for obj in buffer_sets:
        try:
            notes += pf.as_buffer_set(obj, "").notes
        except Exception:  # noqa: BLE001, S112 - a refusal needs no notes
            continue
    return notes


def _register(registry, buffers: dict, unchanged: bool):
    """Page-lock `buffers`' CPU storages through `registry` (None: not asked for); unchanged:
    they are the storages of its last sync (HostRegistry.sync). An optimization only: on
    failure the sync still runs, bounced through the ring."""
    if registry is None:
        return None
    try:
        return registry.sync(buffers, unchanged=unchanged)
    except RuntimeError as exc:
        return {"error": str(exc)}
