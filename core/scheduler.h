/* scheduler.h — the continuous-batching scheduler of one instance, as a pure
 * state machine.
 *
 * It reads no clock, starts no thread and allocates nothing after
 * duet__sched_new. Inputs are events stamped with a time; the output is the
 * next step's plan, or "wait until T", or "idle". The engine thread drives it
 * with the real clock; tests and simulators drive the same code with a
 * virtual clock. Not thread safe: one owner calls everything.
 *
 * Time: int64 nanoseconds on any monotonic clock (the engine uses
 * CLOCK_MONOTONIC; tests start at 0). Only differences matter.
 *
 * The drive loop:
 *
 *     for (;;) {
 *         feed pending duet__sched_arrival / duet__sched_cancel events;
 *         switch (duet__sched_plan(s, now, &plan)) {
 *         case DUET_SCHED_STEP: drop the state of plan->preempted[];
 *                               run the step; duet__sched_step_done(...);
 *                               break;
 *         case DUET_SCHED_WAIT: sleep until plan->wake_at or a new event;
 *                               break;
 *         case DUET_SCHED_IDLE: sleep until a new event;
 *         }
 *     }
 *
 * Requests. Each request is a token stream: its n_prompt prompt tokens
 * followed by the tokens generated so far. A step entry asks the engine to
 * run stream tokens [pos, pos + n_tokens) of one request in its sequence
 * slot; when `logits` is set, the last of them yields logits and the engine
 * samples the next token. A preempted request loses its KV blocks and
 * slot; when it is scheduled again it re-prefills its whole stream (prompt +
 * generated: recompute), and the entry that completes that re-prefill asks
 * for logits and produces its next token. The engine keeps the stream (and
 * the sampler state) across preemption; the scheduler only counts.
 *
 * Outcomes. Every accepted arrival leaves the scheduler exactly once:
 * finished (step_done says so), or removed by duet__sched_cancel (the
 * engine uses cancel for client cancellation and for failures alike). The
 * engine reports the outcome (finish reason, error) to the client; the
 * scheduler keeps no per-request timestamps beyond the arrival time (the
 * engine records first-scheduled and first-token times itself, helped by
 * duet_sched_seq.first_schedule).
 *
 * Policies:
 * - Continuous batching: every running sequence gets a token each step
 *   (decodes first, oldest interactive first); a sequence that finishes or
 *   is cancelled frees its slot and KV blocks at once; waiting requests
 *   join at the next plan.
 * - Chunked prefill: after the decodes, prompt chunks (at most
 *   prefill_chunk tokens per sequence) fill the rest of max_batch_tokens;
 *   first those of running sequences still prefilling, then newly admitted
 *   requests.
 * - Stall-free steps (a time budget, Sarathi-Serve's idea): with a step-cost
 *   model (duet__sched_set_cost) and a step budget for the class of a
 *   sequence decoding in the step (knobs.step_budget_ns, the tightest of
 *   the decoding classes'), prompt chunks shrink so that the model's
 *   predicted time of the whole step (decodes, drafts, chunks) stays
 *   within the budget. Chunks are whole or at least DUET_SCHED_MIN_CHUNK
 *   tokens (smaller ones waste the matrix multiply); the first chunk of a
 *   step gets at least that many even when the budget has no room left, so
 *   prefill never starves (a step then runs over its budget by at most one
 *   minimum chunk). A step without decodes, a class without a budget, or
 *   no model: token counts only (as above). Admission stops at the first
 *   request whose first chunk finds no time left.
 * - Admission: interactive queue first, then batch; FIFO by arrival within a
 *   class; admission stops at the first request that does not fit (no
 *   overtaking). A request is admitted only when free KV blocks cover its
 *   whole stream so far (after preempting lower-priority sequences if
 *   needed) and a slot is free (running < max_batch_seqs).
 * - Prefix caching: a request whose stream the engine gave with
 *   duet__sched_set_stream has its full KV blocks registered in the pool's
 *   prefix cache as its computed tokens cover them (kv_blocks.h: keyed by
 *   the chain hash of the tokens up to each block's end, matched exactly).
 *   When lookup is on, admission (and re-admission after a preemption)
 *   shares the cached blocks that hold the start of its stream, at most
 *   (stream length - 1) / block_size of them so the last token is always
 *   computed and yields logits: its first entry starts at pos = the tokens
 *   found, a multiple of block_size. Admission then needs free blocks only
 *   for the rest (an unreferenced cached block it shares counts as taken).
 *   Unreferenced cached blocks count as free; allocation evicts them, least
 *   recently released first, only when no plain free block is left.
 *   Finished, cancelled and preempted requests release their references;
 *   what they registered stays cached.
 * - batch_timeout: when nothing is running, the scheduler starts prefilling
 *   only once the oldest waiting request has waited batch_timeout, or as
 *   soon as max_batch_seqs requests are waiting.
 * - Preemption: when KV blocks run out, the lowest-ranked running sequence
 *   not already in this step's plan is preempted (rank: interactive before
 *   batch, then older arrival before younger). A running sequence may
 *   preempt any sequence ranked below it, even one already placed in this
 *   plan (it is taken out again); a decode that ranks lowest preempts
 *   itself, a prompt chunk that ranks lowest shrinks to the free blocks (or
 *   waits a step). A waiting request may preempt only lower-priority
 *   (batch, when it is interactive) sequences. A preempted request goes
 *   back to the front of its class's queue, in arrival order (it keeps its
 *   place), and is not re-admitted in the same plan. The best-ranked
 *   running sequence always progresses, so nothing livelocks.
 * - Speculative decoding: before a plan the engine may offer draft tokens
 *   for a request (duet__sched_set_draft, with the request's estimated
 *   acceptance). After the decodes are placed, the decision grants each
 *   decode with an offer some of its draft tokens: with knobs.spec_measured
 *   and a step-cost model, duet__spec_decide (speculative.h) grants what
 *   raises the step's predicted tokens per second, weighing the target's
 *   model and the draft model's (duet__sched_set_draft_cost; none: drafts
 *   are free, as n-gram's); after DUET_SCHED_SPEC_EXPLORE plans in a row
 *   in which it granted nothing, one candidate in turn gets its offer (so
 *   its acceptance is measured where speculation is refused), when the
 *   decision would have granted drafts had every candidate kept all of
 *   them (otherwise acceptance is not what refuses them, and exploring
 *   costs throughput for nothing); without spec_measured or a model every offer is granted.
 *   A step with more than spec_max_batch decodes (a hard cap) grants
 *   nothing. Each decode, best rank first, grows by its grant
 *   (n_draft), within the token budget, the KV blocks free now (nobody
 *   is preempted to make room for drafts; they come before prompt chunks,
 *   which get what is left) and max_new (a step never yields more than
 *   the request may still generate). Every one of the entry's 1 + n_draft
 *   rows yields logits; step_done reports how many tokens it kept
 *   (1..1 + n_draft) and the KV of the rejected positions rolls back (the
 *   sequence's blocks shrink to its computed tokens). The stats count the
 *   draft tokens offered, granted, refused (spec_throttled) and refused by
 *   the cap, and the steps by decision. Offers last for one plan. With a
 *   draft model's cost, the plan's predicted_s and the time budget include
 *   the draft's passes the decision predicted.
 * - Refusal at arrival: DUET_SCHED_QUEUE_FULL when max_waiting requests
 *   are waiting (HTTP 429), DUET_SCHED_TOO_LONG when n_prompt + max_new
 *   exceeds n_ctx or the whole KV pool (HTTP 400), DUET_SCHED_INVALID for
 *   non-positive sizes, a bad priority or a duplicate id (HTTP 400).
 */
