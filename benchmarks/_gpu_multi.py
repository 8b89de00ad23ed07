"""`gpu_bench.py --mode multi`: reshard over NCCL on 2 GPUs, each against baselines in the
same run (`--backend gloo`: the same code as a CPU dry run, no GPU needed).

Writes DIR/gpu_bench_multi.{json,md,png}; a progress line per step on stderr; a summary table
at the end on stdout. Sections:
- `p2p`: the NCCL point-to-point ceiling: S bytes GPU0 -> GPU1 (one direction) and S bytes each
  way at once (both directions), plain `batch_isend_irecv` of device buffers.
- `swap`: reshard moving the same bytes GPU -> GPU, both directions at once (a tensor whose
  row r lives on rank r goes to rank 1-r), for several per-peer budgets; ratio to the
  bidirectional ceiling of the same size. A whole `Transfer` call: preflight (one all-gather),
  pack, NCCL, unpack, final synchronize.
- `weight_sync`: sync_latency's rl_weight_sync scenario (benchmarks/_scenarios.py: ZeRO-3 bf16
  shards -> TP=2 bf16 rollout buffers; llama-8l, or gpt-nano with --quick) on the GPUs: reshard
  vs the per-tensor `gather_broadcast` and `full_gather` of benchmarks/_baselines.py. Median /
  p90 latency, the first sync on its own (reshard: planning, tables, arenas), peak extra device
  memory (the caching allocator's peak above what sources and targets hold, plus the staging
  reshard keeps between calls), every target checked bitwise against plain slicing.
Times: wall clock between an aligning all-reduce and a device synchronize on every rank; the
slowest rank's time per iteration, median over iterations. Bandwidth: bytes moved per direction
per second (1 GB = 1e9 B). NCCL's own buffers are not counted in any method's memory.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _baselines as B  # noqa: E402
import _common as C  # noqa: E402
import _scenarios as S  # noqa: E402

import reshard as rs  # noqa: E402
from reshard._launch import RanksFailed, launch  # noqa: E402

WORLD = 2
# NVLink multicast stays off on the lent machines (KINDS.md)
NCCL_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
GB, MiB = C.GB, C.MiB
STEM = "gpu_bench_multi"
T_START = time.monotonic()
progress = C.progress_logger(STEM)


# ----------------------------------------------------------------- timing helpers


class Ctx:
    def __init__(self, rank, backend, deadline):
        self.rank, self.backend, self.deadline = rank, backend, deadline
        self.cuda = backend == "nccl"
        self.dev = torch.device("cuda", rank) if self.cuda else torch.device("cpu")
        self._zero = torch.zeros(1, device=self.dev)

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def align(self):
        """Every rank leaves this at about the same time, with no device work pending."""
        self.sync()
        dist.all_reduce(self._zero)
        self.sync()

    def out_of_time(self, margin: float) -> bool:
        """Collective: true on every rank if any rank has less than `margin` seconds left (a
        rank deciding alone would leave its peer waiting in a collective)."""
        flag = torch.tensor([float(self.deadline - time.monotonic() < margin)], device=self.dev)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def measure(self, fn, iters, warmup=2, inner=1):
        """Per iteration: the slowest rank's seconds for `inner` calls, divided by inner.
        Returns (median, p90, list)."""
        for _ in range(warmup):
            fn()
        self.sync()
        mine = []
        for _ in range(iters):
            self.align()
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            self.sync()
            mine.append((time.perf_counter() - t0) / inner)
        allt = [None] * WORLD
        dist.all_gather_object(allt, mine)
        per_iter = sorted(max(ts) for ts in zip(*allt))
        return statistics.median(per_iter), C.quantile(per_iter, 0.9)


# ----------------------------------------------------------------- p2p ceiling


def bench_p2p(ctx, sizes, iters):
    peer = 1 - ctx.rank
    out = []
    for nbytes in sizes:
        if ctx.out_of_time(20):
            ctx.rank or progress(f"p2p: time cap reached, skipping {nbytes} B and larger")
            break
        send = torch.full((nbytes,), ctx.rank + 1, dtype=torch.uint8, device=ctx.dev)
        recv = torch.zeros(nbytes, dtype=torch.uint8, device=ctx.dev)
        inner = max(1, min(20, (256 * MiB) // nbytes))

        def bidir(send=send, recv=recv):
            ops = [
                dist.P2POp(dist.isend, send, peer),
                dist.P2POp(dist.irecv, recv, peer),
            ]
            for w in dist.batch_isend_irecv(ops):
                w.wait()

        def unidir(send=send, recv=recv):
            op = dist.isend if ctx.rank == 0 else dist.irecv
            buf = send if ctx.rank == 0 else recv
            for w in dist.batch_isend_irecv([dist.P2POp(op, buf, peer)]):
                w.wait()

        bi, bi90 = ctx.measure(bidir, iters, inner=inner)
        ok = bool((recv == peer + 1).all())
        uni, _ = ctx.measure(unidir, iters, inner=inner)
        row = {
            "bytes": nbytes,
            "bidir_s": bi,
            "bidir_p90_s": bi90,
            "bidir_gbps_per_direction": nbytes / bi / GB,
            "unidir_s": uni,
            "unidir_gbps": nbytes / uni / GB,
            "correct": ok,
        }
        out.append(row)
        if ctx.rank == 0:
            progress(
                f"p2p {nbytes / MiB:8.1f} MiB: bidir {row['bidir_gbps_per_direction']:7.1f} GB/s "
                f"per direction, unidir {row['unidir_gbps']:7.1f} GB/s"
            )
        del send, recv
    return out


# ----------------------------------------------------------------- reshard swap


def _swap_layouts(n):
    """Tensor x (2, n) fp32: row r on rank r (location r) -> rank 1-r (location 10 + 1-r)."""
    src = rs.Layout(
        {"x": rs.split((2, n), 0, [1, 1], [0, 1])},
        {0: rs.Storage(0, torch.float32, n), 1: rs.Storage(1, torch.float32, n)},
    )
    dst = rs.Layout(
        {"x": rs.split((2, n), 0, [1, 1], [11, 10])},
        {10: rs.Storage(0, torch.float32, n), 11: rs.Storage(1, torch.float32, n)},
    )
    return src, dst


def bench_swap(ctx, sizes, budgets, p2p, iters):
    ceiling = {r["bytes"]: r["bidir_s"] for r in p2p}
    out = []
    for nbytes in sizes:
        n = nbytes // 4
        src_l, dst_l = _swap_layouts(n)
        g = torch.Generator(device=ctx.dev).manual_seed(1234 + ctx.rank)
        src = {ctx.rank: torch.randn(n, generator=g, device=ctx.dev)}
        g2 = torch.Generator(device=ctx.dev).manual_seed(1234 + (1 - ctx.rank))
        want = torch.randn(n, generator=g2, device=ctx.dev)  # the peer's row
        for budget in budgets:
            if budget > 2 * nbytes and budget != budgets[0]:
                continue  # bigger budgets than the message change nothing
            if ctx.out_of_time(20):
                ctx.rank or progress(f"swap: time cap reached, skipping {nbytes} B budget {budget}")
                break
            dst = {10 + ctx.rank: torch.full((n,), float("nan"), device=ctx.dev)}
            sync = rs.Transfer(src_l, dst_l, budget_bytes_per_peer=budget)
            last = {}

            def call(sync=sync, src=src, dst=dst, last=last):
                last["r"] = sync(src, dst)

            med, p90 = ctx.measure(call, iters)
            rep = last["r"]
            ok = bool(torch.equal(dst[10 + ctx.rank], want))
            row = {
                "bytes": nbytes,
                "budget": budget,
                "rounds": rep.rounds,
                "median_s": med,
                "p90_s": p90,
                "gbps_per_direction": nbytes / med / GB,
                "ratio_to_p2p_bidir": (ceiling[nbytes] / med) if nbytes in ceiling else None,
                "staging_device_bytes": rep.peak_staging_bytes["device"],
                "phases_s": {k: round(v, 6) for k, v in rep.seconds.items()},
                "correct": ok,
            }
            out.append(row)
            if ctx.rank == 0:
                r = row["ratio_to_p2p_bidir"]
                progress(
                    f"swap {nbytes / MiB:8.1f} MiB budget {budget / MiB:7.1f} MiB: "
                    f"{row['gbps_per_direction']:7.1f} GB/s per direction, "
                    f"{'-' if r is None else f'{r:.3f}'} of p2p, {rep.rounds} rounds, ok={ok}"
                )
            del sync, dst
        del src, want
        if ctx.cuda:
            torch.cuda.empty_cache()
    return out


# ----------------------------------------------------------------- weight sync


def _peak_extra(ctx, step, bufs):
    """Device bytes the caching allocator held above the baseline during one step."""
    if not ctx.cuda:
        return None
    ctx.align()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step(bufs)
    ctx.sync()
    return torch.cuda.max_memory_allocated() - base


def bench_weight_sync(ctx, model, budgets, iters):
    """benchmarks/_scenarios.rl_weight_sync on the GPUs: reshard at each budget and the
    per-tensor baselines of benchmarks/_baselines, each checked bitwise."""
    t0 = time.monotonic()
    case = S.rl_weight_sync(model, ctx.rank, WORLD, ctx.dev)
    if ctx.rank == 0:
        progress(
            f"weight_sync: {model}, {case.params / 1e9:.3f}B params bf16, set up in "
            f"{time.monotonic() - t0:.1f} s"
        )
    methods = [(f"reshard@{b // MiB}MiB", "reshard", b) for b in budgets]
    methods += [
        ("gather_broadcast", "gather_broadcast", None),
        ("full_gather", "full_gather", None),
    ]
    out = {"params": case.params, "model": model, "bytes_bf16": 2 * case.params, "methods": {}}
    for name, method, budget in methods:
        if ctx.out_of_time(15):
            ctx.rank or progress(f"weight_sync: time cap reached, skipping {name}")
            continue
        bufs = case.targets()
        t_first = time.perf_counter()
        step, info = B.METHODS[method](case, {"world": WORLD, "budget": budget})
        step(bufs)
        ctx.sync()
        first = time.perf_counter() - t_first
        med, p90 = ctx.measure(lambda step=step, bufs=bufs: step(bufs), iters)
        extra = _peak_extra(ctx, step, bufs)
        held = info().get("staging_bytes", {}).get("device", 0)
        row = {
            "median_s": med,
            "p90_s": p90,
            "first_sync_s": first,
            "transient_extra_bytes": extra,
            "held_between_calls_bytes": held,
            "peak_extra_device_bytes": (extra or 0) + held,
            "correct": B.targets_correct(case, bufs),
        }
        if method == "reshard":
            r = info()
            row |= {"rounds": r["rounds"], "bytes_received": r["recv_bytes"]}
            row["phases_s"] = {k: round(v, 6) for k, v in r["seconds"].items()}
        out["methods"][name] = row
        if ctx.rank == 0:
            progress(
                f"weight_sync {name:<18} median {med * 1e3:8.2f} ms  p90 {p90 * 1e3:8.2f} ms  "
                f"first {first * 1e3:8.1f} ms  peak extra "
                f"{row['peak_extra_device_bytes'] / MiB:9.1f} MiB  correct={row['correct']}"
            )
        B.close(step)
        del step, bufs
        if ctx.cuda:
            torch.cuda.empty_cache()
    return out


# ----------------------------------------------------------------- harness


def _rank_body(rank, world, backend, cfg):
    """Sections in order; each finished one is kept (a failing section ends the run with an
    "error" entry next to the finished ones)."""
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // WORLD))
    result = {}
    try:
        ctx = Ctx(rank, backend, cfg["deadline"])
        result["p2p"] = bench_p2p(ctx, cfg["sizes"], cfg["iters"])
        result["swap"] = bench_swap(
            ctx, cfg["swap_sizes"], cfg["budgets"], result["p2p"], cfg["iters"]
        )
        result["weight_sync"] = bench_weight_sync(
            ctx, cfg["model"], cfg["ws_budgets"], cfg["ws_iters"]
        )
    except Exception:  # noqa: BLE001 - the parent prints it; finished sections stay
        result["error"] = traceback.format_exc()
    return result


def _env_info(backend):
    env = C.environment("cuda" if backend == "nccl" else "cpu")
    env |= {
        "backend": backend,
        "world": WORLD,
        "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE"),
    }
    return env


def _fmt_bytes(n):
    return f"{n / MiB:.0f} MiB" if n >= MiB else f"{n / 1024:.0f} KiB"


def write_outputs(out_dir, res):
    C.write_results(os.path.join(out_dir, STEM + ".json"), res, markdown, plot)


def markdown(res):
    lines = [f"# {STEM} ({res['env']['backend']}, {WORLD} ranks)", "", "```"]
    lines += [json.dumps(res["env"])]
    lines += ["```", "", "## NCCL point-to-point ceiling", ""]
    lines += ["| size | one direction GB/s | both directions GB/s (each) |", "|---|---|---|"]
    for r in res["p2p"]:
        lines.append(
            f"| {_fmt_bytes(r['bytes'])} | {r['unidir_gbps']:.1f} | "
            f"{r['bidir_gbps_per_direction']:.1f} |"
        )
    lines += ["", "## reshard GPU->GPU, both directions at once, vs the p2p ceiling", ""]
    lines += [
        "| size | budget/peer | rounds | GB/s (each direction) | ratio to p2p | device staging "
        "| correct |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in res["swap"]:
        ratio = "-" if r["ratio_to_p2p_bidir"] is None else f"{r['ratio_to_p2p_bidir']:.3f}"
        lines.append(
            f"| {_fmt_bytes(r['bytes'])} | {_fmt_bytes(r['budget'])} | {r['rounds']} | "
            f"{r['gbps_per_direction']:.1f} | {ratio} | "
            f"{_fmt_bytes(r['staging_device_bytes'])} | {r['correct']} |"
        )
    ws = res["weight_sync"]
    lines += ["", f"## Weight sync: {ws['params'] / 1e9:.3f}B params, ZeRO-3 bf16 -> TP=2 bf16", ""]
    lines += [
        "| method | median ms | p90 ms | vs reshard | first ms | peak extra device MiB | correct |",
        "|---|---|---|---|---|---|---|",
    ]
    base = next((m["median_s"] for k, m in ws["methods"].items() if k.startswith("reshard")), None)
    for name, m in ws["methods"].items():
        rel = f"{m['median_s'] / base:.2f}x" if base else "-"
        first = m.get("first_sync_s")
        lines.append(
            f"| {name} | {m['median_s'] * 1e3:.2f} | {m['p90_s'] * 1e3:.2f} | {rel} | "
            f"{'-' if first is None else f'{first * 1e3:.1f}'} | "
            f"{m['peak_extra_device_bytes'] / MiB:.1f} | {m['correct']} |"
        )
    return "\n".join(lines) + "\n"


def plot(stem, res):
    plt = C.pyplot()
    ws = res["weight_sync"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    p2p = res["p2p"]
    xs = [r["bytes"] / MiB for r in p2p]
    a.plot(xs, [r["unidir_gbps"] for r in p2p], "o-", label="NCCL p2p, one direction")
    a.plot(xs, [r["bidir_gbps_per_direction"] for r in p2p], "s-", label="NCCL p2p, both")
    budgets = sorted({r["budget"] for r in res["swap"]})
    for bud in budgets:
        rows = [r for r in res["swap"] if r["budget"] == bud]
        a.plot(
            [r["bytes"] / MiB for r in rows],
            [r["gbps_per_direction"] for r in rows],
            "^--",
            label=f"reshard, both, budget {_fmt_bytes(bud)}",
        )
    a.set_xscale("log", base=2)
    a.set_xlabel("bytes per direction (MiB)")
    a.set_ylabel("GB/s per direction")
    a.set_title("GPU0 <-> GPU1")
    a.legend(fontsize=7)
    names = list(ws["methods"])
    b.bar(names, [ws["methods"][n]["median_s"] * 1e3 for n in names])
    b.set_ylabel("median ms per sync")
    b.set_title(f"weight sync {ws['params'] / 1e9:.2f}B bf16 ZeRO-3 -> TP=2")
    b.tick_params(axis="x", labelrotation=20, labelsize=7)
    fig.tight_layout()
    fig.savefig(stem + ".png", dpi=90)
    plt.close(fig)


def summary(res) -> str:
    out = [f"== {STEM} summary ({res['env']['backend']}, {res['env'].get('gpus', 'cpu')})"]
    out.append(f"{'bytes/dir':>10} {'p2p 1-dir':>10} {'p2p both':>10} {'reshard best':>13} "
               f"{'ratio':>6} {'budget':>9}")  # fmt: skip
    for r in res["p2p"]:
        rows = [s for s in res["swap"] if s["bytes"] == r["bytes"]]
        best = max(rows, key=lambda s: s["gbps_per_direction"]) if rows else None
        out.append(
            f"{_fmt_bytes(r['bytes']):>10} {r['unidir_gbps']:>10.1f} "
            f"{r['bidir_gbps_per_direction']:>10.1f} "
            + (
                f"{best['gbps_per_direction']:>13.1f} {best['ratio_to_p2p_bidir']:>6.3f} "
                f"{_fmt_bytes(best['budget']):>9}"
                if best and best["ratio_to_p2p_bidir"] is not None
                else f"{'-':>13}"
            )
        )
    ws = res["weight_sync"]
    out.append(f"weight sync {ws['params'] / 1e9:.3f}B params bf16 ZeRO-3 -> TP=2:")
    for name, m in ws["methods"].items():
        out.append(
            f"  {name:<18} median {m['median_s'] * 1e3:8.2f} ms  p90 {m['p90_s'] * 1e3:8.2f} ms"
            f"  peak extra {m['peak_extra_device_bytes'] / MiB:9.1f} MiB  correct {m['correct']}"
        )
    bad = [s for s in res["swap"] if not s["correct"]] + [
        n for n, m in ws["methods"].items() if not m["correct"]
    ]
    bad += [r["bytes"] for r in res["p2p"] if not r["correct"]]
    out.append("ALL CORRECT" if not bad else f"INCORRECT: {bad}")
    if res.get("errors"):
        out.append("ERRORS: a rank failed or wrote nothing (tracebacks on stderr); partial results")
    return "\n".join(out)


def config(quick, backend, time_cap) -> dict:
    """Sizes, budgets, model and iterations (small with --quick or as a gloo dry run)."""
    if quick or backend == "gloo":
        sizes = [64 << 10, 1 * MiB, 8 * MiB]
        budgets = [1 * MiB, 64 * MiB]
        model = "gpt-nano"
        iters, ws_iters = 5, 5
    else:
        sizes = [1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB, 1024 * MiB]
        budgets = [16 * MiB, 64 * MiB, 256 * MiB, 1024 * MiB]
        model = "llama-8l"
        iters, ws_iters = 10, 10
    return {
        "sizes": sizes,
        "swap_sizes": sizes,
        "budgets": budgets,
        "model": model,
        "ws_budgets": [64 * MiB, 256 * MiB] if not quick else [1 * MiB],
        "iters": iters,
        "ws_iters": ws_iters,
        # steps shrink past this (wall clock of this machine, shared with the ranks)
        "deadline": time.monotonic() + time_cap - 15,
    }


def run(args) -> int:
    """Spawn the ranks, gather their sections, write the results and print the summary."""
    if args.backend == "nccl" and torch.cuda.device_count() < WORLD:
        print(
            f"--mode multi needs {WORLD} GPUs, found {torch.cuda.device_count()}", file=sys.stderr
        )
        return 2
    cfg = config(args.quick, args.backend, args.time_cap)
    progress(f"start: backend {args.backend}, sizes {[_fmt_bytes(s) for s in cfg['sizes']]}")
    try:
        results = launch(
            _rank_body,
            WORLD,
            backend=args.backend,
            args=(args.backend, cfg),
            env=NCCL_ENV,
            timeout_s=60,
            join_s=max(10.0, T_START + args.time_cap - 3 - time.monotonic()),
            prefix="reshard-gpu-bench-",
        )
    except RanksFailed as exc:
        print(exc, file=sys.stderr)
        results = exc.results
    rc = 0
    for r, x in enumerate(results):
        if x is None:
            rc = 1  # RanksFailed said why
        elif "error" in x:
            print(f"rank {r} failed:\n{x['error']}", file=sys.stderr)
            rc = 1
    base = next((x for x in results if x), None)
    if base is None:
        return 1
    res = _record(base, results, cfg, args.backend, rc != 0)
    write_outputs(args.out, res)
    print(summary(res))
    return rc if all(res["per_rank_correct"]) else 1


def _record(base, results, cfg, backend, errors) -> dict:
    """The results record: rank `base`'s sections (all ranks measure the same slowest-rank
    times), the environment, the config, and whether every rank's targets were correct."""
    cfg_out = {k: v for k, v in cfg.items() if k != "deadline"}
    res = {"env": _env_info(backend), "config": cfg_out, "errors": errors}
    res.update({k: v for k, v in base.items() if k != "error"})
    res.setdefault("p2p", [])
    res.setdefault("swap", [])
    res.setdefault("weight_sync", {"params": 0, "methods": {}})
    res["per_rank_correct"] = [
        x is not None
        and all(s["correct"] for s in x.get("swap", []))
        and all(m["correct"] for m in x.get("weight_sync", {}).get("methods", {}).values())
        and all(p["correct"] for p in x.get("p2p", []))
        for x in results
    ]
    return res
