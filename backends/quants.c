/* quants.c — GGUF's block weight formats beyond q8_0: dequantize (the
 * oracle every backend's kernels are checked against) and quantize.
 *
 * Portable scalar C, run at load time, by `duet quantize` and in tests.
 * Dequantization computes exactly what ggml's reference does, in the same
 * order of f32 operations (scale products first), so the results equal
 * the gguf Python package's bit for bit; this assumes the compiler does not
 * contract a*b - c into an FMA (it does not on x86-64's baseline ISA).
 *
 * Quantizers: Q4_0/Q4_1/Q5_0/Q5_1 round as GGUF's reference quantizer
 * (truncation of x/d + 0.5 after an offset, which is what the files in the
 * wild and the gguf package produce). The k-quants and IQ4 follow the
 * searches of llama.cpp's reference quantizers (the path llama-quantize
 * takes without an importance matrix): per sub-block a weighted
 * least-squares fit over a sweep of candidate scales (and mins), then the
 * sub-block scales are themselves quantized and the weights requantized
 * against the scales a reader will see. Round-to-nearest alone costs
 * visibly more error at 2-4 bits. */
#include <float.h>
#include <math.h>
#include <string.h>

#include "backend.h"

#define GROUP_EPS 1e-15f /* below this a group's largest |x| counts as all zero */

const int8_t duet_iq4nl_values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                      1,    13,   25,  38,  53,  69,  89,  113};

static inline float fp16(uint16_t h) {
    return duet_fp16_to_fp32(h);
}

static inline uint16_t to_fp16(float f) {
    return duet_fp32_to_fp16(f);
}

static inline int imin(int a, int b) {
    return a < b ? a : b;
}

static inline int imax(int a, int b) {
    return a > b ? a : b;
}

/* Round to nearest, ties to even (the rounding llama.cpp's quantizers use).
 * Out-of-range and NaN inputs are clamped first so every caller gets a
 * defined int; the magic-number add is exact below 2^22. */
static inline int nearest_int(float v) {
    if (!(v > -4194303.0f)) return v != v ? 0 : -4194303;
    if (v > 4194303.0f) return 4194303;
    float f = v + 12582912.0f; /* 1.5 * 2^23: the integer lands in the low mantissa bits */
    int32_t i;
    memcpy(&i, &f, 4);
    return (i & 0x007fffff) - 0x00400000;
}

/* GGUF's legacy rounding: v is x/d plus an offset, truncated and clamped
 * to [0, hi] (numpy's trunc + clip; NaN gives 0). */
static inline uint8_t trunc_clamp(float v, int hi) {
    if (!(v >= 0.0f)) return 0;
    if (v >= (float)hi) return (uint8_t)hi;
    return (uint8_t)v;
}

/* The value of largest magnitude (the first of ties, as numpy's argmax
 * picks: an all -0.0 block gives -0.0), and that magnitude. */
static float signed_absmax(const float *x, int n, float *amax_out) {
    float amax = fabsf(x[0]), max = x[0];
    for (int i = 1; i < n; i++)
        if (fabsf(x[i]) > amax) amax = fabsf(x[i]), max = x[i];
    *amax_out = amax;
    return max;
}

static void min_max(const float *x, int n, float *mn, float *mx) {
    float lo = FLT_MAX, hi = -FLT_MAX;
    for (int i = 0; i < n; i++) {
        if (x[i] < lo) lo = x[i];
        if (x[i] > hi) hi = x[i];
    }
    *mn = lo, *mx = hi;
}

/* ---- Q4_0, Q4_1, Q5_0, Q5_1 ------------------------------------------------ */

void duet__q4_0_to_f32(const void *vx, float *y, int64_t n) {
    const duet_block_q4_0 *x = vx;
    for (int64_t b = 0; b < n / DUET_QK4_0; b++, y += DUET_QK4_0) {
        const float d = fp16(x[b].d);
        for (int j = 0; j < 16; j++) {
            y[j] = (float)((x[b].qs[j] & 15) - 8) * d;
            y[j + 16] = (float)((x[b].qs[j] >> 4) - 8) * d;
        }
    }
}

/* d maps the value of largest magnitude to -8, so the other end gets the
 * spare level +7. */
void duet__q4_0_from_f32(const float *x, void *vy, int64_t n) {
    duet_block_q4_0 *y = vy;
    for (int64_t b = 0; b < n / DUET_QK4_0; b++, x += DUET_QK4_0) {
        float amax;
        const float d = signed_absmax(x, DUET_QK4_0, &amax) / -8.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        y[b].d = to_fp16(d);
        for (int j = 0; j < 16; j++)
            y[b].qs[j] = trunc_clamp(x[j] * id + 8.5f, 15) | trunc_clamp(x[j + 16] * id + 8.5f, 15) << 4;
    }
}

