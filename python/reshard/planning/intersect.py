"""Intersection of pieces: batches of tensors, their pieces stacked, source regions, target
templates, and the jobs (box, source piece, target piece) where they overlap."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .helpers import expand, rows_equal, segments_of
from .records import I64, Jobs

# Jobs (piece intersections) are made in batches of about this many pieces so that peak
# memory stays bounded on models with millions of pieces. Read at call time.
BATCH_PIECES = 1 << 15


class Batch(NamedTuple):
    """Tensors planned together: global tensor ids `tids`, `pos[tid]` the position of a
    tensor in the batch, `shape[i]` its shape padded in front to the plan's ndim (all zeros
    for an empty tensor: it has no pieces here and takes no sweep key range), `numel[i]` its
    element count."""

    tids: np.ndarray
    pos: np.ndarray
    shape: np.ndarray
    numel: np.ndarray


class PieceSet(NamedTuple):
    """Non-empty pieces of a batch's tensors, stacked: global `tensor` id, storage `location`,
    `offset`, and `start`/`shape`/`strides` padded in front to the plan's ndim (extent 1,
    stride 0)."""

    tensor: np.ndarray
    location: np.ndarray
    offset: np.ndarray
    start: np.ndarray
    shape: np.ndarray
    strides: np.ndarray


class Templates(NamedTuple):
    """Distinct target (tensor, start, shape, strides) boxes: `order` sorts the target pieces
    so that the replicas of template i are `order[first[i] : first[i] + count[i]]`."""

    order: np.ndarray
    first: np.ndarray
    count: np.ndarray


class Overlaps(NamedTuple):
    """Pairs (a[i], b[i]) of boxes that intersect in the box [lo[i], hi[i])."""

    a: np.ndarray
    b: np.ndarray
    lo: np.ndarray
    hi: np.ndarray


class Regions(NamedTuple):
    """Distinct source boxes [lo, hi) of batch tensor `tensor`, each read from any of its
    holders: source pieces `holders[first[r] : first[r] + count[r]]`."""

    tensor: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    first: np.ndarray
    count: np.ndarray
    holders: np.ndarray


def batches(src, dst, names, tids):
    """Tensors in batches of about BATCH_PIECES pieces, so temporaries stay small."""
    out, cur, size = [], [], 0
    for t in tids:
        name = names[t]
        cur.append(t)
        size += len(src.tensors[name]) + len(dst.tensors[name])
        if size >= BATCH_PIECES:
            out.append(cur)
            cur, size = [], 0
    if cur:
        out.append(cur)
    return out


def batch_of(layout, names, tids, ndim) -> Batch:
    tids = np.asarray(tids, I64)
    shapes = []
    for t in tids.tolist():
        shp = layout.tensors[names[t]].shape
        shapes.append((1,) * (ndim - len(shp)) + tuple(shp))
    shapes = np.array(shapes, I64).reshape(len(tids), ndim)
    pos = np.zeros(int(tids.max()) + 1, I64)
    pos[tids] = np.arange(len(tids))
    numel = shapes.prod(axis=1)
    # An empty tensor takes no sweep key range, so the keys of `intersect` stay within the
    # elements of the batch (below 2**53) however long its dims are.
    return Batch(tids, pos, np.where(numel[:, None] > 0, shapes, 0), numel)


def gather(layout, names, tids, ndim) -> PieceSet:
    """The non-empty pieces of tensors `tids`. One concatenation per ndim, so the cost per
    tensor is a list append, not numpy calls."""
    by_d = {}
    for t in tids.tolist():
        tl = layout.tensors[names[t]]
        by_d.setdefault(len(tl.shape), []).append((t, tl))
    parts = []
    for d, items in sorted(by_d.items()):
        tables = [tl.table for _, tl in items]
        loc, off, start, box, strides = (np.concatenate([t[k] for t in tables]) for k in range(5))
        counts = np.array([len(t.location) for t in tables], I64)
        tid = np.repeat(np.array([t for t, _ in items], I64), counts)
        n = len(loc)
        start, box, strides = (a.reshape(n, d) for a in (start, box, strides))
        keep = (box > 0).all(axis=1)
        if keep.all():
            keep = slice(None)  # a view, not a copy
        pad = ndim - d

        def padded(a, fill, keep=keep, pad=pad):
            a = a[keep]
            if pad:
                a = np.concatenate([np.full((len(a), pad), fill, I64), a], axis=1)
            return a

        parts.append(
            PieceSet(
                tid[keep],
                loc[keep],
                off[keep],
                padded(start, 0),
                padded(box, 1),
                padded(strides, 0),
            )
        )
    return PieceSet(*(np.concatenate([pt[k] for pt in parts]) for k in range(6)))


def templates(ti, start, box, strides) -> Templates:
    """Distinct target (box, strides) per tensor; replicas of a template differ only in
    storage and base offset."""
    order = np.lexsort(tuple(strides.T[::-1]) + tuple(box.T[::-1]) + tuple(start.T[::-1]) + (ti,))
    first = segments_of(rows_equal(ti[order], start[order], box[order], strides[order]))
    return Templates(order, first, np.diff(np.append(first, len(order))))


def intersect(shape, a_ti, a_lo, a_hi, b_ti, b_lo, b_hi) -> Overlaps:
    """All pairs (i, j) of boxes a_i, b_j of the same tensor that intersect, with the
    intersection. `shape[t]`: an extent of tensor t holding all its boxes. Output-sensitive:
    candidate pairs are the pairs whose ranges on one sweep key overlap, found by binary search
    (one box's key start lies inside the other's range), then filtered. The key is picked per
    call among one dim or the row-major index over a leading run of dims (see `_sweep_keys`),
    whichever yields the fewest candidates: dim 0 alone makes every pair of a tensor's column
    blocks, or of a (1, n) tensor's ZeRO ranges, a candidate (quadratic in pieces).
    The order of the pairs carries no meaning: callers sort what needs an order."""
    best = None
    for keys in _sweep_keys(shape, a_ti, a_lo, a_hi, b_ti, b_lo, b_hi):
        cand = _candidates(*keys)
        if best is None or cand.count < best.count:
            best = cand
        if best.count <= 4 * (len(a_ti) + len(b_ti)):
            break  # about as few as the boxes themselves: no key can do much better
    pa, pb = best.pairs()
    lo = np.maximum(a_lo[pa], b_lo[pb])
    hi = np.minimum(a_hi[pa], b_hi[pb])
    ok = (hi > lo).all(axis=1)
    if ok.all():
        return Overlaps(pa, pb, lo, hi)
    return Overlaps(pa[ok], pb[ok], lo[ok], hi[ok])


def _sweep_keys(shape, a_ti, a_lo, a_hi, b_ti, b_lo, b_hi):
    """Key ranges [k0, k1) of both box sets for each sweep key, dim 0 first: each dim alone,
    then the row-major index over dims 0..k (a box's indices there lie between those of its
    first and last corner, so boxes that intersect have overlapping ranges). Every tensor gets
    its own key range (a base), so one sweep covers the batch. Ranges are at most a tensor's
    elements, so keys stay below the batch's elements (2**53)."""
    shape = np.asarray(shape, I64)
    D = shape.shape[1]
    for k in range(D):  # one dim
        ext = shape[:, k]
        base = np.cumsum(ext) - ext
        yield (
            base[a_ti] + a_lo[:, k],
            base[a_ti] + a_hi[:, k],
            base[b_ti] + b_lo[:, k],
            base[b_ti] + b_hi[:, k],
        )
    for k in range(1, D):  # row-major index over dims 0..k
        ext = shape[:, : k + 1].prod(axis=1)
        base = np.cumsum(ext) - ext
        place = np.cumprod(shape[:, k:0:-1], axis=1)[:, ::-1]  # per dim < k: elements/step
        place = np.concatenate([place, np.ones((len(shape), 1), I64)], axis=1)
        pa, pb = place[a_ti], place[b_ti]
        yield (
            base[a_ti] + (a_lo[:, : k + 1] * pa).sum(axis=1),
            base[a_ti] + ((a_hi[:, : k + 1] - 1) * pa).sum(axis=1) + 1,
            base[b_ti] + (b_lo[:, : k + 1] * pb).sum(axis=1),
            base[b_ti] + ((b_hi[:, : k + 1] - 1) * pb).sum(axis=1) + 1,
        )


