"""Local CPU -> CUDA copies of one rank's schedule, batched over all its tables in one pipeline.

A `stage_h2d` call moves one table and waits for its last copy before returning, so a schedule
of many small tables (an FSDP2 model offloaded to the CPU: one storage per parameter and
moment) drains the link between tables and packs each one while nothing is in flight. This
path moves every qualifying table in one pipeline instead:

- source spans in page-locked memory (pinned, or registered in place: reshard.hostreg) with
  the target's dtype are copied straight from the source by the copy engine (no host work);
- other spans are packed by the host (a cast to the target dtype on the way: the C core's
  copy loop): a table of several such spans and at least a ring slot of bytes in one
  `stage_h2d` call with its own descriptor table, pieces of a ring slot or more through
  `stage_h2d` too (its pipeline packs on all host threads as one queue), smaller ones together
  through the slots of the same pinned ring, a slot's pieces packed by one `copy_pieces` call
  (one pass over all host threads, whatever the number of source buffers), each slot copied to
  the device while the host packs the next, its pieces landing straight in their targets (no
  device staging);
- fp32 spans in page-locked memory bound for narrower targets are split between the host-side
  cast (half the bytes on the link, the host's time) and a copy of the source dtype to device
  scratch followed by the device-side cast (`copy_runs` on the device: the same casts.h code,
  bit for bit), so the host and the link finish together. The share is chosen by measured
  calls (`pick_share`): TRIAL_CALLS with every cast on the host give the host's time per
  element, `split_fraction` of it and the link's measured rate gives the model's share, and
  TRIAL_CALLS at that share and at a smaller device share (the device share's reads of host
  memory slow the host's cast, which the model does not see) decide by their median call;
  the fastest is kept for good, all on the host unless a split won by MIN_GAIN.

Direct copies (largest first, in batches that double) and device casts are queued first on two side streams
(after the caller's queued work), so they share the link with the host's copies from the start.
The call returns after every copy that reads a source or the ring completed (the caller may
rewrite sources at once; a stage op's device-side scatter may still be queued on the current
stream); it keeps no reference to the buffers. Device memory: at most the stage ops' device staging for the same
ring (`stage_device_bytes`), allocated per call from the caching allocator: the device casts'
scratch, or a whole table's `stage_h2d` staging (whole tables are staged only in calls without
device casts; staged pieces land straight in their targets); host: the ring. How each span
moves is decided once per set of page-locked sources and host share, and reused while they
stay. A table qualifies when its source is on the CPU, its target on the current CUDA device,
the target dtype is no wider than the source's, and its runs are at most `MAX_SPANS`
contiguous spans; every other table goes through `stage_h2d`.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

MAX_SPANS = 256  # per table: more (a strided split) and the stage op's one pass wins
MAX_SLOTS = 4  # ring slots, as the stage ops cut the ring
MIN_SLOT_BYTES = 64 * 1024
ALIGN = 16  # bytes: pieces in a slot start aligned (any dtype view, full-speed DMA)
EMA = 0.5  # weight of the newest measurement of the host's time per element
# Calls measured per candidate share before one is kept; shares compare by their median call
# and a split must win by MIN_GAIN. With two calls each and their fastest compared, one fast
# call kept a share that then ran 2-11% slower than all on the host (H200 host, benchmarks/
# results/h200/device_share).
TRIAL_CALLS = 3
SMALLER_SHARE = 0.6  # the second candidate's device share, of the model's
MIN_GAIN = 0.05
STAGE_MIN_SLOTS = 1  # a piece of this many ring slots goes through stage_h2d's own pipeline
MAX_DESCS = 256
# A casting stage_h2d call packs through at most this much of the ring: eight 4 MiB queue slots
# in flight. On the H200 host, 32 MiB moved CPU fp32 -> GPU bf16 4-10% faster than the whole
# 64 MiB ring (one Transfer and a stream's buckets) in two of three same-run comparisons; 16 MiB
# was slower in the stream (benchmarks/results/h200/rings).
CAST_RING_BYTES = 32 << 20


class Progress(NamedTuple):
    """Where a call publishes how far its copies are queued: `word`, a progress word (int64
    [4] CPU tensor, `torch.ops.reshard.progress_wait`), gets the end of the prefix of target
    bytes whose copies are all queued on the current stream, as a byte offset from the
    address `origin`."""

    word: torch.Tensor
    origin: int
    values: np.ndarray | None = None  # `word`'s numpy view (None: made when needed)


_publishing = threading.local()


class publishing:  # noqa: N801 - used as a context manager, like contextlib's
    """Within: this thread's calls that may publish (`current_progress`) publish to
    `progress`."""

    def __init__(self, progress: Progress | None):
        self.progress = progress

    def __enter__(self):
        self.before = getattr(_publishing, "progress", None)
        _publishing.progress = self.progress

    def __exit__(self, *exc):
        _publishing.progress = self.before
        return False


def current_progress() -> Progress | None:
    return getattr(_publishing, "progress", None)


def stage_ring(ring: torch.Tensor, src_dtype, dst_dtype) -> torch.Tensor:
    """The part of the pinned ring a stage call packs through: CAST_RING_BYTES of it for a
    cast, all of it for a same-dtype copy."""
    return ring[:CAST_RING_BYTES] if src_dtype != dst_dtype else ring


def contiguous_spans(desc, max_spans: int = MAX_SPANS) -> np.ndarray | None:
    """A descriptor table as contiguous copies [(src_offset, dst_offset, length)], adjacent
    ones merged, in the table's work order; None when there are more than `max_spans`."""
    d = np.asarray(desc, dtype=np.int64).reshape(-1, 6)
    d = d[(d[:, 4] > 0) & (d[:, 5] > 0)]
    whole = (d[:, 5] == 1) | ((d[:, 1] == d[:, 4]) & (d[:, 3] == d[:, 4]))
    count = np.where(whole, 1, d[:, 5])
    if int(count.sum()) > 4 * max_spans:  # merging cannot bring it under the cap
        return None
    rows = []
    for (so, ss, do, ds, n, c), one in zip(d.tolist(), whole.tolist(), strict=True):
        if one:
            rows.append((so, do, n * c))
        else:
            rows.extend((so + i * ss, do + i * ds, n) for i in range(c))
    out: list[list[int]] = []
    for so, do, n in rows:
        if out and out[-1][0] + out[-1][2] == so and out[-1][1] + out[-1][2] == do:
            out[-1][2] += n
        else:
            out.append([so, do, n])
    if len(out) > max_spans:
        return None
    return np.array(out, dtype=np.int64).reshape(-1, 3)


