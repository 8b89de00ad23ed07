"""One call of an `rs.Stream`: the iteration and double-buffer protocol, the whole-stream source
checks of the first bucket's preflight, and the call's merged Report.

Protocol (the same bucket order on every rank; each bucket's transfer runs on the mover's one
worker thread, in order): a bucket is queued on the worker as soon as the caller has moved past
every earlier tensor that shares its bytes (`Bucket.ready_after`, fixed by
`stream_buckets.place_buckets`), whether or not the bucket before it has landed. With a ring of
two buckets, bucket k+1 is queued once the caller is done with bucket k-1: it moves right after
bucket k, while the caller consumes bucket k, and the worker never idles waiting for the caller
to hand it the next bucket. Ranks that receive nothing queue every bucket at once. A caller that
stops early closes the generator, which then moves the remaining buckets without yielding them,
so its peers finish normally (a failure there fails the next call: `Call.stop`); after a failed
transfer (its peers failed too) the worker skips the buckets queued behind it and the call
stops. Every wait on the worker is bounded by the Stream's timeout (`Call.timed_out`).

CUDA receivers take a bucket's tensors while it still moves: a tensor is yielded once the
copies that write its bytes are queued on the worker's stream (the bucket's progress word,
published by the stage op as its pipeline issues them), the caller's current stream first
waiting on an event recorded on the worker's stream at that moment. So the caller's own work
on each tensor (an engine's weight loader: Python and kernel launches) overlaps the host's
packing of the rest of the bucket, and only its kernels wait for the bytes. Where the bucket's
transfer does not publish (peers send to it, or its copies take another path), the caller gets
its tensors once the transfer returned, behind its landed event, as before. A yielded tensor's
bytes are all queued before it is yielded: a transfer that fails later never hands out a
tensor it did not write.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import sys
import time
from collections import deque
from concurrent.futures import Future

import torch

from . import preflight as pf
from .errors import TransferError
from .report import PHASES, STAGING_KINDS, Report
from .stream_mover import DONE

# Microseconds one progress wait sleeps before the caller checks the bucket's Future (a worker
# that died without publishing cannot hold the caller).
PROGRESS_POLL_US = 250_000
# Microseconds the caller polls a bucket's progress word before it sleeps: waking a sleeping
# thread takes 50-150 us on the H200 host right after a pack. For DONE it waits only once the
# bucket's last copies are queued (its transfer's return is a fraction of a millisecond away).
# For a tensor's copies it polls only where the worker's packing team left the caller a core,
# long enough to cover the first tensor of a 256 MiB bucket (the longest wait of a call).
SETTLE_SPIN_US = 2_000
AWAIT_SPIN_US = 10_000


class Call:
    """One call's state. `stream`: the Stream (buckets, buffer, mover); `bufs`: {location:
    tensor}; `hooks`: the buffer set's readiness checks (run in bucket 0's preflight); `kind`:
    the buffer object's `.kind` (compared in bucket 0's preflight) or None."""

    def __init__(self, stream, bufs, hooks, stopped=None, kind=None):
        self.s, self.bufs, self.hooks, self.kind = stream, bufs, hooks, kind
        self.stopped = stopped  # the previous call's failure after an early stop, or None
        self.pid = os.getpid()  # a call resumed in a forked child has no worker there
        self.receiving = stream.rank in stream.receivers and stream.buffer is not None
        self.cuda = stream.mover.cuda_device is not None
        self.pending = deque()  # (bucket index, Future) of the buckets queued, in order
        self.next = 0  # the next bucket to queue
        self.outcomes = []  # per bucket moved: its Report, or its Future (read in `report`)
        self.waited = 0.0  # seconds the caller blocked on a bucket still in flight
        self.failed = False
        self.landed = None  # CUDA event: the bucket being yielded has landed
        self.early = self.receiving and self.cuda  # tensors yielded as their copies are queued

    def start(self) -> None:
        """Queue the next bucket on the worker."""
        s, k = self.s, self.next
        b = s.buckets[k]
        checks = self.first_checks() if k == 0 else []
        done = None
        if self.cuda:
            # the caller's kernels may still write the sources or read the bytes this bucket
            # overwrites: the worker's stream waits for them (no host synchronization)
            done = s.mover.caller_event(k)
            done.record(torch.cuda.current_stream(s.mover.cuda_device))
        src = {loc: self.bufs[loc] for loc in b.src_locations if loc in self.bufs}
        if k == 0 and self.kind is not None:
            # Streams of one plan (exp_avg and exp_avg_sq of one model) iterated in another
            # order on another rank pair up: the preflight compares the kinds the ranks name
            src = pf.BufferSet(src, kind=self.kind)
        host_sync = s.device.type != "cuda"
        origin = None
        if self.early:
            s.mover.progress_word(k)  # reset before the worker can publish to it
            origin = s.buffer.data_ptr()
        fut = s.mover.submit(b, src, s.targets(k), checks, done, host_sync, origin)
        self.pending.append((k, fut))
        self.next = k + 1

    def first_checks(self) -> list:
        """Bucket 0's extra preflight checks, run here on the caller's thread, which holds the
        group's lock (on the worker, a hook that calls a Transfer or iterates a Stream on the
        group would wait for that lock forever; here it raises at once): each failure is
        raised again in the preflight, where it is a reason like any other. A KeyboardInterrupt
        or SystemExit too, and it ends the checks: raised here, bucket 0 would never reach
        its peers' preflight; raised there, every rank hears of it (`preflight.collect`) and
        the bucket raises it again on this rank, the PreflightError as its context."""
        failed = []
        for check in [*self.hooks, lambda: self.s.check_sources(self.bufs, self.stopped)]:
            try:
                check()
            except BaseException as exc:  # noqa: BLE001 - a reason of the collective preflight
                failed.append(exc)
                if not isinstance(exc, Exception):
                    break
        return [functools.partial(_raise, exc) for exc in failed]

    def advance(self, consumed: int) -> None:
        """The caller is done with `consumed` tensors of the stream: queue every bucket (in
        order) that may now be written."""
        buckets = self.s.buckets
        while self.next < len(buckets) and buckets[self.next].ready_after <= consumed:
            self.start()

    def finish(self) -> None:
        """Wait for the oldest queued bucket to land (at most the Stream's timeout)."""
        t0 = time.perf_counter()
        k, fut = self.pending[0]
        try:
            self.same_process()
            try:
                rep, self.landed = fut.result(timeout=self.s.timeout)
            except concurrent.futures.TimeoutError:
                raise self.timed_out(k) from None  # left to the worker (`timed_out`)
            finally:
                if self.pending and self.pending[0][1] is fut:
                    self.pending.popleft()
            self.outcomes.append(rep)
        except BaseException:
            self.failed = True
            raise
        finally:
            self.waited += time.perf_counter() - t0

    def same_process(self) -> None:
        if self.pid != os.getpid():
            self.failed = True
            self.pending.clear()  # queued on the parent's worker: nothing moves them here
            raise RuntimeError(
                f"this Stream call was started in process {self.pid} before os.fork(): its "
                "buckets move on that process's worker thread; start a new call in this process"
            )

    def timed_out(self, k: int) -> TransferError:
        """Bucket k (still pending) did not finish within the timeout: the call stops; the peers
        no longer see this rank's collectives in step, so the group is marked (its next use
        on this rank raises at once instead of pairing with a stale collective)."""
        s = self.s
        self.failed = True
        if self.pending and self.pending[0][0] == k:  # left to the worker: not waited for again
            s.mover.leftover.append(self.pending.popleft())
        what = (
            f"bucket {k} of {len(s.buckets)} did not finish within the Stream's timeout "
            f"({s.timeout:g} s) on rank {s.rank}"
        )
        hint = ""
        if s.world_size > 1:
            pf.mark_out_of_step(s.mover.group, f"an rs.Stream call was abandoned ({what})")
            hint = f"; {pf.REBUILD}"
        return TransferError(
            f"rs.Stream: {what}; the call stops and the stream's buffer may be partially "
            f"written{hint}"
        )

    def settle(self, k: int) -> None:
        """Wait for bucket k (the oldest pending, which publishes progress) to be done, as
        `finish` does, but on its progress word: DONE is published once its transfer returned
        and its landed event is recorded, so the caller goes on without waiting for the
        worker to hand back its Future (the Report in it is read by `report`). A failure
        raises as in `finish`."""
        fut = self.pending[0][1]
        v = self.wait_word(k, DONE, fut, SETTLE_SPIN_US)
        if v < DONE:  # failed (or the worker ended without publishing): its Future says
            self.finish()  # done already: no further wait
            return
        self.pending.popleft()
        self.outcomes.append(fut)
        self.landed = self.s.mover.landed[k]

    def wait_word(self, k: int, at_least: int, fut, spin_us: int = 0) -> int:
        """Bucket k's progress word once it is >= at_least or negative, or once `fut` (the
        bucket's move) is done: a worker that ended without publishing cannot hold the caller.
        The time counts as waited."""
        self.same_process()
        word = self.s.mover.progress_word_of(k)
        t0 = time.perf_counter()
        try:
            while True:
                v = torch.ops.reshard.progress_wait(word, at_least, PROGRESS_POLL_US, spin_us)
                if v >= at_least or v < 0 or fut.done():
                    return v
                if time.perf_counter() - t0 > self.s.timeout:
                    raise self.timed_out(k)
        finally:
            self.waited += time.perf_counter() - t0

    def await_queued(self, k: int, end: int) -> int:
        """Block until the copies of bucket k (the oldest pending) that write the buffer's
        bytes before `end` are queued, and make the caller's current stream wait for them.
        Returns how far the buffer is covered now (a byte offset; DONE once the bucket's
        transfer returned and its landed event is waited on). Raises the bucket's failure."""
        s = self.s
        spin = AWAIT_SPIN_US if s.mover.caller_has_core else 0
        v = self.wait_word(k, end, self.pending[0][1], spin)
        cur = torch.cuda.current_stream(s.mover.cuda_device)
        if v < end or v >= DONE:
            # failed, or done (or publishing nothing): the bucket's own result and event
            self.settle(k)
            cur.wait_event(self.landed)
            return DONE
        # every copy before `end` is queued on the worker's stream: an event recorded there
        # now follows them. Were the bucket's landed event already set, the worker may have
        # queued the next bucket's copies too, so the exact event is used instead.
        ev = s.mover.queued_event()
        ev.record(s.mover.cuda_stream)
        landed = s.mover.landed.get(k)
        cur.wait_event(landed if landed is not None else ev)
        return v

    def run(self):
        s = self.s
        nb = len(s.buckets)
        completed = stopped = False
        try:
            s.mover.begin_call()
            everything = sum(len(b.entries) for b in s.buckets)
            consumed = 0  # tensors of the stream the caller is done with
            for k in range(nb):
                self.advance(consumed if self.receiving else everything)
                if self.early:
                    covered = 0  # the buffer's bytes before this are queued (or landed)
                    for item, end in zip(s.views(k), s.view_ends(k), strict=True):
                        if end > covered:
                            covered = self.await_queued(k, end)
                        self.advance(consumed)
                        yield item
                        consumed += 1
                    if covered < DONE:
                        self.settle(k)  # bucket k is done (or raises its failure)
                    continue
                self.finish()  # bucket k has landed
                if not self.receiving:
                    continue
                if self.landed is not None:
                    torch.cuda.current_stream(s.mover.cuda_device).wait_event(self.landed)
                for item in s.views(k):
                    self.advance(consumed)
                    yield item
                    consumed += 1
            completed = True
        except GeneratorExit:
            stopped = True
            raise
        finally:
            if stopped:
                self.stop()
            else:
                self.drain(completed)

    def stop(self) -> None:
        """The caller stopped early (break, an exception in its loop, the generator collected):
        move the rest for the peers. Python drops what a generator's close raises ("Exception
        ignored"), while the peers raise the failure in their loops: it is kept and fails the
        Stream's next call on every rank instead (a reason of bucket 0's preflight)."""
        try:
            self.drain(False)
        except Exception as exc:  # noqa: BLE001 - reported by the next call
            self.s.stopped_error = exc

    def completed(self, total: float) -> None:
        """The call returned after `total` seconds: keep what its Report needs that a later
        call may change (the pool's holdings, the registration)."""
        self.total = total
        self.ring_nbytes = (
            self.s.mover.pool.ring_nbytes if self.s.mover.pool.ring is not None else 0
        )
        self.held = self.s.mover.pool.held()
        self.registration = self.s.mover.registration

    def report(self) -> Report:
        """The completed call's Report: sums over its buckets; staging held and bound are the
        receivers' buffer plus the Stream's staging pool."""
        s = self.s
        reports = [o.result()[0] if isinstance(o, Future) else o for o in self.outcomes]
        rep = merge_reports(reports, s.rank, s.world_size, s.backend, s.fingerprint)
        transport = "nccl" if s.mover.cuda_device is not None else "gloo"
        rep.staging_bound = s.staging_bytes(transport=transport, host_ring_bytes=self.ring_nbytes)
        held = dict(self.held)
        if s.buffer is not None:
            held["device" if s.device.type == "cuda" else "host"] += s.buffer_bytes
        rep.peak_staging_bytes = held
        rep.seconds["total"] = self.total
        rep.wait_seconds = self.waited  # the caller blocked on a bucket still in flight
        if self.registration is not None:
            rep.host_registration = self.registration
        return rep

    def drain(self, completed: bool) -> None:
        """Stopped early by the caller: the peers expect every bucket, so move the rest without
        yielding. After a failed transfer the peers failed too: the worker skips what is
        queued. Nothing may write after the call returns. A call left unfinished when the
        interpreter exits moves nothing more: its worker thread is gone."""
        try:
            if self.pid != os.getpid():  # a forked child's copy: nothing of it moves here
                self.pending.clear()
            elif not completed and not self.failed and not sys.is_finalizing():
                while self.next < len(self.s.buckets):  # the caller holds no tensor now
                    self.start()
                while self.pending:
                    self.finish()
        finally:
            self.abandon()

    def abandon(self) -> None:
        """After a failure: buckets queued but not started never start (the worker would skip
        them); one still moving is waited for up to the timeout, then left to the worker
        (`BucketMover.leftover`: the Stream refuses calls until it ended)."""
        for _, fut in self.pending:
            fut.cancel()
        while self.pending:
            k, fut = self.pending.popleft()
            if fut.cancelled():
                continue
            try:
                fut.exception(timeout=self.s.timeout)
            except concurrent.futures.TimeoutError:
                self.pending.appendleft((k, fut))
                self.timed_out(k)  # marks the group, leaves the move to the worker


def _raise(exc):
    raise exc


def check_sources(layout, used, rank: int, backend: str, bufs: dict) -> list[str]:
    """Why this rank's source buffers cannot serve the whole stream (empty: they can). used:
    every source location any bucket reads."""
    reasons = []
    for loc in used:
        st = layout.storages[loc]
        if st.rank != rank:
            continue
        t = bufs.get(loc)
        if loc not in bufs:
            reasons.append(f"source location {loc} (owned by rank {rank}) is missing")
        elif t is None:
            reasons.append(f"source location {loc} has no buffer (None: not ready)")
        elif not isinstance(t, torch.Tensor):
            reasons.append(f"source location {loc}: expected a tensor, got {type(t).__name__}")
        else:
            bad = _tensor_problems(t, st, backend)
            if bad:
                reasons.append(f"source location {loc}: " + "; ".join(bad))
    for loc in bufs:
        bad_key = pf.key_fault("source", loc)
        if bad_key:
            reasons.append(bad_key)
        elif loc not in layout.storages:
            reasons.append(f"source location {loc!r} does not exist in the source layout")
        elif layout.storages[loc].rank != rank:
            owner = layout.storages[loc].rank
            reasons.append(f"source location {loc} is owned by rank {owner}, not {rank}")
    return reasons


def _tensor_problems(t, st, backend) -> list[str]:
    """What the bucket's own preflight would refuse in `t` (dtype, 1-D contiguous, extent, a
    storage that holds the view, plain values, device): the same checks, so that a bad buffer
    of a late bucket fails in bucket 0, before anything is yielded, not after."""
    return pf._shape_faults(st, t) + pf._device_faults(t, backend)


def merge_reports(reports, rank, world_size, backend, fingerprint) -> Report:
    """One Report for a whole call: sums over buckets (bytes, rounds, phase seconds); staging is
    filled in by the caller (the Stream's buffer and pool)."""
    first = reports[0] if reports else None
    rep = Report(
        rank=rank,
        world_size=world_size,
        transport=first.transport if first else backend,
        rounds=sum(r.rounds for r in reports),
        fingerprint=fingerprint,
    )
    for r in reports:
        for peer, n in r.bytes_sent.items():
            rep.bytes_sent[peer] = rep.bytes_sent.get(peer, 0) + n
        for peer, n in r.bytes_received.items():
            rep.bytes_received[peer] = rep.bytes_received.get(peer, 0) + n
        rep.local_bytes += r.local_bytes
        rep.zero_copy_bytes += r.zero_copy_bytes
        for p in PHASES:
            rep.seconds[p] += r.seconds[p]
    for k in STAGING_KINDS:
        rep.peak_staging_bytes[k] = 0
        rep.staging_bound[k] = 0
    rep.seconds["plan"] = 0.0
    rep.buckets = len(reports)
    return rep
