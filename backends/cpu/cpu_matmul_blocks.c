/* cpu_matmul_blocks.c — MATMUL for the block-quantised weight types other
 * than q8_0: Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL (blocks of 32) and Q2_K, Q3_K,
 * Q4_K, Q5_K, Q6_K, IQ4_XS (super-blocks of 256).
 *
 * Every type is read 32 weights at a time (a "chunk") as w = s * q - m,
 * with q a small unsigned integer (0..63) and s, m per 16 weights (the
 * k-quants' sub-block scales and mins; a 32-block's one scale twice);
 * IQ4's q are its signed table values and m = 0. Activations are q8_0
 * blocks (the op's x_q8, or x quantised here by duet_quantize_row_q8_0's
 * rule), so a chunk against activation block b (scale dx) is
 *     dx * (s0 * sum_lo(q * qx) + s1 * sum_hi(q * qx)) - (m0 * xm_lo + m1 * xm_hi)
 * with xm the block's sums of qx times dx, kept per 4 values (8 lanes, the
 * lanes an int8 dot product's 32-bit sums come in; prepared once per token)
 * so the min term is vector arithmetic on the same lanes as the products.
 * The q are unpacked in registers and meet the activations in int8 dot
 * products (maddubs on avx2, vpdpbusd on avx512): the weights are never
 * dequantised in memory. The scalar path (no x86 SIMD) dequantises one
 * block at a time on the stack.
 *
 * Q4_0 and Q5_0 matrices the backend repacked (16 rows per 32-block side
 * by side, cpu_internal.h) run their own kernels, a row per vector lane,
 * with the same float work per row and token as the tiles and the panel.
 *
 * As in cpu_matmul.c, a token's result does not depend on the batch around
 * it: each token's sums run in the same order for any tile shape. */
#include <stdlib.h>
#include <string.h>

#include "cpu_internal.h"
#include "cpu_simd.h"

#define BLK_MR 8 /* tile: rows (8 at decode, else 4) */
#define BLK_MT 4 /* tile: tokens, at most (avx2 takes 2) */

typedef float blk_res[BLK_MR][BLK_MT];

/* The super-block's scales and mins per 16 weights (a 32-block: 2). */
typedef struct blk_scales {
    float s[16], m[16];
} blk_scales;

/* Types whose w has a min term (m != 0). */
static inline bool has_min(duet_dtype t) {
    return t != DUET_DTYPE_IQ4_NL && t != DUET_DTYPE_IQ4_XS;
}

static inline bool signed_q(duet_dtype t) {
    return t == DUET_DTYPE_IQ4_NL || t == DUET_DTYPE_IQ4_XS;
}

/* Chunks of 32 per block, and bytes per block: constants once inlined with
 * a constant type (the SIMD kernels' shifts and offsets then are too). */
static inline int blk_cps(duet_dtype t) {
    return t == DUET_DTYPE_Q4_0 || t == DUET_DTYPE_Q4_1 || t == DUET_DTYPE_Q5_0 || t == DUET_DTYPE_Q5_1 ||
                   t == DUET_DTYPE_IQ4_NL
               ? 1
               : 8;
}

static inline size_t blk_bytes(duet_dtype t) {
    switch (t) {
    case DUET_DTYPE_Q4_0:
        return sizeof(duet_block_q4_0);
    case DUET_DTYPE_Q4_1:
        return sizeof(duet_block_q4_1);
    case DUET_DTYPE_Q5_0:
        return sizeof(duet_block_q5_0);
    case DUET_DTYPE_Q5_1:
        return sizeof(duet_block_q5_1);
    case DUET_DTYPE_IQ4_NL:
        return sizeof(duet_block_iq4_nl);
    case DUET_DTYPE_Q2_K:
        return sizeof(duet_block_q2_K);
    case DUET_DTYPE_Q3_K:
        return sizeof(duet_block_q3_K);
    case DUET_DTYPE_Q4_K:
        return sizeof(duet_block_q4_K);
    case DUET_DTYPE_Q5_K:
        return sizeof(duet_block_q5_K);
    case DUET_DTYPE_Q6_K:
        return sizeof(duet_block_q6_K);
    default:
        return sizeof(duet_block_iq4_xs);
    }
}

/* Repacked Q4_0 and Q5_0 (cpu_internal.h): the bytes of one 32-block of a
 * group (288 for Q4_0, 352 for Q5_0), and where its 4 x 64 bytes of
 * nibbles start (after the scales, and Q5_0's fifth bits). */
static inline size_t rp_block_bytes(duet_dtype DT) {
    return CPU_RP_ROWS * blk_bytes(DT);
}

static inline size_t rp_qs_at(duet_dtype DT) {
    return DT == DUET_DTYPE_Q5_0 ? 96 : 32;
}

/* ---- scales (scalar: once per block and row) --------------------------------------------------- */

/* q4_K/q5_K: the 8 6-bit scales and 8 mins from the 12 packed bytes, four
 * at a time in 32-bit words: bytes 0-3 hold scales 0-3 (low 6 bits), 4-7
 * mins 0-3; bytes 8-11 the low 4 bits of scales and mins 4-7, whose top 2
 * bits are the top bits of bytes 0-3 and 4-7. */
static inline void k4_scales_mins(const uint8_t *q, uint8_t sc[8], uint8_t mn[8]) {
    uint32_t u[3], v[4];
    memcpy(u, q, 12);
    v[0] = u[0] & 0x3f3f3f3fu;
    v[1] = (u[2] & 0x0f0f0f0fu) | ((u[0] >> 6) & 0x03030303u) << 4;
    v[2] = u[1] & 0x3f3f3f3fu;
    v[3] = ((u[2] >> 4) & 0x0f0f0f0fu) | ((u[1] >> 6) & 0x03030303u) << 4;
    memcpy(sc, v, 8);
    memcpy(mn, v + 2, 8);
}

/* q3_K: the 16 6-bit scales (minus 32): low 4 bits from bytes 0..7 (low
 * nibbles, then high), top 2 from bytes 8..11, four at a time. */
static inline void k3_scales(const uint8_t *q, int8_t out[16]) {
    uint32_t u[3], v[4];
    memcpy(u, q, 12);
    v[0] = (u[0] & 0x0f0f0f0fu) | ((u[2] >> 0) & 0x03030303u) << 4;
    v[1] = (u[1] & 0x0f0f0f0fu) | ((u[2] >> 2) & 0x03030303u) << 4;
    v[2] = ((u[0] >> 4) & 0x0f0f0f0fu) | ((u[2] >> 4) & 0x03030303u) << 4;
    v[3] = ((u[1] >> 4) & 0x0f0f0f0fu) | ((u[2] >> 6) & 0x03030303u) << 4;
    memcpy(out, v, 16);
    for (int k = 0; k < 16; k++)
        out[k] = (int8_t)(out[k] - 32);
}

static inline uint16_t rd16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

/* F is the fp16 conversion (the hardware's inside SIMD paths). Both give
 * the same value: fp16 -> f32 is exact. */
#define BLK_SCALES(NAME, ATTR, F)                                                                            \
    ATTR CPU_INLINE void NAME(duet_dtype DT, const uint8_t *b, blk_scales *o) {                              \
        switch (DT) {                                                                                        \
        case DUET_DTYPE_Q4_0:                                                                                \
        case DUET_DTYPE_Q5_0:                                                                                \
            o->s[0] = o->s[1] = F(rd16(b));                                                                  \
            o->m[0] = o->m[1] = o->s[0] * (DT == DUET_DTYPE_Q4_0 ? 8.0f : 16.0f);                            \
            break;                                                                                           \
        case DUET_DTYPE_Q4_1:                                                                                \
        case DUET_DTYPE_Q5_1:                                                                                \
            o->s[0] = o->s[1] = F(rd16(b));                                                                  \
            o->m[0] = o->m[1] = -F(rd16(b + 2));                                                             \
            break;                                                                                           \
        case DUET_DTYPE_IQ4_NL:                                                                              \
            o->s[0] = o->s[1] = F(rd16(b));                                                                  \
            break;                                                                                           \
        case DUET_DTYPE_Q2_K: {                                                                              \
            const duet_block_q2_K *x = (const duet_block_q2_K *)b;                                           \
            const float d = F(rd16((const uint8_t *)&x->d)), dm = F(rd16((const uint8_t *)&x->dmin));        \
            for (int k = 0; k < 16; k++) {                                                                   \
                o->s[k] = d * (float)(x->scales[k] & 0xf);                                                   \
                o->m[k] = dm * (float)(x->scales[k] >> 4);                                                   \
            }                                                                                                \
            break;                                                                                           \
        }                                                                                                    \
        case DUET_DTYPE_Q3_K: {                                                                              \
            const duet_block_q3_K *x = (const duet_block_q3_K *)b;                                           \
            const float d = F(rd16((const uint8_t *)&x->d));                                                 \
            int8_t sc[16];                                                                                   \
            k3_scales(x->scales, sc);                                                                        \
            for (int k = 0; k < 16; k++) {                                                                   \
                o->s[k] = d * (float)sc[k];                                                                  \
                o->m[k] = 4.0f * o->s[k];                                                                    \
            }                                                                                                \
            break;                                                                                           \
        }                                                                                                    \
        case DUET_DTYPE_Q4_K:                                                                                \
        case DUET_DTYPE_Q5_K: {                                                                              \
            /* d, dmin and scales sit at the same offsets in both. */                                        \
            const duet_block_q4_K *x = (const duet_block_q4_K *)b;                                           \
            const float d = F(rd16((const uint8_t *)&x->d)), dm = F(rd16((const uint8_t *)&x->dmin));        \
            uint8_t sc[8], mn[8];                                                                            \
            k4_scales_mins(x->scales, sc, mn);                                                               \
            for (int j = 0; j < 8; j++) {                                                                    \
                o->s[2 * j] = o->s[2 * j + 1] = d * (float)sc[j];                                            \
                o->m[2 * j] = o->m[2 * j + 1] = dm * (float)mn[j];                                           \
            }                                                                                                \
            break;                                                                                           \
        }                                                                                                    \
        case DUET_DTYPE_Q6_K: {                                                                              \
            const duet_block_q6_K *x = (const duet_block_q6_K *)b;                                           \
            const float d = F(rd16((const uint8_t *)&x->d));                                                 \
            for (int k = 0; k < 16; k++) {                                                                   \
                o->s[k] = d * (float)x->scales[k];                                                           \
                o->m[k] = 32.0f * o->s[k];                                                                   \
            }                                                                                                \
            break;                                                                                           \
        }                                                                                                    \
        case DUET_DTYPE_IQ4_XS: {                                                                            \
            const duet_block_iq4_xs *x = (const duet_block_iq4_xs *)b;                                       \
            const float d = F(rd16((const uint8_t *)&x->d));                                                 \
            for (int j = 0; j < 8; j++) {                                                                    \
                int ls = ((x->scales_l[j / 2] >> 4 * (j % 2)) & 0xf) | (((x->scales_h >> 2 * j) & 3) << 4);  \
                o->s[2 * j] = o->s[2 * j + 1] = d * (float)(ls - 32);                                        \
            }                                                                                                \
            break;                                                                                           \
        }                                                                                                    \
        default:                                                                                             \
            break;                                                                                           \
        }                                                                                                    \
    }

