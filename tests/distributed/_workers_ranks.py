"""Workers of test_rank_faults.py: faults only one rank sees (a plan that fails there, an
interrupt in its readiness hook or in its exchange, a read-only target: test_hostile_ranks.py)
and ranks that call different things on one group. Each returns plain data (never asserts);
the parent compares ranks.

Module level and light imports: spawned ranks re-import this module.
"""

from __future__ import annotations

import os
import time
import warnings

import _faults as F
import _scenarios as S
import numpy as np
import torch

import reshard as rs
from reshard import preflight as pf

TIMEOUT = 120.0  # far beyond what any refusal here may take: waiting it out fails the test


def _sides(world, drop=None):
    """ZeRO-3 fp32 sources -> TP fp32 targets over every rank; `drop`: a tensor the source
    layout leaves out (as FSDP2 leaves out a parameter without optimizer state)."""
    shapes = S.model_shapes()
    ranks = list(range(world))
    kept = {n: s for n, s in shapes.items() if n != drop}
    src = S.Zero3(kept, ranks, dtype=torch.float32, loc0=0)
    dst = S.TensorParallel(shapes, [ranks], dtype=torch.float32, loc0=1000)
    return src, dst, S.model_values(shapes)


class _Noted:
    """A buffers object with the `notes` an integration's describe() keeps."""

    def __init__(self, buffers, notes):
        self.buffers, self.notes = buffers, notes


def _outcome(call, db):
    """(error type or "ok", message, seconds, whether a target byte changed)."""
    before = {k: v.clone() for k, v in db.items()}
    t0 = time.monotonic()
    try:
        call()
        kind, msg = "ok", ""
    except BaseException as exc:  # noqa: BLE001 - KeyboardInterrupt too: the parent judges it
        kind, msg = type(exc).__name__, str(exc)
    return kind, msg, time.monotonic() - t0, bool(S.mismatches(db, before))


def _good_call(rank, world):
    """What a correct transfer on the group gets wrong (it must still be usable)."""
    src, dst, values = _sides(world)
    db = dst.empty(rank)
    rs.Transfer(src.layout(), dst.layout(), 64, timeout=TIMEOUT)(
        S.source_buffers(src, values, rank), db
    )
    return S.mismatches(db, dst.fill(values, rank))


def _build(src_layout, dst_layout, **kw):
    """(rs.Transfer, None), or Transfer.refusing with the error its construction raised
    here (and that error's text): what a caller does where layouts come from each rank's
    own state."""
    try:
        return rs.Transfer(src_layout, dst_layout, timeout=TIMEOUT, **kw), None
    except rs.LayoutError as exc:
        return rs.Transfer.refusing(exc, timeout=TIMEOUT), str(exc)


def w_plan_fails(rank, world, bad_ranks):
    """Planning fails on `bad_ranks` (their source layout lacks a tensor the target names):
    [(construction error or None, outcome of call 1, of call 2), what a good call after gets
    wrong]."""
    name = sorted(S.model_shapes())[0]
    bad = rank in bad_ranks
    src, dst, values = _sides(world, drop=name if bad else None)
    sync, built = _build(src.layout(), dst.layout(), budget_bytes_per_peer=64)
    notes = [f"{name!r} left out: no optimizer state for it on this rank"] if bad else []
    outcomes = []
    for _ in range(2):  # a refusing Transfer refuses every call, with its peers
        db = dst.empty(rank)
        sb = _Noted(S.source_buffers(src, {n: values[n] for n in src.shapes}, rank), notes)
        outcomes.append(_outcome(lambda sb=sb, db=db: sync(sb, db), db))
    return [built, *outcomes], _good_call(rank, world)


class _Live:
    def __init__(self, buffers, hook):
        self.buffers, self._hook = buffers, hook

    def check(self):
        self._hook()


def w_interrupted_hook(rank, world, raiser):
    """Rank 1's readiness hook (`.check`), then its `checks=`, raise `raiser`; then a clean
    call on the same Transfer. Per call: the outcome and what the targets get wrong."""
    error = {"KeyboardInterrupt": KeyboardInterrupt, "SystemExit": SystemExit}[raiser]

    def hook():
        if rank == 1:
            raise error("interrupted in a readiness hook")

    src, dst, values = _sides(world)
    sync = rs.Transfer(src.layout(), dst.layout(), 64, timeout=TIMEOUT)
    sb = S.source_buffers(src, values, rank)
    calls = (
        lambda db: sync(_Live(sb, hook), db),
        lambda db: sync(sb, db, checks=(hook,)),
        lambda db: sync(sb, db),
    )
    out = []
    for call in calls:
        db = dst.empty(rank)
        kind, msg, secs, _ = _outcome(lambda call=call, db=db: call(db), db)
        out.append((kind, msg, secs, S.mismatches(db, dst.fill(values, rank))))
    return out


