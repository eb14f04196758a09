/* duet.c — the public API: open a model on a backend, tokenize, evaluate,
 * and generate as a synchronous client of the handle's own instance. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "duet.h"
#include "forward.h"
#include "speculative.h"
#include "tokenizer.h"
#include "duet_internal.h"

/* Prefill runs in chunks of this many tokens (the step's activation size). */
#define DUET_PREFILL_CHUNK 256
/* Logit rows one step of the handle's run state can return (duet_quality_eval
 * scores that many positions per step). */
#define DUET_MAX_OUT 64

duet_open_params duet_open_params_default(void) {
    return (duet_open_params){.backend = "auto", .device = -1};
}

/* CPU time of the whole process (all its threads), for measurements on a
 * shared machine where wall time depends on the neighbours' load. */
static double cpu_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* The first weight's type decides the KV default: f32 models keep f32 KV. */
static duet_dtype default_kv_type(const duet_weights *w) {
    return w->layers && w->layers[0].wq.type == DUET_DTYPE_F32 ? DUET_DTYPE_F32 : DUET_DTYPE_F16;
}

/* A token's text has no length limit in GGUF. The detokenizer emits at most
 * three bytes (U+FFFD) per byte of a token plus a pending partial
 * character, so size buffers from the longest token. */
static size_t detok_size(const duet_tokenizer *t) {
    int longest = 0;
    for (int id = 0; id < duet_tokenizer_n_vocab(t); id++) {
        int n = duet_tokenizer_token_bytes(t, id, false, NULL, 0);
        if (n > longest) longest = n;
    }
    return 3 * ((size_t)longest + 4) + 1;
}

static duet_status model_open(const char *path, const duet_open_params *params, int max_step_tokens,
                              int max_out, int kv_block_size, int kv_blocks, duet_model *host,
                              duet_model **out);

/* The lock of m's backend: its own, or its host's when it shares the host's. */
static pthread_mutex_t *device_mu(duet_model *m) {
    return m->host ? &m->host->device_mu : &m->device_mu;
}

duet_status duet__draft_open(duet_model *m, const char *path, const duet_open_params *p, duet_model **out) {
    *out = NULL;
    duet_open_params dp = *p;
    dp.draft = NULL;
    dp.spec = NULL;
    dp.vocab_only = true;
    duet_model *v;
    char why[512];
    duet_status st = duet__model_open(path, &dp, DUET_PREFILL_CHUNK, DUET_MAX_OUT, 0, 0, &v);
    if (st) {
        snprintf(why, sizeof why, "%s", duet_last_error());
        return duet__error(st, "draft model %s: %s", path, why);
    }
    int nt = duet_tokenizer_n_vocab(m->tok), nd = duet_tokenizer_n_vocab(v->tok), nv = v->hp.n_vocab;
    if (nt != nd || m->hp.n_vocab != nv) {
        duet_model_close(v);
        return duet__error(
            DUET_BAD_MODEL,
            "draft model %s has %d tokens (%d logits), the target %d (%d): speculative decoding needs "
            "the same vocabulary",
            path, nd, nv, nt, m->hp.n_vocab);
    }
    for (int id = 0; id < nt; id++) {
        char a[256], b[256];
        int la = duet_tokenizer_token_bytes(m->tok, id, true, a, sizeof a);
        int lb = duet_tokenizer_token_bytes(v->tok, id, true, b, sizeof b);
        if (la != lb || (la > 0 && memcmp(a, b, (size_t)(la < (int)sizeof a ? la : (int)sizeof a)))) {
            duet_model_close(v);
            return duet__error(
                DUET_BAD_MODEL,
                "draft model %s: token %d differs from the target's: speculative decoding needs the "
                "same vocabulary",
                path, id);
        }
    }
    duet_model_close(v);
    dp.vocab_only = false;
    dp.weights_only = true; /* an engine makes the draft's KV pool */
    dp.n_ctx = m->n_ctx;
    dp.n_seqs = 1;
    st = model_open(path, &dp, DUET_PREFILL_CHUNK, DUET_MAX_OUT, 0, 0, m, out);
    if (st) {
        snprintf(why, sizeof why, "%s", duet_last_error());
        return duet__error(st, "draft model %s: %s", path, why);
    }
    return DUET_OK;
}

