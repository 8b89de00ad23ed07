"""Where an rs.Stream's time goes against one Transfer of the same state, on one GPU, measured in
one run: the stream_offload scenario (CPU fp32 masters -> bf16 tensors by name on the GPU, each
tensor copied into the 'engine' weights as it arrives, as sync_latency.py's stream_offload).

Variants, timed in interleaved rounds (one sync of each in turn, the order rotated per round):
- transfer: one `rs.Transfer` of the same state straight into the engine's weights;
- transfer_thread: the same Transfer called from a worker thread (the caller waits);
- transfer_thread15: the same from a worker thread whose intra-op threads are set to 15;
- buckets_main / buckets_thread: the stream's bucket Transfers back to back, no iteration
  protocol, on the caller's thread / on one worker thread;
- buckets_h2d / buckets_op: the same buckets' `reshard.h2d` calls alone (no preflight, no
  executor), and the `stage_h2d` calls those make, alone (no h2d); buckets_h2d_before: the
  h2d of another revision (--before-h2d FILE, that revision's h2d.py) over the same calls;
- stream: the current `rs.Stream`; stream_before: the Stream of another revision (--before
  DIR: that revision's stream*.py, loaded as reshard._before_*);
- stream_inline: the current Stream, its buckets moved on the caller's thread;
- stream_full / stream_t14 / stream_t15 / stream_before_t15: a Stream whose worker's intra-op
  threads are set to the caller's count / 14 / 15 (the current Stream, or the one of --before);
- stream_nowrite: the current Stream, iterated without copying the tensors anywhere;
- stream_bN / stream_bN_nowrite: the same with N MiB buckets (the case's: the Stream's default,
  256 MiB); transfer_rN: one Transfer whose per-peer budget (and so its pinned ring) is N MiB;
- VARIANT_castN: VARIANT with `reshard.h2d`'s casting stage calls given N MiB of the ring
  (`h2d.CAST_RING_BYTES`: N / 4 queue slots of 4 MiB in flight), whatever the ring's size.
Each Stream's worker, and the caller, has its own OpenMP team (whose idle threads likely keep
spinning for a while after each region): variants on different teams disturb one another, so
compare team sizes or thread placements across processes, one variant each
(benchmarks/results/h200/tail_landed, calls E and F).
The floor is sync_latency's: the payload over pinned H2D bandwidth (256 MiB, best of 10, in
this run). The last round records, per stream variant, when each bucket was queued and moved.
--stage N:P1,P2,..: `stage_h2d` of N elements in one call and in P equal calls (the op's own
cost per call); with a build that exports `rs_stage_probe_ns` (stage.cu instrumented with host
timestamps per queued call, as in this file's history) also where each call's time goes and a
variant whose calls skip their final wait (what overlapping one call's tail with the next
call's start could give). --ordering: the GPU test of queued reads (tests/gpu/test_stream_gpu.py) run
against the current Stream and against one whose worker ignores the caller's event; the second
must fail.

    python benchmarks/stream_probe.py --json out/stream_probe.json [--before DIR] \\
        [--before-h2d FILE] [--models gpt-125m,gpt-350m] [--rounds 12] [--variants a,b,...] \\
        [--ordering] [--stage 123551232:1,4,11]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib.util
import json
import os
import re
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _baselines as B  # noqa: E402
import _common as C  # noqa: E402
import _scenarios as S  # noqa: E402

import reshard as rs  # noqa: E402
from reshard import h2d  # noqa: E402

MiB = 1 << 20
H2D_BEFORE = None  # --before-h2d: another revision's reshard.h2d module
ALL = (
    "transfer",
    "transfer_thread",
    "transfer_thread15",
    "buckets_main",
    "buckets_thread",
    "buckets_h2d",
    "buckets_op",
)


def load_before(path):
    """Another revision's Stream (`_common.load_stream_before`)."""
    return C.load_stream_before(path)


class Inline:
    """An executor that runs each job on the caller's thread."""

    def submit(self, fn, *args):
        fut = concurrent.futures.Future()
        try:
            fut.set_result(fn(*args))
        except BaseException as exc:
            fut.set_exception(exc)
        return fut


