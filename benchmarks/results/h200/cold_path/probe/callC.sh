#!/usr/bin/env bash
# main (c6cc27b) and this tree side by side: both built, timelines alternated
set -u -o pipefail
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0
ROOT=$PWD; R=$OUT/s14c; mkdir -p $R
rm -rf build python/reshard/_C*.so /tmp/m && mkdir -p /tmp/m && tar xzf benchmarks/results/h200/cold_path/probe/main.tgz -C /tmp/m
(cd /tmp/m && MAX_JOBS=8 timeout 200 python3 setup.py -q build_clib build_ext --inplace >$R/build_main.log 2>&1; echo "build main rc=$?") &
(MAX_JOBS=8 timeout 200 python3 setup.py -q build_clib build_ext --inplace >$R/build_lean.log 2>&1; echo "build lean rc=$?") &
wait
uptime
PYTHONPATH=python timeout 200 python3 benchmarks/results/h200/cold_path/probe/cold.py 25 2>&1 | tail -30
for i in 1 2; do
  echo "== main $i"; (cd /tmp/m && PYTHONPATH=python timeout 120 python3 $ROOT/benchmarks/results/h200/cold_path/probe/timeline.py gpt-125m 20 2>&1 | tail -50)
  echo "== lean $i"; PYTHONPATH=python timeout 120 python3 benchmarks/results/h200/cold_path/probe/timeline.py gpt-125m 20 2>&1 | tail -50
done
echo "== gpu stream/h2d tests (lean)"
PYTHONPATH=python timeout 240 python3 -m pytest -q -x tests/gpu/test_stream_gpu.py tests/gpu/test_h2d_gpu.py -p no:cacheprovider 2>&1 | tail -5
