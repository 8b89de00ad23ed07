"""Sync latency: reshard vs what users do today, measured in the same run (CPU, gloo).

Scenario (`zero3_to_tp`): a ZeRO-3 sharded fp32 state of a transformer-shaped model -> TP=2
bf16 rollout buffers (the `reshard.demo` model). Methods:
- `reshard`: a `reshard.Transfer`, planned once, called every step.
- `gather_broadcast`: per parameter, gather the shards to rank 0 (dist.gather), rank 0 rebuilds
  the parameter and broadcasts it, every rank slices out its part (the "gather then
  broadcast" sync many RL frameworks run).
- `full_gather`: per parameter, all-gather the shards into the whole tensor on every rank,
  then slice (what `safe_get_full_fp32_param`-style syncs amount to).
Every method's targets are checked bitwise against an independent reference (plain torch
slicing of the logical tensors) after its last sync.

Reported per method: median and p90 latency over `--iters` syncs (after warm-up), peak extra
memory (staging/temporaries the method holds beyond sources and targets: measured for reshard
from its Report, accounted tensor by tensor for the baselines), and bytes received per rank.

    python benchmarks/sync_latency.py --quick
    python benchmarks/sync_latency.py --world 2 --hidden 1024 --layers 8 --json out.json

Scenarios and methods are plain functions in SCENARIOS / METHODS so the suite can grow (GPU,
NCCL, more layouts) without touching the harness.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist

import reshard as rs
from reshard.demo import Rollout, Zero3, _blocks, _shapes, _values

# ----------------------------------------------------------------- scenarios


class Scenario:
    """What every method needs: source shards, empty targets, how a full parameter maps to
    this rank's targets."""

    def __init__(self, rank, world, hidden, ffn, vocab, layers):
        self.rank, self.world = rank, world
        self.shapes = _shapes(hidden, ffn, vocab, layers)
        self.src = Zero3(self.shapes, world)
        self.dst = Rollout(self.shapes, world, 2 if world % 2 == 0 else world)
        self.values = _values(self.shapes, 0)
        self.shard = self.src.buffer(self.values, rank)
        self.src_layout, self.dst_layout = self.src.layout(), self.dst.layout()

    def targets(self):
        return self.dst.buffers(self.rank, "cpu")

    def write_param(self, name, full, bufs):
        """Copy this rank's part of a full parameter into its rollout buffers (with cast)."""
        d = self.dst
        g = next(g for g in d.groups if self.rank in g)
        t = g.index(self.rank)
        (h0, hs), (f0, fs), (v0, vs) = (_blocks(x, d.tp)[t] for x in (d.h, d.f, d.v))
        if name == "embed":
            key, off, part = "embed", 0, full[v0 : v0 + vs]
        elif full.dim() == 1:
            key, off, part = "norms", d.norms.index(name) * d.h, full
        else:
            layer, kind = name.split(".")
            if kind in "qkv":
                key, off, part = f"{layer}.qkv", "qkv".index(kind) * hs * d.h, full[h0 : h0 + hs]
            elif kind == "o":
                key, off, part = f"{layer}.o", 0, full[:, h0 : h0 + hs]
            elif kind == "fc1":
                key, off, part = f"{layer}.fc1", 0, full[f0 : f0 + fs]
            else:
                key, off, part = f"{layer}.fc2", 0, full[:, f0 : f0 + fs]
        buf = bufs[d.loc[(self.rank, key)]]
        buf[off : off + part.numel()].view(part.shape).copy_(part)


def zero3_to_tp(rank, world, quick):
    if quick:
        return Scenario(rank, world, hidden=130, ffn=346, vocab=501, layers=2)
    return Scenario(rank, world, hidden=1026, ffn=2752, vocab=8001, layers=6)


SCENARIOS = {"zero3_to_tp": zero3_to_tp}


# ----------------------------------------------------------------- methods
# A method takes the scenario and returns (step, info): step(bufs) runs one sync into bufs;
# info() returns {"peak_extra_bytes": int, "bytes_received": int} for the last step.


class _Peak:
    """Accounts temporaries tensor by tensor: live bytes and their peak."""

    def __init__(self):
        self.live = self.peak = 0

    def alloc(self, t):
        self.live += t.numel() * t.element_size()
        self.peak = max(self.peak, self.live)
        return t

    def free(self, t):
        self.live -= t.numel() * t.element_size()


def m_reshard(sc):
    sync = rs.Transfer(sc.src_layout, sc.dst_layout, budget_bytes_per_peer=4 << 20)
    last = {}

    def step(bufs):
        last["r"] = sync({sc.rank: sc.shard}, bufs)

    def info():
        r = last["r"]
        return {
            "peak_extra_bytes": sum(r.peak_staging_bytes.values()),
            "bytes_received": r.total_bytes_received,
            "rounds": r.rounds,
            "seconds": r.seconds,  # the last sync's phases
        }

    return step, info


def _chunk_views(sc, name):
    c = sc.src.chunk[name]
    off = sc.src.offset[name]
    return c, sc.shard[off : off + c]


def m_gather_broadcast(sc):
    acct = {"recv": 0}
    peak = _Peak()

    def step(bufs):
        peak.live = peak.peak = 0
        acct["recv"] = 0
        for name, shape in sc.shapes.items():
            c, mine = _chunk_views(sc, name)
            numel = math.prod(shape)
            if sc.rank == 0:
                parts = [peak.alloc(torch.empty(c)) for _ in range(sc.world)]
                dist.gather(mine, parts, dst=0)
                full = peak.alloc(torch.cat(parts)[:numel].reshape(shape))
                for p in parts:
                    peak.free(p)
                acct["recv"] += (sc.world - 1) * c * 4
            else:
                dist.gather(mine, None, dst=0)
                full = peak.alloc(torch.empty(shape))
                acct["recv"] += numel * 4
            dist.broadcast(full, src=0)
            sc.write_param(name, full, bufs)
            peak.free(full)

    return step, lambda: {"peak_extra_bytes": peak.peak, "bytes_received": acct["recv"]}


