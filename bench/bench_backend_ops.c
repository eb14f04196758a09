/* bench_backend_ops.c — the op runner: every backend's ops on the one case
 * table (tests/backend_ops_cases.h), in two modes, as ggml's
 * test-backend-ops.
 *
 * --mode test: every BO_TEST case on every device of every backend, under
 *   each of the backend's tuning variants (bo_variants: every forced path),
 *   against the oracle (tests/op_oracle.h): NMSE within the case's
 *   tolerance, guard bytes intact, index outputs exact. Exit 1 on a
 *   mismatch. (ctest runs the same checks through tests/test_backend_ops.)
 *
 * --mode perf (the default): the BO_PERF cases on every device, under each
 *   backend's default variant and its perf variants (bo_perf_variants: the
 *   matmul paths, int8 dot products on and off, CLBlast; --variants all
 *   adds every bo_variants row). Each timed case is first run once and
 *   checked against the oracle, so a number always belongs to a correct
 *   result. A row gives the time per op, the GB/s of the bytes the op must
 *   move, GFLOP/s, and the fraction of the device's peak bandwidth: the
 *   machine's STREAM triad for CPU-type devices (the cpu backend, PoCL,
 *   lavapipe), a large ADD through the backend otherwise.
 *   One-token matmuls (decode GEMVs) cycle their weights through a pool of
 *   copies twice the last-level cache (--pool-mib), so weights come from
 *   memory as in a forward pass; BO_HOT rows (batched matmuls, per-op
 *   overhead) reuse one copy. Ops run many to a step (up to --reps; a
 *   pooled GEMV at least once through the pool), steps repeat for
 *   --min-time seconds (at least three), and the best step counts.
 *   On OpenCL, with both clblast_min variants run, the sweep of F32/F16
 *   batches (768->2048, 4..128 tokens) says where CLBlast starts to win (the
 *   tuning table's clblast_min). Floors are printed at the end (--strict:
 *   exit 1 when one is missed), per weight type: Q8_0 matrix-vector (1b up
 *   projection, x_q8) >= 25% of the triad on OpenCL CPU devices; on Vulkan
 *   >= 10% of the triad on CPU devices, 80% of the device's bandwidth on
 *   GPUs; the other block types >= 20% (OpenCL) and >= 10% (Vulkan) of the
 *   triad on CPU devices (floor_min).
 *
 * End-to-end prefill and decode tokens/s (and their floors) are
 * bench_decode's.
 *
 * usage: bench_backend_ops [--mode perf|test] [--backends cpu,opencl,vulkan]
 *          [--variants perf|default|all|STR|!STR] [--filter STR] [--cases small]
 *          [--reps N] [--min-time S] [--pool-mib N] [--threads N] [--quick]
 *          [--no-check] [--strict] [--verbose] [--list] [--json] [--out FILE]
 *
 *   --variants  perf: defaults + bo_perf_variants (perf mode's default);
 *               all: every variant (test mode's default: bo_variants);
 *               default: only what the environment leaves; STR: variants
 *               whose label contains STR; !STR: all but those
 *   --filter    only cases whose label contains STR, or one of STR,STR,...
 *               (labels: --list)
 *   --cases     small: test mode on the BO_SMALL cases only
 *   --reps      most ops in one step (default 1000)
 *   --min-time  seconds of timed steps per row (default 0.2; --quick 0.03)
 *   --pool-mib  weight pool of one-token matmuls (default: 2 x the last-level
 *               cache, 64..1024 MiB; 0: hot weights)
 *   --threads   cpu backend threads in perf mode, and the triad's (default 2);
 *               test mode uses each variant's
 *   --no-check  perf mode: time without the oracle check
 *   --json      print the JSON report; --out FILE writes it */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "../tests/backend_ops_cases.h"
#include "bench_util.h"
#include "duet.h"

typedef struct opts {
    bool test; /* --mode test */
    const char *backends, *variants, *filter, *out;
    bool small, check, strict, verbose, list, json;
    int reps, threads;
    double min_time;
    size_t pool_bytes;
} opts;

typedef struct counts {
    int passed, failed, unsupported, errors, skipped_variants;
} counts;

static bool in_list(const char *list, const char *name) {
    if (!list || !*list) return true;
    char buf[256];
    snprintf(buf, sizeof buf, "%s", list);
    char *save = NULL;
    for (char *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save))
        if (!strcmp(t, name)) return true;
    return false;
}

/* ---- the oracle's answers, computed once per case ------------------------------------------ */

static bo_answer answers[BO_N_CASES];

static const bo_answer *answer(int ci) {
    if (!answers[ci].done) bo_answer_compute(&bo_cases[ci], ci, &answers[ci]);
    return &answers[ci];
}

