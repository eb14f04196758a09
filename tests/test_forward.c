/* test_forward.c — the forward pass against the oracle's ops (op_oracle.h)
 * run in the same order, on small models the test writes itself: llama
 * (adjacent-pair RoPE, GQA), qwen2 (q/k/v biases, NeoX RoPE, own rope base),
 * tied and separate outputs, and every weight type (f32, f16, bf16, q8_0).
 * "archs" runs the variants real files use on cpu, Vulkan and OpenCL:
 * Llama 3.1's rope_freqs, linear and YaRN RoPE scaling, a sliding window,
 * qwen3's per-head q/k norms, and refuses other architectures by name.
 * Also: a token's logits do not depend on the rest of its batch (bit for
 * bit), hostile hyperparameters and arguments get errors, and a failing
 * device op reports its own message. */
#include <limits.h>
#include <math.h>
#include <pthread.h>

#include "duet.h"
#include "duet_internal.h"
#include "fault_backend.h"
#include "gguf.h"
#include "op_oracle.h"
#include "test_backends.h"
#include "test_util.h"

/* cfg literals name only the fields they use. */
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"

typedef struct cfg {
    const char *arch;
    duet_dtype type;
    bool tied;
    int E, L, H, HKV, F, V;
    float rope_base;
    /* The variants real files use (all optional, 0/NULL: none). */
    int hd;              /* attention.key_length when not E / H */
    const char *scaling; /* rope.scaling.type: "linear", "yarn", ... */
    float factor;        /* rope.scaling.factor */
    int orig_ctx;        /* rope.scaling.original_context_length */
    float attn_factor;   /* rope.scaling.attn_factor */
    bool llama3;         /* a rope_freqs tensor of Llama 3.1's per-band factors */
    int window;          /* attention.sliding_window */
} cfg;

static int head_dim(const cfg *c) {
    return c->hd ? c->hd : c->E / c->H;
}

static uint64_t rng_state;
static float frand(float scale) {
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return scale * ((float)((rng_state >> 40) & 0xFFFFFF) / 16777216.0f * 2.0f - 1.0f);
}

/* Keeps every tensor as written (in its dtype), so the reference reads
 * exactly the weights the engine reads. */
typedef struct ref_tensor {
    char name[64];
    duet_dtype type;
    void *data; /* [rows][cols] in type */
    int64_t rows, cols;
} ref_tensor;

static ref_tensor tensors[256];
static int n_tensors;
/* When set, the vocabulary's last token has this text. */
static const char *last_token_text;

static const ref_tensor *T(const char *name) {
    for (int i = 0; i < n_tensors; i++)
        if (!strcmp(tensors[i].name, name)) return &tensors[i];
    return NULL;
}

static void add(duet_gguf_writer *w, const char *name, duet_dtype type, int64_t cols, int64_t rows, float scale,
                float mean) {
    ref_tensor *t = &tensors[n_tensors++];
    snprintf(t->name, sizeof t->name, "%s", name);
    t->type = type, t->rows = rows, t->cols = cols;
    size_t rb = duet_dtype_row_bytes(type, cols);
    uint8_t *q = malloc(rb * rows);
    float *row = malloc(sizeof(float) * cols);
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t c = 0; c < cols; c++) row[c] = mean + frand(scale);
        duet_convert_row(type, row, q + r * rb, cols);
    }
    free(row);
    t->data = q;
    int64_t ne[2] = {cols, rows};
    duet_gguf_add_tensor(w, name, type, rows > 1 ? 2 : 1, ne, q, false);
}

/* Llama 3.1's rope_freqs, as convert_hf_to_gguf computes them from
 * rope_scaling {rope_type llama3, factor 8, low_freq_factor 1,
 * high_freq_factor 4, original_max_position_embeddings 256} (the file
 * gets no rope.scaling keys, only the tensor): 1 for short
 * wavelengths, factor for long ones, a smooth blend between. */
static void llama3_factors(const cfg *c, int n_rot, float *ff) {
    const double factor = 8, lo_f = 1, hi_f = 4, orig = 256; /* 8 pairs of 16 dims: all three bands */
    const double lo_wl = orig / lo_f, hi_wl = orig / hi_f;
    for (int i = 0; i < n_rot / 2; i++) {
        const double wl = 2 * M_PI * pow(c->rope_base, 2.0 * i / n_rot); /* 2 pi / frequency */
        if (wl < hi_wl)
            ff[i] = 1;
        else if (wl > lo_wl)
            ff[i] = (float)factor;
        else {
            const double smooth = (orig / wl - lo_f) / (hi_f - lo_f);
            ff[i] = (float)(1 / ((1 - smooth) / factor + smooth));
        }
    }
}

