"""The compiled ops (`torch.ops.reshard.*`), their fake implementations and Python wrappers.

`import reshard` imports this module, which loads the extension `reshard._C`: its import
registers the ops with the dispatcher, and the fake implementations below register with them.
Without a build (or with one made for another torch) geometry and planning still work; the ops
are then stand-ins with the same schemas whose every call raises an error that says how to
build, and `require_built()` raises that error up front.

The ops are destination-passing: they write into `dst` (and `ring`). A descriptor table `desc`
is an int64 [n, 6] array/tensor with rows
`(src_offset, src_stride, dst_offset, dst_stride, length, count)` in elements.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import json
import os
import warnings
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np
import torch

__all__ = [
    "StageStats",
    "as_desc",
    "copy_pieces",
    "copy_runs",
    "is_built",
    "require_built",
    "stage_d2h",
    "stage_h2d",
]

DESC_COLUMNS = ("src_offset", "src_stride", "dst_offset", "dst_stride", "length", "count")
PIECE_COLUMNS = ("source", "src_offset", "dst_offset", "length")

BUILD_COMMAND = "pip install --no-build-isolation -e ."

# The op set, exactly as csrc/ops.cpp defines it (tests/test_ops.py compares the two). Here
# only for the stand-ins registered when the extension is missing.
SCHEMAS = (
    "copy_runs(Tensor src, Tensor desc, Tensor(a!) dst) -> ()",
    "copy_pieces(Tensor[] srcs, Tensor pieces, Tensor(a!) dst) -> ()",
    "stage_h2d(Tensor src, Tensor desc, Tensor(a!) ring, Tensor(b!) dst, "
    "Tensor(c!)? progress=None) -> Tensor",
    "stage_d2h(Tensor src, Tensor desc, Tensor(a!) ring, Tensor(b!) dst) -> Tensor",
    "host_register(Tensor t) -> int",
    "host_unregister(Tensor t) -> ()",
    "stage_device_bytes(int ring_bytes) -> int",
    "tensor_facts(Tensor[] tensors) -> Tensor",
    "progress_wait(Tensor progress, int at_least, int timeout_us, int spin_us=0) -> int",
    "progress_set(Tensor(a!) progress, int value) -> ()",
    "unwritable_reason(Tensor t) -> str",
)

# tensor_facts' columns: per tensor, what these Python reads return (device_index: get_device(),
# -1 on the CPU; dtype and device_type: c10 enum values; the flags 0 or 1).
FACT_COLUMNS = (
    "data_ptr",  # data_ptr()
    "storage_ptr",  # untyped_storage().data_ptr()
    "storage_nbytes",  # untyped_storage().nbytes()
    "dtype",
    "device_type",
    "device_index",
    "dim",
    "numel",
    "contiguous",  # is_contiguous()
    "requires_grad",
    "inference",  # is_inference()
    "math_bits",  # is_conj() | is_neg() << 1
)

try:
    _C = importlib.import_module(".._C", __name__)  # registers torch.ops.reshard.*
except ImportError as exc:
    _C = None
    _MISSING = (
        "reshard's compiled extension is missing or does not match this torch "
        f"({torch.__version__}): build it with `{BUILD_COMMAND}` from the repository root "
        f"(or `make build`); geometry and planning work without it ({exc})"
    )
else:
    _MISSING = None

CPU_CAPABILITIES = ("default", "avx2", "avx512")  # the C core's cast ISAs, by level


def _check_cpu_capability_env() -> None:
    """The C core reads RESHARD_CPU_CAPABILITY on every cast and ignores values it does not
    know (it cannot raise): say so once, at import, rather than run uncapped silently."""
    value = os.environ.get("RESHARD_CPU_CAPABILITY")
    if value is not None and value not in CPU_CAPABILITIES:
        warnings.warn(
            f"RESHARD_CPU_CAPABILITY={value!r} is not one of {', '.join(CPU_CAPABILITIES)} "
            "(lower case): ignored, casts use the widest ISA this CPU runs",
            RuntimeWarning,
            stacklevel=2,
        )


_check_cpu_capability_env()


def is_built() -> bool:
    """Whether the compiled extension is loaded (torch.ops.reshard.* run real kernels)."""
    return _MISSING is None


@functools.cache
def build_info() -> dict:
    """The facts compiled into `reshard._C` (csrc/ops.cpp `reshard_build_info`): the torch it
    was built against, whether it has CUDA kernels, its archs, flags and the C core version."""
    lib = ctypes.CDLL(library_path())
    fn = lib.reshard_build_info
    fn.restype = ctypes.c_char_p
    return json.loads(fn().decode())


def library_path() -> str:
    """The loaded extension's file: ctypes reaches the C core's `rs_*` symbols through it."""
    require_built()
    return _C.__file__


def built_with_cuda() -> bool:
    """Whether the loaded extension has CUDA kernels. Every build defines the same ops; in a
    CPU-only build the CUDA ones raise when called."""
    return is_built() and build_info()["cuda"]


def require_built() -> None:
    """Raise ImportError saying how to build the extension when it is not loaded."""
    if _MISSING is not None:
        raise ImportError(_MISSING)


def _define_stand_ins() -> None:
    """Ops with the real schemas whose every call raises the build error, so
    `torch.ops.reshard.copy_runs(...)` says how to build rather than that the name is missing."""
    lib = torch.library.Library("reshard", "DEF")  # noqa: TOR901 (kept alive below)

    def missing(*args, **kwargs):
        raise RuntimeError(_MISSING)

    for schema in SCHEMAS:
        name = schema.split("(", 1)[0]
        lib.define(schema)
        lib.impl(name, missing, "CompositeExplicitAutograd")
    _define_stand_ins.lib = lib


# Types whose facts the op reads as Python would (a subclass may dispatch the call elsewhere).
_FACT_TYPES = frozenset((torch.Tensor, torch.nn.Parameter))


def facts_key(tensors: list) -> tuple | None:
    """(the tensors' types, their `FACT_COLUMNS` as bytes), read in one `tensor_facts` call:
    two keys are equal exactly when every tensor, in order, has the same type and facts. None
    when one is not a plain tensor or parameter, or has no storage (or without a build, or
    with one older than the op)."""
    types = tuple(map(type, tensors))
    if not _FACT_TYPES.issuperset(types):
        return None
    try:
        facts = torch.ops.reshard.tensor_facts.default(tensors)
    except (RuntimeError, AttributeError):
        return None
    return types, facts.numpy().tobytes()


def _int64_table(table, columns: tuple, name: str) -> torch.Tensor:
    """`table` (a tensor, numpy array or nested sequence of integers) as a contiguous int64
    [n, len(columns)] tensor; [] is a table with no rows. Int64 contiguous numpy arrays and
    tensors are shared, not copied; other integer dtypes are widened, whatever holds them."""
    width = len(columns)
    if isinstance(table, torch.Tensor):
        if table.layout != torch.strided:  # .contiguous() below would fail inside torch
            raise TypeError(f"{name} must be a dense (strided) tensor, got {table.layout}")
        if table.dtype == torch.bool or table.is_floating_point() or table.is_complex():
            raise TypeError(f"{name} must hold integers, got {table.dtype}")
        if table.dtype == torch.uint64 and bool((table.view(torch.int64) < 0).any()):
            raise ValueError(f"{name} holds a value outside int64")
        t = table
    else:
        if not isinstance(table, np.ndarray):
            # rows read once (a generator), never a mapping's keys
            table = _rows(table, name)
            _check_python_ints(table, name)  # numpy would truncate 1.5 or Fraction, take True
        try:
            arr = np.asarray(table)
        except ValueError:  # ragged rows
            raise TypeError(f"{name} must be a rectangular table of integers") from None
        if arr.dtype == object:  # Python ints of int64's range that numpy did not type
            try:
                arr = np.asarray(table, dtype=np.int64)
            except (TypeError, ValueError):  # rows numpy cannot type (tensors, ragged arrays)
                raise TypeError(f"{name} must be a rectangular table of integers") from None
        if arr.size == 0:  # [] or [[]]: no values, whatever dtype numpy guessed
            arr = arr.astype(np.int64) if arr.ndim == 2 else np.zeros((0, width), np.int64)
        if not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"{name} must hold integers, got numpy dtype {arr.dtype}")
        if arr.dtype == np.uint64 and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
            raise ValueError(f"{name} holds a value outside int64")
        t = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.int64))
    if t.dim() != 2 or t.shape[1] != width:
        raise ValueError(f"{name} must have shape [n, {width}] {columns}, got {tuple(t.shape)}")
    if t.dtype != torch.int64:
        t = t.to(torch.int64)
    return t.contiguous()


def _rows(table, name: str, what: str = "a table of integers") -> list:
    """The entries of a sequence (a table's rows, the sources), as a list."""
    if isinstance(table, (Mapping, str, bytes)):
        raise TypeError(f"{name} must be {what}, got {type(table).__name__}")
    try:
        return list(table)
    except TypeError:
        raise TypeError(f"{name} must be {what}, got {type(table).__name__}") from None


def _check_python_ints(table, name: str) -> None:
    """Every entry of a table given as nested sequences is an integer (bool refused) that
    fits int64."""
    try:
        rows = list(table)
    except TypeError:
        raise TypeError(f"{name} must be a table of integers, got {type(table).__name__}") from None
    for row in rows:
        try:
            values = list(row)
        except TypeError:  # a flat list: its values are checked here, its shape later
            values = [row]
        for x in values:
            if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
                raise TypeError(f"{name} must hold integers, got {type(x).__name__} {x!r}")
            if not -(2**63) <= int(x) < 2**63:
                raise ValueError(f"{name} holds a value outside int64: {x}")


def as_desc(desc) -> torch.Tensor:
    """A descriptor table as a contiguous int64 [n, 6] tensor."""
    return _int64_table(desc, DESC_COLUMNS, "desc")


def copy_runs(src: torch.Tensor, desc, dst: torch.Tensor) -> torch.Tensor:
    """For every row and c in range(count):
    `dst[dst_offset + c*dst_stride : +length] = src[src_offset + c*src_stride : +length]`,
    cast to `dst.dtype` (float32/bfloat16/float16 cast bitwise like `Tensor.to`; any other
    dtype copies to itself). src and dst are 1-D contiguous on the same device. The whole
    table is validated before any write; a bad row raises RuntimeError naming it.
    Overlapping writes are rejected. Returns dst."""
    torch.ops.reshard.copy_runs(src, as_desc(desc), dst)
    return dst


def copy_pieces(srcs: list, pieces, dst: torch.Tensor) -> torch.Tensor:
    """For every row `(source, src_offset, dst_offset, length)` of `pieces` (int64 [k, 4], in
    elements): `dst[dst_offset : +length] = srcs[source][src_offset : +length]`, cast to
    `dst.dtype` as copy_runs casts, in one parallel pass over all rows. CPU tensors only: the
    sources 1-D contiguous of one dtype, dst 1-D contiguous. Every row is validated before any
    write; destination ranges must be disjoint and no source may share memory with dst.
    Returns dst."""
    table = _int64_table(pieces, PIECE_COLUMNS, "pieces")
    srcs = _rows(srcs, "srcs", "a list of tensors")  # never a mapping's keys
    for i, t in enumerate(srcs):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"srcs[{i}] must be a tensor, got {type(t).__name__}")
    torch.ops.reshard.copy_pieces(srcs, table, dst)
    return dst


class StageStats(NamedTuple):
    """What one stage_h2d / stage_d2h call did (the ops return these as an int64 tensor)."""

    slots: int  # ring slots used (0 when no row went through the ring)
    slot_bytes: int  # bytes of one slot
    chunks: int  # slot-sized chunks moved through the ring
    ring_bytes: int  # wire bytes moved through the ring
    direct_bytes: int  # bytes moved by direct copies (pinned or registered host side)
    direct_copies: int
    host_waits: int  # event waits on the host (one per reused slot, plus the final one)


def stage_h2d(src: torch.Tensor, desc, ring: torch.Tensor, dst: torch.Tensor) -> StageStats:
    """Runs of a CPU `src` into a CUDA `dst` through the pinned host `ring` (CUDA builds)."""
    return StageStats(*torch.ops.reshard.stage_h2d(src, as_desc(desc), ring, dst).tolist())


def stage_d2h(src: torch.Tensor, desc, ring: torch.Tensor, dst: torch.Tensor) -> StageStats:
    """Runs of a CUDA `src` into a CPU `dst` through the pinned host `ring` (CUDA builds)."""
    return StageStats(*torch.ops.reshard.stage_d2h(src, as_desc(desc), ring, dst).tolist())


def unwritable_reason(t: torch.Tensor) -> str:
    """Why writing CPU tensor `t` would kill the process (its first byte in read-only or
    unmapped memory, and what is mapped there); '' when it would not, or where the OS gives no
    memory map to look in."""
    return torch.ops.reshard.unwritable_reason(t)


# ------------------------------------------------------------------ fake (meta) impls
# Metadata checks only: a fake tensor has no data, so row contents are checked at run time.
# A fake impl also runs for real `meta` tensors (as their kernel): a call that mixes meta and
# real tensors is refused here, naming the argument, as the real kernels refuse wrong devices.


def _check_desc_meta(op: str, desc: torch.Tensor) -> None:
    torch._check(desc.dtype == torch.int64, lambda: f"{op}: desc must be int64, got {desc.dtype}")
    torch._check(
        desc.dim() == 2 and desc.shape[1] == 6,
        lambda: f"{op}: desc must have shape [n, 6], got {tuple(desc.shape)}",
    )


def _check_1d(op: str, name: str, t: torch.Tensor) -> None:
    torch._check(t.dim() == 1, lambda: f"{op}: {name} must be 1-D, got shape {tuple(t.shape)}")


def _check_device(op: str, name: str, t: torch.Tensor, ok: bool, want: str) -> None:
    torch._check(ok, lambda: f"{op}: {name} must be {want}, got a tensor on {t.device}")


def _check_runs_meta(op: str, src, desc, dst) -> None:
    _check_desc_meta(op, desc)
    _check_1d(op, "src", src)
    _check_1d(op, "dst", dst)


def _check_devices(op: str, host: dict, device: dict, desc: torch.Tensor) -> None:
    """`host` args must be on the CPU and `device` args on the GPU (for copy_runs: on one
    device, any); all-meta calls (shape propagation) pass; desc lives on the CPU (or on meta
    with meta buffers)."""
    tensors = [*host.values(), *device.values()]
    if all(t.device.type == "meta" for t in tensors):
        _check_device(op, "desc", desc, desc.device.type in ("cpu", "meta"), "a CPU tensor")
        return
    _check_device(op, "desc", desc, desc.device.type == "cpu", "a CPU tensor")
    for name, t in host.items():
        _check_device(op, name, t, t.device.type == "cpu", "a CPU tensor")
    for name, t in device.items():
        _check_device(op, name, t, t.device.type == "cuda", "a CUDA tensor")


def _stats_fake(ring: torch.Tensor) -> torch.Tensor:
    return ring.new_empty((len(StageStats._fields),), dtype=torch.int64)


def _register_fakes() -> None:
    # The three ops share one signature shape (src, desc, [ring,] dst) and the same metadata rules.
    @torch.library.register_fake("reshard::copy_runs")
    def _copy_runs_fake(src, desc, dst):
        op = "reshard::copy_runs"
        _check_device(op, "src", src, src.device == dst.device, f"on dst's device ({dst.device})")
        if src.device.type == "meta":
            _check_device(op, "desc", desc, desc.device.type in ("cpu", "meta"), "a CPU tensor")
        else:
            _check_device(op, "desc", desc, desc.device.type == "cpu", "a CPU tensor")
        _check_runs_meta(op, src, desc, dst)

    @torch.library.register_fake("reshard::copy_pieces")
    def _copy_pieces_fake(srcs, pieces, dst):
        op = "reshard::copy_pieces"
        meta = all(t.device.type == "meta" for t in (*srcs, pieces, dst))
        want = ("cpu", "meta") if meta else ("cpu",)
        for i, t in enumerate(srcs):
            _check_device(op, f"srcs[{i}]", t, t.device.type in want, "a CPU tensor")
            _check_1d(op, f"srcs[{i}]", t)
        _check_device(op, "pieces", pieces, pieces.device.type in want, "a CPU tensor")
        _check_device(op, "dst", dst, dst.device.type in want, "a CPU tensor")
        torch._check(
            pieces.dtype == torch.int64,
            lambda: f"{op}: pieces must be int64, got {pieces.dtype}",
        )
        torch._check(
            pieces.dim() == 2 and pieces.shape[1] == len(PIECE_COLUMNS),
            lambda: f"{op}: pieces must have shape [k, 4], got {tuple(pieces.shape)}",
        )
        _check_1d(op, "dst", dst)

    @torch.library.register_fake("reshard::stage_h2d")
    def _stage_h2d_fake(src, desc, ring, dst, progress=None):
        op = "reshard::stage_h2d"
        _check_devices(op, {"src": src, "ring": ring}, {"dst": dst}, desc)
        _check_runs_meta(op, src, desc, dst)
        return _stats_fake(ring)

    @torch.library.register_fake("reshard::stage_d2h")
    def _stage_d2h_fake(src, desc, ring, dst):
        op = "reshard::stage_d2h"
        _check_devices(op, {"dst": dst, "ring": ring}, {"src": src}, desc)
        _check_runs_meta(op, src, desc, dst)
        return _stats_fake(ring)


if _MISSING is None:
    _register_fakes()
else:
    _define_stand_ins()
