/* test_cpu_ops.c — the cpu backend's own shapes against the oracle.
 *
 * The shared case table (test_backend_ops) runs the cpu backend on every
 * SIMD path too; here are the shapes the cpu kernels are built around:
 * widths around the 8- and 16-wide SIMD steps and the 4-row/4-token tiles,
 * block counts the avx512 kernel pairs, token counts that cross the thread
 * splits, attention batches that cross tiles and splits at large scales,
 * and bit-for-bit batch invariance. Each runs on every SIMD path this
 * machine has (forced with $DUET_CPU_ISA) and on 1, 2 and 3 threads, and is
 * compared with the oracle (op_oracle.h) by normalised mean squared error
 * with a per-type bound. Outputs live between guard bytes that must come
 * back untouched; non-finite values fail unless expected. The dtype helpers
 * are checked exhaustively where the domain is 2^16. */
#include <float.h>
#include <math.h>
#include <stdint.h>

#include "../backends/backend.h"
#include "op_oracle.h"
#include "test_util.h"

/* ---- helpers ------------------------------------------------------------- */

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint64_t rng_next(void) { /* splitmix64 */
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static float rng_uniform(float lo, float hi) { return lo + (hi - lo) * (float)((rng_next() >> 40) * 0x1p-24); }
static int rng_int(int n) { return (int)(rng_next() % (uint64_t)n); }
static void fill_uniform(float *x, size_t n, float lo, float hi) {
    for (size_t i = 0; i < n; i++) x[i] = rng_uniform(lo, hi);
}

static float f32_of(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static uint32_t bits_of(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

/* A backend configuration: SIMD path and thread count. */
typedef struct cfg {
    const char *isa;
    int threads;
} cfg;

static const cfg CONFIGS[] = {
    {"scalar", 1}, {"scalar", 2}, {"avx2", 1}, {"avx2", 3}, {"avx512", 1}, {"avx512", 2}, {"avx512", 3},
};
#define N_CONFIGS ((int)(sizeof CONFIGS / sizeof CONFIGS[0]))

/* Opens the cpu backend on a forced path; false if this CPU lacks it (the
 * backend then reports a lower path in its driver string). */
static bool open_cfg(cfg c, duet_backend **be) {
    setenv("DUET_CPU_ISA", c.isa, 1);
    duet_backend_params p = {.n_threads = c.threads};
    duet_status st = duet_backend_open("cpu", 0, &p, be);
    unsetenv("DUET_CPU_ISA");
    ck_assert_msg(st == DUET_OK, "open cpu (%s, %d threads): %s", c.isa, c.threads, duet_last_error());
    char want[64];
    snprintf(want, sizeof want, "duet-cpu/%s", c.isa);
    if (strcmp((*be)->info.driver, want) != 0) {
        duet_backend_close(*be);
        *be = NULL;
        return false;
    }
    return true;
}

static duet_buffer *mkbuf(duet_backend *be, const void *data, size_t bytes) {
    duet_buffer *b = NULL;
    ck_assert_msg(duet_buffer_alloc(be, bytes, &b) == DUET_OK, "alloc %zu: %s", bytes, duet_last_error());
    if (data) ck_assert_msg(duet_buffer_upload(be, b, 0, data, bytes) == DUET_OK, "upload: %s", duet_last_error());
    return b;
}

/* The plain RoPE table of base for n_rot dims (n_rot <= 1024), as a buffer. */
static duet_buffer *freqs_buf(duet_backend *be, float base, int n_rot) {
    float f[512];
    oracle_rope_freqs(base, n_rot, f);
    return mkbuf(be, f, sizeof(float) * (size_t)(n_rot / 2 > 0 ? n_rot / 2 : 1));
}

/* Output buffers: GUARD bytes of 0xa5 on both sides of the payload. */
#define GUARD 64
typedef struct gbuf {
    duet_buffer *buf;
    size_t bytes;
} gbuf;

static gbuf gbuf_new(duet_backend *be, size_t bytes, const void *init) {
    gbuf g = {NULL, bytes};
    uint8_t *h = malloc(bytes + 2 * GUARD);
    memset(h, 0xa5, bytes + 2 * GUARD);
    if (init) memcpy(h + GUARD, init, bytes);
    g.buf = mkbuf(be, h, bytes + 2 * GUARD);
    free(h);
    return g;
}

static duet_view gview(gbuf g) { return (duet_view){g.buf, GUARD}; }

static void gbuf_read(duet_backend *be, gbuf g, void *dst, const char *what) {
    uint8_t *h = malloc(g.bytes + 2 * GUARD);
    ck_assert(duet_buffer_download(be, g.buf, 0, h, g.bytes + 2 * GUARD) == DUET_OK);
    for (size_t i = 0; i < GUARD; i++) {
        ck_assert_msg(h[i] == 0xa5, "%s: guard byte %zu before the output was overwritten", what, GUARD - i);
        ck_assert_msg(h[GUARD + g.bytes + i] == 0xa5, "%s: guard byte %zu after the output was overwritten", what, i);
    }
    memcpy(dst, h + GUARD, g.bytes);
    free(h);
}

static duet_status run_op(duet_backend *be, const duet_op *op) {
    duet_status st = duet_step_begin(be);
    if (st != DUET_OK) return st;
    st = duet_step_op(be, op);
    duet_status s2 = duet_step_submit(be);
    duet_status s3 = duet_step_wait(be);
    return st != DUET_OK ? st : s2 != DUET_OK ? s2 : s3;
}

#define RUN_OK(be, op, ...)                                                                  \
    do {                                                                                     \
        duet_status st_ = run_op(be, op);                                                    \
        if (st_ != DUET_OK) {                                                                \
            char m_[512];                                                                    \
            snprintf(m_, sizeof m_, __VA_ARGS__);                                            \
            ck_abort_msg("%s: %s (%s)", m_, duet_status_name(st_), duet_last_error());       \
        }                                                                                    \
    } while (0)

/* NMSE of got against ref, failing on non-finite values where ref is finite. */
static void check_nmse(const float *got, const double *ref, size_t n, double tol, const char *what) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        /* Plain ifs in per-element loops: every ck_assert reports to the
         * parent process, which is slow over millions of elements. */
        if (!isfinite(got[i]) && isfinite(ref[i]))
            ck_abort_msg("%s: element %zu is %g, reference %g", what, i, (double)got[i], ref[i]);
        double e = (double)got[i] - ref[i];
        num += e * e;
        den += ref[i] * ref[i];
    }
    double nmse = num / (den > 1e-300 ? den : 1e-300);
    ck_assert_msg(nmse <= tol, "%s: NMSE %.3g exceeds %.1g", what, nmse, tol);
}

/* q8_0 blocks against the blocks they should be: scales and quants may
 * differ by one step (a kernel may round its own f32 row a hair
 * differently), no more. */
static void check_q8_blocks(const duet_block_q8_0 *got, const duet_block_q8_0 *want, int64_t nb,
                            const char *what) {
    for (int64_t b = 0; b < nb; b++) {
        if (abs((int)got[b].d - (int)want[b].d) > 1)
            ck_abort_msg("%s: block %lld scale %04x, want %04x", what, (long long)b, got[b].d, want[b].d);
        for (int j = 0; j < 32; j++)
            if (abs(got[b].qs[j] - want[b].qs[j]) > 1)
                ck_abort_msg("%s: block %lld quant %d is %d, want %d", what, (long long)b, j, got[b].qs[j],
                             want[b].qs[j]);
    }
}

/* A fused q8_0 output against duet_quantize_row_q8_0 of the f32 values it
 * was made from (the definition in backend.h). */
static void check_q8(const duet_block_q8_0 *got, const float *f32, int64_t n, const char *what) {
    duet_block_q8_0 *want = malloc(sizeof *want * (size_t)(n / 32));
    duet_quantize_row_q8_0(f32, want, n);
    check_q8_blocks(got, want, n / 32, what);
    free(want);
}

/* ck_assert for loops of millions of checks: each ck_assert reports to the
 * parent process, this one only on failure. */
#define FAST_ASSERT(cond, ...)                                                                                         \
    do {                                                                                                               \
        if (!(cond)) ck_abort_msg(__VA_ARGS__);                                                                        \
    } while (0)

/* Values of a dtype row as the kernels see them (exact dequantization). */
static void to_dtype_and_back(duet_dtype t, const float *x, void *packed, float *back, int64_t n) {
    duet_convert_row(t, x, packed, n);
    duet_dequantize_row(t, packed, back, n);
}

/* ---- dtype helpers ------------------------------------------------------- */

START_TEST(test_dtype_sizes) {
    ck_assert_int_eq(duet_dtype_block(DUET_DTYPE_Q8_0), 32);
    ck_assert_int_eq(duet_dtype_block(DUET_DTYPE_F16), 1);
    ck_assert_uint_eq(duet_dtype_block_bytes(DUET_DTYPE_Q8_0), 34);
    ck_assert_uint_eq(duet_dtype_block_bytes(DUET_DTYPE_BF16), 2);
    ck_assert_uint_eq(duet_dtype_block_bytes(DUET_DTYPE_I32), 4);
    ck_assert_uint_eq(duet_dtype_row_bytes(DUET_DTYPE_Q8_0, 4096), 128 * 34);
    ck_assert_uint_eq(duet_dtype_row_bytes(DUET_DTYPE_F32, 7), 28);
    ck_assert_msg(duet_dtype_row_bytes(DUET_DTYPE_Q8_0, 33) == 0, "q8_0 row of 33 must report 0 bytes (invalid)");
    ck_assert_msg(duet_dtype_row_bytes((duet_dtype)5, 32) == 0, "unknown dtype must report 0 bytes");
    ck_assert_str_eq(duet_dtype_name(DUET_DTYPE_Q8_0), "q8_0");
    ck_assert_str_eq(duet_dtype_name(DUET_DTYPE_BF16), "bf16");
    ck_assert_ptr_null(duet_dtype_name((duet_dtype)99));
    ck_assert(duet_dtype_is_weight(DUET_DTYPE_F16) && !duet_dtype_is_weight(DUET_DTYPE_I32));
}
END_TEST

/* Independent decoding of an fp16 bit pattern through ldexp. */
static double fp16_value(uint16_t h) {
    int e = (h >> 10) & 31, m = h & 1023;
    double v = e == 0 ? ldexp(m, -24) : ldexp(1024 + m, e - 25);
    return (h & 0x8000) ? -v : v;
}

START_TEST(test_fp16_exhaustive) {
    for (uint32_t h = 0; h < 65536; h++) {
        float f = duet_fp16_to_fp32((uint16_t)h);
        bool special = ((h >> 10) & 31) == 31;
        if (special && (h & 1023)) {
            FAST_ASSERT(isnan(f), "fp16 %04x should decode to NaN, got %g", h, (double)f);
            uint16_t back = duet_fp32_to_fp16(f);
            FAST_ASSERT((back & 0x7c00) == 0x7c00 && (back & 0x3ff) && (back & 0x8000) == (h & 0x8000),
                          "fp16 NaN %04x re-encoded as %04x", h, back);
            continue;
        }
        if (special) FAST_ASSERT(isinf(f) && (f < 0) == ((h & 0x8000) != 0), "fp16 %04x should be inf", h);
        else FAST_ASSERT((double)f == fp16_value((uint16_t)h), "fp16 %04x decoded to %.9g, expected %.9g", h,
                           (double)f, fp16_value((uint16_t)h));
        FAST_ASSERT(duet_fp32_to_fp16(f) == h, "fp16 %04x -> %.9g -> %04x does not round-trip", h, (double)f,
                      duet_fp32_to_fp16(f));
    }
}
END_TEST

START_TEST(test_fp16_rounding) {
    /* Between every two adjacent finite fp16 magnitudes: the midpoint (exact
     * in f32) goes to the even one, anything off the midpoint to the nearer. */
    for (uint32_t h = 0; h < 0x7c00; h++) {
        for (int s = 0; s < 2; s++) {
            uint16_t lo = (uint16_t)(h | (s << 15)), hi = (uint16_t)((h + 1) | (s << 15));
            /* fp16_value(0x7c00) is 65536: the overflow threshold is a midpoint too. */
            float mid = (float)((fp16_value(lo) + fp16_value(hi)) / 2);
            uint16_t even = (lo & 1) ? hi : lo;
            FAST_ASSERT(duet_fp32_to_fp16(mid) == even, "midpoint %.9g of %04x/%04x gave %04x, want %04x",
                          (double)mid, lo, hi, duet_fp32_to_fp16(mid), even);
            float toward_hi = nextafterf(mid, s ? -INFINITY : INFINITY);
            float toward_lo = nextafterf(mid, 0.0f);
            FAST_ASSERT(duet_fp32_to_fp16(toward_hi) == hi, "%.9g should round to %04x", (double)toward_hi, hi);
            FAST_ASSERT(duet_fp32_to_fp16(toward_lo) == lo, "%.9g should round to %04x", (double)toward_lo, lo);
        }
    }
    ck_assert_uint_eq(duet_fp32_to_fp16(65519.0f), 0x7bff);
    ck_assert_uint_eq(duet_fp32_to_fp16(65520.0f), 0x7c00);
    ck_assert_uint_eq(duet_fp32_to_fp16(1e10f), 0x7c00);
    ck_assert_uint_eq(duet_fp32_to_fp16(-INFINITY), 0xfc00);
    ck_assert_uint_eq(duet_fp32_to_fp16(0x1p-25f), 0x0000);         /* tie to even: zero */
    ck_assert_uint_eq(duet_fp32_to_fp16(nextafterf(0x1p-25f, 1)), 1); /* just above: smallest subnormal */
    ck_assert_uint_eq(duet_fp32_to_fp16(-0.0f), 0x8000);
    ck_assert_uint_eq(duet_fp32_to_fp16(FLT_MIN), 0);
    uint16_t n = duet_fp32_to_fp16(f32_of(0x7f800001)); /* NaN with only a low payload bit */
    FAST_ASSERT((n & 0x7c00) == 0x7c00 && (n & 0x3ff), "NaN became %04x", n);
}
END_TEST

#if defined(__x86_64__)
#include <immintrin.h>
__attribute__((target("f16c"))) static uint16_t hw_fp16(float f) { return (uint16_t)_cvtss_sh(f, 0); }

/* The hardware converter as an oracle over a sweep of all f32 bit patterns. */
START_TEST(test_fp16_vs_f16c) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2")) return; /* f16c comes with every avx2 cpu */
    for (uint64_t u = 0; u < (1ull << 32); u += 251) {
        float f = f32_of((uint32_t)u);
        uint16_t a = duet_fp32_to_fp16(f), b = hw_fp16(f);
        FAST_ASSERT(a == b, "f32 %08x: duet %04x, f16c %04x", (uint32_t)u, a, b);
    }
}
END_TEST
#endif