static void write_model(const cfg *c, const char *path) {
    n_tensors = 0;
    rng_state = 12345;
    duet_gguf_writer *w = duet_gguf_writer_new();
    char key[128];
#define KEY(s) (snprintf(key, sizeof key, "%s.%s", c->arch, s), key)
    duet_gguf_set_str(w, "general.architecture", c->arch);
    duet_gguf_set_u32(w, KEY("embedding_length"), c->E);
    duet_gguf_set_u32(w, KEY("block_count"), c->L);
    duet_gguf_set_u32(w, KEY("attention.head_count"), c->H);
    duet_gguf_set_u32(w, KEY("attention.head_count_kv"), c->HKV);
    duet_gguf_set_u32(w, KEY("feed_forward_length"), c->F);
    duet_gguf_set_u32(w, KEY("context_length"), 256);
    duet_gguf_set_f32(w, KEY("rope.freq_base"), c->rope_base);
    duet_gguf_set_f32(w, KEY("attention.layer_norm_rms_epsilon"), 1e-6f);
    if (c->hd) {
        duet_gguf_set_u32(w, KEY("attention.key_length"), c->hd);
        duet_gguf_set_u32(w, KEY("attention.value_length"), c->hd);
    }
    if (c->scaling) duet_gguf_set_str(w, KEY("rope.scaling.type"), c->scaling);
    if (c->factor) duet_gguf_set_f32(w, KEY("rope.scaling.factor"), c->factor);
    if (c->orig_ctx) duet_gguf_set_u32(w, KEY("rope.scaling.original_context_length"), c->orig_ctx);
    if (c->attn_factor) duet_gguf_set_f32(w, KEY("rope.scaling.attn_factor"), c->attn_factor);
    if (c->window) duet_gguf_set_u32(w, KEY("attention.sliding_window"), c->window);
    /* A byte-level vocabulary: <unk> <s> </s> and 256 byte tokens + fillers. */
    const char **toks = malloc(sizeof(char *) * c->V);
    char(*store)[16] = malloc(16 * (size_t)c->V);
    float *scores = calloc(c->V, sizeof(float));
    int32_t *types = malloc(sizeof(int32_t) * c->V);
    for (int i = 0; i < c->V; i++) {
        if (i < 3) snprintf(store[i], 16, "%s", i == 0 ? "<unk>" : i == 1 ? "<s>" : "</s>");
        else if (i < 259) snprintf(store[i], 16, "<0x%02X>", i - 3);
        else snprintf(store[i], 16, "tok%d", i);
        toks[i] = i == c->V - 1 && last_token_text ? last_token_text : store[i];
        types[i] = i == 0 ? 2 : i < 3 ? 3 : i < 259 ? 6 : 1;
    }
    duet_gguf_set_str(w, "tokenizer.ggml.model", "llama");
    duet_gguf_set_str_array(w, "tokenizer.ggml.tokens", toks, c->V);
    duet_gguf_set_array(w, "tokenizer.ggml.scores", DUET_GGUF_FLOAT32, scores, c->V);
    duet_gguf_set_array(w, "tokenizer.ggml.token_type", DUET_GGUF_INT32, types, c->V);
    duet_gguf_set_u32(w, "tokenizer.ggml.bos_token_id", 1);
    duet_gguf_set_u32(w, "tokenizer.ggml.eos_token_id", 2);
    free(toks), free(store), free(scores), free(types);

    const int hd = head_dim(c), KV = hd * c->HKV, Q = hd * c->H;
    add(w, "token_embd.weight", c->type, c->E, c->V, 1.0f, 0);
    if (c->llama3) { /* what convert_hf_to_gguf writes for rope_scaling llama3 */
        ref_tensor *t = &tensors[n_tensors++];
        snprintf(t->name, sizeof t->name, "rope_freqs.weight");
        t->type = DUET_DTYPE_F32, t->rows = 1, t->cols = hd / 2;
        float *f = malloc(sizeof(float) * (size_t)(hd / 2));
        llama3_factors(c, hd, f);
        t->data = f;
        int64_t ne[1] = {hd / 2};
        duet_gguf_add_tensor(w, t->name, DUET_DTYPE_F32, 1, ne, f, false);
    }
    add(w, "output_norm.weight", DUET_DTYPE_F32, c->E, 1, 0.2f, 1.0f);
    if (!c->tied) add(w, "output.weight", c->type, c->E, c->V, 0.3f, 0);
    for (int l = 0; l < c->L; l++) {
        char n[64];
#define LAYER(s, ty, cols, rows, sc, mean) (snprintf(n, sizeof n, "blk.%d.%s", l, s), add(w, n, ty, cols, rows, sc, mean))
        LAYER("attn_norm.weight", DUET_DTYPE_F32, c->E, 1, 0.2f, 1.0f);
        LAYER("attn_q.weight", c->type, c->E, Q, 0.3f, 0);
        LAYER("attn_k.weight", c->type, c->E, KV, 0.3f, 0);
        LAYER("attn_v.weight", c->type, c->E, KV, 0.3f, 0);
        if (!strcmp(c->arch, "qwen2")) {
            LAYER("attn_q.bias", DUET_DTYPE_F32, Q, 1, 0.5f, 0);
            LAYER("attn_k.bias", DUET_DTYPE_F32, KV, 1, 0.5f, 0);
            LAYER("attn_v.bias", DUET_DTYPE_F32, KV, 1, 0.5f, 0);
        }
        if (!strcmp(c->arch, "qwen3")) {
            LAYER("attn_q_norm.weight", DUET_DTYPE_F32, hd, 1, 0.5f, 1.0f);
            LAYER("attn_k_norm.weight", DUET_DTYPE_F32, hd, 1, 0.5f, 1.0f);
        }
        LAYER("attn_output.weight", c->type, Q, c->E, 0.3f, 0);
        LAYER("ffn_norm.weight", DUET_DTYPE_F32, c->E, 1, 0.2f, 1.0f);
        LAYER("ffn_gate.weight", c->type, c->E, c->F, 0.3f, 0);
        LAYER("ffn_up.weight", c->type, c->E, c->F, 0.3f, 0);
        LAYER("ffn_down.weight", c->type, c->F, c->E, 0.2f, 0);
#undef LAYER
    }
#undef KEY
    ck_assert_msg(duet_gguf_write(w, path) == DUET_OK, "write: %s", duet_last_error());
    duet_gguf_writer_free(w);
}

static void free_tensors(void) {
    for (int i = 0; i < n_tensors; i++) free(tensors[i].data);
    n_tensors = 0;
}

/* What rewrite_model changes on the way. */
typedef struct rewrite {
    const char *drop;   /* leave out tensors whose name contains this */
    const char *zero;   /* this tensor's data becomes zeros */
    const char *key;    /* this metadata key is set to the uint64 `value` */
    uint64_t value;
    const char *add; /* a tensor of 64 zero floats with this name is added */
} rewrite;

static void rewrite_model(const char *in, const char *out, const rewrite *rw) {
    duet_gguf *g;
    ck_assert_msg(duet_gguf_open(in, &g) == DUET_OK, "open %s: %s", in, duet_last_error());
    duet_gguf_writer *w = duet_gguf_writer_new();
    duet_gguf_copy_kv(w, g);
    if (rw->key) duet_gguf_set_u64(w, rw->key, rw->value);
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        const duet_gguf_tensor *t = &g->tensors[i];
        char name[96];
        snprintf(name, sizeof name, "%.*s", (int)t->name.len, t->name.ptr);
        if (rw->drop && strstr(name, rw->drop)) continue;
        void *zeros = rw->zero && !strcmp(name, rw->zero) ? calloc(1, t->size) : NULL;
        duet_gguf_add_tensor(w, name, t->type, t->n_dims, t->ne, zeros ? zeros : t->data, false);
        free(zeros);
    }
    if (rw->add) {
        float zeros[64] = {0};
        duet_gguf_add_tensor(w, rw->add, DUET_DTYPE_F32, 1, (int64_t[1]){64}, zeros, false);
    }
    ck_assert_msg(duet_gguf_write(w, out) == DUET_OK, "write %s: %s", out, duet_last_error());
    duet_gguf_writer_free(w);
    duet_gguf_close(g);
}

