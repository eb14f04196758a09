/* test_speculative.c — speculative decoding's pure pieces (core/speculative.c):
 * the n-gram drafter, greedy verification, the output distribution of
 * rejection sampling against the target's exact distribution (chi-square,
 * >= 100k samples per setting at fixed seeds, with a draft model's q and
 * with a deterministic drafter), the same test failing when the residual
 * step is broken, seeded reproducibility, and adaptive k. */
#include <check.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "sampler.h"
#include "speculative.h"
#include "test_util.h"

/* ---- n-gram drafter ----------------------------------------------------------- */

START_TEST(test_ngram_basic) {
    int32_t d[8];
    /* "1 2 3 4 5 | 1 2 3" -> the trigram 1 2 3 occurred at 0: propose 4 5 1 2 */
    const int32_t a[] = {1, 2, 3, 4, 5, 1, 2, 3};
    ck_assert_int_eq(duet__spec_ngram(a, 8, 1, 3, 4, d), 4);
    ck_assert_int_eq(d[0], 4);
    ck_assert_int_eq(d[1], 5);
    ck_assert_int_eq(d[2], 1);
    ck_assert_int_eq(d[3], 2);
    /* k = 1 */
    ck_assert_int_eq(duet__spec_ngram(a, 8, 1, 3, 1, d), 1);
    ck_assert_int_eq(d[0], 4);
    /* The latest occurrence wins: "7 9 | 7 8 | 7" -> after the last earlier 7 comes 8. */
    const int32_t b[] = {7, 9, 7, 8, 7};
    ck_assert_int_eq(duet__spec_ngram(b, 5, 1, 3, 1, d), 1);
    ck_assert_int_eq(d[0], 8);
    /* The longest suffix wins over a later shorter match: "5 6 1 | 9 6 2 | 5 6"
     * -> bigram 5 6 at 0 proposes 1; unigram 6's latest occurrence would propose 2. */
    const int32_t c[] = {5, 6, 1, 9, 6, 2, 5, 6};
    ck_assert_int_eq(duet__spec_ngram(c, 8, 1, 3, 1, d), 1);
    ck_assert_int_eq(d[0], 1);
    /* With n_min = 2 the unigram fallback is off. */
    const int32_t e[] = {4, 6, 2, 3, 6};
    ck_assert_int_eq(duet__spec_ngram(e, 5, 2, 3, 2, d), 0);
    ck_assert_int_eq(duet__spec_ngram(e, 5, 1, 3, 2, d), 2);
    ck_assert_int_eq(d[0], 2);
    ck_assert_int_eq(d[1], 3);
}
END_TEST

START_TEST(test_ngram_edges) {
    int32_t d[8] = {0};
    const int32_t a[] = {1, 2, 3, 4};
    ck_assert_int_eq(duet__spec_ngram(a, 4, 1, 3, 4, d), 0); /* no repeat */
    ck_assert_int_eq(duet__spec_ngram(a, 1, 1, 3, 4, d), 0); /* too short */
    ck_assert_int_eq(duet__spec_ngram(a, 4, 1, 3, 0, d), 0); /* k = 0 */
    /* A repeating run continues periodically: "x y x y x y" -> x y x y x. */
    const int32_t p[] = {3, 8, 3, 8, 3, 8};
    ck_assert_int_eq(duet__spec_ngram(p, 6, 1, 3, 5, d), 5);
    const int32_t want[] = {3, 8, 3, 8, 3};
    for (int i = 0; i < 5; i++)
        ck_assert_int_eq(d[i], want[i]);
    /* "z z": the only earlier z is followed by the last z itself. */
    const int32_t z[] = {9, 9};
    ck_assert_int_eq(duet__spec_ngram(z, 2, 1, 3, 3, d), 3);
    ck_assert_int_eq(d[0], 9);
    ck_assert_int_eq(d[2], 9);
}
END_TEST

/* ---- helpers ----------------------------------------------------------------------- */

static duet_sampling settings(float t, int top_k, float top_p, float min_p, uint64_t seed) {
    duet_sampling s = duet_sampling_default();
    s.temperature = t;
    s.top_k = top_k;
    s.top_p = top_p;
    s.min_p = min_p;
    s.repetition_penalty = 1.0f;
    s.presence_penalty = s.frequency_penalty = 0.0f;
    s.penalty_last_n = 0;
    s.seed = seed;
    return s;
}

