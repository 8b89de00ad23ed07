"""The DeepSpeed half of `python -m reshard.demo` (its default mode).

Per rank: a real DeepSpeed ZeRO-3 engine with its optimizer offloaded to CPU (bf16 params,
torch AdamW) trains a few steps; after every step `SyncAfterStep` syncs the bf16 params into TP=2
rollout buffers, Megatron-style (column-parallel q/k/v and linear1, row-parallel out_proj and
linear2, norms replicated; each TP group of 2 ranks holds a full copy); after the last step the fp32
masters and both Adam moments go into a CPU snapshot split over all ranks. Every target element
is compared bitwise with DeepSpeed's own accessors (`GatheredParameters`,
`safe_get_full_fp32_param`, `safe_get_full_optimizer_state`), which gather and are used only to
check. Runs inside a process group the demo set up (gloo on CPU, NCCL on GPUs).
"""

from __future__ import annotations

import logging
import math

import torch

from ._demo_common import (
    check_model_args,
    compare,
    deepspeed_env,
    model,
    print_syncs_and_verdict,
    split_targets,
    summary,
    tp_size,
)

KINDS = ("fp32", "exp_avg", "exp_avg_sq")
check_args = check_model_args  # the demo runs it on the command line's sizes


def _engine(rank, world, backend, cfg):
    """A real ZeRO-3 engine with its optimizer offloaded to CPU, as a launcher would make it."""
    deepspeed_env(rank, world, backend)
    import deepspeed
    from deepspeed.utils import logger

    logger.setLevel(logging.ERROR)
    net = model(cfg["hidden"], cfg["ffn"], cfg["vocab"], cfg["layers"])
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10**9,
    }
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    engine, _, _, _ = deepspeed.initialize(model=net, optimizer=opt, config=config)
    return engine


def _train_and_sync(engine, rank, world, cfg):
    """Train cfg["steps"] steps, bf16 params -> TP rollout buffers after each one; returns
    (rollout layout, buffers, SyncAfterStep, first sync's Report, last loss)."""
    import reshard as rs
    from reshard.integrations import deepspeed as rsds

    tp = tp_size(world)
    groups = [list(range(g, g + tp)) for g in range(0, world, tp)]
    live = rsds.describe(engine, "param")
    roll_layout, roll_bufs = split_targets(
        rs, live.layout, groups, torch.bfloat16, engine.device, tp_rules=True
    )
    sync = rsds.SyncAfterStep(
        engine, {"param": (roll_layout, roll_bufs)}, every=1, budget_bytes_per_peer=cfg["budget"]
    )
    g = torch.Generator().manual_seed(1000 + rank)
    first_report = loss = None
    for _ in range(cfg["steps"]):
        tokens = torch.randint(0, cfg["vocab"], (2, 16), generator=g).to(engine.device)
        loss = engine(tokens).float().logsumexp(-1).mean()
        engine.backward(loss)
        sync.step()
        first_report = first_report or sync.reports["param"]
    return roll_layout, roll_bufs, sync, first_report, loss


def _snapshot_and_compare(engine, world, cfg, params, reports):
    """fp32 masters and moments (CPU-offloaded) into a CPU snapshot split over all ranks,
    compared with DeepSpeed's accessors; fills `reports`, returns (bad, checked)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    import reshard as rs
    from reshard.integrations import deepspeed as rsds

    bad, checked = [], 0
    for kind in KINDS:
        live = rsds.describe(engine, kind)
        snap_layout, snap_bufs = split_targets(
            rs, live.layout, [list(range(world))], torch.float32, "cpu"
        )
        transfer = rs.Transfer(live.layout, snap_layout, budget_bytes_per_peer=cfg["budget"])
        reports[kind] = transfer(live, snap_bufs)
        get = safe_get_full_fp32_param if kind == "fp32" else None
        want = {n: get(p) if get else safe_get_full_optimizer_state(p, kind) for n, p in params}
        b, c = compare(snap_layout, snap_bufs, want, kind)
        bad += b
        checked += c
    return bad, checked


def run_rank(rank, world, backend, cfg):
    """One rank of the demo (process group already initialized); a JSON-able result."""
    engine = _engine(rank, world, backend, cfg)
    import deepspeed

    roll_layout, roll_bufs, sync, first_report, loss = _train_and_sync(engine, rank, world, cfg)
    params = list(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in params]):
        full = {n: p.data.detach().clone() for n, p in params}
    bad, checked = compare(roll_layout, roll_bufs, full, "rollout")
    reports = {"param": sync.reports["param"]}
    b, c = _snapshot_and_compare(engine, world, cfg, params, reports)
    engine.destroy()
    return {
        "bad": bad + b,
        "params": sum(math.prod(getattr(p, "ds_shape", p.shape)) for _, p in params),
        "elements_checked": checked + c,
        "loss": float(loss.detach()),
        "first_sync_s": first_report.seconds["total"],
        "reports": {k: summary(r) for k, r in reports.items()},
    }


def print_report(results, world, backend, cfg, wall):
    r0 = results[0]
    print(
        f"reshard demo: DeepSpeed ZeRO-3 engine, optimizer offloaded to CPU, {world} ranks "
        f"({backend}), {r0['params'] / 1e6:.2f}M params, {cfg['steps']} training steps"
    )
    print(
        f"  after each step: bf16 params -> TP={tp_size(world)} rollout buffers "
        "(rsds.SyncAfterStep)"
    )
    print("  after the last step: fp32 masters + exp_avg + exp_avg_sq (CPU) -> CPU snapshot")
    print(f"  first sync (plans, allocates staging): {r0['first_sync_s'] * 1e3:.1f} ms")
    equal_to = (
        "DeepSpeed's GatheredParameters / safe_get_full_fp32_param / safe_get_full_optimizer_state"
    )
    return print_syncs_and_verdict(results, equal_to, wall)
