#!/usr/bin/env bash
# final: this tree's whole GPU suite (no multi), sync_latency A/B x4 against main (c6cc27b),
# this tree's full stream_offload row, a timeline of each
set -u -o pipefail
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0
ROOT=$PWD; R=/tmp/s14f; mkdir -p $R $OUT
save() { tar czf $OUT/s14f.tgz -C /tmp s14f; }
rm -rf build python/reshard/_C*.so /tmp/m && mkdir -p /tmp/m && tar xzf benchmarks/results/h200/cold_path/probe/main.tgz -C /tmp/m
(cd /tmp/m && MAX_JOBS=8 timeout 200 python3 setup.py -q build_clib build_ext --inplace >$R/build_main.log 2>&1; echo "build main rc=$?") &
(MAX_JOBS=8 timeout 200 python3 setup.py -q build_clib build_ext --inplace >$R/build_lean.log 2>&1; echo "build lean rc=$?") &
wait
uptime; git -C $ROOT log --oneline -1 2>/dev/null
PYTHONPATH=python timeout 280 python3 -m pytest -q -n 8 -p no:cacheprovider tests/gpu --ignore=tests/gpu/multi -rs >$R/pytest.log 2>&1; echo "pytest rc=$?"; tail -3 $R/pytest.log; save
for i in 1 2 3 4; do
  for v in main lean; do
    d=$ROOT; [ $v = main ] && d=/tmp/m
    (cd $d && PYTHONPATH=python timeout 60 python3 benchmarks/sync_latency.py --world 1 --device cuda --iters 20 --scenarios stream_offload --models gpt-125m --methods reshard,reshard_registered --time-budget 50 --json $R/sl_${v}_$i.json >$R/sl_${v}_$i.log 2>&1; echo "$v $i rc=$?")
    grep -E "^\| gpt" $R/sl_${v}_$i.md | cut -d'|' -f4,5,6,18,19,20 | head -3
  done
done
save
PYTHONPATH=python timeout 100 python3 benchmarks/sync_latency.py --world 1 --device cuda --iters 20 --scenarios stream_offload --models gpt-125m --time-budget 80 --json $R/sync_latency_h200.json >$R/sync_latency.log 2>&1; echo "full rc=$?"
grep -E "^\| gpt" $R/sync_latency_h200.md | cut -d'|' -f4,5,6,18,19,20; save
(cd /tmp/m && PYTHONPATH=python timeout 80 python3 $ROOT/benchmarks/results/h200/cold_path/probe/timeline.py gpt-125m 20 > $R/timeline_main.log 2>&1); tail -4 $R/timeline_main.log
PYTHONPATH=python timeout 80 python3 benchmarks/results/h200/cold_path/probe/timeline.py gpt-125m 20 > $R/timeline_lean.log 2>&1; tail -4 $R/timeline_lean.log
save