static duet_sampler *mk(const duet_sampling *s, int n_vocab) {
    duet_sampler *smp = NULL;
    ck_assert_msg(duet_sampler_new(s, n_vocab, &smp) == DUET_OK, "%s", duet_last_error());
    return smp;
}

static duet_spec_verifier *mk_verifier(int n_vocab) {
    duet_spec_verifier *v = NULL;
    ck_assert_msg(duet__spec_verifier_new(n_vocab, &v) == DUET_OK, "%s", duet_last_error());
    return v;
}

/* The test's own RNG (draft draws), independent of the sampler's. */
static uint64_t lcg;
static double lcg_uniform(void) {
    lcg = lcg * 6364136223846793005ull + 1442695040888963407ull;
    return (double)(lcg >> 11) * 0x1.0p-53;
}

/* The target's exact distribution after sampler.h's transformation,
 * computed independently of sampler.c: top-k (ties: lower id), softmax at
 * temperature T, top-p (the shortest prefix by probability whose mass
 * reaches top_p), min-p (p >= min_p * p_max), renormalised. Test logits
 * have no ties and no mass exactly at a top-p boundary. */
#define V 5
static void exact_dist(const float *logits, const duet_sampling *s, double *out) {
    int order[V];
    for (int i = 0; i < V; i++)
        order[i] = i;
    for (int i = 1; i < V; i++) /* by logit descending */
        for (int j = i; j > 0 && logits[order[j]] > logits[order[j - 1]]; j--) {
            int t = order[j];
            order[j] = order[j - 1];
            order[j - 1] = t;
        }
    int n = s->top_k > 0 && s->top_k < V ? s->top_k : V;
    double w[V], z = 0;
    for (int i = 0; i < n; i++) {
        w[i] = exp((double)(logits[order[i]] - logits[order[0]]) / s->temperature);
        z += w[i];
    }
    int keep = n;
    if (s->top_p < 1.0f) {
        double cum = 0;
        for (keep = 0; keep < n;) {
            cum += w[keep++] / z;
            if (cum >= s->top_p) break;
        }
    }
    int m = 0;
    for (int i = 0; i < keep; i++)
        if (w[i] / w[0] >= s->min_p) m++;
    double zz = 0;
    for (int i = 0; i < m; i++)
        zz += w[i];
    for (int i = 0; i < V; i++)
        out[i] = 0;
    for (int i = 0; i < m; i++)
        out[order[i]] = w[i] / zz;
}

/* A Markov chain: the target's and the draft's logits given the previous
 * token (row V is the start). The draft is a perturbed target, as a small
 * model of the same family would be. */
static const float target_logits[V + 1][V] = {
    {1.0f, 0.2f, -0.5f, 0.7f, -1.3f}, {0.1f, 1.4f, 0.6f, -0.9f, 0.25f},  {-0.4f, 0.3f, 1.1f, 0.8f, -0.2f},
    {0.9f, -1.1f, 0.4f, 0.05f, 1.2f}, {0.35f, 0.75f, -0.6f, 1.5f, 0.0f}, {0.5f, -0.3f, 1.3f, 0.15f, 0.8f},
};
static const float draft_logits[V + 1][V] = {
    {0.2f, 1.0f, -0.1f, 0.7f, -0.6f}, {0.8f, 0.9f, 0.1f, -0.3f, 0.6f},  {0.3f, -0.5f, 1.6f, 0.2f, 0.4f},
    {0.1f, -0.2f, 0.9f, 0.5f, 0.7f},  {-0.2f, 1.2f, 0.1f, 0.9f, 0.45f}, {1.1f, 0.6f, 0.2f, -0.4f, 0.3f},
};
#define START V
#define LEN 3 /* tokens per trial: the joint has V^3 cells */

enum drafter { DRAFT_MODEL, DRAFT_DETERMINISTIC };

/* Runs `trials` generations of LEN tokens with speculation (k cycles 1..3
 * per step) and counts each trial's token triple. The draft model draws
 * its tokens from q (its logits through the same transformation); the
 * deterministic drafter proposes the draft model's most likely token. */
