#!/usr/bin/env bash
# Call G (session 17): the shrinking tail (cd206c5 + probe switch) timed alone, then main's row
set -u -o pipefail
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0
R=/tmp/s17a; mkdir -p $R $OUT; T0=$SECONDS
save() { tar czf $OUT/s17a.tgz -C /tmp s17a; }
left() { echo $((560 - (SECONDS - T0))); }
# .devscripts/s17/tail.tar: git archive --format=tar -o .devscripts/s17/tail.tar cd206c5 csrc python \
#   setup.py pyproject.toml Makefile $(git ls-tree --name-only cd206c5 benchmarks/ | grep "\.py$")
TT=/tmp/tailtree; mkdir -p $TT; tar xf .devscripts/s17/tail.tar -C $TT
cd $TT
sed -i 's|#include <string.h>|#include <stdlib.h>\n#include <string.h>|' csrc/cuda/stage.cu
sed -i 's|  const int64_t least = std::min(RS_STAGE_QUEUE_LEAST_BYTES / q.wes, sub_elems);|  const int64_t least = getenv("RESHARD_PROBE_NO_TAIL") ? sub_elems : std::min(RS_STAGE_QUEUE_LEAST_BYTES / q.wes, sub_elems);|' csrc/cuda/stage.cu
echo "switch lines: $(grep -c RESHARD_PROBE_NO_TAIL csrc/cuda/stage.cu)"
MAX_JOBS=16 timeout 200 python3 setup.py -q build_clib build_ext --inplace > $R/build_tail.log 2>&1; echo "tail build rc=$? at $((SECONDS - T0)) s"
cd - > /dev/null
rm -rf build python/reshard/_C*.so
MAX_JOBS=16 timeout 200 python3 setup.py -q build_clib build_ext --inplace > $R/build.log 2>&1; echo "main build rc=$? at $((SECONDS - T0)) s"
uptime; lscpu | grep "Model name"
for i in 1 2; do
  (cd $TT && PYTHONPATH=python timeout 90 python3 $OLDPWD/benchmarks/results/h200/tail_landed/probe/tail_alone.py gpt-125m 40 $R/tail_$i.json > $R/tail_$i.log 2>&1); echo "tail $i rc=$?"; cat $R/tail_$i.log | tail -5; save
done
for i in 1 2 3; do
  [ $(left) -lt 60 ] && break
  PYTHONPATH=python timeout 55 python3 benchmarks/sync_latency.py --world 1 --device cuda --iters 20 --scenarios stream_offload --models gpt-125m --methods reshard,reshard_registered --time-budget 40 --json $R/sl_$i.json > $R/sl_$i.log 2>&1; echo "sl $i rc=$?"
  grep -E "^\| gpt" $R/sl_$i.md | cut -d'|' -f2,4,5,18,19 | head -2
  save
done
save; echo "done at $((SECONDS - T0)) s"
