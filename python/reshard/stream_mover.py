"""The bucket transfer engine of an `rs.Stream`: moves one bucket at a time on one worker
thread, in the order they were queued, so the group sees the same sequence of collectives on
every rank. Once a bucket's transfer fails, the buckets queued behind it in the same call are
skipped (every rank skips them: its peers failed that bucket too).

Each bucket gets one `Transfer` (around the bucket's plan, built in the Stream's constructor),
created on its first move and kept: later calls reuse its schedule, typed rounds and descriptor
tables, so a call costs each bucket only its preflight and its rounds. The Transfers share one
`StagingPool` (they never run at the same time): arenas sized for the largest bucket's rounds and
one pinned ring, allocated on first use and kept across calls. With `register_host_sources`, CPU
source storages are page-locked in place once (`reshard.hostreg`), for every bucket.

CUDA: the worker moves buckets on its own CUDA stream, its thread's current stream (set once:
nothing else runs on that thread). A landed bucket is handed to the caller as an event its
current stream waits on (no host synchronization); before a bucket overwrites bytes the caller
used, the worker's stream waits on an event recorded on the caller's stream. Each bucket keeps
its two events across calls (a bucket's move is over before the next call queues it again).
A bucket submitted with a progress word (`progress_word`) also tells the caller, while it
moves, how far its copies are queued (`reshard.h2d.Progress`; only where one stage_h2d pipeline
writes the whole target, else nothing until it is done), then DONE once its transfer returned
(its `landed` event recorded first) or FAILED.
"""

from __future__ import annotations

import concurrent.futures
import os

import torch

from . import staging
from .h2d import MAX_DESCS, Progress, publishing
from .hostreg import HostRegistry
from .planning.rank_schedule import schedule
from .preflight import ROW
from .report import STAGING_KINDS
from .rounds import RECV, SEND
from .staging_bound import DESC_ROW_BYTES, cuda_block, device_table_bytes

# Final values of a bucket's progress word: its transfer returned (every copy queued), or failed.
DONE = 1 << 62
FAILED = -1
PROGRESS_WORD_BYTES = 32  # int64 [4], CPU


class StagingPool:
    """The staging of one Stream on one rank, shared by its buckets' Transfers (they never run
    at the same time): per direction up to two arenas, each as large as the largest any bucket
    has asked for so far, on the transport's device, and one pinned ring; kept across calls.
    Arenas only grow while the first call meets buckets that need more; growing drops every
    member Staging's views (their Transfers take new ones at their next preflight), so the old
    arenas are freed. The most it may hold is `bound()`, from the plans."""

    def __init__(self, plans, rank: int):
        self.plans, self.rank = plans, rank
        self.ring_nbytes = max(
            (staging.ring_bytes(p.budget_bytes_per_peer) for p in plans), default=0
        )
        self.arenas: dict = {}  # (side, index) -> uint8 tensor
        self.ring = None
        self._ring_device = None  # device staging the stage ops take with the ring
        self.members: list = []  # the PooledStaging of every bucket Transfer

    def arena(self, device, side, index: int, nbytes: int) -> torch.Tensor:
        t = self.arenas.get((side, index))
        if t is None or t.numel() < nbytes or t.device != device:
            if t is not None:  # grow: nobody may keep a view of the smaller arena
                for m in self.members:
                    m.arenas = None
                self.arenas[(side, index)] = t = None
            t = self.arenas[(side, index)] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return t[:nbytes]

    def ring_view(self, nbytes: int) -> torch.Tensor:
        if nbytes > self.ring_nbytes:
            raise RuntimeError(f"a ring of {nbytes} B exceeds the pool's {self.ring_nbytes} B")
        if self.ring is None:
            self.ring = torch.empty(self.ring_nbytes, dtype=torch.uint8, pin_memory=True)
        return self.ring[:nbytes]

    def staging(self, device, num_rounds: int) -> staging.Staging:
        """The `Transfer.from_plan(staging=...)` factory: a Staging whose tensors are views of
        this pool's."""
        member = PooledStaging(self, device, num_rounds)
        self.members.append(member)
        return member

    def held(self) -> dict:
        """Bytes this pool holds now, by kind."""
        out = dict.fromkeys(STAGING_KINDS, 0)
        for t in self.arenas.values():
            out["device" if t.device.type == "cuda" else "host"] += t.numel()
        if self.ring is not None:
            if self._ring_device is None:  # an op call: asked once, the ring is fixed
                self._ring_device = ring_device_bytes(self.ring_nbytes)
            out["host_pinned"] += self.ring.numel()
            out["device"] += self._ring_device
        return out

    def bound(self, transport: str, host_ring_bytes: int) -> dict:
        """The most it may hold: per direction, min(2, rounds) arenas of the largest round any
        bucket plan sends / receives on this rank (plan.rounds.send_arena / recv_arena), on the
        transport's device; plus the ring (and the device slots the stage ops take with it)
        when there is one."""
        nbuf = max((min(2, p.num_rounds) for p in self.plans), default=0)
        send = max((p.rounds.send_arena.get(self.rank, 0) for p in self.plans), default=0)
        recv = max((p.rounds.recv_arena.get(self.rank, 0) for p in self.plans), default=0)
        out = dict.fromkeys(STAGING_KINDS, 0)
        out["device" if transport == "nccl" else "host"] = nbuf * (send + recv)
        if host_ring_bytes:
            out["host_pinned"] += host_ring_bytes
            out["device"] += ring_device_bytes(host_ring_bytes)
        return out


