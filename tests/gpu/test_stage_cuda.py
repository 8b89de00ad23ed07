"""reshard::stage_h2d / stage_d2h and host registration on CUDA: pageable, pinned and
registered host buffers, casts, rings smaller than one run, the direct (no bounce) path, the
number of host waits, errors, opcheck and torch.compile. Skipped without a CUDA device."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gpu_ref import (
    FLOAT_PAIRS,
    RAW,
    assert_same,
    poison,
    random_table,
    random_values,
    reference,
    require_cuda_build,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

from reshard import _ops as ops  # noqa: E402

require_cuda_build()

DEV = "cuda"


def ring(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _ids(p):
    return f"{str(p[0]).split('.')[-1]}-{str(p[1]).split('.')[-1]}"


def h2d(src_cpu, desc, dst_dtype, dst_numel, ring_bytes):
    dst = poison(dst_numel, dst_dtype, DEV)
    ref = reference(src_cpu, desc, poison(dst_numel, dst_dtype, "cpu"))
    stats = ops.stage_h2d(src_cpu, desc, ring(ring_bytes), dst)
    torch.cuda.synchronize()
    return dst.cpu(), ref, stats._asdict()


def d2h(src_cpu, desc, dst_dtype, dst_numel, ring_bytes, pin=False):
    dst = poison(dst_numel, dst_dtype, "cpu")
    if pin:
        dst = dst.pin_memory()
    ref = reference(src_cpu, desc, poison(dst_numel, dst_dtype, "cpu"))
    stats = ops.stage_d2h(src_cpu.to(DEV), desc, ring(ring_bytes), dst)
    return dst, ref, stats._asdict()  # every host write is done when stage_d2h returns


@pytest.mark.parametrize("pair", FLOAT_PAIRS + [(t, t) for t in RAW], ids=_ids)
@pytest.mark.parametrize("ring_bytes", [32, 48, 1000, 1 << 16, 4 << 20])
def test_random_tables_h2d_d2h(pair, ring_bytes):
    sdt, ddt = pair
    rng = np.random.default_rng(ring_bytes)
    # tiny rings move 16-byte chunks: keep those tables small so the test stays fast
    desc, sn, dn = random_table(rng, *((300, 500, 4) if ring_bytes >= 1000 else (40, 100, 3)))
    src = random_values(rng, sn, sdt)
    out, ref, s = h2d(src, desc, ddt, dn, ring_bytes)
    assert_same(out, ref)
    assert s["direct_copies"] == 0  # pageable source: everything through the ring
    wire = int((desc[:, 4] * desc[:, 5]).sum()) * min(sdt.itemsize, ddt.itemsize)
    assert s["ring_bytes"] == wire  # the narrower dtype crosses the link
    assert s["chunks"] == (-(-wire // s["slot_bytes"]) if wire else 0)
    # one wait per reused slot plus one final wait: never one per run
    assert s["host_waits"] <= max(0, s["chunks"] - s["slots"]) + 1
    out, ref, s = d2h(src, desc, ddt, dn, ring_bytes)
    assert_same(out, ref)
    assert s["host_waits"] == s["chunks"]


def test_ring_smaller_than_one_run():
    n = 1_000_003
    src = torch.randn(n + 1)
    desc = np.array([[1, 0, 2, 0, n, 1]], dtype=np.int64)
    out, ref, s = h2d(src, desc, torch.bfloat16, n + 5, 64)
    assert_same(out, ref)
    assert s["chunks"] == -(-(2 * n) // 32)
    out, ref, _ = d2h(src, desc, torch.float16, n + 5, 64)
    assert_same(out, ref)


def _long_runs_table(rng, elem_bytes):
    """Long runs (direct-eligible: >= 256 KiB each, one strided 2-D row) mixed with short
    ones that must still go through the ring."""
    long_len = (300 << 10) // elem_bytes
    rows = [
        [0, 0, 0, 0, long_len, 1],
        [long_len + 7, long_len + 3, long_len + 11, long_len + 5, long_len, 3],  # 2-D
        [17, 0, 5 * long_len + 100, 0, 33, 1],  # short: ring
        [100, 9, 6 * long_len, 8, 5, 40],  # short, strided: ring
    ]
    desc = np.array(rows, dtype=np.int64)[rng.permutation(4)]
    return desc, 5 * long_len + 200, 7 * long_len


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_pinned_source_goes_direct(dtype):
    rng = np.random.default_rng(1)
    desc, sn, dn = _long_runs_table(rng, dtype.itemsize)
    src = random_values(rng, sn, dtype).pin_memory()
    out, ref, s = h2d(src, desc, dtype, dn, 1 << 16)
    assert_same(out, ref)
    long_len = int(desc[:, 4].max())
    assert s["direct_copies"] == 2
    assert s["direct_bytes"] == 4 * long_len * dtype.itemsize
    assert s["ring_bytes"] == (33 + 5 * 40) * dtype.itemsize
    # a cast cannot go direct: all through the ring
    if dtype == torch.float32:
        out, ref, s = h2d(src, desc, torch.bfloat16, dn, 1 << 16)
        assert_same(out, ref)
        assert s["direct_copies"] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_pinned_target_goes_direct(dtype):
    rng = np.random.default_rng(2)
    desc, sn, dn = _long_runs_table(rng, dtype.itemsize)
    src = random_values(rng, sn, dtype)
    out, ref, s = d2h(src, desc, dtype, dn, 1 << 16, pin=True)
    assert_same(out, ref)
    assert s["direct_copies"] == 2


def test_pinned_short_runs_repeated_calls():
    """A pinned source (and a pinned target) whose rows are all too short to go direct: the op
    remembers that split after the first call; every call moves the same data through the ring,
    also after the table's contents changed in place."""
    rng = np.random.default_rng(4)
    n, ln = 500, 256
    starts = rng.choice(3 * n, n, replace=False) * ln
    z = np.zeros(n, np.int64)
    desc = ops.as_desc(np.stack([starts, z, np.arange(n) * ln, z, z + ln, z + 1], 1))
    src = random_values(rng, 3 * n * ln, torch.float32).pin_memory()
    r = ring(1 << 16)
    for call in range(3):
        if call == 2:  # an in-place edit: a new split, still all through the ring
            desc[:, 0] = torch.from_numpy(rng.choice(3 * n, n, replace=False) * ln)
        dst = poison(n * ln, torch.float32, DEV)
        s = ops.stage_h2d(src, desc, r, dst)
        torch.cuda.synchronize()
        assert_same(dst.cpu(), reference(src, desc.numpy(), poison(n * ln, torch.float32, "cpu")))
        assert s.direct_copies == 0 and s.ring_bytes == n * ln * 4
        back = poison(3 * n * ln, torch.float32, "cpu").pin_memory()
        rev = ops.as_desc(desc.numpy()[:, [2, 3, 0, 1, 4, 5]].copy())
        s = ops.stage_d2h(dst, rev, r, back)
        ref = reference(dst.cpu(), rev.numpy(), poison(3 * n * ln, torch.float32, "cpu"))
        assert_same(back, ref)
        assert s.direct_copies == 0


