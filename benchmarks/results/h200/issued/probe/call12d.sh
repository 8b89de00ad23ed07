#!/usr/bin/env bash
# Session 12 call D: the stream against the bare stage op of its buckets, same run (the probe's
# bucket variants), and sync_latency's stream rows on a second machine.
set -u -o pipefail
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16
R=/tmp/c12d; rm -rf $R; mkdir -p $R
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
pack() { tar czf $OUT/c12d.tar.gz -C /tmp c12d; }
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nproc; uptime; echo "branch issued at ${COMMIT:-?}"; } >$R/env.txt 2>&1
timeout 240 python3 setup.py -q build_clib build_ext --inplace >$R/build.log 2>&1; echo "build rc=$? t=$(el)"
export PYTHONPATH=$PWD/python
uptime >>$R/env.txt
timeout 200 python3 benchmarks/stream_probe.py --json $R/stream_probe.json --models gpt-125m,gpt-350m --rounds 12 \
  --before .devscripts/before12 \
  --variants transfer,stream,stream_before,stream_nowrite,buckets_op,buckets_h2d,buckets_main >$R/stream_probe.log 2>&1; echo "probe rc=$? t=$(el)"
grep -E "^gpt|dropped|Error|error" $R/stream_probe.log | head -30
pack
timeout 150 python3 benchmarks/sync_latency.py --world 1 --device cuda --iters 20 \
  --scenarios stream_offload --models gpt-125m,gpt-350m --time-budget 110 \
  --json $R/sync_latency_h200.json >$R/sync_latency.log 2>&1; echo "sync rc=$? t=$(el)"
grep -E "^\| gpt" $R/sync_latency_h200.md | cut -c1-120 | head -12
pack
