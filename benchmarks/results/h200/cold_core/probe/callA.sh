#!/usr/bin/env bash
# which caches the cold calls miss in (where.py), this tree's timeline and stream_offload rows
set -u -o pipefail
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0
R=/tmp/s15a; mkdir -p $R $OUT
P=benchmarks/results/h200/cold_core/probe
save() { tar czf $OUT/s15a.tgz -C /tmp s15a; }
rm -rf build python/reshard/_C*.so
MAX_JOBS=16 timeout 200 python3 setup.py -q build_clib build_ext --inplace >$R/build.log 2>&1; echo "build rc=$?"
uptime; nproc; cat /sys/kernel/mm/transparent_hugepage/enabled; lscpu | grep -E "Model name|L2|L3|NUMA node0"
PYTHONPATH=python timeout 150 python3 $P/where.py 21 >$R/where.log 2>&1; echo "where rc=$?"; cat $R/where.log; save
for i in 1 2; do
  PYTHONPATH=python timeout 60 python3 benchmarks/sync_latency.py --world 1 --device cuda --iters 20 --scenarios stream_offload --models gpt-125m --methods reshard,reshard_registered --time-budget 50 --json $R/sl_$i.json >$R/sl_$i.log 2>&1; echo "sl $i rc=$?"
  grep -E "^\| gpt" $R/sl_$i.md | cut -d'|' -f4,5,6,18,19,20 | head -3
done
PYTHONPATH=python timeout 80 python3 benchmarks/results/h200/cold_path/probe/timeline.py gpt-125m 20 >$R/timeline.log 2>&1; tail -6 $R/timeline.log
save
