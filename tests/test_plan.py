"""Planner tests: every rank's schedule is simulated in-process with plain torch/numpy
indexing (pack segments into byte arenas, deliver message bytes, unpack, local copies) and
compared with an independent element-by-element map built from the layouts. The wire dtype
each segment must travel in comes from the brute-force reference planner
(tests/distributed/_refplan.py), not from the code under test."""

from __future__ import annotations

import copy
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import reshard as rs
from reshard.planning import intersect, wire_dtype

sys.path.insert(0, str(Path(__file__).parent / "distributed"))
import _refplan  # noqa: E402

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
SIXTEEN = (torch.bfloat16, torch.float16)

# Every value below is exact in float32, bfloat16 and float16 (at most 8 significant bits,
# within float16's normal range), so whatever cast chain a value takes it arrives bit for bit
# unchanged: a wrong wire dtype or a misplaced element shows as a wrong value, not a rounding.
EXACT16 = np.unique([s * m * 2.0**e for s in (1, -1) for m in range(1, 256) for e in range(-14, 8)])
EXACT16 = EXACT16[np.random.default_rng(0).permutation(len(EXACT16))]


# -- independent reference ----------------------------------------------------------------


def piece_map(tl):
    """Yield (location, storage elements, logical flat indices) for every non-empty piece."""
    for p in tl.pieces:
        if any(n == 0 for n in p.shape):
            continue
        if not p.shape:
            yield p.location, np.array([p.offset]), np.array([0])
            continue
        rel = np.indices(p.shape).reshape(len(p.shape), -1)
        off = p.offset + sum(s * r for s, r in zip(p.strides, rel))
        flat = np.ravel_multi_index(tuple(r + s for r, s in zip(rel, p.start)), tl.shape)
        yield p.location, off, flat


def logical_values(t, flat, exact16):
    """The value of element `flat` of tensor `t`: unique integers (exact in float32 and the
    integer dtypes) or, when a 16-bit dtype takes part, EXACT16 values (neighbours differ)."""
    if exact16:
        return EXACT16[(t * 1009 + np.asarray(flat)) % len(EXACT16)]
    flat = np.asarray(flat, np.int64)
    assert t < 2048 and (flat < 8192).all(), "unique values exact in float32 need < 2**24"
    return ((t << 13) + flat).astype(np.float64)


def tensor_ids(layout, names):
    """(id, name) of the tensors that have elements, ids counted among those only."""
    return enumerate(n for n in names if layout.tensors[n].numel)


def uses_16bit(*layouts):
    return any(s.dtype in SIXTEEN for lay in layouts for s in lay.storages.values())


def poison(dtype):
    """What an unwritten target element holds: never a value of logical_values."""
    return float("inf") if dtype.is_floating_point else -12345.0


def fill_sources(layout, names, exact16=False):
    """Storages holding each tensor's logical value in every replica; float padding holds NaN
    and integer padding negative values, so a read of padding shows in the target."""
    bufs = {}
    for loc, s in layout.storages.items():
        pad = np.full(s.numel, np.nan) if s.dtype.is_floating_point else -1.0 - np.arange(s.numel)
        bufs[loc] = torch.from_numpy(pad).to(s.dtype)
    for t, name in tensor_ids(layout, names):
        for loc, off, flat in piece_map(layout.tensors[name]):
            vals = torch.from_numpy(logical_values(t, flat, exact16))
            bufs[loc][torch.from_numpy(off)] = vals.to(bufs[loc].dtype)
    return bufs


def expected_targets(layout, names, exact16=False):
    """{loc: expected values (float64; NaN where nothing is written)} from the target layout."""
    exp = {loc: np.full(s.numel, np.nan) for loc, s in layout.storages.items()}
    for t, name in tensor_ids(layout, names):
        for loc, off, flat in piece_map(layout.tensors[name]):
            assert np.isnan(exp[loc][off]).all(), "reference: target aliasing"
            assert len(np.unique(off)) == len(off), "reference: target aliasing"
            exp[loc][off] = logical_values(t, flat, exact16)
    return exp


# -- in-process execution of every rank's schedule --------------------------------------------


def desc_index(desc):
    """(src indices, dst indices) of a descriptor table, element by element, row by row."""
    d = np.asarray(desc, np.int64).reshape(-1, 6)
    assert (d >= 0).all(), desc
    so, ss, do, ds, ln, cnt = d.T
    n = ln * cnt
    row = np.repeat(np.arange(len(d)), n)
    k = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
    c, j = k // ln[row], k % ln[row]
    return so[row] + c * ss[row] + j, do[row] + c * ds[row] + j


def apply_desc(src, desc, dst, written=None):
    si, di = desc_index(desc)
    if not len(si):
        return
    assert si.max() < src.numel() and di.max() < dst.numel()
    assert len(np.unique(di)) == len(di), "a desc writes one element twice"
    dst[torch.from_numpy(di)] = src[torch.from_numpy(si)].to(dst.dtype)
    if written is not None:
        np.add.at(written, di, 1)


def simulate(plan, src_layout, dst_layout, src_bufs):
    """Run every rank's schedule; return the target storages and per-element write counts."""
    dst_bufs = {
        loc: torch.full((s.numel,), poison(s.dtype), dtype=torch.float64).to(s.dtype)
        for loc, s in dst_layout.storages.items()
    }
    written = {loc: np.zeros(s.numel, np.int64) for loc, s in dst_layout.storages.items()}
    src_before = {k: v.clone() for k, v in src_bufs.items()}
    ranks = plan.ranks()
    scheds = {r: plan.schedule(r) for r in ranks}
    budget = plan.budget_bytes_per_peer
    for r, sc in scheds.items():
        assert sc.rank == r and sc.num_rounds == plan.num_rounds
        assert len(sc.sends) == len(sc.recvs) == plan.num_rounds
        for lc in sc.local:
            assert src_layout.storages[lc.src_location].rank == r
            assert dst_layout.storages[lc.dst_location].rank == r
            apply_desc(
                src_bufs[lc.src_location],
                lc.desc,
                dst_bufs[lc.dst_location],
                written[lc.dst_location],
            )
        st = plan.staging_bytes(r, transport="gloo")
        assert st["host"] == min(2, plan.num_rounds) * (sc.send_arena_bytes + sc.recv_arena_bytes)
        assert plan.staging_bytes(r)["device"] == st["host"]
    for k in range(plan.num_rounds):
        arenas = {}
        for r, sc in scheds.items():
            arena = torch.full((sc.send_arena_bytes,), 0xAB, dtype=torch.uint8)
            check_messages(sc.sends[k], sc.send_arena_bytes, budget, k)
            for msg in sc.sends[k]:
                for seg in msg.segments:
                    assert src_layout.storages[seg.src_location].rank == r
                    assert dst_layout.storages[seg.dst_location].rank == msg.peer
                    assert seg.wire_dtype == _refplan.wire_dtype(
                        src_layout.storages[seg.src_location].dtype,
                        dst_layout.storages[seg.dst_location].dtype,
                    )
                    lo = msg.arena_offset + seg.byte_offset
                    view = arena[lo : lo + seg.numel * seg.wire_dtype.itemsize].view(seg.wire_dtype)
                    si, di = desc_index(seg.desc)
                    assert sorted(di.tolist()) == list(range(seg.numel)), "segment not filled"
                    apply_desc(src_bufs[seg.src_location], seg.desc, view)
            arenas[r] = arena
        for r, sc in scheds.items():
            check_messages(sc.recvs[k], sc.recv_arena_bytes, budget, k)
            rarena = torch.full((sc.recv_arena_bytes,), 0xCD, dtype=torch.uint8)
            for msg in sc.recvs[k]:
                peer = scheds[msg.peer]
                (smsg,) = [m for m in peer.sends[k] if m.peer == r]
                assert smsg.nbytes == msg.nbytes
                assert [
                    (s.src_location, s.dst_location, s.wire_dtype, s.byte_offset, s.numel)
                    for s in smsg.segments
                ] == [
                    (s.src_location, s.dst_location, s.wire_dtype, s.byte_offset, s.numel)
                    for s in msg.segments
                ]
                rarena[msg.arena_offset : msg.arena_offset + msg.nbytes] = arenas[msg.peer][
                    smsg.arena_offset : smsg.arena_offset + smsg.nbytes
                ]
                for seg in msg.segments:
                    lo = msg.arena_offset + seg.byte_offset
                    view = rarena[lo : lo + seg.numel * seg.wire_dtype.itemsize].view(
                        seg.wire_dtype
                    )
                    si, di = desc_index(seg.desc)
                    assert sorted(si.tolist()) == list(range(seg.numel))
                    apply_desc(
                        view, seg.desc, dst_bufs[seg.dst_location], written[seg.dst_location]
                    )
            # every message this rank receives was sent to it, and vice versa
            senders = sorted(m.peer for m in sc.recvs[k])
            assert senders == sorted(
                p for p, s in scheds.items() if any(m.peer == r for m in s.sends[k])
            )
    for loc, buf in src_bufs.items():
        # bitwise (padding is NaN)
        assert bits(buf) == bits(src_before[loc]), f"source storage {loc} was written"
    return dst_bufs, written


