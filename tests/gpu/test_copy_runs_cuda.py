"""reshard::copy_runs on CUDA: random tables against an independent reference and against the
CPU implementation (bit for bit, NaNs included), odd sizes, errors, caching, streams,
opcheck and torch.compile. Skipped without a CUDA device."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gpu_ref import (
    FLOAT_PAIRS,
    RAW,
    assert_same,
    poison,
    random_table,
    random_values,
    reference,
    require_cuda_build,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

from reshard import _ops as ops  # noqa: E402

require_cuda_build()

DEV = "cuda"
PAIRS = FLOAT_PAIRS + [(t, t) for t in RAW]


def _ids(p):
    return f"{str(p[0]).split('.')[-1]}-{str(p[1]).split('.')[-1]}"


def run_both(src_cpu, desc, dst_dtype, dst_numel, src_offset=0, dst_offset=0, cached=True):
    """Runs the CUDA op (on views starting src_offset/dst_offset elements into their buffers,
    to misalign them) and the CPU op on poisoned outputs; returns (cuda_out, cpu_out, ref).
    cached=False hands the CUDA op desc as an inference tensor, which stays outside its table
    cache: the tile kernels instead of a cached table's compact form."""
    table = desc
    if not cached:
        with torch.inference_mode():
            table = ops.as_desc(desc).clone()
    sbuf = torch.empty(src_cpu.numel() + src_offset, dtype=src_cpu.dtype, device=DEV)
    src = sbuf[src_offset:]
    src.copy_(src_cpu.to(DEV))
    dbuf = poison(dst_numel + dst_offset, dst_dtype, DEV)
    dst = dbuf[dst_offset:]
    ref = reference(src_cpu, desc, poison(dst_numel, dst_dtype, "cpu"))
    ops.copy_runs(src, table, dst)
    cpu = poison(dst_numel, dst_dtype, "cpu")
    ops.copy_runs(src_cpu, desc, cpu)
    torch.cuda.synchronize()
    assert torch.equal(dbuf[:dst_offset].cpu(), poison(dst_offset, dst_dtype, "cpu"))
    return dst.cpu(), cpu, ref


@pytest.mark.parametrize("pair", PAIRS, ids=_ids)
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("cached", [True, False], ids=["cached", "uncached"])
def test_random_tables(pair, seed, cached):
    sdt, ddt = pair
    rng = np.random.default_rng(seed)
    for n, max_len, max_count in [(1, 1, 1), (7, 40, 3), (300, 200, 4), (2000, 9, 20)]:
        desc, sn, dn = random_table(rng, n, max_len, max_count)
        src = random_values(rng, sn, sdt)
        out, cpu, ref = run_both(src, desc, ddt, dn, cached=cached)
        assert_same(out, ref)
        assert_same(out, cpu, nan_exact=True)


@pytest.mark.parametrize("pair", PAIRS, ids=_ids)
@pytest.mark.parametrize("offsets", [(1, 0), (0, 3), (5, 7)])
@pytest.mark.parametrize("cached", [True, False], ids=["cached", "uncached"])
def test_misaligned(pair, offsets, cached):
    sdt, ddt = pair
    rng = np.random.default_rng(7)
    desc, sn, dn = random_table(rng, 50, 300, 3)
    src = random_values(rng, sn, sdt)
    out, cpu, ref = run_both(src, desc, ddt, dn, *offsets, cached=cached)
    assert_same(out, ref)
    assert_same(out, cpu, nan_exact=True)


def _tile_elems(src_size, dst_size):
    """Work elements of one warp tile (copy_runs.cu: tile_elems): 32 lanes x U groups of V."""
    v = 16 // min(src_size, dst_size)
    u = 8 // (v * max(src_size, dst_size) // 16)
    return 32 * u * v, v


