// reshard's one C++ file: op schemas, argument checks, and the CPU/CUDA implementations that
// unpack tensors and call the C core (reshard.h) or the CUDA C API (cuda/reshard_cuda.h).
//
// The extension module `reshard._C` has no Python API: importing it runs the static
// registrations below. It builds against Py_LIMITED_API (see setup.py, README).
#include <Python.h>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <c10/core/InferenceMode.h>
// torch's autograd headers trip -Wunused-parameter under -Wextra; the warnings are theirs.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-parameter"
#include <torch/csrc/autograd/VariableTypeUtils.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#pragma GCC diagnostic pop
#include <torch/library.h>

#include <algorithm>
#include <iterator>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "reshard.h"

#ifdef RESHARD_WITH_CUDA
#include <ATen/ops/from_blob.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <list>
#include <mutex>

#include "cuda/reshard_cuda.h"
#endif

// Build facts from setup.py as bare tokens (no quotes: they must survive both a direct
// compiler call and ninja's shell), turned into strings here.
#define RESHARD_STR2(...) #__VA_ARGS__
#define RESHARD_STR(...) RESHARD_STR2(__VA_ARGS__)
#ifdef RESHARD_BUILD_TORCH
#define RESHARD_TORCH_STR RESHARD_STR(RESHARD_BUILD_TORCH)
#else
#define RESHARD_TORCH_STR "unknown"
#endif
#ifdef RESHARD_BUILD_CUDA_ARCHS
#define RESHARD_ARCHS_STR RESHARD_STR(RESHARD_BUILD_CUDA_ARCHS)
#else
#define RESHARD_ARCHS_STR ""
#endif
#ifdef RESHARD_BUILD_FLAGS
#define RESHARD_FLAGS_STR RESHARD_STR(RESHARD_BUILD_FLAGS)
#else
#define RESHARD_FLAGS_STR ""
#endif
#ifdef RESHARD_WITH_CUDA
#define RESHARD_CUDA_JSON "true"
#else
#define RESHARD_CUDA_JSON "false"
#endif
#ifdef _OPENMP
#define RESHARD_OPENMP_JSON "true"
#else
#define RESHARD_OPENMP_JSON "false"
#endif

