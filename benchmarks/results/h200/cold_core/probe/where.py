"""Which cache a stream sync's cold calls miss in, on the H200 host. The timed thread is pinned
to CPU 0; each call is timed once after one of these washes and once warm (medians of N):

- all: a 512 MiB sweep by torch's intra-op team, CPU 0 included (as after a sync's pack);
- others: the same sweep by a helper process pinned to CPUs 1..n-1 (the shared L3 washed,
  CPU 0's own L1/L2/TLB kept);
- own: the timed thread alone sweeps 8 MiB (its L1/L2 and much of its TLB washed, L3 kept);
- others+own: both.

Run from the repo root with PYTHONPATH=python."""

import concurrent.futures
import os
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

import reshard  # noqa: F401

N = int(sys.argv[1]) if len(sys.argv) > 1 else 21
ncpu = os.cpu_count()
junk = torch.ones(128 << 20)  # 512 MiB
junk.add_(1.0)  # the intra-op team exists before the pin (its threads keep every CPU)
os.sched_setaffinity(0, {0})  # this thread only
own = np.ones(2 << 20, dtype=np.float32)  # 8 MiB

HELPER = r"""
import os, sys
os.sched_setaffinity(0, set(range(1, os.cpu_count())))
import torch
torch.set_num_threads(os.cpu_count() - 1)
junk = torch.ones(128 << 20)
for line in sys.stdin:
    junk.add_(1.0)
    sys.stdout.write("ok\n"); sys.stdout.flush()
"""
helper = subprocess.Popen(
    [sys.executable, "-c", HELPER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
)


def wash_all():
    junk.add_(1.0)


def wash_others():
    helper.stdin.write("go\n")
    helper.stdin.flush()
    helper.stdout.readline()


def _own():
    np.add(own, 1.0, out=own)


def wash_both():
    wash_others()
    _own()


WASHES = {"all": wash_all, "others": wash_others, "own": _own, "others+own": wash_both}

s = torch.cuda.Stream()
ev = torch.cuda.Event()
ev.record()
word = torch.zeros(4, dtype=torch.int64)
page = torch.ones(1 << 20)
a, b = torch.ones(1 << 20), torch.ones(1 << 20, device="cuda", dtype=torch.bfloat16)
pool = concurrent.futures.ThreadPoolExecutor(1)
pool.submit(lambda: None).result()
desc = torch.tensor([[0, 0, 1 << 16, 1, 0, 0]], dtype=torch.int64)
ring = torch.empty(32 << 20, dtype=torch.uint8, pin_memory=True)
ssrc, sdst = torch.ones(1 << 16), torch.empty(1 << 16, device="cuda", dtype=torch.bfloat16)
table = {i: (i, str(i)) for i in range(2000)}


def ctx_stream():
    with torch.cuda.stream(s):
        pass


def pyloop():
    return sum(v[0] for v in table.values())


CANDIDATES = {
    "nothing": lambda: None,
    "python dict loop (2000)": pyloop,
    "cuda.current_stream": torch.cuda.current_stream,
    "with cuda.stream(s)": ctx_stream,
    "event.record(s)": lambda: ev.record(s),
    "pageable.is_pinned()": page.is_pinned,
    "progress_set op": lambda: torch.ops.reshard.progress_set(word, 5),
    "tensor_facts+bytes": lambda: torch.ops.reshard.tensor_facts.default([a, b]).numpy().tobytes(),
    "pool.submit().result()": lambda: pool.submit(lambda: None).result(),
    "cuda.synchronize": torch.cuda.synchronize,
    "stage_h2d 64K el": lambda: torch.ops.reshard.stage_h2d(ssrc, desc, ring, sdst),
}

out = {(w, k): [] for w in WASHES for k in CANDIDATES}
warm = {k: [] for k in CANDIDATES}
for _ in range(N):
    for w, wash in WASHES.items():
        for k, fn in CANDIDATES.items():
            wash()
            t0 = time.perf_counter_ns()
            fn()
            out[(w, k)].append((time.perf_counter_ns() - t0) / 1e3)
    for k, fn in CANDIDATES.items():
        for _ in range(3):
            fn()
        t0 = time.perf_counter_ns()
        fn()
        warm[k].append((time.perf_counter_ns() - t0) / 1e3)
torch.cuda.synchronize()
helper.stdin.close()
helper.wait()
print(f"cpus {ncpu}; timed thread on CPU 0; medians of {N}, microseconds")
print(f"{'call':26s}" + "".join(f"{w:>12s}" for w in WASHES) + f"{'warm':>10s}")
for k in CANDIDATES:
    row = "".join(f"{statistics.median(out[(w, k)]):12.1f}" for w in WASHES)
    print(f"{k:26s}{row}{statistics.median(warm[k]):10.1f}")
