"""Worker functions for the distributed tests (module level: the spawn context re-imports them).

Every worker returns plain data (lists of error strings, byte counts) and never asserts
itself, so one run checks many cases and the parent reports all failures at once.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _faults as F  # noqa: E402
import _refplan  # noqa: E402
import _scenarios as S  # noqa: E402

import reshard as rs  # noqa: E402
from reshard.rounds import wire_parts  # noqa: E402

DT = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def make_side(spec, shapes, dtype, loc0):
    kind, ranks = spec
    cls = {"zero3": S.Zero3, "zero12": S.Zero12, "tp": S.TensorParallel, "rep": S.Replicas}
    return cls[kind](shapes, ranks, dtype=DT[dtype], loc0=loc0)


def make_plan(planner, src, dst, budget, salt=""):
    if planner == "ref":
        return _refplan.RefPlan(src, dst, budget, salt=salt)
    return rs.plan(src, dst, budget_bytes_per_peer=budget)


def make_transfer(planner, src, dst, budget, **kw):
    """A Transfer over the reference planner's plan or over rs.plan's."""
    if planner == "ref":
        return rs.Transfer.from_plan(_refplan.RefPlan(src, dst, budget), **kw)
    return rs.Transfer(src, dst, budget_bytes_per_peer=budget, **kw)


def build(case, shapes):
    src_spec, dst_spec, sdt, ddt = case[:4]
    src = make_side(src_spec, shapes, sdt, 0)
    dst = make_side(dst_spec, shapes, ddt, 1000)
    return src, dst


def check_case(rank, planner, case, shapes, values, group=None, transfer=None):
    """Run one transfer; return (errors, report)."""
    src, dst = build(case, shapes)
    budget = case[4]
    plan = transfer.plan if transfer else make_plan(planner, src.layout(), dst.layout(), budget)
    sb = S.source_buffers(src, values, rank)
    sb_before = {k: t.clone() for k, t in sb.items()}
    db = dst.empty(rank)
    if transfer is not None:
        rep = transfer(sb, db)
    else:
        rep = rs.execute(plan, sb, db, group=group)
    # the source holds values rounded to its dtype; the reference casts those to the target's
    held = {n: v.to(src.dtype).float() for n, v in values.items()}
    errs = [f"{case}: {m}" for m in S.mismatches(db, dst.fill(held, rank))]
    errs += [f"{case}: source modified: {m}" for m in S.mismatches(sb, sb_before)]
    for k in rep.peak_staging_bytes:
        if rep.peak_staging_bytes[k] > rep.staging_bound[k]:
            errs.append(f"{case}: staging {k} {rep.peak_staging_bytes} > {rep.staging_bound}")
    bound = plan.staging_bytes(rank, transport="gloo", host_ring_bytes=0)
    if rep.staging_bound != {k: bound.get(k, 0) for k in rep.staging_bound}:
        errs.append(f"{case}: report bound {rep.staging_bound} != plan bound {bound}")
    return errs, rep


def w_correct(rank, world, planner, cases, shapes_kw):
    shapes = S.model_shapes(**shapes_kw)
    values = S.model_values(shapes, seed=world)
    out = []
    for case in cases:
        errs, rep = check_case(rank, planner, case, shapes, values)
        out.append((errs, rep.bytes_sent, rep.bytes_received, rep.rounds))
    return out


def w_repeat(rank, world, planner, n):
    """n calls of one Transfer: same results each time, RSS flat, no new staging after call 1."""
    import psutil

    shapes = S.model_shapes()
    case = (("zero3", list(range(world))), ("tp", [list(range(world))]), "fp32", "bf16", 256)
    src, dst = build(case, shapes)
    t = make_transfer(planner, src.layout(), dst.layout(), 256, timeout=60.0)
    errs, rss, allocs, ptrs = [], [], [], []
    proc = psutil.Process()
    for i in range(n):
        values = S.model_values(shapes, seed=i % 3)  # the state changes every step
        e, rep = check_case(rank, planner, case, shapes, values, transfer=t)
        errs += [f"call {i}: {x}" for x in e]
        allocs.append(t.engine_allocations)
        ptrs.append(tuple(a.data_ptr() for v in t._engine.staging.arenas.values() for a in v))
        if i in (9, n - 1):
            rss.append(proc.memory_info().rss)
    return errs, rss, allocs, len(set(ptrs)), rep.rounds


# the shared faults (_faults.py) plus two only this executor has: the staging allocation fails
# on one rank ("oom"), a buffer on a device the gloo transport cannot use ("device")
# refuse / refuse_noplan: the failing rank joins its peers' call through executor.refuse,
# with the plan or without one (its fingerprint then neither compared nor the reference)
PREFLIGHT_KINDS = F.PREFLIGHT_KINDS + ("oom", "device", "refuse", "refuse_noplan")


def _no_memory(self, nbytes, pinned):
    raise torch.OutOfMemoryError(f"cannot allocate {nbytes} bytes (injected)")


def w_preflight(rank, world, planner, kinds):
    """For each kind and each failing rank: every rank must raise the same PreflightError
    naming the failing rank, and no target byte may change anywhere."""
    from reshard.executor import refuse
    from reshard.staging import Staging

    real_alloc = Staging._alloc
    shapes = S.model_shapes()
    values = S.model_values(shapes)
    case = (("zero12", list(range(world))), ("tp", [list(range(world))]), "fp32", "bf16", 64)
    src, dst = build(case, shapes)
    plan = make_plan(planner, src.layout(), dst.layout(), 64)
    other = make_plan(planner, src.layout(), dst.layout(), 96, salt="other")
    errs, msgs = [], []
    for kind in kinds:
        for bad in range(world):
            sb = S.source_buffers(src, values, rank)
            db = dst.empty(rank)
            p, checks = plan, ()
            if rank == bad and kind == "oom":  # the staging allocation fails on this rank only
                Staging._alloc = _no_memory
            elif rank == bad and kind == "device":
                sloc = next(iter(sb))
                sb[sloc] = sb[sloc].to("meta")
            elif rank == bad and not kind.startswith("refuse"):
                p, checks = F.break_inputs(kind, rank, world, src, sb, db, plan, other)
            before = {k: t.clone() for k, t in db.items()}  # after the break: aliases included
            try:
                if rank == bad and kind.startswith("refuse"):
                    why = ["KeyError: 'buffers not ready' (injected)"]
                    refuse(None if kind == "refuse_noplan" else plan, why)
                rs.execute(p, sb, db, checks=checks)
                errs.append(f"{kind} on rank {bad}: no PreflightError on rank {rank}")
                continue
            except rs.PreflightError as exc:
                msg, failures = str(exc), exc.failures
            finally:
                Staging._alloc = real_alloc
            if f"rank {bad}:" not in msg:
                errs.append(f"{kind} on rank {bad}: message does not name it: {msg}")
            if kind != "fingerprint" and set(failures) != {bad}:
                errs.append(f"{kind} on rank {bad}: failures {failures}")
            errs += [f"{kind}/{bad}: touched {m}" for m in S.mismatches(db, before)]
            msgs.append((kind, bad, msg))
    return errs, msgs


class _Noted:
    """A buffers object with the `notes` an integration's describe() keeps (how this rank's
    state shaped its layout)."""

    def __init__(self, buffers, notes):
        self.buffers, self.notes = buffers, notes


def w_notes(rank, world):
    """Rank 1 planned another transfer (its layout came out otherwise) and its source object
    says why: every rank's PreflightError names the differing plan and rank 1's notes; no
    target byte changes."""
    shapes = S.model_shapes()
    values = S.model_values(shapes)
    case = (("zero12", list(range(world))), ("tp", [list(range(world))]), "fp32", "bf16", 64)
    src, dst = build(case, shapes)
    plan = make_plan("real", src.layout(), dst.layout(), 64)
    other = make_plan("real", src.layout(), dst.layout(), 96, salt="other")
    sb, db = S.source_buffers(src, values, rank), dst.empty(rank)
    before = {k: t.clone() for k, t in db.items()}
    note = "'fc2.weight' left out: no optimizer state for it on this rank"
    try:
        if rank == 1:
            rs.execute(other, _Noted(sb, [note]), db)
        else:
            rs.execute(plan, _Noted(sb, []), db)
    except rs.PreflightError as exc:
        msg = str(exc)
    else:
        return [f"rank {rank}: no PreflightError"], ""
    errs = [f"touched {m}" for m in S.mismatches(db, before)]
    if f"rank 1: its described state: {note}" not in msg or "rank 0: its" in msg:
        errs.append(f"notes not named as expected: {msg}")
    return errs, msg


def w_killed(rank, world, planner, victim, mode, timeout):
    """`victim` dies (or stalls) in the middle of the rounds; the others must raise
    TransferError within the timeout. Modes ending in "_direct": a transfer whose messages all
    go straight between buffers, several rounds posted ahead, the victim stopping before it
    posts its third round."""
    from tests._spawn import die

    shapes = S.model_shapes()
    values = S.model_values(shapes)
    r = list(range(world))
    if mode.endswith("_direct"):  # the offload shape, fp32 both sides: every wire direct
        case = (("zero3", r), ("zero3", r[1:] + r[:1]), "fp32", "fp32", 1000)
    else:
        case = (("zero3", r), ("tp", [r]), "fp32", "fp32", 16)
    src, dst = build(case, shapes)
    plan = make_plan(planner, src.layout(), dst.layout(), case[4])
    checks = ()
    if rank == victim and mode == "die_in_preflight":
        checks = (die,)  # dies inside the local checks, before the collective exchange
    elif rank == victim and mode.endswith("_direct"):
        F.die_in_posts(mode.removesuffix("_direct"), timeout)
    elif rank == victim:
        F.die_in_rounds(mode, timeout)
    t0 = time.monotonic()
    try:
        db = dst.empty(rank)
        before = {k: v.clone() for k, v in db.items()}
        rs.execute(plan, S.source_buffers(src, values, rank), db, timeout=timeout, checks=checks)
        return ("no error", time.monotonic() - t0, plan.schedule(rank).num_rounds)
    except (rs.TransferError, rs.PreflightError) as exc:
        if isinstance(exc, rs.PreflightError) and S.mismatches(db, before):
            return ("PreflightError but targets were written", 0.0, str(exc))
        return (type(exc).__name__, time.monotonic() - t0, str(exc))
    except Exception as exc:  # noqa: BLE001 - reported to the parent as a wrong error type
        return (type(exc).__name__, time.monotonic() - t0, str(exc))


def w_subgroup(rank, world, planner):
    """Two transfers on two disjoint subgroups of a 4-rank world at the same time: layout
    ranks are group ranks (global ranks 1,3 are group ranks 0,1 of the first group)."""
    groups = [dist.new_group([1, 3]), dist.new_group([0, 2])]
    mine = 0 if rank in (1, 3) else 1
    g = groups[mine]
    shapes = S.model_shapes()
    values = S.model_values(shapes, seed=mine)
    case = (("zero12", [0, 1]), ("tp", [[1, 0]]), "fp32", "bf16", 200)
    errs, rep = check_case(dist.get_rank(g), planner, case, shapes, values, group=g)
    try:  # a group this rank is not in: a clear error, no collective attempted
        check_case(0, planner, case, shapes, values, group=groups[1 - mine])
        errs.append("no error for a group this rank is not a member of")
    except ValueError as exc:
        if "is not a member of the process group" not in str(exc):
            errs.append(f"unclear error for a foreign group: {exc}")
    return errs, rep.rank, rep.world_size, rep.bytes_sent


def w_balance(rank, world, planner):
    """Replicas on ranks 0 and 1, TP targets on ranks 2 and 3: both replicas must send."""
    shapes = S.model_shapes(hidden=16, ffn=24, vocab=40)
    values = S.model_values(shapes)
    case = (("rep", [0, 1]), ("tp", [[2, 3]]), "fp32", "bf16", 1 << 20)
    errs, rep = check_case(rank, planner, case, shapes, values)
    return errs, rep.bytes_sent


def w_rank_budget(rank, world):
    """Transfer(budget_bytes_per_rank=...): ZeRO-3 over every rank -> TP over every rank (each
    rank exchanges with every other), the staging each rank held within the rank budget."""
    shapes = S.model_shapes(hidden=16, ffn=24, vocab=40)
    values = S.model_values(shapes)
    ranks = list(range(world))
    case = (("zero3", ranks), ("tp", [ranks]), "fp32", "bf16", None)
    src, dst = build(case, shapes)
    cap = 2 * 2 * (world - 1) * 64 + 40  # 64 bytes per peer and direction, plus a remainder
    t = rs.Transfer(src.layout(), dst.layout(), budget_bytes_per_rank=cap)
    errs, rep = check_case(rank, "real", case, shapes, values, transfer=t)
    if t.plan.budget_bytes_per_peer != 64:
        errs.append(f"per-peer budget {t.plan.budget_bytes_per_peer}, want 64")
    held = sum(rep.peak_staging_bytes.values())
    if held > cap:
        errs.append(f"rank {rank} held {held} staging bytes > rank budget {cap}")
    return errs, rep.rounds


def w_world4(rank, world, planner, cases):
    """One 4-rank spawn for everything that needs 4 ranks (spawning costs more than checking)."""
    return {
        "correct": w_correct(rank, world, planner, cases, {}),
        "subgroup": w_subgroup(rank, world, planner),
        "balance": w_balance(rank, world, planner),
        "rank_budget": w_rank_budget(rank, world) if planner == "real" else ([], 0),
    }


FUZZ_DTYPES = [
    ("fp32", "bf16"),
    ("bf16", "fp32"),
    ("fp32", "fp32"),
    ("fp16", "fp32"),
    ("bf16", "bf16"),
    ("fp32", "fp16"),
]
FUZZ_BUDGETS = [16, 48, 208, 4096, 1 << 20]


def _random_side(rng, kind, shapes, world, dtype, loc0):
    k = int(rng.integers(1, world + 1))
    ranks = sorted(int(x) for x in rng.choice(world, size=k, replace=False))
    if kind == "blocks":
        return S.RandomBlocks(shapes, ranks, rng, DT[dtype], loc0)
    return S.RandomFlat(shapes, ranks, rng, DT[dtype], loc0, replicate=(kind == "replicas"))


def w_fuzz(rank, world, seeds, planners):
    """Random layouts on both sides (flat ZeRO-like cuts, replicas, dim blocks), random dtypes
    and budgets, the same draws on every rank (seeded); both planners on each case."""
    import numpy as np

    errs, done = [], 0
    for seed in seeds:
        rng = np.random.default_rng(seed)
        shapes = S.random_shapes(rng, int(rng.integers(1, 4)))
        values = S.model_values(shapes, seed=seed)
        sdt, ddt = FUZZ_DTYPES[int(rng.integers(len(FUZZ_DTYPES)))]
        src = _random_side(
            rng, ["flat", "replicas", "blocks"][int(rng.integers(3))], shapes, world, sdt, 0
        )
        dst = _random_side(rng, ["flat", "blocks"][int(rng.integers(2))], shapes, world, ddt, 500)
        budget = FUZZ_BUDGETS[int(rng.integers(len(FUZZ_BUDGETS)))]
        held = {n: v.to(src.dtype).float() for n, v in values.items()}
        for planner in planners:
            plan = make_plan(planner, src.layout(), dst.layout(), budget)
            db = dst.empty(rank)
            sb = S.source_buffers(src, values, rank)
            rs.execute(plan, sb, db)
            errs += [
                f"seed {seed} {planner} ({sdt}->{ddt}, budget {budget}): {m}"
                for m in S.mismatches(db, dst.fill(held, rank))
            ]
            done += 1
    return errs, done


def _message_image(msg, side, dtype_of):
    """Brute force: the storage element behind each element of `msg` on this side ("send": the
    source, "recv": the target), or None where that is not one storage in the wire dtype."""
    import numpy as np

    attr = "src_location" if side == "send" else "dst_location"
    sc, mc = (0, 2) if side == "send" else (2, 0)  # storage / message columns of a desc row
    locs = {getattr(seg, attr) for seg in msg.segments}
    wires = {seg.wire_dtype for seg in msg.segments}
    if len(locs) != 1 or len(wires) != 1:
        return None
    loc, wire = locs.pop(), wires.pop()
    if dtype_of(loc) != wire or msg.nbytes % wire.itemsize:
        return None
    image = np.full(msg.nbytes // wire.itemsize, -1, dtype=np.int64)
    for seg in msg.segments:
        base = seg.byte_offset // wire.itemsize
        for row in np.asarray(seg.desc).reshape(-1, 6).tolist():
            for c in range(row[5]):
                for j in range(row[4]):
                    image[base + row[mc] + c * row[mc + 1] + j] = row[sc] + c * row[sc + 1] + j
    return image


def _is_one_range(image) -> bool:
    import numpy as np

    return image is not None and (image >= 0).all() and (np.diff(image) == 1).all()


def _segment_image(seg, side, dtype):
    """_message_image of a message holding only `seg` (at byte 0)."""
    one = _refplan.Segment(
        seg.src_location, seg.dst_location, seg.wire_dtype, 0, seg.numel, seg.desc
    )
    msg = _refplan.Message(0, 0, 0, seg.numel * seg.wire_dtype.itemsize, [one])
    return _message_image(msg, side, lambda loc: dtype)


def _peer_segments(scheds, plan, rank, side, rnd, peer):
    """{byte offset: segment} of the message the other end of (rank, side, round, peer) has;
    `scheds` caches the schedules by rank."""
    if peer not in scheds:
        scheds[peer] = plan.schedule(peer)
    sched = scheds[peer]
    msgs = (sched.recvs if side == "send" else sched.sends)[rnd]
    (msg,) = [m for m in msgs if m.peer == rank]
    return {int(seg.byte_offset): seg for seg in msg.segments}


def expected_zero_copy(plan, rank, src_dtype, dst_dtype):
    """(zero-copy bytes this rank should report, messages that are one contiguous range,
    messages that are not but partly are (consecutive elements somewhere, or a segment that
    alone is one range), messages, errors):
    what the executor's zero-copy rule means, computed element by element from the schedule.
    Also checks the planner's `contiguous` flag of every segment against both ends' element
    images: a flagged segment is one in-order range of its source and of its target storage
    in one dtype (else it would be sent or received straight from the wrong bytes), both
    ends flag it alike (else they would cut the message differently), and rs.plan flags
    every such segment."""
    import numpy as np

    sched = plan.schedule(rank)
    scheds = {rank: sched}
    nbytes = direct = partly = total = split = 0
    errs = []
    dts = {"send": src_dtype, "recv": dst_dtype}
    for side, rounds in (("send", sched.sends), ("recv", sched.recvs)):
        dt = dts[side]
        other = "recv" if side == "send" else "send"
        for rnd, msgs in enumerate(rounds):
            for m in msgs:
                total += 1
                peer_segs = _peer_segments(scheds, plan, rank, side, rnd, m.peer)
                for seg in m.segments:
                    pseg = peer_segs.get(int(seg.byte_offset))
                    truth = (
                        src_dtype == dst_dtype
                        and _is_one_range(_segment_image(seg, side, dt))
                        and pseg is not None
                        and _is_one_range(_segment_image(pseg, other, dts[other]))
                    )
                    if pseg is None or bool(pseg.contiguous) != bool(seg.contiguous):
                        errs.append(f"rank {rank} round {rnd}: the ends disagree on {seg}")
                    if seg.contiguous and not truth:
                        errs.append(f"rank {rank} round {rnd}: flagged, not contiguous: {seg}")
                    if isinstance(plan, rs.Plan) and truth and not seg.contiguous:
                        errs.append(f"rank {rank} round {rnd}: contiguous, not flagged: {seg}")
                image = _message_image(m, side, lambda loc, dt=dt: dt)
                if _is_one_range(image):
                    direct += 1
                elif image is not None and (image >= 0).all() and (np.diff(image) == 1).any():
                    partly += 1  # consecutive elements somewhere, but not one range
                elif any(_is_one_range(_segment_image(seg, side, dt)) for seg in m.segments):
                    partly += 1  # one of several storages' segments is one range alone
                # the cut itself is pinned by test_wire_parts_cut_at_contiguous_segments;
                # which of its wires are one range is judged here, element by element
                parts = wire_parts(m)
                split += len(parts) > 1
                for part in parts:
                    one = _refplan.Message(0, 0, 0, part.nbytes, list(part.segments))
                    if _is_one_range(_message_image(one, side, lambda loc, dt=dt: dt)):
                        nbytes += part.nbytes
    return nbytes, direct, partly, total, errs, split


def w_zero_copy(rank, world, planner, cases, calls):
    """Each case through one Transfer, `calls` times with fresh buffers and values: targets
    bitwise equal to the reference (poisoned padding intact), sources unchanged, and
    Report.zero_copy_bytes equal to the element-by-element expectation. Returns per case
    (errors, zero-copy bytes, direct messages, partly contiguous messages, messages, host
    staging held, host staging bound, rounds, messages cut into several wires)."""
    shapes = S.model_shapes()
    out = []
    for case in cases:
        src, dst = build(case, shapes)
        budget = case[4]
        t = make_transfer(planner, src.layout(), dst.layout(), budget)
        want, direct, partly, total, errs, split = expected_zero_copy(
            t.plan, rank, src.dtype, dst.dtype
        )
        for i in range(calls):
            values = S.model_values(shapes, seed=i)
            e, rep = check_case(rank, planner, case, shapes, values, transfer=t)
            errs += [f"call {i}: {x}" for x in e]
            if rep.zero_copy_bytes != want:
                errs.append(f"{case} call {i}: zero_copy_bytes {rep.zero_copy_bytes} != {want}")
        out.append(
            (
                errs,
                rep.zero_copy_bytes,
                direct,
                partly,
                total,
                rep.peak_staging_bytes["host"],
                rep.staging_bound["host"],
                rep.rounds,
                split,
            )
        )
    return out


# ---------------------------------------------------------------- hostile input (focused)


def _zero3_case(world, sdt="fp32", ddt="bf16", budget=64, dst_kind="tp"):
    r = list(range(world))
    dst_spec = ("tp", [r]) if dst_kind == "tp" else ("zero3", r[::-1])
    return (("zero3", r), dst_spec, sdt, ddt, budget)


def _outcome(fn):
    """("ok", report) or (exception type name, message, failures or None)."""
    try:
        return ("ok", fn())
    except Exception as exc:  # noqa: BLE001 - the parent judges the type
        return (type(exc).__name__, str(exc), getattr(exc, "failures", None))


def _run_threads(worker, n, timeout) -> bool:
    """worker(0) .. worker(n-1) on n threads at once; whether all finished within `timeout` s."""
    import threading

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout)
    return not any(th.is_alive() for th in threads)


def w_threads(rank, world, calls):
    """Two threads per rank call one Transfer at the same time, `calls` times each, with the
    same sources and their own targets: every call succeeds and every target is exact."""
    import threading

    shapes = S.model_shapes()
    values = S.model_values(shapes)
    case = _zero3_case(world, budget=48)
    src, dst = build(case, shapes)
    t = rs.Transfer(src.layout(), dst.layout(), budget_bytes_per_peer=48, timeout=60.0)
    sb = S.source_buffers(src, values, rank)
    want = dst.fill({n: v.to(src.dtype).float() for n, v in values.items()}, rank)
    errs, barrier = [], threading.Barrier(2)

    def worker(i):
        barrier.wait()
        for c in range(calls):
            db = dst.empty(rank)
            try:
                t(sb, db)
            except Exception as exc:  # noqa: BLE001 - reported
                errs.append(f"thread {i} call {c}: {type(exc).__name__}: {exc}")
                return
            errs.extend(f"thread {i} call {c}: {m}" for m in S.mismatches(db, want))

    if not _run_threads(worker, 2, 120):
        errs.append("a thread did not finish")
    return errs


def w_threads_two_transfers(rank, world, calls):
    """Two threads per rank, each with its own Transfer (different budgets: different plans)
    on the same group. The ranks may pair different Transfers' calls: such a call must raise
    PreflightError (fingerprints differ) on every rank; a call that succeeds is exact."""
    import threading

    shapes = S.model_shapes()
    values = S.model_values(shapes)
    want_vals = {n: v.to(torch.float32).float() for n, v in values.items()}
    cases = [_zero3_case(world, budget=48), _zero3_case(world, budget=80)]
    errs, outcomes, barrier = [], [], threading.Barrier(2)

    def worker(i):
        case = cases[i]
        src, dst = build(case, shapes)
        t = rs.Transfer(src.layout(), dst.layout(), budget_bytes_per_peer=case[4], timeout=60.0)
        sb = S.source_buffers(src, values, rank)
        want = dst.fill(want_vals, rank)
        barrier.wait()
        for c in range(calls):
            db = dst.empty(rank)
            before = {k: v.clone() for k, v in db.items()}
            try:
                t(sb, db)
                outcomes.append("ok")
                errs.extend(f"thread {i} call {c}: {m}" for m in S.mismatches(db, want))
            except rs.PreflightError as exc:
                outcomes.append("preflight")
                if "fingerprint" not in str(exc):
                    errs.append(f"thread {i} call {c}: unexpected PreflightError {exc}")
                errs.extend(f"thread {i} call {c} refused: {m}" for m in S.mismatches(db, before))
            except Exception as exc:  # noqa: BLE001 - reported
                errs.append(f"thread {i} call {c}: {type(exc).__name__}: {exc}")
                return

    if not _run_threads(worker, 2, 200):
        errs.append("a thread did not finish")
    return errs, outcomes


def w_versions(rank, world):
    """Every target a call writes has a new version (packed, local and zero-copy paths), and
    autograd notices a target saved for backward being overwritten. A target that requires
    grad is refused on every rank under grad mode; under no_grad it is written."""
    errs = []
    shapes = S.model_shapes()
    values = S.model_values(shapes)
    held = {n: v.float() for n, v in values.items()}
    zero_copy = 0
    for case in (_zero3_case(world), _zero3_case(world, "fp32", "fp32", 1 << 20, "zero3")):
        src, dst = build(case, shapes)
        t = rs.Transfer(src.layout(), dst.layout(), budget_bytes_per_peer=case[4])
        written = {lc.dst_location for lc in t.plan.schedule(rank).local} | {
            seg.dst_location
            for msgs in t.plan.schedule(rank).recvs
            for m in msgs
            for seg in m.segments
        }
        db = dst.empty(rank)
        before = {k: v._version for k, v in db.items()}
        rep = t(S.source_buffers(src, values, rank), db)
        zero_copy += rep.zero_copy_bytes
        errs += S.mismatches(db, dst.fill(held, rank))
        errs += [
            f"{case}: location {k} written, version unchanged"
            for k in written
            if db[k]._version == before[k]
        ]
    if zero_copy == 0:
        errs.append("no zero-copy receive happened: the case does not test that path")
    # autograd: a target saved for backward, then overwritten by a transfer
    case = _zero3_case(world)
    src, dst = build(case, shapes)
    t = rs.Transfer(src.layout(), dst.layout(), budget_bytes_per_peer=64)
    db = dst.empty(rank)
    loc = max(db, key=lambda k: db[k].numel())
    w = torch.ones(db[loc].numel(), dtype=db[loc].dtype, requires_grad=True)
    loss = (w * db[loc]).sum()
    t(S.source_buffers(src, values, rank), db)
    try:
        loss.backward()
        errs.append("backward used a target the transfer overwrote without noticing")
    except RuntimeError as exc:
        if "modified by an inplace operation" not in str(exc):
            errs.append(f"unexpected autograd error: {exc}")
    # requires grad: refused on every rank (rank 1's target), accepted under no_grad
    db = dst.empty(rank)
    before = {k: v.clone() for k, v in db.items()}
    if rank == 1:
        db[loc] = db[loc].clone().requires_grad_(True)
        before[loc] = db[loc].detach().clone()
    out = _outcome(lambda: t(S.source_buffers(src, values, rank), db))
    if out[0] != "PreflightError" or set(out[2] or {}) != {1} or "requires grad" not in out[1]:
        errs.append(f"requires_grad target not refused collectively: {out[:2]}")
    errs += [f"refused call wrote {m}" for m in S.mismatches(db, before)]
    with torch.no_grad():
        t(S.source_buffers(src, values, rank), db)
    errs += [f"no_grad: {m}" for m in S.mismatches(db, dst.fill(held, rank))]
    return errs


HOSTILE_KINDS = (
    "list",  # a list where the dict of buffers belongs (a Python type error)
    "schedule",  # building this rank's schedule raises
    "timeout_nan",
    "timeout_neg",
    "timeout_str",
    "timeout_none",
    "timeout_inf",
    "freed",  # a target whose storage was resized to 0 (FSDP frees parameters this way)
    "shrunk",  # a source whose storage is smaller than its view
    "target_alias",  # two target locations' buffers overlap where both are written
    "desc_overflow",  # a descriptor row whose extent overflows int64
)


def _corrupt_schedule(plan, rank):
    """A copy of the plan whose schedule on `rank` has one row with strides near 2**62."""
    import copy

    import numpy as np

    sched = copy.copy(plan.schedule(rank))
    if sched.local:
        lc = sched.local[0]
        d = np.array(lc.desc, copy=True)
        d[0, 1], d[0, 5] = 1 << 62, 3
        sched.local = [type(lc)(lc.src_location, lc.dst_location, d), *sched.local[1:]]
    return sched


class _PlanWith:
    """A plan whose schedule on one rank is replaced (or raises)."""

    def __init__(self, plan, rank, sched=None, error=None):
        self._plan, self._rank, self._sched, self._error = plan, rank, sched, error

    def __getattr__(self, name):
        return getattr(self._plan, name)

    def schedule(self, rank):
        if rank == self._rank:
            if self._error is not None:
                raise self._error
            return self._sched
        return self._plan.schedule(rank)


def w_hostile(rank, world, kinds):
    """For each kind and each bad rank: every rank raises the same PreflightError naming the
    bad rank, at once (the spawn's timeout is far below the transfer's), and no target byte
    changes anywhere. Returns (errors, {(kind, bad): message})."""
    shapes = S.model_shapes()
    values = S.model_values(shapes)
    case = (("zero12", list(range(world))), ("tp", [list(range(world))]), "fp32", "bf16", 64)
    src, dst = build(case, shapes)
    plan = rs.plan(src.layout(), dst.layout(), budget_bytes_per_peer=64)
    errs, msgs = [], {}
    for kind in kinds:
        for bad in range(world):
            sb = S.source_buffers(src, values, rank)
            db = dst.empty(rank)
            before = {k: v.clone() for k, v in db.items()}
            p, timeout = plan, 600.0
            if rank == bad:
                if kind == "list":
                    sb = list(sb.values())
                elif kind == "schedule":
                    p = _PlanWith(plan, rank, error=MemoryError("schedule: injected failure"))
                elif kind.startswith("timeout_"):
                    timeout = {
                        "nan": float("nan"),
                        "neg": -1.0,
                        "str": "60",
                        "none": None,
                        "inf": float("inf"),
                    }[kind[8:]]
                elif kind == "freed":
                    loc = max(db, key=lambda k: db[k].numel())
                    db[loc].untyped_storage().resize_(0)
                    before[loc] = db[loc]
                elif kind == "shrunk":
                    loc = next(iter(sb))
                    view = sb[loc].clone()
                    view.untyped_storage().resize_(view.untyped_storage().nbytes() // 2)
                    sb[loc] = view
                elif kind == "target_alias":  # two targets overlap in one tensor
                    a, b = sorted(db)[:2]
                    n = db[a].numel() + db[b].numel()
                    base = torch.full((n - 1,), S.POISON, dtype=db[a].dtype)
                    db[a] = base[: db[a].numel()]
                    db[b] = base[db[a].numel() - 1 :]
                    before = {k: v.clone() for k, v in db.items()}
                elif kind == "desc_overflow":
                    p = _PlanWith(plan, rank, sched=_corrupt_schedule(plan, rank))
            out = _outcome(
                lambda p=p, sb=sb, db=db, timeout=timeout: rs.execute(p, sb, db, timeout=timeout)
            )
            if out[0] != "PreflightError":
                errs.append(f"{kind} on rank {bad}: rank {rank} got {out[:2]}")
                continue
            if set(out[2]) != {bad} or f"rank {bad}:" not in out[1]:
                errs.append(f"{kind} on rank {bad}: failures {out[2]}: {out[1]}")
            if "exchange failed" in out[1]:
                errs.append(f"{kind} on rank {bad}: not collective: {out[1]}")
            if kind != "freed" or rank != bad:
                errs += [f"{kind}/{bad}: touched {m}" for m in S.mismatches(db, before)]
            msgs[(kind, bad)] = out[1]
    return errs, msgs


def w_late_rank(rank, world, marker_dir, timeout):
    """Ranks other than the last give up in preflight waiting for the last one (it arrives
    only after they raised). The late rank must not write its targets: every rank raises
    PreflightError and every target stays poisoned. Its clock runs behind: it reports having
    entered half a timeout after its peers, as if their waits had not run out, so the rows
    alone cannot tell it they gave up and the commit is what stops it."""
    shapes = S.model_shapes()
    values = S.model_values(shapes)
    r = list(range(world))
    # the late rank has local copies, so a late rank that went on would write at once
    case = (("zero3", r), ("zero3", r), "fp32", "fp32", 64)
    src, dst = build(case, shapes)
    plan = rs.plan(src.layout(), dst.layout(), budget_bytes_per_peer=64)
    late = world - 1
    has_local = bool(plan.schedule(late).local)
    db = dst.empty(rank)
    before = {k: v.clone() for k, v in db.items()}
    entered = os.path.join(marker_dir, f"entered{rank}")

    def call():
        if rank != late:
            with open(entered, "w") as f:
                f.write(str(time.time_ns()))
            return rs.execute(plan, S.source_buffers(src, values, rank), db, timeout=timeout)
        peers = [int(open(os.path.join(marker_dir, f"entered{p}")).read()) for p in range(late)]
        real = time.time_ns
        time.time_ns = lambda: max(peers) + int(timeout * 0.5e9)  # a clock running behind
        try:
            return rs.execute(plan, S.source_buffers(src, values, rank), db, timeout=timeout)
        finally:
            time.time_ns = real

    out = F.arrive_late(rank, world, marker_dir, call)
    return (
        out,
        S.mismatches(db, before),
        has_local,
        _after_the_group_fell_out_of_step(plan, src, dst, values, rank, world, timeout),
    )


def w_mixed_timeouts(rank, world):
    """Rank 0 waits 2 s at most, rank 1 60 s; rank 1 arrives 1 s late, within both. The ranks
    decide whether to commit from the shortest timeout of all, so they take the same branch
    and the call succeeds."""
    shapes = S.model_shapes()
    values = S.model_values(shapes)
    r = list(range(world))
    src, dst = build((("zero3", r), ("zero3", r), "fp32", "fp32", 64), shapes)
    plan = rs.plan(src.layout(), dst.layout(), budget_bytes_per_peer=64)
    timeout = 2.0 if rank == 0 else 60.0
    want = dst.fill({n: v.to(src.dtype).float() for n, v in values.items()}, rank)
    errs = []
    for call in range(2):
        if rank == 1:
            time.sleep(1.0)
        db = dst.empty(rank)
        try:
            rs.execute(plan, S.source_buffers(src, values, rank), db, timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - the parent judges it
            errs.append(f"call {call}: {type(exc).__name__}: {exc}")
            break
        errs += [f"call {call}: {m}" for m in S.mismatches(db, want)]
    return errs


def _after_the_group_fell_out_of_step(plan, src, dst, values, rank, world, timeout):
    """The next call on the group whose collectives were abandoned raises at once, saying to
    rebuild it (touching it again would abort the process); on a rebuilt group the same plan
    moves the right values. Returns what went wrong."""
    errs = []
    db = dst.empty(rank)
    before = {k: v.clone() for k, v in db.items()}
    t0 = time.perf_counter()
    try:
        rs.execute(plan, S.source_buffers(src, values, rank), db, timeout=timeout)
        errs.append("a call on the out-of-step group succeeded")
    except rs.PreflightError as exc:
        if "cannot be used again: rebuild it" not in str(exc):
            errs.append(f"unclear refusal: {exc}")
    if time.perf_counter() - t0 > timeout / 2:
        errs.append("the refusal waited on the group")
    errs += [f"touched {m}" for m in S.mismatches(db, before)]
    fresh = dist.new_group(list(range(world)), backend="gloo")
    db = dst.empty(rank)
    rs.execute(plan, S.source_buffers(src, values, rank), db, group=fresh, timeout=60)
    want = dst.fill({n: v.to(src.dtype).float() for n, v in values.items()}, rank)
    errs += [f"rebuilt group: {m}" for m in S.mismatches(db, want)]
    return errs


def w_padded_target(rank, world):
    """Rank 0 sends two source storages (3 and 4 fp32, each every other element of its
    storage, so no segment is one range of both buffers and the message stays one wire) to
    rank 1's one target storage, laid out [a a a pad b b b b]: one message of two segments
    whose padding between them (message element 3) lines up with the target's padding. The
    target's padding must keep its poison; the message is not a byte image of the target, so
    it must be unpacked."""
    f32 = torch.float32
    src = rs.Layout(
        {
            "a": rs.TensorLayout((3,), [rs.Piece(0, 0, (0,), (3,), (2,))]),
            "b": rs.TensorLayout((4,), [rs.Piece(1, 0, (0,), (4,), (2,))]),
        },
        {0: rs.Storage(0, f32, 6), 1: rs.Storage(0, f32, 8)},
    )
    dst = rs.Layout(
        {"a": rs.flat((3,), [(10, 0, 3, 0)]), "b": rs.flat((4,), [(10, 0, 4, 4)])},
        {10: rs.Storage(1, f32, 8)},
    )
    t = rs.Transfer(src, dst)
    nan = float("nan")
    sb = {
        0: torch.tensor([1.0, nan, 2, nan, 3, nan]),
        1: torch.tensor([4.0, nan, 5, nan, 6, nan, 7, nan]),
    }
    sb = sb if rank == 0 else {}
    segments = [len(m.segments) for msgs in t.plan.schedule(rank).recvs for m in msgs]
    out = []
    for _ in range(3):
        db = {10: torch.full((8,), S.POISON)} if rank == 1 else {}
        t(sb, db)
        if rank == 1:
            out.append(db[10].tolist())
    return out, segments


def w_wire_bytes(rank, world):
    """Two 3-element fp32 tensors on rank 0 into one 6-element storage on rank 1: 24 bytes
    cross, as two wires (each segment is contiguous on both sides); the message's arena
    layout pads each to 16 bytes, and that padding never travels. The Report counts what
    travels, as the plan's pair_bytes does."""
    f32 = torch.float32
    src = rs.Layout(
        {"a": rs.replicated((3,), [0]), "b": rs.replicated((3,), [1])},
        {0: rs.Storage(0, f32, 3), 1: rs.Storage(0, f32, 3)},
    )
    dst = rs.Layout(
        {"a": rs.flat((3,), [(2, 0, 3, 0)]), "b": rs.flat((3,), [(2, 0, 3, 3)])},
        {2: rs.Storage(1, f32, 6)},
    )
    t = rs.Transfer(src, dst)
    sb = {0: torch.arange(3.0), 1: torch.arange(3.0) + 10} if rank == 0 else {}
    db = {2: torch.zeros(6)} if rank == 1 else {}
    rep = t(sb, db)
    want = t.plan.pair_bytes()[(0, 1)]
    got = rep.bytes_sent.get(1, 0) if rank == 0 else rep.bytes_received.get(0, 0)
    errs = [] if got == want == 24 else [f"rank {rank}: report {got} B, plan {want} B, 24 cross"]
    if rank == 1 and db[2].tolist() != [0.0, 1.0, 2.0, 10.0, 11.0, 12.0]:
        errs.append(f"target {db[2].tolist()}")
    return errs


