#!/usr/bin/env bash
# this tree's whole GPU suite (no multi; DeepSpeed from .whl), then sync_latency stream_offload
# gpt-125m pairs of main (51d5168) against this tree, and a timeline of each
set -u -o pipefail
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0
ROOT=$PWD; R=/tmp/s15c; mkdir -p $R $OUT
P=benchmarks/results/h200/cold_core/probe
save() { tar czf $OUT/s15c.tgz -C /tmp s15c; }
rm -rf build python/reshard/_C*.so /tmp/m && mkdir -p /tmp/m && tar xzf .devscripts/s15/main.tgz -C /tmp/m
(cd /tmp/m && MAX_JOBS=8 timeout 200 python3 setup.py -q build_clib build_ext --inplace >$R/build_main.log 2>&1; echo "build main rc=$?") &
(MAX_JOBS=8 timeout 200 python3 setup.py -q build_clib build_ext --inplace >$R/build_head.log 2>&1; echo "build head rc=$?") &
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/{deepspeed,hjson,pydantic,pydantic_core,annotated_types}-[0-9]*.whl .whl/typing_{inspection,extensions}-[0-9]*.whl >$R/wheels.log 2>&1; echo "wheels rc=$?"
wait
uptime; git log --oneline -1 2>/dev/null
PYTHONPATH=python:/tmp/site timeout 300 python3 -m pytest -q -n 8 -p no:cacheprovider tests/gpu --ignore=tests/gpu/multi -rs >$R/pytest.log 2>&1; echo "pytest rc=$?"; tail -3 $R/pytest.log; save
for i in 1 2 3 4 5; do
  for v in main head; do
    d=$ROOT; [ $v = main ] && d=/tmp/m
    (cd $d && PYTHONPATH=python timeout 40 python3 benchmarks/sync_latency.py --world 1 --device cuda --iters 20 --scenarios stream_offload --models gpt-125m --methods reshard,reshard_registered --time-budget 30 --json $R/sl_${v}_$i.json >$R/sl_${v}_$i.log 2>&1; echo "$v $i rc=$?")
    grep -E "^\| gpt" $R/sl_${v}_$i.md | cut -d'|' -f4,5,6,18,19,20 | head -3
  done
  save
done
(cd /tmp/m && PYTHONPATH=python timeout 80 python3 $ROOT/$P/timeline.py gpt-125m 20 > $R/timeline_main.log 2>&1); tail -6 $R/timeline_main.log
PYTHONPATH=python timeout 80 python3 $P/timeline.py gpt-125m 20 > $R/timeline_head.log 2>&1; tail -6 $R/timeline_head.log
save