static void run_speculative(const duet_sampling *s, enum drafter dr, bool broken, long trials, long *counts) {
    duet_sampler *smp = mk(s, V);
    duet_sampler *qs = mk(s, V); /* only for duet_sampler_dist: q */
    duet_spec_verifier *v = mk_verifier(V);
    duet__spec_verifier_break_residual(v, broken);
    lcg = s->seed ^ 0x5DEECE66Dull;
    int32_t q_ids[DUET_SPEC_MAX_K][V];
    float q_probs[DUET_SPEC_MAX_K][V];
    int n_q[DUET_SPEC_MAX_K];
    memset(counts, 0, sizeof(long) * V * V * V);
    int step = 0;
    for (long t = 0; t < trials; t++) {
        int out[LEN], n_out = 0;
        while (n_out < LEN) {
            int prev = n_out ? out[n_out - 1] : START;
            int k = 1 + step++ % 3;
            int32_t d[DUET_SPEC_MAX_K];
            for (int j = 0; j < k; j++) {
                int from = j ? d[j - 1] : prev;
                float row[V];
                memcpy(row, draft_logits[from], sizeof row);
                n_q[j] = duet_sampler_dist(qs, row, q_ids[j], q_probs[j]);
                if (dr == DRAFT_DETERMINISTIC) {
                    int best = 0;
                    for (int i = 1; i < n_q[j]; i++)
                        if (q_probs[j][i] > q_probs[j][best]) best = i;
                    d[j] = q_ids[j][best];
                    n_q[j] = 0;
                } else {
                    double u = lcg_uniform(), cum = 0;
                    d[j] = q_ids[j][n_q[j] - 1];
                    for (int i = 0; i < n_q[j]; i++)
                        if ((cum += q_probs[j][i]) > u) {
                            d[j] = q_ids[j][i];
                            break;
                        }
                }
            }
            /* Row j of the target is its distribution after prev, d[0..j). */
            bool all = true;
            for (int j = 0; j < k && n_out < LEN; j++) {
                float row[V];
                memcpy(row, target_logits[j ? d[j - 1] : prev], sizeof row);
                bool acc;
                int32_t tok = duet__spec_verify(v, smp, row, d[j], q_ids[j], q_probs[j], n_q[j], &acc);
                ck_assert(tok >= 0 && tok < V);
                ck_assert(!acc || tok == d[j]);
                duet_sampler_accept(smp, tok);
                out[n_out++] = tok;
                if (!acc) {
                    all = false;
                    break;
                }
            }
            if (all && n_out < LEN) { /* the bonus token, from p after the k drafts */
                float row[V];
                memcpy(row, target_logits[d[k - 1]], sizeof row);
                int32_t tok = duet_sampler_sample(smp, row);
                duet_sampler_accept(smp, tok);
                out[n_out++] = tok;
            }
        }
        counts[(out[0] * V + out[1]) * V + out[2]]++;
    }
    duet__spec_verifier_free(v);
    duet_sampler_free(qs);
    duet_sampler_free(smp);
}

/* The exact joint of LEN tokens under the target. */
static void exact_joint(const duet_sampling *s, double *joint) {
    double p[V + 1][V];
    for (int r = 0; r <= V; r++)
        exact_dist(target_logits[r], s, p[r]);
    for (int a = 0; a < V; a++)
        for (int b = 0; b < V; b++)
            for (int c = 0; c < V; c++)
                joint[(a * V + b) * V + c] = p[START][a] * p[a][b] * p[b][c];
}

/* Pearson's chi-square of counts against the joint; cells expected below 5
 * are pooled. A cell the target never produces must stay empty
 * (*impossible counts the samples that landed there). */
static double chi_square(const long *counts, const double *joint, long trials, int *df, long *impossible) {
    double chi = 0, pooled_e = 0;
    long pooled_o = 0;
    int cells = 0;
    *impossible = 0;
    for (int i = 0; i < V * V * V; i++) {
        double e = joint[i] * (double)trials;
        if (joint[i] == 0) {
            *impossible += counts[i];
            continue;
        }
        if (e < 5) {
            pooled_e += e;
            pooled_o += counts[i];
            continue;
        }
        chi += (counts[i] - e) * (counts[i] - e) / e;
        cells++;
    }
    if (pooled_e > 0) {
        chi += (pooled_o - pooled_e) * (pooled_o - pooled_e) / pooled_e;
        cells++;
    }
    *df = cells - 1;
    return chi;
}

/* Upper critical value of chi-square with df degrees of freedom at
 * P = 1e-4 (Wilson-Hilferty; z = 3.719). */
