"""A rank's schedule as typed rounds: a pure function, no tensors allocated but descriptor tables.

`build_rounds(sched, direct, dtype_of)` cuts each message into the wires both of its ends
agree on (`wire_parts`: its contiguous segments alone), decides, per wire, which travel
straight from a source / into a target buffer (`direct_range`: the wire is a byte image of one
contiguous range of one buffer in the wire dtype), where every other one sits in the
round's compacted arena, and fuses the packed segments of a round that share a storage and
a wire dtype into one descriptor table over the whole arena (one `copy_runs` call each). The
staging module (`reshard.staging`) allocates arenas of the sizes this returns; the run loop
(`reshard.executor`) walks the rounds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from .planning import align

SEND, RECV = "send", "recv"


def desc_array(desc) -> np.ndarray:
    """A descriptor table as a contiguous int64 [n, 6] array."""
    return np.ascontiguousarray(np.asarray(desc, dtype=np.int64)).reshape(-1, 6)


@dataclass(frozen=True, eq=False)
class Table:
    """One `copy_runs` call: `desc` (a CPU int64 tensor, kept alive so the CUDA op's cache of
    its device copy stays hot) between the storage `location` and the arena viewed as
    `wire_dtype` (pack: storage -> arena; unpack: arena -> storage)."""

    location: int
    wire_dtype: torch.dtype
    desc: torch.Tensor


@dataclass(frozen=True, eq=False)
class LocalTable:
    """A local copy: source storage -> target storage, no transport, no arena."""

    src_location: int
    dst_location: int
    desc: torch.Tensor
    elements: int  # elements written into the target


@dataclass(frozen=True)
class DirectRange:
    """Bytes [first_byte, end_byte) of the buffer at `location`: a message sent from / received
    into the buffer itself."""

    location: int
    first_byte: int
    end_byte: int


@dataclass(frozen=True)
class Wire:
    """One point-to-point operation of a round: a packed message at `arena_offset` of the
    round's arena, or a `direct` range of a buffer."""

    peer: int  # group rank
    send: bool
    nbytes: int
    arena_offset: int | None
    direct: DirectRange | None


@dataclass(frozen=True, eq=False)
class Round:
    index: int
    pack: tuple[Table, ...]
    unpack: tuple[Table, ...]
    wires: tuple[Wire, ...]  # its receives, then its sends
    first_send: int  # wires[first_send:] are the sends
    bytes_sent: int
    bytes_received: int
    uses_send_arena: bool  # some message of the round is packed into the send arena
    uses_recv_arena: bool  # some message is received into the receive arena


@dataclass(frozen=True, eq=False)
class Rounds:
    """Everything the run loop needs for one set of direct-capable buffers."""

    rounds: tuple[Round, ...]
    send_arena_bytes: int  # what one send arena must hold (packed messages of a round)
    recv_arena_bytes: int
    zero_copy_bytes: int  # wire bytes per call (sent + received) that skip the arenas


def local_tables(sched) -> tuple[LocalTable, ...]:
    out = []
    for lc in sched.local:
        d = desc_array(lc.desc)
        out.append(
            LocalTable(
                lc.src_location,
                lc.dst_location,
                torch.from_numpy(d),
                int((d[:, 4] * d[:, 5]).sum()),
            )
        )
    return tuple(out)


def direct_range(msg, side: str, storage_dtype) -> DirectRange | None:
    """The range of one buffer on this side (SEND: the source, RECV: the target) that `msg`
    (anything with `segments` and `nbytes`, segment byte offsets relative to its start) is a
    byte-exact image of in the wire dtype, else None. Such a message travels straight from /
    into the buffer: no pack or unpack copy and no arena bytes. A cast (bf16 on the wire from
    fp32), a gap or reordering, a second storage, or alignment padding between segments all
    disqualify it."""
    segs = msg.segments
    nbytes = int(msg.nbytes)
    if not segs or nbytes == 0:
        return None
    attr = "src_location" if side == SEND else "dst_location"
    loc, wire = getattr(segs[0], attr), segs[0].wire_dtype
    isz = wire.itemsize
    if storage_dtype(loc) != wire or nbytes % isz:
        return None
    sc, mc = (0, 2) if side == SEND else (2, 0)  # storage / message columns of a desc row
    rows = []
    for seg in segs:
        if getattr(seg, attr) != loc or seg.wire_dtype != wire:
            return None
        d = desc_array(seg.desc)
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
    first = int(shift[0])
    return DirectRange(int(loc), first * isz, (first + n) * isz)


@dataclass(frozen=True)
class _Part:
    """A byte range [lo, lo + nbytes) of a message that travels as one wire, and its
    segments with byte offsets relative to lo (what `direct_range` reads)."""

    lo: int
    nbytes: int
    segments: tuple


