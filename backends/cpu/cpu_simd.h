/* cpu_simd.h — run-time selected SIMD: target attributes and small helpers.
 *
 * The library is built for the baseline ISA; functions that use wider
 * instructions carry a target attribute and are only called after the CPU
 * check in cpu_backend.c chose their path. Helpers used inside such functions
 * need the same attribute (or inlining fails), hence the macros. */
#ifndef DUET_CPU_SIMD_H
#define DUET_CPU_SIMD_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#define CPU_X86 1
#include <immintrin.h>
#define CPU_AVX2 __attribute__((target("avx2,fma,f16c")))
#define CPU_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))
#else
#define CPU_X86 0
#endif

#define CPU_INLINE static inline __attribute__((always_inline))

/* ---- scalar ---------------------------------------------------------------- */

/* bf16 is the top half of an f32 (inline: no call inside SIMD loops). */
CPU_INLINE float cpu_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

#if CPU_X86
/* ---- avx2 -------------------------------------------------------------------- */

CPU_AVX2 CPU_INLINE float avx2_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

CPU_AVX2 CPU_INLINE float avx2_hmax(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* exp(x) to about 2 ulp: x = n ln2 + r with |r| <= ln2/2 (ln2 split in two
 * so n*ln2 is exact), exp(r) by its degree-6 Taylor polynomial (error under
 * 2^-23 on that range), then 2^n through the exponent bits. Inputs are
 * clamped so 2^n stays a normal float: exp(-inf) gives ~1e-38, not 0, which
 * is harmless for softmax weights and silu. */
CPU_AVX2 CPU_INLINE __m256 avx2_exp(__m256 x) {
    x = _mm256_min_ps(x, _mm256_set1_ps(88.0f));
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* 8 bf16 -> 8 f32: bf16 is the top half of an f32. */
CPU_AVX2 CPU_INLINE __m256 avx2_load_bf16(const uint16_t *p) {
    __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

CPU_AVX2 CPU_INLINE __m256 avx2_load_f16(const uint16_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

/* ---- avx512 ------------------------------------------------------------------ */

CPU_AVX512 CPU_INLINE __m512 avx512_exp(__m512 x) {
    x = _mm512_min_ps(x, _mm512_set1_ps(88.0f));
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    /* scalef multiplies by 2^n without building exponent bits by hand. */
    return _mm512_scalef_ps(p, n);
}

/* Loads of 16 elements as f32; the masked forms read only the lanes in m
 * (the row tail), so nothing past a row's end is touched. */
CPU_AVX512 CPU_INLINE __m512 avx512_load_f16(const uint16_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
CPU_AVX512 CPU_INLINE __m512 avx512_maskload_f16(const uint16_t *p, __mmask16 m) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
}
CPU_AVX512 CPU_INLINE __m512 avx512_load_bf16(const uint16_t *p) {
    __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}
CPU_AVX512 CPU_INLINE __m512 avx512_maskload_bf16(const uint16_t *p, __mmask16 m) {
    __m512i v = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}
CPU_AVX512 CPU_INLINE __mmask16 avx512_tail_mask(int64_t n) {
    return (__mmask16)((1u << n) - 1);
}

/* 16 rows of 32 bytes -> 8 vectors, v[c] lane l = bytes 4c..4c+3 of row l
 * (the panels' layout: one row per lane). Two rows share a register (8
 * dwords each), then an 8 x 8 dword transpose runs in both 256-bit halves at
 * once; which rows share a register is chosen so that the final 128-bit
 * shuffle leaves lane l holding row l. */
CPU_AVX512 CPU_INLINE void avx512_transpose_16x8d(const __m256i rows[16], __m512i v[8]) {
    __m512i z[8], t[8], u[8];
#pragma GCC unroll 8
    for (int r = 0; r < 8; r++) {
        const int ra = r < 4 ? r : r + 4, rb = r < 4 ? r + 4 : r + 8;
        z[r] = _mm512_inserti64x4(_mm512_castsi256_si512(rows[ra]), rows[rb], 1);
    }
#pragma GCC unroll 4
    for (int r = 0; r < 8; r += 2) { /* per 128-bit lane: rows r, r+1 x dwords (0,1 | 2,3) */
        t[r] = _mm512_unpacklo_epi32(z[r], z[r + 1]);
        t[r + 1] = _mm512_unpackhi_epi32(z[r], z[r + 1]);
    }
#pragma GCC unroll 2
    for (int g = 0; g < 8; g += 4) { /* u[g + c] lanes: rows of 4 registers x dword c | c + 4 */
        u[g + 0] = _mm512_unpacklo_epi64(t[g + 0], t[g + 2]);
        u[g + 1] = _mm512_unpackhi_epi64(t[g + 0], t[g + 2]);
        u[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
        u[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
    }
#pragma GCC unroll 4
    for (int c = 0; c < 4; c++) {
        v[c] = _mm512_shuffle_i32x4(u[c], u[c + 4], 0x88);
        v[c + 4] = _mm512_shuffle_i32x4(u[c], u[c + 4], 0xdd);
    }
}
#endif /* CPU_X86 */

#endif /* DUET_CPU_SIMD_H */
