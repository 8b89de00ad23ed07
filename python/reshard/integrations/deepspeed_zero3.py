"""ZeRO-3 geometry (DeepSpeed's runtime/zero/stage3.py and partition_parameters.py, 0.19.8).

Unit = sub-group (`sub_group_size`), every kind: the concatenation of this rank's padded shards
of the sub-group's params (`fp16_partitioned_groups_flat[j]`, `fp32_partitioned_groups_flat[j]`,
its optimizer state). Rank r holds [r*p, (r+1)*p) of each param with p = ceil(numel / dp); the
padding is uninitialized and a rank may hold only padding. Frozen params: their `ds_tensor`.
"""

from __future__ import annotations

import math

from reshard.errors import UnsupportedError

from .deepspeed_geometry import Entry, ZeroGeometry, check_view, shard_runs


class Zero3Geometry(ZeroGeometry):
    unit_label = "sub-group"

    def read_units(self) -> list:
        opt = self.optimizer
        units, self.shard_numel = [], []
        for j, sub_group in enumerate(opt.fp16_groups):
            self.check_group(opt.sub_group_process_groups[j], f"sub-group {j}")
            entries, off = [], 0
            for p in sub_group:
                entries.append(Entry(p, self.name_of(p), tuple(p.ds_shape), off))
                off += int(p.partition_numel())
            units.append(entries)
            self.shard_numel.append(off)
        return units

    def storage_numel(self, kind, u) -> int:
        return self.shard_numel[u]

    def runs(self, kind, u, entry) -> list:
        return shard_runs(math.prod(entry.shape), entry.offset, self.world)

    def unit_tensor(self, kind, u):
        if kind == "param":
            t = self.optimizer.fp16_partitioned_groups_flat[u]
            if t is None:
                raise UnsupportedError(
                    f"sub-group {u} has no resident bf16 shard (parameters on NVMe): set "
                    "zero_optimization.offload_param.device to 'cpu' or 'none'"
                )
            return t
        master = self.optimizer.fp32_partitioned_groups_flat[u]
        return master if kind == "fp32" else self.moment(master, kind)

    def cross_check(self, kind, u, base) -> None:
        """The shard offsets against DeepSpeed's `grad_position` and `ds_tensor` views."""
        self.check_storage(kind, u, base)
        opt = self.optimizer
        for e in self.units[u]:
            pos = opt.grad_position.get(opt.get_param_id(e.param))
            if pos is not None and (int(pos[0]), int(pos[1])) != (u, e.offset):
                raise UnsupportedError(
                    f"{e.name!r}: DeepSpeed places it at sub-group {pos[0]} offset {pos[1]}, "
                    f"reshard computed {u}, {e.offset}"
                )
            if kind == "param":
                check_view(e.name, kind, e.param.ds_tensor, base, e.offset)

    def lp_tensor(self, p):
        return p.ds_tensor  # the shard; p.data is the gathered copy (or empty)

    def frozen_shape(self, p) -> tuple:
        if not hasattr(p, "ds_shape"):
            raise UnsupportedError(
                f"parameter {self.names.get(id(p), '?')!r} of engine.module is not partitioned "
                "by ZeRO-3 (added to the module after deepspeed.initialize?): every parameter "
                "must be one ZeRO-3 manages"
            )
        return tuple(p.ds_shape)

    def frozen_tensor(self, p):
        return p.ds_tensor

    def frozen_numel(self, numel) -> int:
        return -(-numel // self.world)

    def frozen_runs(self, numel) -> list:
        return shard_runs(numel, 0, self.world)
