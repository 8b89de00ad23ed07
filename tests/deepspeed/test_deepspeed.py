"""reshard.integrations.deepspeed against real DeepSpeed engines on spawned gloo ranks.

DS_ACCELERATOR=cpu. Every configuration runs a real engine (torch AdamW, bf16, ZeRO 1/2/3,
optimizer offload none/cpu, dp 2 and 3); references are DeepSpeed's own
safe_get_full_fp32_param / safe_get_full_optimizer_state / GatheredParameters. Many
configurations share one spawn so the suite stays within a few minutes on 2 cores.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/_spawn.py
sys.path.insert(0, str(Path(__file__).resolve().parent))  # _dsutil.py

from _spawn import run_ranks

try:
    import deepspeed  # noqa: F401
except ImportError as exc:  # installed by `make test` (deps-deepspeed): missing is a broken setup
    raise ImportError(
        "tests/deepspeed needs DeepSpeed: run `make deps-deepspeed` (DS_BUILD_OPS=0)"
    ) from exc

# The timeout is above every run_ranks timeout here, so on a loaded machine the launcher's error
# (naming the ranks) fires, not pytest's.
pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("deepspeed_cpu_ops")]

ENV = {"DS_ACCELERATOR": "cpu", "RESHARD_TEST_THREADS": "1"}
MODELS = ("mlp", "block")
MOMENTS = ("exp_avg", "exp_avg_sq")
KINDS = ("param", "fp32", "exp_avg", "exp_avg_sq")


# --------------------------------------------------------------------------------- workers


def _owned_views(engine, kind):
    """DeepSpeed's own per-param tensors of `kind` on this rank (views into its storage)."""
    from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_optimizer_state

    stage = engine.zero_optimization_stage()
    out = []
    for name, p in engine.module.named_parameters():
        if kind == "param":
            out.append((name, p.ds_tensor if stage == 3 else p.data))
        elif not p.requires_grad:
            continue
        elif stage == 3:
            t = (
                safe_get_local_fp32_param(p)
                if kind == "fp32"
                else safe_get_local_optimizer_state(p, kind)
            )
            out.append((name, t))
        elif p._hp_mapping is not None:
            out.append((name, p._hp_mapping.get_hp_fragment(None if kind == "fp32" else kind)))
    return out


def _check_views_inside(engine, live, kind):
    spans = [
        (b.untyped_storage().data_ptr(), b.data_ptr(), b.data_ptr() + b.numel() * b.element_size())
        for b in live.buffers.values()
    ]
    for name, t in _owned_views(engine, kind):
        if t.numel() == 0:
            continue
        lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        assert any(
            t.untyped_storage().data_ptr() == s and b0 <= lo and hi <= b1 for s, b0, b1 in spans
        ), f"{kind} {name}: DeepSpeed's tensor is not inside any described buffer"


def _check_padding(engine, live, kind, me):
    """Storage elements the layout references on this rank are exactly the non-padding ones."""
    import torch

    stage = engine.zero_optimization_stage()
    world = len(live.dp_ranks)
    refs = {}
    for tl in live.layout.tensors.values():
        for pc in tl.pieces:
            if live.layout.storages[pc.location].rank != me:
                continue
            idx = torch.full(pc.shape, pc.offset, dtype=torch.int64)
            for k, (n, st) in enumerate(zip(pc.shape, pc.strides, strict=True)):
                view = [1] * len(pc.shape)
                view[k] = n
                idx = idx + (torch.arange(n) * st).view(view)
            refs.setdefault(pc.location, []).append(idx.view(-1))
    opt = engine.optimizer
    r = live.dp_ranks.index(me) if me in live.dp_ranks else None
    for u in range(len(opt.bit16_groups if stage <= 2 else opt.fp16_groups)):
        loc = u * world + r
        idx = torch.cat(refs.get(loc, [torch.zeros(0, dtype=torch.int64)]))
        numel = live.buffers[loc].numel()
        if kind == "param" and stage <= 2:
            # full replica of the flat; DeepSpeed's padding is the flat's tail
            expected = sum(p.numel() for p in opt.bit16_groups[u])
            counts = torch.bincount(idx, minlength=numel)
        elif stage <= 2:
            # DeepSpeed's own padding: the group tail, plus per-param alignment padding
            part = opt.partition_size[u]
            expected = part - opt.groups_padding[u]
            lo, hi = r * part, (r + 1) * part
            for q, off, pad in zip(
                opt.round_robin_bit16_groups[u],
                opt.round_robin_bit16_offsets[u],
                opt.round_robin_bit16_padding[u],
                strict=True,
            ):
                a0, a1 = off + q.numel(), off + q.numel() + pad
                expected -= max(0, min(a1, hi) - max(a0, lo))
            counts = torch.bincount(idx, minlength=numel)
        else:
            expected = 0
            for p in opt.fp16_groups[u]:
                pn = p.partition_numel()
                expected += max(0, min(pn, p.ds_numel - r * pn))
            counts = torch.bincount(idx, minlength=numel)
        if kind != "param" or stage == 3:
            # a partition storage: every element referenced at most once
            assert counts.numel() == 0 or int(counts.max()) <= 1, (
                f"{kind} unit {u}: element referenced twice"
            )
        assert int((counts > 0).sum()) == expected, (
            f"{kind} unit {u} rank {r}: {int((counts > 0).sum())} elements referenced, "
            f"{expected} are not padding"
        )