#ifndef DUET_SCHEDULER_H
#define DUET_SCHEDULER_H

#include <stdbool.h>
#include <stdint.h>

#include "duet.h"
#include "kv_blocks.h"
#include "speculative.h"

typedef struct duet_sched duet_sched;

#define DUET_SCHED_NS_PER_MS INT64_C(1000000)
#define DUET_SCHED_NS_PER_S INT64_C(1000000000)

/* Knobs: settable at run time (duet__sched_set_knobs); take effect at the
 * next plan. */
typedef struct duet_sched_knobs {
    int max_batch_seqs;        /* running sequences at most; 1..config.max_seqs */
    int max_batch_tokens;      /* tokens per step; 1..config.max_tokens. Keep it
                                  >= max_batch_seqs: otherwise the youngest
                                  running sequences skip steps */
    int prefill_chunk;         /* prompt tokens per sequence per step; >= 1 */
    int max_waiting;           /* waiting requests at most; 0..config.max_waiting */
    int64_t batch_timeout_ns;  /* idle wait for more arrivals; >= 0 */
    int spec_max_batch;        /* drafts only in steps with at most this many
                                  decodes (a hard cap; 0: never); >= 0 */
    bool spec_measured;        /* grant drafts by duet__spec_decide (needs a
                                  step-cost model); false: every offer */
    int64_t step_budget_ns[2]; /* per duet_priority: the predicted time of a
                                  step in which a sequence of that class
                                  decodes, at most (prompt chunks shrink to
                                  fit; see Policies); 0 = none; >= 0 */
} duet_sched_knobs;

