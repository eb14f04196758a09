/* scheduler.c — continuous batching as a pure state machine (see scheduler.h
 * for the policies). Everything is sized at creation: the request table
 * holds max_waiting + max_seqs records, which bounds waiting + running since
 * arrivals are refused once max_waiting requests wait, and preemption only
 * moves records from running to waiting. */
#include "scheduler.h"

#include <assert.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../backends/backend.h"
#include "speculative.h"

enum { ST_FREE = 0, ST_WAITING, ST_RUNNING };

typedef struct req {
    uint64_t id;
    uint64_t order;  /* arrival sequence number: age within a class */
    int64_t arrival; /* time of arrival */
    int n_prompt, max_new;
    int n_generated; /* tokens sampled so far (survive preemption) */
    int n_computed;  /* stream tokens whose KV is in the cache */
    int prio;        /* duet_priority */
    int state;
    int slot;               /* -1 unless running */
    int prev, next;         /* queue links while waiting; next = free-list link while free */
    int plan_index;         /* entry in the plan being built / outstanding, or -1 */
    int n_preempted;        /* times preempted */
    int draft_offer;        /* draft tokens the engine offers for the next plan */
    float draft_alpha;      /* with it: the request's estimated acceptance */
    int draft_catchup;      /* and the tokens the draft model's KV has still to take (>= 1) */
    uint64_t preempt_epoch; /* plan epoch of its last preemption */
    bool started;           /* scheduled at least once */
    bool cancelled;         /* cancelled while in the outstanding step */
    /* Prefix caching (duet__sched_set_stream): the stream's tokens (owned
     * by the engine), whether admission looks them up, the stream tokens
     * the cache supplied at the last admission, and the table entries
     * registered so far with the chain hash of the last one. */
    const int32_t *tokens;
    bool lookup;
    int n_hit;
    int n_reg;
    uint64_t reg_hash;
} req;

struct duet_sched {
    duet_sched_config cfg;
    duet_sched_knobs knobs;
    duet_kv_blocks *kv;

    req *reqs; /* [n_reqs] */
    int n_reqs, free_head;
    int qhead[2], qtail[2], qcount[2];
    int *slot_req; /* [max_seqs] record holding the slot, or -1 */
    int n_running; /* slots held (including cancelled in-flight ones) */

    int *order;           /* [max_seqs] running records sorted by rank (scratch) */
    duet_sched_seq *seqs; /* [max_seqs] plan entries */
    int *seq_req;         /* [max_seqs] record of each entry */
    uint64_t *preempted;  /* [max_seqs] */
    int32_t *hits;        /* [blocks per sequence] cached blocks found for an admission */
    int n_seqs, n_preempted, budget;
    uint64_t epoch; /* bumped per plan, to recognise this plan's preemptions */
    uint64_t next_order;
    bool outstanding;
    /* The time budget (duet__sched_set_cost): the model, and while a plan
     * is built, whether a budget applies, the seconds it has left, whether
     * a prompt chunk is placed yet and whether one was cut short. */
    bool have_cost;
    duet_step_cost cost;
    bool timed, chunked, cut;
    double time_left;
    /* Speculation's decision (duet__spec_decide): the draft model's pass
     * cost (have_draft_cost false: drafts are free, n-gram), the candidates'
     * scratch [max_seqs], the draft seconds of the step being planned, the
     * plans in a row whose offers the decision refused (exploration), and
     * the last decision. */
    bool have_draft_cost;
    duet_step_cost draft_cost;
    duet_spec_cand *cands, *cands_opt; /* cands_opt: the exploration's what-if */
    int *cand_req;                     /* [max_seqs] the record of each candidate */
    double draft_s;
    int spec_refused_run;
    uint64_t spec_explore;
    bool spec_last_valid;
    duet_spec_decision spec_last;

    duet_sched_stats st; /* counters only; gauges are computed on demand */
};

/* ---- ranks and queues ---------------------------------------------------- */

/* True when a ranks before b: interactive first, then older arrival. */
static bool ranks_before(const req *a, const req *b) {
    if (a->prio != b->prio) return a->prio < b->prio;
    return a->order < b->order;
}

static void queue_unlink(duet_sched *s, int i) {
    req *r = &s->reqs[i];
    int p = r->prio;
    if (r->prev >= 0)
        s->reqs[r->prev].next = r->next;
    else
        s->qhead[p] = r->next;
    if (r->next >= 0)
        s->reqs[r->next].prev = r->prev;
    else
        s->qtail[p] = r->prev;
    r->prev = r->next = -1;
    s->qcount[p]--;
}

/* Inserts keeping the queue sorted by arrival order. New arrivals land at
 * the tail in O(1); a preempted request walks in from the front, where it
 * belongs (it is older than everything admitted after it). */
static void queue_insert(duet_sched *s, int i) {
    req *r = &s->reqs[i];
    int p = r->prio;
    int after = -1; /* insert after this record (-1 = at the front) */
    if (s->qtail[p] >= 0 && s->reqs[s->qtail[p]].order < r->order) {
        after = s->qtail[p];
    } else {
        for (int j = s->qhead[p]; j >= 0 && s->reqs[j].order < r->order; j = s->reqs[j].next)
            after = j;
    }
    r->prev = after;
    r->next = after >= 0 ? s->reqs[after].next : s->qhead[p];
    if (r->prev >= 0)
        s->reqs[r->prev].next = i;
    else
        s->qhead[p] = i;
    if (r->next >= 0)
        s->reqs[r->next].prev = i;
    else
        s->qtail[p] = i;
    s->qcount[p]++;
}

static int stream_len(const req *r) {
    return r->n_prompt + r->n_generated;
}

static void record_free(duet_sched *s, int i) {
    req *r = &s->reqs[i];
    memset(r, 0, sizeof *r);
    r->state = ST_FREE;
    r->slot = r->prev = -1;
    r->plan_index = -1;
    r->next = s->free_head;
    s->free_head = i;
}

