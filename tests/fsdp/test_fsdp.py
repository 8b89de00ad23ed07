"""reshard.integrations.fsdp / dtensor against real FSDP2 (fully_shard) models on gloo ranks.

CPU, spawned gloo ranks. References are DTensor.full_tensor() of the parameters and of the
torch.optim AdamW state, computed in the test only; targets are poisoned (NaN) so an unwritten
element shows; FSDP2's own padding is poisoned so a read or write of it shows. Several
configurations share one spawn so the module stays within a few minutes on 2 cores.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/_spawn.py
sys.path.insert(0, str(Path(__file__).resolve().parent))  # _fsdputil.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "deepspeed"))  # _dsutil.py

from _fsdputil import FAULT_TIMEOUT_S, refused_by_rank_1
from _spawn import run_ranks

ENV = {"RESHARD_TEST_THREADS": "1"}
KINDS = ("param", "exp_avg", "exp_avg_sq")
MOMENTS = ("exp_avg", "exp_avg_sq")


def _describe(net, opt, kind):
    from reshard.integrations import fsdp as rsfsdp

    return rsfsdp.describe(net, kind) if kind == "param" else rsfsdp.describe(net, kind, opt)


def _check_views(net, opt, live, kind):
    """Every described buffer is the live local tensor FSDP2 / the optimizer holds (a view)."""
    locals_ = []
    for p in net.parameters():
        t = p if kind == "param" else (opt.state.get(p) or {}).get(kind)
        if t is not None and t._local_tensor.numel():
            locals_.append(t._local_tensor)
    assert len(live.buffers) == len(locals_), (len(live.buffers), len(locals_))
    ptrs = {(b.data_ptr(), b.numel()) for b in live.buffers.values()}
    assert ptrs == {(t.data_ptr(), t.numel()) for t in locals_}


# ------------------------------------------------------------------------------- geometry


def _check_geometry(net, opt, tag):
    """Every kind's layout, assembled from this rank's views and the peers', equals
    full_tensor() bitwise; identical on every rank; views of the live tensors; FSDP2's padding
    (poisoned) is never read. Returns the number of padding elements poisoned here."""
    from _dsutil import assemble, assert_bitwise
    from _fsdputil import kinds_of, poison_padding, reference, same_layout_everywhere

    from reshard.integrations import dtensor as rsdt

    undo, intact, npad = poison_padding(net)
    try:
        for kind in kinds_of(opt):
            live = _describe(net, opt, kind)
            assert same_layout_everywhere(live.layout), f"{tag} {kind}: layouts differ"
            # the same DTensors described by name: the same layout, location ids included
            # (sorted-name order), storages in the described tensors' own dtype
            dts = {n: p for n, p in net.named_parameters()}
            if kind != "param":
                dts = {n: opt.state[p][kind] for n, p in dts.items() if opt.state.get(p)}
            assert rsdt.describe(dts).layout == live.layout, f"{tag} {kind}: numbering"
            want = reference(net, opt, kind)
            assert sorted(live.layout.tensors) == sorted(want)
            assert live.check() is None
            _check_views(net, opt, live, kind)
            got = assemble(live.layout, live.buffers)
            for n in want:
                assert_bitwise(got[n], want[n], f"{tag} {kind} {n}")
            if "offload" in tag:
                assert all(b.device.type == "cpu" for b in live.buffers.values())
        assert intact()
    finally:
        undo()
    return npad


# ------------------------------------------------------------------- DTensor placements, 2-D


def _dtensor_cases(mesh1, mesh2):
    """(name, mesh, placements, shape) of hand-made DTensors: uneven, empty shards, replicas,
    two mesh dims on one tensor dim, a strided shard."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    return [
        ("s0_uneven", mesh1, [Shard(0)], (7, 3)),
        ("s1_uneven", mesh1, [Shard(1)], (2, 6)),
        ("s0_empty", mesh1, [Shard(0)], (3, 2)),  # the 4th rank holds nothing
        ("rep", mesh1, [Replicate()], (5,)),
        ("s0_s1", mesh2, [Shard(0), Shard(1)], (5, 7)),
        ("s0_s0", mesh2, [Shard(0), Shard(0)], (9, 2)),
        ("rep_s0", mesh2, [Replicate(), Shard(0)], (5, 3)),
        ("s1_rep", mesh2, [Shard(1), Replicate()], (3, 5)),
        ("strided", mesh2, [_StridedShard(0, split_factor=2), Shard(0)], (8, 3)),
        ("strided_3d", mesh2, [_StridedShard(1, split_factor=2), Shard(1)], (2, 12, 2)),
        # alone, a strided shard leaves each rank rows k and 4 + k: two pieces per local tensor
        ("strided_alone", mesh1, [_StridedShard(0, split_factor=2)], (8, 3)),
        # a sliced mesh: one instance per row of mesh2, each holding a replica
        ("sliced", mesh2["b"], [Shard(0)], (5, 2)),
    ]


def _placements_worker(rank, world):
    import torch
    from _dsutil import assemble, assert_bitwise, check_targets, replicated_targets
    from _fsdputil import same_layout_everywhere
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, distribute_tensor

    import reshard as rs
    from reshard.errors import NotReadyError
    from reshard.integrations import dtensor as rsdt

    mesh1 = init_device_mesh("cpu", (world,))
    mesh2 = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("a", "b"))
    g = torch.Generator().manual_seed(5)
    dts, full = {}, {}
    for name, mesh, placements, shape in _dtensor_cases(mesh1, mesh2):
        t = torch.randn(shape, generator=g)
        full[name] = t
        dts[name] = distribute_tensor(t, mesh, placements)
    for name, dt in dts.items():
        assert torch.equal(dt.full_tensor(), full[name]), f"{name}: torch itself disagrees"
    live = rsdt.describe(dts)
    assert same_layout_everywhere(live.layout)
    got = assemble(live.layout, live.buffers)
    for name in full:
        assert_bitwise(got[name], full[name], name)
    # read every DTensor into one fp32 and one bf16 replica on ranks 0 and 2
    for dtype in (torch.float32, torch.bfloat16):
        dst, bufs = replicated_targets(live, [0, world - 1], dtype=dtype)
        rs.Transfer(live.layout, dst, budget_bytes_per_peer=64)(live, bufs)
        check_targets(dst, bufs, full, f"replicas {dtype}")
    # and write them back from poisoned DTensors: every element of every shard is written
    for dt in dts.values():
        dt._local_tensor.fill_(float("nan"))
    rs.Transfer(dst, live.layout, budget_bytes_per_peer=64)(bufs, live)
    for name, dt in dts.items():
        want = full[name].to(torch.bfloat16).float()
        assert_bitwise(dt.full_tensor(), want, f"written back {name}")
    # a Partial placement stores no element: refused, naming it (by check(): the peers may
    # hold the tensor otherwise placed)
    part = distribute_tensor(torch.ones(4), mesh1, [Partial()])
    with pytest.raises(NotReadyError, match=r"placement Partial\(sum\) on mesh dim 0"):
        rsdt.describe({"p": part}).check()
    return sorted(full)


