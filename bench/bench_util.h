/* bench_util.h — helpers shared by the benchmarks: a clock and a
 * STREAM-style triad that measures the machine's memory bandwidth. */
#ifndef DUET_BENCH_UTIL_H
#define DUET_BENCH_UTIL_H

#include <pthread.h>
#include <stdlib.h>
#include <time.h>

static inline double bench_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

typedef struct bench_triad_part {
    double *a, *b, *c;
    size_t lo, hi;
} bench_triad_part;

static void *bench_triad_worker(void *arg) {
    bench_triad_part *p = arg;
    for (size_t i = p->lo; i < p->hi; i++)
        p->a[i] = p->b[i] + 3.0 * p->c[i];
    return NULL;
}

/* a[i] = b[i] + s*c[i] over three 64 MiB arrays with `threads` threads;
 * best of `reps`, in GB/s (24 bytes moved per element, as STREAM counts). */
static inline double bench_triad_gbs(int threads, int reps) {
    const size_t n = (64u << 20) / sizeof(double);
    double *a = malloc(n * sizeof *a), *b = malloc(n * sizeof *b), *c = malloc(n * sizeof *c);
    if (!a || !b || !c) return 0;
    for (size_t i = 0; i < n; i++)
        a[i] = 0, b[i] = 1, c[i] = 2;
    if (threads < 1) threads = 1;
    pthread_t tid[64];
    bench_triad_part parts[64];
    if (threads > 64) threads = 64;
    double best = 1e30;
    for (int r = 0; r < reps; r++) {
        double t0 = bench_now();
        for (int t = 0; t < threads; t++) {
            parts[t] = (bench_triad_part){a, b, c, n * t / threads, n * (t + 1) / threads};
            pthread_create(&tid[t], NULL, bench_triad_worker, &parts[t]);
        }
        for (int t = 0; t < threads; t++)
            pthread_join(tid[t], NULL);
        double dt = bench_now() - t0;
        if (dt < best) best = dt;
    }
    free(a);
    free(b);
    free(c);
    return 3.0 * n * sizeof(double) / best / 1e9;
}

static inline int bench_cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Median of n > 0 values (sorts v). */
static inline double bench_median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, bench_cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

#endif
