/* test_cpu_ops.c — the cpu backend against naive references.
 *
 * Every op x dtype x shape class runs on every SIMD path this machine has
 * (forced with $DUET_CPU_ISA) and on 1, 2 and 3 threads, and is compared
 * with a scalar reference in double precision here, by normalised mean
 * squared error with a per-type bound. Outputs live between guard bytes
 * that must come back untouched; non-finite values fail unless expected.
 * The dtype helpers are checked exhaustively where the domain is 2^16. */
#include <float.h>
#include <math.h>
#include <stdint.h>

#include "../backends/backend.h"
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
        ck_assert_msg(isfinite(got[i]) || !isfinite(ref[i]), "%s: element %zu is %g, reference %g", what, i,
                      (double)got[i], ref[i]);
        double e = (double)got[i] - ref[i];
        num += e * e;
        den += ref[i] * ref[i];
    }
    double nmse = num / (den > 1e-300 ? den : 1e-300);
    ck_assert_msg(nmse <= tol, "%s: NMSE %.3g exceeds %.1g", what, nmse, tol);
}

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
            ck_assert_msg(isnan(f), "fp16 %04x should decode to NaN, got %g", h, (double)f);
            uint16_t back = duet_fp32_to_fp16(f);
            ck_assert_msg((back & 0x7c00) == 0x7c00 && (back & 0x3ff) && (back & 0x8000) == (h & 0x8000),
                          "fp16 NaN %04x re-encoded as %04x", h, back);
            continue;
        }
        if (special) ck_assert_msg(isinf(f) && (f < 0) == ((h & 0x8000) != 0), "fp16 %04x should be inf", h);
        else ck_assert_msg((double)f == fp16_value((uint16_t)h), "fp16 %04x decoded to %.9g, expected %.9g", h,
                           (double)f, fp16_value((uint16_t)h));
        ck_assert_msg(duet_fp32_to_fp16(f) == h, "fp16 %04x -> %.9g -> %04x does not round-trip", h, (double)f,
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
            ck_assert_msg(duet_fp32_to_fp16(mid) == even, "midpoint %.9g of %04x/%04x gave %04x, want %04x",
                          (double)mid, lo, hi, duet_fp32_to_fp16(mid), even);
            float toward_hi = nextafterf(mid, s ? -INFINITY : INFINITY);
            float toward_lo = nextafterf(mid, 0.0f);
            ck_assert_msg(duet_fp32_to_fp16(toward_hi) == hi, "%.9g should round to %04x", (double)toward_hi, hi);
            ck_assert_msg(duet_fp32_to_fp16(toward_lo) == lo, "%.9g should round to %04x", (double)toward_lo, lo);
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
    ck_assert_msg((n & 0x7c00) == 0x7c00 && (n & 0x3ff), "NaN became %04x", n);
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
        ck_assert_msg(a == b, "f32 %08x: duet %04x, f16c %04x", (uint32_t)u, a, b);
    }
}
END_TEST
#endif

