"""Same-run A/B: main's reshard.h2d (a copy_runs call per ring piece) against this build's (one
copy_pieces call per ring slot), over the same calls: FSDP2 CPU fp32 per-parameter shards ->
bf16 on the GPU (fsdp_weight_sync, world 1), and stream_offload as a check."""

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
spec = importlib.util.spec_from_file_location("reshard._h2d_main", sys.argv[1])
old = importlib.util.module_from_spec(spec)
sys.modules["reshard._h2d_main"] = old
spec.loader.exec_module(old)
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
out = {"pinned_h2d_Bps": bw, "cases": {}}
for scen, model in [
    ("fsdp_weight_sync", "gpt-125m"),
    ("fsdp_weight_sync", "gpt-350m"),
    ("stream_offload", "gpt-125m"),
]:
    case = getattr(S, scen)(model, 0, 1, "cuda")
    b1 = case.targets()
    payload = sum(t.numel() * t.element_size() for t in b1.values())
    floor = payload / bw
    T = rs.Transfer(case.src_layout, case.dst_layout, budget_bytes_per_peer=64 * MiB)
    T(case.src_buffers, b1)
    T(case.src_buffers, b1)
    path = T._engine.local_h2d
    calls = []
    orig = path.run

    def grab(*a, calls=calls, orig=orig):
        calls.append(a)
        return orig(*a)

    path.run = grab
    T(case.src_buffers, b1)
    del path.run
    a = calls[0]
    other = old.HostToDevice([old.LocalSpans(t, t.spans) for t in path.tables])
    ref = {k: v.clone() for k, v in b1.items()}
    b2 = {k: torch.full_like(v, 7) for k, v in b1.items()}
    other.run(a[0], b2, *a[2:])
    torch.cuda.synchronize()
    same = all(torch.equal(b2[k].view(torch.int16), ref[k].view(torch.int16)) for k in ref)
    st = rs.Stream(
        case.src_layout, [0], 256 * MiB, dtype=torch.bfloat16, device=torch.device("cuda")
    )

    def stream(st=st, case=case):
        for name, full in st(case.src_buffers):
            pass

    steps = {
        "transfer": lambda T=T, case=case, b1=b1: T(case.src_buffers, b1),
        "h2d_new": lambda path=path, a=a: path.run(*a),
        "h2d_main": lambda other=other, a=a: other.run(*a),
        "stream_nowrite": stream,
    }
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
    ok = all(torch.equal(b1[k].view(torch.int16), ref[k].view(torch.int16)) for k in ref)
    res = {
        "floor_s": floor,
        "payload_bytes": payload,
        "main_equals_new": same,
        "new_stable": ok,
        "rows": {},
        "last_new": dict(path.last),
        "last_main": dict(other.last),
    }
    key = f"{scen}/{model}"
    print(
        key,
        "floor ms",
        round(floor * 1e3, 2),
        "main h2d == new h2d bitwise:",
        same,
        "repeat equal:",
        ok,
        flush=True,
    )
    for k in names:
        m = statistics.median(times[k])
        res["rows"][k] = {"median_s": m, "times": times[k]}
        print(f"{key} {k:16s} {m * 1e3:8.2f} ms  x floor {m / floor:5.2f}", flush=True)
    print(
        key,
        "new/main h2d",
        round(res["rows"]["h2d_new"]["median_s"] / res["rows"]["h2d_main"]["median_s"], 3),
        flush=True,
    )
    for k in ("last_new", "last_main"):
        l = res[k]
        print(
            key,
            k,
            {
                x: l.get(x)
                for x in ("ring_pieces", "staged_pieces", "host_pack_s", "host_s", "total_s")
            },
            flush=True,
        )
    out["cases"][key] = res
json.dump(out, open(sys.argv[2], "w"), indent=1, default=str)
