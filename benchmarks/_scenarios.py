"""Scenarios of the sync benchmarks (sync_latency.py, gpu_bench.py --mode multi): a named model
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
        # {"receivers", "bucket_bytes"}: the reshard method is an rs.Stream (rollout_stream)
        self.stream = None
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


# ------------------------------------------------------------------ rollout engines


def rollout_stream(model, rank, world, device="cpu"):
    """Full tensors by name to one receiver (an inference engine's `load_weights`): ZeRO-3 bf16
    shards -> every tensor whole on rank 0, where the 'engine weights' are one replica. The
    reshard method is an `rs.Stream` (STREAM_BUCKET_BYTES buckets, the default staging cap of a
    quarter bucket) whose tensors are copied into the engine weights as they arrive."""
    shapes = sc.named_shapes(model)
    src = sc.Zero3(shapes, range(world), torch.bfloat16, loc0=0)
    dst = sc.Replicas(shapes, [0], torch.bfloat16, loc0=100000)
    desc = (
        f"ZeRO-3 bf16 param shards (DP={world}) -> full tensors by name on rank 0 (an engine's "
        f"load_weights), stream buckets of {STREAM_BUCKET_BYTES >> 20} MiB, staging "
        f"{STREAM_BUCKET_BYTES >> 22} MiB per rank"
    )
    case = Case("rollout_stream", model, rank, world, src, dst, desc, (device, device))
    case.stream = {"receivers": [0], "bucket_bytes": STREAM_BUCKET_BYTES}
    return case


# The stream's buffer is max(largest bucket, 2 x bucket_bytes): from 124M parameters on, the
# 50k-row embedding (74 MiB at 124M) is more than two 32 MiB buckets, so the buffer is that
# tensor, the floor of any by-name path.
STREAM_BUCKET_BYTES = 32 << 20
# GPU receivers: the Stream's default (256 MiB): device memory is plentiful, and each bucket
# costs a preflight and a pipeline start; sync_latency's reshard_b64 row keeps 64 MiB buckets.
STREAM_GPU_BUCKET_BYTES = 256 << 20
STREAM_GPU_SMALL_BUCKET_BYTES = 64 << 20


def stream_offload(model, rank, world, device="cpu"):
    """One process (--world 1 --device cuda): CPU-offloaded fp32 masters (a ZeRO-3 flat
    partition in host memory) streamed as bf16 into GPU tensors by name (rs.Stream with
    STREAM_GPU_BUCKET_BYTES buckets on the GPU, each tensor copied into the 'engine' weights)."""
    shapes = sc.named_shapes(model)
    src = sc.Zero3(shapes, range(world), torch.float32, loc0=0)
    dst = sc.Replicas(shapes, [0], torch.bfloat16, loc0=100000)
    desc = (
        "CPU-offloaded fp32 masters -> bf16 full tensors by name on "
        f"{device} (rs.Stream, {STREAM_GPU_BUCKET_BYTES >> 20} MiB buckets)"
    )
    case = Case("stream_offload", model, rank, world, src, dst, desc, ("cpu", device))
    case.stream = {"receivers": [0], "bucket_bytes": STREAM_GPU_BUCKET_BYTES}
    return case


def llama_config(model):
    """A Llama-style config of `model`'s sizes (GQA: 2 kv heads), for tp_layout."""
    import types

    hidden, ffn, vocab, layers = MODELS[model]
    heads = max(4, hidden // 64 // 2 * 2)
    return types.SimpleNamespace(
        model_type="llama",
        hidden_size=hidden,
        intermediate_size=ffn + ffn % 2,
        vocab_size=vocab,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=2,
        head_dim=hidden // heads,
        hidden_act="silu",
        tie_word_embeddings=False,
    )


def llama_shapes(cfg):
    """The HF parameter shapes of a Llama config (names as transformers' LlamaForCausalLM)."""
    h, i, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


class VllmTP(sc.Side):
    """vLLM's TP weights of a Llama model (`reshard.integrations.vllm.tp_layout`); `write` is
    vLLM's loader on full tensors (`TPLayout.load`: torch slicing, no layout or plan)."""

    def __init__(self, cfg, hosts, dtype=torch.bfloat16):
        from reshard.integrations import vllm as rsvllm

        self.cfg, self.hosts, self.dtype = cfg, list(hosts), dtype
        self.tgt = rsvllm.tp_layout(cfg, len(hosts), hosts, dtype=dtype)
        self.shapes = llama_shapes(cfg)
        self.storages = dict(self.tgt.layout.storages)

    def tensor_layouts(self):
        return dict(self.tgt.layout.tensors)

    def write(self, name, full, bufs, rank):
        for r, host in enumerate(self.hosts):
            if host == rank:
                params = {
                    v: bufs[self.tgt.locations[(v, r)]].view(shape)
                    for v, shape in self.tgt.shapes.items()
                }
                self.tgt.load(name, full, r, params)


TP_STREAM_BUCKET_BYTES = 8 << 20  # rollout_tp's stream_then_shard baseline


def rollout_tp(model, rank, world, device="cpu"):
    """Pre-sharded rollout weights: ZeRO-3 bf16 shards of a Llama-style model -> vLLM's TP=2
    layout (fused qkv / gate_up, GQA, padded vocab) on ranks 0 and 1. reshard: one Transfer
    into tp_layout; stream_then_shard: an rs.Stream of full tensors to both TP hosts, each then
    loading its shard as vLLM's loader does."""
    cfg = llama_config(model)
    shapes = llama_shapes(cfg)
    src = sc.Zero3(shapes, range(world), torch.bfloat16, loc0=0)
    dst = VllmTP(cfg, [0, 1], torch.bfloat16)
    desc = (
        f"ZeRO-3 bf16 param shards (DP={world}) of a Llama-style {model} (GQA {cfg.num_attention_heads}"
        f"/{cfg.num_key_value_heads} heads) -> vLLM TP=2 weights (tp_layout) on ranks 0, 1"
    )
    return Case("rollout_tp", model, rank, world, src, dst, desc, (device, device))


class FsdpShards(sc.Side):
    """FSDP2's sharded parameters (and optimizer states, alike): each tensor Shard(0) over
    `ranks` with torch.chunk sizes (the last ranks hold fewer rows, or none), one storage per
    (tensor, rank) holding that rank's local shard, row-major."""

    def __init__(self, shapes, ranks, dtype, loc0):
        self.shapes, self.ranks, self.dtype = shapes, list(ranks), dtype
        self.rows, self.loc, self.storages = {}, {}, {}
        for name, shape in shapes.items():
            c = math.ceil(shape[0] / len(self.ranks))
            for i, r in enumerate(self.ranks):
                a = min(i * c, shape[0])
                b = min(a + c, shape[0])
                self.rows[(name, r)] = (a, b)
                if b > a:
                    loc = loc0 + len(self.storages)
                    self.loc[(name, r)] = loc
                    self.storages[loc] = rs.Storage(r, dtype, (b - a) * math.prod(shape[1:]))

    def tensor_layouts(self):
        out = {}
        for name, shape in self.shapes.items():
            pieces = []
            for r in self.ranks:
                if (name, r) in self.loc:
                    a, b = self.rows[(name, r)]
                    start = (a,) + (0,) * (len(shape) - 1)
                    pieces.append(rs.Piece(self.loc[(name, r)], 0, start, (b - a, *shape[1:])))
            out[name] = rs.TensorLayout(shape, pieces)
        return out

    def local(self, name, bufs, rank, device="cpu"):
        """This rank's local shard of `name` (a view of its buffer; empty if it holds none)."""
        shape = self.shapes[name]
        a, b = self.rows[(name, rank)]
        if (name, rank) not in self.loc:
            return torch.empty((0, *shape[1:]), dtype=self.dtype, device=device)
        return bufs[self.loc[(name, rank)]].view(b - a, *shape[1:])

    def write(self, name, full, bufs, rank):
        if (name, rank) in self.loc:
            a, b = self.rows[(name, rank)]
            self.local(name, bufs, rank).copy_(full[a:b])

    def dtensors(self, bufs, rank, mesh):
        """{name: DTensor} over this rank's buffers (no copy), as FSDP2 holds its params."""
        from torch.distributed.tensor import DTensor, Shard

        out = {}
        for name, shape in self.shapes.items():
            local = self.local(name, bufs, rank, mesh.device_type)
            stride = tuple(math.prod(shape[k + 1 :]) for k in range(len(shape)))
            out[name] = DTensor.from_local(local, mesh, [Shard(0)], shape=shape, stride=stride)
        return out


def _fsdp_case(scenario, model, rank, world, device, src, dst, desc, dst_mesh_ranks=None):
    """A Case whose source is FSDP2-style DTensors in CPU memory (FSDP2's state; under
    CPUOffloadPolicy when the target device is a GPU), described by
    reshard.integrations.dtensor: the reshard method plans that layout and its preflight runs
    the LiveDTensors check; the baselines read the same DTensors. dst_mesh_ranks: the target's
    mesh when its targets are DTensors too (fsdp_resize's DCP load)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from reshard.integrations import dtensor as rsdt

    if not dist.is_initialized():
        # world 1 runs in this process without a group; DTensors need one. With CUDA it must
        # have an NCCL backend too, or reshard would take the group's gloo transport, which
        # refuses GPU buffers.
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    case = Case(scenario, model, rank, world, src, dst, desc, ("cpu", device))
    # the model's parameters, not its optimizer states' elements
    case.params = sc.count_params(
        {n: s for n, s in src.shapes.items() if not n.startswith(("exp_avg/", "exp_avg_sq/"))}
    )
    mesh = DeviceMesh("cpu", list(range(world)))
    case.src_dtensors = src.dtensors(case.src_buffers, rank, mesh)
    live = rsdt.describe(case.src_dtensors)
    case.src_layout, case.src_buffers = live.layout, live
    if dst_mesh_ranks is not None:
        dst_mesh = DeviceMesh("cpu", dst_mesh_ranks)  # every rank creates it (a collective)
        inside = rank in dst_mesh_ranks
        case.dst_dtensors = lambda bufs: dst.dtensors(bufs, rank, dst_mesh) if inside else {}
    return case


def fsdp_weight_sync(model, rank, world, device="cpu"):
    shapes = sc.named_shapes(model)
    src = FsdpShards(shapes, range(world), torch.float32, loc0=0)
    dst = sc.TensorParallel(shapes, _tp_groups(world), torch.bfloat16, loc0=100000)
    desc = (
        f"FSDP2 fp32 sharded params (DTensor Shard(0), DP={world}, torch.chunk rows) -> "
        f"TP={len(dst.groups[0])} bf16 rollout buffers (fused QKV, row/column splits, "
        "replicated norms)"
    )
    return _fsdp_case("fsdp_weight_sync", model, rank, world, device, src, dst, desc)


def fsdp_resize(model, rank, world, device="cpu"):
    if world < 2:
        raise ValueError("fsdp_resize needs world >= 2 (DP=world -> DP=world-1)")
    base = sc.named_shapes(model)
    shapes = {
        f"{s}/{n}": shape for s in ("param", "exp_avg", "exp_avg_sq") for n, shape in base.items()
    }
    src = FsdpShards(shapes, range(world), torch.float32, loc0=0)
    dst = FsdpShards(shapes, range(world - 1), torch.float32, loc0=100000)
    desc = (
        f"FSDP2 fp32 params + exp_avg + exp_avg_sq (DTensor Shard(0)): DP={world} -> "
        f"DP={world - 1} (elastic shrink)"
    )
    return _fsdp_case(
        "fsdp_resize", model, rank, world, device, src, dst, desc, list(range(world - 1))
    )


def fsdp_offload(model, rank, world, device="cpu"):
    """FSDP2 state under CPUOffloadPolicy into device-side fp32 partitions of the same geometry
    (world 1: this process's device; world > 1 on a CPU-only box: the next rank's memory)."""
    base = sc.named_shapes(model)
    shapes = {
        f"{s}/{n}": shape for s in ("param", "exp_avg", "exp_avg_sq") for n, shape in base.items()
    }
    src = FsdpShards(shapes, range(world), torch.float32, loc0=0)
    dst = FsdpShards(shapes, [(r + 1) % world for r in range(world)], torch.float32, loc0=100000)
    where = f"{device} of the same process" if world == 1 else "the next rank"
    desc = (
        f"FSDP2 CPU-offloaded fp32 params + exp_avg + exp_avg_sq (DTensor Shard(0), DP={world}) "
        f"-> fp32 device-side partitions on {where}"
    )
    return _fsdp_case("fsdp_offload", model, rank, world, device, src, dst, desc)


SCENARIOS = {
    "rl_weight_sync": rl_weight_sync,
    "offload_fp32": offload_fp32,
    "offload_bf16": offload_bf16,
    "offload_back": offload_back,
    "dp_change": dp_change,
    "lora_sync": lora_sync,
    "rollout_stream": rollout_stream,
    "rollout_tp": rollout_tp,
    "stream_offload": stream_offload,
    "fsdp_weight_sync": fsdp_weight_sync,
    "fsdp_resize": fsdp_resize,
    "fsdp_offload": fsdp_offload,
}
# default models of a scenario whose size is not the model sweep's (without --models)
SCENARIO_MODELS = {"lora_sync": ("gpt-125m", "gpt-350m")}