static int find(const duet_sched *s, uint64_t id) {
    for (int i = 0; i < s->n_reqs; i++)
        if (s->reqs[i].state != ST_FREE && !s->reqs[i].cancelled && s->reqs[i].id == id) return i;
    return -1;
}

/* Gives back a running record's slot and KV blocks. */
static void drop_slot(duet_sched *s, int i) {
    req *r = &s->reqs[i];
    assert(r->state == ST_RUNNING && r->slot >= 0);
    duet__kv_blocks_release(s->kv, r->slot);
    s->slot_req[r->slot] = -1;
    r->slot = -1;
    s->n_running--;
}

/* ---- creation and knobs -------------------------------------------------- */

static duet_status check_knobs(const duet_sched_config *c, const duet_sched_knobs *k) {
    if (k->max_batch_seqs < 1 || k->max_batch_seqs > c->max_seqs)
        return duet__error(DUET_INVALID_ARGUMENT, "scheduler: max_batch_seqs %d not in [1, %d]",
                           k->max_batch_seqs, c->max_seqs);
    if (k->max_batch_tokens < 1 || k->max_batch_tokens > c->max_tokens)
        return duet__error(DUET_INVALID_ARGUMENT, "scheduler: max_batch_tokens %d not in [1, %d]",
                           k->max_batch_tokens, c->max_tokens);
    if (k->prefill_chunk < 1)
        return duet__error(DUET_INVALID_ARGUMENT, "scheduler: prefill_chunk %d must be >= 1",
                           k->prefill_chunk);
    if (k->max_waiting < 0 || k->max_waiting > c->max_waiting)
        return duet__error(DUET_INVALID_ARGUMENT, "scheduler: max_waiting %d not in [0, %d]", k->max_waiting,
                           c->max_waiting);
    if (k->batch_timeout_ns < 0)
        return duet__error(DUET_INVALID_ARGUMENT, "scheduler: batch_timeout must be >= 0");
    if (k->spec_max_batch < 0)
        return duet__error(DUET_INVALID_ARGUMENT, "scheduler: spec_max_batch %d must be >= 0",
                           k->spec_max_batch);
    if (k->step_budget_ns[0] < 0 || k->step_budget_ns[1] < 0)
        return duet__error(DUET_INVALID_ARGUMENT, "scheduler: step_budget must be >= 0");
    return DUET_OK;
}

duet_status duet__sched_new(const duet_sched_config *config, duet_sched **out) {
    *out = NULL;
    const duet_sched_config *c = config;
    if (c->max_seqs < 1 || c->max_tokens < 1 || c->max_waiting < 0 || c->n_ctx < 1 || c->kv_block_size < 1 ||
        c->kv_blocks < 1)
        return duet__error(DUET_INVALID_ARGUMENT,
                           "scheduler: bad capacities (max_seqs %d, max_tokens %d, max_waiting %d, n_ctx %d, "
                           "kv_block_size %d, kv_blocks %d)",
                           c->max_seqs, c->max_tokens, c->max_waiting, c->n_ctx, c->kv_block_size,
                           c->kv_blocks);
    if ((int64_t)c->max_waiting + c->max_seqs > INT32_MAX / 2)
        return duet__error(DUET_INVALID_ARGUMENT, "scheduler: max_waiting %d too large", c->max_waiting);
    duet_status st = check_knobs(c, &c->knobs);
    if (st != DUET_OK) return st;

    duet_sched *s = calloc(1, sizeof *s);
    if (!s) return duet__error(DUET_OUT_OF_MEMORY, "scheduler: out of memory");
    s->cfg = *c;
    s->knobs = c->knobs;
    int per_seq = (int)(((int64_t)c->n_ctx + c->kv_block_size - 1) / c->kv_block_size);
    st = duet__kv_blocks_new(c->kv_block_size, c->kv_blocks, c->max_seqs, per_seq, &s->kv);
    if (st != DUET_OK) {
        free(s);
        return st;
    }
    s->n_reqs = c->max_waiting + c->max_seqs;
    s->reqs = malloc((size_t)s->n_reqs * sizeof *s->reqs);
    s->slot_req = malloc((size_t)c->max_seqs * sizeof *s->slot_req);
    s->order = malloc((size_t)c->max_seqs * sizeof *s->order);
    s->seqs = calloc((size_t)c->max_seqs, sizeof *s->seqs);
    s->seq_req = malloc((size_t)c->max_seqs * sizeof *s->seq_req);
    s->preempted = malloc((size_t)c->max_seqs * sizeof *s->preempted);
    s->hits = malloc((size_t)per_seq * sizeof *s->hits);
    s->cands = malloc((size_t)c->max_seqs * sizeof *s->cands);
    s->cands_opt = malloc((size_t)c->max_seqs * sizeof *s->cands_opt);
    s->cand_req = malloc((size_t)c->max_seqs * sizeof *s->cand_req);
    if (!s->reqs || !s->slot_req || !s->order || !s->seqs || !s->seq_req || !s->preempted || !s->hits ||
        !s->cands || !s->cands_opt || !s->cand_req) {
        duet__sched_free(s);
        return duet__error(DUET_OUT_OF_MEMORY, "scheduler: out of memory for %d requests", c->max_waiting);
    }
    s->free_head = -1;
    for (int i = s->n_reqs - 1; i >= 0; i--)
        record_free(s, i);
    for (int i = 0; i < c->max_seqs; i++)
        s->slot_req[i] = -1;
    for (int p = 0; p < 2; p++)
        s->qhead[p] = s->qtail[p] = -1;
    *out = s;
    return DUET_OK;
}

void duet__sched_free(duet_sched *s) {
    if (!s) return;
    duet__kv_blocks_free(s->kv);
    free(s->reqs);
    free(s->slot_req);
    free(s->order);
    free(s->seqs);
    free(s->seq_req);
    free(s->preempted);
    free(s->hits);
    free(s->cands);
    free(s->cands_opt);
    free(s->cand_req);
    free(s);
}

duet_status duet__sched_set_knobs(duet_sched *s, const duet_sched_knobs *knobs) {
    duet_status st = check_knobs(&s->cfg, knobs);
    if (st == DUET_OK) s->knobs = *knobs;
    return st;
}

