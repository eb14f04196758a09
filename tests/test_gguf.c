/* test_gguf.c — GGUF reader on the shared models, writer round trip, and a
 * malformed-file corpus made from a valid file (truncations, absurd counts,
 * bad types, bad tensors, duplicates, random mutations).
 *
 * The round-trip sample is also written to DUET_BINARY_DIR/gguf_sample.gguf,
 * which tests/test_gguf_pyref.py reads with the reference Python reader; the
 * expected values below and in that script must stay in step.
 */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <sys/stat.h>

#include "gguf.h"
#include "test_util.h"

/* ---- a little-endian byte builder for hand-made files --------------------- */

typedef struct bb {
    uint8_t *p;
    size_t len, cap;
} bb;

static void bb_put(bb *b, const void *src, size_t n) {
    if (b->len + n > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n)
            cap *= 2;
        b->p = realloc(b->p, cap);
        ck_assert_ptr_nonnull(b->p);
        b->cap = cap;
    }
    if (n) memcpy(b->p + b->len, src, n);
    b->len += n;
}
static void bb_u8(bb *b, uint8_t v) {
    bb_put(b, &v, 1);
}
static void bb_u16(bb *b, uint16_t v) {
    uint8_t t[2] = {(uint8_t)v, (uint8_t)(v >> 8)};
    bb_put(b, t, 2);
}
static void bb_u32(bb *b, uint32_t v) {
    bb_u16(b, (uint16_t)v);
    bb_u16(b, (uint16_t)(v >> 16));
}
static void bb_u64(bb *b, uint64_t v) {
    bb_u32(b, (uint32_t)v);
    bb_u32(b, (uint32_t)(v >> 32));
}
static void bb_str(bb *b, const char *s) {
    bb_u64(b, strlen(s));
    bb_put(b, s, strlen(s));
}
static void bb_header(bb *b, uint32_t version, uint64_t n_tensors, uint64_t n_kv) {
    bb_put(b, "GGUF", 4);
    bb_u32(b, version);
    bb_u64(b, n_tensors);
    bb_u64(b, n_kv);
}

static void put_u32_at(uint8_t *p, uint64_t off, uint32_t v) {
    for (int i = 0; i < 4; i++)
        p[off + i] = (uint8_t)(v >> (8 * i));
}
static void put_u64_at(uint8_t *p, uint64_t off, uint64_t v) {
    for (int i = 0; i < 8; i++)
        p[off + i] = (uint8_t)(v >> (8 * i));
}

/* ---- the round-trip sample -------------------------------------------------- */

/* Values shared with test_gguf_pyref.py. */
static const uint8_t ARR_U8[] = {1, 2, 255};
static const int8_t ARR_I8[] = {-1, 0, 1, -128};
static const uint16_t ARR_U16[] = {0, 65535};
static const int16_t ARR_I16[] = {-32768, 32767, 5};
static const uint32_t ARR_U32[] = {7, 4000000000u};
static const int32_t ARR_I32[] = {-2000000000, 2000000000, 0};
static const float ARR_F32[] = {0.25f, -1.5f};
static const uint8_t ARR_BOOL[] = {1, 0, 1};
static const uint64_t ARR_U64[] = {UINT64_MAX, 1};
static const int64_t ARR_I64[] = {INT64_MIN, -1};
static const double ARR_F64[] = {1e300, -0.125};
static const char *const STRS[] = {"", "x", "hello world", "\xc3\xbcn\xc3\xaf"};

typedef struct sample_tensor {
    const char *name;
    duet_dtype type;
    int n_dims;
    int64_t ne[4];
    size_t size;
} sample_tensor;

/* Data of tensor k is byte i = (i*31 + k*7) & 0xff. */
static const sample_tensor TENSORS[] = {
    {"f32", DUET_DTYPE_F32, 2, {4, 3, 1, 1}, 4 * 3 * 4},
    {"f16", DUET_DTYPE_F16, 2, {8, 2, 1, 1}, 8 * 2 * 2},
    {"bf16", DUET_DTYPE_BF16, 1, {5, 1, 1, 1}, 5 * 2},
    {"q8_0", DUET_DTYPE_Q8_0, 2, {64, 2, 1, 1}, 2 * 2 * 34},
    {"i32", DUET_DTYPE_I32, 4, {2, 3, 1, 2}, 2 * 3 * 1 * 2 * 4},
};
#define N_TENSORS (int)(sizeof TENSORS / sizeof TENSORS[0])

static uint8_t *tensor_bytes(int k, size_t n) {
    uint8_t *p = malloc(n);
    ck_assert_ptr_nonnull(p);
    for (size_t i = 0; i < n; i++)
        p[i] = (uint8_t)((i * 31 + (size_t)k * 7) & 0xff);
    return p;
}

/* Keys the setters cannot make (8/16-bit scalars, i64, f64, nested arrays)
 * come from a hand-made file through duet_gguf_copy_kv. */
#define N_SOURCE_KV 9
static bb source_file(void) {
    bb b = {0};
    bb_header(&b, 3, 0, N_SOURCE_KV);
    bb_str(&b, "t.u8"), bb_u32(&b, DUET_GGUF_UINT8), bb_u8(&b, 200);
    bb_str(&b, "t.i8"), bb_u32(&b, DUET_GGUF_INT8), bb_u8(&b, (uint8_t)-100);
    bb_str(&b, "t.u16"), bb_u32(&b, DUET_GGUF_UINT16), bb_u16(&b, 60000);
    bb_str(&b, "t.i16"), bb_u32(&b, DUET_GGUF_INT16), bb_u16(&b, (uint16_t)-30000);
    bb_str(&b, "t.i64"), bb_u32(&b, DUET_GGUF_INT64), bb_u64(&b, (uint64_t)-5000000000LL);
    double pi = 3.141592653589793;
    uint64_t u;
    memcpy(&u, &pi, 8);
    bb_str(&b, "t.f64"), bb_u32(&b, DUET_GGUF_FLOAT64), bb_u64(&b, u);
    /* [[1,2,3],[],[4]] of int32 */
    bb_str(&b, "t.nested"), bb_u32(&b, DUET_GGUF_ARRAY), bb_u32(&b, DUET_GGUF_ARRAY), bb_u64(&b, 3);
    bb_u32(&b, DUET_GGUF_INT32), bb_u64(&b, 3), bb_u32(&b, 1), bb_u32(&b, 2), bb_u32(&b, 3);
    bb_u32(&b, DUET_GGUF_INT32), bb_u64(&b, 0);
    bb_u32(&b, DUET_GGUF_INT32), bb_u64(&b, 1), bb_u32(&b, 4);
    /* [["a","bc"],["def"]] */
    bb_str(&b, "t.nested_str"), bb_u32(&b, DUET_GGUF_ARRAY), bb_u32(&b, DUET_GGUF_ARRAY), bb_u64(&b, 2);
    bb_u32(&b, DUET_GGUF_STRING), bb_u64(&b, 2), bb_str(&b, "a"), bb_str(&b, "bc");
    bb_u32(&b, DUET_GGUF_STRING), bb_u64(&b, 1), bb_str(&b, "def");
    /* [[[7]]] of uint16 */
    bb_str(&b, "t.deep"), bb_u32(&b, DUET_GGUF_ARRAY), bb_u32(&b, DUET_GGUF_ARRAY), bb_u64(&b, 1);
    bb_u32(&b, DUET_GGUF_ARRAY), bb_u64(&b, 1), bb_u32(&b, DUET_GGUF_UINT16), bb_u64(&b, 1), bb_u16(&b, 7);
    return b;
}

#define N_SET_KV 23

/* Builds the sample writer: copied keys, then one key per setter, then the
 * tensors. alignment 0 = default (no general.alignment key). */
