"""A repeated sync's per-call cost, before vs after a change of the call path, in one run.

    python benchmarks/call_ab.py REV --json benchmarks/results/cpu/call_ab.json
    python benchmarks/call_ab.py REV --world 1 --json benchmarks/results/cpu/call_ab_world1.json
    python benchmarks/call_ab.py REV --world 1 --device cuda --rev-dir OLD_CHECKOUT --json ...

Loads the call path of git revision REV (`preflight.py`, `rounds.py`, `executor.py`,
`integrations/dtensor.py`, `integrations/fsdp.py`) next to the current one (as
`reshard._rev_preflight`, `_rev_rounds`, `_rev_executor`, `reshard.integrations._rev_dtensor`,
`_rev_fsdp`, sharing the current planning, staging and ops), then on `--world` gloo ranks (1: in
this process; with `--device cuda` the targets on the GPU, as fsdp_offload on the H200) builds,
per case, one `Transfer` of REV's executor and one of the current executor over the same
layouts (the sync_latency budget rule), and times their syncs call by call, in rotating order,
in the same processes, so load bursts on a shared machine hit every variant alike. The
FSDP2 scenarios' sources are `LiveDTensors` (their `check()` runs in every preflight): REV's
variant passes one described by REV's dtensor / fsdp module. With 2 or more ranks a third
variant, `commit`, is the current code with the commit step forced on every call
(`preflight.COMMIT_SPREAD = 0`): its distance to `current` is what the commit all-gather
costs. Each sync is timed as in sync_latency.py (ranks aligned by a barrier, each rank's own
call timed, the slowest rank's); the phases come from each rank's `Report` (for REV, the time
in its `preflight.agree` stands in for `exchange`).

Cases (or --cases): with 2 ranks rl_weight_sync gpt-micro and gpt-mini, fsdp_resize gpt-mini,
lora_sync gpt-125m, fsdp_offload and fsdp2_exp_avg gpt-125m-thin and `agree/-` (the agreement
alone, `preflight.agree` after a barrier, 10x the iterations: the collective's own cost); with
1 rank fsdp_offload gpt-125m-thin and gpt-350m-thin (the storage counts of gpt-125m and
gpt-350m, 294 and 582 per side, at tiny widths: the per-call cost of that many buffers without
the copies), fsdp2_param and fsdp2_exp_avg gpt-125m-thin (a real FSDP2 model with
CPUOffloadPolicy, `rsfsdp.describe(net, "param" | "exp_avg")` as the source: its check()).
`--register`: every Transfer page-locks its CPU buffers (`register_host_sources` /
`register_host_targets`, as sync_latency's reshard_registered; on a CPU-only box the registry
does nothing), waited for after the warm-up. `--transport local` (world 1): both variants run
without their process group, the in-process transport, whose per-call path is the one NCCL takes
at world 1 on a GPU (the arena-skipping set and the local copy paths read from the buffers'
devices) while every copy stays on the CPU: that path's per-call cost on a box without a GPU.
`--only rounds.py,executor.py` takes just those modules from REV (the rest of the rev variant is
this checkout's), to isolate one part's change; `--rev-dir DIR` reads REV's modules from a
checkout without history (DIR/python/reshard/..., e.g. on the device machine). Only for call
paths whose executor still fits the current rounds and staging modules (REV close to the current
code). Not part of the suite: run by hand.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _baselines as B  # noqa: E402
import _common as C  # noqa: E402
import _scenarios as S  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the agreement alone (`preflight.agree`), 10x the iterations: the collective's own cost
AGREE = "agree/-"
CASES = {
    1: (
        "fsdp_offload/gpt-125m-thin",
        "fsdp_offload/gpt-350m-thin",
        "fsdp2_param/gpt-125m-thin",
        "fsdp2_exp_avg/gpt-125m-thin",
    ),
    2: (
        "rl_weight_sync/gpt-micro",
        "rl_weight_sync/gpt-mini",
        "fsdp_resize/gpt-mini",
        "lora_sync/gpt-125m",
        "fsdp_offload/gpt-125m-thin",
        "fsdp2_exp_avg/gpt-125m-thin",
        AGREE,
    ),
}
# the modules whose REV is loaded next to the current one: (path under python/reshard, name)
REV_MODULES = (
    ("preflight.py", "reshard._rev_preflight"),
    ("rounds.py", "reshard._rev_rounds"),
    ("executor.py", "reshard._rev_executor"),
    ("integrations/dtensor.py", "reshard.integrations._rev_dtensor"),
    ("integrations/fsdp.py", "reshard.integrations._rev_fsdp"),
)
# real FSDP2 cases: "<kind>" of rsfsdp.describe as source (see _fsdp2_case)
FSDP2 = {"fsdp2_param": "param", "fsdp2_exp_avg": "exp_avg"}
PHASES = ("preflight", "exchange", "pack", "transport", "unpack", "local", "total")
progress = C.progress_logger("call_ab")


def variants(world) -> tuple:
    return ("rev", "current", "commit") if world > 1 else ("rev", "current")


def load_rev(sources: dict) -> dict:
    """REV's modules (REV_MODULES) as modules of the current package, by path."""
    import reshard

    mods = {}
    for path, full in REV_MODULES:
        text = (
            sources[path]
            .replace("from . import preflight as pf", "from . import _rev_preflight as pf")
            .replace("from .rounds import", "from ._rev_rounds import")
            .replace("from .dtensor import", "from ._rev_dtensor import")
        )
        package, name = full.rsplit(".", 1)
        mod = importlib.util.module_from_spec(importlib.util.spec_from_loader(full, loader=None))
        mod.__package__ = package
        sys.modules[full] = mod
        exec(compile(text, f"<rev {path}>", "exec"), mod.__dict__)
        setattr(importlib.import_module(package), name, mod)
        mods[path] = mod
    assert reshard._rev_preflight is mods["preflight.py"]
    return mods


