"""DTensor placement geometry: which global indices each mesh coordinate holds.

Pure functions of a DTensor's spec (global shape, mesh, placements) with DTensor's own
semantics (the placements are listed in `reshard.integrations.dtensor`), so every rank
derives the same `rs.Layout` without communicating. `dtensor.describe` and the FSDP2
integration (which cross-checks the placements against FSDP2's own sharding) both build on it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

import reshard as rs
from reshard.errors import UnsupportedError

__all__ = [
    "Entry",
    "PlacementOp",
    "build_layout",
    "check_group",
    "entry",
    "local_shape",
    "mesh_problem",
    "mesh_ranks",
    "placement_ops",
    "placement_problem",
    "plain_entry",
    "segments",
]


class PlacementOp(NamedTuple):
    """One placement as `segments` applies it: `kind` "shard" (torch.chunk of the current
    extent of tensor dim `dim` over mesh dim `mesh_dim`) or "strided" (first cut into
    `split_factor` chunks, each chunked over the mesh dim)."""

    mesh_dim: int
    kind: str
    dim: int
    split_factor: int


def _take(runs, a, b):
    """Positions [a, b) of a dim's local index sequence, given as (global_start, length) runs."""
    out, pos = [], 0
    for start, n in runs:
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


def _merge(runs):
    out = []
    for start, n in runs:
        if out and out[-1][0] + out[-1][1] == start:
            out[-1] = (out[-1][0], out[-1][1] + n)
        elif n:
            out.append((start, n))
    return out


def segments(shape, mesh_shape, coord, ops):
    """Per tensor dim, the (global_start, length) runs coordinate `coord` holds, in local order.

    ops: `PlacementOp`s in the order they apply (Replicate placements have none).
    """
    segs = [[(0, n)] for n in shape]
    for op in ops:
        parts, k, d = mesh_shape[op.mesh_dim], coord[op.mesh_dim], op.dim
        length = sum(n for _, n in segs[d])
        if op.kind == "shard":
            segs[d] = _take(segs[d], *_chunk(length, parts, k))
        else:
            picked = []
            for j in range(op.split_factor):
                a0, b0 = _chunk(length, op.split_factor, j)
                a, b = _chunk(b0 - a0, parts, k)
                picked += _take(segs[d], a0 + a, a0 + b)
            segs[d] = picked
    return [_merge(s) for s in segs]


def placement_ops(name, placements, ndim, strict=True):
    """DTensor placements -> the ops `segments` applies, left to right.

    Mesh dims are numbered as in `mesh_ranks` (dim 0: the mesh's instances), so placement i
    acts on mesh dim i + 1. A placement that stores no elements (Partial) raises
    UnsupportedError; with strict=False it is laid out like Replicate (its local tensor has
    the full extent there), for a caller that keeps no buffer for it and reports
    `placement_problem` instead.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    ops = []
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, _StridedShard):  # before Shard: keep the check order explicit
            ops.append(PlacementOp(mesh_dim + 1, "strided", p.dim % ndim, int(p.split_factor)))
        elif isinstance(p, Shard):
            ops.append(PlacementOp(mesh_dim + 1, "shard", p.dim % ndim, 1))
        elif isinstance(p, Replicate) or not strict:
            continue
        else:
            raise UnsupportedError(placement_problem(name, placements))
    return tuple(ops)


def placement_problem(name, placements):
    """Why `placements` cannot be read or written (a placement that stores no elements, e.g.
    Partial); None when they can."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    for mesh_dim, p in enumerate(placements):
        if not isinstance(p, (Shard, _StridedShard, Replicate)):  # no common base in torch 2.13
            return (
                f"{name!r}: placement {p!r} on mesh dim {mesh_dim} is not supported (reshard "
                "moves stored elements; a Partial value is not materialized on any rank): "
                "redistribute() it to Shard or Replicate first"
            )
    return None


def mesh_ranks(mesh):
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


