"""Worker functions for tests/gpu/multi/test_nccl.py (module level: spawn re-imports them).

Every worker runs on real spawned ranks (tests/_spawn.py): NCCL with one GPU per rank on the GPU
machine; the same functions also run over gloo on CPU (cuda residencies dropped) so their logic
is exercised where there is no GPU. Workers return plain data (error strings, byte counts) and do
not assert, so one spawn checks many cases and the parent reports every failure at once.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

_HERE = os.path.dirname(os.path.abspath(__file__))
_TESTS = os.path.dirname(os.path.dirname(_HERE))
for _p in (os.path.join(_TESTS, "distributed"), os.path.join(_TESTS, "deepspeed"), _TESTS):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import _faults as F  # noqa: E402
import _scenarios as S  # noqa: E402
import _workers as W  # noqa: E402

import reshard as rs  # noqa: E402


def _dev(kind: str) -> torch.device:
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _to(bufs: dict, kind: str) -> dict:
    return {k: t.to(_dev(kind)) for k, t in bufs.items()}


def _cpu(bufs: dict) -> dict:
    return {k: t.cpu() for k, t in bufs.items()}


def w_residency(rank, world, cases, combos, shapes_kw):
    """Each case under each (source device, target device): two calls of one Transfer into
    poisoned targets, compared bitwise on the CPU with the scenario's reference; sources must be
    unchanged and held staging within the plan's bound."""
    shapes = S.model_shapes(**shapes_kw)
    values = S.model_values(shapes, seed=world)
    out = []
    for case in cases:
        src, dst = W.build(case, shapes)
        held = {n: v.to(src.dtype).float() for n, v in values.items()}
        want = dst.fill(held, rank)
        for sdev, ddev in combos:
            errs = []
            tag = f"{case} {sdev}->{ddev}"
            sync = rs.Transfer(src.layout(), dst.layout(), budget_bytes_per_peer=case[4])
            sb = _to(S.source_buffers(src, values, rank), sdev)
            sb_before = _cpu(sb)
            for call in range(2):  # the second call reuses the arenas (and the ring)
                db = _to(dst.empty(rank), ddev)
                rep = sync(sb, db)
                errs += [f"{tag} call {call}: {m}" for m in S.mismatches(_cpu(db), want)]
                for k in rep.peak_staging_bytes:
                    if rep.peak_staging_bytes[k] > rep.staging_bound[k]:
                        errs.append(
                            f"{tag}: staging {rep.peak_staging_bytes} > {rep.staging_bound}"
                        )
            errs += [f"{tag}: source modified: {m}" for m in S.mismatches(_cpu(sb), sb_before)]
            out.append((tag, errs, rep.bytes_sent, rep.bytes_received, rep.rounds, rep.transport))
    return out


PREFLIGHT_KINDS = F.PREFLIGHT_KINDS


def w_preflight(rank, world, sdev, ddev, kinds):
    """For each kind (tests/distributed/_faults.py) and each failing rank: every rank raises the
    same PreflightError naming the failing rank, and no target byte changes anywhere."""
    shapes = S.model_shapes()
    values = S.model_values(shapes)
    case = (("zero12", list(range(world))), ("tp", [list(range(world))]), "fp32", "bf16", 64)
    src, dst = W.build(case, shapes)
    plan = rs.plan(src.layout(), dst.layout(), budget_bytes_per_peer=64)
    other = rs.plan(src.layout(), dst.layout(), budget_bytes_per_peer=96)
    errs, msgs = [], []
    for kind in kinds:
        for bad in range(world):
            sb = _to(S.source_buffers(src, values, rank), sdev)
            db = _to(dst.empty(rank), ddev)
            p, checks = plan, ()
            if rank == bad:
                p, checks = F.break_inputs(kind, rank, world, src, sb, db, plan, other)
            before = _cpu(db)
            try:
                rs.execute(p, sb, db, checks=checks)
                errs.append(f"{kind} on rank {bad}: no PreflightError on rank {rank}")
            except rs.PreflightError as exc:
                msg = str(exc)
                # a 2-rank fingerprint tie names the other rank as the odd one out
                named = f"rank {bad}" if kind == "fingerprint" else f"rank {bad}:"
                if named not in msg:
                    errs.append(f"{kind} on rank {bad}: message does not name it: {msg}")
                if kind != "fingerprint" and set(exc.failures) != {bad}:
                    errs.append(f"{kind} on rank {bad}: failures {exc.failures}")
                errs += [f"{kind}/{bad}: touched {m}" for m in S.mismatches(_cpu(db), before)]
                msgs.append((kind, bad, msg))
    return errs, msgs


def w_preflight_many(rank, world, runs):
    """w_preflight for several (source device, target device, kinds) in one spawn."""
    return [w_preflight(rank, world, sdev, ddev, kinds) for sdev, ddev, kinds in runs]