def _placements_and_2d_worker(rank, world):
    return _placements_worker(rank, world), _fsdp_2d_worker(rank, world)


def _fsdp_2d_worker(rank, world):
    import torch
    from _dsutil import check_targets, tp_targets
    from _fsdputil import BETAS, LR, full_params, make_fsdp, make_net, param_groups, shard, train
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    from torch.distributed.tensor.placement_types import _StridedShard

    import reshard as rs
    from reshard.integrations import fsdp as rsfsdp

    # HSDP: replicate over mesh dim 0, shard over mesh dim 1
    hsdp = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    net, opt = make_fsdp(hsdp, seed=3)
    assert isinstance(net.fc1.weight.placements[0], Replicate)
    train(net, opt, 2, seed=4, rank=hsdp["replicate"].get_local_rank())
    _check_geometry(net, opt, "HSDP")

    # FSDP x TP: fc1 column-parallel, fc2 row-parallel (10 over tp 2: DTensor's TP ops need
    # even shards), then FSDP over dp (5 rows -> 3 + 2, 7 rows -> 4 + 3); the data-parallel
    # mesh dim of fc1.weight carries a _StridedShard
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    net = make_net(5, hidden=10)
    parallelize_module(net, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    shard(net, mesh["dp"])
    opt = torch.optim.AdamW(param_groups(net), lr=LR, betas=BETAS)
    assert isinstance(net.fc1.weight.placements[0], _StridedShard), net.fc1.weight.placements
    train(net, opt, 2, seed=6, rank=mesh["dp"].get_local_rank())  # same data across tp
    _check_geometry(net, opt, "FSDPxTP")
    # weight sync out of FSDP x TP into bf16 TP=2 rollout buffers on ranks 0 and 1
    live = rsfsdp.describe(net, "param")
    dst, bufs = tp_targets(live, [0, 1], dtype=torch.bfloat16)
    rs.Transfer(live.layout, dst, budget_bytes_per_peer=256)(live, bufs)
    check_targets(dst, bufs, full_params(net), "FSDPxTP -> TP2 bf16")
    return True


def test_dtensor_placements_and_2d_meshes(tmp_path):
    names, fsdp_2d = run_ranks(_placements_and_2d_worker, 4, tmp_path, env=ENV, timeout=400)[0]
    assert len(names) == 12 and fsdp_2d


# ------------------------------------------------------------------------ weight sync, restore


def _sync_restore_worker(rank, world, modes, budget):
    """Weight sync into TP=2 rollout buffers; snapshot -> restore -> the next step matches."""
    import torch
    from _dsutil import assert_bitwise, check_targets, tp_targets
    from _fsdputil import (
        batch,
        full_params,
        make_fsdp,
        poison_padding,
        reference,
        steps_of,
        train,
    )
    from torch.distributed.device_mesh import init_device_mesh

    import reshard as rs
    from reshard.errors import NotReadyError

    mesh = init_device_mesh("cpu", (world,))
    done = []
    for mode, dtype in modes:
        dt = getattr(torch, dtype) if dtype else None
        tag = f"{mode} {dtype} dp {world}"
        a, opt_a = make_fsdp(mesh, seed=0, mode=mode, dtype=dt)
        b, opt_b = make_fsdp(mesh, seed=7, mode=mode, dtype=dt)  # other init, other data
        for kind in MOMENTS:
            with pytest.raises(NotReadyError, match="no optimizer state yet"):
                _describe(a, opt_a, kind).check()
        train(a, opt_a, 2, seed=1, rank=rank, dtype=dt)
        train(b, opt_b, 2, seed=2, rank=rank, dtype=dt)
        npad = _check_geometry(a, opt_a, tag)

        # weight sync: FSDP2 params -> bf16 TP=2 rollout buffers on ranks 0 and 1 (poisoned)
        live = _describe(a, opt_a, "param")
        dst, bufs = tp_targets(live, [0, 1], dtype=torch.bfloat16)
        undo, intact, _ = poison_padding(a)
        try:
            rs.Transfer(live.layout, dst, budget_bytes_per_peer=budget)(live, bufs)
        finally:
            undo()
        check_targets(dst, bufs, full_params(a), f"{tag} weight sync")

        # snapshot A into TP shards over every rank (source dtype), restore into B
        want = {k: reference(a, opt_a, k) for k in KINDS}
        before = reference(b, opt_b, "param")
        assert any(not torch.equal(before[n], want["param"][n]) for n in before), tag
        undo, intact, _ = poison_padding(b)
        try:
            for kind in KINDS:
                src = _describe(a, opt_a, kind)
                snap, snap_bufs = tp_targets(src, list(range(world)))
                rs.Transfer(src.layout, snap, budget_bytes_per_peer=budget)(src, snap_bufs)
                dst = _describe(b, opt_b, kind)
                rs.Transfer(snap, dst.layout, budget_bytes_per_peer=budget)(snap_bufs, dst)
            assert intact(), f"{tag}: FSDP2 padding was written"
        finally:
            undo()
        assert steps_of(a, opt_a) == steps_of(b, opt_b)  # both stepped twice
        for kind in KINDS:
            got = reference(b, opt_b, kind)
            for n in want[kind]:
                assert_bitwise(got[n], want[kind][n], f"{tag} restored {kind} {n}")
        # the next step of B equals the uninterrupted A's, bitwise
        x = batch(100 + rank, dt)
        losses = []
        for net, opt in ((a, opt_a), (b, opt_b)):
            loss = net(x).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        assert_bitwise(losses[1], losses[0], f"{tag} step-3 loss")
        for kind in KINDS:
            ra, rb = reference(a, opt_a, kind), reference(b, opt_b, kind)
            for n in ra:
                assert_bitwise(rb[n], ra[n], f"{tag} after step 3 {kind} {n}")
        done.append((tag, npad))
    return done


@pytest.mark.parametrize("world", [2, 3])
def test_layouts_weight_sync_and_restore(world, tmp_path):
    modes = [("fp32", None), ("fp32", "bfloat16"), ("mp", None), ("offload", None)]
    modes.append(("offload_mp", None))
    if world == 3:
        modes = modes[1:4]
    out = run_ranks(_sync_restore_worker, world, tmp_path, args=(modes, 256), env=ENV, timeout=400)
    assert len(out[0]) == len(modes)
    assert sum(n for r in out for _, n in r) > 0  # padding existed and was poisoned


# --------------------------------------------------------------------------- elastic resize


def _resize_worker(rank, world, configs, budget):
    """dp=N -> dp=M of params and both moments inside one world; the resized run's next step
    equals a control at dp=M whose state torch itself scattered from A's full tensors."""
    import torch
    import torch.distributed as dist
    from _dsutil import assert_bitwise
    from _fsdputil import (
        batch,
        broadcast_layout,
        make_fsdp,
        poison_padding,
        reference,
        steps_of,
        torch_made_state,
        train,
    )
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import distribute_tensor

    import reshard as rs
    from reshard.integrations import fsdp as rsfsdp

    done = []
    for n_src, n_dst, mode, dtype, amsgrad in configs:
        dt = getattr(torch, dtype) if dtype else None
        tag = f"{mode} {dtype}{' amsgrad' if amsgrad else ''} dp {n_src} -> {n_dst}"
        # every rank builds both meshes (group creation is collective); rank 0 is in both
        mesh_a = DeviceMesh("cpu", list(range(n_src)))
        mesh_b = DeviceMesh("cpu", list(range(n_dst)))
        in_a, in_b = rank < n_src, rank < n_dst
        a = b = c = None
        # amsgrad: a third moment (max_exp_avg_sq) that the next step reads
        kinds = KINDS + (("max_exp_avg_sq",) if amsgrad else ())
        moments = kinds[1:]
        if in_a:
            a, opt_a = make_fsdp(mesh_a, seed=0, mode=mode, dtype=dt, amsgrad=amsgrad)
            train(a, opt_a, 2, seed=3, rank=rank, dtype=dt)
        if in_b:
            # fresh: never stepped; c: the control
            b, opt_b = make_fsdp(mesh_b, seed=9, mode=mode, dtype=dt, amsgrad=amsgrad)
            c, opt_c = make_fsdp(mesh_b, seed=9, mode=mode, dtype=dt, amsgrad=amsgrad)
        box = [None, None]
        if rank == 0:
            box = [{k: reference(a, opt_a, k) for k in kinds}, steps_of(a, opt_a)]
        # A's full tensors on every rank: the reference (a collective of A's mesh, then a copy)
        if in_a and rank != 0:
            for k in kinds:
                reference(a, opt_a, k)
        dist.broadcast_object_list(box, src=0)
        want, steps = box
        step = set(steps.values())
        assert len(step) == 1, steps
        step = step.pop()

        # B has no moments yet: make them (zeros, with A's step count), then poison everything
        if in_b:
            rsfsdp.init_adam_state(opt_b, step)
            with torch.no_grad():
                for p in b.parameters():
                    p._local_tensor.fill_(float("nan"))
                    for k in moments if p.requires_grad else ():
                        opt_b.state[p][k]._local_tensor.fill_(float("nan"))
            undo, intact, _ = poison_padding(b)
        for kind in kinds:
            src = _describe(a, opt_a, kind) if in_a else None
            dst = _describe(b, opt_b, kind) if in_b else None
            # ranks outside a mesh get that side's layout from rank 0 (it is in both)
            src_layout = broadcast_layout(src.layout if src else None)
            dst_layout = broadcast_layout(dst.layout if dst else None)
            sync = rs.Transfer(src_layout, dst_layout, budget_bytes_per_peer=budget)
            sync(src if in_a else {}, dst if in_b else {})
        if in_b:
            assert intact(), f"{tag}: FSDP2 padding was written"
            undo()
            for kind in kinds:
                got = reference(b, opt_b, kind)
                assert sorted(got) == sorted(want[kind])
                for n in got:
                    assert_bitwise(got[n], want[kind][n], f"{tag} resized {kind} {n}")

            # the control: torch's own state creation (a step with lr 0 and zero grads), then
            # A's full tensors scattered by distribute_tensor, A's step count
            torch_made_state(c, opt_c)
            with torch.no_grad():
                for n, p in c.named_parameters():
                    pairs = [(p, want["param"][n])]
                    if opt_c.state.get(p):
                        opt_c.state[p]["step"].fill_(step)
                        pairs += [(opt_c.state[p][k], want[k][n]) for k in moments]
                    for t, full in pairs:
                        t._local_tensor.copy_(
                            distribute_tensor(full.to(t.dtype), mesh_b, t.placements).to_local()
                        )
            # one step of B and of the control on the same data (per dp rank of M): bitwise
            x = batch(500 + rank, dt)
            losses = []
            for net, opt in ((b, opt_b), (c, opt_c)):
                loss = net(x).float().pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.detach())
            assert_bitwise(losses[0], losses[1], f"{tag} next loss")
            for kind in kinds:
                rb, rc = reference(b, opt_b, kind), reference(c, opt_c, kind)
                for n in rc:
                    assert_bitwise(rb[n], rc[n], f"{tag} after the next step {kind} {n}")
            assert steps_of(b, opt_b) == steps_of(c, opt_c)
        dist.barrier()
        done.append(tag)
    return done