def mesh_problem(name, ranks):
    """Why DTensors on a mesh with this rank table (`mesh_ranks`) cannot be laid out; None
    when they can: its ranks must increase along every mesh dim.

    Otherwise torch disagrees with itself about where the elements are: a mesh dim's process
    group orders its ranks by number, and torch 2.13's data movement (distribute_tensor,
    FSDP2's sharding, full_tensor) follows that order, while the DTensor spec's mesh
    coordinates (and torch's own compute_local_shape_and_global_offset) follow the mesh: on
    DeviceMesh([1, 0]) rank 0 holds the first chunk that its coordinate 1 says is rank 1's.
    The same on every rank (the mesh is)."""
    for d in range(1, ranks.ndim):
        if ranks.shape[d] > 1 and not bool((np.diff(ranks, axis=d) > 0).all()):
            return (
                f"{name!r}: device mesh {ranks[0].tolist()} does not number its ranks in "
                f"increasing order along mesh dim {d - 1}: torch places the shards by the "
                "order of that dim's process group (by rank number) while the DTensor's "
                "mesh coordinates say otherwise, so which rank holds which elements is "
                "ambiguous; build the mesh with ranks increasing along every dim (as "
                "init_device_mesh does)"
            )
    return None


@dataclass(frozen=True)
class Entry:
    """What the layout needs of one distributed tensor: pure data, the same on every rank."""

    name: str
    shape: tuple
    dtype: object
    mesh_ranks: np.ndarray  # global rank at each (instance, *mesh coordinate): mesh_ranks()
    ops: tuple  # PlacementOp, in the order they apply


def _rowmajor(shape):
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


def local_shape(segs):
    """The local tensor's shape: per dim, the total length of its runs."""
    return tuple(sum(n for _, n in s) for s in segs)


def _pieces(location, segs):
    """Pieces of one local tensor (row-major of its local shape) whose dims hold `segs`."""
    strides = _rowmajor(local_shape(segs))
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


def check_group(group) -> None:
    """TypeError unless `group` is None (the world) or a torch.distributed ProcessGroup;
    ValueError on a rank outside it."""
    import torch.distributed as dist

    if group is dist.GroupMember.NON_GROUP_MEMBER:  # what new_group() returns to the others
        raise ValueError(
            f"global rank {dist.get_rank()} is not a member of the process group it was given: "
            "only the group's members describe state for a transfer on that group"
        )
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"group must be None (the world) or a torch.distributed ProcessGroup, got "
            f"{type(group).__name__}"
        )


def _group_ranks(group):
    import torch.distributed as dist

    if group is None or group is dist.group.WORLD:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


def build_layout(entries, group):
    """Layout over `entries` plus, per entry, {location: mesh coordinate} of its storages."""
    import torch.distributed as dist

    members = None if group is None or group is dist.group.WORLD else _group_ranks(group)
    tensors, storages, where = {}, {}, []
    loc = 0
    for e in entries:
        mesh_shape = e.mesh_ranks.shape
        pieces, mine = [], {}
        for coord in np.ndindex(*mesh_shape):
            segs = segments(e.shape, mesh_shape, coord, e.ops)
            numel = int(np.prod(local_shape(segs), dtype=np.int64))
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


def entry(name, dt, ops=None, strict=True):
    """`dt`'s `Entry`; `ops` (default: its placements' `placement_ops`) overrides the geometry.
    strict=False: see `placement_ops`; a mesh with a `mesh_problem` is laid out by its
    coordinates, for a caller that reports the problem (strict: UnsupportedError)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(dt, DTensor):
        raise TypeError(f"{name!r} is a {type(dt).__name__}, not a DTensor")
    spec = dt._spec
    shape = tuple(dt.shape)
    if ops is None:
        ops = placement_ops(name, spec.placements, len(shape), strict)
    ranks = mesh_ranks(spec.mesh)
    if strict and (why := mesh_problem(name, ranks)):
        raise UnsupportedError(why)
    return Entry(name, shape, dt.dtype, ranks, tuple(ops))


def plain_entry(name, t):
    """An `Entry` for a plain tensor where a DTensor was expected: one storage of its shape on
    this rank. Only a stand-in that lets this rank plan (against a target of that shape)
    while its check() says why; the tensor has no buffer."""
    import torch.distributed as dist

    me = np.array([[dist.get_rank()]], dtype=np.int64)
    return Entry(name, tuple(t.shape), t.dtype, me, ())
