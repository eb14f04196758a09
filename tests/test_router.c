/* test_router.c — the router (core/router.c) on its own and driving a fleet on
 * a virtual clock: one real scheduler (core/scheduler.c) per instance, each
 * step costing what a simple per-instance step-cost model says. Policies:
 * least outstanding work beats round-robin on p99 latency over instances of
 * different speeds; a failing instance loses no request; tier routing keeps
 * interactive TTFT low under a flood of batch work, with the step costs
 * `duet profile` measured on this machine's cpu, lavapipe and PoCL. */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "router.h"
#include "scheduler.h"
#include "test_util.h"

#define MS DUET_SCHED_NS_PER_MS

static duet_router *make(const duet_router_instance_config *ic, int n, duet_router_config c) {
    c.n_instances = n;
    c.instances = ic;
    if (!c.max_requests) c.max_requests = 1024;
    duet_router *r = NULL;
    duet_status st = duet__router_new(&c, &r);
    ck_assert_msg(st == DUET_OK && r, "router_new: %s", duet_last_error());
    return r;
}

static int route(duet_router *r, uint64_t id, duet_priority tier, int n_prompt, int max_tokens) {
    int inst = -1;
    duet_status st = duet__router_route(r, id, tier, n_prompt, max_tokens, &inst);
    ck_assert_msg(st == DUET_OK, "route %llu: %s", (unsigned long long)id, duet_last_error());
    ck_assert_int_eq(duet__router_check(r), DUET_OK);
    return inst;
}

/* ---- the policy, request by request --------------------------------------- */

START_TEST(test_least_work_weighted_by_speed) {
    const duet_router_instance_config ic[3] = {{DUET_PRIORITY_INTERACTIVE, 100, 0},
                                               {DUET_PRIORITY_INTERACTIVE, 100, 0},
                                               {DUET_PRIORITY_INTERACTIVE, 400, 0}};
    duet_router *r = make(ic, 3, duet__router_config_default());
    /* Idle: the fastest drains a request soonest. */
    ck_assert_int_eq(route(r, 1, DUET_PRIORITY_INTERACTIVE, 100, 100), 2);
    /* 200 tokens on a 400 tok/s instance (0.5 s) + 200 more = 1 s, vs 2 s idle at 100 tok/s. */
    ck_assert_int_eq(route(r, 2, DUET_PRIORITY_INTERACTIVE, 100, 100), 2);
    /* 400 + 200 at 400 = 1.5 s vs 2 s: still the fast one; then 2 s vs 2 s ties go by requests. */
    ck_assert_int_eq(route(r, 3, DUET_PRIORITY_INTERACTIVE, 100, 100), 2);
    int a = route(r, 4, DUET_PRIORITY_INTERACTIVE, 100, 100);
    ck_assert_msg(a == 0 || a == 1, "a tie with 3 requests on the fast one goes to an idle one (got %d)", a);
    /* Tokens take work off: the first token removes the prompt too. */
    duet_router_instance_stats is;
    duet__router_instance_stats(r, 2, &is);
    ck_assert_int_eq(is.outstanding, 600);
    duet__router_token(r, 1);
    duet__router_token(r, 1);
    duet__router_instance_stats(r, 2, &is);
    ck_assert_int_eq(is.outstanding, 600 - 102);
    duet__router_done(r, 1);
    duet__router_instance_stats(r, 2, &is);
    ck_assert_int_eq(is.outstanding, 400);
    ck_assert_int_eq(is.requests, 2);
    ck_assert_int_eq(is.routed, 3);
    /* Measured speed replaces the guess: instance 2 turns out slow. */
    for (int i = 0; i < 50; i++)
        duet__router_observe(r, 2, 10, 1.0);
    duet__router_instance_stats(r, 2, &is);
    ck_assert_msg(is.speed < 20, "speed EWMA follows measurements (%g)", is.speed);
    ck_assert_int_ne(route(r, 5, DUET_PRIORITY_INTERACTIVE, 10, 10), 2);
    ck_assert_int_eq(duet__router_check(r), DUET_OK);
    duet__router_free(r);
}
END_TEST

