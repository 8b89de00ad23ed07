"""Probe (branch dstpf): destination prefetch in the host's cast and the queue's sub-chunk
size, switched per call by environment variables, interleaved: stage_h2d alone, then one
Transfer and rs.Stream of stream_offload."""

import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
import _baselines as B  # noqa: E402
import _scenarios as S  # noqa: E402

import reshard as rs  # noqa: E402

MiB = 1 << 20
OP_VARIANTS = [
    "",
    "w:4096",
    "w:8192",
    "w:16384",
    "t0:8192",
    "src:32768",
    "sub:131072",
    "sub:524288",
    "sub:1048576",
]
E2E_VARIANTS = os.environ.get("E2E", ",w:8192,w:16384,sub:524288").split(",")


def setenv(v):
    os.environ.pop("RESHARD_PROBE_DST", None)
    os.environ.pop("RESHARD_PROBE_SUB", None)
    if v.startswith("sub:"):
        os.environ["RESHARD_PROBE_SUB"] = v[4:]
    elif v:
        os.environ["RESHARD_PROBE_DST"] = v


def op_section(out):
    n = 128 << 20
    ring = torch.empty(64 * MiB, dtype=torch.uint8, pin_memory=True)[: 32 * MiB]
    desc = torch.tensor([[0, 0, 0, 0, n, 1]])
    dst = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    src = torch.randn(n)
    ref = src.to(torch.bfloat16).view(torch.int16)

    def run(v):
        setenv(v)
        torch.cuda.synchronize()
        a = time.perf_counter()
        torch.ops.reshard.stage_h2d(src, desc, ring, dst)
        torch.cuda.synchronize()
        return time.perf_counter() - a

    ok = {}
    for v in OP_VARIANTS:
        run(v)
        ok[v] = bool(torch.equal(dst.cpu().view(torch.int16), ref))
    times = {v: [] for v in OP_VARIANTS}
    for r in range(9):
        order = OP_VARIANTS[r % len(OP_VARIANTS) :] + OP_VARIANTS[: r % len(OP_VARIANTS)]
        for v in order:
            times[v].append(run(v))
    setenv("")
    base = statistics.median(times[""])
    for v in OP_VARIANTS:
        m = statistics.median(times[v])
        out.append(
            {
                "section": "op",
                "variant": v,
                "median_s": m,
                "g_el_s": n / m / 1e9,
                "x_base": m / base,
                "ok": ok[v],
            }
        )
        print(
            f"op {v or 'base':12s} {m * 1e3:7.2f} ms {n / m / 1e9:6.2f} G el/s  x base {m / base:.3f} ok {ok[v]}",
            flush=True,
        )


def e2e_section(model, out, bw):
    case = S.stream_offload(model, 0, 1, "cuda")
    kw = dict(dtype=case.dst.dtype, device=case.dst_device)
    t = rs.Transfer(case.src_layout, case.dst_layout, budget_bytes_per_peer=64 * MiB)
    st = rs.Stream(case.src_layout, [0], case.stream["bucket_bytes"], **kw)
    bt, bs = case.targets(), case.targets()

    def tr():
        t(case.src_buffers, bt)

    def sm():
        for name, full in st(case.src_buffers):
            case.write(name, full, bs)

    for _ in range(3):
        tr()
        sm()
    keys = [(k, v) for v in E2E_VARIANTS for k in ("transfer", "stream")]
    times = {k: [] for k in keys}
    for r in range(12):
        order = keys[r % len(keys) :] + keys[: r % len(keys)]
        for k in order:
            setenv(k[1])
            torch.cuda.synchronize()
            a = time.perf_counter()
            (tr if k[0] == "transfer" else sm)()
            torch.cuda.synchronize()
            times[k].append(time.perf_counter() - a)
    setenv("")
    floor = case.payload_bytes / bw
    ok = B.targets_correct(case, bt) and B.targets_correct(case, bs)
    for k in keys:
        m = statistics.median(times[k])
        base = statistics.median(times[(k[0], "")])
        out.append(
            {
                "section": model,
                "method": k[0],
                "variant": k[1],
                "median_s": m,
                "x_floor": m / floor,
                "x_base": m / base,
            }
        )
        print(
            f"{model} {k[0]:8s} {k[1] or 'base':12s} {m * 1e3:7.2f} ms  x floor {m / floor:.2f}  x base {m / base:.3f}  ok {ok}",
            flush=True,
        )
    t.close()
    st.close()


def main():
    from stream_probe import pinned_h2d_Bps

    bw = pinned_h2d_Bps()
    print(f"pinned h2d {bw / 1e9:.2f} GB/s", flush=True)
    out = []
    op_section(out)
    json.dump(out, open(sys.argv[1], "w"), indent=1)
    for m in ("gpt-125m", "gpt-350m"):
        e2e_section(m, out, bw)
        json.dump(out, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
