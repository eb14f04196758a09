/* fleet_sim.c — duet_simulate: a fleet of identical instances behind a
 * least-outstanding-work router, on a virtual clock.
 *
 * The router is the server's (router.c: least outstanding work over each
 * instance's measured speed, tier-blind here since the instances are
 * identical). Each instance is the engine's real scheduler (scheduler.c)
 * driven the way
 * the engine thread drives it (engine.c's loop), except that a planned step
 * takes the time the step-cost model predicts instead of running a forward
 * pass, and every logits row "samples" a token. Events are processed in
 * time order: an arrival goes to the router, then to its instance's
 * scheduler; an instance that is not in a step plans at once (as the
 * engine thread wakes on a submit); a step's end reports its results and
 * plans the next; a batch_timeout wait ends with a plan. At equal times
 * arrivals come first (the engine sees a submit that raced a step's end at
 * its next plan). Time is int64 nanoseconds, as the scheduler counts it.
 *
 * Each instance is configured from duet_sim_params.engine exactly as
 * duet_engine_start configures a served one (engine_config.h: defaults,
 * scheduler knobs, stall-free step budgets under ITL targets), and its
 * scheduler sizes steps with the simulation's step-cost model, as the
 * engine's does with its fitted one. With a latency target set, the
 * adaptive controller runs as on the engine thread: once a window, at the
 * instance's next plan (an idle instance wakes for it), from the window's
 * p99 TTFT (requests finished in it) and p99 ITL (gaps ending in it) per
 * class, kept in rings as the metrics keep them.
 *
 * With step_noise, each step's time is the model's times a draw from its
 * measured dispersion (measured / predicted over the profile's repeats),
 * from a generator of the simulation's own (splitmix64, seeded: the same
 * seed, the same run): queueing near capacity grows with the variance of
 * the service time, which a deterministic cost leaves out. The scheduler
 * still sizes steps with the model's prediction, as the engine does.
 *
 * Pure: no clock, no thread; it allocates its tables at the start and
 * nothing per event.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../backends/backend.h"
#include "engine_config.h"
#include "router.h"
#include "scheduler.h"

#define NS 1e9

typedef struct sim_req {
    int generated, n_output;
    bool started;
    double t_last; /* the latest token's time */
} sim_req;

/* The newest `cap` (time, value) samples, as metrics.c's rings keep them
 * for the controller's window. */
typedef struct sim_ring {
    double *t, *v;
    int cap, head, n;
} sim_ring;

static bool ring_init(sim_ring *r, int cap) {
    r->cap = cap;
    r->t = malloc((size_t)cap * sizeof *r->t);
    r->v = malloc((size_t)cap * sizeof *r->v);
    return r->t && r->v;
}

