#!/usr/bin/env bash
# Session 12 call E: build, the stream and h2d GPU tests (the early-stop test added after call C).
set -u -o pipefail
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16
R=/tmp/c12e; rm -rf $R; mkdir -p $R
{ date -u; echo "branch issued at ${COMMIT:-?}"; } >$R/env.txt
timeout 240 python3 setup.py -q build_clib build_ext --inplace >$R/build.log 2>&1; echo "build rc=$?"
export PYTHONPATH=$PWD/python
timeout 200 python3 -m pytest -p no:cacheprovider --timeout 120 -rfEs -n 4 -v tests/gpu/test_stream_gpu.py tests/gpu/test_h2d_gpu.py tests/gpu/test_stage_cuda.py tests/test_progress.py >$R/pytest.log 2>&1; echo "tests rc=$?"
tail -5 $R/pytest.log
tar czf $OUT/c12e.tar.gz -C /tmp c12e
