/* bench_vulkan.c — the Vulkan backend's floors, its matmul paths and its
 * attention.
 *
 * bench_backend_ops times every op of every backend side by side; this one
 * answers the Vulkan questions of the paged-attention and INT8 issues on
 * the device at hand:
 *   - Q8_0 matrix-vector GB/s on each path the tuning table can pick (tile
 *     or subgroup; int8 dot products or the packed-integer fallback), from
 *     f32 activations (quantised first) and from q8_0 activations (x_q8, as
 *     the forward pass feeds it), next to F16, against the machine's triad
 *     (CPU devices) or the device's bandwidth (a large ADD);
 *   - attention decode GB/s of the 125m shape (12 heads of 64) at contexts
 *     128, 1024 and 4096, f16 and q8_0 KV;
 *   - end to end decode tokens/s: 125m q8_0 at context 128 and at 4096
 *     (f16 and q8_0 KV), 1b q8_0 against 1b f16.
 * Floors checked (exit 1 when one is missed): 1b q8_0 decode >= 1.4x 1b
 * f16 decode; 125m q8_0 decode at 4096 >= 60% of at 128; Q8_0
 * matrix-vector >= 10% of triad on CPU devices (80% of bandwidth on GPUs);
 * 125m q8_0 decode >= 10 tokens/s on CPU devices.
 *
 * usage: bench_vulkan [--device N] [--decode-tokens N] [--ctx N] [--no-e2e]
 *                     [--only-1b] [--rounds N] [--verbose] [--out FILE]
 * --only-1b: just the 1b q8_0 against f16 decode (the INT8 floor);
 * --rounds: interleaved decode rounds (default 3); --verbose: each one.
 * Timings take the best of interleaved rounds (ops, and decode at each
 * context and of each model), so machines shared with other work still
 * compare fairly. DUET_PROFILE=1 prints per-op device time of each run as
 * its instance closes. */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <string.h>

#include "../tests/backend_ops_cases.h"
#include "bench_util.h"
#include "duet.h"

/* ---- op timing ---------------------------------------------------------------------- */

/* One case on one backend instance, set up once and run in rounds. */
typedef struct timed {
    const bo_case *c;
    duet_backend *be;
    bo_host h;
    bo_dev d;
    bool ok;
    double best; /* seconds per op */
} timed;

static bool timed_setup(timed *t, duet_backend *be, const bo_case *c) {
    *t = (timed){.c = c, .be = be, .best = 1e30};
    bo_host_build_case(c, 7, &t->h); /* any seed: random operands */
    t->ok = bo_dev_setup(be, &t->h, &t->d) == DUET_OK && bo_dev_run(&t->d, 1) == DUET_OK;
    if (!t->ok) {
        fprintf(stderr, "bench_vulkan: %s\n", duet_last_error());
        bo_host_free(&t->h);
    }
    return t->ok;
}

/* Best time per op over `rounds` rounds of every item in turn. */
static void timed_rounds(timed *items, int n, int rounds, int reps) {
    for (int r = 0; r < rounds; r++)
        for (int i = 0; i < n; i++) {
            if (!items[i].ok) continue;
            double t0 = bench_now();
            if (bo_dev_run(&items[i].d, reps) != DUET_OK) {
                items[i].ok = false;
                continue;
            }
            double dt = (bench_now() - t0) / reps;
            if (dt < items[i].best) items[i].best = dt;
        }
}

static void timed_free(timed *t) {
    if (!t->ok) return;
    bo_dev_free(&t->d);
    bo_host_free(&t->h);
}

static double timed_gbs(const timed *t) {
    double bytes, flops;
    bo_case_cost(t->c, &bytes, &flops);
    return t->ok ? bytes / t->best / 1e9 : 0;
}

static duet_backend *open_tuned(int device, const char *tune) {
    if (tune)
        setenv("DUET_VK_TUNE", tune, 1);
    else
        unsetenv("DUET_VK_TUNE");
    duet_backend *be = NULL;
    duet_status st = duet_backend_open("vulkan", device, NULL, &be);
    unsetenv("DUET_VK_TUNE");
    return st == DUET_OK ? be : NULL;
}