def test_elastic_resize(tmp_path):
    configs = [(3, 2, "fp32", None, True), (2, 3, "fp32", "bfloat16", False)]
    configs.append((3, 2, "offload", None, False))
    out = run_ranks(_resize_worker, 3, tmp_path, args=(configs, 256), env=ENV, timeout=400)
    assert len(out[0]) == len(configs)


# ------------------------------------------------------------------------ readiness, errors


def _errors_worker(rank, world):
    import copy
    import gc

    import torch
    from _dsutil import replicated_targets
    from _fsdputil import BETAS, LR, batch, make_fsdp, make_net, param_groups, shard, train
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    import reshard as rs
    from reshard.errors import NotReadyError, PreflightError, UnsupportedError
    from reshard.integrations import fsdp as rsfsdp

    mesh = init_device_mesh("cpu", (world,))
    seen = []

    def expect(exc, match, fn, *args):
        with pytest.raises(exc, match=match):
            fn(*args)
        seen.append(match)

    def refused_everywhere(src, match):
        """A transfer from `src` is refused on every rank and writes no target."""
        dst, bufs = replicated_targets(src, list(range(world)))
        expect(PreflightError, match, rs.Transfer(src.layout, dst), src, bufs)
        assert all(bool(b.isnan().all()) for b in bufs.values())

    # not FSDP2 / bad arguments
    expect(UnsupportedError, "fully_shard", rsfsdp.describe, make_net(0), "param")
    partial = shard(make_net(0), mesh, root=False)  # the root's own params stay plain
    expect(UnsupportedError, "not managed by fully_shard", rsfsdp.describe, partial, "param")
    # ignored_params: fully_shard() was called on their owner, so say what FSDP2 did instead
    ignoring = make_net(0)
    fully_shard(ignoring, mesh=mesh, ignored_params={ignoring.scale})
    expect(UnsupportedError, r"\['scale'\] .*ignored_params", rsfsdp.describe, ignoring, "param")
    net, opt = make_fsdp(mesh)
    expect(ValueError, "kind must be one of", rsfsdp.describe, net, "grad")
    expect(ValueError, "needs the optimizer", rsfsdp.describe, net, "exp_avg")
    foreign = torch.optim.AdamW(make_net(1).parameters())
    train(net, opt, 1, seed=1, rank=rank)
    # a fault of the configuration every rank may not share (assign-loads on one rank): a
    # check() reason, so that the preflight refuses on every rank
    expect(
        NotReadyError, "none of this module's FSDP2", rsfsdp.describe(net, "exp_avg", foreign).check
    )
    sgd = torch.optim.SGD(param_groups(net), lr=LR, momentum=0.9)
    train(net, sgd, 1, seed=2, rank=rank)
    expect(UnsupportedError, "SGD keeps no 'exp_avg' state", rsfsdp.describe, net, "exp_avg", sgd)
    plain_sgd = torch.optim.SGD(param_groups(net), lr=LR)  # stepped, and still no state
    train(net, plain_sgd, 1, seed=3, rank=rank)
    expect(
        UnsupportedError, "SGD keeps no 'exp_avg' state", rsfsdp.describe, net, "exp_avg", plain_sgd
    )

    # between forward and backward the root's parameters are unsharded: describe refuses, a
    # state described before refuses in preflight on every rank
    live = rsfsdp.describe(net, "param")
    loss = net(batch(rank)).float().pow(2).mean()
    expect(NotReadyError, "not sharded", rsfsdp.describe(net, "param").check)
    expect(NotReadyError, "not sharded", live.check)
    refused_everywhere(live, "not sharded")
    loss.backward()
    opt.step()
    assert live.reasons() == []

    # reshard_after_forward=False keeps every group unsharded after a forward
    keep = shard(make_net(2), mesh, reshard_after_forward=False)
    with torch.no_grad():
        keep(batch(rank))
    expect(NotReadyError, r"fc1\.weight \(UNSHARDED\)", rsfsdp.describe(keep, "param").check)
    for m in keep.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
    assert rsfsdp.describe(keep, "param").reasons() == []

    # replaced storage: the optimizer's load_state_dict, the module's load_state_dict(assign)
    moments = rsfsdp.describe(net, "exp_avg", opt)
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    expect(NotReadyError, "replaced since describe", moments.check)
    # only rank 0 passes the stale state, the others a fresh one: every rank still refuses
    fresh = rsfsdp.describe(net, "exp_avg", opt)
    refused_everywhere(moments if rank == 0 else fresh, "replaced since describe")
    assert fresh.reasons() == []
    live = rsfsdp.describe(net, "param")
    state = {k: v.detach().clone() for k, v in net.state_dict().items()}
    net.load_state_dict(state)  # in place: the same storage
    assert live.reasons() == []
    net.load_state_dict(state, assign=True)  # new parameter objects
    expect(NotReadyError, "replaced since describe", live.check)

    # moments of a fresh optimizer: not ready until the first step or init_adam_state()
    net, _ = make_fsdp(mesh, seed=3)
    opt = torch.optim.AdamW(param_groups(net), lr=LR, betas=BETAS)
    early = rsfsdp.describe(net, "exp_avg_sq", opt)
    expect(NotReadyError, "no optimizer state yet", early.check)
    rsfsdp.init_adam_state(opt, 5)
    live = rsfsdp.describe(net, "exp_avg_sq", opt)
    assert all(float(s["step"]) == 5 for s in opt.state.values())
    assert all(bool((b == 0).all()) for b in live.buffers.values())
    expect(UnsupportedError, "Adam/AdamW", rsfsdp.init_adam_state, sgd, 1)

    # AdamW(model.parameters()) holds frozen parameters too: they never get moments, so they
    # are left out of the moments' layout instead of keeping it "not ready" for good
    net, _ = make_fsdp(mesh, seed=4)
    frozen = next(n for n, _ in net.named_parameters())
    net.get_parameter(frozen).requires_grad_(False)
    opt = torch.optim.AdamW(net.parameters(), lr=LR, betas=BETAS)
    train(net, opt, 2, 4, rank)
    live = rsfsdp.describe(net, "exp_avg", opt)
    trained = {n for n, p in net.named_parameters() if p.requires_grad}
    assert frozen not in trained and set(live.layout.tensors) == trained, sorted(
        live.layout.tensors
    )
    # a target built alike that never stepped: init_adam_state() gives state to what torch's
    # first step would (not the frozen one), so its moments' layout is the source's
    twin, _ = make_fsdp(mesh, seed=4)
    twin.get_parameter(frozen).requires_grad_(False)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=LR, betas=BETAS)
    rsfsdp.init_adam_state(twin_opt, 2)
    assert not twin_opt.state.get(twin.get_parameter(frozen))
    assert rsfsdp.describe(twin, "exp_avg", twin_opt).layout == live.layout
    # frozen after training: the optimizer keeps its moments, so they are described
    later = sorted(trained)[0]
    net.get_parameter(later).requires_grad_(False)
    live = rsfsdp.describe(net, "exp_avg", opt)
    assert set(live.layout.tensors) == trained, sorted(live.layout.tensors)
    _check_views(net, opt, live, "exp_avg")
    # a target frozen alike gets state for it when init_adam_state() is told to (params=)
    twin, _ = make_fsdp(mesh, seed=4)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=LR, betas=BETAS)
    for n in (frozen, later):
        twin.get_parameter(n).requires_grad_(False)
    rsfsdp.init_adam_state(twin_opt, 2)
    assert later not in rsfsdp.describe(twin, "exp_avg", twin_opt).layout.tensors
    rsfsdp.init_adam_state(twin_opt, 2, params=[twin.get_parameter(n) for n in trained])
    assert rsfsdp.describe(twin, "exp_avg", twin_opt).layout == live.layout
    expect(ValueError, "not held by the optimizer", rsfsdp.init_adam_state, opt, 1, [twin.fc1.bias])

    # the training loop makes a new optimizer: the described one is gone, not written instead
    opt = torch.optim.AdamW(net.parameters(), lr=LR, betas=BETAS)
    rsfsdp.init_adam_state(opt, 2)
    gc.collect()
    expect(NotReadyError, "no longer exists", live.check)
    _more_errors(rank, world, mesh, expect, refused_everywhere)
    return seen


