/* libFuzzer target for descriptor validation (built by `make fuzz` with
 * -fsanitize=fuzzer,address,undefined).
 *
 * Input: src_numel, dst_numel (uint16 each, small so brute force stays cheap), then rows of
 * six int64 taken raw from the input (so negative values and overflow are explored), or,
 * when a row's first byte is odd, six small values (so valid and overlapping tables are
 * common too). Properties:
 *  - rs_validate never crashes and returns a known status;
 *  - if it accepts a table, copying it touches only the buffers (ASan checks) and a
 *    brute-force walk finds no write out of range and no element written twice;
 *  - if it rejects a table for range or overlap, the brute force agrees;
 *  - rs_prefix agrees with the walk's element count;
 *  - an accepted table copies f32 -> bf16 element for element as the walk and the scalar cast
 *    say, and leaves every other dst element alone;
 *  - a slice [begin, end) of its work (from the input's leftover bytes) packed into a dense
 *    buffer (RS_MODE_PACK) holds work element k's source at k - begin, and unpacked
 *    (RS_MODE_UNPACK) writes exactly those elements back, casting on the way. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "reshard.h"

#define MAX_ROWS 16
#define MAX_WORK 200000

static int64_t rd64(const uint8_t *p) {
  int64_t v;
  memcpy(&v, p, 8);
  return v;
}

/* Source bits of element i: every class of float (NaN, inf, subnormal, ties) turns up. */
static uint32_t src_bits(int64_t i) { return (uint32_t)((uint64_t)i * 2654435761u ^ 0x7F80A5A5u); }

#define POISON 0xDEADu