def w_interrupted_exchange(rank, world, timeout):
    """Rank 0's check fails, so the preflight gathers the reasons; rank 1 is interrupted as it
    starts that gather. Then each rank calls again. [(outcome, message, seconds)] per call."""
    src, dst, values = _sides(world)
    sync = rs.Transfer(src.layout(), dst.layout(), 64, timeout=timeout)
    sb = S.source_buffers(src, values, rank)
    real = pf._all_gather_bytes

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt("interrupted in the exchange")

    def veto():
        raise ValueError("not ready on rank 0")

    if rank == 1:
        pf._all_gather_bytes = interrupted
    out = []
    try:
        for checks in ((veto,) if rank == 0 else (), ()):
            db = dst.empty(rank)
            kind, msg, secs, touched = _outcome(lambda c=checks, db=db: sync(sb, db, checks=c), db)
            out.append((kind, msg, secs, touched))
    finally:
        pf._all_gather_bytes = real
    return out


def w_mixed_calls(rank, world):
    """Rank 0 calls a Transfer while rank 1 calls rs.execute of another plan, a Stream, or
    Transfer.refusing; then both call the Transfer. Per pair: (outcome, message, touched)."""
    src, dst, values = _sides(world)
    sync = rs.Transfer(src.layout(), dst.layout(), 64, timeout=TIMEOUT)
    other = rs.plan(src.layout(), dst.layout(), budget_bytes_per_peer=96)
    stream = rs.Stream(src.layout(), receivers=[0], bucket_bytes=1 << 10, timeout=TIMEOUT)
    refusing = rs.Transfer.refusing("no Transfer here", timeout=TIMEOUT)
    sb = S.source_buffers(src, values, rank)
    peer_calls = {
        "execute": lambda db: rs.execute(other, sb, db, timeout=TIMEOUT),
        "stream": lambda db: [n for n, _ in stream(sb)],
        "refusing": lambda db: refusing(sb, db),
        "same": lambda db: sync(sb, db),
    }
    out = {}
    for what, peer_call in peer_calls.items():
        db = dst.empty(rank)
        call = (lambda db=db: sync(sb, db)) if rank == 0 else (lambda c=peer_call, db=db: c(db))
        kind, msg, _, touched = _outcome(call, db)
        wrong = S.mismatches(db, dst.fill(values, rank)) if kind == "ok" else []
        out[what] = (kind, msg, touched, wrong)
    return out


def w_source_as_target(rank, world):
    """The same tensors passed as sources and as targets (a local copy onto itself; a target
    written from a peer that is this rank's source): refused on every rank, no source byte
    changed. Per case: (outcome, message, what changed in the sources)."""
    shapes = S.model_shapes()
    values = S.model_values(shapes)
    ranks = list(range(world))
    src = S.Zero3(shapes, ranks, dtype=torch.float32, loc0=0)
    out = []
    for order in (ranks, ranks[::-1]):  # the same rank's partition (local), the peer's
        dst = S.Zero3(shapes, order, dtype=torch.float32, loc0=1000)
        sync = rs.Transfer(src.layout(), dst.layout(), 64, timeout=TIMEOUT)
        sb = S.source_buffers(src, values, rank)
        before = {k: v.clone() for k, v in sb.items()}
        db = dict(zip(dst.locations(rank), (sb[k] for k in src.locations(rank)), strict=True))
        kind, msg, _, _ = _outcome(lambda sync=sync, sb=sb, db=db: sync(sb, db), db)
        out.append((kind, msg, S.mismatches(sb, before)))
    return out


def w_read_only_target(rank, world, tmp_dir):
    """Rank 1's first target location is a numpy memmap opened read-only (a write there kills
    the process). Per rank: (outcome, message, whether a target byte changed, that location,
    what a clean call on the group gets wrong after)."""
    src, dst, values = _sides(world)
    db = dst.empty(rank)
    loc = dst.locations(1)[0]
    if rank == 1:
        path = os.path.join(tmp_dir, "rank1_target.bin")
        np.memmap(path, np.float32, "w+", shape=tuple(db[loc].shape))[:] = S.POISON
        with warnings.catch_warnings():  # torch warns that it cannot protect the array
            warnings.simplefilter("ignore", UserWarning)
            db[loc] = torch.from_numpy(np.memmap(path, np.float32, "r"))
    sync = rs.Transfer(src.layout(), dst.layout(), 64, timeout=TIMEOUT)
    sb = S.source_buffers(src, values, rank)
    kind, msg, _, touched = _outcome(lambda: sync(sb, db), db)
    return kind, msg, touched, loc, _good_call(rank, world)


