"""Faults that one rank alone sees, and ranks that call different things on one group, on
real spawned gloo ranks: every rank raises the same PreflightError at once (never after
waiting out the timeout), nothing is written, and the group stays usable where it can.

- planning that fails on one rank (its layout differs from its peers'): `rs.Transfer(...)`
  raises LayoutError there; `rs.Transfer.refusing(exc)` joins the peers' call with it. A bad
  layout every rank shares still raises LayoutError at construction on every rank;
- a rank that enters after its peers' waits ran out, with a longer timeout of its own: it
  refuses at once instead of waiting out its timeout for a commit that cannot come;
- a KeyboardInterrupt / SystemExit in one rank's readiness hook or `checks=`: a reason like any
  other (raised again on that rank after the exchange); the next call is correct;
- an interrupt in the middle of the exchange, or after the agreement before the rounds: that
  rank's group is marked out of step, so its next call refuses at once instead of pairing
  with a stale collective;
- a Transfer on one rank against rs.execute of another plan, a Stream, or a refusing Transfer;
- the same tensors passed as sources and targets.
"""

from __future__ import annotations

import builtins
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _faults as F  # noqa: E402
import _workers_ranks as W  # noqa: E402
import pytest  # noqa: E402

import reshard as rs  # noqa: E402
from tests._spawn import run_ranks  # noqa: E402

PROMPT_S = 20.0  # a refusal reaches every rank well within this (the transfers wait 120 s)


def test_a_plan_failing_on_one_rank_refuses_on_every_rank(tmp_path):
    res = run_ranks(W.w_plan_fails, 3, tmp_path, args=({1},), timeout=240)
    built = [r[0][0] for r in res]
    assert built[0] is None and built[2] is None, built
    assert "target tensor" in built[1] and "has no source" in built[1], built
    for call in (1, 2):
        outcomes = [r[0][call] for r in res]
        assert {o[0] for o in outcomes} == {"PreflightError"}, outcomes
        assert len({o[1] for o in outcomes}) == 1, outcomes  # the same message everywhere
        msg = outcomes[0][1]
        assert "preflight failed on 1 of 3 ranks (1)" in msg, msg
        assert "rank 1: LayoutError: target tensor" in msg, msg
        assert "rank 1: its described state: " in msg and "no optimizer state" in msg, msg
        assert all(o[2] < PROMPT_S for o in outcomes), outcomes
        assert not any(o[3] for o in outcomes), "a target was written"
    assert all(r[1] == [] for r in res), [r[1] for r in res]  # the group is still usable


def test_a_bad_layout_every_rank_shares_raises_at_construction(tmp_path):
    res = run_ranks(W.w_plan_fails, 2, tmp_path, args=({0, 1},), timeout=240)
    built = [r[0][0] for r in res]
    assert built[0] is not None and built[0] == built[1], built  # LayoutError, at construction
    for call in (1, 2):  # Transfer.refusing on every rank: every rank named, promptly
        outcomes = [r[0][call] for r in res]
        assert {o[0] for o in outcomes} == {"PreflightError"}, outcomes
        assert outcomes[0][1] == outcomes[1][1], outcomes
        assert "preflight failed on 2 of 2 ranks (0, 1)" in outcomes[0][1], outcomes
        assert all(o[2] < PROMPT_S and not o[3] for o in outcomes), outcomes
    assert all(r[1] == [] for r in res), [r[1] for r in res]


@pytest.mark.parametrize("raiser", ["KeyboardInterrupt", "SystemExit"])
def test_an_interrupt_in_one_ranks_hook_refuses_on_every_rank(tmp_path, raiser):
    res = run_ranks(W.w_interrupted_hook, 2, tmp_path, args=(raiser,), timeout=240)
    for call in (0, 1):  # the hook (.check), then checks=
        (k0, m0, s0, _), (k1, m1, s1, _) = res[0][call], res[1][call]
        assert (k0, k1) == ("PreflightError", raiser), (res[0][call], res[1][call])
        assert f"rank 1: {raiser} on this rank during its preflight" in m0, m0
        assert "interrupted in a readiness hook" in m1, m1
        assert s0 < PROMPT_S and s1 < PROMPT_S, (s0, s1)
    for rank in (0, 1):
        assert res[rank][0][3] and res[rank][1][3], "a refused call wrote its targets"
        assert res[rank][2][:1] == ("ok",) and res[rank][2][3] == [], res[rank][2]


def test_an_interrupt_in_the_exchange_marks_that_ranks_group(tmp_path):
    timeout = 3.0
    res = run_ranks(W.w_interrupted_exchange, 2, tmp_path, args=(timeout,), timeout=180)
    (first0, again0), (first1, again1) = res
    assert first1[0] == "KeyboardInterrupt", first1
    assert first0[0] == "PreflightError" and "exchange failed" in first0[1], first0
    for again in (again0, again1):  # refused at once, without touching the group
        assert again[0] == "PreflightError" and "cannot be used again" in again[1], again
        assert again[2] < 1.0, again
    assert not any(o[3] for o in (first0, again0, first1, again1)), res