def _more_errors(rank, world, mesh, expect, refused_everywhere):
    """Arguments refused with specific errors; an async unshard; a local tensor only one rank
    sees is wrong; moments of another dtype than their parameters; a submodule's moments."""
    import torch
    from _dsutil import assemble, assert_bitwise, check_targets, replicated_targets
    from _fsdputil import full_moments, make_fsdp, train
    from torch.distributed.tensor import Shard, distribute_tensor

    import reshard as rs
    from reshard.errors import NotReadyError
    from reshard.integrations import dtensor as rsdt
    from reshard.integrations import fsdp as rsfsdp

    net, opt = make_fsdp(mesh, seed=6)
    dt = distribute_tensor(torch.arange(24.0).view(6, 4), mesh, [Shard(0)])
    expect(TypeError, "names must be str", rsdt.describe, {1: dt, "a": dt})
    expect(TypeError, "group must be", rsdt.describe, {"a": dt}, "world")
    expect(TypeError, "group must be", rsfsdp.describe, net, "param", None, "world")
    expect(TypeError, "module must be a torch.nn.Module", rsfsdp.describe, None, "param")
    expect(ValueError, "kind must be one of", rsfsdp.describe, net, None)
    expect(TypeError, "optimizer must be a torch.optim", rsfsdp.describe, net, "exp_avg", "x")
    expect(TypeError, "step must be an integer", rsfsdp.init_adam_state, opt, "two")
    expect(ValueError, "step must be >= 0", rsfsdp.init_adam_state, opt, -1)
    expect(ValueError, "step must be an integer", rsfsdp.init_adam_state, opt, 2.5)
    assert not opt.state  # nothing was created by the refused calls
    train(net, opt, 1, seed=6, rank=rank)
    expect(NotReadyError, "amsgrad", rsfsdp.describe(net, "max_exp_avg_sq", opt).check)

    # unshard(async_op=True) not waited for: the parameters still say SHARDED while their
    # all-gather is in flight (the next forward copies out what it gathered)
    live = rsfsdp.describe(net, "param")
    handle = net.fc1.unshard(async_op=True)
    expect(NotReadyError, r"fc1 \(unshard\(async_op=True\)", rsfsdp.describe(net, "param").check)
    refused_everywhere(live, r"unshard\(async_op=True\)")
    handle.wait()
    expect(NotReadyError, r"fc1\.weight \(UNSHARDED\)", live.check)
    net.fc1.reshard()
    assert live.reasons() == []

    # a local tensor wrong on rank 0 only (not contiguous; another shape than its spec): every
    # rank describes, and every rank refuses the transfer (a rank-local raise would leave the
    # peer waiting in the transfer's collective)
    bad = {}
    for name, change in (("strided", lambda t: t.t().contiguous().t()), ("short", lambda t: t[:1])):
        bad[name] = distribute_tensor(torch.arange(24.0).view(6, 4), mesh, [Shard(0)])
        if rank == 0:
            bad[name]._local_tensor = change(bad[name]._local_tensor)
    live = rsdt.describe(bad)
    refused_everywhere(live, r"'strided': local tensor is not contiguous")
    refused_everywhere(live, r"'short': local tensor has shape \(1, 4\)")

    # moments kept in another dtype than their parameters (bf16 state of fp32 parameters):
    # storages in the moments' dtype, values exact
    for st in opt.state.values():
        st["exp_avg"] = st["exp_avg"].to(torch.bfloat16)
    live = rsfsdp.describe(net, "exp_avg", opt)
    assert {s.dtype for s in live.layout.storages.values()} == {torch.bfloat16}
    dst, bufs = replicated_targets(live, list(range(world)), dtype=torch.float32)
    rs.Transfer(live.layout, dst)(live, bufs)
    check_targets(dst, bufs, full_moments(net, opt, "exp_avg"), "bf16 moments")

    # a submodule's moments under the whole model's optimizer: named as in its own
    # named_parameters(), like its "param" kind
    live = rsfsdp.describe(net.fc1, "exp_avg_sq", opt)
    assert sorted(live.layout.tensors) == ["bias", "weight"]
    by_name = {n: opt.state[p]["exp_avg_sq"] for n, p in net.fc1.named_parameters()}
    assert live.layout == rsdt.describe(by_name).layout
    got, want = assemble(live.layout, live.buffers), full_moments(net.fc1, opt, "exp_avg_sq")
    for n in want:
        assert_bitwise(got[n], want[n], f"fc1 exp_avg_sq {n}")


