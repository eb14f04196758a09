/* bench_opencl.c — OpenCL kernel bandwidth: the Q8_0 matrix-vector
 * product with q8_0 activations (int8 dot products: the extension's or
 * the portable code) against the same weights with f32 activations and
 * against F16 weights, and paged attention decode at several contexts,
 * each as GB/s of the bytes the op must read, next to the machine's STREAM
 * triad.
 *
 * usage: bench_opencl [--device N] [--reps N] [--json FILE]
 *
 * Tuning variants come from $DUET_OPENCL_TUNE like everywhere else; the
 * q8 x q8 rows are run once as the device's choice and once forced to the
 * portable fallback (dot=0). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../backends/opencl/ocl_internal.h"
#include "bench_util.h"

typedef struct row {
    char name[96], path[32];
    double us, gbs;
} row;

static row rows[64];
static int n_rows;

static uint64_t rng = 88172645463325252ull;
static float frand(void) {
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (float)((rng >> 40) & 0xffffff) / (float)(1 << 23) - 1.0f;
}

static duet_buffer *buf_rand(duet_backend *be, duet_dtype t, size_t rows_, size_t cols) {
    size_t rb = duet_dtype_row_bytes(t, (int64_t)cols);
    uint8_t *img = malloc(rb * rows_);
    float *tmp = malloc(cols * sizeof *tmp);
    for (size_t r = 0; r < rows_; r++) {
        for (size_t i = 0; i < cols; i++)
            tmp[i] = frand();
        duet_convert_row(t, tmp, img + r * rb, (int64_t)cols);
    }
    duet_buffer *b = NULL;
    if (duet_buffer_alloc(be, rb * rows_, &b) || duet_buffer_upload(be, b, 0, img, rb * rows_)) {
        fprintf(stderr, "bench_opencl: buffer: %s\n", duet_last_error());
        exit(1);
    }
    free(img);
    free(tmp);
    return b;
}

/* Best time of `reps` steps of `inner` ops each, in microseconds per op. */
static double time_op(duet_backend *be, const duet_op *op, int reps, int inner) {
    double best = 1e30;
    for (int r = 0; r < reps + 1; r++) { /* the first step also compiles */
        double t0 = bench_now();
        duet_status st = duet_step_begin(be);
        for (int i = 0; i < inner && st == DUET_OK; i++)
            st = duet_step_op(be, op);
        if (st == DUET_OK) st = duet_step_submit(be);
        if (st == DUET_OK) st = duet_step_wait(be);
        if (st != DUET_OK) {
            fprintf(stderr, "bench_opencl: op failed: %s\n", duet_last_error());
            exit(1);
        }
        double dt = (bench_now() - t0) / inner;
        if (r > 0 && dt < best) best = dt;
    }
    return best * 1e6;
}

static duet_backend *open_dev(int device, const char *tune) {
    if (tune) setenv("DUET_OPENCL_TUNE", tune, 1);
    duet_backend *be = NULL;
    duet_status st = duet_backend_open("opencl", device, NULL, &be);
    if (tune) unsetenv("DUET_OPENCL_TUNE");
    if (st != DUET_OK) {
        fprintf(stderr, "bench_opencl: open: %s\n", duet_last_error());
        exit(1);
    }
    return be;
}

static void add_row(const char *name, const char *path, double us, double bytes) {
    row *r = &rows[n_rows++];
    snprintf(r->name, sizeof r->name, "%s", name);
    snprintf(r->path, sizeof r->path, "%s", path);
    r->us = us;
    r->gbs = bytes / (us * 1e-6) / 1e9;
    printf("  %-46s %-16s %10.1f us %8.2f GB/s\n", r->name, r->path, r->us, r->gbs);
}

