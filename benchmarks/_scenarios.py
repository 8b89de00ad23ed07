"""Scenarios of the sync benchmarks (sync_latency.py, nccl_bench.py): a named model
(reshard.scenarios.MODELS) laid out as a trainer and as a consumer holds it.

Each scenario builds, on one rank, a `Case`: source and target layouts from the shared sides of
reshard.scenarios, this rank's filled source buffers, a factory of poisoned target buffers, the
expected targets (the sides' `write`: plain torch slicing of the logical tensors, not reshard),
and what the per-tensor baselines need (`chunk_view`: this rank's ZeRO-3 chunk of a tensor;
`write`: a full logical tensor into this rank's targets). All state is synthetic, with the
layouts DeepSpeed uses (ZeRO-3 `Zero3`, ZeRO-1/2 `Zero12`) and a TP=2 rollout engine's
(`TensorParallel`: fused QKV, row/column splits, replicated norms).

Adding a scenario: a function `(model, rank, world, device) -> Case` in `SCENARIOS`; give it
default models in `SCENARIO_MODELS` when the model sweep of the others does not fit it.
"""

from __future__ import annotations

import math

import torch

import reshard as rs
from reshard import scenarios as sc

MODELS = sc.MODELS
ADAM = ("master", "exp_avg", "exp_avg_sq")
LORA_RANK = 8
LORA_MODULES = ("q", "k", "v", "o", "fc1", "fc2")


def model_params(model: str) -> int:
    return sc.count_params(sc.named_shapes(model))


class Case:
    """One (scenario, model) on one rank; see the module docstring. Tensors are named as in
    the layouts (state/tensor where a side holds several optimizer states)."""

    def __init__(self, scenario, model, rank, world, src, dst, description, devices=("cpu", "cpu")):
        self.scenario, self.model, self.rank, self.world = scenario, model, rank, world
        self.src, self.dst, self.description = src, dst, description
        self.dst_device = torch.device(devices[1])
        self.shapes = src.shapes
        self.names = list(src.shapes)
        states = len(src.parts) if isinstance(src, sc.States) else 1
        self.params = sc.count_params(src.shapes) // states  # of the model, not of its states
        self.src_layout, self.dst_layout = src.layout(), dst.layout()
        self.src_buffers = src.empty(rank, float("nan"), devices[0])  # NaN padding
        self.reference = dst.empty(rank, sc.POISON)
        # bytes of target elements (the payload every method must deliver), over all ranks
        self.payload_bytes = sc.count_params(dst.shapes) * dst.dtype.itemsize
        # which ranks hold targets of each tensor (a baseline broadcasts only if others do)
        self.target_ranks = {
            t: sorted({dst.storages[p.location].rank for p in tl.pieces})
            for t, tl in self.dst_layout.tensors.items()
        }
        for i, t in enumerate(self.names):
            v = sc.value(i, self.shapes[t], src.dtype)
            src.write(t, v, self.src_buffers, rank)
            dst.write(t, v, self.reference, rank)

    def targets(self):
        return self.dst.empty(self.rank, sc.POISON, self.dst_device)

    def chunk_view(self, name):
        """(chunk elements, this rank's ZeRO-3 chunk of tensor `name` or None)."""
        return self.src.chunk_view(name, self.src_buffers, self.rank)

    def partition_of_rank(self, r):
        zero3 = next(iter(self.src.parts.values())) if isinstance(self.src, sc.States) else self.src
        return zero3.partitions(r)[0]

    def write(self, name, full, bufs):
        self.dst.write(name, full, bufs, self.rank)

    def per_tensor_pairs(self, bufs):
        """(source view, target view) per logical tensor: the per-tensor `.to(device)` baseline
        (one process: every partition and every target on this rank)."""
        out = []
        for t in self.names:
            numel = math.prod(self.shapes[t])
            sv = self.chunk_view(t)[1][:numel]
            dv = self.dst.chunk_view(t, bufs, self.rank)[1][:numel]
            out.append((sv, dv))
        return out


