"""Half-open integer intervals: merging, and finding overlaps in O(n log n).

One utility for every "do these ranges overlap" question: target aliasing in geometry
(storage elements), and buffer aliasing in preflight (bytes). Intervals are int64 arrays:
a set is `[n, 2]` rows `[lo, hi)`, or separate starts and lengths.
"""

from __future__ import annotations

import numpy as np


def merge(iv: np.ndarray) -> np.ndarray:
    """`[n, 2]` intervals as sorted, disjoint intervals; touching intervals merge too."""
    if iv.shape[0] <= 1:
        return iv
    iv = iv[np.argsort(iv[:, 0], kind="stable")]
    ends = np.maximum.accumulate(iv[:, 1])
    new = np.ones(iv.shape[0], bool)
    new[1:] = iv[1:, 0] > ends[:-1]
    idx = np.flatnonzero(new)
    return np.stack([iv[idx, 0], np.maximum.reduceat(iv[:, 1], idx)], axis=1)


def first_overlap(a: np.ndarray, b: np.ndarray) -> tuple[int, int] | None:
    """First overlap `[lo, hi)` of two merged interval sets (see `merge`), or None."""
    if a.shape[0] == 0 or b.shape[0] == 0:
        return None
    # b is disjoint and sorted, so its ends are sorted too: the last b starting before a's end
    # is the only b interval that can reach into a.
    j = np.searchsorted(b[:, 0], a[:, 1], side="left") - 1
    hit = (j >= 0) & (b[np.maximum(j, 0), 1] > a[:, 0])
    if not hit.any():
        return None
    i = int(np.flatnonzero(hit)[0])
    return int(max(a[i, 0], b[j[i], 0])), int(min(a[i, 1], b[j[i], 1]))


def overlapping_rows(starts: np.ndarray, lengths: np.ndarray) -> tuple[int, int] | None:
    """Two rows `[start, start + length)` of one set that overlap, as indices `(a, b)`, or None.

    In start order (stable), `b` is the first row that starts before an earlier row ends, and
    `a` the first earlier row that reaches past `b`'s start. Rows are non-empty."""
    o = np.argsort(starts, kind="stable")
    s, ln = starts[o], lengths[o]
    ends = np.maximum.accumulate(s + ln)
    hit = np.nonzero(s[1:] < ends[:-1])[0]
    if not len(hit):
        return None
    j = int(hit[0]) + 1
    prev = int(np.nonzero((s[:j] + ln[:j]) > s[j])[0][0])
    return int(o[prev]), int(o[j])


def segmented_cummax(x: np.ndarray, key: np.ndarray) -> np.ndarray:
    """Running max of `x` that restarts whenever `key` changes (`key` sorted)."""
    # Lift each group above all previous ones so that one global cummax works: group g is
    # shifted by the spans of the groups before it, whose sum stays within the values' extent
    # (no int64 wraparound, however many groups).
    if not len(x):
        return x
    starts = np.nonzero(np.concatenate([[True], key[1:] != key[:-1]]))[0]
    lo = np.minimum.reduceat(x, starts)
    span = np.maximum.reduceat(x, starts) - lo + 1
    shift = np.repeat(np.cumsum(span) - span - lo, np.diff(np.append(starts, len(x))))
    return np.maximum.accumulate(x + shift) - shift