START_TEST(test_tiers_and_spill_over) {
    const duet_router_instance_config ic[2] = {{DUET_PRIORITY_INTERACTIVE, 100, 2},
                                               {DUET_PRIORITY_BATCH, 100, 2}};
    duet_router_config c = duet__router_config_default();
    duet_router *r = make(ic, 2, c);
    /* Each tier to its own instance, whatever the load. */
    ck_assert_int_eq(route(r, 1, DUET_PRIORITY_BATCH, 10, 1000), 1);
    ck_assert_int_eq(route(r, 2, DUET_PRIORITY_INTERACTIVE, 10, 10), 0);
    ck_assert_int_eq(route(r, 3, DUET_PRIORITY_BATCH, 10, 1000), 1);
    /* The batch instance is saturated (2 requests); batch may not spill by default. */
    ck_assert_int_eq(route(r, 4, DUET_PRIORITY_BATCH, 10, 10), 1);
    duet_router_stats s;
    duet__router_stats(r, &s);
    ck_assert_int_eq(s.spills, 0);
    /* Interactive saturates its instance, then spills to batch... which is saturated too: it queues at home.
     */
    ck_assert_int_eq(route(r, 5, DUET_PRIORITY_INTERACTIVE, 10, 10), 0);
    ck_assert_int_eq(route(r, 6, DUET_PRIORITY_INTERACTIVE, 10, 10), 0);
    duet__router_done(r, 1), duet__router_done(r, 3), duet__router_done(r, 4);
    ck_assert_int_eq(route(r, 7, DUET_PRIORITY_INTERACTIVE, 10, 10), 1); /* a spill */
    duet__router_stats(r, &s);
    ck_assert_int_eq(s.spills, 1);
    duet__router_free(r);

    /* spill_batch lets batch use interactive capacity; tier_blind ignores tiers altogether. */
    c.spill_batch = true;
    r = make(ic, 2, c);
    route(r, 1, DUET_PRIORITY_BATCH, 10, 10), route(r, 2, DUET_PRIORITY_BATCH, 10, 10);
    ck_assert_int_eq(route(r, 3, DUET_PRIORITY_BATCH, 10, 10), 0);
    duet__router_free(r);
    c = duet__router_config_default();
    c.tier_blind = true;
    r = make(ic, 2, c);
    ck_assert_int_eq(route(r, 1, DUET_PRIORITY_BATCH, 10, 100), 0);
    ck_assert_int_eq(route(r, 2, DUET_PRIORITY_BATCH, 10, 100), 1);
    duet__router_stats(r, &s);
    ck_assert_int_eq(s.spills, 0); /* no tiers, no spills */
    duet__router_free(r);

    /* A tier without instances falls back to the other. */
    const duet_router_instance_config only_batch[1] = {{DUET_PRIORITY_BATCH, 100, 0}};
    r = make(only_batch, 1, duet__router_config_default());
    ck_assert_int_eq(route(r, 1, DUET_PRIORITY_INTERACTIVE, 10, 10), 0);
    duet__router_free(r);
}
END_TEST

START_TEST(test_round_robin_and_power_of_two) {
    duet_router_instance_config ic[8];
    for (int i = 0; i < 8; i++)
        ic[i] = (duet_router_instance_config){DUET_PRIORITY_BATCH, 100, 0};
    ic[5].tier = DUET_PRIORITY_INTERACTIVE;
    duet_router_config c = duet__router_config_default();
    c.policy = DUET_ROUTER_ROUND_ROBIN;
    duet_router *r = make(ic, 8, c);
    int seen[8] = {0};
    for (int k = 0; k < 14; k++)
        seen[route(r, (uint64_t)k + 1, DUET_PRIORITY_BATCH, 10, 1000 * (k + 1))]++;
    for (int i = 0; i < 8; i++)
        ck_assert_int_eq(seen[i], i == 5 ? 0 : 2); /* in turn, in its tier, whatever the work */
    duet__router_free(r);

    /* Power of two choices: 7 batch candidates > p2c_above (4). Draws are
     * deterministic, stay in the tier, and the load stays even. */
    uint64_t routed_a[8], routed_b[8];
    for (int run = 0; run < 2; run++) {
        r = make(ic, 8, duet__router_config_default());
        for (uint64_t id = 1; id <= 700; id++) {
            int i = route(r, id, DUET_PRIORITY_BATCH, 10, 10);
            ck_assert_int_ne(i, 5);
            if (id > 70) duet__router_done(r, id - 70); /* 70 in flight */
        }
        int min = 1 << 30, max = 0;
        for (int i = 0; i < 8; i++) {
            duet_router_instance_stats is;
            duet__router_instance_stats(r, i, &is);
            (run ? routed_b : routed_a)[i] = is.routed;
            if (i != 5 && is.requests < min) min = is.requests;
            if (i != 5 && is.requests > max) max = is.requests;
        }
        ck_assert_msg(max - min <= 4, "p2c keeps 70 requests even over 7 instances (%d..%d)", min, max);
        duet__router_free(r);
    }
    ck_assert_mem_eq(routed_a, routed_b, sizeof routed_a);
}
END_TEST

