"""The batched CPU -> CUDA path (reshard.h2d) on a GPU: many tables (one storage per tensor, as
FSDP2 offloads), sources pageable, pinned or registered in place, targets fp32 / bf16 / fp16.
Every target equals the host cast bit for bit (the C core's CPU copy_runs: casts.h, the code
both sides share; and torch's .to() wherever the value is not NaN): normal numbers, subnormals,
infinities, NaN payloads, rounding ties, odd sizes and offsets; with the host/device split
forced to every share, and the staging bound kept (device memory measured by the allocator).
Skipped without a CUDA device."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

POISON = -7.0  # exact in every target dtype
TABLES_SLACK = 64 << 10  # device copies of the ops' cached descriptor tables
SPECIAL = [0.0, -0.0, float("inf"), float("-inf"), 1e-40, -1e-45, 1.1754942e-38, 3.4e38, -65519.0]
# sizes: odd, tiny, one element, and larger than a ring slot of the small budgets below
SIZES = [1, 7, 33, 1023, 4097, 65_537, 300_001, 2_000_003]


def _values(n, seed):
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(n, generator=g) * 1000
    bits = v.view(torch.int32)
    bits[1::5] = (bits[1::5] & ~0xFFFF) | 0x8000  # bf16 rounding ties, odd and even kept bits
    bits[2::5] = (bits[2::5] & ~0x1FFF) | 0x1000  # fp16 rounding ties
    bits[3::11] &= 0x807FFFFF  # fp32 subnormals (exponent 0)
    k = min(n, len(SPECIAL))
    v[:k] = torch.tensor(SPECIAL[:k])
    if n > k + 1:
        nan = torch.tensor([0x7FC00001, -0x7FFF0001], dtype=torch.int32).view(torch.float32)
        v[k : k + 2] = nan  # NaN payloads, both signs
    return v


def _host_cast(src, dtype):
    """The host cast: the C core's CPU copy_runs (casts.h), independent of the GPU path."""
    out = torch.empty(src.numel(), dtype=dtype)
    torch.ops.reshard.copy_runs(src, torch.tensor([[0, 0, 0, 0, src.numel(), 1]]), out)
    not_nan = ~torch.isnan(src)
    assert torch.equal(out[not_nan], src[not_nan].to(dtype))  # and torch agrees off NaN
    return out


def _bits(t):
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _layouts(dst_dtype, offset=3):
    """One source storage per tensor (values at `offset`, a gap after), one target storage per
    tensor (values at offset 1)."""
    import reshard as rs

    src_t, dst_t, src_s, dst_s = {}, {}, {}, {}
    for i, n in enumerate(SIZES):
        src_t[f"t{i}"] = rs.flat((n,), [(i, 0, n, offset)])
        dst_t[f"t{i}"] = rs.flat((n,), [(1000 + i, 0, n, 1)])
        src_s[i] = rs.Storage(0, torch.float32, n + offset + 2)
        dst_s[1000 + i] = rs.Storage(0, dst_dtype, n + 1)
    return rs.Layout(src_t, src_s), rs.Layout(dst_t, dst_s)


def _sources(kind, offset=3):
    out = {}
    for i, n in enumerate(SIZES):
        t = torch.full((n + offset + 2,), 5.0)
        t[offset : offset + n] = _values(n, i)
        out[i] = t.pin_memory() if kind == "pinned" else t
    return out


def _check(src, dst, dst_dtype, offset=3):
    for i, n in enumerate(SIZES):
        got = dst[1000 + i].cpu()
        want = _host_cast(src[i][offset : offset + n], dst_dtype)
        assert torch.equal(_bits(got[1:]), _bits(want)), f"tensor {i} ({n} elements)"
        assert got[0].item() == POISON  # the target element before the range stays


