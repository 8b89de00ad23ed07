"""Helpers for the DeepSpeed tests, used inside spawned ranks: real engines, references.

Kept import-light at module level (the spawn context re-imports it in every worker).
"""

from __future__ import annotations

import logging
import os

STAGES_OFFLOAD = [(s, o) for s in (1, 2, 3) for o in ("none", "cpu")]


def ds_env(rank, world):
    """What the DeepSpeed launcher would set; DS_ACCELERATOR=cpu before deepspeed imports."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.update(
        LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_SIZE=str(world)
    )
    import deepspeed
    from deepspeed.utils import logger

    logger.setLevel(logging.ERROR)
    return deepspeed


def make_model(kind, seed):
    import torch

    torch.manual_seed(seed)
    if kind == "mlp":
        # 13x13 + 13 twice, plus a 1-element param in its own group: with dp 3 it pads its
        # ZeRO-1/2 group to 6, so two ranks hold only padding.
        class MLP(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.fc1 = torch.nn.Linear(13, 13)
                self.fc2 = torch.nn.Linear(13, 13)
                self.scale = torch.nn.Parameter(torch.ones(1))

            def forward(self, x):
                return self.fc2(torch.relu(self.fc1(x))) * self.scale

        return MLP()
    if kind == "block":
        # A small transformer block with odd sizes and a frozen LayerNorm.
        class Block(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.layer = torch.nn.TransformerEncoderLayer(
                    d_model=12, nhead=2, dim_feedforward=20, dropout=0.0, batch_first=True
                )
                self.head = torch.nn.Linear(12, 7)
                self.layer.norm2.weight.requires_grad_(False)

            def forward(self, x):
                return self.head(self.layer(x))

        return Block()
    if kind in ("moe", "moe-only"):
        return _moe_model(kind)
    raise ValueError(kind)


def _moe_model(kind):
    """A mixture-of-experts block (a router and 4 experts, top-1) that ZeRO-3 is told to treat
    as a leaf module (`set_z3_leaf_modules`: its params fetched and released as a unit, its
    gradients reduced by one module backward hook instead of per-param hooks).
    "moe": a Linear before it and a head after it, which keep per-param gradient hooks;
    "moe-only": two MoE blocks, so every trainable param sits in a leaf module."""
    import torch

    class Expert(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up = torch.nn.Linear(8, 12)
            self.down = torch.nn.Linear(12, 8)

        def forward(self, x):
            return self.down(torch.relu(self.up(x)))

    class MoE(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.router = torch.nn.Linear(8, 4, bias=False)
            self.experts = torch.nn.ModuleList(Expert() for _ in range(4))

        def forward(self, x):
            w = torch.softmax(self.router(x).float(), -1).to(x.dtype)
            top = w.argmax(-1)
            out = torch.zeros_like(x)
            for i, expert in enumerate(self.experts):
                routed = top == i
                if bool(routed.any()):
                    out[routed] = out[routed] + expert(x[routed]) * w[routed][:, i : i + 1]
            return out

    class Net(torch.nn.Module):
        z3_leaf_classes = (MoE,)

        def __init__(self):
            super().__init__()
            if kind == "moe":
                self.inp = torch.nn.Linear(6, 8)
                self.moe = MoE()
                self.head = torch.nn.Linear(8, 5)
            else:
                self.moe = MoE()
                self.moe2 = MoE()

        def forward(self, x):
            if kind == "moe":
                h = self.inp(x)
                return self.head(h + self.moe(h))
            h = x + self.moe(x)
            return h + self.moe2(h)

    return Net()


def param_groups(model):
    weights, biases, other = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (weights if name.endswith("weight") else biases if name.endswith("bias") else other).append(
            p
        )
    groups = [{"params": weights, "weight_decay": 0.01}, {"params": biases, "weight_decay": 0.0}]
    if other:
        groups.append({"params": other, "weight_decay": 0.0})
    return groups


def make_engine(
    stage,
    offload,
    model="mlp",
    seed=0,
    dtype="bf16",
    zero_extra=None,
    config_extra=None,
    optimizer="adamw",
):
    import deepspeed
    import torch

    net = make_model(model, seed)
    leaf = getattr(net, "z3_leaf_classes", None)
    if leaf:
        from deepspeed.utils import set_z3_leaf_modules

        set_z3_leaf_modules(net, list(leaf))
    if optimizer == "adamw":
        opt = torch.optim.AdamW(param_groups(net), lr=1e-2, betas=(0.9, 0.99))
    elif optimizer == "sgd":
        opt = torch.optim.SGD(param_groups(net), lr=1e-2, momentum=0.9)
    elif optimizer == "sgd0":  # plain SGD: keeps no per-parameter state at all
        opt = torch.optim.SGD(param_groups(net), lr=1e-2)
    else:
        raise ValueError(optimizer)
    zero = {"stage": stage, "offload_optimizer": {"device": offload}}
    if stage == 3 and model == "block":
        # several sub-groups, and no persistent params: the plain ZeRO-3 path
        zero.update(sub_group_size=200, stage3_param_persistence_threshold=0)
    zero.update(zero_extra or {})
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10**9,
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "loss_scale": 128}
    cfg.update(config_extra or {})
    engine, _, _, _ = deepspeed.initialize(model=net, optimizer=opt, config=cfg)
    return engine


def batch(engine, model, seed):
    import torch

    g = torch.Generator().manual_seed(seed)
    shape = {"mlp": (2, 13), "block": (2, 5, 12), "moe": (2, 5, 6), "moe-only": (2, 5, 8)}[model]
    dtype = next(p for p in engine.module.parameters()).dtype
    x = torch.randn(shape, generator=g).to(device=engine.device, dtype=dtype)
    # a leaf module whose input needs no grad fails DeepSpeed 0.19.8's own backward ("The size
    # of tensor a (0) must match the size of tensor b (12)"): "moe-only" starts with one
    return x.requires_grad_() if model == "moe-only" else x


def train(engine, model, steps, seed, rank, first=0):
    for s in range(first, first + steps):
        x = batch(engine, model, seed * 1000 + s * 10 + rank)
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
    relink_moments(engine)


def assert_restored_then_in_step(a, b, want, model, rank, kinds, tag):
    """Engine B, restored from A's state `want` ({kind: {name: full tensor}}), holds it
    bitwise; one more step of both on the same batch keeps them bitwise equal (the loss and
    every kind)."""
    for k in kinds:
        got = reference(b, k)
        for n in want[k]:
            assert_bitwise(got[n], want[k][n], f"{tag} restored {k} {n}")
    x = batch(a, model, 777 + rank)
    losses = []
    for e in (a, b):
        loss = e(x).float().pow(2).mean()
        e.backward(loss)
        e.step()
        losses.append(loss.detach())
    assert_bitwise(losses[1], losses[0], f"{tag} next step's loss")
    for k in kinds:
        ra, rb = reference(a, k), reference(b, k)
        for n in ra:
            assert_bitwise(rb[n], ra[n], f"{tag} after the next step {k} {n}")


def relink_moments(engine):
    """Work around a DeepSpeed 0.19.8 bug: ZeRO-1/2 links the per-param moment views once,
    right after the *first* param group's first step, so params of later groups get no
    `exp_avg` link and safe_get_full_optimizer_state raises for them. Re-linking after a step
    makes the public accessor usable as the reference (no reshard code path depends on it)."""
    opt = engine.optimizer
    if engine.zero_optimization_stage() <= 2 and getattr(opt, "_hp_optimizer_states_linked", 0):
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()


def named_trainable(engine):
    return [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]


def reference(engine, kind):
    """Full tensors of `kind` through DeepSpeed's own public accessors (collective)."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {}
    if kind == "param":
        params = list(engine.module.named_parameters())
        if engine.zero_optimization_stage() == 3:
            with deepspeed.zero.GatheredParameters([p for _, p in params]):
                for n, p in params:
                    out[n] = p.data.detach().clone()
        else:
            for n, p in params:
                out[n] = p.data.detach().clone()
        return out
    for n, p in named_trainable(engine):
        if kind == "fp32":
            out[n] = safe_get_full_fp32_param(p).detach().clone()
        else:
            out[n] = safe_get_full_optimizer_state(p, kind).detach().clone()
    return out