/* ---- the reference: the oracle's ops in the forward pass's order -------- */

/* out[n][rows] = W x (+ bias) for W = tensor `w` ([rows][cols] in its dtype). */
static void ref_matmul(const ref_tensor *w, const ref_tensor *bias, const float *x, int n, bool accumulate,
                       float *out) {
    oracle_matmul(w->data, w->type, x, NULL, bias ? bias->data : NULL, accumulate, n, (int)w->cols,
                  (int)w->rows, out);
}

/* RoPE as llama.cpp computes it (ggml's rope_yarn and
 * ggml_rope_yarn_corr_dims, llama-context.cpp's attention factor), written
 * out plainly: pair i of a token at position p turns by
 *   theta = fs * te (1 - mix_i) + te mix_i,  te = p base^(-2i/n) / ff_i,
 * fs = 1/factor, mix_i YaRN's ramp (0 unless YaRN), and cos/sin are scaled
 * by mscale. The angle is linear in p, so freqs[i] is theta at p = 1. */
static void reference_rope(const cfg *c, int n_rot, float *freqs, float *mscale) {
    const bool yarn = c->scaling && !strcmp(c->scaling, "yarn");
    const bool none = c->scaling && !strcmp(c->scaling, "none");
    const double factor = c->factor > 0 && !none ? c->factor : 1.0, fs = 1.0 / factor;
    const double ext = yarn ? 1.0 : 0.0, base = c->rope_base;
    const int orig = c->orig_ctx ? c->orig_ctx : 256; /* else context_length */
    /* The dims whose wavelength fits beta_fast (32) and beta_slow (1)
     * rotations into the original context. */
    double lo = floor(n_rot * log(orig / (32 * 2 * M_PI)) / (2 * log(base)));
    double hi = ceil(n_rot * log(orig / (1 * 2 * M_PI)) / (2 * log(base)));
    lo = fmax(lo, 0), hi = fmin(hi, n_rot - 1);
    float ff[512];
    if (c->llama3) llama3_factors(c, n_rot, ff);
    for (int i = 0; i < n_rot / 2; i++) {
        const double te = pow(base, -2.0 * i / n_rot) / (c->llama3 ? ff[i] : 1.0);
        const double y = (i - lo) / fmax(0.001, hi - lo);
        const double mix = (1 - fmin(1, fmax(0, y))) * ext;
        freqs[i] = (float)(fs * te * (1 - mix) + te * mix);
    }
    double m = c->attn_factor ? c->attn_factor : 1.0;
    if (ext != 0) {
        const double get_mscale = factor <= 1 ? 1.0 : 0.1 * log(factor) + 1;
        m *= get_mscale / (1 + 0.1 * log(factor)) * (1 + 0.1 * log(1 / fs));
    }
    *mscale = (float)m;
}

/* Logits of the last of n tokens: every layer over the whole sequence
 * (one sequence, positions 0..n-1), through an f32 KV cache. */
static void reference_logits(const cfg *c, const int32_t *tok, int n, double *logits) {
    const int E = c->E, hd = head_dim(c), KV = hd * c->HKV, Q = hd * c->H, F = c->F;
    const bool qwen = !strcmp(c->arch, "qwen2") || !strcmp(c->arch, "qwen3");
    const bool bias = !strcmp(c->arch, "qwen2"), qk_norm = !strcmp(c->arch, "qwen3");
    const float eps = 1e-6f;
    float freqs[512], mscale;
    reference_rope(c, hd, freqs, &mscale);
    float *x = malloc(sizeof(float) * (size_t)n * E), *xn = malloc(sizeof(float) * (size_t)n * E);
    float *q = malloc(sizeof(float) * (size_t)n * Q), *k = malloc(sizeof(float) * (size_t)n * KV),
          *v = malloc(sizeof(float) * (size_t)n * KV), *att = malloc(sizeof(float) * (size_t)n * Q);
    float *g = malloc(sizeof(float) * (size_t)n * F), *u = malloc(sizeof(float) * (size_t)n * F);
    float *lg = malloc(sizeof(float) * (size_t)c->V);
    int32_t *pos = malloc(sizeof(int32_t) * (size_t)n), *seq = calloc((size_t)n, sizeof(int32_t));
    for (int t = 0; t < n; t++)
        pos[t] = t;
    /* One sequence in blocks of 16; each layer stores positions 0..n-1
     * before its attention reads them, so the layers share the cache. */
    oracle_kv kv;
    oracle_kv_alloc(&kv, DUET_DTYPE_F32, KV, 16, (n + 15) / 16, 1, (n + 15) / 16);
    oracle_kv_scatter(&kv, &n, -1, 7);
    const ref_tensor *embd = T("token_embd.weight");
    oracle_embed(tok, n, embd->data, embd->type, E, x);
    char nm[64];
#define W(s) (snprintf(nm, sizeof nm, "blk.%d.%s", l, s), T(nm))
    for (int l = 0; l < c->L; l++) {
        oracle_rmsnorm(x, W("attn_norm.weight")->data, n, E, eps, xn, NULL);
        ref_matmul(W("attn_q.weight"), bias ? W("attn_q.bias") : NULL, xn, n, false, q);
        ref_matmul(W("attn_k.weight"), bias ? W("attn_k.bias") : NULL, xn, n, false, k);
        ref_matmul(W("attn_v.weight"), bias ? W("attn_v.bias") : NULL, xn, n, false, v);
        if (qk_norm) { /* every head of q and k: an RMS norm over head_dim */
            oracle_rmsnorm(q, W("attn_q_norm.weight")->data, n * c->H, hd, eps, q, NULL);
            oracle_rmsnorm(k, W("attn_k_norm.weight")->data, n * c->HKV, hd, eps, k, NULL);
        }
        oracle_rope_kv(q, k, v, pos, seq, n, c->H, c->HKV, hd, hd, freqs, mscale, qwen, &kv);
        oracle_attention(q, pos, seq, n, c->H, c->HKV, hd, 1.0f / sqrtf((float)hd), c->window, &kv, att,
                         NULL);
        ref_matmul(W("attn_output.weight"), NULL, att, n, true, x);
        oracle_rmsnorm(x, W("ffn_norm.weight")->data, n, E, eps, xn, NULL);
        ref_matmul(W("ffn_gate.weight"), NULL, xn, n, false, g);
        ref_matmul(W("ffn_up.weight"), NULL, xn, n, false, u);
        oracle_swiglu(g, u, n, F, g, NULL);
        ref_matmul(W("ffn_down.weight"), NULL, g, n, true, x);
    }
#undef W
    oracle_rmsnorm(x + (size_t)(n - 1) * E, T("output_norm.weight")->data, 1, E, eps, xn, NULL);
    ref_matmul(c->tied ? embd : T("output.weight"), NULL, xn, 1, false, lg);
    for (int i = 0; i < c->V; i++)
        logits[i] = lg[i];
    oracle_kv_free(&kv);
    free(x), free(xn), free(q), free(k), free(v), free(att), free(g), free(u), free(lg), free(pos), free(seq);
}

