/* test_cpu_matmul.c — the cpu backend's q8_0 matmul and quantiser, the
 * block types' batch invariance and Q4_0's, Q5_0's and F16's repacked layouts.
 *
 * - duet__cpu_quantize_q8_0 on every SIMD path this machine has must give
 *   the bytes of duet_quantize_row_q8_0: ties, clamps, NaN/inf, subnormal
 *   and overflowing scales included.
 * - A q8_0 matmul given x_q8 must give exactly (bit for bit) what the f32 x
 *   path gives for the x those blocks came from, on every path, for token
 *   counts on both sides of the tile/panel switch and of the panel's token
 *   groups and chunks, with row counts around the panel's 16.
 * - Each token's row is the same bits computed alone (one token per op)
 *   as in the batch: the engine's greedy output must not depend on how it
 *   batches (test_forward checks the whole model; this pins the kernels).
 * - Both against a double-precision reference on the same blocks
 *   (sum_b d_w d_x sum(qw qx)), with bias and accumulate, between guard
 *   values that must stay untouched. */
#include <math.h>
#include <stdint.h>

#include "../backends/cpu/cpu_internal.h"
#include "test_util.h"

static uint64_t rng_state = 0x2545f4914f6cdd1dull;
static uint64_t rng_next(void) { /* splitmix64 */
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static float rng_uniform(float lo, float hi) {
    return lo + (hi - lo) * (float)((rng_next() >> 40) * 0x1p-24);
}
static int rng_int(int n) {
    return (int)(rng_next() % (uint64_t)n);
}

static const char *const ISA_NAMES[] = {"scalar", "avx2", "avx512"};

/* The paths this CPU runs (duet__cpu_isa_detect without a cap). */
static int n_isas(void) {
    unsetenv("DUET_CPU_ISA");
    return (int)duet__cpu_isa_detect() + 1;
}

/* ---- quantiser ------------------------------------------------------------ */

/* One block of 32 in one of several hard modes. */
static void fill_block(float *x, int mode) {
    switch (mode) {
    case 0: { /* random magnitudes from subnormal to near FLT_MAX */
        float scale = ldexpf(1.0f, rng_int(270) - 149);
        for (int i = 0; i < 32; i++)
            x[i] = rng_uniform(-1.0f, 1.0f) * scale;
        break;
    }
    case 1: { /* exact ties: d a power of two, x = (k + 0.5) d */
        float d = ldexpf(1.0f, rng_int(60) - 30);
        for (int i = 0; i < 32; i++)
            x[i] = ((float)(rng_int(253) - 126) + 0.5f) * d;
        x[rng_int(32)] = (rng_int(2) ? 127.0f : -127.0f) * d;
        break;
    }
    case 2: /* all zero, signs mixed */
        for (int i = 0; i < 32; i++)
            x[i] = rng_int(2) ? 0.0f : -0.0f;
        break;
    case 3: { /* non-finite values among normal ones */
        for (int i = 0; i < 32; i++)
            x[i] = rng_uniform(-3.0f, 3.0f);
        int k = 1 + rng_int(3);
        for (int i = 0; i < k; i++) {
            int r = rng_int(3);
            x[rng_int(32)] = r == 0 ? NAN : r == 1 ? INFINITY : -INFINITY;
        }
        break;
    }
    case 4: /* only NaNs */
        for (int i = 0; i < 32; i++)
            x[i] = NAN;
        break;
    case 5: { /* values at +-amax and just inside: the clamp and 127 itself */
        float a = rng_uniform(0.5f, 2.0f);
        for (int i = 0; i < 32; i++) {
            int r = rng_int(4);
            x[i] = r == 0 ? a : r == 1 ? -a : r == 2 ? nextafterf(a, 0.0f) : -nextafterf(a, 0.0f);
        }
        break;
    }
    default: { /* random bit patterns: every exponent, NaN payloads */
        for (int i = 0; i < 32; i++) {
            uint32_t u = (uint32_t)rng_next();
            memcpy(&x[i], &u, 4);
        }
        break;
    }
    }
}

START_TEST(quantize_matches_reference) {
    enum { NB = 64, MODES = 7, ROUNDS = 300 };
    float *x = malloc(sizeof(float) * 32 * NB);
    duet_block_q8_0 *want = malloc(sizeof *want * NB), *got = malloc(sizeof *got * (NB + 1));
    int isas = n_isas();
    for (int isa = 0; isa < isas; isa++) {
        cpu_backend be = {.isa = (cpu_isa)isa};
        for (int round = 0; round < ROUNDS; round++) {
            for (int b = 0; b < NB; b++)
                fill_block(x + 32 * b, round < MODES ? round : rng_int(MODES));
            int64_t n = 32 * (1 + rng_int(NB)); /* odd and even block counts */
            duet_quantize_row_q8_0(x, want, n);
            memset(got, 0x5a, sizeof *got * (NB + 1));
            duet__cpu_quantize_q8_0(&be, x, got, n);
            for (int64_t b = 0; b < n / 32; b++) {
                ck_assert_msg(got[b].d == want[b].d,
                              "%s: block %lld: scale 0x%04x, reference 0x%04x (round %d)", ISA_NAMES[isa],
                              (long long)b, got[b].d, want[b].d, round);
                for (int i = 0; i < 32; i++)
                    ck_assert_msg(got[b].qs[i] == want[b].qs[i],
                                  "%s: block %lld [%d]: x %.9g -> %d, reference %d (scale 0x%04x, round %d)",
                                  ISA_NAMES[isa], (long long)b, i, (double)x[32 * b + i], got[b].qs[i],
                                  want[b].qs[i], want[b].d, round);
            }
            ck_assert_msg(got[n / 32].d == 0x5a5a, "%s: wrote past %lld values", ISA_NAMES[isa],
                          (long long)n);
        }
    }
    free(x);
    free(want);
    free(got);
}
END_TEST

/* ---- matmul ---------------------------------------------------------------- */

typedef struct mm_case {
    int n_out, n_in, n_tokens;
    bool bias, accumulate;
} mm_case;

enum { GUARD = 19 };
static const float GUARD_VALUE = -1234.5f;

/* Runs one q8_0 matmul on `be` with f32 x (xq NULL) or blocks xq; out has
 * GUARD floats either side and holds `init` (accumulate) in between. */
static void run_mm(duet_backend *be, const mm_case *c, const duet_block_q8_0 *w, const float *x,
                   const duet_block_q8_0 *xq, const float *bias, const float *init, float *out_guarded) {
    duet_op op = {.kind = DUET_OP_MATMUL, .n_tokens = c->n_tokens};
    op.matmul.dtype = DUET_DTYPE_Q8_0;
    op.matmul.n_in = c->n_in;
    op.matmul.n_out = c->n_out;
    op.matmul.accumulate = c->accumulate;
    size_t n = (size_t)c->n_tokens * c->n_out;
    for (int i = 0; i < GUARD; i++)
        out_guarded[i] = out_guarded[GUARD + n + i] = GUARD_VALUE;
    memcpy(out_guarded + GUARD, init, n * sizeof(float));
    duet_status st = duet__cpu_matmul((cpu_backend *)be, &op, w, xq ? NULL : x, xq, c->bias ? bias : NULL,
                                      out_guarded + GUARD);
    ck_assert_msg(st == DUET_OK, "matmul %dx%d, %d tokens: %s", c->n_out, c->n_in, c->n_tokens,
                  duet_last_error());
    for (int i = 0; i < GUARD; i++) {
        ck_assert_msg(out_guarded[i] == GUARD_VALUE, "matmul %dx%d, %d tokens: wrote before out", c->n_out,
                      c->n_in, c->n_tokens);
        ck_assert_msg(out_guarded[GUARD + n + i] == GUARD_VALUE, "matmul %dx%d, %d tokens: wrote past out",
                      c->n_out, c->n_in, c->n_tokens);
    }
}

static void check_case(const mm_case *c) {
    int nb = c->n_in / 32;
    size_t n_w = (size_t)c->n_out * nb, n_x = (size_t)c->n_tokens * nb, n_o = (size_t)c->n_tokens * c->n_out;
    duet_block_q8_0 *w = malloc(sizeof *w * n_w), *xq = malloc(sizeof *xq * n_x);
    float *x = malloc(sizeof(float) * c->n_tokens * c->n_in), *bias = malloc(sizeof(float) * c->n_out);
    float *init = malloc(sizeof(float) * n_o), *ref = malloc(sizeof(float) * n_o),
          *mag = malloc(sizeof(float) * n_o);
    float *o1 = malloc(sizeof(float) * (n_o + 2 * GUARD)), *o2 = malloc(sizeof(float) * (n_o + 2 * GUARD));
    float *o3 = malloc(sizeof(float) * (c->n_out + 2 * GUARD));
    /* Full-range weights, -128 included, and scales of mixed size. */
    for (size_t i = 0; i < n_w; i++) {
        w[i].d = duet_fp32_to_fp16(rng_uniform(0.001f, 0.05f));
        for (int k = 0; k < 32; k++)
            w[i].qs[k] = (int8_t)(rng_int(256) - 128);
    }
    for (int i = 0; i < c->n_tokens * c->n_in; i++)
        x[i] = rng_uniform(-2.0f, 2.0f) * (i % 97 == 0 ? 20.0f : 1.0f);
    for (int t = 0; t < c->n_tokens; t++)
        duet_quantize_row_q8_0(x + (size_t)t * c->n_in, xq + (size_t)t * nb, c->n_in);
    for (int o = 0; o < c->n_out; o++)
        bias[o] = rng_uniform(-1.0f, 1.0f);
    for (size_t i = 0; i < n_o; i++)
        init[i] = c->accumulate ? rng_uniform(-1.0f, 1.0f) : 0.0f;
    for (int t = 0; t < c->n_tokens; t++)
        for (int o = 0; o < c->n_out; o++) {
            double s = 0.0, m = 0.0;
            for (int b = 0; b < nb; b++) {
                const duet_block_q8_0 *wb = w + (size_t)o * nb + b, *xb = xq + (size_t)t * nb + b;
                int32_t dot = 0;
                for (int k = 0; k < 32; k++)
                    dot += wb->qs[k] * xb->qs[k];
                double term = (double)duet_fp16_to_fp32(wb->d) * duet_fp16_to_fp32(xb->d) * dot;
                s += term;
                m += fabs(term);
            }
            size_t i = (size_t)t * c->n_out + o;
            double extra = (c->bias ? bias[o] : 0.0) + init[i];
            ref[i] = (float)(s + extra);
            mag[i] = (float)(m + fabs(extra));
        }

    static const int threads[] = {1, 3};
    int isas = n_isas();
    for (int isa = 0; isa < isas; isa++)
        for (int th = 0; th < 2; th++) {
            setenv("DUET_CPU_ISA", ISA_NAMES[isa], 1);
            duet_backend_params p = {.n_threads = threads[th]};
            duet_backend *be;
            duet_status st = duet_backend_open("cpu", 0, &p, &be);
            unsetenv("DUET_CPU_ISA");
            ck_assert_msg(st == DUET_OK, "open cpu: %s", duet_last_error());
            run_mm(be, c, w, x, NULL, bias, init, o1);
            run_mm(be, c, w, NULL, xq, bias, init, o2);
            mm_case alone = *c;
            alone.n_tokens = 1;
            for (int t = 0; t < c->n_tokens; t++) {
                run_mm(be, &alone, w, NULL, xq + (size_t)t * nb, bias, init + (size_t)t * c->n_out, o3);
                for (int o = 0; o < c->n_out; o++)
                    ck_assert_msg(
                        memcmp(&o3[GUARD + o], &o2[GUARD + (size_t)t * c->n_out + o], 4) == 0,
                        "%s/%d threads, %dx%d: token %d of %d row %d: %.9g alone, %.9g in the batch",
                        ISA_NAMES[isa], threads[th], c->n_out, c->n_in, t, c->n_tokens, o,
                        (double)o3[GUARD + o], (double)o2[GUARD + (size_t)t * c->n_out + o]);
            }
            for (size_t i = 0; i < n_o; i++) {
                int t = (int)(i / c->n_out), o = (int)(i % c->n_out);
                ck_assert_msg(memcmp(&o1[GUARD + i], &o2[GUARD + i], 4) == 0,
                              "%s/%d threads, %dx%d, %d tokens: token %d row %d: f32 x gives %.9g, x_q8 %.9g",
                              ISA_NAMES[isa], threads[th], c->n_out, c->n_in, c->n_tokens, t, o,
                              (double)o1[GUARD + i], (double)o2[GUARD + i]);
                /* f32 sums of nb products, each rounded a few times */
                double err = fabs((double)o2[GUARD + i] - ref[i]);
                ck_assert_msg(
                    err <= (nb + 8) * 1.2e-7 * mag[i] + 1e-6,
                    "%s/%d threads, %dx%d, %d tokens: token %d row %d: %.9g, reference %.9g (|terms| %g)",
                    ISA_NAMES[isa], threads[th], c->n_out, c->n_in, c->n_tokens, t, o, (double)o2[GUARD + i],
                    (double)ref[i], (double)mag[i]);
            }
            duet_backend_close(be);
        }
    free(w), free(xq), free(x), free(bias), free(init), free(ref), free(mag), free(o1), free(o2), free(o3);
}

/* Token counts: the tile (1-2), one panel group (3-16), balanced groups
 * (17, 33), and with n_in 4096 several token chunks (48 tokens each). */
START_TEST(matmul_q8_shapes) {
    static const mm_case cases[] = {
        {16, 32, 1, false, false},    {17, 64, 2, true, false},    {33, 96, 3, false, true},
        {16, 64, 4, false, false},    {1, 32, 5, true, true},      {15, 160, 7, false, false},
        {50, 768, 16, true, false},   {31, 256, 17, false, true},  {48, 96, 33, true, true},
        {20, 64, 40, false, false},   {64, 768, 12, false, false}, {3, 32, 16, true, true},
        {40, 4096, 100, true, false},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        check_case(&cases[i]);
}
END_TEST

/* Random shapes around the panel's edges. */
START_TEST(matmul_q8_random) {
    for (int i = 0; i < 40; i++) {
        mm_case c = {1 + rng_int(70), 32 * (1 + rng_int(12)), 1 + rng_int(40), rng_int(2) == 1,
                     rng_int(2) == 1};
        check_case(&c);
    }
}
END_TEST

/* The other block types: a token's result is the same bits alone or in a
 * batch of any size, with f32 x or its q8_0 blocks, on every ISA and thread
 * count: 9 rows (the 4-, 2- and 1-token tiles, row tails), and 37 rows by 37
 * tokens (avx512's 16-row panels, the last moved back; token groups of 16,
 * 4 and 1 from a kept pack; a row of 17 chunks for the 32-blocks: a partial
 * pack unit). */
static void blocks_batch_invariant(duet_dtype type, int n_out, int n_in, int T) {
    float *wf = malloc(sizeof(float) * n_in), *x = malloc(sizeof(float) * T * n_in);
    float *batch = malloc(sizeof(float) * T * n_out), *viaq = malloc(sizeof(float) * T * n_out);
    float *alone = malloc(sizeof(float) * n_out);
    duet_block_q8_0 *xq = malloc(sizeof *xq * T * (n_in / 32));
    for (int i = 0; i < T * n_in; i++)
        x[i] = rng_uniform(-2.0f, 2.0f);
    for (int t = 0; t < T; t++)
        duet_quantize_row_q8_0(x + t * n_in, xq + t * (n_in / 32), n_in);
    const size_t rb = duet_dtype_row_bytes(type, n_in);
    uint8_t *w = malloc(rb * n_out);
    for (int o = 0; o < n_out; o++) {
        for (int i = 0; i < n_in; i++)
            wf[i] = rng_uniform(-1.0f, 1.0f);
        duet_convert_row(type, wf, w + o * rb, n_in);
    }
    for (int isa = 0; isa < n_isas(); isa++)
        for (int th = 1; th <= 3; th += 2) {
            setenv("DUET_CPU_ISA", ISA_NAMES[isa], 1);
            duet_backend *be;
            ck_assert_int_eq(duet_backend_open("cpu", 0, &(duet_backend_params){.n_threads = th}, &be),
                             DUET_OK);
            unsetenv("DUET_CPU_ISA");
            duet_op op = {.kind = DUET_OP_MATMUL, .n_tokens = T};
            op.matmul.dtype = type;
            op.matmul.n_in = n_in;
            op.matmul.n_out = n_out;
            ck_assert_int_eq(duet__cpu_matmul((cpu_backend *)be, &op, w, x, NULL, NULL, batch), DUET_OK);
            ck_assert_int_eq(duet__cpu_matmul((cpu_backend *)be, &op, w, NULL, xq, NULL, viaq), DUET_OK);
            ck_assert_msg(memcmp(batch, viaq, sizeof(float) * T * n_out) == 0, "%s/%s: f32 x and x_q8 differ",
                          duet_dtype_name(type), ISA_NAMES[isa]);
            op.n_tokens = 1;
            for (int t = 0; t < T; t++) {
                ck_assert_int_eq(
                    duet__cpu_matmul((cpu_backend *)be, &op, w, NULL, xq + t * (n_in / 32), NULL, alone),
                    DUET_OK);
                ck_assert_msg(memcmp(alone, batch + t * n_out, sizeof(float) * n_out) == 0,
                              "%s/%s/%d threads, %d rows: token %d alone differs from the batch",
                              duet_dtype_name(type), ISA_NAMES[isa], th, n_out, t);
            }
            duet_backend_close(be);
        }
    free(w), free(wf), free(x), free(batch), free(viaq), free(xq), free(alone);
}

START_TEST(matmul_blocks_batch_invariant) {
    static const duet_dtype types[] = {DUET_DTYPE_Q4_0,   DUET_DTYPE_Q4_1, DUET_DTYPE_Q5_0,  DUET_DTYPE_Q5_1,
                                       DUET_DTYPE_IQ4_NL, DUET_DTYPE_Q2_K, DUET_DTYPE_Q3_K,  DUET_DTYPE_Q4_K,
                                       DUET_DTYPE_Q5_K,   DUET_DTYPE_Q6_K, DUET_DTYPE_IQ4_XS};
    for (size_t k = 0; k < sizeof types / sizeof types[0]; k++) {
        blocks_batch_invariant(types[k], 9, 512, 11);
        blocks_batch_invariant(types[k], 37, duet_dtype_block(types[k]) == 32 ? 544 : 512, 37);
    }
}
END_TEST

/* ---- Q4_0's and Q5_0's repacked layout ------------------------------------ */

/* One op in a step of its own, through the HAL (where the cpu backend
 * repacks and restores weights). */
static void hal_op(duet_backend *be, const duet_op *op) {
    ck_assert_int_eq(duet_step_begin(be), DUET_OK);
    duet_status st = duet_step_op(be, op);
    ck_assert_msg(st == DUET_OK, "%s: %s", duet_op_name(op->kind), duet_last_error());
    ck_assert_int_eq(duet_step_submit(be), DUET_OK);
    ck_assert_int_eq(duet_step_wait(be), DUET_OK);
}

/* A matmul of the `dt` (Q4_0 or Q5_0) matrix at `off` in wbuf: n_out
 * rows, T tokens (x_q8 when q8; every x is x_const unless that is 0), bias
 * and accumulate. Through the HAL it must give the bits the plain kernels
 * (duet__cpu_matmul on the host bytes w) give, and leave the buffer
 * repacked as `rp_rows` says. */
static void rp_matmul(duet_backend *be, duet_dtype dt, duet_buffer *wbuf, size_t off, const uint8_t *w,
                      int n_out, int n_in, int T, bool q8, float x_const, int64_t rp_rows, const char *what) {
    const int nb = n_in / 32;
    float *x = malloc(sizeof(float) * T * n_in), *bias = malloc(sizeof(float) * n_out);
    float *want = malloc(sizeof(float) * T * n_out), *got = malloc(sizeof(float) * T * n_out);
    duet_block_q8_0 *xq = malloc(sizeof *xq * T * nb);
    for (int i = 0; i < T * n_in; i++)
        x[i] = x_const != 0.0f ? x_const : rng_uniform(-2.0f, 2.0f);
    for (int t = 0; t < T; t++)
        duet_quantize_row_q8_0(x + t * n_in, xq + t * nb, n_in);
    for (int o = 0; o < n_out; o++)
        bias[o] = rng_uniform(-1.0f, 1.0f);
    for (int i = 0; i < T * n_out; i++)
        want[i] = got[i] = rng_uniform(-1.0f, 1.0f); /* accumulated onto */
    duet_op op = {.kind = DUET_OP_MATMUL, .n_tokens = T};
    op.matmul.dtype = dt;
    op.matmul.n_in = n_in;
    op.matmul.n_out = n_out;
    op.matmul.accumulate = true;
    ck_assert_int_eq(duet__cpu_matmul((cpu_backend *)be, &op, w, q8 ? NULL : x, q8 ? xq : NULL, bias, want),
                     DUET_OK);
    duet_buffer *xb, *bb, *ob;
    const size_t xbytes = q8 ? sizeof *xq * T * nb : sizeof(float) * T * n_in;
    ck_assert_int_eq(duet_buffer_alloc(be, xbytes, &xb), DUET_OK);
    ck_assert_int_eq(duet_buffer_alloc(be, sizeof(float) * n_out, &bb), DUET_OK);
    ck_assert_int_eq(duet_buffer_alloc(be, sizeof(float) * T * n_out, &ob), DUET_OK);
    ck_assert_int_eq(duet_buffer_upload(be, xb, 0, q8 ? (const void *)xq : (const void *)x, xbytes), DUET_OK);
    ck_assert_int_eq(duet_buffer_upload(be, bb, 0, bias, sizeof(float) * n_out), DUET_OK);
    ck_assert_int_eq(duet_buffer_upload(be, ob, 0, got, sizeof(float) * T * n_out), DUET_OK);
    op.matmul.w = (duet_view){wbuf, off};
    if (q8)
        op.matmul.x_q8 = (duet_view){xb, 0};
    else
        op.matmul.x = (duet_view){xb, 0};
    op.matmul.bias = (duet_view){bb, 0};
    op.matmul.out = (duet_view){ob, 0};
    hal_op(be, &op);
    ck_assert_msg(wbuf->rp_rows == rp_rows, "%s: %lld rows repacked, want %lld", what,
                  (long long)wbuf->rp_rows, (long long)rp_rows);
    ck_assert_int_eq(duet_buffer_download(be, ob, 0, got, sizeof(float) * T * n_out), DUET_OK);
    for (int i = 0; i < T * n_out; i++)
        ck_assert_msg(memcmp(&got[i], &want[i], 4) == 0,
                      "%s: %d x %d, %d tokens: token %d row %d: %.9g, plain %.9g", what, n_out, n_in, T,
                      i / n_out, i % n_out, (double)got[i], (double)want[i]);
    duet_buffer_free(be, xb), duet_buffer_free(be, bb), duet_buffer_free(be, ob);
    free(x), free(bias), free(want), free(got), free(xq);
}

/* Q4_0 and Q5_0 weights through the HAL on every path and thread count: the
 * repacked kernels give the plain kernels' bits (decode, 2-7 tokens, the
 * 8-token passes and their tails; row counts with 1 to 15 plain tail rows
 * and below one group), x or x_q8; embedding lookups read the layout; a
 * download gives the uploaded bytes back; an upload, another shape or
 * $DUET_CPU_REPACK=0 leave or make the plain layout, with the same results.
 * The last case has the largest integer dots (q 15 or 31 against x 127:
 * the avx2 kernels' 16-bit sums must not wrap). */
static void blocks_repacked(duet_dtype dt) {
    static const struct {
        int n_out, n_in, T;
    } cases[] = {{37, 544, 1}, {37, 544, 11}, {53, 96, 19}, {16, 64, 2},
                 {15, 64, 3},  {100, 256, 9}, {32, 128, 3}};
    const size_t off = 96; /* the matrix need not start the buffer */
    for (int isa = 0; isa < n_isas(); isa++)
        for (int th = 1; th <= 3; th += 2)
            for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
                const int n_out = cases[k].n_out, n_in = cases[k].n_in, T = cases[k].T;
                const size_t ws = duet_dtype_row_bytes(dt, n_in), bytes = ws * n_out;
                uint8_t *w = malloc(bytes), *back = malloc(bytes);
                float *wf = malloc(sizeof(float) * n_in), *row = malloc(sizeof(float) * n_in);
                const bool big = k == 6;
                const float xc = big ? 2.0f : 0.0f;
                for (int o = 0; o < n_out; o++) {
                    /* big: -1 sets the scale (q 0), the rest q's largest. */
                    for (int i = 0; i < n_in; i++)
                        wf[i] = !big ? rng_uniform(-1.0f, 1.0f) : i % 32 == 0 ? -1.0f : 0.9375f;
                    duet_convert_row(dt, wf, w + o * ws, n_in);
                }
                setenv("DUET_CPU_ISA", ISA_NAMES[isa], 1);
                if (k == 5) setenv("DUET_CPU_REPACK", "0", 1);
                duet_backend *be;
                ck_assert_int_eq(duet_backend_open("cpu", 0, &(duet_backend_params){.n_threads = th}, &be),
                                 DUET_OK);
                unsetenv("DUET_CPU_ISA");
                unsetenv("DUET_CPU_REPACK");
                const int64_t groups = isa > 0 && k != 5 ? n_out / CPU_RP_ROWS * CPU_RP_ROWS : 0;
                char what[64];
                snprintf(what, sizeof what, "%s %s/%d threads", duet_dtype_name(dt), ISA_NAMES[isa], th);
                duet_buffer *wb;
                ck_assert_int_eq(duet_buffer_alloc(be, off + bytes + 40, &wb), DUET_OK);
                ck_assert_int_eq(duet_buffer_upload(be, wb, off, w, bytes), DUET_OK);
                rp_matmul(be, dt, wb, off, w, n_out, n_in, T, k % 2 == 1, xc, groups, what);
                rp_matmul(be, dt, wb, off, w, n_out, n_in, 1, k % 2 == 0, xc, groups, what);

                /* Embedding lookups of group rows and tail rows. */
                int32_t toks[5] = {0, n_out - 1, n_out / 2, 15 % n_out, rng_int(n_out)};
                duet_buffer *tb, *eb;
                ck_assert_int_eq(duet_buffer_alloc(be, sizeof toks, &tb), DUET_OK);
                ck_assert_int_eq(duet_buffer_alloc(be, sizeof(float) * 5 * n_in, &eb), DUET_OK);
                ck_assert_int_eq(duet_buffer_upload(be, tb, 0, toks, sizeof toks), DUET_OK);
                duet_op eo = {.kind = DUET_OP_EMBED, .n_tokens = 5};
                eo.embed.tokens = (duet_view){tb, 0};
                eo.embed.table = (duet_view){wb, off};
                eo.embed.dtype = dt;
                eo.embed.dim = n_in;
                eo.embed.out = (duet_view){eb, 0};
                hal_op(be, &eo);
                ck_assert_msg(wb->rp_rows == groups, "%s: embed changed the layout", what);
                float *emb = malloc(sizeof(float) * 5 * n_in);
                ck_assert_int_eq(duet_buffer_download(be, eb, 0, emb, sizeof(float) * 5 * n_in), DUET_OK);
                for (int t = 0; t < 5; t++) {
                    duet_dequantize_row(dt, w + toks[t] * ws, row, n_in);
                    ck_assert_msg(memcmp(row, emb + t * n_in, sizeof(float) * n_in) == 0,
                                  "%s: embedding row %d differs from the plain row", what, toks[t]);
                }
                free(emb);

                /* A download restores the bytes as uploaded; the next matmul repacks again. */
                ck_assert_int_eq(duet_buffer_download(be, wb, off, back, bytes), DUET_OK);
                ck_assert_msg(memcmp(back, w, bytes) == 0, "%s: download differs from the upload", what);
                ck_assert_int_eq((int)wb->rp_rows, 0);
                rp_matmul(be, dt, wb, off, w, n_out, n_in, T, false, xc, groups, what);

                /* A partial upload (row 1 anew) lands on the plain layout. */
                for (int i = 0; i < n_in; i++)
                    wf[i] = rng_uniform(-1.0f, 1.0f);
                duet_convert_row(dt, wf, w + ws, n_in);
                ck_assert_int_eq(duet_buffer_upload(be, wb, off + ws, w + ws, ws), DUET_OK);
                rp_matmul(be, dt, wb, off, w, n_out, n_in, T, true, xc, groups, what);

                /* The same bytes as a 17-row matrix (another shape where
                 * that is not the same whole groups): restored, and plain
                 * from then on for both shapes (no conversions back and forth). */
                const int m = n_out < 17 ? n_out : 17;
                const bool other = groups && m / 16 * 16 != groups;
                rp_matmul(be, dt, wb, off, w, m, n_in, T, false, xc, other ? 0 : groups, what);
                rp_matmul(be, dt, wb, off, w, n_out, n_in, 1, true, xc, other ? 0 : groups, what);

                duet_buffer_free(be, tb), duet_buffer_free(be, eb), duet_buffer_free(be, wb);
                duet_backend_close(be);
                free(w), free(back), free(wf), free(row);
            }
}

START_TEST(matmul_q4_0_repacked) {
    blocks_repacked(DUET_DTYPE_Q4_0);
}
END_TEST

START_TEST(matmul_q5_0_repacked) {
    blocks_repacked(DUET_DTYPE_Q5_0);
}
END_TEST

/* ---- F16's repacked layout ---------------------------------------------- */

/* The F16 matrix at `off` in wbuf (host bytes w): T tokens through the HAL
 * with bias and accumulate must match the plain kernels (duet__cpu_matmul
 * on w) within 1e-5 of each output's magnitude (sum |w x| + |bias| + |out|:
 * the repacked kernels sum in another order), leave the buffer repacked as
 * `rp_rows` says, and give each token the same bits when it runs alone
 * (batch invariance; the ops then find the layout already in place). */
static void f16rp_matmul(duet_backend *be, duet_buffer *wbuf, size_t off, const uint16_t *w, int n_out,
                         int n_in, int T, int64_t rp_rows, const char *what) {
    float *x = malloc(sizeof(float) * T * n_in), *bias = malloc(sizeof(float) * n_out);
    float *init = malloc(sizeof(float) * T * n_out), *want = malloc(sizeof(float) * T * n_out);
    float *got = malloc(sizeof(float) * T * n_out), *one = malloc(sizeof(float) * n_out);
    for (int i = 0; i < T * n_in; i++)
        x[i] = rng_uniform(-2.0f, 2.0f);
    for (int o = 0; o < n_out; o++)
        bias[o] = rng_uniform(-1.0f, 1.0f);
    for (int i = 0; i < T * n_out; i++)
        init[i] = want[i] = rng_uniform(-1.0f, 1.0f); /* accumulated onto */
    duet_op op = {.kind = DUET_OP_MATMUL, .n_tokens = T};
    op.matmul.dtype = DUET_DTYPE_F16;
    op.matmul.n_in = n_in;
    op.matmul.n_out = n_out;
    op.matmul.accumulate = true;
    ck_assert_int_eq(duet__cpu_matmul((cpu_backend *)be, &op, w, x, NULL, bias, want), DUET_OK);
    duet_buffer *xb, *bb, *ob;
    ck_assert_int_eq(duet_buffer_alloc(be, sizeof(float) * T * n_in, &xb), DUET_OK);
    ck_assert_int_eq(duet_buffer_alloc(be, sizeof(float) * n_out, &bb), DUET_OK);
    ck_assert_int_eq(duet_buffer_alloc(be, sizeof(float) * T * n_out, &ob), DUET_OK);
    ck_assert_int_eq(duet_buffer_upload(be, xb, 0, x, sizeof(float) * T * n_in), DUET_OK);
    ck_assert_int_eq(duet_buffer_upload(be, bb, 0, bias, sizeof(float) * n_out), DUET_OK);
    ck_assert_int_eq(duet_buffer_upload(be, ob, 0, init, sizeof(float) * T * n_out), DUET_OK);
    op.matmul.w = (duet_view){wbuf, off};
    op.matmul.x = (duet_view){xb, 0};
    op.matmul.bias = (duet_view){bb, 0};
    op.matmul.out = (duet_view){ob, 0};
    hal_op(be, &op);
    ck_assert_msg(wbuf->rp_rows == rp_rows, "%s: %lld rows repacked, want %lld", what,
                  (long long)wbuf->rp_rows, (long long)rp_rows);
    ck_assert_int_eq(duet_buffer_download(be, ob, 0, got, sizeof(float) * T * n_out), DUET_OK);
    for (int t = 0; t < T; t++)
        for (int o = 0; o < n_out; o++) {
            double mag = fabs(bias[o]) + fabs(init[t * n_out + o]);
            for (int i = 0; i < n_in; i++)
                mag += fabs((double)duet_fp16_to_fp32(w[(size_t)o * n_in + i]) * x[t * n_in + i]);
            const float g = got[t * n_out + o], p = want[t * n_out + o];
            ck_assert_msg(fabs((double)g - p) <= 1e-5 * mag,
                          "%s: %d x %d, %d tokens: token %d row %d: %.9g, plain %.9g (magnitude %.3g)", what,
                          n_out, n_in, T, t, o, (double)g, (double)p, mag);
        }
    /* Each token alone: the same bits as in the batch. */
    op.n_tokens = 1;
    for (int t = 0; t < T; t++) {
        op.matmul.x = (duet_view){xb, sizeof(float) * (size_t)t * n_in};
        op.matmul.out = (duet_view){ob, sizeof(float) * (size_t)t * n_out};
        ck_assert_int_eq(duet_buffer_upload(be, ob, sizeof(float) * (size_t)t * n_out, init + t * n_out,
                                            sizeof(float) * n_out),
                         DUET_OK);
        hal_op(be, &op);
        ck_assert_int_eq(
            duet_buffer_download(be, ob, sizeof(float) * (size_t)t * n_out, one, sizeof(float) * n_out),
            DUET_OK);
        for (int o = 0; o < n_out; o++)
            ck_assert_msg(memcmp(&one[o], &got[t * n_out + o], 4) == 0,
                          "%s: %d x %d: token %d of %d alone, row %d: %.9g, in the batch %.9g", what, n_out,
                          n_in, t, T, o, (double)one[o], (double)got[t * n_out + o]);
    }
    ck_assert_msg(wbuf->rp_rows == rp_rows, "%s: one-token ops changed the layout", what);
    duet_buffer_free(be, xb), duet_buffer_free(be, bb), duet_buffer_free(be, ob);
    free(x), free(bias), free(init), free(want), free(got), free(one);
}

/* F16 weights through the HAL on every path and thread count: repacked on
 * avx512 only; close to the plain kernels and batch invariant (decode, the
 * 12-token passes and the last pass of the rest, 1 to 15 plain tail rows, rows
 * below one group, odd columns); embedding lookups read the layout; a
 * download gives the uploaded bytes back; an upload lands on the plain
 * layout; $DUET_CPU_REPACK=0 leaves it plain. */
START_TEST(matmul_f16_repacked) {
    static const struct {
        int n_out, n_in, T;
    } cases[] = {{37, 96, 1}, {64, 96, 31},  {53, 67, 29}, {16, 64, 2},
                 {15, 64, 3}, {100, 256, 9}, {144, 40, 13}};
    const size_t off = 96; /* the matrix need not start the buffer */
    const size_t n_cases = sizeof cases / sizeof cases[0];
    for (int isa = 0; isa < n_isas(); isa++)
        for (int th = 1; th <= 3; th += 2)
            for (size_t k = 0; k < n_cases; k++) {
                const int n_out = cases[k].n_out, n_in = cases[k].n_in, T = cases[k].T;
                const bool no_repack = k == n_cases - 1;
                const size_t ws = duet_dtype_row_bytes(DUET_DTYPE_F16, n_in), bytes = ws * n_out;
                uint16_t *w = malloc(bytes), *back = malloc(bytes);
                float *row = malloc(sizeof(float) * n_in);
                for (int i = 0; i < n_out * n_in; i++)
                    w[i] = duet_fp32_to_fp16(rng_uniform(-1.0f, 1.0f));
                setenv("DUET_CPU_ISA", ISA_NAMES[isa], 1);
                if (no_repack) setenv("DUET_CPU_REPACK", "0", 1);
                duet_backend *be;
                ck_assert_int_eq(duet_backend_open("cpu", 0, &(duet_backend_params){.n_threads = th}, &be),
                                 DUET_OK);
                unsetenv("DUET_CPU_ISA");
                unsetenv("DUET_CPU_REPACK");
                const int64_t groups = isa == 2 && !no_repack ? n_out / CPU_RP_ROWS * CPU_RP_ROWS : 0;
                char what[64];
                snprintf(what, sizeof what, "f16 %s/%d threads", ISA_NAMES[isa], th);
                duet_buffer *wb;
                ck_assert_int_eq(duet_buffer_alloc(be, off + bytes + 40, &wb), DUET_OK);
                ck_assert_int_eq(duet_buffer_upload(be, wb, off, w, bytes), DUET_OK);
                f16rp_matmul(be, wb, off, w, n_out, n_in, T, groups, what);

                /* Embedding lookups of group rows and tail rows. */
                int32_t toks[5] = {0, n_out - 1, n_out / 2, 15 % n_out, rng_int(n_out)};
                duet_buffer *tb, *eb;
                ck_assert_int_eq(duet_buffer_alloc(be, sizeof toks, &tb), DUET_OK);
                ck_assert_int_eq(duet_buffer_alloc(be, sizeof(float) * 5 * n_in, &eb), DUET_OK);
                ck_assert_int_eq(duet_buffer_upload(be, tb, 0, toks, sizeof toks), DUET_OK);
                duet_op eo = {.kind = DUET_OP_EMBED, .n_tokens = 5};
                eo.embed.tokens = (duet_view){tb, 0};
                eo.embed.table = (duet_view){wb, off};
                eo.embed.dtype = DUET_DTYPE_F16;
                eo.embed.dim = n_in;
                eo.embed.out = (duet_view){eb, 0};
                hal_op(be, &eo);
                ck_assert_msg(wb->rp_rows == groups, "%s: embed changed the layout", what);
                float *emb = malloc(sizeof(float) * 5 * n_in);
                ck_assert_int_eq(duet_buffer_download(be, eb, 0, emb, sizeof(float) * 5 * n_in), DUET_OK);
                for (int t = 0; t < 5; t++) {
                    duet_dequantize_row(DUET_DTYPE_F16, w + (size_t)toks[t] * n_in, row, n_in);
                    ck_assert_msg(memcmp(row, emb + t * n_in, sizeof(float) * n_in) == 0,
                                  "%s: embedding row %d differs from the plain row", what, toks[t]);
                }
                free(emb);

                /* A download restores the bytes as uploaded; the next matmul repacks again. */
                ck_assert_int_eq(duet_buffer_download(be, wb, off, back, bytes), DUET_OK);
                ck_assert_msg(memcmp(back, w, bytes) == 0, "%s: download differs from the upload", what);
                ck_assert_int_eq((int)wb->rp_rows, 0);
                f16rp_matmul(be, wb, off, w, n_out, n_in, T, groups, what);

                /* A partial upload (row 1 anew) lands on the plain layout. */
                for (int i = 0; i < n_in; i++)
                    w[n_in + i] = duet_fp32_to_fp16(rng_uniform(-1.0f, 1.0f));
                ck_assert_int_eq(duet_buffer_upload(be, wb, off + ws, w + n_in, ws), DUET_OK);
                f16rp_matmul(be, wb, off, w, n_out, n_in, 1, groups, what);
                ck_assert_int_eq(duet_buffer_download(be, wb, off, back, bytes), DUET_OK);
                ck_assert_msg(memcmp(back, w, bytes) == 0, "%s: download after an upload differs", what);

                duet_buffer_free(be, tb), duet_buffer_free(be, eb), duet_buffer_free(be, wb);
                duet_backend_close(be);
                free(w), free(back), free(row);
            }
}
END_TEST

START_TEST(matmul_x_q8_needs_q8_weights) {
    duet_backend_params p = {.n_threads = 1};
    duet_backend *be;
    ck_assert_msg(duet_backend_open("cpu", 0, &p, &be) == DUET_OK, "open cpu: %s", duet_last_error());
    duet_op op = {.kind = DUET_OP_MATMUL, .n_tokens = 1};
    op.matmul.dtype = DUET_DTYPE_F16;
    op.matmul.n_in = 32;
    op.matmul.n_out = 1;
    uint16_t w[32] = {0};
    duet_block_q8_0 xq = {0};
    float out = 0.0f;
    duet_status st = duet__cpu_matmul((cpu_backend *)be, &op, w, NULL, &xq, NULL, &out);
    ck_assert_msg(st == DUET_INVALID_ARGUMENT, "f16 weights with x_q8: status %d, want invalid argument", st);
    duet_backend_close(be);
}
END_TEST

int main(void) {
    Suite *s = suite_create("cpu_matmul");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 600);
    tcase_add_test(tc, quantize_matches_reference);
    tcase_add_test(tc, matmul_q8_shapes);
    tcase_add_test(tc, matmul_q8_random);
    tcase_add_test(tc, matmul_blocks_batch_invariant);
    tcase_add_test(tc, matmul_q4_0_repacked);
    tcase_add_test(tc, matmul_q5_0_repacked);
    tcase_add_test(tc, matmul_f16_repacked);
    tcase_add_test(tc, matmul_x_q8_needs_q8_weights);
    suite_add_tcase(s, tc);
    return test_run_suite(s);
}
