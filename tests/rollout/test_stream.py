"""rs.Stream: full tensors by name, bucket by bucket. In-process cases (no process group) and
spawned gloo ranks with ZeRO-3 style sources; references are full tensors cast by torch,
compared bitwise."""

from __future__ import annotations

import concurrent.futures
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/_spawn.py
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _stream_workers as W
from _spawn import run_ranks

import reshard as rs

ENV = {"RESHARD_TEST_THREADS": "1"}


def _local(seed=0):
    values = W.full_values(seed)
    layout, bufs = W.zero3_source(1, values, 0)
    return values, layout, bufs


# ------------------------------------------------------------------------ in process


@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bucket", [64, 1024, 1 << 20])
def test_local_stream(dtype, bucket):
    values, layout, bufs = _local()
    names = [n for n in values if dtype is not None or n != "empty"]  # see test_empty_tensor
    s = rs.Stream(layout, [0], bucket, dtype=dtype, names=names)
    want = {n: values[n].to(dtype or values[n].dtype) for n in names}
    assert W.consume(s, bufs, want, True, "local") == []
    assert s.report.buckets == len(s.buckets)
    assert s.report.local_bytes == sum(w.numel() * w.element_size() for w in want.values())


def test_empty_tensor():
    values, layout, bufs = _local()
    # no pieces, so no source dtype: the layout mixes fp32 and bf16 storages
    with pytest.raises(ValueError, match="is empty"):
        rs.Stream(layout, names=["empty"])
    got = dict(rs.Stream(layout, dtype=torch.float16, names=["w1", "empty"])(bufs))
    assert got["empty"].shape == (0, 5) and got["empty"].dtype == torch.float16
    one = rs.Layout(
        {"e": rs.TensorLayout((0, 3), []), "x": rs.replicated((2,), [0])},
        {0: rs.Storage(0, torch.bfloat16, 2)},
    )
    got = dict(rs.Stream(one)({0: torch.ones(2, dtype=torch.bfloat16)}))
    assert got["e"].dtype == torch.bfloat16 and got["e"].shape == (0, 3)


def test_names_subset_and_order():
    values, layout, bufs = _local()
    names = ["norm", "w2", "embed"]
    s = rs.Stream(layout, [0], 256, dtype=torch.bfloat16, names=names)
    got = [(n, t.clone()) for n, t in s(bufs)]
    assert [n for n, _ in got] == names
    for n, t in got:
        assert torch.equal(t, values[n].to(torch.bfloat16))
    # only the chosen tensors' storages are read
    assert all(set(b.plan.dst.tensors) <= set(names) for b in s.buckets)


def test_oversized_tensor_gets_its_own_bucket():
    values, layout, bufs = _local()
    s = rs.Stream(layout, [0], 1000, dtype=torch.bfloat16)
    (big,) = [b for b in s.buckets if "big" in b.names]
    assert big.names == ["big"] and big.nbytes == 64 * 24 * 2
    # the largest tensor is more than two buckets: it alone sizes the buffer
    assert s.buffer_bytes == max(2 * 1000, 64 * 24 * 2) == 64 * 24 * 2
    want = {n: v.to(torch.bfloat16) for n, v in values.items()}
    assert W.consume(s, bufs, want, True, "oversized") == []
    assert W.consume(s, bufs, want, True, "oversized, slow", linger=0.01) == []


def test_buffer_is_the_largest_bucket_or_two_buckets():
    values, layout, bufs = _local()
    s = rs.Stream(layout, [0], 16, dtype=torch.float32, names=["big", "w1", "embed"])
    assert [b.names for b in s.buckets] == [["big"], ["w1"], ["embed"]]
    assert s.buffer_bytes == 64 * 24 * 4  # the largest bucket, not two of them
    # w1 overlaps big wherever it goes: it waits until big is consumed; embed fits after w1
    assert [(b.start, b.wait_consumed) for b in s.buckets] == [(0, 0), (0, 1), (960, 0)]
    # in stream order: w1 once big is consumed; embed (overlapping big, not w1) as well
    assert [b.ready_after for b in s.buckets] == [0, 1, 1]
    want = {n: v.float() for n, v in values.items()}
    assert W.consume(s, bufs, want, True, "serial") == []
    s = rs.Stream(layout, [0], 1 << 20, dtype=torch.float32, names=["w1", "embed"])
    assert s.buffer_bytes == 960 + 37 * 12 * 4  # everything streamed, less than two buckets


def test_a_larger_buffer_lets_the_bucket_after_a_large_tensor_move_meanwhile():
    values, layout, bufs = _local()
    names = ["big", "w1", "embed"]
    with pytest.raises(ValueError, match="smaller than the largest bucket"):
        rs.Stream(layout, [0], 16, dtype=torch.float32, names=names, buffer_bytes=6143)
    s = rs.Stream(layout, [0], 16, dtype=torch.float32, names=names, buffer_bytes=6144 + 960)
    assert [(b.start, b.wait_consumed) for b in s.buckets] == [(0, 0), (6144, 0), (0, 0)]
    # w1 is queued at once, behind big; embed once big is consumed
    assert [b.ready_after for b in s.buckets] == [0, 0, 1]
    want = {n: v.float() for n, v in values.items()}
    assert W.consume(s, bufs, want, True, "larger buffer", linger=0.01) == []


