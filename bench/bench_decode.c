/* bench_decode.c — end-to-end decode and prefill tokens/s per backend, at
 * several context lengths, with the fraction of the machine's triad
 * bandwidth that decode reaches ((weight + KV bytes per token) x tokens/s /
 * triad GB/s). The one place for end-to-end figures and their floors (op
 * timings are bench_backend_ops's).
 *
 * usage: bench_decode [--backend cpu|vulkan|opencl] [--device N] [--threads N] [--tokens N]
 *                     [--ctx 128,1024,4096] [--kv f16|q8_0|f32] [--json]
 *                     [--shared DIR] [--models stories260K,125m-q8_0,125m-f16,1b-q8_0,1b-f16,LABEL=FILE]
 *                     [--repeat N] [--verbose] [--strict]
 * Models: stories260K (from ../shared), and synthetic ones made once by
 * duet_mkmodel_cached (~/.cache/duet/models). At context C the cache first holds C prompt
 * tokens (a real prefill), then --tokens tokens are decoded one per step.
 * LABEL=FILE benches a GGUF file under that label (e.g. a file made by
 * `duet quantize`: 1b-q4_0=/tmp/1b-q4_0.gguf names it for the floors).
 * --repeat N runs every model N rounds, one after another, and reports
 * medians: of each figure, and of the per-round ratios (against the first
 * context, and against the first model at the same context). On a shared
 * or throttling machine a ratio taken within one round is far steadier than
 * one between figures measured minutes apart. --verbose prints each round.
 *
 * Floors, printed when the run has their figures (medians of per-round
 * values; --strict: exit 1 when one is missed):
 *   - 1b q8_0 decode >= 1.4x 1b f16 decode (--models 1b-q8_0,1b-f16; issue 6)
 *   - 1b q4_0 decode >= 1.5x 1b q8_0 decode (--models 1b-q4_0=FILE,1b-q8_0=FILE,
 *     files where every matrix is that type; issue 16)
 *   - 125m q8_0 decode at the longest context >= 60% of at 128
 *     (--models 125m-q8_0 --ctx 128,4096, with --kv f16 and --kv q8_0; issue 5)
 *   - 125m q8_0 decode at the first context: >= 40 tokens/s on OpenCL
 *     (PoCL, 2 cores), >= 10 on Vulkan (CPU devices: lavapipe)
 * e.g. bench_decode --backend vulkan --models 1b-q8_0,1b-f16 --ctx 128 --tokens 16 --repeat 10
 */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "bench_util.h"
#include "duet.h"

#define MAX_CTXS 8
#define MAX_MODELS 8
#define MAX_ROUNDS 15

typedef struct result {
    char name[64];
    double weight_mb, kv_mb_per_ktok; /* weights; KV bytes per 1000 cached tokens */
    double prefill_tps;
    int n_ctx;
    int ctx[MAX_CTXS];
    double decode_tps[MAX_CTXS], frac_bw[MAX_CTXS];
    /* CPU time (all threads) per decoded token: on a shared machine, where
     * wall time swings with the load, a steadier view of the work done */
    double cpu_ms[MAX_CTXS];
    /* medians of per-round ratios: against this model's first context, and
     * against the first model at the same context */
    double vs_first_ctx[MAX_CTXS], vs_first_model[MAX_CTXS];
    double round_tps[MAX_CTXS][MAX_ROUNDS];
} result;

typedef struct opts {
    const char *backend, *kv;
    int device, threads, n_tokens, n_ctx;
    int ctx[MAX_CTXS];
    double triad;
} opts;

/* User and system CPU seconds of the process so far (every thread). */
static double bench_cpu_seconds(void) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
           (ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) * 1e-6;
}

static double kv_bytes_per_token(const duet_model_desc *d, const char *kv) {
    double es = !kv || !strcmp(kv, "f16") ? 2 : !strcmp(kv, "q8_0") ? 34.0 / 32 : 4;
    return 2.0 * d->n_layer * d->n_head_kv * (double)(d->n_embd / d->n_head) * es;
}