static duet_gguf_writer *sample_writer(uint32_t alignment, duet_gguf **src_out) {
    bb src = source_file();
    duet_gguf *src_g = NULL;
    duet_status st = duet_gguf_open_memory(src.p, src.len, &src_g);
    ck_assert_msg(st == DUET_OK, "hand-made source file rejected: %s", duet_last_error());
    duet_gguf_writer *w = duet_gguf_writer_new();
    ck_assert_ptr_nonnull(w);
    duet_gguf_copy_kv(w, src_g);
    duet_gguf_set_str(w, "general.architecture", "test");
    duet_gguf_set_u32(w, "t.u32", 4000000000u);
    duet_gguf_set_i32(w, "t.i32", -2000000000);
    duet_gguf_set_u64(w, "t.u64", (1ull << 60) + 1);
    duet_gguf_set_f32(w, "t.f32", 0.5f);
    duet_gguf_set_bool(w, "t.bool", true);
    duet_gguf_set_bool(w, "t.bool_false", false);
    duet_gguf_set_str(w, "t.str", "hello, gguf \xe2\x9c\x93");
    duet_gguf_set_str(w, "t.empty_str", "");
    duet_gguf_set_array(w, "t.arr.u8", DUET_GGUF_UINT8, ARR_U8, 3);
    duet_gguf_set_array(w, "t.arr.i8", DUET_GGUF_INT8, ARR_I8, 4);
    duet_gguf_set_array(w, "t.arr.u16", DUET_GGUF_UINT16, ARR_U16, 2);
    duet_gguf_set_array(w, "t.arr.i16", DUET_GGUF_INT16, ARR_I16, 3);
    duet_gguf_set_array(w, "t.arr.u32", DUET_GGUF_UINT32, ARR_U32, 2);
    duet_gguf_set_array(w, "t.arr.i32", DUET_GGUF_INT32, ARR_I32, 3);
    duet_gguf_set_array(w, "t.arr.f32", DUET_GGUF_FLOAT32, ARR_F32, 2);
    duet_gguf_set_array(w, "t.arr.bool", DUET_GGUF_BOOL, ARR_BOOL, 3);
    duet_gguf_set_array(w, "t.arr.u64", DUET_GGUF_UINT64, ARR_U64, 2);
    duet_gguf_set_array(w, "t.arr.i64", DUET_GGUF_INT64, ARR_I64, 2);
    duet_gguf_set_array(w, "t.arr.f64", DUET_GGUF_FLOAT64, ARR_F64, 2);
    duet_gguf_set_array(w, "t.arr.empty", DUET_GGUF_UINT32, NULL, 0);
    duet_gguf_set_str_array(w, "t.strs", STRS, 4);
    /* Replacing a key keeps one entry with the new value. */
    duet_gguf_set_u32(w, "t.replaced", 1);
    duet_gguf_set_u32(w, "t.replaced", 2);
    if (alignment) duet_gguf_writer_set_alignment(w, alignment);
    for (int k = 0; k < N_TENSORS; k++) {
        uint8_t *d = tensor_bytes(k, TENSORS[k].size);
        /* Copied: the buffer is freed right away. */
        duet_gguf_add_tensor(w, TENSORS[k].name, TENSORS[k].type, TENSORS[k].n_dims, TENSORS[k].ne, d, false);
        free(d);
    }
    if (src_out) {
        *src_out = src_g;
    } else {
        duet_gguf_close(src_g);
    }
    free(src.p);
    return w;
}

static const duet_gguf_kv *must_find(const duet_gguf *g, const char *key, duet_gguf_type type) {
    const duet_gguf_kv *kv = duet_gguf_find(g, key);
    ck_assert_msg(kv != NULL, "key '%s' missing", key);
    ck_assert_msg(kv->value.type == type, "key '%s' has type %s, expected %s", key,
                  duet_gguf_type_name(kv->value.type), duet_gguf_type_name(type));
    return kv;
}

static bool str_eq(duet_gguf_str s, const char *c) {
    return s.len == strlen(c) && memcmp(s.ptr, c, s.len) == 0;
}

static void check_scalar_array(const duet_gguf *g, const char *key, duet_gguf_type et, const void *expect,
                               uint64_t n, size_t esz) {
    const duet_gguf_kv *kv = must_find(g, key, DUET_GGUF_ARRAY);
    ck_assert_msg(kv->value.arr.type == et, "%s: element type %s", key,
                  duet_gguf_type_name(kv->value.arr.type));
    ck_assert_msg(kv->value.arr.n == n, "%s: %llu elements, expected %llu", key,
                  (unsigned long long)kv->value.arr.n, (unsigned long long)n);
    ck_assert_msg(n == 0 || memcmp(kv->value.arr.data, expect, n * esz) == 0, "%s: elements differ", key);
    ck_assert_msg((uintptr_t)kv->value.arr.data % esz == 0, "%s: data not aligned for direct indexing", key);
}