def test_placement_never_overwrites_tensors_in_use():
    """Random tensor sizes and bucket sizes: the placement invariant, from the placement alone
    (W.regions_disjoint), and the bound max(largest bucket, min(2 x bucket, all))."""
    import random

    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 12)
        sizes = [rng.choice([1, 3, 17, 64, 100, 257, 1000]) for _ in range(n)]
        layout = rs.Layout(
            {f"t{i}": rs.replicated((m,), [i]) for i, m in enumerate(sizes)},
            {i: rs.Storage(0, torch.float32, m) for i, m in enumerate(sizes)},
        )
        bucket = rng.choice([16, 23, 64, 400, 1001, 1024, 4096])
        s = rs.Stream(layout, [0], bucket)
        assert W.regions_disjoint(s) == [], (sizes, bucket)
        assert all(b.start % 16 == 0 for b in s.buckets), (sizes, bucket)
        total = sum(b.nbytes for b in s.buckets)
        largest = max(b.nbytes for b in s.buckets)
        assert s.buffer_bytes == max(largest, min(2 * bucket, total))
        extra = rng.choice([0, 7, 16, 100, 1000])
        s = rs.Stream(layout, [0], bucket, buffer_bytes=largest + extra)
        assert W.regions_disjoint(s) == [], (sizes, bucket, extra)
        assert all(b.start % 16 == 0 for b in s.buckets), (sizes, bucket, extra)
        if rng.random() < 0.1:  # and some of them for real, with a slow consumer
            bufs = {i: torch.randn(m) for i, m in enumerate(sizes)}
            want = {f"t{i}": bufs[i].clone() for i in range(n)}
            assert W.consume(s, bufs, want, True, "random", linger=0.001) == []


def test_slow_consumer_holds_a_bucket_while_the_next_moves():
    values, layout, bufs = _local()
    s = rs.Stream(layout, [0], 700, dtype=torch.bfloat16)
    assert len(s.buckets) >= 4
    want = {n: v.to(torch.bfloat16) for n, v in values.items()}
    assert W.consume(s, bufs, want, True, "slow consumer", linger=0.05) == []


def test_buckets_are_queued_as_soon_as_their_bytes_are_free():
    """At each yielded tensor, exactly the buckets whose `ready_after` the caller has reached
    are queued (counted at the mover's submit), and a bucket whose bytes are free is queued
    while the one before it still moves: the worker holds each such bucket's move until the
    next one is queued (it would wait forever if the next were queued only after it landed)."""
    import threading

    layout = rs.Layout(
        {f"t{i}": rs.replicated((100,), [i]) for i in range(12)},
        {i: rs.Storage(0, torch.float32, 100) for i in range(12)},
    )
    bufs = {i: torch.randn(100) for i in range(12)}
    s = rs.Stream(layout, [0], 800, dtype=torch.float32)  # two tensors per bucket
    ready = [b.ready_after for b in s.buckets]
    first = [0]
    for b in s.buckets:
        first.append(first[-1] + len(b.entries))
    # a ring of two buckets: bucket k+1 is free once bucket k-1 is consumed
    early = [k for k in range(len(ready) - 1) if ready[k + 1] <= first[k]]
    assert len(s.buckets) >= 4 and len(early) >= 3, (ready, first)
    queued, seen = [], {k: threading.Event() for k in range(len(ready))}
    missed = []
    submit, move = s.mover.submit, s.mover._move

    def counting_submit(bucket, *args):
        queued.append(bucket.index)
        seen[bucket.index].set()
        return submit(bucket, *args)

    def holding_move(bucket, *args):
        nxt = bucket.index + 1
        if bucket.index in early and not seen[nxt].wait(60):
            missed.append(nxt)
        return move(bucket, *args)

    s.mover.submit, s.mover._move = counting_submit, holding_move
    want = {f"t{i}": bufs[i] for i in range(12)}
    for _ in range(2):
        queued.clear()
        for e in seen.values():
            e.clear()
        for pos, (name, t) in enumerate(s(bufs)):
            assert queued == list(range(len(queued)))
            assert len(queued) == sum(r <= pos for r in ready), (pos, queued, ready)
            assert torch.equal(t, want[name]), name
        assert queued == list(range(len(s.buckets)))
        assert missed == [], f"buckets {missed} were queued only after the one before landed"


def test_a_failed_bucket_stops_the_ones_queued_behind_it():
    """The mover skips the buckets queued behind a failed one in the same call (their targets
    stay poisoned); the next call moves them."""
    values, layout, bufs = _local()
    s = rs.Stream(layout, [0], 700, dtype=torch.bfloat16)
    list(s(bufs))  # allocates the buffer and the views
    s.buffer.fill_(0xFF)
    b0, b1 = s.buckets[0], s.buckets[1]
    src = {loc: bufs[loc] for loc in b1.src_locations}
    s.mover.begin_call()
    bad = s.mover.submit(b0, {}, s.targets(0), [], None, True)  # its sources are missing
    after = s.mover.submit(b1, src, s.targets(1), [], None, True)
    with pytest.raises(rs.PreflightError):
        bad.result()
    with pytest.raises(RuntimeError, match="bucket 1 was not moved: an earlier bucket"):
        after.result()
    assert all((v.view(torch.uint8) == 0xFF).all() for v in s.targets(1).values())
    s.mover.begin_call()
    s.mover.submit(b1, src, s.targets(1), [], None, True).result()
    for name, t in s.views(1):
        assert torch.equal(t, values[name].to(torch.bfloat16))


