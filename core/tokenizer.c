/* tokenizer.c — SentencePiece-style BPE ("llama") and byte-level BPE ("gpt2")
 * tokenizers built from GGUF tokenizer.ggml.* metadata.
 *
 * Both encoders merge with a priority queue over adjacent symbol pairs kept
 * in a doubly linked list, so a prompt of n characters costs O(n log n).
 * The tokenizer is immutable after load; every per-call buffer is allocated
 * by the call, so one tokenizer may be used from many threads.
 */
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <float.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../backends/backend.h"
#include "tokenizer.h"

enum { KIND_SPM, KIND_BPE };

/* Per-token flags, computed at load. */
enum {
    FLAG_EOG = 1,          /* ends generation */
    FLAG_MERGEABLE = 2,    /* may be produced by (or take part in) SPM merges */
    FLAG_MATCH_ALWAYS = 4, /* user-defined: matched in raw text even without parse_special */
    FLAG_MATCH_SPECIAL = 8 /* control/unknown: matched in raw text with parse_special */
};

#define MAX_REGEX 6
/* Longest input encode accepts: keeps every offset (also the 3x-expanded SPM
 * buffer) within 32 bits and every token count within int. */
#define MAX_ENCODE_BYTES ((size_t)1 << 29)

typedef struct merge_slot {
    uint64_t key; /* (left id << 32) | right id; UINT64_MAX = empty */
    int32_t rank;
    int32_t result;
} merge_slot;

struct duet_tokenizer {
    int kind;
    int n_vocab;
    char *text;    /* every piece, NUL-terminated, back to back */
    uint32_t *off; /* piece i is text + off[i], len[i] bytes */
    uint32_t *len;
    char *dec; /* decoded bytes of every token, back to back */
    uint32_t *dec_off;
    uint32_t *dec_len;
    float *scores;  /* SPM merge priority (higher first) */
    uint8_t *type;  /* duet_token_type */
    uint8_t *flags; /* FLAG_* */
    int32_t *slots; /* open-addressing hash: piece -> id (-1 empty) */
    uint32_t slot_mask;
    merge_slot *merges; /* BPE: pair of ids -> rank and merged id */
    uint32_t merge_mask;
    int32_t byte_tok[256]; /* SPM: <0xNN> token; BPE: token of byte b's unicode char; -1 none */
    int32_t *specials;     /* ids matched in raw text, sorted by first byte then length desc */
    int n_specials;
    int n_always;               /* how many of them are matched without parse_special */
    int32_t special_start[257]; /* specials[special_start[b]..special_start[b+1]) start with byte b */
    pcre2_code *re[MAX_REGEX];
    int n_re;
    bool jit;
    int32_t bos, eos, unk;
    bool add_bos, add_eos, add_space_prefix;
};

/* ---- small helpers ------------------------------------------------------- */

/* Length of the UTF-8 character at s (n > 0 bytes available): > 0 for a valid
 * character; 0 when the bytes are a valid but incomplete prefix; -k when the
 * first k bytes are a maximal invalid subpart (Unicode "best practice":
 * each such subpart becomes one U+FFFD). */
static int utf8_char(const uint8_t *s, size_t n) {
    uint8_t c = s[0];
    if (c < 0x80) return 1;
    int need;
    uint8_t lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) {
        need = 1;
    } else if (c == 0xE0) {
        need = 2, lo = 0xA0;
    } else if (c == 0xED) {
        need = 2, hi = 0x9F;
    } else if (c >= 0xE1 && c <= 0xEF) {
        need = 2;
    } else if (c == 0xF0) {
        need = 3, lo = 0x90;
    } else if (c >= 0xF1 && c <= 0xF3) {
        need = 3;
    } else if (c == 0xF4) {
        need = 3, hi = 0x8F;
    } else {
        return -1;
    }
    for (int i = 1; i <= need; i++) {
        if ((size_t)i >= n) return 0;
        if (s[i] < lo || s[i] > hi) return -i;
        lo = 0x80, hi = 0xBF;
    }
    return need + 1;
}

/* Bytes of the character at s when splitting text into symbols: a valid
 * character, else one byte (so invalid input still round-trips). */
static size_t char_len(const uint8_t *s, size_t n) {
    int l = utf8_char(s, n);
    return l > 0 ? (size_t)l : 1;
}

