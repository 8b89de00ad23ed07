"""Scenarios of benchmarks/sync_latency.py: GPT-style models by name, sharded sources, targets.

Each scenario builds, on one rank, a `Case`: source and target `rs.Layout`s, this rank's filled
source buffers, a factory of poisoned target buffers, the expected targets (computed by plain
torch slicing of the logical tensors, not by reshard), and what the baselines need: this rank's
ZeRO chunk of every logical tensor (`chunk_view`) and how a full logical tensor lands in this
rank's targets (`write`). All state is synthetic with the layouts DeepSpeed uses:

- ZeRO-3 (`ZeroChunks`): every parameter's flat form padded to a multiple of the DP size and cut
  in equal chunks; partition p holds chunk p of every parameter, concatenated (DeepSpeed's
  `ds_tensor` / `fp32_partitioned_groups_flat`). Padding is NaN in sources, untouched in targets.
- ZeRO-1/2 (`ZeroFlat`): all parameters concatenated into one flat buffer, padded to a multiple
  of the DP size, cut into equal partitions (parameters straddle partitions).
- TP rollout buffers: `reshard.demo.Rollout` (fused QKV, row/column splits, replicated norms).
"""

from __future__ import annotations

import math

import torch

import reshard as rs
from reshard.demo import POISON, Rollout, _shapes

# name -> (hidden, ffn, vocab, layers). The small ones use odd sizes so TP and ZeRO cuts are
# uneven; the named GPT sizes follow GPT-2/3 (vocab 50257).
MODELS = {
    "gpt-nano": (130, 346, 501, 2),
    "gpt-micro": (258, 690, 2001, 4),
    "gpt-mini": (514, 1378, 8001, 4),
    "gpt-small": (770, 3074, 16001, 8),
    "gpt-125m": (768, 3072, 50257, 12),
    "gpt-350m": (1024, 4096, 50257, 24),
    "gpt-760m": (1536, 6144, 50257, 24),
    "gpt-1.3b": (2048, 8192, 50257, 24),
    "gpt-2.7b": (2560, 10240, 50257, 32),
}

ADAM = ("master", "exp_avg", "exp_avg_sq")
_PERIOD = 1_000_003  # prime: a misplaced run shows unless it moved by a multiple of this


def model_shapes(model: str) -> dict[str, tuple[int, ...]]:
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; choose from {', '.join(MODELS)}")
    return _shapes(*MODELS[model])


def model_params(model: str) -> int:
    return sum(math.prod(s) for s in model_shapes(model).values())


def value(index: int, shape, dtype) -> torch.Tensor:
    """Logical tensor `index`: seeded, identical in every process, cheap for billions of
    elements (a random pattern of prime period, offset per tensor)."""
    numel = math.prod(shape)
    g = torch.Generator().manual_seed(7919 * index + 1)
    pattern = torch.randn(min(numel, _PERIOD), generator=g)
    if numel > pattern.numel():
        pattern = pattern.repeat(math.ceil(numel / pattern.numel()))[:numel]
    return pattern.to(dtype).view(shape)


def _tname(state, p, states):
    return p if len(states) == 1 else f"{state}/{p}"


class ZeroChunks:
    """ZeRO-3 partitions of `states` (one flat buffer per state per partition).

    owner(p): the rank holding partition p (identity for the trainer's own shards; p+1 mod W
    for the "device side" of the CPU-offload scenario on a CPU-only machine)."""

    def __init__(self, shapes, states, dp, dtype, loc_base, owner=None, device="cpu"):
        self.shapes, self.states, self.dp, self.dtype = shapes, states, dp, dtype
        self.device = torch.device(device)
        self.owner = owner or (lambda p: p)
        self.chunk = {n: math.ceil(math.prod(s) / dp) for n, s in shapes.items()}
        self.offset, off = {}, 0
        for n in shapes:
            self.offset[n], off = off, off + self.chunk[n]
        self.numel = off
        self.loc = {(s, p): loc_base + i * dp + p for i, s in enumerate(states) for p in range(dp)}

    def names(self):
        return [(_tname(s, n, self.states), s, n) for s in self.states for n in self.shapes]

    def layout_parts(self):
        tensors = {}
        for t, s, n in self.names():
            c, numel = self.chunk[n], math.prod(self.shapes[n])
            runs = [
                (self.loc[(s, p)], p * c, min((p + 1) * c, numel), self.offset[n])
                for p in range(self.dp)
                if p * c < numel
            ]
            tensors[t] = rs.flat(self.shapes[n], runs)
        storages = {
            loc: rs.Storage(self.owner(p), self.dtype, self.numel)
            for (s, p), loc in self.loc.items()
        }
        return tensors, storages

    def partitions(self, rank):
        return [p for p in range(self.dp) if self.owner(p) == rank]

    def empty(self, rank, fill, device=None):
        dev = device or self.device
        return {
            self.loc[(s, p)]: torch.full((self.numel,), fill, dtype=self.dtype, device=dev)
            for s in self.states
            for p in self.partitions(rank)
        }

    def write(self, tname, state, name, full, bufs, rank):
        """This rank's part of full logical tensor `name` (state `state`) into bufs (cast)."""
        c, off = self.chunk[name], self.offset[name]
        flat = full.reshape(-1)
        for p in self.partitions(rank):
            piece = flat[p * c : (p + 1) * c]
            bufs[self.loc[(state, p)]][off : off + piece.numel()].copy_(piece)


