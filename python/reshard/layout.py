"""Geometry: where every element of every logical tensor lives. Pure data (numpy).

A `TensorLayout` is a list of pieces; a `Piece` says that the logical box
`start .. start+shape` lives in storage `location` at `offset + sum(strides * (idx - start))`.
Overlapping pieces are replicas. Pieces are kept as numpy arrays (one row per piece) so
that layouts with millions of pieces (ZeRO-3 over hundreds of ranks) stay cheap; the
`Piece` objects of `.pieces` are built only when asked for.

Errors are `LayoutError`s naming the tensor, the piece and the reason. A `TensorLayout`
does not know its tensor's name unless given one (`name=`); the builders accept `name=` too.
"""

from __future__ import annotations

import dataclasses
import operator

import numpy as np
import torch

from .errors import LayoutError

__all__ = ["Layout", "Piece", "Storage", "TensorLayout", "flat", "nest", "replicated", "split"]

_I64 = np.int64
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
# Geometry addresses fewer than 2**53 elements: a tensor, a storage and all storages of a
# layout together. The planner sums element counts in float64 (exact below 2**53), and every
# offset, extent, byte count and total derived from them then fits int64 with room to spare,
# so nothing computed from a valid layout can overflow. No machine holds 2**53 elements.
MAX_ELEMENTS = 1 << 53

_DTYPE_ALIASES = {
    "fp32": torch.float32,
    "float": torch.float32,
    "f32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "half": torch.float16,
    "f16": torch.float16,
    "fp64": torch.float64,
    "double": torch.float64,
}

# Expanding a piece's storage footprint into contiguous rows (aliasing checks of
# interleaved targets) is refused above this many rows rather than exhausting memory.
_MAX_EXPAND_ROWS = 1 << 24


def _as_dtype(x) -> torch.dtype:
    if isinstance(x, torch.dtype):
        return x
    if isinstance(x, np.dtype):
        x = x.name
    if isinstance(x, str):
        name = x.strip()
        name = name[6:] if name.startswith("torch.") else name
        if name in _DTYPE_ALIASES:
            return _DTYPE_ALIASES[name]
        dt = getattr(torch, name, None)
        if isinstance(dt, torch.dtype):
            return dt
    raise LayoutError(f"unknown dtype {x!r}: pass a torch.dtype or a name like 'bfloat16'")


def _int(x, what: str) -> int:
    if isinstance(x, bool):
        raise LayoutError(f"{what} must be an integer, got {x!r}")
    try:
        v = operator.index(x)
    except TypeError:
        raise LayoutError(f"{what} must be an integer, got {x!r}") from None
    if not _INT64_MIN <= v <= _INT64_MAX:
        raise LayoutError(f"{what} {v} does not fit in int64")
    return v


def _ints(xs, what: str) -> tuple:
    if isinstance(xs, (str, bytes)) or not hasattr(xs, "__iter__"):
        # A bare int is the common slip for a 1-D shape; say so instead of a TypeError.
        raise LayoutError(f"{what} must be a sequence of integers, got {xs!r}")
    return tuple(_int(x, what) for x in xs)


def _shape(xs, what: str, name=None) -> tuple:
    """A tensor shape: non-negative ints addressing at most MAX_ELEMENTS elements (zero dims
    included, so row-major strides of any such shape fit int64)."""
    shape = _ints(xs, what)
    if any(n < 0 for n in shape):
        raise LayoutError(f"{_tname(name, shape)}: {what} has a negative dim")
    if _numel(max(n, 1) for n in shape) > MAX_ELEMENTS:
        raise LayoutError(
            f"{_tname(name, shape)}: more than 2**53 elements (the limit of reshard's geometry)"
        )
    return shape


def _rowmajor(shape) -> tuple:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


def _numel(shape) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


def _tname(name, shape) -> str:
    return f"tensor {name!r}" if name is not None else f"tensor of shape {tuple(shape)}"


@dataclasses.dataclass(frozen=True)
class Piece:
    """The logical box `start .. start+shape` stored in storage `location`.

    Element `idx` of the box lives at `offset + sum(strides[k] * (idx[k] - start[k]))`.
    `strides=None` means row-major (contiguous) strides of `shape`. Any non-negative
    strides are allowed: a row slice of a fused buffer, a transposed view.
    """

    location: int
    offset: int
    start: tuple
    shape: tuple
    strides: tuple = None

    def __post_init__(self):
        start = _ints(self.start, "Piece.start")
        shape = _ints(self.shape, "Piece.shape")
        if len(start) != len(shape):
            raise LayoutError(f"Piece start {start} and shape {shape} have different lengths")
        if self.strides is None:
            strides = _rowmajor(shape)
        else:
            strides = _ints(self.strides, "Piece.strides")
            if len(strides) != len(shape):
                raise LayoutError(
                    f"Piece strides {strides} and shape {shape} have different lengths"
                )
        object.__setattr__(self, "location", _int(self.location, "Piece.location"))
        object.__setattr__(self, "offset", _int(self.offset, "Piece.offset"))
        object.__setattr__(self, "start", start)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "strides", strides)


