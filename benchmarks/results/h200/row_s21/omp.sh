#!/usr/bin/env bash
# Session 21 probe: the stream_offload row (gpt-125m, world 1) under libgomp's wait policy and
# thread binding, variants alternated in one call on one host.
set -u -o pipefail
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0
R=/tmp/s21omp; mkdir -p $R $OUT; T0=$SECONDS
save() { tar czf $OUT/s21omp.tgz -C /tmp s21omp; }
nvidia-smi -L; uptime; cat /sys/kernel/mm/transparent_hugepage/enabled
rm -rf build python/reshard/_C*.so
MAX_JOBS=16 timeout 200 python3 setup.py -q build_clib build_ext --inplace > $R/build.log 2>&1; echo "build rc=$? at $((SECONDS - T0)) s"
for i in $(seq 6); do l=$(cut -d' ' -f1 /proc/loadavg); awk "BEGIN{exit !($l < 3)}" && break; sleep 5; done; echo "load $(cut -d' ' -f1-3 /proc/loadavg)"
row() {  # name, env...
  local name=$1; shift
  env "$@" PYTHONPATH=python timeout 40 python3 benchmarks/sync_latency.py --world 1 --device cuda --iters 20 --scenarios stream_offload --models gpt-125m --methods reshard --time-budget 25 --json $R/$name.json > $R/$name.log 2>&1; echo "$name rc=$? at $((SECONDS - T0)) s"
  grep -E "^\| stream_offload" $R/$name.md | cut -c1-200 | head -3; save
}
for r in 1 2; do
  row default_$r X=1
  row passive_$r OMP_WAIT_POLICY=PASSIVE
  row bind_$r OMP_PROC_BIND=close OMP_PLACES=cores
done
save; echo "done at $((SECONDS - T0)) s"