def _tp_groups(world):
    tp = 2 if world % 2 == 0 else world
    return [list(range(g, g + tp)) for g in range(0, world, tp)]


# ------------------------------------------------------------------ scenarios


def rl_weight_sync(model, rank, world, device="cpu"):
    shapes = sc.named_shapes(model)
    src = sc.Zero3(shapes, range(world), torch.bfloat16, loc0=0)
    dst = sc.TensorParallel(shapes, _tp_groups(world), torch.bfloat16, loc0=100000)
    tp = len(dst.groups[0])
    desc = (
        f"ZeRO-3 bf16 param shards (DP={world}) -> TP={tp} bf16 rollout buffers "
        "(fused QKV, row/column splits, replicated norms)"
    )
    return Case("rl_weight_sync", model, rank, world, src, dst, desc, (device, device))


def _adam(ranks, dtype, loc0, shapes):
    return sc.States(ADAM, lambda base: sc.Zero3(shapes, ranks, dtype, loc0 + base), len(ranks))


def _offload(name, model, rank, world, device, dst_dtype, back):
    """Host-side partitions on ranks 0..W-1; the device side of partition p on rank p+1 mod W
    (world 1: the same process's device; world > 1 on a CPU-only box: the next rank, so every
    byte crosses the transport)."""
    shapes = sc.named_shapes(model)
    host_ranks = list(range(world))
    dev_ranks = [(p + 1) % world for p in range(world)]
    if back:
        src = _adam(dev_ranks, torch.float32, 0, shapes)
        dst = _adam(host_ranks, torch.float32, 100000, shapes)
        devices = (device, "cpu")
    else:
        src = _adam(host_ranks, torch.float32, 0, shapes)
        dst = _adam(dev_ranks, dst_dtype, 100000, shapes)
        devices = ("cpu", device)
    where = (
        f"{device} of the same process"
        if world == 1
        else "the next rank (no GPU here: 'device' = the other side of the transport)"
    )
    arrow = "<-" if back else "->"
    wire = "bf16" if dst_dtype == torch.bfloat16 else "fp32"
    desc = (
        f"CPU-offloaded fp32 master + exp_avg + exp_avg_sq (ZeRO-3 partitions, DP={world}) "
        f"{arrow} device-side partitions on {where}, {wire} on the wire"
    )
    return Case(name, model, rank, world, src, dst, desc, devices)


def offload_fp32(model, rank, world, device="cpu"):
    return _offload("offload_fp32", model, rank, world, device, torch.float32, False)


def offload_bf16(model, rank, world, device="cpu"):
    return _offload("offload_bf16", model, rank, world, device, torch.bfloat16, False)


def offload_back(model, rank, world, device="cpu"):
    return _offload("offload_back", model, rank, world, device, torch.float32, True)


def dp_change(model, rank, world, device="cpu"):
    if world < 2:
        raise ValueError("dp_change needs world >= 2 (DP=world -> DP=world-1)")
    shapes = sc.named_shapes(model)
    src = _adam(range(world), torch.float32, 0, shapes)
    dst = sc.States(
        ADAM, lambda base: sc.Zero12(shapes, range(world - 1), torch.float32, 100000 + base), world
    )
    desc = (
        f"fp32 master + Adam moments: ZeRO-3 partitions DP={world} -> ZeRO-1/2 flat "
        f"partitions DP={world - 1} (elastic shrink)"
    )
    return Case("dp_change", model, rank, world, src, dst, desc, (device, device))