def test_host_register_in_place():
    rng = np.random.default_rng(3)
    desc, sn, dn = _long_runs_table(rng, 4)
    src = random_values(rng, sn, torch.float32)
    assert not src.is_pinned()
    assert torch.ops.reshard.host_register(src) == 1
    try:
        assert src.is_pinned()
        assert torch.ops.reshard.host_register(src) == 0  # already: nothing to undo
        out, ref, s = h2d(src, desc, torch.float32, dn, 1 << 16)
        assert_same(out, ref)
        assert s["direct_copies"] == 2
    finally:
        torch.ops.reshard.host_unregister(src)
    assert not src.is_pinned()
    with pytest.raises(RuntimeError, match="host_unregister"):
        torch.ops.reshard.host_unregister(src)
    # a tensor from the pinned allocator is already pinned: registering does nothing
    p = torch.empty(1000).pin_memory()
    assert torch.ops.reshard.host_register(p) == 0
    with pytest.raises(RuntimeError, match="CPU tensor"):
        torch.ops.reshard.host_register(torch.zeros(4, device=DEV))


def test_registered_target_d2h():
    rng = np.random.default_rng(4)
    desc, sn, dn = _long_runs_table(rng, 2)
    src = random_values(rng, sn, torch.bfloat16).to(DEV)
    dst = poison(dn, torch.bfloat16, "cpu")
    ref = reference(src.cpu(), desc, dst)
    assert torch.ops.reshard.host_register(dst) == 1
    try:
        assert ops.stage_d2h(src, desc, ring(1 << 16), dst).direct_copies == 2
        assert_same(dst, ref)
    finally:
        torch.ops.reshard.host_unregister(dst)


