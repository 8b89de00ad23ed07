"""Small array helpers shared by the planning steps."""

from __future__ import annotations

import operator

import numpy as np

from .records import I64


def expand(counts):
    """For ranges of `counts`: (owner index, position within the range) of every element."""
    counts = np.asarray(counts, I64)
    total = int(counts.sum())
    owner = np.repeat(np.arange(len(counts), dtype=I64), counts)
    first = np.cumsum(counts) - counts
    return owner, np.arange(total, dtype=I64) - first[owner]


def segments_of(flags):
    """Start index of each maximal segment, given `flags[i]`: element i continues i-1."""
    n = len(flags)
    new = np.ones(n, bool)
    if n > 1:
        new[1:] = ~flags[1:]
    return np.nonzero(new)[0]


def rows_equal(*cols):
    """flags[i]: row i equals row i-1 in every column (1-D or 2-D column blocks)."""
    n = len(cols[0])
    same = np.zeros(n, bool)
    if n > 1:
        same[1:] = True
        for c in cols:
            c = c.reshape(n, -1)
            same[1:] &= (c[1:] == c[:-1]).all(axis=1)
    return same


def check_rank(rank) -> int:
    """`rank` as an int for the per-rank methods: a non-negative integer (numpy ints too). A
    rank past the layouts' is a group member that owns nothing (an empty schedule), so only
    negatives are out of range; a str, bool or float is refused, never read as a rank."""
    return _non_negative_int(rank, "rank")


def check_nbytes(value, what: str) -> int:
    """A byte count given to a bound (`host_ring_bytes`): a non-negative integer (numpy ints
    too); a bool, float, str or negative count is refused, never added to a stated bound."""
    return _non_negative_int(value, what)


def _non_negative_int(value, what: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int, got bool {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an int, got {type(value).__name__} {value!r}") from None
    if value < 0:
        raise ValueError(f"{what} must be >= 0, got {value}")
    return value