def test_readiness_and_errors(tmp_path):
    seen = run_ranks(_errors_worker, 2, tmp_path, env=ENV, timeout=300)[0]
    assert len(seen) == 34, seen


def _changed_in_place_worker(rank, world):
    """After a passing sync, rank 0 alone changes live state in place (the same DTensor and
    local tensor objects, or a moment swapped in the optimizer's state): the next sync of the
    same Transfer is refused with the same PreflightError on every rank, naming rank 0, and
    writes nothing; undone, the state syncs again."""
    import torch
    from _dsutil import replicated_targets
    from _fsdputil import make_fsdp, train
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import reshard as rs
    from reshard.integrations import dtensor as rsdt

    mesh = init_device_mesh("cpu", (world,))
    net, opt = make_fsdp(mesh)
    train(net, opt, 1, seed=4, rank=rank)
    messages = []

    def refused(live, change, match, usable_after=True):
        dst, bufs = replicated_targets(live, list(range(world)))
        sync = rs.Transfer(live.layout, dst)
        sync(live, bufs)  # passes: the next call may take the short path
        for b in bufs.values():
            b.fill_(float("nan"))
        undo = change() if rank == 0 else None
        with pytest.raises(rs.PreflightError, match=match) as err:
            sync(live, bufs)
        assert sorted(err.value.failures) == [0], err.value.failures
        assert all(bool(b.isnan().all()) for b in bufs.values())
        messages.append(str(err.value))
        if undo is not None:
            undo()
        if usable_after:
            sync(live, bufs)
            assert not any(bool(b.isnan().any()) for b in bufs.values())

    def set_data(t, new):
        old = t.data
        t.data = new
        return lambda: setattr(t, "data", old)

    def set_attr(obj, name, new):
        old = getattr(obj, name)
        setattr(obj, name, new)
        return lambda: setattr(obj, name, old)

    def set_item(d, key, new):
        old = d[key]
        d[key] = new
        return lambda: d.__setitem__(key, old)

    weight = net.fc1.weight
    replaced = "replaced since describe"
    live = _describe(net, opt, "param")
    refused(live, lambda: set_data(weight._local_tensor, weight._local_tensor.clone()), replaced)
    refused(live, lambda: set_attr(weight, "_local_tensor", weight._local_tensor.clone()), replaced)
    moments = _describe(net, opt, "exp_avg")
    state = opt.state[weight]
    refused(
        moments,
        lambda: set_data(state["exp_avg"]._local_tensor, state["exp_avg"]._local_tensor.clone()),
        replaced,
    )
    refused(moments, lambda: set_item(state, "exp_avg", state["exp_avg"].clone()), replaced)
    dt = distribute_tensor(torch.arange(21.0).view(7, 3), mesh, [Shard(0)])
    plain = rsdt.describe({"w": dt})
    refused(plain, lambda: set_data(dt._local_tensor, dt._local_tensor.clone()), replaced)

    def free():
        weight._local_tensor.untyped_storage().resize_(0)

    # freed in place: the view's storage is gone (FSDP frees the storages it unshards into)
    refused(live, free, "storage is freed", usable_after=False)
    return messages


def test_state_changed_in_place_on_one_rank_is_refused_everywhere(tmp_path):
    res = run_ranks(_changed_in_place_worker, 2, tmp_path, env=ENV, timeout=300)
    assert len(res[0]) == 6
    assert res[0] == res[1]  # the same message, call by call, on every rank


