"""The per-rank pass: what one rank does, from the pieces on its own storages.

`schedule(plan, rank)` is a pure function of the plan and the rank: it rebuilds the jobs that
involve the rank's storages, turns them into runs, and cuts the runs into the segments the
plan laid out. Sender and receiver of a storage pair build their runs from different pieces
but walk the same element sequence (see runs.jobs_to_runs); each end checks that its runs add
up to the plan's total of every pair it takes part in.
"""

from __future__ import annotations

import numpy as np
import torch

from .helpers import check_rank, expand, rows_equal, segments_of
from .intersect import batch_of, batches, gather, intersect, jobs_of, templates
from .records import (
    CNT,
    DL,
    DO,
    DS,
    I64,
    LEN,
    SL,
    SO,
    SS,
    Jobs,
    LocalCopy,
    Message,
    RankSchedule,
    Segment,
    wire_dtype,
)
from .runs import jobs_to_runs


def schedule(plan, rank) -> RankSchedule:
    """What `rank` does under `plan`: local copies, and per round the messages it sends and
    receives. Built from the pieces on this rank's storages only."""
    rank = check_rank(rank)
    out_runs, in_runs = rank_runs(plan, rank)
    is_local = plan.storages.dst_rank[plan.storages.dst_index(out_runs[DL])] == rank
    local = []
    runs = out_runs[:, is_local]
    if runs.shape[1]:
        # runs are sorted by (source storage, target storage): one LocalCopy per pair
        starts = segments_of(rows_equal(runs[SL], runs[DL]))
        for a, b in zip(starts.tolist(), np.append(starts[1:], runs.shape[1]).tolist()):
            desc = np.ascontiguousarray(runs[[SO, SS, DO, DS, LEN, CNT], a:b].T)
            local.append(LocalCopy(int(runs[SL, a]), int(runs[DL, a]), desc))
    wires = _Wires(plan)
    return RankSchedule(
        rank=rank,
        num_rounds=plan.num_rounds,
        local=local,
        sends=_messages(plan, rank, True, out_runs[:, ~is_local], wires),
        recvs=_messages(plan, rank, False, in_runs, wires),
        send_arena_bytes=plan.rounds.send_arena.get(rank, 0),
        recv_arena_bytes=plan.rounds.recv_arena.get(rank, 0),
    )


def rank_runs(plan, rank):
    """(out, in): this rank's runs as sender (local copies included) and as receiver of
    remote data, each int64 [8, n] in stream order (see runs.jobs_to_runs)."""
    idx = plan.storages
    s_mine = idx.src_rank == rank
    d_mine = idx.dst_rank == rank
    out, inn = [], []
    direct = np.nonzero(plan.direct)[0].tolist()
    for b in batches(plan.src, plan.dst, plan.tensors, direct):
        o, i = _rank_batch(plan, np.asarray(b, I64), s_mine, d_mine)
        out += o
        inn += i
    jobs = plan.replicated_jobs
    if jobs.count:
        si = idx.src_index(jobs.src_loc)
        di = idx.dst_index(jobs.dst_loc)
        out.append(jobs.take(s_mine[si]))
        inn.append(jobs.take(d_mine[di] & ~s_mine[si]))
    return jobs_to_runs(Jobs.concat(plan.ndim, out)), jobs_to_runs(Jobs.concat(plan.ndim, inn))


