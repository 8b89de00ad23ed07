#!/usr/bin/env bash
# Session 20 call $1: clean build, the GPU suite without multi (DeepSpeed from .whl), then
# sync_latency's stream_offload row (gpt-125m) up to three times.
set -u -o pipefail
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0
N=${1:-a}; R=/tmp/s20$N; mkdir -p $R $OUT; T0=$SECONDS
save() { tar czf $OUT/s20$N.tgz -C /tmp s20$N; }
left() { echo $((570 - (SECONDS - T0))); }
nvidia-smi -L; uptime
rm -rf build python/reshard/_C*.so
MAX_JOBS=16 timeout 200 python3 setup.py -q build_clib build_ext --inplace > $R/build.log 2>&1; echo "build rc=$? at $((SECONDS - T0)) s"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/{deepspeed,hjson,pydantic,pydantic_core,annotated_types}-[0-9]*.whl .whl/typing_{inspection,extensions}-[0-9]*.whl > $R/wheels.log 2>&1; echo "wheels rc=$?"
PYTHONPATH=python:/tmp/site timeout 300 python3 -m pytest -q -n 8 -p no:cacheprovider tests/gpu --ignore=tests/gpu/multi -rs > $R/pytest.log 2>&1; echo "pytest rc=$? at $((SECONDS - T0)) s"; tail -12 $R/pytest.log; save
for i in 1 2 3; do
  [ $(left) -lt 55 ] && break
  PYTHONPATH=python timeout 50 python3 benchmarks/sync_latency.py --world 1 --device cuda --iters 20 --scenarios stream_offload --models gpt-125m --methods reshard,reshard_registered --time-budget 36 --json $R/sl_$i.json > $R/sl_$i.log 2>&1; echo "sl $i rc=$?"
  grep -E "^\| gpt" $R/sl_$i.md | cut -d'|' -f2,4,5,18,19 | head -2
  save
done
save; echo "done at $((SECONDS - T0)) s"
