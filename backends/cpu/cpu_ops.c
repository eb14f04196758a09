/* cpu_ops.c — every op except MATMUL, and the vector kernels they use.
 *
 * Ops are parallel over rows (tokens); one whose work is smaller than a
 * dispatch's cost runs on the caller alone, since decode issues many tiny
 * ops per token. Attention over the paged KV cache is FlashAttention-style
 * (online softmax over key tiles read through the block table, never a
 * score row longer than a tile), parallel over (query tile, kv heads) items
 * and, for decode with few such items, over context chunks (flash-decoding).
 * rmsnorm, swiglu and attention quantise their rows to q8_0 in the same
 * pass when asked (out_q8). */
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

static const vec_kernels vec_scalar = {
    scalar_sumsq, scalar_scale_mul, scalar_swiglu, scalar_add, scalar_to_f16,
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

static const vec_kernels vec_avx2 = {
    avx2_sumsq, avx2_scale_mul, avx2_swiglu, avx2_add, avx2_to_f16,
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

static const vec_kernels vec_avx512 = {
    avx512_sumsq, avx512_scale_mul, avx512_swiglu, avx512_add, avx512_to_f16,
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
/* attention tile kernels                                                    */
/* ======================================================================== */

/* FlashAttention on the CPU. A work item holds R query rows (the heads of
 * one kv head, for one or a few tokens of one sequence) and walks its keys
 * in tiles of ATT_TK, keeping per row a running max m, a running sum l and
 * an unnormalised accumulator acc[hd]: no score row longer than a tile
 * exists. The kernels below run one tile's three steps for all R rows. K/V
 * rows arrive as pointers (one per key, already offset to the kv head)
 * because a tile may span blocks of the paged cache. */
#define ATT_TK 16

/* Fixed-count loops over register arrays must be unrolled for the arrays to
 * live in registers (GCC's -O2 keeps them in memory otherwise). */
#define CPU_PRAGMA(x) _Pragma(#x)
#define CPU_UNROLL(n) CPU_PRAGMA(GCC unroll n)

/* Element types of K/V rows as kernels read them: the pool's dtype, or a
 * staged tile (KV_Q8S: q8_0 quants as floats, then the block scales). */
enum { KV_F32, KV_F16, KV_Q8, KV_N, KV_Q8S = KV_N, KV_KINDS };

typedef struct attn_kernels {
    /* s[r * ATT_TK + j] = q_r . K_j for keys j < nk (q rows hd apart, already
     * scaled); lanes nk..ATT_TK-1 are left unspecified. */
    void (*qk[KV_KINDS])(const float *q, int R, const uint8_t *const *k, int nk, int hd, float *s);
    /* acc[r * hd + d] += sum_j p[r * ATT_TK + j] V_j[d], j < nk. */
    void (*pv[KV_KINDS])(const float *p, int R, const uint8_t *const *v, int nk, int hd, float *acc);
    /* Converts a tile once for many rows into rows of kind staged[kvi]
     * (stride hd, or hd + hd/32 for KV_Q8S). */
    void (*stage[KV_N])(const uint8_t *const *src, int nk, int hd, float *dst);
    int staged[KV_N];
    /* Online softmax over one tile: row r sees the first nvalid[r] keys.
     * Turns s into probabilities (0 past nvalid), raises m, rescales l and
     * the acc row by exp(m_old - m_new) when the max grows, adds to l. */
    void (*softmax)(float *s, int R, const int *nvalid, float *m, float *l, float *acc, int hd);
    /* Items with at least this many rows convert f16/q8_0 tiles to f32 once
     * (stage) instead of converting in registers for every row. */
    int stage_rows;
} attn_kernels;

/* ---- scalar (also the path for head_dim % 16 != 0) ---------------------- */

CPU_INLINE float kv_elem(int kvi, const uint8_t *row, int d) {
    if (kvi == KV_F32) return ((const float *)row)[d];
    if (kvi == KV_F16) return duet_fp16_to_fp32(((const uint16_t *)row)[d]);
    const duet_block_q8_0 *b = (const duet_block_q8_0 *)row + d / DUET_QK8_0;
    return duet_fp16_to_fp32(b->d) * (float)b->qs[d % DUET_QK8_0];
}

CPU_INLINE void scalar_qk_t(int kvi, const float *q, int R, const uint8_t *const *k, int nk, int hd,
                            float *s) {
    for (int r = 0; r < R; r++)
        for (int j = 0; j < nk; j++) {
            float acc = 0.0f;
            for (int d = 0; d < hd; d++)
                acc += q[(size_t)r * hd + d] * kv_elem(kvi, k[j], d);
            s[r * ATT_TK + j] = acc;
        }
}

CPU_INLINE void scalar_pv_t(int kvi, const float *p, int R, const uint8_t *const *v, int nk, int hd,
                            float *acc) {
    for (int r = 0; r < R; r++)
        for (int j = 0; j < nk; j++) {
            float w = p[r * ATT_TK + j];
            if (w == 0.0f) continue; /* masked */
            for (int d = 0; d < hd; d++)
                acc[(size_t)r * hd + d] += w * kv_elem(kvi, v[j], d);
        }
}

static void scalar_qk_f32(const float *q, int R, const uint8_t *const *k, int nk, int hd, float *s) {
    scalar_qk_t(KV_F32, q, R, k, nk, hd, s);
}
static void scalar_qk_f16(const float *q, int R, const uint8_t *const *k, int nk, int hd, float *s) {
    scalar_qk_t(KV_F16, q, R, k, nk, hd, s);
}
static void scalar_qk_q8(const float *q, int R, const uint8_t *const *k, int nk, int hd, float *s) {
    scalar_qk_t(KV_Q8, q, R, k, nk, hd, s);
}
static void scalar_pv_f32(const float *p, int R, const uint8_t *const *v, int nk, int hd, float *acc) {
    scalar_pv_t(KV_F32, p, R, v, nk, hd, acc);
}
static void scalar_pv_f16(const float *p, int R, const uint8_t *const *v, int nk, int hd, float *acc) {
    scalar_pv_t(KV_F16, p, R, v, nk, hd, acc);
}
static void scalar_pv_q8(const float *p, int R, const uint8_t *const *v, int nk, int hd, float *acc) {
    scalar_pv_t(KV_Q8, p, R, v, nk, hd, acc);
}
static void scalar_stage_f16(const uint8_t *const *src, int nk, int hd, float *dst) {
    for (int j = 0; j < nk; j++)
        duet_dequantize_row(DUET_DTYPE_F16, src[j], dst + (size_t)j * hd, hd);
}
static void scalar_stage_q8(const uint8_t *const *src, int nk, int hd, float *dst) {
    for (int j = 0; j < nk; j++)
        duet_dequantize_row(DUET_DTYPE_Q8_0, src[j], dst + (size_t)j * hd, hd);
}

/* The max only rises; the first tile of a row finds m = -inf, and
 * exp(-inf) = 0 clears the (zero) accumulator harmlessly. */
static void scalar_softmax(float *s, int R, const int *nvalid, float *m, float *l, float *acc, int hd) {
    for (int r = 0; r < R; r++) {
        float *sr = s + r * ATT_TK;
        int nv = nvalid[r];
        float mx = -INFINITY;
        for (int j = 0; j < nv; j++)
            mx = fmaxf(mx, sr[j]);
        if (nv > 0 && mx > m[r]) {
            float c = expf(m[r] - mx);
            l[r] *= c;
            for (int d = 0; d < hd; d++)
                acc[(size_t)r * hd + d] *= c;
            m[r] = mx;
        }
        float sum = 0.0f;
        for (int j = 0; j < ATT_TK; j++) {
            sr[j] = j < nv ? expf(sr[j] - m[r]) : 0.0f;
            sum += sr[j];
        }
        l[r] += sum;
    }
}

static const attn_kernels attn_scalar = {
    .qk = {scalar_qk_f32, scalar_qk_f16, scalar_qk_q8},
    .pv = {scalar_pv_f32, scalar_pv_f16, scalar_pv_q8},
    .stage = {NULL, scalar_stage_f16, scalar_stage_q8},
    .staged = {KV_F32, KV_F32, KV_F32},
    .softmax = scalar_softmax,
    .stage_rows = 1, /* software fp16 conversion: always convert once */
};

#if CPU_X86
/* ---- avx2: 8 floats per chunk; head_dim % 16 == 0 ----------------------- */

/* Chunk c (8 values) of a K/V row as f32 before any block scale: f32 and
 * f16 values as they are, q8_0 quants (KV_Q8) or staged quants (KV_Q8S) as
 * floats; avx2_kv_scale gives the scale of their 32-block. Whether a tile
 * is read in place or staged, the same values meet the same arithmetic. */
CPU_AVX2 CPU_INLINE __m256 avx2_kv_vals(int kvi, const uint8_t *row, int c) {
    if (kvi == KV_F16) return avx2_load_f16((const uint16_t *)row + 8 * c);
    if (kvi == KV_Q8) {
        const duet_block_q8_0 *b = (const duet_block_q8_0 *)row + c / 4;
        return _mm256_cvtepi32_ps(
            _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b->qs + 8 * (c & 3)))));
    }
    return _mm256_loadu_ps((const float *)row + 8 * c);
}