/* Checks every key and tensor of a file written by sample_writer. */
static void check_sample(const duet_gguf *g, uint32_t alignment) {
    ck_assert_uint_eq(g->version, 3);
    uint64_t want_kv = N_SOURCE_KV + N_SET_KV + (alignment ? 1 : 0);
    ck_assert_msg(g->n_kv == want_kv, "n_kv %llu, expected %llu", (unsigned long long)g->n_kv,
                  (unsigned long long)want_kv);
    ck_assert_uint_eq(g->alignment, alignment ? alignment : 32);
    ck_assert_msg(g->data_offset % g->alignment == 0, "data_offset %llu not aligned",
                  (unsigned long long)g->data_offset);

    ck_assert_uint_eq(must_find(g, "t.u8", DUET_GGUF_UINT8)->value.u64, 200);
    ck_assert_int_eq(must_find(g, "t.i8", DUET_GGUF_INT8)->value.i64, -100);
    ck_assert_uint_eq(must_find(g, "t.u16", DUET_GGUF_UINT16)->value.u64, 60000);
    ck_assert_int_eq(must_find(g, "t.i16", DUET_GGUF_INT16)->value.i64, -30000);
    ck_assert_int_eq(must_find(g, "t.i64", DUET_GGUF_INT64)->value.i64, -5000000000LL);
    ck_assert(must_find(g, "t.f64", DUET_GGUF_FLOAT64)->value.f64 == 3.141592653589793);
    ck_assert_uint_eq(must_find(g, "t.u32", DUET_GGUF_UINT32)->value.u64, 4000000000u);
    ck_assert_int_eq(must_find(g, "t.i32", DUET_GGUF_INT32)->value.i64, -2000000000);
    ck_assert_uint_eq(must_find(g, "t.u64", DUET_GGUF_UINT64)->value.u64, (1ull << 60) + 1);
    ck_assert(must_find(g, "t.f32", DUET_GGUF_FLOAT32)->value.f64 == 0.5);
    ck_assert_uint_eq(must_find(g, "t.bool", DUET_GGUF_BOOL)->value.u64, 1);
    ck_assert_uint_eq(must_find(g, "t.bool_false", DUET_GGUF_BOOL)->value.u64, 0);
    ck_assert(str_eq(must_find(g, "t.str", DUET_GGUF_STRING)->value.str, "hello, gguf \xe2\x9c\x93"));
    ck_assert(str_eq(must_find(g, "t.empty_str", DUET_GGUF_STRING)->value.str, ""));
    ck_assert(str_eq(must_find(g, "general.architecture", DUET_GGUF_STRING)->value.str, "test"));
    ck_assert_uint_eq(must_find(g, "t.replaced", DUET_GGUF_UINT32)->value.u64, 2);
    if (alignment)
        ck_assert_uint_eq(must_find(g, "general.alignment", DUET_GGUF_UINT32)->value.u64, alignment);

    check_scalar_array(g, "t.arr.u8", DUET_GGUF_UINT8, ARR_U8, 3, 1);
    check_scalar_array(g, "t.arr.i8", DUET_GGUF_INT8, ARR_I8, 4, 1);
    check_scalar_array(g, "t.arr.u16", DUET_GGUF_UINT16, ARR_U16, 2, 2);
    check_scalar_array(g, "t.arr.i16", DUET_GGUF_INT16, ARR_I16, 3, 2);
    check_scalar_array(g, "t.arr.u32", DUET_GGUF_UINT32, ARR_U32, 2, 4);
    check_scalar_array(g, "t.arr.i32", DUET_GGUF_INT32, ARR_I32, 3, 4);
    check_scalar_array(g, "t.arr.f32", DUET_GGUF_FLOAT32, ARR_F32, 2, 4);
    check_scalar_array(g, "t.arr.bool", DUET_GGUF_BOOL, ARR_BOOL, 3, 1);
    check_scalar_array(g, "t.arr.u64", DUET_GGUF_UINT64, ARR_U64, 2, 8);
    check_scalar_array(g, "t.arr.i64", DUET_GGUF_INT64, ARR_I64, 2, 8);
    check_scalar_array(g, "t.arr.f64", DUET_GGUF_FLOAT64, ARR_F64, 2, 8);
    check_scalar_array(g, "t.arr.empty", DUET_GGUF_UINT32, NULL, 0, 4);

    const duet_gguf_kv *kv = must_find(g, "t.strs", DUET_GGUF_ARRAY);
    ck_assert_int_eq(kv->value.arr.type, DUET_GGUF_STRING);
    ck_assert_uint_eq(kv->value.arr.n, 4);
    for (int i = 0; i < 4; i++)
        ck_assert_msg(str_eq(kv->value.arr.strs[i], STRS[i]), "t.strs[%d] differs", i);

    kv = must_find(g, "t.nested", DUET_GGUF_ARRAY);
    ck_assert_int_eq(kv->value.arr.type, DUET_GGUF_ARRAY);
    ck_assert_uint_eq(kv->value.arr.n, 3);
    const duet_gguf_value *a = kv->value.arr.arrays;
    ck_assert(a[0].type == DUET_GGUF_ARRAY && a[0].arr.type == DUET_GGUF_INT32 && a[0].arr.n == 3);
    ck_assert(a[1].arr.type == DUET_GGUF_INT32 && a[1].arr.n == 0);
    ck_assert(a[2].arr.type == DUET_GGUF_INT32 && a[2].arr.n == 1);
    const int32_t *x = a[0].arr.data;
    ck_assert(x[0] == 1 && x[1] == 2 && x[2] == 3);
    ck_assert_int_eq(((const int32_t *)a[2].arr.data)[0], 4);

    kv = must_find(g, "t.nested_str", DUET_GGUF_ARRAY);
    ck_assert(kv->value.arr.type == DUET_GGUF_ARRAY && kv->value.arr.n == 2);
    a = kv->value.arr.arrays;
    ck_assert(a[0].arr.type == DUET_GGUF_STRING && a[0].arr.n == 2);
    ck_assert(str_eq(a[0].arr.strs[0], "a") && str_eq(a[0].arr.strs[1], "bc"));
    ck_assert(a[1].arr.n == 1 && str_eq(a[1].arr.strs[0], "def"));

    kv = must_find(g, "t.deep", DUET_GGUF_ARRAY);
    ck_assert(kv->value.arr.type == DUET_GGUF_ARRAY && kv->value.arr.n == 1);
    a = &kv->value.arr.arrays[0];
    ck_assert(a->arr.type == DUET_GGUF_ARRAY && a->arr.n == 1);
    a = &a->arr.arrays[0];
    ck_assert(a->arr.type == DUET_GGUF_UINT16 && a->arr.n == 1);
    ck_assert_uint_eq(((const uint16_t *)a->arr.data)[0], 7);

    ck_assert_uint_eq(g->n_tensors, N_TENSORS);
    for (int k = 0; k < N_TENSORS; k++) {
        const duet_gguf_tensor *t = duet_gguf_find_tensor(g, TENSORS[k].name);
        ck_assert_msg(t != NULL, "tensor '%s' missing", TENSORS[k].name);
        ck_assert_msg(t == &g->tensors[k], "tensor '%s' out of order", TENSORS[k].name);
        ck_assert_int_eq(t->type, TENSORS[k].type);
        ck_assert_int_eq(t->n_dims, TENSORS[k].n_dims);
        for (int d = 0; d < 4; d++)
            ck_assert_int_eq(t->ne[d], TENSORS[k].ne[d]);
        ck_assert_uint_eq(t->size, TENSORS[k].size);
        ck_assert_msg(t->offset % g->alignment == 0, "tensor '%s' offset %llu unaligned", TENSORS[k].name,
                      (unsigned long long)t->offset);
        ck_assert_ptr_eq(t->data, g->base + g->data_offset + t->offset);
        uint8_t *d = tensor_bytes(k, TENSORS[k].size);
        ck_assert_msg(memcmp(t->data, d, t->size) == 0, "tensor '%s' data differs", TENSORS[k].name);
        free(d);
    }
    ck_assert_ptr_null(duet_gguf_find_tensor(g, "nope"));
    ck_assert_ptr_null(duet_gguf_find(g, "nope"));
}

static const char *tmp_path(const char *name) {
    static char buf[4][4096];
    static int slot;
    char *out = buf[slot++ & 3];
    /* The pid keeps concurrent runs (ctest -j, the pyref script) apart. */
    snprintf(out, sizeof buf[0], "%s/%d_%s", DUET_BINARY_DIR, (int)getpid(), name);
    return out;
}

/* Writes the sample and returns its bytes. */
static uint8_t *write_sample(uint32_t alignment, const char *path, size_t *len) {
    duet_gguf_writer *w = sample_writer(alignment, NULL);
    duet_status st = duet_gguf_write(w, path);
    ck_assert_msg(st == DUET_OK, "write %s: %s", path, duet_last_error());
    duet_gguf_writer_free(w);
    uint8_t *b = (uint8_t *)test_read_file(path, len);
    ck_assert_msg(b != NULL, "cannot read back %s", path);
    return b;
}

/* ---- shared models ------------------------------------------------------ */