/* ---- activations -------------------------------------------------------------------------------- */

/* A token's activations as the kernels read them: nb blocks' quants in a
 * row, their scales, and per block dx * (sum of the first 16 qx, of the
 * last 16). */
typedef struct blk_act {
    const int8_t *q; /* [tokens][qs] */
    const float *d;  /* [tokens][ds] */
    const float *xl; /* [tokens][8 * ds]: dx * the sum of each 4 qx (the tiles) */
    /* The panel: per block dx * the sum of the first 16 qx, the last 16, all
     * 32 (xh), and -128 times those sums (nc, the offset of signed q). */
    const float *xh;   /* [tokens][3 * ds] */
    const int32_t *nc; /* [tokens][3 * ds] */
    int64_t qs, ds;
} blk_act;

static void act_layout(const duet_block_q8_0 *xb, int64_t nb, int8_t *q, float *d, float *xl, float *xh,
                       int32_t *nc) {
    for (int64_t b = 0; b < nb; b++) {
        const float dx = duet_fp16_to_fp32(xb[b].d);
        int half[2] = {0, 0};
        for (int l = 0; l < 8; l++) {
            const int s = xb[b].qs[4 * l] + xb[b].qs[4 * l + 1] + xb[b].qs[4 * l + 2] + xb[b].qs[4 * l + 3];
            xl[8 * b + l] = dx * (float)s;
            half[l / 4] += s;
        }
        const int sums[3] = {half[0], half[1], half[0] + half[1]};
        for (int h = 0; h < 3; h++) {
            xh[3 * b + h] = dx * (float)sums[h];
            nc[3 * b + h] = -128 * sums[h];
        }
        memcpy(q + b * 32, xb[b].qs, 32);
        d[b] = dx;
    }
}

/* ---- scalar --------------------------------------------------------------------------------------- */

BLK_SCALES(scalar_scales, , duet_fp16_to_fp32)

/* One chunk's q (as ints) for the scalar path. */
static void scalar_unpack(duet_dtype DT, const uint8_t *b, int c, int q[32]) {
    switch (DT) {
    case DUET_DTYPE_Q4_0:
    case DUET_DTYPE_Q4_1:
    case DUET_DTYPE_IQ4_NL: {
        const uint8_t *qs = b + (DT == DUET_DTYPE_Q4_1 ? 4 : 2);
        for (int l = 0; l < 16; l++) {
            q[l] = qs[l] & 0xf;
            q[l + 16] = qs[l] >> 4;
        }
        if (DT == DUET_DTYPE_IQ4_NL)
            for (int l = 0; l < 32; l++)
                q[l] = duet_iq4nl_values[q[l]];
        break;
    }
    case DUET_DTYPE_Q5_0:
    case DUET_DTYPE_Q5_1: {
        const int off = DT == DUET_DTYPE_Q5_1 ? 4 : 2;
        uint32_t qh;
        memcpy(&qh, b + off, 4);
        const uint8_t *qs = b + off + 4;
        for (int l = 0; l < 16; l++) {
            q[l] = (qs[l] & 0xf) | (int)((qh >> l) & 1) << 4;
            q[l + 16] = (qs[l] >> 4) | (int)((qh >> (l + 16)) & 1) << 4;
        }
        break;
    }
    case DUET_DTYPE_Q2_K: {
        const duet_block_q2_K *x = (const duet_block_q2_K *)b;
        for (int l = 0; l < 32; l++)
            q[l] = (x->qs[32 * (c / 4) + l] >> (2 * (c % 4))) & 3;
        break;
    }
    case DUET_DTYPE_Q3_K: {
        const duet_block_q3_K *x = (const duet_block_q3_K *)b;
        for (int l = 0; l < 32; l++)
            q[l] = ((x->qs[32 * (c / 4) + l] >> (2 * (c % 4))) & 3) + 4 * ((x->hmask[l] >> c) & 1);
        break;
    }
    case DUET_DTYPE_Q4_K:
    case DUET_DTYPE_Q5_K: {
        const uint8_t *qs =
            DT == DUET_DTYPE_Q4_K ? ((const duet_block_q4_K *)b)->qs : ((const duet_block_q5_K *)b)->qs;
        for (int l = 0; l < 32; l++)
            q[l] = (qs[32 * (c / 2) + l] >> (4 * (c % 2))) & 0xf;
        if (DT == DUET_DTYPE_Q5_K)
            for (int l = 0; l < 32; l++)
                q[l] |= ((((const duet_block_q5_K *)b)->qh[l] >> c) & 1) << 4;
        break;
    }
    case DUET_DTYPE_Q6_K: {
        const duet_block_q6_K *x = (const duet_block_q6_K *)b;
        const int h = c / 4, k = c % 4;
        for (int l = 0; l < 32; l++)
            q[l] = ((x->ql[64 * h + 32 * (k & 1) + l] >> (4 * (k >> 1))) & 0xf) |
                   ((x->qh[32 * h + l] >> (2 * k)) & 3) << 4;
        break;
    }
    case DUET_DTYPE_IQ4_XS: {
        const duet_block_iq4_xs *x = (const duet_block_iq4_xs *)b;
        for (int l = 0; l < 16; l++) {
            q[l] = duet_iq4nl_values[x->qs[16 * c + l] & 0xf];
            q[l + 16] = duet_iq4nl_values[x->qs[16 * c + l] >> 4];
        }
        break;
    }
    default:
        break;
    }
}

static void scalar_tile(duet_dtype DT, int nr, int nt, const uint8_t *w, size_t ws, const blk_act *x,
                        int64_t tok, int64_t nsb, blk_res res) {
    const int cps = duet_dtype_block(DT) / 32;
    const size_t bb = duet_dtype_block_bytes(DT);
    for (int i = 0; i < nr; i++) {
        double acc[BLK_MT] = {0};
        for (int64_t sb = 0; sb < nsb; sb++) {
            const uint8_t *blk = w + (size_t)i * ws + (size_t)sb * bb;
            blk_scales sc;
            scalar_scales(DT, blk, &sc);
            for (int c = 0; c < cps; c++) {
                int q[32];
                scalar_unpack(DT, blk, c, q);
                const int64_t b = sb * cps + c;
                for (int j = 0; j < nt; j++) {
                    const int8_t *xq = x->q + (tok + j) * x->qs + b * 32;
                    int32_t lo = 0, hi = 0;
                    for (int l = 0; l < 16; l++) {
                        lo += q[l] * xq[l];
                        hi += q[l + 16] * xq[l + 16];
                    }
                    const float dx = x->d[(tok + j) * x->ds + b];
                    const float *xl = x->xl + (tok + j) * 8 * x->ds + 8 * b;
                    acc[j] += (double)(dx * (sc.s[2 * c] * (float)lo + sc.s[2 * c + 1] * (float)hi));
                    if (has_min(DT))
                        acc[j] -= (double)(sc.m[2 * c] * (xl[0] + xl[1] + xl[2] + xl[3]) +
                                           sc.m[2 * c + 1] * (xl[4] + xl[5] + xl[6] + xl[7]));
                }
            }
        }
        for (int j = 0; j < nt; j++)
            res[i][j] = (float)acc[j];
    }
}

#if CPU_X86
/* ---- avx2 / avx512: unpacking in registers ------------------------------------------------------ */

BLK_SCALES(simd_scales_generic, CPU_AVX2, _cvtsh_ss)

/* 8 small integers as floats times d, each twice (s[2k] = s[2k + 1]). */
CPU_AVX2 CPU_INLINE void store_pairs(__m256i v8, float d, float *o) {
    const __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(v8), _mm256_set1_ps(d));
    _mm256_storeu_ps(o, _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3)));
    _mm256_storeu_ps(o + 8, _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7)));
}

/* 16 small integers (two vectors of 8) as floats times d. */
CPU_AVX2 CPU_INLINE void store_16(__m256i lo, __m256i hi, float d, float *o) {
    _mm256_storeu_ps(o, _mm256_mul_ps(_mm256_cvtepi32_ps(lo), _mm256_set1_ps(d)));
    _mm256_storeu_ps(o + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(hi), _mm256_set1_ps(d)));
}

/* The k-quants' scales with vector conversions (once per super-block and
 * row, so their cost shows at decode); the rest as the generic code. */
CPU_AVX2 CPU_INLINE void simd_scales(duet_dtype DT, const uint8_t *b, blk_scales *o) {
    if (DT == DUET_DTYPE_Q4_K || DT == DUET_DTYPE_Q5_K) {
        const duet_block_q4_K *x = (const duet_block_q4_K *)b;
        uint8_t sc[8], mn[8];
        k4_scales_mins(x->scales, sc, mn);
        store_pairs(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)sc)), _cvtsh_ss(x->d), o->s);
        store_pairs(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)mn)), _cvtsh_ss(x->dmin), o->m);
    } else if (DT == DUET_DTYPE_Q6_K || DT == DUET_DTYPE_Q3_K) {
        int8_t k3[16];
        const int8_t *sc = k3;
        float d;
        if (DT == DUET_DTYPE_Q6_K) {
            const duet_block_q6_K *x = (const duet_block_q6_K *)b;
            sc = x->scales;
            d = _cvtsh_ss(x->d);
        } else {
            const duet_block_q3_K *x = (const duet_block_q3_K *)b;
            k3_scales(x->scales, k3);
            d = _cvtsh_ss(x->d);
        }
        const __m128i v = _mm_loadu_si128((const __m128i *)sc);
        store_16(_mm256_cvtepi8_epi32(v), _mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)), d, o->s);
        /* m = offset * s is made in the tile from s (offset 32 or 4). */
    } else if (DT == DUET_DTYPE_Q2_K) {
        const duet_block_q2_K *x = (const duet_block_q2_K *)b;
        const __m128i v = _mm_loadu_si128((const __m128i *)x->scales);
        const __m128i lo = _mm_and_si128(v, _mm_set1_epi8(0x0f));
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0f));
        store_16(_mm256_cvtepu8_epi32(lo), _mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)), _cvtsh_ss(x->d),
                 o->s);
        store_16(_mm256_cvtepu8_epi32(hi), _mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)), _cvtsh_ss(x->dmin),
                 o->m);
    } else {
        simd_scales_generic(DT, b, o);
    }
}

