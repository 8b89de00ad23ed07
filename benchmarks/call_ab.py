"""A repeated sync's per-call cost, before vs after a change of the call path, in one run.

    python benchmarks/call_ab.py REV --json benchmarks/results/cpu/call_ab.json

Loads `preflight.py`, `rounds.py` and `executor.py` of git revision REV next to the current
ones (as `reshard._rev_preflight` / `_rev_rounds` / `_rev_executor`, sharing the current
planning, staging and ops), then on 2 gloo ranks builds, per case, one `Transfer` of REV's executor and one of the
current executor over the same layouts (the sync_latency budget rule), and times their syncs
call by call, in rotating order, in the same processes, so load bursts on a shared machine hit
every variant alike. A third variant, `commit`, is the current code with the commit step
forced on every call (`preflight.COMMIT_SPREAD = 0`): its distance to `current` is what the
commit all-gather costs. Each sync is timed as in sync_latency.py (ranks aligned by a
barrier, each rank's own call timed, the slowest rank's); the phases come from each rank's `Report` (for REV, the time in its
`preflight.agree` stands in for `exchange`).

Cases: rl_weight_sync gpt-micro and gpt-mini, fsdp_resize gpt-mini, lora_sync gpt-125m (or
--cases). Only for call paths whose executor still fits the current rounds and staging
modules (REV close to the current code). Not part of the suite: run by hand.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _baselines as B  # noqa: E402
import _common as C  # noqa: E402
import _scenarios as S  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = (
    "rl_weight_sync/gpt-micro",
    "rl_weight_sync/gpt-mini",
    "fsdp_resize/gpt-mini",
    "lora_sync/gpt-125m",
)
VARIANTS = ("rev", "current", "commit")
PHASES = ("preflight", "exchange", "pack", "transport", "unpack", "local", "total")
progress = C.progress_logger("call_ab")


MODULES = ("preflight", "rounds", "executor")  # the call path, in import order


def load_rev(sources: dict) -> dict:
    """REV's call path (MODULES) as modules of the current package."""
    import reshard

    mods = {}
    for name in MODULES:
        text = (
            sources[name]
            .replace("from . import preflight as pf", "from . import _rev_preflight as pf")
            .replace("from .rounds import", "from ._rev_rounds import")
        )
        full = f"reshard._rev_{name}"
        mod = importlib.util.module_from_spec(importlib.util.spec_from_loader(full, loader=None))
        mod.__package__ = "reshard"
        sys.modules[full] = mod
        exec(compile(text, f"<rev {name}.py>", "exec"), mod.__dict__)
        setattr(reshard, f"_rev_{name}", mod)
        mods[name] = mod
    return mods


def _rank(rank, world, cfg):
    import torch

    torch.set_num_threads(1)
    rev = load_rev(cfg["sources"])
    agree_s = [0.0]  # seconds of the rev's last preflight.agree: its exchange
    rev_agree = rev["preflight"].agree

    def timed_agree(*a, **k):
        t0 = time.perf_counter()
        try:
            return rev_agree(*a, **k)
        finally:
            agree_s[0] = time.perf_counter() - t0

    rev["preflight"].agree = timed_agree
    out = {}
    for key in cfg["cases"]:
        out[key] = _time_case(key, rank, world, cfg, rev["executor"].Transfer, agree_s)
    return out


def _time_case(key, rank, world, cfg, rev_transfer, agree_s) -> dict:
    """{variant: [[sync s, phase s...] per call], "correct": bool, "params": int}."""
    import torch.distributed as dist

    import reshard as rs
    from reshard import preflight as pf

    scen, model = key.split("/")
    case = S.SCENARIOS[scen](model, rank, world, "cpu")
    budget = B.cpu_budget(case)
    transfers = {
        m: cls(case.src_layout, case.dst_layout, budget, group=dist.group.WORLD)
        for m, cls in (("rev", rev_transfer), ("current", rs.Transfer))
    }
    bufs = {v: case.targets() for v in VARIANTS}
    default_spread = pf.COMMIT_SPREAD

    def call(v):
        pf.COMMIT_SPREAD = 0.0 if v == "commit" else default_spread
        t = transfers["rev" if v == "rev" else "current"]
        sec, rep = C.timed_sync(lambda b: t(case.src_buffers, b), bufs[v], world, False)
        phases = dict(rep.seconds)
        if v == "rev":
            phases["exchange"] = agree_s[0]
        return [sec] + [phases.get(p, 0.0) for p in PHASES]

    try:
        for _ in range(cfg["warmup"]):
            for v in VARIANTS:
                call(v)
        rec = {v: [] for v in VARIANTS}
        for i in range(cfg["iters"]):
            k = i % len(VARIANTS)
            for v in VARIANTS[k:] + VARIANTS[:k]:
                rec[v].append(call(v))
    finally:
        pf.COMMIT_SPREAD = default_spread
    rec["correct"] = all(B.targets_correct(case, bufs[v]) for v in VARIANTS)
    rec["params"] = case.params
    return rec