duet_sched_knobs duet__sched_knobs(const duet_sched *s) {
    return s->knobs;
}
duet_sched_config duet__sched_config(const duet_sched *s) {
    duet_sched_config c = s->cfg;
    c.knobs = s->knobs;
    return c;
}
const duet_kv_blocks *duet__sched_kv(const duet_sched *s) {
    return s->kv;
}
bool duet__sched_busy(const duet_sched *s) {
    return s->n_running > 0 || s->qcount[0] + s->qcount[1] > 0;
}

/* ---- events -------------------------------------------------------------- */

duet_sched_admit duet__sched_arrival(duet_sched *s, int64_t now, uint64_t id, int n_prompt, int max_new,
                                     duet_priority priority) {
    if (n_prompt < 1 || max_new < 1 ||
        (priority != DUET_PRIORITY_INTERACTIVE && priority != DUET_PRIORITY_BATCH) || find(s, id) >= 0) {
        s->st.rejected++;
        return DUET_SCHED_INVALID;
    }
    /* Conservative by one token (the last sampled token never enters the
     * cache), so "fits" has one meaning for the engine and the scheduler. */
    int64_t total = (int64_t)n_prompt + max_new;
    if (total > s->cfg.n_ctx || duet__kv_blocks_needed(s->kv, (int)total) > s->cfg.kv_blocks) {
        s->st.rejected++;
        return DUET_SCHED_TOO_LONG;
    }
    if (s->qcount[0] + s->qcount[1] >= s->knobs.max_waiting) {
        s->st.refused++;
        return DUET_SCHED_QUEUE_FULL;
    }
    int i = s->free_head;
    assert(i >= 0 && "request table sized for max_waiting + max_seqs");
    s->free_head = s->reqs[i].next;
    req *r = &s->reqs[i];
    r->id = id;
    r->order = s->next_order++;
    r->arrival = now;
    r->n_prompt = n_prompt;
    r->max_new = max_new;
    r->n_generated = r->n_computed = 0;
    r->prio = (int)priority;
    r->state = ST_WAITING;
    r->slot = -1;
    r->plan_index = -1;
    queue_insert(s, i);
    s->st.arrivals++;
    return DUET_SCHED_ADMITTED;
}

duet_status duet__sched_set_stream(duet_sched *s, uint64_t id, const int32_t *tokens, bool lookup) {
    int i = find(s, id);
    if (i < 0 || s->reqs[i].started)
        return duet__error(DUET_INVALID_ARGUMENT, "scheduler: request %llu is not waiting for its first step",
                           (unsigned long long)id);
    s->reqs[i].tokens = tokens;
    s->reqs[i].lookup = tokens && lookup;
    return DUET_OK;
}

void duet__sched_prefix_clear(duet_sched *s) {
    duet__kv_blocks_cache_clear(s->kv);
    for (int i = 0; i < s->n_reqs; i++)
        if (s->reqs[i].state == ST_RUNNING) s->reqs[i].n_reg = 0;
}

duet_status duet__sched_cancel(duet_sched *s, int64_t now, uint64_t id) {
    int i = find(s, id);
    if (i < 0)
        return duet__error(DUET_INVALID_ARGUMENT, "scheduler: no request %llu", (unsigned long long)id);
    req *r = &s->reqs[i];
    s->st.cancelled++;
    if (r->state == ST_WAITING) {
        queue_unlink(s, i);
        record_free(s, i);
    } else if (s->outstanding && r->plan_index >= 0) {
        r->cancelled = true; /* the device may still be writing its blocks */
    } else {
        drop_slot(s, i);
        record_free(s, i);
    }
    return DUET_OK;
}

/* A model with every coefficient finite and >= 0 into *dst; false otherwise. */
static bool copy_cost(duet_step_cost *dst, const duet_step_cost *m) {
    memset(dst, 0, sizeof *dst);
    bool ok = m != NULL;
    for (int j = 0; m && j < DUET_STEP_COST_TERMS; j++) {
        if (!(isfinite(m->coef[j]) && m->coef[j] >= 0)) ok = false; /* no guesses from a broken fit */
        dst->coef[j] = m->coef[j];
    }
    return ok;
}

bool duet__sched_spec_decision(const duet_sched *s, duet_spec_decision *out) {
    if (s->spec_last_valid) *out = s->spec_last;
    return s->spec_last_valid;
}

void duet__sched_set_cost(duet_sched *s, const duet_step_cost *m) {
    s->have_cost = copy_cost(&s->cost, m);
}

void duet__sched_set_draft_cost(duet_sched *s, const duet_step_cost *m) {
    s->have_draft_cost = copy_cost(&s->draft_cost, m);
}

void duet__sched_set_draft(duet_sched *s, uint64_t id, int n_draft, float alpha, int catchup) {
    int i = find(s, id);
    if (i < 0 || s->reqs[i].state != ST_RUNNING) return;
    req *r = &s->reqs[i];
    r->draft_offer = n_draft > 0 ? n_draft : 0;
    r->draft_alpha = alpha;
    r->draft_catchup = catchup;
}

/* ---- planning ------------------------------------------------------------ */

static void plan_remove(duet_sched *s, int i) {
    req *r = &s->reqs[i];
    int k = r->plan_index;
    s->budget += s->seqs[k].n_tokens;
    for (int j = k + 1; j < s->n_seqs; j++) {
        s->seqs[j - 1] = s->seqs[j];
        s->seq_req[j - 1] = s->seq_req[j];
        s->reqs[s->seq_req[j - 1]].plan_index = j - 1;
    }
    s->n_seqs--;
    r->plan_index = -1;
}

static void preempt(duet_sched *s, int i) {
    req *r = &s->reqs[i];
    if (r->plan_index >= 0) plan_remove(s, i);
    drop_slot(s, i);
    r->state = ST_WAITING;
    r->n_computed = r->n_hit = r->n_reg = 0;
    r->n_preempted++;
    r->preempt_epoch = s->epoch;
    r->draft_offer = 0;
    queue_insert(s, i);
    assert(s->n_preempted < s->cfg.max_seqs);
    s->preempted[s->n_preempted++] = r->id;
    s->st.preemptions++;
}

