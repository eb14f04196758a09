/* engine.c — one model instance serving many requests: an engine thread
 * drives the continuous-batching scheduler (core/scheduler.c) with the real
 * clock and runs each planned step as one batched forward pass.
 *
 * Locking: one mutex guards the scheduler, the request table and the
 * cancel list. The engine thread holds it only to plan and to report a
 * step; the forward pass, sampling and every user callback run unlocked,
 * so submit/cancel from other threads never wait for the device and a
 * callback may call duet_engine_cancel.
 *
 * Lifetimes: the engine holds a reference to its model (the file, the
 * tokenizer and the weights on the device), which other engines may share
 * (duet_engine_start_model); its run state (activations and KV pool), its
 * scheduler, its thread and its stream on the model's device (a queue of
 * its own: duet_backend_stream_open) are its own, so engines sharing a
 * model run their steps at once; on a backend without streams they take
 * turns on the model's backend (duet__run_forward holds device_mu).
 *
 * Faults: a step that fails (an op, submit, wait or allocation error) fails
 * its own requests and the engine serves on. DUET_DEVICE_LOST is different:
 * nothing that device holds can be trusted, so every request in flight fails
 * and the engine refuses new ones, unhealthy, until it is stopped.
 */
#include <errno.h>
#include <stdatomic.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "controller.h"
#include "duet_internal.h"
#include "engine_config.h"
#include "metrics.h"
#include "sampler.h"
#include "scheduler.h"
#include "speculative.h"
#include "step_cost.h"
#include "stop_strings.h"

/* Request ids carry their table index in the low bits: O(1) look-up. */
#define ID_INDEX_BITS 20
#define ID_INDEX(id) ((int)((id) & ((1u << ID_INDEX_BITS) - 1)))
#define ENGINE_ERR_SIZE 1024
#define ENGINE_DRAFT_PASSES (2 * DUET_SPEC_MAX_K)

typedef struct engine_req {
    uint64_t id;     /* 0 when the entry is free */
    int32_t *stream; /* prompt then generated tokens [n_ctx] */
    int n_prompt, n_gen, max_tokens;
    bool ignore_eos;
    duet_priority prio;
    duet_sampler *smp;
    duet_detok detok;
    duet_event_fn fn;
    void *user;
    int64_t t_arrival, t_first_sched, t_first_token, t_last_token;
    _Atomic bool cancelled; /* DONE(CANCELLED) is owed; read unlocked during a step */
    duet_finish finish;     /* set under the lock when the engine decides it is done */
    /* Stop strings (one allocation with their text) and the text held back
     * because it may begin one (sized at submit: never grows in a step). */
    char **stops;
    int n_stops;
    char *pend;
    size_t pend_len;
    bool stop_hit; /* the text reached a stop string: nothing more is delivered */
    /* Logprobs: asked for (top_n >= 0), prompt positions still to report
     * (from prompt_lp_next), and the current token's, for its TOKEN event. */
    int top_n;
    bool prompt_lp;
    int prompt_lp_next;
    bool lp_valid;
    float lp;
    duet_token_logprob top[DUET_MAX_TOP_LOGPROBS];
    /* Speculative decoding: whether this request is speculated (the engine
     * speculates and it has no grammar); the drafts offered for the next
     * step (written under the lock before a plan, read in the step);
     * during a step, whether verification stopped (a draft was rejected or
     * the request finished: later rows are discarded) and how many drafts
     * it kept; adaptive k; the request's totals. */
    bool spec;
    int32_t draft[DUET_SPEC_MAX_K];
    bool spec_stop;
    int spec_kept;
    duet_spec_adapt adapt;
    int spec_steps, spec_drafted, spec_accepted;
    /* With a draft model: the stream tokens its KV holds (after an
     * admission, those of the shared cached blocks it holds too; it catches
     * up when the request next drafts, so steps without drafts cost it
     * nothing), the full blocks of them marked in e->dkey and the chain
     * hash of the last, its sampler (NULL: greedy, drafts are the argmax),
     * and in a step, the request's slot in the engine's q rows (-1: none,
     * q one-hot) and each row's size. */
    int dlen, dblocks;
    uint64_t dhash;
    duet_sampler *dsmp;
    int qslot;
    int q_n[DUET_SPEC_MAX_K];
} engine_req;

struct duet_engine {
    int seq_capacity;  /* tokens (prompt + generated) one request can ever hold */
    duet_model *model; /* shared, one reference held (none when borrowed) */
    bool borrowed;     /* the model's own instance (duet__engine_start_borrowed): it owns us */
    /* This instance's queue on the model's device (NULL: the backend has
     * no streams; the runs then use the model's backend, under its lock). */
    duet_backend *stream;
    duet_run run; /* this instance's activations and KV pool, on its stream */
    duet_sched *sched;
    duet_metrics *metrics;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool stopping, drain, thread_started;
    bool prefix_cache; /* requests share cached KV blocks of their prompts */
    /* The adaptive controller: runs when some latency target is set, once
     * per window, on the engine thread, under mu. */
    duet_ctl ctl;
    bool ctl_on;
    int64_t ctl_window_ns, ctl_next;
    /* Stall-free steps: a step with decodes of a class may take this share
     * of the class's ITL target, as the step-cost model predicts it (the
     * scheduler's step_budget_ns; the controller retunes the share). */
    double budget_share;
    double slo_itl_s[2];

    engine_req *reqs; /* [cap] */
    int cap;
    uint64_t next_seq;
    uint64_t *cancel_list; /* ids owed a DONE(CANCELLED) event */
    int n_cancel;

    /* Step scratch, sized once (max_tokens / max_seqs). */
    duet_sched_seq *plan_seqs;
    int32_t *tok, *pos, *seq, *out;
    int32_t *row_of;   /* [max_tokens] the plan entry of each batch token */
    bool *want;        /* [max_tokens] the token's logits are wanted */
    float *raw;        /* [n_vocab] a row's logits before sampling changes them (logprobs) */
    duet_vocab *vocab; /* token bytes for grammars, built at the first one (under mu) */
    int32_t *tables;   /* [max_seqs][max_blocks] this step's KV block tables */
    int max_blocks;
    duet_sched_result *results;
    duet_finish *step_finish; /* [max_seqs] what the step decided; published under the lock */
    int max_tokens, max_seqs;
    char *text;         /* [model->detok_size] a token's text, for the engine thread */
    char *err;          /* message of a failed step [ENGINE_ERR_SIZE] */
    duet_status err_st; /* and its status */
    /* Set once, under the lock, when the device is lost: "device lost: <message>". */
    bool lost;
    char lost_why[ENGINE_ERR_SIZE];
    /* Speculative decoding (open.spec or open.draft): drafts of up to
     * spec_k tokens; the verifier's scratch belongs to the engine thread. */
    bool spec;
    int spec_k;
    duet_spec_verifier *verifier;
    /* Acceptance over every sequence's drafts (engine thread): the prior of
     * a sequence that has not drafted yet, instead of 0.5. */
    duet_spec_adapt spec_pool;
    /* A draft model (open.draft; one reference held) on the model's device,
     * with a run state of the same KV geometry: a sequence's block table
     * addresses its blocks in both pools, so the scheduler's allocation
     * (growth, rollback, freeing at finish, cancel and preemption) serves
     * both. Its step scratch: tokens, positions, slots, wanted rows and the
     * plan entry of each row; q rows [q_slots][spec_k][n_vocab] for the
     * sampled requests of a step (greedy ones need none). */
    duet_model *draft;
    duet_run drun;
    int32_t *dtok, *dpos, *dseq, *dout, *drow;
    int32_t *q_ids;
    float *q_probs;
    int q_slots;
    /* Per KV block, the chain hash (kv_blocks.h) of the stream whose draft
     * KV it holds in full (0: none): a request that shares cached blocks of
     * the target's pool shares the draft's too where these match. */
    uint64_t *dkey;
    /* The step-cost model fitted online from the steps run (under mu), and
     * the last step's time (written by run_step). */
    duet_step_cost_online cost;
    double step_s;
    /* Whether a profile seeded the model (cost.prior), and the served
     * steps' seconds since: measured, and as it predicted them. */
    bool cost_seeded;
    duet_served_speed served;            /* against the seeding profile (cost_seeded) */
    FILE *step_log;                      /* params.step_log's CSV, or NULL */
    int64_t t_start, t_step, t_step_end; /* the engine's start; the last step's start and end (ns) */
    /* The kinds of step (WARM_*) run once already: a kind's first run
     * (kernel builds, first touches: 178 ms for a 56-token chunk on PoCL,
     * where the 48-token chunks after it took 2-3 ms) is not learnt. In the fit it outweighed hundreds
     * of 0.6 ms decode steps and left a decode predicted at 0 s (the
     * speculation decision then had no model). duet_engine_warm runs every
     * kind. */
    unsigned warm_kinds;
    /* With a draft model: its own step-cost model, fitted from each of its
     * forward passes (the speculation decision weighs them), and the
     * seconds the last step spent in them (not part of the target's fit). */
    duet_step_cost_online dcost;
    double draft_s;
    /* The last step's draft passes (their shapes and seconds, the first
     * ENGINE_DRAFT_PASSES of them), for the draft's fit under the lock. */
    duet_step_shape dpass[ENGINE_DRAFT_PASSES];
    double dpass_s[ENGINE_DRAFT_PASSES];
    int n_dpass;
    char name[256]; /* the metrics' model_name */
};

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static double secs(int64_t ns) {
    return (double)ns * 1e-9;
}

duet_engine_params duet_engine_params_default(void) {
    return (duet_engine_params){.open = duet_open_params_default(),
                                .max_batch_seqs = 16,
                                .max_batch_tokens = 256,
                                .batch_timeout_ms = 2.0,
                                .prefill_chunk = 128,
                                .max_waiting = 256,
                                .kv_block_size = 16};
}

int duet_engine_max_sequence_tokens(const duet_engine *e) {
    return e->seq_capacity;
}

const duet_model *duet_engine_model(const duet_engine *e) {
    return e->model;
}

static engine_req *find_req(duet_engine *e, uint64_t id) {
    int i = ID_INDEX(id);
    return i < e->cap && e->reqs[i].id == id && id ? &e->reqs[i] : NULL;
}

