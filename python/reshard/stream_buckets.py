"""Bucket planning of an `rs.Stream`: which tensors travel together, where each bucket sits in
the receivers' buffer, when it may start moving, and the plan that moves it. Pure data: built
once in the Stream's constructor, the same on every rank.

The receivers' buffer is a ring of `ring_bytes(buckets, bucket_bytes)` bytes: the largest
bucket, or two buckets' worth (`2 * bucket_bytes`, at most everything streamed) when that is
more, or what the caller asks for (at least the largest bucket). A receiver must hold the
largest tensor whole at some point, so by default the ring is never larger than it needs to be
when a tensor is at least two buckets large; a larger ring lets the bucket after such a tensor
move while that tensor is consumed. Each bucket is placed right
after the previous one, or at the start or the end of the ring, wherever the fewest of the
previous bucket's tensors still in use overlap it (`place_buckets`). A bucket may be written as
soon as the caller has moved past every earlier tensor that shares its bytes
(`Bucket.ready_after`, counted in stream order over all buckets): with a ring of two buckets,
bucket k+1 is queued behind bucket k once the caller is done with bucket k-1, so it moves
while bucket k is consumed and the mover never waits for the caller in between.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping
from typing import NamedTuple

import torch

from .layout import Layout, Piece, Storage, TensorLayout
from .planning import plan as make_plan
from .preflight import copy_support

ALIGN = 16  # bytes: every tensor and every dtype group starts 16-byte aligned in the buffer


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class Entry(NamedTuple):
    """One tensor of a bucket: its byte offset within the bucket (in the streamed dtype)."""

    name: str
    shape: tuple
    dtype: torch.dtype
    offset: int
    nbytes: int


@dataclasses.dataclass
class Bucket:
    """One bucket: its tensors (stream order), where it sits, when it may move, its plan.

    entries: in stream order; byte offsets grouped by dtype (one target storage per dtype and
    receiver). groups: {dtype: (first byte, end byte)} within the bucket. start: byte offset of
    the bucket in the receivers' buffer. wait_consumed: how many tensors of the previous bucket
    (in stream order) the caller must be done with before this bucket may be written (0: it
    moves while the previous one is consumed; all of them: it waits for the whole bucket).
    targets: {target location: (receiver index, dtype)}."""

    index: int
    names: list
    entries: list = dataclasses.field(default_factory=list)
    groups: dict = dataclasses.field(default_factory=dict)
    nbytes: int = 0
    start: int = 0
    wait_consumed: int = 0
    ready_after: int = 0
    targets: dict = dataclasses.field(default_factory=dict)
    plan: object = None
    src_locations: tuple = ()


def make_buckets(names, layout: Layout, out_dtypes: dict, bucket_bytes: int) -> list[Bucket]:
    """Greedy in stream order: a bucket closes when the next tensor would overflow it (a tensor
    larger than `bucket_bytes` is a bucket of its own). Inside a bucket the tensors are
    grouped by dtype."""
    runs, cur, used = [], [], 0
    for name in names:
        n = aligned(layout.tensors[name].numel * out_dtypes[name].itemsize)
        if cur and used + n > bucket_bytes:
            runs.append(cur)
            cur, used = [], 0
        cur.append((name, n))
        used += n
    if cur:
        runs.append(cur)
    return [_bucket(i, items, layout, out_dtypes) for i, items in enumerate(runs)]


def _bucket(index, items, layout, out_dtypes) -> Bucket:
    b = Bucket(index, [name for name, _ in items])
    by_dtype: dict = {}
    for name, n in items:
        by_dtype.setdefault(out_dtypes[name], []).append((name, n))
    offset, entries = 0, {}
    for dt, members in by_dtype.items():
        lo = offset
        for name, n in members:
            shape = tuple(layout.tensors[name].shape)
            entries[name] = Entry(name, shape, dt, offset, layout.tensors[name].numel * dt.itemsize)
            offset += n
        b.groups[dt] = (lo, offset)
    b.nbytes = offset
    b.entries = [entries[name] for name in b.names]
    return b


def ring_bytes(buckets: list[Bucket], bucket_bytes: int, buffer_bytes=None) -> int:
    """The receivers' buffer: `buffer_bytes` when given (at least the largest bucket), else
    max(largest bucket, min(2 * bucket_bytes, all buckets))."""
    largest = max((b.nbytes for b in buckets), default=0)
    if buffer_bytes is not None:
        if buffer_bytes < largest:
            name = next(b.names[0] for b in buckets if b.nbytes == largest)
            raise ValueError(
                f"buffer_bytes {buffer_bytes} is smaller than the largest bucket ({largest} B, "
                f"from {name!r}): a receiver holds one bucket whole"
            )
        return buffer_bytes
    total = sum(b.nbytes for b in buckets)
    return max(largest, min(2 * bucket_bytes, total))


def _needs(prev: Bucket, start: int, nbytes: int) -> int:
    """How many of `prev`'s tensors (stream order) must be consumed before [start, +nbytes)
    may be written: one past the last tensor of `prev` that shares bytes with it."""
    need = 0
    for i, e in enumerate(prev.entries):
        lo = prev.start + e.offset
        if e.nbytes and lo < start + nbytes and start < lo + e.nbytes:
            need = i + 1
    return need


def place_buckets(buckets: list[Bucket], size: int) -> None:
    """Set each bucket's start, wait_consumed and ready_after in a ring of `size` bytes.
    Candidates: right after the previous bucket (when it fits), the ring's start, its end
    (every start ALIGN-aligned); the one that waits for the fewest tensors of the previous
    bucket wins (ties: in that order)."""
    for k, b in enumerate(buckets):
        if k == 0:
            b.start, b.wait_consumed = 0, 0
            continue
        prev = buckets[k - 1]
        after = prev.start + prev.nbytes
        end = (size - b.nbytes) // ALIGN * ALIGN  # the last aligned start that fits
        starts = ([after] if after + b.nbytes <= size else []) + [0, end]
        # ties keep the earlier candidate: min over (need, position in `starts`)
        b.wait_consumed, _, b.start = min(
            (_needs(prev, s, b.nbytes), i, s) for i, s in enumerate(starts)
        )
    _set_ready_after(buckets)


def _set_ready_after(buckets: list[Bucket]) -> None:
    """Each bucket's ready_after, from the newest tensor on each byte of the ring: a list of
    disjoint (first byte, end byte, tensor's stream index) painted bucket by bucket. A bucket
    clears its whole range (an older tensor left under its padding was consumed before it
    moved, since it overlaps this bucket's range too) and paints its tensors."""
    painted: list[tuple[int, int, int]] = []
    first = 0  # stream index of the bucket's first tensor
    for b in buckets:
        lo, hi = b.start, b.start + b.nbytes
        b.ready_after = 1 + max((i for a, z, i in painted if a < hi and lo < z), default=-1)
        kept = []
        for a, z, i in painted:
            if z <= lo or hi <= a:
                kept.append((a, z, i))
                continue
            if a < lo:
                kept.append((a, lo, i))
            if hi < z:
                kept.append((hi, z, i))
        for j, e in enumerate(b.entries):
            if e.nbytes:
                kept.append((b.start + e.offset, b.start + e.offset + e.nbytes, first + j))
        painted = kept
        first += len(b.entries)


def plan_bucket(b: Bucket, src: Layout, receivers, staging_bytes_per_rank: int) -> None:
    """Source: the bucket's tensors and the storages they read. Target: one storage per
    (receiver, dtype) holding that dtype's tensors back to back at their bucket offsets."""
    dst_storages, loc_of = {}, {}
    for j, r in enumerate(receivers):
        for dt, (lo, hi) in b.groups.items():
            loc = len(dst_storages)
            dst_storages[loc] = Storage(r, dt, (hi - lo) // dt.itemsize)
            loc_of[(j, dt)] = loc
            b.targets[loc] = (j, dt)
    src_tensors, dst_tensors, src_locs = {}, {}, set()
    for e in b.entries:
        tl = src.tensors[e.name]
        if tl.numel == 0:
            continue  # nothing to move: yielded as an empty view
        src_tensors[e.name] = tl
        src_locs.update(p.location for p in tl.pieces)
        elem = (e.offset - b.groups[e.dtype][0]) // e.dtype.itemsize
        zeros = (0,) * len(e.shape)
        dst_tensors[e.name] = TensorLayout(
            e.shape,
            [Piece(loc_of[(j, e.dtype)], elem, zeros, e.shape) for j in range(len(receivers))],
            name=e.name,
        )
    src_part = Layout(src_tensors, {loc: src.storages[loc] for loc in sorted(src_locs)})
    b.plan = make_plan(
        src_part, Layout(dst_tensors, dst_storages), budget_bytes_per_rank=staging_bytes_per_rank
    )
    b.src_locations = tuple(sorted(src_locs))


# ---------------------------------------------------------------------- validation


def check_receivers(receivers, world: int) -> list[int]:
    if isinstance(receivers, numbers.Integral) and not isinstance(receivers, bool):
        receivers = [receivers]
    if isinstance(receivers, Mapping):  # its keys would be taken as the ranks
        raise ValueError(f"receivers must be a list of ranks, got {receivers!r}")
    try:
        out = list(receivers)
    except TypeError:
        raise ValueError(f"receivers must be a list of ranks, got {receivers!r}") from None
    if not out:
        raise ValueError("receivers is empty: name at least one rank that receives the tensors")
    for i, r in enumerate(out):
        if isinstance(r, bool) or not isinstance(r, numbers.Integral):
            raise ValueError(f"receivers must be int ranks, got {r!r}")
        out[i] = r = int(r)  # numpy ints too, as a rank anywhere else
        if not 0 <= r < world:
            raise ValueError(f"receiver {r!r} is not a rank of the group (size {world})")
    if len(set(out)) != len(out):
        raise ValueError(f"receivers {out} name a rank twice")
    return out


def check_names(names, layout: Layout) -> list[str]:
    if names is None:
        names = list(layout.tensors)
        if not names:
            raise ValueError("the source layout has no tensors: nothing to stream")
        return names
    if isinstance(names, str):
        raise ValueError(f"names must be a list of tensor names, got the string {names!r}")
    try:
        names = list(names)
    except TypeError:
        raise ValueError(f"names must be a list of tensor names, got {names!r}") from None
    if not names:
        raise ValueError("names is empty: nothing to stream")
    bad = [n for n in names if not isinstance(n, str)]
    if bad:
        raise ValueError(f"names must be strings, got {bad[:3]!r}")
    unknown = [n for n in names if n not in layout.tensors]
    if unknown:
        known = list(layout.tensors)
        raise ValueError(
            f"{len(unknown)} name(s) not in the source layout: {unknown[:5]}"
            f"{' ...' if len(unknown) > 5 else ''} (it has {len(known)} tensors, e.g. "
            f"{known[:3]})"
        )
    seen, dup = set(), []
    for n in names:
        if n in seen:
            dup.append(n)
        seen.add(n)
    if dup:
        raise ValueError(f"names lists {dup[:5]} more than once")
    return names


def out_dtype(name: str, layout: Layout, dtype) -> torch.dtype:
    """The dtype `name` is streamed in; the source storages' dtypes must allow the cast."""
    tl = layout.tensors[name]
    src = {layout.storages[p.location].dtype for p in tl.pieces}
    if dtype is None:
        if len(src) > 1:
            raise ValueError(
                f"tensor {name!r} lives in storages of dtypes {sorted(map(str, src))}: pass "
                "dtype= to stream it in one"
            )
        if not src:  # an empty tensor: the layout's only dtype, if it has one
            src = {st.dtype for st in layout.storages.values()}
            if len(src) != 1:
                raise ValueError(
                    f"tensor {name!r} is empty (no pieces) and the layout mixes dtypes: "
                    "pass dtype= (or leave it out of names)"
                )
        dtype = next(iter(src))
    for s in src or {dtype}:
        why = copy_support(s, dtype)
        if why is not None:
            raise ValueError(f"tensor {name!r}: cannot stream {s} as {dtype} ({why})")
    return dtype
