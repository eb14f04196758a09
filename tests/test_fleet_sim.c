/* test_fleet_sim.c — duet_simulate (core/fleet_sim.c): the engine's
 * scheduler on a virtual clock with steps costed by the step-cost model.
 * Timelines small enough to work out by hand (a lone request, batching,
 * batch_timeout, prefill cost, queue-full refusals, the context clamp, the
 * router spreading work), then a long Poisson run: every request served,
 * time order, determinism, and an hour of traffic in well under a second
 * per simulated instance-hour; step costs drawn from a dispersion: seeded,
 * and queueing that grows with it. */
#include <check.h>
#include <math.h>
#include <time.h>
#include <string.h>

#include "duet.h"
#include "test_util.h"

#define MS 1e-3

static duet_sim_params params(double step_ms) {
    duet_sim_params p = {.n_instances = 1, .engine = duet_engine_params_default(), .n_ctx = 512};
    p.engine.batch_timeout_ms = 0;
    p.cost.coef[0] = step_ms * MS;
    return p;
}

static bool near(double a, double b) {
    return fabs(a - b) < 1e-9;
}

/* Token times of request 0, recorded by the callback. */
typedef struct tokens {
    double t[4096], last;
    int n;
    bool ordered;
} tokens;

static void on_token(int request, int index, double t, void *user) {
    tokens *k = user;
    if (k->n && t < k->last) k->ordered = false;
    if (k->n < 4096) k->t[k->n] = t;
    k->last = t;
    k->n++;
    (void)index, (void)request;
}

/* Every step as on_step reports it. */
typedef struct steps {
    double t[64], seconds[64];
    int seqs[64], n;
    duet_step_shape shape[64];
} steps;

static void on_step(int instance, double t, double seconds, int n_seqs, const duet_step_shape *shape,
                    void *user) {
    steps *s = user;
    ck_assert_int_eq(instance, 0);
    if (s->n < 64)
        s->t[s->n] = t, s->seconds[s->n] = seconds, s->seqs[s->n] = n_seqs, s->shape[s->n] = *shape;
    s->n++;
}

