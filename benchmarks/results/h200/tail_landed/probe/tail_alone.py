"""The bucket's bare stage_h2d with the queue's shrinking tail on and off (probe switch
RESHARD_PROBE_NO_TAIL), alternated in one process where no other OpenMP team runs.
Run from the tail tree's root with PYTHONPATH=python. argv: model rounds json."""

import json
import os
import statistics
import sys
import time

sys.path.insert(0, "benchmarks")
import _scenarios as S  # noqa: E402
import stream_probe as P  # noqa: E402
import torch  # noqa: E402

model, rounds, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
case = S.stream_offload(model, 0, 1, "cuda")
steps, keep, pool, streams, threads = P.make_variants(case, ["buckets_op"], None)
op = steps["buckets_op"]
time.sleep(0.5)  # the stream's one run: its team's threads stop spinning
bw = P.pinned_h2d_Bps()


def run(name):
    if name == "off":
        os.environ["RESHARD_PROBE_NO_TAIL"] = "1"
    else:
        os.environ.pop("RESHARD_PROBE_NO_TAIL", None)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    op(None)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


names = ["on", "off"]
for _ in range(3):
    for n in names:
        run(n)
times = {n: [] for n in names}
for r in range(rounds):
    for n in names if r % 2 == 0 else names[::-1]:
        times[n].append(run(n))
os.environ.pop("RESHARD_PROBE_NO_TAIL", None)
med = statistics.median
nbytes = sum(t.numel() * 2 for t in case.src_buffers.values())  # bf16 bytes of the fp32 masters
floor_s = nbytes / bw
print(
    f"{model}: {nbytes / 2**20:.1f} MiB bf16, floor {floor_s * 1e3:.3f} ms, {rounds} rounds, threads {torch.get_num_threads()}"
)
for n in names:
    v = times[n]
    print(
        f"  tail {n:3s} med {med(v) * 1e3:7.3f} ms ({med(v) / floor_s:.3f}x)  min {min(v) * 1e3:7.3f}  p90 {sorted(v)[int(0.9 * len(v))] * 1e3:7.3f}"
    )
wins = sum(a < b for a, b in zip(times["on"], times["off"], strict=True))
ratio = med([a / b for a, b in zip(times["on"], times["off"], strict=True)])
print(f"  tail on faster in {wins}/{rounds} rounds, median ratio on/off {ratio:.3f}")
with open(out, "w") as f:
    json.dump({"model": model, "floor_s": floor_s, "times": times}, f)
