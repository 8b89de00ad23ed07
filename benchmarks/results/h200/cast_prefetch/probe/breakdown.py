"""Session 10 probe: one Transfer of stream_offload (main's h2d vs another h2d over the same
calls, interleaved), h2d.last for each, registered sources, and the stream's buckets."""

import importlib.util
import json
import statistics
import sys
import time

sys.path.insert(0, "benchmarks")
import _scenarios as S
import torch

import reshard as rs

MiB = 1 << 20
out = {}
spec = importlib.util.spec_from_file_location("reshard._h2d_alt", sys.argv[1])
alt = importlib.util.module_from_spec(spec)
sys.modules["reshard._h2d_alt"] = alt
spec.loader.exec_module(alt)


def pinned_bw():
    p = torch.ones(256 * MiB, dtype=torch.uint8, pin_memory=True)
    d = torch.empty_like(p, device="cuda")
    ts = []
    for _ in range(8):
        torch.cuda.synchronize()
        t = time.perf_counter()
        d.copy_(p, non_blocking=True)
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return p.numel() / min(ts)


bw = pinned_bw()
print(f"pinned h2d {bw / 1e9:.2f} GB/s", flush=True)
for model in sys.argv[2].split(","):
    case = S.stream_offload(model, 0, 1, "cuda")
    floor = case.payload_bytes / bw
    steps, lasts = {}, {}
    T = rs.Transfer(case.src_layout, case.dst_layout, budget_bytes_per_peer=64 * MiB)
    bufs = case.targets()
    T(case.src_buffers, bufs)
    T(case.src_buffers, bufs)
    path = T._engine.local_h2d
    calls = []
    orig = path.run

    def grab(*a):
        calls.append(a)
        return orig(*a)

    path.run = grab
    T(case.src_buffers, bufs)
    del path.run
    a = calls[0]
    other = alt.HostToDevice([alt.LocalSpans(t, t.spans) for t in path.tables])
    steps["transfer"] = lambda: T(case.src_buffers, bufs)
    steps["h2d_main"] = lambda: path.run(*a)
    steps["h2d_alt"] = lambda: other.run(*a)
    TR = rs.Transfer(
        case.src_layout, case.dst_layout, budget_bytes_per_peer=64 * MiB, register_host_sources=True
    )
    bufs2 = case.targets()
    steps["transfer_registered"] = lambda: TR(case.src_buffers, bufs2)
    kw = dict(dtype=case.dst.dtype, device=case.dst_device)
    st = rs.Stream(case.src_layout, [0], case.stream["bucket_bytes"], **kw)
    bufs3 = case.targets()

    def stream_step():
        for name, full in st(case.src_buffers):
            case.write(name, full, bufs3)

    steps["stream"] = stream_step

    def stream_nowrite():
        for name, full in st(case.src_buffers):
            pass

    steps["stream_nowrite"] = stream_nowrite
    sr = rs.Stream(
        case.src_layout, [0], case.stream["bucket_bytes"], register_host_sources=True, **kw
    )
    bufs4 = case.targets()

    def stream_reg():
        for name, full in sr(case.src_buffers):
            case.write(name, full, bufs4)

    steps["stream_registered"] = stream_reg
    for k, f in steps.items():
        for _ in range(6):
            f()
    torch.cuda.synchronize()
    times = {k: [] for k in steps}
    names = list(steps)
    for r in range(14):
        for k in names[r % len(names) :] + names[: r % len(names)]:
            torch.cuda.synchronize()
            t = time.perf_counter()
            steps[k]()
            torch.cuda.synchronize()
            times[k].append(time.perf_counter() - t)
    res = {"floor_s": floor}
    for k in names:
        m = statistics.median(times[k])
        res[k] = m
        print(f"{model} {k:22s} {m * 1e3:8.2f} ms  x floor {m / floor:5.2f}", flush=True)
    res["last_main"] = dict(path.last)
    res["last_alt"] = dict(other.last)
    pr = TR._engine.local_h2d
    res["last_registered"] = dict(pr.last) if pr else None
    res["stream_buckets"] = []
    for b in st.buckets:
        tr = st.mover.transfers.get(b.index)
        p = getattr(getattr(tr, "_engine", None), "local_h2d", None)
        res["stream_buckets"].append(dict(p.last) if p else None)
    res["n_buckets"] = len(st.buckets)
    res["registered_buckets"] = []
    for b in sr.buckets:
        tr = sr.mover.transfers.get(b.index)
        p = getattr(getattr(tr, "_engine", None), "local_h2d", None)
        res["registered_buckets"].append(dict(p.last) if p else None)
        print(model, "registered bucket", b.index, res["registered_buckets"][-1], flush=True)
    print(model, "registration", sr.mover.registration, flush=True)
    for k in ("last_main", "last_alt", "last_registered"):
        print(model, k, res[k], flush=True)
    for i, l in enumerate(res["stream_buckets"]):
        print(model, "bucket", i, l, flush=True)
    out[model] = res
json.dump(out, open(sys.argv[3], "w"), indent=1)
