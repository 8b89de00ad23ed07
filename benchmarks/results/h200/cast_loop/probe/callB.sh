#!/usr/bin/env bash
# Session 13 call B: the same machine's real op and stream row (calibrates the cast probe).
set -u -o pipefail
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16
R=$OUT/s13b; mkdir -p $R
{ date -u; uptime; echo "main at ${COMMIT:-?}"; } >$R/env.txt
timeout 100 python3 setup.py -q build_clib build_ext --inplace >$R/build.log 2>&1; echo "build rc=$?"
export PYTHONPATH=$PWD/python
[ -x /tmp/cast_probe ] || nvcc -O3 -std=c++17 -Xcompiler -fopenmp -Xcompiler -O3 .devscripts/s13/cast_probe.cu -o /tmp/cast_probe -lgomp
timeout 60 python3 benchmarks/host_bw_probe.py --sections stage --elements 134217728 --json $R/stage.json >$R/stage.log 2>&1; echo "stage rc=$?"
grep "stage ring" $R/stage.log | cut -c1-250
timeout 60 python3 benchmarks/sync_latency.py --world 1 --device cuda --iters 20 --scenarios stream_offload --models gpt-125m --time-budget 40 --json $R/sync_latency_h200.json >$R/sync_latency.log 2>&1; echo "sync rc=$?"
grep -E "^\| gpt|^\| stream" $R/sync_latency_h200.md | cut -c1-200
timeout 60 /tmp/cast_probe 3 15 >$R/probe15.log 2>&1; head -3 $R/probe15.log
