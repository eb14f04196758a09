/* mkmodel.c — synthetic Llama-shaped models with deterministic random
 * weights and a working SentencePiece-style vocabulary, for tests, demos and
 * benchmarks (the project ships no third-party weights). */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "gguf.h"

typedef struct shape {
    const char *name;
    int n_embd, n_layer, n_head, n_head_kv, n_ff, n_vocab, n_ctx;
    bool tied;
    /* The other architectures and RoPE variants (0/NULL: a plain llama). */
    const char *arch;    /* "llama" when NULL; qwen2 gets q/k/v biases, qwen3 q/k norms */
    int head_dim;        /* attention.key_length, when not n_embd / n_head */
    float rope_base;     /* 10000 when 0 */
    const char *scaling; /* rope.scaling.type */
    float factor;        /* rope.scaling.factor; with llama3: the rope_freqs tensor's */
    int orig_ctx;        /* rope.scaling.original_context_length; with llama3: the factors' */
    bool llama3;         /* a rope_freqs tensor of Llama 3.1's per-band factors */
    int window;          /* attention.sliding_window */
} shape;

/* Rows name only the fields they use. */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"
static const shape shapes[] = {
    {"tiny", 64, 2, 4, 2, 192, 512, 512, false},
    {"small", 128, 2, 4, 2, 384, 512, 4096, false}, /* head_dim 32: q8_0 KV, long-context tests */
    {"125m", 768, 12, 12, 12, 2048, 32000, 2048, true},
    {"1b", 2048, 22, 32, 4, 5632, 32000, 2048, false},   /* TinyLlama-1.1B */
    {"7b", 4096, 32, 32, 32, 11008, 32000, 4096, false}, /* Llama-2-7B */
    /* tiny models of each variant real files use */
    {"tiny-llama3", 64, 2, 4, 2, 192, 512, 512, true, .rope_base = 500000, .factor = 8, .orig_ctx = 64,
     .llama3 = true}, /* Llama 3.1/3.2: rope_freqs */
    {"tiny-yarn", 64, 2, 4, 2, 192, 512, 512, false, "qwen2", .rope_base = 1000000, .scaling = "yarn",
     .factor = 4, .orig_ctx = 128},
    {"tiny-qwen3", 64, 2, 4, 2, 192, 512, 512, true, "qwen3", .head_dim = 32, .rope_base = 1000000},
    {"tiny-swa", 64, 2, 4, 2, 192, 512, 512, false, .window = 32}, /* Mistral's sliding window */
};
#pragma GCC diagnostic pop
#define SHAPE_NAMES "tiny, small, 125m, 1b, 7b, tiny-llama3, tiny-yarn, tiny-qwen3, tiny-swa"

/* Llama 3.1's rope_freqs as convert_hf_to_gguf computes them (low_freq_factor
 * 1, high_freq_factor 4): 1 for wavelengths under orig/4, factor over orig,
 * a smooth blend between. */
static void llama3_factors(const shape *sh, int n_rot, float base, float *ff) {
    const double lo_wl = sh->orig_ctx, hi_wl = sh->orig_ctx / 4.0;
    for (int i = 0; i < n_rot / 2; i++) {
        const double wl = 2 * M_PI * pow(base, 2.0 * i / n_rot);
        const double smooth = (sh->orig_ctx / wl - 1) / (4 - 1);
        ff[i] = wl < hi_wl   ? 1.0f
                : wl > lo_wl ? sh->factor
                             : (float)(1 / ((1 - smooth) / sh->factor + smooth));
    }
}

