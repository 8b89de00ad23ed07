"""Inputs the ops refuse before any write, each error naming the argument: a mix of devices an
op does not support, an element type the C core does not copy, a tensor whose storage is smaller
than its sizes say (freed as FSDP frees parameters, or shrunk), a destination in read-only
memory (a numpy memmap opened with mode 'r'). The CUDA side of the device rules
is in tests/gpu/test_copy_runs_cuda.py and tests/gpu/test_stage_cuda.py."""

import ctypes
import gc
import mmap
import os
import signal
import subprocess
import sys

import _memmaps as memmaps
import numpy as np
import pytest
import torch

import reshard
from reshard import _ops

DESC = torch.tensor([[0, 1, 0, 1, 4, 1]])
POISON = -7.0


def dst4():
    return torch.full((4,), POISON)


def refused(call, *fragments, written=()):
    """call() raises RuntimeError naming every fragment, and every tensor in `written` keeps
    its contents."""
    before = [t.clone() for t in written]
    with pytest.raises(RuntimeError) as info:
        call()
    for frag in fragments:
        assert frag in str(info.value), f"{frag!r} not in {info.value}"
    for t, b in zip(written, before, strict=True):
        assert torch.equal(t, b)
    return str(info.value)


# ------------------------------------------------------------------ devices


@pytest.mark.parametrize(
    "src_dev,desc_dev,dst_dev,named",
    [
        ("cpu", "meta", "cpu", "desc must be a CPU tensor"),
        ("meta", "cpu", "cpu", "src must be on dst's device"),
        ("cpu", "cpu", "meta", "src must be on dst's device"),
        ("meta", "meta", "cpu", "src must be on dst's device"),
    ],
)
def test_copy_runs_refuses_meta_mixed_with_real_tensors(src_dev, desc_dev, dst_dev, named):
    src = torch.arange(4.0, device=src_dev)
    dst = torch.full((4,), POISON, device=dst_dev)
    real = [t for t in (dst,) if t.device.type == "cpu"]
    refused(
        lambda: torch.ops.reshard.copy_runs(src, DESC.to(desc_dev), dst),
        "reshard::copy_runs",
        named,
        written=real,
    )


def test_copy_runs_all_meta_is_shape_propagation():
    src, dst = torch.empty(4, device="meta"), torch.empty(4, device="meta")
    torch.ops.reshard.copy_runs(src, DESC.to("meta"), dst)
    torch.ops.reshard.copy_runs(src, DESC, dst)  # a real table with meta buffers
    with pytest.raises(RuntimeError, match="src must be 1-D"):
        torch.ops.reshard.copy_runs(torch.empty(2, 2, device="meta"), DESC, dst)


@pytest.mark.parametrize("op", ["stage_h2d", "stage_d2h"])
@pytest.mark.parametrize("meta_arg", ["src", "desc", "ring", "dst"])
def test_stage_ops_refuse_meta_mixed_with_real_tensors(op, meta_arg):
    args = {
        "src": torch.arange(4.0),
        "desc": DESC,
        "ring": torch.empty(64, dtype=torch.uint8),
        "dst": dst4(),
    }
    args[meta_arg] = args[meta_arg].to("meta")
    msg = refused(
        lambda: getattr(torch.ops.reshard, op)(**args),
        f"reshard::{op}",
        written=[args["dst"]] if meta_arg != "dst" else [],
    )
    # the message names an argument, and which device it must be on
    assert any(f"{name} must be a" in msg for name in args), msg


@pytest.mark.skipif(_ops.built_with_cuda(), reason="the CPU-only build's refusals")
@pytest.mark.parametrize("op", ["stage_h2d", "stage_d2h"])
def test_stage_ops_in_a_cpu_build_say_so(op):
    dst = dst4()
    ring = torch.empty(64, dtype=torch.uint8)
    refused(
        lambda: getattr(torch.ops.reshard, op)(torch.arange(4.0), DESC, ring, dst),
        f"reshard::{op}: reshard was built without CUDA",
        written=[dst],
    )


@pytest.mark.skipif(_ops.built_with_cuda(), reason="the CPU-only build's refusals")
def test_cuda_only_ops_exist_in_a_cpu_build_and_say_so():
    calls = {
        "host_register": lambda: torch.ops.reshard.host_register(torch.ones(4)),
        "host_unregister": lambda: torch.ops.reshard.host_unregister(torch.ones(4)),
        "stage_device_bytes": lambda: torch.ops.reshard.stage_device_bytes(1 << 20),
    }
    for name, call in calls.items():
        refused(call, f"reshard::{name}: reshard was built without CUDA")


# ------------------------------------------------------------------ element types


def _all_dtypes():
    return sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)


def _buffer(dtype, numel=4):
    """A 1-D tensor of any dtype (quantized and sub-byte ones included), poisoned."""
    raw = torch.full((numel * dtype.itemsize,), 0x5B, dtype=torch.uint8)
    return raw.view(dtype)


