"""reshard.integrations.deepspeed_cpu_ops: DeepSpeed's CPU comm op is built once before ranks
start, and a lock left by a killed build neither hangs the build nor the ranks after it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

pytest.importorskip("deepspeed")

from reshard.integrations import deepspeed_cpu_ops as ops  # noqa: E402

pytestmark = pytest.mark.usefixtures("deepspeed_cpu_ops")


def _copy_of_built_op(tmp_path):
    """A private extensions dir holding the op the session built (so nothing recompiles)."""
    built = os.path.join(os.environ["TORCH_EXTENSIONS_DIR"], ops.OP_NAME)
    assert os.path.exists(os.path.join(built, f"{ops.OP_NAME}.so")), built
    root = tmp_path / "ext"
    shutil.copytree(built, root / ops.OP_NAME)
    return root


def _start(root):
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(root), DS_ACCELERATOR="cpu")
    cmd = [sys.executable, "-m", ops.__name__]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_killed_builds_lock_is_removed(tmp_path):
    root = _copy_of_built_op(tmp_path)
    lock = root / ops.OP_NAME / "lock"
    lock.touch()
    old = time.time() - ops.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    proc = _start(root)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, out + err
    assert "removing" in err and "killed build" in err, err
    assert not lock.exists()


def test_a_fresh_lock_is_waited_on(tmp_path):
    root = _copy_of_built_op(tmp_path)
    lock = root / ops.OP_NAME / "lock"
    lock.touch()
    proc = _start(root)
    first = ""
    while not first.startswith("deepspeed_cpu_ops:"):  # its first line; others may come before
        line = proc.stderr.readline()
        assert line, "ended without a line: " + proc.communicate(timeout=300)[1]
        first = line
    assert "waiting for" in first, first
    time.sleep(2)
    assert proc.poll() is None, "went on while another build held the lock"
    lock.unlink()  # the other build ends
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, out + first + err
    assert "removing" not in err, err
