/* op_oracle.c — the reference ops of op_oracle.h: plain loops in the order
 * of the definitions, double accumulators, one f32 rounding per output. */
#include "op_oracle.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- helpers ----------------------------------------------------------------- */

static void *oracle_alloc(size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    if (!p) {
        fprintf(stderr, "op_oracle: out of memory (%zu bytes)\n", bytes);
        abort();
    }
    return p;
}

static void oracle_fail(const char *what) {
    fprintf(stderr, "op_oracle: %s\n", what);
    abort();
}

/* 64-bit LCG: [-1, 1). */
static float oracle_rand(uint64_t *s) {
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((*s >> 40) & 0xffffff) / (float)0x800000 - 1.0f;
}

/* Row r of a [*][n] matrix in dtype t. */
static const uint8_t *row_at(duet_dtype t, const void *base, int64_t r, int64_t n) {
    return (const uint8_t *)base + (size_t)r * duet_dtype_row_bytes(t, n);
}

/* The q8_0 output rows of n_tokens x dim f32 values (dim % 32 == 0). */
static void quantize_rows(const float *x, int n_tokens, int dim, duet_block_q8_0 *out_q8) {
    for (int t = 0; t < n_tokens; t++)
        duet_quantize_row_q8_0(x + (size_t)t * dim, out_q8 + (size_t)t * (dim / DUET_QK8_0), dim);
}

static double dot(const float *a, const float *b, int n) {
    double s = 0;
    for (int i = 0; i < n; i++)
        s += (double)a[i] * b[i];
    return s;
}

/* ---- the paged KV cache ------------------------------------------------------ */

void oracle_kv_alloc(oracle_kv *kv, duet_dtype dtype, int width, int block_size, int n_blocks, int n_seqs,
                     int max_blocks) {
    memset(kv, 0, sizeof *kv);
    kv->dtype = dtype;
    kv->width = width;
    kv->block_size = block_size;
    kv->n_blocks = n_blocks;
    kv->n_seqs = n_seqs;
    kv->max_blocks = max_blocks;
    kv->row_bytes = duet_dtype_row_bytes(dtype, width);
    kv->k = calloc(1, oracle_kv_pool_bytes(kv) + 1);
    kv->v = calloc(1, oracle_kv_pool_bytes(kv) + 1);
    kv->table = oracle_alloc(oracle_kv_table_bytes(kv));
    if (!kv->k || !kv->v) oracle_fail("out of memory for the KV pools");
    for (int i = 0; i < n_seqs * max_blocks; i++)
        kv->table[i] = -1;
    kv->owned = true;
}

oracle_kv oracle_kv_wrap(const duet_kv_pages *pages, int width, uint8_t *k_pool, uint8_t *v_pool,
                         int32_t *table) {
    return (oracle_kv){.dtype = pages->dtype,
                       .width = width,
                       .block_size = pages->block_size,
                       .n_blocks = pages->n_blocks,
                       .n_seqs = pages->n_seqs,
                       .max_blocks = pages->max_blocks,
                       .row_bytes = duet_dtype_row_bytes(pages->dtype, width),
                       .k = k_pool,
                       .v = v_pool,
                       .table = table};
}

void oracle_kv_free(oracle_kv *kv) {
    if (kv->owned) {
        free(kv->k);
        free(kv->v);
        free(kv->table);
    }
    memset(kv, 0, sizeof *kv);
}

void oracle_kv_clone(oracle_kv *dst, const oracle_kv *src) {
    oracle_kv_alloc(dst, src->dtype, src->width, src->block_size, src->n_blocks, src->n_seqs,
                    src->max_blocks);
    memcpy(dst->k, src->k, oracle_kv_pool_bytes(src));
    memcpy(dst->v, src->v, oracle_kv_pool_bytes(src));
    memcpy(dst->table, src->table, oracle_kv_table_bytes(src));
}

size_t oracle_kv_pool_bytes(const oracle_kv *kv) {
    return kv->row_bytes * (size_t)kv->n_blocks * (size_t)kv->block_size;
}

size_t oracle_kv_table_bytes(const oracle_kv *kv) {
    return sizeof(int32_t) * (size_t)kv->n_seqs * (size_t)kv->max_blocks;
}