static void release_req(engine_req *r) {
    duet_sampler_free(r->smp);
    duet_sampler_free(r->dsmp);
    r->smp = r->dsmp = NULL;
    free(r->stops);
    free(r->pend);
    r->stops = NULL, r->pend = NULL;
    r->n_stops = 0, r->pend_len = 0;
    r->id = 0;
}

/* ---- events (always called without the lock) ------------------------------ */

static void emit_token(engine_req *r, int32_t token, const char *text, size_t len) {
    duet_event ev = {
        .kind = DUET_EVENT_TOKEN, .request_id = r->id, .token = token, .text = text, .text_len = len};
    if (token >= 0 && r->lp_valid) {
        ev.has_logprob = true;
        ev.logprob = r->lp;
        ev.n_top = r->top_n;
        ev.top = r->top;
        r->lp_valid = false;
    }
    r->fn(&ev, r->user);
}

/* Delivers a token's text; with stop strings, holds back what may begin
 * one and cuts the text before the first one found. True on a stop string
 * (the request ends there). */
static bool deliver(engine_req *r, int32_t token, const char *text, size_t len) {
    if (!r->n_stops) {
        emit_token(r, token, text, len);
        return false;
    }
    memcpy(r->pend + r->pend_len, text, len);
    r->pend_len += len;
    bool hit;
    size_t safe = duet__stop_scan(r->pend, r->pend_len, (const char *const *)r->stops, r->n_stops, &hit);
    emit_token(r, token, r->pend, safe);
    if (hit) {
        r->stop_hit = true;
        r->pend_len = 0;
        return true;
    }
    memmove(r->pend, r->pend + safe, r->pend_len - safe);
    r->pend_len -= safe;
    return false;
}

static void emit_done(duet_engine *e, engine_req *r, duet_finish finish, const char *message) {
    int64_t now = now_ns();
    /* An unfinished UTF-8 character at the end is delivered as U+FFFD; the
     * text held back for the stop strings goes out unless one was hit. */
    char tail[16];
    int n = finish != DUET_FINISH_ERROR && !r->stop_hit ? duet_detok_flush(&r->detok, tail, sizeof tail) : 0;
    /* A stop string completed by the tail ends a request that ran to its length as STOP. */
    if (n > 0 && deliver(r, -1, tail, (size_t)n) && finish == DUET_FINISH_LENGTH) finish = DUET_FINISH_STOP;
    if (!r->stop_hit && r->pend_len) emit_token(r, -1, r->pend, r->pend_len);
    r->pend_len = 0;
    duet_event ev = {.kind = DUET_EVENT_DONE,
                     .request_id = r->id,
                     .token = -1,
                     .finish = finish,
                     .message = message,
                     .status = finish == DUET_FINISH_ERROR ? e->err_st : DUET_OK,
                     .prompt_tokens = r->n_prompt,
                     .generated_tokens = r->n_gen,
                     .spec_drafts = r->spec_steps,
                     .spec_draft_tokens = r->spec_drafted,
                     .spec_accepted_tokens = r->spec_accepted};
    int64_t first = r->t_first_sched ? r->t_first_sched : now;
    ev.queue_seconds = secs(first - r->t_arrival);
    ev.ttft_seconds = r->t_first_token ? secs(r->t_first_token - r->t_arrival) : 0;
    ev.total_seconds = secs(now - r->t_arrival);
    duet__metrics_request_done(e->metrics, r->prio, finish, ev.total_seconds, ev.ttft_seconds,
                               ev.queue_seconds, r->n_prompt, r->n_gen);
    r->fn(&ev, r->user);
}

/* ---- submit / cancel (any thread) ----------------------------------------- */

/* The vocabulary as grammars see it (built once, at the first grammar): each
 * token's bytes (none for control, unknown and unused tokens). */
static const duet_vocab *engine_vocab(duet_engine *e) {
    pthread_mutex_lock(&e->mu);
    if (!e->vocab) {
        const duet_tokenizer *t = e->model->tok;
        int n = e->model->hp.n_vocab;
        char **bytes = calloc((size_t)n, sizeof *bytes);
        int *len = calloc((size_t)n, sizeof *len);
        bool *eog = calloc((size_t)n, sizeof *eog);
        bool ok = bytes && len && eog;
        for (int i = 0; ok && i < n; i++) {
            duet_token_type ty = duet_tokenizer_token_type(t, i);
            eog[i] = duet_tokenizer_is_eog(t, i);
            if (ty == DUET_TOKEN_CONTROL || ty == DUET_TOKEN_UNKNOWN || ty == DUET_TOKEN_UNUSED) continue;
            char buf[512];
            int k = duet_tokenizer_token_bytes(t, i, false, buf, sizeof buf);
            if (k <= 0 || k > (int)sizeof buf) continue;
            if (!(bytes[i] = malloc((size_t)k)))
                ok = false;
            else
                memcpy(bytes[i], buf, (size_t)k), len[i] = k;
        }
        if (ok) duet_vocab_new(n, (const char *const *)bytes, len, eog, &e->vocab);
        for (int i = 0; bytes && i < n; i++)
            free(bytes[i]);
        free(bytes), free(len), free(eog);
    }
    const duet_vocab *v = e->vocab;
    pthread_mutex_unlock(&e->mu);
    return v;
}

duet_status duet_engine_submit(duet_engine *e, const duet_request *q, duet_event_fn fn, void *user,
                               uint64_t *id) {
    if (!e || !q || !fn) return duet__error(DUET_INVALID_ARGUMENT, "submit: NULL argument");
    const duet_model *m = e->model;
    duet_priority prio = q->priority;
    if (prio != DUET_PRIORITY_INTERACTIVE && prio != DUET_PRIORITY_BATCH)
        return duet__error(DUET_BAD_REQUEST, "priority %d is not interactive (0) or batch (1)", (int)prio);
    if (q->n_prompt < 1 || !q->prompt) {
        duet__metrics_request_refused(e->metrics, prio, "invalid");
        return duet__error(DUET_BAD_REQUEST, "the prompt is empty");
    }
    if (q->max_tokens < 1) {
        duet__metrics_request_refused(e->metrics, prio, "invalid");
        return duet__error(DUET_BAD_REQUEST, "max_tokens %d must be >= 1", q->max_tokens);
    }
    for (int i = 0; i < q->n_prompt; i++)
        if (q->prompt[i] < 0 || q->prompt[i] >= m->hp.n_vocab) {
            duet__metrics_request_refused(e->metrics, prio, "invalid");
            return duet__error(DUET_BAD_REQUEST, "prompt token %d = %d is outside the vocabulary [0, %d)", i,
                               q->prompt[i], m->hp.n_vocab);
        }
    if (q->n_prompt >= e->run.n_ctx) {
        duet__metrics_request_refused(e->metrics, prio, "invalid");
        return duet__error(DUET_CONTEXT_FULL, "the prompt has %d tokens; the context holds %d", q->n_prompt,
                           e->run.n_ctx);
    }
    if (q->logprobs &&
        (q->top_logprobs < 0 || q->top_logprobs > DUET_MAX_TOP_LOGPROBS || q->top_logprobs > m->hp.n_vocab)) {
        duet__metrics_request_refused(e->metrics, prio, "invalid");
        return duet__error(DUET_BAD_REQUEST, "top_logprobs %d: 0 to %d", q->top_logprobs,
                           DUET_MAX_TOP_LOGPROBS);
    }
    if (q->n_stop < 0 || q->n_stop > DUET_MAX_STOP || (q->n_stop && !q->stop)) {
        duet__metrics_request_refused(e->metrics, prio, "invalid");
        return duet__error(DUET_BAD_REQUEST, "n_stop %d: 0 to %d stop strings", q->n_stop, DUET_MAX_STOP);
    }
    size_t stop_bytes = 0, stop_max = 0;
    for (int i = 0; i < q->n_stop; i++) {
        size_t n = q->stop[i] ? strlen(q->stop[i]) : 0;
        if (n == 0) {
            duet__metrics_request_refused(e->metrics, prio, "invalid");
            return duet__error(DUET_BAD_REQUEST, "stop string %d is empty", i);
        }
        stop_bytes += n + 1;
        if (n > stop_max) stop_max = n;
    }
    char **stops = NULL, *pend = NULL;
    if (q->n_stop) {
        /* pend holds at most a stop string's prefix plus one token's text. */
        stops = malloc((size_t)q->n_stop * sizeof *stops + stop_bytes);
        pend = malloc(stop_max + m->detok_size + 16);
        if (!stops || !pend) {
            free(stops), free(pend);
            return duet__error(DUET_OUT_OF_MEMORY, "submit: stop strings");
        }
        char *at = (char *)(stops + q->n_stop);
        for (int i = 0; i < q->n_stop; i++) {
            size_t n = strlen(q->stop[i]) + 1;
            memcpy(at, q->stop[i], n);
            stops[i] = at;
            at += n;
        }
    }
    /* Generation stops at the context's end: clamp rather than refuse. */
    int max_tokens = q->max_tokens;
    if (max_tokens > e->run.n_ctx - q->n_prompt) max_tokens = e->run.n_ctx - q->n_prompt;
    duet_sampler *smp;
    duet_status st = duet_sampler_new(&q->sampling, m->hp.n_vocab, &smp);
    if (st) {
        free(stops), free(pend);
        duet__metrics_request_refused(e->metrics, prio, "invalid");
        return DUET_BAD_REQUEST;
    }
    for (int i = 0; i < q->n_prompt; i++)
        duet_sampler_accept(smp, q->prompt[i]);
    if (q->grammar) {
        duet_grammar *g = NULL;
        const duet_vocab *voc = engine_vocab(e);
        st = voc ? duet_grammar_parse(q->grammar, &g) : DUET_OUT_OF_MEMORY;
        if (!st) st = duet_sampler_set_grammar(smp, g, voc);
        if (st) {
            free(stops), free(pend);
            duet_sampler_free(smp);
            duet__metrics_request_refused(e->metrics, prio, "invalid");
            return st == DUET_OUT_OF_MEMORY ? st : DUET_BAD_REQUEST;
        }
    }

    pthread_mutex_lock(&e->mu);
    if (e->stopping) {
        pthread_mutex_unlock(&e->mu);
        free(stops), free(pend);
        duet_sampler_free(smp);
        return duet__error(DUET_CANCELLED, "the engine is shutting down");
    }
    if (e->lost) {
        char why[ENGINE_ERR_SIZE];
        snprintf(why, sizeof why, "%s", e->lost_why);
        pthread_mutex_unlock(&e->mu);
        free(stops), free(pend);
        duet_sampler_free(smp);
        duet__metrics_request_refused(e->metrics, prio, "rejected");
        return duet__error(DUET_DEVICE_LOST, "the engine cannot serve: %s", why);
    }
    int slot = -1;
    for (int i = 0; i < e->cap; i++) {
        int j = (int)((e->next_seq + (uint64_t)i) % (uint64_t)e->cap);
        if (!e->reqs[j].id) {
            slot = j;
            break;
        }
    }
    uint64_t rid = ((++e->next_seq) << ID_INDEX_BITS) | (uint64_t)(slot < 0 ? 0 : slot);
    duet_sched_admit a = slot < 0
                             ? DUET_SCHED_QUEUE_FULL
                             : duet__sched_arrival(e->sched, now_ns(), rid, q->n_prompt, max_tokens, prio);
    if (a != DUET_SCHED_ADMITTED) {
        pthread_mutex_unlock(&e->mu);
        free(stops), free(pend);
        duet_sampler_free(smp);
        if (a == DUET_SCHED_QUEUE_FULL) {
            duet__metrics_request_refused(e->metrics, prio, "rejected");
            return duet__error(DUET_QUEUE_FULL, "the queue is full; retry later");
        }
        duet__metrics_request_refused(e->metrics, prio, "invalid");
        if (a == DUET_SCHED_TOO_LONG)
            return duet__error(DUET_CONTEXT_FULL, "prompt (%d) + max_tokens (%d) can never fit the KV cache",
                               q->n_prompt, max_tokens);
        return duet__error(DUET_BAD_REQUEST, "the scheduler refused the request");
    }
    engine_req *r = &e->reqs[slot];
    memcpy(r->stream, q->prompt, (size_t)q->n_prompt * sizeof(int32_t));
    /* Prompt logprobs need every prompt position computed: such a request
     * registers its blocks but shares none. */
    if (e->prefix_cache)
        duet__sched_set_stream(e->sched, rid, r->stream, !(q->logprobs && q->prompt_logprobs));
    r->id = rid;
    r->n_prompt = q->n_prompt;
    r->n_gen = 0;
    r->max_tokens = max_tokens;
    r->ignore_eos = q->ignore_eos;
    r->prio = prio;
    r->smp = smp;
    bool after_bos = q->prompt[q->n_prompt - 1] == duet_tokenizer_bos(m->tok);
    duet_detok_init(&r->detok, m->tok, after_bos && !strcmp(duet_tokenizer_model(m->tok), "llama"));
    r->fn = fn;
    r->user = user;
    r->t_arrival = now_ns();
    r->t_first_sched = r->t_first_token = r->t_last_token = 0;
    r->cancelled = false;
    r->finish = DUET_FINISH_NONE;
    r->stops = stops, r->n_stops = q->n_stop;
    r->pend = pend, r->pend_len = 0;
    r->stop_hit = false;
    r->top_n = q->logprobs ? q->top_logprobs : -1;
    r->prompt_lp = q->logprobs && q->prompt_logprobs;
    r->prompt_lp_next = 1;
    r->lp_valid = false;
    r->spec = e->spec && !q->grammar;
    duet__spec_adapt_init(&r->adapt, e->spec_k);
    r->spec_steps = r->spec_drafted = r->spec_accepted = 0;
    r->dlen = r->dblocks = 0;
    r->qslot = -1;
    r->dsmp = NULL;
    if (r->spec && e->draft && q->sampling.temperature > 0) {
        /* Without memory for it the drafts are the argmax: still lossless. */
        duet_sampling ds = duet__spec_draft_sampling(&q->sampling);
        if (duet_sampler_new(&ds, m->hp.n_vocab, &r->dsmp)) r->dsmp = NULL;
    }
    if (id) *id = rid;
    pthread_cond_signal(&e->cv);
    pthread_mutex_unlock(&e->mu);
    return DUET_OK;
}

