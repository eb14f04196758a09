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
 * Pure: no clock, no thread; it allocates its tables at the start and
 * nothing per event.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../backends/backend.h"
#include "router.h"
#include "scheduler.h"

#define NS 1e9

typedef struct sim_req {
    int generated, n_output;
    bool started;
} sim_req;

typedef struct sim_inst {
    duet_sched *s;
    bool stepping;
    int64_t t_event;      /* the step's end, or the wait's; INT64_MAX when idle */
    duet_sched_seq *seqs; /* the outstanding step's plan, copied */
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
} sim;

static void plan_at(sim *f, int k, int64_t now) {
    sim_inst *in = &f->inst[k];
    duet_sched_plan plan;
    duet_sched_action a = duet__sched_plan(in->s, now, &plan);
    in->stepping = false;
    if (a == DUET_SCHED_IDLE) {
        in->t_event = INT64_MAX;
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
    int64_t dt = cost > 0 ? (int64_t)llround(cost * NS) : 0;
    if (dt < 1) dt = 1; /* time always moves: a zero model still finishes */
    in->stepping = true;
    in->dt = dt;
    in->t_event = now + dt;
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
        if (s->logits) {
            res->n_generated = 1;
            if (f->p->on_token) f->p->on_token(r, q->generated, t, f->p->user);
            duet__router_token(f->router, s->id);
            if (!q->started) {
                q->started = true;
                f->out[r].first_token = t;
            }
            q->generated++;
            res->finished = q->generated >= q->n_output;
        }
        if (res->finished) {
            duet__router_done(f->router, s->id);
            f->out[r].done = t;
            f->out[r].n_generated = q->generated;
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
    for (int i = 0; i < n; i++)
        if (!isfinite(reqs[i].arrival) || reqs[i].arrival < 0 ||
            (i && reqs[i].arrival < reqs[i - 1].arrival) || reqs[i].arrival > 1e9)
            return duet__error(
                DUET_INVALID_ARGUMENT,
                "simulate: request %d arrives at %g s: arrivals must be finite, >= 0 and in order", i,
                reqs[i].arrival);

    /* The engine's defaults for knobs left at 0, as duet_engine_start does. */
    duet_engine_params e = p->engine, d = duet_engine_params_default();
    if (!e.max_batch_seqs) e.max_batch_seqs = d.max_batch_seqs;
    if (!e.max_batch_tokens) e.max_batch_tokens = d.max_batch_tokens;
    if (e.batch_timeout_ms < 0) e.batch_timeout_ms = d.batch_timeout_ms;
    if (!e.prefill_chunk) e.prefill_chunk = d.prefill_chunk;
    if (!e.max_waiting) e.max_waiting = d.max_waiting;
    if (!e.kv_block_size) e.kv_block_size = d.kv_block_size;
    /* What the scheduler does not check itself, duet_engine_start does. */
    if (e.max_batch_tokens < e.max_batch_seqs || e.prefill_chunk < 1 || e.prefill_chunk > e.max_batch_tokens)
        return duet__error(
            DUET_INVALID_ARGUMENT,
            "simulate: want max_batch_seqs (%d) <= max_batch_tokens (%d) and prefill_chunk (%d) "
            "in [1, max_batch_tokens]",
            e.max_batch_seqs, e.max_batch_tokens, e.prefill_chunk);
    int n_ctx = p->n_ctx > 0 ? p->n_ctx : p->cost.n_ctx > 0 ? p->cost.n_ctx : 2048;
    int blocks_per_seq = (n_ctx + e.kv_block_size - 1) / e.kv_block_size;
    duet_sched_config sc = {.max_seqs = e.max_batch_seqs,
                            .max_tokens = e.max_batch_tokens,
                            .max_waiting = e.max_waiting,
                            .n_ctx = n_ctx,
                            .kv_block_size = e.kv_block_size,
                            .kv_blocks = e.kv_blocks > 0 ? e.kv_blocks : e.max_batch_seqs * blocks_per_seq,
                            .knobs = {.max_batch_seqs = e.max_batch_seqs,
                                      .max_batch_tokens = e.max_batch_tokens,
                                      .prefill_chunk = e.prefill_chunk,
                                      .max_waiting = e.max_waiting,
                                      .batch_timeout_ns = (int64_t)(e.batch_timeout_ms * 1e6)}};

    sim f = {.p = p, .reqs = reqs, .out = out, .n_inst = p->n_instances};
    f.rq = calloc((size_t)n + 1, sizeof *f.rq);
    f.inst = calloc((size_t)f.n_inst, sizeof *f.inst);
    duet_status st = f.rq && f.inst ? DUET_OK : duet__error(DUET_OUT_OF_MEMORY, "simulate: out of memory");
    for (int k = 0; !st && k < f.n_inst; k++) {
        sim_inst *in = &f.inst[k];
        in->t_event = INT64_MAX;
        in->seqs = calloc((size_t)sc.max_seqs, sizeof *in->seqs);
        in->results = calloc((size_t)sc.max_seqs, sizeof *in->results);
        if (!in->seqs || !in->results) st = duet__error(DUET_OUT_OF_MEMORY, "simulate: out of memory");
        if (!st) st = duet__sched_new(&sc, &in->s);
    }
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
        for (int i = 0; i < f.n_inst; i++)
            if (f.inst[i].t_event != INT64_MAX && (k < 0 || f.inst[i].t_event < f.inst[k].t_event)) k = i;
        int64_t t_arr = next < n ? (int64_t)llround(reqs[next].arrival * NS) : INT64_MAX;
        if (k < 0 && next >= n) break;
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
        if (f.inst[k].stepping) st = step_end(&f, k, now);
        if (!st) plan_at(&f, k, now);
        if (now > f.stats.end * NS) f.stats.end = (double)now / NS;
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
    }
    free(f.inst);
    free(f.rq);
    duet__router_free(f.router);
    if (stats) *stats = f.stats;
    return st;
}
