"""rsfsdp.describe(module, key, optimizer) of optimizer state other than Adam's moments: any
per-parameter state tensor placed like its parameter, by its state key (docs/fsdp.md).

Real FSDP2 (fully_shard) models on spawned gloo ranks, real torch.optim optimizers stepped;
references are torch.distributed.checkpoint's full optimizer state or DTensor.full_tensor(),
computed in the test only; targets are poisoned (NaN) so an unwritten element shows.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/_spawn.py
sys.path.insert(0, str(Path(__file__).resolve().parent))  # _fsdputil.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "deepspeed"))  # _dsutil.py

from _spawn import run_ranks

ENV = {"RESHARD_TEST_THREADS": "1"}

# (torch.optim class, keyword arguments, its per-parameter state tensors placed like the
# parameter); each also keeps a scalar "step" (NAdam a "mu_product" too), refused below
OPTIMIZERS = [
    ("SGD", {"momentum": 0.9}, ("momentum_buffer",)),
    ("Adagrad", {}, ("sum",)),
    ("Adamax", {}, ("exp_avg", "exp_inf")),
    ("NAdam", {}, ("exp_avg", "exp_avg_sq")),
    ("RAdam", {}, ("exp_avg", "exp_avg_sq")),
]


def _full_state(net, opt):
    """{parameter name: {key: value}} of torch.distributed.checkpoint's full optimizer state
    dict (gathered by DCP itself, collective over the mesh)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    sd = get_optimizer_state_dict(net, opt, options=StateDictOptions(full_state_dict=True))
    return sd["state"]


def _hybrid(params, vector_key="trace", **defaults):
    """A user optimizer with two kinds of state, as hybrid optimizers keep (one rule for
    matrices, another for the rest). Matrices: "momentum_buffer" (a DTensor placed like the
    parameter) and "row_sq" (factored: one value per row, a DTensor of shape (rows, 1)). The
    others: `vector_key` (a plain tensor of the local shard: stepped through the local
    tensors) and "count" (a Python int). `defaults`: more hyperparameters (betas)."""
    import torch

    class Hybrid(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {"lr": 1e-2, **defaults})

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    st = self.state[p]
                    if p.ndim >= 2:
                        buf = st.setdefault("momentum_buffer", torch.zeros_like(p))
                        buf.mul_(0.9).add_(p.grad)
                        st["row_sq"] = p.grad.pow(2).sum(dim=1, keepdim=True)
                        p.add_(buf, alpha=-group["lr"])
                    else:
                        grad = p.grad.to_local()
                        trace = st.setdefault(vector_key, torch.zeros_like(grad))
                        trace.mul_(0.5).add_(grad)
                        st["count"] = st.get("count", 0) + 1
                        p._local_tensor.add_(trace, alpha=-group["lr"])

    return Hybrid(params)


# ------------------------------------------------------------------ torch optimizers' state


