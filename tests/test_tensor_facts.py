"""`reshard::tensor_facts` (what preflight's per-call key reads, one op call per side): every
column equals what Python reads of the same tensor, for tensors of every kind preflight meets
and after every in-place change of a tensor object that moves, retypes, reshapes, frees or
regrows what it points at; `facts_key` tells two lists apart exactly when a fact differs."""

from __future__ import annotations

import pytest
import torch

from reshard import _ops

DTYPES = (
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
)


def _facts(tensors) -> list[list[int]]:
    out = torch.ops.reshard.tensor_facts(list(tensors))
    assert out.dtype == torch.int64 and out.device.type == "cpu"
    assert tuple(out.shape) == (len(tensors), len(_ops.FACT_COLUMNS))
    return out.tolist()


def _enum(column: int, value) -> int:
    """The op's code for a dtype (column 3) or device type (column 4): read from a tensor of
    nothing but that dtype / device."""
    if column == 3:
        t = torch.empty(0, dtype=value)
    else:
        t = torch.empty(0, device=value)
    return _facts([t])[0][column]


def _python_facts(t: torch.Tensor) -> list[int]:
    st = t.untyped_storage()
    return [
        t.data_ptr(),
        st.data_ptr(),
        st.nbytes(),
        _enum(3, t.dtype),
        _enum(4, t.device.type),
        t.get_device(),
        t.dim(),
        t.numel(),
        int(t.is_contiguous()),
        int(t.requires_grad),
        int(t.is_inference()),
        int(t.is_conj()) | int(t.is_neg()) << 1,
    ]


def _check(t: torch.Tensor) -> list[int]:
    (row,) = _facts([t])
    assert dict(zip(_ops.FACT_COLUMNS, row, strict=True)) == dict(
        zip(_ops.FACT_COLUMNS, _python_facts(t), strict=True)
    )
    return row


def test_dtype_and_device_codes_tell_every_kind_apart():
    codes = [_enum(3, d) for d in DTYPES]
    assert len(set(codes)) == len(DTYPES)
    devices = ["cpu", "meta"] + (["cuda"] if torch.cuda.is_available() else [])
    assert len({_enum(4, d) for d in devices}) == len(devices)


def _kinds():
    base = torch.arange(20.0)
    with torch.inference_mode():
        inference = torch.ones(5)
    out = {
        "plain": base,
        "offset view": base[3:],
        "empty view": base[3:3],
        "empty": torch.empty(0),
        "2-D": base.view(4, 5),
        "transposed": base.view(4, 5).t(),
        "strided 1-D": base[::2],
        "parameter": torch.nn.Parameter(torch.ones(3)),
        "requires grad": torch.ones(3, requires_grad=True),
        "inference": inference,
        "meta": torch.empty(3, device="meta"),
        "scalar": torch.tensor(1.5),
        "conjugated view": torch.arange(4.0).to(torch.complex64).conj(),
        "negated view": torch._neg_view(base),
    }
    for d in DTYPES:
        out[str(d)] = torch.zeros(7, dtype=d)
    if torch.cuda.is_available():
        out["cuda"] = torch.arange(9.0, device="cuda")[2:]
    return out


def test_every_column_is_what_python_reads():
    kinds = _kinds()
    rows = _facts(kinds.values())
    for (name, t), row in zip(kinds.items(), rows, strict=True):
        assert row == _check(t), name  # one call over all equals one call per tensor


def _changes():
    """(name, in-place change of the tensor object `t`) pairs; each changes some fact."""

    def set_other(t):
        t.set_(torch.arange(30.0).untyped_storage(), 4, (6,))

    def shrink(t):
        t.resize_(3)

    def grow(t):
        t.resize_(1000)

    def free(t):
        t.untyped_storage().resize_(0)

    def regrow_smaller(t):
        st = t.untyped_storage()
        st.resize_(0)
        st.resize_(4 * t.numel() - 4)

    def retype(t):
        t.data = t.view(torch.int32)

    def move(t):
        t.data = torch.arange(12.0)[1:7]

    def strided(t):
        t.as_strided_((3,), (2,))

    def unsqueeze(t):
        t.unsqueeze_(0)

    def requires_grad(t):
        t.requires_grad_()

    def negated(t):
        torch._C._set_neg(t, True)

    return [
        ("set_", set_other),
        ("resize_ smaller", shrink),
        ("resize_ larger", grow),
        ("storage freed", free),
        ("storage regrown smaller", regrow_smaller),
        (".data = int32 view", retype),
        (".data = elsewhere", move),
        ("as_strided_", strided),
        ("unsqueeze_", unsqueeze),
        ("requires_grad_", requires_grad),
        ("negation bit", negated),
    ]


@pytest.mark.parametrize("name,change", _changes(), ids=[n for n, _ in _changes()])
def test_in_place_changes_are_read_and_change_the_key(name, change):
    t = torch.arange(6.0)
    others = [torch.ones(4), t, torch.zeros(2)]
    before_row = _check(t)
    before_key = _ops.facts_key(others)
    change(t)
    after_row = _check(t)
    assert after_row != before_row, name
    assert _ops.facts_key(others) != before_key, name


def test_facts_key_equal_for_the_same_facts_only():
    a, b = torch.arange(5.0), torch.arange(5.0)
    assert _ops.facts_key([a, b]) == _ops.facts_key([a, b])
    assert _ops.facts_key([a, b]) != _ops.facts_key([b, a])  # order is part of it
    assert _ops.facts_key([a]) != _ops.facts_key([a.view(1, 5)])
    p = torch.nn.Parameter(a.clone())
    assert _ops.facts_key([p]) is not None


class _Sub(torch.Tensor):
    pass


def test_what_the_op_does_not_read_gives_no_key():
    t = torch.arange(4.0)
    assert _ops.facts_key([t, torch.Tensor._make_subclass(_Sub, t)]) is None
    assert _ops.facts_key([t, None]) is None
    assert _ops.facts_key([t, t.to_sparse()]) is None
    with pytest.raises(RuntimeError, match="must be strided and have a storage"):
        torch.ops.reshard.tensor_facts([t.to_sparse()])
    assert _facts([]) == []
