"""Hostile input in one process (no process group): random layouts, dtypes and budgets with
one corruption of the buffers, the arguments, the timeout or the schedule. A refused call
writes no byte; a clean one gives exactly the reference; nothing else is raised. The same
cases run on spawned gloo ranks in tests/distributed/test_hostile_ranks.py.

Also the focused checks of what preflight refuses on its own: element types the C core does
not copy, descriptor arithmetic, storages smaller than their views, timeouts, targets that
require grad, concurrent and reentrant calls.
"""

from __future__ import annotations

import ctypes
import gc
import math
import mmap
import os
import re
import sys
import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "distributed"))

import _memmaps as memmaps  # noqa: E402
import _refplan  # noqa: E402
import _scenarios as S  # noqa: E402
import _workers as W  # noqa: E402

import reshard as rs  # noqa: E402
from reshard import preflight as pf  # noqa: E402


@settings(max_examples=250)
@given(seed=st.integers(0, 2**32 - 1))
def test_property_hostile_input_in_process(seed):
    errs, kind, outcome = W.run_hostile_case(seed, 0, 1)
    assert not errs, "\n".join(errs[:10])


def test_hostile_cases_cover_every_corruption():
    """The property test's draws reach every corruption, applied, and both outcomes."""
    applied = {}
    for seed in range(400):
        _, kind, (outcome, was_applied) = W.run_hostile_case(seed, 0, 1)
        if was_applied:
            applied.setdefault(kind, set()).add(outcome)
    missing = set(W.CORRUPTIONS) - {"none"} - set(applied)
    assert not missing, f"never applied: {sorted(missing)}"
    assert all("preflight" in v for k, v in applied.items() if k != "desc"), applied


# ------------------------------------------------------------------ element types


DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.complex128,
    torch.float8_e4m3fn,
]


@pytest.mark.parametrize("src", DTYPES)
@pytest.mark.parametrize("dst", DTYPES)
def test_copy_support_matches_the_op(src, dst):
    """copy_support says None exactly when copy_runs copies the pair (checked by running the
    op on a few elements: same dtype bitwise, casts as torch's .to())."""
    import reshard._ops  # noqa: F401 - the op

    why = pf.copy_support(src, dst)
    a = (torch.arange(6) % 3).to(src)
    out = torch.zeros(6, dtype=dst)
    desc = torch.tensor([[0, 0, 0, 0, 6, 1]], dtype=torch.int64)
    try:
        torch.ops.reshard.copy_runs(a, desc, out)
        ran = True
    except RuntimeError:
        ran = False
    assert ran == (why is None), (src, dst, why)
    if why is None:
        assert torch.equal(
            out.view(torch.uint8) if src == dst else out,
            a.view(torch.uint8) if src == dst else a.to(dst),
        )
    else:
        assert (str(src) in why) and (src == dst or str(dst) in why)


def _one_rank(dtype=torch.float32, n=6):
    src = rs.Layout({"w": rs.flat((n,), [(0, 0, n, 0)])}, {0: rs.Storage(0, dtype, n)})
    dst = rs.Layout({"w": rs.flat((n,), [(10, 0, n, 0)])}, {10: rs.Storage(0, dtype, n)})
    return src, dst


def test_sixteen_byte_elements_are_refused_before_any_write():
    src, dst = _one_rank(torch.complex128)
    plan = _refplan.RefPlan(src, dst, 64)  # a planner that does not refuse them itself
    sb = {0: torch.arange(6.0).to(torch.complex128)}
    db = {10: torch.full((6,), 7 + 7j, dtype=torch.complex128)}
    with pytest.raises(rs.PreflightError, match="complex128 has 16-byte elements"):
        rs.execute(plan, sb, db)
    assert bool((db[10] == 7 + 7j).all())


# ------------------------------------------------------------------ descriptor arithmetic


def test_bad_rows_matches_brute_force():
    """_bad_rows against exact Python integers, on rows near every edge (int64 overflow)."""
    rng = np.random.default_rng(0)
    edges = [0, 1, 2, 3, 7, 1 << 31, (1 << 62) - 1, 1 << 62, (1 << 63) - 1, -1]
    rows = np.array([[rng.choice(edges) for _ in range(6)] for _ in range(4000)], np.int64)
    for numel in (0, 5, 1 << 40, (1 << 63) - 1):
        got = pf._bad_rows(rows, 0, numel)
        for row, g in zip(rows.tolist(), got.tolist(), strict=True):
            off, stride, _, _, length, count = row
            neg = min(off, stride, length, count) < 0  # this side's fields only
            active = length > 0 and count > 0
            want = neg or (active and off + (count - 1) * stride + length > numel)
            assert g == want, (row, numel)