duet_status duet_engine_cancel(duet_engine *e, uint64_t id) {
    pthread_mutex_lock(&e->mu);
    engine_req *r = find_req(e, id);
    duet_status st = DUET_OK;
    if (!r || r->cancelled || r->finish != DUET_FINISH_NONE) {
        st = duet__error(DUET_INVALID_ARGUMENT, "request %llu is not in flight", (unsigned long long)id);
    } else {
        duet__sched_cancel(e->sched, now_ns(), id);
        r->cancelled = true;
        e->cancel_list[e->n_cancel++] = id;
        pthread_cond_signal(&e->cv);
    }
    pthread_mutex_unlock(&e->mu);
    return st;
}

bool duet_engine_healthy(duet_engine *e, char *why, size_t why_size) {
    if (why && why_size) why[0] = 0;
    if (!e) {
        if (why && why_size) snprintf(why, why_size, "no engine");
        return false;
    }
    pthread_mutex_lock(&e->mu);
    bool healthy = !e->lost;
    if (!healthy && why && why_size) snprintf(why, why_size, "%s", e->lost_why);
    pthread_mutex_unlock(&e->mu);
    return healthy;
}

/* ---- the engine thread ---------------------------------------------------- */

/* Delivers DONE(CANCELLED) to every request on the cancel list. Called with
 * the lock held; drops it around the callbacks. */
static void flush_cancels(duet_engine *e) {
    while (e->n_cancel > 0) {
        uint64_t id = e->cancel_list[--e->n_cancel];
        engine_req *r = find_req(e, id);
        if (!r) continue;
        pthread_mutex_unlock(&e->mu);
        emit_done(e, r, DUET_FINISH_CANCELLED, NULL);
        pthread_mutex_lock(&e->mu);
        release_req(r);
    }
}

/* Ends r with DONE(ERROR) and e->err (whatever its step decided: the
 * step failed). Called with the lock held; drops it around the callback. A
 * cancelled request gets its DONE(CANCELLED) from flush_cancels instead. */
static void fail_request(duet_engine *e, engine_req *r) {
    if (!r || r->cancelled) return;
    duet__sched_cancel(e->sched, now_ns(), r->id);
    r->finish = DUET_FINISH_ERROR; /* a cancel from now on is refused */
    pthread_mutex_unlock(&e->mu);
    emit_done(e, r, DUET_FINISH_ERROR, e->err);
    pthread_mutex_lock(&e->mu);
    release_req(r);
}

static void update_gauges(duet_engine *e) {
    duet_sched_stats st;
    duet__sched_stats(e->sched, &st);
    duet_sched_knobs k = duet__sched_knobs(e->sched);
    duet_metrics_gauges g = {.kv_usage = st.kv_usage,
                             .max_batch_seqs = k.max_batch_seqs,
                             .max_batch_tokens = k.max_batch_tokens,
                             .prefill_chunk = k.prefill_chunk,
                             .batch_timeout_s = secs(k.batch_timeout_ns),
                             .kv_block_size = e->run.state->p.block_size,
                             .kv_blocks = e->run.state->p.n_blocks,
                             .prefix_cache = e->prefix_cache,
                             .prefix_cache_queries = st.prefix_queries,
                             .prefix_cache_hits = st.prefix_hits,
                             .kv_blocks_cached = st.kv_blocks_cached,
                             .spec_k = e->spec ? e->spec_k : 0,
                             .spec_max_batch = k.spec_max_batch,
                             .spec_measured = k.spec_measured,
                             .spec_draft_model = e->draft != NULL,
                             .spec_offered_tokens = st.spec_offered,
                             .spec_throttled_tokens = st.spec_throttled,
                             .spec_capped_tokens = st.spec_capped,
                             .controller = e->ctl_on,
                             .ctl_itl_ratio = e->ctl.itl_ratio,
                             .ctl_ttft_ratio = e->ctl.ttft_ratio,
                             .budget_share = e->ctl.cfg.share_max > 0 ? e->budget_share : 0,
                             .budget_cut_steps = st.budget_cut,
                             .budget_over_steps = st.budget_over};
    for (int c = 0; c < 2; c++) {
        g.slo_ttft_s[c] = e->ctl.cfg.ttft_target_s[c];
        g.slo_itl_s[c] = e->ctl.cfg.itl_target_s[c];
        g.step_budget_s[c] = secs(k.step_budget_ns[c]);
    }
    for (int a = 0; a < DUET_CTL_N_ACTIONS; a++)
        g.ctl_decisions[a] = e->ctl.actions[a];
    _Static_assert(DUET_SPEC_STEP_KINDS == sizeof g.spec_steps / sizeof *g.spec_steps, "spec step kinds");
    memcpy(g.spec_steps, st.spec_steps, sizeof g.spec_steps);
    duet_spec_decision d;
    if (duet__sched_spec_decision(e->sched, &d))
        g.spec_speedup = d.speedup, g.spec_alpha = d.alpha_mean, g.spec_draft_predicted_s = d.draft_seconds;
    if (e->draft)
        memcpy(g.spec_draft_coef, duet__step_cost_online_get(&e->dcost)->coef, sizeof g.spec_draft_coef);
    memcpy(g.waiting, st.waiting, sizeof g.waiting);
    memcpy(g.running, st.running, sizeof g.running);
    duet__metrics_set_gauges(e->metrics, &g);
}

/* Appends token `id` of plan entry i to the stream, streams it and decides
 * whether the request is done (unlocked, in run_step). */
