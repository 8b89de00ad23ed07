"""Where one rs.Stream call's time goes: the stream_offload scenario (CPU fp32 masters -> bf16
tensors by name on the GPU, one process), with the caller's and the worker's steps timestamped
(milliseconds from the call's start, median over the timed calls), against the pinned-PCIe copy
of the same bytes measured in the same run.

Each step is timed by wrapping the function that runs it: the call's set-up (`allocbuf`,
`register`, `callstart`: queuing bucket 0 on the worker), the worker's start, the transfer's
preflight, reshard.h2d's route lookup and its `stage_h2d` pipeline (`staged`), the first tensor
handed to the caller, the end of the caller's loop and the device synchronize after it. Two
consumers: `write` copies each tensor into the 'engine' weights (as sync_latency does), `nowrite`
takes it and does nothing. Needs CUDA.

    python benchmarks/stream_timeline.py --models gpt-125m --iters 15 --json OUT/timeline.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _scenarios as S  # noqa: E402

import reshard as rs  # noqa: E402
from reshard import h2d, stream, stream_iter, stream_mover  # noqa: E402
from reshard import preflight as pf  # noqa: E402

WARMUP = 2
_marks: dict = {}


def _mark(key: str) -> None:
    _marks.setdefault(key, time.perf_counter())


def _wrap(owner, name: str, tag: str) -> None:
    """Time `owner.name` as `tag`_0 (its first entry in a call) .. `tag`_1 (its first return)."""
    inner = getattr(owner, name)

    def timed(*args, **kwargs):
        _mark(f"{tag}_0")
        out = inner(*args, **kwargs)
        _mark(f"{tag}_1")
        return out

    setattr(owner, name, timed)


def _instrument() -> None:
    _wrap(stream.Stream, "_allocate_buffer", "allocbuf")
    _wrap(stream_mover.BucketMover, "register", "register")
    _wrap(stream_iter.Call, "start", "callstart")
    _wrap(stream_mover.BucketMover, "_move", "worker")
    _wrap(pf, "run", "preflight")
    _wrap(h2d.HostToDevice, "run", "h2d")
    _wrap(h2d.HostToDevice, "_route", "route")
    _wrap(h2d.HostToDevice, "_staged_pieces", "staged")


def _calls(st, case, bufs, write: bool, iters: int) -> list[dict]:
    rows = []
    for i in range(WARMUP + iters):
        _marks.clear()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for n, (name, full) in enumerate(st(case.src_buffers)):
            if n == 0:
                _mark("first_yield")
            if write:
                case.write(name, full, bufs)
        _mark("loop_end")
        torch.cuda.synchronize()
        _mark("sync_end")
        if i >= WARMUP:
            rows.append({k: (v - t0) * 1e3 for k, v in _marks.items()})
    return rows


def _floor_ms(nbytes: int) -> float:
    pinned = torch.ones(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(pinned, device="cuda")
    ts = []
    for _ in range(10):
        torch.cuda.synchronize()
        t = time.perf_counter()
        dev.copy_(pinned, non_blocking=True)
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return min(ts) * 1e3


def run(model: str, iters: int) -> dict:
    case = S.stream_offload(model, 0, 1, "cuda")
    bufs = case.targets()
    out = {"model": model, "loadavg": os.getloadavg(), "rows": []}
    for label, kw in (("pageable", {}), ("registered", {"register_host_sources": True})):
        st = rs.Stream(
            case.src_layout,
            [0],
            case.stream["bucket_bytes"],
            dtype=case.dst.dtype,
            device=case.dst_device,
            **kw,
        )
        for consumer in ("write", "nowrite"):
            rows = _calls(st, case, bufs, consumer == "write", iters)
            keys = {k for r in rows for k in r}
            med = {k: statistics.median(r[k] for r in rows if k in r) for k in keys}
            med = dict(sorted(med.items(), key=lambda kv: kv[1]))
            print(
                f"{model} {label} {consumer}: " + " ".join(f"{k}={v:.2f}" for k, v in med.items())
            )
            out["rows"].append(
                {"sources": label, "consumer": consumer, "median_ms": med, "calls": rows}
            )
        st.close()
    out["floor_ms"] = _floor_ms(case.payload_bytes)
    out["bitwise"] = all(torch.equal(bufs[k].cpu(), case.reference[k]) for k in bufs)
    print(f"{model}: bf16 PCIe floor {out['floor_ms']:.2f} ms, bitwise {out['bitwise']}")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="gpt-125m")
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device (the stream's CPU -> GPU path)")
    if args.iters < 1:
        ap.error("--iters must be at least 1")
    _instrument()
    results = [run(m, args.iters) for m in args.models.split(",")]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