def _move_worker(rank, world, cases):
    """Each optimizer's state keys, described by key after two real steps at dp 2, move into a
    full replica on rank 1 and into the same model's state at dp 1 (rank 0 alone), both
    poisoned; both equal DCP's full state bitwise."""
    import torch
    from _dsutil import assert_bitwise, check_targets, replicated_targets
    from _fsdputil import (
        LR,
        broadcast_layout,
        make_net,
        param_groups,
        shard,
        torch_made_state,
        train,
    )
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    import reshard as rs
    from reshard.integrations import dtensor as rsdt
    from reshard.integrations import fsdp as rsfsdp

    mesh = init_device_mesh("cpu", (world,))
    alone = DeviceMesh("cpu", [0])  # every rank builds it (group creation is collective)
    done = []
    for cls_name, kw, keys in cases:
        cls = getattr(torch.optim, cls_name)
        net = shard(make_net(1), mesh)
        opt = cls(param_groups(net), lr=LR, **kw)
        train(net, opt, 2, seed=2, rank=rank)
        want = _full_state(net, opt)
        assert want and all(k in want[n] for n in want for k in keys), (cls_name, want)
        if rank == 0:  # the target at dp 1, its state as torch makes it, poisoned
            small = shard(make_net(3), alone)
            small_opt = cls(param_groups(small), lr=LR, **kw)
            torch_made_state(small, small_opt)
            with torch.no_grad():
                for st in small_opt.state.values():
                    for k in keys:
                        st[k]._local_tensor.fill_(float("nan"))

        for key in keys:
            tag = f"{cls_name} {key}"
            live = rsfsdp.describe(net, key, opt)
            assert sorted(live.layout.tensors) == sorted(want), tag
            assert live.reasons() == [] and live.notes == [], (tag, live.reasons(), live.notes)
            by_name = {n: opt.state[p][key] for n, p in net.named_parameters() if opt.state.get(p)}
            assert rsdt.describe(by_name).layout == live.layout, tag
            full = {n: want[n][key] for n in want}
            dst, bufs = replicated_targets(live, [1])
            rs.Transfer(live.layout, dst, budget_bytes_per_peer=256)(live, bufs)
            checked = check_targets(dst, bufs, full, f"{tag} -> rank 1")
            assert checked == (len(full) if rank == 1 else 0), (tag, checked)

            into = rsfsdp.describe(small, key, small_opt) if rank == 0 else None
            layout = broadcast_layout(into.layout if into else None)
            assert layout != live.layout and sorted(layout.tensors) == sorted(want), tag
            rs.Transfer(live.layout, layout, budget_bytes_per_peer=256)(live, into or {})
        if rank == 0:
            got = _full_state(small, small_opt)
            for n in want:
                for key in keys:
                    assert_bitwise(got[n][key], want[n][key], f"{cls_name} at dp 1 {key} {n}")
        done.append(cls_name)
    return done


def test_torch_optimizer_state_moves_by_key(tmp_path):
    out = run_ranks(_move_worker, 2, tmp_path, args=(OPTIMIZERS,), env=ENV, timeout=400)
    assert out[0] == [c for c, _, _ in OPTIMIZERS]


# ---------------------------------------------------------------- a user optimizer's state