void duet__q4_1_to_f32(const void *vx, float *y, int64_t n) {
    const duet_block_q4_1 *x = vx;
    for (int64_t b = 0; b < n / DUET_QK4_1; b++, y += DUET_QK4_1) {
        const float d = fp16(x[b].d), m = fp16(x[b].m);
        for (int j = 0; j < 16; j++) {
            y[j] = (float)(x[b].qs[j] & 15) * d + m;
            y[j + 16] = (float)(x[b].qs[j] >> 4) * d + m;
        }
    }
}

void duet__q4_1_from_f32(const float *x, void *vy, int64_t n) {
    duet_block_q4_1 *y = vy;
    for (int64_t b = 0; b < n / DUET_QK4_1; b++, x += DUET_QK4_1) {
        float mn, mx;
        min_max(x, DUET_QK4_1, &mn, &mx);
        const float d = (mx - mn) / 15.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        y[b].d = to_fp16(d);
        y[b].m = to_fp16(mn);
        for (int j = 0; j < 16; j++)
            y[b].qs[j] =
                trunc_clamp((x[j] - mn) * id + 0.5f, 15) | trunc_clamp((x[j + 16] - mn) * id + 0.5f, 15) << 4;
    }
}

/* The 5-bit codes of a q5 block: low nibbles as q4, bit 4 from qh. */
static void q5_codes(const uint8_t qs[16], const uint8_t qh[4], int q[32]) {
    uint32_t h;
    memcpy(&h, qh, 4); /* GGUF is little endian, and so is every host duet runs on */
    for (int j = 0; j < 16; j++) {
        q[j] = (qs[j] & 15) | ((h >> j) & 1) << 4;
        q[j + 16] = (qs[j] >> 4) | ((h >> (j + 16)) & 1) << 4;
    }
}

static void q5_pack(const uint8_t q[32], uint8_t qs[16], uint8_t qh[4]) {
    uint32_t h = 0;
    for (int j = 0; j < 16; j++)
        qs[j] = (q[j] & 15) | (q[j + 16] & 15) << 4;
    for (int j = 0; j < 32; j++)
        h |= (uint32_t)(q[j] >> 4 & 1) << j;
    memcpy(qh, &h, 4);
}

void duet__q5_0_to_f32(const void *vx, float *y, int64_t n) {
    const duet_block_q5_0 *x = vx;
    for (int64_t b = 0; b < n / DUET_QK5_0; b++, y += DUET_QK5_0) {
        const float d = fp16(x[b].d);
        int q[32];
        q5_codes(x[b].qs, x[b].qh, q);
        for (int j = 0; j < 32; j++)
            y[j] = (float)(q[j] - 16) * d;
    }
}

void duet__q5_0_from_f32(const float *x, void *vy, int64_t n) {
    duet_block_q5_0 *y = vy;
    for (int64_t b = 0; b < n / DUET_QK5_0; b++, x += DUET_QK5_0) {
        float amax;
        const float d = signed_absmax(x, DUET_QK5_0, &amax) / -16.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        uint8_t q[32];
        for (int j = 0; j < 32; j++)
            q[j] = trunc_clamp(x[j] * id + 16.5f, 31);
        y[b].d = to_fp16(d);
        q5_pack(q, y[b].qs, y[b].qh);
    }
}

void duet__q5_1_to_f32(const void *vx, float *y, int64_t n) {
    const duet_block_q5_1 *x = vx;
    for (int64_t b = 0; b < n / DUET_QK5_1; b++, y += DUET_QK5_1) {
        const float d = fp16(x[b].d), m = fp16(x[b].m);
        int q[32];
        q5_codes(x[b].qs, x[b].qh, q);
        for (int j = 0; j < 32; j++)
            y[j] = (float)q[j] * d + m;
    }
}

void duet__q5_1_from_f32(const float *x, void *vy, int64_t n) {
    duet_block_q5_1 *y = vy;
    for (int64_t b = 0; b < n / DUET_QK5_1; b++, x += DUET_QK5_1) {
        float mn, mx;
        min_max(x, DUET_QK5_1, &mn, &mx);
        const float d = (mx - mn) / 31.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        uint8_t q[32];
        for (int j = 0; j < 32; j++)
            q[j] = trunc_clamp((x[j] - mn) * id + 0.5f, 31);
        y[b].d = to_fp16(d);
        y[b].m = to_fp16(mn);
        q5_pack(q, y[b].qs, y[b].qh);
    }
}

/* ---- scale searches shared by the k-quants ---------------------------------- */

/* Symmetric levels -nmax..nmax-1 for n values: returns the scale d with
 * x ~ d * (L - nmax), L[i] in 0..2nmax-1. Starting from the scale that
 * maps the largest |x| to -nmax, it tries 18 nearby scales and keeps the
 * one whose least-squares fit (weights x^2: large weights matter most)
 * explains the most of x. */
