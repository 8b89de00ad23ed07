"""DeepSpeed's CPU shared-memory allreduce op, built once before ranks start.

On the CPU accelerator every rank's first `deepspeed.initialize` JIT-compiles DeepSpeed's
`deepspeed_shm_comm` op (about a minute of C++ on two cores), one rank compiling while the
others wait. The demo and the tests call `prepare()` in the launching process instead, so ranks
only load the built op and no rank's timeout runs while another compiles.

torch guards that build with a lock file; a build that is killed leaves it behind, and every
later build or load of the op then waits on it forever. Here a lock is waited on until it is
`STALE_LOCK_S` old (no build of this op runs that long), then removed, with a line saying so.

`python -m reshard.integrations.deepspeed_cpu_ops` runs the build in this process.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time

OP_NAME = "deepspeed_shm_comm"
STALE_LOCK_S = 600.0
BUILD_TIMEOUT_S = 1800.0


def prepare(timeout_s: float = BUILD_TIMEOUT_S) -> None:
    """Build (or find built) DeepSpeed's CPU comm op in a child process with DS_ACCELERATOR=cpu,
    leaving this process's DeepSpeed state untouched. No-op without DeepSpeed. Raises
    RuntimeError with the child's output when the build fails or outlasts `timeout_s`."""
    if importlib.util.find_spec("deepspeed") is None:
        return
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    cmd = [sys.executable, "-m", __name__]
    try:
        # DeepSpeed logs to stdout (kept for an error); this module's progress lines go to stderr.
        done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout or b""  # bytes even in text mode
        out = out.decode(errors="replace") if isinstance(out, bytes) else out
        raise RuntimeError(
            f"DeepSpeed's {OP_NAME} op did not build within {timeout_s:.0f} s; its output:\n{out}"
        ) from None
    if done.returncode != 0:
        raise RuntimeError(
            f"building DeepSpeed's {OP_NAME} op failed (exit code {done.returncode}):\n"
            f"{done.stdout}"
        )


def _say(line: str) -> None:
    print(f"deepspeed_cpu_ops: {line}", file=sys.stderr, flush=True)


def _build_here() -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from torch.utils.cpp_extension import _get_build_directory

    build_dir = _get_build_directory(OP_NAME, False)
    lock = os.path.join(build_dir, "lock")
    waited = False
    while True:
        try:
            age = time.time() - os.stat(lock).st_mtime
        except FileNotFoundError:
            break
        if age > STALE_LOCK_S:
            _say(f"removing {lock}, left {age / 60:.0f} min ago by a killed build")
            os.remove(lock)
            break
        if not waited:
            _say(f"waiting for {lock} (another build, or a killed one)")
            waited = True
        time.sleep(1.0)
    built = os.path.exists(os.path.join(build_dir, f"{OP_NAME}.so"))
    if not built:
        _say(f"building DeepSpeed's {OP_NAME} op once in {build_dir}")
    t0 = time.perf_counter()
    from deepspeed.comm.torch import build_shm_op

    if build_shm_op() is None:
        _say(f"DeepSpeed reports {OP_NAME} incompatible here; ranks use gloo")
    elif not built:
        _say(f"built in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    _build_here()
