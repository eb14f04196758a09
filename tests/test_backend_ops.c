/* test_backend_ops.c — op parity: every case of tests/backend_ops_cases.h on
 * every device of every non-cpu backend in the registry, against the cpu
 * backend.
 *
 * Per case: the same operands go to both backends (inside guard bytes); the
 * outputs must match within a normalised mean squared error per dtype, be
 * finite where the reference is, leave the guard bytes alone, and index
 * outputs must match exactly. "not supported" (supports_op says no) is
 * counted apart from passed.
 *
 * Environment:
 *   DUET_REQUIRE_BACKENDS=opencl,vulkan  fail when a named backend is not
 *                                        compiled in or has no device (CI)
 *   DUET_OPS_BACKENDS=opencl             only these backends
 *   DUET_OPS_CASES=small                 only the BO_SMALL cases (simulators)
 *   DUET_OPS_FILTER=matmul               only cases whose label contains this
 *   DUET_OPS_VERBOSE=1                   a line per case */
#include <math.h>

#include "backend_ops_cases.h"
#include "test_backends.h"
#include "test_util.h"

/* Leaks inside GPU drivers and their compilers (PoCL's and lavapipe's
 * LLVM, the loaders) are theirs, not ours: LeakSanitizer ignores them. */
const char *__lsan_default_suppressions(void) {
    return "leak:libpocl\nleak:libLLVM\nleak:libOpenCL\nleak:libclblast\nleak:liboclgrind\nleak:libvulkan\n";
}

static bool verbose(void) {
    const char *v = getenv("DUET_OPS_VERBOSE");
    return v && *v && strcmp(v, "0") != 0;
}

static unsigned case_mask(void) {
    const char *v = getenv("DUET_OPS_CASES");
    return v && strcmp(v, "small") == 0 ? BO_SMALL : BO_TEST;
}

/* Largest NMSE a case may show. Q8_0: the cpu backend quantizes the
 * activations to 8 bits, a GPU kernel may not. F16 outputs: one rounding
 * step may differ. Everything else: f32 summation order only. */
static double tolerance(const bo_case *c, const bo_operand *o) {
    if (c->kind == DUET_OP_MATMUL && c->dtype == DUET_DTYPE_Q8_0) return 5e-4;
    /* q8 outputs (activations, pools rope_kv stored): a value on a rounding
     * boundary may land one step apart. q8 KV attention: a kernel may also
     * quantise q for int8 dot products. */
    if (o->elem == BO_ELEM_Q8 || (o->elem == BO_ELEM_RAW && c->dtype == DUET_DTYPE_Q8_0)) return 1e-4;
    if (c->kind == DUET_OP_ATTENTION && c->dtype == DUET_DTYPE_Q8_0) return 5e-4;
    if (o->elem == BO_ELEM_RAW && c->dtype == DUET_DTYPE_F16) return 1e-6;
    return 1e-7;
}

static float raw_at(duet_dtype t, const uint8_t *p, size_t i) {
    if (t == DUET_DTYPE_Q8_0) {
        const duet_block_q8_0 *b = (const duet_block_q8_0 *)p + i / DUET_QK8_0;
        uint16_t d;
        memcpy(&d, &b->d, 2);
        return duet_fp16_to_fp32(d) * b->qs[i % DUET_QK8_0];
    }
    if (t == DUET_DTYPE_F16) return duet_fp16_to_fp32(((const uint16_t *)p)[i]);
    if (t == DUET_DTYPE_BF16) return duet_bf16_to_fp32(((const uint16_t *)p)[i]);
    float f;
    memcpy(&f, p + 4 * i, 4);
    return f;
}

static bool guards_ok(const uint8_t *img, size_t bytes, size_t *where) {
    for (size_t i = 0; i < BO_GUARD; i++) {
        if (img[i] != BO_GUARD_BYTE) return *where = i, false;
        if (img[BO_GUARD + bytes + i] != BO_GUARD_BYTE) return *where = BO_GUARD + bytes + i, false;
    }
    return true;
}