/* 16 bytes -> their 32 nibbles: the low ones, then the high ones. */
CPU_AVX2 CPU_INLINE __m256i nibbles32(const uint8_t *qs) {
    const __m128i v = _mm_loadu_si128((const __m128i *)qs);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(0x0f));
}

/* Bit k of qh as 0x10 in byte k. */
CPU_AVX2 CPU_INLINE __m256i bits32(uint32_t qh) {
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2,
                                            2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i sel = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    const __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), spread);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(b, sel), sel), _mm256_set1_epi8(0x10));
}

CPU_AVX2 CPU_INLINE __m256i iq4_lookup(__m256i nib) {
    const __m256i tbl = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)duet_iq4nl_values));
    return _mm256_shuffle_epi8(tbl, nib);
}

/* Chunk c's 32 q of the block at b, in weight order. */
CPU_AVX2 CPU_INLINE __m256i simd_unpack(duet_dtype DT, const uint8_t *b, int c) {
    const __m256i m4 = _mm256_set1_epi8(0x0f), m2 = _mm256_set1_epi8(3);
    switch (DT) {
    case DUET_DTYPE_Q4_0:
        return nibbles32(b + 2);
    case DUET_DTYPE_Q4_1:
        return nibbles32(b + 4);
    case DUET_DTYPE_IQ4_NL:
        return iq4_lookup(nibbles32(b + 2));
    case DUET_DTYPE_Q5_0:
    case DUET_DTYPE_Q5_1: {
        const int off = DT == DUET_DTYPE_Q5_1 ? 4 : 2;
        uint32_t qh;
        memcpy(&qh, b + off, 4);
        return _mm256_or_si256(nibbles32(b + off + 4), bits32(qh));
    }
    case DUET_DTYPE_Q2_K: {
        const duet_block_q2_K *x = (const duet_block_q2_K *)b;
        const __m256i v = _mm256_loadu_si256((const __m256i *)(x->qs + 32 * (c / 4)));
        return _mm256_and_si256(_mm256_srli_epi16(v, 2 * (c % 4)), m2);
    }
    case DUET_DTYPE_Q3_K: {
        const duet_block_q3_K *x = (const duet_block_q3_K *)b;
        const __m256i v = _mm256_loadu_si256((const __m256i *)(x->qs + 32 * (c / 4)));
        const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(v, 2 * (c % 4)), m2);
        const __m256i h = _mm256_loadu_si256((const __m256i *)x->hmask);
        const __m256i hb = _mm256_and_si256(_mm256_srli_epi16(h, c), _mm256_set1_epi8(1));
        return _mm256_or_si256(lo, _mm256_slli_epi16(hb, 2));
    }
    case DUET_DTYPE_Q4_K: {
        const duet_block_q4_K *x = (const duet_block_q4_K *)b;
        const __m256i v = _mm256_loadu_si256((const __m256i *)(x->qs + 32 * (c / 2)));
        return _mm256_and_si256(_mm256_srli_epi16(v, 4 * (c % 2)), m4);
    }
    case DUET_DTYPE_Q5_K: {
        const duet_block_q5_K *x = (const duet_block_q5_K *)b;
        const __m256i v = _mm256_loadu_si256((const __m256i *)(x->qs + 32 * (c / 2)));
        const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(v, 4 * (c % 2)), m4);
        const __m256i h = _mm256_loadu_si256((const __m256i *)x->qh);
        const __m256i hb = _mm256_and_si256(_mm256_srli_epi16(h, c), _mm256_set1_epi8(1));
        return _mm256_or_si256(lo, _mm256_slli_epi16(hb, 4));
    }
    case DUET_DTYPE_Q6_K: {
        const duet_block_q6_K *x = (const duet_block_q6_K *)b;
        const int h = c / 4, k = c % 4;
        const __m256i v = _mm256_loadu_si256((const __m256i *)(x->ql + 64 * h + 32 * (k & 1)));
        const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(v, 4 * (k >> 1)), m4);
        const __m256i hv = _mm256_loadu_si256((const __m256i *)(x->qh + 32 * h));
        const __m256i hb = _mm256_and_si256(_mm256_srli_epi16(hv, 2 * k), m2);
        return _mm256_or_si256(lo, _mm256_slli_epi16(hb, 4));
    }
    case DUET_DTYPE_IQ4_XS: {
        const duet_block_iq4_xs *x = (const duet_block_iq4_xs *)b;
        return iq4_lookup(nibbles32(x->qs + 16 * c));
    }
    default:
        return _mm256_setzero_si256();
    }
}

/* The tile body twice: avx2 (maddubs: u8 x s8 pair sums, which stay below
 * 2^15 as q <= 63 or, IQ4, |q| <= 127 with the sign moved onto x) and
 * avx512 (vpdpbusd on 256-bit vectors: no 16-bit intermediate). */
#define BLK_TARGET CPU_AVX2
#define BLK_NAME(n) avx2_##n
#define BLK_TILE_MT 2
#define BLK_DOT(u, s) _mm256_madd_epi16(_mm256_maddubs_epi16((u), (s)), _mm256_set1_epi16(1))
#include "cpu_matmul_blocks_tile.h"
#undef BLK_TARGET
#undef BLK_NAME
#undef BLK_DOT
#undef BLK_TILE_MT

#define BLK_TARGET CPU_AVX512
#define BLK_NAME(n) avx512_##n
#define BLK_TILE_MT 4
#define BLK_DOT(u, s) _mm256_dpbusd_epi32(_mm256_setzero_si256(), (u), (s))
#include "cpu_matmul_blocks_tile.h"
#undef BLK_TARGET
#undef BLK_NAME
#undef BLK_DOT
#undef BLK_TILE_MT

/* ---- avx512: the panel ------------------------------------------------------------------------- */

/* As the q8_0 panel (cpu_matmul.c): 16 weight rows, one per vector lane, so
 * each token's 4 activation bytes are broadcast against 16 rows at once
 * (vpdpbusd), and the row's scales are lane vectors. The rows are unpacked
 * and transposed into a pack (per 32-value chunk: 8 vectors of q, then the
 * scales and mins of both 16-value halves), 8 chunks at a time; with more
 * tokens than one group takes, the panel's whole pack is kept and reused.
 * Per token and chunk the sum is
 *     acc += dot_lo * (s_lo dx) + dot_hi * (s_hi dx) - m_lo xh_lo - m_hi xh_hi
 * (one dot and one scale when both halves share theirs), the same ops in
 * the same order for every token, and the same as the tiles' (see
 * cpu_matmul_blocks_tile.h): a token's result does not depend on the batch
 * or on which of the two ran it. */
#define BLK_PANEL_ROWS 16
#define BLK_PANEL_TOKENS 16
#define BLK_PANEL_MIN_TOKENS 8 /* fewer tokens run the tiles */
#define BLK_UNIT 8             /* chunks packed at a time (a k-quant super-block) */
#define BLK_PACK_VECS 12       /* per chunk: 8 vectors of q, s_lo, s_hi, m_lo, m_hi */

typedef void (*blk_pack_fn)(const uint8_t *w, size_t ws, int64_t c0, int nc, __m512i *o);

enum { BLK_DIRECT, BLK_STORE, BLK_LOAD }; /* pack and use; pack, keep and use; use the kept pack */

typedef struct blk_panel {
    const uint8_t *w; /* the panel's first row */
    size_t ws;
    int first; /* rows before this belong to the panel before (the last panel moves back) */
    int64_t nchunks;
    const blk_act *x;
    int64_t tok; /* first token */
    blk_pack_fn pack_fn;
    __m512i *pack; /* nchunks * BLK_PACK_VECS vectors: the kept pack */
    int pack_mode;
    const float *bias; /* at the panel's first row, or NULL */
    bool accumulate;
    float *out; /* token tok, row 0 of the panel */
    int64_t os;
} blk_panel;

/* Chunks c0 .. c0 + nc of the 16 rows into o (c0 is a whole block's first
 * chunk). */
CPU_AVX512 CPU_INLINE void blk_panel_pack(duet_dtype DT, const uint8_t *w, size_t ws, int64_t c0, int nc,
                                          __m512i *o) {
    const int cps = blk_cps(DT);
    const size_t bb = blk_bytes(DT);
    const float offset = DT == DUET_DTYPE_Q6_K ? 32.0f : DT == DUET_DTYPE_Q3_K ? 4.0f : 0.0f;
    const __m512i sidx =
        _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                           _mm512_set1_epi32((int)(sizeof(blk_scales) / sizeof(float))));
    /* The 32-blocks start with their fp16 scale (and Q4_1/Q5_1's min after
     * it): one gather of the 16 rows' first dwords gives both. */
    const __m512i widx = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32((int)ws));
    for (int k0 = 0; k0 < nc; k0 += cps) {
        const int64_t blk = (c0 + k0) / cps;
        blk_scales sc[BLK_PANEL_ROWS];
        if (cps == 1) {
            __m512i *v = o + (size_t)k0 * BLK_PACK_VECS;
            const __m512i dd = _mm512_i32gather_epi32(widx, w + (size_t)blk * bb, 1);
            const __m512 sv = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dd));
            __m512 mv = _mm512_setzero_ps();
            if (DT == DUET_DTYPE_Q4_0 || DT == DUET_DTYPE_Q5_0)
                mv = _mm512_mul_ps(sv, _mm512_set1_ps(DT == DUET_DTYPE_Q4_0 ? 8.0f : 16.0f));
            else if (DT == DUET_DTYPE_Q4_1 || DT == DUET_DTYPE_Q5_1)
                mv = _mm512_sub_ps(_mm512_setzero_ps(),
                                   _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dd, 16))));
            _mm512_store_ps((float *)(v + 8), sv); /* one scale: only the _lo pair is read */
            _mm512_store_ps((float *)(v + 10), mv);
        } else {
            for (int i = 0; i < BLK_PANEL_ROWS; i++)
                simd_scales(DT, w + (size_t)i * ws + (size_t)blk * bb, &sc[i]);
        }
