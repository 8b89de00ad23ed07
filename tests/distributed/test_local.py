"""In-process pieces of the executor: no process group (all storages on rank 0), the
preflight's interval arithmetic against brute force, the buffer-set hook API."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _refplan  # noqa: E402
import _scenarios as S  # noqa: E402

import reshard as rs  # noqa: E402
from reshard import preflight as pf  # noqa: E402
from reshard.layout.intervals import first_overlap, merge  # noqa: E402


def _one_rank_case(budget=64):
    shapes = S.model_shapes()
    values = S.model_values(shapes)
    src = S.Zero12(shapes, [0], dtype=torch.float32, loc0=0)
    dst = S.TensorParallel(shapes, [[0]], dtype=torch.bfloat16, loc0=100)
    return shapes, values, src, dst


@pytest.mark.parametrize("planner", ["real", "ref"])
def test_in_process_execution_without_a_group(planner):
    _, values, src, dst = _one_rank_case()
    if planner == "ref":
        plan = _refplan.RefPlan(src.layout(), dst.layout(), 64)
    else:
        plan = rs.plan(src.layout(), dst.layout(), budget_bytes_per_peer=64)
    db = dst.empty(0)
    rep = rs.execute(plan, S.source_buffers(src, values, 0), db)
    assert not S.mismatches(db, dst.fill(values, 0))
    assert rep.transport == "local" and rep.rounds == 0
    assert rep.bytes_sent == {} and rep.local_bytes == sum(t.numel() * 2 for t in db.values())
    assert rep.peak_staging_bytes == {"device": 0, "host_pinned": 0, "host": 0}
    assert set(rep.seconds) >= {"plan", "preflight", "pack", "h2d", "transport", "d2h", "unpack"}


def test_transfer_reuses_and_reports_plan_time_once():
    _, values, src, dst = _one_rank_case()
    sync = rs.Transfer(src.layout(), dst.layout(), budget_bytes_per_peer=64)
    sb = S.source_buffers(src, values, 0)
    reps = []
    for _ in range(3):
        db = dst.empty(0)
        reps.append(sync(sb, db))
        assert not S.mismatches(db, dst.fill(values, 0))
    assert reps[0].seconds["plan"] > 0 and reps[1].seconds["plan"] == 0.0
    assert reps[0].fingerprint == sync.plan.fingerprint


def test_local_preflight_reasons_and_nothing_written():
    _, values, src, dst = _one_rank_case()
    plan = rs.plan(src.layout(), dst.layout())
    sb = S.source_buffers(src, values, 0)
    db = dst.empty(0)
    before = {k: v.clone() for k, v in db.items()}
    bad_src = dict(sb)
    bad_src[0] = sb[0].reshape(1, -1)  # 2-D
    bad_src[77] = torch.zeros(3)  # unknown location
    bad_dst = dict(db)
    first = next(iter(bad_dst))
    bad_dst[first] = torch.zeros(2 * db[first].numel(), dtype=torch.bfloat16)[::2]  # strided
    with pytest.raises(rs.PreflightError) as ei:
        rs.execute(plan, bad_src, bad_dst)
    msg = str(ei.value)
    assert "source location 0: must be 1-D, got shape (1, " in msg
    assert "source location 77 does not exist in the source layout" in msg
    assert f"target location {first}: must be 1-D" not in msg
    assert f"target location {first}: must be contiguous" in msg
    assert ei.value.failures.keys() == {0}
    assert not S.mismatches(db, before)


def test_buffer_set_hooks():
    _, values, src, dst = _one_rank_case()
    plan = rs.plan(src.layout(), dst.layout())

    class Live:  # what an integration hands over: .buffers and a readiness .check()
        def __init__(self, buffers, ready):
            self.buffers, self.ready = buffers, ready

        def check(self):
            if not self.ready:
                raise rs.NotReadyError("exp_avg_sq does not exist before the first step")

    db = dst.empty(0)
    with pytest.raises(rs.PreflightError, match="NotReadyError: exp_avg_sq does not exist"):
        rs.execute(plan, Live(S.source_buffers(src, values, 0), False), db)
    rs.execute(plan, Live(S.source_buffers(src, values, 0), True), db)
    assert not S.mismatches(db, dst.fill(values, 0))
    # a type error in the arguments is a preflight reason like any other (collective)
    with pytest.raises(rs.PreflightError, match="rank 0: TypeError: src_buffers must be a mapping"):
        rs.execute(plan, [1, 2], db)


def test_a_refusing_transfer_refuses_every_call_and_writes_nothing():
    _, values, src, dst = _one_rank_case()
    with pytest.raises(rs.LayoutError) as caught:  # every target tensor lacks a source
        rs.Transfer(rs.Layout({}, dict(src.layout().storages)), dst.layout())
    sync = rs.Transfer.refusing(caught.value)
    assert sync.plan is None
    db = dst.empty(0)
    before = {k: v.clone() for k, v in db.items()}

    class Noted:  # a describe() result: how this rank's state shaped its layout
        buffers = S.source_buffers(src, values, 0)
        notes = ["'w' left out: no optimizer state for it on this rank"]

    why = f"LayoutError: {caught.value}"
    for call, failures in (
        (lambda: sync(Noted(), db), [why, "its described state: " + Noted.notes[0]]),
        (lambda: sync({}, db), [why]),
        (lambda: sync.refuse(["and this"]), [why, "and this"]),
    ):
        with pytest.raises(rs.PreflightError) as exc:
            call()
        assert exc.value.failures == {0: failures}
    assert not S.mismatches(db, before)
    for bad in (None, 3, [1]):
        with pytest.raises(TypeError, match="Transfer.refusing"):
            rs.Transfer.refusing(bad)
    with pytest.raises(ValueError, match="timeout"):
        rs.Transfer.refusing("x", timeout=0)


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
def test_an_interrupt_in_a_hook_is_raised_after_the_preflight(interrupt):
    _, values, src, dst = _one_rank_case()
    sync = rs.Transfer(src.layout(), dst.layout())

    def hook():
        raise interrupt("stop")

    db = dst.empty(0)
    with pytest.raises(interrupt, match="stop") as caught:
        sync(S.source_buffers(src, values, 0), db, checks=(hook,))
    refusal = caught.value.__context__
    assert isinstance(refusal, rs.PreflightError), refusal
    assert refusal.failures == {
        0: [f"{interrupt.__name__} on this rank during its preflight: stop"]
    }
    assert not S.mismatches(db, dst.empty(0))
    sync(S.source_buffers(src, values, 0), db)  # the next call runs normally
    assert not S.mismatches(db, dst.fill(values, 0))


def test_group_too_small_for_the_layout():
    shapes = {"w": (5, 3)}
    src = S.Zero3(shapes, [0, 1])
    dst = S.Zero3(shapes, [0], loc0=10)
    plan = rs.plan(src.layout(), dst.layout())
    with pytest.raises(rs.PreflightError, match="belongs to rank 1, but the group has only 1"):
        rs.execute(plan, S.source_buffers(src, S.model_values(shapes), 0), dst.empty(0))


# ------------------------------------------------------------- interval arithmetic


def _brute_cover(desc, off_col, stride_col):
    cells = set()
    for row in desc:
        for c in range(row[5]):
            start = row[off_col] + c * row[stride_col]
            cells.update(range(start, start + row[4]))
    return cells


rows = st.lists(
    st.tuples(*[st.integers(0, 40)] * 4, st.integers(0, 5), st.integers(0, 4)), max_size=6
)


@settings(max_examples=200, deadline=None)
@given(rows, rows)
def test_written_intervals_match_brute_force(a, b):
    da = np.array(a, np.int64).reshape(-1, 6)
    db = np.array(b, np.int64).reshape(-1, 6)
    ia = merge(pf._expand_runs(da, 2, 3))
    ib = merge(pf._expand_runs(db, 2, 3))
    ca, cb = _brute_cover(da, 2, 3), _brute_cover(db, 2, 3)
    assert {x for lo, hi in ia.tolist() for x in range(lo, hi)} == ca
    assert all(ia[i, 1] < ia[i + 1, 0] for i in range(len(ia) - 1)), "not merged"
    hit = first_overlap(ia, ib)
    assert (hit is not None) == bool(ca & cb)
    if hit is not None:
        assert set(range(*hit)) <= ca & cb and hit[0] < hit[1]


# ------------------------------------------------------------- the plan as the executor reads it


def _apply(src, desc, dst):
    for so, ss, do, ds, ln, cnt in np.asarray(desc).reshape(-1, 6).tolist():
        for c in range(cnt):
            dst[do + c * ds : do + c * ds + ln] = src[so + c * ss : so + c * ss + ln].to(dst.dtype)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("src_kind", ["zero3", "zero12"])
def test_real_schedule_simulated_matches_reference(world, src_kind):
    """Run reshard.plan's schedules with a slow, obviously-correct interpreter (no executor, no
    transport): if this fails and the executor tests fail the same way, the bug is the plan's."""
    shapes = S.model_shapes(hidden=6, ffn=10, vocab=7, layers=1)
    values = S.model_values(shapes)
    ranks = list(range(world))
    src = (S.Zero3 if src_kind == "zero3" else S.Zero12)(shapes, ranks, dtype=torch.float32)
    dst = S.TensorParallel(shapes, [ranks[:2]], dtype=torch.float32, loc0=100)
    plan = rs.plan(src.layout(), dst.layout(), budget_bytes_per_peer=64)
    sbuf = {k: v for r in ranks for k, v in S.source_buffers(src, values, r).items()}
    tbuf = {k: v for r in ranks for k, v in dst.empty(r).items()}
    for r in ranks:
        sc = plan.schedule(r)
        for lc in sc.local:
            _apply(sbuf[lc.src_location], lc.desc, tbuf[lc.dst_location])
        for k in range(sc.num_rounds):
            for m in sc.sends[k]:
                (rm,) = [x for x in plan.schedule(m.peer).recvs[k] if x.peer == r]
                assert rm.nbytes == m.nbytes and len(rm.segments) == len(m.segments)
                for s1, s2 in zip(m.segments, rm.segments, strict=True):
                    wire = torch.empty(s1.numel, dtype=s1.wire_dtype)
                    _apply(sbuf[s1.src_location], s1.desc, wire)
                    _apply(wire, s2.desc, tbuf[s2.dst_location])
    want = {k: v for r in ranks for k, v in dst.fill(values, r).items()}
    bad = S.mismatches(tbuf, want)
    assert not bad, "reshard.plan's schedule is wrong:\n" + "\n".join(bad)


views = st.lists(st.tuples(st.integers(0, 60), st.integers(1, 20), st.booleans()), max_size=8)


@settings(max_examples=200, deadline=None)
@given(views)
def test_buffer_overlap_screen_matches_brute_force(spec):
    base = torch.zeros(100)
    src, dst, ext = {}, {}, []
    for i, (off, n, is_dst) in enumerate(spec):
        (dst if is_dst else src)[i] = base[off : off + n]
        ext.append((off, off + n, is_dst))
    brute = any(
        a[2] or b[2]
        for i, a in enumerate(ext)
        for b in ext[i + 1 :]
        if a[0] < b[1] and b[0] < a[1] and (a[2] or b[2])
    )
    assert pf._any_overlap(src, dst) == brute


def test_one_info_line_per_transfer(caplog):
    _, values, src, dst = _one_rank_case()
    plan = rs.plan(src.layout(), dst.layout())
    with caplog.at_level("DEBUG", logger="reshard"):
        rs.execute(plan, S.source_buffers(src, values, 0), dst.empty(0))
    infos = [r for r in caplog.records if r.levelname == "INFO" and r.name == "reshard"]
    assert len(infos) == 1 and "GB/s" in infos[0].getMessage()
