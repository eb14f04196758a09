/* test_vulkan.c — what only the Vulkan backend has: the validation layer on
 * a real forward pass and on an INT8 decode layer, device features and
 * limits, tensors bound in ranges (larger than maxStorageBufferRange, or
 * than limits shrunk for the test), the tuning table and its overrides,
 * rope_kv writing pools window by window, bad block-table entries seen by
 * the host and by the shaders, a position past n_keys, fused q8_0 outputs
 * written alone, q8_0 activations read without a quantize pass,
 * scratch_bytes, the pipeline cache on disk, barriers only where data
 * depends, steady-state steps that allocate nothing, device-side index
 * checks, and a machine without a driver.
 *
 * Op-by-op parity, every forced tuning path included (DUET_VK_TUNE: int8
 * dot products or the packed-integer fallback, tile, subgroup and GEMM
 * matmuls, lane and flash attention, splits), is test_backend_ops' case
 * table; here every result is checked against the oracle (op_oracle.h).
 *
 * Each test runs in its own process (Check's fork mode), so a test may set
 * environment variables the backend reads once per process
 * (DUET_VK_VALIDATION, VK_ICD_FILENAMES) before its first Vulkan call.
 * Without a Vulkan device the tests pass with a note, unless
 * DUET_REQUIRE_BACKENDS names vulkan. */
#include <dirent.h>
#include <math.h>
#include <sys/stat.h>

#include "backend.h"
#include "duet.h"
#include "op_oracle.h"
#include "test_util.h"

/* Internal to the backend (backends/vulkan/vk_internal.h). */
int duet__vk_validation_errors(void);
void duet__vk_stats(duet_backend *be, long out[5]);
const char *duet__vk_pipeline_cache_path(duet_backend *be);

/* Under AddressSanitizer: the Khronos validation layer (1.3.239) leaks a
 * few objects of its own per instance; they are not ours to fix. */
const char *__lsan_default_suppressions(void);
const char *__lsan_default_suppressions(void) { return "leak:libVkLayer_khronos_validation.so\n"; }

static bool vulkan_required(void) {
    const char *r = getenv("DUET_REQUIRE_BACKENDS");
    return r && strstr(r, "vulkan");
}

/* Opens the Vulkan backend, or returns NULL (the test then passes with a
 * note) when this machine has none and none is required. */
static duet_backend *open_vk(void) {
    const duet_backend_iface *vk = duet_backend_find("vulkan");
    char why[256] = "";
    if (!vk || !vk->available(why, sizeof why)) {
        ck_assert_msg(!vulkan_required(), "vulkan is required but %s", vk ? why : "not compiled in");
        fprintf(stderr, "test_vulkan: skipped, vulkan unavailable (%s)\n", vk ? why : "not compiled in");
        return NULL;
    }
    duet_backend *be = NULL;
    duet_status st = duet_backend_open("vulkan", 0, NULL, &be);
    ck_assert_msg(st == DUET_OK, "open vulkan: %s", duet_last_error());
    return be;
}

/* ---- the same operands on vulkan and in the oracle ------------------------------------ */

/* Each buffer exists twice: on the vulkan backend and in host memory,
 * where the oracle runs the same ops. */
typedef struct twin {
    duet_backend *vk;
    duet_buffer *dev[32];
    uint8_t *host[32];
    size_t size[32];
    int n;
} twin;

/* A buffer of `size` bytes on both sides, holding `data` (or zeros). */
static int twin_buf(twin *t, size_t size, const void *data) {
    ck_assert_int_lt(t->n, 32);
    t->host[t->n] = calloc(1, size ? size : 1);
    if (data) memcpy(t->host[t->n], data, size);
    duet_status st = duet_buffer_alloc(t->vk, size, &t->dev[t->n]);
    ck_assert_msg(st == DUET_OK, "alloc %zu bytes: %s", size, duet_last_error());
    st = duet_buffer_upload(t->vk, t->dev[t->n], 0, t->host[t->n], size);
    ck_assert_msg(st == DUET_OK, "upload: %s", duet_last_error());
    t->size[t->n] = size;
    return t->n++;
}

/* Buffer i on side b (0: the oracle's, whose views carry i + 1; 1: vulkan). */
static duet_view tv(const twin *t, int b, int i, size_t off) {
    return b ? (duet_view){t->dev[i], off} : (duet_view){(duet_buffer *)(uintptr_t)(i + 1), off};
}

static uint8_t *twin_map(void *ctx, duet_view v) {
    const twin *t = ctx;
    return v.buf ? t->host[(uintptr_t)v.buf - 1] + v.offset : NULL;
}

static void twin_free(twin *t) {
    for (int i = 0; i < t->n; i++) {
        duet_buffer_free(t->vk, t->dev[i]);
        free(t->host[i]);
    }
    t->n = 0;
}

/* Runs ops built by `make(t, side, i, op)` (i = 0.. until it returns
 * false) as one step on vulkan, and in order in the oracle. */
typedef bool (*make_op_fn)(const twin *t, int b, int i, duet_op *op, const void *ctx);

static void twin_run(twin *t, make_op_fn make, const void *ctx) {
    duet_op op;
    for (int i = 0; make(t, 0, i, &op, ctx); i++)
        oracle_run(&op, twin_map, t);
    ck_assert_msg(duet_step_begin(t->vk) == DUET_OK, "begin: %s", duet_last_error());
    for (int i = 0; make(t, 1, i, &op, ctx); i++) {
        duet_status st = duet_step_op(t->vk, &op);
        ck_assert_msg(st == DUET_OK, "vulkan op %d: %s", i, duet_last_error());
    }
    ck_assert_msg(duet_step_submit(t->vk) == DUET_OK, "submit: %s", duet_last_error());
    duet_status st = duet_step_wait(t->vk);
    ck_assert_msg(st == DUET_OK, "vulkan wait: %s", duet_last_error());
}

/* NMSE of vulkan's buffer i against the oracle's (n floats from byte off). */
static double twin_nmse(const twin *t, int i, size_t off, size_t n) {
    const float *a = (const float *)(t->host[i] + off);
    float *b = malloc(n * 4);
    ck_assert(b);
    ck_assert_msg(duet_buffer_download(t->vk, t->dev[i], off, b, n * 4) == DUET_OK, "download: %s",
                  duet_last_error());
    double num = 0, den = 0;
    for (size_t k = 0; k < n; k++) {
        ck_assert_msg(isfinite(b[k]), "element %zu is not finite", k);
        num += ((double)a[k] - b[k]) * ((double)a[k] - b[k]);
        den += (double)a[k] * a[k];
    }
    free(b);
    return den > 0 ? num / den : num;
}

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static float frand(void) {
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((rng >> 40) & 0xFFFFFF) / 16777216.0f * 2.0f - 1.0f;
}

static float *rand_f32(size_t n) {
    float *x = malloc(n * sizeof *x);
    ck_assert(x);
    for (size_t i = 0; i < n; i++) x[i] = frand();
    return x;
}

/* rows x cols random weights in dtype t. */
static void *rand_weights(duet_dtype t, int64_t rows, int64_t cols, size_t *bytes) {
    size_t rb = duet_dtype_row_bytes(t, cols);
    uint8_t *w = malloc(rb * (size_t)rows);
    float *row = malloc((size_t)cols * sizeof *row);
    ck_assert(w && row);
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t c = 0; c < cols; c++) row[c] = frand() * 0.5f;
        duet_convert_row(t, row, w + (size_t)r * rb, cols);
    }
    free(row);
    *bytes = rb * (size_t)rows;
    return w;
}

/* ---- tests ------------------------------------------------------------------------------- */

/* `duet devices` material: the device and the features the issue lists. */
START_TEST(device_features) {
    duet_backend *vk = open_vk();
    if (!vk) return;
    duet_device_info info;
    ck_assert_int_eq(duet_backend_find("vulkan")->device_info(0, &info), DUET_OK);
    ck_assert_msg(info.name[0] && info.vendor[0] && info.driver[0], "name/vendor/driver must be set");
    ck_assert_msg(info.memory_bytes > 0, "memory must be reported");
    const char *want[] = {"fp16-arith=", "fp16-storage=", "int8-storage=", "int8-dot=", "subgroup=", "coopmat=",
                          "timestamps=", "heaps=", "max-storage-range="};
    for (size_t i = 0; i < sizeof want / sizeof *want; i++)
        ck_assert_msg(strstr(info.features, want[i]), "features lack '%s': %s", want[i], info.features);
    /* An open instance also says which tuning entry it runs with. */
    ck_assert_msg(strstr(vk->info.features, "tuning="), "instance features lack the tuning: %s", vk->info.features);
    char text[8192];
    duet_devices_describe(text, sizeof text, false);
    ck_assert_msg(strstr(text, "vulkan") && strstr(text, info.name), "duet devices lacks %s:\n%s", info.name, text);
    duet_backend_close(vk);
}
END_TEST

/* A small model, prefill and decode, on vulkan with the Khronos validation
 * layer (and its synchronization checks) on: no error may be reported, and
 * the logits must match the cpu backend's. */
static void forward_under_validation(const char *shape, const char *type, const char *kv_type, double tol) {
    setenv("DUET_VK_VALIDATION", "1", 1);
    duet_backend *vk = open_vk();
    if (!vk) return;
    duet_backend_close(vk);
    ck_assert_msg(duet__vk_validation_errors() == 0, "validation must be on and clean (got %d)",
                  duet__vk_validation_errors());
    char path[512];
    snprintf(path, sizeof path, "%s/test_vulkan_%s_%s.gguf", DUET_BINARY_DIR, shape, type);
    duet_mkmodel_params mp = {.shape = shape, .type = type, .seed = 7, .n_ctx = 64};
    ck_assert_msg(duet_mkmodel(&mp, path) == DUET_OK, "mkmodel: %s", duet_last_error());
    duet_model *m[2];
    const char *names[2] = {"cpu", "vulkan"};
    for (int b = 0; b < 2; b++) {
        duet_open_params p = duet_open_params_default();
        p.backend = names[b];
        p.kv_type = kv_type;
        ck_assert_msg(duet_model_open(path, &p, &m[b]) == DUET_OK, "open on %s: %s", names[b], duet_last_error());
    }
    duet_model_desc d;
    duet_model_describe(m[0], &d);
    float *lg[2] = {malloc(sizeof(float) * d.n_vocab), malloc(sizeof(float) * d.n_vocab)};
    int32_t tok[12];
    for (int i = 0; i < 12; i++) tok[i] = (i * 37 + 5) % d.n_vocab;
    for (int step = 0; step < 4; step++) {
        int n = step == 0 ? 9 : 1, pos0 = step == 0 ? 0 : 8 + step;
        for (int b = 0; b < 2; b++)
            ck_assert_msg(duet_eval(m[b], step == 0 ? tok : &tok[pos0], n, pos0, lg[b]) == DUET_OK, "%s eval: %s",
                          names[b], duet_last_error());
        double num = 0, den = 0;
        for (int i = 0; i < d.n_vocab; i++) {
            num += (lg[0][i] - lg[1][i]) * (double)(lg[0][i] - lg[1][i]);
            den += lg[0][i] * (double)lg[0][i];
        }
        ck_assert_msg(num / den < tol, "%s step %d: logits NMSE %g >= %g", type, step, num / den, tol);
    }
    for (int b = 0; b < 2; b++) duet_model_close(m[b]);
    free(lg[0]), free(lg[1]);
    remove(path);
    ck_assert_msg(duet__vk_validation_errors() == 0, "the validation layer reported %d error(s) (see stderr)",
                  duet__vk_validation_errors());
}

