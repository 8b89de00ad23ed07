"""`gpu_bench.py --mode single`: reshard's CUDA half on one GPU, each against baselines
measured in the same run.

Sections: ceilings (device copy, pinned/pageable PCIe, host copy), copy_runs on the device,
stage_h2d/stage_d2h, the ring-size sweep, and a single-process sync of the CPU-offloaded
optimizer state of a 1.5B-parameter model (fp32 master + Adam moments, 18 GB) into GPU
targets. Bandwidths count bytes read + bytes written for device-to-device and host copies, and
bytes moved for PCIe. Device timings: CUDA events, warm-up, median of repeats;
host-synchronous paths: wall clock around a synchronize. Writes DIR/gpu_bench.{json,md,png}.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402

import reshard._ops as ops  # noqa: E402

DEV = "cuda"
GB = C.GB
SECTIONS = ("copy_runs", "staging", "ring", "model")
RESULTS: dict = {
    "env": {},
    "ceilings": {},
    "copy_runs": [],
    "staging": [],
    "ring": [],
    "model_sync": {},
}


def log(*a):
    print(*a, flush=True)


def _rounded(row: dict) -> str:
    return json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()})


def record(section: str, row: dict) -> None:
    """Keep one measured row in RESULTS[section] and log it."""
    RESULTS[section].append(row)
    log(section, _rounded(row))


time_events, time_wall = C.time_events, C.time_wall


def fill_random(t: torch.Tensor) -> torch.Tensor:
    """Random contents without a slow full-size RNG pass (and every page touched)."""
    flat = t.view(-1)
    block = min(flat.numel(), 1 << 20)
    pattern = torch.randn(block, dtype=torch.float32).to(t.dtype)
    n_full = flat.numel() // block
    if n_full:
        flat[: n_full * block].view(n_full, block).copy_(pattern.expand(n_full, block))
    rest = flat.numel() - n_full * block
    if rest:
        flat[n_full * block :].copy_(pattern[:rest])
    return t


# ------------------------------------------------------------------------------ ceilings


def ceilings(quick):
    c = RESULTS["ceilings"]
    n = (1 << 30) // 4
    a = fill_random(torch.empty(n, device=DEV))
    b = torch.empty_like(a)
    s = time_events(lambda a=a, b=b: b.copy_(a))
    c["d2d_GBps"] = 2 * a.nbytes / s / GB
    size = 256 << 20
    pinned = fill_random(torch.empty(size // 4, pin_memory=True))
    pageable = fill_random(torch.empty(size // 4))
    dev = torch.empty(size // 4, device=DEV)
    c["pinned_h2d_GBps"] = size / time_events(lambda: dev.copy_(pinned, non_blocking=True)) / GB
    c["pinned_d2h_GBps"] = size / time_events(lambda: pinned.copy_(dev, non_blocking=True)) / GB
    c["pageable_h2d_GBps"] = size / time_wall(lambda: dev.copy_(pageable)) / GB
    c["pageable_d2h_GBps"] = size / time_wall(lambda: pageable.copy_(dev)) / GB
    h1 = fill_random(torch.empty((1 << 30) // 4))
    h2 = torch.empty_like(h1)
    h2.copy_(h1)
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        h2.copy_(h1)
        ts.append(time.perf_counter() - t)
    c["host_copy_GBps"] = 2 * h1.nbytes / statistics.median(ts) / GB
    c["torch_threads"] = torch.get_num_threads()
    log("ceilings", json.dumps({k: round(v, 1) for k, v in c.items()}))


# ----------------------------------------------------------------------------- copy_runs


def gather_table(n_runs, run_elems, src_elems, rng):
    """n_runs runs of run_elems elements from random, 16-byte aligned places in src into a
    dense dst, in random order."""
    starts = rng.choice(src_elems // run_elems, n_runs, replace=False) * run_elems
    dst = np.arange(n_runs, dtype=np.int64) * run_elems
    z = np.zeros(n_runs, np.int64)
    return np.stack([starts, z, dst, z, np.full(n_runs, run_elems), np.ones(n_runs, np.int64)], 1)


def bench_copy_runs(quick):
    rng = np.random.default_rng(0)
    d2d = RESULTS["ceilings"]["d2d_GBps"]
    total = (256 << 20) if not quick else (64 << 20)
    cases = [(16 << 10), (64 << 10), (1 << 20), (16 << 20), 256, 1024, 4096]
    for run_bytes in cases:
        run_elems = run_bytes // 4
        n_runs = total // run_bytes
        src = fill_random(torch.empty(2 * total // 4, device=DEV))
        desc = torch.from_numpy(gather_table(n_runs, run_elems, src.numel(), rng))
        for ddt in (torch.float32, torch.bfloat16):
            dst = torch.empty(n_runs * run_elems, dtype=ddt, device=DEV)
            s = time_events(lambda dst=dst, desc=desc, src=src: ops.copy_runs(src, desc, dst))
            moved = n_runs * run_elems * (4 + dst.element_size())
            row = {
                "run_bytes": run_bytes,
                "runs": n_runs,
                "dst_dtype": str(ddt)[6:],
                "GBps": moved / s / GB,
                "ratio_d2d": moved / s / GB / d2d,
            }
            record("copy_runs", row)
    # 20,000 runs of 16 KiB: copy_runs against torch's _foreach_copy_ and cat of views
    n_runs, run_elems = 20_000, (16 << 10) // 4
    src = fill_random(torch.empty(2 * n_runs * run_elems, device=DEV))
    d = gather_table(n_runs, run_elems, src.numel(), rng)
    desc = torch.from_numpy(d)
    dst = torch.empty(n_runs * run_elems, device=DEV)
    views_src = [src[int(r[0]) : int(r[0]) + run_elems] for r in d]
    views_dst = [dst[int(r[2]) : int(r[2]) + run_elems] for r in d]
    t_ours = time_events(lambda: ops.copy_runs(src, desc, dst))
    t_foreach = time_events(lambda: torch._foreach_copy_(views_dst, views_src), reps=5)
    t_cat = time_events(lambda: torch.cat(views_src), reps=5)
    moved = 2 * dst.nbytes
    RESULTS["copy_runs_vs_torch"] = {
        "runs": n_runs,
        "run_bytes": 16 << 10,
        "copy_runs_GBps": moved / t_ours / GB,
        "foreach_copy_GBps": moved / t_foreach / GB,
        "cat_GBps": moved / t_cat / GB,
        "speedup_vs_foreach": t_foreach / t_ours,
        "speedup_vs_cat": t_cat / t_ours,
    }
    log("copy_runs vs torch", json.dumps(RESULTS["copy_runs_vs_torch"]))
    # first call with a new table: validation + upload (cached afterwards)
    fresh = desc.clone()
    torch.cuda.synchronize()
    t = time.perf_counter()
    ops.copy_runs(src, fresh, dst)
    torch.cuda.synchronize()
    RESULTS["copy_runs_vs_torch"]["first_call_s"] = time.perf_counter() - t
    RESULTS["copy_runs_vs_torch"]["cached_call_s"] = t_ours


# ------------------------------------------------------------------------------- staging


def bench_staging(quick):
    rng = np.random.default_rng(1)
    total = (1 << 30) if not quick else (256 << 20)
    ring = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True)
    for run_bytes in (4 << 20, 64 << 10, 4 << 10):
        _staging_runs(run_bytes, total, ring, rng)


def _staging_runs(run_bytes, total, ring, rng):
    """`total` bytes in runs of `run_bytes` from pinned and pageable host memory to the device
    (fp32, and fp32 -> bf16) and back, each against its floor from the ceilings."""
    c = RESULTS["ceilings"]
    host_floor = min(c["pinned_h2d_GBps"], c["host_copy_GBps"] / 2)
    d2h_floor = min(c["pinned_d2h_GBps"], c["host_copy_GBps"] / 2)
    run_elems = run_bytes // 4
    n_runs = total // run_bytes
    d = gather_table(n_runs, run_elems, (5 * total // 4) // 4, rng)
    desc = torch.from_numpy(d)
    rev = torch.from_numpy(d[:, [2, 3, 0, 1, 4, 5]].copy())  # D2H: the reverse table
    pageable = fill_random(torch.empty(5 * total // 16))
    pinned = fill_random(torch.empty(5 * total // 16, pin_memory=True))
    dev = torch.empty(n_runs * run_elems, device=DEV)
    dev_bf16 = torch.empty(n_runs * run_elems, dtype=torch.bfloat16, device=DEV)
    cases = [  # (case, one call, its floor)
        ("h2d pinned", lambda: ops.stage_h2d(pinned, desc, ring, dev), c["pinned_h2d_GBps"]),
        ("h2d pageable", lambda: ops.stage_h2d(pageable, desc, ring, dev), host_floor),
        ("h2d pageable->bf16", lambda: ops.stage_h2d(pageable, desc, ring, dev_bf16), host_floor),
        ("d2h pinned", lambda: ops.stage_d2h(dev, rev, ring, pinned), c["pinned_d2h_GBps"]),
        ("d2h pageable", lambda: ops.stage_d2h(dev, rev, ring, pageable), d2h_floor),
    ]
    moved = n_runs * run_elems * 4  # fp32 source bytes delivered
    for name, call, floor in cases:
        s = time_wall(call, reps=3)
        st = call()  # what each timed call did
        row = {
            "case": name,
            "run_bytes": run_bytes,
            "GBps": moved / s / GB,
            "ratio_floor": moved / s / GB / floor,
            "floor_GBps": floor,
            "direct_copies": st.direct_copies,
            "chunks": st.chunks,
        }
        record("staging", row)


def bench_ring(quick):
    """Ring size sweep for the staged (bounced) paths: what a pageable host buffer and a
    host-side cast cost per ring size, the evidence for the executor's ring default."""
    c = RESULTS["ceilings"]
    total = (1 << 30) if not quick else (256 << 20)
    run_elems = (4 << 20) // 4
    n_runs = total // (4 << 20)
    d = gather_table(n_runs, run_elems, (5 * total // 4) // 4, np.random.default_rng(2))
    desc = torch.from_numpy(d)
    rev = torch.from_numpy(d[:, [2, 3, 0, 1, 4, 5]].copy())
    host = fill_random(torch.empty(5 * total // 16))
    dev = torch.empty(n_runs * run_elems, device=DEV)
    dev_bf16 = torch.empty(n_runs * run_elems, dtype=torch.bfloat16, device=DEV)
    for ring_mib in (4, 16, 64, 256):
        ring = torch.empty(ring_mib << 20, dtype=torch.uint8, pin_memory=True)
        cases = [
            (
                "h2d pageable",
                lambda r=ring, h=host, t=dev: ops.stage_h2d(h, desc, r, t),
                dev.nbytes,
                c["pinned_h2d_GBps"],
            ),
            (
                "h2d pageable->bf16",
                lambda r=ring, h=host, t=dev_bf16: ops.stage_h2d(h, desc, r, t),
                dev_bf16.nbytes,
                c["pinned_h2d_GBps"],
            ),
            (
                "d2h pageable",
                lambda r=ring, h=host, v=dev: ops.stage_d2h(v, rev, r, h),
                dev.nbytes,
                c["pinned_d2h_GBps"],
            ),
        ]
        for name, fn, wire, link in cases:
            s = time_wall(fn, reps=5)
            row = {
                "case": name,
                "ring_MiB": ring_mib,
                "wire_GBps": wire / s / GB,
                "of_pcie": wire / s / GB / link,
                "slots": fn().slots,
            }
            record("ring", row)
        del ring
    del host, dev, dev_bf16


# --------------------------------------------------------------------- 1.5B model sync


def model_shapes(layers=28, hidden=2048, vocab=50257):
    shapes = [(vocab, hidden)]
    for _ in range(layers):
        shapes += [
            (3 * hidden, hidden),
            (hidden, hidden),
            (4 * hidden, hidden),
            (hidden, 4 * hidden),
            (hidden,),
            (hidden,),
        ]
    return shapes


def _model_table(quick):
    """The 1.5B model's parameters as runs: (numels, source offsets (flat, in order), target
    offsets (flat, parameters permuted), the copy_runs table between them)."""
    numels = [int(np.prod(s)) for s in model_shapes(layers=28 if not quick else 4)]
    offs = np.concatenate([[0], np.cumsum(numels)[:-1]])
    perm = np.random.default_rng(2).permutation(len(numels))
    dst_offs = np.zeros(len(numels), np.int64)
    dst_offs[perm] = np.concatenate([[0], np.cumsum(np.array(numels)[perm])[:-1]])
    z = np.zeros(len(numels), np.int64)
    desc = torch.from_numpy(np.stack([offs, z, dst_offs, z, numels, np.ones_like(z)], 1))
    return numels, offs, dst_offs, desc


def bench_model_sync(quick):
    """CPU-offloaded fp32 master + exp_avg + exp_avg_sq (DeepSpeed keeps each as one flat CPU
    buffer) into per-parameter GPU targets laid out in another order (one flat GPU buffer per
    state, parameters permuted), fp32 and bf16."""
    r = RESULTS["model_sync"]
    numels, offs, dst_offs, desc = _model_table(quick)
    n = sum(numels)
    r.update(params=n, tensors=len(numels), states=3, bytes_fp32=3 * n * 4)
    log(f"model sync: {n / 1e9:.2f}B params, {len(numels)} tensors, {3 * n * 4 / GB:.1f} GB")

    t = time.perf_counter()
    cpu = [fill_random(torch.empty(n)) for _ in range(3)]
    r["host_alloc_fill_s"] = time.perf_counter() - t
    gpu = [torch.empty(n, device=DEV) for _ in range(3)]
    gpu_bf16 = [torch.empty(n, dtype=torch.bfloat16, device=DEV) for _ in range(3)]
    cpu_views = [[c[o : o + k] for o, k in zip(offs, numels, strict=True)] for c in cpu]
    gpu_views = [[g[o : o + k] for o, k in zip(dst_offs, numels, strict=True)] for g in gpu]
    bf_views = [[g[o : o + k] for o, k in zip(dst_offs, numels, strict=True)] for g in gpu_bf16]
    ring = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True)
    reps = 3 if not quick else 2

    def per_tensor(non_blocking=False):
        for cv, gv in zip(cpu_views, gpu_views, strict=True):
            for a, b in zip(cv, gv, strict=True):
                b.copy_(a, non_blocking=non_blocking)

    def copy_then_cast():
        for cv, gv in zip(cpu_views, bf_views, strict=True):
            for a, b in zip(cv, gv, strict=True):
                b.copy_(a.to(DEV))

    def ours(targets):
        return [ops.stage_h2d(c, desc, ring, g) for c, g in zip(cpu, targets, strict=True)]

    r["per_tensor_pageable_s"] = time_wall(per_tensor, reps=reps)
    r["copy_then_cast_s"] = time_wall(copy_then_cast, reps=reps)
    r["ours_pageable_s"] = time_wall(lambda: ours(gpu), reps=reps)
    r["ours_pageable_bf16_s"] = time_wall(lambda: ours(gpu_bf16), reps=reps)
    ok = all(
        torch.equal(g[int(dst_offs[0]) : int(dst_offs[0]) + 4096].cpu(), c[:4096])
        for c, g in zip(cpu, gpu, strict=True)
    )
    r["check_fp32_ok"] = bool(ok)
    log("model sync (pageable)", json.dumps({k: v for k, v in r.items() if k.endswith("_s")}))
    _model_sync_registered(r, cpu, lambda: per_tensor(True), ours, gpu, gpu_bf16, reps)
    by = 3 * n * 4
    r["speedup_pageable_vs_per_tensor"] = r["per_tensor_pageable_s"] / r["ours_pageable_s"]
    r["registered_vs_pcie_floor"] = r["ours_registered_s"] / r["per_tensor_pinned_s"]
    r["speedup_bf16_vs_copy_then_cast"] = r["copy_then_cast_s"] / r["ours_pageable_bf16_s"]
    r["ours_pageable_GBps"] = by / r["ours_pageable_s"] / GB
    r["ours_registered_GBps"] = by / r["ours_registered_s"] / GB
    r["per_tensor_pageable_GBps"] = by / r["per_tensor_pageable_s"] / GB
    log("model sync", _rounded(r))


def _model_sync_registered(r, cpu, per_tensor_pinned, ours, gpu, gpu_bf16, reps):
    """The same syncs with the CPU buffers page-locked in place (host_register), against
    per-tensor pinned copies (the PCIe floor); unregistered afterwards, also on failure."""
    t = time.perf_counter()
    regs = [torch.ops.reshard.host_register(c) for c in cpu]
    r["register_s"] = time.perf_counter() - t
    r["registered"] = regs
    try:
        r["per_tensor_pinned_s"] = time_wall(per_tensor_pinned, reps=reps)
        r["ours_registered_s"] = time_wall(lambda: ours(gpu), reps=reps)
        r["ours_registered_direct_copies"] = ours(gpu)[-1].direct_copies
        r["ours_registered_bf16_s"] = time_wall(lambda: ours(gpu_bf16), reps=reps)
    finally:
        t = time.perf_counter()
        for c, reg in zip(cpu, regs, strict=True):
            if reg:
                torch.ops.reshard.host_unregister(c)
        r["unregister_s"] = time.perf_counter() - t


# ------------------------------------------------------------------------------- output


def write_outputs(out):
    C.write_results(os.path.join(out, "gpu_bench.json"), RESULTS, markdown, plot)


def markdown(res):
    c = res["ceilings"]
    lines = [
        "# reshard GPU benchmarks",
        "",
        "Environment: " + json.dumps(res["env"]),
        "",
        "## Ceilings (same run)",
        "",
        "| what | GB/s |",
        "| --- | --- |",
    ]
    lines += [f"| {k} | {v:.1f} |" for k, v in c.items() if k.endswith("GBps")]
    lines += _md_copy_runs(res) + _md_staging(res) + _md_ring(res)
    m = res["model_sync"]
    if m:
        lines += [
            "",
            "## 1.5B-parameter offloaded optimizer state -> GPU (single process)",
            "",
            "```",
            json.dumps(m, indent=1),
            "```",
        ]
    return "\n".join(lines) + "\n"


def _md_copy_runs(res) -> list:
    lines = [
        "",
        "## copy_runs (CUDA), gather into a dense buffer",
        "",
        "| run bytes | runs | dst dtype | GB/s (r+w) | / device copy |",
        "| --- | --- | --- | --- | --- |",
    ]
    lines += [
        f"| {x['run_bytes']} | {x['runs']} | {x['dst_dtype']} | {x['GBps']:.0f} | "
        f"{x['ratio_d2d']:.2f} |"
        for x in res["copy_runs"]
    ]
    v = res.get("copy_runs_vs_torch")
    if v:
        lines += [
            "",
            (
                f"20,000 x 16 KiB: copy_runs {v['copy_runs_GBps']:.0f} GB/s, "
                f"_foreach_copy_ {v['foreach_copy_GBps']:.0f} GB/s "
                f"({v['speedup_vs_foreach']:.1f}x), cat {v['cat_GBps']:.0f} GB/s "
                f"({v['speedup_vs_cat']:.1f}x); first call (validate + upload) "
                f"{v['first_call_s'] * 1e3:.1f} ms, cached {v['cached_call_s'] * 1e3:.2f} ms"
            ),
        ]
    return lines


def _md_staging(res) -> list:
    lines = [
        "",
        "## stage_h2d / stage_d2h (ring 64 MiB)",
        "",
        "| case | run bytes | GB/s | floor GB/s | / floor | direct copies | chunks |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    return lines + [
        f"| {x['case']} | {x['run_bytes']} | {x['GBps']:.1f} | {x['floor_GBps']:.1f} | "
        f"{x['ratio_floor']:.2f} | {x['direct_copies']} | {x['chunks']} |"
        for x in res["staging"]
    ]


def _md_ring(res) -> list:
    if not res["ring"]:
        return []
    lines = [
        "",
        "## ring size sweep: 1 GiB in 4 MiB runs from/to pageable host memory",
        "",
        "wire GB/s = bytes crossing PCIe per second (bf16: half the fp32 source); "
        "/ PCIe = that over the pinned copy ceiling of the same run.",
        "",
        "| case | ring MiB | slots | wire GB/s | / PCIe |",
        "| --- | --- | --- | --- | --- |",
    ]
    return lines + [
        f"| {x['case']} | {x['ring_MiB']} | {x['slots']} | {x['wire_GBps']:.1f} | "
        f"{x['of_pcie']:.2f} |"
        for x in res["ring"]
    ]


def plot(stem, res):
    plt = C.pyplot()
    c, m = res["ceilings"], res["model_sync"]
    fig, ax = plt.subplots(1, 3, figsize=(18, 5))
    for ddt, mk in (("float32", "o-"), ("bfloat16", "s--")):
        xs = [x for x in res["copy_runs"] if x["dst_dtype"] == ddt]
        xs.sort(key=lambda x: x["run_bytes"])
        ax[0].semilogx(
            [x["run_bytes"] for x in xs],
            [x["GBps"] for x in xs],
            mk,
            label=f"copy_runs f32->{ddt}",
        )
    ax[0].axhline(c["d2d_GBps"], color="k", ls=":", label="device copy")
    ax[0].set_xlabel("run bytes")
    ax[0].set_ylabel("GB/s (read+write)")
    ax[0].legend()
    ax[0].set_title("copy_runs on the H200")
    st = res["staging"]
    labels = [f"{x['case']}\n{x['run_bytes'] >> 10}K" for x in st]
    ax[1].bar(range(len(st)), [x["GBps"] for x in st])
    ax[1].plot(range(len(st)), [x["floor_GBps"] for x in st], "r_", ms=20, label="floor")
    ax[1].set_xticks(range(len(st)), labels, rotation=90, fontsize=7)
    ax[1].set_ylabel("GB/s")
    ax[1].legend()
    ax[1].set_title("staging (ring 64 MiB)")
    if m:
        keys = [
            k
            for k in (
                "per_tensor_pageable_s",
                "ours_pageable_s",
                "copy_then_cast_s",
                "ours_pageable_bf16_s",
                "per_tensor_pinned_s",
                "ours_registered_s",
                "ours_registered_bf16_s",
            )
            if k in m
        ]
        ax[2].barh(range(len(keys)), [m[k] for k in keys])
        ax[2].set_yticks(range(len(keys)), [k[:-2] for k in keys])
        ax[2].set_xlabel("seconds (18 GB of fp32 state)")
        ax[2].set_title("1.5B-param offloaded optimizer sync")
    fig.tight_layout()
    fig.savefig(stem + ".png", dpi=90)
    plt.close(fig)


def run(args) -> int:
    """The sections `args.only` names (default: all; --skip-model drops the model sync), after
    the ceilings; the results are rewritten after each, so a timeout keeps the finished ones."""
    if not torch.cuda.is_available():
        print("--mode single needs a CUDA device", file=sys.stderr)
        return 2
    p = torch.cuda.get_device_properties(0)
    RESULTS["env"] = C.environment("cuda") | {"gpu": p.name, "sms": p.multi_processor_count}
    log("env", json.dumps(RESULTS["env"]))
    sections = {
        "copy_runs": bench_copy_runs,
        "staging": bench_staging,
        "ring": bench_ring,
        "model": bench_model_sync,
    }
    names = args.only or [n for n in SECTIONS if not (n == "model" and args.skip_model)]
    for step in [ceilings] + [sections[n] for n in names]:
        t = time.perf_counter()
        try:
            step(args.quick)
        except Exception as exc:  # noqa: BLE001 - keep what the other sections measured
            log(f"{step.__name__} FAILED: {type(exc).__name__}: {exc}")
            RESULTS.setdefault("errors", []).append(f"{step.__name__}: {exc}")
        log(f"[{step.__name__}: {time.perf_counter() - t:.1f} s]")
        torch.cuda.empty_cache()
        write_outputs(args.out)
    return 0