class LoraTensorParallel(sc.Side):
    """A rollout engine's LoRA adapters under TP: for column-parallel modules (q, k, v, fc1) B
    is split on its output dim and A replicated; for row-parallel ones (o, fc2) A is split on
    its input dim and B replicated. Each rank packs its pieces into one buffer."""

    def __init__(self, shapes, groups, dtype, loc0):
        self.shapes, self.groups, self.dtype = shapes, [list(g) for g in groups], dtype
        self.loc, self.offset, used = {}, {}, {}
        for g in self.groups:
            for r in g:
                self.loc[r] = loc0 + len(self.loc)
                used[r] = 0
        for name, shape in shapes.items():
            for g in self.groups:
                for t, r in enumerate(g):
                    self.offset[(name, r)] = used[r]
                    used[r] += math.prod(self._box(name, shape, len(g), t)[1])
        self.storages = {self.loc[r]: rs.Storage(r, dtype, n) for r, n in used.items()}

    @staticmethod
    def _split_dim(name):
        module, ab = name.rsplit(".", 2)[-2:]
        if ab == "B" and module in ("q", "k", "v", "fc1"):
            return 0
        if ab == "A" and module in ("o", "fc2"):
            return 1
        return None

    def _box(self, name, shape, tp, t):
        """(start, size) of TP rank t's block of tensor `name`."""
        dim = self._split_dim(name)
        if dim is None:
            return (0,) * len(shape), tuple(shape)
        sizes = sc.uneven(shape[dim], tp)
        start, box = [0] * len(shape), list(shape)
        start[dim], box[dim] = sum(sizes[:t]), sizes[t]
        return tuple(start), tuple(box)

    def tensor_layouts(self):
        out = {}
        for name, shape in self.shapes.items():
            pieces = [
                rs.Piece(self.loc[r], self.offset[(name, r)], *self._box(name, shape, len(g), t))
                for g in self.groups
                for t, r in enumerate(g)
            ]
            out[name] = rs.TensorLayout(shape, pieces)
        return out

    def write(self, name, full, bufs, rank):
        for g in self.groups:
            if rank in g:
                start, box = self._box(name, full.shape, len(g), g.index(rank))
                part = full[tuple(slice(s, s + b) for s, b in zip(start, box, strict=True))]
                off = self.offset[(name, rank)]
                bufs[self.loc[rank]][off : off + part.numel()].view(part.shape).copy_(part)


def lora_shapes(model, rank=LORA_RANK):
    """LoRA adapters (A: r x in, B: out x r) on every attention and MLP projection of `model`."""
    out = {}
    for name, shape in sc.named_shapes(model).items():
        module = name.split(".")[-1]
        if module in LORA_MODULES:
            out[name + ".A"] = (rank, shape[1])
            out[name + ".B"] = (shape[0], rank)
    return out


def lora_sync(model, rank, world, device="cpu"):
    """Tiny syncs: a LoRA adapter set (hundreds of small tensors, a few MB) from ZeRO-3 shards
    into TP rollout buffers, where a per-sync fixed cost dominates."""
    shapes = lora_shapes(model)
    src = sc.Zero3(shapes, range(world), torch.bfloat16, loc0=0)
    dst = LoraTensorParallel(shapes, _tp_groups(world), torch.bfloat16, loc0=100000)
    mb = sc.count_params(shapes) * 2 / 1e6
    desc = (
        f"LoRA r={LORA_RANK} adapters of {model} ({len(shapes)} tensors, {mb:.1f} MB bf16): "
        f"ZeRO-3 shards (DP={world}) -> TP={len(dst.groups[0])} rollout buffers (B split for "
        "column-parallel modules, A for row-parallel, the other replicated)"
    )
    return Case("lora_sync", model, rank, world, src, dst, desc, (device, device))


SCENARIOS = {
    "rl_weight_sync": rl_weight_sync,
    "offload_fp32": offload_fp32,
    "offload_bf16": offload_bf16,
    "offload_back": offload_back,
    "dp_change": dp_change,
    "lora_sync": lora_sync,
}
# default models of a scenario whose size is not the model sweep's (without --models)
SCENARIO_MODELS = {"lora_sync": ("gpt-125m", "gpt-350m")}