START_TEST(validation_forward_q8_0) { forward_under_validation("tiny", "q8_0", "f16", 1e-6); }
END_TEST
START_TEST(validation_forward_f32) { forward_under_validation("tiny", "f32", "f32", 1e-10); }
END_TEST
/* A q8_0 KV cache (the small shape: head_dim 32): rope_kv quantises rows
 * on each backend (a value a hair from a rounding tie may land a step
 * apart), so the bound is looser. */
START_TEST(validation_forward_q8_kv) { forward_under_validation("small", "q8_0", "q8_0", 1e-4); }
END_TEST

/* The tuning table picks an entry at open; DUET_VK_TUNE overrides it and a
 * malformed override is an error, not a silent default. */
START_TEST(tuning_table) {
    duet_backend *vk = open_vk();
    if (!vk) return;
    const char *f = vk->info.features;
    ck_assert_msg(strstr(f, "tuning=") && (strstr(f, "matmul=tile") || strstr(f, "matmul=subgroup")), "%s", f);
    if (strstr(vk->info.name, "llvmpipe"))
        ck_assert_msg(strstr(f, "tuning=llvmpipe matmul=tile"), "llvmpipe must use its table entry: %s", f);
    duet_backend_close(vk);

    setenv("DUET_VK_TUNE", "matmul=subgroup,dot=0,sg_wg=32", 1);
    ck_assert_msg(duet_backend_open("vulkan", 0, NULL, &vk) == DUET_OK, "%s", duet_last_error());
    ck_assert_msg(strstr(vk->info.features, "+env matmul=subgroup") && !strstr(vk->info.features, "+dot"), "%s",
                  vk->info.features);
    duet_backend_close(vk);

    setenv("DUET_VK_TUNE", "matmul=fast", 1);
    ck_assert_int_eq(duet_backend_open("vulkan", 0, NULL, &vk), DUET_INVALID_ARGUMENT);
    ck_assert_msg(strstr(duet_last_error(), "DUET_VK_TUNE"), "the error must name the variable: %s", duet_last_error());
    setenv("DUET_VK_TUNE", "tile_rows=3", 1);
    ck_assert_int_eq(duet_backend_open("vulkan", 0, NULL, &vk), DUET_INVALID_ARGUMENT);
    setenv("DUET_VK_TUNE", "attn=fast", 1);
    ck_assert_int_eq(duet_backend_open("vulkan", 0, NULL, &vk), DUET_INVALID_ARGUMENT);
    ck_assert_msg(strstr(duet_last_error(), "lane, flash"), "the error must list the choices: %s", duet_last_error());
    unsetenv("DUET_VK_TUNE");
}
END_TEST

/* Tensors larger than a storage binding or a texel view are bound in
 * ranges. DUET_VK_LIMITS shrinks the device's limits so small tensors cross
 * them: weights over several texel views (matmul splits rows, embed splits
 * the table), an output over several storage bindings (matmul splits
 * tokens). (KV pools written window by window: rope_kv_pool_windows.) */
typedef struct range_ctx {
    int w, x, xq, out, tab, tok, emb;
    int n_tok, n_in, n_out, dim;
} range_ctx;

static bool make_range_ops(const twin *t, int b, int i, duet_op *op, const void *p) {
    const range_ctx *c = p;
    switch (i) {
    case 0:
        *op = (duet_op){.kind = DUET_OP_MATMUL, .n_tokens = c->n_tok};
        op->matmul.w = tv(t, b, c->w, 0);
        op->matmul.dtype = DUET_DTYPE_Q8_0;
        /* The backend quantises x by duet_quantize_row_q8_0's rule; the
         * oracle reads those q8_0 activations. */
        if (b)
            op->matmul.x = tv(t, b, c->x, 0);
        else
            op->matmul.x_q8 = tv(t, b, c->xq, 0);
        op->matmul.n_in = c->n_in;
        op->matmul.n_out = c->n_out;
        op->matmul.out = tv(t, b, c->out, 0);
        return true;
    case 1:
        *op = (duet_op){.kind = DUET_OP_EMBED, .n_tokens = c->n_tok};
        op->embed.tokens = tv(t, b, c->tok, 0);
        op->embed.table = tv(t, b, c->tab, 0);
        op->embed.dtype = DUET_DTYPE_F32;
        op->embed.dim = c->dim;
        op->embed.out = tv(t, b, c->emb, 0);
        return true;
    }
    return false;
}

static void check_range_binding(void) {
    /* Views of 32 KiB (a new one every 16 KiB), bindings of 16 KiB. */
    setenv("DUET_VK_LIMITS", "ssbo=16384,texel=32768", 1);
    duet_backend *vk = open_vk();
    if (!vk) return;
    twin t = {.vk = vk};
    range_ctx c = {.n_tok = 20, .n_in = 256, .n_out = 300, .dim = 64};
    size_t wbytes;
    void *w = rand_weights(DUET_DTYPE_Q8_0, c.n_out, c.n_in, &wbytes); /* 81600 bytes: 5 views */
    float *x = rand_f32((size_t)c.n_tok * c.n_in);
    duet_block_q8_0 *xq = malloc(sizeof *xq * (size_t)c.n_tok * (c.n_in / 32));
    for (int i = 0; i < c.n_tok; i++)
        duet_quantize_row_q8_0(x + (size_t)i * c.n_in, xq + (size_t)i * (c.n_in / 32), c.n_in);
    c.w = twin_buf(&t, wbytes, w);
    c.x = twin_buf(&t, (size_t)c.n_tok * c.n_in * 4, x);
    c.xq = twin_buf(&t, sizeof *xq * (size_t)c.n_tok * (c.n_in / 32), xq);
    free(xq);
    c.out = twin_buf(&t, (size_t)c.n_tok * c.n_out * 4, NULL); /* 24000 bytes: 2 bindings */
    free(w), free(x);
    const int rows = 400; /* 102400-byte table: 4 windows of 128 rows */
    float *tab = rand_f32((size_t)rows * c.dim);
    int32_t tok[20];
    for (int i = 0; i < c.n_tok; i++) tok[i] = (i * 83 + 11) % rows;
    c.tab = twin_buf(&t, (size_t)rows * c.dim * 4, tab);
    c.tok = twin_buf(&t, sizeof tok, tok);
    c.emb = twin_buf(&t, (size_t)c.n_tok * c.dim * 4, NULL);
    free(tab);

    twin_run(&t, make_range_ops, &c);
    double e;
    ck_assert_msg((e = twin_nmse(&t, c.out, 0, (size_t)c.n_tok * c.n_out)) < 1e-10, "matmul NMSE %g", e);
    ck_assert_msg((e = twin_nmse(&t, c.emb, 0, (size_t)c.n_tok * c.dim)) == 0, "embed NMSE %g", e);
    long st[5];
    duet__vk_stats(vk, st);
    /* matmul: a quantize, then at least 3 row ranges x 2 token ranges;
     * embed: 4 table windows. */
    ck_assert_msg(st[0] >= 1 + 6 + 4, "only %ld dispatches: the ranges were not split", st[0]);
    twin_free(&t);
    duet_backend_close(vk);
}

START_TEST(range_binding_small_limits) { check_range_binding(); }
END_TEST

/* The same through a 4 KiB staging buffer, as on a discrete GPU whose
 * memory the host cannot map: uploads and downloads in chunks, index inputs
 * checked by the shaders. */
START_TEST(range_binding_through_staging) {
    setenv("DUET_VK_STAGING", "4096", 1);
    check_range_binding();
}
END_TEST

/* ---- operands on vulkan alone, checked against the oracle ------------------------- */

/* Buffers on the vulkan backend alone (the oracle then runs on host copies
 * the test keeps itself). */
typedef struct solo {
    duet_backend *be;
    duet_buffer *b[48];
    size_t size[48];
    int n;
} solo;

static int solo_buf(solo *s, size_t size, const void *data) {
    ck_assert_int_lt(s->n, 48);
    ck_assert_msg(duet_buffer_alloc(s->be, size ? size : 4, &s->b[s->n]) == DUET_OK, "alloc %zu: %s", size,
                  duet_last_error());
    void *zero = data ? NULL : calloc(1, size ? size : 4);
    ck_assert_msg(duet_buffer_upload(s->be, s->b[s->n], 0, data ? data : zero, size ? size : 4) == DUET_OK, "upload: %s",
                  duet_last_error());
    free(zero);
    s->size[s->n] = size;
    return s->n++;
}

static duet_view sv(const solo *s, int i) { return (duet_view){s->b[i], 0}; }

static void *solo_get(const solo *s, int i) {
    void *p = malloc(s->size[i] ? s->size[i] : 1);
    ck_assert(p);
    ck_assert_msg(duet_buffer_download(s->be, s->b[i], 0, p, s->size[i]) == DUET_OK, "download: %s", duet_last_error());
    return p;
}

static void solo_free(solo *s) {
    for (int i = 0; i < s->n; i++) duet_buffer_free(s->be, s->b[i]);
    s->n = 0;
}

/* One step of n ops; every call must succeed. */
static void solo_run(duet_backend *be, const duet_op *ops, int n) {
    ck_assert_msg(duet_step_begin(be) == DUET_OK, "begin: %s", duet_last_error());
    for (int i = 0; i < n; i++) {
        duet_status st = duet_step_op(be, &ops[i]);
        ck_assert_msg(st == DUET_OK, "op %d (kind %d): %s", i, (int)ops[i].kind, duet_last_error());
    }
    ck_assert_msg(duet_step_submit(be) == DUET_OK, "submit: %s", duet_last_error());
    ck_assert_msg(duet_step_wait(be) == DUET_OK, "wait: %s", duet_last_error());
}

static double nmse(const float *ref, const float *got, size_t n) {
    double num = 0, den = 0;
    for (size_t k = 0; k < n; k++) {
        ck_assert_msg(isfinite(got[k]), "element %zu is %g", k, got[k]);
        num += ((double)ref[k] - got[k]) * ((double)ref[k] - got[k]);
        den += (double)ref[k] * ref[k];
    }
    return den > 0 ? num / den : num;
}

