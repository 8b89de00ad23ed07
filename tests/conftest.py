"""Shared pytest configuration for reshard's tests.

Hypothesis profiles: "ci" (the default; deterministic, no deadline: CI machines are slow
and shared) and "dev" (more examples). Select with HYPOTHESIS_PROFILE=dev.
"""

import os
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


def pytest_sessionstart(session):
    """DeepSpeed CPU allreduce segments left in /dev/shm by runs that were killed before their
    launcher's cleanup hold memory until reboot: remove those, and name any others."""
    from reshard._launch import SHM_DIR, remove_orphaned_deepspeed_shm

    removed, freed, others = remove_orphaned_deepspeed_shm()
    if removed:
        print(f"conftest: removed {removed} orphaned DeepSpeed segments ({freed >> 20} MiB)")
    if others:
        print(
            f"conftest: {len(others)} DeepSpeed segments in {SHM_DIR} not made by reshard's "
            f"launcher hold memory (e.g. {others[0]}); remove them when no DeepSpeed job runs"
        )


@pytest.fixture(scope="session")
def deepspeed_cpu_ops():
    """DeepSpeed's CPU comm op, built once before the first test that spawns DeepSpeed ranks."""
    from reshard.integrations import deepspeed_cpu_ops as ops

    ops.prepare()