def _hybrid_worker(rank, world):
    """A key held by some parameters only (left out of the others, a note says so); a plain
    tensor of the local shard's shape (read, and written back into); state not placed like
    its parameter (factored, a Python int) refused by every rank's preflight, naming the key."""
    import torch
    from _dsutil import assert_bitwise, check_targets, replicated_targets
    from _fsdputil import make_fsdp, param_groups, train
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    import reshard as rs
    from reshard.errors import NotReadyError
    from reshard.integrations import fsdp as rsfsdp

    mesh = init_device_mesh("cpu", (world,))
    net, _ = make_fsdp(mesh, seed=4)
    opt = _hybrid(param_groups(net))
    train(net, opt, 2, seed=4, rank=rank)
    params = {n: p for n, p in net.named_parameters() if opt.state.get(p)}
    matrices = sorted(n for n, p in params.items() if p.ndim >= 2)
    vectors = sorted(n for n, p in params.items() if p.ndim < 2)
    assert matrices and vectors

    def full(n, key):
        t, p = opt.state[params[n]][key], params[n]
        if not isinstance(t, DTensor):  # the local shard: placed like the parameter
            t = DTensor.from_local(t, mesh, p.placements, shape=p.shape, stride=p.stride())
        return t.full_tensor()

    for key, names, other in (("momentum_buffer", matrices, vectors), ("trace", vectors, matrices)):
        live = rsfsdp.describe(net, key, opt)
        assert sorted(live.layout.tensors) == names, (key, sorted(live.layout.tensors))
        assert live.reasons() == [], live.reasons()
        assert len(live.notes) == 1 and "of another kind" in live.notes[0], live.notes
        assert all(n in live.notes[0] for n in other), live.notes
        want = {n: full(n, key) for n in names}
        dst, bufs = replicated_targets(live, [0, 1])
        rs.Transfer(live.layout, dst, budget_bytes_per_peer=64)(live, bufs)
        assert check_targets(dst, bufs, want, key) == len(names)
        # and back into the live state, poisoned: every element written, nothing else
        with torch.no_grad():
            for n in names:
                t = opt.state[params[n]][key]
                getattr(t, "_local_tensor", t).fill_(float("nan"))
        rs.Transfer(dst, live.layout, budget_bytes_per_peer=64)(bufs, live)
        for n in names:
            assert_bitwise(full(n, key), want[n], f"{key} {n} written back")

    # RMSprop with momentum in the weights' param group only: the other group's parameters
    # keep square_avg alone, and are left out of momentum_buffer (not refused)
    groups = param_groups(net)
    groups[0]["momentum"] = 0.5
    rmsprop = torch.optim.RMSprop(groups, lr=1e-3)
    train(net, rmsprop, 2, seed=5, rank=rank)
    live = rsfsdp.describe(net, "momentum_buffer", rmsprop)
    held = {
        n: p for n, p in net.named_parameters() if "momentum_buffer" in rmsprop.state.get(p, {})
    }
    decayed = [n for n, p in net.named_parameters() if p.requires_grad and n.endswith("weight")]
    assert sorted(live.layout.tensors) == sorted(held) == sorted(decayed), sorted(held)
    assert live.reasons() == [] and "of another kind" in live.notes[0], (live.reasons(), live.notes)
    dst, bufs = replicated_targets(live, [0])
    rs.Transfer(live.layout, dst)(live, bufs)
    want = {n: rmsprop.state[p]["momentum_buffer"].full_tensor() for n, p in held.items()}
    assert check_targets(dst, bufs, want, "RMSprop") == (len(want) if rank == 0 else 0)

    messages = []
    for key, what in (
        ("row_sq", r"a DTensor placed \(Shard\(dim=0\),\) of shape"),
        ("count", "a Python int"),
    ):
        live = rsfsdp.describe(net, key, opt)
        with pytest.raises(NotReadyError, match=f"{key} is {what}.*not placed like its parameter"):
            live.check()
        dst, bufs = replicated_targets(live, [0])
        with pytest.raises(rs.PreflightError, match="not placed like its parameter") as err:
            rs.Transfer(live.layout, dst)(live, bufs)
        assert sorted(err.value.failures) == [0, 1]
        assert all(bool(b.isnan().all()) for b in bufs.values())
        messages.append(str(err.value))
    return messages


def test_user_optimizer_state_by_key(tmp_path):
    res = run_ranks(_hybrid_worker, 2, tmp_path, env=ENV, timeout=240)
    assert len(res[0]) == 2 and res[0] == res[1]  # the same message on every rank


# ------------------------------------------- a user optimizer's state under Adam's names


def _ema(params, **defaults):
    """A user optimizer that keeps Adam's state names without being Adam: "exp_avg" (an
    average of the gradients) and "max_exp_avg_sq" (the largest squared gradient seen, with
    no amsgrad flag), DTensors placed like their parameters. `defaults`: with or without
    betas."""
    import torch

    class Ema(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {"lr": 1e-2, **defaults})

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    st = self.state[p]
                    avg = st.setdefault("exp_avg", torch.zeros_like(p))
                    avg.mul_(0.9).add_(p.grad, alpha=0.1)
                    top = st.setdefault("max_exp_avg_sq", torch.zeros_like(p))
                    torch.maximum(top, p.grad.pow(2), out=top)
                    p.add_(avg, alpha=-group["lr"])

    return Ema(params)


