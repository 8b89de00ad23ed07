"""rs.Stream into GPU tensors, world 1 (no process group): a CPU-offloaded fp32 master set (a
ZeRO-3 style flat CPU buffer per sub-group, padding between tensors) streamed as bf16 into
CUDA buffers, bucket by bucket, with a slow consumer holding each bucket while the next moves.
The reference is plain torch: each full fp32 tensor `.to("cuda").to(torch.bfloat16)`, compared
bitwise. Skipped without a CUDA device.

Run on the GPU host: python -m pytest -q tests/gpu/test_stream_gpu.py
"""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_ref import require_cuda_build  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
if torch.cuda.is_available():
    require_cuda_build()

# a small decoder's shapes (hidden 1024, 4 layers, vocab 32000) plus odd ones
SHAPES = {"embed": (32000, 1024)}
for i in range(4):
    SHAPES.update(
        {
            f"l{i}.qkv": (1536, 1024),
            f"l{i}.o": (1024, 1024),
            f"l{i}.up": (5632, 1024),
            f"l{i}.down": (1024, 2816),
            f"l{i}.norm": (1024,),
        }
    )
SHAPES["odd"] = (37, 19)


def _masters(pin):
    """Two sub-group storages on the CPU, 7 elements of padding after each tensor (poisoned)."""
    import reshard as rs

    g = torch.Generator().manual_seed(0)
    full = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    tensors, offs = {}, [0, 0]
    for k, (n, s) in enumerate(SHAPES.items()):
        loc = k % 2
        tensors[n] = rs.flat(s, [(loc, 0, math.prod(s), offs[loc])])
        offs[loc] += math.prod(s) + 7
    layout = rs.Layout(tensors, {i: rs.Storage(0, torch.float32, offs[i]) for i in (0, 1)})
    bufs = {i: torch.full((offs[i],), float("nan"), pin_memory=pin) for i in (0, 1)}
    for n, tl in tensors.items():
        (p,) = tl.pieces
        bufs[p.location][p.offset : p.offset + full[n].numel()] = full[n].reshape(-1)
    return full, layout, bufs


def _protected_until(stream):
    """{name: stream position}: by brute force from the placement, until when a tensor's bytes
    stay untouched (the first `ready_after` of a later bucket sharing its bytes)."""
    out = {}
    for a in stream.buckets:
        for e in a.entries:
            lo, hi = a.start + e.offset, a.start + e.offset + e.nbytes
            later = [
                b.ready_after
                for b in stream.buckets[a.index + 1 :]
                if e.nbytes and lo < b.start + b.nbytes and b.start < hi
            ]
            out[e.name] = min(later, default=len(stream.names))
    return out


@pytest.mark.parametrize(
    "pin,register",
    [(False, False), (True, False), (False, True)],
    ids=["pageable", "pinned", "registered"],
)
def test_fp32_cpu_masters_stream_as_bf16_into_gpu(pin, register):
    import time

    import reshard as rs

    full, layout, bufs = _masters(pin)
    want = {n: t.to("cuda").to(torch.bfloat16) for n, t in full.items()}
    stream = rs.Stream(
        layout, [0], 32 << 20, dtype=torch.bfloat16, device="cuda", register_host_sources=register
    )
    assert stream.device.type == "cuda"
    # the buffer: the largest bucket or two buckets, whichever is more
    assert stream.buffer_bytes == max(2 * (32 << 20), 32000 * 1024 * 2)
    bucket_of = {n: b.index for b in stream.buckets for n in b.names}
    until = _protected_until(stream)
    held_before = None
    for call in range(3):
        seen, held = [], []
        for pos, (name, t) in enumerate(stream(bufs)):
            assert t.device.type == "cuda" and t.dtype == torch.bfloat16
            if seen and bucket_of[seen[-1]] != bucket_of[name]:
                time.sleep(0.02)  # a slow consumer: queued buckets land meanwhile
            assert torch.equal(t.view(torch.int16), want[name].view(torch.int16)), (call, name)
            held = [h for h in held if h[2] > pos] + [(name, t, until[name])]
            for hn, ht, _ in held:  # never overwritten while the placement protects it
                assert torch.equal(ht.view(torch.int16), want[hn].view(torch.int16)), (call, hn)
            seen.append(name)
        assert seen == list(SHAPES)
        rep = stream.report
        assert rep.transport == "local"
        for k in rep.peak_staging_bytes:
            assert rep.peak_staging_bytes[k] <= rep.staging_bound[k], rep.summary()
        assert rep.peak_staging_bytes["device"] >= stream.buffer_bytes
        # staging is kept across calls: a later call holds exactly what the first one did
        if held_before is not None:
            assert rep.peak_staging_bytes == held_before
        held_before = dict(rep.peak_staging_bytes)
        assert rep.local_bytes == sum(w.numel() * 2 for w in want.values())
        if register:
            assert rep.host_registration.get("registered_bytes", 0) > 0, rep.host_registration
        # the sources are read, never written: their padding is still poisoned
        assert bufs[0][SHAPES["embed"][0] * 1024 :][:7].isnan().all()
    stream.close()


