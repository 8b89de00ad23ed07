"""What the integration demos share: the demo model, the TP rollout targets, the bitwise check
against a reference, the DeepSpeed launcher environment, the per-call summary, the per-rank
sync lines and the verdict."""

from __future__ import annotations

import math
import os

import torch

KIB = 1 << 10
HEADS = 2  # attention heads of `model`'s encoder layers


def tp_size(world: int) -> int:
    """The demos' rollout TP size: 2, or every rank for an odd world."""
    return 2 if world % 2 == 0 else world


def model(hidden, ffn, vocab, layers):
    """A small transformer (embedding, encoder layers, head), seeded: the same on every rank."""

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(vocab, hidden)
            self.layers = torch.nn.ModuleList(
                torch.nn.TransformerEncoderLayer(
                    hidden, nhead=HEADS, dim_feedforward=ffn, dropout=0.0, batch_first=True
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


def check_model_args(cfg) -> str | None:
    """Why `model` cannot be built from cfg's sizes (an argparse-style message), or None."""
    if cfg["hidden"] % HEADS:
        return (
            f"argument --hidden: must be a multiple of {HEADS} for --mode {cfg['mode']} "
            f"(its attention has {HEADS} heads), got {cfg['hidden']}"
        )
    return None


def _tp_dim(name, shape):
    """Megatron-style TP: norms replicated (None); out_proj / linear2 weights row-parallel (split
    the input dim 1); every other tensor column-parallel (dim 0)."""
    if len(shape) == 1 and "norm" in name:
        return None
    if len(shape) == 2 and ("out_proj.weight" in name or "linear2.weight" in name):
        return 1
    return 0


def split_targets(rs, layout, groups, dtype, device, tp_rules=False):
    """Each tensor split over the ranks of a group (dim 0, or by `_tp_dim` with tp_rules);
    every group holds a copy. Returns (layout, {location: NaN-poisoned buffer of this rank})."""
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


def compare(layout, buffers, want, tag):
    """Bitwise comparison of this rank's target pieces with full reference tensors: (list of
    mismatch lines, elements checked)."""
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


def deepspeed_env(rank, world, backend) -> None:
    """The environment DeepSpeed's launcher would give this rank."""
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if backend == "nccl" else "cpu")
    os.environ.update(
        LOCAL_RANK=str(rank if backend != "nccl" else torch.cuda.current_device()),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_SIZE=str(world),
    )


def summary(r) -> dict:
    """A Report as JSON-able data (staging held and bound by kind)."""
    return {
        "rounds": r.rounds,
        "sent": r.total_bytes_sent,
        "received": r.total_bytes_received,
        "local": r.local_bytes,
        "total_s": r.seconds["total"],
        "held": dict(r.peak_staging_bytes),
        "bound": dict(r.staging_bound),
        "transport": r.transport,
    }


def print_sync(rank: int, what: str, rep: dict) -> None:
    held, bound = sum(rep["held"].values()), sum(rep["bound"].values())
    print(
        f"  rank {rank} {what:10s}: sent {rep['sent'] / KIB:8.1f} KiB, received "
        f"{rep['received'] / KIB:8.1f} KiB, local {rep['local'] / KIB:8.1f} KiB, "
        f"{rep['rounds']} rounds, {rep['total_s'] * 1e3:6.1f} ms, staging held "
        f"{held} B <= bound {bound} B"
    )


def print_syncs_and_verdict(results: list[dict], equal_to: str, wall: float) -> int:
    """Every rank's sync lines (`results[r]["reports"]`: {what: summary}), then the verdict."""
    over = []
    for r, x in enumerate(results):
        for what, rep in x["reports"].items():
            print_sync(r, what, rep)
            if any(rep["held"][k] > rep["bound"][k] for k in rep["held"]):
                over.append((r, what))
    return verdict(results, over, equal_to, wall)


def verdict(results: list[dict], over: list[tuple[int, str]], equal_to: str, wall: float) -> int:
    """Prints the mismatches and staging-bound breaches, or OK; returns the exit code."""
    bad = [b for x in results for b in x["bad"]]
    if bad or over:
        for b in bad[:20]:
            print("  MISMATCH " + b)
        for r, what in over:
            print(f"  rank {r} {what}: staging held above the plan's bound")
        print(f"FAILED ({len(bad)} mismatches; wall {wall:.1f} s)")
        return 1
    checked = sum(x["elements_checked"] for x in results)
    print(f"OK: {checked} target elements bitwise equal to {equal_to} (wall {wall:.1f} s)")
    return 0
