"""What a DeepSpeed engine must be for its ZeRO state to be described and used (docs/deepspeed.md).

Configuration support (`check_supported`: refused settings name the config key to change) and
the engine's lifecycle (`is_destroyed`, the training-forward watch): facts about the engine, not
about any one kind of state.
"""

from __future__ import annotations

import weakref

import torch

from reshard.errors import NotReadyError, UnsupportedError

DESTROYED = (
    "the engine was destroyed (engine.destroy() removed its gradient hooks and parameter "
    "links): its state is no longer maintained; describe a live engine"
)


def stage_of(engine) -> int:
    try:
        return int(engine.zero_optimization_stage())
    except AttributeError as exc:
        raise UnsupportedError(
            f"describe() needs a deepspeed.DeepSpeedEngine, got {type(engine).__name__}"
        ) from exc


def device_name(value) -> str:
    # OffloadDeviceEnum is a str enum ("none" | "cpu" | "nvme"); tolerate plain strings.
    return str(getattr(value, "value", value) or "none")


def _cfg_get(obj, name, default=None):
    return default if obj is None else getattr(obj, name, default)


def check_supported(engine) -> int:
    """The ZeRO stage; refuse, with the config key to change, every setting not modelled."""
    stage = stage_of(engine)
    if stage not in (1, 2, 3):
        raise UnsupportedError(
            f"ZeRO stage {stage} is not supported: set zero_optimization.stage to 1, 2 or 3"
        )
    opt = engine.optimizer
    if opt is None or type(opt).__name__ == "DeepSpeedZeRoOffload":
        raise UnsupportedError(
            "the engine has no ZeRO optimizer (inference-only ZeRO-3): pass an optimizer to "
            "deepspeed.initialize"
        )
    zc = engine._config.zero_config
    _check_offload(zc)
    _check_partitioning(engine, zc, stage)
    return stage


def _check_offload(zc) -> None:
    off_opt, off_param = zc.offload_optimizer, zc.offload_param
    if device_name(_cfg_get(off_opt, "device")) == "nvme":
        raise UnsupportedError(
            "optimizer state offloaded to NVMe exists only while swapped in: set "
            "zero_optimization.offload_optimizer.device to 'cpu' or 'none'"
        )
    if device_name(_cfg_get(off_param, "device")) == "nvme":
        raise UnsupportedError(
            "parameters offloaded to NVMe are not resident: set "
            "zero_optimization.offload_param.device to 'cpu' or 'none'"
        )
    if device_name(_cfg_get(off_opt, "device")) == "none":
        return
    ratio = float(_cfg_get(off_opt, "ratio", 1.0))
    if ratio < 1.0:
        raise UnsupportedError(
            f"partial optimizer offload (ratio={ratio}) splits state across two optimizers: "
            "set zero_optimization.offload_optimizer.ratio to 1.0"
        )
    if _cfg_get(off_opt, "super_offload", False):
        raise UnsupportedError(
            "SuperOffload keeps its own optimizer state: set "
            "zero_optimization.offload_optimizer.super_offload to false"
        )


def _check_partitioning(engine, zc, stage) -> None:
    if getattr(zc, "zenflow", None) is not None or getattr(engine, "zenflow", False):
        raise UnsupportedError(
            "ZenFlow keeps selective optimizer state outside the ZeRO partitions: remove "
            "zero_optimization.zenflow"
        )
    if stage <= 2 and getattr(zc, "round_robin_gradients", False):
        raise UnsupportedError(
            "round-robin gradient partitioning reorders the flat buffer: set "
            "zero_optimization.round_robin_gradients to false"
        )
    if getattr(engine, "has_moe_layers", False):
        raise UnsupportedError(
            "MoE expert parameters are partitioned over expert data-parallel groups, which "
            "describe() does not model: use a model without MoE layers"
        )
    if stage != 3:
        return
    if int(getattr(zc, "zero_hpz_partition_size", 1) or 1) > 1:
        raise UnsupportedError(
            "ZeRO++ hierarchical partitioning keeps secondary shards: set "
            "zero_optimization.zero_hpz_partition_size to 1"
        )
    if getattr(zc, "mics_shard_size", -1) not in (-1, None, 0):
        raise UnsupportedError(
            "MiCS shards over sub-groups: set zero_optimization.mics_shard_size to -1"
        )
    if getattr(zc, "zero_quantized_weights", False) or getattr(
        zc, "zero_quantized_nontrainable_weights", False
    ):
        raise UnsupportedError(
            "quantized ZeRO-3 weights are not stored as plain tensors: set "
            "zero_optimization.zero_quantized_weights and "
            "zero_quantized_nontrainable_weights to false"
        )