def _short_run_table(rng, lens, count_max, aligned, v):
    """Rows of the given run lengths (count 1..count_max, strided when > 1), in random order,
    with empty rows mixed in; offsets multiples of v when aligned (whole 16-byte groups),
    anything otherwise."""
    rows, dpos, src_need = [], int(rng.integers(0, 3)) * (v if aligned else 1), 0
    for ln in lens:
        ct = int(rng.integers(1, count_max + 1))
        gap = int(rng.integers(0, 3)) * v if aligned else int(rng.integers(0, 5))
        so = int(rng.integers(0, 4000)) * (v if aligned else 1) + (0 if aligned else 1)
        ss = ln + gap
        ds = ln + gap
        rows.append((so, ss, dpos, ds, ln, ct))
        dpos += (ct - 1) * ds + ln + gap
        src_need = max(src_need, so + (ct - 1) * ss + ln)
        if rng.random() < 0.05:  # an empty row (zero length or zero count) in between
            rows.append((0, 0, dpos, 0, 0, 1) if rng.random() < 0.5 else (0, 1, dpos, 1, 3, 0))
    desc = np.array(rows, dtype=np.int64)[rng.permutation(len(rows))]
    return desc, src_need + 3, dpos + 1


@pytest.mark.parametrize("pair", PAIRS, ids=_ids)
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "misaligned"])
def test_short_run_tiles(pair, aligned):
    """Tiles of 2..33 rows (the short-run path stages a tile's rows in shared memory and loads
    every group before storing): run lengths around tile/32 (32 and 33 rows per tile), whole
    and partial 16-byte groups, groups that cross runs and rows, strided rows, empty rows,
    aligned and misaligned offsets; against the reference and the CPU op, bit for bit."""
    sdt, ddt = pair
    tile, v = _tile_elems(sdt.itemsize, ddt.itemsize)
    rng = np.random.default_rng(17 + sdt.itemsize * 3 + ddt.itemsize)
    for base in sorted({tile // 32 - 1, tile // 32, tile // 32 + 1, tile // 16, 2 * v, v + 1}):
        for count_max in (1, 3):
            lens = rng.integers(max(1, base - 1), base + 2, 400)
            if aligned:
                lens = np.maximum(v, lens // v * v)
            desc, sn, dn = _short_run_table(rng, lens.tolist(), count_max, aligned, v)
            src = random_values(rng, sn, sdt)
            offsets = (0, 0) if aligned else (1, 3)
            out, cpu, ref = run_both(src, desc, ddt, dn, *offsets, cached=False)
            assert_same(out, ref)
            assert_same(out, cpu, nan_exact=True)


@pytest.mark.parametrize(
    "pair",
    [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
     (torch.bfloat16, torch.float32), (torch.int8, torch.int8), (torch.int64, torch.int64)],
    ids=_ids,
)  # fmt: skip
def test_short_run_kernel_mixed_rows(pair):
    """A table that averages short rows (the short-run kernel) and also holds one long run,
    rows of several contiguous runs (strides equal to the length), strided rows whose runs
    leave gaps, and empty rows: against the reference and the CPU op, bit for bit."""
    sdt, ddt = pair
    rng = np.random.default_rng(29)
    rows, dpos = [], 0

    def add(ln, ct, sstride, dstride):
        nonlocal dpos
        so = int(rng.integers(0, 50_000))
        rows.append((so, sstride, dpos, dstride, ln, ct))
        dpos += (ct - 1) * dstride + ln + int(rng.integers(0, 3))

    for _ in range(3000):
        add(int(rng.integers(1, 4)) * 32, 1, 0, 0)
    add(200_003, 1, 0, 0)
    for _ in range(60):
        add(48, 3, 48, 48)  # contiguous on both sides
        add(48, 4, 100, 60)  # strided: gaps on both sides
    rows += [(0, 0, dpos, 0, 0, 1), (0, 1, dpos, 1, 3, 0)]
    desc = np.array(rows, dtype=np.int64)[rng.permutation(len(rows))]
    per_row = (desc[:, 4] * desc[:, 5]).sum() * sdt.itemsize / len(desc)
    assert per_row <= 2048  # copy_runs.cu: kShortRowBytes
    src = random_values(rng, 50_000 + 4 * 100 + 200_003, sdt)
    out, cpu, ref = run_both(src, desc, ddt, dpos + 1, cached=False)
    assert_same(out, ref)
    assert_same(out, cpu, nan_exact=True)


@pytest.mark.parametrize("pair", FLOAT_PAIRS, ids=_ids)
def test_every_bit_pattern(pair):
    """All 65536 16-bit patterns and 4M random 32-bit patterns (NaN payloads, subnormals,
    ties) through each cast: CUDA == CPU op bit for bit, == torch's .to() except NaN bits."""
    sdt, ddt = pair
    if sdt == torch.float32:
        g = torch.Generator().manual_seed(3)
        raw = torch.randint(-(2**31), 2**31, (1 << 22,), generator=g, dtype=torch.int64)
        src = raw.to(torch.int32).view(torch.float32)
    else:
        src = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(sdt)
    n = src.numel()
    desc = np.array([[0, 0, 0, 0, n, 1]], dtype=np.int64)
    out, cpu, ref = run_both(src, desc, ddt, n)
    assert_same(out, ref)
    assert_same(out, cpu, nan_exact=True)


@pytest.mark.parametrize(
    "pair",
    [
        (torch.float32, torch.float32),
        (torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.float32),
    ],
    ids=_ids,
)
def test_huge_run(pair):
    sdt, ddt = pair
    n = (64 << 20) + 3
    src = torch.randn(n + 5, dtype=torch.float32).to(sdt)
    desc = np.array([[5, 0, 1, 0, n, 1]], dtype=np.int64)
    out, cpu, ref = run_both(src, desc, ddt, n + 2)
    assert_same(out, cpu, nan_exact=True)
    assert_same(out, ref)


def test_million_tiny_runs():
    rng = np.random.default_rng(11)
    m = 1_000_000
    lens = rng.integers(1, 4, m)
    dst_off = np.cumsum(lens + 1) - lens - 1
    src_off = rng.integers(0, 5_000_000, m)
    desc = np.stack(
        [
            src_off,
            np.zeros(m, np.int64),
            dst_off,
            np.zeros(m, np.int64),
            lens,
            np.ones(m, np.int64),
        ],
        1,
    )
    desc = desc[rng.permutation(m)]
    src = torch.randn(5_000_004)
    for cached in (True, False):
        out, _, ref = run_both(src, desc, torch.bfloat16, int((lens + 1).sum()) + 1, cached=cached)
        assert_same(out, ref)
    # one row, a million strided runs of one element
    desc = np.array([[0, 3, 1, 2, 1, m]], dtype=np.int64)
    out, _, ref = run_both(torch.randn(3 * m), desc, torch.float32, 2 * m + 1)
    assert_same(out, ref)


def test_empty_tables():
    src = torch.randn(10, device=DEV)
    dst = torch.full((4,), 7.0, device=DEV)
    ops.copy_runs(src, np.zeros((0, 6), np.int64), dst)
    ops.copy_runs(src, np.array([[0, 0, 0, 0, 0, 5], [3, 1, 2, 1, 4, 0]]), dst)
    ops.copy_runs(
        torch.empty(0, device=DEV), np.zeros((0, 6), np.int64), torch.empty(0, device=DEV)
    )
    assert torch.equal(dst.cpu(), torch.full((4,), 7.0))


BAD_ROWS = [
    ([0, 0, 0, 0, -1, 1], "negative"),
    ([0, -2, 0, 0, 1, 2], "negative"),
    ([8, 0, 0, 0, 4, 1], "row 1"),  # reads past src
    ([0, 0, 30, 0, 4, 1], "row 1"),  # writes past dst
    ([0, 1, 0, 1, 3, 2], "row 1"),  # overlapping writes within the row
    ([0, 0, 0, 0, 2, 1], "rows 0 and 1"),  # overlaps row 0
    ([0, 1 << 62, 0, 1, 1, 4], "row 1"),  # offset arithmetic overflows
]


@pytest.mark.parametrize("row,msg", BAD_ROWS)
def test_bad_rows_write_nothing(row, msg):
    src = torch.randn(10, device=DEV)
    dst = torch.full((32,), 7.0, device=DEV)
    desc = np.array([[0, 0, 0, 0, 1, 1], row], dtype=np.int64)
    with pytest.raises(RuntimeError, match=msg):
        ops.copy_runs(src, desc, dst)
    assert torch.equal(dst.cpu(), torch.full((32,), 7.0))


def test_bad_arguments():
    src = torch.randn(10, device=DEV)
    dst = torch.zeros(10, device=DEV)
    ok = torch.tensor([[0, 0, 0, 0, 4, 1]])
    op = torch.ops.reshard.copy_runs
    with pytest.raises(RuntimeError, match="desc must be a CPU tensor"):
        op(src, ok.to(DEV), dst)
    with pytest.raises(RuntimeError, match="src must be on dst's CUDA device"):
        op(src.cpu(), ok, dst)
    with pytest.raises(RuntimeError, match="int64"):
        op(src, ok.to(torch.int32), dst)
    with pytest.raises(RuntimeError, match="shape"):
        op(src, ok[:, :5], dst)
    with pytest.raises(RuntimeError, match="contiguous"):
        op(torch.randn(20, device=DEV)[::2], ok, dst)
    with pytest.raises(RuntimeError, match="1-D"):
        op(src.view(2, 5), ok, dst)
    with pytest.raises(RuntimeError, match="cannot copy"):
        op(src, ok, torch.zeros(10, dtype=torch.int32, device=DEV))
    with pytest.raises(RuntimeError, match="overlap"):
        buf = torch.randn(20, device=DEV)
        op(buf[:12], ok, buf[8:])


@pytest.mark.parametrize(
    "src_dev,desc_dev,dst_dev,named",
    [
        ("cpu", "cuda", "cpu", "desc must be a CPU tensor"),
        ("cuda", "cuda", "cuda", "desc must be a CPU tensor"),
        ("cuda", "cpu", "cpu", "dst must be a CUDA tensor when src is"),
        ("cpu", "cpu", "cuda", "src must be on dst's CUDA device"),
        ("meta", "cpu", "cuda", "src must be on dst's device"),
        ("cuda", "meta", "cuda", "desc must be a CPU tensor"),
    ],
)
def test_device_mixes_name_the_argument(src_dev, desc_dev, dst_dev, named):
    src = torch.arange(8.0, device=src_dev)
    dst = torch.full((8,), 7.0, device=dst_dev)
    desc = torch.tensor([[0, 1, 0, 1, 4, 1]], device=desc_dev)
    with pytest.raises(RuntimeError, match=named):
        torch.ops.reshard.copy_runs(src, desc, dst)
    assert torch.equal(dst.cpu(), torch.full((8,), 7.0))


def test_writes_bump_versions_and_refuse_leaves():
    src = torch.arange(8.0, device=DEV)
    desc = torch.tensor([[0, 1, 0, 1, 4, 1]])
    dst = torch.zeros(8, device=DEV)
    ops.copy_runs(src, desc, dst)
    assert dst._version == 1 and src._version == 0
    a = torch.ones(8, device=DEV, requires_grad=True)
    b = a * 2
    y = b.sin()  # saves b
    ops.copy_runs(src, desc, b)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    leaf = torch.full((8,), 7.0, device=DEV, requires_grad=True)
    with pytest.raises(RuntimeError, match="a leaf Variable that requires grad"):
        ops.copy_runs(src, desc, leaf)
    assert torch.equal(leaf.detach().cpu(), torch.full((8,), 7.0))


def test_freed_storage_refused():
    src = torch.arange(8.0, device=DEV)
    dst = torch.full((8,), 7.0, device=DEV)
    freed = torch.ones(8, device=DEV)
    freed.untyped_storage().resize_(0)  # what FSDP does to a resharded parameter
    desc = torch.tensor([[0, 1, 0, 1, 4, 1]])
    with pytest.raises(RuntimeError, match="src needs 32 bytes of storage but its storage holds 0"):
        ops.copy_runs(freed, desc, dst)
    assert torch.equal(dst.cpu(), torch.full((8,), 7.0))
    with pytest.raises(RuntimeError, match="dst needs 32 bytes"):
        ops.copy_runs(src, desc, freed)


def test_cached_table_follows_in_place_edits():
    """The device table is cached per desc tensor; an in-place edit (version bump) must
    invalidate it, and so must a new tensor at the same address."""
    src = torch.arange(100, dtype=torch.float32, device=DEV)
    dst = torch.zeros(100, device=DEV)
    desc = torch.tensor([[10, 0, 0, 0, 5, 1]])
    ops.copy_runs(src, desc, dst)
    assert dst[:5].tolist() == [10, 11, 12, 13, 14]
    desc[0, 0] = 50  # in place: bumps the version counter
    ops.copy_runs(src, desc, dst)
    assert dst[:5].tolist() == [50, 51, 52, 53, 54]
    desc[0, 4] = 1000  # now invalid: must be re-validated, not served from the cache
    with pytest.raises(RuntimeError, match="row 0"):
        ops.copy_runs(src, desc, dst)
    for k in range(20):  # fresh tensors, possibly at recycled addresses
        d = torch.tensor([[k, 0, 0, 0, 5, 1]])
        ops.copy_runs(src, d, dst)
        assert dst[:5].tolist() == [k, k + 1, k + 2, k + 3, k + 4]
        del d


def test_runs_on_the_current_stream():
    """Launched on a side stream behind a long kernel: a launch on the default stream would
    read src before the side stream wrote it."""
    n = 1 << 22
    src = torch.zeros(n, device=DEV)
    dst = torch.zeros(n, device=DEV)
    desc = torch.tensor([[0, 0, 0, 0, n, 1]])
    ops.copy_runs(src, desc, dst)  # warm the cache and the kernel
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time
        src.fill_(3.0)
        ops.copy_runs(src, desc, dst)
    side.synchronize()
    assert bool((dst == 3.0).all())


def _compact_table(rng, shape, v):
    """Tables of short runs for the compact form (reshard_cuda.h: rs_compact_choose): uniform
    runs of whole 16-byte groups (every piece full), mixed lengths (pieces with idle slots),
    odd lengths at odd offsets (element-wise groups), strided rows, and empty rows."""
    lens = {
        "uniform": [16 * v] * 3000,
        "mixed": rng.choice([v, 3 * v, 16 * v, 100, 257, 1000], 1500).tolist(),
        "odd": rng.integers(1, 41, 3000).tolist(),
        "strided": rng.choice([8 * v, 16 * v], 800).tolist(),
    }[shape]
    aligned = shape in ("uniform", "strided")
    return _short_run_table(rng, lens, 6 if shape == "strided" else 1, aligned, v)


@pytest.mark.parametrize("pair", PAIRS, ids=_ids)
@pytest.mark.parametrize("shape", ["uniform", "mixed", "odd", "strided"])
def test_compact_form(pair, shape):
    """Short-run tables copied from their compact form (first call: built and cached; second
    call: reused), aligned and misaligned buffers: against the reference and the CPU op, bit
    for bit, into poisoned outputs."""
    sdt, ddt = pair
    _, v = _tile_elems(sdt.itemsize, ddt.itemsize)
    rng = np.random.default_rng([len(shape), ord(shape[0]), sdt.itemsize, ddt.itemsize])
    desc, sn, dn = _compact_table(rng, shape, v)
    per_run = (desc[:, 4] * desc[:, 5]).sum() * sdt.itemsize / desc[:, 5][desc[:, 4] > 0].sum()
    assert per_run <= 65536  # reshard_cuda.h: RS_COMPACT_MAX_RUN_BYTES
    src = random_values(rng, sn, sdt)
    table = torch.from_numpy(desc)
    for offsets in [(0, 0), (1, 3), (0, 0)]:
        out, cpu, ref = run_both(src, table, ddt, dn, *offsets)
        assert_same(out, ref)
        assert_same(out, cpu, nan_exact=True)


def _poisoned_u8(numel, value=77):
    return torch.full((numel,), value, dtype=torch.uint8, device=DEV)


@pytest.mark.parametrize("side", ["src", "dst"])
def test_compact_offsets_near_2_pow_32(side):
    """Element indices around 2^31 and 2^32 on one side: a buffer of exactly 2^32 elements
    (32-bit descriptors, indices >= 2^31 must not turn negative) and one of 2^32 + 4096 (64-bit
    descriptors), runs crossing 2^31 and ending at or crossing 2^32. Reference: torch slices."""
    big = (1 << 32) + 4096
    gen = torch.Generator(device=DEV).manual_seed(5)
    rng = np.random.default_rng(41)
    common = [((1 << 31) - 16, 48), ((1 << 31) + 32, 32), ((1 << 32) - 64, 48), (4096, 64), (0, 16)]
    cases = [
        (1 << 32, [((1 << 32) - 16, 16)]),
        (big, [((1 << 32) - 8, 40), ((1 << 32) + 48, 32), (big - 16, 16)]),
    ]
    for numel, extra in cases:
        rows, pos = [], 8192
        for far, ln in common + extra:
            near = pos
            pos += ln + 16
            if side == "src":
                rows.append((far, 0, near, 0, ln, 1))
            else:
                rows.append((near, 0, far, 0, ln, 1))
        desc = torch.tensor(rows, dtype=torch.int64)[torch.from_numpy(rng.permutation(len(rows)))]
        if side == "src":
            src = torch.empty(numel, dtype=torch.uint8, device=DEV).random_(generator=gen)
            dst = _poisoned_u8(pos + 64)
        else:
            src = torch.empty(pos + 64, dtype=torch.uint8, device=DEV).random_(generator=gen)
            dst = _poisoned_u8(numel)
        expect = dst.clone()
        for so, _, do, _, ln, _ in desc.tolist():
            expect[do : do + ln] = src[so : so + ln]
        for _ in range(2):  # built, then reused
            ops.copy_runs(src, desc, dst)
            torch.cuda.synchronize()
            assert torch.equal(dst, expect)
            dst.fill_(77)
        del src, dst, expect
        torch.cuda.empty_cache()


def test_compact_tables_evicted_and_rebuilt():
    """A table's compact forms (one per element-size pair) after its cache entry was evicted
    by 1100 other tables, after an in-place edit, and for a desc outside the cache (an
    inference tensor): every call against the reference, into poisoned outputs."""
    rng = np.random.default_rng(53)
    desc_np, sn, dn = _short_run_table(rng, [64] * 500, 1, True, 8)
    desc = torch.from_numpy(desc_np.copy())
    src32 = random_values(rng, sn, torch.float32)
    src16 = random_values(rng, sn, torch.bfloat16)

    def check(d, src, ddt):
        dst = poison(dn, ddt, DEV)
        ops.copy_runs(src.to(DEV), d, dst)
        assert_same(dst, reference(src, d.numpy(), poison(dn, ddt, "cpu")))

    src32_dev = src32.to(DEV)
    for _ in range(2):
        check(desc, src32, torch.float32)
        check(desc, src32, torch.bfloat16)
        check(desc, src16, torch.float32)
        for k in range(1100):  # more tables than the cache holds (ops.cpp: kCacheEntries)
            other = torch.tensor([[k, 0, 0, 0, 16, 1], [k + 100, 1, 16, 1, 1, 1]])
            dst = poison(17, torch.float32, DEV)
            ops.copy_runs(src32_dev, other, dst)
            assert dst.cpu().tolist() == src32[k : k + 16].tolist() + [src32[k + 100].item()]
    desc[:, 0] = torch.from_numpy(rng.permutation(desc_np[:, 0]))  # in place: a new entry
    check(desc, src32, torch.float32)
    with torch.inference_mode():
        frozen = desc.clone()
    check(frozen, src32, torch.float32)


def test_opcheck():
    rng = np.random.default_rng(5)
    for sdt, ddt in [
        (torch.float32, torch.bfloat16),
        (torch.float16, torch.float16),
        (torch.int64, torch.int64),
    ]:
        desc, sn, dn = random_table(rng, 20, 30, 3)
        src = random_values(rng, sn, sdt).to(DEV)
        dst = poison(dn, ddt, DEV)
        torch.library.opcheck(torch.ops.reshard.copy_runs, (src, torch.from_numpy(desc), dst))


def test_torch_compile_fullgraph():
    rng = np.random.default_rng(9)
    desc_np, sn, dn = random_table(rng, 40, 50, 3)
    desc = torch.from_numpy(desc_np)
    src = torch.randn(sn, device=DEV)

    @torch.compile(fullgraph=True)
    def f(src, desc, dst):
        torch.ops.reshard.copy_runs(src * 2, desc, dst)
        return dst + 1

    dst = poison(dn, torch.bfloat16, DEV)
    out = f(src, desc, dst)
    ref = reference((src * 2).cpu(), desc_np, poison(dn, torch.bfloat16, "cpu"))
    assert_same(dst, ref)
    assert_same(out, (ref.to(DEV) + 1))
