#!/usr/bin/env bash
# Session 12 final call (C): build the branch, the progress ops' refusals, the stream probe (this
# branch against main's Stream, interleaved), sync_latency's stream rows, then every GPU test.
set -u -o pipefail
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16
R=/tmp/c12c; rm -rf $R; mkdir -p $R
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
pack() { tar czf $OUT/c12c.tar.gz -C /tmp c12c; }
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nproc; uptime; echo "branch issued at ${COMMIT:-?}"; } >$R/env.txt 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/{deepspeed,hjson,pydantic,pydantic_core,annotated_types}-[0-9]*.whl .whl/typing_{inspection,extensions}-[0-9]*.whl >$R/wheels.log 2>&1
timeout 240 python3 setup.py -q build_clib build_ext --inplace >$R/build.log 2>&1; echo "build rc=$? t=$(el)"
export PYTHONPATH=/tmp/site:$PWD/python
timeout 60 python3 -m pytest -p no:cacheprovider -q tests/test_progress.py >$R/pytest_progress.log 2>&1; echo "progress tests rc=$? t=$(el)"
tail -3 $R/pytest_progress.log
uptime >>$R/env.txt
timeout 150 python3 benchmarks/stream_probe.py --json $R/stream_probe.json --models gpt-125m,gpt-350m --rounds 12 \
  --before .devscripts/before12 \
  --variants transfer,stream,stream_before,stream_nowrite,buckets_op,buckets_main >$R/stream_probe.log 2>&1; echo "probe rc=$? t=$(el)"
grep -E "^gpt|dropped|Error|error" $R/stream_probe.log | head -30
pack
timeout 150 python3 benchmarks/sync_latency.py --world 1 --device cuda --iters 20 \
  --scenarios stream_offload,offload_bf16 --models gpt-125m,gpt-350m --time-budget 115 \
  --json $R/sync_latency_h200.json >$R/sync_latency.log 2>&1; echo "sync rc=$? t=$(el)"
grep -E "^\| (stream|offload)" $R/sync_latency_h200.md | cut -c1-200 | head
pack
TT=$(( 585 - $(el) ))
echo "tests get ${TT}s"
python3 -m pytest --collect-only -q -p no:cacheprovider tests/gpu --ignore=tests/gpu/multi >$R/collected.txt 2>&1
timeout $TT python3 -m pytest -p no:cacheprovider --timeout 240 -rfEs -n 8 -v --durations=25 \
  tests/gpu --ignore=tests/gpu/multi >$R/pytest.log 2>&1; echo "tests rc=$? t=$(el)"
tail -40 $R/pytest.log | grep -vE "^\[gw" | tail -12
pack