duet_status duet_model_open(const char *path, const duet_open_params *params, duet_model **out) {
    /* Run states come at first use: duet_generate's is its instance's. */
    duet_open_params p = params ? *params : duet_open_params_default();
    p.weights_only = true;
    return duet__model_open(path, &p, DUET_PREFILL_CHUNK, DUET_MAX_OUT, 0, 0, out);
}

duet_model *duet__model_ref(duet_model *m) {
    atomic_fetch_add(&m->refs, 1);
    return m;
}

static duet_status parse_kv_type(const char *name, const duet_weights *w, duet_dtype *out) {
    *out = default_kv_type(w);
    if (!name || !*name) return DUET_OK;
    if (strcmp(name, "f32") == 0)
        *out = DUET_DTYPE_F32;
    else if (strcmp(name, "f16") == 0)
        *out = DUET_DTYPE_F16;
    else if (strcmp(name, "q8_0") == 0)
        *out = DUET_DTYPE_Q8_0;
    else
        return duet__error(DUET_INVALID_ARGUMENT, "kv type '%s' is not supported (use f32, f16 or q8_0)",
                           name);
    return DUET_OK;
}

duet_status duet__run_new(duet_model *m, int n_ctx, int n_seqs, const char *kv_type, int max_step_tokens,
                          int max_out, int kv_block_size, int kv_blocks, duet_run *out) {
    return duet__run_new_on(m, NULL, n_ctx, n_seqs, kv_type, max_step_tokens, max_out, kv_block_size,
                            kv_blocks, out);
}

duet_status duet__run_new_on(duet_model *m, duet_backend *stream, int n_ctx, int n_seqs, const char *kv_type,
                             int max_step_tokens, int max_out, int kv_block_size, int kv_blocks,
                             duet_run *out) {
    memset(out, 0, sizeof *out);
    if (m->vocab_only) return duet__error(DUET_INVALID_ARGUMENT, "the model was opened vocab-only");
    if (n_ctx < 0 || n_ctx > (1 << 20))
        return duet__error(DUET_INVALID_ARGUMENT, "n_ctx %d out of range [0, 1048576]", n_ctx);
    if (n_seqs < 0 || n_seqs > 4096)
        return duet__error(DUET_INVALID_ARGUMENT, "n_seqs %d out of range [0, 4096]", n_seqs);
    duet_dtype kv;
    duet_status st = parse_kv_type(kv_type && *kv_type ? kv_type : m->kv_type, &m->w, &kv);
    if (st) return st;
    if (max_step_tokens < DUET_PREFILL_CHUNK) max_step_tokens = DUET_PREFILL_CHUNK;
    if (max_out < 1) max_out = 1;
    if (max_out > max_step_tokens) max_out = max_step_tokens;
    out->n_ctx = n_ctx ? n_ctx : m->n_ctx;
    out->n_seqs = n_seqs ? n_seqs : 1;
    out->max_step_tokens = max_step_tokens;
    out->max_out = max_out;
    duet_state_params sp = {.max_tokens = max_step_tokens,
                            .max_out = max_out,
                            .n_ctx = out->n_ctx,
                            .n_seqs = out->n_seqs,
                            .kv_type = kv,
                            .block_size = kv_block_size,
                            .n_blocks = kv_blocks};
    out->stream = stream;
    /* A stream allocates and uploads on its own; m->be takes turns. */
    if (!stream) pthread_mutex_lock(device_mu(m));
    st = duet__state_new(stream ? stream : m->be, &m->hp, &m->w, &sp, &out->state);
    if (!stream) pthread_mutex_unlock(device_mu(m));
    if (!st && !(out->logits = malloc((size_t)max_out * m->hp.n_vocab * sizeof(float))))
        st = duet__error(DUET_OUT_OF_MEMORY, "out of memory for logits");
    if (st) duet__run_free(m, out);
    return st;
}

void duet__run_free(duet_model *m, duet_run *run) {
    if (run->state) {
        if (!run->stream) pthread_mutex_lock(device_mu(m));
        duet__state_free(run->state);
        if (!run->stream) pthread_mutex_unlock(device_mu(m));
    }
    free(run->logits);
    memset(run, 0, sizeof *run);
}