def _geometry_worker(rank, world, configs):
    import torch.distributed as dist
    from _dsutil import (
        assemble,
        assert_bitwise,
        ds_env,
        make_engine,
        reference,
        train,
    )

    ds_env(rank, world)
    from reshard.errors import NotReadyError
    from reshard.integrations import deepspeed as rsds

    done = []
    for stage, offload, model, *extra in configs:
        tag = f"stage {stage} offload {offload} {model} {extra} dp {world}"
        engine = make_engine(stage, offload, model, zero_extra=extra[0] if extra else None)
        names_all = [n for n, _ in engine.module.named_parameters()]
        names_tr = [n for n, p in engine.module.named_parameters() if p.requires_grad]
        for kind in MOMENTS:
            with pytest.raises(NotReadyError, match="first applied"):
                rsds.describe(engine, kind)
        train(engine, model, 2, seed=1, rank=rank)
        for kind in KINDS:
            live = rsds.describe(engine, kind)
            layouts = [None] * world
            dist.all_gather_object(layouts, live.layout)
            assert all(lay == live.layout for lay in layouts), f"{tag} {kind}: layouts differ"
            assert sorted(live.layout.tensors) == sorted(names_all if kind == "param" else names_tr)
            assert live.check() is None
            _check_views_inside(engine, live, kind)
            _check_padding(engine, live, kind, rank)
            got = assemble(live.layout, live.buffers)
            want = reference(engine, kind)
            assert sorted(got) == sorted(want)
            for n in want:
                assert_bitwise(got[n], want[n], f"{tag} {kind} {n}")
        done.append(tag)
        engine.destroy()
    return done


# ----------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("world", [2, 3])
def test_layouts_match_deepspeed_accessors(world, tmp_path):
    configs = [(s, o, m) for s in (1, 2, 3) for o in ("none", "cpu") for m in MODELS]
    # ZeRO-3 with params offloaded to CPU too (their shards live in pinned CPU flats)
    configs.append((3, "cpu", "block", {"offload_param": {"device": "cpu"}}))
    # ZeRO-1/2 per-param alignment padding inside the flat (16-byte starts)
    configs.append((2, "cpu", "block", {"parameter_alignment": True}))
    out = run_ranks(_geometry_worker, world, tmp_path, args=(configs,), env=ENV, timeout=400)
    assert len(out[0]) == len(configs)


# ------------------------------------------------------------------------ target layouts


def _me():
    import torch.distributed as dist

    return dist.get_rank()


def _poison_padding(live):
    """NaN into every storage element of this rank that no piece references (the padding);
    returns an undo. A transfer that read padding would carry NaN into a target."""
    import torch

    me = _me()
    saved = []
    for loc, buf in live.buffers.items():
        used = torch.zeros(buf.numel(), dtype=torch.bool)
        for tl in live.layout.tensors.values():
            for pc in tl.pieces:
                if pc.location != loc or live.layout.storages[loc].rank != me:
                    continue
                idx = torch.full(pc.shape, pc.offset, dtype=torch.int64)
                for k, (n, st) in enumerate(zip(pc.shape, pc.strides, strict=True)):
                    view = [1] * len(pc.shape)
                    view[k] = n
                    idx = idx + (torch.arange(n) * st).view(view)
                used[idx.view(-1)] = True
        pad = (~used).nonzero().view(-1)
        if pad.numel():
            saved.append((buf, pad, buf[pad].clone()))
            buf[pad] = float("nan")

    def undo():
        for b, idx, vals in saved:
            b[idx] = vals

    return undo, sum(p.numel() for _, p, _ in saved)


# --------------------------------------------------------------------------- transfer workers


