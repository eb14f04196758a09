/* cpu_ops.c — every op except MATMUL, and the vector kernels they use.
 *
 * Ops are parallel over rows (tokens, or token x head for attention); one
 * whose work is smaller than a dispatch's cost runs on the caller alone,
 * since decode issues many tiny ops per token. */
#include <stdlib.h>

#include "cpu_internal.h"
#include "cpu_simd.h"

/* Below this many elements of work an op runs inline (~10 us of work is
 * where two threads start to pay off over a ~1 us fork/join). */
#define CPU_PAR_MIN_WORK 32768

/* The per-row vector kernels, one set per SIMD path. */
typedef struct vec_kernels {
    float (*sumsq)(const float *x, int64_t n);
    void (*scale_mul)(float *out, const float *x, const float *w, float s, int64_t n);
    void (*swiglu)(float *out, const float *g, const float *u, int64_t n);
    void (*add)(float *out, const float *a, const float *b, int64_t n);
    void (*to_f16)(uint16_t *y, const float *x, int64_t n);
    /* One query head against n cached positions (rows kvs elements apart,
     * f32 or f16): out = softmax(scale * q.K) V. scores: n floats. */
    void (*attend)(const float *q, const void *k, const void *v, int64_t kvs, duet_dtype kvt, int64_t n,
                   int hd, float scale, float *scores, float *out);
} vec_kernels;

/* ======================================================================== */
/* scalar                                                                    */
/* ======================================================================== */

static float scalar_sumsq(const float *x, int64_t n) {
    double s = 0.0;
    for (int64_t i = 0; i < n; i++)
        s += (double)x[i] * x[i];
    return (float)s;
}

static void scalar_scale_mul(float *out, const float *x, const float *w, float s, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        out[i] = x[i] * s * w[i];
}

static void scalar_swiglu(float *out, const float *g, const float *u, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        out[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

static void scalar_add(float *out, const float *a, const float *b, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        out[i] = a[i] + b[i];
}

static void scalar_to_f16(uint16_t *y, const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        y[i] = duet_fp32_to_fp16(x[i]);
}

static inline float kv_at(const void *base, duet_dtype t, int64_t i) {
    return t == DUET_DTYPE_F16 ? duet_fp16_to_fp32(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

/* Two passes over the scores (max, then exp and sum) keep the softmax
 * stable without an n x n matrix: only this head's n scores exist. */
static void scalar_attend(const float *q, const void *k, const void *v, int64_t kvs, duet_dtype kvt,
                          int64_t n, int hd, float scale, float *scores, float *out) {
    float mx = -INFINITY;
    for (int64_t p = 0; p < n; p++) {
        float s = 0.0f;
        for (int d = 0; d < hd; d++)
            s += q[d] * kv_at(k, kvt, p * kvs + d);
        scores[p] = s * scale;
        if (scores[p] > mx) mx = scores[p];
    }
    float sum = 0.0f;
    for (int64_t p = 0; p < n; p++)
        sum += scores[p] = expf(scores[p] - mx);
    for (int d = 0; d < hd; d++)
        out[d] = 0.0f;
    for (int64_t p = 0; p < n; p++)
        for (int d = 0; d < hd; d++)
            out[d] += scores[p] * kv_at(v, kvt, p * kvs + d);
    float inv = 1.0f / sum;
    for (int d = 0; d < hd; d++)
        out[d] *= inv;
}

static const vec_kernels vec_scalar = {
    scalar_sumsq, scalar_scale_mul, scalar_swiglu, scalar_add, scalar_to_f16, scalar_attend,
};

#if CPU_X86
/* ======================================================================== */
/* avx2                                                                      */
/* ======================================================================== */

CPU_AVX2 static float avx2_sumsq(const float *x, int64_t n) {
    __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 u = _mm256_loadu_ps(x + i), w = _mm256_loadu_ps(x + i + 8);
        a = _mm256_fmadd_ps(u, u, a);
        b = _mm256_fmadd_ps(w, w, b);
    }
    float s = avx2_hsum(_mm256_add_ps(a, b));
    for (; i < n; i++)
        s += x[i] * x[i];
    return s;
}

CPU_AVX2 static void avx2_scale_mul(float *out, const float *x, const float *w, float s, int64_t n) {
    __m256 sv = _mm256_set1_ps(s);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i,
                         _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), sv), _mm256_loadu_ps(w + i)));
    for (; i < n; i++)
        out[i] = x[i] * s * w[i];
}

