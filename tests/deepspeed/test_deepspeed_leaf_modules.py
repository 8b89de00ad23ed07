"""ZeRO-3 leaf modules (`deepspeed.utils.set_z3_leaf_modules`, as MoE blocks use), on spawned
gloo ranks with real engines and the optimizer offloaded to CPU.

A leaf module's params are fetched and released as a unit by the leaf's own hooks (its
submodules get none) and their gradients are reduced by one module backward hook instead of a
hook per param. The storage is DeepSpeed's usual one, so every kind is described as for any
ZeRO-3 engine: checked bitwise against DeepSpeed's accessors, moved into TP targets, restored
into a diverged engine (after a no_grad forward, which leaves gathered params behind) and
stepped in lockstep with the source. An engine whose trainable params all sit in leaf modules
has no per-param gradient hooks at all: once destroyed it is still recognized as destroyed.
Leaves chosen by size (`stage3_module_granularity_threshold`) are checked untrained: DeepSpeed's
own backward fails there on the CPU accelerator.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/_spawn.py
sys.path.insert(0, str(Path(__file__).resolve().parent))  # _dsutil.py

from _spawn import run_ranks

pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("deepspeed_cpu_ops")]

ENV = {"DS_ACCELERATOR": "cpu", "RESHARD_TEST_THREADS": "1"}
KINDS = ("param", "fp32", "exp_avg", "exp_avg_sq")
CONFIGS = [
    # a leaf between modules with per-param hooks; every param persistent (the default)
    ("moe", {}),
    # every trainable param in a leaf; no persistent params, several sub-groups
    ("moe-only", {"stage3_param_persistence_threshold": 0, "sub_group_size": 300}),
    # every trainable param in a leaf; persistent
    ("moe-only", {}),
]


def _leaf_worker(rank, world, configs):
    import torch
    import torch.distributed as dist
    from _dsutil import (
        assemble,
        assert_bitwise,
        assert_restored_then_in_step,
        batch,
        check_targets,
        ds_env,
        make_engine,
        reference,
        tp_targets,
        train,
    )

    ds_env(rank, world)
    from deepspeed.utils import get_z3_leaf_modules

    import reshard as rs
    from reshard.errors import NotReadyError
    from reshard.integrations import deepspeed as rsds

    done = []
    for i, (model, zx) in enumerate(configs):
        tag = f"{model} {zx}"
        a = make_engine(3, "cpu", model, seed=0, zero_extra=zx)
        b = make_engine(3, "cpu", model, seed=5, zero_extra=zx)
        assert get_z3_leaf_modules(a.module), f"{tag}: no leaf module"
        if model == "moe-only":  # nothing but the leaves' module hooks
            assert not a.optimizer._grad_acc_hooks and a.optimizer._leaf_module_hooks, tag
        train(a, model, 2, seed=1, rank=rank)
        train(b, model, 2, seed=2, rank=rank)
        want = {k: reference(a, k) for k in KINDS}
        for kind in KINDS:
            live = rsds.describe(a, kind)
            layouts = [None] * world
            dist.all_gather_object(layouts, live.layout)
            assert all(lay == live.layout for lay in layouts), f"{tag} {kind}: layouts differ"
            got = assemble(live.layout, live.buffers)
            assert sorted(got) == sorted(want[kind]), tag
            for n in want[kind]:
                assert_bitwise(got[n], want[kind][n], f"{tag} {kind} {n}")
            tp_layout, tp_bufs = tp_targets(live, list(range(world)))  # poisoned with NaN
            rs.Transfer(live.layout, tp_layout)(live, tp_bufs)
            assert check_targets(tp_layout, tp_bufs, want[kind], f"{tag} {kind} tp") > 0

        with torch.no_grad():  # rollout log-probs on the target: leaves params gathered
            b(batch(b, model, 7))
        # even configs write all four kinds, odd ones masters + moments then refresh_params()
        kinds = KINDS if i % 2 == 0 else KINDS[1:]
        for kind in kinds:
            src, dst = rsds.describe(a, kind), rsds.describe(b, kind)
            rs.Transfer(src.layout, dst.layout)(src, dst)
        if "param" in kinds:
            rsds.refresh_persistent(b)
        else:
            rsds.refresh_params(b)
        assert_restored_then_in_step(a, b, want, model, rank, KINDS, tag)

        lives = {k: rsds.describe(b, k) for k in KINDS}
        b.destroy()
        for kind in KINDS:
            with pytest.raises(NotReadyError, match="engine was destroyed"):
                rsds.describe(b, kind)
            with pytest.raises(NotReadyError, match="engine was destroyed"):
                lives[kind].check()
        for refresh in (rsds.refresh_params, rsds.refresh_persistent):
            with pytest.raises(NotReadyError, match=r"failed on 2 of 2 .*\n  rank 0: .*destroyed"):
                refresh(b)
        a.destroy()
        done.append(tag)

    # leaves chosen by size (stage3_module_granularity_threshold, "fast" leaf sharding, which
    # leaves a 1-element placeholder in released params): DeepSpeed 0.19.8's own backward fails
    # there on the CPU accelerator, so untrained engines: params and masters, then a forward
    zx = {"stage3_param_persistence_threshold": 0, "stage3_module_granularity_threshold": 100}
    a = make_engine(3, "cpu", "moe", seed=0, zero_extra=zx)
    b = make_engine(3, "cpu", "moe", seed=5, zero_extra=zx)
    assert a.optimizer.parameter_offload.fast_sharding_for_leaf_module
    x = batch(a, "moe", 3)
    with torch.no_grad():
        b(x)
    for kind in ("param", "fp32"):
        live = rsds.describe(a, kind)
        got, want = assemble(live.layout, live.buffers), reference(a, kind)
        for n in want:
            assert_bitwise(got[n], want[n], f"granularity {kind} {n}")
        dst = rsds.describe(b, kind)
        rs.Transfer(live.layout, dst.layout)(live, dst)
    rsds.refresh_persistent(b)
    with torch.no_grad():
        assert_bitwise(b(x), a(x), "granularity: forward after the write")
    a.destroy()
    b.destroy()
    done.append("granularity")
    return done


def test_leaf_module_engines_are_described_restored_and_seen_destroyed(tmp_path):
    done = run_ranks(_leaf_worker, 2, tmp_path, args=(CONFIGS,), env=ENV, timeout=500)
    assert done[0] == done[1] and len(done[0]) == len(CONFIGS) + 1