static double chi_critical(int df) {
    double a = 2.0 / (9.0 * df);
    double c = 1.0 - a + 3.719 * sqrt(a);
    return df * c * c * c;
}

typedef struct setting {
    const char *name;
    float t;
    int top_k;
    float top_p, min_p;
} setting;

static const setting settings_table[] = {
    {"T=1", 1.0f, 0, 1.0f, 0.0f},
    {"T=0.6 top_k=3", 0.6f, 3, 1.0f, 0.0f},
    {"T=1.4 top_p=0.85", 1.4f, 0, 0.85f, 0.0f},
    {"T=0.9 min_p=0.2", 0.9f, 0, 1.0f, 0.2f},
    {"T=1.2 top_k=4 top_p=0.9 min_p=0.05", 1.2f, 4, 0.9f, 0.05f},
};
#define N_SETTINGS ((int)(sizeof settings_table / sizeof *settings_table))
#define TRIALS 100000L

/* ---- distribution ----------------------------------------------------------- */

static void check_setting(int i, enum drafter dr) {
    const setting *st = &settings_table[i];
    duet_sampling s = settings(st->t, st->top_k, st->top_p, st->min_p, 1000 + (uint64_t)i * 7 + dr);
    static long counts[V * V * V];
    double joint[V * V * V];
    exact_joint(&s, joint);
    run_speculative(&s, dr, false, TRIALS, counts);
    int df;
    long impossible;
    double chi = chi_square(counts, joint, TRIALS, &df, &impossible);
    double crit = chi_critical(df);
    fprintf(stderr, "spec %s, %s drafter: chi-square %.1f (df %d, critical %.1f)\n", st->name,
            dr == DRAFT_MODEL ? "model" : "deterministic", chi, df, crit);
    ck_assert_msg(impossible == 0, "%s: %ld samples outside the target's support", st->name, impossible);
    ck_assert_msg(chi < crit, "%s (%s drafter): chi-square %.1f >= %.1f with df %d", st->name,
                  dr == DRAFT_MODEL ? "model" : "deterministic", chi, crit, df);
}

START_TEST(test_distribution_draft_model) {
    check_setting(_i, DRAFT_MODEL);
}
END_TEST

START_TEST(test_distribution_deterministic) {
    check_setting(_i, DRAFT_DETERMINISTIC);
}
END_TEST

/* The same test with the residual step broken (a rejection draws from p):
 * the chi-square must blow past the critical value, or the test above
 * could not catch the bug it exists for. */
START_TEST(test_broken_residual_fails) {
    for (int dr = 0; dr < 2; dr++) {
        duet_sampling s = settings(1.0f, 0, 1.0f, 0.0f, 77 + (uint64_t)dr);
        static long counts[V * V * V];
        double joint[V * V * V];
        exact_joint(&s, joint);
        run_speculative(&s, (enum drafter)dr, true, TRIALS, counts);
        int df;
        long impossible;
        double chi = chi_square(counts, joint, TRIALS, &df, &impossible);
        fprintf(stderr, "broken residual, %s drafter: chi-square %.1f (critical %.1f)\n",
                dr == DRAFT_MODEL ? "model" : "deterministic", chi, chi_critical(df));
        ck_assert_msg(chi > 10 * chi_critical(df), "broken residual not detected: chi-square %.1f", chi);
    }
}
END_TEST

/* ---- greedy and seeds ----------------------------------------------------------- */

/* Greedy: every kept token is the target's argmax, whatever the draft, and
 * no random number is drawn. */
START_TEST(test_greedy) {
    duet_sampling s = settings(0.0f, 0, 1.0f, 0.0f, 5);
    duet_sampler *smp = mk(&s, V), *fresh = mk(&s, V);
    duet_spec_verifier *v = mk_verifier(V);
    int32_t q_ids[V] = {0, 1, 2, 3, 4};
    float q_probs[V] = {0.1f, 0.2f, 0.3f, 0.2f, 0.2f};
    for (int r = 0; r <= V; r++) {
        int best = 0;
        for (int i = 1; i < V; i++)
            if (target_logits[r][i] > target_logits[r][best]) best = i;
        for (int d = 0; d < V; d++)
            for (int withq = 0; withq < 2; withq++) {
                float row[V];
                memcpy(row, target_logits[r], sizeof row);
                bool acc;
                int32_t tok = duet__spec_verify(v, smp, row, d, q_ids, q_probs, withq ? V : 0, &acc);
                ck_assert_int_eq(tok, best);
                ck_assert(acc == (d == best));
            }
    }
    /* The RNG did not move. */
    ck_assert(duet_sampler_uniform(smp) == duet_sampler_uniform(fresh));
    duet__spec_verifier_free(v);
    duet_sampler_free(smp);
    duet_sampler_free(fresh);
}
END_TEST