def _rank(rank, world, cfg):
    import torch

    if cfg["device"] == "cpu":  # ranks sharing this box's cores (a GPU run keeps its host threads)
        torch.set_num_threads(1)
    rev = load_rev(cfg["sources"])
    if cfg.get("transport") == "local":
        import reshard.executor

        def local_group(group):
            return None, 0, 1, "local"

        for ex in (rev["executor.py"], reshard.executor):
            ex.resolve_group = local_group
    agree_s = [0.0]  # seconds of the rev's last preflight.agree: its exchange
    rev_agree = rev["preflight.py"].agree

    def timed_agree(*a, **k):
        t0 = time.perf_counter()
        try:
            return rev_agree(*a, **k)
        finally:
            agree_s[0] = time.perf_counter() - t0

    rev["preflight.py"].agree = timed_agree
    out = {}
    for key in cfg["cases"]:
        if key == AGREE:
            out[key] = _time_agree(rank, world, cfg, rev_agree)
        else:
            out[key] = _time_case(key, rank, world, cfg, rev, agree_s)
    return out


def _time_agree(rank, world, cfg, rev_agree) -> dict:
    """The agreement alone (`preflight.agree` of a passing rank), after a barrier, on each
    rank: REV's against the current one with its kept `GatherRows` (and the commit forced)."""
    import torch
    import torch.distributed as dist

    from reshard import preflight as pf

    group, cpu = dist.group.WORLD, torch.device("cpu")
    gather = pf.GatherRows(group, world)
    default_spread = pf.COMMIT_SPREAD
    agree = {
        "rev": lambda: rev_agree([], "fp", group, rank, world, cpu, 300.0),
        "current": lambda: pf.agree([], "fp", group, rank, world, cpu, 300.0, gather),
    }
    agree["commit"] = agree["current"]
    names = variants(world)

    def call(v):
        pf.COMMIT_SPREAD = 0.0 if v == "commit" else default_spread
        dist.barrier()
        t0 = time.perf_counter()
        agree[v]()
        sec = time.perf_counter() - t0
        return [sec] + [sec if p in ("preflight", "exchange") else 0.0 for p in PHASES]

    rec = {v: [] for v in names}
    try:
        for i in range(cfg["warmup"] + 10 * cfg["iters"]):
            k = i % len(names)
            for v in names[k:] + names[:k]:
                sample = call(v)
                if i >= cfg["warmup"]:
                    rec[v].append(sample)
    finally:
        pf.COMMIT_SPREAD = default_spread
    rec.update(correct=True, params=0, buffers=[0, 0])
    return rec


