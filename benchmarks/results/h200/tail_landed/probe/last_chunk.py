"""Does a small last chunk cost the queued stage_h2d a stall? Main's op, fp32 -> dense bf16 of
58 ring slots of 4 MiB plus r elements, r from a whole slot down to a few KiB (so the table ends
on a chunk of that size), each timed once per round in an order rotated per round. Prints ms,
and ms per MiB of wire against the r = 2M row. Run from the repo root with PYTHONPATH=python.
argv: rounds threads."""

import statistics
import sys
import time

import torch

import reshard  # noqa: F401  (the ops)

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 20
threads = int(sys.argv[2]) if len(sys.argv) > 2 else torch.get_num_threads()
torch.set_num_threads(threads)
slot = 2 << 20  # bf16 elements of a 4 MiB slot
tails = [slot, slot // 2, 245_760, 24_576, 2_048, 0]
n_max = 58 * slot + slot
src = torch.randn(n_max)
ring = torch.empty(32 << 20, dtype=torch.uint8, pin_memory=True)  # the cast ring: 8 slots
dst = torch.empty(n_max, dtype=torch.bfloat16, device="cuda")
descs = {r: torch.tensor([[0, 0, 0, 0, 58 * slot + r, 1]]) for r in tails}
stats = {}


def run(r):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = torch.ops.reshard.stage_h2d(src, descs[r], ring, dst)
    torch.cuda.synchronize()
    stats[r] = out.tolist()
    return time.perf_counter() - t0


for _ in range(3):
    for r in tails:
        run(r)
times = {r: [] for r in tails}
for i in range(rounds):
    k = i % len(tails)
    for r in tails[k:] + tails[:k]:
        times[r].append(run(r))
ref = statistics.median(times[slot]) / (59 * slot * 2 / 2**20)
print(f"threads {threads}, {rounds} rounds; stats [slots, slot_bytes, chunks, ring_bytes, ...]")
for r in tails:
    m = statistics.median(times[r])
    mib = (58 * slot + r) * 2 / 2**20
    print(
        f"  r={r:8d} ({mib:7.1f} MiB): med {m * 1e3:7.3f} ms, min {min(times[r]) * 1e3:7.3f}, "
        f"per MiB {m / mib * 1e6:6.2f} us ({m / mib / ref:.3f}x)  {stats[r][:3]}"
    )
