"""Repeated calls of one Transfer: a call whose buffers sit where the last passing call's did
skips the placement checks (aliasing, local copy extents, staging) but still checks every
buffer, the grad mode and the readiness hooks, and still fails on every rank alike. A rank
that arrives after its peers gave up on a repeated call writes nothing.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _faults as F  # noqa: E402
import _workers_repeat as W  # noqa: E402

from tests._spawn import run_ranks  # noqa: E402


def _check(res):
    errs = [e for r, _ in res for e in r]
    assert not errs, "\n".join(errs[:10])
    seen = [s for _, s in res]
    assert len(seen[0]) == 2 * len(W.CORRUPTIONS) + 1
    for calls in seen[1:]:  # the same outcome and message on every rank, call by call
        assert calls == seen[0]


def test_repeated_calls_recheck_every_buffer_in_process():
    errs, seen = W.run_repeated(0, 1)
    assert not errs, "\n".join(errs[:10])
    assert [kind for kind, _, outcome, *_ in seen if outcome == "PreflightError"] == list(
        W.CORRUPTIONS
    )


def test_repeated_calls_recheck_every_buffer_on_two_ranks(tmp_path):
    _check(run_ranks(W.w_repeated, 2, tmp_path, timeout=240))


def test_a_late_rank_on_a_repeated_call_writes_nothing(tmp_path):
    marker_dir = tmp_path / "markers"
    marker_dir.mkdir()
    res = run_ranks(
        W.w_late_rank_on_a_repeated_call,
        3,
        tmp_path,
        args=(str(marker_dir), 2.0),
        timeout=180,
        group_timeout=60,
    )
    F.assert_late_rank_wrote_nothing(res)


def test_same_buffers_means_cleared_on_every_rank(tmp_path):
    res = run_ranks(W.w_same_buffers, 2, tmp_path, timeout=120)
    for flags in res:
        assert flags == [False, True, "refused", False, True], flags
