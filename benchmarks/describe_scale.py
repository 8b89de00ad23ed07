"""Describe-and-plan cost at scale: building layouts of 10**3 .. 10**5 small tensors.

    python benchmarks/describe_scale.py                  # N = 1e3, 1e4, 1e5; W = 2, 8, 64
    python benchmarks/describe_scale.py --n 1000 --w 8   # one cell
    python benchmarks/describe_scale.py --max-pieces 2e6 # skip plan where pieces exceed this

Per (N tensors, W ranks), each the min of --repeat runs:
  zero:     the ZeRO-3 layout as `deepspeed_live.describe()` builds it once it has read the
            engine (`ZeroGeometry.placement`, the layouts of its runs, `rs.Layout`), for
            an engine whose params all sit in one sub-group;
  tp:       a tensor-parallel layout of the same tensors (`rs.split` of dim 0 over W ranks,
            shards back to back per rank, as the vLLM integration builds it);
  plan:     `rs.plan(zero, tp)`;
  transfer: `rs.Transfer(zero, tp)` (plans, then its local setup; no collective);
  schedule: `plan.schedule(0)`, the per-rank pass a first call runs.
Shapes cycle through (64,), (64, 64), (128, 64). Writes benchmarks/results/cpu/describe_scale.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time

import torch

import reshard as rs
from reshard.integrations import deepspeed_geometry as geometry
from reshard.integrations.deepspeed_geometry import Entry, ZeroGeometry, shard_runs

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "cpu")
SHAPES = ((64,), (64, 64), (128, 64))
FLAT_LAYOUTS = getattr(geometry, "flat_layouts", None)


def shapes_of(n) -> dict:
    return {f"layers.{i // 3}.w{i % 3}": SHAPES[i % 3] for i in range(n)}


class Zero3Sketch(ZeroGeometry):
    """The ZeRO-3 geometry of an engine whose params all sit in one sub-group, without the
    engine: `placement()` is the integration's own code."""

    def __init__(self, shapes, world):  # noqa: D107 - no engine to read
        self.world, self.dp_rank, self.frozen = world, 0, []
        entries, offset = [], 0
        for name, shape in shapes.items():
            entries.append(Entry(None, name, shape, offset))
            offset += -(-math.prod(shape) // world)
        self.units, self.numel = [entries], offset

    def storage_numel(self, kind, u):
        return self.numel

    def runs(self, kind, u, entry):
        return shard_runs(math.prod(entry.shape), entry.offset, self.world)


def zero_layout(shapes, world):
    """What describe() does after reading the engine: `placement()`, the layouts of its runs
    (`flat_layouts`; `rs.flat` per param in trees that lack it), `rs.Layout`."""
    geo = Zero3Sketch(shapes, world)
    storages, runs = geo.placement("fp32", list(range(world)), {0: torch.float32})
    if FLAT_LAYOUTS is not None:
        tensors = FLAT_LAYOUTS(runs)
    else:
        tensors = {name: rs.flat(shape, r) for name, (shape, r) in runs.items()}
    return rs.Layout(tensors, storages)


def tp_layout(shapes, world):
    """Dim 0 of every tensor split over `world` ranks (uneven blocks where it does not
    divide), each rank's blocks back to back in one buffer."""
    tensors, used = {}, [0] * world
    for name, shape in shapes.items():
        q, r = divmod(shape[0], world)
        sizes = [q + (k < r) for k in range(world)]
        row = 1
        for n in shape[1:]:
            row *= n
        tensors[name] = rs.split(shape, 0, sizes, list(range(world)), offsets=list(used), name=name)
        used = [u + s * row for u, s in zip(used, sizes)]
    storages = {r: rs.Storage(r, torch.float32, used[r]) for r in range(world)}
    return rs.Layout(tensors, storages)


def timed(fn, repeat):
    best, out = float("inf"), None
    for _ in range(repeat):
        out = None
        gc.collect()
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def cell(n, world, repeat, max_pieces) -> dict:
    shapes = shapes_of(n)
    t_zero, zero = timed(lambda: zero_layout(shapes, world), repeat)
    t_tp, tp = timed(lambda: tp_layout(shapes, world), repeat)
    pieces = sum(len(t) for t in zero.tensors.values()) + sum(len(t) for t in tp.tensors.values())
    row = {
        "tensors": n,
        "world": world,
        "pieces": pieces,
        "zero_s": t_zero,
        "tp_s": t_tp,
    }
    if pieces <= max_pieces:
        t_plan, p = timed(lambda: rs.plan(zero, tp), repeat)
        t_xfer, _ = timed(lambda: rs.Transfer(zero, tp), repeat)
        t0 = time.perf_counter()
        p.schedule(0)
        row.update(
            plan_s=t_plan,
            transfer_s=t_xfer,
            schedule0_s=time.perf_counter() - t0,
            fingerprint=p.fingerprint,
        )
    return row


def fmt_row(r) -> str:
    def ms(key):
        return f"{r[key] * 1e3:10.1f}" if key in r else f"{'-':>10}"

    per = f"{r['plan_s'] / r['tensors'] * 1e6:9.1f}" if "plan_s" in r else f"{'-':>9}"
    return (
        f"{r['tensors']:>7} {r['world']:>4} {r['pieces']:>9} {ms('zero_s')} {ms('tp_s')} "
        f"{ms('plan_s')} {per} {ms('transfer_s')} {ms('schedule0_s')}"
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--n", type=int, nargs="*", default=[1000, 10000, 100000])
    ap.add_argument("--w", type=int, nargs="*", default=[2, 8, 64])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--max-pieces", type=float, default=4e6, help="skip plan above this")
    ap.add_argument("--out", default=os.path.join(OUT, "describe_scale.json"))
    args = ap.parse_args()
    print(
        f"{'tensors':>7} {'W':>4} {'pieces':>9} {'zero ms':>10} {'tp ms':>10} {'plan ms':>10} "
        f"{'plan us/t':>9} {'xfer ms':>10} {'sched0 ms':>10}"
    )
    rows = []
    for n in args.n:
        for w in args.w:
            repeat = args.repeat if n < 100000 else 1
            rows.append(cell(n, w, repeat, args.max_pieces))
            print(fmt_row(rows[-1]), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"python": sys.version.split()[0], "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
