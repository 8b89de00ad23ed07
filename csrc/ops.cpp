// reshard's one C++ file: op schemas, argument checks, and the CPU/CUDA implementations that
// unpack tensors and call the C core (reshard.h) or the CUDA C API (cuda/reshard_cuda.h).
//
// The extension module `reshard._C` has no Python API: importing it runs the static
// registrations below. It builds against Py_LIMITED_API (see setup.py, README).
#include <Python.h>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "reshard.h"

#ifdef RESHARD_WITH_CUDA
#include "cuda/reshard_cuda.h"
#endif

extern "C" {
// An empty module: `import reshard._C` loads the shared library, which registers the ops.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT,
                                          "_C",
                                          "reshard torch ops (registered on import)",
                                          -1,
                                          nullptr,
                                          nullptr,
                                          nullptr,
                                          nullptr,
                                          nullptr};
  return PyModule_Create(&module_def);
}
}

namespace reshard {
namespace {

// Work per thread chunk, in bytes of the destination: small tables stay on the calling
// thread (a thread pool wake-up costs more than copying a few KiB).
constexpr int64_t kGrainBytes = 64 * 1024;

// The C core's dtype for a torch dtype; same-size raw copies for everything else.
bool to_rs_dtype(at::ScalarType t, rs_dtype* out) {
  switch (t) {
    case at::kFloat: *out = RS_F32; return true;
    case at::kBFloat16: *out = RS_BF16; return true;
    case at::kHalf: *out = RS_F16; return true;
    default: break;
  }
  switch (c10::elementSize(t)) {
    case 1: *out = RS_RAW1; return true;
    case 2: *out = RS_RAW2; return true;
    case 4: *out = RS_RAW4; return true;
    case 8: *out = RS_RAW8; return true;
    default: return false;
  }
}

bool is_castable_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

// Checks shared by every impl of every op: `desc` is an int64 [n, 6] table, src and dst
// are 1-D contiguous, the dtype pair is supported. Returns the contiguous table.
at::Tensor check_common(const char* op, const at::Tensor& src, const at::Tensor& desc,
                        const at::Tensor& dst) {
  TORCH_CHECK(desc.scalar_type() == at::kLong, op, ": desc must be int64, got ",
              desc.scalar_type());
  TORCH_CHECK(desc.dim() == 2 && desc.size(1) == 6, op,
              ": desc must have shape [n, 6] (src_offset, src_stride, dst_offset, dst_stride, "
              "length, count), got ",
              desc.sizes());
  TORCH_CHECK(src.dim() == 1, op, ": src must be 1-D, got shape ", src.sizes());
  TORCH_CHECK(dst.dim() == 1, op, ": dst must be 1-D, got shape ", dst.sizes());
  TORCH_CHECK(src.is_contiguous(), op, ": src must be contiguous (stride ", src.stride(0), ")");
  TORCH_CHECK(dst.is_contiguous(), op, ": dst must be contiguous (stride ", dst.stride(0), ")");
  const auto st = src.scalar_type(), dt = dst.scalar_type();
  TORCH_CHECK(st == dt || (is_castable_float(st) && is_castable_float(dt)), op, ": cannot copy ",
              st, " to ", dt,
              " (casts exist only among float32, bfloat16, float16; other dtypes copy to "
              "themselves)");
  rs_dtype unused;
  TORCH_CHECK(to_rs_dtype(st, &unused), op, ": unsupported dtype ", st,
              " (element size must be 1, 2, 4 or 8 bytes)");
  return desc.contiguous();
}

// src and dst must not share memory: the copy would read what it already wrote.
void check_no_alias(const char* op, const at::Tensor& src, const at::Tensor& dst) {
  if (src.numel() == 0 || dst.numel() == 0) return;
  auto s0 = reinterpret_cast<uintptr_t>(src.const_data_ptr());
  auto d0 = reinterpret_cast<uintptr_t>(dst.const_data_ptr());
  uintptr_t s1 = s0 + static_cast<uintptr_t>(src.nbytes());
  uintptr_t d1 = d0 + static_cast<uintptr_t>(dst.nbytes());
  TORCH_CHECK(s1 <= d0 || d1 <= s0, op, ": src and dst overlap in memory");
}

// Validates every row before anything is written; errors name the op, the row and why.
void validate_table(const char* op, const rs_run* runs, int64_t n, int64_t src_numel,
                    int64_t dst_numel) {
  rs_error err;
  rs_status st = rs_validate(runs, n, src_numel, dst_numel, RS_CHECK_OVERLAP, &err);
  TORCH_CHECK(st == RS_OK, op, ": bad desc: ", err.msg);
}

void copy_runs_cpu(const at::Tensor& src, const at::Tensor& desc_in, const at::Tensor& dst) {
  constexpr const char* op = "reshard::copy_runs";
  at::Tensor desc = check_common(op, src, desc_in, dst);
  TORCH_CHECK(src.device().is_cpu() && desc.device().is_cpu() && dst.device().is_cpu(), op,
              ": the CPU implementation needs src, desc and dst on the CPU, got ", src.device(),
              ", ", desc.device(), ", ", dst.device());
  check_no_alias(op, src, dst);

  const int64_t n = desc.size(0);
  const auto* runs = reinterpret_cast<const rs_run*>(desc.const_data_ptr<int64_t>());
  validate_table(op, runs, n, src.numel(), dst.numel());

  std::vector<int64_t> prefix(static_cast<size_t>(n) + 1);
  int64_t total = 0;
  rs_error err;
  TORCH_CHECK(rs_prefix(runs, n, prefix.data(), &total, &err) == RS_OK, op,
              ": bad desc: ", err.msg);
  if (total == 0) return;

  rs_dtype sdt, ddt;
  to_rs_dtype(src.scalar_type(), &sdt);
  to_rs_dtype(dst.scalar_type(), &ddt);
  const void* s = src.const_data_ptr();
  void* d = dst.mutable_data_ptr();
  const int64_t grain = std::max<int64_t>(1, kGrainBytes / static_cast<int64_t>(dst.itemsize()));
  std::atomic<int> status{RS_OK};
  // Split by work elements (bytes / itemsize), not rows: every thread gets an equal share
  // whether the table is one huge run or a million tiny ones.
  at::parallel_for(0, total, grain, [&](int64_t begin, int64_t end) {
    rs_status r = rs_copy_slice(s, sdt, d, ddt, runs, n, prefix.data(), begin, end, RS_MODE_RUNS);
    if (r != RS_OK) status.store(r);
  });
  TORCH_CHECK(status.load() == RS_OK, op, ": internal error in the C core: ",
              rs_status_name(static_cast<rs_status>(status.load())));
}

}  // namespace

TORCH_LIBRARY(reshard, m) {
  m.def("copy_runs(Tensor src, Tensor desc, Tensor(a!) dst) -> ()");
  m.def("stage_h2d(Tensor src, Tensor desc, Tensor(a!) ring, Tensor(a!) dst) -> ()");
  m.def("stage_d2h(Tensor src, Tensor desc, Tensor(a!) ring, Tensor(a!) dst) -> ()");
}

TORCH_LIBRARY_IMPL(reshard, CPU, m) { m.impl("copy_runs", &copy_runs_cpu); }

// ============================================================================================
// CUDA implementations (owner: the CUDA issue). copy_runs (CUDA), stage_h2d, stage_d2h:
// reuse check_common / check_no_alias / validate_table above so errors read the same on
// every device; register them in a TORCH_LIBRARY_IMPL(reshard, CUDA, m) block here.
// stage_h2d/stage_d2h take CPU and CUDA tensors together: register them for CUDA (the
// dispatcher picks CUDA when any argument is a CUDA tensor).
// ============================================================================================
#ifdef RESHARD_WITH_CUDA

#endif  // RESHARD_WITH_CUDA

}  // namespace reshard