START_TEST(lone_request_timeline) {
    duet_sim_params p = params(10);
    tokens k = {.ordered = true};
    p.on_token = on_token;
    p.user = &k;
    duet_sim_request r = {.arrival = 1.0, .n_prompt = 32, .n_output = 5};
    duet_sim_outcome o;
    duet_sim_stats st;
    ck_assert_int_eq(duet_simulate(&p, &r, 1, &o, &st), DUET_OK);
    /* One step prefills the prompt and samples the first token; then a
     * decode step per token: 10 ms each. */
    ck_assert_int_eq(o.status, DUET_OK);
    ck_assert_int_eq(o.instance, 0);
    ck_assert_int_eq(o.n_generated, 5);
    ck_assert_msg(near(o.first_token, 1.010), "first token at %.9f", o.first_token);
    ck_assert_msg(near(o.done, 1.050), "done at %.9f", o.done);
    ck_assert_int_eq(k.n, 5);
    for (int i = 0; i < 5; i++)
        ck_assert(near(k.t[i], 1.010 + 0.010 * i));
    ck_assert(st.steps == 5 && near(st.busy_s, 0.05) && near(st.end, 1.05));

    /* The prompt's cost: 100 prompt tokens at 0.1 ms in 128-token chunks,
     * and their attention (sum of 1..100 positions at 1 us). */
    p.cost.coef[2] = 0.1 * MS;
    p.cost.coef[4] = 1e-6;
    r.n_prompt = 100;
    r.n_output = 1;
    k.n = 0;
    ck_assert_int_eq(duet_simulate(&p, &r, 1, &o, &st), DUET_OK);
    ck_assert_msg(near(o.first_token, 1.0 + 0.010 + 0.010 + 5050e-6), "first token at %.9f", o.first_token);
    ck_assert(near(o.done, o.first_token));

    /* A chunk of 64: the first step runs half the prompt, no token. */
    p.engine.prefill_chunk = 64;
    ck_assert_int_eq(duet_simulate(&p, &r, 1, &o, &st), DUET_OK);
    double s1 = 0.010 + 64 * 0.1 * MS + (64.0 * 65 / 2) * 1e-6;
    double s2 = 0.010 + 36 * 0.1 * MS + (36.0 * 64 + 36.0 * 37 / 2) * 1e-6;
    ck_assert_msg(near(o.first_token, 1.0 + s1 + s2), "first token at %.9f", o.first_token);
    ck_assert(st.steps == 2);

    /* The steps as they start: their times, costs and sizes. */
    steps sk = {0};
    p.on_token = NULL;
    p.on_step = on_step;
    p.user = &sk;
    ck_assert_int_eq(duet_simulate(&p, &r, 1, &o, &st), DUET_OK);
    ck_assert_int_eq(sk.n, 2);
    ck_assert(near(sk.t[0], 1.0) && near(sk.seconds[0], s1) && sk.seqs[0] == 1);
    ck_assert(near(sk.t[1], 1.0 + s1) && near(sk.seconds[1], s2) && sk.seqs[1] == 1);
    /* Their shapes: prompt chunks of 64 and 36 tokens at positions 0.. and
     * 64.., no decode. */
    ck_assert(sk.shape[0].n_prefill == 64 && sk.shape[0].n_decode == 0 && sk.shape[0].decode_ctx == 0);
    ck_assert(near(sk.shape[0].prefill_ctx, 64.0 * 65 / 2));
    ck_assert(sk.shape[1].n_prefill == 36 && sk.shape[1].n_decode == 0);
    ck_assert(near(sk.shape[1].prefill_ctx, 36.0 * 64 + 36.0 * 37 / 2));
    /* A two-token output: its second step decodes one token at position
     * 100 (context 101). */
    r.n_output = 2;
    sk.n = 0;
    ck_assert_int_eq(duet_simulate(&p, &r, 1, &o, &st), DUET_OK);
    ck_assert_int_eq(sk.n, 3);
    ck_assert(sk.shape[2].n_decode == 1 && sk.shape[2].n_prefill == 0 && near(sk.shape[2].decode_ctx, 101));
    double d = sk.seconds[2];

    /* Speeds by kind: prompt chunks twice the model, decodes three times. */
    p.prompt_scale = 2;
    p.decode_scale = 3;
    sk.n = 0;
    ck_assert_int_eq(duet_simulate(&p, &r, 1, &o, &st), DUET_OK);
    ck_assert_int_eq(sk.n, 3);
    ck_assert(near(sk.seconds[0], 2 * s1) && near(sk.seconds[1], 2 * s2) && near(sk.seconds[2], 3 * d));
    ck_assert_msg(near(o.done, 1.0 + 2 * (s1 + s2) + 3 * d), "done at %.9f", o.done);
    p.decode_scale = -1;
    ck_assert_int_eq(duet_simulate(&p, &r, 1, &o, &st), DUET_INVALID_ARGUMENT);
    ck_assert_ptr_nonnull(strstr(duet_last_error(), "step scales"));
}
END_TEST

/* Request 0's largest gap between tokens from `after` on. */
typedef struct gaps {
    double after, last, max;
} gaps;

static void on_token_gap(int request, int index, double t, void *user) {
    gaps *g = user;
    if (request != 0) return;
    if (index > 0 && t > g->after && t - g->last > g->max) g->max = t - g->last;
    g->last = t;
}

