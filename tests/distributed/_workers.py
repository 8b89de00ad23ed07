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

import _refplan  # noqa: E402
import _scenarios as S  # noqa: E402

import reshard as rs  # noqa: E402

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
        ptrs.append(tuple(a.data_ptr() for v in t._engine.arenas.values() for a in v))
        if i in (9, n - 1):
            rss.append(proc.memory_info().rss)
    return errs, rss, allocs, len(set(ptrs)), rep.rounds


PREFLIGHT_KINDS = (
    "dtype",
    "short",
    "foreign",
    "missing",
    "alias",
    "fingerprint",
    "notready",
    "oom",
    "device",
)


def w_preflight(rank, world, planner, kinds):
    """For each kind and each failing rank: every rank must raise the same PreflightError
    naming the failing rank, and no target byte may change anywhere."""
    import reshard.executor as ex

    real_alloc = ex._Engine._alloc
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
            before = {k: t.clone() for k, t in db.items()}
            p, checks = plan, ()
            if rank == bad:
                sloc = next(iter(sb))
                if kind == "dtype":
                    sb[sloc] = sb[sloc].to(torch.float16)
                elif kind == "short":
                    sb[sloc] = sb[sloc][:-1]
                elif kind == "foreign":  # a location owned by the next rank
                    peer = (rank + 1) % world
                    loc = next(loc for loc, s in src.storages.items() if s.rank == peer)
                    sb[loc] = torch.zeros(src.storages[loc].numel)
                elif kind == "missing":
                    del sb[sloc]
                elif kind == "alias":  # the largest target is a view of a source's memory
                    dloc = max(db, key=lambda k: db[k].numel())
                    db[dloc] = sb[sloc].view(torch.bfloat16)[: db[dloc].numel()]
                    before[dloc] = db[dloc].clone()
                elif kind == "fingerprint":
                    p = other
                elif kind == "notready":

                    def not_ready():
                        raise rs.NotReadyError("exp_avg does not exist before the first step")

                    checks = (not_ready,)
                elif kind == "oom":  # the staging allocation fails on this rank only

                    def no_memory(self, nbytes, pinned):
                        raise torch.OutOfMemoryError(f"cannot allocate {nbytes} bytes (injected)")

                    ex._Engine._alloc = no_memory
                elif kind == "device":  # a buffer on a device the gloo transport cannot use
                    sb[sloc] = sb[sloc].to("meta")
            try:
                rs.execute(p, sb, db, checks=checks)
                errs.append(f"{kind} on rank {bad}: no PreflightError on rank {rank}")
                continue
            except rs.PreflightError as exc:
                msg, failures = str(exc), exc.failures
            finally:
                ex._Engine._alloc = real_alloc
            if f"rank {bad}:" not in msg:
                errs.append(f"{kind} on rank {bad}: message does not name it: {msg}")
            if kind != "fingerprint" and set(failures) != {bad}:
                errs.append(f"{kind} on rank {bad}: failures {failures}")
            errs += [f"{kind}/{bad}: touched {m}" for m in S.mismatches(db, before)]
            msgs.append((kind, bad, msg))
    return errs, msgs


def w_killed(rank, world, planner, victim, mode, timeout):
    """`victim` dies (or stalls) in the middle of the rounds; the others must raise
    TransferError within the timeout."""
    import reshard.executor as ex
    from tests._spawn import die

    shapes = S.model_shapes()
    values = S.model_values(shapes)
    case = (("zero3", list(range(world))), ("tp", [list(range(world))]), "fp32", "fp32", 16)
    src, dst = build(case, shapes)
    plan = make_plan(planner, src.layout(), dst.layout(), 16)
    checks = ()
    if rank == victim and mode == "die_in_preflight":
        checks = (die,)  # dies inside the local checks, before the collective exchange
    elif rank == victim:
        real = ex._copy_runs_op()
        calls = [0]

        def dying(s, d, o):
            calls[0] += 1
            if calls[0] == 5:
                if mode == "die":
                    die()
                time.sleep(timeout * 2)
            return real(s, d, o)

        ex._copy_runs_op = lambda: dying
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


def expected_zero_copy(plan, rank, src_dtype, dst_dtype):
    """(zero-copy bytes this rank should report, messages that are one contiguous range,
    messages that are not but partly are (consecutive elements somewhere, or a segment that
    alone is one range), messages):
    what the executor's zero-copy rule means, computed element by element from the schedule."""
    import numpy as np

    sched = plan.schedule(rank)
    nbytes = direct = partly = total = 0
    for side, rounds, dt in (("send", sched.sends, src_dtype), ("recv", sched.recvs, dst_dtype)):
        for msgs in rounds:
            for m in msgs:
                total += 1
                image = _message_image(m, side, lambda loc, dt=dt: dt)
                if _is_one_range(image):
                    nbytes += m.nbytes
                    direct += 1
                elif image is not None and (image >= 0).all() and (np.diff(image) == 1).any():
                    partly += 1  # consecutive elements somewhere, but not one range
                elif any(_is_one_range(_segment_image(seg, side, dt)) for seg in m.segments):
                    partly += 1  # one of several storages' segments is one range alone
    return nbytes, direct, partly, total


def w_zero_copy(rank, world, planner, cases, calls):
    """Each case through one Transfer, `calls` times with fresh buffers and values: targets
    bitwise equal to the reference (poisoned padding intact), sources unchanged, and
    Report.zero_copy_bytes equal to the element-by-element expectation. Returns per case
    (errors, zero-copy bytes, direct messages, partly contiguous messages, messages, host
    staging held, host staging bound, rounds)."""
    shapes = S.model_shapes()
    out = []
    for case in cases:
        src, dst = build(case, shapes)
        budget = case[4]
        t = make_transfer(planner, src.layout(), dst.layout(), budget)
        want, direct, partly, total = expected_zero_copy(t.plan, rank, src.dtype, dst.dtype)
        errs = []
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
            )
        )
    return out
