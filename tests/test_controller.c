/* test_controller.c — the adaptive controller: its law window by window, and
 * closed loops on a virtual clock with the real scheduler under it and a
 * step-cost model standing in for the device (constant load, a ramp up to
 * past capacity and back, a burst): it converges, does not oscillate, and
 * keeps interactive p99 ITL under target below capacity. */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "controller.h"
#include "scheduler.h"
#include "test_util.h"

#define MS DUET_SCHED_NS_PER_MS

static duet_ctl_config base_cfg(void) {
    return (duet_ctl_config){.ttft_target_s = {1.0, 0},
                             .itl_target_s = {0.015, 0},
                             .seqs_min = 1,
                             .seqs_max = 32,
                             .tokens_min = 16,
                             .tokens_max = 512,
                             .timeout_min_ns = 0,
                             .timeout_max_ns = 100 * MS};
}

static duet_ctl_window window(double itl_p99, double ttft_p99, int waiting, int running) {
    duet_ctl_window w = {.arrival_rate = 10, .waiting = waiting, .running = running};
    w.itl_p99_s[0] = itl_p99, w.itl_n[0] = itl_p99 >= 0 ? 100 : 0;
    w.ttft_p99_s[0] = ttft_p99, w.ttft_n[0] = ttft_p99 >= 0 ? 20 : 0;
    return w;
}

