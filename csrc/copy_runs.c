/* reshard C core: descriptor validation and the strided-run copy with casts. See reshard.h. */
#include "reshard.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* Extents above this are rejected: no real buffer is that large, and the bound keeps every
 * intermediate of the overlap arithmetic below inside int64. */
#define RS_MAX_NUMEL (INT64_C(1) << 60)

static const char *const field_names[6] = {"src_offset", "src_stride", "dst_offset",
                                           "dst_stride", "length",     "count"};

static rs_status fail(rs_error *err, rs_status code, int64_t row, int64_t other, const char *fmt,
                      ...) {
  if (err) {
    va_list ap;
    err->code = code;
    err->row = row;
    err->other_row = other;
    va_start(ap, fmt);
    vsnprintf(err->msg, sizeof err->msg, fmt, ap);
    va_end(ap);
  }
  return code;
}

static void clear(rs_error *err) {
  if (err) {
    err->code = RS_OK;
    err->row = -1;
    err->other_row = -1;
    err->msg[0] = '\0';
  }
}

size_t rs_dtype_size(rs_dtype dtype) {
  switch (dtype) {
    case RS_F32: return 4;
    case RS_BF16: return 2;
    case RS_F16: return 2;
    case RS_RAW1: return 1;
    case RS_RAW2: return 2;
    case RS_RAW4: return 4;
    case RS_RAW8: return 8;
    default: return 0;
  }
}

const char *rs_dtype_name(rs_dtype dtype) {
  switch (dtype) {
    case RS_F32: return "f32";
    case RS_BF16: return "bf16";
    case RS_F16: return "f16";
    case RS_RAW1: return "raw1";
    case RS_RAW2: return "raw2";
    case RS_RAW4: return "raw4";
    case RS_RAW8: return "raw8";
    default: return "?";
  }
}

static int is_float(rs_dtype d) { return d == RS_F32 || d == RS_BF16 || d == RS_F16; }

int rs_dtype_pair_ok(rs_dtype src, rs_dtype dst) {
  if (rs_dtype_size(src) == 0 || rs_dtype_size(dst) == 0) return 0;
  return src == dst || (is_float(src) && is_float(dst));
}

const char *rs_status_name(rs_status status) {
  switch (status) {
    case RS_OK: return "ok";
    case RS_EINVAL: return "invalid argument";
    case RS_ENEG: return "negative descriptor field";
    case RS_EOVERFLOW: return "int64 overflow";
    case RS_ERANGE: return "out of range";
    case RS_EOVERLAP: return "overlapping writes";
    case RS_EDTYPE: return "unsupported dtype";
    case RS_ENOMEM: return "out of memory";
    case RS_EDEVICE: return "device error";
    default: return "unknown status";
  }
}

/* ---------------------------------------------------------------- validation */

/* *end = offset + (count-1)*stride + length for count >= 1, all fields >= 0. */
static int run_end(int64_t offset, int64_t stride, int64_t length, int64_t count, int64_t *end) {
  int64_t reps = count - 1, span;
  if (stride != 0 && reps > INT64_MAX / stride) return 0;
  span = reps * stride;
  if (span > INT64_MAX - offset) return 0;
  span += offset;
  if (length > INT64_MAX - span) return 0;
  *end = span + length;
  return 1;
}

/* The destination footprint of a non-empty row: `count` intervals [start + i*stride, +length). */
typedef struct {
  int64_t start, end, stride, length, count, row;
} footprint;

static footprint row_footprint(const rs_run *r, int64_t row, int64_t end) {
  footprint f;
  f.start = r->dst_offset;
  f.end = end;
  f.stride = r->dst_stride;
  f.length = r->length;
  f.count = r->count;
  f.row = row;
  return f;
}

static int64_t floor_div(int64_t a, int64_t b) { /* b > 0 */
  int64_t q = a / b;
  return (a % b != 0 && a < 0) ? q - 1 : q;
}

/* Does [x, x + len) intersect any interval of footprint g? g has no self-overlap, so when
 * g.count > 1, g.stride >= g.length > 0 and intervals are ordered. */