extern "C" {
// What this binary was built with, as JSON, for `python -m reshard.info` (read through
// ctypes: a plain C symbol, no dispatcher op and no Python API).
__attribute__((visibility("default"))) const char* reshard_build_info(void) {
  return "{\"c_core\": \"" RS_VERSION_STRING "\", \"torch\": \"" RESHARD_TORCH_STR
         "\", \"cuda\": " RESHARD_CUDA_JSON ", \"cuda_archs\": \"" RESHARD_ARCHS_STR
         "\", \"flags\": \"" RESHARD_FLAGS_STR "\", \"openmp\": " RESHARD_OPENMP_JSON "}";
}

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

// Work per thread chunk, in bytes of the destination: tables under 256 KiB stay on the
// calling thread (at::parallel_for runs serially below one grain). One thread copies 256 KiB
// in ~25 us, about what waking a sleeping OpenMP worker costs on an idle machine; on a loaded
// one the wake-up took milliseconds (benchmarks/kernels.py, 0.6 MiB packs at 0.1 GB/s).
constexpr int64_t kGrainBytes = 256 * 1024;

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

// Integers in error messages are formatted with std::to_string, never streamed: an extension
// built by a newer g++ than the libstdc++ loaded at run time crashed inside ostream's integer
// insertion (the H200 image: /opt/gcc g++ vs the runtime libstdc++; the integer inserter is
// instantiated in this .so and bound locally), while strings stream fine.
std::string int_list(at::IntArrayRef v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

// Elements of storage a dense tensor reaches from its storage offset (0 when it is empty).
int64_t storage_extent(const at::Tensor& t) {
  if (t.numel() == 0) return 0;
  int64_t last = t.storage_offset();
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  return last + 1;
}

// A tensor's storage must hold what its sizes say: FSDP frees parameters with
// storage().resize_(0), and a storage shrunk under its tensors would be read or written out of
// bounds.
void check_storage(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.layout() == at::kStrided, op, ": ", name, " must be a dense tensor, got layout ",
              t.layout());
  if (t.numel() == 0) return;
  TORCH_CHECK(t.has_storage(), op, ": ", name, " has no storage");
  const auto need = static_cast<uint64_t>(storage_extent(t)) * t.itemsize();
  const auto have = static_cast<uint64_t>(t.storage().nbytes());
  TORCH_CHECK(need <= have, op, ": ", name, " needs ", std::to_string(need),
              " bytes of storage but its storage holds ", std::to_string(have),
              have == 0 ? " (it was freed: storage().resize_(0))" : " (it was shrunk)");
}

// Storages not from torch's allocator (from_numpy, frombuffer, from_dlpack...) whose memory a
// lookup found writable, by their StorageImpl, held weakly: a live storage keeps its memory
// mapped, so one lookup (reading the whole memory map: ~20 us in a torch process) serves every
// later call with it. A weak reference keeps the StorageImpl's own block allocated, so no new
// storage takes a remembered address; freed storages' entries go when the table is full.
struct WritableStorage {
  c10::weak_intrusive_ptr<c10::StorageImpl> weak{c10::intrusive_ptr<c10::StorageImpl>()};
  const void* data = nullptr;
  size_t nbytes = 0;
};
constexpr size_t kWritableStorages = 4096;
std::mutex g_writable_mutex;
// Never destroyed: weak references must not be released during static destruction.
auto& g_writable = *new std::unordered_map<const c10::StorageImpl*, WritableStorage>();

bool known_writable(const c10::Storage& st) {
  std::lock_guard<std::mutex> lock(g_writable_mutex);
  const auto it = g_writable.find(st.unsafeGetStorageImpl());
  // the same memory still: a storage's data can be swapped (set_data_ptr)
  return it != g_writable.end() && it->second.data == st.data() &&
         it->second.nbytes == st.nbytes() && !it->second.weak.expired();
}

void remember_writable(const c10::Storage& st) {
  WritableStorage e;
  e.weak = st.getWeakStorageImpl();
  e.data = st.data();
  e.nbytes = st.nbytes();
  std::lock_guard<std::mutex> lock(g_writable_mutex);
  if (g_writable.size() >= kWritableStorages) {
    for (auto it = g_writable.begin(); it != g_writable.end();)
      it = it->second.weak.expired() ? g_writable.erase(it) : std::next(it);
    if (g_writable.size() >= kWritableStorages) g_writable.clear();
  }
  g_writable[st.unsafeGetStorageImpl()] = std::move(e);
}

// Why a write to CPU tensor `t` would fault, "" when none would: writing read-only memory (a
// numpy memmap opened with mode 'r') kills the process. A resizable storage holds memory of
// torch's allocator, which is writable: no lookup. Any other storage is looked up in the
// process's memory map (Linux; elsewhere unchecked) once while it lives. The preflight asks
// this of every target (reshard::unwritable_reason); the ops ask it of what they write. Call
// after check_storage (the tensor's bytes lie inside its storage).
std::string unwritable_reason(const at::Tensor& t) {
  if (!t.is_cpu() || t.numel() == 0) return "";
  const c10::Storage& st = t.storage();
  if (st.resizable() || known_writable(st)) return "";
  uint64_t offset = 0;
  char what[256];
  const int whole = rs_unwritable_byte(RS_MEMORY_MAP, reinterpret_cast<uintptr_t>(st.data()),
                                       st.nbytes(), &offset, what, sizeof what);
  if (whole == 0) remember_writable(st);
  if (whole != 1) return "";  // writable, or no map to look in (not Linux, or out of files)
  // a view may avoid the storage's unwritable part: only its own bytes decide
  const auto lo = reinterpret_cast<uintptr_t>(t.const_data_ptr());
  if (rs_unwritable_byte(RS_MEMORY_MAP, lo, t.nbytes(), &offset, what, sizeof what) != 1) return "";
  return "byte " + std::to_string(offset) + " of it is not writable (" + what +
         "): writing it would kill the process; pass writable memory (a numpy memmap opened "
         "with mode 'r+' or 'c', or a copy)";
}

void check_writable(const char* op, const char* name, const at::Tensor& t) {
  const std::string why = unwritable_reason(t);
  TORCH_CHECK(why.empty(), op, ": ", name, ": ", why);
}

// Names the argument on the wrong device.
void check_device(const char* op, const char* name, const at::Tensor& t, bool ok,
                  const char* want) {
  TORCH_CHECK(ok, op, ": ", name, " must be ", want, ", got a tensor on ", t.device().str());
}

// `name` is 1-D and contiguous, as every buffer of every op is.
void check_1d_contiguous(const char* op, const std::string& name, const at::Tensor& t) {
  TORCH_CHECK(t.dim() == 1, op, ": ", name, " must be 1-D, got shape ", int_list(t.sizes()));
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous (stride ",
              std::to_string(t.stride(0)), ")");
}

// A copy from st to dt is supported; returns the C core's dtype of st.
rs_dtype check_dtype_pair(const char* op, at::ScalarType st, at::ScalarType dt) {
  TORCH_CHECK(st == dt || (is_castable_float(st) && is_castable_float(dt)), op, ": cannot copy ",
              st, " to ", dt,
              " (casts exist only among float32, bfloat16, float16; other dtypes copy to "
              "themselves)");
  rs_dtype out;
  TORCH_CHECK(to_rs_dtype(st, &out), op, ": unsupported dtype ", st,
              " (element size must be 1, 2, 4 or 8 bytes)");
  return out;
}

// Checks shared by every impl of every op: `desc` is an int64 [n, 6] table, src and dst
// are 1-D contiguous, the dtype pair is supported, every storage holds its tensor. Returns
// the contiguous table.
at::Tensor check_common(const char* op, const at::Tensor& src, const at::Tensor& desc,
                        const at::Tensor& dst) {
  TORCH_CHECK(desc.scalar_type() == at::kLong, op, ": desc must be int64, got ",
              desc.scalar_type());
  TORCH_CHECK(desc.dim() == 2 && desc.size(1) == 6, op,
              ": desc must have shape [n, 6] (src_offset, src_stride, dst_offset, dst_stride, "
              "length, count), got ",
              int_list(desc.sizes()));
  check_1d_contiguous(op, "src", src);
  check_1d_contiguous(op, "dst", dst);
  check_dtype_pair(op, src.scalar_type(), dst.scalar_type());
  check_storage(op, "src", src);
  check_storage(op, "desc", desc);
  check_storage(op, "dst", dst);
  return desc.contiguous();
}

// What is read and dst must not share memory: the copy would read what it already wrote.
void check_no_alias(const char* op, const at::Tensor& src, const at::Tensor& dst,
                    const std::string& src_name = "src") {
  if (src.numel() == 0 || dst.numel() == 0) return;
  auto s0 = reinterpret_cast<uintptr_t>(src.const_data_ptr());
  auto d0 = reinterpret_cast<uintptr_t>(dst.const_data_ptr());
  uintptr_t s1 = s0 + static_cast<uintptr_t>(src.nbytes());
  uintptr_t d1 = d0 + static_cast<uintptr_t>(dst.nbytes());
  TORCH_CHECK(s1 <= d0 || d1 <= s0, op, ": ", src_name, " and dst overlap in memory");
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
  check_device(op, "src", src, src.is_cpu(), "a CPU tensor (dst is on the CPU)");
  check_device(op, "desc", desc_in, desc_in.is_cpu(), "a CPU tensor");
  check_device(op, "dst", dst, dst.is_cpu(), "a CPU tensor (src is on the CPU)");
  at::Tensor desc = check_common(op, src, desc_in, dst);
  check_writable(op, "dst", dst);
  check_no_alias(op, src, dst);
  check_no_alias(op, desc, dst, "desc");  // rows are read while dst is written

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

// Pieces of many CPU sources of one dtype into one CPU destination, in one parallel pass:
// reshard.h2d packs a ring slot of small pieces (one storage per FSDP2 parameter) with one call
// instead of one copy_runs call (and one fan-out of the threads) per piece. Row r of `pieces`
// (int64 [k, 4]): (source index, source offset, destination offset, length), in elements.
// Every row is checked before anything is written; destination ranges must be disjoint and no
// source may share memory with the destination. The destination is written as a pack (casts
// read their source ahead, plain stores: a ring slot stays in the cache for its DMA).
void copy_pieces_cpu(at::TensorList srcs, const at::Tensor& pieces_in, const at::Tensor& dst) {
  constexpr const char* op = "reshard::copy_pieces";
  constexpr int64_t kCols = 4;
  check_device(op, "pieces", pieces_in, pieces_in.is_cpu(), "a CPU tensor");
  check_device(op, "dst", dst, dst.is_cpu(), "a CPU tensor");
  std::vector<std::string> names(srcs.size());
  for (size_t i = 0; i < srcs.size(); ++i) {
    names[i] = "srcs[" + std::to_string(i) + "]";
    check_device(op, names[i].c_str(), srcs[i], srcs[i].is_cpu(), "a CPU tensor");
  }
  TORCH_CHECK(pieces_in.scalar_type() == at::kLong, op, ": pieces must be int64, got ",
              pieces_in.scalar_type());
  TORCH_CHECK(pieces_in.dim() == 2 && pieces_in.size(1) == kCols, op,
              ": pieces must have shape [k, 4] (source index, source offset, destination "
              "offset, length), got ",
              int_list(pieces_in.sizes()));
  check_1d_contiguous(op, "dst", dst);
  const rs_dtype ddt = check_dtype_pair(op, dst.scalar_type(), dst.scalar_type());
  for (size_t i = 0; i < srcs.size(); ++i) {
    const at::Tensor& t = srcs[i];
    check_1d_contiguous(op, names[i], t);
    TORCH_CHECK(t.scalar_type() == srcs[0].scalar_type(), op,
                ": every source must have one dtype: srcs[0] is ", srcs[0].scalar_type(), ", ",
                names[i], " is ", t.scalar_type());
    check_storage(op, names[i].c_str(), t);
  }
  check_storage(op, "pieces", pieces_in);
  check_storage(op, "dst", dst);
  check_writable(op, "dst", dst);
  const rs_dtype sdt =
      srcs.empty() ? ddt : check_dtype_pair(op, srcs[0].scalar_type(), dst.scalar_type());
  const at::Tensor pieces = pieces_in.contiguous();
  const int64_t k = pieces.size(0);
  const int64_t* p = pieces.const_data_ptr<int64_t>();
  const auto n_srcs = static_cast<int64_t>(srcs.size());
  std::vector<int64_t> prefix(static_cast<size_t>(k) + 1, 0);
  std::vector<std::pair<int64_t, int64_t>> written;  // (destination offset, row)
  std::vector<char> used(srcs.size(), 0);
  for (int64_t r = 0; r < k; ++r) {
    const int64_t idx = p[r * kCols], so = p[r * kCols + 1], off = p[r * kCols + 2],
                  n = p[r * kCols + 3];
    TORCH_CHECK(idx >= 0 && idx < n_srcs, op, ": pieces row ", std::to_string(r), ": source index ",
                std::to_string(idx), " is out of range for ", std::to_string(n_srcs), " sources");
    TORCH_CHECK(so >= 0 && off >= 0 && n >= 0, op, ": pieces row ", std::to_string(r),
                ": offsets and length must be >= 0, got (", std::to_string(so), ", ",
                std::to_string(off), ", ", std::to_string(n), ")");
    const int64_t s_numel = srcs[static_cast<size_t>(idx)].numel();
    TORCH_CHECK(so <= s_numel && n <= s_numel - so, op, ": pieces row ", std::to_string(r),
                ": elements [", std::to_string(so), ", ", std::to_string(so), " + ",
                std::to_string(n), ") are past the end of ", names[static_cast<size_t>(idx)], " (",
                std::to_string(s_numel), " elements)");
    TORCH_CHECK(off <= dst.numel() && n <= dst.numel() - off, op, ": pieces row ",
                std::to_string(r), ": elements [", std::to_string(off), ", ", std::to_string(off),
                " + ", std::to_string(n), ") are past the end of dst (",
                std::to_string(dst.numel()), " elements)");
    if (n > 0) {
      written.emplace_back(off, r);
      used[static_cast<size_t>(idx)] = 1;
    }
  }
  std::sort(written.begin(), written.end());
  for (size_t i = 1; i < written.size(); ++i) {
    const int64_t a = written[i - 1].second, b = written[i].second;
    TORCH_CHECK(written[i - 1].first + p[a * kCols + 3] <= written[i].first, op, ": pieces rows ",
                std::to_string(std::min(a, b)), " and ", std::to_string(std::max(a, b)),
                " write overlapping elements of dst");
  }
  // the destination ranges are disjoint and inside dst: the sum of lengths is at most its size
  for (int64_t r = 0; r < k; ++r)
    prefix[static_cast<size_t>(r) + 1] = prefix[static_cast<size_t>(r)] + p[r * kCols + 3];
  for (size_t i = 0; i < srcs.size(); ++i)
    if (used[i]) check_no_alias(op, srcs[i], dst, names[i]);
  check_no_alias(op, pieces, dst, "pieces");
  const int64_t total = prefix[static_cast<size_t>(k)];
  if (total == 0) return;
  std::vector<const void*> bases(srcs.size());
  for (size_t i = 0; i < srcs.size(); ++i) bases[i] = srcs[i].const_data_ptr();
  auto* d = static_cast<unsigned char*>(dst.mutable_data_ptr());
  const auto dsz = static_cast<int64_t>(dst.itemsize());
  const int64_t grain = std::max<int64_t>(1, kGrainBytes / dsz);
  std::atomic<int> status{RS_OK};
  at::parallel_for(0, total, grain, [&](int64_t begin, int64_t end) {
    // the last row starting at or before `begin`, then row by row to `end`
    auto r = static_cast<int64_t>(std::upper_bound(prefix.begin(), prefix.end(), begin) -
                                  prefix.begin()) -
             1;
    for (int64_t w = begin; w < end; ++r) {
      const int64_t* row = p + r * kCols;
      const int64_t first = prefix[static_cast<size_t>(r)];
      const int64_t stop = std::min(end, prefix[static_cast<size_t>(r) + 1]);
      if (stop <= w) continue;  // an empty row
      const rs_run run{row[1], 0, 0, 0, row[3], 1};
      const int64_t run_prefix[2] = {0, row[3]};
      // PACK: work element w of the one-run table lands at dst + w, so the pointer given is
      // the piece's destination at its first element of this slice
      rs_status st =
          rs_copy_slice(bases[static_cast<size_t>(row[0])], sdt, d + (row[2] + (w - first)) * dsz,
                        ddt, &run, 1, run_prefix, w - first, stop - first, RS_MODE_PACK);
      if (st != RS_OK) status.store(st);
      w = stop;
    }
  });
  TORCH_CHECK(status.load() == RS_OK, op, ": internal error in the C core: ",
              rs_status_name(static_cast<rs_status>(status.load())));
}

// One int64 row per tensor of what preflight's per-call key reads, as Python reads it
// (reshard._ops.FACT_COLUMNS): data_ptr, storage data_ptr and nbytes, dtype, device type and
// index, dim, numel, is_contiguous, requires_grad, is_inference. Read from each TensorImpl:
// nothing is dispatched on the tensors and no data is touched (a copy-on-write tensor stays
// shared). A tensor without storage or not strided is refused.
constexpr int64_t kFactColumns = 12;

constexpr int64_t kMaxProgressWaitUs = int64_t{3600} * 1000 * 1000;  // an hour
constexpr int64_t kMaxProgressSpinUs = 100 * 1000;  // polling longer than this wastes a core

// A progress word (reshard.h): a CPU int64 tensor of RS_PROGRESS_WORDS elements, contiguous.
int64_t* progress_words(const char* op, const at::Tensor& p) {
  TORCH_CHECK(p.device().is_cpu() && p.scalar_type() == at::kLong && p.is_contiguous() &&
                  p.numel() == RS_PROGRESS_WORDS,
              op, ": progress must be a contiguous CPU int64 tensor of ",
              std::to_string(RS_PROGRESS_WORDS), " elements, got ", p.scalar_type(), " shape ",
              int_list(p.sizes()), p.is_contiguous() ? "" : " (not contiguous)", " on ",
              p.device().str());
  check_storage(op, "progress", p);
  // Atomics and futex waits on the word need natural alignment: a misaligned view (a byte
  // offset into another storage) would tear or never wake.
  const auto addr = reinterpret_cast<uintptr_t>(p.const_data_ptr());
  TORCH_CHECK(addr % alignof(int64_t) == 0, op, ": progress must be 8-byte aligned, got address ",
              std::to_string(addr), " (a view at a byte offset into another storage)");
  return p.mutable_data_ptr<int64_t>();
}

// Blocks (without the GIL: torch.ops calls release it) until the progress word's value is
// >= at_least or negative, or timeout_us microseconds have passed; returns the value. It polls
// for its first spin_us microseconds and sleeps after.
int64_t progress_wait(const at::Tensor& progress, int64_t at_least, int64_t timeout_us,
                      int64_t spin_us) {
  int64_t* p = progress_words("reshard::progress_wait", progress);
  TORCH_CHECK(timeout_us >= 0 && timeout_us <= kMaxProgressWaitUs,
              "reshard::progress_wait: ", "timeout_us ", std::to_string(timeout_us),
              " is outside [0, ", std::to_string(kMaxProgressWaitUs), "]");
  TORCH_CHECK(spin_us >= 0 && spin_us <= kMaxProgressSpinUs, "reshard::progress_wait: ", "spin_us ",
              std::to_string(spin_us), " is outside [0, ", std::to_string(kMaxProgressSpinUs), "]");
  return rs_progress_wait(p, at_least, timeout_us * 1000, spin_us * 1000);
}

void progress_set(const at::Tensor& progress, int64_t value) {
  constexpr const char* op = "reshard::progress_set";
  int64_t* p = progress_words(op, progress);
  check_writable(op, "progress", progress);
  rs_progress_set(p, value);
}

at::Tensor tensor_facts(at::TensorList tensors) {
  at::Tensor out = at::empty({static_cast<int64_t>(tensors.size()), kFactColumns},
                             at::TensorOptions().dtype(at::kLong));
  int64_t* row = out.mutable_data_ptr<int64_t>();
  for (const at::Tensor& t : tensors) {
    TORCH_CHECK(t.defined() && t.layout() == at::kStrided && t.has_storage(),
                "reshard::tensor_facts: every tensor must be strided and have a storage");
    const c10::Storage& st = t.storage();
    row[0] = reinterpret_cast<int64_t>(t.const_data_ptr());
    row[1] = reinterpret_cast<int64_t>(st.data());
    row[2] = static_cast<int64_t>(st.nbytes());
    row[3] = static_cast<int64_t>(t.scalar_type());
    row[4] = static_cast<int64_t>(t.device().type());
    row[5] = t.device().index();
    row[6] = t.dim();
    row[7] = t.numel();
    row[8] = t.is_contiguous();
    row[9] = t.requires_grad();
    row[10] = t.is_inference();
    row[11] = (t.is_conj() ? 1 : 0) | (t.is_neg() ? 2 : 0);
    row += kFactColumns;
  }
  return out;
}

}  // namespace

#ifdef RESHARD_WITH_CUDA
// ---- CUDA (docs/cuda.md) ----------------------------------------------------------------
// desc is a CPU int64 tensor. The first call with a given desc validates it on the host
// (the same rs_validate as the CPU path) and uploads it with its prefix sums to the device;
// the result is cached by the desc's storage identity (a weak reference, so a freed desc
// never matches), its version counter (an in-place torch op on desc invalidates it), the
// buffers' extents and the device. Repeated syncs with the same desc tensor pay neither
// validation nor upload. Mutating a desc behind torch's back (through a numpy view) is not
// detected: build a new tensor instead.

namespace {

struct DeviceTable {
  std::vector<rs_run> runs;  // host copy (empty when it is the desc tensor itself)
  const rs_run* host_runs = nullptr;
  int64_t n = 0, total = 0;
  std::vector<int64_t> prefix;  // host, n + 1
  at::Tensor d_runs, d_prefix;  // device
  std::vector<rs_run> direct;   // stage split only: rows moved by direct copies
  // src / dst hold work element k at index k (a packed arena segment): staging can DMA
  // slots straight from/to it
  bool dense_src = false, dense_dst = false;
};

// Whether one side of a table is its work order laid out densely.
bool is_dense(const rs_run* runs, int64_t n, const int64_t* prefix, bool dst_side) {
  for (int64_t i = 0; i < n; ++i) {
    const rs_run& r = runs[i];
    if (r.length == 0 || r.count == 0) continue;
    const int64_t off = dst_side ? r.dst_offset : r.src_offset;
    const int64_t stride = dst_side ? r.dst_stride : r.src_stride;
    if (off != prefix[i] || (r.count > 1 && stride != r.length)) return false;
  }
  return true;
}

// A cached table's compact form for copy_runs (rs_compact_choose: bounded by the table's own
// device copy or a sixteenth of the bytes a copy reads); form RS_COMPACT_NONE when it has none.
struct CompactTable {
  rs_compact_plan plan{};
  at::Tensor d_pieces;  // device
};

struct CacheEntry {
  const c10::StorageImpl* storage = nullptr;
  c10::weak_intrusive_ptr<c10::StorageImpl> weak{c10::intrusive_ptr<c10::StorageImpl>()};
  uint32_t version = 0;
  const void* data = nullptr;
  int64_t n = 0, src_numel = 0, dst_numel = 0;
  int device = -1;
  std::shared_ptr<DeviceTable> full;
  // stage splits keyed by the element size used to pick direct rows (0: no direct rows)
  std::vector<std::pair<int64_t, std::shared_ptr<DeviceTable>>> splits;
  // compact forms keyed by src_size * 16 + dst_size, built by the first copy_runs with them
  std::vector<std::pair<int, std::shared_ptr<CompactTable>>> compact;
};

// A schedule's local tables (one per FSDP2 storage: hundreds) stay cached across syncs.
constexpr size_t kCacheEntries = 1024;
std::mutex g_cache_mutex;
// Most recently used first. Never destroyed: at process exit the CUDA driver may be gone
// before static destructors run, and freeing the entries' device tensors then aborts.
std::list<std::shared_ptr<CacheEntry>>& g_cache = *new std::list<std::shared_ptr<CacheEntry>>();

void upload(DeviceTable& t, int device) {
  const at::Device dev(at::kCUDA, static_cast<c10::DeviceIndex>(device));
  auto opts = at::TensorOptions().dtype(at::kLong);
  // from_blob views host memory we own; .to() copies synchronously (pageable source)
  t.d_runs = at::from_blob(const_cast<rs_run*>(t.host_runs), {t.n, 6}, opts).to(dev);
  t.d_prefix = at::from_blob(t.prefix.data(), {t.n + 1}, opts).to(dev);
}

// Prefix sums + upload of a (validated) table; owned rows are moved in.
std::shared_ptr<DeviceTable> make_table(const char* op, const rs_run* runs, int64_t n,
                                        std::vector<rs_run> owned, int device) {
  auto t = std::make_shared<DeviceTable>();
  t->runs = std::move(owned);
  t->host_runs = t->runs.empty() ? runs : t->runs.data();
  t->n = n;
  t->prefix.resize(static_cast<size_t>(n) + 1);
  rs_error err;
  TORCH_CHECK(rs_prefix(t->host_runs, n, t->prefix.data(), &t->total, &err) == RS_OK, op,
              ": bad desc: ", err.msg);
  t->dense_src = is_dense(t->host_runs, n, t->prefix.data(), false);
  t->dense_dst = is_dense(t->host_runs, n, t->prefix.data(), true);
  if (n > 0) upload(*t, device);
  return t;
}

// Finds (or validates and inserts) the entry of desc for these extents on this device.
std::shared_ptr<CacheEntry> lookup(const char* op, const at::Tensor& desc, int64_t src_numel,
                                   int64_t dst_numel, int device) {
  const int64_t n = desc.size(0);
  const c10::StorageImpl* storage = desc.storage().unsafeGetStorageImpl();
  const bool cacheable = !desc.is_inference();
  const uint32_t version =
      cacheable ? desc.unsafeGetTensorImpl()->version_counter().current_version() : 0;
  const void* data = desc.const_data_ptr();
  if (cacheable) {
    std::lock_guard<std::mutex> lock(g_cache_mutex);
    for (auto it = g_cache.begin(); it != g_cache.end(); ++it) {
      const CacheEntry& e = **it;
      if (e.storage == storage && !e.weak.expired() && e.version == version && e.data == data &&
          e.n == n && e.src_numel == src_numel && e.dst_numel == dst_numel && e.device == device) {
        auto hit = *it;
        g_cache.erase(it);
        g_cache.push_front(hit);
        return hit;
      }
    }
  }
  const auto* runs = reinterpret_cast<const rs_run*>(desc.const_data_ptr<int64_t>());
  validate_table(op, runs, n, src_numel, dst_numel);
  auto e = std::make_shared<CacheEntry>();
  e->storage = storage;
  e->version = version;
  e->data = data;
  e->n = n;
  e->src_numel = src_numel;
  e->dst_numel = dst_numel;
  e->device = device;
  // the entry owns a copy of the rows: it must not pin (or follow) the caller's tensor
  e->full = make_table(op, nullptr, n, std::vector<rs_run>(runs, runs + n), device);
  if (cacheable) {
    e->weak = desc.storage().getWeakStorageImpl();
    std::lock_guard<std::mutex> lock(g_cache_mutex);
    g_cache.push_front(e);
    if (g_cache.size() > kCacheEntries) g_cache.pop_back();
  }
  return e;
}

// Ring rows and direct rows for staging. direct_es == 0: every row goes through the ring.
std::shared_ptr<DeviceTable> stage_table(const char* op, CacheEntry& e, int64_t direct_es) {
  if (direct_es == 0) return e.full;
  {
    std::lock_guard<std::mutex> lock(g_cache_mutex);
    for (auto& kv : e.splits)
      if (kv.first == direct_es) return kv.second;
  }
  const rs_run* r = e.full->host_runs;
  std::vector<rs_run> ring, direct;
  for (int64_t i = 0; i < e.n; ++i)
    (rs_stage_row_is_direct(&r[i], direct_es, RS_STAGE_DIRECT_MIN_BYTES) ? direct : ring)
        .push_back(r[i]);
  if (direct.empty()) {
    // cached too: otherwise each call with a pinned host buffer scans and copies every row
    // again before its first copy (262,144 rows for 1 GiB of 4 KiB runs)
    std::lock_guard<std::mutex> lock(g_cache_mutex);
    e.splits.emplace_back(direct_es, e.full);
    return e.full;
  }
  const auto n_ring = static_cast<int64_t>(ring.size());
  auto t = make_table(op, nullptr, n_ring, std::move(ring), e.device);
  t->direct = std::move(direct);
  std::lock_guard<std::mutex> lock(g_cache_mutex);
  e.splits.emplace_back(direct_es, t);
  return t;
}

// The compact form of a cached table for these element sizes, built on first use; nullptr when
// the table has none (not short, or no form within the bound).
std::shared_ptr<const CompactTable> compact_table(CacheEntry& e, int src_size, int dst_size) {
  const int key = src_size * 16 + dst_size;
  {
    std::lock_guard<std::mutex> lock(g_cache_mutex);
    for (auto& kv : e.compact)
      if (kv.first == key) return kv.second->plan.form == RS_COMPACT_NONE ? nullptr : kv.second;
  }
  auto c = std::make_shared<CompactTable>();
  const DeviceTable& t = *e.full;
  rs_compact_choose(t.host_runs, t.n, t.total, e.src_numel, e.dst_numel, src_size, dst_size,
                    RS_COMPACT_MAX_RUN_BYTES, &c->plan);
  if (c->plan.form != RS_COMPACT_NONE) {
    std::vector<int64_t> host(static_cast<size_t>(c->plan.bytes / 8));
    rs_compact_fill(t.host_runs, t.n, &c->plan, host.data());
    const at::Device dev(at::kCUDA, static_cast<c10::DeviceIndex>(e.device));
    c->d_pieces = at::from_blob(host.data(), {static_cast<int64_t>(host.size())},
                                at::TensorOptions().dtype(at::kLong))
                      .to(dev);
  }
  std::lock_guard<std::mutex> lock(g_cache_mutex);
  e.compact.emplace_back(key, c);
  return c->plan.form == RS_COMPACT_NONE ? nullptr : c;
}

// The caching allocator must not hand a cached table's memory to another stream while a
// kernel on this one may still read it.
void record_use(const DeviceTable& t, const c10::cuda::CUDAStream& stream) {
  if (t.n == 0) return;
  c10::cuda::CUDACachingAllocator::recordStream(t.d_runs.storage().data_ptr(), stream);
  c10::cuda::CUDACachingAllocator::recordStream(t.d_prefix.storage().data_ptr(), stream);
}

rs_dtype rs_dtype_of(const at::Tensor& t) {
  rs_dtype d;
  to_rs_dtype(t.scalar_type(), &d);
  return d;
}

void copy_runs_cuda(const at::Tensor& src, const at::Tensor& desc_in, const at::Tensor& dst) {
  constexpr const char* op = "reshard::copy_runs";
  const char* one_device =
      "on dst's CUDA device (CPU<->GPU copies are reshard::stage_h2d / stage_d2h)";
  check_device(op, "desc", desc_in, desc_in.is_cpu(),
               "a CPU tensor (it is validated on the host, then uploaded once and cached per "
               "device)");
  check_device(op, "dst", dst, dst.is_cuda(), "a CUDA tensor when src is (or use stage_d2h)");
  check_device(op, "src", src, src.device() == dst.device(), one_device);
  at::Tensor desc = check_common(op, src, desc_in, dst);
  check_no_alias(op, src, dst);
  const c10::cuda::CUDAGuard guard(dst.device());
  auto entry = lookup(op, desc, src.numel(), dst.numel(), dst.get_device());
  const auto t = entry->full;
  if (t->total == 0) return;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  rs_error err;
  // tables outside the cache (inference tensors) are not compiled: they are used once
  const auto compact = desc.is_inference()
                           ? nullptr
                           : compact_table(*entry, static_cast<int>(src.element_size()),
                                           static_cast<int>(dst.element_size()));
  if (compact) {
    const rs_status st = rs_cuda_copy_compact(
        src.const_data_ptr(), rs_dtype_of(src), dst.mutable_data_ptr(), rs_dtype_of(dst),
        &compact->plan, compact->d_pieces.const_data_ptr(), stream.stream(), &err);
    TORCH_CHECK(st == RS_OK, op, ": ", err.msg);
    c10::cuda::CUDACachingAllocator::recordStream(compact->d_pieces.storage().data_ptr(), stream);
    return;
  }
  const rs_status st = rs_cuda_copy_slice(
      src.const_data_ptr(), rs_dtype_of(src), dst.mutable_data_ptr(), rs_dtype_of(dst),
      reinterpret_cast<const rs_run*>(t->d_runs.const_data_ptr<int64_t>()), t->n,
      t->d_prefix.const_data_ptr<int64_t>(), 0, t->total, RS_MODE_RUNS, stream.stream(), &err);
  TORCH_CHECK(st == RS_OK, op, ": ", err.msg);
  record_use(*t, stream);
}

// Host half of the staging loop: rs_copy_slice over the torch thread pool. The dense side's
// pointer moves with each thread's sub-range (it holds work element `begin` at index 0).
rs_status host_copy_threaded(void* /*ctx*/, const void* src, rs_dtype sdt, void* dst, rs_dtype ddt,
                             const rs_run* runs, int64_t n, const int64_t* prefix, int64_t begin,
                             int64_t end, rs_mode mode) {
  const auto ssz = static_cast<int64_t>(rs_dtype_size(sdt));
  const auto dsz = static_cast<int64_t>(rs_dtype_size(ddt));
  if (ssz == 0 || dsz == 0) return RS_EDTYPE;
  std::atomic<int> status{RS_OK};
  at::parallel_for(begin, end, std::max<int64_t>(1, kGrainBytes / dsz), [&](int64_t b, int64_t e) {
    const char* s = static_cast<const char*>(src);
    char* d = static_cast<char*>(dst);
    if (mode == RS_MODE_UNPACK) s += (b - begin) * ssz;
    if (mode == RS_MODE_PACK) d += (b - begin) * dsz;
    const rs_status r = rs_copy_slice(s, sdt, d, ddt, runs, n, prefix, b, e, mode);
    if (r != RS_OK) status.store(r);
  });
  return static_cast<rs_status>(status.load());
}

// The queued H2D's workers on the torch thread pool: one index per thread.
void run_workers(void* /*ctx*/, int64_t workers, rs_worker_fn body, void* arg) {
  at::parallel_for(0, workers, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) body(arg, i);
  });
}