START_TEST(test_bf16) {
    for (uint32_t h = 0; h < 65536; h++) {
        float f = duet_bf16_to_fp32((uint16_t)h);
        ck_assert_uint_eq(bits_of(f), h << 16);
        uint16_t back = duet_fp32_to_bf16(f);
        if (isnan(f)) {
            ck_assert_msg((back & 0x7f80) == 0x7f80 && (back & 0x7f), "bf16 NaN %04x became %04x", h, back);
            continue;
        }
        ck_assert_msg(back == h, "bf16 %04x does not round-trip (%04x)", h, back);
        if ((h & 0x7fff) >= 0x7f80) continue; /* no finite neighbour above inf */
        /* The midpoint to the next magnitude is exact in f32: ties to even. */
        uint32_t mid = (h << 16) | 0x8000;
        uint16_t up = (uint16_t)(h + 1), even = (h & 1) ? up : (uint16_t)h;
        ck_assert_msg(duet_fp32_to_bf16(f32_of(mid)) == even, "bf16 midpoint %08x gave %04x, want %04x", mid,
                      duet_fp32_to_bf16(f32_of(mid)), even);
        ck_assert_uint_eq(duet_fp32_to_bf16(f32_of(mid + 1)), up);
        ck_assert_uint_eq(duet_fp32_to_bf16(f32_of(mid - 1)), h);
    }
    ck_assert_uint_eq(duet_fp32_to_bf16(FLT_MAX), 0x7f80); /* rounds up to inf */
    uint16_t n = duet_fp32_to_bf16(f32_of(0x7f800001));     /* payload only in the low half */
    ck_assert_msg((n & 0x7f80) == 0x7f80 && (n & 0x7f), "NaN became %04x (must stay NaN)", n);
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
            ck_assert_msg(q[b].d == duet_fp32_to_fp16(d), "block %d: d %04x, want fp16(amax/127)", b, q[b].d);
            /* Rounding leaves at most d/2; storing d in fp16 adds 127|d - d16|. */
            float bound = 0.5f * d + 127.0f * fabsf(d - d16) + 1e-30f;
            for (int j = 0; j < 32; j++) {
                int i = b * 32 + j;
                ck_assert_msg(q[b].qs[j] >= -127 && q[b].qs[j] <= 127, "q out of range");
                ck_assert_msg(fabsf(y[i] - x[i]) <= bound * 1.0001f, "rep %d elem %d: %g -> %g (bound %g)", rep, i,
                              (double)x[i], (double)y[i], (double)bound);
                ck_assert_msg(y[i] == d16 * (float)q[b].qs[j], "dequantize must be d * q");
            }
            if (amax > 0) {
                int jmax = 0;
                for (int j = 1; j < 32; j++)
                    if (fabsf(x[b * 32 + j]) > fabsf(x[b * 32 + jmax])) jmax = j;
                ck_assert_msg(abs(q[b].qs[jmax]) == 127, "the largest element must map to +-127");
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

static void run_matmul_case(duet_backend *be, cfg c, duet_dtype dt, mm_case mc, bool bias, bool accumulate) {
    const int n_in = mc.n_in, n_out = mc.n_out, nt = mc.n_tokens;
    float *w = malloc(sizeof(float) * n_in * n_out), *wref = malloc(sizeof(float) * n_in * n_out);
    size_t row = duet_dtype_row_bytes(dt, n_in);
    uint8_t *wp = malloc(row * n_out);
    fill_uniform(w, (size_t)n_in * n_out, -1, 1);
    for (int o = 0; o < n_out; o++) to_dtype_and_back(dt, w + (size_t)o * n_in, wp + o * row, wref + (size_t)o * n_in, n_in);
    float *x = malloc(sizeof(float) * n_in * nt), *b = malloc(sizeof(float) * n_out);
    float *init = malloc(sizeof(float) * n_out * nt), *got = malloc(sizeof(float) * n_out * nt);
    double *ref = malloc(sizeof(double) * n_out * nt), *bound = malloc(sizeof(double) * n_out * nt);
    fill_uniform(x, (size_t)n_in * nt, -2, 2);
    fill_uniform(b, n_out, -1, 1);
    fill_uniform(init, (size_t)n_out * nt, -3, 3);
    for (int t = 0; t < nt; t++)
        for (int o = 0; o < n_out; o++) {
            double s = 0, q8err = 0, mag = 0;
            for (int i = 0; i < n_in; i++) {
                double wi = wref[(size_t)o * n_in + i], xi = x[(size_t)t * n_in + i];
                s += wi * xi;
                mag += fabs(wi * xi);
                if (i % 32 == 0) { /* x is quantized per 32: error <= amax/127/2 each */
                    double amax = 0;
                    for (int j = i; j < i + 32 && j < n_in; j++) amax = fmax(amax, fabs(x[(size_t)t * n_in + j]));
                    for (int j = i; j < i + 32 && j < n_in; j++) q8err += fabs(wref[(size_t)o * n_in + j]) * amax / 254;
                }
            }
            if (bias) s += b[o];
            if (accumulate) s += init[(size_t)t * n_out + o];
            ref[(size_t)t * n_out + o] = s;
            /* Hard per-output bound: activation rounding (q8_0) plus f32 sums. */
            bound[(size_t)t * n_out + o] = (dt == DUET_DTYPE_Q8_0 ? q8err * 1.001 : 0) + 1e-5 * (mag + fabs(s)) + 1e-6;
        }
    /* Inputs at non-zero offsets inside larger buffers. */
    duet_buffer *wb = mkbuf(be, NULL, row * n_out + 128), *xb = mkbuf(be, NULL, sizeof(float) * n_in * nt + 64);
    ck_assert(duet_buffer_upload(be, wb, 64, wp, row * n_out) == DUET_OK);
    ck_assert(duet_buffer_upload(be, xb, 32, x, sizeof(float) * n_in * nt) == DUET_OK);
    duet_buffer *bb = bias ? mkbuf(be, b, sizeof(float) * n_out) : NULL;
    gbuf out = gbuf_new(be, sizeof(float) * n_out * nt, accumulate ? init : NULL);
    duet_op op = {.kind = DUET_OP_MATMUL, .n_tokens = nt};
    op.matmul.w = (duet_view){wb, 64};
    op.matmul.dtype = dt;
    op.matmul.x = (duet_view){xb, 32};
    op.matmul.bias = (duet_view){bb, 0};
    op.matmul.accumulate = accumulate;
    op.matmul.n_in = n_in;
    op.matmul.n_out = n_out;
    op.matmul.out = gview(out);
    char what[160];
    snprintf(what, sizeof what, "matmul %s %dx%d tokens %d bias %d acc %d [%s, %d threads]", duet_dtype_name(dt),
             n_out, n_in, nt, bias, accumulate, c.isa, c.threads);
    RUN_OK(be, &op, "%s", what);
    gbuf_read(be, out, got, what);
    for (int i = 0; i < n_out * nt; i++)
        ck_assert_msg(fabs(got[i] - ref[i]) <= bound[i], "%s: output %d is %.7g, reference %.7g, bound %.3g", what, i,
                      (double)got[i], ref[i], bound[i]);
    /* Q8_0 quantizes the activations to 8 bits (relative error ~1/254 per
     * element): NMSE ~1e-5 over enough outputs. The float paths only differ
     * in summation order. */
    if (dt != DUET_DTYPE_Q8_0 || n_out * nt >= 64)
        check_nmse(got, ref, (size_t)n_out * nt, dt == DUET_DTYPE_Q8_0 ? 1e-4 : 1e-10, what);
    duet_buffer_free(be, wb);
    duet_buffer_free(be, xb);
    duet_buffer_free(be, bb);
    duet_buffer_free(be, out.buf);
    free(w), free(wref), free(wp), free(x), free(b), free(init), free(got), free(ref), free(bound);
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

/* Weights at the int8 extreme -128 (legal in a file, never made by the
 * quantizer) and activations with outliers. */
START_TEST(test_matmul_q8_0_extremes) {
    enum { N_IN = 96, N_OUT = 5, NT = 3 };
    duet_block_q8_0 w[N_OUT * N_IN / 32];
    float wref[N_OUT * N_IN], x[NT * N_IN], got[NT * N_OUT];
    double ref[NT * N_OUT];
    for (int i = 0; i < N_OUT * N_IN / 32; i++) {
        w[i].d = duet_fp32_to_fp16(0.01f * (float)(i + 1));
        for (int j = 0; j < 32; j++) w[i].qs[j] = (int8_t)(j % 3 == 0 ? -128 : (j * 37 % 255) - 127);
    }
    for (int o = 0; o < N_OUT; o++) duet_dequantize_row(DUET_DTYPE_Q8_0, w + o * (N_IN / 32), wref + o * N_IN, N_IN);
    fill_uniform(x, NT * N_IN, -1, 1);
    x[10] = 50.0f;
    x[N_IN + 3] = -80.0f;
    for (int t = 0; t < NT; t++)
        for (int o = 0; o < N_OUT; o++) {
            double s = 0;
            for (int i = 0; i < N_IN; i++) s += (double)wref[o * N_IN + i] * x[t * N_IN + i];
            ref[t * N_OUT + o] = s;
        }
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
                float *tab = malloc(sizeof(float) * dim * n_vocab), *tref = malloc(sizeof(float) * dim * n_vocab);
                uint8_t *tp = malloc(row * n_vocab);
                fill_uniform(tab, (size_t)dim * n_vocab, -1, 1);
                for (int v = 0; v < n_vocab; v++) to_dtype_and_back(dt, tab + (size_t)v * dim, tp + v * row, tref + (size_t)v * dim, dim);
                int32_t tok[20];
                for (int t = 0; t < nt; t++) tok[t] = t == 0 ? 0 : t == 1 ? n_vocab - 1 : rng_int(n_vocab);
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
                    ck_assert_msg(memcmp(got + (size_t)t * dim, tref + (size_t)tok[t] * dim, sizeof(float) * dim) == 0,
                                  "embed %s dim %d token %d: row differs [%s]", duet_dtype_name(dt), dim, t,
                                  CONFIGS[ci].isa);
                duet_buffer_free(be, tb), duet_buffer_free(be, kb), duet_buffer_free(be, out.buf);
                free(tab), free(tref), free(tp), free(got);
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
                for (int t = 0; t < nt; t++) {
                    double ss = 0;
                    for (int i = 0; i < dim; i++) ss += (double)x[t * dim + i] * x[t * dim + i];
                    double s = 1.0 / sqrt(ss / dim + eps);
                    for (int i = 0; i < dim; i++) ref[t * dim + i] = x[t * dim + i] * s * w[i];
                }
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

/* SWIGLU and ADD share shapes: ragged dims, one and many tokens, in place. */
static void run_elementwise(duet_backend *be, cfg c, duet_op_kind kind, int dim, int nt, int inplace) {
    size_t n = (size_t)dim * nt;
    float *a = malloc(sizeof(float) * n), *b = malloc(sizeof(float) * n), *got = malloc(sizeof(float) * n);
    double *ref = malloc(sizeof(double) * n);
    fill_uniform(a, n, -8, 8);
    fill_uniform(b, n, -2, 2);
    if (n > 4) a[0] = 100.0f, a[1] = -100.0f, a[2] = -1000.0f, a[3] = 88.9f; /* exp far out of range */
    for (size_t i = 0; i < n; i++)
        ref[i] = kind == DUET_OP_ADD ? (double)a[i] + b[i] : (double)a[i] / (1.0 + exp(-(double)a[i])) * b[i];
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
            for (int t = 0; t < nt; t++)
                ck_assert_msg(memcmp(got + (size_t)t * dim, x + (size_t)rows[t] * dim, sizeof(float) * dim) == 0,
                              "gather row %d differs [%s]", t, CONFIGS[ci].isa);
            duet_buffer_free(be, xb), duet_buffer_free(be, rb), duet_buffer_free(be, out.buf);
            free(x), free(got);
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
        int32_t want[NT] = {777, 12345, 0, 31999, 4}, got[NT];
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

/* ---- rope_kv and attention ---------------------------------------------- */

typedef struct attn_case {
    int n_head, n_head_kv, head_dim, n_rot;
    bool neox;
    duet_dtype kvt;
    int n_tokens;
} attn_case;

static const attn_case ATTN_CASES[] = {
    {4, 4, 8, 8, false, DUET_DTYPE_F32, 5},    {4, 2, 16, 16, true, DUET_DTYPE_F16, 3},
    {8, 2, 64, 64, false, DUET_DTYPE_F16, 7},  {8, 2, 64, 32, true, DUET_DTYPE_F32, 2},
    {6, 3, 6, 6, false, DUET_DTYPE_F32, 4},    {4, 1, 24, 16, false, DUET_DTYPE_F16, 1},
    {12, 12, 64, 64, false, DUET_DTYPE_F32, 1}, {8, 4, 80, 80, true, DUET_DTYPE_F16, 40},
};
#define N_SEQS 3
#define N_CTX 300

/* Positions/sequences mixing a prefill run in one sequence with decode
 * tokens of others, positions up to N_CTX - 1, sorted so a token only sees
 * slots that exist. */
static void make_positions(int nt, int32_t *pos, int32_t *seq) {
    int run = nt > 2 ? nt - 2 : nt;
    if (nt == 1) { /* decode deep into a sequence */
        seq[0] = 1, pos[0] = N_CTX - 1;
        return;
    }
    for (int t = 0; t < nt; t++) {
        if (t < run) seq[t] = 0, pos[t] = t;
        else if (t == run) seq[t] = 1, pos[t] = N_CTX - 1;
        else seq[t] = 2, pos[t] = 150 + t;
    }
}

static void ref_rope(float *x, int n_heads, int hd, int n_rot, bool neox, int pos, float base) {
    for (int h = 0; h < n_heads; h++) {
        float *v = x + h * hd;
        for (int i = 0; i < n_rot / 2; i++) {
            double th = pos * pow(base, -2.0 * i / n_rot);
            int a = neox ? i : 2 * i, b = neox ? i + n_rot / 2 : 2 * i + 1;
            double x0 = v[a], x1 = v[b];
            v[a] = (float)(x0 * cos(th) - x1 * sin(th));
            v[b] = (float)(x0 * sin(th) + x1 * cos(th));
        }
    }
}

START_TEST(test_rope_kv) {
    for (int ci = 0; ci < N_CONFIGS; ci++) {
        duet_backend *be;
        if (!open_cfg(CONFIGS[ci], &be)) continue;
        for (size_t k = 0; k < sizeof ATTN_CASES / sizeof ATTN_CASES[0]; k++) {
            attn_case ac = ATTN_CASES[k];
            int nt = ac.n_tokens, qw = ac.n_head * ac.head_dim, kw = ac.n_head_kv * ac.head_dim;
            size_t es = duet_dtype_block_bytes(ac.kvt), cache_bytes = (size_t)N_SEQS * N_CTX * kw * es;
            float *q = malloc(sizeof(float) * qw * nt), *kk = malloc(sizeof(float) * kw * nt), *v = malloc(sizeof(float) * kw * nt);
            float *qg = malloc(sizeof(float) * qw * nt), *kg = malloc(sizeof(float) * kw * nt);
            double *qr = malloc(sizeof(double) * qw * nt), *kr = malloc(sizeof(double) * kw * nt);
            int32_t pos[64], seq[64];
            make_positions(nt, pos, seq);
            fill_uniform(q, (size_t)qw * nt, -1, 1);
            fill_uniform(kk, (size_t)kw * nt, -1, 1);
            fill_uniform(v, (size_t)kw * nt, -1, 1);
            float base = k % 2 ? 500000.0f : 10000.0f;
            float *qt = malloc(sizeof(float) * qw * nt), *kt = malloc(sizeof(float) * kw * nt);
            memcpy(qt, q, sizeof(float) * qw * nt);
            memcpy(kt, kk, sizeof(float) * kw * nt);
            for (int t = 0; t < nt; t++) {
                ref_rope(qt + t * qw, ac.n_head, ac.head_dim, ac.n_rot, ac.neox, pos[t], base);
                ref_rope(kt + t * kw, ac.n_head_kv, ac.head_dim, ac.n_rot, ac.neox, pos[t], base);
            }
            for (int i = 0; i < qw * nt; i++) qr[i] = qt[i];
            for (int i = 0; i < kw * nt; i++) kr[i] = kt[i];
            uint8_t *cache0 = malloc(cache_bytes), *kc = malloc(cache_bytes), *vc = malloc(cache_bytes);
            memset(cache0, 0x5a, cache_bytes); /* untouched slots must keep this */
            gbuf qb = gbuf_new(be, sizeof(float) * qw * nt, q), kb = gbuf_new(be, sizeof(float) * kw * nt, kk);
            duet_buffer *vb = mkbuf(be, v, sizeof(float) * kw * nt), *pb = mkbuf(be, pos, sizeof(int32_t) * nt),
                        *sb = mkbuf(be, seq, sizeof(int32_t) * nt);
            gbuf kcb = gbuf_new(be, cache_bytes, cache0), vcb = gbuf_new(be, cache_bytes, cache0);
            duet_op op = {.kind = DUET_OP_ROPE_KV, .n_tokens = nt};
            op.rope_kv.q = gview(qb), op.rope_kv.k = gview(kb), op.rope_kv.v = (duet_view){vb, 0};
            op.rope_kv.pos = (duet_view){pb, 0}, op.rope_kv.seq = (duet_view){sb, 0};
            op.rope_kv.k_cache = gview(kcb), op.rope_kv.v_cache = gview(vcb);
            op.rope_kv.kv_dtype = ac.kvt;
            op.rope_kv.n_head = ac.n_head, op.rope_kv.n_head_kv = ac.n_head_kv, op.rope_kv.head_dim = ac.head_dim;
            op.rope_kv.n_rot = ac.n_rot, op.rope_kv.n_ctx = N_CTX, op.rope_kv.freq_base = base, op.rope_kv.neox = ac.neox;
            char what[128];
            snprintf(what, sizeof what, "rope_kv case %zu [%s, %d threads]", k, CONFIGS[ci].isa, CONFIGS[ci].threads);
            RUN_OK(be, &op, "%s", what);
            gbuf_read(be, qb, qg, what);
            gbuf_read(be, kb, kg, what);
            gbuf_read(be, kcb, kc, what);
            gbuf_read(be, vcb, vc, what);
            check_nmse(qg, qr, (size_t)qw * nt, 1e-12, what);
            check_nmse(kg, kr, (size_t)kw * nt, 1e-12, what);
            /* The cache holds rotated k and plain v at [seq][pos], nothing else changed. */
            uint8_t *mark = calloc((size_t)N_SEQS * N_CTX, 1);
            for (int t = 0; t < nt; t++) {
                size_t slot = (size_t)seq[t] * N_CTX + pos[t];
                mark[slot] = 1;
                float krow[1024], vrow[1024];
                duet_dequantize_row(ac.kvt, kc + slot * kw * es, krow, kw);
                duet_dequantize_row(ac.kvt, vc + slot * kw * es, vrow, kw);
                double vref[1024];
                for (int i = 0; i < kw; i++) vref[i] = v[t * kw + i];
                double tol = ac.kvt == DUET_DTYPE_F16 ? 1e-6 : 1e-12;
                check_nmse(krow, kr + t * kw, kw, tol, "k cache row");
                check_nmse(vrow, vref, kw, ac.kvt == DUET_DTYPE_F16 ? 1e-6 : 0.0, "v cache row");
            }
            for (size_t s = 0; s < (size_t)N_SEQS * N_CTX; s++)
                if (!mark[s])
                    ck_assert_msg(memcmp(kc + s * kw * es, cache0, kw * es) == 0 && memcmp(vc + s * kw * es, cache0, kw * es) == 0,
                                  "%s: cache slot %zu changed", what, s);
            free(mark);
            duet_buffer_free(be, qb.buf), duet_buffer_free(be, kb.buf), duet_buffer_free(be, vb);
            duet_buffer_free(be, pb), duet_buffer_free(be, sb), duet_buffer_free(be, kcb.buf), duet_buffer_free(be, vcb.buf);
            free(q), free(kk), free(v), free(qg), free(kg), free(qr), free(kr), free(qt), free(kt);
            free(cache0), free(kc), free(vc);
        }
        duet_backend_close(be);
    }
}
END_TEST

static void run_attention_case(duet_backend *be, cfg c, attn_case ac, float scale_mul, bool inplace) {
    int nt = ac.n_tokens, hd = ac.head_dim, qw = ac.n_head * hd, kw = ac.n_head_kv * hd;
    size_t es = duet_dtype_block_bytes(ac.kvt), n_slots = (size_t)N_SEQS * N_CTX;
    float *kc = malloc(sizeof(float) * n_slots * kw), *vc = malloc(sizeof(float) * n_slots * kw);
    uint8_t *kp = malloc(n_slots * kw * es), *vp = malloc(n_slots * kw * es);
    fill_uniform(kc, n_slots * kw, -1, 1);
    fill_uniform(vc, n_slots * kw, -1, 1);
    /* The reference sees the cache values exactly as stored. */
    to_dtype_and_back(ac.kvt, kc, kp, kc, (int64_t)n_slots * kw);
    to_dtype_and_back(ac.kvt, vc, vp, vc, (int64_t)n_slots * kw);
    float *q = malloc(sizeof(float) * qw * nt), *got = malloc(sizeof(float) * qw * nt);
    double *ref = malloc(sizeof(double) * qw * nt), *sc = malloc(sizeof(double) * N_CTX);
    fill_uniform(q, (size_t)qw * nt, -1, 1);
    int32_t pos[64], seq[64];
    make_positions(nt, pos, seq);
    float scale = scale_mul / sqrtf((float)hd);
    int group = ac.n_head / ac.n_head_kv;
    for (int t = 0; t < nt; t++)
        for (int h = 0; h < ac.n_head; h++) {
            const float *qh = q + t * qw + h * hd;
            int n = pos[t] + 1;
            double mx = -INFINITY, sum = 0;
            for (int p = 0; p < n; p++) {
                const float *kr = kc + ((size_t)seq[t] * N_CTX + p) * kw + (h / group) * hd;
                double s = 0;
                for (int d = 0; d < hd; d++) s += (double)qh[d] * kr[d];
                sc[p] = s * scale;
                mx = fmax(mx, sc[p]);
            }
            for (int p = 0; p < n; p++) sum += sc[p] = exp(sc[p] - mx);
            for (int d = 0; d < hd; d++) {
                double o = 0;
                for (int p = 0; p < n; p++) o += sc[p] * vc[((size_t)seq[t] * N_CTX + p) * kw + (h / group) * hd + d];
                ref[t * qw + h * hd + d] = o / sum;
            }
        }
    duet_buffer *kb = mkbuf(be, kp, n_slots * kw * es), *vb = mkbuf(be, vp, n_slots * kw * es);
    duet_buffer *qb = inplace ? NULL : mkbuf(be, q, sizeof(float) * qw * nt);
    duet_buffer *pb = mkbuf(be, pos, sizeof(int32_t) * nt), *sb = mkbuf(be, seq, sizeof(int32_t) * nt);
    gbuf out = gbuf_new(be, sizeof(float) * qw * nt, inplace ? q : NULL);
    duet_op op = {.kind = DUET_OP_ATTENTION, .n_tokens = nt};
    op.attention.q = inplace ? gview(out) : (duet_view){qb, 0};
    op.attention.pos = (duet_view){pb, 0}, op.attention.seq = (duet_view){sb, 0};
    op.attention.k_cache = (duet_view){kb, 0}, op.attention.v_cache = (duet_view){vb, 0};
    op.attention.kv_dtype = ac.kvt;
    op.attention.n_head = ac.n_head, op.attention.n_head_kv = ac.n_head_kv, op.attention.head_dim = hd;
    op.attention.n_ctx = N_CTX, op.attention.scale = scale, op.attention.out = gview(out);
    char what[160];
    snprintf(what, sizeof what, "attention heads %d/%d hd %d %s tokens %d scale x%g inplace %d [%s, %d threads]",
             ac.n_head, ac.n_head_kv, hd, duet_dtype_name(ac.kvt), nt, (double)scale_mul, inplace, c.isa, c.threads);
    RUN_OK(be, &op, "%s", what);
    gbuf_read(be, out, got, what);
    /* Large scales amplify the f32 rounding of each score (~1e-7 |s|). */
    check_nmse(got, ref, (size_t)qw * nt, scale_mul > 1 ? 1e-8 : 1e-10, what);
    duet_buffer_free(be, kb), duet_buffer_free(be, vb), duet_buffer_free(be, qb), duet_buffer_free(be, pb);
    duet_buffer_free(be, sb), duet_buffer_free(be, out.buf);
    free(kc), free(vc), free(kp), free(vp), free(q), free(got), free(ref), free(sc);
}

START_TEST(test_attention) {
    for (int ci = 0; ci < N_CONFIGS; ci++) {
        duet_backend *be;
        if (!open_cfg(CONFIGS[ci], &be)) continue;
        for (size_t k = 0; k < sizeof ATTN_CASES / sizeof ATTN_CASES[0]; k++)
            run_attention_case(be, CONFIGS[ci], ATTN_CASES[k], 1.0f, k % 3 == 2);
        /* Large logits: the softmax must subtract the max, not overflow. */
        run_attention_case(be, CONFIGS[ci], ATTN_CASES[2], 60.0f, false);
        run_attention_case(be, CONFIGS[ci], ATTN_CASES[0], 200.0f, false);
        duet_backend_close(be);
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

    /* rope_kv / attention: positions and sequences outside the cache */
    enum { HD = 8, NH = 2, CTX = 16 };
    int32_t pos[2] = {3, CTX}, seq[2] = {0, 0};
    duet_buffer *q = mkbuf(be, NULL, 2 * NH * HD * 4), *k = mkbuf(be, NULL, 2 * NH * HD * 4);
    duet_buffer *pb = mkbuf(be, pos, sizeof pos), *sb = mkbuf(be, seq, sizeof seq);
    duet_buffer *kc = mkbuf(be, NULL, 2 * CTX * NH * HD * 4), *vc = mkbuf(be, NULL, 2 * CTX * NH * HD * 4);
    duet_op rp = {.kind = DUET_OP_ROPE_KV, .n_tokens = 1};
    rp.rope_kv.q = (duet_view){q, 0}, rp.rope_kv.k = (duet_view){k, 0}, rp.rope_kv.v = (duet_view){k, 0};
    rp.rope_kv.pos = (duet_view){pb, 0}, rp.rope_kv.seq = (duet_view){sb, 0};
    rp.rope_kv.k_cache = (duet_view){kc, 0}, rp.rope_kv.v_cache = (duet_view){vc, 0};
    rp.rope_kv.kv_dtype = DUET_DTYPE_F32, rp.rope_kv.n_head = NH, rp.rope_kv.n_head_kv = NH;
    rp.rope_kv.head_dim = HD, rp.rope_kv.n_rot = HD, rp.rope_kv.n_ctx = CTX, rp.rope_kv.freq_base = 10000;
    RUN_OK(be, &rp, "the valid rope_kv");
    rp.n_tokens = 2;
    expect_invalid(be, &rp, "rope_kv", "position n_ctx");
    pos[1] = 2, seq[1] = 2; /* the caches hold 2 sequences */
    duet_buffer_upload(be, pb, 0, pos, sizeof pos);
    duet_buffer_upload(be, sb, 0, seq, sizeof seq);
    expect_invalid(be, &rp, "rope_kv", "sequence 2 of a 2-sequence cache");
    rp.n_tokens = 1, rp.rope_kv.n_rot = 3;
    expect_invalid(be, &rp, "rope_kv", "odd n_rot");
    rp.rope_kv.n_rot = HD, rp.rope_kv.k_cache.offset = 64;
    rp.rope_kv.n_ctx = 2 * CTX; /* one sequence of 32 would need the whole buffer past offset 64 */
    pos[0] = 2 * CTX - 1;
    duet_buffer_upload(be, pb, 0, pos, sizeof pos);
    expect_invalid(be, &rp, "rope_kv", "slot past the end of an offset cache");

    duet_op at = {.kind = DUET_OP_ATTENTION, .n_tokens = 2};
    at.attention.q = (duet_view){q, 0}, at.attention.pos = (duet_view){pb, 0}, at.attention.seq = (duet_view){sb, 0};
    at.attention.k_cache = (duet_view){kc, 0}, at.attention.v_cache = (duet_view){vc, 0};
    at.attention.kv_dtype = DUET_DTYPE_F32, at.attention.n_head = NH, at.attention.n_head_kv = NH;
    at.attention.head_dim = HD, at.attention.n_ctx = CTX, at.attention.scale = 0.3f, at.attention.out = (duet_view){k, 0};
    expect_invalid(be, &at, "attention", "sequence 2 and position 31");
    at.n_tokens = 1, at.attention.n_head_kv = 3;
    expect_invalid(be, &at, "attention", "n_head not a multiple of n_head_kv");
    pos[0] = 3;
    duet_buffer_upload(be, pb, 0, pos, sizeof pos);
    at.attention.n_head_kv = NH, at.attention.out = (duet_view){kc, 0};
    expect_invalid(be, &at, "attention", "out overlapping the cache");

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
    duet_op ad = {.kind = DUET_OP_ADD, .n_tokens = 1};
    ad.add.a = (duet_view){x, 0}, ad.add.b = (duet_view){small, 0}, ad.add.out = (duet_view){o, 0}, ad.add.dim = 5;
    expect_invalid(be, &ad, "add", "b too small");
    duet_op sw = {.kind = DUET_OP_SWIGLU, .n_tokens = 1};
    sw.swiglu.gate = (duet_view){x, 0}, sw.swiglu.up = (duet_view){x, 0}, sw.swiglu.out = (duet_view){o, 0};
    sw.swiglu.dim = 0;
    expect_invalid(be, &sw, "swiglu", "dim 0");
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

    duet_buffer *all[] = {w, x, o, small, tk, tab, eo, q, k, pb, sb, kc, vc, rb};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) duet_buffer_free(be, all[i]);
    duet_backend_close(be);
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
    tcase_add_test(ops, test_matmul_q8_0_extremes);
    tcase_add_test(ops, test_embed);
    tcase_add_test(ops, test_rmsnorm);
    tcase_add_test(ops, test_elementwise);
    tcase_add_test(ops, test_gather_argmax);
    tcase_add_test(ops, test_rope_kv);
    tcase_add_test(ops, test_attention);
    tcase_add_test(ops, test_bounds);
    tcase_add_test(ops, test_pool_stress);
    tcase_set_timeout(ops, 300);
    suite_add_tcase(s, ops);
    return s;
}

int main(void) { return test_run_suite(cpu_suite()); }