static void take_token(duet_engine *e, engine_req *r, int i, int32_t id) {
    duet_model *m = e->model;
    duet_sched_result *res = &e->results[i];
    res->n_generated++;
    duet_sampler_accept(r->smp, id);
    r->stream[r->n_prompt + r->n_gen++] = id;
    int64_t now = now_ns();
    if (!r->t_first_token)
        r->t_first_token = now;
    else
        duet__metrics_inter_token_prio(e->metrics, r->prio, secs(now - r->t_last_token));
    r->t_last_token = now;
    bool eog = !r->ignore_eos && duet_tokenizer_is_eog(m->tok, id);
    if (eog || duet_sampler_grammar_done(r->smp)) /* the grammar's sentence is closed */
        e->step_finish[i] = DUET_FINISH_STOP;
    else if (r->n_gen >= r->max_tokens || r->n_prompt + r->n_gen >= e->run.n_ctx)
        e->step_finish[i] = DUET_FINISH_LENGTH;
    res->finished = e->step_finish[i] != DUET_FINISH_NONE;
    if (r->cancelled) return; /* its DONE is owed; no more tokens */
    int len = eog ? 0 : duet_detok_push(&r->detok, id, e->text, m->detok_size);
    if (deliver(r, id, e->text, (size_t)(len > 0 ? len : 0))) {
        e->step_finish[i] = DUET_FINISH_STOP; /* a stop string */
        res->finished = true;
    }
}

/* Logprobs come from the raw distribution: kept before the sampler's
 * penalties change the row in place. */
static void keep_raw(duet_engine *e, const engine_req *r, const float *logits) {
    if (r->top_n >= 0) memcpy(e->raw, logits, (size_t)e->model->hp.n_vocab * sizeof *logits);
}

static void set_logprob(duet_engine *e, engine_req *r, int32_t id) {
    if (r->top_n < 0) return;
    r->lp = duet_logprobs(e->raw, e->model->hp.n_vocab, id, r->top_n, r->top);
    r->lp_valid = true;
}

/* Samples the next token of plan entry i from its logits row. */
static void sample_row(duet_engine *e, engine_req *r, int i, float *logits) {
    keep_raw(e, r, logits);
    int32_t id = duet_sampler_sample(r->smp, logits);
    set_logprob(e, r, id);
    take_token(e, r, i, id);
}

/* Request r's q row for draft j this step (NULLs without a slot). */
static void q_row(duet_engine *e, const engine_req *r, int j, int32_t **ids, float **probs) {
    *ids = NULL, *probs = NULL;
    if (r->qslot < 0) return;
    size_t at = ((size_t)r->qslot * (size_t)e->spec_k + (size_t)j) * (size_t)e->model->hp.n_vocab;
    *ids = e->q_ids + at, *probs = e->q_probs + at;
}

/* Row j (0..n_draft) of a speculative entry i: rows before n_draft verify
 * draft j (speculative.h); row n_draft, reached only when every draft was
 * kept, samples the bonus token. Rows after a rejection or the request's
 * end are discarded. */
static void spec_row(duet_engine *e, engine_req *r, int i, int j, float *logits) {
    const duet_sched_seq *s = &e->plan_seqs[i];
    if (r->spec_stop) return;
    if (j == s->n_draft) {
        sample_row(e, r, i, logits);
        return;
    }
    keep_raw(e, r, logits);
    bool kept;
    int32_t *q_ids;
    float *q_probs;
    q_row(e, r, j, &q_ids, &q_probs);
    int32_t id = duet__spec_verify(e->verifier, r->smp, logits, r->draft[j], q_ids, q_probs,
                                   q_ids ? r->q_n[j] : 0, &kept);
    set_logprob(e, r, id);
    r->spec_kept += kept;
    take_token(e, r, i, id);
    if (!kept || e->step_finish[i] != DUET_FINISH_NONE) r->spec_stop = true;
}

/* Before a plan (locked): each speculated request that is decoding offers
 * the scheduler a draft: an n-gram draft, or with a draft model, tokens it
 * will draft in the step if granted. With the measured decision it offers
 * up to spec_k and the decision picks how many pay (from its acceptance and
 * the step costs); without it (every offer verified) it offers its adaptive
 * k. */
static void offer_drafts(duet_engine *e) {
    if (!e->spec) return;
    const int k_offer_max = duet__sched_knobs(e->sched).spec_measured ? e->spec_k : 0;
    for (int i = 0; i < e->cap; i++) {
        engine_req *r = &e->reqs[i];
        if (!r->id || !r->spec || r->cancelled || r->finish != DUET_FINISH_NONE || r->n_gen == 0) continue;
        int len = r->n_prompt + r->n_gen;
        int k = k_offer_max ? k_offer_max : r->adapt.k;
        int n = e->draft
                    ? k
                    : duet__spec_ngram(r->stream, len, DUET_SPEC_NGRAM_MIN, DUET_SPEC_NGRAM_MAX, k, r->draft);
        /* Every token the draft's KV misses: the decision charges the
         * steady part (the newest token, and one more after a step that
         * kept every draft) whole and a longer backlog (after steps
         * without drafts) by the share of it this step serves. */
        int catchup = len - r->dlen < 1 ? 1 : len - r->dlen;
        /* Until its first verified draft a sequence's acceptance is the
         * population's: from 0.5 the decision refused a good draft pair's
         * first offers at 4 streams, and each refused step grew the draft's
         * backlog, which then made drafting look dear (0.90x on/off where
         * verifying every draft gave 1.11x: bench/results/spec-draft-smollm2-xeon-2c.md).
         * Only for the decision (without it the prior would steer k, and a
         * seeded request's tokens would depend on the requests before it),
         * and once the pool has seen a draft; weighed as the pool's own
         * trials, at most DUET_SPEC_PRIOR_TRIALS. */
        if (k_offer_max && r->spec_steps == 0 && e->spec_pool.trials > DUET_SPEC_ADAPT_PRIOR_TRIALS)
            duet__spec_adapt_prior(&r->adapt, e->spec_pool.alpha,
                                   fminf(e->spec_pool.trials, DUET_SPEC_PRIOR_TRIALS));
        if (n > 0) duet__sched_set_draft(e->sched, r->id, n, r->adapt.alpha, catchup);
    }
}

/* After r's draft KV came to hold its stream's first r->dlen tokens: marks
 * the blocks of its table that are now full with their chain hash. */
static void draft_mark(duet_engine *e, engine_req *r, const int32_t *table) {
    const int bs = e->run.state->p.block_size;
    for (; (r->dblocks + 1) * bs <= r->dlen; r->dblocks++) {
        r->dhash = duet__kv_hash_block(r->dblocks ? r->dhash : DUET_KV_HASH_SEED,
                                       r->stream + (size_t)r->dblocks * bs, bs);
        e->dkey[table[r->dblocks]] = r->dhash;
    }
}

/* At the first entry of an admission (s->pos: the tokens of the shared
 * cached blocks the target starts from): the draft starts from the longest
 * run of those blocks whose marks match the stream's chain (a block is
 * re-marked only once its new contents are whole, and the target's cache
 * forgets a block before reusing it). */
static void draft_admit(duet_engine *e, engine_req *r, const duet_sched_seq *s, const int32_t *table) {
    const int bs = e->run.state->p.block_size;
    uint64_t h = DUET_KV_HASH_SEED;
    r->dlen = r->dblocks = 0;
    for (int b = 0; (b + 1) * bs <= s->pos; b++) {
        h = duet__kv_hash_block(h, r->stream + (size_t)b * bs, bs);
        if (e->dkey[table[b]] != h) break;
        r->dblocks = b + 1, r->dhash = h, r->dlen = (b + 1) * bs;
    }
}

/* Before a running request's step (its table was `old`, is `now`): the
 * scheduler may have swapped one of its full blocks for an identical cached
 * one (kv_blocks: two streams computed the same block; keep one copy). The
 * target's KV there is the same; the draft's is only where the other
 * stream's draft wrote that block whole (its mark matches this stream's
 * chain). Otherwise the draft's KV is valid only up to the block, and its
 * next drafting step catches up from there. */
static void draft_reblock(duet_engine *e, engine_req *r, const int32_t *old, const int32_t *now) {
    const int bs = e->run.state->p.block_size;
    uint64_t h = DUET_KV_HASH_SEED;
    for (int b = 0; b * bs < r->dlen; b++) {
        uint64_t prev = h;
        if ((b + 1) * bs <= r->n_prompt + r->n_gen)
            h = duet__kv_hash_block(h, r->stream + (size_t)b * bs, bs);
        if (old[b] == now[b]) continue;
        if ((b + 1) * bs <= r->dlen && e->dkey[now[b]] == h) continue;
        r->dlen = b * bs;
        if (r->dblocks > b) r->dblocks = b, r->dhash = prev;
        return;
    }
}

/* One forward of the draft model over dtok[0..n); row k (of n_out) gives
 * draft token j of plan entry drow[k]. */
static duet_status draft_forward(duet_engine *e, int n, int n_out, int j) {
    const int V = e->draft->hp.n_vocab;
    duet_batch b = {.n_tokens = n,
                    .tokens = e->dtok,
                    .pos = e->dpos,
                    .seq = e->dseq,
                    .n_out = n_out,
                    .out = e->dout,
                    .block_tables = e->tables};
    int64_t t0 = now_ns();
    duet_status st = duet__run_forward(e->draft, &e->drun, &b, e->drun.logits);
    if (!st) {
        duet_step_shape sh = {0};
        for (int t = 0; t < n; t++)
            duet_step_shape_add(&sh, e->dpos[t], 1, true);
        double s = secs(now_ns() - t0);
        e->draft_s += s;
        if (e->n_dpass < ENGINE_DRAFT_PASSES) e->dpass[e->n_dpass] = sh, e->dpass_s[e->n_dpass++] = s;
    }
    for (int k = 0; !st && k < n_out; k++) {
        engine_req *r = find_req(e, e->plan_seqs[e->drow[k]].id);
        int32_t *q_ids;
        float *q_probs;
        q_row(e, r, j, &q_ids, &q_probs);
        r->draft[j] = duet__spec_draw(r->dsmp, e->drun.logits + (size_t)k * V, V, q_ids, q_probs, &r->q_n[j]);
    }
    return st;
}

/* Before the target's forward (unlocked, in run_step): the draft model
 * drafts each speculating decode's n_draft tokens. Its KV first catches up
 * with the stream, from r->dlen to the newest token (the whole stream after
 * an admission, one or two tokens after a speculative step, more after
 * steps without drafts), in passes of at most its step size; the newest
 * token's row gives draft 0. Then one pass per further position, batched
 * over the sequences still drafting, feeds draft j - 1 back to get draft j
 * (the last draft is never fed: the target's step computes its KV). */