void check_ring(const char* op, const at::Tensor& ring, const at::Tensor& host) {
  TORCH_CHECK(ring.is_contiguous(), op, ": ring must be contiguous");
  TORCH_CHECK(ring.is_pinned(), op,
              ": ring must be pinned host memory (torch.empty(nbytes, dtype=torch.uint8, "
              "pin_memory=True)); pageable memory would make every DMA synchronous");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(ring.const_data_ptr()) % 16 == 0, op,
              ": ring must start on a 16-byte boundary");
  if (host.numel() > 0 && ring.numel() > 0) {
    const auto r0 = reinterpret_cast<uintptr_t>(ring.const_data_ptr());
    const auto h0 = reinterpret_cast<uintptr_t>(host.const_data_ptr());
    TORCH_CHECK(r0 + ring.nbytes() <= h0 || h0 + host.nbytes() <= r0, op,
                ": ring overlaps the host buffer");
  }
}

// What a stage call did, returned by the op as an int64 CPU tensor, in the order of
// reshard._ops.STAGE_STATS.
at::Tensor stats_tensor(const rs_stage_stats& s) {
  at::Tensor out = at::empty({7}, at::TensorOptions().dtype(at::kLong));
  int64_t* v = out.mutable_data_ptr<int64_t>();
  const int64_t values[7] = {s.slots,        s.slot_bytes,    s.chunks,    s.ring_bytes,
                             s.direct_bytes, s.direct_copies, s.host_waits};
  std::copy(values, values + 7, v);
  return out;
}

