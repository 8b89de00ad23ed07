// Host fp32 -> bf16 cast throughput on the device host: kernel variants, thread counts, page
// sizes, with and without a concurrent pinned H2D DMA. Work is split like stage_h2d's queue:
// 256 KiB (wire) sub-chunks claimed in order, written into a 64 MiB ring of 4 MiB slots.
#include <cuda_runtime.h>
#include <immintrin.h>
#include <omp.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <atomic>
#include <vector>
#include <algorithm>

static double now() { timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }

static inline uint16_t bf16_rne(uint32_t u) {
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0xFFFFu;
  return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
__attribute__((target("avx512f,avx512bw,avx512vl"))) static void cvt_auto(const uint32_t *s, uint16_t *d, int64_t n) {
  for (int64_t i = 0; i < n; i++) d[i] = bf16_rne(s[i]);
}
__attribute__((target("avx512f,avx512bw,avx512vl"))) static inline __m256i cvt16(__m512i u) {
  const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7FFF);
  const __m512i absm = _mm512_set1_epi32(0x7FFFFFFF), inf = _mm512_set1_epi32(0x7F800000);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, bias), lsb), 16);
  __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, absm), inf);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0xFFFF));
  return _mm512_cvtepi32_epi16(r);
}
// intrinsics, 64 elements per iteration, prefetch `pf` bytes ahead (0: none), nt stores or not
template <int NT>
__attribute__((target("avx512f,avx512bw,avx512vl"))) static void cvt_intr(const uint32_t *s, uint16_t *d, int64_t n, int64_t pf) {
  int64_t i = 0;
  const char *end = (const char *)(s + n);
  for (; i + 64 <= n; i += 64) {
    if (pf) {
      const char *p = (const char *)(s + i) + pf;
      if (p < end) { _mm_prefetch(p, _MM_HINT_T0); _mm_prefetch(p + 64, _MM_HINT_T0); _mm_prefetch(p + 128, _MM_HINT_T0); _mm_prefetch(p + 192, _MM_HINT_T0); }
    }
    __m512i a = _mm512_loadu_si512(s + i), b = _mm512_loadu_si512(s + i + 16);
    __m512i c = _mm512_loadu_si512(s + i + 32), e = _mm512_loadu_si512(s + i + 48);
    __m512i ab = _mm512_inserti64x4(_mm512_castsi256_si512(cvt16(a)), cvt16(b), 1);
    __m512i ce = _mm512_inserti64x4(_mm512_castsi256_si512(cvt16(c)), cvt16(e), 1);
    if (NT) { _mm512_stream_si512((__m512i *)(d + i), ab); _mm512_stream_si512((__m512i *)(d + i + 32), ce); }
    else { _mm512_storeu_si512(d + i, ab); _mm512_storeu_si512(d + i + 32, ce); }
  }
  for (; i < n; i++) d[i] = bf16_rne(s[i]);
}
// current copy_runs.c shape: 1 KiB source blocks, each prefetching (T2) the block 16 KiB ahead
static void cvt_cur(const uint32_t *s, uint16_t *d, int64_t n, int64_t pf) {
  const int64_t block = 256;
  const uintptr_t end = (uintptr_t)(s + n);
  for (int64_t i = 0; i < n; i += block) {
    int64_t m = n - i < block ? n - i : block;
    if (pf) { uintptr_t a = (uintptr_t)(s + i) + pf; for (uintptr_t l = a; l < a + 1024 && l < end; l += 64) __builtin_prefetch((const void *)l, 0, 1); }
    cvt_auto(s + i, d + i, m);
  }
}
__attribute__((target("avx512f"))) static uint64_t read_sum(const uint32_t *s, int64_t n) {
  __m512i acc = _mm512_setzero_si512();
  for (int64_t i = 0; i + 16 <= n; i += 16) acc = _mm512_xor_si512(acc, _mm512_loadu_si512(s + i));
  return (uint64_t)_mm512_reduce_add_epi32(acc);
}

enum { K_CUR = 0, K_NOPF, K_INTR, K_INTR_NOPF, K_INTR_NT, K_READ, K_CUR_PF4K, K_CUR_PF64K, K_INTR_PF4K, K_NK };
static const char *kname[] = {"cur_pf16k", "cur_nopf", "intr_pf16k", "intr_nopf", "intr_nt_pf16k", "read", "cur_pf4k", "cur_pf64k", "intr_pf4k"};

static std::atomic<int> dma_stop{0};
static std::atomic<long> dma_bytes{0};
static void *dma_loop(void *arg) {
  size_t chunk = 16 << 20, total = 256 << 20;
  void *h, *dv; cudaStream_t st;
  cudaSetDevice(0); cudaHostAlloc(&h, total, 0); cudaMalloc(&dv, total); cudaStreamCreate(&st);
  memset(h, 1, total);
  *(int *)arg = 1;
  while (!dma_stop.load()) {
    for (size_t o = 0; o < total; o += chunk) cudaMemcpyAsync((char *)dv + o, (char *)h + o, chunk, cudaMemcpyHostToDevice, st);
    cudaStreamSynchronize(st);
    dma_bytes += total;
  }
  cudaFreeHost(h); cudaFree(dv); cudaStreamDestroy(st);
  return nullptr;
}

