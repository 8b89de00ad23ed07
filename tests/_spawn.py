"""Run a function on N real, spawned torch.distributed ranks (gloo on CPU, NCCL on GPUs).

Every test that needs ranks uses this (docs/internals.md). It is reshard._launch.spawn (the
launcher of the demo and the benchmarks too: a FileStore under `tmp_path`, never a fixed port;
the gloo barrier after init; a group timeout; the result record written before the teardown,
then `os._exit(0)`; a join deadline with stragglers killed and reported by rank) with pytest's
rules on top:
- every exit code is asserted; a worker's exception is re-raised in the parent with the
  worker's traceback; `pytest.skip` inside a worker skips the test in the parent;
- the worker runs with `RESHARD_TEST_THREADS` torch threads (default 1).

Workers are started with the spawn context, which re-imports the module that defines `fn`:
keep worker functions at module level in importable test modules, and keep those modules'
top-level imports light.

    def _work(rank, world_size, n):          # module level, picklable arguments
        ...
        return something_picklable

    results = run_ranks(_work, 3, tmp_path, args=(10,))   # [rank0's value, rank1's, rank2's]

A rank can die on purpose with `die()` (exit code KILLED_EXIT, no cleanup, no destroy): pass
its rank in `expect_killed` and `run_ranks` asserts that it died, that every other rank exited
cleanly, and returns None in its slot.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from reshard._launch import spawn

KILLED_EXIT = 77  # exit code of a rank that called die(); any other non-zero code is a crash


class WorkerError(RuntimeError):
    """A rank raised; the message carries its rank and its full traceback."""


def die() -> None:
    """End this rank now, as a crash would: no finally blocks, no process-group teardown."""
    os._exit(KILLED_EXIT)


def _test_body(rank, world_size, fn, args):
    import torch

    torch.set_num_threads(int(os.environ.get("RESHARD_TEST_THREADS", "1")))
    return fn(rank, world_size, *args)


def run_ranks(
    fn,
    world_size: int,
    tmp_path,
    backend: str = "gloo",
    timeout: float = 120.0,
    args: tuple = (),
    env: dict | None = None,
    group_timeout: float = 60.0,
    expect_killed=(),
):
    """Run `fn(rank, world_size, *args)` on `world_size` spawned ranks; return their values.

    timeout: wall seconds for the whole run (start-up included); stragglers are killed and a
        TimeoutError names them. group_timeout: the process group's collective timeout, which
        bounds how long a rank waits for a dead peer.
    expect_killed: ranks that must end through die(); their slots in the result are None.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    expect_killed = set(expect_killed)
    if not expect_killed <= set(range(world_size)):
        raise ValueError(f"expect_killed {sorted(expect_killed)} not in range({world_size})")
    base = Path(tmp_path)
    base.mkdir(parents=True, exist_ok=True)
    run_dir = tempfile.mkdtemp(prefix="ranks-", dir=base)
    records, exitcodes, hung = spawn(
        _test_body,
        world_size,
        run_dir,
        backend=backend,
        args=(fn, args),
        env=env,
        group_timeout_s=group_timeout,
        timeout_s=timeout,
        expect_killed=expect_killed,
    )
    # Report the most informative failure first: a traceback beats an exit code.
    skips = []
    for rank in range(world_size):
        rec = records.get(rank)
        if rec is None or rec[0] != "error":
            continue
        _, tb, exc, type_name = rec
        if type_name == "Skipped":  # pytest.skip() inside the worker
            skips.append(str(exc) if exc is not None else tb.strip().splitlines()[-1])
            continue
        msg = f"rank {rank} of {world_size} raised:\n{tb}"
        if exc is not None:
            raise WorkerError(msg) from exc
        raise WorkerError(msg)
    if hung:
        raise TimeoutError(
            f"ranks {hung} of {world_size} still running after the timeout ({timeout} s); killed"
        )
    for rank, code in enumerate(exitcodes):
        if rank in expect_killed:
            assert code == KILLED_EXIT, (
                f"rank {rank} was expected to die() (exit {KILLED_EXIT}), exit code {code}"
            )
        else:
            assert code == 0, f"rank {rank} exited with code {code}"
            assert rank in records, f"rank {rank} exited 0 but wrote no result"
    if skips:
        import pytest

        pytest.skip(skips[0])
    return [None if r in expect_killed else records[r][1] for r in range(world_size)]