def _interrupted_after_agreement(rank, world, raiser, where, timeout):
    """Rank 1 is interrupted after the call's agreement, before its rounds; then each rank
    calls again. [(outcome, message, seconds, whether a target byte changed)] per call."""
    src, dst, values = W._sides(world)
    sync = rs.Transfer(src.layout(), dst.layout(), 64, timeout=timeout)
    sb = W.S.source_buffers(src, values, rank)
    if rank == 1:
        F.interrupt_after_agreement(getattr(builtins, raiser), where.split(",")[0])
    out = []
    for _ in range(2):
        db = dst.empty(rank)
        if where.endswith("in a handler"):  # the caller handles an earlier call's refusal
            try:
                raise rs.PreflightError("an earlier call was refused", {})
            except rs.PreflightError:
                out.append(W._outcome(lambda db=db: sync(sb, db), db))
        else:
            out.append(W._outcome(lambda db=db: sync(sb, db), db))
    return out


@pytest.mark.parametrize("where", ["preflight", "report", "preflight, in a handler"])
@pytest.mark.parametrize("raiser", ["KeyboardInterrupt", "SystemExit"])
def test_an_interrupt_after_the_agreement_marks_that_ranks_group(tmp_path, raiser, where):
    """Its peers go on to the rounds and fail within their timeout (TransferError); the
    interrupted rank's next call refuses at once (it was a call into the exchange that no
    peer joins: a wait of the whole timeout, then an exchange failure)."""
    timeout = 3.0
    args = (raiser, where, timeout)
    res = run_ranks(_interrupted_after_agreement, 2, tmp_path, args=args, timeout=180)
    (first0, again0), (first1, again1) = res
    assert first1[0] == raiser and "after the agreement" in first1[1], first1
    assert first0[0] == "TransferError" and first0[2] < timeout * 4, first0
    for again in (again0, again1):  # refused at once, without touching the group
        assert again[0] == "PreflightError" and "cannot be used again" in again[1], again
        assert again[2] < 1.0, again
    assert "rank 1" in again1[1] and raiser in again1[1], again1
    assert not any(o[3] for o in (first1, again0, again1)), res


def test_ranks_calling_different_things_on_one_group(tmp_path):
    res = run_ranks(W.w_mixed_calls, 2, tmp_path, timeout=240)
    for what in ("execute", "stream", "refusing"):
        (k0, m0, t0, _), (k1, m1, t1, _) = res[0][what], res[1][what]
        assert k0 == k1 == "PreflightError" and m0 == m1, (what, res[0][what], res[1][what])
        assert "rank 1:" in m0 and not (t0 or t1), (what, m0)
    assert "no Transfer here" in res[0]["refusing"][1]
    for rank in (0, 1):  # the group is still in step: the next call pairs and is correct
        assert res[rank]["same"][0] == "ok" and res[rank]["same"][3] == [], res[rank]["same"]


def test_sources_passed_as_targets_are_refused_and_never_written(tmp_path):
    res = run_ranks(W.w_source_as_target, 2, tmp_path, timeout=240)
    for local, remote in res:
        assert local[0] == "PreflightError" and "shares memory with source" in local[1], local
        assert remote[0] == "PreflightError" and "sources are never written" in remote[1], remote
        assert local[2] == [] and remote[2] == [], (local[2], remote[2])
    assert res[0][0][1] == res[1][0][1] and res[0][1][1] == res[1][1][1]


def test_fsdp2_state_lost_on_one_rank_refuses_on_every_rank(tmp_path):
    res = run_ranks(W.w_fsdp_state_lost, 2, tmp_path, timeout=300)
    (built0, refusal0, wrong0), (built1, refusal1, wrong1) = res
    assert built0 is None and "target tensor 'fc2.weight' has no source" in built1, res
    assert refusal0[0] == refusal1[0] == "PreflightError" and refusal0[1] == refusal1[1], res
    msg = refusal0[1]
    assert "preflight failed on 1 of 2 ranks (1)" in msg, msg
    assert "rank 1: LayoutError: target tensor 'fc2.weight' has no source" in msg, msg
    assert "rank 1: its described state: " in msg and "left out" in msg, msg
    assert refusal0[2] < PROMPT_S and refusal1[2] < PROMPT_S, (refusal0, refusal1)
    assert refusal0[3] and refusal1[3], "a refused sync wrote a target"
    assert wrong0 == [] and wrong1 == [], (wrong0, wrong1)


def test_a_late_rank_with_a_longer_timeout_refuses_at_once(tmp_path):
    markers = tmp_path / "markers"
    markers.mkdir()
    res = run_ranks(W.w_late_with_a_longer_timeout, 2, tmp_path, args=(str(markers),), timeout=300)
    (early, _, touched0), (late, secs, touched1) = res
    assert early[0] == "PreflightError" and "exchange failed" in early[1], early
    assert late[0] == "PreflightError" and "rank 0 gave up on this call" in late[1], late
    assert "nothing was written" in late[1] and "rebuild it" in late[1], late
    assert secs < PROMPT_S, f"the late rank waited {secs:.1f} s (its timeout: {W.TIMEOUT} s)"
    assert not touched0 and not touched1


def test_calls_of_one_plan_moving_different_states_do_not_pair_up(tmp_path):
    res = run_ranks(W.w_calls_out_of_order, 2, tmp_path, timeout=240)
    (avg0, sq0), (sq1, again1) = res
    assert avg0[0] == sq1[0] == "PreflightError" and avg0[1] == sq1[1], (avg0, sq1)
    assert "its source buffers hold 'exp_avg_sq' state, rank 0's hold 'exp_avg'" in avg0[1]
    assert not avg0[2] and not sq1[2], "a refused call wrote its targets"
    assert sq0[0] == again1[0] == "ok" and sq0[2] == again1[2] == [], (sq0, again1)