/* A device's own bandwidth for GPUs: a large ADD (read 2, write 1). */
static double device_gbs(int device) {
    static const bo_case add = {"big", DUET_OP_ADD, DUET_DTYPE_F32, 1024,  16384, 0,       0, 0, 0,  0,
                                0,     false,       false,          false, false, BO_PERF, 0, 0, {0}};
    duet_backend *be = open_tuned(device, NULL);
    if (!be) return 0;
    timed t;
    double gbs = 0;
    if (timed_setup(&t, be, &add)) {
        timed_rounds(&t, 1, 5, 10);
        gbs = timed_gbs(&t);
        timed_free(&t);
    }
    duet_backend_close(be);
    return gbs;
}

/* ---- matrix-vector ------------------------------------------------------------------------ */

/* The decode GEMVs: 125m's up projection and 1b's. */
#define MV_SHAPES 2
static const bo_case mv_cases[MV_SHAPES][3] = {
    {
        {"125m-up",
         DUET_OP_MATMUL,
         DUET_DTYPE_F16,
         1,
         768,
         2048,
         0,
         0,
         0,
         0,
         0,
         false,
         false,
         false,
         false,
         BO_PERF,
         0,
         0,
         {0}},
        {"125m-up",
         DUET_OP_MATMUL,
         DUET_DTYPE_Q8_0,
         1,
         768,
         2048,
         0,
         0,
         0,
         0,
         0,
         false,
         false,
         false,
         false,
         BO_PERF,
         0,
         0,
         {0}},
        {"125m-up",
         DUET_OP_MATMUL,
         DUET_DTYPE_Q8_0,
         1,
         768,
         2048,
         0,
         0,
         0,
         0,
         0,
         false,
         false,
         false,
         false,
         BO_PERF,
         1,
         0,
         {0}},
    },
    {
        {"1b-up",
         DUET_OP_MATMUL,
         DUET_DTYPE_F16,
         1,
         2048,
         5632,
         0,
         0,
         0,
         0,
         0,
         false,
         false,
         false,
         false,
         BO_PERF,
         0,
         0,
         {0}},
        {"1b-up",
         DUET_OP_MATMUL,
         DUET_DTYPE_Q8_0,
         1,
         2048,
         5632,
         0,
         0,
         0,
         0,
         0,
         false,
         false,
         false,
         false,
         BO_PERF,
         0,
         0,
         {0}},
        {"1b-up",
         DUET_OP_MATMUL,
         DUET_DTYPE_Q8_0,
         1,
         2048,
         5632,
         0,
         0,
         0,
         0,
         0,
         false,
         false,
         false,
         false,
         BO_PERF,
         1,
         0,
         {0}},
    },
};
static const char *const mv_kind[3] = {"f16", "q8_0 (f32 x)", "q8_0 (x_q8)"};

typedef struct path {
    const char *name, *tune; /* DUET_VK_TUNE for it; NULL: the table's choice */
} path;
static const path paths[] = {
    {"table", NULL},
    {"tile fallback", "matmul=tile,dot=0"},
    {"tile int-dot", "matmul=tile,dot=1"},
    {"subgroup fallback", "matmul=subgroup,dot=0"},
    {"subgroup int-dot", "matmul=subgroup,dot=1"},
};
#define N_PATHS ((int)(sizeof paths / sizeof paths[0]))

