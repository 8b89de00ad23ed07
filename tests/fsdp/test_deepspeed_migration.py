"""Live migration between DeepSpeed ZeRO-3 (optimizer offloaded to CPU) and FSDP2, both ways.

The same model class on both sides (tensor names = named_parameters()). DeepSpeed's fp32
masters go into FSDP2's sharded fp32 parameters and its Adam moments into torch AdamW state,
bitwise (references: DeepSpeed's safe_get_full_* accessors and DTensor.full_tensor()); then one
training step on each side agrees within a stated tolerance: the forward is bitwise equal (both
run the bf16 cast of the same masters), the gradient reductions differ (DeepSpeed reduces bf16
gradients in its own order, FSDP2 with reduce_dtype=fp32).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/_spawn.py
sys.path.insert(0, str(Path(__file__).resolve().parent))  # _fsdputil.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "deepspeed"))  # _dsutil.py

from _spawn import run_ranks

try:
    import deepspeed  # noqa: F401
except ImportError as exc:  # installed by `make test` (deps-deepspeed): missing is a broken setup
    raise ImportError(
        "tests/fsdp/test_deepspeed_migration.py needs DeepSpeed: run `make deps-deepspeed`"
    ) from exc

pytestmark = pytest.mark.usefixtures("deepspeed_cpu_ops")

ENV = {"DS_ACCELERATOR": "cpu", "RESHARD_TEST_THREADS": "1"}
MOMENTS = ("exp_avg", "exp_avg_sq")
# After one step from bitwise-equal state the fp32 params agree within STEP_ATOL per element
# (1% of the learning rate; Adam's update is ~lr per element, and the gradients differ only by
# the bf16 rounding of their reduction).
STEP_ATOL = 1e-4
# Both sides clip gradients by their global norm (DeepSpeed's gradient_clipping, torch's
# clip_grad_norm_): a hyperparameter to carry over like lr and betas.
CLIP = 1.0


def _ds_engine(seed):
    import deepspeed
    import torch
    from _fsdputil import BETAS, LR, make_net, param_groups

    net = make_net(seed)
    opt = torch.optim.AdamW(param_groups(net), lr=LR, betas=BETAS)
    cfg = {
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
        "zero_force_ds_cpu_optimizer": False,
        "bf16": {"enabled": True},
        "gradient_clipping": CLIP,
        "steps_per_print": 10**9,
    }
    engine, _, _, _ = deepspeed.initialize(model=net, optimizer=opt, config=cfg)
    return engine


def _ds_step(engine, x):
    loss = engine(x.to(torch_bf16())).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    return loss.detach()


def _fsdp_step(net, opt, x):
    """The FSDP2 side of a step with DeepSpeed's gradient clipping (by the global norm)."""
    import torch

    loss = net(x).float().pow(2).mean()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)
    opt.step()
    opt.zero_grad()
    return loss.detach()


def torch_bf16():
    import torch

    return torch.bfloat16


def _ds_steps(engine):
    """DeepSpeed's Adam step count (one counter per sub-group of its torch AdamW)."""
    return {float(s["step"]) for s in engine.optimizer.optimizer.state.values()}


def _trainable(layout_names, net):
    return [n for n, p in net.named_parameters() if p.requires_grad and n in layout_names]


def _move(src, dst, names, budget):
    """src -> dst over the tensors `names` (a target may name a subset of its source)."""
    from _fsdputil import sub_layout

    import reshard as rs

    layout = sub_layout(dst.layout, names)
    return rs.Transfer(sub_layout(src.layout, names), layout, budget_bytes_per_peer=budget)(
        src, dst
    )


def _compare_step(ds_fp32, ds_before, fsdp_params, tag):
    """FSDP2 and DeepSpeed params after one step from the same state: within STEP_ATOL."""
    worst = 0.0
    for n, want in ds_fp32.items():
        err = float((fsdp_params[n] - want).abs().max())
        assert err <= STEP_ATOL, f"{tag} {n}: FSDP2 and DeepSpeed differ by {err:.3g}"
        assert not bool(want.eq(ds_before[n]).all()), f"{tag} {n}: the step changed nothing"
        worst = max(worst, err)
    return worst