CPU_AVX2 static void avx2_swiglu(float *out, const float *g, const float *u, int64_t n) {
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 gv = _mm256_loadu_ps(g + i);
        __m256 e = avx2_exp(_mm256_xor_ps(gv, sign)); /* exp(-g) */
        __m256 silu = _mm256_div_ps(gv, _mm256_add_ps(one, e));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
    }
    for (; i < n; i++)
        out[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

CPU_AVX2 static void avx2_add(float *out, const float *a, const float *b, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_add_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
    for (; i < n; i++)
        out[i] = a[i] + b[i];
}

CPU_AVX2 static void avx2_to_f16(uint16_t *y, const float *x, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(y + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++)
        y[i] = _cvtss_sh(x[i], _MM_FROUND_TO_NEAREST_INT);
}

CPU_AVX2 CPU_INLINE __m256 avx2_load_kv(duet_dtype kvt, const void *base, int64_t i) {
    if (kvt == DUET_DTYPE_F16) return avx2_load_f16((const uint16_t *)base + i);
    return _mm256_loadu_ps((const float *)base + i);
}

CPU_AVX2 CPU_INLINE float avx2_kv_at(duet_dtype kvt, const void *base, int64_t i) {
    if (kvt == DUET_DTYPE_F16) return _cvtsh_ss(((const uint16_t *)base)[i]);
    return ((const float *)base)[i];
}

CPU_AVX2 CPU_INLINE void avx2_attend_t(duet_dtype KVT, const float *q, const void *k, const void *v,
                                       int64_t kvs, int64_t n, int hd, float scale, float *scores,
                                       float *out) {
    int hd8 = hd & ~7;
    float mx = -INFINITY;
    for (int64_t p = 0; p < n; p++) {
        __m256 acc = _mm256_setzero_ps();
        for (int d = 0; d < hd8; d += 8)
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), avx2_load_kv(KVT, k, p * kvs + d), acc);
        float s = avx2_hsum(acc);
        for (int d = hd8; d < hd; d++)
            s += q[d] * avx2_kv_at(KVT, k, p * kvs + d);
        scores[p] = s * scale;
        mx = scores[p] > mx ? scores[p] : mx;
    }
    __m256 sumv = _mm256_setzero_ps(), mv = _mm256_set1_ps(mx);
    int64_t p = 0;
    for (; p + 8 <= n; p += 8) {
        __m256 e = avx2_exp(_mm256_sub_ps(_mm256_loadu_ps(scores + p), mv));
        _mm256_storeu_ps(scores + p, e);
        sumv = _mm256_add_ps(sumv, e);
    }
    float sum = avx2_hsum(sumv);
    for (; p < n; p++)
        sum += scores[p] = expf(scores[p] - mx);
    for (int d = 0; d < hd; d++)
        out[d] = 0.0f;
    for (p = 0; p < n; p++) {
        __m256 w = _mm256_set1_ps(scores[p]);
        for (int d = 0; d < hd8; d += 8)
            _mm256_storeu_ps(out + d,
                             _mm256_fmadd_ps(w, avx2_load_kv(KVT, v, p * kvs + d), _mm256_loadu_ps(out + d)));
        for (int d = hd8; d < hd; d++)
            out[d] += scores[p] * avx2_kv_at(KVT, v, p * kvs + d);
    }
    float inv = 1.0f / sum;
    for (int d = 0; d < hd; d++)
        out[d] *= inv;
}

CPU_AVX2 static void avx2_attend(const float *q, const void *k, const void *v, int64_t kvs, duet_dtype kvt,
                                 int64_t n, int hd, float scale, float *scores, float *out) {
    if (kvt == DUET_DTYPE_F16)
        avx2_attend_t(DUET_DTYPE_F16, q, k, v, kvs, n, hd, scale, scores, out);
    else
        avx2_attend_t(DUET_DTYPE_F32, q, k, v, kvs, n, hd, scale, scores, out);
}

