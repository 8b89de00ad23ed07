"""reshard::copy_runs on the CPU against independent references.

References: element indices come from a plain Python (or numpy) expansion of the table, and
values from torch's own contiguous `.to()`, so a wrong offset, a wrong cast or a stray write
all show up. Destinations are poisoned with a byte pattern that no copy writes.
"""

import ctypes
import itertools
import platform
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import reshard
from reshard import _ops

OP = torch.ops.reshard.copy_runs.default
FLOATS = [torch.float32, torch.bfloat16, torch.float16]
RAW = [
    torch.bool,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.uint16,
    torch.int32,
    torch.uint32,
    torch.int64,
    torch.float64,
    torch.complex64,
    torch.float8_e4m3fn,
]
POISON = 0x5B  # byte pattern of untouched destination memory


# ------------------------------------------------------------------ helpers


def bits(t: torch.Tensor) -> np.ndarray:
    """The raw bytes of a tensor as a numpy uint8 array (bitwise comparisons: NaN payloads,
    signed zeros)."""
    return t.contiguous().view(torch.uint8).numpy().copy()


def poisoned(numel: int, dtype: torch.dtype) -> torch.Tensor:
    t = torch.empty(numel, dtype=dtype)
    t.view(torch.uint8).fill_(POISON)
    return t


def random_values(numel: int, dtype: torch.dtype, gen: np.random.Generator) -> torch.Tensor:
    """Random bit patterns (floats include NaN payloads, infs, subnormals)."""
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    raw = torch.from_numpy(gen.integers(0, 256, size=nbytes, dtype=np.uint8))
    t = raw.view(dtype) if numel else torch.empty(0, dtype=dtype)
    if dtype == torch.bool:
        t = raw.view(torch.uint8).remainder(2).view(torch.bool)
    return t.clone()


def expand(desc: np.ndarray):
    """(src_index, dst_index) lists of every element the table copies, by brute force."""
    src_idx, dst_idx = [], []
    for so, ss, do, ds, length, count in desc.tolist():
        for c in range(count):
            for j in range(length):
                src_idx.append(so + c * ss + j)
                dst_idx.append(do + c * ds + j)
    return src_idx, dst_idx


def expand_np(desc: np.ndarray):
    """The same expansion, vectorized (for tables too big for Python loops)."""
    desc = np.asarray(desc, dtype=np.int64).reshape(-1, 6)
    so, ss, do, ds, length, count = desc.T
    segs = count
    row = np.repeat(np.arange(len(desc)), segs)
    seg_start = np.cumsum(segs) - segs
    c = np.arange(segs.sum()) - np.repeat(seg_start, segs)
    seg_len = length[row]
    src0 = so[row] + c * ss[row]
    dst0 = do[row] + c * ds[row]
    e_seg = np.repeat(np.arange(len(row)), seg_len)
    e_start = np.cumsum(seg_len) - seg_len
    j = np.arange(seg_len.sum()) - np.repeat(e_start, seg_len)
    return src0[e_seg] + j, dst0[e_seg] + j


def f16_nan_to_f32_bits(h: np.ndarray) -> np.ndarray:
    """torch's vectorized f16 -> f32 of a NaN: sign and payload kept, quiet bit set. (Its
    scalar tail loop, for the last numel % 8 elements, returns 0x7FFFFFFF instead; reshard
    follows the vectorized body everywhere.)"""
    h = h.astype(np.uint32)
    return ((h & 0x8000) << 16) | 0x7FC00000 | ((h & 0x3FF) << 13)


