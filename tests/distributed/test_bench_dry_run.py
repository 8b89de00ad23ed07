"""The multi-GPU benchmark's CPU dry run (`benchmarks/gpu_bench.py --mode multi --backend gloo`):
the GPU machine runs the same code under NCCL, so it must start, measure and check its targets
here. Checks correctness and exit codes only, never timings."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_bench.py")


def _run(*args, timeout=300):
    return subprocess.run(
        [sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=timeout
    )


def test_help_and_bad_section():
    assert _run("--help").returncode == 0
    res = _run("--only", "nonsense")
    assert res.returncode == 2 and "unknown sections ['nonsense']" in res.stderr


def test_multi_mode_gloo_dry_run(tmp_path):
    res = _run("--mode", "multi", "--backend", "gloo", "--quick", "--out", str(tmp_path))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "ALL CORRECT" in res.stdout, res.stdout[-2000:]
    with open(tmp_path / "gpu_bench_multi.json") as f:
        rec = json.load(f)
    assert rec["per_rank_correct"] == [True, True] and not rec["errors"]
    assert rec["p2p"] and rec["swap"] and len(rec["weight_sync"]["methods"]) == 3
    assert (tmp_path / "gpu_bench_multi.md").exists()