START_TEST(serve_targets_budget_steps_and_run_the_controller) {
    /* A long decode, then a 1000-token prompt: without targets its 128-token
     * chunks ride along with the decode (5 + 1 + 64 ms steps); with an ITL
     * target of 40 ms the step budget (0.8 of it, as duet serve starts)
     * cuts them to what fits 32 ms, and the controller runs each window. */
    duet_sim_params p = params(5);
    p.n_ctx = 2048;
    p.cost.coef[1] = 1 * MS;
    p.cost.coef[2] = 0.5 * MS;
    duet_sim_request r[2] = {{.arrival = 0, .n_prompt = 16, .n_output = 800},
                             {.arrival = 0.1, .n_prompt = 1000, .n_output = 1}};
    duet_sim_outcome o[2];
    duet_sim_stats st;
    gaps g = {.after = 0.1};
    p.on_token = on_token_gap;
    p.user = &g;
    ck_assert_int_eq(duet_simulate(&p, r, 2, o, &st), DUET_OK);
    ck_assert_msg(near(g.max, 0.070), "largest gap %.9f without a target", g.max);
    ck_assert(st.controller_windows == 0);
    double plain_first = o[1].first_token;

    p.engine.slo_itl_ms[DUET_PRIORITY_INTERACTIVE] = 40;
    g = (gaps){.after = 0.1};
    ck_assert_int_eq(duet_simulate(&p, r, 2, o, &st), DUET_OK);
    ck_assert_msg(g.max <= 0.032 + 1e-9 && g.max > 0.025, "largest gap %.9f under a 32 ms budget", g.max);
    ck_assert_msg(o[1].first_token > plain_first, "the long prompt's first token: %g, %g without",
                  o[1].first_token, plain_first);
    ck_assert_msg(st.controller_windows >= 2, "controller windows: %llu",
                  (unsigned long long)st.controller_windows);
    ck_assert(o[0].status == DUET_OK && o[0].n_generated == 800 && o[1].status == DUET_OK);
}
END_TEST

START_TEST(batching_and_batch_timeout) {
    duet_sim_params p = params(10);
    duet_sim_request r[3] = {{.arrival = 0, .n_prompt = 8, .n_output = 3},
                             {.arrival = 0.001, .n_prompt = 8, .n_output = 3},
                             {.arrival = 0.024, .n_prompt = 8, .n_output = 2}};
    duet_sim_outcome o[3];
    duet_sim_stats st;
    ck_assert_int_eq(duet_simulate(&p, r, 3, o, &st), DUET_OK);
    /* No timeout: request 0 starts alone at 0; request 1 joins at the next
     * plan (10 ms); request 2 at the plan at 30 ms. */
    ck_assert(near(o[0].first_token, 0.010) && near(o[0].done, 0.030));
    ck_assert(near(o[1].first_token, 0.020) && near(o[1].done, 0.040));
    ck_assert_msg(near(o[2].first_token, 0.040), "%.9f", o[2].first_token);

    /* A 5 ms batch_timeout: the first step waits for request 1 and starts
     * at 5 ms with both. */
    p.engine.batch_timeout_ms = 5;
    ck_assert_int_eq(duet_simulate(&p, r, 3, o, &st), DUET_OK);
    ck_assert_msg(near(o[0].first_token, 0.015), "%.9f", o[0].first_token);
    ck_assert(near(o[1].first_token, 0.015));
    ck_assert(near(o[0].done, 0.035) && near(o[1].done, 0.035));
    /* Request 2 arrives while they run: it joins at the plan at 25 ms. */
    ck_assert_msg(near(o[2].first_token, 0.035), "%.9f", o[2].first_token);
}
END_TEST