def table_bytes(plan, rank: int, world_size: int, transport: str, own: bool) -> dict:
    """The most memory one bucket Transfer's executor state holds on `rank` besides its staging
    (kept across calls), by kind: the descriptor tables, one int64 row per copy run (the
    schedule's, of its local copies and its messages' segments; the round tables fused from
    the segments it packs, every segment's rows at most once more), the preflight's
    all-gather rows (world > 1: kept on the CPU, made per call on the device under NCCL), and
    under NCCL, where CUDA ops read the tables, the device copies the ops' table cache keeps
    of each one, plus the one-row tables of its local copies' batched CPU -> CUDA path (for
    staged pieces and device casts: at most `h2d.MAX_DESCS` per Transfer). `own`: `rank` is this
    process's, whose schedule the plan keeps (its Transfer builds it anyway); another rank's
    is built and dropped."""
    sched = plan.schedule(rank) if own else schedule(plan, rank)
    src = plan.src.storages
    cuda = transport == "nccl"
    out = dict.fromkeys(STAGING_KINDS, 0)
    rows = 0
    for lc in sched.local:
        rows += len(lc.desc)
        if cuda:
            read = int((lc.desc[:, 4] * lc.desc[:, 5]).sum()) * src[lc.src_location].dtype.itemsize
            out["device"] += device_table_bytes(len(lc.desc), read)
    for side, msgs in ((SEND, sched.sends), (RECV, sched.recvs)):
        for seg in (seg for rm in msgs for m in rm for seg in m.segments):
            rows += 2 * len(seg.desc)  # the schedule's, and the round table's copy
            if cuda:
                dt = src[seg.src_location].dtype if side == SEND else seg.wire_dtype
                out["device"] += device_table_bytes(len(seg.desc), seg.numel * dt.itemsize)
    out["host"] += DESC_ROW_BYTES * rows
    if world_size > 1:  # this rank's row and everyone's, int64 (preflight.GatherRows)
        if cuda:  # made per call (_all_gather_rows): a row per rank, and their stack
            stacked = cuda_block(8 * ROW * world_size)
            out["device"] += (world_size + 1) * cuda_block(8 * ROW) + stacked
        else:
            out["host"] += 8 * ROW * (world_size + 1)
    if cuda and sched.local:
        out["host"] += MAX_DESCS * DESC_ROW_BYTES
        out["device"] += MAX_DESCS * device_table_bytes(1, 1 << 62)
    return out


def ring_device_bytes(ring_nbytes: int) -> int:
    """Device staging a stage op may take with a ring of this size (none without CUDA)."""
    if not ring_nbytes or not torch.cuda.is_available():
        return 0
    return int(torch.ops.reshard.stage_device_bytes(ring_nbytes))


class PooledStaging(staging.Staging):
    """One bucket Transfer's Staging, backed by the Stream's pool."""

    def __init__(self, pool: StagingPool, device, num_rounds: int):
        super().__init__(device, num_rounds)
        self.pool = pool

    def allocate_arenas(self, send_bytes: int, recv_bytes: int) -> None:
        self.arenas = {
            SEND: [self.pool.arena(self.device, SEND, i, send_bytes) for i in range(self.nbuf)],
            RECV: [self.pool.arena(self.device, RECV, i, recv_bytes) for i in range(self.nbuf)],
        }

    def allocate_ring(self, nbytes: int) -> None:
        if self.ring is None:
            self.ring = self.pool.ring_view(nbytes)


