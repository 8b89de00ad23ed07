"""stage_h2d fp32 -> bf16 (128 M elements, dense target, 32 MiB of ring as reshard.h2d uses for
casts), source prefetch variants (RESHARD_PROBE_PREFETCH) and thread counts, interleaved."""

import json
import os
import statistics
import sys
import time

import torch  # noqa

n = 128 << 20
MiB = 1 << 20
ring = torch.empty(64 * MiB, dtype=torch.uint8, pin_memory=True)
r32 = ring[: 32 * MiB]
desc = torch.tensor([[0, 0, 0, 0, n, 1]])
SAME = bool(os.environ.get("PF_SAME"))
dst = torch.empty(n, dtype=torch.float32 if SAME else torch.bfloat16, device="cuda")
if SAME:
    r32 = ring
srcs = (
    {"pageable": torch.randn(n)}
    if SAME
    else {"pinned": torch.randn(n).pin_memory(), "pageable": torch.randn(n)}
)
refs = {
    k: (v.view(torch.int32) if SAME else v.to(torch.bfloat16).view(torch.int16))
    for k, v in srcs.items()
}
P = (
    [("" if x == "none" else x) for x in os.environ.get("PF_VARIANTS", "").split(",")]
    if os.environ.get("PF_VARIANTS")
    else ["", "nta:1024", "nta:4096", "t0:2048", "t2:2048", "t2:8192"]
)
variants = [(s, p, 16) for s in srcs for p in P] + (
    [(s, "", t) for s in srcs for t in (8, 12)] if not os.environ.get("PF_VARIANTS") else []
)
nt0 = torch.get_num_threads()
print("threads", nt0, "cpus", os.cpu_count(), flush=True)


def run(v):
    s, p, t = v
    os.environ["RESHARD_PROBE_PREFETCH"] = p
    torch.set_num_threads(t)
    torch.cuda.synchronize()
    a = time.perf_counter()
    torch.ops.reshard.stage_h2d(srcs[s], desc, r32, dst)
    torch.cuda.synchronize()
    return time.perf_counter() - a


ok = {}
for v in variants:
    run(v)
    run(v)
    ok[v] = bool(torch.equal(dst.cpu().view(refs[v[0]].dtype), refs[v[0]]))
times = {v: [] for v in variants}
for r in range(9):
    order = variants[r % len(variants) :] + variants[: r % len(variants)]
    for v in order:
        times[v].append(run(v))
torch.set_num_threads(nt0)
out = []
for v in variants:
    m = statistics.median(times[v])
    out.append(
        {
            "src": v[0],
            "prefetch": v[1],
            "threads": v[2],
            "median_s": m,
            "g_elem_s": n / m / 1e9,
            "bitwise": ok[v],
        }
    )
    print(
        f"{v[0]:9s} {v[1] or 'none':9s} thr {v[2]:2d}  {m * 1e3:7.2f} ms  {n / m / 1e9:6.2f} G el/s  ok {ok[v]}",
        flush=True,
    )
json.dump(out, open(sys.argv[1], "w"), indent=1)