START_TEST(test_stories260k) {
    duet_gguf *g = NULL;
    duet_status st = duet_gguf_open(test_shared_path("models/stories260K.gguf"), &g);
    ck_assert_msg(st == DUET_OK, "open: %s", duet_last_error());
    ck_assert(g->mapped);
    ck_assert_uint_eq(g->version, 3);
    ck_assert_uint_eq(g->n_kv, 19);
    ck_assert_uint_eq(g->n_tensors, 48);
    ck_assert_uint_eq(g->data_offset, 14176);
    ck_assert_uint_eq(g->alignment, 32);
    ck_assert_uint_eq(g->size, 1185376);

    char buf[64];
    ck_assert(duet_gguf_get_str(g, "general.architecture", buf, sizeof buf));
    ck_assert_str_eq(buf, "llama");
    ck_assert(duet_gguf_get_str(g, "tokenizer.ggml.model", buf, sizeof buf));
    ck_assert_str_eq(buf, "llama");
    ck_assert(duet_gguf_get_str(g, "general.architecture", buf, 3)); /* truncates */
    ck_assert_str_eq(buf, "ll");
    uint32_t u;
    ck_assert(duet_gguf_get_u32(g, "llama.embedding_length", &u) && u == 64);
    ck_assert(duet_gguf_get_u32(g, "llama.block_count", &u) && u == 5);
    ck_assert(duet_gguf_get_u32(g, "llama.attention.head_count", &u) && u == 8);
    ck_assert(duet_gguf_get_u32(g, "llama.attention.head_count_kv", &u) && u == 4);
    ck_assert(duet_gguf_get_u32(g, "llama.feed_forward_length", &u) && u == 172);
    ck_assert(duet_gguf_get_u32(g, "llama.context_length", &u) && u == 2048);
    ck_assert(duet_gguf_get_u32(g, "tokenizer.ggml.seperator_token_id", &u) && u == UINT32_MAX);
    float f;
    ck_assert(duet_gguf_get_f32(g, "llama.attention.layer_norm_rms_epsilon", &f) && f == 1e-5f);
    ck_assert(!duet_gguf_get_u32(g, "general.architecture", &u)); /* wrong type */
    ck_assert(!duet_gguf_get_u32(g, "no.such.key", &u));

    const duet_gguf_kv *kv = duet_gguf_find(g, "tokenizer.ggml.tokens");
    ck_assert_ptr_nonnull(kv);
    ck_assert(kv->value.type == DUET_GGUF_ARRAY && kv->value.arr.type == DUET_GGUF_STRING);
    ck_assert_uint_eq(kv->value.arr.n, 512);
    ck_assert(str_eq(kv->value.arr.strs[0], "<unk>"));
    ck_assert(str_eq(kv->value.arr.strs[1], "<s>"));
    ck_assert(str_eq(kv->value.arr.strs[3], "<0x00>"));
    kv = duet_gguf_find(g, "tokenizer.ggml.token_type");
    ck_assert(kv && kv->value.arr.type == DUET_GGUF_INT32 && kv->value.arr.n == 512);
    ck_assert_int_eq(((const int32_t *)kv->value.arr.data)[0], 2);
    ck_assert_int_eq(((const int32_t *)kv->value.arr.data)[3], 6);

    const duet_gguf_tensor *t = duet_gguf_find_tensor(g, "token_embd.weight");
    ck_assert_ptr_nonnull(t);
    ck_assert_int_eq(t->n_dims, 2);
    ck_assert(t->ne[0] == 64 && t->ne[1] == 512 && t->ne[2] == 1 && t->ne[3] == 1);
    ck_assert_int_eq(t->type, DUET_DTYPE_F32);
    ck_assert_uint_eq(t->size, 64 * 512 * 4);
    ck_assert_uint_eq(t->offset, 0);
    /* The embedding equals the llama2.c checkpoint's (after its 7-int header). */
    size_t blen;
    char *bin = test_read_file(test_shared_path("models/stories260K.bin"), &blen);
    ck_assert_ptr_nonnull(bin);
    ck_assert(blen > 28 + t->size);
    ck_assert_msg(memcmp(bin + 28, t->data, t->size) == 0, "token_embd.weight differs from stories260K.bin");
    free(bin);
    t = duet_gguf_find_tensor(g, "blk.4.ffn_down.weight");
    ck_assert(t && t->ne[0] == 172 && t->ne[1] == 64);
    ck_assert(duet_gguf_find_tensor(g, "output_norm.weight") != NULL);
    duet_gguf_close(g);
}
END_TEST

START_TEST(test_vocab_only) {
    static const struct {
        const char *file, *arch, *model, *tok0;
        uint64_t n_kv, n_tokens, n_merges;
    } cases[] = {
        {"models/ggml-vocab-llama-spm.gguf", "llama", "llama", "<unk>", 22, 32000, 0},
        {"models/ggml-vocab-gpt-2.gguf", "gpt2", "gpt2", "!", 16, 50257, 50000},
        {"models/ggml-vocab-deepseek-coder.gguf", "llama", "gpt2", "!", 25, 32256, 31757},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        duet_gguf *g = NULL;
        duet_status st = duet_gguf_open(test_shared_path(cases[i].file), &g);
        ck_assert_msg(st == DUET_OK, "%s: %s", cases[i].file, duet_last_error());
        ck_assert_uint_eq(g->n_tensors, 0);
        ck_assert_msg(g->n_kv == cases[i].n_kv, "%s: n_kv %llu", cases[i].file, (unsigned long long)g->n_kv);
        char buf[32];
        ck_assert(duet_gguf_get_str(g, "general.architecture", buf, sizeof buf));
        ck_assert_str_eq(buf, cases[i].arch);
        ck_assert(duet_gguf_get_str(g, "tokenizer.ggml.model", buf, sizeof buf));
        ck_assert_str_eq(buf, cases[i].model);
        const duet_gguf_kv *kv = duet_gguf_find(g, "tokenizer.ggml.tokens");
        ck_assert(kv && kv->value.arr.type == DUET_GGUF_STRING);
        ck_assert_uint_eq(kv->value.arr.n, cases[i].n_tokens);
        ck_assert(str_eq(kv->value.arr.strs[0], cases[i].tok0));
        kv = duet_gguf_find(g, "tokenizer.ggml.merges");
        if (cases[i].n_merges) {
            ck_assert(kv && kv->value.arr.n == cases[i].n_merges);
            ck_assert(str_eq(kv->value.arr.strs[0], "\xc4\xa0 t") ||
                      str_eq(kv->value.arr.strs[0], "\xc4\xa0 \xc4\xa0"));
        } else {
            ck_assert_ptr_null(kv);
        }
        duet_gguf_close(g);
    }
}
END_TEST

START_TEST(test_open_errors) {
    duet_gguf *g = (duet_gguf *)1;
    duet_status st = duet_gguf_open("/nonexistent/dir/model.gguf", &g);
    ck_assert_int_eq(st, DUET_IO);
    ck_assert_ptr_null(g);
    ck_assert_msg(strstr(duet_last_error(), "No such file") != NULL, "message: %s", duet_last_error());
    st = duet_gguf_open(DUET_BINARY_DIR, &g);
    ck_assert_int_eq(st, DUET_IO);
    ck_assert_msg(strstr(duet_last_error(), "regular file") != NULL, "message: %s", duet_last_error());
    /* A bad file on disk: the message names the file. */
    const char *path = tmp_path("gguf_bad_magic.gguf");
    FILE *f = fopen(path, "wb");
    ck_assert_ptr_nonnull(f);
    fputs("GGML and then some more bytes to get past the header", f);
    fclose(f);
    st = duet_gguf_open(path, &g);
    ck_assert_int_eq(st, DUET_BAD_MODEL);
    ck_assert_msg(strstr(duet_last_error(), "magic") && strstr(duet_last_error(), path), "message: %s",
                  duet_last_error());
    remove(path);
    st = duet_gguf_open_memory(NULL, 0, &g);
    ck_assert_int_eq(st, DUET_BAD_MODEL);
    duet_gguf_close(NULL);
}
END_TEST

/* ---- writer ----------------------------------------------------------------- */

START_TEST(test_roundtrip) {
    static const uint32_t aligns[] = {0, 32, 64, 4096};
    for (size_t i = 0; i < sizeof aligns / sizeof aligns[0]; i++) {
        char name[64];
        snprintf(name, sizeof name, "gguf_roundtrip_%u.gguf", aligns[i]);
        const char *path = tmp_path(name);
        size_t len;
        uint8_t *bytes = write_sample(aligns[i], path, &len);
        duet_gguf *g = NULL;
        duet_status st = duet_gguf_open(path, &g);
        ck_assert_msg(st == DUET_OK, "align %u: %s", aligns[i], duet_last_error());
        check_sample(g, aligns[i]);
        ck_assert_uint_eq(g->size % g->alignment, 0); /* last tensor padded too */
        duet_gguf_close(g);
        /* The same bytes from memory, at an odd address so scalar arrays
         * must be copied to stay aligned. */
        uint8_t *odd = malloc(len + 1);
        memcpy(odd + 1, bytes, len);
        st = duet_gguf_open_memory(odd + 1, len, &g);
        ck_assert_msg(st == DUET_OK, "memory: %s", duet_last_error());
        ck_assert(!g->mapped);
        check_sample(g, aligns[i]);

        /* copy_kv of everything plus the same tensors gives the same bytes. */
        duet_gguf_writer *w = duet_gguf_writer_new();
        duet_gguf_copy_kv(w, g);
        for (uint64_t k = 0; k < g->n_tensors; k++) {
            const duet_gguf_tensor *t = &g->tensors[k];
            char tn[64];
            snprintf(tn, sizeof tn, "%.*s", (int)t->name.len, t->name.ptr);
            duet_gguf_add_tensor(w, tn, t->type, t->n_dims, t->ne, t->data, true);
        }
        const char *path2 = tmp_path("gguf_recopy.gguf");
        st = duet_gguf_write(w, path2);
        ck_assert_msg(st == DUET_OK, "rewrite: %s", duet_last_error());
        duet_gguf_writer_free(w);
        duet_gguf_close(g);
        free(odd);
        size_t len2;
        char *bytes2 = test_read_file(path2, &len2);
        ck_assert_msg(len2 == len && memcmp(bytes, bytes2, len) == 0,
                      "align %u: copy_kv + borrowed tensors did not reproduce the file", aligns[i]);
        free(bytes2);
        free(bytes);
        remove(path2);
        remove(path);
    }
}
END_TEST