START_TEST(test_bf16) {
    for (uint32_t h = 0; h < 65536; h++) {
        float f = duet_bf16_to_fp32((uint16_t)h);
        FAST_ASSERT(bits_of(f) == h << 16, "bf16 %04x decoded to %08x", h, bits_of(f));
        uint16_t back = duet_fp32_to_bf16(f);
        if (isnan(f)) {
            FAST_ASSERT((back & 0x7f80) == 0x7f80 && (back & 0x7f), "bf16 NaN %04x became %04x", h, back);
            continue;
        }
        FAST_ASSERT(back == h, "bf16 %04x does not round-trip (%04x)", h, back);
        if ((h & 0x7fff) >= 0x7f80) continue; /* no finite neighbour above inf */
        /* The midpoint to the next magnitude is exact in f32: ties to even. */
        uint32_t mid = (h << 16) | 0x8000;
        uint16_t up = (uint16_t)(h + 1), even = (h & 1) ? up : (uint16_t)h;
        FAST_ASSERT(duet_fp32_to_bf16(f32_of(mid)) == even, "bf16 midpoint %08x gave %04x, want %04x", mid,
                      duet_fp32_to_bf16(f32_of(mid)), even);
        FAST_ASSERT(duet_fp32_to_bf16(f32_of(mid + 1)) == up, "bf16 above midpoint %08x", mid);
        FAST_ASSERT(duet_fp32_to_bf16(f32_of(mid - 1)) == h, "bf16 below midpoint %08x", mid);
    }
    ck_assert_uint_eq(duet_fp32_to_bf16(FLT_MAX), 0x7f80); /* rounds up to inf */
    uint16_t n = duet_fp32_to_bf16(f32_of(0x7f800001));     /* payload only in the low half */
    FAST_ASSERT((n & 0x7f80) == 0x7f80 && (n & 0x7f), "NaN became %04x (must stay NaN)", n);
}
END_TEST

START_TEST(test_q8_0_rows) {
    enum { N = 32 * 64 };
    float *x = malloc(N * sizeof(float)), *y = malloc(N * sizeof(float));
    duet_block_q8_0 *q = malloc(N / 32 * sizeof *q);
    for (int rep = 0; rep < 20; rep++) {
        float scale = powf(10.0f, (float)(rep % 7) - 3.0f);
        fill_uniform(x, N, -scale, scale);
        if (rep == 1) memset(x, 0, 32 * sizeof(float)); /* an all-zero block */
        if (rep == 2) x[5] = 0.0f, x[6] = -3.0f * scale;  /* the extreme value is negative */
        duet_quantize_row_q8_0(x, q, N);
        duet_dequantize_row(DUET_DTYPE_Q8_0, q, y, N);
        for (int b = 0; b < N / 32; b++) {
            float amax = 0;
            for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[b * 32 + j]));
            float d = amax / 127.0f, d16 = duet_fp16_to_fp32(q[b].d);
            FAST_ASSERT(q[b].d == duet_fp32_to_fp16(d), "block %d: d %04x, want fp16(amax/127)", b, q[b].d);
            /* Rounding leaves at most d/2; storing d in fp16 adds 127|d - d16|. */
            float bound = 0.5f * d + 127.0f * fabsf(d - d16) + 1e-30f;
            for (int j = 0; j < 32; j++) {
                int i = b * 32 + j;
                FAST_ASSERT(q[b].qs[j] >= -127 && q[b].qs[j] <= 127, "q out of range");
                FAST_ASSERT(fabsf(y[i] - x[i]) <= bound * 1.0001f, "rep %d elem %d: %g -> %g (bound %g)", rep, i,
                              (double)x[i], (double)y[i], (double)bound);
                FAST_ASSERT(y[i] == d16 * (float)q[b].qs[j], "dequantize must be d * q");
            }
            if (amax > 0) {
                int jmax = 0;
                for (int j = 1; j < 32; j++)
                    if (fabsf(x[b * 32 + j]) > fabsf(x[b * 32 + jmax])) jmax = j;
                FAST_ASSERT(abs(q[b].qs[jmax]) == 127, "the largest element must map to +-127");
            }
        }
    }
    /* Non-finite inputs give defined quants (no UB), finite others unharmed. */
    fill_uniform(x, 64, -1, 1);
    x[3] = NAN;
    x[40] = INFINITY;
    duet_quantize_row_q8_0(x, q, 64);
    ck_assert(q[0].qs[3] == 0);
    /* convert_row agrees with the scalar converters. */
    uint16_t h[64];
    duet_convert_row(DUET_DTYPE_F16, x, h, 64);
    ck_assert_uint_eq(h[7], duet_fp32_to_fp16(x[7]));
    duet_convert_row(DUET_DTYPE_BF16, x, h, 64);
    ck_assert_uint_eq(h[9], duet_fp32_to_bf16(x[9]));
    free(x);
    free(y);
    free(q);
}
END_TEST

/* ---- device -------------------------------------------------------------- */

START_TEST(test_device_info) {
    const duet_backend_iface *cpu = duet_backend_find("cpu");
    ck_assert_ptr_nonnull(cpu);
    char why[128] = "";
    ck_assert(cpu->available(why, sizeof why));
    ck_assert_int_eq(cpu->device_count(), 1);
    duet_device_info info;
    ck_assert_int_eq(cpu->device_info(0, &info), DUET_OK);
    ck_assert_int_eq(info.type, DUET_DEVICE_HOST);
    ck_assert_msg(info.name[0] && info.vendor[0], "name/vendor empty");
    ck_assert_msg(info.memory_bytes > 0 && info.compute_units > 0, "memory/compute units unknown");
    ck_assert_int_ne(cpu->device_info(1, &info), DUET_OK);
    for (int i = 0; i < N_CONFIGS; i++) {
        duet_backend *be;
        if (!open_cfg(CONFIGS[i], &be)) continue;
        ck_assert_int_eq(be->info.compute_units, CONFIGS[i].threads);
        const char *want = strcmp(CONFIGS[i].isa, "avx512") == 0 ? "avx512_vnni"
                           : strcmp(CONFIGS[i].isa, "avx2") == 0 ? "avx2 fma f16c"
                                                                 : "scalar";
        ck_assert_msg(strstr(be->info.features, want), "features '%s' should list %s", be->info.features, want);
        duet_buffer *b = mkbuf(be, "abcdefgh", 8);
        char *hp = be->iface->buffer_host_ptr(be, b);
        ck_assert_msg(hp && (uintptr_t)hp % 64 == 0 && memcmp(hp, "abcdefgh", 8) == 0,
                      "buffer_host_ptr must give the 64-byte aligned buffer memory");
        duet_buffer_free(be, b);
        duet_backend_close(be);
    }
}
END_TEST

/* ---- matmul -------------------------------------------------------------- */

typedef struct mm_case {
    int n_in, n_out, n_tokens;
} mm_case;

/* xq8: the activations go in as q8_0 blocks (x_q8) instead of f32 x. The
 * reference is the oracle's; the per-output bound allows for the rounding of
 * the activations to q8_0 when the backend quantises them itself. */
static void run_matmul_case_x(duet_backend *be, cfg c, duet_dtype dt, mm_case mc, bool bias, bool accumulate,
                              bool xq8) {
    const int n_in = mc.n_in, n_out = mc.n_out, nt = mc.n_tokens;
    float *w = malloc(sizeof(float) * n_in * n_out), *wref = malloc(sizeof(float) * n_in * n_out);
    size_t row = duet_dtype_row_bytes(dt, n_in);
    uint8_t *wp = malloc(row * n_out);
    fill_uniform(w, (size_t)n_in * n_out, -1, 1);
    for (int o = 0; o < n_out; o++) to_dtype_and_back(dt, w + (size_t)o * n_in, wp + o * row, wref + (size_t)o * n_in, n_in);
    float *x = malloc(sizeof(float) * n_in * nt), *b = malloc(sizeof(float) * n_out);
    float *init = malloc(sizeof(float) * n_out * nt), *got = malloc(sizeof(float) * n_out * nt);
    float *want = malloc(sizeof(float) * n_out * nt);
    double *ref = malloc(sizeof(double) * n_out * nt), *bound = malloc(sizeof(double) * n_out * nt);
    fill_uniform(x, (size_t)n_in * nt, -2, 2);
    fill_uniform(b, n_out, -1, 1);
    fill_uniform(init, (size_t)n_out * nt, -3, 3);
    duet_block_q8_0 *xq = NULL;
    if (xq8) {
        xq = malloc(sizeof *xq * (n_in / 32) * nt);
        for (int t = 0; t < nt; t++)
            to_dtype_and_back(DUET_DTYPE_Q8_0, x + (size_t)t * n_in, xq + (size_t)t * (n_in / 32), x + (size_t)t * n_in, n_in);
    }
    memcpy(want, init, sizeof(float) * n_out * nt);
    oracle_matmul(wp, dt, xq8 ? NULL : x, xq, bias ? b : NULL, accumulate, nt, n_in, n_out, want);
    for (int t = 0; t < nt; t++)
        for (int o = 0; o < n_out; o++) {
            double q8err = 0, mag = 0, s = want[(size_t)t * n_out + o];
            for (int i = 0; i < n_in; i++) {
                double wi = wref[(size_t)o * n_in + i], xi = x[(size_t)t * n_in + i];
                mag += fabs(wi * xi);
                if (i % 32 == 0) { /* x is quantized per 32: error <= amax/127/2 each */
                    double amax = 0;
                    for (int j = i; j < i + 32 && j < n_in; j++) amax = fmax(amax, fabs(x[(size_t)t * n_in + j]));
                    for (int j = i; j < i + 32 && j < n_in; j++) q8err += fabs(wref[(size_t)o * n_in + j]) * amax / 254;
                }
            }
            ref[(size_t)t * n_out + o] = s;
            /* Hard per-output bound: activation rounding (q8_0) plus f32 sums. */
            bound[(size_t)t * n_out + o] = (dt == DUET_DTYPE_Q8_0 && !xq8 ? q8err * 1.001 : 0) + 1e-5 * (mag + fabs(s)) + 1e-6;
        }
    /* Inputs at non-zero offsets inside larger buffers. */
    const size_t xbytes = xq8 ? sizeof *xq * (n_in / 32) * nt : sizeof(float) * n_in * nt;
    duet_buffer *wb = mkbuf(be, NULL, row * n_out + 128), *xb = mkbuf(be, NULL, xbytes + 64);
    ck_assert(duet_buffer_upload(be, wb, 64, wp, row * n_out) == DUET_OK);
    ck_assert(duet_buffer_upload(be, xb, xq8 ? 34 : 32, xq8 ? (const void *)xq : x, xbytes) == DUET_OK);
    duet_buffer *bb = bias ? mkbuf(be, b, sizeof(float) * n_out) : NULL;
    gbuf out = gbuf_new(be, sizeof(float) * n_out * nt, accumulate ? init : NULL);
    duet_op op = {.kind = DUET_OP_MATMUL, .n_tokens = nt};
    op.matmul.w = (duet_view){wb, 64};
    op.matmul.dtype = dt;
    if (xq8) op.matmul.x_q8 = (duet_view){xb, 34}; /* 2-byte aligned, not 4 */
    else op.matmul.x = (duet_view){xb, 32};
    op.matmul.bias = (duet_view){bb, 0};
    op.matmul.accumulate = accumulate;
    op.matmul.n_in = n_in;
    op.matmul.n_out = n_out;
    op.matmul.out = gview(out);
    char what[160];
    snprintf(what, sizeof what, "matmul %s%s %dx%d tokens %d bias %d acc %d [%s, %d threads]", duet_dtype_name(dt),
             xq8 ? " x_q8" : "", n_out, n_in, nt, bias, accumulate, c.isa, c.threads);
    RUN_OK(be, &op, "%s", what);
    gbuf_read(be, out, got, what);
    for (int i = 0; i < n_out * nt; i++)
        if (!(fabs(got[i] - ref[i]) <= bound[i]))
            ck_abort_msg("%s: output %d is %.7g, reference %.7g, bound %.3g", what, i, (double)got[i], ref[i], bound[i]);
    /* Q8_0 quantizes the activations to 8 bits (relative error ~1/254 per
     * element): NMSE ~1e-5 over enough outputs. The float paths only differ
     * in summation order. */
    if (dt != DUET_DTYPE_Q8_0 || n_out * nt >= 64)
        check_nmse(got, ref, (size_t)n_out * nt, dt == DUET_DTYPE_Q8_0 && !xq8 ? 1e-4 : 1e-10, what);
    duet_buffer_free(be, wb);
    duet_buffer_free(be, xb);
    duet_buffer_free(be, bb);
    duet_buffer_free(be, out.buf);
    free(w), free(wref), free(wp), free(x), free(b), free(init), free(got), free(want), free(ref),
        free(bound), free(xq);
}

