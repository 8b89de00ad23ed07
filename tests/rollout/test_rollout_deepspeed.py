"""Rollout weight sync from a real trainer: HF Llama (GQA, untied and tied embeddings) under
DeepSpeed ZeRO-3 with CPU optimizer offload, 2 and 3 gloo ranks, two optimizer steps.

(a) rs.Stream of every parameter to the receiver ranks, bitwise equal to GatheredParameters'
full weights; of the fp32 masters cast to bf16, bitwise equal to safe_get_full_fp32_param's.
(b) vLLM tp_layout targets at tp 2 and 4 (kv heads replicated at tp 4) hosted by the trainer
ranks, bitwise equal to vLLM's rule applied to the full weights, padding rows never written.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/_spawn.py
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _ds_workers as W
from _spawn import run_ranks

pytest.importorskip("transformers")
try:
    import deepspeed  # noqa: F401
except ImportError as exc:  # installed by `make test` (deps-deepspeed): missing is a broken setup
    raise ImportError(
        "tests/rollout needs DeepSpeed: run `make deps-deepspeed` (DS_BUILD_OPS=0)"
    ) from exc

pytestmark = pytest.mark.usefixtures("deepspeed_cpu_ops")

ENV = {"DS_ACCELERATOR": "cpu", "RESHARD_TEST_THREADS": "1"}


def test_zero3_offload_untied_two_ranks(tmp_path):
    # persistence threshold 0: every param lives only as shards between steps
    tp_hosts = {2: [0, 1], 4: [0, 1, 0, 1]}
    for errs in run_ranks(
        W.w_trainer, 2, tmp_path, env=ENV, timeout=300, args=(False, [0], tp_hosts, 0)
    ):
        assert errs == []


def test_zero3_offload_tied_three_ranks(tmp_path):
    # default persistence: small params also keep a full copy; two receivers
    tp_hosts = {2: [1, 2], 4: [2, 0, 1, 2]}
    for errs in run_ranks(
        W.w_trainer, 3, tmp_path, env=ENV, timeout=300, args=(True, [0, 2], tp_hosts, 100000)
    ):
        assert errs == []


def test_demo_rollout_mode():
    """`python -m reshard.demo --mode rollout`: both rollout shapes after each step, verified."""
    import os
    import subprocess

    cmd = [sys.executable, "-m", "reshard.demo", "--mode", "rollout", "--layers", "1"]
    cmd += ["--hidden", "64", "--ffn", "96", "--vocab", "101", "--steps", "2"]
    env = dict(os.environ, **ENV)
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "OK:" in res.stdout and "bitwise equal" in res.stdout, res.stdout[-3000:]
