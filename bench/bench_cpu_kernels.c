/* bench_cpu_kernels.c — the cpu backend's kernels against the machine's
 * memory bandwidth.
 *
 * 1. STREAM-style triad a[i] = b[i] + s*c[i] on doubles (24 bytes moved per
 *    element, as STREAM counts), arrays larger than the last-level cache,
 *    with the benchmark's thread count: the bandwidth roof.
 * 2. Matrix-vector (decode, one token) for q8_0, f16 and f32 weights at
 *    Llama-ish shapes, cycling through distinct matrices in a pool several
 *    times the cache so every weight comes from memory: weight GB/s and its
 *    fraction of the triad.
 * 3. Prefill matmul (64 and 128 tokens): GFLOP/s.
 * 4. Batched q8_0 matmul at the 125m shapes for 1..128 tokens (batched
 *    decode runs every matmul with one token per sequence): GFLOP/s with f32
 *    x (quantised inside the op) and with pre-quantised x_q8.
 * 5. Per-op overhead of a tiny inline op and of a small threaded matvec.
 *
 * usage: bench_cpu_kernels [--threads N] [--json] [--pool-mib N] [--triad-mib N] [--quick] [--batched]
 *   --batched runs section 4 only.
 */
#include <cjson/cJSON.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "backend.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void die(const char *what) {
    fprintf(stderr, "bench_cpu_kernels: %s: %s\n", what, duet_last_error());
    exit(1);
}

/* ---- triad ------------------------------------------------------------------ */

typedef struct triad_part {
    double *a, *b, *c;
    size_t lo, hi;
    bool init;
} triad_part;

static void *triad_worker(void *p) {
    triad_part *t = p;
    if (t->init) /* first touch by the thread that streams the part */
        for (size_t i = t->lo; i < t->hi; i++) t->a[i] = 0, t->b[i] = 1, t->c[i] = 2;
    else
        for (size_t i = t->lo; i < t->hi; i++) t->a[i] = t->b[i] + 3.0 * t->c[i];
    return NULL;
}

static void triad_pass(double *a, double *b, double *c, size_t n, int threads, bool init) {
    pthread_t tid[256];
    triad_part parts[256];
    for (int t = 0; t < threads; t++) {
        parts[t] = (triad_part){a, b, c, n * t / threads, n * (t + 1) / threads, init};
        if (t > 0) pthread_create(&tid[t], NULL, triad_worker, &parts[t]);
    }
    triad_worker(&parts[0]);
    for (int t = 1; t < threads; t++) pthread_join(tid[t], NULL);
}

static double triad_gbs(size_t mib, int threads, int reps) {
    size_t n = (mib << 20) / sizeof(double);
    double *a = malloc(n * sizeof *a), *b = malloc(n * sizeof *b), *c = malloc(n * sizeof *c);
    if (!a || !b || !c) {
        fprintf(stderr, "bench_cpu_kernels: triad: out of memory\n");
        exit(1);
    }
    triad_pass(a, b, c, n, threads, true);
    double best = 1e30;
    for (int r = 0; r < reps; r++) {
        double t0 = now_s();
        triad_pass(a, b, c, n, threads, false);
        double dt = now_s() - t0;
        if (dt < best) best = dt;
    }
    volatile double sink = a[n / 2];
    (void)sink;
    free(a), free(b), free(c);
    return 3.0 * (double)n * sizeof(double) / best / 1e9;
}

/* ---- matmul runs ---------------------------------------------------------------- */

typedef struct bench_ctx {
    duet_backend *be;
    duet_buffer *pool; /* weights: every 16-bit word 0x3c00 | random -> normal floats in any dtype */
    size_t pool_bytes;
    duet_buffer *x, *xq, *out; /* xq: x quantised to q8_0 blocks, for x_q8 */
    int max_tokens, max_in, max_out;
} bench_ctx;

/* Runs `iters` matmuls in one step (as a forward pass does), weights
 * starting at pool offsets `stride` apart (cycling), and returns seconds. */