@settings(max_examples=200)
@given(
    rows=st.lists(
        st.tuples(st.integers(0, 40), st.integers(0, 9), st.integers(0, 5), st.integers(0, 4)),
        max_size=12,
    )
)
def test_overlapping_writes_matches_brute_force(rows):
    desc = np.array([[0, 0, o, s, n, c] for o, s, n, c in rows], np.int64).reshape(-1, 6)
    hit = pf._overlapping_writes(desc, 2)
    seen, twice = set(), set()
    for _, _, o, s, n, c in desc.tolist():
        for k in range(c):
            for e in range(o + k * s, o + k * s + n):
                (twice if e in seen else seen).add(e)
    assert (hit is not None) == bool(twice), (rows, hit, twice)
    if hit is not None:
        assert hit[0] < hit[1] and set(range(*hit)) <= twice


def test_a_schedule_that_writes_an_element_twice_is_refused():
    src, dst = _one_rank()
    plan = rs.plan(src, dst)
    sched = plan.schedule(0)
    lc = sched.local[0]
    twice = np.array([[0, 0, 0, 0, 4, 1], [0, 0, 3, 0, 3, 1]], np.int64)
    bad = W._PlanWith(plan, 0, sched=type(sched)(0, 0, [type(lc)(0, 10, twice)], [], [], 0, 0))
    db = {10: torch.full((6,), S.POISON)}
    with pytest.raises(rs.PreflightError, match=r"writes elements \[3, 4\) twice"):
        rs.execute(bad, {0: torch.arange(6.0)}, db)
    assert bool((db[10] == S.POISON).all())


def test_local_copy_source_and_target_share_memory():
    """The target's unwritten padding overlaps the source: no written byte touches the
    source, but the copy op refuses overlapping extents, so preflight must refuse first."""
    f32 = torch.float32
    src = rs.Layout({"w": rs.flat((6,), [(0, 0, 6, 0)])}, {0: rs.Storage(0, f32, 6)})
    dst = rs.Layout({"w": rs.flat((6,), [(10, 0, 6, 2)])}, {10: rs.Storage(0, f32, 8)})
    plan = rs.plan(src, dst)
    base = torch.full((12,), S.POISON)
    base[:6] = torch.arange(6.0)
    sb, db = {0: base[:6]}, {10: base[4:]}  # target elements 0, 1 (padding) = source 4, 5
    before = base.clone()
    with pytest.raises(rs.PreflightError, match="shares memory with source location 0"):
        rs.execute(plan, sb, db)
    assert torch.equal(base, before)


# ------------------------------------------------------------------ storages


@pytest.mark.parametrize("side", ["source", "target"])
@pytest.mark.parametrize("how", ["freed", "shrunk", "offset"])
def test_storage_smaller_than_its_view_is_refused(side, how):
    src, dst = _one_rank(n=64)
    plan = rs.plan(src, dst)
    sb, db = {0: torch.arange(64.0)}, {10: torch.full((64,), S.POISON)}
    keep = db[10]
    t = (sb if side == "source" else db)[0 if side == "source" else 10]
    if how == "freed":
        t.untyped_storage().resize_(0)
    elif how == "shrunk":
        t.untyped_storage().resize_(100)
    else:  # a view at an offset of a storage that is then shrunk under it
        base = torch.zeros(128)
        view = base[64:]
        base.untyped_storage().resize_(300)
        (sb if side == "source" else db)[0 if side == "source" else 10] = view
    with pytest.raises(rs.PreflightError, match="its storage is freed|fewer than the"):
        rs.execute(plan, sb, db)
    if side == "source":
        assert bool((keep == S.POISON).all())


def _passed_once(n=6, target=None):
    """A Transfer whose first call passed, so the next may take the short path (every input
    of the per-buffer checks equal to that call's); its buffers, the target poisoned again."""
    src, dst = _one_rank(n=n)
    sync = rs.Transfer(src, dst)
    sb = {0: torch.arange(float(n))}
    db = {10: torch.full((n,), S.POISON) if target is None else target}
    sync(sb, db)
    assert sync._engine.verified_buffers is not None  # the short path is armed
    with torch.inference_mode(db[10].is_inference()):
        db[10].fill_(S.POISON)
    return sync, sb, db


def test_storage_reallocated_at_the_same_address_is_seen_on_a_repeated_call():
    """Freed and given fewer bytes, a storage often comes back at its old address (FSDP frees
    and reallocates storages in place): the same tensor, the same address, fewer bytes.
    Small sizes come back at their address by the heap's state; above glibc's largest mmap
    threshold (32 MiB) a storage is its own mapping, which the kernel mostly hands back at the
    same place, so the last two sizes keep the test from skipping after other tests churned
    the heap."""
    for n in (4096, 1024, 16384, 2048, 8192, 9 << 20, 10 << 20):
        sync, sb, db = _passed_once(n)
        st, before = sb[0].untyped_storage(), sb[0].data_ptr()
        st.resize_(0)
        st.resize_(4 * n - 4)
        if sb[0].data_ptr() == before:
            break
    else:
        pytest.skip("the allocator never returned the old address")
    with pytest.raises(rs.PreflightError, match="fewer than the"):
        sync(sb, db)
    assert bool((db[10] == S.POISON).all())


