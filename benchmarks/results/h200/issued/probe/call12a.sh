#!/usr/bin/env bash
# Session 12 call A: build the branch, the GPU tests of the paths it touches, then the stream
# probe: this branch's Stream (tensors as their copies are queued) against main's, interleaved.
set -u -o pipefail
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16
R=/tmp/c12a; rm -rf $R; mkdir -p $R
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
pack() { tar czf $OUT/c12a.tar.gz -C /tmp c12a; }
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nproc; uptime; echo "branch issued at ${COMMIT:-?}"; } >$R/env.txt 2>&1
timeout 240 python3 setup.py -q build_clib build_ext --inplace >$R/build.log 2>&1; echo "build rc=$? t=$(el)"
tail -3 $R/build.log
export PYTHONPATH=$PWD/python
timeout 200 python3 -m pytest -p no:cacheprovider --timeout 120 -q -x -n 4 tests/gpu/test_stream_gpu.py tests/gpu/test_h2d_gpu.py tests/gpu/test_stage_cuda.py tests/test_progress.py >$R/pytest.log 2>&1; echo "tests rc=$? t=$(el)"
tail -15 $R/pytest.log
pack
uptime >>$R/env.txt
timeout 200 python3 benchmarks/stream_probe.py --json $R/stream_probe.json --models gpt-125m,gpt-350m --rounds 12 \
  --before .devscripts/before12 \
  --variants transfer,stream,stream_before,stream_nowrite,stream_t15,stream_before_t15 >$R/stream_probe.log 2>&1; echo "probe rc=$? t=$(el)"
grep -E "^gpt|dropped|Error|error" $R/stream_probe.log | head -30
pack
