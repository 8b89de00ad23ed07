"""Live DeepSpeed ZeRO-1/2/3 state as reshard Layouts (docs/deepspeed.md).

`describe(engine, kind)` says where every element of every parameter's `kind` lives across the
engine's data-parallel ranks, as an `rs.Layout` that is identical on every rank, plus this rank's
live storage views (never copies). Geometry is read from the optimizer's own bookkeeping
(written against DeepSpeed 0.19.8) and cross-checked against the live tensors, so a layout change
in another DeepSpeed version is an `UnsupportedError`, not a silent misread.

Storage model (one storage per *unit* per data-parallel rank; location = unit * dp + dp_rank):
- ZeRO-1/2, "param": unit = param group, storage = the whole bit16 flat buffer, which every rank
  holds in full after `step()`: each param is replicated dp times.
- ZeRO-1/2, fp32/moments: unit = param group, storage = this rank's equal chunk of the padded
  flat (`single_partition_of_fp32_groups[i]` and its optimizer state). Params straddle chunks.
- ZeRO-3, all kinds: unit = sub-group, storage = the concatenation of this rank's padded shards
  of the sub-group's params (`fp16_partitioned_groups_flat[j]`, `fp32_partitioned_groups_flat[j]`).
- Frozen params ("param" kind only): one unit each. ZeRO-1/2: the full tensor on every rank;
  ZeRO-3: its `ds_tensor` shard.
Padding (group padding in ZeRO-1/2, per-param padding in ZeRO-3) is covered by no piece, so a
transfer never reads it into a target nor writes it from a source.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field

import torch

import reshard as rs
from reshard.errors import NotReadyError, UnsupportedError

KINDS = ("param", "fp32", "exp_avg", "exp_avg_sq")
_MOMENTS = ("exp_avg", "exp_avg_sq")

__all__ = [
    "KINDS",
    "LiveState",
    "SyncAfterStep",
    "describe",
    "refresh_params",
]


# ---------------------------------------------------------------------------------------------
# configuration checks


def _cfg_get(obj, name, default=None):
    return default if obj is None else getattr(obj, name, default)


def _device_name(value) -> str:
    # OffloadDeviceEnum is a str enum ("none" | "cpu" | "nvme"); tolerate plain strings.
    return str(getattr(value, "value", value) or "none")


def _stage(engine) -> int:
    try:
        return int(engine.zero_optimization_stage())
    except AttributeError as exc:
        raise UnsupportedError(
            f"describe() needs a deepspeed.DeepSpeedEngine, got {type(engine).__name__}"
        ) from exc


def _hook_live(handle) -> bool:
    hooks = handle.hooks_dict_ref()
    return hooks is not None and handle.id in hooks


def _destroyed(engine) -> bool:
    """engine.destroy() leaves no flag: it removes the optimizer's gradient hooks (and ZeRO-1/2
    unlinks every param's fp32 fragment), so a destroyed engine has hooks, none of them live."""
    hooks = getattr(engine.optimizer, "_grad_acc_hooks", None) or []
    if hooks:
        return not any(_hook_live(h) for h in hooks)
    groups = getattr(engine.optimizer, "bit16_groups", None)
    if not groups or _stage(engine) == 3:
        return False
    params = [p for g in groups for p in g]
    return bool(params) and all(getattr(p, "_hp_mapping", None) is None for p in params)


_DESTROYED = (
    "the engine was destroyed (engine.destroy() removed its gradient hooks and parameter "
    "links): its state is no longer maintained; describe a live engine"
)


def _check_alive(engine) -> None:
    if _destroyed(engine):
        raise NotReadyError(_DESTROYED)