def _transfer_worker(rank, world, configs, budget):
    import torch.distributed as dist
    from _dsutil import (
        check_targets,
        ds_env,
        make_engine,
        reference,
        replicated_targets,
        tp_targets,
        train,
    )

    ds_env(rank, world)
    import reshard as rs
    from reshard.integrations import deepspeed as rsds

    done = []
    pad_total = 0
    for stage, offload, model in configs:
        tag = f"stage {stage} offload {offload} {model} dp {world}"
        engine = make_engine(stage, offload, model)
        train(engine, model, 2, seed=3, rank=rank)
        for kind in KINDS:
            live = rsds.describe(engine, kind)
            want = reference(engine, kind)
            undo, npad = _poison_padding(live)
            pad_total += npad
            try:
                dst, bufs = replicated_targets(live, list(range(world)))
                report = rs.Transfer(live.layout, dst, budget_bytes_per_peer=budget)(live, bufs)
                if kind == "param" and stage <= 2:
                    # every rank holds the whole bit16 flat: all reads are local
                    assert report.total_bytes_sent == 0 and report.local_bytes > 0
                else:
                    assert report.rounds >= 1 and report.total_bytes_sent > 0
                n = check_targets(dst, bufs, want, f"{tag} {kind} snapshot")
                assert n == len(want)
                if kind == "param":
                    # weight sync into TP=2 rollout buffers on ranks 0 and 1
                    dst, bufs = tp_targets(live, [0, 1])
                    rs.Transfer(live.layout, dst, budget_bytes_per_peer=budget)(live, bufs)
                    check_targets(dst, bufs, want, f"{tag} weight sync")
            finally:
                undo()
        done.append(tag)
        engine.destroy()
    gathered = [None] * world
    dist.all_gather_object(gathered, pad_total)
    return done, sum(gathered)


def _snapshot(live, budget):
    """Engine state -> fp32/bf16 TP shards over every rank (a layout unlike ZeRO's)."""
    from _dsutil import tp_targets

    import reshard as rs

    dst, bufs = tp_targets(live, list(range(len(live.dp_ranks))))
    rs.Transfer(live.layout, dst, budget_bytes_per_peer=budget)(live, bufs)
    return dst, bufs


def _restore_worker(rank, world, configs, budget):
    import torch
    import torch.distributed as dist
    from _dsutil import (
        assert_restored_then_in_step,
        ds_env,
        make_engine,
        reference,
        train,
    )

    ds_env(rank, world)
    import reshard as rs
    from reshard.integrations import deepspeed as rsds

    done = []
    for i, (stage, offload, model) in enumerate(configs):
        tag = f"stage {stage} offload {offload} {model} dp {world}"
        a = make_engine(stage, offload, model, seed=0)
        b = make_engine(stage, offload, model, seed=5)  # other init, other data: diverged
        train(a, model, 2, seed=1, rank=rank)
        train(b, model, 2, seed=2, rank=rank)
        snaps = {k: _snapshot(rsds.describe(a, k), budget) for k in KINDS}
        want = {k: reference(a, k) for k in KINDS}
        before = reference(b, "fp32")
        assert any(not (before[n] == want["fp32"][n]).all() for n in before), (
            f"{tag}: B did not diverge"
        )
        # odd configs restore masters + moments and rebuild params from masters; even ones
        # write the "param" kind too
        kinds = KINDS if i % 2 == 0 else ("fp32", "exp_avg", "exp_avg_sq")
        for k in kinds:
            dst_live = rsds.describe(b, k)
            layout, bufs = snaps[k]
            rs.Transfer(layout, dst_live.layout, budget_bytes_per_peer=budget)(bufs, dst_live)
        if "param" in kinds:
            persistent = list(getattr(b.optimizer, "persistent_parameters", None) or [])
            if stage == 3 and persistent:
                # negative control: forward would still read the stale full copies
                pa = dict(a.module.named_parameters())
                nb = {id(q): n for n, q in b.module.named_parameters()}
                assert any(not torch.equal(q.data, pa[nb[id(q)]].data) for q in persistent), (
                    f"{tag}: persistent copies already equal before refresh_persistent()"
                )
            rsds.refresh_persistent(b)
        else:
            rsds.refresh_params(b)
        # B holds A's state, and its next step matches the uninterrupted A, bitwise
        assert_restored_then_in_step(a, b, want, model, rank, KINDS, tag)
        dist.barrier()
        done.append(tag)
        a.destroy()
        b.destroy()
    return done


