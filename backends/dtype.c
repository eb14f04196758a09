/* dtype.c — element types: sizes, names, fp16/bf16 conversions and the Q8_0
 * row format (the other block formats live in quants.c). Portable scalar
 * code: these run at load time and in tests;
 * the hot paths in backends use their own SIMD conversions, which round the
 * same way (nearest even), so results agree bit for bit. */
#include <math.h>
#include <string.h>

#include "backend.h"

/* Row converters of the type table (n elements, a multiple of the block). */
static void f32_to_f32(const void *x, float *y, int64_t n) {
    memmove(y, x, (size_t)n * sizeof(float));
}
static void f16_to_f32(const void *x, float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        y[i] = duet_fp16_to_fp32(((const uint16_t *)x)[i]);
}
static void bf16_to_f32(const void *x, float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        y[i] = duet_bf16_to_fp32(((const uint16_t *)x)[i]);
}
static void q8_0_to_f32(const void *x, float *y, int64_t n) {
    for (int64_t b = 0; b < n / DUET_QK8_0; b++) {
        const duet_block_q8_0 *blk = (const duet_block_q8_0 *)x + b;
        const float d = duet_fp16_to_fp32(blk->d);
        for (int j = 0; j < DUET_QK8_0; j++)
            y[b * DUET_QK8_0 + j] = d * (float)blk->qs[j];
    }
}
static void i32_to_f32(const void *x, float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        y[i] = (float)((const int32_t *)x)[i];
}
static void f32_from_f32(const float *x, void *y, int64_t n) {
    memmove(y, x, (size_t)n * sizeof(float));
}
static void f16_from_f32(const float *x, void *y, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        ((uint16_t *)y)[i] = duet_fp32_to_fp16(x[i]);
}
static void bf16_from_f32(const float *x, void *y, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        ((uint16_t *)y)[i] = duet_fp32_to_bf16(x[i]);
}
static void q8_0_from_f32(const float *x, void *y, int64_t n) {
    duet_quantize_row_q8_0(x, y, n);
}
/* Not a conversion target (the header leaves i32 out); kept
 * defined: truncation toward zero, saturated. */
static void i32_from_f32(const float *x, void *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const float v = x[i];
        ((int32_t *)y)[i] = v != v                ? 0
                            : v >= 2147483520.0f  ? INT32_MAX
                            : v <= -2147483648.0f ? INT32_MIN
                                                  : (int32_t)v;
    }
}

/* The type table: everything the HAL knows about an element type is one
 * row here, so a new weight type is a row, its two converters, and each
 * backend's kernels. */
typedef struct dtype_traits {
    const char *name;
    int block;           /* elements per block */
    size_t block_bytes;  /* bytes per block */
    bool weight;         /* a type a weight may have */
    bool q8_activations; /* its matmuls can read q8_0 activations (x_q8) */
    void (*to_f32)(const void *x, float *y, int64_t n);
    void (*from_f32)(const float *x, void *y, int64_t n);
} dtype_traits;

/* A block format's row: its block, weight type or not, and quants.c's two
 * converters. Every weight block is a multiple of 32 values, so its
 * matmuls read q8_0 activations (the cpu kernels do; a backend without a
 * kernel for the type refuses the matmul in supports_op altogether). */