/* Counts the matmuls a model runs, and those that read int8 activations
 * (x_q8), by wrapping its backend's op. */
static const duet_backend_iface *count_real;
static duet_backend_iface count_iface;
static int n_matmuls, n_q8_matmuls;

static duet_status count_op(duet_backend *be, const duet_op *op) {
    if (op->kind == DUET_OP_MATMUL) {
        n_matmuls++;
        n_q8_matmuls += op->matmul.x_q8.buf != NULL;
    }
    return count_real->op(be, op);
}

/* The model of c on `backend` against the reference. */
static void check_model_on(const cfg *c, double tol, const char *backend) {
    char path[512];
    snprintf(path, sizeof path, "%s/test_forward_%s_%s.gguf", DUET_BINARY_DIR, c->arch, duet_dtype_name(c->type));
    write_model(c, path);
    duet_open_params p = duet_open_params_default();
    p.backend = backend;
    p.kv_type = "f32";
    p.n_ctx = 256;
    duet_model *m;
    ck_assert_msg(duet_model_open(path, &p, &m) == DUET_OK, "open: %s", duet_last_error());
    count_real = m->be->iface;
    count_iface = *m->be->iface;
    count_iface.op = count_op;
    m->be->iface = &count_iface;
    n_matmuls = n_q8_matmuls = 0;
    int32_t tok[40];
    for (int i = 0; i < 40; i++) tok[i] = (i * 37 + 5) % c->V;
    float *got = malloc(sizeof(float) * c->V);
    double *want = malloc(sizeof(double) * c->V);
    /* A prefill of 37 tokens, then 3 single decode steps. */
    ck_assert_int_eq(duet_eval(m, tok, 37, 0, got), DUET_OK);
    for (int n = 37; n <= 40; n++) {
        if (n > 37) ck_assert_int_eq(duet_eval(m, &tok[n - 1], 1, n - 1, got), DUET_OK);
        reference_logits(c, tok, n, want);
        double num = 0, den = 0;
        for (int i = 0; i < c->V; i++) {
            ck_assert_msg(isfinite(got[i]), "logit %d is not finite", i);
            num += (got[i] - want[i]) * (got[i] - want[i]);
            den += want[i] * want[i];
        }
        double nmse = num / den;
        ck_assert_msg(nmse < tol, "%s %s on %s: %d tokens: NMSE %g >= %g", c->arch, duet_dtype_name(c->type),
                      backend, n, nmse, tol);
    }
    free(got), free(want);
    m->be->iface = count_real;
    duet_model_close(m);
    free_tensors();
    remove(path);
}

static void check_model(const cfg *c, double tol) {
    check_model_on(c, tol, getenv("DUET_TEST_BACKEND") ? getenv("DUET_TEST_BACKEND") : "cpu");
}

/* The activations of q8_0 matmuls are quantized to 8 bits: a looser bound. */
START_TEST(llama_f32) { check_model(&(cfg){"llama", DUET_DTYPE_F32, false, 64, 2, 8, 2, 96, 300, 10000}, 1e-9); }
END_TEST
START_TEST(llama_f16_tied) { check_model(&(cfg){"llama", DUET_DTYPE_F16, true, 64, 2, 4, 4, 96, 300, 10000}, 1e-6); }
END_TEST
START_TEST(mistral_bf16) { check_model(&(cfg){"mistral", DUET_DTYPE_BF16, false, 96, 2, 6, 2, 128, 280, 10000}, 1e-6); }
END_TEST
static const cfg llama_q8 = {"llama", DUET_DTYPE_Q8_0, false, 64, 2, 8, 2, 96, 300, 10000};
START_TEST(llama_q8_0) {
    check_model(&llama_q8, 1e-3);
    /* Every q8_0 matmul reads int8 activations written by the op before it. */
    ck_assert_msg(n_matmuls > 0 && n_q8_matmuls == n_matmuls, "%d of %d matmuls read int8 activations", n_q8_matmuls,
                  n_matmuls);
}
END_TEST
/* DUET_ACT_Q8=0 (the README's A/B switch): the same model with f32
 * activations everywhere, still within the bound. */
START_TEST(llama_q8_0_f32_activations) {
    setenv("DUET_ACT_Q8", "0", 1);
    check_model(&llama_q8, 1e-3);
    unsetenv("DUET_ACT_Q8");
    ck_assert_msg(n_matmuls > 0 && n_q8_matmuls == 0, "DUET_ACT_Q8=0: %d of %d matmuls read int8 activations",
                  n_q8_matmuls, n_matmuls);
}
END_TEST
START_TEST(qwen2_f32_bias_neox) { check_model(&(cfg){"qwen2", DUET_DTYPE_F32, false, 64, 2, 8, 4, 96, 300, 1e6}, 1e-9); }
END_TEST

