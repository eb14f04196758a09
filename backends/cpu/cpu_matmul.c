/* cpu_matmul.c — MATMUL: out[t][o] = sum_i W[o][i] x[t][i] (+ bias) (+ out).
 *
 * Work is split by output rows into contiguous chunks, a few per thread, so
 * each thread streams its own part of W once per token chunk. Inside a
 * chunk a micro-kernel ("tile") computes up to MR rows x MT tokens at once:
 * each weight vector loaded is used MT times, each activation vector MR
 * times. Decode (one token) is bound by the bytes of W; prefill and batched
 * decode by arithmetic, which the tile's reuse feeds.
 *
 * Q8_0 weights run int8 x int8 dot products against q8_0 activation blocks
 * (the op's x_q8, or f32 x quantised here by the same rule as
 * duet_quantize_row_q8_0, so both give identical results): per block
 * d_w * d_x * sum(qw * qx). On avx512 (matrices of 16 rows or more) a
 * "panel" does it: 16 weight rows transposed in registers so each vector
 * lane is one row, and every token's 4-byte slice is broadcast against it
 * (vpdpbusd); the transposition is paid once per 16 rows and block and
 * shared by up to 16 tokens. Elsewhere tiles run over the blocks' 32 values
 * (a cheap per-op copy puts the activations in the layout the tile wants).
 * Either way a token's result does not depend on the batch around it: the
 * path depends only on the weights' shape, and every tile or panel shape
 * sums a token's products in the same order (greedy output must not change
 * with the engine's batching).
 * F32/F16/BF16 weights are converted to f32 in registers and use f32 FMAs
 * with f32 activations. F16 matrices the backend repacked (avx512; groups
 * of 16 rows stored column by column, cpu_internal.h) run an outer-product
 * kernel instead: per column one conversion gives 16 rows' weights, and
 * each token's x[k] is broadcast into 16-row accumulators, in passes of 2
 * groups x 12 tokens and one of the rest (decode: 4 groups, prefetched). Its sums run
 * over k in order per row (not the tiles' 16 lanes), so it is batch
 * invariant on its own but not the tiles' bits. */
#include <assert.h>
#include <stdlib.h>

#include "cpu_internal.h"
#include "cpu_simd.h"

#define CPU_MR 4 /* largest tile: rows */
/* Decode streams W from memory with short per-row streams that the hardware
 * prefetcher picks up late; the kernels prefetch the same position CPU_MR
 * rows ahead (the next tile: a thread's rows are contiguous). Prefetches
 * never fault, so running past the matrix end is harmless. */
#define CPU_PREFETCH(p) _mm_prefetch((const char *)(p), _MM_HINT_T0)
#define CPU_MT 4 /* largest tile: tokens */

typedef float cpu_tile_res[CPU_MR][CPU_MT];

/* q8 tile: res[i][j] = dot(W row i, x token j) over nb blocks. xq: token
 * rows of int8 quants (stride xqs bytes; the avx512 path stores them +128 as
 * unsigned); xd: token rows of scales (stride xds floats). */
typedef void (*q8_tile_fn)(int nr, int nt, const uint8_t *w, size_t ws, const int8_t *xq, int64_t xqs,
                           const float *xd, int64_t xds, int64_t nb, cpu_tile_res res);
/* f tile: the same with f32 activations (stride xs floats) over n columns. */
typedef void (*f_tile_fn)(int nr, int nt, const uint8_t *w, size_t ws, const float *x, int64_t xs, int64_t n,
                          cpu_tile_res res);
/* Quantises n floats (n % 32 == 0) exactly as duet_quantize_row_q8_0. */
typedef void (*quant_fn)(const float *x, duet_block_q8_0 *y, int64_t n);

/* Per activation block, for the panel kernel: -128 * sum(q) (the offset
 * correction, see avx512_panel_body) and the scale as f32. */
typedef struct q8_aux {
    int32_t ncx;
    float dx;
} q8_aux;

/* One panel: CPU_PANEL_ROWS weight rows (all real: the matrix's last,
 * partial panel is moved back to end at its last row, and stores only rows
 * from `first`, the others belonging to the panel before) against nt tokens
 * (nt <= CPU_PANEL_TOKENS), all nb blocks; writes out (+ bias, + out).
 * The transposed weights can be kept in `pack` (nb * CPU_PANEL_PACK bytes,
 * 64-aligned) for the next token group of the same rows. */
enum { PANEL_DIRECT, PANEL_STORE, PANEL_LOAD }; /* transpose; transpose and keep; reuse kept */
typedef struct q8_panel {
    const uint8_t *w;
    size_t ws;
    int first;
    int64_t nb;
    const duet_block_q8_0 *x; /* token rows of nb blocks */
    const q8_aux *aux;        /* token rows of nb entries */
    void *pack;
    int pack_mode;
    const float *bias; /* at the panel's first row, or NULL */
    bool accumulate;
    float *out; /* token 0, row 0 of the panel */
    int64_t os; /* floats between tokens of out */
} q8_panel;
typedef void (*q8_panel_fn)(const q8_panel *p, int nt);
/* Fills the panel's aux for one token row of nb blocks. */
typedef void (*q8_aux_fn)(const duet_block_q8_0 *xb, int64_t nb, q8_aux *aux);
#define CPU_PANEL_ROWS 16
#define CPU_PANEL_TOKENS 16
#define CPU_PANEL_PACK (9 * 64) /* bytes per block: 8 vectors of weights + the scales */

typedef struct mm_kernels {
    int mr, mt;        /* tile shape this path is tuned for */
    int d_pair_floats; /* tile scales per block pair: 2, or 16 (avx512: pre-broadcast) */
    bool q_unsigned;   /* tile quants stored +128 as unsigned bytes (avx512) */
    quant_fn quantize;
    q8_tile_fn q8;
    f_tile_fn f32, f16, bf16;
    q8_panel_fn panel; /* NULL: the tile does every q8_0 matmul */
    q8_aux_fn panel_aux;
} mm_kernels;

/* ======================================================================== */
/* scalar                                                                    */
/* ======================================================================== */

static void scalar_q8_tile(int nr, int nt, const uint8_t *w, size_t ws, const int8_t *xq, int64_t xqs,
                           const float *xd, int64_t xds, int64_t nb, cpu_tile_res res) {
    for (int i = 0; i < nr; i++) {
        const duet_block_q8_0 *row = (const duet_block_q8_0 *)(w + (size_t)i * ws);
        float acc[CPU_MT] = {0};
        for (int64_t b = 0; b < nb; b++) {
            float dw = duet_fp16_to_fp32(row[b].d);
            for (int j = 0; j < nt; j++) {
                const int8_t *q = xq + j * xqs + b * 32;
                int32_t s = 0;
                for (int k = 0; k < 32; k++)
                    s += (int32_t)row[b].qs[k] * q[k];
                acc[j] += dw * xd[j * xds + b] * (float)s;
            }
        }
        for (int j = 0; j < nt; j++)
            res[i][j] = acc[j];
    }
}

/* Converts 64-column slices of the rows to f32 once, then reuses each slice
 * for every token of the tile. */
static void scalar_f_tile(duet_dtype dt, int nr, int nt, const uint8_t *w, size_t ws, const float *x,
                          int64_t xs, int64_t n, cpu_tile_res res) {
    float acc[CPU_MR][CPU_MT] = {{0}};
    float buf[CPU_MR][64];
    size_t esize = duet_dtype_block_bytes(dt);
    for (int64_t k0 = 0; k0 < n; k0 += 64) {
        int64_t len = n - k0 < 64 ? n - k0 : 64;
        for (int i = 0; i < nr; i++)
            duet_dequantize_row(dt, w + (size_t)i * ws + (size_t)k0 * esize, buf[i], len);
        for (int j = 0; j < nt; j++) {
            const float *xj = x + j * xs + k0;
            for (int i = 0; i < nr; i++) {
                float s = 0.0f;
                for (int64_t k = 0; k < len; k++)
                    s += buf[i][k] * xj[k];
                acc[i][j] += s;
            }
        }
    }
    for (int i = 0; i < nr; i++)
        for (int j = 0; j < nt; j++)
            res[i][j] = acc[i][j];
}

