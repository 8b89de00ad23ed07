"""Live DTensors as a reshard Layout (docs/fsdp.md).

`describe({name: dtensor}, group=None)` says where every element of every DTensor lives across
the ranks of its device mesh, as an `rs.Layout` identical on every rank, plus this rank's local
tensors as 1-D views (never copies). The geometry is computed from each DTensor's spec (global
shape, mesh, placements) with DTensor's own semantics, so every rank derives it without
communication. This rank's local tensors are cross-checked against it (shape, contiguity) by
`check()`, not by `describe()`: only this rank sees them, and the transfer's preflight runs
`check()` on every rank, so every rank refuses together.

Placements (applied left to right over the mesh dims, as DTensor does):
- `Shard(d)`: the current local extent of dim d is cut into `torch.chunk` pieces (the last
  ranks may get fewer elements, or none);
- `_StridedShard(d, split_factor=sf)`: the extent is first cut into sf chunks, each of those into
  mesh-size chunks, and a rank holds its chunk of each, in order (FSDP2 composed with TP);
- `Replicate()`: every rank of that mesh dim holds the same elements (replicas);
- `Partial` and anything else: a `check()` reason naming the placement (the values are not
  materialized anywhere), laid out like `Replicate` with no buffer, so that the peers (which
  may hold it otherwise placed) plan alike and every rank's preflight refuses.
A mesh whose ranks do not increase along every mesh dim is a `check()` reason too
(`dtensor_geometry.mesh_problem`: torch's data and its coordinates disagree there).

One storage per (tensor, mesh coordinate) with a non-empty local tensor. A local tensor may be
split into several pieces (a strided shard); each piece addresses the local tensor row-major.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

from reshard._ops import facts_key
from reshard.errors import NotReadyError, UnsupportedError

from .dtensor_geometry import (
    build_layout,
    check_group,
    entry,
    local_shape,
    mesh_problem,
    placement_problem,
    plain_entry,
    segments,
)

__all__ = ["LiveDTensors", "describe", "describe_entries"]


# ---------------------------------------------------------------------------------------------
# live storage


def _identity(t):
    return (t.data_ptr(), t.untyped_storage().data_ptr(), t.numel(), t.dtype, str(t.device))


def _local_problem(name, local, want_shape):
    """Why this rank's local tensor cannot be viewed as its storage; None when it can.

    Only this rank sees it: `check()` reports it, so that the transfer's preflight refuses on
    every rank (a raise in describe() would leave the peers waiting in the transfer)."""
    if tuple(local.shape) != tuple(want_shape):
        return (
            f"{name!r}: local tensor has shape {tuple(local.shape)}, but its DTensor spec "
            f"places {tuple(want_shape)} on this rank"
        )
    if not local.is_contiguous():
        return f"{name!r}: local tensor is not contiguous (strides {tuple(local.stride())})"
    return None


def _mine(entries, where):
    """[(entry index, location, local shape)] of the storages this rank owns."""
    import torch.distributed as dist

    me = dist.get_rank()
    out = []
    for i, (e, locs) in enumerate(zip(entries, where, strict=True)):
        for loc, coord in locs.items():
            if int(e.mesh_ranks[coord]) == me:
                segs = segments(e.shape, e.mesh_ranks.shape, coord, e.ops)
                out.append((i, loc, local_shape(segs)))
    return out


def _views(entries, mine, locals_):
    """({location: view}, [problem]) of this rank's storages: `locals_[i]` is entry i's local
    tensor; a view is a 1-D view of its live storage (detached: no autograd). A local tensor
    with a problem has no view, nor has None (a tensor this rank lacks: its readiness reasons
    say why)."""
    views, problems = {}, []
    for i, loc, shape in mine:
        local = locals_[i]
        if local is None:
            continue
        why = _local_problem(entries[i].name, local, shape)
        if why is None:
            views[loc] = local.detach().view(-1)
        else:
            problems.append(why)
    return views, problems


_SHAPE = operator.attrgetter("shape")


def _locals_key(locals_, mine) -> tuple | None:
    """Everything `_views` and `_identity` read of this rank's local tensors (address, storage
    address, shape, contiguity, dtype, device: `_ops.facts_key` and the shapes), without
    building views: equal keys give equal views. None when a local is not a plain tensor."""
    try:
        # an entry has at most one storage on a rank, so as many as entries: every one, in order
        ts = locals_ if len(mine) == len(locals_) else [locals_[i] for i, _, _ in mine]
        facts = facts_key(ts)
        return None if facts is None else (facts, tuple(map(_SHAPE, ts)))
    except Exception:  # noqa: BLE001 - not a list of tensors: the views say why
        return None


# ---------------------------------------------------------------------------------------------
# the public object


@dataclass
class LiveDTensors:
    """Live distributed tensors: `.layout` (same on every rank), `.buffers` (this rank's views).

    `check()` raises `NotReadyError` when a described storage was replaced since `describe()`
    (or, for a framework's state, is not ready); `reasons()` returns the findings as a list.
    Pass the object itself as `src_buffers` / `dst_buffers` and preflight runs `check()` on
    every rank: it compares what the views are made of (`_locals_key`) with what it was at
    `describe()` and builds views only when that differs, to say what changed.
    """

    layout: object  # rs.Layout
    buffers: dict  # {location: live 1-D view of this rank's storage}
    what: str  # named in error messages
    _entries: list = field(repr=False)
    _mine: list = field(repr=False)  # _mine(): this rank's (entry index, location, shape)
    # () -> (every entry's local tensor or None, [readiness reason]); raises only when the
    # state can no longer be read at all
    _locals: object = field(repr=False)
    _identity: dict = field(repr=False)  # location -> identity tuple at describe time
    _key: tuple | None = field(repr=False)  # _locals_key at describe time
    _problems: list = field(repr=False, default_factory=list)  # _views' at describe time
    # what this rank's own state chose of the layout where its peers' may differ (e.g. which
    # parameters have optimizer state): not faults, but when the plans' fingerprints differ
    # they say how this rank's layout came to be
    notes: list = field(default_factory=list)
    # which state the tensors are ("param", "exp_avg"; None: unnamed): the preflight refuses
    # two calls of one plan that pair up across ranks while moving different kinds
    kind: str | None = None

    def reasons(self) -> list:
        """Local reasons this state must not be read or written now; [] when it may."""
        try:
            locals_, not_ready = self._locals()
            if self._key is not None and _locals_key(locals_, self._mine) == self._key:
                # equal keys: the same views, the same problems
                return [*not_ready, *self._problems]
            live, problems = _views(self._entries, self._mine, locals_)
        except (NotReadyError, UnsupportedError) as exc:
            return [str(exc)]
        problems = [*not_ready, *problems]
        replaced = sorted(
            loc
            for loc in self._identity.keys() | live.keys()
            if loc not in live
            or loc not in self._identity
            or _identity(live[loc]) != self._identity[loc]
        )
        if replaced:
            problems.append(
                f"storage replaced since describe() at locations {replaced} (load_state_dict, "
                "a new tensor assigned?): describe() again"
            )
        return problems

    def check(self) -> None:
        """Raise NotReadyError naming every reason this state must not be used now."""
        reasons = self.reasons()
        if reasons:
            raise NotReadyError(f"{self.what} not ready: " + "; ".join(reasons))


def describe_entries(what, entries, locals_fn, group=None, notes=(), kind=None):
    """A LiveDTensors over `entries`; `locals_fn()` returns (every entry's local tensor now,
    None where this rank has none, and the reasons the state is not usable now). kind: the
    object's `.kind`.

    What only this rank can see is never raised here: a raise on one rank would leave its
    peers waiting in the transfer. It is kept as a reason that `check()` raises, so the
    transfer's preflight refuses on every rank with the same message."""
    layout, where = build_layout(entries, group)
    mine = _mine(entries, where)
    locals_, _ = locals_fn()
    buffers, problems = _views(entries, mine, locals_)
    return LiveDTensors(
        layout=layout,
        buffers=buffers,
        what=what,
        _entries=entries,
        _mine=mine,
        _locals=locals_fn,
        _identity={loc: _identity(t) for loc, t in buffers.items()},
        _key=_locals_key(locals_, mine),
        _problems=problems,
        notes=list(notes),
        kind=kind,
    )


def describe(dtensors, group=None, kind=None) -> LiveDTensors:
    """Describe DTensors by name: where each element lives on the ranks of its device mesh.

    Call it on every rank of the transfer group with the same names and DTensor specs (the
    layout is computed from the specs; nothing is communicated). `group`: the process group
    the transfer runs over (default: the world); storages are owned by ranks numbered in it,
    so it must contain every rank of every mesh. What may differ between ranks is not raised
    here but by `check()`, which the transfer's preflight runs on every rank, so every rank
    refuses: a local tensor wrong (not contiguous, another shape than its spec places here),
    a placement that stores no elements (`Partial`), a mesh numbering its ranks out of order,
    a plain tensor where a DTensor belongs.
    A value that is not a tensor at all raises TypeError.

    `kind`: which state the tensors are (a name such as "exp_avg"; default None, unnamed), the
    result's `.kind`. Two Transfers of one plan moving differently named states, called in
    another order on another rank, are then refused by their preflight instead of pairing up.
    """
    if not hasattr(dtensors, "items"):
        raise TypeError(f"describe() takes a {{name: DTensor}} mapping, got {type(dtensors)}")
    if kind is not None and not isinstance(kind, str):
        raise TypeError(f"kind must be a str or None, got {type(kind).__name__} {kind!r}")
    check_group(group)
    bad = [name for name in dtensors if not isinstance(name, str)]
    if bad:
        raise TypeError(f"DTensor names must be str, got {bad[:8]!r}")
    import torch
    from torch.distributed.tensor import DTensor

    items = sorted(dtensors.items(), key=operator.itemgetter(0))
    entries, usable, problems = [], [], []
    for name, dt in items:
        # A plain tensor or a Partial placement where the peers may hold a usable DTensor (a
        # rank-dependent path replaced it): raising here alone would leave the peers waiting
        # in the transfer. Laid out as well as this rank can (a plain tensor: its shape on
        # this rank), with no buffer and a reason, so every rank's preflight refuses.
        if isinstance(dt, DTensor):
            entries.append(entry(name, dt, strict=False))
            why = placement_problem(name, dt._spec.placements)
            why = why or mesh_problem(name, entries[-1].mesh_ranks)
        elif isinstance(dt, torch.Tensor):
            why = f"{name!r} is a {type(dt).__name__}, not a DTensor, on this rank"
            entries.append(plain_entry(name, dt))
        else:  # nothing to lay out: a program error, not a state one rank alone reached
            raise TypeError(f"{name!r} is a {type(dt).__name__}, not a DTensor")
        usable.append(dt if why is None else None)
        if why is not None:
            problems.append(why)

    def locals_():
        return [None if dt is None else dt._local_tensor for dt in usable], problems

    return describe_entries("DTensors", entries, locals_, group=group, kind=kind)
