"""Workers for the Stream tests (module level: the spawn context re-imports this module).

Sources are ZeRO-3 style: every tensor flattened and cut into `world` equal shards (the last
one padded), rank r's shards of all fp32 tensors concatenated in one storage and of all bf16
tensors in another; padding is poisoned. References are the full tensors every rank builds
from the same seed, cast with torch. Workers return lists of error strings.
"""

from __future__ import annotations

import gc
import math
import time
from collections import deque
from concurrent.futures import Future

import numpy as np
import torch
import torch.distributed as dist

import reshard as rs

POISON = float("nan")
SHAPES = {
    "embed": ((37, 12), torch.float32),
    "w1": ((20, 12), torch.float32),
    "b1": ((20,), torch.bfloat16),
    "big": ((64, 24), torch.float32),  # 6144 B as bf16: larger than the small buckets below
    "empty": ((0, 5), torch.float32),
    "w2": ((12, 20), torch.float32),
    "norm": ((12,), torch.bfloat16),
}


def full_values(seed):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(shape, generator=g).to(dt) for n, (shape, dt) in SHAPES.items()}


def zero3_source(world, values, rank):
    """(layout, this rank's buffers): storage 2r holds rank r's fp32 shards, 2r+1 its bf16."""
    tensors, used = {}, {}
    for n, (shape, dt) in SHAPES.items():
        numel = math.prod(shape)
        part = -(-numel // world)
        runs = []
        for r in range(world):
            loc = 2 * r + (dt == torch.bfloat16)
            lo, hi = min(r * part, numel), min((r + 1) * part, numel)
            off = used.get(loc, 0)
            if hi > lo:
                runs.append((loc, lo, hi, off))
            used[loc] = off + part
        tensors[n] = rs.flat(shape, runs)
    storages = {}
    for r in range(world):
        for k, dt in enumerate((torch.float32, torch.bfloat16)):
            storages[2 * r + k] = rs.Storage(r, dt, used.get(2 * r + k, 0))
    layout = rs.Layout(tensors, storages)
    bufs = {}
    for loc, st in storages.items():
        if st.rank != rank:
            continue
        bufs[loc] = torch.full((st.numel,), POISON, dtype=st.dtype)
    for n, tl in tensors.items():
        flat = values[n].reshape(-1)
        for p in tl.pieces:
            if p.location in bufs:
                k = math.prod(p.shape)
                # flat() pieces of a row-major range: rebuild the flat index of the box start
                start = sum(s * st for s, st in zip(p.start, _rowmajor(SHAPES[n][0])))
                box = flat[start:].as_strided(p.shape, _rowmajor(SHAPES[n][0]))
                bufs[p.location][p.offset : p.offset + k] = box.reshape(-1)
    return layout, bufs


def _rowmajor(shape):
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(out))