def assemble(layout, buffers, group=None):
    """Brute force: every element of every tensor from the layout's pieces and the ranks'
    buffers, all-gathered; replicas must agree and every element must be covered."""
    import torch
    import torch.distributed as dist

    me = dist.get_rank(group)
    out = {}
    for name, tl in layout.tensors.items():
        shape = tuple(tl.shape)
        val = torch.full(shape, float("nan"), dtype=torch.float64)
        hit = torch.zeros(shape, dtype=torch.int64)
        for pc in tl.pieces:
            if layout.storages[pc.location].rank != me:
                continue
            buf = buffers[pc.location]
            idx = torch.full(pc.shape, pc.offset, dtype=torch.int64)
            for k, (n, st) in enumerate(zip(pc.shape, pc.strides, strict=True)):
                view = [1] * len(pc.shape)
                view[k] = n
                idx = idx + (torch.arange(n) * st).view(view)
            box = tuple(slice(s, s + n) for s, n in zip(pc.start, pc.shape, strict=True))
            vals = buf.detach().to("cpu").view(-1)[idx.view(-1)].to(torch.float64).view(pc.shape)
            prev = val[box]
            seen = hit[box] > 0
            if seen.any():
                assert _same(prev[seen], vals[seen]), f"{name}: local replicas disagree"
            val[box] = vals
            hit[box] += 1
        world = dist.get_world_size(group)
        vals = [torch.empty_like(val) for _ in range(world)]
        hits = [torch.empty_like(hit) for _ in range(world)]
        dist.all_gather(vals, val, group=group)
        dist.all_gather(hits, hit, group=group)
        full = torch.full(shape, float("nan"), dtype=torch.float64)
        covered = torch.zeros(shape, dtype=torch.bool)
        for v, h in zip(vals, hits, strict=True):
            m = h > 0
            both = m & covered
            assert _same(full[both], v[both]), f"{name}: replicas on different ranks disagree"
            full[m] = v[m]
            covered |= m
        assert bool(covered.all()), f"{name}: {int((~covered).sum())} elements in no piece"
        out[name] = full
    return out