@dataclasses.dataclass(frozen=True)
class Storage:
    """One buffer: the rank that owns it, its dtype (normalized to torch.dtype), its extent."""

    rank: int
    dtype: torch.dtype
    numel: int

    def __post_init__(self):
        rank = _int(self.rank, "Storage.rank")
        numel = _int(self.numel, "Storage.numel")
        if rank < 0:
            raise LayoutError(f"Storage rank must be >= 0, got {rank}")
        if numel < 0:
            raise LayoutError(f"Storage numel must be >= 0, got {numel}")
        if numel > MAX_ELEMENTS:
            raise LayoutError(
                f"Storage numel {numel} exceeds 2**53 (the limit of reshard's geometry)"
            )
        object.__setattr__(self, "rank", rank)
        object.__setattr__(self, "numel", numel)
        object.__setattr__(self, "dtype", _as_dtype(self.dtype))


class TensorLayout:
    """Where every element of one logical tensor lives: `pieces` cover `shape`.

    `pieces` may mix `Piece`s and other `TensorLayout`s of the same shape (their pieces are
    added; handy for replicas: `TensorLayout(shape, [split(...), split(...)])`).
    Overlapping pieces are replicas. Raises `LayoutError` for pieces outside the tensor,
    negative offsets/strides, and gaps (an element no piece covers).
    """

    __slots__ = ("_shape", "_loc", "_off", "_start", "_box", "_strides", "_name", "_pieces")

    def __init__(self, shape, pieces, *, name=None):
        shape = _shape(shape, "TensorLayout.shape", name)
        if isinstance(pieces, (Piece, TensorLayout)):
            pieces = [pieces]
        parts, explicit, covered = [], [], False
        for i, p in enumerate(pieces):
            if isinstance(p, TensorLayout):
                if p.shape != shape:
                    raise LayoutError(
                        f"{_tname(name, shape)}: entry {i} is a TensorLayout of shape {p.shape}"
                    )
                parts.append(p._arrays())
                covered = True  # it was validated to cover the tensor on its own
            elif isinstance(p, Piece):
                if len(p.shape) != len(shape):
                    raise LayoutError(
                        f"{_tname(name, shape)}: piece {i} {p}: has {len(p.shape)} dims, "
                        f"the tensor has {len(shape)}"
                    )
                explicit.append(p)
            else:
                raise LayoutError(
                    f"{_tname(name, shape)}: entry {i} is {type(p).__name__}, "
                    "expected Piece or TensorLayout"
                )
        d = len(shape)
        if explicit:
            n = len(explicit)
            parts.insert(
                0,
                (
                    np.array([p.location for p in explicit], _I64),
                    np.array([p.offset for p in explicit], _I64),
                    np.array([p.start for p in explicit], _I64).reshape(n, d),
                    np.array([p.shape for p in explicit], _I64).reshape(n, d),
                    np.array([p.strides for p in explicit], _I64).reshape(n, d),
                ),
            )
        if parts:
            arrays = tuple(np.concatenate([pt[k] for pt in parts]) for k in range(5))
        else:
            arrays = (
                np.zeros(0, _I64),
                np.zeros(0, _I64),
                np.zeros((0, d), _I64),
                np.zeros((0, d), _I64),
                np.zeros((0, d), _I64),
            )
        self._set(shape, *arrays, name=name)
        self._validate(check_cover=not covered)

    @classmethod
    def _from_arrays(cls, shape, loc, off, start, box, strides, *, name=None, covered=False):
        self = object.__new__(cls)
        self._set(tuple(shape), loc, off, start, box, strides, name=name)
        self._validate(check_cover=not covered)
        return self

    def _set(self, shape, loc, off, start, box, strides, *, name):
        d = len(shape)
        self._shape = shape
        self._loc = np.ascontiguousarray(loc, _I64).reshape(-1)
        n = len(self._loc)
        self._off = np.ascontiguousarray(off, _I64).reshape(n)
        self._start = np.ascontiguousarray(start, _I64).reshape(n, d)
        self._box = np.ascontiguousarray(box, _I64).reshape(n, d)
        self._strides = np.ascontiguousarray(strides, _I64).reshape(n, d)
        self._name = name
        self._pieces = None

    def _arrays(self):
        return self._loc, self._off, self._start, self._box, self._strides

    @property
    def shape(self) -> tuple:
        return self._shape

    @property
    def numel(self) -> int:
        return _numel(self._shape)

    @property
    def pieces(self) -> tuple:
        if self._pieces is None:
            self._pieces = tuple(self._piece(i) for i in range(len(self._loc)))
        return self._pieces

    def __len__(self):
        return len(self._loc)

    def _piece(self, i) -> Piece:
        return Piece(
            int(self._loc[i]),
            int(self._off[i]),
            tuple(int(x) for x in self._start[i]),
            tuple(int(x) for x in self._box[i]),
            tuple(int(x) for x in self._strides[i]),
        )

    def _where(self, i) -> str:
        return f"{_tname(self._name, self._shape)}: piece {i} {self._piece(i)}"

    def _validate(self, check_cover: bool):
        shape = np.array(self._shape, _I64)
        start, box = self._start, self._box
        n = len(self._loc)
        # `box > shape - start`, not `start + box > shape`: the sum could wrap around int64
        if (
            not check_cover
            and n
            and min(
                int(self._loc.min()),
                int(self._off.min()),
                int(start.min(initial=0)),
                int(box.min(initial=0)),
                int(self._strides.min(initial=0)),
            )
            >= 0
            and not (box > shape - start).any()
        ):
            self._check_footprint()
            return  # fast path for builders (one pass per check; the slow path names the piece)
        for arr, what in (
            (self._loc[:, None], "negative location"),
            (self._off[:, None], "negative storage offset"),
            (start, "negative start"),
            (box, "negative shape"),
            (self._strides, "negative stride (flip the piece's start instead)"),
        ):
            bad = np.nonzero((arr < 0).any(axis=1))[0]
            if len(bad):
                raise LayoutError(f"{self._where(int(bad[0]))}: {what}")
        bad = np.nonzero((box > shape - start).any(axis=1))[0]
        if len(bad):
            raise LayoutError(
                f"{self._where(int(bad[0]))}: outside the tensor (start+shape exceeds "
                f"{self._shape})"
            )
        self._check_footprint()
        if check_cover and self.numel > 0:
            gap = _find_gap(self._shape, start, start + box)
            if gap is not None:
                raise LayoutError(
                    f"{_tname(self._name, self._shape)}: gap: element {gap} is in no piece "
                    f"({len(self._loc)} pieces)"
                )

    def _check_footprint(self):
        """Every piece's furthest storage element, offset + sum(strides * (shape - 1)), is below
        MAX_ELEMENTS (fields are non-negative here). A float64 screen finds the candidates;
        they are checked exactly in Python ints, since int64 arithmetic could wrap."""
        if not len(self._loc):
            return
        ext = np.maximum(self._box - 1, 0).astype(np.float64)
        approx = self._off.astype(np.float64) + (self._strides.astype(np.float64) * ext).sum(1)
        for i in np.nonzero(approx >= MAX_ELEMENTS / 2)[0].tolist():
            if (self._box[i] == 0).any():
                continue  # an empty piece touches no storage
            hi = int(self._off[i]) + sum(
                int(s) * (int(b) - 1) for s, b in zip(self._strides[i], self._box[i])
            )
            if hi >= MAX_ELEMENTS:
                raise LayoutError(
                    f"{self._where(i)}: reaches storage element {hi} (offset + "
                    "sum(strides * (shape - 1))), beyond the 2**53 elements of reshard's geometry"
                )

    def _footprint_hi(self):
        """Largest storage offset each piece touches (-1 for empty pieces)."""
        nonempty = (self._box > 0).all(axis=1)
        hi = self._off + (self._strides * (self._box - 1)).sum(axis=1)
        return np.where(nonempty, hi, -1)

    def __eq__(self, other):
        if not isinstance(other, TensorLayout):
            return NotImplemented
        return self._shape == other._shape and all(
            np.array_equal(a, b) for a, b in zip(self._arrays(), other._arrays())
        )

    __hash__ = None

    def __getstate__(self):
        return (self._shape, self._arrays(), self._name)

    def __setstate__(self, state):
        shape, arrays, name = state
        self._set(shape, *arrays, name=name)

    def __repr__(self):
        n = len(self._loc)
        head = ", ".join(repr(self._piece(i)) for i in range(min(n, 3)))
        more = f", ... {n - 3} more" if n > 3 else ""
        return f"TensorLayout(shape={self._shape}, pieces=[{head}{more}])"