static void scalar_f32_tile(int nr, int nt, const uint8_t *w, size_t ws, const float *x, int64_t xs,
                            int64_t n, cpu_tile_res res) {
    scalar_f_tile(DUET_DTYPE_F32, nr, nt, w, ws, x, xs, n, res);
}
static void scalar_f16_tile(int nr, int nt, const uint8_t *w, size_t ws, const float *x, int64_t xs,
                            int64_t n, cpu_tile_res res) {
    scalar_f_tile(DUET_DTYPE_F16, nr, nt, w, ws, x, xs, n, res);
}
static void scalar_bf16_tile(int nr, int nt, const uint8_t *w, size_t ws, const float *x, int64_t xs,
                             int64_t n, cpu_tile_res res) {
    scalar_f_tile(DUET_DTYPE_BF16, nr, nt, w, ws, x, xs, n, res);
}

static const mm_kernels mm_scalar = {
    .mr = 4,
    .mt = 4,
    .d_pair_floats = 2,
    .quantize = duet_quantize_row_q8_0,
    .q8 = scalar_q8_tile,
    .f32 = scalar_f32_tile,
    .f16 = scalar_f16_tile,
    .bf16 = scalar_bf16_tile,
};

#if CPU_X86
/* ======================================================================== */
/* avx2 + fma + f16c                                                          */
/* ======================================================================== */

/* duet_quantize_row_q8_0, bit for bit: the same IEEE operations (amax,
 * amax / 127, 1 / d, x * id) in the same order, then roundf's ties away
 * from zero built from truncation (y - trunc(y) is exact), the clamp, and
 * NaN -> 0. The fp16 scale uses the hardware conversion, which rounds to
 * nearest even like duet_fp32_to_fp16. */
CPU_AVX2 static void avx2_quantize(const float *x, duet_block_q8_0 *y, int64_t n) {
    const __m256 sign = _mm256_set1_ps(-0.0f), zero = _mm256_setzero_ps(), half = _mm256_set1_ps(0.5f);
    const __m256 one = _mm256_set1_ps(1.0f), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
    for (int64_t b = 0; b < n / 32; b++) {
        __m256 v[4];
        __m256 m = zero;
        for (int k = 0; k < 4; k++) {
            v[k] = _mm256_loadu_ps(x + b * 32 + k * 8);
            /* maxps returns its second operand when one is NaN: NaN never wins. */
            m = _mm256_max_ps(_mm256_andnot_ps(sign, v[k]), m);
        }
        float amax = avx2_hmax(m);
        float d = amax / 127.0f;
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        y[b].d = _cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT);
        __m256 s = _mm256_set1_ps(id);
        __m256i i[4];
        for (int k = 0; k < 4; k++) {
            __m256 yv = _mm256_mul_ps(v[k], s);
            __m256 t = _mm256_round_ps(yv, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
            __m256 away = _mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_sub_ps(yv, t)), half, _CMP_GE_OQ);
            __m256 r = _mm256_add_ps(t, _mm256_and_ps(away, _mm256_or_ps(one, _mm256_and_ps(sign, yv))));
            __m256 ord = _mm256_cmp_ps(r, r, _CMP_ORD_Q);
            r = _mm256_and_ps(ord, _mm256_min_ps(_mm256_max_ps(r, lo), hi)); /* NaN -> +0 */
            i[k] = _mm256_cvtps_epi32(r);                                    /* integral: exact */
        }
        /* The packs work per 128-bit lane; the permute puts the 4-byte groups
         * back in element order. */
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
        p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)y[b].qs, p);
    }
}

/* int8 x int8 dot of 32 pairs: maddubs wants unsigned x signed, so move
 * w's sign onto x (|w| * sign(w)x). Pair sums stay below 2*128*127 < 2^15. */
CPU_AVX2 CPU_INLINE void avx2_q8_body(const int NR, const int NT, const uint8_t *w, size_t ws,
                                      const int8_t *xq, int64_t xqs, const float *xd, int64_t xds, int64_t nb,
                                      cpu_tile_res res) {
    __m256 acc[CPU_MR][CPU_MT];
    const __m256i ones = _mm256_set1_epi16(1);
#pragma GCC unroll 4
    for (int i = 0; i < NR; i++)
#pragma GCC unroll 4
        for (int j = 0; j < NT; j++)
            acc[i][j] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i xv[CPU_MT];
#pragma GCC unroll 4
        for (int j = 0; j < NT; j++)
            xv[j] = _mm256_loadu_si256((const __m256i *)(xq + j * xqs + b * 32));
#pragma GCC unroll 4
        for (int i = 0; i < NR; i++) {
            const duet_block_q8_0 *blk = (const duet_block_q8_0 *)(w + (size_t)i * ws) + b;
            CPU_PREFETCH((const uint8_t *)blk + CPU_MR * ws);
            __m256i wv = _mm256_loadu_si256((const __m256i *)blk->qs);
            __m256i aw = _mm256_sign_epi8(wv, wv);
            float dw = _cvtsh_ss(blk->d);
#pragma GCC unroll 4
            for (int j = 0; j < NT; j++) {
                __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv[j], wv)), ones);
                acc[i][j] =
                    _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dw * xd[j * xds + b]), acc[i][j]);
            }
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < NR; i++)
#pragma GCC unroll 4
        for (int j = 0; j < NT; j++)
            res[i][j] = avx2_hsum(acc[i][j]);
}

CPU_AVX2 static void avx2_q8_tile(int nr, int nt, const uint8_t *w, size_t ws, const int8_t *xq, int64_t xqs,
                                  const float *xd, int64_t xds, int64_t nb, cpu_tile_res res) {
    if (nr == 4 && nt == 2) {
        avx2_q8_body(4, 2, w, ws, xq, xqs, xd, xds, nb, res);
        return;
    }
    if (nr == 4 && nt == 1) {
        avx2_q8_body(4, 1, w, ws, xq, xqs, xd, xds, nb, res);
        return;
    }
    for (int i = 0; i < nr; i++) { /* row tail: one row at a time */
        float(*r)[CPU_MT] = (float(*)[CPU_MT])res[i];
        if (nt == 2)
            avx2_q8_body(1, 2, w + (size_t)i * ws, ws, xq, xqs, xd, xds, nb, r);
        else
            avx2_q8_body(1, 1, w + (size_t)i * ws, ws, xq, xqs, xd, xds, nb, r);
    }
}

/* One f32 FMA tile for f32/f16/bf16 weights; DT picks the load (a constant
 * after inlining). Columns past the last multiple of 8 go scalar. */
CPU_AVX2 CPU_INLINE __m256 avx2_load_w(duet_dtype DT, const uint8_t *row, int64_t k) {
    if (DT == DUET_DTYPE_F16) return avx2_load_f16((const uint16_t *)row + k);
    if (DT == DUET_DTYPE_BF16) return avx2_load_bf16((const uint16_t *)row + k);
    return _mm256_loadu_ps((const float *)row + k);
}

CPU_AVX2 CPU_INLINE float avx2_w_scalar(duet_dtype DT, const uint8_t *row, int64_t k) {
    if (DT == DUET_DTYPE_F16) return _cvtsh_ss(((const uint16_t *)row)[k]);
    if (DT == DUET_DTYPE_BF16) return cpu_bf16_to_f32(((const uint16_t *)row)[k]);
    return ((const float *)row)[k];
}

CPU_AVX2 CPU_INLINE void avx2_f_body(duet_dtype DT, const int NR, const int NT, const uint8_t *w, size_t ws,
                                     const float *x, int64_t xs, int64_t n, cpu_tile_res res) {
    __m256 acc[CPU_MR][CPU_MT];
#pragma GCC unroll 4
    for (int i = 0; i < NR; i++)
#pragma GCC unroll 4
        for (int j = 0; j < NT; j++)
            acc[i][j] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= n; k += 8) {
        __m256 xv[CPU_MT];
#pragma GCC unroll 4
        for (int j = 0; j < NT; j++)
            xv[j] = _mm256_loadu_ps(x + j * xs + k);
#pragma GCC unroll 4
        for (int i = 0; i < NR; i++) {
            CPU_PREFETCH(w + (size_t)(i + CPU_MR) * ws + (size_t)k * (DT == DUET_DTYPE_F32 ? 4 : 2));
            __m256 wv = avx2_load_w(DT, w + (size_t)i * ws, k);
#pragma GCC unroll 4
            for (int j = 0; j < NT; j++)
                acc[i][j] = _mm256_fmadd_ps(wv, xv[j], acc[i][j]);
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < NR; i++)
#pragma GCC unroll 4
        for (int j = 0; j < NT; j++) {
            float s = avx2_hsum(acc[i][j]);
            for (int64_t kk = k; kk < n; kk++)
                s += avx2_w_scalar(DT, w + (size_t)i * ws, kk) * x[j * xs + kk];
            res[i][j] = s;
        }
}