def _time_case(key, rank, world, cfg, rev, agree_s) -> dict:
    """{variant: [[sync s, phase s...] per call], "correct": bool, "params": int}."""
    import torch.distributed as dist

    import reshard as rs
    from reshard import preflight as pf

    scen, model = key.split("/")
    if scen in FSDP2:
        case = _fsdp2_case(
            FSDP2[scen], model, rank, world, rev["integrations/fsdp.py"], cfg["device"]
        )
        budget = 64 << 20
    else:
        case = S.SCENARIOS[scen](model, rank, world, cfg["device"])
        # sync_latency's budget: 64 MiB on a GPU, else its CPU rule
        budget = 64 << 20 if cfg["device"] == "cuda" else B.cpu_budget(case)
    # one Transfer per variant: each keeps its own last cleared buffers (a Transfer shared by
    # two variants with different targets would never take preflight's short path)
    register = (
        {"register_host_sources": True, "register_host_targets": True}
        if cfg.get("register")
        else {}
    )
    transfers = {
        m: cls(case.src_layout, case.dst_layout, budget, group=dist.group.WORLD, **register)
        for m, cls in (
            ("rev", rev["executor.py"].Transfer),
            ("current", rs.Transfer),
            ("commit", rs.Transfer),
        )
    }
    sources = dict.fromkeys(("rev", "current"), case.src_buffers)
    if getattr(case, "rev_src_buffers", None) is not None:
        sources["rev"] = case.rev_src_buffers
    elif getattr(case, "src_dtensors", None) is not None:  # REV's own LiveDTensors and check()
        sources["rev"] = rev["integrations/dtensor.py"].describe(case.src_dtensors)
    names = variants(world)
    bufs = {v: case.targets() for v in names}
    default_spread = pf.COMMIT_SPREAD

    def call(v):
        pf.COMMIT_SPREAD = 0.0 if v == "commit" else default_spread
        t, src = transfers[v], sources["rev" if v == "rev" else "current"]
        sec, rep = C.timed_sync(lambda b: t(src, b), bufs[v], world, cfg["device"] == "cuda")
        phases = dict(rep.seconds)
        if v == "rev":
            phases["exchange"] = agree_s[0]
        return [sec] + [phases.get(p, 0.0) for p in PHASES]

    try:
        for _ in range(cfg["warmup"]):
            for v in names:
                call(v)
        if register:  # the registration runs on a thread: time the registered steady state
            for v in names:
                transfers[v].wait_host_registration()
                call(v)
        rec = {v: [] for v in names}
        for i in range(cfg["iters"]):
            k = i % len(names)
            for v in names[k:] + names[:k]:
                rec[v].append(call(v))
    finally:
        pf.COMMIT_SPREAD = default_spread
        for t in transfers.values():
            t.close()
    rec["correct"] = all(_correct(case, bufs[v]) for v in names)
    rec["params"] = case.params
    rec["buffers"] = [len(getattr(case.src_buffers, "buffers", case.src_buffers)), len(bufs["rev"])]
    return rec


