"""Where the time of CPU -> GPU local copies goes (one process, one GPU), measured in one run:

- per_table: an FSDP2-style offloaded state (one CPU storage per parameter and Adam moment,
  the shapes of a named model) moved table by table with `stage_h2d` (one call per table, each
  waiting for its last copy) vs the batched path (reshard.h2d, one pipeline over all tables),
  sources pageable and pinned, against the pinned-copy floor;
- call_cost: the fixed cost of one `stage_h2d` call (a 1-element table), cycling over 32
  distinct tables (the op's device table cache holds them) and over one per tensor (more than
  the cache holds: every call validates and uploads its table again);
- host_rates: the host's fp32 -> bf16 cast (the C core, all threads) and its fp32 copy into
  pinned memory, in elements per second, against the link's bf16 rate: whether a host-side
  split of pageable sources could help.

    python benchmarks/h2d_diag.py --model gpt-125m --json out/h2d_diag.json
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

import _common as C  # noqa: E402

import reshard as rs  # noqa: E402
from reshard import h2d  # noqa: E402
from reshard import scenarios as sc  # noqa: E402
from reshard.rounds import LocalTable  # noqa: E402


def _best(fn, reps=5):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return min(ts), statistics.median(ts)


def per_table(model, ring):
    shapes = sc.named_shapes(model)
    sizes = [n for _ in range(3) for n in (int(torch.Size(s).numel()) for s in shapes.values())]
    out = {"tables": len(sizes), "bytes": 4 * sum(sizes)}
    dst = [torch.empty(n, device="cuda") for n in sizes]
    descs = [torch.tensor([[0, 0, 0, 0, n, 1]]) for n in sizes]
    tables = [
        h2d.LocalSpans(LocalTable(i, 1000 + i, descs[i], n), h2d.contiguous_spans(descs[i].numpy()))
        for i, n in enumerate(sizes)
    ]
    dev_bytes = int(torch.ops.reshard.stage_device_bytes(ring.numel()))
    for kind in ("pageable", "pinned"):
        out.update(_per_table_kind(kind, sizes, dst, descs, tables, ring, dev_bytes))
    return out


def _per_table_kind(kind, sizes, dst, descs, tables, ring, dev_bytes):
    src = [torch.randn(n) for n in sizes]
    if kind == "pinned":
        src = [s.pin_memory() for s in src]

    def per_call():
        for s, d, desc in zip(src, dst, descs, strict=True):
            torch.ops.reshard.stage_h2d(s, desc, ring, d)

    path = h2d.HostToDevice(tables)
    srcs = dict(enumerate(src))
    dsts = {1000 + i: d for i, d in enumerate(dst)}

    def batched():
        path.run(srcs, dsts, ring, dev_bytes)

    return {f"stage_per_table_{kind}_s": _best(per_call), f"batched_{kind}_s": _best(batched)}


def call_cost(n_tables, ring):
    s, d = torch.randn(1), torch.empty(1, device="cuda")
    out = {}
    for distinct in (32, n_tables):
        descs = [torch.tensor([[0, 0, 0, 0, 1, 1]]) for _ in range(distinct)]
        order = [descs[i % distinct] for i in range(n_tables)]

        def calls(order=order):
            for desc in order:
                torch.ops.reshard.stage_h2d(s, desc, ring, d)

        best, med = _best(calls)
        out[f"{distinct}_distinct_us_per_call"] = (best / n_tables * 1e6, med / n_tables * 1e6)
    return out


def host_rates(ring):
    n = ring.numel() // 4 // 2  # one slot's worth of bf16, a fp32 source
    n = min(n, 16 << 20)
    src = torch.randn(n)
    bf = ring[: 2 * n].view(torch.bfloat16)
    f32 = ring[: 4 * n].view(torch.float32)
    desc = torch.tensor([[0, 0, 0, 0, n, 1]])

    def cast():
        torch.ops.reshard.copy_runs(src, desc, bf)

    def copy():
        f32.copy_(src)

    return {
        "elements": n,
        "cast_elem_per_s": n / _best(cast)[0],
        "copy_elem_per_s": n / _best(copy)[0],
    }


def _link_h2d():
    pinned = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(pinned, device="cuda")
    return pinned.numel() / _best(lambda: dev.copy_(pinned, non_blocking=True))[0]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gpt-125m")
    ap.add_argument("--ring-mib", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    ring = torch.empty(args.ring_mib << 20, dtype=torch.uint8, pin_memory=True)
    link = _link_h2d()
    res = {"env": C.environment("cuda"), "link_h2d_Bps": link, "model": args.model}
    res["per_table"] = per_table(args.model, ring)
    res["per_table"]["floor_s"] = res["per_table"]["bytes"] / link
    res["call_cost"] = call_cost(res["per_table"]["tables"], ring)
    res["host_rates"] = host_rates(ring)
    res["host_rates"]["link_bf16_elem_per_s"] = link / 2
    res["reshard"] = getattr(rs, "__version__", "?")
    text = json.dumps(res, indent=1, default=str)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