/* q8_0 blocks `got` against the quantisation of the f32 values `x` (the
 * same op's f32 output): scales within fp16 rounding, every value within
 * one quantisation step. */
static void check_q8_of(const char *what, const float *x, const duet_block_q8_0 *got, size_t n_blocks) {
    duet_block_q8_0 *want = malloc(n_blocks * sizeof *want);
    ck_assert(want);
    duet_quantize_row_q8_0(x, want, (int64_t)n_blocks * 32);
    for (size_t b = 0; b < n_blocks; b++) {
        float dw = duet_fp16_to_fp32(want[b].d), dg = duet_fp16_to_fp32(got[b].d);
        ck_assert_msg(fabsf(dw - dg) <= 1e-3f * dw + 1e-30f, "%s block %zu: scale %g, want %g", what, b, dg, dw);
        for (int k = 0; k < 32; k++)
            ck_assert_msg(abs(want[b].qs[k] - got[b].qs[k]) <= 1, "%s block %zu value %d: %d, want %d", what, b, k,
                          got[b].qs[k], want[b].qs[k]);
    }
    free(want);
}

/* ---- the paged KV cache: the oracle's host model --------------------------------------- */

typedef struct paged {
    int nh, nkv, hd, bs, n_blocks, n_seqs, max_blocks;
    duet_dtype dt;
    oracle_kv kv; /* pools and block table */
} paged;

/* Pools of random rows and a scattered table: each sequence holds
 * max_blocks blocks handed out from a shuffle of the pool, so neighbouring
 * positions live far apart. */
static void paged_init(paged *p) {
    int lens[64];
    ck_assert_int_le(p->n_seqs, 64);
    ck_assert_int_ge(p->n_blocks, p->n_seqs * p->max_blocks);
    for (int s = 0; s < p->n_seqs; s++)
        lens[s] = p->max_blocks * p->bs;
    oracle_kv_alloc(&p->kv, p->dt, p->nkv * p->hd, p->bs, p->n_blocks, p->n_seqs, p->max_blocks);
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    oracle_kv_scatter(&p->kv, lens, -1, rng);
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    oracle_kv_fill(&p->kv, rng, 1.0f, 1.0f);
}

static void paged_free(paged *p) {
    oracle_kv_free(&p->kv);
}

static void ref_attention(const paged *p, const float *q, const int32_t *pos, const int32_t *seq, int n_tok, float scale,
                          float *out) {
    oracle_attention(q, pos, seq, n_tok, p->nh, p->nkv, p->hd, scale, 0, &p->kv, out, NULL);
}

/* The device's paged operands. */
typedef struct paged_dev {
    int kp, vp, bt;
} paged_dev;

static paged_dev paged_upload(solo *s, const paged *p) {
    paged_dev d;
    d.kp = solo_buf(s, oracle_kv_pool_bytes(&p->kv), p->kv.k);
    d.vp = solo_buf(s, oracle_kv_pool_bytes(&p->kv), p->kv.v);
    d.bt = solo_buf(s, oracle_kv_table_bytes(&p->kv), p->kv.table);
    return d;
}

static duet_kv_pages paged_view(const solo *s, const paged *p, paged_dev d) {
    return oracle_kv_pages(&p->kv, sv(s, d.kp), sv(s, d.vp), sv(s, d.bt));
}

/* A batch of tokens: (seq, pos) pairs. */
typedef struct batch {
    int n;
    int32_t pos[160], seq[160];
} batch;

/* Appends positions lo..hi-1 of sequence s. */
static void batch_run(batch *b, int s, int lo, int hi) {
    for (int p = lo; p < hi; p++) {
        ck_assert_int_lt(b->n, 160);
        b->seq[b->n] = s, b->pos[b->n++] = p;
    }
}

/* Attention of batch `b` over pools `p` on vulkan (f32 output and, with
 * q8, a q8_0 output too) against the oracle. */
static void check_attention(duet_backend *vk, paged *p, const batch *b, bool q8, double tol, const char *what) {
    solo s = {.be = vk};
    const int qw = p->nh * p->hd;
    float *q = rand_f32((size_t)b->n * qw), *want = malloc(sizeof(float) * (size_t)b->n * qw);
    ck_assert(want);
    const float scale = 1.0f / sqrtf((float)p->hd);
    ref_attention(p, q, b->pos, b->seq, b->n, scale, want);
    paged_dev d = paged_upload(&s, p);
    int qi = solo_buf(&s, sizeof(float) * (size_t)b->n * qw, q), pi = solo_buf(&s, sizeof(int32_t) * (size_t)b->n, b->pos),
        si = solo_buf(&s, sizeof(int32_t) * (size_t)b->n, b->seq), oi = solo_buf(&s, sizeof(float) * (size_t)b->n * qw, NULL);
    int oqi = q8 ? solo_buf(&s, (size_t)b->n * (size_t)(qw / 32) * sizeof(duet_block_q8_0), NULL) : -1;
    duet_op op = {.kind = DUET_OP_ATTENTION, .n_tokens = b->n};
    op.attention.q = sv(&s, qi);
    op.attention.pos = sv(&s, pi);
    op.attention.seq = sv(&s, si);
    op.attention.kv = paged_view(&s, p, d);
    op.attention.n_head = p->nh;
    op.attention.n_head_kv = p->nkv;
    op.attention.head_dim = p->hd;
    op.attention.scale = scale;
    op.attention.out = sv(&s, oi);
    if (q8) op.attention.out_q8 = sv(&s, oqi);
    solo_run(vk, &op, 1);
    float *got = solo_get(&s, oi);
    double e = nmse(want, got, (size_t)b->n * qw);
    ck_assert_msg(e < tol, "%s: attention NMSE %g >= %g (%d tokens, %s kv, hd %d, %d/%d heads)", what, e, tol, b->n,
                  duet_dtype_name(p->dt), p->hd, p->nh, p->nkv);
    if (q8) {
        duet_block_q8_0 *gq = solo_get(&s, oqi);
        check_q8_of(what, got, gq, (size_t)b->n * (size_t)(qw / 32));
        /* Only the q8_0 output: the same blocks. */
        op.attention.out = (duet_view){0};
        void *zero = calloc(1, s.size[oqi]);
        duet_buffer_upload(vk, s.b[oqi], 0, zero, s.size[oqi]);
        free(zero);
        solo_run(vk, &op, 1);
        duet_block_q8_0 *gq2 = solo_get(&s, oqi);
        ck_assert_msg(memcmp(gq, gq2, s.size[oqi]) == 0, "%s: out_q8 alone differs from out_q8 next to out", what);
        free(gq), free(gq2);
    }
    free(got), free(q), free(want);
    solo_free(&s);
}

static duet_backend *open_tuned(const char *tune) {
    if (tune) setenv("DUET_VK_TUNE", tune, 1);
    else unsetenv("DUET_VK_TUNE");
    duet_backend *vk = NULL;
    ck_assert_msg(duet_backend_open("vulkan", 0, NULL, &vk) == DUET_OK, "open with DUET_VK_TUNE=%s: %s",
                  tune ? tune : "", duet_last_error());
    unsetenv("DUET_VK_TUNE");
    return vk;
}

/* rope_kv into paged pools: rotated q and k, the pool rows it writes (f32
 * exact, f16 to rounding, q8_0 within a step of the oracle's quantisation),
 * and no other row touched; then attention over what it wrote. Under
 * DUET_VK_LIMITS the pools are written through several storage windows. */
static void check_rope_kv(duet_backend *vk, duet_dtype dt, int hd, bool neox, const char *what) {
    paged p = {.nh = 4, .nkv = 2, .hd = hd, .bs = 8, .n_blocks = 24, .n_seqs = 3, .max_blocks = 8, .dt = dt};
    paged_init(&p);
    batch b = {0};
    batch_run(&b, 1, 0, 13);
    batch_run(&b, 0, 40, 41);
    batch_run(&b, 2, 7, 9);
    const int qw = p.nh * hd, kvw = p.nkv * hd, n = b.n;
    float *q = rand_f32((size_t)n * qw), *k = rand_f32((size_t)n * kvw), *v = rand_f32((size_t)n * kvw);
    solo s = {.be = vk};
    paged_dev d = paged_upload(&s, &p);
    int qi = solo_buf(&s, sizeof(float) * (size_t)n * qw, q), ki = solo_buf(&s, sizeof(float) * (size_t)n * kvw, k),
        vi = solo_buf(&s, sizeof(float) * (size_t)n * kvw, v), pi = solo_buf(&s, sizeof(int32_t) * (size_t)n, b.pos),
        si = solo_buf(&s, sizeof(int32_t) * (size_t)n, b.seq), oi = solo_buf(&s, sizeof(float) * (size_t)n * qw, NULL);
    duet_op ops[2] = {{.kind = DUET_OP_ROPE_KV, .n_tokens = n}, {.kind = DUET_OP_ATTENTION, .n_tokens = n}};
    ops[0].rope_kv.q = sv(&s, qi);
    ops[0].rope_kv.k = sv(&s, ki);
    ops[0].rope_kv.v = sv(&s, vi);
    ops[0].rope_kv.pos = sv(&s, pi);
    ops[0].rope_kv.seq = sv(&s, si);
    ops[0].rope_kv.kv = paged_view(&s, &p, d);
    ops[0].rope_kv.n_head = p.nh;
    ops[0].rope_kv.n_head_kv = p.nkv;
    ops[0].rope_kv.head_dim = hd;
    ops[0].rope_kv.n_rot = hd & ~1;
    float fr[512];
    oracle_rope_freqs(10000.0f, hd & ~1, fr);
    ops[0].rope_kv.freqs = sv(&s, solo_buf(&s, sizeof(float) * (size_t)((hd / 2) > 0 ? hd / 2 : 1), fr));
    ops[0].rope_kv.neox = neox;
    ops[1].attention.q = sv(&s, qi);
    ops[1].attention.pos = sv(&s, pi);
    ops[1].attention.seq = sv(&s, si);
    ops[1].attention.kv = ops[0].rope_kv.kv;
    ops[1].attention.n_head = p.nh;
    ops[1].attention.n_head_kv = p.nkv;
    ops[1].attention.head_dim = hd;
    ops[1].attention.scale = 1.0f / sqrtf((float)hd);
    ops[1].attention.out = sv(&s, oi);
    solo_run(vk, ops, 2);

    oracle_rope_kv(q, k, v, b.pos, b.seq, n, p.nh, p.nkv, hd, hd & ~1, fr, 0.0f, neox, &p.kv);
    float *gq = solo_get(&s, qi), *gk = solo_get(&s, ki);
    double e;
    ck_assert_msg((e = nmse(q, gq, (size_t)n * qw)) < 1e-12, "%s: rotated q NMSE %g", what, e);
    ck_assert_msg((e = nmse(k, gk, (size_t)n * kvw)) < 1e-12, "%s: rotated k NMSE %g", what, e);
    const size_t rows = (size_t)p.bs * p.n_blocks;
    float *a = malloc(sizeof(float) * (size_t)kvw), *c = malloc(sizeof(float) * (size_t)kvw);
    for (int which = 0; which < 2; which++) {
        uint8_t *pool = solo_get(&s, which ? d.vp : d.kp), *want = which ? p.kv.v : p.kv.k;
        for (size_t r = 0; r < rows; r++) {
            const uint8_t *wr = want + r * p.kv.row_bytes, *gr = pool + r * p.kv.row_bytes;
            if (dt == DUET_DTYPE_Q8_0) {
                const duet_block_q8_0 *wb = (const duet_block_q8_0 *)wr, *gb = (const duet_block_q8_0 *)gr;
                for (int bl = 0; bl < kvw / 32; bl++) {
                    float dw = duet_fp16_to_fp32(wb[bl].d), dg = duet_fp16_to_fp32(gb[bl].d);
                    ck_assert_msg(fabsf(dw - dg) <= 1e-3f * dw, "%s: %s pool row %zu block %d: scale %g, want %g", what,
                                  which ? "v" : "k", r, bl, dg, dw);
                    for (int j = 0; j < 32; j++)
                        ck_assert_msg(abs(wb[bl].qs[j] - gb[bl].qs[j]) <= 1, "%s: %s pool row %zu block %d: q %d, want %d",
                                      what, which ? "v" : "k", r, bl, gb[bl].qs[j], wb[bl].qs[j]);
                }
                continue;
            }
            duet_dequantize_row(dt, wr, a, kvw);
            duet_dequantize_row(dt, gr, c, kvw);
            for (int j = 0; j < kvw; j++)
                ck_assert_msg(fabsf(a[j] - c[j]) <= (dt == DUET_DTYPE_F16 ? 1e-3f : 1e-6f) * (1 + fabsf(a[j])),
                              "%s: %s pool row %zu element %d: %g, want %g", what, which ? "v" : "k", r, j, c[j], a[j]);
        }
        free(pool);
    }
    /* Attention over the written pools (q8_0: the oracle's and the device's
     * quantisation may differ by a step, so the bound is looser). */
    float *want = malloc(sizeof(float) * (size_t)n * qw), *got = solo_get(&s, oi);
    ref_attention(&p, q, b.pos, b.seq, n, 1.0f / sqrtf((float)hd), want);
    double tol = dt == DUET_DTYPE_Q8_0 ? 1e-5 : dt == DUET_DTYPE_F16 ? 1e-6 : 1e-10;
    ck_assert_msg((e = nmse(want, got, (size_t)n * qw)) < tol, "%s: attention after rope_kv NMSE %g", what, e);
    free(a), free(c), free(want), free(got), free(gq), free(gk), free(q), free(k), free(v);
    solo_free(&s);
    paged_free(&p);
}

