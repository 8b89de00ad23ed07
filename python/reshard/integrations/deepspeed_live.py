"""describe(): one kind of a live DeepSpeed engine's ZeRO state as an rs.Layout plus this rank's
live storage views, and the readiness of that state (docs/deepspeed.md).

Pure geometry and inspection: nothing here communicates or drives a transfer (the RL hook is
deepspeed_hooks.py). The geometry is read from the optimizer's bookkeeping by the engine's ZeRO
family (deepspeed_zero12.py / deepspeed_zero3.py) and cross-checked against DeepSpeed's own
per-param links, so another DeepSpeed version's layout is an UnsupportedError, not a misread.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

import reshard as rs
from reshard.errors import NotReadyError, UnsupportedError

from ._module_tree import ModuleTree
from .deepspeed_checks import (
    DESTROYED,
    check_alive,
    check_supported,
    device_name,
    is_destroyed,
    watch_forwards,
)
from .deepspeed_geometry import ZeroGeometry, flat_layouts, group_ranks
from .deepspeed_zero3 import Zero3Geometry
from .deepspeed_zero12 import Zero12Geometry

KINDS = ("param", "fp32", "exp_avg", "exp_avg_sq")


def geometry_of(engine) -> ZeroGeometry:
    """The engine's ZeRO family geometry, after refusing what it does not model."""
    stage = check_supported(engine)
    check_alive(engine)
    return Zero3Geometry(engine) if stage == 3 else Zero12Geometry(engine)


def _identity(t):
    return (t.data_ptr(), t.untyped_storage().data_ptr(), t.numel(), t.dtype, str(t.device))


class _ModuleTree:
    """engine.module's submodules and parameters, by name and identity, as describe() saw them
    (`ModuleTree`), and what changed since, by name."""

    def __init__(self, module):
        self.module = module
        self.named = list(module.named_parameters(remove_duplicate=False))
        self.shape = ModuleTree(module)

    def changed(self) -> str | None:
        """What changed since describe() (names), or None."""
        if self.shape.unchanged():
            return None
        then = dict(self.named)
        now = dict(self.module.named_parameters(remove_duplicate=False))
        parts = [
            (what, names[:8])
            for what, names in (
                ("replaced", [n for n in then if n in now and now[n] is not then[n]]),
                ("removed", [n for n in then if n not in now]),
                ("added", [n for n in now if n not in then]),
            )
            if names
        ]
        if not parts:  # a submodule swapped for one with the same parameter objects
            return "engine.module's submodules were replaced"
        return "engine.module parameters " + ", ".join(f"{w} {n}" for w, n in parts)


def _moved_views(geo, views) -> list:
    """Names of trainable params whose bf16/fp16 tensor is no longer at its described address."""
    lp = geo.lp_tensor
    return [name for name, p, addr in views if lp(p).data_ptr() != addr]


def _as_flat(t):
    if t.dim() != 1 or not t.is_contiguous():
        raise UnsupportedError(f"expected a contiguous 1-D storage, got shape {tuple(t.shape)}")
    # detach(): same storage, no autograd; masters have requires_grad=True and an in-place
    # write into them through the tensor DeepSpeed holds would be refused by autograd.
    return t.detach()


