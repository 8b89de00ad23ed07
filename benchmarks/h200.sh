#!/usr/bin/env bash
# The one script for the GPU machine: build reshard for sm_90, run tests/gpu, run the GPU
# benchmarks, run the sanitizers on a subset while time is left, and write everything under
# $OUT (build.log, pytest.log, gpu_bench.{json,md,png}, sanitizer.log, env.txt).
#
#   bash benchmarks/h200.sh            # from the repository root; OUT defaults to ./out
#   BUDGET=560 BENCH_ARGS=--quick bash benchmarks/h200.sh
#
# BUDGET (seconds, default 560: one 600 s device call) bounds the whole script: later steps
# shrink or are skipped. The tests need ~90 s with -n 4, so keep BUDGET >= 450 with SYNC_S=150.
# BENCH=0 skips benchmarks/gpu_bench.py (one GPU), SANITIZE=0 the compute-sanitizer step.
# SYNC_S (seconds, default 150; 0 skips) is kept for benchmarks/sync_latency.py (one GPU:
# CPU-offloaded optimizer state <-> GPU, reshard vs per-tensor .to(device)), SYNC_SCENARIOS and
# SYNC_MODELS its scenarios (scenario-major: the first ones get every model) and models.
# SYNC_S comes out of the tests' and benchmarks' time: give BUDGET ~550 on one GPU. A longer run
# of it: SYNC_S=450 SYNC_MODELS=gpt-125m,gpt-350m,gpt-760m,gpt-1.3b (BUDGET raised to match).
# With >= 2 GPUs the default BUDGET is 520 and MULTI_S (default 270) is kept for the
# multi-GPU step that runs last: tests/gpu/multi over NCCL (<= MULTI_TEST_S, default 170) and
# benchmarks/gpu_bench.py --mode multi (the rest); pytest_multi.log,
# gpu_bench_multi.{json,md,png,txt,log}.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=${MAX_JOBS:-16}
# NVLink multicast stays off on the lent machines (KINDS.md)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
if ((NGPU >= 2)); then BUDGET=${BUDGET:-520} MULTI_S=${MULTI_S:-270}; else MULTI_S=0; fi
BUDGET=${BUDGET:-560} MULTI_TEST_S=${MULTI_TEST_S:-170}
status_multi=skipped status_multi_bench=skipped
T0=$(date +%s)
# Until the multi-GPU step starts, MULTI_S is held back from every earlier step's time.
RESERVE=$MULTI_S
left() { echo $((BUDGET - RESERVE - ($(date +%s) - T0))); }
PY=${PY:-python3}
status_build=skipped status_tests=skipped status_bench=skipped status_san=skipped
status_sync=skipped SYNC_S=${SYNC_S:-150}

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  $PY -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__,
"cuda", torch.version.cuda, "threads", torch.get_num_threads())'
  nvcc --version | tail -1
  nproc
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# ---- DeepSpeed travels as wheels in .whl/ (benchmarks/prepare_wheels.sh; carry .whl): the
# DeepSpeed GPU tests need it. Only our wheels are named: another torch there would shadow CUDA's.
if ! $PY -c 'import deepspeed' >/dev/null 2>&1 && ls .whl/deepspeed-[0-9]*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/{deepspeed,hjson,pydantic,pydantic_core,annotated_types}-[0-9]*.whl \
    .whl/typing_{inspection,extensions}-[0-9]*.whl >"$OUT/wheels.log" 2>&1 &&
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
$PY -c 'import deepspeed; print("deepspeed", deepspeed.__version__)' 2>&1 | tail -1

# ---- build (editable install; fall back to an in-place build)
echo "== build"
if timeout 300 $PY -m pip install -v --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1; then
  status_build=ok
elif timeout 300 $PY setup.py build_ext --inplace >>"$OUT/build.log" 2>&1; then
  status_build=ok-inplace
  export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
else
  status_build=FAILED
  tail -40 "$OUT/build.log"
fi
echo "build: $status_build ($(($(date +%s) - T0)) s)"

if [[ $status_build != FAILED ]]; then
  # ---- a native backtrace if an argument-error path crashes
  if command -v cuda-gdb >/dev/null; then
    timeout 60 cuda-gdb -batch -ex run -ex bt --args $PY -c 'import torch, reshard._ops
ok = torch.tensor([[0, 0, 0, 0, 4, 1]])
for dev in ("cpu", "cuda"):
    s, d = torch.randn(10, device=dev), torch.zeros(10, device=dev)
    for bad in (ok[:, :5], ok.view(-1)):
        try:
            torch.ops.reshard.copy_runs(s, bad, d)
        except RuntimeError as e:
            print(dev, "ok:", str(e)[:90])
    try:
        torch.ops.reshard.copy_runs(s.view(2, 5), ok, d)
    except RuntimeError as e:
        print(dev, "ok:", str(e)[:90])
