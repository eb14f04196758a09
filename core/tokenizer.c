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

/* Code point classes (unicode_cats.h): the first letter of the general
 * category, or undefined for unassigned code points. */
enum { UCAT_UNDEF, UCAT_N, UCAT_L, UCAT_Z, UCAT_M, UCAT_P, UCAT_S, UCAT_C };
#include "unicode_cats.h"

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

enum { STAGE_CLASS_TEXT, STAGE_UTF8, STAGE_KIMI_K2, STAGE_DIGITS3 };

typedef struct pre_stage {
    int kind;       /* STAGE_* */
    pcre2_code *re; /* the regexes' stages */
} pre_stage;

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
    pre_stage stages[MAX_REGEX]; /* BPE pre-tokenizer, in order */
    int n_stages;
    unsigned pre_flags;  /* PRE_* */
    bool need_utf8_text; /* a stage matches UTF-8 text, not class text */
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
    if (cp < 0x10000) {
        out[0] = (char)(0xE0 | (cp >> 12));
        out[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (char)(0xF0 | (cp >> 18));
    out[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    out[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    out[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
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

/* ---- pre-tokenizers ------------------------------------------------------
 *
 * A byte-level BPE vocabulary names its pre-tokenizer in tokenizer.ggml.pre.
 * The names and the regexes are llama.cpp's (commit 0c1e570, the one inside
 * llama-cpp-python 0.3.36), and so is the way they split text, because its
 * test vectors are the reference:
 *
 * - Several regexes run in sequence, each splitting the pieces of the one
 *   before; matches and the text between them both become pieces (Hugging
 *   Face's Split with "isolated" behaviour). An empty match splits the text
 *   at its position.
 * - \p{L}, \p{N}, \p{P}, \p{M}, \p{S} (and \p{Lu} ... \p{Lo}, which mean
 *   \p{L}) use llama.cpp's own code point classes (Unicode 15.1, see
 *   unicode_cats.h), not the regex library's: a regex that uses them runs on
 *   "class text", one byte per code point: ASCII stays itself, other code
 *   points become one byte per class (0x0B for the White_Space ones), and
 *   the regex's \p{X} becomes a class of that byte plus X's ASCII members.
 *   A regex without \p{..} runs on the UTF-8 text with non-ASCII white space
 *   as 0x0B; \s, \d and \w are ASCII there, as in std::regex.
 * - Two splitters are code, not regexes: Kimi-K2's (Han runs apart from
 *   other letters) and the digit grouping of AFMoE and Tiny Aya (a digit run
 *   is cut into groups of three from the right; the text before a run stays
 *   joined to its first group, as llama.cpp does).
 * - Some names take a whole pre-token that is itself in the vocabulary as
 *   one token without merging ("ignore_merges", Llama 3's tokenizer.json
 *   says so): " Việt" is one token of Llama 3, though its merges would give
 *   three.
 * - A byte of invalid UTF-8 splits like U+FFFD but keeps its own byte, so
 *   byte-level BPE stays lossless (llama.cpp puts U+FFFD's three bytes in
 *   its place: the one place duet differs on purpose).
 * - Gemma 4 and Sarvam have SentencePiece-style BPE vocabularies: spaces
 *   become U+2581, pieces are merged as UTF-8 characters, not GPT-2's byte
 *   alphabet, and missing characters fall back to <0xNN> byte tokens.
 */

#define SPLIT_KIMI_K2 "@kimi-k2"  /* a splitter in code (split_kimi) */
#define SPLIT_DIGITS3 "@digits-3" /* a splitter in code (split_digits3) */

#define RE_CONTRACTIONS "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
#define RE_GPT2 "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"
#define RE_LLAMA3                                                                                            \
    RE_CONTRACTIONS                                                                                          \
        "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|"           \
        "\\s+(?!\\S)|\\s+"
#define RE_QWEN2                                                                                             \
    RE_CONTRACTIONS "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|"    \
                    "\\s+(?!\\S)|\\s+"
#define RE_BLOOM " ?[^(\\s|.,!?…。，、।۔،)]+"
#define RE_CJK_DEEPSEEK "[一-龥ࠀ-一가-퟿]+"
#define RE_DEEPSEEK3                                                                                         \
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| "      \
    "?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"
/* GPT-4o's regex with its upper/lower-case classes spelled as llama.cpp
 * spells them (lookaheads over ASCII case), given the letter class L. */
#define RE_GPT4O_LIKE(L)                                                                                     \
    "[^\\r\\n\\p{L}\\p{N}]?((?=[" L "])([^a-z]))*((?=[" L "])([^A-Z]))+" RE_CONTRACTIONS                     \
    "?|[^\\r\\n\\p{L}\\p{N}]?((?=[" L "])([^a-z]))+((?=[" L "])([^A-Z]))*" RE_CONTRACTIONS                   \
    "?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
#define RE_UPPER_LOWER "[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]"
#define RE_LOWER_ANY "[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]"

enum {
    PRE_IGNORE_MERGES = 1, /* a pre-token that is a token is taken whole */
    PRE_ADD_BOS = 2,       /* add_bos defaults to true */
    PRE_RAW_UTF8 = 4,      /* merges over UTF-8 characters, <0xNN> byte fallback */
    PRE_ESCAPE_SPACES = 8, /* spaces become U+2581 first */
    PRE_NEWLINE_RUNS = 16, /* a run of newlines that is a token is taken whole (Gemma 4) */
    PRE_FORCE_BOS = 32,    /* add_bos whatever the metadata says (Gemma 4) */
};

typedef struct pre_type {
    const char *names[10]; /* tokenizer.ggml.pre values */
    const char *patterns[MAX_REGEX];
} pre_type;

/* The regexes by pre-tokenizer type, each type with the names that select it
 * (a name's flags are in PRE_FLAGS). */
static const pre_type PRE_TYPES[] = {
    {{"default"}, {"[\\p{P}\\$\\+<=>\\^~\\|]+", RE_GPT2, "\\p{N}+", "[0-9][0-9][0-9]"}},
    {{"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
      "jina-v5-nano"},
     {RE_LLAMA3}},
    {{"dbrx", "smaug-bpe", "chatglm-bpe", "glm4", "glm5"}, {RE_LLAMA3}},
    {{"jais-2"},
     {RE_CONTRACTIONS
      "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|"
      "\\s{512}(?!\\S)|\\s{256}(?!\\S)|\\s{128}(?!\\S)|\\s{64}(?!\\S)|\\s{32}(?!\\S)|"
      "\\s{16}(?!\\S)|\\s{8}(?!\\S)|\\s{4}(?!\\S)|\\s{1,2}(?!\\S)|\\s{1}"}},
    {{"deepseek-llm"},
     {"[\r\n]",
      "\\s?[A-Za-z\\x{B5}\\x{C0}-\\x{D6}\\x{D8}-\\x{F6}\\x{F8}-\\x{1BA}\\x{1BC}-\\x{1BF}\\x{1C4}-"
      "\\x{293}\\x{295}-\\x{2AF}\\x{370}-\\x{373}\\x{376}\\x{377}\\x{37B}-\\x{37D}\\x{37F}\\x{386}"
      "\\x{388}-\\x{38A}\\x{38C}\\x{38E}-\\x{3A1}\\x{3A3}-\\x{3F5}\\x{3F7}-\\x{481}\\x{48A}-"
      "\\x{52F}\\x{531}-\\x{556}\\x{10A0}-\\x{10C5}\\x{13A0}-\\x{13F5}\\x{13F8}-\\x{13FD}\\x{1C90}-"
      "\\x{1CBA}\\x{1CBD}-\\x{1CBF}\\x{1D00}-\\x{1D2B}\\x{1D6B}-\\x{1D77}\\x{1D79}-\\x{1D9A}"
      "\\x{1E00}-\\x{1F15}\\x{1F18}-\\x{1F1D}\\x{1F20}-\\x{1F45}\\x{1F48}-\\x{1F4D}\\x{1F50}-"
      "\\x{1F57}\\x{1F59}\\x{1F5B}\\x{1F5D}\\x{1F5F}-\\x{1F7D}\\x{1F80}-\\x{1FB4}\\x{1FB6}-"
      "\\x{1FBC}\\x{1FBE}\\x{1FC2}-\\x{1FC4}\\x{1FC6}-\\x{1FCC}\\x{1FD0}-\\x{1FD3}\\x{1FD6}-"
      "\\x{1FDB}\\x{1FE0}-\\x{1FEC}\\x{1FF2}-\\x{1FF4}\\x{1FF6}-\\x{1FFC}\\x{2102}\\x{2107}"
      "\\x{210A}-\\x{2113}\\x{2115}\\x{2119}-\\x{211D}\\x{2124}\\x{2126}\\x{2128}\\x{212A}-"
      "\\x{212D}\\x{212F}-\\x{2134}\\x{2139}\\x{213C}-\\x{213F}\\x{2145}-\\x{2149}\\x{214E}"
      "\\x{2183}\\x{2184}\\x{2C00}-\\x{2C7B}\\x{2C7E}-\\x{2CE4}\\x{2CEB}-\\x{2CEE}\\x{2CF2}"
      "\\x{2CF3}\\x{A640}-\\x{A66D}\\x{A680}-\\x{A69B}\\x{A722}-\\x{A76F}\\x{A771}-\\x{A787}"
      "\\x{A78B}-\\x{A78E}\\x{AB70}-\\x{ABBF}\\x{FB00}-\\x{FB06}\\x{FB13}-\\x{FB17}\\x{FF21}-"
      "\\x{FF3A}\\x{FF41}-\\x{FF5A}\\x{10400}-\\x{1044F}\\x{104B0}-\\x{104D3}\\x{104D8}-\\x{104FB}"
      "\\x{10C80}-\\x{10CB2}\\x{10CC0}-\\x{10CF2}\\x{118A0}-\\x{118DF}\\x{1E900}-\\x{1E943}]+",
      "\\s?[!-/:-~！-／：-～‘-‟　-。]+", "\\s+$", RE_CJK_DEEPSEEK, "\\p{N}+"}},
    {{"deepseek-coder"}, {"[\r\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", RE_CJK_DEEPSEEK, "\\p{N}"}},
    {{"deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"},
     {"\\p{N}{1,3}", "[一-龥぀-ゟ゠-ヿ]+", RE_DEEPSEEK3}},
    {{"spark2_5"},
     {"\\p{N}{1,3}", "[一-龥぀-ゟ゠-ヿ]+",
      "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| "
      "?[\\p{P}\\p{S}]+|[\r\n]|\\s+(?!\\S)|\\s+",
      "\\p{N}"}},
    {{"youtu"},
     {"[가-힣ㄱ-ㆎ]+|[！…“”‘’—：；，、-〿︰-﹏]+|[ㄅ-ㄯ]+|[一-龥぀-ゟ゠-ヿ]+",
      "[^\\r\\n\\p{L}\\p{N}]?" RE_UPPER_LOWER "*" RE_LOWER_ANY "+" RE_CONTRACTIONS
      "?|[^\\r\\n\\p{L}\\p{N}]?" RE_UPPER_LOWER "+" RE_LOWER_ANY "*" RE_CONTRACTIONS
      "?|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"}},
    {{"falcon"}, {"[\\p{P}\\$\\+<=>\\^~\\|`]+", RE_GPT2, "[0-9][0-9][0-9]"}},
    /* StarCoder's family: every digit its own piece, then GPT-2's split. */
    {{"starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"},
     {"\\p{N}", RE_GPT2}},
    {{"gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum",
      "modern-bert"},
     {RE_GPT2}},
    {{"jina-v1-en", "jina-v2-code", "roberta-bpe", "exaone4", "mpt", "olmo", "jais", "trillion",
      "granite-docling"},
     {RE_GPT2}},
    {{"qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "stablelm2", "hunyuan", "solar-open", "megrez"},
     {RE_QWEN2}},
    {{"grok-2"}, {RE_QWEN2}},
    {{"qwen35"},
     {RE_CONTRACTIONS "|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*|"
                      "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"}},
    {{"poro-chat", "bloom", "gpt3-finnish"}, {RE_BLOOM}},
    {{"viking"}, {RE_BLOOM, "\\p{N}"}},
    {{"tekken"},
     {"[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}"
      "])([^"
      "a-z]))+((?=[\\p{L}])([^A-Z]))*|\\p{N}| "
      "?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"}},
    {{"chameleon"},
     {"<sentinel:[0-9]+>", "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", "([\\t\\n]|    |  )", "\\p{N}",
      "[\\p{P}!-/:-@\\[-`{-~]", RE_GPT2}},
    {{"gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"}, {RE_GPT4O_LIKE("\\p{L}")}},
    /* GPT-4o's with \p{M} joining letters (combining marks stay on their base). */
    {{"granite-embed-multi-97m"}, {RE_GPT4O_LIKE("\\p{L}\\p{M}")}},
    {{"tiny_aya", "cohere2moe"},
     {SPLIT_DIGITS3, "[^\\r\\n\\p{L}\\p{N}]?" RE_UPPER_LOWER "*" RE_LOWER_ANY "+" RE_CONTRACTIONS
                     "?|[^\\r\\n\\p{L}\\p{N}]?" RE_UPPER_LOWER "+" RE_LOWER_ANY "*" RE_CONTRACTIONS
                     "?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"}},
    {{"kimi-k2"}, {SPLIT_KIMI_K2}},
    {{"superbpe"}, {"\\p{N}+", "(?=(\\d{3})+(?!\\d))"}},
    {{"bailingmoe", "bailingmoe2", "llada-moe"},
     {"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| "
      "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+"}},
    {{"seed-coder"},
     {RE_CONTRACTIONS "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1}| ?[^\\s\\p{L}\\p{N}\\r\\n]+|\\s*[\\r\\n]+|"
                      "\\s+(?!\\S)|\\s+"}},
    /* Qwen2's without the contractions (Turkish suffixes stay attached). */
    {{"ufakzeka"},
     {"[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"}},
    {{"afmoe"},
     {SPLIT_DIGITS3,
      "[一-鿿㐀-䶿豈-﫿぀-ゟ゠-ヿ･-ﾟ⼀-⿟เ-๿຀-໿ក-៿က-႟ꩠ-ꩿꧠ-꧿가-힯ᄀ-ᇿ]"
      "+",
      "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\\r\\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| "
      "?[\\p{P}\\p{S}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"}},
    {{"laguna"}, {"[^\\n]+|[\\n]+", RE_QWEN2}},
    {{"exaone-moe"},
     {RE_CONTRACTIONS "|[^\\r\\n\\p{L}\\p{N}]?(?:\\p{L}\\p{M}*(?: \\p{L}\\p{M}*)*)+|\\p{N}| "
                      "?[^\\s\\p{L}\\p{N}]+[\\r\\n/]?|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+"}},
    /* SentencePiece-style BPE: only newlines split. */
    {{"gemma4", "granite-embed-multi-311m", "sarvam-moe"}, {"[^\\n]+|[\\n]+"}},
    {{"minicpm5"},
     {"\\p{N}{1,3}", RE_CONTRACTIONS "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}+| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
                                     "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"}},
    {{"whitespace"}, {"\\S+"}},
};

static const struct {
    const char *name;
    unsigned flags;
} PRE_FLAGS[] = {
    {"llama3", PRE_IGNORE_MERGES | PRE_ADD_BOS},
    {"llama-v3", PRE_IGNORE_MERGES | PRE_ADD_BOS},
    {"llama-bpe", PRE_IGNORE_MERGES | PRE_ADD_BOS},
    {"falcon3", PRE_IGNORE_MERGES | PRE_ADD_BOS},
    {"falcon-h1", PRE_IGNORE_MERGES | PRE_ADD_BOS},
    {"pixtral", PRE_IGNORE_MERGES | PRE_ADD_BOS},
    {"midm-2.0", PRE_IGNORE_MERGES | PRE_ADD_BOS},
    {"lfm2", PRE_IGNORE_MERGES | PRE_ADD_BOS},
    {"jina-v5-nano", PRE_IGNORE_MERGES | PRE_ADD_BOS},
    {"tekken", PRE_IGNORE_MERGES | PRE_ADD_BOS},
    {"chameleon", PRE_ADD_BOS},
    {"minicpm5", PRE_IGNORE_MERGES},
    {"youtu", PRE_IGNORE_MERGES},
    {"glm4", PRE_IGNORE_MERGES},
    {"glm5", PRE_IGNORE_MERGES},
    {"granite-embed-multi-97m", PRE_IGNORE_MERGES},
    {"gemma4", PRE_RAW_UTF8 | PRE_ESCAPE_SPACES | PRE_ADD_BOS | PRE_NEWLINE_RUNS | PRE_FORCE_BOS},
    {"granite-embed-multi-311m",
     PRE_RAW_UTF8 | PRE_ESCAPE_SPACES | PRE_ADD_BOS | PRE_NEWLINE_RUNS | PRE_FORCE_BOS},
    {"sarvam-moe", PRE_RAW_UTF8 | PRE_ESCAPE_SPACES},
    {"whitespace", PRE_RAW_UTF8},
};

/* The ASCII members of each class, for class text (see above); the class's
 * own byte comes first. */
static const char *ucat_class(const char *name, size_t n) {
    static const struct {
        const char *name, *members;
    } cls[] = {
        {"N", "\xD1"
              "0-9"},
        {"L", "\xD2"
              "A-Za-z"},
        {"Lu", "\xD2"
               "A-Za-z"},
        {"Ll", "\xD2"
               "A-Za-z"},
        {"Lt", "\xD2"
               "A-Za-z"},
        {"Lm", "\xD2"
               "A-Za-z"},
        {"Lo", "\xD2"
               "A-Za-z"},
        {"P", "\xD3"
              "!-#%-*,-/:;?@\\[-\\]_\\{\\}"},
        {"M", "\xD4"},
        {"S", "\xD5"
              "\\$\\+<->\\^`\\|~"},
    };
    for (size_t i = 0; i < sizeof cls / sizeof cls[0]; i++)
        if (strlen(cls[i].name) == n && memcmp(cls[i].name, name, n) == 0) return cls[i].members;
    return NULL;
}

/* Rewrites a regex that uses \p{X} for class text into out (malloc'd);
 * *uses_classes says whether it had any. NULL when out of memory or when
 * it mixes \p{..} with non-ASCII characters (not expressible in class text). */
static char *collapse_regex(const char *re, bool *uses_classes) {
    size_t n = strlen(re);
    char *out = malloc(8 * n + 1);
    if (!out) return NULL;
    size_t o = 0;
    bool inside = false, non_ascii = false;
    *uses_classes = false;
    for (size_t i = 0; i < n; i++) {
        char c = re[i];
        if ((uint8_t)c >= 0x80) non_ascii = true;
        if (c == '\\' && i + 1 < n && re[i + 1] != 'p') {
            out[o++] = c, out[o++] = re[++i]; /* an escaped character, never a bracket */
            continue;
        }
        if (c == '[' && !inside)
            inside = true;
        else if (c == ']' && inside)
            inside = false;
        if (c == '\\' && i + 2 < n && re[i + 1] == 'p' && re[i + 2] == '{') {
            const char *close = strchr(re + i + 3, '}');
            const char *members = close ? ucat_class(re + i + 3, (size_t)(close - (re + i + 3))) : NULL;
            if (members) {
                size_t m = strlen(members);
                if (!inside) out[o++] = '[';
                memcpy(out + o, members, m), o += m;
                if (!inside) out[o++] = ']';
                i = (size_t)(close - re);
                *uses_classes = true;
                continue;
            }
        }
        out[o++] = c;
    }
    out[o] = 0;
    if (*uses_classes && non_ascii) {
        free(out);
        return NULL;
    }
    return out;
}

static duet_status compile_pre(duet_tokenizer *t, const char *pre) {
    const pre_type *ty = NULL;
    for (size_t i = 0; i < sizeof PRE_TYPES / sizeof PRE_TYPES[0] && !ty; i++)
        for (int k = 0; k < 10 && PRE_TYPES[i].names[k]; k++)
            if (strcmp(PRE_TYPES[i].names[k], pre) == 0) ty = &PRE_TYPES[i];
    if (!ty)
        return duet__error(DUET_UNSUPPORTED,
                           "tokenizer: unknown pre-tokenizer '%s' (tokenizer.ggml.pre; llama.cpp's names are "
                           "supported)",
                           pre);
    for (size_t i = 0; i < sizeof PRE_FLAGS / sizeof PRE_FLAGS[0]; i++)
        if (strcmp(PRE_FLAGS[i].name, pre) == 0) t->pre_flags = PRE_FLAGS[i].flags;
    uint32_t jit_cfg = 0;
    pcre2_config(PCRE2_CONFIG_JIT, &jit_cfg);
    t->jit = jit_cfg != 0;
    for (int i = 0; i < MAX_REGEX && ty->patterns[i]; i++) {
        pre_stage *st = &t->stages[t->n_stages];
        const char *pat = ty->patterns[i];
        if (strcmp(pat, SPLIT_KIMI_K2) == 0 || strcmp(pat, SPLIT_DIGITS3) == 0) {
            st->kind = pat[1] == 'k' ? STAGE_KIMI_K2 : STAGE_DIGITS3;
            t->n_stages++;
            continue;
        }
        bool classes;
        char *re_text = collapse_regex(pat, &classes);
        if (!re_text)
            return duet__error(DUET_OUT_OF_MEMORY,
                               "tokenizer: pre-tokenizer '%s' regex %d: out of memory or "
                               "classes with non-ASCII text",
                               pre, i);
        st->kind = classes ? STAGE_CLASS_TEXT : STAGE_UTF8;
        if (!classes) t->need_utf8_text = true;
        int err;
        PCRE2_SIZE at;
        /* $ is the end only, as in ECMAScript. UTF mode is for UTF-8 text
         * (built valid by the encoder); class text is bytes. No UCP: \s,
         * \d, \w are ASCII, as in std::regex. */
        uint32_t opts = PCRE2_DOLLAR_ENDONLY | (classes ? 0 : PCRE2_UTF);
        st->re = pcre2_compile((PCRE2_SPTR)re_text, PCRE2_ZERO_TERMINATED, opts, &err, &at, NULL);
        free(re_text);
        if (!st->re) {
            char msg[128];
            pcre2_get_error_message(err, (PCRE2_UCHAR *)msg, sizeof msg);
            return duet__error(DUET_BAD_MODEL, "tokenizer: pre-tokenizer '%s' regex %d: %s at %zu", pre, i,
                               msg, (size_t)at);
        }
        if (t->jit && pcre2_jit_compile(st->re, PCRE2_JIT_COMPLETE) != 0) t->jit = false;
        t->n_stages++;
    }
    return DUET_OK;
}

void duet_tokenizer_free(duet_tokenizer *t) {
    if (!t) return;
    for (int i = 0; i < t->n_stages; i++)
        if (t->stages[i].re) pcre2_code_free(t->stages[i].re);
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
        /* SentencePiece-style pieces: "▁" is a space, <0xNN> a byte. */
        bool spm_like = t->kind == KIND_SPM || (t->pre_flags & PRE_RAW_UTF8);
        bool unescape = t->kind == KIND_SPM || (t->pre_flags & PRE_ESCAPE_SPACES);
        int byte = ty == DUET_TOKEN_BYTE && spm_like ? parse_byte_piece((const char *)p, len) : -1;
        if (byte >= 0) {
            o[k++] = (char)byte;
        } else if ((ty == DUET_TOKEN_NORMAL || ty == DUET_TOKEN_BYTE) && spm_like) {
            for (size_t i = 0; i < len;) {
                if (unescape && i + 3 <= len && p[i] == 0xE2 && p[i + 1] == 0x96 && p[i + 2] == 0x81) {
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
    char pre[64] = "default";
    if (strcmp(model, "llama") == 0) {
        t->kind = KIND_SPM;
    } else if (strcmp(model, "gpt2") == 0 || strcmp(model, "gemma4") == 0) {
        t->kind = KIND_BPE;
        /* Gemma 4's tokenizer model implies its pre-tokenizer. */
        if (strcmp(model, "gemma4") == 0)
            strcpy(pre, "gemma4");
        else if (duet_gguf_find(g, "tokenizer.ggml.pre") &&
                 !duet_gguf_get_str(g, "tokenizer.ggml.pre", pre, sizeof pre))
            return duet__error(DUET_BAD_MODEL, "tokenizer: tokenizer.ggml.pre is not a string (or too long)");
        duet_status st = compile_pre(t, pre);
        if (st) return st;
    } else if (strcmp(model, "bert") == 0) {
        return duet__error(DUET_UNSUPPORTED, "tokenizer: WPM (BERT WordPiece, tokenizer.ggml.model = 'bert') "
                                             "vocabularies are not supported; duet has SPM ('llama') and BPE "
                                             "('gpt2') tokenizers");
    } else if (strcmp(model, "t5") == 0) {
        return duet__error(DUET_UNSUPPORTED, "tokenizer: UGM (T5 Unigram, tokenizer.ggml.model = 't5') "
                                             "vocabularies are not supported; duet has SPM ('llama') and BPE "
                                             "('gpt2') tokenizers");
    } else if (strcmp(model, "rwkv") == 0) {
        return duet__error(DUET_UNSUPPORTED,
                           "tokenizer: RWKV (tokenizer.ggml.model = 'rwkv') vocabularies are "
                           "not supported; duet has SPM ('llama') and BPE ('gpt2') tokenizers");
    } else {
        return duet__error(DUET_UNSUPPORTED,
                           "tokenizer: unsupported tokenizer model '%s' (tokenizer.ggml.model); duet has SPM "
                           "('llama') and BPE ('gpt2') tokenizers",
                           model);
    }

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
    bool bos_default = t->kind == KIND_SPM || (t->pre_flags & PRE_ADD_BOS);
    if ((st = get_flag(g, "tokenizer.ggml.add_bos_token", bos_default, &t->add_bos, &bos_present)) ||
        (st = get_flag(g, "tokenizer.ggml.add_eos_token", false, &t->add_eos, &eos_present)) ||
        (st =
             get_flag(g, "tokenizer.ggml.add_space_prefix", t->kind == KIND_SPM, &t->add_space_prefix, NULL)))
        return st;
    /* Gemma 4 always starts with BOS, whatever its metadata says (as in
     * llama.cpp). */
    if (t->pre_flags & PRE_FORCE_BOS) t->add_bos = true, bos_present = false;
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
        if (t->kind == KIND_SPM || (t->pre_flags & PRE_RAW_UTF8)) {
            static const char hex[] = "0123456789ABCDEF";
            memcpy(buf, "<0x", 3);
            buf[3] = hex[b >> 4], buf[4] = hex[b & 15], buf[5] = '>';
            l = 6;
        } else {
            l = utf8_put(byte_to_cp((uint8_t)b), buf);
        }
        t->byte_tok[b] = lookup(t, buf, l);
    }
    if (t->kind == KIND_SPM || (t->pre_flags & PRE_RAW_UTF8)) {
        /* Byte tokens spelled in lower case hex still count. */
        for (int i = 0; i < n; i++) {
            int b = t->type[i] == DUET_TOKEN_BYTE ? parse_byte_piece(t->text + t->off[i], t->len[i]) : -1;
            if (b >= 0 && t->byte_tok[b] < 0) t->byte_tok[b] = i;
        }
    }

    if (t->kind == KIND_BPE) {
        const duet_gguf_value *merges = get_array(g, "tokenizer.ggml.merges", DUET_GGUF_STRING, &bad);
        /* Kimi-K2's vocabulary may come without merges (llama.cpp then
         * tokenizes each pre-token by its bytes, or whole). */
        static const duet_gguf_value no_merges = {.type = DUET_GGUF_ARRAY, .arr = {.type = DUET_GGUF_STRING}};
        if (!merges && !bad && strcmp(pre, "kimi-k2") == 0) merges = &no_merges;
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
    /* BPE pre-tokenizing, per fragment of n code points: */
    size_t cp_cap;
    uint32_t *cp;      /* code points (U+FFFD for a byte of invalid UTF-8) */
    uint32_t *boff;    /* byte offset of code point i in the fragment; [n] = its length */
    uint8_t *cls;      /* class text */
    uint32_t *ends[2]; /* piece ends (code point indices), before and after a stage */
    char *utf8;        /* UTF-8 text (see need_utf8_text), and per byte its code point */
    uint32_t *utf8_cp;
    uint32_t *utf8_off; /* byte offset in utf8 of code point i */
    size_t utf8_cap;
    char *word; /* a pre-token in GPT-2's byte alphabet (ignore_merges) */
    size_t word_cap;
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

/* BPE of one pre-token, merges by rank: byte-level vocabularies start from
 * one symbol per byte, SentencePiece-style ones (PRE_RAW_UTF8) from one per
 * UTF-8 character. */
static duet_status bpe_word(const duet_tokenizer *t, scratch *s, const char *w, size_t n, out_ids *o) {
    bool raw = t->pre_flags & PRE_RAW_UTF8;
    if (n == 1 && !raw) {
        int32_t id = t->byte_tok[(uint8_t)w[0]];
        if (id < 0) id = t->unk;
        if (id >= 0) emit(o, id);
        return DUET_OK;
    }
    if (!reserve_syms(s, n)) return duet__error(DUET_OUT_OF_MEMORY, "tokenizer: out of memory");
    int32_t ns = 0;
    for (size_t i = 0; i < n;) {
        size_t l = raw ? char_len((const uint8_t *)w + i, n - i) : 1;
        int32_t id = raw ? lookup(t, w + i, l) : t->byte_tok[(uint8_t)w[i]];
        s->syms[ns] = (sym){(uint32_t)i, (uint32_t)l, ns - 1, ns + 1, id};
        ns++;
        i += l;
    }
    s->syms[ns - 1].next = -1;
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
        const sym *y = &s->syms[i];
        if (y->id >= 0) {
            emit(o, y->id);
        } else if (raw) {
            /* A character outside the vocabulary: its <0xNN> byte tokens
             * (those the vocabulary lacks are dropped, as llama.cpp does). */
            for (uint32_t k = 0; k < y->len; k++)
                if (t->byte_tok[(uint8_t)w[y->start + k]] >= 0)
                    emit(o, t->byte_tok[(uint8_t)w[y->start + k]]);
        } else if (t->unk >= 0) {
            emit(o, t->unk); /* a byte the vocabulary lacks, and no <unk>: dropped */
        }
    }
    return DUET_OK;
}

/* ---- pre-tokenizing (see the PRE_TYPES comment) -------------------------- */

static int ucat(uint32_t cp) {
    if (cp >= 0x110000) return UCAT_UNDEF;
    size_t lo = 0, hi = sizeof UNICODE_CAT_RANGES / sizeof UNICODE_CAT_RANGES[0];
    while (hi - lo > 1) {
        size_t mid = lo + (hi - lo) / 2;
        if ((UNICODE_CAT_RANGES[mid] >> 4) <= cp)
            lo = mid;
        else
            hi = mid;
    }
    return (int)(UNICODE_CAT_RANGES[lo] & 15);
}

/* Unicode's White_Space property. */
static bool is_space(uint32_t cp) {
    return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
           (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
           cp == 0x3000;
}

/* Han ideographs, as Kimi-K2's tokenizer counts them. */
static bool is_han(uint32_t cp) {
    return (cp >= 0x4E00 && cp <= 0x9FFF) || (cp >= 0x3400 && cp <= 0x4DBF) ||
           (cp >= 0x20000 && cp <= 0x2EBEF && !(cp >= 0x2A6E0 && cp <= 0x2A6FF)) ||
           (cp >= 0xF900 && cp <= 0xFAFF) || (cp >= 0x2F800 && cp <= 0x2FA1F);
}

static uint32_t utf8_decode(const uint8_t *p, int l) {
    if (l == 1) return p[0];
    if (l == 2) return ((uint32_t)(p[0] & 0x1F) << 6) | (p[1] & 0x3F);
    if (l == 3) return ((uint32_t)(p[0] & 0x0F) << 12) | ((uint32_t)(p[1] & 0x3F) << 6) | (p[2] & 0x3F);
    return ((uint32_t)(p[0] & 0x07) << 18) | ((uint32_t)(p[1] & 0x3F) << 12) |
           ((uint32_t)(p[2] & 0x3F) << 6) | (p[3] & 0x3F);
}

/* Class text byte of a code point. */
static uint8_t class_byte(uint32_t cp) {
    if (cp < 0x80) return (uint8_t)cp;
    if (is_space(cp)) return 0x0B;
    switch (ucat(cp)) {
    case UCAT_N:
        return 0xD1;
    case UCAT_L:
        return 0xD2;
    case UCAT_P:
        return 0xD3;
    case UCAT_M:
        return 0xD4;
    case UCAT_S:
        return 0xD5;
    default:
        return 0xD0;
    }
}

#define GROW(ptr, cap_needed)                                                                                \
    do {                                                                                                     \
        void *p_ = realloc((ptr), (cap_needed) * sizeof *(ptr));                                             \
        if (!p_) return false;                                                                               \
        (ptr) = p_;                                                                                          \
    } while (0)

static bool reserve_cps(scratch *s, size_t n) {
    if (n + 1 <= s->cp_cap) return true;
    size_t cap = n + 1 < 64 ? 64 : (n + 1) * 2;
    GROW(s->cp, cap);
    GROW(s->boff, cap);
    GROW(s->cls, cap);
    GROW(s->ends[0], cap);
    GROW(s->ends[1], cap);
    GROW(s->utf8_off, cap);
    s->cp_cap = cap;
    return true;
}

static bool reserve_utf8(scratch *s, size_t n) {
    if (n + 1 <= s->utf8_cap) return true;
    size_t cap = (n + 1) * 2;
    GROW(s->utf8, cap);
    GROW(s->utf8_cp, cap);
    s->utf8_cap = cap;
    return true;
}

/* Appends a piece end, dropping empty pieces. */
typedef struct cuts {
    uint32_t *end;
    size_t n;
    uint32_t last;
} cuts;

static void cut(cuts *c, size_t at) {
    if (at > c->last) c->end[c->n++] = (uint32_t)at, c->last = (uint32_t)at;
}

/* One regex stage over the piece [a, b): matches and the gaps between them
 * become pieces. Matching follows std::regex_iterator: after an empty match
 * the next try is a non-empty match at the same place, else a search from
 * one character further. A resource limit ends matching: the rest is one
 * piece. */
static void split_regex(scratch *s, const pre_stage *st, size_t a, size_t b, cuts *c) {
    bool utf8 = st->kind == STAGE_UTF8;
    const uint8_t *subj = utf8 ? (const uint8_t *)s->utf8 + s->utf8_off[a] : s->cls + a;
    size_t n = utf8 ? s->utf8_off[b] - s->utf8_off[a] : b - a;
    size_t pos = 0;
    bool after_empty = false;
    for (;;) {
        int rc;
        if (after_empty) {
            rc = pcre2_match(st->re, subj, n, pos,
                             PCRE2_NOTEMPTY_ATSTART | PCRE2_ANCHORED | PCRE2_NO_UTF_CHECK, s->md, s->mctx);
            if (rc < 0) {
                if (pos >= n) break;
                pos += utf8 ? char_len(subj + pos, n - pos) : 1;
                after_empty = false;
                continue;
            }
        } else {
            rc = pcre2_match(st->re, subj, n, pos, PCRE2_NO_UTF_CHECK, s->md, s->mctx);
            if (rc < 0) break;
        }
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(s->md);
        size_t ms = ov[0], me = ov[1];
        if (ms < pos || me < ms || me > n) break; /* cannot happen; \K-free patterns */
        /* Byte offsets in UTF-8 text back to code point indices. */
        cut(c, utf8 ? s->utf8_cp[s->utf8_off[a] + ms] : a + ms);
        cut(c, utf8 ? s->utf8_cp[s->utf8_off[a] + me] : a + me);
        after_empty = me == ms;
        pos = me;
    }
    cut(c, b);
}

static bool is_ascii_lower(uint32_t cp, char ch) {
    return cp == (uint32_t)ch || cp == (uint32_t)(ch - 'a' + 'A');
}

/* Kimi-K2: Han runs | [^\r\n\p{L}\p{N}]? non-Han letters + an optional
 * contraction | \p{N}{1,3} | ' '? [^\s\p{L}\p{N}]+ [\r\n]* | \s*[\r\n]+ |
 * \s+(?!\S) | \s+, with llama.cpp's classes. */
static void split_kimi(const scratch *s, size_t a, size_t b, cuts *c) {
    const uint32_t *cp = s->cp;
#define K_CAT(i) ((i) < b ? ucat(cp[i]) : -1)
#define K_SPACE(i) ((i) < b && is_space(cp[i]))
#define K_LETTER(i) ((i) < b && ucat(cp[i]) == UCAT_L && !is_han(cp[i]))
    size_t pos = a;
    while (pos < b) {
        uint32_t ch = cp[pos];
        int cat = ucat(ch);
        if (is_han(ch)) {
            while (pos < b && is_han(cp[pos]))
                pos++;
            cut(c, pos);
            continue;
        }
        bool lead = !(ch == '\r' || ch == '\n' || cat == UCAT_L || cat == UCAT_N);
        if (K_LETTER(pos) || (lead && K_LETTER(pos + 1))) {
            if (lead) pos++;
            while (K_LETTER(pos))
                pos++;
            if (pos < b && cp[pos] == '\'' && pos + 1 < b) {
                uint32_t n1 = cp[pos + 1];
                if (is_ascii_lower(n1, 's') || is_ascii_lower(n1, 't') || is_ascii_lower(n1, 'm') ||
                    is_ascii_lower(n1, 'd')) {
                    pos += 2;
                } else if (pos + 2 < b) {
                    uint32_t n2 = cp[pos + 2];
                    if ((is_ascii_lower(n1, 'r') && is_ascii_lower(n2, 'e')) ||
                        (is_ascii_lower(n1, 'v') && is_ascii_lower(n2, 'e')) ||
                        (is_ascii_lower(n1, 'l') && is_ascii_lower(n2, 'l')))
                        pos += 3;
                }
            }
            cut(c, pos);
            continue;
        }
        if (cat == UCAT_N) {
            size_t start = pos;
            while (K_CAT(pos) == UCAT_N) {
                pos++;
                if (pos - start == 3) cut(c, pos), start = pos;
            }
            cut(c, pos);
            continue;
        }
        size_t q = ch == ' ' ? pos + 1 : pos;
        if (q < b && !K_SPACE(q) && K_CAT(q) != UCAT_L && K_CAT(q) != UCAT_N) {
            pos = q;
            while (pos < b && !K_SPACE(pos) && K_CAT(pos) != UCAT_L && K_CAT(pos) != UCAT_N)
                pos++;
            while (pos < b && (cp[pos] == '\r' || cp[pos] == '\n'))
                pos++;
            cut(c, pos);
            continue;
        }
        size_t nws = 0, last_nl = 0;
        while (K_SPACE(pos + nws)) {
            if (cp[pos + nws] == '\r' || cp[pos + nws] == '\n') last_nl = pos + nws + 1;
            nws++;
        }
        if (last_nl > 0)
            pos = last_nl;
        else if (nws > 1 && pos + nws < b)
            pos += nws - 1;
        else if (nws > 0)
            pos += nws;
        else
            pos++;
        cut(c, pos);
    }
#undef K_CAT
#undef K_SPACE
#undef K_LETTER
}

/* AFMoE's and Tiny Aya's digits: a run of \p{N} is cut into groups of three
 * from the right; the text before the run joins its first group. */
static void split_digits3(const scratch *s, size_t a, size_t b, cuts *c) {
    size_t pos = a;
    while (pos < b) {
        if (ucat(s->cp[pos]) != UCAT_N) {
            pos++;
            continue;
        }
        size_t start = pos;
        while (pos < b && ucat(s->cp[pos]) == UCAT_N)
            pos++;
        size_t k = start + (pos - start) % 3;
        if (k > start) cut(c, k);
        for (; k < pos; k += 3)
            cut(c, k + 3);
    }
    cut(c, b);
}

/* Pre-tokenizes one fragment: its pieces end at code points
 * s->ends[0][0..*np_out), code point i starting at byte s->boff[i]. */
static duet_status pre_split(const duet_tokenizer *t, scratch *s, const char *text, size_t len,
                             size_t *np_out) {
    *np_out = 0;
    if (!reserve_cps(s, len)) return duet__error(DUET_OUT_OF_MEMORY, "tokenizer: out of memory");
    size_t n = 0;
    for (size_t i = 0; i < len; n++) {
        int l = utf8_char((const uint8_t *)text + i, len - i);
        s->boff[n] = (uint32_t)i;
        s->cp[n] = l > 0 ? utf8_decode((const uint8_t *)text + i, l) : 0xFFFD;
        s->cls[n] = class_byte(s->cp[n]);
        i += l > 0 ? (size_t)l : 1;
    }
    s->boff[n] = (uint32_t)len;
    if (n == 0) return DUET_OK;
    if (t->need_utf8_text) {
        if (!reserve_utf8(s, 4 * n)) return duet__error(DUET_OUT_OF_MEMORY, "tokenizer: out of memory");
        size_t m = 0;
        for (size_t i = 0; i < n; i++) {
            s->utf8_off[i] = (uint32_t)m;
            size_t l = s->cls[i] == 0x0B ? (s->utf8[m] = 0x0B, 1) : utf8_put(s->cp[i], s->utf8 + m);
            for (size_t k = 0; k < l; k++)
                s->utf8_cp[m + k] = (uint32_t)i;
            m += l;
        }
        s->utf8_off[n] = (uint32_t)m;
        s->utf8_cp[m] = (uint32_t)n;
    }
    /* ends[0] holds the pieces: one piece, the whole fragment. */
    size_t np = 1;
    s->ends[0][0] = (uint32_t)n;
    for (int k = 0; k < t->n_stages; k++) {
        cuts c = {s->ends[1], 0, 0};
        size_t a = 0;
        for (size_t i = 0; i < np; i++) {
            size_t b = s->ends[0][i];
            const pre_stage *st = &t->stages[k];
            if (st->kind == STAGE_KIMI_K2)
                split_kimi(s, a, b, &c);
            else if (st->kind == STAGE_DIGITS3)
                split_digits3(s, a, b, &c);
            else
                split_regex(s, st, a, b, &c);
            a = b;
        }
        uint32_t *tmp = s->ends[0];
        s->ends[0] = s->ends[1], s->ends[1] = tmp;
        np = c.n;
    }
    *np_out = np;
    return DUET_OK;
}

/* BPE of the text of one fragment: pre-tokenizer stages, then BPE per
 * pre-token. */
static duet_status bpe_fragment(const duet_tokenizer *t, scratch *s, const char *text, size_t len,
                                out_ids *o) {
    size_t np;
    duet_status st = pre_split(t, s, text, len, &np);
    if (st) return st;
    size_t a = 0;
    for (size_t i = 0; i < np; i++) {
        size_t b = s->ends[0][i];
        const char *w = text + s->boff[a];
        size_t wl = s->boff[b] - s->boff[a];
        a = b;
        bool newlines = false;
        if (t->pre_flags & PRE_NEWLINE_RUNS) {
            newlines = true;
            for (size_t k = 0; k < wl && newlines; k++)
                newlines = w[k] == '\n';
        }
        if ((t->pre_flags & PRE_IGNORE_MERGES) || newlines) {
            /* The pre-token as the vocabulary spells it. */
            const char *key = w;
            size_t kl = wl;
            if (!(t->pre_flags & PRE_RAW_UTF8)) {
                if (2 * wl > s->word_cap) {
                    char *p = realloc(s->word, 2 * wl);
                    if (!p) return duet__error(DUET_OUT_OF_MEMORY, "tokenizer: out of memory");
                    s->word = p, s->word_cap = 2 * wl;
                }
                kl = 0;
                for (size_t k = 0; k < wl; k++)
                    kl += utf8_put(byte_to_cp((uint8_t)w[k]), s->word + kl);
                key = s->word;
            }
            int32_t id = lookup(t, key, kl);
            if (id >= 0) {
                emit(o, id);
                continue;
            }
        }
        if ((st = bpe_word(t, s, w, wl, o))) return st;
    }
    return DUET_OK;
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
    if (!(t->pre_flags & PRE_ESCAPE_SPACES)) return bpe_fragment(t, s, text, n, o);
    /* SentencePiece-style BPE: spaces as U+2581 first. */
    size_t need = 3 * n + 1;
    if (need > s->norm_cap) {
        char *p = realloc(s->norm, need);
        if (!p) return duet__error(DUET_OUT_OF_MEMORY, "tokenizer: out of memory");
        s->norm = p, s->norm_cap = need;
    }
    size_t m = 0;
    for (size_t i = 0; i < n; i++) {
        if (text[i] == ' ')
            memcpy(s->norm + m, "\xe2\x96\x81", 3), m += 3;
        else
            s->norm[m++] = text[i];
    }
    return bpe_fragment(t, s, s->norm, m, o);
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
    free(s.cp);
    free(s.boff);
    free(s.cls);
    free(s.ends[0]);
    free(s.ends[1]);
    free(s.utf8);
    free(s.utf8_cp);
    free(s.utf8_off);
    free(s.word);
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