START_TEST(test_failure_retries_once) {
    const duet_router_instance_config ic[3] = {
        {DUET_PRIORITY_BATCH, 100, 0}, {DUET_PRIORITY_BATCH, 100, 0}, {DUET_PRIORITY_BATCH, 100, 0}};
    duet_router *r = make(ic, 3, duet__router_config_default());
    for (uint64_t id = 1; id <= 6; id++)
        route(r, id, DUET_PRIORITY_BATCH, 10, 10);
    ck_assert_int_eq(duet__router_instance_of(r, 1), 0);
    ck_assert_int_eq(duet__router_instance_of(r, 4), 0);
    duet__router_token(r, 4); /* 4 has streamed; 1 has not */
    uint64_t ids[64];
    int n = duet__router_fail_instance(r, 0, ids, 64);
    ck_assert_int_eq(n, 2);
    int to = -1;
    for (int k = 0; k < n; k++) {
        duet_status st = duet__router_failed(r, ids[k], &to);
        if (ids[k] == 1) {
            ck_assert_int_eq(st, DUET_OK);
            ck_assert(to == 1 || to == 2);
        } else {
            ck_assert_int_eq(st, DUET_DEVICE_LOST);
            ck_assert_int_eq(to, -1);
        }
        ck_assert_int_eq(duet__router_check(r), DUET_OK);
    }
    /* Nothing goes to a failed instance; a second failure of request 1 ends it. */
    for (uint64_t id = 10; id < 20; id++)
        ck_assert_int_ne(route(r, id, DUET_PRIORITY_BATCH, 10, 10), 0);
    int on = duet__router_instance_of(r, 1);
    n = duet__router_fail_instance(r, on, ids, 64);
    bool found = false;
    int retried = 1;
    for (int k = 0; k < n; k++) {
        duet_status st = duet__router_failed(r, ids[k], &to);
        if (ids[k] == 1) {
            found = true;
            ck_assert_int_eq(st, DUET_DEVICE_LOST);
        } else {
            ck_assert_int_eq(st, DUET_OK); /* none of the others streamed */
            retried++;
        }
    }
    ck_assert(found);
    /* The last instance fails: no retry target, and new requests are refused. */
    int last = 3 - on; /* instances 1 and 2 remain; `on` failed */
    n = duet__router_fail_instance(r, last, ids, 64);
    ck_assert_int_le(n, 64);
    for (int k = 0; k < n; k++) {
        duet_status st = duet__router_failed(r, ids[k], &to);
        ck_assert(st == DUET_NO_DEVICE || st == DUET_DEVICE_LOST);
    }
    duet_router_stats s;
    duet__router_stats(r, &s);
    ck_assert_int_eq(s.in_flight, 0);
    ck_assert_int_eq(s.live, 0);
    int inst;
    ck_assert_int_eq(duet__router_route(r, 99, DUET_PRIORITY_BATCH, 1, 1, &inst), DUET_NO_DEVICE);
    ck_assert_int_eq(s.retries, (uint64_t)retried);
    ck_assert_int_eq(duet__router_check(r), DUET_OK);
    duet__router_free(r);
}
END_TEST

START_TEST(test_pinned_requests) {
    /* Instance 0 interactive and saturated, 1 and 2 batch: a pinned request
     * goes where it is told, whatever its tier, load and saturation, counts
     * there, and is never moved. */
    const duet_router_instance_config ic[3] = {
        {DUET_PRIORITY_INTERACTIVE, 100, 1}, {DUET_PRIORITY_BATCH, 100, 0}, {DUET_PRIORITY_BATCH, 1, 0}};
    duet_router *r = make(ic, 3, duet__router_config_default());
    ck_assert_int_eq(route(r, 1, DUET_PRIORITY_INTERACTIVE, 10, 10), 0); /* 0 is now saturated */
    ck_assert_int_eq(duet__router_route_to(r, 2, DUET_PRIORITY_BATCH, 10, 10, 0), DUET_OK);
    ck_assert_int_eq(duet__router_route_to(r, 3, DUET_PRIORITY_INTERACTIVE, 10, 1000, 2), DUET_OK);
    ck_assert_int_eq(duet__router_route_to(r, 4, DUET_PRIORITY_BATCH, 10, 10, 2), DUET_OK);
    ck_assert_int_eq(duet__router_instance_of(r, 2), 0);
    ck_assert_int_eq(duet__router_instance_of(r, 3), 2);
    ck_assert_int_eq(duet__router_check(r), DUET_OK);
    duet_router_instance_stats is;
    duet__router_instance_stats(r, 2, &is);
    ck_assert_int_eq(is.routed, 2);
    ck_assert_int_eq(is.pinned, 2);
    ck_assert_int_eq(is.outstanding, 1010 + 20);
    duet__router_instance_stats(r, 0, &is);
    ck_assert_int_eq(is.routed, 2);
    ck_assert_int_eq(is.pinned, 1);
    duet_router_stats s;
    duet__router_stats(r, &s);
    ck_assert_int_eq(s.routed, 4);
    ck_assert_int_eq(s.pinned, 3);
    ck_assert_int_eq(s.spills, 0); /* pinning is no spill */
    /* Bad arguments: nothing is recorded. */
    ck_assert_int_eq(duet__router_route_to(r, 5, DUET_PRIORITY_BATCH, 1, 1, 3), DUET_INVALID_ARGUMENT);
    ck_assert_int_eq(duet__router_route_to(r, 5, DUET_PRIORITY_BATCH, 1, 1, -1), DUET_INVALID_ARGUMENT);
    ck_assert_int_eq(duet__router_route_to(r, 4, DUET_PRIORITY_BATCH, 1, 1, 1), DUET_INVALID_ARGUMENT);
    ck_assert_int_eq(duet__router_route_to(r, 5, DUET_PRIORITY_BATCH, 0, 1, 1), DUET_INVALID_ARGUMENT);
    /* Instance 2 fails: its pinned requests, streamed or not, end (no retry). */
    duet__router_token(r, 4);
    uint64_t ids[8];
    int n = duet__router_fail_instance(r, 2, ids, 8);
    ck_assert_int_eq(n, 2);
    int to = 7;
    for (int k = 0; k < n; k++) {
        ck_assert_int_eq(duet__router_failed(r, ids[k], &to), DUET_DEVICE_LOST);
        ck_assert_int_eq(to, -1);
    }
    /* A failed instance takes no pinned request. */
    ck_assert_int_eq(duet__router_route_to(r, 6, DUET_PRIORITY_BATCH, 1, 1, 2), DUET_NO_DEVICE);
    duet__router_stats(r, &s);
    ck_assert_int_eq(s.retries, 0);
    ck_assert_int_eq(s.failed, 2);
    ck_assert_int_eq(s.in_flight, 2);
    ck_assert_int_eq(duet__router_check(r), DUET_OK);
    duet__router_free(r);
}
END_TEST