def _user_adam_names_worker(rank, world):
    """A user optimizer's "exp_avg" / "max_exp_avg_sq", with betas in its defaults or without:
    described like any other per-parameter key (they were refused as Adam moments of an
    optimizer without betas, or without amsgrad), moved into a full replica on every rank and
    back into the live state, both poisoned, bitwise equal to DCP's full optimizer state. A
    hybrid user optimizer with betas keeping "exp_avg" for vectors only, as a plain tensor of
    the local shard: the matrices are left out (a note says so), not refused."""
    import torch
    from _dsutil import assert_bitwise, check_targets, replicated_targets
    from _fsdputil import make_fsdp, param_groups, train
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    import reshard as rs
    from reshard.integrations import fsdp as rsfsdp

    mesh = init_device_mesh("cpu", (world,))
    done = []
    for defaults in ({"beta": 0.9}, {"betas": (0.9, 0.99)}):
        net, _ = make_fsdp(mesh, seed=7)
        opt = _ema(param_groups(net), **defaults)
        train(net, opt, 2, seed=7, rank=rank)
        want = _full_state(net, opt)
        for key in ("exp_avg", "max_exp_avg_sq"):
            tag = f"{sorted(defaults)} {key}"
            live = rsfsdp.describe(net, key, opt)
            assert sorted(live.layout.tensors) == sorted(want), tag
            assert live.reasons() == [] and live.notes == [], (tag, live.reasons(), live.notes)
            full = {n: want[n][key] for n in want}
            dst, bufs = replicated_targets(live, [0, 1])
            rs.Transfer(live.layout, dst, budget_bytes_per_peer=64)(live, bufs)
            assert check_targets(dst, bufs, full, tag) == len(full), tag
            with torch.no_grad():
                for st in opt.state.values():
                    st[key]._local_tensor.fill_(float("nan"))
            rs.Transfer(dst, live.layout, budget_bytes_per_peer=64)(bufs, live)
            back = _full_state(net, opt)
            for n in want:
                assert_bitwise(back[n][key], full[n], f"{tag} {n} written back")
            done.append(tag)

    net, _ = make_fsdp(mesh, seed=8)
    opt = _hybrid(param_groups(net), vector_key="exp_avg", betas=(0.9, 0.99))
    train(net, opt, 2, seed=8, rank=rank)
    params = {n: p for n, p in net.named_parameters() if opt.state.get(p)}
    vectors = sorted(n for n, p in params.items() if p.ndim < 2)
    live = rsfsdp.describe(net, "exp_avg", opt)
    assert sorted(live.layout.tensors) == vectors, sorted(live.layout.tensors)
    assert live.reasons() == [], live.reasons()
    assert len(live.notes) == 1 and "of another kind" in live.notes[0], live.notes
    want = {}
    for n in vectors:
        local, p = opt.state[params[n]]["exp_avg"], params[n]
        assert not isinstance(local, DTensor)
        dt = DTensor.from_local(local, mesh, p.placements, shape=p.shape, stride=p.stride())
        want[n] = dt.full_tensor()
    dst, bufs = replicated_targets(live, [0, 1])
    rs.Transfer(live.layout, dst, budget_bytes_per_peer=64)(live, bufs)
    assert check_targets(dst, bufs, want, "hybrid exp_avg") == len(vectors)
    done.append("hybrid")
    return done


def test_user_optimizer_state_under_adam_names(tmp_path):
    res = run_ranks(_user_adam_names_worker, 2, tmp_path, env=ENV, timeout=240)
    assert len(res[0]) == 5 and res[0] == res[1]


# ------------------------------------------------------------------------------- refusals


