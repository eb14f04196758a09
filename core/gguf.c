/* gguf.c — GGUF v2/v3 reader and v3 writer.
 *
 * Reader: the file is untrusted. Every count is checked against the bytes
 * left in the file before anything is allocated (each element needs at
 * least a known number of bytes, so a count that cannot fit is rejected
 * without allocating), every length and offset with overflow-checked
 * arithmetic, and every message says what is wrong and at which byte.
 * All parsed structures live in an arena freed by duet_gguf_close.
 *
 * Writer: keeps each metadata value already encoded (type tag + payload),
 * so copying a reader's KV pairs, replacing a key and writing are all plain
 * byte copies.
 */
#include "gguf.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define GGUF_MAGIC "GGUF"
#define GGUF_DEFAULT_ALIGNMENT 32
#define GGUF_MAX_ARRAY_DEPTH 8 /* arrays of arrays nest at most this deep */
#define GGUF_N_TYPES 13

/* ---- small helpers ------------------------------------------------------ */

static bool add_ovf(uint64_t a, uint64_t b, uint64_t *out) {
    return __builtin_add_overflow(a, b, out);
}
static bool mul_ovf(uint64_t a, uint64_t b, uint64_t *out) {
    return __builtin_mul_overflow(a, b, out);
}

static bool is_pow2(uint64_t x) {
    return x != 0 && (x & (x - 1)) == 0;
}

/* Rounds x up to a multiple of the power of two a; false on overflow. */
static bool align_up(uint64_t x, uint64_t a, uint64_t *out) {
    uint64_t t;
    if (add_ovf(x, a - 1, &t)) return false;
    *out = t & ~(a - 1);
    return true;
}

static uint32_t le32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t le64(const uint8_t *p) {
    return (uint64_t)le32(p) | (uint64_t)le32(p + 4) << 32;
}

/* Bytes of one scalar element; 0 for STRING/ARRAY and unknown types. */
static uint64_t scalar_size(uint32_t t) {
    switch (t) {
    case DUET_GGUF_UINT8:
    case DUET_GGUF_INT8:
    case DUET_GGUF_BOOL:
        return 1;
    case DUET_GGUF_UINT16:
    case DUET_GGUF_INT16:
        return 2;
    case DUET_GGUF_UINT32:
    case DUET_GGUF_INT32:
    case DUET_GGUF_FLOAT32:
        return 4;
    case DUET_GGUF_UINT64:
    case DUET_GGUF_INT64:
    case DUET_GGUF_FLOAT64:
        return 8;
    default:
        return 0;
    }
}

const char *duet_gguf_type_name(duet_gguf_type t) {
    static const char *const names[GGUF_N_TYPES] = {
        "uint8", "int8",   "uint16", "int16",  "uint32", "int32",   "float32",
        "bool",  "string", "array",  "uint64", "int64",  "float64",
    };
    if ((unsigned)t < GGUF_N_TYPES) return names[t];
    return "unknown";
}

/* The dtypes duet reads: the type table's weight types and i32; anything
 * else in a file is refused. (Q8_K is in the table as an activation
 * format, never a tensor's.) Whether a backend runs a type is the model
 * loader's question, not the reader's. */
static bool dtype_supported(uint32_t t) {
    return t < 256 && (duet_dtype_is_weight((duet_dtype)t) || t == DUET_DTYPE_I32);
}

/* "f32 (0), f16 (1), ...": the supported types, for messages. */
static const char *supported_dtypes(char *buf, size_t size) {
    size_t n = 0;
    buf[0] = '\0';
    for (uint32_t t = 0; t < 64 && n < size; t++)
        if (dtype_supported(t))
            n += (size_t)snprintf(buf + n, size - n, "%s%s (%u)", n ? ", " : "",
                                  duet_dtype_name((duet_dtype)t), t);
    return buf;
}

/* ggml's names for its type ids, so a refusal says what the file holds. */
static const char *ggml_type_name(uint32_t t) {
    static const char *const names[] = {
        [0] = "f32",     [1] = "f16",    [2] = "q4_0",     [3] = "q4_1",    [6] = "q5_0",     [7] = "q5_1",
        [8] = "q8_0",    [9] = "q8_1",   [10] = "q2_K",    [11] = "q3_K",   [12] = "q4_K",    [13] = "q5_K",
        [14] = "q6_K",   [15] = "q8_K",  [16] = "iq2_xxs", [17] = "iq2_xs", [18] = "iq3_xxs", [19] = "iq1_s",
        [20] = "iq4_nl", [21] = "iq3_s", [22] = "iq2_s",   [23] = "iq4_xs", [24] = "i8",      [25] = "i16",
        [26] = "i32",    [27] = "i64",   [28] = "f64",     [29] = "iq1_m",  [30] = "bf16",    [34] = "tq1_0",
        [35] = "tq2_0",  [39] = "mxfp4",
    };
    if (t < sizeof names / sizeof names[0] && names[t]) return names[t];
    return "unknown";
}

/* Copies an untrusted name into buf for a message: at most 64 bytes,
 * non-printable bytes shown as '?'. */
static const char *printable(duet_gguf_str s, char *buf, size_t size) {
    size_t n = 0;
    for (uint64_t i = 0; i < s.len && n + 4 < size; i++) {
        if (i == 64) {
            memcpy(buf + n, "...", 3);
            n += 3;
            break;
        }
        unsigned char c = (unsigned char)s.ptr[i];
        buf[n++] = (c >= 0x20 && c < 0x7f) ? (char)c : '?';
    }
    buf[n] = 0;
    return buf;
}

static int str_cmp(duet_gguf_str a, duet_gguf_str b) {
    uint64_t n = a.len < b.len ? a.len : b.len;
    int c = n ? memcmp(a.ptr, b.ptr, (size_t)n) : 0;
    if (c) return c;
    return a.len < b.len ? -1 : a.len > b.len ? 1 : 0;
}

/* ---- arena -------------------------------------------------------------- */

typedef struct arena_chunk {
    struct arena_chunk *next;
    size_t cap, used;
    _Alignas(16) unsigned char data[];
} arena_chunk;

#define ARENA_CHUNK (64 * 1024)

/* Private part of a duet_gguf (what g->arena points to). */
typedef struct gguf_priv {
    arena_chunk *chunks;
    const duet_gguf_kv **kv_sorted;         /* by key, for lookup */
    const duet_gguf_tensor **tensor_sorted; /* by name, for lookup */
} gguf_priv;