#pragma GCC unroll 8
        for (int c = 0; c < cps; c++) {
            __m512i *v = o + (size_t)(k0 + c) * BLK_PACK_VECS;
            __m256i rows[BLK_PANEL_ROWS];
#pragma GCC unroll 16
            for (int i = 0; i < BLK_PANEL_ROWS; i++) {
                const __m256i q = simd_unpack(DT, w + (size_t)i * ws + (size_t)blk * bb, c);
                rows[i] = signed_q(DT) ? _mm256_xor_si256(q, _mm256_set1_epi8((char)0x80)) : q;
            }
            __m512i t[8];
            avx512_transpose_16x8d(rows, t);
#pragma GCC unroll 8
            for (int r = 0; r < 8; r++)
                _mm512_store_si512(v + r, t[r]);
            for (int h = 0; h < 2 && cps > 1; h++) {
                const __m512 sv = _mm512_i32gather_ps(sidx, &sc[0].s[2 * c + h], 4);
                __m512 mv = _mm512_setzero_ps();
                if (offset != 0.0f)
                    mv = _mm512_mul_ps(sv, _mm512_set1_ps(offset));
                else if (has_min(DT))
                    mv = _mm512_i32gather_ps(sidx, &sc[0].m[2 * c + h], 4);
                _mm512_store_ps((float *)(v + 8 + h), sv);
                _mm512_store_ps((float *)(v + 10 + h), mv);
            }
        }
    }
}

#define BLK_PACKER(T, name)                                                                                  \
    CPU_AVX512 static void name(const uint8_t *w, size_t ws, int64_t c0, int nc, __m512i *o) {               \
        blk_panel_pack(T, w, ws, c0, nc, o);                                                                 \
    }
BLK_PACKER(DUET_DTYPE_Q4_0, pack_q4_0)
BLK_PACKER(DUET_DTYPE_Q4_1, pack_q4_1)
BLK_PACKER(DUET_DTYPE_Q5_0, pack_q5_0)
BLK_PACKER(DUET_DTYPE_Q5_1, pack_q5_1)
BLK_PACKER(DUET_DTYPE_IQ4_NL, pack_iq4_nl)
BLK_PACKER(DUET_DTYPE_Q2_K, pack_q2_K)
BLK_PACKER(DUET_DTYPE_Q3_K, pack_q3_K)
BLK_PACKER(DUET_DTYPE_Q4_K, pack_q4_K)
BLK_PACKER(DUET_DTYPE_Q5_K, pack_q5_K)
BLK_PACKER(DUET_DTYPE_Q6_K, pack_q6_K)
BLK_PACKER(DUET_DTYPE_IQ4_XS, pack_iq4_xs)
#undef BLK_PACKER

static blk_pack_fn blk_packer(duet_dtype t) {
    switch (t) {
    case DUET_DTYPE_Q4_0:
        return pack_q4_0;
    case DUET_DTYPE_Q4_1:
        return pack_q4_1;
    case DUET_DTYPE_Q5_0:
        return pack_q5_0;
    case DUET_DTYPE_Q5_1:
        return pack_q5_1;
    case DUET_DTYPE_IQ4_NL:
        return pack_iq4_nl;
    case DUET_DTYPE_Q2_K:
        return pack_q2_K;
    case DUET_DTYPE_Q3_K:
        return pack_q3_K;
    case DUET_DTYPE_Q4_K:
        return pack_q4_K;
    case DUET_DTYPE_Q5_K:
        return pack_q5_K;
    case DUET_DTYPE_Q6_K:
        return pack_q6_K;
    default:
        return pack_iq4_xs;
    }
}

/* NT tokens against the panel. TWO: the halves have their own scales (q2_K,
 * q3_K, q6_K); SGN: signed q (IQ4: stored + 128, no mins). */
CPU_AVX512 CPU_INLINE void blk_panel_body(const int NT, const bool TWO, const bool SGN, const blk_panel *p) {
    const blk_act *x = p->x;
    __m512 acc[BLK_PANEL_TOKENS];
#pragma GCC unroll 16
    for (int j = 0; j < NT; j++)
        acc[j] = _mm512_setzero_ps();
    __m512i local[BLK_UNIT * BLK_PACK_VECS];
    for (int64_t u0 = 0; u0 < p->nchunks; u0 += BLK_UNIT) {
        const int nc = (int)(p->nchunks - u0 < BLK_UNIT ? p->nchunks - u0 : BLK_UNIT);
        const __m512i *pk = p->pack_mode == BLK_DIRECT ? local : p->pack + (size_t)u0 * BLK_PACK_VECS;
        if (p->pack_mode != BLK_LOAD) p->pack_fn(p->w, p->ws, u0, nc, (__m512i *)pk);
        for (int k = 0; k < nc; k++) {
            const int64_t b = u0 + k;
            const __m512i *v = pk + (size_t)k * BLK_PACK_VECS;
            const __m512 s_lo = _mm512_load_ps((const float *)(v + 8)),
                         s_hi = _mm512_load_ps((const float *)(v + 9));
            const __m512 m_lo = _mm512_load_ps((const float *)(v + 10)),
                         m_hi = _mm512_load_ps((const float *)(v + 11));
            __m512i w[8];
#pragma GCC unroll 8
            for (int c = 0; c < 8; c++)
                w[c] = _mm512_load_si512(v + c);
#pragma GCC unroll 16
            for (int j = 0; j < NT; j++) {
                const int64_t t = p->tok + j;
                const int8_t *q = x->q + t * x->qs + b * 32;
                const float *xh = x->xh + t * 3 * x->ds + 3 * b;
                const int32_t *ncx = x->nc + t * 3 * x->ds + 3 * b;
                const __m512 dx = _mm512_set1_ps(x->d[t * x->ds + b]);
                int32_t q4[8];
                memcpy(q4, q, 32);
                if (TWO) {
                    __m512i r0 = SGN ? _mm512_set1_epi32(ncx[0]) : _mm512_setzero_si512();
                    __m512i r1 = SGN ? _mm512_set1_epi32(ncx[1]) : _mm512_setzero_si512();
#pragma GCC unroll 4
                    for (int c = 0; c < 4; c++) {
                        r0 = _mm512_dpbusd_epi32(r0, w[c], _mm512_set1_epi32(q4[c]));
                        r1 = _mm512_dpbusd_epi32(r1, w[c + 4], _mm512_set1_epi32(q4[c + 4]));
                    }
                    acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(r0), _mm512_mul_ps(s_lo, dx), acc[j]);
                    acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(r1), _mm512_mul_ps(s_hi, dx), acc[j]);
                    if (!SGN) {
                        acc[j] = _mm512_fnmadd_ps(m_lo, _mm512_set1_ps(xh[0]), acc[j]);
                        acc[j] = _mm512_fnmadd_ps(m_hi, _mm512_set1_ps(xh[1]), acc[j]);
                    }
                } else {
                    __m512i r = SGN ? _mm512_set1_epi32(ncx[2]) : _mm512_setzero_si512();
#pragma GCC unroll 8
                    for (int c = 0; c < 8; c++)
                        r = _mm512_dpbusd_epi32(r, w[c], _mm512_set1_epi32(q4[c]));
                    acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(r), _mm512_mul_ps(s_lo, dx), acc[j]);
                    if (!SGN) acc[j] = _mm512_fnmadd_ps(m_lo, _mm512_set1_ps(xh[2]), acc[j]);
                }
            }
        }
    }
    const __mmask16 m = (__mmask16)(0xffffu << p->first);
    const __m512 bias = p->bias ? _mm512_maskz_loadu_ps(m, p->bias) : _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int j = 0; j < NT; j++) {
        float *o = p->out + j * p->os;
        __m512 v = _mm512_add_ps(acc[j], bias);
        if (p->accumulate) v = _mm512_add_ps(_mm512_maskz_loadu_ps(m, o), v);
        _mm512_mask_storeu_ps(o, m, v);
    }
}

typedef void (*blk_panel_fn)(const blk_panel *p);
#define BLK_PANEL(NT, TWO, SGN)                                                                              \
    CPU_AVX512 static void blk_panel_##NT##_##TWO##SGN(const blk_panel *p) {                                 \
        blk_panel_body(NT, TWO, SGN, p);                                                                     \
    }
#define BLK_PANELS(TWO, SGN)                                                                                 \
    BLK_PANEL(1, TWO, SGN)                                                                                   \
    BLK_PANEL(2, TWO, SGN) BLK_PANEL(4, TWO, SGN) BLK_PANEL(8, TWO, SGN) BLK_PANEL(16, TWO, SGN)
BLK_PANELS(0, 0)
BLK_PANELS(1, 0)
BLK_PANELS(0, 1)
#undef BLK_PANELS
#undef BLK_PANEL

/* The kernels for 16, 8, 4, 2 and 1 tokens of a type. */
static const blk_panel_fn *blk_panels(duet_dtype t) {
    static const blk_panel_fn one[5] = {blk_panel_16_00, blk_panel_8_00, blk_panel_4_00, blk_panel_2_00,
                                        blk_panel_1_00};
    static const blk_panel_fn two[5] = {blk_panel_16_10, blk_panel_8_10, blk_panel_4_10, blk_panel_2_10,
                                        blk_panel_1_10};
    static const blk_panel_fn sgn[5] = {blk_panel_16_01, blk_panel_8_01, blk_panel_4_01, blk_panel_2_01,
                                        blk_panel_1_01};
    if (signed_q(t)) return sgn;
    if (t == DUET_DTYPE_Q2_K || t == DUET_DTYPE_Q3_K || t == DUET_DTYPE_Q6_K) return two;
    return one;
}

