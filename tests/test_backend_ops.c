/* test_backend_ops.c — op parity: every case of tests/backend_ops_cases.h on
 * every device of every backend in the registry, under each of the
 * backend's tuning variants (bo_variants: every forced path), against the
 * oracle (tests/op_oracle.h).
 *
 * Per case: the operands go to the backend inside guard bytes and to the
 * oracle on the host; the outputs must match within a normalised mean
 * squared error per output kind, be finite where the oracle's are, leave
 * the guard bytes alone, and index outputs must match exactly. "not
 * supported" (supports_op says no) is counted apart from passed. The
 * oracle's answer for a case is computed once per process.
 *
 * One ctest test per backend (its variants, each a Check test of its own;
 * the forced attention kernels apart) and one for the HAL's contract
 * (bounds, n_keys, attention memory).
 *
 * Environment:
 *   DUET_REQUIRE_BACKENDS=opencl,vulkan  fail when a named backend is not
 *                                        compiled in or has no device (CI)
 *   DUET_OPS_BACKENDS=opencl             only these backends
 *   DUET_OPS_CASES=small                 only the BO_SMALL cases (simulators)
 *   DUET_OPS_FILTER=matmul               only cases whose label contains this
 *   DUET_OPS_VARIANTS=default            only the variants that force nothing
 *                                        (the backend as the environment sets
 *                                        it up); other values: only variants
 *                                        whose label contains the value, or
 *                                        with a leading '!', all but those
 *   DUET_OPS_SHARD=1/2                   only the variants whose index in
 *                                        bo_variants is 1 modulo 2 (runs
 *                                        split over processes, as under
 *                                        oclgrind)
 *   DUET_OPS_VERBOSE=1                   a line per case */
#include <math.h>
#include <pthread.h>

#include "backend_ops_cases.h"
#include "test_backends.h"
#include "test_util.h"

/* Leaks inside GPU drivers and their compilers (PoCL's and lavapipe's
 * LLVM, the loaders) are theirs, not ours: LeakSanitizer ignores them. */
const char *__lsan_default_suppressions(void) {
    return "leak:libpocl\nleak:libLLVM\nleak:libOpenCL\nleak:libclblast\nleak:liboclgrind\nleak:libvulkan\n";
}

/* DUET_OPS_BACKENDS leaves iface out. */
static bool excluded(const duet_backend_iface *iface) {
    const char *only = getenv("DUET_OPS_BACKENDS");
    return only && *only && !test_list_has(only, iface->name);
}

static bool verbose(void) {
    const char *v = getenv("DUET_OPS_VERBOSE");
    return v && *v && strcmp(v, "0") != 0;
}

static unsigned case_mask(void) {
    const char *v = getenv("DUET_OPS_CASES");
    return v && strcmp(v, "small") == 0 ? BO_SMALL : BO_TEST;
}

/* ---- the oracle's answer (backend_ops_cases.h: bo_answer, bo_dev_check) ---------------- */

static bo_answer answers[BO_N_CASES];

static const bo_answer *answer(int ci) {
    bo_answer *a = &answers[ci];
    if (!a->done) bo_answer_compute(&bo_cases[ci], ci, a);
    return a;
}

typedef enum { CASE_PASS, CASE_FAIL, CASE_UNSUPPORTED } case_result;

static case_result run_case(duet_backend *be, int ci, char *msg, size_t msg_size, double *nmse) {
    const bo_answer *a = answer(ci);
    bo_host h;
    bo_host_build(ci, &h);
    bo_dev got;
    case_result r = CASE_PASS;
    *nmse = 0;
    duet_status st = bo_dev_setup(be, &h, &got);
    if (st == DUET_OK && !duet_device_supports_op(be->iface, be->device_index, &got.op)) r = CASE_UNSUPPORTED;
    if (r == CASE_PASS && st == DUET_OK) st = bo_dev_run(&got, 1);
    if (r == CASE_PASS && st != DUET_OK) {
        snprintf(msg, msg_size, "%s: %s", duet_status_name(st), duet_last_error());
        r = CASE_FAIL;
    }
    if (r == CASE_PASS && !bo_dev_check(&got, &h, a, nmse, msg, msg_size)) r = CASE_FAIL;
    bo_dev_free(&got);
    bo_host_free(&h);
    return r;
}

/* ---- one variant on every device -------------------------------------------------------- */

