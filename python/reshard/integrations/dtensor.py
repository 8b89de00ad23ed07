"""Live DTensors as a reshard Layout (docs/fsdp.md).

`describe({name: dtensor}, group=None)` says where every element of every DTensor lives across
the ranks of its device mesh, as an `rs.Layout` identical on every rank, plus this rank's local
tensors as 1-D views (never copies). The geometry is computed from each DTensor's spec (global
shape, mesh, placements) with DTensor's own semantics, so every rank derives it without
communication, and it is cross-checked against the shape of this rank's local tensor.

Placements (applied left to right over the mesh dims, as DTensor does):
- `Shard(d)`: the current local extent of dim d is cut into `torch.chunk` pieces (the last
  ranks may get fewer elements, or none);
- `_StridedShard(d, split_factor=sf)`: the extent is first cut into sf chunks, each of those into
  mesh-size chunks, and a rank holds its chunk of each, in order (FSDP2 composed with TP);
- `Replicate()`: every rank of that mesh dim holds the same elements (replicas);
- `Partial` and anything else: `UnsupportedError` naming the placement (the values are not
  materialized anywhere).

One storage per (tensor, mesh coordinate) with a non-empty local tensor. A local tensor may be
split into several pieces (a strided shard); each piece addresses the local tensor row-major.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

import reshard as rs
from reshard.errors import NotReadyError, UnsupportedError

__all__ = ["LiveDTensors", "describe"]


# ---------------------------------------------------------------------------------------------
# geometry: which global indices a mesh coordinate holds, per tensor dim


def _take(segments, a, b):
    """Positions [a, b) of a dim's local index sequence, given as (global_start, length) runs."""
    out, pos = [], 0
    for start, n in segments:
        lo, hi = max(a, pos), min(b, pos + n)
        if lo < hi:
            out.append((start + lo - pos, hi - lo))
        pos += n
    return out