static float fit_symmetric(int n, int nmax, const float *x, int8_t *L) {
    float amax;
    const float max = signed_absmax(x, n, &amax);
    if (amax < GROUP_EPS) {
        memset(L, 0, (size_t)n);
        return 0.0f;
    }
    float best_scale = 0.0f, best = -1.0f;
    for (int is = 0; is <= 18; is++) {
        /* is 0 is the plain scale; then -9..9 tenths of a level around it. */
        const float iscale = is == 0 ? -nmax / max : -(nmax + 0.1f * (is <= 9 ? is - 10 : is - 9)) / max;
        float sumlx = 0.0f, suml2 = 0.0f;
        int8_t Lt[32];
        for (int i = 0; i < n; i++) {
            const int l = imax(-nmax, imin(nmax - 1, nearest_int(iscale * x[i])));
            const float w = x[i] * x[i];
            Lt[i] = (int8_t)l;
            sumlx += w * x[i] * l;
            suml2 += w * l * l;
        }
        /* Keep it if sumlx^2/suml2 (the error it removes) is larger. */
        const bool better = is == 0 ? true : suml2 > 0 && sumlx * sumlx > best * suml2;
        if (!better) continue;
        best_scale = suml2 > 0 ? sumlx / suml2 : 0.0f;
        best = best_scale * sumlx;
        for (int i = 0; i < n; i++)
            L[i] = (int8_t)(Lt[i] + nmax);
    }
    return best_scale;
}

/* Symmetric levels -nmax..nmax-1 for 3-bit sub-blocks: round to nearest,
 * then up to 5 passes of coordinate descent moving single levels while the
 * weighted (x^2) least-squares fit improves. L[i] gets l + nmax. */
static float fit_symmetric_descent(int n, int nmax, const float *x, int8_t *L) {
    float amax;
    const float max = signed_absmax(x, n, &amax);
    if (amax < GROUP_EPS) {
        memset(L, 0, (size_t)n);
        return 0.0f;
    }
    const float iscale = -nmax / max;
    float sumlx = 0.0f, suml2 = 0.0f;
    for (int i = 0; i < n; i++) {
        const int l = imax(-nmax, imin(nmax - 1, nearest_int(iscale * x[i])));
        const float w = x[i] * x[i];
        L[i] = (int8_t)l;
        sumlx += w * x[i] * l;
        suml2 += w * l * l;
    }
    for (int pass = 0; pass < 5; pass++) {
        int changed = 0;
        for (int i = 0; i < n; i++) {
            const float w = x[i] * x[i];
            float slx = sumlx - w * x[i] * L[i];
            if (!(slx > 0)) continue;
            float sl2 = suml2 - w * L[i] * L[i];
            /* The level that best fits x[i] under the others' scale. */
            const int nl = imax(-nmax, imin(nmax - 1, nearest_int(x[i] * sl2 / slx)));
            if (nl == L[i]) continue;
            slx += w * x[i] * nl;
            sl2 += w * nl * nl;
            if (sl2 > 0 && slx * slx * suml2 > sumlx * sumlx * sl2) {
                L[i] = (int8_t)nl, sumlx = slx, suml2 = sl2;
                changed++;
            }
        }
        if (!changed) break;
    }
    for (int i = 0; i < n; i++)
        L[i] = (int8_t)(L[i] + nmax);
    return suml2 > 0.0f ? sumlx / suml2 : 0.0f;
}

/* Levels 0..nmax with an offset, x ~ scale * L - min (min >= 0 returned in
 * *the_min). Sweeps nstep + 1 candidate inverse scales (rmin + rdelta*is +
 * nmax)/(max - min); for each, solves the weighted least-squares scale and
 * offset for those levels and keeps the one with the least weighted error
 * (absolute error when use_mad, squared otherwise). */
typedef struct affine_search {
    int nmax;
    float rmin, rdelta;
    int nstep;
    bool use_mad;
} affine_search;

static float affine_error(int n, const float *x, const float *w, const uint8_t *L, float scale, float min,
                          bool use_mad) {
    float err = 0.0f;
    for (int i = 0; i < n; i++) {
        float diff = scale * L[i] + min - x[i];
        err += w[i] * (use_mad ? fabsf(diff) : diff * diff);
    }
    return err;
}

