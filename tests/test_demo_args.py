"""`python -m reshard.demo`'s and `python -m reshard.info`'s arguments: out-of-range values,
sizes a mode's model cannot take, a mode whose requirements are missing and NCCL without GPUs
are refused by the parser (exit 2, before any rank starts) with the exact reason; sizes are used
as given; the report names the TP size the run used."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch

from reshard import demo, info

PREFIX = "python -m reshard.demo: error: "


def _refused(argv, capsys) -> str:
    """The parser's error line for argv (exit code 2)."""
    with pytest.raises(SystemExit) as exit_info:
        demo.main(argv)
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(PREFIX), last
    return last[len(PREFIX) :]


class _Launched(Exception):
    pass


def _launched(monkeypatch, argv):
    """(world, backend, cfg) that demo.main would start its ranks with."""

    def launch(body, world, backend, args, **kwargs):
        raise _Launched(world, backend, args[1])

    monkeypatch.setattr(demo, "launch", launch)
    monkeypatch.setattr(demo.deepspeed_cpu_ops, "prepare", lambda: None)
    with pytest.raises(_Launched) as launched:
        demo.main(argv)
    return launched.value.args


def _not_installed(monkeypatch, *names):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in names else find_spec(name, *a)
    )


@pytest.mark.parametrize(
    "argv",
    [["--world", "0"], ["--world", "-2"], ["--steps", "0"], ["--layers", "0"], ["--budget", "8"]],
)
def test_out_of_range_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        demo.main(["--mode", "synthetic", *argv])
    assert exit_info.value.code == 2
    assert "must be at least" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--world", "abc"], "argument --world: expected an integer, got 'abc'"),
        (["--hidden", "1.5"], "argument --hidden: expected an integer, got '1.5'"),
        (["--budget", ""], "argument --budget: expected an integer, got ''"),
    ],
)
def test_non_integers_are_refused(argv, message, capsys):
    assert _refused(["--mode", "synthetic", *argv], capsys) == message


@pytest.mark.parametrize("mode", ["deepspeed", "fsdp"])
def test_a_hidden_size_the_attention_heads_do_not_divide_is_refused(mode, capsys):
    if mode == "deepspeed":
        pytest.importorskip("deepspeed")
    assert _refused(["--mode", mode, "--hidden", "33"], capsys) == (
        f"argument --hidden: must be a multiple of 2 for --mode {mode} (its attention has 2 "
        "heads), got 33"
    )


def test_the_cli_refuses_an_odd_hidden_size_without_a_traceback():
    cmd = [sys.executable, "-m", "reshard.demo", "--mode", "fsdp", "--hidden", "33"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert res.returncode == 2, res.stdout[-3000:] + res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines()[-1] == PREFIX + (
        "argument --hidden: must be a multiple of 2 for --mode fsdp (its attention has 2 heads), "
        "got 33"
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--hidden", "100"],
            "argument --hidden: must be a multiple of 64 for --mode rollout (8 attention heads, "
            "head_dim a multiple of 8), got 100",
        ),
        (
            ["--hidden", "32"],
            "argument --hidden: must be a multiple of 64 for --mode rollout (8 attention heads, "
            "head_dim a multiple of 8), got 32",
        ),
        (
            ["--ffn", "689"],
            "argument --ffn: must be a multiple of 2 for --mode rollout (vLLM's TP=2 splits the "
            "MLP evenly), got 689",
        ),
    ],
)
def test_rollout_sizes_are_refused_not_rounded(argv, message, capsys):
    pytest.importorskip("deepspeed")
    pytest.importorskip("transformers")
    assert _refused(["--mode", "rollout", *argv], capsys) == message


def test_rollout_uses_the_sizes_as_given(monkeypatch):
    pytest.importorskip("deepspeed")
    transformers = pytest.importorskip("transformers")
    from reshard.integrations import rollout_demo

    _, _, cfg = _launched(monkeypatch, ["--mode", "rollout", "--backend", "gloo"])
    assert (cfg["hidden"], cfg["ffn"]) == (256, 690)  # the mode's default width
    cfg |= {"hidden": 128, "ffn": 94}
    hf = rollout_demo._config(cfg)
    assert isinstance(hf, transformers.LlamaConfig)
    assert (hf.hidden_size, hf.intermediate_size) == (128, 94)