/* The sample for test_gguf_pyref.py (alignment 64), renamed into place so a
 * concurrent reader never sees half a file. */
START_TEST(test_write_pyref_sample) {
    size_t len;
    const char *tmp = tmp_path("gguf_sample.gguf");
    free(write_sample(64, tmp, &len));
    const char *path = DUET_BINARY_DIR "/gguf_sample.gguf";
    ck_assert_msg(rename(tmp, path) == 0, "rename to %s: %s", path, strerror(errno));
}
END_TEST

START_TEST(test_getters) {
    size_t len;
    uint8_t *bytes = write_sample(0, tmp_path("gguf_getters.gguf"), &len);
    duet_gguf *g = NULL;
    ck_assert_int_eq(duet_gguf_open_memory(bytes, len, &g), DUET_OK);
    uint32_t u;
    int64_t i;
    float f;
    bool b;
    char buf[8];
    ck_assert(duet_gguf_get_u32(g, "t.u8", &u) && u == 200);
    ck_assert(duet_gguf_get_u32(g, "t.u16", &u) && u == 60000);
    ck_assert(duet_gguf_get_u32(g, "t.u32", &u) && u == 4000000000u);
    ck_assert(!duet_gguf_get_u32(g, "t.i8", &u));  /* negative */
    ck_assert(!duet_gguf_get_u32(g, "t.u64", &u)); /* too big */
    ck_assert(!duet_gguf_get_u32(g, "t.f32", &u));
    ck_assert(!duet_gguf_get_u32(g, "t.bool", &u));
    ck_assert(duet_gguf_get_i64(g, "t.i8", &i) && i == -100);
    ck_assert(duet_gguf_get_i64(g, "t.i64", &i) && i == -5000000000LL);
    ck_assert(duet_gguf_get_i64(g, "t.u64", &i) && i == (int64_t)((1ull << 60) + 1));
    ck_assert(duet_gguf_get_i64(g, "t.u32", &i) && i == 4000000000LL);
    ck_assert(!duet_gguf_get_i64(g, "t.str", &i));
    ck_assert(duet_gguf_get_f32(g, "t.f32", &f) && f == 0.5f);
    ck_assert(duet_gguf_get_f32(g, "t.f64", &f) && f == (float)3.141592653589793);
    ck_assert(!duet_gguf_get_f32(g, "t.u32", &f));
    ck_assert(duet_gguf_get_bool(g, "t.bool", &b) && b);
    ck_assert(duet_gguf_get_bool(g, "t.bool_false", &b) && !b);
    ck_assert(!duet_gguf_get_bool(g, "t.u8", &b));
    ck_assert(duet_gguf_get_str(g, "t.str", buf, sizeof buf));
    ck_assert_str_eq(buf, "hello, ");
    ck_assert(duet_gguf_get_str(g, "t.empty_str", buf, sizeof buf));
    ck_assert_str_eq(buf, "");
    ck_assert(!duet_gguf_get_str(g, "t.strs", buf, sizeof buf));
    ck_assert(!duet_gguf_get_str(g, "absent", buf, sizeof buf));
    ck_assert_str_eq(duet_gguf_type_name(DUET_GGUF_FLOAT64), "float64");
    ck_assert_str_eq(duet_gguf_type_name((duet_gguf_type)99), "unknown");
    duet_gguf_close(g);
    free(bytes);
    remove(tmp_path("gguf_getters.gguf"));
}
END_TEST

START_TEST(test_writer_errors) {
    static const int64_t ne33[] = {33, 1};
    static const int64_t ne4[] = {4};
    static const int64_t ne0[] = {0};
    float data[64] = {0};
    const char *path = tmp_path("gguf_writer_err.gguf");
    struct {
        const char *what, *word;
    } cases[] = {
        {"q8_0 row not a block multiple", "block"},
        {"alignment 48", "power of two"},
        {"duplicate tensor", "duplicate"},
        {"zero dimension", "dimension"},
        {"5 dims", "n_dims"},
        {"string set_array", "scalar"},
    };
    for (int c = 0; c < (int)(sizeof cases / sizeof cases[0]); c++) {
        duet_gguf_writer *w = duet_gguf_writer_new();
        duet_gguf_set_u32(w, "a", 1);
        switch (c) {
        case 0:
            duet_gguf_add_tensor(w, "q", DUET_DTYPE_Q8_0, 2, ne33, data, true);
            break;
        case 1:
            duet_gguf_writer_set_alignment(w, 48);
            break;
        case 2:
            duet_gguf_add_tensor(w, "x", DUET_DTYPE_F32, 1, ne4, data, false);
            duet_gguf_add_tensor(w, "x", DUET_DTYPE_F32, 1, ne4, data, false);
            break;
        case 3:
            duet_gguf_add_tensor(w, "x", DUET_DTYPE_F32, 1, ne0, data, false);
            break;
        case 4:
            duet_gguf_add_tensor(w, "x", DUET_DTYPE_F32, 5, ne4, data, false);
            break;
        case 5:
            duet_gguf_set_array(w, "s", DUET_GGUF_STRING, data, 1);
            break;
        }
        duet_status st = duet_gguf_write(w, path);
        ck_assert_msg(st == DUET_INVALID_ARGUMENT, "%s: write gave %s", cases[c].what, duet_status_name(st));
        ck_assert_msg(strstr(duet_last_error(), cases[c].word), "%s: message '%s' lacks '%s'", cases[c].what,
                      duet_last_error(), cases[c].word);
        duet_gguf_writer_free(w);
    }
    duet_gguf_writer *w = duet_gguf_writer_new();
    duet_status st = duet_gguf_write(w, "/nonexistent/dir/out.gguf");
    ck_assert_int_eq(st, DUET_IO);
    ck_assert_msg(strstr(duet_last_error(), "No such file"), "message: %s", duet_last_error());
    /* An empty writer makes a valid empty file. */
    ck_assert_int_eq(duet_gguf_write(w, path), DUET_OK);
    duet_gguf_writer_free(w);
    duet_gguf *g;
    ck_assert_msg(duet_gguf_open(path, &g) == DUET_OK, "empty file: %s", duet_last_error());
    ck_assert(g->n_kv == 0 && g->n_tensors == 0 && g->data_offset == 32 && g->size == 24);
    duet_gguf_close(g);
    remove(path);
}
END_TEST

/* Keys are byte strings: one with a NUL inside survives copy_kv and does
 * not collide with its prefix; overriding a copied key replaces it. */