duet_status duet__run_forward(duet_model *m, duet_run *run, const duet_batch *b, float *logits) {
    if (run->stream) return duet__forward(run->state, &m->hp, &m->w, b, logits); /* its own queue */
    pthread_mutex_lock(device_mu(m));
    duet_status st = duet__forward(run->state, &m->hp, &m->w, b, logits);
    pthread_mutex_unlock(device_mu(m));
    return st;
}

duet_status duet__model_own_run(duet_model *m) {
    if (m->run.state) return DUET_OK;
    return duet__run_new(m, m->n_ctx, m->open.n_seqs, NULL, DUET_PREFILL_CHUNK, DUET_MAX_OUT, 0, 0, &m->run);
}

duet_status duet__model_open(const char *path, const duet_open_params *params, int max_step_tokens,
                             int max_out, int kv_block_size, int kv_blocks, duet_model **out) {
    return model_open(path, params, max_step_tokens, max_out, kv_block_size, kv_blocks, NULL, out);
}

/* duet__model_open; with a host, the weights go to the host's backend
 * (shared, not reopened: the draft model of a target). */
static duet_status model_open(const char *path, const duet_open_params *params, int max_step_tokens,
                              int max_out, int kv_block_size, int kv_blocks, duet_model *host,
                              duet_model **out) {
    if (!out) return duet__error(DUET_INVALID_ARGUMENT, "duet_model_open: out is NULL");
    *out = NULL;
    if (!path) return duet__error(DUET_INVALID_ARGUMENT, "duet_model_open: path is NULL");
    duet_open_params p = params ? *params : duet_open_params_default();
    if (p.n_ctx < 0 || p.n_ctx > (1 << 20))
        return duet__error(DUET_INVALID_ARGUMENT, "n_ctx %d out of range [0, 1048576]", p.n_ctx);
    if (p.n_seqs < 0 || p.n_seqs > 4096)
        return duet__error(DUET_INVALID_ARGUMENT, "n_seqs %d out of range [0, 4096]", p.n_seqs);
    if (p.n_threads < 0 || p.n_threads > 1024)
        return duet__error(DUET_INVALID_ARGUMENT, "n_threads %d out of range [0, 1024]", p.n_threads);
    if (p.kv_type && strlen(p.kv_type) >= 8)
        return duet__error(DUET_INVALID_ARGUMENT, "kv type '%s' is not supported (use f32, f16 or q8_0)",
                           p.kv_type);

    duet_spec_mode spec;
    int spec_k;
    duet_status st = duet__spec_params(&p, &spec, &spec_k);
    if (st) return st;

    duet_model *m = calloc(1, sizeof *m);
    if (!m) return duet__error(DUET_OUT_OF_MEMORY, "out of memory");
    atomic_init(&m->refs, 1);
    pthread_mutex_init(&m->device_mu, NULL);
    m->open = p;
    m->open.backend = NULL; /* not kept: the caller's string */
    m->open.kv_type = NULL;
    snprintf(m->kv_type, sizeof m->kv_type, "%s", p.kv_type ? p.kv_type : "");
    st = duet_gguf_open(path, &m->gguf);
    m->spec_mode = p.vocab_only ? DUET_SPEC_OFF : (int)spec;
    m->spec_k = spec_k;
    m->open.spec = NULL; /* not kept: the caller's strings */
    m->open.draft = NULL;
    if (st) goto fail;
    if ((st = duet_tokenizer_load(m->gguf, &m->tok))) goto fail;
    m->detok_size = detok_size(m->tok);
    m->vocab_only = p.vocab_only;
    if (p.vocab_only) {
        /* Hyperparameters are informative only here; a vocab file may lack them. */
        if (duet__hparams_load(m->gguf, &m->hp) != DUET_OK) {
            memset(&m->hp, 0, sizeof m->hp);
            duet_gguf_get_str(m->gguf, "general.architecture", m->hp.arch, sizeof m->hp.arch);
            m->hp.n_vocab = duet_tokenizer_n_vocab(m->tok);
        }
        *out = m;
        return DUET_OK;
    }
    if ((st = duet__hparams_load(m->gguf, &m->hp))) goto fail;
    if (duet_tokenizer_n_vocab(m->tok) > m->hp.n_vocab) {
        st = duet__error(DUET_BAD_MODEL, "model: tokenizer has %d tokens but the embedding only %d rows",
                         duet_tokenizer_n_vocab(m->tok), m->hp.n_vocab);
        goto fail;
    }
    duet_backend_params bp = {.n_threads = p.n_threads};
    m->host = host;
    if (host)
        m->be = host->be;
    else if ((st = duet_backend_open(p.backend, p.device, &bp, &m->be)))
        goto fail;
    /* A draft's weights go up through its target's backend, which the
     * synchronous API may be stepping on: take turns with it. */
    if (host) pthread_mutex_lock(device_mu(host));
    st = duet__weights_load(m->gguf, &m->hp, m->be, &m->w);
    if (host) pthread_mutex_unlock(device_mu(host));
    if (st) goto fail;

    m->n_ctx = p.n_ctx ? p.n_ctx : (m->hp.n_ctx_train < 4096 ? m->hp.n_ctx_train : 4096);
    duet_dtype kv;
    if ((st = parse_kv_type(m->kv_type, &m->w, &kv))) goto fail;
    if (!p.weights_only && (st = duet__run_new(m, m->n_ctx, p.n_seqs, NULL, max_step_tokens, max_out,
                                               kv_block_size, kv_blocks, &m->run)))
        goto fail;
    if (m->spec_mode == DUET_SPEC_DRAFT && (st = duet__draft_open(m, p.draft, &p, &m->draft))) goto fail;
    if (m->spec_mode == DUET_SPEC_DRAFT && !(m->draft_path = strdup(p.draft))) {
        st = duet__error(DUET_OUT_OF_MEMORY, "out of memory");
        goto fail;
    }
    *out = m;
    return DUET_OK;
fail:;
    /* Keep the message of the first failure: closing does not set errors. */
    duet_model_close(m);
    return st;
}

