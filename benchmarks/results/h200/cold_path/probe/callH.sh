#!/usr/bin/env bash
# more same-machine pairs: sync_latency stream_offload gpt-125m, main (c6cc27b) against this tree
set -u -o pipefail
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0
ROOT=$PWD; R=/tmp/s14h; mkdir -p $R $OUT
save() { tar czf $OUT/s14h.tgz -C /tmp s14h; }
rm -rf build python/reshard/_C*.so /tmp/m && mkdir -p /tmp/m && tar xzf benchmarks/results/h200/cold_path/probe/main.tgz -C /tmp/m
(cd /tmp/m && MAX_JOBS=8 timeout 200 python3 setup.py -q build_clib build_ext --inplace >$R/build_main.log 2>&1; echo "build main rc=$?") &
(MAX_JOBS=8 timeout 200 python3 setup.py -q build_clib build_ext --inplace >$R/build_head.log 2>&1; echo "build head rc=$?") &
wait
uptime
for i in 1 2 3 4 5 6; do
  for v in main head; do
    d=$ROOT; [ $v = main ] && d=/tmp/m
    (cd $d && PYTHONPATH=python timeout 40 python3 benchmarks/sync_latency.py --world 1 --device cuda --iters 20 --scenarios stream_offload --models gpt-125m --methods reshard,reshard_registered --time-budget 30 --json $R/sl_${v}_$i.json >$R/sl_${v}_$i.log 2>&1; echo "$v $i rc=$?")
    grep -E "^\| gpt" $R/sl_${v}_$i.md | cut -d'|' -f4,5,6,18,19,20 | head -3
  done
  save
done
