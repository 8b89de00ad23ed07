"""Preflight: every rank checks its own buffers against the plan, then one collective exchange.

Nothing is written unless every rank of the group agrees. Local checks (this rank only):
ownership and presence of locations, dtype and extent against each `Storage`, 1-D contiguous,
device vs transport, CPU targets in read-only memory, target writes that alias a source
buffer or another target's writes, readiness hooks, staging allocation. Then every rank
contributes (ok, plan fingerprint, the time it entered, its buffer objects' kinds) to one small
all-gather; only when someone failed (or the fingerprints or kinds differ) a second all-gather
carries the reasons, and every rank raises the same `PreflightError`; only when the ranks
entered far apart (a peer may have given up waiting) a commit all-gather follows before
anything is written.

What cannot change between calls is checked once per Transfer (the schedule against what the
kernels accept). Every call reads, for each buffer, everything the per-buffer checks depend on
(`_call_key`: type, address, storage address and bytes, dtype, shape, contiguity, device; for
targets requires_grad and inference) plus the grad / inference mode, and runs the hooks; when
all of it equals the last passing call's, the per-buffer verdicts and the placement are that
call's, and only the hooks, the staging and (when a target storage of that call was freed
since) the targets' writability run. Otherwise every buffer is checked (ownership, dtype,
extent, a live storage, device, the in-place rules of the current mode), and the checks
that depend only on where the buffers are (aliasing, local copy extents, staging) run again
when the buffers moved (`placement`).

Buffer sets: `src_buffers` / `dst_buffers` are either a mapping {location: tensor} or an
object with a `.buffers` mapping and, optionally, a `.check()` method that raises (e.g.
`NotReadyError`) when the state is not usable yet: the integrations' hook (a DeepSpeed
`describe()` result is such an object). Extra checks can also be passed as callables.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
import math
import threading
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from . import _ops
from .errors import PreflightError
from .layout import Layout
from .layout.intervals import first_overlap, merge
from .layout.values import as_dtype

SUPPORTED_TRANSPORTS = ("gloo", "nccl", "local")


@dataclass
class BufferSet:
    """A normalized buffer set: {location: tensor or None} plus readiness hooks, and the
    layout the buffers' object says they hold (an integration's `describe()` result has
    one; None for a plain mapping), with the object's type name for messages."""

    buffers: dict
    checks: list = field(default_factory=list)
    layout: Layout | None = None
    source: str = ""
    notes: list = field(default_factory=list)  # how this rank's state shaped its layout
    # which state the buffers are (a DeepSpeed LiveState's "exp_avg"): two calls of one plan
    # moving different states must not pair up across ranks
    kind: str | None = None


def as_buffer_set(obj, side: str, hooks: list | None = None) -> BufferSet:
    """Accept a mapping, a BufferSet, or an object with `.buffers` (and optional `.check()`
    and `.layout`). hooks: the object's `readiness_hooks`, when the caller has read them."""
    if isinstance(obj, BufferSet):
        return obj
    if isinstance(obj, Mapping):
        return BufferSet(dict(obj))
    buffers = getattr(obj, "buffers", None)
    if isinstance(buffers, Mapping):
        layout = getattr(obj, "layout", None)
        if layout is not None and not isinstance(layout, Layout):
            raise TypeError(
                f"{side}_buffers' `.layout` must be a reshard Layout (or absent), got "
                f"{type(layout).__name__}"
            )
        if hooks is None:
            hooks = readiness_hooks(obj, side)
        notes = getattr(obj, "notes", None)
        notes = [str(n) for n in notes[:8]] if isinstance(notes, (list, tuple)) else []
        kind = getattr(obj, "kind", None)
        kind = kind if isinstance(kind, str) else None
        return BufferSet(dict(buffers), hooks, layout, type(obj).__name__, notes, kind)
    raise TypeError(
        f"{side}_buffers must be a mapping {{location: tensor}} or an object with a `.buffers` "
        f"mapping, got {type(obj).__name__}"
    )


def readiness_hooks(obj, side: str) -> list:
    """The readiness hook of a buffers object (its `.check`), as a list; none for a mapping."""
    if isinstance(obj, BufferSet):
        return obj.checks
    if isinstance(obj, Mapping):
        return []
    check = getattr(obj, "check", None)
    if check is None:
        return []
    if not callable(check):
        raise TypeError(
            f"{side}_buffers' `.check` must be callable (a readiness hook), got "
            f"{type(check).__name__}"
        )
    return [check]


def fingerprint_words(fp) -> tuple[int, int]:
    """Two int64 words of a fingerprint's hash, so it fits a fixed-size tensor all-gather."""
    return _hash_words(str(fp))


@functools.lru_cache(maxsize=64)
def _hash_words(text: str) -> tuple[int, int]:
    digest = hashlib.sha256(text.encode()).digest()
    return (
        int.from_bytes(digest[:8], "little", signed=True),
        int.from_bytes(digest[8:16], "little", signed=True),
    )


# ---------------------------------------------------------------- what the kernels accept

_CASTABLE = (torch.float32, torch.bfloat16, torch.float16)


def copy_support(src_dtype: torch.dtype, dst_dtype: torch.dtype) -> str | None:
    """None if the C core copies `src_dtype` elements into `dst_dtype` ones, else why not.

    Same dtype: raw bytes, for element sizes 1, 2, 4 and 8. Different dtypes: casts among
    float32, bfloat16 and float16 only. The ops refuse exactly what this refuses."""
    if src_dtype == dst_dtype:
        size = src_dtype.itemsize
        if size in (1, 2, 4, 8):
            return None
        return (
            f"{src_dtype} has {size}-byte elements; the C core copies elements of 1, 2, 4 or 8 "
            "bytes"
        )
    if src_dtype in _CASTABLE and dst_dtype in _CASTABLE:
        return None
    return (
        f"cannot copy {src_dtype} to {dst_dtype}: casts exist only among float32, bfloat16 "
        "and float16; other dtypes copy only to themselves"
    )


