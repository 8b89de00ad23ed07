"""Rounds: storage-pair totals cut into 16-byte aligned segments and per-round messages
under the per-peer budget, with their arena offsets; and the per-peer budget a per-rank
budget allows."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from .records import ALIGN, I64, StorageIndex, align


class Groups(NamedTuple):
    """Remote storage pairs in stream order (sender, receiver, source storage, target
    storage): locations, ranks, element totals, wire itemsize, and `key` (source index *
    number of targets + target index) to find a pair from its storages."""

    src_loc: np.ndarray
    dst_loc: np.ndarray
    sender: np.ndarray
    receiver: np.ndarray
    numel: np.ndarray
    itemsize: np.ndarray
    key: np.ndarray


class LocalTotals(NamedTuple):
    """Storage pairs within one rank: the rank, the target's StorageIndex number, elements."""

    rank: np.ndarray
    dst: np.ndarray
    numel: np.ndarray


class SegmentTable(NamedTuple):
    """Segment i holds elements [lo, hi) of group `group`'s stream, in round `round` at
    `byte_offset` of its message."""

    group: np.ndarray
    round: np.ndarray
    byte_offset: np.ndarray
    lo: np.ndarray
    hi: np.ndarray

    def packed(self) -> np.ndarray:
        return np.stack(self, axis=1).reshape(-1, 5)


class MessageTable(NamedTuple):
    """Message i goes from `sender` to `receiver` in round `round`, `nbytes` long, at
    `send_offset` of the sender's arena and `recv_offset` of the receiver's."""

    sender: np.ndarray
    receiver: np.ndarray
    round: np.ndarray
    nbytes: np.ndarray
    send_offset: np.ndarray
    recv_offset: np.ndarray

    def packed(self) -> np.ndarray:
        return np.stack(self, axis=1).reshape(-1, 6)


@dataclasses.dataclass(frozen=True, eq=False)
class Rounds:
    """The global structure of a plan's transport. `send_arena[rank]` / `recv_arena[rank]`:
    the most bytes that rank sends / receives in one round (over all its peers)."""

    groups: Groups
    local: LocalTotals
    segments: SegmentTable
    messages: MessageTable
    num_rounds: int
    send_arena: dict
    recv_arena: dict
    segment_rows: np.ndarray  # segments.packed(), built once for every schedule
    message_rows: np.ndarray  # messages.packed()
    key_order: np.ndarray  # groups sorted by key

    def group_of(self, keys) -> tuple[np.ndarray, np.ndarray]:
        """(group index, found) of storage-pair keys."""
        sorted_keys = self.groups.key[self.key_order]
        ng = len(sorted_keys)
        at = np.minimum(np.searchsorted(sorted_keys, keys), max(ng - 1, 0))
        found = sorted_keys[at] == keys if ng else np.zeros(len(keys), bool)
        return self.key_order[at] if ng else at, found


def cut_rounds(pair_src, pair_dst, pair_numel, index: StorageIndex, budget) -> Rounds:
    """Cut each (sender, receiver) stream of storage-pair totals into rounds of at most
    floor16(budget) bytes; every segment starts 16-byte aligned inside its message."""
    groups, local = _groups(pair_src, pair_dst, pair_numel, index)
    _check_cuts(groups, budget)
    segs, msgs = _cut(groups, budget - budget % ALIGN)
    m = np.array(msgs, I64).reshape(-1, 4)
    send_off, send_arena = _arena_offsets(m, 0)
    recv_off, recv_arena = _arena_offsets(m, 1)
    s = np.array(segs, I64).reshape(-1, 5)
    segments, messages = SegmentTable(*s.T), MessageTable(*m.T, send_off, recv_off)
    return Rounds(
        groups=groups,
        local=local,
        segments=segments,
        messages=messages,
        num_rounds=int(m[:, 2].max()) + 1 if len(m) else 0,
        send_arena=send_arena,
        recv_arena=recv_arena,
        segment_rows=segments.packed(),
        message_rows=messages.packed(),
        key_order=np.argsort(groups.key, kind="stable"),
    )


def _groups(si, di, numel, index: StorageIndex):
    snd, rcv = index.src_rank[si], index.dst_rank[di]
    order = np.lexsort((di, si, rcv, snd))
    si, di, numel, snd, rcv = si[order], di[order], numel[order], snd[order], rcv[order]
    is_local = snd == rcv
    local = LocalTotals(snd[is_local], di[is_local], numel[is_local])
    r = ~is_local
    si, di, numel, snd, rcv = si[r], di[r], numel[r], snd[r], rcv[r]
    groups = Groups(
        src_loc=index.src_locs[si],
        dst_loc=index.dst_locs[di],
        sender=snd,
        receiver=rcv,
        numel=numel,
        itemsize=index.pair_itemsize(si, di),
        key=si * len(index.dst_locs) + di,
    )
    return groups, local


# Segments beyond one per storage pair, made by cutting pairs' data across rounds, are refused
# above these many, in all and on one rank (as sender or as receiver): `plan()` cuts every
# rank's segments, a schedule and every call then work per segment of their rank (a 16 MiB
# tensor sent at a 16-byte budget is 2**20 segments: 2.5 s to plan, 17 s and 1.5 GB for the
# sender's schedule), so a budget far below the data is a hang, not a plan. A 140 GB model sent
# by one rank to another at 1 MiB per round is 2**17 segments.
MAX_CUTS = 1 << 22
MAX_RANK_CUTS = 1 << 18


