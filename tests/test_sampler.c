/* test_sampler.c — greedy, determinism, the distribution drawn from (exact
 * supports and a chi-square test), penalties and their window, validation,
 * non-finite logits and a full-size vocabulary. */
#include <check.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "sampler.h"
#include "test_util.h"

/* Plain softmax sampling: every filter and penalty off. */
static duet_sampling plain(uint64_t seed) {
    duet_sampling s = duet_sampling_default();
    s.temperature = 1.0f;
    s.top_k = 0;
    s.top_p = 1.0f;
    s.min_p = 0.0f;
    s.repetition_penalty = 1.0f;
    s.presence_penalty = 0.0f;
    s.frequency_penalty = 0.0f;
    s.penalty_last_n = 0;
    s.seed = seed;
    return s;
}

static duet_sampler *mk(const duet_sampling *s, int n_vocab) {
    duet_sampler *smp = NULL;
    duet_status st = duet_sampler_new(s, n_vocab, &smp);
    ck_assert_msg(st == DUET_OK, "duet_sampler_new failed: %s (%s)", duet_status_name(st), duet_last_error());
    ck_assert_ptr_nonnull(smp);
    return smp;
}

/* Deterministic test data (independent of the sampler's RNG). */
static uint64_t lcg_state;
static double lcg_uniform(void) {
    lcg_state = lcg_state * 6364136223846793005ull + 1442695040888963407ull;
    return (double)(lcg_state >> 11) * 0x1.0p-53;
}

/* Draws with a fresh copy of `logits` each time (sample may modify it). */
static int32_t draw(duet_sampler *smp, const float *logits, float *scratch, int n) {
    memcpy(scratch, logits, (size_t)n * sizeof *scratch);
    return duet_sampler_sample(smp, scratch);
}

/* Calls duet_sampler_dist on a copy and returns a dense prob-per-token table
 * (0 for dropped tokens) in `dense`; returns the support size. */
static int dist_dense(duet_sampler *smp, const float *logits, int n, float *dense) {
    float *tmp = malloc((size_t)n * sizeof *tmp);
    int32_t *ids = malloc((size_t)n * sizeof *ids);
    float *probs = malloc((size_t)n * sizeof *probs);
    ck_assert(tmp && ids && probs);
    memcpy(tmp, logits, (size_t)n * sizeof *tmp);
    int k = duet_sampler_dist(smp, tmp, ids, probs);
    ck_assert_msg(k >= 1 && k <= n, "dist returned %d of %d", k, n);
    for (int i = 0; i < n; i++)
        dense[i] = 0.0f;
    for (int i = 0; i < k; i++) {
        ck_assert_msg(ids[i] >= 0 && ids[i] < n, "dist id %d out of range", ids[i]);
        ck_assert_msg(dense[ids[i]] == 0.0f, "dist lists token %d twice", ids[i]);
        dense[ids[i]] = probs[i];
    }
    free(tmp);
    free(ids);
    free(probs);
    return k;
}

/* ---- greedy --------------------------------------------------------------- */

START_TEST(test_argmax) {
    const float a[] = {1.0f, 3.0f, 2.0f, 3.0f};
    ck_assert_msg(duet_argmax(a, 4) == 1, "tie between 1 and 3 must pick the lower index");
    const float b[] = {NAN, -1.0f, NAN, 5.0f, NAN};
    ck_assert_msg(duet_argmax(b, 5) == 3, "NaN must be skipped");
    const float c[] = {NAN, NAN};
    ck_assert_msg(duet_argmax(c, 2) == 0, "all NaN gives 0");
    const float d[] = {NAN, -INFINITY, -INFINITY};
    ck_assert_msg(duet_argmax(d, 3) == 1, "first non-NaN -inf wins when nothing is finite");
    const float e[] = {1e30f, INFINITY, 2.0f};
    ck_assert_msg(duet_argmax(e, 3) == 1, "+inf is the max");
}
END_TEST

START_TEST(test_greedy) {
    duet_sampling s = duet_sampling_default();
    s.temperature = 0.0f;
    enum { N = 1000 };
    float logits[N], tmp[N];
    lcg_state = 7;
    for (int i = 0; i < N; i++)
        logits[i] = (float)(lcg_uniform() * 10.0 - 5.0);
    logits[321] = 9.0f;
    logits[654] = 9.0f;
    duet_sampler *smp = mk(&s, N);
    for (int i = 0; i < 50; i++) {
        int32_t t = draw(smp, logits, tmp, N);
        ck_assert_msg(t == 321, "greedy draw %d gave %d, want 321 (max, lowest index)", i, t);
    }
    duet_sampler_free(smp);
}
END_TEST

START_TEST(test_topk1_is_greedy) {
    enum { N = 2000 };
    float logits[N], tmp[N];
    for (int round = 0; round < 20; round++) {
        lcg_state = 100 + (uint64_t)round;
        /* Coarse values so ties are common. */
        for (int i = 0; i < N; i++)
            logits[i] = (float)floor(lcg_uniform() * 50.0);
        duet_sampling s = plain((uint64_t)round);
        s.top_k = 1;
        s.temperature = 1.5f;
        duet_sampler *smp = mk(&s, N);
        int32_t want = duet_argmax(logits, N);
        for (int j = 0; j < 10; j++) {
            int32_t t = draw(smp, logits, tmp, N);
            ck_assert_msg(t == want, "round %d: top_k=1 gave %d, argmax is %d", round, t, want);
        }
        duet_sampler_free(smp);
    }
}
END_TEST

/* ---- determinism ------------------------------------------------------------ */