def _stick(stream, index):
    """Make the worker hang in bucket `index`'s move until the returned event is set."""
    import threading

    release, move = threading.Event(), stream.mover._move

    def stuck(bucket, *args):
        if bucket.index == index:
            release.wait(120)
        return move(bucket, *args)

    stream.mover._move = stuck
    return release


def test_a_bucket_that_never_finishes_is_an_error_within_the_timeout():
    """Every wait on the worker is bounded by the Stream's timeout: a bucket that never
    finishes ends the call with a TransferError naming it (in the loop, and when a caller that
    stopped early is drained); the Stream refuses calls while its worker is still stuck, and
    works again once it is not (no process group: nothing is out of step)."""
    import time

    values, layout, bufs = _local()
    want = {n: v.to(torch.bfloat16) for n, v in values.items()}
    s = rs.Stream(layout, [0], 256, dtype=torch.bfloat16, timeout=1.0)
    assert len(s.buckets) >= 3
    for stop_early in (False, True):
        release = _stick(s, 1)
        t0 = time.perf_counter()
        if stop_early:  # the close moves the rest: bounded too, and reported by the next call
            for _ in s(bufs):
                break
        else:
            with pytest.raises(rs.TransferError, match=r"bucket 1 of \d+ did not finish within"):
                for _ in s(bufs):
                    pass
        assert time.perf_counter() - t0 < 15
        with pytest.raises(RuntimeError, match="still moving bucket 1"):
            next(s(bufs))
        release.set()
        s.mover._worker.submit(int).result(timeout=60)  # the worker is idle again
        del s.mover._move
        if stop_early:
            with pytest.raises(rs.PreflightError, match="stopped early.*did not finish within"):
                next(s(bufs))
        assert W.consume(s, bufs, want, True, f"after a stuck bucket ({stop_early})") == []


def test_plans_are_built_once_and_reused():
    values, layout, bufs = _local()
    s = rs.Stream(layout, [0], 512, dtype=torch.bfloat16)
    plans = s.plans
    fp = s.fingerprint
    list(s(bufs))
    # after the first call: one Transfer per bucket and the buffer, reused by every later call
    transfers = dict(s.mover.transfers)
    assert sorted(transfers) == [b.index for b in s.buckets]
    buffer_ptr = s.buffer.data_ptr()
    for _ in range(3):
        list(s(bufs))
        assert s.plans == plans and s.report.fingerprint == fp
        assert s.mover.transfers == transfers and s.buffer.data_ptr() == buffer_ptr


def test_early_break_then_full_call():
    """A yielded tensor is valid until the next iteration, and `break` ends the iteration: the
    close moves the remaining buckets through the same buffer (the peers expect them), so a
    view kept past the loop is the Stream's memory; a copy taken in the loop stays right."""
    values, layout, bufs = _local()
    s = rs.Stream(layout, [0], 256, dtype=torch.bfloat16)
    for name, t in s(bufs):
        kept, copy, want = t, t.clone(), values[name].to(torch.bfloat16)
        break
    assert kept.untyped_storage().data_ptr() == s.buffer.untyped_storage().data_ptr()
    assert torch.equal(copy, want)
    want = {n: v.to(torch.bfloat16) for n, v in values.items()}
    assert W.consume(s, bufs, want, True, "after break") == []


def test_report_is_the_last_completed_calls():
    """The Report is made when first read, from what the call kept: reading it late, or after a
    later call stopped early, still gives the last completed call's; one read, one object."""
    values, layout, bufs = _local()
    s = rs.Stream(layout, [0], 256, dtype=torch.bfloat16)
    assert s.report is None
    list(s(bufs))
    first_total = s._last_call.total
    for _ in s(bufs):  # stopped early: not a completed call
        break
    rep = s.report
    assert rep is s.report
    assert rep.seconds["total"] == first_total and rep.buckets == len(s.buckets)
    want = sum(v.numel() * 2 for v in values.values())  # every tensor, as bf16
    assert rep.local_bytes == want
    list(s(bufs))
    assert s.report is not rep and s.report.local_bytes == want


def test_settle_waits_on_the_progress_word_not_the_future():
    """A CUDA receiver's caller settles a bucket on its progress word (the same logic runs
    here on the CPU): DONE lets it go on while the worker's Future is still pending, keeping
    the Future for the Report; FAILED raises the bucket's own error; a Future that ends without
    publishing cannot hold it."""
    import concurrent.futures
    import threading
    import time

    from reshard import stream_iter, stream_mover

    values, layout, bufs = _local()
    s = rs.Stream(layout, [0], 256, dtype=torch.bfloat16)
    call = stream_iter.Call(s, bufs, [])

    def published(value, result=None, error=None):
        word = s.mover.progress_word(0)
        fut = concurrent.futures.Future()
        s.mover.landed[0] = "landed event"
        call.pending.append((0, fut))

        def later():
            torch.ops.reshard.progress_set(word, value)
            if error is not None:
                fut.set_exception(error)
            elif result is not None:
                fut.set_result(result)

        threading.Timer(0.05, later).start()
        return fut

    fut = published(stream_mover.DONE)
    late = threading.Timer(3.0, fut.set_result, (("a report", None),))  # the worker, much later
    late.start()
    t0 = time.perf_counter()
    call.settle(0)
    assert time.perf_counter() - t0 < 2.0 and not fut.done()
    assert not call.pending and call.outcomes == [fut] and call.landed == "landed event"
    assert call.waited >= 0.04
    late.cancel()

    published(stream_mover.FAILED, error=RuntimeError("bucket 0 failed on the worker"))
    with pytest.raises(RuntimeError, match="bucket 0 failed on the worker"):
        call.settle(0)
    assert call.failed and not call.pending

    call.failed = False
    fut = concurrent.futures.Future()
    s.mover.progress_word(0)
    call.pending.append((0, fut))
    fut.set_result(("a report", None))  # done without publishing: the Future decides
    call.settle(0)
    assert call.outcomes[-1] == "a report" and not call.pending


