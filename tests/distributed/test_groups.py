"""Process groups over a job's life on real spawned gloo ranks: a Transfer with group=None
follows the default group through destroy_process_group / init_process_group (and from
before the first init); a destroyed group is refused clearly and is not kept alive by
reshard; a group that is not a group is a TypeError; a live buffer object whose own `.layout`
is not the plan's is refused on every rank, naming what differs."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _workers_groups as W  # noqa: E402

from tests._spawn import run_ranks  # noqa: E402


def test_group_lifecycle(tmp_path):
    stores = tmp_path / "stores"
    stores.mkdir()
    res = run_ranks(W.w_group_lifecycle, 2, tmp_path, args=(str(stores),), timeout=180)
    errs = [f"rank {r}: {e}" for r, es in enumerate(res) for e in es]
    assert not errs, "\n".join(errs[:10])