static void run_matmul_case(duet_backend *be, cfg c, duet_dtype dt, mm_case mc, bool bias, bool accumulate) {
    run_matmul_case_x(be, c, dt, mc, bias, accumulate, false);
}

START_TEST(test_matmul_float) {
    /* Ragged widths around the 8/16-wide SIMD steps and the 4-row/4-token
     * tiles; the last cases cross the threaded and the token-chunk paths. */
    static const mm_case cases[] = {
        {1, 1, 1},   {3, 5, 1},   {7, 3, 2},    {8, 4, 3},    {15, 4, 3},   {16, 8, 4},
        {17, 9, 5},  {33, 7, 1},  {100, 33, 7}, {257, 66, 9}, {64, 1, 17},  {768, 70, 1},
        {300, 130, 2}, {768, 6, 100},
    };
    static const duet_dtype dts[] = {DUET_DTYPE_F32, DUET_DTYPE_F16, DUET_DTYPE_BF16};
    for (int ci = 0; ci < N_CONFIGS; ci++) {
        duet_backend *be;
        if (!open_cfg(CONFIGS[ci], &be)) continue;
        for (int d = 0; d < 3; d++)
            for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++)
                run_matmul_case(be, CONFIGS[ci], dts[d], cases[k], (k + d) % 2 == 0, (k + d) % 3 == 1);
        duet_backend_close(be);
    }
}
END_TEST

START_TEST(test_matmul_q8_0) {
    /* n_in even and odd numbers of blocks (the avx512 kernel pairs blocks). */
    static const mm_case cases[] = {
        {32, 1, 1},  {64, 3, 1},   {96, 4, 2},   {160, 7, 3},  {32, 33, 4},  {768, 64, 1},
        {96, 9, 5},  {224, 17, 9}, {64, 5, 17},  {768, 70, 3}, {2048, 40, 1}, {768, 8, 350},
    };
    for (int ci = 0; ci < N_CONFIGS; ci++) {
        duet_backend *be;
        if (!open_cfg(CONFIGS[ci], &be)) continue;
        for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++)
            run_matmul_case(be, CONFIGS[ci], DUET_DTYPE_Q8_0, cases[k], k % 2 == 0, k % 3 == 1);
        duet_backend_close(be);
    }
}
END_TEST

/* INT8 activations: x_q8 blocks (as rmsnorm/swiglu/attention write them)
 * into q8_0 weights, int8 x int8 products against the exact dequantised
 * values; one token and batches, bias and accumulate. */
START_TEST(test_matmul_x_q8) {
    static const mm_case cases[] = {
        {32, 1, 1}, {64, 3, 1}, {96, 4, 2}, {160, 7, 3}, {768, 64, 1}, {224, 17, 9}, {768, 70, 3}, {2048, 40, 1}, {768, 8, 350},
    };
    for (int ci = 0; ci < N_CONFIGS; ci++) {
        duet_backend *be;
        if (!open_cfg(CONFIGS[ci], &be)) continue;
        for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++)
            run_matmul_case_x(be, CONFIGS[ci], DUET_DTYPE_Q8_0, cases[k], k % 2 == 0, k % 3 == 1, true);
        duet_backend_close(be);
    }
}
END_TEST

/* Weights at the int8 extreme -128 (legal in a file, never made by the
 * quantizer) and activations with outliers. */
START_TEST(test_matmul_q8_0_extremes) {
    enum { N_IN = 96, N_OUT = 5, NT = 3 };
    duet_block_q8_0 w[N_OUT * N_IN / 32];
    float x[NT * N_IN], got[NT * N_OUT], want[NT * N_OUT];
    double ref[NT * N_OUT];
    for (int i = 0; i < N_OUT * N_IN / 32; i++) {
        w[i].d = duet_fp32_to_fp16(0.01f * (float)(i + 1));
        for (int j = 0; j < 32; j++) w[i].qs[j] = (int8_t)(j % 3 == 0 ? -128 : (j * 37 % 255) - 127);
    }
    fill_uniform(x, NT * N_IN, -1, 1);
    x[10] = 50.0f;
    x[N_IN + 3] = -80.0f;
    oracle_matmul(w, DUET_DTYPE_Q8_0, x, NULL, NULL, false, NT, N_IN, N_OUT, want);
    for (int i = 0; i < NT * N_OUT; i++)
        ref[i] = want[i];
    for (int ci = 0; ci < N_CONFIGS; ci++) {
        duet_backend *be;
        if (!open_cfg(CONFIGS[ci], &be)) continue;
        duet_buffer *wb = mkbuf(be, w, sizeof w), *xb = mkbuf(be, x, sizeof x);
        gbuf out = gbuf_new(be, sizeof got, NULL);
        duet_op op = {.kind = DUET_OP_MATMUL, .n_tokens = NT};
        op.matmul.w = (duet_view){wb, 0};
        op.matmul.dtype = DUET_DTYPE_Q8_0;
        op.matmul.x = (duet_view){xb, 0};
        op.matmul.n_in = N_IN;
        op.matmul.n_out = N_OUT;
        op.matmul.out = gview(out);
        RUN_OK(be, &op, "q8_0 extremes [%s]", CONFIGS[ci].isa);
        gbuf_read(be, out, got, "q8_0 extremes");
        check_nmse(got, ref, NT * N_OUT, 1e-4, CONFIGS[ci].isa);
        duet_buffer_free(be, wb), duet_buffer_free(be, xb), duet_buffer_free(be, out.buf);
        duet_backend_close(be);
    }
}
END_TEST

/* ---- embed, rmsnorm, elementwise ----------------------------------------- */

START_TEST(test_embed) {
    static const duet_dtype dts[] = {DUET_DTYPE_F32, DUET_DTYPE_F16, DUET_DTYPE_BF16, DUET_DTYPE_Q8_0};
    static const int dims[] = {5, 32, 96, 2048};
    for (int ci = 0; ci < N_CONFIGS; ci++) {
        duet_backend *be;
        if (!open_cfg(CONFIGS[ci], &be)) continue;
        for (int d = 0; d < 4; d++)
            for (int k = 0; k < 4; k++) {
                duet_dtype dt = dts[d];
                int dim = dims[k], n_vocab = 37, nt = k == 3 ? 20 : 6;
                if (dim % duet_dtype_block(dt)) continue;
                size_t row = duet_dtype_row_bytes(dt, dim);
                float *tab = malloc(sizeof(float) * dim * n_vocab), *want = malloc(sizeof(float) * dim * nt);
                uint8_t *tp = malloc(row * n_vocab);
                fill_uniform(tab, (size_t)dim * n_vocab, -1, 1);
                for (int v = 0; v < n_vocab; v++)
                    duet_convert_row(dt, tab + (size_t)v * dim, tp + v * row, dim);
                int32_t tok[20];
                for (int t = 0; t < nt; t++) tok[t] = t == 0 ? 0 : t == 1 ? n_vocab - 1 : rng_int(n_vocab);
                oracle_embed(tok, nt, tp, dt, dim, want);
                duet_buffer *tb = mkbuf(be, tp, row * n_vocab), *kb = mkbuf(be, tok, sizeof(int32_t) * nt);
                gbuf out = gbuf_new(be, sizeof(float) * dim * nt, NULL);
                duet_op op = {.kind = DUET_OP_EMBED, .n_tokens = nt};
                op.embed.tokens = (duet_view){kb, 0};
                op.embed.table = (duet_view){tb, 0};
                op.embed.dtype = dt;
                op.embed.dim = dim;
                op.embed.out = gview(out);
                RUN_OK(be, &op, "embed %s dim %d", duet_dtype_name(dt), dim);
                float *got = malloc(sizeof(float) * dim * nt);
                gbuf_read(be, out, got, "embed");
                for (int t = 0; t < nt; t++)
                    ck_assert_msg(
                        memcmp(got + (size_t)t * dim, want + (size_t)t * dim, sizeof(float) * dim) == 0,
                        "embed %s dim %d token %d: row differs [%s]", duet_dtype_name(dt), dim, t,
                        CONFIGS[ci].isa);
                duet_buffer_free(be, tb), duet_buffer_free(be, kb), duet_buffer_free(be, out.buf);
                free(tab), free(want), free(tp), free(got);
            }
        duet_backend_close(be);
    }
}
END_TEST

START_TEST(test_rmsnorm) {
    static const int dims[] = {1, 7, 16, 17, 768, 4100};
    for (int ci = 0; ci < N_CONFIGS; ci++) {
        duet_backend *be;
        if (!open_cfg(CONFIGS[ci], &be)) continue;
        for (int k = 0; k < 6; k++)
            for (int inplace = 0; inplace < 2; inplace++) {
                int dim = dims[k], nt = k == 5 ? 9 : 1 + k % 4;
                float eps = 1e-5f;
                float *x = malloc(sizeof(float) * dim * nt), *w = malloc(sizeof(float) * dim);
                float *got = malloc(sizeof(float) * dim * nt);
                double *ref = malloc(sizeof(double) * dim * nt);
                fill_uniform(x, (size_t)dim * nt, -3, 3);
                fill_uniform(w, dim, 0.5f, 1.5f);
                oracle_rmsnorm(x, w, nt, dim, eps, got, NULL);
                for (int i = 0; i < dim * nt; i++)
                    ref[i] = got[i];
                gbuf out = gbuf_new(be, sizeof(float) * dim * nt, inplace ? x : NULL);
                duet_buffer *xb = inplace ? NULL : mkbuf(be, x, sizeof(float) * dim * nt), *wb = mkbuf(be, w, sizeof(float) * dim);
                duet_op op = {.kind = DUET_OP_RMSNORM, .n_tokens = nt};
                op.rmsnorm.x = inplace ? gview(out) : (duet_view){xb, 0};
                op.rmsnorm.w = (duet_view){wb, 0};
                op.rmsnorm.out = gview(out);
                op.rmsnorm.dim = dim;
                op.rmsnorm.eps = eps;
                char what[96];
                snprintf(what, sizeof what, "rmsnorm dim %d tokens %d inplace %d [%s, %d]", dim, nt, inplace,
                         CONFIGS[ci].isa, CONFIGS[ci].threads);
                RUN_OK(be, &op, "%s", what);
                gbuf_read(be, out, got, what);
                check_nmse(got, ref, (size_t)dim * nt, 1e-11, what);
                duet_buffer_free(be, xb), duet_buffer_free(be, wb), duet_buffer_free(be, out.buf);
                free(x), free(w), free(got), free(ref);
            }
        duet_backend_close(be);
    }
}
END_TEST

/* rmsnorm and swiglu with the fused q8_0 output, with and without the f32
 * out: the blocks must be the q8_0 of the f32 row (one step of slack), and
 * the f32 row must be unchanged by asking for blocks too. */
static void run_q8_out_case(duet_backend *be, cfg c, duet_op_kind kind, int dim, int nt, bool with_out) {
    size_t n = (size_t)dim * nt, nb = n / 32;
    float *a = malloc(sizeof(float) * n), *b = malloc(sizeof(float) * n), *w = malloc(sizeof(float) * dim);
    float *got = malloc(sizeof(float) * n), *reff = malloc(sizeof(float) * n);
    double *ref = malloc(sizeof(double) * n);
    duet_block_q8_0 *gq = malloc(sizeof *gq * nb), *wq = malloc(sizeof *wq * nb);
    fill_uniform(a, n, -3, 3);
    fill_uniform(b, n, -2, 2);
    fill_uniform(w, dim, 0.5f, 1.5f);
    if (nt > 1) memset(a + dim, 0, sizeof(float) * 32); /* an all-zero block: d = 0 */
    if (kind == DUET_OP_RMSNORM)
        oracle_rmsnorm(a, w, nt, dim, 1e-5f, reff, wq);
    else
        oracle_swiglu(a, b, nt, dim, reff, wq);
    for (size_t i = 0; i < n; i++)
        ref[i] = reff[i];
    duet_buffer *ab = mkbuf(be, a, sizeof(float) * n), *bb = mkbuf(be, b, sizeof(float) * n);
    duet_buffer *wb = mkbuf(be, w, sizeof(float) * dim);
    gbuf out = gbuf_new(be, sizeof(float) * n, NULL), q8 = gbuf_new(be, sizeof *gq * nb, NULL);
    duet_op op = {.kind = kind, .n_tokens = nt};
    duet_view ov = with_out ? gview(out) : (duet_view){NULL, 0};
    if (kind == DUET_OP_RMSNORM) {
        op.rmsnorm.x = (duet_view){ab, 0}, op.rmsnorm.w = (duet_view){wb, 0}, op.rmsnorm.out = ov;
        op.rmsnorm.out_q8 = gview(q8), op.rmsnorm.dim = dim, op.rmsnorm.eps = 1e-5f;
    } else {
        op.swiglu.gate = (duet_view){ab, 0}, op.swiglu.up = (duet_view){bb, 0}, op.swiglu.out = ov;
        op.swiglu.out_q8 = gview(q8), op.swiglu.dim = dim;
    }
    char what[128];
    snprintf(what, sizeof what, "%s out_q8 dim %d tokens %d with out %d [%s, %d threads]",
             kind == DUET_OP_RMSNORM ? "rmsnorm" : "swiglu", dim, nt, with_out, c.isa, c.threads);
    RUN_OK(be, &op, "%s", what);
    gbuf_read(be, q8, gq, what);
    gbuf_read(be, out, got, what); /* untouched (guard pattern) when absent */
    if (with_out) {
        check_nmse(got, ref, n, 1e-11, what);
        check_q8(gq, got, (int64_t)n, what);
    } else {
        for (size_t i = 0; i < n * 4; i++)
            if (((uint8_t *)got)[i] != 0xa5) ck_abort_msg("%s: the absent out was written (byte %zu)", what, i);
        check_q8_blocks(gq, wq, (int64_t)nb, what);
    }
    duet_buffer_free(be, ab), duet_buffer_free(be, bb), duet_buffer_free(be, wb);
    duet_buffer_free(be, out.buf), duet_buffer_free(be, q8.buf);
    free(a), free(b), free(w), free(got), free(reff), free(ref), free(gq), free(wq);
}

