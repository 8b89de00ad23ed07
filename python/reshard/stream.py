"""Stream full tensors by name to receiver ranks, bucket by bucket, with bounded memory.

    stream = rs.Stream(src_layout, receivers=[0], bucket_bytes=256 << 20, dtype=torch.bfloat16)
    for name, tensor in stream(src_buffers):     # every rank of the group iterates
        engine.load_weights([(name, tensor)])    # receivers get full tensors; others nothing

Inference engines that load weights by name (vLLM's `load_weights`, SGLang's
`update_weights_from_tensor`) want full logical tensors, one at a time. A Stream cuts the
chosen tensors into buckets of at most `bucket_bytes` (in the streamed dtype) and moves each
bucket with one planned transfer into a buffer on every receiver; the tensors it yields are
views of that buffer. Planning happens once, in the constructor; each bucket's executor state
(schedule, rounds, staging) is built on the first call and reused by every later one.

The parts: `stream_buckets` (bucket planning: which tensors, where in the buffer, when each
bucket may move, its plan), `stream_mover` (the bucket transfer engine: one worker thread, one
Transfer per bucket, one staging pool), `stream_iter` (one call: the double-buffer protocol,
the source checks, the merged Report).

Memory (receivers): one buffer of `buffer_bytes`, allocated on the first call and kept: the
largest bucket, or `2 * bucket_bytes` (at most everything streamed) when that is more. Every
rank also holds one staging pool shared by its buckets (arenas of the largest bucket's rounds,
plus the pinned ring when CPU buffers meet CUDA ones), kept across calls, and each bucket's
Transfer keeps its descriptor tables (48 B per copy run; under NCCL their device copies too).
`staging_bytes(rank)` states the whole bound; each call's `report` says what the pool and
buffer held. A consumer that takes tensors whole needs the largest one whole, so that tensor
is the floor of any by-name path.

Errors: names, dtype, receivers, sizes, the timeout and a `device` value that names no CPU or
CUDA device are checked in the constructor (the same ValueError on every rank, since every rank
builds the same Stream). Whether a device fits the rank's process (CUDA present, enough GPUs)
and the group's transport is the rank's own (`device=` may differ between ranks): a misfit is
refused in bucket 0's preflight, the same PreflightError on every rank. The first bucket's
collective preflight agrees on the whole stream's fingerprint and checks every source buffer the
whole stream reads (and runs the buffer set's readiness hook), so Streams that differ between
ranks, or a bad or missing buffer anywhere, raise the same PreflightError on every rank before
anything is yielded or written. Sources must stay as they are until the iteration ends: the next
bucket reads them while the caller consumes this one. Every rank must iterate the stream to its end; a caller
that stops early (break, an exception in the loop body) closes the generator, which then moves
the remaining buckets without yielding them into the same buffer, so its peers finish normally
(a tensor kept past `break` is overwritten: copy it in the loop). Python drops what a
generator's close raises, so a failure while moving the rest fails the Stream's next call on
every rank (a PreflightError naming it). Every wait on the worker is bounded by `timeout`: a
bucket that does not finish in time ends the call with a TransferError.

Calls and the process group: a call holds its group (the executor's per-group lock, shared with
every Transfer on it) from its first tensor to its end, so its collectives never interleave with
another call's. Calls on the group from other threads wait for it; from the same thread (the
loop body, a readiness hook, a Stream call left unfinished) they raise. `group=None` is the
default group at each call, as for a Transfer: when it changes, the Stream rebuilds its worker,
Transfers and buffer. A forked child starts a worker of its own. A Stream pickles (and copies)
without its runtime state; one on an explicit group does not pickle.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import threading
import time

import torch

from . import preflight as pf
from . import stream_buckets as sb
from .layout import Layout
from .layout.state import QUANTIZED_DTYPES
from .layout.values import row_major
from .planning.helpers import check_nbytes, check_rank
from .planning.planner import MAX_BUDGET, _integral
from .preflight import timeout_error
from .report import STAGING_KINDS
from .staging_bound import TRANSPORTS
from .stream_iter import Call, check_sources
from .stream_mover import PROGRESS_WORD_BYTES, BucketMover, StagingPool, table_bytes

__all__ = ["Stream"]

DEFAULT_TIMEOUT_S = 300.0


class Stream:
    """Full tensors by name, bucket by bucket, to `receivers`; see the module docstring.

    src_layout: an `rs.Layout` (e.g. `reshard.integrations.deepspeed.describe(engine,
        "param").layout`), the same on every rank.
    receivers: ranks of `group` that receive every tensor.
    bucket_bytes: bytes per bucket in the streamed dtype (a larger tensor is its own bucket).
    dtype: the dtype tensors arrive in (fp32/bf16/fp16 casts happen on the way); None keeps
        each tensor's source dtype.
    names: the tensors to stream, in this order (default: every tensor of `src_layout`).
    group: the process group (default: the default group as it is at each call; no process
        group: in-process, rank 0).
    device: where receivers' tensors live (default: the current CUDA device under NCCL, else
        the CPU). One this rank's process lacks (or a CUDA device under gloo) fails the first
        call on every rank (a PreflightError naming this rank), not the constructor here.
    staging_bytes_per_rank: cap on one bucket transfer's arenas on any rank (default
        `min(bucket_bytes // 4, 64 MiB)`, at least 64 KiB).
    timeout: seconds any single wait may take (gloo), the caller's wait for one bucket's move
        included; a receiver's consumption of one bucket counts against its peers' wait for
        the next.
    register_host_sources: page-lock CPU source storages in place on the first call (CUDA
        receivers: DMA straight from them), undone by `close()`.
    buffer_bytes: the receivers' buffer (default max(largest bucket, min(2 * bucket_bytes,
        everything streamed)); at least the largest bucket). More lets the bucket after a
        tensor that fills the buffer move while that tensor is consumed.
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
        timeout=DEFAULT_TIMEOUT_S,
        register_host_sources=False,
        buffer_bytes=None,
    ):
        if not isinstance(src_layout, Layout):
            raise TypeError(
                f"Stream(src_layout): expected a reshard.Layout, got {type(src_layout).__name__}"
                " (for a DeepSpeed engine pass describe(engine, kind).layout)"
            )
        bucket_bytes = _positive_int("bucket_bytes", bucket_bytes)
        bad_timeout = timeout_error(timeout)
        if bad_timeout is not None:
            raise bad_timeout
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype or None, got {dtype!r}")
        if dtype in QUANTIZED_DTYPES:
            raise ValueError(
                f"dtype {dtype} is quantized: its scale and zero point are not elements, so "
                "it cannot be streamed; stream the int_repr() values' dtype"
            )
        if not isinstance(register_host_sources, bool):
            raise TypeError(
                f"register_host_sources must be True or False, got {register_host_sources!r}"
            )
        if staging_bytes_per_rank is None:
            staging_bytes_per_rank = max(min(bucket_bytes // 4, 64 << 20), 64 << 10)
        staging_bytes_per_rank = _positive_int("staging_bytes_per_rank", staging_bytes_per_rank)
        if buffer_bytes is not None:
            buffer_bytes = _positive_int("buffer_bytes", buffer_bytes)
        bound = _resolve_group(group)
        self.group, self.timeout, self.dtype = group, float(timeout), dtype
        self.receivers = sb.check_receivers(receivers, bound[2])
        self.names = sb.check_names(names, src_layout)
        self.bucket_bytes, self.staging_bytes_per_rank = bucket_bytes, staging_bytes_per_rank
        self._device_arg = device  # None: the group's default, resolved with the group
        _resolve_device(device, bound[3])  # a value that is no device raises here, before planning
        self.register_host_sources = register_host_sources
        self.src_layout = src_layout
        out_dtypes = {n: sb.out_dtype(n, src_layout, dtype) for n in self.names}
        self.buckets = sb.make_buckets(self.names, src_layout, out_dtypes, bucket_bytes)
        self.buffer_bytes = sb.ring_bytes(self.buckets, bucket_bytes, buffer_bytes)
        sb.place_buckets(self.buckets, self.buffer_bytes)
        t0 = time.perf_counter()
        for b in self.buckets:
            sb.plan_bucket(b, src_layout, self.receivers, staging_bytes_per_rank)
        self.plan_seconds = time.perf_counter() - t0
        digest = hashlib.sha256()
        for b in self.buckets:
            digest.update(f"{b.names}|{b.start}|{b.plan.fingerprint};".encode())
        self.fingerprint = digest.hexdigest()[:32]
        # bucket 0's preflight agrees on the whole stream: ranks whose streams differ anywhere
        # (names, order, a later bucket) all fail there, before anything is yielded
        first = self.buckets[0]
        first.plan = dataclasses.replace(
            first.plan, fingerprint=f"{first.plan.fingerprint[:16]}, stream {self.fingerprint}"
        )
        self.used_locations = sorted({loc for b in self.buckets for loc in b.src_locations})
        self._first_locations = set(self.buckets[0].src_locations)
        self._table_bounds = {}  # (rank, world size, transport) -> the buckets' table_bytes
        self._clear_runtime()
        self._bind(bound)

    # The state a call builds and keeps (a Stream pickles without it, and rebuilds it when the
    # group `group=None` stands for changes).
    _RUNTIME = (
        "mover",  # the worker thread, the bucket Transfers and their staging pool
        "_bound",  # (group, rank, world size, backend) the mover and buffer were made for
        "buffer",  # the receivers' buffer, allocated on the first call
        "_buffer_error",
        "_target_views",  # per bucket: {location: view of the buffer}
        "_yields",  # per bucket: [(name, typed buffer, shape, strides, offset)]
        "_ends",  # per bucket: per yielded tensor, the end of its bytes in the buffer
        "_active",  # the pid of the process iterating a call (not reentrant)
        "_report",  # the last completed call's Report, once read
        "_last_call",  # the last completed call, until its Report is read
        "_layout_seen",  # the last buffer object's .layout found equal to src_layout
        "stopped_error",  # what moving the rest failed with after an early stop: fails the next call
    )

    def _clear_runtime(self) -> None:
        for name in self._RUNTIME:
            setattr(self, name, None)

    def _bind(self, bound) -> None:
        """Make the mover (and drop the buffer) for `bound`, the resolved group; raises the
        constructor's ValueError when the receivers do not fit it. A device that does not fit
        this process or the group is kept as `device_problem`: the next call refuses it."""
        group, rank, world, backend = bound
        sb.check_receivers(self.receivers, world)
        device, self.device_problem = _resolve_device(self._device_arg, backend)
        cuda = device.index if device.type == "cuda" and not self.device_problem else None
        if cuda is None and "nccl" in backend and torch.cuda.is_available():
            cuda = torch.cuda.current_device()
        if self.mover is not None:
            self.mover.shutdown()
        self.rank, self.world_size, self.backend, self.device = rank, world, backend, device
        self.mover = BucketMover(
            self.buckets, bound, self.timeout, cuda, self.register_host_sources
        )
        # a CUDA receiver's caller works on its tensors while the worker packs the next ones
        self.mover.caller_overlaps = rank in self.receivers and device.type == "cuda"
        self.buffer = self._target_views = self._yields = self._ends = None
        self._bound = bound

    def __getstate__(self):
        """Pickles (and copies) as a fresh Stream: its plans and settings, without what calls
        built (worker, buffer, staging, last Report); the group is resolved at its first call
        wherever it is unpickled."""
        if self.group is not None:
            raise TypeError(
                "an rs.Stream on an explicit process group cannot be pickled: a process group "
                "belongs to its process (build the Stream where it runs, or use group=None, "
                "resolved at each call)"
            )
        state = dict(self.__dict__)
        state.update(dict.fromkeys(self._RUNTIME))
        return state

    @property
    def report(self):
        """The last completed call's Report (None before one completed), made when first read:
        a caller that does not read it pays nothing for it."""
        if self._last_call is not None:
            self._report, self._last_call = self._last_call.report(), None
        return self._report

    @property
    def plans(self) -> list:
        """The per-bucket plans (computed once, in the constructor)."""
        return [b.plan for b in self.buckets]

    def staging_bytes(self, rank=None, transport=None, host_ring_bytes=0) -> dict:
        """The most memory a call holds on `rank` beyond the caller's own tensors, by kind
        (`{"device", "host_pinned", "host"}`): the receivers' buffer plus the staging pool
        (per direction, double-buffered arenas of the largest bucket's rounds on the
        transport's device; `host_ring_bytes`: the pinned ring when CPU buffers meet CUDA
        ones), plus what each bucket's Transfer keeps besides (`stream_mover.table_bytes`:
        its descriptor tables, about 48 B per copy run, and under NCCL their device copies)
        and a CUDA receiver's progress word per bucket."""
        rank = self.rank if rank is None else check_rank(rank)
        host_ring_bytes = check_nbytes(host_ring_bytes, "host_ring_bytes")
        if transport is None:
            transport = "nccl" if self.device.type == "cuda" else "gloo"
        elif transport not in TRANSPORTS:
            raise ValueError(f"transport must be 'nccl' or 'gloo', got {transport!r}")
        out = StagingPool(self.plans, rank).bound(transport, host_ring_bytes)
        for kind, n in self._table_bytes(rank, transport).items():
            out[kind] += n
        if rank in self.receivers:
            out["device" if self.device.type == "cuda" else "host"] += self.buffer_bytes
            if self.device.type == "cuda":
                out["host"] += PROGRESS_WORD_BYTES * len(self.buckets)
        return out

    def _table_bytes(self, rank, transport) -> dict:
        """`table_bytes` summed over the buckets, once per (rank, world size, transport)."""
        key = (rank, self.world_size, transport)
        got = self._table_bounds.get(key)
        if got is None:
            got, own = dict.fromkeys(STAGING_KINDS, 0), rank == self.rank
            for b in self.buckets:
                for kind, n in table_bytes(b.plan, rank, self.world_size, transport, own).items():
                    got[kind] += n
            self._table_bounds[key] = got
        return got

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
                f"{b.start}, moves once the caller is past {b.ready_after} tensor(s) of the "
                f"stream, {b.plan.num_rounds} rounds"
            )
        return "\n".join(lines)

    def close(self) -> None:
        """Undo host registrations (if any). The Stream stays usable."""
        if self.mover is not None:
            self.mover.close()

    # ------------------------------------------------------------------ a call

    def __call__(self, src_buffers):
        """A generator of (name, tensor): full tensors on receivers, nothing elsewhere.

        src_buffers: {location: tensor} for the source locations this rank owns, or an object
        with `.buffers`, an optional `.check()` readiness hook and an optional `.kind` (a
        DeepSpeed `describe()` result). A yielded tensor is a view of the stream's buffer, valid until the next
        iteration, or until the loop stops (break, an exception: the rest of the stream then
        moves through the buffer): copy it to keep it. The call holds the process group until
        it ends (see the module docstring).
        """
        return self._run(src_buffers)

    def _run(self, src_buffers):
        bufs, hooks, kind, self._layout_seen = _buffers_and_hooks(
            src_buffers, self.src_layout, self._layout_seen
        )
        with _ENTRY_GUARD:  # checked and taken at once: two threads never both pass
            if self._active == os.getpid():  # a call copied into a forked child is not this one
                raise RuntimeError(
                    "this Stream is already being iterated: finish (or close) that iteration "
                    "first; its buffer holds the tensors it yields"
                )
            self._active = os.getpid()
        try:
            stuck = self.mover.still_moving() if self.mover is not None else None
            if stuck is not None:
                raise RuntimeError(
                    f"this Stream's worker is still moving bucket {stuck} of a call that gave "
                    f"up waiting for it (timeout {self.timeout:g} s): a new call would queue "
                    "behind it"
                )
            # the group is resolved per call, as a Transfer's (group=None: the default group)
            bound = _resolve_group(self.group)
            if (
                self._bound is None
                or bound[0] is not self._bound[0]
                or bound[1:] != self._bound[1:]
            ):
                self._bind(bound)
            if self.device_problem is not None:
                self._refuse_device(bound[0])
            lock = _hold_group(bound[0], self.timeout)
        except BaseException:
            self._active = None
            raise
        try:
            t0 = time.perf_counter()
            self._buffer_error = self._allocate_buffer()
            self.mover.register(bufs)
            stopped, self.stopped_error = self.stopped_error, None
            call = Call(self, bufs, hooks, stopped, kind)
            yield from call.run()
            call.completed(time.perf_counter() - t0)
            self._last_call, self._report = call, None
        finally:
            self._active = None
            if lock is not None:
                lock.__exit__(None, None, None)

    def _refuse_device(self, group) -> None:
        """This rank's side of bucket 0's preflight when its `device` does not fit its process
        or group: its peers' first bucket raises the same PreflightError, naming this rank and
        the device, and nothing moves anywhere. Always raises."""
        from .executor import refuse  # needs the built ops; planning does not

        refuse(self.buckets[0].plan, [self.device_problem], group, timeout=self.timeout)

    def check_sources(self, bufs, stopped=None) -> None:
        """bucket 0's preflight check: every source buffer the whole stream reads on this
        rank (bucket 0's own are its transfer's to check), and the receiver's buffer."""
        later = [loc for loc in self.used_locations if loc not in self._first_locations]
        reasons = check_sources(self.src_layout, later, self.rank, self.backend, bufs)
        reasons += self._sources_in_buffer(bufs)
        if stopped is not None:
            reasons.append(
                "this rank's previous call of the Stream stopped early (break, or an exception "
                "in the loop) and moving its remaining buckets failed: "
                f"{type(stopped).__name__}: {stopped}"
            )
        if self._buffer_error is not None:
            reasons.append(self._buffer_error)
        if reasons:
            raise ValueError("; ".join(reasons))

    def _sources_in_buffer(self, bufs) -> list[str]:
        """Sources that share memory with this receiver's buffer (a tensor an earlier call
        yielded, passed back): each bucket's own preflight sees only its own targets, so a
        bucket would overwrite another's source before (or after) it is read."""
        buf = self.buffer
        if buf is None:
            return []
        lo = buf.data_ptr()
        hi = lo + buf.numel()
        out = []
        for loc in self.used_locations:
            t = bufs.get(loc)
            if not isinstance(t, torch.Tensor) or t.device != buf.device or not t.numel():
                continue
            try:
                a = t.untyped_storage().data_ptr()
                b = a + t.untyped_storage().nbytes()
            except RuntimeError:  # no storage of its own: refused by the other checks
                continue
            if a < hi and lo < b:
                out.append(
                    f"source location {loc} shares memory with the Stream's receiver buffer "
                    "(a tensor the Stream yielded, passed back as a source?): the stream "
                    "would overwrite it; pass a copy"
                )
        return out

    def _allocate_buffer(self):
        """The receivers' buffer, once; a failure is a preflight reason of the first bucket."""
        if self.rank not in self.receivers or self.buffer is not None:
            return None
        # normal tensors even when the caller iterates under inference_mode: the worker
        # thread, outside it, writes the buffer's views in place
        with torch.inference_mode(False):
            return self._make_buffer()

    def _make_buffer(self):
        try:
            buffer = torch.empty(self.buffer_bytes, dtype=torch.uint8, device=self.device)
        except (RuntimeError, MemoryError) as exc:
            return (
                f"receiver buffer of {self.buffer_bytes} B on {self.device} could not be "
                f"allocated ({type(exc).__name__}: {exc})"
            )
        me = self.receivers.index(self.rank)
        self._target_views = [
            {
                loc: buffer[b.start + b.groups[dt][0] : b.start + b.groups[dt][1]].view(dt)
                for loc, (j, dt) in b.targets.items()
                if j == me
            }
            for b in self.buckets
        ]
        # one typed view of the whole buffer per dtype; a yielded tensor is one as_strided of it
        dtypes = {e.dtype for b in self.buckets for e in b.entries}
        typed = {
            dt: buffer[: self.buffer_bytes // dt.itemsize * dt.itemsize].view(dt) for dt in dtypes
        }
        self._yields = [
            [
                (
                    e.name,
                    typed[e.dtype],
                    e.shape,
                    row_major(e.shape),
                    (b.start + e.offset) // e.dtype.itemsize,
                )
                for e in b.entries
            ]
            for b in self.buckets
        ]
        self._ends = [[b.start + e.offset + e.nbytes for e in b.entries] for b in self.buckets]
        self.buffer = buffer
        return None

    def targets(self, k) -> dict:
        """This rank's target views of bucket k: {location: 1-D view of the buffer}."""
        return self._target_views[k] if self._target_views is not None else {}

    def views(self, k):
        """Bucket k's tensors as (name, view of the buffer), in stream order."""
        for name, typed, shape, strides, offset in self._yields[k]:
            yield name, typed.as_strided(shape, strides, offset)

    def view_ends(self, k) -> list:
        """Per tensor of `views(k)`: the end of its bytes, as an offset in the buffer."""
        return self._ends[k]


_ENTRY_GUARD = threading.Lock()  # a Stream's "already iterated" check and its claim, as one


def _resolve_group(group):
    """(group, rank, world size, transport) the stream runs over now, resolved as a Transfer's
    (executor.resolve_group): group=None is the default group, or in-process without one."""
    from .executor import resolve_group  # needs the built ops; planning does not

    return resolve_group(group)


def _hold_group(group, timeout):
    """Enter `group`'s call lock (the executor's, shared with every Transfer on the group) for
    a whole call: its buckets' collectives must not interleave with another call's on the
    group (gloo pairs them in issue order; identical Streams would silently swap data). From
    other threads, calls wait up to `timeout`; from this thread (the loop body, a readiness
    hook, a Stream call left unfinished) they raise: waiting would be waiting for itself.
    None: no group."""
    if group is None:
        return None
    from .executor import _call_lock  # needs the built ops; planning does not

    lock = _call_lock(group, None)
    try:
        lock.acquire("an rs.Stream iteration (until its loop ends or it is closed)", timeout)
    except RuntimeError as exc:
        raise RuntimeError(
            "an rs.Stream was iterated inside another call on the same process group on this "
            "thread (a readiness hook, the loop body of another Stream, or while a Stream "
            "iteration on the group is left unfinished): calls on a group run one at a time, "
            "so it would wait for itself; finish (or close) the other call first"
        ) from exc
    return lock


def _positive_int(what, value) -> int:
    """`value` as an int in 1 .. 2**62 (numpy ints too, as plan() takes its budget)."""
    value = _integral(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_BUDGET:
        raise ValueError(f"{what} must be an int in 1 .. 2**62, got {value!r}")
    return value


def _resolve_device(device, backend) -> tuple[torch.device, str | None]:
    """(the receivers' device, why it does not fit this process or the group's transport, or
    None). A value that names no CPU or CUDA device raises ValueError: the same for the same
    value on every rank. Whether a device fits depends on the rank (its host's GPUs, and
    `device=` may differ between ranks, as `f"cuda:{local_rank}"` does), so a misfit is
    returned instead: the call's first bucket refuses it on every rank at once."""
    if device is None:
        if "nccl" in backend and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device()), None
        return torch.device("cpu"), None
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device {device!r} is not a device ({exc})") from None
    if device.type not in ("cpu", "cuda"):
        # the executor's copies run on the CPU or CUDA only (a meta buffer would yield
        # tensors without values)
        raise ValueError(f"device {device}: receivers' tensors live on the cpu or a CUDA device")
    problem = None
    if device.type == "cpu":
        pass
    elif not torch.cuda.is_available():
        problem = f"device {device}: CUDA is not available in this process"
    elif (device.index or 0) >= torch.cuda.device_count():
        problem = f"device {device}: this process has {torch.cuda.device_count()} CUDA device(s)"
    elif backend == "gloo":
        problem = (
            f"device {device}: the gloo transport delivers into CPU memory; use device='cpu' "
            "or an NCCL group"
        )
    elif device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device, problem


def _buffers_and_hooks(src_buffers, layout, seen):
    """({location: tensor}, readiness hooks, kind, seen) of a call's `src_buffers`, read as a
    Transfer reads them (preflight.as_buffer_set): a mapping, or an object with `.buffers`, an
    optional callable `.check`, an optional `.kind` (which state it is) and an optional
    `.layout`, which must agree with the Stream's. Whatever is
    wrong with the object (including a `.buffers` that raises) becomes a hook that raises in
    bucket 0's collective preflight, so every rank raises it, not this one alone. `seen`: the
    last buffer layout found equal to `layout` (not compared again), returned updated."""
    try:
        bs = pf.as_buffer_set(src_buffers, "src")
        bufs, hooks = dict(bs.buffers), list(bs.checks)
    except Exception as exc:  # noqa: BLE001 - a reason of the collective preflight
        return {}, [functools.partial(_raise, exc)], None, seen
    have = bs.layout
    if have is not None and have is not layout and have is not seen:
        why = pf.layout_difference(have, layout)
        if why is None:
            seen = have
        else:
            hooks.append(
                functools.partial(
                    _raise,
                    ValueError(
                        f"the src buffers' layout ({bs.source}.layout) differs from the "
                        f"Stream's src_layout: {why}"
                    ),
                )
            )
    return bufs, hooks, bs.kind, seen


def _raise(exc):
    raise exc
