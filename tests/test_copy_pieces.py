"""reshard::copy_pieces (pieces of many CPU sources into one destination) against an independent
reference, and its refusals: every bad argument is refused, naming it, before any write.

Reference: each source converted once by torch's contiguous `.to()`, pieces placed by plain
slicing; destinations poisoned with a byte pattern no copy writes.
"""

import numpy as np
import pytest
import torch

from reshard import _ops

OP = torch.ops.reshard.copy_pieces.default
FLOATS = [torch.float32, torch.bfloat16, torch.float16]
POISON = 0x5B


def bits(t):
    return t.contiguous().view(torch.uint8).numpy().copy()


def poisoned(numel, dtype):
    t = torch.empty(numel, dtype=dtype)
    t.view(torch.uint8).fill_(POISON)
    return t


def random_bits(numel, dtype, gen):
    """Random bit patterns (floats include NaN payloads, infs, subnormals)."""
    isz = torch.empty(0, dtype=dtype).element_size()
    raw = torch.from_numpy(gen.integers(0, 256, size=numel * isz, dtype=np.uint8))
    return raw.view(dtype).clone()


def random_pieces(gen, sizes, dst_numel, k):
    """Up to k rows (source, src_offset, dst_offset, length) over `sizes`, destination ranges
    disjoint and in a random order; some rows empty."""
    cuts = np.sort(gen.choice(dst_numel + 1, size=2 * k, replace=True))
    rows = []
    for a, b in zip(cuts[::2], cuts[1::2]):
        idx = int(gen.integers(len(sizes)))
        n = int(min(b - a, sizes[idx]))
        so = int(gen.integers(0, sizes[idx] - n + 1))
        rows.append((idx, so, int(a), n))
    gen.shuffle(rows)
    return np.array(rows, dtype=np.int64).reshape(-1, 4)


def reference(srcs, rows, dst_numel, ddt):
    want = poisoned(dst_numel, ddt)
    converted = [s.to(ddt) for s in srcs]
    for idx, so, do, n in rows.tolist():
        want[do : do + n] = converted[idx][so : so + n]
    return want


@pytest.mark.parametrize("ddt", FLOATS, ids=str)
@pytest.mark.parametrize("sdt", FLOATS, ids=str)
def test_random_pieces_match_reference(sdt, ddt):
    gen = np.random.default_rng(11)
    for trial in range(40):
        sizes = [int(x) for x in gen.integers(1, 300, size=int(gen.integers(1, 6)))]
        srcs = [random_bits(n, sdt, gen) for n in sizes]
        dn = int(gen.integers(1, 600))
        rows = random_pieces(gen, sizes, dn, int(gen.integers(1, 8)))
        dst = poisoned(dn, ddt)
        OP(srcs, torch.from_numpy(rows), dst)
        want = reference(srcs, rows, dn, ddt)
        np.testing.assert_array_equal(bits(dst), bits(want), err_msg=f"trial {trial}")


def test_same_dtype_raw_pieces():
    gen = np.random.default_rng(2)
    srcs = [torch.from_numpy(gen.integers(-(2**62), 2**62, size=n)) for n in (50, 7, 300)]
    rows = np.array([[2, 10, 0, 200], [1, 0, 205, 7], [0, 49, 220, 1]], dtype=np.int64)
    dst = poisoned(230, torch.int64)
    OP(srcs, torch.from_numpy(rows), dst)
    np.testing.assert_array_equal(bits(dst), bits(reference(srcs, rows, 230, torch.int64)))


def test_pieces_spread_over_threads():
    """Millions of elements over dozens of sources: slices cut across rows on every thread."""
    torch.manual_seed(0)
    gen = np.random.default_rng(4)
    sizes = [int(x) for x in gen.integers(1, 200_000, size=40)]
    srcs = [torch.randn(n) for n in sizes]
    rows, at = [], 0
    for i in gen.permutation(len(sizes)).tolist():
        rows.append((i, 0, at, sizes[i]))
        at += sizes[i] + int(gen.integers(0, 9))
    rows = np.array(rows, dtype=np.int64)
    dst = poisoned(at, torch.bfloat16)
    _ops.copy_pieces(srcs, rows, dst)
    np.testing.assert_array_equal(bits(dst), bits(reference(srcs, rows, at, torch.bfloat16)))