START_TEST(test_table_and_refusals) {
    const duet_router_instance_config ic[2] = {{DUET_PRIORITY_BATCH, 100, 0}, {DUET_PRIORITY_BATCH, 50, 0}};
    duet_router_config c = duet__router_config_default();
    c.max_requests = 300;
    duet_router *r = make(ic, 2, c);
    int inst;
    ck_assert_int_eq(duet__router_route(r, 1, 7, 1, 1, &inst), DUET_INVALID_ARGUMENT);
    ck_assert_int_eq(duet__router_route(r, 1, DUET_PRIORITY_BATCH, 0, 1, &inst), DUET_INVALID_ARGUMENT);
    route(r, 1, DUET_PRIORITY_BATCH, 1, 1);
    ck_assert_int_eq(duet__router_route(r, 1, DUET_PRIORITY_BATCH, 1, 1, &inst), DUET_INVALID_ARGUMENT);
    duet__router_done(r, 1);
    /* Random inserts and removals (ids that collide in the table): the
     * table and the per-instance sums stay consistent. */
    uint64_t live[300];
    int n = 0;
    uint64_t x = 12345;
    for (int k = 0; k < 20000; k++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        if (n < 300 && (n == 0 || (x >> 60) < 9)) {
            uint64_t id = ((x >> 20) & 0xffff) << 12; /* low bits equal: stress the probing */
            if (duet__router_instance_of(r, id) >= 0) continue;
            ck_assert_int_eq(duet__router_route(r, id, DUET_PRIORITY_BATCH, 3, 5, &inst), DUET_OK);
            live[n++] = id;
        } else {
            int j = (int)((x >> 32) % (uint64_t)n);
            if ((x >> 8) & 1) duet__router_token(r, live[j]);
            duet__router_done(r, live[j]);
            live[j] = live[--n];
        }
        if (k % 97 == 0) ck_assert_msg(duet__router_check(r) == DUET_OK, "%s", duet_last_error());
    }
    for (int j = 0; j < n; j++)
        ck_assert_int_ge(duet__router_instance_of(r, live[j]), 0);
    if (n == 300)
        ck_assert_int_eq(duet__router_route(r, 1, DUET_PRIORITY_BATCH, 1, 1, &inst), DUET_QUEUE_FULL);
    duet__router_free(r);
    /* Bad configs are refused with a message. */
    duet_router *bad = NULL;
    const duet_router_instance_config slow[1] = {{DUET_PRIORITY_BATCH, 0, 0}};
    c = duet__router_config_default();
    c.n_instances = 1, c.instances = slow, c.max_requests = 1;
    ck_assert_int_eq(duet__router_new(&c, &bad), DUET_INVALID_ARGUMENT);
    ck_assert_ptr_null(bad);
}
END_TEST

/* ---- a fleet on the virtual clock ----------------------------------------------- */

/* Step cost: base + per decode token + per prefill token, in ms. The cpu
 * figures fit bench/results/cpu-batching-xeon-2c.json (125m q8_0 on this
 * machine's 2 cores: 3.75 ms a step at one sequence, 20.3 ms at sixteen);
 * Vulkan (lavapipe) and OpenCL (PoCL) run the same sweep at about 0.55x
 * the cpu backend's best throughput (bench/results/20261130-0400-all-devices-tiny). */
typedef struct step_cost {
    double base_ms, decode_ms, prefill_ms;
} step_cost;
static const step_cost COST_CPU = {2.65, 1.10, 0.25};
static const step_cost COST_LAVAPIPE = {4.8, 2.0, 0.45};
static const step_cost COST_POCL = {4.8, 2.0, 0.45};

#define SIM_MAX_INST 4
#define SIM_MAX_REQ 8192
#define SIM_MAX_SEQS 32

typedef struct sim_inst {
    duet_sched *s;
    step_cost cost;
    const duet_step_cost *measured; /* when set, steps cost what this profile predicts instead */
    double slow; /* cost multiplier */
    bool busy, failed;
    int64_t busy_until, wake_at; /* wake_at < 0: none */
    int n;
    uint64_t ids[SIM_MAX_SEQS];
    bool logits[SIM_MAX_SEQS];
    int step_tokens;
    int64_t step_ns;
} sim_inst;

typedef struct sim_req {
    int64_t arrival, first_token, end;
    int n_prompt, max_new, gen;
    duet_priority prio;
    int inst;
    bool closed, done, errored, streamed_at_failure, retried;
} sim_req;

typedef struct workload {
    /* Open loop: n_open requests, Poisson at open_rate per second. */
    int n_open;
    double open_rate;
    duet_priority open_prio;
    int open_prompt_min, open_prompt_max, open_new_min, open_new_max;
    /* Closed loop: clients each with one request in flight, until closed_until. */
    int closed_clients;
    duet_priority closed_prio;
    int closed_prompt, closed_new;
    int64_t closed_until;
    /* One instance fails at fail_at (fail_inst < 0: none). */
    int fail_inst;
    int64_t fail_at;
    uint64_t seed;
} workload;

