"""The FSDP2 half of `python -m reshard.demo --mode fsdp`.

Per rank: a small transformer sharded with FSDP2 (`fully_shard` per layer and at the root,
`CPUOffloadPolicy`: fp32 sharded params and AdamW state in CPU memory, bf16
`MixedPrecisionPolicy` for compute) trains a few steps; after every step one reused
`rs.Transfer` syncs the sharded fp32 params into bf16 TP=2 rollout buffers, Megatron-style (the
DeepSpeed demo's targets); after the last step the params and both Adam moments go into a CPU
snapshot split over all ranks. Every target element is compared bitwise with
`DTensor.full_tensor()` (which gathers, and is used only to check).
"""

from __future__ import annotations

import math

import torch

from ._demo_common import (
    check_model_args,
    compare,
    model,
    print_syncs_and_verdict,
    split_targets,
    summary,
    tp_size,
)

KINDS = ("param", "exp_avg", "exp_avg_sq")
check_args = check_model_args  # the demo runs it on the command line's sizes


def _full(dt, device):
    """full_tensor() of a DTensor whose local tensor may sit in CPU memory under an NCCL mesh."""
    from torch.distributed.tensor import DTensor

    local = dt.to_local().detach().to(device)
    moved = DTensor.from_local(
        local, dt.device_mesh, dt.placements, shape=dt.shape, stride=dt.stride()
    )
    return moved.full_tensor().cpu()


def _sharded_model(world, backend, cfg, device):
    """The demo model under fully_shard (per layer and at the root), fp32 params and AdamW state
    offloaded to CPU, bf16 compute; and its optimizer."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cuda" if backend == "nccl" else "cpu", (world,))
    net = model(cfg["hidden"], cfg["ffn"], cfg["vocab"], cfg["layers"]).to(device)
    policy = {
        "offload_policy": CPUOffloadPolicy(pin_memory=backend == "nccl"),
        "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16),
    }
    for layer in net.layers:
        fully_shard(layer, mesh=mesh, **policy)
    fully_shard(net, mesh=mesh, **policy)
    return net, torch.optim.AdamW(net.parameters(), lr=1e-3)


def _train_and_sync(net, opt, rank, world, cfg, device):
    """Train cfg["steps"] steps, the sharded params -> TP rollout buffers after each one with one
    reused Transfer; returns (rollout layout, buffers, last Report, first Report, last loss)."""
    import reshard as rs
    from reshard.integrations import fsdp as rsfsdp

    tp = tp_size(world)
    groups = [list(range(g, g + tp)) for g in range(0, world, tp)]
    live = rsfsdp.describe(net, "param")
    roll_layout, roll_bufs = split_targets(
        rs, live.layout, groups, torch.bfloat16, device, tp_rules=True
    )
    sync = rs.Transfer(live.layout, roll_layout, budget_bytes_per_peer=cfg["budget"])
    g = torch.Generator().manual_seed(1000 + rank)
    first = None
    for _ in range(cfg["steps"]):
        tokens = torch.randint(0, cfg["vocab"], (2, 16), generator=g).to(device)
        loss = net(tokens).float().logsumexp(-1).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        report = sync(live, roll_bufs)  # preflight runs live.check() on every rank
        first = first or report
    return roll_layout, roll_bufs, report, first, loss


def _snapshot_and_compare(net, opt, world, cfg, device, full, reports):
    """The CPU-offloaded fp32 params and moments into a CPU snapshot split over all ranks,
    compared with full_tensor(); fills `reports`, returns (bad, checked)."""
    import reshard as rs
    from reshard.integrations import fsdp as rsfsdp

    params = dict(net.named_parameters())
    bad, checked = [], 0
    for kind in KINDS:
        live = rsfsdp.describe(net, kind, **({} if kind == "param" else {"optimizer": opt}))
        snap_layout, snap_bufs = split_targets(
            rs, live.layout, [list(range(world))], torch.float32, "cpu"
        )
        rep = rs.Transfer(live.layout, snap_layout, budget_bytes_per_peer=cfg["budget"])(
            live, snap_bufs
        )
        reports[kind] = summary(rep)
        want = (
            full
            if kind == "param"
            else {n: _full(opt.state[p][kind], device) for n, p in params.items()}
        )
        b, c = compare(snap_layout, snap_bufs, want, kind)
        bad += b
        checked += c
    return bad, checked


def run_rank(rank, world, backend, cfg):
    """One rank of the demo (process group already initialized); a JSON-able result."""
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"
    net, opt = _sharded_model(world, backend, cfg, device)
    roll_layout, roll_bufs, report, first, loss = _train_and_sync(
        net, opt, rank, world, cfg, device
    )
    params = dict(net.named_parameters())
    full = {n: _full(p, device) for n, p in params.items()}
    bad, checked = compare(roll_layout, roll_bufs, full, "rollout")
    reports = {"rollout": summary(report)}
    b, c = _snapshot_and_compare(net, opt, world, cfg, device, full, reports)
    return {
        "bad": bad + b,
        "params": sum(math.prod(p.shape) for p in params.values()),
        "elements_checked": checked + c,
        "loss": float(loss.detach()),
        "first_sync_s": first.seconds["total"],
        "reports": reports,
    }


def print_report(results, world, backend, cfg, wall):
    r0 = results[0]
    print(
        f"reshard demo: FSDP2 (fully_shard, CPUOffloadPolicy, bf16 MixedPrecisionPolicy), "
        f"{world} ranks ({backend}), {r0['params'] / 1e6:.2f}M params, {cfg['steps']} steps"
    )
    print(
        f"  after each step: sharded fp32 params (CPU) -> bf16 TP={tp_size(world)} rollout buffers"
    )
    print("  after the last step: params + exp_avg + exp_avg_sq (CPU) -> CPU snapshot")
    print(f"  first sync (plans, allocates staging): {r0['first_sync_s'] * 1e3:.1f} ms")
    return print_syncs_and_verdict(results, "DTensor.full_tensor()", wall)