/* Bad models get clear errors, not crashes. */
START_TEST(unknown_arch_and_missing_tensor) {
    char path[512];
    snprintf(path, sizeof path, "%s/test_forward_bad.gguf", DUET_BINARY_DIR);
    duet_gguf_writer *w = duet_gguf_writer_new();
    duet_gguf_set_str(w, "general.architecture", "mamba");
    ck_assert_int_eq(duet_gguf_write(w, path), DUET_OK);
    duet_gguf_writer_free(w);
    duet_model *m = NULL;
    duet_open_params p = duet_open_params_default();
    p.backend = "cpu";
    duet_status st = duet_model_open(path, &p, &m);
    ck_assert_int_ne(st, DUET_OK);
    ck_assert_ptr_null(m);
    /* The tokenizer is missing, or the arch is unknown: either way, named. */
    ck_assert_msg(strstr(duet_last_error(), "tokenizer") || strstr(duet_last_error(), "mamba"), "message: %s",
                  duet_last_error());

    cfg c = {"llama", DUET_DTYPE_F32, false, 64, 1, 4, 4, 96, 300, 10000};
    write_model(&c, path);
    free_tensors();
    /* Rewrite without ffn_up: the loader must name it. */
    char path2[600];
    snprintf(path2, sizeof path2, "%s.2", path);
    rewrite_model(path, path2, &(rewrite){.drop = "ffn_up"});
    st = duet_model_open(path2, &p, &m);
    ck_assert_int_eq(st, DUET_BAD_MODEL);
    ck_assert_msg(strstr(duet_last_error(), "blk.0.ffn_up.weight"), "message: %s", duet_last_error());
    remove(path);
    remove(path2);
}
END_TEST

/* ---- the architectures and RoPE variants real files use, on every backend ---- */

/* Small f32 models (head_dim 16 throughout, so each backend compiles one set
 * of kernels for all of them), 40 positions: enough for a window of 9 to
 * cut most of the context and for YaRN's and llama3's bands to differ. */
static void check_archs(const cfg *c) {
    static const char *const backends[] = {"cpu", "vulkan", "opencl"};
    for (int i = 0; i < 3; i++)
        if (test_backend_usable(backends[i], c->arch)) check_model_on(c, 1e-9, backends[i]);
}

/* Llama 3.1/3.2: the rope_freqs tensor's per-band factors, no scaling keys. */
START_TEST(llama31_rope_freqs) {
    check_archs(&(cfg){"llama", DUET_DTYPE_F32, false, 64, 2, 4, 2, 96, 300, 500000, .llama3 = true});
}
END_TEST
/* Linear scaling (rope.scaling.type linear, factor 4) and Mistral's
 * sliding window (attention.sliding_window 9). */
START_TEST(llama_linear_sliding_window) {
    check_archs(&(cfg){"llama", DUET_DTYPE_F32, true, 64, 2, 4, 1, 96, 300, 10000, .scaling = "linear",
                       .factor = 4, .window = 9});
}
END_TEST
/* YaRN on qwen2 (biases, NeoX pairs): factor 4 over an original context
 * of 64, so the ramp runs through the 8 pairs; an attention factor too. */
START_TEST(qwen2_yarn) {
    check_archs(&(cfg){"qwen2", DUET_DTYPE_F32, false, 64, 2, 4, 2, 96, 300, 10000, .scaling = "yarn",
                       .factor = 4, .orig_ctx = 64, .attn_factor = 0.9f});
}
END_TEST
/* qwen3: per-head q/k RMS norms, a head_dim (16) that is not n_embd /
 * n_head (48 / 4), NeoX pairs, no biases. */
START_TEST(qwen3_qk_norm) {
    check_archs(&(cfg){"qwen3", DUET_DTYPE_F32, false, 48, 2, 4, 2, 96, 300, 1000000, .hd = 16});
}
END_TEST

/* duet mkmodel writes each variant (for benchmarks and the CLI): they load
 * with the hyperparameters meant, and run. */
START_TEST(mkmodel_variants_load_and_run) {
    static const struct {
        const char *shape, *arch;
        duet_rope_scaling scaling;
        bool qk_norm;
        int window;
    } cases[] = {
        {"tiny-llama3", "llama", DUET_ROPE_SCALING_LINEAR, false, 0},
        {"tiny-yarn", "qwen2", DUET_ROPE_SCALING_YARN, false, 0},
        {"tiny-qwen3", "qwen3", DUET_ROPE_SCALING_LINEAR, true, 0},
        {"tiny-swa", "llama", DUET_ROPE_SCALING_LINEAR, false, 32},
    };
    char path[512];
    snprintf(path, sizeof path, "%s/test_forward_mkmodel.gguf", DUET_BINARY_DIR);
    duet_open_params p = duet_open_params_default();
    p.backend = "cpu";
    p.n_ctx = 64;
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        duet_mkmodel_params mp = {.shape = cases[i].shape, .type = "f32"};
        ck_assert_msg(duet_mkmodel(&mp, path) == DUET_OK, "%s: %s", cases[i].shape, duet_last_error());
        duet_model *m;
        ck_assert_msg(duet_model_open(path, &p, &m) == DUET_OK, "%s: %s", cases[i].shape, duet_last_error());
        ck_assert_str_eq(m->hp.arch, cases[i].arch);
        ck_assert_int_eq(m->hp.rope_scaling, cases[i].scaling);
        ck_assert_int_eq(m->hp.qk_norm, cases[i].qk_norm);
        ck_assert_int_eq(m->hp.sliding_window, cases[i].window);
        int32_t tok[40];
        for (int t = 0; t < 40; t++)
            tok[t] = (t * 37 + 5) % m->hp.n_vocab;
        float *logits = malloc(sizeof(float) * (size_t)m->hp.n_vocab);
        ck_assert_int_eq(duet_eval(m, tok, 40, 0, logits), DUET_OK);
        for (int v = 0; v < m->hp.n_vocab; v++)
            ck_assert_msg(isfinite(logits[v]), "%s: logit %d", cases[i].shape, v);
        free(logits);
        duet_model_close(m);
    }
    remove(path);
}
END_TEST

/* Anything else is refused at load, naming what: an architecture, a RoPE
 * scaling type. */
