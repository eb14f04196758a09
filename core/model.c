/* model.c — hyperparameters and weights of a Llama-family GGUF model. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model.h"

/* The architectures duet runs: Llama's block with these differences. */
typedef struct arch_desc {
    const char *name;
    float rope_base; /* when the file gives no rope.freq_base */
    bool neox;       /* RoPE pairs (i, i + n_rot/2) */
    bool qkv_bias;   /* q, k, v projections have biases */
    bool qk_norm;    /* per-head RMS norm of q and k before RoPE */
} arch_desc;

static const arch_desc archs[] = {
    {"llama", 10000.0f, false, false, false}, /* Llama 2/3/3.1/3.2, SmolLM, TinyLlama, Mistral's GGUFs */
    {"mistral", 10000.0f, false, false, false},
    {"qwen2", 1000000.0f, true, true, false},
    {"qwen3", 1000000.0f, true, false, true},
};

/* Larger than any released vocabulary (Gemma's 256k), small enough that
 * n_vocab-sized logit rows stay a sane allocation. */
#define DUET_MAX_VOCAB (1 << 22)

/* Reads "<arch>.<suffix>" as an int. */
static bool get_arch_int(const duet_gguf *g, const char *arch, const char *suffix, int64_t *out) {
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    return duet_gguf_get_i64(g, key, out);
}

static bool get_arch_f32(const duet_gguf *g, const char *arch, const char *suffix, float *out) {
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    return duet_gguf_get_f32(g, key, out);
}

/* A required positive integer hyperparameter within [1, max]. */
static duet_status need_int(const duet_gguf *g, const char *arch, const char *suffix, int64_t max,
                            int *out) {
    int64_t v;
    if (!get_arch_int(g, arch, suffix, &v))
        return duet__error(DUET_BAD_MODEL, "model: missing metadata key '%s.%s'", arch, suffix);
    if (v < 1 || v > max)
        return duet__error(DUET_BAD_MODEL, "model: '%s.%s' = %lld is out of range [1, %lld]", arch, suffix,
                           (long long)v, (long long)max);
    *out = (int)v;
    return DUET_OK;
}

/* ---- RoPE scaling ----------------------------------------------------------------------- */

/* <arch>.rope.scaling.*, with llama.cpp's defaults (llama-model.cpp,
 * llama-context.cpp): no type key means linear, no factor means 1; YaRN's
 * extrapolation mix defaults to 1, its betas to 32 and 1, its original
 * context to context_length. */
