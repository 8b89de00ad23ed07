#!/usr/bin/env bash
# Session 20 probe call $1: clean build, let the host settle, the stream timeline, sync_latency rows.
set -u -o pipefail
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0
N=${1:-b}; R=/tmp/s20$N; mkdir -p $R $OUT; T0=$SECONDS; export R
save() { tar czf $OUT/s20$N.tgz -C /tmp s20$N; }
left() { echo $((560 - (SECONDS - T0))); }
nvidia-smi -L; uptime
rm -rf build python/reshard/_C*.so
MAX_JOBS=16 timeout 200 python3 setup.py -q build_clib build_ext --inplace > $R/build.log 2>&1; echo "build rc=$? at $((SECONDS - T0)) s"
for i in $(seq 12); do l=$(cut -d' ' -f1 /proc/loadavg); echo "load $l"; awk "BEGIN{exit !($l < 3)}" && break; sleep 5; done
PYTHONPATH=python timeout 120 python3 .devscripts/s20/timeline.py gpt-125m 15 > $R/timeline.log 2>&1; echo "timeline rc=$?"; cat $R/timeline.log | grep -v h2d_last; save
for i in 1 2 3; do
  [ $(left) -lt 55 ] && break
  PYTHONPATH=python timeout 50 python3 benchmarks/sync_latency.py --world 1 --device cuda --iters 20 --scenarios stream_offload --models gpt-125m --methods reshard,reshard_registered --time-budget 36 --json $R/sl_$i.json > $R/sl_$i.log 2>&1; echo "sl $i rc=$?"
  grep -E "^\| gpt" $R/sl_$i.md | cut -d'|' -f2,4,5,18,19 | head -2
  save
done
save; echo "done at $((SECONDS - T0)) s"