/* ---- weight pools: distinct copies of a GEMV's matrix, larger than the cache ----------------- */

/* One buffer per copy, as the model loader gives every weight tensor its
 * own (core/model.c): a backend that keeps per-buffer state for a matrix
 * (the cpu backend's repacked Q4_0 layout, made at a buffer's first matmul)
 * then runs the path a forward pass runs. Several copies to one buffer
 * timed the cpu's plain Q4_0 kernel: a buffer holds one repacked matrix. */
#define POOL_MAX_COPIES 1024

typedef struct wpool {
    duet_buffer **buf; /* n copies of the weights, one to a buffer; n == 0: no pool */
    int n;
    size_t bytes; /* of one copy */
} wpool;

static void pool_free(duet_backend *be, wpool *p) {
    for (int i = 0; i < p->n; i++)
        duet_buffer_free(be, p->buf[i]);
    free(p->buf);
    memset(p, 0, sizeof *p);
}

/* Copies of h's weights filling `bytes`. */
static duet_status pool_make(duet_backend *be, const bo_host *h, size_t bytes, wpool *p) {
    memset(p, 0, sizeof *p);
    const bo_operand *w = &h->ops[bo_find(h, "w")];
    size_t n = bytes / w->bytes;
    if (n < 2) return DUET_OK; /* one matrix as large as the pool is cold by itself */
    if (n > POOL_MAX_COPIES) n = POOL_MAX_COPIES;
    p->bytes = w->bytes;
    p->buf = calloc(n, sizeof *p->buf);
    if (!p->buf) return duet__error(DUET_OUT_OF_MEMORY, "weight pool: out of memory");
    duet_status st = DUET_OK;
    for (size_t i = 0; i < n && st == DUET_OK; i++) {
        st = duet_buffer_alloc(be, w->bytes, &p->buf[i]);
        if (st != DUET_OK) break;
        p->n++;
        st = duet_buffer_upload(be, p->buf[i], 0, w->host, w->bytes);
    }
    if (st != DUET_OK) pool_free(be, p);
    return st;
}

/* ---- timing ------------------------------------------------------------------------------- */

/* One step of `reps` ops; a pooled matmul takes copy r % n at op r. */
static duet_status run_step(bo_dev *d, const wpool *p, int reps) {
    duet_op op = d->op;
    duet_status st = duet_step_begin(d->be);
    for (int r = 0; r < reps && st == DUET_OK; r++) {
        if (p && p->n) op.matmul.w = (duet_view){p->buf[r % p->n], 0};
        st = duet_step_op(d->be, &op);
    }
    duet_status st2 = duet_step_submit(d->be);
    duet_status st3 = duet_step_wait(d->be);
    return st ? st : st2 ? st2 : st3;
}

/* Seconds per op (negative on failure): ops to a step doubled until a step
 * takes min_time / 8 (or --reps of them; a pool at least once through),
 * then steps until min_time has passed, at least three; the best wins. */
static double time_op(bo_dev *d, const wpool *p, const opts *o, int *reps_out) {
    const int pooled = p && p->n ? p->n : 0;
    const int cap = pooled > o->reps ? pooled : o->reps;
    int reps = pooled ? pooled : 1;
    double dt;
    for (;;) {
        double t0 = bench_now();
        if (run_step(d, p, reps) != DUET_OK) return -1;
        dt = bench_now() - t0;
        if (dt >= o->min_time / 8 || reps >= cap) break;
        reps = reps * 2 > cap ? cap : reps * 2;
    }
    double best = dt / reps, spent = dt;
    for (int i = 1; i < 50 && (i < 3 || spent < o->min_time); i++) {
        double t0 = bench_now();
        if (run_step(d, p, reps) != DUET_OK) return -1;
        dt = bench_now() - t0;
        spent += dt;
        if (dt / reps < best) best = dt / reps;
    }
    *reps_out = reps;
    return best;
}

/* A large ADD through the backend: 3 x 64 MiB moved per op, like a triad. */
static double device_add_gbs(duet_backend *be, const opts *o) {
    const size_t n = (64u << 20) / 4;
    duet_buffer *a = NULL, *b = NULL;
    double gbs = 0;
    if (duet_buffer_alloc(be, n * 4, &a) == DUET_OK && duet_buffer_alloc(be, n * 4, &b) == DUET_OK) {
        float *init = calloc(n, 4);
        duet_buffer_upload(be, a, 0, init, n * 4);
        duet_buffer_upload(be, b, 0, init, n * 4);
        free(init);
        bo_dev d = {.be = be};
        d.op = (duet_op){.kind = DUET_OP_ADD, .n_tokens = 1024};
        d.op.add.a = (duet_view){a, 0};
        d.op.add.b = (duet_view){b, 0};
        d.op.add.out = (duet_view){a, 0};
        d.op.add.dim = (int)(n / 1024);
        opts short_run = *o;
        short_run.reps = 3;
        int reps;
        if (run_step(&d, NULL, 1) == DUET_OK) {
            double s = time_op(&d, NULL, &short_run, &reps);
            if (s > 0) gbs = 12.0 * n / s / 1e9;
        }
    }
    duet_buffer_free(be, a);
    duet_buffer_free(be, b);
    return gbs;
}

