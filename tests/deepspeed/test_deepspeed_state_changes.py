"""DeepSpeed state changed under a described LiveState, on spawned gloo ranks with real engines.

- describe() while the states are offloaded (engine.offload_states()) is NotReadyError saying
  to reload them, not a misleading UnsupportedError from the cross-check.
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
KINDS = ("param", "fp32", "exp_avg", "exp_avg_sq")


def _offloaded_worker(rank, world):
    from _dsutil import ds_env, make_engine, train

    ds_env(rank, world)
    from reshard.errors import NotReadyError
    from reshard.integrations import deepspeed as rsds

    done = []
    for stage in (1, 2, 3):
        engine = make_engine(stage, "none")
        train(engine, "mlp", 1, seed=1, rank=rank)
        lives = {k: rsds.describe(engine, k) for k in KINDS}
        if stage == 3:
            # DeepSpeed 0.19.8's ZeRO-3 offload_states() fails on the CPU accelerator
            # (IndexError inside DeepSpeed): set what it records instead
            from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum

            engine.optimizer.offloaded_states.add(OffloadStateTypeEnum.optim_states)
        else:
            engine.offload_states()
        for k in KINDS:
            with pytest.raises(NotReadyError, match=r"offloaded .*call engine\.reload_states\(\)"):
                rsds.describe(engine, k)
            with pytest.raises(NotReadyError, match=r"offloaded .*call engine\.reload_states\(\)"):
                lives[k].check()
        if stage == 3:
            engine.optimizer.offloaded_states.clear()
        else:
            engine.reload_states()
        for k in KINDS:
            assert rsds.describe(engine, k).reasons() == [], (stage, k)
        engine.destroy()
        done.append(stage)
    return done


def test_describe_while_offloaded_says_reload(tmp_path):
    assert run_ranks(_offloaded_worker, 2, tmp_path, env=ENV, timeout=300)[0] == [1, 2, 3]