print("no crash")' >"$OUT/diag.log" 2>&1
    grep -E "ok:|no crash|SIGSEGV|^#[0-9]" "$OUT/diag.log" | head -30
  fi

  # ---- tests (xdist: a crashing test loses its worker, not the run)
  echo "== tests"
  t=$(( $(left) - 130 - SYNC_S )); ((t > 240)) && t=240  # keep ~130 s for the benchmarks
  if ((t > 30)); then
    timeout "$t" $PY -m pytest tests/gpu -q -p no:cacheprovider --timeout 120 -rs -n 4 \
      --ignore=tests/gpu/multi \
      >"$OUT/pytest.log" 2>&1
    rc=$?
    status_tests=$([[ $rc == 0 ]] && echo passed || echo "FAILED(rc=$rc)")
    tail -25 "$OUT/pytest.log"
  fi
  echo "tests: $status_tests ($(($(date +%s) - T0)) s)"

  # ---- benchmarks
  echo "== benchmarks"
  t=$(( $(left) - 25 - SYNC_S ))
  if ((t > 40 && ${BENCH:-1})); then  # BENCH=0 skips
    timeout "$t" $PY benchmarks/gpu_bench.py --out "$OUT" ${BENCH_ARGS:-}
    rc=$?
    status_bench=$([[ $rc == 0 ]] && echo ok || echo "rc=$rc")
  fi
  echo "bench: $status_bench ($(($(date +%s) - T0)) s)"

  # ---- repeated-sync benchmark: writes sync_latency_h200.{json,md} + plots after
  # every case, so a timeout keeps the finished ones; --time-budget stops starting new cases.
  echo "== sync_latency"
  t=$(( $(left) - 15 ))
  ((t > SYNC_S + 30)) && t=$((SYNC_S + 30))
  if ((SYNC_S > 0 && t > 40)); then
    timeout "$t" $PY benchmarks/sync_latency.py --world 1 --device cuda --iters 20 \
      --scenarios "${SYNC_SCENARIOS:-offload_fp32,offload_bf16,fsdp_offload,offload_back,fsdp_weight_sync}" \
      --models "${SYNC_MODELS:-gpt-125m,gpt-350m}" --time-budget $((t - 80 > 20 ? t - 80 : 20)) \
      --json "$OUT/sync_latency_h200.json" >"$OUT/sync_latency.log" 2>&1
    rc=$?
    status_sync=$([[ $rc == 0 ]] && echo ok || echo "rc=$rc")
    grep -E "^\| gpt|^## " "$OUT/sync_latency_h200.md" 2>/dev/null | head -40 || tail -20 "$OUT/sync_latency.log"
  fi
  echo "sync_latency: $status_sync ($(($(date +%s) - T0)) s)"

  # ---- compute-sanitizer (memcheck + racecheck) on a subset, if time is left
  t=$(( ($(left) - 10) / 2 ))
  if ((t > 30 && ${SANITIZE:-1})) && command -v compute-sanitizer >/dev/null; then
    : >"$OUT/sanitizer.log"
    for tool in memcheck racecheck; do
      echo "== compute-sanitizer $tool" | tee -a "$OUT/sanitizer.log"
      timeout "$t" compute-sanitizer --tool "$tool" --target-processes all --error-exitcode 99 \
        $PY -m pytest -q -p no:cacheprovider -x \
        "tests/gpu/test_copy_runs_cuda.py::test_random_tables[0-float32-bfloat16]" \
        "tests/gpu/test_copy_runs_cuda.py::test_misaligned[offsets1-int16-int16]" \
        "tests/gpu/test_stage_cuda.py::test_random_tables_h2d_d2h[1000-float32-bfloat16]" \
        "tests/gpu/test_stage_cuda.py::test_pinned_source_goes_direct[dtype0]" \
        >>"$OUT/sanitizer.log" 2>&1
      echo "$tool rc=$?" | tee -a "$OUT/sanitizer.log"
    done
    status_san=$(grep -c "rc=0" "$OUT/sanitizer.log")/2-clean
    tail -6 "$OUT/sanitizer.log"
  fi

  # ---- multi-GPU, last: NCCL tests on 2 GPUs, then benchmarks/gpu_bench.py --mode multi
  if ((NGPU >= 2)); then
    RESERVE=0
    echo "== multi-GPU ($NGPU GPUs, $(left) s left)"
    t=$(( $(left) - 100 )); ((t > MULTI_TEST_S)) && t=$MULTI_TEST_S  # >= 100 s for the bench
    if ((t > 30)); then
      timeout -k 10 "$t" $PY -m pytest tests/gpu/multi -v -p no:cacheprovider --timeout 200 -rs \
        --durations=0 >"$OUT/pytest_multi.log" 2>&1
      rc=$?
      status_multi=$([[ $rc == 0 ]] && echo passed || echo "FAILED(rc=$rc)")
      grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" "$OUT/pytest_multi.log" | tail -15
    fi
    echo "multi tests: $status_multi ($(($(date +%s) - T0)) s)"
    t=$(( $(left) - 5 ))
    if ((t > 40)); then
      timeout -k 10 "$t" $PY benchmarks/gpu_bench.py --mode multi --out "$OUT" \
        --time-cap $((t - 10)) >"$OUT/gpu_bench_multi.txt" 2>"$OUT/gpu_bench_multi.log"
      rc=$?
      status_multi_bench=$([[ $rc == 0 ]] && echo ok || echo "rc=$rc")
      tail -5 "$OUT/gpu_bench_multi.log"
    fi
    echo "gpu_bench --mode multi: $status_multi_bench ($(($(date +%s) - T0)) s)"
  fi
fi

echo
echo "== summary ($(($(date +%s) - T0)) s): build $status_build, tests $status_tests," \
  "bench $status_bench, sync_latency $status_sync, sanitizer $status_san," \
  "multi-GPU tests $status_multi, multi-GPU bench $status_multi_bench"
grep -E "passed|failed|error" "$OUT/pytest.log" 2>/dev/null | tail -1
[[ -f $OUT/gpu_bench.md ]] && grep -vE "^(\{|\}| \")" "$OUT/gpu_bench.md" | head -60
if [[ -f $OUT/gpu_bench_multi.txt ]]; then cat "$OUT/gpu_bench_multi.txt"; fi
