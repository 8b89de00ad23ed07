"""Probe: the device-cast split's host share, forced, for CPU fp32 masters (page-locked) -> GPU bf16.

Variants per model, interleaved rounds, medians:
  T_page:      one Transfer, pageable sources (own copy of the state)
  T_auto:      one Transfer, page-locked sources, the split's own trial
  T_<share>:   the same, host share forced
  S_page:      rs.Stream, pageable sources (each tensor copied into the weights)
  S_auto:      rs.Stream, page-locked sources, the trial
  S_<share>:   rs.Stream, page-locked, share forced in every bucket
  S_<share>_nw: the same, tensors not copied anywhere
"""

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

MiB = 1 << 20
T_SHARES = [
    float(x) for x in os.environ.get("T_SHARES", "1.0,0.85,0.8,0.75,0.7,0.65,0.6,0.5").split(",")
]
S_SHARES = [float(x) for x in os.environ.get("S_SHARES", "1.0,0.8,0.7,0.6").split(",")]
ROUNDS = int(os.environ.get("ROUNDS", "15"))


def h2d_of(t):
    return t._engine.local_h2d


def force(h, share):
    h.split = "kept"
    h.host_share = share


def run(model, bw):
    page = S.stream_offload(model, 0, 1, "cuda")
    reg = S.stream_offload(model, 0, 1, "cuda")
    kw = dict(dtype=reg.dst.dtype, device=reg.dst_device)
    bb = reg.stream["bucket_bytes"]
    steps = {}

    def transfer(case, register=False):
        return rs.Transfer(
            case.src_layout,
            case.dst_layout,
            budget_bytes_per_peer=64 * MiB,
            register_host_sources=register,
        )

    t_reg = transfer(reg, register=True)
    t_reg(reg.src_buffers, reg.targets())
    t_reg.wait_host_registration()
    print(model, "registered:", all(b.is_pinned() for b in reg.src_buffers.values()), flush=True)
    pin = S.stream_offload(model, 0, 1, "cuda")
    pin.src_buffers = {k: v.pin_memory() for k, v in pin.src_buffers.items()}
    steps["T_page"] = (transfer(page), page)
    steps["T_auto"] = (t_reg, reg)
    for sh in T_SHARES:
        steps[f"T_{sh}"] = (transfer(reg), reg)
    steps["S_page"] = (rs.Stream(page.src_layout, [0], bb, **kw), page)
    steps["S_page_nw"] = (rs.Stream(page.src_layout, [0], bb, **kw), page)
    steps["S_auto"] = (rs.Stream(reg.src_layout, [0], bb, **kw), reg)
    steps["P_auto"] = (rs.Stream(pin.src_layout, [0], bb, **kw), pin)
    for sh in S_SHARES:
        steps[f"S_{sh}"] = (rs.Stream(reg.src_layout, [0], bb, **kw), reg)
        steps[f"S_{sh}_nw"] = (rs.Stream(reg.src_layout, [0], bb, **kw), reg)
        steps[f"P_{sh}"] = (rs.Stream(pin.src_layout, [0], bb, **kw), pin)
        steps[f"P_{sh}_nw"] = (rs.Stream(pin.src_layout, [0], bb, **kw), pin)
    bufs = {k: c.targets() for k, (_, c) in steps.items()}

    def call(k):
        o, c = steps[k]
        if isinstance(o, rs.Transfer):
            o(c.src_buffers, bufs[k])
            return
        nw = k.endswith("_nw")
        for name, full in o(c.src_buffers):
            if not nw:
                c.write(name, full, bufs[k])

    for k in steps:  # warm: the trials finish (6 calls), then force the shares
        for _ in range(8 if k.endswith("auto") else 2):
            call(k)
        o, _ = steps[k]
        sh = k.split("_")[1]
        if sh in ("page", "auto", "pin"):
            continue
        if isinstance(o, rs.Transfer):
            force(h2d_of(o), float(sh))
        else:
            for t in o.mover.transfers.values():
                force(h2d_of(t), float(sh))
        call(k)
    torch.cuda.synchronize()
    order = list(steps)
    times = {k: [] for k in order}
    for r in range(ROUNDS):
        rot = order[r % len(order) :] + order[: r % len(order)]
        for k in rot:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            call(k)
            torch.cuda.synchronize()
            times[k].append(time.perf_counter() - t0)
    floor = reg.payload_bytes / bw
    out = {"model": model, "floor_s": floor, "rows": []}
    for k in order:
        o, c = steps[k]
        med = statistics.median(times[k])
        if isinstance(o, rs.Transfer):
            lasts = [h2d_of(o).last]
        else:
            lasts = [h2d_of(t).last for t in o.mover.transfers.values()]
        ok = None if k.endswith("_nw") else B.targets_correct(c, bufs[k])
        row = {
            "variant": k,
            "median_s": med,
            "min_s": min(times[k]),
            "x_floor": med / floor,
            "ok": ok,
            "last": [
                {a: (round(b, 6) if isinstance(b, float) else b) for a, b in L.items()}
                for L in lasts
            ],
        }
        row["link"] = [
            h2d_of(t).link_bytes_per_s
            for t in ([o] if isinstance(o, rs.Transfer) else o.mover.transfers.values())
        ]
        out["rows"].append(row)
        desc = " ".join(
            f"share={L.get('host_share', 0):.3f}/{L.get('split')} host={L.get('host_s', 0) * 1e3:.2f} "
            f"dev_el={L.get('device_cast_elements', 0)} tot={L.get('total_s', 0) * 1e3:.2f}"
            for L in lasts
        )
        print(
            f"{model} {k:12s} link {(row['link'][0] or 0) / 1e9:5.1f} {med * 1e3:7.2f} ms  x floor {med / floor:5.2f}  ok {ok}  | {desc}",
            flush=True,
        )
    for o, _ in steps.values():
        o.close()
    return out


def main():
    bw = pinned_h2d_Bps()
    print(f"pinned h2d {bw / 1e9:.2f} GB/s", flush=True)
    res = {"pinned_h2d_Bps": bw, "models": []}
    for m in sys.argv[2].split(","):
        res["models"].append(run(m, bw))
        json.dump(res, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