/* Returns the table path's Q8_0 (x_q8) GB/s on the 1b shape. */
static double bench_matvec(int device, double peak, bool cpu_device, cJSON *out) {
    duet_backend *be[N_PATHS] = {0};
    timed items[N_PATHS][MV_SHAPES][3];
    memset(items, 0, sizeof items);
    for (int p = 0; p < N_PATHS; p++) {
        be[p] = open_tuned(device, paths[p].tune);
        if (!be[p]) {
            printf("  %-18s (not on this device: %s)\n", paths[p].name, duet_last_error());
            continue;
        }
        if (p == 0) printf("  the table picks: %s\n", strstr(be[p]->info.features, "tuning="));
        for (int s = 0; s < MV_SHAPES; s++)
            for (int k = 0; k < 3; k++)
                if (p == 0 || k > 0) timed_setup(&items[p][s][k], be[p], &mv_cases[s][k]);
    }
    timed_rounds(&items[0][0][0], N_PATHS * MV_SHAPES * 3, 5, 5);
    double frac = -1;
    for (int s = 0; s < MV_SHAPES; s++) {
        const timed *f16 = &items[0][s][0];
        for (int p = 0; p < N_PATHS; p++)
            for (int k = 0; k < 3; k++) {
                const timed *t = &items[p][s][k];
                if (!t->ok) continue;
                char label[160];
                bo_case_label(t->c, label, sizeof label);
                double gbs = timed_gbs(t);
                /* Time per weight against F16's: the q8_0 speed-up. */
                double speedup = f16->ok ? f16->best / t->best : 0;
                printf("  %-18s %-13s %-34s %9.1f us %6.2f GB/s %5.1f%% of %s  x%.2f vs f16\n", paths[p].name,
                       mv_kind[k], label, t->best * 1e6, gbs, 100 * gbs / peak,
                       cpu_device ? "triad" : "device", speedup);
                cJSON *e = cJSON_CreateObject();
                cJSON_AddStringToObject(e, "path", paths[p].name);
                cJSON_AddStringToObject(e, "kind", mv_kind[k]);
                cJSON_AddStringToObject(e, "case", label);
                cJSON_AddNumberToObject(e, "us", t->best * 1e6);
                cJSON_AddNumberToObject(e, "gbs", gbs);
                cJSON_AddNumberToObject(e, "frac_peak", gbs / peak);
                cJSON_AddNumberToObject(e, "speedup_vs_f16", speedup);
                cJSON_AddItemToArray(out, e);
                if (p == 0 && k == 2 && s == MV_SHAPES - 1) frac = gbs / peak;
            }
    }
    for (int p = 0; p < N_PATHS; p++) {
        for (int s = 0; s < MV_SHAPES; s++)
            for (int k = 0; k < 3; k++)
                timed_free(&items[p][s][k]);
        if (be[p]) duet_backend_close(be[p]);
    }
    return frac;
}

/* ---- attention ---------------------------------------------------------------------------- */

#define ATT_CTX 3
static const int att_ctx[ATT_CTX] = {128, 1024, 4096};

static void bench_attention(int device, double peak, cJSON *out) {
    duet_backend *be = open_tuned(device, NULL);
    if (!be) {
        printf("  (cannot open: %s)\n", duet_last_error());
        return;
    }
    bo_case cases[2][ATT_CTX];
    timed items[2][ATT_CTX];
    for (int k = 0; k < 2; k++)
        for (int i = 0; i < ATT_CTX; i++) {
            cases[k][i] = (bo_case){"125m",
                                    DUET_OP_ATTENTION,
                                    k ? DUET_DTYPE_Q8_0 : DUET_DTYPE_F16,
                                    1,
                                    64,
                                    att_ctx[i],
                                    12,
                                    12,
                                    1,
                                    0,
                                    0,
                                    false,
                                    false,
                                    false,
                                    false,
                                    BO_PERF,
                                    0,
                                    16,
                                    {att_ctx[i]}};
            timed_setup(&items[k][i], be, &cases[k][i]);
        }
    timed_rounds(&items[0][0], 2 * ATT_CTX, 5, 5);
    for (int k = 0; k < 2; k++)
        for (int i = 0; i < ATT_CTX; i++) {
            const timed *t = &items[k][i];
            if (!t->ok) continue;
            double gbs = timed_gbs(t);
            printf("  kv %-5s context %5d   %9.1f us  %6.2f GB/s  %5.1f%% of peak  (%.1fx the time at %d)\n",
                   k ? "q8_0" : "f16", att_ctx[i], t->best * 1e6, gbs, 100 * gbs / peak,
                   items[k][0].ok ? t->best / items[k][0].best : 0, att_ctx[0]);
            cJSON *e = cJSON_CreateObject();
            cJSON_AddStringToObject(e, "kv", k ? "q8_0" : "f16");
            cJSON_AddNumberToObject(e, "context", att_ctx[i]);
            cJSON_AddNumberToObject(e, "us", t->best * 1e6);
            cJSON_AddNumberToObject(e, "gbs", gbs);
            cJSON_AddNumberToObject(e, "frac_peak", gbs / peak);
            cJSON_AddItemToArray(out, e);
        }
    for (int k = 0; k < 2; k++)
        for (int i = 0; i < ATT_CTX; i++)
            timed_free(&items[k][i]);
    printf("  scratch_bytes after these: %zu\n", duet_backend_scratch_bytes(be));
    duet_backend_close(be);
}

/* ---- end to end ---------------------------------------------------------------------------- */

static const char *synthetic(const char *shape, const char *type, int n_ctx) {
    static char path[4096];
    duet_mkmodel_params p = {.shape = shape, .type = type, .seed = 1, .n_ctx = n_ctx};
    if (duet_mkmodel_cached(&p, path, sizeof path, NULL) != DUET_OK) {
        fprintf(stderr, "bench_vulkan: mkmodel %s %s: %s\n", shape, type, duet_last_error());
        return NULL;
    }
    return path;
}

