"""Where one stream_offload sync's time goes beyond its bare stage_h2d, on one GPU: wall-clock
stamps (perf_counter_ns) at the Stream's, the worker's, preflight's, reshard.h2d's and the op's
boundaries, per sync; bare op and stream syncs interleaved. Run from the repo root with
PYTHONPATH=python. argv: model rounds."""

import statistics
import sys
import threading
import time

sys.path.insert(0, "benchmarks")
import _scenarios as S  # noqa: E402
import stream_probe as P  # noqa: E402
import torch  # noqa: E402

from reshard import executor, h2d, preflight, stream_iter, stream_mover  # noqa: E402

model = sys.argv[1] if len(sys.argv) > 1 else "gpt-125m"
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 20
REC = []
ON = [False]


def stamp(label):
    if ON[0]:
        REC.append((label, time.perf_counter_ns(), threading.get_ident()))


def wrap(owner, name, label):
    orig = getattr(owner, name)

    def w(*a, **k):
        stamp(label + "_in")
        try:
            return orig(*a, **k)
        finally:
            stamp(label + "_out")

    setattr(owner, name, w)


wrap(preflight, "run", "pf")
wrap(preflight, "_call_key", "ckey")
wrap(preflight, "hook_reasons", "hook")
wrap(preflight, "_allocate", "alloc")
wrap(executor.Transfer, "__call__", "tx")
wrap(executor._RoundLoop, "run", "loop")
wrap(h2d.HostToDevice, "_page_locked", "pinq")
wrap(h2d.HostToDevice, "_route", "route")
wrap(h2d.HostToDevice, "_staged_pieces", "staged")
wrap(executor, "_run", "xrun")
wrap(h2d.HostToDevice, "run", "h2d")
wrap(h2d._Streams, "stage", "op")
wrap(stream_mover.BucketMover, "_move", "move")
wrap(stream_iter.Call, "start", "start")
wrap(stream_iter.Call, "finish", "finish")
wrap(stream_iter.Call, "report", "report")
SUMS = {}


def total(owner, name, label):
    orig = getattr(owner, name)

    def w(*a, **k):
        t0 = time.perf_counter_ns()
        try:
            return orig(*a, **k)
        finally:
            if ON[0]:
                n, t = SUMS.get(label, (0, 0))
                SUMS[label] = (n + 1, t + time.perf_counter_ns() - t0)

    setattr(owner, name, w)


total(stream_iter.Call, "await_queued", "await")
if hasattr(stream_iter.Call, "settle"):
    wrap(stream_iter.Call, "settle", "settle")

case = S.stream_offload(model, 0, 1, "cuda")
bufs = case.targets()
steps, keep, pool, streams, threads = P.make_variants(case, ["buckets_op", "stream"], None)
s = streams["stream"]
payload = sum(b.nbytes for b in s.buckets)
floor_s = payload / P.pinned_h2d_Bps()


def stream_step(bufs):
    first = True
    for name, full in s(case.src_buffers):
        if first:
            stamp("yield_first")
            first = False
        t0 = time.perf_counter_ns()
        case.write(name, full, bufs)
        if ON[0]:
            n, t = SUMS.get("write", (0, 0))
            SUMS["write"] = (n + 1, t + time.perf_counter_ns() - t0)
    stamp("yield_end")


for _ in range(3):
    steps["buckets_op"](bufs)
    stream_step(bufs)
torch.cuda.synchronize()
op_t, st_t, segs = [], [], []
for r in range(rounds):
    for which in ["op", "stream"] if r % 2 == 0 else ["stream", "op"]:
        torch.cuda.synchronize()
        if which == "op":
            t0 = time.perf_counter_ns()
            steps["buckets_op"](bufs)
            torch.cuda.synchronize()
            op_t.append((time.perf_counter_ns() - t0) / 1e6)
            continue
        REC.clear()
        SUMS.clear()
        ON[0] = True
        t0 = time.perf_counter_ns()
        stream_step(bufs)
        torch.cuda.synchronize()
        t1 = time.perf_counter_ns()
        ON[0] = False
        st_t.append((t1 - t0) / 1e6)
        marks = {}
        for label, t, _ in REC:
            marks.setdefault(label, (t - t0) / 1e6)  # first occurrence
        marks["sync_end"] = (t1 - t0) / 1e6
        marks["sums"] = dict(SUMS)
        segs.append(marks)
med = statistics.median
print(f"{model}: payload {payload / 2**20:.1f} MiB, floor {floor_s * 1e3:.3f} ms")
print(
    f"bare op med {med(op_t):.3f} ms ({med(op_t) / 1e3 / floor_s:.3f}x), min {min(op_t):.3f}; "
    f"stream med {med(st_t):.3f} ms ({med(st_t) / 1e3 / floor_s:.3f}x), min {min(st_t):.3f}"
)
order = [
    "start_in",
    "start_out",
    "move_in",
    "tx_in",
    "xrun_in",
    "pf_in",
    "ckey_in",
    "ckey_out",
    "hook_in",
    "hook_out",
    "alloc_in",
    "alloc_out",
    "pf_out",
    "loop_in",
    "h2d_in",
    "pinq_in",
    "pinq_out",
    "route_out",
    "staged_in",
    "op_in",
    "yield_first",
    "op_out",
    "staged_out",
    "h2d_out",
    "loop_out",
    "xrun_out",
    "tx_out",
    "move_out",
    "finish_in",
    "finish_out",
    "settle_in",
    "settle_out",
    "report_in",
    "report_out",
    "yield_end",
    "sync_end",
]
keys = [k for k in order if all(k in m for m in segs)]
print("stamp          median ms after the sync's start (min, max)")
for k in keys:
    v = [m[k] for m in segs]
    print(f"  {k:14s} {med(v):8.3f}  ({min(v):.3f}, {max(v):.3f})")
print("op inside the stream: med", f"{med([m['op_out'] - m['op_in'] for m in segs]):.3f} ms")
print("before the op:        med", f"{med([m['op_in'] for m in segs]):.3f} ms")
print("after the op:         med", f"{med([m['sync_end'] - m['op_out'] for m in segs]):.3f} ms")
for label in ("await", "write"):
    n = [m["sums"].get(label, (0, 0))[0] for m in segs]
    t = [m["sums"].get(label, (0, 0))[1] / 1e6 for m in segs]
    print(f"caller's {label:6s} calls per sync: med {med(n)}, ms in them: med {med(t):.3f}")
