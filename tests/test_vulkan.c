/* test_vulkan.c — what only the Vulkan backend has: the validation layer on
 * a real forward pass, device features and limits, tensors bound in ranges
 * (larger than maxStorageBufferRange, or than limits shrunk for the test),
 * the tuning table and its overrides (int8 dot products vs the fallback,
 * tile vs subgroup matmuls), the pipeline cache on disk, barriers only where
 * data depends, steady-state steps that allocate nothing, device-side index
 * checks, and a machine without a driver.
 *
 * Op-by-op parity over the shared case table is tests/test_backend_ops.c;
 * here every comparison also runs against the cpu backend.
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

static duet_backend *open_cpu(void) {
    duet_backend *be = NULL;
    ck_assert_msg(duet_backend_open("cpu", 0, NULL, &be) == DUET_OK, "open cpu: %s", duet_last_error());
    return be;
}

/* ---- the same operands on the cpu backend and on vulkan ---------------------------- */

typedef struct twin {
    duet_backend *be[2]; /* cpu, vulkan */
    duet_buffer *bufs[2][32];
    int n;
} twin;

/* A buffer of `size` bytes on both backends, holding `data` (or zeros). */
static int twin_buf(twin *t, size_t size, const void *data) {
    ck_assert_int_lt(t->n, 32);
    void *zero = data ? NULL : calloc(1, size ? size : 1);
    for (int b = 0; b < 2; b++) {
        duet_status st = duet_buffer_alloc(t->be[b], size, &t->bufs[b][t->n]);
        ck_assert_msg(st == DUET_OK, "alloc %zu bytes: %s", size, duet_last_error());
        st = duet_buffer_upload(t->be[b], t->bufs[b][t->n], 0, data ? data : zero, size);
        ck_assert_msg(st == DUET_OK, "upload: %s", duet_last_error());
    }
    free(zero);
    return t->n++;
}

static duet_view tv(const twin *t, int b, int i, size_t off) { return (duet_view){t->bufs[b][i], off}; }

static void twin_free(twin *t) {
    for (int b = 0; b < 2; b++)
        for (int i = 0; i < t->n; i++) duet_buffer_free(t->be[b], t->bufs[b][i]);
    t->n = 0;
}

/* Runs ops built by `make(t, backend, i, op)` (i = 0.. until it returns
 * false) as one step on each backend. */
typedef bool (*make_op_fn)(const twin *t, int b, int i, duet_op *op, const void *ctx);

static void twin_run(twin *t, make_op_fn make, const void *ctx) {
    for (int b = 0; b < 2; b++) {
        ck_assert_msg(duet_step_begin(t->be[b]) == DUET_OK, "begin: %s", duet_last_error());
        duet_op op;
        for (int i = 0; make(t, b, i, &op, ctx); i++) {
            duet_status st = duet_step_op(t->be[b], &op);
            ck_assert_msg(st == DUET_OK, "%s op %d: %s", b ? "vulkan" : "cpu", i, duet_last_error());
        }
        ck_assert_msg(duet_step_submit(t->be[b]) == DUET_OK, "submit: %s", duet_last_error());
        duet_status st = duet_step_wait(t->be[b]);
        ck_assert_msg(st == DUET_OK, "%s wait: %s", b ? "vulkan" : "cpu", duet_last_error());
    }
}

