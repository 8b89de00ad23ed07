"""A brute-force planner that speaks the executor's contract (docs/internals.md).

Element by element, no cleverness: every logical element's source replica and target slot,
grouped per (source storage, target storage), cut into budget-sized messages, one message per
peer pair per round. It lets the executor be tested against schedules that do not come from
reshard.plan (and shaped on purpose: many rounds, many tiny runs), so an executor bug and a
planner bug cannot hide each other.
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class LocalCopy:
    src_location: int
    dst_location: int
    desc: np.ndarray


@dataclass
class Segment:
    src_location: int
    dst_location: int
    wire_dtype: torch.dtype
    byte_offset: int
    numel: int
    desc: np.ndarray
    contiguous: bool = False  # never claimed here: every message stays one wire


@dataclass
class Message:
    peer: int
    round: int
    arena_offset: int
    nbytes: int
    segments: list


@dataclass
class RankSchedule:
    rank: int
    num_rounds: int
    local: list = field(default_factory=list)
    sends: list = field(default_factory=list)
    recvs: list = field(default_factory=list)
    send_arena_bytes: int = 0
    recv_arena_bytes: int = 0


def wire_dtype(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """Equal dtypes travel as themselves, fp16<->bf16 as the target's, fp32 with a 16-bit
    dtype as the 16-bit one."""
    if a == b:
        return a
    if {a, b} == {torch.float16, torch.bfloat16}:
        return b
    return a if a.itemsize < b.itemsize else b


def _elements(tl):
    """(logical flat index, location, storage index) for every element of every piece."""
    out = []
    shape = tl.shape
    for p in tl.pieces:
        if 0 in p.shape:
            continue
        grids = np.meshgrid(*[np.arange(n) for n in p.shape], indexing="ij")
        rel = [g.reshape(-1) for g in grids]
        sidx = p.offset + sum(s * r for s, r in zip(p.strides, rel, strict=True))
        idx = [r + s for r, s in zip(rel, p.start, strict=True)]
        logical = np.ravel_multi_index(idx, shape)
        out.append((logical, np.full(logical.size, p.location), sidx))
    return out


def _runs(sidx: np.ndarray, didx: np.ndarray) -> np.ndarray:
    """Coalesce element pairs (sorted by didx) into rows with count 1."""
    if sidx.size == 0:
        return np.zeros((0, 6), np.int64)
    brk = np.flatnonzero((np.diff(sidx) != 1) | (np.diff(didx) != 1)) + 1
    starts = np.concatenate([[0], brk])
    lens = np.diff(np.concatenate([starts, [sidx.size]]))
    z = np.zeros_like(lens)
    return np.stack([sidx[starts], z, didx[starts], z, lens, z + 1], 1).astype(np.int64)


class RefPlan:
    def __init__(self, src, dst, budget_bytes_per_peer=64 << 20, salt=""):
        self.src, self.dst, self.budget = src, dst, int(budget_bytes_per_peer)
        self.fingerprint = hashlib.sha256(
            f"ref{self.budget}{salt}{sorted(src.storages)}{sorted(dst.storages)}".encode()
        ).hexdigest()[:16]
        # pairs[(src_loc, dst_loc)] -> (sidx array, didx array), sorted by didx
        pairs: dict = {}
        turn = itertools.count()
        for name, dtl in dst.tensors.items():
            stl = src.tensors[name]
            src_of: dict[int, list] = {}
            for logical, loc, sidx in _elements(stl):
                for lg, lc, si in zip(logical.tolist(), loc.tolist(), sidx.tolist(), strict=True):
                    src_of.setdefault(lg, []).append((lc, si))
            for logical, loc, didx in _elements(dtl):
                for lg, dl, di in zip(logical.tolist(), loc.tolist(), didx.tolist(), strict=True):
                    reps = src_of[lg]
                    drank = dst.storages[dl].rank
                    here = [r for r in reps if src.storages[r[0]].rank == drank]
                    sl, si = here[0] if here else reps[next(turn) % len(reps)]
                    pairs.setdefault((sl, dl), []).append((si, di))
        self.pairs = {}
        for key, lst in pairs.items():
            arr = np.array(sorted(lst, key=lambda x: x[1]), np.int64).reshape(-1, 2)
            self.pairs[key] = (arr[:, 0], arr[:, 1])
        self._build()

    def _build(self):
        ranks = {s.rank for s in self.src.storages.values()} | {
            s.rank for s in self.dst.storages.values()
        }
        self.scheds = {r: RankSchedule(r, 0) for r in ranks}
        chunks: dict = {}  # (srank, drank) -> list of per-round segment lists
        for (sl, dl), (si, di) in sorted(self.pairs.items()):
            sr, dr = self.src.storages[sl].rank, self.dst.storages[dl].rank
            if sr == dr:
                self.scheds[sr].local.append(LocalCopy(sl, dl, _runs(si, di)))
                continue
            wire = wire_dtype(self.src.storages[sl].dtype, self.dst.storages[dl].dtype)
            per = max(1, self.budget // wire.itemsize)
            lst = chunks.setdefault((sr, dr), [])
            for lo in range(0, si.size, per):
                lst.append((sl, dl, wire, si[lo : lo + per], di[lo : lo + per]))
        nrounds = 0
        for (sr, dr), pieces in sorted(chunks.items()):
            # one segment per message, one message per round: the most rounds
            for k, (sl, dl, wire, si, di) in enumerate(pieces):
                pos = np.arange(si.size, dtype=np.int64)
                n = si.size
                nb = n * wire.itemsize
                s_seg = Segment(sl, dl, wire, 0, n, _runs(si, pos))
                r_seg = Segment(sl, dl, wire, 0, n, _runs(pos, di))
                self._add(sr, k, Message(dr, k, 0, nb, [s_seg]), "sends")
                self._add(dr, k, Message(sr, k, 0, nb, [r_seg]), "recvs")
                nrounds = max(nrounds, k + 1)
        for s in self.scheds.values():
            s.num_rounds = nrounds
            for attr in ("sends", "recvs"):
                lst = getattr(s, attr)
                lst += [[] for _ in range(nrounds - len(lst))]
                # lay a round's messages out one after another, 16-byte aligned
                most = 0
                for msgs in lst:
                    off = 0
                    for m in msgs:
                        m.arena_offset = off
                        off += -(-m.nbytes // 16) * 16
                    most = max(most, off)
                setattr(s, attr[:-1] + "_arena_bytes", most)

    def _add(self, rank, k, msg, attr):
        lst = getattr(self.scheds[rank], attr)
        while len(lst) <= k:
            lst.append([])
        lst[k].append(msg)

    def schedule(self, rank):
        return self.scheds.get(rank) or RankSchedule(
            rank,
            self.num_rounds_any(),
            [],
            *([[[] for _ in range(self.num_rounds_any())] for _ in range(2)]),
        )

    def num_rounds_any(self):
        return max((s.num_rounds for s in self.scheds.values()), default=0)

    def staging_bytes(self, rank, transport="gloo", host_ring_bytes=0):
        s = self.schedule(rank)
        held = min(2, s.num_rounds) * (s.send_arena_bytes + s.recv_arena_bytes)
        if transport == "nccl":
            return {"device": held, "host_pinned": host_ring_bytes, "host": 0}
        return {"device": 0, "host_pinned": 0, "host": held}
