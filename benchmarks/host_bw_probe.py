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
  state, where the time goes (per bucket: the Transfer call, the local copies' own record).

    python benchmarks/host_bw_probe.py --json out/host_bw_probe.json [--sections host,dma,stage,stream]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402
import _scenarios as S  # noqa: E402

import reshard as rs  # noqa: E402

MiB = 1 << 20


def _desc(n):
    return torch.tensor([[0, 0, 0, 0, n, 1]], dtype=torch.int64)


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
            fn()
            ts = []
            for _ in range(3):
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
            s = min(ts)
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

        pack_only()
        pt = []
        for _ in range(3):
            t0 = time.perf_counter()
            pack_only()
            pt.append(time.perf_counter() - t0)
        row = {
            "ring_bytes": ring.numel(),
            "elements": n,
            "s": s,
            "g_elem_per_s": n / s / 1e9,
            "wire_gbps": 2 * n / s / 1e9,
            "pack_only_g_elem_per_s": n / min(pt) / 1e9,
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


def _bucket_timer(stream_obj, rows):
    mover = stream_obj.mover
    orig = mover._move

    def timed(bucket, src, dst, checks, caller_done, host_sync):
        t0 = time.perf_counter()
        rep, ev = orig(bucket, src, dst, checks, caller_done, host_sync)
        if ev is not None:
            ev.synchronize()
        t1 = time.perf_counter()
        tr = mover.transfers.get(bucket.index)
        paths = getattr(getattr(tr, "_engine", None), "_local_paths", (None, None))[1]
        path = paths[0] if paths else None
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


def section_stream(models, iters):
    out = []
    for model in models:
        case = S.stream_offload(model, 0, 1, "cuda")
        bufs = case.targets()
        floor_bytes = case.payload_bytes
        for label, kw in (("stream", {}), ("stream_registered", {"register_host_sources": True})):
            st = rs.Stream(
                case.src_layout,
                [0],
                case.stream["bucket_bytes"],
                dtype=case.dst.dtype,
                device=case.dst_device,
                **kw,
            )

            def step(st=st, case=case, bufs=bufs):
                for name, full in st(case.src_buffers):
                    case.write(name, full, bufs)
                torch.cuda.synchronize()

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
            paths = sync._engine._local_paths[1]
            row = {
                "model": model,
                "method": f"transfer_{budget >> 20}MiB",
                "median_s": statistics.median(ts),
                "min_s": min(ts),
                "payload_bytes": floor_bytes,
                "seconds": {k: v for k, v in r.seconds.items() if v},
                "h2d": dict(paths[0].last) if paths and paths[0] is not None else None,
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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--sections", default="host,dma,stage,stream")
    ap.add_argument("--threads", default="1,2,4,8,12,16")
    ap.add_argument("--elements", type=int, default=64 << 20)
    ap.add_argument("--models", default="gpt-125m,gpt-350m")
    ap.add_argument("--iters", type=int, default=5)
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
    if "stream" in sections:
        rec["stream"] = section_stream(args.models.split(","), args.iters)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(rec, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
