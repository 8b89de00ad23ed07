"""One call of an `rs.Stream`: the iteration and double-buffer protocol, the whole-stream source
checks of the first bucket's preflight, and the call's merged Report.

Protocol (the same bucket order on every rank; each bucket's transfer runs on the mover's one
worker thread): bucket 0 starts at once. When bucket k has landed, bucket k+1 starts as soon
as the caller is done with the tensors of bucket k that share its bytes
(`Bucket.wait_consumed`, fixed by `stream_buckets.place_buckets`): at once when none do, else
when the caller asks for the first tensor past them. Ranks that receive nothing start each
bucket as soon as the previous one is done. A caller that stops early closes the generator,
which then moves the remaining buckets without yielding them, so its peers finish normally;
after a failed transfer (its peers failed too) it stops.
"""

from __future__ import annotations

import time

import torch

from .report import PHASES, STAGING_KINDS, Report


class Call:
    """One call's state. `stream`: the Stream (buckets, buffer, mover); `bufs`: {location:
    tensor}; `hooks`: the buffer set's readiness checks (run in bucket 0's preflight)."""

    def __init__(self, stream, bufs, hooks):
        self.s, self.bufs, self.hooks = stream, bufs, hooks
        self.receiving = stream.rank in stream.receivers and stream.buffer is not None
        self.cuda = stream.mover.cuda_device is not None
        self.pending = None  # the Future of the bucket in flight
        self.next = 0  # the next bucket to start
        self.reports = []
        self.waited = 0.0  # seconds the caller blocked on a bucket still in flight
        self.failed = False
        self.landed = None  # CUDA event: the bucket being yielded has landed

    def start(self) -> None:
        s, k = self.s, self.next
        b = s.buckets[k]
        checks = [*self.hooks, lambda: s.check_sources(self.bufs)] if k == 0 else []
        done = None
        if self.cuda:
            # the caller's kernels may still write the sources or read the bytes this bucket
            # overwrites: the worker's stream waits for them (no host synchronization)
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(s.mover.cuda_device))
        src = {loc: self.bufs[loc] for loc in b.src_locations if loc in self.bufs}
        host_sync = s.device.type != "cuda"
        self.pending = s.mover.submit(b, src, s.targets(k), checks, done, host_sync)
        self.next = k + 1

    def finish(self) -> None:
        t0 = time.perf_counter()
        try:
            rep, self.landed = self.pending.result()
            self.reports.append(rep)
        except BaseException:
            self.failed = True
            raise
        finally:
            self.pending = None
            self.waited += time.perf_counter() - t0

    def tensors(self, k):
        """Bucket k's (name, view) pairs, starting bucket k+1 once the caller is past the
        tensors it overwrites."""
        s = self.s
        if self.landed is not None:
            torch.cuda.current_stream(s.mover.cuda_device).wait_event(self.landed)
        wait = s.buckets[k + 1].wait_consumed if k + 1 < len(s.buckets) else None
        for i, item in enumerate(s.views(k)):
            if i == wait and self.next == k + 1:
                self.start()
            yield item

    def run(self):
        nb = len(self.s.buckets)
        completed = False
        try:
            if nb:
                self.start()
            for k in range(nb):
                self.finish()  # bucket k has landed
                if self.receiving:
                    yield from self.tensors(k)
                if self.next == k + 1 and self.next < nb:
                    self.start()
            completed = True
        finally:
            self.drain(completed)

    def report(self, total: float) -> Report:
        """The call's Report: sums over its buckets; staging held and bound are the
        receivers' buffer plus the Stream's staging pool."""
        s = self.s
        rep = merge_reports(self.reports, s.rank, s.world_size, s.backend, s.fingerprint)
        transport = "nccl" if s.mover.cuda_device is not None else "gloo"
        ring = s.mover.pool.ring_nbytes if s.mover.pool.ring is not None else 0
        rep.staging_bound = s.staging_bytes(transport=transport, host_ring_bytes=ring)
        held = s.mover.pool.held()
        if s.buffer is not None:
            held["device" if s.device.type == "cuda" else "host"] += s.buffer_bytes
        rep.peak_staging_bytes = held
        rep.seconds["total"] = total
        rep.wait_seconds = self.waited  # the caller blocked on a bucket still in flight
        if s.mover.registration is not None:
            rep.host_registration = s.mover.registration
        return rep

    def drain(self, completed: bool) -> None:
        """Stopped early by the caller: the peers expect every bucket, so move the rest without
        yielding. After a failed transfer the peers failed too: stop. Nothing may write after
        the call returns."""
        try:
            if not completed and not self.failed:
                if self.pending is not None:
                    self.finish()
                while self.next < len(self.s.buckets):
                    self.start()
                    self.finish()
        finally:
            if self.pending is not None:
                self.pending.exception()


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
        if loc not in layout.storages:
            reasons.append(f"source location {loc} does not exist in the source layout")
        elif layout.storages[loc].rank != rank:
            owner = layout.storages[loc].rank
            reasons.append(f"source location {loc} is owned by rank {owner}, not {rank}")
    return reasons


def _tensor_problems(t, st, backend) -> list[str]:
    bad = []
    if t.dtype != st.dtype:
        bad.append(f"dtype {t.dtype}, storage declares {st.dtype}")
    if t.dim() != 1 or not t.is_contiguous():
        bad.append(f"must be 1-D contiguous, got shape {tuple(t.shape)}")
    if t.numel() != st.numel:
        bad.append(f"has {t.numel()} elements, storage declares {st.numel}")
    if backend == "gloo" and t.device.type != "cpu":
        bad.append(f"is on {t.device}, but the gloo transport needs CPU buffers")
    return bad


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
