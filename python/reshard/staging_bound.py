"""The staging bound: the bytes one rank's executor may hold for one plan.

Plain arithmetic on a rank's arena sizes (and, for a Stream's bound, its descriptor tables'
rows), no torch. Planning states the bound with it (`Plan.staging_bytes`) and staging sizes
its arenas by it (`Staging`), so the bound and what is allocated cannot drift apart. It sits below both so that planning never imports the
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


# The executor's descriptor tables: one row of six int64 per copy run; the CUDA ops keep a
# device copy of each table they read, with an int64 prefix sum per row (and one more).
DESC_ROW_BYTES = 48
PREFIX_ROW_BYTES = 8
# The CUDA caching allocator hands out multiples of this (its smallest block): a table of a
# few rows costs a whole block per device tensor.
CUDA_BLOCK_BYTES = 512
COMPACT_MAX_RUN_BYTES = 65536  # RS_COMPACT_MAX_RUN_BYTES


def cuda_block(nbytes: int) -> int:
    """`nbytes` as the caching allocator allocates it (rounded up to whole blocks)."""
    return -(-int(nbytes) // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES


def device_table_bytes(rows: int, read_bytes: int) -> int:
    """The most device memory the CUDA ops' table cache keeps for one descriptor table of `rows`
    runs whose copy reads `read_bytes`: its copy and prefix sums, a stage op's split of them
    (the rows it moves through the ring), and the compact form copy_runs may build (at most
    max(56 * rows + 8, read_bytes / 16) bytes, and only where a run reads at most 64 KiB on
    average: csrc/cuda/reshard_cuda.h), each in whole blocks."""
    rows = int(rows)
    copy = cuda_block(DESC_ROW_BYTES * rows) + cuda_block(PREFIX_ROW_BYTES * (rows + 1))
    # built only for tables averaging at most COMPACT_MAX_RUN_BYTES read per run
    read = min(int(read_bytes), COMPACT_MAX_RUN_BYTES * rows)
    compact = max((DESC_ROW_BYTES + PREFIX_ROW_BYTES) * rows + 8, read // 16)
    return 2 * copy + cuda_block(compact)