void oracle_kv_scatter(oracle_kv *kv, const int *lens, int32_t unused, uint64_t seed) {
    int32_t *perm = oracle_alloc(sizeof(int32_t) * (size_t)kv->n_blocks);
    for (int i = 0; i < kv->n_blocks; i++)
        perm[i] = i;
    for (int i = kv->n_blocks - 1; i > 0; i--) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        int j = (int)((seed >> 33) % (uint64_t)(i + 1));
        int32_t tmp = perm[i];
        perm[i] = perm[j];
        perm[j] = tmp;
    }
    int next = 0;
    for (int s = 0; s < kv->n_seqs; s++) {
        const int need = (lens[s] + kv->block_size - 1) / kv->block_size;
        if (need > kv->max_blocks) oracle_fail("oracle_kv_scatter: a sequence longer than its table row");
        for (int b = 0; b < kv->max_blocks; b++) {
            if (b < need && next >= kv->n_blocks)
                oracle_fail("oracle_kv_scatter: more blocks needed than the pool has");
            kv->table[s * kv->max_blocks + b] = b < need ? perm[next++] : unused;
        }
    }
    free(perm);
}

void oracle_kv_fill(oracle_kv *kv, uint64_t seed, float k_scale, float v_scale) {
    float *row = oracle_alloc(sizeof(float) * (size_t)kv->width);
    const size_t rows = (size_t)kv->n_blocks * (size_t)kv->block_size;
    for (size_t r = 0; r < rows; r++)
        for (int which = 0; which < 2; which++) {
            const float scale = which ? v_scale : k_scale;
            for (int i = 0; i < kv->width; i++)
                row[i] = oracle_rand(&seed) * scale;
            duet_convert_row(kv->dtype, row, (which ? kv->v : kv->k) + r * kv->row_bytes, kv->width);
        }
    free(row);
}

int64_t oracle_kv_row(const oracle_kv *kv, int seq, int pos) {
    if (seq < 0 || seq >= kv->n_seqs || pos < 0 || pos / kv->block_size >= kv->max_blocks) return -1;
    const int32_t block = kv->table[(size_t)seq * kv->max_blocks + pos / kv->block_size];
    if (block < 0 || block >= kv->n_blocks) return -1;
    return (int64_t)block * kv->block_size + pos % kv->block_size;
}

void oracle_kv_load(const oracle_kv *kv, const uint8_t *pool, int64_t row, float *out) {
    duet_dequantize_row(kv->dtype, pool + (size_t)row * kv->row_bytes, out, kv->width);
}

/* The row of (seq, pos), which must exist. */
static int64_t kv_row_checked(const oracle_kv *kv, int seq, int pos) {
    const int64_t r = oracle_kv_row(kv, seq, pos);
    if (r < 0) {
        char msg[128];
        snprintf(msg, sizeof msg, "sequence %d position %d has no block in the table", seq, pos);
        oracle_fail(msg);
    }
    return r;
}

void oracle_kv_store(oracle_kv *kv, int seq, int pos, const float *k, const float *v) {
    const size_t r = (size_t)kv_row_checked(kv, seq, pos);
    duet_convert_row(kv->dtype, k, kv->k + r * kv->row_bytes, kv->width);
    duet_convert_row(kv->dtype, v, kv->v + r * kv->row_bytes, kv->width);
}

duet_kv_pages oracle_kv_pages(const oracle_kv *kv, duet_view k_pool, duet_view v_pool, duet_view table) {
    return (duet_kv_pages){.k_pool = k_pool,
                           .v_pool = v_pool,
                           .block_table = table,
                           .dtype = kv->dtype,
                           .block_size = kv->block_size,
                           .n_blocks = kv->n_blocks,
                           .n_seqs = kv->n_seqs,
                           .max_blocks = kv->max_blocks};
}

/* ---- ops ----------------------------------------------------------------------- */

void oracle_embed(const int32_t *tokens, int n_tokens, const void *table, duet_dtype dtype, int dim,
                  float *out) {
    for (int t = 0; t < n_tokens; t++)
        duet_dequantize_row(dtype, row_at(dtype, table, tokens[t], dim), out + (size_t)t * dim, dim);
}