START_TEST(test_determinism) {
    enum { N = 50, DRAWS = 1000 };
    float logits[N], tmp[N];
    lcg_state = 3;
    for (int i = 0; i < N; i++)
        logits[i] = (float)(lcg_uniform() * 3.0);
    duet_sampling s = duet_sampling_default();
    s.seed = 1234;
    s.top_k = 20;
    static int32_t a[DRAWS], b[DRAWS], c[DRAWS], d[DRAWS];
    duet_sampler *s1 = mk(&s, N), *s2 = mk(&s, N);
    for (int i = 0; i < DRAWS; i++) {
        a[i] = draw(s1, logits, tmp, N);
        b[i] = draw(s2, logits, tmp, N);
    }
    for (int i = 0; i < DRAWS; i++)
        ck_assert_msg(a[i] == b[i], "same seed differs at draw %d: %d vs %d", i, a[i], b[i]);
    /* reset restores the fresh state (the RNG too). */
    duet_sampler_reset(s1);
    for (int i = 0; i < DRAWS; i++)
        c[i] = draw(s1, logits, tmp, N);
    for (int i = 0; i < DRAWS; i++)
        ck_assert_msg(a[i] == c[i], "after reset draw %d is %d, want %d", i, c[i], a[i]);
    s.seed = 1235;
    duet_sampler *s3 = mk(&s, N);
    int differ = 0;
    for (int i = 0; i < DRAWS; i++) {
        d[i] = draw(s3, logits, tmp, N);
        differ += d[i] != a[i];
    }
    ck_assert_msg(differ > DRAWS / 4, "seeds 1234 and 1235 differ in only %d of %d draws", differ, DRAWS);
    duet_sampler_free(s1);
    duet_sampler_free(s2);
    duet_sampler_free(s3);
}
END_TEST

/* With 256 equal logits the draw is floor(256 * u) = the top 8 bits of the
 * xoshiro256** output, so this pins the RNG to its specification (expected
 * values from an independent Python implementation of splitmix64 seeding +
 * xoshiro256**): the stream is the same on every platform. */
START_TEST(test_rng_stream) {
    static const int32_t want_c0ffee[16] = {18, 143, 240, 80,  247, 78,  83,  251,
                                            23, 79,  117, 205, 96,  182, 217, 225};
    static const int32_t want_42[16] = {21,  97,  174, 236, 253, 197, 184, 217,
                                        194, 149, 174, 74,  205, 82,  182, 224};
    float logits[256], tmp[256];
    for (int i = 0; i < 256; i++)
        logits[i] = 0.0f;
    duet_sampling s = plain(0);
    ck_assert_msg(duet_sampling_default().seed == 0xC0FFEEu, "default seed changed");
    s.seed = duet_sampling_default().seed;
    duet_sampler *a = mk(&s, 256);
    s.seed = 42;
    duet_sampler *b = mk(&s, 256);
    for (int i = 0; i < 16; i++) {
        int32_t ta = draw(a, logits, tmp, 256), tb = draw(b, logits, tmp, 256);
        ck_assert_msg(ta == want_c0ffee[i], "seed 0xC0FFEE draw %d: %d, want %d", i, ta, want_c0ffee[i]);
        ck_assert_msg(tb == want_42[i], "seed 42 draw %d: %d, want %d", i, tb, want_42[i]);
    }
    duet_sampler_free(a);
    duet_sampler_free(b);
}
END_TEST

/* ---- the distribution --------------------------------------------------------- */

static void softmax_d(const float *x, int n, double t, double *p) {
    double m = x[0];
    for (int i = 1; i < n; i++)
        m = x[i] > m ? x[i] : m;
    double z = 0;
    for (int i = 0; i < n; i++)
        z += p[i] = exp((x[i] - m) / t);
    for (int i = 0; i < n; i++)
        p[i] /= z;
}

static double chi_square(const long *obs, const double *p, int n, long draws) {
    double chi = 0;
    for (int i = 0; i < n; i++) {
        double e = p[i] * (double)draws;
        chi += (obs[i] - e) * (obs[i] - e) / e;
    }
    return chi;
}

START_TEST(test_chi_square) {
    enum { N = 6 };
    const float logits[N] = {1.0f, 0.5f, 0.0f, -0.5f, -1.0f, 2.0f};
    float tmp[N];
    double p1[N], p06[N];
    softmax_d(logits, N, 1.0, p1);
    softmax_d(logits, N, 0.6, p06);

    /* df = 5: P(chi2 > 30) ~ 1.5e-5, and the seed is fixed anyway. */
    const double limit = 30.0;
    const long draws = 200000;
    long obs[N] = {0};
    duet_sampling s = plain(2024);
    duet_sampler *smp = mk(&s, N);
    for (long i = 0; i < draws; i++)
        obs[draw(smp, logits, tmp, N)]++;
    duet_sampler_free(smp);
    double chi = chi_square(obs, p1, N, draws);
    ck_assert_msg(chi < limit, "T=1: chi-square %.2f >= %.0f against softmax", chi, limit);

    /* T = 0.6 must match softmax(x / 0.6) and clearly not softmax(x). */
    long obs2[N] = {0};
    s = plain(77);
    s.temperature = 0.6f;
    smp = mk(&s, N);
    for (long i = 0; i < draws; i++)
        obs2[draw(smp, logits, tmp, N)]++;
    duet_sampler_free(smp);
    double chi_t = chi_square(obs2, p06, N, draws);
    double chi_ignored = chi_square(obs2, p1, N, draws);
    ck_assert_msg(chi_t < limit, "T=0.6: chi-square %.2f >= %.0f against softmax(x/T)", chi_t, limit);
    ck_assert_msg(chi_ignored > 1000.0,
                  "T=0.6 draws fit softmax(x) too well (chi-square %.1f): temperature ignored?", chi_ignored);
}
END_TEST