@pytest.mark.parametrize("dst_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("kind", ["pageable", "pinned", "registered"])
def test_transfer_many_tables_bitwise(dst_dtype, kind):
    import reshard as rs
    from reshard import h2d

    src_l, dst_l = _layouts(dst_dtype)
    src = _sources(kind)
    dst = {
        k: torch.full((s.numel,), POISON, dtype=dst_dtype, device="cuda")
        for k, s in dst_l.storages.items()
    }
    budget = 1 << 20  # a 1 MiB ring: the largest tensors span several slots
    with rs.Transfer(
        src_l, dst_l, budget_bytes_per_peer=budget, register_host_sources=kind == "registered"
    ) as sync:
        for call in range(3 * h2d.TRIAL_CALLS + 2):  # the split policy's trial, then its pick
            if call == 1 and kind == "registered":
                sync.wait_host_registration()
                assert all(t.is_pinned() for t in src.values())
            for v in dst.values():
                v.fill_(POISON)
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            rep = sync(src, dst)
            extra = torch.cuda.max_memory_allocated() - base
            # the staging, plus the device copies of the ops' descriptor tables (cached, KiBs)
            assert extra <= rep.staging_bound["device"] + TABLES_SLACK, (extra, rep.staging_bound)
            for side, held in rep.peak_staging_bytes.items():
                assert held <= rep.staging_bound[side]
            _check(src, dst, dst_dtype)
        path, rest = sync._engine.local_paths(src, dst)
        assert path is not None and not rest  # every table took the batched path
        if kind != "pageable" and dst_dtype == torch.float32:
            assert path.last["direct_elements"] == sum(SIZES)  # straight from the sources
        if kind == "pageable":
            assert path.last["host_elements"] == sum(SIZES)
        # (casts from page-locked sources: the split is the policy's; forced below)


@pytest.mark.parametrize("dst_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("share", [0.0, 0.3, 1.0])
def test_device_cast_split_forced(dst_dtype, share):
    """Every share of the host/device split gives the host cast's bits (the share is the
    policy's to choose; here it is forced)."""
    import reshard as rs
    from reshard import h2d
    from reshard.rounds import local_tables

    src_l, dst_l = _layouts(dst_dtype)
    src = _sources("pinned")
    dst = {
        k: torch.full((s.numel,), POISON, dtype=dst_dtype, device="cuda")
        for k, s in dst_l.storages.items()
    }
    plan = rs.plan(src_l, dst_l, budget_bytes_per_peer=1 << 20)
    tables = [
        h2d.LocalSpans(t, h2d.contiguous_spans(t.desc.numpy()))
        for t in local_tables(plan.schedule(0))
    ]
    path = h2d.HostToDevice(tables)
    ring = torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)
    path.host_share = share
    path.link_bytes_per_s = 1.0  # known: no probe, and the forced share is kept for one call
    device_bytes = 1 << 20
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    path.host_s_per_elem = None
    path.run(src, dst, ring, device_bytes)
    assert torch.cuda.max_memory_allocated() - base <= device_bytes + TABLES_SLACK
    _check(src, dst, dst_dtype)
    total = sum(SIZES)
    if share == 0.0:
        assert path.last["device_cast_elements"] >= total - max(SIZES)  # all but a partial
    if share == 1.0:
        assert path.last["device_cast_elements"] == 0


def _path_and_targets(dst_dtype, src):
    import reshard as rs
    from reshard import h2d
    from reshard.rounds import local_tables

    src_l, dst_l = _layouts(dst_dtype)
    plan = rs.plan(src_l, dst_l, budget_bytes_per_peer=1 << 20)
    tables = [
        h2d.LocalSpans(t, h2d.contiguous_spans(t.desc.numpy()))
        for t in local_tables(plan.schedule(0))
    ]
    dst = {
        k: torch.full((s.numel,), POISON, dtype=dst_dtype, device="cuda")
        for k, s in dst_l.storages.items()
    }
    return h2d.HostToDevice(tables), dst


def test_device_cast_share_moving_between_calls():
    """One path whose share moves from call to call (new routes, device-cast lengths seen for
    the first time, scratch parts reused across chunks): every call gives the host cast's
    bits into freshly poisoned targets, within the scratch bound."""
    src = _sources("pinned")
    path, dst = _path_and_targets(torch.bfloat16, src)
    ring = torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)
    device_bytes = 1 << 20
    path.link_bytes_per_s = 1.0  # known: no probe
    path._balance = lambda *a, **k: False  # the forced shares stay
    seen = 0
    for share in (1.0, 0.7, 0.3, 0.7, 0.0, 0.3):
        path.split, path.host_share = "kept", share
        for v in dst.values():
            v.fill_(POISON)
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        path.run(src, dst, ring, device_bytes)
        assert torch.cuda.max_memory_allocated() - base <= device_bytes + TABLES_SLACK
        _check(src, dst, torch.bfloat16)
        seen += path.last["device_cast_elements"] > 0
    assert seen == 5