def _sync_worker(rank, world):
    import torch
    from _dsutil import (
        batch,
        check_targets,
        ds_env,
        make_engine,
        reference,
        relink_moments,
        replicated_targets,
        tp_targets,
    )

    ds_env(rank, world)
    from reshard.integrations import deepspeed as rsds

    out = []
    for stage in (2, 3):
        engine = make_engine(stage, "cpu", "block")
        p_layout, p_bufs = tp_targets(rsds.describe(engine, "param"), [0, 1])
        m_layout, m_bufs = replicated_targets(rsds.describe(engine, "fp32"), [world - 1])
        sync = rsds.SyncAfterStep(
            engine,
            {"param": (p_layout, p_bufs), "fp32": (m_layout, lambda bufs=m_bufs: bufs)},
            every=2,
        )
        for s in range(5):
            x = batch(engine, "block", 50 + s * 10 + rank)
            loss = engine(x).float().pow(2).mean()
            engine.backward(loss)
            sync.step()
            if s == 3:  # the 4th applied step synced: targets hold this state
                check_targets(p_layout, p_bufs, reference(engine, "param"), "sync param")
                check_targets(m_layout, m_bufs, reference(engine, "fp32"), "sync fp32")
                snap = {k: v.clone() for k, v in p_bufs.items()}
        assert sync.applied_steps == 5 and sync.syncs == 2, (sync.applied_steps, sync.syncs)
        # step 5 did not sync (every=2): targets still hold step 4's params
        for k, v in p_bufs.items():
            assert torch.equal(v, snap[k])
        rep = sync.reports["param"]
        # ZeRO-2 reads every param locally (full bit16 flat on each rank); ZeRO-3 sends
        assert rep.seconds["total"] > 0 and rep.local_bytes + rep.total_bytes_received > 0
        out.append((stage, rep.total_bytes_sent, rep.local_bytes))
        engine.destroy()

    # gradient accumulation 2: only boundary steps count and sync; moments after a skip-free
    # first boundary (lazily described by the hook)
    engine = make_engine(1, "none", "mlp", config_extra={"gradient_accumulation_steps": 2})
    live = rsds.describe(engine, "param")
    e_layout, e_bufs = replicated_targets(live, list(range(world)), dtype=torch.float32)
    sync = rsds.SyncAfterStep(engine, {"exp_avg": (e_layout, e_bufs)}, every=1)
    for s in range(6):
        x = batch(engine, "mlp", 70 + s * 10 + rank)
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        sync.step()
        assert sync.syncs == (s + 1) // 2, (s, sync.syncs)
    relink_moments(engine)
    check_targets(e_layout, e_bufs, reference(engine, "exp_avg"), "sync exp_avg gas 2")
    engine.destroy()
    return out


# ------------------------------------------------------------------------------- errors