def _refusals_worker(rank, world):
    """Keys known to hold state not placed like the parameter are refused by describe() on
    every rank alike (by the optimizer's class, not by this rank's state), naming key and why."""
    import torch
    from _fsdputil import LR, make_fsdp, param_groups, train
    from torch.distributed.device_mesh import init_device_mesh

    from reshard.errors import NotReadyError, UnsupportedError
    from reshard.integrations import fsdp as rsfsdp

    mesh = init_device_mesh("cpu", (world,))
    net, adamw = make_fsdp(mesh, seed=5)
    seen = []

    def refused(exc, match, *args):
        with pytest.raises(exc, match=match) as err:
            rsfsdp.describe(net, *args)
        seen.append(str(err.value))

    for cls_name, kw, _ in OPTIMIZERS:
        opt = getattr(torch.optim, cls_name)(param_groups(net), lr=LR, **kw)
        refused(UnsupportedError, f"{cls_name}'s 'step' is the step counter", "step", opt)
    refused(UnsupportedError, "'step' is the step counter", "step", _hybrid(param_groups(net)))
    nadam = torch.optim.NAdam(param_groups(net), lr=LR)
    train(net, nadam, 1, seed=5, rank=rank)
    refused(UnsupportedError, "NAdam's 'mu_product' is the product", "mu_product", nadam)
    adafactor = torch.optim.Adafactor(param_groups(net), lr=LR)
    for key in ("row_var", "col_var"):
        refused(UnsupportedError, f"Adafactor's '{key}' is Adafactor's factored", key, adafactor)
    refused(ValueError, "kind must be one of .* got 'momentum_buffer'", "momentum_buffer")
    refused(ValueError, "kind must be one of", "", nadam)
    refused(ValueError, "kind must be one of", 3, nadam)
    # a key the optimizer keeps for no parameter (mu_product is NAdam's, not AdamW's): a
    # check() reason, as only this rank's state says so
    train(net, adamw, 1, seed=5, rank=rank)
    with pytest.raises(NotReadyError, match="AdamW keeps no 'mu_product' state on this rank"):
        rsfsdp.describe(net, "mu_product", adamw).check()
    return seen


def test_state_not_placed_like_its_parameter_is_refused(tmp_path):
    res = run_ranks(_refusals_worker, 2, tmp_path, env=ENV, timeout=240)
    assert len(res[0]) == 12 and res[0] == res[1]  # the same error on every rank


# ------------------------------------------------------------ faults of one rank, by key