START_TEST(test_q8_outputs) {
    static const int dims[] = {32, 96, 768, 4096};
    for (int ci = 0; ci < N_CONFIGS; ci++) {
        duet_backend *be;
        if (!open_cfg(CONFIGS[ci], &be)) continue;
        for (int k = 0; k < 4; k++)
            for (int with_out = 0; with_out < 2; with_out++) {
                int nt = k == 3 ? 9 : 1 + k;
                run_q8_out_case(be, CONFIGS[ci], DUET_OP_RMSNORM, dims[k], nt, with_out);
                run_q8_out_case(be, CONFIGS[ci], DUET_OP_SWIGLU, dims[k], nt, with_out);
            }
        duet_backend_close(be);
    }
}
END_TEST

/* SWIGLU and ADD share shapes: ragged dims, one and many tokens, in place. */
static void run_elementwise(duet_backend *be, cfg c, duet_op_kind kind, int dim, int nt, int inplace) {
    size_t n = (size_t)dim * nt;
    float *a = malloc(sizeof(float) * n), *b = malloc(sizeof(float) * n), *got = malloc(sizeof(float) * n);
    double *ref = malloc(sizeof(double) * n);
    fill_uniform(a, n, -8, 8);
    fill_uniform(b, n, -2, 2);
    if (n > 4) a[0] = 100.0f, a[1] = -100.0f, a[2] = -1000.0f, a[3] = 88.9f; /* exp far out of range */
    float *want = malloc(sizeof(float) * n);
    if (kind == DUET_OP_ADD)
        oracle_add(a, b, nt, dim, want);
    else
        oracle_swiglu(a, b, nt, dim, want, NULL);
    for (size_t i = 0; i < n; i++)
        ref[i] = want[i];
    free(want);
    gbuf out = gbuf_new(be, sizeof(float) * n, inplace == 1 ? a : inplace == 2 ? b : NULL);
    duet_buffer *ab = mkbuf(be, a, sizeof(float) * n), *bb = mkbuf(be, b, sizeof(float) * n);
    duet_view av = inplace == 1 ? gview(out) : (duet_view){ab, 0}, bv = inplace == 2 ? gview(out) : (duet_view){bb, 0};
    duet_op op = {.kind = kind, .n_tokens = nt};
    if (kind == DUET_OP_ADD) op.add.a = av, op.add.b = bv, op.add.out = gview(out), op.add.dim = dim;
    else op.swiglu.gate = av, op.swiglu.up = bv, op.swiglu.out = gview(out), op.swiglu.dim = dim;
    char what[96];
    snprintf(what, sizeof what, "%s dim %d tokens %d inplace %d [%s, %d]", kind == DUET_OP_ADD ? "add" : "swiglu", dim,
             nt, inplace, c.isa, c.threads);
    RUN_OK(be, &op, "%s", what);
    gbuf_read(be, out, got, what);
    check_nmse(got, ref, n, kind == DUET_OP_ADD ? 1e-13 : 1e-11, what);
    duet_buffer_free(be, ab), duet_buffer_free(be, bb), duet_buffer_free(be, out.buf);
    free(a), free(b), free(got), free(ref);
}

START_TEST(test_elementwise) {
    static const int dims[] = {1, 7, 8, 15, 16, 17, 100, 2048, 5000};
    for (int ci = 0; ci < N_CONFIGS; ci++) {
        duet_backend *be;
        if (!open_cfg(CONFIGS[ci], &be)) continue;
        for (int k = 0; k < 9; k++)
            for (int kind = 0; kind < 2; kind++)
                run_elementwise(be, CONFIGS[ci], kind ? DUET_OP_ADD : DUET_OP_SWIGLU, dims[k], k >= 7 ? 8 : 1 + k % 3,
                                k % 3);
        duet_backend_close(be);
    }
}
END_TEST

START_TEST(test_gather_argmax) {
    for (int ci = 0; ci < N_CONFIGS; ci++) {
        duet_backend *be;
        if (!open_cfg(CONFIGS[ci], &be)) continue;
        /* gather: repeated and boundary rows, small and threaded sizes */
        for (int k = 0; k < 2; k++) {
            int dim = k ? 2048 : 5, n_rows = 10, nt = k ? 24 : 4;
            float *x = malloc(sizeof(float) * dim * n_rows), *got = malloc(sizeof(float) * dim * nt);
            fill_uniform(x, (size_t)dim * n_rows, -1, 1);
            int32_t rows[24];
            for (int t = 0; t < nt; t++) rows[t] = t == 0 ? n_rows - 1 : t == 1 ? 0 : rng_int(n_rows);
            duet_buffer *xb = mkbuf(be, x, sizeof(float) * dim * n_rows), *rb = mkbuf(be, rows, sizeof(int32_t) * nt);
            gbuf out = gbuf_new(be, sizeof(float) * dim * nt, NULL);
            duet_op op = {.kind = DUET_OP_GATHER_ROWS, .n_tokens = nt};
            op.gather.x = (duet_view){xb, 0};
            op.gather.rows = (duet_view){rb, 0};
            op.gather.out = gview(out);
            op.gather.dim = dim;
            RUN_OK(be, &op, "gather dim %d", dim);
            gbuf_read(be, out, got, "gather");
            float *want = malloc(sizeof(float) * dim * nt);
            oracle_gather_rows(x, rows, nt, dim, want);
            for (int t = 0; t < nt; t++)
                ck_assert_msg(memcmp(got + (size_t)t * dim, want + (size_t)t * dim, sizeof(float) * dim) == 0,
                              "gather row %d differs [%s]", t, CONFIGS[ci].isa);
            duet_buffer_free(be, xb), duet_buffer_free(be, rb), duet_buffer_free(be, out.buf);
            free(x), free(got), free(want);
        }
        /* argmax: ties go to the lowest index, NaN never wins, -inf rows */
        enum { DIM = 32000, NT = 5 };
        float *x = malloc(sizeof(float) * DIM * NT);
        fill_uniform(x, (size_t)DIM * NT, -5, 5);
        x[0 * DIM + 777] = 9.0f, x[0 * DIM + 31999] = 9.0f;   /* tie: 777 */
        x[1 * DIM + 0] = NAN, x[1 * DIM + 12345] = 7.5f;      /* NaN skipped */
        for (int j = 0; j < DIM; j++) x[2 * DIM + j] = -INFINITY; /* all -inf: 0 */
        x[3 * DIM + 31999] = 6.0f;                            /* last element */
        x[4 * DIM + 4] = 6.0f, x[4 * DIM + 5] = 6.0f;
        int32_t want[NT], got[NT];
        oracle_argmax(x, NT, DIM, want);
        /* What each row is there for (the oracle must say so too). */
        static const int32_t meant[NT] = {777, 12345, 0, 31999, 4};
        ck_assert_msg(memcmp(want, meant, sizeof want) == 0, "the oracle's argmax misreads the rows");
        for (int nt = 1; nt <= NT; nt += 4) {
            duet_buffer *xb = mkbuf(be, x, sizeof(float) * DIM * nt);
            gbuf out = gbuf_new(be, sizeof(int32_t) * nt, NULL);
            duet_op op = {.kind = DUET_OP_ARGMAX, .n_tokens = nt};
            op.argmax.x = (duet_view){xb, 0};
            op.argmax.out = gview(out);
            op.argmax.dim = DIM;
            RUN_OK(be, &op, "argmax");
            gbuf_read(be, out, got, "argmax");
            for (int t = 0; t < nt; t++)
                ck_assert_msg(got[t] == want[t], "argmax row %d: %d, want %d [%s]", t, got[t], want[t], CONFIGS[ci].isa);
            duet_buffer_free(be, xb), duet_buffer_free(be, out.buf);
        }
        free(x);
        duet_backend_close(be);
    }
}
END_TEST

/* ---- paged KV: rope_kv and attention -------------------------------------- */

/* The paged KV cache: the oracle's host model (op_oracle.h), its blocks
 * handed to sequences in a shuffled order with unused blocks mixed in, so a
 * kernel that ignores the table (or reads a neighbour block) gets different
 * values. Table entries past a sequence's blocks are -1: only entries
 * covering 0..pos may be read. Values uniform in [-1, 1). */
static oracle_kv paged_new(duet_dtype dt, int bs, int kw, int n_seqs, const int *lens, int spare) {
    int max_len = 1, need = 0;
    for (int s = 0; s < n_seqs; s++) {
        max_len = lens[s] > max_len ? lens[s] : max_len;
        need += (lens[s] + bs - 1) / bs;
    }
    oracle_kv p;
    oracle_kv_alloc(&p, dt, kw, bs, need + spare, n_seqs, (max_len + bs - 1) / bs + 1);
    oracle_kv_scatter(&p, lens, -1, rng_next());
    oracle_kv_fill(&p, rng_next(), 1.0f, 1.0f);
    return p;
}

/* The pool row of (sequence, position). */
static size_t paged_row(const oracle_kv *p, int seq, int pos) {
    int64_t r = oracle_kv_row(p, seq, pos);
    ck_assert_msg(r >= 0, "test bug: sequence %d position %d has no block", seq, pos);
    return (size_t)r;
}

/* Device copies; the k pool and the table sit at non-zero offsets. */
typedef struct paged_dev {
    duet_buffer *k, *v, *table;
} paged_dev;
#define KPOOL_OFF 128
#define TABLE_OFF 12

static paged_dev paged_upload(duet_backend *be, const oracle_kv *p) {
    paged_dev d;
    size_t tb = oracle_kv_table_bytes(p), pb = oracle_kv_pool_bytes(p);
    d.k = mkbuf(be, NULL, pb + KPOOL_OFF);
    ck_assert(duet_buffer_upload(be, d.k, KPOOL_OFF, p->k, pb) == DUET_OK);
    d.v = mkbuf(be, p->v, pb);
    d.table = mkbuf(be, NULL, tb + TABLE_OFF);
    ck_assert(duet_buffer_upload(be, d.table, TABLE_OFF, p->table, tb) == DUET_OK);
    return d;
}

static void paged_dev_free(duet_backend *be, paged_dev d) {
    duet_buffer_free(be, d.k), duet_buffer_free(be, d.v), duet_buffer_free(be, d.table);
}

static duet_kv_pages paged_view(const oracle_kv *p, paged_dev d) {
    return oracle_kv_pages(p, (duet_view){d.k, KPOOL_OFF}, (duet_view){d.v, 0},
                           (duet_view){d.table, TABLE_OFF});
}

/* The oracle's attention over the cache, as doubles for check_nmse. */
static void ref_attention(const oracle_kv *p, const float *q, const int32_t *pos, const int32_t *seq, int nt,
                          int nh, int nkv, int hd, float scale, double *out) {
    const size_t n = (size_t)nt * nh * hd;
    float *f = malloc(sizeof(float) * n);
    oracle_attention(q, pos, seq, nt, nh, nkv, hd, scale, 0, p, f, NULL);
    for (size_t i = 0; i < n; i++)
        out[i] = f[i];
    free(f);
}

typedef struct att_shape {
    int n_head, n_head_kv, hd;
} att_shape;

/* Output modes: f32 out, out + out_q8, out_q8 alone, out written over q. */
enum { OUT_F32, OUT_BOTH, OUT_Q8, OUT_INPLACE, OUT_MODES };
static const char *const OUT_NAMES[OUT_MODES] = {"out", "out+out_q8", "out_q8", "in-place"};

/* One attention op on a prepared cache, checked against ref (the double
 * reference for these q, pos, seq). */
static void check_attention(duet_backend *be, cfg c, const oracle_kv *p, paged_dev dev, att_shape sh,
                            const float *q, const int32_t *pos, const int32_t *seq, int nt, float scale,
                            const double *ref, int mode, double tol, const char *name) {
    const int qw = sh.n_head * sh.hd;
    const size_t n = (size_t)qw * nt, qbytes = sizeof(float) * n;
    if (mode == OUT_Q8 && qw % 32) mode = OUT_F32; /* no q8 output for this width */
    const bool q8 = (mode == OUT_BOTH || mode == OUT_Q8) && qw % 32 == 0;
    const size_t q8bytes = q8 ? sizeof(duet_block_q8_0) * n / 32 : 0;
    gbuf out = gbuf_new(be, qbytes, mode == OUT_INPLACE ? q : NULL);
    gbuf oq = gbuf_new(be, q8 ? q8bytes : 1, NULL);
    duet_buffer *qb = mode == OUT_INPLACE ? NULL : mkbuf(be, q, qbytes);
    duet_buffer *pb = mkbuf(be, pos, sizeof(int32_t) * nt), *sb = mkbuf(be, seq, sizeof(int32_t) * nt);
    duet_op op = {.kind = DUET_OP_ATTENTION, .n_tokens = nt};
    op.attention.q = mode == OUT_INPLACE ? gview(out) : (duet_view){qb, 0};
    op.attention.pos = (duet_view){pb, 0}, op.attention.seq = (duet_view){sb, 0};
    op.attention.kv = paged_view(p, dev);
    op.attention.n_head = sh.n_head, op.attention.n_head_kv = sh.n_head_kv, op.attention.head_dim = sh.hd;
    op.attention.scale = scale;
    if (mode != OUT_Q8) op.attention.out = gview(out);
    if (q8) op.attention.out_q8 = gview(oq);
    char what[256];
    snprintf(what, sizeof what, "attention %s heads %d/%d hd %d %s bs %d tokens %d %s [%s, %d threads]", name,
             sh.n_head, sh.n_head_kv, sh.hd, duet_dtype_name(p->dtype), p->block_size, nt, OUT_NAMES[mode],
             c.isa, c.threads);
    RUN_OK(be, &op, "%s", what);
    float *got = malloc(qbytes);
    gbuf_read(be, out, got, what);
    if (mode != OUT_Q8) check_nmse(got, ref, n, tol, what);
    if (q8) {
        duet_block_q8_0 *gq = malloc(q8bytes);
        gbuf_read(be, oq, gq, what);
        float *f = got;
        if (mode == OUT_Q8) {
            for (size_t i = 0; i < qbytes; i++)
                if (((uint8_t *)got)[i] != 0xa5) ck_abort_msg("%s: the absent out was written (byte %zu)", what, i);
            f = malloc(qbytes);
            for (size_t i = 0; i < n; i++) f[i] = (float)ref[i];
        }
        check_q8(gq, f, (int64_t)n, what);
        if (f != got) free(f);
        free(gq);
    }
    free(got);
    duet_buffer_free(be, qb), duet_buffer_free(be, pb), duet_buffer_free(be, sb);
    duet_buffer_free(be, out.buf), duet_buffer_free(be, oq.buf);
}

