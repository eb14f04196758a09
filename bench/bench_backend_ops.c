/* bench_backend_ops.c — the kernel and end-to-end benchmark of every
 * backend, side by side on one machine.
 *
 * Kernels: the BO_PERF cases of tests/backend_ops_cases.h (the parity
 * test's table) on every device: time per op, GB/s and GFLOP/s, and the
 * fraction of the device's peak bandwidth (the machine's STREAM triad for
 * CPU-type devices, a large ADD through the backend otherwise). On OpenCL,
 * F32/F16 matmuls run twice, through CLBlast and through our kernels, and
 * --sweep finds the token count where CLBlast starts to win (the tuning
 * table's clblast_min).
 *
 * End to end: prefill and decode tokens/s of the synthetic 125m and 1b
 * models (duet_mkmodel) through the public API on each backend.
 *
 * usage: bench_backend_ops [--backends opencl,cpu] [--filter STR] [--reps N]
 *          [--threads N] [--models 125m-q8_0,1b-q8_0] [--decode-tokens N]
 *          [--no-ops] [--no-e2e] [--sweep] [--json] [--out FILE]
 *
 * Floors (issue: OpenCL backend, PoCL on 2 cores) are printed at the end:
 * Q8_0 matrix-vector >= 25% of triad, 125m q8_0 decode >= 40 tokens/s. */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <string.h>

#include "../tests/backend_ops_cases.h"
#include "bench_util.h"
#include "duet.h"

typedef struct opts {
    const char *backends, *filter, *models, *out;
    int reps, threads, decode_tokens;
    bool ops, e2e, sweep, json;
} opts;

static bool in_list(const char *list, const char *name) {
    if (!list || !*list) return true;
    char buf[256];
    snprintf(buf, sizeof buf, "%s", list);
    char *save = NULL;
    for (char *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save))
        if (!strcmp(t, name)) return true;
    return false;
}

/* Seconds per op: one warm-up step, then steps of `reps` ops until ~0.3 s
 * has passed; the best step wins. Negative on failure. */
static double time_op(bo_dev *d, int reps) {
    if (bo_dev_run(d, 1) != DUET_OK) return -1;
    double best = 1e30, spent = 0;
    for (int i = 0; i < 20 && (i < 3 || spent < 0.3); i++) {
        double t0 = bench_now();
        if (bo_dev_run(d, reps) != DUET_OK) return -1;
        double dt = bench_now() - t0;
        spent += dt;
        if (dt / reps < best) best = dt / reps;
    }
    return best;
}

/* Runs case ci on `be` and appends a row. impl names the path ("ours",
 * "clblast", or the backend's only one). */
static void bench_case(duet_backend *be, int ci, const char *impl, const opts *o, double peak, cJSON *rows) {
    const bo_case *c = &bo_cases[ci];
    char label[160];
    bo_case_label(c, label, sizeof label);
    bo_host h;
    bo_host_build(ci, &h);
    bo_dev d;
    cJSON *r = cJSON_CreateObject();
    cJSON_AddStringToObject(r, "op", bo_op_name(c->kind));
    cJSON_AddStringToObject(r, "dtype", duet_dtype_name(c->dtype));
    cJSON_AddStringToObject(r, "shape", c->shape);
    cJSON_AddStringToObject(r, "case", label);
    cJSON_AddStringToObject(r, "impl", impl);
    cJSON_AddNumberToObject(r, "n_tokens", c->n_tokens);
    if (bo_dev_setup(be, &h, &d) != DUET_OK || !duet_device_supports_op(be->iface, be->device_index, &d.op)) {
        cJSON_AddStringToObject(r, "error", duet_last_error());
    } else {
        double bytes, flops;
        bo_case_cost(c, &bytes, &flops);
        double s = time_op(&d, o->reps);
        if (s < 0) {
            cJSON_AddStringToObject(r, "error", duet_last_error());
        } else {
            cJSON_AddNumberToObject(r, "us", s * 1e6);
            cJSON_AddNumberToObject(r, "gbs", bytes / s / 1e9);
            cJSON_AddNumberToObject(r, "gflops", flops / s / 1e9);
            if (peak > 0) cJSON_AddNumberToObject(r, "frac_peak_bw", bytes / s / 1e9 / peak);
        }
    }
    bo_dev_free(&d);
    bo_host_free(&h);
    cJSON_AddItemToArray(rows, r);
    if (!o->json) {
        cJSON *e = cJSON_GetObjectItem(r, "error");
        if (e) printf("  %-62s %-8s error: %s\n", label, impl, e->valuestring);
        else
            printf("  %-62s %-8s %10.1f us %8.2f GB/s %8.2f GFLOP/s %6.1f%%\n", label, impl,
                   cJSON_GetObjectItem(r, "us")->valuedouble, cJSON_GetObjectItem(r, "gbs")->valuedouble,
                   cJSON_GetObjectItem(r, "gflops")->valuedouble,
                   peak > 0 ? 100 * cJSON_GetObjectItem(r, "frac_peak_bw")->valuedouble : 0.0);
        fflush(stdout);
    }
}

