"""What the ZeRO families share: where each param of each kind lives, as rs.flat runs.

A family (ZeRO-1/2 in deepspeed_zero12.py, ZeRO-3 in deepspeed_zero3.py, the split DeepSpeed
makes between stage_1_and_2.py and stage3.py) reads its units from the optimizer's bookkeeping
and answers the same questions: how many elements a unit's storage of a kind holds, which
ranges of a param each rank's storage holds, the live tensor behind a storage, and whether
DeepSpeed's own per-param links agree. This base turns those answers into storages and runs.

Storage model: one storage per unit per data-parallel rank, location = unit * dp + dp_rank;
trainable units first (param groups / sub-groups), then one unit per frozen param ("param" kind
only). Padding is covered by no run, so a transfer never reads or writes it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import repeat
from typing import NamedTuple

import torch.distributed as dist

import reshard as rs
from reshard.errors import NotReadyError, UnsupportedError
from reshard.layout.builders import flat_batch

from .deepspeed_checks import applied_steps


@dataclass(frozen=True)
class Entry:
    """One param of a unit: its name, logical shape and start within the unit's flat."""

    param: object
    name: str
    shape: tuple
    offset: int


class Run(NamedTuple):
    """Elements [start, stop) of a param's row-major flattening, held by data-parallel rank
    `rank` at `offset` of its storage of the unit. A NamedTuple: a frozen dataclass cost
    ~0.5 us to build, and a ZeRO-3 model makes params x ranks of them per describe()."""

    rank: int
    start: int
    stop: int
    offset: int


def group_ranks(group) -> list:
    if group is None or group is dist.group.WORLD:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


def ds_version() -> str:
    try:
        import deepspeed

        return deepspeed.__version__
    except Exception:  # noqa: BLE001 - only for a message
        return "unknown"


def check_view(name, kind, view, base, expected_offset) -> None:
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
            f"{ds_version()} is not supported)"
        )


def flat_layouts(runs) -> dict:
    """{name: rs.flat(shape, runs)} of `ZeroGeometry.placement`'s runs, built all at once
    (`flat_batch`: the same layouts and errors, without ~100 numpy calls per param)."""
    built = flat_batch([shape for shape, _ in runs.values()], [r for _, r in runs.values()])
    return dict(zip(runs, built))