static const vec_kernels vec_avx2 = {
    avx2_sumsq, avx2_scale_mul, avx2_swiglu, avx2_add, avx2_to_f16, avx2_attend,
};

/* ======================================================================== */
/* avx512: masked tails, no scalar clean-up loops                              */
/* ======================================================================== */

CPU_AVX512 static float avx512_sumsq(const float *x, int64_t n) {
    __m512 a = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 u = _mm512_loadu_ps(x + i);
        a = _mm512_fmadd_ps(u, u, a);
    }
    if (i < n) {
        __m512 u = _mm512_maskz_loadu_ps(avx512_tail_mask(n - i), x + i);
        a = _mm512_fmadd_ps(u, u, a);
    }
    return _mm512_reduce_add_ps(a);
}

CPU_AVX512 static void avx512_scale_mul(float *out, const float *x, const float *w, float s, int64_t n) {
    __m512 sv = _mm512_set1_ps(s);
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : avx512_tail_mask(n - i);
        __m512 r = _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), sv),
                                 _mm512_maskz_loadu_ps(m, w + i));
        _mm512_mask_storeu_ps(out + i, m, r);
    }
}

CPU_AVX512 static void avx512_swiglu(float *out, const float *g, const float *u, int64_t n) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : avx512_tail_mask(n - i);
        __m512 gv = _mm512_maskz_loadu_ps(m, g + i);
        __m512 e = avx512_exp(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        __m512 silu = _mm512_div_ps(gv, _mm512_add_ps(one, e));
        _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(silu, _mm512_maskz_loadu_ps(m, u + i)));
    }
}

CPU_AVX512 static void avx512_add(float *out, const float *a, const float *b, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : avx512_tail_mask(n - i);
        _mm512_mask_storeu_ps(
            out + i, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i)));
    }
}

CPU_AVX512 static void avx512_to_f16(uint16_t *y, const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : avx512_tail_mask(n - i);
        __m256i h = _mm512_cvtps_ph(_mm512_maskz_loadu_ps(m, x + i), _MM_FROUND_TO_NEAREST_INT);
        _mm256_mask_storeu_epi16(y + i, m, h);
    }
}

CPU_AVX512 CPU_INLINE __m512 avx512_load_kv(duet_dtype kvt, const void *base, int64_t i, __mmask16 m) {
    if (kvt == DUET_DTYPE_F16) return avx512_maskload_f16((const uint16_t *)base + i, m);
    return _mm512_maskz_loadu_ps(m, (const float *)base + i);
}

CPU_AVX512 CPU_INLINE void avx512_attend_t(duet_dtype KVT, const float *q, const void *k, const void *v,
                                           int64_t kvs, int64_t n, int hd, float scale, float *scores,
                                           float *out) {
    float mx = -INFINITY;
    for (int64_t p = 0; p < n; p++) {
        __m512 acc = _mm512_setzero_ps();
        for (int d = 0; d < hd; d += 16) {
            __mmask16 m = hd - d >= 16 ? (__mmask16)0xffff : avx512_tail_mask(hd - d);
            acc =
                _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, q + d), avx512_load_kv(KVT, k, p * kvs + d, m), acc);
        }
        float s = _mm512_reduce_add_ps(acc) * scale;
        scores[p] = s;
        mx = s > mx ? s : mx;
    }
    __m512 sumv = _mm512_setzero_ps(), mv = _mm512_set1_ps(mx);
    for (int64_t p = 0; p < n; p += 16) {
        __mmask16 m = n - p >= 16 ? (__mmask16)0xffff : avx512_tail_mask(n - p);
        __m512 e = avx512_exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, scores + p), mv));
        _mm512_mask_storeu_ps(scores + p, m, e);
        sumv = _mm512_mask_add_ps(sumv, m, sumv, e);
    }
    float inv = 1.0f / _mm512_reduce_add_ps(sumv);
    for (int d = 0; d < hd; d += 16) {
        __mmask16 m = hd - d >= 16 ? (__mmask16)0xffff : avx512_tail_mask(hd - d);
        /* Four independent chains hide the FMA latency. */
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        int64_t p = 0;
        for (; p + 4 <= n; p += 4) {
            a0 = _mm512_fmadd_ps(_mm512_set1_ps(scores[p]), avx512_load_kv(KVT, v, p * kvs + d, m), a0);
            a1 = _mm512_fmadd_ps(_mm512_set1_ps(scores[p + 1]), avx512_load_kv(KVT, v, (p + 1) * kvs + d, m),
                                 a1);
            a2 = _mm512_fmadd_ps(_mm512_set1_ps(scores[p + 2]), avx512_load_kv(KVT, v, (p + 2) * kvs + d, m),
                                 a2);
            a3 = _mm512_fmadd_ps(_mm512_set1_ps(scores[p + 3]), avx512_load_kv(KVT, v, (p + 3) * kvs + d, m),
                                 a3);
        }
        for (; p < n; p++)
            a0 = _mm512_fmadd_ps(_mm512_set1_ps(scores[p]), avx512_load_kv(KVT, v, p * kvs + d, m), a0);
        __m512 acc = _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3));
        _mm512_mask_storeu_ps(out + d, m, _mm512_mul_ps(acc, _mm512_set1_ps(inv)));
    }
}