/* ---- repacked Q4_0 and Q5_0 (the layout: cpu_internal.h) -------------------------------------- */

#define RP_TOKENS 8 /* tokens per pass over a group, at most */

/* NT tokens against one group of 16 rows. */
typedef struct rp_job {
    const uint8_t *g; /* the group */
    int64_t nb;       /* 32-blocks per row */
    const blk_act *x;
    int64_t tok;       /* first token */
    const float *bias; /* at the group's first row, or NULL */
    bool accumulate;
    float *out; /* token tok, the group's first row */
    int64_t os;
    size_t pf; /* bytes of a group: the block prefetched is the next group's */
} rp_job;

/* The next group's block b (a thread's groups are contiguous): decode reads
 * each weight once, and one stream with the hardware prefetcher alone
 * keeps too few lines in flight (as the q8_0 panel, cpu_matmul.c). */
#define RP_PREFETCH(DT, p, jb)                                                                               \
    do {                                                                                                     \
        for (size_t off_ = 0; off_ < rp_block_bytes(DT); off_ += 64)                                         \
            _mm_prefetch((const char *)(p) + (jb)->pf + off_, _MM_HINT_T0);                                  \
    } while (0)

static inline int32_t rd32(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* avx512: a lane per row. Per block and token the float work is the
 * panel's (acc += dot * (s dx) - m s xh, m = 8 or 16), so the bits are
 * the same. Q5_0's fifth bits: chunk c's low nibbles take bit c of each
 * byte of the row's permuted qh dword, the high ones bit 4 + c, each
 * shifted to 0x10 in place (cpu_internal.h). */
CPU_AVX512 CPU_INLINE void rp512_body(duet_dtype DT, const int NT, const rp_job *jb) {
    const blk_act *x = jb->x;
    const bool q5 = DT == DUET_DTYPE_Q5_0;
    const __m512i m4 = _mm512_set1_epi8(0x0f), m5 = _mm512_set1_epi8(0x10);
    __m512 acc[RP_TOKENS];
#pragma GCC unroll 8
    for (int j = 0; j < NT; j++)
        acc[j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < jb->nb; b++) {
        const uint8_t *p = jb->g + (size_t)b * rp_block_bytes(DT);
        RP_PREFETCH(DT, p, jb);
        const __m512i qh = q5 ? _mm512_loadu_si512(p + 32) : _mm512_setzero_si512();
        __m512i r[RP_TOKENS];
#pragma GCC unroll 8
        for (int j = 0; j < NT; j++)
            r[j] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) {
            const __m512i v = _mm512_loadu_si512(p + rp_qs_at(DT) + 64 * c);
            __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
            if (q5) {
                lo = _mm512_or_si512(lo, _mm512_and_si512(_mm512_slli_epi32(qh, 4 - c), m5));
                hi = _mm512_or_si512(hi, _mm512_and_si512(_mm512_srli_epi32(qh, c), m5));
            }
#pragma GCC unroll 8
            for (int j = 0; j < NT; j++) {
                const int8_t *q = x->q + (jb->tok + j) * x->qs + b * 32;
                r[j] = _mm512_dpbusd_epi32(r[j], lo, _mm512_set1_epi32(rd32(q + 4 * c)));
                r[j] = _mm512_dpbusd_epi32(r[j], hi, _mm512_set1_epi32(rd32(q + 16 + 4 * c)));
            }
        }
        const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
        const __m512 m = _mm512_mul_ps(s, _mm512_set1_ps(q5 ? 16.0f : 8.0f));
#pragma GCC unroll 8
        for (int j = 0; j < NT; j++) {
            const int64_t t = jb->tok + j;
            const __m512 dx = _mm512_set1_ps(x->d[t * x->ds + b]);
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(r[j]), _mm512_mul_ps(s, dx), acc[j]);
            acc[j] = _mm512_fnmadd_ps(m, _mm512_set1_ps(x->xh[t * 3 * x->ds + 3 * b + 2]), acc[j]);
        }
    }
    const __m512 bias = jb->bias ? _mm512_loadu_ps(jb->bias) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int j = 0; j < NT; j++) {
        float *o = jb->out + j * jb->os;
        __m512 v = _mm512_add_ps(acc[j], bias);
        if (jb->accumulate) v = _mm512_add_ps(_mm512_loadu_ps(o), v);
        _mm512_storeu_ps(o, v);
    }
}

/* avx2: the group as two halves of 8 rows. maddubs' pair sums add up in
 * 16 bits without overflow for a whole Q4_0 block (8 of at most
 * 2 * 15 * 128: 30720 < 2^15) but only for half a Q5_0 block (4 of at most
 * 2 * 31 * 128: 31744), which then widens to 32 bits twice per block. The
 * integer dot is exact either way; the tiles' avx2 float work follows. */
CPU_AVX2 CPU_INLINE void rp256_body(duet_dtype DT, const int NT, const rp_job *jb) {
    const blk_act *x = jb->x;
    const bool q5 = DT == DUET_DTYPE_Q5_0;
    const __m256i m4 = _mm256_set1_epi8(0x0f), m5 = _mm256_set1_epi8(0x10), one = _mm256_set1_epi16(1);
    __m256 acc[2][RP_TOKENS];
#pragma GCC unroll 8
    for (int j = 0; j < NT; j++)
        acc[0][j] = acc[1][j] = _mm256_setzero_ps();
    for (int64_t b = 0; b < jb->nb; b++) {
        const uint8_t *p = jb->g + (size_t)b * rp_block_bytes(DT);
        RP_PREFETCH(DT, p, jb);
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const __m256i qh = q5 ? _mm256_loadu_si256((const __m256i *)(p + 32 + 32 * h)) : m4;
            __m256i r[RP_TOKENS], d32[RP_TOKENS];
#pragma GCC unroll 8
            for (int j = 0; j < NT; j++)
                r[j] = d32[j] = _mm256_setzero_si256();
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(p + rp_qs_at(DT) + 64 * c + 32 * h));
                __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                if (q5) {
                    lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi32(qh, 4 - c), m5));
                    hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_srli_epi32(qh, c), m5));
                }
#pragma GCC unroll 8
                for (int j = 0; j < NT; j++) {
                    const int8_t *q = x->q + (jb->tok + j) * x->qs + b * 32;
                    r[j] =
                        _mm256_add_epi16(r[j], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(rd32(q + 4 * c))));
                    r[j] = _mm256_add_epi16(
                        r[j], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(rd32(q + 16 + 4 * c))));
                    if (q5 && c % 2 == 1) {
                        d32[j] = _mm256_add_epi32(d32[j], _mm256_madd_epi16(r[j], one));
                        r[j] = _mm256_setzero_si256();
                    }
                }
            }
            const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16 * h)));
            const __m256 m = _mm256_mul_ps(s, _mm256_set1_ps(q5 ? 16.0f : 8.0f));
#pragma GCC unroll 8
            for (int j = 0; j < NT; j++) {
                const int64_t t = jb->tok + j;
                const __m256 dx = _mm256_broadcast_ss(x->d + t * x->ds + b);
                if (!q5) d32[j] = _mm256_madd_epi16(r[j], one);
                acc[h][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d32[j]), _mm256_mul_ps(s, dx), acc[h][j]);
                acc[h][j] =
                    _mm256_fnmadd_ps(m, _mm256_broadcast_ss(x->xh + t * 3 * x->ds + 3 * b + 2), acc[h][j]);
            }
        }
    }
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
        const __m256 bias = jb->bias ? _mm256_loadu_ps(jb->bias + 8 * h) : _mm256_setzero_ps();
#pragma GCC unroll 8
        for (int j = 0; j < NT; j++) {
            float *o = jb->out + j * jb->os + 8 * h;
            __m256 v = _mm256_add_ps(acc[h][j], bias);
            if (jb->accumulate) v = _mm256_add_ps(_mm256_loadu_ps(o), v);
            _mm256_storeu_ps(o, v);
        }
    }
}

typedef void (*rp_fn)(const rp_job *jb);
#define RP512(T, NT)                                                                                         \
    CPU_AVX512 static void rp512_##T##_##NT(const rp_job *jb) {                                              \
        rp512_body(DUET_DTYPE_##T, NT, jb);                                                                  \
    }
#define RP256(T, NT)                                                                                         \
    CPU_AVX2 static void rp256_##T##_##NT(const rp_job *jb) {                                                \
        rp256_body(DUET_DTYPE_##T, NT, jb);                                                                  \
    }
/* 8, 4, 2 and 1 tokens per pass (avx2: at most 2, for its 16 registers). */
#define RP_FNS(T)                                                                                            \
    RP512(T, 8)                                                                                              \
    RP512(T, 4)                                                                                              \
    RP512(T, 2)                                                                                              \
    RP512(T, 1)                                                                                              \
    RP256(T, 2)                                                                                              \
    RP256(T, 1)                                                                                              \
    static const rp_fn rp512_##T##_fns[4] = {rp512_##T##_8, rp512_##T##_4, rp512_##T##_2, rp512_##T##_1};    \
    static const rp_fn rp256_##T##_fns[4] = {NULL, NULL, rp256_##T##_2, rp256_##T##_1};
RP_FNS(Q4_0)
RP_FNS(Q5_0)
#undef RP_FNS
#undef RP256
#undef RP512
#endif /* CPU_X86 */

/* ---- driver ------------------------------------------------------------------------------------------ */

typedef void (*blk_tile_fn)(duet_dtype DT, int nr, int nt, const uint8_t *w, size_t ws, const blk_act *x,
                            int64_t tok, int64_t nsb, blk_res res);

typedef struct blk_task {
    blk_tile_fn tile;
    const cpu_backend *be;
    duet_dtype dtype;
    int64_t n_tokens, n_in, n_out, nb, nsb;
    const uint8_t *w;
    size_t ws;
    const float *x, *bias;
    float *out;
    bool accumulate;
    const duet_block_q8_0 *xb; /* [n_tokens][nb] */
    duet_block_q8_0 *xbuf;     /* x quantised here, or NULL (x_q8 given) */
    blk_act act;
    int64_t token_chunk; /* tokens whose activations stay in L2 while W rows cycle */
#if CPU_X86
    bool panel;
    blk_pack_fn pack_fn;
    const blk_panel_fn *panels; /* 16, 8, 4, 2, 1 tokens */
    __m512i *packs;             /* per worker: pack_vecs vectors */
    size_t pack_vecs;
    int64_t rp_rows;     /* rows [0, rp_rows) are repacked groups */
    const rp_fn *rp_fns; /* 8, 4, 2, 1 tokens (NULL: not on this path) */
#endif
} blk_task;

