#!/usr/bin/env bash
# Session 22 row call $1: clean build, then on the settled host the stream timeline and the
# stream_offload row three times (no GPU suite: the final code's suite ran in call a).
set -u -o pipefail
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0
N=${1:-b}; R=/tmp/s22$N; mkdir -p $R $OUT; T0=$SECONDS
save() { tar czf $OUT/s22$N.tgz -C /tmp s22$N; }
nvidia-smi -L; uptime
rm -rf build python/reshard/_C*.so
MAX_JOBS=16 timeout 200 python3 setup.py -q build_clib build_ext --inplace > $R/build.log 2>&1; echo "build rc=$? at $((SECONDS - T0)) s"
for i in $(seq 24); do l=$(cut -d' ' -f1 /proc/loadavg); awk "BEGIN{exit !($l < 3)}" && break; sleep 5; done; echo "load $(cut -d' ' -f1-3 /proc/loadavg)"
PYTHONPATH=python timeout 50 python3 benchmarks/stream_timeline.py --models gpt-125m --iters 15 --json $R/timeline.json > $R/timeline.log 2>&1; echo "timeline rc=$?"; cat $R/timeline.log; save
for i in 1 2 3; do
  PYTHONPATH=python timeout 45 python3 benchmarks/sync_latency.py --world 1 --device cuda --iters 20 --scenarios stream_offload --models gpt-125m --methods reshard,reshard_registered --time-budget 32 --json $R/sl_$i.json > $R/sl_$i.log 2>&1; echo "sl $i rc=$?"
  grep -E "^\| gpt-125m" $R/sl_$i.log | cut -d"|" -f4,5,6,19 | head -2; save
done
save; echo "done at $((SECONDS - T0)) s"
