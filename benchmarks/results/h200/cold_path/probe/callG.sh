#!/usr/bin/env bash
# this tree's DeepSpeed GPU tests (callF ran without the DeepSpeed wheels)
set -u -o pipefail
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16
R=/tmp/s14g; mkdir -p $R $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/{deepspeed,hjson,pydantic,pydantic_core,annotated_types}-[0-9]*.whl .whl/typing_{inspection,extensions}-[0-9]*.whl >$R/wheels.log 2>&1; echo "wheels rc=$?"
rm -rf build python/reshard/_C*.so; timeout 200 python3 setup.py -q build_clib build_ext --inplace >$R/build.log 2>&1; echo "build rc=$?"
export PYTHONPATH=/tmp/site:$PWD/python
timeout 200 python3 -m pytest -p no:cacheprovider -rfEs -n 3 -q tests/gpu/test_deepspeed_gpu.py >$R/pytest.log 2>&1; echo "tests rc=$?"
tail -4 $R/pytest.log
tar czf $OUT/s14g.tgz -C /tmp s14g
