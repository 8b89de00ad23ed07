"""Workers of test_repeated_calls.py: one Transfer called again and again, where a repeated
call's preflight may take its short path (buffers where the last passing call had them).

Module level and light imports: spawned ranks re-import this module.
"""

from __future__ import annotations

import _faults as F
import _scenarios as S
import torch

import reshard as rs
from reshard.preflight import BufferSet

# One corruption per refused call, applied on one rank. Each must be caught although the
# calls before it passed with the same Transfer (and, for the in-place ones, the same tensors).
CORRUPTIONS = (
    "freed_source",  # a source view whose storage was freed
    "target_in_source",  # a target that is a view of a source buffer's memory
    "targets_overlap",  # two targets that share memory
    "requires_grad_in_place",  # the same target tensor, now requiring grad under grad mode
    "not_ready",  # the readiness hook raises
    "missing_target",  # a target location left out
    "wrong_dtype",  # a source of another dtype
)


def _case(world):
    shapes = S.model_shapes()
    values = S.model_values(shapes)
    ranks = list(range(world))
    src = S.Zero3(shapes, ranks, dtype=torch.float32, loc0=0)
    dst = S.TensorParallel(shapes, [ranks], dtype=torch.float32, loc0=1000)
    return values, src, dst


def _corrupt(kind, sb, db):
    """(source buffer set, target buffer set, undo) for one corrupted call."""
    sb, db = dict(sb), dict(db)
    undo = []
    sloc = max(sb, key=lambda k: sb[k].numel())
    tlocs = sorted(db, key=lambda k: db[k].numel(), reverse=True)
    if kind == "freed_source":
        bad = sb[sloc].clone()
        bad.untyped_storage().resize_(0)
        sb[sloc] = bad
    elif kind == "target_in_source":
        t = db[tlocs[0]]
        base = torch.empty(max(sb[sloc].numel(), t.numel()))
        base[: sb[sloc].numel()] = sb[sloc]
        sb[sloc] = base[: sb[sloc].numel()]
        db[tlocs[0]] = base[: t.numel()]
    elif kind == "targets_overlap":
        a, b = db[tlocs[0]], db[tlocs[1]]
        base = torch.full((max(a.numel(), b.numel()),), S.POISON)
        db[tlocs[0]], db[tlocs[1]] = base[: a.numel()], base[: b.numel()]
    elif kind == "requires_grad_in_place":
        db[tlocs[0]].requires_grad_(True)
        undo.append(lambda: db[tlocs[0]].requires_grad_(False))
    elif kind == "not_ready":

        def check():
            raise rs.NotReadyError("injected: state not ready")

        return BufferSet(sb, [check]), db, undo
    elif kind == "missing_target":
        del db[tlocs[0]]
    elif kind == "wrong_dtype":
        sb[sloc] = sb[sloc].double()
    return sb, db, undo


def run_repeated(rank, world, group=None):
    """A clean call, then per corruption a call corrupted on rank i % world followed by a
    clean call, all on one Transfer. Returns (errors, [(kind, bad rank, outcome type,
    message, failing ranks)]) for the parent to compare across ranks."""
    values, src, dst = _case(world)
    t = rs.Transfer(src.layout(), dst.layout(), budget_bytes_per_peer=64, group=group, timeout=60)
    sb = S.source_buffers(src, values, rank)
    sb_before = {k: v.clone() for k, v in sb.items()}
    want = dst.fill(values, rank)
    poisoned = dst.empty(rank)
    db = dst.empty(rank)  # the same target tensors on every call: the short path's case
    errs, seen = [], []
    calls = [("none", 0)]
    for i, kind in enumerate(CORRUPTIONS):
        calls += [(kind, i % world), ("none", 0)]
    for kind, bad_rank in calls:
        for v in db.values():
            v.fill_(S.POISON)
        undo = []
        s_arg, d_arg = sb, db
        if kind != "none" and rank == bad_rank:
            s_arg, d_arg, undo = _corrupt(kind, sb, db)
        try:
            t(s_arg, d_arg)
            outcome = ("ok", "", ())
        except rs.PreflightError as exc:
            outcome = ("PreflightError", str(exc), tuple(sorted(exc.failures)))
        except Exception as exc:  # noqa: BLE001 - the parent reports it
            outcome = (type(exc).__name__, str(exc), ())
        for fn in undo:
            fn()
        seen.append((kind, bad_rank, *outcome))
        if kind == "none":
            errs += [
                f"clean call after {seen[-2][0] if len(seen) > 1 else '-'}: {m}"
                for m in S.mismatches(db, want)
            ]
            if outcome[0] != "ok":
                errs.append(f"clean call refused: {outcome[1][:300]}")
        else:
            errs += [f"{kind}: wrote {m}" for m in S.mismatches(db, poisoned)]
            if outcome[0] != "PreflightError" or outcome[2] != (bad_rank,):
                errs.append(
                    f"{kind}: expected a PreflightError naming rank {bad_rank}, got {outcome}"
                )
        errs += [f"{kind}: source {m}" for m in S.mismatches(sb, sb_before)]
    return errs, seen


def w_repeated(rank, world):
    return run_repeated(rank, world, group=None if world == 1 else torch.distributed.group.WORLD)


def w_late_rank_on_a_repeated_call(rank, world, marker_dir, timeout):
    """A Transfer's first call runs with every rank on time; on its second call every rank but
    the last gives up waiting (timeout) before the last one arrives. The late rank must not
    write: every rank raises PreflightError and the targets keep what the first call wrote."""
    values, src, dst = _case(world)
    t = rs.Transfer(src.layout(), dst.layout(), budget_bytes_per_peer=64, timeout=timeout)
    sb = S.source_buffers(src, values, rank)
    db = dst.empty(rank)
    first = t(sb, db)
    for v in db.values():
        v.fill_(S.POISON)
    before = {k: v.clone() for k, v in db.items()}
    outcome = F.arrive_late(rank, world, marker_dir, lambda: t(sb, db))
    return outcome, S.mismatches(db, before), first.local_bytes > 0
