#!/usr/bin/env bash
# the event ops: GPU tests, then sync_latency stream_offload gpt-125m pairs of main (51d5168)
# against this tree, and a timeline of each with the caller's waits and writes counted
set -u -o pipefail
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0
ROOT=$PWD; R=/tmp/s15b; mkdir -p $R $OUT
P=benchmarks/results/h200/cold_core/probe
save() { tar czf $OUT/s15b.tgz -C /tmp s15b; }
rm -rf build python/reshard/_C*.so /tmp/m && mkdir -p /tmp/m && tar xzf .devscripts/s15/main.tgz -C /tmp/m
(cd /tmp/m && MAX_JOBS=8 timeout 200 python3 setup.py -q build_clib build_ext --inplace >$R/build_main.log 2>&1; echo "build main rc=$?") &
(MAX_JOBS=8 timeout 200 python3 setup.py -q build_clib build_ext --inplace >$R/build_head.log 2>&1; echo "build head rc=$?") &
wait
uptime
PYTHONPATH=python timeout 200 python3 -m pytest -q -n 8 -p no:cacheprovider tests/gpu/test_events_cuda.py tests/gpu/test_stream_gpu.py tests/gpu/test_h2d_gpu.py -rs >$R/pytest.log 2>&1; echo "pytest rc=$?"; tail -3 $R/pytest.log; save
for i in 1 2 3 4 5; do
  for v in main head; do
    d=$ROOT; [ $v = main ] && d=/tmp/m
    (cd $d && PYTHONPATH=python timeout 40 python3 benchmarks/sync_latency.py --world 1 --device cuda --iters 20 --scenarios stream_offload --models gpt-125m --methods reshard,reshard_registered --time-budget 30 --json $R/sl_${v}_$i.json >$R/sl_${v}_$i.log 2>&1; echo "$v $i rc=$?")
    grep -E "^\| gpt" $R/sl_${v}_$i.md | cut -d'|' -f4,5,6,18,19,20 | head -3
  done
  save
done
(cd /tmp/m && PYTHONPATH=python timeout 80 python3 $ROOT/$P/timeline.py gpt-125m 20 > $R/timeline_main.log 2>&1); tail -6 $R/timeline_main.log
PYTHONPATH=python timeout 80 python3 $P/timeline.py gpt-125m 20 > $R/timeline_head.log 2>&1; tail -6 $R/timeline_head.log
save