/* Same seed, same settings, same drafts: same tokens; another seed differs. */
START_TEST(test_seeded) {
    long a[V * V * V], b[V * V * V], c[V * V * V];
    duet_sampling s = settings(1.0f, 0, 1.0f, 0.0f, 4242);
    run_speculative(&s, DRAFT_MODEL, false, 2000, a);
    run_speculative(&s, DRAFT_MODEL, false, 2000, b);
    ck_assert(memcmp(a, b, sizeof a) == 0);
    s.seed = 4243;
    run_speculative(&s, DRAFT_MODEL, false, 2000, c);
    ck_assert(memcmp(a, c, sizeof a) != 0);
}
END_TEST

/* ---- adaptive k ------------------------------------------------------------------ */

START_TEST(test_adapt) {
    duet_spec_adapt a;
    duet__spec_adapt_init(&a, 8);
    ck_assert_int_eq(a.k, 8);
    ck_assert_float_eq_tol(a.alpha, 0.5f, 1e-6f);
    /* Always everything accepted: k stays at the maximum. */
    for (int i = 0; i < 20; i++)
        duet__spec_adapt_update(&a, a.k, a.k, 8);
    ck_assert_int_eq(a.k, 8);
    ck_assert(a.alpha > 0.99f);
    /* One rejection after a long run of keeps is one trial in about 50: a
     * pair that keeps 98% of its drafts stays near 0.98 (a short memory
     * dropped it to 0.7, and the decision refused it from then on). */
    duet__spec_adapt_update(&a, 8, 2, 8);
    ck_assert_msg(a.alpha > 0.97f && a.k == 8, "one rejection: alpha %.3f k %d", a.alpha, a.k);
    /* The maximum-likelihood value: 7 steps keeping all 8 and one keeping
     * 2 of 8, repeated, give 58 kept of 59 trials. */
    for (int i = 0; i < 400; i++)
        duet__spec_adapt_update(&a, 8, i % 8 == 7 ? 2 : 8, 8);
    ck_assert_float_eq_tol(a.alpha, 58.0f / 59.0f, 0.01f);
    /* Nothing accepted: alpha falls (within tens of trials below 0.7, k
     * with it) and k reaches 1. */
    int steps = 0;
    while (a.alpha >= 0.7f && steps < 1000)
        duet__spec_adapt_update(&a, a.k, 0, 8), steps++;
    ck_assert_msg(steps <= 20, "%d rejected steps to fall below 0.7", steps);
    ck_assert_int_le(a.k, 5);
    for (int i = 0; i < 300; i++)
        duet__spec_adapt_update(&a, a.k, 0, 8);
    ck_assert_int_eq(a.k, 1);
    ck_assert(a.alpha < 0.01f);
    /* Half of each run: alpha settles near 0.5, k = floor(log 0.15 / log 0.5) = 2. */
    for (int i = 0; i < 400; i++)
        duet__spec_adapt_update(&a, 4, 1, 8); /* one kept, one rejected */
    ck_assert_float_eq_tol(a.alpha, 0.5f, 0.02f);
    ck_assert_int_eq(a.k, 2);
    /* The first prior weighs a quarter of a trial: from 0.5, one step
     * keeping all 8 drafts (an exploration) lifts alpha to about 0.985,
     * one keeping its single draft to 0.9; a new prior replaces the
     * history. */
    duet_spec_adapt b;
    duet__spec_adapt_init(&b, 8);
    duet__spec_adapt_update(&b, 8, 8, 8);
    float d8 = powf(DUET_SPEC_ADAPT_DECAY, 8);
    ck_assert_float_eq_tol(b.alpha, (0.125f * d8 + 8) / (0.25f * d8 + 8), 1e-5f);
    ck_assert_msg(b.alpha > 0.98f && b.k == 8, "8 of 8 kept: alpha %.3f k %d", b.alpha, b.k);
    duet__spec_adapt_init(&b, 8);
    duet__spec_adapt_update(&b, 1, 1, 8);
    float d1 = DUET_SPEC_ADAPT_DECAY;
    ck_assert_float_eq_tol(b.alpha, (0.125f * d1 + 1) / (0.25f * d1 + 1), 1e-5f);
    duet__spec_adapt_prior(&b, 0.3f, 1);
    ck_assert_float_eq_tol(b.alpha, 0.3f, 1e-6f);
    duet__spec_adapt_update(&b, 1, 1, 8);
    ck_assert_float_eq_tol(b.alpha, (0.3f * d1 + 1) / (d1 + 1), 1e-5f);
    /* The population's prior at full weight: one early rejection (6 of 8
     * kept) leaves a 0.98 sequence at 0.95 or more; a sequence keeping one
     * draft in two falls below 0.9 within 4 steps of 8 drafts. */
    duet__spec_adapt_prior(&b, 0.98f, DUET_SPEC_PRIOR_TRIALS);
    duet__spec_adapt_update(&b, 8, 6, 8);
    ck_assert_msg(b.alpha >= 0.95f, "an early rejection: %.3f", b.alpha);
    duet__spec_adapt_prior(&b, 0.98f, DUET_SPEC_PRIOR_TRIALS);
    for (int i = 0; i < 4; i++)
        duet__spec_adapt_update(&b, 8, 1, 8);
    ck_assert_msg(b.alpha < 0.9f, "half kept, 4 steps: %.3f", b.alpha);
    /* k_max bounds it; a step without drafts changes nothing. */
    float before = a.alpha;
    duet__spec_adapt_update(&a, 0, 0, 1);
    ck_assert(a.alpha == before);
    ck_assert_int_eq(a.k, 1);
}
END_TEST