#define AVX2_F_TILE(name, DT)                                                                                \
    CPU_AVX2 static void name(int nr, int nt, const uint8_t *w, size_t ws, const float *x, int64_t xs,       \
                              int64_t n, cpu_tile_res res) {                                                 \
        if (nr == 4 && nt == 2) {                                                                            \
            avx2_f_body(DT, 4, 2, w, ws, x, xs, n, res);                                                     \
            return;                                                                                          \
        }                                                                                                    \
        if (nr == 4 && nt == 1) {                                                                            \
            avx2_f_body(DT, 4, 1, w, ws, x, xs, n, res);                                                     \
            return;                                                                                          \
        }                                                                                                    \
        for (int i = 0; i < nr; i++) {                                                                       \
            float(*r)[CPU_MT] = (float(*)[CPU_MT])res[i];                                                    \
            if (nt == 2)                                                                                     \
                avx2_f_body(DT, 1, 2, w + (size_t)i * ws, ws, x, xs, n, r);                                  \
            else                                                                                             \
                avx2_f_body(DT, 1, 1, w + (size_t)i * ws, ws, x, xs, n, r);                                  \
        }                                                                                                    \
    }
AVX2_F_TILE(avx2_f32_tile, DUET_DTYPE_F32)
AVX2_F_TILE(avx2_f16_tile, DUET_DTYPE_F16)
AVX2_F_TILE(avx2_bf16_tile, DUET_DTYPE_BF16)

/* 16 ymm registers: 4 rows x 2 tokens of accumulators leaves room for the
 * loads and temporaries. */
static const mm_kernels mm_avx2 = {
    .mr = 4,
    .mt = 2,
    .d_pair_floats = 2,
    .quantize = avx2_quantize,
    .q8 = avx2_q8_tile,
    .f32 = avx2_f32_tile,
    .f16 = avx2_f16_tile,
    .bf16 = avx2_bf16_tile,
};

/* ======================================================================== */
/* avx512 (f, bw, vl, vnni)                                                    */
/* ======================================================================== */

/* avx2_quantize with 16 lanes; masks instead of blends. */
CPU_AVX512 static void avx512_quantize(const float *x, duet_block_q8_0 *y, int64_t n) {
    const __m512 zero = _mm512_setzero_ps(), half = _mm512_set1_ps(0.5f), one = _mm512_set1_ps(1.0f);
    const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
    const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
    for (int64_t b = 0; b < n / 32; b++) {
        __m512 v[2] = {_mm512_loadu_ps(x + b * 32), _mm512_loadu_ps(x + b * 32 + 16)};
        /* maxps returns its second operand when one is NaN: NaN never wins. */
        __m512 m = _mm512_max_ps(_mm512_abs_ps(v[1]), _mm512_max_ps(_mm512_abs_ps(v[0]), zero));
        float amax = _mm512_reduce_max_ps(m);
        float d = amax / 127.0f;
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        y[b].d = _cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT);
        __m512 s = _mm512_set1_ps(id);
        for (int k = 0; k < 2; k++) {
            __m512 yv = _mm512_mul_ps(v[k], s);
            __m512 t = _mm512_roundscale_ps(yv, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
            __mmask16 away = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_sub_ps(yv, t)), half, _CMP_GE_OQ);
            __m512 sg = _mm512_castsi512_ps(
                _mm512_or_si512(_mm512_castps_si512(one), _mm512_and_si512(sign, _mm512_castps_si512(yv))));
            __m512 r = _mm512_mask_add_ps(t, away, t, sg);
            __mmask16 ord = _mm512_cmp_ps_mask(r, r, _CMP_ORD_Q);
            r = _mm512_min_ps(_mm512_max_ps(r, lo), hi);
            __m512i q = _mm512_maskz_cvtps_epi32(ord, r); /* integral: exact; NaN -> 0 */
            _mm_storeu_si128((__m128i *)(y[b].qs + 16 * k), _mm512_cvtsepi32_epi8(q));
        }
    }
}

/* Two blocks per 512-bit register. vpdpbusd multiplies unsigned by signed
 * bytes: with u = x + 128 (stored so by mm_tile_layout) and the weights as
 * they are, sum(u*w) = sum(x*w) + 128*sum(w). The correction 128*sum(w) is
 * one vpdpbusd per weight vector, shared by the tile's tokens, and enters
 * negated as each token's accumulator start value. A zero upper half (odd
 * last block) contributes zero to both. */
CPU_AVX512 CPU_INLINE void avx512_q8_body(const int NR, const int NT, const uint8_t *w, size_t ws,
                                          const int8_t *xq, int64_t xqs, const float *xd, int64_t xds,
                                          int64_t nb, cpu_tile_res res) {
    __m512 acc[CPU_MR][CPU_MT];
    const __m512i zero = _mm512_setzero_si512(), c128 = _mm512_set1_epi8((char)0x80);
#pragma GCC unroll 4
    for (int i = 0; i < NR; i++)
#pragma GCC unroll 4
        for (int j = 0; j < NT; j++)
            acc[i][j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b += 2) {
        const bool pair = b + 1 < nb;
        __m512i xv[CPU_MT];
        __m512 dx[CPU_MT];
#pragma GCC unroll 4
        for (int j = 0; j < NT; j++) {
            xv[j] = _mm512_loadu_si512(xq + j * xqs + b * 32);
            dx[j] = _mm512_loadu_ps(xd + j * xds + b * 8);
        }
#pragma GCC unroll 4
        for (int i = 0; i < NR; i++) {
            const duet_block_q8_0 *blk = (const duet_block_q8_0 *)(w + (size_t)i * ws) + b;
            /* 68 bytes per pair: two prefetches cover every line. */
            CPU_PREFETCH((const uint8_t *)blk + CPU_MR * ws);
            CPU_PREFETCH((const uint8_t *)blk + CPU_MR * ws + 64);
            __m512i wv;
            __m256i dh;
            if (pair) { /* blocks are 34 bytes apart: two 32-byte loads */
                wv =
                    _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)blk[0].qs)),
                                       _mm256_loadu_si256((const __m256i *)blk[1].qs), 1);
                dh = _mm256_set_m128i(_mm_set1_epi16((short)blk[1].d), _mm_set1_epi16((short)blk[0].d));
            } else { /* odd last block: zero upper weights add nothing */
                wv = _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)blk[0].qs));
                dh = _mm256_set_m128i(_mm_setzero_si128(), _mm_set1_epi16((short)blk[0].d));
            }
            __m512 dw = _mm512_cvtph_ps(dh);
            __m512i corr = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, c128, wv));
#pragma GCC unroll 4
            for (int j = 0; j < NT; j++) {
                __m512i dot = _mm512_dpbusd_epi32(corr, xv[j], wv);
                acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw, dx[j]), acc[i][j]);
            }
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < NR; i++)
#pragma GCC unroll 4
        for (int j = 0; j < NT; j++)
            res[i][j] = _mm512_reduce_add_ps(acc[i][j]);
}

