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
import os

import torch

from ._demo_report import print_sync, verdict

KINDS = ("fp32", "exp_avg", "exp_avg_sq")


def _model(hidden, ffn, vocab, layers):
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(vocab, hidden)
            self.layers = torch.nn.ModuleList(
                torch.nn.TransformerEncoderLayer(
                    hidden, nhead=2, dim_feedforward=ffn, dropout=0.0, batch_first=True
                )
                for _ in range(layers)
            )
            self.head = torch.nn.Linear(hidden, vocab)

        def forward(self, tokens):
            x = self.embed(tokens)
            for layer in self.layers:
                x = layer(x)
            return self.head(x)

    torch.manual_seed(0)
    return Net()


def _tp_dim(name, shape):
    """Megatron-style TP: norms replicated (None); out_proj / linear2 weights row-parallel (split
    the input dim 1); every other tensor column-parallel (dim 0)."""
    if len(shape) == 1 and "norm" in name:
        return None
    if len(shape) == 2 and ("out_proj.weight" in name or "linear2.weight" in name):
        return 1
    return 0


def _split_targets(rs, layout, groups, dtype, device, tp_rules=False):
    """Each tensor split over the ranks of a group (dim 0, or by `_tp_dim` with tp_rules);
    every group holds a copy."""
    me = torch.distributed.get_rank()
    tp = len(groups[0])
    tensors, storages, buffers = {}, {}, {}
    for name, tl in sorted(layout.tensors.items()):
        dim = _tp_dim(name, tl.shape) if tp_rules else 0
        blocks = 1 if dim is None else tp
        n = tl.shape[dim or 0]
        sizes = [n // blocks + (1 if t < n % blocks else 0) for t in range(blocks)]
        rest = math.prod(tl.shape) // n
        locs = []
        for t in range(blocks):
            replicas = []
            for ranks in groups:
                # a replicated tensor: one full copy on every rank of every group
                for r in ranks if dim is None else [ranks[t]]:
                    loc = len(storages)
                    storages[loc] = rs.Storage(r, dtype, sizes[t] * rest)
                    replicas.append(loc)
                    if r == me:
                        buffers[loc] = torch.full(
                            (sizes[t] * rest,), float("nan"), dtype=dtype, device=device
                        )
            locs.append(replicas)
        tensors[name] = rs.split(tl.shape, dim or 0, sizes, locs)
    return rs.Layout(tensors, storages), buffers


def _compare(layout, buffers, want, tag):
    """Bitwise comparison of this rank's target pieces with full reference tensors."""
    me = torch.distributed.get_rank()
    bad, checked = [], 0
    for name, tl in layout.tensors.items():
        for pc in tl.pieces:
            if layout.storages[pc.location].rank != me:
                continue
            n = math.prod(pc.shape)
            got = buffers[pc.location][pc.offset : pc.offset + n].view(pc.shape).cpu()
            box = tuple(slice(s, s + k) for s, k in zip(pc.start, pc.shape, strict=True))
            ref = want[name].cpu()[box].to(got.dtype)
            ints = {2: torch.int16, 4: torch.int32}[got.element_size()]
            same = (got + 0.0).view(ints) == (ref + 0.0).view(ints)  # +0.0: -0 == +0
            checked += n
            if not bool(same.all()):
                bad.append(f"{tag} {name}{list(pc.start)}: {int((~same).sum())} elements differ")
    return bad, checked


def _engine(rank, world, backend, cfg):
    """A real ZeRO-3 engine with its optimizer offloaded to CPU, as a launcher would make it."""
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if backend == "nccl" else "cpu")
    os.environ.update(
        LOCAL_RANK=str(rank if backend != "nccl" else torch.cuda.current_device()),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_SIZE=str(world),
    )
    import deepspeed
    from deepspeed.utils import logger

    logger.setLevel(logging.ERROR)
    net = _model(cfg["hidden"], cfg["ffn"], cfg["vocab"], cfg["layers"])
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

    tp = 2 if world % 2 == 0 else world
    groups = [list(range(g, g + tp)) for g in range(0, world, tp)]
    live = rsds.describe(engine, "param")
    roll_layout, roll_bufs = _split_targets(
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
        snap_layout, snap_bufs = _split_targets(
            rs, live.layout, [list(range(world))], torch.float32, "cpu"
        )
        transfer = rs.Transfer(live.layout, snap_layout, budget_bytes_per_peer=cfg["budget"])
        reports[kind] = transfer(live, snap_bufs)
        get = safe_get_full_fp32_param if kind == "fp32" else None
        want = {n: get(p) if get else safe_get_full_optimizer_state(p, kind) for n, p in params}
        b, c = _compare(snap_layout, snap_bufs, want, kind)
        bad += b
        checked += c
    return bad, checked


def _report_summary(r):
    return {
        "rounds": r.rounds,
        "sent": r.total_bytes_sent,
        "received": r.total_bytes_received,
        "local": r.local_bytes,
        "total_s": r.seconds["total"],
        "held": sum(r.peak_staging_bytes.values()),
        "bound": sum(r.staging_bound.values()),
        "transport": r.transport,
    }


def run_rank(rank, world, backend, cfg):
    """One rank of the demo (process group already initialized); a JSON-able result."""
    engine = _engine(rank, world, backend, cfg)
    import deepspeed

    roll_layout, roll_bufs, sync, first_report, loss = _train_and_sync(engine, rank, world, cfg)
    params = list(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in params]):
        full = {n: p.data.detach().clone() for n, p in params}
    bad, checked = _compare(roll_layout, roll_bufs, full, "rollout")
    reports = {"param": sync.reports["param"]}
    b, c = _snapshot_and_compare(engine, world, cfg, params, reports)
    engine.destroy()
    return {
        "bad": bad + b,
        "params": sum(math.prod(getattr(p, "ds_shape", p.shape)) for _, p in params),
        "elements_checked": checked + c,
        "loss": float(loss.detach()),
        "first_sync_s": first_report.seconds["total"],
        "reports": {k: _report_summary(r) for k, r in reports.items()},
    }


def print_report(results, world, backend, cfg, wall):
    r0 = results[0]
    print(
        f"reshard demo: DeepSpeed ZeRO-3 engine, optimizer offloaded to CPU, {world} ranks "
        f"({backend}), {r0['params'] / 1e6:.2f}M params, {cfg['steps']} training steps"
    )
    print("  after each step: bf16 params -> TP=2 rollout buffers (rsds.SyncAfterStep)")
    print("  after the last step: fp32 masters + exp_avg + exp_avg_sq (CPU) -> CPU snapshot")
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
    equal_to = (
        "DeepSpeed's GatheredParameters / safe_get_full_fp32_param / safe_get_full_optimizer_state"
    )
    return verdict(results, over, equal_to, wall)