static duet_status rope_scaling_load(const duet_gguf *g, const char *a, duet_hparams *hp) {
    char type[32] = "linear", key[128];
    snprintf(key, sizeof key, "%s.rope.scaling.type", a);
    duet_gguf_get_str(g, key, type, sizeof type);
    if (strcmp(type, "none") == 0)
        hp->rope_scaling = DUET_ROPE_SCALING_NONE;
    else if (strcmp(type, "linear") == 0)
        hp->rope_scaling = DUET_ROPE_SCALING_LINEAR;
    else if (strcmp(type, "yarn") == 0)
        hp->rope_scaling = DUET_ROPE_SCALING_YARN;
    else
        return duet__error(DUET_UNSUPPORTED,
                           "model: %s.rope.scaling.type '%s' is not supported (none, linear, yarn)", a, type);
    hp->rope_factor = 1.0f;
    if (!get_arch_f32(g, a, "rope.scaling.factor", &hp->rope_factor))
        get_arch_f32(g, a, "rope.scale_linear", &hp->rope_factor); /* the older name */
    if (hp->rope_factor == 0.0f || hp->rope_scaling == DUET_ROPE_SCALING_NONE) hp->rope_factor = 1.0f;
    if (!(hp->rope_factor > 0.0f && hp->rope_factor < 1e6f))
        return duet__error(DUET_BAD_MODEL, "model: rope.scaling.factor %g out of range", hp->rope_factor);
    int64_t v = hp->n_ctx_train;
    get_arch_int(g, a, "rope.scaling.original_context_length", &v);
    if (v < 1 || v > INT32_MAX)
        return duet__error(DUET_BAD_MODEL, "model: rope.scaling.original_context_length %lld", (long long)v);
    hp->rope_n_ctx_orig = (int)v;
    hp->rope_attn_factor = 1.0f;
    get_arch_f32(g, a, "rope.scaling.attn_factor", &hp->rope_attn_factor);
    hp->yarn_ext_factor = hp->rope_scaling == DUET_ROPE_SCALING_YARN ? 1.0f : 0.0f;
    get_arch_f32(g, a, "rope.scaling.yarn_ext_factor", &hp->yarn_ext_factor);
    hp->yarn_beta_fast = 32.0f;
    hp->yarn_beta_slow = 1.0f;
    get_arch_f32(g, a, "rope.scaling.yarn_beta_fast", &hp->yarn_beta_fast);
    get_arch_f32(g, a, "rope.scaling.yarn_beta_slow", &hp->yarn_beta_slow);
    if (!(hp->rope_attn_factor > 0.0f && hp->rope_attn_factor < 1e3f) ||
        !(hp->yarn_ext_factor >= 0.0f && hp->yarn_ext_factor <= 1.0f) || !(hp->yarn_beta_fast > 0.0f) ||
        !(hp->yarn_beta_slow > 0.0f))
        return duet__error(
            DUET_BAD_MODEL,
            "model: RoPE scaling out of range (attn_factor %g, yarn ext_factor %g, betas %g, %g)",
            hp->rope_attn_factor, hp->yarn_ext_factor, hp->yarn_beta_fast, hp->yarn_beta_slow);
    /* The magnitude of cos and sin: llama.cpp's yarn_attn_factor,
     * get_mscale(factor) / (1 + 0.1 ln factor), times rope_yarn's own
     * 1 + 0.1 ln factor, times attn_factor. */
    const float f = hp->rope_factor;
    hp->rope_mscale = hp->rope_attn_factor;
    if (hp->yarn_ext_factor != 0.0f && f > 1.0f) hp->rope_mscale *= 1.0f + 0.1f * logf(f);
    return DUET_OK;
}

/* ggml_rope_yarn_corr_dim: the pair index whose wavelength fits n_rot
 * rotations into the original context (in float, as ggml computes it). */
static float yarn_corr_dim(int n_dims, int n_ctx_orig, float n_rot, float base) {
    return (float)n_dims * logf((float)n_ctx_orig / (n_rot * 2.0f * (float)M_PI)) / (2.0f * logf(base));
}

void duet__rope_freqs(const duet_hparams *hp, const float *factors, float *freqs) {
    const int n = hp->n_rot;
    const float fs = 1.0f / hp->rope_factor, ext = hp->yarn_ext_factor;
    float lo = floorf(yarn_corr_dim(n, hp->rope_n_ctx_orig, hp->yarn_beta_fast, hp->rope_base));
    float hi = ceilf(yarn_corr_dim(n, hp->rope_n_ctx_orig, hp->yarn_beta_slow, hp->rope_base));
    lo = lo > 0 ? lo : 0;
    hi = hi < (float)(n - 1) ? hi : (float)(n - 1);
    for (int i = 0; i < n / 2; i++) {
        double extrap = pow((double)hp->rope_base, -2.0 * i / n) / (factors ? factors[i] : 1.0f);
        /* theta = interp * (1 - mix) + extrap * mix, interp = fs * extrap. */
        double mix = 0;
        if (ext != 0.0f) {
            float y = ((float)i - lo) / (hi - lo > 0.001f ? hi - lo : 0.001f);
            mix = (1.0 - (y < 0 ? 0 : y > 1 ? 1 : y)) * ext;
        }
        freqs[i] = (float)(extrap * (fs * (1.0 - mix) + mix));
    }
}