CPU_AVX512 static void avx512_q8_tile(int nr, int nt, const uint8_t *w, size_t ws, const int8_t *xq,
                                      int64_t xqs, const float *xd, int64_t xds, int64_t nb,
                                      cpu_tile_res res) {
    if (nr == 4) {
        switch (nt) {
        case 4: {
            avx512_q8_body(4, 4, w, ws, xq, xqs, xd, xds, nb, res);
            return;
        }
        case 3: {
            avx512_q8_body(4, 3, w, ws, xq, xqs, xd, xds, nb, res);
            return;
        }
        case 2: {
            avx512_q8_body(4, 2, w, ws, xq, xqs, xd, xds, nb, res);
            return;
        }
        default: {
            avx512_q8_body(4, 1, w, ws, xq, xqs, xd, xds, nb, res);
            return;
        }
        }
    }
    for (int i = 0; i < nr; i++) {
        float(*r)[CPU_MT] = (float(*)[CPU_MT])res[i];
        const uint8_t *wi = w + (size_t)i * ws;
        switch (nt) {
        case 4:
            avx512_q8_body(1, 4, wi, ws, xq, xqs, xd, xds, nb, r);
            break;
        case 3:
            avx512_q8_body(1, 3, wi, ws, xq, xqs, xd, xds, nb, r);
            break;
        case 2:
            avx512_q8_body(1, 2, wi, ws, xq, xqs, xd, xds, nb, r);
            break;
        default:
            avx512_q8_body(1, 1, wi, ws, xq, xqs, xd, xds, nb, r);
            break;
        }
    }
}

CPU_AVX512 CPU_INLINE __m512 avx512_load_w(duet_dtype DT, const uint8_t *row, int64_t k) {
    if (DT == DUET_DTYPE_F16) return avx512_load_f16((const uint16_t *)row + k);
    if (DT == DUET_DTYPE_BF16) return avx512_load_bf16((const uint16_t *)row + k);
    return _mm512_loadu_ps((const float *)row + k);
}

CPU_AVX512 CPU_INLINE __m512 avx512_maskload_w(duet_dtype DT, const uint8_t *row, int64_t k, __mmask16 m) {
    if (DT == DUET_DTYPE_F16) return avx512_maskload_f16((const uint16_t *)row + k, m);
    if (DT == DUET_DTYPE_BF16) return avx512_maskload_bf16((const uint16_t *)row + k, m);
    return _mm512_maskz_loadu_ps(m, (const float *)row + k);
}

CPU_AVX512 CPU_INLINE void avx512_f_body(duet_dtype DT, const int NR, const int NT, const uint8_t *w,
                                         size_t ws, const float *x, int64_t xs, int64_t n, cpu_tile_res res) {
    __m512 acc[CPU_MR][CPU_MT];
#pragma GCC unroll 4
    for (int i = 0; i < NR; i++)
#pragma GCC unroll 4
        for (int j = 0; j < NT; j++)
            acc[i][j] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= n; k += 16) {
        __m512 xv[CPU_MT];
#pragma GCC unroll 4
        for (int j = 0; j < NT; j++)
            xv[j] = _mm512_loadu_ps(x + j * xs + k);
#pragma GCC unroll 4
        for (int i = 0; i < NR; i++) {
            CPU_PREFETCH(w + (size_t)(i + CPU_MR) * ws + (size_t)k * (DT == DUET_DTYPE_F32 ? 4 : 2));
            __m512 wv = avx512_load_w(DT, w + (size_t)i * ws, k);
#pragma GCC unroll 4
            for (int j = 0; j < NT; j++)
                acc[i][j] = _mm512_fmadd_ps(wv, xv[j], acc[i][j]);
        }
    }
    if (k < n) { /* masked tail: reads only the row's remaining columns */
        __mmask16 m = avx512_tail_mask(n - k);
        __m512 xv[CPU_MT];
#pragma GCC unroll 4
        for (int j = 0; j < NT; j++)
            xv[j] = _mm512_maskz_loadu_ps(m, x + j * xs + k);
#pragma GCC unroll 4
        for (int i = 0; i < NR; i++) {
            __m512 wv = avx512_maskload_w(DT, w + (size_t)i * ws, k, m);
#pragma GCC unroll 4
            for (int j = 0; j < NT; j++)
                acc[i][j] = _mm512_fmadd_ps(wv, xv[j], acc[i][j]);
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < NR; i++)
#pragma GCC unroll 4
        for (int j = 0; j < NT; j++)
            res[i][j] = _mm512_reduce_add_ps(acc[i][j]);
}

#define AVX512_F_TILE(name, DT)                                                                              \
    CPU_AVX512 static void name(int nr, int nt, const uint8_t *w, size_t ws, const float *x, int64_t xs,     \
                                int64_t n, cpu_tile_res res) {                                               \
        if (nr == 4) {                                                                                       \
            switch (nt) {                                                                                    \
            case 4: {                                                                                        \
                avx512_f_body(DT, 4, 4, w, ws, x, xs, n, res);                                               \
                return;                                                                                      \
            }                                                                                                \
            case 3: {                                                                                        \
                avx512_f_body(DT, 4, 3, w, ws, x, xs, n, res);                                               \
                return;                                                                                      \
            }                                                                                                \
            case 2: {                                                                                        \
                avx512_f_body(DT, 4, 2, w, ws, x, xs, n, res);                                               \
                return;                                                                                      \
            }                                                                                                \
            default: {                                                                                       \
                avx512_f_body(DT, 4, 1, w, ws, x, xs, n, res);                                               \
                return;                                                                                      \
            }                                                                                                \
            }                                                                                                \
        }                                                                                                    \
        for (int i = 0; i < nr; i++) {                                                                       \
            float(*r)[CPU_MT] = (float(*)[CPU_MT])res[i];                                                    \
            const uint8_t *wi = w + (size_t)i * ws;                                                          \
            switch (nt) {                                                                                    \
            case 4:                                                                                          \
                avx512_f_body(DT, 1, 4, wi, ws, x, xs, n, r);                                                \
                break;                                                                                       \
            case 3:                                                                                          \
                avx512_f_body(DT, 1, 3, wi, ws, x, xs, n, r);                                                \
                break;                                                                                       \
            case 2:                                                                                          \
                avx512_f_body(DT, 1, 2, wi, ws, x, xs, n, r);                                                \
                break;                                                                                       \
            default:                                                                                         \
                avx512_f_body(DT, 1, 1, wi, ws, x, xs, n, r);                                                \
                break;                                                                                       \
            }                                                                                                \
        }                                                                                                    \
    }
AVX512_F_TILE(avx512_f32_tile, DUET_DTYPE_F32)
AVX512_F_TILE(avx512_f16_tile, DUET_DTYPE_F16)
AVX512_F_TILE(avx512_bf16_tile, DUET_DTYPE_BF16)

/* ---- F16 repacked groups (cpu_internal.h) ---------------------------------- */

#define F16RP_TOKENS 12 /* tokens per pass, at most (2 groups: 24 accumulators) */
/* Decode prefetches each group's stream this far ahead (the 4 groups of a
 * pass are 4 streams the hardware prefetcher takes up late). */
#define F16RP_PF 1024

/* One pass: NG groups (gs bytes apart) against NT tokens, all n columns;
 * writes out (+ bias, + out). x is the pass's activations column by
 * column (x[k * NT + j]: token j's column k), so every broadcast is at a
 * constant offset from one pointer. */
typedef struct f16rp_job {
    const uint8_t *g;
    size_t gs;
    int64_t n;
    const float *x;
    const float *bias; /* at the first group's first row, or NULL */
    bool accumulate;
    float *out; /* the first token's first row */
    int64_t os; /* floats between tokens of out */
} f16rp_job;

/* Per column k: each group's 16 halves become 16 floats (a row per lane),
 * each token's x[k] is broadcast, and one FMA per group and token adds the
 * products. Two columns per step (one cache line per group). A row's sum
 * over k runs in order in its lane, so a token's bits do not depend on NG,
 * NT or the pass it lands in. */
