# reshard: `make test` installs what is missing (system packages through apt-get, Python
# packages through pip), builds, runs the C tests (ASan+UBSan), a short libFuzzer run and pytest.
# `make lint`, `make demo`, `make bench`, `make info`.
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip
TORCH_VERSION ?= 2.13.0
# A local CPU wheel for this Python is used when present (no multi-GB CUDA download); else
# PyTorch's CPU index.
PY_TAG = $(shell $(PYTHON) -c 'import sys; print("cp%d%d" % sys.version_info[:2])' 2>/dev/null)
TORCH_WHEEL ?= $(firstword $(wildcard .whl/torch-$(TORCH_VERSION)+cpu-$(PY_TAG)-*.whl \
	/opt/wheels/torch-$(TORCH_VERSION)+cpu-$(PY_TAG)-*.whl))
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
RUFF_VERSION ?= 0.17.6
CLANG_FORMAT_VERSION ?= 23.1.5
# The clang-format that deps-lint installs into $(PYTHON)'s environment, run through that
# Python: its script directory need not be on PATH (a venv used without activating it).
CLANG_FORMAT = $(PYTHON) -c 'from clang_format import clang_format; clang_format()'
# The DeepSpeed the integration's internals were verified against (docs/deepspeed.md).
DEEPSPEED_VERSION ?= 0.19.8
# The transformers the rollout tests ran with (tests/rollout).
TRANSFORMERS_VERSION ?= 5.24.0
SAN_CC ?= clang
FUZZ_CC ?= clang
FUZZ_SECONDS ?= 25
NVCC ?= nvcc
CUDA_ARCH ?= sm_90

SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c  # a failing fuzzer is not hidden by `| tail`

BIN := tests/c/bin
CORE := csrc/copy_runs.c csrc/progress.c csrc/writable.c
CORE_HEADERS := csrc/reshard.h csrc/casts.h
SAN_FLAGS := -std=c11 -g -O1 -fno-omit-frame-pointer -fsanitize=address,undefined \
	-fno-sanitize-recover=all -Wall -Wextra -Werror -Icsrc
C_FORMAT_FILES := $(wildcard csrc/*.c csrc/*.h csrc/*.cpp csrc/cuda/*.cu csrc/cuda/*.cuh \
	csrc/cuda/*.h tests/c/*.c)

.PHONY: all test deps deps-system deps-torch deps-test deps-deepspeed deps-lint build cstrict \
	ctest fuzz pytest lint format demo bench info cuda-check clean

all: build

test: deps-system deps build ctest fuzz pytest

# ---------------------------------------------------------------- dependencies
deps: deps-torch deps-test deps-deepspeed

# System packages the build and the tests need: a C/C++ compiler (the extension, the strict C11
# compile), readelf (tests/test_ops.py reads the extension's NEEDED entries), Python's headers,
# and clang with its libFuzzer/ASan/UBSan runtime (Debian ships that runtime apart, as
# libclang-rt-<version>-dev). Installs only what is missing, through apt-get (sudo when not
# root), and says what; without apt-get or root it fails naming what to install.
define DEPS_SYSTEM_SH
set -eo pipefail
probe=$$(mktemp -d)
trap 'rm -rf "$$probe"' EXIT
echo 'int LLVMFuzzerTestOneInput(const char *d, unsigned long n) { return 0; }' \
	>"$$probe/fuzz.c"
fuzz_links() {
	"$(FUZZ_CC)" -fsanitize=fuzzer,address,undefined "$$probe/fuzz.c" -o "$$probe/fuzz" \
		>"$$probe/log" 2>&1
}
clang_version() {
	"$(FUZZ_CC)" --version | sed -n 's/.*clang version \([0-9]*\).*/\1/p' | head -n 1
}
listed() { local IFS=';'; echo "$$*" | sed 's/;/; /g'; }
pkgs=() missing=()
if ! command -v cc >/dev/null || ! command -v c++ >/dev/null; then
	pkgs+=(build-essential) missing+=("a C/C++ compiler (cc, c++)")
fi
command -v readelf >/dev/null || { pkgs+=(binutils) missing+=(readelf); }
py_include=$$($(PYTHON) -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
if [ ! -f "$$py_include/Python.h" ]; then
	missing+=("Python's headers ($$py_include/Python.h)")
	case $$py_include in /usr/include/python*) pkgs+=("$${py_include#/usr/include/}-dev") ;; esac
fi
runtime=
if ! command -v "$(FUZZ_CC)" >/dev/null; then
	pkgs+=("$(FUZZ_CC)") missing+=("$(FUZZ_CC)") runtime=yes
elif ! fuzz_links; then
	missing+=("the libFuzzer/sanitizer runtime of $$("$(FUZZ_CC)" --version | head -n 1)") runtime=yes