def test_stage_errors_write_nothing():
    src = torch.randn(100)
    dst = torch.full((100,), 7.0, device=DEV)
    good = torch.tensor([[0, 0, 0, 0, 50, 1]])
    h2d_op, d2h_op = torch.ops.reshard.stage_h2d, torch.ops.reshard.stage_d2h
    with pytest.raises(RuntimeError, match="pinned"):
        h2d_op(src, good, torch.empty(1024, dtype=torch.uint8), dst)
    with pytest.raises(RuntimeError, match="too small"):
        h2d_op(src, good, ring(16), dst)
    with pytest.raises(RuntimeError, match="16-byte"):
        h2d_op(src, good, ring(1024)[1:], dst)
    with pytest.raises(RuntimeError, match="row 1"):
        h2d_op(src, torch.tensor([[0, 0, 0, 0, 50, 1], [90, 0, 60, 0, 20, 1]]), ring(1024), dst)
    with pytest.raises(RuntimeError, match="CPU tensor"):
        h2d_op(src.to(DEV), good, ring(1024), dst)
    with pytest.raises(RuntimeError, match="dst must be a CPU tensor"):
        d2h_op(src, good, ring(1024), torch.zeros(100).to(DEV))
    with pytest.raises(RuntimeError, match="src must be a CPU tensor"):
        h2d_op(dst, good, ring(1024), dst.clone())
    with pytest.raises(RuntimeError, match="cannot copy"):
        h2d_op(src, good, ring(1024), torch.zeros(100, dtype=torch.int32, device=DEV))
    r = ring(4096)
    with pytest.raises(RuntimeError, match="ring overlaps"):
        h2d_op(r[:400].view(torch.float32), good, r, dst)
    assert torch.equal(dst.cpu(), torch.full((100,), 7.0))
    host = torch.full((100,), 7.0)
    with pytest.raises(RuntimeError, match="row 0"):
        d2h_op(dst, torch.tensor([[0, 0, 60, 0, 50, 1]]), ring(1024), host)
    assert torch.equal(host, torch.full((100,), 7.0))


@pytest.mark.parametrize("op", ["stage_h2d", "stage_d2h"])
@pytest.mark.parametrize("arg,device", [("desc", "cuda"), ("ring", "cuda"), ("desc", "meta")])
def test_stage_device_mixes_name_the_argument(op, arg, device):
    host = torch.full((64,), 7.0)
    dev = torch.full((64,), 7.0, device=DEV)
    args = {
        "src": host if op == "stage_h2d" else dev,
        "desc": torch.tensor([[0, 1, 0, 1, 8, 1]]),
        "ring": ring(1024),
        "dst": dev if op == "stage_h2d" else host,
    }
    args[arg] = args[arg].to(device)
    with pytest.raises(RuntimeError, match=f"{arg} must be a"):
        getattr(torch.ops.reshard, op)(**args)
    assert torch.equal(host, torch.full((64,), 7.0))
    assert torch.equal(dev.cpu(), torch.full((64,), 7.0))