CPU_AVX2 CPU_INLINE float avx2_kv_scale(int kvi, const uint8_t *row, int b, int hd) {
    if (kvi == KV_Q8) return _cvtsh_ss(((const duet_block_q8_0 *)row)[b].d);
    return ((const float *)row)[hd + b]; /* KV_Q8S: scales after the values */
}

/* Lane j of the result = sum of the lanes of v[j] (8 horizontal sums in 21
 * shuffles/adds instead of 8 separate reductions). */
CPU_AVX2 CPU_INLINE __m256 avx2_reduce8(const __m256 *v) {
    __m256 t[4], u[2];
    CPU_UNROLL(4)
    for (int i = 0; i < 4; i++) /* per 128-bit lane: a0+a2, b0+b2, a1+a3, b1+b3 */
        t[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    CPU_UNROLL(2)
    for (int i = 0; i < 2; i++) /* per lane: the lane sums of v[4i..4i+3] */
        u[i] = _mm256_add_ps(_mm256_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm256_add_ps(_mm256_permute2f128_ps(u[0], u[1], 0x20), _mm256_permute2f128_ps(u[0], u[1], 0x31));
}

/* Scores of keys [j0, j0 + 8) for one query row. q8_0: per 32-block the
 * unscaled dot, then times the block's scale. */
CPU_AVX2 CPU_INLINE void avx2_qk8(int kvi, const float *qr, const uint8_t *const *k, int j0, int nk, int hd,
                                  float *s) {
    __m256 acc[8];
    CPU_UNROLL(8)
    for (int j = 0; j < 8; j++)
        acc[j] = _mm256_setzero_ps();
    if (kvi == KV_Q8 || kvi == KV_Q8S) {
        for (int b = 0; b < hd / 32; b++) {
            __m256 q[4];
            CPU_UNROLL(4)
            for (int cc = 0; cc < 4; cc++)
                q[cc] = _mm256_loadu_ps(qr + 32 * b + 8 * cc);
            CPU_UNROLL(8)
            for (int j = 0; j < 8; j++)
                if (j0 + j < nk) {
                    const uint8_t *row = k[j0 + j];
                    __m256 t = _mm256_mul_ps(q[0], avx2_kv_vals(kvi, row, 4 * b));
                    CPU_UNROLL(3)
                    for (int cc = 1; cc < 4; cc++)
                        t = _mm256_fmadd_ps(q[cc], avx2_kv_vals(kvi, row, 4 * b + cc), t);
                    acc[j] = _mm256_fmadd_ps(t, _mm256_set1_ps(avx2_kv_scale(kvi, row, b, hd)), acc[j]);
                }
        }
    } else {
        for (int c = 0; c < hd / 8; c++) {
            __m256 qc = _mm256_loadu_ps(qr + 8 * c);
            CPU_UNROLL(8)
            for (int j = 0; j < 8; j++)
                if (j0 + j < nk) acc[j] = _mm256_fmadd_ps(qc, avx2_kv_vals(kvi, k[j0 + j], c), acc[j]);
        }
    }
    _mm256_storeu_ps(s + j0, avx2_reduce8(acc));
}

CPU_AVX2 CPU_INLINE void avx2_qk_t(int kvi, const float *q, int R, const uint8_t *const *k, int nk, int hd,
                                   float *s) {
    for (int r = 0; r < R; r++) {
        avx2_qk8(kvi, q + (size_t)r * hd, k, 0, nk, hd, s + r * ATT_TK);
        if (nk > 8) avx2_qk8(kvi, q + (size_t)r * hd, k, 8, nk, hd, s + r * ATT_TK);
    }
}

/* NR rows x PC chunks from chunk c0, in registers across the tile's keys.
 * Even and odd keys go to two accumulator sets (more FMA chains in flight),
 * summed at the end of the tile. Every row sees exactly this order whatever
 * NR is, so a row's result does not depend on which rows share its item:
 * attention is invariant to how tokens are batched. q8_0 weighs a key's
 * quants by p times the block scale. */
CPU_AVX2 CPU_INLINE void avx2_pv_key(int kvi, int NR, int PC, const float *p, const uint8_t *row, int j,
                                     int hd, int c0, __m256 (*a)[4]) {
    __m256 x[4];
    CPU_UNROLL(4)
    for (int c = 0; c < PC; c++)
        x[c] = avx2_kv_vals(kvi, row, c0 + c);
    const bool q8 = kvi == KV_Q8 || kvi == KV_Q8S;
    /* The panel's chunks lie in at most two 32-blocks. */
    const int b0 = c0 / 4;
    const float d0 = q8 ? avx2_kv_scale(kvi, row, b0, hd) : 1.0f;
    const float d1 = q8 && PC > 4 ? avx2_kv_scale(kvi, row, b0 + 1, hd) : 1.0f;
    CPU_UNROLL(1)
    for (int r = 0; r < NR; r++) {
        const float pj = p[r * ATT_TK + j];
        const __m256 w0 = _mm256_set1_ps(q8 ? pj * d0 : pj), w1 = _mm256_set1_ps(q8 ? pj * d1 : pj);
        CPU_UNROLL(4)
        for (int c = 0; c < PC; c++)
            a[r][c] = _mm256_fmadd_ps(c < 4 ? w0 : w1, x[c], a[r][c]);
    }
}

CPU_AVX2 CPU_INLINE void avx2_pv_panel(int kvi, int NR, int PC, const float *p, const uint8_t *const *v,
                                       int nk, int hd, int c0, float *acc) {
    __m256 a[2][1][4]; /* [even/odd key][row][chunk] */
    CPU_UNROLL(1)
    for (int r = 0; r < NR; r++)
        CPU_UNROLL(4)
    for (int c = 0; c < PC; c++) {
        a[0][r][c] = _mm256_loadu_ps(acc + (size_t)r * hd + 8 * (c0 + c));
        a[1][r][c] = _mm256_setzero_ps();
    }
    int j = 0;
    for (; j + 2 <= nk; j += 2) {
        avx2_pv_key(kvi, NR, PC, p, v[j], j, hd, c0, a[0]);
        avx2_pv_key(kvi, NR, PC, p, v[j + 1], j + 1, hd, c0, a[1]);
    }
    if (j < nk) avx2_pv_key(kvi, NR, PC, p, v[j], j, hd, c0, a[0]);
    CPU_UNROLL(1)
    for (int r = 0; r < NR; r++)
        CPU_UNROLL(4)
    for (int c = 0; c < PC; c++)
        _mm256_storeu_ps(acc + (size_t)r * hd + 8 * (c0 + c), _mm256_add_ps(a[0][r][c], a[1][r][c]));
}

CPU_AVX2 CPU_INLINE void avx2_pv_t(int kvi, const float *p, int R, const uint8_t *const *v, int nk, int hd,
                                   float *acc) {
    const int nc = hd / 8;
    for (int c0 = 0; c0 < nc;) {
        const int pc = nc - c0 >= 4 ? 4 : nc - c0 >= 2 ? 2 : 1;
        for (int r = 0; r < R;) {
            const int nr = R - r >= 1 ? 1 : 1;
            const float *pr = p + r * ATT_TK;
            float *ar = acc + (size_t)r * hd;
            switch (nr * 8 + pc) {
            case 1 * 8 + 4:
                avx2_pv_panel(kvi, 1, 4, pr, v, nk, hd, c0, ar);
                break;
            case 1 * 8 + 2:
                avx2_pv_panel(kvi, 1, 2, pr, v, nk, hd, c0, ar);
                break;
            default:
                avx2_pv_panel(kvi, 1, 1, pr, v, nk, hd, c0, ar);
                break;
            }
            r += nr;
        }
        c0 += pc;
    }
}

/* Tile staging: f16 rows to f32 (stride hd); q8_0 rows to unscaled quants
 * followed by the hd/32 block scales (KV_Q8S, stride hd + hd/32). */
CPU_AVX2 CPU_INLINE void avx2_stage_t(int kvi, const uint8_t *const *src, int nk, int hd, float *dst) {
    const size_t stride = (size_t)hd + (kvi == KV_Q8 ? (size_t)hd / 32 : 0);
    for (int j = 0; j < nk; j++) {
        float *row = dst + (size_t)j * stride;
        for (int c = 0; c < hd / 8; c++)
            _mm256_storeu_ps(row + 8 * c, avx2_kv_vals(kvi, src[j], c));
        if (kvi == KV_Q8)
            for (int b = 0; b < hd / 32; b++)
                row[hd + b] = avx2_kv_scale(kvi, src[j], b, hd);
    }
}

CPU_AVX2 static void avx2_softmax(float *s, int R, const int *nvalid, float *m, float *l, float *acc,
                                  int hd) {
    const __m256 idx0 = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7),
                 idx1 = _mm256_setr_ps(8, 9, 10, 11, 12, 13, 14, 15);
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    for (int r = 0; r < R; r++) {
        float *sr = s + r * ATT_TK;
        const __m256 nv = _mm256_set1_ps((float)nvalid[r]);
        const __m256 k0 = _mm256_cmp_ps(idx0, nv, _CMP_LT_OQ), k1 = _mm256_cmp_ps(idx1, nv, _CMP_LT_OQ);
        __m256 s0 = _mm256_blendv_ps(ninf, _mm256_loadu_ps(sr), k0);
        __m256 s1 = _mm256_blendv_ps(ninf, _mm256_loadu_ps(sr + 8), k1);
        float mx = avx2_hmax(_mm256_max_ps(s0, s1));
        if (nvalid[r] > 0 && mx > m[r]) {
            float c = expf(m[r] - mx);
            l[r] *= c;
            __m256 cv = _mm256_set1_ps(c);
            for (int d = 0; d < hd; d += 8)
                _mm256_storeu_ps(acc + (size_t)r * hd + d,
                                 _mm256_mul_ps(_mm256_loadu_ps(acc + (size_t)r * hd + d), cv));
            m[r] = mx;
        }
        __m256 mv = _mm256_set1_ps(m[r]);
        __m256 p0 = _mm256_and_ps(k0, avx2_exp(_mm256_sub_ps(s0, mv)));
        __m256 p1 = _mm256_and_ps(k1, avx2_exp(_mm256_sub_ps(s1, mv)));
        _mm256_storeu_ps(sr, p0);
        _mm256_storeu_ps(sr + 8, p1);
        l[r] += avx2_hsum(_mm256_add_ps(p0, p1));
    }
}

CPU_AVX2 static void avx2_qk_f32(const float *q, int R, const uint8_t *const *k, int nk, int hd, float *s) {
    avx2_qk_t(KV_F32, q, R, k, nk, hd, s);
}
CPU_AVX2 static void avx2_qk_f16(const float *q, int R, const uint8_t *const *k, int nk, int hd, float *s) {
    avx2_qk_t(KV_F16, q, R, k, nk, hd, s);
}
CPU_AVX2 static void avx2_qk_q8(const float *q, int R, const uint8_t *const *k, int nk, int hd, float *s) {
    avx2_qk_t(KV_Q8, q, R, k, nk, hd, s);
}
CPU_AVX2 static void avx2_pv_f32(const float *p, int R, const uint8_t *const *v, int nk, int hd, float *acc) {
    avx2_pv_t(KV_F32, p, R, v, nk, hd, acc);
}
CPU_AVX2 static void avx2_pv_f16(const float *p, int R, const uint8_t *const *v, int nk, int hd, float *acc) {
    avx2_pv_t(KV_F16, p, R, v, nk, hd, acc);
}
CPU_AVX2 static void avx2_pv_q8(const float *p, int R, const uint8_t *const *v, int nk, int hd, float *acc) {
    avx2_pv_t(KV_Q8, p, R, v, nk, hd, acc);
}
CPU_AVX2 static void avx2_qk_q8s(const float *q, int R, const uint8_t *const *k, int nk, int hd, float *s) {
    avx2_qk_t(KV_Q8S, q, R, k, nk, hd, s);
}
CPU_AVX2 static void avx2_pv_q8s(const float *p, int R, const uint8_t *const *v, int nk, int hd, float *acc) {
    avx2_pv_t(KV_Q8S, p, R, v, nk, hd, acc);
}
CPU_AVX2 static void avx2_stage_f16(const uint8_t *const *src, int nk, int hd, float *dst) {
    avx2_stage_t(KV_F16, src, nk, hd, dst);
}
CPU_AVX2 static void avx2_stage_q8(const uint8_t *const *src, int nk, int hd, float *dst) {
    avx2_stage_t(KV_Q8, src, nk, hd, dst);
}

static const attn_kernels attn_avx2 = {
    .qk = {avx2_qk_f32, avx2_qk_f16, avx2_qk_q8, avx2_qk_q8s},
    .pv = {avx2_pv_f32, avx2_pv_f16, avx2_pv_q8, avx2_pv_q8s},
    .stage = {NULL, avx2_stage_f16, avx2_stage_q8},
    .staged = {KV_F32, KV_F32, KV_Q8S},
    .softmax = avx2_softmax,
    .stage_rows = 3,
};

/* ---- avx512: 16 floats per chunk; head_dim % 16 == 0 --------------------- */

/* Chunk c (16 values) of a K/V row as f32 before any block scale: f32 and
 * f16 values as they are, q8_0 quants (KV_Q8) or staged quants (KV_Q8S) as
 * floats; avx512_kv_scale gives the scale of their 32-block. Whether a tile
 * is read in place or staged, the same values meet the same arithmetic. */
CPU_AVX512 CPU_INLINE __m512 avx512_kv_vals(int kvi, const uint8_t *row, int c) {
    if (kvi == KV_F16) return avx512_load_f16((const uint16_t *)row + 16 * c);
    if (kvi == KV_Q8) {
        const duet_block_q8_0 *b = (const duet_block_q8_0 *)row + c / 2;
        return _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b->qs + 16 * (c & 1)))));
    }
    return _mm512_loadu_ps((const float *)row + 16 * c);
}