static float fit_affine(int n, const float *x, const float *w, uint8_t *L, float *the_min, affine_search s) {
    float min = x[0], max = x[0], sum_w = w[0], sum_x = w[0] * x[0];
    for (int i = 1; i < n; i++) {
        if (x[i] < min) min = x[i];
        if (x[i] > max) max = x[i];
        sum_w += w[i];
        sum_x += w[i] * x[i];
    }
    if (min > 0) min = 0; /* the offset only ever lowers the levels */
    if (max == min) {
        memset(L, 0, (size_t)n);
        *the_min = -min;
        return 0.0f;
    }
    float iscale = s.nmax / (max - min), scale = 1 / iscale;
    for (int i = 0; i < n; i++)
        L[i] = (uint8_t)imax(0, imin(s.nmax, nearest_int(iscale * (x[i] - min))));
    float best = affine_error(n, x, w, L, scale, min, s.use_mad);
    for (int is = 0; is <= s.nstep; is++) {
        iscale = (s.rmin + s.rdelta * is + s.nmax) / (max - min);
        uint8_t Lt[32];
        float sum_l = 0, sum_l2 = 0, sum_xl = 0;
        for (int i = 0; i < n; i++) {
            const int l = imax(0, imin(s.nmax, nearest_int(iscale * (x[i] - min))));
            Lt[i] = (uint8_t)l;
            sum_l += w[i] * l;
            sum_l2 += w[i] * l * l;
            sum_xl += w[i] * l * x[i];
        }
        const float D = sum_w * sum_l2 - sum_l * sum_l;
        if (!(D > 0)) continue;
        float this_scale = (sum_w * sum_xl - sum_x * sum_l) / D;
        float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
        if (this_min > 0) { /* a positive offset is not representable: refit the scale alone */
            this_min = 0;
            this_scale = sum_xl / sum_l2;
        }
        const float err = affine_error(n, x, w, Lt, this_scale, this_min, s.use_mad);
        if (err < best) {
            memcpy(L, Lt, (size_t)n);
            best = err, scale = this_scale, min = this_min;
        }
    }
    *the_min = -min;
    return scale;
}

/* 2-bit weights (|x|) and 4/5-bit weights (rms + |x|) of the k-quants'
 * searches. */
static void weights_abs(const float *x, float *w, int n) {
    for (int i = 0; i < n; i++)
        w[i] = fabsf(x[i]);
}

static void weights_rms_abs(const float *x, float *w, int n) {
    float sum_x2 = 0;
    for (int i = 0; i < n; i++)
        sum_x2 += x[i] * x[i];
    const float av = sqrtf(sum_x2 / n);
    for (int i = 0; i < n; i++)
        w[i] = av + fabsf(x[i]);
}

/* ---- Q2_K --------------------------------------------------------------------- */

void duet__q2_K_to_f32(const void *vx, float *y, int64_t n) {
    const duet_block_q2_K *x = vx;
    for (int64_t b = 0; b < n / DUET_QK_K; b++, y += DUET_QK_K) {
        const float d = fp16(x[b].d), dmin = fp16(x[b].dmin);
        for (int i = 0; i < DUET_QK_K; i++) {
            const uint8_t sc = x[b].scales[i / 16];
            const float dl = d * (float)(sc & 15), ml = dmin * (float)(sc >> 4);
            const int q = (x[b].qs[32 * (i / 128) + i % 32] >> (2 * (i % 128 / 32))) & 3;
            y[i] = dl * (float)q - ml;
        }
    }
}

/* Packs 2-bit levels: weight 128h + 32s + l goes to bits 2s of byte 32h + l. */
static void pack_2bit(const uint8_t *L, uint8_t *qs) {
    for (int h = 0; h < DUET_QK_K; h += 128)
        for (int l = 0; l < 32; l++)
            qs[h / 4 + l] = L[h + l] | L[h + l + 32] << 2 | L[h + l + 64] << 4 | L[h + l + 96] << 6;
}

/* Quantizes positive values v[16] to 4 bits under one scale (max/15); the
 * scale's fp16 bits are returned, 0 when all are zero. */
static uint16_t q2_K_scales(const float *v, uint8_t *out, int shift) {
    float max = 0;
    for (int j = 0; j < 16; j++)
        if (v[j] > max) max = v[j];
    if (!(max > 0)) return to_fp16(0.0f);
    const float iscale = 15.0f / max;
    for (int j = 0; j < 16; j++)
        out[j] |= (uint8_t)(imin(15, nearest_int(iscale * v[j])) << shift);
    return to_fp16(max / 15.0f);
}

void duet__q2_K_from_f32(const float *x, void *vy, int64_t n) {
    duet_block_q2_K *y = vy;
    const affine_search s = {.nmax = 3, .rmin = -0.5f, .rdelta = 0.1f, .nstep = 15, .use_mad = true};
    for (int64_t b = 0; b < n / DUET_QK_K; b++, x += DUET_QK_K) {
        uint8_t L[DUET_QK_K];
        float scales[16], mins[16], w[16];
        for (int j = 0; j < 16; j++) {
            weights_abs(x + 16 * j, w, 16);
            scales[j] = fit_affine(16, x + 16 * j, w, L + 16 * j, &mins[j], s);
        }
        memset(y[b].scales, 0, sizeof y[b].scales);
        y[b].d = q2_K_scales(scales, y[b].scales, 0);
        y[b].dmin = q2_K_scales(mins, y[b].scales, 4);
        /* Requantize against the scales a reader will see. */
        for (int j = 0; j < 16; j++) {
            const float d = fp16(y[b].d) * (float)(y[b].scales[j] & 15);
            if (d == 0.0f) continue;
            const float dm = fp16(y[b].dmin) * (float)(y[b].scales[j] >> 4);
            for (int i = 0; i < 16; i++)
                L[16 * j + i] = (uint8_t)imax(0, imin(3, nearest_int((x[16 * j + i] + dm) / d)));
        }
        pack_2bit(L, y[b].qs);
    }
}

