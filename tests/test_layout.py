"""Geometry tests: builders against brute-force element maps, every LayoutError case,
pickling and equality."""

from __future__ import annotations

import copy
import copyreg
import pickle
import re

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


@pytest.mark.parametrize("seed", range(30))
def test_nest_matches_brute_force_with_replicated_inner_pieces(seed):
    # outer: a split with strided blocks into virtual locations 90/91; inner: flat runs of
    # each virtual buffer, some of them replicas (overlapping runs), over real locations
    rng = np.random.default_rng(seed)
    shape = (int(rng.integers(1, 5)), int(rng.integers(1, 6)))
    cut = int(rng.integers(0, shape[0] + 1))
    outer = rs.split(shape, 0, [cut, shape[0] - cut], [90, 91])
    inner, want_inner = {}, {}
    for v, rows in ((90, cut), (91, shape[0] - cut)):
        n = rows * shape[1]
        if not n:
            continue
        bounds = sorted({0, n, *rng.integers(0, n, size=3).tolist()})
        runs = [(int(rng.integers(0, 3)), a, b, 4 * a) for a, b in zip(bounds, bounds[1:])]
        for _ in range(int(rng.integers(0, 3))):  # replicas of random ranges
            a = int(rng.integers(0, n))
            runs.append((3, a, int(rng.integers(a + 1, n + 1)), 0))
        inner[v] = rs.flat((n,), runs)
        want_inner[v] = element_map(inner[v])
    tl = rs.nest(outer, inner)
    want = {}
    for f, places in element_map(outer).items():
        for vloc, voff in places:
            want.setdefault(f, []).extend(want_inner[vloc][voff])
    assert element_map(tl) == {f: sorted(v) for f, v in want.items()}


def test_nest_of_many_outer_and_inner_pieces_is_not_quadratic():
    """Each outer piece was composed with every inner piece in Python: 3000 x 3000 took 26 s.
    Only the inner pieces an outer piece reaches are looked at (a binary search)."""
    import time

    n, N = 3000, 3000 * 64
    outer = rs.flat((N,), [(100, 64 * i, 64 * (i + 1), 64 * i) for i in range(n)])
    inner = rs.flat(
        (N,),
        [(i % 8, 64 * i + 7, 64 * (i + 1) + 7, 0) for i in range(n - 1)]
        + [(9, 0, 7, 0), (9, N - 57, N, 7)],
    )
    t0 = time.perf_counter()
    tl = rs.nest(outer, {100: inner})
    assert time.perf_counter() - t0 < 3
    assert len(tl) == 2 * n