/* Sequences of a test cache: contexts 1, 7, 64, 1000, 4096, and a 40-token
 * one for prefill from position 0. */
static const int ATT_LENS[] = {1, 7, 64, 1000, 4096, 40};
#define ATT_NSEQ 6

typedef struct att_batch {
    const char *name;
    int n;
    int32_t seq[64], pos[64];
    float scale_mul;
} att_batch;

/* Decode at each context, prefill runs (one crossing tiles mid-sequence, one
 * from position 0), a ragged mix where one sequence's tokens come in two
 * runs, and a prefill chunk at the end of the 4096 context. */
static int make_batches(att_batch *b, bool long_prefill) {
    int nb = 0;
    for (int s = 0; s < 5; s++) {
        att_batch *x = &b[nb++];
        *x = (att_batch){.name = "decode", .n = 1, .scale_mul = s == 1 ? 200.0f : 1.0f};
        x->seq[0] = s, x->pos[0] = ATT_LENS[s] - 1;
    }
    att_batch *x = &b[nb++];
    *x = (att_batch){.name = "prefill 976..999", .n = 24, .scale_mul = 60.0f};
    for (int i = 0; i < 24; i++) x->seq[i] = 3, x->pos[i] = 976 + i;
    x = &b[nb++];
    *x = (att_batch){.name = "prefill 0..39", .n = 40, .scale_mul = 1.0f};
    for (int i = 0; i < 40; i++) x->seq[i] = 5, x->pos[i] = i;
    x = &b[nb++];
    *x = (att_batch){.name = "ragged", .n = 0, .scale_mul = 1.0f};
    static const int rs[] = {4, 5, 5, 5, 5, 5, 5, 0, 3, 5, 5, 5, 5, 1, 2};
    static const int rp[] = {4095, 30, 31, 32, 33, 34, 35, 0, 999, 36, 37, 38, 39, 6, 63};
    for (int i = 0; i < 15; i++) x->seq[i] = rs[i], x->pos[i] = rp[i];
    x->n = 15;
    if (long_prefill) {
        x = &b[nb++];
        *x = (att_batch){.name = "prefill 4064..4095", .n = 32, .scale_mul = 1.0f};
        for (int i = 0; i < 32; i++) x->seq[i] = 4, x->pos[i] = 4064 + i;
    }
    return nb;
}

/* Every shape x KV dtype x block size runs every batch on every SIMD path
 * and thread count; the reference is computed once per case. */
static void run_attention_shape(att_shape sh, duet_dtype dt, int bs, bool long_prefill) {
    const int kw = sh.n_head_kv * sh.hd, qw = sh.n_head * sh.hd;
    oracle_kv p = paged_new(dt, bs, kw, ATT_NSEQ, ATT_LENS, 5);
    att_batch batches[16];
    int nb = make_batches(batches, long_prefill);
    float *q[16];
    double *ref[16];
    for (int i = 0; i < nb; i++) {
        q[i] = malloc(sizeof(float) * qw * batches[i].n);
        ref[i] = malloc(sizeof(double) * qw * batches[i].n);
        fill_uniform(q[i], (size_t)qw * batches[i].n, -1, 1);
        float scale = batches[i].scale_mul / sqrtf((float)sh.hd);
        ref_attention(&p, q[i], batches[i].pos, batches[i].seq, batches[i].n, sh.n_head, sh.n_head_kv, sh.hd, scale,
                      ref[i]);
    }
    for (int ci = 0; ci < N_CONFIGS; ci++) {
        duet_backend *be;
        if (!open_cfg(CONFIGS[ci], &be)) continue;
        paged_dev dev = paged_upload(be, &p);
        for (int i = 0; i < nb; i++) {
            float scale = batches[i].scale_mul / sqrtf((float)sh.hd);
            /* Large scales amplify the f32 rounding of each score (~1e-7 |s|). */
            double tol = batches[i].scale_mul > 1 ? 1e-8 : 1e-10;
            check_attention(be, CONFIGS[ci], &p, dev, sh, q[i], batches[i].pos, batches[i].seq, batches[i].n, scale,
                            ref[i], (i + ci) % OUT_MODES, tol, batches[i].name);
        }
        /* The cache is an input: not one byte of it may change. */
        uint8_t *back = malloc(oracle_kv_pool_bytes(&p));
        ck_assert(duet_buffer_download(be, dev.k, KPOOL_OFF, back, oracle_kv_pool_bytes(&p)) == DUET_OK);
        ck_assert_msg(memcmp(back, p.k, oracle_kv_pool_bytes(&p)) == 0, "attention wrote to the k pool");
        ck_assert(duet_buffer_download(be, dev.v, 0, back, oracle_kv_pool_bytes(&p)) == DUET_OK);
        ck_assert_msg(memcmp(back, p.v, oracle_kv_pool_bytes(&p)) == 0, "attention wrote to the v pool");
        free(back);
        paged_dev_free(be, dev);
        duet_backend_close(be);
    }
    for (int i = 0; i < nb; i++) free(q[i]), free(ref[i]);
    oracle_kv_free(&p);
}

/* MHA (the 125m shape), GQA, MQA; head_dim 64 and 128 take the SIMD
 * kernels, 80 does too but its q8 output blocks straddle heads, 24 runs
 * scalar on every path. q8_0 KV needs head_dim % 32 == 0. */
START_TEST(test_attention_mha) {
    att_shape sh = {12, 12, 64};
    run_attention_shape(sh, DUET_DTYPE_F16, 16, true);
    run_attention_shape(sh, DUET_DTYPE_Q8_0, 32, false);
    run_attention_shape(sh, DUET_DTYPE_F32, 32, false);
}
END_TEST

START_TEST(test_attention_gqa) {
    att_shape sh = {8, 2, 64};
    run_attention_shape(sh, DUET_DTYPE_F32, 16, false);
    run_attention_shape(sh, DUET_DTYPE_F16, 32, false);
    run_attention_shape(sh, DUET_DTYPE_Q8_0, 16, true);
}
END_TEST

START_TEST(test_attention_mqa) {
    att_shape sh = {8, 1, 128};
    run_attention_shape(sh, DUET_DTYPE_Q8_0, 32, false);
    run_attention_shape(sh, DUET_DTYPE_F16, 16, false);
}
END_TEST

START_TEST(test_attention_odd_heads) {
    run_attention_shape((att_shape){6, 6, 80}, DUET_DTYPE_F16, 16, false);
    run_attention_shape((att_shape){4, 2, 24}, DUET_DTYPE_F32, 32, false);
    run_attention_shape((att_shape){6, 3, 32}, DUET_DTYPE_Q8_0, 16, false);
}
END_TEST

/* Batching must not change a token's attention, bit for bit: the engine
 * batches whatever is running and greedy decoding must not depend on it.
 * Each token alone (decode: context splits on 2-3 threads) against the
 * whole ragged batch (prefill tiles, no splits), on 1, 2 and 3 threads. */
static void run_invariance(att_shape sh, duet_dtype dt) {
    const int qw = sh.n_head * sh.hd;
    oracle_kv p = paged_new(dt, 16, sh.n_head_kv * sh.hd, ATT_NSEQ, ATT_LENS, 3);
    att_batch b[16];
    make_batches(b, false);
    att_batch *mix = &b[7]; /* ragged */
    float *q = malloc(sizeof(float) * qw * mix->n);
    fill_uniform(q, (size_t)qw * mix->n, -1, 1);
    float *first = malloc(sizeof(float) * qw * mix->n), *got = malloc(sizeof(float) * qw * mix->n);
    static const char *const isas[] = {"scalar", "avx2", "avx512"};
    for (int ii = 0; ii < 3; ii++)
        for (int threads = 1; threads <= 3; threads++) {
            duet_backend *be;
            if (!open_cfg((cfg){isas[ii], threads}, &be)) continue;
            paged_dev dev = paged_upload(be, &p);
            duet_buffer *qb = mkbuf(be, q, sizeof(float) * qw * mix->n), *ob = mkbuf(be, NULL, sizeof(float) * qw * mix->n);
            duet_buffer *pb = mkbuf(be, mix->pos, sizeof(int32_t) * mix->n), *sb = mkbuf(be, mix->seq, sizeof(int32_t) * mix->n);
            for (int alone = 0; alone < 2; alone++) {
                for (int t0 = 0; t0 < mix->n; t0 += alone ? 1 : mix->n) {
                    duet_op op = {.kind = DUET_OP_ATTENTION, .n_tokens = alone ? 1 : mix->n};
                    op.attention.q = (duet_view){qb, (size_t)t0 * qw * 4};
                    op.attention.pos = (duet_view){pb, (size_t)t0 * 4}, op.attention.seq = (duet_view){sb, (size_t)t0 * 4};
                    op.attention.kv = paged_view(&p, dev), op.attention.n_head = sh.n_head;
                    op.attention.n_head_kv = sh.n_head_kv, op.attention.head_dim = sh.hd, op.attention.scale = 0.125f;
                    op.attention.out = (duet_view){ob, (size_t)t0 * qw * 4};
                    RUN_OK(be, &op, "attention token %d", t0);
                }
                ck_assert(duet_buffer_download(be, ob, 0, got, sizeof(float) * qw * mix->n) == DUET_OK);
                if (threads == 1 && alone == 0) memcpy(first, got, sizeof(float) * qw * mix->n);
                for (int t = 0; t < mix->n; t++)
                    ck_assert_msg(memcmp(got + (size_t)t * qw, first + (size_t)t * qw, sizeof(float) * qw) == 0,
                                  "heads %d/%d %s [%s]: token %d (seq %d pos %d) %s on %d threads differs from the "
                                  "batch on 1 thread",
                                  sh.n_head, sh.n_head_kv, duet_dtype_name(dt), isas[ii], t, mix->seq[t], mix->pos[t],
                                  alone ? "alone" : "in the batch", threads);
            }
            duet_buffer_free(be, qb), duet_buffer_free(be, ob), duet_buffer_free(be, pb), duet_buffer_free(be, sb);
            paged_dev_free(be, dev);
            duet_backend_close(be);
        }
    free(q), free(first), free(got);
    oracle_kv_free(&p);
}

START_TEST(test_attention_batch_invariance) {
    run_invariance((att_shape){12, 12, 64}, DUET_DTYPE_Q8_0);
    run_invariance((att_shape){8, 2, 64}, DUET_DTYPE_F16);
    run_invariance((att_shape){8, 1, 128}, DUET_DTYPE_F32);
    run_invariance((att_shape){6, 6, 80}, DUET_DTYPE_F16);
}
END_TEST

/* ---- rope_kv -------------------------------------------------------------- */

typedef struct rope_case {
    int n_head, n_head_kv, head_dim, n_rot;
    bool neox;
    duet_dtype kvt;
    int n_tokens;
} rope_case;

static const rope_case ROPE_CASES[] = {
    {4, 4, 8, 8, false, DUET_DTYPE_F32, 5},      {4, 2, 16, 16, true, DUET_DTYPE_F16, 3},
    {8, 2, 64, 64, false, DUET_DTYPE_F16, 7},    {8, 2, 64, 32, true, DUET_DTYPE_F32, 2},
    {6, 3, 6, 6, false, DUET_DTYPE_F32, 4},      {4, 1, 32, 16, false, DUET_DTYPE_Q8_0, 1},
    {12, 12, 64, 64, false, DUET_DTYPE_Q8_0, 9}, {8, 4, 128, 128, true, DUET_DTYPE_Q8_0, 40},
    {8, 4, 80, 80, true, DUET_DTYPE_F16, 40},
};
static const int ROPE_LENS[3] = {64, 300, 200};

/* A prefill run in sequence 0, one deep token of sequence 1, a few of
 * sequence 2 (positions within ROPE_LENS). */
static void rope_positions(int nt, int32_t *pos, int32_t *seq) {
    int run = nt > 2 ? nt - 2 : nt;
    if (nt == 1) {
        seq[0] = 1, pos[0] = ROPE_LENS[1] - 1;
        return;
    }
    for (int t = 0; t < nt; t++) {
        if (t < run) seq[t] = 0, pos[t] = t;
        else if (t == run) seq[t] = 1, pos[t] = ROPE_LENS[1] - 1;
        else seq[t] = 2, pos[t] = 150 + t;
    }
}

/* The pools after rope_kv against `want` (the oracle's store of the
 * device's own rotated k and the input v): rows written exactly for f32,
 * the correctly rounded fp16 for f16, within a step of the q8_0 rule for
 * q8_0; every other row keeps its bytes. */
