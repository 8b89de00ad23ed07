"""reshard.integrations.deepspeed against real DeepSpeed engines on spawned gloo ranks.

DS_ACCELERATOR=cpu. Every configuration runs a real engine (torch AdamW, bf16, ZeRO 1/2/3,
optimizer offload none/cpu, dp 2 and 3); references are DeepSpeed's own
safe_get_full_fp32_param / safe_get_full_optimizer_state / GatheredParameters. Many
configurations share one spawn so the suite stays within a few minutes on 2 cores.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/_spawn.py
sys.path.insert(0, str(Path(__file__).resolve().parent))  # _dsutil.py

from _spawn import run_ranks

pytest.importorskip("deepspeed")

ENV = {"DS_ACCELERATOR": "cpu", "RESHARD_TEST_THREADS": "1"}
MODELS = ("mlp", "block")
MOMENTS = ("exp_avg", "exp_avg_sq")
KINDS = ("param", "fp32", "exp_avg", "exp_avg_sq")


# --------------------------------------------------------------------------------- workers


def _owned_views(engine, kind):
    """DeepSpeed's own per-param tensors of `kind` on this rank (views into its storage)."""
    from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_optimizer_state

    stage = engine.zero_optimization_stage()
    out = []
    for name, p in engine.module.named_parameters():
        if kind == "param":
            out.append((name, p.ds_tensor if stage == 3 else p.data))
        elif not p.requires_grad:
            continue
        elif stage == 3:
            t = (
                safe_get_local_fp32_param(p)
                if kind == "fp32"
                else safe_get_local_optimizer_state(p, kind)
            )
            out.append((name, t))
        elif p._hp_mapping is not None:
            out.append((name, p._hp_mapping.get_hp_fragment(None if kind == "fp32" else kind)))
    return out


def _check_views_inside(engine, live, kind):
    spans = [
        (b.untyped_storage().data_ptr(), b.data_ptr(), b.data_ptr() + b.numel() * b.element_size())
        for b in live.buffers.values()
    ]
    for name, t in _owned_views(engine, kind):
        if t.numel() == 0:
            continue
        lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        assert any(
            t.untyped_storage().data_ptr() == s and b0 <= lo and hi <= b1 for s, b0, b1 in spans
        ), f"{kind} {name}: DeepSpeed's tensor is not inside any described buffer"


def _check_padding(engine, live, kind, me):
    """Storage elements the layout references on this rank are exactly the non-padding ones."""
    import torch

    stage = engine.zero_optimization_stage()
    world = len(live.dp_ranks)
    refs = {}
    for tl in live.layout.tensors.values():
        for pc in tl.pieces:
            if live.layout.storages[pc.location].rank != me:
                continue
            idx = torch.full(pc.shape, pc.offset, dtype=torch.int64)
            for k, (n, st) in enumerate(zip(pc.shape, pc.strides, strict=True)):
                view = [1] * len(pc.shape)
                view[k] = n
                idx = idx + (torch.arange(n) * st).view(view)
            refs.setdefault(pc.location, []).append(idx.view(-1))
    opt = engine.optimizer
    r = live.dp_ranks.index(me) if me in live.dp_ranks else None
    for u in range(len(opt.bit16_groups if stage <= 2 else opt.fp16_groups)):
        loc = u * world + r
        idx = torch.cat(refs.get(loc, [torch.zeros(0, dtype=torch.int64)]))
        numel = live.buffers[loc].numel()
        if kind == "param" and stage <= 2:
            # full replica of the flat; DeepSpeed's padding is the flat's tail
            expected = sum(p.numel() for p in opt.bit16_groups[u])
            counts = torch.bincount(idx, minlength=numel)
        elif stage <= 2:
            expected = opt.partition_size[u] - opt.groups_padding[u]  # DeepSpeed's own padding
            counts = torch.bincount(idx, minlength=numel)
        else:
            expected = 0
            for p in opt.fp16_groups[u]:
                pn = p.partition_numel()
                expected += max(0, min(pn, p.ds_numel - r * pn))
            counts = torch.bincount(idx, minlength=numel)
        if kind != "param" or stage == 3:
            # a partition storage: every element referenced at most once
            assert counts.numel() == 0 or int(counts.max()) <= 1, (
                f"{kind} unit {u}: element referenced twice"
            )
        assert int((counts > 0).sum()) == expected, (
            f"{kind} unit {u} rank {r}: {int((counts > 0).sum())} elements referenced, "
            f"{expected} are not padding"
        )


def _geometry_worker(rank, world, configs):
    import torch.distributed as dist
    from _dsutil import (
        assemble,
        assert_bitwise,
        ds_env,
        make_engine,
        reference,
        train,
    )

    ds_env(rank, world)
    from reshard.errors import NotReadyError
    from reshard.integrations import deepspeed as rsds

    done = []
    for stage, offload, model in configs:
        tag = f"stage {stage} offload {offload} {model} dp {world}"
        engine = make_engine(stage, offload, model)
        names_all = [n for n, _ in engine.module.named_parameters()]
        names_tr = [n for n, p in engine.module.named_parameters() if p.requires_grad]
        for kind in MOMENTS:
            with pytest.raises(NotReadyError, match="first applied"):
                rsds.describe(engine, kind)
        train(engine, model, 2, seed=1, rank=rank)
        for kind in KINDS:
            live = rsds.describe(engine, kind)
            layouts = [None] * world
            dist.all_gather_object(layouts, live.layout)
            assert all(lay == live.layout for lay in layouts), f"{tag} {kind}: layouts differ"
            assert sorted(live.layout.tensors) == sorted(names_all if kind == "param" else names_tr)
            assert live.check() is None
            _check_views_inside(engine, live, kind)
            _check_padding(engine, live, kind, rank)
            got = assemble(live.layout, live.buffers)
            want = reference(engine, kind)
            assert sorted(got) == sorted(want)
            for n in want:
                assert_bitwise(got[n], want[n], f"{tag} {kind} {n}")
        done.append(tag)
        engine.destroy()
    return done


# ----------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("world", [2, 3])
def test_layouts_match_deepspeed_accessors(world, tmp_path):
    configs = [(s, o, m) for s in (1, 2, 3) for o in ("none", "cpu") for m in MODELS]
    out = run_ranks(_geometry_worker, world, tmp_path, args=(configs,), env=ENV, timeout=400)
    assert len(out[0]) == len(configs)