def test_no_rows_and_empty_rows_write_nothing():
    dst = poisoned(8, torch.float32)
    OP([], torch.zeros((0, 4), dtype=torch.int64), dst)
    OP([torch.ones(3)], torch.tensor([[0, 3, 8, 0], [0, 0, 0, 0]]), dst)
    assert (bits(dst) == POISON).all()


def test_wrapper_takes_only_k_by_4_tables():
    """The Python entry point widens integer tables but never reshapes one: a flat or [k, 8]
    table is a mistake, not rows to guess."""
    srcs, pieces = good()
    for bad in (pieces.flatten(), pieces.reshape(1, 8), pieces.flatten().tolist()):
        dst = poisoned(20, torch.float32)
        with pytest.raises(ValueError, match=r"pieces must have shape \[n, 4\]"):
            _ops.copy_pieces(srcs, bad, dst)
        assert (bits(dst) == POISON).all()
    dst = poisoned(20, torch.float32)
    with pytest.raises(ValueError, match="pieces holds a value outside int64"):
        _ops.copy_pieces(srcs, [[0, 0, 0, 2**70]], dst)
    _ops.copy_pieces(srcs, pieces.int(), dst)  # int32 widened, as numpy int32 is
    _ops.copy_pieces(srcs, [], poisoned(20, torch.float32))
    assert torch.equal(dst[:10], srcs[0]) and torch.equal(dst[12:17], srcs[1])


# ------------------------------------------------------------------ refusals


def refused(args, fragment):
    srcs, pieces, dst = args
    before = bits(dst)
    with pytest.raises(RuntimeError, match=fragment):
        OP(srcs, pieces, dst)
    np.testing.assert_array_equal(bits(dst), before)


def good():
    return [torch.arange(10.0), torch.arange(5.0)], torch.tensor([[0, 0, 0, 10], [1, 0, 12, 5]])


@pytest.mark.parametrize(
    "row, fragment",
    [
        ([2, 0, 0, 1], r"row 1: source index 2 is out of range for 2 sources"),
        ([-1, 0, 0, 1], r"row 1: source index -1 is out of range"),
        ([1, -1, 0, 1], r"row 1: offsets and length must be >= 0"),
        ([1, 0, 0, -1], r"row 1: offsets and length must be >= 0"),
        ([1, 1, 12, 5], r"row 1: elements \[1, 1 \+ 5\) are past the end of srcs\[1\] \(5 "),
        ([1, 0, 16, 5], r"row 1: elements \[16, 16 \+ 5\) are past the end of dst \(20 "),
        ([1, 0, 2**63 - 2, 5], r"row 1: elements \[9223372036854775806, .* past the end of dst"),
        ([1, 0, 9, 2], r"rows 0 and 1 write overlapping elements of dst"),
    ],
)
def test_bad_row_refused_before_any_write(row, fragment):
    srcs, pieces = good()
    pieces[1] = torch.tensor(row)
    refused((srcs, pieces, torch.full((20,), -7.0)), fragment)