def _errors_worker(rank, world, tmp):
    import torch.distributed as dist
    from _dsutil import (
        assemble,
        assert_bitwise,
        ds_env,
        make_engine,
        reference,
        replicated_targets,
        train,
    )

    ds_env(rank, world)
    import reshard as rs
    from reshard.errors import NotReadyError, PreflightError, UnsupportedError
    from reshard.integrations import deepspeed as rsds

    seen = []

    def expect(exc, match, fn, *args):
        with pytest.raises(exc, match=match):
            fn(*args)
        seen.append(match)

    # not an engine / bad kind
    expect(UnsupportedError, "DeepSpeedEngine", rsds.describe, object(), "fp32")
    # ZeRO stage 0 (DeepSpeed's BF16_Optimizer)
    e0 = make_engine(0, "none")
    expect(UnsupportedError, "zero_optimization.stage", rsds.describe, e0, "fp32")
    e0.destroy()
    # round-robin gradients: a real engine
    rr = make_engine(2, "none", zero_extra={"round_robin_gradients": True})
    expect(UnsupportedError, "zero_optimization.round_robin_gradients", rsds.describe, rr, "param")
    rr.destroy()
    # ZeRO++ hpZ: a real engine
    hz = make_engine(3, "none", zero_extra={"zero_hpz_partition_size": 2})
    expect(UnsupportedError, "zero_optimization.zero_hpz_partition_size", rsds.describe, hz, "fp32")
    hz.destroy()

    # an optimizer without Adam moments
    sgd = make_engine(
        1, "none", optimizer="sgd", config_extra={"zero_allow_untested_optimizer": True}
    )
    train(sgd, "mlp", 1, seed=1, rank=rank)
    expect(UnsupportedError, "SGD keeps no 'exp_avg' state", rsds.describe, sgd, "exp_avg")
    sgd.destroy()

    engine = make_engine(3, "cpu")
    expect(ValueError, "kind must be one of", rsds.describe, engine, "grad")
    # Moments before the first step.
    expect(NotReadyError, "first applied", rsds.describe, engine, "exp_avg_sq")
    train(engine, "mlp", 1, seed=1, rank=rank)
    # NVMe, partial offload, SuperOffload, ZenFlow cannot be built on this CPU-only machine
    # (they need the async-io / DeepSpeedCPUAdam ops): flip the config field on a real engine.
    zc = engine._config.zero_config
    cases = [
        (zc.offload_optimizer, "device", "nvme", "zero_optimization.offload_optimizer.device"),
        (zc.offload_optimizer, "ratio", 0.5, "zero_optimization.offload_optimizer.ratio"),
        (zc.offload_optimizer, "super_offload", True, "offload_optimizer.super_offload"),
        (zc, "zero_quantized_weights", True, "zero_optimization.zero_quantized_weights"),
        (zc, "zenflow", {"topk_ratio": 0.1}, "zero_optimization.zenflow"),
    ]
    for obj, attr, value, key in cases:
        old = getattr(obj, attr)
        object.__setattr__(obj, attr, value)
        try:
            expect(UnsupportedError, key.replace(".", r"\."), rsds.describe, engine, "fp32")
        finally:
            object.__setattr__(obj, attr, old)
    if zc.offload_param is None:
        from deepspeed.runtime.zero.offload_config import DeepSpeedZeroOffloadParamConfig

        object.__setattr__(zc, "offload_param", DeepSpeedZeroOffloadParamConfig(device="nvme"))
        try:
            expect(UnsupportedError, r"offload_param\.device", rsds.describe, engine, "param")
        finally:
            object.__setattr__(zc, "offload_param", None)

    # Storage replaced by load_checkpoint: check() raises; preflight refuses on every rank.
    lives = {k: rsds.describe(engine, k) for k in KINDS}
    engine.save_checkpoint(tmp, tag="t")
    engine.load_checkpoint(tmp, tag="t")
    stale = [k for k, lv in lives.items() if lv.reasons()]
    assert set(MOMENTS) <= set(stale), stale
    expect(NotReadyError, "replaced since describe", lives["exp_avg"].check)
    dst, bufs = replicated_targets(lives["exp_avg"], list(range(world)))
    # only rank 0 passes the stale state; the others pass fresh ones: all ranks still refuse
    src = lives["exp_avg"] if rank == 0 else rsds.describe(engine, "exp_avg")
    before = {k: v.clone() for k, v in bufs.items()}
    expect(PreflightError, "replaced since describe", rs.Transfer(src.layout, dst), src, bufs)
    for k, v in bufs.items():
        assert v.isnan().all() and before[k].isnan().all()  # untouched
    fresh = rsds.describe(engine, "exp_avg")
    assert fresh.reasons() == []
    got, want = assemble(fresh.layout, fresh.buffers), reference(engine, "exp_avg")
    for n in want:
        assert_bitwise(got[n], want[n], f"after load_checkpoint {n}")
    engine.destroy()

    # Mid gradient accumulation, and offload_states (ZeRO-1: DeepSpeed's ZeRO-3 offload_states
    # fails on the CPU accelerator).
    ga = make_engine(1, "none", config_extra={"gradient_accumulation_steps": 2})
    train(ga, "mlp", 2, seed=1, rank=rank)  # two micro steps: one applied step
    live = rsds.describe(ga, "fp32")
    assert live.reasons() == []
    from _dsutil import batch

    loss = ga(batch(ga, "mlp", 9)).float().pow(2).mean()
    ga.backward(loss)
    ga.step()  # not a boundary
    expect(NotReadyError, "mid gradient accumulation", live.check)
    loss = ga(batch(ga, "mlp", 10)).float().pow(2).mean()
    ga.backward(loss)
    ga.step()
    assert live.reasons() == []
    ga.offload_states()
    expect(NotReadyError, r"offloaded \(offload_states", live.check)
    expect(NotReadyError, r"offloaded \(offload_states", rsds.describe, ga, "param")
    ga.reload_states()
    expect(NotReadyError, "replaced since describe", live_param_check(rsds, ga))
    ga.destroy()
    dist.barrier()
    return seen


def live_param_check(rsds, engine):
    """describe "param", then replace the storage the way offload/reload does."""
    live = rsds.describe(engine, "param")
    engine.offload_states()
    engine.reload_states()
    return live.check


