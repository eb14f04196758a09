/* test_cpu_threadpool.c — the cpu backend's fork/join pool under stress.
 *
 * Each task lives on the caller's stack, as the real ops' contexts do, and
 * is poisoned when duet__cpu_pool_run returns: a chunk run twice, a chunk
 * of one task run with another task's count, a chunk run after the join,
 * or a join that never ends is caught. A test-only hook injects delays at
 * the points where a descheduled thread exposes races (between publishing
 * a task's fields and its claim word, between a worker's read of the claim
 * and its CAS), so interleavings that take hours of real load to happen
 * happen within seconds. DUET_POOL_STRESS_TASKS sets the task count (the
 * default is CI's; the 10 million runs as a benchmark). */
#include <stdatomic.h>
#include <time.h>

#include "../backends/cpu/cpu_internal.h"
#include "test_util.h"

#define MAX_CHUNKS 24

typedef struct stress_task {
    _Atomic int alive; /* 1 while the caller is inside duet__cpu_pool_run */
    int n_chunks;
    _Atomic int ran[MAX_CHUNKS];
} stress_task;

static _Atomic long bad_calls; /* chunks run on a dead task or with a wrong count */

static void stress_fn(void *p, int chunk, int n_chunks, int worker) {
    (void)worker;
    stress_task *t = p;
    if (atomic_load(&t->alive) != 1 || n_chunks != t->n_chunks || chunk < 0 || chunk >= t->n_chunks) {
        atomic_fetch_add(&bad_calls, 1);
        return;
    }
    atomic_fetch_add(&t->ran[chunk], 1);
}

/* xorshift per thread: the hook runs on every thread. */
static _Thread_local uint32_t rng_state;
static uint32_t rng(void) {
    if (!rng_state) rng_state = (uint32_t)(uintptr_t)&rng_state | 1u;
    rng_state ^= rng_state << 13, rng_state ^= rng_state >> 17, rng_state ^= rng_state << 5;
    return rng_state;
}

static void spin_ns(long ns) {
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    do
        clock_gettime(CLOCK_MONOTONIC, &b);
    while ((b.tv_sec - a.tv_sec) * 1000000000L + (b.tv_nsec - a.tv_nsec) < ns);
}

/* A few microseconds at one call in 16: often enough to hit every window,
 * rarely enough that millions of tasks take seconds. */
static void delay_hook(int where) {
    (void)where;
    if ((rng() & 15) == 0) spin_ns(1000 + (long)(rng() % 5000));
}

static long stress_tasks(void) {
    const char *e = getenv("DUET_POOL_STRESS_TASKS");
    long n = e ? atol(e) : 0;
    return n > 0 ? n : 300000;
}

/* Runs `n` tasks of 2..MAX_CHUNKS chunks on a pool of `threads` and checks
 * each chunk ran exactly once, while the task was alive. */
static void stress(int threads, long n, bool delays) {
    cpu_pool pool;
    ck_assert_int_eq(duet__cpu_pool_init(&pool, threads), DUET_OK);
    duet__cpu_pool_delay_hook = delays ? delay_hook : NULL;
    atomic_store(&bad_calls, 0);
    long miscounted = 0;
    for (long i = 0; i < n; i++) {
        stress_task t;
        atomic_init(&t.alive, 1);
        t.n_chunks = 2 + (int)(rng() % (MAX_CHUNKS - 1));
        for (int c = 0; c < MAX_CHUNKS; c++)
            atomic_init(&t.ran[c], 0);
        duet__cpu_pool_run(&pool, t.n_chunks, stress_fn, &t);
        for (int c = 0; c < t.n_chunks; c++)
            if (atomic_load(&t.ran[c]) != 1) miscounted++;
        /* Poison: a worker still using this task after the join counts as bad. */
        atomic_store(&t.alive, 0);
        t.n_chunks = -1;
    }
    duet__cpu_pool_delay_hook = NULL;
    duet__cpu_pool_free(&pool);
    ck_assert_msg(
        miscounted == 0 && atomic_load(&bad_calls) == 0,
        "%d threads, %ld tasks%s: %ld chunks not run exactly once, %ld chunks run on a finished task "
        "or with another task's chunk count",
        threads, n, delays ? " with delays" : "", miscounted, atomic_load(&bad_calls));
    printf("pool stress: %d threads, %ld tasks%s: ok\n", threads, n, delays ? " with injected delays" : "");
}

START_TEST(test_pool_stress_delays) {
    /* Three threads on a 2-core machine: oversubscribed on purpose. */
    stress(3, stress_tasks(), true);
}
END_TEST

START_TEST(test_pool_stress_plain) {
    stress(2, stress_tasks() / 2, false);
    stress(4, stress_tasks() / 4, false);
}
END_TEST

static void fn_cap(void *ctx, int chunk, int n, int worker) {
    (void)chunk, (void)worker;
    atomic_store((_Atomic int *)ctx, n);
}

/* A task cut finer than the claim word holds runs with the capped count. */
START_TEST(test_pool_chunk_cap) {
    cpu_pool pool;
    ck_assert_int_eq(duet__cpu_pool_init(&pool, 2), DUET_OK);
    static _Atomic int seen_n;
    atomic_store(&seen_n, 0);
    duet__cpu_pool_run(&pool, 100000, fn_cap, (void *)&seen_n);
    duet__cpu_pool_free(&pool);
    ck_assert_int_eq(atomic_load(&seen_n), CPU_POOL_MAX_CHUNKS);
}
END_TEST

int main(void) {
    Suite *s = suite_create("cpu_threadpool");
    TCase *tc = tcase_create("pool");
    /* A hang (the join waiting for a chunk that was counted twice or
     * never) shows as this timeout: ~10 us a task is ample. */
    tcase_set_timeout(tc, 60.0 + (double)stress_tasks() * 2e-5);
    tcase_add_test(tc, test_pool_stress_delays);
    tcase_add_test(tc, test_pool_stress_plain);
    tcase_add_test(tc, test_pool_chunk_cap);
    suite_add_tcase(s, tc);
    return test_run_suite(s);
}
