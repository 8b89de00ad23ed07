/* reshard C core: progress words (see reshard.h). A long call (a stage op filling a ring) runs
 * on one thread while another waits for part of its result; the waiter sleeps in the kernel
 * instead of spinning beside the threads doing the work. */
#if defined(__linux__) && !defined(_GNU_SOURCE)
#define _GNU_SOURCE /* syscall() */
#elif !defined(_POSIX_C_SOURCE)
#define _POSIX_C_SOURCE 200809L /* nanosleep() */
#endif
#include <stdint.h>
#include <time.h>

#include "reshard.h"

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#include <time.h>
#endif

static int32_t *seq_word(int64_t *p) {
  /* the low 32 bits of p[1] on either byte order */
  const int64_t one = 1;
  const int little = *(const char *)&one == 1;
  return (int32_t *)(void *)&p[1] + (little ? 0 : 1);
}

static void wake_all(int64_t *p) {
  int32_t *w = seq_word(p);
  __atomic_fetch_add(w, 1, __ATOMIC_RELEASE);
#if defined(__linux__)
  syscall(SYS_futex, w, FUTEX_WAKE_PRIVATE, INT32_MAX, NULL, NULL, 0);
#endif
}

void rs_progress_set(int64_t *p, int64_t value) {
  __atomic_store_n(&p[0], value, __ATOMIC_RELEASE);
  wake_all(p);
}

void rs_progress_publish(int64_t *p, int64_t amount) {
  const int64_t base = __atomic_load_n(&p[2], __ATOMIC_RELAXED);
  const int64_t scale = __atomic_load_n(&p[3], __ATOMIC_RELAXED);
  rs_progress_set(p, base + amount * scale);
}

static int64_t now_ns(void) {
  struct timespec ts;
  timespec_get(&ts, TIME_UTC);
  return (int64_t)ts.tv_sec * 1000000000 + (int64_t)ts.tv_nsec;
}

static void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause(); /* leaves the core's other hardware thread its share while polling */
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

int64_t rs_progress_wait(int64_t *p, int64_t at_least, int64_t timeout_ns, int64_t spin_ns) {
  const int64_t start = now_ns();
  const int64_t deadline = start + (timeout_ns > 0 ? timeout_ns : 0);
  const int64_t spin_end = start + (spin_ns > 0 ? spin_ns : 0);
  int32_t *w = seq_word(p);
  for (;;) {
    /* the sequence first: a publish after this read changes it, so the sleep below returns */
    const int32_t seen = __atomic_load_n(w, __ATOMIC_ACQUIRE);
    const int64_t v = __atomic_load_n(&p[0], __ATOMIC_ACQUIRE);
    if (v >= at_least || v < 0) return v;
    const int64_t now = now_ns();
    const int64_t left = deadline - now;
    if (left <= 0) return v;
    if (now < spin_end) {
      for (int i = 0; i < 64; ++i) cpu_relax();
      continue;
    }
#if defined(__linux__)
    struct timespec ts = {(time_t)(left / 1000000000), (long)(left % 1000000000)};
    syscall(SYS_futex, w, FUTEX_WAIT_PRIVATE, seen, &ts, NULL, 0);
#else
    (void)seen;
    struct timespec ts = {0, left < 50000 ? (long)left : 50000L};
    nanosleep(&ts, NULL);
#endif
  }
}