typedef struct fleet {
    duet_router *r;
    sim_inst inst[SIM_MAX_INST];
    int n_inst;
    sim_req *req; /* [SIM_MAX_REQ]; router and scheduler id = index + 1 */
    int n_req;
    uint64_t rng;
    int64_t now;
    int retried, errored, done;
} fleet;

static double rnd(fleet *f) {
    f->rng = f->rng * 6364136223846793005ull + 1442695040888963407ull;
    return (double)(f->rng >> 11) / 9007199254740992.0;
}

static void fleet_init(fleet *f, int n, const step_cost *costs, const double *slow, const int *max_seqs,
                       const duet_router_instance_config *ric, duet_router_config rc, uint64_t seed) {
    memset(f, 0, sizeof *f);
    f->req = calloc(SIM_MAX_REQ, sizeof *f->req);
    ck_assert_ptr_nonnull(f->req);
    f->n_inst = n;
    f->rng = seed;
    rc.max_requests = SIM_MAX_REQ;
    f->r = make(ric, n, rc);
    for (int i = 0; i < n; i++) {
        sim_inst *in = &f->inst[i];
        in->cost = costs[i];
        in->slow = slow ? slow[i] : 1.0;
        in->wake_at = -1;
        duet_sched_config c = {.max_seqs = max_seqs[i],
                               .max_tokens = 256,
                               .max_waiting = SIM_MAX_REQ,
                               .n_ctx = 1024,
                               .kv_block_size = 16,
                               .kv_blocks = max_seqs[i] * 1024 / 16,
                               .knobs = {.max_batch_seqs = max_seqs[i],
                                         .max_batch_tokens = 256,
                                         .prefill_chunk = 128,
                                         .max_waiting = SIM_MAX_REQ,
                                         .batch_timeout_ns = 0}};
        ck_assert_int_eq(duet__sched_new(&c, &in->s), DUET_OK);
    }
}

static void fleet_free(fleet *f) {
    for (int i = 0; i < f->n_inst; i++)
        duet__sched_free(f->inst[i].s);
    duet__router_free(f->r);
    free(f->req);
}

static void sched_arrive(fleet *f, int i, int k) {
    sim_req *q = &f->req[k];
    q->inst = i;
    duet_sched_admit a =
        duet__sched_arrival(f->inst[i].s, f->now, (uint64_t)k + 1, q->n_prompt, q->max_new, q->prio);
    ck_assert_int_eq(a, DUET_SCHED_ADMITTED);
}

static void submit(fleet *f, duet_priority prio, int n_prompt, int max_new, bool closed) {
    ck_assert_int_lt(f->n_req, SIM_MAX_REQ);
    int k = f->n_req++;
    sim_req *q = &f->req[k];
    *q = (sim_req){
        .arrival = f->now, .n_prompt = n_prompt, .max_new = max_new, .prio = prio, .closed = closed};
    int i = -1;
    ck_assert_int_eq(duet__router_route(f->r, (uint64_t)k + 1, prio, n_prompt, max_new, &i), DUET_OK);
    sched_arrive(f, i, k);
}

/* The request ended (done or error); a closed-loop client sends its next. */
static void finish(fleet *f, const workload *w, int k) {
    sim_req *q = &f->req[k];
    q->done = true;
    q->end = f->now;
    f->done++;
    if (q->closed && f->now < w->closed_until)
        submit(f, w->closed_prio, w->closed_prompt, w->closed_new, true);
}

static void step_end(fleet *f, const workload *w, int i) {
    sim_inst *in = &f->inst[i];
    duet_sched_result res[SIM_MAX_SEQS];
    int fin[SIM_MAX_SEQS], n_fin = 0;
    for (int j = 0; j < in->n; j++) {
        int k = (int)in->ids[j] - 1;
        sim_req *q = &f->req[k];
        res[j] = (duet_sched_result){.id = in->ids[j]};
        if (!in->logits[j]) continue;
        res[j].n_generated = 1;
        if (q->gen++ == 0) q->first_token = f->now;
        duet__router_token(f->r, in->ids[j]);
        if (q->gen == q->max_new) res[j].finished = true, fin[n_fin++] = k;
    }
    ck_assert_int_eq(duet__sched_step_done(in->s, f->now, res, in->n), DUET_OK);
    duet__router_observe(f->r, i, in->step_tokens, (double)in->step_ns * 1e-9);
    in->busy = false;
    for (int j = 0; j < n_fin; j++) {
        duet__router_done(f->r, (uint64_t)fin[j] + 1);
        finish(f, w, fin[j]);
    }
}

static void fail_instance(fleet *f, const workload *w, int i) {
    sim_inst *in = &f->inst[i];
    if (in->busy) duet__sched_step_failed(in->s, f->now);
    in->busy = false;
    in->failed = true;
    uint64_t ids[SIM_MAX_REQ];
    int n = duet__router_fail_instance(f->r, i, ids, SIM_MAX_REQ);
    for (int j = 0; j < n; j++) {
        int k = (int)ids[j] - 1, to = -1;
        sim_req *q = &f->req[k];
        q->streamed_at_failure = q->gen > 0;
        ck_assert_int_eq(duet__sched_cancel(in->s, f->now, ids[j]), DUET_OK);
        if (duet__router_failed(f->r, ids[j], &to) == DUET_OK) {
            ck_assert(!q->streamed_at_failure);
            ck_assert_int_ne(to, i);
            q->retried = true;
            f->retried++;
            sched_arrive(f, to, k);
        } else {
            q->errored = true;
            f->errored++;
            finish(f, w, k);
        }
    }
    ck_assert_int_eq(duet__router_check(f->r), DUET_OK);
}