at::Tensor stage_cuda(rs_direction dir, const at::Tensor& src, const at::Tensor& desc_in,
                      const at::Tensor& ring, const at::Tensor& dst,
                      const std::optional<at::Tensor>& progress = std::nullopt) {
  const char* op = dir == RS_H2D ? "reshard::stage_h2d" : "reshard::stage_d2h";
  const at::Tensor& host = dir == RS_H2D ? src : dst;
  const at::Tensor& dev = dir == RS_H2D ? dst : src;
  check_device(op, dir == RS_H2D ? "src" : "dst", host, host.is_cpu(),
               "a CPU tensor (pinned or pageable)");
  check_device(op, dir == RS_H2D ? "dst" : "src", dev, dev.is_cuda(), "a CUDA tensor");
  check_device(op, "desc", desc_in, desc_in.is_cpu(), "a CPU tensor");
  check_device(op, "ring", ring, ring.is_cpu(), "a pinned CPU tensor");
  at::Tensor desc = check_common(op, src, desc_in, dst);
  check_storage(op, "ring", ring);
  check_ring(op, ring, host);
  check_writable(op, "ring", ring);
  if (dir == RS_D2H) check_writable(op, "dst", dst);
  const c10::cuda::CUDAGuard guard(dev.device());
  auto entry = lookup(op, desc, src.numel(), dst.numel(), dev.get_device());
  // Direct copies need a pinned (or registered) host buffer and no cast.
  const bool direct_ok =
      host.numel() > 0 && src.scalar_type() == dst.scalar_type() &&
      rs_cuda_is_pinned(host.const_data_ptr(), static_cast<int64_t>(host.nbytes()));
  const auto t = stage_table(op, *entry, direct_ok ? static_cast<int64_t>(src.itemsize()) : 0);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor staging;
  const int64_t ring_bytes = static_cast<int64_t>(ring.nbytes());
  const rs_dtype wire = rs_stage_wire_dtype(dir, rs_dtype_of(src), rs_dtype_of(dst));
  const bool device_dense = dir == RS_H2D ? (t->dense_dst && wire == rs_dtype_of(dst))
                                          : (t->dense_src && wire == rs_dtype_of(src));
  if (t->total > 0) {
    rs_error err;
    int64_t slots = 0, slot_bytes = 0;
    TORCH_CHECK(rs_stage_slots(ring_bytes, &slots, &slot_bytes, &err) == RS_OK, op, ": ", err.msg);
    if (!device_dense)
      staging = at::empty({rs_stage_device_bytes(ring_bytes)},
                          at::TensorOptions().dtype(at::kByte).device(dev.device()));
  }
  rs_stage_table table;
  table.runs = t->host_runs;
  table.prefix = t->prefix.data();
  table.n = t->n;
  table.total = t->total;
  table.d_runs =
      t->n ? reinterpret_cast<const rs_run*>(t->d_runs.const_data_ptr<int64_t>()) : nullptr;
  table.d_prefix = t->n ? t->d_prefix.const_data_ptr<int64_t>() : nullptr;
  table.direct = t->direct.data();
  table.n_direct = static_cast<int64_t>(t->direct.size());
  table.device_dense = device_dense ? 1 : 0;
  rs_stage_buffers buf;
  buf.src = src.const_data_ptr();
  buf.src_dtype = rs_dtype_of(src);
  buf.dst = dst.mutable_data_ptr();
  buf.dst_dtype = rs_dtype_of(dst);
  buf.ring = ring.mutable_data_ptr();
  buf.ring_bytes = ring_bytes;
  buf.staging = staging.defined() ? staging.mutable_data_ptr() : nullptr;
  buf.stream = stream.stream();
  buf.progress = nullptr;
  if (progress.has_value()) {
    buf.progress = progress_words(op, *progress);
    check_writable(op, "progress", *progress);
    // the op writes the word while it reads src and fills the ring
    for (const at::Tensor* other : {&src, &ring}) {
      const auto a = reinterpret_cast<uintptr_t>(progress->const_data_ptr());
      const auto b = reinterpret_cast<uintptr_t>(other->const_data_ptr());
      TORCH_CHECK(a + progress->nbytes() <= b || b + other->nbytes() <= a, op, ": progress ",
                  "shares memory with ", other == &src ? "src" : "ring");
    }
  }
  rs_stage_stats stats{};
  rs_error err;
  // H2D of ring rows only, more than one sub-chunk of them: the host's threads pack the
  // ring's chunks as one queue (no join per chunk); everything else: one chunk at a time.
  const int64_t workers = at::in_parallel_region() ? 1 : at::get_num_threads();
  int64_t q_slots = 0, q_slot_bytes = 0;
  const bool queued =
      dir == RS_H2D && table.n_direct == 0 && workers > 1 &&
      t->total * static_cast<int64_t>(rs_dtype_size(wire)) > 2 * RS_STAGE_QUEUE_SUB_BYTES &&
      rs_stage_h2d_queued_slots(ring_bytes, &q_slots, &q_slot_bytes);
  const rs_status st =
      queued ? rs_cuda_stage_h2d_queued(&table, &buf, workers, run_workers, nullptr, &stats, &err)
             : rs_cuda_stage(dir, &table, &buf, host_copy_threaded, nullptr, &stats, &err);
  TORCH_CHECK(st == RS_OK, op, ": ", err.msg);
  record_use(*t, stream);
  return stats_tensor(stats);
}