def _lifecycle_worker(rank, world, configs):
    """Per (stage, offload): a stateless optimizer's moments, a training forward after the
    boundary, and a destroyed engine each get the error that names the real cause."""
    import torch
    from _dsutil import batch, ds_env, make_engine, replicated_targets, train

    ds_env(rank, world)
    import reshard as rs
    from reshard.errors import NotReadyError, PreflightError, UnsupportedError
    from reshard.integrations import deepspeed as rsds

    done = []
    for stage, offload in configs:
        tag = f"stage {stage} offload {offload}"
        # plain SGD keeps no per-parameter state: not ready before its first step, unsupported
        # (naming the optimizer) once steps have run
        sgd = make_engine(
            stage, offload, optimizer="sgd0", config_extra={"zero_allow_untested_optimizer": True}
        )
        with pytest.raises(NotReadyError, match="first applied"):
            rsds.describe(sgd, "exp_avg")
        train(sgd, "mlp", 2, seed=1, rank=rank)
        for kind in MOMENTS:
            with pytest.raises(UnsupportedError, match=f"SGD keeps no '{kind}' state"):
                rsds.describe(sgd, kind)
        sgd.destroy()

        engine = make_engine(stage, offload)
        train(engine, "mlp", 1, seed=1, rank=rank)
        lives = {k: rsds.describe(engine, k) for k in KINDS}
        assert all(lv.reasons() == [] for lv in lives.values()), tag
        _check_storage_sizes(engine, lives)
        with torch.no_grad():  # an inference forward (rollout log-probs) is allowed
            engine(batch(engine, "mlp", 5))
        assert all(lv.reasons() == [] for lv in lives.values()), tag
        # forward + backward after the boundary, no step(): every kind refuses, and so does a
        # transfer, on every rank, writing nothing
        loss = engine(batch(engine, "mlp", 6 + rank)).float().pow(2).mean()
        engine.backward(loss)
        for lv in lives.values():
            with pytest.raises(NotReadyError, match="forward with autograd enabled ran after"):
                lv.check()
        dst, bufs = replicated_targets(lives["fp32"], list(range(world)))
        with pytest.raises(PreflightError, match="forward with autograd enabled ran after"):
            rs.Transfer(lives["fp32"].layout, dst)(lives["fp32"], bufs)
        assert all(v.isnan().all() for v in bufs.values()), f"{tag}: a refused transfer wrote"
        engine.step()  # the boundary again: ready
        assert all(lv.reasons() == [] for lv in lives.values()), tag
        # a forward alone (grad enabled) already ends the safe boundary
        engine(batch(engine, "mlp", 8))
        assert lives["param"].reasons(), tag
        # destroyed: describe() and check() say so (not "unexpected DeepSpeed layout")
        engine.destroy()
        for k in KINDS:
            with pytest.raises(NotReadyError, match="engine was destroyed"):
                rsds.describe(engine, k)
            with pytest.raises(NotReadyError, match="engine was destroyed"):
                lives[k].check()
        done.append(tag)
    return done


def _check_storage_sizes(engine, lives):
    """The family's storage size is the one the layout and the cross-check use, and a storage
    of another size is refused with that expected size (ZeRO-1/2 "param": the whole flat)."""
    from reshard.errors import UnsupportedError
    from reshard.integrations.deepspeed_live import geometry_of

    geo = geometry_of(engine)
    assert type(geo).__name__ == (
        "Zero3Geometry" if engine.zero_optimization_stage() == 3 else "Zero12Geometry"
    )
    for kind, live in lives.items():
        for u in range(len(geo.units)):
            loc = geo.location(u, geo.dp_rank)
            numel = live.buffers[loc].numel()
            assert live.layout.storages[loc].numel == geo.storage_numel(kind, u) == numel
            with pytest.raises(
                UnsupportedError, match=rf"live storage has {numel - 1} elements, expected {numel} "
            ):
                geo.cross_check(kind, u, live.buffers[loc][1:])


def _skipped_step_worker(rank, world, configs):
    """SyncAfterStep counts only applied steps: an overflow that DeepSpeed skips (bf16 with
    check_grad_overflow, DeepSpeed's default; the CPU accelerator refuses fp16) neither counts
    nor syncs. every=2, steps: skip, ok, ok (sync), skip, ok, ok (sync)."""
    from _dsutil import (
        batch,
        check_targets,
        ds_env,
        make_engine,
        reference,
        relink_moments,
        replicated_targets,
        tp_targets,
    )

    ds_env(rank, world)
    from reshard.errors import NotReadyError
    from reshard.integrations import deepspeed as rsds

    done = []
    for stage, offload in configs:
        tag = f"stage {stage} offload {offload}"
        engine = make_engine(stage, offload)
        p_layout, p_bufs = tp_targets(rsds.describe(engine, "param"), [0, 1])
        e_layout, e_bufs = replicated_targets(rsds.describe(engine, "fp32"), [0])
        sync = rsds.SyncAfterStep(
            engine, {"param": (p_layout, p_bufs), "exp_avg": (e_layout, e_bufs)}, every=2
        )
        for s, overflow in enumerate((True, False, False, True, False, False)):
            loss = engine(batch(engine, "mlp", 90 + s * 10 + rank)).float().pow(2).mean()
            if overflow and rank == 0:  # one rank's inf reaches every rank's gradients
                loss = loss * float("inf")
            engine.backward(loss)
            sync.step()
            assert engine.was_step_applied() != overflow, f"{tag} step {s}: no real skip"
            if s == 0:  # a skipped step creates no moments: nothing could have synced them
                with pytest.raises(NotReadyError, match="first applied"):
                    rsds.describe(engine, "exp_avg")
            if s in (2, 5):
                relink_moments(engine)
                check_targets(p_layout, p_bufs, reference(engine, "param"), f"{tag} {s} param")
                check_targets(e_layout, e_bufs, reference(engine, "exp_avg"), f"{tag} {s} m")
        assert engine.skipped_steps == 2, (tag, engine.skipped_steps)
        assert (sync.applied_steps, sync.syncs) == (4, 2), (tag, sync.applied_steps, sync.syncs)
        done.append(tag)
        engine.destroy()
    return done


