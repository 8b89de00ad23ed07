"""reshard.hostreg and Transfer(register_host_sources=True) where CUDA is absent: registration
is an optimization, so it must degrade to a no-op that says so, and the transfer must still be
right. (The CUDA behaviour is tested in tests/gpu/.)"""

from __future__ import annotations

import pytest
import torch

import reshard as rs
from reshard.hostreg import HostRegistry, available

# With CUDA present registration really happens (tests/gpu/test_execute_gpu.py checks it);
# these assertions describe the fallback only.
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="tests the no-CUDA fallback; CUDA is present here"
)


def test_registry_is_a_noop_without_cuda():
    assert not available()
    t = torch.arange(10.0)
    with HostRegistry() as reg:
        out = reg.sync({0: t, 1: torch.zeros(0), 2: "not a tensor"})
        assert out["registered"] == [] and out["already_pinned"] == []
        assert out["registered_bytes"] == 0 and reg.registered_bytes == 0
    assert reg.close() == []


def test_transfer_with_registration_requested_still_copies():
    src = rs.Layout({"w": rs.flat((6, 4), [(0, 0, 24, 3)])}, {0: rs.Storage(0, torch.float32, 30)})
    dst = rs.Layout(
        {"w": rs.split((6, 4), 0, [2, 4], [10, 11])},
        {10: rs.Storage(0, torch.bfloat16, 8), 11: rs.Storage(0, torch.bfloat16, 16)},
    )
    flat = torch.randn(30)
    out = {
        10: torch.full((8,), -1.0, dtype=torch.bfloat16),
        11: torch.full((16,), -1.0, dtype=torch.bfloat16),
    }
    with rs.Transfer(src, dst, register_host_sources=True, register_host_targets=True) as sync:
        rep = sync({0: flat}, out)
    assert rep.host_registration["registered"] == []
    assert rep.host_registration["targets"]["registered"] == []
    w = flat[3:27].to(torch.bfloat16)
    assert torch.equal(out[10], w[:8]) and torch.equal(out[11], w[8:])


class _Seen(HostRegistry):
    """A real registry (a no-op here) that records whether each sync was told the buffers are
    those of its previous sync, and which storages it was given."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def sync(self, buffers, unchanged=False):
        self.calls.append(
            (unchanged, {k: t.untyped_storage().data_ptr() for k, t in buffers.items()})
        )
        return super().sync(buffers, unchanged=unchanged)


def test_transfer_tells_the_registry_unchanged_only_for_the_storages_it_last_saw():
    """The registries skip their pass over the buffers only when told `unchanged`: a Transfer
    says so exactly when every storage is the one the registry's previous sync was given. A
    storage swapped under the same tensor (set_), a new tensor, a storage resized in place, a
    refused call and a failed call in between are each seen."""
    n = 6
    src = rs.Layout({"w": rs.flat((n,), [(0, 0, n, 0)])}, {0: rs.Storage(0, torch.float32, n)})
    dst = rs.Layout({"w": rs.flat((n,), [(10, 0, n, 0)])}, {10: rs.Storage(0, torch.float32, n)})
    sync = rs.Transfer(src, dst, register_host_sources=True, register_host_targets=True)
    seen_src, seen_dst = sync._hostreg, sync._hostreg_targets = _Seen(), _Seen()
    sb, db = {0: torch.arange(float(n))}, {10: torch.full((n,), -1.0)}
    expect = []

    def call(unchanged, s=None, d=None):
        sync(sb if s is None else s, db if d is None else d)
        expect.append(unchanged)
        assert torch.equal((db if d is None else d)[10], (sb if s is None else s)[0])

    call(False)  # first call
    call(True)
    call(True)
    sb[0].set_(torch.arange(float(n)) + 1)  # same tensor object, new storage
    call(False)
    call(True)
    db[10] = torch.full((n,), -1.0)  # a new target tensor
    call(False)
    call(True, dict(sb), dict(db))  # new dicts, the same tensors
    st = sb[0].untyped_storage()
    st.resize_(0)
    st.resize_(4 * n)  # freed and reallocated in place (the same address or not)
    sb[0].copy_(torch.arange(float(n)) + 2)
    call(False)
    with pytest.raises(rs.PreflightError):
        sync({0: torch.zeros(n + 1)}, db)  # refused: the registries are not called
    call(True)
    sb[0] = sb[0].clone()
    with pytest.raises(rs.PreflightError):
        sync(sb, {10: torch.zeros(n - 1)})
    call(False)  # the source changed since the registry's last sync (the refused call between)
    call(True)
    assert [c[0] for c in seen_src.calls] == expect
    assert [c[0] for c in seen_dst.calls] == expect
    for reg in (seen_src, seen_dst):  # told unchanged only with the storages of the sync before
        for (unchanged, ptrs), (_, before) in zip(reg.calls[1:], reg.calls, strict=False):
            assert not unchanged or ptrs == before
