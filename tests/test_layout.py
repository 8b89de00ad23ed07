"""Geometry tests: builders against brute-force element maps, every LayoutError case,
pickling and equality."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reshard as rs


def element_map(tl):
    """{logical flat index: sorted [(location, storage offset)]} by brute force."""
    out = {}
    for p in tl.pieces:
        for idx in np.ndindex(*p.shape):
            logical = tuple(s + i for s, i in zip(p.start, idx))
            flat = int(np.ravel_multi_index(logical, tl.shape)) if tl.shape else 0
            off = p.offset + sum(s * i for s, i in zip(p.strides, idx))
            out.setdefault(flat, []).append((p.location, off))
    return {k: sorted(v) for k, v in out.items()}


def S(rank, numel, dtype=torch.float32):
    return rs.Storage(rank, dtype, numel)


# -- builders -------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(1, 5), min_size=1, max_size=4),
    st.data(),
)
def test_flat_matches_flat_index_map(shape, data):
    n = int(np.prod(shape))
    cuts = sorted(data.draw(st.lists(st.integers(0, n), max_size=5)))
    edges = [0, *cuts, n]
    runs = [(i, a, b, i * 3) for i, (a, b) in enumerate(zip(edges, edges[1:]))]
    tl = rs.flat(tuple(shape), runs)
    # at most 2*ndim-1 boxes per run
    assert len(tl.pieces) <= len(runs) * (2 * len(shape) - 1)
    want = {}
    for loc, a, b, off in runs:
        for f in range(a, b):
            want[f] = [(loc, off + f - a)]
    assert element_map(tl) == want


def test_flat_replicas_and_scalar():
    tl = rs.flat((2, 3), [(0, 0, 6, 0), (1, 2, 6, 1)])
    m = element_map(tl)
    assert m[1] == [(0, 1)] and m[4] == [(0, 4), (1, 3)]
    assert element_map(rs.flat((), [(5, 0, 1, 7)])) == {0: [(5, 7)]}
    assert rs.flat((0, 4), []).pieces == ()


def test_split_uneven_with_replicas_and_offsets():
    tl = rs.split((5, 4), 0, [2, 0, 3], [[1, 2], 3, 4], offsets=[[10, 0], 0, 5])
    m = element_map(tl)
    assert m[0] == [(1, 10), (2, 0)]
    assert m[2 * 4 + 1] == [(4, 5 + 1)]
    assert len(m) == 20
    col = rs.split((3, 5), -1, [1, 4], [0, 1])
    assert element_map(col)[1 * 5 + 3] == [(1, 1 * 4 + 2)]


def test_replicated_and_mixed_entries():
    a = rs.replicated((2, 2), [0, 1])
    assert element_map(a)[3] == [(0, 3), (1, 3)]
    mixed = rs.TensorLayout(
        (2, 2), [rs.split((2, 2), 1, [1, 1], [5, 6]), rs.Piece(7, 0, (0, 0), (1, 1))]
    )
    assert element_map(mixed)[0] == [(5, 0), (7, 0)]


def test_piece_defaults_and_equality():
    p = rs.Piece(3, 4, [0, 1], (2, 3))
    assert p.strides == (3, 1) and p.start == (0, 1)
    assert p == rs.Piece(3, 4, (0, 1), (2, 3), (3, 1))
    assert hash(p) == hash(rs.Piece(3, 4, (0, 1), (2, 3), (3, 1)))


def test_nest_single_holder_zero_partitioned():
    # a 2-D tensor stored whole in one virtual buffer, itself split over two ranks' storages
    outer = rs.replicated((3, 4), [99])
    inner = {99: rs.flat((12,), [(0, 0, 5, 1), (1, 5, 12, 0)])}
    tl = rs.nest(outer, inner)
    assert tl.shape == (3, 4)
    want = {f: [(0, 1 + f)] if f < 5 else [(1, f - 5)] for f in range(12)}
    assert element_map(tl) == want


def test_nest_tp_shard_buffer_zero_partitioned_with_strides():
    # TP shards (column blocks) whose shard buffers are ZeRO-partitioned, one outer replica
    # left unnested (passes through), inner replicated over two locations
    outer = rs.split((4, 6), 1, [2, 4], [[10, 3], 11])
    inner = {
        10: rs.flat((8,), [(0, 0, 3, 0), (1, 3, 8, 2)]),
        11: rs.TensorLayout(
            (16,), [rs.Piece(2, 0, (0,), (16,), (2,)), rs.Piece(4, 1, (0,), (16,))]
        ),
    }
    tl = rs.nest(outer, inner)
    m = element_map(tl)
    for r in range(4):
        for c in range(6):
            f = r * 6 + c
            if c < 2:
                v = r * 2 + c
                want = [(0, v) if v < 3 else (1, 2 + v - 3), (3, v)]
            else:
                v = r * 4 + c - 2
                want = [(2, 2 * v), (4, 1 + v)]
            assert m[f] == sorted(want), (r, c)


def test_nest_transposed_outer_piece():
    # outer piece with transposed strides into a virtual buffer split in two
    outer = rs.TensorLayout((3, 2), [rs.Piece(9, 0, (0, 0), (3, 2), (1, 3))])
    tl = rs.nest(outer, {9: rs.flat((6,), [(0, 0, 4, 0), (1, 4, 6, 0)])})
    m = element_map(tl)
    for r in range(3):
        for c in range(2):
            v = r + 3 * c
            assert m[r * 2 + c] == [(0, v) if v < 4 else (1, v - 4)]


def test_layout_pickle_and_equality():
    lay = rs.Layout(
        {
            "w": rs.flat((4, 4), [(0, 0, 16, 0)]),
            "b": rs.split((4,), 0, [1, 3], [0, 1], offsets=[16, 0]),
        },
        {0: S(0, 17, "bfloat16"), 1: S(1, 3, "torch.float32")},
    )
    again = pickle.loads(pickle.dumps(lay))
    assert again == lay
    assert again.storages[0].dtype is torch.bfloat16
    assert again.tensors["w"].pieces == lay.tensors["w"].pieces
    assert lay != rs.Layout({"w": rs.flat((4, 4), [(0, 0, 16, 1)])}, {0: S(0, 17, "bf16")})


def test_storage_dtype_normalization():
    assert S(0, 1, "bfloat16").dtype is torch.bfloat16
    assert S(0, 1, "fp16").dtype is torch.float16
    assert S(0, 1, np.dtype("float32")).dtype is torch.float32
    assert S(0, 1, "int8").dtype is torch.int8
    with pytest.raises(rs.LayoutError, match="unknown dtype 'float33'"):
        S(0, 1, "float33")
    with pytest.raises(rs.LayoutError, match="numel must be >= 0"):
        S(0, -1)
    with pytest.raises(rs.LayoutError, match="rank must be >= 0"):
        S(-1, 1)


# -- every LayoutError ---------------------------------------------------------------------------


def test_error_gap_names_tensor_and_element():
    with pytest.raises(rs.LayoutError, match=r"tensor 'w': gap: element \(1, 1\)"):
        rs.TensorLayout(
            (2, 2), [rs.Piece(0, 0, (0, 0), (1, 2)), rs.Piece(0, 2, (1, 0), (1, 1))], name="w"
        )
    with pytest.raises(rs.LayoutError, match=r"gap: flat element 3 \(index \(1, 0\)\)"):
        rs.flat((2, 3), [(0, 0, 3, 0), (0, 4, 6, 3)], name="w")
    with pytest.raises(rs.LayoutError, match=r"gap: element \(\)"):
        rs.TensorLayout((), [])


def test_error_piece_outside_tensor():
    with pytest.raises(rs.LayoutError, match=r"tensor 'x': piece 1 Piece\(.*\): outside the"):
        rs.TensorLayout(
            (2, 2), [rs.Piece(0, 0, (0, 0), (2, 2)), rs.Piece(0, 0, (1, 1), (2, 1))], name="x"
        )
    with pytest.raises(rs.LayoutError, match="negative start"):
        rs.TensorLayout((2,), [rs.Piece(0, 0, (-1,), (2,))])
    with pytest.raises(rs.LayoutError, match="has 1 dims, the tensor has 2"):
        rs.TensorLayout((2, 2), [rs.Piece(0, 0, (0,), (4,))])
    with pytest.raises(rs.LayoutError, match="flat_stop beyond the tensor's 6 elements"):
        rs.flat((2, 3), [(0, 0, 7, 0)])
    with pytest.raises(rs.LayoutError, match=r"flat run 0 \(0, 3, 2, 0\): flat_start must be"):
        rs.flat((2, 3), [(0, 3, 2, 0)])


def test_error_negative_fields_and_bad_types():
    with pytest.raises(rs.LayoutError, match="negative storage offset"):
        rs.TensorLayout((2,), [rs.Piece(0, -1, (0,), (2,))])
    with pytest.raises(rs.LayoutError, match="negative stride"):
        rs.TensorLayout((2,), [rs.Piece(0, 2, (0,), (2,), (-1,))])
    with pytest.raises(rs.LayoutError, match="Piece strides .* different lengths"):
        rs.Piece(0, 0, (0, 0), (1, 1), (1,))
    with pytest.raises(rs.LayoutError, match="must be an integer"):
        rs.Piece(0, 0.5, (0,), (1,))
    with pytest.raises(rs.LayoutError, match="sequence of integers"):
        rs.replicated(4, [0])
    with pytest.raises(rs.LayoutError, match="expected Piece or TensorLayout"):
        rs.TensorLayout((2,), [(0, 0, (0,), (2,))])
    with pytest.raises(rs.LayoutError, match="flat runs must be"):
        rs.flat((3,), [(0, 0, 3)])


def test_error_split_sizes():
    with pytest.raises(rs.LayoutError, match=r"split sizes \(1, 2\) sum to 3 but dim 0 has 4"):
        rs.split((4, 2), 0, [1, 2], [0, 1], name="w")
    with pytest.raises(rs.LayoutError, match="2 sizes but 3 locations"):
        rs.split((4,), 0, [2, 2], [0, 1, 2])
    with pytest.raises(rs.LayoutError, match="split dim 2 out of range"):
        rs.split((4,), 2, [4], [0])
    with pytest.raises(rs.LayoutError, match="negative size"):
        rs.split((4,), 0, [5, -1], [0, 1])
    with pytest.raises(rs.LayoutError, match="block 1 has 2 locations but 1 offsets"):
        rs.split((4,), 0, [2, 2], [0, [1, 2]], offsets=[0, [3]])


def test_error_unknown_location_and_storage_range():
    tl = rs.split((4, 4), 1, [2, 2], [0, 1])
    with pytest.raises(rs.LayoutError, match=r"tensor 'w': piece 1 .*unknown location 1"):
        rs.Layout({"w": tl}, {0: S(0, 8)})
    with pytest.raises(
        rs.LayoutError,
        match=r"tensor 'w': piece 1 .*storage out of range: touches element 7 of "
        r"location 1, which has 6",
    ):
        rs.Layout({"w": tl}, {0: S(0, 8), 1: S(1, 6)})
    with pytest.raises(rs.LayoutError, match="expected Storage"):
        rs.Layout({"w": tl}, {0: (0, "fp32", 8)})
    with pytest.raises(rs.LayoutError, match="tensor names must be str"):
        rs.Layout({1: tl}, {0: S(0, 8)})


def test_error_nest():
    outer = rs.replicated((2, 3), [9])
    with pytest.raises(
        rs.LayoutError, match="reaches element 5 of location 9, whose inner layout has only 4"
    ):
        rs.nest(outer, {9: rs.flat((4,), [(0, 0, 4, 0)])})
    with pytest.raises(rs.LayoutError, match="must be a 1-D TensorLayout"):
        rs.nest(outer, {9: rs.replicated((2, 3), [0])})


def test_error_target_aliasing():
    # two tensors written to overlapping storage: caught when planning into them
    dst = rs.Layout(
        {"a": rs.replicated((4,), [0]), "b": rs.split((4,), 0, [2, 2], [0, 1], offsets=[3, 0])},
        {0: S(0, 8), 1: S(0, 2)},
    )
    src = rs.Layout({"a": rs.replicated((4,), [5]), "b": rs.replicated((4,), [5])}, {5: S(0, 4)})
    with pytest.raises(
        rs.LayoutError,
        match=r"target tensor 'b': piece 0 .*writes storage "
        r"element 3 of location 0, also written by tensor 'a'",
    ):
        rs.plan(src, dst)
    # a piece whose strides map two logical elements onto one storage element
    bad = rs.Layout(
        {"a": rs.TensorLayout((2, 2), [rs.Piece(0, 0, (0, 0), (2, 2), (1, 1))])}, {0: S(0, 4)}
    )
    src22 = rs.Layout({"a": rs.replicated((2, 2), [5])}, {5: S(0, 4)})
    with pytest.raises(
        rs.LayoutError, match="two logical elements written to the same storage element 1"
    ):
        rs.plan(src22, bad)
    # the same layout is a fine *source* (a broadcast read)
    ok_dst = rs.Layout({"a": rs.replicated((2, 2), [3])}, {3: S(0, 4)})
    src2 = rs.Layout(
        {"a": rs.TensorLayout((2, 2), [rs.Piece(0, 0, (0, 0), (2, 2), (0, 1))])}, {0: S(0, 2)}
    )
    assert rs.plan(src2, ok_dst).num_rounds == 0
    # interleaved (fused) target pieces that do not overlap are accepted
    fused = rs.Layout(
        {
            "a": rs.TensorLayout((2, 2), [rs.Piece(0, 0, (0, 0), (2, 2), (4, 1))]),
            "c": rs.TensorLayout((2, 2), [rs.Piece(0, 2, (0, 0), (2, 2), (4, 1))]),
        },
        {0: S(0, 8)},
    )
    src3 = rs.Layout(
        {"a": rs.replicated((2, 2), [1]), "c": rs.replicated((2, 2), [1])}, {1: S(0, 4)}
    )
    rs.plan(src3, fused)