static duet_status draft_run(duet_engine *e, int n_seqs) {
    const int cap = e->drun.max_step_tokens;
    const int bs = e->run.state->p.block_size;
    int n = 0, n_out = 0, max_draft = 0, n_q = 0;
    duet_status st = DUET_OK;
    for (int i = 0; i < n_seqs && !st; i++) {
        const duet_sched_seq *s = &e->plan_seqs[i];
        if (s->n_draft == 0) continue;
        engine_req *r = find_req(e, s->id);
        r->qslot = r->dsmp && n_q < e->q_slots ? n_q++ : -1;
        if (s->n_draft > max_draft) max_draft = s->n_draft;
        if (r->dlen > s->pos) r->dlen = s->pos; /* a failed step left it ahead of the stream */
        /* The blocks this step's passes write lose their marks until they
         * are whole again (draft_mark): another stream's draft KV may have
         * been marked there before the block was reused, with the very hash
         * these tokens will have. */
        const int32_t *table = e->tables + (size_t)s->slot * e->max_blocks;
        for (int b = r->dlen / bs; b <= (s->pos + s->n_draft - 1) / bs; b++)
            if (b >= r->dblocks) e->dkey[table[b]] = 0;
        for (int p = r->dlen; p <= s->pos && !st; p++) {
            if (n == cap) {
                st = draft_forward(e, n, n_out, 0);
                n = n_out = 0;
            }
            e->dtok[n] = r->stream[p];
            e->dpos[n] = p;
            e->dseq[n] = s->slot;
            if (p == s->pos) e->dout[n_out] = n, e->drow[n_out++] = i;
            n++;
        }
        r->dlen = s->pos + 1; /* once the pass has run */
    }
    if (!st && n > 0) st = draft_forward(e, n, n_out, 0);
    for (int i = 0; i < n_seqs && !st; i++) {
        const duet_sched_seq *s = &e->plan_seqs[i];
        if (s->n_draft) draft_mark(e, find_req(e, s->id), e->tables + (size_t)s->slot * e->max_blocks);
    }
    for (int j = 1; j < max_draft && !st; j++) {
        n = 0;
        for (int i = 0; i < n_seqs; i++) {
            const duet_sched_seq *s = &e->plan_seqs[i];
            if (s->n_draft <= j) continue;
            const engine_req *r = find_req(e, s->id);
            e->dtok[n] = r->draft[j - 1];
            e->dpos[n] = s->pos + j;
            e->dseq[n] = s->slot;
            e->dout[n] = n, e->drow[n] = i;
            n++;
        }
        st = draft_forward(e, n, n, j);
    }
    return st;
}

/* Runs one planned step (unlocked). Fills e->results and e->step_finish;
 * returns the forward's status. Request fields that other threads read
 * (finish) are left for the caller to set under the lock. */
static duet_status run_step(duet_engine *e, int n_seqs) {
    duet_model *m = e->model;
    const int V = m->hp.n_vocab;
    int n = 0;
    int64_t t0 = e->t_step = now_ns();
    e->draft_s = 0;
    e->n_dpass = 0;
    if (e->draft) {
        duet_status st = draft_run(e, n_seqs);
        if (st) {
            duet__metrics_step(e->metrics, n_seqs, 0, secs(now_ns() - t0));
            return st;
        }
    }
    for (int i = 0; i < n_seqs; i++) {
        const duet_sched_seq *s = &e->plan_seqs[i];
        engine_req *r = find_req(e, s->id);
        const int n_real = s->n_tokens - s->n_draft; /* stream tokens; the drafts follow */
        for (int t = 0; t < s->n_tokens; t++) {
            int p = s->pos + t;
            e->tok[n] = t < n_real ? r->stream[p] : r->draft[t - n_real];
            e->pos[n] = p;
            e->seq[n] = s->slot;
            e->row_of[n] = i;
            /* The last stream token samples, and each draft token's row
             * verifies the next draft; with prompt logprobs, every prompt
             * position not yet reported scores the prompt token after it. */
            e->want[n] = (t >= n_real - 1 && s->logits) ||
                         (r->prompt_lp && p + 1 < r->n_prompt && p + 1 >= r->prompt_lp_next);
            n++;
        }
        e->results[i] = (duet_sched_result){.id = s->id};
        e->step_finish[i] = DUET_FINISH_NONE;
        r->spec_stop = false;
        r->spec_kept = 0;
    }
    /* One forward pass, or several when more rows want logits than the
     * logits buffer holds (prompt logprobs): each piece takes the tokens in
     * order, so every sequence's earlier tokens are in the KV cache first. */
    for (int start = 0; start < n;) {
        int n_out = 0, end = start;
        while (end < n && (n_out < e->run.max_out || !e->want[end])) {
            if (e->want[end]) e->out[n_out++] = end - start;
            end++;
        }
        duet_batch b = {.n_tokens = end - start,
                        .tokens = e->tok + start,
                        .pos = e->pos + start,
                        .seq = e->seq + start,
                        .n_out = n_out,
                        .out = e->out,
                        .block_tables = e->tables};
        duet_status st = duet__run_forward(m, &e->run, &b, e->run.logits);
        if (st) {
            duet__metrics_step(e->metrics, n_seqs, n, secs(now_ns() - t0));
            return st;
        }
        for (int k = 0; k < n_out; k++) {
            int j = start + e->out[k];
            float *logits = e->run.logits + (size_t)k * V;
            const duet_sched_seq *s = &e->plan_seqs[e->row_of[j]];
            engine_req *r = find_req(e, s->id);
            int p = e->pos[j];
            if (p + 1 < r->n_prompt) { /* a prompt logprob */
                r->prompt_lp_next = p + 2;
                if (r->cancelled) continue;
                duet_event ev = {.kind = DUET_EVENT_PROMPT_TOKEN,
                                 .request_id = r->id,
                                 .token = r->stream[p + 1],
                                 .position = p + 1,
                                 .has_logprob = true,
                                 .n_top = r->top_n,
                                 .top = r->top};
                ev.logprob = duet_logprobs(logits, V, ev.token, r->top_n, r->top);
                r->fn(&ev, r->user);
                continue;
            }
            if (s->n_draft > 0)
                spec_row(e, r, e->row_of[j], p - (s->pos + s->n_tokens - s->n_draft - 1), logits);
            else
                sample_row(e, r, e->row_of[j], logits);
        }
        start = end;
    }
    e->step_s = secs(now_ns() - t0);
    duet__metrics_step(e->metrics, n_seqs, n, e->step_s);
    duet__metrics_spec_draft_time(e->metrics, e->draft_s);
    for (int i = 0; i < n_seqs; i++) {
        const duet_sched_seq *s = &e->plan_seqs[i];
        if (s->n_draft == 0) continue;
        engine_req *r = find_req(e, s->id);
        r->spec_steps++;
        r->spec_drafted += s->n_draft;
        r->spec_accepted += r->spec_kept;
        /* The draft's KV holds the newest token and its drafts 0..n_draft-2:
         * valid as far as they were kept. */
        if (e->draft) {
            r->dlen = s->pos + 1 + (r->spec_kept < s->n_draft - 1 ? r->spec_kept : s->n_draft - 1);
            draft_mark(e, r, e->tables + (size_t)s->slot * e->max_blocks);
        }
        duet__spec_adapt_update(&r->adapt, s->n_draft, r->spec_kept, e->spec_k);
        duet__spec_adapt_update(&e->spec_pool, s->n_draft, r->spec_kept, e->spec_k);
        duet__metrics_spec(e->metrics, s->n_draft, r->spec_kept);
    }
    return DUET_OK;
}

/* One controller window: the metrics of the last window and the queue in,
 * new knobs out (under mu). */
static void controller_tick(duet_engine *e, int64_t now) {
    duet_metrics_window w;
    duet__metrics_window(e->metrics, secs(now), secs(e->ctl_window_ns), &w);
    duet_ctl_window cw = {.arrival_rate = w.arrival_rate};
    for (int c = 0; c < 2; c++) {
        cw.ttft_p99_s[c] = w.ttft_p99_prio_s[c], cw.ttft_n[c] = w.ttft_n[c];
        cw.itl_p99_s[c] = w.itl_p99_prio_s[c], cw.itl_n[c] = w.itl_n[c];
    }
    duet__engine_ctl_tick(&e->ctl, &cw, e->sched, &e->budget_share, e->slo_itl_s);
}

enum { WARM_DECODE = 1, WARM_PROMPT = 2, WARM_VERIFY = 4, WARM_DRAFT = 8 };

/* One line of the step log for the step just run (under the lock, before
 * the fit learns it: the prediction is what sized the step; stdio buffers
 * the lines, flushed when the engine goes idle). */
static void log_step(duet_engine *e, int n_seqs, const duet_step_shape *sh, bool learnt) {
    int64_t end = e->t_step + (int64_t)llround(e->step_s * 1e9);
    fprintf(e->step_log, "%.6f,", secs(e->t_step - e->t_start));
    if (e->t_step_end) fprintf(e->step_log, "%.6f", secs(e->t_step - e->t_step_end));
    fprintf(e->step_log, ",%d,%d,%d,%.0f,%.0f,%.6f,%.6f,%.6f,", n_seqs, sh->n_decode, sh->n_prefill,
            sh->decode_ctx, sh->prefill_ctx, e->step_s - e->draft_s, e->draft_s,
            duet_step_cost_predict(&e->cost.current, sh));
    if (e->cost_seeded) fprintf(e->step_log, "%.6f", duet_step_cost_predict(&e->cost.prior, sh));
    fprintf(e->step_log, ",%d\n", learnt);
    e->t_step_end = end;
}

/* Feeds the step just run to the online step-cost fit, and the fit to the
 * scheduler's time budget (under the lock); not the first step of its
 * kind (warm_kinds). */
