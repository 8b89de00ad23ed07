"""`python -m reshard.demo` (`make demo`): a trainer -> rollout weight sync, end to end.

Default (`--mode deepspeed`, when DeepSpeed is importable): a real DeepSpeed ZeRO-3 engine with
CPU-offloaded optimizer trains a few steps, syncing bf16 params into TP=2 rollout buffers after
each step and fp32 masters + Adam moments into a snapshot; see integrations/deepspeed_demo.py.
`--mode synthetic`, described below, needs no DeepSpeed.

Spawns ranks (gloo on CPU, 2 by default; NCCL when there are >= 2 GPUs), builds a ZeRO-3 style
sharded fp32 state of a small transformer-shaped model (every parameter's flat form cut evenly
across ranks, padded; shards deliberately uneven), and syncs it into TP=2 rollout buffers in
bf16: a fused QKV buffer per layer, column splits (fc1, vocab-split embedding), row splits (o,
fc2), replicated norms. fp32 -> bf16 happens on the wire. Every target element is checked
against a reference computed independently (plain torch slicing of the logical tensors), and
the demo exits non-zero on any mismatch.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

import reshard as rs
from reshard._launch import RanksFailed, launch

POISON = -1234.5


def _shapes(hidden, ffn, vocab, layers):
    shapes = {"embed": (vocab, hidden)}
    for i in range(layers):
        shapes |= {f"l{i}.ln1": (hidden,), f"l{i}.q": (hidden, hidden)}
        shapes |= {f"l{i}.k": (hidden, hidden), f"l{i}.v": (hidden, hidden)}
        shapes |= {f"l{i}.o": (hidden, hidden), f"l{i}.ln2": (hidden,)}
        shapes |= {f"l{i}.fc1": (ffn, hidden), f"l{i}.fc2": (hidden, ffn)}
    shapes["norm"] = (hidden,)
    return shapes


def _values(shapes, step):
    """The 'trained' weights at a step: seeded, identical in every process."""
    out = {}
    for i, (name, shape) in enumerate(shapes.items()):
        g = torch.Generator().manual_seed(step * 100003 + i)
        out[name] = torch.randn(shape, generator=g)
    return out


def _blocks(n, parts):
    base, extra = divmod(n, parts)
    sizes = [base + (i < extra) for i in range(parts)]
    return [(sum(sizes[:i]), sizes[i]) for i in range(parts)]


class Zero3:
    """Source: rank r's flat fp32 buffer holds chunk r of every parameter (ceil(numel/W))."""

    def __init__(self, shapes, world):
        self.shapes, self.world = shapes, world
        self.chunk = {n: math.ceil(math.prod(s) / world) for n, s in shapes.items()}
        self.offset, off = {}, 0
        for n in shapes:
            self.offset[n], off = off, off + self.chunk[n]
        self.numel = off

    def layout(self):
        tensors = {}
        for n, s in self.shapes.items():
            c, numel = self.chunk[n], math.prod(s)
            runs = [
                (r, r * c, min((r + 1) * c, numel), self.offset[n])
                for r in range(self.world)
                if r * c < numel
            ]
            tensors[n] = rs.flat(s, runs)
        storages = {r: rs.Storage(r, torch.float32, self.numel) for r in range(self.world)}
        return rs.Layout(tensors, storages)

    def buffer(self, values, rank):
        parts = []
        for n in self.shapes:
            c = self.chunk[n]
            piece = values[n].reshape(-1)[rank * c : (rank + 1) * c]
            parts += [piece, torch.full((c - piece.numel(),), float("nan"))]  # padding: NaN
        return torch.cat(parts)