def _migrate_worker(rank, world, budget):
    import torch
    from _dsutil import assert_bitwise, ds_env, reference, relink_moments
    from _fsdputil import (
        BETAS,
        LR,
        batch,
        full_moments,
        full_params,
        make_net,
        param_groups,
        shard,
        steps_of,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    ds_env(rank, world)
    from reshard.integrations import deepspeed as rsds
    from reshard.integrations import fsdp as rsfsdp

    engine = _ds_engine(seed=0)
    for s in range(2):
        _ds_step(engine, batch(10 * s + rank))
    relink_moments(engine)

    # the FSDP2 side: other init, fp32 sharded params under a bf16 MixedPrecisionPolicy, and
    # a torch AdamW with DeepSpeed's hyperparameters and step count
    mesh = init_device_mesh("cpu", (world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    net = shard(make_net(seed=4), mesh, mp_policy=mp)
    opt = torch.optim.AdamW(param_groups(net), lr=LR, betas=BETAS)
    (ds_step,) = _ds_steps(engine)
    rsfsdp.init_adam_state(opt, ds_step)

    # DeepSpeed -> FSDP2: fp32 masters into the sharded params, moments into AdamW state;
    # the frozen LayerNorm weight has no master: its bf16 param goes (exactly) into fp32
    names = list(rsds.describe(engine, "fp32").layout.tensors)
    frozen = [n for n, p in net.named_parameters() if not p.requires_grad]
    _move(rsds.describe(engine, "fp32"), rsfsdp.describe(net, "param"), names, budget)
    _move(rsds.describe(engine, "param"), rsfsdp.describe(net, "param"), frozen, budget)
    for k in MOMENTS:
        _move(rsds.describe(engine, k), rsfsdp.describe(net, k, opt), names, budget)
    want = {k: reference(engine, k) for k in ("fp32", "param", *MOMENTS)}
    got = full_params(net)
    for n in names:
        assert_bitwise(got[n], want["fp32"][n], f"DS -> FSDP2 fp32 {n}")
    for n in frozen:
        assert_bitwise(got[n], want["param"][n].float(), f"DS -> FSDP2 frozen {n}")
    for k in MOMENTS:
        got = full_moments(net, opt, k)
        assert sorted(got) == sorted(names)
        for n in names:
            assert_bitwise(got[n], want[k][n], f"DS -> FSDP2 {k} {n}")

    # one step on each side on the same data: the forward is bitwise equal, params close
    x = batch(77 + rank)
    before = want["fp32"]
    ds_loss = _ds_step(engine, x)
    loss = _fsdp_step(net, opt, x)
    assert_bitwise(loss.detach(), ds_loss, "forward loss after DS -> FSDP2")
    relink_moments(engine)
    worst_there = _compare_step(reference(engine, "fp32"), before, full_params(net), "DS->FSDP2")

    # FSDP2 -> DeepSpeed: the FSDP2 run's state back into the engine (same step count)
    assert set(steps_of(net, opt).values()) == _ds_steps(engine)
    _move(rsfsdp.describe(net, "param"), rsds.describe(engine, "fp32"), names, budget)
    for k in MOMENTS:
        _move(rsfsdp.describe(net, k, opt), rsds.describe(engine, k), names, budget)
    rsds.refresh_params(engine)  # bf16 params from the written masters
    relink_moments(engine)
    fsdp_state = {"fp32": full_params(net), **{k: full_moments(net, opt, k) for k in MOMENTS}}
    for k in ("fp32", *MOMENTS):
        ref = reference(engine, k)
        for n in names:
            assert_bitwise(ref[n], fsdp_state[k][n], f"FSDP2 -> DS {k} {n}")
    ref = reference(engine, "param")
    for n in names:
        assert_bitwise(ref[n], fsdp_state["fp32"][n].to(torch.bfloat16), f"FSDP2 -> DS bf16 {n}")
    x = batch(88 + rank)
    ds_loss = _ds_step(engine, x)
    loss = _fsdp_step(net, opt, x)
    assert_bitwise(loss.detach(), ds_loss, "forward loss after FSDP2 -> DS")
    relink_moments(engine)
    worst_back = _compare_step(
        reference(engine, "fp32"), fsdp_state["fp32"], full_params(net), "FSDP2->DS"
    )
    engine.destroy()
    return worst_there, worst_back


def test_deepspeed_zero3_offload_to_fsdp2_and_back(tmp_path):
    out = run_ranks(_migrate_worker, 2, tmp_path, args=(512,), env=ENV, timeout=400)
    for there, back in out:  # the worst difference after a step on each side
        assert 0 < there <= STEP_ATOL and 0 < back <= STEP_ATOL
