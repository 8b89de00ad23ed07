"""reshard over NCCL on 2 GPUs: one spawned rank per GPU (tests/_spawn.py, file store in tmp_path).

- every residency pair (GPU->GPU, CPU-offloaded->GPU, GPU->CPU, CPU->CPU through the pinned
  ring) x ZeRO-3 / ZeRO-1/2 / TP / replica layouts with uneven shards x dtypes x budgets from
  16 B (hundreds of rounds) to 64 MiB, targets poisoned, compared bitwise with the scenarios'
  independent reference (reshard.scenarios);
- preflight failure injection on each rank (tests/distributed/_faults.py): every rank raises
  the same PreflightError, no target byte changes;
- a rank killed mid-transfer: the survivor raises TransferError within the group timeout
  (TORCH_NCCL_BLOCKING_WAIT=1 turns the NCCL timeout into an exception instead of a watchdog
  abort of the whole process); killed in preflight: PreflightError, targets untouched;
- real DeepSpeed ZeRO-1/2/3 engines with CPU-offloaded optimizer: masters and moments vs
  safe_get_full_*, bf16 params -> TP=2 buffers, write-back, restore -> next step bitwise.

Skipped with fewer than 2 GPUs. RESHARD_MULTI_ON_GLOO=1 runs the same workers over gloo on the
CPU (CPU->CPU only, no DeepSpeed-on-GPU): a dry run of this file's logic without GPUs.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(_HERE)))
for _p in (_ROOT, _HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

WORLD = 2
ON_GLOO = os.environ.get("RESHARD_MULTI_ON_GLOO") == "1"
HAVE_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= WORLD
if not HAVE_GPUS and not ON_GLOO:
    pytest.skip(f"needs {WORLD} CUDA devices", allow_module_level=True)

import _nccl_workers as NW  # noqa: E402

from tests._spawn import run_ranks  # noqa: E402

BACKEND = "nccl" if HAVE_GPUS else "gloo"
# NVLink multicast stays off (docs: the device host's fabric manager does not provide it).
ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "RESHARD_TEST_THREADS": "2",
}
COMBOS = (
    [("cuda", "cuda"), ("cpu", "cuda"), ("cuda", "cpu"), ("cpu", "cpu")]
    if HAVE_GPUS
    else [("cpu", "cpu")]
)


def _cases(budgets):
    r = [0, 1]
    layouts = [
        (("zero3", r), ("tp", [r]), "fp32", "bf16"),  # trainer -> rollout, uneven shards
        (("zero12", r), ("tp", [r[::-1]]), "fp32", "fp32"),
        (("tp", [r]), ("zero3", r), "bf16", "fp32"),  # rollout -> training
        (("zero12", r), ("zero3", r[::-1]), "fp32", "fp32"),  # resize-like, reversed ranks
        (("rep", r[:1]), ("zero12", r), "fp16", "bf16"),  # one replica feeds both ranks
    ]
    return [c + (b,) for c in layouts for b in budgets]


def _check(res, label):
    errs = [e for rank_out in res for case in rank_out for e in case[1]]
    assert not errs, f"{label}:\n" + "\n".join(errs[:20])
    # rank r's bytes_sent[p] == rank p's bytes_received[r], case by case
    for c in range(len(res[0])):
        for r in range(WORLD):
            for p, nb in res[r][c][2].items():
                got = res[p][c][3].get(r, 0)
                assert got == nb, f"{label} {res[r][c][0]}: {r}->{p} sent {nb}, received {got}"
    assert all(case[5] == BACKEND for rank_out in res for case in rank_out)


def test_residency_layouts_budgets(tmp_path):
    """Small model, budgets 16 B / 1000 B / 64 MiB (16 B: hundreds of rounds, both arenas of
    the double buffer turned over many times) under every residency pair."""
    cases = _cases([16, 1000, 64 << 20])
    res = run_ranks(
        NW.w_residency, WORLD, tmp_path, backend=BACKEND, env=ENV, timeout=240,
        args=(cases, COMBOS, {}),
    )  # fmt: skip
    _check(res, "small")
    assert len(res[0]) == len(cases) * len(COMBOS)
    rounds = {case[0]: case[4] for case in res[0]}
    assert max(rounds.values()) > 100, rounds  # the tiny budget really cut it into rounds


def test_residency_larger_model(tmp_path):
    """~3M elements, long runs (the kernels' vector paths, ring direct/bounce paths), budgets
    64 KiB and 64 MiB."""
    cases = _cases([64 << 10, 64 << 20])
    kw = {"hidden": 256, "ffn": 1000, "vocab": 5003, "layers": 2}
    res = run_ranks(
        NW.w_residency, WORLD, tmp_path, backend=BACKEND, env=ENV, timeout=240,
        args=(cases, COMBOS, kw),
    )  # fmt: skip
    _check(res, "large")


def test_preflight_failures_are_collective(tmp_path):
    """Each injected failure on each rank, with GPU buffers and with CPU sources (one spawn)."""
    runs = []
    for sdev, ddev in COMBOS[:2]:
        extra = ("wrong_gpu",) if HAVE_GPUS and sdev == "cuda" else ()
        runs.append((sdev, ddev, NW.PREFLIGHT_KINDS + extra))
    res = run_ranks(
        NW.w_preflight_many, WORLD, tmp_path, backend=BACKEND, env=ENV, timeout=180,
        args=(runs,),
    )  # fmt: skip
    for i, (sdev, ddev, kinds) in enumerate(runs):
        label = f"{sdev}->{ddev}"
        for errs, _ in (r[i] for r in res):
            assert not errs, label + "\n" + "\n".join(map(str, errs[:10]))
        per_rank = [{(k, b): m for k, b, m in r[i][1]} for r in res]
        assert len(per_rank[0]) == len(kinds) * WORLD, label
        for key, msg in per_rank[0].items():
            assert per_rank[1][key] == msg, (label, key, msg, per_rank[1][key])
        msgs = {k: m for (k, b), m in per_rank[0].items() if b == 1}
        assert "dtype torch.float16, storage declares torch.float32" in msgs["dtype"]
        assert "is owned by rank 0, not 1" in msgs["foreign"]
        assert "is missing" in msgs["missing"]
        assert "fingerprint" in msgs["fingerprint"]
        assert "NotReadyError: exp_avg does not exist" in msgs["notready"]
        if "wrong_gpu" in msgs:
            assert "not this rank's current device cuda:1" in msgs["wrong_gpu"]


GROUP_TIMEOUT_S = 12.0


@pytest.mark.parametrize("mode", ["die", "die_in_preflight"])
def test_killed_rank(tmp_path, mode):
    """Rank 1 dies; rank 0 raises TransferError (mid-transfer) or PreflightError (in
    preflight, targets untouched) within the group timeout, and never hangs."""
    victim = 1
    env = dict(ENV, TORCH_NCCL_BLOCKING_WAIT="1")
    dev = "cuda" if HAVE_GPUS else "cpu"
    res = run_ranks(
        NW.w_killed, WORLD, tmp_path, backend=BACKEND, env=env, timeout=150,
        args=(victim, mode, dev, GROUP_TIMEOUT_S), expect_killed=[victim],
        group_timeout=GROUP_TIMEOUT_S,
    )  # fmt: skip
    assert res[victim] is None
    kind, seconds, msg, rounds = res[0]
    assert rounds > 5, rounds  # the victim dies while packing round 4: rounds remain
    if mode == "die":
        assert kind == "TransferError", res[0]
        assert "targets may be partially written" in msg
    else:
        assert kind == "PreflightError", res[0]
        assert "nothing was written" in msg
    assert seconds < 2 * GROUP_TIMEOUT_S + 10, res[0]


# The GPU host is offline: DeepSpeed is there only when benchmarks/h200.sh installed the wheels
# of benchmarks/prepare_wheels.sh. In the CPU dry run (RESHARD_MULTI_ON_GLOO=1) `make test`
# installs it, so there a missing DeepSpeed fails instead of skipping.
_NO_DS = HAVE_GPUS and importlib.util.find_spec("deepspeed") is None
_NO_DS_REASON = "DeepSpeed is not installed on this GPU machine (benchmarks/prepare_wheels.sh)"
DS_ENV = dict(ENV, DS_ACCELERATOR="cuda" if HAVE_GPUS else "cpu")


@pytest.mark.skipif(_NO_DS, reason=_NO_DS_REASON)
def test_deepspeed_offload_two_gpus(tmp_path):
    out = run_ranks(
        NW.w_deepspeed, WORLD, tmp_path, backend=BACKEND, env=DS_ENV, timeout=300,
        args=((1, 2, 3), ("mlp", "block"), 1 << 16, "cuda" if HAVE_GPUS else "cpu"),
    )  # fmt: skip
    for rank_out in out:
        assert len(rank_out) == 3 * 2 * 4, rank_out
        assert all(t[3] == BACKEND for t in rank_out)
    # ZeRO shards really crossed between the GPUs (not only local copies)
    assert any(t[2] > 0 for t in out[0] if t[1] != "tp")


@pytest.mark.skipif(not HAVE_GPUS, reason=f"needs {WORLD} CUDA devices")
@pytest.mark.skipif(_NO_DS, reason=_NO_DS_REASON)
def test_deepspeed_restore_two_gpus(tmp_path):
    configs = [(s, "cpu", "mlp") for s in (1, 2, 3)]
    out = run_ranks(
        NW.w_restore, WORLD, tmp_path, backend="nccl", env=DS_ENV, timeout=300,
        args=(configs, 1 << 14),
    )  # fmt: skip
    assert all(len(o) == len(configs) for o in out)