def test_stage_writes_bump_versions_and_refuse_leaves():
    desc = torch.tensor([[0, 1, 0, 1, 8, 1]])
    host = torch.arange(64.0)
    dev = torch.zeros(64, device=DEV)
    r = ring(1024)
    ops.stage_h2d(host, desc, r, dev)
    assert dev._version == 1 and r._version == 1 and host._version == 0
    ops.stage_d2h(dev, desc, r, host)
    assert host._version == 1 and r._version == 2
    leaf = torch.full((64,), 7.0, device=DEV, requires_grad=True)
    with pytest.raises(RuntimeError, match="a leaf Variable that requires grad"):
        ops.stage_h2d(host, desc, r, leaf)
    host_leaf = torch.full((64,), 7.0, requires_grad=True)
    with pytest.raises(RuntimeError, match="a leaf Variable that requires grad"):
        ops.stage_d2h(dev, desc, r, host_leaf)
    assert torch.equal(host_leaf.detach(), torch.full((64,), 7.0)) and r._version == 2
    a = torch.ones(64, requires_grad=True)
    b = a * 2
    y = b.sin()  # saves its input, b, which the stage then overwrites
    ops.stage_d2h(dev, desc, r, b.detach())
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_stage_refuses_freed_storage():
    desc = torch.tensor([[0, 1, 0, 1, 8, 1]])
    freed = torch.ones(64)
    freed.untyped_storage().resize_(0)
    dev = torch.full((64,), 7.0, device=DEV)
    with pytest.raises(
        RuntimeError, match="src needs 256 bytes of storage but its storage holds 0"
    ):
        ops.stage_h2d(freed, desc, ring(1024), dev)
    assert torch.equal(dev.cpu(), torch.full((64,), 7.0))


@pytest.mark.parametrize("view", ["conj", "neg"])
def test_stage_refuses_lazily_conjugated_or_negated_views(view):
    """torch's fallback would run the op on materialized copies: a written one asserts."""
    make = {"conj": torch.Tensor.conj, "neg": torch._neg_view}[view]
    dtype = torch.complex64 if view == "conj" else torch.float32
    desc = torch.tensor([[0, 1, 0, 1, 8, 1]])
    host = torch.arange(8.0).to(dtype)
    dev = torch.full((8,), 7.0, device=DEV).to(dtype)
    with pytest.raises(RuntimeError, match="dst is a lazily"):
        ops.stage_h2d(host, desc, ring(1024), make(dev))
    with pytest.raises(RuntimeError, match="src is a lazily"):
        ops.stage_h2d(make(host), desc, ring(1024), dev)
    back = torch.full((8,), 7.0).to(dtype)
    with pytest.raises(RuntimeError, match="dst is a lazily"):
        ops.stage_d2h(dev, desc, ring(1024), make(back))
    assert bool((dev.cpu() == 7.0).all()) and bool((back == 7.0).all())


def test_stage_on_side_stream():
    n = 1 << 20
    src_dev = torch.zeros(n, device=DEV)
    host = torch.zeros(n)
    desc = torch.tensor([[0, 0, 0, 0, n, 1]])
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)
        src_dev.fill_(5.0)
        ops.stage_d2h(src_dev, desc, ring(1 << 16), host)  # ordered after the fill
    assert bool((host == 5.0).all())
    dst = torch.zeros(n, device=DEV)
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)
        ops.stage_h2d(torch.full((n,), 2.0), desc, ring(1 << 16), dst)
        out = dst * 1  # on the side stream, after the scatter
    side.synchronize()
    assert bool((out == 2.0).all())