def ring_slots(ring_bytes: int) -> tuple[int, int]:
    """(slots, slot bytes) of a ring, cut as the stage ops cut it (rs_stage_slots)."""
    s = MAX_SLOTS
    while s > 2 and ring_bytes // s < MIN_SLOT_BYTES:
        s -= 1
    return s, (ring_bytes // s) // ALIGN * ALIGN


def split_fraction(host_s_per_elem, link_bytes_per_s, host_wire_bytes, device_wire_bytes):
    """The share f of cast elements to give the host-side cast so that the host, casting f of
    them, and the link, carrying f of them narrow and 1 - f at the source's width, finish
    together: f * h = (f * a + (1 - f) * b) / link. 1.0 (all on the host, the narrowest wire)
    whenever the host outruns the link or a rate is unknown."""
    h, link = host_s_per_elem, link_bytes_per_s
    if not h or not link or h <= 0 or link <= 0 or device_wire_bytes <= host_wire_bytes:
        return 1.0
    b = device_wire_bytes / link
    f = b / (h + b - host_wire_bytes / link)
    return float(min(1.0, max(0.0, f)))


def pick_share(trials: dict, min_gain: float) -> float:
    """The host share to keep from measured calls {host share: [seconds of whole calls]}: the
    share whose median call was fastest, if that beat the median call with every cast on the
    host (share 1.0) by at least `min_gain`; else 1.0. Where the host's memory is the
    bottleneck, the device share's source reads slow the host's cast, and the model alone
    cannot see how much: these measured calls decide (medians: one lucky call on a noisy host
    does not keep a split)."""
    base = trials.get(1.0)
    if not base:
        return 1.0
    best = min((s for s in trials if trials[s]), key=lambda s: statistics.median(trials[s]))
    return (
        best if statistics.median(trials[best]) < (1 - min_gain) * statistics.median(base) else 1.0
    )


def device_cast_chunks(spans, want: int, chunk: int) -> list[tuple[int, int, int]]:
    """Which elements of the cast spans go to the device-side cast: [(span index, first
    element within the span, length)], min(want, all) elements in all, each piece at most
    `chunk` elements, taken from the ends of the spans (the last span first). A new piece
    length costs its table's upload once (done before the pipeline: `_warm_tables`)."""
    out, left = [], int(want)
    for i in range(len(spans) - 1, -1, -1):
        end = int(spans[i])
        while left > 0 and end > 0:
            size = min(chunk, end, left)
            out.append((i, end - size, size))
            left -= size
            end -= size
        if left <= 0:
            break
    return out


def slot_pieces(pieces, itemsizes, slot_bytes: int):
    """Cuts host pieces [(key, first, n)] (key indexes `itemsizes`, the wire element size) into
    ring slots: a list per slot of (key, first, n, byte offset in the slot), every piece at an
    ALIGN-byte offset, a piece cut where a slot ends."""
    slots, cur, used = [], [], 0
    for key, first, n in pieces:
        isz = itemsizes[key]
        while n > 0:
            at = -(-used // ALIGN) * ALIGN
            room = (slot_bytes - at) // isz
            if room <= 0:
                slots.append(cur)
                cur, used = [], 0
                continue
            take = min(n, room)
            cur.append((key, first, take, at))
            used = at + take * isz
            first += take
            n -= take
    if cur:
        slots.append(cur)
    return slots


def slot_packs(tables, src, dst, small, slots) -> list:
    """Per ring slot, the `copy_pieces` calls that pack it: [(source locations, pieces, target
    dtype)], one per (source dtype, target dtype) among the slot's pieces; pieces (int64 [k, 4]:
    index into the locations, source element, element in the slot viewed as the target dtype,
    length). slots: `slot_pieces` of `small` (pieces (table, span, first, n))."""
    out = []
    for slot in slots:
        groups: dict = {}
        for key, first, n, at in slot:
            ti, j, _, _ = small[key]
            t = tables[ti]
            s, d = src[t.src_location], dst[t.dst_location]
            locs, rows = groups.setdefault((s.dtype, d.dtype), ({}, []))
            idx = locs.setdefault(t.src_location, len(locs))
            rows.append((idx, int(t.spans[j, 0]) + first, at // d.element_size(), n))
        out.append(
            [
                (tuple(locs), torch.tensor(rows, dtype=torch.int64).reshape(-1, 4), ddt)
                for (_, ddt), (locs, rows) in groups.items()
            ]
        )
    return out


class LocalSpans(NamedTuple):
    """What the executor hands this path per local table: the schedule's table and its
    contiguous spans (`contiguous_spans`)."""

    table: object  # a schedule's LocalTable (src_location, dst_location, desc)
    spans: np.ndarray  # [m, 3] (src_offset, dst_offset, length)


@dataclass(frozen=True)
class _Table:
    src_location: int
    dst_location: int
    spans: np.ndarray  # [m, 3] (src_offset, dst_offset, length)
    desc: torch.Tensor  # the schedule's table (a whole-table stage_h2d call)


def _dense_desc(n: int) -> torch.Tensor:
    return torch.tensor([[0, 0, 0, 0, n, 1]], dtype=torch.int64)


def _classify(tables, src, dst, pinned):
    """Each span of each table: copied directly (page-locked source, same dtype), a cast
    candidate for the device (page-locked source, narrower target) or packed by the host.
    Returns (direct [(table, span)], cast_spans [(table, span)], host [(table, span, first, n)])."""
    pinned = dict(pinned)
    direct, cast_spans, host = [], [], []
    for ti, t in enumerate(tables):
        s, d = src[t.src_location], dst[t.dst_location]
        if t.src_location not in pinned:
            pinned[t.src_location] = s.device.type == "cpu" and bool(s.is_pinned())
        same = s.dtype == d.dtype
        for j in range(t.spans.shape[0]):
            if pinned[t.src_location] and same:
                direct.append((ti, j))
            elif pinned[t.src_location] and s.element_size() > d.element_size():
                cast_spans.append((ti, j))
            else:
                host.append((ti, j, 0, int(t.spans[j, 2])))
    return direct, cast_spans, host


def _device_cast_chunks(tables, cast_spans, src, device_bytes, host_share, host):
    """The device-side share of the cast spans: pieces of at most half the scratch taken from
    the spans' ends; what is left of each span is appended to `host`.
    Returns (chunks [((table, span), first, n)], chunk elements, source item size)."""
    dev_chunks, chunk, src_isz = [], 0, 4
    if not cast_spans:
        return dev_chunks, chunk, src_isz
    src_isz = max(src[tables[ti].src_location].element_size() for ti, _ in cast_spans)
    chunk = device_bytes // 2 // src_isz  # two scratch halves
    lengths = [int(tables[ti].spans[j, 2]) for ti, j in cast_spans]
    want = 0 if chunk <= 0 else round((1.0 - host_share) * sum(lengths))
    taken = {}
    for i, first, n in device_cast_chunks(lengths, want, max(chunk, 1)):
        dev_chunks.append((cast_spans[i], first, n))
        taken[i] = min(taken.get(i, lengths[i]), first)
    for i, (ti, j) in enumerate(cast_spans):
        if taken.get(i, lengths[i]) > 0:
            host.append((ti, j, 0, taken.get(i, lengths[i])))
    return dev_chunks, chunk, src_isz


def _by_size(tables, dst, host, slot_bytes, whole_ok):
    """Tables of several spans, every one packed by the host, with at least a ring slot of
    bytes: one stage_h2d call each (entries (table, None, 0, elements); only where `whole_ok`:
    its device staging must not meet the device casts' scratch). Host pieces of STAGE_MIN_SLOTS
    ring slots: stage_h2d each. The rest share the slots of one ring. Returns (big, small)."""
    big, small = [], []
    per_table: dict[int, list] = {}
    for piece in host:
        per_table.setdefault(piece[0], []).append(piece)
    for ti, pieces in per_table.items():
        t = tables[ti]
        wsz = dst[t.dst_location].element_size()
        n = sum(p[3] for p in pieces)
        whole = len(pieces) == t.spans.shape[0] and all(p[2] == 0 for p in pieces)
        if whole_ok and whole and len(pieces) > 1 and n * wsz >= slot_bytes:
            big.append((ti, None, 0, n))
            continue
        for p in pieces:
            (big if p[3] * wsz >= STAGE_MIN_SLOTS * slot_bytes else small).append(p)
    return big, small


class _Route(NamedTuple):
    """How one call moves every span (see `HostToDevice._route`)."""

    direct: list
    cast_spans: list
    host: list
    dev_chunks: list
    chunk: int
    src_isz: int
    big: list
    small: list
    slots: list  # the small pieces cut into ring slots (slot_pieces)
    packs: list  # per slot, its copy_pieces calls (slot_packs)
    n_slots: int
    slot_bytes: int
    # per direct copy, largest first: (source, target, source byte, target byte, bytes)
    direct_bytes: list
    direct_whole: list  # per direct copy: it is the whole source and the whole target
    counts: dict  # what a call on this route moves, by path (the fixed part of `last`)
    publishes: bool  # a call on it can publish its progress (`_publishes`)


class HostToDevice:
    """The batched CPU -> CUDA path for the local tables it was given (see the module doc).
    Built once per plan and buffer set; `run` once per call."""

    def __init__(self, tables):
        """tables: [LocalSpans] whose source is a CPU buffer and target a CUDA one."""
        self.tables = [_Table(t.src_location, t.dst_location, s, t.desc) for t, s in tables]
        self.host_s_per_elem = None  # host-side cast time per element, measured
        self.link_bytes_per_s = None  # H2D copy rate of page-locked memory, measured once
        self.host_share = 1.0  # of the cast elements in page-locked memory
        self.split = "trial"  # "trial" (measuring), "kept" or "rejected" (all on the host)
        self._trial: dict = {}  # host share -> seconds of whole calls (pick_share)
        self._candidates: list = []  # the split's host shares to measure
        self._streams = None
        self._descs: dict[int, torch.Tensor] = {}  # device-cast tables by length (kept alive)
        self._pinned = {}  # source location -> data_ptr seen page-locked (stays so while alive)
        self._routes: dict = {}  # (page-locked sources, share, ring, scratch) -> _Route
        self._warm: set = set()  # (length, dtypes) of device casts whose tables the op holds
        self._ring_views: dict = {}  # casting? -> (the ring, its `stage_ring` view)
        self.last = {}  # what the last call did (elements per path, share, seconds)

    def _desc(self, n: int) -> torch.Tensor:
        """One dense table per length, kept so the ops' table caches stay warm (bounded: the
        host share moves the lengths of split spans)."""
        d = self._descs.get(n)
        if d is None:
            if len(self._descs) >= MAX_DESCS:
                self._descs.clear()
                self._warm.clear()
            d = self._descs[n] = _dense_desc(n)
        return d

    def run(
        self,
        src: dict,
        dst: dict,
        ring: torch.Tensor,
        device_bytes: int,
        pinned=None,
        progress=None,
    ):
        """One call: every table's spans from `src` into `dst` through `ring` (pinned) and at
        most `device_bytes` of device scratch. pinned: {source location: page-locked?}
        (default: asked of torch). progress: a `Progress` the call publishes to while its
        copies are queued, when its route allows (`_Route.publishes`); else nothing is
        published. Targets on the CPU run the same pipeline in order, with no streams (the CPU
        tests of this module)."""
        if progress is not None and self.split == "trial":
            # a caller that takes what is queued keeps every cast on the host: device casts
            # leave no queued prefix to publish, and its own overlap with the move is worth
            # more than a split (which never won on the H200 host: benchmarks/results/h200/
            # device_share)
            self.split, self.host_share = "rejected", 1.0
        dev = dst[self.tables[0].dst_location].device
        if dev.type != "cuda":
            return self._run(src, dst, ring, device_bytes, dev, _Ordered(), pinned or {}, progress)
        with torch.cuda.device(dev):
            if self._streams is None:
                self._streams = _Streams(dev)
            self._run(src, dst, ring, device_bytes, dev, self._streams, pinned or {}, progress)

    def _page_locked(self, src, pinned) -> dict:
        """{source location: page-locked?}: `pinned` where given, else asked of torch, except
        for a buffer already seen page-locked (registration is not undone while a Transfer
        uses it; were it, its copies would still be right, only synchronous)."""
        out = {}
        for t in self.tables:
            loc = t.src_location
            if loc in out:
                continue
            if loc in pinned:
                out[loc] = bool(pinned[loc])
                continue
            s = src[loc]
            if self._pinned.get(loc) == s.data_ptr():
                out[loc] = True
                continue
            out[loc] = s.device.type == "cpu" and bool(s.is_pinned())
            if out[loc]:
                self._pinned[loc] = s.data_ptr()
        return out

    def _route(self, src, dst, ring, device_bytes, pinned) -> _Route:
        """Which span goes which way (`_classify`, `_device_cast_chunks`, `_by_size`,
        `slot_pieces`), computed once per set of page-locked sources, share, ring and scratch
        size (the buffers' dtypes and devices are fixed for this object)."""
        key = (tuple(sorted(pinned.items())), self.host_share, ring.numel(), device_bytes)
        r = self._routes.get(key)
        if r is not None:
            return r
        direct, cast_spans, host = _classify(self.tables, src, dst, pinned)
        dev_chunks, chunk, src_isz = _device_cast_chunks(
            self.tables, cast_spans, src, device_bytes, self.host_share, host
        )
        n_slots, slot_bytes = ring_slots(ring.numel())
        big, small = _by_size(self.tables, dst, host, slot_bytes, whole_ok=not dev_chunks)
        itemsizes = [dst[self.tables[ti].dst_location].element_size() for ti, _, _, _ in small]
        slots = slot_pieces(
            [(k, first, n) for k, (_, _, first, n) in enumerate(small)], itemsizes, slot_bytes
        )
        direct_bytes = []
        for ti, j in direct:
            t = self.tables[ti]
            isz = src[t.src_location].element_size()
            so, do, n = (int(v) * isz for v in t.spans[j])
            direct_bytes.append((t.src_location, t.dst_location, so, do, n))
        # largest first: the copy engine starts on it while the rest are queued
        direct_bytes.sort(key=lambda c: -c[4])
        direct_whole = [
            a == 0 and b == 0 and n == _nbytes(src[s]) and n == _nbytes(dst[d])
            for s, d, a, b, n in direct_bytes
        ]
        if len(self._routes) >= MAX_DESCS:
            self._routes.clear()
        r = self._routes[key] = _Route(
            direct,
            cast_spans,
            host,
            dev_chunks,
            chunk,
            src_isz,
            big,
            small,
            slots,
            slot_packs(self.tables, src, dst, small, slots),
            n_slots,
            slot_bytes,
            direct_bytes,
            direct_whole,
            {
                "direct_elements": sum(int(self.tables[ti].spans[j, 2]) for ti, j in direct),
                "direct_copies": len(direct),
                "device_cast_elements": sum(n for _, _, n in dev_chunks),
                "host_elements": sum(n for _, _, _, n in host),
                "staged_pieces": sum(1 for _, j, _, _ in big if j is not None),
                "staged_tables": sum(1 for _, j, _, _ in big if j is None),
                "ring_pieces": len(small),
            },
            self._publishes(direct, dev_chunks, small, big),
        )
        return r

    def _run(self, src, dst, ring, device_bytes, dev, q, pinned, progress=None):
        side, cast_stream = q.side, q.cast
        pinned = self._page_locked(src, pinned)
        r = self._route(src, dst, ring, device_bytes, pinned)
        direct, cast_spans, host, dev_chunks = r.direct, r.cast_spans, r.host, r.dev_chunks
        chunk, src_isz, big, small = r.chunk, r.src_isz, r.big, r.small
        if self.link_bytes_per_s is None and cast_spans and dev.type == "cuda":
            self.link_bytes_per_s = _probe_link(self.tables, cast_spans, src, q, dev, device_bytes)
        t_start = time.perf_counter()
        # the side streams and their events only where direct copies or device casts use
        # them, the final wait only where copies are still in flight: a call of stage ops
        # alone (each returns once its bytes were read) makes no other CUDA call
        side_work = bool(dev_chunks or direct)
        timed = dev.type == "cuda" and side_work
        if side_work:
            cur = q.current()
            side_start, side_end = q.event(timed), q.event(timed)
            scratch = None
            if dev_chunks:
                scratch = torch.empty(2 * chunk * src_isz, dtype=torch.uint8, device=dev)
                self._warm_tables(src, dst, dev_chunks, scratch, chunk * src_isz)
            q.record(side_start, cur)  # the side streams start after the caller's queued work
            q.wait(side, side_start)
            q.wait(cast_stream, side_start)
            self._direct_copies(q, src, dst, r.direct_bytes, r.direct_whole)
            self._device_casts(q, src, dst, dev_chunks, scratch, chunk * src_isz)
            if timed:  # the side streams' end: the cast stream after the side stream's last copy
                side_done = q.event()
                q.record(side_done, side)
                q.wait(cast_stream, side_done)
                q.record(side_end, cast_stream)
        if progress is not None and not r.publishes:
            progress = None
        self._staged_pieces(q, src, dst, ring, big, progress)
        pack_s = 0.0
        if small:
            pack_s = self._ring_pieces(q, src, dst, ring, r)
        host_s = time.perf_counter() - t_start
        if side_work or small:
            # every source and ring byte read, every target byte written
            q.finish(side=side_work)
        total_s = time.perf_counter() - t_start
        side_s = q.elapsed(side_start, side_end) if timed else 0.0
        share = self.host_share
        self._balance(cast_spans, host, src, dst, host_s, total_s)
        self.last = {
            **r.counts,
            "host_share": share,  # this call's (self.host_share: the next call's)
            "host_s": host_s,
            "host_pack_s": pack_s,
            "device_side_s": side_s,
            "total_s": total_s,
            "split": self.split,
        }

    def _direct_copies(self, q, src, dst, direct_bytes, whole):
        """Same-dtype spans in page-locked memory: the copy engine reads the source itself.
        Queued largest first in batches that double (one call each), so the engine is busy
        with the first copies while the views of the later ones are built; a copy of a whole
        buffer into a whole buffer needs no view."""
        sb, db = {}, {}
        start, size = 0, 1
        with q.on(q.side):
            while start < len(direct_bytes):
                to, fro = [], []
                for i in range(start, min(start + size, len(direct_bytes))):
                    s, d, a, b, n = direct_bytes[i]
                    if whole[i]:
                        to.append(dst[d])
                        fro.append(src[s])
                        continue
                    if s not in sb:
                        sb[s] = src[s].view(torch.uint8)
                    if d not in db:
                        db[d] = dst[d].view(torch.uint8)
                    to.append(db[d][b : b + n])
                    fro.append(sb[s][a : a + n])
                torch._foreach_copy_(to, fro, non_blocking=True)
                start += size
                size *= 2

    def _publishes(self, direct, dev_chunks, small, big) -> bool:
        """Whether a call on a route can publish its progress: one table, all of it through
        stage_h2d calls (no direct copies, device casts or ring pieces), whose spans in call
        order each start where the one before ended in the target, the first at the target
        buffer's start. Then the end of what the running call has queued is the end
        of a prefix of the target buffer all queued."""
        if direct or dev_chunks or small or not big:
            return False
        end, table = 0, big[0][0]
        for ti, j, first, n in big:
            if ti != table:
                return False
            spans = self.tables[ti].spans
            # a whole-table call publishes its table's prefix: its spans in order, each one
            # starting where the one before ended, are then that prefix of the target
            pieces = spans[:, 1:3].tolist() if j is None else [(int(spans[j, 1]) + first, n)]
            for do, length in pieces:
                if do != end:
                    return False
                end += length
        return True

    def _staged_pieces(self, q, src, dst, ring, big, progress=None):
        """Whole tables and pieces of a ring slot or more: stage_h2d's own pipeline, one
        call each. progress: each call publishes its queued prefix, as target bytes from
        progress.origin (the route is one `_publishes` accepts: the calls cover their target
        from its start, in order)."""
        for ti, j, first, n in big:
            t = self.tables[ti]
            s, d = src[t.src_location], dst[t.dst_location]
            r = self._stage_ring(ring, s.dtype, d.dtype)
            a = b = 0
            if j is not None:
                so, do, _ = (int(v) for v in t.spans[j])
                a, b = so + first, do + first
            word = None
            if progress is not None:
                word = progress.word
                # base and scale through numpy: a torch index assignment costs far more
                values = progress.values if progress.values is not None else word.numpy()
                values[2] = d.data_ptr() + b * d.element_size() - progress.origin  # base
                values[3] = d.element_size()  # scale: the call publishes elements
            if j is None:
                q.stage(s, t.desc, r, d, word)
            else:
                q.stage(s[a : a + n], self._desc(n), r, d[b : b + n], word)

    def _stage_ring(self, ring, src_dtype, dst_dtype) -> torch.Tensor:
        """`stage_ring`, kept per ring object (a Transfer's ring is fixed once allocated):
        slicing a tensor costs tens of microseconds once a large copy has left the caches
        cold."""
        casting = src_dtype != dst_dtype
        kept = self._ring_views.get(casting)
        if kept is None or kept[0] is not ring:
            kept = self._ring_views[casting] = (ring, stage_ring(ring, src_dtype, dst_dtype))
        return kept[1]

    def _warm_tables(self, src, dst, chunks, scratch, half_bytes):
        """The device op validates and uploads a new table with a synchronous copy on the
        current stream: for a device-cast length not seen yet that happens here, between the
        scratch halves, before the pipeline (on the cast stream it would wait for a chunk's
        copy, and the host's cast would start that much later)."""
        for (ti, _), _, n in chunks:
            t = self.tables[ti]
            s, d = src[t.src_location], dst[t.dst_location]
            key = (n, s.dtype, d.dtype)
            if key in self._warm:
                continue
            a = scratch[:half_bytes].view(s.dtype)[:n]
            b = scratch[half_bytes : 2 * half_bytes].view(d.dtype)[:n]
            torch.ops.reshard.copy_runs(a, self._desc(n), b)
            self._warm.add(key)

    def _device_casts(self, q, src, dst, chunks, scratch, half_bytes):
        """Each chunk: its source elements to a scratch half (side stream), then the cast into
        the target (cast stream); a half is refilled after the cast that read it."""
        sc_events = [(q.event(), q.event()) for _ in range(2)]
        for c, ((ti, j), first, n) in enumerate(chunks):
            t = self.tables[ti]
            so, do, _ = (int(v) for v in t.spans[j])
            s, d = src[t.src_location], dst[t.dst_location]
            h = c % 2
            dma_done, cast_done = sc_events[h]
            buf = scratch[h * half_bytes : (h + 1) * half_bytes].view(s.dtype)[:n]
            if c >= 2:  # the cast that last read this half
                q.wait(q.side, cast_done)
            with q.on(q.side):
                buf.copy_(s[so + first : so + first + n], non_blocking=True)
            q.record(dma_done, q.side)
            q.wait(q.cast, dma_done)
            with q.on(q.cast):
                torch.ops.reshard.copy_runs(buf, self._desc(n), d[do + first : do + first + n])
            q.record(cast_done, q.cast)

    def _ring_pieces(self, q, src, dst, ring, r: _Route) -> float:
        """The route's small pieces packed by the host into ring slots (cast to the target dtype
        on the way, one `copy_pieces` call per slot and dtype pair), each slot copied to the
        device while the next is packed; returns the packing time."""
        events = [q.event() for _ in range(r.n_slots)]
        pack_s = 0.0
        for k, (slot, packs) in enumerate(zip(r.slots, r.packs, strict=True)):
            sl = k % r.n_slots
            if k >= r.n_slots:
                q.host_wait(events[sl])  # the copy that last read this slot
            base = ring[sl * r.slot_bytes : (sl + 1) * r.slot_bytes]
            t0 = time.perf_counter()
            for locs, rows, ddt in packs:
                torch.ops.reshard.copy_pieces([src[loc] for loc in locs], rows, base.view(ddt))
            pack_s += time.perf_counter() - t0
            for key, first, n, at in slot:
                ti, j, _, _ = r.small[key]
                t = self.tables[ti]
                d = dst[t.dst_location]
                do = int(t.spans[j, 1]) + first
                _bytes(d, do, n).copy_(base[at : at + n * d.element_size()], non_blocking=True)
            q.record(events[sl], q.current())
        return pack_s

    def _balance(self, cast_spans, host, src, dst, host_s, total_s) -> None:
        """The split's trial (see `pick_share`): TRIAL_CALLS calls with every cast on the host
        (the host's time per element), then TRIAL_CALLS at each candidate share: the model's
        (`split_fraction`) and one with SMALLER_SHARE of its device share; then the fastest
        share is kept for good. A share set from outside is not part of the trial."""
        if not cast_spans or self.split != "trial" or not self.link_bytes_per_s:
            return
        if self.host_share >= 1.0:
            host_elems = sum(n for _, _, _, n in host)
            if host_elems and host_s > 0:
                h = host_s / host_elems
                old = self.host_s_per_elem
                self.host_s_per_elem = h if old is None else EMA * h + (1 - EMA) * old
        elif self.host_share not in self._candidates:
            return
        self._trial.setdefault(self.host_share, []).append(total_s)
        if len(self._trial[self.host_share]) < TRIAL_CALLS:
            return
        if not self._candidates:
            ti, _ = cast_spans[0]
            t = self.tables[ti]
            f = split_fraction(
                self.host_s_per_elem,
                self.link_bytes_per_s,
                dst[t.dst_location].element_size(),
                src[t.src_location].element_size(),
            )
            if f >= 1.0:  # the model sees no gain: nothing to try
                self.split = "rejected"
                return
            self._candidates = [f, 1.0 - SMALLER_SHARE * (1.0 - f)]
        for c in self._candidates:
            if len(self._trial.get(c, ())) < TRIAL_CALLS:
                self.host_share = c
                return
        self.host_share = pick_share(self._trial, MIN_GAIN)
        self.split = "kept" if self.host_share < 1.0 else "rejected"


def _probe_link(tables, cast_spans, src, q, dev, device_bytes):
    """The H2D rate of page-locked memory, once: a copy of up to 64 MiB (within the
    scratch's bound, before the scratch exists) of the first cast span's source, best of
    three, timed on the device (bytes per second; None if nothing to time)."""
    ti, j = cast_spans[0]
    t = tables[ti]
    s = src[t.src_location]
    so, _, n = (int(v) for v in t.spans[j])
    n = min(n, min(64 << 20, device_bytes) // s.element_size())
    if n <= 0:
        return None
    buf = torch.empty(n, dtype=s.dtype, device=dev)
    best = None
    for _ in range(3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(q.side)
        with q.on(q.side):
            buf.copy_(s[so : so + n], non_blocking=True)
        b.record(q.side)
        b.synchronize()
        ms = a.elapsed_time(b)
        best = ms if best is None else min(best, ms)
    return n * s.element_size() / (best / 1e3) if best and best > 0 else None


class _Streams:
    """The side streams of one CUDA device and the stream operations of the pipeline."""

    def __init__(self, dev):
        self.side, self.cast = torch.cuda.Stream(dev), torch.cuda.Stream(dev)

    def current(self):
        return torch.cuda.current_stream()

    def event(self, timed=False):
        return torch.cuda.Event(enable_timing=timed)

    def elapsed(self, a, b) -> float:
        return a.elapsed_time(b) / 1e3

    def on(self, stream):
        return torch.cuda.stream(stream)

    def wait(self, stream, event):
        stream.wait_event(event)

    def record(self, event, stream):
        event.record(stream)

    def host_wait(self, event):
        event.synchronize()

    def stage(self, src, desc, ring, dst, progress=None):
        torch.ops.reshard.stage_h2d(src, desc, ring, dst, progress)

    def finish(self, side=True):
        """Waits for every copy queued: the side streams' (when `side`), then the current
        stream's."""
        cur = self.current()
        for st in (self.side, self.cast) if side else ():
            done = torch.cuda.Event()
            done.record(st)
            cur.wait_event(done)
        cur.synchronize()


class _Ordered:
    """The same operations where every copy completes before the next starts (CPU targets)."""

    side = cast = None

    def current(self):
        return None

    def event(self, timed=False):
        return None

    def elapsed(self, a, b) -> float:
        return 0.0

    def on(self, stream):
        return contextlib.nullcontext()

    def wait(self, stream, event):
        pass

    def record(self, event, stream):
        pass

    def host_wait(self, event):
        pass

    def stage(self, src, desc, ring, dst, progress=None):
        torch.ops.reshard.copy_runs(src, desc, dst)
        if progress is not None:  # as stage_h2d publishes: base + table elements * scale
            elements = int((desc[:, 4] * desc[:, 5]).sum())
            torch.ops.reshard.progress_set(progress, int(progress[2] + elements * progress[3]))

    def finish(self, side=True):
        pass


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _bytes(t: torch.Tensor, first: int, n: int) -> torch.Tensor:
    """Elements [first, first + n) of a 1-D tensor as bytes (copies of any dtype stay exact)."""
    isz = t.element_size()
    return t.view(torch.uint8)[first * isz : (first + n) * isz]