#define BLOCK_ROW(name, blk, w, fn)                                                                          \
    { name, blk, sizeof(duet_block_##fn), w, w, duet__##fn##_to_f32, duet__##fn##_from_f32 }

static const dtype_traits traits[] = {
    [DUET_DTYPE_F32] = {"f32", 1, 4, true, false, f32_to_f32, f32_from_f32},
    [DUET_DTYPE_F16] = {"f16", 1, 2, true, false, f16_to_f32, f16_from_f32},
    [DUET_DTYPE_Q4_0] = BLOCK_ROW("q4_0", DUET_QK4_0, true, q4_0),
    [DUET_DTYPE_Q4_1] = BLOCK_ROW("q4_1", DUET_QK4_1, true, q4_1),
    [DUET_DTYPE_Q5_0] = BLOCK_ROW("q5_0", DUET_QK5_0, true, q5_0),
    [DUET_DTYPE_Q5_1] = BLOCK_ROW("q5_1", DUET_QK5_1, true, q5_1),
    [DUET_DTYPE_Q8_0] = {"q8_0", DUET_QK8_0, sizeof(duet_block_q8_0), true, true, q8_0_to_f32, q8_0_from_f32},
    [DUET_DTYPE_Q2_K] = BLOCK_ROW("q2_k", DUET_QK_K, true, q2_K),
    [DUET_DTYPE_Q3_K] = BLOCK_ROW("q3_k", DUET_QK_K, true, q3_K),
    [DUET_DTYPE_Q4_K] = BLOCK_ROW("q4_k", DUET_QK_K, true, q4_K),
    [DUET_DTYPE_Q5_K] = BLOCK_ROW("q5_k", DUET_QK_K, true, q5_K),
    [DUET_DTYPE_Q6_K] = BLOCK_ROW("q6_k", DUET_QK_K, true, q6_K),
    [DUET_DTYPE_Q8_K] = BLOCK_ROW("q8_k", DUET_QK_K, false, q8_K),
    [DUET_DTYPE_IQ4_NL] = BLOCK_ROW("iq4_nl", DUET_QK4_NL, true, iq4_nl),
    [DUET_DTYPE_IQ4_XS] = BLOCK_ROW("iq4_xs", DUET_QK_K, true, iq4_xs),
    [DUET_DTYPE_I32] = {"i32", 1, 4, false, false, i32_to_f32, i32_from_f32},
    [DUET_DTYPE_BF16] = {"bf16", 1, 2, true, false, bf16_to_f32, bf16_from_f32},
};

/* The row of t, or NULL for a type the table does not have. */
static const dtype_traits *traits_of(duet_dtype t) {
    return (unsigned)t < sizeof traits / sizeof traits[0] && traits[t].name ? &traits[t] : NULL;
}

int duet_dtype_block(duet_dtype t) {
    const dtype_traits *tr = traits_of(t);
    return tr ? tr->block : 0;
}

size_t duet_dtype_block_bytes(duet_dtype t) {
    const dtype_traits *tr = traits_of(t);
    return tr ? tr->block_bytes : 0;
}

/* 0 for an unknown type, a negative n or n not a multiple of the block: a
 * caller that sizes a buffer from it then fails its bounds check instead of
 * running past the end. */
size_t duet_dtype_row_bytes(duet_dtype t, int64_t n) {
    int blk = duet_dtype_block(t);
    if (blk == 0 || n < 0 || n % blk != 0) return 0;
    return (size_t)(n / blk) * duet_dtype_block_bytes(t);
}

const char *duet_dtype_name(duet_dtype t) {
    const dtype_traits *tr = traits_of(t);
    return tr ? tr->name : NULL;
}

bool duet_dtype_is_weight(duet_dtype t) {
    const dtype_traits *tr = traits_of(t);
    return tr && tr->weight;
}

bool duet_dtype_is_packed_quant(duet_dtype t) {
    const dtype_traits *tr = traits_of(t);
    return tr && tr->weight && tr->block > 1 && tr->block_bytes < (size_t)tr->block;
}

bool duet_dtype_takes_q8_activations(duet_dtype t) {
    const dtype_traits *tr = traits_of(t);
    return tr && tr->q8_activations;
}

/* ---- fp16 / bf16 --------------------------------------------------------- */

static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float f32_from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

float duet_fp16_to_fp32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f;
    uint32_t mant = h & 0x3ff;
    if (exp == 0x1f) /* inf, or NaN with its payload kept in the top bits */
        return f32_from_bits(sign | 0x7f800000u | (mant << 13));
    if (exp == 0) {
        if (mant == 0) return f32_from_bits(sign);
        /* Subnormal: mant * 2^-24, exact in f32. */
        float v = (float)mant * 0x1p-24f;
        return f32_from_bits(sign | f32_bits(v));
    }
    return f32_from_bits(sign | ((exp + 112) << 23) | (mant << 13));
}

uint16_t duet_fp32_to_fp16(float f) {
    uint32_t u = f32_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000);
    uint32_t a = u & 0x7fffffffu;
    if (a >= 0x7f800000u) {
        /* inf stays inf; NaN stays NaN (quiet bit set, top payload bits kept,
         * as F16C's vcvtps2ph does). */
        if (a == 0x7f800000u) return sign | 0x7c00;
        return (uint16_t)(sign | 0x7e00 | ((a >> 13) & 0x3ff));
    }
    if (a >= 0x477ff000u) return sign | 0x7c00; /* >= 65520 rounds to inf */
    if (a < 0x38800000u) {
        /* Below the smallest normal (2^-14): a subnormal or zero. Scaling by
         * 2^24 is exact and the f32 -> int rounding below is done by hand. */
        if (a < 0x33000000u) return sign; /* < 2^-25: rounds to zero (ties too) */
        uint32_t e = a >> 23;
        uint32_t m = (a & 0x7fffff) | 0x800000; /* value = m * 2^(e-150) */
        int shift = (int)(126 - e);             /* to units of 2^-24: 150-24-e */
        uint32_t q = m >> shift;
        uint32_t rem = m & ((1u << shift) - 1);
        uint32_t half = 1u << (shift - 1);
        if (rem > half || (rem == half && (q & 1))) q++;
        return (uint16_t)(sign | q); /* q may carry into the smallest normal */
    }
    /* Normal: rebias the exponent and round the 13 dropped bits to nearest
     * even; a carry out of the mantissa correctly bumps the exponent. */
    uint32_t r = a + 0xfff + ((a >> 13) & 1);
    return (uint16_t)(sign | ((r - 0x38000000u) >> 13));
}

