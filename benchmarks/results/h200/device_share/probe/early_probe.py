"""Probe: rs.Stream taking tensors as they land (EARLY_TENSORS, the worker one thread short)
against whole buckets, interleaved, stream_offload at world 1."""

import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
import _baselines as B  # noqa: E402
import _scenarios as S  # noqa: E402
from stream_probe import pinned_h2d_Bps  # noqa: E402

import reshard as rs  # noqa: E402
from reshard import stream_iter  # noqa: E402

MiB = 1 << 20


def run(model, bw, out):
    case = S.stream_offload(model, 0, 1, "cuda")
    kw = dict(dtype=case.dst.dtype, device=case.dst_device)
    bb = case.stream["bucket_bytes"]
    t = rs.Transfer(case.src_layout, case.dst_layout, budget_bytes_per_peer=64 * MiB)
    v = {
        "transfer": (t, True, True),
        "early": (rs.Stream(case.src_layout, [0], bb, **kw), True, True),
        "whole": (rs.Stream(case.src_layout, [0], bb, **kw), False, True),
        "early_nw": (rs.Stream(case.src_layout, [0], bb, **kw), True, False),
        "whole_nw": (rs.Stream(case.src_layout, [0], bb, **kw), False, False),
    }
    bufs = {k: case.targets() for k in v}

    def call(k):
        o, early, write = v[k]
        if isinstance(o, rs.Transfer):
            o(case.src_buffers, bufs[k])
            return
        stream_iter.EARLY_TENSORS = early
        try:
            for name, full in o(case.src_buffers):
                if write:
                    case.write(name, full, bufs[k])
        finally:
            stream_iter.EARLY_TENSORS = True

    for k in v:
        for _ in range(3):
            call(k)
    times = {k: [] for k in v}
    order = list(v)
    for r in range(12):
        for k in order[r % len(order) :] + order[: r % len(order)]:
            torch.cuda.synchronize()
            a = time.perf_counter()
            call(k)
            torch.cuda.synchronize()
            times[k].append(time.perf_counter() - a)
    floor = case.payload_bytes / bw
    for k in v:
        m = statistics.median(times[k])
        ok = None if k.endswith("_nw") else B.targets_correct(case, bufs[k])
        out.append(
            {
                "model": model,
                "variant": k,
                "median_s": m,
                "x_floor": m / floor,
                "ok": ok,
                "times": times[k],
            }
        )
        print(f"{model} {k:9s} {m * 1e3:7.2f} ms  x floor {m / floor:.2f}  ok {ok}", flush=True)
    for o, _, _ in v.values():
        o.close()


def main():
    bw = pinned_h2d_Bps()
    print(f"pinned h2d {bw / 1e9:.2f} GB/s", flush=True)
    out = []
    for m in ("gpt-125m", "gpt-350m"):
        run(m, bw, out)
        json.dump(out, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