def test_queued_buckets_wait_for_the_callers_queued_reads():
    """The caller reads each tensor late on its own CUDA stream (a long kernel queued before
    the reads, no host synchronization) while later buckets are queued and land: a bucket
    that overwrote bytes before the caller's queued reads of them ran would show in the
    copies. Targets start poisoned; references are torch's own casts."""
    import reshard as rs

    full, layout, bufs = _masters(False)
    want = {n: t.to("cuda").to(torch.bfloat16) for n, t in full.items()}
    stream = rs.Stream(layout, [0], 8 << 20, dtype=torch.bfloat16, device="cuda")
    assert len(stream.buckets) >= 6
    # buckets queued while the one before them still moves: each writes bytes of a bucket
    # the caller has only just moved past
    assert any(b.ready_after > 0 for b in stream.buckets)
    bucket_of = {n: b.index for b in stream.buckets for n in b.names}
    list(stream(bufs))
    for call in range(2):
        stream.buffer.fill_(0xFF)
        copies, last = {}, None
        for name, t in stream(bufs):
            if bucket_of[name] != last:
                torch.cuda._sleep(40_000_000)  # ~20 ms: this bucket's reads run late
                last = bucket_of[name]
            copies[name] = t.clone()
        torch.cuda.synchronize()
        for name, c in copies.items():
            assert torch.equal(c.view(torch.int16), want[name].view(torch.int16)), (call, name)
    stream.close()


def _flat_masters(seed):
    """One flat CPU fp32 storage of SHAPES, tensors back to back (one stage_h2d pipeline writes
    a bucket of them, in order): (layout, source, {name: torch's bf16 cast on the GPU})."""
    import reshard as rs

    g = torch.Generator().manual_seed(seed)
    full = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    tensors, off = {}, 0
    for n, s in SHAPES.items():
        tensors[n] = rs.flat(s, [(0, 0, math.prod(s), off)])
        off += math.prod(s)
    layout = rs.Layout(tensors, {0: rs.Storage(0, torch.float32, off)})
    src = torch.cat([t.reshape(-1) for t in full.values()])
    return layout, src, {n: t.to("cuda").to(torch.bfloat16) for n, t in full.items()}


