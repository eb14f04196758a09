/* eval.c — quality of a model against a reference over the same tokens:
 * KL divergence of the next-token distributions, top-1 agreement and the
 * perplexity of each, with every position of a prefill chunk producing
 * logits (teacher forcing). */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "duet_internal.h"
#include "sampler.h"

static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* The KL divergence is meaningless unless token i means the same text in
 * both models, so the tokenizers are compared piece by piece. */
static duet_status check_same_vocab(const duet_model *m, const duet_model *r) {
    if (m->hp.n_vocab != r->hp.n_vocab)
        return duet__error(DUET_INVALID_ARGUMENT,
                           "eval: the vocabularies differ: the model has %d logits per token, the reference %d",
                           m->hp.n_vocab, r->hp.n_vocab);
    int nm = duet_tokenizer_n_vocab(m->tok), nr = duet_tokenizer_n_vocab(r->tok);
    if (nm != nr)
        return duet__error(DUET_INVALID_ARGUMENT,
                           "eval: the vocabularies differ: the model's tokenizer has %d tokens, the reference's %d",
                           nm, nr);
    for (int32_t i = 0; i < nm; i++) {
        const char *a = duet_tokenizer_piece(m->tok, i), *b = duet_tokenizer_piece(r->tok, i);
        if (strcmp(a ? a : "", b ? b : ""))
            return duet__error(DUET_INVALID_ARGUMENT,
                               "eval: the vocabularies differ: token %d is '%.40s' in the model but '%.40s' in "
                               "the reference",
                               (int)i, a ? a : "", b ? b : "");
    }
    if (duet_tokenizer_bos(m->tok) != duet_tokenizer_bos(r->tok))
        return duet__error(DUET_INVALID_ARGUMENT, "eval: the vocabularies differ: BOS is %d in the model, %d in "
                           "the reference", (int)duet_tokenizer_bos(m->tok), (int)duet_tokenizer_bos(r->tok));
    return DUET_OK;
}

/* log of the softmax normaliser of one logit row, in double; false when a
 * logit is NaN or infinite. */
static bool log_norm(const float *x, int n, double *out) {
    double mx = -INFINITY;
    for (int i = 0; i < n; i++) {
        if (!isfinite(x[i])) return false;
        if (x[i] > mx) mx = x[i];
    }
    double s = 0;
    for (int i = 0; i < n; i++) s += exp((double)x[i] - mx);
    *out = mx + log(s);
    return true;
}

