#!/usr/bin/env bash
# Call E: main's code (the final tree): the stream's packing team of 15 threads and a polling
# caller against 16 threads (probe/threads_ab.py), twice
set -u -o pipefail
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0
R=/tmp/s16e; mkdir -p $R $OUT; T0=$SECONDS
rm -rf build python/reshard/_C*.so
MAX_JOBS=16 timeout 240 python3 setup.py -q build_clib build_ext --inplace > $R/build.log 2>&1; echo "build rc=$? at $((SECONDS - T0)) s"
uptime
for i in 1 2; do
  PYTHONPATH=python timeout 150 python3 benchmarks/results/h200/tail_landed/probe/threads_ab.py gpt-125m 30 > $R/threads_$i.log 2>&1; echo "run $i rc=$?"; tail -12 $R/threads_$i.log
  tar czf $OUT/s16e.tgz -C /tmp s16e
done
echo "done at $((SECONDS - T0)) s"