/* DUET_OPS_VARIANTS or DUET_OPS_SHARD leaves v out. */
static bool variant_excluded(const bo_variant *v) {
    const char *shard = getenv("DUET_OPS_SHARD");
    int k, n;
    if (shard && sscanf(shard, "%d/%d", &k, &n) == 2 && n > 0 && (int)(v - bo_variants) % n != k) return true;
    const char *want = getenv("DUET_OPS_VARIANTS");
    if (!want || !*want) return false;
    if (strcmp(want, "default") == 0) return v->env != NULL;
    char label[600];
    bo_variant_label(v, label, sizeof label);
    if (want[0] == '!') return strstr(label, want + 1) != NULL;
    return !strstr(label, want);
}

/* Opens device dev under variant v (its variable set for the open only). */
static duet_status open_variant(const duet_backend_iface *iface, int dev, const bo_variant *v,
                                duet_backend **out) {
    char *saved = NULL;
    if (v->env) {
        const char *old = getenv(v->env);
        saved = old ? strdup(old) : NULL;
        setenv(v->env, v->value, 1);
    }
    duet_status st = iface->open(dev, &(duet_backend_params){.n_threads = v->n_threads}, out);
    if (v->env) {
        if (saved)
            setenv(v->env, saved, 1);
        else
            unsetenv(v->env);
    }
    free(saved);
    return st;
}

/* Runs v's cases on one device; returns the number of failures and keeps
 * the first failure's description. */
static int run_device(const duet_backend_iface *iface, int dev, const bo_variant *v, char *first,
                      size_t first_size) {
    char vl[600];
    bo_variant_label(v, vl, sizeof vl);
    duet_device_info info;
    if (v->int8_dot && (iface->device_info(dev, &info) != DUET_OK || !info.int8_dot)) {
        printf("%s/%d [%s]: not on this device (no int8 dot product)\n", iface->name, dev, vl);
        return 0;
    }
    duet_backend *be;
    duet_status st = open_variant(iface, dev, v, &be);
    if (st != DUET_OK) {
        snprintf(first, first_size, "%s/%d [%s]: open failed: %s", iface->name, dev, vl, duet_last_error());
        printf("FAIL %s\n", first);
        return 1;
    }
    if (v->proof && !strstr(be->info.driver, v->proof)) {
        printf("%s/%d [%s]: not on this device (it runs %s)\n", iface->name, dev, vl, be->info.driver);
        iface->close(be);
        return 0;
    }
    const unsigned mask = case_mask();
    const char *filter = getenv("DUET_OPS_FILTER");
    int pass = 0, fail = 0, unsup = 0;
    struct timespec t0, t1, c0, c1; /* wall and CPU time (the driver's threads too) */
    clock_gettime(CLOCK_MONOTONIC, &t0);
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &c0);
    for (int ci = 0; ci < BO_N_CASES; ci++) {
        const bo_case *c = &bo_cases[ci];
        if (!(c->modes & mask) || !bo_variant_runs(v, c)) continue;
        char label[160], msg[600] = "";
        bo_case_label(c, label, sizeof label);
        if (filter && *filter && !strstr(label, filter)) continue;
        double nmse = 0;
        case_result r = run_case(be, ci, msg, sizeof msg, &nmse);
        if (r == CASE_PASS) {
            pass++;
            if (verbose()) printf("  ok   %s/%d %-60s nmse %.2g\n", iface->name, dev, label, nmse);
        } else if (r == CASE_UNSUPPORTED) {
            unsup++;
            printf("  not supported  %s/%d %s\n", iface->name, dev, label);
        } else {
            fail++;
            printf("  FAIL %s/%d [%s] %s: %s\n", iface->name, dev, vl, label, msg);
            if (!first[0]) snprintf(first, first_size, "%s/%d [%s] %s: %s", iface->name, dev, vl, label, msg);
        }
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &c1);
    printf("%s/%d (%s) [%s]: %d passed, %d failed, %d not supported (%.1f s, %.1f s of CPU)\n", iface->name,
           dev, be->info.name, vl, pass, fail, unsup,
           (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec),
           (double)(c1.tv_sec - c0.tv_sec) + 1e-9 * (double)(c1.tv_nsec - c0.tv_nsec));
    fflush(stdout);
    iface->close(be);
    return fail;
}

