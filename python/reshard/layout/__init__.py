"""Geometry: where every element of every logical tensor lives. Pure data (numpy).

A `TensorLayout` is a list of pieces; a `Piece` says that the logical box
`start .. start+shape` lives in storage `location` at `offset + sum(strides * (idx - start))`.
Overlapping pieces are replicas. Pieces are kept as numpy arrays (a `PieceTable`, one row per
piece) so that layouts with millions of pieces (ZeRO-3 over hundreds of ranks) stay cheap; the
`Piece` objects of `.pieces` are built only when asked for.

Errors are `LayoutError`s naming the tensor, the piece and the reason. A `TensorLayout`
does not know its tensor's name unless given one (`name=`); the builders accept `name=` too.

Modules: `values` (checked integers, shapes, dtypes, limits), `pieces` (Piece, PieceTable,
TensorLayout and their checks), `builders` (replicated, split, flat, nest;
`flat_batch`: many `flat` calls at once), `state` (Storage,
Layout), `aliasing` (the target aliasing check), `intervals` (interval overlap utility).
"""

from .builders import flat, flat_batch, nest, replicated, split
from .intervals import first_overlap, merge, overlapping_rows
from .pieces import Piece, PieceTable, TensorLayout
from .state import Layout, Storage
from .values import MAX_ELEMENTS, as_dtype

__all__ = [
    "MAX_ELEMENTS",
    "Layout",
    "Piece",
    "PieceTable",
    "Storage",
    "TensorLayout",
    "as_dtype",
    "first_overlap",
    "flat",
    "flat_batch",
    "merge",
    "nest",
    "overlapping_rows",
    "replicated",
    "split",
]
