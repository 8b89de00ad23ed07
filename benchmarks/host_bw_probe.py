"""The host side of CPU -> GPU copies on one machine (one process, one GPU), measured in one run:
what bounds fp32 host state reaching the GPU as bf16.

- host: the host's memory bandwidth with 1..16 threads (torch's pool): read (a sum), copy
  fp32 -> fp32 (torch's copy: plain stores, so the destination is read for ownership first),
  copy with streaming stores (the C core's same-dtype copy of >= 4 MiB), cast fp32 -> bf16
  into a large buffer (the C core's cast: plain stores), and the cast into a small reused
  region (a ring's slots: the destination stays in the cache), each alone and while an H2D
  DMA of pinned memory runs (the ring's reads of bf16, or a device-side cast's fp32 reads);
  both rates are measured over the same window;
- dma: H2D copies of pinned memory in chunks of 256 KiB .. 16 MiB, from one stream and
  spread over 16 streams;
- stage: `stage_h2d` of pageable fp32 into a dense bf16 target through rings of 16 and 64 MiB,
  and the host's pack of the same chunks into the ring alone (no DMA);
- stream: the stream_offload scenario (CPU fp32 masters -> bf16 tensors by name): per call
  of an `rs.Stream` (pageable and registered sources) and of one `rs.Transfer` of the same
  state, where the time goes (per bucket: the Transfer call, the local copies' own record);
- split (on request): page-locked fp32 -> bf16 through reshard.h2d with the host/device cast
  split forced to each of --shares (this code's and, with --before, another h2d.py's), its
  controls, and the split policy call by call;
- policy (on request): whole offload_bf16 / stream_offload calls from registered sources with
  the split off, this code's policy and --before's, interleaved call by call;
- fsdp (on request): fsdp_offload from registered sources with the direct copies queued one
  Python call each and in one call, and what one small DMA costs the copy engine.

    python benchmarks/host_bw_probe.py --json out/host_bw_probe.json [--sections host,dma,stage,stream]
    python benchmarks/host_bw_probe.py --json out/split.json --sections split,policy,fsdp \
        --before OLD/h2d.py --shares 0.0,0.2,0.3,0.4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import types
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402
import _scenarios as S  # noqa: E402

import reshard as rs  # noqa: E402

MiB = 1 << 20


def _desc(n):
    return torch.tensor([[0, 0, 0, 0, n, 1]], dtype=torch.int64)


def _best_wall(fn, reps=3):
    """Fastest wall seconds of `reps` calls of a host-synchronous fn, after one warm-up call."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _dma_batch(src_pinned, dst_dev, stream, copies):
    """Queue `copies` H2D copies of the pinned buffer on `stream`; (start, end) events."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record(stream)
    with torch.cuda.stream(stream):
        for _ in range(copies):
            dst_dev.copy_(src_pinned, non_blocking=True)
    b.record(stream)
    return a, b


def _host_ops(n):
    src = torch.rand(n)
    dst32 = torch.empty(n)
    dst32.fill_(1.0)
    dst16 = torch.empty(n, dtype=torch.bfloat16)
    dst16.fill_(1.0)
    ring = torch.empty(16 * MiB, dtype=torch.uint8)
    ring.fill_(1)
    piece = 2 * MiB // 2  # elements per ring piece: 2 MiB of bf16
    d_all, d_piece = _desc(n), _desc(piece)
    slots = ring.numel() // (piece * 2)

    def cast_ring():
        for k in range(n // piece):
            sl = k % slots
            w = ring[sl * piece * 2 : (sl + 1) * piece * 2].view(torch.bfloat16)
            torch.ops.reshard.copy_runs(src[k * piece : (k + 1) * piece], d_piece, w)

    # (name, fn, bytes read + written as named, bytes incl. read-for-ownership)
    return src, [
        ("read", lambda: src.sum(), 4 * n, 4 * n),
        ("copy", lambda: dst32.copy_(src), 8 * n, 12 * n),
        ("copy_stream", lambda: torch.ops.reshard.copy_runs(src, d_all, dst32), 8 * n, 8 * n),
        ("cast", lambda: torch.ops.reshard.copy_runs(src, d_all, dst16), 6 * n, 8 * n),
        ("cast_ring", cast_ring, 6 * n, 4 * n),
    ]


def section_host(threads, n, dma_mib):
    out = []
    src, ops = _host_ops(n)
    pinned = torch.empty(dma_mib * MiB, dtype=torch.uint8, pin_memory=True)
    pinned.fill_(1)
    dev = torch.empty(dma_mib * MiB, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    # the DMA alone
    a, b = _dma_batch(pinned, dev, side, 4)
    b.synchronize()
    link = 4 * pinned.numel() / (a.elapsed_time(b) / 1e3)
    out.append({"op": "dma_alone", "threads": 0, "dma_gbps": link / 1e9})
    for t in threads:
        torch.set_num_threads(t)
        for name, fn, named, traffic in ops:
            s = _best_wall(fn)
            row = {"op": name, "threads": t, "elements": n, "s": s}
            row |= {"gbps_named": named / s / 1e9, "gbps_traffic": traffic / s / 1e9}
            row["g_elem_per_s"] = n / s / 1e9
            # the same op looped while a DMA batch runs (both rates over the same window)
            copies = max(2, int(0.15 * link / pinned.numel()))
            torch.cuda.synchronize()
            a, b = _dma_batch(pinned, dev, side, copies)
            t0, it = time.perf_counter(), 0
            while not b.query():
                fn()
                it += 1
            wall = time.perf_counter() - t0
            b.synchronize()
            dma_s = a.elapsed_time(b) / 1e3
            row["with_dma"] = {
                "iters": it,
                "s_per_iter": wall / max(it, 1),
                "gbps_traffic": it * traffic / wall / 1e9,
                "g_elem_per_s": it * n / wall / 1e9,
                "dma_gbps": copies * pinned.numel() / dma_s / 1e9,
            }
            out.append(row)
            print(
                f"host {name:12s} t={t:2d} {row['g_elem_per_s']:6.2f} Gel/s "
                f"{row['gbps_traffic']:7.1f} GB/s | +dma {row['with_dma']['g_elem_per_s']:6.2f} "
                f"Gel/s {row['with_dma']['gbps_traffic']:7.1f} GB/s dma "
                f"{row['with_dma']['dma_gbps']:5.1f}",
                flush=True,
            )
    torch.set_num_threads(os.cpu_count() or 1)
    del src
    return out


def section_dma(total_mib):
    out = []
    pinned = torch.empty(total_mib * MiB, dtype=torch.uint8, pin_memory=True)
    pinned.fill_(1)
    dev = torch.empty_like(pinned, device="cuda")
    streams = [torch.cuda.Stream() for _ in range(16)]
    for chunk_kib in (256, 1024, 4096, 16384):
        c = chunk_kib * 1024
        k = pinned.numel() // c
        for ns in (1, 16):
            best = None
            for _ in range(3):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for i in range(k):
                    with torch.cuda.stream(streams[i % ns]):
                        dev[i * c : (i + 1) * c].copy_(
                            pinned[i * c : (i + 1) * c], non_blocking=True
                        )
                torch.cuda.synchronize()
                s = time.perf_counter() - t0
                best = s if best is None else min(best, s)
            row = {"chunk_bytes": c, "streams": ns, "gbps": k * c / best / 1e9}
            print(
                f"dma chunk {chunk_kib:6d} KiB streams {ns:2d}: {row['gbps']:.1f} GB/s", flush=True
            )
            out.append(row)
    return out


def section_stage(n):
    out = []
    src = torch.rand(n)
    dst = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    ref = src.to(torch.bfloat16)
    d = _desc(n)
    for ring_mib in (16, 64):
        ring = torch.empty(ring_mib * MiB, dtype=torch.uint8, pin_memory=True)
        ts = []
        for _ in range(4):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            torch.ops.reshard.stage_h2d(src, d, ring, dst)
            ts.append(time.perf_counter() - t0)
        ok = bool(torch.equal(dst.cpu(), ref))
        s = min(ts[1:])
        slot = ring.numel() // 4 // 2
        dr = _desc(slot)

        def pack_only(ring=ring, slot=slot, dr=dr):
            for k in range(n // slot):
                sl = k % 4
                w = ring[sl * slot * 2 : (sl + 1) * slot * 2].view(torch.bfloat16)
                torch.ops.reshard.copy_runs(src[k * slot : (k + 1) * slot], dr, w)

        pack_s = _best_wall(pack_only)
        row = {
            "ring_bytes": ring.numel(),
            "elements": n,
            "s": s,
            "g_elem_per_s": n / s / 1e9,
            "wire_gbps": 2 * n / s / 1e9,
            "pack_only_g_elem_per_s": n / pack_s / 1e9,
            "bitwise": ok,
        }
        print(f"stage ring {ring_mib} MiB: {row}", flush=True)
        out.append(row)
    # per-call cost: a quarter of the table per call, back to back and 2 ms apart (the host
    # threads idle between calls, as between a stream's buckets)
    m = n // 4
    d = _desc(m)
    for gap in (0.0, 0.002):
        ts = []
        for _ in range(6):
            torch.cuda.synchronize()
            time.sleep(gap)
            t0 = time.perf_counter()
            torch.ops.reshard.stage_h2d(src[:m], d, ring, dst[:m])
            ts.append(time.perf_counter() - t0)
        row = {"ring_bytes": ring.numel(), "elements": m, "gap_s": gap}
        row |= {"median_s": statistics.median(ts[1:]), "min_s": min(ts[1:])}
        row["g_elem_per_s"] = m / row["median_s"] / 1e9
        print(f"stage quarter gap {gap}: {row}", flush=True)
        out.append(row)
    return out


def section_rings(n, rounds, rings_mib, threads):
    """stage_h2d of n pageable fp32 elements -> a dense bf16 target through rings of several
    sizes (the queued H2D cuts each into slots of at most 4 MiB and half the ring) and host
    thread counts:
    interleaved rounds, the order rotated per round; the first round checks bits."""
    src = torch.rand(n)
    ref = src.to(torch.bfloat16)
    dst = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    d = _desc(n)
    rings = {r: torch.empty(int(r * MiB), dtype=torch.uint8, pin_memory=True) for r in rings_mib}
    cells = [(r, t) for t in threads for r in rings_mib]
    times = {c: [] for c in cells}
    ok, stats = {}, {}
    before = torch.get_num_threads()
    for rnd in range(rounds + 1):
        k = rnd % len(cells)
        for c in cells[k:] + cells[:k]:
            r, t = c
            torch.set_num_threads(t)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            st = torch.ops.reshard.stage_h2d(src, d, rings[r], dst)
            dt = time.perf_counter() - t0
            if rnd:
                times[c].append(dt)
            else:
                ok[c] = bool(torch.equal(dst.cpu(), ref))
                stats[c] = [int(x) for x in st.tolist()]
                dst.fill_(0)
    torch.set_num_threads(before)
    out = []
    for c in cells:
        r, t = c
        med = statistics.median(times[c])
        row = {"ring_mib": r, "threads": t, "elements": n, "median_s": med, "min_s": min(times[c])}
        row |= {"g_elem_per_s": n / med / 1e9, "bitwise": ok[c], "stats": stats[c]}
        print(
            f"ring {r:>5} MiB threads {t:>2}: {row['g_elem_per_s']:.2f} G elem/s "
            f"(best {n / row['min_s'] / 1e9:.2f}) bitwise {ok[c]} stats {stats[c]}",
            flush=True,
        )
        out.append(row)
    return out


def _bucket_timer(stream_obj, rows):
    mover = stream_obj.mover
    orig = mover._move

    def timed(bucket, *args):
        t0 = time.perf_counter()
        rep, ev = orig(bucket, *args)
        if ev is not None:
            ev.synchronize()
        t1 = time.perf_counter()
        tr = mover.transfers.get(bucket.index)
        path = getattr(getattr(tr, "_engine", None), "local_h2d", None)
        rows.append(
            {
                "bucket": bucket.index,
                "bytes": bucket.nbytes,
                "s": t1 - t0,
                "seconds": {k: v for k, v in rep.seconds.items() if v},
                "h2d": dict(path.last) if path is not None else None,
            }
        )
        return rep, ev

    mover._move = timed


def _case_stream(case, bufs, synchronize=False, **kw):
    """(the case's rs.Stream, one sync: every tensor handed to the 'engine' weights in bufs,
    then the device synchronized where `synchronize`)."""
    st = rs.Stream(
        case.src_layout,
        [0],
        case.stream["bucket_bytes"],
        dtype=case.dst.dtype,
        device=case.dst_device,
        **kw,
    )

    def step():
        for name, full in st(case.src_buffers):
            case.write(name, full, bufs)
        if synchronize:
            torch.cuda.synchronize()

    return st, step


def section_stream(models, iters):
    out = []
    for model in models:
        case = S.stream_offload(model, 0, 1, "cuda")
        bufs = case.targets()
        floor_bytes = case.payload_bytes
        for label, kw in (("stream", {}), ("stream_registered", {"register_host_sources": True})):
            st, step = _case_stream(case, bufs, synchronize=True, **kw)

            for _ in range(2):
                step()
            ts, per_bucket = [], []
            for i in range(iters):
                rows = [] if i == iters - 1 else None
                if rows is not None:
                    _bucket_timer(st, rows)
                t0 = time.perf_counter()
                step()
                ts.append(time.perf_counter() - t0)
                if rows is not None:
                    per_bucket = rows
            rep = st.report
            row = {
                "model": model,
                "method": label,
                "median_s": statistics.median(ts),
                "min_s": min(ts),
                "payload_bytes": floor_bytes,
                "buckets": len(st.buckets),
                "ring_bytes": st.mover.pool.ring_nbytes,
                "wait_s": rep.wait_seconds,
                "seconds": {k: v for k, v in rep.seconds.items() if v},
                "per_bucket_last_call": per_bucket,
            }
            print(f"stream {model} {label}: {statistics.median(ts) * 1e3:.2f} ms", flush=True)
            out.append(row)
            st.close()
        for budget in (16 * MiB, 64 * MiB):
            sync = rs.Transfer(case.src_layout, case.dst_layout, budget_bytes_per_peer=budget)
            for _ in range(2):
                sync(case.src_buffers, bufs)
            torch.cuda.synchronize()
            ts = []
            for _ in range(iters):
                t0 = time.perf_counter()
                r = sync(case.src_buffers, bufs)
                torch.cuda.synchronize()
                ts.append(time.perf_counter() - t0)
            path = sync._engine.local_h2d
            row = {
                "model": model,
                "method": f"transfer_{budget >> 20}MiB",
                "median_s": statistics.median(ts),
                "min_s": min(ts),
                "payload_bytes": floor_bytes,
                "seconds": {k: v for k, v in r.seconds.items() if v},
                "h2d": dict(path.last) if path is not None else None,
            }
            print(
                f"stream {model} {row['method']}: {row['median_s'] * 1e3:.2f} ms {row['h2d']}",
                flush=True,
            )
            out.append(row)
            sync.close()
        ok = all(torch.equal(bufs[k].cpu(), case.reference[k]) for k in bufs)
        out.append({"model": model, "bitwise": ok})
    return out


def _load_h2d(path):
    """reshard.h2d as another module (the code to compare against, e.g. an earlier
    commit's python/reshard/h2d.py)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("h2d_before", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["h2d_before"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def _one_table(mod, n):
    t = SimpleNamespace(src_location=0, dst_location=1, desc=_desc(n))
    return [mod.LocalSpans(t, np.array([[0, 0, n]], dtype=np.int64))]


def _forced(mod, n, host_share):
    """A HostToDevice path of one dense fp32 -> bf16 table with its split forced."""
    p = mod.HostToDevice(_one_table(mod, n))
    p.split, p.host_share, p.link_bytes_per_s = "kept", host_share, 1.0
    p._balance = lambda *a, **k: False  # the share stays
    return p


def section_split(n, before, rounds, shares=(0.0, 0.1, 0.2, 0.3, 0.4, 1.0)):
    """fp32 in page-locked memory -> dense bf16 on the GPU through reshard.h2d with the
    device share forced (this code and `before`'s), its controls (the host part alone, with a
    concurrent fp32 DMA of the device part, the DMA alone), the registered vs pinned source,
    then the split policy itself, call by call; every variant once per round, interleaved."""
    from reshard import h2d
    from reshard.hostreg import HostRegistry

    out = {"env": C.environment("cuda")}
    src = torch.rand(n) * 100
    src[:4] = torch.tensor([float("nan"), float("inf"), 1e-40, -0.0])
    reg = HostRegistry()
    reg.sync({0: src})
    assert src.is_pinned()
    pin = torch.empty(n, pin_memory=True)  # cudaHostAlloc memory (src.pin_memory() is src)
    pin.copy_(src)
    ref = torch.empty(n, dtype=torch.bfloat16)
    torch.ops.reshard.copy_runs(src, _desc(n), ref)
    ref_bits = ref.view(torch.int16)
    dst = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    ring = torch.empty(64 * MiB, dtype=torch.uint8, pin_memory=True)
    dev_bytes = int(torch.ops.reshard.stage_device_bytes(ring.numel()))
    out["device_bytes"] = dev_bytes
    scratch32 = torch.empty(n, dtype=torch.float32, device="cuda")
    side = torch.cuda.Stream()
    d_all = _desc(n)
    m = round(0.7 * n)
    d_m = _desc(m)
    mods = {"new": h2d} | ({"before": before} if before is not None else {})
    variants = {"stage_all": lambda: torch.ops.reshard.stage_h2d(src, d_all, ring, dst)}
    paths = {}
    for tag, mod in mods.items():
        for dshare in shares:
            paths[f"{tag}_d{dshare}"] = (_forced(mod, n, 1.0 - dshare), src)
    paths["new_pinned_d0.0"] = (_forced(h2d, n, 1.0), pin)
    paths["new_pinned_d0.3"] = (_forced(h2d, n, 0.7), pin)
    for label, (p, s) in paths.items():
        variants[label] = lambda p=p, s=s: p.run({0: s}, {1: dst}, ring, dev_bytes)

    def host_part_with_dma():
        with torch.cuda.stream(side):
            scratch32[m:].copy_(src[m:], non_blocking=True)
        torch.ops.reshard.stage_h2d(src[:m], d_m, ring, dst[:m])

    def dma_part_alone():
        with torch.cuda.stream(side):
            scratch32[m:].copy_(src[m:], non_blocking=True)

    def dma_all_fp32():
        with torch.cuda.stream(side):
            scratch32.copy_(src, non_blocking=True)

    partial = {
        "host_part_alone": lambda: torch.ops.reshard.stage_h2d(src[:m], d_m, ring, dst[:m]),
        "host_part_with_dma": host_part_with_dma,
        "dma_part_alone": dma_part_alone,
        "dma_all_fp32": dma_all_fp32,
    }
    allv = variants | partial
    times = {k: [] for k in allv}
    lasts = {k: [] for k in paths}
    ok = {}
    names = list(allv)
    for rnd in range(rounds):
        order = names[rnd % len(names) :] + names[: rnd % len(names)]
        for label in order:
            dst.fill_(float("nan"))
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            allv[label]()
            torch.cuda.synchronize()
            times[label].append(time.perf_counter() - t0)
            if label in paths:
                lasts[label].append(dict(paths[label][0].last))
            if rnd == rounds - 1 and label in variants:
                ok[label] = bool(torch.equal(dst.cpu().view(torch.int16), ref_bits))
    out["elements"], out["rounds"] = n, rounds
    out["variants"] = {}
    base = statistics.median(times["stage_all"][1:])
    for label in names:
        med = statistics.median(times[label][1:])
        row = {"median_s": med, "min_s": min(times[label][1:]), "x_stage_all": med / base}
        row["g_elem_per_s"] = n / med / 1e9
        if label in ok:
            row["bitwise"] = ok[label]
        if label in lasts:
            keep = ("device_cast_elements", "host_s", "device_side_s", "total_s", "host_share")
            row["last"] = {k: lasts[label][-1].get(k) for k in keep}
            row["host_s_median"] = statistics.median(x["host_s"] for x in lasts[label][1:])
        out["variants"][label] = row
        print(
            f"split {label:18s} {med * 1e3:7.2f} ms  x stage_all {row['x_stage_all']:.3f}  "
            f"{row['g_elem_per_s']:6.2f} Gel/s {row.get('bitwise', '')} "
            f"{row.get('last', '')}",
            flush=True,
        )
    out["link_fp32_gbps"] = 4 * n / out["variants"]["dma_all_fp32"]["median_s"] / 1e9
    out["bf16_floor_s"] = 2 * n / (out["link_fp32_gbps"] * 1e9)
    # the policy itself: a fresh path per module, call by call
    auto = {tag: mod.HostToDevice(_one_table(mod, n)) for tag, mod in mods.items()}
    out["policy"] = {tag: [] for tag in auto}
    for _call in range(12):
        for tag, p in auto.items():
            dst.fill_(float("nan"))
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            p.run({0: src}, {1: dst}, ring, dev_bytes)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
            rec = {"wall_s": wall, "link": p.link_bytes_per_s, "h": p.host_s_per_elem}
            rec |= {"next_share": p.host_share, "trial": {k: list(v) for k, v in p._trial.items()}}
            rec["last"] = dict(p.last)
            out["policy"][tag].append(rec)
    for tag, p in auto.items():
        ok_bits = bool(torch.equal(dst.cpu().view(torch.int16), ref_bits)) if tag == "new" else None
        calls = out["policy"][tag]
        print(
            f"split policy {tag}: link {p.link_bytes_per_s} h {p.host_s_per_elem} split {p.split} "
            f"shares {[round(c['last']['host_share'], 3) for c in calls]} ms "
            f"{[round(c['wall_s'] * 1e3, 2) for c in calls]} bitwise(last={tag == 'new'}) {ok_bits}",
            flush=True,
        )
    reg.close()
    return out


def _patched(cls):
    """Context: reshard.executor builds its local CPU -> CUDA paths as `cls`."""
    import contextlib

    import reshard.executor as ex

    @contextlib.contextmanager
    def cm():
        orig = ex.HostToDevice
        ex.HostToDevice = cls
        try:
            yield
        finally:
            ex.HostToDevice = orig

    return cm()


def _h2d_paths(transfers):
    out = []
    for t in transfers:
        path = getattr(getattr(t, "_engine", None), "local_h2d", None)
        if path is not None:
            out.append(path)
    return out


def section_policy(models, before, iters):
    """Whole calls with page-locked (registered) sources, the split off (every cast on the
    host), `before`'s policy and this code's, interleaved call by call: offload_bf16 (one
    Transfer, 64 MiB budget) and stream_offload (rs.Stream)."""
    from reshard import h2d

    class Off(h2d.HostToDevice):
        def __init__(self, tables):
            super().__init__(tables)
            self.split = "rejected"

    classes = {"off": Off, "new": h2d.HostToDevice}
    if before is not None:
        classes["before"] = before.HostToDevice
    out = []
    for model in models:
        for scen in ("offload_bf16", "stream_offload"):
            case = getattr(S, scen)(model, 0, 1, "cuda")
            bufs = case.targets()
            steps, objs, closers = {}, {}, []
            for label, cls in classes.items():
                if scen == "stream_offload":
                    st, step = _case_stream(case, bufs, register_host_sources=True)

                    def trs(st=st):
                        return list(st.mover.transfers.values())

                else:
                    st = rs.Transfer(
                        case.src_layout,
                        case.dst_layout,
                        budget_bytes_per_peer=64 * MiB,
                        register_host_sources=True,
                    )

                    def step(st=st, case=case, bufs=bufs):
                        st(case.src_buffers, bufs)

                    def trs(st=st):
                        return [st]

                with _patched(cls):
                    step()
                    for t in trs():
                        w = getattr(t, "wait_host_registration", None)
                        if w is not None:
                            w()
                    step()
                steps[label], objs[label] = step, trs
                closers.append(st)
            times = {k: [] for k in steps}
            warm = 8
            for i in range(warm + iters):
                for label in steps:
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    steps[label]()
                    torch.cuda.synchronize()
                    if i >= warm:
                        times[label].append(time.perf_counter() - t0)
            row = {"model": model, "scenario": scen, "payload_bytes": case.payload_bytes}
            row["floor_s_55gbps"] = case.payload_bytes / 55e9
            for label in steps:
                row[f"{label}_median_s"] = statistics.median(times[label])
                row[f"{label}_min_s"] = min(times[label])
                row[f"{label}_h2d"] = [dict(p.last) for p in _h2d_paths(objs[label]())]
            for label in steps:
                row[f"{label}_vs_off"] = row[f"{label}_median_s"] / row["off_median_s"]
            row["bitwise"] = all(torch.equal(bufs[k].cpu(), case.reference[k]) for k in bufs)
            print(
                f"policy {model} {scen}: "
                + ", ".join(
                    f"{k} {row[f'{k}_median_s'] * 1e3:.2f} ms ({row[f'{k}_vs_off']:.3f})"
                    for k in steps
                )
                + f" shares new {[round(h.get('host_share', 1), 2) for h in row['new_h2d']]}"
                f" {[h.get('split') for h in row['new_h2d']]} ok {row['bitwise']}",
                flush=True,
            )
            out.append(row)
            for st in closers:
                st.close()
            del steps, objs, closers, case, bufs
    return out


def _direct_copies_loop(self, q, src, dst, direct_bytes, whole=None):
    """reshard.h2d's direct copies as one Python `copy_` call each (the earlier code)."""
    for s, d, a, b, n in direct_bytes:
        with q.on(q.side):
            dst[d].view(torch.uint8)[b : b + n].copy_(
                src[s].view(torch.uint8)[a : a + n], non_blocking=True
            )


def section_fsdp(models, iters):
    """fsdp_offload (FSDP2 CPU-offloaded fp32 state -> fp32 device partitions, registered
    sources: direct copies), the direct copies issued one Python call each and in one call,
    toggled call by call on one Transfer; where each call's time goes; and what one small DMA
    costs on the copy engine."""
    out = {"calls": [], "dma": []}
    for model in models:
        case = S.fsdp_offload(model, 0, 1, "cuda")
        bufs = case.targets()
        sync = rs.Transfer(
            case.src_layout,
            case.dst_layout,
            budget_bytes_per_peer=64 * MiB,
            register_host_sources=True,
        )
        sync(case.src_buffers, bufs)
        sync.wait_host_registration()
        sync(case.src_buffers, bufs)
        path = _h2d_paths([sync])[0]
        variants = {"one_call": None, "loop": types.MethodType(_direct_copies_loop, path)}
        rec = {k: {"s": [], "seconds": [], "h2d": []} for k in variants}
        for i in range(3 + iters):
            for label, meth in variants.items():
                if meth is None:
                    path.__dict__.pop("_direct_copies", None)
                else:
                    path._direct_copies = meth
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                r = sync(case.src_buffers, bufs)
                torch.cuda.synchronize()
                if i >= 3:
                    rec[label]["s"].append(time.perf_counter() - t0)
                    rec[label]["seconds"].append({k: v for k, v in r.seconds.items() if v})
                    rec[label]["h2d"].append(dict(path.last))
        path.__dict__.pop("_direct_copies", None)
        ok = all(torch.equal(bufs[k].cpu(), case.reference[k]) for k in bufs)
        floor = case.payload_bytes / 55e9
        for label, v in rec.items():
            keys = set().union(*[s.keys() for s in v["seconds"]])
            row = {"model": model, "method": label, "payload_bytes": case.payload_bytes}
            row["median_s"] = statistics.median(v["s"])
            row["x_floor_55gbps"] = row["median_s"] / floor
            row["seconds_median"] = {
                k: statistics.median(s.get(k, 0.0) for s in v["seconds"]) for k in keys
            }
            for k in ("host_s", "device_side_s", "total_s"):
                row[f"h2d_{k}_median"] = statistics.median(h[k] for h in v["h2d"])
            row["direct_copies"] = v["h2d"][-1].get("direct_copies")
            row["bitwise"] = ok
            print(f"fsdp {model} {label}: {row}", flush=True)
            out["calls"].append(row)
        sync.close()
        del case, bufs
    # the copy engine's cost per small copy: k copies of b bytes from registered memory
    from reshard.hostreg import HostRegistry

    host = torch.rand(64 * MiB // 4)
    reg = HostRegistry()
    reg.sync({0: host})
    hb = host.view(torch.uint8)
    devb = torch.empty_like(hb, device="cuda")
    st = torch.cuda.Stream()
    for b, k in ((3072, 256), (65536, 256), (3072 * 256, 1), (64 * MiB, 1)):
        best = None
        for _ in range(5):
            a, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            to = [devb[i * b : (i + 1) * b] for i in range(k)]
            fro = [hb[i * b : (i + 1) * b] for i in range(k)]
            with torch.cuda.stream(st):
                torch.cuda._sleep(4_000_000)  # the copies queue up behind it: device time only
            a.record(st)
            with torch.cuda.stream(st):
                torch._foreach_copy_(to, fro, non_blocking=True)
            e.record(st)
            e.synchronize()
            ms = a.elapsed_time(e)
            best = ms if best is None else min(best, ms)
        row = {"bytes": b, "copies": k, "device_us": best * 1e3, "us_per_copy": best * 1e3 / k}
        print(f"fsdp dma {row}", flush=True)
        out["dma"].append(row)
    reg.close()
    return out


def _dump(rec, path):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(rec, f, indent=1, default=str)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--sections", default="host,dma,stage,stream")
    ap.add_argument("--threads", default="1,2,4,8,12,16")
    ap.add_argument("--elements", type=int, default=64 << 20)
    ap.add_argument("--models", default="gpt-125m,gpt-350m")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument(
        "--before",
        default=None,
        help="another python/reshard/h2d.py to compare against (split, policy, fsdp sections)",
    )
    ap.add_argument("--split-elements", type=int, default=64 << 20)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--rings", default="1,2,4,8,16,32,64", help="ring MiB (rings section)")
    ap.add_argument("--ring-threads", default="16,14", help="host threads (rings section)")
    ap.add_argument("--shares", default="0.0,0.1,0.2,0.3,0.4,1.0", help="device shares (split)")
    args = ap.parse_args(argv)
    sections = args.sections.split(",")
    rec = {
        "command": C.command_line("benchmarks/host_bw_probe.py", argv),
        "env": C.environment("cuda"),
    }
    if "host" in sections:
        rec["host"] = section_host([int(t) for t in args.threads.split(",")], args.elements, 512)
    if "dma" in sections:
        rec["dma"] = section_dma(512)
    if "stage" in sections:
        rec["stage"] = section_stage(2 * args.elements)
    if "rings" in sections:
        rings = [float(r) for r in args.rings.split(",")]
        threads = [int(t) for t in args.ring_threads.split(",")]
        rec["rings"] = section_rings(2 * args.elements, args.rounds, rings, threads)
    if "stream" in sections:
        rec["stream"] = section_stream(args.models.split(","), args.iters)
    before = _load_h2d(args.before) if args.before else None
    models = args.models.split(",")
    for name, fn in (
        (
            "split",
            lambda: section_split(
                args.split_elements,
                before,
                args.rounds,
                [float(x) for x in args.shares.split(",")],
            ),
        ),
        ("policy", lambda: section_policy(models, before, args.iters)),
        ("fsdp", lambda: section_fsdp(models, args.iters)),
    ):
        if name in sections:
            try:
                rec[name] = fn()
            except Exception as e:  # noqa: BLE001 - a probe: keep the other sections' results
                import traceback

                traceback.print_exc()
                rec[name] = {"error": repr(e)}
            _dump(rec, args.json)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(rec, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
