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
import torch.distributed as dist

from reshard.errors import NotReadyError, UnsupportedError

from .deepspeed_checks import check_alive, check_supported
from .deepspeed_hooks import SyncAfterStep
from .deepspeed_live import KINDS, LiveState, describe, offload_reason

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
    rank. ZeRO-1/2: what `optimizer.update_lp_params()` does (cast this rank's chunk, all-gather
    the flat). ZeRO-3: cast each sub-group's master shard into its param shard (what step()
    does), then re-gather the persistent params, whose full copies forward reads instead of the
    shards. What fails on any rank before DeepSpeed communicates fails on every rank alike.
    """
    what = "refresh_params(engine)"
    stage = _agreed(engine, what)
    opt = engine.optimizer
    if stage <= 2:
        _local_part_agreed(
            engine,
            what,
            lambda: _cast_zero12(opt),
            "the ranks that got that far cast their chunk of the masters into their bf16/fp16 "
            "partition; nothing was gathered, so forward reads a mix of old and new chunks: "
            "call it again on every rank once the cause is fixed",
        )
        from deepspeed.runtime.zero import stage_1_and_2

        # update_lp_params()'s gather, with the same arguments
        stage_1_and_2.all_gather_dp_groups(
            groups_flat=opt.bit16_groups_flat,
            partitioned_param_groups=opt.parallel_partitioned_bit16_groups,
            dp_process_group=opt.real_dp_process_group,
            start_alignment_factor=opt.nccl_start_alignment_factor,
            allgather_bucket_size=opt.allgather_bucket_size,
        )
        return

    def cast_and_release():
        for j in range(len(opt.fp16_groups)):
            opt._reassign_or_swap_out_partitioned_parameters(j)
        _release_gathered(opt)

    _local_part_agreed(
        engine,
        what,
        cast_and_release,
        "the ranks that got that far cast their master shards into their param shards and "
        f"released the gathered params; nothing was gathered. {_RETRY_ZERO3}",
    )
    _gather_persistent(opt)


@torch.no_grad()
def refresh_persistent(engine) -> None:
    """ZeRO-3: re-gather persistent params after their shards were written ("param" kind).

    Params at or under stage3_param_persistence_threshold keep a full copy that forward reads;
    it is re-gathered only after step(). Params a forward under no_grad gathered and left
    gathered are released, so the next forward fetches them from the new shards. Collective
    over the data-parallel group. Nothing to do for ZeRO-1/2, whose "param" storage is the full
    flat buffer forward reads (the ranks still agree that their engines are fit). What fails on
    any rank before DeepSpeed communicates fails on every rank alike.
    """
    what = "refresh_persistent(engine)"
    if _agreed(engine, what) != 3:
        return
    opt = engine.optimizer
    _local_part_agreed(
        engine,
        what,
        lambda: _release_gathered(opt),
        f"the ranks that got that far released the gathered params; nothing was gathered. "
        f"{_RETRY_ZERO3}",
    )
    _gather_persistent(opt)


_RETRY_ZERO3 = (
    "The ranks may now differ in which params are gathered, and the next forward's gathers "
    "need them alike: call it again on every rank once the cause is fixed"
)


def _cast_zero12(opt) -> None:
    # update_lp_params()'s local part: this rank's chunk of the masters into its bf16/fp16
    # partition of the flat
    for i, (parts, master) in enumerate(
        zip(opt.parallel_partitioned_bit16_groups, opt.single_partition_of_fp32_groups, strict=True)
    ):
        parts[dist.get_rank(group=opt.real_dp_process_group[i])].data.copy_(master.data)


def _release_gathered(opt) -> None:
    # partition() keeps the existing (just written) shard and frees the stale full copy;
    # _gather_persistent() rebuilds it from the shards, as step()'s epilogue does. A forward
    # under no_grad leaves the params it gathered gathered, and the next forward would read
    # those stale copies: every param is partitioned first, persistent or not. Secondary
    # (ZeRO++) shards, stale after a write, are dropped here too: local work, so before the
    # agreement that precedes the gather.
    offload = getattr(opt, "parameter_offload", None)
    persistent = _persistent(opt)
    if offload is not None:
        offload.empty_partition_cache()
    elif persistent:
        persistent[0].partition(persistent)
    if hasattr(opt, "invalidate_secondary_tensor"):
        opt.invalidate_secondary_tensor()


def _persistent(opt) -> list:
    return list(getattr(opt, "persistent_parameters", []) or [])


def _gather_persistent(opt) -> None:
    persistent = _persistent(opt)
    if persistent:
        persistent[0].all_gather(persistent)


def _agreed(engine, what) -> int:
    """The ZeRO stage, once every rank of the engine's data-parallel group found its engine
    fit for `what`; otherwise every rank raises the same error naming each failing rank.

    The refreshes run DeepSpeed's collectives: a rank refusing alone (its engine destroyed,
    its states offloaded) would leave its peers waiting in them for the group's timeout. One
    flag all-reduce when every rank is fit; the reasons are gathered only when one is not."""
    try:
        stage = check_supported(engine)
        check_alive(engine)
        why = offload_reason(engine)
        if why:
            raise NotReadyError(why)
        failed = None
    except Exception as exc:  # noqa: BLE001 - raised below, on every rank
        stage, failed = None, exc
    _agree(engine, failed, what, "before communicating; nothing was changed")
    return stage


def _local_part_agreed(engine, what, local, changed) -> None:
    """Run the local part of a refresh (DeepSpeed's code that reads and writes this rank's
    partitions, no communication), then agree before its gather: an exception there on one
    rank makes every rank raise the same error naming it, instead of its peers waiting in the
    gather for the group's timeout. `changed` says what the local part leaves behind."""
    try:
        local()
        failed = None
    except Exception as exc:  # noqa: BLE001 - raised below, on every rank
        failed = exc
    _agree(engine, failed, what, f"in DeepSpeed's local refresh, before its gather; {changed}")


def _agree(engine, failed, what, when) -> None:
    """One flag all-reduce over the engine's data-parallel group; when any rank's `failed` is
    set, every rank raises the same error naming each failing rank and its exception."""
    group = getattr(getattr(engine, "optimizer", None), "dp_process_group", None)
    if not (dist.is_available() and dist.is_initialized()):
        if failed is not None:
            raise failed
        return
    device = "cpu"
    if dist.get_backend(group) == "nccl":
        from deepspeed.accelerator import get_accelerator

        device = get_accelerator().current_device_name()
    flag = torch.tensor([0 if failed is None else 1], dtype=torch.int64, device=device)
    dist.all_reduce(flag, group=group)
    if not int(flag.item()):
        return
    mine = None if failed is None else (type(failed).__name__, str(failed))
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    bad = [(r, f) for r, f in enumerate(every) if f is not None]
    kinds = {name for _, (name, _) in bad}
    cls = {"NotReadyError": NotReadyError, "UnsupportedError": UnsupportedError}.get(
        kinds.pop() if len(kinds) == 1 else "", RuntimeError
    )
    lines = "".join(f"\n  rank {r}: {name}: {msg}" for r, (name, msg) in bad)
    raise cls(
        f"{what} failed on {len(bad)} of {len(every)} data-parallel ranks "
        f"({', '.join(str(r) for r, _ in bad)}) {when}:" + lines
    )