/* ---- one case on one instance ----------------------------------------------------------------- */

typedef struct device_ctx {
    const duet_backend_iface *iface;
    int dev;
    double peak; /* GB/s, perf mode */
    cJSON *rows;
    counts *n;
} device_ctx;

/* Runs case ci on `be` under variant label vl; appends a row. */
static void run_case(const device_ctx *dc, duet_backend *be, const char *vl, int ci, const opts *o) {
    const bo_case *c = &bo_cases[ci];
    char label[160], msg[600] = "";
    bo_case_label(c, label, sizeof label);
    cJSON *r = cJSON_CreateObject();
    cJSON_AddStringToObject(r, "op", bo_op_name(c->kind));
    cJSON_AddStringToObject(r, "dtype", duet_dtype_name(c->dtype));
    cJSON_AddStringToObject(r, "shape", c->shape);
    cJSON_AddStringToObject(r, "case", label);
    cJSON_AddStringToObject(r, "variant", vl);
    cJSON_AddNumberToObject(r, "n_tokens", c->n_tokens);
    cJSON_AddItemToArray(dc->rows, r);
    bo_host h;
    bo_host_build(ci, &h);
    bo_dev d;
    duet_status st = bo_dev_setup(be, &h, &d);
    const char *status = "pass";
    if (st == DUET_OK && !duet_device_supports_op(be->iface, be->device_index, &d.op)) {
        status = "not supported";
        dc->n->unsupported++;
    } else if (st != DUET_OK || (st = bo_dev_run(&d, 1)) != DUET_OK) {
        snprintf(msg, sizeof msg, "%s: %s", duet_status_name(st), duet_last_error());
        status = "error";
        dc->n->errors++;
    } else if (o->check || o->test) {
        double nmse;
        if (bo_dev_check(&d, &h, answer(ci), &nmse, msg, sizeof msg)) {
            dc->n->passed++;
        } else {
            status = "fail";
            dc->n->failed++;
        }
        cJSON_AddNumberToObject(r, "nmse", nmse);
    } else {
        status = "unchecked";
    }
    cJSON_AddStringToObject(r, "status", status);
    if (msg[0]) cJSON_AddStringToObject(r, "error", msg);
    const bool ran = !strcmp(status, "pass") || !strcmp(status, "fail") || !strcmp(status, "unchecked");
    if (o->test) {
        if (strcmp(status, "pass") != 0 || o->verbose)
            printf("  %-13s %s/%d [%s] %s%s%s\n", status, dc->iface->name, dc->dev, vl, label,
                   msg[0] ? ": " : "", msg);
    } else if (!ran) {
        printf("    %-64s %s%s%s\n", label, status, msg[0] ? ": " : "", msg);
    } else {
        /* Timed after the check: accumulating and in-place ops change their
         * operands with every run. */
        wpool pool = {0};
        const bool gemv = c->kind == DUET_OP_MATMUL && c->n_tokens == 1 && !(c->modes & BO_HOT);
        if (gemv && o->pool_bytes && pool_make(be, &h, o->pool_bytes, &pool) != DUET_OK)
            printf("    %-64s (no weight pool: %s)\n", label, duet_last_error());
        int reps = 0;
        const double s = time_op(&d, &pool, o, &reps);
        if (s < 0) {
            cJSON_AddStringToObject(r, "error", duet_last_error());
            printf("    %-64s error: %s\n", label, duet_last_error());
        } else {
            double bytes, flops;
            bo_case_cost(c, &bytes, &flops);
            const double gbs = bytes / s / 1e9;
            cJSON_AddNumberToObject(r, "us", s * 1e6);
            cJSON_AddNumberToObject(r, "gbs", gbs);
            cJSON_AddNumberToObject(r, "gflops", flops / s / 1e9);
            if (dc->peak > 0) cJSON_AddNumberToObject(r, "frac_peak_bw", gbs / dc->peak);
            cJSON_AddNumberToObject(r, "ops_per_step", reps);
            /* Cold: cycled through the pool, or one matrix at least half its size. */
            const bool cold =
                pool.n || (gemv && 2 * h.ops[bo_find(&h, "w")].bytes >= o->pool_bytes && o->pool_bytes);
            if (c->kind == DUET_OP_MATMUL)
                cJSON_AddStringToObject(r, "weights", pool.n ? "pool" : cold ? "cold" : "hot");
            if (pool.n) cJSON_AddNumberToObject(r, "pool_mib", (double)pool.n * pool.bytes / (1 << 20));
            printf("    %-64s %10.2f us %8.2f GB/s %8.2f GFLOP/s %6.1f%%%s%s%s\n", label, s * 1e6, gbs,
                   flops / s / 1e9, dc->peak > 0 ? 100 * gbs / dc->peak : 0.0, cold ? " cold" : "",
                   !strcmp(status, "fail") ? "  CHECK FAILED: " : "", !strcmp(status, "fail") ? msg : "");
        }
        pool_free(be, &pool);
    }
    fflush(stdout);
    bo_dev_free(&d);
    bo_host_free(&h);
}