def pinned_h2d_Bps():
    pinned = torch.ones(256 * MiB, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(pinned, device="cuda")
    dev.copy_(pinned, non_blocking=True)
    torch.cuda.synchronize()
    ts = []
    for _ in range(10):
        t = time.perf_counter()
        dev.copy_(pinned, non_blocking=True)
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return pinned.numel() / min(ts)


def _timeline(stream_obj, t0, rows):
    """Record, relative to t0[0], when each bucket was queued and moved (no synchronization)."""
    mover = stream_obj.mover
    submit, move = mover.submit, mover._move

    def sub(bucket, *args):
        rows.append(("queued", bucket.index, time.perf_counter() - t0[0]))
        return submit(bucket, *args)

    def mv(bucket, *args):
        a = time.perf_counter() - t0[0]
        out = move(bucket, *args)
        b = time.perf_counter() - t0[0]
        tr = mover.transfers.get(bucket.index)
        path = getattr(getattr(tr, "_engine", None), "local_h2d", None)
        h2d = dict(path.last) if path is not None else {}
        rows.append(("moved", bucket.index, a, b, h2d.get("total_s"), h2d.get("host_s")))
        return out

    mover.submit, mover._move = sub, mv


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# stream variants: (current or before, copy each tensor into the weights, worker threads:
# None: as built, "inline": moves on the caller's thread, "all": the caller's count, or a count)
STREAMS = {
    "stream": ("current", True, None),
    "stream_before": ("before", True, None),
    "stream_inline": ("current", True, "inline"),
    "stream_full": ("current", True, "all"),
    "stream_t14": ("current", True, 14),
    "stream_t15": ("current", True, 15),
    "stream_before_t15": ("before", True, 15),
    "stream_nowrite": ("current", False, None),
}


def s_path(transfer):
    """The reshard.h2d path of a Transfer that ran once (None: it has none)."""
    return transfer._engine.local_h2d


def bucket_parts(sb, run_buckets):
    """buckets_h2d / buckets_op steps (see the module doc)."""
    out = {}
    # the same buckets' reshard.h2d calls alone (no preflight / executor), and the stage
    # ops those calls make, alone (no h2d): each bucket's arguments caught in one call
    calls = {}
    paths = [s_path(sb.mover._transfer(b)) for b in sb.buckets]
    for k, path in enumerate(paths if all(p is not None for p in paths) else ()):

        def grab(*a, k=k, orig=path.run, **kw):  # kw: the executor's progress (None here)
            calls[k] = (orig, a)
            return orig(*a, **kw)

        path.run = grab
    run_buckets()
    for path in paths if calls else ():
        del path.run
    if calls:
        out["buckets_h2d"] = lambda bufs: [fn(*a) for fn, a in calls.values()]
    if calls and H2D_BEFORE:
        # another revision's reshard.h2d over the same tables and arguments
        old = [
            (
                H2D_BEFORE.HostToDevice(
                    [H2D_BEFORE.LocalSpans(t, t.spans) for t in fn.__self__.tables]
                ),
                a,
            )
            for fn, a in calls.values()
        ]
        out["buckets_h2d_before"] = lambda bufs: [h.run(*a) for h, a in old]
    ops = [] if calls else None
    for fn, (src, dst, ring, _) in calls.values() if calls else ():
        h = fn.__self__
        (r,) = h._routes.values()
        if r.small or r.direct or r.dev_chunks:
            ops = None
            break
        for ti, j, first, n in r.big:
            t = h.tables[ti]
            sa = int(t.spans[j, 0]) + first if j is not None else 0
            da = int(t.spans[j, 1]) + first if j is not None else 0
            d = h._desc(n) if j is not None else t.desc
            sv, dv = src[t.src_location], dst[t.dst_location]
            ops.append((sv[sa:], d, h2d.stage_ring(ring, sv.dtype, dv.dtype), dv[da:], n, j))
    if ops is not None:

        def run_ops():
            for sv, d, ring, dv, n, j in ops:
                if j is None:
                    torch.ops.reshard.stage_h2d(sv, d, ring, dv)
                else:
                    torch.ops.reshard.stage_h2d(sv[:n], d, ring, dv[:n])

        out["buckets_op"] = lambda bufs: run_ops()
    return out


def make_variants(case, names, before_cls):
    out, keep, streams, threads = {}, [], {}, {}
    kw = dict(dtype=case.dst.dtype, device=case.dst_device)
    bb = case.stream["bucket_bytes"]

    def new_stream(cls=rs.Stream):
        s = cls(case.src_layout, [0], bb, **kw)
        keep.append(s)
        return s

    def stream_step(label, s, write=True):
        streams[label] = s

        def step(bufs):
            for name, full in s(case.src_buffers):
                if write:
                    case.write(name, full, bufs)

        return step

    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="probe")
    if {"transfer", "transfer_thread", "transfer_thread15"} & set(names):
        sync = rs.Transfer(case.src_layout, case.dst_layout, budget_bytes_per_peer=64 * MiB)
        keep.append(sync)
        out["transfer"] = lambda bufs: sync(case.src_buffers, bufs)
        out["transfer_thread"] = lambda bufs: pool.submit(sync, case.src_buffers, bufs).result()
        out["transfer_thread15"] = None  # made after every other thread started (see main)
        out["_sync"] = sync
    if {"buckets_main", "buckets_thread", "buckets_h2d", "buckets_op"} & set(names):
        sb = new_stream()
        list(sb(case.src_buffers))  # buffer, views, Transfers

        def run_buckets(s=sb):
            for k, b in enumerate(s.buckets):
                src = {loc: case.src_buffers[loc] for loc in b.src_locations}
                s.mover._transfer(b)(src, s.targets(k))

        out["buckets_main"] = lambda bufs: run_buckets()
        out["buckets_thread"] = lambda bufs: pool.submit(run_buckets).result()
        try:
            out |= bucket_parts(sb, run_buckets)
        except Exception as exc:  # a probe variant's own bug: the others still run
            print(f"buckets_h2d / buckets_op dropped: {type(exc).__name__}: {exc}", flush=True)
    for label, (which, write, nthreads) in STREAMS.items():
        if label not in names or (which == "before" and before_cls is None):
            continue
        s = new_stream(rs.Stream if which == "current" else before_cls)
        if nthreads == "inline":
            s.mover._worker = Inline()
        elif nthreads is not None:
            threads[label] = nthreads
        out[label] = stream_step(label, s, write)
    for label in names:
        # stream_bN[_nowrite]: a Stream of N MiB buckets; transfer_rN: one Transfer of N MiB
        # per peer (its pinned ring)
        m = re.fullmatch(r"stream_b(\d+)(_nowrite)?", label)
        if m:
            s = rs.Stream(case.src_layout, [0], int(m[1]) * MiB, **kw)
            keep.append(s)
            out[label] = stream_step(label, s, write=not m[2])
        m = re.fullmatch(r"transfer_r(\d+)", label)
        if m:
            t = rs.Transfer(case.src_layout, case.dst_layout, budget_bytes_per_peer=int(m[1]) * MiB)
            keep.append(t)
            out[label] = lambda bufs, t=t: t(case.src_buffers, bufs)
    for label in names:  # VARIANT_castN: VARIANT whose casting stage calls use N MiB of ring
        m = re.fullmatch(r"(.+)_cast(\d+)", label)
        if m and out.get(m[1]) is not None:
            out[label] = _with_cast_ring(out[m[1]], int(m[2]) * MiB)
    steps = {k: v for k, v in out.items() if k in names or k == "_sync"}
    return steps, keep, pool, streams, threads