def test_sixteen_byte_elements_refused_before_any_write():
    src = _buffer(torch.complex128)
    dst = _buffer(torch.complex128)
    before = dst.view(torch.uint8).clone()
    with pytest.raises(RuntimeError, match="unsupported dtype ComplexDouble"):
        torch.ops.reshard.copy_runs(src, DESC, dst)
    assert torch.equal(dst.view(torch.uint8), before)


def test_op_accepts_exactly_the_dtype_pairs_preflight_accepts():
    from reshard.preflight import copy_support

    mismatches = []
    for sdt in _all_dtypes():
        for ddt in _all_dtypes():
            src = torch.arange(4 * sdt.itemsize, dtype=torch.uint8).view(sdt)
            dst = _buffer(ddt)
            before = dst.view(torch.uint8).clone()
            try:
                torch.ops.reshard.copy_runs(src, DESC, dst)
                accepted = True
            except RuntimeError:
                accepted = False
                assert torch.equal(dst.view(torch.uint8), before), (sdt, ddt)
            if accepted != (copy_support(sdt, ddt) is None):
                mismatches.append((sdt, ddt, accepted))
    assert not mismatches


# ------------------------------------------------------------------ storage extents


@pytest.mark.parametrize("arg", ["src", "desc", "dst"])
def test_freed_storage_refused(arg):
    """FSDP frees a parameter with storage().resize_(0), keeping its sizes."""
    args = {"src": torch.arange(4.0), "desc": DESC.clone(), "dst": dst4()}
    args[arg].untyped_storage().resize_(0)
    need = args[arg].numel() * args[arg].element_size()
    refused(
        lambda: torch.ops.reshard.copy_runs(args["src"], args["desc"], args["dst"]),
        f"reshard::copy_runs: {arg} needs {need} bytes of storage but its storage holds 0",
        "freed",
        written=[args["dst"]] if arg != "dst" else [],
    )


@pytest.mark.parametrize("arg", ["src", "dst"])
def test_shrunk_storage_of_a_view_refused(arg):
    base = torch.full((16,), 3.0)
    view = base[8:12]  # elements [8, 12): needs 48 bytes of storage
    base.untyped_storage().resize_(40)
    src, dst = (view, dst4()) if arg == "src" else (torch.arange(4.0), view)
    refused(
        lambda: reshard.copy_runs(src, DESC, dst),
        f"{arg} needs 48 bytes of storage but its storage holds 40",
        "shrunk",
        written=[dst] if arg == "src" else [],
    )
    assert base[:8].tolist() == [3.0] * 8


def test_freed_and_empty_tensors_with_nothing_to_copy_are_fine():
    src = torch.arange(4.0)
    src.untyped_storage().resize_(0)
    with pytest.raises(RuntimeError, match="storage"):
        reshard.copy_runs(src, np.zeros((0, 6), np.int64), dst4())  # sizes still say 4
    empty = torch.empty(0)
    dst = dst4()
    reshard.copy_runs(empty, np.zeros((0, 6), np.int64), dst)
    assert dst.tolist() == [POISON] * 4


# ------------------------------------------------------------------ memory shared with dst


def test_desc_that_shares_memory_with_dst_is_refused():
    """The rows are read while dst is written: a table inside dst could be rewritten by its own
    first row into rows that were never validated."""
    dst = torch.zeros(64, dtype=torch.int64)
    desc = dst[:12].view(2, 6)
    desc[0] = torch.tensor([0, 0, 6, 0, 6, 1])  # writes over row 1
    desc[1] = torch.tensor([0, 0, 20, 0, 4, 1])
    src = torch.tensor([0, 0, 1 << 40, 0, 4, 1])  # what row 1 would say after row 0
    refused(
        lambda: torch.ops.reshard.copy_runs(src, desc, dst),
        "reshard::copy_runs: desc and dst overlap in memory",
        written=[dst],
    )
    tail = torch.zeros(8, dtype=torch.int64)
    refused(  # a numpy table over dst's memory is shared, not copied, by as_desc
        lambda: reshard.copy_runs(tail[:6], dst.numpy()[:6].reshape(1, 6), dst),
        "desc and dst overlap",
        written=[dst],
    )


# ------------------------------------------------------------------ lazy views