/* splitmix64: a fast, well-mixed generator; one stream per tensor. */
static uint64_t splitmix64(uint64_t *s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Uniform in [-a, a] with a = std * sqrt(3), so the values have that std. */
static void fill_uniform(float *x, int64_t n, float std, uint64_t seed) {
    const float a = std * 1.7320508f;
    for (int64_t i = 0; i < n; i++) {
        uint64_t r = splitmix64(&seed);
        x[i] = a * (2.0f * (float)(r >> 40) * (1.0f / 16777216.0f) - 1.0f);
    }
}

/* The vocabulary: <unk> <s> </s>, 256 byte tokens, then pieces built so
 * every piece is reachable by merging two shorter ones: single characters,
 * "▁"+character, then two- and three-character strings, scored so shorter
 * merges happen first. */
static char **make_vocab(int n_vocab, float *scores, int32_t *types) {
    char **v = calloc((size_t)n_vocab, sizeof *v);
    if (!v) return NULL;
    int n = 0;
    const char *specials[3] = {"<unk>", "<s>", "</s>"};
    const int32_t special_types[3] = {2, 3, 3};
    for (int i = 0; i < 3; i++) {
        v[n] = strdup(specials[i]);
        scores[n] = 0;
        types[n++] = special_types[i];
    }
    for (int b = 0; b < 256 && n < n_vocab; b++) {
        char buf[8];
        snprintf(buf, sizeof buf, "<0x%02X>", b);
        v[n] = strdup(buf);
        scores[n] = 0;
        types[n++] = 6;
    }
    const char *alpha = "etaoinshrdlcumwfgypbvkjxqz";
    const char *extra = "ETAOINSHRDLCUMWFGYPBVKJXQZ.,!?'\"-:;()0123456789";
    char chars[128];
    snprintf(chars, sizeof chars, "%s%s", alpha, extra);
    int nc = (int)strlen(chars);
    float score = -1;
    char buf[32];
#define ADD_PIECE(str)                                                                                   \
    do {                                                                                                 \
        if (n >= n_vocab) goto done;                                                                     \
        v[n] = strdup(str);                                                                              \
        scores[n] = score;                                                                               \
        score -= 1;                                                                                      \
        types[n++] = 1;                                                                                  \
    } while (0)
    ADD_PIECE("\xe2\x96\x81"); /* "▁" */
    for (int i = 0; i < nc; i++) {
        buf[0] = chars[i], buf[1] = 0;
        ADD_PIECE(buf);
    }
    for (int i = 0; i < nc; i++) {
        snprintf(buf, sizeof buf, "\xe2\x96\x81%c", chars[i]);
        ADD_PIECE(buf);
    }
    for (int i = 0; i < 26; i++)
        for (int j = 0; j < 26; j++) {
            snprintf(buf, sizeof buf, "%c%c", alpha[i], alpha[j]);
            ADD_PIECE(buf);
        }
    for (int i = 0; i < 26; i++)
        for (int j = 0; j < 26; j++) {
            snprintf(buf, sizeof buf, "\xe2\x96\x81%c%c", alpha[i], alpha[j]);
            ADD_PIECE(buf);
        }
    for (int i = 0; i < 26; i++)
        for (int j = 0; j < 26; j++)
            for (int k = 0; k < 26; k++) {
                snprintf(buf, sizeof buf, "%c%c%c", alpha[i], alpha[j], alpha[k]);
                ADD_PIECE(buf);
            }
    for (int i = 0; i < 26; i++)
        for (int j = 0; j < 26; j++)
            for (int k = 0; k < 26; k++) {
                snprintf(buf, sizeof buf, "\xe2\x96\x81%c%c%c", alpha[i], alpha[j], alpha[k]);
                ADD_PIECE(buf);
            }
    /* Fill the rest with unreachable placeholders that never occur in text. */
    while (n < n_vocab) {
        snprintf(buf, sizeof buf, "<unused%d>", n);
        v[n] = strdup(buf);
        scores[n] = -1e9f;
        types[n++] = 5;
    }
done:
#undef ADD_PIECE
    for (int i = 0; i < n_vocab; i++)
        if (!v[i]) {
            for (int j = 0; j < n_vocab; j++) free(v[j]);
            free(v);
            return NULL;
        }
    return v;
}

/* Generates one tensor (rows x cols, std) and adds it converted to `type`. */
static duet_status add_random(duet_gguf_writer *w, const char *name, duet_dtype type, int64_t cols,
                              int64_t rows, float std, float mean, uint64_t seed) {
    size_t row_bytes = duet_dtype_row_bytes(type, cols);
    uint8_t *data = malloc(row_bytes * (size_t)rows);
    float *row = malloc((size_t)cols * sizeof(float));
    if (!data || !row) {
        free(data);
        free(row);
        return duet__error(DUET_OUT_OF_MEMORY, "mkmodel: out of memory for '%s'", name);
    }
    for (int64_t r = 0; r < rows; r++) {
        fill_uniform(row, cols, std, seed ^ (0x5851F42D4C957F2Dull * (uint64_t)(r + 1)));
        for (int64_t c = 0; c < cols; c++) row[c] += mean;
        duet_convert_row(type, row, data + (size_t)r * row_bytes, cols);
    }
    free(row);
    int64_t ne[2] = {cols, rows};
    duet_gguf_add_tensor(w, name, type, rows > 1 ? 2 : 1, ne, data, false);
    free(data);
    return DUET_OK;
}

duet_status duet_mkmodel(const duet_mkmodel_params *p, const char *path) {
    if (!p || !path) return duet__error(DUET_INVALID_ARGUMENT, "mkmodel: NULL argument");
    const shape *sh = NULL;
    for (size_t i = 0; i < sizeof shapes / sizeof *shapes; i++)
        if (p->shape && strcmp(p->shape, shapes[i].name) == 0) sh = &shapes[i];
    if (!sh)
        return duet__error(DUET_INVALID_ARGUMENT, "mkmodel: unknown shape '%s' (have: " SHAPE_NAMES ")",
                           p->shape ? p->shape : "(null)");
    duet_dtype type;
    if (!p->type || strcmp(p->type, "f32") == 0) type = DUET_DTYPE_F32;
    else if (strcmp(p->type, "f16") == 0) type = DUET_DTYPE_F16;
    else if (strcmp(p->type, "q8_0") == 0) type = DUET_DTYPE_Q8_0;
    else return duet__error(DUET_INVALID_ARGUMENT, "mkmodel: unknown type '%s' (have: f32, f16, q8_0)", p->type);
    if (p->n_ctx < 0 || p->n_ctx > (1 << 20))
        return duet__error(DUET_INVALID_ARGUMENT, "mkmodel: n_ctx %d out of range [1, 1048576] (0 = the shape's default)", p->n_ctx);

    duet_gguf_writer *w = duet_gguf_writer_new();
    if (!w) return duet__error(DUET_OUT_OF_MEMORY, "mkmodel: out of memory");
    char name[64];
    snprintf(name, sizeof name, "duet-synthetic-%s-%s", sh->name, duet_dtype_name(type));
    const char *arch = sh->arch ? sh->arch : "llama";
    const int hd = sh->head_dim ? sh->head_dim : sh->n_embd / sh->n_head;
    const float base = sh->rope_base ? sh->rope_base : 10000.0f;
    char key[96];
#define KEY(suffix) (snprintf(key, sizeof key, "%s.%s", arch, suffix), key)
    duet_gguf_set_str(w, "general.architecture", arch);
    duet_gguf_set_str(w, "general.name", name);
    duet_gguf_set_u32(w, "general.file_type", type == DUET_DTYPE_F32 ? 0 : type == DUET_DTYPE_F16 ? 1 : 7);
    duet_gguf_set_u32(w, KEY("context_length"), (uint32_t)(p->n_ctx ? p->n_ctx : sh->n_ctx));
    duet_gguf_set_u32(w, KEY("embedding_length"), (uint32_t)sh->n_embd);
    duet_gguf_set_u32(w, KEY("block_count"), (uint32_t)sh->n_layer);
    duet_gguf_set_u32(w, KEY("feed_forward_length"), (uint32_t)sh->n_ff);
    duet_gguf_set_u32(w, KEY("attention.head_count"), (uint32_t)sh->n_head);
    duet_gguf_set_u32(w, KEY("attention.head_count_kv"), (uint32_t)sh->n_head_kv);
    if (sh->head_dim) {
        duet_gguf_set_u32(w, KEY("attention.key_length"), (uint32_t)hd);
        duet_gguf_set_u32(w, KEY("attention.value_length"), (uint32_t)hd);
    }
    duet_gguf_set_u32(w, KEY("rope.dimension_count"), (uint32_t)hd);
    duet_gguf_set_f32(w, KEY("rope.freq_base"), base);
    if (sh->scaling) {
        duet_gguf_set_str(w, KEY("rope.scaling.type"), sh->scaling);
        duet_gguf_set_f32(w, KEY("rope.scaling.factor"), sh->factor);
        duet_gguf_set_u32(w, KEY("rope.scaling.original_context_length"), (uint32_t)sh->orig_ctx);
    }
    if (sh->window) duet_gguf_set_u32(w, KEY("attention.sliding_window"), (uint32_t)sh->window);
    duet_gguf_set_f32(w, KEY("attention.layer_norm_rms_epsilon"), 1e-5f);
    duet_gguf_set_u32(w, KEY("vocab_size"), (uint32_t)sh->n_vocab);
#undef KEY

    float *scores = malloc((size_t)sh->n_vocab * sizeof(float));
    int32_t *types = malloc((size_t)sh->n_vocab * sizeof(int32_t));
    char **vocab = scores && types ? make_vocab(sh->n_vocab, scores, types) : NULL;
    if (!vocab) {
        free(scores);
        free(types);
        duet_gguf_writer_free(w);
        return duet__error(DUET_OUT_OF_MEMORY, "mkmodel: out of memory for the vocabulary");
    }
    duet_gguf_set_str(w, "tokenizer.ggml.model", "llama");
    duet_gguf_set_str(w, "tokenizer.ggml.pre", "default");
    duet_gguf_set_str_array(w, "tokenizer.ggml.tokens", (const char *const *)vocab, (uint64_t)sh->n_vocab);
    duet_gguf_set_array(w, "tokenizer.ggml.scores", DUET_GGUF_FLOAT32, scores, (uint64_t)sh->n_vocab);
    duet_gguf_set_array(w, "tokenizer.ggml.token_type", DUET_GGUF_INT32, types, (uint64_t)sh->n_vocab);
    duet_gguf_set_u32(w, "tokenizer.ggml.bos_token_id", 1);
    duet_gguf_set_u32(w, "tokenizer.ggml.eos_token_id", 2);
    duet_gguf_set_u32(w, "tokenizer.ggml.unknown_token_id", 0);
    duet_gguf_set_bool(w, "tokenizer.ggml.add_bos_token", true);
    duet_gguf_set_bool(w, "tokenizer.ggml.add_eos_token", false);
    for (int i = 0; i < sh->n_vocab; i++) free(vocab[i]);
    free(vocab);
    free(scores);
    free(types);

    const int64_t E = sh->n_embd, F = sh->n_ff, V = sh->n_vocab;
    const int64_t Q = hd * sh->n_head, KV = hd * sh->n_head_kv;
    const bool bias = strcmp(arch, "qwen2") == 0, qk_norm = strcmp(arch, "qwen3") == 0;
    /* Weights scaled like a trained model's (std ~ 1/sqrt(fan_in)) so the
     * residual stream stays well conditioned through every layer. */
    const float s_in = 1.0f / sqrtf((float)E), s_ff = 1.0f / sqrtf((float)F);
    uint64_t seed = p->seed * 0x9E3779B97F4A7C15ull + 1;
    uint64_t t = 0;
    duet_status st = DUET_OK;
#define ADD(nm, ty, cols, rows, std, mean)                                                               \
    do {                                                                                                 \
        if (!st) st = add_random(w, nm, ty, cols, rows, std, mean, seed + 0x1000193ull * ++t);           \
    } while (0)
    ADD("token_embd.weight", type, E, V, 1.0f, 0.0f);
    ADD("output_norm.weight", DUET_DTYPE_F32, E, 1, 0.05f, 1.0f);
    if (!sh->tied) ADD("output.weight", type, E, V, s_in, 0.0f);
    if (sh->llama3 && !st) {
        float ff[512];
        llama3_factors(sh, hd, base, ff);
        duet_gguf_add_tensor(w, "rope_freqs.weight", DUET_DTYPE_F32, 1, (int64_t[1]){hd / 2}, ff, false);
    }
    for (int l = 0; l < sh->n_layer && !st; l++) {
        char n[96];
#define LAYER(suffix, ty, cols, rows, std, mean)                                                         \
    do {                                                                                                 \
        snprintf(n, sizeof n, "blk.%d.%s", l, suffix);                                                   \
        ADD(n, ty, cols, rows, std, mean);                                                               \
    } while (0)
        LAYER("attn_norm.weight", DUET_DTYPE_F32, E, 1, 0.05f, 1.0f);
        LAYER("attn_q.weight", type, E, Q, s_in, 0.0f);
        LAYER("attn_k.weight", type, E, KV, s_in, 0.0f);
        LAYER("attn_v.weight", type, E, KV, s_in, 0.0f);
        if (bias) {
            LAYER("attn_q.bias", DUET_DTYPE_F32, Q, 1, 0.1f, 0.0f);
            LAYER("attn_k.bias", DUET_DTYPE_F32, KV, 1, 0.1f, 0.0f);
            LAYER("attn_v.bias", DUET_DTYPE_F32, KV, 1, 0.1f, 0.0f);
        }
        if (qk_norm) {
            LAYER("attn_q_norm.weight", DUET_DTYPE_F32, hd, 1, 0.05f, 1.0f);
            LAYER("attn_k_norm.weight", DUET_DTYPE_F32, hd, 1, 0.05f, 1.0f);
        }
        LAYER("attn_output.weight", type, Q, E, s_in * 0.5f, 0.0f);
        LAYER("ffn_norm.weight", DUET_DTYPE_F32, E, 1, 0.05f, 1.0f);
        LAYER("ffn_gate.weight", type, E, F, s_in, 0.0f);
        LAYER("ffn_up.weight", type, E, F, s_in, 0.0f);
        LAYER("ffn_down.weight", type, F, E, s_ff * 0.5f, 0.0f);
#undef LAYER
    }
#undef ADD
    if (!st) st = duet_gguf_write(w, path);
    duet_gguf_writer_free(w);
    return st;
}

/* ---- the cache of generated models ---------------------------------------------------- */

/* mkdir -p. */
static void make_dirs(char *dir) {
    for (char *q = dir + 1; *q; q++)
        if (*q == '/') {
            *q = 0;
            mkdir(dir, 0755);
            *q = '/';
        }
    mkdir(dir, 0755);
}

duet_status duet_mkmodel_cached(const duet_mkmodel_params *p, char *path, size_t size, bool *generated) {
    if (generated) *generated = false;
    if (!p || !p->shape || !p->type || !path || size == 0)
        return duet__error(DUET_INVALID_ARGUMENT,
                           "mkmodel_cached: shape, type and a path buffer are required");
    const char *cache = getenv("XDG_CACHE_HOME"), *home = getenv("HOME");
    char dir[2048];
    if (cache && *cache)
        snprintf(dir, sizeof dir, "%s/duet/models", cache);
    else
        snprintf(dir, sizeof dir, "%s/.cache/duet/models", home && *home ? home : "/tmp");
    /* Every parameter and the generator's version name the file, so a
     * model made by an older generator is never taken for today's. */
    int n = snprintf(path, size, "%s/synthetic-v%d-%s-%s-ctx%d-seed%llu.gguf", dir, DUET_MKMODEL_VERSION,
                     p->shape, p->type, p->n_ctx, (unsigned long long)p->seed);
    if (n < 0 || (size_t)n >= size)
        return duet__error(DUET_INVALID_ARGUMENT, "mkmodel_cached: path too long");
    struct stat sb;
    if (stat(path, &sb) == 0) return DUET_OK;
    make_dirs(dir);
    /* Written under a private name, then renamed: a concurrent run, or one
     * after an interrupted write, never finds a partial file at `path`. */
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.%ld.tmp", path, (long)getpid());
    duet_status st = duet_mkmodel(p, tmp);
    if (st) {
        remove(tmp);
        return st;
    }
    if (rename(tmp, path) != 0) {
        int e = errno;
        remove(tmp);
        return duet__error(DUET_IO, "mkmodel_cached: cannot move %s to %s: %s", tmp, path, strerror(e));
    }
    if (generated) *generated = true;
    return DUET_OK;
}