/* Compares one output operand; fills msg on failure. */
static bool compare(const bo_case *c, const bo_operand *o, const uint8_t *ref_img, const uint8_t *got_img,
                    double *nmse_out, char *msg, size_t msg_size) {
    size_t where;
    if (!guards_ok(got_img, o->bytes, &where)) {
        snprintf(msg, msg_size, "%s: guard byte %zd (relative to the view) was overwritten", o->name,
                 (ssize_t)where - BO_GUARD);
        return false;
    }
    if (!guards_ok(ref_img, o->bytes, &where)) {
        snprintf(msg, msg_size, "%s: the cpu reference overwrote guard byte %zd", o->name, (ssize_t)where - BO_GUARD);
        return false;
    }
    const uint8_t *ref = ref_img + BO_GUARD, *got = got_img + BO_GUARD;
    if (o->elem == BO_ELEM_I32) {
        for (size_t i = 0; i < o->bytes / 4; i++) {
            int32_t a, b;
            memcpy(&a, ref + 4 * i, 4);
            memcpy(&b, got + 4 * i, 4);
            if (a != b) {
                snprintf(msg, msg_size, "%s[%zu] = %d, cpu says %d", o->name, i, b, a);
                return false;
            }
        }
        *nmse_out = 0;
        return true;
    }
    /* F32, q8_0 activations, or raw data of the case's dtype (KV pools). */
    const duet_dtype t = o->elem == BO_ELEM_F32 ? DUET_DTYPE_F32 : o->elem == BO_ELEM_Q8 ? DUET_DTYPE_Q8_0 : c->dtype;
    const size_t n = o->bytes / duet_dtype_block_bytes(t) * (size_t)duet_dtype_block(t);
    double err = 0, norm = 0;
    for (size_t i = 0; i < n; i++) {
        const float a = raw_at(t, ref, i), b = raw_at(t, got, i);
        if (isfinite(a) != isfinite(b) || (isnan(a) != isnan(b))) {
            snprintf(msg, msg_size, "%s[%zu] = %g, cpu says %g", o->name, i, (double)b, (double)a);
            return false;
        }
        if (!isfinite(a)) continue;
        err += ((double)a - b) * ((double)a - b);
        norm += (double)a * a;
    }
    const double nmse = norm > 0 ? err / norm : err;
    *nmse_out = nmse;
    const double tol = tolerance(c, o);
    if (!(nmse <= tol)) {
        size_t worst = 0;
        double wd = -1;
        for (size_t i = 0; i < n; i++) {
            double dd = fabs((double)raw_at(t, ref, i) - raw_at(t, got, i));
            if (dd > wd) wd = dd, worst = i;
        }
        snprintf(msg, msg_size, "%s: NMSE %.3g > %.1g (worst [%zu]: %g vs cpu %g)", o->name, nmse, tol, worst,
                 (double)raw_at(t, got, worst), (double)raw_at(t, ref, worst));
        return false;
    }
    return true;
}

typedef enum { CASE_PASS, CASE_FAIL, CASE_UNSUPPORTED } case_result;

static case_result run_case(duet_backend *cpu, duet_backend *be, int ci, char *msg, size_t msg_size, double *nmse) {
    bo_host h;
    bo_host_build(ci, &h);
    bo_dev ref, got;
    case_result r = CASE_PASS;
    *nmse = 0;
    duet_status st = bo_dev_setup(cpu, &h, &ref);
    if (st == DUET_OK) st = bo_dev_run(&ref, 1);
    if (st != DUET_OK) {
        snprintf(msg, msg_size, "cpu reference failed: %s", duet_last_error());
        bo_dev_free(&ref);
        bo_host_free(&h);
        return CASE_FAIL;
    }
    st = bo_dev_setup(be, &h, &got);
    if (st == DUET_OK && !duet_device_supports_op(be->iface, be->device_index, &got.op)) r = CASE_UNSUPPORTED;
    if (r == CASE_PASS && st == DUET_OK) st = bo_dev_run(&got, 1);
    if (r == CASE_PASS && st != DUET_OK) {
        snprintf(msg, msg_size, "%s: %s", duet_status_name(st), duet_last_error());
        r = CASE_FAIL;
    }
    for (int i = 0; i < h.n && r == CASE_PASS; i++) {
        if (!h.ops[i].output || h.ops[i].alias >= 0) continue;
        uint8_t *a = bo_dev_image(&ref, &h, i), *b = bo_dev_image(&got, &h, i);
        double e = 0;
        if (!a || !b) {
            snprintf(msg, msg_size, "%s: download failed: %s", h.ops[i].name, duet_last_error());
            r = CASE_FAIL;
        } else if (!compare(h.c, &h.ops[i], a, b, &e, msg, msg_size)) {
            r = CASE_FAIL;
        }
        if (e > *nmse) *nmse = e;
        free(a);
        free(b);
    }
    bo_dev_free(&ref);
    bo_dev_free(&got);
    bo_host_free(&h);
    return r;
}

/* Runs every case on one device; returns the number of failures and keeps
 * the first failure's description. */