def test_target_moved_within_its_storage_onto_the_source_is_seen_on_a_repeated_call():
    """The same target tensor, moved one element down the storage it shares with the source
    (`.data =`: same storage, bytes, shape and strides, another address): it now overlaps the
    source, which the transfer would write."""
    n = 64
    base = torch.full((2 * n + 1,), S.POISON)
    base[:n] = torch.arange(float(n))
    src, dst = _one_rank(n=n)
    sync = rs.Transfer(src, dst)
    sb, db = {0: base[:n]}, {10: base[n + 1 :]}
    sync(sb, db)
    assert sync._engine.verified_buffers is not None
    db[10].data = base[n - 1 : 2 * n - 1]
    before = base.clone()
    with pytest.raises(rs.PreflightError, match="shares memory with source location 0"):
        sync(sb, db)
    assert torch.equal(base, before)


def test_leaving_inference_mode_is_seen_on_a_repeated_call():
    """Written in inference mode, then the same call under no_grad outside it: grad mode is
    off both times, only inference mode differs."""
    with torch.inference_mode():
        target = torch.full((6,), S.POISON)
        sync, sb, db = _passed_once(target=target)
    with torch.no_grad(), pytest.raises(rs.PreflightError, match="is an inference tensor"):
        sync(sb, db)
    assert bool((target == S.POISON).all())


# ------------------------------------------------------------------ read-only memory


def _mapped(path, mode, n=6, value=S.POISON):
    return memmaps.mapped(path, mode, n, value)


needs_memory_map = memmaps.needs_memory_map


@needs_memory_map
def test_a_target_in_read_only_memory_is_refused_before_any_write(tmp_path):
    """A target over a memmap opened read-only: the copy would write a PROT_READ page and
    kill the process (torch's own copy_ too); preflight names the location and the file."""
    src, dst = _one_rank()
    target = _mapped(tmp_path / "t.bin", "r")
    with pytest.raises(rs.PreflightError, match=r"target location 10: byte 0 of it is not "):
        rs.Transfer(src, dst)({0: torch.arange(6.0)}, {10: target})
    with pytest.raises(rs.PreflightError, match=r"read-only memory: mapped r--s from .*t\.bin"):
        rs.execute(rs.plan(src, dst), {0: torch.arange(6.0)}, {10: target})
    assert bool((target == S.POISON).all())


def test_copy_on_write_targets_and_read_only_sources_are_written_and_read(tmp_path):
    """A private writable mapping (memmap mode 'c') is written, its file not; a read-only
    source is only read."""
    src, dst = _one_rank()
    source = _mapped(tmp_path / "s.bin", "r", value=3.0)
    target = _mapped(tmp_path / "t.bin", "c")
    rs.Transfer(src, dst)({0: source}, {10: target})
    assert torch.equal(target, source)
    assert bool((_mapped(tmp_path / "t.bin", "r") == S.POISON).all())


@needs_memory_map
def test_a_target_partly_in_read_only_memory_names_its_first_unwritable_byte():
    """Every page of a target's bytes must be writable: the second of two pages is made
    read-only (mprotect) under one buffer."""
    page = mmap.PAGESIZE
    n = 2 * page // 4
    src, dst = _one_rank(n=n)
    sync = rs.Transfer(src, dst)
    mem = mmap.mmap(-1, 2 * page)
    target = torch.frombuffer(mem, dtype=torch.float32)
    target.fill_(S.POISON)
    memmaps.protect_read_only(target.data_ptr() + page, page)
    with pytest.raises(rs.PreflightError, match=f"byte {page} of it is not writable"):
        sync({0: torch.arange(float(n))}, {10: target})
    assert bool((target == S.POISON).all())


@needs_memory_map
def test_a_read_only_mapping_at_a_verified_targets_address_is_seen_on_a_repeated_call(tmp_path):
    """A target over a writable memmap passes; it is freed, and a read-only mapping of the
    same bytes takes its address: the same address, storage and size, so the repeated call's
    key equals the passing call's. The freed storage makes the call look again."""
    n = 4 * mmap.PAGESIZE
    path = tmp_path / "t.bin"
    sync, sb, db = _passed_once(n, _mapped(path, "r+", n))
    at = db.pop(10).data_ptr()
    gc.collect()  # the memmap, and with it the mapping, goes with its last tensor
    got = memmaps.map_read_only_at(path, at, 4 * n)
    try:
        if got != at:
            pytest.skip("the kernel did not map the file at the freed target's address")
        db[10] = torch.frombuffer((ctypes.c_char * (4 * n)).from_address(at), dtype=torch.float32)
        with pytest.raises(rs.PreflightError, match="byte 0 of it is not writable"):
            sync(sb, db)
        assert bool((db.pop(10) == S.POISON).all())
    finally:
        memmaps.libc().munmap(got, 4 * n)