static void observe_step(duet_engine *e, int n_seqs) {
    duet_step_shape sh = {0};
    int drafts = 0;
    for (int i = 0; i < n_seqs; i++) {
        duet_step_shape_add(&sh, e->plan_seqs[i].pos, e->plan_seqs[i].n_tokens, e->plan_seqs[i].decode);
        drafts += e->plan_seqs[i].n_draft;
    }
    /* The draft's passes have their own model, learnt apart from the
     * target's kinds; its first step of passes is cold too (its own kernel
     * builds and first touches) and is not learnt. Until one is, the
     * decision prices drafts at 0, so it keeps granting and exploring. */
    if (e->n_dpass > 0 && !(e->warm_kinds & WARM_DRAFT)) {
        e->warm_kinds |= WARM_DRAFT;
    } else {
        for (int i = 0; i < e->n_dpass; i++)
            duet__step_cost_online_observe(&e->dcost, &e->dpass[i], e->dpass_s[i]);
    }
    if (e->draft) duet__sched_set_draft_cost(e->sched, duet__step_cost_online_get(&e->dcost));
    unsigned kind = sh.n_prefill > 0 ? WARM_PROMPT : drafts > 0 ? WARM_VERIFY : WARM_DECODE;
    bool learn = e->warm_kinds & kind;
    if (e->step_log) log_step(e, n_seqs, &sh, learn);
    if (!learn) {
        e->warm_kinds |= kind;
        return;
    }
    /* The target's own time: the draft's passes have their own model. */
    duet__step_cost_online_observe(&e->cost, &sh, e->step_s - e->draft_s);
    if (e->cost_seeded)
        duet__served_speed_add(&e->served, e->step_s - e->draft_s,
                               duet_step_cost_predict(&e->cost.prior, &sh));
    duet__sched_set_cost(e->sched, &e->cost.current);
}

