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
 *  - rs_prefix agrees with the walk's element count. */
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

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  rs_run runs[MAX_ROWS];
  int64_t n = 0, sn, dn, i, c, j, work = 0, total = 0;
  rs_error err;
  rs_status st;
  unsigned char *hits;
  int out_of_range = 0, double_write = 0;
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
  if (st == RS_OK) {
    float *src = malloc(sizeof(float) * (size_t)(sn + 1));
    uint16_t *dst = malloc(sizeof(uint16_t) * (size_t)(dn + 1));
    if (rs_prefix(runs, n, NULL, &total, &err) == RS_OK && total <= MAX_WORK && src && dst) {
      if (work < MAX_WORK && work != total) abort();
      memset(src, 0, sizeof(float) * (size_t)(sn + 1));
      if (rs_copy_runs(src, RS_F32, sn, dst, RS_BF16, dn, runs, n, RS_CHECK_OVERLAP, &err) !=
          RS_OK) {
        abort();
      }
    }
    free(src);
    free(dst);
  }
  return 0;
}