/* One token through an n_out x n_in matrix. */
static void bench_gemv(duet_backend *be, const char *label, duet_dtype wt, bool q8x, int n_in, int n_out,
                       int reps) {
    duet_buffer *w = buf_rand(be, wt, (size_t)n_out, (size_t)n_in);
    duet_buffer *x = buf_rand(be, q8x ? DUET_DTYPE_Q8_0 : DUET_DTYPE_F32, 1, (size_t)n_in);
    duet_buffer *out = buf_rand(be, DUET_DTYPE_F32, 1, (size_t)n_out);
    duet_op op = {.kind = DUET_OP_MATMUL, .n_tokens = 1};
    op.matmul.w = (duet_view){w, 0};
    op.matmul.dtype = wt;
    if (q8x)
        op.matmul.x_q8 = (duet_view){x, 0};
    else
        op.matmul.x = (duet_view){x, 0};
    op.matmul.n_in = n_in, op.matmul.n_out = n_out;
    op.matmul.out = (duet_view){out, 0};
    const double bytes = (double)duet_dtype_row_bytes(wt, n_in) * n_out;
    double us = time_op(be, &op, reps, 20);
    char name[96], path[32];
    snprintf(name, sizeof name, "gemv %s %dx%d (%s)", duet_dtype_name(wt), n_out, n_in, label);
    const ocl_backend *o = (const ocl_backend *)be;
    snprintf(path, sizeof path, "%s%s", duet__ocl_matmul_path(o, &op),
             !q8x               ? ""
             : o->int_dot == 0  ? "/portable"
             : o->tune.dot == 2 ? "/emulated"
                                : "/int-dot");
    add_row(name, path, us, bytes);
    duet_buffer_free(be, w), duet_buffer_free(be, x), duet_buffer_free(be, out);
}

/* One decode token of one sequence at context ctx (125m: 12 heads of 64). */
static void bench_attention(duet_backend *be, duet_dtype kvt, int ctx, int reps) {
    const int nh = 12, nkv = 12, hd = 64, bs = 16, kvw = nkv * hd;
    duet_kv_pages kv = {
        .dtype = kvt, .block_size = bs, .n_blocks = ctx / bs, .n_seqs = 1, .max_blocks = ctx / bs};
    duet_buffer *kp = buf_rand(be, kvt, (size_t)ctx, (size_t)kvw),
                *vp = buf_rand(be, kvt, (size_t)ctx, (size_t)kvw);
    int32_t *table = malloc((size_t)kv.max_blocks * 4);
    for (int b = 0; b < kv.max_blocks; b++)
        table[b] = (b * 7) % kv.n_blocks; /* scattered (7 is coprime) */
    duet_buffer *tab, *pos, *seq;
    int32_t p = ctx - 1, s = 0;
    if (duet_buffer_alloc(be, (size_t)kv.max_blocks * 4, &tab) || duet_buffer_alloc(be, 4, &pos) ||
        duet_buffer_alloc(be, 4, &seq) || duet_buffer_upload(be, tab, 0, table, (size_t)kv.max_blocks * 4) ||
        duet_buffer_upload(be, pos, 0, &p, 4) || duet_buffer_upload(be, seq, 0, &s, 4)) {
        fprintf(stderr, "bench_opencl: %s\n", duet_last_error());
        exit(1);
    }
    free(table);
    duet_buffer *q = buf_rand(be, DUET_DTYPE_F32, 1, (size_t)nh * hd),
                *out = buf_rand(be, DUET_DTYPE_F32, 1, (size_t)nh * hd);
    kv.k_pool = (duet_view){kp, 0}, kv.v_pool = (duet_view){vp, 0}, kv.block_table = (duet_view){tab, 0};
    duet_op op = {.kind = DUET_OP_ATTENTION, .n_tokens = 1};
    op.attention.q = (duet_view){q, 0}, op.attention.pos = (duet_view){pos, 0},
    op.attention.seq = (duet_view){seq, 0};
    op.attention.kv = kv;
    op.attention.n_head = nh, op.attention.n_head_kv = nkv, op.attention.head_dim = hd;
    op.attention.scale = 0.125f, op.attention.out = (duet_view){out, 0};
    const double bytes = 2.0 * (double)duet_dtype_row_bytes(kvt, kvw) * ctx;
    double us = time_op(be, &op, reps, 10);
    int split_len, n_splits;
    const char *plan = duet__ocl_attention_plan((const ocl_backend *)be, &op, &split_len, &n_splits);
    char name[96], path[32];
    snprintf(name, sizeof name, "attention decode 125m kv %s ctx %d", duet_dtype_name(kvt), ctx);
    snprintf(path, sizeof path, "%s/%d split%s", plan, n_splits, n_splits == 1 ? "" : "s");
    add_row(name, path, us, bytes);
    duet_buffer_free(be, kp), duet_buffer_free(be, vp), duet_buffer_free(be, tab), duet_buffer_free(be, pos);
    duet_buffer_free(be, seq), duet_buffer_free(be, q), duet_buffer_free(be, out);
}