CPU_AVX512 CPU_INLINE void avx512_f16rp_body(const int NG, const int NT, const f16rp_job *jb) {
    __m512 acc[4][F16RP_TOKENS];
#pragma GCC unroll 4
    for (int g = 0; g < NG; g++)
#pragma GCC unroll 12
        for (int j = 0; j < NT; j++)
            acc[g][j] = _mm512_setzero_ps();
    const uint8_t *w = jb->g;
    const float *x = jb->x;
    const int64_t n = jb->n;
    const size_t gs = jb->gs;
    int64_t k = 0;
    for (; k + 2 <= n; k += 2) {
        __m512 w0[4], w1[4];
#pragma GCC unroll 4
        for (int g = 0; g < NG; g++) {
            const uint8_t *p = w + (size_t)g * gs + (size_t)k * 32;
            if (NT == 1) CPU_PREFETCH(p + F16RP_PF);
            __m512i v = _mm512_loadu_si512(p);
            w0[g] = _mm512_cvtph_ps(_mm512_castsi512_si256(v));
            w1[g] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(v, 1));
        }
#pragma GCC unroll 12
        for (int j = 0; j < NT; j++) {
            const __m512 xv = _mm512_set1_ps(x[k * NT + j]);
#pragma GCC unroll 4
            for (int g = 0; g < NG; g++)
                acc[g][j] = _mm512_fmadd_ps(w0[g], xv, acc[g][j]);
        }
#pragma GCC unroll 12
        for (int j = 0; j < NT; j++) {
            const __m512 xv = _mm512_set1_ps(x[(k + 1) * NT + j]);
#pragma GCC unroll 4
            for (int g = 0; g < NG; g++)
                acc[g][j] = _mm512_fmadd_ps(w1[g], xv, acc[g][j]);
        }
    }
    if (k < n) { /* an odd last column */
        __m512 w0[4];
#pragma GCC unroll 4
        for (int g = 0; g < NG; g++)
            w0[g] =
                _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + (size_t)g * gs + (size_t)k * 32)));
#pragma GCC unroll 12
        for (int j = 0; j < NT; j++) {
            const __m512 xv = _mm512_set1_ps(x[k * NT + j]);
#pragma GCC unroll 4
            for (int g = 0; g < NG; g++)
                acc[g][j] = _mm512_fmadd_ps(w0[g], xv, acc[g][j]);
        }
    }
#pragma GCC unroll 4
    for (int g = 0; g < NG; g++) {
        const __m512 bias = jb->bias ? _mm512_loadu_ps(jb->bias + 16 * g) : _mm512_setzero_ps();
#pragma GCC unroll 12
        for (int j = 0; j < NT; j++) {
            float *o = jb->out + j * jb->os + 16 * g;
            __m512 v = _mm512_add_ps(acc[g][j], bias);
            if (jb->accumulate) v = _mm512_add_ps(_mm512_loadu_ps(o), v);
            _mm512_storeu_ps(o, v);
        }
    }
}

typedef void (*f16rp_fn)(const f16rp_job *jb);
#define AVX512_F16RP(NG, NT)                                                                                 \
    CPU_AVX512 static void avx512_f16rp_##NG##_##NT(const f16rp_job *jb) {                                   \
        avx512_f16rp_body(NG, NT, jb);                                                                       \
    }
#define AVX512_F16RP_NG(NG)                                                                                  \
    AVX512_F16RP(NG, 1)                                                                                      \
    AVX512_F16RP(NG, 2)                                                                                      \
    AVX512_F16RP(NG, 3)                                                                                      \
    AVX512_F16RP(NG, 4)                                                                                      \
    AVX512_F16RP(NG, 5)                                                                                      \
    AVX512_F16RP(NG, 6)                                                                                      \
    AVX512_F16RP(NG, 7)                                                                                      \
    AVX512_F16RP(NG, 8)                                                                                      \
    AVX512_F16RP(NG, 9)                                                                                      \
    AVX512_F16RP(NG, 10)                                                                                     \
    AVX512_F16RP(NG, 11)                                                                                     \
    AVX512_F16RP(NG, 12)
AVX512_F16RP_NG(1)
AVX512_F16RP_NG(2)
AVX512_F16RP(4, 1)

/* Passes of 1..12 tokens (index nt - 1), for 1 group and for 2. */
#define F16RP_FNS(NG)                                                                                        \
    {                                                                                                        \
        avx512_f16rp_##NG##_1, avx512_f16rp_##NG##_2, avx512_f16rp_##NG##_3, avx512_f16rp_##NG##_4,          \
            avx512_f16rp_##NG##_5, avx512_f16rp_##NG##_6, avx512_f16rp_##NG##_7, avx512_f16rp_##NG##_8,      \
            avx512_f16rp_##NG##_9, avx512_f16rp_##NG##_10, avx512_f16rp_##NG##_11, avx512_f16rp_##NG##_12    \
    }
static const f16rp_fn f16rp_fns[2][F16RP_TOKENS] = {F16RP_FNS(1), F16RP_FNS(2)};

/* ---- the q8_0 panel ------------------------------------------------------- */

/* Loads block b of the 16 rows from w (ws bytes apart) and transposes it:
 * v[c] lane l = bytes 4c..4c+3 of row l's quants, XORed with 0x80 (= q + 128:
 * vpdpbusd's unsigned operand). */
CPU_AVX512 CPU_INLINE void avx512_panel_transpose(const uint8_t *w, size_t ws, int64_t b, __m512i v[8]) {
    /* Row addresses are plain w + r * ws (scalar arithmetic on ports the
     * vector work leaves free). */
    const uint8_t *q = w + b * sizeof(duet_block_q8_0) + 2;
    __m256i rows[16];
#pragma GCC unroll 16
    for (int r = 0; r < 16; r++)
        rows[r] = _mm256_loadu_si256((const __m256i *)(q + (size_t)r * ws));
    avx512_transpose_16x8d(rows, v);
    const __m512i x80 = _mm512_set1_epi8((char)0x80);
#pragma GCC unroll 8
    for (int c = 0; c < 8; c++)
        v[c] = _mm512_xor_si512(v[c], x80);
}

/* Lane l of a token's int32 accumulator gets row l's dot product for one
 * block: vpdpbusd adds (w + 128) * q over 4 bytes per instruction, 8 of
 * them per block, each with the token's 4 quant bytes broadcast from memory.
 * sum((w + 128) q) = sum(w q) + 128 sum(q), so the accumulator starts at
 * -128 sum(q) (aux.ncx, per token and block). Then the float accumulator
 * gets that times d_w (lanes) * d_x (broadcast).
 * Registers: NT accumulators + 8 weight vectors + scales: NT <= 16. */
CPU_AVX512 CPU_INLINE void avx512_panel_body(const int NT, const q8_panel *p) {
    /* Byte offsets of the rows for the scale gather (the driver keeps them
     * within int32). */
    const __m512i gidx =
        _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                           _mm512_set1_epi32((int)p->ws));
    __m512i *pack = p->pack;
    __m512 acc[CPU_PANEL_TOKENS];
#pragma GCC unroll 16
    for (int j = 0; j < NT; j++)
        acc[j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < p->nb; b++) {
        __m512i v[8];
        __m512 dw;
        if (p->pack_mode == PANEL_LOAD) {
#pragma GCC unroll 8
            for (int c = 0; c < 8; c++)
                v[c] = _mm512_load_si512(pack + b * 9 + c);
            dw = _mm512_castsi512_ps(_mm512_load_si512(pack + b * 9 + 8));
        } else {
            /* The next panel's rows (a thread's rows are contiguous): one
             * prefetch per row every 2 blocks (68 bytes) touches nearly
             * every line; the hardware prefetcher fills the rest. */
            if ((b & 1) == 0) {
#pragma GCC unroll 16
                for (size_t r = CPU_PANEL_ROWS; r < 2 * CPU_PANEL_ROWS; r++)
                    CPU_PREFETCH(p->w + r * p->ws + (size_t)b * sizeof(duet_block_q8_0));
            }
            avx512_panel_transpose(p->w, p->ws, b, v);
            /* The scale is the block's first 2 bytes: gather the dwords there. */
            __m512i dd = _mm512_i32gather_epi32(gidx, p->w + b * sizeof(duet_block_q8_0), 1);
            dw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dd));
            if (p->pack_mode == PANEL_STORE) {
#pragma GCC unroll 8
                for (int c = 0; c < 8; c++)
                    _mm512_store_si512(pack + b * 9 + c, v[c]);
                _mm512_store_si512(pack + b * 9 + 8, _mm512_castps_si512(dw));
            }
        }