START_TEST(rope_kv_into_pages) {
    duet_backend *vk = open_vk();
    if (!vk) return;
    check_rope_kv(vk, DUET_DTYPE_F32, 64, false, "f32");
    check_rope_kv(vk, DUET_DTYPE_F16, 64, true, "f16 neox");
    check_rope_kv(vk, DUET_DTYPE_F16, 15, true, "f16 odd rows");
    check_rope_kv(vk, DUET_DTYPE_Q8_0, 64, false, "q8_0");
    check_rope_kv(vk, DUET_DTYPE_Q8_0, 32, true, "q8_0 odd block count");
    duet_backend_close(vk);
}
END_TEST

/* The same with storage bindings of 16 KiB: the pools are written window
 * by window (several dispatches). */
START_TEST(rope_kv_pool_windows) {
    setenv("DUET_VK_LIMITS", "ssbo=16384", 1);
    duet_backend *vk = open_vk();
    if (!vk) return;
    check_rope_kv(vk, DUET_DTYPE_F16, 64, false, "f16 in windows");
    check_rope_kv(vk, DUET_DTYPE_Q8_0, 64, false, "q8_0 in windows");
    long st[5];
    duet__vk_stats(vk, st);
    ck_assert_msg(st[0] >= 3, "%ld dispatches: the pools were not written in windows", st[0]);
    duet_backend_close(vk);
}
END_TEST

/* A block table entry outside the pools: an error from the op when the
 * host can read the table (as on the cpu backend); through staging (the
 * host cannot), the shaders clamp, nothing is written out of bounds, and
 * wait() reports it. */
static void bad_table(bool staged) {
    if (staged) setenv("DUET_VK_STAGING", "4096", 1);
    duet_backend *vk = open_vk();
    if (!vk) return;
    paged p = {.nh = 2, .nkv = 2, .hd = 32, .bs = 4, .n_blocks = 4, .n_seqs = 1, .max_blocks = 4, .dt = DUET_DTYPE_F16};
    paged_init(&p);
    const int32_t saved = p.kv.table[1];
    p.kv.table[1] = 1000; /* positions 4..7 */
    solo s = {.be = vk};
    paged_dev d = paged_upload(&s, &p);
    int32_t pos = 6, seq = 0;
    float *q = rand_f32(64);
    int qi = solo_buf(&s, 64 * 4, q), ki = solo_buf(&s, 64 * 4, q), vi = solo_buf(&s, 64 * 4, q),
        pi = solo_buf(&s, 4, &pos), si = solo_buf(&s, 4, &seq), oi = solo_buf(&s, 64 * 4, NULL);
    free(q);
    duet_op ops[2] = {{.kind = DUET_OP_ROPE_KV, .n_tokens = 1}, {.kind = DUET_OP_ATTENTION, .n_tokens = 1}};
    ops[0].rope_kv.q = sv(&s, qi);
    ops[0].rope_kv.k = sv(&s, ki), ops[0].rope_kv.v = sv(&s, vi);
    ops[0].rope_kv.pos = sv(&s, pi);
    ops[0].rope_kv.seq = sv(&s, si);
    ops[0].rope_kv.kv = paged_view(&s, &p, d);
    ops[0].rope_kv.n_head = ops[0].rope_kv.n_head_kv = 2;
    ops[0].rope_kv.head_dim = ops[0].rope_kv.n_rot = 32;
    float fr[16];
    oracle_rope_freqs(10000.0f, 32, fr);
    ops[0].rope_kv.freqs = sv(&s, solo_buf(&s, sizeof fr, fr));
    ops[1].attention.q = sv(&s, qi);
    ops[1].attention.pos = sv(&s, pi);
    ops[1].attention.seq = sv(&s, si);
    ops[1].attention.kv = ops[0].rope_kv.kv;
    ops[1].attention.n_head = ops[1].attention.n_head_kv = 2;
    ops[1].attention.head_dim = 32;
    ops[1].attention.scale = 0.125f;
    ops[1].attention.out = sv(&s, oi);
    for (int i = 0; i < 2; i++) {
        ck_assert_int_eq(duet_step_begin(vk), DUET_OK);
        duet_status st = duet_step_op(vk, &ops[i]);
        if (!staged) {
            ck_assert_msg(st == DUET_INVALID_ARGUMENT, "op %d with a bad table entry: %d (%s)", i, st, duet_last_error());
            ck_assert_msg(strstr(duet_last_error(), "block table entry 1 of sequence 0 is 1000"), "%s", duet_last_error());
        } else {
            ck_assert_msg(st == DUET_OK, "recording must succeed: %s", duet_last_error());
        }
        ck_assert_int_eq(duet_step_submit(vk), DUET_OK);
        st = duet_step_wait(vk);
        if (staged) {
            ck_assert_msg(st == DUET_INVALID_ARGUMENT, "op %d: wait must report the bad entry", i);
            ck_assert_msg(strstr(duet_last_error(), "block table"), "%s", duet_last_error());
        } else {
            ck_assert_int_eq(st, DUET_OK);
        }
    }
    /* The next good step is clean. */
    p.kv.table[1] = saved;
    ck_assert_int_eq(duet_buffer_upload(vk, s.b[d.bt], 0, p.kv.table, 16), DUET_OK);
    solo_run(vk, ops, 2);
    solo_free(&s);
    paged_free(&p);
    duet_backend_close(vk);
}

/* A position past the attention's n_keys, read where the host cannot see
 * it (staged buffers): the splits cover fewer keys, so the shader flags
 * the token and wait() reports it; the right n_keys runs clean. */
static void past_n_keys_device(const char *tune) {
    setenv("DUET_VK_STAGING", "4096", 1);
    duet_backend *vk = open_tuned(tune);
    paged p = {.nh = 2, .nkv = 2, .hd = 32, .bs = 4, .n_blocks = 16, .n_seqs = 1, .max_blocks = 16, .dt = DUET_DTYPE_F16};
    paged_init(&p);
    solo s = {.be = vk};
    paged_dev d = paged_upload(&s, &p);
    int32_t pos = 40, seq = 0;
    float *q = rand_f32(64);
    int qi = solo_buf(&s, 64 * 4, q), pi = solo_buf(&s, 4, &pos), si = solo_buf(&s, 4, &seq), oi = solo_buf(&s, 64 * 4, NULL);
    free(q);
    duet_op op = {.kind = DUET_OP_ATTENTION, .n_tokens = 1};
    op.attention.q = sv(&s, qi);
    op.attention.pos = sv(&s, pi);
    op.attention.seq = sv(&s, si);
    op.attention.kv = paged_view(&s, &p, d);
    op.attention.n_head = op.attention.n_head_kv = 2;
    op.attention.head_dim = 32;
    op.attention.scale = 0.125f;
    op.attention.out = sv(&s, oi);
    op.attention.n_keys = 8; /* position 40 needs 41 */
    ck_assert_int_eq(duet_step_begin(vk), DUET_OK);
    ck_assert_msg(duet_step_op(vk, &op) == DUET_OK, "recording must succeed: %s", duet_last_error());
    ck_assert_int_eq(duet_step_submit(vk), DUET_OK);
    ck_assert_msg(duet_step_wait(vk) == DUET_INVALID_ARGUMENT, "%s: a position past n_keys went unreported",
                  tune ? tune : "table");
    ck_assert_msg(strstr(duet_last_error(), "n_keys"), "%s", duet_last_error());
    op.attention.n_keys = 41;
    solo_run(vk, &op, 1);
    solo_free(&s);
    paged_free(&p);
    duet_backend_close(vk);
}

START_TEST(position_past_n_keys_device) {
    duet_backend *vk = open_vk();
    if (!vk) return;
    duet_backend_close(vk);
    past_n_keys_device(NULL);
    past_n_keys_device("attn=flash");
}
END_TEST

START_TEST(bad_block_table_host) { bad_table(false); }
END_TEST
START_TEST(bad_block_table_device) { bad_table(true); }
END_TEST