static void blk_prepare_task(void *p, int chunk, int n_chunks, int worker) {
    (void)worker;
    blk_task *t = p;
    int64_t lo, hi;
    cpu_split(t->n_tokens, chunk, n_chunks, 1, &lo, &hi);
    for (int64_t i = lo; i < hi; i++) {
        if (t->xbuf) duet__cpu_quantize_q8_0(t->be, t->x + i * t->n_in, t->xbuf + i * t->nb, t->n_in);
        act_layout(t->xb + i * t->nb, t->nb, (int8_t *)t->act.q + i * t->act.qs,
                   (float *)t->act.d + i * t->act.ds, (float *)t->act.xl + i * 8 * t->act.ds,
                   (float *)t->act.xh + i * 3 * t->act.ds, (int32_t *)t->act.nc + i * 3 * t->act.ds);
    }
}

/* Rows [lo, hi) by the tiles. */
static void blk_rows_range(const blk_task *t, int64_t lo, int64_t hi) {
    blk_res res;
    for (int64_t t0 = 0; t0 < t->n_tokens; t0 += t->token_chunk) {
        const int64_t t1 = t0 + t->token_chunk < t->n_tokens ? t0 + t->token_chunk : t->n_tokens;
        for (int64_t r = lo; r < hi; r += BLK_MR) {
            const int nr = (int)(hi - r < BLK_MR ? hi - r : BLK_MR);
            for (int64_t tok = t0; tok < t1; tok += BLK_MT) {
                const int nt = (int)(t1 - tok < BLK_MT ? t1 - tok : BLK_MT);
                t->tile(t->dtype, nr, nt, t->w + (size_t)r * t->ws, t->ws, &t->act, tok, t->nsb, res);
                for (int j = 0; j < nt; j++) {
                    float *o = t->out + (tok + j) * t->n_out + r;
                    for (int i = 0; i < nr; i++) {
                        const float v = res[i][j] + (t->bias ? t->bias[r + i] : 0.0f);
                        o[i] = t->accumulate ? o[i] + v : v;
                    }
                }
            }
        }
    }
}

static void blk_rows_task(void *p, int chunk, int n_chunks, int worker) {
    (void)worker;
    const blk_task *t = p;
    int64_t lo, hi;
    cpu_split(t->n_out, chunk, n_chunks, BLK_MR, &lo, &hi);
    blk_rows_range(t, lo, hi);
}

#if CPU_X86
/* Repacked groups of 16 rows, per token chunk in passes of 8, 4, 2 and 1
 * tokens; the plain rows after the last group by the tiles. */
static void blk_rp_task(void *p, int chunk, int n_chunks, int worker) {
    (void)worker;
    const blk_task *t = p;
    int64_t lo, hi;
    cpu_split(t->n_out, chunk, n_chunks, CPU_RP_ROWS, &lo, &hi);
    const int64_t split = hi < t->rp_rows ? hi : t->rp_rows;
    rp_job jb = {
        .nb = t->nb, .x = &t->act, .accumulate = t->accumulate, .os = t->n_out, .pf = CPU_RP_ROWS * t->ws};
    for (int64_t t0 = 0; t0 < t->n_tokens; t0 += t->token_chunk) {
        const int64_t t1 = t0 + t->token_chunk < t->n_tokens ? t0 + t->token_chunk : t->n_tokens;
        for (int64_t r = lo; r < split; r += CPU_RP_ROWS) {
            jb.g = t->w + (size_t)r * t->ws;
            jb.bias = t->bias ? t->bias + r : NULL;
            for (int64_t tok = t0; tok < t1;) {
                int g = 0; /* the largest pass that fits: 8, 4, 2, 1 */
                while (!t->rp_fns[g] || (RP_TOKENS >> g) > t1 - tok)
                    g++;
                jb.tok = tok;
                jb.out = t->out + tok * t->n_out + r;
                t->rp_fns[g](&jb);
                tok += RP_TOKENS >> g;
            }
        }
    }
    if (split < hi) blk_rows_range(t, split > lo ? split : lo, hi);
}
#endif

#if CPU_X86
/* Panels of 16 rows; per token chunk each panel meets the chunk's tokens in
 * groups of 16, 8, 4, 2 and 1. With more than one group the first packs the
 * panel and keeps the pack for the others. */
static void blk_panel_task(void *p, int chunk, int n_chunks, int worker) {
    blk_task *t = p;
    int64_t lo, hi;
    cpu_split(t->n_out, chunk, n_chunks, BLK_PANEL_ROWS, &lo, &hi);
    blk_panel pn = {.ws = t->ws,
                    .nchunks = t->nb,
                    .x = &t->act,
                    .pack_fn = t->pack_fn,
                    .pack = t->packs + (size_t)worker * t->pack_vecs,
                    .accumulate = t->accumulate,
                    .os = t->n_out};
    for (int64_t t0 = 0; t0 < t->n_tokens; t0 += t->token_chunk) {
        const int64_t t1 = t0 + t->token_chunk < t->n_tokens ? t0 + t->token_chunk : t->n_tokens;
        for (int64_t r = lo; r < hi; r += BLK_PANEL_ROWS) {
            const int64_t r0 = hi - r < BLK_PANEL_ROWS ? hi - BLK_PANEL_ROWS : r; /* n_out >= 16 */
            pn.first = (int)(r - r0);
            pn.w = t->w + (size_t)r0 * t->ws;
            pn.bias = t->bias ? t->bias + r0 : NULL;
            const bool one_group =
                t1 - t0 == 1 || t1 - t0 == 2 || t1 - t0 == 4 || t1 - t0 == 8 || t1 - t0 == 16;
            pn.pack_mode = one_group ? BLK_DIRECT : BLK_STORE;
            for (int64_t tok = t0; tok < t1;) {
                int g = 0; /* the largest group that fits: 16, 8, 4, 2, 1 */
                while ((BLK_PANEL_TOKENS >> g) > t1 - tok)
                    g++;
                pn.tok = tok;
                pn.out = t->out + tok * t->n_out + r0;
                t->panels[g](&pn);
                if (pn.pack_mode == BLK_STORE) pn.pack_mode = BLK_LOAD;
                tok += BLK_PANEL_TOKENS >> g;
            }
        }
    }
}
#endif

static size_t align64(size_t n) {
    return (n + 63) & ~(size_t)63;
}

/* The task and its activations' layout (x quantised unless x_q8 came);
 * `panel`: the avx512 panel may run (not for repacked rows). */
static duet_status blk_setup(cpu_backend *be, const duet_op *op, const void *w, const float *x,
                             const duet_block_q8_0 *xq, const float *bias, float *out, bool panel,
                             blk_task *task) {
    const duet_dtype dt = op->matmul.dtype;
    blk_task t = {
        .tile = scalar_tile,
        .be = be,
        .dtype = dt,
        .n_tokens = op->n_tokens,
        .n_in = op->matmul.n_in,
        .n_out = op->matmul.n_out,
        .nb = op->matmul.n_in / 32,
        .nsb = op->matmul.n_in / duet_dtype_block(dt),
        .w = w,
        .ws = duet_dtype_row_bytes(dt, op->matmul.n_in),
        .x = x,
        .bias = bias,
        .out = out,
        .accumulate = op->matmul.accumulate,
    };
#if CPU_X86
    if (be->isa == CPU_ISA_AVX512)
        t.tile = avx512_tile;
    else if (be->isa == CPU_ISA_AVX2)
        t.tile = avx2_tile;
#endif
    /* Scratch: x quantised (unless x_q8 came), the kernels' layout, and
     * for the panel one pack per worker. */
    const size_t n_blk = (size_t)t.n_tokens * (size_t)t.nb;
    const size_t xbuf_bytes = xq ? 0 : align64(n_blk * sizeof(duet_block_q8_0));
    t.act.qs = t.nb * 32;
    t.act.ds = t.nb;
    const size_t q_bytes = align64((size_t)t.n_tokens * (size_t)t.act.qs);
    const size_t d_bytes = align64((size_t)t.n_tokens * (size_t)t.act.ds * sizeof(float));
    size_t pack_bytes = 0;
#if CPU_X86
    /* The panel for batches (it and the tiles agree bit for bit, so the
     * choice may depend on n_tokens): decode's tile reads each row once
     * and transposes nothing. */
    t.panel = panel && be->isa == CPU_ISA_AVX512 && t.n_out >= BLK_PANEL_ROWS &&
              t.n_tokens >= BLK_PANEL_MIN_TOKENS &&
              t.ws * (BLK_PANEL_ROWS - 1) <= (size_t)INT32_MAX; /* the scale gathers' offsets */
    if (t.panel) {
        t.pack_fn = blk_packer(dt);
        t.panels = blk_panels(dt);
        t.pack_vecs = (size_t)((t.nb + BLK_UNIT - 1) / BLK_UNIT * BLK_UNIT) * BLK_PACK_VECS;
        pack_bytes = t.pack_vecs * sizeof(__m512i) * (size_t)be->pool->n_threads;
    }
#endif
    /* d, xl (8 per block), xh and nc (3 each per block), then the packs. */
    duet_status st =
        duet__cpu_scratch_reserve(&be->act, xbuf_bytes + q_bytes + 15 * d_bytes + pack_bytes + 64);
    if (st != DUET_OK) return st;
    uint8_t *sp = be->act.p;
    t.xbuf = xq ? NULL : (duet_block_q8_0 *)sp;
    t.xb = xq ? xq : t.xbuf;
    t.act.q = (const int8_t *)(sp + xbuf_bytes);
    t.act.d = (const float *)(sp + xbuf_bytes + q_bytes);
    t.act.xl = (const float *)(sp + xbuf_bytes + q_bytes + d_bytes);
    t.act.xh = (const float *)(sp + xbuf_bytes + q_bytes + 9 * d_bytes);
    t.act.nc = (const int32_t *)(sp + xbuf_bytes + q_bytes + 12 * d_bytes);
#if CPU_X86
    if (t.panel)
        t.packs = (__m512i *)(((uintptr_t)(sp + xbuf_bytes + q_bytes + 15 * d_bytes) + 63) & ~(uintptr_t)63);
#endif
    duet__cpu_pool_run(be->pool, t.n_tokens >= 8 ? cpu_chunks(be->pool, t.n_tokens) : 1, blk_prepare_task,
                       &t);
    (void)panel;
    *task = t;
    return DUET_OK;
}

