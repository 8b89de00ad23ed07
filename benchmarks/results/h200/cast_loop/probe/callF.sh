#!/usr/bin/env bash
set -u -o pipefail
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16
R=$OUT/s13f; mkdir -p $R
python3 -c "import sys; sys.path.insert(0,'python'); import reshard" 2>/dev/null || timeout 100 python3 setup.py -q build_clib build_ext --inplace >$R/build.log 2>&1
export PYTHONPATH=$PWD/python
timeout 60 python3 benchmarks/sync_latency.py --world 1 --device cuda --iters 20 --scenarios stream_offload --models gpt-125m --time-budget 40 --json $R/sync_latency_h200.json >$R/sync_latency.log 2>&1; echo "sync rc=$?"
grep -E "^\| gpt" $R/sync_latency_h200.md | cut -c1-120
timeout 120 python3 benchmarks/stream_probe.py --json $R/probe.json --models gpt-125m --rounds 16 \
  --variants buckets_op,buckets_main,stream_nowrite,stream >$R/probe.log 2>&1; echo "probe rc=$?"
grep -E "^gpt" $R/probe.log | cut -c1-150
python3 - $R/probe.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for row in d["models"][0]["rows"]:
    t = sorted(row["times"]); print(f'{row["method"]:16s} min {t[0]*1e3:6.2f} p25 {t[len(t)//4]*1e3:6.2f} med {t[len(t)//2]*1e3:6.2f}')
for k, v in d["models"][0].get("timelines", {}).items():
    print(k, {a: round(b * 1e3, 3) for a, b in v.get("seconds", {}).items()}, "wait", round(v.get("wait_s", 0) * 1e3, 3), v.get("rows"))
PY
