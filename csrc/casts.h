/* reshard's scalar casts among float32, bfloat16 and float16, on bit patterns: written once,
 * compiled by the C core (copy_runs.c, as C11) and by the CUDA kernels (cuda/copy_runs.cu, as
 * __host__ __device__ functions), like c10's C10_HOST_DEVICE scalar code.
 *
 * Bitwise identical to torch 2.13's CPU .to() on contiguous tensors (tests/test_ops.py checks
 * the C core against torch, tests/gpu the kernels against the same reference). Integer
 * arithmetic only, so no result depends on a compiler's or a device's float modes. NaN
 * results differ per pair, as in torch:
 *   f32 -> bf16: every NaN becomes 0xFFFF (torch's vectorized path)
 *   f16 -> bf16: every NaN becomes 0x7FC0
 *   f32/bf16 -> f16: sign kept, quiet bit set, top 9 payload bits kept (as F16C does)
 *   f16 -> f32: sign and payload kept, quiet bit set (torch's vectorized body; its scalar tail,
 *   the last numel % 8 elements, gives 0x7FFFFFFF instead); bf16 -> f32 is a plain shift. */
#ifndef RESHARD_CASTS_H
#define RESHARD_CASTS_H

#include <stdint.h>

#ifdef __CUDACC__
#define RS_HOST_DEVICE static __host__ __device__ __forceinline__
#else
#define RS_HOST_DEVICE static inline
#endif

RS_HOST_DEVICE uint16_t rs_bf16_from_bits_rne(uint32_t u) { /* u is not NaN */
  return (uint16_t)((u + UINT32_C(0x7FFF) + ((u >> 16) & 1u)) >> 16);
}

RS_HOST_DEVICE uint16_t rs_bf16_from_f32_bits(uint32_t u) {
  if ((u & UINT32_C(0x7FFFFFFF)) > UINT32_C(0x7F800000)) return 0xFFFFu;
  return rs_bf16_from_bits_rne(u);
}

RS_HOST_DEVICE uint16_t rs_f16_from_f32_bits(uint32_t w) {
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

/* The index of the highest set bit of m, 0 < m < 2^10. */
RS_HOST_DEVICE uint32_t rs_top_bit10(uint32_t m) {
#ifdef __CUDA_ARCH__
  return 31u - (uint32_t)__clz((int)m);
#else
  uint32_t p = 9;
  while (!(m >> p)) p--;
  return p;
#endif
}

RS_HOST_DEVICE uint32_t rs_f32_bits_from_f16(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t e = (h >> 10) & 0x1Fu, m = h & 0x3FFu, p;
  if (e == 0x1F) return sign | UINT32_C(0x7F800000) | (m ? UINT32_C(0x400000) | (m << 13) : 0);
  if (e == 0) {
    if (m == 0) return sign;
    p = rs_top_bit10(m); /* leading bit: value = m * 2^-24, exponent p - 24 */
    return sign | ((p + 103) << 23) | ((m << (23 - p)) & UINT32_C(0x7FFFFF));
  }
  return sign | ((e + 112) << 23) | (m << 13);
}

RS_HOST_DEVICE uint16_t rs_bf16_from_f16_bits(uint16_t h) {
  if ((h & 0x7C00u) == 0x7C00u && (h & 0x3FFu)) return 0x7FC0u;
  return rs_bf16_from_bits_rne(rs_f32_bits_from_f16(h));
}

#endif /* RESHARD_CASTS_H */