def bits(t):
    return t.reshape(-1).contiguous().view(torch.uint8).tolist() if t.numel() else []


def check_messages(msgs, arena_bytes, budget, k):
    spans = []
    for msg in msgs:
        assert msg.round == k
        assert 0 < msg.nbytes <= budget
        assert msg.arena_offset % 16 == 0
        assert msg.arena_offset + msg.nbytes <= arena_bytes
        spans.append((msg.arena_offset, msg.arena_offset + msg.nbytes))
        end = 0
        for seg in msg.segments:
            assert seg.byte_offset % 16 == 0 and seg.byte_offset >= end
            end = seg.byte_offset + seg.numel * seg.wire_dtype.itemsize
            assert seg.numel > 0 and end <= msg.nbytes
    spans.sort()
    for (_, a1), (b0, _) in zip(spans, spans[1:]):
        assert a1 <= b0, "messages overlap in the arena"


def check_plan(src, dst, budget=64 << 20, **plan_kw):
    names = sorted(dst.tensors)
    p = rs.plan(src, dst, budget_bytes_per_peer=budget, **plan_kw)
    exact16 = uses_16bit(src, dst)
    out, written = simulate(p, src, dst, fill_sources(src, names, exact16))
    for loc, e in expected_targets(dst, names, exact16).items():
        got = out[loc].to(torch.float64).numpy()
        cov = ~np.isnan(e)
        assert (written[loc][cov] == 1).all(), f"target {loc}: element not written exactly once"
        assert (written[loc][~cov] == 0).all(), f"target {loc}: padding written"
        # every value is exact in every dtype involved: the target holds it bit for bit
        np.testing.assert_array_equal(got[cov], e[cov], err_msg=f"target storage {loc}")
        assert (got[~cov] == poison(dst.storages[loc].dtype)).all()
    return p


# -- layout builders ----------------------------------------------------------------------------


class Alloc:
    """Hands out storage locations; remembers rank, dtype and extent of each."""

    def __init__(self, world, dtype=torch.float32):
        self.world, self.dtype, self.store = world, dtype, {}

    def new(self, rank, numel, dtype=None):
        loc = len(self.store) * 3 + 1  # sparse ids: locations need not be dense
        self.store[loc] = [rank, dtype or self.dtype, numel]
        return loc

    def grow(self, loc, numel):
        self.store[loc][2] = max(self.store[loc][2], numel)

    def storages(self):
        return {loc: rs.Storage(r, d, n) for loc, (r, d, n) in self.store.items()}


