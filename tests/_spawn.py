"""Run a function on N real, spawned torch.distributed ranks (gloo on CPU, NCCL on GPUs).

Every test that needs ranks uses this (docs/internals.md). Rules it enforces:
- a FileStore under `tmp_path` for rendezvous (never a fixed port, so parallel runs never clash),
  through `reshard._launch.init_group`, the demo's and benchmarks' start-up too;
- a group timeout, so a dead peer turns into an error instead of a hang;
- `destroy_process_group()` in `finally`;
- a join timeout in the parent: stragglers are killed and reported by rank;
- every exit code is asserted; a worker's exception is re-raised in the parent with the
  worker's traceback; `pytest.skip` inside a worker skips the test in the parent;
- a worker that has written its result exits at once (`os._exit(0)`): interpreter
  finalization with torch's threads alive can abort a process that did its work correctly.

Workers are started with the spawn context, which re-imports the module that defines `fn`:
keep worker functions at module level in importable test modules, and keep those modules'
top-level imports light. Results travel back as pickles in `tmp_path`, not through a pipe, so a
rank that dies hard cannot wedge the parent on a half-written queue.

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
import pickle
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch.multiprocessing as mp

KILLED_EXIT = 77  # exit code of a rank that called die(); any other non-zero code is a crash

_FAIL_GRACE_S = 20.0  # after one rank failed, how long the others get to finish on their own


class WorkerError(RuntimeError):
    """A rank raised; the message carries its rank and its full traceback."""


def die() -> None:
    """End this rank now, as a crash would: no finally blocks, no process-group teardown."""
    os._exit(KILLED_EXIT)


def _result_path(out_dir: str, rank: int) -> str:
    return os.path.join(out_dir, f"rank{rank}.pkl")


def _write_result(out_dir: str, rank: int, record: tuple) -> None:
    # Write-then-rename: the parent never reads a half-written pickle.
    path = _result_path(out_dir, rank)
    with open(path + ".tmp", "wb") as f:
        pickle.dump(record, f)
    os.replace(path + ".tmp", path)


def _worker(rank, world_size, init_file, backend, group_timeout_s, fn, args, env, out_dir):
    # Environment before importing anything that reads it (thread counts, NCCL knobs).
    for key, value in (env or {}).items():
        os.environ[key] = str(value)
    import torch
    import torch.distributed as dist

    from reshard._launch import init_group  # after the environment: reshard reads it

    torch.set_num_threads(int(os.environ.get("RESHARD_TEST_THREADS", "1")))
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    record = None
    try:
        init_group(backend, init_file, rank, world_size, group_timeout_s)
        try:
            record = ("ok", fn(rank, world_size, *args))
        finally:
            if dist.is_initialized():  # a worker may have aborted its group after a failure
                dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
        tb = traceback.format_exc()
        if type(exc).__name__ == "Skipped":  # pytest.skip() inside the worker
            record = ("skip", str(exc))
        else:
            try:
                pickle.dumps(exc)
                payload = exc
            except Exception:  # noqa: BLE001 - unpicklable: the traceback still goes back
                payload = None
            record = ("error", tb, payload)
    _write_result(out_dir, rank, record)
    # The record is the rank's outcome; end here, skipping interpreter finalization. A torch
    # thread (gloo work, autograd) that wants the GIL while Python finalizes is unwound through
    # a noexcept frame and aborts the process ("terminate called without an active exception",
    # exit -6), which CI saw once in a DeepSpeed test after the rank had returned its result.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


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
    init_file = os.path.join(run_dir, "store")
    ctx = mp.get_context("spawn")
    procs = []
    for rank in range(world_size):
        p = ctx.Process(
            target=_worker,
            args=(rank, world_size, init_file, backend, group_timeout, fn, args, env, run_dir),
            name=f"reshard-rank{rank}",
            daemon=False,
        )
        p.start()
        procs.append(p)

    deadline = time.monotonic() + timeout
    first_failure = None
    try:
        while any(p.is_alive() for p in procs):
            now = time.monotonic()
            if first_failure is None:
                for rank, p in enumerate(procs):
                    if p.exitcode not in (None, 0) and rank not in expect_killed:
                        first_failure = now
                        deadline = min(deadline, now + _FAIL_GRACE_S)
                        break
            if now > deadline:
                break
            time.sleep(0.02)
    finally:
        hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(10)

    records = {}
    for rank in range(world_size):
        path = _result_path(run_dir, rank)
        if os.path.exists(path):
            with open(path, "rb") as f:
                records[rank] = pickle.load(f)

    # Report the most informative failure first: a traceback beats an exit code.
    for rank in range(world_size):
        rec = records.get(rank)
        if rec is not None and rec[0] == "error":
            _, tb, exc = rec
            msg = f"rank {rank} of {world_size} raised:\n{tb}"
            if exc is not None:
                raise WorkerError(msg) from exc
            raise WorkerError(msg)
    if hung:
        raise TimeoutError(
            f"ranks {hung} of {world_size} still running after the timeout ({timeout} s); killed"
        )
    for rank, p in enumerate(procs):
        if rank in expect_killed:
            assert p.exitcode == KILLED_EXIT, (
                f"rank {rank} was expected to die() (exit {KILLED_EXIT}), exit code {p.exitcode}"
            )
        else:
            assert p.exitcode == 0, f"rank {rank} exited with code {p.exitcode}"
            assert rank in records, f"rank {rank} exited 0 but wrote no result"
    skips = [rec[1] for rec in records.values() if rec[0] == "skip"]
    if skips:
        import pytest

        pytest.skip(skips[0])
    return [None if r in expect_killed else records[r][1] for r in range(world_size)]
