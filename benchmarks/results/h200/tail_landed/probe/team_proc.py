"""One stream_offload Stream alone in its process (no other OpenMP team on the machine), its
worker's packing team as built (one thread short of the caller's count, the caller polling in
its waits: 15poll) or the caller's full count with the caller sleeping (16sleep) or polling
(16poll) in its waits. Times `syncs` syncs after warm-up. Run from the repo root with
PYTHONPATH=python. argv: variant model syncs."""

import statistics
import sys
import time

sys.path.insert(0, "benchmarks")
import _scenarios as S  # noqa: E402
import stream_probe as P  # noqa: E402
import torch  # noqa: E402

variant, model, syncs = sys.argv[1], sys.argv[2], int(sys.argv[3])
case = S.stream_offload(model, 0, 1, "cuda")
steps, keep, pool, streams, _ = P.make_variants(case, ["stream"], None)
s, step = streams["stream"], steps["stream"]
bufs = case.targets()
floor_s = sum(b.nbytes for b in s.buckets) / P.pinned_h2d_Bps()
for _ in range(3):
    step(bufs)
threads = torch.get_num_threads()
if variant.startswith("16"):
    s.mover._worker.submit(torch.set_num_threads, threads).result()
    s.mover.caller_has_core = variant == "16poll"
team = s.mover._worker.submit(torch.get_num_threads).result()
for _ in range(2):
    step(bufs)
times = []
for _ in range(syncs):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step(bufs)
    torch.cuda.synchronize()
    times.append(time.perf_counter() - t0)
m = statistics.median(times)
print(
    f"{variant:8s} team {team:2d} poll {int(s.mover.caller_has_core)}: med {m * 1e3:.3f} ms "
    f"({m / floor_s:.3f}x), min {min(times) * 1e3:.3f}, floor {floor_s * 1e3:.3f} ms"
)