def test_tensors_are_yielded_while_their_bucket_moves():
    """One flat CPU fp32 storage into one large bucket: the stage op publishes how far its
    copies are queued, and the stream yields each tensor once its bytes are queued, before the
    bucket's transfer has returned. The caller's reads (a copy on its current stream, a host
    read) see every byte of each tensor; the buffer starts poisoned; references are torch's
    own casts."""
    import reshard as rs

    layout, src, want = _flat_masters(1)
    stream = rs.Stream(layout, [0], 256 << 20, dtype=torch.bfloat16, device="cuda")
    assert len(stream.buckets) == 1
    for call in range(3):
        if stream.buffer is not None:
            stream.buffer.fill_(0xFF)
        copies, host, early = {}, {}, []
        for name, t in stream({0: src}):
            early.append(stream.mover.landed.get(0) is None)
            copies[name] = t.clone()
            if name in ("embed", "l2.up", "odd"):
                host[name] = t.cpu()
        torch.cuda.synchronize()
        for name, c in copies.items():
            assert torch.equal(c.view(torch.int16), want[name].view(torch.int16)), (call, name)
        for name, h in host.items():
            assert torch.equal(h.view(torch.int16), want[name].cpu().view(torch.int16)), name
        # the first tensors were handed out while the bucket still moved
        assert early[0], early
        assert stream.report.buckets == 1
    stream.close()


def test_stopping_while_a_bucket_moves_leaves_the_stream_usable():
    """A caller that leaves the loop after the first tensor (break), or raises in its body,
    while the bucket still moves: the generator finishes the bucket without yielding it, the
    error is the caller's own, and the next call yields every tensor right."""
    import reshard as rs

    layout, src, want = _flat_masters(2)
    stream = rs.Stream(layout, [0], 256 << 20, dtype=torch.bfloat16, device="cuda")
    first = []
    for name, _ in stream({0: src}):
        first.append(name)
        break
    assert first == ["embed"]

    class Stop(Exception):
        pass

    with pytest.raises(Stop):
        for _name, _t in stream({0: src}):
            raise Stop
    stream.buffer.fill_(0xFF)
    got = {name: t.clone() for name, t in stream({0: src})}
    torch.cuda.synchronize()
    assert list(got) == list(SHAPES)
    for name, c in got.items():
        assert torch.equal(c.view(torch.int16), want[name].view(torch.int16)), name
    stream.close()


# The caching allocator splits a cached or fresh block for a large request only when more
# than 1 MiB would be left over, so a large allocation may hold up to 1 MiB more than it asked
# for; a call holds at most two large ones at once (the buffer, one op's device staging).
ALLOCATOR_SLACK = 2 << 20


@pytest.mark.parametrize(
    "source", ["pageable", "pinned", "registered", "one-pipeline", "short-runs"]
)
def test_a_call_allocates_no_more_device_memory_than_the_stream_states(source):
    """The growth of torch.cuda.max_memory_allocated over a call (the first, which allocates
    the buffer, builds the descriptor tables and uploads them, and a later one) stays within
    the device bound the Stream states for it (`report.staging_bound["device"]`: the buffer,
    the stage ops' device slots, the tables' device copies). The loop body allocates nothing;
    an earlier call (and test) of the process may have left tables cached, never more.
    "short-runs": a tensor of 131k irregular runs, whose table (uploaded whole by stage_h2d:
    7 MiB of device copies) the bound left out."""
    import reshard as rs

    if source == "one-pipeline":
        layout, src, _ = _flat_masters(3)
        bufs = {0: src}
    elif source == "short-runs":
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "rollout"))
        from _stream_workers import short_runs_source

        layout, bufs, _ = short_runs_source(1 << 21, seed=6)
    else:
        _, layout, bufs = _masters(source == "pinned")
    stream = rs.Stream(
        layout,
        [0],
        32 << 20,
        dtype=torch.bfloat16,
        device="cuda",
        register_host_sources=source == "registered",
    )
    for call in range(2):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        names = [name for name, _ in stream(bufs)]
        torch.cuda.synchronize()
        grew = torch.cuda.max_memory_allocated() - base
        bound = stream.report.staging_bound["device"] + ALLOCATOR_SLACK
        assert names == list(layout.tensors), call
        assert grew <= bound, (call, grew, bound, stream.report.summary())
        if call == 0:  # the measure sees the call's allocations: the buffer at least
            assert grew >= stream.buffer_bytes, (grew, stream.buffer_bytes)
    stream.close()