class Rollout:
    """Target: TP groups of `tp` ranks (world // tp data-parallel replicas), bf16 buffers."""

    def __init__(self, shapes, world, tp):
        self.shapes, self.tp = shapes, tp
        self.groups = [list(range(g, g + tp)) for g in range(0, world, tp)]
        self.layers = sum(1 for n in shapes if n.endswith(".q"))
        self.norms = [n for n, s in shapes.items() if len(s) == 1]
        self.h, self.f, self.v = shapes["norm"][0], shapes["l0.fc1"][0], shapes["embed"][0]
        self.loc, self.storages = {}, {}
        for g in self.groups:
            for t, r in enumerate(g):
                (_, hs), (_, fs), (_, vs) = (_blocks(x, tp)[t] for x in (self.h, self.f, self.v))
                sizes = {"embed": vs * self.h, "norms": self.h * len(self.norms)}
                for i in range(self.layers):
                    sizes |= {f"l{i}.qkv": 3 * hs * self.h, f"l{i}.o": self.h * hs}
                    sizes |= {f"l{i}.fc1": fs * self.h, f"l{i}.fc2": self.h * fs}
                for key, numel in sizes.items():
                    loc = 1000 + len(self.storages)
                    self.loc[(r, key)] = loc
                    self.storages[loc] = rs.Storage(r, torch.bfloat16, numel)

    def layout(self):
        pieces = {n: [] for n in self.shapes}
        h = self.h
        for g in self.groups:
            for t, r in enumerate(g):
                (h0, hs), (f0, fs), (v0, vs) = (_blocks(x, self.tp)[t] for x in (h, self.f, self.v))
                pieces["embed"].append(rs.Piece(self.loc[(r, "embed")], 0, (v0, 0), (vs, h)))
                for j, n in enumerate(self.norms):
                    pieces[n].append(rs.Piece(self.loc[(r, "norms")], j * h, (0,), (h,)))
                for i in range(self.layers):
                    qkv = self.loc[(r, f"l{i}.qkv")]
                    for j, x in enumerate("qkv"):
                        pieces[f"l{i}.{x}"].append(rs.Piece(qkv, j * hs * h, (h0, 0), (hs, h)))
                    o, fc2 = self.loc[(r, f"l{i}.o")], self.loc[(r, f"l{i}.fc2")]
                    pieces[f"l{i}.o"].append(rs.Piece(o, 0, (0, h0), (h, hs)))
                    pieces[f"l{i}.fc1"].append(
                        rs.Piece(self.loc[(r, f"l{i}.fc1")], 0, (f0, 0), (fs, h))
                    )
                    pieces[f"l{i}.fc2"].append(rs.Piece(fc2, 0, (0, f0), (h, fs)))
        tensors = {n: rs.TensorLayout(self.shapes[n], p) for n, p in pieces.items()}
        return rs.Layout(tensors, dict(self.storages))

    def buffers(self, rank, device):
        return {
            loc: torch.full((s.numel,), POISON, dtype=torch.bfloat16, device=device)
            for loc, s in self.storages.items()
            if s.rank == rank
        }

    def write_part(self, name, full, bufs, rank):
        """Write `rank`'s TP part of the full parameter `name` into its buffers `bufs` (plain
        torch slicing, as a rollout engine loading a checkpoint would). No-op for a rank
        outside every TP group."""
        g = next((g for g in self.groups if rank in g), None)
        if g is None:
            return
        t = g.index(rank)
        (h0, hs), (f0, fs), (v0, vs) = (_blocks(x, self.tp)[t] for x in (self.h, self.f, self.v))
        if name == "embed":
            key, off, part = "embed", 0, full[v0 : v0 + vs]
        elif full.dim() == 1:
            key, off, part = "norms", self.norms.index(name) * self.h, full
        else:
            layer, kind = name.split(".")
            if kind in ("q", "k", "v"):
                key, off = f"{layer}.qkv", "qkv".index(kind) * hs * self.h
                part = full[h0 : h0 + hs]
            elif kind == "o":
                key, off, part = f"{layer}.o", 0, full[:, h0 : h0 + hs]
            elif kind == "fc1":
                key, off, part = f"{layer}.fc1", 0, full[f0 : f0 + fs]
            else:
                key, off, part = f"{layer}.fc2", 0, full[:, f0 : f0 + fs]
        bufs[self.loc[(rank, key)]][off : off + part.numel()].view(part.shape).copy_(part)

    def reference(self, values, rank):
        """What each of this rank's buffers must hold: plain torch slicing, then bf16."""
        g = next(g for g in self.groups if rank in g)
        t = g.index(rank)
        (h0, hs), (f0, fs), (v0, vs) = (_blocks(x, self.tp)[t] for x in (self.h, self.f, self.v))
        want = {
            "embed": values["embed"][v0 : v0 + vs],
            "norms": torch.cat([values[n] for n in self.norms]),
        }
        for i in range(self.layers):
            p = f"l{i}."
            want[p + "qkv"] = torch.cat([values[p + x][h0 : h0 + hs] for x in "qkv"])
            want[p + "o"] = values[p + "o"][:, h0 : h0 + hs]
            want[p + "fc1"] = values[p + "fc1"][f0 : f0 + fs]
            want[p + "fc2"] = values[p + "fc2"][:, f0 : f0 + fs]
        return {self.loc[(rank, k)]: v.reshape(-1).to(torch.bfloat16) for k, v in want.items()}


def _rank_body(rank, world, backend, cfg):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if cfg.get("mode") == "deepspeed":
        from .integrations import deepspeed_demo

        return deepspeed_demo.run_rank(rank, world, backend, cfg)
    return _sync(rank, world, backend, cfg)