START_TEST(test_copy_kv_odd_keys) {
    bb b = {0};
    bb_header(&b, 3, 0, 3);
    bb_u64(&b, 3), bb_put(&b, "a\0b", 3), bb_u32(&b, DUET_GGUF_UINT8), bb_u8(&b, 1);
    bb_str(&b, "a"), bb_u32(&b, DUET_GGUF_UINT8), bb_u8(&b, 2);
    bb_str(&b, "general.alignment"), bb_u32(&b, DUET_GGUF_UINT32), bb_u32(&b, 128);
    duet_gguf *src;
    ck_assert_msg(duet_gguf_open_memory(b.p, b.len, &src) == DUET_OK, "source: %s", duet_last_error());
    duet_gguf_writer *w = duet_gguf_writer_new();
    duet_gguf_copy_kv(w, src);
    duet_gguf_set_u32(w, "a", 3); /* replaces the copied "a" */
    static const int64_t ne[] = {32};
    float data[32] = {1};
    duet_gguf_add_tensor(w, "t", DUET_DTYPE_F32, 1, ne, data, true);
    const char *path = tmp_path("gguf_oddkeys.gguf");
    ck_assert_msg(duet_gguf_write(w, path) == DUET_OK, "write: %s", duet_last_error());
    duet_gguf_writer_free(w);
    duet_gguf_close(src);
    free(b.p);
    duet_gguf *g;
    ck_assert_msg(duet_gguf_open(path, &g) == DUET_OK, "read back: %s", duet_last_error());
    ck_assert_uint_eq(g->n_kv, 3);
    ck_assert(g->kv[0].key.len == 3 && memcmp(g->kv[0].key.ptr, "a\0b", 3) == 0);
    ck_assert_uint_eq(g->kv[0].value.u64, 1);
    uint32_t u;
    ck_assert(duet_gguf_get_u32(g, "a", &u) && u == 3);
    /* The copied alignment governs the written file. */
    ck_assert_uint_eq(g->alignment, 128);
    ck_assert_uint_eq(g->data_offset % 128, 0);
    ck_assert_uint_eq(g->size, g->data_offset + 128);
    duet_gguf_close(g);
    remove(path);
}
END_TEST

/* ---- malformed corpus ------------------------------------------------------- */

/* Runs the reader on a mutated copy; it must fail with BAD_MODEL and a
 * message containing `word` (NULL: any non-empty message). */
static void expect_bad(const uint8_t *p, size_t len, const char *word, const char *what) {
    /* An exact-size heap copy so ASan sees any read past the end. */
    uint8_t *copy = malloc(len ? len : 1);
    if (len) memcpy(copy, p, len);
    duet_gguf *g = NULL;
    duet_status st = duet_gguf_open_memory(copy, len, &g);
    ck_assert_msg(st == DUET_BAD_MODEL, "%s: accepted or wrong status %s", what, duet_status_name(st));
    ck_assert_ptr_null(g);
    const char *msg = duet_last_error();
    ck_assert_msg(msg[0] != 0, "%s: empty message", what);
    ck_assert_msg(strncmp(msg, "gguf: ", 6) == 0, "%s: message '%s' lacks the gguf prefix", what, msg);
    if (word) ck_assert_msg(strstr(msg, word) != NULL, "%s: message '%s' lacks '%s'", what, msg, word);
    free(copy);
}

typedef struct fixture {
    uint8_t *bytes;
    size_t len;
    duet_gguf *g; /* the valid file, to locate fields */
    uint8_t *m;   /* scratch copy to mutate */
} fixture;

static fixture fx_open(uint32_t alignment) {
    fixture fx;
    char name[64];
    snprintf(name, sizeof name, "gguf_corpus_%u.gguf", alignment);
    fx.bytes = write_sample(alignment, tmp_path(name), &fx.len);
    remove(tmp_path(name));
    ck_assert_int_eq(duet_gguf_open_memory(fx.bytes, fx.len, &fx.g), DUET_OK);
    fx.m = malloc(fx.len);
    return fx;
}

static uint8_t *fx_fresh(fixture *fx) {
    memcpy(fx->m, fx->bytes, fx->len);
    return fx->m;
}

static void fx_close(fixture *fx) {
    duet_gguf_close(fx->g);
    free(fx->bytes);
    free(fx->m);
}

/* File offsets of fields, found through the parsed valid file. */
static uint64_t off_of(const fixture *fx, const void *p) {
    return (uint64_t)((const uint8_t *)p - fx->bytes);
}
static uint64_t key_len_at(const fixture *fx, const char *key) {
    return off_of(fx, duet_gguf_find(fx->g, key)->key.ptr) - 8;
}
static uint64_t value_type_at(const fixture *fx, const char *key) {
    const duet_gguf_kv *kv = duet_gguf_find(fx->g, key);
    return off_of(fx, kv->key.ptr) + kv->key.len;
}
static uint64_t tensor_field_at(const fixture *fx, int k, const char *field) {
    const duet_gguf_tensor *t = &fx->g->tensors[k];
    uint64_t o = off_of(fx, t->name.ptr) + t->name.len; /* n_dims */
    if (strcmp(field, "n_dims") == 0) return o;
    o += 4;
    if (strcmp(field, "ne") == 0) return o;
    o += 8 * (uint64_t)t->n_dims;
    if (strcmp(field, "type") == 0) return o;
    return o + 4; /* offset */
}

START_TEST(test_truncation) {
    fixture fx = fx_open(0);
    uint64_t data_end = 0;
    for (uint64_t k = 0; k < fx.g->n_tensors; k++) {
        uint64_t e = fx.g->data_offset + fx.g->tensors[k].offset + fx.g->tensors[k].size;
        if (e > data_end) data_end = e;
    }
    char what[64];
    /* Every byte boundary of header, metadata and tensor infos, and every
     * one in the data up to the end of the last tensor. */
    for (size_t cut = 0; cut < data_end; cut++) {
        snprintf(what, sizeof what, "truncated at %zu of %zu", cut, fx.len);
        expect_bad(fx.bytes, cut, NULL, what);
    }
    /* Cutting only the final padding leaves a valid file. */
    for (size_t cut = data_end; cut <= fx.len; cut++) {
        duet_gguf *g;
        ck_assert_msg(duet_gguf_open_memory(fx.bytes, cut, &g) == DUET_OK, "cut at %zu: %s", cut,
                      duet_last_error());
        duet_gguf_close(g);
    }
    /* Truncations in the middle of tensor data say so. */
    expect_bad(fx.bytes, data_end - 1, "past end", "one byte short");
    expect_bad(fx.bytes, 3, "too small", "3 bytes");
    expect_bad(fx.bytes, 20, "truncated", "inside the counts");
    fx_close(&fx);
}
END_TEST

START_TEST(test_bad_header) {
    fixture fx = fx_open(0);
    uint8_t *m;
    m = fx_fresh(&fx), m[0] = 'X';
    expect_bad(m, fx.len, "magic", "bad magic");
    m = fx_fresh(&fx), put_u32_at(m, 4, 1);
    expect_bad(m, fx.len, "version 1", "version 1");
    m = fx_fresh(&fx), put_u32_at(m, 4, 4);
    expect_bad(m, fx.len, "version 4", "version 4");
    m = fx_fresh(&fx), put_u32_at(m, 4, 0);
    expect_bad(m, fx.len, "version", "version 0");
    m = fx_fresh(&fx), put_u32_at(m, 4, 0x03000000);
    expect_bad(m, fx.len, "big-endian", "byte-swapped version");
    /* Absurd counts: rejected before allocating anything. */
    m = fx_fresh(&fx), put_u64_at(m, 8, 1ull << 63);
    expect_bad(m, fx.len, "tensor count", "n_tensors 2^63");
    m = fx_fresh(&fx), put_u64_at(m, 16, 1ull << 63);
    expect_bad(m, fx.len, "key count", "n_kv 2^63");
    m = fx_fresh(&fx), put_u64_at(m, 16, UINT64_MAX);
    expect_bad(m, fx.len, "key count", "n_kv 2^64-1");
    m = fx_fresh(&fx), put_u64_at(m, 8, UINT64_MAX / 16), put_u64_at(m, 16, 1);
    expect_bad(m, fx.len, "tensor count", "n_tensors huge");
    /* Counts that fit in size but not in content. */
    m = fx_fresh(&fx), put_u64_at(m, 16, fx.g->n_kv + 1);
    expect_bad(m, fx.len, NULL, "one key too many");
    m = fx_fresh(&fx), put_u64_at(m, 8, fx.g->n_tensors + 1);
    expect_bad(m, fx.len, NULL, "one tensor too many");
    m = fx_fresh(&fx), put_u64_at(m, 16, fx.g->n_kv - 1);
    expect_bad(m, fx.len, NULL, "one key too few");
    fx_close(&fx);
}
END_TEST

