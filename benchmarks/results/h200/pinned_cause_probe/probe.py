"""Why do 4 KiB runs from/to pinned host memory stage slower than from pageable memory?

Buffers of 320 MiB: P = cudaHostAlloc (torch pin_memory), G = pageable, R = pageable filled
then page-locked in place (reshard host_register). For each: where its pages are (pagemap PFNs,
NUMA, zones; R before and after registering), one dependent load per random page (latency),
the host gather / scatter of 4 KiB runs alone (C, OpenMP; threads, prefetch distance), the
gather while a DMA runs, and stage_h2d / stage_d2h end to end, each against one contiguous
pinned copy in the same round. `python probe.py OUT.json` (PYTHONPATH=python, libprobe.so built
next to this file: gcc -O2 -fopenmp -shared -fPIC probe.c -o libprobe.so).
"""

import ctypes
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

import reshard._ops as ops

GB = 1e9
HERE = os.path.dirname(os.path.abspath(__file__))
lib = ctypes.CDLL(os.path.join(HERE, "libprobe.so"))
P64 = ctypes.POINTER(ctypes.c_int64)
lib.chase.restype = ctypes.c_double
lib.chase.argtypes = [ctypes.c_void_p, P64, ctypes.c_int64, ctypes.c_int64]
for f in (lib.gather, lib.scatter):
    f.restype = ctypes.c_double
    f.argtypes = [ctypes.c_void_p, ctypes.c_void_p, P64, ctypes.c_int64, ctypes.c_int64]
    f.argtypes += [ctypes.c_int, ctypes.c_int]
PAGE = 4096
TOTAL = 256 << 20  # bytes moved per case
SPAN = 320 << 20  # buffer size
RUN = 4 << 10


def sh(cmd):
    try:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=20).stdout
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"


def system_facts():
    zones = []
    for ln in open("/proc/zoneinfo"):
        w = ln.split()
        if ln.startswith("Node"):
            zones.append({"node": w[1].rstrip(","), "zone": w[3]})
        elif zones and w and w[0] in ("present", "managed", "spanned", "start_pfn:"):
            zones[-1][w[0].rstrip(":")] = int(w[1])
    blocks = {}
    mdir = "/sys/devices/system/memory"
    if os.path.isdir(mdir):
        for b in os.listdir(mdir):
            if b.startswith("memory"):
                try:
                    z = open(f"{mdir}/{b}/valid_zones").read().split()[0]
                    on = open(f"{mdir}/{b}/online").read().strip()
                except OSError:
                    continue
                blocks[f"{z}/online={on}"] = blocks.get(f"{z}/online={on}", 0) + 1
    return {
        "uname": platform.uname()._asdict(),
        "cmdline": open("/proc/cmdline").read().strip(),
        "lscpu": sh("lscpu"),
        "nodes": sorted(os.listdir("/sys/devices/system/node"))
        if os.path.isdir("/sys/devices/system/node")
        else None,
        "zones": zones,
        "memory_block_bytes": sh(f"cat {mdir}/block_size_bytes").strip(),
        "memory_blocks_by_zone": blocks,
        "thp": sh("cat /sys/kernel/mm/transparent_hugepage/enabled").strip(),
        "meminfo": [
            ln.strip()
            for ln in open("/proc/meminfo")
            if ln.split(":")[0]
            in (
                "MemTotal",
                "MemFree",
                "AnonHugePages",
                "HugePages_Total",
                "Hugepagesize",
                "Mlocked",
                "Unevictable",
            )
        ],  # fmt: skip
        "iommu": sh("ls /sys/class/iommu; dmesg 2>/dev/null | grep -i -m5 iommu"),
        "torch_threads": torch.get_num_threads(),
    }


def pfns(t, pages=None):
    """PFN of each sampled 4 KiB page of t (0: unknown / not present)."""
    base = t.data_ptr() // PAGE
    n = t.nbytes // PAGE
    idx = np.arange(n) if pages is None else pages
    out = np.zeros(len(idx), np.uint64)
    with open("/proc/self/pagemap", "rb") as f:
        for j, i in enumerate(idx):
            f.seek(8 * (base + int(i)))
            e = int.from_bytes(f.read(8), "little")
            out[j] = (e & ((1 << 55) - 1)) if e >> 63 else 0
    return out