/* A large ADD through the backend: 3 x 64 MiB moved per op, like a triad. */
static double device_add_gbs(duet_backend *be) {
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
        double s = time_op(&d, 3);
        if (s > 0) gbs = 12.0 * n / s / 1e9;
    }
    duet_buffer_free(be, a);
    duet_buffer_free(be, b);
    return gbs;
}

static duet_status open_with_tune(const duet_backend_iface *iface, int dev, int threads, const char *tune,
                                  duet_backend **out) {
    /* The OpenCL backend reads its tuning overrides at open. */
    char *saved = getenv("DUET_OPENCL_TUNE") ? strdup(getenv("DUET_OPENCL_TUNE")) : NULL;
    if (tune) setenv("DUET_OPENCL_TUNE", tune, 1);
    duet_status st = iface->open(dev, &(duet_backend_params){.n_threads = threads}, out);
    if (saved) setenv("DUET_OPENCL_TUNE", saved, 1);
    else if (tune) unsetenv("DUET_OPENCL_TUNE");
    free(saved);
    return st;
}

static bool is_clblast_case(const bo_case *c) {
    return c->kind == DUET_OP_MATMUL && (c->dtype == DUET_DTYPE_F32 || c->dtype == DUET_DTYPE_F16);
}

static void bench_device(const duet_backend_iface *iface, int dev, const opts *o, double triad, cJSON *devices) {
    duet_backend *be;
    if (open_with_tune(iface, dev, o->threads, NULL, &be) != DUET_OK) {
        fprintf(stderr, "bench_backend_ops: %s/%d: %s\n", iface->name, dev, duet_last_error());
        return;
    }
    const bool cpu_type = be->info.type == DUET_DEVICE_CPU || be->info.type == DUET_DEVICE_HOST;
    const double add = device_add_gbs(be);
    const double peak = cpu_type ? triad : add;
    cJSON *dj = cJSON_CreateObject();
    cJSON_AddStringToObject(dj, "backend", iface->name);
    cJSON_AddNumberToObject(dj, "device_index", dev);
    cJSON_AddStringToObject(dj, "device", be->info.name);
    cJSON_AddStringToObject(dj, "driver", be->info.driver);
    cJSON_AddNumberToObject(dj, "compute_units", be->info.compute_units);
    cJSON_AddNumberToObject(dj, "device_add_gbs", add);
    cJSON_AddNumberToObject(dj, "peak_gbs", peak);
    cJSON_AddStringToObject(dj, "peak_source", cpu_type ? "machine STREAM triad" : "ADD op through the backend");
    cJSON *rows = cJSON_AddArrayToObject(dj, "ops");
    if (!o->json)
        printf("\n%s/%d: %s (%s) — peak %.1f GB/s (%s), device ADD %.1f GB/s\n", iface->name, dev, be->info.name,
               be->info.driver, peak, cpu_type ? "triad" : "ADD", add);
    const bool opencl = !strcmp(iface->name, "opencl");
    duet_backend *ours = NULL, *clb = NULL;
    if (opencl && o->ops) {
        open_with_tune(iface, dev, o->threads, "clblast_min=0", &ours);
        open_with_tune(iface, dev, o->threads, "clblast_min=1", &clb);
    }
    for (int ci = 0; ci < BO_N_CASES && o->ops; ci++) {
        if (!(bo_cases[ci].modes & BO_PERF)) continue;
        char label[160];
        bo_case_label(&bo_cases[ci], label, sizeof label);
        if (o->filter && !strstr(label, o->filter)) continue;
        if (opencl && is_clblast_case(&bo_cases[ci]) && bo_cases[ci].n_tokens > 1 && ours && clb) {
            bench_case(ours, ci, "ours", o, peak, rows);
            bench_case(clb, ci, "clblast", o, peak, rows);
        } else {
            bench_case(be, ci, iface->name, o, peak, rows);
        }
    }
    if (opencl && o->sweep && ours && clb) {
        /* Token counts where CLBlast overtakes our kernels, per dtype. */
        cJSON *sw = cJSON_AddArrayToObject(dj, "clblast_sweep");
        const int toks[] = {4, 8, 16, 32, 64, 128};
        const duet_dtype types[] = {DUET_DTYPE_F32, DUET_DTYPE_F16};
        for (int ti = 0; ti < 2; ti++) {
            int first_win = 0;
            for (size_t k = 0; k < sizeof toks / sizeof toks[0]; k++) {
                bo_case c = {"sweep", DUET_OP_MATMUL, types[ti], toks[k], 768, 2048, .modes = BO_PERF};
                double s_ours = -1, s_clb = -1;
                for (int which = 0; which < 2; which++) {
                    bo_host h;
                    /* bo_host_build indexes the table: build from a copy. */
                    memset(&h, 0, sizeof h);
                    h.c = &c;
                    uint64_t seed = 7;
                    bo_add(&h, "w", (size_t)c.rows * duet_dtype_row_bytes(c.dtype, c.dim),
                           bo_fill_typed(c.dtype, c.rows, c.dim, seed, 1.0f), BO_ELEM_RAW, false);
                    bo_add(&h, "x", (size_t)c.n_tokens * c.dim * 4, bo_fill_f32((size_t)c.n_tokens * c.dim, seed + 1, 1.0f),
                           BO_ELEM_F32, false);
                    bo_add(&h, "out", (size_t)c.n_tokens * c.rows * 4, bo_fill_f32((size_t)c.n_tokens * c.rows, seed + 2, 1.0f),
                           BO_ELEM_F32, true);
                    bo_dev d;
                    if (bo_dev_setup(which ? clb : ours, &h, &d) == DUET_OK) {
                        double s = time_op(&d, o->reps);
                        if (which) s_clb = s;
                        else s_ours = s;
                    }
                    bo_dev_free(&d);
                    bo_host_free(&h);
                }
                cJSON *e = cJSON_CreateObject();
                cJSON_AddStringToObject(e, "dtype", duet_dtype_name(types[ti]));
                cJSON_AddNumberToObject(e, "n_tokens", toks[k]);
                cJSON_AddNumberToObject(e, "ours_us", s_ours * 1e6);
                cJSON_AddNumberToObject(e, "clblast_us", s_clb * 1e6);
                cJSON_AddItemToArray(sw, e);
                if (!first_win && s_clb > 0 && s_ours > 0 && s_clb < s_ours) first_win = toks[k];
                if (!o->json)
                    printf("  sweep matmul %s %3dx768->2048: ours %9.1f us  clblast %9.1f us\n", duet_dtype_name(types[ti]),
                           toks[k], s_ours * 1e6, s_clb * 1e6);
            }
            if (!o->json) {
                if (first_win) printf("  -> CLBlast first wins for %s at %d tokens\n", duet_dtype_name(types[ti]), first_win);
                else printf("  -> CLBlast wins for %s at no tested token count\n", duet_dtype_name(types[ti]));
            }
            char key[32];
            snprintf(key, sizeof key, "clblast_min_%s", duet_dtype_name(types[ti]));
            cJSON_AddNumberToObject(dj, key, first_win);
        }
    }
    if (ours) iface->close(ours);
    if (clb) iface->close(clb);
    iface->close(be);
    cJSON_AddItemToArray(devices, dj);
}