void oracle_rmsnorm(const float *x, const float *w, int n_tokens, int dim, float eps, float *out,
                    duet_block_q8_0 *out_q8) {
    float *y = oracle_alloc(sizeof(float) * (size_t)dim);
    for (int t = 0; t < n_tokens; t++) {
        const float *xt = x + (size_t)t * dim;
        const double scale = 1.0 / sqrt(dot(xt, xt, dim) / dim + eps);
        for (int i = 0; i < dim; i++)
            y[i] = (float)(xt[i] * scale * w[i]);
        if (out) memcpy(out + (size_t)t * dim, y, sizeof(float) * (size_t)dim);
        if (out_q8) quantize_rows(y, 1, dim, out_q8 + (size_t)t * (dim / DUET_QK8_0));
    }
    free(y);
}

void oracle_matmul(const void *w, duet_dtype dtype, const float *x, const duet_block_q8_0 *x_q8,
                   const float *bias, bool accumulate, int n_tokens, int n_in, int n_out, float *out) {
    /* The activations as values: x, or the exact d * q of x_q8. */
    float *xs = oracle_alloc(sizeof(float) * (size_t)n_tokens * n_in);
    for (int t = 0; t < n_tokens; t++) {
        float *dst = xs + (size_t)t * n_in;
        if (x_q8)
            duet_dequantize_row(DUET_DTYPE_Q8_0, x_q8 + (size_t)t * (n_in / DUET_QK8_0), dst, n_in);
        else
            memcpy(dst, x + (size_t)t * n_in, sizeof(float) * (size_t)n_in);
    }
    float *wr = oracle_alloc(sizeof(float) * (size_t)n_in);
    for (int o = 0; o < n_out; o++) {
        duet_dequantize_row(dtype, row_at(dtype, w, o, n_in), wr, n_in);
        for (int t = 0; t < n_tokens; t++) {
            float *y = out + (size_t)t * n_out + o;
            double s = dot(wr, xs + (size_t)t * n_in, n_in);
            if (bias) s += bias[o];
            if (accumulate) s += *y;
            *y = (float)s;
        }
    }
    free(wr);
    free(xs);
}

void oracle_rope_freqs(float base, int n_rot, float *freqs) {
    for (int i = 0; i < n_rot / 2; i++)
        freqs[i] = (float)pow((double)base, -2.0 * i / n_rot);
}

void oracle_rope(float *x, int n_heads, int head_dim, int n_rot, const float *freqs, float mscale, bool neox,
                 int pos) {
    const int half = n_rot / 2;
    const double m = mscale == 0.0f ? 1.0 : mscale;
    for (int h = 0; h < n_heads; h++) {
        float *v = x + (size_t)h * head_dim;
        for (int i = 0; i < half; i++) {
            const double theta = pos * (double)freqs[i];
            const int a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
            const double x0 = v[a], x1 = v[b], c = cos(theta) * m, s = sin(theta) * m;
            v[a] = (float)(x0 * c - x1 * s);
            v[b] = (float)(x0 * s + x1 * c);
        }
    }
}

void oracle_rope_kv(float *q, float *k, const float *v, const int32_t *pos, const int32_t *seq, int n_tokens,
                    int n_head, int n_head_kv, int head_dim, int n_rot, const float *freqs, float mscale,
                    bool neox, oracle_kv *kv) {
    const size_t qw = (size_t)n_head * head_dim, kvw = (size_t)n_head_kv * head_dim;
    for (int t = 0; t < n_tokens; t++) {
        oracle_rope(q + t * qw, n_head, head_dim, n_rot, freqs, mscale, neox, pos[t]);
        oracle_rope(k + t * kvw, n_head_kv, head_dim, n_rot, freqs, mscale, neox, pos[t]);
        oracle_kv_store(kv, seq[t], pos[t], k + t * kvw, v + t * kvw);
    }
}

