"""reshard's latency/memory trade-off against the per-peer budget, budgets interleaved.

On a shared, loaded machine back-to-back runs drift by 2-3x; here every budget gets its own
`Transfer` and the syncs go round-robin over the budgets (b0, b1, ..., b0, b1, ...), so each
budget sees the same load. Also reports each budget's rounds and the last sync's phases.

    python benchmarks/_sync_budget.py --scenario offload_fp32 --model gpt-mini \\
        --budgets-kib 256,512,1024,4096,16384 --json benchmarks/results/cpu/sync_latency_budget.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _scenarios as S  # noqa: E402
import sync_latency as SL  # noqa: E402

import reshard as rs  # noqa: E402
from reshard._launch import RanksFailed, launch  # noqa: E402


def _rank(rank, world, cfg):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    case = S.SCENARIOS[cfg["scenario"]](cfg["model"], rank, world)
    syncs, bufs, times, reps = {}, {}, {}, {}
    for kib in cfg["budgets"]:
        syncs[kib] = rs.Transfer(
            case.src_layout, case.dst_layout, kib << 10, group=dist.group.WORLD
        )
        bufs[kib] = case.targets()
        for _ in range(2):  # first sync (staging allocation) + one warm-up
            syncs[kib](case.src_buffers, bufs[kib])
        times[kib] = []
    for _ in range(cfg["iters"]):
        for kib in cfg["budgets"]:
            seconds, reps[kib] = SL.timed_sync(
                lambda b, s=syncs[kib]: s(case.src_buffers, b), bufs[kib], world, cuda=False
            )
            times[kib].append(seconds)
    out = {}
    for kib in cfg["budgets"]:
        ok = SL.targets_correct(case, bufs[kib])
        r = reps[kib]
        out[kib] = {
            "times": times[kib],
            "rounds": r.rounds,
            "staging_bytes": sum(r.peak_staging_bytes.values()),
            "phases_s": r.seconds,
            "correct": ok,
        }
    return {"params": case.params, "budgets": out}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenario", default="offload_fp32", choices=sorted(S.SCENARIOS))
    ap.add_argument("--model", default="gpt-mini", choices=list(S.MODELS))
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--budgets-kib", default="256,512,1024,4096,16384")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    budgets = [int(x) for x in args.budgets_kib.split(",")]
    if any(b <= 0 for b in budgets) or args.world < 2:
        ap.error("budgets must be positive and --world >= 2")
    cfg = {
        "scenario": args.scenario,
        "model": args.model,
        "budgets": budgets,
        "iters": args.iters,
    }
    try:
        per = launch(_rank, args.world, args=(cfg,), prefix="reshard-budget-")
    except RanksFailed as exc:
        print(exc, file=sys.stderr)
        return 1
    rows = []
    for kib in budgets:
        recs = [x["budgets"][str(kib)] for x in per]
        t = sorted(max(rec["times"][i] for rec in recs) for i in range(args.iters))
        rows.append(
            {
                "budget_bytes_per_peer": kib << 10,
                "median_s": statistics.median(t),
                "p90_s": t[int(0.9 * (len(t) - 1))],
                "rounds": recs[0]["rounds"],
                "staging_bytes": max(rec["staging_bytes"] for rec in recs),
                "phases_s": recs[0]["phases_s"],
                "correct": all(rec["correct"] for rec in recs),
            }
        )
    meta = {
        "scenario": args.scenario,
        "model": args.model,
        "params": per[0]["params"],
        "world": args.world,
        "iters": args.iters,
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        "torch": torch.__version__,
        "command": "python benchmarks/_sync_budget.py " + " ".join(argv or sys.argv[1:]),
    }
    print(
        f"{args.scenario} {args.model} world {args.world}, budgets interleaved, {args.iters} each"
    )
    print("| budget KiB | rounds | staging MiB | median ms | p90 ms | ok |")
    print("|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(
            f"| {r['budget_bytes_per_peer'] >> 10} | {r['rounds']} | "
            f"{r['staging_bytes'] / 2**20:.2f} | {r['median_s'] * 1e3:.1f} | "
            f"{r['p90_s'] * 1e3:.1f} | {'yes' if r['correct'] else 'NO'} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=1)
    return 0 if all(r["correct"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
