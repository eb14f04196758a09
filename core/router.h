/* router.h — which instance serves a request, as a pure state machine.
 *
 * The router holds N instances (any backends, devices and tiers in one
 * process) and sends each request to one of them. Like the scheduler
 * (scheduler.h) it reads no clock, starts no thread and allocates nothing
 * after duet__router_new: the server drives it with real events, tests and
 * `duet-bench --simulate` drive the same code on a virtual clock. Not thread
 * safe: the owner serialises every call (the server holds a mutex).
 *
 * The drive loop:
 *
 *     duet__router_route(r, id, tier, n_prompt, max_tokens, &inst);  submit to inst
 *     duet__router_token(r, id);                      each token it streams
 *     duet__router_observe(r, inst, tokens, seconds); each step it runs (speed)
 *     duet__router_done(r, id);                       when it ends, any outcome
 *
 *   and when an instance fails (its device is lost):
 *
 *     n = duet__router_fail_instance(r, inst, ids, max);  ids[] were on it
 *     for each of them: duet__router_failed(r, id, &to)
 *         DUET_OK: resubmit it to `to` (a retry; it is still in flight)
 *         else:    end it with an error (it has left the router)
 *
 * Work. A request's work is the tokens still to compute for it: at route,
 * its prompt plus max_tokens; its first token takes the prompt off and each
 * token one more. An instance's outstanding work is the sum over the
 * requests routed to it; divided by the instance's speed (tokens per second,
 * measured: an EWMA of what duet__router_observe reports) it is the time the
 * instance needs to drain, which is what the policy compares.
 *
 * Policy (DUET_ROUTER_LEAST_WORK):
 * - Tiers: a request goes to an instance of its tier (interactive requests
 *   to small-batch instances, batch requests to large-batch ones), unless
 *   config.tier_blind, when every live instance is a candidate.
 * - Saturation: an instance holding max_outstanding requests (its
 *   config; 0 = never) is saturated. When every live instance of the tier is
 *   saturated, the request spills over to an unsaturated instance of the
 *   other tier if the config allows that direction (spill_interactive:
 *   interactive requests may use batch instances; spill_batch: batch
 *   requests may use interactive ones). Otherwise it queues on its own tier.
 *   A tier with no live instance at all always falls back to the other (a
 *   spill too): a request is refused only when no instance is live.
 * - Choice: among the candidates, the least (outstanding + this request's
 *   work) / speed; ties go to fewer requests, then round the instances.
 *   With more than p2c_above candidates, power of two choices: two distinct
 *   candidates drawn at random (config.seed; deterministic), the better one.
 * - DUET_ROUTER_ROUND_ROBIN ignores work and speed (the baseline policy the
 *   tests and the bench compare against); tiers, saturation and spills apply
 *   as above.
 *
 * Pinning. duet__router_route_to places a request on the instance its
 * caller names (a benchmark comparing instances, a client with its own
 * placement), whatever its tier, load or saturation; its work counts there
 * like any other's. A pinned request is never moved: when its instance
 * fails it ends with an error, streamed or not.
 *
 * Failures. An instance marked failed is taken out: nothing is routed to it
 * again. Each of its requests that has streamed no token is routed once more
 * (to another live instance, by the same policy; one retry per request);
 * the others, and those with nowhere to go, end with an error. Either way a
 * request is counted once: routed[] counts routing decisions, and a retry is
 * counted in `retries`, not as a new request.
 */
#ifndef DUET_ROUTER_H
#define DUET_ROUTER_H

#include <stdbool.h>
#include <stdint.h>

#include "duet.h"

#define DUET_ROUTER_MAX_INSTANCES 64

typedef enum duet_router_policy {
    DUET_ROUTER_LEAST_WORK = 0, /* least outstanding work / speed (default) */
    DUET_ROUTER_ROUND_ROBIN,    /* each candidate in turn (a baseline) */
} duet_router_policy;

/* One instance, as the router sees it. */
typedef struct duet_router_instance_config {
    duet_priority tier;  /* DUET_PRIORITY_INTERACTIVE or DUET_PRIORITY_BATCH */
    double speed;        /* tokens/s before any measurement; > 0 */
    int max_outstanding; /* requests at which it is saturated; 0 = never */
} duet_router_instance_config;

typedef struct duet_router_config {
    int n_instances;                              /* 1..DUET_ROUTER_MAX_INSTANCES */
    const duet_router_instance_config *instances; /* [n_instances], copied */
    int max_requests;                             /* requests in flight at most (the table's size) */
    duet_router_policy policy;
    bool tier_blind;        /* ignore tiers: every live instance is a candidate */
    bool spill_interactive; /* interactive -> batch instances when its tier is saturated */
    bool spill_batch;       /* batch -> interactive instances when its tier is saturated */
    int p2c_above;          /* power of two choices above this many candidates; 0 = never */
    double speed_alpha;     /* weight of a new measurement in the speed EWMA (0..1]; 0 = 0.2 */
    uint64_t seed;          /* random draws of the power of two choices */
} duet_router_config;