CPU_AVX512 static void avx512_attend(const float *q, const void *k, const void *v, int64_t kvs,
                                     duet_dtype kvt, int64_t n, int hd, float scale, float *scores,
                                     float *out) {
    if (kvt == DUET_DTYPE_F16)
        avx512_attend_t(DUET_DTYPE_F16, q, k, v, kvs, n, hd, scale, scores, out);
    else
        avx512_attend_t(DUET_DTYPE_F32, q, k, v, kvs, n, hd, scale, scores, out);
}

static const vec_kernels vec_avx512 = {
    avx512_sumsq, avx512_scale_mul, avx512_swiglu, avx512_add, avx512_to_f16, avx512_attend,
};
#endif /* CPU_X86 */

static const vec_kernels *vec_for(cpu_isa isa) {
#if CPU_X86
    if (isa == CPU_ISA_AVX512) return &vec_avx512;
    if (isa == CPU_ISA_AVX2) return &vec_avx2;
#endif
    (void)isa;
    return &vec_scalar;
}

/* ======================================================================== */
/* row-parallel driver                                                        */
/* ======================================================================== */

/* fn(ctx, row, worker): worker indexes per-thread scratch. */
typedef void (*row_fn)(const void *ctx, int64_t row, int worker);

typedef struct rows_job {
    row_fn fn;
    const void *ctx;
    int64_t n;
} rows_job;

static void rows_task(void *p, int chunk, int n_chunks, int worker) {
    rows_job *j = p;
    int64_t lo, hi;
    cpu_split(j->n, chunk, n_chunks, 1, &lo, &hi);
    for (int64_t r = lo; r < hi; r++)
        j->fn(j->ctx, r, worker);
}

/* Runs fn on rows [0, n) in contiguous chunks; `work` (elements touched)
 * decides inline or threaded, `chunks_per_thread` how finely rows of
 * unequal cost are cut so the pool can balance them. */
static void run_rows(cpu_backend *be, int64_t n, int64_t work, int chunks_per_thread, row_fn fn,
                     const void *ctx) {
    rows_job j = {.fn = fn, .ctx = ctx, .n = n};
    int64_t max_chunks = (int64_t)be->pool.n_threads * chunks_per_thread;
    int chunks = (int)(n < max_chunks ? n : max_chunks);
    duet__cpu_pool_run(&be->pool, work >= CPU_PAR_MIN_WORK ? chunks : 1, rows_task, &j);
}

/* Per-thread slices of the work scratch, 64-byte aligned. */
static duet_status work_reserve(cpu_backend *be, size_t per_thread, size_t *stride) {
    *stride = (per_thread + 63) & ~(size_t)63;
    return duet__cpu_scratch_reserve(&be->work, *stride * (size_t)be->pool.n_threads);
}

/* ======================================================================== */
/* ops                                                                       */
/* ======================================================================== */

typedef struct embed_ctx {
    const int32_t *tokens;
    const uint8_t *table;
    size_t row_bytes;
    duet_dtype dtype;
    int dim;
    float *out;
} embed_ctx;

