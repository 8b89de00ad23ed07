#!/usr/bin/env bash
# main (51d5168) against this tree: the stream and h2d GPU tests, then sync_latency
# stream_offload gpt-125m pairs
set -u -o pipefail
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0
ROOT=$PWD; R=/tmp/s15e; mkdir -p $R $OUT
P=benchmarks/results/h200/cold_core/probe
save() { tar czf $OUT/s15e.tgz -C /tmp s15e; }
rm -rf build python/reshard/_C*.so /tmp/main && mkdir -p /tmp/main && tar xzf .devscripts/s15/main.tgz -C /tmp/main
for d in /tmp/main $ROOT; do
  (cd $d && MAX_JOBS=8 timeout 200 python3 setup.py -q build_clib build_ext --inplace >$R/build_$(basename $d).log 2>&1; echo "build $d rc=$?") &
done
wait
uptime
PYTHONPATH=python timeout 90 python3 -m pytest -q -n 4 -p no:cacheprovider tests/gpu/test_stream_gpu.py tests/gpu/test_h2d_gpu.py >$R/pytest.log 2>&1; echo "pytest rc=$?"; tail -1 $R/pytest.log
dir() { case $1 in main) echo /tmp/main;; head) echo $ROOT;; esac; }
for i in 1 2 3; do
  for v in main head; do
    (cd $(dir $v) && PYTHONPATH=python timeout 30 python3 benchmarks/sync_latency.py --world 1 --device cuda --iters 20 --scenarios stream_offload --models gpt-125m --methods reshard,reshard_registered --time-budget 25 --json $R/sl_${v}_$i.json >$R/sl_${v}_$i.log 2>&1)
    echo "$v $i: $(grep -E '^\| gpt' $R/sl_${v}_$i.md | cut -d'|' -f4,5,19 | head -2 | tr '\n' ' ')"
  done
  save
done