/* The smallest prompt chunk the time budget cuts to (a chunk may still be
 * smaller when that is all the prompt has left). */
#define DUET_SCHED_MIN_CHUNK 16

/* Plans in a row whose draft offers the decision refused, after which one
 * candidate's offer is granted anyway (exploration). */
#define DUET_SCHED_SPEC_EXPLORE 16

/* Steps with draft offers, by what became of them. */
enum {
    DUET_SPEC_STEP_DRAFT = 0, /* the decision granted drafts */
    DUET_SPEC_STEP_PLAIN,     /* the decision refused them all */
    DUET_SPEC_STEP_EXPLORE,   /* refused, but one was granted to measure */
    DUET_SPEC_STEP_CAPPED,    /* more decodes than spec_max_batch */
    DUET_SPEC_STEP_ALWAYS,    /* granted without a decision (spec_measured off, or no model) */
    DUET_SPEC_STEP_KINDS
};

/* Capacities, fixed at creation (all memory is sized from them). */
typedef struct duet_sched_config {
    int max_seqs;           /* sequence slots; the engine's KV state holds this many */
    int max_tokens;         /* largest step the engine's buffers take */
    int max_waiting;        /* largest queue. Preempted requests count as
                               waiting, and the request table always has room
                               for them (it holds max_waiting + max_seqs) */
    int n_ctx;              /* positions per sequence */
    int kv_block_size;      /* tokens per KV block (16 or 32) */
    int kv_blocks;          /* blocks in the pool */
    duet_sched_knobs knobs; /* initial knob values */
} duet_sched_config;

typedef enum duet_sched_admit {
    DUET_SCHED_ADMITTED = 0,
    DUET_SCHED_QUEUE_FULL, /* -> DUET_QUEUE_FULL / HTTP 429 */
    DUET_SCHED_TOO_LONG,   /* -> DUET_CONTEXT_FULL / HTTP 400: can never fit */
    DUET_SCHED_INVALID,    /* -> DUET_BAD_REQUEST / HTTP 400 */
} duet_sched_admit;

/* One sequence of a step. The engine feeds tokens [pos, pos + n_tokens) of
 * the request's stream (prompt, then generated tokens) at positions
 * pos.. in KV slot `slot`. */
typedef struct duet_sched_seq {
    uint64_t id;
    int slot;              /* KV sequence slot, in [0, config.max_seqs) */
    int pos;               /* first position = stream index of the first token */
    int n_tokens;          /* >= 1: a prompt chunk, or 1 + n_draft for a decode */
    int n_draft;           /* speculative: the last n_draft tokens are the
                              engine's draft tokens (not in the stream yet),
                              and all 1 + n_draft tokens yield logits */
    bool logits;           /* the last token's logits are wanted: sample one */
    bool decode;           /* a decode (the stream's newest token), not a chunk */
    bool first_schedule;   /* the first time this request runs (queue time ends) */
    bool resumed;          /* re-prefill after a preemption */
    int n_prompt;          /* stream layout, for the engine's convenience */
    int n_generated;       /* tokens generated before this step */
    const int32_t *blocks; /* KV block table covering [0, pos + n_tokens) */
    int n_blocks;
} duet_sched_seq;