def _rank_batch(plan, tids, s_mine, d_mine):
    """Jobs of direct tensors `tids` that involve this rank: as sender, its source pieces x
    every target template, multiplied out over the replicas; as receiver, its target pieces x
    every source piece of another rank."""
    b = batch_of(plan.src, plan.tensors, tids, plan.ndim)
    S = gather(plan.src, plan.tensors, b.tids, plan.ndim)
    T = gather(plan.dst, plan.tensors, b.tids, plan.ndim)
    s_ti, d_ti = b.pos[S.tensor], b.pos[T.tensor]
    mine_s = s_mine[plan.storages.src_index(S.location)]
    mine_d = d_mine[plan.storages.dst_index(T.location)]
    out, inn = [], []
    a = np.nonzero(mine_s)[0]
    if len(a) and len(d_ti):
        tpl = templates(d_ti, T.start, T.shape, T.strides)
        first = tpl.order[tpl.first]
        a_lo, t_lo = S.start[a], T.start[first]
        a_hi, t_hi = a_lo + S.shape[a], t_lo + T.shape[first]
        ov = intersect(b.shape, s_ti[a], a_lo, a_hi, d_ti[first], t_lo, t_hi)
        owner, k = expand(tpl.count[ov.b])
        pj = tpl.order[tpl.first[ov.b[owner]] + k]
        out.append(jobs_of(a[ov.a[owner]], pj, ov.lo[owner], ov.hi[owner], S, T))
    r = np.nonzero(mine_d)[0]
    mine_t = np.zeros(len(tids), bool)  # tensors with a target piece here
    mine_t[d_ti[r]] = True
    c = np.nonzero(~mine_s & mine_t[s_ti])[0]
    if len(r) and len(c):
        c_lo, r_lo = S.start[c], T.start[r]
        c_hi, r_hi = c_lo + S.shape[c], r_lo + T.shape[r]
        ov = intersect(b.shape, s_ti[c], c_lo, c_hi, d_ti[r], r_lo, r_hi)
        inn.append(jobs_of(c[ov.a], r[ov.b], ov.lo, ov.hi, S, T))
    return out, inn


class _Wires:
    """Wire dtype of (source location, target location) pairs, looked up once each."""

    def __init__(self, plan):
        self.plan, self.known = plan, {}

    def __call__(self, sl, dl) -> torch.dtype:
        w = self.known.get((sl, dl))
        if w is None:
            w = wire_dtype(self.plan.src.storages[sl].dtype, self.plan.dst.storages[dl].dtype)
            self.known[(sl, dl)] = w
        return w


def _messages(plan, rank, sender_side, runs, wires):
    """This rank's messages of one side; `runs` are its remote runs of that side, sorted
    by (source storage, target storage) and, inside a pair, in stream order."""
    rounds, g = plan.rounds, plan.rounds.groups
    out = [[] for _ in range(plan.num_rounds)]
    gsel = np.nonzero((g.sender if sender_side else g.receiver) == rank)[0]
    key = plan.storages.src_index(runs[SL]) * len(plan.storages.dst_locs)
    key += plan.storages.dst_index(runs[DL])
    run_g, found = rounds.group_of(key)
    if not found.all():
        raise RuntimeError(f"reshard internal error: rank {rank} has runs of no group")
    rnum = runs[LEN] * runs[CNT]
    rpos = np.cumsum(rnum) - rnum
    pos0 = _check_totals(rank, run_g, rnum, rpos, gsel, g.numel)
    if not len(gsel):
        return out
    segs = rounds.segment_rows
    segs = segs[np.isin(segs[:, 0], gsel)]
    descs, contiguous = _slice(segs, sender_side, runs, rpos, rnum, pos0)
    by_key = {}
    src_st, dst_st = plan.src.storages, plan.dst.storages
    for s, (grp, rnd, boff, lo, hi) in enumerate(segs.tolist()):
        peer = int(g.receiver[grp] if sender_side else g.sender[grp])
        sl, dl = int(g.src_loc[grp]), int(g.dst_loc[grp])
        same = src_st[sl].dtype == dst_st[dl].dtype
        seg = Segment(sl, dl, wires(sl, dl), boff, hi - lo, descs[s], same and contiguous[s])
        by_key.setdefault((peer, rnd), []).append(seg)
    m = rounds.message_rows
    for i in np.nonzero(m[:, 0 if sender_side else 1] == rank)[0].tolist():
        snd, rcv, rnd, nbytes, soff, roff = m[i].tolist()
        peer = rcv if sender_side else snd
        offset = soff if sender_side else roff
        out[rnd].append(Message(peer, rnd, offset, nbytes, by_key.get((peer, rnd), [])))
    for lst in out:
        lst.sort(key=lambda msg: msg.peer)
    return out


def _check_totals(rank, run_g, rnum, rpos, gsel, group_numel):
    """Both ends rebuilt their runs independently; they must add up to the global totals.
    Returns the stream position of each group's first run."""
    ng = len(group_numel)
    brk = segments_of(rows_equal(run_g))
    pos0 = np.zeros(ng, I64)
    pos0[run_g[brk]] = rpos[brk]
    have = np.zeros(ng, I64)
    if len(brk):
        have[run_g[brk]] = np.add.reduceat(rnum, brk)
    want = np.zeros(ng, I64)
    want[gsel] = group_numel[gsel]
    if (have != want).any():
        raise RuntimeError(
            f"reshard internal error: rank {rank}'s runs disagree with the plan's totals"
        )
    return pos0


