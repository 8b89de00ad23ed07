"""Workers of test_repeated_calls.py: one Transfer called again and again, where a repeated
call's preflight may take its short path (buffers where the last passing call had them).

Module level and light imports: spawned ranks re-import this module.
"""

from __future__ import annotations

import functools

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
    # The same tensor objects as the passing calls, changed in place: what a repeated call
    # reads of each buffer must see each of these.
    "target_freed_in_place",  # storage resized to 0 bytes (as FSDP frees unsharded params)
    "source_reallocated_smaller",  # storage freed, then given fewer bytes (often the same address)
    "target_retyped_in_place",  # .data = a view of its own bytes as int32: same address
    "target_truncated_in_place",  # .data = its first n-1 elements: same address and strides
    "target_strided_in_place",  # .data = stride-0 view: same address and shape
    "target_onto_source_in_place",  # .data = a view of a source buffer's memory
    "grad_mode_on",  # a target that requires grad, passed under no_grad before, now grad mode
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
    elif kind in IN_PLACE:
        undo.append(IN_PLACE[kind](sb[sloc], db[tlocs[0]], db[tlocs[-1]]))
    return sb, db, undo


def _resize_storage(t, *nbytes):
    """Resize `t`'s storage to each of `nbytes` in turn; the undo restores size and values."""
    keep, st = t.clone(), t.untyped_storage()
    n = st.nbytes()
    for size in nbytes:
        st.resize_(size)
    return lambda: (st.resize_(n), t.copy_(keep))


def _set_data(t, new):
    old = t.data
    t.data = new
    return lambda: setattr(t, "data", old)


# kind -> f(the largest source, the largest target, the smallest target) -> undo
IN_PLACE = {
    "target_freed_in_place": lambda s, big, small: _resize_storage(big, 0),
    "source_reallocated_smaller": lambda s, big, small: _resize_storage(
        s, 0, s.untyped_storage().nbytes() - s.element_size()
    ),
    "target_retyped_in_place": lambda s, big, small: _set_data(big, big.view(torch.int32)),
    "target_truncated_in_place": lambda s, big, small: _set_data(big, big[:-1]),
    "target_strided_in_place": lambda s, big, small: _set_data(
        big, big.as_strided(big.shape, (0,))
    ),
    "target_onto_source_in_place": lambda s, big, small: _set_data(small, s[: small.numel()]),
}


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
        if kind == "grad_mode_on":
            # a target that requires grad passes under no_grad on every rank; then the same
            # call with grad mode on, on the bad rank only
            target = db[min(db)].requires_grad_(True)
            undo.append(functools.partial(target.requires_grad_, False))
            with torch.no_grad():
                t(sb, db)
                for v in db.values():
                    v.fill_(S.POISON)
            torch.set_grad_enabled(rank == bad_rank)
            undo.append(lambda: torch.set_grad_enabled(True))
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


def w_same_buffers(rank, world):
    """`Cleared.same_buffers` (what the rounds may rely on): True only when every buffer reads
    as in the previous call that cleared preflight on every rank. A call that passed on this
    rank while a peer failed did not clear: the same buffers next time are checked in full
    and reported as new. Returns the flag of each preflight that passed, in order."""
    from reshard import preflight as pf

    values, src, dst = _case(world)
    t = rs.Transfer(src.layout(), dst.layout(), budget_bytes_per_peer=64, timeout=60)
    sb = S.source_buffers(src, values, rank)
    t(sb, dst.empty(rank))
    engine, flags = t._engine, []

    def cleared(db, checks=()):
        flags.append(pf.run(engine, sb, db, checks, 60.0).same_buffers)

    def veto():
        raise rs.NotReadyError("injected on the last rank")

    db = dst.empty(rank)  # new tensors: never cleared
    cleared(db)
    cleared(db)
    other = dst.empty(rank)
    try:
        cleared(other, (veto,) if rank == world - 1 else ())
    except rs.PreflightError:
        flags.append("refused")
    cleared(other)
    cleared(other)
    return flags
