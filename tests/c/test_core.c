/* Unit tests of the C core (csrc/reshard.h), built and run by `make ctest` under
 * AddressSanitizer + UndefinedBehaviorSanitizer. Every copy is checked against an
 * independent element-by-element reference on poisoned destinations; the overlap check
 * against a brute-force write-count map; the casts against the compiler's _Float16 and
 * against exact arithmetic. */
#if defined(__linux__)
#define _GNU_SOURCE /* mkstemp, mmap with MAP_ANONYMOUS: the writability tests */
#else
#define _POSIX_C_SOURCE 200809L /* mkstemp */
#endif
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

#include "reshard.h"

static int failures = 0;
static int checks = 0;

#define CHECK(cond, ...)                                                       \
  do {                                                                         \
    checks++;                                                                  \
    if (!(cond)) {                                                             \
      failures++;                                                              \
      fprintf(stderr, "%s:%d: CHECK(%s) failed: ", __FILE__, __LINE__, #cond); \
      fprintf(stderr, __VA_ARGS__);                                            \
      fprintf(stderr, "\n");                                                   \
      if (failures > 20) exit(1);                                              \
    }                                                                          \
  } while (0)

/* splitmix64: a small deterministic PRNG so failures reproduce. */
static uint64_t rng_state = 0x1234567u;
static uint64_t rnd(void) {
  uint64_t z = (rng_state += UINT64_C(0x9E3779B97F4A7C15));
  z = (z ^ (z >> 30)) * UINT64_C(0xBF58476D1CE4E5B9);
  z = (z ^ (z >> 27)) * UINT64_C(0x94D049BB133111EB);
  return z ^ (z >> 31);
}
static int64_t rnd_below(int64_t n) { return n <= 0 ? 0 : (int64_t)(rnd() % (uint64_t)n); }

static uint32_t f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
static float bits_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* ------------------------------------------------------------------ validation */

static rs_status validate1(rs_run r, int64_t sn, int64_t dn, rs_error *err) {
  return rs_validate(&r, 1, sn, dn, RS_CHECK_OVERLAP, err);
}

static void test_validate_errors(void) {
  rs_error err;
  rs_run ok = {0, 4, 0, 4, 4, 3};
  rs_run rows[3] = {{0, 1, 0, 1, 1, 1}, {0, 1, 1, 1, 1, 1}, {0, 0, 2, 1, 1, -1}};
  int k;

  CHECK(validate1(ok, 12, 12, &err) == RS_OK, "%s", err.msg);
  CHECK(validate1(ok, 11, 12, &err) == RS_ERANGE && err.row == 0, "%s", err.msg);
  CHECK(strstr(err.msg, "reads src[11]") != NULL, "%s", err.msg);
  CHECK(validate1(ok, 12, 11, &err) == RS_ERANGE && strstr(err.msg, "writes dst[11]"), "%s",
        err.msg);

  /* every field negative in turn, reported by name and row */
  for (k = 0; k < 6; k++) {
    rs_run r = ok;
    static const char *names[6] = {"src_offset", "src_stride", "dst_offset",
                                   "dst_stride", "length",     "count"};
    ((int64_t *)&r)[k] = -1;
    CHECK(validate1(r, 100, 100, &err) == RS_ENEG && err.row == 0, "field %d", k);
    CHECK(strstr(err.msg, names[k]) != NULL, "%s", err.msg);
  }
  CHECK(rs_validate(rows, 3, 10, 10, RS_CHECK_OVERLAP, &err) == RS_ENEG && err.row == 2, "%s",
        err.msg);
  CHECK(strncmp(err.msg, "row 2:", 6) == 0, "%s", err.msg);

  /* int64 overflow in each term of offset + (count-1)*stride + length */
  {
    rs_run r1 = {0, INT64_MAX / 2, 0, 1, 1, 4};
    rs_run r2 = {INT64_MAX - 2, 1, 0, 1, 4, 1};
    rs_run r3 = {0, 1, INT64_MAX - 10, 1, 1, 20};
    rs_run r4 = {0, 0, 0, INT64_MAX, 1, INT64_MAX};
    CHECK(validate1(r1, 100, 100, &err) == RS_EOVERFLOW && strstr(err.msg, "src"), "%s", err.msg);
    CHECK(validate1(r2, 100, 100, &err) == RS_EOVERFLOW, "%s", err.msg);
    CHECK(validate1(r3, 100, 100, &err) == RS_EOVERFLOW && strstr(err.msg, "dst"), "%s", err.msg);
    CHECK(validate1(r4, 100, 100, &err) == RS_EOVERFLOW, "%s", err.msg);
  }
  /* zero-length and zero-count rows are no-ops, even with far offsets */
  {
    rs_run z1 = {1000, 5, 1000, 5, 0, 7}, z2 = {1000, 5, 1000, 5, 3, 0};
    CHECK(validate1(z1, 1, 1, &err) == RS_OK, "%s", err.msg);
    CHECK(validate1(z2, 1, 1, &err) == RS_OK, "%s", err.msg);
  }
  /* within-row overlap; stride 0 reads are fine */
  {
    rs_run r = {0, 0, 0, 2, 3, 2};
    rs_run b = {0, 0, 0, 3, 3, 2};
    CHECK(validate1(r, 10, 10, &err) == RS_EOVERLAP && err.row == 0 && err.other_row == 0, "%s",
          err.msg);
    CHECK(rs_validate(&r, 1, 10, 10, 0, &err) == RS_OK, "without the flag: %s", err.msg);
    CHECK(validate1(b, 10, 10, &err) == RS_OK, "%s", err.msg);
  }
  /* bad arguments */
  CHECK(rs_validate(NULL, 1, 1, 1, 0, &err) == RS_EINVAL, "null table");
  CHECK(rs_validate(&ok, -1, 1, 1, 0, &err) == RS_EINVAL, "negative n");
  CHECK(rs_validate(&ok, 1, -1, 1, 0, &err) == RS_EINVAL, "negative extent");
  CHECK(rs_validate(&ok, 1, 1, 1, 0x80u, &err) == RS_EINVAL, "bad flags");
  CHECK(rs_validate(NULL, 0, 0, 0, RS_CHECK_OVERLAP, NULL) == RS_OK, "empty table, no err");
}

/* Brute-force overlap: counts writes per dst element. */
static int brute_overlap(const rs_run *runs, int64_t n, int64_t dn) {
  unsigned char *hits = calloc((size_t)dn + 1, 1);
  int64_t i, c, j;
  int found = 0;
  for (i = 0; i < n && !found; i++) {
    for (c = 0; c < runs[i].count && !found; c++) {
      for (j = 0; j < runs[i].length && !found; j++) {
        int64_t at = runs[i].dst_offset + c * runs[i].dst_stride + j;
        if (hits[at]++) found = 1;
      }
    }
  }
  free(hits);
  return found;
}

/* Random in-range table: mixes interleaved strided rows (column splits), transposes (equal
 * strides), single intervals and empty rows, in random order so both the sorted fast path
 * and the sweep run. */
static int64_t random_table(rs_run *runs, int64_t max_rows, int64_t dn) {
  int64_t n = 1 + rnd_below(max_rows), i;
  for (i = 0; i < n; i++) {
    rs_run r;
    int64_t length = 1 + rnd_below(6), count = rnd_below(5), stride;
    int kind = (int)rnd_below(4);
    if (kind == 0) count = 1;
    stride = kind == 1 ? 8 : length + rnd_below(6); /* kind 1: equal strides */
    if (rnd_below(10) == 0) length = 0;
    r.src_offset = rnd_below(8);
    r.src_stride = rnd_below(4);
    r.length = length;
    r.count = count;
    r.dst_stride = stride;
    {
      int64_t span = count > 0 ? (count - 1) * stride + length : 0;
      r.dst_offset = span < dn ? rnd_below(dn - span + 1) : 0;
      if (span > dn) r.count = 0;
    }
    runs[i] = r;
  }
  return n;
}

static void test_overlap_random(void) {
  int t;
  rs_run runs[12];
  int64_t agree_yes = 0, agree_no = 0;
  for (t = 0; t < 200000; t++) {
    int64_t dn = 8 + rnd_below(120);
    int64_t n = random_table(runs, 12, dn);
    rs_error err;
    rs_status st = rs_validate(runs, n, 64, dn, RS_CHECK_OVERLAP, &err);
    int expect = brute_overlap(runs, n, dn);
    CHECK(st == RS_OK || st == RS_EOVERLAP, "trial %d: %s", t, err.msg);
    CHECK((st == RS_EOVERLAP) == expect, "trial %d: validate says %s, brute force says %d", t,
          rs_status_name(st), expect);
    if (st == RS_EOVERLAP) {
      /* the two rows named really overlap */
      rs_run pair[2];
      pair[0] = runs[err.other_row];
      pair[1] = runs[err.row];
      CHECK(brute_overlap(pair, err.row == err.other_row ? 1 : 2, dn), "trial %d: %s", t, err.msg);
      agree_yes++;
    } else {
      agree_no++;
    }
  }
  /* the generator must exercise both outcomes, or this test proves nothing */
  CHECK(agree_yes > 10000 && agree_no > 10000, "yes %" PRId64 " no %" PRId64, agree_yes, agree_no);
}

/* Tables whose repeated rows share one stride W plus single runs that may span several lines of
 * W, against the brute force; a quarter of them also have rows of 2W or 3W (rectangles in the
 * lcm grid) and of unrelated strides (the merge). Up to 40 rows, so clusters are large. */
static void test_overlap_one_stride_random(void) {
  int t;
  rs_run runs[40];
  int64_t agree_yes = 0, agree_no = 0;
  for (t = 0; t < 100000; t++) {
    int64_t width = 1 + rnd_below(12), dn = 16 + rnd_below(400), n = 1 + rnd_below(40), i;
    int mixed = t % 4 == 3;
    rs_error err;
    rs_status st;
    int expect;
    for (i = 0; i < n; i++) {
      rs_run r = {0, 1, 0, width, 1, 1};
      int64_t span;
      if (rnd_below(2)) {
        int64_t pick = mixed ? rnd_below(4) : 0;
        /* a multiple of the stride (lcm grid) or an unrelated one (merge) */
        r.dst_stride = pick == 1   ? width * (2 + rnd_below(2))
                       : pick == 2 ? width + 1 + rnd_below(4)
                                   : width;
        r.length = 1 + rnd_below(r.dst_stride);
        r.count = 2 + rnd_below(6);
      } else {
        r.length = 1 + rnd_below(3 * width);
      }
      span = (r.count - 1) * r.dst_stride + r.length;
      if (span > dn) r.count = 1, span = r.length;
      if (span > dn) r.length = dn, span = dn;
      r.dst_offset = rnd_below(dn - span + 1);
      runs[i] = r;
    }
    st = rs_validate(runs, n, INT64_C(1) << 20, dn, RS_CHECK_OVERLAP, &err);
    expect = brute_overlap(runs, n, dn);
    CHECK(st == RS_OK || st == RS_EOVERLAP, "trial %d: %s", t, err.msg);
    CHECK((st == RS_EOVERLAP) == expect, "trial %d: validate says %s, brute force says %d", t,
          rs_status_name(st), expect);
    if (st == RS_EOVERLAP) {
      rs_run pair[2];
      pair[0] = runs[err.other_row];
      pair[1] = runs[err.row];
      CHECK(err.row != err.other_row && brute_overlap(pair, 2, dn), "trial %d: %s", t, err.msg);
      agree_yes++;
    } else {
      agree_no++;
    }
  }
  CHECK(agree_yes > 5000 && agree_no > 5000, "yes %" PRId64 " no %" PRId64, agree_yes, agree_no);
}

static void test_overlap_large_sorted_and_transposed(void) {
  /* 4096 columns of a 4096x4096 matrix (equal strides, fully interleaved): the sweep must
   * finish quickly and find no overlap; then one duplicate column must be found. */
  enum { N = 4096 };
  rs_run *runs = malloc(sizeof(rs_run) * (N + 1));
  rs_error err;
  int64_t i;
  for (i = 0; i < N; i++) {
    rs_run r = {0, 0, N - 1 - i, N, 1, N}; /* reverse order: forces the sort */
    runs[i] = r;
  }
  CHECK(rs_validate(runs, N, 1, (int64_t)N * N, RS_CHECK_OVERLAP, &err) == RS_OK, "%s", err.msg);
  runs[N] = runs[17];
  CHECK(rs_validate(runs, N + 1, 1, (int64_t)N * N, RS_CHECK_OVERLAP, &err) == RS_EOVERLAP,
        "duplicate column not found");
  CHECK(err.row == N && err.other_row == 17, "rows %" PRId64 " %" PRId64, err.row, err.other_row);
  free(runs);
}

/* ------------------------------------------------------------------ casts */

static void test_casts(void) {
  uint32_t u;
  uint32_t h;
  /* bf16 -> f32 -> bf16 and f16 -> f32 -> f16 round trips are exact for non-NaN */
  for (h = 0; h < 65536; h++) {
    float fb = rs_bf16_to_f32((uint16_t)h), fh = rs_f16_to_f32((uint16_t)h);
    CHECK(f32_bits(fb) == h << 16, "bf16 %04x", h);
    if (!isnan(fb)) CHECK(rs_f32_to_bf16(fb) == h, "bf16 %04x", h);
    if (!isnan(fh)) CHECK(rs_f32_to_f16(fh) == h, "f16 %04x -> %08x", h, f32_bits(fh));
#if defined(__FLT16_MAX__)
    {
      _Float16 x;
      uint16_t hh = (uint16_t)h;
      memcpy(&x, &hh, 2);
      if (!isnan(fh)) CHECK(f32_bits((float)x) == f32_bits(fh), "f16 %04x", h);
    }
#endif
    if (isnan(fh)) {
      CHECK((f32_bits(fh) & 0x400000u) && (f32_bits(fh) >> 31) == (h >> 15), "f16 nan %04x", h);
    }
  }
  /* f32 -> f16 / bf16 over a wide sample of all bit patterns */
  for (u = 0;; u += 65521u) {
    float f = bits_f32(u);
    uint16_t b = rs_f32_to_bf16(f);
    if (isnan(f)) {
      CHECK(b == 0xFFFF, "f32 %08x -> bf16 %04x", u, b);
      CHECK((rs_f32_to_f16(f) & 0x7E00u) == 0x7E00u, "f32 nan %08x", u);
    } else {
      /* bf16: the nearer of the two neighbours by exact double arithmetic, ties to even;
       * past the largest finite bf16 the upper neighbour is 2^128 (rounds to inf) */
      uint16_t lo_b = (uint16_t)(u >> 16), hi_b = (uint16_t)(lo_b + 1), want = lo_b;
      if (u & 0xFFFFu) {
        double x = fabs((double)f), lo = fabs((double)rs_bf16_to_f32(lo_b));
        double hi =
            (hi_b & 0x7FFFu) == 0x7F80u ? ldexp(1.0, 128) : fabs((double)rs_bf16_to_f32(hi_b));
        if (hi - x < x - lo || (hi - x == x - lo && (lo_b & 1u))) want = hi_b;
      }
      CHECK(b == want, "f32 %08x -> bf16 %04x want %04x", u, b, want);
#if defined(__FLT16_MAX__)
      {
        _Float16 y = (_Float16)f;
        uint16_t yb;
        memcpy(&yb, &y, 2);
        CHECK(rs_f32_to_f16(f) == yb, "f32 %08x -> f16 %04x want %04x", u, rs_f32_to_f16(f), yb);
      }
#endif
    }
    if (u > UINT32_MAX - 65521u) break;
  }
  /* hand-picked edges: ties, subnormals, overflow to inf */
  CHECK(rs_f32_to_f16(65520.0f) == 0x7C00, "65520 -> inf");
  CHECK(rs_f32_to_f16(65519.996f) == 0x7BFF, "just below 65520 -> max");
  CHECK(rs_f32_to_f16(ldexpf(1.0f, -25)) == 0x0000, "2^-25 ties to even zero");
  CHECK(rs_f32_to_f16(ldexpf(1.5f, -25)) == 0x0001, "1.5*2^-25 -> smallest subnormal");
  CHECK(rs_f32_to_f16(ldexpf(3.0f, -25)) == 0x0002, "3*2^-25 ties to even 2");
  CHECK(rs_f32_to_f16(-ldexpf(1.0f, -14)) == 0x8400, "-smallest normal");
  CHECK(rs_f32_to_f16(bits_f32(0x7FA00000u)) == 0x7F00, "payload kept");
  CHECK(rs_f32_to_f16(bits_f32(0xFF812345u)) == 0xFE09, "negative payload kept");
  CHECK(rs_f32_to_bf16(bits_f32(0x3F808000u)) == 0x3F80, "tie to even (down)");
  CHECK(rs_f32_to_bf16(bits_f32(0x3F818000u)) == 0x3F82, "tie to even (up)");
  CHECK(rs_f32_to_bf16(bits_f32(0x7F7FFFFFu)) == 0x7F80, "max float rounds to inf");
  CHECK(f32_bits(rs_f16_to_f32(0x7C01)) == 0x7FC02000u, "f16 snan quieted, payload kept");
}

/* ------------------------------------------------------------------ copies */

static const rs_dtype all_dtypes[] = {RS_F32, RS_BF16, RS_F16, RS_RAW1, RS_RAW2, RS_RAW4, RS_RAW8};

/* Reference element conversion, written independently of copy_runs.c's bulk loops. */
static void ref_convert(const unsigned char *s, rs_dtype sd, unsigned char *d, rs_dtype dd) {
  float f;
  uint16_t h;
  if (sd == dd) {
    memcpy(d, s, rs_dtype_size(sd));
    return;
  }
  if (sd == RS_F32) {
    memcpy(&f, s, 4);
  } else {
    memcpy(&h, s, 2);
    if (sd == RS_F16 && dd == RS_BF16 && (h & 0x7C00u) == 0x7C00u && (h & 0x3FFu)) {
      h = 0x7FC0; /* torch's f16 -> bf16 NaN */
      memcpy(d, &h, 2);
      return;
    }
    f = sd == RS_BF16 ? rs_bf16_to_f32(h) : rs_f16_to_f32(h);
  }
  if (dd == RS_F32) {
    memcpy(d, &f, 4);
  } else {
    h = dd == RS_BF16 ? rs_f32_to_bf16(f) : rs_f32_to_f16(f);
    memcpy(d, &h, 2);
  }
}

static void ref_copy(const unsigned char *s, rs_dtype sd, unsigned char *d, rs_dtype dd,
                     const rs_run *runs, int64_t n) {
  size_t ss = rs_dtype_size(sd), ds = rs_dtype_size(dd);
  int64_t i, c, j;
  for (i = 0; i < n; i++)
    for (c = 0; c < runs[i].count; c++)
      for (j = 0; j < runs[i].length; j++)
        ref_convert(s + (size_t)(runs[i].src_offset + c * runs[i].src_stride + j) * ss, sd,
                    d + (size_t)(runs[i].dst_offset + c * runs[i].dst_stride + j) * ds, dd);
}

/* Poisons buf[0, nbytes), copies the table into d (inside buf) as three rs_copy_slice calls cut
 * at random points and run out of order, as threads would, and checks buf against want. */
static void check_three_slices(const unsigned char *src, rs_dtype sd, unsigned char *buf,
                               unsigned char *d, rs_dtype dd, const rs_run *runs, int64_t n,
                               const int64_t *prefix, const unsigned char *want, size_t nbytes,
                               int trial) {
  int64_t total = prefix[n], a, b;
  memset(buf, 0xA5, nbytes);
  a = rnd_below(total + 1);
  b = a + rnd_below(total - a + 1);
  CHECK(rs_copy_slice(src, sd, d, dd, runs, n, prefix, b, total, RS_MODE_RUNS) == RS_OK, "slice");
  CHECK(rs_copy_slice(src, sd, d, dd, runs, n, prefix, 0, a, RS_MODE_RUNS) == RS_OK, "slice");
  CHECK(rs_copy_slice(src, sd, d, dd, runs, n, prefix, a, b, RS_MODE_RUNS) == RS_OK, "slice");
  CHECK(memcmp(buf, want, nbytes) == 0, "sliced copy differs, trial %d", trial);
}

static void test_copy_random(void) {
  enum { SN = 300, DN = 300, MAXN = 10 };
  unsigned char *src = malloc(SN * 8), *got = malloc(DN * 8), *want = malloc(DN * 8);
  unsigned char *packed = malloc(DN * 8), *unpacked = malloc(DN * 8);
  rs_run runs[MAXN];
  int64_t prefix[MAXN + 1];
  size_t si, di;
  int t;
  for (t = 0; t < 4000; t++) {
    for (si = 0; si < sizeof all_dtypes / sizeof *all_dtypes; si++) {
      for (di = 0; di < sizeof all_dtypes / sizeof *all_dtypes; di++) {
        rs_dtype sd = all_dtypes[si], dd = all_dtypes[di];
        size_t ds = rs_dtype_size(dd);
        int64_t n, total = 0, k;
        rs_error err;
        rs_status st;
        if (!rs_dtype_pair_ok(sd, dd)) {
          CHECK(rs_copy_runs(src, sd, SN, got, dd, DN, runs, 0, 0, &err) == RS_EDTYPE, "pair");
          continue;
        }
        if (t % 7 != 0 && (si > 2 || di > 2) && sd != dd) continue;
        for (k = 0; k < SN * 8; k++) src[k] = (unsigned char)rnd();
        n = random_table(runs, MAXN, DN);
        for (k = 0; k < n; k++) runs[k].src_offset = rnd_below(SN - 40); /* reads stay < SN */
        if (rs_validate(runs, n, SN, DN, RS_CHECK_OVERLAP, &err) != RS_OK) continue;
        memset(got, 0xA5, DN * 8); /* poison: untouched bytes must stay 0xA5 */
        memset(want, 0xA5, DN * 8);
        ref_copy(src, sd, want, dd, runs, n);
        st = rs_copy_runs(src, sd, SN, got, dd, DN, runs, n, RS_CHECK_OVERLAP, &err);
        CHECK(st == RS_OK, "%s", err.msg);
        CHECK(memcmp(got, want, DN * ds) == 0, "trial %d %s->%s", t, rs_dtype_name(sd),
              rs_dtype_name(dd));
        CHECK(memcmp(got + DN * ds, want + DN * ds, DN * 8 - DN * ds) == 0, "beyond dst");

        /* slices at random cut points give the same result as one call */
        CHECK(rs_prefix(runs, n, prefix, &total, &err) == RS_OK, "%s", err.msg);
        check_three_slices(src, sd, got, got, dd, runs, n, prefix, want, DN * 8, t);

        /* pack (dense dst) in two slices, then unpack (dense src) in two other slices */
        if (total <= DN) {
          int64_t c1 = rnd_below(total + 1), c2 = rnd_below(total + 1);
          memset(packed, 0xA5, DN * 8);
          memset(unpacked, 0xA5, DN * 8);
          CHECK(rs_copy_slice(src, sd, packed, sd, runs, n, prefix, 0, c1, RS_MODE_PACK) == RS_OK,
                "pack");
          CHECK(rs_copy_slice(src, sd, packed + (size_t)c1 * rs_dtype_size(sd), sd, runs, n, prefix,
                              c1, total, RS_MODE_PACK) == RS_OK,
                "pack");
          CHECK(rs_copy_slice(packed, sd, unpacked, dd, runs, n, prefix, 0, c2, RS_MODE_UNPACK) ==
                    RS_OK,
                "unpack");
          CHECK(rs_copy_slice(packed + (size_t)c2 * rs_dtype_size(sd), sd, unpacked, dd, runs, n,
                              prefix, c2, total, RS_MODE_UNPACK) == RS_OK,
                "unpack");
          CHECK(memcmp(unpacked, want, DN * 8) == 0, "pack+unpack differs, trial %d", t);
        }
      }
    }
  }
  free(src);
  free(got);
  free(want);
  free(packed);
  free(unpacked);
}

/* Runs long enough for the streaming path (copy_runs.c streams same-dtype copies of >= 256
 * bytes when the table's destination is large): byte-unaligned heads and tails on both
 * sides, lengths around the 64-byte line and 256-byte cut-offs, slices cut mid-run, on a
 * poisoned destination. `make ctest` also runs this whole file in a build that streams every
 * table (RS_STREAM_MIN_BYTES=1); the last trial is above the default threshold, so it streams
 * in either build. */
static void test_copy_long_runs(void) {
  enum { MAXN = 64 };
  static const rs_dtype dtypes[] = {RS_RAW1, RS_F32, RS_RAW8, RS_BF16};
  rs_run runs[MAXN];
  int64_t prefix[MAXN + 1];
  int t;
  for (t = 0; t < 301; t++) {
    rs_dtype dt = dtypes[t % 4];
    size_t es = rs_dtype_size(dt);
    int big = t == 300; /* 6 MiB of destination: above the default streaming threshold */
    int64_t max_len = big ? (INT64_C(96) << 10) : 5000 / (int64_t)es;
    int64_t n = big ? MAXN : 1 + rnd_below(MAXN), sn, dn = 0, total, i;
    unsigned char *src, *got, *want;
    rs_error err;
    if (big) dt = RS_RAW1, es = 1;
    for (i = 0; i < n; i++) { /* dst in table order with random gaps; src anywhere */
      int64_t len = big ? max_len : rnd_below(5) == 0 ? rnd_below(300) : rnd_below(max_len + 1);
      int64_t count = big ? 1 : 1 + rnd_below(3), stride = len + rnd_below(70);
      runs[i].src_offset = rnd_below(4096);
      runs[i].src_stride = rnd_below(2) ? stride : len + rnd_below(9);
      runs[i].dst_offset = dn + rnd_below(67);
      runs[i].dst_stride = stride;
      runs[i].length = len;
      runs[i].count = count;
      dn = runs[i].dst_offset + (count - 1) * stride + len;
    }
    sn = 4096 + 3 * (max_len + 70); /* reads end before src_offset + 3 * stride */
    dn += rnd_below(67);
    src = malloc((size_t)sn * es);
    got = malloc((size_t)dn * es + 1);
    want = malloc((size_t)dn * es + 1);
    for (i = 0; i < sn * (int64_t)es; i++) src[i] = (unsigned char)rnd();
    memset(want, 0xA5, (size_t)dn * es + 1); /* poison, one byte past the end included */
    ref_copy(src, dt, want, dt, runs, n);
    { /* every other trial writes to got + 1: a dst that starts unaligned */
      unsigned char *d = t % 2 ? got + 1 : got;
      if (t % 2) {
        memmove(want + 1, want, (size_t)dn * es);
        want[0] = 0xA5;
      }
      memset(got, 0xA5, (size_t)dn * es + 1);
      CHECK(rs_copy_runs(src, dt, sn, d, dt, dn, runs, n, RS_CHECK_OVERLAP, &err) == RS_OK, "%s",
            err.msg);
      CHECK(memcmp(got, want, (size_t)dn * es + 1) == 0, "long runs, trial %d (%s)", t,
            rs_dtype_name(dt));
      /* three slices cut at random points, as threads would */
      CHECK(rs_prefix(runs, n, prefix, &total, &err) == RS_OK, "%s", err.msg);
      check_three_slices(src, dt, got, d, dt, runs, n, prefix, want, (size_t)dn * es + 1, t);
    }
    CHECK(!big || dn * (int64_t)es >= (INT64_C(4) << 20), "big trial is %" PRId64 " bytes", dn);
    free(src);
    free(got);
    free(want);
  }
}

/* Casts of runs many prefetch blocks long (copy_runs.c converts a block at a time, reading
 * ahead): lengths around the 1 KiB block of source and far past it, at unaligned offsets, as
 * one call, in three slices, and packed in two slices into a dense destination; the bytes
 * around every destination stay poisoned. */
static void test_cast_long_runs(void) {
  static const rs_dtype pairs[][2] = {{RS_F32, RS_BF16}, {RS_F32, RS_F16},  {RS_BF16, RS_F32},
                                      {RS_F16, RS_F32},  {RS_BF16, RS_F16}, {RS_F16, RS_BF16}};
  static const int64_t lengths[] = {1, 255, 256, 257, 511, 512, 513, 4103, 20000, 70001};
  enum { PAD = 64 };
  size_t p, l;
  for (p = 0; p < sizeof pairs / sizeof *pairs; p++) {
    for (l = 0; l < sizeof lengths / sizeof *lengths; l++) {
      rs_dtype sd = pairs[p][0], dd = pairs[p][1];
      size_t ss = rs_dtype_size(sd), ds = rs_dtype_size(dd);
      int64_t len = lengths[l], so = 1 + rnd_below(33), dof = 1 + rnd_below(33), k, total = 0;
      int64_t sn = so + len + PAD, dn = dof + len + PAD, prefix[2], cut;
      unsigned char *src = malloc((size_t)sn * ss), *got = malloc((size_t)dn * ds);
      unsigned char *want = malloc((size_t)dn * ds), *packed = malloc((size_t)(len + PAD) * ds);
      unsigned char *want_packed = malloc((size_t)(len + PAD) * ds);
      rs_run run = {so, 0, dof, 0, len, 1};
      rs_run dense = {so, 0, 0, 0, len, 1};
      rs_error err;
      for (k = 0; k < sn * (int64_t)ss; k++) src[k] = (unsigned char)rnd();
      memset(want, 0xA5, (size_t)dn * ds);
      ref_copy(src, sd, want, dd, &run, 1);
      memset(got, 0xA5, (size_t)dn * ds);
      CHECK(rs_copy_runs(src, sd, sn, got, dd, dn, &run, 1, RS_CHECK_OVERLAP, &err) == RS_OK, "%s",
            err.msg);
      CHECK(memcmp(got, want, (size_t)dn * ds) == 0, "%s->%s length %" PRId64, rs_dtype_name(sd),
            rs_dtype_name(dd), len);
      CHECK(rs_prefix(&run, 1, prefix, &total, &err) == RS_OK, "%s", err.msg);
      check_three_slices(src, sd, got, got, dd, &run, 1, prefix, want, (size_t)dn * ds, (int)len);
      /* pack: the same elements, dense from 0, in two slices */
      memset(want_packed, 0xA5, (size_t)(len + PAD) * ds);
      ref_copy(src, sd, want_packed, dd, &dense, 1);
      memset(packed, 0xA5, (size_t)(len + PAD) * ds);
      cut = rnd_below(len + 1);
      CHECK(rs_copy_slice(src, sd, packed + (size_t)cut * ds, dd, &run, 1, prefix, cut, len,
                          RS_MODE_PACK) == RS_OK,
            "pack");
      CHECK(rs_copy_slice(src, sd, packed, dd, &run, 1, prefix, 0, cut, RS_MODE_PACK) == RS_OK,
            "pack");
      CHECK(memcmp(packed, want_packed, (size_t)(len + PAD) * ds) == 0,
            "pack %s->%s length %" PRId64 " cut %" PRId64, rs_dtype_name(sd), rs_dtype_name(dd),
            len, cut);
      free(src);
      free(got);
      free(want);
      free(packed);
      free(want_packed);
    }
  }
}

static void test_copy_errors_write_nothing(void) {
  float src[8] = {1, 2, 3, 4, 5, 6, 7, 8}, dst[8];
  rs_run rows[2] = {{0, 1, 0, 1, 4, 1}, {0, 1, 6, 1, 4, 1}}; /* row 1 writes dst[9] */
  rs_error err;
  int64_t prefix[3] = {0, 4, 8};
  int i;
  for (i = 0; i < 8; i++) dst[i] = -1.0f;
  CHECK(rs_copy_runs(src, RS_F32, 8, dst, RS_F32, 8, rows, 2, RS_CHECK_OVERLAP, &err) == RS_ERANGE,
        "%s", err.msg);
  CHECK(err.row == 1, "row %" PRId64, err.row);
  for (i = 0; i < 8; i++) CHECK(dst[i] == -1.0f, "dst[%d] written on error", i);
  /* slice argument errors touch nothing */
  CHECK(rs_copy_slice(src, RS_F32, dst, RS_F32, rows, 2, prefix, 3, 2, RS_MODE_RUNS) == RS_EINVAL,
        "end < begin");
  CHECK(rs_copy_slice(src, RS_F32, dst, RS_F32, rows, 2, prefix, 0, 9, RS_MODE_RUNS) == RS_EINVAL,
        "end > total");
  CHECK(rs_copy_slice(src, RS_F32, dst, RS_F32, rows, 2, prefix, 0, 1, (rs_mode)7) == RS_EINVAL,
        "mode");
  CHECK(rs_copy_slice(src, RS_F32, dst, RS_RAW4, rows, 2, prefix, 0, 1, RS_MODE_RUNS) == RS_EDTYPE,
        "f32 -> raw4 is not a cast");
  for (i = 0; i < 8; i++) CHECK(dst[i] == -1.0f, "dst[%d] written on error", i);
  CHECK(rs_prefix(rows, 2, NULL, NULL, &err) == RS_OK, "prefix without outputs");
  {
    rs_run big[2] = {{0, 0, 0, 0, INT64_MAX / 2, 1}, {0, 0, 0, 0, INT64_MAX / 2 + 2, 1}};
    int64_t total;
    CHECK(rs_prefix(big, 2, NULL, &total, &err) == RS_EOVERFLOW && err.row == 1, "%s", err.msg);
  }
  CHECK(strcmp(rs_status_name(RS_EOVERLAP), "overlapping writes") == 0, "status name");
  CHECK(rs_dtype_size((rs_dtype)99) == 0 && strcmp(rs_dtype_name((rs_dtype)99), "?") == 0, "dtype");
}

/* ------------------------------------------------------------------ writable memory */

/* rs_unwritable_byte over [addr, addr + nbytes) of `map`: its result, offset and message. */
static int unwritable_in(const char *map, uint64_t addr, uint64_t nbytes, uint64_t *offset,
                         char *what, size_t what_len) {
  char path[] = "/tmp/reshard_maps_XXXXXX";
  const int fd = mkstemp(path);
  FILE *f = fd >= 0 ? fdopen(fd, "w") : NULL;
  if (!f) {
    CHECK(0, "cannot write a map to %s", path);
    return -2;
  }
  fputs(map, f);
  fclose(f);
  const int r = rs_unwritable_byte(path, (uintptr_t)addr, nbytes, offset, what, what_len);
  remove(path);
  return r;
}

static void test_unwritable_byte_map(void) {
  static char map[4096];
  char longpath[2000];
  memset(longpath, 'x', sizeof longpath - 1);
  longpath[sizeof longpath - 1] = '\0';
  /* address order, a gap at [0x4000, 0x5000), a malformed line, a path longer than a line */
  snprintf(map, sizeof map,
           "1000-2000 rw-p 00000000 00:00 0 \n"
           "2000-3000 r--s 00000000 08:01 42                         /data/x y.bin (deleted)\n"
           "3000-4000 rw-p 00000000 00:00 0          /%s\n"
           "not a mapping\n"
           "5000-6000 rw-p 00000000 00:00 0          [heap]\n"
           "6000-7000 ---p 00000000 00:00 0 \n",
           longpath);
  uint64_t off = 99;
  char what[256];
  CHECK(unwritable_in(map, 0x1000, 0x1000, &off, what, sizeof what) == 0, "writable");
  CHECK(unwritable_in(map, 0x1234, 0, &off, what, sizeof what) == 0, "nothing to write");
  CHECK(unwritable_in(map, 0x1800, 0x1000, &off, what, sizeof what) == 1 && off == 0x800,
        "read-only at 0x2000: %" PRIu64, off);
  CHECK(strcmp(what, "read-only memory: mapped r--s from /data/x y.bin (deleted)") == 0, "%s",
        what);
  CHECK(unwritable_in(map, 0x3000, 0x1800, &off, what, sizeof what) == 1 && off == 0x1000,
        "gap at 0x4000: %" PRIu64, off);
  CHECK(strcmp(what, "no memory is mapped there") == 0, "%s", what);
  CHECK(unwritable_in(map, 0x800, 0x1000, &off, what, sizeof what) == 1 && off == 0, "before");
  CHECK(unwritable_in(map, 0x5000, 0x1001, &off, what, sizeof what) == 1 && off == 0x1000 &&
            strcmp(what, "read-only memory: mapped ---p") == 0,
        "no permissions at 0x6000: %s", what);
  CHECK(unwritable_in(map, 0x9000, 1, &off, what, sizeof what) == 1 && off == 0, "past the map");
  CHECK(unwritable_in(map, 0x5000, UINT64_MAX, &off, what, sizeof what) == 1 && off == 0x1000,
        "a range past the address space: %" PRIu64, off);
  CHECK(unwritable_in(map, 0x2000, 1, &off, what, 9) == 1 && strcmp(what, "read-onl") == 0,
        "truncated message: %s", what);
  CHECK(rs_unwritable_byte("/nonexistent/maps", 0x1000, 1, &off, what, sizeof what) == -1,
        "no map");
}

/* The process's own map: a page made read-only, and memory malloc gave. */
static void test_unwritable_byte_self(void) {
#if defined(__linux__)
  const long page = sysconf(_SC_PAGESIZE);
  unsigned char *m =
      mmap(NULL, (size_t)(2 * page), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  CHECK(m != MAP_FAILED, "mmap");
  if (m == MAP_FAILED) return;
  uint64_t off = 0;
  char what[256];
  CHECK(rs_unwritable_byte(RS_MEMORY_MAP, (uintptr_t)m, (uint64_t)(2 * page), &off, what,
                           sizeof what) == 0,
        "read-write pages");
  CHECK(mprotect(m + page, (size_t)page, PROT_READ) == 0, "mprotect");
  CHECK(rs_unwritable_byte(RS_MEMORY_MAP, (uintptr_t)(m + 8), (uint64_t)(2 * page - 8), &off, what,
                           sizeof what) == 1 &&
            off == (uint64_t)(page - 8) && strncmp(what, "read-only memory: mapped r--p", 29) == 0,
        "second page read-only: %" PRIu64 " %s", off, what);
  munmap(m, (size_t)(2 * page));
  CHECK(rs_unwritable_byte(RS_MEMORY_MAP, (uintptr_t)m, 1, &off, what, sizeof what) == 1 &&
            strcmp(what, "no memory is mapped there") == 0,
        "unmapped: %s", what);
  void *heap = malloc(1 << 20);
  CHECK(rs_unwritable_byte(RS_MEMORY_MAP, (uintptr_t)heap, 1 << 20, &off, what, sizeof what) == 0,
        "malloc'd memory: %s", what);
  free(heap);
#endif
}

int main(void) {
  test_validate_errors();
  test_overlap_random();
  test_overlap_one_stride_random();
  test_overlap_large_sorted_and_transposed();
  test_casts();
  test_copy_random();
  test_copy_long_runs();
  test_cast_long_runs();
  test_copy_errors_write_nothing();
  test_unwritable_byte_map();
  test_unwritable_byte_self();
  printf("test_core: %d checks, %d failures (C core %s)\n", checks, failures, RS_VERSION_STRING);
  return failures != 0;
}