static void embed_row(const void *p, int64_t t, int worker) {
    const embed_ctx *c = p;
    duet_dequantize_row(c->dtype, c->table + (size_t)c->tokens[t] * c->row_bytes, c->out + t * c->dim,
                        c->dim);
}

duet_status duet__cpu_embed(cpu_backend *be, const duet_op *op, const int32_t *tokens, const void *table,
                            float *out) {
    embed_ctx c = {tokens,          table,         duet_dtype_row_bytes(op->embed.dtype, op->embed.dim),
                   op->embed.dtype, op->embed.dim, out};
    run_rows(be, op->n_tokens, (int64_t)op->n_tokens * op->embed.dim, 4, embed_row, &c);
    return DUET_OK;
}

typedef struct rms_ctx {
    const vec_kernels *vk;
    const float *x, *w;
    float *out;
    int dim;
    float eps;
} rms_ctx;

static void rms_row(const void *p, int64_t t, int worker) {
    const rms_ctx *c = p;
    const float *x = c->x + t * c->dim;
    float ms = c->vk->sumsq(x, c->dim) / (float)c->dim;
    c->vk->scale_mul(c->out + t * c->dim, x, c->w, 1.0f / sqrtf(ms + c->eps), c->dim);
}

duet_status duet__cpu_rmsnorm(cpu_backend *be, const duet_op *op, const float *x, const float *w,
                              float *out) {
    rms_ctx c = {vec_for(be->isa), x, w, out, op->rmsnorm.dim, op->rmsnorm.eps};
    run_rows(be, op->n_tokens, (int64_t)op->n_tokens * op->rmsnorm.dim, 4, rms_row, &c);
    return DUET_OK;
}

typedef struct rope_ctx {
    const vec_kernels *vk;
    float *q, *k;
    const float *v;
    const int32_t *pos, *seq;
    uint8_t *kc, *vc;
    duet_dtype kvt;
    int n_head, n_head_kv, hd, n_rot, n_ctx;
    bool neox;
    const double *freq;
    uint8_t *scratch; /* per thread: cos[n_rot/2], sin[n_rot/2] */
    size_t scratch_stride;
} rope_ctx;

static void rope_rotate(float *x, const float *cs, const float *sn, int half, bool neox) {
    /* Pair i is (2i, 2i+1), or (i, i + half) in GPT-NeoX order. */
    int stride = neox ? 1 : 2, off = neox ? half : 1;
    for (int i = 0; i < half; i++) {
        float *a = x + i * stride, *b = a + off;
        float x0 = *a, x1 = *b;
        *a = x0 * cs[i] - x1 * sn[i];
        *b = x0 * sn[i] + x1 * cs[i];
    }
}

static void rope_row(const void *p, int64_t t, int worker) {
    const rope_ctx *c = p;
    int half = c->n_rot / 2;
    float *cs = (float *)(c->scratch + (size_t)worker * c->scratch_stride), *sn = cs + half;
    int32_t pos = c->pos[t];
    for (int i = 0; i < half; i++) { /* double: angles reach pos * 1 rad */
        double th = (double)pos * c->freq[i];
        cs[i] = (float)cos(th);
        sn[i] = (float)sin(th);
    }
    int64_t qw = (int64_t)c->n_head * c->hd, kw = (int64_t)c->n_head_kv * c->hd;
    for (int h = 0; h < c->n_head; h++)
        rope_rotate(c->q + t * qw + h * c->hd, cs, sn, half, c->neox);
    float *k = c->k + t * kw;
    for (int h = 0; h < c->n_head_kv; h++)
        rope_rotate(k + h * c->hd, cs, sn, half, c->neox);
    int64_t slot = ((int64_t)c->seq[t] * c->n_ctx + pos) * kw;
    if (c->kvt == DUET_DTYPE_F16) {
        c->vk->to_f16((uint16_t *)c->kc + slot, k, kw);
        c->vk->to_f16((uint16_t *)c->vc + slot, c->v + t * kw, kw);
    } else {
        memcpy((float *)c->kc + slot, k, (size_t)kw * sizeof(float));
        memcpy((float *)c->vc + slot, c->v + t * kw, (size_t)kw * sizeof(float));
    }
}