def reference(src, desc, dst, big=False):
    out = dst.view(torch.uint8).clone().view(dst.dtype)  # byte copy: bool clone normalizes
    si, di = expand_np(desc) if big else expand(np.asarray(desc))
    if len(si) and src.dtype == dst.dtype:  # raw copy: move bytes in numpy, any dtype
        esize = src.element_size()
        out_b = out.view(torch.uint8).numpy().reshape(-1, esize)
        out_b[np.asarray(di)] = src.view(torch.uint8).numpy().reshape(-1, esize)[np.asarray(si)]
    elif len(si):
        gathered = src[torch.as_tensor(si, dtype=torch.int64)].contiguous()
        converted = gathered.to(dst.dtype)
        if src.dtype == torch.float16 and dst.dtype == torch.float32:
            nan = torch.isnan(gathered).numpy()
            h = gathered.view(torch.int16).numpy().view(np.uint16)
            fixed = converted.view(torch.int32).numpy().view(np.uint32).copy()
            fixed[nan] = f16_nan_to_f32_bits(h[nan])
            converted = torch.from_numpy(fixed.view(np.float32))
        out[torch.as_tensor(di, dtype=torch.int64)] = converted
    return out


def random_table(gen, src_numel, dst_numel, max_rows=12):
    """A random table with in-range reads and non-overlapping in-range writes: rows are drawn
    freely (strided, zero counts, zero lengths, stride-0 reads) and kept only if their writes
    miss every element already written."""
    written = np.zeros(dst_numel, dtype=bool)
    rows = []
    for _ in range(int(gen.integers(0, max_rows + 1))):
        length = int(gen.integers(0, 9))
        count = int(gen.integers(0, 5))
        if gen.random() < 0.3:
            count = 1
        dst_stride = length + int(gen.integers(0, 7))
        src_stride = int(gen.integers(0, 12))
        src_span = (count - 1) * src_stride + length if count and length else 0
        dst_span = (count - 1) * dst_stride + length if count and length else 0
        if src_span > src_numel or dst_span > dst_numel:
            continue
        so = int(gen.integers(0, src_numel - src_span + 1))
        do = int(gen.integers(0, dst_numel - dst_span + 1))
        row = [so, src_stride, do, dst_stride, length, count]
        _, di = expand(np.array([row]))
        if di and written[di].any():
            continue
        written[di] = True
        rows.append(row)
    order = gen.permutation(len(rows)) if rows else []
    return np.array([rows[i] for i in order], dtype=np.int64).reshape(-1, 6)


def run_and_compare(src, desc, dst_dtype, dst_numel, big=False):
    dst = poisoned(dst_numel, dst_dtype)
    want = reference(src, desc, dst, big=big)
    got = reshard.copy_runs(src, desc, dst)
    assert got is dst
    np.testing.assert_array_equal(bits(dst), bits(want))
    return dst


# ------------------------------------------------------------------ correctness


@pytest.mark.parametrize("sdt,ddt", list(itertools.product(FLOATS, FLOATS)))
def test_random_tables_float_pairs(sdt, ddt):
    seed = FLOATS.index(sdt) * len(FLOATS) + FLOATS.index(ddt)  # stable across hash seeds
    print(f"random tables seed {seed}")  # shown by pytest when the test fails
    gen = np.random.default_rng(seed)
    for _ in range(60):
        sn, dn = int(gen.integers(1, 200)), int(gen.integers(1, 200))
        src = random_values(sn, sdt, gen)
        run_and_compare(src, random_table(gen, sn, dn), ddt, dn)


@pytest.mark.parametrize("dtype", RAW + FLOATS)
def test_random_tables_same_dtype(dtype):
    gen = np.random.default_rng(7)
    for _ in range(40):
        sn, dn = int(gen.integers(1, 150)), int(gen.integers(1, 150))
        src = random_values(sn, dtype, gen)
        run_and_compare(src, random_table(gen, sn, dn), dtype, dn)