START_TEST(test_topk_support) {
    enum { N = 1000, K = 10 };
    float logits[N], dense[N], tmp[N];
    lcg_state = 11;
    for (int i = 0; i < N; i++)
        logits[i] = (float)floor(lcg_uniform() * 200.0) / 10.0f;
    /* A tie across the boundary: the lower ids must win it. */
    for (int i = 0; i < N; i++)
        if (logits[i] >= 19.0f) logits[i] = 18.0f;
    for (int i = 0; i < 8; i++)
        logits[100 * i + 5] = 19.5f;
    logits[17] = logits[900] = logits[450] = 19.0f; /* ranks 9..11: 17 and 450 kept */
    /* Reference: the K best by (logit desc, id asc). */
    int ref[K], nref = 0;
    for (int i = 0; i < N; i++)
        if (logits[i] == 19.5f) ref[nref++] = i;
    ref[nref++] = 17;
    ref[nref++] = 450;
    ck_assert_int_eq(nref, K);

    duet_sampling s = plain(5);
    s.top_k = K;
    s.temperature = 2.0f;
    duet_sampler *smp = mk(&s, N);
    int k = dist_dense(smp, logits, N, dense);
    ck_assert_msg(k == K, "top_k=%d kept %d tokens", K, k);
    double z = 0;
    for (int j = 0; j < K; j++)
        z += exp(logits[ref[j]] / 2.0);
    for (int j = 0; j < K; j++) {
        double want = exp(logits[ref[j]] / 2.0) / z;
        ck_assert_msg(fabs(dense[ref[j]] - want) < 1e-6, "token %d: p %.7f, want %.7f", ref[j],
                      (double)dense[ref[j]], want);
    }
    ck_assert_msg(dense[900] == 0.0f, "token 900 loses the tie to 17 and 450 but was kept");
    for (int i = 0; i < 2000; i++) {
        int32_t t = draw(smp, logits, tmp, N);
        ck_assert_msg(dense[t] > 0.0f, "drew %d, outside the top-%d", t, K);
    }
    duet_sampler_free(smp);
}
END_TEST

/* Logits log(p) for a designed distribution placed at scattered ids. */
static void designed(float *logits, int n, const double *p, const int *at, int np) {
    for (int i = 0; i < n; i++)
        logits[i] = -INFINITY;
    for (int i = 0; i < np; i++)
        logits[at[i]] = (float)log(p[i]);
}

START_TEST(test_topp_support) {
    enum { N = 32 };
    const double p[] = {0.4, 0.3, 0.15, 0.1, 0.05};
    const int at[] = {20, 3, 31, 0, 9};
    float logits[N], dense[N];
    designed(logits, N, p, at, 5);
    /* top_p -> number of leading tokens kept (cum 0.4, 0.7, 0.85, 0.95, 1). */
    const struct {
        float top_p;
        int keep;
    } cases[] = {
        {0.3f, 1}, {0.45f, 2}, {0.69f, 2}, {0.72f, 3}, {0.8f, 3}, {0.9f, 4}, {0.97f, 5}, {1.0f, 5},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        duet_sampling s = plain(1);
        s.top_p = cases[c].top_p;
        duet_sampler *smp = mk(&s, N);
        int k = dist_dense(smp, logits, N, dense);
        ck_assert_msg(k == cases[c].keep, "top_p=%.2f kept %d tokens, want %d", (double)cases[c].top_p, k,
                      cases[c].keep);
        double mass = 0;
        for (int j = 0; j < cases[c].keep; j++)
            mass += p[j];
        for (int j = 0; j < 5; j++) {
            double want = j < cases[c].keep ? p[j] / mass : 0.0;
            ck_assert_msg(fabs(dense[at[j]] - want) < 1e-6, "top_p=%.2f: token %d p=%.7f want %.7f",
                          (double)cases[c].top_p, at[j], (double)dense[at[j]], want);
        }
        duet_sampler_free(smp);
    }
}
END_TEST

START_TEST(test_minp_support) {
    enum { N = 16 };
    const double p[] = {0.5, 0.2, 0.1, 0.09, 0.06, 0.05};
    const int at[] = {7, 1, 15, 2, 11, 4};
    float logits[N], dense[N];
    designed(logits, N, p, at, 6);
    /* min_p -> kept; threshold min_p * 0.5. */
    const struct {
        float min_p, top_p;
        int keep;
    } cases[] = {
        {0.0f, 1.0f, 6},
        {0.15f, 1.0f, 4},
        {0.19f, 1.0f, 3},
        {0.3f, 1.0f, 2},
        {0.5f, 1.0f, 1},
        {1.0f, 1.0f, 1},
        /* Both on: the shorter prefix wins (top-p counts mass of the full set). */
        {0.15f, 0.75f, 3},
        {0.3f, 0.75f, 2},
        {0.15f, 0.92f, 4},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        duet_sampling s = plain(1);
        s.min_p = cases[c].min_p;
        s.top_p = cases[c].top_p;
        duet_sampler *smp = mk(&s, N);
        int k = dist_dense(smp, logits, N, dense);
        ck_assert_msg(k == cases[c].keep, "min_p=%.2f top_p=%.2f kept %d, want %d", (double)cases[c].min_p,
                      (double)cases[c].top_p, k, cases[c].keep);
        for (int j = 0; j < 6; j++)
            ck_assert_msg((dense[at[j]] > 0.0f) == (j < cases[c].keep),
                          "min_p=%.2f top_p=%.2f: token %d kept=%d", (double)cases[c].min_p,
                          (double)cases[c].top_p, at[j], dense[at[j]] > 0.0f);
        duet_sampler_free(smp);
    }
}
END_TEST

static double entropy(const float *p, int n) {
    double h = 0;
    for (int i = 0; i < n; i++)
        if (p[i] > 0) h -= p[i] * log(p[i]);
    return h;
}