@dataclass
class LiveState:
    """One kind of a live engine's state: `.layout` (same on every rank), `.buffers` (this rank).

    `check()` re-validates at the safe boundary and raises `NotReadyError`: the engine is not
    destroyed, no training forward ran since the last step, storage identity (nothing replaced
    since describe: `load_checkpoint`, `offload_states`, an optimizer `load_state_dict`), the
    module's parameters (the same objects under the same names, their bf16/fp16 tensors still
    DeepSpeed's views) and readiness (moments exist, states are not offloaded, not mid
    gradient accumulation).
    `reasons()` returns the same findings as a list. Pass the LiveState itself as
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
    _geo: ZeroGeometry = field(repr=False)
    _identity: dict = field(repr=False)  # location -> identity tuple at describe time
    _tree: _ModuleTree = field(repr=False)
    _views: list = field(repr=False)  # [(name, param, address)]: geo.lp_views() at describe

    def reasons(self) -> list:
        """Local reasons this state must not be read or written now; [] when it may."""
        engine = self.engine
        if is_destroyed(engine):
            return [DESTROYED]
        reasons = _engine_reasons(engine)
        changed = self._tree.changed()
        if changed:
            reasons.append(
                f"{changed} since describe() (the described storage is no longer what the "
                "module reads): describe() again"
            )
        # offload_states() empties param.data: its own reason says what to do
        moved = [] if offload_reason(engine) else _moved_views(self._geo, self._views)
        if moved:
            reasons.append(
                f"the bf16/fp16 tensors of {moved[:8]} no longer view DeepSpeed's flat "
                "buffers (param.data / ds_tensor replaced?) since describe(): describe() again"
            )
        try:
            live = self._geo.live_tensors(self.kind)
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


def _engine_reasons(engine) -> list:
    """Reasons common to every kind: a training forward since the step, offloaded states,
    mid gradient accumulation."""
    reasons = []
    if watch_forwards(engine).forward_since_step():
        reasons.append(
            f"a forward with autograd enabled ran after the last engine.step() (micro step "
            f"{engine.micro_steps}): the safe boundary ends at the next training forward; "
            "use the state right after engine.step(), or call engine.step() first"
        )
    offloaded = offload_reason(engine)
    if offloaded:
        reasons.append(offloaded)
    gas = engine.gradient_accumulation_steps()
    managed = getattr(engine, "managed_gradient_accumulation", lambda: True)()
    if managed and engine.micro_steps % gas:
        reasons.append(
            f"mid gradient accumulation (micro step {engine.micro_steps}, "
            f"gradient_accumulation_steps={gas}): the safe boundary is right after "
            "engine.step() on an accumulation boundary"
        )
    return reasons


def offload_reason(engine) -> str | None:
    """Why the engine's states are not where DeepSpeed keeps them while training, or None.
    DeepSpeed 0.19.8 records `engine.offload_states()` in the ZeRO optimizer's
    `offloaded_states` (a set of OffloadStateTypeEnum) until `reload_states()`."""
    offloaded = getattr(engine.optimizer, "offloaded_states", None)
    if not offloaded:
        return None
    names = sorted(device_name(s) for s in offloaded)
    return (
        f"engine states {names} are offloaded (offload_states()): call "
        "engine.reload_states(), then describe() again"
    )


def describe(engine, kind: str, group=None) -> LiveState:
    """Describe one kind of a DeepSpeed engine's live ZeRO state.

    kind: "param" (bf16/fp16 params), "fp32" (master weights), "exp_avg", "exp_avg_sq".
    group: the process group the transfer will run over (default: the world). Storages are
    owned by ranks numbered in that group, which must contain the engine's data-parallel group.
    Call it on every rank of the engine's data-parallel group, at the safe boundary (after
    engine.step() on an accumulation boundary, before the next training forward). It
    communicates nothing; the layout is computed from structure every rank shares.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    geo = geometry_of(engine)
    # offload_states() moves the flats and unlinks the fp32 fragments: without this the
    # cross-check below would call it an unsupported DeepSpeed layout
    offloaded = offload_reason(engine)
    if offloaded:
        raise NotReadyError(offloaded)
    watch_forwards(engine)
    owners = _owner_ranks(geo.dp_ranks, group)
    tree = _ModuleTree(engine.module)
    views = geo.lp_views()
    moved = _moved_views(geo, views)
    if moved:
        raise UnsupportedError(
            f"the bf16/fp16 tensors of {moved[:8]} are not DeepSpeed's views into its flat "
            "buffers (param.data or ds_tensor replaced after deepspeed.initialize?): "
            "DeepSpeed's step() no longer updates what forward reads"
        )
    live = geo.live_tensors(kind)
    for u in range(len(geo.units)):
        geo.cross_check(kind, u, live[geo.location(u, geo.dp_rank)])
    buffers = {loc: _as_flat(t) for loc, t in live.items()}
    storages, runs = geo.placement(kind, owners, {loc: t.dtype for loc, t in buffers.items()})
    tensors = flat_layouts(runs)
    return LiveState(
        engine=engine,
        kind=kind,
        layout=rs.Layout(tensors, storages),
        buffers=buffers,
        dp_ranks=geo.dp_ranks,
        runs=runs,
        _geo=geo,
        _identity={loc: _identity(t) for loc, t in buffers.items()},
        _tree=tree,
        _views=views,
    )


def _owner_ranks(dp_ranks, group):
    """The data-parallel members' ranks as numbered in the transfer group."""
    if group is None or group is dist.group.WORLD:
        return list(dp_ranks)
    members = group_ranks(group)
    missing = [r for r in dp_ranks if r not in members]
    if missing:
        raise ValueError(
            f"the transfer group {members} lacks data-parallel ranks {missing} of the engine"
        )
    return [members.index(r) for r in dp_ranks]