typedef enum duet_sched_action {
    DUET_SCHED_IDLE = 0, /* nothing waiting or running: sleep until an event */
    DUET_SCHED_WAIT,     /* waiting work, held back by batch_timeout: sleep
                            until plan->wake_at or an event */
    DUET_SCHED_STEP,     /* run plan->seqs, then call duet__sched_step_done */
} duet_sched_action;

/* Owned by the scheduler; valid until its next call. */
typedef struct duet_sched_plan {
    int n_seqs;
    const duet_sched_seq *seqs; /* decodes first, then prompt chunks */
    int n_tokens;               /* sum of seqs[i].n_tokens (<= max_batch_tokens) */
    int n_logits;               /* logit rows: 1 per entry with logits set, plus its drafts */
    int n_draft;                /* draft tokens in the step */
    int n_preempted;            /* requests preempted by this plan: the engine */
    const uint64_t *preempted;  /* drops their KV state; they stay queued */
    int64_t wake_at;            /* DUET_SCHED_WAIT: when to call plan again */
    int64_t budget_ns;          /* the time budget the step was sized to; 0 = none */
    double predicted_s;         /* the cost model's time for the step; 0 without a model */
} duet_sched_plan;

/* What the engine reports for plan->seqs[i], in plan order. */
typedef struct duet_sched_result {
    uint64_t id;     /* must equal plan->seqs[i].id */
    int n_generated; /* tokens appended to the stream: 1 when logits were
                        sampled, else 0; with n_draft drafts, 1..1 + n_draft
                        (the kept drafts, then the target's own token) */
    bool finished;   /* the request is done (EOS, stop, max_tokens reached,
                        context full); the engine decides, since it samples */
} duet_sched_result;

typedef struct duet_sched_stats {
    int waiting[2]; /* by duet_priority: in queue (incl. preempted) */
    int running[2]; /* holding a slot (prefilling or decoding) */
    int prefilling; /* running but not yet past their stream */
    int kv_blocks_used, kv_blocks_total;
    double kv_usage;   /* kv_blocks_used / kv_blocks_total */
    uint64_t arrivals; /* admitted */
    uint64_t refused;  /* QUEUE_FULL */
    uint64_t rejected; /* TOO_LONG or INVALID */
    uint64_t finished, cancelled;
    uint64_t preemptions;
    uint64_t steps, step_tokens;
    /* Prefix cache: stream tokens looked up at admissions (requests with
     * lookup on) and those found cached (vLLM's prefix_cache_queries and
     * _hits); blocks with a cache entry now; entries evicted. */
    uint64_t prefix_queries, prefix_hits;
    int kv_blocks_cached;
    uint64_t prefix_evictions;
    uint64_t spec_offered;   /* draft tokens offered */
    uint64_t spec_granted;   /* draft tokens placed into steps */
    uint64_t spec_throttled; /* draft tokens offered but not granted (the decision or the cap) */
    uint64_t spec_capped;    /* of those, refused by the cap (spec_max_batch) */
    uint64_t spec_steps[DUET_SPEC_STEP_KINDS]; /* plans with offers, by DUET_SPEC_STEP_* */
    uint64_t budget_cut;                       /* steps whose prompt chunks the time budget shortened */
    uint64_t budget_over; /* steps predicted over their budget (decodes alone, or the minimum chunk) */
} duet_sched_stats;

/* Validates config and allocates everything. DUET_INVALID_ARGUMENT on bad
 * sizes (message in duet_last_error), DUET_OUT_OF_MEMORY. */
duet_status duet__sched_new(const duet_sched_config *config, duet_sched **out);
void duet__sched_free(duet_sched *s);

/* A new request. n_prompt >= 1 and max_new >= 1 tokens. */
duet_sched_admit duet__sched_arrival(duet_sched *s, int64_t now, uint64_t id, int n_prompt, int max_new,
                                     duet_priority priority);
/* Gives request id's stream (n_prompt prompt tokens, then each generated
 * token before its step_done reports it) for prefix caching: its full
 * blocks are registered in the cache as they are computed and, with lookup,
 * its admissions share cached blocks of its start (see Policies). The
 * memory is the caller's and must stay valid and unchanged (but for
 * appended tokens) until the request leaves the scheduler; it is not read
 * after a cancel. Call it before the request's first plan (right after its
 * arrival); DUET_INVALID_ARGUMENT for an unknown or started request. NULL
 * tokens: no caching for it (the default). */