def _find_gap(shape, starts, ends):
    """An element of the box `0..shape` covered by no [start, end) box, or None."""
    d = len(shape)
    if d == 0:
        return None if len(starts) else ()
    keep = (ends > starts).all(axis=1)
    return _gap_in(np.zeros(d, _I64), np.array(shape, _I64), starts[keep], ends[keep])


def _gap_in(lo, hi, s, e):
    # Sweep dim 0; slabs between breakpoints with the same set of spanning boxes are
    # checked once on the remaining dims. Cheap for the layouts people build: ZeRO flat
    # ranges, splits, replicas (a box that spans everything ends the search at once).
    m = ((s < hi) & (e > lo)).all(axis=1)
    s, e = np.maximum(s[m], lo), np.minimum(e[m], hi)
    if len(s) == 0:
        return tuple(int(x) for x in lo)
    if ((s <= lo) & (e >= hi)).all(axis=1).any():
        return None
    if len(lo) == 1:
        order = np.argsort(s[:, 0], kind="stable")
        ss = s[order, 0]
        ee = np.maximum.accumulate(e[order, 0])
        if ss[0] > lo[0]:
            return (int(lo[0]),)
        gaps = np.nonzero(ss[1:] > ee[:-1])[0]
        if len(gaps):
            return (int(ee[gaps[0]]),)
        return None if ee[-1] >= hi[0] else (int(ee[-1]),)
    bps = np.unique(np.concatenate([s[:, 0], e[:, 0], lo[:1], hi[:1]]))
    a, b = bps[:-1], bps[1:]
    active = (s[None, :, 0] <= a[:, None]) & (e[None, :, 0] >= b[:, None])
    seen = set()
    for k in range(len(a)):
        key = np.packbits(active[k]).tobytes()
        if key in seen:
            continue
        seen.add(key)
        sel = active[k]
        g = _gap_in(lo[1:], hi[1:], s[sel, 1:], e[sel, 1:])
        if g is not None:
            return (int(a[k]), *g)
    return None