@given(
    data=st.data(),
    sdt=st.sampled_from(FLOATS + [torch.int32, torch.uint8]),
    ddt=st.sampled_from(FLOATS),
)
def test_property_random_tables(data, sdt, ddt):
    if sdt not in FLOATS:
        ddt = sdt
    seed = data.draw(st.integers(0, 2**32 - 1))
    sn = data.draw(st.integers(0, 300))
    dn = data.draw(st.integers(0, 300))
    gen = np.random.default_rng(seed)
    src = random_values(sn, sdt, gen)
    desc = random_table(gen, max(sn, 1), max(dn, 1)) if sn and dn else np.zeros((0, 6), np.int64)
    run_and_compare(src, desc, ddt, dn)


def test_zero_rows_zero_counts_empty_buffers():
    src = torch.arange(10, dtype=torch.float32)
    for desc in [
        np.zeros((0, 6), dtype=np.int64),
        np.array([[0, 1, 0, 1, 0, 5], [3, 1, 3, 1, 4, 0], [9999, 7, 9999, 7, 0, 0]]),
    ]:
        dst = poisoned(10, torch.float32)
        before = bits(dst)
        reshard.copy_runs(src, desc, dst)
        np.testing.assert_array_equal(bits(dst), before)
    reshard.copy_runs(torch.empty(0), np.zeros((0, 6), np.int64), torch.empty(0))
    reshard.copy_runs(torch.empty(0), [], torch.empty(0))
    # a zero-count row is a no-op even when its offsets point past an empty buffer
    reshard.copy_runs(torch.empty(0), np.array([[5, 1, 5, 1, 3, 0]]), torch.empty(0))


def test_stride_zero_reads_broadcast():
    src = torch.tensor([1.5, 2.5, 3.5])
    dst = run_and_compare(src, np.array([[1, 0, 0, 2, 2, 4]]), torch.bfloat16, 9)
    assert dst[:8].float().tolist() == [2.5, 3.5] * 4


@pytest.fixture
def torch_threads(request):
    """torch's intra-op thread count for one test (parametrize indirectly), then restored."""
    old = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(old)


@pytest.mark.parametrize("torch_threads", [1, 2], indirect=True)
def test_large_tables_split_across_threads(torch_threads):
    """One huge run and many tiny ones: the byte split cuts runs in the middle, so a bug at
    a chunk boundary shows up as a wrong or missing element."""
    gen = np.random.default_rng(torch_threads)
    n = 3_000_001
    src = random_values(n, torch.float32, gen)
    run_and_compare(src, np.array([[1, 0, 0, 0, n - 1, 1]]), torch.bfloat16, n, big=True)
    # 200k tiny runs of 3, reading backwards, writing every other slot
    k = 200_000
    rows = np.zeros((k, 6), dtype=np.int64)
    rows[:, 0] = (k - 1 - np.arange(k)) * 3
    rows[:, 2] = np.arange(k) * 5
    rows[:, 4] = 3
    rows[:, 5] = 1
    run_and_compare(src, rows, torch.float16, 5 * k, big=True)
    # one strided row of 100k segments (a column of a matrix)
    run_and_compare(
        src, np.array([[7, 13, 1, 29, 11, 100_000]]), torch.float32, 2_900_000, big=True
    )


@pytest.mark.parametrize(
    "dtype,torch_threads",
    [(torch.uint8, 2), (torch.float32, 1), (torch.int64, 2)],
    indirect=["torch_threads"],
)
def test_streaming_stores_on_large_destinations(dtype, torch_threads):
    """Destinations of >= 4 MiB take the C core's streaming-store path: runs with unaligned
    starts and ends (single bytes for uint8), short runs that stay on memcpy, long runs cut
    between threads, gaps that must keep their poison."""
    gen = np.random.default_rng(7)
    esize = torch.empty(0, dtype=dtype).element_size()
    target = (8 << 20) // esize  # destination elements
    src = random_values(target, dtype, gen)
    rows, at = [], 0
    while at < target - 200:  # rows in dst order with gaps; src anywhere
        length = int(gen.choice([1, 17, 63, 65, 255, 257, 4099, 65_537, 1_000_003]))
        count = int(gen.integers(1, 4))
        dst_stride = length + int(gen.integers(0, 70))
        src_stride = int(gen.integers(0, length + 9))
        do = at + int(gen.integers(0, 67))
        if do + (count - 1) * dst_stride + length > target:
            continue
        so = int(gen.integers(0, target - (count - 1) * src_stride - length + 1))
        rows.append([so, src_stride, do, dst_stride, length, count])
        at = do + (count - 1) * dst_stride + length
    desc = np.array(rows, dtype=np.int64)[gen.permutation(len(rows))]
    assert (desc[:, 4] * desc[:, 5]).sum() * esize >= 4 << 20  # the streaming threshold
    run_and_compare(src, desc, dtype, target, big=True)