int main(int argc, char **argv) {
    int device = 0, reps = 5;
    const char *json = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--device") && i + 1 < argc)
            device = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc)
            reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--json") && i + 1 < argc)
            json = argv[++i];
        else {
            fprintf(stderr, "usage: bench_opencl [--device N] [--reps N] [--json FILE]\n");
            return 2;
        }
    }
    char why[256] = "";
    if (!duet_opencl_backend_iface.available(why, sizeof why)) {
        printf("bench_opencl: opencl unavailable (%s)\n", why);
        return 0;
    }
    const double triad = bench_triad_gbs(2, 5);
    duet_backend *be = open_dev(device, NULL);
    const ocl_backend *o = (const ocl_backend *)be;
    printf("device: %s (%s); tuning %s; int dot: %s\n", be->info.name, be->info.driver, o->tune.entry,
           o->dev->int_dot ? (o->dev->int_dot_packed ? "packed 4x8" : "4x8") : "no (portable fallback)");
    printf("machine triad (2 threads): %.2f GB/s\n", triad);

    static const int shapes[][2] = {{2048, 5632}, {5632, 2048}, {768, 2048}, {768, 32000}};
    for (int si = 0; si < 4; si++) {
        const int n_in = shapes[si][0], n_out = shapes[si][1];
        bench_gemv(be, "x q8_0", DUET_DTYPE_Q8_0, true, n_in, n_out, reps);
        if (o->int_dot) { /* the same with the fallback forced */
            duet_backend *fb = open_dev(device, "dot=0");
            bench_gemv(fb, "x q8_0", DUET_DTYPE_Q8_0, true, n_in, n_out, reps);
            duet_backend_close(fb);
        }
        bench_gemv(be, "x f32", DUET_DTYPE_Q8_0, false, n_in, n_out, reps);
        bench_gemv(be, "x f32", DUET_DTYPE_F16, false, n_in, n_out, reps);
    }
    const duet_dtype kvts[2] = {DUET_DTYPE_F16, DUET_DTYPE_Q8_0};
    static const int ctxs[3] = {128, 1024, 4096};
    for (int k = 0; k < 2; k++)
        for (int c = 0; c < 3; c++)
            bench_attention(be, kvts[k], ctxs[c], reps);
    char dev_name[256];
    snprintf(dev_name, sizeof dev_name, "%s", be->info.name);
    duet_backend_close(be);

    if (json) {
        FILE *f = fopen(json, "w");
        if (!f) {
            perror(json);
            return 1;
        }
        fprintf(f, "{\n  \"device\": \"%s\",\n  \"triad_gbs\": %.3f,\n  \"rows\": [\n", dev_name, triad);
        for (int i = 0; i < n_rows; i++)
            fprintf(f,
                    "    {\"name\": \"%s\", \"path\": \"%s\", \"us\": %.2f, \"gbs\": %.3f, \"frac_triad\": "
                    "%.3f}%s\n",
                    rows[i].name, rows[i].path, rows[i].us, rows[i].gbs, rows[i].gbs / triad,
                    i + 1 < n_rows ? "," : "");
        fprintf(f, "  ]\n}\n");
        fclose(f);
    }
    return 0;
}