void duet_model_close(duet_model *m) {
    if (!m) return;
    if (atomic_fetch_sub(&m->refs, 1) > 1) return; /* an engine still serves it */
    /* duet_generate's instance borrows m and m->draft: it goes first. */
    duet_engine_stop(m->client, false);
    duet_model_close(m->draft);
    free(m->draft_path);
    duet__run_free(m, &m->run);
    if (m->be) duet__weights_free(m->be, &m->w);
    if (!m->host) duet_backend_close(m->be);
    duet_tokenizer_free(m->tok);
    duet_gguf_close(m->gguf);
    pthread_mutex_destroy(&m->device_mu);
    free(m);
}

void duet_model_describe(const duet_model *m, duet_model_desc *d) {
    memset(d, 0, sizeof *d);
    d->arch = m->hp.arch;
    d->backend = m->be ? m->be->iface->name : "none";
    d->device = m->be ? m->be->info.name : "none";
    d->n_vocab = m->hp.n_vocab;
    d->n_embd = m->hp.n_embd;
    d->n_layer = m->hp.n_layer;
    d->n_head = m->hp.n_head;
    d->n_head_kv = m->hp.n_head_kv;
    d->n_ff = m->hp.n_ff;
    d->n_ctx_train = m->hp.n_ctx_train;
    d->n_ctx = m->n_ctx;
    d->bos = duet_tokenizer_bos(m->tok);
    d->eos = duet_tokenizer_eos(m->tok);
    d->add_bos = duet_tokenizer_add_bos(m->tok);
    d->weight_bytes = m->w.bytes;
}

int duet_model_meta(const duet_model *m, const char *key, char *buf, size_t size) {
    const duet_gguf_kv *kv = duet_gguf_find(m->gguf, key);
    if (!kv || kv->value.type != DUET_GGUF_STRING) return -1;
    if (size)
        snprintf(buf, size, "%.*s", (int)(kv->value.str.len < size ? kv->value.str.len : size - 1),
                 kv->value.str.ptr);
    return (int)kv->value.str.len;
}

int duet_tokenize(const duet_model *m, const char *text, size_t len, bool add_special, bool parse_special,
                  int32_t *ids, int max) {
    if (!m || (!text && len)) return duet__error(DUET_INVALID_ARGUMENT, "duet_tokenize: NULL argument");
    return duet_tokenizer_encode(m->tok, text ? text : "", len, add_special, parse_special, ids, max);
}

int duet_token_piece(const duet_model *m, int32_t id, char *buf, size_t size) {
    return duet_tokenizer_token_bytes(m->tok, id, false, buf, size);
}

/* Evaluates tokens[0..n) of sequence 0 at pos0.. in prefill chunks; the
 * logits of the last token land in m->run.logits. */