duet_status duet__hparams_load(const duet_gguf *g, duet_hparams *hp) {
    memset(hp, 0, sizeof *hp);
    if (!duet_gguf_get_str(g, "general.architecture", hp->arch, sizeof hp->arch))
        return duet__error(DUET_BAD_MODEL, "model: missing 'general.architecture'");
    const arch_desc *ad = NULL;
    for (size_t i = 0; i < sizeof archs / sizeof *archs; i++)
        if (strcmp(hp->arch, archs[i].name) == 0) ad = &archs[i];
    if (!ad)
        return duet__error(
            DUET_UNSUPPORTED,
            "model: architecture '%s' is not supported (supported: llama, mistral, qwen2, qwen3)", hp->arch);
    const char *a = hp->arch;
    duet_status st;
    if ((st = need_int(g, a, "embedding_length", 1 << 16, &hp->n_embd)) ||
        (st = need_int(g, a, "block_count", 1024, &hp->n_layer)) ||
        (st = need_int(g, a, "attention.head_count", 1024, &hp->n_head)) ||
        (st = need_int(g, a, "feed_forward_length", 1 << 18, &hp->n_ff)))
        return st;
    /* Optional keys are checked as int64 before narrowing, so a huge value
     * cannot wrap into a plausible one. */
    int64_t v = hp->n_head;
    get_arch_int(g, a, "attention.head_count_kv", &v);
    if (v < 1 || v > hp->n_head || hp->n_head % v)
        return duet__error(DUET_BAD_MODEL, "model: head_count_kv %lld must divide head_count %d", (long long)v,
                           hp->n_head);
    hp->n_head_kv = (int)v;
    v = hp->n_embd / hp->n_head;
    get_arch_int(g, a, "attention.key_length", &v);
    if (v < 2 || v > 1024 || v % 2)
        return duet__error(DUET_BAD_MODEL, "model: head dimension %lld must be even, in [2, 1024]", (long long)v);
    hp->head_dim = (int)v;
    v = hp->head_dim;
    get_arch_int(g, a, "rope.dimension_count", &v);
    if (v < 2 || v > hp->head_dim || v % 2)
        return duet__error(DUET_BAD_MODEL, "model: rope.dimension_count %lld must be even and <= head dim %d",
                           (long long)v, hp->head_dim);
    hp->n_rot = (int)v;
    hp->n_ctx_train = get_arch_int(g, a, "context_length", &v) && v > 0 && v < (1 << 24) ? (int)v : 2048;
    hp->norm_eps = 1e-5f;
    get_arch_f32(g, a, "attention.layer_norm_rms_epsilon", &hp->norm_eps);
    if (!(hp->norm_eps > 0 && hp->norm_eps < 1))
        return duet__error(DUET_BAD_MODEL, "model: rms epsilon %g out of range (0, 1)", hp->norm_eps);
    hp->rope_base = ad->rope_base;
    get_arch_f32(g, a, "rope.freq_base", &hp->rope_base);
    if (!(hp->rope_base > 1))
        return duet__error(DUET_BAD_MODEL, "model: rope.freq_base %g must be > 1", hp->rope_base);
    hp->rope_neox = ad->neox;
    hp->qkv_bias = ad->qkv_bias;
    hp->qk_norm = ad->qk_norm;
    if ((st = rope_scaling_load(g, a, hp))) return st;
    v = 0;
    get_arch_int(g, a, "attention.sliding_window", &v);
    if (v < 0 || v > INT32_MAX)
        return duet__error(DUET_BAD_MODEL, "model: attention.sliding_window %lld out of range", (long long)v);
    hp->sliding_window = (int)v;

    /* The vocabulary size comes from the embedding (what the weights hold). */
    const duet_gguf_tensor *emb = duet_gguf_find_tensor(g, "token_embd.weight");
    if (emb && emb->n_dims == 2) v = emb->ne[1];
    else if (!get_arch_int(g, a, "vocab_size", &v)) {
        const duet_gguf_kv *kv = duet_gguf_find(g, "tokenizer.ggml.tokens");
        v = kv && kv->value.type == DUET_GGUF_ARRAY && kv->value.arr.n <= INT32_MAX ? (int64_t)kv->value.arr.n : 0;
    }
    if (v < 1 || v > DUET_MAX_VOCAB)
        return duet__error(DUET_BAD_MODEL, "model: vocabulary size %lld is not in [1, %d]", (long long)v,
                           DUET_MAX_VOCAB);
    hp->n_vocab = (int)v;
    return DUET_OK;
}