def _slice(segs, sender_side, runs, rpos, rnum, pos0):
    """Per segment, the desc of the run pieces falling in its element range: a partial head
    row, whole rows and a partial tail row of each run it overlaps; and whether the segment
    is one contiguous, in-order range of its source storage and one of its target storage.
    Runs carry both storages' offsets and strides and both ends walk the same element
    sequence, so sender and receiver compute the same flag."""
    glo = pos0[segs[:, 0]] + segs[:, 3]
    ghi = pos0[segs[:, 0]] + segs[:, 4]
    first = np.searchsorted(rpos + rnum, glo, side="right")
    last = np.searchsorted(rpos, ghi, side="left")
    owner, k = expand(last - first)
    ri = first[owner] + k
    run = np.take(runs, ri, axis=1).T
    p0 = rpos[ri]
    lo = np.maximum(glo[owner], p0) - p0  # element range inside the run
    hi = np.minimum(ghi[owner], p0 + rnum[ri]) - p0
    L = run[:, LEN]
    ones = np.ones_like(L)
    ra, rb = -(-lo // L), hi // L
    parts = (  # (mask, row, column, length, count, element position in the run)
        (lo % L != 0, lo // L, lo % L, np.minimum(L - lo % L, hi - lo), ones, lo),
        (rb > ra, ra, np.zeros_like(L), L, rb - ra, ra * L),
        ((hi % L != 0) & (rb >= ra), rb, np.zeros_like(L), hi % L, ones, rb * L),
    )
    rows = [_desc_rows(sender_side, run, p0, glo[owner], L, *p) for p in parts]
    own = np.concatenate([owner[r[0]] for r in rows])
    pos = np.concatenate([r[1] for r in rows])
    desc = np.concatenate([r[2] for r in rows]).astype(I64)
    ext = np.concatenate([r[3] for r in rows]).astype(I64).reshape(-1, 4)
    o = np.lexsort((pos, own))
    own, desc, ext = own[o], desc[o], ext[o]
    bounds = np.searchsorted(own, np.arange(len(segs) + 1))
    return [
        np.ascontiguousarray(desc[bounds[s] : bounds[s + 1]]) for s in range(len(segs))
    ], _contiguous(own, ext, len(segs))


def _contiguous(own, ext, n):
    """Per segment: its pieces (rows of `ext`: source start, target start, elements, dense on
    both sides; sorted by segment and position) each dense and each starting on both sides
    where the previous one ended."""
    ok = np.zeros(n, bool)
    if not len(own):
        return ok
    bad = ext[:, 3] == 0
    same = own[1:] == own[:-1]
    step = (ext[1:, 0] != ext[:-1, 0] + ext[:-1, 2]) | (ext[1:, 1] != ext[:-1, 1] + ext[:-1, 2])
    bad[1:] |= same & step
    ok[np.unique(own)] = True
    ok[own[bad]] = False
    return ok


def _desc_rows(sender_side, run, p0, seg_lo, L, m, row, col, ln, cnt, q):
    """Descriptor rows of one kind of run piece (see _slice): (indices, positions in the
    segment, rows, extents). Sender rows map storage -> segment, receiver rows segment ->
    storage; extents are (source start, target start, elements, dense on both sides)."""
    i = np.nonzero(m)[0]
    r = run[i]
    so = r[:, SO] + row[i] * r[:, SS] + col[i]
    do = r[:, DO] + row[i] * r[:, DS] + col[i]
    spos = p0[i] + q[i] - seg_lo[i]  # position inside the segment
    one = cnt[i] == 1
    stride = np.where(one, ln[i], L[i])  # the segment side is dense
    if sender_side:
        d = np.column_stack([so, np.where(one, ln[i], r[:, SS]), spos, stride, ln[i], cnt[i]])
    else:
        d = np.column_stack([spos, stride, do, np.where(one, ln[i], r[:, DS]), ln[i], cnt[i]])
    dense = one | ((r[:, SS] == ln[i]) & (r[:, DS] == ln[i]))
    return i, spos, d, np.column_stack([so, do, ln[i] * cnt[i], dense])
