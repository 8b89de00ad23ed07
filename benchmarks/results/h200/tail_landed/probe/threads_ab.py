"""The stream's packing team: 15 threads and a polling caller (as built: the team leaves the
caller a core) against 16 threads with the caller sleeping in its waits, or polling, and the
bare op with 16 and 15 threads; stream_offload, one sync of each per round, the order rotated
per round. Run from the repo root with PYTHONPATH=python. argv: model rounds."""

import statistics
import sys
import time

sys.path.insert(0, "benchmarks")
import _scenarios as S  # noqa: E402
import stream_probe as P  # noqa: E402
import torch  # noqa: E402

model = sys.argv[1] if len(sys.argv) > 1 else "gpt-125m"
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 30
case = S.stream_offload(model, 0, 1, "cuda")
steps, keep, pool, streams, _ = P.make_variants(case, ["buckets_op", "stream", "stream_full"], None)
threads = torch.get_num_threads()
s15, s16 = streams["stream"], streams["stream_full"]
for _ in range(2):  # the workers exist now
    steps["stream"](case.targets())
    steps["stream_full"](case.targets())
s16.mover._worker.submit(torch.set_num_threads, threads).result()
assert (
    s15.mover.caller_has_core
    and s15.mover._worker.submit(torch.get_num_threads).result() == threads - 1
)


def with_threads(step, n):
    def run(bufs):
        torch.set_num_threads(n)
        try:
            step(bufs)
        finally:
            torch.set_num_threads(threads)

    return run


def polling(flag):
    def run(bufs):
        s16.mover.caller_has_core = flag
        steps["stream_full"](bufs)

    return run


variants = {
    "op16": with_threads(steps["buckets_op"], threads),
    "op15": with_threads(steps["buckets_op"], threads - 1),
    "stream15_poll": steps["stream"],
    "stream16_sleep": polling(False),
    "stream16_poll": polling(True),
}
payload = sum(b.nbytes for b in s15.buckets)
floor_s = payload / P.pinned_h2d_Bps()
bufs = {n: case.targets() for n in variants}


def run(name):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    variants[name](bufs[name])
    torch.cuda.synchronize()
    return time.perf_counter() - t0


names = list(variants)
for _ in range(2):
    for n in names:
        run(n)
times = {n: [] for n in names}
for r in range(rounds):
    k = r % len(names)
    for n in names[k:] + names[:k]:
        times[n].append(run(n))
med = statistics.median
print(f"{model}: payload {payload / 2**20:.1f} MiB, floor {floor_s * 1e3:.3f} ms, {rounds} rounds")
for n in names:
    v = times[n]
    print(
        f"  {n:15s} med {med(v) * 1e3:7.3f} ms ({med(v) / floor_s:.3f}x)  min {min(v) * 1e3:7.3f}"
    )
for a, b in [
    ("stream16_sleep", "stream15_poll"),
    ("stream16_poll", "stream15_poll"),
    ("op16", "op15"),
]:
    wins = sum(x < y for x, y in zip(times[a], times[b], strict=True))
    ratio = med([x / y for x, y in zip(times[a], times[b], strict=True)])
    print(f"  {a} faster than {b} in {wins}/{rounds} rounds, median ratio {ratio:.3f}")