static void fleet_run(fleet *f, const workload *w) {
    int64_t *open_at = calloc((size_t)w->n_open + 1, sizeof *open_at);
    ck_assert_ptr_nonnull(open_at);
    double t = 0;
    for (int k = 0; k < w->n_open; k++) {
        t += -log(1.0 - rnd(f)) / w->open_rate;
        open_at[k] = (int64_t)(t * 1e9);
    }
    int opened = 0;
    bool fail_pending = w->fail_inst >= 0;
    for (int c = 0; c < w->closed_clients; c++)
        submit(f, w->closed_prio, w->closed_prompt, w->closed_new, true);
    for (;;) {
        for (int i = 0; i < f->n_inst; i++)
            if (f->inst[i].busy && f->inst[i].busy_until <= f->now) step_end(f, w, i);
        if (fail_pending && f->now >= w->fail_at) {
            fail_pending = false;
            fail_instance(f, w, w->fail_inst);
        }
        while (opened < w->n_open && open_at[opened] <= f->now) {
            int span_p = w->open_prompt_max - w->open_prompt_min + 1,
                span_n = w->open_new_max - w->open_new_min + 1;
            int np = w->open_prompt_min + (int)(rnd(f) * span_p),
                nn = w->open_new_min + (int)(rnd(f) * span_n);
            submit(f, w->open_prio, np, nn, false);
            opened++;
        }
        int64_t next = INT64_MAX;
        for (int i = 0; i < f->n_inst; i++) {
            sim_inst *in = &f->inst[i];
            if (in->failed) continue;
            if (!in->busy) {
                duet_sched_plan p;
                duet_sched_action act = duet__sched_plan(in->s, f->now, &p);
                in->wake_at = act == DUET_SCHED_WAIT ? p.wake_at : -1;
                if (act == DUET_SCHED_STEP) {
                    int dec = 0;
                    duet_step_shape shape = {0};
                    in->n = p.n_seqs;
                    for (int j = 0; j < p.n_seqs; j++) {
                        in->ids[j] = p.seqs[j].id;
                        in->logits[j] = p.seqs[j].logits;
                        dec += p.seqs[j].decode;
                        duet_step_shape_add(&shape, p.seqs[j].pos, p.seqs[j].n_tokens, p.seqs[j].decode);
                    }
                    in->step_tokens = p.n_tokens;
                    double ms = in->measured ? duet_step_cost_predict(in->measured, &shape) * 1e3
                                             : in->cost.base_ms + in->cost.decode_ms * dec +
                                                   in->cost.prefill_ms * (p.n_tokens - dec);
                    in->step_ns = (int64_t)(ms * in->slow * 1e6);
                    in->busy = true;
                    in->busy_until = f->now + in->step_ns;
                }
            }
            if (in->busy && in->busy_until < next) next = in->busy_until;
            if (!in->busy && in->wake_at >= 0 && in->wake_at < next) next = in->wake_at;
        }
        if (opened < w->n_open && open_at[opened] < next) next = open_at[opened];
        if (fail_pending && w->fail_at < next) next = w->fail_at;
        if (next == INT64_MAX) break; /* nothing runs, nothing comes */
        ck_assert_int_ge(next, f->now);
        f->now = next;
    }
    free(open_at);
    /* Nothing lost: every request ended, once, and the router holds none. */
    for (int k = 0; k < f->n_req; k++)
        ck_assert_msg(f->req[k].done, "request %d never ended", k + 1);
    ck_assert_int_eq(f->done, f->n_req);
    duet_router_stats s;
    duet__router_stats(f->r, &s);
    ck_assert_int_eq(s.in_flight, 0);
    ck_assert_int_eq(duet__router_check(f->r), DUET_OK);
}

static int cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* p99 (nearest rank) over the successful requests of class prio (-1: all),
 * of latency (ttft false: end - arrival) or time to first token, in ms. */
static double p99_ms(const fleet *f, int prio, bool ttft) {
    int64_t *v = malloc((size_t)f->n_req * sizeof *v);
    int n = 0;
    for (int k = 0; k < f->n_req; k++) {
        const sim_req *q = &f->req[k];
        if (q->errored || (prio >= 0 && (int)q->prio != prio)) continue;
        v[n++] = (ttft ? q->first_token : q->end) - q->arrival;
    }
    ck_assert_int_gt(n, 0);
    qsort(v, (size_t)n, sizeof *v, cmp_i64);
    int rank = (int)ceil(0.99 * n) - 1;
    double ms = (double)v[rank < 0 ? 0 : rank] / 1e6;
    free(v);
    return ms;
}

