"""The batched CPU -> CUDA path's logic (reshard.h2d), device-independent parts: the span
decomposition of descriptor tables, the split policy as a pure function, how cast spans are
cut between the host and the device, the ring slot packing, and the whole pipeline run in
order on CPU targets against an independent reference (numpy index arrays + torch `.to()`),
for every mix of page-locked and pageable sources and host shares. tests/gpu/test_h2d_gpu.py
runs the same pipeline on a GPU."""

from __future__ import annotations

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


@pytest.mark.parametrize("want", [0, 1, 7, 10, 25, 26, 37, 38, 10**6])
def test_device_cast_chunks(want):
    lengths, chunk = [25, 3, 10], 10
    chunks = h2d.device_cast_chunks(lengths, want, chunk)
    assert sum(n for _, _, n in chunks) == min(want, sum(lengths))  # exactly the share
    seen = {}
    for i, first, n in chunks:
        assert 0 < n <= chunk and 0 <= first and first + n <= lengths[i]
        # suffix pieces, each next one right before the last
        assert first + n == seen.get(i, lengths[i])
        seen[i] = first
    # the last spans first: a span is touched only once every later one is taken whole
    touched = sorted(seen)
    for i in touched[1:]:
        assert seen[i] == 0


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


def test_pick_share_only_when_measured_faster():
    fast = {1.0: [1.0, 0.9, 0.95], 0.7: [0.8, 0.85, 0.84], 0.82: [0.75, 0.9, 0.8]}
    assert h2d.pick_share(fast, 0.05) == 0.82  # the fastest median wins (0.8 against 0.95)
    assert h2d.pick_share({1.0: [1.0, 0.9, 0.95], 0.7: [0.91, 0.93, 0.9]}, 0.05) == 1.0  # 4%
    assert h2d.pick_share({1.0: [1.0], 0.7: [1.2, 1.1]}, 0.05) == 1.0  # slower
    assert h2d.pick_share({0.7: [0.5]}, 0.05) == 1.0  # no host-only call measured
    assert h2d.pick_share({1.0: [0.5]}, 0.05) == 1.0
    # one lucky call does not keep a split that is slower in its other calls
    assert h2d.pick_share({1.0: [1.0, 1.0, 1.0], 0.7: [0.6, 1.1, 1.1]}, 0.05) == 1.0


def test_split_trial_picks_the_fastest_share():
    """The policy's sequence on measured call times: TRIAL_CALLS all on the host, then
    TRIAL_CALLS at the model's share and at the smaller device share, then the fastest kept for
    good (or all on the host when no split won)."""
    tables, src, dst, _ = _case(3, 2, torch.bfloat16)
    host = [(0, 0, 0, 1000)]
    # the host casts 10 G elem/s, the link 55 GB/s: the model gives the host ~0.53
    f = h2d.split_fraction(1 / 10e9, 55e9, 2, 4)
    g = 1.0 - h2d.SMALLER_SHARE * (1.0 - f)
    for times, outcome, kept in (
        ({1.0: 1.0, f: 0.8, g: 0.7}, "kept", g),
        ({1.0: 1.0, f: 0.8, g: 0.9}, "kept", f),
        ({1.0: 1.0, f: 1.1, g: 0.99}, "rejected", 1.0),
    ):
        path = h2d.HostToDevice(tables)
        path.link_bytes_per_s = 55e9
        shares, calls = [], 3 * h2d.TRIAL_CALLS + 2
        for _ in range(calls):
            share = path.host_share
            shares.append(share)
            total = times[min(times, key=lambda s, share=share: abs(s - share))]
            path._balance([(0, 0)], host, src, dst, host_s=1000 / 10e9, total_s=total)
        n = h2d.TRIAL_CALLS
        assert shares[:n] == [1.0] * n
        assert shares[n : 2 * n] == pytest.approx([f] * n)
        assert shares[2 * n : 3 * n] == pytest.approx([g] * n)
        assert shares[3 * n :] == pytest.approx([kept] * (calls - 3 * n))
        assert path.split == outcome


def test_split_trial_ignores_a_share_set_from_outside():
    tables, src, dst, _ = _case(3, 2, torch.bfloat16)
    path = h2d.HostToDevice(tables)
    path.link_bytes_per_s = 55e9
    path.host_share = 0.3
    for _ in range(5):
        path._balance([(0, 0)], [(0, 0, 0, 300)], src, dst, host_s=1e-6, total_s=1.0)
    assert path.host_share == 0.3 and path.split == "trial" and path.host_s_per_elem is None


def test_direct_copies_follow_new_buffers():
    """Direct copies are queued by one call over byte views of the spans: a call with other
    source or target tensors (new storage) copies from and into those, and leaves the last
    call's targets alone."""
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