static int run_device(duet_backend *cpu, const duet_backend_iface *iface, int dev, char *first, size_t first_size) {
    duet_backend *be;
    if (iface->open(dev, &(duet_backend_params){0}, &be) != DUET_OK) {
        snprintf(first, first_size, "%s/%d: open failed: %s", iface->name, dev, duet_last_error());
        printf("FAIL %s\n", first);
        return 1;
    }
    const unsigned mask = case_mask();
    int pass = 0, fail = 0, unsup = 0;
    for (int ci = 0; ci < BO_N_CASES; ci++) {
        if (!(bo_cases[ci].modes & mask)) continue;
        char label[160], msg[600] = "";
        bo_case_label(&bo_cases[ci], label, sizeof label);
        const char *filter = getenv("DUET_OPS_FILTER");
        if (filter && *filter && !strstr(label, filter)) continue;
        double nmse = 0;
        case_result r = run_case(cpu, be, ci, msg, sizeof msg, &nmse);
        if (r == CASE_PASS) {
            pass++;
            if (verbose()) printf("  ok   %s/%d %-60s nmse %.2g\n", iface->name, dev, label, nmse);
        } else if (r == CASE_UNSUPPORTED) {
            unsup++;
            printf("  not supported  %s/%d %s\n", iface->name, dev, label);
        } else {
            fail++;
            printf("  FAIL %s/%d %s: %s\n", iface->name, dev, label, msg);
            if (!first[0]) snprintf(first, first_size, "%s/%d %s: %s", iface->name, dev, label, msg);
        }
    }
    printf("%s/%d (%s): %d passed, %d failed, %d not supported\n", iface->name, dev, be->info.name, pass, fail, unsup);
    fflush(stdout);
    iface->close(be);
    return fail;
}

/* One test per registry entry (the cpu backend is the oracle, not a subject). */
START_TEST(test_backend_parity) {
    const duet_backend_iface *iface = duet_backend_get(_i);
    ck_assert_ptr_nonnull(iface);
    if (strcmp(iface->name, "cpu") == 0) return;
    const char *only = getenv("DUET_OPS_BACKENDS");
    if (only && *only && !test_list_has(only, iface->name)) return;
    if (!test_backend_usable(iface->name, "parity")) return;
    duet_backend *cpu;
    ck_assert_msg(duet_backend_open("cpu", 0, &(duet_backend_params){.n_threads = 2}, &cpu) == DUET_OK,
                  "cpu backend: %s", duet_last_error());
    int failures = 0;
    char first[800] = "";
    for (int d = 0; d < iface->device_count(); d++) failures += run_device(cpu, iface, d, first, sizeof first);
    duet_backend_close(cpu);
    ck_assert_msg(failures == 0, "%d case(s) failed; first: %s", failures, first);
}
END_TEST

/* Naive attention from the host operands, in double precision: for token
 * t, a softmax over the dequantised K rows of positions 0..pos[t] of its
 * sequence, found through the block table, then the weighted V rows. */
static void ref_attention(const bo_host *h, float *out) {
    const bo_case *c = h->c;
    const int hd = c->dim, nh = c->n_head, nkv = c->n_head_kv, kvw = nkv * hd, group = nh / nkv;
    const size_t rb = duet_dtype_row_bytes(c->dtype, kvw);
    const uint8_t *kp = h->ops[bo_find(h, "k_pool")].host, *vp = h->ops[bo_find(h, "v_pool")].host;
    const float *q = h->ops[bo_find(h, "q")].host;
    const double scale = 1.0 / sqrt((double)hd);
    float *row = malloc(sizeof(float) * (size_t)kvw);
    double *sc = malloc(sizeof(double) * (size_t)nh * (size_t)c->rows), *acc = malloc(sizeof(double) * (size_t)hd);
    for (int t = 0; t < c->n_tokens; t++) {
        const int s = h->seq[t], p = h->pos[t];
        const int32_t *table = h->table + (size_t)s * h->max_blocks;
        const float *qt = q + (size_t)t * nh * hd;
        for (int j = 0; j <= p; j++) {
            size_t r = (size_t)table[j / h->block_size] * h->block_size + j % h->block_size;
            duet_dequantize_row(c->dtype, kp + r * rb, row, kvw);
            for (int hh = 0; hh < nh; hh++) {
                double dot = 0;
                for (int i = 0; i < hd; i++) dot += (double)qt[hh * hd + i] * row[(hh / group) * hd + i];
                sc[(size_t)hh * c->rows + j] = dot * scale;
            }
        }
        for (int hh = 0; hh < nh; hh++) {
            double *sh = sc + (size_t)hh * c->rows, mx = -INFINITY, sum = 0;
            for (int j = 0; j <= p; j++) mx = sh[j] > mx ? sh[j] : mx;
            for (int j = 0; j <= p; j++) sum += (sh[j] = exp(sh[j] - mx));
            for (int j = 0; j <= p; j++) sh[j] /= sum;
        }
        for (int hh = 0; hh < nh; hh++)
            for (int i = 0; i < hd; i++) out[((size_t)t * nh + hh) * hd + i] = 0;
        for (int hh = 0; hh < nh; hh++) {
            for (int i = 0; i < hd; i++) acc[i] = 0;
            for (int j = 0; j <= p; j++) {
                size_t r = (size_t)table[j / h->block_size] * h->block_size + j % h->block_size;
                duet_dequantize_row(c->dtype, vp + r * rb, row, kvw);
                const double w = sc[(size_t)hh * c->rows + j];
                for (int i = 0; i < hd; i++) acc[i] += w * row[(hh / group) * hd + i];
            }
            for (int i = 0; i < hd; i++) out[((size_t)t * nh + hh) * hd + i] = (float)acc[i];
        }
    }
    free(row);
    free(sc);
    free(acc);
}