static void *arena_alloc(gguf_priv *a, uint64_t n) {
    if (n > SIZE_MAX - 64) return NULL;
    size_t sz = ((size_t)n + 15) & ~(size_t)15;
    if (sz == 0) sz = 16;
    arena_chunk *c = a->chunks;
    if (!c || c->cap - c->used < sz) {
        size_t cap = sz > ARENA_CHUNK ? sz : ARENA_CHUNK;
        c = malloc(sizeof *c + cap);
        if (!c) return NULL;
        c->cap = cap;
        c->used = 0;
        /* A big one-off allocation goes behind the current chunk so the
         * current chunk's free space stays usable. */
        if (a->chunks && sz > ARENA_CHUNK) {
            c->next = a->chunks->next;
            a->chunks->next = c;
        } else {
            c->next = a->chunks;
            a->chunks = c;
        }
    }
    void *p = c->data + c->used;
    c->used += sz;
    return p;
}

static void arena_free(gguf_priv *a) {
    arena_chunk *c = a->chunks;
    while (c) {
        arena_chunk *next = c->next;
        free(c);
        c = next;
    }
    a->chunks = NULL;
}

/* ---- reader ------------------------------------------------------------- */

typedef struct parser {
    const uint8_t *base;
    uint64_t size, pos;
    gguf_priv *priv;
    /* What is being parsed, for messages. */
    const char *section; /* "header", "key", "tensor" */
    uint64_t index;
    duet_gguf_str name; /* key or tensor name once read */
    bool has_name;
} parser;

static const char *where(const parser *p, char *buf, size_t size) {
    char nb[80];
    if (p->has_name)
        snprintf(buf, size, "%s #%llu ('%s')", p->section, (unsigned long long)p->index,
                 printable(p->name, nb, sizeof nb));
    else if (strcmp(p->section, "header") == 0)
        snprintf(buf, size, "header");
    else
        snprintf(buf, size, "%s #%llu", p->section, (unsigned long long)p->index);
    return buf;
}

__attribute__((format(printf, 2, 3))) static duet_status bad(const parser *p, const char *fmt, ...) {
    char msg[700], w[160];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return duet__error(DUET_BAD_MODEL, "gguf: %s: %s", where(p, w, sizeof w), msg);
}

static duet_status oom(const parser *p, uint64_t n) {
    char w[160];
    return duet__error(DUET_OUT_OF_MEMORY, "gguf: %s: out of memory allocating %llu bytes",
                       where(p, w, sizeof w), (unsigned long long)n);
}

static uint64_t left(const parser *p) {
    return p->size - p->pos;
}

/* Checks that n bytes of `what` fit at the cursor. */
static duet_status need(const parser *p, uint64_t n, const char *what) {
    if (n <= left(p)) return DUET_OK;
    return bad(p, "%s at byte %llu needs %llu bytes but the file ends at byte %llu (truncated?)", what,
               (unsigned long long)p->pos, (unsigned long long)n, (unsigned long long)p->size);
}

static duet_status rd_u32(parser *p, const char *what, uint32_t *out) {
    duet_status st = need(p, 4, what);
    if (st) return st;
    *out = le32(p->base + p->pos);
    p->pos += 4;
    return DUET_OK;
}

static duet_status rd_u64(parser *p, const char *what, uint64_t *out) {
    duet_status st = need(p, 8, what);
    if (st) return st;
    *out = le64(p->base + p->pos);
    p->pos += 8;
    return DUET_OK;
}

static duet_status rd_str(parser *p, const char *what, duet_gguf_str *out) {
    uint64_t at = p->pos;
    uint64_t len;
    duet_status st = rd_u64(p, what, &len);
    if (st) return st;
    if (len > left(p))
        return bad(p, "%s length %llu at byte %llu exceeds the %llu bytes left in the file (size %llu)", what,
                   (unsigned long long)len, (unsigned long long)at, (unsigned long long)left(p),
                   (unsigned long long)p->size);
    out->ptr = (const char *)p->base + p->pos;
    out->len = len;
    p->pos += len;
    return DUET_OK;
}

/* Checks n elements of at least min_bytes each can fit in what is left of
 * the file, before anything is allocated for them. */
static duet_status count_fits(const parser *p, uint64_t n, uint64_t min_bytes, uint64_t at,
                              const char *what) {
    if (min_bytes == 0 || n <= left(p) / min_bytes) return DUET_OK;
    return bad(p,
               "%s %llu at byte %llu cannot fit: each needs at least %llu bytes and only %llu bytes "
               "are left (file size %llu)",
               what, (unsigned long long)n, (unsigned long long)at, (unsigned long long)min_bytes,
               (unsigned long long)left(p), (unsigned long long)p->size);
}

static void *alloc_array(parser *p, uint64_t n, uint64_t elem, duet_status *st) {
    uint64_t bytes;
    if (mul_ovf(n, elem, &bytes)) {
        *st = oom(p, UINT64_MAX);
        return NULL;
    }
    void *r = arena_alloc(p->priv, bytes);
    if (!r)
        *st = oom(p, bytes);
    else
        memset(r, 0, (size_t)bytes);
    return r;
}

static duet_status parse_value(parser *p, uint32_t type, duet_gguf_value *v, int depth);

/* Array body: element type, count, elements. */
static duet_status parse_array(parser *p, duet_gguf_value *v, int depth) {
    duet_status st;
    if (depth >= GGUF_MAX_ARRAY_DEPTH)
        return bad(p, "arrays nested more than %d deep at byte %llu", GGUF_MAX_ARRAY_DEPTH,
                   (unsigned long long)p->pos);
    uint64_t at = p->pos;
    uint32_t et;
    if ((st = rd_u32(p, "array element type", &et))) return st;
    if (et >= GGUF_N_TYPES)
        return bad(p, "unknown array element type %u at byte %llu (valid: 0..%d)", et, (unsigned long long)at,
                   GGUF_N_TYPES - 1);
    uint64_t n_at = p->pos, n;
    if ((st = rd_u64(p, "array length", &n))) return st;
    v->type = DUET_GGUF_ARRAY;
    v->arr.type = (duet_gguf_type)et;
    v->arr.n = n;
    v->arr.data = NULL;
    v->arr.strs = NULL;
    v->arr.arrays = NULL;

    uint64_t esz = scalar_size(et);
    if (esz) {
        if ((st = count_fits(p, n, esz, n_at, "array length"))) return st;
        const uint8_t *raw = p->base + p->pos;
        uint64_t bytes = n * esz;
        if (et == DUET_GGUF_BOOL) {
            for (uint64_t i = 0; i < n; i++)
                if (raw[i] > 1)
                    return bad(p, "bool array element %llu at byte %llu has value %u (must be 0 or 1)",
                               (unsigned long long)i, (unsigned long long)(p->pos + i), raw[i]);
        }
        /* Elements are handed out as a typed pointer; keep it naturally
         * aligned so callers may index it directly. */
        if ((uintptr_t)raw % esz != 0) {
            void *copy = arena_alloc(p->priv, bytes);
            if (!copy) return oom(p, bytes);
            memcpy(copy, raw, (size_t)bytes);
            v->arr.data = copy;
        } else {
            v->arr.data = raw;
        }
        p->pos += bytes;
        return DUET_OK;
    }
    if (et == DUET_GGUF_STRING) {
        if ((st = count_fits(p, n, 8, n_at, "string array length"))) return st;
        duet_gguf_str *strs = alloc_array(p, n, sizeof *strs, &st);
        if (!strs) return st;
        for (uint64_t i = 0; i < n; i++) {
            uint64_t sat = p->pos, len;
            if ((st = rd_u64(p, "string array element length", &len))) return st;
            if (len > left(p))
                return bad(p,
                           "string array element %llu length %llu at byte %llu exceeds the %llu bytes "
                           "left in the file (size %llu)",
                           (unsigned long long)i, (unsigned long long)len, (unsigned long long)sat,
                           (unsigned long long)left(p), (unsigned long long)p->size);
            strs[i].ptr = (const char *)p->base + p->pos;
            strs[i].len = len;
            p->pos += len;
        }
        v->arr.strs = strs;
        return DUET_OK;
    }
    /* Array of arrays: each element is element type + count (12 bytes) at least. */
    if ((st = count_fits(p, n, 12, n_at, "nested array length"))) return st;
    duet_gguf_value *arrs = alloc_array(p, n, sizeof *arrs, &st);
    if (!arrs) return st;
    for (uint64_t i = 0; i < n; i++)
        if ((st = parse_array(p, &arrs[i], depth + 1))) return st;
    v->arr.arrays = arrs;
    return DUET_OK;
}