static int interval_hits(int64_t x, int64_t len, const footprint *g) {
  int64_t j = 0;
  if (g->count > 1) {
    /* smallest j with g.start + j*stride + g.length > x */
    int64_t num = x - g->length + 1 - g->start;
    if (num > 0) j = num / g->stride + (num % g->stride != 0);
  }
  if (j >= g->count) return 0;
  return g->start + j * g->stride < x + len;
}

/* Exact test of whether two self-non-overlapping footprints share an element. */
static int footprints_overlap(const footprint *a, const footprint *b) {
  int64_t i0, i1, i;
  const footprint *few, *many;
  if (a->end <= b->start || b->end <= a->start) return 0;
  if (a->count > 1 && b->count > 1 && a->stride == b->stride) {
    /* intervals i of a and j of b overlap iff -Lb < d + k*s < La with k = j - i,
     * k in [-(na-1), nb-1] and d = b.start - a.start. Bounded by RS_MAX_NUMEL. */
    int64_t s = a->stride, d = b->start - a->start;
    int64_t k = floor_div(-b->length - d, s) + 1;
    if (k < -(a->count - 1)) k = -(a->count - 1);
    return k <= b->count - 1 && d + k * s < a->length;
  }
  few = a->count <= b->count ? a : b;
  many = few == a ? b : a;
  /* only intervals of `few` inside many's extent can hit it */
  i0 = 0;
  i1 = few->count - 1;
  if (few->count > 1) {
    int64_t num = many->start - few->length + 1 - few->start;
    if (num > 0) i0 = num / few->stride + (num % few->stride != 0);
    i1 = floor_div(many->end - 1 - few->start, few->stride);
    if (i1 > few->count - 1) i1 = few->count - 1;
  }
  for (i = i0; i <= i1; i++) {
    if (interval_hits(few->start + i * few->stride, few->length, many)) return 1;
  }
  return 0;
}

/* (dst start, row) keys sorted by an LSD radix sort: stable, so equal starts stay in row
 * order; O(n) per 11-bit digit, and digits that do not vary are skipped. Keys are 16 bytes
 * and a row's full footprint is read only when its extent meets another's: qsort of
 * footprints cost more than the copy itself for 1e5 tiny runs. */
typedef struct {
  int64_t start, row;
} keyed;

#define RS_RADIX_BITS 11
#define RS_RADIX (1 << RS_RADIX_BITS)

/* Sorts a[0..m) by start (>= 0) using tmp (m entries); returns the buffer holding the
 * result. */
static keyed *radix_sort(keyed *a, keyed *tmp, int64_t m, int64_t max_key) {
  static const int64_t mask = RS_RADIX - 1;
  int64_t counts[RS_RADIX];
  int shift;
  for (shift = 0; shift < 63 && (max_key >> shift) != 0; shift += RS_RADIX_BITS) {
    int64_t i, sum = 0, d0 = (a[0].start >> shift) & mask;
    keyed *t;
    memset(counts, 0, sizeof counts);
    for (i = 0; i < m; i++) counts[(a[i].start >> shift) & mask]++;
    if (counts[d0] == m) continue; /* this digit is the same everywhere */
    for (i = 0; i < RS_RADIX; i++) {
      int64_t c = counts[i];
      counts[i] = sum;
      sum += c;
    }
    for (i = 0; i < m; i++) tmp[counts[(a[i].start >> shift) & mask]++] = a[i];
    t = a;
    a = tmp;
    tmp = t;
  }
  return a;
}

static rs_status report_overlap(rs_error *err, int64_t r1, int64_t r2) {
  int64_t lo = r1 < r2 ? r1 : r2, hi = r1 < r2 ? r2 : r1;
  return fail(err, RS_EOVERLAP, hi, lo,
              "rows %" PRId64 " and %" PRId64 " write the same dst element", lo, hi);
}

/* Cross-row overlap check of the non-empty rows. Sorted tables (the common case: plans emit
 * rows in dst order) take one linear pass; others are sorted and swept with an active set
 * of rows whose extent reaches the current start. */