START_TEST(test_law) {
    duet_ctl c;
    duet_ctl_config g = base_cfg();
    ck_assert_int_eq(duet__ctl_init(&c, &g), DUET_OK);
    duet_ctl_knobs k = {.max_batch_seqs = 16, .max_batch_tokens = 256, .batch_timeout_ns = 2 * MS}, n;
    /* ITL over target: the budget shrinks, the batch stays; TTFT has room
     * (0.2 of its target), so the timeout goes to its cap, 2% of 1 s. */
    duet_ctl_window w = window(0.030, 0.2, 0, 8);
    ck_assert_int_eq(duet__ctl_update(&c, &w, &k, &n), DUET_CTL_PROTECT);
    ck_assert_msg(n.max_batch_tokens < 256 && n.max_batch_tokens >= 256 * 0.6 && n.max_batch_seqs == 16 &&
                      n.batch_timeout_ns == 20 * MS,
                  "protect: tokens %d seqs %d timeout %lld", n.max_batch_tokens, n.max_batch_seqs,
                  (long long)n.batch_timeout_ns);
    /* Down at the batch size, the batch shrinks too, never below the budget. */
    k = (duet_ctl_knobs){.max_batch_seqs = 16, .max_batch_tokens = 16, .batch_timeout_ns = 0};
    ck_assert_int_eq(duet__ctl_update(&c, &w, &k, &n), DUET_CTL_PROTECT);
    ck_assert_msg(n.max_batch_seqs < 16 && n.max_batch_tokens >= n.max_batch_seqs, "seqs %d tokens %d",
                  n.max_batch_seqs, n.max_batch_tokens);

    /* TTFT over with ITL headroom: no timeout, larger steps. */
    ck_assert_int_eq(duet__ctl_init(&c, &g), DUET_OK);
    k = (duet_ctl_knobs){.max_batch_seqs = 16, .max_batch_tokens = 128, .batch_timeout_ns = 8 * MS};
    w = window(0.005, 1.5, 30, 16);
    ck_assert_int_eq(duet__ctl_update(&c, &w, &k, &n), DUET_CTL_CATCH_UP);
    ck_assert_msg(n.batch_timeout_ns == 0 && n.max_batch_tokens > 128 && n.max_batch_seqs > 16,
                  "catch up: timeout %lld tokens %d seqs %d", (long long)n.batch_timeout_ns,
                  n.max_batch_tokens, n.max_batch_seqs);
    /* A queue behind a full batch grows the batch; the timeout follows TTFT's room (cap). */
    ck_assert_int_eq(duet__ctl_init(&c, &g), DUET_OK);
    w = window(0.005, 0.2, 30, 16);
    ck_assert_int_eq(duet__ctl_update(&c, &w, &k, &n), DUET_CTL_CATCH_UP);
    ck_assert_msg(n.batch_timeout_ns == 20 * MS && n.max_batch_seqs > 16, "backlog: timeout %lld seqs %d",
                  (long long)n.batch_timeout_ns, n.max_batch_seqs);

    /* Quiet: the timeout goes to 2% of the TTFT target (20 ms) at once and
     * stays; the budget grows 8% a window to its ceiling. */
    ck_assert_int_eq(duet__ctl_init(&c, &g), DUET_OK);
    k = (duet_ctl_knobs){.max_batch_seqs = 16, .max_batch_tokens = 128, .batch_timeout_ns = 2 * MS};
    w = window(0.003, 0.05, 0, 1);
    for (int i = 0; i < 200; i++) {
        duet_ctl_action a = duet__ctl_update(&c, &w, &k, &n);
        ck_assert(a == DUET_CTL_RELAX || a == DUET_CTL_HOLD);
        ck_assert_msg(n.batch_timeout_ns == 20 * MS, "window %d: timeout %lld", i,
                      (long long)n.batch_timeout_ns);
        k = n;
    }
    ck_assert_msg(k.max_batch_tokens == 512, "quiet: tokens %d", k.max_batch_tokens);
    ck_assert_int_eq(duet__ctl_update(&c, &w, &k, &n), DUET_CTL_HOLD);

    /* Inside the bands: hold the budget; the timeout follows TTFT's room
     * (0.6 of the target: 0.8 of the cap). No targets: hold, whatever the window. */
    ck_assert_int_eq(duet__ctl_init(&c, &g), DUET_OK);
    w = window(0.012, 0.6, 0, 4);
    ck_assert_int_eq(duet__ctl_update(&c, &w, &k, &n), DUET_CTL_HOLD);
    ck_assert_msg(n.max_batch_tokens == k.max_batch_tokens && n.batch_timeout_ns == 16 * MS,
                  "hold: tokens %d timeout %lld", n.max_batch_tokens, (long long)n.batch_timeout_ns);
    duet_ctl_config none = g;
    none.ttft_target_s[0] = none.itl_target_s[0] = 0;
    ck_assert_int_eq(duet__ctl_init(&c, &none), DUET_OK);
    ck_assert(!duet__ctl_active(&c));
    w = window(1, 10, 50, 16);
    ck_assert_int_eq(duet__ctl_update(&c, &w, &k, &n), DUET_CTL_HOLD);
    /* Bad configurations are refused. */
    duet_ctl_config bad = g;
    bad.seqs_min = 0;
    ck_assert_int_eq(duet__ctl_init(&c, &bad), DUET_INVALID_ARGUMENT);
    bad = g;
    bad.itl_target_s[1] = -1;
    ck_assert_int_eq(duet__ctl_init(&c, &bad), DUET_INVALID_ARGUMENT);
    bad = g;
    bad.timeout_max_ns = -1;
    ck_assert_int_eq(duet__ctl_init(&c, &bad), DUET_INVALID_ARGUMENT);
    ck_assert_str_eq(duet__ctl_action_name(DUET_CTL_CATCH_UP), "catch_up");
    bad = g;
    bad.share_max = 0.5, bad.share_min = 0.6;
    ck_assert_int_eq(duet__ctl_init(&c, &bad), DUET_INVALID_ARGUMENT);
    bad.share_max = 1.5, bad.share_min = 0.2;
    ck_assert_int_eq(duet__ctl_init(&c, &bad), DUET_INVALID_ARGUMENT);
}
END_TEST

