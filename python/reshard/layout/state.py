"""A whole state: `Storage`s (who owns each buffer) and `Layout` (tensors over storages)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType

import numpy as np
import torch

from ..errors import LayoutError
from .aliasing import check_target_aliasing
from .pieces import TensorLayout
from .values import I64, MAX_ELEMENTS, as_dtype, as_int

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
        return {"tensors": dict(self.tensors), "storages": dict(self.storages)}

    def __setstate__(self, state):
        self._set(dict(state["tensors"]), dict(state["storages"]))

    def __repr__(self):
        return f"Layout({len(self.tensors)} tensors, {len(self.storages)} storages)"


def _check_locations(tensors, storages):
    """Every piece names a known storage and lies inside it."""
    locs = np.array(sorted(storages), I64)
    numels = np.array([storages[int(x)].numel for x in locs], I64)
    for name, tl in tensors.items():
        t = tl.table
        if not len(tl):
            continue
        pos = np.searchsorted(locs, t.location)
        pos_c = np.minimum(pos, max(len(locs) - 1, 0))
        known = (pos < len(locs)) & (locs[pos_c] == t.location) if len(locs) else pos < 0
        bad = np.nonzero(~known)[0]
        if len(bad):
            i = int(bad[0])
            raise LayoutError(
                f"tensor {name!r}: piece {i} {tl.piece(i)}: unknown location "
                f"{int(t.location[i])} (storages: {sorted(storages)[:16]})"
            )
        hi = t.footprint_hi()
        bad = np.nonzero(hi >= numels[pos_c])[0]
        if len(bad):
            i = int(bad[0])
            loc = int(t.location[i])
            raise LayoutError(
                f"tensor {name!r}: piece {i} {tl.piece(i)}: storage out of range: touches "
                f"element {int(hi[i])} of location {loc}, which has {storages[loc].numel}"
            )