START_TEST(test_temperature) {
    enum { N = 64 };
    float logits[N], dense[N];
    lcg_state = 9;
    for (int i = 0; i < N; i++)
        logits[i] = (float)(lcg_uniform() * 4.0);
    const float temps[] = {0.25f, 0.5f, 1.0f, 2.0f, 4.0f};
    double prev = -1.0;
    for (int j = 0; j < 5; j++) {
        duet_sampling s = plain(1);
        s.temperature = temps[j];
        duet_sampler *smp = mk(&s, N);
        dist_dense(smp, logits, N, dense);
        double ref[N];
        softmax_d(logits, N, temps[j], ref);
        for (int i = 0; i < N; i++)
            ck_assert_msg(fabs(dense[i] - ref[i]) < 1e-6, "T=%.2f token %d: p=%.7f want %.7f",
                          (double)temps[j], i, (double)dense[i], ref[i]);
        double h = entropy(dense, N);
        ck_assert_msg(h > prev + 0.01, "entropy at T=%.2f is %.4f, not above %.4f", (double)temps[j], h,
                      prev);
        prev = h;
        duet_sampler_free(smp);
    }
    ck_assert_msg(prev < log((double)N), "entropy exceeds the uniform bound");

    /* Tiny temperatures (1/T may overflow to inf) collapse onto the argmax,
     * with or without truncation. */
    float tmp[N];
    const float tiny[] = {1e-30f, 1e-38f, 1e-45f};
    for (int j = 0; j < 3; j++) {
        for (int v = 0; v < 2; v++) {
            duet_sampling s = plain(4);
            s.temperature = tiny[j];
            if (v) s.top_p = 0.9f, s.min_p = 0.05f;
            duet_sampler *smp = mk(&s, N);
            for (int i = 0; i < 100; i++) {
                int32_t t = draw(smp, logits, tmp, N);
                ck_assert_msg(t == duet_argmax(logits, N), "T=%g variant %d drew %d, argmax %d",
                              (double)tiny[j], v, t, duet_argmax(logits, N));
            }
            duet_sampler_free(smp);
        }
    }
}
END_TEST

/* ---- penalties ----------------------------------------------------------------- */

/* Runs dist (greedy settings) on a copy of `in` and returns the penalised
 * logits in `out`, plus the greedy choice. */
static int32_t penalised(duet_sampler *smp, const float *in, float *out, int n) {
    int32_t ids[64];
    float probs[64];
    ck_assert(n <= 64);
    memcpy(out, in, (size_t)n * sizeof *out);
    ck_assert_int_eq(duet_sampler_dist(smp, out, ids, probs), 1);
    ck_assert(probs[0] == 1.0f);
    return ids[0];
}

START_TEST(test_repetition_penalty) {
    enum { N = 6 };
    const float in[N] = {2.0f, 1.9f, -1.0f, -1.2f, 0.0f, 1.0f};
    float out[N], tmp[N];
    duet_sampling s = plain(1);
    s.temperature = 0.0f;
    s.repetition_penalty = 1.25f;
    duet_sampler *smp = mk(&s, N);
    ck_assert_int_eq(penalised(smp, in, out, N), 0);
    /* Token 0 three times, token 2 once: each is penalised once. */
    duet_sampler_accept(smp, 0);
    duet_sampler_accept(smp, 0);
    duet_sampler_accept(smp, 2);
    duet_sampler_accept(smp, 0);
    duet_sampler_accept(smp, 4);
    int32_t t = penalised(smp, in, out, N);
    ck_assert_msg(out[0] == 2.0f / 1.25f, "positive logit: %g, want %g", (double)out[0],
                  (double)(2.0f / 1.25f));
    ck_assert_msg(out[2] == -1.0f * 1.25f, "negative logit: %g, want %g", (double)out[2],
                  (double)(-1.0f * 1.25f));
    ck_assert_msg(out[4] == 0.0f, "zero logit stays 0, got %g", (double)out[4]);
    for (int i = 0; i < N; i++)
        if (i != 0 && i != 2 && i != 4)
            ck_assert_msg(out[i] == in[i], "unseen token %d changed: %g", i, (double)out[i]);
    ck_assert_msg(t == 1, "greedy after penalising token 0 gave %d, want 1", t);
    ck_assert_msg(draw(smp, in, tmp, N) == 1, "sample (greedy) disagrees with dist");
    /* Between the negatives: -1 * 1.25 = -1.25 < -1.2. */
    const float neg[N] = {-5.0f, -5.0f, -1.0f, -1.2f, -5.0f, -5.0f};
    ck_assert_msg(penalised(smp, neg, out, N) == 3, "penalised -1.0 must fall below -1.2");
    duet_sampler_free(smp);
}
END_TEST

START_TEST(test_presence_frequency) {
    enum { N = 5 };
    const float in[N] = {3.0f, 2.5f, 2.0f, 1.0f, -1.0f};
    float out[N];
    duet_sampling s = plain(1);
    s.temperature = 0.0f;
    s.presence_penalty = 0.75f;
    s.frequency_penalty = 0.125f;
    duet_sampler *smp = mk(&s, N);
    for (int i = 0; i < 4; i++)
        duet_sampler_accept(smp, 0); /* count 4 */
    duet_sampler_accept(smp, 1);     /* count 1 */
    duet_sampler_accept(smp, 4);
    duet_sampler_accept(smp, 4); /* count 2 */
    int32_t t = penalised(smp, in, out, N);
    ck_assert_msg(out[0] == 3.0f - (4 * 0.125f + 0.75f), "token 0: %g, want %g", (double)out[0],
                  3.0 - (4 * 0.125 + 0.75));
    ck_assert_msg(out[1] == 2.5f - (1 * 0.125f + 0.75f), "token 1: %g", (double)out[1]);
    ck_assert_msg(out[4] == -1.0f - (2 * 0.125f + 0.75f), "token 4: %g", (double)out[4]);
    ck_assert_msg(out[2] == 2.0f && out[3] == 1.0f, "unseen tokens changed");
    ck_assert_msg(t == 2, "greedy gave %d, want 2 (0 -> 1.75, 1 -> 1.625)", t);
    duet_sampler_free(smp);

    /* All three combined: repetition first, then the subtraction. */
    s.repetition_penalty = 2.0f;
    smp = mk(&s, N);
    duet_sampler_accept(smp, 0);
    duet_sampler_accept(smp, 0);
    duet_sampler_accept(smp, 4);
    penalised(smp, in, out, N);
    ck_assert_msg(out[0] == 3.0f / 2.0f - (2 * 0.125f + 0.75f), "combined token 0: %g", (double)out[0]);
    ck_assert_msg(out[4] == -1.0f * 2.0f - (1 * 0.125f + 0.75f), "combined token 4: %g", (double)out[4]);
    duet_sampler_free(smp);
}
END_TEST