def _rank_local_faults_worker(rank, world, only=None):
    """only: the tags of the faults to try (default: all; each is undone after its try)."""

    import torch
    from _dsutil import replicated_targets
    from _fsdputil import BETAS, LR, batch, make_fsdp, make_net, param_groups, shard, train
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, Replicate

    import reshard as rs
    from reshard.integrations import fsdp as rsfsdp

    mesh = init_device_mesh("cpu", (world,))
    out = []

    def fsdp_modules(net):
        return [m for m in net.modules() if isinstance(m, FSDPModule)]

    def snapshot(tensors):
        return [t.detach().clone() for t in tensors]

    def refused(tag, describe, match, into=False, live_tensors=list):
        """Every rank describes (rank 1 with its fault) and moves the state into poisoned
        replicated targets (into=False) or a replicated source into it (into=True); every
        rank must get the same PreflightError naming rank 1 only, well before the timeout,
        and no target changes (the poisoned buffers, or the live tensors `live_tensors()`)."""
        if only is not None and tag not in only:
            return
        made = {}

        def attempt():
            live = describe()
            rep, bufs = made["bufs"] = replicated_targets(live, list(range(world)))
            made["before"] = snapshot(live_tensors())
            if into:
                for b in bufs.values():
                    b.fill_(7.0)
                rs.Transfer(rep, live.layout, timeout=FAULT_TIMEOUT_S)(bufs, live)
            else:
                rs.Transfer(live.layout, rep, timeout=FAULT_TIMEOUT_S)(live, bufs)

        err = refused_by_rank_1(tag, rank, attempt, match)
        assert "fingerprint" not in str(err), (tag, str(err))  # every rank laid it out alike
        if into:
            after, before = live_tensors(), made["before"]
            assert len(after) == len(before), tag
            assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True)), tag
        else:
            assert all(bool(b.isnan().all()) for b in made["bufs"][1].values()), tag
        out.append((tag, str(err)))

    # 1. rank 1 stays unsharded after a forward with reshard_after_forward=False (rank 0
    #    resharded: reshard() is local, so the ranks may disagree)
    keep = shard(make_net(2), mesh, reshard_after_forward=False)
    with torch.no_grad():
        keep(batch(rank))
    if rank == 0:
        for m in fsdp_modules(keep):
            m.reshard()
    sharded = [fp.sharded_param._local_tensor for fp in rsfsdp._fsdp_params(keep)]
    describe = lambda: rsfsdp.describe(keep, "param")  # noqa: E731
    refused("unsharded param", describe, r"fc1\.weight \(UNSHARDED\)")

    def live_now():  # the sharded storage and what the module holds (rank 1: unsharded)
        return [*sharded, *(getattr(p, "_local_tensor", p) for p in keep.parameters())]

    refused("unsharded param target", describe, "not sharded", True, live_now)
    early = describe()
    if rank == 1:
        for m in fsdp_modules(keep):
            m.reshard()
    # described while rank 1 was unsharded: usable once it resharded
    assert early.reasons() == [], early.reasons()
    rep, bufs = replicated_targets(early, list(range(world)))
    rs.Transfer(early.layout, rep, timeout=FAULT_TIMEOUT_S)(early, bufs)
    assert not any(bool(b.isnan().any()) for b in bufs.values())

    # 2. an async unshard that rank 1 did not wait for (the all-gather ran on every rank)
    net, opt = make_fsdp(mesh, seed=5)
    train(net, opt, 1, seed=5, rank=rank)
    handle = net.fc1.unshard(async_op=True)
    if rank == 0:
        handle.wait()
        net.fc1.reshard()
    refused(
        "async unshard", lambda: rsfsdp.describe(net, "param"), r"fc1 \(unshard\(async_op=True\)"
    )
    if rank == 1:
        handle.wait()
        net.fc1.reshard()

    # 3. a parameter attribute rank 1 replaced with another DTensor (placed otherwise)
    weight = net.fc1.weight
    if rank == 1:
        full = DTensor.from_local(torch.zeros(weight.shape), mesh, [Replicate()], run_check=False)
        net.fc1.weight = torch.nn.Parameter(full)
    refused("replaced attribute", lambda: rsfsdp.describe(net, "param"), r"not FSDP2's sharded")
    net.fc1.weight = weight

    # 4. moments: rank 1's optimizer has not stepped (rank 0's did; Adam's step is local)
    fresh, _ = make_fsdp(mesh, seed=6)
    fresh_opt = torch.optim.AdamW(param_groups(fresh), lr=LR, betas=BETAS)
    fresh(batch(rank)).float().pow(2).mean().backward()
    if rank == 0:
        fresh_opt.step()
    fresh_opt.zero_grad()
    describe = lambda: rsfsdp.describe(fresh, "exp_avg", fresh_opt)  # noqa: E731
    refused("no state on rank 1", describe, "no optimizer state yet on this rank")
    moments = lambda: [s["exp_avg"]._local_tensor for s in fresh_opt.state.values()]  # noqa: E731
    refused("no state on rank 1, target", describe, "no optimizer state yet", True, moments)

    # 5. one moment placed otherwise than its parameter on rank 1 only
    state = opt.state[net.fc2.weight]
    saved = state["exp_avg_sq"]
    if rank == 1:
        local = torch.zeros(saved.shape)
        state["exp_avg_sq"] = DTensor.from_local(local, mesh, [Replicate()], run_check=False)
    describe = lambda: rsfsdp.describe(net, "exp_avg_sq", opt)  # noqa: E731
    refused("moment placed otherwise", describe, r"'fc2\.weight': exp_avg_sq is \(Replicate")
    state["exp_avg_sq"] = saved

    # 6. a moment missing on rank 1 only (its state dict lost the kind)
    if rank == 1:
        del state["exp_avg_sq"]
    refused("moment missing", describe, r"keeps no 'exp_avg_sq' state for it")
    state["exp_avg_sq"] = saved

    # 7. a local tensor whose storage rank 1 freed before describe()
    local = net.fc2.weight._local_tensor
    keep_vals, nbytes = local.clone(), local.untyped_storage().nbytes()
    if rank == 1:
        local.untyped_storage().resize_(0)
    refused("freed storage", lambda: rsfsdp.describe(net, "param"), "freed")
    if rank == 1:
        local.untyped_storage().resize_(nbytes)
        with torch.no_grad():
            local.copy_(keep_vals)

    # every fault undone: the same states move again
    for kind in ("param", "exp_avg", "exp_avg_sq"):
        live = _describe(net, opt, kind)
        assert live.reasons() == [], (kind, live.reasons())
        rep, bufs = replicated_targets(live, list(range(world)))
        rs.Transfer(live.layout, rep, timeout=FAULT_TIMEOUT_S)(live, bufs)
    return out


def test_faults_of_one_rank_are_refused_everywhere(tmp_path):
    """Rank 1 alone is unsharded, mid async unshard, has a replaced parameter attribute, an
    optimizer that has not stepped, a moment placed otherwise or missing, a freed storage:
    describe() raises on no rank, and every rank's transfer raises the same PreflightError
    naming rank 1, long before the timeout, writing nothing."""
    res = run_ranks(_rank_local_faults_worker, 2, tmp_path, env=ENV, timeout=240, group_timeout=30)
    assert len(res[0]) == 9, [t for t, _ in res[0]]
    assert res[0] == res[1]  # the same message, fault by fault, on every rank


def test_demo_fsdp_mode():
    """`python -m reshard.demo --mode fsdp`: a real FSDP2 + CPUOffloadPolicy model, verified
    bitwise in-process against DTensor.full_tensor()."""
    import os
    import subprocess

    cmd = [sys.executable, "-m", "reshard.demo", "--mode", "fsdp", "--layers", "1"]
    cmd += ["--hidden", "34", "--ffn", "50", "--vocab", "101", "--steps", "2", "--budget", "512"]
    env = dict(os.environ, **ENV)
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "OK:" in res.stdout and "bitwise equal" in res.stdout, res.stdout[-3000:]