def wire_parts(msg) -> tuple[_Part, ...]:
    """The wires one message travels as, computed alike on both of its ends: a message with
    one segment, or without a `contiguous` one, is one wire of all its bytes; otherwise each
    contiguous segment is a wire of its own (it may go straight between the buffers on both
    sides) and every run of other segments one wire, from its first segment's start to its
    last one's end. Padding between parts does not travel."""
    segs = sorted(msg.segments, key=lambda seg: int(seg.byte_offset))
    if len(segs) < 2 or not any(seg.contiguous for seg in segs):
        return (_Part(0, int(msg.nbytes), tuple(segs)),)
    groups = []
    for seg in segs:
        if seg.contiguous or not groups or groups[-1][-1].contiguous:
            groups.append([seg])
        else:
            groups[-1].append(seg)
    parts = []
    for group in groups:
        lo = int(group[0].byte_offset)
        hi = int(group[-1].byte_offset) + group[-1].numel * group[-1].wire_dtype.itemsize
        shifted = tuple(
            dataclasses.replace(seg, byte_offset=int(seg.byte_offset) - lo) for seg in group
        )
        if hi > lo:
            parts.append(_Part(lo, hi - lo, shifted))
    return tuple(parts)


def _round(index, sched, direct, dtype_of):
    """One round's wires and fused tables, plus the arena bytes each direction needs."""
    tables = {SEND: {}, RECV: {}}  # (location, wire dtype) -> [desc rows shifted into the arena]
    wires, need = [], {SEND: 0, RECV: 0}
    nbytes = {SEND: 0, RECV: 0}
    zero_copy = 0
    # receives first: the run loop posts wires in this order, and a peer's send moves only
    # once its receive is posted
    for side, msgs in ((RECV, sched.recvs[index]), (SEND, sched.sends[index])):
        attr = "src_location" if side == SEND else "dst_location"
        arena_col = 2 if side == SEND else 0  # pack writes the arena (dst), unpack reads it
        cursor = 0
        for m in msgs:
            nb = int(m.nbytes)  # the message's arena layout, padding between parts included
            parts = wire_parts(m)
            nbytes[side] += sum(part.nbytes for part in parts)  # what travels
            packed = False
            for part in parts:
                rng = None
                if part.segments and (side, getattr(part.segments[0], attr)) in direct:
                    rng = direct_range(part, side, dtype_of[side])
                if rng is not None:
                    wires.append(Wire(int(m.peer), side == SEND, part.nbytes, None, rng))
                    zero_copy += part.nbytes
                    continue
                packed = True
                for seg in part.segments:
                    wire = seg.wire_dtype
                    off = cursor + part.lo + int(seg.byte_offset)
                    d = np.array(desc_array(seg.desc), copy=True)
                    d[:, arena_col] += off // wire.itemsize
                    tables[side].setdefault((getattr(seg, attr), wire), []).append(d)
                if part.nbytes:
                    wires.append(
                        Wire(int(m.peer), side == SEND, part.nbytes, cursor + part.lo, None)
                    )
            if packed:
                need[side] = max(need[side], cursor + nb)
                # packed messages start aligned, as the planner laid them
                cursor = align(cursor + nb)

    def fused(side):
        return tuple(
            Table(loc, wire, torch.from_numpy(np.concatenate(parts)))
            for (loc, wire), parts in tables[side].items()
        )

    rnd = Round(
        index,
        fused(SEND),
        fused(RECV),
        tuple(wires),
        sum(not w.send for w in wires),
        nbytes[SEND],
        nbytes[RECV],
        uses_send_arena=any(w.send and w.direct is None for w in wires),
        uses_recv_arena=any(not w.send and w.direct is None for w in wires),
    )
    return rnd, need, zero_copy


def build_rounds(sched, direct: frozenset, dtype_of: dict) -> Rounds:
    """`sched`: the rank's schedule (checked by `preflight.check_schedule`). `direct`: the
    (SEND | RECV, location) pairs whose buffers may be read / written by the transport itself
    (they live on the arenas' device). `dtype_of`: {SEND: fn(location) -> source dtype, RECV:
    fn(location) -> target dtype}. The arenas hold only the packed messages of a round, so they
    are never larger than the schedule's send/recv_arena_bytes and may be empty."""
    rounds, zero_copy = [], 0
    need = {SEND: 0, RECV: 0}
    for k in range(int(sched.num_rounds)):
        rnd, n, z = _round(k, sched, direct, dtype_of)
        rounds.append(rnd)
        zero_copy += z
        need = {side: max(need[side], n[side]) for side in need}
    return Rounds(tuple(rounds), need[SEND], need[RECV], zero_copy)
