"""`python -m reshard.demo` (`make demo`): a trainer -> rollout weight sync, end to end.

Modes (`--mode`; the default is the first one whose requirement imports):
- `deepspeed`: a real DeepSpeed ZeRO-3 engine with CPU-offloaded optimizer trains a few steps,
  syncing bf16 params into TP=2 rollout buffers after each step and fp32 masters + Adam moments
  into a snapshot; see integrations/deepspeed_demo.py.
- `rollout` (DeepSpeed and transformers): an HF Llama (GQA) under DeepSpeed ZeRO-3 with CPU
  optimizer offload; after each step its weights go to an inference engine both ways engines
  take them: an `rs.Stream` of full tensors by name to rank 0 and one Transfer into vLLM's
  TP=2 layout (`integrations.vllm.tp_layout`); see integrations/rollout_demo.py.
- `fsdp`: a model sharded with FSDP2 (`fully_shard`, `CPUOffloadPolicy`, bf16 mixed precision)
  trains a few steps, syncing its CPU fp32 sharded params into TP=2 bf16 rollout buffers after
  each step and params + Adam moments into a snapshot; see integrations/fsdp_demo.py.
- `synthetic` (needs nothing): a ZeRO-3 sharded fp32 state of a small transformer-shaped model
  (reshard.scenarios: every parameter's flat form cut evenly across ranks, padded; shards
  deliberately uneven) synced into TP=2 rollout buffers in bf16: a fused QKV buffer per layer,
  column splits (fc1, vocab-split embedding), row splits (o, fc2), replicated norms. fp32 ->
  bf16 happens on the wire. Every target element is checked against a reference computed
  independently (plain torch slicing of the logical tensors).

Ranks are spawned by reshard._launch (gloo on CPU, 2 by default; NCCL when there are >= 2 GPUs).
The demo exits non-zero on any mismatch.

Adding a mode: write a module with `run_rank(rank, world, backend, cfg) -> JSON-able dict`
(runs inside the initialized process group; cfg holds the command-line options below) and
`print_report(results, world, backend, cfg, wall_s) -> exit code` (results in rank order),
then add one `Mode` line to `MODES`: its name, that module, and the modules its ranks need.
A mode module may define `check_args(cfg) -> message or None` (sizes its model cannot take:
the parser refuses them) and `DEFAULT_HIDDEN`. Checks compare against references computed
without reshard.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
import time
from typing import NamedTuple

import torch

import reshard as rs
from reshard import scenarios as sc
from reshard._launch import RanksFailed, launch
from reshard.integrations import deepspeed_cpu_ops, rollout_demo
from reshard.integrations._demo_common import HEADS, tp_size


class Mode(NamedTuple):
    module: str  # defines run_rank(...) and print_report(...)
    requires: tuple[str, ...] = ()  # modules the mode imports


MODES = {
    "deepspeed": Mode("reshard.integrations.deepspeed_demo", ("deepspeed",)),
    "synthetic": Mode("reshard.demo"),
    "rollout": Mode("reshard.integrations.rollout_demo", ("transformers", "deepspeed")),
    "fsdp": Mode("reshard.integrations.fsdp_demo"),
}
DEFAULT_HIDDEN = 258


def _missing(mode: str) -> list[str]:
    return [m for m in MODES[mode].requires if importlib.util.find_spec(m) is None]


def _rank_body(rank, world, backend, cfg):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    return importlib.import_module(MODES[cfg["mode"]].module).run_rank(rank, world, backend, cfg)


def run_rank(rank, world, backend, cfg):
    """The synthetic mode on one rank: `steps` syncs of one Transfer, each checked bitwise."""
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    shapes = sc.model_shapes(cfg["hidden"], cfg["ffn"], cfg["vocab"], cfg["layers"])
    tp = tp_size(world)
    src = sc.Zero3(shapes, range(world), torch.float32, loc0=0)
    groups = [list(range(g, g + tp)) for g in range(0, world, tp)]
    dst = sc.TensorParallel(shapes, groups, torch.bfloat16, loc0=1000)
    sync = rs.Transfer(src.layout(), dst.layout(), budget_bytes_per_peer=cfg["budget"])
    targets = dst.empty(rank, sc.POISON, device)
    bad, reports = [], []
    for step in range(cfg["steps"]):  # one sync per "training step"; the weights change
        values = sc.model_values(shapes, seed=step)
        reports.append(sync(sc.source_buffers(src, values, rank, device), targets))
        bad += [
            f"step {step}: rank {rank} {m}" for m in sc.mismatches(targets, dst.fill(values, rank))
        ]
    first, last = reports[0], reports[-1]
    return {
        "bad": bad,
        "params": sc.count_params(shapes),
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


# One gloo rank is one process with its own torch: 0.22 GiB RSS after importing torch and
# reshard (Python 3.11, torch 2.13 CPU), before its process group and model.
RANK_PROCESS_BYTES = 400 << 20


def _available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo; None where the kernel does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) << 10
    except (OSError, ValueError, IndexError):
        pass
    return None


def _default_mode():
    for name in MODES:
        if not _missing(name):
            return name
    raise AssertionError("the synthetic mode needs nothing")


def _at_least(lo: int):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be at least {lo}, got {v}")
        return v

    return parse


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m reshard.demo", description=__doc__.split("\n")[0])
    ap.add_argument(
        "--world",
        type=_at_least(1),
        default=None,
        help="ranks (default: 2, or #GPUs >= 2); gloo: as many as memory holds, about 0.4 GiB each",
    )
    ap.add_argument(
        "--backend",
        choices=["auto", "gloo", "nccl"],
        default="auto",
        help="auto: nccl with >= 2 GPUs, else gloo (CPU); nccl needs a CUDA GPU per rank",
    )
    ap.add_argument(
        "--hidden",
        type=_at_least(1),
        default=None,
        help=f"model width, used as given (default {DEFAULT_HIDDEN}; rollout: "
        f"{rollout_demo.DEFAULT_HIDDEN}); deepspeed, fsdp: a multiple of {HEADS} ({HEADS} "
        f"attention heads); rollout: a multiple of {rollout_demo.HIDDEN_MULTIPLE} "
        f"({rollout_demo.HEADS} heads)",
    )
    ap.add_argument(
        "--ffn",
        type=_at_least(1),
        default=690,
        help=f"MLP width (rollout: a multiple of {rollout_demo.TP})",
    )
    ap.add_argument("--vocab", type=_at_least(1), default=1001)
    ap.add_argument("--layers", type=_at_least(1), default=4)
    ap.add_argument(
        "--budget", type=_at_least(16), default=1 << 20, help="bytes per peer per round"
    )
    ap.add_argument(
        "--steps",
        type=_at_least(1),
        default=3,
        help="steps, each followed by a verified sync: training steps in the deepspeed, fsdp and rollout modes, weight changes in the synthetic mode",
    )
    ap.add_argument(
        "--mode",
        choices=list(MODES),
        default=None,
        help="needs: "
        + "; ".join(f"{n}: {' and '.join(m.requires) or 'nothing'}" for n, m in MODES.items())
        + ". Default: the first whose requirements are installed",
    )
    args = ap.parse_args(argv)
    if args.mode is None:
        args.mode = _default_mode()
        if args.mode != next(iter(MODES)):
            missing = " and ".join(_missing(next(iter(MODES))))
            print(f"{missing} is not installed: running the {args.mode} demo", file=sys.stderr)
    elif missing := _missing(args.mode):
        ap.error(
            f"argument --mode: {args.mode} needs {' and '.join(MODES[args.mode].requires)}; "
            f"not installed: {', '.join(missing)} (--mode synthetic needs nothing)"
        )
    module = importlib.import_module(MODES[args.mode].module)
    if args.hidden is None:
        args.hidden = getattr(module, "DEFAULT_HIDDEN", DEFAULT_HIDDEN)
    keys = ("hidden", "ffn", "vocab", "layers", "budget", "steps", "mode")
    cfg = {k: getattr(args, k) for k in keys}
    if hasattr(module, "check_args") and (message := module.check_args(cfg)):
        ap.error(message)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = args.backend
    if backend == "auto":
        backend = "nccl" if gpus >= 2 else "gloo"
    world = args.world if args.world is not None else (gpus if backend == "nccl" else 2)
    if backend == "nccl" and gpus == 0:
        cpu_build = ", and this torch is a CPU-only build" if torch.version.cuda is None else ""
        ap.error(
            "argument --backend: nccl needs CUDA GPUs, one per rank; none is visible here"
            f"{cpu_build}. Use --backend gloo (or auto) to run the ranks on CPU"
        )
    if backend == "nccl" and world > gpus:
        ap.error(
            f"argument --backend: nccl needs a CUDA GPU per rank: --world {world} needs {world}, "
            f"{gpus} visible. Use --world {gpus} or fewer, or --backend gloo to run on CPU"
        )
    available = _available_memory_bytes() if backend == "gloo" else None
    if available is not None and world * RANK_PROCESS_BYTES > available:
        fits = max(1, available // RANK_PROCESS_BYTES)
        ap.error(
            f"argument --world: {world} gloo ranks are {world} processes, each with its own "
            f"torch (about {RANK_PROCESS_BYTES >> 20} MiB); this machine has "
            f"{available >> 20} MiB available, enough for {fits}. Use --world {fits} or fewer"
        )
    if "deepspeed" in MODES[args.mode].requires and backend == "gloo":
        deepspeed_cpu_ops.prepare()  # once here, not in every rank's first initialize
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
    return module.print_report(results, world, backend, cfg, wall)


def print_report(results, world, backend, cfg, wall):
    r0 = results[0]
    mb = 1 << 20
    print(
        f"reshard demo: ZeRO-3 fp32 ({world} uneven shards) -> TP={tp_size(world)} bf16 "
        "rollout buffers, "
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
