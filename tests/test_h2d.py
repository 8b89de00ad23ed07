"""The batched CPU -> CUDA path's logic (reshard.h2d), device-independent parts: the span
decomposition of descriptor tables, the split policy as a pure function, how cast spans are
cut between the host and the device, the ring slot packing, and the whole pipeline run in
order on CPU targets against an independent reference (numpy index arrays + torch `.to()`),
for every mix of page-locked and pageable sources and host shares. tests/gpu/test_h2d_gpu.py
runs the same pipeline on a GPU."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard import h2d
from reshard.rounds import LocalTable


def _expand(desc):
    """[(src index, dst index)] of every element a table copies, in work order."""
    out = []
    for so, ss, do, ds, n, c in np.asarray(desc).reshape(-1, 6).tolist():
        for i in range(c):
            out += [(so + i * ss + k, do + i * ds + k) for k in range(n)]
    return out


def test_contiguous_spans_merge_and_cap():
    desc = [
        [0, 0, 100, 0, 5, 1],
        [5, 0, 105, 0, 3, 1],  # continues both sides: merged
        [20, 10, 200, 10, 10, 3],  # strides equal the length: one span of 30
        [60, 8, 300, 4, 4, 2],  # strided: two spans, the second not adjacent on the source
        [90, 0, 400, 0, 0, 1],  # empty
    ]
    spans = h2d.contiguous_spans(desc)
    assert spans.tolist() == [[0, 100, 8], [20, 200, 30], [60, 300, 4], [68, 304, 4]]
    assert h2d.contiguous_spans([[0, 3, 0, 3, 2, 10]], max_spans=9) is None
    assert h2d.contiguous_spans([[0, 3, 0, 3, 2, 10]], max_spans=10).shape == (10, 3)
    assert h2d.contiguous_spans(np.zeros((0, 6), np.int64)).shape == (0, 3)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(*[st.integers(0, 6)] * 6), max_size=6))
def test_contiguous_spans_cover_the_table(rows):
    desc = np.array(rows, np.int64).reshape(-1, 6)
    spans = h2d.contiguous_spans(desc, max_spans=10_000)
    got = [(so + k, do + k) for so, do, n in spans.tolist() for k in range(n)]
    assert got == _expand(desc)


def test_split_fraction():
    # host casts 20 G elem/s, link 55 GB/s: f * h = (2f + 4(1 - f)) / link
    f = h2d.split_fraction(1 / 20e9, 55e9, 2, 4)
    assert f == pytest.approx((4 / 55e9) / (1 / 20e9 + 2 / 55e9))
    assert f * (1 / 20e9) == pytest.approx((2 * f + 4 * (1 - f)) / 55e9)
    assert h2d.split_fraction(1 / 100e9, 55e9, 2, 4) == 1.0  # the host outruns the link
    assert 0 < h2d.split_fraction(1 / 1e9, 55e9, 2, 4) < 0.1  # a slow host casts little
    for h, link in ((None, 55e9), (1e-9, None), (0.0, 55e9), (1e-9, 0.0)):
        assert h2d.split_fraction(h, link, 2, 4) == 1.0  # unknown: all on the host
    assert h2d.split_fraction(1e-9, 55e9, 4, 4) == 1.0  # no narrower wire to gain


@pytest.mark.parametrize("want", [0, 1, 7, 10, 25, 26, 10**6])
def test_device_cast_chunks(want):
    lengths, chunk = [25, 3, 10], 10
    chunks = h2d.device_cast_chunks(lengths, want, chunk)
    taken = sum(n for _, _, n in chunks)
    assert taken >= min(want, sum(lengths)) and taken < want + chunk or want == 0
    seen = {}
    for i, first, n in chunks:
        assert 0 < n <= chunk and 0 <= first and first + n <= lengths[i]
        # suffix pieces, each next one right before the last
        assert first + n == seen.get(i, lengths[i])
        seen[i] = first
        assert n in (chunk, lengths[i] % chunk, lengths[i])  # a fixed set of lengths


def test_slot_pieces_align_and_cut():
    pieces = [(0, 0, 10), (1, 5, 3), (0, 10, 40)]
    slots = h2d.slot_pieces(pieces, [4, 2], 64)
    for slot in slots:
        end = 0
        for key, _, n, at in slot:
            isz = [4, 2][key]
            assert at % h2d.ALIGN == 0 and at >= end and at + n * isz <= 64
            end = at + n * isz
    flat = [(k, f, n) for slot in slots for k, f, n, _ in slot]
    got = {}
    for k, f, n in flat:  # every element once, in order
        got.setdefault(k, []).extend(range(f, f + n))
    assert got[0] == list(range(50)) and got[1] == [5, 6, 7]


def test_ring_slots_like_the_stage_ops():
    assert h2d.ring_slots(64 << 20) == (4, 16 << 20)
    assert h2d.ring_slots(128 << 10) == (2, 64 << 10)
    s, b = h2d.ring_slots(4096)
    assert s == 2 and b == 2048


# ------------------------------------------------------------------ the pipeline, in order

SPECIAL = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, -1e-45, 3.4e38]


def _values(n, seed):
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(n, generator=g) * 100
    bits = v.view(torch.int32)
    # rounding ties for bf16: the low 16 bits exactly half (0x8000), odd and even kept bits
    bits[::7] = (bits[::7] & ~0xFFFF) | 0x8000
    v[: len(SPECIAL)] = torch.tensor(SPECIAL)[: min(n, len(SPECIAL))]
    nan = torch.tensor([0x7FC00001, -0x7FFF0001], dtype=torch.int32).view(torch.float32)
    if n > len(SPECIAL) + 2:
        v[len(SPECIAL) : len(SPECIAL) + 2] = nan  # NaN payloads, both signs
    return v


def _case(seed, n_tables, dst_dtype):
    rng = np.random.default_rng(seed)
    tables, src, dst, ref = [], {}, {}, {}
    for i in range(n_tables):
        n_src = int(rng.integers(1, 3000))
        n_dst = n_src + int(rng.integers(0, 50))
        rows = []
        so, do = int(rng.integers(0, 5)), int(rng.integers(0, 5))
        while so < n_src - 1 and do < n_dst - 1:
            n = int(rng.integers(1, min(n_src - so, n_dst - do) + 1))
            rows.append([so, 0, do, 0, n, 1])
            so += n + int(rng.integers(0, 3))
            do += n + int(rng.integers(0, 3))
        desc = np.array(rows, np.int64).reshape(-1, 6)
        src[i] = _values(n_src, seed * 100 + i)
        dst[1000 + i] = torch.full((n_dst,), -7.0, dtype=dst_dtype)
        expect = dst[1000 + i].clone()
        pairs = np.array(_expand(desc), np.int64).reshape(-1, 2)
        expect[torch.from_numpy(pairs[:, 1])] = src[i][torch.from_numpy(pairs[:, 0])].to(dst_dtype)
        ref[1000 + i] = expect
        t = LocalTable(i, 1000 + i, torch.from_numpy(desc), len(pairs))
        tables.append(h2d.LocalSpans(t, h2d.contiguous_spans(desc)))
    return tables, src, dst, ref


def _bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("dst_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("share", [1.0, 0.6, 0.0])
@pytest.mark.parametrize("pinned_every", [0, 1, 2])  # none, all, every other source
def test_pipeline_in_order_matches_reference(dst_dtype, share, pinned_every):
    tables, src, dst, ref = _case(7, 9, dst_dtype)
    path = h2d.HostToDevice(tables)
    path.host_share = share
    pinned = {i: bool(pinned_every) and i % pinned_every == 0 for i in src}
    ring = torch.empty(4096, dtype=torch.uint8)  # two 2 KiB slots: many slot turns
    for _ in range(2):
        for v in dst.values():
            v.fill_(-7.0)
        path.run(src, dst, ring, device_bytes=1024, pinned=pinned)
        for k in ref:
            assert torch.equal(_bits(dst[k]), _bits(ref[k])), k
    last = path.last
    total = sum(t.elements for t, _ in tables)
    moved = last["direct_elements"] + last["device_cast_elements"] + last["host_elements"]
    assert moved == total
    if pinned_every and dst_dtype != torch.float32 and share < 1.0:
        assert last["device_cast_elements"] > 0
    if pinned_every == 1 and dst_dtype == torch.float32:
        assert last["host_elements"] == 0 and last["direct_elements"] == total
    if not pinned_every:
        assert last["host_elements"] == total
        assert last["staged_tables"] > 0  # tables of several spans: one stage call each


def test_keep_split_only_when_measured_faster():
    assert h2d.keep_split([1.0, 0.9], [0.8, 0.85], 0.03)  # the best split call wins by 11%
    assert not h2d.keep_split([1.0, 0.9], [0.88, 0.95], 0.03)  # 2%: within the margin
    assert not h2d.keep_split([1.0], [1.2, 1.1], 0.03)  # slower
    assert not h2d.keep_split([], [0.5], 0.03) and not h2d.keep_split([0.5], [], 0.03)


def _route_of(cast_spans, host, dev_elems, wire_bytes):
    """What `_balance` reads of a call's route."""
    return SimpleNamespace(
        cast_spans=cast_spans,
        host=host,
        dev_chunks=[((0, 0), 0, dev_elems)] if dev_elems else [],
        wire_bytes=wire_bytes,
    )


