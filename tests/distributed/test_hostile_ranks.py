"""Hostile input on real spawned gloo ranks: each class of bad input or bad timing is refused
the same way on every rank, before anything is written, or gives exactly the reference result.

Concurrent calls from two threads per rank, the autograd view of the writes (version counters,
targets that require grad), non-collective failures (a Python type error, a schedule that
cannot be built, a bad timeout), storages smaller than their views, targets that alias each
other, a descriptor row that overflows int64, a rank that arrives after its peers gave up,
a target in read-only memory on one rank, and a multi-segment message landing in a padded
target.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _faults as F  # noqa: E402
import _scenarios as S  # noqa: E402
import _workers as W  # noqa: E402
import _workers_ranks as R  # noqa: E402

from tests._spawn import run_ranks  # noqa: E402


def test_concurrent_calls_on_one_transfer_are_serialized(tmp_path):
    res = run_ranks(W.w_threads, 2, tmp_path, args=(6,), timeout=240)
    errs = [e for r in res for e in r]
    assert not errs, "\n".join(errs[:10])


def test_concurrent_transfers_on_one_group_never_interleave(tmp_path):
    res = run_ranks(W.w_threads_two_transfers, 2, tmp_path, args=(4,), timeout=240)
    errs = [e for r, _ in res for e in r]
    assert not errs, "\n".join(errs[:10])
    assert all(len(outcomes) == 8 for _, outcomes in res)


def test_writes_move_version_counters_and_grad_targets_are_refused(tmp_path):
    res = run_ranks(W.w_versions, 2, tmp_path, timeout=240)
    errs = [e for r in res for e in r]
    assert not errs, "\n".join(map(str, errs[:10]))


def test_non_collective_failures_become_collective(tmp_path):
    """Every failure before the first write reaches every rank as the same PreflightError
    naming the bad rank and the reason, without waiting for the transfer's timeout (600 s,
    far beyond the spawn's limit)."""
    world = 3
    res = run_ranks(W.w_hostile, world, tmp_path, args=(W.HOSTILE_KINDS,), timeout=240)
    errs = [e for r, _ in res for e in r]
    assert not errs, "\n".join(map(str, errs[:10]))
    msgs = [m for _, m in res]
    assert len(msgs[0]) == len(W.HOSTILE_KINDS) * world
    for key, msg in msgs[0].items():
        assert all(other[key] == msg for other in msgs[1:]), key
    m = {k: v for (k, b), v in msgs[0].items() if b == 1}
    assert "TypeError: src_buffers must be a mapping" in m["list"]
    assert "MemoryError: schedule: injected failure" in m["schedule"]
    assert "timeout must be a finite number of seconds > 0, got nan" in m["timeout_nan"]
    assert "timeout must be a finite number of seconds > 0, got -1.0" in m["timeout_neg"]
    assert "timeout must be a finite number of seconds > 0, got inf" in m["timeout_inf"]
    assert (
        "TypeError: timeout must be a number of seconds (a Python int or float: float(x) for a numpy scalar), got str '60'"
        in m["timeout_str"]
    )
    assert (
        "TypeError: timeout must be a number of seconds (a Python int or float: float(x) for a numpy scalar), got NoneType"
        in m["timeout_none"]
    )
    assert "its storage is freed" in m["freed"]
    assert "fewer than the" in m["shrunk"] and "source location" in m["shrunk"]
    assert "alias: both would write the same bytes" in m["target_alias"]
    assert "overflows int64 or reaches outside" in m["desc_overflow"]


def test_a_read_only_target_on_one_rank_is_refused_on_every_rank(tmp_path):
    """Rank 1's target is a memmap opened read-only: rank 1 would die of a segfault mid-copy
    (and rank 0 wait on it); both raise the same PreflightError naming rank 1 and the
    location, nothing is written, and the group stays usable."""
    res = run_ranks(R.w_read_only_target, 2, tmp_path, args=(str(tmp_path),), timeout=240)
    kind, msg, _, loc, _ = res[0]
    assert [r[:3] for r in res] == [("PreflightError", msg, False)] * 2, res
    assert "preflight failed on 1 of 2 ranks (1)" in msg, msg
    assert f"rank 1: target location {loc}: byte 0 of it is not writable (read-only" in msg, msg
    assert [r[4] for r in res] == [[], []]


def test_a_rank_arriving_after_its_peers_gave_up_writes_nothing(tmp_path):
    world, timeout = 3, 2.0
    marker_dir = tmp_path / "markers"
    marker_dir.mkdir()
    res = run_ranks(
        W.w_late_rank,
        world,
        tmp_path,
        args=(str(marker_dir), timeout),
        timeout=180,
        group_timeout=60,
    )
    F.assert_late_rank_wrote_nothing(res)


def test_ranks_with_different_timeouts_take_the_same_branch(tmp_path):
    for errs in run_ranks(W.w_mixed_timeouts, 2, tmp_path, timeout=120):
        assert errs == []


def test_reported_bytes_are_the_bytes_that_travel(tmp_path):
    for errs in run_ranks(W.w_wire_bytes, 2, tmp_path, timeout=120):
        assert errs == []


def test_multi_segment_message_into_a_padded_target(tmp_path):
    res = run_ranks(W.w_padded_target, 2, tmp_path, timeout=120)
    got, segments = res[1]
    assert segments == [2], segments  # one message of two segments reaches rank 1
    want = [1.0, 2.0, 3.0, S.POISON, 4.0, 5.0, 6.0, 7.0]
    assert got == [want] * 3, got


def test_random_hostile_input_on_three_ranks(tmp_path):
    """Random layouts with one corruption on one rank (tests/distributed/_workers.py
    CORRUPTIONS): refused on every rank naming that rank with nothing written anywhere, or
    (clean) exactly the reference."""
    seeds = list(range(1000, 1090))
    res = run_ranks(W.w_hostile_random, 3, tmp_path, args=(seeds,), timeout=300)
    errs = [e for r, _ in res for e in r]
    assert not errs, "\n".join(errs[:10])
    refused = {kind for r, seen in res for kind, (outcome, applied) in seen if applied}
    assert len(refused) >= len(W.CORRUPTIONS) // 2, sorted(refused)