at::Tensor stage_h2d_cuda(const at::Tensor& src, const at::Tensor& desc, const at::Tensor& ring,
                          const at::Tensor& dst, const std::optional<at::Tensor>& progress) {
  return stage_cuda(RS_H2D, src, desc, ring, dst, progress);
}

at::Tensor stage_d2h_cuda(const at::Tensor& src, const at::Tensor& desc, const at::Tensor& ring,
                          const at::Tensor& dst) {
  return stage_cuda(RS_D2H, src, desc, ring, dst);
}

// Page-locks the whole storage of a CPU tensor in place. 1: registered by this call (undo
// with host_unregister); 0: it already was pinned or registered (nothing to undo).
int64_t host_register(const at::Tensor& t) {
  TORCH_CHECK(t.is_cpu(), "reshard::host_register: needs a CPU tensor, got ", t.device());
  const auto nbytes = static_cast<int64_t>(t.storage().nbytes());
  TORCH_CHECK(nbytes > 0, "reshard::host_register: the tensor's storage is empty");
  int registered = 0;
  rs_error err;
  TORCH_CHECK(rs_cuda_host_register(t.storage().mutable_data(), nbytes, &registered, &err) == RS_OK,
              "reshard::host_register: ", err.msg);
  return registered;
}

void host_unregister(const at::Tensor& t) {
  TORCH_CHECK(t.is_cpu(), "reshard::host_unregister: needs a CPU tensor, got ", t.device());
  rs_error err;
  TORCH_CHECK(rs_cuda_host_unregister(t.storage().mutable_data(), &err) == RS_OK,
              "reshard::host_unregister: ", err.msg);
}