def test_split_trial_rejects_a_split_that_does_not_pay():
    """The policy's sequence on measured call times: TRIAL_CALLS all on the host, then the
    model's share for TRIAL_CALLS calls, then kept or back to all on the host for good."""
    tables, src, dst, _ = _case(3, 2, torch.bfloat16)
    for split_faster, outcome in ((True, "kept"), (False, "rejected")):
        path = h2d.HostToDevice(tables)
        path.link_bytes_per_s = 55e9
        shares = []
        for _ in range(6):
            share = path.host_share
            shares.append(share)
            total = 1.0 if share >= 1.0 else (0.8 if split_faster else 1.1)
            host_n = round(1000 * share)
            # the host casts 10 G elem/s, the link 55 GB/s: the model gives the host ~0.53;
            # 1000 elements in a second leave the link idle (not link-bound)
            r = _route_of([(0, 0)], [(0, 0, 0, host_n)], 1000 - host_n, 4000)
            path._balance(r, src, dst, host_s=host_n / 10e9, total_s=total)
        assert shares[:2] == [1.0, 1.0] and 0.5 < shares[2] < 0.9 and shares[3] == shares[2]
        assert path.split == outcome
        assert (path.host_share < 1.0) == split_faster


def test_split_share_moves_to_the_host_after_link_bound_calls():
    """A split call that kept the link busy: the host's time per element is not taken from
    it (the host waited for the link), and SHARE_STEP of the casts go back to the host; a
    host-bound split call measures the host and gives the model's share again."""
    tables, src, dst, _ = _case(3, 2, torch.bfloat16)
    path = h2d.HostToDevice(tables)
    link = path.link_bytes_per_s = 55e9
    path.split, path.host_share, path.host_s_per_elem = "kept", 0.6, 1 / 10e9
    n = 10**9
    host_n = round(n * path.host_share)
    wire = host_n * 2 + (n - host_n) * 4
    # link-bound: the wire bytes at the measured rate fill the call; the host's 3 s (it
    # waited) must not count as its time per element
    r = _route_of([(0, 0)], [(0, 0, 0, host_n)], n - host_n, wire)
    assert path._balance(r, src, dst, host_s=3.0, total_s=wire / link)
    assert path.host_s_per_elem == 1 / 10e9
    assert path.host_share == pytest.approx(0.6 + h2d.SHARE_STEP)
    # host-bound: the link idle half the time; the host measured at 20 G elem/s this call
    host_n = round(n * path.host_share)
    r = _route_of([(0, 0)], [(0, 0, 0, host_n)], n - host_n, wire)
    assert not path._balance(r, src, dst, host_s=host_n / 20e9, total_s=2 * wire / link)
    h = h2d.EMA / 20e9 + (1 - h2d.EMA) / 10e9
    assert path.host_s_per_elem == pytest.approx(h)
    assert path.host_share == pytest.approx(h2d.split_fraction(h, link, 2, 4))
    assert path.split == "kept"


def test_direct_copies_follow_new_buffers():
    """Direct copies are queued from byte views built once per set of buffers: a call with
    other source or target tensors (new storage) copies from and into those, not the views
    of the last set."""
    tables, src, dst, ref = _case(11, 5, torch.float32)
    path = h2d.HostToDevice(tables)
    pinned = dict.fromkeys(src, True)
    ring = torch.empty(4096, dtype=torch.uint8)
    path.run(src, dst, ring, device_bytes=1024, pinned=pinned)
    assert path.last["direct_copies"] > 0 and path.last["host_elements"] == 0
    for k in ref:
        assert torch.equal(_bits(dst[k]), _bits(ref[k])), k
    src2 = {k: -v for k, v in src.items()}  # new storages, other values
    dst2 = {k: torch.full_like(v, -7.0) for k, v in dst.items()}
    old = {k: v.clone() for k, v in dst.items()}
    path.run(src2, dst2, ring, device_bytes=1024, pinned=pinned)
    for k in ref:
        want = torch.where(ref[k] == -7.0, ref[k], -ref[k])  # unwritten elements stay poisoned
        assert torch.equal(_bits(dst2[k]), _bits(want)), k
        assert torch.equal(_bits(dst[k]), _bits(old[k])), k  # the old targets untouched
