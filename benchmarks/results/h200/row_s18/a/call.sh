#!/usr/bin/env bash
# Call A (session 18): a fresh machine, nothing run before the row but the build. The stream's
# row with its pack team at 15 (default), 14 and 13 threads (caller count 16/15/14 through
# OMP_NUM_THREADS), rotated; vmstat every second records steal time beside each run.
set -u -o pipefail
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0
R=/tmp/s18a; mkdir -p $R $OUT; T0=$SECONDS
save() { tar czf $OUT/s18a.tgz -C /tmp s18a; }
left() { echo $((575 - (SECONDS - T0))); }
vmstat -t 1 > $R/vmstat.log 2>&1 &
VM=$!
lscpu > $R/lscpu.txt; nvidia-smi > $R/nvidia-smi.txt 2>&1
rm -rf build python/reshard/_C*.so
MAX_JOBS=16 timeout 200 python3 setup.py -q build_clib build_ext --inplace > $R/build.log 2>&1; echo "build rc=$? at $((SECONDS - T0)) s"
sleep 15; uptime; ps -eo pcpu,comm --sort=-pcpu | head -5
n=0
for round in 1 2 3; do
  for t in 16 15 14; do
    [ $(left) -lt 45 ] && break 2
    n=$((n + 1)); echo "run $n threads $t start $(date +%T)" | tee -a $R/runs.txt
    OMP_NUM_THREADS=$t PYTHONPATH=python timeout 40 python3 benchmarks/sync_latency.py --world 1 --device cuda --iters 20 --scenarios stream_offload --models gpt-125m --methods reshard,reshard_registered --time-budget 28 --json $R/sl_${n}_t$t.json > $R/sl_${n}_t$t.log 2>&1; echo "  rc=$? end $(date +%T)" | tee -a $R/runs.txt
    grep -E "^\| gpt" $R/sl_${n}_t$t.md | cut -d'|' -f2,4,5,18,19 | head -2
  done
  save
done
kill $VM; save; echo "done at $((SECONDS - T0)) s"