static duet_status parse_value(parser *p, uint32_t type, duet_gguf_value *v, int depth) {
    duet_status st;
    v->type = (duet_gguf_type)type;
    if (type == DUET_GGUF_STRING) return rd_str(p, "string value", &v->str);
    if (type == DUET_GGUF_ARRAY) return parse_array(p, v, depth);
    uint64_t sz = scalar_size(type);
    if ((st = need(p, sz, duet_gguf_type_name((duet_gguf_type)type)))) return st;
    const uint8_t *b = p->base + p->pos;
    switch (type) {
    case DUET_GGUF_UINT8:
        v->u64 = b[0];
        break;
    case DUET_GGUF_INT8:
        v->i64 = (int8_t)b[0];
        break;
    case DUET_GGUF_UINT16:
        v->u64 = (uint16_t)(b[0] | b[1] << 8);
        break;
    case DUET_GGUF_INT16:
        v->i64 = (int16_t)(uint16_t)(b[0] | b[1] << 8);
        break;
    case DUET_GGUF_UINT32:
        v->u64 = le32(b);
        break;
    case DUET_GGUF_INT32:
        v->i64 = (int32_t)le32(b);
        break;
    case DUET_GGUF_UINT64:
        v->u64 = le64(b);
        break;
    case DUET_GGUF_INT64:
        v->i64 = (int64_t)le64(b);
        break;
    case DUET_GGUF_FLOAT32: {
        uint32_t u = le32(b);
        float f;
        memcpy(&f, &u, 4);
        v->f64 = f;
        break;
    }
    case DUET_GGUF_FLOAT64: {
        uint64_t u = le64(b);
        memcpy(&v->f64, &u, 8);
        break;
    }
    case DUET_GGUF_BOOL:
        if (b[0] > 1)
            return bad(p, "bool value at byte %llu is %u (must be 0 or 1)", (unsigned long long)p->pos, b[0]);
        v->u64 = b[0];
        break;
    default:
        return bad(p, "unknown value type %u", type); /* callers check first */
    }
    p->pos += sz;
    return DUET_OK;
}

static int cmp_kv(const void *a, const void *b) {
    return str_cmp((*(const duet_gguf_kv *const *)a)->key, (*(const duet_gguf_kv *const *)b)->key);
}

static int cmp_tensor_name(const void *a, const void *b) {
    return str_cmp((*(const duet_gguf_tensor *const *)a)->name, (*(const duet_gguf_tensor *const *)b)->name);
}

static int cmp_tensor_offset(const void *a, const void *b) {
    const duet_gguf_tensor *x = *(const duet_gguf_tensor *const *)a;
    const duet_gguf_tensor *y = *(const duet_gguf_tensor *const *)b;
    return x->offset < y->offset ? -1 : x->offset > y->offset ? 1 : 0;
}

/* Minimum bytes of one KV pair (non-empty key, type, 1-byte value) and of
 * one tensor info (non-empty name, n_dims, one ne, type, offset). */
#define MIN_KV_BYTES (8 + 1 + 4 + 1)
#define MIN_TENSOR_INFO_BYTES (8 + 1 + 4 + 8 + 4 + 8)

