/* Host-side probes for pinned_cause_probe.py: dependent-load latency and a threaded gather of
 * fixed-size runs, run on whichever buffer the caller passes. Built on the GPU machine with
 * `gcc -O2 -fopenmp -shared -fPIC probe.c -o libprobe.so`. */
#include <omp.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Writes a cyclic chain through buf at the given byte offsets (each slot holds the next
 * slot's offset), then follows it for `steps` dependent loads. Returns ns per load. */
double chase(char *buf, const int64_t *offs, int64_t n, int64_t steps) {
  for (int64_t i = 0; i < n; ++i) *(int64_t *)(buf + offs[i]) = offs[(i + 1) % n];
  int64_t o = offs[0];
  for (int64_t i = 0; i < n; ++i) o = *(volatile int64_t *)(buf + o); /* warm once */
  const double t = now();
  for (int64_t i = 0; i < steps; ++i) o = *(volatile int64_t *)(buf + o);
  const double dt = now() - t;
  return o == -1 ? -1.0 : 1e9 * dt / (double)steps;
}

/* dst[i * run .. +run] = src[offs[i] .. +run] for i < n on `threads` threads (static split),
 * touching the first 4 lines of run i + dist before copying run i (dist 0: no prefetch).
 * Returns seconds. */
double gather(char *dst, const char *src, const int64_t *offs, int64_t n, int64_t run, int dist,
              int threads) {
  const double t = now();
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t i = 0; i < n; ++i) {
    if (dist > 0 && i + dist < n) {
      const char *q = src + offs[i + dist];
      __builtin_prefetch(q, 0);
      __builtin_prefetch(q + 64, 0);
      __builtin_prefetch(q + 128, 0);
      __builtin_prefetch(q + 192, 0);
    }
    memcpy(dst + i * run, src + offs[i], (size_t)run);
  }
  return now() - t;
}

/* The same, scattering: dst[offs[i] ..] = src[i * run ..]. */
double scatter(char *dst, const char *src, const int64_t *offs, int64_t n, int64_t run, int dist,
               int threads) {
  const double t = now();
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t i = 0; i < n; ++i) {
    if (dist > 0 && i + dist < n) {
      char *q = dst + offs[i + dist];
      __builtin_prefetch(q, 1);
      __builtin_prefetch(q + 64, 1);
      __builtin_prefetch(q + 128, 1);
      __builtin_prefetch(q + 192, 1);
    }
    memcpy(dst + offs[i], src + i * run, (size_t)run);
  }
  return now() - t;
}