/* ---- one variant on one device ---------------------------------------------------------------- */

/* Opens device dev under variant v (its variable set for the open only). */
static duet_status open_variant(const duet_backend_iface *iface, int dev, const bo_variant *v, int n_threads,
                                duet_backend **out) {
    char *saved = NULL;
    const char *old = v->env ? getenv(v->env) : NULL;
    if (old) saved = strdup(old);
    if (v->env) setenv(v->env, v->value, 1);
    duet_status st = iface->open(dev, &(duet_backend_params){.n_threads = n_threads}, out);
    if (v->env) {
        if (saved)
            setenv(v->env, saved, 1);
        else
            unsetenv(v->env);
    }
    free(saved);
    return st;
}

/* Whether the case at ci runs under v in this mode. */
static bool case_selected(const opts *o, const bo_variant *v, int ci) {
    const bo_case *c = &bo_cases[ci];
    if (o->test ? !((c->modes & (o->small ? BO_SMALL : BO_TEST)) && bo_variant_runs(v, c))
                : !bo_variant_times(v, c))
        return false;
    if (!o->filter) return true;
    char label[160], buf[256];
    bo_case_label(c, label, sizeof label);
    snprintf(buf, sizeof buf, "%s", o->filter);
    char *save = NULL;
    for (char *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save))
        if (strstr(label, t)) return true;
    return false;
}

static void run_variant(const device_ctx *dc, const bo_variant *v, const opts *o, cJSON *vlist) {
    /* Threads: perf mode times every cpu variant at --threads; test mode
     * runs each at its own count, as the parity test. */
    const int n_threads = !o->test && v->n_threads ? o->threads : v->n_threads;
    bo_variant shown = *v;
    shown.n_threads = n_threads;
    char vl[600];
    bo_variant_label(&shown, vl, sizeof vl);
    cJSON *ve = cJSON_CreateObject();
    cJSON_AddStringToObject(ve, "variant", vl);
    cJSON_AddItemToArray(vlist, ve);
    int n_cases = 0;
    for (int ci = 0; ci < BO_N_CASES; ci++)
        n_cases += case_selected(o, v, ci);
    if (!n_cases) {
        cJSON_AddStringToObject(ve, "skipped", "no case selected");
        return;
    }
    duet_device_info info;
    if (v->int8_dot && (dc->iface->device_info(dc->dev, &info) != DUET_OK || !info.int8_dot)) {
        printf("  [%s]: not on this device (no int8 dot product)\n", vl);
        cJSON_AddStringToObject(ve, "skipped", "no int8 dot product");
        dc->n->skipped_variants++;
        return;
    }
    duet_backend *be;
    if (open_variant(dc->iface, dc->dev, v, n_threads, &be) != DUET_OK) {
        /* The parity test fails a variant that cannot open; a perf path the
         * device cannot take is only absent. */
        printf("  %s[%s]: open failed: %s\n", o->test ? "FAIL " : "", vl, duet_last_error());
        cJSON_AddStringToObject(ve, o->test ? "error" : "skipped", duet_last_error());
        if (o->test)
            dc->n->failed++;
        else
            dc->n->skipped_variants++;
        return;
    }
    if (v->proof && !strstr(be->info.driver, v->proof)) {
        printf("  [%s]: not on this device (it runs %s)\n", vl, be->info.driver);
        cJSON_AddStringToObject(ve, "skipped", "path not on this device");
        dc->n->skipped_variants++;
        dc->iface->close(be);
        return;
    }
    if (!o->test) printf("  [%s] %s\n", vl, be->info.features);
    counts before = *dc->n;
    const double t0 = bench_now();
    for (int ci = 0; ci < BO_N_CASES; ci++)
        if (case_selected(o, v, ci)) run_case(dc, be, vl, ci, o);
    const counts *n = dc->n;
    cJSON_AddNumberToObject(ve, "passed", n->passed - before.passed);
    cJSON_AddNumberToObject(ve, "failed", n->failed - before.failed);
    cJSON_AddNumberToObject(ve, "not_supported", n->unsupported - before.unsupported);
    cJSON_AddNumberToObject(ve, "errors", n->errors - before.errors);
    cJSON_AddNumberToObject(ve, "seconds", bench_now() - t0);
    if (o->test)
        printf("%s/%d (%s) [%s]: %d passed, %d failed, %d errors, %d not supported (%.1f s)\n",
               dc->iface->name, dc->dev, be->info.name, vl, n->passed - before.passed,
               n->failed - before.failed, n->errors - before.errors, n->unsupported - before.unsupported,
               bench_now() - t0);
    fflush(stdout);
    dc->iface->close(be);
}

