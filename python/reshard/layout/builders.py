"""Builders of TensorLayouts for the common shardings: `replicated`, `split` (TP, DTensor
Shard), `flat` (ZeRO ranges of the flattened tensor) and `nest` (a sharding of a sharding)."""

from __future__ import annotations

import operator
from collections.abc import Mapping
from itertools import chain

import numpy as np

from ..errors import LayoutError
from .pieces import TensorLayout, check_tensors, find_gap, read_only_view
from .values import (
    I64,
    INT64_MAX,
    MAX_ELEMENTS,
    as_int,
    as_int_array,
    as_ints,
    as_list,
    as_shape,
    num_elements,
    row_major,
    tensor_label,
)


def _tensor_layout(shape, loc, off, start, box, strides, name, covered):
    return TensorLayout._from_table(shape, (loc, off, start, box, strides), name, covered)


def _rows(values, n, d) -> np.ndarray:
    """`values` (d ints) repeated in n rows: a broadcast view, which `PieceTable.of` copies
    into a contiguous array once (np.tile cost ~15 us a call)."""
    return np.broadcast_to(np.array(values, I64), (n, d))


def replicated(shape, locations, *, name=None) -> TensorLayout:
    """A full, contiguous copy of the tensor at offset 0 of each location."""
    shape = as_shape(shape, "replicated shape", name)
    locs = as_ints(locations, "replicated locations")
    if not locs:
        raise LayoutError(f"{tensor_label(name, shape)}: replicated() needs at least one location")
    n, d = len(locs), len(shape)
    return _tensor_layout(
        shape,
        np.array(locs, I64),
        np.zeros(n, I64),
        np.zeros((n, d), I64),
        _rows(shape, n, d),
        _rows(row_major(shape), n, d),
        name,
        covered=True,
    )


def split(shape, dim, sizes, locations, *, offsets=None, name=None) -> TensorLayout:
    """Shard `dim` into consecutive blocks of `sizes` (uneven allowed, zeros allowed).

    Block i is stored contiguously (row-major of its own shape) at `offsets[i]` (default 0)
    of `locations[i]`. An entry of `locations` may be a sequence of locations (replicas of
    that block); the matching entry of `offsets` is then an int or a sequence as long.
    """
    shape = as_shape(shape, "split shape", name)
    tn = tensor_label(name, shape)
    d = len(shape)
    dim = as_int(dim, "split dim")
    if not -d <= dim < d:
        raise LayoutError(f"{tn}: split dim {dim} out of range for {d} dims")
    dim %= d
    sizes = as_ints(sizes, "split sizes")
    locations = as_list(locations, f"{tn}: split locations", ordered=True)
    if len(sizes) != len(locations):
        raise LayoutError(f"{tn}: split has {len(sizes)} sizes but {len(locations)} locations")
    if any(s < 0 for s in sizes):
        raise LayoutError(f"{tn}: split sizes {sizes} has a negative size")
    if sum(sizes) != shape[dim]:
        raise LayoutError(
            f"{tn}: split sizes {sizes} sum to {sum(sizes)} but dim {dim} has {shape[dim]}"
        )
    if offsets is None:
        offsets = [0] * len(sizes)
    offsets = as_list(offsets, f"{tn}: split offsets", ordered=True)
    if len(offsets) != len(sizes):
        raise LayoutError(f"{tn}: split has {len(sizes)} sizes but {len(offsets)} offsets")
    loc, off, blk = _split_holders(tn, locations, offsets)
    neg = np.nonzero(off < 0)[0]
    if len(neg):
        i = int(neg[0])
        raise LayoutError(f"{tn}: split block {int(blk[i])}: negative storage offset {off[i]}")
    size_a = np.array(sizes, I64).reshape(-1)
    begin = np.cumsum(size_a) - size_a
    n = len(loc)
    start = np.zeros((n, d), I64)
    start[:, dim] = begin[blk]
    box = np.empty((n, d), I64)
    box[:] = shape
    box[:, dim] = size_a[blk]
    # row-major strides of each block's own shape (a dim of extent 0 counts as 1), in one
    # pass: a loop over distinct sizes was quadratic in blocks of distinct sizes
    steps = np.maximum(box[:, :0:-1], 1)
    strides = np.concatenate(
        [np.cumprod(steps, axis=1)[:, ::-1], np.ones((n, 1), I64)], axis=1
    ).reshape(n, d)
    return _tensor_layout(shape, loc, off, start, box, strides, name, covered=True)