START_TEST(refusals_and_context_clamp) {
    duet_sim_params p = params(10);
    p.engine.max_batch_seqs = 1;
    p.engine.max_batch_tokens = 16;
    p.engine.prefill_chunk = 16;
    p.engine.max_waiting = 1;
    duet_sim_request r[5] = {{.arrival = 0, .n_prompt = 8, .n_output = 2},
                             {.arrival = 0, .n_prompt = 8, .n_output = 2},
                             {.arrival = 0, .n_prompt = 8, .n_output = 2},
                             {.arrival = 1, .n_prompt = 600, .n_output = 2},
                             {.arrival = 2, .n_prompt = 500, .n_output = 50}};
    duet_sim_outcome o[5];
    ck_assert_int_eq(duet_simulate(&p, r, 5, o, NULL), DUET_OK);
    ck_assert_int_eq(o[0].status, DUET_OK);
    ck_assert_int_eq(o[1].status, DUET_OK); /* waits: the queue holds one */
    ck_assert_int_eq(o[2].status, DUET_QUEUE_FULL);
    ck_assert(isnan(o[2].first_token) && o[2].done == 0);
    ck_assert(near(o[1].first_token, 0.030)); /* after request 0's two steps */
    ck_assert_int_eq(o[3].status, DUET_CONTEXT_FULL);
    /* 500 + 50 > 512: generation stops at the context's end, as submit clamps. */
    ck_assert_int_eq(o[4].status, DUET_OK);
    ck_assert_int_eq(o[4].n_generated, 12);

    /* Bad parameters say what is wrong. */
    duet_sim_request bad[2] = {{.arrival = 1, .n_prompt = 8, .n_output = 2},
                               {.arrival = 0.5, .n_prompt = 8, .n_output = 2}};
    ck_assert_int_eq(duet_simulate(&p, bad, 2, o, NULL), DUET_INVALID_ARGUMENT);
    ck_assert_msg(strstr(duet_last_error(), "request 1"), "%s", duet_last_error());
    p.cost.coef[3] = -1;
    ck_assert_int_eq(duet_simulate(&p, r, 1, o, NULL), DUET_INVALID_ARGUMENT);
    ck_assert(strstr(duet_last_error(), "per_decode_context"));
    p.cost.coef[3] = 0;
    p.n_instances = 0;
    ck_assert_int_eq(duet_simulate(&p, r, 1, o, NULL), DUET_INVALID_ARGUMENT);
    p.n_instances = 1;
    p.engine.prefill_chunk = 100; /* > max_batch_tokens: the scheduler refuses the knobs */
    ck_assert_int_eq(duet_simulate(&p, r, 1, o, NULL), DUET_INVALID_ARGUMENT);
}
END_TEST

START_TEST(router_spreads_work) {
    duet_sim_params p = params(10);
    p.engine.max_batch_seqs = 1;
    p.engine.max_batch_tokens = 16;
    p.engine.prefill_chunk = 16;
    duet_sim_request r[4];
    for (int i = 0; i < 4; i++)
        r[i] = (duet_sim_request){.arrival = 0, .n_prompt = 8, .n_output = 4};
    duet_sim_outcome o[4];
    /* One instance, one slot: they run one after another. */
    ck_assert_int_eq(duet_simulate(&p, r, 4, o, NULL), DUET_OK);
    ck_assert(near(o[3].first_token, 0.130) && near(o[3].done, 0.160));
    /* Four instances: each takes one; all finish at 40 ms. */
    p.n_instances = 4;
    ck_assert_int_eq(duet_simulate(&p, r, 4, o, NULL), DUET_OK);
    bool used[4] = {0};
    for (int i = 0; i < 4; i++) {
        ck_assert(near(o[i].done, 0.040));
        used[o[i].instance] = true;
    }
    ck_assert(used[0] && used[1] && used[2] && used[3]);
    /* Two instances: a long request on one, the short ones go to the other
     * until its outstanding work catches up. */
    p.n_instances = 2;
    r[0].n_output = 40;
    ck_assert_int_eq(duet_simulate(&p, r, 4, o, NULL), DUET_OK);
    ck_assert(o[1].instance != o[0].instance && o[2].instance != o[0].instance);
}
END_TEST

