"""Same-run A/B of the cast's source prefetch (RESHARD_PROBE_PREFETCH, the probe build) on the
stream_offload state: one Transfer, the stream, the stream not copying, interleaved."""

import json
import os
import statistics
import sys
import time

sys.path.insert(0, "benchmarks")
import _scenarios as S
import torch

import reshard as rs

MiB = 1 << 20
ON = os.environ.get("AB_ON", "t2:16384")


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
out = {"pinned_h2d_Bps": bw, "on": ON, "models": {}}
for model in sys.argv[2].split(","):
    case = S.stream_offload(model, 0, 1, "cuda")
    floor = case.payload_bytes / bw
    kw = dict(dtype=case.dst.dtype, device=case.dst_device)
    base = {}
    T = rs.Transfer(case.src_layout, case.dst_layout, budget_bytes_per_peer=64 * MiB)
    b1 = case.targets()
    base["transfer"] = lambda: T(case.src_buffers, b1)
    st = rs.Stream(case.src_layout, [0], case.stream["bucket_bytes"], **kw)
    b2 = case.targets()

    def stream_step():
        for name, full in st(case.src_buffers):
            case.write(name, full, b2)

    base["stream"] = stream_step

    def stream_nowrite():
        for name, full in st(case.src_buffers):
            pass

    base["stream_nowrite"] = stream_nowrite
    st64 = rs.Stream(case.src_layout, [0], 64 * MiB, **kw)
    b3 = case.targets()

    def stream_b64():
        for name, full in st64(case.src_buffers):
            case.write(name, full, b3)

    base["stream_b64"] = stream_b64
    steps = {}
    for k, f in base.items():
        for tag, val in (("off", ""), ("on", ON)):

            def g(f=f, val=val):
                os.environ["RESHARD_PROBE_PREFETCH"] = val
                f()

            steps[f"{k}_{tag}"] = g
    for k, f in steps.items():
        for _ in range(8):
            f()
    torch.cuda.synchronize()
    names = list(steps)
    times = {k: [] for k in names}
    for r in range(16):
        for k in names[r % len(names) :] + names[: r % len(names)]:
            torch.cuda.synchronize()
            t = time.perf_counter()
            steps[k]()
            torch.cuda.synchronize()
            times[k].append(time.perf_counter() - t)
    os.environ["RESHARD_PROBE_PREFETCH"] = ""
    ok = (
        torch.equal(b2[next(iter(b2))].view(torch.int16), b1[next(iter(b1))].view(torch.int16))
        if len(b1) == 1
        else None
    )
    print(model, "stream targets equal the transfer targets:", ok, flush=True)
    res = {"floor_s": floor, "payload_bytes": case.payload_bytes, "rows": {}, "bitwise": ok}
    for k in names:
        m = statistics.median(times[k])
        res["rows"][k] = {"median_s": m, "min_s": min(times[k]), "times": times[k]}
        print(f"{model} {k:20s} {m * 1e3:8.2f} ms  x floor {m / floor:5.2f}", flush=True)
    for k in base:
        a, b = res["rows"][f"{k}_off"]["median_s"], res["rows"][f"{k}_on"]["median_s"]
        print(f"{model} {k:20s} on/off {b / a:5.3f}", flush=True)
    out["models"][model] = res
json.dump(out, open(sys.argv[1], "w"), indent=1)