static void check_pools(const oracle_kv *want, const uint8_t *kc, const uint8_t *vc, const uint8_t *written,
                        const char *what) {
    const size_t rb = want->row_bytes, n_rows = (size_t)want->n_blocks * want->block_size;
    for (size_t r = 0; r < n_rows; r++)
        for (int which = 0; which < 2; which++) {
            const uint8_t *got = (which ? vc : kc) + r * rb, *w = (which ? want->v : want->k) + r * rb;
            if (written[r] && want->dtype == DUET_DTYPE_Q8_0)
                check_q8_blocks((const duet_block_q8_0 *)got, (const duet_block_q8_0 *)w, want->width / 32,
                                what);
            else if (memcmp(got, w, rb) != 0)
                ck_abort_msg("%s: %s pool row %zu %s", what, which ? "v" : "k", r,
                             written[r] ? "differs" : "changed but no token maps to it");
        }
}

START_TEST(test_rope_kv) {
    for (int ci = 0; ci < N_CONFIGS; ci++) {
        duet_backend *be;
        if (!open_cfg(CONFIGS[ci], &be)) continue;
        for (size_t k = 0; k < sizeof ROPE_CASES / sizeof ROPE_CASES[0]; k++) {
            rope_case rc = ROPE_CASES[k];
            int nt = rc.n_tokens, qw = rc.n_head * rc.head_dim, kw = rc.n_head_kv * rc.head_dim;
            oracle_kv p = paged_new(rc.kvt, k % 2 ? 32 : 16, kw, 3, ROPE_LENS, 3);
            float *q = malloc(sizeof(float) * qw * nt), *kk = malloc(sizeof(float) * kw * nt), *v = malloc(sizeof(float) * kw * nt);
            float *qg = malloc(sizeof(float) * qw * nt), *kg = malloc(sizeof(float) * kw * nt);
            double *qr = malloc(sizeof(double) * qw * nt), *kr = malloc(sizeof(double) * kw * nt);
            int32_t pos[64], seq[64];
            rope_positions(nt, pos, seq);
            fill_uniform(q, (size_t)qw * nt, -1, 1);
            fill_uniform(kk, (size_t)kw * nt, -1, 1);
            fill_uniform(v, (size_t)kw * nt, -1, 1);
            float base = k % 2 ? 500000.0f : 10000.0f;
            float *qt = malloc(sizeof(float) * qw * nt), *kt = malloc(sizeof(float) * kw * nt);
            memcpy(qt, q, sizeof(float) * qw * nt);
            memcpy(kt, kk, sizeof(float) * kw * nt);
            float fr[512];
            oracle_rope_freqs(base, rc.n_rot, fr);
            for (int t = 0; t < nt; t++) {
                oracle_rope(qt + t * qw, rc.n_head, rc.head_dim, rc.n_rot, fr, 0.0f, rc.neox, pos[t]);
                oracle_rope(kt + t * kw, rc.n_head_kv, rc.head_dim, rc.n_rot, fr, 0.0f, rc.neox, pos[t]);
            }
            for (int i = 0; i < qw * nt; i++) qr[i] = qt[i];
            for (int i = 0; i < kw * nt; i++) kr[i] = kt[i];
            gbuf qb = gbuf_new(be, sizeof(float) * qw * nt, q), kb = gbuf_new(be, sizeof(float) * kw * nt, kk);
            duet_buffer *vb = mkbuf(be, v, sizeof(float) * kw * nt), *pb = mkbuf(be, pos, sizeof(int32_t) * nt),
                        *sb = mkbuf(be, seq, sizeof(int32_t) * nt);
            paged_dev dev = paged_upload(be, &p);
            duet_op op = {.kind = DUET_OP_ROPE_KV, .n_tokens = nt};
            op.rope_kv.q = gview(qb), op.rope_kv.k = gview(kb), op.rope_kv.v = (duet_view){vb, 0};
            op.rope_kv.pos = (duet_view){pb, 0}, op.rope_kv.seq = (duet_view){sb, 0};
            op.rope_kv.kv = paged_view(&p, dev);
            op.rope_kv.n_head = rc.n_head, op.rope_kv.n_head_kv = rc.n_head_kv, op.rope_kv.head_dim = rc.head_dim;
            duet_buffer *fb = freqs_buf(be, base, rc.n_rot);
            op.rope_kv.n_rot = rc.n_rot, op.rope_kv.freqs = (duet_view){fb, 0}, op.rope_kv.neox = rc.neox;
            char what[128];
            snprintf(what, sizeof what, "rope_kv case %zu %s bs %d [%s, %d threads]", k,
                     duet_dtype_name(rc.kvt), p.block_size, CONFIGS[ci].isa, CONFIGS[ci].threads);
            RUN_OK(be, &op, "%s", what);
            gbuf_read(be, qb, qg, what);
            gbuf_read(be, kb, kg, what);
            check_nmse(qg, qr, (size_t)qw * nt, 1e-12, what);
            check_nmse(kg, kr, (size_t)kw * nt, 1e-12, what);
            /* The pools hold rotated k and plain v at the table's rows for
             * (seq, pos); every other row keeps its bytes. */
            uint8_t *kc = malloc(oracle_kv_pool_bytes(&p)), *vc = malloc(oracle_kv_pool_bytes(&p));
            ck_assert(duet_buffer_download(be, dev.k, KPOOL_OFF, kc, oracle_kv_pool_bytes(&p)) == DUET_OK);
            ck_assert(duet_buffer_download(be, dev.v, 0, vc, oracle_kv_pool_bytes(&p)) == DUET_OK);
            uint8_t *mark = calloc((size_t)p.n_blocks * p.block_size, 1);
            oracle_kv want;
            oracle_kv_clone(&want, &p);
            for (int t = 0; t < nt; t++) {
                mark[paged_row(&p, seq[t], pos[t])] = 1;
                oracle_kv_store(&want, seq[t], pos[t], kg + (size_t)t * kw, v + (size_t)t * kw);
            }
            check_pools(&want, kc, vc, mark, what);
            oracle_kv_free(&want);
            free(mark), free(kc), free(vc);
            paged_dev_free(be, dev);
            duet_buffer_free(be, qb.buf), duet_buffer_free(be, kb.buf), duet_buffer_free(be, vb);
            duet_buffer_free(be, pb), duet_buffer_free(be, sb), duet_buffer_free(be, fb);
            free(q), free(kk), free(v), free(qg), free(kg), free(qr), free(kr), free(qt), free(kt);
            oracle_kv_free(&p);
        }
        duet_backend_close(be);
    }
}
END_TEST

/* rope_kv then attention through one cache, as a forward pass runs them:
 * what rope_kv stores (q8_0 here) is what attention reads. */
START_TEST(test_rope_then_attention) {
    enum { NH = 8, NKV = 2, HD = 64, NT = 20 };
    const int lens[2] = {NT, 1};
    for (int ci = 0; ci < N_CONFIGS; ci++) {
        duet_backend *be;
        if (!open_cfg(CONFIGS[ci], &be)) continue;
        oracle_kv p = paged_new(DUET_DTYPE_Q8_0, 16, NKV * HD, 2, lens, 2);
        float q[NT * NH * HD], k[NT * NKV * HD], v[NT * NKV * HD], got[NT * NH * HD];
        int32_t pos[NT], seq[NT];
        for (int t = 0; t < NT; t++) pos[t] = t, seq[t] = 0;
        fill_uniform(q, sizeof q / 4, -1, 1);
        fill_uniform(k, sizeof k / 4, -1, 1);
        fill_uniform(v, sizeof v / 4, -1, 1);
        paged_dev dev = paged_upload(be, &p);
        duet_buffer *qb = mkbuf(be, q, sizeof q), *kb = mkbuf(be, k, sizeof k), *vb = mkbuf(be, v, sizeof v);
        duet_buffer *pb = mkbuf(be, pos, sizeof pos), *sb = mkbuf(be, seq, sizeof seq), *ob = mkbuf(be, NULL, sizeof got);
        duet_op rp = {.kind = DUET_OP_ROPE_KV, .n_tokens = NT};
        rp.rope_kv.q = (duet_view){qb, 0}, rp.rope_kv.k = (duet_view){kb, 0}, rp.rope_kv.v = (duet_view){vb, 0};
        rp.rope_kv.pos = (duet_view){pb, 0}, rp.rope_kv.seq = (duet_view){sb, 0}, rp.rope_kv.kv = paged_view(&p, dev);
        rp.rope_kv.n_head = NH, rp.rope_kv.n_head_kv = NKV, rp.rope_kv.head_dim = HD, rp.rope_kv.n_rot = HD;
        duet_buffer *fb = freqs_buf(be, 10000.0f, HD);
        rp.rope_kv.freqs = (duet_view){fb, 0};
        duet_op at = {.kind = DUET_OP_ATTENTION, .n_tokens = NT};
        at.attention.q = (duet_view){qb, 0}, at.attention.pos = (duet_view){pb, 0}, at.attention.seq = (duet_view){sb, 0};
        at.attention.kv = paged_view(&p, dev), at.attention.n_head = NH, at.attention.n_head_kv = NKV;
        at.attention.head_dim = HD, at.attention.scale = 0.125f, at.attention.out = (duet_view){ob, 0};
        ck_assert(duet_step_begin(be) == DUET_OK);
        ck_assert_msg(duet_step_op(be, &rp) == DUET_OK, "rope_kv: %s", duet_last_error());
        ck_assert_msg(duet_step_op(be, &at) == DUET_OK, "attention: %s", duet_last_error());
        ck_assert(duet_step_submit(be) == DUET_OK && duet_step_wait(be) == DUET_OK);
        /* Reference: the rotated q from the device, the pools as stored. */
        ck_assert(duet_buffer_download(be, qb, 0, q, sizeof q) == DUET_OK);
        ck_assert(duet_buffer_download(be, dev.k, KPOOL_OFF, p.k, oracle_kv_pool_bytes(&p)) == DUET_OK);
        ck_assert(duet_buffer_download(be, dev.v, 0, p.v, oracle_kv_pool_bytes(&p)) == DUET_OK);
        double ref[NT * NH * HD];
        ref_attention(&p, q, pos, seq, NT, NH, NKV, HD, 0.125f, ref);
        ck_assert(duet_buffer_download(be, ob, 0, got, sizeof got) == DUET_OK);
        check_nmse(got, ref, NT * NH * HD, 1e-10, CONFIGS[ci].isa);
        /* The values in the cache are within q8_0 error of the rotated k/v. */
        float vrow[NKV * HD];
        double vref[NKV * HD];
        oracle_kv_load(&p, p.v, (int64_t)paged_row(&p, 0, NT - 1), vrow);
        for (int i = 0; i < NKV * HD; i++) vref[i] = v[(NT - 1) * NKV * HD + i];
        check_nmse(vrow, vref, NKV * HD, 1e-4, "v row in q8_0");
        paged_dev_free(be, dev);
        duet_buffer *all[] = {qb, kb, vb, pb, sb, ob, fb};
        for (int i = 0; i < 7; i++)
            duet_buffer_free(be, all[i]);
        oracle_kv_free(&p);
        duet_backend_close(be);
    }
}
END_TEST

/* ---- attention memory ---------------------------------------------------------- */

/* Scratch after a 64-query prefill chunk ending at position ctx-1 and a
 * decode at ctx-1, on a fresh backend; also checks the outputs. */
static size_t attention_scratch_at(att_shape sh, int ctx) {
    const int kw = sh.n_head_kv * sh.hd, qw = sh.n_head * sh.hd;
    int len = ctx;
    oracle_kv p = paged_new(DUET_DTYPE_F16, 16, kw, 1, &len, 0);
    duet_backend *be;
    duet_backend_params prm = {.n_threads = 2};
    ck_assert(duet_backend_open("cpu", 0, &prm, &be) == DUET_OK);
    paged_dev dev = paged_upload(be, &p);
    enum { CHUNK = 64 };
    float *q = malloc(sizeof(float) * qw * CHUNK);
    fill_uniform(q, (size_t)qw * CHUNK, -1, 1);
    int32_t pos[CHUNK], seq[CHUNK] = {0};
    for (int i = 0; i < CHUNK; i++) pos[i] = ctx - CHUNK + i;
    /* Reference for the chunk's last token (which the decode repeats) and
     * a few other rows. */
    const int rows[] = {0, 21, CHUNK - 1};
    double *ref = malloc(sizeof(double) * qw);
    float scale = 1.0f / sqrtf((float)sh.hd);
    char name[64];
    for (int pass = 0; pass < 2; pass++) {
        int nt = pass ? 1 : CHUNK;
        const float *qp = pass ? q + (size_t)(CHUNK - 1) * qw : q;
        const int32_t *pp = pass ? pos + CHUNK - 1 : pos;
        duet_buffer *qb = mkbuf(be, qp, sizeof(float) * qw * nt), *pb = mkbuf(be, pp, sizeof(int32_t) * nt);
        duet_buffer *sb = mkbuf(be, seq, sizeof(int32_t) * nt), *ob = mkbuf(be, NULL, sizeof(float) * qw * nt);
        duet_buffer *o8 = mkbuf(be, NULL, sizeof(duet_block_q8_0) * qw / 32 * nt);
        duet_op op = {.kind = DUET_OP_ATTENTION, .n_tokens = nt};
        op.attention.q = (duet_view){qb, 0}, op.attention.pos = (duet_view){pb, 0}, op.attention.seq = (duet_view){sb, 0};
        op.attention.kv = paged_view(&p, dev), op.attention.n_head = sh.n_head, op.attention.n_head_kv = sh.n_head_kv;
        op.attention.head_dim = sh.hd, op.attention.scale = scale;
        op.attention.out = (duet_view){ob, 0}, op.attention.out_q8 = (duet_view){o8, 0};
        RUN_OK(be, &op, "attention at context %d (%d tokens)", ctx, nt);
        float *got = malloc(sizeof(float) * qw * nt);
        ck_assert(duet_buffer_download(be, ob, 0, got, sizeof(float) * qw * nt) == DUET_OK);
        for (int k = pass ? 2 : 0; k < 3; k++) {
            int t = rows[k];
            ref_attention(&p, q + (size_t)t * qw, pos + t, seq, 1, sh.n_head, sh.n_head_kv, sh.hd, scale, ref);
            snprintf(name, sizeof name, "context %d, %s, row %d", ctx, pass ? "decode" : "prefill", t);
            check_nmse(got + (size_t)(pass ? 0 : t) * qw, ref, qw, 1e-10, name);
        }
        free(got);
        duet_buffer_free(be, qb), duet_buffer_free(be, pb), duet_buffer_free(be, sb);
        duet_buffer_free(be, ob), duet_buffer_free(be, o8);
    }
    size_t scratch = duet_backend_scratch_bytes(be);
    paged_dev_free(be, dev);
    duet_backend_close(be);
    free(q), free(ref);
    oracle_kv_free(&p);
    return scratch;
}