def _with_cast_ring(step, nbytes):
    """`step` with reshard.h2d's casting stage calls given `nbytes` of the ring (the stage op's
    queue then keeps nbytes / 4 MiB slots in flight)."""

    def run(bufs):
        old, h2d.CAST_RING_BYTES = h2d.CAST_RING_BYTES, nbytes
        try:
            return step(bufs)
        finally:
            h2d.CAST_RING_BYTES = old

    return run


def run_model(model, names, rounds, before_cls, floor_bw, device):
    case = S.stream_offload(model, 0, 1, device)
    steps, keep, pool, streams, worker_threads = make_variants(case, names, before_cls)
    sync = steps.pop("_sync", None)
    bufs = {m: case.targets() for m in steps}
    for m, step in list(steps.items()):
        if step is not None:
            try:
                for _ in range(2):
                    step(bufs[m])
            except Exception as exc:  # a probe variant's own bug: the others still run
                print(f"{model} {m} dropped: {type(exc).__name__}: {exc}", flush=True)
                del steps[m]
    _sync()
    threads = torch.get_num_threads()
    for label, n in worker_threads.items():  # the workers exist now: set their own teams
        n = threads if n == "all" else n
        streams[label].mover._worker.submit(torch.set_num_threads, n).result()
    pool15 = None
    if steps.get("transfer_thread15", 1) is None:
        pool15 = concurrent.futures.ThreadPoolExecutor(
            1, initializer=torch.set_num_threads, initargs=(15,)
        )
        src = case.src_buffers
        steps["transfer_thread15"] = lambda b: pool15.submit(sync, src, b).result()
        for _ in range(2):
            steps["transfer_thread15"](bufs["transfer_thread15"])
    torch.set_num_threads(threads)  # the caller's own setting stays as it was
    order = list(steps)
    times = {m: [] for m in order}
    timelines = {}
    for r in range(rounds):
        last = r == rounds - 1
        rot = order[r % len(order) :] + order[: r % len(order)]
        for m in rot:
            t0 = [0.0]
            rows = []
            sobj = streams.get(m) if last else None
            if sobj is not None:
                _timeline(sobj, t0, rows)
            _sync()
            t0[0] = time.perf_counter()
            steps[m](bufs[m])
            _sync()
            times[m].append(time.perf_counter() - t0[0])
            if sobj is not None:
                rep = sobj.report
                timelines[m] = {
                    "rows": rows,
                    "wait_s": getattr(rep, "wait_seconds", None),
                    "seconds": {k: v for k, v in rep.seconds.items() if v},
                    "buckets": [
                        (b.index, len(b.names), b.nbytes, b.start, getattr(b, "ready_after", None))
                        for b in sobj.buckets
                    ],
                }
    floor = case.payload_bytes / floor_bw if floor_bw else None
    res = {"model": model, "payload_bytes": case.payload_bytes, "floor_s": floor, "rows": []}
    for m in order:
        ts = times[m]
        med = statistics.median(ts)
        res["rows"].append(
            {
                "method": m,
                "median_s": med,
                "min_s": min(ts),
                "times": ts,
                "x_floor": med / floor if floor else None,
                # the bucket variants and stream_nowrite leave the engine's weights alone
                "correct": None
                if m.startswith("buckets") or "nowrite" in m
                else B.targets_correct(case, bufs[m]),
            }
        )
    t_ref = statistics.median(times["transfer"]) if "transfer" in times else None
    for row in res["rows"]:
        row["x_transfer"] = row["median_s"] / t_ref if t_ref else None
        print(
            f"{model} {row['method']:18s} {row['median_s'] * 1e3:7.2f} ms  x floor "
            f"{row['x_floor'] or 0:.2f}  x transfer {row['x_transfer'] or 0:.2f}  ok {row['correct']}",
            flush=True,
        )
    res["timelines"] = timelines
    for s in keep:
        s.close()
    pool.shutdown()
    if pool15 is not None:
        pool15.shutdown()
    del steps, bufs, keep, case
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return res


