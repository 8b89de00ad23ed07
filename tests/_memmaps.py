"""Memory the process may not write, for the read-only target and destination tests: numpy
memmaps of a file, pages made read-only, a file mapped read-only at a chosen address."""

from __future__ import annotations

import ctypes
import mmap
import os
import pathlib
import warnings

import numpy as np
import pytest
import torch

needs_memory_map = pytest.mark.skipif(
    not os.path.exists("/proc/self/maps"), reason="no memory map to look writability up in"
)


def mapped(path, mode, n, value, dtype=np.float32) -> torch.Tensor:
    """A tensor over a numpy memmap of `path` (made with `value`s first if absent) opened with
    `mode`: 'r' maps it read-only, 'c' copy-on-write, 'r+' shared writable."""
    path = pathlib.Path(path)
    if not path.exists():
        np.memmap(path, dtype, "w+", shape=(n,))[:] = value
    with warnings.catch_warnings():  # torch warns that it cannot protect a read-only array
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.memmap(path, dtype, mode, shape=(n,)))


def libc():
    lib = ctypes.CDLL(None, use_errno=True)
    lib.mmap.restype = ctypes.c_void_p
    lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, *[ctypes.c_int] * 3, ctypes.c_long]
    lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    lib.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return lib


def protect_read_only(address: int, nbytes: int) -> None:
    """Makes the pages of [address, address + nbytes) read-only."""
    assert libc().mprotect(address, nbytes, mmap.PROT_READ) == 0, ctypes.get_errno()


def map_read_only_at(path, address: int, nbytes: int) -> int:
    """Maps `path` read-only (shared), asking for `address` (a hint: the kernel may place it
    elsewhere); returns where it went. Undo with `libc().munmap(returned, nbytes)`."""
    fd = os.open(path, os.O_RDONLY)
    try:
        got = libc().mmap(address, nbytes, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    finally:
        os.close(fd)
    assert got not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
    return got