#pragma GCC unroll 16
        for (int j = 0; j < NT; j++) {
            const int8_t *q = p->x[j * p->nb + b].qs;
            const q8_aux *a = p->aux + j * p->nb + b;
            __m512i r = _mm512_set1_epi32(a->ncx);
#pragma GCC unroll 8
            for (int c = 0; c < 8; c++) {
                int32_t q4;
                memcpy(&q4, q + 4 * c, 4);
                r = _mm512_dpbusd_epi32(r, v[c], _mm512_set1_epi32(q4));
            }
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(r), _mm512_mul_ps(dw, _mm512_set1_ps(a->dx)), acc[j]);
        }
    }
    __mmask16 m = (__mmask16)(0xffffu << p->first);
    __m512 bias = p->bias ? _mm512_maskz_loadu_ps(m, p->bias) : _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int j = 0; j < NT; j++) {
        float *o = p->out + j * p->os;
        __m512 v = _mm512_add_ps(acc[j], bias);
        if (p->accumulate) v = _mm512_add_ps(_mm512_maskz_loadu_ps(m, o), v);
        _mm512_mask_storeu_ps(o, m, v);
    }
}

/* sum(q) of a block: vpsadbw adds 8 unsigned bytes at a time, so sum the
 * bytes as q + 128 and take 32 * 128 off. */
CPU_AVX512 static void avx512_panel_aux(const duet_block_q8_0 *xb, int64_t nb, q8_aux *aux) {
    const __m256i x80 = _mm256_set1_epi8((char)0x80);
    for (int64_t b = 0; b < nb; b++) {
        __m256i u = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)xb[b].qs), x80);
        __m256i s4 = _mm256_sad_epu8(u, _mm256_setzero_si256());
        __m128i s2 = _mm_add_epi64(_mm256_castsi256_si128(s4), _mm256_extracti128_si256(s4, 1));
        int32_t s = (int32_t)(_mm_cvtsi128_si64(s2) + _mm_extract_epi64(s2, 1)) - 32 * 128;
        aux[b] = (q8_aux){-128 * s, _cvtsh_ss(xb[b].d)};
    }
}

#define AVX512_PANEL(N)                                                                                      \
    CPU_AVX512 static void avx512_panel_##N(const q8_panel *p) {                                             \
        avx512_panel_body(N, p);                                                                             \
    }
AVX512_PANEL(1)
AVX512_PANEL(2)
AVX512_PANEL(3)
AVX512_PANEL(4)
AVX512_PANEL(5)
AVX512_PANEL(6)
AVX512_PANEL(7)
AVX512_PANEL(8)
AVX512_PANEL(9)
AVX512_PANEL(10)
AVX512_PANEL(11)
AVX512_PANEL(12)
AVX512_PANEL(13)
AVX512_PANEL(14)
AVX512_PANEL(15)
AVX512_PANEL(16)

static void avx512_panel(const q8_panel *p, int nt) {
    static void (*const fn[CPU_PANEL_TOKENS + 1])(const q8_panel *) = {
        [1] = avx512_panel_1,   [2] = avx512_panel_2,   [3] = avx512_panel_3,   [4] = avx512_panel_4,
        [5] = avx512_panel_5,   [6] = avx512_panel_6,   [7] = avx512_panel_7,   [8] = avx512_panel_8,
        [9] = avx512_panel_9,   [10] = avx512_panel_10, [11] = avx512_panel_11, [12] = avx512_panel_12,
        [13] = avx512_panel_13, [14] = avx512_panel_14, [15] = avx512_panel_15, [16] = avx512_panel_16,
    };
    assert(nt >= 1 && nt <= CPU_PANEL_TOKENS);
    fn[nt](p);
}

/* 32 zmm registers: 4 x 4 accumulators plus 4 activation vectors. */
static const mm_kernels mm_avx512 = {
    .mr = 4,
    .mt = 4,
    .d_pair_floats = 16,
    .q_unsigned = true,
    .quantize = avx512_quantize,
    .q8 = avx512_q8_tile,
    .f32 = avx512_f32_tile,
    .f16 = avx512_f16_tile,
    .bf16 = avx512_bf16_tile,
    .panel = avx512_panel,
    .panel_aux = avx512_panel_aux,
};
#endif /* CPU_X86 */

static const mm_kernels *mm_kernels_for(cpu_isa isa) {
#if CPU_X86
    if (isa == CPU_ISA_AVX512) return &mm_avx512;
    if (isa == CPU_ISA_AVX2) return &mm_avx2;
#endif
    (void)isa;
    return &mm_scalar;
}

/* ======================================================================== */
/* driver                                                                     */
/* ======================================================================== */

typedef struct mm_task {
    const mm_kernels *k;
    duet_dtype dtype;
    int n_tokens;
    int64_t n_in, n_out;
    const uint8_t *w;
    size_t ws; /* bytes per weight row */
    const float *x, *bias;
    float *out;
    bool accumulate;
    /* Q8_0 weights: activation blocks [n_tokens][nb], the op's x_q8 or x
     * quantised into xbuf, then either the tile layout (xq, xd: rows of
     * xqs bytes and xds floats) or the panel's aux [n_tokens][nb]. */
    int64_t nb;
    const duet_block_q8_0 *xb;
    duet_block_q8_0 *xbuf;
    int8_t *xq;
    float *xd;
    int64_t xqs, xds;
    q8_aux *aux;
    uint8_t *packs; /* per worker: nb * CPU_PANEL_PACK bytes */
    size_t pack_bytes;
    int64_t token_chunk; /* tokens whose activations stay in L2 while W rows cycle */
} mm_task;

/* One token's q8_0 blocks -> the tile kernels' layout: quants (+128 as
 * unsigned for avx512) padded to whole block pairs, scales as f32 per block
 * (2 per pair) or pre-broadcast (16 per pair). A missing second block of the
 * last pair gets quants 0 and scale 0. */
static void mm_tile_layout(const mm_kernels *k, const duet_block_q8_0 *xb, int64_t nb, int8_t *qs, float *d) {
    const uint8_t off = k->q_unsigned ? 0x80 : 0;
    for (int64_t b = 0; b < nb + nb % 2; b++) {
        uint8_t *o = (uint8_t *)qs + b * 32;
        float s = 0.0f;
        if (b < nb) {
            for (int i = 0; i < 32; i++)
                o[i] = (uint8_t)xb[b].qs[i] ^ off;
            s = duet_fp16_to_fp32(xb[b].d);
        } else {
            memset(o, off, 32);
        }
        if (k->d_pair_floats == 2) {
            d[b] = s;
        } else {
            for (int i = 0; i < 8; i++)
                d[(b / 2) * 16 + (b % 2) * 8 + i] = s;
        }
    }
}

/* Per token: quantise x (when no x_q8 came), then the layout the row
 * kernels read. */
static void mm_prepare_task(void *p, int chunk, int n_chunks, int worker) {
    mm_task *t = p;
    int64_t lo, hi;
    cpu_split(t->n_tokens, chunk, n_chunks, 1, &lo, &hi);
    for (int64_t i = lo; i < hi; i++) {
        if (t->xbuf) t->k->quantize(t->x + i * t->n_in, t->xbuf + i * t->nb, t->n_in);
        const duet_block_q8_0 *xb = t->xb + i * t->nb;
        if (t->aux)
            t->k->panel_aux(xb, t->nb, t->aux + i * t->nb);
        else
            mm_tile_layout(t->k, xb, t->nb, t->xq + i * t->xqs, t->xd + i * t->xds);
    }
}

static void mm_store(const mm_task *t, int64_t r, int64_t tok, int nr, int nt, cpu_tile_res res) {
    for (int j = 0; j < nt; j++) {
        float *o = t->out + (tok + j) * t->n_out + r;
        for (int i = 0; i < nr; i++) {
            float v = res[i][j] + (t->bias ? t->bias[r + i] : 0.0f);
            o[i] = t->accumulate ? o[i] + v : v;
        }
    }
}