def _one_rank_config_faults_worker(rank, world):
    """What used to raise in describe() on one rank alone: a plain tensor or a Partial
    placement where the peers hold a DTensor (rsdt), an optimizer holding none of the
    module's parameters, max_exp_avg_sq with amsgrad off (rsfsdp). Each rank plans against
    one target layout (a rollout's, the same everywhere); every rank must raise the same
    PreflightError naming rank 1, fast, writing nothing."""
    import re

    import torch
    from _dsutil import replicated_targets
    from _fsdputil import BETAS, LR, broadcast_layout, make_fsdp, param_groups, train
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    import reshard as rs
    from reshard.integrations import dtensor as rsdt
    from reshard.integrations import fsdp as rsfsdp

    mesh = init_device_mesh("cpu", (world,))
    out = []

    def refused(tag, describe, match, good):
        """`good()` describes the healthy state: its layout (rank 0's) is the target's."""
        target, bufs = replicated_targets(good(), list(range(world)))
        target = broadcast_layout(target)

        def attempt():
            live = describe()
            rs.Transfer(live.layout, target, timeout=FAULT_TIMEOUT_S)(live, bufs)

        err = refused_by_rank_1(tag, rank, attempt, re.escape(match))
        assert all(bool(b.isnan().all()) for b in bufs.values()), tag
        out.append((tag, str(err)))

    # rsdt: rank 1 holds the full tensor as a plain tensor, or a Partial DTensor
    full = torch.arange(42.0).view(7, 6)
    dt = distribute_tensor(full, mesh, [Shard(0)])
    other = distribute_tensor(torch.ones(3, 2), mesh, [Replicate()])
    good = lambda: rsdt.describe({"w": dt, "o": other})  # noqa: E731
    w = full.clone() if rank == 1 else dt
    refused("plain tensor", lambda: rsdt.describe({"w": w, "o": other}), "not a DTensor", good)
    part = DTensor.from_local(torch.ones(3, 2), mesh, [Partial()], run_check=False)
    o = part if rank == 1 else other
    refused("partial", lambda: rsdt.describe({"w": dt, "o": o}), "placement Partial", good)

    # rsfsdp: rank 1's optimizer holds none of the module's parameters (it was built for
    # another model there)
    net, opt = make_fsdp(mesh, seed=8, amsgrad=True)
    train(net, opt, 1, seed=8, rank=rank)
    twin, _ = make_fsdp(mesh, seed=8)
    foreign = torch.optim.AdamW(param_groups(twin), lr=LR, betas=BETAS)
    mine = foreign if rank == 1 else opt
    refused(
        "optimizer holds none",
        lambda: rsfsdp.describe(net, "exp_avg", mine),
        "holds none of this module's FSDP2 sharded parameters on this rank",
        lambda: rsfsdp.describe(net, "exp_avg", opt),
    )
    # rank 1's param groups turned amsgrad off (a load_state_dict of another config)
    if rank == 1:
        for g in opt.param_groups:
            g["amsgrad"] = False
    refused(
        "amsgrad off",
        lambda: rsfsdp.describe(net, "max_exp_avg_sq", opt),
        "keeps no 'max_exp_avg_sq' on this rank",
        lambda: rsfsdp.describe(net, "exp_avg_sq", opt),
    )
    for g in opt.param_groups:
        g["amsgrad"] = True

    # rank 1 lost one parameter's state, or keeps its moments in bf16: its layout differs, so
    # the plans do; its notes say how, by name (the preflight names only the fingerprints)
    for tag in ("state lost", "bf16 moments"):
        saved = {p: dict(st) for p, st in opt.state.items()}
        if rank == 1 and tag == "state lost":
            del opt.state[net.fc2.weight]
        elif rank == 1:
            for st in opt.state.values():
                st["exp_avg"] = st["exp_avg"].to(torch.bfloat16)
        live = rsfsdp.describe(net, "exp_avg", opt)
        target, bufs = replicated_targets(live, list(range(world)))  # each rank's own
        with pytest.raises(rs.PreflightError, match="fingerprint") as err:
            rs.Transfer(live.layout, target, timeout=FAULT_TIMEOUT_S)(live, bufs)
        assert sorted(err.value.failures) == [1], err.value.failures
        want = {"state lost": "left out", "bf16 moments": "in torch.bfloat16"}[tag]
        if rank == 1:
            assert any(want in n and "fc2.weight" in n for n in live.notes), live.notes
        else:
            assert live.notes == [], live.notes
        for p, st in saved.items():
            opt.state[p] = st
    # amsgrad in one param group only: the other group's parameters are not "left out" of
    # max_exp_avg_sq (they never keep one)
    opt.param_groups[1]["amsgrad"] = False
    live = rsfsdp.describe(net, "max_exp_avg_sq", opt)
    assert live.reasons() == [] and live.notes == [], (live.reasons(), live.notes)
    return out


def test_configuration_faults_of_one_rank_are_refused_everywhere(tmp_path):
    res = run_ranks(
        _one_rank_config_faults_worker, 2, tmp_path, env=ENV, timeout=240, group_timeout=30
    )
    assert [t for t, _ in res[0]] == [
        "plain tensor",
        "partial",
        "optimizer holds none",
        "amsgrad off",
    ]
    assert res[0] == res[1]


def _compiled_worker(rank, world):
    """torch.compile's wrapper (OptimizedModule) adds `_orig_mod` to named_parameters(): the
    names must stay the model's own (as torch.distributed.checkpoint keeps them), so that a
    rollout or DeepSpeed layout of the same model plans against them; values bitwise."""
    import torch
    from _dsutil import check_targets, replicated_targets
    from _fsdputil import full_moments, full_params, make_fsdp, train
    from torch.distributed.device_mesh import init_device_mesh

    import reshard as rs

    mesh = init_device_mesh("cpu", (world,))
    net, opt = make_fsdp(mesh, seed=9)
    net.fc2 = torch.compile(net.fc2, backend="aot_eager")  # a compiled submodule, too
    compiled = torch.compile(net, backend="aot_eager")
    train(compiled, opt, 2, seed=9, rank=rank)
    names = sorted(n.replace("_orig_mod.", "") for n, _ in compiled.named_parameters())
    for kind in ("param", "exp_avg"):
        live = _describe(compiled, opt, kind)
        plain = _describe(net, opt, kind)
        assert sorted(live.layout.tensors) == sorted(plain.layout.tensors), sorted(
            live.layout.tensors
        )
        assert live.layout == plain.layout
        if kind == "param":
            assert sorted(live.layout.tensors) == names
        dst, bufs = replicated_targets(live, list(range(world)))
        rs.Transfer(live.layout, dst)(live, bufs)
        ref = full_params(net) if kind == "param" else full_moments(net, opt, kind)
        ref = {n.replace("_orig_mod.", ""): t for n, t in ref.items()}
        check_targets(dst, bufs, ref, f"compiled {kind}")
        assert live.reasons() == []
    return sorted(live.layout.tensors)