static size_t utf8_put(uint32_t cp, char *out) {
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (char)(0xC0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    out[0] = (char)(0xE0 | (cp >> 12));
    out[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
    out[2] = (char)(0x80 | (cp & 0x3F));
    return 3;
}

/* GPT-2's byte-to-unicode alphabet: printable Latin-1 bytes map to
 * themselves, the other 68 bytes to U+0100.. in byte order. */
static uint32_t byte_to_cp(uint8_t b) {
    if ((b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE)) return b;
    uint32_t k = 0;
    for (int i = 0; i < b; i++) {
        bool printable = (i >= 0x21 && i <= 0x7E) || (i >= 0xA1 && i <= 0xAC) || (i >= 0xAE);
        if (!printable) k++;
    }
    return 0x100 + k;
}

static uint64_t hash_bytes(const char *s, size_t n) {
    uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a, then a final mix */
    for (size_t i = 0; i < n; i++)
        h = (h ^ (uint8_t)s[i]) * 0x100000001b3ull;
    h ^= h >> 32;
    return h * 0x9E3779B97F4A7C15ull;
}

static uint64_t hash_u64(uint64_t x) {
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static uint32_t table_size(uint64_t n) {
    uint32_t s = 16;
    while (s < 2 * n)
        s <<= 1;
    return s;
}

static int32_t lookup(const duet_tokenizer *t, const char *s, size_t n) {
    uint32_t i = (uint32_t)hash_bytes(s, n) & t->slot_mask;
    for (;;) {
        int32_t id = t->slots[i];
        if (id < 0) return -1;
        if (t->len[id] == n && memcmp(t->text + t->off[id], s, n) == 0) return id;
        i = (i + 1) & t->slot_mask;
    }
}

static const merge_slot *merge_find(const duet_tokenizer *t, int32_t a, int32_t b) {
    uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    uint32_t i = (uint32_t)hash_u64(key) & t->merge_mask;
    for (;;) {
        const merge_slot *m = &t->merges[i];
        if (m->key == UINT64_MAX) return NULL;
        if (m->key == key) return m;
        i = (i + 1) & t->merge_mask;
    }
}

/* ---- loading ------------------------------------------------------------- */

static bool is_int_type(duet_gguf_type ty) {
    switch (ty) {
    case DUET_GGUF_UINT8:
    case DUET_GGUF_INT8:
    case DUET_GGUF_UINT16:
    case DUET_GGUF_INT16:
    case DUET_GGUF_UINT32:
    case DUET_GGUF_INT32:
    case DUET_GGUF_UINT64:
    case DUET_GGUF_INT64:
        return true;
    default:
        return false;
    }
}

/* Element i of a scalar integer array, widened. */
static int64_t arr_int(const duet_gguf_value *v, uint64_t i) {
    const uint8_t *p = v->arr.data;
    switch (v->arr.type) {
    case DUET_GGUF_UINT8:
        return p[i];
    case DUET_GGUF_INT8:
        return (int8_t)p[i];
    case DUET_GGUF_UINT16: {
        uint16_t x;
        memcpy(&x, p + 2 * i, 2);
        return x;
    }
    case DUET_GGUF_INT16: {
        int16_t x;
        memcpy(&x, p + 2 * i, 2);
        return x;
    }
    case DUET_GGUF_UINT32: {
        uint32_t x;
        memcpy(&x, p + 4 * i, 4);
        return x;
    }
    case DUET_GGUF_INT32: {
        int32_t x;
        memcpy(&x, p + 4 * i, 4);
        return x;
    }
    case DUET_GGUF_UINT64: {
        uint64_t x;
        memcpy(&x, p + 8 * i, 8);
        return x > INT64_MAX ? -1 : (int64_t)x;
    }
    case DUET_GGUF_INT64: {
        int64_t x;
        memcpy(&x, p + 8 * i, 8);
        return x;
    }
    default:
        return -1;
    }
}

/* An array-valued key of the given element type (any integer type when
 * elem is DUET_GGUF_INT32), or NULL with *bad set when present but wrong. */
static const duet_gguf_value *get_array(const duet_gguf *g, const char *key, duet_gguf_type elem, bool *bad) {
    const duet_gguf_kv *kv = duet_gguf_find(g, key);
    if (!kv) return NULL;
    const duet_gguf_value *v = &kv->value;
    bool ok =
        v->type == DUET_GGUF_ARRAY &&
        (elem == DUET_GGUF_INT32     ? is_int_type(v->arr.type)
         : elem == DUET_GGUF_FLOAT32 ? (v->arr.type == DUET_GGUF_FLOAT32 || v->arr.type == DUET_GGUF_FLOAT64)
                                     : v->arr.type == elem);
    if (!ok) {
        *bad = true;
        return NULL;
    }
    return v;
}

/* Reads an optional token id: -1 when absent or "none" (0xFFFFFFFF / -1). */
static duet_status get_token_id(const duet_gguf *g, const char *key, int n_vocab, int32_t *out) {
    *out = -1;
    if (!duet_gguf_find(g, key)) return DUET_OK;
    int64_t v;
    if (!duet_gguf_get_i64(g, key, &v))
        return duet__error(DUET_BAD_MODEL, "tokenizer: %s is not an integer", key);
    if (v == -1 || v == 0xFFFFFFFFll) return DUET_OK;
    if (v < 0 || v >= n_vocab)
        return duet__error(DUET_BAD_MODEL, "tokenizer: %s = %lld is outside the vocabulary (%d tokens)", key,
                           (long long)v, n_vocab);
    *out = (int32_t)v;
    return DUET_OK;
}

static duet_status get_flag(const duet_gguf *g, const char *key, bool dflt, bool *out, bool *present) {
    *out = dflt;
    if (present) *present = false;
    if (!duet_gguf_find(g, key)) return DUET_OK;
    if (!duet_gguf_get_bool(g, key, out))
        return duet__error(DUET_BAD_MODEL, "tokenizer: %s is not a bool", key);
    if (present) *present = true;
    return DUET_OK;
}

/* Parses "<0xNN>" (either hex case). */
static int parse_byte_piece(const char *s, size_t n) {
    if (n != 6 || s[0] != '<' || s[1] != '0' || s[2] != 'x' || s[5] != '>') return -1;
    int v = 0;
    for (int i = 3; i < 5; i++) {
        char c = s[i];
        int d = c >= '0' && c <= '9'   ? c - '0'
                : c >= 'A' && c <= 'F' ? c - 'A' + 10
                : c >= 'a' && c <= 'f' ? c - 'a' + 10
                                       : -1;
        if (d < 0) return -1;
        v = v * 16 + d;
    }
    return v;
}

typedef struct pre_spec {
    const char *name;
    const char *patterns[MAX_REGEX];
} pre_spec;

#define RE_GPT2 "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+"
/* Llama 3 and Qwen2 spell their case-insensitive contractions (?i:'s|...) out
 * as explicit classes, so Unicode case folding (e.g. U+017F) cannot widen them. */
#define RE_LLAMA3                                                                                            \
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|"               \
    "\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
#define RE_QWEN2                                                                                             \
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|"               \
    "\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"

/* Pre-tokenizers by tokenizer.ggml.pre. Several patterns run in sequence,
 * each splitting the pieces of the previous one (Hugging Face's Split with
 * "isolated" behaviour: matches and the text between them both become
 * pieces). */
static const pre_spec PRE_SPECS[] = {
    {"default", {RE_GPT2}},
    {"gpt-2", {RE_GPT2}},
    {"gpt2", {RE_GPT2}},
    {"llama-bpe", {RE_LLAMA3}},
    {"llama3", {RE_LLAMA3}},
    {"dbrx", {RE_LLAMA3}},
    {"smaug-bpe", {RE_LLAMA3}},
    {"qwen2", {RE_QWEN2}},
    {"stablelm2", {RE_QWEN2}},
    /* StarCoder's family: every digit its own piece, then GPT-2's split. */
    {"starcoder", {"\\p{N}", RE_GPT2}},
    {"refact", {"\\p{N}", RE_GPT2}},
    {"command-r", {"\\p{N}", RE_GPT2}},
    {"smollm", {"\\p{N}", RE_GPT2}},
    {"codeshell", {"\\p{N}", RE_GPT2}},
    {"exaone", {"\\p{N}", RE_GPT2}},
    {"minerva-7b", {"\\p{N}", RE_GPT2}},
    {"deepseek-coder",
     {"[\\r\\n]", "\\s?\\p{L}+", "\\s?\\p{P}+",
      "[\\x{4E00}-\\x{9FA5}\\x{0800}-\\x{4E00}\\x{AC00}-\\x{D7FF}]+", "\\p{N}"}},
};

static duet_status compile_pre(duet_tokenizer *t, const char *pre) {
    const pre_spec *spec = NULL;
    for (size_t i = 0; i < sizeof PRE_SPECS / sizeof PRE_SPECS[0]; i++)
        if (strcmp(PRE_SPECS[i].name, pre) == 0) spec = &PRE_SPECS[i];
    if (!spec) return duet__error(DUET_UNSUPPORTED, "tokenizer: unknown pre-tokenizer '%s'", pre);
    uint32_t jit_cfg = 0;
    pcre2_config(PCRE2_CONFIG_JIT, &jit_cfg);
    t->jit = jit_cfg != 0;
    for (int i = 0; i < MAX_REGEX && spec->patterns[i]; i++) {
        int err;
        PCRE2_SIZE at;
        /* MATCH_INVALID_UTF: invalid UTF-8 in the input never matches and
         * falls into the gaps, instead of being undefined behaviour. */
        pcre2_code *re = pcre2_compile((PCRE2_SPTR)spec->patterns[i], PCRE2_ZERO_TERMINATED,
                                       PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &err, &at, NULL);
        if (!re) {
            char msg[128];
            pcre2_get_error_message(err, (PCRE2_UCHAR *)msg, sizeof msg);
            return duet__error(DUET_BAD_MODEL, "tokenizer: pre-tokenizer '%s' regex %d: %s at %zu", pre, i,
                               msg, (size_t)at);
        }
        if (t->jit && pcre2_jit_compile(re, PCRE2_JIT_COMPLETE) != 0) t->jit = false;
        t->re[t->n_re++] = re;
    }
    return DUET_OK;
}

void duet_tokenizer_free(duet_tokenizer *t) {
    if (!t) return;
    for (int i = 0; i < t->n_re; i++)
        pcre2_code_free(t->re[i]);
    free(t->text);
    free(t->off);
    free(t->len);
    free(t->dec);
    free(t->dec_off);
    free(t->dec_len);
    free(t->scores);
    free(t->type);
    free(t->flags);
    free(t->slots);
    free(t->merges);
    free(t->specials);
    free(t);
}

typedef struct special_key {
    uint8_t first;
    uint32_t len;
    int32_t id;
} special_key;

/* By first byte, then longest first, so the first hit is the longest. */
static int cmp_special(const void *pa, const void *pb) {
    const special_key *a = pa, *b = pb;
    if (a->first != b->first) return a->first < b->first ? -1 : 1;
    if (a->len != b->len) return a->len > b->len ? -1 : 1;
    return a->id < b->id ? -1 : a->id > b->id;
}

/* Decoded bytes of every token (see duet_tokenizer_token_bytes). */
static duet_status build_decoded(duet_tokenizer *t) {
    int n = t->n_vocab;
    /* Every decoded form is at most as long as its piece ("▁" 3 -> 1 byte,
     * byte-level chars 1-2 -> 1 byte, <0xNN> 6 -> 1). */
    size_t total = (size_t)t->off[n - 1] + t->len[n - 1] + 1;
    t->dec = malloc(total);
    t->dec_off = malloc(sizeof(uint32_t) * (size_t)n);
    t->dec_len = malloc(sizeof(uint32_t) * (size_t)n);
    if (!t->dec || !t->dec_off || !t->dec_len)
        return duet__error(DUET_OUT_OF_MEMORY, "tokenizer: out of memory");
    int16_t cp_to_byte[0x144];
    for (int i = 0; i < 0x144; i++)
        cp_to_byte[i] = -1;
    for (int b = 0; b < 256; b++)
        cp_to_byte[byte_to_cp((uint8_t)b)] = (int16_t)b;
    uint32_t pos = 0;
    for (int id = 0; id < n; id++) {
        const uint8_t *p = (const uint8_t *)t->text + t->off[id];
        size_t len = t->len[id];
        char *o = t->dec + pos;
        size_t k = 0;
        int ty = t->type[id];
        int byte = ty == DUET_TOKEN_BYTE && t->kind == KIND_SPM ? parse_byte_piece((const char *)p, len) : -1;
        if (byte >= 0) {
            o[k++] = (char)byte;
        } else if ((ty == DUET_TOKEN_NORMAL || ty == DUET_TOKEN_BYTE) && t->kind == KIND_SPM) {
            for (size_t i = 0; i < len;) {
                if (i + 3 <= len && p[i] == 0xE2 && p[i + 1] == 0x96 && p[i + 2] == 0x81) {
                    o[k++] = ' ';
                    i += 3;
                } else {
                    o[k++] = (char)p[i++];
                }
            }
        } else if (ty == DUET_TOKEN_NORMAL || ty == DUET_TOKEN_BYTE) {
            /* Byte-level BPE: each alphabet character is one byte; anything
             * outside the alphabet is kept as it is. */
            for (size_t i = 0; i < len;) {
                int l = utf8_char(p + i, len - i);
                if (l == 2) {
                    uint32_t cp = ((uint32_t)(p[i] & 0x1F) << 6) | (p[i + 1] & 0x3F);
                    if (cp < 0x144 && cp_to_byte[cp] >= 0) {
                        o[k++] = (char)cp_to_byte[cp];
                        i += 2;
                        continue;
                    }
                } else if (l == 1 && cp_to_byte[p[i]] >= 0) {
                    o[k++] = (char)cp_to_byte[p[i]];
                    i++;
                    continue;
                }
                size_t m = l > 0 ? (size_t)l : 1;
                memcpy(o + k, p + i, m);
                k += m;
                i += m;
            }
        } else {
            /* User-defined, control, unknown, unused: the text itself. */
            memcpy(o, p, len);
            k = len;
        }
        t->dec_off[id] = pos;
        t->dec_len[id] = (uint32_t)k;
        pos += (uint32_t)k;
    }
    return DUET_OK;
}

static bool eog_name(const char *s) {
    static const char *const names[] = {
        "<|eot_id|>",      "<|im_end|>", "<|endoftext|>", "<|end|>", "<end_of_turn>",
        "<|end_of_text|>", "<|eom_id|>", "<EOT>",         "<|EOT|>", "<｜end▁of▁sentence｜>",
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (strcmp(s, names[i]) == 0) return true;
    return false;
}

static duet_status load(const duet_gguf *g, duet_tokenizer *t) {
    char model[32];
    if (!duet_gguf_get_str(g, "tokenizer.ggml.model", model, sizeof model))
        return duet__error(DUET_BAD_MODEL, "tokenizer: tokenizer.ggml.model is missing or not a string");
    if (strcmp(model, "llama") == 0)
        t->kind = KIND_SPM;
    else if (strcmp(model, "gpt2") == 0)
        t->kind = KIND_BPE;
    else
        return duet__error(DUET_UNSUPPORTED, "tokenizer: unsupported tokenizer model '%s'", model);

    bool bad = false;
    const duet_gguf_value *tokens = get_array(g, "tokenizer.ggml.tokens", DUET_GGUF_STRING, &bad);
    if (!tokens)
        return duet__error(DUET_BAD_MODEL, "tokenizer: tokenizer.ggml.tokens is %s",
                           bad ? "not an array of strings" : "missing");
    if (tokens->arr.n == 0) return duet__error(DUET_BAD_MODEL, "tokenizer: the vocabulary is empty");
    if (tokens->arr.n > (1u << 26))
        return duet__error(DUET_BAD_MODEL, "tokenizer: %llu tokens is too many",
                           (unsigned long long)tokens->arr.n);
    int n = (int)tokens->arr.n;
    t->n_vocab = n;

    const duet_gguf_value *scores = get_array(g, "tokenizer.ggml.scores", DUET_GGUF_FLOAT32, &bad);
    if (bad) return duet__error(DUET_BAD_MODEL, "tokenizer: tokenizer.ggml.scores is not a float array");
    if (scores && scores->arr.n != (uint64_t)n)
        return duet__error(DUET_BAD_MODEL, "tokenizer: %llu scores for %d tokens",
                           (unsigned long long)scores->arr.n, n);
    const duet_gguf_value *types = get_array(g, "tokenizer.ggml.token_type", DUET_GGUF_INT32, &bad);
    if (bad)
        return duet__error(DUET_BAD_MODEL, "tokenizer: tokenizer.ggml.token_type is not an integer array");
    if (types && types->arr.n != (uint64_t)n)
        return duet__error(DUET_BAD_MODEL, "tokenizer: %llu token types for %d tokens",
                           (unsigned long long)types->arr.n, n);

    /* Pieces. */
    uint64_t total = 0;
    for (int i = 0; i < n; i++)
        total += tokens->arr.strs[i].len + 1;
    if (total > UINT32_MAX) return duet__error(DUET_BAD_MODEL, "tokenizer: the vocabulary text is too large");
    t->text = malloc(total);
    t->off = malloc(sizeof(uint32_t) * (size_t)n);
    t->len = malloc(sizeof(uint32_t) * (size_t)n);
    t->scores = malloc(sizeof(float) * (size_t)n);
    t->type = malloc((size_t)n);
    t->flags = calloc((size_t)n, 1);
    t->slot_mask = table_size((uint64_t)n) - 1;
    t->slots = malloc(sizeof(int32_t) * ((size_t)t->slot_mask + 1));
    if (!t->text || !t->off || !t->len || !t->scores || !t->type || !t->flags || !t->slots)
        return duet__error(DUET_OUT_OF_MEMORY, "tokenizer: out of memory");
    uint32_t pos = 0;
    for (int i = 0; i < n; i++) {
        const duet_gguf_str *s = &tokens->arr.strs[i];
        memcpy(t->text + pos, s->ptr, s->len);
        t->text[pos + s->len] = 0;
        t->off[i] = pos;
        t->len[i] = (uint32_t)s->len;
        pos += (uint32_t)s->len + 1;
    }

    for (int i = 0; i < n; i++) {
        float sc = 0.0f;
        if (scores) {
            if (scores->arr.type == DUET_GGUF_FLOAT32) {
                memcpy(&sc, (const uint8_t *)scores->arr.data + 4 * (size_t)i, 4);
            } else {
                double d;
                memcpy(&d, (const uint8_t *)scores->arr.data + 8 * (size_t)i, 8);
                sc = (float)d;
            }
        }
        /* A NaN would break the queue's ordering: rank it last instead. */
        t->scores[i] = isnan(sc) ? -FLT_MAX : sc;
        int64_t ty = types ? arr_int(types, (uint64_t)i) : DUET_TOKEN_NORMAL;
        if (ty == 0) ty = DUET_TOKEN_NORMAL; /* "undefined" in older converters */
        if (ty < DUET_TOKEN_NORMAL || ty > DUET_TOKEN_BYTE)
            return duet__error(DUET_BAD_MODEL, "tokenizer: token %d has invalid type %lld", i, (long long)ty);
        if (!types && t->kind == KIND_SPM && parse_byte_piece(t->text + t->off[i], t->len[i]) >= 0)
            ty = DUET_TOKEN_BYTE;
        t->type[i] = (uint8_t)ty;
    }

    /* Piece -> id. A duplicated piece keeps its lowest id; later copies are
     * reachable only by id. Empty pieces are never looked up. */
    memset(t->slots, 0xFF, sizeof(int32_t) * ((size_t)t->slot_mask + 1));
    for (int i = 0; i < n; i++) {
        if (t->len[i] == 0) continue;
        const char *s = t->text + t->off[i];
        if (lookup(t, s, t->len[i]) >= 0) continue;
        uint32_t h = (uint32_t)hash_bytes(s, t->len[i]) & t->slot_mask;
        while (t->slots[h] >= 0)
            h = (h + 1) & t->slot_mask;
        t->slots[h] = i;
    }

    /* Special ids and flags. */
    duet_status st;
    int32_t eot, eom;
    if ((st = get_token_id(g, "tokenizer.ggml.bos_token_id", n, &t->bos)) ||
        (st = get_token_id(g, "tokenizer.ggml.eos_token_id", n, &t->eos)) ||
        (st = get_token_id(g, "tokenizer.ggml.unknown_token_id", n, &t->unk)) ||
        (st = get_token_id(g, "tokenizer.ggml.eot_token_id", n, &eot)) ||
        (st = get_token_id(g, "tokenizer.ggml.eom_token_id", n, &eom)))
        return st;
    if (!types) {
        /* Without types the special ids are still not text. */
        if (t->bos >= 0) t->type[t->bos] = DUET_TOKEN_CONTROL;
        if (t->eos >= 0) t->type[t->eos] = DUET_TOKEN_CONTROL;
        if (t->unk >= 0) t->type[t->unk] = DUET_TOKEN_UNKNOWN;
    }
    bool bos_present, eos_present;
    if ((st = get_flag(g, "tokenizer.ggml.add_bos_token", t->kind == KIND_SPM, &t->add_bos, &bos_present)) ||
        (st = get_flag(g, "tokenizer.ggml.add_eos_token", false, &t->add_eos, &eos_present)) ||
        (st =
             get_flag(g, "tokenizer.ggml.add_space_prefix", t->kind == KIND_SPM, &t->add_space_prefix, NULL)))
        return st;
    if (t->add_bos && t->bos < 0) {
        if (bos_present)
            return duet__error(DUET_BAD_MODEL, "tokenizer: add_bos_token is set but there is no BOS id");
        t->add_bos = false; /* only the default asked for it */
    }
    if (t->add_eos && t->eos < 0)
        return duet__error(DUET_BAD_MODEL, "tokenizer: add_eos_token is set but there is no EOS id");

    int n_specials = 0;
    for (int i = 0; i < n; i++) {
        int ty = t->type[i];
        if (ty == DUET_TOKEN_NORMAL || ty == DUET_TOKEN_USER_DEFINED) t->flags[i] |= FLAG_MERGEABLE;
        if (t->len[i] > 0 && ty == DUET_TOKEN_USER_DEFINED) t->flags[i] |= FLAG_MATCH_ALWAYS;
        if (t->len[i] > 0 && (ty == DUET_TOKEN_CONTROL || ty == DUET_TOKEN_UNKNOWN))
            t->flags[i] |= FLAG_MATCH_SPECIAL;
        if (t->flags[i] & (FLAG_MATCH_ALWAYS | FLAG_MATCH_SPECIAL)) n_specials++;
        if ((ty == DUET_TOKEN_CONTROL || ty == DUET_TOKEN_USER_DEFINED) && eog_name(t->text + t->off[i]))
            t->flags[i] |= FLAG_EOG;
    }
    if (t->eos >= 0) t->flags[t->eos] |= FLAG_EOG;
    if (eot >= 0) t->flags[eot] |= FLAG_EOG;
    if (eom >= 0) t->flags[eom] |= FLAG_EOG;

    t->specials = malloc(sizeof(int32_t) * (size_t)(n_specials + 1));
    special_key *keys = malloc(sizeof(special_key) * (size_t)(n_specials + 1));
    if (!t->specials || !keys) {
        free(keys);
        return duet__error(DUET_OUT_OF_MEMORY, "tokenizer: out of memory");
    }
    for (int i = 0; i < n; i++) {
        if (!(t->flags[i] & (FLAG_MATCH_ALWAYS | FLAG_MATCH_SPECIAL))) continue;
        if (t->flags[i] & FLAG_MATCH_ALWAYS) t->n_always++;
        keys[t->n_specials++] = (special_key){(uint8_t)t->text[t->off[i]], t->len[i], i};
    }
    qsort(keys, (size_t)t->n_specials, sizeof *keys, cmp_special);
    for (int i = 0; i < t->n_specials; i++)
        t->specials[i] = keys[i].id;
    free(keys);
    int k = 0;
    for (int b = 0; b <= 256; b++) {
        while (k < t->n_specials && (uint8_t)t->text[t->off[t->specials[k]]] < b)
            k++;
        t->special_start[b] = k;
    }

    /* Byte tokens. */
    for (int b = 0; b < 256; b++) {
        char buf[8];
        size_t l;
        if (t->kind == KIND_SPM) {
            static const char hex[] = "0123456789ABCDEF";
            memcpy(buf, "<0x", 3);
            buf[3] = hex[b >> 4], buf[4] = hex[b & 15], buf[5] = '>';
            l = 6;
        } else {
            l = utf8_put(byte_to_cp((uint8_t)b), buf);
        }
        t->byte_tok[b] = lookup(t, buf, l);
    }
    if (t->kind == KIND_SPM) {
        /* Byte tokens spelled in lower case hex still count. */
        for (int i = 0; i < n; i++) {
            int b = t->type[i] == DUET_TOKEN_BYTE ? parse_byte_piece(t->text + t->off[i], t->len[i]) : -1;
            if (b >= 0 && t->byte_tok[b] < 0) t->byte_tok[b] = i;
        }
    }

    if (t->kind == KIND_BPE) {
        const duet_gguf_value *merges = get_array(g, "tokenizer.ggml.merges", DUET_GGUF_STRING, &bad);
        if (!merges)
            return duet__error(DUET_BAD_MODEL, "tokenizer: tokenizer.ggml.merges is %s",
                               bad ? "not an array of strings" : "missing");
        if (merges->arr.n > (1u << 26))
            return duet__error(DUET_BAD_MODEL, "tokenizer: %llu merges is too many",
                               (unsigned long long)merges->arr.n);
        t->merge_mask = table_size(merges->arr.n) - 1;
        t->merges = malloc(sizeof(merge_slot) * ((size_t)t->merge_mask + 1));
        if (!t->merges) return duet__error(DUET_OUT_OF_MEMORY, "tokenizer: out of memory");
        for (uint32_t i = 0; i <= t->merge_mask; i++)
            t->merges[i].key = UINT64_MAX;
        char *cat = NULL;
        size_t cat_cap = 0;
        for (uint64_t r = 0; r < merges->arr.n; r++) {
            const duet_gguf_str *s = &merges->arr.strs[r];
            /* "left right": split at the first space after the first byte. */
            const char *sp = s->len > 1 ? memchr(s->ptr + 1, ' ', s->len - 1) : NULL;
            if (!sp) {
                free(cat);
                return duet__error(DUET_BAD_MODEL, "tokenizer: merge %llu has no space separating two pieces",
                                   (unsigned long long)r);
            }
            size_t ll = (size_t)(sp - s->ptr), rl = s->len - ll - 1;
            if (ll + rl > cat_cap) {
                cat_cap = (ll + rl) * 2;
                char *c2 = realloc(cat, cat_cap);
                if (!c2) {
                    free(cat);
                    return duet__error(DUET_OUT_OF_MEMORY, "tokenizer: out of memory");
                }
                cat = c2;
            }
            memcpy(cat, s->ptr, ll);
            memcpy(cat + ll, sp + 1, rl);
            int32_t a = lookup(t, s->ptr, ll), b = lookup(t, sp + 1, rl), c = lookup(t, cat, ll + rl);
            /* A merge naming a piece the vocabulary lacks can never apply:
             * it is skipped. A repeated pair keeps its first (best) rank. */
            if (a < 0 || b < 0 || c < 0) continue;
            uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
            uint32_t h = (uint32_t)hash_u64(key) & t->merge_mask;
            while (t->merges[h].key != UINT64_MAX && t->merges[h].key != key)
                h = (h + 1) & t->merge_mask;
            if (t->merges[h].key == key) continue;
            t->merges[h] = (merge_slot){key, (int32_t)r, c};
        }
        free(cat);
        char pre[64];
        if (!duet_gguf_get_str(g, "tokenizer.ggml.pre", pre, sizeof pre)) strcpy(pre, "default");
        if ((st = compile_pre(t, pre))) return st;
    }
    return build_decoded(t);
}

duet_status duet_tokenizer_load(const duet_gguf *g, duet_tokenizer **out) {
    if (!g || !out) return duet__error(DUET_INVALID_ARGUMENT, "tokenizer_load: NULL argument");
    *out = NULL;
    duet_tokenizer *t = calloc(1, sizeof *t);
    if (!t) return duet__error(DUET_OUT_OF_MEMORY, "tokenizer: out of memory");
    duet_status st = load(g, t);
    if (st) {
        duet_tokenizer_free(t);
        return st;
    }
    *out = t;
    return DUET_OK;
}

/* ---- accessors ----------------------------------------------------------- */

int duet_tokenizer_n_vocab(const duet_tokenizer *t) {
    return t->n_vocab;
}
int32_t duet_tokenizer_bos(const duet_tokenizer *t) {
    return t->bos;
}
int32_t duet_tokenizer_eos(const duet_tokenizer *t) {
    return t->eos;
}
bool duet_tokenizer_add_bos(const duet_tokenizer *t) {
    return t->add_bos;
}
bool duet_tokenizer_add_eos(const duet_tokenizer *t) {
    return t->add_eos;
}
const char *duet_tokenizer_model(const duet_tokenizer *t) {
    return t->kind == KIND_SPM ? "llama" : "gpt2";
}

static bool valid_id(const duet_tokenizer *t, int32_t id) {
    return id >= 0 && id < t->n_vocab;
}

duet_token_type duet_tokenizer_token_type(const duet_tokenizer *t, int32_t id) {
    return valid_id(t, id) ? (duet_token_type)t->type[id] : DUET_TOKEN_UNKNOWN;
}

bool duet_tokenizer_is_eog(const duet_tokenizer *t, int32_t id) {
    return valid_id(t, id) && (t->flags[id] & FLAG_EOG);
}

const char *duet_tokenizer_piece(const duet_tokenizer *t, int32_t id) {
    return valid_id(t, id) ? t->text + t->off[id] : NULL;
}

/* ---- encoding ------------------------------------------------------------ */

typedef struct out_ids {
    int32_t *ids;
    int max;
    int n;
} out_ids;

static void emit(out_ids *o, int32_t id) {
    if (o->n < o->max) o->ids[o->n] = id;
    o->n++;
}

typedef struct sym {
    uint32_t start, len; /* SPM: bytes of the normalized text; BPE: bytes of the word */
    int32_t prev, next;
    int32_t id; /* -1: not in the vocabulary (SPM byte fallback) */
} sym;

typedef struct pair {
    double score; /* SPM: token score (higher first); BPE: -rank (exact in a double) */
    int32_t left, right;
    int32_t id;       /* the merged token */
    uint32_t size;    /* SPM: merged byte length, to detect stale entries */
    int32_t lid, rid; /* BPE: the ids merged, to detect stale entries */
} pair;

/* Max-heap: higher score first, then the leftmost pair. */
typedef struct heap {
    pair *a;
    size_t n, cap;
} heap;

static bool pair_before(const pair *x, const pair *y) {
    return x->score > y->score || (x->score == y->score && x->left < y->left);
}

static bool heap_push(heap *h, pair p) {
    if (h->n == h->cap) {
        size_t cap = h->cap ? h->cap * 2 : 64;
        pair *a = realloc(h->a, cap * sizeof *a);
        if (!a) return false;
        h->a = a, h->cap = cap;
    }
    size_t i = h->n++;
    while (i > 0) {
        size_t up = (i - 1) / 2;
        if (!pair_before(&p, &h->a[up])) break;
        h->a[i] = h->a[up];
        i = up;
    }
    h->a[i] = p;
    return true;
}

static pair heap_pop(heap *h) {
    pair top = h->a[0], last = h->a[--h->n];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= h->n) break;
        if (c + 1 < h->n && pair_before(&h->a[c + 1], &h->a[c])) c++;
        if (!pair_before(&h->a[c], &last)) break;
        h->a[i] = h->a[c];
        i = c;
    }
    if (h->n) h->a[i] = last;
    return top;
}

/* Scratch reused across the fragments and words of one encode call. */
typedef struct scratch {
    sym *syms;
    size_t cap;
    heap h;
    char *norm;
    size_t norm_cap;
    pcre2_match_data *md;
    pcre2_match_context *mctx;
    pcre2_jit_stack *jit_stack;
} scratch;

static bool reserve_syms(scratch *s, size_t n) {
    if (n <= s->cap) return true;
    size_t cap = s->cap ? s->cap : 64;
    while (cap < n)
        cap *= 2;
    sym *p = realloc(s->syms, cap * sizeof *p);
    if (!p) return false;
    s->syms = p, s->cap = cap;
    return true;
}

static bool spm_try_pair(const duet_tokenizer *t, scratch *s, const char *norm, int32_t l, int32_t r) {
    if (l < 0 || r < 0) return true;
    const sym *a = &s->syms[l], *b = &s->syms[r];
    if (a->id < 0 || b->id < 0) return true;
    uint32_t size = a->len + b->len;
    int32_t id = lookup(t, norm + a->start, size);
    if (id < 0 || !(t->flags[id] & FLAG_MERGEABLE)) return true;
    return heap_push(&s->h, (pair){t->scores[id], l, r, id, size, 0, 0});
}

/* SentencePiece BPE of one raw-text fragment: optional dummy-prefix space,
 * spaces as U+2581, one symbol per character (byte fallback for characters
 * outside the vocabulary), then best-score-first merging. */
static duet_status spm_fragment(const duet_tokenizer *t, scratch *s, const char *text, size_t n, bool prefix,
                                out_ids *o) {
    size_t need = 3 * n + 3;
    if (need > s->norm_cap) {
        char *p = realloc(s->norm, need);
        if (!p) return duet__error(DUET_OUT_OF_MEMORY, "tokenizer: out of memory");
        s->norm = p, s->norm_cap = need;
    }
    char *norm = s->norm;
    size_t m = 0;
    if (prefix) memcpy(norm, "\xe2\x96\x81", 3), m = 3;
    for (size_t i = 0; i < n; i++) {
        if (text[i] == ' ')
            memcpy(norm + m, "\xe2\x96\x81", 3), m += 3;
        else
            norm[m++] = text[i];
    }
    if (!reserve_syms(s, m)) return duet__error(DUET_OUT_OF_MEMORY, "tokenizer: out of memory");
    int32_t ns = 0;
    for (size_t i = 0; i < m;) {
        size_t l = char_len((const uint8_t *)norm + i, m - i);
        int32_t id = lookup(t, norm + i, l);
        if (id >= 0 && !(t->flags[id] & FLAG_MERGEABLE)) id = -1;
        s->syms[ns] = (sym){(uint32_t)i, (uint32_t)l, ns - 1, ns + 1, id};
        ns++;
        i += l;
    }
    if (ns == 0) return DUET_OK;
    s->syms[ns - 1].next = -1;

    s->h.n = 0;
    for (int32_t i = 0; i + 1 < ns; i++)
        if (!spm_try_pair(t, s, norm, i, i + 1))
            return duet__error(DUET_OUT_OF_MEMORY, "tokenizer: out of memory");
    while (s->h.n) {
        pair p = heap_pop(&s->h);
        sym *a = &s->syms[p.left], *b = &s->syms[p.right];
        /* Stale when either side has changed since the pair was queued. */
        if (a->len == 0 || b->len == 0 || a->next != p.right || a->len + b->len != p.size) continue;
        a->len += b->len;
        a->id = p.id;
        b->len = 0;
        a->next = b->next;
        if (b->next >= 0) s->syms[b->next].prev = p.left;
        if (!spm_try_pair(t, s, norm, a->prev, p.left) || !spm_try_pair(t, s, norm, p.left, a->next))
            return duet__error(DUET_OUT_OF_MEMORY, "tokenizer: out of memory");
    }
    for (int32_t i = 0; i >= 0; i = s->syms[i].next) {
        const sym *y = &s->syms[i];
        if (y->id >= 0) {
            emit(o, y->id);
            continue;
        }
        /* Byte fallback; a character whose bytes lack tokens is one <unk>
         * (dropped when there is no <unk> either). */
        bool bytes = true;
        for (uint32_t k = 0; k < y->len; k++)
            bytes = bytes && t->byte_tok[(uint8_t)norm[y->start + k]] >= 0;
        if (!bytes) {
            if (t->unk >= 0) emit(o, t->unk);
            continue;
        }
        for (uint32_t k = 0; k < y->len; k++)
            emit(o, t->byte_tok[(uint8_t)norm[y->start + k]]);
    }
    return DUET_OK;
}

static bool bpe_try_pair(const duet_tokenizer *t, scratch *s, int32_t l, int32_t r) {
    if (l < 0 || r < 0) return true;
    int32_t a = s->syms[l].id, b = s->syms[r].id;
    if (a < 0 || b < 0) return true;
    const merge_slot *m = merge_find(t, a, b);
    if (!m) return true;
    return heap_push(&s->h, (pair){-(double)m->rank, l, r, m->result, 0, a, b});
}

/* Byte-level BPE of one pre-token: one symbol per byte, then merges by rank. */
static duet_status bpe_word(const duet_tokenizer *t, scratch *s, const char *w, size_t n, out_ids *o) {
    if (n == 1) {
        int32_t id = t->byte_tok[(uint8_t)w[0]];
        if (id < 0) id = t->unk;
        if (id >= 0) emit(o, id);
        return DUET_OK;
    }
    if (!reserve_syms(s, n)) return duet__error(DUET_OUT_OF_MEMORY, "tokenizer: out of memory");
    int32_t ns = (int32_t)n;
    for (int32_t i = 0; i < ns; i++)
        s->syms[i] = (sym){(uint32_t)i, 1, i - 1, i + 1 < ns ? i + 1 : -1, t->byte_tok[(uint8_t)w[i]]};
    s->h.n = 0;
    for (int32_t i = 0; i + 1 < ns; i++)
        if (!bpe_try_pair(t, s, i, i + 1)) return duet__error(DUET_OUT_OF_MEMORY, "tokenizer: out of memory");
    while (s->h.n) {
        pair p = heap_pop(&s->h);
        sym *a = &s->syms[p.left], *b = &s->syms[p.right];
        /* A symbol's id only changes by growing, so matching ids mean the
         * pair is still the one queued. */
        if (a->len == 0 || b->len == 0 || a->next != p.right || a->id != p.lid || b->id != p.rid) continue;
        a->len += b->len;
        a->id = p.id;
        b->len = 0;
        a->next = b->next;
        if (b->next >= 0) s->syms[b->next].prev = p.left;
        if (!bpe_try_pair(t, s, a->prev, p.left) || !bpe_try_pair(t, s, p.left, a->next))
            return duet__error(DUET_OUT_OF_MEMORY, "tokenizer: out of memory");
    }
    for (int32_t i = 0; i >= 0; i = s->syms[i].next) {
        int32_t id = s->syms[i].id >= 0 ? s->syms[i].id : t->unk;
        if (id >= 0) emit(o, id); /* a byte the vocabulary lacks, and no <unk>: dropped */
    }
    return DUET_OK;
}

/* Splits [text, text+n) with pre-tokenizer regex `stage` and hands every
 * piece (matches and the gaps between them) to the next stage. */
static duet_status bpe_split(const duet_tokenizer *t, scratch *s, const char *text, size_t n, int stage,
                             out_ids *o) {
    if (n == 0) return DUET_OK;
    if (stage == t->n_re) return bpe_word(t, s, text, n, o);
    size_t pos = 0, last = 0;
    duet_status st;
    while (pos < n) {
        int rc = pcre2_match(t->re[stage], (PCRE2_SPTR)text, n, pos, 0, s->md, s->mctx);
        /* No match, or a resource limit: the rest is one gap piece. */
        if (rc < 0) break;
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(s->md);
        size_t ms = ov[0], me = ov[1];
        if (ms < pos || me < ms || me > n) break; /* cannot happen; \K-free patterns */
        if (me == ms) {
            pos = ms + char_len((const uint8_t *)text + ms, n - ms);
            continue;
        }
        if (ms > last && (st = bpe_split(t, s, text + last, ms - last, stage + 1, o))) return st;
        if ((st = bpe_split(t, s, text + ms, me - ms, stage + 1, o))) return st;
        last = pos = me;
    }
    return bpe_split(t, s, text + last, n - last, stage + 1, o);
}

static int32_t match_special(const duet_tokenizer *t, const char *s, size_t n, bool parse_special,
                             size_t *len) {
    uint8_t b = (uint8_t)s[0];
    for (int32_t k = t->special_start[b]; k < t->special_start[b + 1]; k++) {
        int32_t id = t->specials[k];
        if (!parse_special && !(t->flags[id] & FLAG_MATCH_ALWAYS)) continue;
        if (t->len[id] <= n && memcmp(t->text + t->off[id], s, t->len[id]) == 0) {
            *len = t->len[id];
            return id;
        }
    }
    return -1;
}

static duet_status encode_fragment(const duet_tokenizer *t, scratch *s, const char *text, size_t n,
                                   out_ids *o) {
    if (t->kind == KIND_SPM) return spm_fragment(t, s, text, n, t->add_space_prefix, o);
    return bpe_split(t, s, text, n, 0, o);
}

int duet_tokenizer_encode(const duet_tokenizer *t, const char *text, size_t len, bool add_special,
                          bool parse_special, int32_t *ids, int max) {
    if (!t || (!text && len) || max < 0 || (!ids && max > 0))
        return duet__error(DUET_INVALID_ARGUMENT, "tokenizer_encode: bad argument");
    if (len > MAX_ENCODE_BYTES)
        return duet__error(DUET_INVALID_ARGUMENT, "tokenizer_encode: %zu bytes is more than the %zu allowed",
                           len, MAX_ENCODE_BYTES);
    out_ids o = {ids, max, 0};
    scratch s = {0};
    duet_status st = DUET_OK;
    if (t->kind == KIND_BPE) {
        s.md = pcre2_match_data_create(1, NULL);
        s.mctx = pcre2_match_context_create(NULL);
        if (!s.md || !s.mctx) {
            st = duet__error(DUET_OUT_OF_MEMORY, "tokenizer: out of memory");
            goto done;
        }
        if (t->jit) {
            /* Long runs of whitespace backtrack deeper than the default
             * 32 KiB JIT stack allows. */
            s.jit_stack = pcre2_jit_stack_create(32 * 1024, 4 * 1024 * 1024, NULL);
            if (s.jit_stack) pcre2_jit_stack_assign(s.mctx, NULL, s.jit_stack);
        }
    }
    if (add_special && t->add_bos) emit(&o, t->bos);
    /* Raw text between special-token matches is tokenized as fragments;
     * like llama.cpp, each SPM fragment gets the dummy prefix. */
    size_t frag = 0, i = 0;
    while (i < len) {
        size_t ml = 0;
        bool any = parse_special ? t->n_specials > 0 : t->n_always > 0;
        int32_t id = any ? match_special(t, text + i, len - i, parse_special, &ml) : -1;
        if (id < 0) {
            i++;
            continue;
        }
        if (i > frag && (st = encode_fragment(t, &s, text + frag, i - frag, &o))) goto done;
        emit(&o, id);
        i += ml;
        frag = i;
    }
    if (len > frag && (st = encode_fragment(t, &s, text + frag, len - frag, &o))) goto done;
    if (add_special && t->add_eos) emit(&o, t->eos);
done:
    free(s.syms);
    free(s.h.a);
    free(s.norm);
    if (s.md) pcre2_match_data_free(s.md);
    if (s.mctx) pcre2_match_context_free(s.mctx);
    if (s.jit_stack) pcre2_jit_stack_free(s.jit_stack);
    return st ? (int)st : o.n;
}

/* ---- decoding ------------------------------------------------------------ */

static bool renders_empty(const duet_tokenizer *t, int32_t id) {
    int ty = t->type[id];
    return ty == DUET_TOKEN_CONTROL || ty == DUET_TOKEN_UNKNOWN || ty == DUET_TOKEN_UNUSED;
}

int duet_tokenizer_token_bytes(const duet_tokenizer *t, int32_t id, bool render_special, char *buf,
                               size_t size) {
    if (!t || !valid_id(t, id))
        return duet__error(DUET_INVALID_ARGUMENT, "token_bytes: bad token id %d", (int)id);
    size_t n = (!render_special && renders_empty(t, id)) ? 0 : t->dec_len[id];
    if (buf && size) {
        memcpy(buf, t->dec + t->dec_off[id], n < size ? n : size);
        if (n < size) buf[n] = 0;
    }
    return (int)n;
}

void duet_detok_init(duet_detok *d, const duet_tokenizer *t, bool strip_leading_space) {
    memset(d, 0, sizeof *d);
    d->tok = t;
    d->strip_leading_space = strip_leading_space;
    d->at_start = true;
}

/* Appends bytes to out, keeping room for the NUL; counts them all. */
typedef struct sink {
    char *out;
    size_t size, n;
} sink;

static void sink_put(sink *k, const char *p, size_t n) {
    if (k->n < k->size && k->size - 1 - k->n >= n)
        memcpy(k->out + k->n, p, n);
    else if (k->n < k->size)
        k->size = k->n + 1; /* truncate at a character boundary */
    k->n += n;
}

static int sink_end(sink *k) {
    if (k->size) k->out[k->n < k->size ? k->n : k->size - 1] = 0;
    return (int)k->n;
}

static const char REPLACEMENT[] = "\xef\xbf\xbd";

int duet_detok_push(duet_detok *d, int32_t id, char *out, size_t size) {
    sink k = {out, out ? size : 0, 0};
    const duet_tokenizer *t = d->tok;
    if (!valid_id(t, id)) {
        sink_end(&k);
        return duet__error(DUET_INVALID_ARGUMENT, "detok_push: bad token id %d", (int)id);
    }
    if (id == t->bos) {
        d->at_start = true;
        return sink_end(&k);
    }
    const char *p = t->dec + t->dec_off[id];
    size_t n = renders_empty(t, id) ? 0 : t->dec_len[id];
    if (d->at_start && d->strip_leading_space && t->kind == KIND_SPM && t->type[id] == DUET_TOKEN_NORMAL &&
        n > 0 && p[0] == ' ')
        p++, n--;
    d->at_start = false;

    /* Pending bytes are a valid incomplete prefix (at most 3 bytes); join
     * them with the new bytes and emit every complete character. */
    uint8_t buf[16];
    size_t i = 0;
    while (d->n_pending > 0 || i < n) {
        size_t have = (size_t)d->n_pending;
        memcpy(buf, d->pending, have);
        size_t take = n - i < 4 ? n - i : 4;
        memcpy(buf + have, p + i, take);
        int l = utf8_char(buf, have + take);
        if (l == 0) {
            /* Still incomplete: everything left fits in pending. */
            memcpy(d->pending + have, p + i, take);
            d->n_pending = (int)(have + take);
            return sink_end(&k);
        }
        size_t used = l > 0 ? (size_t)l : (size_t)-l;
        if (l > 0)
            sink_put(&k, (const char *)buf, used);
        else
            sink_put(&k, REPLACEMENT, 3);
        /* Consume `used` bytes: first from pending, then from p. */
        if (used >= have) {
            i += used - have;
            d->n_pending = 0;
        } else {
            memmove(d->pending, d->pending + used, have - used);
            d->n_pending = (int)(have - used);
        }
    }
    return sink_end(&k);
}

int duet_detok_flush(duet_detok *d, char *out, size_t size) {
    sink k = {out, out ? size : 0, 0};
    /* What is pending is one incomplete character: one U+FFFD. */
    if (d->n_pending > 0) sink_put(&k, REPLACEMENT, 3);
    d->n_pending = 0;
    return sink_end(&k);
}