/* scratch_bytes: attention's split partials grow linearly with the
 * context (8x the context: at most ~8x the scratch, and more than 1x),
 * and stay bounded by what the splits need. */
static size_t decode_scratch(int ctx) {
    duet_backend *vk = open_tuned("attn_par=65536,attn_chunk=64");
    paged p = {.nh = 8, .nkv = 8, .hd = 64, .bs = 32, .n_blocks = ctx / 32, .n_seqs = 1, .max_blocks = ctx / 32,
               .dt = DUET_DTYPE_F16};
    paged_init(&p);
    batch b = {0};
    batch_run(&b, 0, ctx - 1, ctx);
    check_attention(vk, &p, &b, false, 1e-9, "scratch");
    size_t bytes = duet_backend_scratch_bytes(vk);
    paged_free(&p);
    duet_backend_close(vk);
    return bytes;
}

START_TEST(scratch_linear_in_context) {
    duet_backend *probe = open_vk();
    if (!probe) return;
    size_t base = duet_backend_scratch_bytes(probe);
    duet_backend_close(probe);
    size_t s1 = decode_scratch(1024), s8 = decode_scratch(8192);
    /* 1024 keys in splits of 64: 16 partials of 66 floats per head. */
    const size_t part1 = 8 * 16 * 66 * 4;
    ck_assert_msg(s1 >= base + part1, "scratch %zu at 1024 does not count the partials (%zu + %zu)", s1, base, part1);
    ck_assert_msg(s1 <= base + 2 * part1 + 65536, "scratch %zu at 1024: more than the partials need", s1);
    ck_assert_msg(s8 > s1 && s8 - base <= 9 * (s1 - base), "scratch %zu at 8192 vs %zu at 1024: not linear", s8, s1);
}
END_TEST

/* ---- INT8 activations ------------------------------------------------------------------- */

/* rmsnorm and swiglu with out_q8 (next to out, and alone): the f32 output
 * matches the oracle's; the blocks are the quantisation of that same f32
 * output, and the same blocks when out is absent. */
START_TEST(q8_outputs_of_rmsnorm_swiglu) {
    duet_backend *vk = open_vk();
    if (!vk) return;
    const int nt = 3, dim = 768, nb = dim / 32;
    twin t = {.vk = vk};
    float *x = rand_f32((size_t)nt * dim), *w = rand_f32(dim), *g = rand_f32((size_t)nt * dim);
    for (int i = 0; i < nt * dim; i++) x[i] *= 1 + 4 * (i % 97 == 0); /* a few outliers per block row */
    int xi = twin_buf(&t, (size_t)nt * dim * 4, x), wi = twin_buf(&t, (size_t)dim * 4, w),
        gi = twin_buf(&t, (size_t)nt * dim * 4, g), oi = twin_buf(&t, (size_t)nt * dim * 4, NULL),
        si = twin_buf(&t, (size_t)nt * dim * 4, NULL);
    free(x), free(w), free(g);
    solo s = {.be = vk};
    int q1 = solo_buf(&s, (size_t)nt * nb * 34, NULL), q2 = solo_buf(&s, (size_t)nt * nb * 34, NULL);
    for (int pass = 0; pass < 2; pass++) {
        duet_op ops[2] = {{.kind = DUET_OP_RMSNORM, .n_tokens = nt}, {.kind = DUET_OP_SWIGLU, .n_tokens = nt}};
        ops[0].rmsnorm.x = tv(&t, 1, xi, 0);
        ops[0].rmsnorm.w = tv(&t, 1, wi, 0);
        ops[0].rmsnorm.out = pass ? (duet_view){0} : tv(&t, 1, oi, 0);
        ops[0].rmsnorm.out_q8 = sv(&s, q1);
        ops[0].rmsnorm.dim = dim;
        ops[0].rmsnorm.eps = 1e-5f;
        ops[1].swiglu.gate = tv(&t, 1, gi, 0);
        ops[1].swiglu.up = tv(&t, 1, xi, 0);
        ops[1].swiglu.out = pass ? (duet_view){0} : tv(&t, 1, si, 0);
        ops[1].swiglu.out_q8 = sv(&s, q2);
        ops[1].swiglu.dim = dim;
        if (pass == 0) {
            solo_run(vk, ops, 2);
            /* The f32 outputs against the oracle's. */
            duet_op c[2] = {ops[0], ops[1]};
            c[0].rmsnorm.out_q8 = c[1].swiglu.out_q8 = (duet_view){0};
            c[0].rmsnorm.x = tv(&t, 0, xi, 0), c[0].rmsnorm.w = tv(&t, 0, wi, 0), c[0].rmsnorm.out = tv(&t, 0, oi, 0);
            c[1].swiglu.gate = tv(&t, 0, gi, 0), c[1].swiglu.up = tv(&t, 0, xi, 0), c[1].swiglu.out = tv(&t, 0, si, 0);
            for (int k = 0; k < 2; k++)
                oracle_run(&c[k], twin_map, &t);
            double e;
            ck_assert_msg((e = twin_nmse(&t, oi, 0, (size_t)nt * dim)) < 1e-12, "rmsnorm NMSE %g", e);
            ck_assert_msg((e = twin_nmse(&t, si, 0, (size_t)nt * dim)) < 1e-12, "swiglu NMSE %g", e);
            float *o = malloc((size_t)nt * dim * 4), *sw = malloc((size_t)nt * dim * 4);
            duet_buffer_download(vk, t.dev[oi], 0, o, (size_t)nt * dim * 4);
            duet_buffer_download(vk, t.dev[si], 0, sw, (size_t)nt * dim * 4);
            duet_block_q8_0 *b1 = solo_get(&s, q1), *b2 = solo_get(&s, q2);
            check_q8_of("rmsnorm out_q8", o, b1, (size_t)nt * nb);
            check_q8_of("swiglu out_q8", sw, b2, (size_t)nt * nb);
            free(o), free(sw), free(b1), free(b2);
        } else {
            duet_block_q8_0 *a1 = solo_get(&s, q1), *a2 = solo_get(&s, q2);
            void *zero = calloc(1, s.size[q1]);
            duet_buffer_upload(vk, s.b[q1], 0, zero, s.size[q1]);
            duet_buffer_upload(vk, s.b[q2], 0, zero, s.size[q2]);
            free(zero);
            solo_run(vk, ops, 2);
            duet_block_q8_0 *c1 = solo_get(&s, q1), *c2 = solo_get(&s, q2);
            ck_assert_msg(memcmp(a1, c1, s.size[q1]) == 0, "rmsnorm: out_q8 alone differs from out_q8 next to out");
            ck_assert_msg(memcmp(a2, c2, s.size[q2]) == 0, "swiglu: out_q8 alone differs from out_q8 next to out");
            free(a1), free(a2), free(c1), free(c2);
        }
    }
    solo_free(&s);
    twin_free(&t);
    duet_backend_close(vk);
}
END_TEST

/* A Q8_0 matmul of q8_0 activations runs no quantize pass (one dispatch),
 * on every matmul path, with the activations' view at a 2-byte offset (the
 * case table's operands sit at aligned offsets; its x-q8 rows cover the
 * paths' results otherwise). */
typedef struct xq_case {
    int n_tok, n_in, n_out;
    size_t x_off;
    bool bias, acc;
} xq_case;

static void check_matmul_xq8(duet_backend *vk, const xq_case *c, const char *tune) {
    const int nb = c->n_in / 32;
    size_t wbytes;
    duet_block_q8_0 *w = rand_weights(DUET_DTYPE_Q8_0, c->n_out, c->n_in, &wbytes);
    float *xf = rand_f32((size_t)c->n_tok * c->n_in), *bias = rand_f32((size_t)c->n_out),
          *out0 = rand_f32((size_t)c->n_tok * c->n_out);
    const size_t xbytes = c->x_off + (size_t)c->n_tok * nb * sizeof(duet_block_q8_0);
    uint8_t *xq = calloc(1, xbytes);
    for (int t = 0; t < c->n_tok; t++)
        duet_quantize_row_q8_0(xf + (size_t)t * c->n_in, (duet_block_q8_0 *)(xq + c->x_off) + (size_t)t * nb, c->n_in);
    float *want = malloc(sizeof(float) * (size_t)c->n_tok * c->n_out);
    memcpy(want, out0, sizeof(float) * (size_t)c->n_tok * c->n_out);
    oracle_matmul(w, DUET_DTYPE_Q8_0, NULL, (const duet_block_q8_0 *)(xq + c->x_off), c->bias ? bias : NULL,
                  c->acc, c->n_tok, c->n_in, c->n_out, want);
    solo s = {.be = vk};
    int wi = solo_buf(&s, wbytes, w), xi = solo_buf(&s, xbytes, xq), bi = solo_buf(&s, (size_t)c->n_out * 4, bias),
        oi = solo_buf(&s, (size_t)c->n_tok * c->n_out * 4, out0);
    duet_op op = {.kind = DUET_OP_MATMUL, .n_tokens = c->n_tok};
    op.matmul.w = sv(&s, wi);
    op.matmul.dtype = DUET_DTYPE_Q8_0;
    op.matmul.x_q8 = (duet_view){s.b[xi], c->x_off};
    op.matmul.bias = c->bias ? sv(&s, bi) : (duet_view){0};
    op.matmul.accumulate = c->acc;
    op.matmul.n_in = c->n_in;
    op.matmul.n_out = c->n_out;
    op.matmul.out = sv(&s, oi);
    solo_run(vk, &op, 1);
    long st[5];
    duet__vk_stats(vk, st);
    ck_assert_msg(st[0] == 1, "%s: %ld dispatches for a matmul of q8_0 activations: a quantize pass ran", tune, st[0]);
    float *got = solo_get(&s, oi);
    double e = nmse(want, got, (size_t)c->n_tok * c->n_out);
    ck_assert_msg(e < 1e-12, "%s: x_q8 matmul %dx%d->%d (x at +%zu): NMSE %g", tune, c->n_tok, c->n_in, c->n_out, c->x_off,
                  e);
    free(got), free(w), free(xf), free(bias), free(out0), free(xq), free(want);
    solo_free(&s);
}

START_TEST(matmul_q8_activations) {
    duet_backend *probe = open_vk();
    if (!probe) return;
    bool has_dot = probe->info.int8_dot;
    duet_backend_close(probe);
    const char *tunes[] = {"matmul=tile,dot=0",
                           "matmul=subgroup,dot=0,mm_min=0",
                           "matmul=subgroup,dot=0,mm_min=2,mm_bm=16,mm_bn=8",
                           "matmul=tile,dot=1",
                           "matmul=subgroup,dot=1,mm_min=0",
                           "matmul=subgroup,dot=1,mm_min=2,mm_bm=32,mm_bn=16"};
    const xq_case cases[] = {
        {2, 256, 40, 2, false, true}, /* GEMV */
        {40, 160, 70, 2, true, true}, /* GEMM tiles: ragged rows, tokens and blocks */
    };
    for (int k = 0; k < 6; k++) {
        if (k >= 3 && !has_dot) continue;
        duet_backend *vk = open_tuned(tunes[k]);
        for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) check_matmul_xq8(vk, &cases[i], tunes[k]);
        duet_backend_close(vk);
    }
}
END_TEST