START_TEST(unsupported_arch_and_scaling_are_named) {
    char path[512];
    snprintf(path, sizeof path, "%s/test_forward_refused.gguf", DUET_BINARY_DIR);
    duet_open_params p = duet_open_params_default();
    p.backend = "cpu";
    static const struct {
        cfg c;
        const char *needle;
    } cases[] = {
        {{"gemma2", DUET_DTYPE_F32, false, 64, 1, 4, 4, 96, 300, 10000},
         "architecture 'gemma2' is not supported"},
        {{"phi3", DUET_DTYPE_F32, false, 64, 1, 4, 4, 96, 300, 10000},
         "architecture 'phi3' is not supported"},
        {{"llama", DUET_DTYPE_F32, false, 64, 1, 4, 4, 96, 300, 10000, .scaling = "longrope"},
         "rope.scaling.type 'longrope' is not supported"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        write_model(&cases[i].c, path);
        free_tensors();
        duet_model *m = NULL;
        ck_assert_int_eq(duet_model_open(path, &p, &m), DUET_UNSUPPORTED);
        ck_assert_ptr_null(m);
        ck_assert_msg(strstr(duet_last_error(), cases[i].needle), "message '%s' lacks '%s'",
                      duet_last_error(), cases[i].needle);
    }
    /* A bias llama.cpp would apply and duet does not: refused by name. */
    char path2[600];
    snprintf(path2, sizeof path2, "%s.bias", path);
    write_model(&(cfg){"llama", DUET_DTYPE_F32, false, 64, 1, 4, 4, 96, 300, 10000}, path);
    free_tensors();
    rewrite_model(path, path2, &(rewrite){.add = "blk.0.attn_output.bias"});
    duet_model *m = NULL;
    ck_assert_int_eq(duet_model_open(path2, &p, &m), DUET_UNSUPPORTED);
    ck_assert_msg(strstr(duet_last_error(), "'blk.0.attn_output.bias' is not supported"), "message '%s'",
                  duet_last_error());
    remove(path);
    remove(path2);
}
END_TEST

/* ---- batch invariance ------------------------------------------------------ */

#define BI_SEQS 4
#define BI_MAX_LEN 20
static const int bi_len[BI_SEQS] = {13, 1, 7, 20};

static int32_t bi_token(int s, int i, int n_vocab) { return (s * 31 + i * 17 + 3) % n_vocab; }

/* Runs the listed (seq, pos) entries as one step, every row asking for
 * logits, and files each row's logits under [seq][pos] in `into`. */
static void bi_step(duet_model *m, const int32_t *seqs, const int32_t *poss, int n, float *into) {
    int32_t tok[64], out[64];
    ck_assert_int_le(n, 64);
    for (int i = 0; i < n; i++) {
        tok[i] = bi_token(seqs[i], poss[i], m->hp.n_vocab);
        out[i] = i;
    }
    const size_t V = (size_t)m->hp.n_vocab;
    float *logits = malloc(sizeof(float) * V * (size_t)n);
    duet_batch b = {.n_tokens = n, .tokens = tok, .pos = poss, .seq = seqs, .n_out = n, .out = out};
    ck_assert_msg(duet__forward(m->run.state, &m->hp, &m->w, &b, logits) == DUET_OK, "forward: %s",
                  duet_last_error());
    for (int i = 0; i < n; i++)
        memcpy(into + ((size_t)seqs[i] * BI_MAX_LEN + (size_t)poss[i]) * V, logits + (size_t)i * V, V * sizeof(float));
    free(logits);
}

/* Every row of `got` equals `want` bit for bit. */
static void bi_compare(const duet_model *m, const float *want, const float *got, const char *how, duet_dtype type) {
    const size_t V = (size_t)m->hp.n_vocab;
    for (int s = 0; s < BI_SEQS; s++)
        for (int i = 0; i < bi_len[s]; i++) {
            const float *a = want + ((size_t)s * BI_MAX_LEN + (size_t)i) * V, *b = got + ((size_t)s * BI_MAX_LEN + (size_t)i) * V;
            if (!memcmp(a, b, V * sizeof(float))) continue;
            double worst = 0;
            for (size_t k = 0; k < V; k++) worst = fmax(worst, fabs((double)a[k] - b[k]));
            ck_abort_msg("%s weights, %s: seq %d pos %d differs from one token at a time (max |diff| %g)",
                         duet_dtype_name(type), how, s, i, worst);
        }
}

/* The engine batches whatever is running; greedy outputs must not depend
 * on that. Each token's logits, computed one token per step, must equal
 * those from big mixed steps exactly (the matmul tiles, thread splits and
 * activation quantization all vary with the step's size). */
static void check_batch_invariance(duet_dtype type, int n_ff) {
    char path[512];
    snprintf(path, sizeof path, "%s/test_forward_bi_%s.gguf", DUET_BINARY_DIR, duet_dtype_name(type));
    /* Widths large enough for threaded matmuls and every tile shape; n_ff
     * leaves a column tail (f32/f16/bf16) or an odd block count (q8_0). */
    write_model(&(cfg){"llama", type, false, 128, 2, 4, 2, n_ff, 300, 10000}, path);
    free_tensors();
    duet_open_params p = duet_open_params_default();
    p.backend = getenv("DUET_TEST_BACKEND") ? getenv("DUET_TEST_BACKEND") : "cpu";
    p.n_ctx = 64;
    p.n_seqs = BI_SEQS;
    duet_model *m;
    ck_assert_msg(duet__model_open(path, &p, 256, 64, 0, 0, &m) == DUET_OK, "open: %s", duet_last_error());
    const size_t per_run = (size_t)BI_SEQS * BI_MAX_LEN * (size_t)m->hp.n_vocab;
    float *one = calloc(per_run, sizeof(float)), *all = calloc(per_run, sizeof(float)),
          *halves = calloc(per_run, sizeof(float));

    /* One token per step, the sequences interleaved. */
    for (int i = 0; i < BI_MAX_LEN; i++)
        for (int s = 0; s < BI_SEQS; s++)
            if (i < bi_len[s]) bi_step(m, &(int32_t){s}, &(int32_t){i}, 1, one);

    /* Every token of every sequence in one step. */
    int32_t seqs[64], poss[64];
    int n = 0;
    for (int s = 0; s < BI_SEQS; s++)
        for (int i = 0; i < bi_len[s]; i++) seqs[n] = s, poss[n++] = i;
    bi_step(m, seqs, poss, n, all);
    bi_compare(m, one, all, "all tokens in one step", type);

    /* Two steps, each holding part of every sequence, in reverse order:
     * chunked prefills next to single-token decodes. */
    for (int half = 0; half < 2; half++) {
        n = 0;
        for (int s = BI_SEQS - 1; s >= 0; s--) {
            int lo = half ? bi_len[s] / 2 : 0, hi = half ? bi_len[s] : bi_len[s] / 2;
            for (int i = lo; i < hi; i++) seqs[n] = s, poss[n++] = i;
        }
        bi_step(m, seqs, poss, n, halves);
    }
    bi_compare(m, one, halves, "two mixed steps", type);

    free(one), free(all), free(halves);
    duet_model_close(m);
    remove(path);
}

START_TEST(batch_invariant_f32) { check_batch_invariance(DUET_DTYPE_F32, 172); }
END_TEST
START_TEST(batch_invariant_f16) { check_batch_invariance(DUET_DTYPE_F16, 172); }
END_TEST
START_TEST(batch_invariant_bf16) { check_batch_invariance(DUET_DTYPE_BF16, 172); }
END_TEST
START_TEST(batch_invariant_q8_0) { check_batch_invariance(DUET_DTYPE_Q8_0, 224); }
END_TEST

/* ---- hostile input ----------------------------------------------------------- */

/* A small f32 llama model at DUET_BINARY_DIR/test_forward_<tag>.gguf. */
static void write_small(const char *tag, char *path, size_t size) {
    snprintf(path, size, "%s/test_forward_%s.gguf", DUET_BINARY_DIR, tag);
    write_model(&(cfg){"llama", DUET_DTYPE_F32, false, 64, 1, 4, 2, 96, 300, 10000}, path);
    free_tensors();
}

/* Opens a model on the cpu backend with 32 positions. */
static duet_model *open_small(const char *path) {
    duet_open_params p = duet_open_params_default();
    p.backend = "cpu";
    p.n_ctx = 32;
    duet_model *m;
    ck_assert_msg(duet_model_open(path, &p, &m) == DUET_OK, "open %s: %s", path, duet_last_error());
    return m;
}

/* Hyperparameters are int64 in the file: a value past INT_MAX must be
 * refused, not wrapped into a plausible int (2^32 + 16 would have become a
 * head dimension of 16, and the model would have loaded). */
START_TEST(huge_hyperparameters_are_refused) {
    char path[512], bad[600];
    write_small("hp", path, sizeof path);
    snprintf(bad, sizeof bad, "%s.bad", path);
    static const struct {
        const char *key, *needle;
    } cases[] = {
        {"llama.attention.key_length", "head dimension 4294967312"},
        {"llama.attention.head_count_kv", "head_count_kv 4294967298"},
        {"llama.rope.dimension_count", "rope.dimension_count 4294967312"},
    };
    const uint64_t values[] = {(1ull << 32) + 16, (1ull << 32) + 2, (1ull << 32) + 16};
    duet_open_params p = duet_open_params_default();
    p.backend = "cpu";
    for (int i = 0; i < 3; i++) {
        rewrite_model(path, bad, &(rewrite){.key = cases[i].key, .value = values[i]});
        duet_model *m = NULL;
        duet_status st = duet_model_open(bad, &p, &m);
        ck_assert_msg(st == DUET_BAD_MODEL, "%s = %llu: status %d, want DUET_BAD_MODEL", cases[i].key,
                      (unsigned long long)values[i], st);
        ck_assert_ptr_null(m);
        ck_assert_msg(strstr(duet_last_error(), cases[i].needle), "%s: message '%s' lacks '%s'", cases[i].key,
                      duet_last_error(), cases[i].needle);
    }
    remove(path);
    remove(bad);
}
END_TEST

/* Positions near INT_MAX: a clear CONTEXT_FULL, no signed overflow (UBSan
 * builds abort on one). */
START_TEST(eval_positions_do_not_overflow) {
    char path[512];
    write_small("pos", path, sizeof path);
    duet_model *m = open_small(path);
    int32_t tok[2] = {5, 6};
    ck_assert_int_eq(duet_eval(m, tok, 1, INT_MAX, NULL), DUET_CONTEXT_FULL);
    ck_assert_int_eq(duet_eval(m, tok, 2, INT_MAX - 1, NULL), DUET_CONTEXT_FULL);
    ck_assert_int_eq(duet_eval(m, tok, INT_MAX, 1, NULL), DUET_CONTEXT_FULL);
    ck_assert_msg(strstr(duet_last_error(), "context of 32"), "message: %s", duet_last_error());
    ck_assert_int_eq(duet_eval(m, tok, 2, 30, NULL), DUET_OK); /* the last two positions */
    ck_assert_int_eq(duet_eval(m, tok, 1, 32, NULL), DUET_CONTEXT_FULL);
    duet_model_close(m);
    remove(path);
}
END_TEST

/* ---- callbacks and errors -------------------------------------------------- */

typedef struct stop_ctx {
    int calls;
    int32_t first;
} stop_ctx;

static bool stop_at_once(int32_t id, const char *text, size_t len, void *user) {
    stop_ctx *c = user;
    if (c->calls++ == 0) c->first = id;
    return false;
}

/* duet.h: "Return false to stop: no further call follows", even when a
 * partial UTF-8 character is pending (which a normal end would flush). */
START_TEST(generate_stops_when_the_callback_says_so) {
    char path[512], zero[600];
    write_small("stop", path, sizeof path);
    snprintf(zero, sizeof zero, "%s.zero", path);
    /* All-zero output weights: every logit is 0, so a negative presence
     * penalty makes the prompt's one token the greedy choice: byte 0xE2,
     * the first of a three-byte character, left pending. */
    rewrite_model(path, zero, &(rewrite){.zero = "output.weight"});
    duet_model *m = open_small(zero);
    const int32_t e2 = 3 + 0xE2;
    duet_sampling smp = duet_sampling_default();
    smp.temperature = 0;
    smp.presence_penalty = -5;
    stop_ctx c = {0};
    ck_assert_int_eq(duet_generate(m, &e2, 1, 8, &smp, true, stop_at_once, &c, NULL), DUET_OK);
    ck_assert_int_eq(c.first, e2);
    ck_assert_msg(c.calls == 1, "the callback returned false, yet was called %d times", c.calls);
    duet_model_close(m);
    remove(path);
    remove(zero);
}
END_TEST

/* A device op that fails mid-step: its status and message reach the
 * caller, even when closing the step leaves a message of its own, and the
 * next step runs normally. */
START_TEST(failed_op_keeps_its_message) {
    char path[512];
    write_small("fault", path, sizeof path);
    duet_model *m = open_small(path);
    int32_t tok[3] = {5, 6, 7};
    float *want = malloc(sizeof(float) * 300), *got = malloc(sizeof(float) * 300);
    ck_assert_int_eq(duet_eval(m, tok, 3, 0, want), DUET_OK);
    fault_install(m->be);
    atomic_store(&fault_ops_left, 4); /* the fifth op of the step fails */
    atomic_store(&fault_noisy_submit, true);
    ck_assert_int_eq(duet_eval(m, tok, 3, 0, got), DUET_DEVICE);
    ck_assert_msg(strstr(duet_last_error(), "injected op failure"), "message: %s", duet_last_error());
    atomic_store(&fault_ops_left, -1);
    ck_assert_int_eq(duet_eval(m, tok, 3, 0, got), DUET_OK);
    ck_assert_msg(!memcmp(want, got, sizeof(float) * 300), "logits after a failed step differ");
    fault_remove(m->be);
    free(want), free(got);
    duet_model_close(m);
    remove(path);
}
END_TEST

/* ---- long token texts -------------------------------------------------------- */

typedef struct text_acc {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    char *buf;
    size_t len;
    bool done;
} text_acc;

static void text_append(text_acc *a, const char *text, size_t len) {
    a->buf = realloc(a->buf, a->len + len + 1);
    memcpy(a->buf + a->len, text, len);
    a->len += len;
    a->buf[a->len] = 0;
}

static bool on_text(int32_t id, const char *text, size_t len, void *user) {
    text_append(user, text, len);
    return true;
}

static void on_engine_event(const duet_event *ev, void *user) {
    text_acc *a = user;
    pthread_mutex_lock(&a->mu);
    if (ev->kind == DUET_EVENT_TOKEN) text_append(a, ev->text, ev->text_len);
    else a->done = true;
    pthread_cond_broadcast(&a->cv);
    pthread_mutex_unlock(&a->mu);
}

/* Nothing limits a token's text in a GGUF vocabulary. A token of 1200 bytes
 * reaches the callbacks of duet_generate and of the engine whole: no
 * truncation, and no read past the end of a fixed-size text buffer (which
 * ASan builds would report). */
START_TEST(long_token_text_is_delivered_whole) {
    char path[512], zero[600], longest[1201];
    memset(longest, 'a', 1200);
    longest[1200] = 0;
    last_token_text = longest;
    write_small("long", path, sizeof path);
    last_token_text = NULL;
    snprintf(zero, sizeof zero, "%s.zero", path);
    /* Zero output weights and a negative presence penalty: greedy decoding
     * repeats the prompt's one token (see generate_stops_...). */
    rewrite_model(path, zero, &(rewrite){.zero = "output.weight"});
    const int32_t tok = 299;
    duet_sampling smp = duet_sampling_default();
    smp.temperature = 0;
    smp.presence_penalty = -5;
    char want[2401];
    memset(want, 'a', 2400);
    want[2400] = 0;

    duet_model *m = open_small(zero);
    text_acc g = {.buf = NULL};
    ck_assert_int_eq(duet_generate(m, &tok, 1, 2, &smp, true, on_text, &g, NULL), DUET_OK);
    ck_assert_msg(g.len == 2400 && !strcmp(g.buf, want), "generate delivered %zu bytes, want 2400 'a's", g.len);
    duet_model_close(m);
    free(g.buf);

    duet_engine_params ep = duet_engine_params_default();
    ep.open.backend = "cpu";
    ep.open.n_ctx = 32;
    duet_engine *e;
    ck_assert_msg(duet_engine_start(zero, &ep, &e) == DUET_OK, "engine: %s", duet_last_error());
    text_acc a = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
    duet_request q = {.prompt = &tok, .n_prompt = 1, .max_tokens = 2, .sampling = smp, .ignore_eos = true};
    ck_assert_int_eq(duet_engine_submit(e, &q, on_engine_event, &a, NULL), DUET_OK);
    pthread_mutex_lock(&a.mu);
    while (!a.done) pthread_cond_wait(&a.cv, &a.mu);
    pthread_mutex_unlock(&a.mu);
    duet_engine_stop(e, true);
    ck_assert_msg(a.len == 2400 && !strcmp(a.buf, want), "the engine delivered %zu bytes, want 2400 'a's", a.len);
    free(a.buf);
    remove(path);
    remove(zero);
}
END_TEST

int main(void) {
    Suite *s = suite_create("forward");
    TCase *tc = tcase_create("oracle");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, llama_f32);
    tcase_add_test(tc, llama_f16_tied);
    tcase_add_test(tc, mistral_bf16);
    tcase_add_test(tc, llama_q8_0);
    tcase_add_test(tc, llama_q8_0_f32_activations);
    tcase_add_test(tc, qwen2_f32_bias_neox);
    tcase_add_test(tc, unknown_arch_and_missing_tensor);
    tcase_add_test(tc, batch_invariant_f32);
    tcase_add_test(tc, batch_invariant_f16);
    tcase_add_test(tc, batch_invariant_bf16);
    tcase_add_test(tc, batch_invariant_q8_0);
    tcase_add_test(tc, huge_hyperparameters_are_refused);
    tcase_add_test(tc, eval_positions_do_not_overflow);
    tcase_add_test(tc, generate_stops_when_the_callback_says_so);
    tcase_add_test(tc, failed_op_keeps_its_message);
    tcase_add_test(tc, long_token_text_is_delivered_whole);
    suite_add_tcase(s, tc);
    TCase *ta = tcase_create("archs");
    tcase_set_timeout(ta, 300);
    tcase_add_test(ta, llama31_rope_freqs);
    tcase_add_test(ta, llama_linear_sliding_window);
    tcase_add_test(ta, qwen2_yarn);
    tcase_add_test(ta, qwen3_qk_norm);
    tcase_add_test(ta, mkmodel_variants_load_and_run);
    tcase_add_test(ta, unsupported_arch_and_scaling_are_named);
    suite_add_tcase(s, ta);
    return test_run_suite(s);
}