/* ---- weights ------------------------------------------------------------- */

static duet_status upload_tensor(const duet_gguf_tensor *t, duet_dtype as, duet_backend *be,
                                 duet_weight *w) {
    int64_t rows = t->n_dims >= 2 ? t->ne[1] : 1;
    for (int d = 2; d < t->n_dims; d++) rows *= t->ne[d];
    w->rows = rows;
    w->cols = t->ne[0];
    w->type = as;
    size_t bytes = duet_dtype_row_bytes(as, w->cols) * (size_t)rows;
    duet_status st = duet_buffer_alloc(be, bytes, &w->buf);
    if (st) return st;
    if (as == t->type) return duet_buffer_upload(be, w->buf, 0, t->data, bytes);
    /* Convert (norm weights and biases to f32). */
    float *tmp = malloc((size_t)w->cols * rows * sizeof(float));
    if (!tmp) return duet__error(DUET_OUT_OF_MEMORY, "model: out of memory converting '%.*s'",
                                 (int)t->name.len, t->name.ptr);
    size_t src_row = duet_dtype_row_bytes(t->type, w->cols);
    for (int64_t r = 0; r < rows; r++)
        duet_dequantize_row(t->type, (const uint8_t *)t->data + r * src_row, tmp + r * w->cols, w->cols);
    st = duet_buffer_upload(be, w->buf, 0, tmp, bytes);
    free(tmp);
    return st;
}

/* Whether the backend runs matmuls of weight type t and, for the embedding
 * table, lookups too (asked of the device, so a file mixing types fails at
 * load with the tensor's name, not at the first step). */
static bool backend_runs(duet_backend *be, duet_dtype t, bool embed) {
    duet_op op = {.kind = DUET_OP_MATMUL};
    op.matmul.dtype = t;
    if (!duet_device_supports_op(be->iface, be->device_index, &op)) return false;
    if (!embed) return true;
    op = (duet_op){.kind = DUET_OP_EMBED};
    op.embed.dtype = t;
    return duet_device_supports_op(be->iface, be->device_index, &op);
}

/* "f32, f16, ...": the weight types the backend runs, for error messages. */
static void runnable_types(duet_backend *be, bool embed, char *buf, size_t size) {
    size_t n = 0;
    buf[0] = '\0';
    for (int t = 0; t < 64 && n < size; t++)
        if (duet_dtype_is_weight((duet_dtype)t) && backend_runs(be, (duet_dtype)t, embed))
            n += (size_t)snprintf(buf + n, size - n, "%s%s", n ? ", " : "", duet_dtype_name((duet_dtype)t));
}

/* Finds `name`, checks its shape is [rows][cols] (ne = {cols, rows}; rows 0
 * for a vector), and uploads it (as f32 when force_f32). */
static duet_status load_weight(const duet_gguf *g, const char *name, int64_t cols, int64_t rows,
                               bool required, bool force_f32, duet_backend *be, duet_weight *w) {
    memset(w, 0, sizeof *w);
    const duet_gguf_tensor *t = duet_gguf_find_tensor(g, name);
    if (!t) {
        if (!required) return DUET_OK;
        return duet__error(DUET_BAD_MODEL, "model: missing tensor '%s'", name);
    }
    bool shape_ok = rows ? (t->n_dims == 2 && t->ne[0] == cols && t->ne[1] == rows)
                         : (t->n_dims == 1 && t->ne[0] == cols);
    if (!shape_ok)
        return duet__error(DUET_BAD_MODEL,
                           "model: tensor '%s' has shape [%lld, %lld] (n_dims %d), expected [%lld, %lld]",
                           name, (long long)t->ne[0], (long long)(t->n_dims > 1 ? t->ne[1] : 1), t->n_dims,
                           (long long)cols, (long long)(rows ? rows : 1));
    const duet_dtype as = force_f32 ? DUET_DTYPE_F32 : t->type;
    const bool embed = strcmp(name, "token_embd.weight") == 0;
    if (!duet_dtype_is_weight(t->type) || !backend_runs(be, as, embed)) {
        char list[256];
        runnable_types(be, embed, list, sizeof list);
        return duet__error(DUET_UNSUPPORTED,
                           "model: tensor '%s' has type %s, which the %s backend does not run (it runs %s)",
                           name, duet_dtype_name(t->type) ? duet_dtype_name(t->type) : "unknown",
                           be->iface->name, list);
    }
    return upload_tensor(t, as, be, w);
}