START_TEST(test_penalty_window) {
    enum { N = 8 };
    const float in[N] = {1, 1, 1, 1, 1, 1, 1, 1};
    float out[N];
    duet_sampling s = plain(1);
    s.temperature = 0.0f;
    s.frequency_penalty = 1.0f;
    s.penalty_last_n = 3;
    duet_sampler *smp = mk(&s, N);
    /* Window after each accept: [0] [0 1] [0 1 0] [1 0 2] [0 2 0] [2 0 3]. */
    const int32_t seq[] = {0, 1, 0, 2, 0, 3};
    const float want[][4] = {
        {0, 1, 1, 1}, {0, 0, 1, 1}, {-1, 0, 1, 1}, {0, 0, 0, 1}, {-1, 1, 0, 1}, {0, 1, 0, 0},
    };
    for (int i = 0; i < 6; i++) {
        duet_sampler_accept(smp, seq[i]);
        penalised(smp, in, out, N);
        for (int t = 0; t < 4; t++)
            ck_assert_msg(out[t] == want[i][t], "after %d accepts token %d: %g, want %g", i + 1, t,
                          (double)out[t], (double)want[i][t]);
    }
    /* Ids outside the vocabulary are ignored, not stored. */
    duet_sampler_accept(smp, -1);
    duet_sampler_accept(smp, N);
    penalised(smp, in, out, N);
    ck_assert_msg(out[2] == 0.0f && out[3] == 0.0f && out[0] == 1.0f - 1.0f,
                  "out-of-range ids disturbed the window");
    duet_sampler_reset(smp);
    penalised(smp, in, out, N);
    for (int t = 0; t < N; t++)
        ck_assert_msg(out[t] == 1.0f, "reset left a penalty on %d", t);
    duet_sampler_free(smp);

    /* penalty_last_n = 0: nothing is forgotten. */
    s.penalty_last_n = 0;
    smp = mk(&s, N);
    duet_sampler_accept(smp, 5);
    for (int i = 0; i < 1000; i++)
        duet_sampler_accept(smp, 6);
    penalised(smp, in, out, N);
    ck_assert_msg(out[5] == 0.0f, "whole-context window forgot token 5: %g", (double)out[5]);
    ck_assert_msg(out[6] == 1.0f - 1000.0f, "token 6 count: %g", (double)out[6]);
    duet_sampler_free(smp);
}
END_TEST

/* ---- validation and bad logits --------------------------------------------------- */

START_TEST(test_invalid_settings) {
    struct {
        const char *field;
        duet_sampling s;
        int n_vocab;
    } cases[20];
    int n = 0;
#define BAD(name, stmt, nv)                                                                                  \
    do {                                                                                                     \
        duet_sampling s_ = plain(1);                                                                         \
        stmt;                                                                                                \
        cases[n].field = name;                                                                               \
        cases[n].s = s_;                                                                                     \
        cases[n].n_vocab = nv;                                                                               \
        n++;                                                                                                 \
    } while (0)
    BAD("temperature", s_.temperature = NAN, 10);
    BAD("temperature", s_.temperature = -0.5f, 10);
    BAD("temperature", s_.temperature = INFINITY, 10);
    BAD("top_k", s_.top_k = -1, 10);
    BAD("top_p", s_.top_p = 0.0f, 10);
    BAD("top_p", s_.top_p = 1.01f, 10);
    BAD("top_p", s_.top_p = NAN, 10);
    BAD("min_p", s_.min_p = -0.1f, 10);
    BAD("min_p", s_.min_p = 1.5f, 10);
    BAD("min_p", s_.min_p = NAN, 10);
    BAD("repetition_penalty", s_.repetition_penalty = 0.0f, 10);
    BAD("repetition_penalty", s_.repetition_penalty = -1.0f, 10);
    BAD("repetition_penalty", s_.repetition_penalty = NAN, 10);
    BAD("presence_penalty", s_.presence_penalty = NAN, 10);
    BAD("frequency_penalty", s_.frequency_penalty = NAN, 10);
    BAD("frequency_penalty", s_.frequency_penalty = -INFINITY, 10);
    BAD("penalty_last_n", s_.penalty_last_n = -1, 10);
    BAD("n_vocab", (void)0, 0);
    BAD("n_vocab", (void)0, -5);
#undef BAD
    for (int i = 0; i < n; i++) {
        static char sentinel;
        duet_sampler *smp = (duet_sampler *)&sentinel; /* must be cleared */
        duet_status st = duet_sampler_new(&cases[i].s, cases[i].n_vocab, &smp);
        ck_assert_msg(st == DUET_INVALID_ARGUMENT, "case %d (%s): status %s", i, cases[i].field,
                      duet_status_name(st));
        ck_assert_msg(smp == NULL, "case %d (%s): out not cleared", i, cases[i].field);
        ck_assert_msg(strstr(duet_last_error(), cases[i].field) != NULL,
                      "case %d: message \"%s\" does not name %s", i, duet_last_error(), cases[i].field);
    }
    /* The value is in the message too. */
    duet_sampling s = plain(1);
    s.top_k = -7;
    duet_sampler *smp = NULL;
    duet_sampler_new(&s, 10, &smp);
    ck_assert_msg(strstr(duet_last_error(), "-7") != NULL, "message \"%s\" lacks the value",
                  duet_last_error());
    /* Edge values that are valid. */
    s = plain(1);
    s.temperature = 0.0f;
    s.top_p = 1.0f;
    s.min_p = 1.0f;
    s.presence_penalty = -2.0f;
    s.top_k = 1000000;
    ck_assert_int_eq(duet_sampler_new(&s, 1, &smp), DUET_OK);
    float one = 3.0f;
    ck_assert_int_eq(duet_sampler_sample(smp, &one), 0);
    duet_sampler_free(smp);
    duet_sampler_free(NULL);
}
END_TEST