/* Runs fn over units of `unit` rows, a few per thread, in token chunks of
 * ~256 KiB of activations (a multiple of `pass` tokens) that stay in L2
 * while a thread's rows cycle; matmuls far smaller than a dispatch inline. */
static void blk_run(cpu_backend *be, blk_task *t, int unit, int pass, cpu_task_fn fn) {
    int64_t chunk = (256 * 1024) / (t->act.qs > 0 ? t->act.qs : 1);
    chunk = chunk / pass * pass;
    t->token_chunk = chunk < pass ? pass : chunk;
    const int64_t work = t->n_tokens * t->n_in * t->n_out;
    const int64_t units = (t->n_out + unit - 1) / unit;
    duet__cpu_pool_run(be->pool, work >= 32 * 1024 ? cpu_chunks(be->pool, units) : 1, fn, t);
}

duet_status duet__cpu_matmul_blocks(cpu_backend *be, const duet_op *op, const void *w, const float *x,
                                    const duet_block_q8_0 *xq, const float *bias, float *out) {
    blk_task t;
    duet_status st = blk_setup(be, op, w, x, xq, bias, out, true, &t);
    if (st != DUET_OK) return st;
#if CPU_X86
    if (t.panel) {
        blk_run(be, &t, BLK_PANEL_ROWS, BLK_PANEL_TOKENS, blk_panel_task);
        return DUET_OK;
    }
#endif
    blk_run(be, &t, BLK_MR, BLK_MT, blk_rows_task);
    return DUET_OK;
}

duet_status duet__cpu_matmul_rp(cpu_backend *be, const duet_op *op, const void *w, int64_t rp_rows,
                                const float *x, const duet_block_q8_0 *xq, const float *bias, float *out) {
#if CPU_X86
    blk_task t;
    duet_status st = blk_setup(be, op, w, x, xq, bias, out, false, &t);
    if (st != DUET_OK) return st;
    t.rp_rows = rp_rows;
    const bool q5 = op->matmul.dtype == DUET_DTYPE_Q5_0;
    if (be->isa == CPU_ISA_AVX512)
        t.rp_fns = q5 ? rp512_Q5_0_fns : rp512_Q4_0_fns;
    else
        t.rp_fns = q5 ? rp256_Q5_0_fns : rp256_Q4_0_fns;
    blk_run(be, &t, CPU_RP_ROWS, RP_TOKENS, blk_rp_task);
    return DUET_OK;
#else
    (void)be, (void)op, (void)w, (void)rp_rows, (void)x, (void)xq, (void)bias, (void)out;
    return duet__error(DUET_INVALID_ARGUMENT,
                       "matmul: repacked weights on a cpu without the layout's kernels");
#endif
}

/* ---- repacking ------------------------------------------------------------------------------------ */

/* Q5_0's qh as the group stores it: byte k holds in bit c the fifth bit of
 * weight 4c + k and in bit 4 + c that of weight 16 + 4c + k, so chunk c's
 * bits are a shift away from 0x10 in each byte (the kernels). Each half is
 * a 4 x 4 bit transpose (nibble c, bit k -> nibble k, bit c) whose
 * nibbles then spread to the bytes' low or high halves. */
static inline uint32_t rp_t4x4(uint32_t x) {
    uint32_t t = (x ^ (x >> 3)) & 0x0a0au; /* the 2 x 2 blocks' corners */
    x ^= t ^ (t << 3);
    t = (x ^ (x >> 6)) & 0x00ccu; /* the off-diagonal 2 x 2 blocks */
    return x ^ t ^ (t << 6);
}

static inline uint32_t rp_spread(uint32_t x) { /* nibble k -> the low half of byte k */
    return (x & 0xfu) | (x & 0xf0u) << 4 | (x & 0xf00u) << 8 | (x & 0xf000u) << 12;
}

static inline uint32_t rp_gather(uint32_t y) { /* the low half of byte k -> nibble k */
    return (y & 0xfu) | (y >> 4 & 0xf0u) | (y >> 8 & 0xf00u) | (y >> 12 & 0xf000u);
}

static uint32_t rp_qh_pack(uint32_t qh) {
    return rp_spread(rp_t4x4(qh & 0xffffu)) | rp_spread(rp_t4x4(qh >> 16)) << 4;
}

static uint32_t rp_qh_unpack(uint32_t v) {
    return rp_t4x4(rp_gather(v & 0x0f0f0f0fu)) | rp_t4x4(rp_gather(v >> 4 & 0x0f0f0f0fu)) << 16;
}

/* 16 plain Q4_0 or Q5_0 rows (ws bytes apart) -> one group at g, and back:
 * per 32-block the 16 scales, Q5_0's 16 qh dwords, then the nibbles. */
static void rp_pack_blocks(duet_dtype dt, const uint8_t *rows, size_t ws, int64_t cols, uint8_t *g) {
    const size_t bb = blk_bytes(dt), qs = dt == DUET_DTYPE_Q5_0 ? 6 : 2;
    for (int64_t b = 0; b < cols / 32; b++, g += CPU_RP_ROWS * bb)
        for (int l = 0; l < CPU_RP_ROWS; l++) {
            const uint8_t *blk = rows + (size_t)l * ws + (size_t)b * bb;
            memcpy(g + 2 * l, blk, 2);
            if (dt == DUET_DTYPE_Q5_0) {
                uint32_t qh;
                memcpy(&qh, blk + 2, 4);
                qh = rp_qh_pack(qh);
                memcpy(g + 32 + 4 * l, &qh, 4);
            }
            for (int c = 0; c < 4; c++)
                memcpy(g + rp_qs_at(dt) + 64 * c + 4 * l, blk + qs + 4 * c, 4);
        }
}

/* Block b of row l of the group at g, as the plain block's bytes. */
static void rp_block(duet_dtype dt, const uint8_t *g, int64_t b, int l, uint8_t *out) {
    const size_t qs = dt == DUET_DTYPE_Q5_0 ? 6 : 2;
    const uint8_t *p = g + (size_t)b * rp_block_bytes(dt);
    memcpy(out, p + 2 * l, 2);
    if (dt == DUET_DTYPE_Q5_0) {
        uint32_t qh;
        memcpy(&qh, p + 32 + 4 * l, 4);
        qh = rp_qh_unpack(qh);
        memcpy(out + 2, &qh, 4);
    }
    for (int c = 0; c < 4; c++)
        memcpy(out + qs + 4 * c, p + rp_qs_at(dt) + 64 * c + 4 * l, 4);
}

static void rp_unpack_blocks(duet_dtype dt, const uint8_t *g, size_t ws, int64_t cols, uint8_t *rows) {
    const size_t bb = blk_bytes(dt);
    for (int l = 0; l < CPU_RP_ROWS; l++)
        for (int64_t b = 0; b < cols / 32; b++)
            rp_block(dt, g, b, l, rows + (size_t)l * ws + (size_t)b * bb);
}

/* 16 plain F16 rows -> one group (column k's 16 halves at g + 32k), and back. */
static void rp_pack_f16(const uint8_t *rows, size_t ws, int64_t cols, uint8_t *g) {
    uint16_t *o = (uint16_t *)g;
    for (int l = 0; l < CPU_RP_ROWS; l++) {
        const uint16_t *r = (const uint16_t *)(rows + (size_t)l * ws);
        for (int64_t k = 0; k < cols; k++)
            o[k * CPU_RP_ROWS + l] = r[k];
    }
}

#if CPU_X86
/* The same 16 columns at a time: a 16 x 16 transpose of halves in three
 * rounds of two-source word permutes. A register holds 32 halves; each
 * round's output lists (row, column) pairs in the order wanted, and its
 * index picks them out of two inputs. Round 0 holds rows 2i, 2i+1 (all 16
 * columns); round 1: 4 rows x 8 columns, column-major; round 2: 8 rows x
 * 4 columns; round 3: 16 rows x 2 columns, the group's layout. */
static int rp_t_elem(int round, int reg, int e) { /* (row << 4) | column of element e */
    switch (round) {
    case 0:
        return ((2 * reg + e / 16) << 4) | (e % 16);
    case 1: /* reg = 2m + h: rows 4m.., columns 8h.. */
        return ((4 * (reg / 2) + e % 4) << 4) | (8 * (reg % 2) + e / 4);
    case 2: /* reg = 4n + q: rows 8n.., columns 4q.. */
        return ((8 * (reg / 4) + e % 8) << 4) | (4 * (reg % 4) + e / 8);
    default: /* reg = s: columns 2s, 2s + 1 */
        return ((e % 16) << 4) | (2 * reg + e / 16);
    }
}

/* idx[round - 1][reg] and the two inputs of each output register. */
typedef struct rp_t_plan {
    uint16_t idx[3][8][32];
    uint8_t src[3][8][2];
} rp_t_plan;

static void rp_t_plan_make(rp_t_plan *pl) {
    static const uint8_t srcs[3][8][2] = {
        {{0, 1}, {0, 1}, {2, 3}, {2, 3}, {4, 5}, {4, 5}, {6, 7}, {6, 7}},
        {{0, 2}, {0, 2}, {1, 3}, {1, 3}, {4, 6}, {4, 6}, {5, 7}, {5, 7}},
        {{0, 4}, {0, 4}, {1, 5}, {1, 5}, {2, 6}, {2, 6}, {3, 7}, {3, 7}},
    };
    for (int r = 0; r < 3; r++)
        for (int o = 0; o < 8; o++) {
            pl->src[r][o][0] = srcs[r][o][0];
            pl->src[r][o][1] = srcs[r][o][1];
            for (int e = 0; e < 32; e++) {
                const int want = rp_t_elem(r + 1, o, e);
                int at = -1;
                for (int h = 0; h < 2 && at < 0; h++)
                    for (int f = 0; f < 32; f++)
                        if (rp_t_elem(r, srcs[r][o][h], f) == want) {
                            at = 32 * h + f;
                            break;
                        }
                pl->idx[r][o][e] = (uint16_t)at;
            }
        }
}