def test_the_other_modes_default_to_an_uneven_hidden_size(monkeypatch):
    _, _, cfg = _launched(monkeypatch, ["--mode", "fsdp", "--backend", "gloo"])
    assert cfg["hidden"] == 258


def test_a_mode_whose_requirements_are_missing_is_refused(monkeypatch, capsys):
    _not_installed(monkeypatch, "transformers")
    assert _refused(["--mode", "rollout"], capsys) == (
        "argument --mode: rollout needs transformers and deepspeed; not installed: transformers "
        "(--mode synthetic needs nothing)"
    )


def test_without_deepspeed_the_default_mode_is_synthetic(monkeypatch, capsys):
    _not_installed(monkeypatch, "deepspeed")
    _, _, cfg = _launched(monkeypatch, ["--backend", "gloo"])
    assert cfg["mode"] == "synthetic"
    assert capsys.readouterr().err == "deepspeed is not installed: running the synthetic demo\n"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
@pytest.mark.parametrize("world", [[], ["--world", "2"]])
def test_nccl_without_gpus_says_so(world, capsys):
    build = ", and this torch is a CPU-only build" if torch.version.cuda is None else ""
    assert _refused(["--mode", "synthetic", "--backend", "nccl", *world], capsys) == (
        f"argument --backend: nccl needs CUDA GPUs, one per rank; none is visible here{build}. "
        "Use --backend gloo (or auto) to run the ranks on CPU"
    )


def test_nccl_with_fewer_gpus_than_ranks_says_so(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    argv = ["--mode", "synthetic", "--backend", "nccl", "--world", "3"]
    assert _refused(argv, capsys) == (
        "argument --backend: nccl needs a CUDA GPU per rank: --world 3 needs 3, 1 visible. "
        "Use --world 1 or fewer, or --backend gloo to run on CPU"
    )
    assert _launched(monkeypatch, argv[:-2])[:2] == (1, "nccl")


def test_info_refuses_unknown_arguments(capsys):
    with pytest.raises(SystemExit) as exit_info:
        info.main(["--bogus"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "python -m reshard.info: error: unrecognized arguments: --bogus"
    )


def test_info_json_is_one_object(capsys):
    info.main(["--json"])
    assert capsys.readouterr().out.lstrip().startswith("{")


def test_info_into_a_closed_pipe_exits_quietly():
    """`python -m reshard.info | head`: a reader that stops early is not an error."""
    for _ in range(3):  # the reader may close before or after the first write
        proc = subprocess.Popen(
            [sys.executable, "-m", "reshard.info"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        proc.stdout.close()
        err = proc.communicate(timeout=120)[1].decode()
        assert proc.returncode == 0, err
        assert "Error" not in err, err


def test_the_report_names_the_tp_size_it_ran():
    cmd = [sys.executable, "-m", "reshard.demo", "--mode", "synthetic", "--world", "3"]
    cmd += ["--layers", "1", "--hidden", "34", "--ffn", "50", "--vocab", "101", "--steps", "1"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "(3 uneven shards) -> TP=3 bf16" in res.stdout, res.stdout[:500]


def test_more_gloo_ranks_than_memory_holds_are_refused(monkeypatch, capsys):
    monkeypatch.setattr(demo, "_available_memory_bytes", lambda: 10 * demo.RANK_PROCESS_BYTES)
    argv = ["--mode", "synthetic", "--backend", "gloo", "--world", "11"]
    assert _refused(argv, capsys) == (
        "argument --world: 11 gloo ranks are 11 processes, each with its own torch (about "
        f"400 MiB); this machine has {10 * 400} MiB available, enough for 10. "
        "Use --world 10 or fewer"
    )
    assert _launched(monkeypatch, [*argv[:-1], "10"])[0] == 10


def test_available_memory_is_read_from_the_kernel():
    available = demo._available_memory_bytes()
    if sys.platform.startswith("linux"):
        assert available is not None
    assert available is None or 0 < available < 1 << 50
