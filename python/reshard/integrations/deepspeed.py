"""Live DeepSpeed ZeRO-1/2/3 state as reshard Layouts (docs/deepspeed.md): the public surface.

    from reshard.integrations import deepspeed as rsds
    live = rsds.describe(engine, "fp32")   # "param" | "fp32" | "exp_avg" | "exp_avg_sq"
    sync = rsds.SyncAfterStep(engine, {"param": (layout, buffers)})

Module map (data flows down):
- deepspeed_checks.py: supported configurations, engine lifecycle (destroyed, training forwards)
- deepspeed_geometry.py: what the ZeRO families share, storages and runs from their answers
- deepspeed_zero12.py / deepspeed_zero3.py: one geometry class per ZeRO family
- deepspeed_live.py: describe() and LiveState (geometry + readiness; communicates nothing)
- deepspeed_hooks.py: SyncAfterStep, which decides when to transfer and drives the executor
- this module: the public names, and the collective refreshes to call after writing
"""

from __future__ import annotations

import torch

from .deepspeed_checks import check_supported, stage_of
from .deepspeed_hooks import SyncAfterStep
from .deepspeed_live import KINDS, LiveState, describe

__all__ = [
    "KINDS",
    "LiveState",
    "SyncAfterStep",
    "describe",
    "refresh_params",
    "refresh_persistent",
]


@torch.no_grad()
def refresh_params(engine) -> None:
    """Recompute the bf16/fp16 params from the fp32 masters (after writing "fp32").

    DeepSpeed casts masters to params only inside step(), so a write to masters leaves the
    params stale until this is called. Collective over the data-parallel group: call it on every
    rank. ZeRO-1/2: `optimizer.update_lp_params()` (cast this rank's chunk, all-gather the flat).
    ZeRO-3: cast each sub-group's master shard into its param shard (what step() does), then
    re-gather the persistent params, whose full copies forward reads instead of the shards.
    """
    stage = check_supported(engine)
    opt = engine.optimizer
    if stage <= 2:
        opt.update_lp_params()
        return
    for j in range(len(opt.fp16_groups)):
        opt._reassign_or_swap_out_partitioned_parameters(j)
    refresh_persistent(engine)


@torch.no_grad()
def refresh_persistent(engine) -> None:
    """ZeRO-3: re-gather persistent params after their shards were written ("param" kind).

    Params at or under stage3_param_persistence_threshold keep a full copy that forward reads;
    it is re-gathered only after step(). Params a forward under no_grad gathered and left
    gathered are released, so the next forward fetches them from the new shards. Collective
    over the data-parallel group. A no-op for ZeRO-1/2, whose "param" storage is the full flat
    buffer forward reads.
    """
    if stage_of(engine) != 3:
        return
    opt = engine.optimizer
    persistent = list(getattr(opt, "persistent_parameters", []) or [])
    # partition() keeps the existing (just written) shard and frees the stale full copy;
    # all_gather() rebuilds it from the shards, as step()'s epilogue does. A forward under
    # no_grad leaves the params it gathered gathered, and the next forward would read those
    # stale copies: every param is partitioned first, persistent or not.
    offload = getattr(opt, "parameter_offload", None)
    if offload is not None:
        offload.empty_partition_cache()
    elif persistent:
        persistent[0].partition(persistent)
    if persistent:
        persistent[0].all_gather(persistent)
    if hasattr(opt, "invalidate_secondary_tensor"):
        opt.invalidate_secondary_tensor()