/* ---- end to end ------------------------------------------------------------------ */

static const char *synthetic(const char *shape, const char *type) {
    static char path[4096];
    duet_mkmodel_params p = {.shape = shape, .type = type, .seed = 1};
    if (duet_mkmodel_cached(&p, path, sizeof path, NULL)) {
        fprintf(stderr, "bench_backend_ops: mkmodel %s %s: %s\n", shape, type, duet_last_error());
        return NULL;
    }
    return path;
}

static void bench_e2e(const char *backend, const char *model, const opts *o, double triad, cJSON *out) {
    char shape[16], type[16];
    if (sscanf(model, "%15[^-]-%15s", shape, type) != 2) return;
    const char *path = synthetic(shape, type);
    if (!path) return;
    duet_open_params op = duet_open_params_default();
    op.backend = backend;
    op.n_threads = o->threads;
    op.n_ctx = 512;
    duet_model *m;
    cJSON *e = cJSON_CreateObject();
    cJSON_AddStringToObject(e, "backend", backend);
    cJSON_AddStringToObject(e, "model", model);
    cJSON_AddItemToArray(out, e);
    if (duet_model_open(path, &op, &m) != DUET_OK) {
        cJSON_AddStringToObject(e, "error", duet_last_error());
        if (!o->json) printf("  %-8s %-12s error: %s\n", backend, model, duet_last_error());
        return;
    }
    duet_model_desc desc;
    duet_model_describe(m, &desc);
    const bool big = !strcmp(shape, "1b") || !strcmp(shape, "7b");
    const int n_prompt = big ? 64 : 128, n_decode = big ? o->decode_tokens / 4 : o->decode_tokens;
    int32_t prompt[128];
    for (int i = 0; i < 128; i++) prompt[i] = 3 + (i * 7919) % (desc.n_vocab - 3);
    double best_prefill = 1e30, best_decode = 1e30;
    const int reps = big ? 1 : 3;
    duet_status st = DUET_OK;
    duet_eval(m, prompt, 8, 0, NULL); /* warm-up: kernels compiled, caches warm */
    for (int r = 0; r < reps && st == DUET_OK; r++) {
        double t0 = bench_now();
        st = duet_eval(m, prompt, n_prompt, 0, NULL);
        double dt = bench_now() - t0;
        if (dt < best_prefill) best_prefill = dt;
    }
    for (int r = 0; r < reps && st == DUET_OK; r++) {
        st = duet_eval(m, prompt, 8, 0, NULL);
        double t0 = bench_now();
        for (int i = 0; i < n_decode && st == DUET_OK; i++) st = duet_eval(m, &prompt[(8 + i) % 128], 1, 8 + i, NULL);
        double dt = bench_now() - t0;
        if (dt < best_decode) best_decode = dt;
    }
    if (st != DUET_OK) {
        cJSON_AddStringToObject(e, "error", duet_last_error());
    } else {
        cJSON_AddStringToObject(e, "device", desc.device);
        cJSON_AddNumberToObject(e, "weight_mb_per_token", desc.weight_bytes / 1e6);
        cJSON_AddNumberToObject(e, "prefill_tokens", n_prompt);
        cJSON_AddNumberToObject(e, "prefill_tokens_per_s", n_prompt / best_prefill);
        cJSON_AddNumberToObject(e, "decode_tokens", n_decode);
        cJSON_AddNumberToObject(e, "decode_tokens_per_s", n_decode / best_decode);
        cJSON_AddNumberToObject(e, "decode_fraction_of_triad", desc.weight_bytes * (n_decode / best_decode) / (triad * 1e9));
        if (!o->json)
            printf("  %-8s %-12s prefill %8.1f tok/s   decode %7.2f tok/s   (%.0f MB/token, %.0f%% of triad)\n",
                   backend, model, n_prompt / best_prefill, n_decode / best_decode, desc.weight_bytes / 1e6,
                   100 * desc.weight_bytes * (n_decode / best_decode) / (triad * 1e9));
    }
    fflush(stdout);
    duet_model_close(m);
}