START_TEST(test_law_time_budget) {
    /* With time budgets the step budget is a share of the ITL targets:
     * it moves, max_batch_tokens does not. */
    duet_ctl c;
    duet_ctl_config g = base_cfg();
    g.share_min = 0.25, g.share_max = 1;
    ck_assert_int_eq(duet__ctl_init(&c, &g), DUET_OK);
    duet_ctl_knobs k = {.max_batch_seqs = 16,
                        .max_batch_tokens = 256,
                        .batch_timeout_ns = 2 * MS,
                        .budget_share = 0.8},
                   n;
    duet_ctl_window w = window(0.030, 0.2, 0, 8);
    ck_assert_int_eq(duet__ctl_update(&c, &w, &k, &n), DUET_CTL_PROTECT);
    ck_assert_msg(n.budget_share < 0.8 && n.budget_share >= 0.8 * 0.6 && n.max_batch_tokens == 256 &&
                      n.max_batch_seqs == 16,
                  "protect: share %g tokens %d seqs %d", n.budget_share, n.max_batch_tokens,
                  n.max_batch_seqs);
    /* At its floor, the batch shrinks instead. */
    k.budget_share = 0.25;
    ck_assert_int_eq(duet__ctl_update(&c, &w, &k, &n), DUET_CTL_PROTECT);
    ck_assert_msg(n.budget_share == 0.25 && n.max_batch_seqs < 16, "share %g seqs %d", n.budget_share,
                  n.max_batch_seqs);
    /* Quiet, and the budget never shortened a chunk: growing it buys nothing. */
    ck_assert_int_eq(duet__ctl_init(&c, &g), DUET_OK);
    k = (duet_ctl_knobs){
        .max_batch_seqs = 16, .max_batch_tokens = 128, .batch_timeout_ns = 2 * MS, .budget_share = 0.5};
    w = window(0.003, 0.05, 0, 1);
    ck_assert(duet__ctl_update(&c, &w, &k, &n) != DUET_CTL_PROTECT);
    ck_assert_msg(n.budget_share == 0.5 && n.max_batch_tokens == 128, "share %g tokens %d", n.budget_share,
                  n.max_batch_tokens);
    /* Quiet, and it did: the share grows to its ceiling, the token budget stays. */
    w.budget_cut = 3;
    for (int i = 0; i < 100; i++) {
        duet_ctl_action a = duet__ctl_update(&c, &w, &k, &n);
        ck_assert(a == DUET_CTL_RELAX || a == DUET_CTL_HOLD);
        ck_assert(n.budget_share <= k.budget_share * 1.081);
        k = n;
    }
    ck_assert_msg(k.budget_share == 1 && k.max_batch_tokens == 128, "quiet: share %g tokens %d",
                  k.budget_share, k.max_batch_tokens);
}
END_TEST

/* ---- closed loop on a virtual clock ------------------------------------------- */

#define PROMPT 200
#define OUTPUT 32
#define WINDOW_NS (2000 * MS)
#define MAX_REQ 60000
#define MAX_WINDOWS 200

/* The device: a fixed cost per step, per token and per sequence. */
static int64_t step_cost(const duet_sched_plan *p) {
    return 3 * MS + (int64_t)p->n_tokens * 60000 + (int64_t)p->n_seqs * 100000;
}

typedef struct loop_req {
    int64_t arrival, last_token;
    int prio, gen;
} loop_req;

typedef struct window_rec {
    double rate;          /* offered */
    duet_ctl_knobs knobs; /* in force during the window */
    double itl_p99[2], ttft_p99[2];
    int waiting;
    duet_ctl_action action;
} window_rec;

typedef struct samples {
    double *v[2][2]; /* [itl/ttft][class] */
    int n[2][2];
} samples;

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double p99(double *v, int n) {
    if (n == 0) return -1;
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    int k = (int)ceil(0.99 * n) - 1;
    return v[k < 0 ? 0 : k];
}

static void add_sample(samples *s, int kind, int prio, double v) {
    if (s->n[kind][prio] < MAX_REQ * 4) s->v[kind][prio][s->n[kind][prio]++] = v;
}