static void ring_push(sim_ring *r, double t, double v) {
    r->t[r->head] = t;
    r->v[r->head] = v;
    r->head = (r->head + 1) % r->cap;
    if (r->n < r->cap) r->n++;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* The nearest-rank p99 of the samples stamped in (lo, hi] (scratch holds
 * cap values); *n_out gets their count. */
static double ring_p99(const sim_ring *r, double lo, double hi, double *scratch, int *n_out) {
    int n = 0;
    for (int i = 0; i < r->n; i++)
        if (r->t[i] > lo && r->t[i] <= hi) scratch[n++] = r->v[i];
    *n_out = n;
    if (n == 0) return 0;
    qsort(scratch, (size_t)n, sizeof *scratch, cmp_double);
    int rank = (int)ceil(0.99 * n);
    return scratch[rank < 1 ? 0 : rank - 1];
}

typedef struct sim_inst {
    duet_sched *s;
    bool stepping;
    bool idle_tick;  /* idle, waking only for the controller's window */
    int64_t t_event; /* the step's end, or the wait's; INT64_MAX when idle */
    /* The adaptive controller, when a target is set. */
    duet_ctl ctl;
    double share;
    int64_t ctl_next;
    sim_ring ttft[2], itl[2]; /* per class */
    duet_sched_seq *seqs;     /* the outstanding step's plan, copied */
    duet_sched_result *results;
    int n_seqs, n_tokens;
    int64_t dt; /* the outstanding step's duration */
} sim_inst;

typedef struct sim {
    const duet_sim_params *p;
    const duet_sim_request *reqs;
    duet_sim_outcome *out;
    sim_req *rq;
    sim_inst *inst;
    int n_inst;
    duet_router *router;
    duet_sim_stats stats;
    duet_engine_setup su;
    bool ctl_on;
    double *scratch; /* the rings' p99s */
    bool noise;      /* step costs drawn from the model's dispersion */
    uint64_t rng;    /* splitmix64 state */
} sim;

/* A uniform in [0, 1) (splitmix64). */
static double sim_uniform(sim *f) {
    uint64_t z = (f->rng += UINT64_C(0x9E3779B97F4A7C15));
    z = (z ^ (z >> 30)) * UINT64_C(0xBF58476D1CE4E5B9);
    z = (z ^ (z >> 27)) * UINT64_C(0x94D049BB133111EB);
    z ^= z >> 31;
    return (double)(z >> 11) * 0x1.0p-53;
}

/* One controller window of instance k at `now`, as the engine's
 * controller_tick (engine_config.h does the rest). */
static void ctl_tick(sim *f, int k, int64_t now) {
    sim_inst *in = &f->inst[k];
    double t = (double)now / NS, lo = t - (double)f->su.ctl_window_ns / NS;
    duet_ctl_window w = {0}; /* arrival_rate: the controller does not read it */
    for (int c = 0; c < 2; c++) {
        w.ttft_p99_s[c] = ring_p99(&in->ttft[c], lo, t, f->scratch, &w.ttft_n[c]);
        w.itl_p99_s[c] = ring_p99(&in->itl[c], lo, t, f->scratch, &w.itl_n[c]);
    }
    duet__engine_ctl_tick(&in->ctl, &w, in->s, &in->share, f->su.slo_itl_s);
    f->stats.controller_windows++;
}

static void plan_at(sim *f, int k, int64_t now) {
    sim_inst *in = &f->inst[k];
    if (f->ctl_on && now >= in->ctl_next) {
        ctl_tick(f, k, now);
        in->ctl_next = now + f->su.ctl_window_ns;
    }
    duet_sched_plan plan;
    duet_sched_action a = duet__sched_plan(in->s, now, &plan);
    in->stepping = in->idle_tick = false;
    if (a == DUET_SCHED_IDLE) {
        /* With the controller on, idle windows count too (the engine
         * wakes for them). */
        in->idle_tick = f->ctl_on;
        in->t_event = f->ctl_on ? in->ctl_next : INT64_MAX;
        return;
    }
    if (a == DUET_SCHED_WAIT) {
        in->t_event = plan.wake_at > now ? plan.wake_at : now;
        return;
    }
    /* A step: its cost from the model; the plan copied (arrivals during
     * the step may reuse the scheduler's memory). */
    duet_step_shape sh = {0};
    for (int i = 0; i < plan.n_seqs; i++) {
        in->seqs[i] = plan.seqs[i];
        duet_step_shape_add(&sh, plan.seqs[i].pos, plan.seqs[i].n_tokens, plan.seqs[i].decode);
    }
    in->n_seqs = plan.n_seqs;
    in->n_tokens = plan.n_tokens;
    double cost = duet_step_cost_predict(&f->p->cost, &sh);
    double kind = sh.n_prefill > 0 ? f->p->prompt_scale : f->p->decode_scale;
    if (kind > 0) cost *= kind;
    if (f->noise) cost *= duet_step_cost_noise_at(&f->p->cost, sim_uniform(f));
    int64_t dt = cost > 0 ? (int64_t)llround(cost * NS) : 0;
    if (dt < 1) dt = 1; /* time always moves: a zero model still finishes */
    in->stepping = true;
    in->dt = dt;
    in->t_event = now + dt;
    if (f->p->on_step) f->p->on_step(k, (double)now / NS, (double)dt / NS, plan.n_seqs, &sh, f->p->user);
    f->stats.steps++;
    f->stats.busy_s += (double)dt / NS;
}

/* The outstanding step of instance k ends at `now`. */
static duet_status step_end(sim *f, int k, int64_t now) {
    sim_inst *in = &f->inst[k];
    double t = (double)now / NS;
    duet__router_observe(f->router, k, in->n_tokens, (double)in->dt / NS);
    for (int i = 0; i < in->n_seqs; i++) {
        const duet_sched_seq *s = &in->seqs[i];
        int r = (int)(s->id - 1);
        sim_req *q = &f->rq[r];
        duet_sched_result *res = &in->results[i];
        *res = (duet_sched_result){.id = s->id};
        int prio = f->reqs[r].priority == DUET_PRIORITY_BATCH;
        if (s->logits) {
            res->n_generated = 1;
            if (f->p->on_token) f->p->on_token(r, q->generated, t, f->p->user);
            duet__router_token(f->router, s->id);
            if (!q->started) {
                q->started = true;
                f->out[r].first_token = t;
            } else if (f->ctl_on) {
                ring_push(&in->itl[prio], t, t - q->t_last);
            }
            q->t_last = t;
            q->generated++;
            res->finished = q->generated >= q->n_output;
        }
        if (res->finished) {
            duet__router_done(f->router, s->id);
            f->out[r].done = t;
            f->out[r].n_generated = q->generated;
            if (f->ctl_on) ring_push(&in->ttft[prio], t, f->out[r].first_token - f->reqs[r].arrival);
        }
    }
    return duet__sched_step_done(in->s, now, in->results, in->n_seqs);
}

duet_status duet_simulate(const duet_sim_params *p, const duet_sim_request *reqs, int n,
                          duet_sim_outcome *out, duet_sim_stats *stats) {
    if (!p || (n > 0 && (!reqs || !out)) || n < 0)
        return duet__error(DUET_INVALID_ARGUMENT, "duet_simulate: NULL argument");
    if (p->n_instances < 1 || p->n_instances > DUET_ROUTER_MAX_INSTANCES)
        return duet__error(DUET_INVALID_ARGUMENT, "simulate: %d instances; the router takes 1 to %d",
                           p->n_instances, DUET_ROUTER_MAX_INSTANCES);
    for (int j = 0; j < DUET_STEP_COST_TERMS; j++)
        if (!(isfinite(p->cost.coef[j]) && p->cost.coef[j] >= 0))
            return duet__error(DUET_INVALID_ARGUMENT, "simulate: step-cost term %s is %g",
                               duet_step_cost_term(j), p->cost.coef[j]);
    if (!(p->prompt_scale >= 0 && p->prompt_scale < 1e6 && p->decode_scale >= 0 && p->decode_scale < 1e6))
        return duet__error(DUET_INVALID_ARGUMENT,
                           "simulate: step scales %g (prompt) and %g (decode) must be 0..1e6",
                           p->prompt_scale, p->decode_scale);
    if (p->step_noise && p->cost.n_noise > DUET_STEP_COST_NOISE_Q)
        return duet__error(DUET_INVALID_ARGUMENT, "simulate: %d step-cost dispersion quantiles (at most %d)",
                           p->cost.n_noise, DUET_STEP_COST_NOISE_Q);
    for (int k = 0; p->step_noise && k < p->cost.n_noise; k++)
        if (!(isfinite(p->cost.noise_ratio[k]) && p->cost.noise_ratio[k] > 0))
            return duet__error(DUET_INVALID_ARGUMENT, "simulate: step-cost dispersion quantile %d is %g", k,
                               p->cost.noise_ratio[k]);
    for (int i = 0; i < n; i++)
        if (!isfinite(reqs[i].arrival) || reqs[i].arrival < 0 ||
            (i && reqs[i].arrival < reqs[i - 1].arrival) || reqs[i].arrival > 1e9)
            return duet__error(
                DUET_INVALID_ARGUMENT,
                "simulate: request %d arrives at %g s: arrivals must be finite, >= 0 and in order", i,
                reqs[i].arrival);

    /* The engine's defaults and checks, then its configuration. */
    duet_engine_params e;
    duet_status st = duet__engine_params_check(&p->engine, &e);
    if (st) return st;
    int n_ctx = p->n_ctx > 0 ? p->n_ctx : p->cost.n_ctx > 0 ? p->cost.n_ctx : 2048;
    int blocks_per_seq = (n_ctx + e.kv_block_size - 1) / e.kv_block_size;
    sim f = {.p = p,
             .reqs = reqs,
             .out = out,
             .n_inst = p->n_instances,
             .noise = p->step_noise && p->cost.n_noise > 0,
             .rng = p->noise_seed};
    duet__engine_setup(&e, n_ctx, e.kv_blocks > 0 ? e.kv_blocks : e.max_batch_seqs * blocks_per_seq, 0,
                       &f.su);
    const duet_sched_config sc = f.su.sched;
    f.rq = calloc((size_t)n + 1, sizeof *f.rq);
    f.inst = calloc((size_t)f.n_inst, sizeof *f.inst);
    st = f.rq && f.inst ? DUET_OK : duet__error(DUET_OUT_OF_MEMORY, "simulate: out of memory");
    /* The rings hold what metrics.c's do (4096 first-token and 32768
     * inter-token samples per class), or every sample there will be. */
    int64_t tokens = 0;
    for (int i = 0; i < n; i++)
        tokens += reqs[i].n_output > 0 ? reqs[i].n_output : 0;
    int cap_ttft = n < 4096 ? n + 1 : 4096, cap_itl = tokens < 32768 ? (int)tokens + 1 : 32768;
    for (int k = 0; !st && k < f.n_inst; k++) {
        sim_inst *in = &f.inst[k];
        in->t_event = INT64_MAX;
        in->seqs = calloc((size_t)sc.max_seqs, sizeof *in->seqs);
        in->results = calloc((size_t)sc.max_seqs, sizeof *in->results);
        if (!in->seqs || !in->results) st = duet__error(DUET_OUT_OF_MEMORY, "simulate: out of memory");
        if (!st) st = duet__sched_new(&sc, &in->s);
        /* The engine's scheduler sizes steps with its fitted model; here
         * the simulation's model is the device. */
        if (!st) duet__sched_set_cost(in->s, &p->cost);
        if (!st) st = duet__ctl_init(&in->ctl, &f.su.ctl);
        if (!st) f.ctl_on = !f.su.static_knobs && duet__ctl_active(&in->ctl);
        in->share = f.su.budget_share;
        in->ctl_next = f.su.ctl_window_ns;
        for (int c = 0; !st && f.ctl_on && c < 2; c++)
            if (!ring_init(&in->ttft[c], cap_ttft) || !ring_init(&in->itl[c], cap_itl))
                st = duet__error(DUET_OUT_OF_MEMORY, "simulate: out of memory");
    }
    if (!st && f.ctl_on &&
        !(f.scratch = malloc((size_t)(cap_itl > cap_ttft ? cap_itl : cap_ttft) * sizeof *f.scratch)))
        st = duet__error(DUET_OUT_OF_MEMORY, "simulate: out of memory");
    /* The router, as the server configures it for identical instances; its
     * speeds start at the model's single-sequence decode rate. */
    duet_router_instance_config rc[DUET_ROUTER_MAX_INSTANCES];
    duet_step_shape one = {0};
    duet_step_shape_add(&one, 64, 1, true);
    double t1 = duet_step_cost_predict(&p->cost, &one);
    for (int k = 0; k < f.n_inst; k++)
        rc[k] =
            (duet_router_instance_config){.tier = DUET_PRIORITY_INTERACTIVE, .speed = t1 > 0 ? 1 / t1 : 1e3};
    duet_router_config rcfg = duet__router_config_default();
    rcfg.n_instances = f.n_inst;
    rcfg.instances = rc;
    rcfg.tier_blind = true;
    int64_t bound = (int64_t)f.n_inst * (sc.max_waiting + sc.max_seqs) + 1;
    rcfg.max_requests = (int)(bound < n + 1 ? bound : n + 1);
    if (!st) st = duet__router_new(&rcfg, &f.router);

    int next = 0;
    while (!st) {
        int k = -1;
        bool busy = false; /* some instance has work (not only a controller window) */
        for (int i = 0; i < f.n_inst; i++) {
            if (f.inst[i].t_event != INT64_MAX && (k < 0 || f.inst[i].t_event < f.inst[k].t_event)) k = i;
            busy = busy || (f.inst[i].t_event != INT64_MAX && !f.inst[i].idle_tick);
        }
        int64_t t_arr = next < n ? (int64_t)llround(reqs[next].arrival * NS) : INT64_MAX;
        if (!busy && next >= n) break;
        if (next < n && (k < 0 || t_arr <= f.inst[k].t_event)) {
            /* An arrival. */
            const duet_sim_request *q = &reqs[next];
            int r = next++;
            duet_sim_outcome *o = &out[r];
            *o = (duet_sim_outcome){.status = DUET_OK, .instance = -1, .first_token = NAN, .done = NAN};
            int n_out = q->n_output;
            if (q->n_prompt < 1 || n_out < 1 ||
                (q->priority != DUET_PRIORITY_INTERACTIVE && q->priority != DUET_PRIORITY_BATCH)) {
                o->status = DUET_BAD_REQUEST;
                o->done = (double)t_arr / NS;
                continue;
            }
            if (q->n_prompt >= n_ctx) {
                o->status = DUET_CONTEXT_FULL;
                o->done = (double)t_arr / NS;
                continue;
            }
            if (n_out > n_ctx - q->n_prompt) n_out = n_ctx - q->n_prompt; /* as submit clamps */
            int i;
            duet_status rs =
                duet__router_route(f.router, (uint64_t)r + 1, q->priority, q->n_prompt, n_out, &i);
            if (rs) {
                o->status = rs == DUET_QUEUE_FULL ? DUET_QUEUE_FULL : DUET_BAD_REQUEST;
                o->done = (double)t_arr / NS;
                continue;
            }
            o->instance = i;
            sim_inst *in = &f.inst[i];
            duet_sched_admit a =
                duet__sched_arrival(in->s, t_arr, (uint64_t)r + 1, q->n_prompt, n_out, q->priority);
            if (a != DUET_SCHED_ADMITTED) {
                duet__router_done(f.router, (uint64_t)r + 1);
                o->status = a == DUET_SCHED_QUEUE_FULL ? DUET_QUEUE_FULL
                            : a == DUET_SCHED_TOO_LONG ? DUET_CONTEXT_FULL
                                                       : DUET_BAD_REQUEST;
                o->done = (double)t_arr / NS;
                continue;
            }
            f.rq[r] = (sim_req){.n_output = n_out};
            if (!in->stepping) plan_at(&f, i, t_arr);
            continue;
        }
        /* An instance's event: its step ends, or its wait does. */
        int64_t now = f.inst[k].t_event;
        bool step = f.inst[k].stepping;
        if (step) st = step_end(&f, k, now);
        if (!st) plan_at(&f, k, now);
        if (step && now > f.stats.end * NS) f.stats.end = (double)now / NS;
    }
    for (int k = 0; f.inst && k < f.n_inst; k++) {
        if (f.inst[k].s) {
            duet_sched_stats ss;
            duet__sched_stats(f.inst[k].s, &ss);
            f.stats.preemptions += ss.preemptions;
        }
        duet__sched_free(f.inst[k].s);
        free(f.inst[k].seqs);
        free(f.inst[k].results);
        for (int c = 0; c < 2; c++) {
            free(f.inst[k].ttft[c].t), free(f.inst[k].ttft[c].v);
            free(f.inst[k].itl[c].t), free(f.inst[k].itl[c].v);
        }
    }
    free(f.scratch);
    free(f.inst);
    free(f.rq);
    duet__router_free(f.router);
    if (stats) *stats = f.stats;
    return st;
}