static double run_matmuls_x(bench_ctx *b, duet_dtype dt, int n_out, int n_in, int n_tokens, size_t stride,
                            int n_mats, int iters, bool x_q8) {
    duet_op op = {.kind = DUET_OP_MATMUL, .n_tokens = n_tokens};
    op.matmul.dtype = dt;
    if (x_q8)
        op.matmul.x_q8 = (duet_view){b->xq, 0};
    else
        op.matmul.x = (duet_view){b->x, 0};
    op.matmul.n_in = n_in;
    op.matmul.n_out = n_out;
    op.matmul.out = (duet_view){b->out, 0};
    if (duet_step_begin(b->be)) die("begin");
    double t0 = now_s();
    for (int i = 0; i < iters; i++) {
        op.matmul.w = (duet_view){b->pool, (size_t)(i % n_mats) * stride};
        if (duet_step_op(b->be, &op)) die("matmul");
    }
    if (duet_step_submit(b->be) || duet_step_wait(b->be)) die("submit");
    return now_s() - t0;
}

static double run_matmuls(bench_ctx *b, duet_dtype dt, int n_out, int n_in, int n_tokens, size_t stride,
                          int n_mats, int iters) {
    return run_matmuls_x(b, dt, n_out, n_in, n_tokens, stride, n_mats, iters, false);
}

typedef struct mv_result {
    const char *dtype;
    int n_out, n_in;
    double gbs, frac;
    double us_per_op;
} mv_result;

/* Matrix-vector with cold weights: distinct matrices filling the pool, one
 * pass through all of them at least, best of three timed passes. */
static mv_result bench_matvec(bench_ctx *b, duet_dtype dt, int n_out, int n_in, double triad, double min_s) {
    size_t bytes = duet_dtype_row_bytes(dt, n_in) * (size_t)n_out;
    size_t stride = (bytes + 4095) & ~(size_t)4095;
    int n_mats = (int)(b->pool_bytes / stride);
    if (n_mats < 1) n_mats = 1;
    /* Iterations for at least min_s and at least one cycle of the pool. */
    double t = run_matmuls(b, dt, n_out, n_in, 1, stride, n_mats, n_mats); /* warm-up cycle */
    int iters = (int)(min_s / (t / n_mats)) + 1;
    if (iters < n_mats) iters = n_mats;
    double best = 1e30;
    for (int r = 0; r < 3; r++) {
        double s = run_matmuls(b, dt, n_out, n_in, 1, stride, n_mats, iters) / iters;
        if (s < best) best = s;
    }
    mv_result m = {duet_dtype_name(dt), n_out, n_in, bytes / best / 1e9, 0, best * 1e6};
    m.frac = m.gbs / triad;
    return m;
}

typedef struct pf_result {
    const char *dtype;
    int n_out, n_in, n_tokens;
    double gflops;
} pf_result;

/* Prefill: weights reused across tokens, so arithmetic bound: GFLOP/s. */
static pf_result bench_prefill(bench_ctx *b, duet_dtype dt, int n_out, int n_in, int n_tokens, double min_s) {
    double flop = 2.0 * n_tokens * (double)n_in * n_out;
    double t = run_matmuls(b, dt, n_out, n_in, n_tokens, 0, 1, 1);
    int iters = (int)(min_s / t) + 1;
    double best = 1e30;
    for (int r = 0; r < 3; r++) {
        double s = run_matmuls(b, dt, n_out, n_in, n_tokens, 0, 1, iters) / iters;
        if (s < best) best = s;
    }
    return (pf_result){duet_dtype_name(dt), n_out, n_in, n_tokens, flop / best / 1e9};
}

typedef struct bt_result {
    int n_out, n_in, n_tokens;
    double gflops_f32x, gflops_xq8;
} bt_result;

/* Batched decode: hot weights (one matrix; the 125m model's weights fit
 * the last-level cache too), median of 5 timed runs each way. */
static double median5(double *v) {
    for (int i = 1; i < 5; i++)
        for (int j = i; j > 0 && v[j] < v[j - 1]; j--) {
            double t = v[j];
            v[j] = v[j - 1], v[j - 1] = t;
        }
    return v[2];
}

