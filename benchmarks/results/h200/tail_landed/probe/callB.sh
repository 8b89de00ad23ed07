#!/usr/bin/env bash
# Call B (the tail halving, four chunks): a build with the probe-only tail switch, the A/B of
# ab.py, the whole GPU suite but multi-GPU (DeepSpeed from .whl), sync_latency's stream_offload
# row with main's Stream beside this tree's, and session 15's timeline of one sync
set -u -o pipefail
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0
R=/tmp/s16b; mkdir -p $R $OUT; T0=$SECONDS
P=benchmarks/results/h200/tail_landed/probe
save() { tar czf $OUT/s16b.tgz -C /tmp s16b; }
left() { echo $((560 - (SECONDS - T0))); }
# the probe-only switch: RESHARD_PROBE_NO_TAIL set = no tail (main's cuts); not on main
sed -i 's|#include <string.h>|#include <stdlib.h>\n#include <string.h>|' csrc/cuda/stage.cu
sed -i 's|  const int64_t least = std::min(RS_STAGE_QUEUE_LEAST_BYTES / q.wes, sub_elems);|  const int64_t least = getenv("RESHARD_PROBE_NO_TAIL") ? sub_elems : std::min(RS_STAGE_QUEUE_LEAST_BYTES / q.wes, sub_elems);|' csrc/cuda/stage.cu
echo "switch lines: $(grep -c RESHARD_PROBE_NO_TAIL csrc/cuda/stage.cu)"
rm -rf build python/reshard/_C*.so
MAX_JOBS=16 timeout 240 python3 setup.py -q build_clib build_ext --inplace > $R/build.log 2>&1; echo "build rc=$? at $((SECONDS - T0)) s"
uptime; lscpu | grep "Model name"; nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
PYTHONPATH=python timeout 100 python3 $P/ab.py .devscripts/s16/before gpt-125m 30 $R/ab1.json > $R/ab1.log 2>&1; echo "ab1 rc=$?"; tail -12 $R/ab1.log; save
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/{deepspeed,hjson,pydantic,pydantic_core,annotated_types}-[0-9]*.whl .whl/typing_{inspection,extensions}-[0-9]*.whl > $R/wheels.log 2>&1; echo "wheels rc=$?"
PYTHONPATH=python:/tmp/site timeout 240 python3 -m pytest -q -n 8 -p no:cacheprovider tests/gpu --ignore=tests/gpu/multi -rs > $R/pytest.log 2>&1; echo "pytest rc=$? at $((SECONDS - T0)) s"; tail -4 $R/pytest.log; save
for i in 1 2; do
  [ $(left) -lt 70 ] && break
  PYTHONPATH=python timeout 60 python3 benchmarks/sync_latency.py --world 1 --device cuda --iters 20 --scenarios stream_offload --models gpt-125m --methods reshard,stream_before,reshard_registered --stream-before .devscripts/s16/before --time-budget 40 --json $R/sl_$i.json > $R/sl_$i.log 2>&1; echo "sl $i rc=$?"
  grep -E "^\| gpt" $R/sl_$i.md | cut -d'|' -f2,4,5,18,19 | head -3
  save
done
[ $(left) -gt 60 ] && { PYTHONPATH=python timeout $(( $(left) - 10 )) python3 $P/ab.py .devscripts/s16/before gpt-125m 30 $R/ab2.json > $R/ab2.log 2>&1; echo "ab2 rc=$?"; tail -12 $R/ab2.log; }
[ $(left) -gt 50 ] && { PYTHONPATH=python timeout $(( $(left) - 5 )) python3 benchmarks/results/h200/cold_core/probe/timeline.py gpt-125m 20 > $R/timeline.log 2>&1; echo "timeline rc=$?"; tail -22 $R/timeline.log; }
save; echo "done at $((SECONDS - T0)) s"
