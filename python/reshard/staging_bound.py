"""The staging bound: the bytes one rank's executor may hold for one plan.

Plain arithmetic on a rank's arena sizes, no torch. Planning states the bound with it
(`Plan.staging_bytes`) and staging sizes its arenas by it (`Staging`), so the bound and what
is allocated cannot drift apart. It sits below both so that planning never imports the
executor's staging module (data flows planning -> staging, not back).
"""

from __future__ import annotations

TRANSPORTS = ("nccl", "gloo")


def arenas_per_direction(num_rounds: int) -> int:
    """Two (round k+1 is packed and in flight while round k is), one with a single round."""
    return min(2, int(num_rounds))


def staging_bytes(
    num_rounds: int,
    send_arena_bytes: int,
    recv_arena_bytes: int,
    transport: str = "nccl",
    host_ring_bytes: int = 0,
) -> dict:
    """``{"device", "host_pinned", "host"}`` bytes of one rank's staging.

    ``arenas = arenas_per_direction(num_rounds) * (send_arena_bytes + recv_arena_bytes)``,
    where ``send_arena_bytes`` is the most this rank sends in one round (its packed
    messages, 16-byte aligned) and ``recv_arena_bytes`` likewise for what it receives. The
    arenas live on the transport's device: device memory under ``"nccl"`` (plus the pinned
    ring, ``host_ring_bytes``), host memory under ``"gloo"``.
    """
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be 'nccl' or 'gloo', got {transport!r}")
    arenas = arenas_per_direction(num_rounds) * (int(send_arena_bytes) + int(recv_arena_bytes))
    if transport == "nccl":
        return {"device": arenas, "host_pinned": int(host_ring_bytes), "host": 0}
    return {"device": 0, "host_pinned": 0, "host": arenas}
