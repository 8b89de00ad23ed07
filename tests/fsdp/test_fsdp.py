"""reshard.integrations.fsdp / dtensor against real FSDP2 (fully_shard) models on gloo ranks.

CPU, spawned gloo ranks. References are DTensor.full_tensor() of the parameters and of the
torch.optim AdamW state, computed in the test only; targets are poisoned (NaN) so an unwritten
element shows; FSDP2's own padding is poisoned so a read or write of it shows. Several
configurations share one spawn so the module stays within a few minutes on 2 cores.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/_spawn.py
sys.path.insert(0, str(Path(__file__).resolve().parent))  # _fsdputil.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "deepspeed"))  # _dsutil.py

from _spawn import run_ranks

ENV = {"RESHARD_TEST_THREADS": "1"}
KINDS = ("param", "exp_avg", "exp_avg_sq")
MOMENTS = ("exp_avg", "exp_avg_sq")


def _describe(net, opt, kind):
    from reshard.integrations import fsdp as rsfsdp

    return rsfsdp.describe(net, kind) if kind == "param" else rsfsdp.describe(net, kind, opt)


def _check_views(net, opt, live, kind):
    """Every described buffer is the live local tensor FSDP2 / the optimizer holds (a view)."""
    locals_ = []
    for p in net.parameters():
        t = p if kind == "param" else (opt.state.get(p) or {}).get(kind)
        if t is not None and t._local_tensor.numel():
            locals_.append(t._local_tensor)
    assert len(live.buffers) == len(locals_), (len(live.buffers), len(locals_))
    ptrs = {(b.data_ptr(), b.numel()) for b in live.buffers.values()}
    assert ptrs == {(t.data_ptr(), t.numel()) for t in locals_}


# ------------------------------------------------------------------------------- geometry


def _geometry_worker(rank, world, modes):
    import torch
    from _dsutil import assemble, assert_bitwise
    from _fsdputil import (
        full_moments,
        make_fsdp,
        poison_padding,
        reference,
        same_layout_everywhere,
        train,
    )
    from torch.distributed.device_mesh import init_device_mesh

    from reshard.errors import NotReadyError

    mesh = init_device_mesh("cpu", (world,))
    done = []
    for mode, dtype in modes:
        dt = getattr(torch, dtype) if dtype else None
        tag = f"{mode} {dtype} dp {world}"
        net, opt = make_fsdp(mesh, seed=1, mode=mode, dtype=dt)
        for kind in MOMENTS:
            with pytest.raises(NotReadyError, match="no optimizer state yet"):
                _describe(net, opt, kind)
        train(net, opt, 2, seed=2, rank=rank, dtype=dt)
        assert full_moments(net, opt, "exp_avg")  # the optimizer stepped
        undo, intact, npad = poison_padding(net)
        try:
            for kind in KINDS:
                live = _describe(net, opt, kind)
                assert same_layout_everywhere(live.layout), f"{tag} {kind}: layouts differ"
                want = reference(net, opt, kind)
                assert sorted(live.layout.tensors) == sorted(want)
                assert live.check() is None
                _check_views(net, opt, live, kind)
                got = assemble(live.layout, live.buffers)
                for n in want:
                    assert_bitwise(got[n], want[n], f"{tag} {kind} {n}")
                if "offload" in mode:
                    assert all(b.device.type == "cpu" for b in live.buffers.values())
            assert intact()
        finally:
            undo()
        done.append((tag, npad))
    return done


@pytest.mark.parametrize("world", [2, 3])
def test_layouts_match_full_tensor(world, tmp_path):
    modes = [("fp32", None), ("fp32", "bfloat16"), ("mp", None), ("offload", None)]
    modes.append(("offload_mp", None))
    out = run_ranks(_geometry_worker, world, tmp_path, args=(modes,), env=ENV, timeout=300)
    assert len(out[0]) == len(modes)
    assert sum(n for r in out for _, n in r) > 0  # padding existed and was poisoned