START_TEST(test_bad_metadata) {
    fixture fx = fx_open(0);
    uint8_t *m;
    /* String lengths. */
    m = fx_fresh(&fx), put_u64_at(m, key_len_at(&fx, "t.u8"), 0xffffffffu);
    expect_bad(m, fx.len, "exceeds", "key length 2^32-1");
    m = fx_fresh(&fx), put_u64_at(m, key_len_at(&fx, "t.u8"), UINT64_MAX);
    expect_bad(m, fx.len, "exceeds", "key length 2^64-1");
    m = fx_fresh(&fx), put_u64_at(m, key_len_at(&fx, "t.u8"), 0);
    expect_bad(m, fx.len, "empty key", "empty key");
    m = fx_fresh(&fx), put_u64_at(m, value_type_at(&fx, "t.str") + 4, UINT64_MAX - 3);
    expect_bad(m, fx.len, "string value length", "string value length");
    uint64_t strs = value_type_at(&fx, "t.strs");
    m = fx_fresh(&fx), put_u64_at(m, strs + 16 + 8 + 8 + 1, 1ull << 62); /* element 2 ("hello world") */
    expect_bad(m, fx.len, "element 2", "string array element length");
    /* Array lengths. */
    m = fx_fresh(&fx), put_u64_at(m, value_type_at(&fx, "t.arr.u32") + 8, 1ull << 62);
    expect_bad(m, fx.len, "array length", "u32 array length 2^62");
    m = fx_fresh(&fx), put_u64_at(m, value_type_at(&fx, "t.arr.u64") + 8, UINT64_MAX);
    expect_bad(m, fx.len, "array length", "u64 array length 2^64-1 (n*8 overflows)");
    m = fx_fresh(&fx), put_u64_at(m, strs + 8, 1ull << 61);
    expect_bad(m, fx.len, "string array length", "string array length 2^61");
    m = fx_fresh(&fx), put_u64_at(m, value_type_at(&fx, "t.nested") + 8, 1ull << 60);
    expect_bad(m, fx.len, "nested array length", "nested array length 2^60");
    /* Types. */
    m = fx_fresh(&fx), put_u32_at(m, value_type_at(&fx, "t.u32"), 13);
    expect_bad(m, fx.len, "unknown value type 13", "value type 13");
    m = fx_fresh(&fx), put_u32_at(m, value_type_at(&fx, "t.u32"), 0xffffffffu);
    expect_bad(m, fx.len, "unknown value type", "value type 2^32-1");
    m = fx_fresh(&fx), put_u32_at(m, value_type_at(&fx, "t.arr.u32") + 4, 99);
    expect_bad(m, fx.len, "element type 99", "array element type 99");
    m = fx_fresh(&fx), m[value_type_at(&fx, "t.bool") + 4] = 2;
    expect_bad(m, fx.len, "bool", "bool value 2");
    m = fx_fresh(&fx), m[value_type_at(&fx, "t.arr.bool") + 4 + 4 + 8 + 1] = 7;
    expect_bad(m, fx.len, "bool array", "bool array element 7");
    /* Duplicate key: "t.i8" renamed to "t.u8". */
    m = fx_fresh(&fx), memcpy(m + key_len_at(&fx, "t.i8") + 8, "t.u8", 4);
    expect_bad(m, fx.len, "duplicate key 't.u8'", "duplicate key");
    fx_close(&fx);

    /* general.alignment: zero, not a power of two, wrong type. */
    fx = fx_open(64);
    uint64_t at = value_type_at(&fx, "general.alignment");
    m = fx_fresh(&fx), put_u32_at(m, at + 4, 0);
    expect_bad(m, fx.len, "power of two", "alignment 0");
    m = fx_fresh(&fx), put_u32_at(m, at + 4, 48);
    expect_bad(m, fx.len, "power of two", "alignment 48");
    m = fx_fresh(&fx), put_u32_at(m, at, DUET_GGUF_INT32);
    expect_bad(m, fx.len, "must be uint32", "alignment int32");
    m = fx_fresh(&fx), put_u32_at(m, at, DUET_GGUF_FLOAT32);
    expect_bad(m, fx.len, "must be uint32", "alignment float32");
    fx_close(&fx);
}
END_TEST

/* A file with one key holding `depth` nested arrays, innermost [1u8]. */
static bb depth_file(int depth) {
    bb b = {0};
    bb_header(&b, 3, 0, 1);
    bb_str(&b, "deep");
    bb_u32(&b, DUET_GGUF_ARRAY);
    for (int i = 1; i < depth; i++)
        bb_u32(&b, DUET_GGUF_ARRAY), bb_u64(&b, 1);
    bb_u32(&b, DUET_GGUF_UINT8), bb_u64(&b, 1), bb_u8(&b, 1);
    return b;
}

START_TEST(test_depth_bomb) {
    bb b = depth_file(8);
    duet_gguf *g;
    ck_assert_msg(duet_gguf_open_memory(b.p, b.len, &g) == DUET_OK, "8 levels: %s", duet_last_error());
    const duet_gguf_value *v = &g->kv[0].value;
    for (int i = 1; i < 8; i++) {
        ck_assert(v->arr.type == DUET_GGUF_ARRAY && v->arr.n == 1);
        v = &v->arr.arrays[0];
    }
    ck_assert(v->arr.type == DUET_GGUF_UINT8 && ((const uint8_t *)v->arr.data)[0] == 1);
    duet_gguf_close(g);
    free(b.p);
    b = depth_file(9);
    expect_bad(b.p, b.len, "nested more than 8", "9 levels");
    free(b.p);
    b = depth_file(100000);
    expect_bad(b.p, b.len, "nested", "100000 levels");
    free(b.p);
    /* Wide rather than deep: many empty inner arrays are fine. */
    b = (bb){0};
    bb_header(&b, 2, 0, 1);
    bb_str(&b, "wide");
    bb_u32(&b, DUET_GGUF_ARRAY), bb_u32(&b, DUET_GGUF_ARRAY), bb_u64(&b, 10000);
    for (int i = 0; i < 10000; i++)
        bb_u32(&b, DUET_GGUF_FLOAT32), bb_u64(&b, 0);
    ck_assert_msg(duet_gguf_open_memory(b.p, b.len, &g) == DUET_OK, "wide (v2): %s", duet_last_error());
    ck_assert_uint_eq(g->version, 2);
    ck_assert_uint_eq(g->kv[0].value.arr.n, 10000);
    duet_gguf_close(g);
    free(b.p);
}
END_TEST