static rs_status check_cross_overlap(const rs_run *runs, int64_t n, const int64_t *ends,
                                     rs_error *err) {
  int64_t i, m = 0, max_end = -1, max_start = 0, nactive = 0;
  int sorted = 1;
  keyed *buf, *key;
  int64_t *active;
  rs_status st = RS_OK;
  for (i = 0; i < n && sorted; i++) {
    if (runs[i].length == 0 || runs[i].count == 0) continue;
    if (runs[i].dst_offset < max_end) sorted = 0;
    if (ends[i] > max_end) max_end = ends[i];
  }
  if (sorted) return RS_OK;

  for (i = 0; i < n; i++) m += runs[i].length != 0 && runs[i].count != 0;
  buf = (keyed *)malloc((size_t)m * 2 * sizeof *buf);
  active = (int64_t *)malloc((size_t)m * sizeof *active);
  if (!buf || !active) {
    free(buf);
    free(active);
    return fail(err, RS_ENOMEM, -1, -1, "overlap check: cannot allocate %" PRId64 " entries", m);
  }
  m = 0;
  for (i = 0; i < n; i++) {
    if (runs[i].length != 0 && runs[i].count != 0) {
      buf[m].start = runs[i].dst_offset;
      buf[m].row = i;
      if (buf[m].start > max_start) max_start = buf[m].start;
      m++;
    }
  }
  key = radix_sort(buf, buf + m, m, max_start);
  for (i = 0; i < m && st == RS_OK; i++) {
    int64_t a = 0, row = key[i].row;
    while (a < nactive && st == RS_OK) {
      int64_t other = active[a];
      if (ends[other] <= key[i].start) { /* ends before this one starts: never again */
        active[a] = active[--nactive];
        continue;
      }
      {
        footprint f = row_footprint(&runs[other], other, ends[other]);
        footprint g = row_footprint(&runs[row], row, ends[row]);
        if (footprints_overlap(&f, &g)) st = report_overlap(err, other, row);
      }
      a++;
    }
    active[nactive++] = row;
  }
  free(buf);
  free(active);
  return st;
}

rs_status rs_validate(const rs_run *runs, int64_t n, int64_t src_numel, int64_t dst_numel,
                      unsigned flags, rs_error *err) {
  int64_t i, *ends = NULL;
  rs_status st = RS_OK;
  int check_overlap = (flags & RS_CHECK_OVERLAP) != 0;
  clear(err);
  if (n < 0) return fail(err, RS_EINVAL, -1, -1, "negative number of rows (%" PRId64 ")", n);
  if (n > 0 && !runs) return fail(err, RS_EINVAL, -1, -1, "null descriptor table");
  if (src_numel < 0 || src_numel > RS_MAX_NUMEL || dst_numel < 0 || dst_numel > RS_MAX_NUMEL) {
    return fail(err, RS_EINVAL, -1, -1,
                "buffer extents must be in [0, 2^60]: src has %" PRId64 ", dst has %" PRId64,
                src_numel, dst_numel);
  }
  if (flags & ~RS_CHECK_OVERLAP) return fail(err, RS_EINVAL, -1, -1, "unknown flags 0x%x", flags);
  if (check_overlap && n > 1) { /* row ends feed only the cross-row check */
    ends = (int64_t *)malloc((size_t)n * sizeof *ends);
    if (!ends) return fail(err, RS_ENOMEM, -1, -1, "cannot allocate %" PRId64 " row ends", n);
  }
  for (i = 0; i < n && st == RS_OK; i++) {
    const rs_run *r = &runs[i];
    const int64_t *f = &r->src_offset;
    int64_t src_end, dst_end;
    int k;
    for (k = 0; k < 6; k++) {
      if (f[k] < 0) {
        st = fail(err, RS_ENEG, i, -1, "row %" PRId64 ": %s is negative (%" PRId64 ")", i,
                  field_names[k], f[k]);
        break;
      }
    }
    if (st != RS_OK) break;
    if (r->length == 0 || r->count == 0) continue; /* legal no-op */
    if (!run_end(r->src_offset, r->src_stride, r->length, r->count, &src_end)) {
      st = fail(err, RS_EOVERFLOW, i, -1,
                "row %" PRId64 ": src_offset + (count-1)*src_stride + length overflows int64", i);
    } else if (!run_end(r->dst_offset, r->dst_stride, r->length, r->count, &dst_end)) {
      st = fail(err, RS_EOVERFLOW, i, -1,
                "row %" PRId64 ": dst_offset + (count-1)*dst_stride + length overflows int64", i);
    } else if (src_end > src_numel) {
      st = fail(err, RS_ERANGE, i, -1,
                "row %" PRId64 ": reads src[%" PRId64 "] but src has %" PRId64 " elements", i,
                src_end - 1, src_numel);
    } else if (dst_end > dst_numel) {
      st = fail(err, RS_ERANGE, i, -1,
                "row %" PRId64 ": writes dst[%" PRId64 "] but dst has %" PRId64 " elements", i,
                dst_end - 1, dst_numel);
    } else if (check_overlap && r->count > 1 && r->dst_stride < r->length) {
      st = fail(err, RS_EOVERLAP, i, i,
                "row %" PRId64 ": writes overlap within the row (dst_stride %" PRId64
                " < length %" PRId64 " with count %" PRId64 ")",
                i, r->dst_stride, r->length, r->count);
    } else if (ends) {
      ends[i] = dst_end;
    }
  }
  if (st == RS_OK && ends) st = check_cross_overlap(runs, n, ends, err);
  free(ends);
  return st;
}