/* The lowest-ranked running record that ranks below `than` (NULL: any) and,
 * when strictly_lower_prio, has a lower priority class. -1 if none. */
static int pick_victim(const duet_sched *s, int n_order, const req *than, bool strictly_lower_prio) {
    for (int k = n_order - 1; k >= 0; k--) {
        const req *v = &s->reqs[s->order[k]];
        if (v->state != ST_RUNNING) continue;
        if (than && !ranks_before(than, v)) return -1; /* order[] is sorted: nothing lower remains */
        if (strictly_lower_prio && than && v->prio <= than->prio) return -1;
        return s->order[k];
    }
    return -1;
}

static void plan_add(duet_sched *s, int i, int n_tokens) {
    req *r = &s->reqs[i];
    int k = s->n_seqs++;
    assert(k < s->cfg.max_seqs);
    int len = stream_len(r);
    duet_sched_seq *e = &s->seqs[k];
    e->id = r->id;
    e->slot = r->slot;
    e->pos = r->n_computed;
    e->n_tokens = n_tokens;
    e->n_draft = 0;
    e->logits = r->n_computed + n_tokens == len;
    e->decode = r->n_generated > 0 && r->n_computed == len - 1;
    e->first_schedule = !r->started;
    e->resumed = r->n_preempted > 0 && r->n_computed == r->n_hit;
    e->n_prompt = r->n_prompt;
    e->n_generated = r->n_generated;
    s->seq_req[k] = i;
    r->plan_index = k;
    s->budget -= n_tokens;
}

/* Tokens of `want` that fit in seq's blocks plus the free list. */
static int fits(const duet_sched *s, const req *r, int want) {
    int bs = duet__kv_blocks_block_size(s->kv);
    int64_t room =
        (int64_t)(duet__kv_blocks_seq_blocks(s->kv, r->slot) + duet__kv_blocks_n_free(s->kv)) * bs -
        r->n_computed;
    return room < want ? (room > 0 ? (int)room : 0) : want;
}

/* Preempts victims ranked below record i (only lower-priority ones with
 * strictly_lower_prio) until `want` more tokens fit. */
static bool preempt_for(duet_sched *s, int i, int n_order, int want, bool strictly_lower_prio) {
    req *r = &s->reqs[i];
    while (!duet__kv_blocks_ensure(s->kv, r->slot, r->n_computed + want)) {
        int v = pick_victim(s, n_order, r, strictly_lower_prio);
        if (v < 0) return false;
        preempt(s, v);
    }
    return true;
}

/* A decode of running record i: grows its blocks by one token, preempting
 * lower-ranked sequences while the pool is short; when it ranks lowest it
 * yields its own blocks. Returns whether it can run. */
static bool grow_decode(duet_sched *s, int i, int n_order) {
    if (preempt_for(s, i, n_order, 1, false)) return true;
    preempt(s, i);
    return false;
}

/* A prompt chunk of running record i: the whole chunk if it fits after
 * preempting lower-priority work; else the part that fits; only when
 * nothing fits does it preempt younger work of its own class. Returns the
 * tokens granted (0: none this step). */
static int grow_chunk(duet_sched *s, int i, int n_order, int want) {
    req *r = &s->reqs[i];
    if (preempt_for(s, i, n_order, want, true)) return want;
    int fit = fits(s, r, want);
    if (fit == 0) fit = preempt_for(s, i, n_order, want, false) ? want : fits(s, r, want);
    if (fit > 0) {
        bool ok = duet__kv_blocks_ensure(s->kv, r->slot, r->n_computed + fit);
        assert(ok);
        (void)ok;
    }
    return fit;
}

static int min_int(int a, int b) {
    return a < b ? a : b;
}

/* ---- the time budget ------------------------------------------------------ */

/* Predicted seconds that prompt tokens [pos, pos + n) add to a step. */
static double chunk_cost(const duet_sched *s, int pos, int n) {
    duet_step_shape none = {0}, sh = {0};
    duet_step_shape_add(&sh, pos, n, false);
    return duet_step_cost_predict(&s->cost, &sh) - duet_step_cost_predict(&s->cost, &none);
}

/* Starts the budget of the step being planned, once its decodes (and
 * drafts) are placed: the tightest budget of their classes, less their
 * predicted time. Returns the budget (0: none applies). */
static int64_t time_start(duet_sched *s) {
    s->timed = s->chunked = s->cut = false;
    int64_t budget = 0;
    for (int k = 0; s->have_cost && k < s->n_seqs; k++) {
        int64_t b = s->knobs.step_budget_ns[s->reqs[s->seq_req[k]].prio];
        if (b > 0 && (budget == 0 || b < budget)) budget = b;
    }
    if (budget == 0) return 0;
    duet_step_shape sh = {0};
    for (int k = 0; k < s->n_seqs; k++)
        duet_step_shape_add(&sh, s->seqs[k].pos, s->seqs[k].n_tokens, true);
    s->timed = true;
    s->time_left = (double)budget * 1e-9 - duet_step_cost_predict(&s->cost, &sh) - s->draft_s;
    return budget;
}

/* The prompt tokens of `want` at stream position pos that the time left
 * allows: all without a budget; else the most that fit, when that is all
 * of them or at least the minimum chunk; the step's first chunk gets the
 * minimum chunk anyway (prefill always progresses); else none. */
static int time_fit(duet_sched *s, int pos, int want) {
    if (!s->timed || want <= 0 || chunk_cost(s, pos, want) <= s->time_left) return want;
    int lo = 0, hi = want; /* lo tokens fit, hi do not (cost grows with n) */
    while (hi - lo > 1) {
        int mid = lo + (hi - lo) / 2;
        if (chunk_cost(s, pos, mid) <= s->time_left)
            lo = mid;
        else
            hi = mid;
    }
    int min = want < DUET_SCHED_MIN_CHUNK ? want : DUET_SCHED_MIN_CHUNK;
    s->cut = true;
    if (lo >= min) return lo;
    return s->chunked ? 0 : min;
}

