"""Checked scalars of geometry: integers, shapes, dtypes, and the limits they live within."""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import KeysView, Mapping
from collections.abc import Set as AbstractSet

import numpy as np
import torch

from ..errors import LayoutError

I64 = np.int64
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
# Geometry addresses fewer than 2**53 elements: a tensor, a storage and all storages of a
# layout together. The planner sums element counts in float64 (exact below 2**53), and every
# offset, extent, byte count and total derived from them then fits int64 with room to spare,
# so nothing computed from a valid layout can overflow. No machine holds 2**53 elements.
MAX_ELEMENTS = 1 << 53

DTYPE_ALIASES = {
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


def as_dtype(x) -> torch.dtype:
    """A torch.dtype from a torch.dtype, a numpy dtype or scalar type (np.float32) or a name
    ('bfloat16', 'bf16', ...)."""
    if isinstance(x, torch.dtype):
        return x
    if isinstance(x, type) and issubclass(x, np.generic):  # np.float32, the scalar type
        x = np.dtype(x)
    if isinstance(x, np.dtype):
        x = x.name
    if isinstance(x, str):
        name = x.strip()
        name = name[6:] if name.startswith("torch.") else name
        if name in DTYPE_ALIASES:
            return DTYPE_ALIASES[name]
        dt = getattr(torch, name, None)
        if isinstance(dt, torch.dtype):
            return dt
    raise LayoutError(f"unknown dtype {x!r}: pass a torch.dtype or a name like 'bfloat16'")


def as_int(x, what: str) -> int:
    """`x` as a Python int that fits int64 (bool and non-integers refused)."""
    if isinstance(x, bool):
        raise LayoutError(f"{what} must be an integer, got {x!r}")
    try:
        v = operator.index(x)
    except TypeError:
        raise LayoutError(f"{what} must be an integer, got {x!r}") from None
    if not INT64_MIN <= v <= INT64_MAX:
        raise LayoutError(f"{what} {v} does not fit in int64")
    return v


def as_ints(xs, what: str) -> tuple:
    if isinstance(xs, (str, bytes)) or not hasattr(xs, "__iter__") or _unordered(xs):
        # A bare int is the common slip for a 1-D shape; say so instead of a TypeError.
        raise LayoutError(f"{what} must be a sequence of integers, got {xs!r}")
    try:
        return tuple(as_int(x, what) for x in xs)
    except TypeError:  # iterable in name only: a 0-d tensor or array
        raise LayoutError(f"{what} must be a sequence of integers, got {xs!r}") from None


def as_list(xs, what: str, ordered: bool = False) -> list:
    """`xs` (any iterable but a string or a mapping; with `ordered`, not a set either: its
    order is not the caller's) as a list; else a LayoutError naming `what`."""
    if (
        isinstance(xs, (str, bytes, Mapping))
        or not hasattr(xs, "__iter__")
        or (ordered and _unordered(xs))
    ):
        raise LayoutError(f"{what} must be a sequence, got {type(xs).__name__} {xs!r}")
    try:
        return list(xs)
    except TypeError:  # iterable in name only: a 0-d tensor or array
        raise LayoutError(f"{what} must be a sequence, got {type(xs).__name__} {xs!r}") from None


def _unordered(xs) -> bool:
    """A set or a mapping: as a shape, a start or a list of blocks, its iteration order (or
    its keys) would silently stand for the order the caller meant. A dict's keys() view is
    ordered (insertion order) and stays a sequence."""
    return isinstance(xs, Mapping) or (isinstance(xs, AbstractSet) and not isinstance(xs, KeysView))


def as_int_array(xs, what: str) -> np.ndarray:
    """`xs` (a list) as int64, with `as_int`'s errors; one numpy pass for plain int lists."""
    try:
        a = np.asarray(xs) if xs else np.zeros(0, I64)
    except ValueError:  # nested sequences: the per-element path says which
        a = np.zeros((0, 0))
    if a.ndim == 1 and a.dtype.kind == "i" and not any(isinstance(x, bool) for x in xs):
        return a.astype(I64, copy=False)
    return np.array([as_int(x, what) for x in xs], I64).reshape(-1)


def as_shape(xs, what: str, name=None) -> tuple:
    """A tensor shape: non-negative ints addressing at most MAX_ELEMENTS elements (zero dims
    included, so row-major strides of any such shape fit int64)."""
    shape = as_ints(xs, what)
    if any(n < 0 for n in shape):
        raise LayoutError(f"{tensor_label(name, shape)}: {what} has a negative dim")
    if num_elements(max(n, 1) for n in shape) > MAX_ELEMENTS:
        raise LayoutError(
            f"{tensor_label(name, shape)}: more than 2**53 elements (the limit of reshard's "
            "geometry)"
        )
    return shape


def row_major(shape) -> tuple:
    """Contiguous strides of `shape` (a dim of extent 0 counts as 1)."""
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


def num_elements(shape) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


def tensor_label(name, shape) -> str:
    """How errors name a tensor: by name when it has one, else by shape."""
    return f"tensor {name!r}" if name is not None else f"tensor of shape {tuple(shape)}"


def restore_fields(obj, state) -> None:
    """Unpickling (or copying) the frozen dataclass `obj`: its fields from `state`, then its
    `__post_init__`'s checks, as its constructor runs them (the bytes may be tampered with or
    stale). A LayoutError names what is wrong."""
    names = [f.name for f in dataclasses.fields(obj)]
    what = type(obj).__name__
    if not isinstance(state, dict) or sorted(state) != sorted(names):
        got = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise LayoutError(f"unpickled {what}: expected the fields {names}, got {got}")
    for name in names:
        object.__setattr__(obj, name, state[name])
    obj.__post_init__()