/* One test per variant (the loop index into bo_variants). */
START_TEST(test_variant) {
    const bo_variant *v = &bo_variants[_i];
    const duet_backend_iface *iface = duet_backend_find(v->backend);
    if (!iface) {
        test_backend_usable(v->backend, "parity"); /* says SKIP; fails if required */
        return;
    }
    if (excluded(iface) || variant_excluded(v) || !test_backend_usable(v->backend, "parity")) return;
    int failures = 0;
    char first[900] = "";
    for (int d = 0; d < iface->device_count(); d++)
        failures += run_device(iface, d, v, first, sizeof first);
    ck_assert_msg(failures == 0, "%d case(s) failed; first: %s", failures, first);
}
END_TEST

/* ---- the HAL's contract ------------------------------------------------------------------- */

/* n_keys (the largest position + 1, which the forward pass passes) smaller
 * than a token's position: a backend that plans its key splits from it
 * must refuse the op or give that token zeros (a bad slot), never
 * attention over a silently shortened context; one whose kernel does not
 * split (OpenCL's prefill kernel, forced) attends over the whole context. */
START_TEST(test_attention_past_n_keys) {
    const duet_backend_iface *iface = duet_backend_get(_i);
    if (excluded(iface) || !test_backend_usable(iface->name, "attention past n_keys")) return;
    int ci = 0;
    while (ci < BO_N_CASES &&
           !(bo_cases[ci].kind == DUET_OP_ATTENTION && !strcmp(bo_cases[ci].shape, "ctx1000") &&
             bo_cases[ci].dtype == DUET_DTYPE_F16))
        ci++;
    ck_assert_int_lt(ci, BO_N_CASES);
    const bo_case *c = &bo_cases[ci];
    for (int d = 0; d < iface->device_count(); d++) {
        duet_backend *be;
        ck_assert_msg(iface->open(d, &(duet_backend_params){0}, &be) == DUET_OK, "%s: %s", iface->name,
                      duet_last_error());
        bo_host h;
        bo_host_build(ci, &h);
        bo_dev dev;
        ck_assert_msg(bo_dev_setup(be, &h, &dev) == DUET_OK, "%s: %s", iface->name, duet_last_error());
        ck_assert_int_eq(dev.op.attention.n_keys, 1000); /* one decode token at position 999 */
        dev.op.attention.n_keys = 300;
        const duet_status st = bo_dev_run(&dev, 1);
        if (st != DUET_OK) {
            ck_assert_msg(strstr(duet_last_error(), "n_keys") || strstr(duet_last_error(), "position"),
                          "%s: refused, but says: %s", iface->name, duet_last_error());
        } else {
            const int oi = bo_find(&h, "out");
            uint8_t *img = bo_dev_image(&dev, &h, oi);
            ck_assert_ptr_nonnull(img);
            const size_t n = (size_t)c->n_tokens * c->n_head * c->dim;
            const float *want = (const float *)answer(ci)->want[oi];
            double err = 0, norm = 0;
            bool zeros = true;
            for (size_t i = 0; i < n; i++) {
                const double g = bo_raw_at(DUET_DTYPE_F32, img + BO_GUARD, i), e = g - want[i];
                zeros = zeros && g == 0.0;
                err += e * e;
                norm += (double)want[i] * want[i];
            }
            ck_assert_msg(zeros || err <= 1e-7 * norm,
                          "%s: a position past n_keys gave neither an error, zeros nor the whole context's "
                          "attention (NMSE %g)",
                          iface->name, err / norm);
            free(img);
            printf("%s/%d: a position past n_keys: %s\n", iface->name, d,
                   zeros ? "zeros" : "the whole context");
        }
        if (st) printf("%s/%d: a position past n_keys: %s\n", iface->name, d, duet_last_error());
        bo_dev_free(&dev);
        bo_host_free(&h);
        iface->close(be);
    }
}
END_TEST

/* Backend scratch (device memory besides the caller's buffers) after one
 * attention step over a context of n_ctx, on a freshly opened backend:
 * 64 queries at the end of the context plus 4 decoding sequences. */
