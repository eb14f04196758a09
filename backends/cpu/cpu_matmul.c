/* cpu_matmul.c — MATMUL: out[t][o] = sum_i W[o][i] x[t][i] (+ bias) (+ out).
 *
 * Work is split by output rows into one contiguous chunk per thread, so each
 * thread streams its own part of W once per token chunk. Inside a chunk a
 * micro-kernel ("tile") computes up to MR rows x MT tokens at once: each
 * weight vector loaded is used MT times, each activation vector MR times.
 * Decode (one token) is bound by the bytes of W; prefill by arithmetic,
 * which the tile's reuse feeds.
 *
 * Q8_0 weights: the activations are quantized once per op to int8 blocks of
 * 32 with an f32 scale, then each block pair is an int8 x int8 dot product
 * scaled by d_w * d_x. F32/F16/BF16 weights are converted to f32 in
 * registers and use f32 FMAs with f32 activations. */
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
/* Quantizes one token row of n floats (n % 32 == 0) into qs and scales d. */
typedef void (*quant_fn)(const float *x, int64_t n, int8_t *qs, float *d);

typedef struct mm_kernels {
    int mr, mt;        /* tile shape this path is tuned for */
    int d_pair_floats; /* scales per block pair: 2, or 16 (avx512: pre-broadcast) */
    quant_fn quantize;
    q8_tile_fn q8;
    f_tile_fn f32, f16, bf16;
} mm_kernels;

/* ======================================================================== */
/* scalar                                                                    */
/* ======================================================================== */

static void scalar_quantize(const float *x, int64_t n, int8_t *qs, float *d) {
    for (int64_t b = 0; b < n / 32; b++) {
        const float *xb = x + b * 32;
        float amax = 0.0f;
        for (int k = 0; k < 32; k++) {
            float a = fabsf(xb[k]);
            if (a > amax) amax = a;
        }
        float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        d[b] = amax / 127.0f;
        for (int k = 0; k < 32; k++) {
            float v = cpu_round_even(xb[k] * id);
            /* NaN/inf inputs: defined int8s instead of an undefined cast. */
            v = v != v ? 0.0f : v < -127.0f ? -127.0f : v > 127.0f ? 127.0f : v;
            qs[b * 32 + k] = (int8_t)v;
        }
    }
}

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
    .quantize = scalar_quantize,
    .q8 = scalar_q8_tile,
    .f32 = scalar_f32_tile,
    .f16 = scalar_f16_tile,
    .bf16 = scalar_bf16_tile,
};

#if CPU_X86
/* ======================================================================== */
/* avx2 + fma + f16c                                                          */
/* ======================================================================== */

CPU_AVX2 static void avx2_quantize(const float *x, int64_t n, int8_t *qs, float *d) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t b = 0; b < n / 32; b++) {
        __m256 v[4];
        for (int k = 0; k < 4; k++)
            v[k] = _mm256_loadu_ps(x + b * 32 + k * 8);
        __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                 _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
        float amax = avx2_hmax(m);
        float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        d[b] = amax / 127.0f;
        __m256 s = _mm256_set1_ps(id);
        __m256i i[4];
        for (int k = 0; k < 4; k++)
            i[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], s)); /* nearest even */
        /* The packs work per 128-bit lane; the permute puts the 4-byte groups
         * back in element order. */
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
        p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(qs + b * 32), p);
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

/* Like avx2_quantize, with two differences for the kernel below:
 * - quants are stored offset by +128 as unsigned bytes (q + 128 in 1..255),
 *   the operand vpdpbusd wants unsigned;
 * - each scale is stored pre-broadcast: per pair of blocks 16 floats
 *   (8 x d0, 8 x d1), matching the int32 lanes the pair's dot product lands
 *   in, so the kernel loads it with one instruction.
 * A missing second block of the last pair gets scale 0 and quants 0 (= 128). */