def test_only_storages_from_elsewhere_are_looked_up_and_not_on_the_short_path(
    tmp_path, monkeypatch
):
    """Storages of torch's allocator are writable without a look; a storage from elsewhere is
    looked up on a call that checks its buffers, not on a repeated call's short path."""
    looked, real = [], pf._ops.unwritable_reason
    monkeypatch.setattr(pf._ops, "unwritable_reason", lambda t: looked.append(1) or real(t))
    src, dst = _one_rank()
    sync = rs.Transfer(src, dst)
    sb = {0: torch.arange(6.0)}
    for _ in range(3):
        sync(sb, {10: torch.empty(6)})
    assert not looked
    db = {10: _mapped(tmp_path / "t.bin", "r+")}
    for _ in range(3):
        sync(sb, db)
    assert len(looked) == 1
    assert torch.equal(db[10], sb[0])
    with torch.no_grad():  # another grad mode: the full checks run again
        sync(sb, db)
    assert len(looked) == 2


# ------------------------------------------------------------------ tensor kinds


def test_views_and_tensors_the_ops_cannot_copy_are_refused_before_any_write():
    src, dst = _one_rank(torch.complex64)
    sync = rs.Transfer(src, dst)
    sb = {0: torch.arange(6.0).to(torch.complex64)}
    target = torch.full((6,), 7 + 7j, dtype=torch.complex64)
    sync(sb, {10: target})  # a passing call: the next calls' buffers are compared with it
    assert torch.equal(target, sb[0])
    target.fill_(7 + 7j)
    for side, bad, why in [
        ("target", target.conj(), "lazily conjugated view"),
        ("source", sb[0].conj(), "lazily conjugated view"),
        ("target", torch._neg_view(target), "lazily negated view"),
    ]:
        call = (sb, {10: bad}) if side == "target" else ({0: bad}, {10: target})
        with pytest.raises(rs.PreflightError, match=f"{side} location .*: is a {why}"):
            sync(*call)
        assert bool((target == 7 + 7j).all())
    src, dst = _one_rank(torch.float32)
    plain = rs.Transfer(src, dst)
    with pytest.raises(rs.PreflightError, match="is a torch.sparse_coo tensor"):
        plain({0: torch.arange(6.0).to_sparse()}, {10: torch.zeros(6)})


# ------------------------------------------------------------------ timeouts


@pytest.mark.parametrize(
    "timeout,error",
    [
        (None, TypeError),
        ("30", TypeError),
        (True, TypeError),
        (float("nan"), ValueError),
        (float("inf"), ValueError),
        (0, ValueError),
        (-1.0, ValueError),
        (1e300, ValueError),
        (1e-4, ValueError),  # gloo counts whole milliseconds: 0 ms would mean no limit
        (10**400, ValueError),  # beyond float's range
        (np.float32(1.0), TypeError),
    ],
)
def test_bad_timeouts(timeout, error):
    src, dst = _one_rank()
    with pytest.raises(error, match="timeout must be"):
        rs.Transfer(src, dst, timeout=timeout)
    db = {10: torch.full((6,), S.POISON)}
    with pytest.raises(rs.PreflightError, match="timeout must be"):
        rs.execute(rs.plan(src, dst), {0: torch.arange(6.0)}, db, timeout=timeout)
    assert bool((db[10] == S.POISON).all())
    assert math.isfinite(rs.Transfer(src, dst, timeout=2).timeout)
    assert rs.Transfer(src, dst, timeout=pf.MIN_TIMEOUT_S).timeout == 0.001


# ------------------------------------------------------------------ arguments


def _refused(call, match, error=rs.PreflightError):
    """`call` raises `error` matching `match`, writes no target byte, and the message holds no
    raw Python error about reshard's internals."""
    db = {10: torch.full((6,), S.POISON)}
    with pytest.raises(error, match=match) as ei:
        call(db)
    assert bool((db[10] == S.POISON).all())
    assert "AttributeError" not in str(ei.value), ei.value
    return str(ei.value)


@pytest.mark.parametrize(
    "checks, match",
    [
        (5, "checks must be an iterable of callables, got int 5"),
        ("ready", "checks must be an iterable of callables, got str 'ready'"),
        (print, "checks must be an iterable of callables, got builtin_function_or_method"),
        ([print, 3], "checks\\[1\\] must be callable, got int 3"),
    ],
)
def test_bad_checks_are_a_clear_collective_type_error(checks, match):
    src, dst = _one_rank()
    sync = rs.Transfer(src, dst)
    sb = {0: torch.arange(6.0)}
    _refused(lambda db: rs.execute(rs.plan(src, dst), sb, db, checks=checks), "TypeError: " + match)
    _refused(lambda db: sync(sb, db, checks=checks), "TypeError: " + match)
    db = {10: torch.zeros(6)}
    sync(sb, db, checks=[lambda: None])
    assert torch.equal(db[10], sb[0])