/* Every backend, the cpu one included, against the naive reference on
 * every attention case (contexts 1 to 4096, ragged mixes, f16/q8_0 KV). */
START_TEST(test_attention_reference) {
    const duet_backend_iface *iface = duet_backend_get(_i);
    if (!test_backend_usable(iface->name, "attention reference")) return;
    const char *only = getenv("DUET_OPS_BACKENDS");
    if (only && *only && !test_list_has(only, iface->name) && strcmp(iface->name, "cpu") != 0) return;
    const unsigned mask = case_mask();
    int checked = 0, failures = 0;
    char first[600] = "";
    for (int d = 0; d < iface->device_count(); d++) {
        duet_backend *be;
        ck_assert_msg(iface->open(d, &(duet_backend_params){0}, &be) == DUET_OK, "%s: %s", iface->name,
                      duet_last_error());
        for (int ci = 0; ci < BO_N_CASES; ci++) {
            const bo_case *c = &bo_cases[ci];
            if (c->kind != DUET_OP_ATTENTION || !(c->modes & mask)) continue;
            char label[160];
            bo_case_label(c, label, sizeof label);
            const char *filter = getenv("DUET_OPS_FILTER");
            if (filter && *filter && !strstr(label, filter)) continue;
            bo_host h;
            bo_host_build(ci, &h);
            const size_t n = (size_t)c->n_tokens * c->n_head * c->dim;
            float *want = malloc(n * sizeof(float)), *got = malloc(n * sizeof(float));
            ref_attention(&h, want);
            bo_dev dev;
            duet_status st = bo_dev_setup(be, &h, &dev);
            if (st == DUET_OK) st = bo_dev_run(&dev, 1);
            int oi = bo_find(&h, c->q8act == 2 ? "out_q8" : "out");
            if (h.ops[oi].alias >= 0) oi = h.ops[oi].alias; /* in place: out is q's buffer */
            uint8_t *img = st == DUET_OK ? bo_dev_image(&dev, &h, oi) : NULL;
            char msg[400] = "";
            if (!img) {
                snprintf(msg, sizeof msg, "%s", duet_last_error());
            } else {
                const duet_dtype t = c->q8act == 2 ? DUET_DTYPE_Q8_0 : DUET_DTYPE_F32;
                for (size_t i = 0; i < n; i++) got[i] = raw_at(t, img + BO_GUARD, i);
                double err = 0, norm = 0;
                size_t worst = 0;
                for (size_t i = 0; i < n; i++) {
                    double e = (double)got[i] - want[i];
                    if (!(fabs(e) <= fabs((double)got[worst] - want[worst]))) worst = i;
                    err += e * e;
                    norm += (double)want[i] * want[i];
                }
                const double nmse = err / (norm > 0 ? norm : 1);
                const double tol = t == DUET_DTYPE_Q8_0 ? 1e-4 : c->dtype == DUET_DTYPE_Q8_0 ? 5e-4 : 1e-7;
                if (!(nmse <= tol))
                    snprintf(msg, sizeof msg, "NMSE %.3g > %.1g (worst [%zu]: %g vs %g)", nmse, tol, worst,
                             (double)got[worst], (double)want[worst]);
                else if (verbose())
                    printf("  ok   %s/%d %-60s nmse vs naive %.2g\n", iface->name, d, label, nmse);
            }
            checked++;
            if (msg[0]) {
                failures++;
                printf("  FAIL %s/%d %s vs naive: %s\n", iface->name, d, label, msg);
                if (!first[0]) snprintf(first, sizeof first, "%s/%d %s: %s", iface->name, d, label, msg);
            }
            free(img);
            free(want);
            free(got);
            bo_dev_free(&dev);
            bo_host_free(&h);
        }
        iface->close(be);
    }
    printf("%s: %d attention cases against the naive reference, %d failed\n", iface->name, checked, failures);
    ck_assert_msg(failures == 0, "%d attention case(s) differ from the naive reference; first: %s", failures, first);
}
END_TEST