/* ---- Q3_K --------------------------------------------------------------------- */

/* The 6-bit scale j (0..63, 32 means 0) of a q3_K block's 12 bytes. */
static int q3_K_scale(const uint8_t *sc, int j) {
    const int lo = j < 8 ? sc[j] & 15 : sc[j - 8] >> 4;
    const int hi = (sc[8 + j % 4] >> (2 * (j / 4))) & 3;
    return lo | hi << 4;
}

void duet__q3_K_to_f32(const void *vx, float *y, int64_t n) {
    const duet_block_q3_K *x = vx;
    for (int64_t b = 0; b < n / DUET_QK_K; b++, y += DUET_QK_K) {
        const float d = fp16(x[b].d);
        for (int i = 0; i < DUET_QK_K; i++) {
            const float dl = d * (float)(q3_K_scale(x[b].scales, i / 16) - 32);
            const int lo = (x[b].qs[32 * (i / 128) + i % 32] >> (2 * (i % 128 / 32))) & 3;
            const int q = lo - ((x[b].hmask[i % 32] >> (i / 32)) & 1 ? 0 : 4);
            y[i] = dl * (float)q;
        }
    }
}

void duet__q3_K_from_f32(const float *x, void *vy, int64_t n) {
    duet_block_q3_K *y = vy;
    for (int64_t b = 0; b < n / DUET_QK_K; b++, x += DUET_QK_K) {
        int8_t L[DUET_QK_K];
        float scales[16], amax;
        for (int j = 0; j < 16; j++)
            scales[j] = fit_symmetric_descent(16, 4, x + 16 * j, L + 16 * j);
        const float max_scale = signed_absmax(scales, 16, &amax);
        memset(y[b].scales, 0, sizeof y[b].scales);
        y[b].d = to_fp16(0.0f);
        if (max_scale != 0.0f) {
            /* The largest scale goes to -32 (the far end), like the weights. */
            const float iscale = -32.0f / max_scale;
            for (int j = 0; j < 16; j++) {
                const int l = imax(-32, imin(31, nearest_int(iscale * scales[j]))) + 32;
                if (j < 8)
                    y[b].scales[j] = l & 15;
                else
                    y[b].scales[j - 8] |= (uint8_t)((l & 15) << 4);
                y[b].scales[8 + j % 4] |= (uint8_t)((l >> 4) << (2 * (j / 4)));
            }
            y[b].d = to_fp16(1 / iscale);
        }
        for (int j = 0; j < 16; j++) {
            const float d = fp16(y[b].d) * (float)(q3_K_scale(y[b].scales, j) - 32);
            if (d == 0.0f) continue;
            for (int i = 0; i < 16; i++)
                L[16 * j + i] = (int8_t)(imax(-4, imin(3, nearest_int(x[16 * j + i] / d))) + 4);
        }
        memset(y[b].hmask, 0, sizeof y[b].hmask);
        uint8_t low[DUET_QK_K];
        for (int i = 0; i < DUET_QK_K; i++) {
            if (L[i] > 3) y[b].hmask[i % 32] |= (uint8_t)(1 << (i / 32));
            low[i] = (uint8_t)(L[i] & 3);
        }
        pack_2bit(low, y[b].qs);
    }
}

/* ---- Q4_K, Q5_K ----------------------------------------------------------------- */

/* Sub-block j's 6-bit scale and min from a q4_K/q5_K block's 12 bytes:
 * j < 4 in the low 6 bits of bytes j and j+4; j >= 4 split into a nibble
 * of byte j+4 and the top 2 bits of bytes j-4 and j. */
static void k4_scale_min(int j, const uint8_t *q, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (uint8_t)((q[j + 4] & 15) | (q[j - 4] >> 6) << 4);
        *m = (uint8_t)((q[j + 4] >> 4) | (q[j] >> 6) << 4);
    }
}

static void k4_pack_scale_min(int j, uint8_t ls, uint8_t lm, uint8_t *q) {
    if (j < 4) {
        q[j] = ls;
        q[j + 4] = lm;
    } else {
        q[j + 4] = (uint8_t)((ls & 15) | (lm & 15) << 4);
        q[j - 4] |= (uint8_t)((ls >> 4) << 6);
        q[j] |= (uint8_t)((lm >> 4) << 6);
    }
}

/* Common to Q4_K and Q5_K: fit each 32-sub-block (levels 0..nmax), put
 * the 8 scales and 8 mins on a 6-bit grid under fp16 d and dmin, then
 * requantize L against what a reader will see. */