/* A model on the device with its context filled by prefill (chunks of 256
 * tokens) up to `fill`. */
typedef struct e2e_model {
    const char *shape, *type, *kv;
    duet_model *m;
    int32_t *tok;
    int n_vocab;
    uint64_t weight_bytes;
} e2e_model;

static bool e2e_open(e2e_model *e, int device, int n_ctx, int fill) {
    const char *path = synthetic(e->shape, e->type, n_ctx);
    if (!path) return false;
    duet_open_params op = duet_open_params_default();
    op.backend = "vulkan";
    op.device = device;
    op.n_ctx = n_ctx;
    op.kv_type = e->kv;
    if (duet_model_open(path, &op, &e->m) != DUET_OK) {
        printf("  %s-%s kv %s: %s\n", e->shape, e->type, e->kv, duet_last_error());
        e->m = NULL;
        return false;
    }
    duet_model_desc d;
    duet_model_describe(e->m, &d);
    e->n_vocab = d.n_vocab;
    e->weight_bytes = d.weight_bytes;
    e->tok = malloc(sizeof(int32_t) * (size_t)n_ctx);
    for (int i = 0; i < n_ctx; i++)
        e->tok[i] = 3 + (i * 7919) % (d.n_vocab - 3);
    duet_status st = DUET_OK;
    for (int p = 0; p < fill && st == DUET_OK; p += 256)
        st = duet_eval(e->m, e->tok + p, fill - p < 256 ? fill - p : 256, p, NULL);
    if (st != DUET_OK) printf("  %s-%s kv %s: %s\n", e->shape, e->type, e->kv, duet_last_error());
    return st == DUET_OK;
}

/* Seconds to decode n tokens one at a time, the last at position end - 1
 * (positions before are filled; attention reads 0..pos only). */
static double e2e_decode(e2e_model *e, int end, int n) {
    double t0 = bench_now();
    for (int i = end - n; i < end; i++)
        if (duet_eval(e->m, &e->tok[i], 1, i, NULL) != DUET_OK) {
            printf("  %s-%s kv %s: %s\n", e->shape, e->type, e->kv, duet_last_error());
            return -1;
        }
    return bench_now() - t0;
}

static void e2e_close(e2e_model *e) {
    if (e->m) duet_model_close(e->m);
    free(e->tok);
    e->m = NULL;
    e->tok = NULL;
}

/* Decode tokens/s of each (model, context) pair, measured in interleaved
 * rounds (the best of each) so that a machine shared with other work
 * changes both sides of a ratio alike. tps[i * n_ctxs + c]. */
static bool verbose; /* --verbose: every round's figure */

static void e2e_rounds(e2e_model *ms, int n_models, const int *ctxs, int n_ctxs, int n_decode, int rounds,
                       double *tps, double *each, cJSON *out) {
    for (int i = 0; i < n_models * n_ctxs; i++)
        tps[i] = 0;
    for (int r = 0; r < rounds; r++)
        for (int i = 0; i < n_models; i++)
            for (int c = 0; c < n_ctxs; c++) {
                if (!ms[i].m) continue;
                double s = e2e_decode(&ms[i], ctxs[c], n_decode);
                if (s > 0 && n_decode / s > tps[i * n_ctxs + c]) tps[i * n_ctxs + c] = n_decode / s;
                if (each) each[(size_t)r * n_models * n_ctxs + i * n_ctxs + c] = s > 0 ? n_decode / s : 0;
                if (verbose)
                    printf("    round %d: %s-%s kv %s context %d: %.2f tok/s\n", r, ms[i].shape, ms[i].type,
                           ms[i].kv, ctxs[c], s > 0 ? n_decode / s : 0);
            }
    for (int i = 0; i < n_models; i++)
        for (int c = 0; c < n_ctxs; c++) {
            if (!ms[i].m || tps[i * n_ctxs + c] <= 0) continue;
            printf("  %-5s %-5s kv %-5s context %5d: decode %7.2f tok/s  (%.0f MB of weights a token)\n",
                   ms[i].shape, ms[i].type, ms[i].kv, ctxs[c], tps[i * n_ctxs + c], ms[i].weight_bytes / 1e6);
            cJSON *e = cJSON_CreateObject();
            cJSON_AddStringToObject(e, "model", ms[i].shape);
            cJSON_AddStringToObject(e, "type", ms[i].type);
            cJSON_AddStringToObject(e, "kv", ms[i].kv);
            cJSON_AddNumberToObject(e, "context", ctxs[c]);
            cJSON_AddNumberToObject(e, "decode_tokens", n_decode);
            cJSON_AddNumberToObject(e, "decode_tokens_per_s", tps[i * n_ctxs + c]);
            cJSON_AddItemToArray(out, e);
        }
}

