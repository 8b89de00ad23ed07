#!/usr/bin/env bash
# Call C: the final tree (main's stage_h2d and stream, a new GPU test of the queue's sizes): a
# clean build, the GPU tests of staging, h2d and the stream, and sync_latency's stream_offload row
set -u -o pipefail
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0
R=/tmp/s16c; mkdir -p $R $OUT; T0=$SECONDS
save() { tar czf $OUT/s16c.tgz -C /tmp s16c; }
left() { echo $((560 - (SECONDS - T0))); }
rm -rf build python/reshard/_C*.so
MAX_JOBS=16 timeout 240 python3 setup.py -q build_clib build_ext --inplace > $R/build.log 2>&1; echo "build rc=$? at $((SECONDS - T0)) s"
uptime; git log --oneline -1 2>/dev/null
PYTHONPATH=python timeout 200 python3 -m pytest -q -n 8 -p no:cacheprovider tests/gpu/test_h2d_gpu.py tests/gpu/test_stream_gpu.py tests/gpu/test_stage_cuda.py -rs > $R/pytest.log 2>&1; echo "pytest rc=$? at $((SECONDS - T0)) s"; tail -3 $R/pytest.log; save
for i in 1 2 3 4; do
  [ $(left) -lt 60 ] && break
  PYTHONPATH=python timeout 55 python3 benchmarks/sync_latency.py --world 1 --device cuda --iters 20 --scenarios stream_offload --models gpt-125m --methods reshard,reshard_registered --time-budget 40 --json $R/sl_$i.json > $R/sl_$i.log 2>&1; echo "sl $i rc=$?"
  grep -E "^\| gpt" $R/sl_$i.md | cut -d'|' -f2,4,5,18,19 | head -2
  save
done
save; echo "done at $((SECONDS - T0)) s"