/* KL(p || q) for p = softmax(lp), q = softmax(lq), given their normalisers. */
static double kl_row(const float *lp, double zp, const float *lq, double zq, int n) {
    double kl = 0;
    for (int i = 0; i < n; i++) {
        double a = (double)lp[i] - zp;
        double p = exp(a);
        if (p > 0) kl += p * (a - ((double)lq[i] - zq));
    }
    /* Rounding can leave a tiny negative value where the rows agree. */
    return kl > 0 ? kl : 0;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

typedef struct scorer {
    duet_model *m, *r;
    int chunk;           /* rows per forward step, all of them outputs */
    int32_t *pos, *seq, *out;
    float *lm, *lr;      /* [chunk][n_vocab] logits of model and ref */
    double *kl;          /* per scored position */
    double kl_sum, nll, nll_ref;
    int n, agree;
} scorer;

/* Scores feed[0..len): row i predicts feed[i + 1]. */
static duet_status score_window(scorer *sc, const int32_t *feed, int len) {
    const int V = sc->m->hp.n_vocab;
    for (int c0 = 0; c0 + 1 < len; c0 += sc->chunk) {
        int c = len - 1 - c0 < sc->chunk ? len - 1 - c0 : sc->chunk;
        for (int i = 0; i < c; i++) sc->pos[i] = c0 + i;
        duet_batch b = {.n_tokens = c, .tokens = feed + c0, .pos = sc->pos, .seq = sc->seq, .n_out = c,
                        .out = sc->out};
        duet_status st = duet__run_forward(sc->r, &sc->r->run, &b, sc->lr);
        if (st) return st;
        if ((st = duet__run_forward(sc->m, &sc->m->run, &b, sc->lm))) return st;
        for (int i = 0; i < c; i++) {
            const float *lr = sc->lr + (size_t)i * V, *lm = sc->lm + (size_t)i * V;
            double zr, zm;
            if (!log_norm(lr, V, &zr))
                return duet__error(DUET_DEVICE, "eval: the reference produced a non-finite logit at position %d",
                                   c0 + i);
            if (!log_norm(lm, V, &zm))
                return duet__error(DUET_DEVICE, "eval: the model produced a non-finite logit at position %d",
                                   c0 + i);
            int32_t next = feed[c0 + i + 1];
            double kl = kl_row(lr, zr, lm, zm, V);
            sc->kl[sc->n++] = kl;
            sc->kl_sum += kl;
            sc->nll += zm - lm[next];
            sc->nll_ref += zr - lr[next];
            sc->agree += duet_argmax(lm, V) == duet_argmax(lr, V);
        }
    }
    return DUET_OK;
}

duet_status duet_quality_eval(duet_model *model, duet_model *ref, const int32_t *tokens, int n_tokens,
                              int window, duet_quality *out) {
    if (!model || !ref || !tokens || !out) return duet__error(DUET_INVALID_ARGUMENT, "eval: NULL argument");
    memset(out, 0, sizeof *out);
    if (model->vocab_only || ref->vocab_only)
        return duet__error(DUET_INVALID_ARGUMENT, "eval: a model was opened vocab-only");
    if (n_tokens < 2) return duet__error(DUET_INVALID_ARGUMENT, "eval: need at least 2 tokens, got %d", n_tokens);
    duet_status st = check_same_vocab(model, ref);
    if (!st) st = duet__model_own_run(model);
    if (!st) st = duet__model_own_run(ref);
    if (st) return st;
    const int V = model->hp.n_vocab;
    for (int i = 0; i < n_tokens; i++)
        if (tokens[i] < 0 || tokens[i] >= V)
            return duet__error(DUET_INVALID_ARGUMENT, "eval: token %d = %d out of range [0, %d)", i, tokens[i], V);
    int ctx = model->n_ctx < ref->n_ctx ? model->n_ctx : ref->n_ctx;
    int W = window ? window : ctx;
    if (W < 2 || W > ctx)
        return duet__error(DUET_INVALID_ARGUMENT, "eval: window %d outside [2, %d] (the smaller context)", W, ctx);

    scorer sc = {.m = model, .r = ref};
    sc.chunk = model->run.max_out < ref->run.max_out ? model->run.max_out : ref->run.max_out;
    if (sc.chunk > model->run.max_step_tokens) sc.chunk = model->run.max_step_tokens;
    if (sc.chunk > ref->run.max_step_tokens) sc.chunk = ref->run.max_step_tokens;
    sc.pos = malloc(sizeof(int32_t) * sc.chunk);
    sc.seq = calloc(sc.chunk, sizeof(int32_t));
    sc.out = malloc(sizeof(int32_t) * sc.chunk);
    sc.lm = malloc(sizeof(float) * (size_t)sc.chunk * V);
    sc.lr = malloc(sizeof(float) * (size_t)sc.chunk * V);
    sc.kl = malloc(sizeof(double) * (size_t)n_tokens);
    int32_t *feed = malloc(sizeof(int32_t) * (size_t)W);
    if (!sc.pos || !sc.seq || !sc.out || !sc.lm || !sc.lr || !sc.kl || !feed) {
        st = duet__error(DUET_OUT_OF_MEMORY, "eval: out of memory");
        goto done;
    }
    for (int i = 0; i < sc.chunk; i++) sc.out[i] = i;

    const int32_t bos = duet_tokenizer_bos(ref->tok);
    double t0 = now_seconds();
    for (int s = 0; s < n_tokens;) {
        /* The first window is the text's own start; later ones get a lead
         * token so the first text token of the window is predicted too. */
        int len = 0;
        if (s > 0 && tokens[s] != bos) feed[len++] = bos >= 0 ? bos : tokens[s - 1];
        int e = s + (W - len) < n_tokens ? s + (W - len) : n_tokens;
        memcpy(feed + len, tokens + s, sizeof(int32_t) * (size_t)(e - s));
        len += e - s;
        if ((st = score_window(&sc, feed, len))) goto done;
        out->windows++;
        s = e;
    }
    out->seconds = now_seconds() - t0;
    out->positions = sc.n;
    if (sc.n > 0) {
        out->kl_mean = sc.kl_sum / sc.n;
        out->top1_agreement = (double)sc.agree / sc.n;
        out->ppl = exp(sc.nll / sc.n);
        out->ppl_ref = exp(sc.nll_ref / sc.n);
        qsort(sc.kl, (size_t)sc.n, sizeof(double), cmp_double);
        int k = (int)ceil(0.99 * sc.n) - 1;
        out->kl_p99 = sc.kl[k < 0 ? 0 : k];
        out->kl_max = sc.kl[sc.n - 1];
    }
done:
    free(sc.pos);
    free(sc.seq);
    free(sc.out);
    free(sc.lm);
    free(sc.lr);
    free(sc.kl);
    free(feed);
    return st;
}

typedef struct collect {
    int32_t *ids;
    int n, max;
} collect;

static bool collect_token(int32_t id, const char *text, size_t len, void *user) {
    collect *c = user;
    if (id >= 0 && c->n < c->max) c->ids[c->n++] = id;
    return c->n < c->max;
}

duet_status duet_quality_generate(duet_model *ref, int n_tokens, int window, uint64_t seed, int32_t *tokens) {
    if (!ref || !tokens || n_tokens < 1)
        return duet__error(DUET_INVALID_ARGUMENT, "generate: need a model, an array and n_tokens >= 1");
    if (ref->vocab_only) return duet__error(DUET_INVALID_ARGUMENT, "generate: the model was opened vocab-only");
    const int32_t bos = duet_tokenizer_bos(ref->tok);
    if (bos < 0) return duet__error(DUET_UNSUPPORTED, "generate: the model has no BOS token to start text from");
    int W = window ? window : ref->n_ctx;
    if (W < 2 || W > ref->n_ctx)
        return duet__error(DUET_INVALID_ARGUMENT, "generate: window %d outside [2, %d] (the context)", W,
                           ref->n_ctx);
    duet_sampling smp = {.temperature = 1.0f, .top_k = 0, .top_p = 1.0f, .min_p = 0.0f,
                         .repetition_penalty = 1.0f};
    int have = 0;
    for (uint64_t segment = 0; have < n_tokens; segment++) {
        tokens[have++] = bos;
        int want = n_tokens - have < W - 1 ? n_tokens - have : W - 1;
        if (want == 0) break;
        /* A distinct, reproducible stream per segment (golden-ratio step). */
        smp.seed = seed + segment * 0x9E3779B97F4A7C15ull;
        collect c = {.ids = tokens + have, .max = want};
        duet_status st = duet_generate(ref, &bos, 1, want, &smp, false, collect_token, &c, NULL);
        if (st) return st;
        if (c.n == 0) return duet__error(DUET_DEVICE, "generate: the model produced no token");
        have += c.n;
    }
    return DUET_OK;
}
