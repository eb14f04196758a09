/* duet.c — the public API: open a model on a backend, tokenize, generate. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "duet.h"
#include "forward.h"
#include "sampler.h"
#include "speculative.h"
#include "tokenizer.h"
#include "duet_internal.h"

/* Prefill runs in chunks of this many tokens (the step's activation size). */
#define DUET_PREFILL_CHUNK 256
/* Logit rows one step can return (decode of many sequences, spec verify). */
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
    return duet__model_open(path, params, DUET_PREFILL_CHUNK, DUET_MAX_OUT, 0, 0, out);
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
    duet_model_close(m->draft);
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

/* Evaluates tokens[0..n) (n <= DUET_MAX_OUT) of sequence 0 at pos0.. in
 * one step with the logits of every row: speculative verification. */
static duet_status eval_rows(duet_model *m, const int32_t *tokens, int n, int pos0) {
    int32_t pos[DUET_MAX_OUT], seq[DUET_MAX_OUT], out[DUET_MAX_OUT];
    for (int i = 0; i < n; i++) {
        pos[i] = pos0 + i;
        seq[i] = 0;
        out[i] = i;
    }
    duet_batch b = {.n_tokens = n, .tokens = tokens, .pos = pos, .seq = seq, .n_out = n, .out = out};
    return duet__run_forward(m, &m->run, &b, m->run.logits);
}

/* The draft model's proposal of k tokens after hist[0..len): its KV first
 * catches up with the stream (from *dpos, the tokens it holds), then each
 * draft token is drawn from q, the draft's distribution under `dsmp` (the
 * request's settings without penalties), and fed back, except the last.
 * q's rows go to q_ids/q_probs[j * n_vocab], their sizes to q_n[j]. */