def _chunk(length, parts, k):
    """torch.chunk's k-th of `parts` chunks of `length`: (begin, end), empty past the end."""
    size = -(-length // parts) if length else 0
    begin = min(k * size, length)
    return begin, min(begin + size, length)


def _merge(segments):
    out = []
    for start, n in segments:
        if out and out[-1][0] + out[-1][1] == start:
            out[-1] = (out[-1][0], out[-1][1] + n)
        elif n:
            out.append((start, n))
    return out


def _segments(shape, mesh_shape, coord, ops):
    """Per tensor dim, the (global_start, length) runs coordinate `coord` holds, in local order.

    ops: [(mesh_dim, kind, tensor_dim, split_factor)] in the order they apply; kind is "shard"
    or "strided" ("replicate" entries are left out by the caller).
    """
    segs = [[(0, n)] for n in shape]
    for mesh_dim, kind, d, sf in ops:
        parts, k = mesh_shape[mesh_dim], coord[mesh_dim]
        length = sum(n for _, n in segs[d])
        if kind == "shard":
            segs[d] = _take(segs[d], *_chunk(length, parts, k))
        else:
            picked = []
            for j in range(sf):
                a0, b0 = _chunk(length, sf, j)
                a, b = _chunk(b0 - a0, parts, k)
                picked += _take(segs[d], a0 + a, a0 + b)
            segs[d] = picked
    return [_merge(s) for s in segs]


def _placement_ops(name, placements, ndim):
    """DTensor placements -> the ops `_segments` applies, left to right.

    Mesh dims are numbered as in `_mesh_ranks` (dim 0: the mesh's instances), so placement i
    acts on mesh dim i + 1.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    ops = []
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, _StridedShard):  # before Shard: keep the check order explicit
            ops.append((mesh_dim + 1, "strided", p.dim % ndim, int(p.split_factor)))
        elif isinstance(p, Shard):
            ops.append((mesh_dim + 1, "shard", p.dim % ndim, 1))
        elif isinstance(p, Replicate):
            continue
        else:
            raise UnsupportedError(
                f"{name!r}: placement {p!r} on mesh dim {mesh_dim} is not supported (reshard "
                "moves stored elements; a Partial value is not materialized on any rank): "
                "redistribute() it to Shard or Replicate first"
            )
    return tuple(ops)


def _mesh_ranks(mesh):
    """Global ranks of every instance of `mesh`: shape (instances, *mesh.shape).

    A mesh sliced from a larger one (`mesh["dp"]` of a dp x tp mesh) has one instance per
    coordinate of the dims sliced away, and `mesh.mesh` shows only this rank's; a DTensor on
    it is taken as replicated over the instances (as FSDP x TP and DDP x TP keep the tensors
    their TP dim does not shard). Every rank derives the same table without communicating.
    """
    shape = tuple(mesh.mesh.shape)
    layout, rank_map = getattr(mesh, "_layout", None), getattr(mesh, "_rank_map", None)
    if layout is None or rank_map is None:
        import torch.distributed as dist

        if mesh.mesh.numel() != dist.get_world_size():
            raise UnsupportedError(
                "a DTensor on a sliced device mesh needs torch's DeviceMesh._layout (torch >= "
                "2.9) to know the mesh's other instances"
            )
        return mesh.mesh.reshape(1, *shape).cpu().numpy().astype(np.int64)
    full = layout.remap_to_tensor(rank_map).reshape(-1, *shape)
    mine = mesh.mesh
    if not any(bool((row == mine).all()) for row in full):
        raise UnsupportedError(
            f"device mesh {mine.tolist()} is not one of its layout's instances {full.tolist()}"
        )
    return full.cpu().numpy().astype(np.int64)


@dataclass(frozen=True)
class _Entry:
    """What the layout needs of one distributed tensor: pure data, the same on every rank."""

    name: str
    shape: tuple
    dtype: object
    mesh_ranks: np.ndarray  # global rank at each (instance, *mesh coordinate): _mesh_ranks
    ops: tuple


def _rowmajor(shape):
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


def _local_shape(segs):
    return tuple(sum(n for _, n in s) for s in segs)


def _pieces(location, segs):
    """Pieces of one local tensor (row-major of its local shape) whose dims hold `segs`."""
    strides = _rowmajor(_local_shape(segs))
    per_dim = []
    for s in segs:
        runs, pos = [], 0
        for start, n in s:
            runs.append((pos, start, n))
            pos += n
        per_dim.append(runs)
    out = []
    for combo in itertools.product(*per_dim):
        offset = sum(st * local for st, (local, _, _) in zip(strides, combo, strict=True))
        out.append(
            rs.Piece(
                location,
                offset,
                tuple(start for _, start, _ in combo),
                tuple(n for _, _, n in combo),
                strides,
            )
        )
    return out


def _group_ranks(group):
    import torch.distributed as dist

    if group is None or group is dist.group.WORLD:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


def _build(entries, group):
    """Layout over `entries` plus, per entry, {location: mesh coordinate} of its storages."""
    import torch.distributed as dist

    members = None if group is None or group is dist.group.WORLD else _group_ranks(group)
    tensors, storages, where = {}, {}, []
    loc = 0
    for e in entries:
        mesh_shape = e.mesh_ranks.shape
        pieces, mine = [], {}
        for coord in np.ndindex(*mesh_shape):
            segs = _segments(e.shape, mesh_shape, coord, e.ops)
            numel = int(np.prod(_local_shape(segs), dtype=np.int64))
            if numel == 0:
                continue
            rank = int(e.mesh_ranks[coord])
            if members is not None:
                if rank not in members:
                    raise ValueError(
                        f"{e.name!r}: mesh rank {rank} is not in the transfer group {members}"
                    )
                rank = members.index(rank)
            storages[loc] = rs.Storage(rank, e.dtype, numel)
            pieces += _pieces(loc, segs)
            mine[loc] = coord
            loc += 1
        tensors[e.name] = rs.TensorLayout(e.shape, pieces)
        where.append(mine)
    return rs.Layout(tensors, storages), where


# ---------------------------------------------------------------------------------------------
# live storage


def _identity(t):
    return (t.data_ptr(), t.untyped_storage().data_ptr(), t.numel(), t.dtype, str(t.device))


def _local_view(name, local, want_shape):
    """This rank's local tensor as a 1-D view of its live storage (detached: no autograd)."""
    if tuple(local.shape) != tuple(want_shape):
        raise UnsupportedError(
            f"{name!r}: local tensor has shape {tuple(local.shape)}, but its DTensor spec "
            f"places {tuple(want_shape)} on this rank"
        )
    if not local.is_contiguous():
        raise UnsupportedError(
            f"{name!r}: local tensor is not contiguous (strides {tuple(local.stride())})"
        )
    return local.detach().view(-1)


def _entry(name, dt, ops=None):
    from torch.distributed.tensor import DTensor

    if not isinstance(dt, DTensor):
        raise UnsupportedError(f"{name!r} is a {type(dt).__name__}, not a DTensor")
    spec = dt._spec
    shape = tuple(dt.shape)
    if ops is None:
        ops = _placement_ops(name, spec.placements, len(shape))
    return _Entry(name, shape, dt.dtype, _mesh_ranks(spec.mesh), tuple(ops))


def _mine(entries, where):
    """[(entry index, location, local shape)] of the storages this rank owns."""
    import torch.distributed as dist

    me = dist.get_rank()
    out = []
    for i, (e, locs) in enumerate(zip(entries, where, strict=True)):
        for loc, coord in locs.items():
            if int(e.mesh_ranks[coord]) == me:
                segs = _segments(e.shape, e.mesh_ranks.shape, coord, e.ops)
                out.append((i, loc, _local_shape(segs)))
    return out


def _views(entries, mine, locals_):
    """{location: view} of this rank's storages: `locals_[i]` is entry i's local tensor."""
    return {loc: _local_view(entries[i].name, locals_[i], shape) for i, loc, shape in mine}


# ---------------------------------------------------------------------------------------------
# the public object


@dataclass
class LiveDTensors:
    """Live distributed tensors: `.layout` (same on every rank), `.buffers` (this rank's views).

    `check()` raises `NotReadyError` when a described storage was replaced since `describe()`
    (or, for a framework's state, is not ready); `reasons()` returns the findings as a list.
    Pass the object itself as `src_buffers` / `dst_buffers` and preflight runs `check()` on
    every rank.
    """

    layout: object  # rs.Layout
    buffers: dict  # {location: live 1-D view of this rank's storage}
    what: str  # named in error messages
    _resolve: object = field(repr=False)  # () -> {location: live view}, raises when not ready
    _identity: dict = field(repr=False)  # location -> identity tuple at describe time

    def reasons(self) -> list:
        """Local reasons this state must not be read or written now; [] when it may."""
        try:
            live = self._resolve()
        except (NotReadyError, UnsupportedError) as exc:
            return [str(exc)]
        replaced = sorted(
            loc
            for loc, ident in self._identity.items()
            if loc not in live or _identity(live[loc]) != ident
        )
        if replaced:
            return [
                f"storage replaced since describe() at locations {replaced} (load_state_dict, "
                "a new tensor assigned?): describe() again"
            ]
        return []

    def check(self) -> None:
        """Raise NotReadyError naming every reason this state must not be used now."""
        reasons = self.reasons()
        if reasons:
            raise NotReadyError(f"{self.what} not ready: " + "; ".join(reasons))


def _live(what, entries, locals_fn, group):
    layout, where = _build(entries, group)
    mine = _mine(entries, where)
    buffers = _views(entries, mine, locals_fn())
    return LiveDTensors(
        layout=layout,
        buffers=buffers,
        what=what,
        _resolve=lambda: _views(entries, mine, locals_fn()),
        _identity={loc: _identity(t) for loc, t in buffers.items()},
    )


def describe(dtensors, group=None) -> LiveDTensors:
    """Describe DTensors by name: where each element lives on the ranks of its device mesh.

    Call it on every rank of the transfer group with the same names and DTensor specs (the
    layout is computed from the specs; nothing is communicated). `group`: the process group
    the transfer runs over (default: the world); storages are owned by ranks numbered in it,
    so it must contain every rank of every mesh. Raises `UnsupportedError` for `Partial` and
    other placements that do not store elements.
    """
    if not hasattr(dtensors, "items"):
        raise TypeError(f"describe() takes a {{name: DTensor}} mapping, got {type(dtensors)}")
    items = sorted(dtensors.items())
    entries = [_entry(name, dt) for name, dt in items]
    return _live("DTensors", entries, lambda: [dt._local_tensor for _, dt in items], group=group)
