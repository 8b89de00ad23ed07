"""Helpers for the FSDP2 / DTensor tests, used inside spawned ranks: real fully_shard models.

Kept import-light at module level (the spawn context re-imports it in every worker). Layout
checks (`assemble`, `check_targets`, `tp_targets`, bitwise comparison) are the DeepSpeed
tests' (tests/deepspeed/_dsutil.py): they read only an rs.Layout and buffers.
"""

from __future__ import annotations

LR = 1e-2
BETAS = (0.9, 0.99)


def make_net(seed, dtype=None, hidden=11):
    """Uneven sizes on purpose: with dp 2..4 the last ranks get fewer rows, `scale` (1 row) and
    `gate` (2 rows) leave some ranks with an empty shard. The root keeps `head`, `gate`,
    `scale` and a LayerNorm with a frozen weight (the root stays unsharded after forward).
    `hidden`: fc1's outputs (even for tensor parallelism, which DTensor needs even)."""
    import torch

    torch.manual_seed(seed)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = torch.nn.Linear(13, hidden)
            self.fc2 = torch.nn.Linear(hidden, 7)
            self.norm = torch.nn.LayerNorm(7)
            self.head = torch.nn.Linear(7, 5)
            self.gate = torch.nn.Parameter(torch.randn(2, 5))
            self.scale = torch.nn.Parameter(torch.ones(1))
            self.norm.weight.requires_grad_(False)

        def forward(self, x):
            h = self.norm(self.fc2(torch.relu(self.fc1(x))))
            return (self.head(h) * self.scale) @ self.gate.t()

    net = Net()
    if dtype is not None:
        net = net.to(dtype)
    return net


def param_groups(net):
    """Weights decayed, everything else not (two groups, as in the DeepSpeed tests)."""
    decay, other = [], []
    for name, p in net.named_parameters():
        if p.requires_grad:
            (decay if name.endswith("weight") else other).append(p)
    return [{"params": decay, "weight_decay": 0.01}, {"params": other, "weight_decay": 0.0}]


def shard(net, mesh, root=True, **kw):
    """fully_shard fc1 and fc2 as their own groups, then the root (the rest)."""
    from torch.distributed.fsdp import fully_shard

    fully_shard(net.fc1, mesh=mesh, **kw)
    fully_shard(net.fc2, mesh=mesh, **kw)
    if root:
        fully_shard(net, mesh=mesh, **kw)
    return net


def policies(mode):
    """fully_shard keyword arguments of a named configuration."""
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    if mode == "mp":
        return {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16)}
    if mode == "offload":
        # pin_memory needs CUDA; on the CPU the policy still keeps params, grads, optimizer
        # state in host memory through FSDP's offload path
        return {"offload_policy": CPUOffloadPolicy(pin_memory=False)}
    if mode == "offload_mp":
        return {
            "offload_policy": CPUOffloadPolicy(pin_memory=False),
            "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16),
        }
    return {}


def make_fsdp(mesh, seed=0, mode="fp32", dtype=None, adamw=True, amsgrad=False):
    import torch

    net = shard(make_net(seed, dtype), mesh, **policies(mode))
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    opt = cls(param_groups(net), lr=LR, betas=BETAS, amsgrad=amsgrad)
    return net, opt


def kinds_of(opt):
    """Every describable kind of `opt`'s state: max_exp_avg_sq only under amsgrad."""
    amsgrad = any(g.get("amsgrad") for g in opt.param_groups)
    return ("param", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())


def batch(seed, dtype=None, device=None):
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, 13, generator=g).to(device=device, dtype=dtype)


def step(net, opt, seed, dtype=None, device=None):
    loss = net(batch(seed, dtype, device)).float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def torch_made_state(net, opt):
    """The state torch's own first step makes (a step with lr 0 and zero gradients)."""
    import torch

    for p in net.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    lrs = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = 0.0
    opt.step()
    opt.zero_grad()
    for g, lr in zip(opt.param_groups, lrs, strict=True):
        g["lr"] = lr