/* Defaults: least work, tiers on, interactive may spill to batch instances
 * (batch may not take interactive capacity), power of two choices above 4
 * candidates. Fill n_instances, instances and max_requests. */
duet_router_config duet__router_config_default(void);

typedef struct duet_router duet_router;

/* Counters and gauges of one instance. */
typedef struct duet_router_instance_stats {
    duet_priority tier;
    bool failed;
    double speed;        /* tokens/s, current estimate */
    int64_t outstanding; /* tokens still to compute */
    int requests;        /* requests in flight on it */
    uint64_t routed;     /* requests routed to it (retries and pinned ones included) */
    uint64_t pinned;     /* of those, pinned to it by duet__router_route_to */
} duet_router_instance_stats;

typedef struct duet_router_stats {
    int n_instances, live;
    int in_flight;
    uint64_t routed;  /* routing decisions (first routes, retries and pinned requests) */
    uint64_t pinned;  /* requests placed by duet__router_route_to */
    uint64_t spills;  /* routed to an instance of the other tier */
    uint64_t retries; /* re-routed after their instance failed */
    uint64_t failed;  /* ended by an instance failure (streamed, retried once already, or nowhere to go) */
    uint64_t refused; /* no live instance */
} duet_router_stats;

/* Validates config (DUET_INVALID_ARGUMENT with a message) and allocates
 * everything. */
duet_status duet__router_new(const duet_router_config *config, duet_router **out);
void duet__router_free(duet_router *r);

/* Routes a new request of `tier` (n_prompt >= 1 prompt tokens, up to
 * max_tokens >= 1 to generate); *inst receives the instance. DUET_NO_DEVICE
 * when no instance is live, DUET_QUEUE_FULL when max_requests are in
 * flight, DUET_INVALID_ARGUMENT for a duplicate id or bad arguments.
 * Nothing is recorded on failure. */
duet_status duet__router_route(duet_router *r, uint64_t id, duet_priority tier, int n_prompt, int max_tokens,
                               int *inst);

/* As duet__router_route, but on instance `inst` (0..n_instances-1) itself:
 * tiers, saturation and the policy do not apply, and the request will not
 * be retried elsewhere (see Pinning). DUET_INVALID_ARGUMENT for an
 * instance out of range, DUET_NO_DEVICE when it has failed. */
duet_status duet__router_route_to(duet_router *r, uint64_t id, duet_priority tier, int n_prompt,
                                  int max_tokens, int inst);

/* A token of request id was streamed (the first one also ends its prompt's
 * work). Unknown ids are ignored. */
void duet__router_token(duet_router *r, uint64_t id);

/* Request id left (finished, cancelled, failed, or refused by its instance
 * at submit). Unknown ids are ignored. */
void duet__router_done(duet_router *r, uint64_t id);

/* Instance inst computed `tokens` tokens in `seconds` (one step, or any
 * window): updates its speed estimate. Non-positive values are ignored. */
void duet__router_observe(duet_router *r, int inst, int64_t tokens, double seconds);

/* Takes instance inst out (idempotent). Writes the ids of the requests in
 * flight on it to ids[] (up to max) and returns how many there are; each of
 * them must then go through duet__router_failed. */
int duet__router_fail_instance(duet_router *r, int inst, uint64_t *ids, int max);

/* Request id's instance failed it. DUET_OK: it streamed no token and was
 * not retried before, and *to is the live instance to resubmit it to (it
 * stays in flight there). Otherwise the request has left the router and
 * must end with an error: DUET_DEVICE_LOST (it had streamed, had been
 * retried, or was pinned), DUET_NO_DEVICE (no live instance left); DUET_INVALID_ARGUMENT
 * for an unknown id. */
duet_status duet__router_failed(duet_router *r, uint64_t id, int *to);

/* The instance request id is on, or -1 when it is not in flight. */
int duet__router_instance_of(const duet_router *r, uint64_t id);

void duet__router_stats(const duet_router *r, duet_router_stats *out);
void duet__router_instance_stats(const duet_router *r, int inst, duet_router_instance_stats *out);

/* Checks invariants (per-instance sums equal the request table). DUET_OK or
 * DUET_INVALID_ARGUMENT with a message. For tests. */
duet_status duet__router_check(const duet_router *r);

#endif /* DUET_ROUTER_H */
