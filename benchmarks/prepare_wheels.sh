#!/usr/bin/env bash
# Wheels for the GPU machine (Python 3.12, torch 2.11, no DeepSpeed, no internet), into .whl/.
#
# tests/gpu/test_deepspeed_gpu.py and the DeepSpeed demo need DeepSpeed there. PyPI has it only
# as a source archive, so it is built here as a pure-Python wheel with no prebuilt ops
# (DS_BUILD_OPS=0; reshard needs none of them). Its requirements that the GPU image lacks
# (see /work/.library/device/KINDS.md: einops, msgpack, ninja, numpy, packaging, psutil,
# py-cpuinfo, tqdm, typing-extensions and torch are there) come as cp312 manylinux wheels.
# On the device (carry .whl), before the tests; name these wheels only, since .whl/ may hold
# others' wheels (a CPU torch wheel there would shadow the CUDA torch):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#     --target /tmp/site .whl/{deepspeed,hjson,pydantic,pydantic_core,annotated_types}-[0-9]*.whl \
#     .whl/typing_{inspection,extensions}-[0-9]*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
# then `python3 -m pytest tests/gpu/test_deepspeed_gpu.py` (DS_ACCELERATOR=cuda is set by it).
set -euo pipefail
cd "$(dirname "$0")/.."

DS_VERSION=${DS_VERSION:-0.19.8}
# Pinned to what the DeepSpeed tests ran with here; pydantic pins pydantic-core exactly.
# typing-extensions is in the image, but pydantic needs >= 4.14.1 and its version there is
# unknown: ship one (newer versions stay compatible with torch).
PURE=(hjson==3.1.0 pydantic==2.13.4 annotated-types==0.7.0 typing-inspection==0.4.2
    typing-extensions==4.15.0)
BINARY=(pydantic-core==2.46.4)
OUT=.whl
mkdir -p "$OUT"

# One version of each package only (two stop the install there): drop ours, keep others'.
for name in deepspeed hjson pydantic pydantic_core annotated_types typing_inspection \
    typing_extensions; do
    rm -f "$OUT/${name}"-[0-9]*.whl
done

DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps --no-build-isolation -w "$OUT" \
    "deepspeed==${DS_VERSION}"

platforms=()
for n in 28 27 17; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d "$OUT" "${BINARY[@]}"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    -d "$OUT" "${PURE[@]}"

ls -l "$OUT"
du -sh "$OUT"