START_TEST(test_fleet_least_work_beats_round_robin) {
    /* Three cpu instances, one four times slower (a weaker device); the
     * router starts with the same speed guess for all and must measure. */
    const step_cost costs[3] = {COST_CPU, COST_CPU, COST_CPU};
    const double slow[3] = {1, 1, 4};
    const int seqs[3] = {16, 16, 16};
    const duet_router_instance_config ric[3] = {
        {DUET_PRIORITY_BATCH, 500, 0}, {DUET_PRIORITY_BATCH, 500, 0}, {DUET_PRIORITY_BATCH, 500, 0}};
    workload w = {.n_open = 600,
                  .open_rate = 12,
                  .open_prio = DUET_PRIORITY_BATCH,
                  .open_prompt_min = 16,
                  .open_prompt_max = 128,
                  .open_new_min = 16,
                  .open_new_max = 128,
                  .fail_inst = -1};
    double p99[2];
    for (int pol = 0; pol < 2; pol++) {
        duet_router_config rc = duet__router_config_default();
        rc.policy = pol ? DUET_ROUTER_ROUND_ROBIN : DUET_ROUTER_LEAST_WORK;
        fleet f;
        fleet_init(&f, 3, costs, slow, seqs, ric, rc, 42);
        fleet_run(&f, &w);
        p99[pol] = p99_ms(&f, -1, false);
        duet_router_instance_stats is;
        duet__router_instance_stats(f.r, 2, &is);
        printf("router: %s: p99 latency %.0f ms; slow instance got %llu of %d requests, speed estimate %.0f "
               "tok/s\n",
               pol ? "round-robin" : "least-work", p99[pol], (unsigned long long)is.routed, f.n_req,
               is.speed);
        fleet_free(&f);
    }
    ck_assert_msg(p99[0] < p99[1] / 2,
                  "least outstanding work (p99 %.0f ms) beats round-robin (%.0f ms) by 2x", p99[0], p99[1]);
}
END_TEST

START_TEST(test_fleet_failing_instance_loses_nothing) {
    const step_cost costs[3] = {COST_CPU, COST_LAVAPIPE, COST_POCL};
    const int seqs[3] = {8, 8, 8};
    const duet_router_instance_config ric[3] = {
        {DUET_PRIORITY_BATCH, 500, 0}, {DUET_PRIORITY_BATCH, 300, 0}, {DUET_PRIORITY_BATCH, 300, 0}};
    /* 24 closed-loop clients and an open stream; instance 1 dies at 3 s with
     * requests queued (not streamed) and running (streamed) on it. */
    workload w = {.n_open = 200,
                  .open_rate = 20,
                  .open_prio = DUET_PRIORITY_BATCH,
                  .open_prompt_min = 8,
                  .open_prompt_max = 64,
                  .open_new_min = 8,
                  .open_new_max = 64,
                  .closed_clients = 24,
                  .closed_prio = DUET_PRIORITY_BATCH,
                  .closed_prompt = 32,
                  .closed_new = 48,
                  .closed_until = 8 * DUET_SCHED_NS_PER_S,
                  .fail_inst = 1,
                  .fail_at = 3 * DUET_SCHED_NS_PER_S};
    fleet f;
    fleet_init(&f, 3, costs, NULL, seqs, ric, duet__router_config_default(), 7);
    fleet_run(&f, &w);
    duet_router_stats s;
    duet__router_stats(f.r, &s);
    duet_router_instance_stats before;
    duet__router_instance_stats(f.r, 1, &before);
    int ok = 0;
    for (int k = 0; k < f.n_req; k++) {
        const sim_req *q = &f.req[k];
        if (q->errored)
            ck_assert_msg(q->streamed_at_failure, "request %d errored without having streamed", k + 1);
        if (!q->errored) {
            ck_assert_int_eq(q->gen, q->max_new);
            ok++;
        }
        if (q->arrival > w.fail_at) ck_assert_int_ne(q->inst, 1);
    }
    printf(
        "router: instance 1 failed at 3 s: %d requests, %d completed, %d retried elsewhere, %d ended with an "
        "error (had streamed); instance 1 had %llu routed\n",
        f.n_req, ok, f.retried, f.errored, (unsigned long long)before.routed);
    ck_assert_int_gt(f.retried, 0);
    ck_assert_int_gt(f.errored, 0);
    ck_assert_int_eq(s.retries, (uint64_t)f.retried);
    ck_assert_int_eq(s.failed, (uint64_t)f.errored);
    ck_assert_int_eq(ok + f.errored, f.n_req);
    ck_assert_int_eq(s.live, 2);
    fleet_free(&f);
}
END_TEST

/* The step-cost models `duet profile` measured for SmolLM2 on this
 * machine's three backends (bench/results/instances-step-costs-smollm2-xeon-2c/). */
static const char *const PROFILE_DIR = DUET_SOURCE_DIR "/bench/results/instances-step-costs-smollm2-xeon-2c";
static const char *const PROFILE_NAMES[3] = {"cpu", "vulkan", "opencl"};

/* Predicted ms of a decode step of `batch` sequences at context ctx. */
static double decode_ms(const duet_step_cost *m, int batch, int ctx) {
    duet_step_shape sh = {0};
    for (int i = 0; i < batch; i++)
        duet_step_shape_add(&sh, ctx, 1, true);
    return duet_step_cost_predict(m, &sh) * 1e3;
}

