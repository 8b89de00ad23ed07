"""Workers for test_spawn.py (module level: the spawn context re-imports them)."""

import time

import torch
import torch.distributed as dist


def w_sum(rank, world, x):
    t = torch.tensor([float(rank + x)])
    dist.all_reduce(t)
    return {"rank": rank, "world": world, "sum": float(t), "backend": dist.get_backend()}


def w_raise(rank, world):
    if rank == 1:
        raise ValueError("bad thing on rank 1")
    return rank


def w_skip(rank, world):
    import pytest

    pytest.skip("needs something this machine lacks")


def w_die(rank, world):
    from tests._spawn import die

    if rank == 1:
        die()
    return rank


def w_hang(rank, world):
    if rank == 1:
        time.sleep(60)
    return rank