def summarize(per_rank, cases) -> list:
    rows = []
    for key in cases:
        for v in VARIANTS:
            n = min(len(x[key][v]) for x in per_rank)
            # per call: the slowest rank's sync and, per phase, the largest rank's seconds
            calls = [
                [max(x[key][v][i][j] for x in per_rank) for j in range(1 + len(PHASES))]
                for i in range(n)
            ]
            col = [sorted(c[j] for c in calls) for j in range(1 + len(PHASES))]
            sync = col[0]
            rows.append(
                {
                    "case": key,
                    "variant": v,
                    "params": per_rank[0][key]["params"],
                    "calls": n,
                    "median_s": C.quantile(sync, 0.5),
                    "p10_s": C.quantile(sync, 0.1),
                    "p90_s": C.quantile(sync, 0.9),
                    "phases_median_s": {
                        p: C.quantile(col[1 + j], 0.5) for j, p in enumerate(PHASES)
                    },
                    "correct": all(x[key]["correct"] for x in per_rank),
                }
            )
    return rows


def markdown(record) -> str:
    meta, rows = record["meta"], record["results"]
    out = [
        f"# call_ab: {meta['rev']} vs the current call path, {meta['host']}, 2 gloo ranks",
        "",
        f"torch {meta['torch']}, {meta['cpus']} CPUs, load average {meta['loadavg']} at the "
        f"start and {meta['loadavg_end']} at the end; {meta['iters']} syncs per variant after "
        f"{meta['warmup']} warm-up rounds, variants interleaved call by call in the same "
        "processes (rotating order). `rev`: preflight.py + rounds.py + executor.py of the revision; "
        "`current`: this checkout; `commit`: this checkout with the commit all-gather on every "
        "call. Sync = each rank's call after a barrier, slowest rank (as sync_latency.py); phases: median over "
        "calls of the largest rank's Report seconds (rev's `exchange` = its time in "
        "preflight.agree, the agreement and the commit).",
        "",
        f"Command: `{meta['command']}`",
        "",
        "| case | variant | median ms | p10 ms | p90 ms | x current | preflight ms | exchange ms "
        "| local checks ms | pack | transport | unpack | local | ok |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    cur = {r["case"]: r for r in rows if r["variant"] == "current"}
    for r in rows:
        ph = {k: v * 1e3 for k, v in r["phases_median_s"].items()}
        out.append(
            f"| {r['case']} | {r['variant']} | {r['median_s'] * 1e3:.2f} | {r['p10_s'] * 1e3:.2f} "
            f"| {r['p90_s'] * 1e3:.2f} | {r['median_s'] / cur[r['case']]['median_s']:.2f} "
            f"| {ph['preflight']:.2f} | {ph['exchange']:.2f} "
            f"| {max(0.0, ph['preflight'] - ph['exchange']):.2f} | {ph['pack']:.2f} "
            f"| {ph['transport']:.2f} | {ph['unpack']:.2f} | {ph['local']:.2f} "
            f"| {'yes' if r['correct'] else 'NO'} |"
        )
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("rev", help="git revision whose call path (MODULES) is the 'rev'")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from reshard._launch import RanksFailed, launch

    sources = {
        name: subprocess.run(
            ["git", "show", f"{args.rev}:python/reshard/{name}.py"],
            cwd=ROOT,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        for name in MODULES
    }
    rev = subprocess.run(
        ["git", "rev-parse", "--short", args.rev],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    cases = args.cases.split(",")
    env = C.environment()
    cfg = {"sources": sources, "cases": cases, "iters": args.iters, "warmup": args.warmup}
    progress(f"{len(cases)} cases x {len(VARIANTS)} variants, {args.iters} syncs each")
    try:
        per_rank = launch(_rank, 2, args=(cfg,), prefix="reshard-call-ab-")
    except RanksFailed as exc:
        print(exc, file=sys.stderr)
        return 1
    meta = {
        **env,
        "rev": rev,
        "iters": args.iters,
        "warmup": args.warmup,
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "command": C.command_line("call_ab.py", argv),
    }
    record = {"meta": meta, "results": summarize(per_rank, cases)}
    if args.json:
        C.write_results(args.json, record, markdown)
    print(markdown(record))
    return 0 if all(r["correct"] for r in record["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
