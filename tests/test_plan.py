"""Planner tests: every rank's schedule is simulated in-process with plain torch/numpy
indexing (pack segments into byte arenas, deliver message bytes, unpack, local copies) and
compared with an independent element-by-element map built from the layouts."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import reshard as rs
from reshard.plan import wire_dtype

POISON = -12345.0
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- independent reference ----------------------------------------------------------------


def piece_map(tl):
    """Yield (location, storage element, logical flat index) for every element of every piece."""
    shape = tl.shape
    for p in tl.pieces:
        if any(n == 0 for n in p.shape):
            continue
        for idx in np.ndindex(*p.shape):
            logical = tuple(s + i for s, i in zip(p.start, idx))
            flat = int(np.ravel_multi_index(logical, shape)) if shape else 0
            off = p.offset + sum(s * i for s, i in zip(p.strides, idx))
            yield p.location, off, flat


def fill_sources(layout, names):
    """Storages holding each tensor's logical value (tensor id * 10000 + flat index) in every
    replica; padding holds a distinct negative value so a read of it is detectable."""
    bufs = {
        loc: torch.tensor(-1.0 - np.arange(s.numel), dtype=torch.float64).to(s.dtype)
        for loc, s in layout.storages.items()
    }
    for t, name in enumerate(names):
        for loc, off, flat in piece_map(layout.tensors[name]):
            bufs[loc][off] = t * 10000 + flat
    return bufs


def expected_targets(layout, names, src_layout):
    """{loc: (expected values float64, written mask)} from the target layout alone."""
    exp = {loc: np.full(s.numel, np.nan) for loc, s in layout.storages.items()}
    for t, name in enumerate(names):
        for loc, off, flat in piece_map(layout.tensors[name]):
            assert np.isnan(exp[loc][off]), "reference: target aliasing"
            exp[loc][off] = t * 10000 + flat
    return exp


# -- in-process execution of every rank's schedule --------------------------------------------


def desc_index(desc):
    """(src indices, dst indices) of a descriptor table, element by element."""
    si, di = [], []
    for so, ss, do, ds, ln, cnt in np.asarray(desc).tolist():
        assert min(so, ss, do, ds, ln, cnt) >= 0, desc
        for c in range(cnt):
            si.extend(range(so + c * ss, so + c * ss + ln))
            di.extend(range(do + c * ds, do + c * ds + ln))
    return np.array(si, np.int64), np.array(di, np.int64)


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
        loc: torch.full((s.numel,), POISON, dtype=torch.float64).to(s.dtype)
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
            apply_desc(src_bufs[lc.src_location], lc.desc, dst_bufs[lc.dst_location],
                       written[lc.dst_location])
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
                    assert seg.wire_dtype == wire_dtype(
                        src_layout.storages[seg.src_location].dtype,
                        dst_layout.storages[seg.dst_location].dtype)
                    lo = msg.arena_offset + seg.byte_offset
                    view = arena[lo: lo + seg.numel * seg.wire_dtype.itemsize].view(
                        seg.wire_dtype)
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
                assert [(s.src_location, s.dst_location, s.wire_dtype, s.byte_offset, s.numel)
                        for s in smsg.segments] == [
                    (s.src_location, s.dst_location, s.wire_dtype, s.byte_offset, s.numel)
                    for s in msg.segments]
                rarena[msg.arena_offset: msg.arena_offset + msg.nbytes] = arenas[msg.peer][
                    smsg.arena_offset: smsg.arena_offset + smsg.nbytes]
                for seg in msg.segments:
                    lo = msg.arena_offset + seg.byte_offset
                    view = rarena[lo: lo + seg.numel * seg.wire_dtype.itemsize].view(
                        seg.wire_dtype)
                    si, di = desc_index(seg.desc)
                    assert sorted(si.tolist()) == list(range(seg.numel))
                    apply_desc(view, seg.desc, dst_bufs[seg.dst_location],
                               written[seg.dst_location])
            # every message this rank receives was sent to it, and vice versa
            senders = sorted(m.peer for m in sc.recvs[k])
            assert senders == sorted(p for p, s in scheds.items()
                                     if any(m.peer == r for m in s.sends[k]))
    for loc, buf in src_bufs.items():
        assert torch.equal(buf, src_before[loc]), f"source storage {loc} was written"
    return dst_bufs, written


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
    for (a0, a1), (b0, b1) in zip(spans, spans[1:]):
        assert a1 <= b0, "messages overlap in the arena"


def check_plan(src, dst, budget=64 << 20):
    names = sorted(dst.tensors)
    p = rs.plan(src, dst, budget_bytes_per_peer=budget)
    src_bufs = fill_sources(src, names)
    out, written = simulate(p, src, dst, src_bufs)
    exp = expected_targets(dst, names, src)
    for loc, e in exp.items():
        got = out[loc].to(torch.float64).numpy()
        cov = ~np.isnan(e)
        assert (written[loc][cov] == 1).all(), f"target {loc}: element not written exactly once"
        assert (written[loc][~cov] == 0).all(), f"target {loc}: padding written"
        np.testing.assert_array_equal(got[cov], e[cov], err_msg=f"target storage {loc}")
        assert (got[~cov] == POISON).all()
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
            groups.append([alloc.new(draw(rank), pn + draw(st.integers(0, 1))) for _ in range(reps)])
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
def shapes_st(draw, max_tensors=3):
    k = draw(st.integers(1, max_tensors))
    out = {}
    for i in range(k):
        d = draw(st.integers(0, 3))
        out[f"t{i}"] = tuple(draw(st.integers(0 if d else 1, 5)) for _ in range(d))
    return out


KINDS = ["zero12", "zero3", "replicated", "split", "nested", "transposed"]


@st.composite
def layout_pair(draw):
    shapes = draw(shapes_st())
    layouts = []
    for _ in range(2):
        alloc = Alloc(draw(st.integers(1, 4)))
        kind = draw(st.sampled_from(KINDS))
        tens = build(draw, alloc, shapes, kind)
        layouts.append(rs.Layout(tens, alloc.storages()))
    budget = draw(st.sampled_from([16, 17, 48, 100, 4096]))
    return layouts[0], layouts[1], budget


# -- tests --------------------------------------------------------------------------------------


@settings(max_examples=150, **SETTINGS)
@given(layout_pair())
def test_property_plan_executes_to_reference(case):
    src, dst, budget = case
    check_plan(src, dst, budget)