static duet_status parse(duet_gguf *g, gguf_priv *priv) {
    parser P = {.base = g->base, .size = g->size, .priv = priv, .section = "header"};
    parser *p = &P;
    duet_status st;
    char nb[80];

    if (p->size < 4 || memcmp(p->base, GGUF_MAGIC, 4) != 0) {
        if (p->size < 4)
            return bad(p, "file is %llu bytes, too small for a GGUF header", (unsigned long long)p->size);
        return bad(p, "bad magic %02x %02x %02x %02x at byte 0 (expected 'GGUF'): not a GGUF file",
                   p->base[0], p->base[1], p->base[2], p->base[3]);
    }
    p->pos = 4;
    if ((st = rd_u32(p, "version", &g->version))) return st;
    if (g->version == 1)
        return bad(p, "GGUF version 1 is not supported (only versions 2 and 3); convert the file "
                      "with a current llama.cpp");
    if (g->version != 2 && g->version != 3) {
        if ((g->version & 0xffff) == 0 && g->version != 0)
            return bad(p,
                       "version field 0x%08x looks byte-swapped: big-endian GGUF files are not "
                       "supported",
                       g->version);
        return bad(p, "unsupported GGUF version %u at byte 4 (supported: 2, 3)", g->version);
    }
    uint64_t n_tensors_at = p->pos;
    if ((st = rd_u64(p, "tensor count", &g->n_tensors))) return st;
    uint64_t n_kv_at = p->pos;
    if ((st = rd_u64(p, "metadata key count", &g->n_kv))) return st;
    if ((st = count_fits(p, g->n_kv, MIN_KV_BYTES, n_kv_at, "metadata key count"))) return st;
    if ((st = count_fits(p, g->n_tensors, MIN_TENSOR_INFO_BYTES, n_tensors_at, "tensor count"))) return st;
    {
        uint64_t a, b, t;
        if (mul_ovf(g->n_kv, MIN_KV_BYTES, &a) || mul_ovf(g->n_tensors, MIN_TENSOR_INFO_BYTES, &b) ||
            add_ovf(a, b, &t) || t > left(p))
            return bad(p,
                       "%llu metadata keys and %llu tensors cannot fit in the %llu bytes left in the "
                       "file (size %llu)",
                       (unsigned long long)g->n_kv, (unsigned long long)g->n_tensors,
                       (unsigned long long)left(p), (unsigned long long)p->size);
    }

    /* ---- metadata ---- */
    g->kv = alloc_array(p, g->n_kv, sizeof *g->kv, &st);
    if (!g->kv) return st;
    g->alignment = GGUF_DEFAULT_ALIGNMENT;
    p->section = "key";
    for (uint64_t i = 0; i < g->n_kv; i++) {
        duet_gguf_kv *kv = &g->kv[i];
        p->index = i;
        p->has_name = false;
        uint64_t at = p->pos;
        if ((st = rd_str(p, "key", &kv->key))) return st;
        if (kv->key.len == 0) return bad(p, "empty key at byte %llu", (unsigned long long)at);
        p->name = kv->key;
        p->has_name = true;
        uint64_t tat = p->pos;
        uint32_t type;
        if ((st = rd_u32(p, "value type", &type))) return st;
        if (type >= GGUF_N_TYPES)
            return bad(p, "unknown value type %u at byte %llu (valid: 0..%d)", type, (unsigned long long)tat,
                       GGUF_N_TYPES - 1);
        if ((st = parse_value(p, type, &kv->value, 0))) return st;
        if (kv->key.len == 17 && memcmp(kv->key.ptr, "general.alignment", 17) == 0) {
            if (type != DUET_GGUF_UINT32)
                return bad(p, "general.alignment has type %s, must be uint32",
                           duet_gguf_type_name((duet_gguf_type)type));
            if (!is_pow2(kv->value.u64))
                return bad(p, "general.alignment is %llu, must be a nonzero power of two",
                           (unsigned long long)kv->value.u64);
            g->alignment = kv->value.u64;
        }
    }
    p->has_name = false;

    /* Duplicate keys, found on the sorted index used for lookups. */
    priv->kv_sorted = alloc_array(p, g->n_kv, sizeof *priv->kv_sorted, &st);
    if (!priv->kv_sorted) return st;
    for (uint64_t i = 0; i < g->n_kv; i++)
        priv->kv_sorted[i] = &g->kv[i];
    if (g->n_kv > 1) qsort(priv->kv_sorted, (size_t)g->n_kv, sizeof *priv->kv_sorted, cmp_kv);
    for (uint64_t i = 1; i < g->n_kv; i++) {
        if (str_cmp(priv->kv_sorted[i - 1]->key, priv->kv_sorted[i]->key) == 0) {
            const duet_gguf_kv *a = priv->kv_sorted[i - 1], *b = priv->kv_sorted[i];
            if (a > b) {
                const duet_gguf_kv *t = a;
                a = b;
                b = t;
            }
            return duet__error(DUET_BAD_MODEL, "gguf: duplicate key '%s' (key #%llu and key #%llu)",
                               printable(a->key, nb, sizeof nb), (unsigned long long)(a - g->kv),
                               (unsigned long long)(b - g->kv));
        }
    }

    /* ---- tensor infos ---- */
    p->section = "tensor";
    if ((st = count_fits(p, g->n_tensors, MIN_TENSOR_INFO_BYTES, n_tensors_at, "tensor count"))) return st;
    g->tensors = alloc_array(p, g->n_tensors, sizeof *g->tensors, &st);
    if (!g->tensors) return st;
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        duet_gguf_tensor *t = &g->tensors[i];
        p->index = i;
        p->has_name = false;
        uint64_t at = p->pos;
        if ((st = rd_str(p, "tensor name", &t->name))) return st;
        if (t->name.len == 0) return bad(p, "empty tensor name at byte %llu", (unsigned long long)at);
        p->name = t->name;
        p->has_name = true;
        uint32_t n_dims;
        at = p->pos;
        if ((st = rd_u32(p, "n_dims", &n_dims))) return st;
        if (n_dims < 1 || n_dims > DUET_GGUF_MAX_DIMS)
            return bad(p, "n_dims %u at byte %llu out of range (1..%d)", n_dims, (unsigned long long)at,
                       DUET_GGUF_MAX_DIMS);
        t->n_dims = (int)n_dims;
        uint64_t nelem = 1;
        for (int d = 0; d < DUET_GGUF_MAX_DIMS; d++)
            t->ne[d] = 1;
        for (uint32_t d = 0; d < n_dims; d++) {
            uint64_t ne;
            at = p->pos;
            if ((st = rd_u64(p, "dimension", &ne))) return st;
            if (ne == 0 || ne > (uint64_t)INT64_MAX)
                return bad(p, "dimension ne[%u] = %llu at byte %llu is invalid (must be 1..2^63-1)", d,
                           (unsigned long long)ne, (unsigned long long)at);
            if (mul_ovf(nelem, ne, &nelem) || nelem > (uint64_t)INT64_MAX)
                return bad(p, "element count overflows at dimension ne[%u] = %llu (byte %llu)", d,
                           (unsigned long long)ne, (unsigned long long)at);
            t->ne[d] = (int64_t)ne;
        }
        uint32_t type;
        at = p->pos;
        if ((st = rd_u32(p, "tensor type", &type))) return st;
        if (!dtype_supported(type)) {
            char list[512];
            return bad(p, "tensor type %u (%s) at byte %llu is not supported; supported types: %s", type,
                       ggml_type_name(type), (unsigned long long)at, supported_dtypes(list, sizeof list));
        }
        t->type = (duet_dtype)type;
        uint64_t block = (uint64_t)duet_dtype_block(t->type);
        uint64_t block_bytes = duet_dtype_block_bytes(t->type);
        if (block == 0 || block_bytes == 0)
            return bad(p, "tensor type %s has no known block size", ggml_type_name(type));
        if ((uint64_t)t->ne[0] % block != 0)
            return bad(p, "ne[0] = %lld is not a multiple of the %s block size %llu", (long long)t->ne[0],
                       ggml_type_name(type), (unsigned long long)block);
        if (mul_ovf(nelem / block, block_bytes, &t->size))
            return bad(p, "data size overflows (%llu elements of %s)", (unsigned long long)nelem,
                       ggml_type_name(type));
        at = p->pos;
        if ((st = rd_u64(p, "tensor offset", &t->offset))) return st;
        if (t->offset % g->alignment != 0)
            return bad(p, "data offset %llu (byte %llu) is not a multiple of the alignment %llu",
                       (unsigned long long)t->offset, (unsigned long long)at,
                       (unsigned long long)g->alignment);
    }
    p->has_name = false;

    if (!align_up(p->pos, g->alignment, &g->data_offset)) return bad(p, "data section offset overflows");

    /* Each tensor's data lies inside the file. A file with no tensors (a
     * vocab-only file) may end before the padded data offset. */
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        duet_gguf_tensor *t = &g->tensors[i];
        uint64_t start, end;
        if (add_ovf(g->data_offset, t->offset, &start) || add_ovf(start, t->size, &end) || end > p->size)
            return duet__error(DUET_BAD_MODEL,
                               "gguf: tensor %llu ('%s') data [offset %llu, size %llu] runs past end "
                               "of file (data section at byte %llu, file size %llu)",
                               (unsigned long long)i, printable(t->name, nb, sizeof nb),
                               (unsigned long long)t->offset, (unsigned long long)t->size,
                               (unsigned long long)g->data_offset, (unsigned long long)p->size);
        t->data = p->base + start;
    }

    /* Duplicate names and overlapping data, on sorted views. */
    priv->tensor_sorted = alloc_array(p, g->n_tensors, sizeof *priv->tensor_sorted, &st);
    if (!priv->tensor_sorted) return st;
    for (uint64_t i = 0; i < g->n_tensors; i++)
        priv->tensor_sorted[i] = &g->tensors[i];
    if (g->n_tensors > 1) {
        qsort(priv->tensor_sorted, (size_t)g->n_tensors, sizeof *priv->tensor_sorted, cmp_tensor_offset);
        for (uint64_t i = 1; i < g->n_tensors; i++) {
            const duet_gguf_tensor *a = priv->tensor_sorted[i - 1], *b = priv->tensor_sorted[i];
            if (a->offset + a->size > b->offset) {
                char nb2[80];
                return duet__error(DUET_BAD_MODEL,
                                   "gguf: tensor %llu ('%s') data [offset %llu, size %llu] overlaps "
                                   "tensor %llu ('%s') data [offset %llu, size %llu]",
                                   (unsigned long long)(a - g->tensors), printable(a->name, nb, sizeof nb),
                                   (unsigned long long)a->offset, (unsigned long long)a->size,
                                   (unsigned long long)(b - g->tensors), printable(b->name, nb2, sizeof nb2),
                                   (unsigned long long)b->offset, (unsigned long long)b->size);
            }
        }
        qsort(priv->tensor_sorted, (size_t)g->n_tensors, sizeof *priv->tensor_sorted, cmp_tensor_name);
        for (uint64_t i = 1; i < g->n_tensors; i++) {
            const duet_gguf_tensor *a = priv->tensor_sorted[i - 1], *b = priv->tensor_sorted[i];
            if (str_cmp(a->name, b->name) == 0) {
                if (a > b) {
                    const duet_gguf_tensor *t = a;
                    a = b;
                    b = t;
                }
                return duet__error(DUET_BAD_MODEL,
                                   "gguf: duplicate tensor name '%s' (tensor %llu and tensor %llu)",
                                   printable(a->name, nb, sizeof nb), (unsigned long long)(a - g->tensors),
                                   (unsigned long long)(b - g->tensors));
            }
        }
    }
    return DUET_OK;
}