def test_compiled_module_keeps_the_model_names(tmp_path):
    res = run_ranks(_compiled_worker, 2, tmp_path, env=ENV, timeout=240)
    assert "fc2.weight" in res[0] and not any("_orig_mod" in n for n in res[0]), res[0]


def _crossed_kinds_worker(rank, world):
    """Two Transfers of one plan (exp_avg and exp_avg_sq of a stepped AdamW have the same
    layouts) called in crossed order on the two ranks: each call pairs one rank's exp_avg
    with the other's exp_avg_sq. Both calls must be refused with the same PreflightError
    naming both kinds, writing nothing, instead of swapping the moments; then the calls in
    one order move the right moments. The same for dtensor.describe's `kind=`."""
    import torch
    from _dsutil import check_targets, replicated_targets
    from _fsdputil import full_moments, make_fsdp, train
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import reshard as rs
    from reshard.integrations import dtensor as rsdt

    mesh = init_device_mesh("cpu", (world,))
    net, opt = make_fsdp(mesh)
    train(net, opt, 2, seed=7, rank=rank)
    owners = list(range(world))
    out = {}

    def crossed(lives, want):
        kinds = list(lives)
        syncs, targets = {}, {}
        for k, live in lives.items():
            dst, bufs = replicated_targets(live, owners)
            syncs[k], targets[k] = rs.Transfer(live.layout, dst, timeout=FAULT_TIMEOUT_S), bufs
        assert len({s.plan.fingerprint for s in syncs.values()}) == 1  # one plan: paired
        refused = []
        for k in kinds if rank == 0 else kinds[::-1]:
            try:
                syncs[k](lives[k], targets[k])
                refused.append(("ok", ""))
            except rs.PreflightError as exc:
                refused.append(("PreflightError", str(exc)))
        untouched = all(bool(b.isnan().all()) for bs in targets.values() for b in bs.values())
        for k in kinds:  # in one order: the group is in step, each state lands where it belongs
            syncs[k](lives[k], targets[k])
            check_targets(syncs[k].plan.dst, targets[k], want[k], f"{k} after the refusal")
        return refused, untouched

    lives = {k: _describe(net, opt, k) for k in ("exp_avg", "exp_avg_sq")}
    assert {k: live.kind for k, live in lives.items()} == {k: k for k in lives}
    out["fsdp"] = crossed(lives, {k: full_moments(net, opt, k) for k in lives})
    assert _describe(net, opt, "param").kind == "param"

    vals = {k: torch.arange(21.0).view(7, 3) * (i + 1) for i, k in enumerate(("a", "b"))}
    dts = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in vals.items()}
    plain = {k: rsdt.describe({"w": dt}, kind=k) for k, dt in dts.items()}
    out["dtensor"] = crossed(plain, {k: {"w": v} for k, v in vals.items()})
    assert rsdt.describe({"w": dts["a"]}).kind is None
    with pytest.raises(TypeError, match="kind must be a str or None"):
        rsdt.describe({"w": dts["a"]}, kind=1)
    return out


def test_transfers_of_two_moments_in_crossed_order_are_refused(tmp_path):
    res = run_ranks(_crossed_kinds_worker, 2, tmp_path, env=ENV, timeout=300)
    for what, kinds in (("fsdp", ("exp_avg", "exp_avg_sq")), ("dtensor", ("a", "b"))):
        (calls0, untouched0), (calls1, untouched1) = res[0][what], res[1][what]
        for c0, c1 in zip(calls0, calls1, strict=True):
            assert c0[0] == c1[0] == "PreflightError" and c0[1] == c1[1], (what, c0, c1)
            assert all(repr(k) in c0[1] for k in kinds), (what, c0[1])
        assert untouched0 and untouched1, f"{what}: a refused call wrote its targets"


# ---------------------------------------------------------------- inputs given by mistake


def _mistaken_inputs_worker(rank, world):
    """A mesh that numbers its ranks out of order (torch's data follows the process group's
    order, the DTensor's coordinates the mesh's): refused, not read with the shards swapped;
    fully_shard on a module without parameters, or with all of them ignored: named for what
    it is; a group this rank is not a member of: said so."""
    import torch
    import torch.distributed as dist
    from _dsutil import replicated_targets
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    import reshard as rs
    from reshard.errors import NotReadyError, UnsupportedError
    from reshard.integrations import dtensor as rsdt
    from reshard.integrations import fsdp as rsfsdp

    seen = []

    def expect(exc, match, fn, *args, **kw):
        with pytest.raises(exc, match=match) as err:
            fn(*args, **kw)
        seen.append(str(err.value))

    flipped = DeviceMesh("cpu", [1, 0])  # every rank builds it (group creation is collective)
    dt = distribute_tensor(torch.arange(6.0), flipped, [Shard(0)])
    assert torch.equal(dt.full_tensor(), torch.arange(6.0))
    # torch holds the rows by group order, its coordinates say the other rank's
    assert dt.to_local().tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]][rank]
    assert flipped.get_coordinate() == [(1,), (0,)][rank]
    order = "device mesh \\[1, 0\\] does not number its ranks in increasing order"
    live = rsdt.describe({"w": dt})
    expect(NotReadyError, order, live.check)
    dst, bufs = replicated_targets(live, [0, 1])
    expect(rs.PreflightError, order, rs.Transfer(live.layout, dst), live, bufs)
    assert all(bool(b.isnan().all()) for b in bufs.values())
    lin = torch.nn.Linear(1, 6, bias=False)
    fully_shard(lin, mesh=flipped)
    expect(UnsupportedError, order, rsfsdp.describe, lin, "param")

    mesh = DeviceMesh("cpu", list(range(world)))
    empty = torch.nn.Sequential(torch.nn.ReLU())
    fully_shard(empty, mesh=mesh)
    expect(
        UnsupportedError,
        "fully_shard\\(\\) applied but no parameters",
        rsfsdp.describe,
        empty,
        "param",
    )
    ignoring = torch.nn.Linear(2, 2)
    fully_shard(ignoring, mesh=mesh, ignored_params=set(ignoring.parameters()))
    expect(
        UnsupportedError,
        "\\['weight', 'bias'\\] are not managed.*ignored_params",
        rsfsdp.describe,
        ignoring,
        "param",
    )

    only0 = dist.new_group([0])  # collective; rank 1 gets GroupMember.NON_GROUP_MEMBER
    net = torch.nn.Linear(2, 4)
    fully_shard(net, mesh=mesh)
    if rank == 1:
        expect(
            ValueError, "global rank 1 is not a member", rsfsdp.describe, net, "param", group=only0
        )
        expect(ValueError, "global rank 1 is not a member", rsdt.describe, {}, group=only0)
    else:
        expect(
            ValueError,
            "mesh rank 1 is not in the transfer group \\[0\\]",
            rsfsdp.describe,
            net,
            "param",
            group=only0,
        )
    return seen


def test_mistaken_inputs_are_named(tmp_path):
    res = run_ranks(_mistaken_inputs_worker, 2, tmp_path, env=ENV, timeout=240)
    assert res[0][:5] == res[1][:5]  # the same on every rank, where every rank takes part