def _split_holders(tn, locations, offsets):
    """(location, offset, block) of every holder of every block. Python work per block
    (few); per location (replicas, hundreds) only numpy."""
    if {type(x) for x in locations} | {type(x) for x in offsets} <= {int}:
        # the common form, one int location and offset per block (bools are no ints here)
        try:
            loc, off = np.array(locations, I64), np.array(offsets, I64)
        except OverflowError:  # beyond int64: the path below names it
            pass
        else:
            return loc, off, np.arange(len(loc))
    locs, offs_all, counts = [], [], []
    for i, (where, offs) in enumerate(zip(locations, offsets)):
        group = _entries(where, f"{tn}: split block {i} locations")
        group = (where,) if group is None else group
        if not group:
            raise LayoutError(f"{tn}: split block {i} has no location")
        many = _entries(offs, f"{tn}: split block {i} offsets")
        offs = (offs,) * len(group) if many is None else many
        if len(offs) != len(group):
            raise LayoutError(
                f"{tn}: split block {i} has {len(group)} locations but {len(offs)} offsets"
            )
        locs.extend(group)
        offs_all.extend(offs)
        counts.append(len(group))
    loc = as_int_array(locs, "split location")
    off = as_int_array(offs_all, "split offset")
    return loc, off, np.repeat(np.arange(len(counts)), counts)


def _entries(x, what):
    """The entries of the sequence `x` (a block's replicas), or None when `x` is one value: an
    int, numpy int or 0-d integer tensor, or anything else that is no sequence (as_int then
    names it)."""
    if isinstance(x, (bool, str, bytes)) or not hasattr(x, "__iter__"):
        return None
    try:
        operator.index(x)
        return None
    except TypeError:
        return tuple(as_list(x, what, ordered=True))


def flat(shape, runs, *, name=None) -> TensorLayout:
    """The ZeRO form: ranges of the row-major flattened tensor.

    `runs`: `[(location, flat_start, flat_stop, offset)]`: flat elements
    `flat_start..flat_stop` live contiguously at `offset` of `location`. Storage outside
    the runs is padding. Overlapping runs are replicas. Each run becomes at most
    `2*ndim - 1` boxes (a range that starts mid-row has a partial head row).
    """
    shape = as_shape(shape, "flat shape", name)
    tn = tensor_label(name, shape)
    numel = num_elements(shape)
    r = _flat_runs_array(tn, runs)
    loc, fs, fe, off = r.T
    bad_any = len(r) and (
        min(int(loc.min()), int(fs.min()), int(off.min())) < 0
        or int(fe.max()) > numel
        or (fs > fe).any()
    )
    for bad, why in (
        (
            ((fs < 0) | (fs > fe), "flat_start must be in 0..flat_stop"),
            (fe > numel, f"flat_stop beyond the tensor's {numel} elements"),
            (off < 0, "negative storage offset"),
            (loc < 0, "negative location"),
        )
        if bad_any
        else ()
    ):
        idx = np.nonzero(bad)[0]
        if len(idx):
            i = int(idx[0])
            raise LayoutError(f"{tn}: flat run {i} {tuple(int(x) for x in r[i])}: {why}")
    keep = fe > fs
    if not keep.all():
        loc, fs, fe, off = loc[keep], fs[keep], fe[keep], off[keep]
    # the common ZeRO form: ranges in order, each starting where the previous one stopped
    tiled = len(fs) and fs[0] == 0 and fe[-1] == numel and (fs[1:] == fe[:-1]).all()
    if numel > 0 and not tiled:
        gap = find_gap((numel,), fs[:, None], fe[:, None])
        if gap is not None:
            g = gap[0]
            idx = np.unravel_index(g, shape) if shape else ()
            raise LayoutError(
                f"{tn}: gap: flat element {g} (index {tuple(int(x) for x in idx)}) is in no run"
            )
    n, d = len(loc), len(shape)
    if d == 0:
        bl, bo, bs, bb = loc, off, np.zeros((n, 0), I64), np.zeros((n, 0), I64)
    else:
        shp, P = np.array(shape, I64), np.array(row_major(shape), I64)
        _, bl, bo, bs, bb = _flat_boxes(shp, P, loc, fs, fe, off)
    strides = _rows(row_major(shape), len(bl), d)
    return _tensor_layout(shape, bl, bo, bs, bb, strides, name, covered=True)