/* A chunk of n tokens at pos was placed: its time comes off the budget. */
static void time_spend(duet_sched *s, int pos, int n) {
    if (!s->timed || n <= 0) return;
    s->time_left -= chunk_cost(s, pos, n);
    s->chunked = true;
}

/* Blocks among the first n of s->hits that nobody references: sharing
 * them takes them out of the free count. */
static int unreferenced(const duet_sched *s, int n) {
    int k = 0;
    for (int j = 0; j < n; j++)
        k += duet__kv_blocks_refcount(s->kv, s->hits[j]) == 0;
    return k;
}

/* Registers the full blocks of running record i that its computed tokens
 * now cover, in stream order, so later streams with the same start share
 * them. */
static void register_blocks(duet_sched *s, req *r) {
    if (!r->tokens) return;
    int bs = duet__kv_blocks_block_size(s->kv);
    for (int full = r->n_computed / bs; r->n_reg < full; r->n_reg++) {
        const int32_t *t = r->tokens + (size_t)r->n_reg * bs;
        uint64_t h = duet__kv_hash_block(r->n_reg ? r->reg_hash : DUET_KV_HASH_SEED, t, bs);
        if (duet__kv_blocks_cache(s->kv, r->slot, r->n_reg, h, t) < 0) return; /* its parent is not cached */
        r->reg_hash = h;
    }
}

/* Whether the decision would grant drafts at this step if every candidate
 * kept all its drafts (alpha 1): only then can a refusal be wrong about
 * acceptance, and only then is an exploration worth its cost (with a draft
 * model, its passes and its KV's catch-up over the steps it missed). */
static bool pays_if_all_kept(duet_sched *s, const duet_step_shape *base, int n) {
    duet_spec_decision d;
    for (int i = 0; i < n; i++) {
        s->cands_opt[i] = s->cands[i];
        s->cands_opt[i].alpha = 1.0f;
    }
    duet__spec_decide(&s->cost, s->have_draft_cost ? &s->draft_cost : NULL, base, s->cands_opt, n, &d);
    return d.n_granted > 0;
}

/* Step 1b of a plan (the decodes are placed): the decodes with draft
 * offers are the candidates. With the hard cap exceeded nothing is
 * granted; with spec_measured and a step-cost model, duet__spec_decide
 * grants what pays; otherwise every offer. After DUET_SCHED_SPEC_EXPLORE
 * plans in a row whose offers the decision refused, one candidate (in turn)
 * gets its offer anyway, so its acceptance keeps being measured, where
 * better acceptance would have changed the decision (pays_if_all_kept). */
static void place_drafts(duet_sched *s, int n_order) {
    const int n_decodes = s->n_seqs;
    int n = 0, offered = 0;
    duet_step_shape base = {0};
    for (int k = 0; k < s->n_seqs; k++)
        duet_step_shape_add(&base, s->seqs[k].pos, s->seqs[k].n_tokens, true);
    for (int k = 0; k < n_order; k++) {
        req *r = &s->reqs[s->order[k]];
        if (r->state != ST_RUNNING || r->plan_index < 0 || r->draft_offer <= 0) continue;
        duet_spec_cand *c = &s->cands[n];
        *c = (duet_spec_cand){.pos = s->seqs[r->plan_index].pos,
                              .offer = r->draft_offer,
                              .alpha = r->draft_alpha,
                              .catchup = min_int(r->draft_catchup, DUET_SCHED_SPEC_STEADY_CATCHUP),
                              .backlog = r->draft_catchup -
                                         min_int(r->draft_catchup, DUET_SCHED_SPEC_STEADY_CATCHUP),
                              .remaining = r->max_new - r->n_generated,
                              .k = r->draft_offer};
        offered += r->draft_offer;
        s->cand_req[n++] = s->order[k];
        r->draft_offer = 0;
    }
    s->draft_s = 0;
    if (n == 0) return;
    s->st.spec_offered += (uint64_t)offered;
    if (n_decodes > s->knobs.spec_max_batch) {
        s->st.spec_throttled += (uint64_t)offered;
        s->st.spec_capped += (uint64_t)offered;
        s->st.spec_steps[DUET_SPEC_STEP_CAPPED]++;
        return;
    }
    int kind = DUET_SPEC_STEP_ALWAYS;
    if (s->knobs.spec_measured && s->have_cost) {
        duet__spec_decide(&s->cost, s->have_draft_cost ? &s->draft_cost : NULL, &base, s->cands, n,
                          &s->spec_last);
        s->spec_last_valid = true;
        kind = s->spec_last.n_granted > 0 ? DUET_SPEC_STEP_DRAFT : DUET_SPEC_STEP_PLAIN;
        if (kind == DUET_SPEC_STEP_PLAIN && ++s->spec_refused_run >= DUET_SCHED_SPEC_EXPLORE &&
            pays_if_all_kept(s, &base, n)) {
            duet_spec_cand *c = &s->cands[s->spec_explore++ % n];
            c->k = c->offer;
            kind = DUET_SPEC_STEP_EXPLORE;
        }
        if (s->spec_refused_run >= DUET_SCHED_SPEC_EXPLORE) s->spec_refused_run = 0;
        if (kind != DUET_SPEC_STEP_PLAIN) s->spec_refused_run = 0;
        s->draft_s = s->spec_last.draft_seconds; /* 0 but for DRAFT: an exploration is not budgeted */
    }
    s->st.spec_steps[kind]++;
    for (int j = 0; j < n; j++) {
        req *r = &s->reqs[s->cand_req[j]];
        int grant = s->cands[j].k;
        s->st.spec_throttled += (uint64_t)(s->cands[j].offer - grant);
        int want = min_int(min_int(grant, s->budget), r->max_new - r->n_generated - 1);
        if (want > 0) want = fits(s, r, 1 + want) - 1;
        if (want <= 0) continue;
        bool ok = duet__kv_blocks_ensure(s->kv, r->slot, r->n_computed + 1 + want);
        assert(ok);
        (void)ok;
        duet_sched_seq *e = &s->seqs[r->plan_index];
        e->n_tokens += want;
        e->n_draft = want;
        s->budget -= want;
        s->st.spec_granted += (uint64_t)want;
    }
}

