/* cpu_threadpool.c — a persistent pool with a cheap fork/join.
 *
 * Decode runs ~150 small ops per token, so a dispatch must cost about a
 * microsecond: workers spin on a sequence number for a while after each
 * task (the next op usually follows within microseconds), then sleep on a
 * futex so an idle engine burns no CPU.
 *
 * A task is cut into chunks that every thread, the caller included, claims
 * with a CAS on one word holding (task sequence, chunk count, next chunk). The caller
 * never waits for a worker to show up: on a busy machine where a worker is
 * descheduled, the caller runs the remaining chunks itself, and the join
 * waits only for chunks already started. A late worker that read the fields
 * of an old task fails its CAS (the sequence moved) and runs nothing. */
#include <errno.h>
#include <limits.h>
#include <sched.h>
#include <stdlib.h>
#include <time.h>

#include "cpu_internal.h"

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#error "the cpu backend's thread pool uses Linux futexes"
#endif

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ __volatile__("yield")
#else
#define cpu_relax() ((void)0)
#endif

/* How long a waiter spins before it sleeps. Workers wait for the next op:
 * long enough to cover the gap between two ops of a forward pass (host-side
 * work, small inline ops), short enough that an idle engine goes quiet. The
 * caller waits for workers of the same op, which finish within microseconds
 * of it unless one was descheduled; then it should give up its core soon. */
#define CPU_WORKER_SPIN_NS 1000000LL
#define CPU_CALLER_SPIN_NS 200000LL
/* After this long a spinner yields on every round: when the machine is
 * oversubscribed, the thread we wait for may be queued behind us. */
#define CPU_PURE_SPIN_NS 50000LL

static void futex_wait(_Atomic uint32_t *addr, uint32_t expected) {
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT_PRIVATE, expected, NULL, NULL, 0);
}