def test_docs_name_checks_as_a_call_argument_only():
    """checks= belongs to a call (execute, Transfer.__call__), not to the constructor."""
    src, dst = _one_rank()
    with pytest.raises(TypeError, match="checks"):
        rs.Transfer(src, dst, checks=())


@pytest.mark.parametrize("kind", ["layout", "dict", "none"])
def test_execute_of_something_that_is_not_a_plan(kind):
    src, dst = _one_rank()
    thing = {"layout": src, "dict": {"src": src}, "none": None}[kind]
    name = type(thing).__name__
    sb = {0: torch.arange(6.0)}
    msg = _refused(lambda db: rs.execute(thing, sb, db), f"expected a Plan .*got {name}")
    assert msg.count("rank 0:") == 1, msg  # one reason, not one per missing attribute
    msg = _refused(lambda db: rs.Transfer.from_plan(thing)(sb, db), f"expected a Plan .*{name}")
    assert msg.count("rank 0:") == 1, msg


def test_a_transfer_is_not_pickled_and_says_what_to_pickle():
    import copy
    import pickle

    src, dst = _one_rank()
    sync = rs.Transfer(src, dst)
    for _ in range(2):  # unused, then used
        with pytest.raises(TypeError, match="cannot be pickled.*Transfer.from_plan"):
            pickle.dumps(sync)
        with pytest.raises(TypeError, match="cannot be pickled"):
            copy.deepcopy(sync)
        sync({0: torch.arange(6.0)}, {10: torch.zeros(6)})
    again = rs.Transfer.from_plan(pickle.loads(pickle.dumps(sync.plan)))
    db = {10: torch.zeros(6)}
    again({0: torch.arange(6.0)}, db)
    assert torch.equal(db[10], torch.arange(6.0))


def test_an_expanded_buffer_gets_only_the_right_reason():
    src, dst = _one_rank()
    for sb in ({0: torch.zeros(1).expand(6)}, {0: torch.zeros(12)[::2]}):
        msg = _refused(lambda db, sb=sb: rs.execute(rs.plan(src, dst), sb, db), "contiguous")
        assert "storage" not in msg, msg
    # a view whose storage really is too small is still named, strided or not
    t = torch.zeros(12)[::2]
    t.untyped_storage().resize_(16)
    msg = _refused(lambda db: rs.execute(rs.plan(src, dst), {0: t}, db), "contiguous")
    assert "fewer than the 44 its view needs" in msg, msg


def _wrapper_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.two_tensor import TwoTensor

    with FakeTensorMode():
        fake = torch.zeros(6)
    return {
        "TwoTensor": TwoTensor(torch.zeros(6), torch.zeros(6)),
        "FakeTensor": fake,
    }


@pytest.mark.parametrize("kind", ["TwoTensor", "FakeTensor", "nested"])
@pytest.mark.parametrize("side", ["source", "target"])
def test_tensors_without_plain_memory_are_named(kind, side):
    """Subclasses that dispatch their own ops and nested tensors are refused by what they are,
    not with torch's internal error or a storage that looks freed."""
    src, dst = _one_rank()
    if kind == "nested":
        t = torch.nested.nested_tensor([torch.zeros(6)])
        match = "is a nested tensor: reshard copies dense"
    else:
        t = _wrapper_tensors()[kind]
        match = f"is a {kind}, a tensor subclass with its own dispatch"
    if side == "source":
        msg = _refused(lambda db: rs.execute(rs.plan(src, dst), {0: t}, db), match)
    else:
        sb = {0: torch.arange(6.0)}
        with pytest.raises(rs.PreflightError, match=match) as ei:
            rs.execute(rs.plan(src, dst), sb, {10: t})
        msg = str(ei.value)
        assert torch.equal(sb[0], torch.arange(6.0))
    assert "freed" not in msg and "Internal error" not in msg, msg


@pytest.mark.parametrize("key", [0.0, np.float64(0.0), True, "0", None])
def test_buffer_keys_must_be_int_locations(key):
    """A float or bool key finds location 0 through dict lookup (0.0 == 0 == False... and
    True == 1); it is refused by its type instead of standing in for the location."""
    src, dst = _one_rank()
    msg = _refused(
        lambda db: rs.execute(rs.plan(src, dst), {key: torch.arange(6.0)}, db),
        re.escape(f"source buffer key {key!r} ({type(key).__name__}) is not a location"),
    )
    # a key equal to 0 is not also reported missing; any other leaves location 0 missing
    assert ("location 0 (owned by rank 0) is missing" in msg) == (key != 0), msg
    # numpy ints are ints
    db = {np.int64(10): torch.full((6,), S.POISON)}
    rs.execute(rs.plan(src, dst), {np.int32(0): torch.arange(6.0)}, db)
    assert torch.equal(db[10], torch.arange(6.0))