static void k45_quantize(const float *x, int nmax, affine_search s, uint16_t *dd, uint16_t *dmin,
                         uint8_t *scales, uint8_t *L) {
    float sc[8], mn[8], w[32], max_scale = 0, max_min = 0;
    for (int j = 0; j < 8; j++) {
        weights_rms_abs(x + 32 * j, w, 32);
        sc[j] = fit_affine(32, x + 32 * j, w, L + 32 * j, &mn[j], s);
        if (sc[j] > max_scale) max_scale = sc[j];
        if (mn[j] > max_min) max_min = mn[j];
    }
    const float inv_scale = max_scale > 0 ? 63.0f / max_scale : 0.0f;
    const float inv_min = max_min > 0 ? 63.0f / max_min : 0.0f;
    for (int j = 0; j < 8; j++) {
        const uint8_t ls = (uint8_t)imin(63, nearest_int(inv_scale * sc[j]));
        const uint8_t lm = (uint8_t)imin(63, nearest_int(inv_min * mn[j]));
        k4_pack_scale_min(j, ls, lm, scales);
    }
    *dd = to_fp16(max_scale / 63.0f);
    *dmin = to_fp16(max_min / 63.0f);
    for (int j = 0; j < 8; j++) {
        uint8_t ls, lm;
        k4_scale_min(j, scales, &ls, &lm);
        const float d = fp16(*dd) * (float)ls;
        if (d == 0.0f) continue;
        const float dm = fp16(*dmin) * (float)lm;
        for (int i = 0; i < 32; i++)
            L[32 * j + i] = (uint8_t)imax(0, imin(nmax, nearest_int((x[32 * j + i] + dm) / d)));
    }
}

void duet__q4_K_to_f32(const void *vx, float *y, int64_t n) {
    const duet_block_q4_K *x = vx;
    for (int64_t b = 0; b < n / DUET_QK_K; b++, y += DUET_QK_K) {
        const float d = fp16(x[b].d), dmin = fp16(x[b].dmin);
        for (int j = 0; j < 8; j++) {
            uint8_t sc, m;
            k4_scale_min(j, x[b].scales, &sc, &m);
            const float dl = d * (float)sc, ml = dmin * (float)m;
            const uint8_t *q = x[b].qs + 32 * (j / 2);
            const int shift = 4 * (j % 2);
            for (int l = 0; l < 32; l++)
                y[32 * j + l] = dl * (float)((q[l] >> shift) & 15) - ml;
        }
    }
}

void duet__q4_K_from_f32(const float *x, void *vy, int64_t n) {
    duet_block_q4_K *y = vy;
    const affine_search s = {.nmax = 15, .rmin = -1.0f, .rdelta = 0.1f, .nstep = 20, .use_mad = false};
    for (int64_t b = 0; b < n / DUET_QK_K; b++, x += DUET_QK_K) {
        uint8_t L[DUET_QK_K];
        memset(y[b].scales, 0, sizeof y[b].scales);
        k45_quantize(x, 15, s, &y[b].d, &y[b].dmin, y[b].scales, L);
        for (int c = 0; c < 4; c++)
            for (int l = 0; l < 32; l++)
                y[b].qs[32 * c + l] = (uint8_t)(L[64 * c + l] | L[64 * c + 32 + l] << 4);
    }
}

void duet__q5_K_to_f32(const void *vx, float *y, int64_t n) {
    const duet_block_q5_K *x = vx;
    for (int64_t b = 0; b < n / DUET_QK_K; b++, y += DUET_QK_K) {
        const float d = fp16(x[b].d), dmin = fp16(x[b].dmin);
        for (int j = 0; j < 8; j++) {
            uint8_t sc, m;
            k4_scale_min(j, x[b].scales, &sc, &m);
            const float dl = d * (float)sc, ml = dmin * (float)m;
            const uint8_t *q = x[b].qs + 32 * (j / 2);
            const int shift = 4 * (j % 2);
            for (int l = 0; l < 32; l++) {
                const int v = ((q[l] >> shift) & 15) | ((x[b].qh[l] >> j) & 1) << 4;
                y[32 * j + l] = dl * (float)v - ml;
            }
        }
    }
}

void duet__q5_K_from_f32(const float *x, void *vy, int64_t n) {
    duet_block_q5_K *y = vy;
    const affine_search s = {.nmax = 31, .rmin = -0.5f, .rdelta = 0.1f, .nstep = 15, .use_mad = false};
    for (int64_t b = 0; b < n / DUET_QK_K; b++, x += DUET_QK_K) {
        uint8_t L[DUET_QK_K];
        memset(y[b].scales, 0, sizeof y[b].scales);
        k45_quantize(x, 31, s, &y[b].d, &y[b].dmin, y[b].scales, L);
        memset(y[b].qh, 0, sizeof y[b].qh);
        for (int i = 0; i < DUET_QK_K; i++)
            y[b].qh[i % 32] |= (uint8_t)((L[i] >> 4) << (i / 32));
        for (int c = 0; c < 4; c++)
            for (int l = 0; l < 32; l++)
                y[b].qs[32 * c + l] = (uint8_t)((L[64 * c + l] & 15) | (L[64 * c + 32 + l] & 15) << 4);
    }
}