def test_the_worker_leaves_the_caller_a_core_only_where_it_overlaps():
    """A receiver that takes tensors while the bucket moves (a CUDA one) gets a core: the
    worker's team is one thread short, and only then does the caller poll rather than sleep
    while it waits for a tensor's copies (`caller_has_core`)."""
    values, layout, bufs = _local()
    before = torch.get_num_threads()
    try:
        for overlaps, threads, has_core in [(True, 2, True), (True, 1, False), (False, 2, False)]:
            torch.set_num_threads(threads)
            s = rs.Stream(layout, [0], 256, dtype=torch.bfloat16)
            s.mover.caller_overlaps = overlaps
            assert len(list(s(bufs))) == len(s.names)
            assert s.mover.caller_has_core is has_core
            team = s.mover._worker.submit(torch.get_num_threads).result()
            assert team == (threads - 1 if has_core else threads)
            # the worker's team is its own: the caller and threads started later keep the
            # process's count
            assert torch.get_num_threads() == threads
            later = concurrent.futures.ThreadPoolExecutor(1)
            assert later.submit(torch.get_num_threads).result() == threads
            later.shutdown()
            s.close()
    finally:
        torch.set_num_threads(before)


def test_an_unfinished_call_at_interpreter_exit_is_quiet():
    """A generator left mid-stream when the program ends is closed while the interpreter
    shuts down: it moves nothing more (its worker is gone) and prints nothing."""
    import subprocess

    code = (
        "import torch, reshard as rs\n"
        "L = rs.Layout({f't{i}': rs.replicated((64,), [i]) for i in range(4)},\n"
        "              {i: rs.Storage(0, torch.float32, 64) for i in range(4)})\n"
        "s = rs.Stream(L, [0], 256)\n"
        "it = s({i: torch.randn(64) for i in range(4)})\n"
        "next(it)\n"
        "print('left')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout == "left\n", out
    assert out.stderr == "", out.stderr


def test_a_forked_child_gets_a_worker_of_its_own():
    """After os.fork() the child has none of the parent's threads: its calls start a worker of
    their own (they would wait forever on the parent's) and move the child's values."""
    import subprocess

    code = (
        "import os, time, torch, reshard as rs\n"
        "torch.set_num_threads(1)\n"
        "L = rs.Layout({f't{i}': rs.replicated((64,), [i]) for i in range(4)},\n"
        "              {i: rs.Storage(0, torch.float32, 64) for i in range(4)})\n"
        "bufs = {i: torch.randn(64) for i in range(4)}\n"
        "s = rs.Stream(L, [0], 256, timeout=20)\n"
        "assert all(torch.equal(t, bufs[int(n[1:])]) for n, t in s(bufs))\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    two = {i: b * 2 for i, b in bufs.items()}\n"
        "    ok = all(torch.equal(t, two[int(n[1:])]) for n, t in s(two))\n"
        "    os._exit(0 if ok else 3)\n"
        "for _ in range(600):\n"
        "    done, status = os.waitpid(pid, os.WNOHANG)\n"
        "    if done:\n"
        "        print('child', os.waitstatus_to_exitcode(status))\n"
        "        break\n"
        "    time.sleep(0.1)\n"
        "else:\n"
        "    os.kill(pid, 9)\n"
        "    print('child hung')\n"
        "it = s(bufs)\n"  # forked mid-call: the child's copy of the call refuses at once
        "next(it)\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    try:\n"
        "        list(it)\n"
        "    except RuntimeError as exc:\n"
        "        ok = 'before os.fork()' in str(exc)\n"
        "        ok = ok and len(list(s(bufs))) == 4\n"
        "        os._exit(0 if ok else 4)\n"
        "    os._exit(5)\n"
        "for _ in range(600):\n"
        "    done, status = os.waitpid(pid, os.WNOHANG)\n"
        "    if done:\n"
        "        print('child', os.waitstatus_to_exitcode(status))\n"
        "        break\n"
        "    time.sleep(0.1)\n"
        "else:\n"
        "    os.kill(pid, 9)\n"
        "    print('child hung')\n"
        "assert len(list(it)) == 3\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0 and out.stdout == "child 0\nchild 0\n", out


def test_not_reentrant():
    values, layout, bufs = _local()
    s = rs.Stream(layout, [0], 256, dtype=torch.bfloat16)
    first = s(bufs)
    next(first)
    with pytest.raises(RuntimeError, match="already being iterated"):
        next(s(bufs))
    rest = [n for n, _ in first]
    assert len(rest) == len(s.names) - 1
    assert len(list(s(bufs))) == len(s.names)  # usable again once the first call ended


def test_threads_starting_one_stream_at_once_get_one_call():
    """Threads that start the same Stream together: exactly one call runs, every other raises
    at once (none waits and runs a call of its own after it: its peers would not). A fresh
    Stream each round, so the calls' first steps include binding its worker."""

    values, layout, bufs = _local()
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads interleave inside a call's first steps
    try:
        for _ in range(20):
            outcomes = _start_together(rs.Stream(layout, [0], 256, dtype=torch.bfloat16), bufs)
            assert sorted(outcomes) == ["already"] * 3 + ["ran"], outcomes
    finally:
        sys.setswitchinterval(switch)


def _start_together(s, bufs, threads=4):
    """What each of `threads` threads got from starting `s` at once: "ran" (it held its call
    until every other thread had its answer), "already", or the unexpected exception."""
    import threading

    gate, release, outcomes = threading.Barrier(threads), threading.Event(), []

    def start():
        it = s(bufs)
        gate.wait(30)
        try:
            next(it)
        except RuntimeError as exc:
            outcomes.append("already" if "already being iterated" in str(exc) else repr(exc))
            return
        outcomes.append("ran")
        release.wait(30)
        it.close()

    workers = [threading.Thread(target=start) for _ in range(threads)]
    for w in workers:
        w.start()
    while outcomes.count("already") < threads - 1 and any(w.is_alive() for w in workers):
        time.sleep(0.002)
    release.set()
    for w in workers:
        w.join(30)
    return outcomes


def test_validation_errors():
    values, layout, bufs = _local()
    with pytest.raises(ValueError, match="not in the source layout"):
        rs.Stream(layout, names=["embed", "nope"])
    with pytest.raises(ValueError, match="more than once"):
        rs.Stream(layout, names=["embed", "embed"])
    with pytest.raises(ValueError, match="empty"):
        rs.Stream(layout, names=[])
    with pytest.raises(ValueError, match="not a rank of the group"):
        rs.Stream(layout, receivers=[1])
    with pytest.raises(ValueError, match="twice"):
        rs.Stream(layout, receivers=[0, 0])
    with pytest.raises(ValueError, match="bucket_bytes"):
        rs.Stream(layout, bucket_bytes=0)
    with pytest.raises(ValueError, match="cannot stream"):
        rs.Stream(layout, dtype=torch.int32)
    with pytest.raises(TypeError, match="Layout"):
        rs.Stream({"a": 1})
    # a tensor whose pieces live in storages of two dtypes needs dtype=
    mixed = rs.Layout(
        {"t": rs.flat((4,), [(0, 0, 2, 0), (1, 2, 4, 0)])},
        {0: rs.Storage(0, torch.float32, 2), 1: rs.Storage(0, torch.bfloat16, 2)},
    )
    with pytest.raises(ValueError, match="pass dtype="):
        rs.Stream(mixed)
    s = rs.Stream(mixed, dtype=torch.float32)
    src = {0: torch.tensor([1.0, 2.0]), 1: torch.tensor([3.0, 4.0], dtype=torch.bfloat16)}
    assert torch.equal(dict(s(src))["t"], torch.tensor([1.0, 2.0, 3.0, 4.0]))


def test_numpy_ints_are_sizes_and_ranks_and_non_ints_are_named():
    """np.int64(0) was 'not a rank of the group (size 1)' and np.int64 sizes were refused
    (plan() takes them); a dict of receivers gave its keys as the ranks."""
    values, layout, bufs = _local()
    want = {n: values[n] for n in ("w1", "embed")}
    for kw in (
        dict(receivers=[np.int64(0)]),
        dict(receivers=np.int32(0)),
        dict(bucket_bytes=np.int64(256), buffer_bytes=np.int64(4096)),
        dict(staging_bytes_per_rank=np.uint32(1 << 16)),
    ):
        s = rs.Stream(layout, names=list(want), **kw)
        assert s.receivers == [0] and all(type(x) is int for x in s.receivers)
        assert type(s.bucket_bytes) is int and type(s.buffer_bytes) is int
        assert W.consume(s, bufs, want, True, f"{kw}") == []
    for kw, match in [
        (dict(receivers=["0"]), "receivers must be int ranks, got '0'"),
        (dict(receivers=[torch.tensor(0)]), "receivers must be int ranks"),
        (dict(receivers={0: "rank"}), "receivers must be a list of ranks"),
        (dict(receivers=[np.int64(1)]), "receiver 1 is not a rank of the group"),
        (dict(bucket_bytes=np.float64(256)), "bucket_bytes must be an int"),
    ]:
        with pytest.raises(ValueError, match=match):
            rs.Stream(layout, **kw)


def test_a_buffer_of_any_size_keeps_every_bucket_aligned():
    """A buffer_bytes that is no multiple of 16 (or twice an odd bucket_bytes): a bucket placed
    at the buffer's end still starts aligned, so its views of every dtype exist."""
    sizes = [250, 100]
    layout = rs.Layout(
        {f"t{i}": rs.replicated((m,), [i]) for i, m in enumerate(sizes)},
        {i: rs.Storage(0, torch.float32, m) for i, m in enumerate(sizes)},
    )
    bufs = {i: torch.randn(m) for i, m in enumerate(sizes)}
    want = {f"t{i}": bufs[i].clone() for i in range(len(sizes))}
    for kw in (dict(bucket_bytes=512, buffer_bytes=1407), dict(bucket_bytes=1001)):
        s = rs.Stream(layout, [0], **kw)
        assert all(b.start % 16 == 0 for b in s.buckets), kw
        for _ in range(2):
            assert W.consume(s, bufs, want, True, str(kw)) == []


def test_iterating_under_inference_mode():
    """Engines load weights under torch.inference_mode(): the Stream's buffer stays a normal
    tensor (its worker thread writes it outside that mode), in every call, in or out of it."""
    values, layout, bufs = _local()
    want = {n: v.to(torch.bfloat16) for n, v in values.items()}
    s = rs.Stream(layout, [0], 256, dtype=torch.bfloat16)
    for inference in (True, False, True):
        with torch.inference_mode(inference):
            got = {n: t.clone() for n, t in s(bufs)}
        assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)


def test_constructor_refuses_what_the_first_call_would():
    values, layout, bufs = _local()
    for timeout, err in [(-1, ValueError), (None, TypeError), ("5", TypeError)]:
        with pytest.raises(err, match="timeout must be"):
            rs.Stream(layout, timeout=timeout)
    with pytest.raises(ValueError, match="names must be a list"):
        rs.Stream(layout, names=5)
    with pytest.raises(ValueError, match="2\\*\\*62"):
        rs.Stream(layout, buffer_bytes=1 << 70)
    wide = rs.Layout({"z": rs.replicated((4,), [0])}, {0: rs.Storage(0, torch.complex128, 4)})
    with pytest.raises(ValueError, match="16-byte elements"):
        rs.Stream(wide)
    if not torch.cuda.is_available():
        # whether a device fits is the rank's own: refused in the first bucket's preflight
        s = rs.Stream(layout, dtype=torch.bfloat16, device="cuda")
        with pytest.raises(rs.PreflightError, match="rank 0: device cuda: CUDA is not available"):
            next(iter(s(bufs)))
    # receivers' tensors live on the CPU or a CUDA device this process has, nothing else
    for device in ("meta", "mps", torch.device("meta")):
        with pytest.raises(ValueError, match="device .*cpu or a CUDA device"):
            rs.Stream(layout, device=device)
    with pytest.raises(ValueError, match="not a device"):
        rs.Stream(layout, device="nonsense")


class _NotReady:
    def __init__(self, buffers):
        self.buffers = buffers

    def check(self):
        raise rs.NotReadyError("moments do not exist yet")


def test_preflight_errors_before_anything_is_yielded():
    values, layout, bufs = _local()
    s = rs.Stream(layout, [0], 256, dtype=torch.bfloat16)
    last = s.buckets[-1].src_locations[0]
    cases = [
        ({k: v for k, v in bufs.items() if k != last}, f"source location {last}"),
        ({**bufs, last: bufs[last][:-1]}, "elements"),
        ({**bufs, 99: bufs[0]}, "location 99 does not exist"),
        (_NotReady(bufs), "moments do not exist yet"),
    ]
    for bad, match in cases:
        got = []
        with pytest.raises(rs.PreflightError, match=match):
            for name, _ in s(bad):
                got.append(name)
        assert got == []


def test_the_stated_bound_covers_the_descriptor_tables():
    """A tensor of irregular short runs (every run a descriptor row): every storage the Stream
    holds after a call, its int64 tables included (found through the garbage collector), is
    within the bound it states; the tables are most of it. They were left out of the bound."""
    layout, bufs, full = W.short_runs_source(1 << 17, seed=5)
    s = rs.Stream(layout, [0], 1 << 20, dtype=torch.bfloat16)
    for _ in range(2):
        got = {n: t.clone() for n, t in s(bufs)}
        assert torch.equal(got["w"].view(torch.int16), full.to(torch.bfloat16).view(torch.int16))
        held = W.held_storages(s, bufs)
        assert held <= sum(s.staging_bytes().values()) == sum(s.report.staging_bound.values())
        # besides the buffer (no arenas in process), exactly the tables: 48 B per copy run
        engines = [t._engine for t in s.mover.transfers.values()]
        rows = sum(len(t.desc) for e in engines for t in e.local)
        assert held - s.buffer_bytes == 48 * rows > s.buffer_bytes


@pytest.mark.parametrize(
    "args, error",
    [
        (("0",), TypeError),  # never read as some other rank (a bound of zeros)
        ((-1,), ValueError),
        ((True,), TypeError),
        ((0, "tcp"), ValueError),  # was stated as the gloo bound
        ((0, "nccl", -1), ValueError),
        ((0, "nccl", 2.5), TypeError),
    ],
)
def test_staging_bytes_refuses_what_a_plan_refuses(args, error):
    _, layout, _ = _local()
    s = rs.Stream(layout, [0], 256, dtype=torch.bfloat16)
    with pytest.raises(error, match="rank|transport|host_ring_bytes"):
        s.staging_bytes(*args)
    assert s.staging_bytes(np.int64(0)) == s.staging_bytes(0) == s.staging_bytes()
    assert s.staging_bytes(0)["host"] >= s.buffer_bytes


def _freed(n, dtype):
    t = torch.arange(float(n)).to(dtype)
    t.untyped_storage().resize_(0)  # as FSDP frees a parameter
    return t


def _shrunk_view(n, dtype):
    base = torch.arange(2.0 * n).to(dtype)
    view = base[n:]
    base.untyped_storage().resize_(n * view.element_size())
    return view


@pytest.mark.parametrize(
    "make, dtype, match",
    [
        (_freed, torch.float32, "its storage is freed"),
        (_shrunk_view, torch.float32, "fewer than the 512 its view needs"),
        (lambda n, dt: torch.empty(n, dtype=dt, device="meta"), torch.float32, "is on meta"),
        (lambda n, dt: torch.arange(float(n)).to(dt).to_sparse(), torch.float32, "sparse_coo"),
        (lambda n, dt: torch.arange(float(n)).to(dt).conj(), torch.complex64, "conjugated"),
        (lambda n, dt: torch._neg_view(torch.arange(float(n)).to(dt)), torch.complex64, "negated"),
    ],
)
def test_a_bad_source_of_a_later_bucket_fails_before_anything_is_yielded(make, dtype, match):
    """Bucket 0's check of the later buckets' sources is their own preflight's: these passed
    it, so the first bucket's tensors were yielded before the second bucket refused."""
    n = 64
    layout = rs.Layout(
        {"a": rs.flat((n,), [(0, 0, n, 0)]), "b": rs.flat((n,), [(1, 0, n, 0)])},
        {0: rs.Storage(0, dtype, n), 1: rs.Storage(0, dtype, n)},
    )
    s = rs.Stream(layout, bucket_bytes=n * dtype.itemsize)
    assert [b.names for b in s.buckets] == [["a"], ["b"]]
    good = {0: torch.arange(float(n)).to(dtype), 1: torch.arange(float(n)).to(dtype) + 1}
    got = []
    with pytest.raises(rs.PreflightError, match=f"source location 1: .*{match}"):
        for name, _ in s({0: good[0], 1: make(n, dtype)}):
            got.append(name)
    assert got == []
    out = {name: t.clone() for name, t in s(good)}  # the Stream is still usable
    assert torch.equal(out["a"], good[0]) and torch.equal(out["b"], good[1])


@pytest.mark.parametrize("which", ["a", "b"])
def test_a_source_in_the_streams_own_buffer_is_refused(which):
    """A yielded tensor passed back as a source: one bucket wrote another's source (b arrived
    with a's values, and the caller's tensor was overwritten)."""
    n = 64
    layout = rs.Layout(
        {"a": rs.flat((n,), [(0, 0, n, 0)]), "b": rs.flat((n,), [(1, 0, n, 0)])},
        {0: rs.Storage(0, torch.float32, n), 1: rs.Storage(0, torch.float32, n)},
    )
    s = rs.Stream(layout, bucket_bytes=n * 4)
    assert [bk.names for bk in s.buckets] == [["a"], ["b"]]
    a, b = torch.arange(float(n)), torch.arange(float(n)) + 1000
    kept = dict(s({0: a, 1: b}))  # views of the Stream's buffer
    src = kept[which]  # the region the other bucket (or this one) writes
    src.copy_(b)
    got = []
    with pytest.raises(rs.PreflightError, match="source location 1 shares memory with the Stream"):
        for name, _ in s({0: a, 1: src}):
            got.append(name)
    assert got == [] and torch.equal(src, b)
    out = {name: t.clone() for name, t in s({0: a, 1: src.clone()})}
    assert torch.equal(out["a"], a) and torch.equal(out["b"], b)


def test_a_buffer_object_is_read_as_a_transfer_reads_it():
    """Its `.layout` must agree with the Stream's (a stale describe() of another layout would
    stream the wrong elements under each name), its `.check` must be callable, and a
    `.buffers` that raises is a PreflightError, as for a Transfer."""
    a, b = torch.arange(4.0), torch.arange(4.0) + 10
    mine = rs.Layout(
        {"a": rs.flat((4,), [(0, 0, 4, 0)]), "b": rs.flat((4,), [(0, 0, 4, 4)])},
        {0: rs.Storage(0, torch.float32, 8)},
    )
    swapped = rs.Layout(
        {"a": rs.flat((4,), [(0, 0, 4, 4)]), "b": rs.flat((4,), [(0, 0, 4, 0)])},
        {0: rs.Storage(0, torch.float32, 8)},
    )
    held = torch.cat([b, a])  # laid out as `swapped` says
    s = rs.Stream(mine)
    cases = [
        (W._Live({0: held}, layout=swapped), "differs from the Stream's src_layout: tensor 'a'"),
        (W._Live({0: held}, check=True), "`.check` must be callable"),
        (W._BuffersRaise(), "RuntimeError: engine state not ready"),
    ]
    for bad, match in cases:
        got = []
        with pytest.raises(rs.PreflightError, match=match):
            for name, _ in s(bad):
                got.append(name)
        assert got == []
    # the same object with its own layout: the Transfer agrees, and so does the Stream
    same = W._Live({0: torch.cat([a, b])}, layout=mine)
    got = {n: t.clone() for n, t in rs.Stream(swapped)(W._Live({0: held}, layout=swapped))}
    assert torch.equal(got["a"], a) and torch.equal(got["b"], b)
    got = {n: t.clone() for n, t in s(same)}
    assert torch.equal(got["a"], a) and torch.equal(got["b"], b)


def test_stream_sources_need_plain_tensors_under_int_keys():
    """A float key standing in for location 0, a tensor subclass without plain memory and a
    nested tensor are refused in bucket 0's preflight, before anything is yielded."""
    from torch.testing._internal.two_tensor import TwoTensor

    lay = rs.Layout({"a": rs.flat((4,), [(0, 0, 4, 0)])}, {0: rs.Storage(0, torch.float32, 4)})
    s = rs.Stream(lay)
    cases = [
        ({0.0: torch.arange(4.0)}, "source buffer key 0.0 \\(float\\) is not a location"),
        ({0: TwoTensor(torch.zeros(4), torch.zeros(4))}, "is a TwoTensor, a tensor subclass"),
        ({0: torch.nested.nested_tensor([torch.zeros(4)])}, "is a nested tensor"),
    ]
    for bufs, match in cases:
        got = []
        with pytest.raises(rs.PreflightError, match=match):
            for name, _ in s(bufs):
                got.append(name)
        assert got == []
    assert [n for n, _ in s({0: torch.arange(4.0)})] == ["a"]


def test_stream_refuses_a_quantized_dtype_and_a_non_bool_registration():
    lay = rs.Layout(
        {"a": rs.flat((0,), []), "b": rs.flat((4,), [(0, 0, 4, 0)])},
        {0: rs.Storage(0, torch.float32, 4)},
    )
    with pytest.raises(ValueError, match="dtype torch.qint8 is quantized"):
        rs.Stream(lay, dtype=torch.qint8, names=["a"])
    with pytest.raises(TypeError, match="register_host_sources must be True or False, got 'no'"):
        rs.Stream(lay, register_host_sources="no")


# ------------------------------------------------------------------------ spawned ranks


def test_stream_gloo_three_ranks(tmp_path):
    for errs in run_ranks(W.w_stream, 3, tmp_path, env=ENV, timeout=240):
        assert errs == []


def test_stream_gloo_preflight_is_collective(tmp_path):
    out = run_ranks(W.w_preflight, 3, tmp_path, env=ENV, timeout=180)
    for errs, _ in out:
        assert errs == []
    assert len({msg for _, msg in out}) == 1, "every rank raises the same PreflightError"


def test_stream_gloo_ranks_that_disagree_fail_together(tmp_path):
    out = run_ranks(W.w_disagree, 2, tmp_path, env=ENV, timeout=180)
    for errs, _ in out:
        assert errs == []
    assert out[0][1] == out[1][1], "every rank raises the same PreflightErrors"


def test_stream_gloo_early_stop(tmp_path):
    """Also: group holding, the group resolved per call, pickling (`W._group_is_held`,
    `W._resolved_per_call`)."""
    layout, _ = W.zero3_source(2, W.full_values(seed=3), 0)
    local = rs.Stream(layout, [0], 1024, dtype=torch.bfloat16)  # no process group here
    assert (local.rank, local.world_size, local.backend) == (0, 1, "local")
    args = (local,)
    for errs in run_ranks(W.w_early_stop, 2, tmp_path, env=ENV, timeout=180, args=args):
        assert errs == []


def test_stream_gloo_exception_thrown_into_one_ranks_generator(tmp_path):
    """gen.throw() on one receiver: it gets its exception, its peers finish the call with the
    right tensors (its generator moves the rest for them), and the next call is complete."""
    for errs in run_ranks(W.w_throw_on_one_rank, 3, tmp_path, env=ENV, timeout=180):
        assert errs == []


@pytest.mark.parametrize("raiser", ["KeyboardInterrupt", "SystemExit"])
def test_stream_gloo_an_interrupt_in_one_ranks_hook_refuses_on_every_rank(tmp_path, raiser):
    """A KeyboardInterrupt / SystemExit in one rank's readiness hook is a reason of bucket 0's
    preflight: the same PreflightError on every rank (the interrupt itself raised again on
    its rank), nothing yielded, and the group's next call is complete."""
    out = run_ranks(W.w_interrupted_hook, 2, tmp_path, env=ENV, timeout=180, args=(raiser,))
    for errs, _ in out:
        assert errs == []
    assert out[0][1] == out[1][1], "every rank raises the same PreflightError"


def test_stream_gloo_two_states_in_crossed_order_do_not_pair_up(tmp_path):
    """Streams of one plan moving differently named states (a source object's `.kind`) are
    refused alike on every rank when the ranks iterate them in another order."""
    out = run_ranks(W.w_crossed_kinds, 2, tmp_path, env=ENV, timeout=180)
    for errs, _ in out:
        assert errs == []
    assert out[0][1] == out[1][1], "every rank raises the same PreflightErrors"


def test_stream_gloo_a_device_one_rank_lacks_refuses_on_every_rank(tmp_path):
    """`device=` may differ between ranks (cuda:{local_rank}); one that does not fit its rank's
    process (here: CUDA on a CPU-only rank) was a ValueError at construction on that rank
    alone, its peers waiting out their timeout in the first call."""
    out = run_ranks(W.w_device_misfit, 2, tmp_path, env=ENV, timeout=180)
    for errs, _ in out:
        assert errs == []
    assert out[0][1] == out[1][1], "every rank raises the same PreflightErrors"