# ---------------------------------------------------------------------------------------------
# lifecycle


def _hook_live(handle) -> bool:
    hooks = handle.hooks_dict_ref()
    return hooks is not None and handle.id in hooks


def is_destroyed(engine) -> bool:
    """engine.destroy() leaves no flag: it removes the optimizer's gradient hooks (and ZeRO-1/2
    unlinks every param's fp32 fragment), so a destroyed engine has hooks, none of them live.
    ZeRO-3 leaf modules (`set_z3_leaf_modules`, MoE blocks) get one module backward hook each
    instead of their params' gradient hooks: an engine whose trainable params all sit in leaf
    modules has only those."""
    opt = engine.optimizer
    hooks = [
        *(getattr(opt, "_grad_acc_hooks", None) or []),
        *(getattr(opt, "_leaf_module_hooks", None) or []),
    ]
    if hooks:
        return not any(_hook_live(h) for h in hooks)
    groups = getattr(engine.optimizer, "bit16_groups", None)
    if not groups or stage_of(engine) == 3:
        return False
    # only the params that overlap this rank's fp32 partition have a fragment: a rank whose
    # partition is all padding has none, destroyed or not (then it cannot tell)
    owned = getattr(engine.optimizer, "params_in_partition", None)
    params = [p for g in (groups if owned is None else owned) for p in g if p.numel()]
    return bool(params) and all(getattr(p, "_hp_mapping", None) is None for p in params)


def check_alive(engine) -> None:
    if is_destroyed(engine):
        raise NotReadyError(DESTROYED)


def applied_steps(engine) -> int:
    # global_steps counts every boundary step; skipped_steps the overflow-skipped ones.
    return int(engine.global_steps) - int(getattr(engine, "skipped_steps", 0))


class ForwardWatch:
    """Remembers the engine's micro step at its latest forward with autograd enabled, through
    the root module or any module below it that owns parameters.

    engine.step() advances `micro_steps`, so a training forward seen at the current micro step
    ran after the last step: its backward accumulates gradients that the next step applies to
    whatever was written meanwhile. Forwards under no_grad / inference_mode (rollout log-probs)
    change no ZeRO state and are not recorded.
    """

    def __init__(self, engine):
        self._engine = weakref.ref(engine)
        self.micro_step = None
        # every module that owns parameters: a forward may enter below the root
        # (engine.module.model(ids), as HF heads and value models do)
        for m in engine.module.modules():
            if m is engine.module or next(m.parameters(recurse=False), None) is not None:
                m.register_forward_pre_hook(self._seen)

    def _seen(self, module, args):
        engine = self._engine()
        if engine is not None and torch.is_grad_enabled():
            self.micro_step = engine.micro_steps

    def forward_since_step(self) -> bool:
        engine = self._engine()
        return engine is not None and self.micro_step == engine.micro_steps


_WATCHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def watch_forwards(engine) -> ForwardWatch:
    """The engine's forward watch, installed on first use (describe(), SyncAfterStep)."""
    watch = _WATCHES.get(engine)
    if watch is None:
        watch = _WATCHES[engine] = ForwardWatch(engine)
    return watch
