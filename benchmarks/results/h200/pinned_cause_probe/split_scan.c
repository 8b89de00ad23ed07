/* The per-call host work of stage_table() in csrc/ops.cpp before its split was cached for
 * tables with no direct row: every row tested (rs_stage_row_is_direct) and appended to a
 * growing array of ring rows (doubling like std::vector), then dropped. 1 GiB of fp32 in runs
 * of 4 KiB (262,144 rows) and 64 KiB (16,384 rows); 20 calls each.
 *   gcc -O2 -std=c11 split_scan.c -o split_scan && ./split_scan */
#define _POSIX_C_SOURCE 199309L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct {
  int64_t src_offset, src_stride, dst_offset, dst_stride, length, count;
} row_t;

static int is_direct(const row_t *r, int64_t es, int64_t min_bytes) {
  if (r->length <= 0 || r->count <= 0) return 0;
  if (r->length > INT64_MAX / es) return 0;
  if (r->length * es < min_bytes) return 0;
  if (r->count == 1) return 1;
  return r->src_stride >= r->length && r->dst_stride >= r->length;
}

typedef struct {
  row_t *v;
  size_t n, cap;
} vec_t;

static void push(vec_t *a, const row_t *r) {
  if (a->n == a->cap) { /* grow and copy, as std::vector does */
    size_t cap = a->cap ? 2 * a->cap : 1;
    row_t *v = malloc(cap * sizeof *v);
    if (a->n) memcpy(v, a->v, a->n * sizeof *v);
    free(a->v);
    a->v = v;
    a->cap = cap;
  }
  a->v[a->n++] = *r;
}

static double ms_since(const struct timespec *t0) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return 1e3 * (double)(t.tv_sec - t0->tv_sec) + 1e-6 * (double)(t.tv_nsec - t0->tv_nsec);
}

int main(void) {
  const int64_t runs[2] = {4096, 65536};
  for (int k = 0; k < 2; ++k) {
    const int64_t n = ((int64_t)1 << 30) / runs[k];
    row_t *rows = malloc((size_t)n * sizeof *rows);
    for (int64_t i = 0; i < n; ++i) {
      row_t r = {i * 7, 0, i * runs[k] / 4, 0, runs[k] / 4, 1};
      rows[i] = r;
    }
    double best = 1e30, sum = 0;
    for (int rep = 0; rep < 20; ++rep) {
      struct timespec t0;
      clock_gettime(CLOCK_MONOTONIC, &t0);
      vec_t ring = {0}, direct = {0};
      for (int64_t i = 0; i < n; ++i)
        push(is_direct(&rows[i], 4, 256 * 1024) ? &direct : &ring, &rows[i]);
      free(ring.v);
      free(direct.v);
      const double ms = ms_since(&t0);
      best = ms < best ? ms : best;
      sum += ms;
    }
    printf("%lld B runs, %lld rows (1 GiB): per call min %.2f ms, mean %.2f ms\n",
           (long long)runs[k], (long long)n, best, sum / 20);
    free(rows);
  }
  return 0;
}
