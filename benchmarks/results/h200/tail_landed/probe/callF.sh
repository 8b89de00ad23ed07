#!/usr/bin/env bash
# Call F: main's code: the stream's packing team, one configuration per process
# (probe/team_proc.py), the three alternated four times
set -u -o pipefail
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0
R=/tmp/s16f; mkdir -p $R $OUT; T0=$SECONDS
rm -rf build python/reshard/_C*.so
MAX_JOBS=16 timeout 240 python3 setup.py -q build_clib build_ext --inplace > $R/build.log 2>&1; echo "build rc=$? at $((SECONDS - T0)) s"
uptime
for i in 1 2 3 4; do
  for v in 15poll 16sleep 16poll; do
    [ $((SECONDS - T0)) -gt 520 ] && break 2
    PYTHONPATH=python timeout 60 python3 benchmarks/results/h200/tail_landed/probe/team_proc.py $v gpt-125m 30 2>&1 | tail -1 | tee -a $R/team.log
  done
  tar czf $OUT/s16f.tgz -C /tmp s16f
done
tar czf $OUT/s16f.tgz -C /tmp s16f; echo "done at $((SECONDS - T0)) s"
