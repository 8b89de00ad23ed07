/* reshard C core: copy strided runs described by a descriptor table, with casts.
 *
 * C11, no torch, no printing, no exit/abort: every fallible function returns an
 * rs_status and, on failure, fills a caller-provided rs_error naming the row and reason.
 *
 * A descriptor table is n rows of six int64 (rs_run), all counted in *elements* of the
 * respective buffer's dtype:
 *   for c in [0, count), j in [0, length):
 *     dst[dst_offset + c*dst_stride + j] = cast(src[src_offset + c*src_stride + j])
 * Rows with count == 0 or length == 0 are legal no-ops. Negative values are errors.
 *
 * "Work" is the table flattened in row-major (row, c, j) order: work element k is one
 * destination element. Threads split the table by work range [begin, end), not by rows,
 * so one huge run and a million tiny runs both spread over every thread.
 *
 * Typical use (what csrc/ops.cpp does):
 *   rs_validate(runs, n, src_numel, dst_numel, RS_CHECK_OVERLAP, &err)  -- before any write
 *   rs_prefix(runs, n, prefix, &total, &err)                          -- n+1 entries
 *   in parallel, disjoint [b, e) covering [0, total):
 *     rs_copy_slice(src, sdt, dst, ddt, runs, n, prefix, b, e, RS_MODE_RUNS)
 */
#ifndef RESHARD_H
#define RESHARD_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define RS_VERSION_MAJOR 0
#define RS_VERSION_MINOR 1
#define RS_VERSION_PATCH 0
#define RS_VERSION_STRING "0.1.0"

/* Status codes. RS_OK is 0; every error is positive. */
typedef enum rs_status {
  RS_OK = 0,
  RS_EINVAL = 1,    /* bad argument: null pointer, negative n or extent, bad mode/flags */
  RS_ENEG = 2,      /* a descriptor field is negative */
  RS_EOVERFLOW = 3, /* offset + (count-1)*stride + length (or a work total) overflows int64 */
  RS_ERANGE = 4,    /* a run reads or writes outside the buffer's extent */
  RS_EOVERLAP = 5,  /* two writes hit the same destination element (RS_CHECK_OVERLAP) */
  RS_EDTYPE = 6,    /* unknown dtype or unsupported dtype pair */
  RS_ENOMEM = 7,    /* an internal allocation failed (overlap check of an unsorted table) */
  RS_EDEVICE = 8    /* reserved for the CUDA half (csrc/cuda): a CUDA call failed */
} rs_status;

/* Element types. Casts are defined among RS_F32, RS_BF16, RS_F16 (bitwise identical to
 * torch's .to(): round to nearest even, subnormals, inf, NaN as torch does on CPU).
 * Any dtype copies to itself; RS_RAW* are same-size raw copies (ints, bool, fp64, ...). */
typedef enum rs_dtype {
  RS_F32 = 0,
  RS_BF16 = 1,
  RS_F16 = 2,
  RS_RAW1 = 3,
  RS_RAW2 = 4,
  RS_RAW4 = 5,
  RS_RAW8 = 6,
  RS_DTYPE_COUNT = 7
} rs_dtype;

/* One descriptor row; layout-compatible with a row of the int64 [n, 6] desc tensor, so
 * `(const rs_run *)desc.data_ptr<int64_t>()` is a valid table. */
typedef struct rs_run {
  int64_t src_offset;
  int64_t src_stride;
  int64_t dst_offset;
  int64_t dst_stride;
  int64_t length;
  int64_t count;
} rs_run;

/* Filled on failure. row is the offending descriptor row, or -1 when the error is not
 * about one row. For RS_EOVERLAP, other_row is the row it overlaps (may equal row). */
typedef struct rs_error {
  rs_status code;
  int64_t row;
  int64_t other_row;
  char msg[256];
} rs_error;

/* Validation flags. */
#define RS_CHECK_OVERLAP 1u /* reject tables in which two writes hit the same dst element */

/* Copy modes of rs_copy_slice. In the dense modes the dense side's pointer is the element
 * holding work element `begin`: work element k lives at dense[k - begin]. */
typedef enum rs_mode {
  RS_MODE_RUNS = 0,  /* src and dst both addressed by the table's offsets/strides */
  RS_MODE_PACK = 1,  /* src by the table, dst dense: gather a chunk into a staging slot */
  RS_MODE_UNPACK = 2 /* src dense, dst by the table: scatter a staging slot */
} rs_mode;

/* Fills *err (when err is not NULL) with code, row, other_row and a printf-formatted message
 * (truncated to fit), and returns code: how every function of the core and of the CUDA half
 * reports a failure. */
#if defined(__GNUC__) || defined(__clang__)
__attribute__((format(printf, 5, 6)))
#endif
rs_status rs_fail(rs_error *err, rs_status code, int64_t row, int64_t other_row, const char *fmt,
                  ...);

/* Bytes per element; 0 for an unknown dtype. */
size_t rs_dtype_size(rs_dtype dtype);

/* A short name ("f32", "bf16", ...); "?" for an unknown dtype. */
const char *rs_dtype_name(rs_dtype dtype);

/* 1 if rs_copy_slice supports src -> dst, else 0. */
int rs_dtype_pair_ok(rs_dtype src, rs_dtype dst);

/* A static, human-readable name of a status code. */
const char *rs_status_name(rs_status status);