/* ---- Q6_K --------------------------------------------------------------------- */

/* The 6-bit code (0..63) of weight i: its low nibble from ql, where weight
 * 128h + 32s + l sits in byte 64h + 32(s & 1) + l, nibble s >> 1; its top
 * 2 bits at bits 2s of qh[32h + l]. */
static int q6_K_code(const duet_block_q6_K *x, int i) {
    const int h = i / 128, s = i % 128 / 32, l = i % 32;
    const int lo = (x->ql[64 * h + 32 * (s & 1) + l] >> (4 * (s >> 1))) & 15;
    const int hi = (x->qh[32 * h + l] >> (2 * s)) & 3;
    return lo | hi << 4;
}

void duet__q6_K_to_f32(const void *vx, float *y, int64_t n) {
    const duet_block_q6_K *x = vx;
    for (int64_t b = 0; b < n / DUET_QK_K; b++, y += DUET_QK_K) {
        const float d = fp16(x[b].d);
        for (int i = 0; i < DUET_QK_K; i++)
            y[i] = d * (float)x[b].scales[i / 16] * (float)(q6_K_code(&x[b], i) - 32);
    }
}

static void q6_K_pack(const uint8_t *L, duet_block_q6_K *y) {
    memset(y->ql, 0, sizeof y->ql);
    memset(y->qh, 0, sizeof y->qh);
    for (int i = 0; i < DUET_QK_K; i++) {
        const int h = i / 128, s = i % 128 / 32, l = i % 32;
        y->ql[64 * h + 32 * (s & 1) + l] |= (uint8_t)((L[i] & 15) << (4 * (s >> 1)));
        y->qh[32 * h + l] |= (uint8_t)((L[i] >> 4) << (2 * s));
    }
}

void duet__q6_K_from_f32(const float *x, void *vy, int64_t n) {
    duet_block_q6_K *y = vy;
    for (int64_t b = 0; b < n / DUET_QK_K; b++, x += DUET_QK_K) {
        int8_t L[DUET_QK_K];
        float scales[16], amax;
        for (int j = 0; j < 16; j++)
            scales[j] = fit_symmetric(16, 32, x + 16 * j, L + 16 * j);
        const float max_scale = signed_absmax(scales, 16, &amax);
        memset(&y[b], 0, sizeof y[b]);
        if (amax < GROUP_EPS) continue;
        const float iscale = -128.0f / max_scale;
        y[b].d = to_fp16(1 / iscale);
        for (int j = 0; j < 16; j++)
            y[b].scales[j] = (int8_t)imin(127, nearest_int(iscale * scales[j]));
        for (int j = 0; j < 16; j++) {
            const float d = fp16(y[b].d) * (float)y[b].scales[j];
            if (d == 0.0f) continue;
            for (int i = 0; i < 16; i++)
                L[16 * j + i] = (int8_t)(imax(-32, imin(31, nearest_int(x[16 * j + i] / d))) + 32);
        }
        q6_K_pack((const uint8_t *)L, &y[b]);
    }
}

/* ---- Q8_K (activations) ------------------------------------------------------- */

void duet_quantize_row_q8_K(const float *x, duet_block_q8_K *y, int64_t n) {
    for (int64_t b = 0; b < n / DUET_QK_K; b++, x += DUET_QK_K) {
        float amax;
        const float max = signed_absmax(x, DUET_QK_K, &amax);
        memset(&y[b], 0, sizeof y[b]);
        if (amax == 0.0f) continue;
        /* -127 (not -128) keeps every code in -127..127, which the int8
         * dot-product kernels rely on. */
        const float iscale = -127.0f / max;
        for (int i = 0; i < DUET_QK_K; i++)
            y[b].qs[i] = (int8_t)imin(127, nearest_int(iscale * x[i]));
        for (int j = 0; j < DUET_QK_K / 16; j++) {
            int sum = 0;
            for (int i = 0; i < 16; i++)
                sum += y[b].qs[16 * j + i];
            y[b].bsums[j] = (int16_t)sum;
        }
        y[b].d = 1 / iscale;
    }
}

void duet__q8_K_to_f32(const void *vx, float *y, int64_t n) {
    const duet_block_q8_K *x = vx;
    for (int64_t b = 0; b < n / DUET_QK_K; b++, y += DUET_QK_K)
        for (int i = 0; i < DUET_QK_K; i++)
            y[i] = x[b].d * (float)x[b].qs[i];
}

void duet__q8_K_from_f32(const float *x, void *y, int64_t n) {
    duet_quantize_row_q8_K(x, y, n);
}

/* ---- IQ4_NL, IQ4_XS -------------------------------------------------------------- */

/* The index of the level nearest v (ties to the upper one): the number of
 * midpoints between consecutive levels that v reaches, by bisection. */