def _tensor_layout(shape, loc, off, start, box, strides, name, covered):
    return TensorLayout._from_arrays(
        shape, loc, off, start, box, strides, name=name, covered=covered
    )


def replicated(shape, locations, *, name=None) -> TensorLayout:
    """A full, contiguous copy of the tensor at offset 0 of each location."""
    shape = _shape(shape, "replicated shape", name)
    locs = _ints(locations, "replicated locations")
    if not locs:
        raise LayoutError(f"{_tname(name, shape)}: replicated() needs at least one location")
    n, d = len(locs), len(shape)
    return _tensor_layout(
        shape,
        np.array(locs, _I64),
        np.zeros(n, _I64),
        np.zeros((n, d), _I64),
        np.tile(np.array(shape, _I64), (n, 1)).reshape(n, d),
        np.tile(np.array(_rowmajor(shape), _I64), (n, 1)).reshape(n, d),
        name,
        covered=True,
    )


def split(shape, dim, sizes, locations, *, offsets=None, name=None) -> TensorLayout:
    """Shard `dim` into consecutive blocks of `sizes` (uneven allowed, zeros allowed).

    Block i is stored contiguously (row-major of its own shape) at `offsets[i]` (default 0)
    of `locations[i]`. An entry of `locations` may be a sequence of locations (replicas of
    that block); the matching entry of `offsets` is then an int or a sequence as long.
    """
    shape = _shape(shape, "split shape", name)
    tn = _tname(name, shape)
    d = len(shape)
    dim = _int(dim, "split dim")
    if not -d <= dim < d:
        raise LayoutError(f"{tn}: split dim {dim} out of range for {d} dims")
    dim %= d
    sizes = _ints(sizes, "split sizes")
    locations = list(locations)
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
    offsets = list(offsets)
    if len(offsets) != len(sizes):
        raise LayoutError(f"{tn}: split has {len(sizes)} sizes but {len(offsets)} offsets")
    # Python work per block (few); per location (replicas, hundreds) only numpy
    locs, offs_all, counts = [], [], []
    for i, (where, offs) in enumerate(zip(locations, offsets)):
        group = (where,) if not hasattr(where, "__iter__") else tuple(where)
        if not group:
            raise LayoutError(f"{tn}: split block {i} has no location")
        offs = (offs,) * len(group) if not hasattr(offs, "__iter__") else tuple(offs)
        if len(offs) != len(group):
            raise LayoutError(
                f"{tn}: split block {i} has {len(group)} locations but {len(offs)} offsets"
            )
        locs.extend(group)
        offs_all.extend(offs)
        counts.append(len(group))
    loc = _int_array(locs, "split location")
    off = _int_array(offs_all, "split offset")
    blk = np.repeat(np.arange(len(sizes)), counts)
    neg = np.nonzero(off < 0)[0]
    if len(neg):
        i = int(neg[0])
        raise LayoutError(f"{tn}: split block {int(blk[i])}: negative storage offset {off[i]}")
    size_a = np.array(sizes, _I64).reshape(-1)
    begin = np.cumsum(size_a) - size_a
    n = len(loc)
    start = np.zeros((n, d), _I64)
    start[:, dim] = begin[blk]
    box = np.tile(np.array(shape, _I64), (n, 1)).reshape(n, d)
    box[:, dim] = size_a[blk]
    strides = np.empty((n, d), _I64)
    for size in set(sizes):  # row-major strides of each distinct block shape
        pshape = list(shape)
        pshape[dim] = size
        strides[size_a[blk] == size] = _rowmajor(pshape)
    return _tensor_layout(shape, loc, off, start, box, strides, name, covered=True)