class ZeroFlat:
    """ZeRO-1/2 partitions: per state, every parameter concatenated, padded to a multiple of
    `dp`, cut in `dp` equal partitions; partition p on rank p."""

    def __init__(self, shapes, states, dp, dtype, loc_base, device="cpu"):
        self.shapes, self.states, self.dp, self.dtype = shapes, states, dp, dtype
        self.device = torch.device(device)
        self.start, off = {}, 0
        for n, s in shapes.items():
            self.start[n], off = off, off + math.prod(s)
        self.part = math.ceil(off / dp)
        self.loc = {(s, p): loc_base + i * dp + p for i, s in enumerate(states) for p in range(dp)}

    def names(self):
        return [(_tname(s, n, self.states), s, n) for s in self.states for n in self.shapes]

    def _cuts(self, name):
        """[(partition, flat_start, flat_stop, offset in the partition)] of parameter name."""
        g0, numel = self.start[name], math.prod(self.shapes[name])
        out = []
        for p in range(g0 // self.part, min(self.dp, (g0 + numel - 1) // self.part + 1)):
            lo, hi = max(g0, p * self.part), min(g0 + numel, (p + 1) * self.part)
            if lo < hi:
                out.append((p, lo - g0, hi - g0, lo - p * self.part))
        return out

    def layout_parts(self):
        tensors = {}
        for t, s, n in self.names():
            runs = [(self.loc[(s, p)], a, b, o) for p, a, b, o in self._cuts(n)]
            tensors[t] = rs.flat(self.shapes[n], runs)
        storages = {loc: rs.Storage(p, self.dtype, self.part) for (s, p), loc in self.loc.items()}
        return tensors, storages

    def empty(self, rank, fill, device=None):
        if rank >= self.dp:
            return {}
        return {
            self.loc[(s, rank)]: torch.full(
                (self.part,), fill, dtype=self.dtype, device=device or self.device
            )
            for s in self.states
        }

    def write(self, tname, state, name, full, bufs, rank):
        flat = full.reshape(-1)
        for p, a, b, o in self._cuts(name):
            if p == rank:
                bufs[self.loc[(state, p)]][o : o + b - a].copy_(flat[a:b])


class RolloutTargets:
    """TP rollout buffers (reshard.demo.Rollout, bf16), one state ("param")."""

    def __init__(self, shapes, world):
        self.shapes, self.states = shapes, ("param",)
        self.r = Rollout(shapes, world, 2 if world % 2 == 0 else world)
        self.dtype = torch.bfloat16

    def names(self):
        return [(n, "param", n) for n in self.shapes]

    def layout_parts(self):
        lay = self.r.layout()
        return dict(lay.tensors), dict(lay.storages)

    def empty(self, rank, fill, device=None):
        return {
            loc: torch.full((s.numel,), fill, dtype=torch.bfloat16, device=device or "cpu")
            for loc, s in self.r.storages.items()
            if s.rank == rank
        }

    def write(self, tname, state, name, full, bufs, rank):
        self.r.write_part(name, full, bufs, rank)


class Case:
    """One (scenario, model) on one rank; see the module docstring."""

    def __init__(self, scenario, model, rank, world, src, dst, description):
        self.scenario, self.model, self.rank, self.world = scenario, model, rank, world
        self.src, self.dst, self.description = src, dst, description
        self.shapes = src.shapes
        self.params = sum(math.prod(s) for s in self.shapes.values())
        st, ss = src.layout_parts()
        dt, ds = dst.layout_parts()
        self.src_layout, self.dst_layout = rs.Layout(st, ss), rs.Layout(dt, ds)
        self.names = src.names()  # [(tensor name, state, parameter)]
        self.src_buffers = src.empty(rank, float("nan"))  # NaN padding
        self.reference = dst.empty(rank, POISON, device="cpu")
        # bytes of target elements (the payload every method must deliver), over all ranks
        self.payload_bytes = len(dst.states) * self.params * dst.dtype.itemsize
        # which ranks hold targets of each parameter (a baseline broadcasts only if others do)
        self.target_ranks = {}
        for t, tl in dt.items():
            self.target_ranks[t] = sorted({ds[p.location].rank for p in tl.pieces})
        for i, (t, s, n) in enumerate(self.names):
            v = value(i, self.shapes[n], src.dtype)
            src.write(t, s, n, v, self.src_buffers, rank)
            dst.write(t, s, n, v, self.reference, rank)

    def targets(self):
        return self.dst.empty(self.rank, POISON)

    def chunk_view(self, tname, state, name):
        """(chunk elements, this rank's chunk of tensor tname or None): the ZeRO-3 source."""
        s = self.src
        c, off = s.chunk[name], s.offset[name]
        parts = s.partitions(self.rank)
        if not parts:
            return c, None
        return c, self.src_buffers[s.loc[(state, parts[0])]][off : off + c]

    def partition_of_rank(self, r):
        return next(p for p in range(self.src.dp) if self.src.owner(p) == r)

    def write(self, tname, state, name, full, bufs):
        self.dst.write(tname, state, name, full, bufs, self.rank)

    def per_tensor_pairs(self, bufs):
        """(source view, target view) per logical tensor: the per-tensor `.to(device)` baseline
        (single process: every partition and every target on this rank, same flat order)."""
        s, d = self.src, self.dst
        out = []
        for _t, st, n in self.names:
            numel, off = math.prod(self.shapes[n]), s.offset[n]
            sv = self.src_buffers[s.loc[(st, 0)]][off : off + numel]
            dv = bufs[d.loc[(st, 0)]][d.offset[n] : d.offset[n] + numel]
            out.append((sv, dv))
        return out


# ------------------------------------------------------------------ scenarios


def rl_weight_sync(model, rank, world, device="cpu"):
    shapes = model_shapes(model)
    src = ZeroChunks(shapes, ("param",), world, torch.bfloat16, 0)
    dst = RolloutTargets(shapes, world)
    return Case(
        "rl_weight_sync",
        model,
        rank,
        world,
        src,
        dst,
        f"ZeRO-3 bf16 param shards (DP={world}) -> TP={dst.r.tp} bf16 rollout buffers "
        "(fused QKV, row/column splits, replicated norms)",
    )


def _offload(name, model, rank, world, device, dst_dtype, back):
    shapes = model_shapes(model)
    nxt = (lambda p: (p + 1) % world) if world > 1 else None
    host = dict(dp=world, device="cpu")
    dev = dict(dp=world, device=device, owner=nxt)
    if back:
        src = ZeroChunks(shapes, ADAM, dtype=torch.float32, loc_base=0, **dev)
        dst = ZeroChunks(shapes, ADAM, dtype=torch.float32, loc_base=100000, **host)
    else:
        src = ZeroChunks(shapes, ADAM, dtype=torch.float32, loc_base=0, **host)
        dst = ZeroChunks(shapes, ADAM, dtype=dst_dtype, loc_base=100000, **dev)
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
    return Case(name, model, rank, world, src, dst, desc)


def offload_fp32(model, rank, world, device="cpu"):
    return _offload("offload_fp32", model, rank, world, device, torch.float32, False)


def offload_bf16(model, rank, world, device="cpu"):
    return _offload("offload_bf16", model, rank, world, device, torch.bfloat16, False)


def offload_back(model, rank, world, device="cpu"):
    return _offload("offload_back", model, rank, world, device, torch.float32, True)


def dp_change(model, rank, world, device="cpu"):
    if world < 2:
        raise ValueError("dp_change needs world >= 2 (DP=world -> DP=world-1)")
    shapes = model_shapes(model)
    src = ZeroChunks(shapes, ADAM, world, torch.float32, 0)
    dst = ZeroFlat(shapes, ADAM, world - 1, torch.float32, 100000)
    return Case(
        "dp_change",
        model,
        rank,
        world,
        src,
        dst,
        f"fp32 master + Adam moments: ZeRO-3 partitions DP={world} -> ZeRO-1/2 flat "
        f"partitions DP={world - 1} (elastic shrink)",
    )


SCENARIOS = {
    "rl_weight_sync": rl_weight_sync,
    "offload_fp32": offload_fp32,
    "offload_bf16": offload_bf16,
    "offload_back": offload_back,
    "dp_change": dp_change,
}