/* One token's attention, all heads: out_t[n_head * head_dim]. */
static void attend_token(const float *qt, int seq, int pos, int n_head, int n_head_kv, int head_dim,
                         double scale, int window, const oracle_kv *kv, float *out_t) {
    /* Keys first .. pos: the whole context, or the window's last ones. */
    const int first = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
    const int n_keys = pos + 1 - first, group = n_head / n_head_kv;
    double *score = oracle_alloc(sizeof(double) * (size_t)n_head * n_keys);
    double *acc = calloc((size_t)n_head * head_dim, sizeof(double));
    float *row = oracle_alloc(sizeof(float) * (size_t)kv->width);
    if (!acc) oracle_fail("out of memory");
    /* Scores, then a softmax per head (max subtracted before exp). */
    for (int j = 0; j < n_keys; j++) {
        oracle_kv_load(kv, kv->k, kv_row_checked(kv, seq, first + j), row);
        for (int h = 0; h < n_head; h++)
            score[(size_t)h * n_keys + j] =
                dot(qt + (size_t)h * head_dim, row + (size_t)(h / group) * head_dim, head_dim) * scale;
    }
    for (int h = 0; h < n_head; h++) {
        double *s = score + (size_t)h * n_keys, mx = -INFINITY, sum = 0;
        for (int j = 0; j < n_keys; j++)
            mx = s[j] > mx ? s[j] : mx;
        for (int j = 0; j < n_keys; j++)
            sum += s[j] = exp(s[j] - mx);
        for (int j = 0; j < n_keys; j++)
            s[j] /= sum;
    }
    /* The probability-weighted V rows. */
    for (int j = 0; j < n_keys; j++) {
        oracle_kv_load(kv, kv->v, kv_row_checked(kv, seq, first + j), row);
        for (int h = 0; h < n_head; h++) {
            const double p = score[(size_t)h * n_keys + j];
            const float *vr = row + (size_t)(h / group) * head_dim;
            double *a = acc + (size_t)h * head_dim;
            for (int i = 0; i < head_dim; i++)
                a[i] += p * vr[i];
        }
    }
    for (size_t i = 0; i < (size_t)n_head * head_dim; i++)
        out_t[i] = (float)acc[i];
    free(row);
    free(acc);
    free(score);
}

void oracle_attention(const float *q, const int32_t *pos, const int32_t *seq, int n_tokens, int n_head,
                      int n_head_kv, int head_dim, float scale, int window, const oracle_kv *kv, float *out,
                      duet_block_q8_0 *out_q8) {
    const size_t qw = (size_t)n_head * head_dim;
    float *y = oracle_alloc(sizeof(float) * qw); /* out may be q: a token's row is written when done */
    for (int t = 0; t < n_tokens; t++) {
        attend_token(q + t * qw, seq[t], pos[t], n_head, n_head_kv, head_dim, scale, window, kv, y);
        if (out) memcpy(out + t * qw, y, sizeof(float) * qw);
        if (out_q8) quantize_rows(y, 1, (int)qw, out_q8 + t * (qw / DUET_QK8_0));
    }
    free(y);
}

void oracle_swiglu(const float *gate, const float *up, int n_tokens, int dim, float *out,
                   duet_block_q8_0 *out_q8) {
    float *y = oracle_alloc(sizeof(float) * (size_t)dim);
    for (int t = 0; t < n_tokens; t++) {
        const float *g = gate + (size_t)t * dim, *u = up + (size_t)t * dim;
        for (int i = 0; i < dim; i++)
            y[i] = (float)((double)g[i] / (1.0 + exp(-(double)g[i])) * u[i]);
        if (out) memcpy(out + (size_t)t * dim, y, sizeof(float) * (size_t)dim);
        if (out_q8) quantize_rows(y, 1, dim, out_q8 + (size_t)t * (dim / DUET_QK8_0));
    }
    free(y);
}

void oracle_add(const float *a, const float *b, int n_tokens, int dim, float *out) {
    for (size_t i = 0; i < (size_t)n_tokens * dim; i++)
        out[i] = (float)((double)a[i] + b[i]);
}

void oracle_gather_rows(const float *x, const int32_t *rows, int n_tokens, int dim, float *out) {
    for (int t = 0; t < n_tokens; t++)
        memcpy(out + (size_t)t * dim, x + (size_t)rows[t] * dim, sizeof(float) * (size_t)dim);
}

