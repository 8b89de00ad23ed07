"""Target aliasing: no storage element may be written for two logical elements.

Pieces are sorted by footprint bounds per storage; only clusters whose bounds overlap
(interleaved fused buffers) are expanded into contiguous rows and compared, and a piece whose
strides could map two of its own indices onto one element is expanded on its own.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..errors import LayoutError
from .intervals import overlapping_rows, segmented_cummax
from .values import I64, num_elements

# Expanding a piece's storage footprint, or a cluster of interleaved pieces' footprints, into
# contiguous rows (aliasing checks of interleaved targets) is refused above this many rows
# rather than exhausting memory (2**24 rows: about 4 s and 1.5 GB).
MAX_EXPAND_ROWS = 1 << 24


class Footprints(NamedTuple):
    """Non-empty pieces of many tensors: storage `location`, first and last storage element
    touched (`lo`, `hi`), and which piece it is (`tensor` index into the names, `piece`)."""

    location: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    tensor: np.ndarray
    piece: np.ndarray


def check_target_aliasing(tensors: dict):
    """Raise LayoutError naming two pieces (or one piece) that write one storage element."""
    names = sorted(tensors)
    parts = []
    by_d = {}
    for t, name in enumerate(names):
        by_d.setdefault(len(tensors[name].shape), []).append(t)
    for d, ts in sorted(by_d.items()):
        fp = _footprints(tensors, names, ts, d)
        if fp is not None:
            parts.append(fp)
    if parts:
        fp = Footprints(*(np.concatenate([p[k] for p in parts]) for k in range(5)))
        _check_clusters(tensors, names, fp)


def _footprints(tensors, names, ts, d):
    """Footprints of the tensors `ts` (all of ndim d) in one vectorized pass, after checking
    that each of their pieces is injective on its own."""
    tls = [tensors[names[t]] for t in ts]
    counts = np.array([len(tl) for tl in tls], I64)
    n = int(counts.sum())
    if not n:
        return None
    loc = np.concatenate([tl.table.location for tl in tls])
    off = np.concatenate([tl.table.offset for tl in tls])
    box = np.concatenate([tl.table.shape for tl in tls]).reshape(n, d)
    strides = np.concatenate([tl.table.strides for tl in tls]).reshape(n, d)
    tix = np.repeat(np.array(ts, I64), counts)
    pix = np.arange(n, dtype=I64) - np.repeat(np.cumsum(counts) - counts, counts)
    hi = off + (strides * (box - 1)).sum(axis=1)
    ne = np.nonzero((box > 0).all(axis=1))[0]
    for j in ne[~_injective(box[ne], strides[ne])].tolist():
        tl, i, name = tensors[names[tix[j]]], int(pix[j]), names[tix[j]]
        starts, lengths = footprint_rows(tl, i)
        hit = overlapping_rows(starts, lengths)
        if hit is not None:
            raise LayoutError(
                f"target tensor {name!r}: piece {i} {tl.piece(i)}: two logical elements "
                f"written to the same storage element {int(starts[hit[1]])} of location "
                f"{int(loc[j])} (strides overlap)"
            )
    return Footprints(loc[ne], off[ne], hi[ne], tix[ne], pix[ne])


def _check_clusters(tensors, names, fp: Footprints):
    """Clusters of pieces whose footprint bounds chain-overlap within one storage are expanded
    into rows and checked for an overlap."""
    order = np.lexsort((fp.lo, fp.location))
    loc, lo, hi, tix, pix = (a[order] for a in fp)
    n = len(loc)
    new = np.ones(n, bool)
    if n > 1:
        grp_max = segmented_cummax(hi, loc)
        new[1:] = (loc[1:] != loc[:-1]) | (lo[1:] > grp_max[:-1])
    starts = np.nonzero(new)[0]
    sizes = np.diff(np.append(starts, n))
    for c in np.nonzero(sizes > 1)[0].tolist():
        members = range(int(starts[c]), int(starts[c] + sizes[c]))
        nrows = sum(_row_shape(tensors[names[int(tix[m])]], int(pix[m]))[2] for m in members)
        if nrows > MAX_EXPAND_ROWS:
            m = members[0]
            tl = tensors[names[int(tix[m])]]
            raise LayoutError(
                f"{tl.piece_label(int(pix[m]))} and {len(members) - 1} more target pieces "
                f"interleave in location {int(loc[m])}: too many to verify they alias nothing "
                f"({nrows} contiguous rows, more than {MAX_EXPAND_ROWS})"
            )
        rs, rl, rid = [], [], []
        for m in members:
            s, ln = footprint_rows(tensors[names[int(tix[m])]], int(pix[m]))
            rs.append(s)
            rl.append(ln)
            rid.append(np.full(len(s), m, I64))
        s, ln, who = np.concatenate(rs), np.concatenate(rl), np.concatenate(rid)
        hit = overlapping_rows(s, ln)
        if hit is None:
            continue
        a, b = int(who[hit[0]]), int(who[hit[1]])
        ta, tb = tensors[names[int(tix[a])]], tensors[names[int(tix[b])]]
        raise LayoutError(
            f"target tensor {names[int(tix[b])]!r}: piece {int(pix[b])} "
            f"{tb.piece(int(pix[b]))}: writes storage element {int(s[hit[1]])} of location "
            f"{int(loc[b])}, also written by tensor {names[int(tix[a])]!r} piece "
            f"{int(pix[a])} {ta.piece(int(pix[a]))}: two logical elements written to "
            "the same target storage element"
        )


def _injective(box, strides):
    """Sufficient test that each piece maps distinct indices to distinct storage elements."""
    n = len(box)
    if n == 0:
        return np.ones(0, bool)
    big = box > 1
    s = np.where(big, strides, np.iinfo(I64).max)
    order = np.argsort(s, axis=1, kind="stable")
    s_sorted = np.take_along_axis(s, order, axis=1)
    b_sorted = np.take_along_axis(np.where(big, box, 1), order, axis=1)
    ok = np.ones(n, bool)
    reach = np.zeros(n, I64)  # max offset reached by the dims so far
    for k in range(box.shape[1]):
        active = s_sorted[:, k] != np.iinfo(I64).max
        ok &= ~active | (s_sorted[:, k] > reach)
        reach = np.where(active, reach + s_sorted[:, k] * (b_sorted[:, k] - 1), reach)
    return ok


def _row_shape(tl, i: int):
    """Piece `i`'s footprint as rows: the dims enumerated (smallest stride first), the
    contiguous length of a row, and the number of rows."""
    t = tl.table
    box, strides = t.shape[i], t.strides[i]
    dims = [k for k in range(len(box)) if box[k] > 1]
    dims.sort(key=lambda k: strides[k])
    length = 1
    while dims and strides[dims[0]] == length:
        length *= int(box[dims.pop(0)])
    return dims, length, num_elements([int(box[k]) for k in dims])


def footprint_rows(tl, i: int):
    """Piece `i`'s storage footprint as contiguous rows (starts, lengths)."""
    t = tl.table
    box, strides, off = t.shape[i], t.strides[i], int(t.offset[i])
    dims, length, nrows = _row_shape(tl, i)
    if nrows > MAX_EXPAND_ROWS:
        raise LayoutError(
            f"{tl.piece_label(i)}: too interleaved to verify it aliases nothing ({nrows} rows)"
        )
    starts = np.array([off], I64)
    for k in dims:
        starts = (starts[:, None] + np.arange(int(box[k]), dtype=I64)[None, :] * strides[k]).ravel()
    return starts, np.full(len(starts), length, I64)
