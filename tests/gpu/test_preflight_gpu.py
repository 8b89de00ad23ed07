"""A repeated call's short path with CUDA buffers (CPU sources -> CUDA targets, as FSDP2's
offloaded state into device partitions): after a passing call, each change made in place to
the same target tensors must send the next call through every check and be refused before
any write; undone, the call passes again. World 1 under NCCL (the current device enters the
key) and without a process group. Skipped without a CUDA device."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _spawn import run_ranks  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

N = 4096
POISON = -777.0


def _set_data(t, new):
    old = t.data
    t.data = new
    return lambda: setattr(t, "data", old)


def _resize(t, *nbytes):
    st = t.untyped_storage()
    n = st.nbytes()
    for size in nbytes:
        st.resize_(size)
    return lambda: st.resize_(n)


def _requires_grad(t):
    t.requires_grad_(True)
    return lambda: t.requires_grad_(False)


# name -> (change(target) -> undo, what the refusal says)
CHANGES = {
    "freed": (lambda t: _resize(t, 0), "its storage is freed"),
    "reallocated_smaller": (lambda t: _resize(t, 0, 4 * N - 4), "fewer than the"),
    "requires_grad": (lambda t: _requires_grad(t), "requires grad"),
    "retyped": (lambda t: _set_data(t, t.view(torch.int32)), "dtype torch.int32"),
    "strided": (lambda t: _set_data(t, t.as_strided((N,), (0,))), "must be contiguous"),
}


def _check_changes():
    import reshard as rs

    src_l = rs.Layout({"w": rs.flat((N,), [(0, 0, N, 0)])}, {0: rs.Storage(0, torch.float32, N)})
    dst_l = rs.Layout({"w": rs.flat((N,), [(10, 0, N, 0)])}, {10: rs.Storage(0, torch.float32, N)})
    sync = rs.Transfer(src_l, dst_l)
    sb = {0: torch.arange(float(N))}
    db = {10: torch.full((N,), POISON, device="cuda")}
    out = []
    for name, (change, why) in CHANGES.items():
        sync(sb, db)
        torch.cuda.synchronize()
        assert torch.equal(db[10].cpu(), sb[0]), name
        db[10].fill_(POISON)
        undo = change(db[10])
        with pytest.raises(rs.PreflightError, match=why):
            sync(sb, db)
        undo()
        if name not in ("freed", "reallocated_smaller"):  # their bytes came back undefined
            assert bool((db[10] == POISON).all()), f"{name}: written"
        out.append(name)
    sync(sb, db)
    torch.cuda.synchronize()
    assert torch.equal(db[10].cpu(), sb[0])
    return out, sync._engine.transport


def _worker(rank, world_size):
    torch.cuda.set_device(0)
    return _check_changes()


def test_short_path_sees_in_place_changes_of_cuda_targets_nccl(tmp_path):
    (res,) = run_ranks(_worker, 1, tmp_path, backend="nccl", timeout=240)
    assert res == (list(CHANGES), "nccl")


def test_short_path_sees_in_place_changes_of_cuda_targets_without_group():
    assert _check_changes() == (list(CHANGES), "local")