static void futex_wake(_Atomic uint32_t *addr) {
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Spins until *addr != value or budget_ns runs out; returns the last value
 * seen. The clock is read every 64 rounds only. */
static uint32_t spin_while_equal(_Atomic uint32_t *addr, uint32_t value, int64_t budget_ns) {
    int64_t start = 0;
    bool yielding = false;
    for (unsigned i = 1;; i++) {
        uint32_t v = atomic_load_explicit(addr, memory_order_acquire);
        if (v != value) return v;
        if (yielding)
            sched_yield();
        else
            cpu_relax();
        if ((i & 63) == 0) {
            int64_t t = now_ns();
            if (start == 0)
                start = t;
            else if (t - start > budget_ns)
                return v;
            else
                yielding = t - start > CPU_PURE_SPIN_NS;
        }
    }
}

typedef struct worker_arg {
    cpu_pool *pool;
    int id;
} worker_arg;

void (*duet__cpu_pool_delay_hook)(int where);

static inline void delay_point(int where) {
    void (*hook)(int) = duet__cpu_pool_delay_hook;
    if (hook) hook(where);
}

static inline uint64_t claim_word(uint32_t seq, int n_chunks, int next) {
    return (uint64_t)seq << 32 | (uint64_t)(uint32_t)n_chunks << 16 | (uint32_t)next;
}

/* Claims and runs chunks of task `seq` until none is left. */
static void run_chunks(cpu_pool *pool, uint32_t seq, int worker) {
    for (;;) {
        uint64_t c = atomic_load_explicit(&pool->claim, memory_order_acquire);
        if ((uint32_t)(c >> 32) != seq) return; /* a newer task: caller is done with ours */
        const int n = (int)(c >> 16 & 0xffff), chunk = (int)(c & 0xffff);
        if (chunk >= n) return;
        cpu_task_fn fn = atomic_load_explicit(&pool->fn, memory_order_relaxed);
        void *ctx = atomic_load_explicit(&pool->ctx, memory_order_relaxed);
        delay_point(1);
        /* Success proves the word was still (seq, n, chunk): chunk was
         * unclaimed, so task seq could not have finished and the next task
         * could not have been published; fn and ctx read above are seq's. */
        if (!atomic_compare_exchange_weak_explicit(&pool->claim, &c, c + 1, memory_order_acq_rel,
                                                   memory_order_relaxed))
            continue;
        fn(ctx, chunk, n, worker);
        delay_point(2);
        /* seq_cst, like the caller's caller_waiting store then done load:
         * either it sees our increment or we see it waiting. */
        uint32_t done = atomic_fetch_add(&pool->done, 1) + 1;
        if (done == (uint32_t)n && worker != 0 && atomic_load(&pool->caller_waiting)) futex_wake(&pool->done);
    }
}

static void *worker_main(void *p) {
    worker_arg arg = *(worker_arg *)p;
    free(p);
    cpu_pool *pool = arg.pool;
    /* gen is 0 when the pool starts; reading it here instead could skip a
     * task dispatched before this thread got going. */
    uint32_t seen = 0;
    for (;;) {
        uint32_t g = spin_while_equal(&pool->gen, seen, CPU_WORKER_SPIN_NS);
        while (g == seen) {
            /* Announce the sleep before re-checking: the caller bumps gen and
             * then reads sleepers (both seq_cst), so one of us sees the other. */
            atomic_fetch_add(&pool->sleepers, 1);
            g = atomic_load(&pool->gen);
            if (g == seen) futex_wait(&pool->gen, seen);
            atomic_fetch_sub(&pool->sleepers, 1);
            g = atomic_load_explicit(&pool->gen, memory_order_acquire);
        }
        seen = g;
        if (atomic_load_explicit(&pool->stop, memory_order_acquire)) break;
        run_chunks(pool, g, arg.id);
    }
    return NULL;
}

duet_status duet__cpu_pool_init(cpu_pool *pool, int n_threads) {
    *pool = (cpu_pool){.n_threads = n_threads < 1 ? 1 : n_threads};
    pthread_mutex_init(&pool->run_mu, NULL);
    if (pool->n_threads == 1) return DUET_OK;
    pool->threads = calloc((size_t)pool->n_threads, sizeof(pthread_t));
    if (!pool->threads) return duet__error(DUET_OUT_OF_MEMORY, "cpu: thread pool");
    for (int i = 1; i < pool->n_threads; i++) {
        worker_arg *arg = malloc(sizeof *arg);
        if (arg) *arg = (worker_arg){pool, i};
        int rc = arg ? pthread_create(&pool->threads[i], NULL, worker_main, arg) : ENOMEM;
        if (rc != 0) {
            free(arg);
            pool->n_threads = i; /* stop the ones already started */
            duet__cpu_pool_free(pool);
            return duet__error(DUET_OUT_OF_MEMORY, "cpu: cannot start worker thread %d (error %d)", i, rc);
        }
    }
    return DUET_OK;
}

void duet__cpu_pool_free(cpu_pool *pool) {
    if (pool->threads) {
        atomic_store(&pool->stop, 1);
        atomic_fetch_add(&pool->gen, 1);
        futex_wake(&pool->gen);
        for (int i = 1; i < pool->n_threads; i++)
            pthread_join(pool->threads[i], NULL);
        free(pool->threads);
    }
    pthread_mutex_destroy(&pool->run_mu);
    *pool = (cpu_pool){0};
}

void duet__cpu_pool_run(cpu_pool *pool, int n_chunks, cpu_task_fn fn, void *ctx) {
    if (n_chunks <= 1 || pool->n_threads == 1) {
        for (int c = 0; c < n_chunks; c++)
            fn(ctx, c, n_chunks, 0);
        return;
    }
    if (n_chunks > CPU_POOL_MAX_CHUNKS) n_chunks = CPU_POOL_MAX_CHUNKS;
    /* One task at a time: streams sharing the pool take turns, task by task. */
    pthread_mutex_lock(&pool->run_mu);
    /* Publish the task: fields first, then the claim word (release), then
     * gen (seq_cst) for the workers that spin or sleep on it. */
    uint32_t seq = atomic_load_explicit(&pool->gen, memory_order_relaxed) + 1;
    atomic_store_explicit(&pool->fn, fn, memory_order_relaxed);
    atomic_store_explicit(&pool->ctx, ctx, memory_order_relaxed);
    atomic_store_explicit(&pool->done, 0, memory_order_relaxed);
    delay_point(0);
    atomic_store_explicit(&pool->claim, claim_word(seq, n_chunks, 0), memory_order_release);
    atomic_store(&pool->gen, seq);
    if (atomic_load(&pool->sleepers) > 0) futex_wake(&pool->gen);

    run_chunks(pool, seq, 0);

    /* Join: wait for chunks that workers claimed and are still running.
     * Spin through progress; sleep when a worker seems descheduled. */
    uint32_t d;
    while ((d = atomic_load_explicit(&pool->done, memory_order_acquire)) != (uint32_t)n_chunks) {
        uint32_t e = spin_while_equal(&pool->done, d, CPU_CALLER_SPIN_NS);
        if (e != d) continue;
        atomic_store(&pool->caller_waiting, 1);
        if (atomic_load(&pool->done) == d) futex_wait(&pool->done, d);
        atomic_store(&pool->caller_waiting, 0);
    }
    pthread_mutex_unlock(&pool->run_mu);
}
