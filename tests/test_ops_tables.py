"""Large interleaved descriptor tables: validation stays O(n log n) in rows on every table shape
(a quadratic check took minutes on the 64,000-row transpose below), so these run under a
timeout far above what they need and far below what a quadratic check would take. Results are
checked against numpy's own transpose; a refused table writes nothing."""

import numpy as np
import pytest
import torch

import reshard

ROWS, COUNT = 64_000, 8  # 512 Ki float32 elements: a 2 MiB copy
POISON = -1.0


def transpose_table(rows=ROWS, count=COUNT):
    """dst = src viewed as [rows, count], transposed: row i writes src[i*count : +count] to
    dst[i], dst[i + rows], ... (one element per run, every row interleaved with every other)."""
    t = np.zeros((rows, 6), np.int64)
    t[:, 0] = np.arange(rows) * count
    t[:, 1] = 1
    t[:, 2] = np.arange(rows)
    t[:, 3] = rows
    t[:, 4] = 1
    t[:, 5] = count
    return t


def split_rows(t, every=7):
    """Every `every`-th row as two rows of twice the stride (its even and its odd runs): the
    same copy, but the interleaved rows have two strides."""
    rows = len(t)
    even = t[::every].copy()
    even[:, 1] = 2
    even[:, 3] *= 2
    even[:, 5] //= 2
    odd = even.copy()
    odd[:, 0] += 1
    odd[:, 2] += rows
    keep = np.ones(rows, bool)
    keep[::every] = False
    return np.concatenate([t[keep], even, odd])


def expected(src):
    return src.reshape(ROWS, COUNT).t().contiguous().reshape(-1)


def shuffled(t, seed):
    return t[np.random.default_rng(seed).permutation(len(t))]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shape", ["transpose", "transpose shuffled", "two strides shuffled"])
def test_large_interleaved_tables_copy_right(shape):
    table = transpose_table()
    if shape != "transpose":
        table = shuffled(split_rows(table) if "two" in shape else table, seed=len(shape))
    src = torch.arange(ROWS * COUNT, dtype=torch.float32)
    dst = torch.full((ROWS * COUNT,), POISON)
    reshard.copy_runs(src, table, dst)
    assert torch.equal(dst, expected(src))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shape", ["transpose", "two strides"])
def test_large_interleaved_tables_with_one_collision_refused(shape):
    table = shuffled(
        transpose_table() if shape == "transpose" else split_rows(transpose_table()), 1
    )
    bad = len(table) // 2
    victim = int(np.flatnonzero(table[:, 3] == ROWS)[3])  # a row of the transpose's stride
    table[bad, 2] = table[victim, 2] + ROWS * (COUNT // 2)  # lands on the victim's 5th run
    table[bad, 3] = ROWS
    table[bad, 5] = 1
    src = torch.arange(ROWS * COUNT, dtype=torch.float32)
    dst = torch.full((ROWS * COUNT,), POISON)
    lo, hi = sorted((bad, victim))
    with pytest.raises(RuntimeError, match=f"rows {lo} and {hi} write the same dst element"):
        reshard.copy_runs(src, table, dst)
    assert bool((dst == POISON).all())


@pytest.mark.timeout(120)
def test_many_single_runs_inside_one_strided_row():
    """One row writes the even elements, 256,000 single-element rows the odd ones (every row's
    extent inside the first's), then one more single run hits an even element."""
    n = 256_000
    rows = np.zeros((n + 1, 6), np.int64)
    rows[0] = [0, 1, 0, 2, 1, n]
    rows[1:, 0] = n + np.arange(n)
    rows[1:, 2] = 1 + 2 * np.arange(n)
    rows[1:, 4] = 1
    rows[1:, 5] = 1
    rows = shuffled(rows, 2)
    src = torch.arange(2 * n, dtype=torch.float32)
    dst = torch.full((2 * n,), POISON)
    reshard.copy_runs(src, rows, dst)
    want = torch.empty(2 * n)
    want[0::2] = src[:n]
    want[1::2] = src[n:]
    assert torch.equal(dst, want)
    bad = np.concatenate([rows, [[0, 1, 2 * 1000, 1, 1, 1]]])
    dst = torch.full((2 * n,), POISON)
    with pytest.raises(RuntimeError, match=f"and {n + 1} write the same dst element"):
        reshard.copy_runs(src, bad, dst)
    assert bool((dst == POISON).all())