static bt_result bench_batched(bench_ctx *b, int n_out, int n_in, int n_tokens, double min_s) {
    double flop = 2.0 * n_tokens * (double)n_in * n_out;
    bt_result r = {n_out, n_in, n_tokens, 0, 0};
    for (int q = 0; q < 2; q++) {
        double t = run_matmuls_x(b, DUET_DTYPE_Q8_0, n_out, n_in, n_tokens, 0, 1, 1, q);
        int iters = (int)(min_s / 5 / t) + 1;
        double s[5];
        for (int i = 0; i < 5; i++)
            s[i] = run_matmuls_x(b, DUET_DTYPE_Q8_0, n_out, n_in, n_tokens, 0, 1, iters, q) / iters;
        *(q ? &r.gflops_xq8 : &r.gflops_f32x) = flop / median5(s) / 1e9;
    }
    return r;
}

/* Per-op cost of a tiny op (runs inline) and of a hot threaded matvec. */
static double bench_op_overhead_us(bench_ctx *b, bool threaded) {
    duet_op op;
    if (threaded) {
        op = (duet_op){.kind = DUET_OP_MATMUL, .n_tokens = 1};
        op.matmul.w = (duet_view){b->pool, 0};
        op.matmul.dtype = DUET_DTYPE_Q8_0;
        op.matmul.x = (duet_view){b->x, 0};
        op.matmul.n_in = 256;
        op.matmul.n_out = 256; /* 64 KiB of weights: in L2, so dispatch dominates */
        op.matmul.out = (duet_view){b->out, 0};
    } else {
        op = (duet_op){.kind = DUET_OP_ADD, .n_tokens = 1};
        op.add.a = op.add.b = op.add.out = (duet_view){b->out, 0};
        op.add.dim = 16;
    }
    const int iters = 20000;
    double best = 1e30;
    for (int r = 0; r < 3; r++) {
        if (duet_step_begin(b->be)) die("begin");
        double t0 = now_s();
        for (int i = 0; i < iters; i++)
            if (duet_step_op(b->be, &op)) die("op");
        double dt = now_s() - t0;
        if (duet_step_submit(b->be)) die("submit");
        if (dt < best) best = dt;
    }
    return best / iters * 1e6;
}