@pytest.mark.parametrize("flag", ["register_host_sources", "register_host_targets"])
@pytest.mark.parametrize("value", ["no", 0, None])
def test_registration_flags_are_bools(flag, value):
    """A truthy string would turn page-locking on; anything but True/False is refused."""
    src, dst = _one_rank()
    with pytest.raises(TypeError, match=f"{flag} must be True or False, got {value!r}"):
        rs.Transfer(src, dst, **{flag: value})


class _Live:
    """What an integration's describe() returns: `.layout`, `.buffers`, `.check()`."""

    def __init__(self, layout, buffers):
        self.layout, self.buffers = layout, buffers

    def check(self):
        pass


def test_a_live_buffer_set_whose_layout_is_not_the_plans():
    """A describe() result carries its own layout: preflight holds it to the plan's side,
    naming the first difference (a tensor's shape, a storage's dtype or extent, a tensor the
    plan names that it lacks); a layout that agrees on what the plan names (a subset of its
    tensors) passes."""
    src, dst = _one_rank()
    sync = rs.Transfer(src, dst)
    sb = {0: torch.arange(6.0)}
    other = {
        "shape": rs.Layout({"w": rs.flat((2, 3), [(0, 0, 6, 0)])}, src.storages),
        "dtype": rs.Layout(
            {"w": rs.flat((6,), [(0, 0, 6, 0)])}, {0: rs.Storage(0, torch.bfloat16, 6)}
        ),
        "name": rs.Layout({"v": rs.flat((6,), [(0, 0, 6, 0)])}, src.storages),
        "pieces": rs.Layout({"w": rs.split((6,), 0, [3, 3], [0, 0])}, src.storages),
    }
    wants = {
        "shape": "tensor 'w': shape (6,) in the plan, (2, 3) in the buffers' layout",
        "dtype": "storage 0: Storage(rank=0, dtype=torch.float32, numel=6) in the plan, "
        "Storage(rank=0, dtype=torch.bfloat16, numel=6) in the buffers' layout",
        "name": "tensor 'w' of the plan is not in the buffers' layout",
        "pieces": "tensor 'w': laid out differently (piece 0:",
    }
    for kind, layout in other.items():
        live = _Live(layout, sb)
        for call in (
            lambda db, live=live: rs.execute(rs.plan(src, dst), live, db),
            lambda db, live=live: sync(live, db),
        ):
            msg = _refused(call, "source buffers' layout .*_Live.* differs from the plan's")
            assert wants[kind] in msg, (kind, msg)
    # the other side, and a layout that agrees on every tensor the plan names
    wide = rs.Layout({"w": dst.tensors["w"], "extra": rs.flat((2,), [(10, 0, 2, 4)])}, dst.storages)
    for layout, ok in ((other["shape"], False), (wide, True), (dst, True)):
        db = {10: torch.full((6,), S.POISON)}
        try:
            sync(sb, _Live(layout, db))
            assert ok and torch.equal(db[10], sb[0])
        except rs.PreflightError as exc:
            assert not ok and "target buffers' layout" in str(exc), exc
            assert bool((db[10] == S.POISON).all())


class _Hooked:
    """A buffers object whose readiness hook runs `hook` (it may change the buffers)."""

    def __init__(self, buffers, hook):
        self.buffers, self.hook = buffers, hook

    def check(self):
        self.hook()


@pytest.mark.parametrize("call", ["first", "repeated"])
def test_checks_see_the_buffers_as_the_readiness_hooks_leave_them(call):
    """A hook may swap a buffer's .data or free its storage (as FSDP and ZeRO-3 do): every
    check, and a repeated call's short path, reads the buffers after the hooks ran, so the
    swap onto a source and the freed storage are refused and no source is written."""
    two = rs.Layout(
        {"w": rs.flat((6,), [(0, 0, 6, 0)]), "v": rs.flat((6,), [(1, 0, 6, 0)])},
        {0: rs.Storage(0, torch.float32, 6), 1: rs.Storage(0, torch.float32, 6)},
    )
    dst = rs.Layout(
        {"w": rs.flat((6,), [(10, 0, 6, 0)]), "v": rs.flat((6,), [(11, 0, 6, 0)])},
        {10: rs.Storage(0, torch.float32, 6), 11: rs.Storage(0, torch.float32, 6)},
    )
    sync = rs.Transfer(two, dst)
    a, b = torch.arange(6.0), torch.full((6,), 9.0)
    target, other = torch.zeros(6), torch.zeros(6)
    sb, db = {0: a, 1: b}, {10: target, 11: other}
    if call == "repeated":
        sync(sb, _Hooked(db, lambda: None))
    swap = _Hooked(db, lambda: setattr(target, "data", b))
    with pytest.raises(rs.PreflightError, match="aliases source location 1"):
        sync(sb, swap)
    assert torch.equal(b, torch.full((6,), 9.0)), "a source was written"
    target.data = torch.zeros(6)
    if call == "repeated":
        sync(sb, _Hooked(db, lambda: None))

    def free():
        other.untyped_storage().resize_(0)

    with pytest.raises(rs.PreflightError, match="target location 11: .*storage"):
        sync(sb, _Hooked(db, free))
    assert torch.equal(a, torch.arange(6.0)) and torch.equal(b, torch.full((6,), 9.0))


