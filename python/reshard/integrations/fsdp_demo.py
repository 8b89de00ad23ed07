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

from ._demo_report import print_sync, verdict

KINDS = ("param", "exp_avg", "exp_avg_sq")


def _full(dt, device):
    """full_tensor() of a DTensor whose local tensor may sit in CPU memory under an NCCL mesh."""
    from torch.distributed.tensor import DTensor

    local = dt.to_local().detach().to(device)
    moved = DTensor.from_local(
        local, dt.device_mesh, dt.placements, shape=dt.shape, stride=dt.stride()
    )
    return moved.full_tensor().cpu()


def _report(r):
    return {
        "rounds": r.rounds,
        "sent": r.total_bytes_sent,
        "received": r.total_bytes_received,
        "local": r.local_bytes,
        "total_s": r.seconds["total"],
        "held": sum(r.peak_staging_bytes.values()),
        "bound": sum(r.staging_bound.values()),
    }


def run_rank(rank, world, backend, cfg):
    """One rank of the demo (process group already initialized); a JSON-able result."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    import reshard as rs
    from reshard.integrations import fsdp as rsfsdp
    from reshard.integrations.deepspeed_demo import _compare, _model, _split_targets

    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"
    mesh = init_device_mesh("cuda" if backend == "nccl" else "cpu", (world,))
    hidden, ffn, vocab, layers = cfg["hidden"], cfg["ffn"], cfg["vocab"], cfg["layers"]
    net = _model(hidden, ffn, vocab, layers).to(device)
    policy = {
        "offload_policy": CPUOffloadPolicy(pin_memory=backend == "nccl"),
        "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16),
    }
    for layer in net.layers:
        fully_shard(layer, mesh=mesh, **policy)
    fully_shard(net, mesh=mesh, **policy)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    tp = 2 if world % 2 == 0 else world
    groups = [list(range(g, g + tp)) for g in range(0, world, tp)]

    live = rsfsdp.describe(net, "param")
    roll_layout, roll_bufs = _split_targets(
        rs, live.layout, groups, torch.bfloat16, device, tp_rules=True
    )
    sync = rs.Transfer(live.layout, roll_layout, budget_bytes_per_peer=cfg["budget"])
    g = torch.Generator().manual_seed(1000 + rank)
    first = None
    for _ in range(cfg["steps"]):
        tokens = torch.randint(0, vocab, (2, 16), generator=g).to(device)
        loss = net(tokens).float().logsumexp(-1).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        report = sync(live, roll_bufs)  # preflight runs live.check() on every rank
        first = first or report
    params = dict(net.named_parameters())
    full = {n: _full(p, device) for n, p in params.items()}
    bad, checked = _compare(roll_layout, roll_bufs, full, "rollout")

    # the CPU-offloaded fp32 params and moments into a CPU snapshot split over all ranks
    reports = {"rollout": _report(report)}
    for kind in KINDS:
        live = rsfsdp.describe(net, kind, **({} if kind == "param" else {"optimizer": opt}))
        snap_layout, snap_bufs = _split_targets(
            rs, live.layout, [list(range(world))], torch.float32, "cpu"
        )
        rep = rs.Transfer(live.layout, snap_layout, budget_bytes_per_peer=cfg["budget"])(
            live, snap_bufs
        )
        reports[kind] = _report(rep)
        want = (
            full
            if kind == "param"
            else {n: _full(opt.state[p][kind], device) for n, p in params.items()}
        )
        b, c = _compare(snap_layout, snap_bufs, want, kind)
        bad += b
        checked += c
    return {
        "bad": bad,
        "params": sum(math.prod(p.shape) for p in params.values()),
        "elements_checked": checked,
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
    print("  after each step: sharded fp32 params (CPU) -> bf16 TP=2 rollout buffers")
    print("  after the last step: params + exp_avg + exp_avg_sq (CPU) -> CPU snapshot")
    print(f"  first sync (plans, allocates staging): {r0['first_sync_s'] * 1e3:.1f} ms")
    for r, x in enumerate(results):
        for kind, rep in x["reports"].items():
            print_sync(r, kind, rep, rep["held"], rep["bound"])
    over = [
        (r, k)
        for r, x in enumerate(results)
        for k, rep in x["reports"].items()
        if rep["held"] > rep["bound"]
    ]
    return verdict(results, over, "DTensor.full_tensor()", wall)
