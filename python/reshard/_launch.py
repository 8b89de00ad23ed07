"""Spawned ranks for scripts (the demo, the benchmarks): each runs a function inside a process
group and hands back a JSON-able result. Tests use `tests/_spawn.py`, which adds pytest's
skip relay and death injection on top of the same idea."""

from __future__ import annotations

import datetime
import json
import os
import tempfile
import traceback

import torch
import torch.distributed as dist


class RanksFailed(RuntimeError):
    """One or more ranks died or raised; the message names each with its traceback."""


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


def _worker(body, rank, world, backend, store_path, timeout_s, args, out_path):
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        init_group(backend, store_path, rank, world, timeout_s)
        try:
            result = body(rank, world, *args)
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - the parent reports it
        result = {"error": traceback.format_exc()}
    tmp = out_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, out_path)


def launch(body, world, *, backend="gloo", args=(), timeout_s=600, join_s=None, prefix="reshard-"):
    """Run `body(rank, world, *args)` in `world` spawned processes, each inside an initialized
    process group (a FileStore in a temporary directory, never a port), and return the results
    in rank order. `body` must be importable (spawn pickles it by name) and return JSON-able
    data. A rank that dies, raises or outlives `join_s` raises `RanksFailed`."""
    ctx = torch.multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        store = os.path.join(tmp, "store")
        outs = [os.path.join(tmp, f"rank{r}.json") for r in range(world)]
        procs = [
            ctx.Process(
                target=_worker, args=(body, r, world, backend, store, timeout_s, args, outs[r])
            )
            for r in range(world)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(join_s)
            if p.is_alive():
                p.kill()
                p.join()
        results, failures = [], []
        for r, path in enumerate(outs):
            if not os.path.exists(path):
                failures.append(f"rank {r} died (exit code {procs[r].exitcode})")
                results.append(None)
                continue
            with open(path) as f:
                results.append(json.load(f))
            if isinstance(results[-1], dict) and "error" in results[-1]:
                failures.append(f"rank {r} failed:\n{results[-1]['error']}")
    if failures:
        raise RanksFailed("\n".join(failures))
    return results
