#!/usr/bin/env bash
set -u -o pipefail
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16
R=$OUT/s14a; mkdir -p $R
rm -rf build python/reshard/_C*.so
timeout 150 python3 setup.py -q build_clib build_ext --inplace >$R/build.log 2>&1; echo "build rc=$?"
export PYTHONPATH=$PWD/python
nproc; uptime
for env in "" "OMP_WAIT_POLICY=passive"; do
  echo "== timeline $env"
  env $env timeout 120 python3 benchmarks/results/h200/cold_path/probe/timeline.py gpt-125m 20 2>&1 | tail -48
done
timeout 90 python3 benchmarks/sync_latency.py --world 1 --device cuda --iters 20 --scenarios stream_offload --models gpt-125m --time-budget 60 --json $R/sync_latency_h200.json >$R/sync_latency.log 2>&1; echo "sync rc=$?"
grep -E "^\| gpt" $R/sync_latency_h200.md | cut -c1-140
echo "== timeline again"
timeout 120 python3 benchmarks/results/h200/cold_path/probe/timeline.py gpt-125m 20 2>&1 | tail -48
