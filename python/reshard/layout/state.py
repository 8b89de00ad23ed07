"""A whole state: `Storage`s (who owns each buffer) and `Layout` (tensors over storages)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType

import numpy as np
import torch

from ..errors import LayoutError
from .aliasing import check_target_aliasing
from .pieces import TensorLayout, check_tensors, named_error, stacked_tables
from .values import I64, MAX_ELEMENTS, as_dtype, as_int, restore_fields

QUANTIZED_DTYPES = frozenset(
    getattr(torch, n)
    for n in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4")
    if hasattr(torch, n)
)


@dataclasses.dataclass(frozen=True)
class Storage:
    """One buffer: the rank that owns it, its dtype (normalized to torch.dtype), its extent."""

    rank: int
    dtype: torch.dtype
    numel: int

    def __post_init__(self):
        rank = as_int(self.rank, "Storage.rank")
        numel = as_int(self.numel, "Storage.numel")
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
        dtype = as_dtype(self.dtype)
        if dtype in QUANTIZED_DTYPES:
            raise LayoutError(
                f"Storage dtype {dtype} is quantized: its scale and zero point are not elements; "
                "describe the int_repr() values instead"
            )
        object.__setattr__(self, "dtype", dtype)

    def __setstate__(self, state):
        restore_fields(self, state)


class Layout:
    """A whole state: logical tensors by name and the storages their pieces live in.

    Checks that every piece's location is a known storage and that its footprint lies
    inside that storage. Picklable; compares equal across processes. Immutable: a plan keeps
    its layouts, and its fingerprint covers what they held then.
    """

    __slots__ = ("_tensors", "_storages", "_aliasing_checked")

    def __init__(self, tensors, storages):
        if not isinstance(tensors, Mapping) or not isinstance(storages, Mapping):
            raise LayoutError("Layout(tensors, storages) takes two dicts")
        st = {}
        for loc, s in storages.items():
            loc = as_int(loc, "storage location")
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
        self._set(ts, st)
        _check_locations(ts, st)

    def _set(self, tensors: dict, storages: dict) -> None:
        object.__setattr__(self, "_tensors", MappingProxyType(tensors))
        object.__setattr__(self, "_storages", MappingProxyType(storages))
        object.__setattr__(self, "_aliasing_checked", False)

    def __setattr__(self, name, value):
        raise AttributeError(f"Layout is immutable: build a new Layout instead of setting {name!r}")

    def __delattr__(self, name):
        raise AttributeError(f"Layout is immutable: cannot delete {name!r}")

    @property
    def tensors(self) -> Mapping:
        """{name: TensorLayout}, read-only."""
        return self._tensors

    @property
    def storages(self) -> Mapping:
        """{location: Storage}, read-only."""
        return self._storages

    def check_no_aliasing(self):
        """As a target: no storage element may be written for two logical elements. Raises
        LayoutError naming both pieces; checked once per Layout object."""
        if not self._aliasing_checked:
            check_target_aliasing(self.tensors)
            object.__setattr__(self, "_aliasing_checked", True)

    def __eq__(self, other):
        if not isinstance(other, Layout):
            return NotImplemented
        return self.storages == other.storages and self.tensors == other.tensors

    __hash__ = None

    def __getstate__(self):
        # the tensors' own states: unpickling checks all their pieces in one batch
        # (`check_tensors`), not tensor by tensor
        tensors = {name: tl.__getstate__() for name, tl in self.tensors.items()}
        return {"tensors": tensors, "storages": dict(self.storages)}

    def __setstate__(self, state):
        # unpickled (or copied): every check of the constructor, since the bytes may be
        # tampered with or stale. Tensors come as their states (`__getstate__`) and are checked
        # in one batch; TensorLayout objects (pickled by older versions) checked themselves.
        if not isinstance(state, dict) or sorted(state) != ["storages", "tensors"]:
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise LayoutError(
                f"unpickled Layout: expected the state {{tensors, storages}}, got {got}"
            )
        tensors = state["tensors"]
        if not isinstance(tensors, Mapping):
            raise LayoutError(
                f"unpickled Layout: tensors must be a dict, got {type(tensors).__name__}"
            )
        restored, names = {}, []
        for name, tl in tensors.items():
            if not isinstance(tl, TensorLayout):
                try:
                    tl = TensorLayout._restored(tl)
                except LayoutError as exc:
                    raise named_error(name, None, exc) from None
                names.append(name)
            restored[name] = tl
        check_tensors([restored[name] for name in names], names)
        self.__init__(restored, state["storages"])

    def __repr__(self):
        return f"Layout({len(self.tensors)} tensors, {len(self.storages)} storages)"


def _check_locations(tensors, storages):
    """Every piece names a known storage and lies inside it: one pass over every tensor's
    pieces (`stacked_tables`), then the first tensor with a bad piece names it."""
    locs = np.array(sorted(storages), I64)
    numels = np.array([storages[int(x)].numel for x in locs], I64)
    names = list(tensors)
    tls = [tensors[name] for name in names]
    bad_tensors = []
    for idx, which, t in stacked_tables(tls):
        unknown, outside = _bad_pieces(t, locs, numels)
        bad = np.flatnonzero(unknown | outside)
        if len(bad):
            bad_tensors.append(idx[int(which[bad[0]])])
    if bad_tensors:
        i = min(bad_tensors)
        _check_tensor_locations(names[i], tls[i], locs, numels, storages)


def _bad_pieces(t, locs, numels) -> tuple:
    """(pieces of table `t` whose location is not in `locs`, pieces of known locations that
    reach past their storage's numel), as masks."""
    if not len(locs):
        return np.ones(len(t.location), bool), np.zeros(len(t.location), bool)
    pos = np.minimum(np.searchsorted(locs, t.location), len(locs) - 1)
    unknown = locs[pos] != t.location
    return unknown, ~unknown & (t.footprint_hi() >= numels[pos])


def _check_tensor_locations(name, tl, locs, numels, storages):
    """Raise the LayoutError of tensor `name`'s first piece with an unknown location, else of
    its first piece outside its storage."""
    t = tl.table
    unknown, outside = _bad_pieces(t, locs, numels)
    if unknown.any():
        i = int(np.flatnonzero(unknown)[0])
        raise LayoutError(
            f"tensor {name!r}: piece {i} {tl.piece(i)}: unknown location "
            f"{int(t.location[i])} (storages: {sorted(storages)[:16]})"
        )
    if outside.any():
        i = int(np.flatnonzero(outside)[0])
        loc = int(t.location[i])
        raise LayoutError(
            f"tensor {name!r}: piece {i} {tl.piece(i)}: storage out of range: touches "
            f"element {int(t.footprint_hi()[i])} of location {loc}, which has "
            f"{storages[loc].numel}"
        )
