#!/usr/bin/env bash
# main (c6cc27b) and this tree side by side: cold probe, timeline of this tree, sync_latency A/B
set -u -o pipefail
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0
ROOT=$PWD; R=$OUT/s14d; mkdir -p $R
rm -rf build python/reshard/_C*.so /tmp/m && mkdir -p /tmp/m && tar xzf benchmarks/results/h200/cold_path/probe/main.tgz -C /tmp/m
(cd /tmp/m && MAX_JOBS=8 timeout 200 python3 setup.py -q build_clib build_ext --inplace >$R/build_main.log 2>&1; echo "build main rc=$?") &
(MAX_JOBS=8 timeout 200 python3 setup.py -q build_clib build_ext --inplace >$R/build_lean.log 2>&1; echo "build lean rc=$?") &
wait
uptime
PYTHONPATH=python timeout 100 python3 benchmarks/results/h200/cold_path/probe/cold.py 15 2>&1 | tail -26
echo "== lean timeline"; PYTHONPATH=python timeout 120 python3 benchmarks/results/h200/cold_path/probe/timeline.py gpt-125m 20 2>&1 | tail -50
for i in 1 2; do
  for v in main lean; do
    d=$ROOT; [ $v = main ] && d=/tmp/m
    (cd $d && PYTHONPATH=python timeout 100 python3 benchmarks/sync_latency.py --world 1 --device cuda --iters 20 --scenarios stream_offload --models gpt-125m --time-budget 60 --json $R/sl_${v}_$i.json >$R/sl_${v}_$i.log 2>&1; echo "$v $i rc=$?")
    grep -E "^\| gpt" $R/sl_${v}_$i.md | cut -d'|' -f4,5,6,18,19,20 | head -4
  done
done