static rp_t_plan rp_plan;
static pthread_once_t rp_plan_once = PTHREAD_ONCE_INIT;
static void rp_t_plan_make_once(void) {
    rp_t_plan_make(&rp_plan);
}

CPU_AVX512 static void rp_pack_f16_avx512(const uint8_t *rows, size_t ws, int64_t cols, uint8_t *g) {
    pthread_once(&rp_plan_once, rp_t_plan_make_once);
    const rp_t_plan *pl = &rp_plan;
    __m512i idx[3][8];
    for (int r = 0; r < 3; r++)
        for (int o = 0; o < 8; o++)
            idx[r][o] = _mm512_loadu_si512(pl->idx[r][o]);
    int64_t k = 0;
    for (; k + 16 <= cols; k += 16) {
        __m512i a[8], b[8];
        for (int i = 0; i < 8; i++) {
            const uint8_t *r0 = rows + (size_t)(2 * i) * ws + (size_t)k * 2;
            a[i] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)r0)),
                                      _mm256_loadu_si256((const __m256i *)(r0 + ws)), 1);
        }
        for (int r = 0; r < 3; r++) {
            for (int o = 0; o < 8; o++)
                b[o] = _mm512_permutex2var_epi16(a[pl->src[r][o][0]], idx[r][o], a[pl->src[r][o][1]]);
            for (int o = 0; o < 8; o++)
                a[o] = b[o];
        }
        for (int o = 0; o < 8; o++)
            _mm512_storeu_si512(g + (size_t)(k + 2 * o) * 32, a[o]);
    }
    for (; k < cols; k++)
        for (int l = 0; l < CPU_RP_ROWS; l++)
            memcpy(g + (size_t)k * 32 + 2 * l, rows + (size_t)l * ws + (size_t)k * 2, 2);
}
#endif

static void rp_unpack_f16(const uint8_t *g, size_t ws, int64_t cols, uint8_t *rows) {
    const uint16_t *in = (const uint16_t *)g;
    for (int l = 0; l < CPU_RP_ROWS; l++) {
        uint16_t *r = (uint16_t *)(rows + (size_t)l * ws);
        for (int64_t k = 0; k < cols; k++)
            r[k] = in[k * CPU_RP_ROWS + l];
    }
}

typedef struct rp_pack_ctx {
    uint8_t *base; /* the matrix */
    size_t ws;
    int64_t cols, groups;
    duet_dtype dtype;
    void (*pack_f16)(const uint8_t *rows, size_t ws, int64_t cols, uint8_t *g);
    uint8_t *tmp; /* per worker: one group's bytes */
    bool pack;    /* false: back to plain */
} rp_pack_ctx;

static void rp_pack_task(void *p, int chunk, int n_chunks, int worker) {
    const rp_pack_ctx *c = p;
    const size_t gb = CPU_RP_ROWS * c->ws;
    uint8_t *tmp = c->tmp + (size_t)worker * gb;
    const bool f16 = c->dtype == DUET_DTYPE_F16;
    int64_t lo, hi;
    cpu_split(c->groups, chunk, n_chunks, 1, &lo, &hi);
    for (int64_t g = lo; g < hi; g++) {
        uint8_t *at = c->base + (size_t)g * gb;
        memcpy(tmp, at, gb);
        if (f16)
            (c->pack ? c->pack_f16 : rp_unpack_f16)(tmp, c->ws, c->cols, at);
        else if (c->pack)
            rp_pack_blocks(c->dtype, tmp, c->ws, c->cols, at);
        else
            rp_unpack_blocks(c->dtype, tmp, c->ws, c->cols, at);
    }
}

/* Repacks (pack) or restores buf's matrix of `dtype`; false when out of
 * memory (the bytes are then untouched). */
static bool rp_convert(cpu_backend *be, duet_buffer *buf, size_t off, int64_t rows, int64_t cols,
                       duet_dtype dtype, bool pack) {
    rp_pack_ctx c = {.base = (uint8_t *)buf->data + off,
                     .ws = duet_dtype_row_bytes(dtype, cols),
                     .cols = cols,
                     .groups = rows / CPU_RP_ROWS,
                     .dtype = dtype,
                     .pack_f16 = rp_pack_f16,
                     .pack = pack};
#if CPU_X86
    if (be->isa == CPU_ISA_AVX512) c.pack_f16 = rp_pack_f16_avx512;
#endif
    /* Restoring runs on the caller alone (uploads and downloads are not
     * the hot path, and may come while the pool is idle or not). */
    const int workers = pack ? be->pool->n_threads : 1;
    c.tmp = malloc(CPU_RP_ROWS * c.ws * (size_t)workers);
    if (!c.tmp) return false;
    if (pack)
        duet__cpu_pool_run(be->pool, cpu_chunks(be->pool, c.groups), rp_pack_task, &c);
    else
        rp_pack_task(&c, 0, 1, 0);
    free(c.tmp);
    return true;
}

duet_status duet__cpu_rp_restore(cpu_backend *be, duet_buffer *buf) {
    if (!buf->rp_rows) return DUET_OK;
    if (!rp_convert(be, buf, buf->rp_off, buf->rp_rows, buf->rp_cols, buf->rp_dtype, false))
        return duet__error(DUET_OUT_OF_MEMORY, "cpu: out of memory restoring a repacked weight's layout");
    buf->rp_rows = 0;
    atomic_fetch_sub(&be->dev->n_repacked, 1);
    return DUET_OK;
}

void duet__cpu_rp_dequant_row(const duet_buffer *buf, int64_t row, float *out) {
    const size_t ws = duet_dtype_row_bytes(buf->rp_dtype, buf->rp_cols);
    const uint8_t *g =
        (const uint8_t *)buf->data + buf->rp_off + (size_t)(row / CPU_RP_ROWS) * CPU_RP_ROWS * ws;
    const int l = (int)(row % CPU_RP_ROWS);
    if (buf->rp_dtype == DUET_DTYPE_F16) {
        const uint16_t *h = (const uint16_t *)g + l;
        for (int64_t k = 0; k < buf->rp_cols; k++)
            out[k] = duet_fp16_to_fp32(h[k * CPU_RP_ROWS]);
        return;
    }
    for (int64_t b = 0; b < buf->rp_cols / 32; b++) {
        uint8_t blk[sizeof(duet_block_q5_0)];
        rp_block(buf->rp_dtype, g, b, l, blk);
        duet_dequantize_row(buf->rp_dtype, blk, out + 32 * b, 32);
    }
}

/* Whether be has kernels for a repacked `dtype` matrix: Q4_0 and Q5_0 on
 * the avx2 and avx512 paths (f32 or q8_0 activations), F16 on avx512 with f32
 * activations (q8_0 ones never meet F16 weights). ($DUET_CPU_REPACK=0
 * only stops new repacking.) */
static bool rp_serves(const cpu_backend *be, duet_dtype dtype, bool x_q8) {
    if (dtype == DUET_DTYPE_Q4_0 || dtype == DUET_DTYPE_Q5_0) return be->isa >= CPU_ISA_AVX2;
    if (dtype == DUET_DTYPE_F16) return be->isa == CPU_ISA_AVX512 && !x_q8;
    return false;
}

/* Whether op reads operand o (a view of the repacked buffer b) in b's
 * layout: as the same matrix's weights (on a path with its kernels), or as
 * an embedding table of its rows (rows past the groups are plain either
 * way). */
static bool rp_reads_layout(const cpu_backend *be, const duet_op *op, const duet_operand *o,
                            const duet_buffer *b) {
    if (o->view.offset != b->rp_off) return false;
    if (op->kind == DUET_OP_MATMUL && strcmp(o->name, "w") == 0)
        return op->matmul.dtype == b->rp_dtype && op->matmul.n_in == b->rp_cols &&
               op->matmul.n_out / CPU_RP_ROWS * CPU_RP_ROWS == b->rp_rows &&
               rp_serves(be, b->rp_dtype, op->matmul.x_q8.buf != NULL);
    if (op->kind == DUET_OP_EMBED && strcmp(o->name, "table") == 0)
        return op->embed.dtype == b->rp_dtype && op->embed.dim == b->rp_cols;
    return false;
}

duet_status duet__cpu_rp_prepare(cpu_backend *be, const duet_op *op, bool apply, bool *stale) {
    *stale = false;
    const bool mm = op->kind == DUET_OP_MATMUL;
    const bool serves = mm && be->repack && rp_serves(be, op->matmul.dtype, op->matmul.x_q8.buf != NULL);
    if (!atomic_load(&be->dev->n_repacked) && !serves) return DUET_OK;
    duet_operand ops[DUET_MAX_OPERANDS];
    const int n = duet_op_operands(op, ops);
    duet_buffer *w = mm ? op->matmul.w.buf : NULL;
    bool w_alone = true; /* no other operand of the op is in the weights' buffer */
    for (int i = 0; i < n; i++) {
        duet_buffer *b = ops[i].view.buf;
        if (!b) continue;
        if (b == w && !(mm && strcmp(ops[i].name, "w") == 0)) w_alone = false;
        if (b->rp_rows && !rp_reads_layout(be, op, &ops[i], b)) {
            *stale = true;
            if (!apply) return DUET_OK;
            duet_status st = duet__cpu_rp_restore(be, b);
            if (st != DUET_OK) return st;
            b->rp_never = true;
        }
    }
    /* A matrix of at least one group, on a path with its kernels. */
    if (!w || !w_alone || w->rp_rows || w->rp_never || !serves || op->matmul.n_out < CPU_RP_ROWS)
        return DUET_OK;
    *stale = true;
    if (!apply) return DUET_OK;
    const int64_t rows = op->matmul.n_out / CPU_RP_ROWS * CPU_RP_ROWS;
    /* Out of memory for the one-group staging: the plain layout serves. */
    if (!rp_convert(be, w, op->matmul.w.offset, rows, op->matmul.n_in, op->matmul.dtype, true))
        return DUET_OK;
    w->rp_rows = rows;
    w->rp_cols = op->matmul.n_in;
    w->rp_off = op->matmul.w.offset;
    w->rp_dtype = op->matmul.dtype;
    atomic_fetch_add(&be->dev->n_repacked, 1);
    return DUET_OK;
}