duet_status duet__cpu_rope_kv(cpu_backend *be, const duet_op *op, float *q, float *k, const float *v,
                              const int32_t *pos, const int32_t *seq, void *k_cache, void *v_cache) {
    int half = op->rope_kv.n_rot / 2;
    /* Inverse frequencies base^(-2i/n_rot), in double, cached across ops
     * (every layer uses the same ones). */
    if (half > 0 &&
        (!be->rope_freq || be->rope_base != op->rope_kv.freq_base || be->rope_n_rot != op->rope_kv.n_rot)) {
        double *f = realloc(be->rope_freq, (size_t)half * sizeof(double));
        if (!f) return duet__error(DUET_OUT_OF_MEMORY, "rope_kv: frequency table");
        for (int i = 0; i < half; i++)
            f[i] = pow((double)op->rope_kv.freq_base, -2.0 * i / op->rope_kv.n_rot);
        be->rope_freq = f;
        be->rope_base = op->rope_kv.freq_base;
        be->rope_n_rot = op->rope_kv.n_rot;
    }
    size_t stride;
    duet_status st = work_reserve(be, (size_t)(half > 0 ? half : 1) * 2 * sizeof(float), &stride);
    if (st != DUET_OK) return st;
    rope_ctx c = {
        .vk = vec_for(be->isa),
        .q = q,
        .k = k,
        .v = v,
        .pos = pos,
        .seq = seq,
        .kc = k_cache,
        .vc = v_cache,
        .kvt = op->rope_kv.kv_dtype,
        .n_head = op->rope_kv.n_head,
        .n_head_kv = op->rope_kv.n_head_kv,
        .hd = op->rope_kv.head_dim,
        .n_rot = op->rope_kv.n_rot,
        .n_ctx = op->rope_kv.n_ctx,
        .neox = op->rope_kv.neox,
        .freq = be->rope_freq,
        .scratch = be->work.p,
        .scratch_stride = stride,
    };
    int64_t work =
        (int64_t)op->n_tokens * (op->rope_kv.n_head + 2 * op->rope_kv.n_head_kv) * op->rope_kv.head_dim;
    run_rows(be, op->n_tokens, work, 4, rope_row, &c);
    return DUET_OK;
}

typedef struct attn_ctx {
    const vec_kernels *vk;
    const float *q;
    const int32_t *pos, *seq;
    const uint8_t *kc, *vc;
    duet_dtype kvt;
    int n_head, group, hd, n_ctx;
    float scale;
    float *out;
    uint8_t *scratch; /* per thread: q copy [hd], scores [n_ctx] */
    size_t scratch_stride;
} attn_ctx;

static void attn_row(const void *p, int64_t unit, int worker) {
    const attn_ctx *c = p;
    int64_t t = unit / c->n_head;
    int h = (int)(unit % c->n_head), kvh = h / c->group;
    int64_t qw = (int64_t)c->n_head * c->hd, kvs = (int64_t)(c->n_head / c->group) * c->hd;
    size_t esize = c->kvt == DUET_DTYPE_F16 ? 2 : 4;
    float *qc = (float *)(c->scratch + (size_t)worker * c->scratch_stride);
    float *scores = qc + ((c->hd + 15) & ~15);
    /* Copy q first: out may alias q, and unit (t, h) is the only reader of
     * q[t][h] and the only writer of out[t][h]. */
    memcpy(qc, c->q + t * qw + (int64_t)h * c->hd, (size_t)c->hd * sizeof(float));
    size_t first = ((size_t)c->seq[t] * (size_t)c->n_ctx * (size_t)kvs + (size_t)kvh * (size_t)c->hd) * esize;
    c->vk->attend(qc, c->kc + first, c->vc + first, kvs, c->kvt, (int64_t)c->pos[t] + 1, c->hd, c->scale,
                  scores, c->out + t * qw + (int64_t)h * c->hd);
}

