/* test_quants.c — the block weight formats of backends/quants.c: the type
 * table's rows, round-trip error bounds on Gaussian rows (the quality the
 * scale searches must keep), and edge cases: all-zero blocks, huge, tiny
 * and constant rows, spikes, random bytes with sane scales (finite output),
 * Q8_K's block sums.
 *
 * Bit-exactness against the gguf Python package, and the quantizer bytes of
 * the 32-blocks, are checked by tests/test_quants_reference.py.
 */
#include <math.h>

#include "backend.h"
#include "test_util.h"

#define N 4096 /* a row: a multiple of every block */

typedef struct type_case {
    duet_dtype t;
    const char *name;
    int block;
    size_t bytes;
    bool weight;
    double rmse;    /* bound on unit-Gaussian rows: ~10% above what the searches reach */
    int fp16_at[2]; /* byte offsets of the block's fp16 scales (-1: none) */
} type_case;

static const type_case CASES[] = {
    {DUET_DTYPE_Q4_0, "q4_0", 32, 18, true, 0.094, {0, -1}},
    {DUET_DTYPE_Q4_1, "q4_1", 32, 20, true, 0.086, {0, 2}},
    {DUET_DTYPE_Q5_0, "q5_0", 32, 22, true, 0.047, {0, -1}},
    {DUET_DTYPE_Q5_1, "q5_1", 32, 24, true, 0.042, {0, 2}},
    {DUET_DTYPE_Q8_0, "q8_0", 32, 34, true, 0.0059, {0, -1}},
    {DUET_DTYPE_Q2_K, "q2_k", 256, 84, true, 0.327, {80, 82}},
    {DUET_DTYPE_Q3_K, "q3_k", 256, 110, true, 0.166, {108, -1}},
    {DUET_DTYPE_Q4_K, "q4_k", 256, 144, true, 0.079, {0, 2}},
    {DUET_DTYPE_Q5_K, "q5_k", 256, 176, true, 0.040, {0, 2}},
    {DUET_DTYPE_Q6_K, "q6_k", 256, 210, true, 0.0195, {208, -1}},
    {DUET_DTYPE_IQ4_NL, "iq4_nl", 32, 18, true, 0.084, {0, -1}},
    {DUET_DTYPE_IQ4_XS, "iq4_xs", 256, 136, true, 0.085, {0, -1}},
    {DUET_DTYPE_Q8_K, "q8_k", 256, 292, false, 0.0077, {-1, -1}}, /* f32 scale */
};
#define N_CASES (int)(sizeof CASES / sizeof CASES[0])

/* Box-Muller over a fixed LCG: the same rows on every machine. */
static double gauss(unsigned long long *s) {
    double u[2];
    for (int i = 0; i < 2; i++) {
        *s = *s * 6364136223846793005ULL + 1442695040888963407ULL;
        u[i] = ((double)(*s >> 11) + 0.5) / 9007199254740992.0;
    }
    return sqrt(-2 * log(u[0])) * cos(6.283185307179586 * u[1]);
}

/* Quantizes x and reads it back into y; returns the RMSE. */
static double round_trip(duet_dtype t, const float *x, float *y, int n) {
    void *q = malloc(duet_dtype_row_bytes(t, n));
    ck_assert_ptr_nonnull(q);
    duet_convert_row(t, x, q, n);
    duet_dequantize_row(t, q, y, n);
    free(q);
    double se = 0;
    for (int i = 0; i < n; i++)
        se += ((double)y[i] - x[i]) * ((double)y[i] - x[i]);
    return sqrt(se / n);
}

static void all_finite(const float *y, int n, const char *what) {
    for (int i = 0; i < n; i++)
        ck_assert_msg(isfinite(y[i]), "%s: y[%d] = %g", what, i, y[i]);
}

START_TEST(test_table) {
    for (int c = 0; c < N_CASES; c++) {
        const type_case *k = &CASES[c];
        ck_assert_str_eq(duet_dtype_name(k->t), k->name);
        ck_assert_int_eq(duet_dtype_block(k->t), k->block);
        ck_assert_uint_eq(duet_dtype_block_bytes(k->t), k->bytes);
        ck_assert_int_eq(duet_dtype_is_weight(k->t), k->weight);
        ck_assert_uint_eq(duet_dtype_row_bytes(k->t, 2 * k->block), 2 * k->bytes);
        ck_assert_uint_eq(duet_dtype_row_bytes(k->t, k->block + 1), 0);
        /* Every weight block is whole 32-value groups: its matmuls read q8_0
         * activations; q8_K (activations only) does not. */
        ck_assert_int_eq(duet_dtype_takes_q8_activations(k->t), k->weight);
    }
    ck_assert_int_eq(duet_iq4nl_values[0], -127);
    ck_assert_int_eq(duet_iq4nl_values[15], 113);
}
END_TEST

START_TEST(test_gaussian_rmse) {
    float *x = malloc(sizeof(float) * N), *y = malloc(sizeof(float) * N);
    for (int c = 0; c < N_CASES; c++) {
        unsigned long long s = 99;
        double se = 0;
        for (int r = 0; r < 8; r++) {
            for (int i = 0; i < N; i++)
                x[i] = (float)gauss(&s);
            const double e = round_trip(CASES[c].t, x, y, N);
            se += e * e;
            all_finite(y, N, CASES[c].name);
        }
        const double rmse = sqrt(se / 8);
        ck_assert_msg(rmse < CASES[c].rmse, "%s: RMSE %.5f >= %.5f", CASES[c].name, rmse, CASES[c].rmse);
        /* The error scales with the data: the same rows times 1000 and
         * times 0.001 (fp16 scales stay normal) cost the same relative RMSE. */
        for (double scale = 1e-3; scale < 1e4; scale *= 1e6) {
            s = 99;
            for (int i = 0; i < N; i++)
                x[i] = (float)(scale * gauss(&s));
            const double e = round_trip(CASES[c].t, x, y, N) / scale;
            all_finite(y, N, CASES[c].name);
            ck_assert_msg(e < CASES[c].rmse * 1.1, "%s x%g: relative RMSE %.5f", CASES[c].name, scale, e);
        }
    }
    free(x);
    free(y);
}
END_TEST