int main(int argc, char **argv) {
    int device = 0, n_decode = 16, ctx = 4096, rounds = 3;
    bool e2e = true, only_1b = false;
    const char *out_path = NULL;
    for (int i = 1; i < argc; i++) {
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(argv[i], "--device") && v)
            device = atoi(v), i++;
        else if (!strcmp(argv[i], "--decode-tokens") && v)
            n_decode = atoi(v), i++;
        else if (!strcmp(argv[i], "--ctx") && v)
            ctx = atoi(v), i++;
        else if (!strcmp(argv[i], "--no-e2e"))
            e2e = false;
        else if (!strcmp(argv[i], "--only-1b"))
            only_1b = true;
        else if (!strcmp(argv[i], "--verbose"))
            verbose = true;
        else if (!strcmp(argv[i], "--rounds") && v)
            rounds = atoi(v), i++;
        else if (!strcmp(argv[i], "--out") && v)
            out_path = v, i++;
        else {
            fprintf(stderr,
                    "usage: bench_vulkan [--device N] [--decode-tokens N] [--ctx N] [--no-e2e] [--only-1b] "
                    "[--rounds N] [--verbose] [--out FILE]\n");
            return 2;
        }
    }
    if (rounds < 1 || rounds > 100) rounds = 3;
    if (n_decode < 4) n_decode = 4;
    if (ctx < 256) ctx = 256;
    const duet_backend_iface *vk = duet_backend_find("vulkan");
    char why[256] = "";
    if (!vk || !vk->available(why, sizeof why)) {
        printf("vulkan: unavailable (%s)\n", vk ? why : "not compiled in");
        return 0;
    }
    duet_device_info info;
    if (vk->device_info(device, &info) != DUET_OK) {
        fprintf(stderr, "bench_vulkan: %s\n", duet_last_error());
        return 2;
    }
    const bool cpu_device = info.type == DUET_DEVICE_CPU;
    const double triad = bench_triad_gbs(2, 5);
    const double peak = cpu_device ? triad : device_gbs(device);
    printf("vulkan/%d: %s (%s)\n", device, info.name, info.driver);
    printf("machine triad (2 threads): %.1f GB/s; peak used: %.1f GB/s (%s)\n\n", triad, peak,
           cpu_device ? "triad: a CPU device" : "a large ADD on the device");

    cJSON *root = cJSON_CreateObject();
    cJSON_AddStringToObject(root, "device", info.name);
    cJSON_AddStringToObject(root, "driver", info.driver);
    cJSON_AddNumberToObject(root, "triad_gbs", triad);
    cJSON_AddNumberToObject(root, "peak_gbs", peak);

    double frac = -1;
    if (!only_1b) {
        printf("Q8_0 and F16 matrix-vector, by path (x..: time per op against the table's F16):\n");
        frac = bench_matvec(device, peak, cpu_device, cJSON_AddArrayToObject(root, "matvec"));
        printf("\nattention decode, 125m shape (12 heads of 64, one token):\n");
        bench_attention(device, peak, cJSON_AddArrayToObject(root, "attention_decode"));
    }

    bool ok = true;
    cJSON *floors = cJSON_AddObjectToObject(root, "floors");
    if (e2e) {
        printf("\nend to end (decode of %d tokens ending at each context):\n", n_decode);
        cJSON *e2 = cJSON_AddArrayToObject(root, "end_to_end");
        /* 125m q8_0, f16 and q8_0 KV: filled to the long context once,
         * then decoding ends at 128 and at ctx in turn. */
        const int ctxs[2] = {128, ctx}, short_ctx[1] = {128};
        e2e_model m125[2] = {{.shape = "125m", .type = "q8_0", .kv = "f16"},
                             {.shape = "125m", .type = "q8_0", .kv = "q8_0"}};
        double t125[4] = {0};
        if (!only_1b) {
            for (int i = 0; i < 2; i++)
                e2e_open(&m125[i], device, ctx + 64, ctx - n_decode);
            e2e_rounds(m125, 2, ctxs, 2, n_decode, rounds, t125, NULL, e2);
            for (int i = 0; i < 2; i++)
                e2e_close(&m125[i]);
        }
        const double f16kv[2] = {t125[0], t125[1]}, q8kv[2] = {t125[2], t125[3]};
        /* 1b q8_0 against 1b f16, in turn. */
        e2e_model m1b[2] = {{.shape = "1b", .type = "q8_0", .kv = "f16"},
                            {.shape = "1b", .type = "f16", .kv = "f16"}};
        double t1b[2], each[100 * 2], ratio[100];
        for (int i = 0; i < 2; i++)
            e2e_open(&m1b[i], device, 192, 128 - n_decode / 2);
        e2e_rounds(m1b, 2, short_ctx, 1, n_decode / 2, rounds, t1b, each, e2);
        for (int i = 0; i < 2; i++)
            e2e_close(&m1b[i]);
        const double b1q8[1] = {t1b[0]}, b1f16[1] = {t1b[1]};
        /* The median of the per-round ratios too: the best of each side
         * may come from different rounds. */
        int n_ratio = 0;
        for (int r = 0; r < rounds; r++)
            if (each[2 * r] > 0 && each[2 * r + 1] > 0) ratio[n_ratio++] = each[2 * r] / each[2 * r + 1];
        if (n_ratio > 0) {
            const double med = bench_median(ratio, n_ratio);
            cJSON_AddNumberToObject(floors, "1b_q8_0_vs_f16_round_ratio_median", med);
            printf("  1b q8_0 / f16, median of %d per-round ratios: %.2fx (range %.2f-%.2f)\n", n_ratio, med,
                   ratio[0], ratio[n_ratio - 1]);
        }
        printf("\n");
        if (b1q8[0] > 0 && b1f16[0] > 0) {
            const double r = b1q8[0] / b1f16[0];
            cJSON_AddNumberToObject(floors, "1b_q8_0_vs_f16_decode", r);
            printf("floor: 1b q8_0 decode %.2fx 1b f16 decode (>= 1.4x): %s\n", r, r >= 1.4 ? "ok" : "BELOW");
            ok = ok && r >= 1.4;
        }
        for (int k = 0; k < 2; k++) {
            const double *t = k ? q8kv : f16kv;
            if (t[0] <= 0 || t[1] <= 0) continue;
            const double r = t[1] / t[0];
            cJSON_AddNumberToObject(floors, k ? "125m_ctx_ratio_q8_0_kv" : "125m_ctx_ratio_f16_kv", r);
            printf("floor: 125m q8_0 decode at %d = %.0f%% of at 128, %s kv (>= 60%%): %s\n", ctx, 100 * r,
                   k ? "q8_0" : "f16", r >= 0.6 ? "ok" : "BELOW");
            ok = ok && r >= 0.6;
        }
        if (cpu_device && f16kv[0] > 0) {
            cJSON_AddNumberToObject(floors, "125m_q8_0_decode_tokens_per_s", f16kv[0]);
            printf("floor: 125m q8_0 decode %.1f tokens/s (>= 10): %s\n", f16kv[0],
                   f16kv[0] >= 10 ? "ok" : "BELOW");
            ok = ok && f16kv[0] >= 10;
        }
    }
    const double mv_floor = cpu_device ? 0.10 : 0.80;
    if (frac >= 0) {
        cJSON_AddNumberToObject(floors, "q8_0_matvec_frac_peak", frac);
        printf("floor: Q8_0 matrix-vector (1b, x_q8) %.1f%% of %s (>= %.0f%%): %s\n", 100 * frac,
               cpu_device ? "triad" : "device bandwidth", 100 * mv_floor, frac >= mv_floor ? "ok" : "BELOW");
        ok = ok && frac >= mv_floor;
    }
    cJSON_AddBoolToObject(floors, "ok", ok);
    if (out_path) {
        char *s = cJSON_Print(root);
        FILE *f = fopen(out_path, "w");
        if (f) {
            fputs(s, f);
            fputc('\n', f);
            fclose(f);
        } else {
            fprintf(stderr, "bench_vulkan: cannot write %s\n", out_path);
        }
        cJSON_free(s);
    }
    cJSON_Delete(root);
    return ok ? 0 : 1;
}