def _check_supported(engine) -> int:
    """Refuse, with the config key to change, every setting whose storage we do not model."""
    stage = _stage(engine)
    if stage not in (1, 2, 3):
        raise UnsupportedError(
            f"ZeRO stage {stage} is not supported: set zero_optimization.stage to 1, 2 or 3"
        )
    zc = engine._config.zero_config
    opt = engine.optimizer
    if opt is None or type(opt).__name__ == "DeepSpeedZeRoOffload":
        raise UnsupportedError(
            "the engine has no ZeRO optimizer (inference-only ZeRO-3): pass an optimizer to "
            "deepspeed.initialize"
        )
    off_opt = zc.offload_optimizer
    off_param = zc.offload_param
    if _device_name(_cfg_get(off_opt, "device")) == "nvme":
        raise UnsupportedError(
            "optimizer state offloaded to NVMe exists only while swapped in: set "
            "zero_optimization.offload_optimizer.device to 'cpu' or 'none'"
        )
    if _device_name(_cfg_get(off_param, "device")) == "nvme":
        raise UnsupportedError(
            "parameters offloaded to NVMe are not resident: set "
            "zero_optimization.offload_param.device to 'cpu' or 'none'"
        )
    if _device_name(_cfg_get(off_opt, "device")) != "none":
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
    if stage == 3:
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
    return stage


# ---------------------------------------------------------------------------------------------
# geometry


@dataclass
class _Geometry:
    """Engine structure common to every kind: computed once per describe()."""

    stage: int
    dp_ranks: list  # global ranks of the data-parallel group, in dp-rank order
    dp_rank: int  # this process's rank inside that group
    names: dict  # id(param) -> name
    # per trainable unit (ZeRO-1/2 group / ZeRO-3 sub-group): list of (param, shape, offset)
    # where offset is the param's start in the group flat (1/2) or in the sub-group shard (3)
    units: list
    unit_numel: list  # ZeRO-1/2: partition size; ZeRO-3: sub-group shard numel
    flat_numel: list  # ZeRO-1/2 only: the whole padded flat's numel
    frozen: list  # [(param, name, shape)]: params the optimizer does not own


def _group_ranks(group) -> list:
    import torch.distributed as dist

    if group is None or group is dist.group.WORLD:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


def _param_names(engine) -> dict:
    names = {}
    for name, p in engine.module.named_parameters():
        names.setdefault(id(p), name)
    return names