START_TEST(long_poisson_run) {
    /* An hour at 3 req/s on a SmolLM2-like cpu profile, two instances. */
    duet_sim_params p = {.n_instances = 2, .engine = duet_engine_params_default(), .n_ctx = 2048};
    const double coef[DUET_STEP_COST_TERMS] = {12e-3, 1.2e-3, 2.2e-3, 2e-7, 3e-7};
    memcpy(p.cost.coef, coef, sizeof coef);
    tokens *k = calloc(1, sizeof *k);
    k->ordered = true;
    p.on_token = on_token;
    p.user = k;
    enum { n = 10800 };
    duet_sim_request *r = calloc(n, sizeof *r);
    duet_sim_outcome *o = calloc(n, sizeof *o), *o2 = calloc(n, sizeof *o2);
    uint64_t s = 1;
    double t = 0;
    for (int i = 0; i < n; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        double u = ((double)(s >> 11) + 0.5) * 0x1.0p-53;
        t += -log(u) / 3.0;
        r[i] = (duet_sim_request){.arrival = t,
                                  .n_prompt = 50 + i % 100,
                                  .n_output = 20 + i % 60,
                                  .priority = i % 3 ? DUET_PRIORITY_INTERACTIVE : DUET_PRIORITY_BATCH};
    }
    duet_sim_stats st, st2;
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    ck_assert_int_eq(duet_simulate(&p, r, n, o, &st), DUET_OK);
    clock_gettime(CLOCK_MONOTONIC, &b);
    double wall = (double)(b.tv_sec - a.tv_sec) + (double)(b.tv_nsec - a.tv_nsec) * 1e-9;
    ck_assert_msg(wall < 20, "an hour of traffic took %.1f s to simulate", wall);
    ck_assert(k->ordered);
    long tokens_out = 0;
    int used[2] = {0};
    for (int i = 0; i < n; i++) {
        ck_assert_int_eq(o[i].status, DUET_OK);
        ck_assert_int_eq(o[i].n_generated, r[i].n_output);
        ck_assert(o[i].first_token > r[i].arrival && o[i].done >= o[i].first_token);
        tokens_out += o[i].n_generated;
        used[o[i].instance]++;
    }
    ck_assert(k->n == tokens_out);
    ck_assert(used[0] > n / 4 && used[1] > n / 4);
    ck_assert(st.end > t && st.end < t + 60);
    /* The same input gives the same output. */
    p.on_token = NULL;
    ck_assert_int_eq(duet_simulate(&p, r, n, o2, &st2), DUET_OK);
    ck_assert(st.steps == st2.steps && st.end == st2.end);
    for (int i = 0; i < n; i++)
        ck_assert(o[i].first_token == o2[i].first_token && o[i].done == o2[i].done &&
                  o[i].instance == o2[i].instance);
    fprintf(stderr, "simulated %.0f s of traffic (%d requests, %llu steps) in %.3f s\n", st.end, n,
            (unsigned long long)st.steps, wall);
    free(r), free(o), free(o2), free(k);
}
END_TEST

/* Poisson arrivals at `rate`, one-token prompts and outputs. */
static duet_sim_request *poisson(int n, double rate, uint64_t seed) {
    duet_sim_request *r = calloc((size_t)n, sizeof *r);
    double t = 0;
    for (int i = 0; i < n; i++) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        t += -log(((double)(seed >> 11) + 0.5) * 0x1.0p-53) / rate;
        r[i] = (duet_sim_request){.arrival = t, .n_prompt = 1, .n_output = 1};
    }
    return r;
}

/* Step costs times a uniform in [1 - a, 1 + a] (mean 1: the same
 * utilisation), as two quantiles. */
static void uniform_noise(duet_sim_params *p, double a) {
    p->cost.n_noise = 2;
    p->cost.noise_level[0] = 0, p->cost.noise_level[1] = 1;
    p->cost.noise_ratio[0] = 1 - a, p->cost.noise_ratio[1] = 1 + a;
}

static double mean_ttft(const duet_sim_request *r, const duet_sim_outcome *o, int n) {
    double s = 0;
    for (int i = 0; i < n; i++) {
        ck_assert_int_eq(o[i].status, DUET_OK);
        s += (o[i].first_token - r[i].arrival) / n;
    }
    return s;
}