/* A decode layer with INT8 activations and a q8_0 KV cache under the
 * Khronos validation layer with synchronization checks: rmsnorm -> q8_0
 * blocks -> three matmuls -> rope_kv into q8_0 pages -> attention (split,
 * with its reduce pass) -> q8_0 blocks -> matmul (+residual) -> swiglu ->
 * q8_0 blocks -> matmul. No error may be reported. */
START_TEST(validation_int8_layer) {
    setenv("DUET_VK_VALIDATION", "1", 1);
    setenv("DUET_VK_TUNE", "attn_par=64,attn_chunk=16", 1);
    duet_backend *vk = open_vk();
    unsetenv("DUET_VK_TUNE");
    if (!vk) return;
    ck_assert_msg(duet__vk_validation_errors() == 0, "validation must be on and clean (got %d)", duet__vk_validation_errors());
    const int E = 256, H = 4, HD = 64, n = 3;
    paged p = {.nh = H, .nkv = H, .hd = HD, .bs = 16, .n_blocks = 8, .n_seqs = 2, .max_blocks = 4, .dt = DUET_DTYPE_Q8_0};
    paged_init(&p);
    solo s = {.be = vk};
    paged_dev d = paged_upload(&s, &p);
    size_t wb;
    void *w = rand_weights(DUET_DTYPE_Q8_0, E, E, &wb);
    float *x = rand_f32((size_t)n * E), *nw = rand_f32(E);
    int32_t pos[3] = {40, 41, 7}, seq[3] = {0, 0, 1};
    int wi = solo_buf(&s, wb, w), xi = solo_buf(&s, (size_t)n * E * 4, x), nwi = solo_buf(&s, E * 4, nw),
        xq = solo_buf(&s, (size_t)n * E / 32 * 34, NULL), qi = solo_buf(&s, (size_t)n * E * 4, NULL),
        ki = solo_buf(&s, (size_t)n * E * 4, NULL), vi = solo_buf(&s, (size_t)n * E * 4, NULL),
        pi = solo_buf(&s, sizeof pos, pos), si = solo_buf(&s, sizeof seq, seq), ai = solo_buf(&s, (size_t)n * E * 4, NULL),
        gi = solo_buf(&s, (size_t)n * E * 4, NULL);
    free(w), free(x), free(nw);
    duet_op ops[9];
    memset(ops, 0, sizeof ops);
    for (int i = 0; i < 9; i++) ops[i].n_tokens = n;
    ops[0].kind = DUET_OP_RMSNORM;
    ops[0].rmsnorm.x = sv(&s, xi), ops[0].rmsnorm.w = sv(&s, nwi), ops[0].rmsnorm.out_q8 = sv(&s, xq);
    ops[0].rmsnorm.dim = E, ops[0].rmsnorm.eps = 1e-5f;
    for (int i = 1; i <= 3; i++) {
        ops[i].kind = DUET_OP_MATMUL;
        ops[i].matmul.w = sv(&s, wi), ops[i].matmul.dtype = DUET_DTYPE_Q8_0, ops[i].matmul.x_q8 = sv(&s, xq);
        ops[i].matmul.n_in = ops[i].matmul.n_out = E;
        ops[i].matmul.out = sv(&s, i == 1 ? qi : i == 2 ? ki : vi);
    }
    ops[4].kind = DUET_OP_ROPE_KV;
    ops[4].rope_kv.q = sv(&s, qi), ops[4].rope_kv.k = sv(&s, ki), ops[4].rope_kv.v = sv(&s, vi);
    ops[4].rope_kv.pos = sv(&s, pi), ops[4].rope_kv.seq = sv(&s, si), ops[4].rope_kv.kv = paged_view(&s, &p, d);
    ops[4].rope_kv.n_head = ops[4].rope_kv.n_head_kv = H, ops[4].rope_kv.head_dim = ops[4].rope_kv.n_rot = HD;
    float fr[32]; /* HD / 2 */
    oracle_rope_freqs(10000.0f, HD, fr);
    ops[4].rope_kv.freqs = sv(&s, solo_buf(&s, sizeof fr, fr));
    ops[5].kind = DUET_OP_ATTENTION;
    ops[5].attention.q = sv(&s, qi), ops[5].attention.pos = sv(&s, pi), ops[5].attention.seq = sv(&s, si);
    ops[5].attention.kv = ops[4].rope_kv.kv, ops[5].attention.n_head = ops[5].attention.n_head_kv = H;
    ops[5].attention.head_dim = HD, ops[5].attention.scale = 0.125f, ops[5].attention.out_q8 = sv(&s, xq);
    ops[6].kind = DUET_OP_MATMUL;
    ops[6].matmul.w = sv(&s, wi), ops[6].matmul.dtype = DUET_DTYPE_Q8_0, ops[6].matmul.x_q8 = sv(&s, xq);
    ops[6].matmul.n_in = ops[6].matmul.n_out = E, ops[6].matmul.accumulate = true, ops[6].matmul.out = sv(&s, xi);
    ops[7].kind = DUET_OP_SWIGLU;
    ops[7].swiglu.gate = sv(&s, xi), ops[7].swiglu.up = sv(&s, ai), ops[7].swiglu.out = sv(&s, gi);
    ops[7].swiglu.out_q8 = sv(&s, xq), ops[7].swiglu.dim = E;
    ops[8] = ops[6];
    ops[8].matmul.out = sv(&s, ai);
    for (int step = 0; step < 2; step++) solo_run(vk, ops, 9);
    float *a = solo_get(&s, ai);
    for (int i = 0; i < n * E; i++) ck_assert_msg(isfinite(a[i]), "output %d is %g", i, a[i]);
    free(a);
    solo_free(&s);
    paged_free(&p);
    duet_backend_close(vk);
    ck_assert_msg(duet__vk_validation_errors() == 0, "the validation layer reported %d error(s) (see stderr)",
                  duet__vk_validation_errors());
}
END_TEST

/* Real sizes past lavapipe's 128 MiB maxStorageBufferRange: the 7b model's
 * f16 output matrix (32000 x 4096, 262 MB) and the 1b model's embedding
 * table in f32 (32000 x 2048, 262 MB). */
typedef struct big_ctx {
    int w, x, out, tab, tok, emb;
} big_ctx;

static bool make_big_ops(const twin *t, int b, int i, duet_op *op, const void *p) {
    const big_ctx *c = p;
    if (i == 0) {
        *op = (duet_op){.kind = DUET_OP_MATMUL, .n_tokens = 1};
        op->matmul.w = tv(t, b, c->w, 0);
        op->matmul.dtype = DUET_DTYPE_F16;
        op->matmul.x = tv(t, b, c->x, 0);
        op->matmul.n_in = 4096;
        op->matmul.n_out = 32000;
        op->matmul.out = tv(t, b, c->out, 0);
        return true;
    }
    if (i == 1) {
        *op = (duet_op){.kind = DUET_OP_EMBED, .n_tokens = 3};
        op->embed.tokens = tv(t, b, c->tok, 0);
        op->embed.table = tv(t, b, c->tab, 0);
        op->embed.dtype = DUET_DTYPE_F32;
        op->embed.dim = 2048;
        op->embed.out = tv(t, b, c->emb, 0);
        return true;
    }
    return false;
}

START_TEST(tensors_over_128mib) {
    duet_backend *vk = open_vk();
    if (!vk) return;
    twin t = {.vk = vk};
    big_ctx c;
    size_t wbytes;
    void *w = rand_weights(DUET_DTYPE_F16, 32000, 4096, &wbytes);
    ck_assert_uint_gt(wbytes, (size_t)128 << 20);
    float *x = rand_f32(4096);
    c.w = twin_buf(&t, wbytes, w);
    c.x = twin_buf(&t, 4096 * 4, x);
    c.out = twin_buf(&t, 32000 * 4, NULL);
    free(w), free(x);
    float *tab = rand_f32((size_t)32000 * 2048);
    int32_t tok[3] = {0, 17000, 31999}; /* rows past 128 MiB */
    c.tab = twin_buf(&t, (size_t)32000 * 2048 * 4, tab);
    c.tok = twin_buf(&t, sizeof tok, tok);
    c.emb = twin_buf(&t, 3 * 2048 * 4, NULL);
    free(tab);
    twin_run(&t, make_big_ops, &c);
    double e;
    ck_assert_msg((e = twin_nmse(&t, c.out, 0, 32000)) < 1e-11, "262 MB f16 matmul NMSE %g", e);
    ck_assert_msg((e = twin_nmse(&t, c.emb, 0, 3 * 2048)) == 0, "262 MB table embed NMSE %g", e);
    twin_free(&t);
    duet_backend_close(vk);
}
END_TEST

/* The pipeline cache is written to $XDG_CACHE_HOME/duet/vulkan at close
 * (when the driver has anything to cache), and a damaged file does not stop
 * the next open. */
static bool make_add(const twin *t, int b, int i, duet_op *op, const void *p) {
    const int *ids = p;
    if (i > 0) return false;
    *op = (duet_op){.kind = DUET_OP_ADD, .n_tokens = 2};
    op->add.a = tv(t, b, ids[0], 0);
    op->add.b = tv(t, b, ids[1], 0);
    op->add.out = tv(t, b, ids[2], 0);
    op->add.dim = 33;
    return true;
}

static void run_add(duet_backend *vk) {
    twin t = {.vk = vk};
    float *a = rand_f32(66), *b = rand_f32(66);
    int ids[3] = {twin_buf(&t, 66 * 4, a), twin_buf(&t, 66 * 4, b), twin_buf(&t, 66 * 4, NULL)};
    free(a), free(b);
    twin_run(&t, make_add, ids);
    ck_assert_msg(twin_nmse(&t, ids[2], 0, 66) == 0, "add differs");
    twin_free(&t);
}