rs_status rs_prefix(const rs_run *runs, int64_t n, int64_t *prefix, int64_t *total, rs_error *err) {
  int64_t i, sum = 0;
  clear(err);
  if (n < 0) return fail(err, RS_EINVAL, -1, -1, "negative number of rows (%" PRId64 ")", n);
  if (n > 0 && !runs) return fail(err, RS_EINVAL, -1, -1, "null descriptor table");
  if (prefix) prefix[0] = 0;
  for (i = 0; i < n; i++) {
    int64_t len = runs[i].length, cnt = runs[i].count, w;
    if (len < 0 || cnt < 0) {
      return fail(err, RS_ENEG, i, -1, "row %" PRId64 ": negative length or count", i);
    }
    if (len != 0 && cnt > INT64_MAX / len) {
      return fail(err, RS_EOVERFLOW, i, -1, "row %" PRId64 ": length*count overflows int64", i);
    }
    w = len * cnt;
    if (w > INT64_MAX - sum) {
      return fail(err, RS_EOVERFLOW, i, -1,
                  "row %" PRId64 ": total work of the table overflows int64", i);
    }
    sum += w;
    if (prefix) prefix[i + 1] = sum;
  }
  if (total) *total = sum;
  return RS_OK;
}

/* ---------------------------------------------------------------- scalar casts */
/* Bitwise identical to torch 2.13 CPU .to() on contiguous tensors (checked by
 * tests/test_ops.py against torch itself). NaN handling differs per pair, as in torch:
 *   f32 -> bf16: every NaN becomes 0xFFFF (torch's vectorized path)
 *   f16 -> bf16: every NaN becomes 0x7FC0
 *   f32/bf16 -> f16: sign kept, quiet bit set, top 9 payload bits kept (as F16C does)
 *   f16 -> f32: sign and payload kept, quiet bit set; bf16 -> f32 is a plain shift. */

static inline uint32_t f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

static inline float bits_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static inline uint16_t bf16_from_bits_rne(uint32_t u) { /* u is not NaN */
  return (uint16_t)((u + UINT32_C(0x7FFF) + ((u >> 16) & 1u)) >> 16);
}

static inline uint16_t bf16_from_f32_bits(uint32_t u) {
  if ((u & UINT32_C(0x7FFFFFFF)) > UINT32_C(0x7F800000)) return 0xFFFFu;
  return bf16_from_bits_rne(u);
}

