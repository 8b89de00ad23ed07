"""Shared pytest configuration for reshard's tests.

Hypothesis profiles: "ci" (the default; deterministic, no deadline: CI machines are slow
and shared) and "dev" (more examples). Select with HYPOTHESIS_PROFILE=dev.

The whole session has a wall-clock budget (RESHARD_TEST_BUDGET_S, default 45 minutes; the
suite takes about 8 on two cores): past it the session stops before the next test, naming the
machine's free memory, so a machine that runs far slower than usual gets a report instead of
an outside timeout.
"""

import os
import shutil
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", deadline=None, max_examples=1000, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# DeepSpeed JIT-builds its CPU ops under TORCH_EXTENSIONS_DIR: the tests keep them in this
# checkout's build/, so no state from other runs on the machine (a killed build's lock) reaches them.
os.environ.setdefault(
    "TORCH_EXTENSIONS_DIR",
    str(Path(__file__).resolve().parents[1] / "build" / "torch_extensions"),
)


SESSION_BUDGET_S = float(os.environ.get("RESHARD_TEST_BUDGET_S", 45 * 60))
_SESSION_START = time.monotonic()
LOW_MEMORY_BYTES = 4 << 30


def _memory_line() -> tuple:
    """(A line naming available memory and what /dev/shm holds, available bytes or None)."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) << 10
    except OSError:
        pass
    from reshard._launch import SHM_DIR

    shm = shutil.disk_usage(SHM_DIR).used if os.path.isdir(SHM_DIR) else 0
    have = "unknown" if avail is None else f"{avail / 2**30:.1f} GiB"
    return f"memory available {have}, {SHM_DIR} holds {shm / 2**30:.1f} GiB", avail


def pytest_runtest_setup(item):
    spent = time.monotonic() - _SESSION_START
    if spent > SESSION_BUDGET_S:
        pytest.exit(
            f"the test session passed its budget of {SESSION_BUDGET_S:.0f} s "
            f"(RESHARD_TEST_BUDGET_S) before {item.nodeid}: this machine runs far slower than "
            f"usual ({_memory_line()[0]})",
            returncode=1,
        )


def pytest_sessionstart(session):
    """DeepSpeed CPU allreduce segments left in /dev/shm by runs that were killed before their
    launcher's cleanup hold memory until reboot: remove those, and name any others. Low memory
    is named up front: it slows every test that spawns ranks."""
    from reshard._launch import SHM_DIR, remove_orphaned_deepspeed_shm

    removed, freed, others = remove_orphaned_deepspeed_shm()
    if removed:
        print(f"conftest: removed {removed} orphaned DeepSpeed segments ({freed >> 20} MiB)")
    if others:
        print(
            f"conftest: {len(others)} DeepSpeed segments in {SHM_DIR} not made by reshard's "
            f"launcher hold memory (e.g. {others[0]}); remove them when no DeepSpeed job runs"
        )
    line, avail = _memory_line()
    if avail is not None and avail < LOW_MEMORY_BYTES:
        print(f"conftest: low memory: {line}; tests that spawn ranks will be slow or time out")


@pytest.fixture(scope="session")
def deepspeed_cpu_ops():
    """DeepSpeed's CPU comm op, built once before the first test that spawns DeepSpeed ranks."""
    from reshard.integrations import deepspeed_cpu_ops as ops

    ops.prepare()
