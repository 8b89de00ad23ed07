"""`python -m reshard.demo`'s arguments: out-of-range values are refused by the parser (exit
2, before any rank starts), NCCL without GPUs says so, and the report names the TP size the
run used."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from reshard import demo


@pytest.mark.parametrize(
    "argv",
    [["--world", "0"], ["--world", "-2"], ["--steps", "0"], ["--layers", "0"], ["--budget", "8"]],
)
def test_out_of_range_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        demo.main(["--mode", "synthetic", *argv])
    assert exit_info.value.code == 2
    assert "must be at least" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_nccl_without_gpus_says_so(capsys):
    assert demo.main(["--mode", "synthetic", "--backend", "nccl"]) == 2
    assert "needs one GPU per rank" in capsys.readouterr().err


def test_the_report_names_the_tp_size_it_ran():
    cmd = [sys.executable, "-m", "reshard.demo", "--mode", "synthetic", "--world", "3"]
    cmd += ["--layers", "1", "--hidden", "34", "--ffn", "50", "--vocab", "101", "--steps", "1"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "(3 uneven shards) -> TP=3 bf16" in res.stdout, res.stdout[:500]