@pytest.mark.parametrize(
    "case, fragment",
    [
        ("pieces_dtype", r"pieces must be int64, got Int"),
        ("pieces_shape", r"pieces must have shape \[k, 4\]"),
        ("mixed_dtypes", r"every source must have one dtype: srcs\[0\] is Float, srcs\[1\] is"),
        ("int_to_float", r"cannot copy Int to Float"),
        ("src_2d", r"srcs\[1\] must be 1-D"),
        ("src_strided", r"srcs\[0\] must be contiguous"),
        ("dst_strided", r"dst must be contiguous"),
        ("src_alias", r"srcs\[1\] and dst overlap in memory"),
        ("pieces_alias", r"pieces and dst overlap in memory"),
        ("src_freed", r"srcs\[1\] needs 20 bytes of storage but its storage holds 0"),
        ("sixteen_bytes", r"unsupported dtype"),
        ("meta_src", r"srcs\[0\] must be a CPU tensor, got a tensor on meta"),
    ],
)
def test_bad_arguments_refused_before_any_write(case, fragment):
    srcs, pieces = good()
    dst = torch.full((20,), -7.0)
    if case == "pieces_dtype":
        pieces = pieces.int()
    elif case == "pieces_shape":
        pieces = pieces[:, :3].contiguous()
    elif case == "mixed_dtypes":
        srcs[1] = srcs[1].double()
    elif case == "int_to_float":
        srcs = [s.int() for s in srcs]
    elif case == "src_2d":
        srcs[1] = srcs[1].view(5, 1)
    elif case == "src_strided":
        srcs[0] = torch.arange(20.0)[::2]
    elif case == "dst_strided":
        big = torch.full((40,), -7.0)
        dst = big[::2]
    elif case == "src_alias":
        big = torch.full((40,), -7.0)
        dst, srcs[1] = big[:20], big[15:20]
    elif case == "pieces_alias":
        store = torch.zeros(16, dtype=torch.int64)
        store[:8] = pieces.reshape(-1)
        pieces, dst = store[:8].view(2, 4), store[2:].view(torch.float32)
    elif case == "src_freed":
        srcs[1].untyped_storage().resize_(0)
    elif case == "sixteen_bytes":
        srcs = [s.to(torch.complex128) for s in srcs]
        dst = torch.zeros(20, dtype=torch.complex128)
    elif case == "meta_src":
        srcs[0] = srcs[0].to("meta")
    refused((srcs, pieces, dst), fragment)


def test_cuda_arguments_are_named():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    srcs, pieces = good()
    srcs[1] = srcs[1].cuda()
    refused((srcs, pieces, torch.full((20,), -7.0)), r"srcs\[1\] must be a CPU tensor")


# ------------------------------------------------------------------ torch integration


def test_opcheck():
    gen = np.random.default_rng(8)
    for sdt, ddt in [(torch.float32, torch.bfloat16), (torch.float16, torch.float32)]:
        srcs = [torch.randn(int(n)).to(sdt) for n in gen.integers(1, 60, size=3)]
        rows = random_pieces(gen, [s.numel() for s in srcs], 100, 4)
        torch.library.opcheck(OP, (srcs, torch.from_numpy(rows), torch.zeros(100, dtype=ddt)))


def test_writes_are_in_place_writes_to_autograd():
    src = torch.randn(6, requires_grad=True)
    dst = torch.zeros(8)
    version = dst._version
    with torch.no_grad():
        OP([src], torch.tensor([[0, 0, 1, 6]]), dst)
    assert dst._version == version + 1
    dst2 = torch.zeros(8)
    OP([src], torch.tensor([[0, 0, 1, 6]]), dst2)
    assert dst2.requires_grad
    with pytest.raises(RuntimeError, match="copy_pieces"):
        dst2.sum().backward()


def test_torch_compile_fullgraph():
    def pack(a, b, pieces, dst):
        torch.ops.reshard.copy_pieces([a * 2, b], pieces, dst)
        return dst + 1

    compiled = torch.compile(pack, fullgraph=True, backend="inductor")
    pieces = torch.tensor([[0, 1, 0, 4], [1, 0, 6, 3]])
    for _ in range(2):
        a, b = torch.randn(6), torch.randn(3)
        x, y = torch.zeros(10), torch.zeros(10)
        np.testing.assert_array_equal(
            compiled(a, b, pieces, x).numpy(), pack(a, b, pieces, y).numpy()
        )
        np.testing.assert_array_equal(x.numpy(), y.numpy())