duet_sched_action duet__sched_plan(duet_sched *s, int64_t now, duet_sched_plan *plan) {
    assert(!s->outstanding && "plan called with a step outstanding");
    memset(plan, 0, sizeof *plan);
    s->n_seqs = 0;
    s->n_preempted = 0;
    plan->seqs = s->seqs;
    plan->preempted = s->preempted;
    int n_waiting = s->qcount[0] + s->qcount[1];
    if (s->n_running == 0 && n_waiting == 0) return DUET_SCHED_IDLE;

    if (s->n_running == 0 && n_waiting < s->knobs.max_batch_seqs) {
        /* Idle engine: let a batch gather for batch_timeout after the oldest
         * arrival (queues are sorted, so the heads are the oldest). */
        int64_t oldest = INT64_MAX;
        for (int p = 0; p < 2; p++)
            if (s->qhead[p] >= 0 && s->reqs[s->qhead[p]].arrival < oldest)
                oldest = s->reqs[s->qhead[p]].arrival;
        int64_t start =
            oldest > INT64_MAX - s->knobs.batch_timeout_ns ? INT64_MAX : oldest + s->knobs.batch_timeout_ns;
        if (now < start) {
            plan->wake_at = start;
            return DUET_SCHED_WAIT;
        }
    }

    s->epoch++;
    s->budget = s->knobs.max_batch_tokens;

    /* Running records by rank (insertion sort: max_seqs is small). */
    int n_order = 0;
    for (int slot = 0; slot < s->cfg.max_seqs; slot++) {
        int i = s->slot_req[slot];
        if (i < 0) continue;
        int k = n_order++;
        while (k > 0 && ranks_before(&s->reqs[i], &s->reqs[s->order[k - 1]])) {
            s->order[k] = s->order[k - 1];
            k--;
        }
        s->order[k] = i;
    }

    /* 1. Decodes, best rank first, so running streams keep flowing. */
    for (int k = 0; k < n_order && s->budget > 0; k++) {
        int i = s->order[k];
        req *r = &s->reqs[i];
        if (r->state != ST_RUNNING || r->plan_index >= 0) continue;
        if (!(r->n_generated > 0 && r->n_computed == stream_len(r) - 1)) continue;
        if (grow_decode(s, i, n_order)) plan_add(s, i, 1);
    }
    /* 1b. Drafts: decodes with an offer grow by what the decision grants,
     *     best rank first, in the budget and the free blocks (no
     *     preemption for a guess). */
    place_drafts(s, n_order);
    /* The time budget of a step with decodes. */
    const int64_t step_budget = time_start(s);
    /* 2. Prompt chunks of running sequences still prefilling. */
    for (int k = 0; k < n_order && s->budget > 0; k++) {
        int i = s->order[k];
        req *r = &s->reqs[i];
        if (r->state != ST_RUNNING || r->plan_index >= 0) continue;
        int pos = r->n_computed;
        int want = min_int(min_int(stream_len(r) - pos, s->knobs.prefill_chunk), s->budget);
        want = time_fit(s, pos, want);
        if (want <= 0) continue;
        int got = grow_chunk(s, i, n_order, want);
        if (got > 0) {
            plan_add(s, i, got);
            time_spend(s, pos, got);
        }
    }
    /* 3. Admissions: interactive, then batch; FIFO; stop at the first that
     *    does not fit so nobody is overtaken. */
    for (int p = 0; p < 2; p++) {
        while (s->qhead[p] >= 0 && s->budget > 0 && s->n_running < s->knobs.max_batch_seqs) {
            int i = s->qhead[p];
            req *r = &s->reqs[i];
            if (r->preempt_epoch == s->epoch && r->n_preempted > 0) goto admitted_all;
            /* Cached blocks of the stream's start are shared, not computed;
             * at least the last token is, so that its logits exist. */
            int len = stream_len(r), n_hit = 0;
            uint64_t hit_hash = 0;
            if (r->lookup)
                n_hit = duet__kv_blocks_lookup(s->kv, r->tokens, len - 1,
                                               duet__kv_blocks_max_blocks_per_seq(s->kv), s->hits, &hit_hash);
            /* Its first chunk, if the time budget leaves room for one. */
            int pos = n_hit * duet__kv_blocks_block_size(s->kv);
            int want = time_fit(s, pos, min_int(min_int(len - pos, s->knobs.prefill_chunk), s->budget));
            if (want <= 0) goto admitted_all;
            int need = duet__kv_blocks_needed(s->kv, len) - n_hit;
            while (duet__kv_blocks_n_free(s->kv) - unreferenced(s, n_hit) < need) {
                int v = pick_victim(s, n_order, r, true);
                if (v < 0) goto admitted_all;
                preempt(s, v);
            }
            int slot = 0;
            while (s->slot_req[slot] >= 0)
                slot++;
            assert(slot < s->knobs.max_batch_seqs);
            queue_unlink(s, i);
            r->state = ST_RUNNING;
            r->slot = slot;
            s->slot_req[slot] = i;
            s->n_running++;
            for (int k = 0; k < n_hit; k++) {
                bool shared = duet__kv_blocks_append_shared(s->kv, slot, s->hits[k]);
                assert(shared);
                (void)shared;
            }
            r->n_computed = r->n_hit = n_hit * duet__kv_blocks_block_size(s->kv);
            r->n_reg = n_hit;
            r->reg_hash = hit_hash;
            if (r->lookup) {
                s->st.prefix_queries += (uint64_t)len;
                s->st.prefix_hits += (uint64_t)r->n_hit;
            }
            assert(r->n_computed == pos);
            bool ok = duet__kv_blocks_ensure(s->kv, slot, r->n_computed + want);
            assert(ok);
            (void)ok;
            plan_add(s, i, want);
            time_spend(s, pos, want);
        }
    }
admitted_all:
    /* Some work always fits: the best-ranked running sequence may preempt all
     * others, and a lone request fits the pool by the arrival check. */
    assert(s->n_seqs > 0 && "busy scheduler planned an empty step");
    /* Decodes first. A refund from a preempted entry can let a decode in
     * after the chunks; move it forward (stable, n is small). */
    for (int k = 1; k < s->n_seqs; k++) {
        if (!s->seqs[k].decode) continue;
        duet_sched_seq e = s->seqs[k];
        int ri = s->seq_req[k], j = k;
        while (j > 0 && !s->seqs[j - 1].decode) {
            s->seqs[j] = s->seqs[j - 1];
            s->seq_req[j] = s->seq_req[j - 1];
            s->reqs[s->seq_req[j]].plan_index = j;
            j--;
        }
        s->seqs[j] = e;
        s->seq_req[j] = ri;
        s->reqs[ri].plan_index = j;
    }
    duet_step_shape shape = {0};
    for (int k = 0; k < s->n_seqs; k++) {
        duet_sched_seq *e = &s->seqs[k];
        req *r = &s->reqs[s->seq_req[k]];
        duet_step_shape_add(&shape, e->pos, e->n_tokens, e->decode);
        e->blocks = duet__kv_blocks_table(s->kv, e->slot, &e->n_blocks);
        plan->n_tokens += e->n_tokens;
        plan->n_logits += e->logits ? 1 + e->n_draft : 0;
        plan->n_draft += e->n_draft;
        r->started = true;
    }
    for (int k = 0; k < n_order; k++) /* offers last one plan */
        s->reqs[s->order[k]].draft_offer = 0;
    if (s->have_cost) plan->predicted_s = duet_step_cost_predict(&s->cost, &shape) + s->draft_s;
    if (s->timed) {
        plan->budget_ns = step_budget;
        s->st.budget_cut += s->cut;
        s->st.budget_over += plan->predicted_s > (double)step_budget * 1e-9 * (1 + 1e-9);
    }
    plan->n_seqs = s->n_seqs;
    plan->n_preempted = s->n_preempted;
    s->outstanding = true;
    s->st.steps++;
    s->st.step_tokens += (uint64_t)plan->n_tokens;
    return DUET_SCHED_STEP;
}