# torch 2.13 deprecates all_gather_into_tensor for all_gather_single; 2.11 lacks the latter.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def m_full_gather(sc):
    acct = {"recv": 0}
    peak = _Peak()

    def step(bufs):
        peak.live = peak.peak = 0
        acct["recv"] = 0
        for name, shape in sc.shapes.items():
            c, mine = _chunk_views(sc, name)
            flat = peak.alloc(torch.empty(c * sc.world))
            _all_gather_flat(flat, mine)
            acct["recv"] += (sc.world - 1) * c * 4
            sc.write_param(name, flat[: math.prod(shape)].view(shape), bufs)
            peak.free(flat)

    return step, lambda: {"peak_extra_bytes": peak.peak, "bytes_received": acct["recv"]}


METHODS = {
    "reshard": m_reshard,
    "gather_broadcast": m_gather_broadcast,
    "full_gather": m_full_gather,
}


# ----------------------------------------------------------------- harness


def _bench_rank(rank, world, args, out_path):
    try:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        dist.init_process_group(
            "gloo",
            store=dist.FileStore(args["store"], world),
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=300),
        )
        try:
            result = _measure(rank, world, args)
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - the parent prints it and exits non-zero
        result = {"error": traceback.format_exc()}
    with open(out_path, "w") as f:
        json.dump(result, f)


def _measure(rank, world, args):
    sc = SCENARIOS[args["scenario"]](rank, world, args["quick"])
    out = {"params": sum(math.prod(s) for s in sc.shapes.values()), "methods": {}}
    reference = sc.dst.reference(sc.values, rank)  # independent: plain torch slicing
    for name in args["methods"]:
        step, info = METHODS[name](sc)
        bufs = sc.targets()
        for _ in range(args["warmup"]):
            step(bufs)
        times = []
        for _ in range(args["iters"]):
            dist.barrier()
            t0 = time.perf_counter()
            step(bufs)
            dist.barrier()
            times.append(time.perf_counter() - t0)
        correct = all(
            torch.equal(bufs[k].view(torch.int16), v.view(torch.int16))
            for k, v in reference.items()
        )
        times.sort()
        out["methods"][name] = {
            "median_s": statistics.median(times),
            "p90_s": times[min(len(times) - 1, int(0.9 * len(times)))],
            "correct": correct,
            **info(),
        }
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--scenario", choices=sorted(SCENARIOS), default="zero3_to_tp")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="small model, few iterations")
    ap.add_argument("--json", default=None, help="write results to this file")
    args = ap.parse_args(argv)
    methods = args.methods.split(",")
    for m in methods:
        if m not in METHODS:
            ap.error(f"unknown method {m!r}; choose from {sorted(METHODS)}")
    iters = args.iters or (5 if args.quick else 20)
    ctx = torch.multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="reshard-bench-") as tmp:
        cfg = {
            "store": os.path.join(tmp, "store"),
            "scenario": args.scenario,
            "quick": args.quick,
            "methods": methods,
            "iters": iters,
            "warmup": args.warmup,
        }
        outs = [os.path.join(tmp, f"rank{r}.json") for r in range(args.world)]
        procs = [
            ctx.Process(target=_bench_rank, args=(r, args.world, cfg, outs[r]))
            for r in range(args.world)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(3600)
        results = []
        for r, path in enumerate(outs):
            if not os.path.exists(path):
                print(f"rank {r} died (exit code {procs[r].exitcode})", file=sys.stderr)
                return 1
            with open(path) as f:
                results.append(json.load(f))
    for r, x in enumerate(results):
        if "error" in x:
            print(f"rank {r} failed:\n{x['error']}", file=sys.stderr)
            return 1
    env = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "world": args.world,
        "backend": "gloo",
        "scenario": args.scenario,
        "iters": iters,
        "params": results[0]["params"],
    }
    print(
        f"sync_latency: {args.scenario}, {env['params'] / 1e6:.2f}M params, world "
        f"{args.world}, gloo, torch {env['torch']}, {env['cpus']} CPUs, {iters} iters"
    )
    print(
        f"{'method':<18}{'median ms':>11}{'p90 ms':>9}{'vs reshard':>11}"
        f"{'peak extra MiB':>16}{'recv MiB/rank':>15}  correct"
    )
    rows = {}
    base = None
    for m in methods:
        per = [x["methods"][m] for x in results]
        med = max(p["median_s"] for p in per)  # the slowest rank sets the sync's latency
        p90 = max(p["p90_s"] for p in per)
        peak = max(p["peak_extra_bytes"] for p in per)
        recv = max(p["bytes_received"] for p in per)
        correct = all(p["correct"] for p in per)
        base = base or (med if m == "reshard" else None)
        ratio = f"{med / base:.2f}x" if base else "-"
        rows[m] = {
            "median_s": med,
            "p90_s": p90,
            "peak_extra_bytes": peak,
            "bytes_received_max_rank": recv,
            "correct": correct,
        }
        print(
            f"{m:<18}{med * 1e3:>11.2f}{p90 * 1e3:>9.2f}{ratio:>11}{peak / 2**20:>16.2f}"
            f"{recv / 2**20:>15.2f}  {correct}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "methods": rows, "per_rank": results}, f, indent=1)
    return 0 if all(r["correct"] for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
