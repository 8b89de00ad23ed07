#!/usr/bin/env bash
# main (c6cc27b) and this tree side by side: GPU tests of this tree, sync_latency A/B x3
set -u -o pipefail
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0
ROOT=$PWD; R=/tmp/s14e; mkdir -p $R $OUT
rm -rf build python/reshard/_C*.so /tmp/m && mkdir -p /tmp/m && tar xzf benchmarks/results/h200/cold_path/probe/main.tgz -C /tmp/m
(cd /tmp/m && MAX_JOBS=8 timeout 200 python3 setup.py -q build_clib build_ext --inplace >$R/build_main.log 2>&1; echo "build main rc=$?") &
(MAX_JOBS=8 timeout 200 python3 setup.py -q build_clib build_ext --inplace >$R/build_lean.log 2>&1; echo "build lean rc=$?") &
wait
uptime
PYTHONPATH=python timeout 200 python3 -m pytest -q -n 4 -p no:cacheprovider tests/gpu/test_stage_cuda.py tests/gpu/test_stream_gpu.py tests/gpu/test_h2d_gpu.py tests/gpu/test_execute_gpu.py >$R/pytest.log 2>&1; echo "pytest rc=$?"; tail -3 $R/pytest.log
for i in 1 2; do
  for v in main lean; do
    d=$ROOT; [ $v = main ] && d=/tmp/m
    (cd $d && PYTHONPATH=python timeout 100 python3 benchmarks/sync_latency.py --world 1 --device cuda --iters 20 --scenarios stream_offload --models gpt-125m --methods reshard,reshard_registered --time-budget 60 --json $R/sl_${v}_$i.json >$R/sl_${v}_$i.log 2>&1; echo "$v $i rc=$?")
    grep -E "^\| gpt" $R/sl_${v}_$i.md | cut -d'|' -f4,5,6,18,19,20 | head -3
  done
done

tar czf $OUT/s14e.tgz -C /tmp s14e