/* Whether variant v runs: perf_table says it comes from bo_perf_variants. */
static bool variant_selected(const opts *o, const bo_variant *v, bool perf_table) {
    const char *want = o->variants;
    if (!want || !*want) want = o->test ? "all" : "perf";
    if (o->test && perf_table) return false; /* test mode: the parity test's variants */
    if (!strcmp(want, "all")) return true;
    if (!strcmp(want, "default")) return v->env == NULL;
    if (!strcmp(want, "perf")) return v->env == NULL || perf_table;
    char label[600];
    bo_variant_label(v, label, sizeof label);
    if (want[0] == '!') return strstr(label, want + 1) == NULL;
    return strstr(label, want) != NULL;
}

/* ---- the CLBlast crossover (OpenCL, perf) ---------------------------------------------------- */

static const char *json_str(const cJSON *o, const char *k) {
    const cJSON *v = cJSON_GetObjectItem(o, k);
    return v && cJSON_IsString(v) ? v->valuestring : "";
}

static double json_num(const cJSON *o, const char *k) {
    const cJSON *v = cJSON_GetObjectItem(o, k);
    return v && cJSON_IsNumber(v) ? v->valuedouble : -1;
}

/* F32/F16 768->2048 batches timed under clblast_min=0 (ours) and =1
 * (CLBlast): the token count where CLBlast first wins, per dtype. */
static void clblast_sweep(cJSON *dj, const cJSON *rows) {
    static const char *const types[2] = {"f32", "f16"};
    cJSON *sw = NULL;
    for (int ti = 0; ti < 2; ti++) {
        int toks[32], n = 0;
        double ours[32], clb[32];
        const cJSON *a;
        cJSON_ArrayForEach(a, rows) {
            if (strcmp(json_str(a, "op"), "matmul") || strcmp(json_str(a, "dtype"), types[ti]) ||
                !strstr(json_str(a, "case"), "x768->2048") || json_num(a, "n_tokens") < 2 ||
                json_num(a, "us") <= 0 || !strstr(json_str(a, "variant"), "clblast_min=0"))
                continue;
            const cJSON *b;
            cJSON_ArrayForEach(b, rows) {
                if (!strcmp(json_str(b, "case"), json_str(a, "case")) &&
                    strstr(json_str(b, "variant"), "clblast_min=1") && json_num(b, "us") > 0 && n < 32) {
                    toks[n] = (int)json_num(a, "n_tokens");
                    ours[n] = json_num(a, "us");
                    clb[n++] = json_num(b, "us");
                    break;
                }
            }
        }
        if (!n) continue;
        for (int i = 1; i < n; i++) /* by token count */
            for (int j = i; j > 0 && toks[j] < toks[j - 1]; j--) {
                int t = toks[j];
                toks[j] = toks[j - 1], toks[j - 1] = t;
                double x = ours[j];
                ours[j] = ours[j - 1], ours[j - 1] = x;
                x = clb[j];
                clb[j] = clb[j - 1], clb[j - 1] = x;
            }
        if (!sw) sw = cJSON_AddArrayToObject(dj, "clblast_sweep");
        int first_win = 0;
        for (int i = 0; i < n; i++) {
            cJSON *e = cJSON_CreateObject();
            cJSON_AddStringToObject(e, "dtype", types[ti]);
            cJSON_AddNumberToObject(e, "n_tokens", toks[i]);
            cJSON_AddNumberToObject(e, "ours_us", ours[i]);
            cJSON_AddNumberToObject(e, "clblast_us", clb[i]);
            cJSON_AddItemToArray(sw, e);
            printf("  sweep matmul %s %3dx768->2048: ours %9.1f us  clblast %9.1f us\n", types[ti], toks[i],
                   ours[i], clb[i]);
            if (!first_win && clb[i] < ours[i]) first_win = toks[i];
        }
        if (first_win)
            printf("  -> CLBlast first wins for %s at %d tokens\n", types[ti], first_win);
        else
            printf("  -> CLBlast wins for %s at no tested token count\n", types[ti]);
        char key[32];
        snprintf(key, sizeof key, "clblast_min_%s", types[ti]);
        cJSON_AddNumberToObject(dj, key, first_win);
    }
}