static inline uint16_t f16_from_f32_bits(uint32_t w) {
  uint32_t sign = (w >> 16) & 0x8000u;
  uint32_t a = w & UINT32_C(0x7FFFFFFF);
  if (a > UINT32_C(0x7F800000)) return (uint16_t)(sign | 0x7E00u | ((a >> 13) & 0x3FFu));
  if (a >= UINT32_C(0x47800000)) return (uint16_t)(sign | 0x7C00u); /* >= 2^16 and inf */
  if (a < UINT32_C(0x38800000)) {                                   /* f16 subnormal or 0 */
    uint32_t e = a >> 23, m, shift, q, rem, half;
    if (e < 102) return (uint16_t)sign; /* < 2^-25 rounds to zero (2^-25 ties to even 0) */
    m = (a & UINT32_C(0x7FFFFF)) | UINT32_C(0x800000);
    shift = 126 - e; /* value / 2^-24 = m >> shift, shift in [14, 24] */
    q = m >> shift;
    rem = m & ((UINT32_C(1) << shift) - 1);
    half = UINT32_C(1) << (shift - 1);
    q += (rem > half) || (rem == half && (q & 1u));
    return (uint16_t)(sign | q);
  }
  /* normal: rebias the exponent, round to nearest even; a carry into the exponent is
   * the correct result (up to inf for values in [65520, 65536)) */
  a += UINT32_C(0xC8000FFF) + ((a >> 13) & 1u);
  return (uint16_t)(sign | (a >> 13));
}

static inline uint32_t f32_bits_from_f16(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
  if (e == 0x1F) return sign | UINT32_C(0x7F800000) | (m ? UINT32_C(0x400000) | (m << 13) : 0);
  if (e == 0) {
    uint32_t p = 9;
    if (m == 0) return sign;
    while (!(m >> p)) p--; /* leading bit: value = m * 2^-24, exponent p - 24 */
    return sign | ((p + 103) << 23) | ((m << (23 - p)) & UINT32_C(0x7FFFFF));
  }
  return sign | ((e + 112) << 23) | (m << 13);
}

static inline uint16_t bf16_from_f16_bits(uint16_t h) {
  if ((h & 0x7C00u) == 0x7C00u && (h & 0x3FFu)) return 0x7FC0u;
  return bf16_from_bits_rne(f32_bits_from_f16(h));
}

uint16_t rs_f32_to_bf16(float f) { return bf16_from_f32_bits(f32_bits(f)); }
uint16_t rs_f32_to_f16(float f) { return f16_from_f32_bits(f32_bits(f)); }
float rs_bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }
float rs_f16_to_f32(uint16_t h) { return bits_f32(f32_bits_from_f16(h)); }

/* ---------------------------------------------------------------- bulk converters */
/* Loads/stores go through memcpy so the buffers' declared types never alias (torch may have
 * written them as float); compilers turn these into plain vectorizable loads. */

typedef void (*convert_fn)(const unsigned char *s, unsigned char *d, int64_t n);

static inline uint32_t ld32(const unsigned char *p, int64_t i) {
  uint32_t v;
  memcpy(&v, p + (size_t)i * 4, 4);
  return v;
}
static inline uint16_t ld16(const unsigned char *p, int64_t i) {
  uint16_t v;
  memcpy(&v, p + (size_t)i * 2, 2);
  return v;
}
static inline void st32(unsigned char *p, int64_t i, uint32_t v) {
  memcpy(p + (size_t)i * 4, &v, 4);
}
static inline void st16(unsigned char *p, int64_t i, uint16_t v) {
  memcpy(p + (size_t)i * 2, &v, 2);
}

/* Each converter is compiled three times: for the baseline ISA and, on x86-64 with GCC or
 * clang, with AVX2 and with AVX-512BW enabled (auto-vectorized; the same scalar code, so the
 * same bits). The widest one the CPU runs is picked per call, capped by the environment
 * variable RESHARD_CPU_CAPABILITY=default|avx2|avx512 (like torch's ATEN_CPU_CAPABILITY): the
 * tests run every level against torch. f32->bf16 runs ~1.6x (AVX2) and ~1.9x (AVX-512) faster
 * than the SSE2 baseline per thread, which is what bounds host-side casts feeding PCIe. */
#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#define RS_X86_CLONES 1
#define RS_CONVERTER(name, body)                                                                \
  static void name(const unsigned char *s, unsigned char *d, int64_t n) body                    \
      __attribute__((target("avx2"))) static void name##_avx2(const unsigned char *s,           \
                                                              unsigned char *d, int64_t n) body \
      __attribute__((target("avx512f,avx512bw,avx512vl"))) static void name##_avx512(           \
          const unsigned char *s, unsigned char *d, int64_t n) body
#else
#define RS_CONVERTER(name, body) \
  static void name(const unsigned char *s, unsigned char *d, int64_t n) body
#endif