START_TEST(pipeline_cache_on_disk) {
    char dir[512], sub[600];
    snprintf(dir, sizeof dir, "%s/test_vulkan_cache_%d", DUET_BINARY_DIR, (int)getpid());
    snprintf(sub, sizeof sub, "%s/duet/vulkan", dir);
    setenv("XDG_CACHE_HOME", dir, 1);
    duet_backend *vk = open_vk();
    if (!vk) return;
    char path[1024];
    snprintf(path, sizeof path, "%s", duet__vk_pipeline_cache_path(vk));
    ck_assert_msg(strncmp(path, sub, strlen(sub)) == 0, "cache path %s is not under %s", path, sub);
    run_add(vk);
    duet_backend_close(vk);
    /* Either the driver had pipelines to cache and the file starts with
     * this device's header, or it had none (lavapipe) and nothing was made. */
    char file[1024] = "";
    DIR *d = opendir(sub);
    if (d) {
        for (struct dirent *e; (e = readdir(d));)
            if (strstr(e->d_name, ".bin") && !strstr(e->d_name, ".tmp")) snprintf(file, sizeof file, "%s/%s", sub, e->d_name);
        closedir(d);
        ck_assert_msg(file[0], "%s exists but holds no cache file", sub);
        size_t len = 0;
        char *data = test_read_file(file, &len);
        ck_assert_msg(data && len > 32, "cache file %s is %zu bytes", file, len);
        uint32_t h[2];
        memcpy(h, data, sizeof h);
        ck_assert_msg(h[0] >= 32 && h[1] == 1, "cache file %s lacks a pipeline cache header", file);
        free(data);
    } else {
        struct stat sb;
        snprintf(sub, sizeof sub, "%s/duet", dir);
        ck_assert_msg(stat(sub, &sb) != 0, "no cache file, yet %s was created", sub);
        snprintf(sub, sizeof sub, "%s/duet/vulkan", dir);
    }
    /* A damaged file does not stop the next open. */
    char mk[700];
    snprintf(mk, sizeof mk, "%s/duet", dir);
    mkdir(dir, 0755), mkdir(mk, 0755), mkdir(sub, 0755);
    snprintf(file, sizeof file, "%s", path);
    FILE *f = fopen(file, "wb");
    ck_assert(f);
    fputs("not a pipeline cache", f);
    fclose(f);
    ck_assert_msg(duet_backend_open("vulkan", 0, NULL, &vk) == DUET_OK, "open with a bad cache: %s", duet_last_error());
    run_add(vk);
    duet_backend_close(vk);
    remove(file);
    rmdir(sub);
    rmdir(mk);
    rmdir(dir);
}
END_TEST

/* Barriers only where data depends: three matmuls that read the same x and
 * write different outputs run without one; an op reading their outputs
 * gets exactly one. */
typedef struct qkv_ctx {
    int x, w, q, k, v, sum;
} qkv_ctx;

static bool make_qkv(const twin *t, int b, int i, duet_op *op, const void *p) {
    const qkv_ctx *c = p;
    if (i < 3) {
        *op = (duet_op){.kind = DUET_OP_MATMUL, .n_tokens = 2};
        op->matmul.w = tv(t, b, c->w, 0);
        op->matmul.dtype = DUET_DTYPE_F32;
        op->matmul.x = tv(t, b, c->x, 0);
        op->matmul.n_in = 64;
        op->matmul.n_out = 64;
        op->matmul.out = tv(t, b, i == 0 ? c->q : i == 1 ? c->k : c->v, 0);
        return true;
    }
    if (i == 3) {
        *op = (duet_op){.kind = DUET_OP_ADD, .n_tokens = 2};
        op->add.a = tv(t, b, c->q, 0);
        op->add.b = tv(t, b, c->k, 0);
        op->add.out = tv(t, b, c->sum, 0);
        op->add.dim = 64;
        return true;
    }
    if (i == 4) { /* reads v and writes x, which the matmuls read: ordered by the same barrier */
        *op = (duet_op){.kind = DUET_OP_ADD, .n_tokens = 2};
        op->add.a = tv(t, b, c->v, 0);
        op->add.b = tv(t, b, c->v, 0);
        op->add.out = tv(t, b, c->x, 0);
        op->add.dim = 64;
        return true;
    }
    return false;
}

START_TEST(barriers_where_data_depends) {
    duet_backend *vk = open_vk();
    if (!vk) return;
    twin t = {.vk = vk};
    float *x = rand_f32(128), *w = rand_f32(64 * 64);
    qkv_ctx c = {.x = twin_buf(&t, 128 * 4, x), .w = twin_buf(&t, 64 * 64 * 4, w)};
    c.q = twin_buf(&t, 128 * 4, NULL);
    c.k = twin_buf(&t, 128 * 4, NULL);
    c.v = twin_buf(&t, 128 * 4, NULL);
    c.sum = twin_buf(&t, 128 * 4, NULL);
    free(x), free(w);
    twin_run(&t, make_qkv, &c);
    long st[5];
    duet__vk_stats(vk, st);
    ck_assert_msg(st[0] == 5, "%ld dispatches, want 5", st[0]);
    ck_assert_msg(st[1] == 1, "%ld barriers, want 1 (before the first add only)", st[1]);
    ck_assert_msg(twin_nmse(&t, c.sum, 0, 128) < 1e-12, "q + k differs");
    ck_assert_msg(twin_nmse(&t, c.x, 0, 128) < 1e-12, "v + v differs");
    twin_free(&t);
    duet_backend_close(vk);
}
END_TEST

/* A step repeated allocates nothing: no buffers (scratch included), no
 * pipelines, no descriptor sets after the first, and scratch_bytes stays
 * put. A decode layer with INT8 activations and paged f16 KV; each step
 * one position further. */
START_TEST(steady_state_allocates_nothing) {
    duet_backend *vk = open_vk();
    if (!vk) return;
    const int E = 256, H = 4, HD = 64;
    paged p = {.nh = H, .nkv = H, .hd = HD, .bs = 16, .n_blocks = 4, .n_seqs = 1, .max_blocks = 4, .dt = DUET_DTYPE_F16};
    paged_init(&p);
    solo s = {.be = vk};
    paged_dev d = paged_upload(&s, &p);
    size_t tb, wb;
    void *tab = rand_weights(DUET_DTYPE_Q8_0, 50, E, &tb), *w = rand_weights(DUET_DTYPE_Q8_0, E, E, &wb);
    float *nw = rand_f32(E);
    int32_t tok = 7, pos = 0, seq = 0;
    int toki = solo_buf(&s, 4, &tok), tabi = solo_buf(&s, tb, tab), wi = solo_buf(&s, wb, w), nwi = solo_buf(&s, E * 4, nw),
        xi = solo_buf(&s, E * 4, NULL), xq = solo_buf(&s, E / 32 * 34, NULL), qi = solo_buf(&s, E * 4, NULL),
        ki = solo_buf(&s, E * 4, NULL), vi = solo_buf(&s, E * 4, NULL), ai = solo_buf(&s, E * 4, NULL),
        gi = solo_buf(&s, E * 4, NULL), oi = solo_buf(&s, 4, NULL), pi = solo_buf(&s, 4, &pos), si = solo_buf(&s, 4, &seq);
    free(tab), free(w), free(nw);
    duet_op ops[12];
    memset(ops, 0, sizeof ops);
    for (int i = 0; i < 12; i++) ops[i].n_tokens = 1;
    ops[0].kind = DUET_OP_EMBED;
    ops[0].embed.tokens = sv(&s, toki), ops[0].embed.table = sv(&s, tabi), ops[0].embed.dtype = DUET_DTYPE_Q8_0;
    ops[0].embed.dim = E, ops[0].embed.out = sv(&s, xi);
    ops[1].kind = DUET_OP_RMSNORM;
    ops[1].rmsnorm.x = sv(&s, xi), ops[1].rmsnorm.w = sv(&s, nwi), ops[1].rmsnorm.out_q8 = sv(&s, xq);
    ops[1].rmsnorm.dim = E, ops[1].rmsnorm.eps = 1e-5f;
    for (int i = 2; i <= 4; i++) {
        ops[i].kind = DUET_OP_MATMUL;
        ops[i].matmul.w = sv(&s, wi), ops[i].matmul.dtype = DUET_DTYPE_Q8_0, ops[i].matmul.x_q8 = sv(&s, xq);
        ops[i].matmul.n_in = ops[i].matmul.n_out = E;
        ops[i].matmul.out = sv(&s, i == 2 ? qi : i == 3 ? ki : vi);
    }
    ops[5].kind = DUET_OP_ROPE_KV;
    ops[5].rope_kv.q = sv(&s, qi), ops[5].rope_kv.k = sv(&s, ki), ops[5].rope_kv.v = sv(&s, vi);
    ops[5].rope_kv.pos = sv(&s, pi), ops[5].rope_kv.seq = sv(&s, si), ops[5].rope_kv.kv = paged_view(&s, &p, d);
    ops[5].rope_kv.n_head = ops[5].rope_kv.n_head_kv = H, ops[5].rope_kv.head_dim = ops[5].rope_kv.n_rot = HD;
    float fr[32]; /* HD / 2 */
    oracle_rope_freqs(10000.0f, HD, fr);
    ops[5].rope_kv.freqs = sv(&s, solo_buf(&s, sizeof fr, fr));
    ops[6].kind = DUET_OP_ATTENTION;
    ops[6].attention.q = sv(&s, qi), ops[6].attention.pos = sv(&s, pi), ops[6].attention.seq = sv(&s, si);
    ops[6].attention.kv = ops[5].rope_kv.kv, ops[6].attention.n_head = ops[6].attention.n_head_kv = H;
    ops[6].attention.head_dim = HD, ops[6].attention.scale = 0.125f, ops[6].attention.out = sv(&s, ai);
    ops[6].attention.out_q8 = sv(&s, xq);
    ops[7].kind = DUET_OP_MATMUL;
    ops[7].matmul.w = sv(&s, wi), ops[7].matmul.dtype = DUET_DTYPE_Q8_0, ops[7].matmul.x_q8 = sv(&s, xq);
    ops[7].matmul.n_in = ops[7].matmul.n_out = E, ops[7].matmul.accumulate = true, ops[7].matmul.out = sv(&s, xi);
    ops[8].kind = DUET_OP_SWIGLU;
    ops[8].swiglu.gate = sv(&s, xi), ops[8].swiglu.up = sv(&s, ai), ops[8].swiglu.out = sv(&s, gi);
    ops[8].swiglu.out_q8 = sv(&s, xq), ops[8].swiglu.dim = E;
    ops[9] = ops[7];
    ops[9].matmul.out = sv(&s, gi);
    ops[10].kind = DUET_OP_MATMUL; /* f32 activations: the quantize pass */
    ops[10].matmul.w = sv(&s, wi), ops[10].matmul.dtype = DUET_DTYPE_Q8_0, ops[10].matmul.x = sv(&s, gi);
    ops[10].matmul.n_in = ops[10].matmul.n_out = E, ops[10].matmul.out = sv(&s, ai);
    ops[11].kind = DUET_OP_ARGMAX;
    ops[11].argmax.x = sv(&s, ai), ops[11].argmax.out = sv(&s, oi), ops[11].argmax.dim = E;
    long first[5], now[5];
    size_t scratch0 = 0;
    for (int step = 0; step < 6; step++) {
        pos = step;
        duet_buffer_upload(vk, s.b[pi], 0, &pos, 4);
        solo_run(vk, ops, 12);
        /* argmax against the host's pick from the row it read. */
        float *a = solo_get(&s, ai);
        int32_t *got = solo_get(&s, oi);
        int best = 0;
        for (int j = 1; j < E; j++)
            if (a[j] > a[best]) best = j;
        ck_assert_msg(*got == best, "step %d: argmax %d, want %d", step, *got, best);
        free(a), free(got);
        duet__vk_stats(vk, step == 0 ? first : now);
        if (step == 0) {
            scratch0 = duet_backend_scratch_bytes(vk);
            continue;
        }
        ck_assert_msg(now[2] == first[2], "step %d created pipelines (%ld -> %ld)", step, first[2], now[2]);
        ck_assert_msg(now[3] == first[3], "step %d created descriptor sets (%ld -> %ld)", step, first[3], now[3]);
        ck_assert_msg(now[4] == first[4], "step %d created buffers (%ld -> %ld)", step, first[4], now[4]);
        ck_assert_msg(duet_backend_scratch_bytes(vk) == scratch0, "step %d: scratch grew %zu -> %zu", step, scratch0,
                      duet_backend_scratch_bytes(vk));
    }
    solo_free(&s);
    paged_free(&p);
    duet_backend_close(vk);
}
END_TEST

