/* test_forward.c — the forward pass against a naive double-precision
 * transformer written here, on small models the test writes itself: llama
 * (adjacent-pair RoPE, GQA), qwen2 (q/k/v biases, NeoX RoPE, own rope base),
 * tied and separate outputs, and every weight type (f32, f16, bf16, q8_0). */
#include <math.h>

#include "duet.h"
#include "gguf.h"
#include "test_util.h"

typedef struct cfg {
    const char *arch;
    duet_dtype type;
    bool tied;
    int E, L, H, HKV, F, V;
    float rope_base;
} cfg;

static uint64_t rng_state;
static float frand(float scale) {
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return scale * ((float)((rng_state >> 40) & 0xFFFFFF) / 16777216.0f * 2.0f - 1.0f);
}

/* Stores every tensor as written (after the round trip through its dtype),
 * so the reference sees exactly the weights the engine sees. */
typedef struct ref_tensor {
    char name[64];
    float *data;
    int64_t rows, cols;
} ref_tensor;

static ref_tensor tensors[256];
static int n_tensors;

static const float *T(const char *name) {
    for (int i = 0; i < n_tensors; i++)
        if (!strcmp(tensors[i].name, name)) return tensors[i].data;
    return NULL;
}

static void add(duet_gguf_writer *w, const char *name, duet_dtype type, int64_t cols, int64_t rows, float scale,
                float mean) {
    ref_tensor *t = &tensors[n_tensors++];
    snprintf(t->name, sizeof t->name, "%s", name);
    t->rows = rows, t->cols = cols;
    t->data = malloc(sizeof(float) * cols * rows);
    size_t rb = duet_dtype_row_bytes(type, cols);
    uint8_t *q = malloc(rb * rows);
    for (int64_t r = 0; r < rows; r++) {
        float *row = t->data + r * cols;
        for (int64_t c = 0; c < cols; c++) row[c] = mean + frand(scale);
        duet_convert_row(type, row, q + r * rb, cols);
        duet_dequantize_row(type, q + r * rb, row, cols);
    }
    int64_t ne[2] = {cols, rows};
    duet_gguf_add_tensor(w, name, type, rows > 1 ? 2 : 1, ne, q, false);
    free(q);
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
    /* A byte-level vocabulary: <unk> <s> </s> and 256 byte tokens + fillers. */
    const char **toks = malloc(sizeof(char *) * c->V);
    char(*store)[16] = malloc(16 * (size_t)c->V);
    float *scores = calloc(c->V, sizeof(float));
    int32_t *types = malloc(sizeof(int32_t) * c->V);
    for (int i = 0; i < c->V; i++) {
        if (i < 3) snprintf(store[i], 16, "%s", i == 0 ? "<unk>" : i == 1 ? "<s>" : "</s>");
        else if (i < 259) snprintf(store[i], 16, "<0x%02X>", i - 3);
        else snprintf(store[i], 16, "tok%d", i);
        toks[i] = store[i];
        types[i] = i == 0 ? 2 : i < 3 ? 3 : i < 259 ? 6 : 1;
    }
    duet_gguf_set_str(w, "tokenizer.ggml.model", "llama");
    duet_gguf_set_str_array(w, "tokenizer.ggml.tokens", toks, c->V);
    duet_gguf_set_array(w, "tokenizer.ggml.scores", DUET_GGUF_FLOAT32, scores, c->V);
    duet_gguf_set_array(w, "tokenizer.ggml.token_type", DUET_GGUF_INT32, types, c->V);
    duet_gguf_set_u32(w, "tokenizer.ggml.bos_token_id", 1);
    duet_gguf_set_u32(w, "tokenizer.ggml.eos_token_id", 2);
    free(toks), free(store), free(scores), free(types);

    const int hd = c->E / c->H, KV = hd * c->HKV;
    add(w, "token_embd.weight", c->type, c->E, c->V, 1.0f, 0);
    add(w, "output_norm.weight", DUET_DTYPE_F32, c->E, 1, 0.2f, 1.0f);
    if (!c->tied) add(w, "output.weight", c->type, c->E, c->V, 0.3f, 0);
    for (int l = 0; l < c->L; l++) {
        char n[64];
#define LAYER(s, ty, cols, rows, sc, mean) (snprintf(n, sizeof n, "blk.%d.%s", l, s), add(w, n, ty, cols, rows, sc, mean))
        LAYER("attn_norm.weight", DUET_DTYPE_F32, c->E, 1, 0.2f, 1.0f);
        LAYER("attn_q.weight", c->type, c->E, c->E, 0.3f, 0);
        LAYER("attn_k.weight", c->type, c->E, KV, 0.3f, 0);
        LAYER("attn_v.weight", c->type, c->E, KV, 0.3f, 0);
        if (!strcmp(c->arch, "qwen2")) {
            LAYER("attn_q.bias", DUET_DTYPE_F32, c->E, 1, 0.5f, 0);
            LAYER("attn_k.bias", DUET_DTYPE_F32, KV, 1, 0.5f, 0);
            LAYER("attn_v.bias", DUET_DTYPE_F32, KV, 1, 0.5f, 0);
        }
        LAYER("attn_output.weight", c->type, c->E, c->E, 0.3f, 0);
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

/* ---- the naive reference (double precision, whole sequence) ------------- */

static void rmsnorm(double *out, const double *x, const float *w, int n) {
    double ss = 0;
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    double s = 1.0 / sqrt(ss / n + 1e-6);
    for (int i = 0; i < n; i++) out[i] = x[i] * s * w[i];
}

static void matvec(double *out, const float *W, const double *x, int rows, int cols, const float *bias) {
    for (int r = 0; r < rows; r++) {
        double s = bias ? bias[r] : 0;
        for (int c = 0; c < cols; c++) s += (double)W[(size_t)r * cols + c] * x[c];
        out[r] = s;
    }
}

static void rope(double *v, int n_heads, int hd, int pos, double base, bool neox) {
    for (int h = 0; h < n_heads; h++)
        for (int i = 0; i < hd / 2; i++) {
            double theta = pos * pow(base, -2.0 * i / hd);
            int a = neox ? i : 2 * i, b = neox ? i + hd / 2 : 2 * i + 1;
            double x0 = v[h * hd + a], x1 = v[h * hd + b];
            v[h * hd + a] = x0 * cos(theta) - x1 * sin(theta);
            v[h * hd + b] = x0 * sin(theta) + x1 * cos(theta);
        }
}

/* Logits of the last of n tokens. */
static void reference_logits(const cfg *c, const int32_t *tok, int n, double *logits) {
    const int E = c->E, hd = E / c->H, KV = hd * c->HKV, F = c->F;
    bool qwen = !strcmp(c->arch, "qwen2");
    double *x = calloc((size_t)n * E, sizeof(double)), *xn = malloc(sizeof(double) * E);
    double *q = malloc(sizeof(double) * (size_t)n * E), *k = malloc(sizeof(double) * (size_t)n * KV),
           *v = malloc(sizeof(double) * (size_t)n * KV);
    double *att = malloc(sizeof(double) * E), *tmp = malloc(sizeof(double) * E), *g = malloc(sizeof(double) * F),
           *u = malloc(sizeof(double) * F), *sc = malloc(sizeof(double) * n);
    for (int t = 0; t < n; t++)
        for (int i = 0; i < E; i++) x[t * E + i] = T("token_embd.weight")[(size_t)tok[t] * E + i];
    char nm[64];
#define W(s) (snprintf(nm, sizeof nm, "blk.%d.%s", l, s), T(nm))
    for (int l = 0; l < c->L; l++) {
        for (int t = 0; t < n; t++) {
            rmsnorm(xn, x + t * E, W("attn_norm.weight"), E);
            matvec(q + t * E, W("attn_q.weight"), xn, E, E, qwen ? W("attn_q.bias") : NULL);
            matvec(k + t * KV, W("attn_k.weight"), xn, KV, E, qwen ? W("attn_k.bias") : NULL);
            matvec(v + t * KV, W("attn_v.weight"), xn, KV, E, qwen ? W("attn_v.bias") : NULL);
            rope(q + t * E, c->H, hd, t, c->rope_base, qwen);
            rope(k + t * KV, c->HKV, hd, t, c->rope_base, qwen);
        }
        for (int t = 0; t < n; t++) {
            for (int h = 0; h < c->H; h++) {
                int kh = h / (c->H / c->HKV);
                double mx = -1e300, sum = 0;
                for (int s = 0; s <= t; s++) {
                    double d = 0;
                    for (int i = 0; i < hd; i++) d += q[t * E + h * hd + i] * k[s * KV + kh * hd + i];
                    sc[s] = d / sqrt(hd);
                    if (sc[s] > mx) mx = sc[s];
                }
                for (int s = 0; s <= t; s++) sum += (sc[s] = exp(sc[s] - mx));
                for (int i = 0; i < hd; i++) {
                    double a = 0;
                    for (int s = 0; s <= t; s++) a += sc[s] / sum * v[s * KV + kh * hd + i];
                    att[h * hd + i] = a;
                }
            }
            matvec(tmp, W("attn_output.weight"), att, E, E, NULL);
            for (int i = 0; i < E; i++) x[t * E + i] += tmp[i];
            rmsnorm(xn, x + t * E, W("ffn_norm.weight"), E);
            matvec(g, W("ffn_gate.weight"), xn, F, E, NULL);
            matvec(u, W("ffn_up.weight"), xn, F, E, NULL);
            for (int i = 0; i < F; i++) g[i] = g[i] / (1 + exp(-g[i])) * u[i];
            matvec(tmp, W("ffn_down.weight"), g, E, F, NULL);
            for (int i = 0; i < E; i++) x[t * E + i] += tmp[i];
        }
    }
#undef W
    rmsnorm(xn, x + (n - 1) * E, T("output_norm.weight"), E);
    matvec(logits, T(c->tied ? "token_embd.weight" : "output.weight"), xn, c->V, E, NULL);
    free(x), free(xn), free(q), free(k), free(v), free(att), free(tmp), free(g), free(u), free(sc);
}

static void check_model(const cfg *c, double tol) {
    char path[512];
    snprintf(path, sizeof path, "%s/test_forward_%s_%s.gguf", DUET_BINARY_DIR, c->arch, duet_dtype_name(c->type));
    write_model(c, path);
    duet_open_params p = duet_open_params_default();
    p.backend = getenv("DUET_TEST_BACKEND") ? getenv("DUET_TEST_BACKEND") : "cpu";
    p.kv_type = "f32";
    p.n_ctx = 256;
    duet_model *m;
    ck_assert_msg(duet_model_open(path, &p, &m) == DUET_OK, "open: %s", duet_last_error());
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
        ck_assert_msg(nmse < tol, "%s %s: %d tokens: NMSE %g >= %g", c->arch, duet_dtype_name(c->type), n, nmse, tol);
    }
    free(got), free(want);
    duet_model_close(m);
    for (int i = 0; i < n_tensors; i++) free(tensors[i].data);
    remove(path);
}

/* The activations of q8_0 matmuls are quantized to 8 bits: a looser bound. */
START_TEST(llama_f32) { check_model(&(cfg){"llama", DUET_DTYPE_F32, false, 64, 2, 8, 2, 96, 300, 10000}, 1e-9); }
END_TEST
START_TEST(llama_f16_tied) { check_model(&(cfg){"llama", DUET_DTYPE_F16, true, 64, 2, 4, 4, 96, 300, 10000}, 1e-6); }
END_TEST
START_TEST(mistral_bf16) { check_model(&(cfg){"mistral", DUET_DTYPE_BF16, false, 96, 2, 6, 2, 128, 280, 10000}, 1e-6); }
END_TEST
START_TEST(llama_q8_0) { check_model(&(cfg){"llama", DUET_DTYPE_Q8_0, false, 64, 2, 8, 2, 96, 300, 10000}, 1e-3); }
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
    for (int i = 0; i < n_tensors; i++) free(tensors[i].data);
    duet_gguf *g;
    ck_assert_int_eq(duet_gguf_open(path, &g), DUET_OK);
    /* Rewrite without ffn_up: the loader must name it. */
    w = duet_gguf_writer_new();
    duet_gguf_copy_kv(w, g);
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        char name[96];
        snprintf(name, sizeof name, "%.*s", (int)g->tensors[i].name.len, g->tensors[i].name.ptr);
        if (strstr(name, "ffn_up")) continue;
        duet_gguf_add_tensor(w, name, g->tensors[i].type, g->tensors[i].n_dims, g->tensors[i].ne, g->tensors[i].data,
                             false);
    }
    char path2[600];
    snprintf(path2, sizeof path2, "%s.2", path);
    ck_assert_int_eq(duet_gguf_write(w, path2), DUET_OK);
    duet_gguf_writer_free(w);
    duet_gguf_close(g);
    st = duet_model_open(path2, &p, &m);
    ck_assert_int_eq(st, DUET_BAD_MODEL);
    ck_assert_msg(strstr(duet_last_error(), "blk.0.ffn_up.weight"), "message: %s", duet_last_error());
    remove(path);
    remove(path2);
}
END_TEST

int main(void) {
    Suite *s = suite_create("forward");
    TCase *tc = tcase_create("vs naive reference");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, llama_f32);
    tcase_add_test(tc, llama_f16_tied);
    tcase_add_test(tc, mistral_bf16);
    tcase_add_test(tc, llama_q8_0);
    tcase_add_test(tc, qwen2_f32_bias_neox);
    tcase_add_test(tc, unknown_arch_and_missing_tensor);
    suite_add_tcase(s, tc);
    return test_run_suite(s);
}