/* ---- one device ------------------------------------------------------------------------------ */

static void run_device(const duet_backend_iface *iface, int dev, const opts *o, double triad, cJSON *devices,
                       counts *n) {
    duet_device_info info;
    if (iface->device_info(dev, &info) != DUET_OK) {
        fprintf(stderr, "bench_backend_ops: %s/%d: %s\n", iface->name, dev, duet_last_error());
        n->errors++;
        return;
    }
    const bool cpu_type = info.type == DUET_DEVICE_CPU || info.type == DUET_DEVICE_HOST;
    cJSON *dj = cJSON_CreateObject();
    cJSON_AddItemToArray(devices, dj);
    cJSON_AddStringToObject(dj, "backend", iface->name);
    cJSON_AddNumberToObject(dj, "device_index", dev);
    cJSON_AddStringToObject(dj, "device", info.name);
    cJSON_AddStringToObject(dj, "driver", info.driver);
    cJSON_AddNumberToObject(dj, "compute_units", info.compute_units);
    cJSON_AddBoolToObject(dj, "cpu_type", cpu_type);
    device_ctx dc = {.iface = iface, .dev = dev, .n = n};
    if (!o->test) {
        /* The device's own bandwidth, through its default instance. */
        duet_backend *be;
        double add = 0;
        if (iface->open(dev, &(duet_backend_params){.n_threads = o->threads}, &be) == DUET_OK) {
            add = device_add_gbs(be, o);
            iface->close(be);
        }
        dc.peak = cpu_type ? triad : add;
        cJSON_AddNumberToObject(dj, "device_add_gbs", add);
        cJSON_AddNumberToObject(dj, "peak_gbs", dc.peak);
        cJSON_AddStringToObject(dj, "peak_source",
                                cpu_type ? "machine STREAM triad" : "ADD op through the backend");
        printf("\n%s/%d: %s (%s) — peak %.1f GB/s (%s), device ADD %.1f GB/s\n", iface->name, dev, info.name,
               info.driver, dc.peak, cpu_type ? "triad" : "ADD", add);
        printf("    %-64s %13s %13s %16s %7s\n", "case", "time/op", "bandwidth", "compute", "% peak");
    } else {
        printf("\n%s/%d: %s (%s)\n", iface->name, dev, info.name, info.driver);
    }
    cJSON *vlist = cJSON_AddArrayToObject(dj, "variants");
    dc.rows = cJSON_AddArrayToObject(dj, "ops");
    for (int i = 0; i < BO_N_VARIANTS; i++)
        if (!strcmp(bo_variants[i].backend, iface->name) && variant_selected(o, &bo_variants[i], false))
            run_variant(&dc, &bo_variants[i], o, vlist);
    for (int i = 0; i < BO_N_PERF_VARIANTS; i++)
        if (!strcmp(bo_perf_variants[i].backend, iface->name) &&
            variant_selected(o, &bo_perf_variants[i], true))
            run_variant(&dc, &bo_perf_variants[i], o, vlist);
    if (!o->test && !strcmp(iface->name, "opencl")) clblast_sweep(dj, dc.rows);
}

/* ---- floors ---------------------------------------------------------------------------------- */

/* The matrix-vector floors, per device and weight type: 1b up projection
 * from x_q8 under the default variant, against the device's peak. Q8_0:
 * >= 25% on OpenCL CPU devices, on Vulkan >= 10% on CPU devices and 80% on
 * GPUs; the other block types (issue 16): >= 20% on OpenCL CPU devices,
 * >= 10% on Vulkan CPU devices. */
static double floor_min(const char *be, bool cpu_type, const char *dtype) {
    const bool q8 = !strcmp(dtype, "q8_0");
    if (!strcmp(be, "opencl") && cpu_type) return q8 ? 0.25 : 0.20;
    if (!strcmp(be, "vulkan")) return cpu_type ? 0.10 : q8 ? 0.80 : -1;
    return -1;
}