static void end_step(duet_sched *s) {
    for (int k = 0; k < s->n_seqs; k++) {
        int i = s->seq_req[k];
        req *r = &s->reqs[i];
        r->plan_index = -1;
        if (r->cancelled) {
            drop_slot(s, i);
            record_free(s, i);
        }
    }
    s->n_seqs = 0;
    s->outstanding = false;
}

duet_status duet__sched_step_done(duet_sched *s, int64_t now, const duet_sched_result *results, int n) {
    if (!s->outstanding) return duet__error(DUET_INVALID_ARGUMENT, "scheduler: step_done without a step");
    if (n != s->n_seqs)
        return duet__error(DUET_INVALID_ARGUMENT, "scheduler: step_done with %d results for %d sequences", n,
                           s->n_seqs);
    for (int k = 0; k < n; k++) {
        const duet_sched_seq *e = &s->seqs[k];
        const req *r = &s->reqs[s->seq_req[k]];
        const duet_sched_result *res = &results[k];
        if (res->id != e->id)
            return duet__error(DUET_INVALID_ARGUMENT, "scheduler: result %d is for request %llu, not %llu", k,
                               (unsigned long long)res->id, (unsigned long long)e->id);
        if (r->cancelled) continue;
        if (e->n_draft > 0 && (res->n_generated < 1 || res->n_generated > 1 + e->n_draft))
            return duet__error(DUET_INVALID_ARGUMENT,
                               "scheduler: request %llu generated %d tokens in a step with %d draft tokens",
                               (unsigned long long)e->id, res->n_generated, e->n_draft);
        if (e->n_draft == 0 && res->n_generated != (e->logits ? 1 : 0))
            return duet__error(DUET_INVALID_ARGUMENT,
                               "scheduler: request %llu generated %d tokens in a step %s logits",
                               (unsigned long long)e->id, res->n_generated, e->logits ? "with" : "without");
        if (r->n_generated + res->n_generated >= r->max_new && !res->finished)
            return duet__error(DUET_INVALID_ARGUMENT,
                               "scheduler: request %llu reached max_new %d but did not finish",
                               (unsigned long long)e->id, r->max_new);
    }
    for (int k = 0; k < n; k++) {
        req *r = &s->reqs[s->seq_req[k]];
        if (r->cancelled) continue;
        const duet_sched_seq *e = &s->seqs[k];
        if (e->n_draft > 0) {
            /* The newest token and the kept drafts are in the cache; the
             * rejected drafts' positions roll back. */
            r->n_computed += results[k].n_generated;
            duet__kv_blocks_truncate(s->kv, r->slot, r->n_computed);
        } else {
            r->n_computed += e->n_tokens;
        }
        r->n_generated += results[k].n_generated;
        register_blocks(s, r);
        if (results[k].finished) {
            r->cancelled = true; /* leaves through end_step, like a cancel */
            s->st.finished++;
        }
    }
    end_step(s);
    return DUET_OK;
}

void duet__sched_step_failed(duet_sched *s, int64_t now) {
    assert(s->outstanding && "step_failed without a step");
    /* Nothing advances; the drafts' blocks go back. */
    for (int k = 0; k < s->n_seqs; k++) {
        const req *r = &s->reqs[s->seq_req[k]];
        if (s->seqs[k].n_draft > 0 && !r->cancelled) duet__kv_blocks_truncate(s->kv, r->slot, r->n_computed);
    }
    end_step(s);
}

/* ---- observation ----------------------------------------------------------- */

