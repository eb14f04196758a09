/* router.c — the router as a pure state machine (see router.h for the
 * policy). Requests live in an open-addressing table keyed by id, sized at
 * creation (twice max_requests, a power of two; linear probing, deletion by
 * backward shift), so routing allocates nothing. */
#include "router.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../backends/backend.h"

typedef struct rreq {
    uint64_t id;
    bool used;
    bool streamed; /* a token went out: no retry after a failure */
    bool retried;  /* routed a second time after a failure */
    bool pinned;   /* placed by route_to: never moved */
    int inst;
    int tier;
    int n_prompt, max_tokens;
    int64_t work; /* tokens still to compute, counted in its instance's outstanding */
} rreq;

typedef struct rinst {
    duet_router_instance_config cfg;
    bool failed;
    double speed;
    int64_t outstanding;
    int requests;
    uint64_t routed, pinned;
} rinst;

struct duet_router {
    duet_router_config cfg;
    rinst inst[DUET_ROUTER_MAX_INSTANCES];
    rreq *table; /* [mask + 1] */
    size_t mask;
    int in_flight;
    int rr_next; /* where the round (and least-work ties) starts */
    uint64_t rng;
    duet_router_stats st; /* counters; gauges are filled on demand */
};

duet_router_config duet__router_config_default(void) {
    return (duet_router_config){.policy = DUET_ROUTER_LEAST_WORK,
                                .spill_interactive = true,
                                .spill_batch = false,
                                .p2c_above = 4,
                                .speed_alpha = 0.2,
                                .seed = 0x9e3779b97f4a7c15ull};
}

/* ---- the request table ---------------------------------------------------- */

static size_t hash_id(uint64_t id) {
    id ^= id >> 33;
    id *= 0xff51afd7ed558ccdull;
    id ^= id >> 33;
    return (size_t)id;
}

static rreq *find(const duet_router *r, uint64_t id) {
    for (size_t i = hash_id(id) & r->mask;; i = (i + 1) & r->mask) {
        rreq *q = &r->table[i];
        if (!q->used) return NULL;
        if (q->id == id) return q;
    }
}

static rreq *insert(duet_router *r, uint64_t id) {
    size_t i = hash_id(id) & r->mask;
    while (r->table[i].used)
        i = (i + 1) & r->mask;
    rreq *q = &r->table[i];
    memset(q, 0, sizeof *q);
    q->id = id;
    q->used = true;
    return q;
}

/* Removes q, shifting later entries of its probe run back into the hole. */
static void erase(duet_router *r, rreq *q) {
    size_t hole = (size_t)(q - r->table);
    r->table[hole].used = false;
    for (size_t i = (hole + 1) & r->mask; r->table[i].used; i = (i + 1) & r->mask) {
        size_t home = hash_id(r->table[i].id) & r->mask;
        /* Entry i may move to the hole when its home is not in (hole, i]. */
        bool stays = hole <= i ? (home > hole && home <= i) : (home > hole || home <= i);
        if (stays) continue;
        r->table[hole] = r->table[i];
        r->table[i].used = false;
        hole = i;
    }
}

/* ---- creation --------------------------------------------------------------- */

duet_status duet__router_new(const duet_router_config *c, duet_router **out) {
    if (!c || !out) return duet__error(DUET_INVALID_ARGUMENT, "router: NULL argument");
    *out = NULL;
    if (c->n_instances < 1 || c->n_instances > DUET_ROUTER_MAX_INSTANCES || !c->instances)
        return duet__error(DUET_INVALID_ARGUMENT, "router: %d instances (1..%d)", c->n_instances,
                           DUET_ROUTER_MAX_INSTANCES);
    if (c->max_requests < 1 || c->max_requests > (1 << 24))
        return duet__error(DUET_INVALID_ARGUMENT, "router: max_requests %d out of range [1, 16777216]",
                           c->max_requests);
    if (c->policy != DUET_ROUTER_LEAST_WORK && c->policy != DUET_ROUTER_ROUND_ROBIN)
        return duet__error(DUET_INVALID_ARGUMENT, "router: unknown policy %d", (int)c->policy);
    if (c->p2c_above < 0) return duet__error(DUET_INVALID_ARGUMENT, "router: p2c_above %d < 0", c->p2c_above);
    if (!(c->speed_alpha >= 0 && c->speed_alpha <= 1))
        return duet__error(DUET_INVALID_ARGUMENT, "router: speed_alpha %g out of range [0, 1]",
                           c->speed_alpha);
    for (int i = 0; i < c->n_instances; i++) {
        const duet_router_instance_config *ic = &c->instances[i];
        if (ic->tier != DUET_PRIORITY_INTERACTIVE && ic->tier != DUET_PRIORITY_BATCH)
            return duet__error(DUET_INVALID_ARGUMENT, "router: instance %d has tier %d", i, (int)ic->tier);
        if (!(ic->speed > 0 && ic->speed < 1e12))
            return duet__error(DUET_INVALID_ARGUMENT, "router: instance %d has speed %g (must be > 0)", i,
                               ic->speed);
        if (ic->max_outstanding < 0)
            return duet__error(DUET_INVALID_ARGUMENT, "router: instance %d has max_outstanding %d", i,
                               ic->max_outstanding);
    }
    duet_router *r = calloc(1, sizeof *r);
    if (!r) return duet__error(DUET_OUT_OF_MEMORY, "router: out of memory");
    size_t cap = 16;
    while (cap < 2 * (size_t)c->max_requests)
        cap *= 2;
    r->table = calloc(cap, sizeof *r->table);
    if (!r->table) {
        free(r);
        return duet__error(DUET_OUT_OF_MEMORY, "router: out of memory for %zu requests", cap);
    }
    r->mask = cap - 1;
    r->cfg = *c;
    r->cfg.instances = NULL; /* copied into inst[] */
    if (r->cfg.speed_alpha == 0) r->cfg.speed_alpha = 0.2;
    for (int i = 0; i < c->n_instances; i++) {
        r->inst[i].cfg = c->instances[i];
        r->inst[i].speed = c->instances[i].speed;
    }
    r->rng = c->seed ? c->seed : 1;
    *out = r;
    return DUET_OK;
}