def w_killed(rank, world, victim, mode, dev, timeout):
    """One good transfer (communicators warm), then `victim` dies: in the middle of the rounds
    (mode "die": the survivors must raise TransferError) or in preflight's local checks
    ("die_in_preflight": PreflightError, targets untouched). Returns (error kind, seconds,
    message, rounds)."""
    from tests._spawn import die

    shapes = S.model_shapes(hidden=64, ffn=96, vocab=301)
    values = S.model_values(shapes)
    case = (("zero3", list(range(world))), ("tp", [list(range(world))]), "fp32", "fp32", 4096)
    src, dst = W.build(case, shapes)
    sync = rs.Transfer(src.layout(), dst.layout(), budget_bytes_per_peer=4096, timeout=timeout)
    sb = _to(S.source_buffers(src, values, rank), dev)
    db = _to(dst.empty(rank), dev)
    rounds = sync(sb, db).rounds  # warm-up: communicators exist, the failure is mid-protocol
    checks = ()
    if rank == victim and mode == "die_in_preflight":
        checks = (die,)
    elif rank == victim:
        F.die_in_rounds("die", timeout)  # packing round 4, with round 3 posted
    db = _to(dst.empty(rank), dev)
    before = _cpu(db)
    t0 = time.monotonic()
    try:
        sync(sb, db, checks=checks)
        return ("no error", time.monotonic() - t0, "", rounds)
    except (rs.TransferError, rs.PreflightError) as exc:
        seconds = time.monotonic() - t0
        if isinstance(exc, rs.PreflightError) and S.mismatches(_cpu(db), before):
            out = ("PreflightError but targets were written", seconds, str(exc), rounds)
        else:
            out = (type(exc).__name__, seconds, str(exc), rounds)
    except Exception as exc:  # noqa: BLE001 - reported to the parent as a wrong error type
        out = (type(exc).__name__, time.monotonic() - t0, str(exc), rounds)
    _abort_dead_group()
    return out


def _abort_dead_group():
    """After a peer died under NCCL, abort the group (what a job does before rebuilding it):
    the normal teardown would finalize communicators whose peer is gone. gloo needs nothing."""
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if dist.get_backend() != "nccl" or abort is None:
        return
    try:
        abort()
    except Exception:  # noqa: BLE001 - best effort; the result is already decided
        pass


def w_deepspeed(rank, world, stages, models, budget, device="cuda"):
    """Real ZeRO engines, optimizer offloaded to CPU, one GPU per rank: masters and moments
    (CPU) into GPU replicas, compared bitwise with DeepSpeed's safe_get_full_*; bf16 params
    (GPU) into bf16 TP=2 rollout buffers on the GPUs; GPU values written back into the CPU
    masters/moments and read back through DeepSpeed. device="cpu": the gloo dry run."""
    from _dsutil import (
        assert_bitwise,
        check_targets,
        ds_env,
        make_engine,
        reference,
        replicated_targets,
        tp_targets,
        train,
    )

    ds_env(rank, world)
    from reshard.integrations import deepspeed as rsds

    done = []
    for stage in stages:
        for model in models:
            tag = f"stage {stage} offload cpu {model} dp {world}"
            engine = make_engine(stage, "cpu", model)
            train(engine, model, 2, seed=1, rank=rank)
            for kind in ("param", "fp32", "exp_avg", "exp_avg_sq"):
                live = rsds.describe(engine, kind)
                devices = {b.device.type for b in live.buffers.values()}
                want_dev = {device} if kind == "param" else {"cpu"}
                assert devices <= want_dev, (tag, kind, devices)
                want = reference(engine, kind)
                dst, bufs = replicated_targets(live, list(range(world)), device=device)
                rep = rs.Transfer(live.layout, dst, budget_bytes_per_peer=budget)(live, bufs)
                n = check_targets(dst, bufs, want, f"{tag} {kind} -> gpu replicas")
                assert n == len(want), (tag, kind, n, len(want))
                if kind == "param":
                    dst, bufs = tp_targets(live, [0, 1], device=device)
                    r2 = rs.Transfer(live.layout, dst, budget_bytes_per_peer=budget)(live, bufs)
                    check_targets(dst, bufs, want, f"{tag} bf16 params -> TP=2 gpu")
                    done.append((tag, "tp", r2.total_bytes_sent, r2.transport))
                    continue
                # back: GPU TP shards * 0.5 into the engine's CPU storage
                dst, bufs = tp_targets(live, [0, 1], device=device)
                rs.Transfer(live.layout, dst, budget_bytes_per_peer=budget)(live, bufs)
                for b in bufs.values():
                    b.mul_(0.5)
                rs.Transfer(dst, live.layout, budget_bytes_per_peer=budget)(bufs, live)
                got = reference(engine, kind)
                for name in want:
                    assert_bitwise(got[name], want[name] * 0.5, f"{tag} {kind} <- gpu {name}")
                done.append((tag, kind, rep.total_bytes_sent, rep.transport))
            rsds.refresh_params(engine)  # masters were halved: params follow
            masters, params = reference(engine, "fp32"), reference(engine, "param")
            for name in masters:
                assert_bitwise(
                    params[name], masters[name].to(params[name].dtype), f"{tag} refresh {name}"
                )
            engine.destroy()
    dist.barrier()
    return done


def w_restore(rank, world, configs, budget):
    """The DeepSpeed suite's restore scenario (snapshot A into TP shards, restore into a
    diverged B, B's next step equals A's bitwise) on GPUs over NCCL: CPU-offloaded state and
    CPU snapshot buffers, so every message goes CPU -> pinned ring -> GPU -> NCCL and back."""
    from test_deepspeed import _restore_worker

    return _restore_worker(rank, world, configs, budget)