def build(draw, alloc, shapes, kind):
    """One Layout for `shapes` of the given kind; returns {name: TensorLayout}."""
    W = alloc.world
    out = {}
    if kind == "zero12":
        # one flat group: tensors back to back with alignment padding, the padded buffer
        # split evenly over the ranks
        align = draw(st.sampled_from([1, 2, 4]))
        bases, pos = [], 0
        for shp in shapes.values():
            pos = -(-pos // align) * align
            bases.append(pos)
            pos += int(np.prod(shp))
        part = max(1, -(-pos // W) + draw(st.integers(0, 2)))
        locs = [alloc.new(r, part) for r in range(W)]
        for (name, shp), base in zip(shapes.items(), bases):
            n = int(np.prod(shp))
            runs = []
            for r in range(W):
                lo, hi = max(base, r * part), min(base + n, (r + 1) * part)
                if lo < hi:
                    runs.append((locs[r], lo - base, hi - base, lo - r * part))
            out[name] = rs.flat(shp, runs, name=name)
        return out
    if kind == "zero3":
        # every tensor padded to a multiple of the world, rank r holds partition r
        locs = {}
        used = [0] * W
        for name, shp in shapes.items():
            n = int(np.prod(shp))
            part = -(-n // W) if n else 0
            runs = []
            for r in range(W):
                lo, hi = r * part, min(n, (r + 1) * part)
                if r not in locs:
                    locs[r] = alloc.new(r, 0)
                if lo < hi:
                    runs.append((locs[r], lo, hi, used[r]))
                used[r] += part + draw(st.integers(0, 1))
                alloc.grow(locs[r], used[r])
            out[name] = rs.flat(shp, runs, name=name)
        return out
    if kind == "fused":
        # tensors with the same leading dims share one wider buffer as column blocks (a fused
        # gate_up / qkv buffer): strided pieces whose rows interleave in storage
        groups = {}
        for name, shp in shapes.items():
            if len(shp) and int(np.prod(shp)):
                groups.setdefault(shp[:-1], []).append(name)
            else:
                out[name] = tensor_layout(draw, alloc, name, shp, "replicated")
        for lead, names in groups.items():
            widths = [shapes[n][-1] for n in names]
            width = sum(widths) + draw(st.integers(0, 2))
            strides = _rowmajor((*lead, width))
            numel = int(np.prod(lead)) * width
            locs = [
                alloc.new(draw(st.integers(0, W - 1)), numel)
                for _ in range(draw(st.integers(1, 2)))
            ]
            col = 0
            for n, w in zip(names, widths):
                shp = shapes[n]
                out[n] = rs.TensorLayout(
                    shp, [rs.Piece(loc, col, (0,) * len(shp), shp, strides) for loc in locs], name=n
                )
                col += w
        return out
    for name, shp in shapes.items():
        out[name] = tensor_layout(draw, alloc, name, shp, kind)
    return out


def uneven(draw, n, parts):
    cuts = sorted(draw(st.lists(st.integers(0, n), min_size=parts - 1, max_size=parts - 1)))
    edges = [0, *cuts, n]
    return [b - a for a, b in zip(edges, edges[1:])]


def tensor_layout(draw, alloc, name, shp, kind):
    W = alloc.world
    d = len(shp)
    n = int(np.prod(shp))
    rank = st.integers(0, W - 1)
    if kind == "replicated" or d == 0:
        k = draw(st.integers(1, 3))
        locs = [alloc.new(draw(rank), n + draw(st.integers(0, 2))) for _ in range(k)]
        return rs.replicated(shp, locs, name=name)
    if kind in ("split", "nested"):
        dim = draw(st.integers(0, d - 1))
        parts = draw(st.integers(1, 4))
        sizes = uneven(draw, shp[dim], parts)
        groups = []
        for s in sizes:
            pn = n // shp[dim] * s if shp[dim] else 0
            reps = draw(st.integers(1, 2))
            groups.append(
                [alloc.new(draw(rank), pn + draw(st.integers(0, 1))) for _ in range(reps)]
            )
        tl = rs.split(shp, dim, sizes, groups, name=name)
        if kind == "split":
            return tl
        # every holder of the split is itself ZeRO-partitioned over a few real storages
        inner = {}
        for p in tl.pieces:
            v = alloc.store[p.location][2]
            w = draw(st.integers(1, 3))
            part = -(-v // w) if v else 0
            runs = []
            for i in range(w):
                lo, hi = i * part, min(v, (i + 1) * part)
                if lo < hi:
                    pad = draw(st.integers(0, 1))
                    runs.append((alloc.new(draw(rank), hi - lo + pad), lo, hi, pad))
            inner[p.location] = rs.flat((v,), runs) if v else rs.replicated((0,), [p.location])
        return rs.nest(tl, inner, name=name)
    if kind == "mixed":
        # two differently shaped copies at once (a split and a flat partition): replicas
        # that overlap only partly
        if n == 0:
            return tensor_layout(draw, alloc, name, shp, "replicated")
        a = tensor_layout(draw, alloc, name, shp, "split")
        cut = draw(st.integers(0, n))
        runs = [
            (alloc.new(draw(rank), cut), 0, cut, 0),
            (alloc.new(draw(rank), n - cut), cut, n, 0),
        ]
        return rs.TensorLayout(shp, [a, rs.flat(shp, [r for r in runs if r[1] < r[2]])], name=name)
    if kind == "chunks":
        # a fine-grained partition: the flat tensor cut into many runs, each on its own
        # storage on a random rank, some runs replicated
        if n == 0:
            return tensor_layout(draw, alloc, name, shp, "replicated")
        cuts = draw(st.lists(st.integers(1, max(n - 1, 1)), max_size=min(n - 1, 40)))
        edges = sorted({0, n, *cuts})
        runs = []
        for a, b in zip(edges, edges[1:]):
            for _ in range(draw(st.integers(1, 2))):
                pad = draw(st.integers(0, 2))
                runs.append((alloc.new(draw(rank), b - a + pad), a, b, pad))
        return rs.flat(shp, runs, name=name)
    if kind == "transposed":
        # the whole tensor stored with reversed dim order (strides of the transpose)
        rev = _rowmajor(shp[::-1])[::-1]
        loc = alloc.new(draw(rank), n)
        return rs.TensorLayout(shp, [rs.Piece(loc, 0, (0,) * d, shp, rev)], name=name)
    raise AssertionError(kind)


def _rowmajor(shape):
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(out))


@st.composite
def shapes_st(draw, max_tensors=3, big=False):
    """Tensor shapes: a few elements each, or (big) up to a few thousand elements."""
    k = draw(st.integers(1, max_tensors))
    out = {}
    for i in range(k):
        if big:
            d = draw(st.integers(1, 3))
            top = {1: [4096], 2: [48, 96], 3: [8, 16, 40]}[d]
            out[f"t{i}"] = tuple(draw(st.integers(1, m)) for m in top)
        else:
            d = draw(st.integers(0, 3))
            out[f"t{i}"] = tuple(draw(st.integers(0 if d else 1, 6)) for _ in range(d))
    return out


KINDS = [
    "zero12",
    "zero3",
    "replicated",
    "split",
    "nested",
    "transposed",
    "fused",
    "mixed",
    "chunks",
]
FLOATS = [torch.float32, torch.bfloat16, torch.float16]


@st.composite
def layout_pair(draw, big=False):
    shapes = draw(shapes_st(big=big))
    layouts = []
    same = draw(st.booleans())
    dtypes = [torch.float32] * 2 if same else [draw(st.sampled_from(FLOATS)) for _ in range(2)]
    for i in range(2):
        alloc = Alloc(draw(st.integers(1, 8 if big else 4)), dtypes[i])
        kind = draw(st.sampled_from(KINDS))
        tens = build(draw, alloc, shapes, kind)
        layouts.append(rs.Layout(tens, alloc.storages()))
    budgets = [64, 1000, 4096, 1 << 20] if big else [16, 17, 48, 100, 4096]
    budget = draw(st.sampled_from(budgets))
    return layouts[0], layouts[1], budget


# -- tests --------------------------------------------------------------------------------------


@settings(max_examples=150, **SETTINGS)
@given(layout_pair())
def test_property_plan_executes_to_reference(case):
    src, dst, budget = case
    check_plan(src, dst, budget)


@settings(max_examples=30, **SETTINGS)
@given(layout_pair(big=True))
def test_property_large_tensors_many_pieces_execute_to_reference(case):
    src, dst, budget = case
    check_plan(src, dst, budget)


@settings(max_examples=60, **SETTINGS)
@given(layout_pair(), st.integers(16, 4096))
def test_property_rank_budget_caps_every_rank(case, rank_budget):
    """budget_bytes_per_rank: every rank's staging bound stays within it, and the plan it
    yields still executes to the reference; a cap too small for the peer count is refused."""
    src, dst, _ = case
    try:
        p = check_plan(src, dst, 64 << 20, budget_bytes_per_rank=rank_budget)
    except ValueError as exc:
        assert "too small for this plan" in str(exc) and "peers" in str(exc)
        return
    assert p.budget_bytes_per_rank == rank_budget
    assert p.budget_bytes_per_peer % 16 == 0 and p.budget_bytes_per_peer >= 16
    for r in p.ranks():
        assert p.staging_bytes(r, transport="gloo")["host"] <= rank_budget
        assert p.staging_bytes(r, transport="nccl")["device"] <= rank_budget


def test_rank_budget_divides_among_peers():
    # rank 0 sends to 4 peers and receives from none: 2 * 4 = 8 per-peer shares of the cap
    shp = (64, 64)
    src = rs.Layout({"w": rs.replicated(shp, [0])}, {0: S(0, 64 * 64)})
    dst = rs.Layout(
        {"w": rs.split(shp, 0, [16] * 4, [1, 2, 3, 4])},
        {i: S(i, 16 * 64) for i in range(1, 5)},
    )
    p = rs.plan(src, dst, budget_bytes_per_rank=8 * 1000)
    assert p.budget_bytes_per_peer == 992  # floor16(8000 / 8)
    assert p.staging_bytes(0, transport="gloo")["host"] <= 8000
    assert "/rank" in p.describe()
    assert rs.plan(src, dst, 512, budget_bytes_per_rank=1 << 30).budget_bytes_per_peer == 512
    with pytest.raises(ValueError, match="rank 0 exchanges messages with 4 peers"):
        rs.plan(src, dst, budget_bytes_per_rank=100)
    with pytest.raises(ValueError, match="budget_bytes_per_rank must be an int"):
        rs.plan(src, dst, budget_bytes_per_rank=1.5)


# -- explicit cases -------------------------------------------------------------------------


def S(rank, numel, dtype=torch.float32):
    return rs.Storage(rank, dtype, numel)


def test_tp_split_of_inner_dim_is_one_strided_run_per_piece():
    shp = (64, 48)
    src = rs.Layout({"w": rs.replicated(shp, [0])}, {0: S(0, 64 * 48)})
    dst = rs.Layout(
        {"w": rs.split(shp, 1, [16, 16, 16], [1, 2, 3])},
        {1: S(1, 64 * 16), 2: S(2, 64 * 16), 3: S(3, 64 * 16)},
    )
    p = check_plan(src, dst)
    assert len(p.runs) == 3
    for _, _, ss, _, _, ds, ln, cnt in p.runs.tolist():
        assert (ss, ds, ln, cnt) == (48, 16, 16, 64)


def test_zero3_to_tp_column_split_chains_rows_across_partition_heads():
    # partitions start mid-row; head/tail rows chain into the strided runs
    shp = (10, 12)
    runs = [(r, r * 40, min(120, (r + 1) * 40), 0) for r in range(3)]
    src = rs.Layout({"w": rs.flat(shp, runs)}, {r: S(r, 40) for r in range(3)})
    dst = rs.Layout(
        {"w": rs.split(shp, 1, [5, 7], [[10, 11], [12, 13]])},
        {10: S(0, 50), 11: S(1, 50), 12: S(0, 70), 13: S(2, 70)},
    )
    p = check_plan(src, dst, budget=32)
    assert p.num_rounds > 1


def test_single_process_transpose_and_fused_target():
    shp = (6, 5)
    src = rs.Layout(
        {"a": rs.replicated(shp, [0]), "b": rs.replicated(shp, [1])}, {0: S(0, 30), 1: S(0, 30)}
    )
    # target: a stored transposed, b stored as the right half of a fused (6, 10) buffer
    dst = rs.Layout(
        {
            "a": rs.TensorLayout(shp, [rs.Piece(5, 0, (0, 0), shp, (1, 6))]),
            "b": rs.TensorLayout(shp, [rs.Piece(6, 5, (0, 0), shp, (10, 1))]),
        },
        {5: S(0, 30), 6: S(0, 60)},
    )
    p = check_plan(src, dst)
    assert p.num_rounds == 0 and p.schedule(0).local


def test_local_replica_is_read_first():
    shp = (8, 8)
    src = rs.Layout({"w": rs.replicated(shp, [0, 1, 2, 3])}, {i: S(i, 64) for i in range(4)})
    dst = rs.Layout(
        {"w": rs.split(shp, 0, [2, 2, 2, 2], [10, 11, 12, 13])},
        {10 + i: S(i, 16) for i in range(4)},
    )
    p = check_plan(src, dst)
    assert p.num_rounds == 0 and not p.pair_bytes()
    assert all(len(p.schedule(r).local) == 1 for r in range(4))


def test_replicas_spread_the_sending_load():
    # 4 replicas of every tensor on ranks 0..3, every target on rank 4: no rank may funnel
    R, T, shp = 4, 40, (16, 8)
    names = {f"t{i}": shp for i in range(T)}
    tens, st_ = {}, {r: S(r, T * 128) for r in range(R)}
    for i, n in enumerate(names):
        tens[n] = rs.TensorLayout(shp, [rs.Piece(r, i * 128, (0, 0), shp) for r in range(R)])
    dtens = {
        n: rs.TensorLayout(shp, [rs.Piece(100, i * 128, (0, 0), shp)]) for i, n in enumerate(names)
    }
    p = rs.plan(rs.Layout(tens, st_), rs.Layout(dtens, {100: S(4, T * 128)}))
    sent = {}
    for (s, _), b in p.pair_bytes().items():
        sent[s] = sent.get(s, 0) + b
    total = T * 128 * 4
    assert sum(sent.values()) == total
    assert max(sent.values()) <= total / R * 1.05, sent


def _disjoint_regions_quadratic(tensors, r):
    """The obvious reference: each box minus every earlier box of its tensor, in order."""
    new = []
    claimed = {}
    for i in np.nonzero(np.isin(r.tensor, tensors))[0].tolist():
        t = int(r.tensor[i])
        parts = [(r.lo[i].tolist(), r.hi[i].tolist())]
        for clo, chi in claimed.setdefault(t, []):
            parts = [q for plo, phi in parts for q in intersect.box_minus(plo, phi, clo, chi)]
        claimed[t].append((r.lo[i].tolist(), r.hi[i].tolist()))
        new += [(t, plo, phi, int(r.first[i]), int(r.count[i])) for plo, phi in parts]
    return new


@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(
    dims=st.integers(1, 3),
    n=st.integers(1, 40),
    seed=st.integers(0, 2**31 - 1),
)
def test_disjoint_regions_equals_the_quadratic_reference(dims, n, seed):
    rng = np.random.default_rng(seed)
    tensor = rng.integers(0, 3, n)
    lo = rng.integers(0, 6, (n, dims))
    hi = lo + rng.integers(1, 5, (n, dims))
    r = intersect.Regions(tensor, lo, hi, np.arange(n), np.ones(n, np.int64), np.arange(n))
    bad = np.array([0, 2])
    got = intersect.disjoint_regions(bad, r)
    keep = ~np.isin(tensor, bad)
    assert np.array_equal(got.tensor[: keep.sum()], tensor[keep])
    m = keep.sum()
    rows = list(
        zip(
            got.tensor[m:].tolist(),
            got.lo[m:].tolist(),
            got.hi[m:].tolist(),
            got.first[m:].tolist(),
            got.count[m:].tolist(),
            strict=True,
        )
    )
    assert rows == [tuple(x) for x in _disjoint_regions_quadratic(bad, r)]


def test_many_partly_overlapping_replicas_plan_fast():
    """8000 replica pieces, each overlapping its neighbours by half: only overlapping pairs
    are subtracted (was quadratic: ~25 s here)."""
    import time

    N = 8000
    n = 2 * N + 2
    pieces = [rs.Piece(i % 4, 4 * (i // 4), (2 * i,), (4,)) for i in range(N)]
    sizes = [4 * ((N - r + 3) // 4) for r in range(4)]
    src = rs.Layout({"w": rs.TensorLayout((n,), pieces)}, {r: S(r, sizes[r]) for r in range(4)})
    dst = rs.Layout(
        {"w": rs.split((n,), 0, [n // 2, n // 2], [10, 11])}, {10: S(0, N + 1), 11: S(1, N + 1)}
    )
    t0 = time.perf_counter()
    p = rs.plan(src, dst)
    assert time.perf_counter() - t0 < 10
    assert sum(p.pair_bytes().values()) + sum(p.local_bytes().values()) == n * 4


def _zero_ranges(shape, n, ranks, loc0, shift=0):
    """ZeRO-style flat ranges of `shape` in `n` pieces over `ranks` storages (loc0 + r)."""
    numel = int(np.prod(shape))
    b = np.linspace(0, numel, n + 1).astype(np.int64)
    b[1:-1] += shift
    runs, used = [], [0] * ranks
    for i in range(n):
        runs.append((loc0 + i % ranks, int(b[i]), int(b[i + 1]), used[i % ranks]))
        used[i % ranks] += int(b[i + 1] - b[i])
    return rs.flat(shape, runs), {loc0 + r: S(r, used[r]) for r in range(ranks)}


@pytest.mark.parametrize("kind", ["one_row", "columns"])
def test_intersection_work_is_linear_in_pieces(kind, monkeypatch):
    """Pieces that all share their dim-0 range (ZeRO ranges of a (1, n) tensor, column blocks)
    made every source x target pair a candidate of the dim-0 sweep: 16000 pieces took 135 s
    and 21 GB to plan. The sweep key with the fewest candidates keeps it linear."""
    n = 3000
    if kind == "one_row":
        s, ss = _zero_ranges((1, 64 * n), n, 8, 0)
        d, ds = _zero_ranges((1, 64 * n), n, 8, 100, shift=7)
    else:
        s = rs.split(
            (8, n), 1, [1] * n, [r % 8 for r in range(n)], offsets=[8 * (r // 8) for r in range(n)]
        )
        d = rs.split(
            (8, n),
            1,
            [2] * (n // 2),
            [100 + r % 8 for r in range(n // 2)],
            offsets=[16 * (r // 8) for r in range(n // 2)],
        )
        ss = {r: S(r, 8 * (-(-n // 8))) for r in range(8)}
        ds = {100 + r: S((r + 3) % 8, 16 * (-(-n // 16))) for r in range(8)}
    src, dst = rs.Layout({"w": s}, ss), rs.Layout({"w": d}, ds)
    expanded = []
    real = intersect.expand

    def counting(counts):
        expanded.append(int(np.sum(counts)))
        return real(counts)

    monkeypatch.setattr(intersect, "expand", counting)
    p = rs.plan(src, dst)
    for r in range(8):
        p.schedule(r)
    assert max(expanded) <= 8 * n, f"{max(expanded)} candidate pairs for {n} pieces a side"
    numel = src.tensors["w"].numel
    assert sum(p.pair_bytes().values()) + sum(p.local_bytes().values()) == 4 * numel


@pytest.mark.parametrize("seed", range(24))
def test_intersect_finds_exactly_the_overlapping_pairs(seed):
    # random boxes of a few tensors of a few dims against a brute force, whatever key it picks
    rng = np.random.default_rng(seed)
    D, T = int(rng.integers(1, 4)), 3
    shape = rng.integers(1, 7, size=(T, D))
    shape[1] = 0 if seed % 3 == 0 else shape[1]  # an empty tensor takes no key range

    def boxes(n):
        ti = rng.choice([0, 2] if seed % 3 == 0 else [0, 1, 2], size=n)
        lo = (rng.random((n, D)) * shape[ti]).astype(np.int64)
        hi = lo + 1 + (rng.random((n, D)) * (shape[ti] - lo)).astype(np.int64)
        return ti, lo, np.minimum(hi, shape[ti])

    a, b = boxes(int(rng.integers(0, 40))), boxes(int(rng.integers(0, 40)))
    got = intersect.intersect(shape, *a, *b)
    pairs = {
        (i, j, tuple(x), tuple(y))
        for i, j, x, y in zip(got.a, got.b, got.lo.tolist(), got.hi.tolist())
    }
    want = set()
    for i in range(len(a[0])):
        for j in range(len(b[0])):
            lo, hi = np.maximum(a[1][i], b[1][j]), np.minimum(a[2][i], b[2][j])
            if a[0][i] == b[0][j] and (hi > lo).all():
                want.add((i, j, tuple(lo.tolist()), tuple(hi.tolist())))
    assert pairs == want and len(got.a) == len(want)
    # whichever key wins, every key must offer every overlapping pair as a candidate
    for keys in intersect._sweep_keys(shape, *a, *b):
        pa, pb = intersect._candidates(*keys).pairs()
        assert {(i, j) for i, j, _, _ in want} <= set(zip(pa.tolist(), pb.tolist()))


def test_a_budget_far_below_the_data_is_refused_up_front():
    """16 MiB at 16 bytes per round was 2**20 segments: 2.5 s to plan, 17 s and 1.5 GB for
    the sender's schedule (4 GiB would take hours). Refused at once, naming a budget that fits."""
    import time

    numel = 1 << 22
    src = rs.Layout({"w": rs.replicated((numel,), [0])}, {0: S(0, numel)})
    dst = rs.Layout({"w": rs.replicated((numel,), [1])}, {1: S(1, numel)})
    t0 = time.perf_counter()
    with pytest.raises(
        ValueError, match=r"budget_bytes_per_peer=16 is too small .* at least 64 bytes fits"
    ):
        rs.plan(src, dst, budget_bytes_per_peer=16)
    with pytest.raises(ValueError, match=r"budget_bytes_per_rank=64 leaves"):
        rs.plan(src, dst, budget_bytes_per_rank=64)
    assert time.perf_counter() - t0 < 2
    assert rs.plan(src, dst, budget_bytes_per_peer=64).num_rounds == numel * 4 // 64


def test_replica_partial_overlap_regions():
    # two source copies that overlap only partly, plus a third covering the rest
    shp = (6, 6)
    src = rs.Layout(
        {
            "w": rs.TensorLayout(
                shp,
                [
                    rs.Piece(0, 0, (0, 0), (4, 6)),
                    rs.Piece(1, 0, (2, 0), (4, 6)),
                    rs.Piece(2, 0, (0, 0), (6, 3), (3, 1)),
                ],
            )
        },
        {0: S(0, 24), 1: S(1, 24), 2: S(2, 18)},
    )
    dst = rs.Layout(
        {"w": rs.split(shp, 1, [1, 5], [[7, 8], 9])}, {7: S(3, 6), 8: S(1, 6), 9: S(0, 30)}
    )
    check_plan(src, dst, budget=16)


def test_budget_16_cuts_a_large_run_across_rounds():
    shp = (100,)
    src = rs.Layout({"w": rs.replicated(shp, [0])}, {0: S(0, 100)})
    dst = rs.Layout({"w": rs.replicated(shp, [1])}, {1: S(1, 100)})
    p = check_plan(src, dst, budget=16)
    assert len(p.runs) == 1 and p.num_rounds == 25  # 4 fp32 per 16-byte round
    assert p.schedule(0).send_arena_bytes == 16
    assert p.staging_bytes(0) == {"device": 32, "host_pinned": 0, "host": 0}
    assert p.staging_bytes(1, transport="gloo", host_ring_bytes=64) == {
        "device": 0,
        "host_pinned": 0,
        "host": 32,
    }
    assert p.staging_bytes(1, transport="nccl", host_ring_bytes=64)["host_pinned"] == 64
    with pytest.raises(ValueError, match=">= 16"):
        rs.plan(src, dst, budget_bytes_per_peer=15)
    with pytest.raises(ValueError, match="int"):
        rs.plan(src, dst, budget_bytes_per_peer=64.0)


def test_staging_formula_counts_all_peers_of_a_round():
    shp = (4, 32)
    src = rs.Layout({"w": rs.replicated(shp, [0])}, {0: S(0, 128)})
    dst = rs.Layout(
        {"w": rs.split(shp, 0, [1, 1, 2], [1, 2, 3])}, {1: S(1, 32), 2: S(2, 32), 3: S(3, 64)}
    )
    p = check_plan(src, dst, budget=200)  # rank 3 needs 256 bytes: two rounds
    sc = p.schedule(0)
    assert p.num_rounds == 2
    assert sc.send_arena_bytes == 128 + 128 + 192  # round 0: three peers, 192 = 200 floor 16
    assert p.staging_bytes(0)["device"] == 2 * (sc.send_arena_bytes + sc.recv_arena_bytes)
    assert p.schedule(3).recv_arena_bytes == 192


def test_wire_dtype_narrows_on_the_sender():
    shp = (8, 8)
    src = rs.Layout({"w": rs.replicated(shp, [0])}, {0: S(0, 64, torch.float32)})
    dst = rs.Layout({"w": rs.replicated(shp, [1])}, {1: S(1, 64, "bfloat16")})
    p = check_plan(src, dst)
    assert p.pair_bytes() == {(0, 1): 128}
    (msg,) = p.schedule(0).sends[0]
    assert msg.segments[0].wire_dtype == torch.bfloat16
    assert wire_dtype(torch.bfloat16, torch.float32) == torch.bfloat16
    assert wire_dtype(torch.float16, torch.bfloat16) == torch.bfloat16
    assert wire_dtype(torch.int32, torch.float32) is None


def test_integer_storages_copy_raw():
    shp = (3, 5)
    src = rs.Layout({"i": rs.replicated(shp, [0])}, {0: S(0, 15, torch.int64)})
    dst = rs.Layout(
        {"i": rs.split(shp, 1, [2, 3], [1, 2])}, {1: S(1, 6, torch.int64), 2: S(0, 9, torch.int64)}
    )
    check_plan(src, dst, budget=16)


def test_plan_errors():
    shp = (4, 4)
    src = rs.Layout({"w": rs.replicated(shp, [0])}, {0: S(0, 16, torch.int32)})
    dst = rs.Layout({"w": rs.replicated(shp, [1])}, {1: S(1, 16)})
    with pytest.raises(rs.LayoutError, match=r"tensor 'w': unsupported dtype pair.*int32"):
        rs.plan(src, dst)
    other = rs.Layout({"v": rs.replicated(shp, [1])}, {1: S(1, 16)})
    with pytest.raises(rs.LayoutError, match="target tensor 'v' has no source"):
        rs.plan(src, other)
    wrong = rs.Layout({"w": rs.replicated((16,), [1])}, {1: S(1, 16)})
    with pytest.raises(rs.LayoutError, match=r"tensor 'w': source shape \(4, 4\)"):
        rs.plan(src, wrong)
    with pytest.raises(rs.LayoutError, match="both must be reshard.Layout"):
        rs.plan(src, {"w": 1})


def test_subset_of_source_tensors():
    src = rs.Layout({"a": rs.replicated((3,), [0]), "b": rs.replicated((2,), [0])}, {0: S(0, 5)})
    dst = rs.Layout({"b": rs.replicated((2,), [1])}, {1: S(1, 2)})
    check_plan(src, dst)


def test_describe_and_fingerprint():
    shp = (16, 16)
    src = rs.Layout(
        {"w": rs.flat(shp, [(0, 0, 128, 0), (1, 128, 256, 0)])}, {0: S(0, 128), 1: S(1, 128)}
    )
    dst = rs.Layout(
        {"w": rs.split(shp, 1, [8, 8], [[2, 3], [4, 5]])},
        {2: S(0, 128), 3: S(1, 128), 4: S(0, 128), 5: S(1, 128)},
    )
    p = rs.plan(src, dst, budget_bytes_per_peer=256)
    text = p.describe()
    for want in ("rounds", "busiest sender: rank", "local", "0 -> 1", "1 -> 0", "staging"):
        assert want in text, text
    assert len(p.fingerprint) == 64
    again = rs.plan(pickle.loads(pickle.dumps(src)), pickle.loads(pickle.dumps(dst)), 256)
    assert again.fingerprint == p.fingerprint
    assert rs.plan(src, dst, 512).fingerprint != p.fingerprint
    assert rs.plan(dst, src, 256).fingerprint != p.fingerprint


_FP_SCRIPT = """
import hashlib, pickle, sys
import reshard as rs
src, dst = pickle.load(open(sys.argv[1], "rb"))
print(rs.plan(src, dst, budget_bytes_per_peer=64).fingerprint)
# each rank's schedule built alone, in a fresh plan: replica choice and stream order
for r in (0, 1, 2):
    sc = rs.plan(src, dst, budget_bytes_per_peer=64).schedule(r)
    h = hashlib.sha256()
    for lc in sc.local:
        h.update(repr((lc.src_location, lc.dst_location, lc.desc.tolist())).encode())
    for msgs in sc.sends + sc.recvs:
        for m in msgs:
            for s in m.segments:
                h.update(repr((m.peer, s.src_location, s.dst_location, s.desc.tolist())).encode())
    print(h.hexdigest())
"""


def test_fingerprint_equal_across_processes_and_hash_seeds(tmp_path):
    shp = (12, 10)
    src = rs.Layout(
        {
            "a": rs.flat(shp, [(r, r * 40, (r + 1) * 40, 3) for r in range(3)]),
            "b": rs.replicated((5,), [0, 1]),
        },
        {0: S(0, 50), 1: S(1, 50), 2: S(2, 50)},
    )
    dst = rs.Layout(
        {
            "a": rs.split(shp, 1, [3, 7], [[4, 5], 6]),
            "b": rs.split((5,), 0, [2, 3], [4, 6], offsets=[40, 84]),
        },
        {4: S(0, 60), 5: S(1, 40), 6: S(2, 90, "bf16")},
    )
    path = tmp_path / "layouts.pkl"
    path.write_bytes(pickle.dumps((src, dst)))
    here = subprocess.run(
        [sys.executable, "-c", _FP_SCRIPT, str(path)], capture_output=True, text=True, check=True
    ).stdout
    assert here.splitlines()[0] == rs.plan(src, dst, budget_bytes_per_peer=64).fingerprint
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run(
            [sys.executable, "-c", _FP_SCRIPT, str(path)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        assert out.stdout == here


def test_schedule_is_cached_and_covers_every_round():
    shp = (40,)
    src = rs.Layout({"w": rs.replicated(shp, [0])}, {0: S(0, 40)})
    dst = rs.Layout({"w": rs.split(shp, 0, [20, 20], [1, 2])}, {1: S(1, 20), 2: S(2, 20)})
    p = rs.plan(src, dst, budget_bytes_per_peer=32)
    assert p.schedule(0) is p.schedule(0)
    sc = p.schedule(0)
    assert [len(x) for x in sc.sends] == [2] * p.num_rounds
    assert p.schedule(7).sends == [[]] * p.num_rounds  # a rank with nothing to do


@pytest.mark.parametrize(
    "rank, error",
    [("0", TypeError), (True, TypeError), (1.0, TypeError), (None, TypeError), (-1, ValueError)],
)
def test_per_rank_methods_refuse_bad_ranks_alike(rank, error):
    """schedule and staging_bytes take the same ranks: a non-negative int (numpy ints too; a
    rank past the layout's owns nothing), never a string, bool or float read as one."""
    shp = (40,)
    src = rs.Layout({"w": rs.replicated(shp, [0])}, {0: S(0, 40)})
    dst = rs.Layout({"w": rs.split(shp, 0, [20, 20], [1, 2])}, {1: S(1, 20), 2: S(2, 20)})
    p = rs.plan(src, dst, budget_bytes_per_peer=32)
    for method in (p.schedule, p.staging_bytes):
        with pytest.raises(error, match="rank"):
            method(rank)
    assert p.staging_bytes(np.int64(0)) == p.staging_bytes(0)
    assert p.staging_bytes(0)["device"] > 0
    assert p.staging_bytes(7) == {"device": 0, "host_pinned": 0, "host": 0}
    assert p.schedule(np.int32(1)) is p.schedule(1)


@pytest.mark.parametrize(
    "ring, error", [(-1, ValueError), (1.5, TypeError), ("64", TypeError), (True, TypeError)]
)
def test_staging_bytes_refuses_a_ring_that_is_no_byte_count(ring, error):
    """A negative or fractional ring was added to the stated bound as given (-1 B of pinned
    memory, or 1.5 truncated to 1)."""
    shp = (40,)
    src = rs.Layout({"w": rs.replicated(shp, [0])}, {0: S(0, 40)})
    dst = rs.Layout({"w": rs.split(shp, 0, [20, 20], [1, 2])}, {1: S(1, 20), 2: S(2, 20)})
    p = rs.plan(src, dst, budget_bytes_per_peer=32)
    with pytest.raises(error, match="host_ring_bytes"):
        p.staging_bytes(0, host_ring_bytes=ring)
    assert p.staging_bytes(0, host_ring_bytes=np.int64(64))["host_pinned"] == 64


def test_execute_single_process_with_the_real_op():
    from reshard import _ops as ops

    shp = (9, 7)
    src = rs.Layout(
        {"w": rs.flat(shp, [(0, 0, 30, 2), (1, 30, 63, 0)])}, {0: S(0, 32), 1: S(0, 33)}
    )
    dst = rs.Layout(
        {"w": rs.split(shp, 1, [3, 4], [2, 3])},
        {2: S(0, 27, torch.bfloat16), 3: S(0, 36, torch.bfloat16)},
    )
    p = rs.plan(src, dst)
    assert p.num_rounds == 0
    full = torch.arange(63, dtype=torch.float32)
    sb = {0: torch.full((32,), -1.0), 1: torch.full((33,), -1.0)}
    sb[0][2:32] = full[:30]
    sb[1][:33] = full[30:]
    db = {
        2: torch.full((27,), float("nan"), dtype=torch.bfloat16),
        3: torch.full((36,), float("nan"), dtype=torch.bfloat16),
    }
    for lc in p.schedule(0).local:
        ops.copy_runs(sb[lc.src_location], torch.from_numpy(lc.desc), db[lc.dst_location])
    ref = full.reshape(shp).to(torch.bfloat16)
    assert torch.equal(db[2].reshape(9, 3), ref[:, :3])
    assert torch.equal(db[3].reshape(9, 4), ref[:, 3:])


@settings(max_examples=40, **SETTINGS)
@given(layout_pair())
def test_property_small_batches_match(case):
    # planning in many batches (a tensor or two each) must execute the same way
    src, dst, budget = case
    old = intersect.BATCH_PIECES
    intersect.BATCH_PIECES = 2
    try:
        check_plan(src, dst, budget)
    finally:
        intersect.BATCH_PIECES = old


def test_flat_group_to_flat_group_merges_across_tensors_and_batches(monkeypatch):
    # ZeRO-1/2 style: 30 tensors back to back, world 2 -> world 3; the runs of consecutive
    # tensors continue each other in both buffers and coalesce into a few long runs
    shapes = {f"t{i:02d}": (3, 5) for i in range(30)}

    def group(world):
        total = 15 * 30
        part = -(-total // world)
        tens = {}
        for i, name in enumerate(sorted(shapes)):
            base = 15 * i
            runs = [
                (
                    r,
                    max(base, r * part) - base,
                    min(base + 15, (r + 1) * part) - base,
                    max(base, r * part) - r * part,
                )
                for r in range(world)
                if max(base, r * part) < min(base + 15, (r + 1) * part)
            ]
            tens[name] = rs.flat((3, 5), runs)
        return rs.Layout(tens, {r: S(r, part) for r in range(world)})

    src, dst = group(2), group(3)
    one = check_plan(src, dst)
    monkeypatch.setattr(intersect, "BATCH_PIECES", 3)
    many = check_plan(src, dst)
    assert len(one.runs) == len(many.runs) == 4  # [0,150) [150,225) [225,300) [300,450)


# -- lazy per-rank planning -------------------------------------------------------------------


def _schedule_key(sc):
    """Everything a rank's schedule says, as plain data (desc tables included)."""
    local = [(lc.src_location, lc.dst_location, lc.desc.tolist()) for lc in sc.local]
    side = [
        [
            (
                m.peer,
                m.arena_offset,
                m.nbytes,
                [
                    (s.src_location, s.dst_location, str(s.wire_dtype), s.byte_offset, s.numel)
                    + (s.desc.tolist(),)
                    for s in m.segments
                ],
            )
            for m in msgs
        ]
        for msgs in sc.sends + sc.recvs
    ]
    return local, side, sc.send_arena_bytes, sc.recv_arena_bytes


@settings(max_examples=40, **SETTINGS)
@given(layout_pair())
def test_property_schedule_alone_equals_schedule_among_all(case):
    # one rank of a real job builds only its own schedule; it must be the one a process
    # that built every rank's runs (and materialized .runs) hands that rank
    src, dst, budget = case
    full = rs.plan(src, dst, budget_bytes_per_peer=budget)
    assert full.runs.shape[1] == 8  # every rank's runs built first
    every = {r: _schedule_key(full.schedule(r)) for r in full.ranks()}
    for r in full.ranks():
        alone = rs.plan(src, dst, budget_bytes_per_peer=budget)
        assert _schedule_key(alone.schedule(r)) == every[r]
        assert list(alone._cache) == [("schedule", r)]  # nothing beyond rank r built
        assert alone.fingerprint == full.fingerprint


def _streams(plan, rank, src_bufs, dst_expected, sender_side):
    """{(sender, receiver, src loc, dst loc): logical values in stream order} for one rank's
    side: what the sender reads for each segment position, or what the receiver's target
    slots must end up holding."""
    out = {}
    sc = plan.schedule(rank)
    for k in range(plan.num_rounds):
        for m in sc.sends[k] if sender_side else sc.recvs[k]:
            for seg in m.segments:
                si, di = desc_index(seg.desc)
                vals = np.empty(seg.numel)
                if sender_side:
                    vals[di] = src_bufs[seg.src_location][torch.from_numpy(si)].double().numpy()
                    key = (rank, m.peer)
                else:
                    vals[si] = dst_expected[seg.dst_location][di]
                    key = (m.peer, rank)
                out.setdefault(key + (seg.src_location, seg.dst_location), []).extend(vals)
    return out


@settings(max_examples=60, **SETTINGS)
@given(layout_pair())
def test_property_sender_and_receiver_agree_on_element_order(case):
    # each end builds its runs of a storage pair from different pieces (its own source
    # pieces x every target piece, or its own target pieces x every source piece); the
    # element sequence of the pair's stream must still be the same on both ends
    src, dst, budget = case
    names = sorted(dst.tensors)
    exact16 = uses_16bit(src, dst)
    src_bufs = {k: v.double() for k, v in fill_sources(src, names, exact16).items()}
    exp = expected_targets(dst, names, exact16)
    p = rs.plan(src, dst, budget_bytes_per_peer=budget)
    sent, recv = {}, {}
    for r in p.ranks():
        sent.update(_streams(p, r, src_bufs, exp, True))
        recv.update(_streams(p, r, src_bufs, exp, False))
    assert sent.keys() == recv.keys()
    for key in sent:
        assert sent[key] == recv[key], key


def test_fingerprint_does_not_depend_on_batching(monkeypatch):
    shapes = {f"t{i}": (4, 6) for i in range(12)}
    src = rs.Layout(
        {
            n: rs.flat(s, [(3 * i + r, r * 8, (r + 1) * 8, 0) for r in range(3)])
            for i, (n, s) in enumerate(shapes.items())
        },
        {3 * i + r: S(r, 8) for i in range(12) for r in range(3)},
    )
    dst = rs.Layout(
        {n: rs.split(s, 1, [3, 3], [2 * i, 2 * i + 1]) for i, (n, s) in enumerate(shapes.items())},
        {2 * i + t: S(t, 12) for i in range(12) for t in range(2)},
    )
    one = rs.plan(src, dst, budget_bytes_per_peer=64)
    monkeypatch.setattr(intersect, "BATCH_PIECES", 3)
    many = rs.plan(src, dst, budget_bytes_per_peer=64)
    assert one.fingerprint == many.fingerprint
    assert _schedule_key(one.schedule(1)) == _schedule_key(many.schedule(1))


def test_direct_tensors_keep_no_jobs_globally():
    # ZeRO-3 -> TP: every source element has one holder, so plan() keeps only totals per
    # storage pair; a replicated source keeps its (chosen) jobs, since the choice is global
    shp = (8, 12)
    zero3 = rs.Layout(
        {"w": rs.flat(shp, [(r, r * 24, (r + 1) * 24, 0) for r in range(4)])},
        {r: S(r, 24) for r in range(4)},
    )
    tp = rs.Layout(
        {"w": rs.split(shp, 1, [6, 6], [[10, 12], [11, 13]])},
        {10: S(0, 48), 11: S(1, 48), 12: S(2, 48), 13: S(3, 48)},
    )
    p = check_plan(zero3, tp, budget=64)
    assert p.replicated_jobs.count == 0 and "runs" not in p._cache
    rep = rs.Layout({"w": rs.replicated(shp, [0, 1])}, {0: S(0, 96), 1: S(1, 96)})
    p = check_plan(rep, tp, budget=64)
    assert p.replicated_jobs.count == 4  # one job per column block x two target replicas


# -- arithmetic at the edges: nothing may wrap around int64 ---------------------------------


def test_budgets_beyond_int64_are_value_errors():
    src = rs.Layout({"w": rs.replicated((4,), [0])}, {0: S(0, 4)})
    dst = rs.Layout({"w": rs.replicated((4,), [1])}, {1: S(1, 4)})
    for bad in (2**62, 2**63, 2**64):
        with pytest.raises(ValueError, match="budget_bytes_per_peer must be"):
            rs.plan(src, dst, budget_bytes_per_peer=bad)
        with pytest.raises(ValueError, match="budget_bytes_per_rank must be"):
            rs.plan(src, dst, budget_bytes_per_rank=bad)
    assert rs.plan(src, dst, budget_bytes_per_peer=2**62 - 1).num_rounds == 1


def test_an_unpickled_plan_stays_read_only():
    src = rs.Layout({"w": rs.replicated((64,), [0])}, {0: S(0, 64)})
    dst = rs.Layout({"w": rs.replicated((64,), [1])}, {1: S(1, 64)})
    p = rs.plan(src, dst, budget_bytes_per_peer=64)
    for q in (pickle.loads(pickle.dumps(p)), copy.deepcopy(p)):
        assert q.fingerprint == p.fingerprint
        assert not q.direct.flags.writeable
        assert not q.rounds.segment_rows.flags.writeable


def test_numpy_integer_budgets_plan_as_ints():
    """A budget read from an array (np.int64) is an int to the planner: the same plan and
    fingerprint; a numpy float is still refused."""
    src = rs.Layout({"w": rs.replicated((64,), [0])}, {0: S(0, 64)})
    dst = rs.Layout({"w": rs.replicated((64,), [1])}, {1: S(1, 64)})
    want = rs.plan(src, dst, budget_bytes_per_peer=64, budget_bytes_per_rank=1024)
    got = rs.plan(
        src, dst, budget_bytes_per_peer=np.int64(64), budget_bytes_per_rank=np.int32(1024)
    )
    assert got.fingerprint == want.fingerprint and got.num_rounds == want.num_rounds
    assert type(got.budget_bytes_per_peer) is int
    with pytest.raises(ValueError, match="must be an int"):
        rs.plan(src, dst, budget_bytes_per_peer=np.float64(64))


def test_ranks_anywhere_in_int64():
    # ranks are labels: a huge one must not size a table (replica balancing, peer counts)
    big = 2**62
    shp = (8, 8)
    src = rs.Layout({"w": rs.replicated(shp, [0, 1])}, {0: S(big, 64), 1: S(3, 64)})
    dst = rs.Layout({"w": rs.split(shp, 0, [4, 4], [2, 3])}, {2: S(big + 1, 32), 3: S(5, 32)})
    p = check_plan(src, dst, budget_bytes_per_rank=1 << 16)
    assert sorted(p.ranks()) == [3, 5, big, big + 1]
    assert sum(p.pair_bytes().values()) == 64 * 4


def test_empty_tensors_with_huge_dims_do_not_shift_the_others():
    # 2048 empty tensors of 2**53 rows between two real ones: with the first tensor's one
    # (padded) row their dim-0 extents add up to 2**64, which would wrap a sweep key built
    # from them onto the first tensor's keys
    empty = {f"e{i:04d}": (2**53 - (1 if i == 0 else 0), 0) for i in range(2048)}
    real = {"a": (4,), "z": (4,)}
    src_t = {n: rs.replicated(s, [0]) for n, s in empty.items()}
    src_t.update(a=rs.replicated((4,), [0]), z=rs.replicated((4,), [1]))
    dst_t = {n: rs.replicated(s, [2]) for n, s in empty.items()}
    dst_t.update(a=rs.replicated((4,), [2]), z=rs.replicated((4,), [3]))
    src = rs.Layout(src_t, {0: S(0, 4), 1: S(0, 4)})
    dst = rs.Layout(dst_t, {2: S(1, 4), 3: S(1, 4)})
    assert set(real) < set(dst.tensors)
    check_plan(src, dst)


def test_target_aliasing_check_with_many_storages_and_a_huge_one():
    # 2048 small target storages beside one of almost 2**53 elements: the aliasing sweep
    # must not wrap when it orders the footprints of every storage in one pass
    n, big = 2048, 2**53 - 2**16
    tens = {"big": rs.TensorLayout((4,), [rs.Piece(0, big - 4, (0,), (4,))])}
    tens.update({f"t{i:04d}": rs.replicated((4,), [i + 1]) for i in range(n)})
    storages = {0: S(0, big), **{i + 1: S(0, 4) for i in range(n)}}
    src = rs.Layout({k: rs.replicated((4,), [n + 5]) for k in tens}, {n + 5: S(0, 4)})
    rs.plan(src, rs.Layout(tens, storages))  # no aliasing
    tens["x"] = rs.TensorLayout((2,), [rs.Piece(n, 3, (0,), (2,))])
    storages[n] = S(0, 5)
    src = rs.Layout({k: rs.replicated(t.shape, [n + 5]) for k, t in tens.items()}, {n + 5: S(0, 4)})
    with pytest.raises(rs.LayoutError, match=f"writes storage element 3 of location {n}"):
        rs.plan(src, rs.Layout(tens, storages))


# -- the plan as data ------------------------------------------------------------------------------


def test_plan_is_frozen_data_and_schedule_a_pure_function():
    import dataclasses

    import reshard.planning as planning

    assert rs.plan is planning.plan and callable(rs.plan)
    assert "reshard.plan" not in sys.modules  # the name is the function only
    shp = (8, 6)
    src = rs.Layout({"w": rs.replicated(shp, [0, 1])}, {0: S(0, 48), 1: S(1, 48)})
    dst = rs.Layout({"w": rs.split(shp, 1, [3, 3], [2, 3])}, {2: S(2, 24), 3: S(0, 24)})
    p = rs.plan(src, dst, 32)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.budget_bytes_per_peer = 1
    arrays = [p.direct, *p.replicated_jobs, *p.rounds.groups, *p.rounds.segments]
    assert arrays and all(not a.flags.writeable for a in arrays)
    for r in p.ranks():
        fresh = planning.schedule(p, r)
        assert fresh is not planning.schedule(p, r)  # pure: built anew, nothing cached
        assert _schedule_key(fresh) == _schedule_key(p.schedule(r))
    assert p.replicated_jobs.count == 2 and p.num_jobs >= 2


def test_strided_run_is_not_extended_by_a_row_at_another_target_gap():
    # target piece A: rows 0-1, cols 0-1 as a (2, 2) block (one strided run, source row
    # stride 4, target row stride 2); piece B: row 2, cols 0-1 at target offset 7. B's source
    # row continues A's source stride, but in the target it sits 5 elements after A's last
    # row, not 2: the runs must not chain
    shp = (4, 4)
    src = rs.Layout({"w": rs.replicated(shp, [0])}, {0: S(0, 16)})
    pieces = [
        rs.Piece(5, 0, (0, 0), (2, 2), (2, 1)),
        rs.Piece(5, 7, (2, 0), (1, 2), (2, 1)),
        rs.Piece(6, 0, (3, 0), (1, 2)),
        rs.Piece(6, 2, (0, 2), (4, 2)),
    ]
    dst = rs.Layout({"w": rs.TensorLayout(shp, pieces)}, {5: S(0, 9), 6: S(1, 10)})
    p = check_plan(src, dst)
    runs = [r for r in p.runs.tolist() if r[3] == 5]
    assert sorted(runs) == [[0, 0, 4, 5, 0, 2, 2, 2], [0, 8, 2, 5, 7, 2, 2, 1]]