void duet__sched_stats(const duet_sched *s, duet_sched_stats *out) {
    *out = s->st;
    out->waiting[0] = s->qcount[0];
    out->waiting[1] = s->qcount[1];
    out->running[0] = out->running[1] = 0;
    out->prefilling = 0;
    for (int slot = 0; slot < s->cfg.max_seqs; slot++) {
        int i = s->slot_req[slot];
        if (i < 0 || s->reqs[i].cancelled) continue;
        const req *r = &s->reqs[i];
        out->running[r->prio]++;
        if (r->n_generated == 0 || r->n_computed < stream_len(r) - 1) out->prefilling++;
    }
    out->kv_blocks_total = s->cfg.kv_blocks;
    out->kv_blocks_used = s->cfg.kv_blocks - duet__kv_blocks_n_free(s->kv);
    out->kv_usage = duet__kv_blocks_usage(s->kv);
    out->kv_blocks_cached = duet__kv_blocks_n_cached(s->kv);
    out->prefix_evictions = duet__kv_blocks_evictions(s->kv);
}

#define CHECK(cond, ...)                                                                                     \
    do {                                                                                                     \
        if (!(cond)) return duet__error(DUET_INVALID_ARGUMENT, __VA_ARGS__);                                 \
    } while (0)

duet_status duet__sched_check(const duet_sched *s) {
    duet_status st = duet__kv_blocks_check(s->kv, NULL);
    if (st != DUET_OK) return st;
    int n_free = 0, n_wait = 0, n_run = 0;
    for (int j = s->free_head; j >= 0; j = s->reqs[j].next) {
        CHECK(s->reqs[j].state == ST_FREE, "sched check: record %d on the free list is in use", j);
        CHECK(++n_free <= s->n_reqs, "sched check: free list loops");
    }
    for (int i = 0; i < s->n_reqs; i++) {
        const req *r = &s->reqs[i];
        if (r->state == ST_FREE) continue;
        CHECK(r->n_generated >= 0 && r->n_generated <= r->max_new,
              "sched check: request %llu generated %d of %d", (unsigned long long)r->id, r->n_generated,
              r->max_new);
        CHECK(r->n_computed >= 0 && r->n_computed <= stream_len(r),
              "sched check: request %llu computed %d of %d", (unsigned long long)r->id, r->n_computed,
              stream_len(r));
        if (r->state == ST_WAITING) {
            n_wait++;
            CHECK(r->slot == -1 && r->n_computed == 0 && r->n_hit == 0 && r->n_reg == 0 &&
                      r->plan_index == -1 && !r->cancelled,
                  "sched check: waiting request %llu holds running state", (unsigned long long)r->id);
        } else {
            n_run++;
            CHECK(r->slot >= 0 && r->slot < s->cfg.max_seqs && s->slot_req[r->slot] == i,
                  "sched check: running request %llu has slot %d not mapped back", (unsigned long long)r->id,
                  r->slot);
            int blocks = duet__kv_blocks_seq_blocks(s->kv, r->slot);
            /* A step in flight also holds its draft tokens' blocks. */
            int drafts = s->outstanding && r->plan_index >= 0 ? s->seqs[r->plan_index].n_draft : 0;
            CHECK(blocks >= duet__kv_blocks_needed(s->kv, r->n_computed) &&
                      blocks <= duet__kv_blocks_needed(s->kv, stream_len(r) + drafts),
                  "sched check: request %llu holds %d blocks for %d computed of %d",
                  (unsigned long long)r->id, blocks, r->n_computed, stream_len(r));
            CHECK(r->n_hit <= r->n_computed && r->n_hit < stream_len(r) &&
                      (int64_t)r->n_reg * duet__kv_blocks_block_size(s->kv) <= r->n_computed,
                  "sched check: request %llu: %d cached, %d blocks registered, %d computed of %d",
                  (unsigned long long)r->id, r->n_hit, r->n_reg, r->n_computed, stream_len(r));
            for (int k = 0; r->tokens && k < r->n_reg; k++)
                CHECK(duet__kv_blocks_is_cached(s->kv, duet__kv_blocks_table(s->kv, r->slot, NULL)[k]),
                      "sched check: request %llu: registered block %d is not cached",
                      (unsigned long long)r->id, k);
            CHECK(s->outstanding || (r->n_computed < stream_len(r) && r->plan_index == -1 && !r->cancelled),
                  "sched check: idle running request %llu has nothing to do", (unsigned long long)r->id);
            CHECK(!s->outstanding || r->plan_index < 0 || s->seq_req[r->plan_index] == i,
                  "sched check: request %llu plan index broken", (unsigned long long)r->id);
        }
    }
    CHECK(n_free + n_wait + n_run == s->n_reqs, "sched check: %d free + %d waiting + %d running != %d",
          n_free, n_wait, n_run, s->n_reqs);
    CHECK(n_run == s->n_running, "sched check: %d running records but n_running %d", n_run, s->n_running);
    int in_queues = 0;
    for (int p = 0; p < 2; p++) {
        int count = 0, prev = -1;
        for (int j = s->qhead[p]; j >= 0; j = s->reqs[j].next) {
            const req *r = &s->reqs[j];
            CHECK(r->state == ST_WAITING && r->prio == p && r->prev == prev,
                  "sched check: queue %d broken at request %llu", p, (unsigned long long)r->id);
            CHECK(prev < 0 || s->reqs[prev].order < r->order,
                  "sched check: queue %d out of arrival order at %llu", p, (unsigned long long)r->id);
            CHECK(++count <= s->n_reqs, "sched check: queue %d loops", p);
            prev = j;
        }
        CHECK(prev == s->qtail[p] && count == s->qcount[p], "sched check: queue %d count %d, tail mismatch",
              p, s->qcount[p]);
        in_queues += count;
    }
    CHECK(in_queues == n_wait, "sched check: %d waiting records but %d queued", n_wait, in_queues);
    for (int slot = 0; slot < s->cfg.max_seqs; slot++) {
        if (s->slot_req[slot] >= 0) continue;
        CHECK(duet__kv_blocks_seq_blocks(s->kv, slot) == 0, "sched check: free slot %d holds blocks", slot);
    }
    return DUET_OK;
}