/* The n x n score matrix never exists: scratch grows at most linearly with
 * the context (here not at all), and stays far below the 8192^2 * 4 bytes
 * = 256 MiB one head's score matrix would take. */
START_TEST(test_attention_memory) {
    static const att_shape shapes[] = {{12, 12, 64}, {8, 1, 128}};
    for (int i = 0; i < 2; i++) {
        size_t s2k = attention_scratch_at(shapes[i], 2048), s8k = attention_scratch_at(shapes[i], 8192);
        ck_assert_msg(s2k > 0, "scratch_bytes reports nothing after attention");
        ck_assert_msg((double)s8k <= 4.5 * (double)s2k,
                      "heads %d/%d: scratch grew from %zu bytes at context 2048 to %zu at 8192 (more than linear)",
                      shapes[i].n_head, shapes[i].n_head_kv, s2k, s8k);
        ck_assert_msg(s8k < ((size_t)64 << 20), "heads %d/%d: %zu bytes of scratch at context 8192", shapes[i].n_head,
                      shapes[i].n_head_kv, s8k);
    }
}
END_TEST

/* ---- validation ----------------------------------------------------------- */

static void expect_invalid(duet_backend *be, const duet_op *op, const char *name, const char *why) {
    duet_status st = run_op(be, op);
    ck_assert_msg(st == DUET_INVALID_ARGUMENT, "%s (%s): got %s, want DUET_INVALID_ARGUMENT", name, why,
                  duet_status_name(st));
    ck_assert_msg(strstr(duet_last_error(), name), "%s (%s): message '%s' does not name the op", name, why,
                  duet_last_error());
}

START_TEST(test_bounds) {
    duet_backend *be;
    ck_assert(open_cfg((cfg){"scalar", 2}, &be) || open_cfg((cfg){"scalar", 1}, &be));
    enum { N_IN = 64, N_OUT = 8 };
    size_t wq = duet_dtype_row_bytes(DUET_DTYPE_Q8_0, N_IN) * N_OUT;
    duet_buffer *w = mkbuf(be, NULL, wq), *x = mkbuf(be, NULL, 4 * N_IN * 2), *o = mkbuf(be, NULL, 4 * N_OUT * 2);
    duet_buffer *small = mkbuf(be, NULL, 16);
    uint8_t zeros[64 / 32 * 34 * N_OUT] = {0};
    ck_assert(duet_buffer_upload(be, w, 0, zeros, wq) == DUET_OK);
    duet_op mm = {.kind = DUET_OP_MATMUL, .n_tokens = 2};
    mm.matmul.w = (duet_view){w, 0}, mm.matmul.dtype = DUET_DTYPE_Q8_0, mm.matmul.x = (duet_view){x, 0};
    mm.matmul.n_in = N_IN, mm.matmul.n_out = N_OUT, mm.matmul.out = (duet_view){o, 0};
    RUN_OK(be, &mm, "the valid matmul");
    duet_op bad = mm;
    bad.matmul.n_out = N_OUT + 1;
    expect_invalid(be, &bad, "matmul", "w one row short");
    bad = mm, bad.n_tokens = 3;
    expect_invalid(be, &bad, "matmul", "x and out too small for 3 tokens");
    bad = mm, bad.matmul.out.offset = 4;
    expect_invalid(be, &bad, "matmul", "out runs 4 bytes past its buffer");
    bad = mm, bad.matmul.out.offset = SIZE_MAX - 2;
    expect_invalid(be, &bad, "matmul", "offset near SIZE_MAX");
    bad = mm, bad.matmul.x.offset = 2;
    expect_invalid(be, &bad, "matmul", "x misaligned");
    bad = mm, bad.matmul.n_in = 48;
    expect_invalid(be, &bad, "matmul", "n_in not a multiple of 32 for q8_0");
    bad = mm, bad.matmul.n_in = INT32_MAX - 31, bad.matmul.n_out = INT32_MAX;
    expect_invalid(be, &bad, "matmul", "dimensions whose byte count overflows");
    bad = mm, bad.matmul.bias = (duet_view){small, 0};
    expect_invalid(be, &bad, "matmul", "bias too small");
    bad = mm, bad.matmul.out = (duet_view){x, 0}, bad.matmul.n_out = N_IN / 2;
    bad.matmul.w = (duet_view){w, 0};
    expect_invalid(be, &bad, "matmul", "out overlaps x");
    bad = mm, bad.matmul.w.buf = NULL;
    expect_invalid(be, &bad, "matmul", "no buffer");
    bad = mm, bad.matmul.dtype = DUET_DTYPE_I32;
    ck_assert_int_eq(run_op(be, &bad), DUET_UNSUPPORTED);

    /* embed: token ids outside the table */
    int32_t toks[2] = {0, 5};
    duet_buffer *tk = mkbuf(be, toks, sizeof toks), *tab = mkbuf(be, NULL, 5 * 16 * 4), *eo = mkbuf(be, NULL, 2 * 16 * 4);
    duet_op em = {.kind = DUET_OP_EMBED, .n_tokens = 1};
    em.embed.tokens = (duet_view){tk, 0}, em.embed.table = (duet_view){tab, 0}, em.embed.dtype = DUET_DTYPE_F32;
    em.embed.dim = 16, em.embed.out = (duet_view){eo, 0};
    RUN_OK(be, &em, "the valid embed");
    em.n_tokens = 2;
    expect_invalid(be, &em, "embed", "token 5 of a 5-row table");
    toks[1] = -1;
    duet_buffer_upload(be, tk, 0, toks, sizeof toks);
    expect_invalid(be, &em, "embed", "negative token");
    em.n_tokens = 1, em.embed.dim = 33;
    expect_invalid(be, &em, "embed", "out too small for dim 33");

    /* rope_kv / attention: positions, sequences and pools outside the cache */
    enum { HD = 32, NH = 2, BS = 4, NB = 6, MB = 3 };
    int32_t pos[2] = {3, MB * BS}, seq[2] = {0, 0}, table[2 * MB] = {5, 0, 1, 2, 3, -1};
    duet_buffer *q = mkbuf(be, NULL, 2 * NH * HD * 4), *k = mkbuf(be, NULL, 2 * NH * HD * 4),
                *v = mkbuf(be, NULL, 2 * NH * HD * 4);
    duet_buffer *pb = mkbuf(be, pos, sizeof pos), *sb = mkbuf(be, seq, sizeof seq), *tb = mkbuf(be, table, sizeof table);
    /* kc has room past the k pool for a v pool placed over it */
    duet_buffer *kc = mkbuf(be, NULL, 2 * NB * BS * NH * HD * 4), *vc = mkbuf(be, NULL, NB * BS * NH * HD * 4);
    duet_kv_pages kv = {.k_pool = {kc, 0}, .v_pool = {vc, 0}, .block_table = {tb, 0}, .dtype = DUET_DTYPE_F32,
                        .block_size = BS, .n_blocks = NB, .n_seqs = 2, .max_blocks = MB};
    duet_op rp = {.kind = DUET_OP_ROPE_KV, .n_tokens = 1};
    rp.rope_kv.q = (duet_view){q, 0}, rp.rope_kv.k = (duet_view){k, 0}, rp.rope_kv.v = (duet_view){v, 0};
    rp.rope_kv.pos = (duet_view){pb, 0}, rp.rope_kv.seq = (duet_view){sb, 0}, rp.rope_kv.kv = kv;
    rp.rope_kv.n_head = NH, rp.rope_kv.n_head_kv = NH;
    duet_buffer *fb = freqs_buf(be, 10000, HD);
    rp.rope_kv.head_dim = HD, rp.rope_kv.n_rot = HD, rp.rope_kv.freqs = (duet_view){fb, 0};
    RUN_OK(be, &rp, "the valid rope_kv");
    rp.n_tokens = 2;
    expect_invalid(be, &rp, "rope_kv", "position max_blocks * block_size");
    pos[1] = 2, seq[1] = 2; /* the table has 2 sequences */
    duet_buffer_upload(be, pb, 0, pos, sizeof pos);
    duet_buffer_upload(be, sb, 0, seq, sizeof seq);
    expect_invalid(be, &rp, "rope_kv", "sequence 2 of a 2-sequence table");
    seq[1] = 1, pos[1] = 2 * BS; /* entry 2 of sequence 1 is -1 */
    duet_buffer_upload(be, pb, 0, pos, sizeof pos);
    duet_buffer_upload(be, sb, 0, seq, sizeof seq);
    expect_invalid(be, &rp, "rope_kv", "table entry -1");
    ck_assert_msg(strstr(duet_last_error(), "block table entry"), "message '%s' should name the table entry",
                  duet_last_error());
    rp.n_tokens = 1, rp.rope_kv.n_rot = 3;
    expect_invalid(be, &rp, "rope_kv", "odd n_rot");
    rp.rope_kv.n_rot = HD, rp.rope_kv.kv.v_pool.offset = 64;
    expect_invalid(be, &rp, "rope_kv", "v pool runs past its buffer at offset 64");
    rp.rope_kv.kv.v_pool.offset = 0, rp.rope_kv.kv.n_blocks = NB + 1;
    expect_invalid(be, &rp, "rope_kv", "pools one block short");
    rp.rope_kv.kv.n_blocks = NB, rp.rope_kv.kv.v_pool = (duet_view){kc, 4 * HD};
    expect_invalid(be, &rp, "rope_kv", "v pool overlapping the k pool");
    rp.rope_kv.kv.v_pool = (duet_view){vc, 0}, rp.rope_kv.kv.block_table.offset = 2;
    expect_invalid(be, &rp, "rope_kv", "misaligned block table");
    rp.rope_kv.kv.block_table.offset = 0, rp.rope_kv.kv.n_seqs = 3;
    expect_invalid(be, &rp, "rope_kv", "table of 3 sequences in a buffer of 2");
    rp.rope_kv.kv.n_seqs = 2, rp.rope_kv.v = (duet_view){kc, 0};
    expect_invalid(be, &rp, "rope_kv", "k pool overlapping the v input");

    duet_op at = {.kind = DUET_OP_ATTENTION, .n_tokens = 2};
    at.attention.q = (duet_view){q, 0}, at.attention.pos = (duet_view){pb, 0}, at.attention.seq = (duet_view){sb, 0};
    at.attention.kv = kv, at.attention.n_head = NH, at.attention.n_head_kv = NH;
    at.attention.head_dim = HD, at.attention.scale = 0.3f, at.attention.out = (duet_view){k, 0};
    expect_invalid(be, &at, "attention", "sequence 1 reaching table entry -1");
    at.n_tokens = 1, at.attention.n_head_kv = 3;
    expect_invalid(be, &at, "attention", "n_head not a multiple of n_head_kv");
    at.attention.n_head_kv = NH, at.attention.out = (duet_view){kc, 0};
    expect_invalid(be, &at, "attention", "out overlapping the cache");
    at.attention.out = (duet_view){k, 0}, at.attention.out_q8 = (duet_view){q, 0};
    expect_invalid(be, &at, "attention", "out_q8 overlapping q");
    at.attention.out_q8 = (duet_view){small, 0};
    expect_invalid(be, &at, "attention", "out_q8 of 16 bytes for 2 blocks");
    at.attention.out_q8 = (duet_view){NULL, 0}, at.attention.kv.dtype = DUET_DTYPE_Q8_0, at.attention.head_dim = 16;
    ck_assert_int_ne(run_op(be, &at), DUET_OK); /* q8_0 kv with head_dim 16 */

    /* matmul with x_q8: only with q8_0 weights, sized in blocks */
    duet_op mq = mm;
    mq.matmul.x = (duet_view){NULL, 0}, mq.matmul.x_q8 = (duet_view){x, 0};
    mq.matmul.x_q8.offset = 4 * N_IN * 2 - 2 * 2 * 34 + 2; /* 2 bytes short of 2 tokens x 2 blocks */
    expect_invalid(be, &mq, "matmul", "x_q8 past its buffer");
    mq.matmul.x_q8.offset = 1;
    expect_invalid(be, &mq, "matmul", "x_q8 misaligned");
    mq.matmul.x_q8.offset = 0, mq.matmul.dtype = DUET_DTYPE_F16;
    ck_assert_int_ne(run_op(be, &mq), DUET_OK); /* f16 weights with q8 activations */
    mq.matmul.dtype = DUET_DTYPE_Q8_0, mq.matmul.out = (duet_view){x, 0}, mq.matmul.n_out = 4;
    expect_invalid(be, &mq, "matmul", "out overlapping x_q8");

    /* gather, rmsnorm, add, swiglu, argmax */
    int32_t rows[1] = {8};
    duet_buffer *rb = mkbuf(be, rows, sizeof rows);
    duet_op ga = {.kind = DUET_OP_GATHER_ROWS, .n_tokens = 1};
    ga.gather.x = (duet_view){x, 0}, ga.gather.rows = (duet_view){rb, 0}, ga.gather.out = (duet_view){o, 0};
    ga.gather.dim = 16; /* x holds 8 rows of 16 */
    expect_invalid(be, &ga, "gather_rows", "row 8 of 8");
    duet_op rn = {.kind = DUET_OP_RMSNORM, .n_tokens = 1};
    rn.rmsnorm.x = (duet_view){x, 0}, rn.rmsnorm.w = (duet_view){small, 0}, rn.rmsnorm.out = (duet_view){x, 0};
    rn.rmsnorm.dim = 8, rn.rmsnorm.eps = 1e-5f;
    expect_invalid(be, &rn, "rmsnorm", "w of 4 floats for dim 8");
    rn.rmsnorm.dim = 4, rn.rmsnorm.out.offset = 4;
    expect_invalid(be, &rn, "rmsnorm", "out shifted over x");
    rn.rmsnorm.dim = 32, rn.rmsnorm.w = (duet_view){x, 0}, rn.rmsnorm.out = (duet_view){NULL, 0};
    rn.rmsnorm.out_q8 = (duet_view){small, 0};
    expect_invalid(be, &rn, "rmsnorm", "out_q8 of 16 bytes for one block");
    rn.rmsnorm.out_q8 = (duet_view){x, 64};
    expect_invalid(be, &rn, "rmsnorm", "out_q8 overlapping x");
    duet_op ad = {.kind = DUET_OP_ADD, .n_tokens = 1};
    ad.add.a = (duet_view){x, 0}, ad.add.b = (duet_view){small, 0}, ad.add.out = (duet_view){o, 0}, ad.add.dim = 5;
    expect_invalid(be, &ad, "add", "b too small");
    duet_op sw = {.kind = DUET_OP_SWIGLU, .n_tokens = 1};
    sw.swiglu.gate = (duet_view){x, 0}, sw.swiglu.up = (duet_view){x, 0}, sw.swiglu.out = (duet_view){o, 0};
    sw.swiglu.dim = 0;
    expect_invalid(be, &sw, "swiglu", "dim 0");
    sw.swiglu.dim = 32, sw.swiglu.out = (duet_view){NULL, 0}, sw.swiglu.out_q8 = (duet_view){o, 1};
    expect_invalid(be, &sw, "swiglu", "out_q8 at an odd offset");
    duet_op am = {.kind = DUET_OP_ARGMAX, .n_tokens = 1};
    am.argmax.x = (duet_view){small, 0}, am.argmax.out = (duet_view){o, 0}, am.argmax.dim = 5;
    expect_invalid(be, &am, "argmax", "x of 4 floats for dim 5");

    /* upload/download bounds, step protocol */
    char tmp[32] = {0};
    ck_assert_int_eq(duet_buffer_upload(be, small, 8, tmp, 9), DUET_INVALID_ARGUMENT);
    ck_assert_int_eq(duet_buffer_download(be, small, 17, tmp, 1), DUET_INVALID_ARGUMENT);
    ck_assert_int_eq(duet_step_op(be, &mm), DUET_INVALID_ARGUMENT); /* no begin */
    ck_assert_int_eq(duet_step_begin(be), DUET_OK);
    ck_assert_int_eq(duet_step_begin(be), DUET_INVALID_ARGUMENT);
    ck_assert_int_eq(duet_step_submit(be), DUET_OK);
    ck_assert_int_eq(duet_step_submit(be), DUET_INVALID_ARGUMENT);

    duet_buffer *all[] = {w, x, o, small, tk, tab, eo, q, k, v, pb, sb, tb, kc, vc, rb, fb};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) duet_buffer_free(be, all[i]);
    duet_backend_close(be);
}
END_TEST