class _Candidates(NamedTuple):
    """Pairs of boxes whose key ranges overlap, as counts per box before expanding: for each
    b, the a's starting inside [b0, b1) (`ao[x0 : x0 + nx]`); for each a, the b's starting
    inside (a0, a1) (`bo[y0 : y0 + ny]`). Each overlapping pair is in exactly one of them."""

    count: int
    ao: np.ndarray
    x0: np.ndarray
    nx: np.ndarray
    bo: np.ndarray
    y0: np.ndarray
    ny: np.ndarray

    def pairs(self):
        oj, k = expand(self.nx)
        pa, pb = self.ao[self.x0[oj] + k], oj
        oi, k = expand(self.ny)
        return np.concatenate([pa, oi]), np.concatenate([pb, self.bo[self.y0[oi] + k]])


def _candidates(ak0, ak1, bk0, bk1) -> _Candidates:
    ao = np.argsort(ak0, kind="stable")
    bo = np.argsort(bk0, kind="stable")
    ak0s, bk0s = ak0[ao], bk0[bo]
    x0 = np.searchsorted(ak0s, bk0, "left")  # a starts inside [b0, b1)
    nx = np.searchsorted(ak0s, bk1, "left") - x0
    y0 = np.searchsorted(bk0s, ak0, "right")  # b starts strictly inside (a0, a1)
    ny = np.searchsorted(bk0s, ak1, "left") - y0
    return _Candidates(int(nx.sum()) + int(ny.sum()), ao, x0, nx, bo, y0, ny)