static duet_status eval_seq0(duet_model *m, const int32_t *tokens, int n, int pos0) {
    static const int32_t zero = 0;
    int32_t pos[DUET_PREFILL_CHUNK], seq[DUET_PREFILL_CHUNK];
    memset(seq, 0, sizeof seq);
    for (int done = 0; done < n;) {
        int c = n - done < DUET_PREFILL_CHUNK ? n - done : DUET_PREFILL_CHUNK;
        for (int i = 0; i < c; i++)
            pos[i] = pos0 + done + i;
        bool last = done + c == n;
        int32_t out_row = c - 1;
        duet_batch b = {.n_tokens = c,
                        .tokens = tokens + done,
                        .pos = pos,
                        .seq = seq,
                        .n_out = last ? 1 : 0,
                        .out = last ? &out_row : &zero};
        duet_status st = duet__run_forward(m, &m->run, &b, m->run.logits);
        if (st) return st;
        done += c;
    }
    return DUET_OK;
}

duet_status duet_eval(duet_model *m, const int32_t *tokens, int n, int pos0, float *logits) {
    if (!m || !tokens || n < 1) return duet__error(DUET_INVALID_ARGUMENT, "duet_eval: bad arguments");
    if (m->vocab_only) return duet__error(DUET_INVALID_ARGUMENT, "duet_eval: model was opened vocab-only");
    /* n > n_ctx - pos0, not pos0 + n > n_ctx: the sum may overflow. */
    if (pos0 < 0 || pos0 > m->n_ctx || n > m->n_ctx - pos0)
        return duet__error(DUET_CONTEXT_FULL, "duet_eval: %d tokens at position %d exceed the context of %d",
                           n, pos0, m->n_ctx);
    duet_status st = duet__model_own_run(m);
    if (!st) st = eval_seq0(m, tokens, n, pos0);
    if (!st && logits) memcpy(logits, m->run.logits, (size_t)m->hp.n_vocab * sizeof(float));
    return st;
}

/* duet_generate's request in flight on the handle's instance: its events
 * arrive on the engine's thread; DONE wakes the caller. */
typedef struct gen_wait {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool done;
    duet_engine *e;
    const duet_tokenizer *tok;
    duet_token_fn fn;
    void *user;
    bool deliver; /* max_tokens > 0: tokens go to fn and count (0: the prefill alone) */
    bool ignore_eos;
    bool stopped; /* fn returned false: no further call; the request is cancelled */
    duet_generate_stats *stats;
    double t_first, c_first; /* when the first token came (wall, process CPU) */
    double t_done, c_done;
    duet_finish finish;
    duet_status status;
    char message[1024];
} gen_wait;

static void gen_event(const duet_event *ev, void *user) {
    gen_wait *g = user;
    if (ev->kind == DUET_EVENT_TOKEN) {
        if (ev->token >= 0 && !g->t_first) g->t_first = now_seconds(), g->c_first = cpu_seconds();
        if (g->stopped || !g->deliver) return;
        if (ev->token >= 0) {
            g->stats->generated_tokens++;
            if (!g->ignore_eos && duet_tokenizer_is_eog(g->tok, ev->token)) g->stats->stopped_by_eos = true;
        }
        if (g->fn && !g->fn(ev->token, ev->text, ev->text_len, g->user)) {
            g->stopped = true;
            duet_engine_cancel(g->e, ev->request_id); /* refused only when it has just finished */
        }
        return;
    }
    if (ev->kind != DUET_EVENT_DONE) return;
    pthread_mutex_lock(&g->mu);
    g->t_done = now_seconds(), g->c_done = cpu_seconds();
    g->finish = ev->finish;
    g->status = ev->status;
    snprintf(g->message, sizeof g->message, "%s", ev->message ? ev->message : "");
    g->stats->spec_drafts = ev->spec_drafts;
    g->stats->spec_draft_tokens = ev->spec_draft_tokens;
    g->stats->spec_accepted_tokens = ev->spec_accepted_tokens;
    g->done = true;
    pthread_cond_signal(&g->cv);
    pthread_mutex_unlock(&g->mu);
}

/* duet_generate's instance, started at the first call: one sequence, the
 * handle's context and KV type, prefill in chunks of DUET_PREFILL_CHUNK,
 * no batching delay, the open params' speculation. */