/* The copies of an accepted table (total <= MAX_WORK elements of work) against a walk of it. */
static void check_copies(const rs_run *runs, int64_t n, int64_t sn, int64_t dn, int64_t total,
                         int64_t slice_a, int64_t slice_b) {
  float *src = malloc(sizeof(float) * (size_t)(sn + 1));
  uint16_t *dst = malloc(sizeof(uint16_t) * (size_t)(dn + 1));
  uint16_t *want = malloc(sizeof(uint16_t) * (size_t)(dn + 1));
  int64_t *ws = malloc(sizeof(int64_t) * (size_t)(total + 1)); /* work k: src element */
  int64_t *wd = malloc(sizeof(int64_t) * (size_t)(total + 1)); /* work k: dst element */
  int64_t *prefix = malloc(sizeof(int64_t) * (size_t)(n + 1));
  float *packed = malloc(sizeof(float) * (size_t)(total + 1));
  int64_t i, c, j, k = 0, begin, end;
  rs_error err;
  if (!src || !dst || !want || !ws || !wd || !prefix || !packed) goto done;
  for (i = 0; i < sn; i++) {
    uint32_t b = src_bits(i);
    memcpy(&src[i], &b, 4);
  }
  for (i = 0; i < dn; i++) dst[i] = want[i] = POISON;
  for (i = 0; i < n; i++)
    for (c = 0; c < runs[i].count && runs[i].length > 0; c++)
      for (j = 0; j < runs[i].length; j++, k++) {
        ws[k] = runs[i].src_offset + c * runs[i].src_stride + j;
        wd[k] = runs[i].dst_offset + c * runs[i].dst_stride + j;
        want[wd[k]] = rs_f32_to_bf16(src[ws[k]]);
      }
  if (k != total) abort();
  if (rs_copy_runs(src, RS_F32, sn, dst, RS_BF16, dn, runs, n, RS_CHECK_OVERLAP, &err) != RS_OK)
    abort();
  if (dn > 0 && memcmp(dst, want, sizeof(uint16_t) * (size_t)dn) != 0) abort();

  /* a slice of the work through a dense buffer and back */
  if (rs_prefix(runs, n, prefix, NULL, &err) != RS_OK) abort();
  begin = total ? slice_a % (total + 1) : 0;
  end = slice_b < 0 ? total : begin + slice_b % (total - begin + 1);
  if (rs_copy_slice(src, RS_F32, packed, RS_F32, runs, n, prefix, begin, end, RS_MODE_PACK) !=
      RS_OK)
    abort();
  for (k = begin; k < end; k++)
    if (memcmp(&packed[k - begin], &src[ws[k]], 4) != 0) abort();
  for (i = 0; i < dn; i++) dst[i] = POISON;
  if (rs_copy_slice(packed, RS_F32, dst, RS_BF16, runs, n, prefix, begin, end, RS_MODE_UNPACK) !=
      RS_OK)
    abort();
  for (k = begin; k < end; k++) {
    if (dst[wd[k]] != want[wd[k]]) abort();
    dst[wd[k]] = POISON;
  }
  for (i = 0; i < dn; i++)
    if (dst[i] != POISON) abort(); /* written outside the slice */
done:
  free(src);
  free(dst);
  free(want);
  free(ws);
  free(wd);
  free(prefix);
  free(packed);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  rs_run runs[MAX_ROWS];
  int64_t n = 0, sn, dn, i, c, j, work = 0, total = 0;
  rs_error err;
  rs_status st;
  unsigned char *hits;
  int out_of_range = 0, double_write = 0;
  int64_t slice_a = 0, slice_b = -1;
  if (size < 4) return 0;
  sn = (int64_t)(data[0] | (data[1] << 8)) % 4097;
  dn = (int64_t)(data[2] | (data[3] << 8)) % 4097;
  data += 4;
  size -= 4;
  while (n < MAX_ROWS && size > 0) {
    int64_t *f = &runs[n].src_offset;
    int k;
    if (data[0] & 1) { /* compact row: 6 bytes, small non-negative values */
      if (size < 7) break;
      for (k = 0; k < 6; k++) f[k] = data[1 + k] % 64;
      data += 7;
      size -= 7;
    } else {
      if (size < 49) break;
      for (k = 0; k < 6; k++) f[k] = rd64(data + 1 + 8 * k);
      data += 49;
      size -= 49;
    }
    n++;
  }

  if (size >= 4) { /* leftover bytes pick the slice that PACK/UNPACK copy */
    slice_a = (int64_t)(data[0] | (data[1] << 8));
    slice_b = (int64_t)(data[2] | (data[3] << 8));
  }

  st = rs_validate(runs, n, sn, dn, RS_CHECK_OVERLAP, &err);
  if (st != RS_OK && st != RS_ENEG && st != RS_EOVERFLOW && st != RS_ERANGE && st != RS_EOVERLAP) {
    abort();
  }
  if (st != RS_OK && (err.code != st || err.msg[0] == '\0')) abort();
  if (st == RS_OK || st == RS_ERANGE || st == RS_EOVERLAP) {
    /* Walk only rows whose fields were all checked: every row when the table passed or
     * when the cross-row overlap check (which runs after all rows) failed; rows up to the
     * failing one for a range error or an overlap within one row. */
    int64_t upto = n;
    if (st == RS_ERANGE || (st == RS_EOVERLAP && err.row == err.other_row)) upto = err.row + 1;
    hits = calloc((size_t)dn + 1, 1);
    if (!hits) return 0;
    for (i = 0; i < upto && work < MAX_WORK; i++) {
      if (runs[i].length == 0 || runs[i].count == 0) continue; /* no-op rows: unchecked spans */
      for (c = 0; c < runs[i].count && work < MAX_WORK; c++) {
        int64_t s0 = runs[i].src_offset + c * runs[i].src_stride;
        int64_t d0 = runs[i].dst_offset + c * runs[i].dst_stride;
        for (j = 0; j < runs[i].length && work < MAX_WORK; j++, work++) {
          if (s0 + j >= sn || d0 + j >= dn) {
            out_of_range = 1;
          } else if (hits[d0 + j]++) {
            double_write = 1;
          }
        }
      }
    }
    free(hits);
    if (work < MAX_WORK) {
      if (st == RS_OK && (out_of_range || double_write)) abort();
      if (st == RS_ERANGE && !out_of_range) abort();
      if (st == RS_EOVERLAP && !double_write) abort();
    }
  }
  if (st == RS_OK && rs_prefix(runs, n, NULL, &total, &err) == RS_OK && total <= MAX_WORK) {
    if (work < MAX_WORK && work != total) abort();
    check_copies(runs, n, sn, dn, total, slice_a, slice_b);
  }
  return 0;
}
