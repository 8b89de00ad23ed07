"""The executor on real spawned gloo ranks, against independent references.

Each test spawns one set of ranks and checks many cases inside it (spawning costs ~3 s), for
both planners: "real" (reshard.plan) and "ref" (tests/distributed/_refplan.py, a brute-force
planner with one tiny message per round: the most rounds, the most double-buffer turns).
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _workers as W  # noqa: E402

from tests._spawn import run_ranks  # noqa: E402

PLANNERS = ["real", "ref"]
BUDGETS = [16, 1000, 64 << 20]


def _cases(world):
    r = list(range(world))
    cases = [
        (("zero3", r), ("tp", [r[:2]]), "fp32", "bf16"),  # rank 2.. of a bigger world idle
        (("zero12", r), ("tp", [r]), "fp32", "bf16"),
        (("tp", [r]), ("zero3", r), "bf16", "fp32"),  # back: rollout -> training
        (("zero12", r), ("zero3", r[::-1]), "fp32", "fp32"),  # resize-like: reversed ranks
        (("rep", r[:1]), ("zero12", r), "fp16", "bf16"),  # fp16 -> bf16 (wire: target dtype)
    ]
    if world == 4:
        cases.append((("zero3", r), ("tp", [[0, 1], [2, 3]]), "fp32", "bf16"))  # DP replicas
        # ranks 2 and 3 own nothing at all, yet take part (the preflight is collective)
        cases.append((("zero3", [0, 1]), ("zero12", [1, 0]), "fp32", "bf16"))
    return [c + (b,) for c in cases for b in BUDGETS]


def _check_bytes(results, world, label):
    """Rank r's bytes_sent[p] must equal rank p's bytes_received[r], case by case."""
    for c in range(len(results[0])):
        for r in range(world):
            for p, nb in results[r][c][1].items():
                got = results[p][c][2].get(r, 0)
                assert got == nb, f"{label} case {c}: {r}->{p} sent {nb}, {p} received {got}"


def _check_correct(res, world, planner):
    errs = [e for r in res for case in r for e in case[0]]
    assert not errs, "\n".join(errs[:20])
    _check_bytes(res, world, planner)
    # budget 16 B must really have cut the transfer into many rounds
    assert res[0][0][3] > 10, res[0][0][3]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("planner", PLANNERS)
def test_layouts_dtypes_budgets(tmp_path, world, planner):
    res = run_ranks(W.w_correct, world, tmp_path, args=(planner, _cases(world), {}), timeout=240)
    _check_correct(res, world, planner)


@pytest.mark.parametrize("planner", PLANNERS)
def test_world4_layouts_subgroups_balance(tmp_path, planner):
    """World 4 in one spawn: every layout/dtype/budget case (with 2 TP replicas); two disjoint
    2-rank subgroups transferring at once (layout ranks are group ranks: global 1,3 are group
    ranks 0,1); replicas on ranks 0,1 feeding TP targets on 2,3 with balanced senders."""
    res = run_ranks(W.w_world4, 4, tmp_path, args=(planner, _cases(4)), timeout=300)
    _check_correct([r["correct"] for r in res], 4, planner)

    sub = [r["subgroup"] for r in res]
    for gr, (errs, grank, gsize, _) in enumerate(sub):
        assert not errs, errs[:5]
        assert gsize == 2
        assert grank == {0: 0, 1: 0, 2: 1, 3: 1}[gr]
    assert any(r[3] for r in sub), "nothing crossed ranks: the test would not test p2p peers"

    bal = [r["balance"] for r in res]
    for errs, _ in bal:
        assert not errs, errs[:5]
    sent = [sum(r[1].values()) for r in bal]
    assert sent[2] == sent[3] == 0
    assert min(sent[:2]) > 0 and max(sent[:2]) <= 1.5 * min(sent[:2]), sent

    for errs, rounds in (r["rank_budget"] for r in res):
        assert not errs, errs[:5]
        assert planner == "ref" or rounds > 1  # the cap really cut the transfer into rounds


@pytest.mark.parametrize("planner", PLANNERS)
def test_repeated_transfer(tmp_path, planner):
    n = 100
    res = run_ranks(W.w_repeat, 2, tmp_path, args=(planner, n), timeout=240)
    for rank, (errs, rss, allocs, distinct_arenas, rounds) in enumerate(res):
        assert not errs, errs[:5]
        assert rounds > 1
        assert len(set(allocs)) == 1 and allocs[0] > 0, allocs
        assert distinct_arenas == 1, "arenas were reallocated between calls"
        # RSS after call 10 vs after call 100: flat (generous slack for allocator noise)
        assert rss[1] - rss[0] < 1 << 20, f"rank {rank} RSS grew {rss}"


def test_differing_plans_name_what_shaped_each_layout(tmp_path):
    """A rank whose described state laid its layout out otherwise (an integration's `notes`)
    is named with those notes in the one PreflightError every rank raises."""
    res = run_ranks(W.w_notes, 2, tmp_path)
    for errs, _ in res:
        assert not errs, "\n".join(errs)
    assert res[0][1] == res[1][1]
    assert "differs from rank 0's" in res[0][1]


def test_preflight_failures_are_collective(tmp_path):
    world, planner = 3, "real"
    res = run_ranks(W.w_preflight, world, tmp_path, args=(planner, W.PREFLIGHT_KINDS))
    for errs, _ in res:
        assert not errs, "\n".join(map(str, errs[:10]))
    # the same message on every rank, for every injected failure
    per_rank = [{(k, b): m for k, b, m in msgs} for _, msgs in res]
    assert len(per_rank[0]) == len(W.PREFLIGHT_KINDS) * world
    for key, msg in per_rank[0].items():
        for other in per_rank[1:]:
            assert other[key] == msg, (key, msg, other[key])
    msgs = {k: m for (k, b), m in per_rank[0].items() if b == 1}
    assert "dtype torch.float16, storage declares torch.float32" in msgs["dtype"]
    assert "elements, storage declares" in msgs["short"]
    assert "is owned by rank 2, not 1" in msgs["foreign"]
    assert "is missing" in msgs["missing"]
    assert "aliases source location" in msgs["alias"]
    assert "alias: both would write the same bytes" in msgs["alias_targets"]
    assert "fingerprint" in msgs["fingerprint"]
    assert "NotReadyError: exp_avg does not exist" in msgs["notready"]
    assert "staging allocation failed: OutOfMemoryError: cannot allocate" in msgs["oom"]
    assert "is on meta, but the gloo transport needs CPU buffers" in msgs["device"]
    for kind in ("refuse", "refuse_noplan"):
        assert "KeyError: 'buffers not ready' (injected)" in msgs[kind], msgs[kind]
        assert "fingerprint" not in msgs[kind], msgs[kind]


@pytest.mark.parametrize("mode", ["die", "stall", "die_in_preflight", "die_direct", "stall_direct"])
def test_dead_or_stalled_rank_raises_transfer_error(tmp_path, mode):
    """A rank dies (or stalls) mid-transfer: the others raise TransferError within the timeout.
    A rank that dies during preflight: the others raise PreflightError, nothing written.
    `_direct`: every message goes straight between buffers and rounds are posted ahead (the
    real planner cuts messages into wires)."""
    world, victim, timeout = 3, 1, 3.0
    res = run_ranks(
        W.w_killed,
        world,
        tmp_path,
        args=("real" if mode.endswith("_direct") else "ref", victim, mode, timeout),
        expect_killed=[victim] if mode.startswith("die") else [],
        group_timeout=30,
        timeout=120,
    )
    for rank, r in enumerate(res):
        if rank == victim and mode.startswith("die"):
            assert r is None
            continue
        kind, seconds, msg = r
        if mode == "die_in_preflight":
            assert kind == "PreflightError", (rank, r)
            assert "nothing was written" in msg
        else:
            assert kind == "TransferError", (rank, r)
            assert "targets may be partially written" in msg
        assert seconds < 3 * timeout + 10, (rank, seconds)


def test_random_layouts(tmp_path):
    """40 random (source layout, target layout, dtypes, budget) cases on 3 ranks, both
    planners, every target element checked against the reference."""
    seeds = list(range(40))
    res = run_ranks(W.w_fuzz, 3, tmp_path, args=(seeds, PLANNERS), timeout=300)
    errs = [e for r in res for e in r[0]]
    assert not errs, "\n".join(errs[:20])
    assert all(r[1] == len(seeds) * len(PLANNERS) for r in res)