/* Index inputs: checked on the host when their values are known at record
 * time (an error from the op, as on the cpu backend), in the shader when an
 * earlier op of the step writes them (an error from wait(), zeros out). */
START_TEST(index_errors) {
    duet_backend *vk = open_vk();
    if (!vk) return;
    duet_buffer *tok, *tab, *out, *x;
    ck_assert_int_eq(duet_buffer_alloc(vk, 8, &tok), DUET_OK);
    ck_assert_int_eq(duet_buffer_alloc(vk, 50 * 16 * 4, &tab), DUET_OK);
    ck_assert_int_eq(duet_buffer_alloc(vk, 2 * 16 * 4, &out), DUET_OK);
    ck_assert_int_eq(duet_buffer_alloc(vk, 100 * 4, &x), DUET_OK);
    float *data = rand_f32(50 * 16);
    ck_assert_int_eq(duet_buffer_upload(vk, tab, 0, data, 50 * 16 * 4), DUET_OK);
    free(data);
    duet_op emb = {.kind = DUET_OP_EMBED, .n_tokens = 1};
    emb.embed.tokens = (duet_view){tok, 0};
    emb.embed.table = (duet_view){tab, 0};
    emb.embed.dtype = DUET_DTYPE_F32;
    emb.embed.dim = 16;
    emb.embed.out = (duet_view){out, 0};

    int32_t bad = 50;
    ck_assert_int_eq(duet_buffer_upload(vk, tok, 0, &bad, 4), DUET_OK);
    ck_assert_int_eq(duet_step_begin(vk), DUET_OK);
    ck_assert_int_eq(duet_step_op(vk, &emb), DUET_INVALID_ARGUMENT);
    ck_assert_msg(strstr(duet_last_error(), "token 0 is 50"), "%s", duet_last_error());
    ck_assert_int_eq(duet_step_submit(vk), DUET_OK);
    ck_assert_int_eq(duet_step_wait(vk), DUET_OK);

    /* argmax writes 90 into the token buffer, then embed reads it. */
    float xs[100] = {0};
    xs[90] = 5.0f;
    ck_assert_int_eq(duet_buffer_upload(vk, x, 0, xs, sizeof xs), DUET_OK);
    duet_op am = {.kind = DUET_OP_ARGMAX, .n_tokens = 1};
    am.argmax.x = (duet_view){x, 0};
    am.argmax.out = (duet_view){tok, 0};
    am.argmax.dim = 100;
    float junk[16];
    for (int i = 0; i < 16; i++) junk[i] = 1.0f;
    ck_assert_int_eq(duet_buffer_upload(vk, out, 0, junk, sizeof junk), DUET_OK);
    ck_assert_int_eq(duet_step_begin(vk), DUET_OK);
    ck_assert_int_eq(duet_step_op(vk, &am), DUET_OK);
    ck_assert_msg(duet_step_op(vk, &emb) == DUET_OK, "recording must succeed: %s", duet_last_error());
    ck_assert_int_eq(duet_step_submit(vk), DUET_OK);
    ck_assert_int_eq(duet_step_wait(vk), DUET_INVALID_ARGUMENT);
    ck_assert_msg(strstr(duet_last_error(), "token id"), "%s", duet_last_error());
    float got[16];
    ck_assert_int_eq(duet_buffer_download(vk, out, 0, got, sizeof got), DUET_OK);
    for (int i = 0; i < 16; i++) ck_assert_msg(got[i] == 0.0f, "out[%d] = %g, want 0", i, got[i]);

    /* The next good step is clean. */
    int32_t good = 3;
    ck_assert_int_eq(duet_buffer_upload(vk, tok, 0, &good, 4), DUET_OK);
    ck_assert_int_eq(duet_step_begin(vk), DUET_OK);
    ck_assert_int_eq(duet_step_op(vk, &emb), DUET_OK);
    ck_assert_int_eq(duet_step_submit(vk), DUET_OK);
    ck_assert_msg(duet_step_wait(vk) == DUET_OK, "%s", duet_last_error());
    duet_buffer_free(vk, tok), duet_buffer_free(vk, tab), duet_buffer_free(vk, out), duet_buffer_free(vk, x);
    duet_backend_close(vk);
}
END_TEST

/* Misuse gets an error, never a crash. */
START_TEST(protocol_errors) {
    duet_backend *vk = open_vk();
    if (!vk) return;
    duet_buffer *b;
    ck_assert_int_eq(duet_buffer_alloc(vk, 64, &b), DUET_OK);
    duet_op op = {.kind = DUET_OP_ADD, .n_tokens = 1};
    op.add.a = op.add.b = op.add.out = (duet_view){b, 0};
    op.add.dim = 16;
    ck_assert_int_eq(duet_step_op(vk, &op), DUET_INVALID_ARGUMENT); /* no begin */
    ck_assert_int_eq(duet_step_begin(vk), DUET_OK);
    ck_assert_int_eq(duet_step_begin(vk), DUET_INVALID_ARGUMENT);
    char buf[64] = {0};
    ck_assert_int_eq(duet_buffer_upload(vk, b, 0, buf, 64), DUET_INVALID_ARGUMENT); /* inside a step */
    op.add.dim = 17;                                                                 /* 68 bytes > 64 */
    ck_assert_int_eq(duet_step_op(vk, &op), DUET_INVALID_ARGUMENT);
    ck_assert_int_eq(duet_step_submit(vk), DUET_OK);
    ck_assert_int_eq(duet_step_wait(vk), DUET_OK);
    ck_assert_int_eq(duet_buffer_download(vk, b, 8, buf, 64), DUET_INVALID_ARGUMENT);
    duet_buffer *huge = NULL;
    ck_assert_int_eq(duet_buffer_alloc(vk, (size_t)1 << 42, &huge), DUET_OUT_OF_MEMORY);
    ck_assert_ptr_null(huge);
    ck_assert_msg(strstr(duet_last_error(), "bytes"), "%s", duet_last_error());
    duet_buffer_free(vk, b);
    duet_backend_close(vk);
}
END_TEST

/* No driver: the backend says why it is unavailable, the rest works. */
START_TEST(no_driver) {
    if (getenv("CK_FORK") && strcmp(getenv("CK_FORK"), "no") == 0) {
        fprintf(stderr, "test_vulkan: no_driver needs a fresh process (CK_FORK=no), skipped\n");
        return;
    }
    setenv("VK_ICD_FILENAMES", "/nonexistent/duet_test_icd.json", 1);
    setenv("VK_DRIVER_FILES", "/nonexistent/duet_test_icd.json", 1);
    const duet_backend_iface *vk = duet_backend_find("vulkan");
    ck_assert_msg(vk, "the vulkan backend is compiled in");
    char why[256] = "";
    ck_assert_msg(!vk->available(why, sizeof why), "no ICD, yet vulkan says it is available");
    ck_assert_msg(why[0], "the reason must be given");
    duet_backend *be = NULL;
    ck_assert_int_eq(duet_backend_open("vulkan", 0, NULL, &be), DUET_NO_DEVICE);
    ck_assert_msg(strstr(duet_last_error(), "unavailable"), "%s", duet_last_error());
    char text[8192];
    duet_devices_describe(text, sizeof text, false);
    ck_assert_msg(strstr(text, "unavailable"), "duet devices must say vulkan is unavailable:\n%s", text);
    ck_assert_int_eq(duet_backend_open("cpu", 0, NULL, &be), DUET_OK);
    duet_backend_close(be);
}
END_TEST

/* DUET_VK_TEST=substring runs only the tests whose name contains it. */
#define ADD(tc, fn)                                                                                          \
    do {                                                                                                     \
        const char *only_ = getenv("DUET_VK_TEST");                                                          \
        if (!only_ || strstr(#fn, only_)) tcase_add_test(tc, fn);                                            \
    } while (0)

int main(void) {
    Suite *s = suite_create("vulkan");
    /* One ctest test per case (tests/check_tests.cmake reads the names from
     * the tcase_create calls, so they stay literal). */
    TCase *cases[4] = {tcase_create("device"), tcase_create("validation"), tcase_create("matmul"),
                       tcase_create("attention")};
    for (int i = 0; i < 4; i++) {
        tcase_set_timeout(cases[i], 600);
        suite_add_tcase(s, cases[i]);
    }
    TCase *dev = cases[0], *val = cases[1], *mm = cases[2], *att = cases[3];
    ADD(dev, device_features);
    ADD(val, validation_forward_q8_0);
    ADD(val, validation_forward_f32);
    ADD(val, validation_forward_q8_kv);
    ADD(dev, tuning_table);
    ADD(mm, range_binding_small_limits);
    ADD(mm, range_binding_through_staging);
    ADD(mm, tensors_over_128mib);
    ADD(att, rope_kv_into_pages);
    ADD(att, rope_kv_pool_windows);
    ADD(att, bad_block_table_host);
    ADD(att, bad_block_table_device);
    ADD(att, scratch_linear_in_context);
    ADD(mm, q8_outputs_of_rmsnorm_swiglu);
    ADD(mm, matmul_q8_activations);
    ADD(val, validation_int8_layer);
    ADD(dev, pipeline_cache_on_disk);
    ADD(dev, barriers_where_data_depends);
    ADD(dev, steady_state_allocates_nothing);
    ADD(dev, index_errors);
    ADD(att, position_past_n_keys_device);
    ADD(dev, protocol_errors);
    ADD(dev, no_driver);
    return test_run_suite(s);
}