# ---------------------------------------------------------------- hostile input (random)

# Corruptions of one rank's input; "none" must give exactly the reference result.
CORRUPTIONS = (
    "none",
    "none",
    "dtype",
    "meta",
    "short",
    "freed",
    "shrunk",
    "alias_source",
    "alias_targets",
    "requires_grad",
    "list",
    "unknown",
    "missing",
    "none_buffer",
    "not_tensor",
    "two_d",
    "strided",
    "timeout",
    "desc",
    "schedule",
    "notready",
)
_BAD_TIMEOUTS = (0, -3.0, float("nan"), float("inf"), None, "5", True, 10.0**12)


def hostile_case(seed: int, world: int):
    """(src side, dst side, budget, corruption, bad rank, rng) drawn from `seed` alone, so
    every rank draws the same case."""
    import numpy as np

    rng = np.random.default_rng(seed)
    sdt, ddt = FUZZ_DTYPES[int(rng.integers(len(FUZZ_DTYPES)))]
    if rng.random() < 0.3:  # model-like: many target storages per rank (TP buffers)
        shapes = S.model_shapes(
            hidden=int(rng.integers(2, 9)),
            ffn=int(rng.integers(2, 12)),
            vocab=int(rng.integers(2, 12)),
            layers=1,
        )
        ranks = list(range(world))
        kind = [S.Zero3, S.Zero12][int(rng.integers(2))]
        src = kind(shapes, ranks[int(rng.integers(world)) :] or ranks, dtype=DT[sdt], loc0=0)
        dst = S.TensorParallel(
            shapes, [list(rng.permutation(ranks).tolist())], dtype=DT[ddt], loc0=500
        )
    else:
        shapes = S.random_shapes(rng, int(rng.integers(1, 4)))
        src = _random_side(
            rng, ["flat", "replicas", "blocks"][int(rng.integers(3))], shapes, world, sdt, 0
        )
        dst = _random_side(rng, ["flat", "blocks"][int(rng.integers(2))], shapes, world, ddt, 500)
    budget = FUZZ_BUDGETS[int(rng.integers(len(FUZZ_BUDGETS)))]
    kind = CORRUPTIONS[int(rng.integers(len(CORRUPTIONS)))]
    return shapes, src, dst, budget, kind, int(rng.integers(world)), rng