def test_split_into_many_blocks_of_distinct_sizes_is_linear():
    """Strides were set once per distinct block size over all blocks: 30000 distinct sizes
    took 3.6 s, 60000 about 14 s."""
    import time

    from reshard.layout.values import row_major

    k = 60000
    sizes = list(range(k))  # block 0 is empty
    t0 = time.perf_counter()
    tl = rs.split((sum(sizes), 3, 0, 2), 0, sizes, [i % 8 for i in range(k)])
    assert time.perf_counter() - t0 < 3
    for i in (0, 1, 2, k // 2, k - 1):
        p = tl.piece(i)
        assert p.shape == (sizes[i], 3, 0, 2) and p.strides == row_major(p.shape)


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


# -- unpickling -----------------------------------------------------------------------------------


class _Pickled:
    """Pickles as an object of `cls` made by `cls.__new__(cls, *args)` and given `state`: the
    bytes pickle writes for one, with whatever fields a tampered or stale pickle holds."""

    def __init__(self, cls, state=None, args=()):
        self.cls, self.state, self.args = cls, state, args

    @property
    def __class__(self):  # what pickle checks a __newobj__ object's class against
        return self.cls

    def __reduce__(self):
        return copyreg.__newobj__, (self.cls, *self.args), self.state


def _storage(numel=4, dtype=torch.float32, rank=0):
    """A pickled Storage with these fields, whatever they are."""
    return _Pickled(rs.Storage, {"rank": rank, "dtype": dtype, "numel": numel})


def _halves():
    """The state of a TensorLayout of shape (8,) in two pieces of 4, on locations 0 and 1."""
    return rs.split((8,), 0, [4, 4], [0, 1]).__getstate__()


# what a tampered Layout pickle says, and the error it gets
TAMPERED = {
    "gap": r"tensor of shape \(8,\): gap: element \(4,\) is in no piece",
    "negative offset": r"piece 1 Piece\(location=1, offset=-4.*: negative storage offset",
    "outside": r"piece 1 .*: outside the tensor \(start\+shape exceeds \(8,\)\)",
    "float offsets": r"PieceTable offset must be integers, got dtype float64",
    "negative dim": r"TensorLayout.shape has a negative dim",
    "storage too small": r"piece 1 .*: storage out of range: touches element 3 of location 1",
    "unknown location": r"piece 1 .*: unknown location 1",
    "negative numel": r"Storage numel must be >= 0, got -4",
    "unknown dtype": r"unknown dtype 'float33'",
}


def _tampered(what) -> dict:
    """The state of a pickled Layout (tensor 'w': `_halves()`) whose bytes say `what`."""
    shape, cols, name = _halves()
    cols = [np.array(a) for a in cols]
    storages = {0: _storage(), 1: _storage()}
    if what == "gap":
        cols = [a[:1] for a in cols]
    elif what == "negative offset":
        cols[1][1] = -4
    elif what == "outside":
        cols[2][1] = 6
    elif what == "float offsets":
        cols[1] = cols[1] + 0.5
    elif what == "negative dim":
        shape = (-8,)
    elif what == "storage too small":
        storages[1] = _storage(numel=3)
    elif what == "unknown location":
        del storages[1]
    elif what == "negative numel":
        storages[1] = _storage(numel=-4)
    elif what == "unknown dtype":
        storages[1] = _storage(dtype="float33")
    return {"tensors": {"w": (shape, tuple(cols), name)}, "storages": storages}


@pytest.mark.parametrize("tensor_as", ["state", "object"])
@pytest.mark.parametrize("what", list(TAMPERED))
def test_an_unpickled_layout_runs_the_constructors_checks(what, tensor_as):
    """Unpickling restored whatever the bytes said: a gap, a negative offset, a piece outside
    its tensor or its storage, a storage of -4 elements were all accepted (a gap in a source
    layout was planned, and the transfer left target elements unwritten and reported
    success). Now every check of the constructors runs. The tensor as this version pickles
    it (its state) and as older versions did (a TensorLayout)."""
    state = _tampered(what)
    if tensor_as == "object":
        state["tensors"] = {"w": _Pickled(rs.TensorLayout, state["tensors"]["w"])}
    blob = pickle.dumps(_Pickled(rs.Layout, state))
    with pytest.raises(rs.LayoutError, match=TAMPERED[what]) as err:
        pickle.loads(blob)
    if what == "gap" and tensor_as == "state":  # the layout names the unnamed tensor
        assert str(err.value).startswith("layout tensor 'w': ")


def test_unpickled_parts_of_a_layout_run_their_checks():
    shape, cols, name = _halves()
    bad = [np.array(a) for a in cols]
    bad[2][1] = -1
    cases = [
        (_Pickled(rs.TensorLayout, (shape, tuple(bad), name)), "piece 1 .*: negative start"),
        (_Pickled(rs.TensorLayout, (shape, tuple(bad[:4]), name)), "4 piece arrays, expected 5"),
        (_Pickled(rs.TensorLayout, [shape, cols, name]), "expected the state \\(shape, the 5"),
        (
            _Pickled(rs.layout.PieceTable, args=[a.astype(float) for a in cols]),
            "location must be integers",
        ),
        (
            _Pickled(rs.layout.PieceTable, args=cols[:2] + (cols[2][:, 0],) + cols[3:]),
            "start must be a \\[pieces, dims\\] array",
        ),
        (
            _Pickled(
                rs.Piece,
                {"location": 0, "offset": 0, "start": (0, 0), "shape": (4,), "strides": (1,)},
            ),
            "start \\(0, 0\\) and shape \\(4,\\) have different lengths",
        ),
        (_storage(rank=-1), "rank must be >= 0"),
        (
            _Pickled(rs.Storage, {"rank": 0, "numel": 4}),
            "expected the fields \\['rank', 'dtype', 'numel'\\]",
        ),
        (_Pickled(rs.Layout, [{}, {}]), "unpickled Layout: expected the state"),
    ]
    for obj, match in cases:
        with pytest.raises(rs.LayoutError, match=match):
            pickle.loads(pickle.dumps(obj))
    table = pickle.loads(pickle.dumps(rs.split((4, 6), 1, [2, 4], [0, 1]).table))
    assert all(a.dtype == np.int64 and not a.flags.writeable for a in table)


def test_pickle_round_trips_keep_layouts_equal():
    lay = rs.Layout(
        {
            "w": rs.flat((6, 5), [(0, 0, 13, 0), (1, 13, 30, 0)]),
            "c": rs.split((4, 6), 1, [2, 4], [[0, 1], 1], offsets=[[13, 0], 17]),
            "r": rs.replicated((3,), [0, 1]),
            "e": rs.TensorLayout((0, 3), []),
            "s": rs.TensorLayout((), [rs.Piece(1, 41, (), ())]),
        },
        {0: S(0, 21), 1: S(1, 42)},
    )
    for again in (pickle.loads(pickle.dumps(lay)), copy.deepcopy(lay)):
        assert again == lay and list(again.tensors) == list(lay.tensors)
        assert all(not a.flags.writeable for tl in again.tensors.values() for a in tl.table)


def _random_table(rng, shape) -> list:
    """Piece columns for `shape`: a flat builder's ranges, a grid of blocks (pieces that are
    no row-major runs), or boxes at random; then maybe spoiled: a piece dropped, doubled or
    shifted, a footprint near 2**53."""
    d, numel = len(shape), int(np.prod(shape))
    kind = int(rng.integers(0, 3))
    if kind == 0 and numel:
        cuts = np.sort(rng.integers(0, numel + 1, size=int(rng.integers(0, 4))))
        bounds = [0, *cuts.tolist(), numel]
        runs = [(0, a, b, 0) for a, b in zip(bounds, bounds[1:])]
        cols = [np.array(a) for a in rs.flat(shape, runs).table]
    elif kind == 1 and d:
        axes = [np.unique([0, n, *rng.integers(0, n + 1, size=2)]) for n in shape]
        lo = np.array(np.meshgrid(*[a[:-1] for a in axes], indexing="ij")).reshape(d, -1).T
        box = np.array(np.meshgrid(*[a[1:] for a in axes], indexing="ij")).reshape(d, -1).T - lo
        n = len(lo)
        cols = [np.zeros(n, int), np.zeros(n, int), lo, box, np.ones((n, d), int)]
    else:
        n = int(rng.integers(0, 6))
        lo = rng.integers(-1 if rng.random() < 0.1 else 0, np.array(shape) + 1, size=(n, d))
        box = rng.integers(0, np.array(shape) + 2 - np.maximum(lo, 0), size=(n, d))
        if rng.random() < 0.3 and n:  # a whole replica
            lo[0], box[0] = 0, shape
        off = rng.integers(-1 if rng.random() < 0.1 else 0, 3, size=n)
        cols = [np.zeros(n, int), off, lo, box, np.ones((n, d), int)]
    if len(cols[0]) and rng.random() < 0.3:
        cols = [np.delete(a, int(rng.integers(0, len(cols[0]))), axis=0) for a in cols]
    if len(cols[0]) and rng.random() < 0.2:
        cols = [np.concatenate([a, a[int(rng.integers(0, len(a))) :][:1]]) for a in cols]
    if len(cols[0]) and d and rng.random() < 0.2:
        cols[2][0, int(rng.integers(0, d))] += int(rng.integers(-1, 2))
    if len(cols[0]) and rng.random() < 0.15:  # a negative field the cover would not show
        field = int(rng.integers(0, 4 if d else 2))
        if field < 2:
            cols[field][0] = -1
        else:
            cols[2 if field == 2 else 4][0, 0] = -1
            cols[3][0, 0] += field == 2
    if len(cols[0]) and d and rng.random() < 0.1:
        cols[4][0, 0], cols[1][0] = 2**51, rng.choice([0, 2**53 - 2**51 * (cols[3][0, 0] - 1)])
    return cols


@pytest.mark.parametrize("seed", range(100))
def test_batched_piece_checks_match_the_checks_of_each_tensor(seed):
    """check_tensors (a Layout's unpickling) raises what check_pieces raises for the first
    tensor it refuses, and nothing when it refuses none: random tables of 0 to 3 dims
    (`_random_table`), several per call."""
    from reshard.layout.pieces import TensorLayout, check_pieces, check_tensors

    rng = np.random.default_rng(seed)
    tls = []
    for _ in range(int(rng.integers(1, 12))):
        d = int(rng.integers(0, 4))
        shape = tuple(int(x) for x in rng.integers(0 if rng.random() < 0.1 else 1, 5, size=d))
        cols = _random_table(rng, shape)
        tls.append(TensorLayout._restored((shape, tuple(cols), None)))
    want = None
    for tl in tls:
        try:
            check_pieces(tl, check_cover=True)
        except rs.LayoutError as exc:
            want = str(exc)
            break
    try:
        check_tensors(tls)
        got = None
    except rs.LayoutError as exc:
        got = str(exc)
    assert got == want


@pytest.mark.parametrize(
    "shape, starts, boxes, gap",
    [
        ((2, 2), [[0, 0], [1, 0]], [[2, 1], [1, 2]], (0, 1)),
        ((2, 2, 2), [[0, 0, 0], [1, 0, 0]], [[2, 2, 1], [1, 2, 2]], (0, 0, 1)),
    ],
)
def test_batched_piece_checks_take_no_block_for_a_run(shape, starts, boxes, gap):
    """Column 0 of a 2 x 2 tensor holds as many elements as its first two in row-major order,
    and its last row the last two, yet element (0, 1) is in neither (in 3-D: the blocks
    [:, :, :1] and [1]): only runs of the row-major order are compared as ranges."""
    from reshard.layout.pieces import TensorLayout, check_tensors

    n, d = len(starts), len(shape)
    cols = (np.zeros(n, int), np.arange(n) * 4, np.array(starts), np.array(boxes))
    tl = TensorLayout._restored((shape, (*cols, np.ones((n, d), int)), "w"))
    with pytest.raises(rs.LayoutError, match=re.escape(f"tensor 'w': gap: element {gap}")):
        check_tensors([tl])


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


@pytest.mark.parametrize("seed", range(40))
def test_gap_search_matches_brute_force(seed):
    # random boxes (replicas, nesting, partial overlaps) in up to 3 dims: the first element the
    # search names is covered by no box, and it names none exactly when every element is covered
    from reshard.layout.pieces import find_gap

    rng = np.random.default_rng(seed)
    d = int(rng.integers(1, 4))
    shape = tuple(int(x) for x in rng.integers(1, 6, size=d))
    n = int(rng.integers(0, 12))
    lo = (rng.random((n, d)) * shape).astype(np.int64)
    hi = lo + 1 + (rng.random((n, d)) * (np.array(shape) - lo)).astype(np.int64)
    hi = np.minimum(hi, shape)
    if seed % 4 == 0 and n:  # cover everything but maybe one element, with a few more boxes
        lo = np.concatenate([lo, np.zeros((1, d), np.int64)])
        hi = np.concatenate([hi, np.array([shape], np.int64)])
        hi[-1, 0] -= seed % 8 == 0
    cov = np.zeros(shape, bool)
    for a, b in zip(lo, hi):
        cov[tuple(slice(x, y) for x, y in zip(a, b))] = True
    gap = find_gap(shape, lo.reshape(-1, d), hi.reshape(-1, d))
    if cov.all():
        assert gap is None
    else:
        assert gap is not None and not cov[gap]


def test_gap_search_of_many_hand_built_row_pieces_is_linear():
    """A 2-D tensor given as one Piece per row: the search held a slabs x pieces matrix
    (16000 pieces: 256 MB and 4 s; 30000 took 14 s). Now about the pieces' cost."""
    import time

    n = 30000
    pieces = [rs.Piece(i % 4, 2 * (i // 4), (i, 0), (1, 2)) for i in range(n)]
    t0 = time.perf_counter()
    tl = rs.TensorLayout((n, 2), pieces)
    assert time.perf_counter() - t0 < 3 and len(tl) == n
    with pytest.raises(rs.LayoutError, match=r"gap: element \(12345, 0\)"):
        rs.TensorLayout((n, 2), pieces[:12345] + pieces[12346:], name="w")


def test_gap_search_refuses_pieces_nested_too_deep():
    # 6000 nested boxes (box i spans rows i .. 2n-i, one column of two): the (piece, slab)
    # pairs grow quadratically; refused with a LayoutError instead of gigabytes
    n = 6000
    pieces = [rs.Piece(0, 0, (i, 0), (2 * (n - i), 1), (1, 1)) for i in range(n)]
    pieces.append(rs.Piece(0, 0, (0, 1), (2 * n, 1), (1, 1)))
    with pytest.raises(rs.LayoutError, match="tensor 'w': 6001 pieces overlap too deeply"):
        rs.TensorLayout((2 * n, 2), pieces, name="w")


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
    # what is not a sequence where a sequence belongs: a LayoutError naming it
    for call, what in [
        (lambda: rs.split((4,), 0, [4], 0), "split locations must be a sequence"),
        (lambda: rs.split((4,), 0, [4], None), "split locations must be a sequence"),
        (lambda: rs.split((4,), 0, [4], [0], offsets=3), "split offsets must be a sequence"),
        (lambda: rs.split((4,), 0, [4], [(0, (1,))]), "split location must be an integer"),
        (lambda: rs.flat((3,), None), "flat runs must be a sequence"),
        (lambda: rs.flat((3,), 7), "flat runs must be a sequence"),
        (lambda: rs.TensorLayout((2,), None), "pieces must be a sequence"),
    ]:
        with pytest.raises(rs.LayoutError, match=what):
            call()
    runs = (r for r in [(0, 0, 3, 0)])  # an iterable that is no list works
    assert rs.flat((3,), runs).shape == (3,)


def test_a_layout_is_read_only_and_dtypes_come_in_every_spelling():
    """A plan keeps its layouts and fingerprints what they held: editing one afterwards would
    run a transfer other than the one the ranks agreed on."""
    layout = rs.Layout({"w": rs.replicated((4,), [0])}, {0: S(0, 4)})
    with pytest.raises(TypeError):
        layout.tensors["w"] = rs.replicated((4,), [1])
    with pytest.raises(TypeError):
        layout.storages[1] = S(1, 4)
    back = pickle.loads(pickle.dumps(layout))
    assert back == layout
    assert rs.Layout(layout.tensors, layout.storages) == layout  # a layout's parts build one
    with pytest.raises(TypeError):
        back.tensors["v"] = rs.replicated((4,), [0])
    other = rs.Layout({"v": rs.replicated((8,), [1])}, {1: S(1, 8)})
    for attr in ("tensors", "storages", "_tensors", "anything"):
        with pytest.raises(AttributeError, match="Layout is immutable"):
            setattr(layout, attr, getattr(other, attr, None))
        with pytest.raises(AttributeError, match="Layout is immutable"):
            delattr(layout, attr)
    assert layout == back and copy.deepcopy(layout) == layout
    with pytest.raises(rs.LayoutError, match=r"torch.qint8 is quantized.*int_repr"):
        rs.Storage(0, torch.qint8, 4)
    for spelling in (torch.float32, "float32", np.dtype("float32"), np.float32):
        assert rs.Storage(0, spelling, 4).dtype == torch.float32


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
    for inner in (None, [rs.flat((6,), [(0, 0, 6, 0)])]):
        with pytest.raises(rs.LayoutError, match="nest inner must be a mapping"):
            rs.nest(outer, inner)


def test_nest_of_a_split_with_an_empty_block_moves_the_data():
    """An uneven TP split whose last block is empty, each shard ZeRO-partitioned: the empty
    block's piece kept the virtual location 10, so the Layout refused 'unknown location 10'."""
    outer = rs.split((4, 3), 0, [4, 0], [9, 10])
    inner = {9: rs.flat((12,), [(1, 0, 5, 0), (2, 5, 12, 0)]), 10: rs.flat((0,), [])}
    tl = rs.nest(outer, inner)
    assert {p.location for p in tl.pieces} == {1, 2}
    dst = rs.Layout(
        {"w": tl}, {1: rs.Storage(0, torch.float32, 5), 2: rs.Storage(0, torch.float32, 7)}
    )
    src = rs.Layout({"w": rs.replicated((4, 3), [0])}, {0: rs.Storage(0, torch.float32, 12)})
    full = torch.arange(12.0) * 3 - 5
    out = {1: torch.full((5,), -7.0), 2: torch.full((7,), -7.0)}
    rs.execute(rs.plan(src, dst), {0: full}, out)
    assert torch.equal(out[1], full[:5]) and torch.equal(out[2], full[5:])


@pytest.mark.parametrize("key", ["9", True, 9.0])
def test_nest_inner_keys_must_be_locations(key):
    """A key that is no location was matched by dict equality or missed: "9" left location 9
    unnested (its virtual storage then stood for a real one), True nested location 1."""
    inner = {key: rs.flat((6,), [(0, 0, 6, 0)])}
    for outer in (rs.replicated((2, 3), [9]), rs.replicated((2, 3), [1])):
        with pytest.raises(rs.LayoutError, match="nest inner location must be an integer"):
            rs.nest(outer, inner)
    # numpy ints are locations like any int
    tl = rs.nest(rs.replicated((2, 3), [9]), {np.int64(9): rs.flat((6,), [(0, 0, 6, 2)])})
    assert tl.pieces == (rs.Piece(0, 2, (0, 0), (2, 3)),)


def test_unordered_containers_are_no_sequences():
    """A set's iteration order (or a dict's keys) silently stood for the order meant: split's
    blocks went to the locations in the set's order ({1, 0}: block 0 to location 0)."""
    bad = [
        lambda: rs.split((4,), 0, [2, 2], {1, 0}),
        lambda: rs.split((4,), 0, [2, 2], [{1, 2}, 0]),
        lambda: rs.split((4,), 0, [2, 2], [[1, 2], 0], offsets=[{0, 4}, 0]),
        lambda: rs.split((4,), 0, [2, 2], [{1: 0}, 0]),
        lambda: rs.Piece(0, 0, {1, 0}, (2, 3)),
        lambda: rs.Piece(0, 0, (0, 0), {3: 1, 2: 1}),
        lambda: rs.TensorLayout((3,), {rs.Piece(0, 0, (0,), (3,)): "x"}),
        lambda: rs.split((4,), 0, [2, 2], [torch.tensor(1.0), 0]),  # 0-d: was a torch TypeError
    ]
    for make in bad:
        with pytest.raises(rs.LayoutError, match="must be a sequence"):
            make()
    # integers of any kind, one per block or a sequence of replicas, are fine
    tl = rs.split((4,), 0, [2, 2], [torch.tensor(1), np.array([2, 3])], offsets=[np.int64(4), 0])
    assert [(p.location, p.offset, p.start) for p in tl.pieces] == [
        (1, 4, (0,)),
        (2, 0, (2,)),
        (3, 0, (2,)),
    ]
    assert tl == rs.split((4,), 0, [2, 2], [1, [2, 3]], offsets=[4, 0])
    # a dict's keys() view is ordered: a sequence
    by_block = {5: "block 0", 4: "block 1"}
    assert [p.location for p in rs.split((4,), 0, [2, 2], by_block.keys()).pieces] == [5, 4]


def test_aliasing_check_bounds_a_cluster_of_interleaved_pieces(monkeypatch):
    """Column pieces of a row-major buffer interleave: the check expands every piece of the
    cluster into rows. Each piece was bounded, the cluster was not (10000 x 10000: 10**8 rows,
    ~10 GB). Refused above MAX_EXPAND_ROWS rows in all; below it, checked as before."""
    from reshard.layout import aliasing

    monkeypatch.setattr(aliasing, "MAX_EXPAND_ROWS", 64 * 31)
    R, C = 64, 32
    tl = rs.TensorLayout((R, C), [rs.Piece(0, j, (0, j), (R, 1), (C, 1)) for j in range(C)])
    src = rs.Layout({"w": rs.replicated((R, C), [5])}, {5: S(0, R * C)})
    with pytest.raises(
        rs.LayoutError,
        match=r"and 31 more target pieces interleave in location 0: too many to verify they "
        r"alias nothing \(2048 contiguous rows, more than 1984\)",
    ):
        rs.plan(src, rs.Layout({"w": tl}, {0: S(1, R * C)}))
    tl = rs.TensorLayout((R, C - 1), [rs.Piece(0, j, (0, j), (R, 1), (C, 1)) for j in range(C - 1)])
    src = rs.Layout({"w": rs.replicated((R, C - 1), [5])}, {5: S(0, R * C)})
    assert rs.plan(src, rs.Layout({"w": tl}, {0: S(1, R * C)})).num_rounds == 1


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


# -- integers beyond int64 and extents beyond the geometry's limit -----------------------------

HUGE = [2**64, 2**63, -(2**63) - 1, -(2**64)]


@pytest.mark.parametrize("x", HUGE)
def test_huge_ints_are_layout_errors(x):
    """Integers that do not fit int64 are refused as LayoutError in every field, by name."""
    cases = [
        lambda: rs.Piece(x, 0, (0,), (1,)),
        lambda: rs.Piece(0, x, (0,), (1,)),
        lambda: rs.Piece(0, 0, (x,), (1,)),
        lambda: rs.Piece(0, 0, (0,), (x,)),
        lambda: rs.Piece(0, 0, (0,), (1,), (x,)),
        lambda: rs.Storage(x, torch.float32, 1),
        lambda: rs.Storage(0, torch.float32, x),
        lambda: rs.TensorLayout((x,), []),
        lambda: rs.replicated((x, 2), [0]),
        lambda: rs.replicated((2,), [x]),
        lambda: rs.split((4,), 0, [2, 2], [0, x]),
        lambda: rs.split((4,), 0, [2, 2], [0, 1], offsets=[0, x]),
        lambda: rs.split((4,), x, [4], [0]),
        lambda: rs.flat((4,), [(0, 0, 4, x)]),
        lambda: rs.flat((4,), [(x, 0, 4, 0)]),
        lambda: rs.flat((x,), [(0, 0, 4, 0)]),
        lambda: rs.Layout({}, {x: S(0, 1)}),
    ]
    if x > 0:  # a uint64 table of runs is taken as is by flat(); its values are checked
        big = min(x, 2**64 - 1)
        cases.append(lambda: rs.flat((4,), np.array([[0, 0, 4, big]], np.uint64)))
    for i, make in enumerate(cases):
        with pytest.raises(rs.LayoutError) as info:
            make()
        assert "int64" in str(info.value) or "2**53" in str(info.value), (i, info.value)


def test_piece_extent_beyond_int64_is_refused_naming_the_piece():
    # offset + sum(stride * (shape - 1)) wraps int64: refused where the layout is built, so no
    # later step (planning, preflight, a kernel mid-copy) meets the piece
    for strides, offset in (((2**62,), 0), ((1,), 2**63 - 2), ((2**61, 2**61), 2**62)):
        shape = (3,) * len(strides)
        with pytest.raises(rs.LayoutError, match=r"tensor 'w': piece 0 Piece\(.*reaches storage"):
            rs.TensorLayout(
                shape, [rs.Piece(0, offset, (0,) * len(shape), shape, strides)], name="w"
            )
    # start + shape wrapping around int64 is outside the tensor, not inside it
    with pytest.raises(rs.LayoutError, match="outside the tensor"):
        rs.TensorLayout((4,), [rs.Piece(0, 0, (0,), (4,)), rs.Piece(0, 0, (2**62,), (2**62,))])
    # a huge stride on a dim of extent 1 addresses nothing and is fine; empty pieces too
    tl = rs.TensorLayout((1, 4), [rs.Piece(0, 0, (0, 0), (1, 4), (2**63 - 1, 1))])
    rs.Layout({"w": tl}, {0: S(0, 4)})
    rs.TensorLayout((0,), [rs.Piece(0, 2**62, (0,), (0,), (2**62,))])


def test_elements_beyond_2_53_are_refused():
    with pytest.raises(rs.LayoutError, match=r"more than 2\*\*53 elements"):
        rs.TensorLayout((2**27, 2**27), [])
    with pytest.raises(rs.LayoutError, match=r"more than 2\*\*53 elements"):
        rs.flat((2**30, 0, 2**30), [])  # zero dims included: strides of the others overflow
    with pytest.raises(rs.LayoutError, match=r"negative dim"):
        rs.TensorLayout((-1,), [])
    with pytest.raises(rs.LayoutError, match=r"Storage numel .* exceeds 2\*\*53"):
        S(0, 2**53 + 1)
    with pytest.raises(rs.LayoutError, match=r"more than 2\*\*53"):
        rs.Layout({}, {0: S(0, 2**52), 1: S(1, 2**52), 2: S(1, 1)})
    rs.Layout({}, {0: S(0, 2**52), 1: S(1, 2**52)})
    # a piece reaching element 2**53 fits int64 but not the geometry's limit
    with pytest.raises(rs.LayoutError, match="reaches storage element 9007199254740992"):
        rs.TensorLayout((2,), [rs.Piece(0, 2**53 - 1, (0,), (2,))])


def test_nest_with_a_huge_stride_on_an_extent_1_dim():
    # outer: one row of a (1, 4) box whose row stride is huge (never used); inner: stride 2**40
    outer = rs.TensorLayout((1, 4), [rs.Piece(9, 0, (0, 0), (1, 4), (2**62, 1))])
    inner = {9: rs.TensorLayout((4,), [rs.Piece(1, 0, (0,), (4,), (2**40,))])}
    tl = rs.nest(outer, inner)
    assert element_map(tl) == {i: [(1, i * 2**40)] for i in range(4)}


@st.composite
def hostile_piece(draw):
    """Fields drawn near the edges that matter: 0, small, 2**53, 2**62, int64's end."""
    edge = st.sampled_from([0, 1, 2, 3, 2**31, 2**53 - 2, 2**53, 2**62, 2**63 - 1])
    d = draw(st.integers(1, 3))
    box = tuple(draw(st.sampled_from([0, 1, 2, 3, 2**26, 2**40])) for _ in range(d))
    strides = tuple(draw(edge) for _ in range(d))
    return box, strides, draw(edge)


@settings(max_examples=300, deadline=None)
@given(st.lists(hostile_piece(), min_size=1, max_size=3), st.sampled_from([2**20, 2**53]))
def test_property_hostile_extents_are_refused_or_fit(pieces, numel):
    """Whatever the fields, a layout is either refused with LayoutError or every piece's
    storage footprint, computed exactly in Python ints, lies inside its storage."""
    tls = []
    for i, (box, strides, offset) in enumerate(pieces):
        try:
            tl = rs.TensorLayout(box, [rs.Piece(i, offset, (0,) * len(box), box, strides)])
            tls.append(rs.Layout({"w": tl}, {i: S(0, numel)}))
        except rs.LayoutError:
            continue
        p = tl.pieces[0]
        if all(p.shape):
            hi = p.offset + sum(s * (n - 1) for s, n in zip(p.strides, p.shape))
            assert hi < numel


# -- the public table and the interval utility ---------------------------------------------------


def test_piece_table_is_public_and_read_only():
    tl = rs.split((4, 6), 1, [2, 4], [[3, 4], 5], name="w")
    t = tl.table
    assert isinstance(t, rs.layout.PieceTable) and len(tl) == 3
    np.testing.assert_array_equal(t.location, [3, 4, 5])
    np.testing.assert_array_equal(t.shape, [[4, 2], [4, 2], [4, 4]])
    np.testing.assert_array_equal(t.strides, [[2, 1], [2, 1], [4, 1]])
    for a in t:
        assert a.dtype == np.int64 and not a.flags.writeable
        with pytest.raises(ValueError):
            a[...] = 0
    again = rs.TensorLayout.from_table(tl.shape, t, name="w", covered=True)
    assert again == tl and again.pieces == tl.pieces
    with pytest.raises(rs.LayoutError, match="gap"):
        rs.TensorLayout.from_table((4, 6), rs.layout.PieceTable.of(2, *(a[:1] for a in t)))
    assert rs.layout.as_dtype("bf16") is torch.bfloat16


def test_a_table_that_claims_to_cover_is_checked_all_the_same():
    # covered=True on a table with a gap was trusted: planned, the target's elements 2 and 3
    # were never written and the plan said success
    t = rs.layout.PieceTable.of(1, [0], [0], [[0]], [[2]], [[1]])
    with pytest.raises(rs.LayoutError, match=r"gap: element \(2,\)"):
        rs.TensorLayout.from_table((4,), t, covered=True)
    with pytest.raises(rs.LayoutError, match="more than 2\\*\\*53 elements"):
        rs.TensorLayout.from_table((1 << 40, 1 << 40), rs.layout.PieceTable.empty(2), covered=True)
    with pytest.raises(rs.LayoutError, match="shape must be an integer, got 4.0"):
        rs.TensorLayout.from_table(
            (4.0,), rs.layout.PieceTable.of(1, [0], [0], [[0]], [[4]], [[1]])
        )


@pytest.mark.parametrize(
    "cols, match",
    [
        (([0], [0.5], [[0]], [[4]], [[1]]), "offset must be integers, got dtype float64"),
        (([0.0], [0], [[0]], [[4]], [[1]]), "location must be integers"),
        (([True], [0], [[0]], [[4]], [[1]]), "location must be integers, got dtype bool"),
        (([0], [0], [[0.9]], [[4]], [[1]]), "start must be integers"),
        (([0], [np.uint64(1 << 63)], [[0]], [[4]], [[1]]), "does not fit in int64"),
        (([0], [0], [[0, 0]], [[4]], [[1]]), "start has 2 entries, 1 pieces of 1 dims need 1"),
    ],
)
def test_piece_table_takes_integers_only(cols, match):
    # a float offset or location was truncated (0.5 -> 0, a float location to another storage)
    with pytest.raises(rs.LayoutError, match=match):
        rs.layout.PieceTable.of(1, *cols)


def brute_overlaps(iv):
    """Element sets of half-open intervals, and whether any two share an element."""
    seen, dup = set(), False
    for lo, hi in iv:
        cells = set(range(lo, hi))
        dup |= bool(seen & cells)
        seen |= cells
    return seen, dup


intervals = st.lists(
    st.tuples(st.integers(0, 40), st.integers(1, 8)).map(lambda t: (t[0], t[0] + t[1])),
    max_size=12,
)


@settings(max_examples=300, deadline=None)
@given(intervals, intervals)
def test_interval_utility_against_brute_force(a, b):
    from reshard.layout import intervals as iv

    arr = lambda x: np.array(x, np.int64).reshape(-1, 2)  # noqa: E731
    ma, mb = iv.merge(arr(a)), iv.merge(arr(b))
    cells_a, dup_a = brute_overlaps(a)
    cells_b, _ = brute_overlaps(b)
    # merged: sorted, disjoint, not touching, the same elements
    assert brute_overlaps(ma.tolist())[0] == cells_a
    assert (ma[1:, 0] > ma[:-1, 1]).all()
    hit = iv.first_overlap(ma, mb)
    assert (hit is None) == (not cells_a & cells_b)
    if hit is not None:
        assert set(range(*hit)) <= cells_a & cells_b and hit[1] > hit[0]
    rows = iv.overlapping_rows(arr(a)[:, 0], arr(a)[:, 1] - arr(a)[:, 0])
    assert (rows is not None) == dup_a
    if rows is not None:
        (lo1, hi1), (lo2, hi2) = a[rows[0]], a[rows[1]]
        assert rows[0] != rows[1] and max(lo1, lo2) < min(hi1, hi2)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2**52)), max_size=30))