@pytest.mark.parametrize("arg", ["src", "dst"])
@pytest.mark.parametrize("view", ["conj", "neg"])
def test_lazily_conjugated_or_negated_views_are_refused(arg, view):
    """torch's fallback for these views would run the op on a materialized copy: a written
    one asserts inside torch and aborts the process when it is collected (after this test)."""
    make = {"conj": torch.Tensor.conj, "neg": torch._neg_view}[view]
    dtype = torch.complex64 if view == "conj" else torch.float32
    src = torch.arange(4.0).to(dtype)
    base = torch.full((4,), POISON, dtype=dtype)
    dst = make(base) if arg == "dst" else base
    if arg == "src":
        src = make(src)
    hint = "resolve_conj()" if view == "conj" else "resolve_neg()"
    refused(lambda: reshard.copy_runs(src, DESC, dst), f"{arg} is a lazily", hint, written=[base])
    refused(
        lambda: torch.ops.reshard.copy_pieces([src], torch.tensor([[0, 0, 0, 4]]), dst),
        "srcs[0] is a lazily" if arg == "src" else "dst is a lazily",
        written=[base],
    )


@pytest.mark.parametrize(
    "desc, error, match",
    [
        ({0: [0, 1, 0, 1, 4, 1]}, TypeError, "desc must be a table of integers, got dict"),
        ("0,1,0,1,4,1", TypeError, "desc must be a table of integers, got str"),
        (DESC.to_sparse(), TypeError, "desc must be a dense \\(strided\\) tensor"),
        ([[]], ValueError, r"desc must have shape \[n, 6\].*got \(1, 0\)"),
        ([np.array([0, 1, 0, 1, 4]), np.array([0, 1])], TypeError, "rectangular table"),
    ],
)
def test_tables_the_wrappers_cannot_read_are_named(desc, error, match):
    """These raised from inside numpy or torch ('int() argument must be ... not dict',
    'unsupported memory format option Contiguous') or named the wrong fault ([[]]: 'must hold
    integers, got numpy dtype float64')."""
    src, dst = torch.arange(4.0), dst4()
    with pytest.raises(error, match=match):
        reshard.copy_runs(src, desc, dst)
    assert bool((dst == POISON).all())


def test_tables_and_sources_given_as_iterators_are_read_once():
    """A generator of rows was consumed by the integer check and then read again (empty) by
    numpy; a dict of sources gave its keys."""
    src = torch.arange(4.0)
    dst = reshard.copy_runs(src, (row for row in DESC.tolist()), dst4())
    assert torch.equal(dst, src)
    dst = _ops.copy_pieces((t for t in [src]), (r for r in [[0, 0, 0, 4]]), dst4())
    assert torch.equal(dst, src)
    for srcs, match in [({0: src}, "srcs must be a list of tensors, got dict"), ([None], "srcs")]:
        with pytest.raises(TypeError, match=match):
            _ops.copy_pieces(srcs, [[0, 0, 0, 4]], dst4())


# ------------------------------------------------------------------ read-only memory
# A write to read-only memory kills the process, so the calls that write it on the old code run
# in a fresh interpreter (`in_child`): a crash fails one test instead of ending the session.

needs_memory_map = memmaps.needs_memory_map
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def mapped(path, mode, n=4, dtype=np.float32, value=POISON):
    return memmaps.mapped(path, mode, n, value, dtype)


def in_child(case, *args):
    """Runs case(*args), a function of this module, in a fresh interpreter; returns its stdout."""
    code = f"import {__name__.rsplit('.', 1)[-1]} as m; m.{case.__name__}(*{args!r})"
    path = os.pathsep.join([os.path.dirname(os.path.abspath(__file__)), *sys.path])
    child = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=300,
    )
    died = f" (signal {signal.Signals(-child.returncode).name})" if child.returncode < 0 else ""
    assert child.returncode == 0, (
        f"{case.__name__}{args} exited with {child.returncode}{died}:\n{child.stderr[-4000:]}"
    )
    return child.stdout


# Each writing op called with `arg` over a read-only memmap: op -> (arg, dtype, call(view)).
def _writing_calls():
    src = torch.arange(4.0)
    return {
        "copy_runs": ("dst", np.float32, lambda t: torch.ops.reshard.copy_runs(src, DESC, t)),
        "copy_pieces": (
            "dst",
            np.float32,
            lambda t: torch.ops.reshard.copy_pieces([src], torch.tensor([[0, 0, 0, 4]]), t),
        ),
        "progress_set": ("progress", np.int64, lambda t: torch.ops.reshard.progress_set(t, 5)),
        "stage_d2h": (
            "dst",
            np.float32,
            lambda t: torch.ops.reshard.stage_d2h(
                src.cuda(), DESC, torch.empty(1 << 16, dtype=torch.uint8, pin_memory=True), t
            ),
        ),
        "stage_h2d": (
            "progress",
            np.int64,
            lambda t: torch.ops.reshard.stage_h2d(
                src,
                DESC,
                torch.empty(1 << 16, dtype=torch.uint8, pin_memory=True),
                torch.zeros(4, device="cuda"),
                t,
            ),
        ),
    }