def source_regions(ti, start, box, direct, numel) -> Regions:
    """Source regions of a batch (`ti`, `start`, `box`: its source pieces; `direct[i]`: batch
    tensor i's pieces do not overlap). A direct tensor's pieces are its regions (one holder
    each); the pieces of the others are grouped by box, and boxes that overlap only partly
    are made disjoint."""
    dpc = np.nonzero(direct[ti])[0]
    rep = np.nonzero(~direct[ti])[0]
    order = rep[np.lexsort(tuple(box[rep].T[::-1]) + tuple(start[rep].T[::-1]) + (ti[rep],))]
    starts = segments_of(rows_equal(ti[order], start[order], box[order]))
    holders = np.concatenate([dpc, order])
    first = np.concatenate([np.arange(len(dpc), dtype=I64), len(dpc) + starts])
    lead = holders[first]
    r = Regions(
        ti[lead],
        start[lead],
        start[lead] + box[lead],
        first,
        np.diff(np.append(first, len(holders))),
        holders,
    )
    vol = np.bincount(
        r.tensor, weights=(r.hi - r.lo).prod(axis=1).astype(np.float64), minlength=len(numel)
    )
    overlapping = np.nonzero(vol > numel)[0]
    return disjoint_regions(overlapping, r) if len(overlapping) else r


def disjoint_regions(tensors, r: Regions) -> Regions:
    """Make the distinct source boxes of `tensors` disjoint (partially overlapping replicas).

    Each box keeps only what earlier boxes did not claim; the pieces it keeps are read from its
    own holders. Only the earlier boxes that intersect it are subtracted (found by `intersect`,
    output-sensitive), in order, so the cost follows the overlapping pairs, not the square of
    the boxes; subtracting a disjoint box changes nothing, so the result is the same.
    """
    bad = np.isin(r.tensor, tensors)
    keep = np.nonzero(~bad)[0]
    idx = np.nonzero(bad)[0]
    ti, lo, hi = r.tensor[idx], r.lo[idx], r.hi[idx]
    # earlier boxes of the same tensor that intersect each box, in order (ti is a batch
    # position; each tensor's extent is the furthest its boxes reach)
    span = np.zeros((int(ti.max()) + 1 if len(ti) else 0, hi.shape[1]), I64)
    np.maximum.at(span, ti, hi)
    ov = intersect(span, ti, lo, hi, ti, lo, hi)
    earlier = ov.b < ov.a
    a, b = ov.a[earlier], ov.b[earlier]
    order = np.lexsort((b, a))
    a, b = a[order], b[order]
    starts = np.searchsorted(a, np.arange(len(idx) + 1))
    lo_l, hi_l, b_l = lo.tolist(), hi.tolist(), b.tolist()
    new_ti, new_lo, new_hi, new_first, new_count = [], [], [], [], []
    for k, i in enumerate(idx.tolist()):
        parts = [(lo_l[k], hi_l[k])]
        for j in b_l[starts[k] : starts[k + 1]]:
            nxt = []
            for plo, phi in parts:
                nxt.extend(box_minus(plo, phi, lo_l[j], hi_l[j]))
            parts = nxt
            if not parts:
                break
        t = int(r.tensor[i])
        for plo, phi in parts:
            new_ti.append(t)
            new_lo.append(plo)
            new_hi.append(phi)
            new_first.append(int(r.first[i]))
            new_count.append(int(r.count[i]))
    D = r.lo.shape[1]
    return Regions(
        np.concatenate([r.tensor[keep], np.array(new_ti, I64)]),
        np.concatenate([r.lo[keep], np.array(new_lo, I64).reshape(-1, D)]),
        np.concatenate([r.hi[keep], np.array(new_hi, I64).reshape(-1, D)]),
        np.concatenate([r.first[keep], np.array(new_first, I64)]),
        np.concatenate([r.count[keep], np.array(new_count, I64)]),
        r.holders,
    )


def box_minus(plo, phi, clo, chi):
    """The box [plo, phi) minus the box [clo, chi), as disjoint boxes."""
    if any(ph <= cl or ch <= pl for pl, ph, cl, ch in zip(plo, phi, clo, chi)):
        return [(plo, phi)]
    out = []
    plo, phi = list(plo), list(phi)
    for k in range(len(plo)):
        if plo[k] < clo[k]:
            hi = list(phi)
            hi[k] = clo[k]
            out.append((list(plo), hi))
            plo[k] = clo[k]
        if phi[k] > chi[k]:
            lo = list(plo)
            lo[k] = chi[k]
            out.append((lo, list(phi)))
            phi[k] = chi[k]
    return out


def jobs_of(h, pj, lo, hi, S: PieceSet, T: PieceSet) -> Jobs:
    """Jobs copying box [lo, hi) from source piece `h` to target piece `pj`."""
    so = S.offset[h] + (S.strides[h] * (lo - S.start[h])).sum(axis=1)
    do = T.offset[pj] + (T.strides[pj] * (lo - T.start[pj])).sum(axis=1)
    return Jobs(S.location[h], so, S.strides[h], T.location[pj], do, T.strides[pj], hi - lo)