class BucketMover:
    """Moves a Stream's buckets, one at a time, on one worker thread (see the module
    docstring). `submit` returns a Future of (Report, CUDA event or None)."""

    def __init__(self, buckets, bound, timeout, cuda_device, register_host_sources):
        """bound: the resolved (group, rank, world size, transport) every bucket runs over."""
        self.bound, self.group, self.timeout = bound, bound[0], timeout
        rank = bound[1]
        self.plans = [b.plan for b in buckets]
        self.pool = StagingPool(self.plans, rank)
        self.transfers: dict = {}  # bucket index -> Transfer, created on its first move
        self.cuda_device = cuda_device
        self.registry = HostRegistry() if register_host_sources else None
        self.registration = None  # what the last call's registration did
        self._worker = None
        self._pid = os.getpid()  # the process the worker thread (and CUDA stream) belong to
        self._cuda_stream = None
        self._failed = None  # the exception of this call's failed bucket (worker thread only)
        # the caller runs beside the worker's packing (it takes tensors as they are queued):
        # the worker's intra-op team leaves it a core
        self.caller_overlaps = False
        self.caller_has_core = False  # the worker's team was made one thread short for it
        self._words: dict = {}  # bucket index -> its progress word (int64 [4], CPU), numpy view
        self.landed: dict = {}  # bucket index -> its landed event, set before DONE is published
        self._events: dict = {}  # bucket index -> (caller_done, landed) CUDA events, kept
        self._queued_event = None  # recorded per wait of the caller (see `queued_event`)
        # (bucket index, Future) of moves a call gave up waiting for (timeout) and left running
        self.leftover: list = []

    def still_moving(self):
        """The bucket a call gave up on that the worker still moves, or None."""
        self.leftover = [(k, f) for k, f in self.leftover if not f.done()]
        return self.leftover[0][0] if self.leftover else None

    def begin_call(self) -> None:
        """A new call: nothing is queued (every bucket of the previous call has returned, or
        failed and was waited for)."""
        self._failed = None

    @property
    def cuda_stream(self):
        """The worker's CUDA stream (None before its first CUDA move)."""
        return self._cuda_stream

    def progress_word(self, index: int) -> torch.Tensor:
        """Bucket `index`'s progress word, reset (value 0, no landed event): call before
        submitting the bucket with `progress_origin`."""
        w = self._words.get(index)
        if w is None:
            t = torch.zeros(PROGRESS_WORD_BYTES // 8, dtype=torch.int64)
            w = self._words[index] = (t, t.numpy())
        else:
            w[1][:] = 0  # nothing waits on or publishes to it between calls
        self.landed[index] = None
        return w[0]

    def progress_word_of(self, index: int) -> torch.Tensor:
        """Bucket `index`'s progress word as it is (not reset)."""
        return self._words[index][0]

    def _bucket_events(self, index: int):
        ev = self._events.get(index)
        if ev is None:
            ev = self._events[index] = (torch.cuda.Event(), torch.cuda.Event())
        return ev

    def caller_event(self, index: int):
        """The CUDA event bucket `index`'s move waits for (the caller records it on its
        current stream when it queues the bucket)."""
        return self._bucket_events(index)[0]

    def queued_event(self):
        """An event for the caller to record on the worker's stream and wait on at once (a
        wait takes the event as it was when queued, so one event serves every wait)."""
        if self._queued_event is None:
            self._queued_event = torch.cuda.Event()
        return self._queued_event

    def submit(
        self, bucket, src, dst, checks, caller_done=None, host_sync=False, progress_origin=None
    ):
        """Move `bucket` from `src` into `dst` ({location: tensor}) on the worker. checks: the
        preflight's extra checks. caller_done: a CUDA event the move waits for before writing.
        host_sync: the targets are read by the host once the Future is done. progress_origin:
        publish to the bucket's progress word, target bytes counted from this address."""
        if self._pid != os.getpid():
            # a forked child has none of the parent's threads: a job queued on the parent's
            # worker would never run. The child starts its own (CUDA cannot be used there).
            self._worker = self._cuda_stream = None
            self.caller_has_core, self.leftover, self._pid = False, [], os.getpid()
        if self._worker is None:
            # one worker thread for the Stream's life: its allocator arena (CPU staging) and
            # CUDA stream are reused by every call. Its intra-op team is the caller's, one
            # thread fewer where the caller works beside it (on the H200 host, 15 of 16 moved
            # the stream 8-15% faster in one call; within noise in another:
            # benchmarks/results/h200/issued)
            threads = caller = torch.get_num_threads()
            if self.caller_overlaps and threads > 1:
                threads -= 1
                self.caller_has_core = True
            self._worker = concurrent.futures.ThreadPoolExecutor(
                1,
                thread_name_prefix="reshard-stream",
                initializer=_own_team,
                initargs=(threads,),
            )
            if threads != caller:
                # torch.set_num_threads also sets the count that threads started later begin
                # with: once the worker has its team, the process's count is the caller's again
                self._worker.submit(int).result()
                torch.set_num_threads(caller)
        return self._worker.submit(
            self._move, bucket, src, dst, checks, caller_done, host_sync, progress_origin
        )

    def _transfer(self, bucket):
        t = self.transfers.get(bucket.index)
        if t is None:
            from .executor import Transfer  # needs the built ops; planning does not

            t = self.transfers[bucket.index] = Transfer.from_plan(
                bucket.plan, group=self.group, timeout=self.timeout, staging=self.pool.staging
            )
        return t

    def _move(self, bucket, src, dst, checks, caller_done, host_sync, progress_origin):
        word, values = self._words[bucket.index] if progress_origin is not None else (None, None)
        try:
            if self._failed is not None:
                raise RuntimeError(
                    f"bucket {bucket.index} was not moved: an earlier bucket of this call "
                    f"failed ({type(self._failed).__name__}: {self._failed})"
                )
            progress = Progress(word, progress_origin, values) if word is not None else None
            try:
                out = self._move_now(bucket, src, dst, checks, caller_done, host_sync, progress)
            except BaseException as exc:
                self._failed = exc
                raise
        except BaseException:
            if word is not None:
                torch.ops.reshard.progress_set(word, FAILED)
            raise
        if word is not None:
            torch.ops.reshard.progress_set(word, DONE)
        return out

    def _move_now(self, bucket, src, dst, checks, caller_done, host_sync, progress):
        transfer = self._transfer(bucket)
        # `_call`, not `transfer(...)`: the Stream's call holds the group's lock for all its
        # buckets (stream._hold_group), which the Transfer would take again on this thread
        if self.cuda_device is None:
            return transfer._call(self.bound, src, dst, checks), None
        stream = self._cuda_stream
        if stream is None:  # this thread's device and current stream, for every later move
            torch.cuda.set_device(self.cuda_device)
            stream = torch.cuda.Stream(self.cuda_device)
            torch.cuda.set_stream(stream)
            self._cuda_stream = stream
        if caller_done is not None:
            stream.wait_event(caller_done)
        with publishing(progress):
            rep = transfer._call(self.bound, src, dst, checks)
        landed = self._bucket_events(bucket.index)[1]
        landed.record(stream)
        if progress is not None:
            self.landed[bucket.index] = landed  # before DONE: see Call.await_queued
        if host_sync:
            landed.synchronize()
        return rep, landed

    def register(self, bufs: dict) -> None:
        """Page-lock the CPU source storages in place (with register_host_sources; once, later
        calls check only that they are the same storages). An optimization only: on failure the
        buckets still move, bounced through the ring."""
        if self.registry is None:
            self.registration = None
            return
        try:
            self.registration = self.registry.sync(bufs)
        except RuntimeError as exc:
            self.registration = {"error": str(exc)}

    def close(self) -> None:
        """Undo host registrations (the Stream stays usable: the next call re-registers)."""
        if self.registry is not None:
            self.registry.close()

    def shutdown(self) -> None:
        """This mover is replaced (the Stream's group changed): undo its registrations and let
        its worker thread end once idle."""
        self.close()
        if self._worker is not None and self._pid == os.getpid():
            self._worker.shutdown(wait=False)
        self._worker = None


def _own_team(threads: int) -> None:
    """Give the worker thread a team of its own. torch's thread count is also the count every
    thread starts with, and each library that inlines ATen's parallel_for (libtorch, this
    extension) sets a thread's team from it at that thread's first parallel call. Both first
    calls happen here, so the caller can put the process's count back afterwards."""
    from . import _ops  # needs the built ops; planning does not

    torch.get_num_threads()  # libtorch's first call on this thread
    torch.set_num_threads(threads)
    _ops.copy_runs(torch.zeros(1), [[0, 1, 0, 1, 1, 1]], torch.empty(1))  # this extension's