def _int_array(xs, what: str) -> np.ndarray:
    """`xs` (a list) as int64, with `_int`'s errors; one numpy pass for plain int lists."""
    a = np.asarray(xs) if xs else np.zeros(0, _I64)
    if a.ndim == 1 and a.dtype.kind == "i" and not any(isinstance(x, bool) for x in xs):
        return a.astype(_I64, copy=False)
    return np.array([_int(x, what) for x in xs], _I64).reshape(-1)


def flat(shape, runs, *, name=None) -> TensorLayout:
    """The ZeRO form: ranges of the row-major flattened tensor.

    `runs`: `[(location, flat_start, flat_stop, offset)]`: flat elements
    `flat_start..flat_stop` live contiguously at `offset` of `location`. Storage outside
    the runs is padding. Overlapping runs are replicas. Each run becomes at most
    `2*ndim - 1` boxes (a range that starts mid-row has a partial head row).
    """
    shape = _shape(shape, "flat shape", name)
    tn = _tname(name, shape)
    numel = _numel(shape)
    if isinstance(runs, np.ndarray) and runs.dtype.kind in "iu":
        if runs.size and runs.dtype.kind == "u" and int(runs.max()) > _INT64_MAX:
            raise LayoutError(f"{tn}: flat run field {int(runs.max())} does not fit in int64")
        r = runs.astype(_I64, copy=False)  # fast path for generated layouts
    else:
        r = np.asarray(runs if len(runs) else np.zeros((0, 4)), dtype=object)
        try:
            r = np.array([[_int(x, f"{tn}: flat run field") for x in row] for row in r], _I64)
        except LayoutError:
            raise
        except (TypeError, ValueError):
            raise LayoutError(
                f"{tn}: flat runs must be (location, flat_start, flat_stop, offset) integers"
            ) from None
        r = r.reshape(-1, 4) if r.size == 0 else r
    if r.ndim != 2 or r.shape[1] != 4:
        raise LayoutError(f"{tn}: flat runs must be (location, flat_start, flat_stop, offset)")
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
        gap = _find_gap((numel,), fs[:, None], fe[:, None])
        if gap is not None:
            g = gap[0]
            idx = np.unravel_index(g, shape) if shape else ()
            raise LayoutError(
                f"{tn}: gap: flat element {g} (index {tuple(int(x) for x in idx)}) is in no run"
            )
    bl, bo, bs, bb = _flat_boxes(shape, loc, fs, fe, off)
    n, d = len(bl), len(shape)
    strides = np.tile(np.array(_rowmajor(shape), _I64), (n, 1)).reshape(n, d)
    return _tensor_layout(shape, bl, bo, bs, bb, strides, name, covered=True)