static size_t attention_scratch(const duet_backend_iface *iface, int n_ctx, int n_tokens, int n_seqs) {
    duet_backend *be;
    ck_assert_msg(iface->open(0, &(duet_backend_params){0}, &be) == DUET_OK, "%s: %s", iface->name,
                  duet_last_error());
    // clang-format off
    const bo_case c = {"mem", DUET_OP_ATTENTION, DUET_DTYPE_F16, n_tokens, 64, n_ctx, 8, 2, n_seqs, 0, 0,
                       false, false, false, false, BO_TEST, 0, 32, {n_ctx, n_ctx, n_ctx, n_ctx}, 0};
    // clang-format on
    bo_host h;
    bo_host_build_case(&c, 7, &h);
    bo_dev dev;
    duet_status st = bo_dev_setup(be, &h, &dev);
    if (st == DUET_OK) st = bo_dev_run(&dev, 1);
    ck_assert_msg(st == DUET_OK, "%s: attention at context %d: %s", iface->name, n_ctx, duet_last_error());
    size_t bytes = duet_backend_scratch_bytes(be);
    bo_dev_free(&dev);
    bo_host_free(&h);
    iface->close(be);
    return bytes;
}

/* The n x n score matrix never exists: the scratch attention needs grows
 * at most linearly with the context (8192 vs 2048 tokens), and stays far
 * below one 8192 x 8192 f32 score matrix per head (256 MiB). */
START_TEST(test_attention_memory_linear) {
    const duet_backend_iface *iface = duet_backend_get(_i);
    if (excluded(iface) && strcmp(iface->name, "cpu") != 0) return;
    if (!test_backend_usable(iface->name, "attention memory")) return;
    ck_assert_msg(iface->scratch_bytes != NULL, "%s does not report its scratch memory", iface->name);
    if (case_mask() == BO_SMALL) {
        /* Simulators and forced serial tunings: 8192-token contexts take minutes there. */
        printf("SKIP attention memory on %s: DUET_OPS_CASES=small\n", iface->name);
        return;
    }
    const int shapes[2][2] = {{64, 1}, {4, 4}}; /* a prefill chunk; decoding sequences */
    for (int k = 0; k < 2; k++) {
        size_t small = attention_scratch(iface, 2048, shapes[k][0], shapes[k][1]);
        size_t big = attention_scratch(iface, 8192, shapes[k][0], shapes[k][1]);
        printf("%s: attention scratch %zu bytes at context 2048, %zu at 8192 (%d tokens, %d sequences)\n",
               iface->name, small, big, shapes[k][0], shapes[k][1]);
        ck_assert_msg(big <= 4.5 * (double)small + (1 << 20),
                      "%s: scratch grows faster than the context: %zu bytes at 2048, %zu at 8192",
                      iface->name, small, big);
        ck_assert_msg(big < ((size_t)64 << 20), "%s: %zu bytes of scratch at context 8192", iface->name, big);
    }
}
END_TEST

/* Every backend named in DUET_REQUIRE_BACKENDS is compiled in and has a device. */
START_TEST(test_required_backends) {
    const char *req = getenv("DUET_REQUIRE_BACKENDS");
    if (!req || !*req) return;
    char buf[256];
    snprintf(buf, sizeof buf, "%s", req);
    char *save = NULL;
    for (char *name = strtok_r(buf, ",", &save); name; name = strtok_r(NULL, ",", &save)) {
        const duet_backend_iface *iface = duet_backend_find(name);
        ck_assert_msg(iface != NULL, "required backend %s is not compiled in", name);
        char why[256] = "";
        ck_assert_msg(iface->available(why, sizeof why), "required backend %s is unavailable: %s", name, why);
        ck_assert_msg(iface->device_count() > 0, "required backend %s has no device", name);
    }
}
END_TEST