static void *engine_main(void *arg) {
    duet_engine *e = arg;
    pthread_mutex_lock(&e->mu);
    for (;;) {
        flush_cancels(e);
        if (e->stopping && (!e->drain || !duet__sched_busy(e->sched))) break;
        offer_drafts(e);
        if (e->ctl_on && now_ns() >= e->ctl_next) {
            int64_t t = now_ns();
            controller_tick(e, t);
            e->ctl_next = t + e->ctl_window_ns;
        }
        duet_sched_plan plan;
        int64_t now = now_ns();
        duet_sched_action act = duet__sched_plan(e->sched, now, &plan);
        /* Idle: the step log reaches its file (a reader between runs
         * sees every step so far). */
        if (act == DUET_SCHED_IDLE && e->step_log) fflush(e->step_log);
        if (act == DUET_SCHED_IDLE && !e->ctl_on) {
            update_gauges(e);
            pthread_cond_wait(&e->cv, &e->mu);
            continue;
        }
        if (act == DUET_SCHED_IDLE) { /* idle windows count too (quiet) */
            act = DUET_SCHED_WAIT;
            plan.wake_at = e->ctl_next;
            update_gauges(e);
        }
        if (act == DUET_SCHED_WAIT) {
            struct timespec ts;
            clock_gettime(CLOCK_MONOTONIC, &ts);
            int64_t wake = (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec + (plan.wake_at - now);
            ts.tv_sec = wake / 1000000000;
            ts.tv_nsec = wake % 1000000000;
            pthread_cond_timedwait(&e->cv, &e->mu, &ts);
            continue;
        }
        /* A step: copy the plan (arrivals during the step may reuse its
         * memory), note first schedules and preemptions, then run unlocked. */
        int n_seqs = plan.n_seqs;
        memcpy(e->plan_seqs, plan.seqs, (size_t)n_seqs * sizeof *plan.seqs);
        /* The step's KV block tables, snapshotted with the plan: a slot the
         * scheduler frees meanwhile must not change this step's view. */
        for (int i = 0; i < n_seqs; i++) {
            const duet_sched_seq *s = &e->plan_seqs[i];
            int32_t *row = e->tables + (size_t)s->slot * e->max_blocks;
            engine_req *r = find_req(e, s->id);
            if (e->draft && r && r->spec && !s->first_schedule && !s->resumed)
                draft_reblock(e, r, row, s->blocks);
            memcpy(row, s->blocks, (size_t)s->n_blocks * sizeof *row);
            for (int j = s->n_blocks; j < e->max_blocks; j++)
                row[j] = -1;
            if (e->draft && r && r->spec && (s->first_schedule || s->resumed)) draft_admit(e, r, s, row);
        }
        for (int i = 0; i < plan.n_preempted; i++) {
            engine_req *r = find_req(e, plan.preempted[i]);
            if (r) duet__metrics_preempted(e->metrics, r->prio);
            if (r) r->dlen = r->dblocks = 0; /* its blocks are gone: the draft starts over */
        }
        for (int i = 0; i < n_seqs; i++) {
            engine_req *r = find_req(e, e->plan_seqs[i].id);
            if (r && !r->t_first_sched) r->t_first_sched = now;
        }
        pthread_mutex_unlock(&e->mu);
        duet_status st = run_step(e, n_seqs);
        if (st) snprintf(e->err, ENGINE_ERR_SIZE, "%s", duet_last_error());
        e->err_st = st;
        pthread_mutex_lock(&e->mu);
        if (!st) {
            observe_step(e, n_seqs);
            for (int i = 0; i < n_seqs; i++) {
                engine_req *r = find_req(e, e->plan_seqs[i].id);
                if (r && !r->cancelled) r->finish = e->step_finish[i];
            }
            st = e->err_st = duet__sched_step_done(e->sched, now_ns(), e->results, n_seqs);
            /* Cannot happen unless engine and scheduler disagree; failing the
             * step beats leaving it outstanding, which would wedge the engine. */
            if (st)
                snprintf(e->err, ENGINE_ERR_SIZE, "engine: the scheduler refused a step's results: %s",
                         duet_last_error());
        }
        if (st) {
            /* A failed step fails its own requests and the engine keeps
             * serving the others, unless the device is lost. */
            duet__sched_step_failed(e->sched, now_ns());
            if (st == DUET_DEVICE_LOST && !e->lost) {
                /* Submit refuses from here on, so the table only shrinks. */
                e->lost = true;
                snprintf(e->lost_why, sizeof e->lost_why, "device lost: %s", e->err);
                snprintf(e->err, ENGINE_ERR_SIZE, "%s", e->lost_why);
                duet__metrics_set_healthy(e->metrics, false);
            }
            for (int i = 0; i < n_seqs; i++)
                fail_request(e, find_req(e, e->plan_seqs[i].id));
            /* A lost device takes every other request with it, waiting or running. */
            for (int i = 0; e->lost && i < e->cap; i++)
                fail_request(e, e->reqs[i].id ? &e->reqs[i] : NULL);
            update_gauges(e);
            continue;
        }
        update_gauges(e);
        for (int i = 0; i < n_seqs; i++) {
            engine_req *r = find_req(e, e->plan_seqs[i].id);
            if (!r || r->cancelled || r->finish == DUET_FINISH_NONE) continue;
            pthread_mutex_unlock(&e->mu);
            emit_done(e, r, r->finish, NULL);
            pthread_mutex_lock(&e->mu);
            release_req(r);
        }
    }
    /* Stopping without drain: everything still here is cancelled. */
    for (int i = 0; i < e->cap; i++) {
        engine_req *r = &e->reqs[i];
        if (!r->id) continue;
        pthread_mutex_unlock(&e->mu);
        emit_done(e, r, DUET_FINISH_CANCELLED, NULL);
        pthread_mutex_lock(&e->mu);
        release_req(r);
    }
    pthread_mutex_unlock(&e->mu);
    return NULL;
}

/* ---- lifetime ------------------------------------------------------------- */

static void engine_free(duet_engine *e) {
    if (!e) return;
    for (int i = 0; e->reqs && i < e->cap; i++) {
        duet_sampler_free(e->reqs[i].smp);
        duet_sampler_free(e->reqs[i].dsmp);
        free(e->reqs[i].stream);
    }
    if (e->step_log) fclose(e->step_log);
    free(e->reqs);
    free(e->cancel_list);
    free(e->plan_seqs);
    free(e->tok), free(e->pos), free(e->seq), free(e->out), free(e->tables);
    free(e->row_of), free(e->want), free(e->raw);
    duet_vocab_free(e->vocab);
    free(e->results);
    free(e->step_finish);
    duet__spec_verifier_free(e->verifier);
    free(e->text);
    free(e->err);
    duet__sched_free(e->sched);
    duet__metrics_free(e->metrics);
    /* The draft shares the model's backend: it goes first. */
    if (e->draft) duet__run_free(e->draft, &e->drun);
    duet_model_close(e->draft);
    free(e->dtok), free(e->dpos), free(e->dseq), free(e->dout), free(e->drow);
    free(e->q_ids), free(e->q_probs), free(e->dkey);
    if (e->model) duet__run_free(e->model, &e->run);
    duet_backend_close(e->stream); /* after the runs' buffers */
    if (!e->borrowed) duet_model_close(e->model);
    pthread_mutex_destroy(&e->mu);
    pthread_cond_destroy(&e->cv);
    free(e);
}

/* A step-cost model's coefficients: finite and >= 0. */
/* Sampled requests whose q rows one step keeps at most (more draft argmax). */
#define ENGINE_Q_SLOTS 8

/* The draft model of an engine started with open.draft: the model's own
 * (opened with it), or opened here on the model's backend for a model that
 * came without one; then its run state, with the target's KV geometry, and
 * the draft's step scratch. */
static duet_status draft_start(duet_engine *e, const duet_engine_params *p, int kv_blocks,
                               int spec_max_batch) {
    duet_model *m = e->model;
    duet_status st;
    if (m->draft) {
        e->draft = duet__model_ref(m->draft);
    } else {
        duet_open_params op = p->open;
        op.weights_only = true;
        if ((st = duet__draft_open(m, p->open.draft, &op, &e->draft))) return st;
    }
    /* The draft's weights are on the target's backend: its steps share the
     * engine's stream (the engine thread runs them in turn). */
    st = duet__run_new_on(e->draft, e->stream, e->run.n_ctx, p->max_batch_seqs, p->open.kv_type,
                          p->max_batch_tokens, p->max_batch_seqs, p->kv_block_size, kv_blocks, &e->drun);
    if (st) return st;
    size_t cap = (size_t)e->drun.max_step_tokens;
    e->dtok = malloc(cap * sizeof(int32_t));
    e->dpos = malloc(cap * sizeof(int32_t));
    e->dseq = malloc(cap * sizeof(int32_t));
    e->dout = malloc(cap * sizeof(int32_t));
    e->drow = malloc(cap * sizeof(int32_t));
    e->q_slots = spec_max_batch < ENGINE_Q_SLOTS ? spec_max_batch : ENGINE_Q_SLOTS;
    size_t q = (size_t)e->q_slots * (size_t)e->spec_k * (size_t)m->hp.n_vocab;
    e->q_ids = malloc((q ? q : 1) * sizeof *e->q_ids);
    e->q_probs = malloc((q ? q : 1) * sizeof *e->q_probs);
    e->dkey = calloc((size_t)kv_blocks, sizeof *e->dkey);
    if (!e->dtok || !e->dpos || !e->dseq || !e->dout || !e->drow || !e->q_ids || !e->q_probs || !e->dkey)
        return duet__error(DUET_OUT_OF_MEMORY, "engine: out of memory for the draft model's scratch");
    return DUET_OK;
}

/* Starts an engine on model m with checked params p, taking over the
 * caller's reference to m (released on failure too), or borrowing m. `path`
 * names it in the metrics when it has no general.name. */
static duet_status engine_start(duet_model *m, const char *path, const duet_engine_params p, bool borrowed,
                                duet_engine **out) {
    duet_engine *e = calloc(1, sizeof *e);
    if (!e) {
        if (!borrowed) duet_model_close(m);
        return duet__error(DUET_OUT_OF_MEMORY, "engine: out of memory");
    }
    e->model = m;
    e->borrowed = borrowed;
    pthread_mutex_init(&e->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&e->cv, &ca);
    pthread_condattr_destroy(&ca);

    /* Speculation (checked by engine_params): the logit rows one step may
     * need are one per sequence plus the drafts of those that may speculate. */
    duet_spec_mode spec_mode;
    int spec_k;
    duet__spec_params(&p.open, &spec_mode, &spec_k);
    bool spec = spec_mode != DUET_SPEC_OFF;
    /* spec_max_batch: > 0 a hard cap; 0 no cap; -1 no cap and no decision
     * (every offer verified, as spec_always). */
    int spec_max_batch = !spec || p.spec_max_batch <= 0 ? p.max_batch_seqs : p.spec_max_batch;
    if (!spec) spec_max_batch = 0;
    if (spec_max_batch > p.max_batch_seqs) spec_max_batch = p.max_batch_seqs;
    int64_t max_out = p.max_batch_seqs + (int64_t)spec_max_batch * spec_k;
    if (max_out > p.max_batch_tokens) max_out = p.max_batch_tokens;
    /* Its own queue on the model's device (on the cpu backend: the device's
     * worker pool, a step at a time with the other instances). */
    duet_status st = duet_backend_stream_open(m->be, NULL, &e->stream);
    if (st == DUET_UNSUPPORTED) e->stream = NULL, st = DUET_OK;
    if (st) goto fail;
    /* The device pools hold exactly the blocks the scheduler hands out;
     * duet__run_new checks kv_blocks against the pools' geometry. */
    st = duet__run_new_on(m, e->stream, p.open.n_ctx, p.max_batch_seqs, p.open.kv_type, p.max_batch_tokens,
                          (int)max_out, p.kv_block_size, p.kv_blocks, &e->run);
    if (st) goto fail;
    const int n_ctx = e->run.n_ctx;
    const int blocks_per_seq = (n_ctx + p.kv_block_size - 1) / p.kv_block_size;
    const int kv_blocks = e->run.state->p.n_blocks; /* resolved: 0 became every slot at full context */
    e->max_blocks = blocks_per_seq;
    /* The scheduler refuses a request whose prompt + max_tokens exceeds the
     * context or the whole pool: the smaller of the two is what fits. */
    e->seq_capacity = kv_blocks * p.kv_block_size < n_ctx ? kv_blocks * p.kv_block_size : n_ctx;
    duet_engine_setup su;
    duet__engine_setup(&p, n_ctx, kv_blocks, spec_max_batch, &su);
    e->budget_share = su.budget_share;
    memcpy(e->slo_itl_s, su.slo_itl_s, sizeof e->slo_itl_s);
    if ((st = duet__sched_new(&su.sched, &e->sched))) goto fail;
    /* One step-cost model: seeded by a profile (duet profile), else by the
     * warm-up's steps, then fitted online from every step. */
    duet__step_cost_online_init(&e->cost, p.step_cost, 0, 0);
    duet__sched_set_cost(e->sched, &e->cost.current);
    e->cost_seeded = p.step_cost != NULL;
    char name[256] = "";
    if (p.served_name && *p.served_name)
        snprintf(name, sizeof name, "%s", p.served_name);
    else if (duet_model_meta(m, "general.name", name, sizeof name) < 0)
        snprintf(name, sizeof name, "%s", path ? path : "model");
    snprintf(e->name, sizeof e->name, "%s", name);
    e->metrics = duet__metrics_new(name);
    e->prefix_cache = !p.no_prefix_cache;
    e->t_start = now_ns();
    if (p.step_log) {
        if (!(e->step_log = fopen(p.step_log, "w"))) {
            st = duet__error(DUET_INVALID_ARGUMENT, "step log %s: %s", p.step_log, strerror(errno));
            goto fail;
        }
        fprintf(e->step_log,
                "start_s,idle_s,seqs,decode_tokens,prefill_tokens,decode_ctx,prefill_ctx,seconds,"
                "draft_seconds,predicted_s,profile_s,learnt\n");
    }
    if ((st = duet__ctl_init(&e->ctl, &su.ctl))) goto fail;
    e->ctl_on = !su.static_knobs && duet__ctl_active(&e->ctl);
    e->ctl_window_ns = su.ctl_window_ns;
    e->ctl_next = now_ns() + e->ctl_window_ns;
    /* Requests in flight at most: every waiting one plus every running one. */
    e->cap = p.max_waiting + p.max_batch_seqs + 1;
    e->max_tokens = p.max_batch_tokens;
    e->max_seqs = p.max_batch_seqs;
    e->reqs = calloc((size_t)e->cap, sizeof *e->reqs);
    e->cancel_list = calloc((size_t)e->cap, sizeof *e->cancel_list);
    e->plan_seqs = calloc((size_t)p.max_batch_seqs, sizeof *e->plan_seqs);
    e->results = calloc((size_t)p.max_batch_seqs, sizeof *e->results);
    e->tok = calloc((size_t)p.max_batch_tokens, sizeof(int32_t));
    e->pos = calloc((size_t)p.max_batch_tokens, sizeof(int32_t));
    e->seq = calloc((size_t)p.max_batch_tokens, sizeof(int32_t));
    e->out = calloc((size_t)p.max_batch_tokens, sizeof(int32_t));
    e->row_of = calloc((size_t)p.max_batch_tokens, sizeof(int32_t));
    e->want = calloc((size_t)p.max_batch_tokens, sizeof(bool));
    e->raw = malloc((size_t)m->hp.n_vocab * sizeof(float));
    e->tables = malloc((size_t)p.max_batch_seqs * blocks_per_seq * sizeof(int32_t));
    if (e->tables)
        memset(e->tables, 0xff, (size_t)p.max_batch_seqs * blocks_per_seq * sizeof(int32_t)); /* -1 */
    e->step_finish = calloc((size_t)p.max_batch_seqs, sizeof *e->step_finish);
    e->text = malloc(m->detok_size);
    e->err = calloc(1, ENGINE_ERR_SIZE);
    e->spec = spec;
    e->spec_k = spec_k;
    duet__spec_adapt_init(&e->spec_pool, spec_k);
    e->spec_pool.decay = DUET_SPEC_POOL_DECAY;
    if (spec && (st = duet__spec_verifier_new(m->hp.n_vocab, &e->verifier))) goto fail;
    if (spec_mode == DUET_SPEC_DRAFT && (st = draft_start(e, &p, kv_blocks, spec_max_batch))) goto fail;
    duet__step_cost_online_init(&e->dcost, NULL, 0, 0);
    if (!e->metrics || !e->reqs || !e->cancel_list || !e->plan_seqs || !e->results || !e->tok || !e->pos ||
        !e->seq || !e->out || !e->tables || !e->row_of || !e->want || !e->raw || !e->step_finish ||
        !e->text || !e->err) {
        st = duet__error(DUET_OUT_OF_MEMORY, "engine: out of memory");
        goto fail;
    }
    for (int i = 0; i < e->cap; i++)
        if (!(e->reqs[i].stream = malloc((size_t)n_ctx * sizeof(int32_t)))) {
            st = duet__error(DUET_OUT_OF_MEMORY, "engine: out of memory for request streams");
            goto fail;
        }
    if (pthread_create(&e->thread, NULL, engine_main, e)) {
        st = duet__error(DUET_OUT_OF_MEMORY, "engine: cannot start its thread: %s", strerror(errno));
        goto fail;
    }
    e->thread_started = true;
    *out = e;
    return DUET_OK;
fail:
    engine_free(e);
    return st;
}

duet_backend *duet__engine_backend(duet_engine *e) {
    return e->stream ? e->stream : e->model->be;
}

duet_status duet_engine_start_model(duet_model *model, const duet_engine_params *params, duet_engine **out) {
    if (!out) return duet__error(DUET_INVALID_ARGUMENT, "duet_engine_start_model: out is NULL");
    *out = NULL;
    if (!model) return duet__error(DUET_INVALID_ARGUMENT, "duet_engine_start_model: model is NULL");
    if (model->vocab_only)
        return duet__error(DUET_INVALID_ARGUMENT, "duet_engine_start_model: the model was opened vocab-only");
    duet_engine_params p = {0};
    duet_status st = duet__engine_params_check(params, &p);
    if (st) return st;
    return engine_start(duet__model_ref(model), NULL, p, false, out);
}

duet_status duet__engine_start_borrowed(duet_model *m, const duet_engine_params *params, duet_engine **out) {
    *out = NULL;
    duet_engine_params p = {0};
    duet_status st = duet__engine_params_check(params, &p);
    return st ? st : engine_start(m, NULL, p, true, out);
}

duet_status duet_engine_start(const char *path, const duet_engine_params *params, duet_engine **out) {
    if (!out) return duet__error(DUET_INVALID_ARGUMENT, "duet_engine_start: out is NULL");
    *out = NULL;
    duet_engine_params p = {0};
    duet_status st = duet__engine_params_check(params, &p);
    if (st) return st;
    duet_open_params op = p.open;
    op.weights_only = true; /* the engine makes its own run state */
    duet_model *m;
    if ((st = duet_model_open(path, &op, &m))) return st;
    return engine_start(m, path, p, false, out);
}

void duet_engine_stop(duet_engine *e, bool drain) {
    if (!e) return;
    pthread_mutex_lock(&e->mu);
    e->stopping = true;
    e->drain = drain;
    if (!drain) {
        /* Remove everything from the scheduler; the thread then owes each a
         * DONE(CANCELLED) and exits. */
        for (int i = 0; i < e->cap; i++) {
            engine_req *r = &e->reqs[i];
            if (r->id && !r->cancelled && r->finish == DUET_FINISH_NONE) {
                duet__sched_cancel(e->sched, now_ns(), r->id);
                r->cancelled = true;
                e->cancel_list[e->n_cancel++] = r->id;
            }
        }
    }
    pthread_cond_signal(&e->cv);
    pthread_mutex_unlock(&e->mu);
    if (e->thread_started) pthread_join(e->thread, NULL);
    engine_free(e);
}

/* The warm-up batch: the k tokens in e->tok/pos/seq, the last n_out
 * ones' logits. */
static duet_batch warm_batch(duet_engine *e, int k, int n_out) {
    for (int i = 0; i < n_out; i++)
        e->out[i] = k - n_out + i;
    return (duet_batch){.n_tokens = k,
                        .tokens = e->tok,
                        .pos = e->pos,
                        .seq = e->seq,
                        .n_out = n_out,
                        .out = e->out,
                        .block_tables = e->tables};
}

/* One warm-up forward pass (under mu): k tokens at positions pos0.. of
 * slot 0, the last n_out ones' logits; *seconds its time. */
static duet_status warm_pass(duet_engine *e, int k, int pos0, int n_out, double *seconds) {
    for (int i = 0; i < k; i++) {
        e->tok[i] = 0;
        e->pos[i] = pos0 + i;
        e->seq[i] = 0;
    }
    duet_batch b = warm_batch(e, k, n_out);
    int64_t t0 = now_ns();
    duet_status st = duet__run_forward(e->model, &e->run, &b, e->run.logits);
    *seconds = secs(now_ns() - t0);
    return st;
}

/* The draft model's warm-up: the batch warm_pass just ran (k tokens);
 * timed into the draft's step-cost model as a pass of k tokens. */
static duet_status draft_warm_pass(duet_engine *e, int k, bool timed) {
    duet_batch b = warm_batch(e, k, 1);
    int64_t t0 = now_ns();
    duet_status st = duet__run_forward(e->draft, &e->drun, &b, e->drun.logits);
    if (!st && timed) {
        duet_step_shape sh = {0};
        duet_step_shape_add(&sh, e->pos[0], k, true);
        duet__step_cost_online_observe(&e->dcost, &sh, secs(now_ns() - t0));
    }
    return st;
}

duet_status duet_engine_warmup(duet_engine *e) {
    if (!e) return duet__error(DUET_INVALID_ARGUMENT, "duet_engine_warmup: e is NULL");
    pthread_mutex_lock(&e->mu);
    /* The engine thread plans under mu, so nothing steps while it is held;
     * an engine that already has work is warm (or soon will be) anyway. */
    if (duet__sched_busy(e->sched) || e->lost) {
        pthread_mutex_unlock(&e->mu);
        return DUET_OK;
    }
    /* Slot 0 in the first KV blocks: a request given those blocks later
     * writes each position before it reads it, so what is left there is
     * never seen (the prefix cache is cleared below, since it would). */
    const int bs = e->run.state->p.block_size;
    int n = 8;
    if (n > e->max_tokens) n = e->max_tokens;
    if (n > e->run.n_ctx - 1) n = e->run.n_ctx - 1;
    if (n > bs - 1) n = bs - 1;
    /* The timed passes: a longer chunk over the first blocks, so the
     * step-cost model starts from prefill and decode steps of this device. */
    int blocks = e->run.state->p.n_blocks < e->max_blocks ? e->run.state->p.n_blocks : e->max_blocks;
    int big = 32;
    if (big > e->max_tokens) big = e->max_tokens;
    if (big > e->run.n_ctx - 1) big = e->run.n_ctx - 1;
    if (big > blocks * bs - 1) big = blocks * bs - 1;
    /* Block 0 may hold a cached prefix: the cache forgets it (and the
     * draft's marks of the blocks written here). */
    duet__sched_prefix_clear(e->sched);
    for (int j = 0; j < e->max_blocks; j++) {
        e->tables[j] = j * bs <= big ? j : -1;
        if (e->dkey && j * bs <= big) e->dkey[j] = 0;
    }
    duet_status st = DUET_OK;
    double t;
    /* With speculation, a verification: 1 + spec_k decode tokens, each with
     * logits, after the `big` chunk and within the blocks written. */
    int verify = e->spec ? 1 + e->spec_k : 0;
    if (verify > e->run.max_out) verify = e->run.max_out;
    if (verify > (big / bs + 1) * bs - big) verify = (big / bs + 1) * bs - big;
    /* A prompt chunk of n tokens, then one decode token: each path's first
     * run (pipeline and kernel builds, first touches) happens here, untimed.
     * So does a verification's, and the draft's spec_k one-token passes
     * (one step's drafting): a step's first run of a shape costs far more
     * than the next, and a verification timed cold made the fit's
     * per-token cost so high that the decision refused every draft. */
    if (n >= 1) st = warm_pass(e, n, 0, 1, &t);
    if (!st && n >= 1 && e->draft) st = draft_warm_pass(e, n, false);
    if (!st && n >= 1) st = warm_pass(e, 1, n, 1, &t);
    if (!st && n >= 1 && e->draft) st = draft_warm_pass(e, 1, false);
    if (!st && n >= 1 && big > n && verify >= 2) st = warm_pass(e, verify, big, verify, &t);
    for (int j = 1; !st && n >= 1 && e->draft && j < e->spec_k; j++)
        st = draft_warm_pass(e, 1, false);
    /* Then timed (these alone enter the fits): a chunk of `big` and of n
     * tokens, decodes after them; the verification again (a decode's
     * per-token cost is then measured apart from the step's fixed cost)
     * and the draft's passes of one token and of a chunk. */
    const struct {
        int n, pos;
        bool decode;
    } shapes[5] = {{big, 0, false}, {1, big, true}, {n, 0, false}, {1, n, true}, {verify, big, true}};
    for (int i = 0; i < 5 && !st && n >= 1 && big > n; i++) {
        if (shapes[i].n < 2 && i == 4) break;
        st = warm_pass(e, shapes[i].n, shapes[i].pos, shapes[i].decode ? shapes[i].n : 1, &t);
        duet_step_shape sh = {0};
        duet_step_shape_add(&sh, shapes[i].pos, shapes[i].n, shapes[i].decode);
        if (!st) duet__step_cost_online_observe(&e->cost, &sh, t);
        if (!st && e->draft && i >= 2) st = draft_warm_pass(e, i == 2 ? n : 1, true);
    }
    duet__sched_set_cost(e->sched, duet__step_cost_online_get(&e->cost));
    if (e->draft) duet__sched_set_draft_cost(e->sched, duet__step_cost_online_get(&e->dcost));
    if (!st && n >= 1)
        e->warm_kinds |= WARM_DECODE | WARM_PROMPT | (big > n && verify >= 2 ? WARM_VERIFY : 0) |
                         (e->draft ? WARM_DRAFT : 0);
    for (int j = 0; j < e->max_blocks; j++)
        e->tables[j] = -1;
    pthread_mutex_unlock(&e->mu);
    return st;
}

duet_metrics *duet__engine_metrics(duet_engine *e) {
    pthread_mutex_lock(&e->mu);
    update_gauges(e);
    pthread_mutex_unlock(&e->mu);
    return e->metrics;
}

char *duet_engine_metrics(duet_engine *e) {
    pthread_mutex_lock(&e->mu);
    update_gauges(e);
    pthread_mutex_unlock(&e->mu);
    duet_step_cost_report cost;
    duet__engine_step_cost(e, &cost);
    char *text = duet__metrics_render(e->metrics);
    /* The step-cost families follow the metrics module's. */
    char *extra = duet__step_cost_render_prom(&cost, e->name);
    size_t len = text ? strlen(text) : 0, n = extra ? strlen(extra) : 0;
    char *all = text && extra ? realloc(text, len + n + 1) : NULL;
    if (all) {
        memcpy(all + len, extra, n + 1);
        text = all;
    }
    free(extra);
    return text;
}

void duet__engine_step_cost(duet_engine *e, duet_step_cost_report *out) {
    pthread_mutex_lock(&e->mu);
    *out = (duet_step_cost_report){.model = *duet__step_cost_online_get(&e->cost),
                                   .n_steps = e->cost.n_steps,
                                   .seeded = e->cost_seeded,
                                   .speed = e->served};
    pthread_mutex_unlock(&e->mu);
}

duet_status duet_engine_step_cost(duet_engine *e, duet_step_cost *out) {
    if (!e || !out) return duet__error(DUET_INVALID_ARGUMENT, "duet_engine_step_cost: NULL argument");
    pthread_mutex_lock(&e->mu);
    *out = *duet__step_cost_online_get(&e->cost);
    pthread_mutex_unlock(&e->mu);
    return DUET_OK;
}

duet_status duet_engine_set_step_cost(duet_engine *e, const duet_step_cost *prior) {
    if (!e || !prior) return duet__error(DUET_INVALID_ARGUMENT, "duet_engine_set_step_cost: NULL argument");
    duet_status st = duet__step_cost_check(prior);
    if (st) return st;
    pthread_mutex_lock(&e->mu);
    duet__step_cost_online_init(&e->cost, prior, 0, 0);
    duet__sched_set_cost(e->sched, &e->cost.current);
    e->cost_seeded = true;
    memset(&e->served, 0, sizeof e->served);
    pthread_mutex_unlock(&e->mu);
    return DUET_OK;
}