# ----------------------------------------------------------------------------------- tests 2


@pytest.mark.parametrize("world", [2, 3])
def test_transfer_snapshot_and_weight_sync(world, tmp_path):
    configs = [(s, o, m) for s in (1, 2, 3) for o in ("none", "cpu") for m in MODELS]
    done, padding = run_ranks(
        _transfer_worker, world, tmp_path, args=(configs, 96), env=ENV, timeout=400
    )[0]
    assert len(done) == len(configs)
    assert padding > 0  # padding existed, was poisoned, and no NaN reached a target


@pytest.mark.parametrize("world", [2, 3])
def test_restore_then_step_matches_control(world, tmp_path):
    # Even indices write all four kinds, odd ones masters + moments then refresh_params().
    # dp 2: every combination (the MLP, all params ZeRO-3-persistent, takes the "param" path);
    # dp 3: six of them, ordered so ZeRO-3's persistent MLP takes the refresh_params() path.
    if world == 2:
        configs = [(s, o, m) for s in (1, 2, 3) for o in ("none", "cpu") for m in MODELS]
    else:
        configs = [(1, "cpu", "mlp"), (1, "none", "block"), (2, "cpu", "block")]
        configs += [(2, "none", "mlp"), (3, "cpu", "block"), (3, "none", "mlp")]
    done = run_ranks(
        _restore_worker, world, tmp_path, args=(configs, 1 << 12), env=ENV, timeout=400
    )[0]
    assert len(done) == len(configs)


def test_sync_after_step_hook(tmp_path):
    out = run_ranks(_sync_worker, 2, tmp_path, env=ENV, timeout=300)
    assert [o[0] for o in out[0]] == [2, 3]
    sent = {stage: sum(o[i][1] for o in out) for i, stage in enumerate((2, 3))}
    assert sent[2] == 0 and sent[3] > 0, sent  # ZeRO-2: all reads local; ZeRO-3 sends


def test_errors(tmp_path):
    seen = run_ranks(
        _errors_worker, 2, tmp_path, args=(str(tmp_path / "ckpt"),), env=ENV, timeout=300
    )[0]
    assert len(seen) >= 15


def _edges_worker(rank, world):
    """Engines at the edges of what describe() reads (each from a user's report):
    - ZeRO-3 after a forward under no_grad, which leaves the params it gathered gathered:
      params written from another engine plus refresh_persistent() reach the next forward;
    - ZeRO-1 without gradient hooks (contiguous_gradients off) where this rank's fp32
      partition is all padding: not taken for a destroyed engine on that rank alone;
    - a training forward through a submodule, not the root: seen, like one through the root;
    - a parameter added to engine.module after deepspeed.initialize: UnsupportedError."""
    import torch
    from _dsutil import batch, ds_env, make_engine, replicated_targets, train

    ds_env(rank, world)
    import deepspeed

    import reshard as rs
    from reshard.errors import UnsupportedError
    from reshard.integrations import deepspeed as rsds

    errs = []
    zx = {"stage3_param_persistence_threshold": 0}
    src = make_engine(3, "none", "block", seed=0, zero_extra=zx)
    dst = make_engine(3, "none", "block", seed=5, zero_extra=zx)
    train(src, "block", 2, 1, rank)
    train(dst, "block", 2, 2, rank)
    with torch.no_grad():  # rollout log-probs on the trainer
        dst(batch(dst, "block", 7))
    s, d = rsds.describe(src, "param"), rsds.describe(dst, "param")
    rs.Transfer(s.layout, d.layout)(s, d)
    rsds.refresh_persistent(dst)
    with torch.no_grad():
        x = batch(src, "block", 11)
        want, got = src(x).float().pow(2).mean(), dst(x).float().pow(2).mean()
    if not torch.equal(want, got):
        errs.append(f"after a no_grad forward: next loss {got.item()} != source's {want.item()}")
    src.destroy()
    dst.destroy()

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.backbone = torch.nn.Linear(7, 2)
            self.backbone.requires_grad_(False)
            self.scale = torch.nn.Parameter(torch.ones(2))  # all rank 0's: rank 1 holds padding

        def forward(self, x):
            return self.backbone(x) * self.scale

    torch.manual_seed(0)
    net = Net()
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10**9,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 1, "contiguous_gradients": False},
    }
    opt = torch.optim.AdamW([net.scale], lr=1e-2)
    engine, *_ = deepspeed.initialize(model=net, optimizer=opt, config=cfg)
    engine.backward(engine(torch.randn(2, 7).bfloat16()).float().pow(2).mean())
    engine.step()
    live = rsds.describe(engine, "fp32")  # raised "destroyed" on rank 1 alone
    layout, bufs = replicated_targets(live, list(range(world)))
    rs.Transfer(live.layout, layout)(live, bufs)
    engine.destroy()

    # a training forward that enters below the root module (a value head's trunk)
    e2 = make_engine(2, "none", "mlp", seed=2)
    train(e2, "mlp", 1, 3, rank)
    live = rsds.describe(e2, "param")
    assert live.reasons() == []
    e2.module.fc1(batch(e2, "mlp", 5)).float().sum()
    if not any("a forward with autograd enabled" in r for r in live.reasons()):
        errs.append(f"a forward through a submodule was not seen: {live.reasons()}")
    e2.destroy()

    e3 = make_engine(3, "none", "block", seed=1)
    e3.module.value_head = torch.nn.Linear(12, 1).to(torch.bfloat16)
    for kind in ("param", "fp32"):
        try:
            rsds.describe(e3, kind)
            errs.append(f"{kind}: a param added after initialize was described")
        except UnsupportedError as exc:
            if "'value_head.weight'" not in str(exc):
                errs.append(f"{kind}: {exc}")
    e3.destroy()
    return errs