/* A view that runs past its buffer is refused before anything runs. */
START_TEST(test_bounds_refused) {
    const duet_backend_iface *iface = duet_backend_get(_i);
    /* Excluded backends are not even probed (a simulator such as oclgrind
     * shares the process with whatever driver a probe loads). */
    if (excluded(iface) && strcmp(iface->name, "cpu") != 0) return;
    char why[256];
    if (!iface->available(why, sizeof why)) return;
    duet_backend *be;
    ck_assert_msg(iface->open(0, &(duet_backend_params){0}, &be) == DUET_OK, "%s: %s", iface->name,
                  duet_last_error());
    duet_buffer *w, *x, *out;
    ck_assert_int_eq(duet_buffer_alloc(be, 64 * 64 * 4, &w), DUET_OK);
    ck_assert_int_eq(duet_buffer_alloc(be, 64 * 4, &x), DUET_OK);
    ck_assert_int_eq(duet_buffer_alloc(be, 60 * 4, &out), DUET_OK); /* 4 floats short */
    duet_op op = {.kind = DUET_OP_MATMUL, .n_tokens = 1};
    op.matmul.w = (duet_view){w, 0};
    op.matmul.dtype = DUET_DTYPE_F32;
    op.matmul.x = (duet_view){x, 0};
    op.matmul.n_in = 64;
    op.matmul.n_out = 64;
    op.matmul.out = (duet_view){out, 0};
    ck_assert_int_eq(duet_step_begin(be), DUET_OK);
    duet_status st = duet_step_op(be, &op);
    ck_assert_msg(st == DUET_INVALID_ARGUMENT, "%s: a short out buffer gave %s (%s)", iface->name,
                  duet_status_name(st), duet_last_error());
    op.matmul.out = (duet_view){x, 4}; /* misaligned */
    op.matmul.n_out = 1;
    op.matmul.x = (duet_view){w, 2};
    st = duet_step_op(be, &op);
    ck_assert_msg(st == DUET_INVALID_ARGUMENT, "%s: a misaligned x gave %s", iface->name,
                  duet_status_name(st));
    op.matmul.x = (duet_view){x, 0};
    op.matmul.out = (duet_view){w, 128};
    st = duet_step_op(be, &op);
    ck_assert_msg(st == DUET_INVALID_ARGUMENT, "%s: out overlapping w gave %s", iface->name,
                  duet_status_name(st));
    ck_assert_int_eq(duet_step_submit(be), DUET_OK);
    ck_assert_int_eq(duet_step_wait(be), DUET_OK);
    duet_buffer_free(be, w);
    duet_buffer_free(be, x);
    duet_buffer_free(be, out);
    iface->close(be);
}
END_TEST

/* ---- streams: several queues on one device, weights shared ------------------ */

#define ST_IN 512
#define ST_OUT 256
#define ST_STEPS 12
#define ST_WORKERS 3 /* the parent and two streams, each on its own thread */

/* What one thread records: rmsnorm then a Q4_0 matmul (the weights the
 * parent uploaded; on cpu the first matmul repacks them in place, so the
 * threads race to it), ST_STEPS times, each result checked. */
typedef struct st_worker {
    duet_backend *be;
    duet_buffer *w, *g; /* shared weights */
    int n_tokens;
    float x[4 * ST_IN];
    float want[4 * ST_OUT];   /* the oracle's */
    float first[4 * ST_OUT];  /* this worker's first result: later steps must repeat it bit for bit */
    pthread_barrier_t *start; /* the workers' first steps begin together */
    char err[512];
} st_worker;

static bool st_step(st_worker *k, duet_buffer *x, duet_buffer *xn, duet_buffer *out, float *got) {
    const int T = k->n_tokens;
    duet_op norm = {.kind = DUET_OP_RMSNORM, .n_tokens = T};
    norm.rmsnorm.x = (duet_view){x, 0};
    norm.rmsnorm.w = (duet_view){k->g, 0};
    norm.rmsnorm.out = (duet_view){xn, 0};
    norm.rmsnorm.dim = ST_IN;
    norm.rmsnorm.eps = 1e-5f;
    duet_op mm = {.kind = DUET_OP_MATMUL, .n_tokens = T};
    mm.matmul.w = (duet_view){k->w, 0};
    mm.matmul.dtype = DUET_DTYPE_Q4_0;
    mm.matmul.x = (duet_view){xn, 0};
    mm.matmul.n_in = ST_IN;
    mm.matmul.n_out = ST_OUT;
    mm.matmul.out = (duet_view){out, 0};
    duet_status st;
    if ((st = duet_step_begin(k->be)) || (st = duet_step_op(k->be, &norm)) ||
        (st = duet_step_op(k->be, &mm)) || (st = duet_step_submit(k->be)) || (st = duet_step_wait(k->be)) ||
        (st = duet_buffer_download(k->be, out, 0, got, (size_t)T * ST_OUT * 4))) {
        snprintf(k->err, sizeof k->err, "%s: %s", duet_status_name(st), duet_last_error());
        return false;
    }
    return true;
}