START_TEST(test_nonfinite_logits) {
    enum { N = 16 };
    float logits[N], tmp[N];
    for (int i = 0; i < N; i++)
        logits[i] = (i % 2) ? NAN : 0.0f;
    logits[4] = -INFINITY;
    const duet_sampling base = plain(99);
    duet_sampling variants[3] = {base, base, base};
    variants[1].top_k = 3;
    variants[2].top_p = 0.5f;
    variants[2].min_p = 0.1f;
    for (int v = 0; v < 3; v++) {
        duet_sampler *smp = mk(&variants[v], N);
        for (int i = 0; i < 5000; i++) {
            int32_t t = draw(smp, logits, tmp, N);
            ck_assert_msg(t >= 0 && t < N && t % 2 == 0 && t != 4,
                          "variant %d drew token %d (NaN or -inf logit)", v, t);
        }
        duet_sampler_free(smp);
    }
    duet_sampler *smp = mk(&base, N);
    /* +inf takes all the mass (shared between the +inf tokens). */
    logits[6] = INFINITY;
    logits[10] = INFINITY;
    for (int i = 0; i < 200; i++) {
        int32_t t = draw(smp, logits, tmp, N);
        ck_assert_msg(t == 6 || t == 10, "with +inf logits drew %d", t);
    }
    /* Nothing finite: the argmax fallback, which skips NaN. */
    for (int i = 0; i < N; i++)
        logits[i] = (i < 5) ? NAN : -INFINITY;
    ck_assert_int_eq(draw(smp, logits, tmp, N), 5);
    for (int i = 0; i < N; i++)
        logits[i] = NAN;
    ck_assert_int_eq(draw(smp, logits, tmp, N), 0);
    duet_sampler_free(smp);
    /* Greedy skips NaN too. */
    duet_sampling g = base;
    g.temperature = 0.0f;
    smp = mk(&g, N);
    for (int i = 0; i < N; i++)
        logits[i] = (float)i;
    logits[N - 1] = NAN;
    ck_assert_int_eq(draw(smp, logits, tmp, N), N - 2);
    duet_sampler_free(smp);
}
END_TEST

/* ---- full-size vocabulary ----------------------------------------------------- */

enum { BIG = 152064 };

START_TEST(test_large_vocab_plain) {
    float *logits = malloc(BIG * sizeof *logits), *tmp = malloc(BIG * sizeof *tmp);
    ck_assert(logits && tmp);
    /* One token at +10, the rest 0: P = e^10 / (e^10 + BIG - 1) ~ 0.1265. */
    for (int i = 0; i < BIG; i++)
        logits[i] = 0.0f;
    logits[123456] = 10.0f;
    const double p = exp(10.0) / (exp(10.0) + (BIG - 1));
    duet_sampling s = plain(31337);
    duet_sampler *smp = mk(&s, BIG);
    const int draws = 2000;
    int hits = 0, last_hits = 0;
    for (int i = 0; i < draws; i++) {
        int32_t t = draw(smp, logits, tmp, BIG);
        ck_assert_msg(t >= 0 && t < BIG, "token %d out of range", t);
        hits += t == 123456;
        last_hits += t == BIG - 1;
    }
    double sd = sqrt(draws * p * (1 - p));
    ck_assert_msg(fabs(hits - draws * p) < 6 * sd, "token 123456 drawn %d of %d, expected %.0f", hits, draws,
                  draws * p);
    ck_assert_msg(last_hits < 5, "last token drawn %d times (p ~ 6e-6)", last_hits);
    duet_sampler_free(smp);

    /* Defaults (top-k 40, top-p, min-p) on random logits: always one of the
     * 40 best. */
    lcg_state = 5;
    for (int i = 0; i < BIG; i++)
        logits[i] = (float)(lcg_uniform() * 20.0 - 10.0);
    s = duet_sampling_default();
    smp = mk(&s, BIG);
    float *sorted = malloc(BIG * sizeof *sorted);
    ck_assert(sorted);
    memcpy(sorted, logits, BIG * sizeof *sorted);
    /* 40th largest by a partial selection pass. */
    float kth = -INFINITY;
    for (int r = 0; r < 40; r++) {
        int best = duet_argmax(sorted, BIG);
        kth = sorted[best];
        sorted[best] = -INFINITY;
    }
    for (int i = 0; i < 500; i++) {
        int32_t t = draw(smp, logits, tmp, BIG);
        ck_assert_msg(logits[t] >= kth, "default settings drew token %d (logit %g < 40th %g)", t,
                      (double)logits[t], (double)kth);
    }
    free(sorted);
    duet_sampler_free(smp);
    free(logits);
    free(tmp);
}
END_TEST

