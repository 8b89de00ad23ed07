"""FSDP2 with CPUOffloadPolicy on one GPU (world 1, NCCL).

The sharded fp32 params and the AdamW moments live in (pinned) CPU memory; describe() them,
transfer the params into GPU bf16 rollout buffers and every kind into fp32 GPU partitions
(two storages on the one rank), compare bitwise with DTensor.full_tensor(); then write modified
GPU values back into the CPU state and check FSDP2 and the optimizer see them and still train.
Skips without CUDA.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/_spawn.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fsdp"))  # _fsdputil.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "deepspeed"))  # _dsutil.py

from _spawn import run_ranks  # noqa: E402

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

ENV = {"NCCL_NVLS_ENABLE": "0"}
KINDS = ("param", "exp_avg", "exp_avg_sq")


def _full(net, opt, kind):
    """World 1: each local tensor is the whole tensor (the reference; no collective, which
    NCCL could not run on CPU-offloaded tensors)."""
    out = {}
    for n, p in net.named_parameters():
        t = p if kind == "param" else (opt.state.get(p) or {}).get(kind)
        if t is not None:
            local = t.to_local()
            assert tuple(local.shape) == tuple(t.shape), n
            out[n] = local.detach().clone()
    return out


def _worker(rank, world, modes, device="cuda"):
    """device="cpu" runs the same steps over gloo (a dry run where there is no CUDA)."""
    from _dsutil import assert_bitwise, check_targets, tp_targets
    from _fsdputil import BETAS, LR, make_net, param_groups, shard, train
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    import reshard as rs
    from reshard.integrations import fsdp as rsfsdp

    mesh = init_device_mesh(device, (world,))
    pinned = device == "cuda"  # pinning needs CUDA
    done = []
    for mode in modes:
        kw = {"offload_policy": CPUOffloadPolicy(pin_memory=pinned)}
        if mode == "mp":
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        net = shard(make_net(0).to(device), mesh, **kw)
        opt = torch.optim.AdamW(param_groups(net), lr=LR, betas=BETAS)
        train(net, opt, 2, seed=1, rank=rank, device=device)
        for kind in KINDS:
            live = rsfsdp.describe(net, kind, **({} if kind == "param" else {"optimizer": opt}))
            assert {b.device.type for b in live.buffers.values()} == {"cpu"}, (mode, kind)
            if kind == "param":
                assert all(b.is_pinned() == pinned for b in live.buffers.values())
            want = _full(net, opt, kind)
            if kind == "param":
                # weight sync: CPU fp32 shards -> GPU bf16 rollout buffers
                dst, bufs = tp_targets(live, [0], dtype=torch.bfloat16, device=device)
                rs.Transfer(live.layout, dst)(live, bufs)
                check_targets(dst, bufs, want, f"{mode} {kind} -> gpu bf16")
            # fp32 device partitions: every tensor split in two, both on this GPU
            dst, bufs = tp_targets(live, [0, 0], dtype=torch.float32, device=device)
            rep = rs.Transfer(live.layout, dst)(live, bufs)
            check_targets(dst, bufs, want, f"{mode} {kind} -> gpu fp32")
            # back: GPU values * 0.5 into the CPU state FSDP2 and the optimizer hold
            for b in bufs.values():
                b.mul_(0.5)
            rs.Transfer(dst, live.layout)(bufs, live)
            got = _full(net, opt, kind)
            for n in want:
                assert_bitwise(got[n], want[n] * 0.5, f"{mode} {kind} <- gpu {n}")
            done.append((mode, kind, rep.seconds["total"]))
        train(net, opt, 1, seed=2, rank=rank, first=2, device=device)  # still trains
        assert all(p.isfinite().all() for p in _full(net, opt, "param").values())
    return done


def test_fsdp_cpu_offload_gpu_roundtrip(tmp_path):
    out = run_ranks(
        _worker, 1, tmp_path, backend="nccl", args=(("fp32", "mp"),), env=ENV, timeout=400
    )
    assert len(out[0]) == 2 * len(KINDS)