# opcheck's test_schema re-runs the op on clones of the inputs, and a clone of a pinned ring is
# pageable, which the ops refuse by design; the mutation contract it would check (ring and dst
# written, src and desc not) is checked directly in test_stage_mutates_only_ring_and_dst.
# test_faketensor and test_aot_dispatch_dynamic also run the real op on pageable clones, so the
# fake implementations are checked directly in test_stage_fake_impl.
STAGE_OPCHECK = ("test_autograd_registration",)


def test_stage_fake_impl():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        src, ring_ = torch.empty(64), torch.empty(256, dtype=torch.uint8)
        desc = torch.zeros(2, 6, dtype=torch.int64)
        dst = torch.empty(64, dtype=torch.bfloat16, device=DEV)
        torch.ops.reshard.stage_h2d(src, desc, ring_, dst)
        torch.ops.reshard.stage_d2h(dst, desc, ring_, src)
        assert dst.shape == (64,) and src.shape == (64,)


def test_opcheck_stage():
    rng = np.random.default_rng(8)
    desc, sn, dn = random_table(rng, 30, 40, 3)
    d = torch.from_numpy(desc)
    src = random_values(rng, sn, torch.float32)
    torch.library.opcheck(
        torch.ops.reshard.stage_h2d,
        (src, d, ring(256), poison(dn, torch.bfloat16, DEV)),
        test_utils=STAGE_OPCHECK,
    )
    torch.library.opcheck(
        torch.ops.reshard.stage_d2h,
        (src.to(DEV), d, ring(256), poison(dn, torch.float16, "cpu")),
        test_utils=STAGE_OPCHECK,
    )


def test_stage_mutates_only_ring_and_dst():
    rng = np.random.default_rng(12)
    desc, sn, dn = random_table(rng, 30, 40, 3)
    d = torch.from_numpy(desc)
    d0 = d.clone()
    src = random_values(rng, sn, torch.float32)
    s0 = src.clone()
    r = ring(256)
    r.fill_(0xA5)
    dst = poison(dn, torch.bfloat16, DEV)
    ops.stage_h2d(src, d, r, dst)
    torch.cuda.synchronize()
    assert torch.equal(src, s0) and torch.equal(d, d0)
    assert not bool((r == 0xA5).all())  # the ring was used
    assert_same(dst, reference(s0, desc, poison(dn, torch.bfloat16, "cpu")))
    dsrc = src.to(DEV)
    host = poison(dn, torch.float16, "cpu")
    ops.stage_d2h(dsrc, d, r, host)
    assert torch.equal(dsrc.cpu(), s0) and torch.equal(d, d0)
    assert_same(host, reference(s0, desc, poison(dn, torch.float16, "cpu")))


def test_torch_compile_stage():
    rng = np.random.default_rng(10)
    desc_np, sn, dn = random_table(rng, 30, 40, 3)
    desc = torch.from_numpy(desc_np)
    src = random_values(rng, sn, torch.float32)
    r = ring(512)

    @torch.compile(fullgraph=True)
    def f(src, desc, ring, dst):
        torch.ops.reshard.stage_h2d(src, desc, ring, dst)
        return dst.float() * 2

    dst = poison(dn, torch.bfloat16, DEV)
    out = f(src, desc, r, dst)
    ref = reference(src, desc_np, poison(dn, torch.bfloat16, "cpu"))
    assert_same(dst, ref)
    assert_same(out, ref.float().to(DEV) * 2)


@pytest.mark.parametrize("pair", FLOAT_PAIRS, ids=_ids)
@pytest.mark.parametrize("ring_bytes", [64, 1 << 16])
def test_dense_device_side(pair, ring_bytes):
    """Gather into / scatter out of a packed buffer (what executor arenas are): slots DMA
    straight to/from the device buffer when the wire dtype is the device buffer's dtype."""
    sdt, ddt = pair
    rng = np.random.default_rng(ring_bytes + 1)
    lens = rng.integers(1, 300, 200)
    src_off = rng.permutation(200) * 400 + rng.integers(0, 50, 200)
    dst_off = np.cumsum(lens) - lens
    z = np.zeros(200, np.int64)
    desc = np.stack([src_off, z, dst_off, z, lens, np.ones(200, np.int64)], 1)
    src = random_values(rng, 200 * 400 + 400, sdt)
    out, ref, _ = h2d(src, desc, ddt, int(lens.sum()), ring_bytes)
    assert_same(out, ref)
    back = desc[:, [2, 3, 0, 1, 4, 5]].copy()  # dense source on the device
    packed = random_values(rng, int(lens.sum()), sdt)
    out, ref, _ = d2h(packed, back, ddt, 200 * 400 + 400, ring_bytes)
    assert_same(out, ref)


