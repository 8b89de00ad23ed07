"""Spawned ranks: run a function on N processes, each inside an initialized process group, and
bring back each rank's outcome. The one launcher of the demo, the benchmarks and the tests
(tests/_spawn.py adds pytest's rules on top: skips, deliberate deaths, assertions).

Rules (docs/internals.md):
- rendezvous through a FileStore in a fresh directory, never a port, so parallel runs never clash;
- under gloo every rank passes a barrier right after init (`init_group`);
- a group timeout, so a dead peer turns into an error instead of a hang, and a join deadline in
  the parent: stragglers are killed and reported by rank; once a rank has failed, the others
  get a short grace to finish on their own;
- each rank's outcome is a record written to a file (write-then-rename, so the parent never
  reads half of one, and a rank that dies hard cannot wedge the parent on a pipe); the record
  is written before the process-group teardown, so a teardown stuck on a failed peer cannot
  lose it;
- every gloo rank gets MASTER_ADDR=127.0.0.1 and MASTER_PORT=<the launching process's pid>
  (unless `env` names them): the group never reads them, but DeepSpeed's CPU allreduce names
  a 69 MB /dev/shm segment per rank after them and never unlinks it; so each run's segments
  have names of their own (two concurrent runs never share one) and `spawn` removes them once
  the ranks have ended, whether they finished, failed or were killed;
- after its record a rank ends at once (`os._exit(0)`): interpreter finalization with torch's
  threads alive can abort a process that did its work correctly ("terminate called without an
  active exception", exit -6: a torch thread that wants the GIL while Python finalizes is
  unwound through a noexcept frame).

The spawn context re-imports the module that defines the function: keep it at module level in
an importable module, with light top-level imports.
"""

from __future__ import annotations

import datetime
import os
import pickle
import sys
import tempfile
import time
import traceback
from typing import NamedTuple

import torch
import torch.distributed as dist

FAIL_GRACE_S = 20.0  # after one rank failed, how long the others get to finish on their own
RUN_ADDR = "127.0.0.1"
SHM_DIR = "/dev/shm"


class RanksFailed(RuntimeError):
    """One or more ranks died, raised or hung; the message names each with its traceback.
    `results` holds the values of the ranks that finished (None for the others)."""

    def __init__(self, message, results=None):
        super().__init__(message)
        self.results = results


class Outcome(NamedTuple):
    """What `spawn` saw: each rank's record ({rank: record}; ranks that wrote none are absent),
    exit codes in rank order, and the ranks still running at the deadline (killed)."""

    records: dict
    exitcodes: list
    hung: list


# A record is ("ok", value) or ("error", traceback text, the exception or None if it does not
# pickle, the exception's type name).


