"""The records planning passes between its steps and hands to execution.

Schedule records (`LocalCopy`, `Segment`, `Message`, `RankSchedule`) are what one rank does;
`StorageIndex` numbers the storages of both layouts; `Jobs` are boxes copied from one piece
to another; run tables are int64 `[8, n]` arrays whose rows are named by `SL .. CNT`.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np
import torch

I64 = np.int64
ALIGN = 16  # every segment starts ALIGN-byte aligned inside its message
FLOATS = (torch.float32, torch.bfloat16, torch.float16)

# Rows of a run table: (src_location, src_offset, src_stride, dst_location, dst_offset,
# dst_stride, length, count); a run copies `count` rows of `length` elements.
SL, SO, SS, DL, DO, DS, LEN, CNT = range(8)


def align(x):
    """`x` rounded up to a multiple of ALIGN."""
    return -(-x // ALIGN) * ALIGN


def wire_dtype(src: torch.dtype, dst: torch.dtype) -> torch.dtype | None:
    """The dtype a (source storage, target storage) pair travels in, or None if unsupported.

    Equal dtypes travel as themselves; fp32 with bf16/fp16 travels as the 16-bit one (narrow
    on the sender, widen on the receiver); fp16<->bf16 travels as the target dtype.
    """
    if src == dst:
        return src
    if src in FLOATS and dst in FLOATS:
        if src == torch.float32:
            return dst
        if dst == torch.float32:
            return src
        return dst
    return None


@dataclasses.dataclass(frozen=True, eq=False)
class LocalCopy:
    """Runs whose source and target storages both belong to this rank: desc src -> dst."""

    src_location: int
    dst_location: int
    desc: np.ndarray


@dataclasses.dataclass(frozen=True, eq=False)
class Segment:
    """A 16-byte aligned piece of a message holding `numel` elements of `wire_dtype`.

    Sender: desc maps src storage -> segment. Receiver: desc maps segment -> dst storage.
    `contiguous`: the segment is one in-order range of the source storage and one of the
    target storage, both of the wire dtype; sender and receiver agree on it, so such a
    segment may travel as a message of its own, straight between the two buffers.
    """

    src_location: int
    dst_location: int
    wire_dtype: torch.dtype
    byte_offset: int
    numel: int
    desc: np.ndarray
    contiguous: bool = False


@dataclasses.dataclass(frozen=True, eq=False)
class Message:
    """One point-to-point message of a round at arena[arena_offset : arena_offset+nbytes]."""

    peer: int
    round: int
    arena_offset: int
    nbytes: int
    segments: list


@dataclasses.dataclass(eq=False)
class RankSchedule:
    """What one rank does: its local copies, and per round the messages it sends and
    receives (`sends[k]`, `recvs[k]`, sorted by peer); the arena bytes they need."""

    rank: int
    num_rounds: int
    local: list
    sends: list
    recvs: list
    send_arena_bytes: int
    recv_arena_bytes: int


def _wire_itemsize(src, dst):
    w = wire_dtype(src, dst)
    return 0 if w is None else w.itemsize  # 0: a pair no run may use (the planner checks)


@dataclasses.dataclass(frozen=True, eq=False)
class StorageIndex:
    """The storages of both layouts, numbered in sorted location order (`src_locs[i]` is
    source storage i), with their ranks, the position of each rank among all ranks present
    (`*_rank_pos`: ranks are labels, any int64), target itemsizes, and dtype classes with the
    wire itemsize of each (source class, target class) pair (0: no wire dtype)."""

    src_locs: np.ndarray
    dst_locs: np.ndarray
    src_rank: np.ndarray
    dst_rank: np.ndarray
    src_rank_pos: np.ndarray
    dst_rank_pos: np.ndarray
    num_ranks: int
    dst_itemsize: np.ndarray
    src_class: np.ndarray
    dst_class: np.ndarray
    wire_itemsize: np.ndarray

    @classmethod
    def of(cls, src, dst) -> StorageIndex:
        s_locs, d_locs = sorted(src.storages), sorted(dst.storages)
        s_rank = np.array([src.storages[x].rank for x in s_locs], I64)
        d_rank = np.array([dst.storages[x].rank for x in d_locs], I64)
        ranks = np.unique(np.concatenate([s_rank, d_rank]))
        # dtype classes: few distinct dtypes, many storages
        sdt = sorted({s.dtype for s in src.storages.values()}, key=str)
        ddt = sorted({s.dtype for s in dst.storages.values()}, key=str)
        wire = [[_wire_itemsize(a, b) for b in ddt] for a in sdt]
        return cls(
            src_locs=np.array(s_locs, I64),
            dst_locs=np.array(d_locs, I64),
            src_rank=s_rank,
            dst_rank=d_rank,
            src_rank_pos=np.searchsorted(ranks, s_rank),
            dst_rank_pos=np.searchsorted(ranks, d_rank),
            num_ranks=len(ranks),
            dst_itemsize=np.array([dst.storages[x].dtype.itemsize for x in d_locs], I64),
            src_class=np.array([sdt.index(src.storages[x].dtype) for x in s_locs], I64),
            dst_class=np.array([ddt.index(dst.storages[x].dtype) for x in d_locs], I64),
            wire_itemsize=np.array(wire, I64).reshape(len(sdt), len(ddt)),
        )

    def src_index(self, locations) -> np.ndarray:
        return lookup(self.src_locs, locations)

    def dst_index(self, locations) -> np.ndarray:
        return lookup(self.dst_locs, locations)

    def pair_itemsize(self, si, di) -> np.ndarray:
        """Wire itemsize of source storages `si` with target storages `di` (0: unsupported)."""
        return self.wire_itemsize[self.src_class[si], self.dst_class[di]]


def lookup(sorted_keys, values) -> np.ndarray:
    """Index (int64) of each value in `sorted_keys` (all present): a direct table when the
    keys are small ints (storage locations usually are), else a binary search."""
    if len(sorted_keys) and 0 <= sorted_keys[0] and sorted_keys[-1] < 4 * len(sorted_keys) + 4096:
        table = np.zeros(int(sorted_keys[-1]) + 1, I64)
        table[sorted_keys] = np.arange(len(sorted_keys), dtype=I64)
        return table[values]
    return np.searchsorted(sorted_keys, values).astype(I64)


class Jobs(NamedTuple):
    """Boxes to copy, one per row: from storage `src_loc` at `src_off` with `src_strides` to
    storage `dst_loc` at `dst_off` with `dst_strides`; `extent` is the box (dims padded in
    front to the plan's ndim with extent 1)."""

    src_loc: np.ndarray
    src_off: np.ndarray
    src_strides: np.ndarray
    dst_loc: np.ndarray
    dst_off: np.ndarray
    dst_strides: np.ndarray
    extent: np.ndarray

    @classmethod
    def empty(cls, ndim) -> Jobs:
        z, zd = np.zeros(0, I64), np.zeros((0, ndim), I64)
        return cls(z, z, zd, z, z, zd, zd)

    @classmethod
    def concat(cls, ndim, parts) -> Jobs:
        parts = [cls.empty(ndim), *parts]
        return cls(*(np.concatenate([p[k] for p in parts]) for k in range(7)))

    @property
    def count(self) -> int:
        return len(self.src_loc)

    def take(self, idx) -> Jobs:
        return Jobs(*(a[idx] for a in self))

    def packed(self) -> np.ndarray:
        """One int64 row per job: src_loc, src_off, src_strides, dst_loc, dst_off,
        dst_strides, extent (the form the fingerprint hashes)."""
        return np.concatenate([a if a.ndim == 2 else a[:, None] for a in self], axis=1)
