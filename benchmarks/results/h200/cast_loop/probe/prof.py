"""Where a stream bucket's Transfer spends its time beyond its h2d call (call E, device profile).

Run from the repository root: python prof.py (PYTHONPATH=python)."""

import cProfile
import pstats
import sys
import time

sys.path.insert(0, "benchmarks")
import _scenarios as S  # noqa: E402
import stream_probe as P  # noqa: E402
import torch  # noqa: E402

case = S.stream_offload("gpt-125m", 0, 1, "cuda")
bufs = case.targets()
names = ["buckets_op", "buckets_h2d", "buckets_main"]
steps, keep, pool, streams, threads = P.make_variants(case, names, None)
for n in names:
    steps[n](bufs)
    torch.cuda.synchronize()
times = {n: [] for n in names}
for r in range(20):
    for n in names[r % 3 :] + names[: r % 3]:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        steps[n](bufs)
        torch.cuda.synchronize()
        times[n].append(time.perf_counter() - t0)
for n in names:
    t = sorted(times[n])
    print(f"{n:14s} min {t[0] * 1e3:.2f} med {t[10] * 1e3:.2f}")
sb = keep[0]
tr = sb.mover._transfer(sb.buckets[0])
src = {loc: case.src_buffers[loc] for loc in sb.buckets[0].src_locations}
tg = sb.targets(0)
rep = tr(src, tg)
print("seconds", {k: round(v * 1e3, 3) for k, v in rep.seconds.items()})
pr = cProfile.Profile()
pr.enable()
for _ in range(10):
    tr(src, tg)
pr.disable()
st = pstats.Stats(pr)
st.sort_stats("cumulative").print_stats(25)
st.sort_stats("tottime").print_stats(15)