duet_status duet__sched_set_stream(duet_sched *s, uint64_t id, const int32_t *tokens, bool lookup);
/* Forgets every cached block (the device contents of the pool were
 * overwritten outside the tables). Running requests register their blocks
 * again from the start of their streams. */
void duet__sched_prefix_clear(duet_sched *s);
/* Removes a request in any state (waiting, prefilling, running, preempted).
 * DUET_OK, or DUET_INVALID_ARGUMENT if the id is unknown (already finished
 * or cancelled). If the request is in the step now running, its slot and
 * blocks are released at that step's step_done (the engine ignores its
 * result; pass it anyway, in order). */
duet_status duet__sched_cancel(duet_sched *s, int64_t now, uint64_t id);

/* The step-cost model the time budget (knobs.step_budget_ns) predicts
 * steps with; its coefficients are copied. NULL: none (token counts only). */
void duet__sched_set_cost(duet_sched *s, const duet_step_cost *m);

/* Offers n_draft (>= 0) draft tokens for request id's next decode, with
 * the request's estimated per-token acceptance alpha and the tokens a
 * draft model's first pass takes for it (catchup >= 1: its newest token
 * and every token its KV missed; ignored without a draft cost); the next
 * plan grants all, some or none of them (see the policies above). Up to
 * DUET_SCHED_SPEC_STEADY_CATCHUP of them are a drafting step's own, the
 * rest a backlog the decision charges by the share it serves
 * (duet_spec_cand.backlog). Ignored for an unknown id or a request that is
 * not decoding. */
#define DUET_SCHED_SPEC_STEADY_CATCHUP 2
void duet__sched_set_draft(duet_sched *s, uint64_t id, int n_draft, float alpha, int catchup);
/* The draft model's step-cost model, per forward pass (copied); NULL:
 * drafts cost nothing (n-gram). */
void duet__sched_set_draft_cost(duet_sched *s, const duet_step_cost *m);
/* The last decision duet__spec_decide made (false: none yet). */
bool duet__sched_spec_decision(const duet_sched *s, duet_spec_decision *out);

/* Plans the next step. Must not be called while a step is outstanding
 * (between DUET_SCHED_STEP and step_done/step_failed). */
duet_sched_action duet__sched_plan(duet_sched *s, int64_t now, duet_sched_plan *plan);
/* Ends the outstanding step: results[i] for plan->seqs[i], n == plan->n_seqs.
 * Returns DUET_INVALID_ARGUMENT (and changes nothing) when results do not
 * match the plan (wrong count or id, n_generated not 1 with logits / 0
 * without / outside 1..1 + n_draft with drafts, max_new reached without
 * finished). Results of requests
 * cancelled during the step are ignored. */
duet_status duet__sched_step_done(duet_sched *s, int64_t now, const duet_sched_result *results, int n);
/* The outstanding step did not run (device error): nothing advances; its
 * sequences keep their slots and blocks. The engine may cancel them. */
void duet__sched_step_failed(duet_sched *s, int64_t now);

/* Knobs: validated against the config's capacities (DUET_INVALID_ARGUMENT
 * otherwise); take effect at the next plan. Lowering max_batch_seqs below
 * the running count preempts nothing: admission stops until it drains. */
duet_status duet__sched_set_knobs(duet_sched *s, const duet_sched_knobs *knobs);
duet_sched_knobs duet__sched_knobs(const duet_sched *s);
duet_sched_config duet__sched_config(const duet_sched *s);

void duet__sched_stats(const duet_sched *s, duet_sched_stats *out);
/* The KV allocator (read-only: block tables, usage). */
const duet_kv_blocks *duet__sched_kv(const duet_sched *s);
/* Whether any request is waiting or running. */
bool duet__sched_busy(const duet_sched *s);

/* Checks internal invariants (queues, slots, KV blocks conserved, counts).
 * DUET_OK or DUET_INVALID_ARGUMENT with a message. For tests. */
duet_status duet__sched_check(const duet_sched *s);

#endif /* DUET_SCHEDULER_H */