def _bad_rows(desc: np.ndarray, off_col: int, numel) -> np.ndarray:
    """Rows of `desc` whose (off, stride) side is negative or reaches outside [0, numel) once
    repeated `count` times (length and count checked too), without int64 overflow: the checks
    rs_validate makes before a copy. `numel` is a scalar or one bound per row."""
    off, stride = desc[:, off_col], desc[:, off_col + 1]
    length, count = desc[:, 4], desc[:, 5]
    numel = np.broadcast_to(np.asarray(numel, np.int64), off.shape)
    neg = (off < 0) | (stride < 0) | (length < 0) | (count < 0)
    active = (length > 0) & (count > 0) & ~neg
    # off + (count-1)*stride + length <= numel, evaluated as a division so nothing overflows
    room = np.where((off <= numel) & (length <= numel), numel - off - length, -1)
    reps = np.maximum(count - 1, 1)
    fits = (room >= 0) & ((count <= 1) | (stride <= np.maximum(room, 0) // reps))
    return neg | (active & ~fits)


def _overlapping_writes(desc: np.ndarray, off_col: int) -> tuple[int, int] | None:
    """An element range [lo, hi) that two writes of `desc`'s (off, stride) side both hit, or
    None. Rows whose spans are disjoint are cleared without expanding their repeats; only
    rows whose spans interleave are expanded into runs."""
    keep = (desc[:, 4] > 0) & (desc[:, 5] > 0)
    d = desc[keep]
    if d.shape[0] == 0:
        return None
    off, stride, length, count = d[:, off_col], d[:, off_col + 1], d[:, 4], d[:, 5]
    within = (count > 1) & (stride < length)
    if within.any():
        i = int(np.flatnonzero(within)[0])
        return int(off[i] + stride[i]), int(off[i] + min(length[i], stride[i] + length[i]))
    end = off + (count - 1) * stride + length
    order = np.argsort(off, kind="stable")
    s, e = off[order], end[order]
    clash = np.zeros(s.size, bool)
    clash[1:] = s[1:] < np.maximum.accumulate(e)[:-1]
    if not clash.any():
        return None
    cluster = np.cumsum(~clash)
    sizes = np.bincount(cluster)
    rows = order[sizes[cluster] > 1]
    iv = _expand_runs(d[rows], off_col, off_col + 1)
    iv = iv[np.argsort(iv[:, 0], kind="stable")]
    reach = np.maximum.accumulate(iv[:, 1])
    hit = np.flatnonzero(iv[1:, 0] < reach[:-1])
    if not hit.size:
        return None
    j = int(hit[0]) + 1
    return int(iv[j, 0]), int(min(iv[j, 1], reach[j - 1]))


def _desc(obj) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(obj, dtype=np.int64)).reshape(-1, 6)


class _ScheduleCheck:
    """The reasons one rank's schedule cannot run: see `check_schedule`."""

    def __init__(self, rank, world_size, src_storages, dst_storages, arena_bytes):
        self.rank, self.world_size = rank, world_size
        self.storages = {"source": src_storages, "target": dst_storages}
        self.arena_bytes = arena_bytes  # {"send": bytes, "recv": bytes}
        self.reasons: list[str] = []
        self.writes: dict[int, list] = {}  # target location -> write-side tables

    def storage(self, side, loc):
        st = self.storages[side].get(loc)
        if st is None:
            self.reasons.append(f"the schedule names {side} location {loc}, which the layout lacks")
        return st

    def rows_ok(self, what, desc, off_col, numel) -> bool:
        bad = np.flatnonzero(_bad_rows(desc, off_col, numel))
        if bad.size:
            i = int(bad[0])
            self.reasons.append(
                f"{what}: descriptor row {i} {desc[i].tolist()} is negative, overflows int64 or "
                f"reaches outside the {int(numel)} elements there"
            )
        return not bad.size

    def local_copy(self, lc) -> None:
        s = self.storage("source", lc.src_location)
        t = self.storage("target", lc.dst_location)
        if s is None or t is None:
            return
        what = f"local copy {lc.src_location} -> {lc.dst_location}"
        why = copy_support(as_dtype(s.dtype), as_dtype(t.dtype))
        if why:
            self.reasons.append(f"{what}: {why}")
        d = _desc(lc.desc)
        ok = self.rows_ok(what + " (source side)", d, 0, s.numel)
        if self.rows_ok(what + " (target side)", d, 2, t.numel) and ok:
            self.writes.setdefault(lc.dst_location, []).append(d)

    def message(self, side, k, m) -> None:
        peer, nbytes, at = int(m.peer), int(m.nbytes), int(m.arena_offset)
        what = f"round {k} {side} message {'to' if side == 'send' else 'from'} rank {peer}"
        if not 0 <= peer < self.world_size or peer == self.rank:
            self.reasons.append(f"{what}: peer {peer} is not another rank of the group")
        if at < 0 or nbytes < 0 or at + nbytes > self.arena_bytes[side]:
            self.reasons.append(
                f"{what}: bytes [{at}, {at + nbytes}) lie outside the schedule's "
                f"{self.arena_bytes[side]}-byte {side} arena"
            )
        spans = sorted(filter(None, (self.segment(side, what, nbytes, seg) for seg in m.segments)))
        if any(b[0] < a[1] for a, b in zip(spans, spans[1:])):
            self.reasons.append(f"{what}: two segments share message bytes")

    def segment(self, side, what, nbytes, seg) -> tuple[int, int] | None:
        """Checks one segment; returns its message byte span when it fits the message."""
        s = self.storage("source", seg.src_location)
        t = self.storage("target", seg.dst_location)
        if s is None or t is None:
            return None
        wire, n, at = seg.wire_dtype, int(seg.numel), int(seg.byte_offset)
        what = f"{what}, segment {seg.src_location} -> {seg.dst_location}"
        pair = (as_dtype(s.dtype), wire) if side == "send" else (wire, as_dtype(t.dtype))
        why = copy_support(*pair)
        if why:
            self.reasons.append(f"{what}: {why}")
        if n < 0 or at < 0 or at % wire.itemsize or at + n * wire.itemsize > nbytes:
            self.reasons.append(
                f"{what}: {n} elements of {wire} at byte {at} do not fit the message's "
                f"{nbytes} bytes aligned"
            )
            return None
        d = _desc(seg.desc)
        if side == "send":
            ok = self.rows_ok(what + " (source side)", d, 0, s.numel)
            ok = self.rows_ok(what + " (message side)", d, 2, n) and ok
            hit = _overlapping_writes(d, 2) if ok else None
            if hit:
                self.reasons.append(f"{what}: two rows write message elements {hit}")
        else:
            ok = self.rows_ok(what + " (message side)", d, 0, n)
            if self.rows_ok(what + " (target side)", d, 2, t.numel) and ok:
                self.writes.setdefault(seg.dst_location, []).append(d)
        return at, at + n * wire.itemsize

    def double_writes(self) -> None:
        for loc, tables in self.writes.items():
            hit = _overlapping_writes(np.concatenate(tables), 2)
            if hit:
                self.reasons.append(
                    f"target location {loc}: the schedule writes elements [{hit[0]}, {hit[1]}) "
                    "twice"
                )


def check_schedule(sched, rank: int, world_size: int, src_storages, dst_storages) -> list[str]:
    """Everything the kernels and the executor would refuse mid-transfer, checked for this
    rank's whole schedule before anything is written: element types the C core copies, every
    descriptor row inside its buffers (no negative field, no int64 overflow), segments inside
    their messages and messages inside the arenas, peers inside the group, and target elements
    written at most once. Depends only on the plan: computed once per plan and rank."""
    arena = {"send": int(sched.send_arena_bytes), "recv": int(sched.recv_arena_bytes)}
    check = _ScheduleCheck(rank, world_size, src_storages, dst_storages, arena)
    for lc in sched.local:
        check.local_copy(lc)
    for side, rounds in (("send", sched.sends), ("recv", sched.recvs)):
        for k, msgs in enumerate(rounds):
            for m in msgs:
                check.message(side, k, m)
    check.double_writes()
    return check.reasons


# ---------------------------------------------------------------- written ranges (aliasing)


def _expand_runs(desc: np.ndarray, off_col: int, stride_col: int) -> np.ndarray:
    """Element intervals [start, stop) touched by the (off, stride, length, count) side of desc."""
    if desc.size == 0:
        return np.zeros((0, 2), np.int64)
    off, stride, length, count = desc[:, off_col], desc[:, stride_col], desc[:, 4], desc[:, 5]
    keep = (length > 0) & (count > 0)
    off, stride, length, count = off[keep], stride[keep], length[keep], count[keep]
    if off.size == 0:
        return np.zeros((0, 2), np.int64)
    row = np.repeat(np.arange(off.size), count)
    first = np.cumsum(count) - count
    c = np.arange(row.size) - np.repeat(first, count)
    starts = off[row] + c * stride[row]
    return np.stack([starts, starts + length[row]], axis=1)


def written_elements(sched) -> dict[int, np.ndarray]:
    """Per target location of this rank: merged element intervals the schedule writes."""
    parts: dict[int, list] = {}
    for lc in sched.local:
        parts.setdefault(lc.dst_location, []).append(_expand_runs(np.asarray(lc.desc), 2, 3))
    for msgs in sched.recvs:
        for msg in msgs:
            for seg in msg.segments:
                iv = _expand_runs(np.asarray(seg.desc), 2, 3)
                parts.setdefault(seg.dst_location, []).append(iv)
    return {loc: merge(np.concatenate(p)) for loc, p in parts.items()}


def _extent(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


# ---------------------------------------------------------------- local checks


def _storage_shortfall(t: torch.Tensor) -> str | None:
    """Why `t`'s storage cannot hold what its metadata says (freed, or resized underneath it
    as FSDP does with parameters it frees), else None."""
    if t.numel() == 0:
        return None
    # the last element the view reaches (an expanded or strided view reaches less or more
    # than storage_offset + numel; its wrong strides are a reason of their own)
    last = t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    need = (last + 1) * t.element_size()
    storage = t.untyped_storage()
    have = storage.nbytes()
    if have == 0 or storage.data_ptr() == 0:
        return f"its storage is freed (0 bytes; it needs {need})"
    if have < need:
        return f"its storage holds {have} bytes, fewer than the {need} its view needs"
    return None


def _check_ownership(side, storages, buffers, rank, world_size, reasons) -> None:
    """The layout fits the group, and every location this rank owns is passed."""
    missing = []
    for loc, st in storages.items():
        if st.rank >= world_size:
            reasons.append(
                f"{side} location {loc} belongs to rank {st.rank}, but the group has only "
                f"{world_size} ranks"
            )
        elif st.rank == rank and loc not in buffers:
            missing.append(loc)
    if len(missing) == 1:
        reasons.append(f"{side} location {missing[0]} (owned by rank {rank}) is missing")
    elif missing:  # one line: a state a rank does not have yet may miss every location
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        reasons.append(f"{side} locations {missing[:8]}{more} (owned by rank {rank}) are missing")


def key_fault(side, loc) -> str | None:
    """Why buffer key `loc` is not a location, else None. Locations are ints: a float or bool
    key would find an int location through dict lookup (0.0 == 0 == False)."""
    if isinstance(loc, (bool, np.bool_)) or not isinstance(loc, (int, np.integer)):
        return (
            f"{side} buffer key {loc!r} ({type(loc).__name__}) is not a location: keys are "
            "the layout's int locations"
        )
    return None


def _admission(side, st, loc, t, rank) -> str | None:
    """Why the value passed for `loc` is not a buffer this rank may pass there, else None."""
    bad_key = key_fault(side, loc)
    if bad_key:
        return bad_key
    if st is None:
        return f"{side} location {loc!r} does not exist in the {side} layout"
    if st.rank != rank:
        return f"{side} location {loc} is owned by rank {st.rank}, not {rank}"
    if t is None:
        return f"{side} location {loc} has no buffer (None: not ready)"
    if not isinstance(t, torch.Tensor):
        return f"{side} location {loc}: expected a torch.Tensor, got {type(t).__name__}"
    return None


def _shape_faults(st, t) -> list[str]:
    """Tensor `t` against its `Storage`: dtype, 1-D contiguous, extent, a storage behind it,
    plain values (the ops refuse lazily conjugated or negated views and quantized tensors)."""
    if type(t).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__:
        # DTensor, FakeTensor, FunctionalTensor...: their data is not this tensor's memory
        return [
            f"is a {type(t).__name__}, a tensor subclass with its own dispatch whose memory "
            "reshard cannot address: pass the plain tensor it holds (a DTensor's "
            ".to_local(); rsdt.describe() for DTensors)"
        ]
    if t.is_nested:
        return ["is a nested tensor: reshard copies dense (strided) tensors"]
    if t.layout != torch.strided:
        return [f"is a {t.layout} tensor: reshard copies dense (strided) tensors"]
    bad = []
    if t.is_conj():
        bad.append("is a lazily conjugated view (t.conj()): pass t.resolve_conj()")
    if t.is_neg():
        bad.append("is a lazily negated view: pass t.resolve_neg()")
    if t.is_quantized:
        bad.append(f"is a quantized tensor ({t.dtype}): pass its int_repr()")
    want = as_dtype(st.dtype)
    if t.dtype != want:
        bad.append(f"dtype {t.dtype}, storage declares {want}")
    if t.dim() != 1:
        bad.append(f"must be 1-D, got shape {tuple(t.shape)}")
    elif not t.is_contiguous():
        bad.append(f"must be contiguous, got stride {t.stride()}")
    if t.numel() != st.numel:
        bad.append(f"has {t.numel()} elements, storage declares {st.numel}")
    if not t.is_meta:
        short = _storage_shortfall(t)
        if short:
            bad.append(short)
    return bad


def _device_faults(t, transport) -> list[str]:
    """Where `t` lives against what the transport moves."""
    if t.is_cpu:  # every transport moves CPU buffers (the cheap test first: once per buffer)
        return []
    dev = t.device
    if transport == "gloo":
        return [f"is on {dev}, but the gloo transport needs CPU buffers"]
    if dev.type != "cuda":
        return [f"is on {dev}; reshard copies CPU and CUDA buffers only"]
    if transport == "nccl" and dev.index != torch.cuda.current_device():
        return [f"is on {dev}, not this rank's current device cuda:{torch.cuda.current_device()}"]
    return []


def _write_faults(t) -> list[str]:
    """Why torch's in-place rules forbid writing target `t` in the current mode (grad mode and
    inference mode can change from one call to the next)."""
    bad = []
    if t.is_inference() and not torch.is_inference_mode_enabled():
        bad.append(
            "is an inference tensor, which torch lets no in-place write touch outside "
            "torch.inference_mode() (clone it, or call under inference_mode)"
        )
    if t.requires_grad and torch.is_grad_enabled():
        bad.append(
            "requires grad: the transfer writes it in place, which autograd does not "
            "record (write under torch.no_grad(), or pass a .detach()ed view)"
        )
    return bad


class WritableTargets:
    """Whether a call's CPU targets lie in writable memory. Writing read-only memory (a numpy
    memmap opened with mode 'r', any mapping without write permission) kills the process, and
    torch does not say which memory is writable; the process's memory map does
    (`reshard::unwritable_reason`: storages of torch's allocator need no lookup, any other is
    looked up once while it lives; where the OS gives no map, nothing is checked). A call whose
    buffers read as the last verified call's (its `_call_key` object) asks nothing, unless one
    of that call's target storages was freed since: only then can another mapping take its
    address."""

    def __init__(self):
        self.key = None  # the call key whose targets were all found writable
        self.watched: list = []  # weak references to those targets' storages
        self.freed = False  # one of them was freed since

    def _freed(self, _ref) -> None:
        self.freed = True

    def reasons(self, dst: dict, key=None) -> list[str]:
        """Why targets of `dst` (validated tensors) cannot be written; `key`: the call's
        `_call_key` object, remembered when all of them can."""
        if key is not None and key is self.key and not self.freed:
            return []
        storages, reasons = {}, []
        for loc, t in dst.items():
            if t.is_cpu and t.numel():
                st = t.untyped_storage()
                storages[id(st)] = st
                why = "" if st.resizable() else _ops.unwritable_reason(t)
                if why:
                    reasons.append(f"target location {loc}: {why}")
        if reasons:
            return reasons
        self.key, self.freed = key, False
        self.watched = [weakref.ref(st, self._freed) for st in storages.values()]
        return []


def writable_targets(ctx) -> WritableTargets:
    """The engine's `WritableTargets` (made on first use)."""
    return ctx.__dict__.setdefault("writable_targets", WritableTargets())


def _check_side(side, layout, buffers, rank, world_size, transport, reasons) -> dict:
    """The buffers of one side that pass every per-buffer check, as {location: tensor}; the
    reasons of the others are appended to `reasons`."""
    storages = layout.storages
    _check_ownership(side, storages, buffers, rank, world_size, reasons)
    ok = {}
    for loc, t in buffers.items():
        st = storages.get(loc)
        why = _admission(side, st, loc, t, rank)
        if why:
            reasons.append(why)
            continue
        bad = _shape_faults(st, t) + _device_faults(t, transport)
        if side == "target":
            bad += _write_faults(t)
        if bad:
            reasons.append(f"{side} location {loc}: " + "; ".join(bad))
        else:
            ok[loc] = t
    return ok


def _call_key(ctx, src: dict, dst: dict) -> tuple | None:
    """Everything the per-buffer checks read: the modes (grad, inference, the current CUDA
    device under NCCL), each side's locations in order and, per value, its type and
    `_ops.FACT_COLUMNS` (address, storage address and bytes, dtype, device, dim, numel,
    contiguity, requires_grad, inference), read for both sides in one op call (after a large
    copy every call runs cold, so one is worth saving). Equal keys get the same per-buffer
    verdicts and the same `placement`; only a passing call's key is kept, and a passing buffer
    is 1-D, so its dim and numel are its shape and its contiguity its strides. None when a
    value is not a plain tensor (the full checks then say why)."""
    facts = _ops.facts_key([*src.values(), *dst.values()])
    if facts is None:
        return None
    cuda = torch.cuda.current_device() if ctx.transport == "nccl" else None
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
    return grad, inference, cuda, tuple(src), tuple(dst), facts


def placement(src_ok: dict, dst_ok: dict) -> tuple:
    """Where the validated buffers are: (location, first byte, bytes, device index; -1 for
    the CPU) per buffer. The memory checks (aliasing, local copy extents) and what the staging
    needs depend on nothing else, so a call whose placement equals the last passing call's
    skips them."""
    return tuple(
        tuple(
            (loc, t.data_ptr(), t.numel() * t.element_size(), t.get_device())
            for loc, t in ok.items()
        )
        for ok in (src_ok, dst_ok)
    )


def _check_aliasing(src_ok, dst_ok, sched_written, reasons):
    """Target writes must not touch a source buffer, nor another target's writes."""
    written_bytes = {}
    for loc, t in dst_ok.items():
        iv = sched_written().get(loc)
        if iv is None or iv.shape[0] == 0:
            continue
        written_bytes[loc] = iv * t.element_size() + t.data_ptr()
    for dloc, wb in written_bytes.items():
        d = dst_ok[dloc]
        for sloc, s in src_ok.items():
            if s.device != d.device:
                continue
            lo, hi = _extent(s)
            hit = first_overlap(wb, np.array([[lo, hi]], np.int64))
            if hit is not None:
                reasons.append(
                    f"target location {dloc} aliases source location {sloc}: the transfer would "
                    f"write source bytes [{hit[0] - lo}, {hit[1] - lo}) (sources are never written)"
                )
    locs = sorted(written_bytes)
    for i, a in enumerate(locs):
        for b in locs[i + 1 :]:
            if dst_ok[a].device != dst_ok[b].device:
                continue
            hit = first_overlap(written_bytes[a], written_bytes[b])
            if hit is not None:
                reasons.append(
                    f"target locations {a} and {b} alias: both would write the same bytes "
                    f"(bytes [{hit[0] - dst_ok[a].data_ptr()}, "
                    f"{hit[1] - dst_ok[a].data_ptr()}) of location {a})"
                )


def check_local_extents(local_pairs, src_ok, dst_ok, reasons) -> None:
    """A local copy's source and target buffers must not share memory at all (copy_runs
    refuses overlapping extents, not only overlapping writes)."""
    for sloc, dloc in local_pairs:
        s, d = src_ok.get(sloc), dst_ok.get(dloc)
        if s is None or d is None or s.device != d.device or not s.numel() or not d.numel():
            continue
        (s0, s1), (d0, d1) = _extent(s), _extent(d)
        if s0 < d1 and d0 < s1:
            reasons.append(
                f"target location {dloc} shares memory with source location {sloc}, which it "
                "is copied from locally (source and target of a copy must be disjoint)"
            )


def _any_overlap(src_ok, dst_ok) -> bool:
    """Cheap test first, O(n log n) per device: does any target buffer share memory with a
    source buffer or another target? (Sources may alias each other: they are only read.)"""
    for dev in {t.device for t in dst_ok.values()}:
        tg = np.array([_extent(t) for t in dst_ok.values() if t.device == dev], np.int64)
        tg = tg[np.argsort(tg[:, 0], kind="stable")]
        if len(tg) > 1 and (tg[1:, 0] < np.maximum.accumulate(tg[:-1, 1])).any():
            return True
        sr = [_extent(t) for t in src_ok.values() if t.device == dev]
        if sr and first_overlap(tg, merge(np.array(sr, np.int64))) is not None:
            return True
    return False


def buffer_checks(plan, rank, world_size, transport, src, dst):
    """The per-buffer checks of a call's full path: (reasons, src_ok, dst_ok) with the
    validated {location: tensor} maps. Per buffer: ownership, dtype, extent, 1-D contiguous, a
    live storage, device against the transport, and for targets the in-place rules of the
    current grad / inference mode."""
    if transport not in SUPPORTED_TRANSPORTS:
        return [f"unsupported transport {transport!r} (gloo, nccl or no process group)"], {}, {}
    reasons: list[str] = []
    src_ok = _check_side("source", plan.src, src.buffers, rank, world_size, transport, reasons)
    dst_ok = _check_side("target", plan.dst, dst.buffers, rank, world_size, transport, reasons)
    return reasons, src_ok, dst_ok


def hook_reasons(hooks) -> list[str]:
    """What the readiness hooks raise, as reasons (run on every call)."""
    reasons = []
    for check in hooks:
        try:
            check()
        except Exception as exc:  # noqa: BLE001 - any hook failure is a reason, not a crash
            reasons.append(f"{type(exc).__name__}: {exc}")
    return reasons


def memory_checks(src_ok, dst_ok, written, local_pairs) -> list[str]:
    """Checks that depend only on the buffers' placement: a local copy's source and target
    share no memory, and no target write touches a source buffer or another target's writes.
    written: returns {target location: merged element intervals this rank writes}."""
    reasons: list[str] = []
    check_local_extents(local_pairs, src_ok, dst_ok, reasons)
    if not reasons and _any_overlap(src_ok, dst_ok):
        _check_aliasing(src_ok, dst_ok, written, reasons)
    return reasons


# ---------------------------------------------------------------- the collective


def _wait(work, device, timeout_s) -> None:
    if timeout_s is not None and device.type == "cpu":
        work.wait(datetime.timedelta(seconds=timeout_s))
    else:
        work.wait()


def _all_gather_rows(values: list[int], group, world_size, device, timeout_s) -> list[list[int]]:
    """One all-gather of a few int64 per rank, bounded by timeout_s on CPU tensors."""
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(world_size)]
    _wait(dist.all_gather(gathered, mine, group=group, async_op=True), device, timeout_s)
    return torch.stack(gathered).cpu().tolist()


class GatherRows:
    """The agreement's all-gather (`ROW` int64 per rank) over CPU tensors kept from one call to
    the next: this rank's row is written in place and the process group's own allgather fills
    one preallocated [world, ROW] tensor, so a repeated call allocates nothing. Reuse only
    after a completed wait; the caller drops it after a failed one (a collective that timed
    out may still send from, or complete into, its tensors)."""

    def __init__(self, group, world_size: int):
        self.group = group
        self.mine = torch.zeros(ROW, dtype=torch.int64)
        self.rows = torch.zeros(world_size, ROW, dtype=torch.int64)
        self.outputs = [list(self.rows.unbind(0))]
        self.mine_np, self.rows_np = self.mine.numpy(), self.rows.numpy()

    def __call__(self, values: list[int], timeout_s) -> list[list[int]]:
        self.mine_np[:] = values
        work = self.group.allgather(self.outputs, [self.mine])
        _wait(work, self.mine.device, timeout_s)
        return self.rows_np.tolist()


# (ok, two words of the fingerprint's hash, the wall-clock microsecond this rank entered, its
# timeout in microseconds, a word of the source and of the target buffers' kind: 0 for none)
ROW = 7


def _all_gather_bytes(payload: bytes, group, world_size, device, timeout_s) -> list[bytes]:
    """Every rank's bytes, through two bounded tensor all-gathers (all_gather_object would
    wait for the group's timeout, not ours)."""
    sizes = [
        row[0] for row in _all_gather_rows([len(payload)], group, world_size, device, timeout_s)
    ]
    mine = torch.zeros(max(sizes), dtype=torch.uint8)
    mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    mine = mine.to(device)
    gathered = [torch.empty_like(mine) for _ in range(world_size)]
    _wait(dist.all_gather(gathered, mine, group=group, async_op=True), device, timeout_s)
    return [bytes(g.cpu()[:n].tolist()) for g, n in zip(gathered, sizes, strict=True)]


# A rank that reaches the exchange after its peers gave up waiting for it (their waits timed
# out) completes its all-gather from what they had sent and would go on to write alone. Every
# rank sends the wall-clock time it entered the exchange; when the entries are spread over
# this fraction of the timeout or more, a peer may have given up, and a commit all-gather
# follows before anyone writes: a rank writes only after it received every rank's commit.
# Entries closer together than that mean every rank's contribution was on its way long before
# any wait could expire, so the commit would only repeat the agreement. Every rank decides
# from the same gathered rows (the shortest timeout among them), so they all take the same
# branch. Assumes the ranks' clocks agree to well within the fraction of the timeout (NTP
# keeps hosts within milliseconds).
COMMIT_SPREAD = 0.25


def _arrivals_spread_out(entered_us: list[int], timeout_s: float) -> bool:
    return max(entered_us) - min(entered_us) >= COMMIT_SPREAD * timeout_s * 1e6


# Process groups on which a collective was abandoned part-way (a wait timed out or failed, a
# transfer stopped mid-rounds): the ranks no longer agree on the group's sequence of
# collectives, so the next one would be matched against a stale one (gloo then aborts the
# process). group -> what happened; weak keys, so a destroyed group is freed with its users.
_OUT_OF_STEP: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_OUT_OF_STEP_GUARD = threading.Lock()
REBUILD = (
    "the process group cannot be used again: rebuild it (dist.new_group, or "
    "destroy_process_group and init_process_group) and pass the new one"
)


def mark_out_of_step(group, what: str) -> None:
    """Record that `group`'s collectives were abandoned part-way on this rank (no-op without a
    group)."""
    if group is not None:
        with _OUT_OF_STEP_GUARD:
            _OUT_OF_STEP.setdefault(group, what)


def out_of_step(group) -> str | None:
    """What abandoned `group`'s collectives on this rank, or None while it is usable."""
    if group is None:
        return None
    with _OUT_OF_STEP_GUARD:
        return _OUT_OF_STEP.get(group)


def _commit(group, rank, world_size, device, timeout_s) -> None:
    try:
        _all_gather_rows([1], group, world_size, device, timeout_s)
    except BaseException as exc:  # a KeyboardInterrupt too: the commit is left unmatched
        what = str(exc) if isinstance(exc, Exception) else repr(exc)
        mark_out_of_step(group, f"a preflight commit failed on rank {rank} ({what})")
        if not isinstance(exc, Exception):
            raise
        raise PreflightError(
            f"preflight commit failed on rank {rank} ({type(exc).__name__}: {exc}); "
            "nothing was written on this rank. A peer that received every commit "
            f"before this rank gave up has begun writing and fails with TransferError; {REBUILD}",
            {rank: [f"commit: {exc}"]},
        ) from exc


def agree(
    reasons: list[str],
    fingerprint,
    group,
    rank: int,
    world_size: int,
    device,
    timeout_s=None,
    gather=None,
    notes=(),
    kinds=(None, None),
) -> None:
    """One all-gather of (ok, fingerprint, entry time, kinds); raise the same PreflightError on
    every rank if any rank failed, the fingerprints differ (`notes`: what shaped this rank's
    layout, named in the error when its plan differs) or the buffers' kinds (source, target:
    `BufferSet.kind`, None for none) differ among the ranks that have one. When the ranks'
    entries were far apart (`COMMIT_SPREAD`), a second tiny all-gather commits before anything
    is written; when a rank's wait had run out before the last rank entered, every rank raises
    at once.
    world_size 1 and no group: purely local. timeout_s bounds every wait on CPU (gloo) tensors;
    NCCL relies on the group's timeout. gather: a `GatherRows` of this group for the first
    all-gather (else one with fresh tensors). A failed wait raises the collective's own error
    (the caller reports it)."""
    timeout_s = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
    words = fingerprint_words(fingerprint)
    mine = [0 if reasons else 1, *words, time.time_ns() // 1000, int(timeout_s * 1e6)]
    mine += [_kind_word(k) for k in kinds]
    if world_size == 1:
        rows = [mine]
    elif gather is not None:
        rows = gather(mine, timeout_s)
    else:
        rows = _all_gather_rows(mine, group, world_size, device, timeout_s)
    _refuse_if_given_up(rows, group)
    # The reference fingerprint is the most common one (ties: the lowest rank's), so the odd
    # rank out is the one named. A rank without a plan (UNAVAILABLE: it already has a reason)
    # is neither the reference nor named for it.
    fps = [tuple(row[1:3]) for row in rows]
    ref_fp, fp_bad = _odd_ones(fps, fingerprint_words(UNAVAILABLE))
    # Two calls of one plan that move different states (exp_avg on one rank, exp_avg_sq on
    # another: the same layout, so the same fingerprint) paired up: the ranks called in
    # different orders. Ranks that name no kind (a plain dict) are not compared.
    kind_bad = {}
    for side, col in (("source", ROW - 2), ("target", ROW - 1)):
        ref_kind, bad = _odd_ones([row[col] for row in rows], 0)
        if bad:
            kind_bad[side] = ([row[col] for row in rows].index(ref_kind), bad)
    if all(row[0] for row in rows) and not fp_bad and not kind_bad:
        # from the smallest timeout of any rank, so that ranks given different timeouts
        # still take the same branch
        shortest = min(row[4] for row in rows) / 1e6
        if world_size > 1 and _arrivals_spread_out([row[3] for row in rows], shortest):
            _commit(group, rank, world_size, device, timeout_s)
        return
    # Second collective only on failure; every rank takes this branch (same `rows` everywhere).
    _raise_failures(
        reasons,
        fingerprint,
        fp_bad,
        fps.index(ref_fp),
        (group, world_size, device, timeout_s),
        notes,
        (kinds, kind_bad),
    )


def _kind_word(kind) -> int:
    """A nonzero int64 standing for a buffers' kind; 0 for none."""
    return 0 if kind is None else (_hash_words("kind " + kind)[0] or 1)


def _odd_ones(values: list, none) -> tuple:
    """(the reference value, the ranks whose value differs from it). The reference is the most
    common value (ties: the lowest rank's), so the odd rank out is the one named; ranks whose
    value is `none` (no plan, no kind) are neither the reference nor named."""
    known = [v for v in values if v != none] or values
    ref = max(known, key=lambda v: (values.count(v), -values.index(v)))
    return ref, [r for r, v in enumerate(values) if v != ref and v != none]


def _refuse_if_given_up(rows, group) -> None:
    """Raise PreflightError, with the group marked out of step, when the rows show that a
    rank's wait ran out before the last rank entered: that rank gave up on this call (its
    all-gather completed here from what it had sent), so neither a commit nor the reasons'
    gather could ever complete; waiting for them would only cost this rank its own timeout.
    Every rank that has the rows decides alike (a skewed clock can only make them all refuse a
    call that could have run)."""
    last = max(range(len(rows)), key=lambda r: rows[r][3])
    gone = [r for r, row in enumerate(rows) if rows[last][3] - row[3] > row[4]]
    if not gone:
        return
    first = gone[0]
    what = (
        f"rank {last} entered the preflight exchange {(rows[last][3] - rows[first][3]) / 1e6:.3g}"
        f" s after rank {first}, whose wait of {rows[first][4] / 1e6:g} s had run out: "
        f"rank{'s' if len(gone) > 1 else ''} {', '.join(map(str, gone))} gave up on this call"
    )
    mark_out_of_step(group, what)
    raise PreflightError(f"{what}; nothing was written; {REBUILD}", {last: [what]})


def _raise_failures(reasons, fingerprint, fp_bad, ref_rank, over, notes=(), kinds=((), {})):
    """Gather every rank's reasons, fingerprint text, notes and kinds; raise the one
    PreflightError. over: (group, world size, device, timeout_s) of the gather. kinds: (this
    rank's (source, target) kinds, {side: (reference rank, ranks whose kind differs)})."""
    group, world_size, device, timeout_s = over
    mine, kind_bad = kinds
    mine = [list(map(str, reasons)), str(fingerprint), list(notes), list(mine)]
    if world_size == 1:
        payload = [mine]
    else:
        blob = json.dumps(mine).encode()
        payload = [
            json.loads(b) for b in _all_gather_bytes(blob, group, world_size, device, timeout_s)
        ]
    all_reasons = [p[0] for p in payload]
    all_fps = [p[1] for p in payload]
    failures: dict[int, list[str]] = {}
    for r in range(world_size):
        rs = list(all_reasons[r])
        if r in fp_bad:
            rs.append(
                f"plan fingerprint {all_fps[r]} differs from rank {ref_rank}'s {all_fps[ref_rank]} "
                "(the ranks planned different transfers)"
            )
        # why this rank's layout may differ from its peers' (or why it could not plan)
        if payload[r][2] and (fp_bad or all_fps[r] == UNAVAILABLE):
            rs.append("its described state: " + "; ".join(payload[r][2]))
        for side, (ref, bad) in kind_bad.items():
            if r in bad:
                col = ("source", "target").index(side)
                rs.append(
                    f"its {side} buffers hold {payload[r][3][col]!r} state, rank {ref}'s hold "
                    f"{payload[ref][3][col]!r}: the ranks paired two different calls (call in "
                    "the same order on every rank)"
                )
        if rs:
            failures[r] = rs
    lines = [f"  rank {r}: {reason}" for r, rs in sorted(failures.items()) for reason in rs]
    raise PreflightError(
        f"preflight failed on {len(failures)} of {world_size} ranks "
        f"({', '.join(map(str, sorted(failures)))}); nothing was written:\n" + "\n".join(lines),
        failures,
    )


# ---------------------------------------------------------------- one call's preflight

DEFAULT_TIMEOUT_S = 300.0
# The fingerprint of a rank that has no usable plan (and says why in its reasons).
UNAVAILABLE = "unavailable"
# The longest wait a timeout may ask for (a year): beyond it datetime arithmetic overflows.
MAX_TIMEOUT_S = 365 * 86400.0
# The shortest: gloo truncates a wait's timeout to whole milliseconds, and 0 means none.
MIN_TIMEOUT_S = 0.001


def timeout_error(timeout) -> Exception | None:
    """The error an unusable `timeout` (seconds for any one wait) deserves, else None."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        return TypeError(
            "timeout must be a number of seconds (a Python int or float: float(x) for a numpy "
            f"scalar), got {type(timeout).__name__} {timeout!r}"
        )
    if isinstance(timeout, int) and timeout > MAX_TIMEOUT_S:  # past float's range, maybe
        return ValueError(f"timeout must be at most {MAX_TIMEOUT_S:.0f} seconds, got {timeout!r}")
    if not math.isfinite(timeout) or timeout <= 0:
        return ValueError(
            f"timeout must be a finite number of seconds > 0, got {timeout!r} (every wait is "
            "bounded: a dead peer must become an error, never a hang)"
        )
    if timeout < MIN_TIMEOUT_S:
        return ValueError(
            f"timeout must be at least {MIN_TIMEOUT_S} seconds (1 ms), got {timeout!r}: gloo "
            "counts whole milliseconds, and 0 ms would mean no limit at all"
        )
    if timeout > MAX_TIMEOUT_S:
        return ValueError(f"timeout must be at most {MAX_TIMEOUT_S:.0f} seconds, got {timeout!r}")
    return None


def staging_needs(transport, message_locations, local_pairs, src_ok, dst_ok):
    """(whether the pinned ring is needed, reasons). Under NCCL, CPU buffers in messages go
    through stage_h2d / stage_d2h and the ring; local copies between CPU and CUDA do too, and
    local copies across any other pair of devices are refused."""
    need_ring, reasons = False, []
    if transport == "nccl":
        need_ring = any(
            bufs[loc].device.type == "cpu"
            for side, bufs in (("send", src_ok), ("recv", dst_ok))
            for loc in message_locations[side]
            if loc in bufs
        )
    for sloc, dloc in local_pairs:
        s, d = src_ok.get(sloc), dst_ok.get(dloc)
        if s is None or d is None or s.device == d.device:
            continue
        if {s.device.type, d.device.type} == {"cpu", "cuda"} and torch.cuda.is_available():
            need_ring = True
        else:
            reasons.append(
                f"source location {sloc} ({s.device}) -> target location {dloc} ({d.device}): "
                "local copies across devices are supported only between CPU and CUDA"
            )
    return need_ring, reasons


class Collected(NamedTuple):
    """This rank's side of a call's preflight: the reasons it must not run (none: it may),
    the validated buffers, the call's `_call_key` (None when a buffer has none) and whether
    that key is the last cleared call's (`short`: the per-buffer checks were skipped)."""

    reasons: list
    src: dict
    dst: dict
    key: tuple | None
    need_ring: bool
    short: bool
    notes: tuple | list = ()  # the buffer objects' notes (BufferSet.notes)
    # a KeyboardInterrupt / SystemExit raised here (by a hook, mostly): a reason like any
    # other, raised again on this rank once every rank has heard of it
    interrupt: BaseException | None = None
    kinds: tuple = (None, None)  # the source and target buffer sets' kinds (BufferSet.kind)


def layout_difference(have: Layout, want: Layout) -> str | None:
    """The first way `have` (a buffer object's own layout) cannot stand for `want` (the plan's
    side), else None. It may hold more tensors than the plan names (a plan over a subset);
    every tensor and every storage of `want` must be in it, equal (tensors first: a name says
    more than a storage's extent)."""
    for name, tl in want.tensors.items():
        other = have.tensors.get(name)
        if other is tl:
            continue
        if other is None:
            return f"tensor {name!r} of the plan is not in the buffers' layout"
        if other.shape != tl.shape:
            return f"tensor {name!r}: shape {tl.shape} in the plan, {other.shape} in the buffers' layout"
        if other != tl:
            i = next(
                (i for i in range(min(len(tl), len(other))) if tl.piece(i) != other.piece(i)),
                min(len(tl), len(other)),
            )
            mine = tl.piece(i) if i < len(tl) else "none"
            theirs = other.piece(i) if i < len(other) else "none"
            return (
                f"tensor {name!r}: laid out differently (piece {i}: {mine} in the plan, "
                f"{theirs} in the buffers' layout)"
            )
    for loc, st in want.storages.items():
        other = have.storages.get(loc)
        if other is None:
            return f"storage {loc} of the plan is not in the buffers' layout"
        if other != st:
            return f"storage {loc}: {st} in the plan, {other} in the buffers' layout"
    return None


def layout_reasons(ctx, sets: dict) -> list[str]:
    """The buffer objects whose own `.layout` disagrees with the plan's side. A layout that
    agreed once is remembered by identity on `ctx` (a repeated sync compares nothing)."""
    seen = ctx.__dict__.setdefault("layouts_seen", {})
    reasons = []
    for side, (bs, want) in sets.items():
        have = bs.layout
        if have is None or have is want or seen.get(side) is have:
            continue
        why = layout_difference(have, want)
        if why:
            reasons.append(
                f"the {side} buffers' layout ({bs.source}.layout) differs from the plan's "
                f"{side} layout: {why}"
            )
        else:
            seen[side] = have
    return reasons


def as_checks(checks) -> tuple[list, str | None]:
    """(the extra readiness checks as a list, why `checks` is unusable or None). Per call, so
    its reason goes through the collective like any other."""
    if isinstance(checks, (str, bytes)) or callable(checks) or not hasattr(checks, "__iter__"):
        hint = " (pass checks=(fn,))" if callable(checks) else ""
        return [], (
            f"TypeError: checks must be an iterable of callables, got {type(checks).__name__} "
            f"{checks!r}{hint}"
        )
    checks = list(checks)
    for i, check in enumerate(checks):
        if not callable(check):
            return [], (
                f"TypeError: checks[{i}] must be callable, got {type(check).__name__} {check!r}"
            )
    return checks, None


_PLAN_ATTRS = ("schedule", "staging_bytes", "fingerprint", "src", "dst")


def plan_problem(plan) -> str | None:
    """Why `plan` is not a plan the executor can run (a Layout passed where the Plan belongs),
    else None."""
    missing = [a for a in _PLAN_ATTRS if not hasattr(plan, a)]
    if not missing:
        return None
    hint = (
        ": plan the two layouts first (reshard.plan(src, dst)), or use reshard.Transfer(src, dst)"
        if type(plan).__name__ == "Layout"
        else ""
    )
    return (
        f"TypeError: expected a Plan (reshard.plan(src, dst)), got {type(plan).__name__}"
        f" (it has no {', '.join(missing)}){hint}"
    )


def collect(ctx, src_buffers, dst_buffers, checks, timeout) -> Collected:
    """Every check of this rank before the collective exchange. `ctx` is the executor's
    engine for this plan and rank (`prepare()` builds and checks the schedule once,
    `allocate()` the staging, `verified_placement` / `verified_need_ring` the placement of
    the last buffers that passed here and whether they needed the pinned ring,
    `verified_buffers` the (`_call_key`, need_ring) of the last call that cleared preflight on
    every rank, set by `run`). Nothing here raises: an exception (a list where a dict belongs,
    a schedule that cannot be built, an allocation) is a reason of this rank, so every rank
    learns of it. A KeyboardInterrupt or SystemExit is a reason too (kept in `interrupt`):
    raised here, it would leave this rank out of its peers' exchange, and its next call would
    be paired with the call they are still waiting in."""
    reasons, src_ok, dst_ok, key, need_ring, short, notes = [], {}, {}, None, False, False, []
    interrupt, kinds = None, (None, None)
    bad_timeout = timeout_error(timeout)
    if bad_timeout:
        reasons.append(f"{type(bad_timeout).__name__}: {bad_timeout}")
    try:
        checks, bad_checks = as_checks(checks)
        if bad_checks:
            reasons.append(bad_checks)
        bad_plan = plan_problem(ctx.plan)
        if bad_plan:  # nothing else can be checked against it
            return Collected([*reasons, bad_plan], src_ok, dst_ok, key, need_ring, short)
        reasons += ctx.prepare()
        # the hooks first: one may change what a buffer is (swap a tensor's .data, free or
        # resize its storage), and every check below, the short path's key included, must
        # read the buffers as the transfer will find them
        src_hooks = readiness_hooks(src_buffers, "src")
        dst_hooks = readiness_hooks(dst_buffers, "dst")
        reasons += hook_reasons([*src_hooks, *dst_hooks, *checks])
        src = as_buffer_set(src_buffers, "src", src_hooks)
        dst = as_buffer_set(dst_buffers, "dst", dst_hooks)
        notes, kinds = [*src.notes, *dst.notes], (src.kind, dst.kind)
        reasons += layout_reasons(
            ctx, {"source": (src, ctx.plan.src), "target": (dst, ctx.plan.dst)}
        )
        key = _call_key(ctx, src.buffers, dst.buffers)
        cleared = getattr(ctx, "verified_buffers", None)
        short = key is not None and cleared is not None and key == cleared[0]
        if short:
            # every per-buffer input and the placement equal the last cleared call's: that
            # call's key object stands for them (what the executor derived from it holds)
            key = cleared[0]
            src_ok, dst_ok, need_ring = src.buffers, dst.buffers, cleared[1]
            reasons += writable_targets(ctx).reasons(dst_ok, key)
            if not reasons:
                reasons += _allocate(ctx, src_ok, dst_ok, need_ring, key)
        else:
            more, src_ok, dst_ok = buffer_checks(
                ctx.plan, ctx.rank, ctx.world_size, ctx.transport, src, dst
            )
            reasons += more + writable_targets(ctx).reasons(dst_ok, key)
            if not reasons:
                reasons += _placement_checks(ctx, src_ok, dst_ok, key)
                need_ring = ctx.verified_need_ring
    except BaseException as exc:  # noqa: BLE001 - collective: every rank must hear of it
        if isinstance(exc, Exception):
            reasons.append(f"{type(exc).__name__}: {exc}")
        else:
            interrupt = exc
            said = f": {exc}" if str(exc) else ""
            reasons.append(f"{type(exc).__name__} on this rank during its preflight{said}")
    return Collected(reasons, src_ok, dst_ok, key, need_ring, short, notes, interrupt, kinds)


def _placement_checks(ctx, src_ok, dst_ok, key=None) -> list[str]:
    """The memory checks and what the staging needs depend only on the buffers' `placement`:
    a call that passes buffers where the last passing call had them skips them. The staging
    is allocated last on every call (it needs validated buffers to know whether the pinned
    ring is needed; it allocates nothing while its arenas are in place, and a staging shared
    by several Transfers may have dropped them)."""
    where = placement(src_ok, dst_ok)
    if where == ctx.verified_placement:
        need_ring = ctx.verified_need_ring
    else:
        reasons = memory_checks(src_ok, dst_ok, ctx.written, ctx.local_pairs)
        if reasons:
            return reasons
        need_ring, reasons = staging_needs(
            ctx.transport, ctx.message_locations, ctx.local_pairs, src_ok, dst_ok
        )
        if reasons:
            return reasons
    reasons = _allocate(ctx, src_ok, dst_ok, need_ring, key)
    if not reasons:
        ctx.verified_placement, ctx.verified_need_ring = where, need_ring
    return reasons


def _allocate(ctx, src_ok, dst_ok, need_ring, key=None) -> list[str]:
    try:
        ctx.allocate(src_ok, dst_ok, need_ring, buffers_key=key)
    except (torch.OutOfMemoryError, RuntimeError, MemoryError) as exc:
        return [f"staging allocation failed: {type(exc).__name__}: {exc}"]
    return []


def _gather_rows(ctx, device) -> GatherRows | None:
    """The engine's `GatherRows` (made on first use) when its exchange runs over CPU tensors
    on 2 or more ranks; None otherwise (NCCL gathers device tensors made per call)."""
    if ctx.world_size == 1 or device.type != "cpu" or ctx.group is None:
        return None
    gather = getattr(ctx, "gather_rows", None)
    if gather is None:
        gather = ctx.gather_rows = GatherRows(ctx.group, ctx.world_size)
    return gather


class Cleared(NamedTuple):
    """What a passed preflight hands the rounds: the validated buffers, the plan's
    fingerprint, the timeout of every wait, the preflight's own seconds ("preflight" for all
    of it, "exchange" for the collective part), and `same_buffers`: every buffer has, location
    by location, the address, storage, dtype, shape, strides and device (targets also
    requires_grad and inference) of the previous call that cleared preflight on this engine,
    so whatever the rounds derived from those alone then still holds."""

    src: dict
    dst: dict
    fingerprint: str
    timeout_s: float
    seconds: dict
    same_buffers: bool = False


def _refuse_out_of_step(ctx) -> None:
    why = out_of_step(ctx.group)
    if why is not None:  # touching the group again could abort the process
        raise PreflightError(
            f"rank {ctx.rank}: {why} in an earlier call, so the ranks no longer agree on the "
            f"group's collectives; {REBUILD}. Nothing was written",
            {ctx.rank: [why]},
        )


def _exchange(ctx, reasons, fingerprint, timeout_s, notes=(), kinds=(None, None)) -> None:
    """`agree` over the context's group; a failed exchange marks the group out of step."""
    device = ctx.exchange_device if ctx.transport == "nccl" else torch.device("cpu")
    gather = _gather_rows(ctx, device)
    try:
        agree(
            reasons,
            fingerprint,
            ctx.group,
            ctx.rank,
            ctx.world_size,
            device,
            timeout_s,
            gather,
            notes,
            kinds,
        )
    except PreflightError:
        raise
    except BaseException as exc:  # the exchange itself failed (a peer died or timed out), or
        # was interrupted part-way: either way this rank left collectives unmatched
        ctx.gather_rows = None  # its tensors may still be in use: fresh ones next time
        what = str(exc) if isinstance(exc, Exception) else repr(exc)
        mark_out_of_step(ctx.group, f"a preflight exchange failed on rank {ctx.rank} ({what})")
        if not isinstance(exc, Exception):
            raise
        raise PreflightError(
            f"preflight exchange failed on rank {ctx.rank} ({type(exc).__name__}: {exc}); "
            f"nothing was written on this rank; {REBUILD}",
            {ctx.rank: [str(exc)]},
        ) from exc


def refuse(ctx, reasons, timeout, notes=()) -> None:
    """This rank's side of a call it cannot make (it failed to get its buffers ready, for
    `reasons`) while its peers make it: it joins their preflight exchange with those reasons,
    so every rank raises the same PreflightError and nothing is written anywhere. `ctx.plan`
    may be None (this rank could not plan): its fingerprint is then not compared, and its
    `notes` (how its state shaped its layout) are listed. Raises always."""
    _refuse_out_of_step(ctx)
    reasons = [str(r) for r in reasons] or ["the call was refused on this rank"]
    timeout_s = DEFAULT_TIMEOUT_S if timeout_error(timeout) else float(timeout)
    if ctx.plan is None or plan_problem(ctx.plan):
        fingerprint = UNAVAILABLE
    else:
        fingerprint = ctx.plan.fingerprint
    _exchange(ctx, reasons, fingerprint, timeout_s, notes)
    raise AssertionError("agree() returned with reasons")  # unreachable: it raises


def run(ctx, src_buffers, dst_buffers, checks, timeout) -> Cleared:
    """One call's whole preflight: `collect`, then `agree` over `ctx.group`. Returns when
    every rank may write; raises the same PreflightError on every rank otherwise. An unusable
    timeout is a reason; the exchange itself then waits DEFAULT_TIMEOUT_S."""
    t0 = time.perf_counter()
    _refuse_out_of_step(ctx)
    got = collect(ctx, src_buffers, dst_buffers, checks, timeout)
    reasons = got.reasons
    timeout_s = DEFAULT_TIMEOUT_S if timeout_error(timeout) else float(timeout)
    try:
        # not a plan: one reason already says so (the same text on every rank that erred alike)
        fingerprint = ctx.plan.fingerprint if not plan_problem(ctx.plan) else UNAVAILABLE
    except Exception as exc:  # noqa: BLE001 - a reason like any other
        fingerprint = f"unavailable on rank {ctx.rank}"
        reasons.append(f"plan fingerprint: {type(exc).__name__}: {exc}")
    t1 = time.perf_counter()
    try:
        _exchange(ctx, reasons, fingerprint, timeout_s, got.notes, got.kinds)
    except PreflightError:
        if got.interrupt is not None:  # every rank has heard of it: stop as it asked
            raise got.interrupt  # noqa: B904 - its context is the PreflightError
        raise
    t2 = time.perf_counter()
    # cleared on every rank: the rounds run with these buffers, so the next call whose
    # buffers read the same may skip their checks and what the rounds derive from them. On
    # the short path the kept entry is already these buffers' (`collect` handed its key on):
    # one key object per set of buffers, so the executor tells them apart by identity.
    if not got.short:
        ctx.verified_buffers = (got.key, got.need_ring) if got.key is not None else None
    seconds = {"preflight": t2 - t0, "exchange": t2 - t1}
    return Cleared(got.src, got.dst, str(fingerprint), timeout_s, seconds, got.short)
