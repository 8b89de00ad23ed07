#!/usr/bin/env bash
# Session 12 call F: main's head on another fresh machine: the host's cast rate (host_bw-free:
# stream_probe's bare bucket op) and sync_latency's stream rows.
set -u -o pipefail
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16
R=/tmp/c12f; rm -rf $R; mkdir -p $R
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
pack() { tar czf $OUT/c12f.tar.gz -C /tmp c12f; }
{ date -u; nproc; uptime; echo "main at ${COMMIT:-?}"; } >$R/env.txt 2>&1
timeout 240 python3 setup.py -q build_clib build_ext --inplace >$R/build.log 2>&1; echo "build rc=$? t=$(el)"
export PYTHONPATH=$PWD/python
timeout 110 python3 benchmarks/sync_latency.py --world 1 --device cuda --iters 20 \
  --scenarios stream_offload --models gpt-125m,gpt-350m --time-budget 80 \
  --json $R/sync_latency_h200.json >$R/sync_latency.log 2>&1; echo "sync rc=$? t=$(el)"
grep -E "^\| gpt" $R/sync_latency_h200.md | cut -c1-100 | head -12
pack