@pytest.mark.parametrize("n", [3000, 9 << 20], ids=["one-pass", "queued"])
def test_stage_h2d_publishes_its_progress(n):
    """With a progress word, stage_h2d publishes base + queued elements * scale; once it
    returns, the word holds the end of the whole table. Both pipelines (one chunk at a time,
    and the host threads' queue) publish."""
    src = random_values(np.random.default_rng(3), n, torch.float32)
    dst = poison(n, torch.bfloat16, DEV)
    word = torch.tensor([0, 0, 1000, 2], dtype=torch.int64)
    desc = torch.tensor([[0, 0, 0, 0, n, 1]])
    torch.ops.reshard.stage_h2d(src, desc, ring(32 << 20), dst, word)
    assert int(word[0]) == 1000 + 2 * n
    assert torch.equal(dst.cpu().view(torch.int16), src.to(torch.bfloat16).view(torch.int16))


def test_stage_h2d_refuses_a_bad_progress_word():
    src = torch.randn(100)
    dst = torch.full((100,), 7.0, device=DEV)
    good = torch.tensor([[0, 0, 0, 0, 50, 1]])
    r = ring(4096)
    h2d_op = torch.ops.reshard.stage_h2d
    for bad in (torch.zeros(3, dtype=torch.int64), torch.zeros(4, dtype=torch.int32)):
        with pytest.raises(RuntimeError, match="progress must be a contiguous CPU int64"):
            h2d_op(src, good, r, dst, bad)
    with pytest.raises(RuntimeError, match="progress shares memory with ring"):
        h2d_op(src, good, r, dst, r[:32].view(torch.int64))
    with pytest.raises(RuntimeError, match="progress shares memory with src"):
        h2d_op(src, good, r, dst, src[:8].view(torch.int64))
    assert (dst == 7.0).all()  # refused before any write


def test_concurrent_calls_share_events_safely():
    """Stage calls on four threads at once, each on its own stream and ring, both the queued
    pipeline (a large cast) and the chunked one (a small same-dtype copy), many times: the
    events a finished call hands back to the op's pool serve the next calls, and every result
    is bitwise torch's own."""
    import concurrent.futures

    big, small = 3 << 20, 40_000
    srcs = [torch.randn(big) for _ in range(4)]
    want = [s.to(torch.bfloat16) for s in srcs]
    desc_big = torch.tensor([[0, 0, 0, 0, big, 1]])
    desc_small = torch.tensor([[0, 0, 0, 0, small, 1]])

    def work(i):
        torch.set_num_threads(4)
        stream, r = torch.cuda.Stream(), ring(16 << 20)
        bad = []
        with torch.cuda.stream(stream):
            for call in range(12):
                dst = poison(big, torch.bfloat16, DEV)
                ops.stage_h2d(srcs[i], desc_big, r, dst)
                part = poison(small, torch.float32, DEV)
                ops.stage_h2d(srcs[i], desc_small, r, part)
                stream.synchronize()
                if not torch.equal(dst.cpu().view(torch.int16), want[i].view(torch.int16)):
                    bad.append(("big", call))
                if not torch.equal(part.cpu(), srcs[i][:small]):
                    bad.append(("small", call))
        return bad

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(work, range(4)))
    assert results == [[], [], [], []]