static duet_status client_start(duet_model *m) {
    if (m->client) return DUET_OK;
    duet_engine_params p = duet_engine_params_default();
    p.open.n_ctx = m->n_ctx;
    p.open.kv_type = m->kv_type;
    p.open.spec = m->spec_mode == DUET_SPEC_NGRAM ? "ngram" : NULL;
    p.open.draft = m->spec_mode == DUET_SPEC_DRAFT ? m->draft_path : NULL;
    p.open.spec_k = m->spec_k;
    p.max_batch_seqs = 1;
    p.max_batch_tokens = DUET_PREFILL_CHUNK;
    p.prefill_chunk = DUET_PREFILL_CHUNK;
    p.max_waiting = 1;
    p.batch_timeout_ms = 0;
    p.spec_always = true; /* the caller chose speculation for this one stream: every draft is verified */
    return duet__engine_start_borrowed(m, &p, &m->client);
}

duet_status duet_generate(duet_model *m, const int32_t *prompt, int n_prompt, int max_tokens,
                          const duet_sampling *sampling, bool ignore_eos, duet_token_fn fn, void *user,
                          duet_generate_stats *stats) {
    duet_generate_stats local;
    if (!stats) stats = &local;
    memset(stats, 0, sizeof *stats);
    if (!m || !prompt || n_prompt < 1)
        return duet__error(DUET_INVALID_ARGUMENT, "generate: the prompt needs at least one token");
    if (m->vocab_only) return duet__error(DUET_INVALID_ARGUMENT, "generate: model was opened vocab-only");
    if (max_tokens < 0) return duet__error(DUET_INVALID_ARGUMENT, "generate: max_tokens %d < 0", max_tokens);
    if (n_prompt >= m->n_ctx)
        return duet__error(DUET_CONTEXT_FULL, "generate: prompt of %d tokens does not fit the context of %d",
                           n_prompt, m->n_ctx);
    for (int i = 0; i < n_prompt; i++)
        if (prompt[i] < 0 || prompt[i] >= m->hp.n_vocab)
            return duet__error(DUET_INVALID_ARGUMENT, "generate: prompt token %d = %d out of range [0, %d)",
                               i, prompt[i], m->hp.n_vocab);
    duet_status st = client_start(m);
    if (st) return st;
    stats->prompt_tokens = n_prompt;
    duet_request q = {.prompt = prompt,
                      .n_prompt = n_prompt,
                      .max_tokens = max_tokens > 0 ? max_tokens : 1,
                      .sampling = sampling ? *sampling : duet_sampling_default(),
                      .priority = DUET_PRIORITY_INTERACTIVE,
                      .ignore_eos = ignore_eos};
    gen_wait g = {.e = m->client,
                  .tok = m->tok,
                  .fn = fn,
                  .user = user,
                  .deliver = max_tokens > 0,
                  .ignore_eos = ignore_eos,
                  .stats = stats};
    pthread_mutex_init(&g.mu, NULL);
    pthread_cond_init(&g.cv, NULL);
    double t0 = now_seconds();
    st = duet_engine_submit(m->client, &q, gen_event, &g, NULL);
    if (st == DUET_BAD_REQUEST) { /* bad sampling settings: duet_generate's own code */
        char why[512];
        snprintf(why, sizeof why, "%s", duet_last_error());
        st = duet__error(DUET_INVALID_ARGUMENT, "generate: %s", why);
    }
    if (!st) {
        pthread_mutex_lock(&g.mu);
        while (!g.done)
            pthread_cond_wait(&g.cv, &g.mu);
        pthread_mutex_unlock(&g.mu);
        /* Prefill: to the first token (its sampling included); decode: from it to the end. */
        double t1 = g.t_first ? g.t_first : g.t_done;
        stats->prefill_seconds = t1 - t0;
        stats->decode_seconds = g.t_done - t1;
        stats->decode_cpu_seconds = g.t_first ? g.c_done - g.c_first : 0;
        if (g.finish == DUET_FINISH_ERROR)
            st = duet__error(g.status ? g.status : DUET_DEVICE, "generate: %s", g.message);
        else if (g.finish == DUET_FINISH_CANCELLED && !g.stopped)
            st = duet__error(DUET_CANCELLED, "generate: the instance stopped");
    }
    pthread_cond_destroy(&g.cv);
    pthread_mutex_destroy(&g.mu);
    return st;
}