def _bits(t):
    return t.contiguous().view({1: torch.int8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _same(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def _overlaps(a, e, b):
    """Tensor `e` of bucket `a` shares bytes with bucket `b`'s range."""
    lo = a.start + e.offset
    return e.nbytes and lo < b.start + b.nbytes and b.start < lo + e.nbytes


def protected_until(stream):
    """{name: stream position}: from the placement alone, by brute force, how long each
    tensor's bytes stay untouched: until the caller has asked for the tensor at that position
    (the first `ready_after` of a later bucket overlapping it; len(names) when none does)."""
    out = {}
    for a in stream.buckets:
        for e in a.entries:
            later = [b.ready_after for b in stream.buckets[a.index + 1 :] if _overlaps(a, e, b)]
            out[e.name] = min(later, default=len(stream.names))
    return out


def regions_disjoint(stream):
    """No bucket may be written while the caller may still read a tensor sharing its bytes
    (every earlier tensor at or past its `ready_after`, stream order over all buckets), a
    bucket is never queued before the bucket before it, and every bucket fits the receivers'
    buffer. Checked from the placement alone, byte by byte."""
    errs = []
    for b in stream.buckets:
        if b.start < 0 or b.start + b.nbytes > stream.buffer_bytes:
            errs.append(f"bucket {b.index} [{b.start}, +{b.nbytes}) exceeds the buffer")
    first = 0
    for b in stream.buckets:
        if not 0 <= b.ready_after <= first:
            errs.append(f"bucket {b.index} ready after {b.ready_after}, it starts at {first}")
        index = 0
        for a in stream.buckets[: b.index]:
            for e in a.entries:
                if index >= b.ready_after and _overlaps(a, e, b):
                    errs.append(f"bucket {b.index} overwrites {e.name} (bucket {a.index}) in use")
                index += 1
        first += len(b.entries)
    return errs


def consume(stream, bufs, want, receiving, tag, hold_check=True, linger=0.0):
    """Iterate once; check each tensor, and that every tensor yielded so far stays intact for
    as long as the placement promises (`protected_until`: at least until the caller asks for
    the next one) while later ones (and the buckets queued meanwhile) arrive. linger: seconds
    to wait at each tensor, so queued buckets have landed before the checks (a slow consumer;
    no assertion depends on it). Returns errors."""
    errs, order = regions_disjoint(stream), []
    held = []  # (name, view, position at which it may be overwritten)
    until = protected_until(stream)
    for pos, (name, t) in enumerate(stream(bufs)):
        order.append(name)
        if until[name] <= pos:
            errs.append(f"{tag}: {name} (position {pos}) unprotected when yielded")
        if linger:
            time.sleep(linger)
        held = [h for h in held if h[2] > pos] + [(name, t, until[name])]
        if not _same(t, want[name]):
            errs.append(f"{tag}: {name} differs from the reference")
        if hold_check:
            for hn, ht, _ in held:
                if not _same(ht, want[hn]):
                    errs.append(f"{tag}: {hn} changed while {name} arrived")
    expect = list(stream.names) if receiving else []
    if order != expect:
        errs.append(f"{tag}: yielded {order}, expected {expect}")
    rep = stream.report
    for k in rep.peak_staging_bytes:
        if rep.peak_staging_bytes[k] > rep.staging_bound[k]:
            errs.append(f"{tag}: held {rep.peak_staging_bytes} > bound {rep.staging_bound}")
    bound = stream.staging_bytes(transport="gloo")
    if rep.staging_bound != bound:
        errs.append(f"{tag}: report bound {rep.staging_bound} != stated {bound}")
    return errs


def held_storages(stream, bufs) -> int:
    """Bytes of every storage reachable from `stream` through containers and reshard's own
    objects (found with the garbage collector's referents, not the Stream's own accounting),
    other than the sources in `bufs`, the executor's int64 descriptor tables included: what
    the stated bound `staging_bytes` must cover. Modules, functions and threads are not
    followed (they reach the whole interpreter)."""
    sources = {t.untyped_storage().data_ptr() for t in bufs.values()}
    held, seen, todo = {}, set(), [stream]
    while todo:
        o = todo.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            st = o.untyped_storage()
            if st.data_ptr() not in sources:
                held[st.data_ptr()] = st.nbytes()
        elif isinstance(o, (dict, list, tuple, set, frozenset, deque, Future)) or (
            type(o).__module__.startswith("reshard.") and not isinstance(o, type)
        ):
            todo.extend(gc.get_referents(o))
    return sum(held.values())


def short_runs_source(numel, seed):
    """(layout, buffers, full fp32 tensor "w"): one flat tensor cut into runs of random lengths
    (1-31 elements) that alternate between two storages of rank 0, so no run pattern repeats
    and every run is a descriptor row of its own: the executor's tables are as large as the
    planner makes them (48 B per run, about numel / 16 runs)."""
    g = np.random.default_rng(seed)
    cuts = np.concatenate([[0], np.cumsum(g.integers(1, 32, size=numel // 8))])
    cuts = np.append(cuts[cuts < numel], numel)
    runs, idx, offs = [], ([], []), [0, 0]
    for k, (a, b) in enumerate(zip(cuts[:-1].tolist(), cuts[1:].tolist(), strict=True)):
        loc = k % 2
        runs.append((loc, a, b, offs[loc]))
        idx[loc].append(np.arange(a, b))
        offs[loc] += b - a
    layout = rs.Layout(
        {"w": rs.flat((numel,), runs)}, {i: rs.Storage(0, torch.float32, offs[i]) for i in (0, 1)}
    )
    full = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    bufs = {i: full[torch.from_numpy(np.concatenate(idx[i]))] for i in (0, 1)}
    return layout, bufs, full


def _held_within_bound(stream, bufs, tag) -> list[str]:
    held, bound = held_storages(stream, bufs), sum(stream.staging_bytes().values())
    return [f"{tag}: the Stream holds {held} B of storage, its stated bound is {bound} B"] * (
        held > bound
    )


def w_stream(rank, world):
    errs = []
    values = full_values(seed=1)
    layout, bufs = zero3_source(world, values, rank)
    cases = [
        # (receivers, bucket_bytes, dtype, names)
        ([0], 1024, torch.bfloat16, None),
        ([0, world - 1], 1024, None, [n for n in SHAPES if n != "empty"]),
        ([1], 4096, torch.float32, ["norm", "big", "w1", "empty"]),
        ([0], 1 << 20, torch.float16, None),  # one bucket
    ]
    for receivers, bucket, dtype, names in cases:
        tag = f"rank {rank} recv {receivers} bucket {bucket} {dtype} {names}"
        s = rs.Stream(layout, receivers, bucket, dtype=dtype, names=names)
        chosen = names or list(SHAPES)
        want = {n: values[n].to(dtype or values[n].dtype) for n in chosen}
        plans = [id(p) for p in s.plans]
        errs += consume(s, bufs, want, rank in receivers, tag + " call 1")
        held1 = dict(s.report.peak_staging_bytes)
        # sources change between steps: the second call must move the new values, same plans
        values2 = {n: v * 2 + 1 for n, v in values.items()}
        _, bufs2 = zero3_source(world, values2, rank)
        for loc in bufs:
            bufs[loc].copy_(bufs2[loc])
        want2 = {n: values2[n].to(dtype or values2[n].dtype) for n in chosen}
        errs += consume(s, bufs, want2, rank in receivers, tag + " call 2")
        if s.report.peak_staging_bytes != held1:  # staging is kept, not re-allocated
            errs.append(f"{tag}: held {held1} then {s.report.peak_staging_bytes}")
        errs += _held_within_bound(s, bufs, tag)
        if [id(p) for p in s.plans] != plans:
            errs.append(f"{tag}: plans were rebuilt")
        _, bufs = zero3_source(world, values, rank)
        if rank in receivers and s.report.peak_staging_bytes["host"] < s.buffer_bytes:
            errs.append(f"{tag}: receiver buffer not reported")
    # buckets: the big tensor is alone in its bucket; the buffer is the largest bucket or two
    # buckets' worth, whichever is more
    s = rs.Stream(layout, [0], 1024, dtype=torch.bfloat16)
    big = [b for b in s.buckets if "big" in b.names]
    if len(big) != 1 or big[0].names != ["big"]:
        errs.append(f"big tensor not alone: {[b.names for b in s.buckets]}")
    if s.buffer_bytes != max(2 * 1024, 64 * 24 * 2):
        errs.append(f"buffer {s.buffer_bytes} B, expected max(2 x bucket, largest tensor)")
    return errs


def w_preflight(rank, world):
    """A bad buffer on rank 1 (only in a late bucket): every rank raises the same PreflightError
    before anything is yielded; then a good call works."""
    values = full_values(seed=2)
    layout, bufs = zero3_source(world, values, rank)
    s = rs.Stream(layout, [0], 1024, dtype=torch.bfloat16)
    late = s.buckets[-1].src_locations
    bad = dict(bufs)
    if rank == 1:
        loc = next(loc for loc in late if layout.storages[loc].rank == 1)
        bad[loc] = bufs[loc].to(torch.float16)
    got, msg = [], None
    try:
        for name, _ in s(bad):
            got.append(name)
    except rs.PreflightError as exc:
        msg = str(exc)
    errs = []
    if msg is None or "rank 1" not in msg or "dtype torch.float16" not in msg:
        errs.append(f"rank {rank}: expected a PreflightError naming rank 1, got {msg!r}")
    if got:
        errs.append(f"rank {rank}: yielded {got} before the error")
    want = {n: v.to(torch.bfloat16) for n, v in values.items()}
    errs += consume(s, bufs, want, rank == 0, f"rank {rank} after the error")
    return errs, msg


def w_disagree(rank, world):
    """Rank 1 leaves out the last tensor (its stream differs only in its last bucket), then
    passes a list for its buffers: every rank raises the same PreflightError in bucket 0,
    before anything is yielded; then a good call works."""
    values = full_values(seed=4)
    layout, bufs = zero3_source(world, values, rank)
    names = list(layout.tensors)
    errs, msgs = [], []
    other, _ = zero3_source(world + 1, values, rank)  # the same tensors, sharded otherwise
    odd = {
        "raises": (_BuffersRaise(), "RuntimeError: engine state not ready"),
        "check": (_Live(bufs, check="ready"), "`.check` must be callable"),
        "layout": (_Live(bufs, layout=other), "differs from the Stream's src_layout"),
    }
    cases = [
        (names[:-1] if rank == 1 else names, bufs, "fingerprint"),
        (names, list(bufs.values()) if rank == 1 else bufs, "src_buffers must be a mapping"),
        # a buffer object that fails on rank 1 alone fails every rank's call alike
        *((names, odd[k][0] if rank == 1 else bufs, odd[k][1]) for k in odd),
    ]
    for own, src, why in cases:
        s = rs.Stream(layout, [0], 1024, dtype=torch.bfloat16, names=own)
        got, msg = [], None
        try:
            for name, _ in s(src):
                got.append(name)
        except rs.PreflightError as exc:
            msg = str(exc)
        if msg is None or why not in msg:
            errs.append(f"rank {rank}: expected a PreflightError about {why!r}, got {msg!r}")
        if got:
            errs.append(f"rank {rank}: yielded {got} before the error ({why})")
        msgs.append(msg)
    s = rs.Stream(layout, [0], 1024, dtype=torch.bfloat16)
    want = {n: v.to(torch.bfloat16) for n, v in values.items()}
    errs += consume(s, bufs, want, rank == 0, f"rank {rank} after the errors")
    return errs, msgs


class _BuffersRaise:
    """A buffer object whose `.buffers` raises (an engine in a bad state)."""

    @property
    def buffers(self):
        raise RuntimeError("engine state not ready")


class _Live:
    """A buffer object as the integrations return: `.buffers`, `.layout`, `.check`, `.kind`."""

    def __init__(self, buffers, layout=None, check=None, kind=None):
        self.buffers, self.layout, self.check, self.kind = buffers, layout, check, kind


def w_early_stop(rank, world, local=None):
    """The receiver stops after its first tensor; its peers iterate to the end and finish
    normally (the closed generator moves the rest); the next call is complete everywhere.
    local: a Stream built (and pickled) in a process without a process group."""
    values = full_values(seed=3)
    layout, bufs = zero3_source(world, values, rank)
    s = rs.Stream(layout, [0], 1024, dtype=torch.bfloat16)
    errs = _group_is_held(rank, s, layout, bufs, values)
    errs += _resolved_per_call(rank, local, bufs, values)
    for _name, _t in s(bufs):
        break
    want = {n: v.to(torch.bfloat16) for n, v in values.items()}
    errs += consume(s, bufs, want, rank == 0, f"rank {rank} after the early stop")
    errs += _failure_after_an_early_stop(rank, s, bufs, want)
    dist.barrier()
    return errs


def _refuse():
    raise RuntimeError("injected: the last bucket is refused on rank 0")


def _failure_after_an_early_stop(rank, s, bufs, want):
    """The last bucket fails (collectively) after the receiver stopped: its peers raise in
    their loop, the receiver's generator close cannot raise (Python would print "Exception
    ignored"), so the Stream's next call fails on every rank naming it; the one after works."""
    import sys

    errs, unraisable, msgs = [], [], []
    last = len(s.buckets) - 1
    move = s.mover._move
    if rank == 0:

        def refusing(bucket, src, dst, checks, *args):
            return move(
                bucket, src, dst, [*checks, _refuse] if bucket.index == last else checks, *args
            )

        s.mover._move = refusing
    hook, sys.unraisablehook = sys.unraisablehook, unraisable.append
    try:
        for call in range(2):
            try:
                for _ in s(bufs):
                    if rank == 0 and call == 0:
                        break
            except rs.PreflightError as exc:
                msgs.append(str(exc))
            s.mover._move = move
    finally:
        sys.unraisablehook = hook
    if unraisable:
        errs.append(f"rank {rank}: printed {[str(u.exc_value) for u in unraisable]}")
    expect = (
        [["stopped early", "injected"]]
        if rank == 0
        else [["injected"], ["stopped early", "injected"]]
    )
    if len(msgs) != len(expect) or any(w not in m for m, ws in zip(msgs, expect) for w in ws):
        errs.append(f"rank {rank}: expected PreflightErrors with {expect}, got {msgs}")
    errs += consume(s, bufs, want, rank == 0, f"rank {rank} after the failed early stop")
    return errs


class _Hooked:
    """A buffer set whose readiness hook runs `hook`."""

    def __init__(self, buffers, hook):
        self.buffers, self.hook = buffers, hook

    def check(self):
        self.hook()


def _group_is_held(rank, s, layout, bufs, values):
    """A Stream call holds its group from its first tensor to its end: a Stream or Transfer on
    the group from inside it on the same thread (a readiness hook, a call left unfinished)
    raises at once instead of waiting for itself, and identical Streams iterated from two
    threads never pair their collectives with each other's."""
    import threading

    errs = []
    want = {n: v.to(torch.bfloat16) for n, v in values.items()}
    other = rs.Stream(layout, [0], 4096, dtype=torch.bfloat16)
    sync = rs.Transfer(layout, layout)
    dst = {loc: torch.empty_like(b) for loc, b in bufs.items()}
    inside = "iterated inside another call on the same process group"
    cases = [  # (what, call, expected message)
        (
            "a Stream in a Transfer's hook",
            lambda: sync(_Hooked(bufs, lambda: list(s(bufs))), dst),
            inside,
        ),
        (
            "a Stream in a Stream's hook",
            lambda: list(s(_Hooked(bufs, lambda: list(other(bufs))))),
            inside,
        ),
        (
            "a Transfer in a Stream's hook",
            lambda: list(s(_Hooked(bufs, lambda: sync(bufs, dst)))),
            "where an rs.Stream iteration (until its loop ends or it is closed) holds",
        ),
    ]
    for what, call, match in cases:
        try:
            call()
            errs.append(f"rank {rank}: {what} did not raise")
        except rs.PreflightError as exc:  # the hook's error, on every rank
            if match not in str(exc):
                errs.append(f"rank {rank}: {what}: {exc}")
    # a call left unfinished holds the group: a Transfer on it raises on that rank, before
    # any collective; closing the call moves the rest (a sender's call yields nothing: it ran
    # to its end)
    it = s(bufs)
    next(it, None)
    if rank == 0:
        try:
            sync(bufs, dst)
            errs.append(f"rank {rank}: a Transfer during an unfinished Stream call ran")
        except RuntimeError as exc:  # names what holds the group
            if "where an rs.Stream iteration (until its loop ends" not in str(exc):
                errs.append(f"rank {rank}: Transfer during an unfinished Stream call: {exc}")
    it.close()
    dist.barrier()
    # two identical Streams from two threads, each over its own sources, the second started
    # while the first is iterated: each gets its own values
    twins = [rs.Stream(layout, [0], 1024, dtype=torch.bfloat16) for _ in range(2)]
    vals = [values, {n: v * 3 - 1 for n, v in values.items()}]
    srcs = [zero3_source(dist.get_world_size(), v, rank)[1] for v in vals]
    started = threading.Event()
    results = [[], []]

    def run(i):
        try:
            for n, t in twins[i](srcs[i]):
                started.set()
                time.sleep(0.005)
                ok = _same(t, vals[i][n].to(torch.bfloat16))
                results[i].append(n if ok else f"{n} differs")
        except Exception as exc:  # noqa: BLE001 - reported
            results[i].append(repr(exc))
        started.set()

    first = threading.Thread(target=run, args=(0,))
    first.start()
    started.wait(60)
    second = threading.Thread(target=run, args=(1,))
    second.start()
    first.join(120)
    second.join(120)
    expect = list(values) if rank == 0 else []
    if results != [expect, expect]:
        errs.append(f"rank {rank}: two threads' Streams got {results}")
    errs += consume(s, bufs, want, rank == 0, f"rank {rank} after the group checks")
    return errs


def _resolved_per_call(rank, local, bufs, values):
    """`local` was built without a process group (rank 0 of 1) and pickled: its group=None is
    the default group at each call, so here it streams over the ranks; an explicit group is
    not pickled."""
    import pickle

    errs = []
    want = {n: v.to(torch.bfloat16) for n, v in values.items()}
    s = pickle.loads(pickle.dumps(local))
    errs += consume(s, bufs, want, rank == 0, f"rank {rank} unpickled, built without a group")
    if (s.rank, s.world_size, s.backend) != (rank, dist.get_world_size(), "gloo"):
        errs.append(f"rank {rank}: resolved {(s.rank, s.world_size, s.backend)}")
    copy = pickle.loads(pickle.dumps(s))  # used: pickles without its runtime state
    errs += consume(copy, bufs, want, rank == 0, f"rank {rank} unpickled after use")
    try:
        pickle.dumps(rs.Stream(s.src_layout, [0], 1024, torch.bfloat16, group=dist.group.WORLD))
        errs.append(f"rank {rank}: a Stream on an explicit group pickled")
    except TypeError as exc:
        if "explicit process group cannot be pickled" not in str(exc):
            errs.append(f"rank {rank}: pickling a Stream on a group: {exc}")
    return errs


class _Injected(Exception):
    pass


def w_throw_on_one_rank(rank, world):
    """Receiver rank 2 throws an exception into its generator (`gen.throw`) at its second
    tensor; the other receiver and the sender-only rank finish normally, promptly, with the
    right tensors, and rank 2 gets its own exception. The next call is complete everywhere."""
    values = full_values(seed=5)
    layout, bufs = zero3_source(world, values, rank)
    s = rs.Stream(layout, [0, 2], 1024, dtype=torch.bfloat16, timeout=60)
    want = {n: values[n].to(torch.bfloat16) for n in values}
    errs = []
    t0 = time.perf_counter()
    if rank == 2:
        gen = s(bufs)
        next(gen)
        next(gen)
        try:
            gen.throw(_Injected("thrown into rank 2's generator"))
            errs.append("rank 2: throw() did not raise")
        except _Injected:
            pass
        except Exception as exc:  # noqa: BLE001 - reported
            errs.append(f"rank 2: throw() raised {type(exc).__name__}: {exc}")
    else:
        errs += consume(s, bufs, want, rank == 0, f"rank {rank} while rank 2 throws")
    if time.perf_counter() - t0 > 30:
        errs.append(f"rank {rank}: the call took {time.perf_counter() - t0:.0f} s")
    errs += consume(s, bufs, want, rank in (0, 2), f"rank {rank} after the throw")
    dist.barrier()
    return errs


def w_interrupted_hook(rank, world, raiser):
    """The source object's readiness hook (`.check`) raises `raiser` once on one rank (the
    sender-only rank 1, then the receiver rank 0): every rank's call must end promptly in
    bucket 0's preflight, nothing yielded, the peers with a PreflightError naming the
    interrupt and the interrupted rank with the interrupt, that same PreflightError as its
    context. Then a good call is complete everywhere."""
    error = {"KeyboardInterrupt": KeyboardInterrupt, "SystemExit": SystemExit}[raiser]
    values = full_values(seed=6)
    layout, bufs = zero3_source(world, values, rank)
    s = rs.Stream(layout, [0], 1024, dtype=torch.bfloat16, timeout=60)
    want = {n: v.to(torch.bfloat16) for n, v in values.items()}
    errs, msgs = [], []
    for bad in (1, 0):
        pending = [rank == bad]

        def hook(pending=pending, bad=bad):
            if pending[0]:
                pending[0] = False
                raise error(f"interrupted in rank {bad}'s readiness hook")

        got, outcome, msg = [], "no error", ""
        t0 = time.perf_counter()
        try:
            for name, _ in s(_Live(bufs, check=hook)):
                got.append(name)
        except BaseException as exc:  # noqa: BLE001 - KeyboardInterrupt too: judged here
            outcome = type(exc).__name__
            refusal = exc if rank != bad else exc.__context__
            msg = str(refusal) if isinstance(refusal, rs.PreflightError) else repr(refusal)
        expect = raiser if rank == bad else "PreflightError"
        if outcome != expect:
            errs.append(f"rank {rank} (rank {bad} interrupted): got {outcome} {msg!r}")
        if f"rank {bad}: {raiser} on this rank during its preflight" not in msg:
            errs.append(f"rank {rank}: the error does not name rank {bad}'s interrupt: {msg!r}")
        if got:
            errs.append(f"rank {rank}: yielded {got} before the error")
        if time.perf_counter() - t0 > 20:
            errs.append(f"rank {rank}: the call took {time.perf_counter() - t0:.0f} s")
        msgs.append(msg)
        errs += consume(s, bufs, want, rank == 0, f"rank {rank} after rank {bad}'s interrupt")
    dist.barrier()
    return errs, msgs


def w_crossed_kinds(rank, world):
    """Two Streams of one plan move two states (exp_avg and exp_avg_sq of one model: the same
    layout), iterated in crossed order on the two ranks: each call pairs one rank's exp_avg
    with the other's exp_avg_sq. Both must raise the same PreflightError naming both kinds,
    nothing yielded, instead of swapping the states; then, in one order, each is complete."""
    kinds = ["exp_avg", "exp_avg_sq"]
    values = {k: full_values(seed=7 + i) for i, k in enumerate(kinds)}
    sources = {k: zero3_source(world, values[k], rank) for k in kinds}
    layout = sources[kinds[0]][0]
    streams = {k: rs.Stream(layout, [0], 1024, dtype=torch.bfloat16, timeout=60) for k in kinds}
    errs, msgs = [], []
    for k in kinds if rank == 0 else kinds[::-1]:
        got, msg = [], None
        try:
            for name, _ in streams[k](_Live(sources[k][1], kind=k)):
                got.append(name)
        except rs.PreflightError as exc:
            msg = str(exc)
        if msg is None or any(repr(kind) not in msg for kind in kinds):
            errs.append(f"rank {rank}: expected a PreflightError naming both kinds, got {msg!r}")
        if got:
            errs.append(f"rank {rank}: yielded {got} before the error ({k})")
        msgs.append(msg)
    for k in kinds:
        want = {n: v.to(torch.bfloat16) for n, v in values[k].items()}
        src = _Live(sources[k][1], kind=k)
        errs += consume(streams[k], src, want, rank == 0, f"rank {rank} {k} after the refusals")
    dist.barrier()
    return errs, msgs


def w_device_misfit(rank, world):
    """Rank 1 asks for a CUDA device its process does not have (a receiver, then a rank that
    only sends): every rank's first call raises the same PreflightError naming rank 1 and the
    device, promptly, nothing yielded; then a Stream on a device that fits is complete."""
    values = full_values(seed=8)
    layout, bufs = zero3_source(world, values, rank)
    errs, msgs = [], []
    for receivers in ([0, 1], [0]):
        device = "cuda:1" if rank == 1 else "cpu"
        got, msg = [], None
        t0 = time.perf_counter()
        try:
            s = rs.Stream(layout, receivers, 1024, dtype=torch.bfloat16, device=device, timeout=30)
            for name, _ in s(bufs):
                got.append(name)
        except Exception as exc:  # noqa: BLE001 - a ValueError on rank 1 alone is the bug
            msg = f"{type(exc).__name__}: {exc}"
        secs = time.perf_counter() - t0
        tag = f"rank {rank} receivers {receivers}"
        want = "PreflightError: preflight failed on 1 of 2 ranks (1)"
        if msg is None or not msg.startswith(want) or "rank 1: device cuda:1" not in msg:
            errs.append(f"{tag}: expected a PreflightError naming rank 1's device, got {msg!r}")
        if got:
            errs.append(f"{tag}: yielded {got} before the error")
        if secs > 20:
            errs.append(f"{tag}: the refusal took {secs:.0f} s")
        msgs.append(msg)
    s = rs.Stream(layout, [0, 1], 1024, dtype=torch.bfloat16, device="cpu")
    want = {n: v.to(torch.bfloat16) for n, v in values.items()}
    errs += consume(s, bufs, want, True, f"rank {rank} after the refusals")
    dist.barrier()
    return errs, msgs