/* Checks every row of the table against the buffers' extents (in elements): no negative
 * field, no int64 overflow in offset + (count-1)*stride + length, every read inside
 * [0, src_numel), every write inside [0, dst_numel). With RS_CHECK_OVERLAP also rejects
 * overlapping writes (within a row: count > 1 and dst_stride < length; across rows: exact
 * interval check, O(n) for tables sorted by dst_offset, O(n log n) plus allocation
 * otherwise). Reports the first bad row in table order for per-row errors. */
rs_status rs_validate(const rs_run *runs, int64_t n, int64_t src_numel, int64_t dst_numel,
                      unsigned flags, rs_error *err);

/* prefix[i] = work elements of rows [0, i); prefix must hold n + 1 entries; *total =
 * prefix[n]. Fails with RS_EOVERFLOW (naming the row) if a sum overflows int64.
 * prefix may be NULL to compute only the total. */
rs_status rs_prefix(const rs_run *runs, int64_t n, int64_t *prefix, int64_t *total, rs_error *err);

/* Copies work elements [begin, end) of a *validated* table (no bounds checks here: call
 * rs_validate first) from src to dst with a cast. prefix comes from rs_prefix. Disjoint
 * slices of a table without overlapping writes may run concurrently. Returns RS_EINVAL
 * for a bad range or mode, RS_EDTYPE for an unsupported pair; never touches memory then.
 * Same-dtype tables with >= 4 MiB of destination are written with streaming stores, fenced
 * before returning: the written lines are in memory, not in this core's cache. */
rs_status rs_copy_slice(const void *src, rs_dtype src_dtype, void *dst, rs_dtype dst_dtype,
                        const rs_run *runs, int64_t n, const int64_t *prefix, int64_t begin,
                        int64_t end, rs_mode mode);

/* Single-threaded convenience: validate (with flags), then copy the whole table.
 * Allocates the prefix array (RS_ENOMEM on failure). Nothing is written on error. */
rs_status rs_copy_runs(const void *src, rs_dtype src_dtype, int64_t src_numel, void *dst,
                       rs_dtype dst_dtype, int64_t dst_numel, const rs_run *runs, int64_t n,
                       unsigned flags, rs_error *err);

/* Scalar casts, exposed for tests and for the CUDA half's host reference. Bitwise equal to
 * torch's CPU .to() on contiguous tensors, NaN included; torch's NaN results differ per pair:
 *   f32 -> bf16: every NaN -> 0xFFFF;  f16 -> bf16: every NaN -> 0x7FC0
 *   f32/bf16 -> f16: sign kept, quiet bit set, top 9 payload bits kept (as x86 F16C)
 *   f16 -> f32: sign and payload kept, quiet bit set (torch's vectorized body: its scalar tail
 *   gives 0x7FFFFFFF for the last numel % 8 elements);  bf16 -> f32: exact (bits << 16) */
uint16_t rs_f32_to_bf16(float f);
uint16_t rs_f32_to_f16(float f);
float rs_bf16_to_f32(uint16_t h);
float rs_f16_to_f32(uint16_t h);

/* The instruction set the bulk casts use: 0 baseline, 1 AVX2, 2 AVX-512BW (x86-64 with GCC or
 * clang; 0 elsewhere): the CPU's best, capped by RESHARD_CPU_CAPABILITY=default|avx2|avx512. */
int rs_cpu_capability(void);

/* ---- progress words: how far a long call has got, for a thread waiting on it ---------------
 * A progress word is four int64: [0] the published value, [1] a sequence number (its low 32
 * bits are the word a waiter sleeps on), [2] a base and [3] a scale that rs_progress_publish
 * applies. A producer publishes values that only grow (the end of a prefix it has finished);
 * a negative value is final (the producer failed). Waiters sleep (Linux futex; elsewhere they
 * poll) until the value reaches what they need, turns negative, or their timeout passes. */
#define RS_PROGRESS_WORDS 4

/* value = p[2] + amount * p[3], stored with release order; wakes every waiter. */
void rs_progress_publish(int64_t *p, int64_t amount);
/* Stores `value` as is (a reset, a final value); wakes every waiter. */
void rs_progress_set(int64_t *p, int64_t value);
/* The value, once it is >= at_least or negative, or when timeout_ns (>= 0) has passed; reads
 * with acquire order, so what the producer wrote before publishing is visible. For its first
 * spin_ns (>= 0) the waiter polls instead of sleeping: a short wait then costs no wake-up. */
int64_t rs_progress_wait(int64_t *p, int64_t at_least, int64_t timeout_ns, int64_t spin_ns);

/* ---- writable host memory: a write to read-only memory (a numpy memmap opened with mode 'r')
 * kills the process, and nothing but the process's memory map says where that memory is. */
#define RS_MEMORY_MAP "/proc/self/maps" /* Linux; elsewhere there is none */

/* Reads a memory map in the format of Linux's /proc/<pid>/maps (lines in address order) from
 * map_path and looks for the first byte of [addr, addr + nbytes) that no writable mapping holds.
 * Returns 1 when there is one: *offset is its distance from addr, and `what` (what_len bytes,
 * truncated to fit) says what is there ("read-only memory: mapped r--s from /path" or "no
 * memory is mapped there"); 0 when every byte is writable (always for nbytes 0); -1 when the
 * map cannot be opened (no /proc: not Linux), so nothing was checked. */
int rs_unwritable_byte(const char *map_path, uintptr_t addr, uint64_t nbytes, uint64_t *offset,
                       char *what, size_t what_len);

#ifdef __cplusplus
}
#endif

#endif /* RESHARD_H */