def test_checks_and_buffer_objects_that_raise_or_mislead_are_collective_reasons():
    src, dst = _one_rank()
    sync = rs.Transfer(src, dst)
    sb = {0: torch.arange(6.0)}

    def raising():
        yield lambda: None
        raise KeyError("from the checks generator")

    _refused(lambda db: sync(sb, db, checks=raising()), "KeyError: 'from the checks generator'")

    class Odd:
        def __init__(self, buffers, **attrs):
            self.buffers = buffers
            self.__dict__.update(attrs)

    _refused(lambda db: sync(Odd(sb, check=5), db), r"src_buffers' `.check` must be callable")
    _refused(
        lambda db: sync(sb, Odd(db, layout={"w": 1})),
        r"dst_buffers' `.layout` must be a reshard Layout \(or absent\), got dict",
    )


@pytest.mark.parametrize("group", ["world", 0, object()])
def test_a_group_that_is_not_a_process_group_is_a_type_error(group):
    src, dst = _one_rank()
    name = type(group).__name__
    with pytest.raises(TypeError, match=f"group must be a torch.distributed ProcessGroup.*{name}"):
        rs.Transfer(src, dst, group=group)
    sb = {0: torch.arange(6.0)}
    _refused(
        lambda db: rs.execute(rs.plan(src, dst), sb, db, group=group),
        f"group must be a torch.distributed ProcessGroup.*{name}",
        TypeError,
    )
    sync = rs.Transfer(src, dst)
    sync.group = group
    _refused(lambda db: sync(sb, db), "group must be a torch.distributed ProcessGroup", TypeError)


def test_a_launcher_without_init_process_group_is_named(monkeypatch):
    """WORLD_SIZE > 1 (torchrun) without init_process_group: each process would run alone as
    rank 0; refused on every process, naming the missing call."""
    src, dst = _one_rank()
    sync = rs.Transfer(src, dst)  # built before init: fine, the group is bound per call
    sb = {0: torch.arange(6.0)}
    monkeypatch.setenv("WORLD_SIZE", "4")
    for call in (lambda db: rs.execute(rs.plan(src, dst), sb, db), lambda db: sync(sb, db)):
        msg = _refused(call, "init_process_group", RuntimeError)
        assert "WORLD_SIZE=4" in msg, msg
    monkeypatch.setenv("WORLD_SIZE", "1")
    db = {10: torch.zeros(6)}
    sync(sb, db)
    assert torch.equal(db[10], sb[0])


# ------------------------------------------------------------------ autograd


def test_versions_move_and_grad_targets_are_refused_in_process():
    src, dst = _one_rank()
    sync = rs.Transfer(src, dst)
    sb = {0: torch.arange(6.0)}
    db = {10: torch.zeros(6)}
    v0 = db[10]._version
    sync(sb, db)
    assert db[10]._version > v0 and torch.equal(db[10], sb[0])
    leaf = torch.zeros(6, requires_grad=True)
    for target in (leaf, leaf.view(-1)):
        with pytest.raises(rs.PreflightError, match="requires grad"):
            sync(sb, {10: target})
    assert not leaf.detach().any()
    with torch.no_grad():
        sync(sb, {10: leaf})
    assert torch.equal(leaf.detach(), sb[0])


def test_sources_that_require_grad_leave_the_targets_plain():
    """A model's parameters are the usual source: in grad mode the targets get no autograd
    history, so the same buffers sync again (preflight refuses targets that require grad)."""
    src, dst = _one_rank()
    sync = rs.Transfer(src, dst)
    weight = torch.nn.Parameter(torch.arange(6.0))
    db = {10: torch.full((6,), S.POISON)}
    for step in range(2):
        with torch.no_grad():
            weight.add_(step)
        sync({0: weight.view(-1)}, db)
        assert not db[10].requires_grad and db[10].grad_fn is None
        assert torch.equal(db[10], weight.detach())
    assert weight.grad_fn is None and weight.is_leaf