def w_fsdp_state_lost(rank, world):
    """Real FSDP2: rank 1's optimizer lost fc2.weight's state, so its exp_avg layout leaves
    fc2.weight out, and a target built before (naming it) cannot be planned there. With
    Transfer.refusing every rank raises the same PreflightError (rank 1's LayoutError and its
    notes), the poisoned targets stay NaN; with the state back, the same target is the
    reference. Returns (construction errors, the refusal, what the good sync gets wrong)."""
    import pathlib
    import sys

    here = pathlib.Path(__file__).resolve().parent
    sys.path[:0] = [str(here.parent / "fsdp"), str(here.parent / "deepspeed")]
    from _dsutil import replicated_targets
    from _fsdputil import full_moments, make_fsdp, train
    from torch.distributed.device_mesh import init_device_mesh

    from reshard.integrations import fsdp as rsfsdp

    net, opt = make_fsdp(init_device_mesh("cpu", (world,)), seed=3)
    train(net, opt, 1, seed=3, rank=rank)
    # the target, built while every rank held every moment (as a rollout's would be)
    target, bufs = replicated_targets(rsfsdp.describe(net, "exp_avg", opt), list(range(world)))
    saved = dict(opt.state[net.fc2.weight])
    if rank == 1:
        del opt.state[net.fc2.weight]
    live = rsfsdp.describe(net, "exp_avg", opt)
    sync, built = _build(live.layout, target)
    kind, msg, secs, _ = _outcome(lambda: sync(live, bufs), bufs)
    poisoned = all(bool(b.isnan().all()) for b in bufs.values())
    opt.state[net.fc2.weight] = saved
    live = rsfsdp.describe(net, "exp_avg", opt)
    rs.Transfer(live.layout, target, timeout=TIMEOUT)(live, bufs)
    want = full_moments(net, opt, "exp_avg")
    wrong = [
        f"{name}: differs at location {loc}"
        for i, name in enumerate(sorted(target.tensors))
        for j in range(world)
        if (loc := i * world + j) in bufs and not torch.equal(bufs[loc], want[name].flatten())
    ]
    return built, (kind, msg, secs, poisoned), wrong


def w_late_with_a_longer_timeout(rank, world, marker_dir):
    """The last rank, whose timeout is long, enters only after its peers' short waits ran out:
    it must refuse at once (its peers gave up: no commit can come), not wait out its own
    timeout. (outcome, seconds of the late rank's call, whether a target changed)."""
    src, dst, values = _sides(world)
    plan = rs.plan(src.layout(), dst.layout(), budget_bytes_per_peer=64)
    timeout = TIMEOUT if rank == world - 1 else 2.0
    db = dst.empty(rank)
    before = {k: v.clone() for k, v in db.items()}
    sb = S.source_buffers(src, values, rank)
    t0 = []

    def call():
        t0.append(time.monotonic())
        rs.execute(plan, sb, db, timeout=timeout)

    outcome = F.arrive_late(rank, world, marker_dir, call)
    return outcome, time.monotonic() - t0[0], bool(S.mismatches(db, before))


class _State:
    """A buffers object that says which state it holds, as a DeepSpeed LiveState's `kind`."""

    def __init__(self, buffers, kind):
        self.buffers, self.kind = buffers, kind


def w_calls_out_of_order(rank, world):
    """Two Transfers of one plan (the same layouts: exp_avg and exp_avg_sq of one model) move
    two states; rank 1 skips the first. Its exp_avg_sq call pairs with rank 0's exp_avg call:
    both must refuse, naming the kinds, instead of swapping the states. Then the calls pair
    up again. Per call: (outcome, message, what the targets got wrong or touched)."""
    src, dst, _ = _sides(world)
    states = {"exp_avg": S.model_values(S.model_shapes(), seed=1)}
    states["exp_avg_sq"] = S.model_values(S.model_shapes(), seed=2)
    syncs = {k: rs.Transfer(src.layout(), dst.layout(), 64, timeout=TIMEOUT) for k in states}
    order = ["exp_avg", "exp_avg_sq"] if rank == 0 else ["exp_avg_sq", "exp_avg_sq"]
    out = []
    for kind in order:
        db = dst.empty(rank)
        sb = _State(S.source_buffers(src, states[kind], rank), kind)
        got, msg, _, touched = _outcome(lambda k=kind, sb=sb, db=db: syncs[k](sb, db), db)
        wrong = S.mismatches(db, dst.fill(states[kind], rank)) if got == "ok" else touched
        out.append((got, msg, wrong))
    return out