def _flat_boxes(shape, loc, a, b, off):
    """Decompose flat ranges [a, b) of a row-major `shape` into boxes (vectorized)."""
    d = len(shape)
    if d == 0:
        n = len(loc)
        return loc, off, np.zeros((n, 0), _I64), np.zeros((n, 0), _I64)
    shp = np.array(shape, _I64)
    P = np.array(_rowmajor(shape), _I64)  # elements per index step of each dim
    cur = a.copy()
    out = []

    def emit(mask, k, x, y):
        idx = np.nonzero(mask)[0]
        if not len(idx):
            return
        xs, ys = x[idx], y[idx]
        st = np.zeros((len(idx), d), _I64)
        bx = np.tile(shp, (len(idx), 1))
        for j in range(k + 1):
            st[:, j] = (xs // P[j]) % shp[j]
        bx[:, :k] = 1
        bx[:, k] = (ys - xs) // P[k]
        out.append((loc[idx], off[idx] + (xs - a[idx]), st, bx))

    # Head: climb levels while the range reaches the next boundary of the level above.
    k0 = np.zeros(len(a), _I64)
    active = np.ones(len(a), bool)
    for k in range(d - 1, 0, -1):
        B = -(-cur // P[k - 1]) * P[k - 1]
        ok = active & (B <= b)
        emit(ok & (B > cur), k, cur, B)
        cur = np.where(ok, B, cur)
        k0 = np.where(active & ~ok, k, k0)
        active &= ok
    # Tail: descend levels, taking as many whole blocks of each level as fit.
    for k in range(d):
        E = (b // P[k]) * P[k]
        m = (k >= k0) & (E > cur)
        emit(m, k, cur, E)
        cur = np.where(m, E, cur)
    if not out:
        z = np.zeros(0, _I64)
        return z, z, np.zeros((0, d), _I64), np.zeros((0, d), _I64)
    return tuple(np.concatenate([o[k] for o in out]) for k in range(4))


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
    tn = _tname(name if name is not None else outer._name, shape)
    d = len(shape)
    for loc, tl in inner.items():
        if not isinstance(tl, TensorLayout) or len(tl.shape) != 1:
            raise LayoutError(
                f"{tn}: nest inner[{loc!r}] must be a 1-D TensorLayout of the location's "
                "flat storage"
            )
    hi = outer._footprint_hi()
    rows = []  # (loc, off, start, box, strides)
    for i in range(len(outer._loc)):
        loc = int(outer._loc[i])
        st, bx, sd = outer._start[i], outer._box[i], outer._strides[i]
        off = int(outer._off[i])
        if loc not in inner or hi[i] < 0:
            rows.append((loc, off, st, bx, sd))
            continue
        tl = inner[loc]
        if hi[i] >= tl.shape[0]:
            raise LayoutError(
                f"{outer._where(i)}: reaches element {int(hi[i])} of location {loc}, whose "
                f"inner layout has only {tl.shape[0]} elements"
            )
        for q in range(len(tl._loc)):
            qs = int(tl._start[q, 0])
            qe = qs + int(tl._box[q, 0])
            qstride = int(tl._strides[q, 0])
            for rel, sub in _preimage(off, sd.tolist(), bx.tolist(), qs, qe):
                v = off + sum(s * r for s, r in zip(sd.tolist(), rel))
                rows.append(
                    (
                        int(tl._loc[q]),
                        int(tl._off[q]) + qstride * (v - qs),
                        st + np.array(rel, _I64),
                        np.array(sub, _I64),
                        sd * qstride,
                    )
                )
    n = len(rows)
    return _tensor_layout(
        shape,
        np.array([r[0] for r in rows], _I64),
        np.array([r[1] for r in rows], _I64),
        np.array([r[2] for r in rows], _I64).reshape(n, d),
        np.array([r[3] for r in rows], _I64).reshape(n, d),
        np.array([r[4] for r in rows], _I64).reshape(n, d),
        name if name is not None else outer._name,
        covered=True,  # outer covers the tensor, each inner covers its whole storage
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


class Layout:
    """A whole state: logical tensors by name and the storages their pieces live in.

    Checks that every piece's location is a known storage and that its footprint lies
    inside that storage. Picklable; compares equal across processes.
    """

    def __init__(self, tensors, storages):
        if not isinstance(tensors, dict) or not isinstance(storages, dict):
            raise LayoutError("Layout(tensors, storages) takes two dicts")
        st = {}
        for loc, s in storages.items():
            loc = _int(loc, "storage location")
            if not isinstance(s, Storage):
                raise LayoutError(f"storage {loc}: expected Storage, got {type(s).__name__}")
            st[loc] = s
        ts = {}
        for name, tl in tensors.items():
            if not isinstance(name, str):
                raise LayoutError(f"tensor names must be str, got {name!r}")
            if not isinstance(tl, TensorLayout):
                raise LayoutError(
                    f"tensor {name!r}: expected TensorLayout, got {type(tl).__name__}"
                )
            ts[name] = tl
        total = sum(s.numel for s in st.values())
        if total > MAX_ELEMENTS:
            raise LayoutError(
                f"the storages hold {total} elements in all, more than 2**53 (the limit of "
                "reshard's geometry)"
            )
        self.tensors = ts
        self.storages = st
        self._aliasing_checked = False
        locs = np.array(sorted(st), _I64)
        numels = np.array([st[int(x)].numel for x in locs], _I64)
        for name, tl in ts.items():
            if not len(tl._loc):
                continue
            pos = np.searchsorted(locs, tl._loc)
            pos_c = np.minimum(pos, max(len(locs) - 1, 0))
            known = (pos < len(locs)) & (locs[pos_c] == tl._loc) if len(locs) else pos < 0
            bad = np.nonzero(~known)[0]
            if len(bad):
                i = int(bad[0])
                raise LayoutError(
                    f"tensor {name!r}: piece {i} {tl._piece(i)}: unknown location "
                    f"{int(tl._loc[i])} (storages: {sorted(st)[:16]})"
                )
            hi = tl._footprint_hi()
            bad = np.nonzero(hi >= numels[pos_c])[0]
            if len(bad):
                i = int(bad[0])
                loc = int(tl._loc[i])
                raise LayoutError(
                    f"tensor {name!r}: piece {i} {tl._piece(i)}: storage out of range: touches "
                    f"element {int(hi[i])} of location {loc}, which has {st[loc].numel}"
                )

    def __eq__(self, other):
        if not isinstance(other, Layout):
            return NotImplemented
        return self.storages == other.storages and self.tensors == other.tensors

    __hash__ = None

    def __getstate__(self):
        return {"tensors": self.tensors, "storages": self.storages}

    def __setstate__(self, state):
        self.tensors = state["tensors"]
        self.storages = state["storages"]
        self._aliasing_checked = False

    def __repr__(self):
        return f"Layout({len(self.tensors)} tensors, {len(self.storages)} storages)"

    def _check_no_aliasing(self):
        """As a target: no storage element may be written for two logical elements."""
        if self._aliasing_checked:
            return
        names = sorted(self.tensors)
        cols = [[], [], [], [], []]  # loc, lo, hi, tensor index, piece index
        by_d = {}
        for t, name in enumerate(names):
            by_d.setdefault(len(self.tensors[name].shape), []).append(t)
        for d, ts in sorted(by_d.items()):
            # one vectorized pass per ndim: cost per tensor is a list append
            tls = [self.tensors[names[t]] for t in ts]
            counts = np.array([len(tl._loc) for tl in tls], _I64)
            n = int(counts.sum())
            if not n:
                continue
            loc = np.concatenate([tl._loc for tl in tls])
            off = np.concatenate([tl._off for tl in tls])
            box = np.concatenate([tl._box for tl in tls]).reshape(n, d)
            strides = np.concatenate([tl._strides for tl in tls]).reshape(n, d)
            tix = np.repeat(np.array(ts, _I64), counts)
            pix = np.arange(n, dtype=_I64) - np.repeat(np.cumsum(counts) - counts, counts)
            nonempty = (box > 0).all(axis=1)
            hi = off + (strides * (box - 1)).sum(axis=1)
            ne = np.nonzero(nonempty)[0]
            cols[0].append(loc[ne])
            cols[1].append(off[ne])
            cols[2].append(hi[ne])
            cols[3].append(tix[ne])
            cols[4].append(pix[ne])
            bad = ne[~_injective(box[ne], strides[ne])]
            for j in bad.tolist():
                tl, i, name = self.tensors[names[tix[j]]], int(pix[j]), names[tix[j]]
                rows = _rows(tl, i)
                dup = _first_overlap(rows[0], rows[1])
                if dup is not None:
                    raise LayoutError(
                        f"target tensor {name!r}: piece {i} {tl._piece(i)}: two logical "
                        f"elements written to the same storage element {dup} of location "
                        f"{int(tl._loc[i])} (strides overlap)"
                    )
        if not cols[0]:
            self._aliasing_checked = True
            return
        loc, lo, hi, tix, pix = (np.concatenate(c) for c in cols)
        order = np.lexsort((lo, loc))
        loc, lo, hi, tix, pix = loc[order], lo[order], hi[order], tix[order], pix[order]
        n = len(loc)
        # Clusters of pieces whose footprint bounds chain-overlap within one storage.
        new = np.ones(n, bool)
        if n > 1:
            grp_max = _segmented_cummax(hi, loc)
            new[1:] = (loc[1:] != loc[:-1]) | (lo[1:] > grp_max[:-1])
        starts = np.nonzero(new)[0]
        sizes = np.diff(np.append(starts, n))
        for c in np.nonzero(sizes > 1)[0].tolist():
            members = range(int(starts[c]), int(starts[c] + sizes[c]))
            rs, rl, rid = [], [], []
            for m in members:
                tl = self.tensors[names[int(tix[m])]]
                s, ln = _rows(tl, int(pix[m]))
                rs.append(s)
                rl.append(ln)
                rid.append(np.full(len(s), m, _I64))
            s, ln, who = np.concatenate(rs), np.concatenate(rl), np.concatenate(rid)
            o = np.argsort(s, kind="stable")
            s, ln, who = s[o], ln[o], who[o]
            ends = np.maximum.accumulate(s + ln)
            hit = np.nonzero(s[1:] < ends[:-1])[0]
            if len(hit):
                j = int(hit[0]) + 1
                # the row that reaches furthest before j is the one it overlaps
                prev = int(np.nonzero((s[:j] + ln[:j]) > s[j])[0][0])
                a, b = int(who[prev]), int(who[j])
                ta, tb = self.tensors[names[int(tix[a])]], self.tensors[names[int(tix[b])]]
                raise LayoutError(
                    f"target tensor {names[int(tix[b])]!r}: piece {int(pix[b])} "
                    f"{tb._piece(int(pix[b]))}: writes storage element {int(s[j])} of location "
                    f"{int(loc[b])}, also written by tensor {names[int(tix[a])]!r} piece "
                    f"{int(pix[a])} {ta._piece(int(pix[a]))}: two logical elements written to "
                    "the same target storage element"
                )
        self._aliasing_checked = True


def _segmented_cummax(x, key):
    """Running max of x that restarts whenever `key` changes (key sorted)."""
    # Lift each group above all previous ones so that one global cummax works: group g is
    # shifted by the spans of the groups before it (their sum stays within the total extent).
    if not len(x):
        return x
    starts = np.nonzero(np.concatenate([[True], key[1:] != key[:-1]]))[0]
    lo = np.minimum.reduceat(x, starts)
    span = np.maximum.reduceat(x, starts) - lo + 1
    shift = np.repeat(np.cumsum(span) - span - lo, np.diff(np.append(starts, len(x))))
    return np.maximum.accumulate(x + shift) - shift


def _injective(box, strides):
    """Sufficient test that each piece maps distinct indices to distinct storage elements."""
    n = len(box)
    if n == 0:
        return np.ones(0, bool)
    big = box > 1
    s = np.where(big, strides, np.iinfo(_I64).max)
    order = np.argsort(s, axis=1, kind="stable")
    s_sorted = np.take_along_axis(s, order, axis=1)
    b_sorted = np.take_along_axis(np.where(big, box, 1), order, axis=1)
    ok = np.ones(n, bool)
    reach = np.zeros(n, _I64)  # max offset reached by the dims so far
    for k in range(box.shape[1]):
        active = s_sorted[:, k] != np.iinfo(_I64).max
        ok &= ~active | (s_sorted[:, k] > reach)
        reach = np.where(active, reach + s_sorted[:, k] * (b_sorted[:, k] - 1), reach)
    return ok


def _rows(tl: TensorLayout, i: int):
    """A piece's storage footprint as contiguous rows (starts, lengths)."""
    box, strides, off = tl._box[i], tl._strides[i], int(tl._off[i])
    dims = [k for k in range(len(box)) if box[k] > 1]
    dims.sort(key=lambda k: strides[k])
    length = 1
    while dims and strides[dims[0]] == length:
        length *= int(box[dims.pop(0)])
    nrows = _numel([int(box[k]) for k in dims])
    if nrows > _MAX_EXPAND_ROWS:
        raise LayoutError(
            f"{tl._where(i)}: too interleaved to verify it aliases nothing ({nrows} rows)"
        )
    starts = np.array([off], _I64)
    for k in dims:
        starts = (
            starts[:, None] + np.arange(int(box[k]), dtype=_I64)[None, :] * strides[k]
        ).ravel()
    return starts, np.full(len(starts), length, _I64)


def _first_overlap(starts, lengths):
    o = np.argsort(starts, kind="stable")
    s, ln = starts[o], lengths[o]
    ends = np.maximum.accumulate(s + ln)
    hit = np.nonzero(s[1:] < ends[:-1])[0]
    return int(s[int(hit[0]) + 1]) if len(hit) else None