/* Rows [lo, hi) by the tiles. */
static void mm_rows_range(const mm_task *t, int64_t lo, int64_t hi) {
    const mm_kernels *k = t->k;
    f_tile_fn f = t->dtype == DUET_DTYPE_F16 ? k->f16 : t->dtype == DUET_DTYPE_BF16 ? k->bf16 : k->f32;
    cpu_tile_res res;
    for (int64_t t0 = 0; t0 < t->n_tokens; t0 += t->token_chunk) {
        int64_t t1 = t0 + t->token_chunk < t->n_tokens ? t0 + t->token_chunk : t->n_tokens;
        for (int64_t r = lo; r < hi; r += k->mr) {
            int nr = (int)(hi - r < k->mr ? hi - r : k->mr);
            const uint8_t *w = t->w + (size_t)r * t->ws;
            for (int64_t tok = t0; tok < t1; tok += k->mt) {
                int nt = (int)(t1 - tok < k->mt ? t1 - tok : k->mt);
                if (t->dtype == DUET_DTYPE_Q8_0)
                    k->q8(nr, nt, w, t->ws, t->xq + tok * t->xqs, t->xqs, t->xd + tok * t->xds, t->xds, t->nb,
                          res);
                else
                    f(nr, nt, w, t->ws, t->x + tok * t->n_in, t->n_in, t->n_in, res);
                mm_store(t, r, tok, nr, nt, res);
            }
        }
    }
}

static void mm_rows_task(void *p, int chunk, int n_chunks, int worker) {
    (void)worker;
    const mm_task *t = p;
    int64_t lo, hi;
    cpu_split(t->n_out, chunk, n_chunks, t->k->mr, &lo, &hi);
    mm_rows_range(t, lo, hi);
}

/* Panels of CPU_PANEL_ROWS rows; per token chunk each panel meets the
 * chunk's tokens in balanced groups of at most CPU_PANEL_TOKENS. The first
 * group transposes the weights; with more groups it keeps them in the
 * worker's pack for the rest. */
static void mm_panel_task(void *p, int chunk, int n_chunks, int worker) {
    mm_task *t = p;
    int64_t lo, hi;
    cpu_split(t->n_out, chunk, n_chunks, CPU_PANEL_ROWS, &lo, &hi);
    q8_panel pn = {.ws = t->ws, .nb = t->nb, .accumulate = t->accumulate, .os = t->n_out};
    pn.pack = t->packs ? t->packs + (size_t)worker * t->pack_bytes : NULL;
    /* Token chunks balanced too. */
    int64_t n_tc = (t->n_tokens + t->token_chunk - 1) / t->token_chunk;
    for (int64_t tc = 0; tc < n_tc; tc++) {
        int64_t t0 = t->n_tokens * tc / n_tc, t1 = t->n_tokens * (tc + 1) / n_tc;
        int64_t n = t1 - t0, groups = (n + CPU_PANEL_TOKENS - 1) / CPU_PANEL_TOKENS;
        for (int64_t r = lo; r < hi; r += CPU_PANEL_ROWS) {
            int64_t r0 = hi - r < CPU_PANEL_ROWS ? hi - CPU_PANEL_ROWS : r; /* n_out >= 16 */
            pn.first = (int)(r - r0);
            pn.w = t->w + (size_t)r0 * t->ws;
            pn.bias = t->bias ? t->bias + r0 : NULL;
            for (int64_t g = 0; g < groups; g++) {
                int64_t a = t0 + n * g / groups, b = t0 + n * (g + 1) / groups;
                pn.x = t->xb + a * t->nb;
                pn.aux = t->aux + a * t->nb;
                pn.out = t->out + a * t->n_out + r0;
                pn.pack_mode = groups == 1 ? PANEL_DIRECT : g == 0 ? PANEL_STORE : PANEL_LOAD;
                t->k->panel(&pn, (int)(b - a));
            }
        }
    }
}

void duet__cpu_quantize_q8_0(const cpu_backend *be, const float *x, duet_block_q8_0 *y, int64_t n) {
    mm_kernels_for(be->isa)->quantize(x, y, n);
}

static size_t mm_align64(size_t n) {
    return (n + 63) & ~(size_t)63;
}

duet_status duet__cpu_matmul(cpu_backend *be, const duet_op *op, const void *w, const float *x,
                             const duet_block_q8_0 *xq, const float *bias, float *out) {
    if (duet_dtype_is_packed_quant(op->matmul.dtype))
        return duet__cpu_matmul_blocks(be, op, w, x, xq, bias, out);
    const mm_kernels *k = mm_kernels_for(be->isa);
    mm_task t = {
        .k = k,
        .dtype = op->matmul.dtype,
        .n_tokens = op->n_tokens,
        .n_in = op->matmul.n_in,
        .n_out = op->matmul.n_out,
        .w = w,
        .ws = duet_dtype_row_bytes(op->matmul.dtype, op->matmul.n_in),
        .x = x,
        .bias = bias,
        .out = out,
        .accumulate = op->matmul.accumulate,
    };
    if (xq && t.dtype != DUET_DTYPE_Q8_0)
        return duet__error(DUET_INVALID_ARGUMENT, "matmul: q8 activations need q8_0 weights");
    int64_t x_row_bytes = t.n_in * (int64_t)sizeof(float);
    bool panel = false;
    if (t.dtype == DUET_DTYPE_Q8_0) {
        t.nb = t.n_in / 32;
        /* The panel needs 16 rows and gathers scales with 32-bit offsets of
         * up to 15 rows. The choice must not depend on n_tokens: a token's
         * result is the same bits alone or in any batch only if every
         * batch size sums in the same order. */
        panel = k->panel && t.n_out >= CPU_PANEL_ROWS && t.ws * (CPU_PANEL_ROWS - 1) <= (size_t)INT32_MAX;
        size_t n_blk = (size_t)t.n_tokens * (size_t)t.nb;
        size_t xbuf_bytes = xq ? 0 : mm_align64(n_blk * sizeof(duet_block_q8_0));
        size_t rest;
        if (panel) {
            t.token_chunk = (256 * 1024) / (t.nb * (int64_t)(sizeof(duet_block_q8_0) + sizeof(q8_aux)));
            t.token_chunk = t.token_chunk / CPU_PANEL_TOKENS * CPU_PANEL_TOKENS;
            if (t.token_chunk < CPU_PANEL_TOKENS) t.token_chunk = CPU_PANEL_TOKENS;
            bool packs = t.n_tokens > CPU_PANEL_TOKENS;
            t.pack_bytes = packs ? (size_t)t.nb * CPU_PANEL_PACK : 0;
            rest = mm_align64(n_blk * sizeof(q8_aux)) + t.pack_bytes * (size_t)be->pool->n_threads;
        } else {
            /* Token rows padded to 64 bytes so a block-pair load never
             * leaves the row; scales per pair as the path wants them. */
            int64_t npairs = (t.nb + 1) / 2;
            t.xqs = npairs * 64;
            t.xds = npairs * k->d_pair_floats;
            rest = (size_t)(t.n_tokens * t.xds) * sizeof(float) + (size_t)(t.n_tokens * t.xqs);
            x_row_bytes = t.xqs;
        }
        duet_status st = duet__cpu_scratch_reserve(&be->act, xbuf_bytes + rest);
        if (st != DUET_OK) return st;
        uint8_t *sp = be->act.p;
        t.xbuf = xq ? NULL : (duet_block_q8_0 *)sp;
        t.xb = xq ? xq : t.xbuf;
        sp += xbuf_bytes;
        if (panel) {
            t.aux = (q8_aux *)sp;
            if (t.pack_bytes) t.packs = sp + mm_align64(n_blk * sizeof(q8_aux));
        } else {
            t.xd = (float *)sp;
            t.xq = (int8_t *)(sp + (size_t)(t.n_tokens * t.xds) * sizeof(float));
        }
        /* A few tokens are prepared faster inline than a dispatch costs. */
        duet__cpu_pool_run(be->pool, t.n_tokens >= 8 ? cpu_chunks(be->pool, t.n_tokens) : 1, mm_prepare_task,
                           &t);
    }
    /* Tiny matmuls (per-op work well under the cost of a dispatch) run
     * inline; others in contiguous row ranges, a few per thread. */
    int64_t work = (int64_t)t.n_tokens * t.n_in * t.n_out;
    int chunk_rows = panel ? CPU_PANEL_ROWS : k->mr;
    int64_t units = (t.n_out + chunk_rows - 1) / chunk_rows;
    int n_chunks = work >= 32 * 1024 ? cpu_chunks(be->pool, units) : 1;
    if (panel) {
        duet__cpu_pool_run(be->pool, n_chunks, mm_panel_task, &t);
        return DUET_OK;
    }
    /* Keep a chunk of activations (~256 KiB) in L2 while the W rows of a
     * thread cycle through it; a multiple of the tile's token count. */
    int64_t chunk = (256 * 1024) / (x_row_bytes > 0 ? x_row_bytes : 1);
    chunk = chunk / k->mt * k->mt;
    t.token_chunk = chunk < k->mt ? k->mt : chunk;
    duet__cpu_pool_run(be->pool, n_chunks, mm_rows_task, &t);
    return DUET_OK;
}

