#!/usr/bin/env bash
# Call D: main's op (the final tree), tables whose last queue chunk is small (probe/last_chunk.py)
set -u -o pipefail
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0
R=/tmp/s16d; mkdir -p $R $OUT; T0=$SECONDS
rm -rf build python/reshard/_C*.so
MAX_JOBS=16 timeout 240 python3 setup.py -q build_clib build_ext --inplace > $R/build.log 2>&1; echo "build rc=$? at $((SECONDS - T0)) s"
uptime
for t in 16 15 8; do
  PYTHONPATH=python timeout 120 python3 benchmarks/results/h200/tail_landed/probe/last_chunk.py 25 $t > $R/last_chunk_t$t.log 2>&1; echo "t$t rc=$?"; cat $R/last_chunk_t$t.log
done
tar czf $OUT/s16d.tgz -C /tmp s16d; echo "done at $((SECONDS - T0)) s"