static const float *cmp_logits;
static int by_logit_desc(const void *a, const void *b) {
    int i = *(const int *)a, j = *(const int *)b;
    if (cmp_logits[i] != cmp_logits[j]) return cmp_logits[i] > cmp_logits[j] ? -1 : 1;
    return i < j ? -1 : 1;
}

/* top-p without top-k over the whole vocabulary, with a nucleus large enough
 * that the sampler has to extend its sorted prefix several times. */
START_TEST(test_large_vocab_topp) {
    float *logits = malloc(BIG * sizeof *logits), *dense = malloc(BIG * sizeof *dense);
    int *order = malloc(BIG * sizeof *order);
    ck_assert(logits && dense && order);
    lcg_state = 17;
    for (int i = 0; i < BIG; i++)
        logits[i] = (float)(lcg_uniform() * 4.0 - 8.0);
    for (int i = 0; i < 600; i++) {
        int at = (int)(lcg_uniform() * BIG);
        logits[at] = (float)(4.0 + lcg_uniform() * 2.0);
    }
    logits[77] = logits[78] = 5.5f; /* a tie inside the nucleus */
    for (int i = 0; i < BIG; i++)
        order[i] = i;
    cmp_logits = logits;
    qsort(order, BIG, sizeof *order, by_logit_desc);
    double m = logits[order[0]], z = 0;
    for (int i = 0; i < BIG; i++)
        z += exp(logits[i] - m);

    const int sizes[] = {1, 63, 64, 65, 200, 450};
    for (size_t c = 0; c < sizeof sizes / sizeof sizes[0]; c++) {
        int want = sizes[c];
        /* top_p halfway between the mass of the first want-1 and want tokens,
         * so float rounding cannot move the boundary. */
        double cum = 0, before = 0;
        for (int i = 0; i < want; i++) {
            before = cum;
            cum += exp(logits[order[i]] - m) / z;
        }
        duet_sampling s = plain(3);
        s.top_p = (float)((before + cum) / 2);
        duet_sampler *smp = mk(&s, BIG);
        int k = dist_dense(smp, logits, BIG, dense);
        ck_assert_msg(k == want, "top_p=%.6f kept %d tokens, want %d", (double)s.top_p, k, want);
        for (int i = 0; i < want; i++)
            ck_assert_msg(dense[order[i]] > 0.0f, "top_p=%.6f dropped rank %d (token %d)", (double)s.top_p, i,
                          order[i]);
        duet_sampler_free(smp);
    }
    free(logits);
    free(dense);
    free(order);
}
END_TEST

/* top-k selection on inputs that trouble quickselects (sorted, reversed,
 * all equal, organ pipe, few distinct values): the kept set must be exactly
 * the k first by (logit desc, id asc). */
START_TEST(test_large_vocab_topk_patterns) {
    float *logits = malloc(BIG * sizeof *logits), *tmp = malloc(BIG * sizeof *tmp);
    float *probs = malloc(BIG * sizeof *probs);
    int32_t *ids = malloc(BIG * sizeof *ids);
    int *order = malloc(BIG * sizeof *order);
    unsigned char *kept = malloc(BIG);
    ck_assert(logits && tmp && probs && ids && order && kept);
    const int ks[] = {1, 40, 1000, BIG - 1};
    for (int pat = 0; pat < 5; pat++) {
        for (int i = 0; i < BIG; i++) {
            switch (pat) {
            case 0:
                logits[i] = (float)i / 1000.0f;
                break;
            case 1:
                logits[i] = -(float)i / 1000.0f;
                break;
            case 2:
                logits[i] = 1.0f;
                break;
            case 3:
                logits[i] = (float)(i < BIG / 2 ? i : BIG - i) / 1000.0f;
                break;
            default:
                logits[i] = (float)((i * 7919) % 5);
                break;
            }
        }
        for (int i = 0; i < BIG; i++)
            order[i] = i;
        cmp_logits = logits;
        qsort(order, BIG, sizeof *order, by_logit_desc);
        for (size_t j = 0; j < sizeof ks / sizeof ks[0]; j++) {
            duet_sampling s = plain(1);
            s.top_k = ks[j];
            duet_sampler *smp = mk(&s, BIG);
            memcpy(tmp, logits, BIG * sizeof *tmp);
            int k = duet_sampler_dist(smp, tmp, ids, probs);
            ck_assert_msg(k == ks[j], "pattern %d top_k=%d kept %d", pat, ks[j], k);
            memset(kept, 0, BIG);
            for (int r = 0; r < k; r++) {
                ck_assert_msg(r == 0 || ids[r] > ids[r - 1], "dist ids not ascending at %d", r);
                kept[ids[r]] = 1;
            }
            for (int r = 0; r < ks[j]; r++)
                ck_assert_msg(kept[order[r]], "pattern %d top_k=%d: rank %d (token %d) missing", pat, ks[j],
                              r, order[r]);
            duet_sampler_free(smp);
        }
    }
    free(logits);
    free(tmp);
    free(probs);
    free(ids);
    free(order);
    free(kept);
}
END_TEST

/* ---- an independent reference ---------------------------------------------------- */

/* Token sequences computed by tests/sampler_golden.py, a float32 numpy
 * re-implementation of the specification in sampler.h (its own RNG, full
 * sorts, no shared code). Each draw is accepted back, so the penalties and
 * their window take part. */
typedef struct golden_case {
    const char *name;
    int n_vocab;
    uint64_t data_seed;
    double scale, shift;
    duet_sampling s;
    int draws;
    int32_t want[48];
} golden_case;

