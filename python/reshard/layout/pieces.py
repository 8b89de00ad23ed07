"""Pieces of one logical tensor: `Piece`, the `PieceTable` they are kept in, `TensorLayout`."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from ..errors import LayoutError
from .intervals import segmented_cummax
from .values import (
    I64,
    MAX_ELEMENTS,
    as_int,
    as_ints,
    as_list,
    as_shape,
    num_elements,
    restore_fields,
    row_major,
    tensor_label,
)


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
        start = as_ints(self.start, "Piece.start")
        shape = as_ints(self.shape, "Piece.shape")
        if len(start) != len(shape):
            raise LayoutError(f"Piece start {start} and shape {shape} have different lengths")
        if self.strides is None:
            strides = row_major(shape)
        else:
            strides = as_ints(self.strides, "Piece.strides")
            if len(strides) != len(shape):
                raise LayoutError(
                    f"Piece strides {strides} and shape {shape} have different lengths"
                )
        object.__setattr__(self, "location", as_int(self.location, "Piece.location"))
        object.__setattr__(self, "offset", as_int(self.offset, "Piece.offset"))
        object.__setattr__(self, "start", start)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "strides", strides)

    def __setstate__(self, state):
        restore_fields(self, state)


class PieceTable(NamedTuple):
    """A tensor's pieces as read-only int64 arrays, one row per piece: `location [n]`,
    `offset [n]`, `start [n, d]`, `shape [n, d]`, `strides [n, d]` (d: the tensor's ndim)."""

    location: np.ndarray
    offset: np.ndarray
    start: np.ndarray
    shape: np.ndarray
    strides: np.ndarray

    @classmethod
    def of(cls, d, location, offset, start, shape, strides) -> PieceTable:
        """Contiguous int64 arrays of the right shapes, as read-only views. Integer arrays
        only: a float offset or location would be truncated to another piece, silently."""
        loc = _int64_column("location", location).reshape(-1)
        n = len(loc)
        cols = [loc]
        for field, a, shp in (
            ("offset", offset, (n,)),
            ("start", start, (n, d)),
            ("shape", shape, (n, d)),
            ("strides", strides, (n, d)),
        ):
            if type(a) is np.ndarray and a.shape == shp and a.dtype == I64 and a.flags.c_contiguous:
                cols.append(a)  # a builder's array, as it is: the checks below are no-ops
                continue
            a = _int64_column(field, a)
            if a.size != n * d ** (len(shp) - 1):
                raise LayoutError(
                    f"PieceTable {field} has {a.size} entries, {n} pieces of {d} dims need "
                    f"{n * d ** (len(shp) - 1)}"
                )
            cols.append(a.reshape(shp))
        return tuple.__new__(cls, [read_only_view(a) for a in cols])

    @classmethod
    def empty(cls, d) -> PieceTable:
        z = np.zeros((0, d), I64)
        return cls.of(d, np.zeros(0, I64), np.zeros(0, I64), z, z, z)

    @classmethod
    def from_pieces(cls, d, pieces) -> PieceTable:
        n = len(pieces)
        return cls.of(
            d,
            [p.location for p in pieces],
            [p.offset for p in pieces],
            np.array([p.start for p in pieces], I64).reshape(n, d),
            np.array([p.shape for p in pieces], I64).reshape(n, d),
            np.array([p.strides for p in pieces], I64).reshape(n, d),
        )

    @classmethod
    def concat(cls, d, tables) -> PieceTable:
        return cls.of(d, *(np.concatenate([t[k] for t in tables]) for k in range(5)))

    def footprint_hi(self) -> np.ndarray:
        """Largest storage offset each piece touches (-1 for empty pieces). Column by column:
        numpy reduces along rows of a few dims slowly."""
        hi, nonempty = self.offset.copy(), np.ones(len(self.offset), bool)
        for box, stride in zip(self.shape.T, self.strides.T):
            hi += stride * (box - 1)
            nonempty &= box > 0
        return np.where(nonempty, hi, -1)


def _checked_table(cls, location, offset, start, shape, strides) -> PieceTable:
    """`PieceTable(...)`, which unpickling calls with the stored arrays: `PieceTable.of`'s
    checks, the tensor's ndim read from `start` (the bytes may be tampered with or stale)."""
    ndim = np.ndim(start)
    if ndim != 2:
        raise LayoutError(f"PieceTable start must be a [pieces, dims] array, got {ndim} dims")
    return cls.of(np.shape(start)[1], location, offset, start, shape, strides)


PieceTable.__new__ = _checked_table  # a NamedTuple's body may not define __new__


def _int64_column(field, values) -> np.ndarray:
    """`values` as a contiguous int64 array; a LayoutError unless they are integers that fit."""
    a = np.asarray(values)
    if a.size and a.dtype.kind not in "iu":
        raise LayoutError(f"PieceTable {field} must be integers, got dtype {a.dtype}")
    if a.size and a.dtype.kind == "u" and int(a.max()) > np.iinfo(I64).max:
        raise LayoutError(f"PieceTable {field} value {int(a.max())} does not fit in int64")
    return np.ascontiguousarray(a, I64)


def read_only_view(a: np.ndarray) -> np.ndarray:
    v = a.view()
    v.flags.writeable = False
    return v


class TensorLayout:
    """Where every element of one logical tensor lives: `pieces` cover `shape`.

    `pieces` may mix `Piece`s and other `TensorLayout`s of the same shape (their pieces are
    added; handy for replicas: `TensorLayout(shape, [split(...), split(...)])`).
    Overlapping pieces are replicas. Raises `LayoutError` for pieces outside the tensor,
    negative offsets/strides, and gaps (an element no piece covers). `table` is the pieces as
    read-only arrays (what the planner reads); `pieces` builds `Piece` objects on first use.
    """

    __slots__ = ("_shape", "_table", "_name", "_pieces")

    def __init__(self, shape, pieces, *, name=None):
        shape = as_shape(shape, "TensorLayout.shape", name)
        if isinstance(pieces, (Piece, TensorLayout)):
            pieces = [pieces]
        pieces = as_list(pieces, f"{tensor_label(name, shape)}: pieces")
        d = len(shape)
        tables, explicit, covered = [], [], False
        for i, p in enumerate(pieces):
            if isinstance(p, TensorLayout):
                if p.shape != shape:
                    raise LayoutError(
                        f"{tensor_label(name, shape)}: entry {i} is a TensorLayout of shape "
                        f"{p.shape}"
                    )
                tables.append(p.table)
                covered = True  # it was validated to cover the tensor on its own
            elif isinstance(p, Piece):
                if len(p.shape) != d:
                    raise LayoutError(
                        f"{tensor_label(name, shape)}: piece {i} {p}: has {len(p.shape)} dims, "
                        f"the tensor has {d}"
                    )
                explicit.append(p)
            else:
                raise LayoutError(
                    f"{tensor_label(name, shape)}: entry {i} is {type(p).__name__}, "
                    "expected Piece or TensorLayout"
                )
        if explicit:
            tables.insert(0, PieceTable.from_pieces(d, explicit))
        table = PieceTable.concat(d, tables) if tables else PieceTable.empty(d)
        self._set(shape, table, name)
        check_pieces(self, check_cover=not covered)

    @classmethod
    def from_table(cls, shape, table: PieceTable, *, name=None, covered=False) -> TensorLayout:
        """A TensorLayout from a table of pieces, with every check of `TensorLayout(...)`.
        `covered` is accepted and checked all the same: a table that said it covered the
        tensor but did not was planned as if it did, leaving target elements unwritten."""
        del covered  # only the builders, which build covering tables, skip the gap search
        return cls._from_table(as_shape(shape, "TensorLayout.shape", name), table, name, False)

    @classmethod
    def _from_table(cls, shape, table, name, covered) -> TensorLayout:
        """`from_table` for the builders: `shape` already validated, and with `covered` the
        pieces are known to cover it (the gap search is skipped; every other check runs)."""
        self = object.__new__(cls)
        self._set(tuple(shape), PieceTable.of(len(shape), *table), name)
        check_pieces(self, check_cover=not covered)
        return self

    @classmethod
    def _trusted(cls, shape, columns, name) -> TensorLayout:
        """A TensorLayout of `shape` (a checked tuple) whose 5 piece arrays `columns` are
        already int64, contiguous, read-only and shaped (`builders.flat_batch` slices them
        from arrays it built for many tensors); the caller runs the checks (`check_tensors`)."""
        self = object.__new__(cls)
        self._set(shape, tuple.__new__(PieceTable, columns), name)
        return self

    def _set(self, shape, table, name):
        self._shape, self._table, self._name, self._pieces = shape, table, name, None

    @property
    def shape(self) -> tuple:
        return self._shape

    @property
    def name(self):
        """The tensor's name for error messages, or None."""
        return self._name

    @property
    def numel(self) -> int:
        return num_elements(self._shape)

    @property
    def table(self) -> PieceTable:
        return self._table

    @property
    def pieces(self) -> tuple:
        if self._pieces is None:
            self._pieces = tuple(self.piece(i) for i in range(len(self)))
        return self._pieces

    def __len__(self):
        return len(self._table.location)

    def piece(self, i) -> Piece:
        t = self._table
        return Piece(
            int(t.location[i]),
            int(t.offset[i]),
            tuple(int(x) for x in t.start[i]),
            tuple(int(x) for x in t.shape[i]),
            tuple(int(x) for x in t.strides[i]),
        )

    def piece_label(self, i) -> str:
        """How errors name piece `i`: the tensor, the index and the piece."""
        return f"{tensor_label(self._name, self._shape)}: piece {i} {self.piece(i)}"

    def __eq__(self, other):
        if not isinstance(other, TensorLayout):
            return NotImplemented
        return self._shape == other._shape and all(
            np.array_equal(a, b) for a, b in zip(self._table, other._table)
        )

    __hash__ = None

    def __getstate__(self):
        return (self._shape, tuple(self._table), self._name)

    def __setstate__(self, state):
        # unpickled (or copied): every check of the constructor, gaps included, since the
        # bytes may be tampered with or stale
        self._restore(state)
        check_pieces(self, check_cover=True)

    @classmethod
    def _restored(cls, state) -> TensorLayout:
        """A TensorLayout from its pickled state with the shape's and the table's checks; the
        pieces' checks are the caller's (`check_tensors`, over many at once)."""
        self = object.__new__(cls)
        self._restore(state)
        return self

    def _restore(self, state) -> None:
        if not (isinstance(state, tuple) and len(state) == 3 and isinstance(state[1], tuple)):
            raise LayoutError(
                "unpickled TensorLayout: expected the state (shape, the 5 piece arrays, name), "
                f"got {type(state).__name__}"
            )
        shape, arrays, name = state
        shape = as_shape(shape, "TensorLayout.shape", name)
        if len(arrays) != len(PieceTable._fields):
            raise LayoutError(
                f"unpickled {tensor_label(name, shape)}: {len(arrays)} piece arrays, expected "
                f"{len(PieceTable._fields)} ({', '.join(PieceTable._fields)})"
            )
        self._set(shape, PieceTable.of(len(shape), *arrays), name)

    def __repr__(self):
        n = len(self)
        head = ", ".join(repr(self.piece(i)) for i in range(min(n, 3)))
        more = f", ... {n - 3} more" if n > 3 else ""
        return f"TensorLayout(shape={self._shape}, pieces=[{head}{more}])"


# -- checks -----------------------------------------------------------------------------------


def check_pieces(tl: TensorLayout, check_cover: bool):
    """Non-negative fields, pieces inside the tensor, footprints below MAX_ELEMENTS, and (with
    `check_cover`) no gap. Raises LayoutError naming the first bad piece."""
    t = tl.table
    shape = np.array(tl.shape, I64)
    # `box > shape - start`, not `start + box > shape`: the sum could wrap around int64
    outside = t.shape > shape - t.start
    # every field of every piece in one array: a few numpy calls, not a dozen, for the
    # thousands of small tables a model's builders make
    fields = np.concatenate(
        [t.location[:, None], t.offset[:, None], t.start, t.shape, t.strides], 1
    )
    fields_min = int(fields.min(initial=0))
    if fields_min < 0 or outside.any():  # one pass screens every piece; this names the first
        for arr, what in (
            (t.location[:, None], "negative location"),
            (t.offset[:, None], "negative storage offset"),
            (t.start, "negative start"),
            (t.shape, "negative shape"),
            (t.strides, "negative stride (flip the piece's start instead)"),
        ):
            bad = np.nonzero((arr < 0).any(axis=1))[0]
            if len(bad):
                raise LayoutError(f"{tl.piece_label(int(bad[0]))}: {what}")
        bad = np.nonzero(outside.any(axis=1))[0]
        raise LayoutError(
            f"{tl.piece_label(int(bad[0]))}: outside the tensor (start+shape exceeds {tl.shape})"
        )
    if len(fields):
        # a bound on every piece's furthest element, in Python ints (no wrap): the largest
        # offset plus, per dim, the largest stride times the largest extent - 1. Below
        # check_footprints' own screen, no piece can reach 2**53
        top = fields.max(0).tolist()
        d = len(tl.shape)
        bound = top[1] + sum(
            s * max(b - 1, 0) for s, b in zip(top[2 + 2 * d :], top[2 + d : 2 + 2 * d])
        )
        if bound >= MAX_ELEMENTS / 2:
            check_footprints(tl)
    if check_cover and tl.numel > 0:
        gap = find_gap(tl.shape, t.start, t.start + t.shape, tensor_label(tl.name, tl.shape))
        if gap is not None:
            raise LayoutError(
                f"{tensor_label(tl.name, tl.shape)}: gap: element {gap} is in no piece "
                f"({len(tl)} pieces)"
            )


# Tables of at most this many pieces are stacked (`stacked_tables`); a larger one makes a stack
# of its own: copying it costs more than the passes over it save.
STACK_PIECES = 1024


def stacked_tables(tls: list) -> list:
    """The pieces of the TensorLayouts `tls`, small tables stacked per ndim, so that checks of
    many small tensors make a few numpy passes in all rather than a few per tensor: per
    stack, (the indexes in `tls` of its tensors, each piece's position among those, one
    PieceTable)."""
    groups: dict = {}
    for i, tl in enumerate(tls):
        groups.setdefault(len(tl.shape) if len(tl) <= STACK_PIECES else ~i, []).append(i)
    out = []
    for idx in groups.values():
        tables = [tls[i].table for i in idx]
        if len(tables) == 1:
            out.append((idx, np.zeros(len(tables[0].location), I64), tables[0]))
            continue
        which = np.repeat(np.arange(len(idx)), [len(t.location) for t in tables])
        cols = (np.concatenate([t[k] for t in tables]) for k in range(len(PieceTable._fields)))
        out.append((idx, which, PieceTable.of(tables[0].start.shape[1], *cols)))
    return out


def check_tensors(tls: list, names=None) -> None:
    """`check_pieces(tl, check_cover=True)` of every TensorLayout of `tls`, with its errors, in
    a few numpy passes over all their pieces at once (`stacked_tables`): unpickling a Layout
    of thousands of small tensors costs about its pieces, not a dozen passes per tensor. The
    passes screen fields and footprints and, where every piece is a run of the row-major
    order (ZeRO ranges, row blocks, replicas), decide the cover; a tensor they flag or cannot
    decide gets `check_pieces` of its own, in order, which names the piece (and `names[i]`,
    the tensor's name in its Layout, `named_error`)."""
    own = set()
    for idx, which, t in stacked_tables(tls):
        shapes = np.array([tls[i].shape for i in idx], I64).reshape(len(idx), -1)
        unsettled = _unsettled(shapes, which, t) if shapes.shape[1] else range(len(idx))
        own.update(idx[k] for k in unsettled)
    for i in sorted(own):
        try:
            check_pieces(tls[i], check_cover=True)
        except LayoutError as exc:
            raise exc if names is None else named_error(names[i], tls[i], exc) from None


def named_error(name, tl, exc: LayoutError) -> LayoutError:
    """`exc` of the tensor `name` of a Layout: said in the message, unless `tl` (None: not
    built yet) already bears that name."""
    if tl is not None and tl.name == name:
        return exc
    return LayoutError(f"layout tensor {name!r}: {exc}")


def _unsettled(shapes: np.ndarray, which: np.ndarray, t: PieceTable) -> list:
    """The tensors (rows of `shapes`, ndim >= 1) whose pieces (`t`, piece i of tensor
    `which[i]`) the passes of `check_tensors` do not clear. Column by column: numpy reduces
    along rows of a few dims slowly."""
    n, cols = len(shapes), range(shapes.shape[1])
    full = shapes[which]
    # check_pieces' screen and check_footprints' float screen, per piece
    flagged = (t.location < 0) | (t.offset < 0)
    far = t.offset.astype(np.float64)
    nonempty = np.ones(len(which), bool)
    for j in cols:
        start, box, stride = t.start[:, j], t.shape[:, j], t.strides[:, j]
        flagged |= (start < 0) | (box < 0) | (stride < 0) | (box > full[:, j] - start)
        far += stride * np.maximum(box - 1, 0).astype(np.float64)
        nonempty &= box > 0
    flagged |= far >= MAX_ELEMENTS / 2
    # a piece is a run of the row-major order, [first, first + size), when its dims before
    # some dim k are 1 and its dims after k whole
    is_run, ones_before, whole_after = np.zeros(len(which), bool), True, [True] * len(cols)
    for j in cols[:0:-1]:
        whole_after[j - 1] = whole_after[j] & (t.shape[:, j] == full[:, j])
    for j in cols:
        is_run |= ones_before & whole_after[j]
        ones_before = ones_before & (t.shape[:, j] == 1)
    first, size, step = np.zeros(len(which), I64), np.ones(len(which), I64), np.ones(n, I64)
    for j in cols[::-1]:
        first += t.start[:, j] * step[which]
        size *= t.shape[:, j]
        step = step * shapes[:, j]
    numel = shapes.prod(1)
    unsure = np.zeros(n, bool)
    unsure[which[flagged | (nonempty & ~is_run)]] = True
    # the runs of every other tensor with elements, sorted: the first starts at 0, none
    # starts past the reach of those before it, and the last reach is the tensor's numel
    laid = ~unsure & (numel > 0)
    keep = nonempty & laid[which]
    k, lo, hi = which[keep], first[keep], first[keep] + size[keep]
    if not ((k[1:] > k[:-1]) | (lo[1:] >= lo[:-1])).all():  # the builders' come in order
        order = np.lexsort((lo, k))
        k, lo, hi = k[order], lo[order], hi[order]
    reach = segmented_cummax(hi, k)
    head = np.ones(len(k), bool)
    head[1:] = k[1:] != k[:-1]
    gap = np.where(head, lo > 0, lo > np.roll(reach, 1))
    unsure[k[gap | (np.roll(head, -1) & (reach < numel[k]))]] = True
    unsure[laid & (np.bincount(k, minlength=n) == 0)] = True
    return np.flatnonzero(unsure).tolist()


def check_footprints(tl: TensorLayout):
    """Every piece's furthest storage element, offset + sum(strides * (shape - 1)), is below
    MAX_ELEMENTS (fields are non-negative here). A float64 screen finds the candidates; they
    are checked exactly in Python ints, since int64 arithmetic could wrap."""
    t = tl.table
    if not len(tl):
        return
    ext = np.maximum(t.shape - 1, 0).astype(np.float64)
    approx = t.offset.astype(np.float64) + (t.strides.astype(np.float64) * ext).sum(1)
    for i in np.nonzero(approx >= MAX_ELEMENTS / 2)[0].tolist():
        if (t.shape[i] == 0).any():
            continue  # an empty piece touches no storage
        hi = int(t.offset[i]) + sum(int(s) * (int(b) - 1) for s, b in zip(t.strides[i], t.shape[i]))
        if hi >= MAX_ELEMENTS:
            raise LayoutError(
                f"{tl.piece_label(i)}: reaches storage element {hi} (offset + "
                "sum(strides * (shape - 1))), beyond the 2**53 elements of reshard's geometry"
            )


def find_gap(shape, starts, ends, label="tensor"):
    """An element of the box `0..shape` covered by no [start, end) box, or None. `label`
    names the tensor in the LayoutError of boxes nested too deeply to check."""
    d = len(shape)
    if d == 0:
        return None if len(starts) else ()
    keep = (ends > starts).all(axis=1)
    return _gap_in(np.zeros(d, I64), np.array(shape, I64), starts[keep], ends[keep], label)


# (piece, slab) pairs the gap search holds at one level: a bound on its memory. Pieces of real
# layouts span one slab or a few (a slab is a dim-0 range between piece boundaries); only
# pieces nested many deep reach it, and are refused rather than exhaust memory.
MAX_GAP_PAIRS = 1 << 24


def _gap_in(lo, hi, s, e, label):
    # Sweep dim 0; slabs between breakpoints are covered at once by a box that spans the other
    # dims, else checked on the remaining dims, once per distinct set of spanning boxes. Each
    # box is listed in the slabs it spans only (no slabs x boxes matrix: 16000 row pieces made
    # one of 256 MB and took 4 s, 64000 would take 4 GB), so row blocks, column blocks, ZeRO
    # ranges and replicas cost about their pieces.
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
    first = np.searchsorted(bps, s[:, 0])
    span = np.searchsorted(bps, e[:, 0]) - first  # box i spans slabs first[i] .. + span[i]
    total = int(span.sum())
    if total > MAX_GAP_PAIRS:
        raise LayoutError(
            f"{label}: {len(s)} pieces overlap too deeply to check that they cover the tensor "
            f"({total} (piece, slab) pairs, more than {MAX_GAP_PAIRS}); describe it with "
            "fewer overlapping pieces"
        )
    box = np.repeat(np.arange(len(s)), span)
    slab = np.arange(total) - np.repeat(np.cumsum(span) - span, span) + first[box]
    nslab = len(bps) - 1
    spans_rest = ((s[:, 1:] <= lo[1:]) & (e[:, 1:] >= hi[1:])).all(axis=1)
    count = np.bincount(slab, minlength=nslab)
    empty = np.nonzero(count == 0)[0]
    if len(empty):
        return (int(bps[empty[0]]), *(int(x) for x in lo[1:]))
    covered = np.bincount(slab, weights=spans_rest[box], minlength=nslab) > 0
    open_slabs = np.nonzero(~covered)[0]
    if not len(open_slabs):
        return None
    order = np.lexsort((box, slab))
    box, bounds = box[order], np.concatenate([[0], np.cumsum(count)])
    seen = set()
    for k in open_slabs.tolist():
        sel = box[bounds[k] : bounds[k + 1]]
        key = sel.tobytes()
        if key in seen:
            continue
        seen.add(key)
        g = _gap_in(lo[1:], hi[1:], s[sel, 1:], e[sel, 1:], label)
        if g is not None:
            return (int(bps[k]), *g)
    return None