fi
if [ $${#missing[@]} -eq 0 ]; then
	echo "deps-system: present: cc, c++, readelf, Python.h," \
		"$(FUZZ_CC) $$(clang_version) with libFuzzer/ASan/UBSan"
	exit 0
fi
fail() {
	echo "deps-system: missing: $$(listed "$${missing[@]}")" >&2
	echo "deps-system: $$1" >&2
	echo "deps-system: on Debian/Ubuntu, as root: apt-get install $${pkgs[*]}" \
		"$${runtime:+libclang-rt-<clang major version>-dev}" >&2
	exit 1
}
command -v apt-get >/dev/null || fail "no apt-get here: install these with your package manager"
if [ "$$(id -u)" -eq 0 ]; then as_root=(env)
elif command -v sudo >/dev/null; then as_root=(sudo env)
else fail "not root and no sudo: ask an administrator to install these"
fi
echo "deps-system: missing: $$(listed "$${missing[@]}")"
echo "deps-system: apt-get update"
"$${as_root[@]}" apt-get update -q || fail "apt-get update failed (output above)"
if [ -n "$$runtime" ]; then
	# The clang that will be installed (the `clang` package depends on clang-<major>).
	if command -v "$(FUZZ_CC)" >/dev/null; then major=$$(clang_version)
	else major=$$(apt-cache depends "$(FUZZ_CC)" 2>/dev/null |
			sed -n 's/.*Depends: clang-\([0-9]*\)$$/\1/p' | head -n 1 || true)
		major=$${major:-$$(echo "$(FUZZ_CC)" | sed -n 's/^clang-\([0-9]*\)$$/\1/p')}
	fi
	# Older releases ship the runtime inside clang's own packages: no separate package there.
	if [ -n "$$major" ] && apt-cache show "libclang-rt-$$major-dev" >/dev/null 2>&1; then
		pkgs+=("libclang-rt-$$major-dev")
	fi
fi
echo "deps-system: apt-get install $${pkgs[*]}"
"$${as_root[@]}" DEBIAN_FRONTEND=noninteractive \
	apt-get install -y -q --no-install-recommends "$${pkgs[@]}" ||
	fail "apt-get install $${pkgs[*]} failed (output above)"
if ! fuzz_links; then
	cat "$$probe/log" >&2
	echo "deps-system: $(FUZZ_CC) still cannot link -fsanitize=fuzzer,address,undefined" \
		"after installing $${pkgs[*]}: install the compiler-rt runtime of that clang" >&2
	exit 1
fi
echo "deps-system: installed $${pkgs[*]}; $(FUZZ_CC) $$(clang_version) links libFuzzer/ASan/UBSan"
endef
export DEPS_SYSTEM_SH

deps-system:
	@bash -c "$$DEPS_SYSTEM_SH"

deps-torch:
	@if $(PYTHON) -c "import torch" 2>/dev/null; then \
		echo "torch $$($(PYTHON) -c 'import torch; print(torch.__version__)') present"; \
	elif [ -n "$(TORCH_WHEEL)" ]; then \
		$(PIP) install "$(TORCH_WHEEL)"; \
	else \
		$(PIP) install "torch==$(TORCH_VERSION)" --index-url $(TORCH_CPU_INDEX); \
	fi

# transformers: the rollout tests build tiny HF decoders from a config (no downloads).
deps-test:
	@$(PYTHON) -c "import numpy, hypothesis, pytest, pytest_timeout, setuptools, wheel" \
		2>/dev/null || $(PIP) install numpy hypothesis pytest pytest-timeout setuptools wheel
	@$(PYTHON) -c "import transformers" 2>/dev/null || \
		$(PIP) install "transformers==$(TRANSFORMERS_VERSION)"

# DeepSpeed's tests (tests/deepspeed) run real engines on the CPU; its CUDA ops stay unbuilt.
# Looked up, not imported: importing DeepSpeed takes seconds.
deps-deepspeed: deps-torch deps-test
	@$(PYTHON) -c "import importlib.util as u, sys; sys.exit(not u.find_spec('deepspeed'))" || \
		DS_BUILD_OPS=0 $(PIP) install --no-build-isolation "deepspeed==$(DEEPSPEED_VERSION)"

deps-lint:
	@$(PYTHON) -m ruff --version 2>/dev/null | grep -q "$(RUFF_VERSION)" || \
		$(PIP) install "ruff==$(RUFF_VERSION)"
	@$(CLANG_FORMAT) --version 2>/dev/null | grep -q "$(CLANG_FORMAT_VERSION)" || \
		$(PIP) install "clang-format==$(CLANG_FORMAT_VERSION)"

# ---------------------------------------------------------------- build
build: deps-system deps-torch deps-test
	$(PIP) install --no-build-isolation -e .

# ---------------------------------------------------------------- C tests
# The core must be plain C11: compile it alone with warnings as errors, as C and as C++.
cstrict:
	@mkdir -p $(BIN)
	for f in $(CORE); do \
		cc -std=c11 -O2 -Wall -Wextra -Wpedantic -Wconversion -Wshadow -Werror -Icsrc \
			-c $$f -o $(BIN)/$$(basename $$f .c)_strict.o || exit 1; \
	done
	printf '#include "reshard.h"\n#include "casts.h"\nint main(void){return 0;}\n' | \
		c++ -std=c++17 -Wall -Wextra -Werror -Icsrc -x c++ - -o $(BIN)/header_cxx

$(BIN)/test_core: tests/c/test_core.c $(CORE) $(CORE_HEADERS)
	@mkdir -p $(BIN)
	$(SAN_CC) $(SAN_FLAGS) $(CORE) tests/c/test_core.c -lm -o $@

$(BIN)/fuzz_validate: tests/c/fuzz_validate.c $(CORE) $(CORE_HEADERS)
	@mkdir -p $(BIN)
	$(FUZZ_CC) -std=c11 -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all \
		-Icsrc $(CORE) tests/c/fuzz_validate.c -o $@

# The same tests again in a build that streams every same-dtype table (the production build
# streams only destinations of >= 4 MiB; see RS_STREAM_MIN_BYTES in csrc/copy_runs.c).
$(BIN)/test_core_stream: tests/c/test_core.c $(CORE) $(CORE_HEADERS)
	@mkdir -p $(BIN)
	$(SAN_CC) $(SAN_FLAGS) -DRS_STREAM_MIN_BYTES=1 $(CORE) tests/c/test_core.c -lm -o $@

# Progress words between threads: under ASan/UBSan, and under TSan (a data race fails it).
$(BIN)/test_progress: tests/c/test_progress.c csrc/progress.c csrc/reshard.h
	@mkdir -p $(BIN)
	$(SAN_CC) $(SAN_FLAGS) csrc/progress.c tests/c/test_progress.c -lpthread -o $@

$(BIN)/test_progress_tsan: tests/c/test_progress.c csrc/progress.c csrc/reshard.h
	@mkdir -p $(BIN)
	$(SAN_CC) -std=c11 -g -O1 -fsanitize=thread -Wall -Wextra -Werror -Icsrc \
		csrc/progress.c tests/c/test_progress.c -lpthread -o $@

# test_core once per instruction-set level of the bulk casts (RS_CONVERTER in csrc/copy_runs.c).
ctest: deps-system cstrict $(BIN)/test_core $(BIN)/test_core_stream $(BIN)/test_progress \
		$(BIN)/test_progress_tsan
	for cap in default avx2 avx512; do RESHARD_CPU_CAPABILITY=$$cap $(BIN)/test_core || exit 1; done
	$(BIN)/test_core_stream
	$(BIN)/test_progress
	$(BIN)/test_progress_tsan

# A short libFuzzer run over a scratch copy of the seed corpus (the repo copy stays clean).
fuzz: deps-system $(BIN)/fuzz_validate
	@rm -rf $(BIN)/corpus && mkdir -p $(BIN)/corpus && cp tests/c/corpus/* $(BIN)/corpus/
	$(BIN)/fuzz_validate -max_total_time=$(FUZZ_SECONDS) -max_len=1024 -print_final_stats=1 \
		-artifact_prefix=$(BIN)/ $(BIN)/corpus 2>&1 | tail -n 12

# ---------------------------------------------------------------- Python tests
pytest:
	$(PYTHON) -m pytest -q -rs --durations=12 tests

# ---------------------------------------------------------------- lint / format
lint: deps-lint
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	$(CLANG_FORMAT) --dry-run -Werror $(C_FORMAT_FILES)

format: deps-lint
	$(PYTHON) -m ruff check --fix .
	$(PYTHON) -m ruff format .
	$(CLANG_FORMAT) -i $(C_FORMAT_FILES)

# ---------------------------------------------------------------- run
# Installs what it needs first (torch, DeepSpeed for the default real-engine demo), then runs.
demo: deps build
	$(PYTHON) -m reshard.demo

bench: deps build
	$(PYTHON) benchmarks/kernels.py

info:
	$(PYTHON) -m reshard.info

# The CUDA sources compile here without a GPU: a syntax/type check of csrc/cuda.
cuda-check:
	@mkdir -p $(BIN)
	for f in csrc/cuda/*.cu; do \
		$(NVCC) -std=c++17 -arch=$(CUDA_ARCH) -Icsrc -c $$f -o $(BIN)/$$(basename $$f).o || exit 1; \
	done

clean:
	rm -rf $(BIN) build dist python/reshard/*.so python/*.egg-info

# ---------------------------------------------------------------- mutation check
# Plants one-line bugs one at a time in a throwaway copy and runs the tests that should catch
# each (tests/mutation/mutate.py); run before calling planner/preflight/executor work done.
.PHONY: mutate
mutate: build
	$(PYTHON) tests/mutation/mutate.py $(MUTATE_ARGS)