START_TEST(test_bad_tensors) {
    fixture fx = fx_open(0);
    uint8_t *m;
    /* Tensor 3 is q8_0 [64, 2], tensor 4 is i32 with 4 dims. */
    m = fx_fresh(&fx), put_u32_at(m, tensor_field_at(&fx, 0, "type"), 16);
    expect_bad(m, fx.len, "iq2_xxs", "tensor type iq2_xxs");
    m = fx_fresh(&fx), put_u32_at(m, tensor_field_at(&fx, 0, "type"), 16);
    expect_bad(m, fx.len, "not supported", "tensor type iq2_xxs");
    /* Q8_K is an activation format, never a tensor's. */
    m = fx_fresh(&fx), put_u32_at(m, tensor_field_at(&fx, 0, "type"), 15);
    expect_bad(m, fx.len, "not supported", "tensor type q8_K");
    m = fx_fresh(&fx), put_u32_at(m, tensor_field_at(&fx, 0, "type"), 1000);
    expect_bad(m, fx.len, "tensor type 1000", "tensor type 1000");
    m = fx_fresh(&fx), put_u32_at(m, tensor_field_at(&fx, 0, "n_dims"), 0);
    expect_bad(m, fx.len, "n_dims 0", "n_dims 0");
    m = fx_fresh(&fx), put_u32_at(m, tensor_field_at(&fx, 4, "n_dims"), 5);
    expect_bad(m, fx.len, "n_dims 5", "n_dims 5");
    m = fx_fresh(&fx), put_u64_at(m, tensor_field_at(&fx, 0, "ne"), 0);
    expect_bad(m, fx.len, "ne[0] = 0", "ne 0");
    m = fx_fresh(&fx), put_u64_at(m, tensor_field_at(&fx, 0, "ne") + 8, 1ull << 63);
    expect_bad(m, fx.len, "ne[1]", "ne 2^63");
    m = fx_fresh(&fx), put_u64_at(m, tensor_field_at(&fx, 4, "ne"), 1ull << 40),
    put_u64_at(m, tensor_field_at(&fx, 4, "ne") + 8, 1ull << 40);
    expect_bad(m, fx.len, "overflow", "ne product overflow");
    m = fx_fresh(&fx), put_u64_at(m, tensor_field_at(&fx, 4, "ne"), 1ull << 30),
    put_u64_at(m, tensor_field_at(&fx, 4, "ne") + 8, 1ull << 30);
    expect_bad(m, fx.len, "past end", "huge tensor");
    m = fx_fresh(&fx), put_u64_at(m, tensor_field_at(&fx, 3, "ne"), 33);
    expect_bad(m, fx.len, "block size", "q8_0 ne0 33");
    /* Offsets. */
    uint64_t off1 = fx.g->tensors[1].offset;
    m = fx_fresh(&fx), put_u64_at(m, tensor_field_at(&fx, 1, "offset"), off1 + 1);
    expect_bad(m, fx.len, "not a multiple of the alignment", "offset unaligned");
    m = fx_fresh(&fx), put_u64_at(m, tensor_field_at(&fx, 1, "offset"), 1ull << 40);
    expect_bad(m, fx.len, "runs past end of file", "offset out of range");
    m = fx_fresh(&fx), put_u64_at(m, tensor_field_at(&fx, 1, "offset"), UINT64_MAX - 31);
    expect_bad(m, fx.len, "runs past end of file", "offset + size overflows");
    m = fx_fresh(&fx), put_u64_at(m, tensor_field_at(&fx, 2, "offset"), off1);
    expect_bad(m, fx.len, "overlaps", "tensor 2 at tensor 1's offset");
    m = fx_fresh(&fx), put_u64_at(m, tensor_field_at(&fx, 0, "offset"), off1);
    expect_bad(m, fx.len, "overlaps", "tensor 0 at tensor 1's offset");
    /* Names. */
    const duet_gguf_tensor *t1 = &fx.g->tensors[1]; /* "f16" */
    m = fx_fresh(&fx), memcpy(m + off_of(&fx, t1->name.ptr), "f32", 3);
    expect_bad(m, fx.len, "duplicate tensor name 'f32'", "duplicate tensor");
    m = fx_fresh(&fx), put_u64_at(m, off_of(&fx, t1->name.ptr) - 8, 0);
    expect_bad(m, fx.len, "empty tensor name", "empty tensor name");
    m = fx_fresh(&fx), put_u64_at(m, off_of(&fx, t1->name.ptr) - 8, UINT64_MAX);
    expect_bad(m, fx.len, "tensor name length", "tensor name length 2^64-1");
    /* The message names the tensor. */
    m = fx_fresh(&fx), put_u32_at(m, tensor_field_at(&fx, 1, "type"), 2);
    expect_bad(m, fx.len, "tensor #1 ('f16')", "message names the tensor");
    fx_close(&fx);
}
END_TEST

/* Random byte mutations: the reader must never crash, and anything it
 * accepts must be consistent (walk every value and tensor byte). */
static uint64_t rng_next(uint64_t *s) {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

static uint64_t walk_value(const duet_gguf_value *v) {
    uint64_t h = v->type;
    if (v->type == DUET_GGUF_STRING) {
        for (uint64_t i = 0; i < v->str.len; i++)
            h += (uint8_t)v->str.ptr[i];
    } else if (v->type == DUET_GGUF_ARRAY) {
        for (uint64_t i = 0; i < v->arr.n; i++) {
            if (v->arr.type == DUET_GGUF_STRING) {
                for (uint64_t j = 0; j < v->arr.strs[i].len; j++)
                    h += (uint8_t)v->arr.strs[i].ptr[j];
            } else if (v->arr.type == DUET_GGUF_ARRAY) {
                h += walk_value(&v->arr.arrays[i]);
            }
        }
    }
    return h;
}

START_TEST(test_random_mutations) {
    fixture fx = fx_open(0);
    uint64_t seed = 0x9e3779b97f4a7c15ull;
    int accepted = 0;
    for (int iter = 0; iter < 20000; iter++) {
        uint8_t *m = fx_fresh(&fx);
        int n = 1 + (int)(rng_next(&seed) % 4);
        for (int j = 0; j < n; j++) {
            size_t at = (size_t)(rng_next(&seed) % fx.g->data_offset);
            uint64_t r = rng_next(&seed);
            m[at] = (r & 3) == 0 ? 0xff : (r & 3) == 1 ? 0 : (uint8_t)(r >> 8);
        }
        size_t len = (rng_next(&seed) % 8 == 0) ? (size_t)(rng_next(&seed) % fx.len) : fx.len;
        uint8_t *copy = malloc(len ? len : 1);
        memcpy(copy, m, len);
        duet_gguf *g = NULL;
        duet_status st = duet_gguf_open_memory(copy, len, &g);
        if (st == DUET_OK) {
            accepted++;
            uint64_t h = 0;
            for (uint64_t i = 0; i < g->n_kv; i++)
                h += walk_value(&g->kv[i].value);
            for (uint64_t i = 0; i < g->n_tensors; i++) {
                const uint8_t *d = g->tensors[i].data;
                for (uint64_t b = 0; b < g->tensors[i].size; b++)
                    h += d[b];
            }
            (void)h;
            duet_gguf_close(g);
        } else {
            ck_assert_msg(st == DUET_BAD_MODEL, "iteration %d: status %s", iter, duet_status_name(st));
            ck_assert_msg(duet_last_error()[0], "iteration %d: empty message", iter);
        }
        free(copy);
    }
    /* Flips inside string bytes and tensor data keep the file valid. */
    ck_assert_msg(accepted > 0, "no mutation was accepted: the corpus is too narrow");
    fx_close(&fx);
}
END_TEST

static Suite *gguf_suite(void) {
    Suite *s = suite_create("gguf");
    TCase *tc = tcase_create("reader");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_stories260k);
    tcase_add_test(tc, test_vocab_only);
    tcase_add_test(tc, test_open_errors);
    tcase_add_test(tc, test_roundtrip);
    tcase_add_test(tc, test_getters);
    tcase_add_test(tc, test_writer_errors);
    tcase_add_test(tc, test_copy_kv_odd_keys);
    tcase_add_test(tc, test_truncation);
    tcase_add_test(tc, test_bad_header);
    tcase_add_test(tc, test_bad_metadata);
    tcase_add_test(tc, test_depth_bomb);
    tcase_add_test(tc, test_bad_tensors);
    tcase_add_test(tc, test_random_mutations);
    suite_add_tcase(s, tc);
    /* Its own case so test_gguf_pyref.py can run just this (CK_RUN_CASE=sample). */
    tc = tcase_create("sample");
    tcase_add_test(tc, test_write_pyref_sample);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) {
    return test_run_suite(gguf_suite());
}