static duet_sampling settings(float temperature, int top_k, float top_p, float min_p, float repetition,
                              float presence, float frequency, int last_n, uint64_t seed) {
    duet_sampling s = {
        .temperature = temperature,
        .top_k = top_k,
        .top_p = top_p,
        .min_p = min_p,
        .repetition_penalty = repetition,
        .presence_penalty = presence,
        .frequency_penalty = frequency,
        .penalty_last_n = last_n,
        .seed = seed,
    };
    return s;
}

START_TEST(test_golden_reference) {
    const golden_case cases[4] = {
        {"defaults + penalties, vocab 1000",
         1000,
         1,
         6.0,
         -3.0,
         settings(0.8f, 40, 0.95f, 0.05f, 1.1f, 0.25f, 0.125f, 8, 0xC0FFEE),
         48,
         {42,  600, 945, 265, 984, 284, 379, 999, 73,  243, 556, 860, 432, 751, 909, 914,
          284, 934, 73,  499, 231, 207, 221, 671, 592, 675, 530, 999, 952, 28,  736, 221,
          231, 934, 742, 623, 903, 881, 468, 530, 629, 284, 207, 21,  945, 231, 984, 73}},
        {"top-p 0.9 only, T 1.3, vocab 5000",
         5000,
         2,
         4.0,
         0.0,
         settings(1.3f, 0, 0.9f, 0.0f, 1.0f, 0.0f, 0.0f, 8, 42),
         48,
         {408,  1878, 3370, 4620, 4949, 3812, 3556, 4221, 3761, 2875, 3381, 1431, 3958, 1593, 3529, 4362,
          3045, 4226, 3513, 3513, 450,  870,  2162, 2971, 1560, 2422, 1989, 3894, 3116, 1139, 2051, 3071,
          4279, 4737, 4021, 3692, 3883, 209,  2327, 4867, 2644, 3483, 3971, 4043, 4473, 602,  2795, 2737}},
        {"top-p 0.5, flat, vocab 152064 (nucleus > 4096)",
         BIG,
         3,
         1.0,
         0.0,
         settings(1.0f, 0, 0.5f, 0.0f, 1.0f, 0.0f, 0.0f, 8, 7),
         12,
         {106596, 43078, 127862, 149164, 150622, 132940, 9145, 16133, 61661, 23629, 82607, 111331}},
        {"top-k 2000 (quickselect), vocab 152064",
         BIG,
         4,
         8.0,
         0.0,
         settings(0.7f, 2000, 1.0f, 0.0f, 1.3f, 0.0f, 0.0f, 0, 9),
         12,
         {478, 37463, 20106, 113190, 140833, 114434, 106289, 75931, 22442, 67902, 115381, 150273}},
    };
    float *logits = malloc(BIG * sizeof *logits), *tmp = malloc(BIG * sizeof *tmp);
    ck_assert(logits && tmp);
    for (int c = 0; c < 4; c++) {
        const golden_case *g = &cases[c];
        lcg_state = g->data_seed;
        for (int i = 0; i < g->n_vocab; i++)
            logits[i] = (float)(lcg_uniform() * g->scale + g->shift);
        duet_sampler *smp = mk(&g->s, g->n_vocab);
        for (int i = 0; i < g->draws; i++) {
            int32_t t = draw(smp, logits, tmp, g->n_vocab);
            ck_assert_msg(t == g->want[i], "%s: draw %d gave %d, reference %d", g->name, i, t, g->want[i]);
            duet_sampler_accept(smp, t);
        }
        duet_sampler_free(smp);
    }
    free(logits);
    free(tmp);
}
END_TEST

START_TEST(test_logprobs) {
    float x[6] = {1.0f, 3.0f, NAN, 3.0f, -INFINITY, 0.5f};
    double z = exp(1.0) + 2 * exp(3.0) + exp(0.5);
    duet_token_logprob top[6];
    float lp = duet_logprobs(x, 6, 5, 6, top);
    ck_assert_double_eq_tol(lp, 0.5 - log(z), 1e-6);
    /* Best first, ties by lower id; NaN and -inf last with -inf. */
    static const int32_t want[4] = {1, 3, 0, 5};
    for (int i = 0; i < 4; i++)
        ck_assert_int_eq(top[i].token, want[i]);
    ck_assert_double_eq_tol(top[0].logprob, 3.0 - log(z), 1e-6);
    ck_assert(top[4].logprob == -INFINITY && top[5].logprob == -INFINITY);
    ck_assert(duet_logprobs(x, 6, 2, 0, NULL) == -INFINITY);
    double sum = 0;
    for (int i = 0; i < 6; i++)
        sum += exp(duet_logprobs(x, 6, i, 0, NULL));
    ck_assert_double_eq_tol(sum, 1.0, 1e-6);
}
END_TEST

static Suite *sampler_suite(void) {
    Suite *s = suite_create("sampler");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_argmax);
    tcase_add_test(tc, test_logprobs);
    tcase_add_test(tc, test_greedy);
    tcase_add_test(tc, test_topk1_is_greedy);
    tcase_add_test(tc, test_determinism);
    tcase_add_test(tc, test_rng_stream);
    tcase_add_test(tc, test_chi_square);
    tcase_add_test(tc, test_topk_support);
    tcase_add_test(tc, test_topp_support);
    tcase_add_test(tc, test_minp_support);
    tcase_add_test(tc, test_temperature);
    tcase_add_test(tc, test_repetition_penalty);
    tcase_add_test(tc, test_presence_frequency);
    tcase_add_test(tc, test_penalty_window);
    tcase_add_test(tc, test_invalid_settings);
    tcase_add_test(tc, test_nonfinite_logits);
    tcase_add_test(tc, test_large_vocab_plain);
    tcase_add_test(tc, test_large_vocab_topp);
    tcase_add_test(tc, test_large_vocab_topk_patterns);
    tcase_add_test(tc, test_golden_reference);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) {
    return test_run_suite(sampler_suite());
}