def _sync(rank, world, backend, cfg):
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    shapes = _shapes(cfg["hidden"], cfg["ffn"], cfg["vocab"], cfg["layers"])
    tp = 2 if world % 2 == 0 else world
    src, dst = Zero3(shapes, world), Rollout(shapes, world, tp)
    sync = rs.Transfer(src.layout(), dst.layout(), budget_bytes_per_peer=cfg["budget"])
    targets = dst.buffers(rank, device)
    bad, reports = [], []
    for step in range(cfg["steps"]):  # one sync per "training step"; the weights change
        values = _values(shapes, step)
        shard = src.buffer(values, rank).to(device)
        reports.append(sync({rank: shard}, targets))
        for loc, want in dst.reference(values, rank).items():
            got = targets[loc].cpu()
            if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
                n = int((got.view(torch.int16) != want.view(torch.int16)).sum())
                bad.append(f"step {step}: rank {rank} location {loc}: {n} elements differ")
    first, last = reports[0], reports[-1]
    return {
        "bad": bad,
        "params": sum(math.prod(s) for s in shapes.values()),
        "rounds": last.rounds,
        "sent": last.total_bytes_sent,
        "received": last.total_bytes_received,
        "local": last.local_bytes,
        "first_total_s": first.seconds["total"],
        "plan_s": first.seconds["plan"],
        "seconds": last.seconds,
        "held": last.peak_staging_bytes,
        "bound": last.staging_bound,
        "gbps": last.gbps,
        "transport": last.transport,
        "elements_checked": sum(t.numel() for t in targets.values()) * cfg["steps"],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m reshard.demo", description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=None, help="ranks (default: 2, or #GPUs >= 2)")
    ap.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto")
    ap.add_argument("--hidden", type=int, default=258)
    ap.add_argument("--ffn", type=int, default=690)
    ap.add_argument("--vocab", type=int, default=1001)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--budget", type=int, default=1 << 20, help="bytes per peer per round")
    ap.add_argument("--steps", type=int, default=3, help="syncs (the weights change each time)")
    ap.add_argument(
        "--mode",
        choices=["deepspeed", "synthetic"],
        default=None,
        help="deepspeed (default when importable): a real ZeRO-3 engine with CPU-offloaded "
        "optimizer; synthetic: a hand-built ZeRO-3 style fp32 state",
    )
    args = ap.parse_args(argv)
    if args.mode is None:
        try:
            import deepspeed  # noqa: F401

            args.mode = "deepspeed"
        except ImportError:
            print("DeepSpeed is not installed: running the synthetic demo", file=sys.stderr)
            args.mode = "synthetic"
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = args.backend
    if backend == "auto":
        backend = "nccl" if gpus >= 2 else "gloo"
    world = args.world or (gpus if backend == "nccl" else 2)
    if backend == "nccl" and world > gpus:
        print(f"--backend nccl needs {world} GPUs, found {gpus}", file=sys.stderr)
        return 2
    keys = ("hidden", "ffn", "vocab", "layers", "budget", "steps", "mode")
    cfg = {k: getattr(args, k) for k in keys}
    t0 = time.perf_counter()
    try:
        results = launch(
            _rank_body,
            world,
            backend=backend,
            args=(backend, cfg),
            timeout_s=120,
            join_s=600,
            prefix="reshard-demo-",
        )
    except RanksFailed as exc:
        print(exc, file=sys.stderr)
        return 1
    wall = time.perf_counter() - t0
    if cfg["mode"] == "deepspeed":
        from .integrations import deepspeed_demo

        return deepspeed_demo.print_report(results, world, backend, cfg, wall)
    return _print_report(results, world, backend, cfg, wall)


def _print_report(results, world, backend, cfg, wall):
    r0 = results[0]
    mb = 1 << 20
    print(
        f"reshard demo: ZeRO-3 fp32 ({world} uneven shards) -> TP=2 bf16 rollout buffers, "
        f"{r0['params'] / 1e6:.2f}M params, {backend}, budget {cfg['budget']} B/peer, "
        f"{cfg['steps']} syncs"
    )
    print(
        f"  plan: {r0['plan_s'] * 1e3:.1f} ms (once); first sync {r0['first_total_s'] * 1e3:.1f}"
        " ms (allocates staging)"
    )
    for r, x in enumerate(results):
        s = x["seconds"]
        phases = " ".join(
            f"{p} {s[p] * 1e3:.1f}"
            for p in ("preflight", "pack", "h2d", "transport", "d2h", "unpack", "local")
            if s[p]
        )
        held = sum(x["held"].values())
        bound = sum(x["bound"].values())
        print(
            f"  rank {r}: sent {x['sent'] / mb:.2f} MiB, received {x['received'] / mb:.2f} MiB, "
            f"local {x['local'] / mb:.2f} MiB in {x['rounds']} rounds; total "
            f"{s['total'] * 1e3:.1f} ms ({x['gbps']:.2f} GB/s); phases ms: {phases}; staging "
            f"held {held} B <= bound {bound} B"
        )
    bad = [b for x in results for b in x["bad"]]
    over = [
        r for r, x in enumerate(results) if any(x["held"][k] > x["bound"][k] for k in x["held"])
    ]
    checked = sum(x["elements_checked"] for x in results)
    if bad or over:
        for b in bad[:20]:
            print("  MISMATCH " + b)
        for r in over:
            print(f"  rank {r}: staging held above the plan's bound")
        print(f"FAILED ({len(bad)} mismatching buffers; wall {wall:.1f} s)")
        return 1
    print(f"OK: {checked} target elements bitwise equal to the reference (wall {wall:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
