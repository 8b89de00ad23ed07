"""tests/_spawn.py itself: results, error relay with traceback, skips, deaths, hangs."""

import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _spawn_workers as SW  # noqa: E402

from tests._spawn import WorkerError, run_ranks  # noqa: E402


def test_results_in_rank_order(tmp_path):
    res = run_ranks(SW.w_sum, 3, tmp_path, args=(10,))
    assert [r["rank"] for r in res] == [0, 1, 2]
    assert all(r["sum"] == 33.0 and r["world"] == 3 and r["backend"] == "gloo" for r in res)


def test_worker_exception_carries_rank_and_traceback(tmp_path):
    with pytest.raises(WorkerError) as ei:
        run_ranks(SW.w_raise, 2, tmp_path)
    msg = str(ei.value)
    assert "rank 1 of 2 raised" in msg and "bad thing on rank 1" in msg
    assert "_spawn_workers.py" in msg  # the worker's own traceback, not the parent's
    assert isinstance(ei.value.__cause__, ValueError)


def test_skip_in_worker_skips_the_test(tmp_path):
    with pytest.raises(pytest.skip.Exception, match="needs something this machine lacks"):
        run_ranks(SW.w_skip, 2, tmp_path)


def test_expected_death_and_unexpected_death(tmp_path):
    assert run_ranks(SW.w_die, 2, tmp_path / "a", expect_killed=[1]) == [0, None]
    with pytest.raises(AssertionError, match="rank 1 exited with code 77"):
        run_ranks(SW.w_die, 2, tmp_path / "b")


def test_hung_rank_is_killed_and_named(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[1\] of 2 still running"):
        # generous: rank 0 must import torch and finish before the timeout on a loaded machine
        run_ranks(SW.w_hang, 2, tmp_path, timeout=45)
    assert time.monotonic() - t0 < 120


def test_launch_reports_failures_and_keeps_finished_results():
    """reshard._launch.launch (the demo's and the benchmarks' entry) on the same workers."""
    from reshard._launch import RanksFailed, launch

    assert [r["sum"] for r in launch(SW.w_sum, 2, args=(1,))] == [3.0, 3.0]
    with pytest.raises(RanksFailed, match="rank 1 failed:(.|\n)*bad thing on rank 1") as ei:
        launch(SW.w_raise, 2)
    assert ei.value.results == [0, None]


def test_orphaned_deepspeed_segments_are_removed_and_others_kept(tmp_path):
    """Segments named after a launcher pid that is gone are removed; a live launcher's and
    those of another naming scheme (owner unknown) stay."""
    import subprocess

    from reshard._launch import SHM_DIR, deepspeed_shm_prefix, remove_orphaned_deepspeed_shm

    if not os.path.isdir(SHM_DIR):
        pytest.skip(f"no {SHM_DIR} on this machine")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # reaped: its pid names no process
    orphan = f"{deepspeed_shm_prefix(gone.pid)}3"
    live = f"{deepspeed_shm_prefix(os.getpid())}0"
    foreign = f"deepspeed_allreduce_buffer_{os.getuid()}__test{os.getpid()}_0"
    for name in (orphan, live, foreign):
        with open(os.path.join(SHM_DIR, name), "wb") as f:
            f.write(b"x" * 4096)
    try:
        removed, freed, others = remove_orphaned_deepspeed_shm()
        assert not os.path.exists(os.path.join(SHM_DIR, orphan))
        assert removed >= 1 and freed >= 4096
        assert os.path.exists(os.path.join(SHM_DIR, live))
        assert os.path.exists(os.path.join(SHM_DIR, foreign)) and foreign in others
    finally:
        for name in (orphan, live, foreign):
            if os.path.exists(os.path.join(SHM_DIR, name)):
                os.unlink(os.path.join(SHM_DIR, name))