class _Fsdp2Case:
    """A real FSDP2 model: one submodule per layer of `model`'s parameter shapes
    (reshard.scenarios), `fully_shard` on each and on the root with CPUOffloadPolicy, AdamW
    state from `init_adam_state`. Source: `rsfsdp.describe(net, kind)` (REV's describe for
    the rev variant); targets: fresh buffers of the same geometry on the same ranks, each
    location's copy of its source (local copies only)."""

    def __init__(self, kind, model, rank, world, rev_fsdp, device="cpu"):
        import dataclasses

        import torch
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        import reshard as rs
        from reshard import scenarios as sc
        from reshard.integrations import fsdp as rsfsdp

        root, layers = torch.nn.Module(), {}
        for i, (name, shape) in enumerate(sc.named_shapes(model).items()):
            prefix, _, leaf = name.rpartition(".")
            owner = root
            if prefix:
                if prefix not in layers:
                    layers[prefix] = torch.nn.Module()
                    root.add_module(prefix, layers[prefix])
                owner = layers[prefix]
            owner.register_parameter(leaf, torch.nn.Parameter(sc.value(i, shape)))
        self.params = sum(p.numel() for p in root.parameters())
        kw = {
            "mesh": init_device_mesh("cpu", (world,)),
            "offload_policy": CPUOffloadPolicy(pin_memory=False),
        }
        for layer in layers.values():
            fully_shard(layer, **kw)
        fully_shard(root, **kw)
        opt = torch.optim.AdamW(root.parameters())
        rsfsdp.init_adam_state(opt, 1)
        self.net, self.opt = root, opt  # kept alive: the described state is theirs

        def describe(mod):
            return mod.describe(root, kind) if kind == "param" else mod.describe(root, kind, opt)

        self.src_buffers, self.rev_src_buffers = describe(rsfsdp), describe(rev_fsdp)
        src = self.src_layout = self.src_buffers.layout
        shift = 1 + max(src.storages)
        self.dst_layout = rs.Layout(
            {
                name: rs.TensorLayout(
                    tl.shape,
                    [dataclasses.replace(p, location=p.location + shift) for p in tl.pieces],
                )
                for name, tl in src.tensors.items()
            },
            {loc + shift: st for loc, st in src.storages.items()},
        )
        self.reference = {loc + shift: t.clone() for loc, t in self.src_buffers.buffers.items()}

    def targets(self):
        import torch

        return {loc: torch.full_like(t, float("nan")) for loc, t in self.reference.items()}


def _fsdp2_case(kind, model, rank, world, rev_fsdp, device):
    import torch.distributed as dist

    if not dist.is_initialized():  # world 1 in this process: as the FSDP2 scenarios do
        backend = "cpu:gloo,cuda:nccl" if device == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return _Fsdp2Case(kind, model, rank, world, rev_fsdp, device)


def _correct(case, bufs) -> bool:
    import torch

    if isinstance(case, _Fsdp2Case):
        ref = case.reference
        return set(bufs) == set(ref) and all(torch.equal(bufs[k].cpu(), v) for k, v in ref.items())
    return B.targets_correct(case, bufs)