def test_segmented_cummax_against_brute_force(pairs):
    from reshard.layout import intervals as iv

    pairs.sort(key=lambda p: p[0])
    key = np.array([p[0] for p in pairs], np.int64)
    x = np.array([p[1] for p in pairs], np.int64)
    want, run = [], {}
    for k, v in pairs:
        run[k] = max(run.get(k, v), v)
        want.append(run[k])
    assert iv.segmented_cummax(x, key).tolist() == want


def _built_or_error(build):
    """(the TensorLayouts `build()` returns, or the type and message of what it raises)."""
    try:
        return build()
    except Exception as exc:  # noqa: BLE001 - compared, whatever it is
        return (type(exc), str(exc))


def _same_tables(a, b):
    if isinstance(a, tuple) or isinstance(b, tuple):  # errors
        assert a == b
        return
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.shape == y.shape and x.name == y.name
        for cx, cy in zip(x.table, y.table):
            assert cx.dtype == cy.dtype and cx.shape == cy.shape and np.array_equal(cx, cy)
            assert not cx.flags.writeable and cx.flags.c_contiguous


def _zero_runs(rng, numel, world, offset):
    part = -(-numel // world)
    return [
        (r, r * part, min(numel, r * part + part), offset) for r in range(world) if r * part < numel
    ]


_BAD_RUNS = [
    [(0, 0, 5, -1)],  # negative offset
    [(-1, 0, 5, 0)],  # negative location
    [(0, 3, 2, 0)],  # start past stop
    [(0, 0, 10**6, 0)],  # beyond the tensor
    [(0, 0, 2, 0)],  # a gap
    [(0, 0, 5, 0), (1, 3, 7, 0)],  # overlap: replicas, no error unless a gap
    [(True, 0, 5, 0)],  # a bool
    [(np.int64(0), 0, 5, 0)],  # a numpy int: the checked path
    [(0.0, 0, 5, 0)],  # a float
    [(0, 0, 5, 2**64)],  # beyond int64
    [(0, 0, 5, 2**53 - 2)],  # the footprint past 2**53
    [(0, 0, 5)],  # a short row
    [(0, 0, 5, 0, 1)],  # a long row
    [[0, 0, 5, 0]],  # a list row
    np.array([[0, 0, 5, 0]]),  # an array
    [],  # no runs
    "runs",
]


@settings(deadline=None, max_examples=60)
@given(st.data())
def test_flat_batch_is_flat_per_tensor(data):
    """flat_batch gives flat's TensorLayouts, table for table (dtype, layout, read-only), and
    flat's first error, for ZeRO runs mixed with every kind of odd or bad entry."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    shapes, runs, names = [], [], []
    for i in range(data.draw(st.integers(0, 12))):
        shape = tuple(int(x) for x in rng.integers(0, 5, size=rng.integers(0, 4)))
        numel = int(np.prod(shape)) if shape else 1
        kind = rng.integers(0, 4)
        if kind == 3 and numel >= 5:
            r = _BAD_RUNS[rng.integers(0, len(_BAD_RUNS))]
        elif kind == 2:  # shuffled or with empty runs: tiled or not, a gap or not
            r = _zero_runs(rng, numel, int(rng.integers(1, 6)), int(rng.integers(0, 9)))
            r = [r[j] for j in rng.permutation(len(r))] + [(7, 0, 0, 3)]
        else:
            r = _zero_runs(rng, numel, int(rng.integers(1, 6)), int(rng.integers(0, 9)))
        shapes.append(shape)
        runs.append(r)
        names.append(f"t{i}" if rng.integers(0, 2) else None)
    want = _built_or_error(lambda: [rs.flat(s, r, name=n) for s, r, n in zip(shapes, runs, names)])
    got = _built_or_error(lambda: rs.layout.flat_batch(shapes, runs, names=names))
    _same_tables(got, want)


def test_flat_batch_bad_shape_and_lengths():
    """A bad shape raises flat's error, an earlier tensor's own error first."""
    with pytest.raises(rs.LayoutError, match="flat shape has a negative dim"):
        rs.layout.flat_batch([(4,), (-1,)], [[(0, 0, 4, 0)], []])
    with pytest.raises(rs.LayoutError, match="flat run 0 .*negative storage offset"):
        rs.layout.flat_batch([(4,), (-1,)], [[(0, 0, 4, -1)], []])
    with pytest.raises(rs.LayoutError, match="2 shapes, 1 runs and 2 names"):
        rs.layout.flat_batch([(4,), (4,)], [[(0, 0, 4, 0)]])


def test_flat_batch_zero3_tables():
    """A ZeRO-3 placement of many tensors over 64 ranks, batched, equals flat per tensor."""
    rng = np.random.default_rng(5)
    shapes = [
        tuple(int(x) for x in rng.integers(1, 90, size=rng.integers(1, 4))) for _ in range(300)
    ]
    runs, offset = [], 0
    for s in shapes:
        numel = int(np.prod(s))
        runs.append(_zero_runs(rng, numel, 64, offset))
        offset += -(-numel // 64)
    _same_tables(rs.layout.flat_batch(shapes, runs), [rs.flat(s, r) for s, r in zip(shapes, runs)])