START_TEST(test_verifier_args) {
    duet_spec_verifier *v = NULL;
    ck_assert_int_eq(duet__spec_verifier_new(0, &v), DUET_INVALID_ARGUMENT);
    ck_assert_ptr_null(v);
    /* A draft token outside the vocabulary is rejected, never returned. */
    duet_sampling s = settings(1.0f, 0, 1.0f, 0.0f, 9);
    duet_sampler *smp = mk(&s, V);
    v = mk_verifier(V);
    for (int i = 0; i < 100; i++) {
        float row[V];
        memcpy(row, target_logits[0], sizeof row);
        bool acc = true;
        int32_t tok = duet__spec_verify(v, smp, row, V + 3, NULL, NULL, 0, &acc);
        ck_assert(!acc && tok >= 0 && tok < V);
    }
    duet__spec_verifier_free(v);
    duet_sampler_free(smp);
}
END_TEST

/* ---- the speculation decision ---------------------------------------------------- */

/* A target step-cost model: fixed seconds per step and per decode token. */
static duet_step_cost cost_model(double fixed, double per_token) {
    duet_step_cost m = {0};
    m.coef[0] = fixed;
    m.coef[1] = per_token;
    return m;
}

/* b decodes at position 100 + 10 i, each offering `offer` drafts at
 * acceptance alpha (catch-up 1); returns the decision, grants in c. */
static duet_spec_decision decide(const duet_step_cost *target, const duet_step_cost *draft, int b, int offer,
                                 float alpha, duet_spec_cand *c) {
    duet_step_shape base = {0};
    for (int i = 0; i < b; i++) {
        duet_step_shape_add(&base, 100 + 10 * i, 1, true);
        c[i] = (duet_spec_cand){.pos = 100 + 10 * i, .offer = offer, .alpha = alpha, .catchup = 1};
    }
    duet_spec_decision d;
    duet__spec_decide(target, draft, &base, c, b, &d);
    int granted = 0;
    for (int i = 0; i < b; i++) {
        ck_assert(c[i].k >= 0 && c[i].k <= offer);
        granted += c[i].k;
    }
    ck_assert_int_eq(granted, d.tokens_granted);
    ck_assert_int_eq(d.tokens_offered, b * offer);
    return d;
}

/* Expected tokens of k drafts at acceptance a (the bonus token included). */
static double expected(double a, int k) {
    return (1 - pow(a, k + 1)) / (1 - a);
}

/* A compute-bound step (each token costs half the fixed part): drafting
 * pays alone and turns off as the batch fills; a memory-bound one (a token
 * costs 1% of it) keeps it on; low acceptance turns it off; n-gram drafts
 * at batch 1 get the k that maximises E(k) / T(k). */
