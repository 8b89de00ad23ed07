#!/usr/bin/env bash
# Session 13 call C: where the stream's time goes beyond the bare op, one machine.
set -u -o pipefail
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16
R=$OUT/s13c; mkdir -p $R
{ date -u; uptime; echo "main at ${COMMIT:-?}"; } >$R/env.txt
timeout 100 python3 setup.py -q build_clib build_ext --inplace >$R/build.log 2>&1; echo "build rc=$?"
export PYTHONPATH=$PWD/python
nvcc -O3 -std=c++17 -Xcompiler -fopenmp -Xcompiler -O3 .devscripts/s13/cast_probe.cu -o /tmp/cast_probe -lgomp
timeout 30 /tmp/cast_probe 3 15 >$R/cast15.log 2>&1; head -2 $R/cast15.log
timeout 150 python3 benchmarks/stream_probe.py --json $R/probe.json --models gpt-125m --rounds 15 \
  --variants transfer,transfer_cast64,buckets_h2d,buckets_op,buckets_op_cast64,stream,stream_cast64,stream_nowrite \
  --stage 123551232:1 >$R/probe.log 2>&1; echo "probe rc=$?"
grep -vi "round\|^ *$" $R/probe.log | cut -c1-220 | tail -30
