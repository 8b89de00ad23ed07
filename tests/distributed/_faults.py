"""Faults injected on one rank, shared by the gloo workers (_workers.py) and the NCCL workers
(tests/gpu/multi/_nccl_workers.py): the same bad inputs on CPU and on GPUs.

`break_inputs` makes one rank's call wrong in one way; the test then checks that every rank
raises the same PreflightError naming that rank and that no target byte changed.
`die_in_rounds` makes a rank die (or stall) in the middle of the rounds, after a few copies.
`arrive_late` runs a call with the last rank arriving only after its peers gave up.
"""

from __future__ import annotations

import os
import time

import torch

import reshard as rs

# kinds every transport can check ("wrong_gpu" needs two GPUs, "alias_targets" a real device
# placement of its own; the gloo workers add the executor-specific "oom" and "device")
PREFLIGHT_KINDS = (
    "dtype",
    "short",
    "foreign",
    "missing",
    "alias",
    "alias_targets",
    "fingerprint",
    "notready",
    "negview",
)


def _not_ready():
    raise rs.NotReadyError("exp_avg does not exist before the first step")


def break_inputs(kind, rank, world, src, sb, db, plan, other_plan):
    """Make this rank's call wrong in the way `kind` names, in place on `sb` / `db` (this rank's
    source and target buffers; `src` is the source side). Returns (plan, checks) to call with.
    Raises KeyError for a kind it does not know."""
    sloc = next(iter(sb))
    checks = ()
    if kind == "dtype":
        sb[sloc] = sb[sloc].to(torch.float16)
    elif kind == "short":
        sb[sloc] = sb[sloc][:-1]
    elif kind == "foreign":  # a location owned by the next rank
        peer = (rank + 1) % world
        loc = next(loc for loc, s in src.storages.items() if s.rank == peer)
        sb[loc] = torch.zeros(src.storages[loc].numel, device=sb[sloc].device)
    elif kind == "missing":
        del sb[sloc]
    elif kind == "alias":  # the largest target is a view of a source's memory
        dloc = max(db, key=lambda k: db[k].numel())
        if sb[sloc].device != db[dloc].device:  # cannot alias across devices
            sb[sloc] = sb[sloc].to(db[dloc].device)
        db[dloc] = sb[sloc].view(torch.bfloat16)[: db[dloc].numel()]
    elif kind == "alias_targets":  # two targets share memory
        big = max(db, key=lambda k: db[k].numel())
        small = min(db, key=lambda k: db[k].numel())
        db[small] = db[big][: db[small].numel()]
    elif kind == "fingerprint":
        plan = other_plan
    elif kind == "notready":
        checks = (_not_ready,)
    elif kind == "negview":  # a lazily negated view (the ops refuse it)
        dloc = max(db, key=lambda k: db[k].numel())
        db[dloc] = torch._neg_view(db[dloc])
    elif kind == "wrong_gpu":  # a buffer on the other rank's GPU
        sb[sloc] = sb[sloc].to(torch.device("cuda", (torch.cuda.current_device() + 1) % 2))
    else:
        raise KeyError(f"unknown fault {kind!r}")
    return plan, checks


def die_in_rounds(mode, timeout, after_copies=5):
    """From now on this rank dies (mode "die") or stalls for twice `timeout` (mode "stall") at
    its `after_copies`-th packing copy, with rounds posted to its peers."""
    import reshard.executor as ex
    from tests._spawn import die

    real = ex._copy_runs_op()
    calls = [0]

    def dying(s, d, o):
        calls[0] += 1
        if calls[0] == after_copies:
            if mode == "die":
                die()
            time.sleep(timeout * 2)
        return real(s, d, o)

    ex._copy_runs_op = lambda: dying


def die_in_posts(mode, timeout, after_posts=3):
    """From now on this rank dies (mode "die") or stalls for twice `timeout` (mode "stall")
    when it is about to post its `after_posts`-th round, earlier rounds posted to its peers
    (for transfers whose messages go straight between buffers: no packing copy to hook)."""
    import reshard.executor as ex
    from tests._spawn import die

    real = ex._RoundLoop.start
    calls = [0]

    def dying(self, rnd, flight):
        calls[0] += 1
        if calls[0] == after_posts:
            if mode == "die":
                die()
            time.sleep(timeout * 2)
        return real(self, rnd, flight)

    ex._RoundLoop.start = dying


def arrive_late(rank, world, marker_dir, call):
    """Run `call()` with the last rank entering only after every other rank's call returned
    (they give up waiting for it); the others stay in the group until the late rank is done.
    Returns ("ok", "") or (exception type name, message)."""
    late = world - 1
    gave_up = [os.path.join(marker_dir, f"gave_up{r}") for r in range(late)]
    done = os.path.join(marker_dir, "late_done")
    if rank == late:
        while not all(os.path.exists(f) for f in gave_up):
            time.sleep(0.05)
    try:
        call()
        outcome = ("ok", "")
    except Exception as exc:  # noqa: BLE001 - the parent judges the type
        outcome = (type(exc).__name__, str(exc))
    if rank != late:
        open(gave_up[rank], "w").close()
        while not os.path.exists(done):
            time.sleep(0.05)
    else:
        open(done, "w").close()
    return outcome


def assert_late_rank_wrote_nothing(results):
    """results[rank] = (outcome, touched targets, the late rank has local copies[, what went
    wrong in the calls after it])."""
    assert results[-1][2], "the late rank has no local copies: it would not write at once"
    for rank, (outcome, touched, _, *after) in enumerate(results):
        assert outcome[0] == "PreflightError", (rank, outcome)
        assert "nothing was written" in outcome[1], (rank, outcome)
        assert not touched, (rank, touched[:5])
        assert not (after and after[0]), (rank, after)


def interrupt_after_agreement(raiser, where):
    """From now on this rank's next transfer call raises `raiser` (an exception class) once its
    preflight has agreed with its peers, before its rounds start: as a signal's handler would,
    at `where` ("preflight": as the preflight returns; "report": as the executor begins the
    call's Report)."""
    import reshard.executor as ex
    from reshard import preflight as pf

    if where == "preflight":
        real = pf.run

        def agreed_then_interrupted(*args, **kwargs):
            real(*args, **kwargs)
            pf.run = real
            raise raiser(f"interrupted after the agreement ({where})")

        pf.run = agreed_then_interrupted
    elif where == "report":
        real_report = ex.Report

        def interrupted_report(*args, **kwargs):
            ex.Report = real_report
            raise raiser(f"interrupted after the agreement ({where})")

        ex.Report = interrupted_report
    else:
        raise KeyError(f"unknown point {where!r}")