def shard_runs(numel, offset, world) -> list:
    """ZeRO-3 sharding of one param: rank r holds [r*p, (r+1)*p) at `offset` of its flat."""
    p = -(-numel // world)
    if not p:
        return []
    # a rank past the end (r * p >= numel) holds only padding: no run. Built in C loops
    # (map): describe() makes params x ranks of these
    stops = [*range(p, numel, p), numel]
    return list(map(Run, range(len(stops)), range(0, numel, p), stops, repeat(offset)))


class ZeroGeometry:
    """Engine structure common to every kind; a family subclass fills `units`.

    Subclasses define: `unit_label` (for messages), `storage_numel(kind, u)`,
    `runs(kind, u, entry)`, `unit_tensor(kind, u)`, `cross_check(kind, u, base)`,
    `lp_tensor(p)`, `frozen_shape(p)`, `frozen_tensor(p)`, `frozen_numel(numel)`,
    `frozen_runs(numel)`.
    """

    unit_label = "unit"

    def __init__(self, engine):
        self.engine = engine
        self.optimizer = engine.optimizer
        self.dp_ranks = group_ranks(getattr(engine, "seq_data_parallel_group", None))
        me = dist.get_rank()
        if me not in self.dp_ranks:
            raise UnsupportedError(
                f"rank {me} is not in the engine's data-parallel group {self.dp_ranks}"
            )
        self.dp_rank = self.dp_ranks.index(me)
        self.world = len(self.dp_ranks)
        self.names = {}  # id(param) -> name
        for name, p in engine.module.named_parameters():
            self.names.setdefault(id(p), name)
        self.units = self.read_units()  # [[Entry]] per trainable unit
        owned = {id(e.param) for entries in self.units for e in entries}
        # params the optimizer does not own; shared params are listed once
        self.frozen = [
            Entry(p, name, self.frozen_shape(p), 0)
            for name, p in engine.module.named_parameters()
            if id(p) not in owned
        ]

    # -- helpers for the families

    def check_group(self, group, what) -> None:
        if group_ranks(group) != self.dp_ranks:
            raise UnsupportedError(
                f"{what} is partitioned over ranks {group_ranks(group)}, not the data-parallel "
                f"group {self.dp_ranks} (MoE/AutoTP/MiCS layouts are not supported)"
            )

    def name_of(self, p) -> str:
        try:
            return self.names[id(p)]
        except KeyError:
            raise UnsupportedError(
                "the optimizer owns a parameter that engine.module.named_parameters() does not list"
            ) from None

    def moment(self, master, kind):
        """The base optimizer's `kind` state of fp32 storage `master`, or why it has none."""
        state = self.optimizer.optimizer.state.get(master)
        if state and kind in state:
            return state[kind]
        optimizer = type(self.optimizer.optimizer).__name__
        if state:  # the optimizer has stepped and keeps other state: `kind` will never appear
            raise UnsupportedError(
                f"{optimizer} keeps no {kind!r} state (its state keys: {sorted(state)}): use an "
                "Adam-family optimizer"
            )
        applied = applied_steps(self.engine)
        if applied > 0:  # a stateless optimizer (plain SGD): nothing after real steps
            raise UnsupportedError(
                f"{optimizer} keeps no {kind!r} state (no per-parameter state at all after "
                f"{applied} applied optimizer steps): use an Adam-family optimizer"
            )
        raise NotReadyError(
            f"{kind!r} does not exist yet: Adam moments are created by the first applied "
            "optimizer step (engine.step() on an accumulation boundary without overflow)"
        )

    def lp_views(self) -> list:
        """[(name, param, address)]: each trainable param and the address the geometry puts its
        bf16/fp16 tensor (`lp_tensor(param)`) at in its unit's "param" storage. A tensor moved
        off it (`param.data = ...`) is no longer the one DeepSpeed steps, and the described
        storage is no longer what forward reads."""
        out = []
        for u, entries in enumerate(self.units):
            base = self.unit_tensor("param", u)
            for e in entries:
                if math.prod(e.shape):
                    out.append((e.name, e.param, base.data_ptr() + e.offset * base.element_size()))
        return out

    def check_storage(self, kind, u, base) -> None:
        expected = self.storage_numel(kind, u)
        if base.numel() != expected:
            raise UnsupportedError(
                f"{self.unit_label} {u} ({kind}): live storage has {base.numel()} elements, "
                f"expected {expected} (unexpected DeepSpeed layout)"
            )

    # -- what describe() and LiveState use

    def location(self, unit, dp_rank) -> int:
        return unit * self.world + dp_rank

    def live_tensors(self, kind) -> dict:
        """{location: this rank's live storage of `kind`} (views, never copies)."""
        me = self.dp_rank
        out = {self.location(u, me): self.unit_tensor(kind, u) for u in range(len(self.units))}
        if kind == "param":
            base = len(self.units)
            for f, entry in enumerate(self.frozen):
                t = self.frozen_tensor(entry.param)
                if not t.is_contiguous():
                    raise UnsupportedError(f"frozen parameter {entry.name!r} is not contiguous")
                out[self.location(base + f, me)] = t.detach().view(-1)
        return out

    def placement(self, kind, owners, dtypes) -> tuple:
        """(storages {location: rs.Storage}, {name: (shape, [(location, start, stop, offset)])}).

        owners[r]: transfer-group rank of data-parallel rank r; dtypes: {location: dtype} of
        this rank's storages (every rank's storage of a unit has the same dtype).
        """
        storages, runs = {}, {}
        for u, entries in enumerate(self.units):
            dtype = dtypes[self.location(u, self.dp_rank)]
            for r in range(self.world):
                storages[self.location(u, r)] = rs.Storage(
                    owners[r], dtype, self.storage_numel(kind, u)
                )
            for e in entries:
                runs[e.name] = (e.shape, self._flat_runs(u, self.runs(kind, u, e)))
        if kind == "param":
            base = len(self.units)
            for f, e in enumerate(self.frozen):
                numel = math.prod(e.shape)
                dtype = dtypes[self.location(base + f, self.dp_rank)]
                for r in range(self.world):
                    storages[self.location(base + f, r)] = rs.Storage(
                        owners[r], dtype, self.frozen_numel(numel)
                    )
                runs[e.name] = (e.shape, self._flat_runs(base + f, self.frozen_runs(numel)))
        return storages, runs

    def _flat_runs(self, unit, runs) -> list:
        first = self.location(unit, 0)  # a unit's locations are consecutive, by dp rank
        return [(first + rank, start, stop, offset) for rank, start, stop, offset in runs]