def _one_rank_faults_worker(rank, world):
    """Rank 1 alone: no state yet, a key lost for one parameter or all, a key placed
    otherwise or of another shape: every rank's transfer raises the same PreflightError
    naming rank 1, well before the timeout, writing nothing. A key kept in another dtype on
    rank 1: the plans' fingerprints differ, and rank 1's notes say how."""
    import re

    import torch
    from _dsutil import replicated_targets
    from _fsdputil import FAULT_TIMEOUT_S, LR, make_fsdp, param_groups, refused_by_rank_1, train
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    import reshard as rs
    from reshard.integrations import fsdp as rsfsdp

    mesh = init_device_mesh("cpu", (world,))
    out = []

    def refused(tag, net, key, opt, match):
        made = {}

        def attempt():
            live = rsfsdp.describe(net, key, opt)
            rep, bufs = made["bufs"] = replicated_targets(live, list(range(world)))
            rs.Transfer(live.layout, rep, timeout=FAULT_TIMEOUT_S)(live, bufs)

        err = refused_by_rank_1(tag, rank, attempt, re.escape(match))
        assert "fingerprint" not in str(err), (tag, str(err))
        assert all(bool(b.isnan().all()) for b in made["bufs"][1].values()), tag
        out.append((tag, str(err)))

    # SGD's momentum_buffer: rank 1's optimizer has not stepped
    net, _ = make_fsdp(mesh, seed=6)
    sgd = torch.optim.SGD(param_groups(net), lr=LR, momentum=0.9)
    net(torch.ones(3, 13)).pow(2).mean().backward()
    if rank == 0:
        sgd.step()
    sgd.zero_grad()
    refused("no state", net, "momentum_buffer", sgd, "no optimizer state yet on this rank")

    # Adagrad's sum (its state also holds the step)
    adagrad = torch.optim.Adagrad(param_groups(net), lr=LR)
    train(net, adagrad, 2, seed=6, rank=rank)
    state = adagrad.state[net.fc2.weight]
    saved = {p: dict(st) for p, st in adagrad.state.items()}

    def restore():
        for p, st in saved.items():
            adagrad.state[p] = dict(st)

    if rank == 1:
        del state["sum"]
    refused("lost for one", net, "sum", adagrad, "'fc2.weight': Adagrad keeps no 'sum' state")
    restore()
    if rank == 1:
        for st in adagrad.state.values():
            del st["sum"]
    refused("lost for all", net, "sum", adagrad, "Adagrad keeps no 'sum' state on this rank")
    restore()
    state = adagrad.state[net.fc2.weight]
    if rank == 1:
        local = torch.zeros(state["sum"].shape)
        state["sum"] = DTensor.from_local(local, mesh, [Replicate()], run_check=False)
    refused("placed otherwise", net, "sum", adagrad, "sum is a DTensor placed (Replicate(),)")
    restore()
    flipped = DeviceMesh("cpu", [1, 0])  # every rank builds it (group creation is collective)
    if rank == 1:  # placed alike, on a mesh of the ranks in another order
        sum_ = adagrad.state[net.fc2.weight]["sum"]
        adagrad.state[net.fc2.weight]["sum"] = DTensor.from_local(
            sum_._local_tensor, flipped, sum_.placements, shape=sum_.shape, stride=sum_.stride()
        )
    refused(
        "another mesh",
        net,
        "sum",
        adagrad,
        "on another mesh (ranks [1, 0], its parameter's [0, 1])",
    )
    restore()
    if rank == 1:  # the full tensor, plain: not this rank's shard
        adagrad.state[net.fc2.weight]["sum"] = torch.zeros(7, 11)
    refused("full plain tensor", net, "sum", adagrad, "sum is a Tensor of shape (7, 11)")
    restore()

    # a user optimizer's key lost for one parameter on rank 1: its state is a holder's
    # without the key (a fault), not of another kind (left out)
    hybrid = _hybrid(param_groups(net))
    train(net, hybrid, 1, seed=6, rank=rank)
    kept = hybrid.state[net.fc1.weight].pop("momentum_buffer") if rank == 1 else None
    refused("user key lost", net, "momentum_buffer", hybrid, "keeps no 'momentum_buffer' state")
    if kept is not None:
        hybrid.state[net.fc1.weight]["momentum_buffer"] = kept

    # Adagrad's sum kept in bf16 on rank 1: another layout, refused as the moments are
    if rank == 1:
        for st in adagrad.state.values():
            st["sum"] = st["sum"].to(torch.bfloat16)
    live = rsfsdp.describe(net, "sum", adagrad)
    rep, bufs = replicated_targets(live, list(range(world)))
    with pytest.raises(rs.PreflightError, match="fingerprint") as err:
        rs.Transfer(live.layout, rep, timeout=FAULT_TIMEOUT_S)(live, bufs)
    assert sorted(err.value.failures) == [1], err.value.failures
    assert (rank == 1) == any("sum laid out in torch.bfloat16" in n for n in live.notes), live.notes
    restore()

    # every fault undone: the same states move
    for key, opt in (("sum", adagrad), ("momentum_buffer", hybrid)):
        live = rsfsdp.describe(net, key, opt)
        assert live.reasons() == [], (key, live.reasons())
        rep, bufs = replicated_targets(live, list(range(world)))
        rs.Transfer(live.layout, rep, timeout=FAULT_TIMEOUT_S)(live, bufs)
        assert not any(bool(b.isnan().any()) for b in bufs.values()), key
    return out


def test_faults_of_one_rank_by_key_are_refused_everywhere(tmp_path):
    res = run_ranks(_one_rank_faults_worker, 2, tmp_path, env=ENV, timeout=240, group_timeout=30)
    assert [t for t, _ in res[0]] == [
        "no state",
        "lost for one",
        "lost for all",
        "placed otherwise",
        "another mesh",
        "full plain tensor",
        "user key lost",
    ]
    assert res[0] == res[1]  # the same message, fault by fault, on every rank