CPU_AVX512 CPU_INLINE float avx512_kv_scale(int kvi, const uint8_t *row, int b, int hd) {
    if (kvi == KV_Q8) return _cvtsh_ss(((const duet_block_q8_0 *)row)[b].d);
    return ((const float *)row)[hd + b]; /* KV_Q8S: scales after the values */
}

/* Lane j of the result = sum of the lanes of v[j]: 16 horizontal sums in
 * 45 shuffles/adds. */
CPU_AVX512 CPU_INLINE __m512 avx512_reduce16(const __m512 *v) {
    __m512 t[8], u[4];
    CPU_UNROLL(8)
    for (int i = 0; i < 8; i++) /* per 128-bit lane: a0+a2, b0+b2, a1+a3, b1+b3 */
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    CPU_UNROLL(4)
    for (int i = 0; i < 4; i++) /* per 128-bit lane: the lane sums of v[4i..4i+3] */
        u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    /* Add 128-bit lanes pairwise, twice: lane k ends as the sums of v[4k..4k+3]. */
    __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
    __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(w0, w1, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* Scores of a tile's keys for each query row. q8_0: per 32-block the
 * unscaled dot, then times the block's scale. */
CPU_AVX512 CPU_INLINE void avx512_qk_t(int kvi, const float *q, int R, const uint8_t *const *k, int nk,
                                       int hd, float *s) {
    for (int r = 0; r < R; r++) {
        const float *qr = q + (size_t)r * hd;
        __m512 acc[ATT_TK];
        CPU_UNROLL(16)
        for (int j = 0; j < ATT_TK; j++)
            acc[j] = _mm512_setzero_ps();
        if (kvi == KV_Q8 || kvi == KV_Q8S) {
            for (int b = 0; b < hd / 32; b++) {
                __m512 q0 = _mm512_loadu_ps(qr + 32 * b), q1 = _mm512_loadu_ps(qr + 32 * b + 16);
                CPU_UNROLL(16)
                for (int j = 0; j < ATT_TK; j++)
                    if (j < nk) {
                        __m512 t = _mm512_mul_ps(q0, avx512_kv_vals(kvi, k[j], 2 * b));
                        t = _mm512_fmadd_ps(q1, avx512_kv_vals(kvi, k[j], 2 * b + 1), t);
                        acc[j] =
                            _mm512_fmadd_ps(t, _mm512_set1_ps(avx512_kv_scale(kvi, k[j], b, hd)), acc[j]);
                    }
            }
        } else {
            for (int c = 0; c < hd / 16; c++) {
                __m512 qc = _mm512_loadu_ps(qr + 16 * c);
                CPU_UNROLL(16)
                for (int j = 0; j < ATT_TK; j++)
                    if (j < nk) acc[j] = _mm512_fmadd_ps(qc, avx512_kv_vals(kvi, k[j], c), acc[j]);
            }
        }
        _mm512_storeu_ps(s + r * ATT_TK, avx512_reduce16(acc));
    }
}

/* NR rows x PC chunks from chunk c0, in registers across the tile's keys.
 * Even and odd keys go to two accumulator sets (more FMA chains in flight),
 * summed at the end of the tile. Every row sees exactly this order whatever
 * NR is, so a row's result does not depend on which rows share its item:
 * attention is invariant to how tokens are batched. q8_0 weighs a key's
 * quants by p times the block scale. */
CPU_AVX512 CPU_INLINE void avx512_pv_key(int kvi, int NR, int PC, const float *p, const uint8_t *row, int j,
                                         int hd, int c0, __m512 (*a)[4]) {
    __m512 x[4];
    CPU_UNROLL(4)
    for (int c = 0; c < PC; c++)
        x[c] = avx512_kv_vals(kvi, row, c0 + c);
    const bool q8 = kvi == KV_Q8 || kvi == KV_Q8S;
    /* The panel's chunks lie in at most two 32-blocks. */
    const int b0 = c0 / 2;
    const float d0 = q8 ? avx512_kv_scale(kvi, row, b0, hd) : 1.0f;
    const float d1 = q8 && PC > 2 ? avx512_kv_scale(kvi, row, b0 + 1, hd) : 1.0f;
    CPU_UNROLL(2)
    for (int r = 0; r < NR; r++) {
        const float pj = p[r * ATT_TK + j];
        const __m512 w0 = _mm512_set1_ps(q8 ? pj * d0 : pj), w1 = _mm512_set1_ps(q8 ? pj * d1 : pj);
        CPU_UNROLL(4)
        for (int c = 0; c < PC; c++)
            a[r][c] = _mm512_fmadd_ps(c < 2 ? w0 : w1, x[c], a[r][c]);
    }
}

CPU_AVX512 CPU_INLINE void avx512_pv_panel(int kvi, int NR, int PC, const float *p, const uint8_t *const *v,
                                           int nk, int hd, int c0, float *acc) {
    __m512 a[2][2][4]; /* [even/odd key][row][chunk] */
    CPU_UNROLL(2)
    for (int r = 0; r < NR; r++)
        CPU_UNROLL(4)
    for (int c = 0; c < PC; c++) {
        a[0][r][c] = _mm512_loadu_ps(acc + (size_t)r * hd + 16 * (c0 + c));
        a[1][r][c] = _mm512_setzero_ps();
    }
    int j = 0;
    for (; j + 2 <= nk; j += 2) {
        avx512_pv_key(kvi, NR, PC, p, v[j], j, hd, c0, a[0]);
        avx512_pv_key(kvi, NR, PC, p, v[j + 1], j + 1, hd, c0, a[1]);
    }
    if (j < nk) avx512_pv_key(kvi, NR, PC, p, v[j], j, hd, c0, a[0]);
    CPU_UNROLL(2)
    for (int r = 0; r < NR; r++)
        CPU_UNROLL(4)
    for (int c = 0; c < PC; c++)
        _mm512_storeu_ps(acc + (size_t)r * hd + 16 * (c0 + c), _mm512_add_ps(a[0][r][c], a[1][r][c]));
}

CPU_AVX512 CPU_INLINE void avx512_pv_t(int kvi, const float *p, int R, const uint8_t *const *v, int nk,
                                       int hd, float *acc) {
    const int nc = hd / 16;
    for (int c0 = 0; c0 < nc;) {
        const int pc = nc - c0 >= 4 ? 4 : nc - c0 >= 2 ? 2 : 1;
        for (int r = 0; r < R;) {
            const int nr = R - r >= 2 ? 2 : 1;
            const float *pr = p + r * ATT_TK;
            float *ar = acc + (size_t)r * hd;
            switch (nr * 8 + pc) {
            case 2 * 8 + 4:
                avx512_pv_panel(kvi, 2, 4, pr, v, nk, hd, c0, ar);
                break;
            case 2 * 8 + 2:
                avx512_pv_panel(kvi, 2, 2, pr, v, nk, hd, c0, ar);
                break;
            case 2 * 8 + 1:
                avx512_pv_panel(kvi, 2, 1, pr, v, nk, hd, c0, ar);
                break;
            case 1 * 8 + 4:
                avx512_pv_panel(kvi, 1, 4, pr, v, nk, hd, c0, ar);
                break;
            case 1 * 8 + 2:
                avx512_pv_panel(kvi, 1, 2, pr, v, nk, hd, c0, ar);
                break;
            default:
                avx512_pv_panel(kvi, 1, 1, pr, v, nk, hd, c0, ar);
                break;
            }
            r += nr;
        }
        c0 += pc;
    }
}

/* Tile staging: f16 rows to f32 (stride hd); q8_0 rows to unscaled quants
 * followed by the hd/32 block scales (KV_Q8S, stride hd + hd/32). */
CPU_AVX512 CPU_INLINE void avx512_stage_t(int kvi, const uint8_t *const *src, int nk, int hd, float *dst) {
    const size_t stride = (size_t)hd + (kvi == KV_Q8 ? (size_t)hd / 32 : 0);
    for (int j = 0; j < nk; j++) {
        float *row = dst + (size_t)j * stride;
        for (int c = 0; c < hd / 16; c++)
            _mm512_storeu_ps(row + 16 * c, avx512_kv_vals(kvi, src[j], c));
        if (kvi == KV_Q8)
            for (int b = 0; b < hd / 32; b++)
                row[hd + b] = avx512_kv_scale(kvi, src[j], b, hd);
    }
}

CPU_AVX512 static void avx512_softmax(float *s, int R, const int *nvalid, float *m, float *l, float *acc,
                                      int hd) {
    for (int r = 0; r < R; r++) {
        float *sr = s + r * ATT_TK;
        const int nv = nvalid[r];
        if (nv <= 0) {
            _mm512_storeu_ps(sr, _mm512_setzero_ps());
            continue;
        }
        const __mmask16 vm = avx512_tail_mask(nv < ATT_TK ? nv : ATT_TK);
        const __m512 sv = _mm512_loadu_ps(sr);
        float mx = _mm512_mask_reduce_max_ps(vm, sv);
        if (mx > m[r]) {
            float c = expf(m[r] - mx);
            l[r] *= c;
            __m512 cv = _mm512_set1_ps(c);
            for (int d = 0; d < hd; d += 16)
                _mm512_storeu_ps(acc + (size_t)r * hd + d,
                                 _mm512_mul_ps(_mm512_loadu_ps(acc + (size_t)r * hd + d), cv));
            m[r] = mx;
        }
        __m512 pv = _mm512_maskz_mov_ps(vm, avx512_exp(_mm512_sub_ps(sv, _mm512_set1_ps(m[r]))));
        _mm512_storeu_ps(sr, pv);
        l[r] += _mm512_reduce_add_ps(pv);
    }
}

CPU_AVX512 static void avx512_qk_f32(const float *q, int R, const uint8_t *const *k, int nk, int hd,
                                     float *s) {
    avx512_qk_t(KV_F32, q, R, k, nk, hd, s);
}
CPU_AVX512 static void avx512_qk_f16(const float *q, int R, const uint8_t *const *k, int nk, int hd,
                                     float *s) {
    avx512_qk_t(KV_F16, q, R, k, nk, hd, s);
}
CPU_AVX512 static void avx512_qk_q8(const float *q, int R, const uint8_t *const *k, int nk, int hd,
                                    float *s) {
    avx512_qk_t(KV_Q8, q, R, k, nk, hd, s);
}
CPU_AVX512 static void avx512_pv_f32(const float *p, int R, const uint8_t *const *v, int nk, int hd,
                                     float *acc) {
    avx512_pv_t(KV_F32, p, R, v, nk, hd, acc);
}
CPU_AVX512 static void avx512_pv_f16(const float *p, int R, const uint8_t *const *v, int nk, int hd,
                                     float *acc) {
    avx512_pv_t(KV_F16, p, R, v, nk, hd, acc);
}
CPU_AVX512 static void avx512_pv_q8(const float *p, int R, const uint8_t *const *v, int nk, int hd,
                                    float *acc) {
    avx512_pv_t(KV_Q8, p, R, v, nk, hd, acc);
}
CPU_AVX512 static void avx512_qk_q8s(const float *q, int R, const uint8_t *const *k, int nk, int hd,
                                     float *s) {
    avx512_qk_t(KV_Q8S, q, R, k, nk, hd, s);
}
CPU_AVX512 static void avx512_pv_q8s(const float *p, int R, const uint8_t *const *v, int nk, int hd,
                                     float *acc) {
    avx512_pv_t(KV_Q8S, p, R, v, nk, hd, acc);
}
CPU_AVX512 static void avx512_stage_f16(const uint8_t *const *src, int nk, int hd, float *dst) {
    avx512_stage_t(KV_F16, src, nk, hd, dst);
}
CPU_AVX512 static void avx512_stage_q8(const uint8_t *const *src, int nk, int hd, float *dst) {
    avx512_stage_t(KV_Q8, src, nk, hd, dst);
}

static const attn_kernels attn_avx512 = {
    .qk = {avx512_qk_f32, avx512_qk_f16, avx512_qk_q8, avx512_qk_q8s},
    .pv = {avx512_pv_f32, avx512_pv_f16, avx512_pv_q8, avx512_pv_q8s},
    .stage = {NULL, avx512_stage_f16, avx512_stage_q8},
    .staged = {KV_F32, KV_F32, KV_Q8S},
    .softmax = avx512_softmax,
    .stage_rows = 3,
};
#endif /* CPU_X86 */

/* The SIMD kernels work in whole 16-float chunks; other head sizes (rare:
 * every common model has head_dim 64, 80, 96, 128 or 256) run scalar. */
static const attn_kernels *attn_for(cpu_isa isa, int hd) {
#if CPU_X86
    if (hd % 16 == 0 && isa == CPU_ISA_AVX512) return &attn_avx512;
    if (hd % 16 == 0 && isa == CPU_ISA_AVX2) return &attn_avx2;
#endif
    (void)isa;
    (void)hd;
    return &attn_scalar;
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
    int64_t max_chunks = (int64_t)be->pool->n_threads * chunks_per_thread;
    int chunks = (int)(n < max_chunks ? n : max_chunks);
    duet__cpu_pool_run(be->pool, work >= CPU_PAR_MIN_WORK ? chunks : 1, rows_task, &j);
}

/* Per-thread slices of the work scratch, 64-byte aligned. */
static duet_status work_reserve(cpu_backend *be, size_t per_thread, size_t *stride) {
    *stride = (per_thread + 63) & ~(size_t)63;
    return duet__cpu_scratch_reserve(&be->work, *stride * (size_t)be->pool->n_threads);
}

/* ======================================================================== */
/* ops                                                                       */
/* ======================================================================== */

typedef struct embed_ctx {
    const int32_t *tokens;
    const uint8_t *table;
    const duet_buffer *rp; /* the table's buffer when its rows are repacked */
    size_t row_bytes;
    duet_dtype dtype;
    int dim;
    float *out;
} embed_ctx;

static void embed_row(const void *p, int64_t t, int worker) {
    const embed_ctx *c = p;
    if (c->rp && c->tokens[t] < c->rp->rp_rows)
        duet__cpu_rp_dequant_row(c->rp, c->tokens[t], c->out + t * c->dim);
    else
        duet_dequantize_row(c->dtype, c->table + (size_t)c->tokens[t] * c->row_bytes, c->out + t * c->dim,
                            c->dim);
}

duet_status duet__cpu_embed(cpu_backend *be, const duet_op *op, const int32_t *tokens, const void *table,
                            const duet_buffer *table_buf, float *out) {
    embed_ctx c = {tokens,
                   table,
                   table_buf && table_buf->rp_rows ? table_buf : NULL,
                   duet_dtype_row_bytes(op->embed.dtype, op->embed.dim),
                   op->embed.dtype,
                   op->embed.dim,
                   out};
    run_rows(be, op->n_tokens, (int64_t)op->n_tokens * op->embed.dim, 4, embed_row, &c);
    return DUET_OK;
}

/* Where a row of an op with an optional f32 output goes: out's row, or the
 * worker's scratch row when only the q8_0 blocks are wanted. */
static float *row_dst(float *out, uint8_t *scratch, size_t stride, int64_t t, int dim, int worker) {
    return out ? out + t * dim : (float *)(scratch + (size_t)worker * stride);
}

typedef struct rms_ctx {
    const cpu_backend *be;
    const vec_kernels *vk;
    const float *x, *w;
    float *out;
    duet_block_q8_0 *out_q8;
    uint8_t *scratch; /* per thread: one f32 row when out is absent */
    size_t stride;
    int dim;
    float eps;
} rms_ctx;

static void rms_row(const void *p, int64_t t, int worker) {
    const rms_ctx *c = p;
    const float *x = c->x + t * c->dim;
    float ms = c->vk->sumsq(x, c->dim) / (float)c->dim;
    float *y = row_dst(c->out, c->scratch, c->stride, t, c->dim, worker);
    c->vk->scale_mul(y, x, c->w, 1.0f / sqrtf(ms + c->eps), c->dim);
    /* Quantised while the row is still in L1: no pass reads it back. */
    if (c->out_q8) duet__cpu_quantize_q8_0(c->be, y, c->out_q8 + t * (c->dim / DUET_QK8_0), c->dim);
}

duet_status duet__cpu_rmsnorm(cpu_backend *be, const duet_op *op, const float *x, const float *w, float *out,
                              duet_block_q8_0 *out_q8) {
    const int dim = op->rmsnorm.dim;
    size_t stride = 0;
    if (!out) {
        duet_status st = work_reserve(be, (size_t)dim * sizeof(float), &stride);
        if (st != DUET_OK) return st;
    }
    rms_ctx c = {be, vec_for(be->isa), x, w, out, out_q8, be->work.p, stride, dim, op->rmsnorm.eps};
    run_rows(be, op->n_tokens, (int64_t)op->n_tokens * dim * (out_q8 ? 2 : 1), 4, rms_row, &c);
    return DUET_OK;
}

/* ---- rope_kv ---------------------------------------------------------------- */

typedef struct rope_ctx {
    const cpu_backend *be;
    const vec_kernels *vk;
    float *q, *k;
    const float *v;
    const int32_t *pos, *seq, *table;
    uint8_t *kp, *vp;
    duet_dtype kvt;
    size_t row_bytes; /* one pool row: all kv heads of a position */
    int bs, max_blocks;
    int n_head, n_head_kv, hd, n_rot;
    bool neox;
    const float *freq; /* inverse frequency of each pair */
    double mscale;     /* of cos and sin */
    uint8_t *scratch;  /* per thread: cos[n_rot/2], sin[n_rot/2] */
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

/* Stores one f32 row of kw values into a pool row of the pool's dtype. */
static void store_kv_row(const rope_ctx *c, uint8_t *dst, const float *x, int64_t kw) {
    if (c->kvt == DUET_DTYPE_F16)
        c->vk->to_f16((uint16_t *)dst, x, kw);
    else if (c->kvt == DUET_DTYPE_Q8_0)
        duet__cpu_quantize_q8_0(c->be, x, (duet_block_q8_0 *)dst, kw);
    else
        memcpy(dst, x, (size_t)kw * sizeof(float));
}

static void rope_row(const void *p, int64_t t, int worker) {
    const rope_ctx *c = p;
    int half = c->n_rot / 2;
    float *cs = (float *)(c->scratch + (size_t)worker * c->scratch_stride), *sn = cs + half;
    int32_t pos = c->pos[t];
    for (int i = 0; i < half; i++) { /* double: angles reach pos * 1 rad */
        double th = (double)pos * c->freq[i];
        cs[i] = (float)(cos(th) * c->mscale);
        sn[i] = (float)(sin(th) * c->mscale);
    }
    int64_t qw = (int64_t)c->n_head * c->hd, kw = (int64_t)c->n_head_kv * c->hd;
    for (int h = 0; h < c->n_head; h++)
        rope_rotate(c->q + t * qw + h * c->hd, cs, sn, half, c->neox);
    float *k = c->k + t * kw;
    for (int h = 0; h < c->n_head_kv; h++)
        rope_rotate(k + h * c->hd, cs, sn, half, c->neox);
    /* Position pos of the sequence: row pos % bs of its table's block. */
    int32_t blk = c->table[(size_t)c->seq[t] * (size_t)c->max_blocks + (size_t)(pos / c->bs)];
    size_t row = ((size_t)blk * (size_t)c->bs + (size_t)(pos % c->bs)) * c->row_bytes;
    store_kv_row(c, c->kp + row, k, kw);
    store_kv_row(c, c->vp + row, c->v + t * kw, kw);
}

duet_status duet__cpu_rope_kv(cpu_backend *be, const duet_op *op, float *q, float *k, const float *v,
                              const int32_t *pos, const int32_t *seq, const float *freqs,
                              const int32_t *table, void *k_pool, void *v_pool) {
    int half = op->rope_kv.n_rot / 2;
    size_t stride;
    duet_status st = work_reserve(be, (size_t)(half > 0 ? half : 1) * 2 * sizeof(float), &stride);
    if (st != DUET_OK) return st;
    const duet_kv_pages *kv = &op->rope_kv.kv;
    rope_ctx c = {
        .be = be,
        .vk = vec_for(be->isa),
        .q = q,
        .k = k,
        .v = v,
        .pos = pos,
        .seq = seq,
        .table = table,
        .kp = k_pool,
        .vp = v_pool,
        .kvt = kv->dtype,
        .row_bytes = duet_dtype_row_bytes(kv->dtype, (int64_t)op->rope_kv.n_head_kv * op->rope_kv.head_dim),
        .bs = kv->block_size,
        .max_blocks = kv->max_blocks,
        .n_head = op->rope_kv.n_head,
        .n_head_kv = op->rope_kv.n_head_kv,
        .hd = op->rope_kv.head_dim,
        .n_rot = op->rope_kv.n_rot,
        .neox = op->rope_kv.neox,
        .freq = freqs,
        .mscale = op->rope_kv.mscale == 0.0f ? 1.0 : op->rope_kv.mscale,
        .scratch = be->work.p,
        .scratch_stride = stride,
    };
    int64_t work =
        (int64_t)op->n_tokens * (op->rope_kv.n_head + 2 * op->rope_kv.n_head_kv) * op->rope_kv.head_dim;
    run_rows(be, op->n_tokens, work, 4, rope_row, &c);
    return DUET_OK;
}

/* ---- attention ------------------------------------------------------------------ */

/* Query rows per item: tokens of one sequence are tiled so that about this
 * many rows (tokens x heads of a kv head) share each K/V tile from L1. */
#define ATT_ROWS 16
/* Keys are processed in chunks of this many from position 0: each chunk
 * gets its own (m, l, acc), folded into the running result in chunk order.
 * A context split (flash-decoding) is a chunk, so split and unsplit runs,
 * any thread count and any batching give bit-identical results. */
#define ATT_CHUNK 256
/* How far ahead of the tile being computed one kv head's K/V slices are
 * prefetched (items of all kv heads prefetch one tile of whole rows). */
#define ATT_PREFETCH 48

typedef struct attn_ctx {
    const cpu_backend *be;
    const attn_kernels *ak;
    int kvi; /* the pools' element type */
    const float *q;
    const int32_t *pos, *seq, *table;
    const uint8_t *kp, *vp;
    size_t row_bytes, head_bytes; /* a pool row; one kv head's part of it */
    int bs, max_blocks;
    int n_head, n_head_kv, group, hd;
    float scale;
    int window; /* > 0: keys before pos - window + 1 are masked */
    float *out;
    duet_block_q8_0 *out_q8;
    /* Query tiles: tile i is tokens [tiles[i], tiles[i+1]) of one sequence;
     * its items are [items[i], items[i+1]). */
    const int32_t *tiles, *items;
    int n_tiles;
    bool split; /* one item per chunk (flash-decoding) */
    /* Items write (m, l, acc) partials, finished by a reduce pass per token:
     * with context splits, or with out_q8 blocks that straddle kv heads. */
    bool partial;
    int max_chunks; /* partials per (token, head) */
    float *part;    /* [n_tokens][n_head][max_chunks][2 + hd] */
    uint8_t *scratch;
    size_t stride;
    int rows_max;
} attn_ctx;

/* The per-thread working set of one item, carved from the work scratch. */
typedef struct attn_scratch {
    float *qs, *m, *l, *acc; /* result so far (chunks folded) */
    float *cm, *cl, *cacc;   /* the current chunk */
    float *s, *kst, *vst;
    int *nvalid;
    size_t *rows;
} attn_scratch;

static size_t f32_span(size_t n) { /* n floats, rounded up to 64 bytes */
    return (n * sizeof(float) + 63) & ~(size_t)63;
}

static size_t attn_scratch_layout(int rows, int hd, uint8_t *base, attn_scratch *a) {
    const size_t rh = (size_t)rows * hd;
    const size_t sizes[12] = {f32_span(rh),
                              f32_span(rows),
                              f32_span(rows),
                              f32_span(rh),
                              f32_span(rows),
                              f32_span(rows),
                              f32_span(rh),
                              f32_span((size_t)rows * ATT_TK),
                              f32_span((size_t)ATT_TK * (hd + hd / 32)),
                              f32_span((size_t)ATT_TK * (hd + hd / 32)),
                              f32_span(rows),
                              f32_span(ATT_TK * 2)};
    void *p[12];
    size_t o = 0;
    for (int i = 0; i < 12; i++) {
        p[i] = base ? base + o : NULL;
        o += sizes[i];
    }
    if (a)
        *a = (attn_scratch){.qs = p[0],
                            .m = p[1],
                            .l = p[2],
                            .acc = p[3],
                            .cm = p[4],
                            .cl = p[5],
                            .cacc = p[6],
                            .s = p[7],
                            .kst = p[8],
                            .vst = p[9],
                            .nvalid = p[10],
                            .rows = p[11]};
    return o;
}

/* Folds a chunk's (cm, cl, cacc) into a row's (m, l, acc). Items and the
 * reduce pass both use this one (not inlined) function, in chunk order, so
 * they round alike; an empty chunk (l = 0) leaves the row untouched and the
 * first one is copied exactly. */
__attribute__((noinline)) static void attn_fold(float *m, float *l, float *acc, float cm, float cl,
                                                const float *cacc, int hd) {
    if (!(cl > 0.0f)) return;
    if (!(*l > 0.0f)) {
        *m = cm, *l = cl;
        memcpy(acc, cacc, (size_t)hd * sizeof(float));
        return;
    }
    float mx = fmaxf(*m, cm), w0 = expf(*m - mx), w1 = expf(cm - mx);
    *l = *l * w0 + cl * w1;
    for (int d = 0; d < hd; d++)
        acc[d] = acc[d] * w0 + cacc[d] * w1;
    *m = mx;
}

/* y = acc / l (0 for a row that saw nothing). */
__attribute__((noinline)) static void attn_finish(float *y, const float *acc, float l, int hd) {
    float inv = l > 0.0f ? 1.0f / l : 0.0f;
    for (int d = 0; d < hd; d++)
        y[d] = acc[d] * inv;
}

/* Issues prefetches for bytes [p, p + n). */
static void prefetch_span(const uint8_t *p, size_t n) {
    for (size_t b = 0; b < n; b += 64)
        __builtin_prefetch(p + b);
    __builtin_prefetch(p + n - 1);
}

/* Row pointers of kv head h for the tile's keys (pool rows at a->rows), or
 * of its copy converted into `buf` when the tile is staged. */
static void attn_tile_rows(const attn_ctx *c, const attn_scratch *a, const uint8_t *pool, int h, int nk,
                           bool stage, float *buf, const uint8_t **rows) {
    const size_t off = (size_t)h * c->head_bytes;
    for (int j = 0; j < nk; j++)
        rows[j] = pool + a->rows[j] + off;
    if (!stage) return;
    c->ak->stage[c->kvi](rows, nk, c->hd, buf);
    const size_t stride = (size_t)c->hd + (c->ak->staged[c->kvi] == KV_Q8S ? (size_t)c->hd / 32 : 0);
    for (int j = 0; j < nk; j++)
        rows[j] = (const uint8_t *)(buf + (size_t)j * stride);
}

/* One item: the query rows of a tile for kv heads [kvh0, kvh0 + nkh)
 * against all its keys, or one chunk of them when the op is split. A tile
 * of one token (decode) takes every kv head in one item, so K/V rows are
 * read whole and in order; a longer tile (prefill) takes one kv head, so
 * its K/V tiles are reused by all its rows from L1. Row r of the item is
 * query head (kvh0 + r / (ntok * g)) * g + r % g of token t0 + r / g % ntok
 * (one of ntok and nkh is 1). */
static void attn_item(const void *p, int64_t item, int worker) {
    const attn_ctx *c = p;
    int lo_t = 0, hi_t = c->n_tiles; /* the tile whose items hold this one */
    while (hi_t - lo_t > 1) {
        int mid = (lo_t + hi_t) / 2;
        if (c->items[mid] <= item)
            lo_t = mid;
        else
            hi_t = mid;
    }
    const int tile = lo_t, t0 = c->tiles[tile], ntok = c->tiles[tile + 1] - t0;
    int64_t kmax = 0;
    for (int i = 0; i < ntok; i++)
        kmax = c->pos[t0 + i] + 1 > kmax ? c->pos[t0 + i] + 1 : kmax;
    const int n_ch = c->split ? (int)((kmax + ATT_CHUNK - 1) / ATT_CHUNK) : 1;
    const int nkh = ntok == 1 ? c->n_head_kv : 1, local = (int)(item - c->items[tile]);
    const int kvh0 = (local / n_ch) * nkh, chunk = local % n_ch;
    const int g = c->group, hd = c->hd, rh = ntok * g, R = rh * nkh;
    const int64_t qw = (int64_t)c->n_head * hd;
    attn_scratch a;
    attn_scratch_layout(c->rows_max, hd, c->scratch + (size_t)worker * c->stride, &a);
    /* Split: this item is chunk `chunk`; else every chunk, folded here.
     * A sliding window skips whole chunks before every row's window (they
     * would fold nothing), so split and unsplit runs still agree. */
    int64_t lo = c->split ? (int64_t)chunk * ATT_CHUNK : 0;
    const int64_t hi = c->split && lo + ATT_CHUNK < kmax ? lo + ATT_CHUNK : kmax;
    int64_t first_min = kmax; /* the earliest key any row of the tile sees */
    for (int i = 0; i < ntok; i++) {
        const int64_t f = c->window > 0 ? (int64_t)c->pos[t0 + i] - c->window + 1 : 0;
        first_min = f < first_min ? (f > 0 ? f : 0) : first_min;
    }
    if (!c->split) lo = first_min / ATT_CHUNK * ATT_CHUNK;

    for (int r = 0; r < R; r++)
        a.m[r] = -INFINITY, a.l[r] = 0.0f;
    memset(a.acc, 0, (size_t)R * hd * sizeof(float));
    /* q rows scaled once; copied, so out may be q (it is written only after
     * every read of this item's rows). */
    for (int hh = 0; hh < nkh; hh++)
        for (int i = 0; i < ntok; i++)
            for (int j = 0; j < g; j++) {
                const float *src = c->q + (t0 + i) * qw + (int64_t)((kvh0 + hh) * g + j) * hd;
                float *dst = a.qs + (size_t)(hh * rh + i * g + j) * hd;
                for (int d = 0; d < hd; d++)
                    dst[d] = src[d] * c->scale;
            }

    const int32_t *entries = c->table + (size_t)c->seq[t0] * (size_t)c->max_blocks;
    const bool stage = c->kvi != KV_F32 && rh >= c->ak->stage_rows;
    const int kvi = stage ? c->ak->staged[c->kvi] : c->kvi;
    const size_t span_off = (size_t)kvh0 * c->head_bytes, span = (size_t)nkh * c->head_bytes;
    int64_t blk = lo / c->bs;
    int off = (int)(lo % c->bs);
    /* A second walker runs `ahead` keys ahead and prefetches: the rows
     * of a sequence sit in scattered blocks (and one kv head's slices are a
     * row apart), which the hardware prefetchers do not follow, and decode
     * is bound by how fast these bytes arrive. */
    const int64_t ahead = nkh > 1 ? ATT_TK : ATT_PREFETCH; /* whole rows: one tile is ~L1 */
    int64_t pf = lo + ahead < hi ? lo + ahead : hi, pf_blk = pf / c->bs;
    int pf_off = (int)(pf % c->bs);
    for (int64_t p0 = lo; p0 < hi; p0 += ATT_TK) {
        const int nk = hi - p0 < ATT_TK ? (int)(hi - p0) : ATT_TK;
        if (p0 % ATT_CHUNK == 0) { /* a chunk starts: fresh state */
            for (int r = 0; r < R; r++)
                a.cm[r] = -INFINITY, a.cl[r] = 0.0f;
            memset(a.cacc, 0, (size_t)R * hd * sizeof(float));
        }
        for (int j = 0; j < nk; j++) {
            a.rows[j] = ((size_t)entries[blk] * (size_t)c->bs + (size_t)off) * c->row_bytes;
            if (++off == c->bs) off = 0, blk++;
        }
        for (int j = 0; j < ATT_TK && pf < hi; j++, pf++) {
            size_t row = ((size_t)entries[pf_blk] * (size_t)c->bs + (size_t)pf_off) * c->row_bytes + span_off;
            prefetch_span(c->kp + row, span);
            prefetch_span(c->vp + row, span);
            if (++pf_off == c->bs) pf_off = 0, pf_blk++;
        }
        int masked[ATT_ROWS]; /* per token: keys of the tile before its window */
        for (int i = 0; i < ntok; i++) {
            int64_t nv = c->pos[t0 + i] - p0 + 1;
            nv = nv < 0 ? 0 : nv > nk ? nk : nv;
            int64_t mk = c->window > 0 ? (int64_t)c->pos[t0 + i] - c->window + 1 - p0 : 0;
            mk = mk < 0 ? 0 : mk;
            if (mk >= nv) nv = 0, mk = 0; /* nothing of this tile in the window */
            masked[i] = (int)mk;
            for (int hh = 0; hh < nkh; hh++)
                for (int j = 0; j < g; j++)
                    a.nvalid[hh * rh + i * g + j] = (int)nv;
        }
        /* Scores of every head, one softmax step over all rows (their
         * reductions overlap), then every head's values. Keys before a
         * row's window score -inf: a prefix of its valid keys. */
        const uint8_t *rows[ATT_TK];
        for (int hh = 0; hh < nkh; hh++) {
            const int r0 = hh * rh;
            attn_tile_rows(c, &a, c->kp, kvh0 + hh, nk, stage, a.kst, rows);
            c->ak->qk[kvi](a.qs + (size_t)r0 * hd, rh, rows, nk, hd, a.s + r0 * ATT_TK);
            for (int i = 0; i < ntok; i++)
                for (int j = 0; j < g; j++)
                    for (int e = 0; e < masked[i]; e++)
                        a.s[(r0 + i * g + j) * ATT_TK + e] = -INFINITY;
        }
        c->ak->softmax(a.s, R, a.nvalid, a.cm, a.cl, a.cacc, hd);
        for (int hh = 0; hh < nkh; hh++) {
            const int r0 = hh * rh;
            attn_tile_rows(c, &a, c->vp, kvh0 + hh, nk, stage, a.vst, rows);
            c->ak->pv[kvi](a.s + r0 * ATT_TK, rh, rows, nk, hd, a.cacc + (size_t)r0 * hd);
        }
        if (p0 + nk == hi || (p0 + nk) % ATT_CHUNK == 0) /* a chunk ends */
            for (int r = 0; r < R; r++)
                attn_fold(a.m + r, a.l + r, a.acc + (size_t)r * hd, a.cm[r], a.cl[r], a.cacc + (size_t)r * hd,
                          hd);
    }

    if (c->partial) {
        for (int hh = 0; hh < nkh; hh++)
            for (int i = 0; i < ntok; i++)
                for (int j = 0; j < g; j++) {
                    int r = hh * rh + i * g + j, h = (kvh0 + hh) * g + j;
                    float *dst =
                        c->part + (((size_t)(t0 + i) * c->n_head + h) * c->max_chunks + chunk) * (2 + hd);
                    dst[0] = a.m[r];
                    dst[1] = a.l[r];
                    memcpy(dst + 2, a.acc + (size_t)r * hd, (size_t)hd * sizeof(float));
                }
        return;
    }
    for (int r = 0; r < R; r++)
        attn_finish(a.acc + (size_t)r * hd, a.acc + (size_t)r * hd, a.l[r], hd);
    /* A token's rows here are heads kvh0*g .. (kvh0+nkh)*g - 1 in order: one
     * contiguous segment of its output row (whole q8_0 blocks unless
     * c->partial said otherwise). */
    const size_t seg = (size_t)nkh * g * hd, col = (size_t)kvh0 * g * hd;
    for (int i = 0; i < ntok; i++) {
        const float *y = a.acc + (size_t)i * g * hd;
        if (c->out) memcpy(c->out + (t0 + i) * qw + col, y, seg * sizeof(float));
        if (c->out_q8)
            duet__cpu_quantize_q8_0(c->be, y, c->out_q8 + ((t0 + i) * qw + col) / DUET_QK8_0, (int64_t)seg);
    }
}

/* Folds token t's partials, chunk by chunk as the items do, and writes
 * its row (and q8_0 blocks). Chunks past the token's own position were
 * empty for it. */
static void attn_reduce(const void *p, int64_t t, int worker) {
    const attn_ctx *c = p;
    const int hd = c->hd;
    const int64_t qw = (int64_t)c->n_head * hd;
    int64_t own = ((int64_t)c->pos[t] + ATT_CHUNK) / ATT_CHUNK;
    const int n_ch = own < c->max_chunks ? (int)own : c->max_chunks;
    float *row = row_dst(c->out, c->scratch, c->stride, t, (int)qw, worker);
    for (int h = 0; h < c->n_head; h++) {
        const float *ps = c->part + ((size_t)t * c->n_head + h) * c->max_chunks * (2 + hd);
        float m = -INFINITY, l = 0.0f, *o = row + (int64_t)h * hd;
        for (int k = 0; k < n_ch; k++) {
            const float *e = ps + (size_t)k * (2 + hd);
            attn_fold(&m, &l, o, e[0], e[1], e + 2, hd);
        }
        attn_finish(o, o, l, hd);
    }
    if (c->out_q8) duet__cpu_quantize_q8_0(c->be, row, c->out_q8 + t * (qw / DUET_QK8_0), qw);
}

duet_status duet__cpu_attention(cpu_backend *be, const duet_op *op, const float *q, const int32_t *pos,
                                const int32_t *seq, const int32_t *table, const void *k_pool,
                                const void *v_pool, float *out, duet_block_q8_0 *out_q8) {
    const int nt = op->n_tokens, nh = op->attention.n_head, nkv = op->attention.n_head_kv;
    const int hd = op->attention.head_dim, g = nh / nkv;
    const duet_kv_pages *kv = &op->attention.kv;
    const int n_threads = be->pool->n_threads;

    /* Query tiles: runs of consecutive tokens of one sequence, cut so a tile
     * has about ATT_ROWS rows per kv head. A one-token tile is one unit of
     * work (all kv heads), a longer one nkv units (one per kv head). */
    const int tile_tokens = g >= ATT_ROWS ? 1 : ATT_ROWS / g;
    int n_tiles = 0, start = 0;
    bool multi = false; /* some tile has several tokens */
    int64_t kmax = 0, work = 0, units = 0;
    for (int t = 0; t <= nt; t++) {
        if (t == nt || t == 0 || seq[t] != seq[t - 1] || t - start >= tile_tokens) {
            if (t > 0) units += t - start == 1 ? 1 : nkv, multi |= t - start > 1;
            if (t == nt) break;
            n_tiles++, start = t;
        }
        kmax = pos[t] + 1 > kmax ? pos[t] + 1 : kmax;
        work += ((int64_t)pos[t] + 1) * nh * hd * 2;
    }
    /* Flash-decoding: too few units to keep every thread busy (decode of
     * one or a few sequences) and a context of several chunks: an item per
     * chunk, and a reduce pass. Only then do partials scale with the
     * context, for the few tokens of such a batch. */
    const int64_t want = 4 * (int64_t)n_threads, chunks = (kmax + ATT_CHUNK - 1) / ATT_CHUNK;
    const bool split = n_threads > 1 && units < want && chunks > 1 && work >= CPU_PAR_MIN_WORK;
    /* One-head items write g*hd values of a row: whole q8_0 blocks only if
     * g*hd % 32 == 0; otherwise a reduce pass quantises whole rows. */
    const bool partial = split || (out_q8 && multi && ((int64_t)g * hd) % DUET_QK8_0 != 0);
    const int max_chunks = split ? (int)chunks : 1;

    /* Op scratch (tiles, partials). */
    const size_t tiles_bytes = ((size_t)(n_tiles + 1) * 2 * sizeof(int32_t) + 63) & ~(size_t)63;
    const size_t part_bytes = partial ? (size_t)nt * nh * max_chunks * (2 + hd) * sizeof(float) : 0;
    duet_status st = duet__cpu_scratch_reserve(&be->attn, tiles_bytes + part_bytes);
    if (st != DUET_OK) return st;
    int32_t *tiles = be->attn.p, *items = tiles + n_tiles + 1;
    n_tiles = 0;
    for (int t = 0; t < nt; t++)
        if (t == 0 || seq[t] != seq[t - 1] || t - tiles[n_tiles - 1] >= tile_tokens) tiles[n_tiles++] = t;
    tiles[n_tiles] = nt;
    items[0] = 0;
    for (int i = 0; i < n_tiles; i++) {
        int64_t tk = 0; /* the tile's keys */
        for (int t = tiles[i]; t < tiles[i + 1]; t++)
            tk = pos[t] + 1 > tk ? pos[t] + 1 : tk;
        int n_ch = split ? (int)((tk + ATT_CHUNK - 1) / ATT_CHUNK) : 1;
        items[i + 1] = items[i] + (tiles[i + 1] - tiles[i] == 1 ? 1 : nkv) * n_ch;
    }

    /* Per-thread scratch: an item's working set, or a reduce pass's row. */
    const int rows_max = nh > tile_tokens * g ? nh : tile_tokens * g;
    size_t per_thread = attn_scratch_layout(rows_max, hd, NULL, NULL), stride;
    if (per_thread < (size_t)nh * hd * sizeof(float)) per_thread = (size_t)nh * hd * sizeof(float);
    if ((st = work_reserve(be, per_thread, &stride)) != DUET_OK) return st;

    static const int kvi_of[] = {
        [DUET_DTYPE_F32] = KV_F32, [DUET_DTYPE_F16] = KV_F16, [DUET_DTYPE_Q8_0] = KV_Q8};
    attn_ctx c = {
        .be = be,
        .ak = attn_for(be->isa, hd),
        .kvi = kvi_of[kv->dtype],
        .q = q,
        .pos = pos,
        .seq = seq,
        .table = table,
        .kp = k_pool,
        .vp = v_pool,
        .row_bytes = duet_dtype_row_bytes(kv->dtype, (int64_t)nkv * hd),
        .head_bytes = duet_dtype_row_bytes(kv->dtype, hd),
        .bs = kv->block_size,
        .max_blocks = kv->max_blocks,
        .n_head = nh,
        .n_head_kv = nkv,
        .group = g,
        .hd = hd,
        .scale = op->attention.scale,
        .window = op->attention.window,
        .out = out,
        .out_q8 = out_q8,
        .tiles = tiles,
        .items = items,
        .n_tiles = n_tiles,
        .split = split,
        .partial = partial,
        .max_chunks = max_chunks,
        .part = partial ? (float *)((uint8_t *)be->attn.p + tiles_bytes) : NULL,
        .scratch = be->work.p,
        .stride = stride,
        .rows_max = rows_max,
    };
    /* Items differ in length (causal, ragged): cut them finely so the pool
     * balances them. */
    run_rows(be, items[n_tiles], work, 16, attn_item, &c);
    if (partial) run_rows(be, nt, (int64_t)nt * nh * max_chunks * hd, 4, attn_reduce, &c);
    return DUET_OK;
}

/* ---- elementwise ------------------------------------------------------------------ */

typedef struct ew_ctx {
    const cpu_backend *be;
    const vec_kernels *vk;
    const float *a, *b;
    float *out;
    duet_block_q8_0 *out_q8;
    uint8_t *scratch;
    size_t stride;
    int dim;
} ew_ctx;

static void swiglu_row(const void *p, int64_t t, int worker) {
    const ew_ctx *c = p;
    float *y = row_dst(c->out, c->scratch, c->stride, t, c->dim, worker);
    c->vk->swiglu(y, c->a + t * c->dim, c->b + t * c->dim, c->dim);
    if (c->out_q8) duet__cpu_quantize_q8_0(c->be, y, c->out_q8 + t * (c->dim / DUET_QK8_0), c->dim);
}

static void add_row(const void *p, int64_t t, int worker) {
    const ew_ctx *c = p;
    c->vk->add(c->out + t * c->dim, c->a + t * c->dim, c->b + t * c->dim, c->dim);
}

duet_status duet__cpu_swiglu(cpu_backend *be, const duet_op *op, const float *gate, const float *up,
                             float *out, duet_block_q8_0 *out_q8) {
    const int dim = op->swiglu.dim;
    size_t stride = 0;
    if (!out) {
        duet_status st = work_reserve(be, (size_t)dim * sizeof(float), &stride);
        if (st != DUET_OK) return st;
    }
    ew_ctx c = {be, vec_for(be->isa), gate, up, out, out_q8, be->work.p, stride, dim};
    /* exp costs ~10 elements' worth of streaming: weigh it so. */
    run_rows(be, op->n_tokens, (int64_t)op->n_tokens * dim * (out_q8 ? 5 : 4), 4, swiglu_row, &c);
    return DUET_OK;
}

duet_status duet__cpu_add(cpu_backend *be, const duet_op *op, const float *a, const float *b, float *out) {
    ew_ctx c = {.be = be, .vk = vec_for(be->isa), .a = a, .b = b, .out = out, .dim = op->add.dim};
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