/* ---- F16 repacked weights ------------------------------------------------- */

#if CPU_X86
/* A batch's passes: as many of 12 tokens as fit, then one of the rest (a
 * verification's 2 to 9 tokens in one pass: split as 8 + 1, the 1-token
 * pass's two accumulators wait on the FMA latency). Pass p's first token
 * and its size. */
static int64_t f16rp_passes(int64_t n_tokens) {
    return (n_tokens + F16RP_TOKENS - 1) / F16RP_TOKENS;
}

static int f16rp_pass(int64_t n_tokens, int64_t p, int64_t *t0) {
    *t0 = p * F16RP_TOKENS;
    return n_tokens - *t0 < F16RP_TOKENS ? (int)(n_tokens - *t0) : F16RP_TOKENS;
}

typedef struct f16rp_task {
    const uint8_t *w;
    size_t gs; /* bytes per group */
    int64_t n_in, n_tokens, groups, passes;
    const float *x;
    float *xp; /* x by passes, column by column (x itself for one token) */
    const float *bias;
    float *out;
    int64_t os;
    bool accumulate;
    int64_t pass_chunk; /* passes whose activations stay in L2 while a chunk's groups cycle */
    int rp_chunks;      /* chunks of whole groups; a last one takes the plain rows */
    int align;          /* groups per chunk: a multiple of this */
    mm_task tail;       /* the plain rows past the last group */
    int64_t rp_rows;
} f16rp_task;

/* Passes' activations into the kernels' layout. */
static void f16rp_pack_task(void *p, int chunk, int n_chunks, int worker) {
    (void)worker;
    const f16rp_task *t = p;
    int64_t lo, hi;
    cpu_split(t->passes, chunk, n_chunks, 1, &lo, &hi);
    for (int64_t q = lo; q < hi; q++) {
        int64_t t0;
        const int nt = f16rp_pass(t->n_tokens, q, &t0);
        const float *x = t->x + t0 * t->n_in;
        float *o = t->xp + t0 * t->n_in;
        for (int64_t k = 0; k < t->n_in; k++)
            for (int j = 0; j < nt; j++)
                o[k * nt + j] = x[j * t->n_in + k];
    }
}

static void f16rp_run_task(void *p, int chunk, int n_chunks, int worker) {
    (void)n_chunks, (void)worker;
    const f16rp_task *t = p;
    if (chunk >= t->rp_chunks) {
        mm_rows_range(&t->tail, t->rp_rows, t->tail.n_out);
        return;
    }
    int64_t lo, hi;
    cpu_split(t->groups, chunk, t->rp_chunks, t->align, &lo, &hi);
    f16rp_job jb = {.gs = t->gs, .n = t->n_in, .accumulate = t->accumulate, .os = t->os};
    for (int64_t p0 = 0; p0 < t->passes; p0 += t->pass_chunk) {
        const int64_t p1 = p0 + t->pass_chunk < t->passes ? p0 + t->pass_chunk : t->passes;
        for (int64_t g = lo; g < hi;) {
            jb.g = t->w + (size_t)g * t->gs;
            jb.bias = t->bias ? t->bias + g * CPU_RP_ROWS : NULL;
            if (t->n_tokens == 1 && hi - g >= 4) { /* decode: 4 groups' streams at once */
                jb.x = t->xp;
                jb.out = t->out + g * CPU_RP_ROWS;
                avx512_f16rp_4_1(&jb);
                g += 4;
                continue;
            }
            const int ng = hi - g >= 2 ? 2 : 1;
            for (int64_t q = p0; q < p1; q++) {
                int64_t t0;
                const int nt = f16rp_pass(t->n_tokens, q, &t0);
                jb.x = t->xp + t0 * t->n_in;
                jb.out = t->out + t0 * t->os + g * CPU_RP_ROWS;
                f16rp_fns[ng - 1][nt - 1](&jb);
            }
            g += ng;
        }
    }
}
#endif

duet_status duet__cpu_matmul_f16_rp(cpu_backend *be, const duet_op *op, const void *w, int64_t rp_rows,
                                    const float *x, const float *bias, float *out) {
#if CPU_X86
    if (be->isa != CPU_ISA_AVX512 || op->matmul.dtype != DUET_DTYPE_F16)
        return duet__error(DUET_INVALID_ARGUMENT, "matmul: repacked f16 weights need the avx512 path");
    const mm_kernels *k = mm_kernels_for(be->isa);
    const size_t ws = duet_dtype_row_bytes(DUET_DTYPE_F16, op->matmul.n_in);
    f16rp_task t = {
        .w = w,
        .gs = CPU_RP_ROWS * ws,
        .n_in = op->matmul.n_in,
        .n_tokens = op->n_tokens,
        .groups = rp_rows / CPU_RP_ROWS,
        .passes = f16rp_passes(op->n_tokens),
        .x = x,
        .bias = bias,
        .out = out,
        .os = op->matmul.n_out,
        .accumulate = op->matmul.accumulate,
        .rp_rows = rp_rows,
        .align = op->n_tokens == 1 ? 4 : 2,
    };
    t.tail = (mm_task){.k = k,
                       .dtype = DUET_DTYPE_F16,
                       .n_tokens = op->n_tokens,
                       .n_in = op->matmul.n_in,
                       .n_out = op->matmul.n_out,
                       .w = w,
                       .ws = ws,
                       .x = x,
                       .bias = bias,
                       .out = out,
                       .accumulate = op->matmul.accumulate,
                       .token_chunk = op->n_tokens};
    const int64_t work = (int64_t)t.n_tokens * t.n_in * op->matmul.n_out;
    const bool small = work < 32 * 1024; /* smaller than a dispatch costs: inline */
    if (t.n_tokens == 1) {
        t.xp = (float *)x; /* one token's columns are its row */
    } else {
        duet_status st = duet__cpu_scratch_reserve(&be->act, (size_t)(t.n_tokens * t.n_in) * sizeof(float));
        if (st != DUET_OK) return st;
        t.xp = be->act.p;
        duet__cpu_pool_run(be->pool, small ? 1 : cpu_chunks(be->pool, t.passes), f16rp_pack_task, &t);
    }
    /* ~256 KiB of activations per pass chunk. */
    const int64_t pc = (256 * 1024) / (t.n_in * F16RP_TOKENS * (int64_t)sizeof(float));
    t.pass_chunk = pc < 1 ? 1 : pc;
    /* Chunks of ~1 MiB of weights, and at least a few per thread: claimed
     * by whichever thread is free, so both cores stay busy to the end. */
    const int64_t units = (t.groups + t.align - 1) / t.align;
    int64_t n = (int64_t)((t.groups * t.gs + (1u << 20) - 1) >> 20);
    const int64_t few = cpu_chunks(be->pool, units);
    if (n < few) n = few;
    if (n > units) n = units;
    if (n > CPU_POOL_MAX_CHUNKS - 1) n = CPU_POOL_MAX_CHUNKS - 1;
    if (small) n = 1;
    t.rp_chunks = (int)n;
    const bool tail = rp_rows < op->matmul.n_out;
    if (t.rp_chunks == 1 && tail) {
        f16rp_run_task(&t, 0, 1, 0);
        f16rp_run_task(&t, 1, 1, 0);
        return DUET_OK;
    }
    duet__cpu_pool_run(be->pool, t.rp_chunks + (tail ? 1 : 0), f16rp_run_task, &t);
    return DUET_OK;
#else
    (void)be, (void)op, (void)w, (void)rp_rows, (void)x, (void)bias, (void)out;
    return duet__error(DUET_INVALID_ARGUMENT, "matmul: repacked f16 weights on a cpu without their kernels");
#endif
}