def test_inference_tensor_targets_follow_torch():
    """Outside inference mode torch refuses in-place writes to inference tensors (the op
    does too): preflight refuses first; inside inference mode they are written."""
    src, dst = _one_rank()
    sync = rs.Transfer(src, dst)
    sb = {0: torch.arange(6.0)}
    with torch.inference_mode():
        target = torch.full((6,), S.POISON)
    with pytest.raises(rs.PreflightError, match="is an inference tensor"):
        sync(sb, {10: target})
    assert bool((target == S.POISON).all())
    with torch.inference_mode():
        sync(sb, {10: target})
    assert torch.equal(target, sb[0])


# ------------------------------------------------------------------ threads


def test_reentrant_call_from_a_hook_is_refused():
    src, dst = _one_rank()
    sync = rs.Transfer(src, dst)
    sb, db = {0: torch.arange(6.0)}, {10: torch.full((6,), S.POISON)}

    def hook():
        sync(sb, {10: torch.zeros(6)})

    with pytest.raises(rs.PreflightError, match="on the thread where a Transfer call holds"):
        sync(sb, db, checks=(hook,))
    assert bool((db[10] == S.POISON).all())
    sync(sb, db)  # the Transfer is still usable


def test_a_call_waits_for_another_threads_call_at_most_its_timeout():
    src, dst = _one_rank()
    sync = rs.Transfer(src, dst, timeout=0.3)
    sb, db = {0: torch.arange(6.0)}, {10: torch.full((6,), S.POISON)}
    inside, release = threading.Event(), threading.Event()

    def hook():
        inside.set()
        release.wait(30)

    holder = threading.Thread(
        target=sync, args=(sb, {10: torch.zeros(6)}), kwargs={"checks": (hook,)}
    )
    holder.start()
    try:
        assert inside.wait(30)
        with pytest.raises(TimeoutError, match="waited 0.3 s for a Transfer call on another"):
            sync(sb, db)
        assert bool((db[10] == S.POISON).all())
    finally:
        release.set()
        holder.join(30)
    sync(sb, db)
    assert torch.equal(db[10], sb[0])
    assert torch.equal(db[10], sb[0])


def test_threads_share_one_transfer_in_process():
    src, dst = _one_rank(n=4096)
    sync = rs.Transfer(src, dst, budget_bytes_per_peer=256)
    sb = {0: torch.arange(4096.0)}
    errors, barrier = [], threading.Barrier(4)

    def worker():
        barrier.wait()
        for _ in range(20):
            db = {10: torch.full((4096,), S.POISON)}
            try:
                sync(sb, db)
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(repr(exc))
                return
            if not torch.equal(db[10], sb[0]):
                errors.append("wrong data")

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors[:3]


def test_strided_run_is_not_extended_across_a_different_target_gap():
    """Rows 0-3 of a [5, 3] tensor at target row stride 5, row 4 alone 3 elements after row
    3's end: the source rows are evenly spaced, the target's are not, so the planner must not
    fold row 4 into the strided run of rows 0-3 (it would land at 20, not 18)."""
    f32 = torch.float32
    src = rs.Layout({"w": rs.flat((5, 3), [(0, 0, 15, 0)])}, {0: rs.Storage(0, f32, 15)})
    pieces = [rs.Piece(10, 0, (0, 0), (4, 3), (5, 1)), rs.Piece(10, 18, (4, 0), (1, 3), (3, 1))]
    dst = rs.Layout({"w": rs.TensorLayout((5, 3), pieces)}, {10: rs.Storage(0, f32, 24)})
    w = torch.arange(15.0).reshape(5, 3)
    want = torch.full((24,), S.POISON)
    want[:20].view(4, 5)[:, :3] = w[:4]
    want[18:21] = w[4]
    db = {10: torch.full((24,), S.POISON)}
    rs.execute(rs.plan(src, dst), {0: w.reshape(-1).clone()}, db)
    assert torch.equal(db[10], want), db[10].tolist()


def test_local_paths_are_kept_whichever_way_a_call_reaches_them():
    """The local copy paths (and what their CPU -> CUDA pipeline has measured) are built once
    for a set of devices and dtypes: a lookup without preflight's key between short-path calls
    returns the same paths, and a target of another dtype builds new ones."""
    sync, sb, db = _passed_once()
    sync(sb, db)  # the short path: the paths are looked up by preflight's key object
    engine = sync._engine
    key = engine.verified_buffers[0]  # the object the short path hands the executor
    paths = engine.local_paths(sb, db, key)
    assert engine.local_paths(sb, db) is paths
    assert engine.local_paths(sb, db, key) is paths
    assert engine.local_h2d is paths[0]  # what benchmarks read: None here (CPU targets)
    sync(sb, db)
    assert engine.local_paths(sb, db) is paths
    assert torch.equal(db[10], sb[0])
    other = {10: torch.full((6,), S.POISON, dtype=torch.float64)}
    assert engine.local_paths(sb, other) is not paths
