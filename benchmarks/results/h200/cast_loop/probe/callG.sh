#!/usr/bin/env bash
# Session 13 call G: main before (d30ac04) and after (the written-out AVX-512 pack, the cached
# device staging size), built side by side, alternated three times on one machine.
set -u -o pipefail
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0
R=$OUT/s13g; mkdir -p $R
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
{ date -u; nproc; uptime; echo "main at ${COMMIT:-?}, before = d30ac04"; } >$R/env.txt 2>&1
mkdir -p /tmp/old && tar xzf .devscripts/s13/old.tgz -C /tmp/old
(cd /tmp/old && MAX_JOBS=8 timeout 200 python3 setup.py -q build_clib build_ext --inplace >$R/build_old.log 2>&1; echo "old build rc=$?") &
MAX_JOBS=8 timeout 200 python3 setup.py -q build_clib build_ext --inplace >$R/build_new.log 2>&1; echo "new build rc=$? t=$(el)"
wait; echo "builds t=$(el)"
one() {  # $1 = old|new, $2 = run index
  local dir=$PWD; [ "$1" = old ] && dir=/tmp/old
  (cd $dir && PYTHONPATH=$dir/python timeout 60 python3 benchmarks/stream_probe.py --json $R/probe_$1_$2.json --models gpt-125m --rounds 10 \
     --variants buckets_op,buckets_main,stream >$R/probe_$1_$2.log 2>&1)
  (cd $dir && PYTHONPATH=$dir/python timeout 60 python3 benchmarks/sync_latency.py --world 1 --device cuda --iters 20 --scenarios stream_offload \
     --models gpt-125m --time-budget 40 --json $R/sync_$1_$2.json >$R/sync_$1_$2.log 2>&1)
  echo "$1 $2 t=$(el)"
  grep -E "^gpt" $R/probe_$1_$2.log | cut -c1-60
  grep -E "^\| gpt" $R/sync_$1_$2.md | cut -c1-60 | head -2
}
for i in 1 2 3; do one old $i; one new $i; done
PYTHONPATH=$PWD/python timeout 100 python3 benchmarks/sync_latency.py --world 1 --device cuda --iters 20 \
  --scenarios stream_offload,offload_bf16 --models gpt-125m,gpt-350m --time-budget 80 \
  --json $R/sync_latency_h200.json >$R/sync_latency.log 2>&1; echo "row rc=$? t=$(el)"
grep -E "^\| (stream|offload)" $R/sync_latency_h200.md | cut -c1-120 | head -12