START_TEST(test_fleet_tiers_protect_interactive_ttft) {
    /* One small-batch interactive instance (cpu, 4 sequences) and two
     * large-batch ones (lavapipe and PoCL, 32 sequences), each step costing
     * what `duet profile` measured for SmolLM2 on that backend here. A flood
     * of batch work: 32 closed-loop clients with long outputs; interactive
     * requests arrive at a rate that keeps the interactive instance half
     * busy. Same instances, same load; only the routing differs. */
    duet_step_cost prof[3];
    for (int i = 0; i < 3; i++) {
        char path[1024];
        snprintf(path, sizeof path, "%s/%s.json", PROFILE_DIR, PROFILE_NAMES[i]);
        ck_assert_msg(duet_step_cost_load(path, &prof[i]) == DUET_OK, "%s", duet_last_error());
    }
    for (int i = 0; i < 3; i++)
        printf("router: measured step costs, %s (%s): decode step %.1f ms at 1 sequence, %.1f ms at 32 "
               "(context 128); %.2fx and %.2fx the cpu's\n",
               PROFILE_NAMES[i], prof[i].device, decode_ms(&prof[i], 1, 128), decode_ms(&prof[i], 32, 128),
               decode_ms(&prof[i], 1, 128) / decode_ms(&prof[0], 1, 128),
               decode_ms(&prof[i], 32, 128) / decode_ms(&prof[0], 32, 128));
    /* An interactive request alone on the cpu instance: a 40-token prompt,
     * then 24 decode steps; requests arrive so that two are in flight. */
    duet_step_shape pre = {0};
    duet_step_shape_add(&pre, 0, 40, false);
    double t_req = duet_step_cost_predict(&prof[0], &pre) + 24 * decode_ms(&prof[0], 2, 64) * 1e-3;
    const step_cost unused[3] = {COST_CPU, COST_CPU, COST_CPU};
    const int seqs[3] = {4, 32, 32};
    const duet_router_instance_config ric[3] = {
        {DUET_PRIORITY_INTERACTIVE, 300, 8}, {DUET_PRIORITY_BATCH, 300, 64}, {DUET_PRIORITY_BATCH, 300, 64}};
    workload w = {.n_open = 60,
                  .open_rate = 2 / t_req,
                  .open_prio = DUET_PRIORITY_INTERACTIVE,
                  .open_prompt_min = 16,
                  .open_prompt_max = 64,
                  .open_new_min = 16,
                  .open_new_max = 32,
                  .closed_clients = 32,
                  .closed_prio = DUET_PRIORITY_BATCH,
                  .closed_prompt = 64,
                  .closed_new = 256,
                  .fail_inst = -1};
    /* The flood lasts as long as the interactive arrivals and more. */
    w.closed_until = (int64_t)((w.n_open / w.open_rate + 10 * t_req) * 1e9);
    double ttft[2], batch_tput[2];
    for (int blind = 0; blind < 2; blind++) {
        duet_router_config rc = duet__router_config_default();
        rc.tier_blind = blind;
        fleet f;
        fleet_init(&f, 3, unused, NULL, seqs, ric, rc, 99);
        for (int i = 0; i < 3; i++)
            f.inst[i].measured = &prof[i];
        fleet_run(&f, &w);
        ttft[blind] = p99_ms(&f, DUET_PRIORITY_INTERACTIVE, true);
        int64_t gen = 0;
        for (int k = 0; k < f.n_req; k++)
            if (f.req[k].prio == DUET_PRIORITY_BATCH) gen += f.req[k].gen;
        batch_tput[blind] = (double)gen / ((double)f.now * 1e-9);
        printf("router: %s: interactive p99 TTFT %.1f ms (arrivals %.2f/s), batch %.0f tok/s over %.1f s\n",
               blind ? "tier-blind" : "tier routing", ttft[blind], w.open_rate, batch_tput[blind],
               (double)f.now * 1e-9);
        fleet_free(&f);
    }
    printf("router: tier routing's interactive p99 TTFT is %.1fx lower than tier-blind's\n",
           ttft[1] / ttft[0]);
    ck_assert_msg(ttft[0] * 3 <= ttft[1],
                  "tier routing's interactive p99 TTFT (%.1f ms) is >= 3x lower than tier-blind (%.1f ms)",
                  ttft[0], ttft[1]);
}
END_TEST

static Suite *suite(void) {
    Suite *s = suite_create("router");
    TCase *tc = tcase_create("policy");
    tcase_add_test(tc, test_least_work_weighted_by_speed);
    tcase_add_test(tc, test_tiers_and_spill_over);
    tcase_add_test(tc, test_round_robin_and_power_of_two);
    tcase_add_test(tc, test_failure_retries_once);
    tcase_add_test(tc, test_pinned_requests);
    tcase_add_test(tc, test_table_and_refusals);
    suite_add_tcase(s, tc);
    TCase *fl = tcase_create("fleet");
    tcase_set_timeout(fl, 120);
    tcase_add_test(fl, test_fleet_least_work_beats_round_robin);
    tcase_add_test(fl, test_fleet_failing_instance_loses_nothing);
    tcase_add_test(fl, test_fleet_tiers_protect_interactive_ttft);
    suite_add_tcase(s, fl);
    return s;
}

int main(void) {
    return test_run_suite(suite());
}