def _flat_runs_array(tn, runs) -> np.ndarray:
    """`runs` as an int64 [n, 4] array (location, flat_start, flat_stop, offset)."""
    if isinstance(runs, np.ndarray) and runs.dtype.kind in "iu":
        if runs.size and runs.dtype.kind == "u" and int(runs.max()) > INT64_MAX:
            raise LayoutError(f"{tn}: flat run field {int(runs.max())} does not fit in int64")
        r = runs.astype(I64, copy=False)  # fast path for generated layouts
    else:
        r = _int_rows(runs) if isinstance(runs, (list, tuple)) else None
        if r is None:
            r = _checked_runs(tn, runs)
    if r.ndim != 2 or r.shape[1] != 4:
        raise LayoutError(f"{tn}: flat runs must be (location, flat_start, flat_stop, offset)")
    return r


def _int_rows(rows) -> np.ndarray | None:
    """`rows` (a list of 4-tuples or 4-lists of plain ints, what the integrations build) as an
    int64 [n, 4] array, in C loops (np.array of a list of tuples costs ~0.3 us a row), or
    None for any other input (a bool, a numpy int, an int beyond int64, rows of other
    lengths), which `_checked_runs` then converts or refuses."""
    if not rows or not set(map(type, rows)) <= {tuple, list} or set(map(len, rows)) != {4}:
        return None
    if not set(map(type, chain.from_iterable(rows))) <= {int}:
        return None
    try:
        r = np.fromiter(chain.from_iterable(rows), I64, count=4 * len(rows))
    except OverflowError:
        return None
    return r.reshape(-1, 4)


def _checked_runs(tn, runs) -> np.ndarray:
    """`runs` as an int64 array, each field through `as_int` (its errors)."""
    runs = as_list(runs, f"{tn}: flat runs")
    r = np.asarray(runs if len(runs) else np.zeros((0, 4)), dtype=object)
    try:
        r = np.array([[as_int(x, f"{tn}: flat run field") for x in row] for row in r], I64)
    except LayoutError:
        raise
    except (TypeError, ValueError):
        raise LayoutError(
            f"{tn}: flat runs must be (location, flat_start, flat_stop, offset) integers"
        ) from None
    return r.reshape(-1, 4) if r.size == 0 else r


