"""Same-process A/B of a stream_offload sync's two changes on one GPU: stage_h2d's queue with
and without its shrinking tail (the device build's probe-only switch RESHARD_PROBE_NO_TAIL,
patched in by the call script), and the Stream of this tree against main's (--before DIR: main's
stream*.py; main's caller leaves a bucket at DONE, this tree's at LANDED). Variants, one sync
each per round in an order rotated per round: the bucket's bare stage_h2d (op), this tree's
stream (new) and main's (old), each with the tail (on) and without (off). Run from the repo root
with PYTHONPATH=python. argv: before_dir model rounds json."""

import json
import os
import statistics
import sys
import time

sys.path.insert(0, "benchmarks")
import _scenarios as S  # noqa: E402
import stream_probe as P  # noqa: E402
import torch  # noqa: E402

before_dir, model, rounds, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a dry run of the harness
case = S.stream_offload(model, 0, 1, device)
steps, keep, pool, streams, threads = P.make_variants(
    case, ["buckets_op", "stream", "stream_before"], P.load_before(before_dir)
)
labels = {"op": "buckets_op", "new": "stream", "old": "stream_before"}
base = {b: steps[v] for b, v in labels.items() if v in steps}
payload = sum(b.nbytes for b in streams["stream"].buckets)
floor_s = payload / (P.pinned_h2d_Bps() if device == "cuda" else 25e9)
names = [f"{b}_{t}" for b in base for t in ("on", "off")]
bufs = {n: case.targets() for n in names}


def run(name):
    b, tail = name.rsplit("_", 1)
    if tail == "off":
        os.environ["RESHARD_PROBE_NO_TAIL"] = "1"
    else:
        os.environ.pop("RESHARD_PROBE_NO_TAIL", None)
    P._sync()
    t0 = time.perf_counter()
    base[b](bufs[name])
    P._sync()
    return time.perf_counter() - t0


for _ in range(3):
    for n in names:
        run(n)
times = {n: [] for n in names}
for r in range(rounds):
    k = r % len(names)
    for n in names[k:] + names[:k]:
        times[n].append(run(n))
os.environ.pop("RESHARD_PROBE_NO_TAIL", None)
med = statistics.median
print(f"{model}: payload {payload / 2**20:.1f} MiB, floor {floor_s * 1e3:.3f} ms, {rounds} rounds")
for n in names:
    v = times[n]
    print(
        f"  {n:8s} med {med(v) * 1e3:7.3f} ms ({med(v) / floor_s:.3f}x)  "
        f"min {min(v) * 1e3:7.3f}  p90 {sorted(v)[int(0.9 * len(v))] * 1e3:7.3f}"
    )
pairs = [("new_on", "old_off"), ("new_on", "old_on"), ("new_off", "old_off"), ("op_on", "op_off")]
for a, b in [p for p in pairs if set(p) <= set(names)]:
    wins = sum(x < y for x, y in zip(times[a], times[b], strict=True))
    ratio = med([x / y for x, y in zip(times[a], times[b], strict=True)])
    print(f"  {a} faster than {b} in {wins}/{rounds} rounds, median ratio {ratio:.3f}")
with open(out, "w") as f:
    json.dump({"model": model, "floor_s": floor_s, "payload": payload, "times": times}, f)