def summarize(per_rank, cases, world) -> list:
    rows = []
    for key in cases:
        for v in variants(world):
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
                    "buffers_per_rank": per_rank[0][key]["buffers"],
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
        f"# call_ab: {meta['rev']} vs the current call path, {meta['host']}, "
        f"{meta['world']} gloo rank{'s' if meta['world'] > 1 else ''}, targets on "
        f"{meta.get('device', 'cpu')}"
        + (", in-process transport" if meta.get("transport") == "local" else "")
        + (", buffers page-locked" if meta.get("register") else ""),
        "",
        f"torch {meta['torch']}, {meta['cpus']} CPUs, load average {meta['loadavg']} at the "
        f"start and {meta['loadavg_end']} at the end; {meta['iters']} syncs per variant after "
        f"{meta['warmup']} warm-up rounds, variants interleaved call by call in the same "
        "processes (rotating order). `rev`: "
        f"{', '.join(meta.get('rev_modules', ['the call path']))} of the revision (the rest "
        "of the call path this checkout's); "
        "`current`: this checkout; `commit` (2+ ranks): this checkout with the commit all-gather "
        "on every call. Buffers: source / target storages per rank. Sync = each rank's call "
        "after a barrier, slowest rank (as sync_latency.py); phases: median over "
        "calls of the largest rank's Report seconds (rev's `exchange` = its time in "
        "preflight.agree, the agreement and the commit).",
        "",
        f"Command: `{meta['command']}`",
        "",
        "| case | buffers | variant | median ms | p10 ms | p90 ms | x current | preflight ms "
        "| exchange ms | local checks ms | pack | transport | unpack | local | ok |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    cur = {r["case"]: r for r in rows if r["variant"] == "current"}
    for r in rows:
        ph = {k: v * 1e3 for k, v in r["phases_median_s"].items()}
        out.append(
            f"| {r['case']} | {'/'.join(map(str, r['buffers_per_rank']))} | {r['variant']} "
            f"| {r['median_s'] * 1e3:.2f} | {r['p10_s'] * 1e3:.2f} "
            f"| {r['p90_s'] * 1e3:.2f} | {r['median_s'] / cur[r['case']]['median_s']:.2f} "
            f"| {ph['preflight']:.2f} | {ph['exchange']:.2f} "
            f"| {max(0.0, ph['preflight'] - ph['exchange']):.2f} | {ph['pack']:.2f} "
            f"| {ph['transport']:.2f} | {ph['unpack']:.2f} | {ph['local']:.2f} "
            f"| {'yes' if r['correct'] else 'NO'} |"
        )
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("rev", help="git revision whose call path (REV_MODULES) is the 'rev'")
    ap.add_argument("--world", type=int, default=2, choices=(1, 2, 3, 4))
    ap.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="targets' device; cuda: --world 1, in this process (CPU -> GPU, as on the H200)",
    )
    ap.add_argument(
        "--rev-dir",
        default=None,
        help="read REV's modules from this checkout (python/reshard/...) instead of git "
        "(a copy without history, e.g. on the device machine); REV is then only its label",
    )
    ap.add_argument("--register", action="store_true", help="page-lock CPU buffers (see above)")
    ap.add_argument(
        "--transport",
        default=None,
        choices=("local",),
        help="world 1, CPU: run both variants on the in-process transport (see above)",
    )
    ap.add_argument("--cases", default=None, help="default: CASES of --world")
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--only",
        default=None,
        help="comma-separated REV_MODULES paths taken from REV; the others of the 'rev' "
        "variant are this checkout's (isolates one module's change)",
    )
    args = ap.parse_args(argv)
    if args.device == "cuda" and args.world != 1:
        ap.error("--device cuda needs --world 1")
    if args.transport == "local" and (args.world != 1 or args.device != "cpu"):
        ap.error("--transport local needs --world 1 --device cpu")
    from reshard._launch import RanksFailed, launch

    only = None if args.only is None else set(args.only.split(","))
    if only is not None and not only <= {path for path, _ in REV_MODULES}:
        ap.error(f"--only: not in REV_MODULES: {sorted(only - {p for p, _ in REV_MODULES})}")

    def source(path):
        if only is not None and path not in only:
            with open(os.path.join(ROOT, "python", "reshard", path)) as f:
                return f.read()
        if args.rev_dir:
            with open(os.path.join(args.rev_dir, "python", "reshard", path)) as f:
                return f.read()
        return C.git_output("show", f"{args.rev}:python/reshard/{path}")

    sources = {path: source(path) for path, _ in REV_MODULES}
    rev = args.rev
    if not args.rev_dir:
        rev = C.git_output("rev-parse", "--short", args.rev).strip()
    cases = args.cases.split(",") if args.cases else list(CASES.get(args.world, CASES[2]))
    env = C.environment(args.device)
    cfg = {
        "sources": sources,
        "cases": cases,
        "iters": args.iters,
        "warmup": args.warmup,
        "device": args.device,
        "register": args.register,
        "transport": args.transport,
    }
    names = variants(args.world)
    progress(f"{len(cases)} cases x {len(names)} variants, {args.iters} syncs each")
    if args.world == 1:  # in this process (as sync_latency.py): a GPU needs no spawn
        per_rank = [_rank(0, 1, cfg)]
    else:
        try:
            per_rank = launch(_rank, args.world, args=(cfg,), prefix="reshard-call-ab-")
        except RanksFailed as exc:
            print(exc, file=sys.stderr)
            return 1
    meta = {
        **env,
        "rev": rev,
        "rev_modules": sorted(only) if only is not None else [p for p, _ in REV_MODULES],
        "world": args.world,
        "device": args.device,
        "register": args.register,
        "transport": args.transport or "the group's",
        "iters": args.iters,
        "warmup": args.warmup,
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "command": C.command_line("call_ab.py", argv),
    }
    record = {"meta": meta, "results": summarize(per_rank, cases, args.world)}
    if args.json:
        C.write_results(args.json, record, markdown)
    print(markdown(record))
    return 0 if all(r["correct"] for r in record["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