def init_group(backend, store_path, rank, world, timeout_s):
    """The default process group over a FileStore at `store_path` (never a port). Under gloo
    every rank then passes a barrier: gloo's init returns on a rank once its own pairs are up,
    possibly before a peer's are, and a rank that raised or died at once would fail that peer's
    init ("connectFullMesh failed ... Connection closed by peer") instead of reporting its own
    error."""
    dist.init_process_group(
        backend,
        store=dist.FileStore(store_path, world),
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    if backend == "gloo":
        dist.barrier()


def _record_path(run_dir, rank):
    return os.path.join(run_dir, f"rank{rank}.pkl")


def _write_record(run_dir, rank, record):
    path = _record_path(run_dir, rank)
    with open(path + ".tmp", "wb") as f:
        pickle.dump(record, f)
    os.replace(path + ".tmp", path)


def _error_record(exc):
    tb = traceback.format_exc()
    try:
        pickle.dumps(exc)
        payload = exc
    except Exception:  # noqa: BLE001 - unpicklable: the traceback still goes back
        payload = None
    return ("error", tb, payload, type(exc).__name__)


DEEPSPEED_SHM_NAME = "deepspeed_allreduce_buffer"  # csrc/cpu/comm/shm.cpp's SHM_BUFFER_NAME


def _deepspeed_shm_head() -> str:
    return f"{DEEPSPEED_SHM_NAME}_{os.getuid()}_{RUN_ADDR}_"


def deepspeed_shm_prefix(launcher_pid: int) -> str:
    """The names of the /dev/shm segments DeepSpeed's CPU allreduce creates in the ranks a
    process launched (csrc/cpu/comm/shm.cpp: `<name>_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>`)."""
    return f"{_deepspeed_shm_head()}{launcher_pid}_"


def _deepspeed_shm_segments() -> list:
    """[(name, launcher pid or None)] of DeepSpeed's segments in SHM_DIR; None: a name not of
    this scheme, whose owner cannot be told."""
    head = _deepspeed_shm_head()
    try:
        names = [n for n in os.listdir(SHM_DIR) if n.startswith(DEEPSPEED_SHM_NAME + "_")]
    except OSError:  # no /dev/shm: nothing was created there
        return []
    out = []
    for name in names:
        pid, _, rank = name[len(head) :].partition("_") if name.startswith(head) else ("", "", "")
        ok = pid.isdigit() and int(pid) > 0 and rank.isdigit()
        out.append((name, int(pid) if ok else None))
    return out


def _unlink_shm(name) -> int:
    path = os.path.join(SHM_DIR, name)
    try:
        size = os.stat(path).st_size
        os.unlink(path)
    except FileNotFoundError:
        return 0
    return size


def _remove_deepspeed_shm() -> None:
    me = os.getpid()
    for name, pid in _deepspeed_shm_segments():
        if pid == me:
            _unlink_shm(name)


def remove_orphaned_deepspeed_shm() -> tuple:
    """Remove the DeepSpeed segments of runs whose launcher is gone (a launcher killed before
    its cleanup). Returns (segments removed, their bytes, other DeepSpeed segments left: names
    not of this scheme, whose owner cannot be told)."""
    removed, freed, others = 0, 0, []
    for name, pid in _deepspeed_shm_segments():
        if pid is None:
            others.append(name)
            continue
        try:
            os.kill(pid, 0)
            continue  # its launcher runs (or another process has its pid): keep
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        removed += 1
        freed += _unlink_shm(name)
    return removed, freed, others


def _worker(rank, world, backend, run_dir, group_timeout_s, fn, args, env):
    if backend == "gloo":  # CPU ranks: the ones DeepSpeed's CPU allreduce runs in
        os.environ.update(MASTER_ADDR=RUN_ADDR, MASTER_PORT=str(os.getppid()))
    for key, value in (env or {}).items():
        os.environ[key] = str(value)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        init_group(backend, os.path.join(run_dir, "store"), rank, world, group_timeout_s)
        record = ("ok", fn(rank, world, *args))
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
        record = _error_record(exc)
    _write_record(run_dir, rank, record)
    try:
        if dist.is_initialized():  # a worker may have aborted its group after a failure
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the record already holds this rank's outcome
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _load(run_dir, rank):
    path = _record_path(run_dir, rank)
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return pickle.load(f)


def spawn(
    fn,
    world,
    run_dir,
    *,
    backend="gloo",
    args=(),
    env=None,
    group_timeout_s=60.0,
    timeout_s=600.0,
    expect_killed=(),
) -> Outcome:
    """Run `fn(rank, world, *args)` on `world` spawned ranks with their store and records in
    `run_dir`; wait until all have ended, or `timeout_s` has passed, or FAIL_GRACE_S after the
    first failure (a non-zero exit code outside `expect_killed`, or an error record)."""
    ctx = torch.multiprocessing.get_context("spawn")
    procs = []
    for rank in range(world):
        p = ctx.Process(
            target=_worker,
            args=(rank, world, backend, run_dir, group_timeout_s, fn, args, env),
            name=f"reshard-rank{rank}",
            daemon=False,
        )
        p.start()
        procs.append(p)
    deadline = time.monotonic() + timeout_s
    failed, recorded = False, set()
    try:
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            for r, p in enumerate(procs):
                if failed:
                    break
                crashed = p.exitcode not in (None, 0) and r not in expect_killed
                raised = False
                if r not in recorded and os.path.exists(_record_path(run_dir, r)):
                    recorded.add(r)
                    raised = _load(run_dir, r)[0] == "error"
                if crashed or raised:
                    failed = True
                    deadline = min(deadline, time.monotonic() + FAIL_GRACE_S)
            time.sleep(0.02)
    finally:
        hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(10)
        _remove_deepspeed_shm()
    records = {r: rec for r in range(world) if (rec := _load(run_dir, r)) is not None}
    return Outcome(records, [p.exitcode for p in procs], hung)


def launch(body, world, *, backend="gloo", args=(), env=None, timeout_s=600, join_s=None,
           prefix="reshard-"):  # fmt: skip
    """Run `body(rank, world, *args)` in `world` spawned ranks (a temporary directory for the
    store and the records) and return the values in rank order. `timeout_s` is the group's
    collective timeout, `join_s` (default: no limit beyond a day) the wall-clock limit of the
    whole run. A rank that dies, raises or hangs raises `RanksFailed`."""
    with tempfile.TemporaryDirectory(prefix=prefix) as run_dir:
        out = spawn(
            body,
            world,
            run_dir,
            backend=backend,
            args=args,
            env=env,
            group_timeout_s=timeout_s,
            timeout_s=join_s or 86400.0,
        )
    results, failures = [], []
    for r in range(world):
        rec = out.records.get(r)
        if rec is None:
            why = "still running at the deadline (killed)" if r in out.hung else "died"
            failures.append(f"rank {r} {why} (exit code {out.exitcodes[r]})")
        elif rec[0] == "error":
            failures.append(f"rank {r} failed:\n{rec[1]}")
        results.append(rec[1] if rec is not None and rec[0] == "ok" else None)
    if failures:
        raise RanksFailed("\n".join(failures), results)
    return results