static volatile uint64_t sink;
static double run(int k, const uint32_t *src, int64_t n, uint16_t *ring, int64_t ring_elems, int threads, int64_t sub) {
  std::atomic<int64_t> next{0};
  const int64_t subs = (n + sub - 1) / sub;
  double t0 = now();
#pragma omp parallel num_threads(threads)
  {
    uint64_t acc = 0;
    for (;;) {
      int64_t j = next.fetch_add(1, std::memory_order_relaxed);
      if (j >= subs) break;
      int64_t b = j * sub, m = std::min(sub, n - b);
      uint16_t *d = ring + (b % ring_elems);
      switch (k) {
        case K_CUR: cvt_cur(src + b, d, m, 16384); break;
        case K_CUR_PF4K: cvt_cur(src + b, d, m, 4096); break;
        case K_CUR_PF64K: cvt_cur(src + b, d, m, 65536); break;
        case K_NOPF: cvt_cur(src + b, d, m, 0); break;
        case K_INTR: cvt_intr<0>(src + b, d, m, 16384); break;
        case K_INTR_PF4K: cvt_intr<0>(src + b, d, m, 4096); break;
        case K_INTR_NOPF: cvt_intr<0>(src + b, d, m, 0); break;
        case K_INTR_NT: cvt_intr<1>(src + b, d, m, 16384); break;
        case K_READ: acc += read_sum(src + b, m); break;
      }
    }
    sink += acc;
  }
  return n / (now() - t0) / 1e9;
}

int main(int argc, char **argv) {
  const int64_t n = (int64_t)1 << 27;  // 128 M elements, 512 MiB fp32
  const int64_t ring_elems = (64 << 20) / 2;
  int reps = argc > 1 ? atoi(argv[1]) : 5;
  uint32_t *srcs[2];
  for (int h = 0; h < 2; h++) {
    srcs[h] = (uint32_t *)aligned_alloc(2 << 20, n * 4);
    madvise(srcs[h], n * 4, h ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
    for (int64_t i = 0; i < n; i++) srcs[h][i] = (uint32_t)(i * 2654435761u) ;
  }
  uint16_t *ring = nullptr; int have_cuda = cudaHostAlloc((void **)&ring, ring_elems * 2, 0) == cudaSuccess;
  if (!have_cuda) ring = (uint16_t *)aligned_alloc(4096, ring_elems * 2);
  // correctness: every variant bitwise equal to the scalar rule (incl. NaN, denormals)
  {
    const int64_t m = 1 << 20;
    std::vector<uint16_t> ref(m);
    uint16_t *outp = (uint16_t *)aligned_alloc(64, m * 2);
    for (int64_t i = 0; i < m; i++) ref[i] = bf16_rne(srcs[0][i]);
    for (int k = 0; k < K_NK; k++) {
      if (k == K_READ) continue;
      std::fill(outp, outp + m, 0x1234);
      int64_t sub = 4160 + 32 * (k % 3); // NT stores need 64 B aligned rows
      for (int64_t b = 0; b < m; b += sub) {
        int64_t mm = std::min(sub, m - b);
        if (k == K_CUR || k == K_NOPF) cvt_cur(srcs[0] + b, outp + b, mm, k == K_CUR ? 16384 : 0);
        else if (k == K_INTR_NT) cvt_intr<1>(srcs[0] + b, outp + b, mm, 16384);
        else cvt_intr<0>(srcs[0] + b, outp + b, mm, 16384);
      }
      _mm_sfence();
      if (memcmp(ref.data(), outp, m * 2)) printf("MISMATCH %s\n", kname[k]);
    }
  }
  FILE *f = fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r");
  char thp[128] = "?"; if (f) { fgets(thp, sizeof thp, f); fclose(f); }
  printf("thp: %s", thp);
  int order[] = {K_CUR, K_INTR, K_NOPF, K_INTR_NOPF, K_INTR_NT, K_READ, K_CUR_PF4K, K_CUR_PF64K, K_INTR_PF4K};
  int thr_list[] = {16, 15, 12, 8};
  if (argc > 2) { thr_list[0] = thr_list[1] = thr_list[2] = thr_list[3] = atoi(argv[2]); }
  int64_t subs[] = {128 << 10, 1 << 20};
  for (int dma = 0; dma < 1 + have_cuda; dma++) {
    pthread_t th; int ready = 0;
    if (dma) { dma_stop = 0; pthread_create(&th, nullptr, dma_loop, &ready); while (!ready) ; }
    for (int hp = 0; hp < 2; hp++)
      for (int ti = 0; ti < 4; ti++)
        for (int si = 0; si < 2; si++) {
          if (si == 1 && (ti != 1 || hp)) continue;
          if (dma && ti >= 2) continue;
          std::vector<std::vector<double>> r(K_NK);
          long b0 = dma_bytes.load(); double w0 = now();
          for (int rep = 0; rep < reps; rep++)
            for (int k : order) {
              if (ti >= 2 && k != K_CUR && k != K_INTR && k != K_READ) continue;
              r[k].push_back(run(k, srcs[hp], n, ring, ring_elems, thr_list[ti], subs[si]));
            }
          double dma_rate = dma ? (dma_bytes.load() - b0) / (now() - w0) / 1e9 : 0;
          printf("dma=%d thp=%d threads=%d sub=%lld:", dma, hp, thr_list[ti], (long long)subs[si]);
          for (int k : order) {
            if (r[k].empty()) continue;
            std::sort(r[k].begin(), r[k].end());
            printf(" %s=%.2f", kname[k], r[k][r[k].size() / 2]);
          }
          if (dma) printf(" (dma %.1f GB/s)", dma_rate);
          printf("\n"); fflush(stdout);
        }
    if (dma) { dma_stop = 1; pthread_join(th, nullptr); }
  }
  return 0;
}
