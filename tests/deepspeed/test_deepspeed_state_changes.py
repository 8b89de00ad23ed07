"""DeepSpeed state changed under a described LiveState, on spawned gloo ranks with real engines.

- a parameter replaced on engine.module (a new Parameter object, or param.data / ds_tensor
  moved off DeepSpeed's flat): a stale LiveState is refused by preflight on every rank and
  writes nothing; SyncAfterStep describes again and moves the new parameter's data;
- a failure on one rank inside SyncAfterStep.sync() (the target-buffers callable, describing
  again) makes every rank raise the same PreflightError at once, instead of that rank raising
  alone while its peers wait in the exchange;
- describe() while the states are offloaded (engine.offload_states()) is NotReadyError saying
  to reload them, not a misleading UnsupportedError from the cross-check.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/_spawn.py
sys.path.insert(0, str(Path(__file__).resolve().parent))  # _dsutil.py

from _spawn import run_ranks

pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("deepspeed_cpu_ops")]

ENV = {"DS_ACCELERATOR": "cpu", "RESHARD_TEST_THREADS": "1"}
KINDS = ("param", "fp32", "exp_avg", "exp_avg_sq")
FROZEN = "layer.norm2.weight"  # the "block" model's frozen LayerNorm weight


def _poison(bufs):
    for v in bufs.values():
        v.fill_(float("nan"))


def _refused_everywhere(transfer, src, bufs, match):
    """The transfer raises PreflightError matching `match` and leaves the targets poisoned."""
    from reshard.errors import PreflightError

    _poison(bufs)
    with pytest.raises(PreflightError, match=match) as info:
        transfer(src, bufs)
    assert all(v.isnan().all() for v in bufs.values()), "a refused transfer wrote"
    return str(info.value)


def _replaced_worker(rank, world, configs):
    import torch
    import torch.distributed as dist
    from _dsutil import (
        check_targets,
        ds_env,
        make_engine,
        reference,
        replicated_targets,
        train,
    )

    ds_env(rank, world)
    import reshard as rs
    from reshard.errors import NotReadyError
    from reshard.integrations import deepspeed as rsds

    done = []
    for stage, offload in configs:
        tag = f"stage {stage} offload {offload}"
        engine = make_engine(stage, offload, "block")
        train(engine, "block", 1, seed=1, rank=rank)
        lives = {k: rsds.describe(engine, k) for k in KINDS}
        assert all(lv.reasons() == [] for lv in lives.values()), tag
        targets = {k: replicated_targets(lv, list(range(world))) for k, lv in lives.items()}
        transfers = {k: rs.Transfer(lv.layout, targets[k][0]) for k, lv in lives.items()}
        p_layout, p_bufs = targets["param"]
        sync = rsds.SyncAfterStep(engine, {"param": (p_layout, p_bufs)})
        sync.sync()  # describes and plans "param" once: the cached state goes stale below
        check_targets(p_layout, p_bufs, reference(engine, "param"), f"{tag} before")
        head = engine.module.head

        # 1. a trainable param's bf16/fp16 tensor moved off the flat DeepSpeed steps
        lp = head.bias.ds_tensor if stage == 3 else head.bias
        kept = lp.data
        lp.data = torch.zeros_like(kept)
        for k, lv in lives.items():
            with pytest.raises(NotReadyError, match=r"\['head\.bias'\] no longer view"):
                lv.check()
            _refused_everywhere(transfers[k], lv, targets[k][1], r"head\.bias'\] no longer view")
        lp.data = kept  # the view again: usable as described
        assert all(lv.reasons() == [] for lv in lives.values()), tag

        # 2. a trainable param replaced by a new Parameter: DeepSpeed still steps the old one,
        # so describing again is refused too (through the preflight, by SyncAfterStep)
        old = head.weight
        head.weight = torch.nn.Parameter(torch.zeros_like(old))
        for k, lv in lives.items():
            msg = _refused_everywhere(
                transfers[k], lv, targets[k][1], r"parameters replaced \['head\.weight'\]"
            )
            assert "describe() again" in msg, msg
        _poison(p_bufs)
        with pytest.raises(rs.PreflightError, match="does not list"):
            sync.sync()
        assert all(v.isnan().all() for v in p_bufs.values()), tag
        head.weight = old
        assert all(lv.reasons() == [] for lv in lives.values()), tag

        # 3. a frozen param replaced: ZeRO-1/2 reads frozen params from the module, so the next
        # sync describes again and moves the new values; ZeRO-3 refuses an unpartitioned one
        norm = engine.module.layer.norm2
        g = torch.Generator().manual_seed(123)
        new = torch.randn(norm.weight.ds_shape if stage == 3 else norm.weight.shape, generator=g)
        new = new.to(torch.bfloat16)
        norm.weight = torch.nn.Parameter(new.clone(), requires_grad=False)
        for k, lv in lives.items():
            _refused_everywhere(transfers[k], lv, targets[k][1], rf"replaced \['{FROZEN}'\]")
        _poison(p_bufs)
        if stage == 3:
            with pytest.raises(rs.PreflightError, match="not partitioned by ZeRO-3"):
                sync.sync()
            assert all(v.isnan().all() for v in p_bufs.values()), tag
        else:
            sync.sync()
            want = reference(engine, "param")
            assert torch.equal(want[FROZEN], new)  # the reference reads the module
            assert check_targets(p_layout, p_bufs, want, f"{tag} after replacement") > 0
        dist.barrier()
        engine.destroy()
        done.append(tag)
    return done


def test_replaced_parameters_are_refused_and_resynced(tmp_path):
    configs = [(1, "none"), (2, "cpu"), (3, "none")]
    done = run_ranks(_replaced_worker, 2, tmp_path, args=(configs,), env=ENV, timeout=400)[0]
    assert len(done) == len(configs)


def _one_rank_worker(rank, world):
    import time

    import torch
    from _dsutil import batch, ds_env, make_engine, replicated_targets, train

    ds_env(rank, world)
    import reshard as rs
    from reshard.integrations import deepspeed as rsds

    out = []
    engine = make_engine(2, "none", "block")
    train(engine, "block", 1, seed=1, rank=rank)
    layout, bufs = replicated_targets(rsds.describe(engine, "param"), list(range(world)))

    def buffers():
        if rank == 1 and fail[0]:
            raise KeyError("rollout buffers not allocated yet")
        return bufs

    fail = [True]
    sync = rsds.SyncAfterStep(engine, {"param": (layout, buffers)})

    def refused(call):
        """`call()` must refuse on every rank: its error and time, and no target written."""
        t0 = time.perf_counter()
        try:
            call()
            out.append(("no error", 0.0))
        except rs.PreflightError as exc:
            out.append((str(exc), time.perf_counter() - t0))
        assert all(v.isnan().all() for v in bufs.values()), "a refused sync wrote"

    # the callable raises on rank 1 only, on the first sync (nothing planned before) and on a
    # later one (the Transfer planned)
    for first in (True, False):
        x = batch(engine, "block", 30 + rank)
        engine.backward(engine(x).float().pow(2).mean())
        refused(sync.step)
        if first:  # let one sync through, so the second failure meets a planned Transfer
            fail[0] = False
            sync.sync()
            fail[0] = True
            for v in bufs.values():
                v.fill_(float("nan"))

    # describing again fails on rank 1 only (its module changed, its peers' did not): rank 1
    # has no plan for the new state, its peers run the cached one; all refuse alike
    fail[0] = False
    if rank == 1:
        engine.module.head.weight = torch.nn.Parameter(torch.zeros_like(engine.module.head.weight))
    refused(sync.sync)
    engine.destroy()
    return out


def test_sync_after_step_failure_on_one_rank_fails_every_rank(tmp_path):
    # group_timeout bounds the old behaviour (rank 0 waiting in the exchange) to 40 s
    res = run_ranks(_one_rank_worker, 2, tmp_path, env=ENV, timeout=300, group_timeout=40)
    for i, cause in enumerate(
        (
            "target buffers callable raised KeyError: 'rollout buffers not allocated yet'",
            "target buffers callable raised KeyError: 'rollout buffers not allocated yet'",
            "describe(engine, 'param') failed: UnsupportedError: the optimizer owns a parameter",
        )
    ):
        msgs = [r[i][0] for r in res]
        assert msgs[0] == msgs[1], msgs  # the same error on every rank
        assert "preflight failed on 1 of 2 ranks (1)" in msgs[0], msgs[0]
        assert "\n  rank 1: " in msgs[0] and cause in msgs[0], msgs[0]
        assert "rank 0:" not in msgs[0], msgs[0]  # rank 0's plan is not blamed
        assert max(r[i][1] for r in res) < 20, [r[i][1] for r in res]  # no wait for a timeout


def _offloaded_worker(rank, world):
    from _dsutil import ds_env, make_engine, train

    ds_env(rank, world)
    from reshard.errors import NotReadyError
    from reshard.integrations import deepspeed as rsds

    done = []
    for stage in (1, 2, 3):
        engine = make_engine(stage, "none")
        train(engine, "mlp", 1, seed=1, rank=rank)
        lives = {k: rsds.describe(engine, k) for k in KINDS}
        if stage == 3:
            # DeepSpeed 0.19.8's ZeRO-3 offload_states() fails on the CPU accelerator
            # (IndexError inside DeepSpeed): set what it records instead
            from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum

            engine.optimizer.offloaded_states.add(OffloadStateTypeEnum.optim_states)
        else:
            engine.offload_states()
        for k in KINDS:
            with pytest.raises(NotReadyError, match=r"offloaded .*call engine\.reload_states\(\)"):
                rsds.describe(engine, k)
            with pytest.raises(NotReadyError, match=r"offloaded .*call engine\.reload_states\(\)"):
                lives[k].check()
        if stage == 3:
            engine.optimizer.offloaded_states.clear()
        else:
            engine.reload_states()
        for k in KINDS:
            assert rsds.describe(engine, k).reasons() == [], (stage, k)
        engine.destroy()
        done.append(stage)
    return done


def test_describe_while_offloaded_says_reload(tmp_path):
    assert run_ranks(_offloaded_worker, 2, tmp_path, env=ENV, timeout=300)[0] == [1, 2, 3]


def _collective_worker(rank, world):
    import contextlib
    import time

    from _dsutil import batch, ds_env, make_engine, replicated_targets, train

    ds_env(rank, world)
    import reshard as rs
    from reshard.errors import NotReadyError
    from reshard.integrations import deepspeed as rsds
    from reshard.integrations.deepspeed_live import LiveState

    out = {}

    def timed(call):
        t0 = time.perf_counter()
        try:
            call()
            return ("no error", time.perf_counter() - t0)
        except (NotReadyError, rs.PreflightError) as exc:
            return (f"{type(exc).__name__}: {exc}", time.perf_counter() - t0)

    # 1. the refreshes on an engine whose states are offloaded on rank 1 only: DeepSpeed's
    # collectives inside them must not start on rank 0 alone
    engine = make_engine(2, "none", "block")
    train(engine, "block", 1, seed=1, rank=rank)
    if rank == 1:
        engine.offload_states()
    out["refresh_params"] = timed(lambda: rsds.refresh_params(engine))
    out["refresh_persistent"] = timed(lambda: rsds.refresh_persistent(engine))
    if rank == 1:
        engine.reload_states()
    rsds.refresh_params(engine)  # fit on every rank again: runs

    # 2. reasons() runs once per kind per sync (the preflight does not compute them again), and
    # a training forward on rank 1 alone still stops the sync on every rank
    layout, bufs = replicated_targets(rsds.describe(engine, "param"), list(range(world)))
    sync = rsds.SyncAfterStep(engine, {"param": (layout, bufs)})
    calls = [0]
    reasons = LiveState.reasons

    def counted(self):
        calls[0] += 1
        return reasons(self)

    LiveState.reasons = counted
    try:
        sync.sync()  # describes: the fresh state's check() in preflight
        calls[0] = 0
        sync.sync()
        sync.sync()
        out["reasons calls"] = calls[0]
    finally:
        LiveState.reasons = reasons
    if rank == 1:
        engine(batch(engine, "block", 40)).float().sum()  # a training forward
    for v in bufs.values():
        v.fill_(float("nan"))
    out["forward on rank 1"] = timed(sync.sync)
    assert all(v.isnan().all() for v in bufs.values()), "a refused sync wrote"
    engine.destroy()

    # 3. SyncAfterStep built on an engine destroyed on rank 1 only: the constructor refuses
    # nothing alone; the first sync refuses on every rank
    engine = make_engine(1, "none", "mlp")
    train(engine, "mlp", 1, seed=1, rank=rank)
    layout, bufs = replicated_targets(rsds.describe(engine, "param"), list(range(world)))
    if rank == 1:
        engine.destroy()
    try:
        with (
            pytest.warns(UserWarning, match="destroyed") if rank == 1 else contextlib.nullcontext()
        ):
            sync = rsds.SyncAfterStep(engine, {"param": (layout, bufs)})
        out["init"] = ("no error", 0.0)
    except NotReadyError as exc:  # the old behaviour: rank 1 alone
        out["init"] = (f"NotReadyError: {exc}", 0.0)
        return out
    out["sync after init"] = timed(sync.sync)
    out["sync after init again"] = timed(sync.sync)
    assert all(v.isnan().all() for v in bufs.values()), "a refused sync wrote"
    if rank == 0:
        engine.destroy()
    return out


def test_one_rank_failures_in_refreshes_and_constructor_fail_every_rank(tmp_path):
    res = run_ranks(_collective_worker, 2, tmp_path, env=ENV, timeout=300, group_timeout=40)
    for what in ("refresh_params", "refresh_persistent"):
        msgs = [r[what][0] for r in res]
        assert msgs[0] == msgs[1], (what, msgs)  # the same error on every rank
        assert msgs[0].startswith(f"NotReadyError: {what}(engine) failed on 1 of 2"), msgs[0]
        assert "\n  rank 1: NotReadyError: engine states" in msgs[0], msgs[0]
        assert "reload_states()" in msgs[0] and "rank 0:" not in msgs[0], msgs[0]
        assert max(r[what][1] for r in res) < 20, [r[what][1] for r in res]
    assert [r["reasons calls"] for r in res] == [2, 2], res  # two syncs, one kind
    msgs = [r["forward on rank 1"][0] for r in res]
    assert msgs[0] == msgs[1] and "a forward with autograd enabled ran" in msgs[0], msgs
    assert "preflight failed on 1 of 2 ranks (1)" in msgs[0], msgs[0]
    assert [r["init"][0] for r in res] == ["no error", "no error"], [r["init"] for r in res]
    for what in ("sync after init", "sync after init again"):
        msgs = [r[what][0] for r in res]
        assert msgs[0] == msgs[1], (what, msgs)
        assert "preflight failed on 1 of 2 ranks (1)" in msgs[0], msgs[0]
        assert (
            "rank 1: SyncAfterStep(engine, ...) failed on this rank: NotReadyError: " in (msgs[0])
            and "destroyed" in msgs[0]
        ), msgs[0]
        assert max(r[what][1] for r in res) < 20, [r[what][1] for r in res]


def _crossed_kinds_worker(rank, world):
    """SyncAfterStep with exp_avg and exp_avg_sq into one target layout (one plan for both),
    its targets dict in crossed order on the two ranks (built from a set, say): every sync
    pairs one rank's exp_avg with the other's exp_avg_sq, from the first (fresh LiveStates)
    to later ones (the cached state, `_Checked`). Each must be refused alike on every rank,
    writing nothing; a SyncAfterStep in one order then moves the right states."""
    from _dsutil import check_targets, ds_env, make_engine, reference, replicated_targets, train

    ds_env(rank, world)
    import reshard as rs
    from reshard.integrations import deepspeed as rsds

    engine = make_engine(2, "none", "block")
    train(engine, "block", 2, seed=3, rank=rank)
    kinds = ["exp_avg", "exp_avg_sq"]
    layout, _ = replicated_targets(rsds.describe(engine, "exp_avg"), list(range(world)))

    def targets(order):
        return {
            k: (layout, replicated_targets(rsds.describe(engine, k), list(range(world)))[1])
            for k in order
        }

    crossed = targets(kinds if rank == 0 else kinds[::-1])
    sync = rsds.SyncAfterStep(engine, crossed)
    out = []
    for _ in range(3):
        try:
            sync.sync()
            out.append("no error")
        except rs.PreflightError as exc:
            out.append(str(exc))
    out.append(all(bool(v.isnan().all()) for _, bufs in crossed.values() for v in bufs.values()))
    ordered = targets(kinds)
    sync = rsds.SyncAfterStep(engine, ordered)
    for _ in range(2):  # the second through the cached state
        sync.sync()
        for k, (dst, bufs) in ordered.items():
            check_targets(dst, bufs, reference(engine, k), k)
    engine.destroy()
    return out


def test_sync_after_step_kinds_in_crossed_order_are_refused(tmp_path):
    res = run_ranks(_crossed_kinds_worker, 2, tmp_path, env=ENV, timeout=300, group_timeout=40)
    for i in range(3):
        msgs = [r[i] for r in res]
        assert msgs[0] == msgs[1], (i, msgs)  # the same error on every rank
        assert "'exp_avg'" in msgs[0] and "'exp_avg_sq'" in msgs[0], (i, msgs[0])
    assert res[0][3] and res[1][3], "a refused sync wrote its targets"
