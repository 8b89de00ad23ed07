"""Staging memory: the arenas and the pinned ring one rank holds for one plan.

Two arenas per direction (round k+1 is packed and in flight while round k is), each as large as
the largest round's packed messages in that direction, on the transport's device (host memory
under gloo, device memory under NCCL); plus, when CPU buffers meet CUDA ones, one pinned ring
for the stage_h2d / stage_d2h ops (and the device slots those ops may take). The bound they
must stay within is `staging_bound.staging_bytes` (what `Plan.staging_bytes` states); the
executor checks it on every allocation.
Allocated on first use, reused by every later call: repeated syncs allocate nothing.
"""

from __future__ import annotations

import torch

from .report import STAGING_KINDS
from .rounds import RECV, SEND
from .staging_bound import arenas_per_direction

# Largest pinned ring of the stage ops. Bounced (pageable or cast) CPU<->GPU copies reach the
# PCIe ceiling only with chunks large enough to hide the per-chunk host fork/join and event
# wait (benchmarks/gpu_bench.py --only ring); a 64 MiB ring gives four 16 MiB slots.
RING_MAX_BYTES = 64 << 20
RING_MIN_BYTES = 4096


def ring_bytes(budget_bytes_per_peer) -> int:
    """The pinned ring: the per-peer budget clamped to [4 KiB, 64 MiB], a multiple of 16."""
    budget = RING_MAX_BYTES if budget_bytes_per_peer is None else int(budget_bytes_per_peer)
    return max(RING_MIN_BYTES, min(budget, RING_MAX_BYTES)) // 16 * 16


class Staging:
    """The arenas (two per direction, or one with a single round) and the ring of one rank."""

    def __init__(self, device: torch.device, num_rounds: int):
        self.device = device
        self.nbuf = arenas_per_direction(num_rounds)
        self.arenas = None  # {SEND: [tensor, ...], RECV: [...]} once allocated
        self.ring = None  # pinned uint8 tensor of the stage ops
        self._stage_device = (0, 0)  # (ring bytes, stage_device_bytes for that ring)

    def allocate_arenas(self, send_bytes: int, recv_bytes: int) -> None:
        self.arenas = {
            SEND: [self._alloc(send_bytes, False) for _ in range(self.nbuf)],
            RECV: [self._alloc(recv_bytes, False) for _ in range(self.nbuf)],
        }

    def allocate_ring(self, nbytes: int) -> None:
        if self.ring is None:
            self.ring = self._alloc(nbytes, True)

    def arena(self, side: str, round_index: int) -> torch.Tensor:
        """Round k uses arena k % 2 of its direction."""
        return self.arenas[side][round_index % 2]

    @property
    def allocations(self) -> int:
        """How many staging tensors are held (constant once allocated)."""
        return sum(len(v) for v in (self.arenas or {}).values()) + (self.ring is not None)

    def held(self) -> dict:
        held = dict.fromkeys(STAGING_KINDS, 0)
        kind = "device" if self.device.type == "cuda" else "host"
        for arenas in (self.arenas or {}).values():
            held[kind] += sum(a.numel() for a in arenas)
        if self.ring is not None:
            held["host_pinned"] += self.ring.numel()
            held["device"] += self.stage_device_bytes()
        return held

    def stage_device_bytes(self) -> int:
        """Device staging one stage_h2d/stage_d2h call may take with this ring (the ring's
        slots mirrored on the device; none when the device side is a packed arena segment).
        Counted in both the bound and the held bytes while the ring exists."""
        if self.ring is None:
            return 0
        n = self.ring.numel()
        if self._stage_device[0] != n:  # once per ring, not three times per call
            got = torch.ops.reshard.stage_device_bytes(n) if torch.cuda.is_available() else 0
            self._stage_device = (n, int(got))
        return self._stage_device[1]

    def _alloc(self, nbytes: int, pinned: bool) -> torch.Tensor:
        if pinned:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
