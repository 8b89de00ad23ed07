"""Same-run A/B of the cast prefetch (RESHARD_PROBE_PREFETCH, probe build, every cast mode) on
FSDP2 CPU fp32 per-parameter shards -> bf16 on the GPU (fsdp_weight_sync, world 1): one Transfer
and an rs.Stream, interleaved; what reshard.h2d did per call."""

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
p = torch.ones(256 * MiB, dtype=torch.uint8, pin_memory=True)
d = torch.empty_like(p, device="cuda")
ts = []
for _ in range(8):
    torch.cuda.synchronize()
    t = time.perf_counter()
    d.copy_(p, non_blocking=True)
    torch.cuda.synchronize()
    ts.append(time.perf_counter() - t)
bw = p.numel() / min(ts)
del p, d
print(f"pinned h2d {bw / 1e9:.2f} GB/s", flush=True)
out = {"pinned_h2d_Bps": bw, "on": ON, "models": {}}
for model in sys.argv[2].split(","):
    case = S.fsdp_weight_sync(model, 0, 1, "cuda")
    payload = sum(t.numel() * t.element_size() for t in case.targets().values())
    floor = payload / bw
    T = rs.Transfer(case.src_layout, case.dst_layout, budget_bytes_per_peer=64 * MiB)
    b1 = case.targets()
    st = rs.Stream(
        case.src_layout, [0], 256 * MiB, dtype=torch.bfloat16, device=torch.device("cuda")
    )

    def tr():
        T(case.src_buffers, b1)

    def stream():
        for name, full in st(case.src_buffers):
            pass

    steps = {}
    for k, f in (("transfer", tr), ("stream_nowrite", stream)):
        for tag, val in (("off", ""), ("on", ON)):

            def g(f=f, val=val):
                os.environ["RESHARD_PROBE_PREFETCH"] = val
                f()

            steps[f"{k}_{tag}"] = g
    for f in steps.values():
        for _ in range(6):
            f()
    torch.cuda.synchronize()
    names = list(steps)
    times = {k: [] for k in names}
    for r in range(14):
        for k in names[r % len(names) :] + names[: r % len(names)]:
            torch.cuda.synchronize()
            t = time.perf_counter()
            steps[k]()
            torch.cuda.synchronize()
            times[k].append(time.perf_counter() - t)
    os.environ["RESHARD_PROBE_PREFETCH"] = ""
    res = {"floor_s": floor, "payload_bytes": payload, "rows": {}}
    pt = T._engine.local_h2d
    res["transfer_h2d"] = dict(pt.last) if pt else None
    res["stream_buckets_h2d"] = []
    for b in st.buckets:
        tb = st.mover.transfers.get(b.index)
        ph = getattr(getattr(tb, "_engine", None), "local_h2d", None)
        res["stream_buckets_h2d"].append(dict(ph.last) if ph else None)
    print(model, "payload", payload, "floor ms", floor * 1e3, flush=True)
    print(model, "transfer h2d", res["transfer_h2d"], flush=True)
    for i, l in enumerate(res["stream_buckets_h2d"]):
        print(model, "bucket", i, l, flush=True)
    for k in names:
        m = statistics.median(times[k])
        res["rows"][k] = {"median_s": m, "times": times[k]}
        print(f"{model} {k:20s} {m * 1e3:8.2f} ms  x floor {m / floor:5.2f}", flush=True)
    for k in ("transfer", "stream_nowrite"):
        a, b = res["rows"][f"{k}_off"]["median_s"], res["rows"][f"{k}_on"]["median_s"]
        print(f"{model} {k:20s} on/off {b / a:5.3f}", flush=True)
    out["models"][model] = res
json.dump(out, open(sys.argv[1], "w"), indent=1, default=str)