RS_CONVERTER(cvt_f32_bf16, {
  int64_t i;
  for (i = 0; i < n; i++) st16(d, i, bf16_from_f32_bits(ld32(s, i)));
})
RS_CONVERTER(cvt_f32_f16, {
  int64_t i;
  for (i = 0; i < n; i++) st16(d, i, f16_from_f32_bits(ld32(s, i)));
})
RS_CONVERTER(cvt_bf16_f32, {
  int64_t i;
  for (i = 0; i < n; i++) st32(d, i, (uint32_t)ld16(s, i) << 16);
})
RS_CONVERTER(cvt_f16_f32, {
  int64_t i;
  for (i = 0; i < n; i++) st32(d, i, f32_bits_from_f16(ld16(s, i)));
})
RS_CONVERTER(cvt_bf16_f16, {
  int64_t i;
  for (i = 0; i < n; i++) st16(d, i, f16_from_f32_bits((uint32_t)ld16(s, i) << 16));
})
RS_CONVERTER(cvt_f16_bf16, {
  int64_t i;
  for (i = 0; i < n; i++) st16(d, i, bf16_from_f16_bits(ld16(s, i)));
})

/* 0: baseline, 1: AVX2, 2: AVX-512BW; the CPU's best, capped by RESHARD_CPU_CAPABILITY. */
int rs_cpu_capability(void) {
#ifdef RS_X86_CLONES
  int level = 0;
  const char *cap = getenv("RESHARD_CPU_CAPABILITY");
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2")) level = 1;
  if (level == 1 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl"))
    level = 2;
  if (cap && strcmp(cap, "default") == 0) level = 0;
  if (cap && strcmp(cap, "avx2") == 0 && level > 1) level = 1;
  return level;
#else
  return 0;
#endif
}

#ifdef RS_X86_CLONES
#define RS_PICK(name) (level == 2 ? name##_avx512 : level == 1 ? name##_avx2 : name)
#else
#define RS_PICK(name) name
#endif

static convert_fn pick_convert(rs_dtype s, rs_dtype d) {
  const int level = rs_cpu_capability();
  (void)level;
  if (s == RS_F32 && d == RS_BF16) return RS_PICK(cvt_f32_bf16);
  if (s == RS_F32 && d == RS_F16) return RS_PICK(cvt_f32_f16);
  if (s == RS_BF16 && d == RS_F32) return RS_PICK(cvt_bf16_f32);
  if (s == RS_F16 && d == RS_F32) return RS_PICK(cvt_f16_f32);
  if (s == RS_BF16 && d == RS_F16) return RS_PICK(cvt_bf16_f16);
  if (s == RS_F16 && d == RS_BF16) return RS_PICK(cvt_f16_bf16);
  return NULL;
}

/* ---------------------------------------------------------------- the copy */

#if defined(__GNUC__) || defined(__clang__)
#define RS_PREFETCH_READ(p) __builtin_prefetch((p), 0)
#define RS_PREFETCH_WRITE(p) __builtin_prefetch((p), 1)
#else
#define RS_PREFETCH_READ(p) ((void)(p))
#define RS_PREFETCH_WRITE(p) ((void)(p))
#endif

/* Same-dtype tables whose destination is at least this large are written with streaming
 * (non-temporal) stores. A streaming store skips the read-for-ownership of its destination
 * line, a third of a copy's memory traffic; glibc's memcpy streams only inside one call above
 * its own threshold (~100 MiB on the benchmark machine), never across 100k 4 KiB runs. 4 MiB
 * is past the private L2 caches; the shared LLC did not make up for it on the benchmark VM:
 * warm 4-64 MiB copies that stayed in it ran at 9-15 GB/s, streamed ones at 15-20 GB/s
 * (benchmarks/kernels.py). The cost: a reader that follows at once misses the cache.
 * Overridable at compile time so the C tests reach the streaming path with small buffers. */
#ifndef RS_STREAM_MIN_BYTES
#define RS_STREAM_MIN_BYTES (INT64_C(4) << 20)
#endif

/* Copies of at least this many bytes stream; shorter ones (and the unaligned head and the
 * tail of every copy) use memcpy: a partly written line would leave the write-combining
 * buffer as a slow partial write. */
#define RS_STREAM_MIN_COPY 256u

/* How far ahead of the loads the streaming loop prefetches the source, staying inside the
 * copy: with the stores bypassing the cache, the source's latency is what is left to hide
 * (+10-25% at runs >= 64 KiB; a contiguous copy got 0.9x glibc's memcpy instead of 0.75x). */
#define RS_STREAM_PREFETCH 1024u

/* Runs usually start on a cold page, where the hardware prefetcher does not follow: touch the
 * first lines of the next row while this one is copied (+10% on 100k random 4 KiB runs).
 * Addresses are computed as integers: the lines may lie past a buffer's end (a prefetch never
 * faults), and empty rows, whose offsets are unchecked, are skipped. A destination that will
 * be streamed is not prefetched: that would read the very lines streaming stores avoid. */
static void prefetch_row(const unsigned char *s, size_t ssz, unsigned char *d, size_t dsz,
                         const rs_run *next, rs_mode mode, int stream) {
  uintptr_t sp = (uintptr_t)s + (uintptr_t)next->src_offset * ssz;
  uintptr_t dp = (uintptr_t)d + (uintptr_t)next->dst_offset * dsz;
  int line, streamed = stream && next->length >= (int64_t)(RS_STREAM_MIN_COPY / dsz);
  if (next->length == 0 || next->count == 0) return;
  for (line = 0; line < 4; line++) {
    if (mode != RS_MODE_UNPACK) RS_PREFETCH_READ((const void *)(sp + 64u * (uintptr_t)line));
    if (mode != RS_MODE_PACK && !streamed) RS_PREFETCH_WRITE((void *)(dp + 64u * (uintptr_t)line));
  }
}

#if defined(__SSE2__)
/* memcpy with streaming stores for the 64-byte aligned, whole lines of the destination. */
static void copy_stream(unsigned char *d, const unsigned char *s, size_t n) {
  size_t head = (size_t)(-(uintptr_t)d & 63u);
  if (n < RS_STREAM_MIN_COPY) {
    memcpy(d, s, n);
    return;
  }
  memcpy(d, s, head);
  d += head;
  s += head;
  n -= head;
  for (; n >= 64; n -= 64, d += 64, s += 64) {
    if (n >= RS_STREAM_PREFETCH + 64) RS_PREFETCH_READ(s + RS_STREAM_PREFETCH);
    __m128i a = _mm_loadu_si128((const __m128i *)(const void *)s);
    __m128i b = _mm_loadu_si128((const __m128i *)(const void *)(s + 16));
    __m128i c = _mm_loadu_si128((const __m128i *)(const void *)(s + 32));
    __m128i e = _mm_loadu_si128((const __m128i *)(const void *)(s + 48));
    _mm_stream_si128((__m128i *)(void *)d, a);
    _mm_stream_si128((__m128i *)(void *)(d + 16), b);
    _mm_stream_si128((__m128i *)(void *)(d + 32), c);
    _mm_stream_si128((__m128i *)(void *)(d + 48), e);
  }
  memcpy(d, s, n);
}
/* streaming stores are weakly ordered: make them visible before the caller's join */
static void store_fence(void) { _mm_sfence(); }
#define RS_HAVE_STREAM 1
#else
/* never called (stream is 0 here): keeps the copy loop free of preprocessor branches */
static void copy_stream(unsigned char *d, const unsigned char *s, size_t n) { memcpy(d, s, n); }
static void store_fence(void) {}
#define RS_HAVE_STREAM 0
#endif

/* Largest r in [0, n) with prefix[r] <= k (prefix is non-decreasing, prefix[0] = 0). */
static int64_t find_row(const int64_t *prefix, int64_t n, int64_t k) {
  int64_t lo = 0, hi = n; /* invariant: prefix[lo] <= k, answer < hi */
  while (hi - lo > 1) {
    int64_t mid = lo + (hi - lo) / 2;
    if (prefix[mid] <= k)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

rs_status rs_copy_slice(const void *src, rs_dtype src_dtype, void *dst, rs_dtype dst_dtype,
                        const rs_run *runs, int64_t n, const int64_t *prefix, int64_t begin,
                        int64_t end, rs_mode mode) {
  const unsigned char *s = (const unsigned char *)src;
  unsigned char *d = (unsigned char *)dst;
  size_t ssz = rs_dtype_size(src_dtype), dsz = rs_dtype_size(dst_dtype);
  convert_fn cvt = NULL;
  int stream;
  int64_t r, k;
  if (!rs_dtype_pair_ok(src_dtype, dst_dtype)) return RS_EDTYPE;
  if (mode != RS_MODE_RUNS && mode != RS_MODE_PACK && mode != RS_MODE_UNPACK) return RS_EINVAL;
  if (n < 0 || begin < 0 || end < begin) return RS_EINVAL;
  if (begin == end) return RS_OK;
  if (!runs || !prefix || !src || !dst || end > prefix[n]) return RS_EINVAL;
  if (src_dtype != dst_dtype) cvt = pick_convert(src_dtype, dst_dtype);
  /* compared in elements: prefix[n] * dsz could overflow for an unvalidated table. PACK writes
   * a staging chunk (the pinned ring) that a DMA reads right away: keep it in the cache. On the
   * H200 host streaming it cut pageable H2D staging from 0.95 to 0.82 of PCIe. */
  stream = RS_HAVE_STREAM && !cvt && mode != RS_MODE_PACK &&
           prefix[n] >= RS_STREAM_MIN_BYTES / (int64_t)dsz;

  r = find_row(prefix, n, begin);
  k = begin;
  while (k < end) {
    const rs_run *R;
    int64_t off, c, j;
    while (prefix[r + 1] <= k) r++; /* skip empty rows */
    R = &runs[r];
    off = k - prefix[r];
    c = off / R->length;
    j = off % R->length;
    if (r + 1 < n) prefetch_row(s, ssz, d, dsz, &runs[r + 1], mode, stream);
    for (; c < R->count && k < end; c++, j = 0) {
      int64_t take = R->length - j;
      const unsigned char *sp;
      unsigned char *dp;
      if (take > end - k) take = end - k;
      sp = mode == RS_MODE_UNPACK ? s + (size_t)(k - begin) * ssz
                                  : s + (size_t)(R->src_offset + c * R->src_stride + j) * ssz;
      dp = mode == RS_MODE_PACK ? d + (size_t)(k - begin) * dsz
                                : d + (size_t)(R->dst_offset + c * R->dst_stride + j) * dsz;
      if (cvt)
        cvt(sp, dp, take);
      else if (stream)
        copy_stream(dp, sp, (size_t)take * ssz);
      else
        memcpy(dp, sp, (size_t)take * ssz);
      k += take;
    }
    r++;
  }
  if (stream) store_fence();
  return RS_OK;
}

rs_status rs_copy_runs(const void *src, rs_dtype src_dtype, int64_t src_numel, void *dst,
                       rs_dtype dst_dtype, int64_t dst_numel, const rs_run *runs, int64_t n,
                       unsigned flags, rs_error *err) {
  int64_t total = 0, *prefix;
  rs_status st;
  clear(err);
  if (!rs_dtype_pair_ok(src_dtype, dst_dtype)) {
    return fail(err, RS_EDTYPE, -1, -1, "cannot copy %s to %s", rs_dtype_name(src_dtype),
                rs_dtype_name(dst_dtype));
  }
  st = rs_validate(runs, n, src_numel, dst_numel, flags, err);
  if (st != RS_OK) return st;
  if ((src_numel > 0 && !src) || (dst_numel > 0 && !dst)) {
    return fail(err, RS_EINVAL, -1, -1, "null src or dst with a nonzero extent");
  }
  prefix = (int64_t *)malloc((size_t)(n + 1) * sizeof *prefix);
  if (!prefix)
    return fail(err, RS_ENOMEM, -1, -1, "cannot allocate %" PRId64 " prefix sums", n + 1);
  st = rs_prefix(runs, n, prefix, &total, err);
  if (st == RS_OK)
    st = rs_copy_slice(src, src_dtype, dst, dst_dtype, runs, n, prefix, 0, total, RS_MODE_RUNS);
  if (st != RS_OK && err && err->code == RS_OK)
    fail(err, st, -1, -1, "copy failed: %s", rs_status_name(st));
  free(prefix);
  return st;
}
