#!/usr/bin/env bash
set -u -o pipefail
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16
R=$OUT/s13e; mkdir -p $R
[ -f python/reshard/_C.abi3.so ] && python3 -c "import sys; sys.path.insert(0,'python'); import reshard" 2>/dev/null || timeout 100 python3 setup.py -q build_clib build_ext --inplace >$R/build.log 2>&1
echo "build done"
export PYTHONPATH=$PWD/python
timeout 150 python3 .devscripts/s13/prof.py >$R/prof.log 2>&1; echo "prof rc=$?"
head -90 $R/prof.log | cut -c1-160
