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