/* A block-table entry outside the pool, covering a position a token uses,
 * is an error naming the entry, and nothing is written: not the outputs,
 * not the pools, not q or k (which rope_kv rotates in place). */
START_TEST(test_bad_block_table) {
    enum { NH = 4, HD = 32, NT = 3, W = NH * HD };
    const int lens[2] = {40, 20};
    for (int ci = 0; ci < N_CONFIGS; ci += 2) {
        duet_backend *be;
        if (!open_cfg(CONFIGS[ci], &be)) continue;
        oracle_kv p = paged_new(DUET_DTYPE_Q8_0, 16, W, 2, lens, 2);
        int32_t pos[NT] = {19, 35, 5}, seq[NT] = {1, 0, 0};
        float q[NT * W], k[NT * W], v[NT * W];
        fill_uniform(q, NT * W, -1, 1), fill_uniform(k, NT * W, -1, 1), fill_uniform(v, NT * W, -1, 1);
        for (int bad = 0; bad < 3; bad++) {
            /* Entries 1 and 2 of sequence 0 cover positions 16..47: token 1
             * (position 35) reads 16..31 and writes 35. */
            int entry = bad == 2 ? 2 : 1;
            int32_t saved = p.table[entry];
            p.table[entry] = bad == 0 ? p.n_blocks : bad == 1 ? -7 : INT32_MAX;
            paged_dev dev = paged_upload(be, &p);
            p.table[entry] = saved;
            gbuf qb = gbuf_new(be, sizeof q, q), kb = gbuf_new(be, sizeof k, k);
            gbuf out = gbuf_new(be, sizeof q, NULL), o8 = gbuf_new(be, sizeof(duet_block_q8_0) * NT * W / 32, NULL);
            duet_buffer *vb = mkbuf(be, v, sizeof v), *pb = mkbuf(be, pos, sizeof pos), *sb = mkbuf(be, seq, sizeof seq);
            duet_op rp = {.kind = DUET_OP_ROPE_KV, .n_tokens = NT};
            rp.rope_kv.q = gview(qb), rp.rope_kv.k = gview(kb), rp.rope_kv.v = (duet_view){vb, 0};
            rp.rope_kv.pos = (duet_view){pb, 0}, rp.rope_kv.seq = (duet_view){sb, 0}, rp.rope_kv.kv = paged_view(&p, dev);
            rp.rope_kv.n_head = NH, rp.rope_kv.n_head_kv = NH, rp.rope_kv.head_dim = HD, rp.rope_kv.n_rot = HD;
            duet_buffer *fb = freqs_buf(be, 10000.0f, HD);
            rp.rope_kv.freqs = (duet_view){fb, 0};
            duet_op at = {.kind = DUET_OP_ATTENTION, .n_tokens = NT};
            at.attention.q = gview(qb), at.attention.pos = rp.rope_kv.pos, at.attention.seq = rp.rope_kv.seq;
            at.attention.kv = rp.rope_kv.kv, at.attention.n_head = NH, at.attention.n_head_kv = NH;
            at.attention.head_dim = HD, at.attention.scale = 0.2f, at.attention.out = gview(out);
            at.attention.out_q8 = gview(o8);
            char what[96];
            snprintf(what, sizeof what, "bad table entry %d [%s, %d threads]", bad, CONFIGS[ci].isa, CONFIGS[ci].threads);
            expect_invalid(be, &at, "attention", what);
            ck_assert_msg(strstr(duet_last_error(), "block table entry"), "%s: message '%s' should name the entry",
                          what, duet_last_error());
            expect_invalid(be, &rp, "rope_kv", what);
            {
                /* Nothing moved. */
                uint8_t *h = malloc(sizeof q + 2 * GUARD);
                ck_assert(duet_buffer_download(be, out.buf, 0, h, sizeof q + 2 * GUARD) == DUET_OK);
                for (size_t i = 0; i < sizeof q + 2 * GUARD; i++)
                    if (h[i] != 0xa5) ck_abort_msg("%s: out byte %zu written", what, i);
                ck_assert(duet_buffer_download(be, o8.buf, 0, h, o8.bytes + 2 * GUARD) == DUET_OK);
                for (size_t i = 0; i < o8.bytes + 2 * GUARD; i++)
                    if (h[i] != 0xa5) ck_abort_msg("%s: out_q8 byte %zu written", what, i);
                float back[NT * W];
                gbuf_read(be, qb, back, what);
                ck_assert_msg(memcmp(back, q, sizeof q) == 0, "%s: q changed", what);
                gbuf_read(be, kb, back, what);
                ck_assert_msg(memcmp(back, k, sizeof k) == 0, "%s: k changed", what);
                uint8_t *pool = malloc(oracle_kv_pool_bytes(&p));
                ck_assert(duet_buffer_download(be, dev.k, KPOOL_OFF, pool, oracle_kv_pool_bytes(&p)) ==
                          DUET_OK);
                ck_assert_msg(memcmp(pool, p.k, oracle_kv_pool_bytes(&p)) == 0, "%s: k pool changed", what);
                ck_assert(duet_buffer_download(be, dev.v, 0, pool, oracle_kv_pool_bytes(&p)) == DUET_OK);
                ck_assert_msg(memcmp(pool, p.v, oracle_kv_pool_bytes(&p)) == 0, "%s: v pool changed", what);
                free(pool), free(h);
                paged_dev_free(be, dev);
            }
            duet_buffer_free(be, qb.buf), duet_buffer_free(be, kb.buf), duet_buffer_free(be, out.buf);
            duet_buffer_free(be, o8.buf), duet_buffer_free(be, vb), duet_buffer_free(be, pb), duet_buffer_free(be, sb);
            duet_buffer_free(be, fb);
        }
        oracle_kv_free(&p);
        duet_backend_close(be);
    }
}
END_TEST

/* ---- thread pool ----------------------------------------------------------- */

/* Thousands of back-to-back dispatches, mixing inline and pooled ops, with a
 * result that depends on every one of them running exactly once. */
START_TEST(test_pool_stress) {
    for (int threads = 2; threads <= 3; threads++) {
        duet_backend *be;
        duet_backend_params p = {.n_threads = threads};
        ck_assert(duet_backend_open("cpu", 0, &p, &be) == DUET_OK);
        enum { N_IN = 256, N_OUT = 256 };
        float *w = calloc(N_IN * N_OUT, sizeof(float)), x[N_IN], got[N_OUT];
        for (int i = 0; i < N_OUT; i++) w[i * N_IN + i] = 1.0f; /* identity */
        for (int i = 0; i < N_IN; i++) x[i] = 1.0f;
        duet_buffer *wb = mkbuf(be, w, sizeof(float) * N_IN * N_OUT), *xb = mkbuf(be, x, sizeof x);
        duet_buffer *ob = mkbuf(be, NULL, sizeof got);
        float zero[N_OUT] = {0};
        duet_buffer_upload(be, ob, 0, zero, sizeof zero);
        duet_op mm = {.kind = DUET_OP_MATMUL, .n_tokens = 1};
        mm.matmul.w = (duet_view){wb, 0}, mm.matmul.dtype = DUET_DTYPE_F32, mm.matmul.x = (duet_view){xb, 0};
        mm.matmul.n_in = N_IN, mm.matmul.n_out = N_OUT, mm.matmul.out = (duet_view){ob, 0}, mm.matmul.accumulate = true;
        duet_op small = mm; /* 8 rows: runs inline */
        small.matmul.n_out = 8;
        enum { REPS = 3000 };
        ck_assert(duet_step_begin(be) == DUET_OK);
        for (int r = 0; r < REPS; r++) {
            ck_assert(duet_step_op(be, &mm) == DUET_OK);
            if (r % 3 == 0) ck_assert(duet_step_op(be, &small) == DUET_OK);
        }
        ck_assert(duet_step_submit(be) == DUET_OK && duet_step_wait(be) == DUET_OK);
        duet_buffer_download(be, ob, 0, got, sizeof got);
        for (int i = 0; i < N_OUT; i++) {
            float want = REPS + (i < 8 ? REPS / 3 : 0);
            ck_assert_msg(got[i] == want, "%d threads: out[%d] = %g after %d accumulating ops, want %g", threads, i,
                          (double)got[i], REPS, (double)want);
        }
        duet_buffer_free(be, wb), duet_buffer_free(be, xb), duet_buffer_free(be, ob);
        free(w);
        duet_backend_close(be);
    }
}
END_TEST

static Suite *cpu_suite(void) {
    Suite *s = suite_create("cpu_ops");
    TCase *dt = tcase_create("dtype");
    tcase_add_test(dt, test_dtype_sizes);
    tcase_add_test(dt, test_fp16_exhaustive);
    tcase_add_test(dt, test_fp16_rounding);
#if defined(__x86_64__)
    tcase_add_test(dt, test_fp16_vs_f16c);
#endif
    tcase_add_test(dt, test_bf16);
    tcase_add_test(dt, test_q8_0_rows);
    tcase_set_timeout(dt, 300);
    suite_add_tcase(s, dt);
    TCase *ops = tcase_create("ops");
    tcase_add_test(ops, test_device_info);
    tcase_add_test(ops, test_matmul_float);
    tcase_add_test(ops, test_matmul_q8_0);
    tcase_add_test(ops, test_matmul_x_q8);
    tcase_add_test(ops, test_matmul_q8_0_extremes);
    tcase_add_test(ops, test_embed);
    tcase_add_test(ops, test_rmsnorm);
    tcase_add_test(ops, test_elementwise);
    tcase_add_test(ops, test_q8_outputs);
    tcase_add_test(ops, test_gather_argmax);
    tcase_add_test(ops, test_rope_kv);
    tcase_add_test(ops, test_rope_then_attention);
    tcase_add_test(ops, test_attention_mha);
    tcase_add_test(ops, test_attention_gqa);
    tcase_add_test(ops, test_attention_mqa);
    tcase_add_test(ops, test_attention_odd_heads);
    tcase_add_test(ops, test_attention_batch_invariance);
    tcase_add_test(ops, test_attention_memory);
    tcase_add_test(ops, test_bounds);
    tcase_add_test(ops, test_bad_block_table);
    tcase_add_test(ops, test_pool_stress);
    tcase_set_timeout(ops, 300);
    suite_add_tcase(s, ops);
    return s;
}

int main(void) { return test_run_suite(cpu_suite()); }
