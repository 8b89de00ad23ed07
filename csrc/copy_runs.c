/* reshard C core: descriptor validation and the strided-run copy with casts. See reshard.h. */
#include "reshard.h"

#include "casts.h"

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

rs_status rs_fail(rs_error *err, rs_status code, int64_t row, int64_t other_row, const char *fmt,
                  ...) {
  if (err) {
    va_list ap;
    err->code = code;
    err->row = row;
    err->other_row = other_row;
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

/* (key, row) pairs sorted by an LSD radix sort: stable, so equal keys stay in row order; O(n)
 * per 11-bit digit, and digits that do not vary are skipped. */
typedef struct {
  int64_t start, row;
} keyed;

#define RS_RADIX_BITS 11
#define RS_RADIX (1 << RS_RADIX_BITS)

/* Sorts a[0..m) by start (>= 0, <= max_key) using tmp (m entries); returns the buffer holding
 * the result. */
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
  return rs_fail(err, RS_EOVERLAP, hi, lo,
                 "rows %" PRId64 " and %" PRId64 " write the same dst element", lo, hi);
}

static rs_status no_memory(rs_error *err, int64_t m) {
  return rs_fail(err, RS_ENOMEM, -1, -1, "cannot allocate the overlap check of %" PRId64 " rows",
                 m);
}

/* ---- rectangles in a grid */

/* Seen in a grid `width` elements wide, destination element x sits at line x / width, phase
 * x % width. A run repeated at stride `width` covers one rectangle (lines of its repeats x
 * phases of the run), or two when the run wraps past a line's end; a single run covers at most
 * three (a partial line, whole lines, a partial line). A row whose stride divides the width
 * is width / stride such repeated runs, one per residue of its run index. Two rows write a
 * common element iff two of their rectangles intersect. */
typedef struct {
  int64_t line_lo, line_hi, phase_lo, phase_hi, row;
} rect;

static rect make_rect(int64_t line_lo, int64_t line_hi, int64_t phase_lo, int64_t phase_hi,
                      int64_t row) {
  rect r;
  r.line_lo = line_lo;
  r.line_hi = line_hi;
  r.phase_lo = phase_lo;
  r.phase_hi = phase_hi;
  r.row = row;
  return r;
}

/* The rectangles of a run [a, a + len) repeated `lines` times at stride `width` (len <= width
 * when lines > 1); returns how many (at most 3). */
static int64_t run_rects(int64_t a, int64_t len, int64_t lines, int64_t width, int64_t row,
                         rect *out) {
  const int64_t q0 = a / width, p0 = a % width;
  int64_t q1, p1, k = 0;
  if (p0 + len <= width) {
    out[k++] = make_rect(q0, q0 + lines, p0, p0 + len, row);
  } else if (lines > 1) {
    out[k++] = make_rect(q0, q0 + lines, p0, width, row);
    out[k++] = make_rect(q0 + 1, q0 + lines + 1, 0, p0 + len - width, row);
  } else {
    q1 = (a + len - 1) / width;
    p1 = (a + len - 1) % width + 1;
    out[k++] = make_rect(q0, q0 + 1, p0, width, row);
    if (q1 > q0 + 1) out[k++] = make_rect(q0 + 1, q1, 0, width, row);
    out[k++] = make_rect(q1, q1 + 1, 0, p1, row);
  }
  return k;
}

/* Residue classes of a repeated row's runs in a grid of `width` (a multiple of its stride). */
static int64_t row_classes(const rs_run *r, int64_t width) {
  const int64_t k = width / r->dst_stride;
  return k < r->count ? k : r->count;
}

/* The rectangles of a non-empty row (count == 1, or a stride dividing width). */
static int64_t row_rects(const rs_run *r, int64_t row, int64_t width, rect *out) {
  int64_t j, n = 0, k, classes;
  if (r->count == 1) return run_rects(r->dst_offset, r->length, 1, width, row, out);
  k = width / r->dst_stride;
  classes = row_classes(r, width);
  for (j = 0; j < classes; j++) {
    const int64_t lines = (r->count - j + k - 1) / k;
    n += run_rects(r->dst_offset + j * r->dst_stride, r->length, lines, width, row, out + n);
  }
  return n;
}

static int64_t gcd(int64_t a, int64_t b) {
  while (b != 0) {
    const int64_t t = a % b;
    a = b;
    b = t;
  }
  return a;
}

/* Fenwick tree over ranks 1..m: count of active rectangles at each phase rank. */
static void fenwick_add(int64_t *tree, int64_t m, int64_t i, int64_t delta) {
  for (; i <= m; i += i & -i) tree[i] += delta;
}

static int64_t fenwick_prefix(const int64_t *tree, int64_t i) {
  int64_t sum = 0;
  for (; i > 0; i -= i & -i) sum += tree[i];
  return sum;
}

/* The smallest rank whose prefix count reaches c (1 <= c <= the active count). */
static int64_t fenwick_find(const int64_t *tree, int64_t m, int64_t c) {
  int64_t pos = 0, step = 1;
  while (step * 2 <= m) step *= 2;
  for (; step > 0; step /= 2) {
    if (pos + step <= m && tree[pos + step] < c) {
      pos += step;
      c -= tree[pos];
    }
  }
  return pos + 1;
}

/* Do any two of the m rectangles intersect? A sweep over lines keeps the rectangles that cross
 * the current line in a Fenwick tree ordered by phase; they are disjoint (else the sweep has
 * stopped), so an entering rectangle can only meet its two phase neighbours: O(m log m). */
static rs_status rects_overlap(const rect *rects, int64_t m, rs_error *err) {
  keyed *keys = (keyed *)malloc((size_t)m * 4 * sizeof *keys), *sorted;
  int64_t *rank = (int64_t *)malloc((size_t)m * sizeof *rank);
  int64_t *by_rank = (int64_t *)malloc((size_t)m * sizeof *by_rank);
  int64_t *tree = (int64_t *)calloc((size_t)m + 1, sizeof *tree);
  int64_t i, max_key = 0, active = 0;
  rs_status st = RS_OK;
  if (!keys || !rank || !by_rank || !tree) {
    st = no_memory(err, m);
    goto done;
  }
  for (i = 0; i < m; i++) {
    keys[i].start = rects[i].phase_lo;
    keys[i].row = i;
    if (rects[i].phase_lo > max_key) max_key = rects[i].phase_lo;
  }
  sorted = radix_sort(keys, keys + m, m, max_key);
  for (i = 0; i < m; i++) {
    rank[sorted[i].row] = i + 1;
    by_rank[i] = sorted[i].row;
  }
  /* events: line * 2 for a rectangle leaving (before) line * 2 + 1 for one entering */
  max_key = 0;
  for (i = 0; i < m; i++) {
    keys[2 * i].start = rects[i].line_lo * 2 + 1;
    keys[2 * i].row = i;
    keys[2 * i + 1].start = rects[i].line_hi * 2;
    keys[2 * i + 1].row = i;
    if (keys[2 * i + 1].start > max_key) max_key = keys[2 * i + 1].start;
  }
  sorted = radix_sort(keys, keys + 2 * m, 2 * m, max_key);
  for (i = 0; i < 2 * m && st == RS_OK; i++) {
    const int64_t k = sorted[i].row, r = rank[k];
    if ((sorted[i].start & 1) == 0) {
      fenwick_add(tree, m, r, -1);
      active--;
      continue;
    }
    {
      const int64_t below = fenwick_prefix(tree, r - 1);
      if (below > 0) {
        const rect *p = &rects[by_rank[fenwick_find(tree, m, below) - 1]];
        if (p->phase_hi > rects[k].phase_lo) st = report_overlap(err, p->row, rects[k].row);
      }
      if (st == RS_OK && below < active) {
        const rect *q = &rects[by_rank[fenwick_find(tree, m, below + 1) - 1]];
        if (q->phase_lo < rects[k].phase_hi) st = report_overlap(err, q->row, rects[k].row);
      }
    }
    fenwick_add(tree, m, r, 1);
    active++;
  }
done:
  free(keys);
  free(rank);
  free(by_rank);
  free(tree);
  return st;
}

/* ---- rows of several strides: a merge of the rows' runs in dst order */

typedef struct {
  int64_t start, row, index; /* the row's next run: index `index`, at dst element `start` */
} next_run;

static int run_before(const next_run *a, const next_run *b) {
  return a->start < b->start || (a->start == b->start && a->row < b->row);
}

static void heap_down(next_run *h, int64_t m, int64_t i) {
  for (;;) {
    int64_t l = 2 * i + 1, r = l + 1, best = i;
    next_run t;
    if (l < m && run_before(&h[l], &h[best])) best = l;
    if (r < m && run_before(&h[r], &h[best])) best = r;
    if (best == i) return;
    t = h[i];
    h[i] = h[best];
    h[best] = t;
    i = best;
  }
}

/* The rows' runs merged in dst order by a heap; consecutive runs of one row (already known to
 * be disjoint) are taken as one step, up to the next other row's run. O(s log m) for s
 * alternations between rows, at most the number of runs, which a table that passes never has
 * more of than the copy itself moves. */
static rs_status merge_overlap(const rs_run *runs, const keyed *rows, int64_t m, rs_error *err) {
  next_run *heap = (next_run *)malloc((size_t)m * sizeof *heap);
  int64_t i, size = m, last_end = 0, last_row = -1;
  rs_status st = RS_OK;
  if (!heap) return no_memory(err, m);
  for (i = 0; i < m; i++) {
    heap[i].start = rows[i].start;
    heap[i].row = rows[i].row;
    heap[i].index = 0;
  }
  for (i = m / 2; i-- > 0;) heap_down(heap, m, i);
  while (size > 0) {
    const rs_run *r = &runs[heap[0].row];
    int64_t last = r->count - 1;
    if (last_row >= 0 && heap[0].start < last_end) {
      st = report_overlap(err, last_row, heap[0].row);
      break;
    }
    if (size > 1 && r->count > 1) { /* its runs that start before the next row's run */
      const next_run *second = size > 2 && run_before(&heap[2], &heap[1]) ? &heap[2] : &heap[1];
      if (second->start <= heap[0].start) {
        last = heap[0].index;
      } else {
        const int64_t k = heap[0].index + (second->start - 1 - heap[0].start) / r->dst_stride;
        if (k < last) last = k;
      }
    }
    last_row = heap[0].row;
    last_end = r->dst_offset + last * r->dst_stride + r->length;
    if (last + 1 < r->count) {
      heap[0].index = last + 1;
      heap[0].start = r->dst_offset + (last + 1) * r->dst_stride;
    } else {
      heap[0] = heap[--size];
    }
    heap_down(heap, size, 0);
  }
  free(heap);
  return st;
}

/* Rectangles per row beyond which a cluster is merged instead: the rectangles would cost more
 * memory than the merge's one entry per row, and not less time. */
#define RS_RECTS_PER_ROW 8

/* Overlap among the rows of one cluster (rows sorted by dst start whose extents chain). In a
 * grid as wide as the lcm of the repeated rows' strides each row is a few rectangles: one or
 * two for a transpose or a column slice (one stride), a few more when strides are small
 * multiples of each other. Otherwise (coprime strides, say) the runs are merged. */
static rs_status cluster_overlap(const rs_run *runs, const keyed *rows, int64_t m, rs_error *err) {
  int64_t i, width = 1, nrects = 0;
  rect *rects;
  rs_status st;
  for (i = 0; i < m; i++) {
    const int64_t s = runs[rows[i].row].dst_stride; /* >= length >= 1 when count >= 2 */
    int64_t multiple;
    if (runs[rows[i].row].count < 2) continue;
    multiple = width / gcd(width, s);
    if (multiple > RS_MAX_NUMEL / s) return merge_overlap(runs, rows, m, err);
    width = multiple * s;
  }
  for (i = 0; i < m; i++) {
    const rs_run *r = &runs[rows[i].row];
    nrects += r->count < 2 ? 3 : 2 * row_classes(r, width);
    if (nrects > RS_RECTS_PER_ROW * m) return merge_overlap(runs, rows, m, err);
  }
  rects = (rect *)malloc((size_t)nrects * sizeof *rects);
  if (!rects) return no_memory(err, m);
  nrects = 0;
  for (i = 0; i < m; i++)
    nrects += row_rects(&runs[rows[i].row], rows[i].row, width, rects + nrects);
  st = rects_overlap(rects, nrects, err);
  free(rects);
  return st;
}

/* Cross-row overlap check of the non-empty rows. Tables sorted by dst (what plans emit) take
 * one linear pass. Others are sorted by dst start and cut into clusters of rows whose extents
 * chain, and each cluster is checked on its own: O(n log n) in rows when a cluster's strides
 * are one stride or small multiples of each other (transposes, column slices), else O(s log n)
 * for s alternations between rows in dst order (see merge_overlap). */
static rs_status check_cross_overlap(const rs_run *runs, int64_t n, const int64_t *ends,
                                     rs_error *err) {
  int64_t i, m = 0, max_end = -1, max_start = 0;
  int sorted = 1;
  keyed *buf, *key;
  rs_status st = RS_OK;
  for (i = 0; i < n && sorted; i++) {
    if (runs[i].length == 0 || runs[i].count == 0) continue;
    if (runs[i].dst_offset < max_end) sorted = 0;
    if (ends[i] > max_end) max_end = ends[i];
  }
  if (sorted) return RS_OK;

  for (i = 0; i < n; i++) m += runs[i].length != 0 && runs[i].count != 0;
  buf = (keyed *)malloc((size_t)m * 2 * sizeof *buf);
  if (!buf) return no_memory(err, m);
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
  for (i = 0; i < m && st == RS_OK;) {
    int64_t j = i + 1;
    max_end = ends[key[i].row];
    for (; j < m && key[j].start < max_end; j++)
      if (ends[key[j].row] > max_end) max_end = ends[key[j].row];
    if (j - i > 1) st = cluster_overlap(runs, key + i, j - i, err);
    i = j;
  }
  free(buf);
  return st;
}

rs_status rs_validate(const rs_run *runs, int64_t n, int64_t src_numel, int64_t dst_numel,
                      unsigned flags, rs_error *err) {
  int64_t i, *ends = NULL;
  rs_status st = RS_OK;
  int check_overlap = (flags & RS_CHECK_OVERLAP) != 0;
  clear(err);
  if (n < 0) return rs_fail(err, RS_EINVAL, -1, -1, "negative number of rows (%" PRId64 ")", n);
  if (n > 0 && !runs) return rs_fail(err, RS_EINVAL, -1, -1, "null descriptor table");
  if (src_numel < 0 || src_numel > RS_MAX_NUMEL || dst_numel < 0 || dst_numel > RS_MAX_NUMEL) {
    return rs_fail(err, RS_EINVAL, -1, -1,
                   "buffer extents must be in [0, 2^60]: src has %" PRId64 ", dst has %" PRId64,
                   src_numel, dst_numel);
  }
  if (flags & ~RS_CHECK_OVERLAP)
    return rs_fail(err, RS_EINVAL, -1, -1, "unknown flags 0x%x", flags);
  if (check_overlap && n > 1) { /* row ends feed only the cross-row check */
    ends = (int64_t *)malloc((size_t)n * sizeof *ends);
    if (!ends) return rs_fail(err, RS_ENOMEM, -1, -1, "cannot allocate %" PRId64 " row ends", n);
  }
  for (i = 0; i < n && st == RS_OK; i++) {
    const rs_run *r = &runs[i];
    const int64_t *f = &r->src_offset;
    int64_t src_end, dst_end;
    int k;
    for (k = 0; k < 6; k++) {
      if (f[k] < 0) {
        st = rs_fail(err, RS_ENEG, i, -1, "row %" PRId64 ": %s is negative (%" PRId64 ")", i,
                     field_names[k], f[k]);
        break;
      }
    }
    if (st != RS_OK) break;
    if (r->length == 0 || r->count == 0) continue; /* legal no-op */
    if (!run_end(r->src_offset, r->src_stride, r->length, r->count, &src_end)) {
      st =
          rs_fail(err, RS_EOVERFLOW, i, -1,
                  "row %" PRId64 ": src_offset + (count-1)*src_stride + length overflows int64", i);
    } else if (!run_end(r->dst_offset, r->dst_stride, r->length, r->count, &dst_end)) {
      st =
          rs_fail(err, RS_EOVERFLOW, i, -1,
                  "row %" PRId64 ": dst_offset + (count-1)*dst_stride + length overflows int64", i);
    } else if (src_end > src_numel) {
      st = rs_fail(err, RS_ERANGE, i, -1,
                   "row %" PRId64 ": reads src[%" PRId64 "] but src has %" PRId64 " elements", i,
                   src_end - 1, src_numel);
    } else if (dst_end > dst_numel) {
      st = rs_fail(err, RS_ERANGE, i, -1,
                   "row %" PRId64 ": writes dst[%" PRId64 "] but dst has %" PRId64 " elements", i,
                   dst_end - 1, dst_numel);
    } else if (check_overlap && r->count > 1 && r->dst_stride < r->length) {
      st = rs_fail(err, RS_EOVERLAP, i, i,
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
  if (n < 0) return rs_fail(err, RS_EINVAL, -1, -1, "negative number of rows (%" PRId64 ")", n);
  if (n > 0 && !runs) return rs_fail(err, RS_EINVAL, -1, -1, "null descriptor table");
  if (prefix) prefix[0] = 0;
  for (i = 0; i < n; i++) {
    int64_t len = runs[i].length, cnt = runs[i].count, w;
    if (len < 0 || cnt < 0) {
      return rs_fail(err, RS_ENEG, i, -1, "row %" PRId64 ": negative length or count", i);
    }
    if (len != 0 && cnt > INT64_MAX / len) {
      return rs_fail(err, RS_EOVERFLOW, i, -1, "row %" PRId64 ": length*count overflows int64", i);
    }
    w = len * cnt;
    if (w > INT64_MAX - sum) {
      return rs_fail(err, RS_EOVERFLOW, i, -1,
                     "row %" PRId64 ": total work of the table overflows int64", i);
    }
    sum += w;
    if (prefix) prefix[i + 1] = sum;
  }
  if (total) *total = sum;
  return RS_OK;
}

/* ---------------------------------------------------------------- scalar casts */
/* The rules are in casts.h, shared with the CUDA kernels; these wrap them for float values. */

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

uint16_t rs_f32_to_bf16(float f) { return rs_bf16_from_f32_bits(f32_bits(f)); }
uint16_t rs_f32_to_f16(float f) { return rs_f16_from_f32_bits(f32_bits(f)); }
float rs_bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }
float rs_f16_to_f32(uint16_t h) { return bits_f32(rs_f32_bits_from_f16(h)); }

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
  for (i = 0; i < n; i++) st16(d, i, rs_bf16_from_f32_bits(ld32(s, i)));
})
RS_CONVERTER(cvt_f32_f16, {
  int64_t i;
  for (i = 0; i < n; i++) st16(d, i, rs_f16_from_f32_bits(ld32(s, i)));
})
RS_CONVERTER(cvt_bf16_f32, {
  int64_t i;
  for (i = 0; i < n; i++) st32(d, i, (uint32_t)ld16(s, i) << 16);
})
RS_CONVERTER(cvt_f16_f32, {
  int64_t i;
  for (i = 0; i < n; i++) st32(d, i, rs_f32_bits_from_f16(ld16(s, i)));
})
RS_CONVERTER(cvt_bf16_f16, {
  int64_t i;
  for (i = 0; i < n; i++) st16(d, i, rs_f16_from_f32_bits((uint32_t)ld16(s, i) << 16));
})
RS_CONVERTER(cvt_f16_bf16, {
  int64_t i;
  for (i = 0; i < n; i++) st16(d, i, rs_bf16_from_f16_bits(ld16(s, i)));
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
#define RS_PREFETCH_FAR(p) __builtin_prefetch((p), 0, 1) /* x86: prefetcht2 */
#else
#define RS_PREFETCH_READ(p) ((void)(p))
#define RS_PREFETCH_WRITE(p) ((void)(p))
#define RS_PREFETCH_FAR(p) ((void)(p))
#endif

/* A cast packing into the staging ring (RS_MODE_PACK: the host side of the CPU -> GPU stage
 * ops) reads its source this far ahead of the converter, in blocks of RS_CAST_BLOCK_BYTES of
 * source. The hardware prefetcher alone left the fp32 -> bf16 pack of the H200 machine (16
 * vCPUs under KVM, 16 threads) at 11-14 G elements/s; reading 8-32 KiB ahead made it 16.5-19
 * G elements/s on three machines (stage_h2d of 128 M elements; hint T0 or T2 alike, NTA 0.6x;
 * benchmarks/results/h200/cast_prefetch). Casts by copy_runs (RS_MODE_RUNS) did not gain on a
 * 2-core VM and keep the plain loop; same-dtype packs, bound by the link on the H200 machine,
 * did not move. */
#define RS_CAST_PREFETCH_BYTES 16384u
#define RS_CAST_BLOCK_BYTES 1024u

/* cvt over n elements, a block at a time, each block first prefetching the source lines
 * RS_CAST_PREFETCH_BYTES ahead that lie inside this call's source (addresses as integers: no
 * pointer is formed past the source). */
static void convert_ahead(convert_fn cvt, const unsigned char *s, size_t ssz, unsigned char *d,
                          size_t dsz, int64_t n) {
  const int64_t block = (int64_t)(RS_CAST_BLOCK_BYTES / ssz);
  const uintptr_t end = (uintptr_t)s + (uintptr_t)n * ssz;
  int64_t i;
  for (i = 0; i < n; i += block) {
    const int64_t m = n - i < block ? n - i : block;
    const uintptr_t ahead = (uintptr_t)s + (uintptr_t)i * ssz + RS_CAST_PREFETCH_BYTES;
    uintptr_t line;
    for (line = ahead; line < ahead + RS_CAST_BLOCK_BYTES && line < end; line += 64u)
      RS_PREFETCH_FAR((const void *)line);
    cvt(s + (size_t)i * ssz, d + (size_t)i * dsz, m);
  }
}

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
      if (cvt && mode == RS_MODE_PACK)
        convert_ahead(cvt, sp, ssz, dp, dsz, take);
      else if (cvt)
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
    return rs_fail(err, RS_EDTYPE, -1, -1, "cannot copy %s to %s", rs_dtype_name(src_dtype),
                   rs_dtype_name(dst_dtype));
  }
  st = rs_validate(runs, n, src_numel, dst_numel, flags, err);
  if (st != RS_OK) return st;
  if ((src_numel > 0 && !src) || (dst_numel > 0 && !dst)) {
    return rs_fail(err, RS_EINVAL, -1, -1, "null src or dst with a nonzero extent");
  }
  prefix = (int64_t *)malloc((size_t)(n + 1) * sizeof *prefix);
  if (!prefix)
    return rs_fail(err, RS_ENOMEM, -1, -1, "cannot allocate %" PRId64 " prefix sums", n + 1);
  st = rs_prefix(runs, n, prefix, &total, err);
  if (st == RS_OK)
    st = rs_copy_slice(src, src_dtype, dst, dst_dtype, runs, n, prefix, 0, total, RS_MODE_RUNS);
  if (st != RS_OK && err && err->code == RS_OK)
    rs_fail(err, st, -1, -1, "copy failed: %s", rs_status_name(st));
  free(prefix);
  return st;
}
