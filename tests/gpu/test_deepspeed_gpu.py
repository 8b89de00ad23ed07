"""DeepSpeed ZeRO-1/2/3 with CPU-offloaded optimizer on one GPU (world 1, NCCL).

describe() the CPU masters and Adam moments (and the GPU bf16 params), transfer them into GPU
targets, compare bitwise with DeepSpeed's safe_get_full_*; then write modified GPU values back
into the engine's CPU storage and check DeepSpeed sees them, and that refresh_params() rebuilds
the bf16 params from them. Skips when CUDA or DeepSpeed is missing (the H200 has no DeepSpeed:
benchmarks/prepare_wheels.sh builds the wheels it needs).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/_spawn.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "deepspeed"))  # _dsutil.py

from _spawn import run_ranks  # noqa: E402

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip(
    "deepspeed",
    reason="DeepSpeed is not installed on this GPU machine (benchmarks/prepare_wheels.sh builds "
    "the wheels that benchmarks/h200.sh installs)",
)

ENV = {"DS_ACCELERATOR": "cuda", "NCCL_NVLS_ENABLE": "0"}


def _worker(rank, world, stages):
    from _dsutil import (
        assert_bitwise,
        check_targets,
        ds_env,
        make_engine,
        reference,
        replicated_targets,
        train,
    )

    ds_env(rank, world)
    import reshard as rs
    from reshard.integrations import deepspeed as rsds

    done = []
    for stage in stages:
        for model in ("mlp", "block"):
            tag = f"gpu stage {stage} offload cpu {model}"
            engine = make_engine(stage, "cpu", model)
            train(engine, model, 2, seed=1, rank=rank)
            for kind in ("param", "fp32", "exp_avg", "exp_avg_sq"):
                live = rsds.describe(engine, kind)
                devices = {b.device.type for b in live.buffers.values()}
                assert devices == ({"cuda"} if kind == "param" else {"cpu"}), (tag, kind, devices)
                want = reference(engine, kind)
                dst, bufs = replicated_targets(live, [0], device="cuda")
                rep = rs.Transfer(live.layout, dst)(live, bufs)
                check_targets(dst, bufs, want, f"{tag} {kind} -> gpu")
                if kind == "param":
                    continue
                # back: GPU values * 0.5 into the engine's CPU storage
                for b in bufs.values():
                    b.mul_(0.5)
                rs.Transfer(dst, live.layout)(bufs, live)
                got = reference(engine, kind)
                for n in want:
                    assert_bitwise(got[n], want[n] * 0.5, f"{tag} {kind} <- gpu {n}")
                done.append((tag, kind, rep.seconds["total"]))
            # masters were halved: refresh_params rebuilds bf16 params from them
            rsds.refresh_params(engine)
            masters = reference(engine, "fp32")
            params = reference(engine, "param")
            for n in masters:
                assert_bitwise(params[n], masters[n].to(params[n].dtype), f"{tag} refresh {n}")
            train(engine, model, 1, seed=2, rank=rank, first=2)  # still trains
            engine.destroy()
    return done


def test_deepspeed_offload_gpu_roundtrip(tmp_path):
    out = run_ranks(_worker, 1, tmp_path, backend="nccl", args=((1, 2, 3),), env=ENV, timeout=500)
    assert len(out[0]) == 3 * 2 * 3


def _fp16_worker(rank, world):
    """fp16 (the CPU accelerator has none): an overflow-skipped first step creates no moments
    (NotReadyError), then the first applied step does; all kinds checked bitwise on the GPU."""
    from _dsutil import (
        check_targets,
        ds_env,
        make_engine,
        reference,
        relink_moments,
        replicated_targets,
        train,
    )

    ds_env(rank, world)
    import reshard as rs
    from reshard.errors import NotReadyError
    from reshard.integrations import deepspeed as rsds

    out = []
    for stage in (2, 3):
        fp16 = {"enabled": True, "loss_scale": 0, "initial_scale_power": 30, "hysteresis": 1}
        engine = make_engine(stage, "cpu", "mlp", dtype="fp16", config_extra={"fp16": fp16})
        train(engine, "mlp", 1, seed=1, rank=rank)
        assert not engine.was_step_applied(), "2**30 loss scale should overflow fp16"
        with pytest.raises(NotReadyError, match="first applied"):
            rsds.describe(engine, "exp_avg")
        skipped = 1
        while not engine.was_step_applied():
            assert skipped < 40, "the loss scale never came down"
            train(engine, "mlp", 1, seed=2, rank=rank, first=skipped)
            skipped += 1
        relink_moments(engine)
        for kind in ("param", "fp32", "exp_avg", "exp_avg_sq"):
            live = rsds.describe(engine, kind)
            dst, bufs = replicated_targets(live, [0], device="cuda")
            rs.Transfer(live.layout, dst)(live, bufs)
            check_targets(dst, bufs, reference(engine, kind), f"fp16 stage {stage} {kind}")
        out.append((stage, skipped))
        engine.destroy()
    return out


def test_deepspeed_fp16_gpu(tmp_path):
    out = run_ranks(_fp16_worker, 1, tmp_path, backend="nccl", env=ENV, timeout=300)
    assert [o[0] for o in out[0]] == [2, 3]


def _fp16_sync_worker(rank, world):
    """SyncAfterStep under fp16 loss scaling: steps DeepSpeed skips on overflow neither count nor
    sync (every=2; steps: skip, ok, ok -> sync, skip, ok, ok -> sync)."""
    from _dsutil import batch, check_targets, ds_env, make_engine, reference, replicated_targets

    ds_env(rank, world)
    from reshard.integrations import deepspeed as rsds

    out = []
    for stage in (1, 2, 3):
        for offload in ("none", "cpu"):
            tag = f"fp16 stage {stage} offload {offload}"
            engine = make_engine(stage, offload, "mlp", dtype="fp16")
            live = rsds.describe(engine, "param")
            p_layout, p_bufs = replicated_targets(live, [0], device="cuda")
            sync = rsds.SyncAfterStep(engine, {"param": (p_layout, p_bufs)}, every=2)
            for s, overflow in enumerate((True, False, False, True, False, False)):
                loss = engine(batch(engine, "mlp", 40 + s)).float().pow(2).mean()
                if overflow:
                    loss = loss * float("inf")
                engine.backward(loss)
                sync.step()
                assert engine.was_step_applied() != overflow, f"{tag} step {s}: no real skip"
                if s in (2, 5):
                    check_targets(p_layout, p_bufs, reference(engine, "param"), f"{tag} {s}")
            assert engine.skipped_steps == 2, (tag, engine.skipped_steps)
            assert (sync.applied_steps, sync.syncs) == (4, 2), (tag, sync.applied_steps)
            out.append(tag)
            engine.destroy()
    return out


def test_deepspeed_fp16_skipped_steps_do_not_sync(tmp_path):
    out = run_ranks(_fp16_sync_worker, 1, tmp_path, backend="nccl", env=ENV, timeout=300)
    assert len(out[0]) == 6