/* ---- floors ---------------------------------------------------------------------------- */

static double find_number(cJSON *arr, const char *k1, const char *v1, const char *k2, const char *v2,
                          const char *field) {
    cJSON *it;
    double best = -1;
    cJSON_ArrayForEach(it, arr) {
        cJSON *a = cJSON_GetObjectItem(it, k1), *b = cJSON_GetObjectItem(it, k2), *f = cJSON_GetObjectItem(it, field);
        if (a && b && f && cJSON_IsString(a) && cJSON_IsString(b) && !strcmp(a->valuestring, v1) &&
            strstr(b->valuestring, v2) && f->valuedouble > best)
            best = f->valuedouble;
    }
    return best;
}

int main(int argc, char **argv) {
    opts o = {.backends = NULL, .filter = NULL, .models = "125m-q8_0,1b-q8_0", .out = NULL, .reps = 10,
              .threads = 2, .decode_tokens = 64, .ops = true, .e2e = true};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--backends") && v) o.backends = v, i++;
        else if (!strcmp(a, "--filter") && v) o.filter = v, i++;
        else if (!strcmp(a, "--models") && v) o.models = v, i++;
        else if (!strcmp(a, "--out") && v) o.out = v, i++;
        else if (!strcmp(a, "--reps") && v) o.reps = atoi(v), i++;
        else if (!strcmp(a, "--threads") && v) o.threads = atoi(v), i++;
        else if (!strcmp(a, "--decode-tokens") && v) o.decode_tokens = atoi(v), i++;
        else if (!strcmp(a, "--no-ops")) o.ops = false;
        else if (!strcmp(a, "--no-e2e")) o.e2e = false;
        else if (!strcmp(a, "--sweep")) o.sweep = true;
        else if (!strcmp(a, "--json")) o.json = true;
        else {
            fprintf(stderr,
                    "usage: bench_backend_ops [--backends opencl,cpu] [--filter STR] [--reps N] [--threads N]\n"
                    "         [--models 125m-q8_0,1b-q8_0] [--decode-tokens N] [--no-ops] [--no-e2e] [--sweep]\n"
                    "         [--json] [--out FILE]\n");
            return 2;
        }
    }
    if (o.reps < 1) o.reps = 1;
    if (o.threads < 1) o.threads = 1;
    const double triad = bench_triad_gbs(o.threads, 5);
    cJSON *root = cJSON_CreateObject();
    char cmd[512] = "";
    for (int i = 0; i < argc; i++) {
        size_t len = strlen(cmd);
        snprintf(cmd + len, sizeof cmd - len, "%s%s", i ? " " : "", argv[i]);
    }
    cJSON_AddStringToObject(root, "command", cmd);
    /* The machine may be shared: its load says how much to trust the times. */
    double load = -1;
    FILE *lf = fopen("/proc/loadavg", "r");
    if (lf) {
        if (fscanf(lf, "%lf", &load) != 1) load = -1;
        fclose(lf);
    }
    cJSON_AddNumberToObject(root, "load_average_1min", load);
    cJSON_AddNumberToObject(root, "threads", o.threads);
    cJSON_AddNumberToObject(root, "triad_gbs", triad);
    cJSON *devices = cJSON_AddArrayToObject(root, "devices");
    cJSON *e2e = cJSON_AddArrayToObject(root, "end_to_end");
    if (!o.json) printf("machine triad (%d threads): %.1f GB/s\n", o.threads, triad);

    for (int b = 0; b < duet_backend_count(); b++) {
        const duet_backend_iface *iface = duet_backend_get(b);
        if (!in_list(o.backends, iface->name)) continue;
        char why[256] = "";
        if (!iface->available(why, sizeof why)) {
            if (!o.json) printf("\nSKIP %s: %s\n", iface->name, why);
            continue;
        }
        for (int d = 0; d < iface->device_count(); d++) bench_device(iface, d, &o, triad, devices);
    }
    if (o.e2e) {
        if (!o.json) printf("\nend to end (%d threads for cpu):\n", o.threads);
        for (int b = 0; b < duet_backend_count(); b++) {
            const duet_backend_iface *iface = duet_backend_get(b);
            char why[256];
            if (!in_list(o.backends, iface->name) || !iface->available(why, sizeof why)) continue;
            char list[256];
            snprintf(list, sizeof list, "%s", o.models);
            char *save = NULL;
            for (char *m = strtok_r(list, ",", &save); m; m = strtok_r(NULL, ",", &save)) bench_e2e(iface->name, m, &o, triad, e2e);
        }
    }

    /* The OpenCL floors on CPU devices (PoCL). */
    cJSON *floors = cJSON_AddObjectToObject(root, "floors");
    cJSON *dev;
    cJSON_ArrayForEach(dev, devices) {
        if (strcmp(cJSON_GetObjectItem(dev, "backend")->valuestring, "opencl") != 0) continue;
        double mv = find_number(cJSON_GetObjectItem(dev, "ops"), "dtype", "q8_0", "case", "1x", "frac_peak_bw");
        if (mv < 0) continue;
        cJSON_AddNumberToObject(floors, "opencl_q8_0_matvec_frac_triad", mv);
        if (!o.json) printf("\nfloor: opencl q8_0 matrix-vector %.1f%% of peak (>= 25%%): %s\n", 100 * mv, mv >= 0.25 ? "ok" : "BELOW");
    }
    double dec = find_number(e2e, "backend", "opencl", "model", "125m-q8_0", "decode_tokens_per_s");
    if (dec >= 0) {
        cJSON_AddNumberToObject(floors, "opencl_125m_q8_0_decode_tokens_per_s", dec);
        if (!o.json) printf("floor: opencl 125m q8_0 decode %.1f tokens/s (>= 40): %s\n", dec, dec >= 40 ? "ok" : "BELOW");
    }

    char *s = cJSON_Print(root);
    if (o.json) puts(s);
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
    return 0;
}