/* n_keys (the largest position + 1, which the forward pass passes) smaller
 * than a token's position: a backend that plans its key splits from it
 * must refuse the op or give that token zeros (a bad slot), never
 * attention over a silently shortened context; one whose kernel does not
 * split (OpenCL's prefill kernel, forced) attends over the whole context. */
START_TEST(test_attention_past_n_keys) {
    const duet_backend_iface *iface = duet_backend_get(_i);
    if (!test_backend_usable(iface->name, "attention past n_keys")) return;
    int ci = 0;
    while (ci < BO_N_CASES && !(bo_cases[ci].kind == DUET_OP_ATTENTION && !strcmp(bo_cases[ci].shape, "ctx1000") &&
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
            float *want = malloc(n * sizeof(float));
            ref_attention(&h, want);
            double err = 0, norm = 0;
            bool zeros = true;
            for (size_t i = 0; i < n; i++) {
                const double g = raw_at(DUET_DTYPE_F32, img + BO_GUARD, i), e = g - want[i];
                zeros = zeros && g == 0.0;
                err += e * e;
                norm += (double)want[i] * want[i];
            }
            ck_assert_msg(zeros || err <= 1e-7 * norm,
                          "%s: a position past n_keys gave neither an error, zeros nor the whole context's "
                          "attention (NMSE %g)",
                          iface->name, err / norm);
            free(want);
            free(img);
            printf("%s/%d: a position past n_keys: %s\n", iface->name, d, zeros ? "zeros" : "the whole context");
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
    const bo_case c = {"mem", DUET_OP_ATTENTION, DUET_DTYPE_F16, n_tokens, 64, n_ctx, 8, 2, n_seqs, 0, 0,
                       false, false, false, false, BO_TEST, 0, 32, {n_ctx, n_ctx, n_ctx, n_ctx}};
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
    if (!test_backend_usable(iface->name, "attention memory")) return;
    const char *only = getenv("DUET_OPS_BACKENDS");
    if (only && *only && !test_list_has(only, iface->name) && strcmp(iface->name, "cpu") != 0) return;
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
                      "%s: scratch grows faster than the context: %zu bytes at 2048, %zu at 8192", iface->name, small,
                      big);
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
    char why[256];
    if (!iface->available(why, sizeof why)) return;
    const char *only = getenv("DUET_OPS_BACKENDS");
    if (only && *only && !test_list_has(only, iface->name) && strcmp(iface->name, "cpu") != 0) return;
    duet_backend *be;
    ck_assert_msg(iface->open(0, &(duet_backend_params){0}, &be) == DUET_OK, "%s: %s", iface->name, duet_last_error());
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
    ck_assert_msg(st == DUET_INVALID_ARGUMENT, "%s: a misaligned x gave %s", iface->name, duet_status_name(st));
    op.matmul.x = (duet_view){x, 0};
    op.matmul.out = (duet_view){w, 128};
    st = duet_step_op(be, &op);
    ck_assert_msg(st == DUET_INVALID_ARGUMENT, "%s: out overlapping w gave %s", iface->name, duet_status_name(st));
    ck_assert_int_eq(duet_step_submit(be), DUET_OK);
    ck_assert_int_eq(duet_step_wait(be), DUET_OK);
    duet_buffer_free(be, w);
    duet_buffer_free(be, x);
    duet_buffer_free(be, out);
    iface->close(be);
}
END_TEST

int main(void) {
    Suite *s = suite_create("backend_ops");
    TCase *tc = tcase_create("parity");
    tcase_set_timeout(tc, 1200);
    tcase_add_test(tc, test_required_backends);
    tcase_add_loop_test(tc, test_bounds_refused, 0, duet_backend_count());
    tcase_add_loop_test(tc, test_backend_parity, 0, duet_backend_count());
    tcase_add_loop_test(tc, test_attention_reference, 0, duet_backend_count());
    tcase_add_loop_test(tc, test_attention_past_n_keys, 0, duet_backend_count());
    tcase_add_loop_test(tc, test_attention_memory_linear, 0, duet_backend_count());
    suite_add_tcase(s, tc);
    return test_run_suite(s);
}
