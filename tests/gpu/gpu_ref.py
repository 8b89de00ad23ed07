"""Helpers for the GPU tests: random descriptor tables and an independent reference.

The reference expands a table into element index arrays with numpy and copies with torch
indexing + `Tensor.to` on the CPU: it shares no code with the C core or the CUDA kernels.
"""

from __future__ import annotations

import numpy as np
import torch

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
FLOAT_PAIRS = [(a, b) for a in FLOATS for b in FLOATS]
RAW = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float64, torch.bool)


def require_cuda_build() -> None:
    """Fail the importing test module (not skip it) where a GPU is visible but the extension has
    no CUDA ops: a CPU-only build on a GPU machine is a broken setup."""
    import pytest

    from reshard import _ops

    if torch.cuda.is_available() and not _ops.built_with_cuda():
        pytest.fail(
            "a GPU is visible but reshard was built without CUDA: rebuild with CUDA_HOME set",
            pytrace=False,
        )


class StageCalls:
    """Context manager recording what every stage_h2d / stage_d2h call made under it on this
    thread did (the stats each op returns), through a dispatch mode: for calls made inside
    reshard (a Transfer), whose return values the test does not see."""

    def __init__(self):
        self.stats = []

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        from reshard import _ops

        stats = self.stats
        stage_ops = (torch.ops.reshard.stage_h2d.default, torch.ops.reshard.stage_d2h.default)

        class Record(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if func in stage_ops:
                    stats.append(_ops.StageStats(*out.tolist()))
                return out

        self._mode = Record()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)


def expand(desc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(src_index, dst_index) of every element a table copies, in work order."""
    d = np.asarray(desc, dtype=np.int64).reshape(-1, 6)
    so, ss, do, ds, ln, ct = (d[:, i] for i in range(6))
    ct = np.where(ln > 0, ct, 0)
    row = np.repeat(np.arange(len(d)), ct)
    first = np.repeat(np.cumsum(ct) - ct, ct)
    c = np.arange(len(row)) - first
    run_len = ln[row]
    run_src = so[row] + c * ss[row]
    run_dst = do[row] + c * ds[row]
    run = np.repeat(np.arange(len(row)), run_len)
    j = np.arange(len(run)) - np.repeat(np.cumsum(run_len) - run_len, run_len)
    return run_src[run] + j, run_dst[run] + j


def reference(src: torch.Tensor, desc: np.ndarray, dst: torch.Tensor) -> torch.Tensor:
    """What dst must hold after the copy (computed on the CPU from dst's current contents)."""
    out = dst.detach().cpu().clone()
    si, di = expand(desc)
    if len(si):
        out[torch.from_numpy(di)] = src.detach().cpu()[torch.from_numpy(si)].to(out.dtype)
    return out


def random_table(
    rng: np.random.Generator, n: int, max_len: int, max_count: int = 3, shuffle: bool = True
) -> tuple[np.ndarray, int, int]:
    """A table of n rows with disjoint writes (random gaps, strides >= length, zero-length
    and zero-count rows included) and reads anywhere (overlapping reads allowed).
    Returns (desc, src_numel, dst_numel)."""
    rows = []
    dpos = int(rng.integers(0, 9))
    src_need = 1
    for _ in range(n):
        ln = int(rng.integers(0, max_len + 1)) if rng.random() < 0.95 else 0
        ct = int(rng.integers(1, max_count + 1)) if rng.random() < 0.95 else 0
        ds = ln + int(rng.integers(0, 5))
        ss = int(rng.integers(0, ln + 9))
        so = int(rng.integers(0, 2 * max_len + 64))
        rows.append((so, ss, dpos, ds, ln, ct))
        if ct > 0 and ln > 0:
            dpos += (ct - 1) * ds + ln
            src_need = max(src_need, so + (ct - 1) * ss + ln)
        dpos += int(rng.integers(0, 7))
    desc = np.array(rows, dtype=np.int64).reshape(-1, 6)
    if shuffle:
        desc = desc[rng.permutation(len(desc))]
    return desc, src_need + int(rng.integers(0, 5)), dpos + 1


def random_values(rng: np.random.Generator, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Random data of dtype on the CPU, with special values for floats."""
    if dtype == torch.bool:
        return torch.from_numpy(rng.integers(0, 2, numel).astype(np.bool_))
    if dtype.is_floating_point:
        x = torch.from_numpy(rng.standard_normal(numel).astype(np.float32) * 100).to(dtype)
        if numel >= 8:
            specials = torch.tensor(
                [float("inf"), -float("inf"), 0.0, -0.0, 1e-40, 65504.0, 70000.0, 3.0e38],
                dtype=torch.float32,
            ).to(dtype)
            idx = torch.from_numpy(rng.integers(0, numel, len(specials)))
            x[idx] = specials
        return x
    info = torch.iinfo(dtype)
    return torch.from_numpy(
        rng.integers(info.min, info.max, numel, endpoint=True, dtype=np.int64)
    ).to(dtype)


def poison(numel: int, dtype: torch.dtype, device) -> torch.Tensor:
    """A destination filled with a value no copy writes in these tests."""
    if dtype == torch.bool:
        return torch.ones(numel, dtype=dtype, device=device)
    if dtype.is_floating_point:
        return torch.full((numel,), -1234.5, dtype=dtype, device=device)
    return torch.full((numel,), -77 if dtype != torch.uint8 else 77, dtype=dtype, device=device)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit patterns (as a same-size integer tensor) on the CPU."""
    t = t.detach().cpu()
    size = t.element_size()
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
    return t.view(view) if t.dtype != torch.bool else t.to(torch.uint8)


def assert_same(out: torch.Tensor, ref: torch.Tensor, nan_exact: bool = False) -> None:
    """Bitwise equality; NaN positions must match, and with nan_exact their bits too."""
    out = out.detach().cpu()
    ref = ref.detach().cpu()
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if out.dtype.is_floating_point and not nan_exact:
        on, rn = torch.isnan(out), torch.isnan(ref)
        assert torch.equal(on, rn), f"NaN at different places ({int((on != rn).sum())})"
        keep = ~on
        ob, rb = bits(out)[keep], bits(ref)[keep]
    else:
        ob, rb = bits(out), bits(ref)
    bad = (ob != rb).nonzero().flatten()
    assert len(bad) == 0, f"{len(bad)} elements differ, first at {bad[:5].tolist()}"