/* The rope_kv op's table: duet__rope_freqs with the file's rope_freqs
 * tensor (Llama 3.1/3.2's llama3 per-band factors, f32 [n_rot/2]) if any,
 * uploaded once. */
static duet_status rope_freqs_load(const duet_gguf *g, const duet_hparams *hp, duet_backend *be,
                                   duet_weight *w) {
    const int half = hp->n_rot / 2;
    const duet_gguf_tensor *t = duet_gguf_find_tensor(g, "rope_freqs.weight");
    if (t && (t->n_dims != 1 || t->ne[0] != half || !duet_dtype_is_weight(t->type) ||
              duet_dtype_block(t->type) != 1))
        return duet__error(
            DUET_BAD_MODEL,
            "model: tensor 'rope_freqs.weight' must be %d scalars (n_rot / 2), has %lld of type %s", half,
            (long long)t->ne[0], duet_dtype_name(t->type) ? duet_dtype_name(t->type) : "?");
    float *factors = t ? malloc(sizeof(float) * (size_t)half) : NULL,
          *freqs = malloc(sizeof(float) * (size_t)half);
    duet_status st = DUET_OK;
    if (!freqs || (t && !factors)) st = duet__error(DUET_OUT_OF_MEMORY, "model: out of memory");
    if (!st && t) {
        duet_dequantize_row(t->type, t->data, factors, half);
        for (int i = 0; i < half && !st; i++)
            if (!(factors[i] > 0.0f && factors[i] < 1e30f))
                st = duet__error(DUET_BAD_MODEL, "model: rope_freqs.weight[%d] = %g is not a positive factor",
                                 i, factors[i]);
    }
    if (!st) {
        duet__rope_freqs(hp, factors, freqs);
        *w = (duet_weight){.type = DUET_DTYPE_F32, .rows = 1, .cols = half};
        st = duet_buffer_alloc(be, sizeof(float) * (size_t)half, &w->buf);
        if (!st) st = duet_buffer_upload(be, w->buf, 0, freqs, sizeof(float) * (size_t)half);
    }
    free(factors);
    free(freqs);
    return st;
}