static void *st_run(void *p) {
    st_worker *k = p;
    const int T = k->n_tokens;
    duet_buffer *x = NULL, *xn = NULL, *out = NULL;
    duet_status st;
    if ((st = duet_buffer_alloc(k->be, (size_t)T * ST_IN * 4, &x)) ||
        (st = duet_buffer_alloc(k->be, (size_t)T * ST_IN * 4, &xn)) ||
        (st = duet_buffer_alloc(k->be, (size_t)T * ST_OUT * 4, &out)) ||
        (st = duet_buffer_upload(k->be, x, 0, k->x, (size_t)T * ST_IN * 4))) {
        snprintf(k->err, sizeof k->err, "setup: %s: %s", duet_status_name(st), duet_last_error());
        if (k->start) pthread_barrier_wait(k->start); /* the others still start */
    } else {
        float got[4 * ST_OUT];
        if (k->start) pthread_barrier_wait(k->start);
        for (int s = 0; s < ST_STEPS && !k->err[0]; s++) {
            if (!st_step(k, x, xn, out, s ? got : k->first)) break;
            if (s && memcmp(got, k->first, (size_t)T * ST_OUT * 4) != 0)
                snprintf(k->err, sizeof k->err, "step %d differs from the first", s);
        }
        double num = 0, den = 0;
        for (int i = 0; i < T * ST_OUT && !k->err[0]; i++) {
            double d = (double)k->first[i] - k->want[i];
            num += d * d;
            den += (double)k->want[i] * k->want[i];
        }
        if (!k->err[0] && !(num <= 1e-4 * den))
            snprintf(k->err, sizeof k->err, "nmse %.3g against the oracle", num / den);
    }
    duet_buffer_free(k->be, x);
    duet_buffer_free(k->be, xn);
    duet_buffer_free(k->be, out);
    return NULL;
}

/* Two streams of one device and the device's first instance record and
 * run steps at once from three threads, reading weights uploaded through
 * the instance; every result equals the oracle's and repeats bit for bit.
 * Then the instance closes first and a stream still runs on its weights,
 * frees them, and closes. On cpu one stream has a pool of its own. */
