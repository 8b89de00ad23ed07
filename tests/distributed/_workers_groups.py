"""Workers for test_groups.py (module level: the spawn context re-imports them): process groups
destroyed and built again, groups that are not groups, and live buffer objects whose `.layout`
is not the plan's. Each returns a list of what went wrong (empty: all as expected)."""

from __future__ import annotations

import gc
import os
import sys
import weakref

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _scenarios as S  # noqa: E402

import reshard as rs  # noqa: E402
from reshard import preflight as pf  # noqa: E402
from reshard._launch import init_group  # noqa: E402


def _case(world, owners=None):
    """A ZeRO-3 fp32 source -> TP bf16 target over `owners` (default: every rank)."""
    r = list(range(world)) if owners is None else owners
    shapes = S.model_shapes()
    values = S.model_values(shapes)
    src = S.Zero3(shapes, r, dtype=torch.float32, loc0=0)
    dst = S.TensorParallel(shapes, [r], dtype=torch.bfloat16, loc0=1000)
    want = {n: v.to(torch.float32).float() for n, v in values.items()}
    return src, dst, values, want


def _sync(call, src, dst, values, want, rank, tag):
    """Run call(src_buffers, dst_buffers) into poisoned targets; what differs from the
    reference (or the error it raised)."""
    db = dst.empty(rank)
    try:
        call(S.source_buffers(src, values, rank), db)
    except Exception as exc:  # noqa: BLE001 - the parent judges it
        return [f"{tag}: {type(exc).__name__}: {exc}"]
    return [f"{tag}: {m}" for m in S.mismatches(db, dst.fill(want, rank))]


def _raises(fn, error, *needles):
    try:
        fn()
    except error as exc:
        missing = [n for n in needles if n not in str(exc)]
        return [f"{error.__name__} lacks {missing}: {exc}"] if missing else []
    except Exception as exc:  # noqa: BLE001
        return [f"expected {error.__name__}, got {type(exc).__name__}: {exc}"]
    return [f"expected {error.__name__}, nothing raised"]


class _Live:
    """What an integration's describe() returns: `.layout`, `.buffers`, `.check()`."""

    def __init__(self, layout, buffers):
        self.layout, self.buffers = layout, buffers

    def check(self):
        pass


def _live_layout(sync, src, dst, values, rank, world):
    """Rank 1's source object describes another model (one tensor's shape differs): every
    rank raises the same PreflightError naming rank 1 and that tensor; nothing is written."""
    shapes = dict(S.model_shapes())
    name = sorted(shapes)[0]
    shapes[name] = (*shapes[name][:-1], shapes[name][-1] + 1)
    wrong = S.Zero3(shapes, list(range(world)), dtype=torch.float32, loc0=0).layout()
    layout = wrong if rank == 1 else src.layout()
    db = dst.empty(rank)
    before = {k: v.clone() for k, v in db.items()}
    try:
        sync(_Live(layout, S.source_buffers(src, values, rank)), db)
        return ["a live object with another layout was accepted"]
    except rs.PreflightError as exc:
        errs = [f"live layout: touched {m}" for m in S.mismatches(db, before)]
        msg = str(exc)
        if set(exc.failures) != {1} or f"tensor {name!r}: shape" not in msg:
            errs.append(f"live layout: unclear refusal {exc.failures}: {msg}")
        return errs


def _reinit(store_dir, name, rank, world):
    dist.destroy_process_group()
    init_group("gloo", os.path.join(store_dir, name), rank, world, 60.0)


def w_group_lifecycle(rank, world, store_dir):
    errs = []
    src, dst, values, want = _case(world)
    sync = rs.Transfer(src.layout(), dst.layout(), budget_bytes_per_peer=64)
    errs += _sync(sync, src, dst, values, want, rank, "first group")

    errs += _live_layout(sync, src, dst, values, rank, world)

    # a subgroup used once and left out of step: reshard's per-group state must not keep it
    sub = dist.new_group(list(range(world)))
    plan = rs.plan(src.layout(), dst.layout(), budget_bytes_per_peer=64)
    errs += _sync(
        lambda s, d, g=sub: rs.execute(plan, s, d, group=g), src, dst, values, want, rank, "sub"
    )
    pf.mark_out_of_step(sub, "marked by the test")
    # as after a failed call: the old default group is unusable, a rebuilt one is not
    pf.mark_out_of_step(dist.group.WORLD, "marked by the test")
    world_ref, sub_ref = weakref.ref(dist.group.WORLD), weakref.ref(sub)

    # destroy and init again: group=None now means the new default group
    _reinit(store_dir, "store-2", rank, world)
    errs += _sync(sync, src, dst, values, want, rank, "rebuilt group")
    errs += _raises(
        lambda g=sub: rs.execute(
            plan, S.source_buffers(src, values, rank), dst.empty(rank), group=g
        ),
        ValueError,
        "destroy",
        "build the group again",
    )
    del sub
    gc.collect()
    if world_ref() is not None:
        errs.append("the destroyed default group is still referenced")
    if sub_ref() is not None:
        errs.append("the destroyed subgroup is still referenced")

    # a group that is no group: a TypeError on this rank before any collective
    errs += _raises(lambda: rs.Transfer(src.layout(), dst.layout(), group="world"), TypeError)
    errs += _raises(
        lambda: rs.execute(plan, {}, {}, group="world"), TypeError, "ProcessGroup", "'world'"
    )

    # a Transfer first called before init_process_group, then on the group: rank 0 owns
    # every storage, so the first call runs in-process on each process alike
    dist.destroy_process_group()
    src0, dst0, values0, want0 = _case(world, owners=[0])
    early = rs.Transfer(src0.layout(), dst0.layout(), budget_bytes_per_peer=64)
    errs += _sync(early, src0, dst0, values0, want0, 0, "before init")
    init_group("gloo", os.path.join(store_dir, "store-3"), rank, world, 60.0)
    errs += _sync(early, src0, dst0, values0, want0, rank, "after init")
    return errs
