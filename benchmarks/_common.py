"""What every benchmark script shares: the environment record, timers, the progress line, and
the results writer (JSON, the markdown rendered from it, plots), so results files look alike
and a script can re-render its markdown and plots from a committed JSON (`--from-json`)."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
GB = 1e9  # bandwidths are in GB/s
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def progress_logger(name):
    """A function printing `[name HH:MM:SS] msg` to stderr, flushed (stdout is the result)."""

    def progress(msg):
        print(f"[{name} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    return progress


def git_output(*args) -> str:
    """stdout of `git ARGS` in the repository (an older revision's file, a short hash)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.run(
        ["git", *args], cwd=root, check=True, capture_output=True, text=True
    ).stdout


def command_line(script, argv=None) -> str:
    args = sys.argv[1:] if argv is None else argv
    return f"python benchmarks/{script} " + " ".join(args)


def environment(device="cpu") -> dict:
    """Where and with what a result was measured."""
    env = {
        "host": platform.node(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if device == "cuda" and torch.cuda.is_available():
        env["cuda"] = torch.version.cuda
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        with contextlib.suppress(Exception):  # descriptive only
            v = torch.cuda.nccl.version()
            env["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    return env


# ------------------------------------------------------------------ timers


def time_events(fn, reps=20, warmup=3):
    """Median seconds of fn() measured with CUDA events on the current stream."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def time_wall(fn, reps=5, warmup=1):
    """Median wall seconds of fn() followed by a device synchronize (host-synchronous paths)."""
    for _ in range(warmup):
        fn()
        torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def timed_sync(step, bufs, world, cuda):
    """One sync, timed on this rank: every rank starts after a barrier, the time runs until
    this rank's step returned and its device work is done. The sync's latency is the slowest
    rank's (the caller takes the max over ranks per sync), so the benchmark's own barrier is
    never inside the timed interval, for every method alike. Returns (seconds, what the step
    returned)."""
    fence(world, cuda)
    t = time.perf_counter()
    out = step(bufs)
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t, out


def fence(world, cuda):
    """No device work pending, and every rank here."""
    if cuda:
        torch.cuda.synchronize()
    if world > 1:
        dist.barrier()


def quantile(sorted_xs, q):
    """The q-quantile of an ascending list, nearest rank (q=0.9: p90)."""
    return sorted_xs[min(len(sorted_xs) - 1, max(0, int(q * len(sorted_xs) + 0.999999) - 1))]


# ------------------------------------------------------------------ results


def write_results(json_path, record, markdown=None, plot=None) -> str:
    """Write `record` to json_path, `markdown(record)` next to it as .md, and `plot(stem,
    record)` (which saves its own PNGs under the stem). Returns the stem. A plot that fails is
    reported on stderr and skipped: the JSON is the record."""
    os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
    tmp = json_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1)
    os.replace(tmp, json_path)
    stem = json_path[:-5] if json_path.endswith(".json") else json_path
    if markdown is not None:
        text = markdown(record)
        with open(stem + ".md", "w") as f:
            f.write(text)
    if plot is not None:
        try:
            plot(stem, record)
        except Exception as exc:  # noqa: BLE001 - a picture is a convenience
            print(f"plot skipped: {type(exc).__name__}: {exc}", file=sys.stderr)
    return stem


def pyplot():
    """matplotlib's pyplot on the file-only backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# The modules of an rs.Stream, each importing the ones before it.
STREAM_MODULES = ("stream_buckets", "stream_mover", "stream_iter", "stream")


def load_stream_before(path):
    """Another revision's Stream: its stream*.py from the directory `path` (git show
    REV:python/reshard/stream*.py), as reshard._before_* modules importing one another; their
    other relative imports resolve in the current package."""
    import importlib.util

    for name in STREAM_MODULES:
        src = open(os.path.join(path, f"{name}.py")).read()
        for other in STREAM_MODULES:
            src = src.replace(f"from .{other} import", f"from ._before_{other} import")
            src = src.replace(f"from . import {other} as", f"from . import _before_{other} as")
        full = f"reshard._before_{name}"
        spec = importlib.util.spec_from_loader(full, loader=None)
        mod = importlib.util.module_from_spec(spec)
        mod.__package__ = "reshard"
        sys.modules[full] = mod
        exec(compile(src, os.path.join(path, f"{name}.py"), "exec"), mod.__dict__)
    return sys.modules["reshard._before_stream"].Stream