static int bench_model(const char *name, const char *path, const opts *o, result *r) {
    int max_ctx = 128;
    for (int i = 0; i < o->n_ctx; i++)
        max_ctx = o->ctx[i] > max_ctx ? o->ctx[i] : max_ctx;
    duet_open_params op = duet_open_params_default();
    op.backend = o->backend;
    op.device = o->device;
    op.n_threads = o->threads;
    op.n_ctx = max_ctx + o->n_tokens;
    op.kv_type = o->kv;
    duet_model *m;
    if (duet_model_open(path, &op, &m)) {
        fprintf(stderr, "bench_decode: %s: %s\n", path, duet_last_error());
        return 1;
    }
    duet_model_desc d;
    duet_model_describe(m, &d);
    int32_t *prompt = malloc(sizeof(int32_t) * (size_t)(max_ctx + o->n_tokens));
    for (int i = 0; i < max_ctx + o->n_tokens; i++)
        prompt[i] = 3 + (int32_t)(((uint32_t)i * 7919u) % (uint32_t)(d.n_vocab - 3));
    memset(r, 0, sizeof *r);
    snprintf(r->name, sizeof r->name, "%s", name);
    r->weight_mb = d.weight_bytes / 1e6;
    const double kv_tok = kv_bytes_per_token(&d, o->kv);
    r->kv_mb_per_ktok = kv_tok * 1000 / 1e6;
    /* Prefill: 128 tokens in one call (best of 3). */
    double best_prefill = 1e30;
    duet_status st = DUET_OK;
    for (int rep = 0; rep < 3 && st == DUET_OK; rep++) {
        double t0 = bench_now();
        st = duet_eval(m, prompt, 128, 0, NULL);
        double dt = bench_now() - t0;
        if (dt < best_prefill) best_prefill = dt;
    }
    r->prefill_tps = 128 / best_prefill;
    if (st != DUET_OK) fprintf(stderr, "bench_decode: %s: prefill: %s\n", name, duet_last_error());
    /* Decode at each context: fill the cache to C, then time n_tokens steps
     * (best of 2; the fill is not timed). */
    for (int c = 0; c < o->n_ctx; c++) {
        const int C = o->ctx[c];
        if ((st = duet_eval(m, prompt, C, 0, NULL)) != DUET_OK) {
            fprintf(stderr, "bench_decode: %s: prefill of %d: %s\n", name, C, duet_last_error());
            break;
        }
        double best = 1e30, cpu0 = bench_cpu_seconds();
        for (int rep = 0; rep < 2 && st == DUET_OK; rep++) {
            double t0 = bench_now();
            for (int i = 0; i < o->n_tokens && st == DUET_OK; i++)
                st = duet_eval(m, &prompt[C + i], 1, C + i, NULL);
            double dt = bench_now() - t0;
            if (dt < best) best = dt;
        }
        r->cpu_ms[r->n_ctx] = (bench_cpu_seconds() - cpu0) * 1e3 / (2.0 * o->n_tokens);
        if (st != DUET_OK) {
            fprintf(stderr, "bench_decode: %s: decode at %d: %s\n", name, C, duet_last_error());
            break;
        }
        r->ctx[r->n_ctx] = C;
        r->decode_tps[r->n_ctx] = o->n_tokens / best;
        /* bytes per token: weights + the KV rows attention reads */
        double bytes = d.weight_bytes + kv_tok * (C + o->n_tokens / 2.0);
        r->frac_bw[r->n_ctx] = bytes * r->decode_tps[r->n_ctx] / (o->triad * 1e9);
        r->n_ctx++;
    }
    free(prompt);
    duet_model_close(m);
    return st == DUET_OK ? 0 : 1;
}

static const char *synthetic(const char *shape, const char *type) {
    static char path[4096];
    duet_mkmodel_params p = {.shape = shape, .type = type, .seed = 1};
    if (duet_mkmodel_cached(&p, path, sizeof path, NULL)) {
        fprintf(stderr, "bench_decode: mkmodel: %s\n", duet_last_error());
        return NULL;
    }
    return path;
}