def _probe_ns():
    """A reader of the stage op's timestamps of its last queued call (builds that export
    `rs_stage_probe_ns`, see the module doc), or None."""
    import ctypes
    import glob

    try:
        lib = ctypes.CDLL(glob.glob(os.path.join(os.path.dirname(rs.__file__), "_C*.so"))[0])
        arr = (ctypes.c_int64 * 8).in_dll(lib, "rs_stage_probe_ns")
    except (OSError, ValueError, AttributeError):
        return None
    return lambda: list(arr)


def stage_calls(elements, parts_list, rounds):
    """stage_h2d of `elements` pageable fp32 -> one dense bf16 CUDA target through a 64 MiB
    ring, on the caller's thread, as one call or as `parts` equal calls back to back
    (interleaved rounds): the op's own cost per call. Variants: op (as built); nowait (probe
    builds: the op skips its final wait, two rings alternate, a ring is reused after the call
    two back completed: what pipelining across calls could give)."""
    src = torch.rand(elements)
    dst = torch.empty(elements, dtype=torch.bfloat16, device="cuda")
    rings = [torch.empty(64 * MiB, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    ref = src.to(torch.bfloat16)
    probe = _probe_ns()
    cuts = {}
    for parts in parts_list:
        edges = [elements * i // parts for i in range(parts + 1)]
        cuts[parts] = [(a, b, _dense(b - a)) for a, b in zip(edges[:-1], edges[1:], strict=True)]
    variants = [("op", p) for p in parts_list]
    if probe is not None:
        variants += [("nowait", p) for p in parts_list if p > 1]
    times = {v: [] for v in variants}
    marks = {v: [] for v in variants}
    for r in range(rounds + 2):
        for v in variants:
            kind, parts = v
            dst.fill_(0)
            torch.cuda.synchronize()
            if kind == "nowait":
                os.environ["RS_STAGE_PROBE_NOWAIT"] = "1"
            done = []
            t0 = time.perf_counter()
            for i, (a, b, d) in enumerate(cuts[parts]):
                if kind == "nowait" and i >= 2:
                    done[i - 2].synchronize()
                c0 = time.perf_counter()
                torch.ops.reshard.stage_h2d(src[a:b], d, rings[i % 2], dst[a:b])
                c1 = time.perf_counter()
                if kind == "nowait":
                    ev = torch.cuda.Event()
                    ev.record()
                    done.append(ev)
                if probe is not None and r >= 2:
                    marks[v].append([i, c1 - c0, *probe()])
            torch.cuda.synchronize()
            if r >= 2:
                times[v].append(time.perf_counter() - t0)
            os.environ.pop("RS_STAGE_PROBE_NOWAIT", None)
            ok = bool(torch.equal(dst.cpu().view(torch.int16), ref.view(torch.int16)))
            assert ok, f"stage_h2d {v} differs from torch's cast"
    out = []
    for v in variants:
        med = statistics.median(times[v])
        row = {"variant": v[0], "elements": elements, "parts": v[1], "median_s": med}
        row |= {"min_s": min(times[v]), "g_elem_per_s": elements / med / 1e9}
        if marks[v]:
            cols = list(zip(*marks[v], strict=True))
            # per call, medians: op seconds, then probe marks in ms since the op's entry
            row["call_s"] = statistics.median(cols[1])
            row["marks_ms"] = [statistics.median(c) / 1e6 for c in cols[2:9]]
            row["first_call_marks_ms"] = [
                statistics.median(c) / 1e6
                for c in list(zip(*[m for m in marks[v] if m[0] == 0], strict=True))[2:9]
            ]
        print(f"stage {v[0]} {elements} elements in {v[1]} calls: {med * 1e3:.2f} ms {row}")
        out.append(row)
    return out


def _dense(n):
    return torch.tensor([[0, 0, 0, 0, n, 1]], dtype=torch.int64)


def ordering_check():
    """The queued-reads GPU test against the current code, then with the worker's stream not
    waiting for the caller's event: the first must pass, the second fail."""
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(here, "..", "tests", "gpu"))
    import test_stream_gpu as T

    from reshard import stream_mover

    out = {}
    try:
        T.test_queued_buckets_wait_for_the_callers_queued_reads()
        out["current"] = "passed"
    except AssertionError as exc:
        out["current"] = f"FAILED {exc}"
    orig = stream_mover.BucketMover._move_now

    def no_wait(self, bucket, src, dst, checks, caller_done, host_sync):
        return orig(self, bucket, src, dst, checks, None, host_sync)

    stream_mover.BucketMover._move_now = no_wait
    try:
        T.test_queued_buckets_wait_for_the_callers_queued_reads()
        out["without_event"] = "passed (the test cannot see the hazard)"
    except AssertionError as exc:
        out["without_event"] = f"failed as it must: {str(exc)[:200]}"
    finally:
        stream_mover.BucketMover._move_now = orig
    print(f"ordering: {out}", flush=True)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--models", default="gpt-125m,gpt-350m")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--variants", default=",".join((*ALL, *STREAMS)))
    ap.add_argument("--before", default=None, help="a directory with another revision's stream*.py")
    ap.add_argument("--ordering", action="store_true", help="run the ordering check too")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the harness")
    ap.add_argument("--stage", default="", help="elements:parts,parts,...: the stage section")
    ap.add_argument("--before-h2d", default=None, help="another revision's h2d.py")
    args = ap.parse_args(argv)
    if args.before_h2d:
        global H2D_BEFORE
        spec = importlib.util.spec_from_file_location("reshard._before_h2d", args.before_h2d)
        H2D_BEFORE = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(H2D_BEFORE)
    names = args.variants.split(",")
    names += [m[1] for n in names if (m := re.fullmatch(r"(.+)_cast\d+", n))]
    names = list(dict.fromkeys(names))
    before_cls = load_before(args.before) if args.before else None
    rec = {
        "command": C.command_line("benchmarks/stream_probe.py", argv),
        "env": C.environment(args.device),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "parallel_info": torch.__config__.parallel_info(),
        "num_threads": torch.get_num_threads(),
    }
    bw = pinned_h2d_Bps() if args.device == "cuda" else None
    rec["pinned_h2d_Bps"] = bw
    print(f"pinned h2d {(bw or 0) / 1e9:.2f} GB/s", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)

    def save():  # after every section: a later failure keeps what was measured
        with open(args.json, "w") as f:
            json.dump(rec, f, indent=1, default=str)

    rec["models"] = []
    for m in filter(None, args.models.split(",")):
        rec["models"].append(run_model(m, names, args.rounds, before_cls, bw, args.device))
        save()
    if args.stage:
        n, parts = args.stage.split(":")
        rec["stage"] = stage_calls(int(n), [int(p) for p in parts.split(",")], args.rounds)
        save()
    if args.ordering:
        rec["ordering"] = ordering_check()
        save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