def _same(a, b):
    import torch

    return bool(torch.equal(a, b))


def bits(t):
    """Bit pattern of a float tensor for bitwise comparison; -0.0 folds into +0.0 because the
    references are built by all-reduce sums (0 + -0 = +0), which cannot preserve it."""
    import torch

    t = t.detach().cpu()
    t = t + 0.0  # -0.0 -> +0.0, NaN payloads kept
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_bitwise(got, want, what):
    import torch

    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    g = got.to(want.dtype) if got.dtype != want.dtype else got
    # float64 assembly of a bf16/fp32 value is exact; casting back is exact too.
    if not torch.equal(bits(g), bits(want)):
        diff = (g.float() - want.float()).abs().max().item()
        raise AssertionError(f"{what}: not bitwise equal (max abs diff {diff})")


# ------------------------------------------------------------------ target layouts


def replicated_targets(live, owners, dtype=None, device="cpu"):
    """A full copy of every tensor on each rank in `owners`: one storage per (tensor, rank)."""
    import torch

    import reshard as rs

    tensors, storages, buffers, me = {}, {}, {}, _me()
    for i, (name, tl) in enumerate(sorted(live.layout.tensors.items())):
        dt = dtype or _src_dtype(live, tl)
        locs = []
        for j, r in enumerate(owners):
            loc = i * len(owners) + j
            n = tl.numel
            storages[loc] = rs.Storage(r, dt, n)
            locs.append(loc)
            if r == me:
                buffers[loc] = torch.full((n,), float("nan"), dtype=dt, device=device)  # poisoned
        tensors[name] = rs.replicated(tl.shape, locs)
    return rs.Layout(tensors, storages), buffers


def tp_targets(live, owners, dtype=None, device="cpu"):
    """Rollout-style TP shards: every tensor split along dim 0 over `owners` (uneven)."""
    import torch

    import reshard as rs

    tp = len(owners)
    tensors, storages, buffers, me = {}, {}, {}, _me()
    for i, (name, tl) in enumerate(sorted(live.layout.tensors.items())):
        dt = dtype or _src_dtype(live, tl)
        n0 = tl.shape[0]
        sizes = [n0 // tp + (1 if t < n0 % tp else 0) for t in range(tp)]
        locs = []
        for t, r in enumerate(owners):
            loc = i * tp + t
            numel = sizes[t] * (tl.numel // n0 if n0 else 0)
            storages[loc] = rs.Storage(r, dt, numel)
            locs.append(loc)
            if r == me:
                buffers[loc] = torch.full((numel,), float("nan"), dtype=dt, device=device)
        tensors[name] = rs.split(tl.shape, 0, sizes, locs)
    return rs.Layout(tensors, storages), buffers


def _me():
    import torch.distributed as dist

    return dist.get_rank()


def _src_dtype(live, tl):
    return live.layout.storages[tl.pieces[0].location].dtype


def _read_targets(layout, buffers):
    """{name: tensor} of this rank's target pieces, as (box slices, values)."""
    me = _me()
    out = {}
    for name, tl in layout.tensors.items():
        for pc in tl.pieces:
            if layout.storages[pc.location].rank != me:
                continue
            n = 1
            for s in pc.shape:
                n *= s
            vals = buffers[pc.location][pc.offset : pc.offset + n].view(pc.shape).cpu()
            box = tuple(slice(s, s + k) for s, k in zip(pc.start, pc.shape, strict=True))
            out.setdefault(name, []).append((box, vals))
    return out


def check_targets(layout, buffers, want, tag):
    got = _read_targets(layout, buffers)
    for name, parts in got.items():
        for box, vals in parts:
            assert_bitwise(vals, want[name].cpu()[box].to(vals.dtype), f"{tag} {name}{box}")
    return sum(len(p) for p in got.values())
