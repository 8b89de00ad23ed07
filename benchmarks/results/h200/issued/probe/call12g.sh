#!/usr/bin/env bash
# Session 12 call G: build, the stream and h2d GPU tests, the registered stream row.
set -u -o pipefail
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16
R=/tmp/c12g; rm -rf $R; mkdir -p $R
{ date -u; echo "main at ${COMMIT:-?}"; } >$R/env.txt
timeout 100 python3 setup.py -q build_clib build_ext --inplace >$R/build.log 2>&1; echo "build rc=$?"
export PYTHONPATH=$PWD/python
timeout 60 python3 -m pytest -p no:cacheprovider --timeout 50 -q -n 8 tests/gpu/test_stream_gpu.py tests/gpu/test_h2d_gpu.py >$R/pytest.log 2>&1; echo "tests rc=$?"
tail -2 $R/pytest.log
tar czf $OUT/c12g.tar.gz -C /tmp c12g
timeout 45 python3 benchmarks/sync_latency.py --world 1 --device cuda --iters 20 --scenarios stream_offload --models gpt-125m --time-budget 30 --json $R/sync_latency_h200.json >$R/sync_latency.log 2>&1; echo "sync rc=$?"
grep -E "^\| gpt" $R/sync_latency_h200.md | cut -c1-90
tar czf $OUT/c12g.tar.gz -C /tmp c12g