def test_direct_copies_largest_first_whole_and_partial():
    """Many direct copies (several doubling batches): whole buffers copied without views and
    spans of larger buffers through byte views, each bitwise, the elements outside the spans
    untouched, queued largest first."""
    rng = np.random.default_rng(5)
    tables, src, dst, ref = [], {}, {}, {}
    for i in range(23):
        n = int(rng.integers(1, 4000))
        partial = i % 3 == 0
        n_src, n_dst = (n + 7, n + 5) if partial else (n, n)
        so, do = (3, 2) if partial else (0, 0)
        desc = np.array([[so, 0, do, 0, n, 1]], np.int64)
        src[i] = _values(n_src, 900 + i)
        dst[1000 + i] = torch.full((n_dst,), -7.0)
        ref[1000 + i] = dst[1000 + i].clone()
        ref[1000 + i][do : do + n] = src[i][so : so + n]
        t = LocalTable(i, 1000 + i, torch.from_numpy(desc), n)
        tables.append(h2d.LocalSpans(t, h2d.contiguous_spans(desc)))
    path = h2d.HostToDevice(tables)
    ring = torch.empty(4096, dtype=torch.uint8)
    pinned = dict.fromkeys(src, True)
    for _ in range(2):
        for v in dst.values():
            v.fill_(-7.0)
        path.run(src, dst, ring, device_bytes=1024, pinned=pinned)
        assert path.last["direct_copies"] == 23 and path.last["host_elements"] == 0
        for k in ref:
            assert torch.equal(_bits(dst[k]), _bits(ref[k])), k
    (route,) = path._routes.values()
    sizes = [c[4] for c in route.direct_bytes]
    assert sizes == sorted(sizes, reverse=True)
    assert route.direct_whole == [c[0] % 3 != 0 for c in route.direct_bytes]


def test_casting_stage_calls_get_a_bounded_share_of_the_ring(monkeypatch):
    """A stage call that casts packs through the ring's first CAST_RING_BYTES (queue slots in
    flight, measured faster on the H200 host); one that copies keeps the whole ring."""
    n = (9 << 20) + 5  # bf16 pieces over one 16 MiB slot of a 64 MiB ring: stage calls
    src = {0: _values(n, 1), 1: _values(n, 2)}
    dst = {1000: torch.empty(n, dtype=torch.bfloat16), 1001: torch.empty(n)}
    tables = []
    for i, loc in enumerate((1000, 1001)):
        desc = np.array([[0, 0, 0, 0, n, 1]], np.int64)
        t = LocalTable(i, loc, torch.from_numpy(desc), n)
        tables.append(h2d.LocalSpans(t, h2d.contiguous_spans(desc)))
    rings = {}

    def stage(self, s, desc, ring, d, progress=None):
        rings[d.dtype] = ring.numel()
        torch.ops.reshard.copy_runs(s, desc, d)

    monkeypatch.setattr(h2d._Ordered, "stage", stage)
    ring = torch.empty(64 << 20, dtype=torch.uint8)
    h2d.HostToDevice(tables).run(src, dst, ring, device_bytes=1024, pinned={0: False, 1: False})
    assert rings == {torch.bfloat16: h2d.CAST_RING_BYTES, torch.float32: 64 << 20}
    assert torch.equal(_bits(dst[1000]), _bits(src[0].to(torch.bfloat16)))
    assert torch.equal(_bits(dst[1001]), _bits(src[1]))


# ------------------------------------------------------------------ progress of a call


def _span_tables(spans_per_table, n_src, dtype=torch.bfloat16):
    """Tables of the given spans [(src_offset, dst_offset, n)], table i from source i into
    target 1000 + i; with sources and poisoned targets."""
    tables, src, dst = [], {}, {}
    for i, spans in enumerate(spans_per_table):
        desc = np.array([[so, 0, do, 0, n, 1] for so, do, n in spans], np.int64).reshape(-1, 6)
        src[i] = _values(n_src, 50 + i)
        dst[1000 + i] = torch.full((max(do + n for _, do, n in spans) + 8,), -7.0, dtype=dtype)
        t = LocalTable(i, 1000 + i, torch.from_numpy(desc), int(desc[:, 4].sum()))
        tables.append(h2d.LocalSpans(t, h2d.contiguous_spans(desc, max_spans=1)))
    return tables, src, dst


def _published(monkeypatch, tables, src, dst, origin_of=1000):
    """Runs one call with a progress word; returns (values seen after each stage call, the
    word's final value, the origin's address)."""
    seen = []
    real = h2d._Ordered.stage

    def stage(self, s, desc, ring, d, progress=None):
        real(self, s, desc, ring, d, progress)
        if progress is not None:
            seen.append(int(progress[0]))

    monkeypatch.setattr(h2d._Ordered, "stage", stage)
    word = torch.zeros(4, dtype=torch.int64)
    origin = dst[origin_of].data_ptr()
    ring = torch.empty(4096, dtype=torch.uint8)  # 1 KiB slots: 512 bf16 make a stage call
    h2d.HostToDevice(tables).run(
        src,
        dst,
        ring,
        device_bytes=1024,
        pinned=dict.fromkeys(src, False),
        progress=h2d.Progress(word, origin),
    )
    return seen, int(word[0]), origin