def test_direct_copies_follow_new_buffers_on_the_device():
    """Direct copies (pinned fp32 -> fp32) are queued by one call over byte views of the
    spans: new source and target tensors are read and written, the old ones left alone."""
    src = _sources("pinned")
    path, dst = _path_and_targets(torch.float32, src)
    ring = torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)
    path.run(src, dst, ring, 1 << 20)
    assert path.last["direct_elements"] == sum(SIZES)
    _check(src, dst, torch.float32)
    src2 = {k: (-v).pin_memory() for k, v in src.items()}
    dst2 = {k: torch.full_like(v, POISON) for k, v in dst.items()}
    old = {k: v.clone() for k, v in dst.items()}
    path.run(src2, dst2, ring, 1 << 20)
    _check(src2, dst2, torch.float32)
    for k, v in old.items():
        assert torch.equal(_bits(dst[k]), _bits(v))


def test_strided_tables_fall_back_to_the_stage_op():
    """A row split of a matrix seen column-wise (thousands of short strided runs) keeps the
    stage op; mixed with a contiguous table, each goes its way and both are right."""
    import reshard as rs

    rows, cols = 513, 301
    src_l = rs.Layout(
        {
            "w": rs.flat((rows, cols), [(0, 0, rows * cols, 0)]),
            "v": rs.flat((999,), [(1, 0, 999, 0)]),
        },
        {0: rs.Storage(0, torch.float32, rows * cols), 1: rs.Storage(0, torch.float32, 999)},
    )
    dst_l = rs.Layout(
        {
            "w": rs.split((rows, cols), 1, [150, 151], [10, 11]),
            "v": rs.flat((999,), [(12, 0, 999, 0)]),
        },
        {
            10: rs.Storage(0, torch.bfloat16, rows * 150),
            11: rs.Storage(0, torch.bfloat16, rows * 151),
            12: rs.Storage(0, torch.bfloat16, 999),
        },
    )
    w, v = _values(rows * cols, 1), _values(999, 2)
    dst = {
        k: torch.full((s.numel,), POISON, dtype=torch.bfloat16, device="cuda")
        for k, s in dst_l.storages.items()
    }
    with rs.Transfer(src_l, dst_l) as sync:
        sync({0: w, 1: v}, dst)
        path, rest = sync._engine.local_paths({0: w, 1: v}, dst)
    assert path is not None and len(path.tables) == 1 and len(rest) == 2
    wc = _host_cast(w, torch.bfloat16).view(rows, cols)
    assert torch.equal(_bits(dst[10].cpu()), _bits(wc[:, :150].reshape(-1)))
    assert torch.equal(_bits(dst[11].cpu()), _bits(wc[:, 150:].reshape(-1)))
    assert torch.equal(_bits(dst[12].cpu()), _bits(_host_cast(v, torch.bfloat16)))


def test_sources_untouched_and_current_stream_ordered():
    """The path reads sources only, and it is ordered on the caller's stream: work queued
    before the call (a slow fill of the targets) comes first, and work queued right after it
    sees every target byte."""
    import reshard as rs

    src_l, dst_l = _layouts(torch.bfloat16)
    src = _sources("pinned")
    before = {k: v.clone() for k, v in src.items()}
    dst = {
        k: torch.empty(s.numel, dtype=torch.bfloat16, device="cuda")
        for k, s in dst_l.storages.items()
    }
    want = [
        _bits(_host_cast(src[i][3 : 3 + n], torch.bfloat16)).to(torch.int64).sum().item()
        for i, n in enumerate(SIZES)
    ]
    s = torch.cuda.Stream()
    with torch.cuda.stream(s), rs.Transfer(src_l, dst_l, budget_bytes_per_peer=1 << 20) as sync:
        for _ in range(3):
            torch.cuda._sleep(50_000_000)  # the fills below wait for this, the sync for them
            for v in dst.values():
                v.fill_(POISON)
            sync(src, dst)
            sums = [_bits(dst[1000 + i][1:]).to(torch.int64).sum() for i in range(len(SIZES))]
            got = [x.item() for x in sums]  # .item() syncs stream s
            assert got == want
    _check(src, dst, torch.bfloat16)
    for k, v in before.items():
        assert torch.equal(_bits(src[k]), _bits(v))