// Device bytes a stage call holds for a ring of ring_bytes (0 when the ring is too small).
int64_t stage_device_bytes(int64_t ring_bytes) { return rs_stage_device_bytes(ring_bytes); }

}  // namespace

#else  // CPU-only build: the CUDA-only ops exist and say so when called

namespace {

[[noreturn]] void built_without_cuda(const char* op) {
  TORCH_CHECK(false, op,
              ": reshard was built without CUDA (rebuild it against a CUDA torch with CUDA_HOME "
              "set: pip install --no-build-isolation -e .)");
}

void copy_runs_cuda(const at::Tensor&, const at::Tensor&, const at::Tensor&) {
  built_without_cuda("reshard::copy_runs");
}
at::Tensor stage_h2d_cuda(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          const at::Tensor&, const std::optional<at::Tensor>&) {
  built_without_cuda("reshard::stage_h2d");
}
at::Tensor stage_d2h_cuda(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          const at::Tensor&) {
  built_without_cuda("reshard::stage_d2h");
}
int64_t host_register(const at::Tensor&) { built_without_cuda("reshard::host_register"); }
void host_unregister(const at::Tensor&) { built_without_cuda("reshard::host_unregister"); }
int64_t stage_device_bytes(int64_t) { built_without_cuda("reshard::stage_device_bytes"); }

}  // namespace