static duet_status draft_propose(duet_model *dm, duet_sampler *dsmp, const int32_t *hist, int len, int *dpos,
                                 int k, int32_t *out, int32_t *q_ids, float *q_probs, int *q_n) {
    const size_t V = (size_t)dm->hp.n_vocab;
    duet_status st = eval_seq0(dm, hist + *dpos, len - *dpos, *dpos);
    if (st) return st;
    *dpos = len;
    for (int j = 0; j < k; j++) {
        out[j] = duet__spec_draw(dsmp, dm->run.logits, (int)V, q_ids + j * V, q_probs + j * V, &q_n[j]);
        if (j + 1 < k && (st = eval_seq0(dm, &out[j], 1, len + j))) return st;
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
    duet_status st = duet__model_own_run(m);
    if (st) return st;
    duet_sampling defaults = duet_sampling_default();
    duet_sampler *smp;
    st = duet_sampler_new(sampling ? sampling : &defaults, m->hp.n_vocab, &smp);
    if (st) return st;
    char *text = malloc(m->detok_size);
    if (!text) {
        duet_sampler_free(smp);
        return duet__error(DUET_OUT_OF_MEMORY, "generate: out of memory for %zu bytes of text",
                           m->detok_size);
    }
    for (int i = 0; i < n_prompt; i++)
        duet_sampler_accept(smp, prompt[i]);

    /* The context bounds generation: the last position is n_ctx - 1. */
    if (max_tokens > m->n_ctx - n_prompt) max_tokens = m->n_ctx - n_prompt;
    stats->prompt_tokens = n_prompt;

    double t0 = now_seconds();
    st = eval_seq0(m, prompt, n_prompt, 0);
    double t1 = now_seconds(), c1 = cpu_seconds();
    stats->prefill_seconds = t1 - t0;

    duet_detok detok;
    bool after_bos = prompt[n_prompt - 1] == duet_tokenizer_bos(m->tok);
    duet_detok_init(&detok, m->tok, after_bos && strcmp(duet_tokenizer_model(m->tok), "llama") == 0);
    /* Speculation (speculative.h): the stream so far feeds the n-gram
     * drafter; a step evaluates the newest token and nd drafts, and the
     * next tokens come from its rows 0..nd in order (dj: the next row)
     * until a draft is rejected. */
    /* With a draft model, q (its distribution) comes with each draft token
     * and dpos counts the stream tokens in its KV cache. */
    const int V = m->hp.n_vocab;
    bool spec = m->spec_mode != DUET_SPEC_OFF && max_tokens > 1;
    bool draft = spec && m->spec_mode == DUET_SPEC_DRAFT;
    int32_t *hist = NULL, step_tok[1 + DUET_SPEC_MAX_K];
    duet_spec_verifier *ver = NULL;
    duet_spec_adapt adapt;
    duet__spec_adapt_init(&adapt, m->spec_k);
    int nd = 0, dj = 0, kept = 0, dpos = 0, draft_len = 0;
    duet_sampler *dsmp = NULL;
    int32_t *q_ids = NULL;
    float *q_probs = NULL;
    int q_n[DUET_SPEC_MAX_K];
    if (spec && !st) {
        hist = malloc(((size_t)n_prompt + max_tokens) * sizeof *hist);
        st = hist ? duet__spec_verifier_new(V, &ver)
                  : duet__error(DUET_OUT_OF_MEMORY, "generate: out of memory for the token history");
        if (hist) memcpy(hist, prompt, (size_t)n_prompt * sizeof *hist);
    }
    if (draft && !st) st = duet__model_own_run(m->draft);
    if (draft && !st) {
        duet_sampling ds = duet__spec_draft_sampling(sampling ? sampling : &defaults);
        q_ids = malloc((size_t)m->spec_k * V * sizeof *q_ids);
        q_probs = malloc((size_t)m->spec_k * V * sizeof *q_probs);
        st = q_ids && q_probs
                 ? duet_sampler_new(&ds, V, &dsmp)
                 : duet__error(DUET_OUT_OF_MEMORY, "generate: out of memory for draft distributions");
    }
    bool stopped = false; /* fn returned false: it is not called again */
    for (int i = 0; !st && i < max_tokens; i++) {
        float *row = m->run.logits + (size_t)dj * V;
        bool acc = false;
        int32_t id =
            dj < nd
                ? duet__spec_verify(ver, smp, row, step_tok[1 + dj], draft ? q_ids + (size_t)dj * V : NULL,
                                    draft ? q_probs + (size_t)dj * V : NULL, draft ? q_n[dj] : 0, &acc)
                : duet_sampler_sample(smp, row);
        kept += acc;
        duet_sampler_accept(smp, id);
        stats->generated_tokens++;
        bool eog = !ignore_eos && duet_tokenizer_is_eog(m->tok, id);
        int len = eog ? 0 : duet_detok_push(&detok, id, text, m->detok_size);
        if (eog) stats->stopped_by_eos = true;
        if (fn && !fn(id, text, (size_t)(len > 0 ? len : 0), user)) {
            stopped = true;
            break;
        }
        if (eog || i + 1 == max_tokens) break;
        if (spec) hist[n_prompt + i] = id;
        if (acc) { /* the next row is computed already */
            dj++;
            continue;
        }
        /* The newest token sits at stream position n_prompt + i. */
        const int pos = n_prompt + i;
        if (nd > 0) {
            stats->spec_accepted_tokens += kept;
            duet__spec_adapt_update(&adapt, nd, kept, m->spec_k);
            /* The draft's KV holds the stream up to draft_len and its own
             * drafts 1..nd-1 after it: valid as far as they were kept. */
            if (draft) dpos = draft_len + (kept < nd - 1 ? kept : nd - 1);
        }
        nd = dj = kept = 0;
        if (spec) {
            /* Drafts fit the tokens still to come (the last comes from the
             * target) and the context. */
            int k = adapt.k;
            if (k > max_tokens - (i + 1) - 1) k = max_tokens - (i + 1) - 1;
            if (k > m->n_ctx - 1 - pos) k = m->n_ctx - 1 - pos;
            if (k > 0 && draft) {
                draft_len = pos + 1;
                st = draft_propose(m->draft, dsmp, hist, draft_len, &dpos, k, step_tok + 1, q_ids, q_probs,
                                   q_n);
                nd = st ? 0 : k;
            } else {
                nd = k > 0 ? duet__spec_ngram(hist, pos + 1, DUET_SPEC_NGRAM_MIN, DUET_SPEC_NGRAM_MAX, k,
                                              step_tok + 1)
                           : 0;
            }
        }
        if (st) break;
        if (nd > 0) {
            step_tok[0] = id;
            stats->spec_drafts++;
            stats->spec_draft_tokens += nd;
            st = eval_rows(m, step_tok, 1 + nd, pos);
        } else {
            st = eval_seq0(m, &id, 1, pos);
        }
    }
    if (nd > 0) stats->spec_accepted_tokens += kept; /* ended inside a speculative step */
    free(hist);
    duet__spec_verifier_free(ver);
    duet_sampler_free(dsmp);
    free(q_ids);
    free(q_probs);
    if (!st && fn && !stopped) {
        int len = duet_detok_flush(&detok, text, m->detok_size);
        if (len > 0) fn(-1, text, (size_t)len, user);
    }
    free(text);
    stats->decode_seconds = now_seconds() - t1;
    stats->decode_cpu_seconds = cpu_seconds() - c1;
    duet_sampler_free(smp);
    return st;
}