@pytest.mark.parametrize(
    "spans", [[(0, 0, 2500)], [(0, 0, 600), (700, 600, 900), (1700, 1500, 1000)]]
)
def test_progress_published_where_the_target_fills_in_order(monkeypatch, spans):
    """One table through stage_h2d (one span: a piece call; several: one whole-table call),
    its spans each starting where the one before ended in the target (the sources need not be
    contiguous): after the call the word holds the end of the target bytes written, counted
    from the origin, and every byte before it holds its final value."""
    tables, src, dst = _span_tables([spans], 3000)
    tables = [h2d.LocalSpans(tables[0].table, np.array(spans, np.int64))]
    seen, final, _ = _published(monkeypatch, tables, src, dst)
    assert seen == [2500 * 2]
    assert final == 2500 * 2
    want = torch.cat([src[0][so : so + n] for so, _, n in spans]).to(torch.bfloat16)
    assert torch.equal(_bits(dst[1000][:2500]), _bits(want))
    assert torch.equal(_bits(dst[1000][2500:]), _bits(torch.full((8,), -7.0, dtype=torch.bfloat16)))


def test_progress_counts_from_the_origin(monkeypatch):
    """The target is a view into a larger buffer: the word counts bytes from the buffer's
    start (the origin), not the view's."""
    spans = [(0, 0, 1200)]
    tables, src, dst = _span_tables([spans], 1200)
    tables = [h2d.LocalSpans(tables[0].table, np.array(spans, np.int64))]
    whole = torch.full((1300 + 64,), -7.0, dtype=torch.bfloat16)
    dst[1000] = whole[64:]
    seen, final, origin = _published(monkeypatch, tables, src, dst)
    assert origin == whole[64:].data_ptr()
    word = torch.zeros(4, dtype=torch.int64)
    ring = torch.empty(4096, dtype=torch.uint8)
    h2d.HostToDevice(tables).run(
        src,
        dst,
        ring,
        device_bytes=1024,
        pinned={0: False},
        progress=h2d.Progress(word, whole.data_ptr()),
    )
    assert int(word[0]) == 64 * 2 + 1200 * 2


@pytest.mark.parametrize(
    "case",
    [
        "out_of_order",  # the second call writes below the first
        "gap",  # a target gap: bytes before the word's value nobody writes
        "late_start",  # the first piece does not start at the target's start
        "two_tables",  # two targets: one call's progress says nothing of the other
        "ring_pieces",  # small pieces share ring slots: no stage call publishes them
    ],
)
def test_progress_not_published_where_it_would_not_be_a_prefix(monkeypatch, case):
    spans = {
        "out_of_order": [[(0, 600, 600), (600, 0, 600)]],
        "gap": [[(0, 0, 600), (600, 700, 600)]],
        "late_start": [[(0, 16, 600), (600, 616, 600)]],
        "two_tables": [[(0, 0, 600)], [(0, 0, 600)]],
        "ring_pieces": [[(0, 0, 100), (200, 100, 100)]],
    }[case]
    tables, src, dst = _span_tables(spans, 1300)
    tables = [h2d.LocalSpans(t.table, np.array(sp, np.int64)) for t, sp in zip(tables, spans)]
    seen, final, _ = _published(monkeypatch, tables, src, dst)
    assert seen == [] and final == 0
    for i, sp in enumerate(spans):  # the copies themselves are unchanged
        for so, do, n in sp:
            got = dst[1000 + i][do : do + n]
            assert torch.equal(_bits(got), _bits(src[i][so : so + n].to(torch.bfloat16)))


def test_progress_keeps_every_cast_on_the_host(monkeypatch):
    """A page-locked fp32 source into bf16 is a split candidate (device casts), which would
    leave no queued prefix: a call given a progress word rejects the split and publishes."""
    spans = [(0, 0, 2500)]
    tables, src, dst = _span_tables([spans], 3000)
    tables = [h2d.LocalSpans(tables[0].table, np.array(spans, np.int64))]
    path = h2d.HostToDevice(tables)
    path.link_bytes_per_s = 1e9  # as if measured: the trial would start
    word = torch.zeros(4, dtype=torch.int64)
    ring = torch.empty(4096, dtype=torch.uint8)
    for _ in range(3):
        path.run(
            src,
            dst,
            ring,
            device_bytes=1024,
            pinned={0: True},
            progress=h2d.Progress(word, dst[1000].data_ptr()),
        )
        assert path.split == "rejected" and path.host_share == 1.0
        assert path.last["device_cast_elements"] == 0
        assert int(word[0]) == 2500 * 2
    want = src[0][:2500].to(torch.bfloat16)
    assert torch.equal(_bits(dst[1000][:2500]), _bits(want))