/* res[i] = the medians of rounds[r][i] over the rounds. */
static void combine(result rounds[][MAX_MODELS], int n_rounds, int n_models, result *res) {
    for (int i = 0; i < n_models; i++) {
        result *m = &res[i];
        *m = rounds[0][i];
        double v[MAX_ROUNDS];
        for (int r = 0; r < n_rounds; r++)
            v[r] = rounds[r][i].prefill_tps;
        m->prefill_tps = bench_median(v, n_rounds);
        for (int c = 0; c < m->n_ctx; c++) {
            for (int r = 0; r < n_rounds; r++)
                m->round_tps[c][r] = v[r] = rounds[r][i].decode_tps[c];
            m->decode_tps[c] = bench_median(v, n_rounds);
            for (int r = 0; r < n_rounds; r++)
                v[r] = rounds[r][i].frac_bw[c];
            m->frac_bw[c] = bench_median(v, n_rounds);
            for (int r = 0; r < n_rounds; r++)
                v[r] = rounds[r][i].cpu_ms[c];
            m->cpu_ms[c] = bench_median(v, n_rounds);
            for (int r = 0; r < n_rounds; r++)
                v[r] = rounds[r][i].decode_tps[c] / rounds[r][i].decode_tps[0];
            m->vs_first_ctx[c] = bench_median(v, n_rounds);
            bool same = c < rounds[0][0].n_ctx;
            for (int r = 0; r < n_rounds && same; r++)
                v[r] = rounds[r][i].decode_tps[c] / rounds[r][0].decode_tps[c];
            m->vs_first_model[c] = same ? bench_median(v, n_rounds) : 0;
        }
    }
}

/* ---- floors ---------------------------------------------------------------------------- */

static int model_index(char names[][64], int n, const char *name) {
    for (int i = 0; i < n; i++)
        if (!strcmp(names[i], name)) return i;
    return -1;
}

static int ctx_index(const result *r, int ctx) {
    for (int c = 0; c < r->n_ctx; c++)
        if (r->ctx[c] == ctx) return c;
    return -1;
}

static bool floor_row(cJSON *out, bool json, const char *name, double value, double min, const char *unit) {
    const bool ok = value >= min;
    cJSON *e = cJSON_CreateObject();
    cJSON_AddStringToObject(e, "name", name);
    cJSON_AddNumberToObject(e, "value", value);
    cJSON_AddNumberToObject(e, "min", min);
    cJSON_AddBoolToObject(e, "ok", ok);
    cJSON_AddItemToArray(out, e);
    if (!json)
        printf("floor: %s %.2f%s (>= %.2f%s): %s\n", name, value, unit, min, unit, ok ? "ok" : "BELOW");
    return ok;
}

/* Decode of model `a` over model `b` at the first context, median of the
 * per-round ratios, against `min` (no row when the run lacks either). */
static bool ratio_floor(result rounds[][MAX_MODELS], int n_rounds, char names[][64], int n, const opts *o,
                        const char *a, const char *b, const char *what, double min, bool json, cJSON *out) {
    const int i = model_index(names, n, a), j = model_index(names, n, b);
    if (i < 0 || j < 0 || rounds[0][i].n_ctx == 0 || rounds[0][j].n_ctx == 0) return true;
    double v[MAX_ROUNDS];
    for (int r = 0; r < n_rounds; r++)
        v[r] = rounds[r][i].decode_tps[0] / rounds[r][j].decode_tps[0];
    char name[160];
    snprintf(name, sizeof name, "%s %s at context %d", o->backend, what, rounds[0][i].ctx[0]);
    return floor_row(out, json, name, bench_median(v, n_rounds), min, "x");
}

/* The floors this run has figures for, from per-round values (medians);
 * false when one is missed. */
static bool floors(result rounds[][MAX_MODELS], int n_rounds, char names[][64], int n, const opts *o,
                   bool json, cJSON *out) {
    bool ok = true;
    double v[MAX_ROUNDS];
    char name[160];
    /* Weight types against each other, at the first context, round by round. */
    ok = ratio_floor(rounds, n_rounds, names, n, o, "1b-q8_0", "1b-f16", "1b q8_0 decode / 1b f16 decode",
                     1.4, json, out) &&
         ok;
    ok = ratio_floor(rounds, n_rounds, names, n, o, "1b-q4_0", "1b-q8_0", "1b q4_0 decode / 1b q8_0 decode",
                     1.5, json, out) &&
         ok;
    const int m = model_index(names, n, "125m-q8_0");
    if (m >= 0 && rounds[0][m].n_ctx > 0) {
        const result *r0 = &rounds[0][m];
        /* Decode at the longest context against at 128. */
        int lo = ctx_index(r0, 128), hi = 0;
        for (int c = 1; c < r0->n_ctx; c++)
            if (r0->ctx[c] > r0->ctx[hi]) hi = c;
        if (lo >= 0 && r0->ctx[hi] > 128) {
            for (int r = 0; r < n_rounds; r++)
                v[r] = rounds[r][m].decode_tps[hi] / rounds[r][m].decode_tps[lo];
            snprintf(name, sizeof name, "%s 125m q8_0 decode at context %d / at 128 (kv %s)", o->backend,
                     r0->ctx[hi], o->kv ? o->kv : "default");
            ok = floor_row(out, json, name, bench_median(v, n_rounds), 0.6, "x") && ok;
        }
        /* Tokens/s on the backends that have a floor for it. */
        const double min = !strcmp(o->backend, "opencl") ? 40 : !strcmp(o->backend, "vulkan") ? 10 : -1;
        if (min > 0) {
            for (int r = 0; r < n_rounds; r++)
                v[r] = rounds[r][m].decode_tps[0];
            snprintf(name, sizeof name, "%s 125m q8_0 decode tokens/s at context %d", o->backend, r0->ctx[0]);
            ok = floor_row(out, json, name, bench_median(v, n_rounds), min, "") && ok;
        }
    }
    return ok;
}