#endif  // RESHARD_WITH_CUDA

// Every schema, in every build: the op set does not depend on which backends were built.
TORCH_LIBRARY(reshard, m) {
  m.def("copy_runs(Tensor src, Tensor desc, Tensor(a!) dst) -> ()");
  m.def("copy_pieces(Tensor[] srcs, Tensor pieces, Tensor(a!) dst) -> ()");
  // The stage ops return what they did (reshard._ops.STAGE_STATS) as an int64 CPU tensor.
  // stage_h2d's progress: a progress word (progress_wait) published as its copies are queued.
  m.def(
      "stage_h2d(Tensor src, Tensor desc, Tensor(a!) ring, Tensor(b!) dst, "
      "Tensor(c!)? progress=None) -> Tensor");
  m.def("stage_d2h(Tensor src, Tensor desc, Tensor(a!) ring, Tensor(b!) dst) -> Tensor");
  m.def("host_register(Tensor t) -> int", &host_register);
  m.def("host_unregister(Tensor t) -> ()", &host_unregister);
  m.def("stage_device_bytes(int ring_bytes) -> int", &stage_device_bytes);
  m.def("tensor_facts(Tensor[] tensors) -> Tensor", &tensor_facts);
  m.def("progress_wait(Tensor progress, int at_least, int timeout_us, int spin_us=0) -> int",
        &progress_wait);
  m.def("progress_set(Tensor(a!) progress, int value) -> ()");
  m.def("unwritable_reason(Tensor t) -> str", &unwritable_reason);
}

// The stage ops move CPU<->CUDA: called with CPU tensors only, their device checks name the
// argument that should be on the GPU.
TORCH_LIBRARY_IMPL(reshard, CPU, m) {
  m.impl("copy_runs", &copy_runs_cpu);
  m.impl("copy_pieces", &copy_pieces_cpu);
  m.impl("stage_h2d", &stage_h2d_cuda);
  m.impl("stage_d2h", &stage_d2h_cuda);
  m.impl("progress_set", &progress_set);
}