def _flat_boxes(shp, P, loc, a, b, off):
    """Decompose flat ranges [a, b) into boxes, vectorized over the runs: run i lies in a
    tensor of shape `shp[i]` (d >= 1 dims) with row-major strides `P[i]` ([n, d] arrays;
    [d] for runs of one tensor). Returns (run, location, offset, start, box) of the boxes,
    by level, then by run within a level."""
    d = shp.shape[-1]
    per_run = shp.ndim == 2
    cur = a.copy()
    out = []

    def emit(mask, k, x, y):
        idx = np.nonzero(mask)[0]
        if not len(idx):
            return
        xs, ys = x[idx], y[idx]
        steps = P[idx] if per_run else P
        bx = np.empty((len(idx), d), I64)
        bx[:] = shp[idx] if per_run else shp
        st = np.zeros((len(idx), d), I64)
        st[:, : k + 1] = (xs[:, None] // steps[..., : k + 1]) % bx[:, : k + 1]
        bx[:, :k] = 1
        bx[:, k] = (ys - xs) // steps[..., k]
        out.append((idx, loc[idx], off[idx] + (xs - a[idx]), st, bx))

    # Head: climb levels while the range reaches the next boundary of the level above.
    k0 = np.zeros(len(a), I64)
    active = np.ones(len(a), bool)
    for k in range(d - 1, 0, -1):
        B = -(-cur // P[..., k - 1]) * P[..., k - 1]
        ok = active & (B <= b)
        emit(ok & (B > cur), k, cur, B)
        cur = np.where(ok, B, cur)
        k0 = np.where(active & ~ok, k, k0)
        active &= ok
    # Tail: descend levels, taking as many whole blocks of each level as fit.
    for k in range(d):
        E = (b // P[..., k]) * P[..., k]
        m = (k >= k0) & (E > cur)
        emit(m, k, cur, E)
        cur = np.where(m, E, cur)
    if not out:
        z = np.zeros(0, I64)
        return z, z, z, np.zeros((0, d), I64), np.zeros((0, d), I64)
    return tuple(np.concatenate([o[k] for o in out]) for k in range(5))


def flat_batch(shapes, runs, *, names=None) -> list:
    """`[flat(shape, r, name=name) for ...]` over `shapes`, `runs` and `names` (default: no
    names): the same TensorLayouts and the same first error, in a few numpy passes over all
    the runs at once rather than a hundred numpy calls per tensor (describing 10**5 params
    cost tens of seconds). Runs given as lists of (location, flat_start, flat_stop, offset)
    tuples of ints, tiling their tensor in order (the ZeRO form), take that path; any other
    tensor, and every tensor once a screen flags a run, go through `flat` one by one, which
    raises its error."""
    shapes, runs = list(shapes), list(runs)
    names = [None] * len(shapes) if names is None else list(names)
    if not len(shapes) == len(runs) == len(names):
        raise LayoutError(
            f"flat_batch: {len(shapes)} shapes, {len(runs)} runs and {len(names)} names"
        )
    try:
        out = _flat_batch(shapes, runs, names)
    except LayoutError:  # a bad shape: `flat` raises it, or an earlier tensor's error
        out = None
    if out is None:
        return [flat(s, r, name=n) for s, r, n in zip(shapes, runs, names)]
    return out


def _flat_batch(shapes, runs, names):
    """`flat_batch`'s batched path, or None where `flat` must build every tensor."""
    shapes = [as_shape(s, "flat shape", n) for s, n in zip(shapes, names)]
    if not {type(r) for r in runs} <= {list, tuple}:
        return None
    counts = [len(r) for r in runs]
    rows = list(chain.from_iterable(runs))
    r = _int_rows(rows) if rows else np.zeros((0, 4), I64)
    if r is None:
        return None
    n = len(shapes)
    numel = np.array([num_elements(s) for s in shapes], I64).reshape(n)
    tix = np.repeat(np.arange(n), counts)
    loc, fs, fe, off = r.T
    half = MAX_ELEMENTS // 2
    # every refusal of `flat`, and the screen of check_footprints (a run's last element lies
    # at offset + (flat_stop - flat_start) - 1): a run it flags goes through `flat`
    bad = (loc < 0) | (fs < 0) | (fs > fe) | (fe > numel[tix]) | (off < 0) | (off >= half)
    if (bad | (off + (fe - fs) >= half)).any():
        return None
    keep = fe > fs
    k, kfs, kfe = tix[keep], fs[keep], fe[keep]
    # tiled: per tensor, the kept runs start at 0, each where the one before stopped, and
    # the last stops at numel (`flat`'s test); any other tensor with elements goes by `flat`
    head = np.ones(len(k), bool)
    head[1:] = k[1:] != k[:-1]
    last = np.roll(head, -1)
    prev_stop = np.roll(kfe, 1)
    tiled_run = np.where(head, kfs == 0, kfs == prev_stop) & (~last | (kfe == numel[k]))
    own = np.zeros(n, bool)
    own[k[~tiled_run]] = True
    own |= (np.bincount(k, minlength=n) == 0) & (numel > 0)
    out = [None] * n
    ndims = np.array([len(s) for s in shapes], I64).reshape(n)
    for d in np.unique(ndims[~own]).tolist():
        members = np.flatnonzero(~own & (ndims == d))
        sel = np.flatnonzero(keep & np.isin(tix, members))
        _batch_boxes(shapes, names, members, d, tix, sel, r, out)
    for i in np.flatnonzero(own).tolist():  # in order: the first error is the first tensor's
        out[i] = flat(shapes[i], runs[i], name=names[i])
    return out


def _batch_boxes(shapes, names, members, d, tix, sel, r, out) -> None:
    """The TensorLayouts of tensors `members` (all of `d` dims, tiled) from their kept runs
    `sel` (rows of `r`, tensor `tix`), into `out`."""
    pos = np.zeros(len(shapes), I64)
    pos[members] = np.arange(len(members))
    shp = np.array([shapes[i] for i in members.tolist()], I64).reshape(len(members), d)
    P = np.array([row_major(shapes[i]) for i in members.tolist()], I64).reshape(len(members), d)
    loc, fs, fe, off = r[sel].T
    t = tix[sel]
    if d == 0:
        run, bl, bo = np.arange(len(sel)), loc, off
        bs = bb = np.zeros((len(sel), 0), I64)
    else:
        run, bl, bo, bs, bb = _flat_boxes(shp[pos[t]], P[pos[t]], loc, fs, fe, off)
    # `flat` lists a tensor's boxes by level, then by run: a stable sort by tensor keeps that
    order = np.argsort(t[run], kind="stable")
    cols = [bl[order], bo[order], bs[order], bb[order], P[pos[t[run[order]]]]]
    cols = [read_only_view(np.ascontiguousarray(c, I64)) for c in cols]
    bounds = np.concatenate([[0], np.cumsum(np.bincount(t[run], minlength=len(shapes)))])
    built = []
    for i in members.tolist():
        a, b = int(bounds[i]), int(bounds[i + 1])
        built.append(TensorLayout._trusted(shapes[i], [c[a:b] for c in cols], names[i]))
        out[i] = built[-1]
    # the checks `flat` runs on its result, over all of them at once
    check_tensors(built)


def nest(outer, inner, *, name=None) -> TensorLayout:
    """Compose: `outer` places the tensor into virtual flat storages; `inner[location]` is
    the 1-D layout of that virtual storage over real locations.

    Example: a TP shard buffer that is itself ZeRO-partitioned, or a 2-D tensor stored whole
    in one process and ZeRO-partitioned underneath. Outer locations absent from `inner`
    pass through unchanged. The result keeps `outer`'s logical shape.
    """
    if not isinstance(outer, TensorLayout):
        raise LayoutError(f"nest: outer must be a TensorLayout, got {type(outer).__name__}")
    shape = outer.shape
    tn = tensor_label(name if name is not None else outer.name, shape)
    d = len(shape)
    if not isinstance(inner, Mapping):
        raise LayoutError(
            f"{tn}: nest inner must be a mapping {{location: TensorLayout}}, got "
            f"{type(inner).__name__}"
        )
    by_loc = {}
    for loc, tl in inner.items():
        # a key that is no location ("5", True, 5.0) would leave outer location 5 unnested, or
        # nest location 1 under True: refused, not matched or missed by dict equality
        key = as_int(loc, f"{tn}: nest inner location")
        if not isinstance(tl, TensorLayout) or len(tl.shape) != 1:
            raise LayoutError(
                f"{tn}: nest inner[{loc!r}] must be a 1-D TensorLayout of the location's "
                "flat storage"
            )
        by_loc[key] = tl
    inner = by_loc
    search = {loc: _interval_search(tl.table) for loc, tl in inner.items()}
    hi = outer.table.footprint_hi()
    rows = []  # (loc, off, start, box, strides)
    ot = outer.table
    for i in range(len(outer)):
        loc = int(ot.location[i])
        st, bx, sd = ot.start[i], ot.shape[i], ot.strides[i]
        off = int(ot.offset[i])
        if loc not in inner:
            rows.append((loc, off, st, bx, sd))
            continue
        if hi[i] < 0:
            # an empty piece (a split's zero-size block) holds nothing: kept, it would name
            # the virtual location, which is no storage of the result
            continue
        tl = inner[loc]
        if hi[i] >= tl.shape[0]:
            raise LayoutError(
                f"{outer.piece_label(i)}: reaches element {int(hi[i])} of location {loc}, whose "
                f"inner layout has only {tl.shape[0]} elements"
            )
        rows.extend(_composed(off, st, bx, sd, tl.table, _reaching(search[loc], off, hi[i])))
    n = len(rows)
    return _tensor_layout(
        shape,
        np.array([r[0] for r in rows], I64),
        np.array([r[1] for r in rows], I64),
        np.array([r[2] for r in rows], I64).reshape(n, d),
        np.array([r[3] for r in rows], I64).reshape(n, d),
        np.array([r[4] for r in rows], I64).reshape(n, d),
        name if name is not None else outer.name,
        covered=True,  # outer covers the tensor, each inner covers its whole storage
    )


def _interval_search(inner):
    """A 1-D table's pieces [start, start + shape) by start (`order`, `starts`), with the
    running max of their ends in that order: what `_reaching` searches."""
    order = np.argsort(inner.start[:, 0], kind="stable")
    starts = inner.start[order, 0]
    ends = inner.start[:, 0] + inner.shape[:, 0]
    return order, starts, ends, np.maximum.accumulate(ends[order]) if len(order) else ends


def _reaching(search, lo, hi):
    """Indices (ascending) of the pieces [start, end) that hold an element of [lo, hi]: among
    those starting at or before hi, from the first whose running max end passes lo; a binary
    search each, so nesting n outer pieces in m inner ones is not n * m."""
    order, starts, ends, run_max = search
    a = np.searchsorted(run_max, lo, side="right")
    b = np.searchsorted(starts, hi, side="right")
    cand = order[a:b]
    return np.sort(cand[ends[cand] > lo]).tolist()


def _composed(off, st, bx, sd, inner, reaching):
    """Rows (loc, off, start, box, strides) of an outer piece (offset `off`, start `st`, box
    `bx`, strides `sd`) composed with each piece of the 1-D `inner` table it reaches (indices
    `reaching`, ascending)."""
    for q in reaching:
        qs = int(inner.start[q, 0])
        qe = qs + int(inner.shape[q, 0])
        qstride = int(inner.strides[q, 0])
        for rel, sub in _preimage(off, sd.tolist(), bx.tolist(), qs, qe):
            v = off + sum(s * r for s, r in zip(sd.tolist(), rel))
            yield (
                int(inner.location[q]),
                int(inner.offset[q]) + qstride * (v - qs),
                st + np.array(rel, I64),
                np.array(sub, I64),
                sd * qstride,
            )


def _preimage(off, strides, shape, a, b):
    """Sub-boxes (relative start, shape) of a strided box whose storage offsets lie in [a, b).

    Splits along the largest-stride dim; rows wholly inside form one box, rows straddling a
    boundary recurse. For contiguous or row-sliced pieces this yields at most a few boxes.
    """
    d = len(shape)
    if any(n == 0 for n in shape):
        return []
    hi = off + sum(s * (n - 1) for s, n in zip(strides, shape))
    if hi < a or off >= b:
        return []
    if off >= a and hi < b:
        return [((0,) * d, tuple(shape))]
    k = max((j for j in range(d) if shape[j] > 1), key=lambda j: (strides[j], -j))
    sk = strides[k]  # > 0: with all strides 0 the footprint is one element, handled above
    sub_ext = hi - off - sk * (shape[k] - 1)
    # rows i with off + i*sk >= a and off + i*sk + sub_ext < b are wholly inside
    i0 = max(0, -(-(a - off) // sk))
    i1 = min(shape[k] - 1, (b - 1 - sub_ext - off) // sk)
    out = []
    if i0 <= i1:
        rel = [0] * d
        rel[k] = i0
        sub = list(shape)
        sub[k] = i1 - i0 + 1
        out.append((tuple(rel), tuple(sub)))
    partial = set()
    for lo_i, hi_i in (
        ((a - sub_ext - off) // sk, (a - off) // sk + 1),
        ((b - sub_ext - off) // sk, (b - off) // sk + 1),
    ):
        for i in range(max(0, lo_i), min(shape[k], hi_i + 1)):
            if not i0 <= i <= i1:
                partial.add(i)
    sub_shape = list(shape)
    sub_shape[k] = 1
    for i in sorted(partial):
        for rel, sub in _preimage(off + i * sk, strides, sub_shape, a, b):
            rel = list(rel)
            rel[k] = i
            out.append((tuple(rel), sub))
    return out