# ------------------------------------------------------------------ casts vs torch


@pytest.fixture(params=["default", "avx2", "avx512"])
def cpu_capability(request, monkeypatch):
    """Every cast is checked with each instruction-set level of the C core's converters (a
    level the CPU lacks falls back to the best it has)."""
    monkeypatch.setenv("RESHARD_CPU_CAPABILITY", request.param)
    return request.param


def _core_capability():
    from reshard import _C

    return ctypes.CDLL(_C.__file__).rs_cpu_capability()


def test_cpu_capability_cap(cpu_capability):
    level = _core_capability()
    assert level <= {"default": 0, "avx2": 1, "avx512": 2}[cpu_capability]
    if platform.machine() in ("x86_64", "AMD64") and cpu_capability != "default":
        assert level >= 1 or "avx2" not in open("/proc/cpuinfo").read()


def _all16(dtype):
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)


@pytest.mark.parametrize("sdt", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ddt", FLOATS)
def test_casts_exhaustive_16bit(sdt, ddt, cpu_capability):
    src = _all16(sdt).clone()
    n = src.numel()
    dst = poisoned(n, ddt)
    reshard.copy_runs(src, np.array([[0, 0, 0, 0, n, 1]]), dst)
    np.testing.assert_array_equal(bits(dst), bits(src.to(ddt)))


@pytest.mark.parametrize("ddt", [torch.bfloat16, torch.float16])
def test_casts_from_f32_bit_patterns(ddt, cpu_capability):
    gen = np.random.default_rng(0)
    special = np.array(
        [
            0,
            0x80000000,
            0x7F800000,
            0xFF800000,
            0x7FC00000,
            0xFFC00000,
            0x7FA00000,
            0xFF812345,
            0x7F800001,
            0x7FFFFFFF,
            0x00000001,
            0x807FFFFF,
            0x33000000,
            0x33000001,
            0x337FFFFF,
            0x387FE000,
            0x38800000,
            0x477FE000,
            0x477FF000,
            0x477FEFFF,
            0x47800000,
            0x7F7FFFFF,
            0x3F808000,
            0x3F818000,
            0x3F807FFF,
        ],
        dtype=np.uint32,
    )
    # random patterns, plus every rounding-relevant low half under a few upper halves
    low = np.arange(2**16, dtype=np.uint32)
    uppers = np.array([0x3F80, 0x0000, 0x8001, 0x387F, 0x3880, 0x477F, 0x7F7F, 0x7F80], np.uint32)
    patterns = np.concatenate(
        [special, gen.integers(0, 2**32, size=2_000_000, dtype=np.uint32)]
        + [(u << 16) | low for u in uppers]
    )
    src = torch.from_numpy(patterns.view(np.float32).copy())
    n = src.numel()
    dst = poisoned(n, ddt)
    reshard.copy_runs(src, np.array([[0, 0, 0, 0, n, 1]]), dst)
    np.testing.assert_array_equal(bits(dst), bits(src.to(ddt)))


def test_nan_rules_match_torch(cpu_capability):
    """The NaN results differ per pair in torch (see csrc/reshard.h); pin them."""
    f = torch.tensor([float("nan"), -float("nan")])
    out = reshard.copy_runs(f, np.array([[0, 0, 0, 0, 2, 1]]), poisoned(2, torch.bfloat16))
    assert bits(out).view(np.uint16).tolist() == bits(f.to(torch.bfloat16)).view(np.uint16).tolist()
    h = torch.tensor([0x7E00, 0xFE01], dtype=torch.int32).to(torch.int16).view(torch.float16)
    out = reshard.copy_runs(h, np.array([[0, 0, 0, 0, 2, 1]]), poisoned(2, torch.bfloat16))
    assert bits(out).view(np.uint16).tolist() == bits(h.to(torch.bfloat16)).view(np.uint16).tolist()
    # f16 -> f32: torch's vectorized body (8 elements here) keeps sign and payload
    h8 = torch.tensor([0x7D55, 0xFD55 - 65536, 0x7C01] + [0x7E00] * 5, dtype=torch.int16)
    h8 = h8.view(torch.float16)
    out = reshard.copy_runs(h8, np.array([[0, 0, 0, 0, 8, 1]]), poisoned(8, torch.float32))
    want = bits(h8.to(torch.float32)).view(np.uint32)
    assert bits(out).view(np.uint32).tolist() == want.tolist()
    assert want[:3].tolist() == [0x7FEAA000, 0xFFEAA000, 0x7FC02000]


# ------------------------------------------------------------------ errors


def _expect_error(src, desc, dst, *fragments):
    before = bits(dst)
    with pytest.raises((RuntimeError, TypeError, ValueError)) as info:
        reshard.copy_runs(src, desc, dst)
    msg = str(info.value)
    for frag in fragments:
        assert frag in msg, f"{frag!r} not in {msg!r}"
    np.testing.assert_array_equal(bits(dst), before)  # nothing written
    return msg


GOOD = [0, 1, 0, 1, 4, 1]


@pytest.mark.parametrize("col", range(6))
def test_negative_field_names_row_and_field(col):
    rows = np.array([GOOD, GOOD, GOOD], dtype=np.int64)
    rows[1, 2] = 10  # keep the good rows from overlapping
    rows[2, 2] = 20
    rows[2, col] = -3
    names = _ops.DESC_COLUMNS
    _expect_error(
        torch.ones(64),
        rows,
        poisoned(64, torch.float32),
        "reshard::copy_runs",
        "row 2",
        names[col],
        "negative",
    )


@pytest.mark.parametrize(
    "row,fragment",
    [
        ([60, 1, 0, 1, 5, 1], "reads src[64]"),
        ([0, 20, 0, 5, 5, 4], "reads src[64]"),
        ([0, 1, 62, 1, 3, 1], "writes dst[64]"),
        ([0, 1, 0, 2**62, 1, 3], "overflows int64"),
        ([0, 2**62, 0, 1, 1, 3], "overflows int64"),
        ([2**63 - 2, 1, 0, 1, 4, 1], "overflows int64"),
        ([0, 1, 0, 2, 3, 2], "overlap within the row"),
    ],
)
def test_bad_row_is_named(row, fragment):
    rows = np.array([GOOD, [0, 1, 10, 1, 4, 1], row], dtype=np.int64)
    if not fragment.startswith("writes"):
        rows[2, 2] += 20  # clear of rows 0 and 1, so only the named defect remains
    _expect_error(
        torch.ones(64),
        rows,
        poisoned(64, torch.float32),
        "reshard::copy_runs",
        "row 2",
        fragment,
    )


def test_overlap_across_rows_names_both():
    rows = np.array([[0, 1, 30, 8, 2, 3], GOOD, [0, 1, 39, 1, 1, 1]], dtype=np.int64)
    _expect_error(
        torch.ones(64), rows, poisoned(64, torch.float32), "rows 0 and 2 write the same dst"
    )
    # interleaved columns that do not overlap are fine
    cols = np.array([[0, 1, c, 4, 1, 16] for c in (3, 1, 0, 2)], dtype=np.int64)
    run_and_compare(torch.arange(64.0), cols, torch.float32, 64)


def test_bad_arguments():
    src, dst = torch.ones(16), poisoned(16, torch.float32)
    desc = torch.tensor([GOOD])
    op = "reshard::copy_runs"
    with pytest.raises(RuntimeError, match="desc must be int64"):
        OP(src, desc.int(), dst)
    with pytest.raises(RuntimeError, match=r"desc must have shape \[n, 6\]"):
        OP(src, desc[:, :5].contiguous(), dst)
    with pytest.raises(RuntimeError, match=r"desc must have shape \[n, 6\]"):
        OP(src, desc.flatten(), dst)
    _expect_error(src.view(4, 4), desc, dst, op, "src must be 1-D")
    _expect_error(src, desc, torch.ones(4, 4), op, "dst must be 1-D")
    _expect_error(src, desc, torch.ones(32)[::2], op, "dst must be contiguous")
    _expect_error(torch.ones(32)[::2], desc, dst, op, "src must be contiguous")
    _expect_error(src.int(), desc, dst, op, "cannot copy Int to Float")
    _expect_error(src, desc, poisoned(16, torch.int32), op, "cannot copy Float to Int")
    _expect_error(
        torch.ones(4, dtype=torch.complex128),
        desc,
        torch.ones(4, dtype=torch.complex128),
        op,
        "element size",
    )
    buf = torch.zeros(32)
    _expect_error(buf[:16], [[0, 1, 0, 1, 2, 1]], buf[8:24], op, "overlap in memory")
    with pytest.raises(TypeError, match="desc must hold integers"):
        reshard.copy_runs(src, np.array([[0.0, 1, 0, 1, 4, 1]]), dst)
    with pytest.raises(ValueError, match=r"shape \[n, 6\]"):
        reshard.copy_runs(src, np.zeros((2, 5), np.int64), dst)
    with pytest.raises(TypeError, match="desc must hold integers, got torch.float32"):
        reshard.copy_runs(src, desc.float(), dst)
    with pytest.raises(ValueError, match="desc holds a value outside int64"):
        reshard.copy_runs(src, [[0, 1, 0, 1, 2**70, 1]], dst)
    with pytest.raises(ValueError, match="desc holds a value outside int64"):
        reshard.copy_runs(src, np.array([[0, 1, 0, 1, 2**63, 1]], np.uint64), dst)
    with pytest.raises(TypeError, match="rectangular table of integers"):
        reshard.copy_runs(src, [[0, 1, 0, 1, 2, 1], [0]], dst)
    # numpy would truncate these, or read True as 1
    for bad in (Fraction(3, 2), Decimal("1.9"), True, 1.0):
        with pytest.raises(TypeError, match="desc must hold integers, got"):
            reshard.copy_runs(src, [[bad, 1, 0, 1, 2, 1]], dst)
    with pytest.raises(ValueError, match="desc holds a value outside int64"):
        reshard.copy_runs(src, [[2**63, 1, 0, 1, 2, 1]], dst)
    assert torch.equal(dst, poisoned(16, torch.float32))


def test_error_after_many_good_rows_writes_nothing():
    """Row 9999 is bad: all 9999 good rows before it must not have been applied."""
    k = 10_000
    rows = np.zeros((k, 6), dtype=np.int64)
    rows[:, 2] = np.arange(k) * 4
    rows[:, 4] = 4
    rows[:, 5] = 1
    rows[-1, 0] = 10**6
    _expect_error(torch.ones(4 * k), rows, poisoned(4 * k, torch.float32), "row 9999")


def test_desc_forms():
    src = torch.arange(8.0)
    want = run_and_compare(src, np.array([[0, 2, 1, 3, 2, 2]]), torch.float32, 8)
    for desc in (
        [[0, 2, 1, 3, 2, 2]],
        np.array([[0, 2, 1, 3, 2, 2]], dtype=np.int32),
        torch.tensor([[0, 2, 1, 3, 2, 2]], dtype=torch.int32),  # widened, as numpy's int32
        torch.tensor([[0, 2, 1, 3, 2, 2], [5] * 6]).t().contiguous().t()[:1],  # strides (1, 2)
    ):
        dst = poisoned(8, torch.float32)
        reshard.copy_runs(src, desc, dst)
        np.testing.assert_array_equal(bits(dst), bits(want))


# ------------------------------------------------------------------ torch integration


def _opcheck_samples():
    gen = np.random.default_rng(3)
    for sdt, ddt in [(a, b) for a in FLOATS for b in FLOATS] + [(torch.int64, torch.int64)]:
        for _ in range(3):
            sn, dn = int(gen.integers(1, 64)), int(gen.integers(1, 64))
            desc = torch.from_numpy(random_table(gen, sn, dn))
            src = random_values(sn, sdt, gen)
            if sdt.is_floating_point:
                src = torch.randn(sn).to(sdt)  # opcheck compares values: avoid NaNs
            yield src, desc, torch.zeros(dn, dtype=ddt)
    yield torch.zeros(0), torch.zeros((0, 6), dtype=torch.int64), torch.zeros(0)


@pytest.mark.parametrize("sample", list(_opcheck_samples()), ids=lambda s: f"{s[0].dtype}")
def test_opcheck(sample):
    torch.library.opcheck(OP, sample)


def test_fake_impl_checks_metadata():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        src, dst = torch.empty(8), torch.empty(8)
        OP(src, torch.empty((3, 6), dtype=torch.int64), dst)
        with pytest.raises(RuntimeError, match="desc must have shape"):
            OP(src, torch.empty((3, 5), dtype=torch.int64), dst)


def test_torch_compile_fullgraph():
    def pack(src, desc, dst):
        torch.ops.reshard.copy_runs(src * 2, desc, dst)
        return dst + 1

    compiled = torch.compile(pack, fullgraph=True, backend="inductor")
    gen = np.random.default_rng(5)
    for _ in range(3):
        desc = torch.from_numpy(random_table(gen, 50, 60))
        src = torch.randn(50)
        a, b = torch.zeros(60), torch.zeros(60)
        np.testing.assert_array_equal(compiled(src, desc, a).numpy(), pack(src, desc, b).numpy())
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_lazy_public_name():
    assert reshard.copy_runs is _ops.copy_runs


def test_extension_links_torch_openmp():
    """Without -fopenmp, at::parallel_for compiles to a serial loop and every test above
    still passes on one thread: guard the build flag itself."""
    import shutil
    import subprocess

    if not torch.backends.openmp.is_available():
        pytest.skip("this torch is built without OpenMP: at::parallel_for is serial by design")
    assert shutil.which("readelf"), "readelf (binutils) is needed: make deps-system installs it"
    dyn = subprocess.run(
        ["readelf", "-d", reshard._C.__file__], capture_output=True, text=True, check=True
    ).stdout
    assert "libgomp" in dyn, dyn


def test_info_reports_the_build():
    import json
    import subprocess
    import sys

    res = subprocess.run(
        [sys.executable, "-m", "reshard.info", "--json"], capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout)
    assert info["build"]["c_core"] == "0.1.0"
    assert info["build"]["torch"] == torch.__version__
    assert info["torch_matches_build"] is True
    assert info["build"]["cuda"] == _ops.built_with_cuda()
    assert set(info["ops"]) == {s.split("(")[0] for s in _ops.SCHEMAS}
    text = subprocess.run(
        [sys.executable, "-m", "reshard.info"], capture_output=True, text=True, check=True
    ).stdout
    assert "C core          0.1.0" in text and "MISMATCH" not in text