START_TEST(test_decide) {
    duet_spec_cand c[32];
    const duet_step_cost compute = cost_model(0.010, 0.005), memory = cost_model(0.050, 0.0005);
    duet_spec_decision d = decide(&compute, NULL, 1, 8, 0.8f, c);
    ck_assert_msg(c[0].k > 0 && d.speedup > 1.1, "compute-bound, batch 1: k %d speedup %.3f", c[0].k,
                  d.speedup);
    /* The best k by brute force: the search finds it. */
    int best = 0;
    for (int k = 1; k <= 8; k++)
        if (expected(0.8, k) / (0.015 + 0.005 * k) > expected(0.8, best) / (0.015 + 0.005 * best)) best = k;
    ck_assert_int_eq(c[0].k, best);
    ck_assert_double_eq_tol(d.speedup, expected(0.8, best) / (0.015 + 0.005 * best) / (1 / 0.015), 1e-6);
    for (int b = 1; b <= 32; b *= 2) {
        d = decide(&compute, NULL, b, 8, 0.8f, c);
        fprintf(stderr, "compute-bound, batch %2d: %d draft tokens granted, predicted %.3fx\n", b,
                d.tokens_granted, d.speedup);
        if (b >= 16)
            ck_assert_msg(d.tokens_granted == 0 && d.n_granted == 0 && d.speedup < 1.02,
                          "compute-bound at batch %d: %d granted", b, d.tokens_granted);
    }
    for (int b = 1; b <= 4; b++) {
        d = decide(&memory, NULL, b, 8, 0.8f, c);
        ck_assert_msg(d.n_granted == b && d.speedup > 1.5, "memory-bound, batch %d: %d granted, %.3fx", b,
                      d.n_granted, d.speedup);
    }
    /* Low acceptance: off, even memory-bound. */
    d = decide(&memory, NULL, 1, 8, 0.01f, c);
    ck_assert_msg(d.tokens_granted == 0, "acceptance 0.01: %d granted", d.tokens_granted);
    /* Half acceptance on the memory-bound device still pays. */
    d = decide(&memory, NULL, 4, 8, 0.5f, c);
    ck_assert(d.n_granted == 4);
    /* No model: nothing to weigh, nothing granted. */
    const duet_step_cost none = {0};
    d = decide(&none, NULL, 2, 8, 0.9f, c);
    ck_assert(d.tokens_granted == 0 && d.speedup == 0);
}
END_TEST

/* A draft model's passes: each costs its fixed part once per pass, shared
 * by the sequences drafting in it. At 98% acceptance a draft pass at 0.7 of
 * the target's step still pays at batch 1 (about 1.2x at the best k);
 * a dearer draft does not; a draft whose fixed cost pays only when shared
 * is granted to the whole batch together, not to one sequence. */
START_TEST(test_decide_draft_model) {
    duet_spec_cand c[8];
    const duet_step_cost target = cost_model(0.040, 0.002);
    duet_step_cost draft = cost_model(0.028, 0.001);
    duet_spec_decision d = decide(&target, &draft, 1, 8, 0.98f, c);
    ck_assert_msg(c[0].k >= 4 && d.speedup > 1.15 && d.draft_seconds > 0.1, "k %d speedup %.3f draft %.3f s",
                  c[0].k, d.speedup, d.draft_seconds);
    /* Its draft seconds are k passes of one token (catch-up 1). */
    ck_assert_double_eq_tol(d.draft_seconds, c[0].k * (0.028 + 0.001), 1e-12);
    duet_step_cost dear = cost_model(0.045, 0.001);
    d = decide(&target, &dear, 1, 8, 0.98f, c);
    ck_assert_msg(d.tokens_granted == 0, "a draft dearer than the target: %d granted", d.tokens_granted);
    /* Shared fixed cost: 4 decodes, alpha 0.9, offers of 4. Any one
     * sequence drafting alone lowers the step's rate (a pass costs about
     * as much as its share of the step), all four together raise it. */
    const duet_step_cost t2 = cost_model(0.040, 0.001);
    duet_step_cost d2 = cost_model(0.020, 0.0005);
    duet_spec_cand one[4];
    duet_step_shape base = {0};
    for (int i = 0; i < 4; i++)
        duet_step_shape_add(&base, 100 + 10 * i, 1, true);
    one[0] = (duet_spec_cand){.pos = 100, .offer = 4, .alpha = 0.9f, .catchup = 1};
    duet__spec_decide(&t2, &d2, &base, one, 1, &d);
    ck_assert_msg(d.tokens_granted == 0, "one of four alone: %d granted (%.3fx)", d.tokens_granted,
                  d.speedup);
    d = decide(&t2, &d2, 4, 4, 0.9f, c);
    ck_assert_msg(d.n_granted == 4 && d.speedup > 1.1, "shared passes: %d granted, %.3fx", d.n_granted,
                  d.speedup);
}
END_TEST