START_TEST(test_streams) {
    const duet_backend_iface *iface = duet_backend_get(_i);
    if (excluded(iface) && strcmp(iface->name, "cpu") != 0) return;
    if (!test_backend_usable(iface->name, "streams")) return;
    duet_backend *parent;
    ck_assert_msg(duet_backend_open(iface->name, 0, NULL, &parent) == DUET_OK, "%s: %s", iface->name,
                  duet_last_error());
    uint64_t seed = 7;
    float *wf = malloc((size_t)ST_OUT * ST_IN * 4), g[ST_IN];
    for (int i = 0; i < ST_OUT * ST_IN; i++)
        wf[i] = bo_rand(&seed);
    for (int i = 0; i < ST_IN; i++)
        g[i] = 1.0f + 0.5f * bo_rand(&seed);
    const size_t wbytes = duet_dtype_row_bytes(DUET_DTYPE_Q4_0, ST_IN) * ST_OUT;
    uint8_t *wq = malloc(wbytes);
    for (int r = 0; r < ST_OUT; r++)
        duet_convert_row(DUET_DTYPE_Q4_0, wf + (size_t)r * ST_IN,
                         wq + (size_t)r * duet_dtype_row_bytes(DUET_DTYPE_Q4_0, ST_IN), ST_IN);
    duet_buffer *w, *gb;
    ck_assert_int_eq(duet_buffer_alloc(parent, wbytes, &w), DUET_OK);
    ck_assert_int_eq(duet_buffer_alloc(parent, sizeof g, &gb), DUET_OK);
    ck_assert_int_eq(duet_buffer_upload(parent, w, 0, wq, wbytes), DUET_OK);
    ck_assert_int_eq(duet_buffer_upload(parent, gb, 0, g, sizeof g), DUET_OK);

    st_worker *k = calloc(ST_WORKERS, sizeof *k);
    pthread_barrier_t start;
    pthread_barrier_init(&start, NULL, ST_WORKERS);
    for (int i = 0; i < ST_WORKERS; i++) {
        k[i].start = &start;
        /* cpu: stream 2 gets a pool of its own (one worker). */
        duet_backend_params sp = {.n_threads = i == 2 && !strcmp(iface->name, "cpu") ? 1 : 0};
        if (i == 0)
            k[i].be = parent;
        else
            ck_assert_msg(duet_backend_stream_open(parent, &sp, &k[i].be) == DUET_OK, "%s: stream %d: %s",
                          iface->name, i, duet_last_error());
        k[i].w = w;
        k[i].g = gb;
        k[i].n_tokens = 1 + i; /* 1, 2, 3: a GEMV and small GEMMs */
        for (int j = 0; j < k[i].n_tokens * ST_IN; j++)
            k[i].x[j] = 4.0f * bo_rand(&seed);
        float xn[4 * ST_IN];
        oracle_rmsnorm(k[i].x, g, k[i].n_tokens, ST_IN, 1e-5f, xn, NULL);
        oracle_matmul(wq, DUET_DTYPE_Q4_0, xn, NULL, NULL, false, k[i].n_tokens, ST_IN, ST_OUT, k[i].want);
    }
    if (getenv("DUET_TEST_STREAMS_SERIAL")) {
        /* Under oclgrind (tests/test_opencl.c): its checker plugins keep
         * shadow memory in a pool that is not thread-safe (two host threads
         * enqueueing at once crash it in MemoryPool::alloc), so the streams
         * take turns there; the threaded run is the normal pass's. */
        for (int i = 0; i < ST_WORKERS; i++) {
            k[i].start = NULL;
            st_run(&k[i]);
        }
    } else {
        pthread_t th[ST_WORKERS];
        for (int i = 0; i < ST_WORKERS; i++)
            ck_assert_int_eq(pthread_create(&th[i], NULL, st_run, &k[i]), 0);
        for (int i = 0; i < ST_WORKERS; i++)
            pthread_join(th[i], NULL);
    }
    for (int i = 0; i < ST_WORKERS; i++)
        ck_assert_msg(!k[i].err[0], "%s: %s %d: %s", iface->name, i ? "stream" : "instance", i, k[i].err);
    pthread_barrier_destroy(&start);
    /* The parent goes first; stream 1 still runs on the weights, then frees them. */
    duet_backend_close(parent);
    k[1].err[0] = 0;
    k[1].start = NULL;
    st_run(&k[1]);
    ck_assert_msg(!k[1].err[0], "%s: stream 1 after the instance closed: %s", iface->name, k[1].err);
    duet_buffer_free(k[1].be, w);
    duet_buffer_free(k[1].be, gb);
    duet_backend_close(k[2].be);
    duet_backend_close(k[1].be);
    free(k);
    free(wf);
    free(wq);
}
END_TEST

/* The variants of `backend` into two ctest cases: those forcing attention
 * kernels (the longest cold compiles) into `att`, the others into `rest`.
 * (tests/check_tests.cmake reads the cases' names from the tcase_create
 * calls, so they stay literal.) */
static void add_variants(TCase *rest, TCase *att, const char *backend) {
    for (int i = 0; i < BO_N_VARIANTS; i++)
        if (strcmp(bo_variants[i].backend, backend) == 0)
            tcase_add_loop_test(bo_variants[i].kinds == BO_ATT && att ? att : rest, test_variant, i, i + 1);
}

int main(void) {
    Suite *s = suite_create("backend_ops");
    TCase *cases[6] = {
        tcase_create("cpu"),    tcase_create("vulkan"),           tcase_create("vulkan_attention"),
        tcase_create("opencl"), tcase_create("opencl_attention"), tcase_create("hal")};
    for (int i = 0; i < 6; i++) {
        tcase_set_timeout(cases[i], 1200);
        if (i < 5) tcase_set_tags(cases[i], "variants"); /* CK_INCLUDE_TAGS=variants: parity only */
        suite_add_tcase(s, cases[i]);
    }
    add_variants(cases[0], NULL, "cpu");
    add_variants(cases[1], cases[2], "vulkan");
    add_variants(cases[3], cases[4], "opencl");
    TCase *hal = cases[5];
    tcase_add_test(hal, test_required_backends);
    tcase_add_loop_test(hal, test_bounds_refused, 0, duet_backend_count());
    tcase_add_loop_test(hal, test_attention_past_n_keys, 0, duet_backend_count());
    tcase_add_loop_test(hal, test_attention_memory_linear, 0, duet_backend_count());
    tcase_add_loop_test(hal, test_streams, 0, duet_backend_count());
    return test_run_suite(s);
}