duet_status duet__cpu_attention(cpu_backend *be, const duet_op *op, const float *q, const int32_t *pos,
                                const int32_t *seq, const void *k_cache, const void *v_cache, float *out) {
    int hd = op->attention.head_dim;
    size_t stride;
    duet_status st = work_reserve(
        be, ((size_t)((hd + 15) & ~15) + (size_t)op->attention.n_ctx + 16) * sizeof(float), &stride);
    if (st != DUET_OK) return st;
    attn_ctx c = {
        .vk = vec_for(be->isa),
        .q = q,
        .pos = pos,
        .seq = seq,
        .kc = k_cache,
        .vc = v_cache,
        .kvt = op->attention.kv_dtype,
        .n_head = op->attention.n_head,
        .group = op->attention.n_head / op->attention.n_head_kv,
        .hd = hd,
        .n_ctx = op->attention.n_ctx,
        .scale = op->attention.scale,
        .out = out,
        .scratch = be->work.p,
        .scratch_stride = stride,
    };
    int64_t work = 0;
    for (int t = 0; t < op->n_tokens; t++)
        work += ((int64_t)pos[t] + 1) * hd * 2 * op->attention.n_head;
    /* Causal rows differ in length: cut (token, head) units finely so the
     * pool balances them. */
    run_rows(be, (int64_t)op->n_tokens * op->attention.n_head, work, 16, attn_row, &c);
    return DUET_OK;
}

typedef struct ew_ctx {
    const vec_kernels *vk;
    const float *a, *b;
    float *out;
    int dim;
} ew_ctx;

static void swiglu_row(const void *p, int64_t t, int worker) {
    const ew_ctx *c = p;
    c->vk->swiglu(c->out + t * c->dim, c->a + t * c->dim, c->b + t * c->dim, c->dim);
}

static void add_row(const void *p, int64_t t, int worker) {
    const ew_ctx *c = p;
    c->vk->add(c->out + t * c->dim, c->a + t * c->dim, c->b + t * c->dim, c->dim);
}

duet_status duet__cpu_swiglu(cpu_backend *be, const duet_op *op, const float *gate, const float *up,
                             float *out) {
    ew_ctx c = {vec_for(be->isa), gate, up, out, op->swiglu.dim};
    /* exp costs ~10 elements' worth of streaming: weigh it so. */
    run_rows(be, op->n_tokens, (int64_t)op->n_tokens * op->swiglu.dim * 4, 4, swiglu_row, &c);
    return DUET_OK;
}

duet_status duet__cpu_add(cpu_backend *be, const duet_op *op, const float *a, const float *b, float *out) {
    ew_ctx c = {vec_for(be->isa), a, b, out, op->add.dim};
    run_rows(be, op->n_tokens, (int64_t)op->n_tokens * op->add.dim, 4, add_row, &c);
    return DUET_OK;
}

typedef struct gather_ctx {
    const float *x;
    const int32_t *rows;
    float *out;
    int dim;
} gather_ctx;

static void gather_row(const void *p, int64_t i, int worker) {
    const gather_ctx *c = p;
    memcpy(c->out + i * c->dim, c->x + (int64_t)c->rows[i] * c->dim, (size_t)c->dim * sizeof(float));
}

duet_status duet__cpu_gather(cpu_backend *be, const duet_op *op, const float *x, const int32_t *rows,
                             float *out) {
    gather_ctx c = {x, rows, out, op->gather.dim};
    run_rows(be, op->n_tokens, (int64_t)op->n_tokens * op->gather.dim, 4, gather_row, &c);
    return DUET_OK;
}

typedef struct argmax_ctx {
    const float *x;
    int32_t *out;
    int dim;
} argmax_ctx;

/* Strict '>' keeps the lowest index among equal maxima; NaNs never win
 * (an all-NaN row gives 0). */
static void argmax_row(const void *p, int64_t t, int worker) {
    const argmax_ctx *c = p;
    const float *x = c->x + t * c->dim;
    int32_t best = 0;
    float bv = -INFINITY;
    bool found = false;
    for (int j = 0; j < c->dim; j++) {
        if (x[j] > bv || (!found && x[j] == bv)) {
            bv = x[j];
            best = j;
            found = true;
        }
    }
    c->out[t] = best;
}

duet_status duet__cpu_argmax(cpu_backend *be, const duet_op *op, const float *x, int32_t *out) {
    argmax_ctx c = {x, out, op->argmax.dim};
    run_rows(be, op->n_tokens, (int64_t)op->n_tokens * op->argmax.dim, 4, argmax_row, &c);
    return DUET_OK;
}
