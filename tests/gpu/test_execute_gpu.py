"""`execute` / `Transfer` with every residency pair (CPU->GPU, GPU->CPU, GPU->GPU, CPU->CPU) in
one process: world 1 under NCCL (a real process group, spawned through tests/_spawn.py) and
without a group. The source is a ZeRO-style flat fp32 buffer holding several tensors; the
targets are a 2-way row split per tensor, in fp32 or bf16. The expected targets are computed
with plain torch slicing and `.to()`. Skipped without a CUDA device."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _spawn import run_ranks  # noqa: E402
from gpu_ref import StageCalls  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SHAPES = [(37, 19), (64,), (5, 7, 3), (1024, 300)]
COMBOS = [("cpu", "cuda"), ("cuda", "cpu"), ("cuda", "cuda"), ("cpu", "cpu")]


def _layouts(dst_dtype):
    import reshard as rs

    src_tensors, off = {}, 0
    dst_tensors, storages = {}, {}
    for i, shp in enumerate(SHAPES):
        n = math.prod(shp)
        src_tensors[f"t{i}"] = rs.flat(shp, [(0, 0, n, off)])
        off += n + 5  # gaps between tensors, as in padded ZeRO partitions
        a = shp[0] // 2 + 1
        b = shp[0] - a
        rest = n // shp[0]
        locs = [100 + 2 * i, 101 + 2 * i]
        dst_tensors[f"t{i}"] = rs.split(shp, 0, [a, b], locs)
        storages[locs[0]] = rs.Storage(0, dst_dtype, a * rest)
        storages[locs[1]] = rs.Storage(0, dst_dtype, b * rest)
    src = rs.Layout(src_tensors, {0: rs.Storage(0, torch.float32, off)})
    return src, rs.Layout(dst_tensors, storages), off


def _expected(flat, dst_dtype):
    out, off = {}, 0
    for i, shp in enumerate(SHAPES):
        n = math.prod(shp)
        t = flat[off : off + n].reshape(shp)
        off += n + 5
        a = shp[0] // 2 + 1
        out[100 + 2 * i] = t[:a].reshape(-1).to(dst_dtype)
        out[101 + 2 * i] = t[a:].reshape(-1).to(dst_dtype)
    return out


def _check_all(dst_dtype, use_group):
    import reshard as rs

    src_l, dst_l, numel = _layouts(dst_dtype)
    g = torch.Generator().manual_seed(0)
    flat = torch.randn(numel, generator=g) * 10
    expected = _expected(flat, dst_dtype)
    results = []
    for sdev, ddev in COMBOS:
        src = {0: flat.to(sdev)}
        dst = {k: torch.full_like(v, -777.0, device=ddev) for k, v in expected.items()}
        sync = rs.Transfer(src_l, dst_l, budget_bytes_per_peer=1 << 16)
        for _ in range(2):  # the second call reuses the plan, tables and ring
            for v in dst.values():
                v.fill_(-777.0)
            rep = sync(src, dst)
            if ddev == "cuda":
                torch.cuda.synchronize()
            for k, v in expected.items():
                got = dst[k].cpu()
                assert torch.equal(
                    got.view(torch.int16 if got.element_size() == 2 else torch.int32),
                    v.view(torch.int16 if v.element_size() == 2 else torch.int32),
                ), f"{sdev}->{ddev} {dst_dtype} location {k} differs"
        for side, bound in rep.peak_staging_bytes.items():
            assert bound <= rep.staging_bound[side], (sdev, ddev, rep.peak_staging_bytes)
        results.append((sdev, ddev, rep.transport))
    return results


def _worker(rank, world_size, dst_dtype):
    torch.cuda.set_device(0)
    return _check_all(dst_dtype, True)


@pytest.mark.parametrize("dst_dtype", [torch.float32, torch.bfloat16])
def test_execute_residency_world1_nccl(tmp_path, dst_dtype):
    (res,) = run_ranks(_worker, 1, tmp_path, backend="nccl", timeout=240, args=(dst_dtype,))
    assert [r[:2] for r in res] == COMBOS
    assert all(r[2] == "nccl" for r in res)


@pytest.mark.parametrize("dst_dtype", [torch.float32, torch.bfloat16])
def test_execute_residency_without_group(dst_dtype):
    res = _check_all(dst_dtype, False)
    assert all(r[2] == "local" for r in res)


def _moving_residency(use_group):
    """One Transfer whose buffers change residency between calls: the same tensor objects
    moved with `.data =` (a changed device under an unchanged tensor), each residency called
    twice (the second call takes preflight's short path, and with it the layout and copy
    paths derived from the last call's devices)."""
    import reshard as rs

    src_l, dst_l, numel = _layouts(torch.float32)
    flat = torch.randn(numel, generator=torch.Generator().manual_seed(1))
    expected = _expected(flat, torch.float32)
    sync = rs.Transfer(src_l, dst_l, budget_bytes_per_peer=1 << 16)
    src = {0: flat.clone()}
    dst = {k: torch.full_like(v, -777.0) for k, v in expected.items()}
    seen = []
    for sdev, ddev in COMBOS + COMBOS[::-1]:
        src[0].data = src[0].data.to(sdev)
        for v in dst.values():
            v.data = v.data.to(ddev)
        for _ in range(2):
            for v in dst.values():
                v.fill_(-777.0)
            rep = sync(src, dst)
            torch.cuda.synchronize()
            for k, v in expected.items():
                assert torch.equal(dst[k].cpu(), v), f"{sdev}->{ddev} location {k}"
        seen.append((sdev, ddev, rep.transport))
    return seen


def _moving_worker(rank, world_size):
    torch.cuda.set_device(0)
    return _moving_residency(True)


def test_repeated_calls_follow_buffers_moving_between_devices(tmp_path):
    assert all(r[2] == "local" for r in _moving_residency(False))
    (res,) = run_ranks(_moving_worker, 1, tmp_path, backend="nccl", timeout=240)
    assert all(r[2] == "nccl" for r in res)


def test_registered_source_swapped_in_place_is_registered_again():
    """Registered and settled (repeated calls with the same storages skip the registry's pass),
    then the source tensor is given another storage in place (set_, the same tensor object):
    the old storage is unregistered, the new one registered, and every call copies the bytes
    the tensor holds at that call."""
    import reshard as rs

    src_l, dst_l, numel = _layouts(torch.float32)
    flat = torch.randn(numel)
    old = flat.untyped_storage()
    dst = {
        k: torch.full((v.numel(),), -777.0, device="cuda")
        for k, v in _expected(flat, torch.float32).items()
    }

    def call():
        for v in dst.values():
            v.fill_(-777.0)
        rep = sync({0: flat}, dst)
        torch.cuda.synchronize()
        for k, v in _expected(flat, torch.float32).items():
            assert torch.equal(dst[k].cpu(), v), k
        return rep.host_registration

    with rs.Transfer(src_l, dst_l, register_host_sources=True) as sync:
        call()
        sync.wait_host_registration()
        for _ in range(3):
            reg = call()
            assert reg["registered"] == [] and reg["unregistered"] == [] and "pending" not in reg
        assert flat.is_pinned()
        fresh = torch.randn(numel)
        flat.set_(fresh.untyped_storage(), 0, (numel,))
        del fresh
        reg = call()
        assert reg["unregistered"] == [0] and reg["pending"] == [0]
        assert sync.wait_host_registration()["sources"]["registered"] == [0]
        assert flat.is_pinned() and not torch.empty(0).set_(old).is_pinned()
        for _ in range(2):
            flat.add_(1.0)  # new values in the same registered storage
            reg = call()
            assert reg["registered"] == [] and reg["unregistered"] == []
    assert not flat.is_pinned()


def test_transfer_registers_host_targets_in_place():
    """GPU -> CPU with the CPU targets page-locked in place: the D2H copies go straight into
    them (direct copies in the stage stats), results equal torch slicing, sources untouched."""
    import reshard as rs

    src_l, dst_l, numel = _layouts(torch.float32)
    flat = torch.randn(numel)
    expected = _expected(flat, torch.float32)
    # the reverse transfer: the row-split pieces on the GPU back into one CPU flat buffer
    dev = {k: v.cuda() for k, v in expected.items()}
    before = {k: v.clone() for k, v in dev.items()}
    back = torch.full((numel,), -777.0)
    with rs.Transfer(dst_l, src_l, register_host_targets=True) as sync:
        rep = sync(dev, {0: back})  # starts the registration on a thread, does not wait
        assert rep.host_registration["targets"]["pending"] == [0]
        assert sync.wait_host_registration()["targets"]["registered"] == [0] and back.is_pinned()
        with StageCalls() as calls:
            rep = sync(dev, {0: back})
        assert calls.stats and calls.stats[-1].direct_copies > 0  # direct D2H rows, no bounce
        assert rep.host_registration["targets"]["registered"] == []
        assert "pending" not in rep.host_registration["targets"]
    assert not back.is_pinned()
    off = 0
    for shp in SHAPES:
        n = math.prod(shp)
        assert torch.equal(back[off : off + n], flat[off : off + n])
        assert torch.equal(back[off + n : off + n + 5], torch.full((5,), -777.0))  # gaps
        off += n + 5
    for k, v in dev.items():
        assert torch.equal(v, before[k])


def test_transfer_registers_host_sources_in_place():
    import reshard as rs
    from reshard.hostreg import HostRegistry

    src_l, dst_l, numel = _layouts(torch.float32)
    flat = torch.randn(numel)
    expected = _expected(flat, torch.float32)
    dst = {k: torch.full_like(v, -777.0, device="cuda") for k, v in expected.items()}
    with rs.Transfer(src_l, dst_l, register_host_sources=True) as sync:
        rep = sync({0: flat}, dst)
        assert rep.host_registration["pending"] == [0]
        for k, v in expected.items():  # right while the registration runs
            assert torch.equal(dst[k].cpu(), v)
        assert sync.wait_host_registration()["sources"]["registered"] == [0]
        assert flat.is_pinned()
        for v in dst.values():
            v.fill_(-777.0)
        rep = sync({0: flat}, dst)
        assert rep.host_registration["registered"] == [] and flat.is_pinned()
        torch.cuda.synchronize()
        for k, v in expected.items():
            assert torch.equal(dst[k].cpu(), v)
        other = flat.clone()  # a new storage for location 0: the old one is released
        rep = sync({0: other}, dst)
        assert rep.host_registration["unregistered"] == [0]
        assert rep.host_registration["pending"] == [0]
        sync.wait_host_registration()
        assert not flat.is_pinned() and other.is_pinned()
    assert not other.is_pinned()  # context exit undid it
    with HostRegistry() as reg:  # memory from the pinned allocator is left alone
        p = torch.zeros(100).pin_memory()
        assert reg.sync({1: p})["already_pinned"] == [1]
    assert p.is_pinned()