int main(int argc, char **argv) {
    int threads = 2, pool_mib = 1024, triad_mib = 0;
    bool json = false, quick = false, batched_only = false;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--threads") == 0 && i + 1 < argc) threads = atoi(argv[++i]);
        else if (strcmp(argv[i], "--pool-mib") == 0 && i + 1 < argc) pool_mib = atoi(argv[++i]);
        else if (strcmp(argv[i], "--triad-mib") == 0 && i + 1 < argc) triad_mib = atoi(argv[++i]);
        else if (strcmp(argv[i], "--json") == 0) json = true;
        else if (strcmp(argv[i], "--quick") == 0) quick = true;
        else if (strcmp(argv[i], "--batched") == 0) batched_only = true;
        else {
            fprintf(stderr,
                    "usage: %s [--threads N] [--json] [--pool-mib N] [--triad-mib N] [--quick] [--batched]\n"
                    "  --threads N    worker threads (default 2)\n"
                    "  --pool-mib N   weight pool cycled by the matvec runs (default 1024)\n"
                    "  --triad-mib N  size of each triad array (default: max(64, last-level cache))\n"
                    "  --quick        shorter runs (smoke test)\n"
                    "  --batched      only the batched q8_0 matmuls\n",
                    argv[0]);
            return 2;
        }
    }
    if (threads < 1 || threads > 256 || pool_mib < 16) {
        fprintf(stderr, "bench_cpu_kernels: bad --threads or --pool-mib\n");
        return 2;
    }
    if (quick && pool_mib == 1024) pool_mib = 256;
    /* Each triad array at least as big as the last-level cache, so the
     * triad measures memory, not cache (this VM reports 300 MiB of L3). */
    if (triad_mib <= 0) {
        long llc = sysconf(_SC_LEVEL3_CACHE_SIZE);
        triad_mib = llc > (64L << 20) ? (int)((llc + (1 << 20) - 1) >> 20) : 64;
        if (triad_mib > 1024) triad_mib = 1024;
    }
    double min_s = quick ? 0.05 : 0.25;

    double triad = batched_only ? 0.0 : triad_gbs((size_t)triad_mib, threads, quick ? 3 : 8);

    duet_backend_params params = {.n_threads = threads};
    bench_ctx b = {.pool_bytes = (size_t)pool_mib << 20, .max_tokens = 128, .max_in = 8192, .max_out = 32000};
    if (duet_backend_open("cpu", 0, &params, &b.be)) die("open cpu backend");
    if (duet_buffer_alloc(b.be, b.pool_bytes, &b.pool)) die("weight pool");
    uint16_t *pool = b.be->iface->buffer_host_ptr(b.be, b.pool);
    uint32_t r = 12345;
    for (size_t i = 0; i < b.pool_bytes / 2; i++) {
        r = r * 1664525u + 1013904223u;
        pool[i] = (uint16_t)(0x3c00 | (r >> 22));
    }
    size_t xn = (size_t)b.max_tokens * b.max_in;
    float *x = malloc(xn * sizeof(float));
    for (size_t i = 0; i < xn; i++) x[i] = (float)((i * 7919) % 2001) / 1000.0f - 1.0f;
    /* The same values as q8_0 blocks for x_q8 (rows of max_in, so a row
     * of n_in < max_in reads the start of its row: fine for timing). */
    size_t xqn = xn / DUET_QK8_0;
    duet_block_q8_0 *xq = malloc(xqn * sizeof *xq);
    duet_quantize_row_q8_0(x, xq, (int64_t)xn);
    if (duet_buffer_alloc(b.be, xn * sizeof(float), &b.x) ||
        duet_buffer_upload(b.be, b.x, 0, x, xn * sizeof(float)) ||
        duet_buffer_alloc(b.be, xqn * sizeof *xq, &b.xq) || duet_buffer_upload(b.be, b.xq, 0, xq, xqn * sizeof *xq) ||
        duet_buffer_alloc(b.be, (size_t)b.max_tokens * b.max_out * sizeof(float), &b.out))
        die("buffers");
    free(x);
    free(xq);

    static const int shapes[][2] = {{768, 768}, {2048, 768}, {768, 2048}, {32000, 768}, {5632, 2048}};
    static const duet_dtype mv_types[] = {DUET_DTYPE_Q8_0, DUET_DTYPE_F16, DUET_DTYPE_F32};
    enum { N_SHAPES = 5, N_MV = 3 * 5 };
    mv_result mv[N_MV];
    int n_mv = 0;
    for (int d = 0; d < 3 && !batched_only; d++)
        for (int s = 0; s < N_SHAPES; s++)
            mv[n_mv++] = bench_matvec(&b, mv_types[d], shapes[s][0], shapes[s][1], triad, min_s);

    static const int pf_shapes[][2] = {{2048, 768}, {768, 2048}, {5632, 2048}};
    pf_result pf[3 * 3 * 2];
    int n_pf = 0;
    for (int d = 0; d < 3 && !batched_only; d++)
        for (int s = 0; s < 3; s++)
            for (int nt = 64; nt <= 128; nt *= 2)
                pf[n_pf++] = bench_prefill(&b, mv_types[d], pf_shapes[s][0], pf_shapes[s][1], nt, min_s);

    static const int bt_tokens[] = {1, 4, 8, 16, 32, 128};
    enum { N_BT_SHAPES = 4, N_BT_TOKENS = 6 };
    bt_result bt[N_BT_SHAPES * N_BT_TOKENS];
    int n_bt = 0;
    for (int s = 0; s < N_BT_SHAPES; s++)
        for (int i = 0; i < N_BT_TOKENS; i++)
            bt[n_bt++] = bench_batched(&b, shapes[s][0], shapes[s][1], bt_tokens[i], min_s);

    double inline_us = batched_only ? 0.0 : bench_op_overhead_us(&b, false);
    double threaded_us = batched_only ? 0.0 : bench_op_overhead_us(&b, true);

    const duet_device_info *info = &b.be->info;
    if (json) {
        cJSON *root = cJSON_CreateObject();
        cJSON_AddStringToObject(root, "device", info->name);
        cJSON_AddStringToObject(root, "simd", info->driver);
        cJSON_AddStringToObject(root, "features", info->features);
        cJSON_AddNumberToObject(root, "threads", threads);
        cJSON_AddNumberToObject(root, "triad_gbs", triad);
        cJSON_AddNumberToObject(root, "triad_array_mib", triad_mib);
        cJSON_AddNumberToObject(root, "weight_pool_mib", pool_mib);
        cJSON *arr = cJSON_AddArrayToObject(root, "matvec");
        for (int i = 0; i < n_mv; i++) {
            cJSON *o = cJSON_CreateObject();
            cJSON_AddStringToObject(o, "dtype", mv[i].dtype);
            cJSON_AddNumberToObject(o, "n_out", mv[i].n_out);
            cJSON_AddNumberToObject(o, "n_in", mv[i].n_in);
            cJSON_AddNumberToObject(o, "gbs", mv[i].gbs);
            cJSON_AddNumberToObject(o, "frac_triad", mv[i].frac);
            cJSON_AddNumberToObject(o, "us", mv[i].us_per_op);
            cJSON_AddItemToArray(arr, o);
        }
        arr = cJSON_AddArrayToObject(root, "prefill");
        for (int i = 0; i < n_pf; i++) {
            cJSON *o = cJSON_CreateObject();
            cJSON_AddStringToObject(o, "dtype", pf[i].dtype);
            cJSON_AddNumberToObject(o, "n_out", pf[i].n_out);
            cJSON_AddNumberToObject(o, "n_in", pf[i].n_in);
            cJSON_AddNumberToObject(o, "n_tokens", pf[i].n_tokens);
            cJSON_AddNumberToObject(o, "gflops", pf[i].gflops);
            cJSON_AddItemToArray(arr, o);
        }
        arr = cJSON_AddArrayToObject(root, "batched_q8_0");
        for (int i = 0; i < n_bt; i++) {
            cJSON *o = cJSON_CreateObject();
            cJSON_AddNumberToObject(o, "n_out", bt[i].n_out);
            cJSON_AddNumberToObject(o, "n_in", bt[i].n_in);
            cJSON_AddNumberToObject(o, "n_tokens", bt[i].n_tokens);
            cJSON_AddNumberToObject(o, "gflops_f32_x", bt[i].gflops_f32x);
            cJSON_AddNumberToObject(o, "gflops_x_q8", bt[i].gflops_xq8);
            cJSON_AddItemToArray(arr, o);
        }
        cJSON_AddNumberToObject(root, "op_overhead_inline_us", inline_us);
        cJSON_AddNumberToObject(root, "op_overhead_threaded_matvec_us", threaded_us);
        char *s = cJSON_Print(root);
        printf("%s\n", s);
        free(s);
        cJSON_Delete(root);
    } else {
        printf("cpu kernels: %s, %s (%s), %d threads\n", info->name, info->driver, info->features, threads);
        printf("\nbatched q8_0 matmul, hot weights (GFLOP/s, median of 5)\n  %13s %7s %10s %10s\n", "rows x cols",
               "tokens", "f32 x", "x_q8");
        for (int i = 0; i < n_bt; i++)
            printf("  %6d x %-5d %7d %10.1f %10.1f\n", bt[i].n_out, bt[i].n_in, bt[i].n_tokens, bt[i].gflops_f32x,
                   bt[i].gflops_xq8);
        if (!batched_only) {
            printf("\ntriad: %.1f GB/s (3 x %d MiB arrays of doubles)\n\n", triad, triad_mib);
            printf("matrix-vector, 1 token, cold weights (%d MiB pool)\n", pool_mib);
            printf("  %-6s %13s %10s %9s %10s\n", "dtype", "rows x cols", "GB/s", "of triad", "us/op");
            for (int i = 0; i < n_mv; i++)
                printf("  %-6s %6d x %-5d %10.1f %8.0f%% %10.1f\n", mv[i].dtype, mv[i].n_out, mv[i].n_in, mv[i].gbs,
                       100 * mv[i].frac, mv[i].us_per_op);
            printf("\nprefill matmul\n  %-6s %13s %7s %10s\n", "dtype", "rows x cols", "tokens", "GFLOP/s");
            for (int i = 0; i < n_pf; i++)
                printf("  %-6s %6d x %-5d %7d %10.1f\n", pf[i].dtype, pf[i].n_out, pf[i].n_in, pf[i].n_tokens, pf[i].gflops);
            printf("\nper-op overhead: %.2f us (inline add, dim 16), %.2f us (threaded q8_0 matvec 256x256, hot)\n",
                   inline_us, threaded_us);
        }
    }
    duet_buffer_free(b.be, b.pool);
    duet_buffer_free(b.be, b.x);
    duet_buffer_free(b.be, b.xq);
    duet_buffer_free(b.be, b.out);
    duet_backend_close(b.be);
    return 0;
}
