/* duet_internal.h — the model handle's insides, shared by the public API
 * (duet.c), the evaluation code (eval.c) and the serving engine (engine.c).
 * Not installed.
 *
 * Three lifetimes (ARCHITECTURE.md):
 * - the model (struct duet_model): the GGUF file, tokenizer and weights on
 *   one device, loaded once and reference-counted; every engine that serves
 *   it holds a reference, so several instances share one copy of the
 *   weights;
 * - the instance (struct duet_engine, engine.c): its own stream on the
 *   model's device (duet_backend_stream_open: a queue, command recording
 *   and scratch of its own, the weights shared), its run state (duet_run:
 *   activations and the paged KV cache, recorded on that stream),
 *   scheduler, engine thread and knobs;
 * - the sequence (engine.c's engine_req): sampler, detokenizer, stop
 *   matcher, finish rule.
 * duet_generate is a synchronous client of an instance: the handle's own
 * engine (model->client), started at its first call and borrowing the
 * model. duet_eval and duet_quality_eval (one forward at a time, not a
 * decode loop) run on the handle's run state, model->run, made at their
 * first call (duet__model_open's callers with a geometry get it at open).
 *
 * Locking: a model's weights are read-only once loaded. A run on its own
 * stream (every engine's, when the backend has streams) records, allocates
 * and uploads with no lock: instances that share a model run their steps
 * at once, each on its own queue. The model's backend itself (m->be)
 * records one step at a time, so what goes through it takes device_mu: the
 * synchronous API's forward passes and run-state allocations (a run with
 * no stream: duet__run_forward, duet__run_new), and weights a draft model
 * loads onto its target's backend. An engine whose backend has no streams
 * (DUET_UNSUPPORTED) runs on m->be under device_mu too, taking turns.
 */
#ifndef DUET_INTERNAL_H
#define DUET_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>

#include "duet.h"
#include "forward.h"
#include "metrics.h"
#include "tokenizer.h"

/* A run state on a model's device: what one instance (or the handle's
 * synchronous API) computes with. */
typedef struct duet_run {
    /* The stream its steps record on (borrowed: the instance's), or NULL:
     * the model's backend, under device_mu. */
    duet_backend *stream;
    duet_state *state; /* activations for max_step_tokens, paged KV for n_seqs (NULL: none yet) */
    float *logits;     /* host [max_out][n_vocab] */
    int n_ctx, n_seqs;
    int max_step_tokens, max_out;
} duet_run;

struct duet_model {
    atomic_int refs; /* the opener's handle + one per engine serving it */
    duet_gguf *gguf;
    duet_tokenizer *tok;
    duet_hparams hp;
    bool vocab_only;
    duet_backend *be;
    duet_weights w;
    pthread_mutex_t device_mu; /* one step (or allocation, or upload) at a time on be itself */
    duet_open_params open;     /* as opened (backend name not kept): n_ctx, n_seqs, kv_type for runs */
    char kv_type[8];           /* open.kv_type's text ("" = default) */
    int n_ctx;                 /* the context runs get unless they ask for another */
    duet_run run;              /* duet_eval's run state (state NULL until made) */
    size_t detok_size;         /* bytes a detokenizer buffer needs for any one token */
    int spec_mode;             /* duet_spec_mode: how duet_generate's instance speculates */
    int spec_k;                /* with at most this many draft tokens per step */
    duet_model *draft;         /* the draft model (spec_mode DUET_SPEC_DRAFT; owned), or NULL */
    char *draft_path;          /* its file (owned), for the instance's params */
    /* duet_generate's instance: started at its first call, borrowing this
     * model (it holds no reference); stopped by the model's last close. */
    duet_engine *client;
    /* A draft model's target, whose backend (device and device_mu) it
     * shares: borrowed, it outlives the draft. NULL for a model of its own. */
    duet_model *host;
};

/* duet_model_open with the step sizes the caller needs (the engine batches
 * up to max_step_tokens tokens and max_out logit rows per step) and the
 * paged KV cache's geometry (kv_block_size 0 = 16; kv_blocks 0 = enough
 * for every slot at full context, with identity block tables), for the
 * handle's own run state. */
duet_status duet__model_open(const char *path, const duet_open_params *params, int max_step_tokens,
                             int max_out, int kv_block_size, int kv_blocks, duet_model **out);

/* Opens `path` as a draft model for target m (p: the target's open
 * params, of which n_threads and kv_type apply): its vocabulary is checked
 * against m's token for token first (DUET_BAD_MODEL naming both otherwise),
 * then its weights load on m's backend, which it shares (m->device_mu
 * serialises both); it has no run state of its own (an engine makes the
 * draft's KV pool). The draft must be closed before m. */
duet_status duet__draft_open(duet_model *m, const char *path, const duet_open_params *p, duet_model **out);

/* Another reference to m (for an engine that serves it); duet_model_close
 * drops one, and the last frees the model. */
duet_model *duet__model_ref(duet_model *m);

/* A run state on m's device: n_ctx 0 = the model's, n_seqs sequence slots,
 * kv_type NULL or "" = the model's default, steps of up to max_step_tokens
 * tokens and max_out logit rows, KV geometry as duet__model_open. */
duet_status duet__run_new(duet_model *m, int n_ctx, int n_seqs, const char *kv_type, int max_step_tokens,
                          int max_out, int kv_block_size, int kv_blocks, duet_run *out);
/* The same on `stream`, a stream of m's backend (NULL: m's backend), which
 * must outlive the run. */
duet_status duet__run_new_on(duet_model *m, duet_backend *stream, int n_ctx, int n_seqs, const char *kv_type,
                             int max_step_tokens, int max_out, int kv_block_size, int kv_blocks,
                             duet_run *out);
void duet__run_free(duet_model *m, duet_run *run);
/* One forward step of `run` on m's device (on its stream, or holding
 * device_mu); the logits land in `logits` (b->n_out rows of n_vocab;
 * run->logits fits max_out). */
duet_status duet__run_forward(duet_model *m, duet_run *run, const duet_batch *b, float *logits);
/* Tests: when set, duet_profile_run passes each step it runs (its shape
 * and measured seconds) through this hook, which may replace the seconds:
 * a device whose step times depend on what ran before. */
extern void (*duet__profile_step_hook)(const duet_step_shape *shape, double *seconds);
/* Makes m->run at first use (duet_eval, duet_quality_eval). */
duet_status duet__model_own_run(duet_model *m);

/* The backend an engine's steps record on: its stream, or the model's
 * backend when that has no streams (tests inject faults there). */
duet_backend *duet__engine_backend(duet_engine *e);

/* duet_engine_start_model, except that the engine borrows m (holds no
 * reference): m's owner stops it before m goes (duet_generate's instance). */
duet_status duet__engine_start_borrowed(duet_model *m, const duet_engine_params *params, duet_engine **out);

/* The engine's metrics, its gauges refreshed (for a fleet's export and
 * its router's speed estimates). Takes the engine's lock briefly. */
duet_metrics *duet__engine_metrics(duet_engine *e);
/* The engine's current step-cost model (as duet_engine_step_cost), the
 * steps it learnt from and, when a profile seeded it, the served and
 * profiled seconds since (for /metrics). */
struct duet_step_cost_report;
void duet__engine_step_cost(duet_engine *e, struct duet_step_cost_report *out);

#endif