static bool floors(cJSON *devices, cJSON *out) {
    bool ok = true;
    const cJSON *dj;
    cJSON_ArrayForEach(dj, devices) {
        const char *be = json_str(dj, "backend");
        const bool cpu_type = cJSON_IsTrue(cJSON_GetObjectItem(dj, "cpu_type"));
        const cJSON *r;
        cJSON_ArrayForEach(r, cJSON_GetObjectItem(dj, "ops")) {
            const double min = floor_min(be, cpu_type, json_str(r, "dtype"));
            if (min < 0 || strcmp(json_str(r, "shape"), "1b-up-q8") ||
                strncmp(json_str(r, "variant"), "default", 7) || json_num(r, "frac_peak_bw") < 0)
                continue;
            const double f = json_num(r, "frac_peak_bw");
            const bool pass = f >= min && strcmp(json_str(r, "status"), "fail") != 0;
            cJSON *e = cJSON_CreateObject();
            char name[160];
            snprintf(name, sizeof name, "%s/%d %s matrix-vector (1b-up, x_q8) fraction of peak", be,
                     (int)json_num(dj, "device_index"), json_str(r, "dtype"));
            cJSON_AddStringToObject(e, "name", name);
            cJSON_AddNumberToObject(e, "value", f);
            cJSON_AddNumberToObject(e, "min", min);
            cJSON_AddBoolToObject(e, "ok", pass);
            cJSON_AddItemToArray(out, e);
            printf("floor: %s %.1f%% (>= %.0f%%): %s\n", name, 100 * f, 100 * min, pass ? "ok" : "BELOW");
            ok = ok && pass;
        }
    }
    return ok;
}

/* ---- main ------------------------------------------------------------------------------------ */

static void usage(void) {
    fprintf(stderr, "usage: bench_backend_ops [--mode perf|test] [--backends cpu,opencl,vulkan]\n"
                    "         [--variants perf|default|all|STR|!STR] [--filter STR] [--cases small]\n"
                    "         [--reps N] [--min-time S] [--pool-mib N] [--threads N] [--quick]\n"
                    "         [--no-check] [--strict] [--verbose] [--list] [--json] [--out FILE]\n"
                    "  --mode test   every BO_TEST case, every backend and tuning variant, against the "
                    "oracle (exit 1 on a "
                    "mismatch)\n"
                    "  --mode perf   time the BO_PERF cases (each checked once against the oracle): time/op, "
                    "GB/s, GFLOP/s, "
                    "%% of peak\n"
                    "  (see the comment at the top of bench/bench_backend_ops.c)\n");
}

static void list_table(void) {
    printf("cases (modes: T test, P perf, S small, A attention paths, H hot):\n");
    for (int ci = 0; ci < BO_N_CASES; ci++) {
        const bo_case *c = &bo_cases[ci];
        char label[160];
        bo_case_label(c, label, sizeof label);
        printf("  %c%c%c%c%c  %s\n", c->modes & BO_TEST ? 'T' : '-', c->modes & BO_PERF ? 'P' : '-',
               c->modes & BO_SMALL ? 'S' : '-', c->modes & BO_PATHS ? 'A' : '-',
               c->modes & BO_HOT ? 'H' : '-', label);
    }
    printf("variants (test and perf):\n");
    for (int i = 0; i < BO_N_VARIANTS; i++) {
        char vl[600];
        bo_variant_label(&bo_variants[i], vl, sizeof vl);
        printf("  %-7s %s\n", bo_variants[i].backend, vl);
    }
    printf("perf variants:\n");
    for (int i = 0; i < BO_N_PERF_VARIANTS; i++) {
        char vl[600];
        bo_variant_label(&bo_perf_variants[i], vl, sizeof vl);
        printf("  %-7s %s\n", bo_perf_variants[i].backend, vl);
    }
}