static int parse_ints(const char *s, int *out, int max) {
    int n = 0;
    char buf[256];
    snprintf(buf, sizeof buf, "%s", s);
    for (char *t = strtok(buf, ","); t && n < max; t = strtok(NULL, ","))
        out[n++] = atoi(t);
    return n;
}

int main(int argc, char **argv) {
    opts o = {.backend = "cpu", .kv = NULL, .threads = 2, .n_tokens = 64, .n_ctx = 1, .ctx = {8}};
    bool json = false, verbose = false, strict = false;
    int n_rounds = 1;
    const char *shared = "../shared", *models = "stories260K,125m-q8_0";
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--threads") && i + 1 < argc)
            o.threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--tokens") && i + 1 < argc)
            o.n_tokens = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--backend") && i + 1 < argc)
            o.backend = argv[++i];
        else if (!strcmp(argv[i], "--kv") && i + 1 < argc)
            o.kv = argv[++i];
        else if (!strcmp(argv[i], "--ctx") && i + 1 < argc)
            o.n_ctx = parse_ints(argv[++i], o.ctx, MAX_CTXS);
        else if (!strcmp(argv[i], "--shared") && i + 1 < argc)
            shared = argv[++i];
        else if (!strcmp(argv[i], "--models") && i + 1 < argc)
            models = argv[++i];
        else if (!strcmp(argv[i], "--json"))
            json = true;
        else if (!strcmp(argv[i], "--repeat") && i + 1 < argc)
            n_rounds = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--device") && i + 1 < argc)
            o.device = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--verbose"))
            verbose = true;
        else if (!strcmp(argv[i], "--strict"))
            strict = true;
        else {
            fprintf(stderr,
                    "usage: bench_decode [--backend NAME] [--device N] [--threads N] [--tokens N] [--ctx "
                    "128,1024,4096] "
                    "[--kv f16|q8_0|f32] [--json] [--shared DIR] "
                    "[--models stories260K,125m-q8_0,125m-f16,1b-q8_0,1b-f16] [--repeat N] [--verbose] "
                    "[--strict]\n");
            return 2;
        }
    }
    if (o.n_tokens < 1 || o.n_ctx < 1 || n_rounds < 1 || n_rounds > MAX_ROUNDS) {
        fprintf(stderr, "bench_decode: --tokens and --ctx need at least 1, --repeat 1..%d\n", MAX_ROUNDS);
        return 2;
    }
    o.triad = bench_triad_gbs(o.threads, 5);
    /* The models' names and files, made once. */
    char names[MAX_MODELS][64], paths[MAX_MODELS][4096];
    int n = 0;
    char list[4096];
    snprintf(list, sizeof list, "%s", models);
    char *save = NULL;
    for (char *tok = strtok_r(list, ",", &save); tok && n < MAX_MODELS; tok = strtok_r(NULL, ",", &save)) {
        char *eq = strchr(tok, '=');
        if (eq) { /* LABEL=FILE */
            *eq = '\0';
            snprintf(paths[n], sizeof paths[n], "%s", eq + 1);
        } else if (!strcmp(tok, "stories260K")) {
            snprintf(paths[n], sizeof paths[n], "%s/models/stories260K.gguf", shared);
        } else {
            char shape[16], type[16];
            if (sscanf(tok, "%15[^-]-%15s", shape, type) != 2) continue;
            const char *p = synthetic(shape, type);
            if (!p) return 1;
            snprintf(paths[n], sizeof paths[n], "%s", p);
        }
        snprintf(names[n], sizeof names[n], "%s", tok);
        n++;
    }
    static result rounds[MAX_ROUNDS][MAX_MODELS];
    for (int r = 0; r < n_rounds; r++)
        for (int i = 0; i < n; i++) {
            if (bench_model(names[i], paths[i], &o, &rounds[r][i]) != 0) return 1;
            for (int c = 0; verbose && c < rounds[r][i].n_ctx; c++)
                fprintf(json ? stderr : stdout, "  round %d: %s context %d: decode %.2f tok/s\n", r, names[i],
                        rounds[r][i].ctx[c], rounds[r][i].decode_tps[c]);
        }
    result res[MAX_MODELS];
    combine(rounds, n_rounds, n, res);
    cJSON *fl = cJSON_CreateArray();
    bool floors_ok = true;
    if (json) {
        cJSON *root = cJSON_CreateObject();
        cJSON_AddStringToObject(root, "backend", o.backend);
        cJSON_AddStringToObject(root, "kv", o.kv ? o.kv : "default");
        cJSON_AddNumberToObject(root, "threads", o.threads);
        cJSON_AddNumberToObject(root, "triad_gbs", o.triad);
        cJSON_AddNumberToObject(root, "rounds", n_rounds);
        cJSON *a = cJSON_AddArrayToObject(root, "models");
        for (int i = 0; i < n; i++) {
            cJSON *e = cJSON_CreateObject();
            cJSON_AddStringToObject(e, "model", res[i].name);
            cJSON_AddNumberToObject(e, "weight_mb_per_token", res[i].weight_mb);
            cJSON_AddNumberToObject(e, "kv_mb_per_1000_tokens", res[i].kv_mb_per_ktok);
            cJSON_AddNumberToObject(e, "prefill_tokens_per_s", res[i].prefill_tps);
            cJSON *dc = cJSON_AddArrayToObject(e, "decode");
            for (int c = 0; c < res[i].n_ctx; c++) {
                cJSON *x = cJSON_CreateObject();
                cJSON_AddNumberToObject(x, "context", res[i].ctx[c]);
                cJSON_AddNumberToObject(x, "tokens_per_s", res[i].decode_tps[c]);
                cJSON_AddNumberToObject(x, "fraction_of_triad", res[i].frac_bw[c]);
                cJSON_AddNumberToObject(x, "cpu_ms_per_token", res[i].cpu_ms[c]);
                cJSON_AddNumberToObject(x, "relative_to_first_context", res[i].vs_first_ctx[c]);
                if (i > 0 && res[i].vs_first_model[c] > 0)
                    cJSON_AddNumberToObject(x, "relative_to_first_model", res[i].vs_first_model[c]);
                if (n_rounds > 1)
                    cJSON_AddItemToObject(x, "round_tokens_per_s",
                                          cJSON_CreateDoubleArray(res[i].round_tps[c], n_rounds));
                cJSON_AddItemToArray(dc, x);
            }
            cJSON_AddItemToArray(a, e);
        }
        floors_ok = floors(rounds, n_rounds, names, n, &o, true, fl);
        cJSON_AddItemToObject(root, "floors", fl);
        char *s = cJSON_Print(root);
        puts(s);
        cJSON_free(s);
        cJSON_Delete(root);
    } else {
        printf("backend %s, kv %s, triad bandwidth (%d threads): %.1f GB/s%s\n", o.backend,
               o.kv ? o.kv : "default", o.threads, o.triad, n_rounds > 1 ? "; medians over rounds" : "");
        printf("%-14s %10s %14s %8s %14s %10s %9s %9s\n", "model", "MB/token", "prefill tok/s", "context",
               "decode tok/s", "% triad", "/1st ctx", "/1st model");
        for (int i = 0; i < n; i++)
            for (int c = 0; c < res[i].n_ctx; c++)
                printf("%-14s %10.1f %14.1f %8d %14.1f %9.1f%% %9.2f %9.2f\n", res[i].name, res[i].weight_mb,
                       res[i].prefill_tps, res[i].ctx[c], res[i].decode_tps[c], 100 * res[i].frac_bw[c],
                       res[i].vs_first_ctx[c], res[i].vs_first_model[c]);
        floors_ok = floors(rounds, n_rounds, names, n, &o, false, fl);
        cJSON_Delete(fl);
    }
    return strict && !floors_ok ? 1 : 0;
}