def refuses_read_only(op, path):
    arg, dtype, call = _writing_calls()[op]
    target = mapped(path, "r", dtype=dtype, value=7)
    refused(
        lambda: call(target),
        f"reshard::{op}: {arg}: byte 0 of it is not writable (read-only memory: mapped r--s "
        f"from {path})",
        "pass writable memory",
        written=[target],
    )


def accepts_copy_on_write(op, path):
    """A private writable mapping (memmap mode 'c') is written, its file not."""
    arg, dtype, call = _writing_calls()[op]
    target = mapped(path, "c", dtype=dtype, value=7)
    call(target)
    if op == "stage_h2d":  # published: the sequence number a waiter sleeps on moved on
        assert target[1] != 7 and target[2:].tolist() == [7, 7], target
    else:  # progress_set: the value, and the sequence number bumped
        want = [5, 8, 7, 7] if arg == "progress" else [0, 1, 2, 3]
        assert target.tolist() == want, target
    assert mapped(path, "r", dtype=dtype).tolist() == [7, 7, 7, 7]


# every op that writes CPU memory
WRITING_OPS = [
    "copy_runs",
    "copy_pieces",
    "progress_set",
    pytest.param("stage_d2h", marks=needs_cuda),
    pytest.param("stage_h2d", marks=needs_cuda),
]


@needs_memory_map
@pytest.mark.parametrize("op", WRITING_OPS)
def test_a_destination_in_read_only_memory_is_refused_before_any_write(op, tmp_path):
    in_child(refuses_read_only, op, str(tmp_path / "t.bin"))


@pytest.mark.parametrize("op", WRITING_OPS)
def test_a_copy_on_write_destination_is_written(op, tmp_path):
    accepts_copy_on_write(op, str(tmp_path / "t.bin"))


def test_read_only_sources_are_read(tmp_path):
    source = mapped(tmp_path / "s.bin", "r", value=3.0)
    dst = dst4()
    torch.ops.reshard.copy_runs(source, DESC, dst)
    assert dst.tolist() == [3.0] * 4
    dst = dst4()
    torch.ops.reshard.copy_pieces([source, torch.arange(4.0)], torch.tensor([[0, 1, 0, 2]]), dst)
    assert dst.tolist() == [3.0, 3.0, POISON, POISON]


def _two_pages_second_read_only():
    """A float32 tensor over two anonymous pages, poisoned; the second made read-only."""
    page = mmap.PAGESIZE
    mem = mmap.mmap(-1, 2 * page)
    t = torch.frombuffer(mem, dtype=torch.float32)
    t.fill_(POISON)
    memmaps.protect_read_only(t.data_ptr() + page, page)
    return t, mem


def refuses_partly_read_only():
    """Only the second page of dst is read-only: the error names its first byte; a view of
    the first page alone is written."""
    t, _mem = _two_pages_second_read_only()
    n, page = t.numel(), mmap.PAGESIZE
    desc = torch.tensor([[0, 1, 0, 1, n, 1]])
    refused(
        lambda: torch.ops.reshard.copy_runs(torch.arange(float(n)), desc, t),
        f"reshard::copy_runs: dst: byte {page} of it is not writable",
        "(read-only memory: mapped r--",
        written=[t],
    )
    torch.ops.reshard.copy_runs(torch.arange(4.0), DESC, t[:4])
    assert t[:5].tolist() == [0.0, 1.0, 2.0, 3.0, POISON]


@needs_memory_map
def test_a_destination_partly_in_read_only_memory_names_its_first_unwritable_byte():
    in_child(refuses_partly_read_only)


def refuses_read_only_at_a_verified_address(path):
    """A destination over a writable memmap is written; it is freed, and a read-only mapping
    of the file takes its address: same address and size (and maybe the same storage object's
    memory), but a new storage, so it is looked up again."""
    n = mmap.PAGESIZE
    dst = mapped(path, "r+", n=n)
    desc = torch.tensor([[0, 1, 0, 1, n, 1]])
    torch.ops.reshard.copy_runs(torch.zeros(n), desc, dst)
    at = dst.data_ptr()
    del dst
    gc.collect()  # the memmap, and with it the mapping, goes with its last tensor
    if memmaps.map_read_only_at(path, at, 4 * n) != at:  # left mapped: the child exits
        print("skip: the kernel did not map the file at the freed destination's address")
        return
    dst = torch.frombuffer((ctypes.c_char * (4 * n)).from_address(at), dtype=torch.float32)
    refused(
        lambda: torch.ops.reshard.copy_runs(torch.ones(n), desc, dst),
        "dst: byte 0 of it is not writable",
        written=[dst],
    )


@needs_memory_map
def test_a_read_only_mapping_at_a_verified_destinations_address_is_refused(tmp_path):
    out = in_child(refuses_read_only_at_a_verified_address, str(tmp_path / "t.bin"))
    if out.startswith("skip: "):
        pytest.skip(out[len("skip: ") :].strip())
