"""Stream full tensors by name to receiver ranks, bucket by bucket, with bounded memory.

    stream = rs.Stream(src_layout, receivers=[0], bucket_bytes=256 << 20, dtype=torch.bfloat16)
    for name, tensor in stream(src_buffers):     # every rank of the group iterates
        engine.load_weights([(name, tensor)])    # receivers get full tensors; others nothing

Inference engines that load weights by name (vLLM's `load_weights`, SGLang's
`update_weights_from_tensor`) want full logical tensors, one at a time. A Stream cuts the
chosen tensors into buckets of at most `bucket_bytes` (in the streamed dtype) and moves each
bucket with one planned transfer into a buffer on every receiver; the tensors it yields are
views of that buffer. Planning happens once, in the constructor: every call reuses the
per-bucket plans.

Memory (receivers): one buffer of `buffer_bytes` bytes, allocated on the first call and kept.
Bucket k sits at the start of that buffer when k is even and at its end when k is odd, so two
consecutive buckets never overlap and the next one can move while the caller holds the current
one. `buffer_bytes` is the largest size of two consecutive buckets, at most `bucket_bytes +
max(bucket_bytes, largest tensor)`; a tensor larger than `bucket_bytes` is a bucket of its own.
On top of that every rank holds the staging of one bucket's transfer at a time (the executor's
arenas, capped per rank by `staging_bytes_per_rank`), freed when that bucket has landed.
`staging_bytes(rank)` states the whole bound; each call's `report` says what was held.

Overlap (what runs at the same time): every transfer runs on the Stream's one worker thread, in
bucket order, so the group sees the same sequence of collectives on every rank. While a
receiver's caller consumes bucket k, the worker moves bucket k+1 (preflight, pack, transport,
unpack); the worker starts bucket k+2 only after the caller asked for the tensor after bucket
k's last one (bucket k+2 reuses bucket k's half of the buffer). Two consecutive buckets that do
not fit the buffer together (two single-tensor buckets larger than `bucket_bytes`) do not
overlap: the second starts once the first is consumed. Ranks that receive nothing run the
buckets back to back. The worker's Python bookkeeping shares the GIL with the caller; the
copies and waits release it. Within a bucket the executor overlaps packing one round with the
transport of the previous one.

Errors: names, dtype, receivers and sizes are checked in the constructor (the same ValueError
on every rank, since every rank builds the same Stream). Every source buffer the whole stream
reads is checked in the first bucket's collective preflight (and the buffer set's readiness hook
runs there), so a bad or missing buffer anywhere raises the same PreflightError on every rank
before anything is yielded or written. Every rank must iterate the stream to its end; a caller
that stops early (break, an exception in the loop body) closes the generator, which then moves
the remaining buckets without yielding them, so its peers finish normally.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import math
import time
from collections.abc import Mapping

import torch
import torch.distributed as dist

from .layout import Layout, Piece, Storage, TensorLayout
from .planning import plan as make_plan
from .report import PHASES, STAGING_KINDS, Report

__all__ = ["Stream"]

_ALIGN = 16  # bytes: every tensor and every dtype group starts 16-byte aligned in the buffer
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_DEFAULT_TIMEOUT_S = 300.0


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _group_info(group):
    """(rank, world size, backend) of the group the stream runs over; no process group: local."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 0, 1, "local"
    g = dist.group.WORLD if group is None else group
    if g is dist.GroupMember.NON_GROUP_MEMBER or dist.get_rank(g) < 0:
        raise ValueError(
            f"global rank {dist.get_rank()} is not a member of the stream's process group: "
            "only the group's members build and iterate a stream on that group"
        )
    return dist.get_rank(g), dist.get_world_size(g), str(dist.get_backend(g)).lower()


class _Bucket:
    """One bucket: its tensors (stream order), where each sits, and the plan that moves it."""

    __slots__ = (
        "index",
        "names",
        "entries",
        "groups",
        "nbytes",
        "start",
        "targets",
        "plan",
        "src_locations",
    )

    def __init__(self, index, names):
        self.index = index
        self.names = names
        self.entries = []  # (name, shape, dtype, byte offset within the bucket), stream order
        self.groups = {}  # dtype -> (first byte, end byte) of its tensors within the bucket
        self.nbytes = 0
        self.start = 0  # byte offset of the bucket in the receivers' buffer
        self.targets = {}  # target location -> (receiver index, dtype)
        self.plan = None
        self.src_locations = ()