/* Parses [data, data+size); on success *out owns the arena (and the
 * mapping when `mapped`). On failure nothing is left allocated. */
static duet_status open_common(const void *data, uint64_t size, bool mapped, duet_gguf **out) {
    duet_gguf *g = calloc(1, sizeof *g + sizeof(gguf_priv));
    if (!g) return duet__error(DUET_OUT_OF_MEMORY, "gguf: out of memory");
    gguf_priv *priv = (gguf_priv *)(g + 1);
    g->arena = priv;
    g->base = data;
    g->size = size;
    g->mapped = mapped;
    duet_status st = parse(g, priv);
    if (st) {
        arena_free(priv);
        free(g);
        return st;
    }
    *out = g;
    return DUET_OK;
}

duet_status duet_gguf_open_memory(const void *data, size_t size, duet_gguf **out) {
    if (!out || (!data && size)) return duet__error(DUET_INVALID_ARGUMENT, "gguf: NULL argument");
    *out = NULL;
    static const uint8_t empty[1];
    return open_common(data ? data : empty, size, false, out);
}

duet_status duet_gguf_open(const char *path, duet_gguf **out) {
    if (!path || !out) return duet__error(DUET_INVALID_ARGUMENT, "gguf: NULL argument");
    *out = NULL;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return duet__error(DUET_IO, "gguf: cannot open '%s': %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        int e = errno;
        close(fd);
        return duet__error(DUET_IO, "gguf: cannot stat '%s': %s", path, strerror(e));
    }
    if (!S_ISREG(sb.st_mode)) {
        close(fd);
        return duet__error(DUET_IO, "gguf: '%s' is not a regular file", path);
    }
    if (sb.st_size < 4 || (uint64_t)sb.st_size > SIZE_MAX) {
        close(fd);
        return duet__error(DUET_BAD_MODEL, "gguf: '%s' is %lld bytes, not a GGUF file", path,
                           (long long)sb.st_size);
    }
    size_t size = (size_t)sb.st_size;
    void *map = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
    int e = errno;
    close(fd); /* the mapping keeps the file */
    if (map == MAP_FAILED) return duet__error(DUET_IO, "gguf: cannot mmap '%s': %s", path, strerror(e));
    duet_status st = open_common(map, size, true, out);
    if (st) {
        munmap(map, size);
        /* Name the file too: the parser's message only knows offsets. */
        char msg[1024];
        snprintf(msg, sizeof msg, "%s", duet_last_error());
        return duet__error(st, "%s (in '%s')", msg, path);
    }
    return DUET_OK;
}

void duet_gguf_close(duet_gguf *g) {
    if (!g) return;
    if (g->mapped) munmap((void *)g->base, (size_t)g->size);
    arena_free(g->arena);
    free(g);
}

/* ---- look-ups ----------------------------------------------------------- */

static int cmp_cstr(duet_gguf_str s, const char *k, size_t klen) {
    duet_gguf_str b = {k, klen};
    return str_cmp(s, b);
}

