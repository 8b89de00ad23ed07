"""DeepSpeed's own refresh code failing on one rank after the ranks agreed their engines are fit,
on spawned gloo ranks with real engines and the optimizer offloaded to CPU.

refresh_params / refresh_persistent run DeepSpeed's local part (casting the masters into this
rank's partition, releasing gathered params) and then its gather. An exception in the local
part on rank 1 alone must make every rank raise the same error naming rank 1, at once, before
the gather (not rank 1 alone while rank 0 waits in the gather for the group's timeout), and
calling the refresh again once the cause is gone must finish the job.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/_spawn.py
sys.path.insert(0, str(Path(__file__).resolve().parent))  # _dsutil.py

from _spawn import run_ranks

pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("deepspeed_cpu_ops")]

ENV = {"DS_ACCELERATOR": "cpu", "RESHARD_TEST_THREADS": "1"}
# (stage, model, refresh, the DeepSpeed code that raises on rank 1). ZeRO-3 "mlp": every param
# persistent, so the refresh ends in a real gather.
CASES = [
    (3, "mlp", "refresh_params", "cast"),
    (3, "mlp", "refresh_persistent", "release"),
    (3, "mlp", "refresh_params", "release"),
    (2, "block", "refresh_params", "partition"),
]


def _inject(engine, where):
    """Make DeepSpeed's local refresh code raise on this rank; returns the undo."""
    opt = engine.optimizer
    if where == "partition":  # a bf16 partition the master chunk does not fit: copy_ raises
        parts = opt.parallel_partitioned_bit16_groups[0]
        me = opt.real_dp_process_group[0].rank()
        good = parts[me]
        parts[me] = good[:-1]

        def undo():
            parts[me] = good

        return undo
    owner, name = {
        "cast": (opt, "_reassign_or_swap_out_partitioned_parameters"),
        "release": (opt.parameter_offload, "empty_partition_cache"),
    }[where]

    def broken(*args, **kwargs):
        raise RuntimeError(f"injected: DeepSpeed's {name} failed")

    setattr(owner, name, broken)
    return lambda: delattr(owner, name)


def _refresh_failure_worker(rank, world, cases):
    import time

    import torch
    from _dsutil import assert_bitwise, batch, ds_env, make_engine, reference, train

    ds_env(rank, world)
    import reshard as rs
    from reshard.integrations import deepspeed as rsds

    out = []
    for stage, model, refresh, where in cases:
        tag = f"stage {stage} {model} {refresh} {where}"
        a = make_engine(stage, "cpu", model, seed=0)
        b = make_engine(stage, "cpu", model, seed=5)
        train(a, model, 1, seed=1, rank=rank)
        train(b, model, 1, seed=2, rank=rank)
        # B's masters (refresh_params) or params (refresh_persistent) from A: the refresh is
        # what makes B's forward read them
        kind = "fp32" if refresh == "refresh_params" else "param"
        src, dst = rsds.describe(a, kind), rsds.describe(b, kind)
        rs.Transfer(src.layout, dst.layout)(src, dst)
        undo = _inject(b, where) if rank == 1 else (lambda: None)
        t0 = time.perf_counter()
        try:
            getattr(rsds, refresh)(b)
            msg = "no error"
        except Exception as exc:  # noqa: BLE001 - compared across ranks by the parent
            msg = f"{type(exc).__name__}: {exc}"
        elapsed = time.perf_counter() - t0
        undo()
        getattr(rsds, refresh)(b)  # again, the cause gone: finishes the job
        x = batch(a, model, 11)
        with torch.no_grad():
            assert_bitwise(b(x), a(x), f"{tag}: forward after the second refresh")
        want, got = reference(a, "param"), reference(b, "param")
        for n in want:
            assert_bitwise(got[n], want[n], f"{tag}: param {n}")
        a.destroy()
        b.destroy()
        out.append((tag, msg, elapsed))
    return out


def test_deepspeed_refresh_code_failing_on_one_rank_fails_every_rank(tmp_path):
    res = run_ranks(
        _refresh_failure_worker,
        2,
        tmp_path,
        args=(CASES,),
        env=ENV,
        timeout=400,
        group_timeout=40,
    )
    for (tag, msg0, t0), (_, msg1, t1) in zip(res[0], res[1], strict=True):
        assert msg0 == msg1, (tag, msg0, msg1)  # the same error on every rank
        refresh = tag.split()[3]
        assert msg0.startswith(
            f"RuntimeError: {refresh}(engine) failed on 1 of 2 data-parallel ranks (1) in "
            "DeepSpeed's local refresh, before its gather;"
        ), (tag, msg0)
        assert "\n  rank 1: RuntimeError: " in msg0 and "rank 0:" not in msg0, (tag, msg0)
        assert "call it again on every rank" in msg0, (tag, msg0)
        assert max(t0, t1) < 20, (tag, t0, t1)