/* NMSE of vulkan's buffer i against the cpu's (n floats from byte off). */
static double twin_nmse(const twin *t, int i, size_t off, size_t n) {
    float *a = malloc(n * 4), *b = malloc(n * 4);
    ck_assert(a && b);
    ck_assert_int_eq(duet_buffer_download(t->be[0], t->bufs[0][i], off, a, n * 4), DUET_OK);
    ck_assert_msg(duet_buffer_download(t->be[1], t->bufs[1][i], off, b, n * 4) == DUET_OK, "download: %s",
                  duet_last_error());
    double num = 0, den = 0;
    for (size_t k = 0; k < n; k++) {
        ck_assert_msg(isfinite(b[k]), "element %zu is not finite", k);
        num += ((double)a[k] - b[k]) * ((double)a[k] - b[k]);
        den += (double)a[k] * a[k];
    }
    free(a), free(b);
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

/* ---- matmul checks ---------------------------------------------------------------------- */

typedef struct mm_case {
    duet_dtype dt;
    int n_tok, n_in, n_out;
    bool bias, acc;
} mm_case;

typedef struct mm_bufs {
    const mm_case *c;
    int w, x, bias, out;
} mm_bufs;

static bool make_matmul(const twin *t, int b, int i, duet_op *op, const void *ctx) {
    const mm_bufs *m = ctx;
    if (i > 0) return false;
    *op = (duet_op){.kind = DUET_OP_MATMUL, .n_tokens = m->c->n_tok};
    op->matmul.w = tv(t, b, m->w, 0);
    op->matmul.dtype = m->c->dt;
    op->matmul.x = tv(t, b, m->x, 0);
    op->matmul.bias = m->c->bias ? tv(t, b, m->bias, 0) : (duet_view){0};
    op->matmul.accumulate = m->c->acc;
    op->matmul.n_in = m->c->n_in;
    op->matmul.n_out = m->c->n_out;
    op->matmul.out = tv(t, b, m->out, 0);
    return true;
}

/* One matmul on both backends; returns the NMSE of the output. */
static double matmul_nmse(duet_backend *vk, const mm_case *c) {
    twin t = {.be = {open_cpu(), vk}};
    size_t wbytes;
    void *w = rand_weights(c->dt, c->n_out, c->n_in, &wbytes);
    float *x = rand_f32((size_t)c->n_tok * c->n_in), *bias = rand_f32((size_t)c->n_out),
          *out = rand_f32((size_t)c->n_tok * c->n_out);
    mm_bufs m = {.c = c};
    m.w = twin_buf(&t, wbytes, w);
    m.x = twin_buf(&t, (size_t)c->n_tok * c->n_in * 4, x);
    m.bias = twin_buf(&t, (size_t)c->n_out * 4, bias);
    m.out = twin_buf(&t, (size_t)c->n_tok * c->n_out * 4, out);
    free(w), free(x), free(bias), free(out);
    twin_run(&t, make_matmul, &m);
    double e = twin_nmse(&t, m.out, 0, (size_t)c->n_tok * c->n_out);
    twin_free(&t);
    duet_backend_close(t.be[0]);
    return e;
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

/* A tiny model, prefill and decode, on vulkan with the Khronos validation
 * layer (and its synchronization checks) on: no error may be reported, and
 * the logits must match the cpu backend's. */
static void forward_under_validation(const char *type, const char *kv_type, double tol) {
    setenv("DUET_VK_VALIDATION", "1", 1);
    duet_backend *vk = open_vk();
    if (!vk) return;
    duet_backend_close(vk);
    ck_assert_msg(duet__vk_validation_errors() == 0, "validation must be on and clean (got %d)",
                  duet__vk_validation_errors());
    char path[512];
    snprintf(path, sizeof path, "%s/test_vulkan_tiny_%s.gguf", DUET_BINARY_DIR, type);
    duet_mkmodel_params mp = {.shape = "tiny", .type = type, .seed = 7, .n_ctx = 64};
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

START_TEST(validation_forward_q8_0) { forward_under_validation("q8_0", "f16", 1e-6); }
END_TEST
START_TEST(validation_forward_f32) { forward_under_validation("f32", "f32", 1e-10); }
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
    unsetenv("DUET_VK_TUNE");
}
END_TEST

/* Q8_0 through OpSDotAccSat and through the portable fallback, on the tile
 * and the subgroup path: each must match the cpu backend, which quantizes
 * the activations the same way (so the bound is tight). The other dtypes on
 * the subgroup path too. */
START_TEST(matmul_paths_match_cpu) {
    duet_backend *probe = open_vk();
    if (!probe) return;
    bool has_dot = probe->info.int8_dot;
    duet_backend_close(probe);
    const char *tunes[] = {"matmul=tile,dot=0", "matmul=subgroup,dot=0", "matmul=tile,dot=1", "matmul=subgroup,dot=1"};
    const mm_case cases[] = {
        {DUET_DTYPE_Q8_0, 1, 768, 70, false, false},  /* tile-aligned decode */
        {DUET_DTYPE_Q8_0, 9, 512, 100, true, true},   /* prefill tiles, ragged rows */
        {DUET_DTYPE_Q8_0, 5, 96, 37, true, false},    /* rows not texel-aligned */
        {DUET_DTYPE_F16, 6, 264, 41, false, true},
        {DUET_DTYPE_BF16, 3, 136, 29, true, false},
        {DUET_DTYPE_F32, 4, 100, 33, true, true},
    };
    for (int k = 0; k < 4; k++) {
        if (k >= 2 && !has_dot) continue;
        setenv("DUET_VK_TUNE", tunes[k], 1);
        duet_backend *vk;
        ck_assert_msg(duet_backend_open("vulkan", 0, NULL, &vk) == DUET_OK, "%s: %s", tunes[k], duet_last_error());
        for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
            const mm_case *c = &cases[i];
            if (k >= 2 && c->dt != DUET_DTYPE_Q8_0) continue;
            double e = matmul_nmse(vk, c);
            double tol = c->dt == DUET_DTYPE_Q8_0 ? 1e-10 : 1e-11;
            ck_assert_msg(e < tol, "%s: %s %dx%d->%d: NMSE %g >= %g", tunes[k], duet_dtype_name(c->dt), c->n_tok,
                          c->n_in, c->n_out, e, tol);
        }
        duet_backend_close(vk);
    }
    unsetenv("DUET_VK_TUNE");
}
END_TEST

/* Tensors larger than a storage binding or a texel view are bound in
 * ranges. DUET_VK_LIMITS shrinks the device's limits so small tensors cross
 * them: weights over several texel views (matmul splits rows, embed splits
 * the table), an output over several storage bindings (matmul splits
 * tokens), a KV cache over several (rope_kv writes by sequence windows). */
typedef struct range_ctx {
    int w, x, out, tab, tok, emb, q, k, v, pos, seq, kc, vc, att;
    int n_tok, n_in, n_out, dim, n_seq_tok, hd, nh, n_ctx;
} range_ctx;

static bool make_range_ops(const twin *t, int b, int i, duet_op *op, const void *p) {
    const range_ctx *c = p;
    switch (i) {
    case 0:
        *op = (duet_op){.kind = DUET_OP_MATMUL, .n_tokens = c->n_tok};
        op->matmul.w = tv(t, b, c->w, 0);
        op->matmul.dtype = DUET_DTYPE_Q8_0;
        op->matmul.x = tv(t, b, c->x, 0);
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
    case 2:
        *op = (duet_op){.kind = DUET_OP_ROPE_KV, .n_tokens = c->n_seq_tok};
        op->rope_kv.q = tv(t, b, c->q, 0);
        op->rope_kv.k = tv(t, b, c->k, 0);
        op->rope_kv.v = tv(t, b, c->v, 0);
        op->rope_kv.pos = tv(t, b, c->pos, 0);
        op->rope_kv.seq = tv(t, b, c->seq, 0);
        op->rope_kv.k_cache = tv(t, b, c->kc, 0);
        op->rope_kv.v_cache = tv(t, b, c->vc, 0);
        op->rope_kv.kv_dtype = DUET_DTYPE_F32;
        op->rope_kv.n_head = op->rope_kv.n_head_kv = c->nh;
        op->rope_kv.head_dim = op->rope_kv.n_rot = c->hd;
        op->rope_kv.n_ctx = c->n_ctx;
        op->rope_kv.freq_base = 10000.0f;
        return true;
    case 3:
        *op = (duet_op){.kind = DUET_OP_ATTENTION, .n_tokens = c->n_seq_tok};
        op->attention.q = tv(t, b, c->q, 0);
        op->attention.pos = tv(t, b, c->pos, 0);
        op->attention.seq = tv(t, b, c->seq, 0);
        op->attention.k_cache = tv(t, b, c->kc, 0);
        op->attention.v_cache = tv(t, b, c->vc, 0);
        op->attention.kv_dtype = DUET_DTYPE_F32;
        op->attention.n_head = op->attention.n_head_kv = c->nh;
        op->attention.head_dim = c->hd;
        op->attention.n_ctx = c->n_ctx;
        op->attention.scale = 1.0f / sqrtf((float)c->hd);
        op->attention.out = tv(t, b, c->att, 0);
        return true;
    }
    return false;
}

static void check_range_binding(void) {
    /* Views of 32 KiB (a new one every 16 KiB), bindings of 16 KiB. */
    setenv("DUET_VK_LIMITS", "ssbo=16384,texel=32768", 1);
    duet_backend *vk = open_vk();
    if (!vk) return;
    twin t = {.be = {open_cpu(), vk}};
    range_ctx c = {.n_tok = 20, .n_in = 256, .n_out = 300, .dim = 64, .n_seq_tok = 6, .hd = 16, .nh = 2, .n_ctx = 64};
    size_t wbytes;
    void *w = rand_weights(DUET_DTYPE_Q8_0, c.n_out, c.n_in, &wbytes); /* 81600 bytes: 5 views */
    float *x = rand_f32((size_t)c.n_tok * c.n_in);
    c.w = twin_buf(&t, wbytes, w);
    c.x = twin_buf(&t, (size_t)c.n_tok * c.n_in * 4, x);
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
    /* KV: 3 sequences of 64 positions x 32 floats = 8 KiB each, 24 KiB in
     * all: two windows of storage bindings, one texel view. */
    const int kvw = c.nh * c.hd, n_seqs = 3;
    float *q = rand_f32((size_t)c.n_seq_tok * kvw), *k = rand_f32((size_t)c.n_seq_tok * kvw),
          *v = rand_f32((size_t)c.n_seq_tok * kvw), *cache = rand_f32((size_t)n_seqs * c.n_ctx * kvw);
    int32_t pos[6] = {0, 1, 0, 5, 63, 2}, seq[6] = {0, 0, 1, 1, 2, 2};
    c.q = twin_buf(&t, (size_t)c.n_seq_tok * kvw * 4, q);
    c.k = twin_buf(&t, (size_t)c.n_seq_tok * kvw * 4, k);
    c.v = twin_buf(&t, (size_t)c.n_seq_tok * kvw * 4, v);
    c.pos = twin_buf(&t, sizeof pos, pos);
    c.seq = twin_buf(&t, sizeof seq, seq);
    c.kc = twin_buf(&t, (size_t)n_seqs * c.n_ctx * kvw * 4, cache);
    c.vc = twin_buf(&t, (size_t)n_seqs * c.n_ctx * kvw * 4, cache);
    c.att = twin_buf(&t, (size_t)c.n_seq_tok * kvw * 4, NULL);
    free(q), free(k), free(v), free(cache);

    twin_run(&t, make_range_ops, &c);
    double e;
    ck_assert_msg((e = twin_nmse(&t, c.out, 0, (size_t)c.n_tok * c.n_out)) < 1e-10, "matmul NMSE %g", e);
    ck_assert_msg((e = twin_nmse(&t, c.emb, 0, (size_t)c.n_tok * c.dim)) == 0, "embed NMSE %g", e);
    ck_assert_msg((e = twin_nmse(&t, c.kc, 0, (size_t)n_seqs * c.n_ctx * kvw)) < 1e-12, "k cache NMSE %g", e);
    ck_assert_msg((e = twin_nmse(&t, c.vc, 0, (size_t)n_seqs * c.n_ctx * kvw)) == 0, "v cache NMSE %g", e);
    ck_assert_msg((e = twin_nmse(&t, c.att, 0, (size_t)c.n_seq_tok * kvw)) < 1e-10, "attention NMSE %g", e);
    long st[5];
    duet__vk_stats(vk, st);
    /* matmul: a quantize, then at least 3 row ranges x 2 token ranges;
     * embed: 4 table windows; rope_kv: 2 sequence windows; attention. */
    ck_assert_msg(st[0] >= 1 + 6 + 4 + 2 + 1, "only %ld dispatches: the ranges were not split", st[0]);
    twin_free(&t);
    duet_backend_close(t.be[0]);
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

/* Two paths the shared case table does not force: an f16 KV cache whose
 * rows have an odd length (neighbouring rows share a 32-bit word, written
 * with atomics), and attention with several lanes per (token, head) merging
 * through shared memory (the GPU entries' choice). */
typedef struct kv_ctx {
    int q, k, v, pos, seq, kc, vc, att;
    int n_tok, hd, nh, nkv, n_ctx;
    duet_dtype kvt;
} kv_ctx;

static bool make_kv_ops(const twin *t, int b, int i, duet_op *op, const void *p) {
    const kv_ctx *c = p;
    if (i == 0) {
        *op = (duet_op){.kind = DUET_OP_ROPE_KV, .n_tokens = c->n_tok};
        op->rope_kv.q = tv(t, b, c->q, 0);
        op->rope_kv.k = tv(t, b, c->k, 0);
        op->rope_kv.v = tv(t, b, c->v, 0);
        op->rope_kv.pos = tv(t, b, c->pos, 0);
        op->rope_kv.seq = tv(t, b, c->seq, 0);
        op->rope_kv.k_cache = tv(t, b, c->kc, 0);
        op->rope_kv.v_cache = tv(t, b, c->vc, 0);
        op->rope_kv.kv_dtype = c->kvt;
        op->rope_kv.n_head = c->nh;
        op->rope_kv.n_head_kv = c->nkv;
        op->rope_kv.head_dim = c->hd;
        op->rope_kv.n_rot = c->hd & ~1;
        op->rope_kv.n_ctx = c->n_ctx;
        op->rope_kv.freq_base = 10000.0f;
        op->rope_kv.neox = true;
        return true;
    }
    if (i == 1) {
        *op = (duet_op){.kind = DUET_OP_ATTENTION, .n_tokens = c->n_tok};
        op->attention.q = tv(t, b, c->q, 0);
        op->attention.pos = tv(t, b, c->pos, 0);
        op->attention.seq = tv(t, b, c->seq, 0);
        op->attention.k_cache = tv(t, b, c->kc, 0);
        op->attention.v_cache = tv(t, b, c->vc, 0);
        op->attention.kv_dtype = c->kvt;
        op->attention.n_head = c->nh;
        op->attention.n_head_kv = c->nkv;
        op->attention.head_dim = c->hd;
        op->attention.n_ctx = c->n_ctx;
        op->attention.scale = 1.0f / sqrtf((float)c->hd);
        op->attention.out = tv(t, b, c->att, 0);
        return true;
    }
    return false;
}

static void check_kv_case(duet_backend *vk, kv_ctx c) {
    twin t = {.be = {open_cpu(), vk}};
    const int qw = c.nh * c.hd, kvw = c.nkv * c.hd, es = c.kvt == DUET_DTYPE_F16 ? 2 : 4;
    float *q = rand_f32((size_t)c.n_tok * qw), *k = rand_f32((size_t)c.n_tok * kvw), *v = rand_f32((size_t)c.n_tok * kvw);
    int32_t pos[64], seq[64];
    ck_assert_int_le(c.n_tok, 64);
    for (int i = 0; i < c.n_tok; i++) pos[i] = i, seq[i] = 0; /* adjacent rows: shared words */
    c.q = twin_buf(&t, (size_t)c.n_tok * qw * 4, q);
    c.k = twin_buf(&t, (size_t)c.n_tok * kvw * 4, k);
    c.v = twin_buf(&t, (size_t)c.n_tok * kvw * 4, v);
    c.pos = twin_buf(&t, (size_t)c.n_tok * 4, pos);
    c.seq = twin_buf(&t, (size_t)c.n_tok * 4, seq);
    c.kc = twin_buf(&t, (size_t)c.n_ctx * kvw * es, NULL);
    c.vc = twin_buf(&t, (size_t)c.n_ctx * kvw * es, NULL);
    c.att = twin_buf(&t, (size_t)c.n_tok * qw * 4, NULL);
    free(q), free(k), free(v);
    twin_run(&t, make_kv_ops, &c);
    /* The caches, as raw f16 bits: every half of every shared word. */
    size_t bytes = (size_t)c.n_ctx * kvw * es;
    uint8_t *a = malloc(bytes), *b = malloc(bytes);
    for (int which = 0; which < 2; which++) {
        ck_assert_int_eq(duet_buffer_download(t.be[0], t.bufs[0][which ? c.vc : c.kc], 0, a, bytes), DUET_OK);
        ck_assert_int_eq(duet_buffer_download(t.be[1], t.bufs[1][which ? c.vc : c.kc], 0, b, bytes), DUET_OK);
        for (size_t i = 0; i < bytes / es; i++) {
            float x = es == 2 ? duet_fp16_to_fp32(((uint16_t *)a)[i]) : ((float *)a)[i];
            float y = es == 2 ? duet_fp16_to_fp32(((uint16_t *)b)[i]) : ((float *)b)[i];
            ck_assert_msg(fabsf(x - y) <= 1e-3f * (1 + fabsf(x)), "%s cache element %zu: %g vs cpu %g", which ? "v" : "k",
                          i, y, x);
        }
    }
    free(a), free(b);
    double e = twin_nmse(&t, c.att, 0, (size_t)c.n_tok * qw);
    ck_assert_msg(e < 1e-9, "attention NMSE %g", e);
    twin_free(&t);
    duet_backend_close(t.be[0]);
}

START_TEST(kv_odd_rows_and_split_attention) {
    duet_backend *vk = open_vk();
    if (!vk) return;
    /* kvw = 15 halves: rows start on odd halves every other token. */
    check_kv_case(vk, (kv_ctx){.n_tok = 9, .hd = 15, .nh = 3, .nkv = 1, .n_ctx = 16, .kvt = DUET_DTYPE_F16});
    duet_backend_close(vk);
    setenv("DUET_VK_TUNE", "attn_wg=16,attn_split=8", 1);
    ck_assert_msg(duet_backend_open("vulkan", 0, NULL, &vk) == DUET_OK, "%s", duet_last_error());
    check_kv_case(vk, (kv_ctx){.n_tok = 37, .hd = 64, .nh = 8, .nkv = 2, .n_ctx = 64, .kvt = DUET_DTYPE_F16});
    check_kv_case(vk, (kv_ctx){.n_tok = 20, .hd = 15, .nh = 3, .nkv = 3, .n_ctx = 32, .kvt = DUET_DTYPE_F32});
    duet_backend_close(vk);
    unsetenv("DUET_VK_TUNE");
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
    twin t = {.be = {open_cpu(), vk}};
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
    duet_backend_close(t.be[0]);
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
    twin t = {.be = {open_cpu(), vk}};
    float *a = rand_f32(66), *b = rand_f32(66);
    int ids[3] = {twin_buf(&t, 66 * 4, a), twin_buf(&t, 66 * 4, b), twin_buf(&t, 66 * 4, NULL)};
    free(a), free(b);
    twin_run(&t, make_add, ids);
    ck_assert_msg(twin_nmse(&t, ids[2], 0, 66) == 0, "add differs");
    twin_free(&t);
    duet_backend_close(t.be[0]);
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
    twin t = {.be = {open_cpu(), vk}};
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
    duet_backend_close(t.be[0]);
    duet_backend_close(vk);
}
END_TEST

/* A step repeated allocates nothing: no buffers (scratch included), no
 * pipelines, no descriptor sets after the first. Forward-pass ops, Q8_0. */
typedef struct layer_ctx {
    int tok, tab, x, xn, nw, wq, q, k, v, pos, seq, kc, vc, att, g, out;
} layer_ctx;

static bool make_layer(const twin *t, int b, int i, duet_op *op, const void *p) {
    const layer_ctx *c = p;
    const int E = 256, H = 4, HD = 64, CTX = 32;
    *op = (duet_op){.n_tokens = 1};
    switch (i) {
    case 0:
        op->kind = DUET_OP_EMBED;
        op->embed.tokens = tv(t, b, c->tok, 0);
        op->embed.table = tv(t, b, c->tab, 0);
        op->embed.dtype = DUET_DTYPE_Q8_0;
        op->embed.dim = E;
        op->embed.out = tv(t, b, c->x, 0);
        return true;
    case 1:
        op->kind = DUET_OP_RMSNORM;
        op->rmsnorm.x = tv(t, b, c->x, 0);
        op->rmsnorm.w = tv(t, b, c->nw, 0);
        op->rmsnorm.out = tv(t, b, c->xn, 0);
        op->rmsnorm.dim = E;
        op->rmsnorm.eps = 1e-5f;
        return true;
    case 2:
    case 3:
    case 4:
        op->kind = DUET_OP_MATMUL;
        op->matmul.w = tv(t, b, c->wq, 0);
        op->matmul.dtype = DUET_DTYPE_Q8_0;
        op->matmul.x = tv(t, b, c->xn, 0);
        op->matmul.n_in = E;
        op->matmul.n_out = E;
        op->matmul.out = tv(t, b, i == 2 ? c->q : i == 3 ? c->k : c->v, 0);
        return true;
    case 5:
        op->kind = DUET_OP_ROPE_KV;
        op->rope_kv.q = tv(t, b, c->q, 0);
        op->rope_kv.k = tv(t, b, c->k, 0);
        op->rope_kv.v = tv(t, b, c->v, 0);
        op->rope_kv.pos = tv(t, b, c->pos, 0);
        op->rope_kv.seq = tv(t, b, c->seq, 0);
        op->rope_kv.k_cache = tv(t, b, c->kc, 0);
        op->rope_kv.v_cache = tv(t, b, c->vc, 0);
        op->rope_kv.kv_dtype = DUET_DTYPE_F16;
        op->rope_kv.n_head = op->rope_kv.n_head_kv = H;
        op->rope_kv.head_dim = op->rope_kv.n_rot = HD;
        op->rope_kv.n_ctx = CTX;
        op->rope_kv.freq_base = 10000.0f;
        return true;
    case 6:
        op->kind = DUET_OP_ATTENTION;
        op->attention.q = tv(t, b, c->q, 0);
        op->attention.pos = tv(t, b, c->pos, 0);
        op->attention.seq = tv(t, b, c->seq, 0);
        op->attention.k_cache = tv(t, b, c->kc, 0);
        op->attention.v_cache = tv(t, b, c->vc, 0);
        op->attention.kv_dtype = DUET_DTYPE_F16;
        op->attention.n_head = op->attention.n_head_kv = H;
        op->attention.head_dim = HD;
        op->attention.n_ctx = CTX;
        op->attention.scale = 0.125f;
        op->attention.out = tv(t, b, c->att, 0);
        return true;
    case 7:
        op->kind = DUET_OP_MATMUL;
        op->matmul.w = tv(t, b, c->wq, 0);
        op->matmul.dtype = DUET_DTYPE_Q8_0;
        op->matmul.x = tv(t, b, c->att, 0);
        op->matmul.accumulate = true;
        op->matmul.n_in = E;
        op->matmul.n_out = E;
        op->matmul.out = tv(t, b, c->x, 0);
        return true;
    case 8:
        op->kind = DUET_OP_SWIGLU;
        op->swiglu.gate = tv(t, b, c->x, 0);
        op->swiglu.up = tv(t, b, c->xn, 0);
        op->swiglu.out = tv(t, b, c->g, 0);
        op->swiglu.dim = E;
        return true;
    case 9:
        op->kind = DUET_OP_ARGMAX;
        op->argmax.x = tv(t, b, c->g, 0);
        op->argmax.out = tv(t, b, c->out, 0);
        op->argmax.dim = E;
        return true;
    }
    return false;
}

START_TEST(steady_state_allocates_nothing) {
    duet_backend *vk = open_vk();
    if (!vk) return;
    twin t = {.be = {open_cpu(), vk}};
    layer_ctx c;
    size_t tb, wb;
    void *tab = rand_weights(DUET_DTYPE_Q8_0, 50, 256, &tb), *wq = rand_weights(DUET_DTYPE_Q8_0, 256, 256, &wb);
    float *nw = rand_f32(256);
    int32_t tok = 7, pos = 0, seq = 0;
    c.tok = twin_buf(&t, 4, &tok);
    c.tab = twin_buf(&t, tb, tab);
    c.wq = twin_buf(&t, wb, wq);
    c.nw = twin_buf(&t, 256 * 4, nw);
    free(tab), free(wq), free(nw);
    c.x = twin_buf(&t, 1024, NULL);
    c.xn = twin_buf(&t, 1024, NULL);
    c.q = twin_buf(&t, 1024, NULL);
    c.k = twin_buf(&t, 1024, NULL);
    c.v = twin_buf(&t, 1024, NULL);
    c.att = twin_buf(&t, 1024, NULL);
    c.g = twin_buf(&t, 1024, NULL);
    c.out = twin_buf(&t, 4, NULL);
    c.pos = twin_buf(&t, 4, &pos);
    c.seq = twin_buf(&t, 4, &seq);
    c.kc = twin_buf(&t, 32 * 256 * 2, NULL);
    c.vc = twin_buf(&t, 32 * 256 * 2, NULL);
    long first[5], now[5];
    for (int step = 0; step < 4; step++) {
        pos = step;
        for (int b = 0; b < 2; b++) duet_buffer_upload(t.be[b], t.bufs[b][c.pos], 0, &pos, 4);
        twin_run(&t, make_layer, &c);
        ck_assert_msg(twin_nmse(&t, c.x, 0, 256) < 1e-8, "step %d: residual NMSE %g", step, twin_nmse(&t, c.x, 0, 256));
        /* argmax against the host's pick from vulkan's own row (the cpu's
         * row may differ in the last bit, which could flip a near-tie). */
        float g[256];
        int32_t got;
        duet_buffer_download(vk, t.bufs[1][c.g], 0, g, sizeof g);
        duet_buffer_download(vk, t.bufs[1][c.out], 0, &got, 4);
        int best = 0;
        for (int j = 1; j < 256; j++)
            if (g[j] > g[best]) best = j;
        ck_assert_msg(got == best, "step %d: argmax %d, want %d", step, got, best);
        duet__vk_stats(vk, step == 0 ? first : now);
        if (step == 0) continue;
        ck_assert_msg(now[2] == first[2], "step %d created pipelines (%ld -> %ld)", step, first[2], now[2]);
        ck_assert_msg(now[3] == first[3], "step %d created descriptor sets (%ld -> %ld)", step, first[3], now[3]);
        ck_assert_msg(now[4] == first[4], "step %d created buffers (%ld -> %ld)", step, first[4], now[4]);
    }
    twin_free(&t);
    duet_backend_close(t.be[0]);
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

int main(void) {
    Suite *s = suite_create("vulkan");
    TCase *tc = tcase_create("vulkan");
    tcase_set_timeout(tc, 600);
    tcase_add_test(tc, device_features);
    tcase_add_test(tc, validation_forward_q8_0);
    tcase_add_test(tc, validation_forward_f32);
    tcase_add_test(tc, tuning_table);
    tcase_add_test(tc, matmul_paths_match_cpu);
    tcase_add_test(tc, range_binding_small_limits);
    tcase_add_test(tc, range_binding_through_staging);
    tcase_add_test(tc, tensors_over_128mib);
    tcase_add_test(tc, kv_odd_rows_and_split_attention);
    tcase_add_test(tc, pipeline_cache_on_disk);
    tcase_add_test(tc, barriers_where_data_depends);
    tcase_add_test(tc, steady_state_allocates_nothing);
    tcase_add_test(tc, index_errors);
    tcase_add_test(tc, protocol_errors);
    tcase_add_test(tc, no_driver);
    suite_add_tcase(s, tc);
    return test_run_suite(s);
}