def _cuts(g: Groups, cap) -> tuple:
    """Lower bounds of the segments beyond one per group that `_cut` makes with messages of
    `cap` bytes (a segment holds at most cap // itemsize elements): in all, and the most of
    any rank as sender or as receiver."""
    room = np.maximum(cap - cap % ALIGN, ALIGN) // g.itemsize
    extra = -(-g.numel // room) - 1
    total = int(extra.sum())
    if total <= MAX_RANK_CUTS:
        return total, total  # no rank can have more (the common case: no sort)
    by_rank = max(
        np.bincount(np.unique(g.sender, return_inverse=True)[1], extra).max(),
        np.bincount(np.unique(g.receiver, return_inverse=True)[1], extra).max(),
    )
    return total, int(by_rank)


def _fits(g: Groups, cap) -> bool:
    total, by_rank = _cuts(g, cap)
    return total <= MAX_CUTS and by_rank <= MAX_RANK_CUTS


def _check_cuts(g: Groups, budget):
    """ValueError when the budget cuts the data into too many segments (MAX_CUTS,
    MAX_RANK_CUTS), naming the smallest budget that does not."""
    if not len(g.numel) or _fits(g, budget):
        return
    lo, hi = budget, 1 << 62  # no cuts at 2**62: no group holds that many bytes
    while hi - lo > ALIGN:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if _fits(g, mid) else (mid, hi)
    total, by_rank = _cuts(g, budget)
    raise ValueError(
        f"budget_bytes_per_peer={budget} is too small for this plan: it would cut the data of "
        f"{len(g.numel)} storage pairs into at least {total} more segments ({by_rank} on one "
        f"rank; the limits are {MAX_CUTS} in all and {MAX_RANK_CUTS} per rank: planning, "
        f"schedules and calls would take minutes and gigabytes); a per-peer budget of at "
        f"least {hi - hi % ALIGN} bytes fits"
    )


def _cut(g: Groups, cap):
    """Segments (group, round, byte_offset, elem_lo, elem_hi) and messages (sender,
    receiver, round, nbytes) of the groups' streams, each message at most `cap` bytes."""
    segs, msgs = [], []
    ng = len(g.numel)
    pair_new = np.ones(ng, bool)
    if ng > 1:
        pair_new[1:] = (g.sender[1:] != g.sender[:-1]) | (g.receiver[1:] != g.receiver[:-1])
    rnd = pos = 0
    snd, rcv = g.sender.tolist(), g.receiver.tolist()
    for i, (n, w, new) in enumerate(zip(g.numel.tolist(), g.itemsize.tolist(), pair_new.tolist())):
        if new:
            if i:
                msgs.append((snd[i - 1], rcv[i - 1], rnd, align(pos)))
            rnd = pos = 0
        e = 0
        while e < n:
            start = align(pos)
            room = (cap - start) // w
            if room <= 0:
                msgs.append((snd[i], rcv[i], rnd, align(pos)))
                rnd, pos = rnd + 1, 0
                continue
            take = min(n - e, room)
            segs.append((i, rnd, start, e, e + take))
            pos = start + take * w
            e += take
    if ng:
        msgs.append((snd[-1], rcv[-1], rnd, align(pos)))
    return segs, msgs


def _arena_offsets(m, who):
    """Offsets of messages `m` (sender, receiver, round, nbytes) in the arenas of side `who`
    (0: senders, 1: receivers): within (rank, round), laid out by peer order; and each
    rank's arena size (its largest round)."""
    off = np.zeros(len(m), I64)
    arena = {}
    o = np.lexsort((m[:, 1 - who], m[:, 2], m[:, who]))
    if not len(o):
        return off, arena
    w, r, nb = m[o, who], m[o, 2], m[o, 3]
    brk = np.ones(len(o), bool)
    brk[1:] = (w[1:] != w[:-1]) | (r[1:] != r[:-1])
    csum = np.cumsum(nb)
    base = np.maximum.accumulate(np.where(brk, csum - nb, 0))
    off[o] = csum - nb - base
    tot = csum - base
    for rank in np.unique(w).tolist():
        arena[rank] = int(tot[w == rank].max())
    return off, arena


def per_peer_budget(index: StorageIndex, pair_src, pair_dst, pair_numel, budget_bytes_per_rank):
    """The per-peer budget that keeps every rank's double-buffered send + receive arenas
    within `budget_bytes_per_rank`: each arena holds at most one message per peer of at most
    the per-peer budget, so 2 * (send peers + receive peers) * per-peer <= the rank budget.
    None when no message crosses ranks (no arenas)."""
    snd, rcv = index.src_rank[pair_src], index.dst_rank[pair_dst]
    remote = (snd != rcv) & (pair_numel > 0)
    pairs = np.unique(np.stack([snd[remote], rcv[remote]]), axis=1)
    if not pairs.shape[1]:
        return None  # nothing crosses ranks: nothing is staged
    # send peers + receive peers of each rank (pairs are unique)
    ranks, peers = np.unique(pairs.ravel(), return_counts=True)
    i = int(np.argmax(peers))
    rank, peers = int(ranks[i]), int(peers[i])
    per_peer = budget_bytes_per_rank // (2 * peers)
    per_peer -= per_peer % ALIGN
    if per_peer < ALIGN:
        raise ValueError(
            f"budget_bytes_per_rank={budget_bytes_per_rank} is too small for this plan: rank "
            f"{rank} exchanges messages with {peers} peers (send + receive), which needs at "
            f"least 2 * {peers} * {ALIGN} = {2 * peers * ALIGN} bytes (one 16-byte segment "
            "per peer, double buffered)"
        )
    return per_peer
