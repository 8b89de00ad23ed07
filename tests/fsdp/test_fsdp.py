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


# ------------------------------------------------------------------- DTensor placements, 2-D


def _dtensor_cases(mesh1, mesh2):
    """(name, mesh, placements, shape) of hand-made DTensors: uneven, empty shards, replicas,
    two mesh dims on one tensor dim, a strided shard."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    return [
        ("s0_uneven", mesh1, [Shard(0)], (7, 3)),
        ("s1_uneven", mesh1, [Shard(1)], (2, 6)),
        ("s0_empty", mesh1, [Shard(0)], (3, 2)),  # the 4th rank holds nothing
        ("rep", mesh1, [Replicate()], (5,)),
        ("s0_s1", mesh2, [Shard(0), Shard(1)], (5, 7)),
        ("s0_s0", mesh2, [Shard(0), Shard(0)], (9, 2)),
        ("rep_s0", mesh2, [Replicate(), Shard(0)], (5, 3)),
        ("s1_rep", mesh2, [Shard(1), Replicate()], (3, 5)),
        ("strided", mesh2, [_StridedShard(0, split_factor=2), Shard(0)], (8, 3)),
        ("strided_3d", mesh2, [_StridedShard(1, split_factor=2), Shard(1)], (2, 12, 2)),
        # a sliced mesh: one instance per row of mesh2, each holding a replica
        ("sliced", mesh2["b"], [Shard(0)], (5, 2)),
    ]


def _placements_worker(rank, world):
    import torch
    from _dsutil import assemble, assert_bitwise, check_targets, replicated_targets
    from _fsdputil import same_layout_everywhere
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, distribute_tensor

    import reshard as rs
    from reshard.errors import UnsupportedError
    from reshard.integrations import dtensor as rsdt

    mesh1 = init_device_mesh("cpu", (world,))
    mesh2 = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("a", "b"))
    g = torch.Generator().manual_seed(5)
    dts, full = {}, {}
    for name, mesh, placements, shape in _dtensor_cases(mesh1, mesh2):
        t = torch.randn(shape, generator=g)
        full[name] = t
        dts[name] = distribute_tensor(t, mesh, placements)
    for name, dt in dts.items():
        assert torch.equal(dt.full_tensor(), full[name]), f"{name}: torch itself disagrees"
    live = rsdt.describe(dts)
    assert same_layout_everywhere(live.layout)
    got = assemble(live.layout, live.buffers)
    for name in full:
        assert_bitwise(got[name], full[name], name)
    # read every DTensor into one fp32 and one bf16 replica on ranks 0 and 2
    for dtype in (torch.float32, torch.bfloat16):
        dst, bufs = replicated_targets(live, [0, world - 1], dtype=dtype)
        rs.Transfer(live.layout, dst, budget_bytes_per_peer=64)(live, bufs)
        check_targets(dst, bufs, full, f"replicas {dtype}")
    # and write them back from poisoned DTensors: every element of every shard is written
    for dt in dts.values():
        dt._local_tensor.fill_(float("nan"))
    rs.Transfer(dst, live.layout, budget_bytes_per_peer=64)(bufs, live)
    for name, dt in dts.items():
        want = full[name].to(torch.bfloat16).float()
        assert_bitwise(dt.full_tensor(), want, f"written back {name}")
    # a Partial placement stores no element: refused, naming it
    part = distribute_tensor(torch.ones(4), mesh1, [Partial()])
    with pytest.raises(UnsupportedError, match=r"placement Partial\(sum\) on mesh dim 0"):
        rsdt.describe({"p": part})
    return sorted(full)


def _check_against_full(net, opt, tag):
    from _dsutil import assemble, assert_bitwise
    from _fsdputil import reference, same_layout_everywhere

    for kind in KINDS:
        live = _describe(net, opt, kind)
        assert same_layout_everywhere(live.layout), f"{tag} {kind}: layouts differ"
        want = reference(net, opt, kind)
        got = assemble(live.layout, live.buffers)
        assert sorted(got) == sorted(want)
        for n in want:
            assert_bitwise(got[n], want[n], f"{tag} {kind} {n}")


def _fsdp_2d_worker(rank, world):
    import torch
    from _dsutil import check_targets, tp_targets
    from _fsdputil import BETAS, LR, full_params, make_fsdp, make_net, param_groups, shard, train
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    from torch.distributed.tensor.placement_types import _StridedShard

    import reshard as rs
    from reshard.integrations import fsdp as rsfsdp

    # HSDP: replicate over mesh dim 0, shard over mesh dim 1
    hsdp = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    net, opt = make_fsdp(hsdp, seed=3)
    assert isinstance(net.fc1.weight.placements[0], Replicate)
    train(net, opt, 2, seed=4, rank=hsdp["replicate"].get_local_rank())
    _check_against_full(net, opt, "HSDP")

    # FSDP x TP: fc1 column-parallel, fc2 row-parallel (10 over tp 2: DTensor's TP ops need
    # even shards), then FSDP over dp (5 rows -> 3 + 2, 7 rows -> 4 + 3); the data-parallel
    # mesh dim of fc1.weight carries a _StridedShard
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    net = make_net(5, hidden=10)
    parallelize_module(net, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    shard(net, mesh["dp"])
    opt = torch.optim.AdamW(param_groups(net), lr=LR, betas=BETAS)
    assert isinstance(net.fc1.weight.placements[0], _StridedShard), net.fc1.weight.placements
    train(net, opt, 2, seed=6, rank=mesh["dp"].get_local_rank())  # same data across tp
    _check_against_full(net, opt, "FSDPxTP")
    # weight sync out of FSDP x TP into bf16 TP=2 rollout buffers on ranks 0 and 1
    live = rsfsdp.describe(net, "param")
    dst, bufs = tp_targets(live, [0, 1], dtype=torch.bfloat16)
    rs.Transfer(live.layout, dst, budget_bytes_per_peer=256)(live, bufs)
    check_targets(dst, bufs, full_params(net), "FSDPxTP -> TP2 bf16")
    return True


def test_dtensor_placements(tmp_path):
    out = run_ranks(_placements_worker, 4, tmp_path, env=ENV, timeout=300)
    assert len(out[0]) == 11


def test_fsdp_2d_meshes(tmp_path):
    assert run_ranks(_fsdp_2d_worker, 4, tmp_path, env=ENV, timeout=300)[0]