CPU_AVX512 static void avx512_quantize(const float *x, int64_t n, int8_t *qs, float *d) {
    int64_t nb = n / 32;
    for (int64_t b = 0; b < nb; b++) {
        __m512 v0 = _mm512_loadu_ps(x + b * 32), v1 = _mm512_loadu_ps(x + b * 32 + 16);
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        __m512 s = _mm512_set1_ps(id);
        __m512i i0 =
            _mm512_cvt_roundps_epi32(_mm512_mul_ps(v0, s), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m512i i1 =
            _mm512_cvt_roundps_epi32(_mm512_mul_ps(v1, s), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512i off = _mm512_set1_epi32(128);
        _mm_storeu_si128((__m128i *)(qs + b * 32), _mm512_cvtusepi32_epi8(_mm512_add_epi32(i0, off)));
        _mm_storeu_si128((__m128i *)(qs + b * 32 + 16), _mm512_cvtusepi32_epi8(_mm512_add_epi32(i1, off)));
        _mm256_storeu_ps(d + (b / 2) * 16 + (b % 2) * 8, _mm256_set1_ps(amax / 127.0f));
    }
    if (nb % 2) {
        memset(qs + nb * 32, 128, 32);
        _mm256_storeu_ps(d + (nb / 2) * 16 + 8, _mm256_setzero_ps());
    }
}

/* Two blocks per 512-bit register. vpdpbusd multiplies unsigned by signed
 * bytes: with u = x + 128 (stored so by avx512_quantize) and the weights as
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

/* 32 zmm registers: 4 x 4 accumulators plus 4 activation vectors. */
static const mm_kernels mm_avx512 = {
    .mr = 4,
    .mt = 4,
    .d_pair_floats = 16,
    .quantize = avx512_quantize,
    .q8 = avx512_q8_tile,
    .f32 = avx512_f32_tile,
    .f16 = avx512_f16_tile,
    .bf16 = avx512_bf16_tile,
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
    /* Quantized activations (Q8_0 weights only). */
    int8_t *xq;
    float *xd;
    int64_t xqs, xds;
    int64_t token_chunk; /* tokens whose activations stay in L2 while W rows cycle */
} mm_task;

static void mm_quantize_task(void *p, int chunk, int n_chunks, int worker) {
    mm_task *t = p;
    int64_t lo, hi;
    cpu_split(t->n_tokens, chunk, n_chunks, 1, &lo, &hi);
    for (int64_t i = lo; i < hi; i++)
        t->k->quantize(t->x + i * t->n_in, t->n_in, t->xq + i * t->xqs, t->xd + i * t->xds);
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

static void mm_rows_task(void *p, int chunk, int n_chunks, int worker) {
    mm_task *t = p;
    const mm_kernels *k = t->k;
    int64_t lo, hi;
    cpu_split(t->n_out, chunk, n_chunks, k->mr, &lo, &hi);
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
                    k->q8(nr, nt, w, t->ws, t->xq + tok * t->xqs, t->xqs, t->xd + tok * t->xds, t->xds,
                          t->n_in / 32, res);
                else
                    f(nr, nt, w, t->ws, t->x + tok * t->n_in, t->n_in, t->n_in, res);
                mm_store(t, r, tok, nr, nt, res);
            }
        }
    }
}

duet_status duet__cpu_matmul(cpu_backend *be, const duet_op *op, const void *w, const float *x,
                             const float *bias, float *out) {
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
    int64_t x_row_bytes = t.n_in * (int64_t)sizeof(float);
    if (t.dtype == DUET_DTYPE_Q8_0) {
        /* Token rows padded to 64 bytes so a block-pair load never leaves
         * the row; scales per pair as the path wants them. */
        int64_t npairs = (t.n_in / 32 + 1) / 2;
        t.xqs = npairs * 64;
        t.xds = npairs * k->d_pair_floats;
        size_t qbytes = (size_t)(t.n_tokens * t.xqs);
        duet_status st =
            duet__cpu_scratch_reserve(&be->act, qbytes + (size_t)(t.n_tokens * t.xds) * sizeof(float));
        if (st != DUET_OK) return st;
        t.xd = be->act.p;
        t.xq = (int8_t *)be->act.p + (size_t)(t.n_tokens * t.xds) * sizeof(float);
        /* A few tokens quantize faster inline than a dispatch costs. */
        duet__cpu_pool_run(&be->pool, t.n_tokens >= 8 ? cpu_chunks(&be->pool, t.n_tokens) : 1,
                           mm_quantize_task, &t);
        x_row_bytes = t.xqs;
    }
    /* Keep a chunk of activations (~256 KiB) in L2 while the W rows of a
     * thread cycle through it; a multiple of the tile's token count. */
    int64_t chunk = (256 * 1024) / (x_row_bytes > 0 ? x_row_bytes : 1);
    chunk = chunk / k->mt * k->mt;
    t.token_chunk = chunk < k->mt ? k->mt : chunk;
    /* Tiny matmuls (per-op work well under the cost of a dispatch) run
     * inline; others in contiguous row ranges, a few per thread. */
    int64_t work = (int64_t)t.n_tokens * t.n_in * t.n_out;
    int64_t units = (t.n_out + k->mr - 1) / k->mr;
    duet__cpu_pool_run(&be->pool, work >= 32 * 1024 ? cpu_chunks(&be->pool, units) : 1, mm_rows_task, &t);
    return DUET_OK;
}
