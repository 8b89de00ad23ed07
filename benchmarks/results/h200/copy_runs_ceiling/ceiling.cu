/* The simplest gathers of fixed-size runs, as a ceiling for copy_runs at short runs: one thread
 * per 16-byte output word, four words in flight per thread, full occupancy, no tiles, no
 * search. desc 8: one int64 source offset per run; desc 56: the source offset and length read
 * from copy_runs' own 48-byte rows and the destination from its 8-byte prefix entry (a dense
 * gather: prefix == dst_offset).
 * Built on the GPU machine: nvcc -O3 -arch=sm_90 -Icsrc -shared -Xcompiler -fPIC ceiling.cu
 * -o libceiling.so; launched on the legacy default stream (torch's current stream there). */
#include <cuda_runtime.h>
#include <stdint.h>

#include "casts.h"

struct Row {
  long long src_offset, src_stride, dst_offset, dst_stride, length, count;
};

/* fp32 -> fp32: word = 4 elements; runs of 1 << lw words */
template <bool FULL>
__global__ void __launch_bounds__(256)
    gather_f32(const uint4 *__restrict__ src, const long long *__restrict__ off,
               const Row *__restrict__ rows, const long long *__restrict__ prefix,
               uint4 *__restrict__ dst, long long n_runs, int lw) {
  const long long total = n_runs << lw;
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total; i += 4 * stride) {
    uint4 v[4];
    long long d[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const long long j = i + k * stride;
      d[k] = -1;
      if (j < total) {
        const long long r = j >> lw, w = j & ((1LL << lw) - 1);
        long long so, dw;
        if (FULL) { /* the row's offset and length, the dense side from the prefix */
          so = __ldg(&rows[r].src_offset) >> 2;
          dw = (__ldg(prefix + r) >> 2) + w;
          if (4 * w >= __ldg(&rows[r].length)) continue;
        } else {
          so = __ldg(off + r);
          dw = j;
        }
        v[k] = __ldg(src + so + w);
        d[k] = dw;
      }
    }
#pragma unroll
    for (int k = 0; k < 4; ++k)
      if (d[k] >= 0) dst[d[k]] = v[k];
  }
}

/* fp32 -> bf16: an output word is 8 elements (two input words); runs of 1 << lw out words */
template <bool FULL>
__global__ void __launch_bounds__(256)
    gather_bf16(const uint4 *__restrict__ src, const long long *__restrict__ off,
                const Row *__restrict__ rows, const long long *__restrict__ prefix,
                uint4 *__restrict__ dst, long long n_runs, int lw) {
  const long long total = n_runs << lw;
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total; i += 4 * stride) {
    uint4 a[4], b[4];
    long long d[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const long long j = i + k * stride;
      d[k] = -1;
      if (j < total) {
        const long long r = j >> lw, w = j & ((1LL << lw) - 1);
        long long so, dw;
        if (FULL) {
          so = __ldg(&rows[r].src_offset) >> 2;
          dw = (__ldg(prefix + r) >> 3) + w;
          if (8 * w >= __ldg(&rows[r].length)) continue;
        } else {
          so = __ldg(off + r);
          dw = j;
        }
        a[k] = __ldg(src + so + 2 * w);
        b[k] = __ldg(src + so + 2 * w + 1);
        d[k] = dw;
      }
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if (d[k] < 0) continue;
      const uint32_t x[8] = {a[k].x, a[k].y, a[k].z, a[k].w, b[k].x, b[k].y, b[k].z, b[k].w};
      uint32_t o[4];
#pragma unroll
      for (int e = 0; e < 4; ++e)
        o[e] = (uint32_t)rs_bf16_from_f32_bits(x[2 * e]) |
               ((uint32_t)rs_bf16_from_f32_bits(x[2 * e + 1]) << 16);
      dst[d[k]] = make_uint4(o[0], o[1], o[2], o[3]);
    }
  }
}

/* off: per run, its source offset in 16-byte words (desc 8); rows/prefix: copy_runs' device
 * table (desc 56; offsets in elements). Returns a cudaError_t. */
extern "C" int ceiling_gather(int bf16, int full, const void *src, const long long *off,
                              const void *rows, const long long *prefix, void *dst,
                              long long n_runs, int lw) {
  int dev = 0, sms = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  const unsigned grid = (unsigned)sms * 8;
  const uint4 *s = (const uint4 *)src;
  const Row *r = (const Row *)rows;
  uint4 *d = (uint4 *)dst;
  if (bf16) {
    if (full)
      gather_bf16<true><<<grid, 256>>>(s, off, r, prefix, d, n_runs, lw);
    else
      gather_bf16<false><<<grid, 256>>>(s, off, r, prefix, d, n_runs, lw);
  } else {
    if (full)
      gather_f32<true><<<grid, 256>>>(s, off, r, prefix, d, n_runs, lw);
    else
      gather_f32<false><<<grid, 256>>>(s, off, r, prefix, d, n_runs, lw);
  }
  return (int)cudaGetLastError();
}