duet_status duet__weights_load(const duet_gguf *g, const duet_hparams *hp, duet_backend *be,
                               duet_weights *w) {
    memset(w, 0, sizeof *w);
    /* Biases llama.cpp applies when a file has them and duet does not:
     * refused, rather than answers that are silently off. */
    static const char *const unapplied[] = {"output.bias", "blk.0.attn_output.bias", "blk.0.ffn_gate.bias",
                                            "blk.0.ffn_up.bias", "blk.0.ffn_down.bias"};
    for (size_t i = 0; i < sizeof unapplied / sizeof *unapplied; i++)
        if (duet_gguf_find_tensor(g, unapplied[i]))
            return duet__error(DUET_UNSUPPORTED,
                               "model: tensor '%s' is not supported (%s has no such bias in duet)",
                               unapplied[i], hp->arch);
    const int64_t E = hp->n_embd, V = hp->n_vocab, F = hp->n_ff;
    const int64_t Q = (int64_t)hp->n_head * hp->head_dim, KV = (int64_t)hp->n_head_kv * hp->head_dim;
    duet_status st;
    if ((st = load_weight(g, "token_embd.weight", E, V, true, false, be, &w->tok_embd)) ||
        (st = load_weight(g, "output_norm.weight", E, 0, true, true, be, &w->output_norm)) ||
        (st = load_weight(g, "output.weight", E, V, false, false, be, &w->output)))
        goto fail;
    if (!w->output.buf) {
        w->output = w->tok_embd;
        w->tied = true;
    }
    if ((st = rope_freqs_load(g, hp, be, &w->rope_freqs))) goto fail;
    w->layers = calloc((size_t)hp->n_layer, sizeof *w->layers);
    w->n_layer = hp->n_layer;
    if (!w->layers) {
        st = duet__error(DUET_OUT_OF_MEMORY, "model: out of memory");
        goto fail;
    }
    for (int l = 0; l < hp->n_layer; l++) {
        duet_layer *L = &w->layers[l];
        char n[14][96];
        static const char *const names[14] = {"attn_norm.weight",   "attn_q.weight",      "attn_k.weight",
                                              "attn_v.weight",      "attn_output.weight", "ffn_norm.weight",
                                              "ffn_gate.weight",    "ffn_up.weight",      "ffn_down.weight",
                                              "attn_q.bias",        "attn_k.bias",        "attn_v.bias",
                                              "attn_q_norm.weight", "attn_k_norm.weight"};
        for (int i = 0; i < 14; i++)
            snprintf(n[i], sizeof n[i], "blk.%d.%s", l, names[i]);
        if ((st = load_weight(g, n[0], E, 0, true, true, be, &L->attn_norm)) ||
            (st = load_weight(g, n[1], E, Q, true, false, be, &L->wq)) ||
            (st = load_weight(g, n[2], E, KV, true, false, be, &L->wk)) ||
            (st = load_weight(g, n[3], E, KV, true, false, be, &L->wv)) ||
            (st = load_weight(g, n[4], Q, E, true, false, be, &L->wo)) ||
            (st = load_weight(g, n[5], E, 0, true, true, be, &L->ffn_norm)) ||
            (st = load_weight(g, n[6], E, F, true, false, be, &L->w_gate)) ||
            (st = load_weight(g, n[7], E, F, true, false, be, &L->w_up)) ||
            (st = load_weight(g, n[8], F, E, true, false, be, &L->w_down)) ||
            (st = load_weight(g, n[9], Q, 0, hp->qkv_bias, true, be, &L->bq)) ||
            (st = load_weight(g, n[10], KV, 0, hp->qkv_bias, true, be, &L->bk)) ||
            (st = load_weight(g, n[11], KV, 0, hp->qkv_bias, true, be, &L->bv)))
            goto fail;
        /* Only an architecture that has them reads them (a stray norm in
         * a llama file must not change its math unnoticed: it is ignored). */
        if (hp->qk_norm && ((st = load_weight(g, n[12], hp->head_dim, 0, true, true, be, &L->q_norm)) ||
                            (st = load_weight(g, n[13], hp->head_dim, 0, true, true, be, &L->k_norm))))
            goto fail;
        const duet_weight *mats[7] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->w_gate, &L->w_up, &L->w_down};
        for (int i = 0; i < 7; i++)
            w->bytes += duet_dtype_row_bytes(mats[i]->type, mats[i]->cols) * (uint64_t)mats[i]->rows;
    }
    w->bytes += duet_dtype_row_bytes(w->output.type, E) * (uint64_t)V;
    return DUET_OK;
fail:
    duet__weights_free(be, w);
    return st;
}

static void free_weight(duet_backend *be, duet_weight *w) {
    duet_buffer_free(be, w->buf);
    w->buf = NULL;
}

void duet__weights_free(duet_backend *be, duet_weights *w) {
    /* Layers are calloc'd, so entries never loaded are NULL and safe to free. */
    for (int l = 0; w->layers && l < w->n_layer; l++) {
        duet_layer *L = &w->layers[l];
        duet_weight *all[14] = {&L->attn_norm, &L->wq,     &L->wk, &L->wv, &L->wo, &L->ffn_norm, &L->w_gate,
                                &L->w_up,      &L->w_down, &L->bq, &L->bk, &L->bv, &L->q_norm,   &L->k_norm};
        for (int i = 0; i < 14; i++)
            free_weight(be, all[i]);
    }
    free_weight(be, &w->rope_freqs);
    free_weight(be, &w->tok_embd);
    if (!w->tied) free_weight(be, &w->output);
    free_weight(be, &w->output_norm);
    free(w->layers);
    memset(w, 0, sizeof *w);
}