static uint64_t g_rng;
static double unit(void) {
    uint64_t z = (g_rng += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return (double)((z ^ (z >> 31)) >> 11) / 9007199254740992.0;
}

/* Runs n_windows windows; rate(w) is the offered Poisson rate of window w,
 * burst(w) requests arrive at its start on top. With use_ctl the
 * controller retunes the scheduler after every window. Fills rec[]. */
typedef double (*rate_fn)(int w);
/* With `timed` the scheduler sizes steps with time budgets, from a
 * step-cost model of the stand-in device, and the controller retunes their
 * share of the ITL target. */
static void run_loop(int n_windows, rate_fn rate, int (*burst)(int w), bool use_ctl, bool timed,
                     window_rec *rec) {
    duet_sched_config sc = {.max_seqs = 32,
                            .max_tokens = 512,
                            .max_waiting = 8192,
                            .n_ctx = 512,
                            .kv_block_size = 16,
                            .kv_blocks = 1024,
                            .knobs = {.max_batch_seqs = 16,
                                      .max_batch_tokens = 256,
                                      .prefill_chunk = 128,
                                      .max_waiting = 8192,
                                      .batch_timeout_ns = 2 * MS}};
    duet_sched *s = NULL;
    ck_assert_int_eq(duet__sched_new(&sc, &s), DUET_OK);
    duet_ctl ctl;
    duet_ctl_config cc = base_cfg();
    double share = 0;
    if (timed) {
        /* The model knows the device but for its per-chunk cost. */
        duet_step_cost m = {.coef = {3e-3, 160e-6, 60e-6, 0, 0}};
        duet__sched_set_cost(s, &m);
        cc.share_min = 0.25, cc.share_max = 1, share = 0.8;
        duet_sched_knobs kn = duet__sched_knobs(s);
        kn.step_budget_ns[0] = (int64_t)(share * cc.itl_target_s[0] * 1e9);
        ck_assert_int_eq(duet__sched_set_knobs(s, &kn), DUET_OK);
    }
    ck_assert_int_eq(duet__ctl_init(&ctl, &cc), DUET_OK);
    loop_req *reqs = calloc(MAX_REQ, sizeof *reqs);
    samples sm = {0};
    for (int k = 0; k < 2; k++)
        for (int p = 0; p < 2; p++)
            sm.v[k][p] = malloc(MAX_REQ * 4 * sizeof(double));
    g_rng = 12345;
    int n_req = 0, w = 0;
    int64_t now = 0, next_arrival = 0, step_end = -1, wake = -1;
    double r0 = rate(0);
    next_arrival = (int64_t)(-log(1 - unit()) / r0 * 1e9);
    int pending_burst = burst ? burst(0) : 0;
    duet_sched_plan plan;
    bool outstanding = false;
    while (w < n_windows) {
        int64_t w_end = (int64_t)(w + 1) * WINDOW_NS;
        /* Arrivals up to now (and a window's burst at its start). */
        while (pending_burst > 0 || next_arrival <= now) {
            ck_assert(n_req < MAX_REQ);
            int id = n_req++;
            reqs[id] = (loop_req){.arrival = pending_burst > 0 ? now : next_arrival, .prio = id % 2};
            duet_sched_admit a = duet__sched_arrival(s, reqs[id].arrival, (uint64_t)id, PROMPT, OUTPUT,
                                                     (duet_priority)reqs[id].prio);
            ck_assert_int_eq(a, DUET_SCHED_ADMITTED);
            if (pending_burst > 0) {
                pending_burst--;
                continue;
            }
            double r = rate(w);
            next_arrival += (int64_t)(-log(1 - unit()) / r * 1e9);
        }
        if (!outstanding) {
            duet_sched_action act = duet__sched_plan(s, now, &plan);
            if (act == DUET_SCHED_STEP) {
                outstanding = true;
                step_end = now + step_cost(&plan);
            }
            wake = act == DUET_SCHED_WAIT ? plan.wake_at : -1;
        }
        int64_t t = now < w_end ? w_end : INT64_MAX;
        if (next_arrival < t) t = next_arrival;
        if (outstanding && step_end < t) t = step_end;
        if (!outstanding && wake >= 0 && wake < t) t = wake;
        if (t > now) now = t;
        if (outstanding && step_end <= now) {
            duet_sched_result res[32];
            for (int k = 0; k < plan.n_seqs; k++) {
                const duet_sched_seq *e = &plan.seqs[k];
                loop_req *r = &reqs[e->id];
                res[k] = (duet_sched_result){.id = e->id, .n_generated = e->logits ? 1 : 0};
                if (!e->logits) continue;
                if (r->gen == 0)
                    add_sample(&sm, 1, r->prio, (double)(now - r->arrival) * 1e-9);
                else
                    add_sample(&sm, 0, r->prio, (double)(now - r->last_token) * 1e-9);
                r->last_token = now;
                res[k].finished = ++r->gen == OUTPUT;
            }
            ck_assert_int_eq(duet__sched_step_done(s, now, res, plan.n_seqs), DUET_OK);
            outstanding = false;
        }
        if (now >= w_end && !outstanding) {
            /* A window ends (after the step that crossed it). */
            window_rec *wr = &rec[w];
            duet_sched_stats st;
            duet__sched_stats(s, &st);
            duet_sched_knobs kn = duet__sched_knobs(s);
            wr->rate = rate(w);
            wr->knobs = (duet_ctl_knobs){kn.max_batch_seqs, kn.max_batch_tokens, kn.batch_timeout_ns, share};
            wr->waiting = st.waiting[0] + st.waiting[1];
            duet_ctl_window cw = {.arrival_rate = wr->rate,
                                  .waiting = wr->waiting,
                                  .running = st.running[0] + st.running[1],
                                  .budget_cut = (int)(st.budget_cut - ctl.budget_cut_seen)};
            ctl.budget_cut_seen = st.budget_cut;
            for (int p = 0; p < 2; p++) {
                cw.itl_n[p] = sm.n[0][p], cw.ttft_n[p] = sm.n[1][p];
                cw.itl_p99_s[p] = wr->itl_p99[p] = p99(sm.v[0][p], sm.n[0][p]);
                cw.ttft_p99_s[p] = wr->ttft_p99[p] = p99(sm.v[1][p], sm.n[1][p]);
                sm.n[0][p] = sm.n[1][p] = 0;
            }
            wr->action = DUET_CTL_HOLD;
            if (use_ctl) {
                duet_ctl_knobs next;
                wr->action = duet__ctl_update(&ctl, &cw, &wr->knobs, &next);
                kn.max_batch_seqs = next.max_batch_seqs;
                kn.max_batch_tokens = next.max_batch_tokens;
                kn.batch_timeout_ns = next.batch_timeout_ns;
                if (timed) {
                    share = next.budget_share;
                    kn.step_budget_ns[0] = (int64_t)(share * cc.itl_target_s[0] * 1e9);
                }
                ck_assert_int_eq(duet__sched_set_knobs(s, &kn), DUET_OK);
            }
            if (getenv("DUET_CTL_TRACE"))
                fprintf(stderr,
                        "w %3d rate %5.1f itl p99 %5.1f/%5.1f ms ttft p99 %7.1f/%7.1f ms wait %4d -> %-8s "
                        "seqs %2d tokens %3d timeout %6.2f ms share %.2f\n",
                        w, wr->rate, wr->itl_p99[0] * 1e3, wr->itl_p99[1] * 1e3, wr->ttft_p99[0] * 1e3,
                        wr->ttft_p99[1] * 1e3, wr->waiting, duet__ctl_action_name(wr->action),
                        kn.max_batch_seqs, kn.max_batch_tokens, (double)kn.batch_timeout_ns / MS, share);
            w++;
            if (w < n_windows && burst) pending_burst = burst(w);
            if (w < n_windows && fabs(rate(w) - rate(w - 1)) > 1e-9) /* a new rate from here */
                next_arrival = now + (int64_t)(-log(1 - unit()) / rate(w) * 1e9);
        }
    }
    duet__sched_free(s);
    free(reqs);
    for (int k = 0; k < 2; k++)
        for (int p = 0; p < 2; p++)
            free(sm.v[k][p]);
}

/* Largest relative change of a knob between windows a and b. */
static double knob_change(const window_rec *a, const window_rec *b) {
    double d = fabs((double)b->knobs.max_batch_seqs - a->knobs.max_batch_seqs) / a->knobs.max_batch_seqs;
    double t =
        fabs((double)b->knobs.max_batch_tokens - a->knobs.max_batch_tokens) / a->knobs.max_batch_tokens;
    /* The timeout is compared on a 1 ms floor (0 -> 0.1 ms is not a 100% swing). */
    double base = (double)(a->knobs.batch_timeout_ns > MS ? a->knobs.batch_timeout_ns : MS);
    double o = fabs((double)(b->knobs.batch_timeout_ns - a->knobs.batch_timeout_ns)) / base;
    double sh = a->knobs.budget_share > 0
                    ? fabs(b->knobs.budget_share - a->knobs.budget_share) / a->knobs.budget_share
                    : 0;
    return fmax(fmax(d, sh), fmax(t, o));
}

static double rate_steady(int w) {
    return 20;
}

/* _i: 0 with token budgets, 1 with time budgets. */
START_TEST(test_constant_load_converges) {
    enum { N = 60 };
    static window_rec fixed[N], tuned[N];
    run_loop(N, rate_steady, NULL, false, false, fixed);
    run_loop(N, rate_steady, NULL, true, _i == 1, tuned);
    int over_fixed = 0;
    for (int w = 2; w < N; w++)
        over_fixed += fixed[w].itl_p99[0] > 0.015;
    ck_assert_msg(over_fixed > N / 2, "the static knobs should miss the ITL target at this load (%d windows)",
                  over_fixed);
    for (int w = 10; w < N; w++) {
        ck_assert_msg(tuned[w].itl_p99[0] <= 0.015, "window %d: interactive ITL p99 %.1f ms over 15 ms", w,
                      tuned[w].itl_p99[0] * 1e3);
        ck_assert_msg(knob_change(&tuned[w - 1], &tuned[w]) < 0.10,
                      "window %d: knobs moved %.0f%% at constant load (tokens %d -> %d, seqs %d -> %d)", w,
                      100 * knob_change(&tuned[w - 1], &tuned[w]), tuned[w - 1].knobs.max_batch_tokens,
                      tuned[w].knobs.max_batch_tokens, tuned[w - 1].knobs.max_batch_seqs,
                      tuned[w].knobs.max_batch_seqs);
    }
    int holds = 0;
    for (int w = N - 10; w < N; w++)
        holds += tuned[w].action == DUET_CTL_HOLD;
    ck_assert_msg(holds >= 8, "converged: %d of the last 10 windows hold", holds);
}
END_TEST

/* 20% of capacity up to 150% and back, in steps of 10 windows. */
static const double ramp_rates[] = {8, 16, 24, 32, 44, 60, 44, 32, 16, 8};
static double rate_ramp(int w) {
    return ramp_rates[(w / 10) % 10];
}

START_TEST(test_ramp_keeps_interactive_itl) {
    enum { N = 100 };
    static window_rec rec[N];
    run_loop(N, rate_ramp, NULL, true, _i == 1, rec);
    int checked = 0;
    for (int w = 0; w < N; w++) {
        /* Below capacity (and not still draining a backlog from above it),
         * after 3 windows at the new rate. */
        if (w % 10 < 3 || rec[w].rate > 32 || rec[w].waiting > 0 || (w >= 60 && w < 70)) continue;
        checked++;
        ck_assert_msg(rec[w].itl_p99[0] <= 0.015,
                      "window %d at %.0f req/s: interactive ITL p99 %.1f ms over 15 ms", w, rec[w].rate,
                      rec[w].itl_p99[0] * 1e3);
    }
    ck_assert_msg(checked >= 30, "only %d windows below capacity were checked", checked);
    /* At constant rate, after settling, no oscillation. */
    for (int w = 0; w < N; w++)
        if (w % 10 >= 5 && w > 0 && rec[w].rate == rec[w - 1].rate && rec[w].rate <= 32)
            ck_assert_msg(knob_change(&rec[w - 1], &rec[w]) < 0.10,
                          "window %d: knobs moved %.0f%% at %.0f req/s", w,
                          100 * knob_change(&rec[w - 1], &rec[w]), rec[w].rate);
}
END_TEST

static double rate_quiet(int w) {
    return 5;
}
static int burst_once(int w) {
    return w == 10 ? 300 : 0;
}

START_TEST(test_burst_then_settles) {
    enum { N = 40 };
    static window_rec rec[N];
    run_loop(N, rate_quiet, burst_once, true, false, rec);
    /* Quiet before the burst: the timeout grew from 2 ms. */
    ck_assert_msg(rec[9].knobs.batch_timeout_ns > 2 * MS, "quiet windows lengthen the timeout (%lld ns)",
                  (long long)rec[9].knobs.batch_timeout_ns);
    /* The burst's backlog makes it act, then it settles. */
    bool reacted = false;
    for (int w = 10; w < 16; w++)
        reacted |= rec[w].action == DUET_CTL_CATCH_UP || rec[w].action == DUET_CTL_PROTECT;
    ck_assert_msg(reacted, "the burst must move the knobs");
    for (int w = 25; w < N; w++) {
        ck_assert_msg(knob_change(&rec[w - 1], &rec[w]) < 0.10,
                      "window %d: knobs moved %.0f%% after the burst", w,
                      100 * knob_change(&rec[w - 1], &rec[w]));
        ck_assert_msg(rec[w].itl_p99[0] <= 0.015, "window %d: interactive ITL p99 %.1f ms", w,
                      rec[w].itl_p99[0] * 1e3);
    }
}
END_TEST

static Suite *suite(void) {
    Suite *s = suite_create("controller");
    TCase *tc = tcase_create("law");
    tcase_add_test(tc, test_law);
    tcase_add_test(tc, test_law_time_budget);
    suite_add_tcase(s, tc);
    TCase *loop = tcase_create("closed_loop");
    tcase_set_timeout(loop, 300);
    tcase_add_loop_test(loop, test_constant_load_converges, 0, 2);
    tcase_add_loop_test(loop, test_ramp_keeps_interactive_itl, 0, 2);
    tcase_add_test(loop, test_burst_then_settles);
    suite_add_tcase(s, loop);
    return s;
}

int main(void) {
    return test_run_suite(suite());
}