def train(net, opt, steps, seed, rank, dtype=None, first=0, device=None):
    for s in range(first, first + steps):
        step(net, opt, seed * 1000 + s * 10 + rank, dtype, device)


def full_params(net):
    """Reference: DTensor.full_tensor() of every parameter (collective over the mesh)."""
    return {n: p.full_tensor().detach().clone() for n, p in net.named_parameters()}


def full_moments(net, opt, kind):
    out = {}
    for n, p in net.named_parameters():
        st = opt.state.get(p)
        if st:
            out[n] = st[kind].full_tensor().detach().clone()
    return out


def reference(net, opt, kind):
    return full_params(net) if kind == "param" else full_moments(net, opt, kind)


def steps_of(net, opt):
    """{name: step counter} of every parameter with optimizer state."""
    return {n: float(opt.state[p]["step"]) for n, p in net.named_parameters() if opt.state.get(p)}


def poison_padding(net):
    """NaN into FSDP2's padding (the tail of each padded shard beyond the local tensor);
    returns (undo, number of padding elements). Writing padding or reading it into a target
    shows up as a changed or NaN value."""
    import torch

    from reshard.integrations.fsdp import _fsdp_params

    saved = []
    for fp in _fsdp_params(net):
        data = fp._sharded_param_data
        n = fp.sharded_param._local_tensor.numel()
        if data.numel() > n and data.is_floating_point():
            saved.append((data, n, data[n:].clone()))
            with torch.no_grad():
                data[n:] = float("nan")

    def undo():
        with torch.no_grad():
            for data, n, vals in saved:
                data[n:] = vals

    def intact():
        return all(bool(data[n:].isnan().all()) for data, n, _ in saved)

    return undo, intact, sum(d.numel() - n for d, n, _ in saved)


def sub_layout(layout, names):
    """The layout restricted to `names` (a target may name a subset of its source's tensors)."""
    import reshard as rs

    return rs.Layout({n: layout.tensors[n] for n in names}, layout.storages)


def same_layout_everywhere(layout, group=None):
    import torch.distributed as dist

    got = [None] * dist.get_world_size(group)
    dist.all_gather_object(got, layout, group=group)
    return all(g == layout for g in got)


def broadcast_layout(layout, src=0):
    """A layout known only on the ranks that hold the state, sent to every rank."""
    import torch.distributed as dist

    box = [layout]
    dist.broadcast_object_list(box, src=src)
    return box[0]


# A fault only rank 1 has when every rank describes and transfers: each rank must raise the
# same PreflightError naming rank 1, fast, with nothing written. A rank-local raise in
# describe() would leave rank 0 in the transfer's exchange until FAULT_TIMEOUT_S: the worker
# then fails at once (the parent sees the differing error, not a hang).
FAULT_TIMEOUT_S = 20.0


def refused_by_rank_1(tag, rank, attempt, match):
    """`attempt()` (every rank describes and transfers) must end in the PreflightError every
    rank raises for rank 1's fault alone, well before the timeout (before the fixes, rank 1
    raised alone), with a reason of rank 1's matching the regex `match`. Returns it."""
    import re
    import time

    import reshard as rs

    t0 = time.perf_counter()
    try:
        attempt()
    except Exception as exc:  # noqa: BLE001 - any other outcome is the failure reported below
        err = exc
    else:
        raise AssertionError(f"{tag}: rank {rank}: the transfer ran")
    if not isinstance(err, rs.PreflightError):
        raise AssertionError(f"{tag}: rank {rank} raised {type(err).__name__}: {err}") from err
    took = time.perf_counter() - t0
    assert took < FAULT_TIMEOUT_S / 4, f"{tag}: rank {rank} took {took:.1f} s"
    assert sorted(err.failures) == [1], (tag, err.failures)
    assert any(re.search(match, r) for r in err.failures[1]), (tag, str(err))
    return err
