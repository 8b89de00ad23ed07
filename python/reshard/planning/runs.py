"""Boxes to runs: each job (a strided box copied between two storages) becomes one or a few
copy runs, and neighbouring runs are coalesced. Run tables are int64 [8, n] (see SL .. CNT)."""

from __future__ import annotations

import numpy as np

from .helpers import expand, segments_of
from .records import CNT, DL, DO, DS, I64, LEN, SL, SO, SS, Jobs


def jobs_to_runs(jobs: Jobs) -> np.ndarray:
    """The coalesced runs of `jobs`, sorted by (source storage, target storage) and, in a
    pair, by the target offset of each job's first element. That order depends only on the
    job set of the pair, which both ends of a transfer build alike."""
    o = np.lexsort((jobs.dst_off, jobs.dst_loc, jobs.src_loc))
    j = jobs.take(o)
    runs = box_runs(
        j.src_loc, j.src_off, j.src_strides, j.dst_loc, j.dst_off, j.dst_strides, j.extent
    )
    return coalesce(runs)


def box_runs(sl, so, Ss, dl, do, Sd, E):
    """Strided copy of boxes -> runs, columnar int64 [8, n] (see SL..CNT), in box order.

    Dims are ordered by source stride, dims contiguous in both storages merge into the run
    length, the largest remaining dim becomes the count, any others are enumerated.
    """
    m, D = E.shape
    if m == 0:
        return np.zeros((8, 0), I64)
    if D >= 2:
        # fast path: boxes that are at most 2-D in the last two dims, unit inner stride on
        # both sides (ZeRO ranges, row/column splits): one run each, no reordering
        fast = (Ss[:, -1] == 1) & (Sd[:, -1] == 1)
        if D > 2:
            fast &= (E[:, :-2] == 1).all(axis=1)
        if fast.all():
            return _box_runs_2d(sl, so, Ss[:, -2], dl, do, Sd[:, -2], E[:, -2], E[:, -1])
        if fast.any():
            f, g = np.nonzero(fast)[0], np.nonzero(~fast)[0]
            a = _box_runs_2d(sl[f], so[f], Ss[f, -2], dl[f], do[f], Sd[f, -2], E[f, -2], E[f, -1])
            b = _general_runs(sl[g], so[g], Ss[g], dl[g], do[g], Sd[g], E[g])
            # keep planning order: interleave back by job index
            src_idx = np.concatenate(
                [np.repeat(f, 1), np.repeat(g, _runs_per_box(E[g], Ss[g], Sd[g]))]
            )
            o = np.argsort(src_idx, kind="stable")
            return np.take(np.concatenate([a, b], axis=1), o, axis=1)
    return _general_runs(sl, so, Ss, dl, do, Sd, E)


def _general_runs(sl, so, Ss, dl, do, Sd, E):
    m, D = E.shape
    W, WS, WD = _merge_contiguous(*_sorted_dims(E, Ss, Sd))
    ar = np.arange(m)
    length = W[:, D]
    outer = W[:, :D]
    cdim = np.argmax(outer, axis=1)  # largest remaining dim becomes the count
    count = outer[ar, cdim]
    css, csd = WS[ar, cdim], WD[ar, cdim]
    rest = outer.copy()
    rest[ar, cdim] = 1
    nruns = rest.prod(axis=1)
    if (nruns == 1).all():
        own = ar
        so2, do2 = so, do
    else:
        # the other dims are enumerated, one run per index
        own, t = expand(nruns)
        so2, do2 = so[own].copy(), do[own].copy()
        for k in range(D - 1, -1, -1):
            ek = rest[own, k]
            dig = t % ek
            t = t // ek
            so2 += dig * WS[own, k]
            do2 += dig * WD[own, k]
    L, C = length[own], count[own]
    one = C == 1
    out = np.empty((8, len(own)), I64)
    out[SL], out[SO], out[DL], out[DO], out[LEN], out[CNT] = sl[own], so2, dl[own], do2, L, C
    out[SS] = np.where(one, L, css[own])
    out[DS] = np.where(one, L, csd[own])
    return out


def _sorted_dims(E, Ss, Sd):
    """Each box's dims (extent > 1) in descending (source stride, target stride) order."""
    D = E.shape[1]
    big = E > 1
    key_s = np.where(big, Ss, -1)
    if D > 1 and not (key_s[:, :-1] >= key_s[:, 1:]).all():
        # two stable passes = a per-row lexsort by (src stride, dst stride), descending
        key_d = np.where(big, Sd, -1)
        o1 = np.argsort(-key_d, axis=1, kind="stable")
        o2 = np.argsort(-np.take_along_axis(key_s, o1, axis=1), axis=1, kind="stable")
        order = np.take_along_axis(o1, o2, axis=1)
        E = np.take_along_axis(E, order, axis=1)
        Ss = np.take_along_axis(Ss, order, axis=1)
        Sd = np.take_along_axis(Sd, order, axis=1)
    return E, Ss, Sd


