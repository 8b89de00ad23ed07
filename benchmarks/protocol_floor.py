"""What the smallest sync protocol costs on this machine's gloo, next to reshard's syncs.

    python benchmarks/protocol_floor.py --json benchmarks/results/cpu/protocol_floor.json

On 2 gloo ranks, per case (default: rl_weight_sync gpt-micro and gpt-mini), in the same
processes and interleaved call by call (rotating order), each timed as sync_latency.py times a
sync (ranks aligned by a barrier, each rank's own call, the slowest rank's):
- `barrier`: one dist.barrier;
- `all_gather`: one all-gather of 3 int64 per rank (the size of the preflight's agreement row);
- `p2p`: one message each way between the ranks, of the bytes reshard's plan sends from
  each rank (its largest total of one rank), receives posted first;
- `all_gather+p2p`: both in sequence: one small collective to agree, then one exchange
  holding every byte that must cross: the least a sync that agrees before writing can cost
  over this transport, local copies not counted;
- `all_gather+p2p+local`: the same with the rank's local bytes copied (one memcpy of that many
  bytes) while the exchange is in flight: the least a whole sync of the case can cost here;
- `reshard`: one sync of the case's reshard.Transfer (the sync_latency budget rule).
The physical floor (sync_latency.py's definition, link rates measured here) is printed with
them: a goal of N x floor that lies below `all_gather+p2p` cannot be met by any protocol
that keeps one collective per sync on this transport.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _baselines as B  # noqa: E402
import _common as C  # noqa: E402
import _scenarios as S  # noqa: E402
import sync_latency as SL  # noqa: E402

CASES = ("rl_weight_sync/gpt-micro", "rl_weight_sync/gpt-mini")
VARIANTS = ("barrier", "all_gather", "p2p", "all_gather+p2p", "all_gather+p2p+local", "reshard")
progress = C.progress_logger("protocol_floor")


def _rank(rank, world, cfg):
    import torch

    torch.set_num_threads(1)
    out = {"links": SL.link_bandwidth(rank, world, False), "cases": {}}
    for key in cfg["cases"]:
        out["cases"][key] = _time_case(key, rank, world, cfg)
    return out


def _time_case(key, rank, world, cfg) -> dict:
    import torch
    import torch.distributed as dist

    import reshard as rs

    pg, peer = dist.group.WORLD, 1 - rank
    scen, model = key.split("/")
    case = S.SCENARIOS[scen](model, rank, world, "cpu")
    sync = rs.Transfer(case.src_layout, case.dst_layout, B.cpu_budget(case), group=pg)
    bufs = case.targets()
    rep = sync(case.src_buffers, bufs)
    most = torch.tensor([rep.total_bytes_sent, rep.total_bytes_received])
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    nbytes = int(most.max())
    a = torch.ones(nbytes, dtype=torch.uint8)
    b = torch.empty(nbytes, dtype=torch.uint8)
    row = torch.zeros(3, dtype=torch.int64)
    rows = torch.zeros(3 * world, dtype=torch.int64)
    local_src = torch.ones(max(1, rep.local_bytes), dtype=torch.uint8)
    local_dst = torch.empty_like(local_src)

    def p2p(during=None):
        works = [pg.recv([b], peer, 0), pg.send([a], peer, 0)]
        if during is not None:
            during()
        for w in works:
            w.wait()

    def all_gather():
        dist.all_gather_into_tensor(rows, row)

    def both():
        all_gather()
        p2p()

    def whole():
        all_gather()
        p2p(lambda: local_dst.copy_(local_src))

    steps = {
        "barrier": dist.barrier,
        "all_gather": all_gather,
        "p2p": p2p,
        "all_gather+p2p": both,
        "all_gather+p2p+local": whole,
        "reshard": lambda: sync(case.src_buffers, bufs),
    }
    for _ in range(cfg["warmup"]):
        for v in VARIANTS:
            steps[v]()
    rec = {v: [] for v in VARIANTS}
    for i in range(cfg["iters"]):
        k = i % len(VARIANTS)
        for v in VARIANTS[k:] + VARIANTS[:k]:
            rec[v].append(C.timed_sync(lambda _, f=steps[v]: f(), None, world, False)[0])
    return {
        "times": rec,
        "bytes": nbytes,
        "recv_bytes": rep.total_bytes_received,
        "local_bytes": rep.local_bytes,
        "rounds": rep.rounds,
        "params": case.params,
        "correct": B.targets_correct(case, bufs),
    }


def summarize(per_rank, cases) -> list:
    links = per_rank[0]["links"]
    rows = []
    for key in cases:
        recs = [x["cases"][key] for x in per_rank]
        floor = max(
            max(r["recv_bytes"] / links["gloo_p2p_Bps"], r["local_bytes"] / links["host_copy_Bps"])
            for r in recs
        )
        for v in VARIANTS:
            n = min(len(r["times"][v]) for r in recs)
            t = sorted(max(r["times"][v][i] for r in recs) for i in range(n))
            rows.append(
                {
                    "case": key,
                    "variant": v,
                    "params": recs[0]["params"],
                    "bytes_each_way": recs[0]["bytes"],
                    "rounds": recs[0]["rounds"],
                    "calls": n,
                    "median_s": C.quantile(t, 0.5),
                    "p10_s": C.quantile(t, 0.1),
                    "p90_s": C.quantile(t, 0.9),
                    "floor_s": floor,
                    "correct": all(r["correct"] for r in recs),
                }
            )
    return rows


def markdown(record) -> str:
    meta, rows = record["meta"], record["results"]
    out = [
        f"# protocol_floor: the least a sync costs on gloo here, {meta['host']}, 2 ranks",
        "",
        f"torch {meta['torch']}, {meta['cpus']} CPUs, load average {meta['loadavg']} at the "
        f"start and {meta['loadavg_end']} at the end; {meta['iters']} calls per variant after "
        f"{meta['warmup']} warm-up rounds, variants interleaved call by call in the same "
        "processes (rotating order); each call timed per rank after a barrier, the slowest "
        "rank's. `p2p`: one message each way of the bytes reshard sends per rank; "
        "`all_gather+p2p`: one small all-gather, then that exchange; `+local`: with the rank's "
        "local bytes copied while the exchange is in flight. `floor`: sync_latency's "
        "physical floor (wire bytes / link, local bytes / copy bandwidth; links measured in "
        "this run).",
        "",
        f"Command: `{meta['command']}`",
        "",
        "| case | variant | bytes each way | median ms | p10 ms | p90 ms | x floor | floor ms | ok |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['case']} | {r['variant']} | {r['bytes_each_way']} | "
            f"{r['median_s'] * 1e3:.3f} | {r['p10_s'] * 1e3:.3f} | {r['p90_s'] * 1e3:.3f} | "
            f"{r['median_s'] / r['floor_s']:.2f} | {r['floor_s'] * 1e3:.3f} | "
            f"{'yes' if r['correct'] else 'NO'} |"
        )
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from reshard._launch import RanksFailed, launch

    cases = args.cases.split(",")
    env = C.environment()
    cfg = {"cases": cases, "iters": args.iters, "warmup": args.warmup}
    progress(f"{len(cases)} cases x {len(VARIANTS)} variants, {args.iters} calls each")
    try:
        per_rank = launch(_rank, 2, args=(cfg,), prefix="reshard-protocol-floor-")
    except RanksFailed as exc:
        print(exc, file=sys.stderr)
        return 1
    meta = {
        **env,
        "iters": args.iters,
        "warmup": args.warmup,
        "links": per_rank[0]["links"],
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "command": C.command_line("protocol_floor.py", argv),
    }
    record = {"meta": meta, "results": summarize(per_rank, cases)}
    if args.json:
        C.write_results(args.json, record, markdown)
    print(markdown(record))
    return 0 if all(r["correct"] for r in record["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