/* The draft's backlog (tokens its KV missed while the sequence did not
 * draft): a sequence with many tokens still to generate starts drafting
 * and pays its share; the same sequence with a few tokens left does not,
 * though drafting pays once the draft has caught up. Where it is granted,
 * draft_seconds counts the whole backlog (the pass will take it). */
START_TEST(test_decide_backlog) {
    const duet_step_cost target = cost_model(0.040, 0.002);
    /* A pass: 10 ms fixed, 1 ms a token (a 300-token backlog: 0.3 s, more than 7 target steps). */
    const duet_step_cost draft = cost_model(0.010, 0.001);
    duet_step_shape base = {0};
    duet_step_shape_add(&base, 400, 1, true);
    duet_spec_decision d;
    duet_spec_cand c = {.pos = 400, .offer = 8, .alpha = 0.9f, .catchup = 1};
    duet__spec_decide(&target, &draft, &base, &c, 1, &d);
    ck_assert_msg(c.k > 0, "caught up: k %d (%.3fx)", c.k, d.speedup);
    const double steady = d.speedup, steady_draft_s = d.draft_seconds;
    /* 300 tokens behind, 1000 to go: its share (E / 1000 of 0.3 s) barely matters. */
    c = (duet_spec_cand){
        .pos = 400, .offer = 8, .alpha = 0.9f, .catchup = 1, .backlog = 300, .remaining = 1000};
    duet__spec_decide(&target, &draft, &base, &c, 1, &d);
    ck_assert_msg(c.k > 0 && d.speedup > 1.02 && d.speedup < steady,
                  "1000 to go: k %d (%.3fx, %.3fx caught up)", c.k, d.speedup, steady);
    ck_assert_msg(d.draft_seconds > steady_draft_s + 0.25, "draft seconds %.3f (caught up %.3f)",
                  d.draft_seconds, steady_draft_s);
    /* 300 tokens behind, 10 to go: the catch-up costs more than drafting saves. */
    c.remaining = 10;
    duet__spec_decide(&target, &draft, &base, &c, 1, &d);
    ck_assert_msg(c.k == 0 && d.tokens_granted == 0, "10 to go: k %d (%.3fx)", c.k, d.speedup);
    /* Unknown remainder: the backlog is charged whole. */
    c.remaining = 0;
    duet__spec_decide(&target, &draft, &base, &c, 1, &d);
    ck_assert_int_eq(c.k, 0);
    /* A backlog longer than the stream is clamped to it. */
    c = (duet_spec_cand){
        .pos = 10, .offer = 8, .alpha = 0.9f, .catchup = 1, .backlog = 500, .remaining = 1000};
    duet__spec_decide(&target, &draft, &base, &c, 1, &d);
    ck_assert_int_eq(c.backlog, 10);
}
END_TEST

static Suite *spec_suite(void) {
    Suite *s = suite_create("speculative");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_ngram_basic);
    tcase_add_test(tc, test_ngram_edges);
    tcase_add_test(tc, test_greedy);
    tcase_add_test(tc, test_seeded);
    tcase_add_test(tc, test_adapt);
    tcase_add_test(tc, test_verifier_args);
    tcase_add_test(tc, test_decide);
    tcase_add_test(tc, test_decide_draft_model);
    tcase_add_test(tc, test_decide_backlog);
    suite_add_tcase(s, tc);
    TCase *dist = tcase_create("distribution");
    tcase_set_timeout(dist, 240);
    tcase_add_loop_test(dist, test_distribution_draft_model, 0, N_SETTINGS);
    tcase_add_loop_test(dist, test_distribution_deterministic, 0, N_SETTINGS);
    tcase_add_test(dist, test_broken_residual_fails);
    suite_add_tcase(s, dist);
    return s;
}

int main(void) {
    return test_run_suite(spec_suite());
}