def _corrupt_desc(plan, rank, rng):
    """A copy of `rank`'s schedule with one field of one descriptor row made hostile."""
    import copy

    import numpy as np

    sched = copy.copy(plan.schedule(rank))
    tables = [("local", i) for i in range(len(sched.local))]
    for side in ("sends", "recvs"):
        for k, msgs in enumerate(getattr(sched, side)):
            for j, m in enumerate(msgs):
                tables += [(side, (k, j, i)) for i in range(len(m.segments))]
    if not tables:
        return None
    where, at = tables[int(rng.integers(len(tables)))]
    col = int(rng.integers(6))
    value = [-1, 1 << 62, (1 << 63) - 1, 1 << 40][int(rng.integers(4))]
    if col == 5 and value > 0 and rng.random() < 0.5:
        value = 2  # a second repeat, with the stride the row has
    if where == "local":
        lc = sched.local[at]
        d = np.array(lc.desc, dtype=np.int64, copy=True).reshape(-1, 6)
        d[int(rng.integers(len(d))), col] = value
        sched.local = list(sched.local)
        sched.local[at] = type(lc)(lc.src_location, lc.dst_location, d)
        return sched
    k, j, i = at
    rounds = [list(msgs) for msgs in getattr(sched, where)]
    m = rounds[k][j]
    seg = m.segments[i]
    d = np.array(seg.desc, dtype=np.int64, copy=True).reshape(-1, 6)
    d[int(rng.integers(len(d))), col] = value
    segs = list(m.segments)
    segs[i] = type(seg)(
        seg.src_location, seg.dst_location, seg.wire_dtype, seg.byte_offset, seg.numel, d
    )
    rounds[k][j] = type(m)(m.peer, m.round, m.arena_offset, m.nbytes, segs)
    setattr(sched, where, rounds)
    return sched