def _merge_contiguous(E, Ss, Sd):
    """Extents and strides with a virtual innermost dim D carrying the run length: each dim
    contiguous in both storages with the dim it continues is merged into that one."""
    m, D = E.shape
    W = np.concatenate([E, np.ones((m, 1), I64)], axis=1)
    WS = np.concatenate([Ss, np.ones((m, 1), I64)], axis=1)
    WD = np.concatenate([Sd, np.ones((m, 1), I64)], axis=1)
    ar = np.arange(m)
    tgt = np.full(m, D, I64)
    for k in range(D - 1, -1, -1):
        e = W[:, k]
        te, ts, td = W[ar, tgt], WS[ar, tgt], WD[ar, tgt]
        can = (e > 1) & (WS[:, k] == ts * te) & (WD[:, k] == td * te)
        ci = np.nonzero(can)[0]
        W[ci, tgt[ci]] *= e[ci]
        W[ci, k] = 1
        mv = (e > 1) & ~can
        tgt[mv] = k
    return W, WS, WD


def _box_runs_2d(sl, so, ss0, dl, do, sd0, e0, e1):
    """Boxes of e0 rows of e1 contiguous elements, row strides ss0 / sd0."""
    contig = (e0 == 1) | ((ss0 == e1) & (sd0 == e1))
    out = np.empty((8, len(sl)), I64)
    out[SL], out[SO], out[DL], out[DO] = sl, so, dl, do
    out[LEN] = np.where(contig, e0 * e1, e1)
    out[CNT] = np.where(contig, 1, e0)
    out[SS] = np.where(contig, out[LEN], ss0)
    out[DS] = np.where(contig, out[LEN], sd0)
    return out


def _runs_per_box(E, Ss, Sd):
    """How many runs the general path emits per box (for re-interleaving)."""
    r = _general_runs(
        np.arange(len(E), dtype=I64),
        np.zeros(len(E), I64),
        Ss,
        np.zeros(len(E), I64),
        np.zeros(len(E), I64),
        Sd,
        E,
    )
    return np.bincount(r[SL], minlength=len(E))


def normalize(runs):
    """Runs whose rows are contiguous in both storages become one longer row (in place)."""
    c = (runs[CNT] > 1) & (runs[SS] == runs[LEN]) & (runs[DS] == runs[LEN])
    if c.any():
        runs[LEN, c] *= runs[CNT, c]
        runs[CNT, c] = 1
        runs[SS, c] = runs[LEN, c]
        runs[DS, c] = runs[LEN, c]
    return runs


def coalesce(runs):
    """Merge neighbouring runs (in planning order, which follows both storages): single rows
    contiguous in both storages join; rows of one length at one constant pair of gaps chain
    into a strided run. No sort: neighbours in planning order are where merges are.
    Modifies `runs` (always a fresh table of the caller's) in place."""
    if runs.shape[1] < 2:
        return runs
    runs = _join_contiguous(normalize(runs))
    if runs.shape[1] < 2:
        return runs
    return _chain_strided(runs)


def _join_contiguous(runs):
    """Single rows contiguous in both storages with the next one join into one row."""
    a, b = runs[:, :-1], runs[:, 1:]
    link = (
        (a[CNT] == 1)
        & (b[CNT] == 1)
        & (a[SL] == b[SL])
        & (a[DL] == b[DL])
        & (b[SO] == a[SO] + a[LEN])
        & (b[DO] == a[DO] + a[LEN])
    )
    if link.any():
        st = segments_of(np.concatenate([[False], link]))
        merged = np.take(runs, st, axis=1)
        merged[LEN] = np.add.reduceat(runs[LEN], st)
        one = merged[CNT] == 1  # strided runs are never merged here; keep their strides
        merged[SS, one] = merged[LEN, one]
        merged[DS, one] = merged[LEN, one]
        runs = merged
    return runs


def _chain_strided(runs):
    """Equal-length rows whose positions form one arithmetic progression in both storages
    chain into one strided run."""
    a, b = runs[:, :-1], runs[:, 1:]
    gs = b[SO] - (a[SO] + (a[CNT] - 1) * a[SS])
    gd = b[DO] - (a[DO] + (a[CNT] - 1) * a[DS])
    basic = (
        (a[SL] == b[SL])
        & (a[DL] == b[DL])
        & (a[LEN] == b[LEN])
        & (gs > 0)
        & (gd > 0)
        & ((a[CNT] == 1) | ((a[SS] == gs) & (a[DS] == gd)))
        & ((b[CNT] == 1) | ((b[SS] == gs) & (b[DS] == gd)))
    )
    if not basic.any():
        return runs
    # a single row linked on both sides must see the same gap on both
    prev_basic = np.concatenate([[False], basic[:-1]])
    prev_gs = np.concatenate([[0], gs[:-1]])
    prev_gd = np.concatenate([[0], gd[:-1]])
    link = basic & ((a[CNT] > 1) | ~prev_basic | ((prev_gs == gs) & (prev_gd == gd)))
    st = segments_of(np.concatenate([[False], link]))
    merged = np.take(runs, st, axis=1)
    merged[CNT] = np.add.reduceat(runs[CNT], st)
    multi = merged[CNT] > 1
    nxt = np.minimum(st + 1, runs.shape[1] - 1)
    first_multi = runs[CNT, st] > 1
    merged[SS] = np.where(
        multi, np.where(first_multi, runs[SS, st], runs[SO, nxt] - runs[SO, st]), merged[SS]
    )
    merged[DS] = np.where(
        multi, np.where(first_multi, runs[DS, st], runs[DO, nxt] - runs[DO, st]), merged[DS]
    )
    return normalize(merged)