const duet_gguf_kv *duet_gguf_find(const duet_gguf *g, const char *key) {
    if (!g || !key) return NULL;
    const gguf_priv *priv = g->arena;
    size_t klen = strlen(key);
    uint64_t lo = 0, hi = g->n_kv;
    while (lo < hi) {
        uint64_t mid = lo + (hi - lo) / 2;
        int c = cmp_cstr(priv->kv_sorted[mid]->key, key, klen);
        if (c == 0) return priv->kv_sorted[mid];
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return NULL;
}

const duet_gguf_tensor *duet_gguf_find_tensor(const duet_gguf *g, const char *name) {
    if (!g || !name) return NULL;
    const gguf_priv *priv = g->arena;
    size_t nlen = strlen(name);
    uint64_t lo = 0, hi = g->n_tensors;
    while (lo < hi) {
        uint64_t mid = lo + (hi - lo) / 2;
        int c = cmp_cstr(priv->tensor_sorted[mid]->name, name, nlen);
        if (c == 0) return priv->tensor_sorted[mid];
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return NULL;
}

static bool is_unsigned_int(duet_gguf_type t) {
    return t == DUET_GGUF_UINT8 || t == DUET_GGUF_UINT16 || t == DUET_GGUF_UINT32 || t == DUET_GGUF_UINT64;
}

static bool is_signed_int(duet_gguf_type t) {
    return t == DUET_GGUF_INT8 || t == DUET_GGUF_INT16 || t == DUET_GGUF_INT32 || t == DUET_GGUF_INT64;
}

bool duet_gguf_get_u32(const duet_gguf *g, const char *key, uint32_t *out) {
    const duet_gguf_kv *kv = duet_gguf_find(g, key);
    if (!kv) return false;
    if (is_unsigned_int(kv->value.type) && kv->value.u64 <= UINT32_MAX) {
        *out = (uint32_t)kv->value.u64;
        return true;
    }
    if (is_signed_int(kv->value.type) && kv->value.i64 >= 0 && kv->value.i64 <= (int64_t)UINT32_MAX) {
        *out = (uint32_t)kv->value.i64;
        return true;
    }
    return false;
}

bool duet_gguf_get_i64(const duet_gguf *g, const char *key, int64_t *out) {
    const duet_gguf_kv *kv = duet_gguf_find(g, key);
    if (!kv) return false;
    if (is_signed_int(kv->value.type)) {
        *out = kv->value.i64;
        return true;
    }
    if (is_unsigned_int(kv->value.type) && kv->value.u64 <= (uint64_t)INT64_MAX) {
        *out = (int64_t)kv->value.u64;
        return true;
    }
    return false;
}

bool duet_gguf_get_f32(const duet_gguf *g, const char *key, float *out) {
    const duet_gguf_kv *kv = duet_gguf_find(g, key);
    if (!kv || (kv->value.type != DUET_GGUF_FLOAT32 && kv->value.type != DUET_GGUF_FLOAT64)) return false;
    *out = (float)kv->value.f64;
    return true;
}

bool duet_gguf_get_bool(const duet_gguf *g, const char *key, bool *out) {
    const duet_gguf_kv *kv = duet_gguf_find(g, key);
    if (!kv || kv->value.type != DUET_GGUF_BOOL) return false;
    *out = kv->value.u64 != 0;
    return true;
}

bool duet_gguf_get_str(const duet_gguf *g, const char *key, char *buf, size_t size) {
    const duet_gguf_kv *kv = duet_gguf_find(g, key);
    if (!kv || kv->value.type != DUET_GGUF_STRING) return false;
    if (size > 0) {
        size_t n = kv->value.str.len < size - 1 ? (size_t)kv->value.str.len : size - 1;
        if (n) memcpy(buf, kv->value.str.ptr, n);
        buf[n] = 0;
    }
    return true;
}

/* ---- writer ------------------------------------------------------------- */

typedef struct bytes {
    uint8_t *p;
    size_t len, cap;
    bool oom;
} bytes;

static void b_put(bytes *b, const void *src, size_t n) {
    if (b->oom || n == 0) return;
    if (b->cap - b->len < n) {
        size_t cap = b->cap ? b->cap : 64;
        while (cap - b->len < n) {
            if (cap > SIZE_MAX / 2) {
                b->oom = true;
                return;
            }
            cap *= 2;
        }
        uint8_t *p = realloc(b->p, cap);
        if (!p) {
            b->oom = true;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->len, src, n);
    b->len += n;
}

static void b_u32(bytes *b, uint32_t v) {
    uint8_t t[4] = {(uint8_t)v, (uint8_t)(v >> 8), (uint8_t)(v >> 16), (uint8_t)(v >> 24)};
    b_put(b, t, 4);
}

static void b_u64(bytes *b, uint64_t v) {
    b_u32(b, (uint32_t)v);
    b_u32(b, (uint32_t)(v >> 32));
}

static void b_str(bytes *b, const char *s, uint64_t len) {
    b_u64(b, len);
    b_put(b, s, (size_t)len);
}

typedef struct wkv {
    char *key;
    size_t key_len; /* keys copied from a file may hold NUL bytes */
    bytes val;      /* type tag + encoded value */
} wkv;

typedef struct wtensor {
    char *name;
    duet_dtype type;
    int n_dims;
    int64_t ne[DUET_GGUF_MAX_DIMS];
    uint64_t size;
    const void *data;
    void *owned;
} wtensor;

struct duet_gguf_writer {
    wkv *kv;
    size_t n_kv, cap_kv;
    wtensor *t;
    size_t n_t, cap_t;
    /* First failure in a setter (they return void); write() reports it. */
    duet_status err;
    char errmsg[512];
};

__attribute__((format(printf, 3, 4))) static void w_fail(duet_gguf_writer *w, duet_status st, const char *fmt,
                                                         ...) {
    if (w->err) return;
    w->err = st;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(w->errmsg, sizeof w->errmsg, fmt, ap);
    va_end(ap);
}

duet_gguf_writer *duet_gguf_writer_new(void) {
    return calloc(1, sizeof(duet_gguf_writer));
}

void duet_gguf_writer_free(duet_gguf_writer *w) {
    if (!w) return;
    for (size_t i = 0; i < w->n_kv; i++) {
        free(w->kv[i].key);
        free(w->kv[i].val.p);
    }
    for (size_t i = 0; i < w->n_t; i++) {
        free(w->t[i].name);
        free(w->t[i].owned);
    }
    free(w->kv);
    free(w->t);
    free(w);
}

/* Stores an encoded value under key, replacing an existing one (so a copied
 * key can be overridden). Takes ownership of val's buffer. */
static void w_put_kv(duet_gguf_writer *w, const char *key, size_t key_len, bytes val) {
    if (val.oom) {
        free(val.p);
        w_fail(w, DUET_OUT_OF_MEMORY, "gguf writer: out of memory encoding key '%.*s'", (int)key_len, key);
        return;
    }
    if (key_len == 0) {
        free(val.p);
        w_fail(w, DUET_INVALID_ARGUMENT, "gguf writer: empty key");
        return;
    }
    for (size_t i = 0; i < w->n_kv; i++) {
        if (w->kv[i].key_len == key_len && memcmp(w->kv[i].key, key, key_len) == 0) {
            free(w->kv[i].val.p);
            w->kv[i].val = val;
            return;
        }
    }
    if (w->n_kv == w->cap_kv) {
        size_t cap = w->cap_kv ? w->cap_kv * 2 : 16;
        wkv *kv = realloc(w->kv, cap * sizeof *kv);
        if (!kv) goto oom;
        w->kv = kv;
        w->cap_kv = cap;
    }
    char *k = malloc(key_len + 1);
    if (!k) goto oom;
    memcpy(k, key, key_len);
    k[key_len] = 0;
    w->kv[w->n_kv].key = k;
    w->kv[w->n_kv].key_len = key_len;
    w->kv[w->n_kv].val = val;
    w->n_kv++;
    return;
oom:
    free(val.p);
    w_fail(w, DUET_OUT_OF_MEMORY, "gguf writer: out of memory adding key '%.*s'", (int)key_len, key);
}

static void set_scalar(duet_gguf_writer *w, const char *key, duet_gguf_type t, const void *le_bytes) {
    if (!w || !key) return;
    bytes b = {0};
    b_u32(&b, t);
    b_put(&b, le_bytes, (size_t)scalar_size(t));
    w_put_kv(w, key, strlen(key), b);
}

/* Host values to little-endian bytes. */
static void to_le(void *dst, uint64_t v, size_t n) {
    uint8_t *d = dst;
    for (size_t i = 0; i < n; i++)
        d[i] = (uint8_t)(v >> (8 * i));
}

void duet_gguf_set_u32(duet_gguf_writer *w, const char *key, uint32_t v) {
    uint8_t b[4];
    to_le(b, v, 4);
    set_scalar(w, key, DUET_GGUF_UINT32, b);
}

void duet_gguf_set_i32(duet_gguf_writer *w, const char *key, int32_t v) {
    uint8_t b[4];
    to_le(b, (uint32_t)v, 4);
    set_scalar(w, key, DUET_GGUF_INT32, b);
}

void duet_gguf_set_u64(duet_gguf_writer *w, const char *key, uint64_t v) {
    uint8_t b[8];
    to_le(b, v, 8);
    set_scalar(w, key, DUET_GGUF_UINT64, b);
}

void duet_gguf_set_f32(duet_gguf_writer *w, const char *key, float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    uint8_t b[4];
    to_le(b, u, 4);
    set_scalar(w, key, DUET_GGUF_FLOAT32, b);
}

void duet_gguf_set_bool(duet_gguf_writer *w, const char *key, bool v) {
    uint8_t b = v ? 1 : 0;
    set_scalar(w, key, DUET_GGUF_BOOL, &b);
}

void duet_gguf_set_str(duet_gguf_writer *w, const char *key, const char *v) {
    if (!w || !key || !v) return;
    bytes b = {0};
    b_u32(&b, DUET_GGUF_STRING);
    b_str(&b, v, strlen(v));
    w_put_kv(w, key, strlen(key), b);
}

void duet_gguf_writer_set_alignment(duet_gguf_writer *w, uint32_t alignment) {
    if (!w) return;
    if (!is_pow2(alignment)) {
        w_fail(w, DUET_INVALID_ARGUMENT, "gguf writer: alignment %u is not a nonzero power of two",
               alignment);
        return;
    }
    /* The key is what readers go by, so the alignment lives only there. */
    duet_gguf_set_u32(w, "general.alignment", alignment);
}

/* Encodes n elements of scalar type t from host memory as little-endian. */
static void b_scalars(bytes *b, duet_gguf_type t, const void *data, uint64_t n) {
    size_t sz = (size_t)scalar_size(t);
    const uint8_t *s = data;
    for (uint64_t i = 0; i < n; i++, s += sz) {
        uint64_t v = 0;
        switch (sz) {
        case 1:
            v = s[0];
            break;
        case 2: {
            uint16_t x;
            memcpy(&x, s, 2);
            v = x;
            break;
        }
        case 4: {
            uint32_t x;
            memcpy(&x, s, 4);
            v = x;
            break;
        }
        default:
            memcpy(&v, s, 8);
            break;
        }
        uint8_t le[8]; /* all eight bytes, then the low sz of them */
        to_le(le, v, sizeof le);
        b_put(b, le, sz);
    }
}

void duet_gguf_set_array(duet_gguf_writer *w, const char *key, duet_gguf_type type, const void *data,
                         uint64_t n) {
    if (!w || !key) return;
    if (scalar_size(type) == 0) {
        w_fail(w, DUET_INVALID_ARGUMENT,
               "gguf writer: key '%s': set_array takes scalar element types, not %s", key,
               duet_gguf_type_name(type));
        return;
    }
    if (n > 0 && !data) {
        w_fail(w, DUET_INVALID_ARGUMENT, "gguf writer: key '%s': NULL array data", key);
        return;
    }
    bytes b = {0};
    b_u32(&b, DUET_GGUF_ARRAY);
    b_u32(&b, type);
    b_u64(&b, n);
    b_scalars(&b, type, data, n);
    w_put_kv(w, key, strlen(key), b);
}

void duet_gguf_set_str_array(duet_gguf_writer *w, const char *key, const char *const *strs, uint64_t n) {
    if (!w || !key) return;
    bytes b = {0};
    b_u32(&b, DUET_GGUF_ARRAY);
    b_u32(&b, DUET_GGUF_STRING);
    b_u64(&b, n);
    for (uint64_t i = 0; i < n; i++) {
        const char *s = strs[i] ? strs[i] : "";
        b_str(&b, s, strlen(s));
    }
    w_put_kv(w, key, strlen(key), b);
}

/* Encodes a reader's array value body (element type, count, elements). */
static void b_array_from(bytes *b, const duet_gguf_value *v) {
    b_u32(b, v->arr.type);
    b_u64(b, v->arr.n);
    if (v->arr.type == DUET_GGUF_STRING) {
        for (uint64_t i = 0; i < v->arr.n; i++)
            b_str(b, v->arr.strs[i].ptr, v->arr.strs[i].len);
    } else if (v->arr.type == DUET_GGUF_ARRAY) {
        for (uint64_t i = 0; i < v->arr.n; i++)
            b_array_from(b, &v->arr.arrays[i]);
    } else {
        /* Raw file bytes: already little-endian. */
        b_put(b, v->arr.data, (size_t)(v->arr.n * scalar_size(v->arr.type)));
    }
}

static void b_value_from(bytes *b, const duet_gguf_value *v) {
    b_u32(b, v->type);
    uint8_t le[8];
    switch (v->type) {
    case DUET_GGUF_STRING:
        b_str(b, v->str.ptr, v->str.len);
        return;
    case DUET_GGUF_ARRAY:
        b_array_from(b, v);
        return;
    case DUET_GGUF_FLOAT32: {
        float f = (float)v->f64;
        uint32_t u;
        memcpy(&u, &f, 4);
        to_le(le, u, 4);
        break;
    }
    case DUET_GGUF_FLOAT64: {
        uint64_t u;
        memcpy(&u, &v->f64, 8);
        to_le(le, u, 8);
        break;
    }
    default:
        /* Integers and bool: the widened value's low bytes. */
        to_le(le, v->u64, 8);
        break;
    }
    b_put(b, le, (size_t)scalar_size(v->type));
}

void duet_gguf_copy_kv(duet_gguf_writer *w, const duet_gguf *g) {
    if (!w || !g) return;
    for (uint64_t i = 0; i < g->n_kv; i++) {
        bytes b = {0};
        b_value_from(&b, &g->kv[i].value);
        w_put_kv(w, g->kv[i].key.ptr, (size_t)g->kv[i].key.len, b);
    }
}

void duet_gguf_add_tensor(duet_gguf_writer *w, const char *name, duet_dtype type, int n_dims,
                          const int64_t *ne, const void *data, bool borrow) {
    if (!w) return;
    if (!name || !*name) {
        w_fail(w, DUET_INVALID_ARGUMENT, "gguf writer: tensor without a name");
        return;
    }
    if (n_dims < 1 || n_dims > DUET_GGUF_MAX_DIMS || !ne) {
        w_fail(w, DUET_INVALID_ARGUMENT, "gguf writer: tensor '%s': n_dims %d out of range (1..%d)", name,
               n_dims, DUET_GGUF_MAX_DIMS);
        return;
    }
    if (!dtype_supported(type)) {
        w_fail(w, DUET_INVALID_ARGUMENT, "gguf writer: tensor '%s': unsupported type %d", name, (int)type);
        return;
    }
    uint64_t nelem = 1;
    for (int d = 0; d < n_dims; d++) {
        if (ne[d] <= 0 || mul_ovf(nelem, (uint64_t)ne[d], &nelem) || nelem > (uint64_t)INT64_MAX) {
            w_fail(w, DUET_INVALID_ARGUMENT, "gguf writer: tensor '%s': bad dimension ne[%d] = %lld", name, d,
                   (long long)ne[d]);
            return;
        }
    }
    uint64_t block = (uint64_t)duet_dtype_block(type), size;
    if ((uint64_t)ne[0] % block != 0) {
        w_fail(w, DUET_INVALID_ARGUMENT,
               "gguf writer: tensor '%s': ne[0] = %lld is not a multiple of the %s block size %llu", name,
               (long long)ne[0], ggml_type_name(type), (unsigned long long)block);
        return;
    }
    if (mul_ovf(nelem / block, duet_dtype_block_bytes(type), &size) || size > SIZE_MAX) {
        w_fail(w, DUET_INVALID_ARGUMENT, "gguf writer: tensor '%s': size overflows", name);
        return;
    }
    if (!data) {
        w_fail(w, DUET_INVALID_ARGUMENT, "gguf writer: tensor '%s': NULL data", name);
        return;
    }
    for (size_t i = 0; i < w->n_t; i++) {
        if (strcmp(w->t[i].name, name) == 0) {
            w_fail(w, DUET_INVALID_ARGUMENT, "gguf writer: duplicate tensor name '%s'", name);
            return;
        }
    }
    if (w->n_t == w->cap_t) {
        size_t cap = w->cap_t ? w->cap_t * 2 : 16;
        wtensor *t = realloc(w->t, cap * sizeof *t);
        if (!t) goto oom;
        w->t = t;
        w->cap_t = cap;
    }
    wtensor *t = &w->t[w->n_t];
    memset(t, 0, sizeof *t);
    t->name = strdup(name);
    if (!t->name) goto oom;
    if (!borrow) {
        t->owned = malloc(size ? (size_t)size : 1);
        if (!t->owned) {
            free(t->name);
            goto oom;
        }
        memcpy(t->owned, data, (size_t)size);
        data = t->owned;
    }
    t->type = type;
    t->n_dims = n_dims;
    for (int d = 0; d < DUET_GGUF_MAX_DIMS; d++)
        t->ne[d] = d < n_dims ? ne[d] : 1;
    t->size = size;
    t->data = data;
    w->n_t++;
    return;
oom:
    w_fail(w, DUET_OUT_OF_MEMORY, "gguf writer: out of memory adding tensor '%s'", name);
}

static bool write_all(FILE *f, const void *p, size_t n) {
    return n == 0 || fwrite(p, 1, n, f) == n;
}

static bool write_pad(FILE *f, uint64_t pos, uint64_t align) {
    static const uint8_t zeros[256];
    uint64_t pad = (align - pos % align) % align;
    while (pad > 0) {
        size_t n = pad < sizeof zeros ? (size_t)pad : sizeof zeros;
        if (!write_all(f, zeros, n)) return false;
        pad -= n;
    }
    return true;
}

duet_status duet_gguf_write(duet_gguf_writer *w, const char *path) {
    if (!w || !path) return duet__error(DUET_INVALID_ARGUMENT, "gguf writer: NULL argument");
    if (w->err) return duet__error(w->err, "%s", w->errmsg);

    /* The alignment is whatever general.alignment says (set, or copied). */
    uint64_t align = GGUF_DEFAULT_ALIGNMENT;
    for (size_t i = 0; i < w->n_kv; i++) {
        if (w->kv[i].key_len != 17 || memcmp(w->kv[i].key, "general.alignment", 17) != 0) continue;
        const bytes *v = &w->kv[i].val;
        if (v->len != 8 || le32(v->p) != DUET_GGUF_UINT32 || !is_pow2(le32(v->p + 4)))
            return duet__error(DUET_INVALID_ARGUMENT,
                               "gguf writer: general.alignment must be a uint32 nonzero power of two");
        align = le32(v->p + 4);
    }

    /* Header, metadata and tensor infos are built in memory; data streams. */
    bytes h = {0};
    b_put(&h, GGUF_MAGIC, 4);
    b_u32(&h, 3);
    b_u64(&h, w->n_t);
    b_u64(&h, w->n_kv);
    for (size_t i = 0; i < w->n_kv; i++) {
        b_str(&h, w->kv[i].key, w->kv[i].key_len);
        b_put(&h, w->kv[i].val.p, w->kv[i].val.len);
    }
    uint64_t off = 0;
    for (size_t i = 0; i < w->n_t; i++) {
        const wtensor *t = &w->t[i];
        b_str(&h, t->name, strlen(t->name));
        b_u32(&h, (uint32_t)t->n_dims);
        for (int d = 0; d < t->n_dims; d++)
            b_u64(&h, (uint64_t)t->ne[d]);
        b_u32(&h, t->type);
        b_u64(&h, off);
        if (add_ovf(off, t->size, &off) || !align_up(off, align, &off)) {
            free(h.p);
            return duet__error(DUET_INVALID_ARGUMENT, "gguf writer: total data size overflows");
        }
    }
    if (h.oom) {
        free(h.p);
        return duet__error(DUET_OUT_OF_MEMORY, "gguf writer: out of memory building the header");
    }

    FILE *f = fopen(path, "wb");
    if (!f) {
        free(h.p);
        return duet__error(DUET_IO, "gguf writer: cannot create '%s': %s", path, strerror(errno));
    }
    /* A file without tensors ends after its infos, like vocab-only files. */
    bool ok = write_all(f, h.p, h.len) && (w->n_t == 0 || write_pad(f, h.len, align));
    for (size_t i = 0; ok && i < w->n_t; i++)
        ok = write_all(f, w->t[i].data, (size_t)w->t[i].size) && write_pad(f, w->t[i].size, align);
    free(h.p);
    int e = ok ? 0 : errno;
    if (fclose(f) != 0 && ok) {
        ok = false;
        e = errno;
    }
    if (!ok) {
        remove(path);
        return duet__error(DUET_IO, "gguf writer: cannot write '%s': %s", path, strerror(e));
    }
    return DUET_OK;
}