START_TEST(step_noise_is_seeded_and_grows_queueing) {
    /* 10 ms a prompt token and nothing else (a batch saves nothing), one
     * token in and out, Poisson at 85% of the 100 req/s this serves. */
    enum { n = 20000 };
    duet_sim_params p = params(0);
    p.cost.coef[2] = 10 * MS;
    duet_sim_request *r = poisson(n, 85, 7);
    duet_sim_outcome *o = calloc(n, sizeof *o), *o2 = calloc(n, sizeof *o2);
    duet_sim_stats st, st2;
    /* Off, or a profile without a dispersion: the model's costs. */
    ck_assert_int_eq(duet_simulate(&p, r, n, o, &st), DUET_OK);
    double t_det = mean_ttft(r, o, n), busy_det = st.busy_s;
    p.step_noise = true;
    p.noise_seed = 42;
    ck_assert_int_eq(duet_simulate(&p, r, n, o2, &st2), DUET_OK);
    ck_assert(st.end == st2.end && mean_ttft(r, o2, n) == t_det);
    /* With one: the same seed, the same run; another seed, another. */
    uniform_noise(&p, 0.5);
    ck_assert_int_eq(duet_simulate(&p, r, n, o, &st), DUET_OK);
    ck_assert_int_eq(duet_simulate(&p, r, n, o2, &st2), DUET_OK);
    ck_assert(st.steps == st2.steps && st.end == st2.end);
    for (int i = 0; i < n; i++)
        ck_assert(o[i].first_token == o2[i].first_token && o[i].done == o2[i].done);
    double t_half = mean_ttft(r, o, n), busy_half = st.busy_s;
    p.noise_seed = 43;
    ck_assert_int_eq(duet_simulate(&p, r, n, o2, &st2), DUET_OK);
    ck_assert(st.end != st2.end || mean_ttft(r, o2, n) != t_half);
    /* Queueing grows with the dispersion at the same utilisation
     * (Pollaczek-Khinchine: waiting ~ 1 + CV^2; a uniform +-a has CV^2
     * a^2/3). */
    p.noise_seed = 42;
    uniform_noise(&p, 0.95);
    ck_assert_int_eq(duet_simulate(&p, r, n, o, &st), DUET_OK);
    double t_wide = mean_ttft(r, o, n), busy_wide = st.busy_s;
    fprintf(stderr, "mean TTFT at 85%% load: %.1f ms deterministic, %.1f ms +-50%%, %.1f ms +-95%%\n",
            t_det / MS, t_half / MS, t_wide / MS);
    ck_assert(fabs(busy_half / busy_det - 1) < 0.03 && fabs(busy_wide / busy_det - 1) < 0.03);
    ck_assert_msg(t_half > 1.03 * t_det && t_wide > 1.1 * t_half, "mean TTFT %g, %g, %g s", t_det, t_half,
                  t_wide);
    /* Off again: as deterministic as before, whatever the dispersion. */
    p.step_noise = false;
    ck_assert_int_eq(duet_simulate(&p, r, n, o, &st), DUET_OK);
    ck_assert(mean_ttft(r, o, n) == t_det);
    free(r), free(o), free(o2);
}
END_TEST

int main(void) {
    Suite *s = suite_create("fleet_sim");
    TCase *tc = tcase_create("fleet_sim");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, lone_request_timeline);
    tcase_add_test(tc, batching_and_batch_timeout);
    tcase_add_test(tc, serve_targets_budget_steps_and_run_the_controller);
    tcase_add_test(tc, refusals_and_context_clamp);
    tcase_add_test(tc, router_spreads_work);
    tcase_add_test(tc, long_poisson_run);
    tcase_add_test(tc, step_noise_is_seeded_and_grows_queueing);
    suite_add_tcase(s, tc);
    return test_run_suite(s);
}