float duet_bf16_to_fp32(uint16_t h) {
    return f32_from_bits((uint32_t)h << 16);
}

uint16_t duet_fp32_to_bf16(float f) {
    uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) /* NaN: truncating could make it inf */
        return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fff + ((u >> 16) & 1); /* nearest even; overflow carries to inf */
    return (uint16_t)(u >> 16);
}

/* ---- rows ------------------------------------------------------------------ */

void duet_quantize_row_q8_0(const float *x, duet_block_q8_0 *y, int64_t n) {
    for (int64_t b = 0; b < n / DUET_QK8_0; b++) {
        const float *xb = x + b * DUET_QK8_0;
        float amax = 0.0f;
        for (int j = 0; j < DUET_QK8_0; j++) {
            float a = fabsf(xb[j]);
            if (a > amax) amax = a; /* NaN never wins */
        }
        /* GGUF's convention: d = amax/127, q = round(x/d), ties away from 0. */
        float d = amax / 127.0f;
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        y[b].d = duet_fp32_to_fp16(d);
        for (int j = 0; j < DUET_QK8_0; j++) {
            float v = roundf(xb[j] * id);
            /* Clamp so that inf/NaN inputs give defined int8s, not UB. */
            if (!(v >= -127.0f)) v = v != v ? 0.0f : -127.0f;
            if (v > 127.0f) v = 127.0f;
            y[b].qs[j] = (int8_t)v;
        }
    }
}

void duet_dequantize_row(duet_dtype t, const void *x, float *y, int64_t n) {
    const dtype_traits *tr = traits_of(t);
    if (tr) tr->to_f32(x, y, n);
}

void duet_convert_row(duet_dtype t, const float *x, void *y, int64_t n) {
    const dtype_traits *tr = traits_of(t);
    if (tr) tr->from_f32(x, y, n);
}