def _first_written(plan, rank):
    """{target location: first element this rank's schedule writes there}."""
    from reshard import preflight as pf

    return {
        loc: int(iv[0, 0])
        for loc, iv in pf.written_elements(plan.schedule(rank)).items()
        if iv.shape[0]
    }


def corrupt(kind, plan, sb, db, rank, rng):
    """Apply `kind` to this rank's input (fresh dicts; tensors may be changed in place).
    Returns (plan, src, dst, timeout, checks, applied); applied is False where the rank owns
    nothing the corruption needs: the case is then a clean one."""
    timeout, checks = 60.0, ()
    srcs, dsts = sorted(sb), sorted(db)
    same = (plan, sb, db, timeout, checks, False)
    if kind in (
        "dtype",
        "meta",
        "short",
        "freed",
        "two_d",
        "strided",
        "requires_grad",
        "none_buffer",
        "not_tensor",
        "missing",
    ):
        use_src = bool(srcs) and (not dsts or rng.random() < 0.5) and kind != "requires_grad"
        names = srcs if use_src else dsts
        if not names:
            return same
        bufs = sb if use_src else db
        loc = names[int(rng.integers(len(names)))]
        t = bufs[loc]
        if kind == "dtype":
            bufs[loc] = t.to(torch.float16 if t.dtype != torch.float16 else torch.float32)
        elif kind == "meta":
            bufs[loc] = t.to("meta")
        elif kind == "short":
            bufs[loc] = t[:-1] if t.numel() else torch.zeros(1, dtype=t.dtype)
        elif kind == "freed":
            if not t.numel():
                return same
            t.untyped_storage().resize_(0)
        elif kind == "two_d":
            bufs[loc] = t.reshape(1, -1)
        elif kind == "strided":
            n = max(t.numel(), 2)  # a single element is contiguous at any stride
            bufs[loc] = torch.full((2 * n,), S.POISON, dtype=t.dtype)[::2]
        elif kind == "requires_grad":
            bufs[loc] = t.clone().requires_grad_(True)
        elif kind == "none_buffer":
            bufs[loc] = None
        elif kind == "not_tensor":
            bufs[loc] = t.tolist()
        elif kind == "missing":
            del bufs[loc]
        return plan, sb, db, timeout, checks, True
    if kind == "shrunk":
        live = [loc for loc in srcs if sb[loc].numel()]
        if not live:
            return same
        t = sb[live[int(rng.integers(len(live)))]]
        t.untyped_storage().resize_(t.untyped_storage().nbytes() - t.element_size())
        return plan, sb, db, timeout, checks, True
    if kind == "alias_source":  # a target whose first written element lies in a source
        first = _first_written(plan, rank)
        for d in sorted(first):
            s = next(
                (
                    sb[x]
                    for x in srcs
                    if sb[x].numel() * sb[x].element_size() >= db[d].numel() * db[d].element_size()
                ),
                None,
            )
            if s is not None:
                nbytes = db[d].numel() * db[d].element_size()
                db[d] = s.view(torch.uint8)[:nbytes].view(db[d].dtype)
                return plan, sb, db, timeout, checks, True
        return same
    if kind == "alias_targets":  # two targets placed so that their first writes coincide
        first = _first_written(plan, rank)
        pair = sorted(first)[:2]
        if len(pair) < 2 or db[pair[0]].dtype != db[pair[1]].dtype:
            return same
        (a, ia), (b, ib) = ((x, first[x]) for x in pair)
        oa = max(0, ib - ia)
        ob = oa + ia - ib
        n = max(oa + db[a].numel(), ob + db[b].numel())
        base = torch.full((n,), S.POISON, dtype=db[a].dtype)
        db[a], db[b] = base[oa : oa + db[a].numel()], base[ob : ob + db[b].numel()]
        return plan, sb, db, timeout, checks, True
    if kind == "list":
        return plan, list(sb.values()), db, timeout, checks, True
    if kind == "unknown":
        sb[123456] = torch.zeros(3)
        return plan, sb, db, timeout, checks, True
    if kind == "timeout":
        return plan, sb, db, _BAD_TIMEOUTS[int(rng.integers(len(_BAD_TIMEOUTS)))], checks, True
    if kind == "desc":
        sched = _corrupt_desc(plan, rank, rng)
        if sched is None:
            return same
        return _PlanWith(plan, rank, sched=sched), sb, db, timeout, checks, True
    if kind == "schedule":
        return _PlanWith(plan, rank, error=ValueError("injected")), sb, db, timeout, checks, True
    if kind == "notready":

        def not_ready():
            raise rs.NotReadyError("injected: not ready")

        return plan, sb, db, timeout, (not_ready,), True
    return same