# ------------------------------------------------------------------ stage_h2d's queued pipeline


def _scattered_table(rng, n_rows, max_len):
    """Rows of random lengths at increasing source offsets with gaps, landing in the target in
    a shuffled order with gaps (a non-dense target: device staging and the scatter kernel);
    some rows strided. Returns (desc, source elements, target elements)."""
    lens = rng.integers(1, max_len, n_rows)
    counts = np.where(rng.random(n_rows) < 0.2, rng.integers(2, 4, n_rows), 1)
    so, rows = 0, []
    for n, c in zip(lens.tolist(), counts.tolist(), strict=True):
        rows.append([so, n + 1, 0, 0, n, c])
        so += c * (n + 1) + int(rng.integers(0, 5))
    do = 0
    for i in rng.permutation(n_rows).tolist():
        n, c = rows[i][4], rows[i][5]
        rows[i][2], rows[i][3] = do, n + 2
        do += c * (n + 2) + int(rng.integers(0, 3))
    return np.array(rows, np.int64), so + 8, do + 8


@pytest.mark.parametrize("dst_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("target", ["dense", "scattered"])
@pytest.mark.parametrize("src_kind", ["pageable", "pinned"])
@pytest.mark.parametrize("ring_mib", [1, 4, 64])
def test_stage_h2d_queue_matches_one_thread(dst_dtype, target, src_kind, ring_mib):
    """Tables of several MiB through stage_h2d with the host's threads packing one queue of
    sub-chunks (rings of 2 to 16 slots, a partial last chunk and sub-chunk), bit for bit the
    host cast, and the same as with one host thread (the chunk-at-a-time loop); nothing
    outside the table's runs written, the source untouched."""
    from reshard import _ops as ops

    if src_kind == "pinned" and dst_dtype == torch.float32:
        pytest.skip("equal dtypes from page-locked memory go direct, not through the ring")
    rng = np.random.default_rng(ring_mib * 7 + len(target))
    if target == "dense":
        n = 3_000_017
        desc = np.array([[5, 0, 0, 0, n, 1]], np.int64)
        sn, dn = n + 9, n
    else:
        desc, sn, dn = _scattered_table(rng, 900, 6000)
    src = _values(sn, ring_mib)
    if src_kind == "pinned":
        src = src.pin_memory()
    before = src.clone()
    want = torch.full((dn,), POISON, dtype=dst_dtype)
    torch.ops.reshard.copy_runs(src, torch.from_numpy(desc), want)  # the host's cast (C core)
    ring = torch.empty(ring_mib << 20, dtype=torch.uint8, pin_memory=True)
    threads = torch.get_num_threads()
    outs, stats = [], []
    try:
        for t in (max(threads, 4), 1):
            torch.set_num_threads(t)
            dst = torch.full((dn,), POISON, dtype=dst_dtype, device="cuda")
            stats.append(ops.stage_h2d(src, desc, ring, dst)._asdict())
            outs.append(dst.cpu())  # every byte landed: stage_h2d returned after its copies
    finally:
        torch.set_num_threads(threads)
    for got in outs:
        assert torch.equal(_bits(got), _bits(want))
    assert torch.equal(_bits(src), _bits(before))
    wire = int((desc[:, 4] * desc[:, 5]).sum()) * min(4, dst_dtype.itemsize)
    for s in stats:
        assert s["ring_bytes"] == wire and s["direct_copies"] == 0
        assert s["chunks"] == -(-wire // s["slot_bytes"])
        assert s["host_waits"] <= max(0, s["chunks"] - s["slots"]) + 1
    queued, one = stats
    assert (
        queued["slot_bytes"] <= 4 << 20 and queued["slots"] * queued["slot_bytes"] <= ring.numel()
    )
    assert one["slots"] <= 4  # one thread: the chunk-at-a-time loop's cut


@pytest.mark.parametrize("n", [(1 << 18) + 1, (1 << 20) + 17, 3 << 21, (20 << 20) + 5])
@pytest.mark.parametrize("threads", [2, 3, 16])
def test_stage_h2d_queue_sizes(n, threads):
    """Dense fp32 -> bf16 tables through the queue from just over two sub-chunks to many slots,
    on teams of 2, 3 and 16 threads: bit for bit torch's cast, nothing past the table written,
    the progress word at the table's end (in elements: scale 1)."""
    from reshard import _ops as ops

    src = _values(n + 3, n % 97)
    want = _host_cast(src[3:], torch.bfloat16)
    ring = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True)
    before = torch.get_num_threads()
    word = torch.zeros(4, dtype=torch.int64)
    word[3] = 1
    try:
        torch.set_num_threads(threads)
        dst = torch.full((n + 64,), POISON, dtype=torch.bfloat16, device="cuda")
        out = torch.ops.reshard.stage_h2d(src, torch.tensor([[3, 0, 0, 0, n, 1]]), ring, dst, word)
        stats = ops.StageStats(*out.tolist())
    finally:
        torch.set_num_threads(before)
    assert torch.equal(_bits(dst[:n].cpu()), _bits(want))
    assert (dst[n:].cpu() == POISON).all()
    assert int(word[0]) == n
    assert stats.chunks == -(-2 * n // stats.slot_bytes) and stats.ring_bytes == 2 * n


def test_stage_h2d_queue_ordered_on_the_current_stream():
    """The queued pipeline's copies follow work queued before the call on the caller's stream
    (a slow fill of the target) and precede work queued after it."""
    from reshard import _ops as ops

    n = 4_000_003
    src = _values(n, 5)
    want = _host_cast(src, torch.bfloat16)
    ring = torch.empty(16 << 20, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for _ in range(2):
            torch.cuda._sleep(50_000_000)
            dst.fill_(POISON)
            ops.stage_h2d(src, np.array([[0, 0, 0, 0, n, 1]], np.int64), ring, dst)
            total = _bits(dst).to(torch.int64).sum().item()
            assert total == _bits(want).to(torch.int64).sum().item()
    assert torch.equal(_bits(dst.cpu()), _bits(want))


def test_stage_only_calls_return_with_sources_read():
    """reshard.h2d with pageable sources whose spans each fill a ring slot or more (stage ops
    only: no side stream, no final wait of its own): the sources are rewritten as soon as the
    call returns and the targets still hold the cast of the values they had; work queued after
    the call on the caller's stream sees every target byte, work queued before it (a slow fill
    of the targets) comes first. One dense span and one table of several spans into a target
    with gaps (the op's device scatter)."""
    from typing import NamedTuple

    from reshard.h2d import HostToDevice, LocalSpans, contiguous_spans

    class Table(NamedTuple):
        src_location: int
        dst_location: int
        desc: torch.Tensor

    n = 2_000_003
    dense = torch.tensor([[3, 0, 1, 0, n, 1]], dtype=torch.int64)
    m, gap = 400_001, 5
    rows = torch.tensor([[k * m, 0, 2 + k * (m + gap), 0, m, 1] for k in range(4)])
    tables = [Table(0, 10, dense), Table(1, 11, rows)]
    path = HostToDevice([LocalSpans(t, contiguous_spans(t.desc.numpy())) for t in tables])
    ring = torch.empty(4 << 20, dtype=torch.uint8, pin_memory=True)
    src = {0: _values(n + 5, 3), 1: _values(4 * m, 4)}
    dst = {
        10: torch.empty(n + 2, dtype=torch.bfloat16, device="cuda"),
        11: torch.empty(2 + 4 * (m + gap), dtype=torch.bfloat16, device="cuda"),
    }
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for call in range(3):
            want = {k: torch.full(v.shape, POISON, dtype=torch.bfloat16) for k, v in dst.items()}
            for t in tables:
                torch.ops.reshard.copy_runs(src[t.src_location], t.desc, want[t.dst_location])
            torch.cuda._sleep(50_000_000)
            for v in dst.values():
                v.fill_(POISON)
            path.run(src, dst, ring, 0)
            for v in src.values():
                v.fill_(float(call + 1))  # read already: the targets keep the old values
            got = {k: v.cpu() for k, v in dst.items()}  # .cpu() waits on stream s
            for k in dst:
                assert torch.equal(_bits(got[k]), _bits(want[k])), f"call {call}, target {k}"
            assert path.last["staged_pieces"] == 1 and path.last["staged_tables"] == 1
            assert path.last["ring_pieces"] == path.last["direct_copies"] == 0
