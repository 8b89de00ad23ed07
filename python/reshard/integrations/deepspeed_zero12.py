"""ZeRO-1/2 geometry (DeepSpeed's runtime/zero/stage_1_and_2.py, read against 0.19.8).

Unit = param group. "param": the whole padded bit16 flat `bit16_groups_flat[i]`, which every
rank holds in full after step(), so each param is a dp-fold replica. fp32 / moments: this rank's
equal chunk of that flat (`single_partition_of_fp32_groups[i]`, its optimizer state); a param
may straddle chunks. Frozen params: the full tensor on every rank.
"""

from __future__ import annotations

import math

from reshard.errors import UnsupportedError

from .deepspeed_geometry import Entry, Run, ZeroGeometry, check_view


class Zero12Geometry(ZeroGeometry):
    unit_label = "param group"

    def read_units(self) -> list:
        opt = self.optimizer
        units, self.partition_numel, self.flat_numel = [], [], []
        for i in range(len(opt.bit16_groups)):
            self.check_group(opt.real_dp_process_group[i], f"param group {i}")
            n = opt.bit16_groups_flat[i].numel()
            if n % self.world or opt.partition_size[i] != n // self.world:
                raise UnsupportedError(
                    f"param group {i}: flat buffer of {n} elements is not {self.world} equal "
                    f"partitions of {opt.partition_size[i]} (unexpected DeepSpeed layout)"
                )
            # round_robin_bit16_groups equals bit16_groups (round-robin is refused); the meta
            # tensors keep shapes even while offload_states() has emptied param.data.
            units.append(
                [
                    Entry(p, self.name_of(p), tuple(meta.shape), int(off))
                    for p, meta, off in zip(
                        opt.round_robin_bit16_groups[i],
                        opt.round_robin_bit16_meta[i],
                        opt.round_robin_bit16_offsets[i],
                        strict=True,
                    )
                ]
            )
            self.partition_numel.append(n // self.world)
            self.flat_numel.append(n)
        return units

    def storage_numel(self, kind, u) -> int:
        return self.flat_numel[u] if kind == "param" else self.partition_numel[u]

    def runs(self, kind, u, entry) -> list:
        numel = math.prod(entry.shape)
        if kind == "param":  # full replicas
            return [Run(r, 0, numel, entry.offset) for r in range(self.world)]
        # a param at [off, off+numel) of a flat cut into `world` chunks of `part`
        off, part, out = entry.offset, self.partition_numel[u], []
        for r in range(self.world):
            lo, hi = max(off, r * part), min(off + numel, (r + 1) * part)
            if lo < hi:
                out.append(Run(r, lo - off, hi - off, lo - r * part))
        return out

    def unit_tensor(self, kind, u):
        if kind == "param":
            return self.optimizer.bit16_groups_flat[u]
        master = self.optimizer.single_partition_of_fp32_groups[u]
        return master if kind == "fp32" else self.moment(master, kind)

    def cross_check(self, kind, u, base) -> None:
        """The partition geometry against DeepSpeed's param views / `_hp_mapping` fragments."""
        self.check_storage(kind, u, base)
        for e in self.units[u]:
            if kind == "param":
                if e.param.data.numel():  # offload_states() empties param.data
                    check_view(e.name, kind, e.param.data, base, e.offset)
                continue
            mapping = getattr(e.param, "_hp_mapping", None)
            mine = [x for x in self.runs(kind, u, e) if x.rank == self.dp_rank]
            if (mapping is None) != (not mine):
                raise UnsupportedError(
                    f"{e.name!r}: DeepSpeed's fp32 link disagrees with the partition geometry"
                )
            if mine:
                x, hp, lp = mine[0], mapping.hp_fragment_address, mapping.lp_fragment_address
                if (hp.start, hp.numel, lp.start) != (x.offset, x.stop - x.start, x.start):
                    raise UnsupportedError(
                        f"{e.name!r}: DeepSpeed maps fragment lp[{lp.start}:+{lp.numel}] to "
                        f"hp[{hp.start}], reshard computed lp[{x.start}:{x.stop}] at {x.offset}"
                    )

    def lp_tensor(self, p):
        return p  # its .data views the group's flat

    def frozen_shape(self, p) -> tuple:
        return tuple(p.shape)

    def frozen_tensor(self, p):
        return p.data

    def frozen_numel(self, numel) -> int:
        return numel

    def frozen_runs(self, numel) -> list:
        return [Run(r, 0, numel, 0) for r in range(self.world)]