void duet__router_free(duet_router *r) {
    if (!r) return;
    free(r->table);
    free(r);
}

/* ---- the policy --------------------------------------------------------------- */

static uint64_t next_random(duet_router *r) {
    /* splitmix64: one 64-bit state, good enough to pick two candidates. */
    uint64_t z = (r->rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static bool saturated(const rinst *in) {
    return in->cfg.max_outstanding > 0 && in->requests >= in->cfg.max_outstanding;
}

/* The live instances of `tier` (any tier when tier < 0), in round order
 * from rr_next, optionally only the unsaturated ones. */
static int collect(const duet_router *r, int tier, bool unsaturated_only, int *cand) {
    int n = 0;
    for (int k = 0; k < r->cfg.n_instances; k++) {
        int i = (r->rr_next + k) % r->cfg.n_instances;
        const rinst *in = &r->inst[i];
        if (in->failed || (tier >= 0 && (int)in->cfg.tier != tier)) continue;
        if (unsaturated_only && saturated(in)) continue;
        cand[n++] = i;
    }
    return n;
}

/* The candidates for a request of `tier` (see router.h: tiers, saturation,
 * spill-over). Returns their count; 0 when no instance is live. */
static int candidates(const duet_router *r, int tier, int *cand) {
    if (r->cfg.tier_blind) {
        int n = collect(r, -1, true, cand);
        return n ? n : collect(r, -1, false, cand);
    }
    int n = collect(r, tier, true, cand);
    if (n) return n;
    bool may_spill = tier == DUET_PRIORITY_INTERACTIVE ? r->cfg.spill_interactive : r->cfg.spill_batch;
    if (may_spill && (n = collect(r, 1 - tier, true, cand))) return n;
    if ((n = collect(r, tier, false, cand))) return n; /* all saturated: queue on its own tier */
    return collect(r, 1 - tier, false, cand);          /* the tier has no live instance */
}

/* Seconds instance i needs to drain its work plus `work` more. */
static double drain_time(const duet_router *r, int i, int64_t work) {
    return (double)(r->inst[i].outstanding + work) / r->inst[i].speed;
}

/* True when instance a is a better choice than b for `work`. */
static bool better(const duet_router *r, int a, int b, int64_t work) {
    double ta = drain_time(r, a, work), tb = drain_time(r, b, work);
    if (ta != tb) return ta < tb;
    return r->inst[a].requests < r->inst[b].requests;
}

static int choose(duet_router *r, const int *cand, int n, int64_t work) {
    if (r->cfg.policy == DUET_ROUTER_ROUND_ROBIN) return cand[0]; /* cand starts at rr_next */
    if (r->cfg.p2c_above > 0 && n > r->cfg.p2c_above) {
        int a = (int)(next_random(r) % (uint64_t)n);
        int b = (int)(next_random(r) % (uint64_t)(n - 1));
        if (b >= a) b++;
        return better(r, cand[b], cand[a], work) ? cand[b] : cand[a];
    }
    int best = cand[0];
    for (int k = 1; k < n; k++)
        if (better(r, cand[k], best, work)) best = cand[k];
    return best;
}

/* Puts q's work on instance i. */
static void put(duet_router *r, rreq *q, int i) {
    rinst *in = &r->inst[i];
    q->inst = i;
    q->work = (int64_t)q->n_prompt + q->max_tokens;
    q->streamed = false;
    in->outstanding += q->work;
    in->requests++;
    in->routed++;
    r->st.routed++;
}

/* Places q on an instance chosen for it; false when none is live. */
static bool place(duet_router *r, rreq *q) {
    int cand[DUET_ROUTER_MAX_INSTANCES];
    int n = candidates(r, q->tier, cand);
    if (!n) return false;
    int i = choose(r, cand, n, (int64_t)q->n_prompt + q->max_tokens);
    put(r, q, i);
    if (!r->cfg.tier_blind && (int)r->inst[i].cfg.tier != q->tier) r->st.spills++;
    r->rr_next = (i + 1) % r->cfg.n_instances;
    return true;
}

/* Takes q's remaining work off its instance. */
static void unplace(duet_router *r, rreq *q) {
    rinst *in = &r->inst[q->inst];
    in->outstanding -= q->work;
    in->requests--;
    q->work = 0;
}

/* ---- events ------------------------------------------------------------------ */

/* The checks every new request passes; DUET_OK when it may be routed. */
static duet_status admit(duet_router *r, uint64_t id, duet_priority tier, int n_prompt, int max_tokens) {
    if (tier != DUET_PRIORITY_INTERACTIVE && tier != DUET_PRIORITY_BATCH)
        return duet__error(DUET_INVALID_ARGUMENT, "router: tier %d", (int)tier);
    if (n_prompt < 1 || max_tokens < 1)
        return duet__error(DUET_INVALID_ARGUMENT, "router: %d prompt tokens, max_tokens %d", n_prompt,
                           max_tokens);
    if (find(r, id))
        return duet__error(DUET_INVALID_ARGUMENT, "router: request %llu is already in flight",
                           (unsigned long long)id);
    if (r->in_flight >= r->cfg.max_requests)
        return duet__error(DUET_QUEUE_FULL, "router: %d requests in flight", r->in_flight);
    return DUET_OK;
}

static rreq *add(duet_router *r, uint64_t id, duet_priority tier, int n_prompt, int max_tokens) {
    rreq *q = insert(r, id);
    q->tier = tier;
    q->n_prompt = n_prompt;
    q->max_tokens = max_tokens;
    r->in_flight++;
    return q;
}

duet_status duet__router_route(duet_router *r, uint64_t id, duet_priority tier, int n_prompt, int max_tokens,
                               int *inst) {
    if (!r || !inst) return duet__error(DUET_INVALID_ARGUMENT, "router: NULL argument");
    *inst = -1;
    duet_status st = admit(r, id, tier, n_prompt, max_tokens);
    if (st) return st;
    int cand[DUET_ROUTER_MAX_INSTANCES];
    if (!candidates(r, tier, cand)) {
        r->st.refused++;
        return duet__error(DUET_NO_DEVICE, "router: no live instance");
    }
    rreq *q = add(r, id, tier, n_prompt, max_tokens);
    place(r, q);
    *inst = q->inst;
    return DUET_OK;
}

duet_status duet__router_route_to(duet_router *r, uint64_t id, duet_priority tier, int n_prompt,
                                  int max_tokens, int inst) {
    if (!r) return duet__error(DUET_INVALID_ARGUMENT, "router: NULL argument");
    if (inst < 0 || inst >= r->cfg.n_instances)
        return duet__error(DUET_INVALID_ARGUMENT, "router: no instance %d (0..%d)", inst,
                           r->cfg.n_instances - 1);
    duet_status st = admit(r, id, tier, n_prompt, max_tokens);
    if (st) return st;
    if (r->inst[inst].failed) {
        r->st.refused++;
        return duet__error(DUET_NO_DEVICE, "router: instance %d has failed", inst);
    }
    rreq *q = add(r, id, tier, n_prompt, max_tokens);
    q->pinned = true;
    put(r, q, inst);
    r->inst[inst].pinned++;
    r->st.pinned++;
    return DUET_OK;
}

void duet__router_token(duet_router *r, uint64_t id) {
    rreq *q = r ? find(r, id) : NULL;
    if (!q) return;
    int64_t take = q->streamed ? 1 : (int64_t)q->n_prompt + 1;
    q->streamed = true;
    if (take > q->work) take = q->work; /* more tokens than max_tokens: never below zero */
    q->work -= take;
    r->inst[q->inst].outstanding -= take;
}

void duet__router_done(duet_router *r, uint64_t id) {
    rreq *q = r ? find(r, id) : NULL;
    if (!q) return;
    unplace(r, q);
    erase(r, q);
    r->in_flight--;
}

void duet__router_observe(duet_router *r, int inst, int64_t tokens, double seconds) {
    if (!r || inst < 0 || inst >= r->cfg.n_instances || tokens <= 0 || !(seconds > 0)) return;
    double s = (double)tokens / seconds, a = r->cfg.speed_alpha;
    if (!(s < 1e12)) return;
    rinst *in = &r->inst[inst];
    in->speed = (1 - a) * in->speed + a * s;
}

int duet__router_fail_instance(duet_router *r, int inst, uint64_t *ids, int max) {
    if (!r || inst < 0 || inst >= r->cfg.n_instances) return 0;
    r->inst[inst].failed = true;
    int n = 0;
    for (size_t i = 0; i <= r->mask; i++) {
        const rreq *q = &r->table[i];
        if (!q->used || q->inst != inst) continue;
        if (n < max && ids) ids[n] = q->id;
        n++;
    }
    return n;
}

duet_status duet__router_failed(duet_router *r, uint64_t id, int *to) {
    if (to) *to = -1;
    rreq *q = r ? find(r, id) : NULL;
    if (!q)
        return duet__error(DUET_INVALID_ARGUMENT, "router: request %llu is not in flight",
                           (unsigned long long)id);
    int from = q->inst;
    bool streamed = q->streamed, pinned = q->pinned, may_retry = !q->streamed && !q->retried && !q->pinned;
    unplace(r, q);
    if (may_retry) {
        /* place() never picks a failed instance; if `from` is still live (the
         * request alone failed), keep it off for this retry anyway. */
        bool was_failed = r->inst[from].failed;
        r->inst[from].failed = true;
        bool placed = place(r, q);
        r->inst[from].failed = was_failed;
        if (placed) {
            q->retried = true;
            r->st.retries++;
            if (to) *to = q->inst;
            return DUET_OK;
        }
    }
    erase(r, q); /* q may now hold another request */
    r->in_flight--;
    r->st.failed++;
    if (may_retry) return duet__error(DUET_NO_DEVICE, "no live instance to retry the request on");
    return duet__error(DUET_DEVICE_LOST, "its instance failed %s",
                       streamed ? "after it had streamed tokens"
                       : pinned ? "(the request was pinned to it)"
                                : "and it was retried once already");
}

/* ---- observation --------------------------------------------------------------- */

int duet__router_instance_of(const duet_router *r, uint64_t id) {
    const rreq *q = r ? find(r, id) : NULL;
    return q ? q->inst : -1;
}

void duet__router_stats(const duet_router *r, duet_router_stats *out) {
    *out = r->st;
    out->n_instances = r->cfg.n_instances;
    out->in_flight = r->in_flight;
    out->live = 0;
    for (int i = 0; i < r->cfg.n_instances; i++)
        out->live += !r->inst[i].failed;
}

void duet__router_instance_stats(const duet_router *r, int inst, duet_router_instance_stats *out) {
    memset(out, 0, sizeof *out);
    if (inst < 0 || inst >= r->cfg.n_instances) return;
    const rinst *in = &r->inst[inst];
    *out = (duet_router_instance_stats){.tier = in->cfg.tier,
                                        .failed = in->failed,
                                        .speed = in->speed,
                                        .outstanding = in->outstanding,
                                        .requests = in->requests,
                                        .routed = in->routed,
                                        .pinned = in->pinned};
}

duet_status duet__router_check(const duet_router *r) {
    int64_t work[DUET_ROUTER_MAX_INSTANCES] = {0};
    int reqs[DUET_ROUTER_MAX_INSTANCES] = {0}, n = 0;
    for (size_t i = 0; i <= r->mask; i++) {
        const rreq *q = &r->table[i];
        if (!q->used) continue;
        n++;
        if (q->inst < 0 || q->inst >= r->cfg.n_instances)
            return duet__error(DUET_INVALID_ARGUMENT, "router: request %llu on instance %d",
                               (unsigned long long)q->id, q->inst);
        if (q->work < 0)
            return duet__error(DUET_INVALID_ARGUMENT, "router: request %llu has work %lld",
                               (unsigned long long)q->id, (long long)q->work);
        if (find(r, q->id) != q)
            return duet__error(DUET_INVALID_ARGUMENT, "router: request %llu is unreachable in the table",
                               (unsigned long long)q->id);
        work[q->inst] += q->work;
        reqs[q->inst]++;
    }
    if (n != r->in_flight)
        return duet__error(DUET_INVALID_ARGUMENT, "router: %d requests in the table, %d in flight", n,
                           r->in_flight);
    for (int i = 0; i < r->cfg.n_instances; i++)
        if (work[i] != r->inst[i].outstanding || reqs[i] != r->inst[i].requests)
            return duet__error(
                DUET_INVALID_ARGUMENT,
                "router: instance %d holds %lld tokens in %d requests, its requests sum to %lld in %d", i,
                (long long)r->inst[i].outstanding, r->inst[i].requests, (long long)work[i], reqs[i]);
    return DUET_OK;
}