class Stream:
    """Full tensors by name, bucket by bucket, to `receivers`; see the module docstring.

    src_layout: an `rs.Layout` (e.g. `reshard.integrations.deepspeed.describe(engine,
        "param").layout`), the same on every rank.
    receivers: ranks of `group` that receive every tensor.
    bucket_bytes: bytes per bucket in the streamed dtype (a larger tensor is its own bucket).
    dtype: the dtype tensors arrive in (fp32/bf16/fp16 casts happen on the way, narrowing on the
        sender); None keeps each tensor's source dtype.
    names: the tensors to stream, in this order (default: every tensor of `src_layout`, in its
        order).
    group: the process group (default: the world; no process group: in-process, rank 0).
    device: where receivers' tensors live (default: the current CUDA device under NCCL, else
        the CPU).
    staging_bytes_per_rank: cap on one bucket transfer's staging arenas on any rank (default
        `min(bucket_bytes // 4, 64 MiB)`, at least 64 KiB).
    timeout: seconds any single wait may take (gloo); a receiver's consumption of one bucket
        counts against its peers' wait for the next.
    """

    def __init__(
        self,
        src_layout,
        receivers=(0,),
        bucket_bytes=256 << 20,
        dtype=None,
        names=None,
        group=None,
        *,
        device=None,
        staging_bytes_per_rank=None,
        timeout=_DEFAULT_TIMEOUT_S,
    ):
        if not isinstance(src_layout, Layout):
            raise TypeError(
                f"Stream(src_layout): expected a reshard.Layout, got {type(src_layout).__name__}"
                " (for a DeepSpeed engine pass describe(engine, kind).layout)"
            )
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype or None, got {dtype!r}")
        self.rank, self.world_size, self._backend = _group_info(group)
        self.group = group
        self.receivers = _check_receivers(receivers, self.world_size)
        self.names = _check_names(names, src_layout)
        self.dtype = dtype
        self.bucket_bytes = bucket_bytes
        self.timeout = float(timeout)
        if staging_bytes_per_rank is None:
            staging_bytes_per_rank = max(min(bucket_bytes // 4, 64 << 20), 64 << 10)
        if (
            isinstance(staging_bytes_per_rank, bool)
            or not isinstance(staging_bytes_per_rank, int)
            or staging_bytes_per_rank < 1
        ):
            raise ValueError(
                f"staging_bytes_per_rank must be a positive int, got {staging_bytes_per_rank!r}"
            )
        self.staging_bytes_per_rank = staging_bytes_per_rank
        self.device = self._resolve_device(device)
        self._src = src_layout
        out_dtypes = {n: _out_dtype(n, src_layout, dtype) for n in self.names}
        self.buckets = self._make_buckets(out_dtypes)
        self.buffer_bytes = self._place_buckets()
        t0 = time.perf_counter()
        for b in self.buckets:
            self._plan_bucket(b)
        self.plan_seconds = time.perf_counter() - t0
        digest = hashlib.sha256()
        for b in self.buckets:
            digest.update(f"{b.names}|{b.start}|{b.plan.fingerprint};".encode())
        self.fingerprint = digest.hexdigest()[:32]
        self._buffer = None  # the receivers' buffer, allocated on the first call
        self._buffer_error = None
        self._active = False  # a call is being iterated (calls are not reentrant)
        self._pool = None  # the worker thread, started by the first call
        self.report = None  # the last completed call's Report

    # ------------------------------------------------------------------ construction

    def _resolve_device(self, device):
        if device is not None:
            device = torch.device(device)
            if self._backend == "gloo" and device.type != "cpu":
                raise ValueError(
                    f"device {device}: the gloo transport delivers into CPU memory; use "
                    "device='cpu' or an NCCL group"
                )
            if device.type == "cuda" and device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            return device
        if "nccl" in self._backend and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _make_buckets(self, out_dtypes):
        """Greedy in stream order: a bucket closes when the next tensor would overflow it.
        Inside a bucket the tensors are grouped by dtype (one storage per dtype and receiver)."""
        runs, cur, used = [], [], 0
        for name in self.names:
            n = _aligned(self._src.tensors[name].numel * out_dtypes[name].itemsize)
            if cur and used + n > self.bucket_bytes:
                runs.append(cur)
                cur, used = [], 0
            cur.append((name, n))
            used += n
        if cur:
            runs.append(cur)
        buckets = []
        for i, items in enumerate(runs):
            b = _Bucket(i, [name for name, _ in items])
            by_dtype = {}
            for name, n in items:
                by_dtype.setdefault(out_dtypes[name], []).append((name, n))
            offset = 0
            for dt, members in by_dtype.items():
                lo = offset
                for name, n in members:
                    b.entries.append((name, tuple(self._src.tensors[name].shape), dt, offset))
                    offset += n
                b.groups[dt] = (lo, offset)
            b.nbytes = offset
            pos = {name: k for k, name in enumerate(b.names)}
            b.entries.sort(key=lambda e: pos[e[0]])
            buckets.append(b)
        return buckets

    def _place_buckets(self) -> int:
        """Even buckets at the start of the buffer, odd ones at its end; returns its size: the
        largest bucket, or the largest pair of consecutive buckets that overlap."""
        size = max((b.nbytes for b in self.buckets), default=0)
        for k in range(len(self.buckets) - 1):
            if self._overlaps(k):
                size = max(size, self.buckets[k].nbytes + self.buckets[k + 1].nbytes)
        for k, b in enumerate(self.buckets):
            b.start = 0 if k % 2 == 0 else size - b.nbytes
        return size

    def _overlaps(self, k) -> bool:
        """May bucket k+1 move while bucket k is consumed? Not for two oversized buckets."""
        return not (
            self.buckets[k].nbytes > self.bucket_bytes
            and self.buckets[k + 1].nbytes > self.bucket_bytes
        )

    def _plan_bucket(self, b):
        """Source: the bucket's tensors and the storages they read. Target: one storage per
        (receiver, dtype) holding that dtype's tensors back to back at their bucket offsets."""
        dst_storages, loc_of = {}, {}
        for j, r in enumerate(self.receivers):
            for dt, (lo, hi) in b.groups.items():
                loc = len(dst_storages)
                dst_storages[loc] = Storage(r, dt, (hi - lo) // dt.itemsize)
                loc_of[(j, dt)] = loc
                b.targets[loc] = (j, dt)
        src_tensors, dst_tensors, src_locs = {}, {}, set()
        for name, shape, dt, off in b.entries:
            tl = self._src.tensors[name]
            if tl.numel == 0:
                continue  # nothing to move: yielded as an empty view
            src_tensors[name] = tl
            src_locs.update(p.location for p in tl.pieces)
            elem = (off - b.groups[dt][0]) // dt.itemsize
            zeros = (0,) * len(shape)
            dst_tensors[name] = TensorLayout(
                shape,
                [Piece(loc_of[(j, dt)], elem, zeros, shape) for j in range(len(self.receivers))],
                name=name,
            )
        src = Layout(src_tensors, {loc: self._src.storages[loc] for loc in sorted(src_locs)})
        dst = Layout(dst_tensors, dst_storages)
        b.plan = make_plan(src, dst, budget_bytes_per_rank=self.staging_bytes_per_rank)
        b.src_locations = tuple(sorted(src_locs))

    # ------------------------------------------------------------------ the bound

    def staging_bytes(self, rank=None, transport=None, host_ring_bytes=0) -> dict:
        """The most memory a call holds on `rank` beyond the caller's own tensors, by kind
        (`{"device", "host_pinned", "host"}`): the receivers' buffer plus the largest staging
        of one bucket's transfer (`Plan.staging_bytes`; `host_ring_bytes`: the executor's pinned
        ring when CPU buffers meet CUDA ones)."""
        rank = self.rank if rank is None else rank
        if transport is None:
            transport = "nccl" if self.device.type == "cuda" else "gloo"
        out = dict.fromkeys(STAGING_KINDS, 0)
        if rank in self.receivers:
            out["device" if self.device.type == "cuda" else "host"] += self.buffer_bytes
        worst = dict.fromkeys(STAGING_KINDS, 0)
        for b in self.buckets:
            s = b.plan.staging_bytes(rank, transport=transport, host_ring_bytes=host_ring_bytes)
            for k in STAGING_KINDS:
                worst[k] = max(worst[k], int(s.get(k, 0)))
        return {k: out[k] + worst[k] for k in STAGING_KINDS}

    @property
    def plans(self) -> list:
        """The per-bucket plans (computed once, in the constructor)."""
        return [b.plan for b in self.buckets]

    def describe(self) -> str:
        lines = [
            f"Stream: {len(self.names)} tensors in {len(self.buckets)} buckets of <= "
            f"{self.bucket_bytes} B to ranks {self.receivers}; receiver buffer "
            f"{self.buffer_bytes} B on {self.device}; staging <= {self.staging_bytes_per_rank}"
            " B per rank per bucket"
        ]
        for b in self.buckets:
            lines.append(
                f"  bucket {b.index}: {len(b.names)} tensors, {b.nbytes} B at buffer byte "
                f"{b.start}, {b.plan.num_rounds} rounds"
            )
        return "\n".join(lines)

    # ------------------------------------------------------------------ a call

    def __call__(self, src_buffers):
        """A generator of (name, tensor): full tensors on receivers, nothing elsewhere.

        src_buffers: {location: tensor} for the source locations this rank owns, or an object
        with `.buffers` and an optional `.check()` readiness hook (a DeepSpeed `describe()`
        result). A yielded tensor is a view of the stream's buffer, valid until the next
        iteration: copy it to keep it.
        """
        return self._run(src_buffers)

    def _buffers_and_hooks(self, src_buffers):
        if isinstance(src_buffers, Mapping):
            return dict(src_buffers), []
        bufs = getattr(src_buffers, "buffers", None)
        if not isinstance(bufs, Mapping):
            raise TypeError(
                "src_buffers must be a mapping {location: tensor} or an object with a "
                f"`.buffers` mapping, got {type(src_buffers).__name__}"
            )
        check = getattr(src_buffers, "check", None)
        return dict(bufs), [check] if callable(check) else []

    def _check_sources(self, bufs):
        """Every source buffer the whole stream reads on this rank, and the receiver's buffer
        (run in the first bucket's preflight, so a problem anywhere stops the stream on every
        rank before anything is written or yielded)."""
        reasons = []
        used = sorted({loc for b in self.buckets for loc in b.src_locations})
        for loc in used:
            st = self._src.storages[loc]
            if st.rank != self.rank:
                continue
            t = bufs.get(loc)
            if loc not in bufs:
                reasons.append(f"source location {loc} (owned by rank {self.rank}) is missing")
            elif t is None:
                reasons.append(f"source location {loc} has no buffer (None: not ready)")
            elif not isinstance(t, torch.Tensor):
                reasons.append(f"source location {loc}: expected a tensor, got {type(t).__name__}")
            else:
                bad = []
                if t.dtype != st.dtype:
                    bad.append(f"dtype {t.dtype}, storage declares {st.dtype}")
                if t.dim() != 1 or not t.is_contiguous():
                    bad.append(f"must be 1-D contiguous, got shape {tuple(t.shape)}")
                if t.numel() != st.numel:
                    bad.append(f"has {t.numel()} elements, storage declares {st.numel}")
                if self._backend == "gloo" and t.device.type != "cpu":
                    bad.append(f"is on {t.device}, but the gloo transport needs CPU buffers")
                if bad:
                    reasons.append(f"source location {loc}: " + "; ".join(bad))
        for loc in bufs:
            if loc not in self._src.storages:
                reasons.append(f"source location {loc} does not exist in the source layout")
            elif self._src.storages[loc].rank != self.rank:
                owner = self._src.storages[loc].rank
                reasons.append(f"source location {loc} is owned by rank {owner}, not {self.rank}")
        if self._buffer_error is not None:
            reasons.append(self._buffer_error)
        if reasons:
            raise ValueError("; ".join(reasons))

    def _allocate_buffer(self):
        """The receivers' buffer, once; a failure becomes a preflight reason of the first
        bucket."""
        self._buffer_error = None
        if self.rank not in self.receivers or self._buffer is not None:
            return
        try:
            self._buffer = torch.empty(self.buffer_bytes, dtype=torch.uint8, device=self.device)
        except (RuntimeError, MemoryError) as exc:
            self._buffer_error = (
                f"receiver buffer of {self.buffer_bytes} B on {self.device} could not be "
                f"allocated ({type(exc).__name__}: {exc})"
            )

    def _targets(self, b):
        """This rank's target views of bucket b: {location: 1-D view of the buffer}."""
        if self.rank not in self.receivers or self._buffer is None:
            return {}
        me = self.receivers.index(self.rank)
        out = {}
        for loc, (j, dt) in b.targets.items():
            if j == me:
                lo, hi = b.groups[dt]
                out[loc] = self._buffer[b.start + lo : b.start + hi].view(dt)
        return out

    def _views(self, b):
        for name, shape, dt, off in b.entries:
            first = b.start + off
            view = self._buffer[first : first + math.prod(shape) * dt.itemsize].view(dt)
            yield name, view.view(shape)

    def _transfer(self, b, bufs, checks, cuda_device):
        """Run bucket b (on the worker thread). A fresh executor engine per bucket, so only one
        bucket's staging exists at a time; the plan is reused."""
        from .executor import Transfer

        if cuda_device is not None:
            torch.cuda.set_device(cuda_device)
        transfer = Transfer.from_plan(b.plan, group=self.group, timeout=self.timeout)
        src = {
            loc: bufs[loc]
            for loc in b.src_locations
            if loc in bufs and self._src.storages[loc].rank == self.rank
        }
        rep = transfer(src, self._targets(b), checks=checks)
        if cuda_device is not None:
            torch.cuda.current_stream().synchronize()  # landed before the caller reads it
        return rep

    def _run(self, src_buffers):
        bufs, hooks = self._buffers_and_hooks(src_buffers)
        if self._active:
            raise RuntimeError(
                "this Stream is already being iterated: finish (or close) that iteration "
                "first; its buffer holds the tensors it yields"
            )
        self._active = True
        try:
            yield from self._iterate(bufs, hooks)
        finally:
            self._active = False

    def _iterate(self, bufs, hooks):
        t_start = time.perf_counter()
        self._allocate_buffer()
        cuda_device = self.device.index if self.device.type == "cuda" else None
        if cuda_device is None and "nccl" in self._backend and torch.cuda.is_available():
            cuda_device = torch.cuda.current_device()
        receiving = self.rank in self.receivers and self._buffer is not None
        nb = len(self.buckets)
        reports = []
        state = {"pending": None, "next": 0, "waited": 0.0, "failed": False}
        if self._pool is None:
            # one worker thread for the Stream's life: its allocator arena (the transfers'
            # staging) is reused by every call instead of a new thread's arena each time
            self._pool = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="reshard-stream"
            )
        pool = self._pool

        def start():
            k = state["next"]
            if cuda_device is not None:
                # the caller's kernels may still read the half of the buffer about to be reused
                torch.cuda.current_stream(cuda_device).synchronize()
            checks = [*hooks, lambda: self._check_sources(bufs)] if k == 0 else []
            state["pending"] = pool.submit(
                self._transfer, self.buckets[k], bufs, checks, cuda_device
            )
            state["next"] = k + 1

        def finish():
            t0 = time.perf_counter()
            try:
                reports.append(state["pending"].result())
            except BaseException:
                state["failed"] = True
                raise
            finally:
                state["pending"] = None
                state["waited"] += time.perf_counter() - t0

        completed = False
        try:
            if nb:
                start()
            for k in range(nb):
                finish()  # bucket k has landed
                if state["next"] < nb and self._overlaps(k):
                    start()  # bucket k+1 moves while the caller consumes bucket k
                if receiving:
                    yield from self._views(self.buckets[k])
                if state["pending"] is None and state["next"] < nb:
                    start()
            completed = True
        finally:
            try:
                # Stopped early by the caller: the peers expect every bucket, so move the rest
                # without yielding. After a failed transfer the peers failed too: stop.
                if not completed and not state["failed"]:
                    if state["pending"] is not None:
                        finish()
                    while state["next"] < nb:
                        start()
                        finish()
            finally:
                if state["pending"] is not None:
                    state["pending"].exception()  # wait: nothing may write after we return
        self.report = self._report(reports, time.perf_counter() - t_start, state["waited"])

    # ------------------------------------------------------------------ the report

    def _report(self, reports, total, waited) -> Report:
        """One Report for the whole call: sums over buckets; staging = the receivers' buffer
        plus the largest single bucket's staging (buckets run one at a time)."""
        first = reports[0] if reports else None
        rep = Report(
            rank=self.rank,
            world_size=self.world_size,
            transport=first.transport if first else self._backend,
            rounds=sum(r.rounds for r in reports),
            fingerprint=self.fingerprint,
        )
        for r in reports:
            for peer, n in r.bytes_sent.items():
                rep.bytes_sent[peer] = rep.bytes_sent.get(peer, 0) + n
            for peer, n in r.bytes_received.items():
                rep.bytes_received[peer] = rep.bytes_received.get(peer, 0) + n
            rep.local_bytes += r.local_bytes
            rep.zero_copy_bytes += r.zero_copy_bytes
            for p in PHASES:
                rep.seconds[p] += r.seconds[p]
        buf_kind = "device" if self.device.type == "cuda" else "host"
        held = self.buffer_bytes if self.rank in self.receivers and self._buffer is not None else 0
        for k in STAGING_KINDS:
            rep.peak_staging_bytes[k] = max((r.peak_staging_bytes[k] for r in reports), default=0)
            rep.staging_bound[k] = max((r.staging_bound[k] for r in reports), default=0)
        rep.peak_staging_bytes[buf_kind] += held
        rep.staging_bound[buf_kind] += held
        rep.seconds["total"] = total
        rep.seconds["plan"] = 0.0
        rep.buckets = len(reports)
        # time the caller's thread blocked on a bucket still in flight (not hidden by overlap)
        rep.wait_seconds = waited
        return rep


# ---------------------------------------------------------------------- validation


def _check_receivers(receivers, world):
    if isinstance(receivers, int) and not isinstance(receivers, bool):
        receivers = [receivers]
    try:
        rs_ = list(receivers)
    except TypeError:
        raise ValueError(f"receivers must be a list of ranks, got {receivers!r}") from None
    if not rs_:
        raise ValueError("receivers is empty: name at least one rank that receives the tensors")
    for r in rs_:
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < world:
            raise ValueError(f"receiver {r!r} is not a rank of the group (size {world})")
    if len(set(rs_)) != len(rs_):
        raise ValueError(f"receivers {rs_} name a rank twice")
    return rs_


def _check_names(names, layout):
    if names is None:
        names = list(layout.tensors)
        if not names:
            raise ValueError("the source layout has no tensors: nothing to stream")
        return names
    if isinstance(names, str):
        raise ValueError(f"names must be a list of tensor names, got the string {names!r}")
    names = list(names)
    if not names:
        raise ValueError("names is empty: nothing to stream")
    bad = [n for n in names if not isinstance(n, str)]
    if bad:
        raise ValueError(f"names must be strings, got {bad[:3]!r}")
    unknown = [n for n in names if n not in layout.tensors]
    if unknown:
        known = list(layout.tensors)
        raise ValueError(
            f"{len(unknown)} name(s) not in the source layout: {unknown[:5]}"
            f"{' ...' if len(unknown) > 5 else ''} (it has {len(known)} tensors, e.g. "
            f"{known[:3]})"
        )
    seen, dup = set(), []
    for n in names:
        if n in seen:
            dup.append(n)
        seen.add(n)
    if dup:
        raise ValueError(f"names lists {dup[:5]} more than once")
    return names


def _out_dtype(name, layout, dtype):
    """The dtype `name` is streamed in; the source storages' dtypes must allow the cast."""
    tl = layout.tensors[name]
    src = {layout.storages[p.location].dtype for p in tl.pieces}
    if dtype is None:
        if len(src) > 1:
            raise ValueError(
                f"tensor {name!r} lives in storages of dtypes {sorted(map(str, src))}: pass "
                "dtype= to stream it in one"
            )
        if not src:  # an empty tensor: the layout's only dtype, if it has one
            src = {st.dtype for st in layout.storages.values()}
            if len(src) != 1:
                raise ValueError(
                    f"tensor {name!r} is empty (no pieces) and the layout mixes dtypes: "
                    "pass dtype= (or leave it out of names)"
                )
        return next(iter(src))
    for s in src:
        if s != dtype and not (s in _FLOATS and dtype in _FLOATS):
            raise ValueError(
                f"tensor {name!r}: cannot stream {s} as {dtype} (casts are among float32, "
                "bfloat16 and float16)"
            )
    return dtype