def _geometry(engine, stage) -> _Geometry:
    import torch.distributed as dist

    opt = engine.optimizer
    dp_group = getattr(engine, "seq_data_parallel_group", None)
    dp_ranks = _group_ranks(dp_group)
    me = dist.get_rank()
    if me not in dp_ranks:
        raise UnsupportedError(f"rank {me} is not in the engine's data-parallel group {dp_ranks}")
    names = _param_names(engine)
    units, unit_numel, flat_numel, owned = [], [], [], set()

    def check_group(pg, what):
        if _group_ranks(pg) != dp_ranks:
            raise UnsupportedError(
                f"{what} is partitioned over ranks {_group_ranks(pg)}, not the data-parallel "
                f"group {dp_ranks} (MoE/AutoTP/MiCS layouts are not supported)"
            )

    def name_of(p):
        try:
            return names[id(p)]
        except KeyError:
            raise UnsupportedError(
                "the optimizer owns a parameter that engine.module.named_parameters() does not list"
            ) from None

    if stage <= 2:
        w = len(dp_ranks)
        for i in range(len(opt.bit16_groups)):
            check_group(opt.real_dp_process_group[i], f"param group {i}")
            flat = opt.bit16_groups_flat[i]
            n = flat.numel()
            if n % w or opt.partition_size[i] != n // w:
                raise UnsupportedError(
                    f"param group {i}: flat buffer of {n} elements is not {w} equal partitions "
                    f"of {opt.partition_size[i]} (unexpected DeepSpeed layout)"
                )
            # round_robin_bit16_groups is refused above, so it equals bit16_groups; the meta
            # tensors keep shapes even while offload_states() has emptied param.data.
            entries = []
            for p, meta, off in zip(
                opt.round_robin_bit16_groups[i],
                opt.round_robin_bit16_meta[i],
                opt.round_robin_bit16_offsets[i],
                strict=True,
            ):
                name_of(p)
                entries.append((p, tuple(meta.shape), int(off)))
                owned.add(id(p))
            units.append(entries)
            unit_numel.append(n // w)
            flat_numel.append(n)
    else:
        for j, sub_group in enumerate(opt.fp16_groups):
            check_group(opt.sub_group_process_groups[j], f"sub-group {j}")
            entries, off = [], 0
            for p in sub_group:
                name_of(p)
                entries.append((p, tuple(p.ds_shape), off))
                off += int(p.partition_numel())
                owned.add(id(p))
            units.append(entries)
            unit_numel.append(off)
            flat_numel.append(None)
    frozen = []
    for name, p in engine.module.named_parameters():  # shared params are listed once
        if id(p) in owned:
            continue
        shape = tuple(p.ds_shape) if stage == 3 else tuple(p.shape)
        frozen.append((p, name, shape))
    return _Geometry(
        stage=stage,
        dp_ranks=dp_ranks,
        dp_rank=dp_ranks.index(me),
        names=names,
        units=units,
        unit_numel=unit_numel,
        flat_numel=flat_numel,
        frozen=frozen,
    )


def _z12_partition_runs(shape, off, part, w):
    """Runs of a param living at [off, off+numel) of a flat cut into w chunks of `part`."""
    numel = math.prod(shape)
    runs = []
    for r in range(w):
        lo, hi = max(off, r * part), min(off + numel, (r + 1) * part)
        if lo < hi:
            runs.append((r, lo - off, hi - off, lo - r * part))
    return runs


def _z3_shard_runs(shape, off, w):
    """Runs of a ZeRO-3 param: rank r holds [r*p, (r+1)*p) of it at `off` of its shard flat."""
    numel = math.prod(shape)
    p = -(-numel // w)
    runs = []
    for r in range(w):
        lo, hi = r * p, min((r + 1) * p, numel)
        if lo < hi:  # a rank past the end holds only padding: no run
            runs.append((r, lo, hi, off))
    return runs


# ---------------------------------------------------------------------------------------------
# live storage of this rank


def _base_state(engine):
    return engine.optimizer.optimizer.state


def _unit_tensor(engine, geo, kind, u):
    """This rank's live storage of trainable unit u for `kind` (a view, never a copy)."""
    opt = engine.optimizer
    if geo.stage <= 2:
        if kind == "param":
            return opt.bit16_groups_flat[u]
        master = opt.single_partition_of_fp32_groups[u]
    else:
        if kind == "param":
            t = opt.fp16_partitioned_groups_flat[u]
            if t is None:
                raise UnsupportedError(
                    f"sub-group {u} has no resident bf16 shard (parameters on NVMe): set "
                    "zero_optimization.offload_param.device to 'cpu' or 'none'"
                )
            return t
        master = opt.fp32_partitioned_groups_flat[u]
    if kind == "fp32":
        return master
    state = _base_state(engine).get(master)
    if state and kind in state:
        return state[kind]
    raise _missing_moment(engine, kind, state)


def _applied_steps(engine) -> int:
    # global_steps counts every boundary step; skipped_steps the overflow-skipped ones.
    return int(engine.global_steps) - int(getattr(engine, "skipped_steps", 0))


def _missing_moment(engine, kind, state):
    """Why `kind` is absent: not created yet, or an optimizer that never creates it."""
    optimizer = type(engine.optimizer.optimizer).__name__
    if state:  # the optimizer has stepped and keeps other state: `kind` will never appear
        return UnsupportedError(
            f"{optimizer} keeps no {kind!r} state (its state keys: {sorted(state)}): use an "
            "Adam-family optimizer"
        )
    applied = _applied_steps(engine)
    if applied > 0:  # stateless optimizer (plain SGD): nothing after real steps
        return UnsupportedError(
            f"{optimizer} keeps no {kind!r} state (no per-parameter state at all after "
            f"{applied} applied optimizer steps): use an Adam-family optimizer"
        )
    return NotReadyError(
        f"{kind!r} does not exist yet: Adam moments are created by the first applied "
        "optimizer step (engine.step() on an accumulation boundary without overflow)"
    )


def _frozen_tensor(geo, index):
    p = geo.frozen[index][0]
    t = p.ds_tensor if geo.stage == 3 else p.data
    if not t.is_contiguous():
        raise UnsupportedError(f"frozen parameter {geo.frozen[index][1]!r} is not contiguous")
    return t.detach().view(-1)


def _identity(t):
    return (t.data_ptr(), t.untyped_storage().data_ptr(), t.numel(), t.dtype, str(t.device))


def _check_view(name, kind, view, base, expected_offset):
    """Assert a per-param tensor DeepSpeed uses is the view of `base` our geometry says."""
    if view.numel() == 0:
        return
    got = view.data_ptr() - base.data_ptr()
    if view.untyped_storage().data_ptr() != base.untyped_storage().data_ptr() or got != (
        expected_offset * base.element_size()
    ):
        raise UnsupportedError(
            f"{name!r} ({kind}): DeepSpeed's tensor is not at element {expected_offset} of the "
            "storage reshard describes (unexpected DeepSpeed layout; version "
            f"{_ds_version()} is not supported)"
        )


def _ds_version():
    try:
        import deepspeed

        return deepspeed.__version__
    except Exception:  # noqa: BLE001 - only for a message
        return "unknown"


def _cross_check(engine, geo, kind, unit_tensors):
    """Verify the geometry against DeepSpeed's own per-param links on this rank."""
    opt = engine.optimizer
    me = geo.dp_rank
    for u, entries in enumerate(geo.units):
        base = unit_tensors[u]
        if base.numel() != (
            geo.flat_numel[u] if kind == "param" and geo.stage <= 2 else geo.unit_numel[u]
        ):
            raise UnsupportedError(
                f"unit {u} ({kind}): live storage has {base.numel()} elements, expected "
                f"{geo.unit_numel[u]} (unexpected DeepSpeed layout)"
            )
        for p, shape, off in entries:
            name = geo.names[id(p)]
            if geo.stage <= 2:
                if kind == "param":
                    if p.data.numel():  # offload_states() empties param.data
                        _check_view(name, kind, p.data, base, off)
                    continue
                mapping = getattr(p, "_hp_mapping", None)
                runs = _z12_partition_runs(shape, off, geo.unit_numel[u], len(geo.dp_ranks))
                mine = [r for r in runs if r[0] == me]
                if (mapping is None) != (not mine):
                    raise UnsupportedError(
                        f"{name!r}: DeepSpeed's fp32 link disagrees with the partition geometry"
                    )
                if mine:
                    _, lo, hi, at = mine[0]
                    hp = mapping.hp_fragment_address
                    lp = mapping.lp_fragment_address
                    if (hp.start, hp.numel, lp.start) != (at, hi - lo, lo):
                        raise UnsupportedError(
                            f"{name!r}: DeepSpeed maps fragment lp[{lp.start}:+{lp.numel}] to "
                            f"hp[{hp.start}], reshard computed lp[{lo}:{hi}] at {at}"
                        )
            else:
                pos = opt.grad_position.get(opt.get_param_id(p))
                if pos is not None and (int(pos[0]), int(pos[1])) != (u, off):
                    raise UnsupportedError(
                        f"{name!r}: DeepSpeed places it at sub-group {pos[0]} offset {pos[1]}, "
                        f"reshard computed {u}, {off}"
                    )
                if kind == "param":
                    _check_view(name, kind, p.ds_tensor, base, off)


# ---------------------------------------------------------------------------------------------
# readiness: training forwards since the last step


class _ForwardWatch:
    """Remembers the engine's micro step at its latest forward with autograd enabled.

    engine.step() advances `micro_steps`, so a training forward seen at the current micro step
    ran after the last step: its backward accumulates gradients that the next step applies to
    whatever was written meanwhile. Forwards under no_grad / inference_mode (rollout log-probs)
    change no ZeRO state and are not recorded.
    """

    def __init__(self, engine):
        self._engine = weakref.ref(engine)
        self.micro_step = None
        engine.module.register_forward_pre_hook(self._seen)

    def _seen(self, module, args):
        engine = self._engine()
        if engine is not None and torch.is_grad_enabled():
            self.micro_step = engine.micro_steps

    def forward_since_step(self) -> bool:
        engine = self._engine()
        return engine is not None and self.micro_step == engine.micro_steps


_WATCHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def watch_forwards(engine) -> _ForwardWatch:
    """The engine's forward watch, installed on first use (describe(), SyncAfterStep)."""
    watch = _WATCHES.get(engine)
    if watch is None:
        watch = _WATCHES[engine] = _ForwardWatch(engine)
    return watch


# ---------------------------------------------------------------------------------------------
# the public object


@dataclass
class LiveState:
    """One kind of a live engine's state: `.layout` (same on every rank), `.buffers` (this rank).

    `check()` re-validates at the safe boundary and raises `NotReadyError`: storage identity
    (nothing replaced since describe: `load_checkpoint`, `offload_states`, an optimizer
    `load_state_dict`) and readiness (moments exist, states are not offloaded, not mid gradient
    accumulation). `reasons()` returns the same findings as a list. Pass the LiveState itself as
    `src_buffers`/`dst_buffers` and the executor's preflight runs `check()` on every rank.
    """

    engine: object
    kind: str
    layout: object  # rs.Layout
    buffers: dict  # {location: live 1-D view of this rank's storage}
    dp_ranks: list
    # {name: (shape, [(location, flat_start, flat_stop, offset)])}: the rs.flat runs the layout
    # was built from (row-major ranges of each param and where they sit in each storage).
    runs: dict = field(repr=False)
    _geo: _Geometry = field(repr=False)
    _identity: dict = field(repr=False)  # location -> identity tuple at describe time

    def _resolve(self) -> dict:
        geo = self._geo
        w = len(geo.dp_ranks)
        out = {}
        for u in range(len(geo.units)):
            out[u * w + geo.dp_rank] = _unit_tensor(self.engine, geo, self.kind, u)
        if self.kind == "param":
            base = len(geo.units)
            for f in range(len(geo.frozen)):
                out[(base + f) * w + geo.dp_rank] = _frozen_tensor(geo, f)
        return out

    def reasons(self) -> list:
        """Local reasons this state must not be read or written now; [] when it may."""
        engine = self.engine
        if _destroyed(engine):
            return [_DESTROYED]
        reasons = []
        if watch_forwards(engine).forward_since_step():
            reasons.append(
                f"a forward with autograd enabled ran after the last engine.step() (micro step "
                f"{engine.micro_steps}): the safe boundary ends at the next training forward; "
                "use the state right after engine.step(), or call engine.step() first"
            )
        offloaded = getattr(engine.optimizer, "offloaded_states", None)
        if offloaded:
            names = sorted(_device_name(s) for s in offloaded)
            reasons.append(
                f"engine states {names} are offloaded (offload_states()): call "
                "engine.reload_states(), then describe() again"
            )
        gas = engine.gradient_accumulation_steps()
        managed = getattr(engine, "managed_gradient_accumulation", lambda: True)()
        if managed and engine.micro_steps % gas:
            reasons.append(
                f"mid gradient accumulation (micro step {engine.micro_steps}, "
                f"gradient_accumulation_steps={gas}): the safe boundary is right after "
                "engine.step() on an accumulation boundary"
            )
        try:
            live = self._resolve()
        except (NotReadyError, UnsupportedError) as exc:
            return reasons + [str(exc)]
        replaced = [
            loc
            for loc, ident in self._identity.items()
            if loc not in live or _identity(live[loc]) != ident
        ]
        if replaced:
            reasons.append(
                f"{self.kind} storage replaced since describe() at locations {replaced} "
                "(load_checkpoint / offload_states / load_state_dict?): describe() again"
            )
        return reasons

    def check(self) -> None:
        """Raise NotReadyError naming every reason this state must not be used now.

        The executor's preflight calls this on every rank when a LiveState is passed as the
        source or target buffer set, so a failure on any rank stops the transfer everywhere.
        """
        reasons = self.reasons()
        if reasons:
            raise NotReadyError(f"DeepSpeed {self.kind} state not ready: " + "; ".join(reasons))


def describe(engine, kind: str, group=None) -> LiveState:
    """Describe one kind of a DeepSpeed engine's live ZeRO state.

    kind: "param" (bf16/fp16 params), "fp32" (master weights), "exp_avg", "exp_avg_sq".
    group: the process group the transfer will run over (default: the world). Storages are
    owned by ranks numbered in that group, which must contain the engine's data-parallel group.
    Call it on every rank of the engine's data-parallel group, at the safe boundary (after
    engine.step() on an accumulation boundary, before the next forward). It communicates
    nothing; the layout is computed from structure every rank shares.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    stage = _check_supported(engine)
    _check_alive(engine)
    watch_forwards(engine)
    geo = _geometry(engine, stage)
    w = len(geo.dp_ranks)
    owners = _owner_ranks(geo.dp_ranks, group)
    tensors = [_unit_tensor(engine, geo, kind, u) for u in range(len(geo.units))]
    _cross_check(engine, geo, kind, tensors)

    storages, per_name = {}, {}
    for u, entries in enumerate(geo.units):
        t = tensors[u]
        numel = geo.flat_numel[u] if (kind == "param" and stage <= 2) else geo.unit_numel[u]
        for r in range(w):
            storages[u * w + r] = rs.Storage(owners[r], t.dtype, numel)
        for p, shape, off in entries:
            name = geo.names[id(p)]
            if kind == "param" and stage <= 2:
                runs = [(r, 0, math.prod(shape), off) for r in range(w)]  # full replicas
            elif stage <= 2:
                runs = _z12_partition_runs(shape, off, geo.unit_numel[u], w)
            else:
                runs = _z3_shard_runs(shape, off, w)
            per_name[name] = (shape, [(u * w + r, a, b, o) for r, a, b, o in runs])
    buffers = {u * w + geo.dp_rank: _as_flat(tensors[u]) for u in range(len(geo.units))}
    if kind == "param":
        base = len(geo.units)
        for f, (p, name, shape) in enumerate(geo.frozen):
            loc0 = (base + f) * w
            numel = math.prod(shape)
            dtype = p.ds_tensor.dtype if stage == 3 else p.dtype
            if stage == 3:
                shard = -(-numel // w)
                for r in range(w):
                    storages[loc0 + r] = rs.Storage(owners[r], dtype, shard)
                runs = [(loc0 + r, a, b, 0) for r, a, b, _ in _z3_shard_runs(shape, 0, w)]
            else:
                for r in range(w):
                    storages[loc0 + r] = rs.Storage(owners[r], dtype, numel)
                runs = [(loc0 + r, 0, numel, 0) for r in range(w)]
            per_name[name] = (shape, runs)
            buffers[loc0 + geo.dp_rank] = _frozen_tensor(geo, f)
    tensors_layout = {name: rs.flat(shape, runs) for name, (shape, runs) in per_name.items()}
    layout = rs.Layout(tensors_layout, storages)
    return LiveState(
        engine=engine,
        kind=kind,
        layout=layout,
        buffers=buffers,
        dp_ranks=geo.dp_ranks,
        runs=per_name,
        _geo=geo,
        _identity={loc: _identity(t) for loc, t in buffers.items()},
    )


def _owner_ranks(dp_ranks, group):
    """The data-parallel members' ranks as numbered in the transfer group."""
    import torch.distributed as dist

    if group is None or group is dist.group.WORLD:
        return list(dp_ranks)
    members = _group_ranks(group)
    missing = [r for r in dp_ranks if r not in members]
    if missing:
        raise ValueError(
            f"the transfer group {members} lacks data-parallel ranks {missing} of the engine"
        )
    return [members.index(r) for r in dp_ranks]


def _as_flat(t):
    if t.dim() != 1 or not t.is_contiguous():
        raise UnsupportedError(f"expected a contiguous 1-D storage, got shape {tuple(t.shape)}")
    # detach(): same storage, no autograd; masters have requires_grad=True and an in-place
    # write into them through the tensor DeepSpeed holds would be refused by autograd.
    return t.detach()


# ---------------------------------------------------------------------------------------------
# after writing


@torch.no_grad()
def refresh_params(engine) -> None:
    """Recompute the bf16/fp16 params from the fp32 masters (after writing "fp32").

    DeepSpeed casts masters to params only inside step(), so a write to masters leaves the
    params stale until this is called. Collective over the data-parallel group: call it on every
    rank. ZeRO-1/2: `optimizer.update_lp_params()` (cast this rank's chunk, all-gather the flat).
    ZeRO-3: cast each sub-group's master shard into its param shard (what step() does), then
    re-gather the persistent params, whose full copies forward reads instead of the shards.
    """
    stage = _check_supported(engine)
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
    it is re-gathered only after step(). Collective over the data-parallel group. A no-op for
    ZeRO-1/2, whose "param" storage is the full flat buffer forward reads.
    """
    if _stage(engine) != 3:
        return
    opt = engine.optimizer
    persistent = list(getattr(opt, "persistent_parameters", []) or [])
    if persistent:
        # partition() keeps the existing (just written) shard and frees the stale full copy;
        # all_gather() rebuilds it from the shards, as step()'s epilogue does.
        persistent[0].partition(persistent)
        persistent[0].all_gather(persistent)
    if hasattr(opt, "invalidate_secondary_tensor"):
        opt.invalidate_secondary_tensor()


# ---------------------------------------------------------------------------------------------
# RL hook


class SyncAfterStep:
    """Run reshard Transfers from a DeepSpeed engine after optimizer steps (RL weight sync).

        sync = rsds.SyncAfterStep(engine, {"param": (rollout_layout, rollout_buffers)}, every=1)
        for batch in data:
            loss = engine(batch); engine.backward(loss)
            sync.step()                 # engine.step(), then the transfer on the safe boundary
            report = sync.reports["param"]

    targets: {kind: (target Layout, target buffers of this rank)}. Buffers may be a callable
    returning the dict (rollout buffers that move). A transfer runs after every `every`-th
    applied step on an accumulation boundary; skipped (overflow) steps do not count. Each kind
    is described and planned once (moments lazily, once they exist); a storage replaced since
    (load_checkpoint, offload_states) is re-described and re-planned.
    """

    def __init__(self, engine, targets, every=1, budget_bytes_per_peer=64 << 20, group=None):
        if not isinstance(targets, dict) or not targets:
            raise ValueError("targets must be a non-empty {kind: (layout, buffers)} dict")
        for kind, value in targets.items():
            if kind not in KINDS:
                raise ValueError(f"target kind must be one of {KINDS}, got {kind!r}")
            if not (isinstance(value, tuple) and len(value) == 2):
                raise ValueError(f"targets[{kind!r}] must be a (layout, buffers) pair")
        if int(every) < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        _check_supported(engine)
        _check_alive(engine)
        watch_forwards(engine)
        self.engine = engine
        self.targets = dict(targets)
        self.every = int(every)
        self.budget = int(budget_bytes_per_peer)
        self.group = group
        self.applied_steps = 0
        self.syncs = 0
        self.reports = {}  # kind -> the Report of the latest transfer
        self._live = {}
        self._transfers = {}

    def step(self, *args, **kwargs):
        """engine.step(...), then sync() if this was the every-th applied boundary step."""
        boundary = self.engine.is_gradient_accumulation_boundary()
        out = self.engine.step(*args, **kwargs)
        if boundary and self.engine.was_step_applied():
            self.applied_steps += 1
            if self.applied_steps % self.every == 0:
                self.sync()
        return out

    def sync(self) -> dict:
        """Transfer every target now (the caller vouches for the safe boundary); {kind: Report}."""
        _synchronize(self.engine)
        for kind, (dst_layout, dst_buffers) in self.targets.items():
            live = self._live.get(kind)
            if live is None or live.reasons():
                live = describe(self.engine, kind, group=self.group)
                self._live[kind] = live
                self._transfers.pop(kind, None)
            transfer = self._transfers.get(kind)
            if transfer is None:
                transfer = rs.Transfer(
                    live.layout, dst_layout, budget_bytes_per_peer=self.budget, group=self.group
                )
                self._transfers[kind] = transfer
            buffers = dst_buffers() if callable(dst_buffers) else dst_buffers
            # The LiveState goes in whole: preflight runs its check() on every rank.
            self.reports[kind] = transfer(live, buffers)
        self.syncs += 1
        return dict(self.reports)


def _synchronize(engine):
    # ZeRO-1/2 with offload returns from step() with a non_blocking H2D copy queued; reads on
    # another stream or on the host must not start before it lands.
    from deepspeed.accelerator import get_accelerator

    get_accelerator().synchronize()