// copy_pieces is a CPU op: called with a CUDA tensor, its device checks name the argument.
TORCH_LIBRARY_IMPL(reshard, CUDA, m) {
  m.impl("copy_runs", &copy_runs_cuda);
  m.impl("copy_pieces", &copy_pieces_cpu);
  m.impl("stage_h2d", &stage_h2d_cuda);
  m.impl("stage_d2h", &stage_d2h_cuda);
}

namespace {

// ADInplaceOrView kernel of the mutating ops: what torch's generated in-place kernels do, for
// every argument the schema marks as written (torch's boxed fallback bumps only returned
// tensors, and these ops return nothing). An inference tensor is refused before the write.
void bump_written_versions(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                           torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t n = schema.arguments().size();
  std::vector<at::Tensor> written;
  for (size_t i = 0; i < n; ++i) {
    if (!schema.is_mutable({c10::SchemaArgType::input, i})) continue;
    const c10::IValue& v = (*stack)[stack->size() - n + i];
    if (v.isNone()) continue;  // an optional argument left out
    const at::Tensor& t = v.toTensor();
    TORCH_CHECK(!t.is_inference() || c10::InferenceMode::is_enabled(), schema.name(), ": ",
                schema.arguments()[i].name(),
                " is an inference tensor: an in-place update to it outside InferenceMode is not "
                "allowed (clone it to get a normal tensor, or call under torch.inference_mode())");
    written.push_back(t);
  }
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
  }
  for (const auto& t : written) torch::autograd::increment_version(t);
}

// torch holds autograd nodes in std::shared_ptr up to 2.11 and in c10::intrusive_ptr later:
// take the pointer type from Tensor::grad_fn() so one source builds against both.
using NodePtr = std::decay_t<decltype(std::declval<const at::Tensor&>().grad_fn())>;

template <class N, class... Args>
NodePtr make_node(Args&&... args) {
  if constexpr (std::is_same_v<NodePtr, std::shared_ptr<torch::autograd::Node>>)
    return std::make_shared<N>(std::forward<Args>(args)...);
  else
    return c10::make_intrusive<N>(std::forward<Args>(args)...);
}

// Autograd kernel of the mutating ops, as torch's kernels of in-place ops without a derivative:
// in grad mode, when an argument requires grad, writing a leaf that requires grad (or a view
// of one) is refused, and what is written gets a history whose backward raises "derivative
// for reshard::... is not implemented" (never a gradient computed from the old values).
void autograd_inplace_writes(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                             torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t n = schema.arguments().size();
  std::vector<at::Tensor> requiring_grad, written;
  for (size_t i = 0; i < n; ++i) {
    const c10::IValue& v = (*stack)[stack->size() - n + i];
    if (v.isTensorList()) {  // copy_pieces' sources: read, never written
      for (const at::Tensor& t : v.toTensorList())
        if (at::GradMode::is_enabled() && t.requires_grad()) requiring_grad.push_back(t);
      continue;
    }
    if (!v.isTensor()) continue;
    if (at::GradMode::is_enabled() && v.toTensor().requires_grad())
      requiring_grad.push_back(v.toTensor());
    if (schema.is_mutable({c10::SchemaArgType::input, i})) written.push_back(v.toTensor());
  }
  NodePtr grad_fn;
  if (!requiring_grad.empty()) {
    for (const auto& t : written) torch::autograd::check_inplace(t, true);
    grad_fn = make_node<torch::autograd::NotImplemented>(
        schema.name(), torch::autograd::collect_next_edges(requiring_grad));
  }
  {
    at::AutoDispatchBelowAutograd guard;
    op.redispatchBoxed(keys & c10::after_autograd_keyset, stack);
  }
  if (!grad_fn) return;
  for (const auto& t : written)
    if (torch::autograd::isDifferentiableType(t.scalar_type()))
      torch::autograd::rebase_history(t, grad_fn);
}

// Conjugate / Negative kernel of the ops: a lazily conjugated or negated view (t.conj(),
// torch._neg_view) is refused, naming the argument. torch's fallback for these keys would run
// the op on a materialized copy, and for a written argument it asserts and later aborts.
void refuse_math_bits(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                      torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t n = schema.arguments().size();
  auto check = [&](const at::Tensor& t, const std::string& name) {
    TORCH_CHECK(!t.is_conj(), schema.name(), ": ", name,
                " is a lazily conjugated view (t.conj()): pass t.resolve_conj()");
    TORCH_CHECK(!t.is_neg(), schema.name(), ": ", name,
                " is a lazily negated view: pass t.resolve_neg()");
  };
  for (size_t i = 0; i < n; ++i) {
    const c10::IValue& v = (*stack)[stack->size() - n + i];
    const std::string& name = schema.arguments()[i].name();
    if (v.isTensor()) check(v.toTensor(), name);
    if (v.isTensorList()) {
      const auto list = v.toTensorList();
      for (size_t j = 0; j < list.size(); ++j)
        check(list.get(j), name + "[" + std::to_string(j) + "]");
    }
  }
  // reached only without either bit: on past both keys (Conjugate is the lower of the two)
  op.redispatchBoxed(
      keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, c10::DispatchKey::Conjugate),
      stack);
}

// Every op that copies from, writes or waits on a tensor (tensor_facts only reads facts).
constexpr const char* kTensorOps[] = {"copy_runs", "copy_pieces",  "stage_h2d",
                                      "stage_d2h", "progress_set", "progress_wait"};

// tensor_facts reads the tensors it is given, math bits included, not materialized copies.
void past_math_bits(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                    torch::jit::Stack* stack) {
  op.redispatchBoxed(
      keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, c10::DispatchKey::Conjugate),
      stack);
}

}  // namespace

TORCH_LIBRARY_IMPL(reshard, Conjugate, m) {
  for (const char* op : kTensorOps)
    m.impl(op, torch::CppFunction::makeFromBoxedFunction<&refuse_math_bits>());
  m.impl("tensor_facts", torch::CppFunction::makeFromBoxedFunction<&past_math_bits>());
}

TORCH_LIBRARY_IMPL(reshard, Negative, m) {
  for (const char* op : kTensorOps)
    m.impl(op, torch::CppFunction::makeFromBoxedFunction<&refuse_math_bits>());
  m.impl("tensor_facts", torch::CppFunction::makeFromBoxedFunction<&past_math_bits>());
}

// The writes are in-place writes to autograd, as torch's own in-place ops are: version
// counters bumped (a tensor saved for backward and then overwritten makes backward raise),
// torch's refusals, no silent gradient through overwritten values. torch's boxed fallbacks for
// custom ops do this only for returned tensors, and these ops return nothing.
TORCH_LIBRARY_IMPL(reshard, ADInplaceOrView, m) {
  for (const char* op : {"copy_runs", "copy_pieces", "stage_h2d", "stage_d2h", "progress_set"})
    m.impl(op, torch::CppFunction::makeFromBoxedFunction<&bump_written_versions>());
}

TORCH_LIBRARY_IMPL(reshard, Autograd, m) {
  for (const char* op : {"copy_runs", "copy_pieces", "stage_h2d", "stage_d2h", "progress_set"})
    m.impl(op, torch::CppFunction::makeFromBoxedFunction<&autograd_inplace_writes>());
}

}  // namespace reshard
