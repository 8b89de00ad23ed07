/* Progress words (csrc/progress.c): a producer thread publishes, waiters sleep until they see
 * what they need; run under ASan/UBSan by `make ctest`. */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <time.h>

#include "reshard.h"

static int failures = 0;
#define CHECK(cond, ...)                                   \
  do {                                                     \
    if (!(cond)) {                                         \
      fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
      fprintf(stderr, __VA_ARGS__);                        \
      fprintf(stderr, "\n");                               \
      ++failures;                                          \
    }                                                      \
  } while (0)

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void sleep_us(long us) {
  struct timespec ts = {0, us * 1000};
  nanosleep(&ts, NULL);
}

enum { STEPS = 200 };
/* what the producer wrote before publishing step i: a waiter that sees value >= i must see it */
static int64_t payload[STEPS + 1];
/* how long waiters poll before sleeping (both paths must see every payload) */
static int64_t a_spin_ns = 0;

typedef struct {
  int64_t *p;
  int64_t final_value; /* published after the last step (negative: a failure) */
} producer_arg;

static void *producer(void *arg) {
  producer_arg *a = arg;
  for (int64_t i = 1; i <= STEPS; ++i) {
    payload[i] = i * 7;
    rs_progress_publish(a->p, i); /* base 0, scale 1 */
    if (i % 16 == 0) sleep_us(200);
  }
  rs_progress_set(a->p, a->final_value);
  return NULL;
}

static void *waiter(void *arg) {
  int64_t *p = arg;
  int64_t need = 1;
  while (need <= STEPS) {
    const int64_t v = rs_progress_wait(p, need, 5000000000LL, a_spin_ns);
    if (v < 0) break; /* final failure value */
    CHECK(v >= need, "woke with %lld before %lld (no timeout expected)", (long long)v,
          (long long)need);
    if (v < need) break;
    const int64_t top = v > STEPS ? STEPS : v;
    for (int64_t i = need; i <= top; ++i)
      CHECK(payload[i] == i * 7, "step %lld published before its payload", (long long)i);
    need = top + 1;
  }
  return NULL;
}

static void run_threads(int64_t final_value) {
  int64_t p[RS_PROGRESS_WORDS] = {0, 0, 0, 1};
  for (int i = 0; i <= STEPS; ++i) payload[i] = 0;
  pthread_t prod, w[3];
  for (int i = 0; i < 3; ++i) pthread_create(&w[i], NULL, waiter, p);
  producer_arg a = {p, final_value};
  pthread_create(&prod, NULL, producer, &a);
  pthread_join(prod, NULL);
  for (int i = 0; i < 3; ++i) pthread_join(w[i], NULL);
  CHECK(p[0] == final_value, "final value %lld, expected %lld", (long long)p[0],
        (long long)final_value);
}

int main(void) {
  /* base and scale: value = base + amount * scale */
  int64_t p[RS_PROGRESS_WORDS] = {0, 0, 1000, 2};
  rs_progress_publish(p, 5);
  CHECK(p[0] == 1010, "publish: %lld", (long long)p[0]);
  CHECK(rs_progress_wait(p, 1010, 0, 0) == 1010, "reached: returns the value at once");

  /* a wait that is not met returns the value once its timeout passed, not earlier */
  const int64_t t0 = now_ns();
  const int64_t v = rs_progress_wait(p, 2000, 20000000LL, 0); /* 20 ms */
  const int64_t waited = now_ns() - t0;
  CHECK(v == 1010, "timeout: %lld", (long long)v);
  CHECK(waited >= 19000000LL, "timeout returned after %lld ns", (long long)waited);
  CHECK(rs_progress_wait(p, 2000, 0, 0) == 1010, "zero timeout: returns at once");
  CHECK(rs_progress_wait(p, 2000, -5, 0) == 1010, "negative timeout: returns at once");

  /* a negative value is final: waiters return it whatever they need */
  rs_progress_set(p, -1);
  CHECK(rs_progress_wait(p, 1, 1000000000LL, 0) == -1, "negative: returned at once");

  /* polling: a value reached during the poll returns it; the timeout still bounds the wait */
  const int64_t t1 = now_ns();
  CHECK(rs_progress_wait(p, -1, 20000000LL, 50000000LL) == -1, "polling: returns at once");
  rs_progress_set(p, 5);
  CHECK(rs_progress_wait(p, 6, 20000000LL, 50000000LL) == 5, "polling past the timeout");
  const int64_t polled = now_ns() - t1;
  CHECK(polled >= 19000000LL && polled < 45000000LL, "poll of 50 ms, timeout 20 ms: %lld ns",
        (long long)polled);

  for (int spin = 0; spin < 2; ++spin) {
    a_spin_ns = spin ? 300000 : 0; /* the producer pauses 200 us every 16 steps */
    run_threads(STEPS);
    run_threads(-1);
  }

  if (failures) {
    fprintf(stderr, "test_progress: %d failures\n", failures);
    return 1;
  }
  printf("test_progress: ok\n");
  return 0;
}
