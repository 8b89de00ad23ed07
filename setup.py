"""Build reshard: the C11 core as a static library (build_clib), linked into the torch
extension `reshard._C` (CppExtension, or CUDAExtension with csrc/cuda/*.cu when torch has CUDA
and CUDA_HOME is set). Install with `pip install --no-build-isolation -e .`.

Environment knobs: RESHARD_DEBUG=1 (-O0 -g, asserts), RESHARD_FORCE_CPU=1 (skip CUDA),
TORCH_CUDA_ARCH_LIST (read by torch's build helper), MAX_JOBS (parallel nvcc/c++ jobs).
"""

import glob
import os
import re
import sys

import torch
from setuptools import setup
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))
DEBUG = os.environ.get("RESHARD_DEBUG", "0") == "1"
OPT = ["-O0", "-g"] if DEBUG else ["-O3"]
# The module exposes no Python API of its own (ops register through the dispatcher), so it
# builds against the limited API: one abi3 binary per torch build, any CPython >= 3.10.
LIMITED_API = "0x030A0000"

C_CORE_SOURCES = sorted(glob.glob(os.path.join("csrc", "*.c")))
CUDA_SOURCES = sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")))

# The C core is real C11, compiled by the C compiler, not as C++ by BuildExtension.
c_core = (
    "reshard_core",
    {
        "sources": C_CORE_SOURCES,
        "include_dirs": ["csrc"],
        "cflags": ["-std=c11", "-fPIC", "-Wall", "-Wextra", "-Werror", *OPT],
    },
)


def use_cuda():
    if os.environ.get("RESHARD_FORCE_CPU", "0") == "1":
        return False
    return bool(torch.version.cuda) and cpp_extension.CUDA_HOME is not None


def openmp_flags():
    # at::parallel_for's OpenMP backend is inline in ATen's headers: without -fopenmp it
    # silently runs on one thread. Linking -fopenmp records NEEDED libgomp.so.1, which the
    # loader resolves to the libgomp torch already loaded (same soname): one OpenMP runtime.
    if sys.platform.startswith("linux") and torch.backends.openmp.is_available():
        return ["-fopenmp"]
    return []


def build_macros(cuda):
    """Facts about this build, compiled into the binary for `python -m reshard.info`. Values
    are bare tokens (ops.cpp stringizes them): no spaces, quotes or shell characters, and no
    commas (nvcc splits -D values at commas: "-DX=-O3,-fopenmp" defines a macro "-fopenmp")."""

    def token(text):
        return re.sub(r"[^A-Za-z0-9.+_-]", "_", text).strip("_") or "none"

    archs = os.environ.get("TORCH_CUDA_ARCH_LIST", "default") if cuda else "none"
    return [
        ("RESHARD_BUILD_TORCH", token(torch.__version__)),
        ("RESHARD_BUILD_CUDA_ARCHS", token(archs)),
        ("RESHARD_BUILD_FLAGS", token(" ".join(OPT + openmp_flags()))),
    ]


def extension():
    define_macros = [("Py_LIMITED_API", LIMITED_API), *build_macros(use_cuda())]
    cxx = ["-std=c++17", "-Wall", "-Wextra", *OPT, *openmp_flags()]
    kwargs = dict(
        name="reshard._C",
        sources=["csrc/ops.cpp"],
        include_dirs=[os.path.join(ROOT, "csrc")],
        libraries=["reshard_core"],
        extra_link_args=openmp_flags(),
        py_limited_api=True,
    )
    if use_cuda():
        define_macros.append(("RESHARD_WITH_CUDA", "1"))
        nvcc = ["-std=c++17", "-lineinfo", *OPT]
        return cpp_extension.CUDAExtension(
            **{**kwargs, "sources": kwargs["sources"] + CUDA_SOURCES},
            define_macros=define_macros,
            extra_compile_args={"cxx": cxx, "nvcc": nvcc},
        )
    return cpp_extension.CppExtension(
        **kwargs, define_macros=define_macros, extra_compile_args={"cxx": cxx}
    )


if sys.version_info < (3, 10):
    sys.exit("reshard needs Python >= 3.10")

setup(
    libraries=[c_core],
    ext_modules=[extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension},
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
