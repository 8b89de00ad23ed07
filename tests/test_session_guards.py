"""tests/conftest.py's session budget: past it the session stops with a report that names the
machine's memory, instead of running into an outside timeout."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_session_past_its_budget_stops_and_names_memory():
    env = dict(os.environ, RESHARD_TEST_BUDGET_S="0")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    cmd += ["tests/test_layout.py"]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode == 1, out[-3000:]
    assert "passed its budget of 0 s" in out and "memory available" in out, out[-3000:]
    assert "no tests ran" in out, out[-3000:]  # stopped before the first test