static inline int iq4_index(float v) {
    const float v2 = v + v;
    int idx = 0;
    for (int step = 8; step > 0; step >>= 1)
        if (v2 >= (float)(duet_iq4nl_values[idx + step - 1] + duet_iq4nl_values[idx + step])) idx += step;
    return idx;
}

/* The scale of one 32-weight sub-block on the non-linear grid, weights
 * x^2: the least-squares scale for the levels chosen at d = max/127, then
 * for 15 other candidate scales around -max/127 (the grid is asymmetric,
 * so both signs are tried); the best fit wins. */
static float iq4_fit(const float *x) {
    float amax;
    const float max = signed_absmax(x, 32, &amax);
    if (amax < GROUP_EPS) return 0.0f;
    float d = 0.0f, best = 0.0f;
    for (int t = -8; t <= 7; t++) {
        /* t == -8 is the first guess; then -7..7 levels of the search. */
        const float id =
            t == -8 ? 1.0f / (-max / (float)duet_iq4nl_values[0]) : (t + duet_iq4nl_values[0]) / max;
        float sumqx = 0.0f, sumq2 = 0.0f;
        for (int j = 0; j < 32; j++) {
            const float q = duet_iq4nl_values[iq4_index(id * x[j])], w = x[j] * x[j];
            sumqx += w * q * x[j];
            sumq2 += w * q * q;
        }
        if (t == -8) {
            d = sumq2 > 0 ? sumqx / sumq2 : 0.0f;
            best = d * sumqx;
        } else if (sumq2 > 0 && sumqx * sumqx > best * sumq2) {
            d = sumqx / sumq2;
            best = d * sumqx;
        }
    }
    return d;
}

static void iq4_pack(const float *x, float d, uint8_t *qs) {
    const float id = d != 0.0f ? 1 / d : 0.0f;
    for (int j = 0; j < 16; j++)
        qs[j] = (uint8_t)(iq4_index(id * x[j]) | iq4_index(id * x[j + 16]) << 4);
}

static void iq4_to_f32(const uint8_t *qs, float d, float *y) {
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)duet_iq4nl_values[qs[j] & 15];
        y[j + 16] = d * (float)duet_iq4nl_values[qs[j] >> 4];
    }
}

void duet__iq4_nl_to_f32(const void *vx, float *y, int64_t n) {
    const duet_block_iq4_nl *x = vx;
    for (int64_t b = 0; b < n / DUET_QK4_NL; b++, y += DUET_QK4_NL)
        iq4_to_f32(x[b].qs, fp16(x[b].d), y);
}

void duet__iq4_nl_from_f32(const float *x, void *vy, int64_t n) {
    duet_block_iq4_nl *y = vy;
    for (int64_t b = 0; b < n / DUET_QK4_NL; b++, x += DUET_QK4_NL) {
        const float d = iq4_fit(x);
        y[b].d = to_fp16(d);
        iq4_pack(x, d, y[b].qs); /* against the unrounded scale, as llama.cpp does */
    }
}

void duet__iq4_xs_to_f32(const void *vx, float *y, int64_t n) {
    const duet_block_iq4_xs *x = vx;
    for (int64_t b = 0; b < n / DUET_QK_K; b++, y += DUET_QK_K) {
        const float d = fp16(x[b].d);
        for (int ib = 0; ib < 8; ib++) {
            const int ls =
                ((x[b].scales_l[ib / 2] >> (4 * (ib % 2))) & 15) | ((x[b].scales_h >> (2 * ib)) & 3) << 4;
            iq4_to_f32(x[b].qs + 16 * ib, d * (float)(ls - 32), y + 32 * ib);
        }
    }
}

void duet__iq4_xs_from_f32(const float *x, void *vy, int64_t n) {
    duet_block_iq4_xs *y = vy;
    for (int64_t b = 0; b < n / DUET_QK_K; b++, x += DUET_QK_K) {
        float scales[8], amax;
        for (int ib = 0; ib < 8; ib++)
            scales[ib] = iq4_fit(x + 32 * ib);
        /* The sub-block scales on a 6-bit grid, the largest at -32. */
        const float d = -signed_absmax(scales, 8, &amax) / 32;
        const float id = d != 0.0f ? 1 / d : 0.0f;
        y[b].d = to_fp16(d);
        y[b].scales_h = 0;
        memset(y[b].scales_l, 0, sizeof y[b].scales_l);
        for (int ib = 0; ib < 8; ib++) {
            const int l = imax(-32, imin(31, nearest_int(id * scales[ib])));
            iq4_pack(x + 32 * ib, d * (float)l, y[b].qs + 16 * ib);
            y[b].scales_l[ib / 2] |= (uint8_t)(((l + 32) & 15) << (4 * (ib % 2)));
            y[b].scales_h |= (uint16_t)(((l + 32) >> 4) << (2 * ib));
        }
    }
}