def test_engines_at_the_edges(tmp_path):
    for errs in run_ranks(_edges_worker, 2, tmp_path, env=ENV, timeout=400):
        assert errs == []


def test_demo_deepspeed_mode():
    """`make demo`'s default: a real ZeRO-3 + CPU-offload engine, verified bitwise in-process."""
    import subprocess

    cmd = [sys.executable, "-m", "reshard.demo", "--mode", "deepspeed", "--layers", "1"]
    cmd += ["--hidden", "34", "--ffn", "50", "--vocab", "101", "--steps", "2", "--budget", "512"]
    env = dict(os.environ, **ENV)
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=500, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "OK:" in res.stdout and "bitwise equal" in res.stdout, res.stdout[-3000:]


def test_lifecycle_errors_name_the_cause(tmp_path):
    from _dsutil import STAGES_OFFLOAD

    done = run_ranks(_lifecycle_worker, 2, tmp_path, args=(STAGES_OFFLOAD,), env=ENV, timeout=400)[
        0
    ]
    assert len(done) == len(STAGES_OFFLOAD)


def test_sync_after_step_ignores_skipped_steps(tmp_path):
    from _dsutil import STAGES_OFFLOAD

    done = run_ranks(
        _skipped_step_worker, 2, tmp_path, args=(STAGES_OFFLOAD,), env=ENV, timeout=400
    )[0]
    assert len(done) == len(STAGES_OFFLOAD)


def _shm_segment_worker(rank, world, doomed):
    """Build an engine; report this rank's DeepSpeed allreduce segment; `doomed` dies here."""
    from _dsutil import ds_env, make_engine

    from reshard._launch import SHM_DIR, deepspeed_shm_prefix

    ds_env(rank, world)
    make_engine(1, "none")
    path = os.path.join(SHM_DIR, f"{deepspeed_shm_prefix(os.getppid())}{rank}")
    exists = os.path.exists(path)
    if rank == doomed:
        from _spawn import die

        die()
    return path, exists


def test_deepspeed_shm_segments_are_removed_after_every_run(tmp_path):
    """DeepSpeed's CPU allreduce leaves a 69 MB /dev/shm segment per rank that it never unlinks;
    hundreds of test runs filled a 24 GiB machine's memory. Each run's segments are named after
    its launcher and removed when its ranks end, a killed rank's too."""
    from reshard._launch import SHM_DIR, deepspeed_shm_prefix

    if not os.path.isdir(SHM_DIR):
        pytest.skip(f"no {SHM_DIR} on this machine: DeepSpeed's CPU allreduce makes no segments")
    prefix = deepspeed_shm_prefix(os.getpid())
    for doomed in (None, 1):
        out = run_ranks(
            _shm_segment_worker,
            2,
            tmp_path,
            args=(doomed,),
            env=ENV,
            timeout=400,
            expect_killed=() if doomed is None else (doomed,),
        )
        for rank, rec in enumerate(out):
            if rec is not None:
                path, existed = rec
                assert path.startswith(os.path.join(SHM_DIR, prefix)), path
                assert existed, f"rank {rank}: DeepSpeed made no segment at {path}"
        left = [n for n in os.listdir(SHM_DIR) if n.startswith(prefix)]
        assert not left, f"segments left after the run (killed rank {doomed}): {left}"
