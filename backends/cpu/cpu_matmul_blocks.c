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
 * As in cpu_matmul.c, a token's result does not depend on the batch around
 * it: each token's sums run in the same order for any tile shape. */
#include <stdlib.h>
#include <string.h>

#include "cpu_internal.h"
#include "cpu_simd.h"

#define BLK_MR 4 /* tile: rows */
#define BLK_MT                                                                                               \
    4 /* tile: tokens, at most (avx512's 32 vector registers hold 4x4 sums; avx2 and scalar take 2) */

typedef float blk_res[BLK_MR][BLK_MT];

/* The super-block's scales and mins per 16 weights (a 32-block: 2). */
typedef struct blk_scales {
    float s[16], m[16];
} blk_scales;

bool duet__cpu_blocks_dtype(duet_dtype t) {
    switch (t) {
    case DUET_DTYPE_Q4_0:
    case DUET_DTYPE_Q4_1:
    case DUET_DTYPE_Q5_0:
    case DUET_DTYPE_Q5_1:
    case DUET_DTYPE_IQ4_NL:
    case DUET_DTYPE_Q2_K:
    case DUET_DTYPE_Q3_K:
    case DUET_DTYPE_Q4_K:
    case DUET_DTYPE_Q5_K:
    case DUET_DTYPE_Q6_K:
    case DUET_DTYPE_IQ4_XS:
        return true;
    default:
        return false;
    }
}

/* Types whose w has a min term (m != 0). */
static inline bool has_min(duet_dtype t) {
    return t != DUET_DTYPE_IQ4_NL && t != DUET_DTYPE_IQ4_XS;
}

static inline bool signed_q(duet_dtype t) {
    return t == DUET_DTYPE_IQ4_NL || t == DUET_DTYPE_IQ4_XS;
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
    const float *xl; /* [tokens][8 * ds]: dx * the sum of each 4 qx */
    int64_t qs, ds;
} blk_act;

static void act_layout(const duet_block_q8_0 *xb, int64_t nb, int8_t *q, float *d, float *xl) {
    for (int64_t b = 0; b < nb; b++) {
        const float dx = duet_fp16_to_fp32(xb[b].d);
        for (int l = 0; l < 8; l++) {
            const int s = xb[b].qs[4 * l] + xb[b].qs[4 * l + 1] + xb[b].qs[4 * l + 2] + xb[b].qs[4 * l + 3];
            xl[8 * b + l] = dx * (float)s;
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
} blk_task;

static void blk_prepare_task(void *p, int chunk, int n_chunks, int worker) {
    (void)worker;
    blk_task *t = p;
    int64_t lo, hi;
    cpu_split(t->n_tokens, chunk, n_chunks, 1, &lo, &hi);
    for (int64_t i = lo; i < hi; i++) {
        if (t->xbuf) duet__cpu_quantize_q8_0(t->be, t->x + i * t->n_in, t->xbuf + i * t->nb, t->n_in);
        act_layout(t->xb + i * t->nb, t->nb, (int8_t *)t->act.q + i * t->act.qs,
                   (float *)t->act.d + i * t->act.ds, (float *)t->act.xl + i * 8 * t->act.ds);
    }
}

static void blk_rows_task(void *p, int chunk, int n_chunks, int worker) {
    (void)worker;
    blk_task *t = p;
    int64_t lo, hi;
    cpu_split(t->n_out, chunk, n_chunks, BLK_MR, &lo, &hi);
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

static size_t align64(size_t n) {
    return (n + 63) & ~(size_t)63;
}

duet_status duet__cpu_matmul_blocks(cpu_backend *be, const duet_op *op, const void *w, const float *x,
                                    const duet_block_q8_0 *xq, const float *bias, float *out) {
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
    /* Scratch: x quantised (unless x_q8 came), then the kernels' layout. */
    const size_t n_blk = (size_t)t.n_tokens * (size_t)t.nb;
    const size_t xbuf_bytes = xq ? 0 : align64(n_blk * sizeof(duet_block_q8_0));
    t.act.qs = t.nb * 32;
    t.act.ds = t.nb;
    const size_t q_bytes = align64((size_t)t.n_tokens * (size_t)t.act.qs);
    const size_t d_bytes = align64((size_t)t.n_tokens * (size_t)t.act.ds * sizeof(float));
    duet_status st = duet__cpu_scratch_reserve(&be->act, xbuf_bytes + q_bytes + 9 * d_bytes); /* d, then xl */
    if (st != DUET_OK) return st;
    uint8_t *sp = be->act.p;
    t.xbuf = xq ? NULL : (duet_block_q8_0 *)sp;
    t.xb = xq ? xq : t.xbuf;
    t.act.q = (const int8_t *)(sp + xbuf_bytes);
    t.act.d = (const float *)(sp + xbuf_bytes + q_bytes);
    t.act.xl = (const float *)(sp + xbuf_bytes + q_bytes + d_bytes);
    duet__cpu_pool_run(&be->pool, t.n_tokens >= 8 ? cpu_chunks(&be->pool, t.n_tokens) : 1, blk_prepare_task,
                       &t);
    /* Keep ~256 KiB of activations in L2 while a thread's W rows cycle. */
    int64_t chunk = (256 * 1024) / (t.act.qs > 0 ? t.act.qs : 1);
    chunk = chunk / BLK_MT * BLK_MT;
    t.token_chunk = chunk < BLK_MT ? BLK_MT : chunk;
    const int64_t work = t.n_tokens * t.n_in * t.n_out;
    const int64_t units = (t.n_out + BLK_MR - 1) / BLK_MR;
    duet__cpu_pool_run(&be->pool, work >= 32 * 1024 ? cpu_chunks(&be->pool, units) : 1, blk_rows_task, &t);
    return DUET_OK;
}