int main(int argc, char **argv) {
    opts o = {.reps = 1000, .threads = 2, .min_time = 0.2, .check = true};
    long pool_mib = -1;
    bool quick = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--mode") && v && (!strcmp(v, "test") || !strcmp(v, "perf")))
            o.test = !strcmp(v, "test"), i++;
        else if (!strcmp(a, "--backends") && v)
            o.backends = v, i++;
        else if (!strcmp(a, "--variants") && v)
            o.variants = v, i++;
        else if (!strcmp(a, "--filter") && v)
            o.filter = v, i++;
        else if (!strcmp(a, "--cases") && v && !strcmp(v, "small"))
            o.small = true, i++;
        else if (!strcmp(a, "--out") && v)
            o.out = v, i++;
        else if (!strcmp(a, "--reps") && v)
            o.reps = atoi(v), i++;
        else if (!strcmp(a, "--min-time") && v)
            o.min_time = atof(v), i++;
        else if (!strcmp(a, "--pool-mib") && v)
            pool_mib = atol(v), i++;
        else if (!strcmp(a, "--threads") && v)
            o.threads = atoi(v), i++;
        else if (!strcmp(a, "--quick"))
            quick = true;
        else if (!strcmp(a, "--no-check"))
            o.check = false;
        else if (!strcmp(a, "--strict"))
            o.strict = true;
        else if (!strcmp(a, "--verbose"))
            o.verbose = true;
        else if (!strcmp(a, "--list"))
            o.list = true;
        else if (!strcmp(a, "--json"))
            o.json = true;
        else {
            usage();
            return strcmp(a, "--help") && strcmp(a, "-h") ? 2 : 0;
        }
    }
    if (o.list) {
        list_table();
        return 0;
    }
    if (o.reps < 1) o.reps = 1;
    if (o.threads < 1) o.threads = 1;
    if (quick && o.min_time == 0.2) o.min_time = 0.03;
    if (o.min_time <= 0) o.min_time = 0.01;
    if (pool_mib < 0) {
        long llc = sysconf(_SC_LEVEL3_CACHE_SIZE);
        pool_mib = llc > 0 ? 2 * ((llc + (1 << 20) - 1) >> 20) : 256;
        if (pool_mib < 64) pool_mib = 64;
        if (pool_mib > 1024) pool_mib = 1024;
    }
    o.pool_bytes = (size_t)pool_mib << 20;
    /* --json prints the report alone on stdout: the table goes to stderr. */
    const int json_fd = o.json ? dup(STDOUT_FILENO) : -1;
    if (o.json && (json_fd < 0 || dup2(STDERR_FILENO, STDOUT_FILENO) < 0)) return 1;

    const double triad = o.test ? 0 : bench_triad_gbs(o.threads, 5);
    cJSON *root = cJSON_CreateObject();
    char cmd[512] = "";
    for (int i = 0; i < argc; i++) {
        size_t len = strlen(cmd);
        snprintf(cmd + len, sizeof cmd - len, "%s%s", i ? " " : "", argv[i]);
    }
    cJSON_AddStringToObject(root, "command", cmd);
    cJSON_AddStringToObject(root, "mode", o.test ? "test" : "perf");
    /* The machine may be shared: its load says how much to trust the times. */
    double load = -1;
    FILE *lf = fopen("/proc/loadavg", "r");
    if (lf) {
        if (fscanf(lf, "%lf", &load) != 1) load = -1;
        fclose(lf);
    }
    cJSON_AddNumberToObject(root, "load_average_1min", load);
    cJSON_AddNumberToObject(root, "threads", o.threads);
    if (!o.test) {
        cJSON_AddNumberToObject(root, "triad_gbs", triad);
        cJSON_AddNumberToObject(root, "pool_mib", (double)pool_mib);
        cJSON_AddNumberToObject(root, "min_time_s", o.min_time);
        cJSON_AddNumberToObject(root, "max_ops_per_step", o.reps);
        printf("machine triad (%d threads): %.1f GB/s; GEMV weight pool %ld MiB; load %.2f\n", o.threads,
               triad, pool_mib, load);
    }
    cJSON *devices = cJSON_AddArrayToObject(root, "devices");
    counts n = {0};
    for (int b = 0; b < duet_backend_count(); b++) {
        const duet_backend_iface *iface = duet_backend_get(b);
        if (!in_list(o.backends, iface->name)) continue;
        char why[256] = "";
        if (!iface->available(why, sizeof why)) {
            printf("\nSKIP %s: %s\n", iface->name, why);
            continue;
        }
        for (int d = 0; d < iface->device_count(); d++)
            run_device(iface, d, &o, triad, devices, &n);
    }
    bool floors_ok = true;
    if (!o.test) {
        printf("\n");
        floors_ok = floors(devices, cJSON_AddArrayToObject(root, "floors"));
    }
    cJSON *sum = cJSON_AddObjectToObject(root, "summary");
    cJSON_AddNumberToObject(sum, "passed", n.passed);
    cJSON_AddNumberToObject(sum, "failed", n.failed);
    cJSON_AddNumberToObject(sum, "errors", n.errors);
    cJSON_AddNumberToObject(sum, "not_supported", n.unsupported);
    cJSON_AddNumberToObject(sum, "variants_not_on_device", n.skipped_variants);
    printf("\n%s: %d passed, %d failed, %d errors, %d not supported; %d variants not on their device\n",
           o.test ? "test" : "perf (oracle checks)", n.passed, n.failed, n.errors, n.unsupported,
           n.skipped_variants);

    char *s = cJSON_Print(root);
    if (o.json) {
        fflush(stdout);
        FILE *f = fdopen(json_fd, "w");
        if (f) {
            fputs(s, f);
            fputc('\n', f);
            fclose(f);
        }
    }
    if (o.out) {
        FILE *f = fopen(o.out, "w");
        if (f) {
            fputs(s, f);
            fputc('\n', f);
            fclose(f);
        } else {
            fprintf(stderr, "bench_backend_ops: cannot write %s\n", o.out);
        }
    }
    cJSON_free(s);
    cJSON_Delete(root);
    for (int ci = 0; ci < BO_N_CASES; ci++)
        bo_answer_free(&answers[ci]);
    const bool bad = n.failed > 0 || n.errors > 0 || (o.strict && !floors_ok);
    return bad ? 1 : 0;
}
