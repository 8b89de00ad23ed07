#!/usr/bin/env bash
# Session 13 final call (H): main as it lands: every GPU test, then the stream rows.
set -u -o pipefail
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16
R=/tmp/s13i; rm -rf $R; mkdir -p $R
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
pack() { tar czf $OUT/s13i.tar.gz -C /tmp s13i; }
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nproc; uptime; echo "main at ${COMMIT:-?}"; } >$R/env.txt 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/{deepspeed,hjson,pydantic,pydantic_core,annotated_types}-[0-9]*.whl .whl/typing_{inspection,extensions}-[0-9]*.whl >$R/wheels.log 2>&1
rm -rf build python/reshard/_C*.so; timeout 200 python3 setup.py -q build_clib build_ext --inplace >$R/build.log 2>&1; echo "build rc=$? t=$(el)"
export PYTHONPATH=/tmp/site:$PWD/python
timeout 300 python3 -m pytest -p no:cacheprovider --timeout 240 -rfEs -n 8 -q tests/gpu --ignore=tests/gpu/multi >$R/pytest.log 2>&1; echo "tests rc=$? t=$(el)"
tail -12 $R/pytest.log
pack
[ $(el) -lt 330 ] && timeout 45 python3 benchmarks/sync_latency.py --world 1 --device cuda --iters 20 --scenarios stream_offload \
  --models gpt-125m --time-budget 40 --json $R/sync_latency_h200.json >$R/sync_latency.log 2>&1; echo "row rc=$? t=$(el)"
grep -E "^\| gpt" $R/sync_latency_h200.md | cut -c1-100 | head -6
pack
