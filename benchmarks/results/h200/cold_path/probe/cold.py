"""Cold and warm cost of single calls on the per-sync path of a stream_offload bucket, on the
H200 host: each call timed once after a 512 MiB sweep of host memory by every thread (caches
cold, as after a sync's pack) and once warm; medians of N. Run from the repo root with
PYTHONPATH=python."""

import concurrent.futures
import ctypes
import glob
import os
import statistics
import sys
import time

import torch

import reshard  # noqa: F401

N = int(sys.argv[1]) if len(sys.argv) > 1 else 25
junk = torch.ones(128 << 20)  # 512 MiB
s = torch.cuda.Stream()
ev = torch.cuda.Event()
ev.record()
word = torch.zeros(4, dtype=torch.int64)
word_np = word.numpy()
page = torch.ones(1 << 20)
a, b = torch.ones(1 << 20), torch.ones(1 << 20, device="cuda", dtype=torch.bfloat16)
pool = concurrent.futures.ThreadPoolExecutor(1)
pool.submit(lambda: None).result()
desc = torch.tensor([[0, 0, 1 << 16, 1, 0, 0]], dtype=torch.int64)
ring = torch.empty(32 << 20, dtype=torch.uint8, pin_memory=True)
ssrc, sdst = torch.ones(1 << 16), torch.empty(1 << 16, device="cuda", dtype=torch.bfloat16)


def ctx_stream():
    with torch.cuda.stream(s):
        pass


def ctx_device():
    with torch.cuda.device(0):
        pass


def setitem():
    word[2] = 12345


def setnp():
    word_np[2] = 12345


def facts():
    return torch.ops.reshard.tensor_facts.default([a, b]).numpy().tobytes()


CANDIDATES = {
    "nothing": lambda: None,
    "cuda.current_stream": torch.cuda.current_stream,
    "cuda.current_device": torch.cuda.current_device,
    "cuda.set_device(0)": lambda: torch.cuda.set_device(0),
    "cuda.is_available": torch.cuda.is_available,
    "cuda.Event()": torch.cuda.Event,
    "event.record(s)": lambda: ev.record(s),
    "stream.wait_event": lambda: s.wait_event(ev),
    "with cuda.stream(s)": ctx_stream,
    "with cuda.device(0)": ctx_device,
    "pageable.is_pinned()": page.is_pinned,
    "word[2] = x (torch)": setitem,
    "word_np[2] = x": setnp,
    "progress_set op": lambda: torch.ops.reshard.progress_set(word, 5),
    "tensor_facts+bytes": facts,
    "pool.submit().result()": lambda: pool.submit(lambda: None).result(),
    "stream.synchronize": s.synchronize,
    "cuda.synchronize": torch.cuda.synchronize,
    "stage_h2d 64K el": lambda: torch.ops.reshard.stage_h2d(ssrc, desc, ring, sdst),
    "tensor.data_ptr": a.data_ptr,
    "ring[:n].view(bf16)": lambda: ring[: 1 << 20].view(torch.bfloat16),
}


_rt = None
for pat in (
    "nvidia/cu13/lib/libcudart.so*",
    "nvidia/cuda_runtime/lib/libcudart.so*",
    "torch/lib/libcudart*.so*",
):
    for sp in sys.path:
        hits = glob.glob(os.path.join(sp, pat))
        if hits:
            try:
                _rt = ctypes.CDLL(hits[0])
                break
            except OSError:
                pass
    if _rt:
        break
if _rt is None:
    try:
        _rt = ctypes.CDLL("libcudart.so")
    except OSError:
        _rt = None
print("cudart:", _rt)
if _rt is not None:
    _evs = (ctypes.c_void_p * 9)()

    def ev_create_destroy9():
        for i in range(9):
            _rt.cudaEventCreateWithFlags(ctypes.byref(_evs, i * 8), 2)
        for i in range(9):
            _rt.cudaEventDestroy(ctypes.c_void_p(_evs[i]))

    def get_device():
        d = ctypes.c_int()
        _rt.cudaGetDevice(ctypes.byref(d))

    CANDIDATES["cudart 9 ev create+destroy"] = ev_create_destroy9
    CANDIDATES["cudart cudaGetDevice"] = get_device


def flush():
    junk.add_(1.0)


out = {k: {"cold": [], "warm": []} for k in CANDIDATES}
for _ in range(N):
    for k, fn in CANDIDATES.items():
        flush()
        t0 = time.perf_counter_ns()
        fn()
        t1 = time.perf_counter_ns()
        out[k]["cold"].append((t1 - t0) / 1e3)
        for _ in range(3):
            fn()
        t0 = time.perf_counter_ns()
        fn()
        t1 = time.perf_counter_ns()
        out[k]["warm"].append((t1 - t0) / 1e3)
torch.cuda.synchronize()
print(f"{'call':26s} {'cold us':>9s} {'warm us':>9s}")
for k, v in out.items():
    print(f"{k:26s} {statistics.median(v['cold']):9.1f} {statistics.median(v['warm']):9.1f}")