def zone_of(pfn, zones):
    for z in zones:
        s = z.get("start_pfn")
        if s is not None and s <= pfn < s + z.get("spanned", 0):
            return f"node{z['node']}/{z['zone']}"
    return "?"


def placement(t, zones, sample):
    p = pfns(t, sample)
    known = p[p > 0]
    run = pfns(t, np.arange(4096, 4096 + 1024))  # 1024 consecutive pages (4 MiB)
    contig = float(np.mean(np.diff(run.astype(np.int64)) == 1)) if (run > 0).all() else None
    zones_hit = {}
    for v in known[:: max(1, len(known) // 512)]:
        z = zone_of(int(v), zones)
        zones_hit[z] = zones_hit.get(z, 0) + 1
    return {
        "sampled": len(p),
        "known": int(len(known)),
        "pfn_min": int(known.min()) if len(known) else None,
        "pfn_max": int(known.max()) if len(known) else None,
        "zones": zones_hit,
        "consecutive_pfn_fraction_4MiB": contig,
        "numa_maps": numa_line(t.data_ptr()),
    }, p


def numa_line(addr):
    for ln in open("/proc/self/numa_maps"):
        start = int(ln.split()[0], 16)
        if start <= addr:
            best = ln.strip()
    return best[:300]


def fill(t):
    flat = t.view(-1)
    block = min(flat.numel(), 1 << 20)
    pat = torch.randn(block)
    n = flat.numel() // block
    flat[: n * block].view(n, block).copy_(pat.expand(n, block))
    flat[n * block :].copy_(pat[: flat.numel() - n * block])
    return t


def ptr64(a):
    return a.ctypes.data_as(P64)


def main():
    out = {"system": system_facts()}
    print(json.dumps({k: v for k, v in out["system"].items() if k != "lscpu"})[:3000], flush=True)
    print(out["system"]["lscpu"][:1500], flush=True)
    zones = out["system"]["zones"]
    n_el = SPAN // 4
    bufs = {"P": fill(torch.empty(n_el, pin_memory=True)), "G": fill(torch.empty(n_el))}
    bufs["R"] = fill(torch.empty(n_el))
    sample = np.linspace(0, SPAN // PAGE - 1, 2048).astype(np.int64)
    place = {}
    place["R_before_register"], r_before = placement(bufs["R"], zones, sample)
    reg = torch.ops.reshard.host_register(bufs["R"])
    place["R"], r_after = placement(bufs["R"], zones, sample)
    both = (r_before > 0) & (r_after > 0)
    place["R_pfn_changed_fraction"] = float(np.mean(r_before[both] != r_after[both]))
    place["R_registered_by_us"] = int(reg)
    for k in ("P", "G"):
        place[k], _ = placement(bufs[k], zones, sample)
    out["placement"] = place
    print("placement", json.dumps(place)[:3000], flush=True)

    rng = np.random.default_rng(5)
    # dependent loads: one random slot per page (random order), and the same pages in order
    pages = rng.permutation(SPAN // PAGE)
    lat = {}
    for k, t in bufs.items():
        offs = (pages * PAGE + 64 * rng.integers(0, 64, len(pages))).astype(np.int64)
        seq = (np.arange(SPAN // PAGE) * PAGE).astype(np.int64)
        lat[k] = {
            "random_page_ns": lib.chase(t.data_ptr(), ptr64(offs), len(offs), 1 << 20),
            "sequential_page_ns": lib.chase(t.data_ptr(), ptr64(seq), len(seq), 1 << 20),
        }
    out["latency"] = lat
    print("latency", json.dumps(lat), flush=True)

    # host-only gather / scatter of 4 KiB runs (the ring pack / unpack without the DMA)
    n_runs = TOTAL // RUN
    offs = (rng.choice(SPAN // RUN, n_runs, replace=False) * RUN).astype(np.int64)
    ring = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True)
    slot = 16 << 20
    per_slot = slot // RUN

    def host(kind, k, threads, dist):
        f = lib.gather if kind == "gather" else lib.scatter
        t = bufs[k]

        def call():
            s = 0.0
            for c in range(n_runs // per_slot):
                o = offs[c * per_slot : (c + 1) * per_slot]
                r = ring.data_ptr() + (c % 4) * slot
                a, b = (r, t.data_ptr()) if kind == "gather" else (t.data_ptr(), r)
                s += f(a, b, ptr64(o), len(o), RUN, dist, threads)
            return s

        return call

    cases = {}
    for k in bufs:
        for threads in (16, 8):
            for dist in (0, 1, 8):
                cases[f"gather {k} t{threads} d{dist}"] = host("gather", k, threads, dist)
        for dist in (1, 8):
            cases[f"scatter {k} t16 d{dist}"] = host("scatter", k, 16, dist)
    res = {k: [] for k in cases}
    for _ in range(5):
        for k, f in cases.items():
            res[k].append(TOTAL / f() / GB)
    out["host_GBps"] = {k: statistics.median(v) for k, v in res.items()}
    print("host", json.dumps({k: round(v, 1) for k, v in out["host_GBps"].items()}), flush=True)

    # the gather while the copy engine moves 4 x 256 MiB pinned -> device (or device -> pinned)
    big = fill(torch.empty(TOTAL // 4, pin_memory=True))
    dev = torch.empty(TOTAL // 4, device="cuda")
    side = torch.cuda.Stream()
    conc = {}
    for direction in ("h2d", "d2h"):
        for k in bufs:
            vals = []
            for _ in range(3):
                torch.cuda.synchronize()
                with torch.cuda.stream(side):
                    for _ in range(4):
                        if direction == "h2d":
                            dev.copy_(big, non_blocking=True)
                        else:
                            big.copy_(dev, non_blocking=True)
                time.sleep(0.002)
                vals.append(TOTAL / host("gather", k, 16, 1)() / GB)
                torch.cuda.synchronize()
            conc[f"gather {k} t16 d1 during {direction} DMA"] = statistics.median(vals)
    out["host_during_dma_GBps"] = conc
    print("during dma", json.dumps({k: round(v, 1) for k, v in conc.items()}), flush=True)

    # end to end: stage_h2d / stage_d2h of the same 4 KiB runs, 16 and 8 packing threads
    z = np.zeros(n_runs, np.int64)
    d = np.stack([offs // 4, z, np.arange(n_runs) * (RUN // 4), z, z + RUN // 4, z + 1], 1)
    desc = torch.from_numpy(d)
    rev = torch.from_numpy(d[:, [2, 3, 0, 1, 4, 5]].copy())
    e2e = {}
    for threads in (16, 8):
        torch.set_num_threads(threads)
        for k, t in bufs.items():
            e2e[f"h2d {k} t{threads}"] = lambda t=t: ops.stage_h2d(t, desc, ring, dev)
            e2e[f"d2h {k} t{threads}"] = lambda t=t: ops.stage_d2h(dev, rev, ring, t)
    e2e["contiguous h2d"] = lambda: dev.copy_(big, non_blocking=True)
    e2e["contiguous d2h"] = lambda: big.copy_(dev, non_blocking=True)
    times = {k: [] for k in e2e}
    for f in e2e.values():
        f()
    torch.cuda.synchronize()
    for _ in range(3):
        for k, f in e2e.items():
            torch.set_num_threads(8 if " t8" in k else 16)
            torch.cuda.synchronize()
            t = time.perf_counter()
            f()
            torch.cuda.synchronize()
            times[k].append(time.perf_counter() - t)
    torch.set_num_threads(16)
    e2e_out = {}
    for k, v in times.items():
        direction = k.split()[-1] if k.startswith("contiguous") else k[:3]
        floor = TOTAL / statistics.median(times["contiguous " + direction]) / GB
        gbps = TOTAL / statistics.median(v) / GB
        e2e_out[k] = {"GBps": gbps, "of_contiguous_pinned": gbps / floor}
    out["stage_e2e"] = e2e_out
    print("e2e", json.dumps({k: round(v["of_contiguous_pinned"], 3) for k, v in e2e_out.items()}))
    torch.ops.reshard.host_unregister(bufs["R"])
    json.dump(out, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
