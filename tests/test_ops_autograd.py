"""The ops' writes are in-place writes to autograd, as torch's own in-place ops are.

Each case is checked against what torch itself does for `Tensor.copy_` in the same graph (the
reference), and the destination's contents are checked: a refused call writes nothing.
"""

import pytest
import torch

import reshard

DESC = torch.tensor([[0, 1, 0, 1, 4, 1]])  # dst[0:4] = src[0:4]
OPS = {
    "reshard": lambda src, dst: torch.ops.reshard.copy_runs(src, DESC, dst),
    "torch": lambda src, dst: dst[:4].copy_(src[:4]),
}


def test_version_counter_of_dst_bumped_once_per_call():
    src, dst = torch.arange(4.0), torch.zeros(4)
    versions = (src._version, DESC._version, dst._version)
    reshard.copy_runs(src, DESC, dst)
    assert (src._version, DESC._version, dst._version) == (
        versions[0],
        versions[1],
        versions[2] + 1,
    )
    torch.ops.reshard.copy_runs(src, DESC, dst)
    assert dst._version == versions[2] + 2
    assert dst.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_view_shares_the_bump():
    base = torch.zeros(8)
    view = base[4:]
    reshard.copy_runs(torch.arange(4.0), DESC, view)
    assert base._version == view._version == 1
    assert base.tolist() == [0.0] * 4 + [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("impl", OPS)
@pytest.mark.parametrize("saved", ["input", "output"])
def test_overwriting_a_tensor_saved_for_backward_makes_backward_raise(impl, saved):
    a = torch.linspace(0.1, 0.4, 4, requires_grad=True)
    if saved == "input":
        b = a * 2
        y = b.sin()  # sin saves its input b
        target = b
    else:
        b = a.exp()  # exp saves its output b
        y = b
        target = b.detach()  # shares the version counter with b, so the write is seen
    OPS[impl](torch.arange(4.0), target)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.parametrize("impl", OPS)
@pytest.mark.parametrize("where", ["leaf", "view of a leaf"])
def test_writing_a_leaf_that_requires_grad_is_refused(impl, where):
    w = torch.full((6,), 7.0, requires_grad=True)
    target = w if where == "leaf" else w[2:]
    with pytest.raises(RuntimeError, match=f"a {where} Variable that requires grad"):
        OPS[impl](torch.arange(4.0), target)
    assert w.tolist() == [7.0] * 6 and w._version == 0  # nothing written


@pytest.mark.parametrize("impl", OPS)
def test_leaf_under_no_grad_is_written(impl):
    w = torch.full((4,), 7.0, requires_grad=True)
    with torch.no_grad():
        OPS[impl](torch.arange(4.0), w)
    assert w.tolist() == [0.0, 1.0, 2.0, 3.0] and w._version == 1
    assert w.is_leaf and w.requires_grad and w.grad_fn is None


def test_backward_through_overwritten_values_raises_not_a_stale_gradient():
    """b = 2a, then b is overwritten: a gradient from b's old history would be silently wrong
    (torch's copy_ reroutes it; reshard has no derivative, so backward must raise)."""
    a = torch.ones(4, requires_grad=True)
    b = a * 2
    reshard.copy_runs(torch.arange(4.0), DESC, b)
    assert b.tolist() == [0.0, 1.0, 2.0, 3.0]
    with pytest.raises(RuntimeError, match="derivative for reshard::copy_runs is not implemented"):
        (b * 3).sum().backward()
    assert a.grad is None


def test_source_that_requires_grad_gives_no_silent_gradient():
    src = torch.arange(4.0, requires_grad=True)
    dst = torch.zeros(4)
    reshard.copy_runs(src, DESC, dst)
    assert dst.requires_grad  # as torch's copy_ would make it
    with pytest.raises(RuntimeError, match="derivative for reshard::copy_runs is not implemented"):
        dst.sum().backward()
    with torch.no_grad():
        out = torch.zeros(4)
        reshard.copy_runs(src, DESC, out)
    assert not out.requires_grad and out.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_no_autograd_state_changes_without_grad():
    dst = torch.zeros(4)
    reshard.copy_runs(torch.arange(4.0), DESC, dst)
    assert not dst.requires_grad and dst.grad_fn is None


def test_inference_tensor_written_only_in_inference_mode():
    with torch.inference_mode():
        dst = torch.full((4,), 7.0)
    with pytest.raises(RuntimeError, match="inference tensor"):
        reshard.copy_runs(torch.arange(4.0), DESC, dst)
    assert dst.tolist() == [7.0] * 4
    with pytest.raises(RuntimeError, match="inference tensor"):
        dst.copy_(torch.arange(4.0))  # torch's rule
    with torch.inference_mode():
        reshard.copy_runs(torch.arange(4.0), DESC, dst)
    assert dst.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_opcheck_with_a_source_that_requires_grad():
    src = torch.randn(8, requires_grad=True)
    desc = torch.tensor([[0, 2, 1, 3, 2, 2]])
    torch.library.opcheck(torch.ops.reshard.copy_runs.default, (src, desc, torch.zeros(8)))


def test_torch_compile_fullgraph_bumps_and_writes():
    def write(src, desc, dst):
        torch.ops.reshard.copy_runs(src + 1, desc, dst)
        return dst * 2

    compiled = torch.compile(write, fullgraph=True, backend="inductor")
    dst = torch.zeros(4)
    out = compiled(torch.arange(4.0), DESC, dst)
    assert dst.tolist() == [1.0, 2.0, 3.0, 4.0] and out.tolist() == [2.0, 4.0, 6.0, 8.0]
    assert dst._version >= 1