START_TEST(test_zero_and_tiny) {
    float x[N], y[N];
    for (int c = 0; c < N_CASES; c++) {
        memset(x, 0, sizeof x);
        round_trip(CASES[c].t, x, y, N);
        for (int i = 0; i < N; i++)
            ck_assert_msg(y[i] == 0.0f, "%s: zeros read back as %g", CASES[c].name, y[i]);
        /* Far below fp16's range: the scale flushes to zero, never to NaN. */
        unsigned long long s = 5;
        for (int i = 0; i < N; i++)
            x[i] = (float)(1e-30 * gauss(&s));
        round_trip(CASES[c].t, x, y, N);
        for (int i = 0; i < N; i++)
            ck_assert_msg(fabsf(y[i]) <= 1e-28f, "%s: tiny -> %g", CASES[c].name, y[i]);
        /* Mixed: one zero block next to ordinary ones. */
        for (int i = 0; i < N; i++)
            x[i] = i < 256 ? 0.0f : (float)gauss(&s);
        round_trip(CASES[c].t, x, y, N);
        all_finite(y, N, CASES[c].name);
        for (int i = 0; i < 256; i++)
            ck_assert_msg(y[i] == 0.0f, "%s: zero block -> %g", CASES[c].name, y[i]);
    }
}
END_TEST

START_TEST(test_constant_and_spike) {
    float x[N], y[N];
    for (int c = 0; c < N_CASES; c++) {
        const char *nm = CASES[c].name;
        for (float v = -0.7f; v < 1.0f; v += 1.4f) {
            for (int i = 0; i < N; i++)
                x[i] = v;
            round_trip(CASES[c].t, x, y, N);
            for (int i = 0; i < N; i++)
                ck_assert_msg(fabsf(y[i] - v) < 0.02f, "%s: constant %g -> %g", nm, v, y[i]);
        }
        /* One outlier per block dominates its scale; it must come back
         * close, the rest stays finite. Largest at fp16-safe magnitudes. */
        unsigned long long s = 11;
        for (int i = 0; i < N; i++)
            x[i] = (float)gauss(&s);
        for (int i = 0; i < N; i += 256)
            x[i + 17] = (i / 256) % 2 ? 3000.0f : -3000.0f;
        round_trip(CASES[c].t, x, y, N);
        all_finite(y, N, nm);
        for (int i = 0; i < N; i += 256)
            ck_assert_msg(fabsf(y[i + 17] - x[i + 17]) < 0.06f * 3000.0f, "%s: spike %g -> %g", nm, x[i + 17],
                          y[i + 17]);
    }
}
END_TEST

/* Random bytes with fp16 scales in [-2, 2]: every type reads back finite. */
START_TEST(test_random_blocks_finite) {
    unsigned long long s = 77;
    for (int c = 0; c < N_CASES; c++) {
        const type_case *k = &CASES[c];
        const int nb = N / k->block;
        uint8_t *q = malloc((size_t)nb * k->bytes);
        float *y = malloc(sizeof(float) * N);
        for (size_t i = 0; i < (size_t)nb * k->bytes; i++)
            q[i] = (uint8_t)(gauss(&s) * 1e6);
        for (int b = 0; b < nb; b++) {
            uint8_t *blk = q + (size_t)b * k->bytes;
            for (int f = 0; f < 2; f++)
                if (k->fp16_at[f] >= 0) {
                    const uint16_t h = duet_fp32_to_fp16((float)(gauss(&s) * 0.7));
                    memcpy(blk + k->fp16_at[f], &h, 2);
                }
            if (k->t == DUET_DTYPE_Q8_K) {
                const float d = (float)gauss(&s);
                memcpy(blk, &d, 4);
            }
        }
        duet_dequantize_row(k->t, q, y, N);
        all_finite(y, N, k->name);
        free(q);
        free(y);
    }
}
END_TEST

START_TEST(test_q8_K) {
    float x[N], y[N];
    duet_block_q8_K q[N / DUET_QK_K];
    unsigned long long s = 3;
    for (int i = 0; i < N; i++)
        x[i] = (float)gauss(&s);
    duet_quantize_row_q8_K(x, q, N);
    for (int b = 0; b < N / DUET_QK_K; b++)
        for (int j = 0; j < 16; j++) {
            int sum = 0;
            for (int i = 0; i < 16; i++) {
                sum += q[b].qs[16 * j + i];
                ck_assert_int_ge(q[b].qs[16 * j + i], -127);
            }
            ck_assert_int_eq(q[b].bsums[j], sum);
        }
    duet_dequantize_row(DUET_DTYPE_Q8_K, q, y, N);
    for (int i = 0; i < N; i++)
        ck_assert_msg(fabsf(y[i] - x[i]) <= fabsf(q[i / 256].d) * 0.5001f, "q8_K at %d", i);
}
END_TEST

static Suite *quants_suite(void) {
    Suite *s = suite_create("quants");
    TCase *tc = tcase_create("quants");
    tcase_add_test(tc, test_table);
    tcase_add_test(tc, test_gaussian_rmse);
    tcase_add_test(tc, test_zero_and_tiny);
    tcase_add_test(tc, test_constant_and_spike);
    tcase_add_test(tc, test_random_blocks_finite);
    tcase_add_test(tc, test_q8_K);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) {
    return test_run_suite(quants_suite());
}