void oracle_argmax(const float *x, int n_tokens, int dim, int32_t *out) {
    for (int t = 0; t < n_tokens; t++) {
        const float *r = x + (size_t)t * dim;
        int best = -1;
        for (int j = 0; j < dim; j++)
            if (!isnan(r[j]) && (best < 0 || r[j] > r[best])) best = j;
        out[t] = best < 0 ? 0 : best;
    }
}

/* ---- a descriptor on host memory --------------------------------------------- */

void oracle_run(const duet_op *op, oracle_map_fn map, void *ctx) {
    const int T = op->n_tokens;
#define H(view) map(ctx, view)
    switch (op->kind) {
    case DUET_OP_EMBED:
        oracle_embed((const int32_t *)H(op->embed.tokens), T, H(op->embed.table), op->embed.dtype,
                     op->embed.dim, (float *)H(op->embed.out));
        break;
    case DUET_OP_RMSNORM:
        oracle_rmsnorm((const float *)H(op->rmsnorm.x), (const float *)H(op->rmsnorm.w), T, op->rmsnorm.dim,
                       op->rmsnorm.eps, (float *)H(op->rmsnorm.out),
                       (duet_block_q8_0 *)H(op->rmsnorm.out_q8));
        break;
    case DUET_OP_MATMUL:
        oracle_matmul(H(op->matmul.w), op->matmul.dtype, (const float *)H(op->matmul.x),
                      (const duet_block_q8_0 *)H(op->matmul.x_q8), (const float *)H(op->matmul.bias),
                      op->matmul.accumulate, T, op->matmul.n_in, op->matmul.n_out,
                      (float *)H(op->matmul.out));
        break;
    case DUET_OP_ROPE_KV: {
        const duet_kv_pages *p = &op->rope_kv.kv;
        oracle_kv kv = oracle_kv_wrap(p, op->rope_kv.n_head_kv * op->rope_kv.head_dim, H(p->k_pool),
                                      H(p->v_pool), (int32_t *)H(p->block_table));
        oracle_rope_kv((float *)H(op->rope_kv.q), (float *)H(op->rope_kv.k), (const float *)H(op->rope_kv.v),
                       (const int32_t *)H(op->rope_kv.pos), (const int32_t *)H(op->rope_kv.seq), T,
                       op->rope_kv.n_head, op->rope_kv.n_head_kv, op->rope_kv.head_dim, op->rope_kv.n_rot,
                       (const float *)H(op->rope_kv.freqs), op->rope_kv.mscale, op->rope_kv.neox, &kv);
        break;
    }
    case DUET_OP_ATTENTION: {
        const duet_kv_pages *p = &op->attention.kv;
        oracle_kv kv = oracle_kv_wrap(p, op->attention.n_head_kv * op->attention.head_dim, H(p->k_pool),
                                      H(p->v_pool), (int32_t *)H(p->block_table));
        oracle_attention((const float *)H(op->attention.q), (const int32_t *)H(op->attention.pos),
                         (const int32_t *)H(op->attention.seq), T, op->attention.n_head,
                         op->attention.n_head_kv, op->attention.head_dim, op->attention.scale,
                         op->attention.window, &kv, (float *)H(op->attention.out),
                         (duet_block_q8_0 *)H(op->attention.out_q8));
        break;
    }
    case DUET_OP_SWIGLU:
        oracle_swiglu((const float *)H(op->swiglu.gate), (const float *)H(op->swiglu.up), T, op->swiglu.dim,
                      (float *)H(op->swiglu.out), (duet_block_q8_0 *)H(op->swiglu.out_q8));
        break;
    case DUET_OP_ADD:
        oracle_add((const float *)H(op->add.a), (const float *)H(op->add.b), T, op->add.dim,
                   (float *)H(op->add.out));
        break;
    case DUET_OP_GATHER_ROWS:
        oracle_gather_rows((const float *)H(op->gather.x), (const int32_t *)H(op->gather.rows), T,
                           op->gather.dim, (float *)H(op->gather.out));
        break;
    case DUET_OP_ARGMAX:
        oracle_argmax((const float *)H(op->argmax.x), T, op->argmax.dim, (int32_t *)H(op->argmax.out));
        break;
    case DUET_OP_COUNT:
        oracle_fail("oracle_run: DUET_OP_COUNT is not an op");
    }
#undef H
}