def _inspectable(bufs) -> dict:
    """The CPU tensors of a buffer set whose storage still holds them (a freed one cannot be
    read back), keyed as in the set."""
    items = bufs.items() if isinstance(bufs, dict) else enumerate(bufs)
    out = {}
    for k, v in items:
        if isinstance(v, torch.Tensor) and v.device.type == "cpu" and not v.requires_grad:
            need = (v.storage_offset() + v.numel()) * v.element_size()
            if v.untyped_storage().nbytes() >= need:
                out[k] = v
    return out


def run_hostile_case(seed, rank, world, planner="real"):
    """One random case, corrupted on one rank. Returns (contract violations seen on this
    rank, corruption, (outcome, applied here)). The contract: a refused call writes no target
    byte on any rank and names only the corrupted rank; a corrupted input is refused (a
    corrupted descriptor may instead pass if it still describes legal copies); a clean case
    gives exactly the reference; sources never change; no other error, no crash, no hang."""
    import numpy as np

    shapes, src, dst, budget, kind, bad, _ = hostile_case(seed, world)
    plan = make_plan(planner, src.layout(), dst.layout(), budget)
    values = S.model_values(shapes, seed=seed)
    sb, db = S.source_buffers(src, values, rank), dst.empty(rank)
    p, timeout, checks, applied = plan, 60.0, (), False
    if rank == bad and kind != "none":
        rng = np.random.default_rng([seed, 1])
        p, sb, db, timeout, checks, applied = corrupt(kind, plan, dict(sb), dict(db), rank, rng)
    pre_src = {k: v.clone() for k, v in _inspectable(sb).items()}
    pre_dst = {k: v.clone() for k, v in _inspectable(db).items()}
    label = f"seed {seed} ({kind} on rank {bad})"
    try:
        rs.execute(p, sb, db, timeout=timeout, checks=checks)
        outcome, failures = "ok", None
    except rs.PreflightError as exc:
        outcome, failures = "preflight", exc.failures
    except Exception as exc:  # noqa: BLE001 - a contract violation, reported
        return [f"{label}: {type(exc).__name__}: {exc}"], kind, ("error", applied)
    errs = [f"{label}: source written: {m}" for m in S.mismatches(_inspectable(sb), pre_src)]
    if outcome == "preflight":
        if set(failures) != {bad} or kind == "none":
            errs.append(f"{label}: refused with failures on ranks {sorted(failures)}")
        errs += [
            f"{label}: refused, yet wrote {m}" for m in S.mismatches(_inspectable(db), pre_dst)
        ]
    elif applied and kind != "desc":
        errs.append(f"{label}: corrupted input accepted")
    elif kind != "desc":  # a descriptor corrupted within bounds may move other elements
        held = {n: v.to(src.dtype).float() for n, v in values.items()}
        errs += [f"{label}: {m}" for m in S.mismatches(db, dst.fill(held, rank))]
    return errs, kind, (outcome, applied)


def w_hostile_random(rank, world, seeds):
    errs, seen = [], []
    for seed in seeds:
        e, kind, outcome = run_hostile_case(seed, rank, world)
        errs += e
        seen.append((kind, outcome))
    return errs, seen
