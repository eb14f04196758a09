/* bench_vulkan.c — the Vulkan backend's floors and its matmul paths.
 *
 * bench_backend_ops times every op of every backend side by side; this one
 * answers the Vulkan issue's questions on the device at hand:
 *   - the Q8_0 matrix-vector shader's GB/s against the machine's triad
 *     bandwidth, on each path the tuning table can pick (tile or subgroup;
 *     int8 dot products or the fallback), so a table entry can be checked;
 *   - end-to-end prefill and decode tokens/s of the synthetic 125m and 1b
 *     Q8_0 models;
 *   - the floors: on a CPU device (lavapipe) matrix-vector >= 10% of triad
 *     and 125m decode >= 10 tokens/s; on a GPU matrix-vector >= 80% of the
 *     device bandwidth (measured with a large ADD, as bench_backend_ops).
 *
 * usage: bench_vulkan [--device N] [--decode-tokens N] [--models 125m-q8_0,1b-q8_0] [--out FILE]
 * Exits 1 when a floor is missed. Set DUET_PROFILE=1 for per-op device
 * time of every run (printed when each instance closes). */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "../tests/backend_ops_cases.h"
#include "bench_util.h"
#include "duet.h"

/* Best seconds per op over steps of `reps` ops (after a warm-up step). */
static double time_case(duet_backend *be, int ci, int reps) {
    bo_host h;
    bo_host_build(ci, &h);
    bo_dev d;
    double best = -1;
    if (bo_dev_setup(be, &h, &d) == DUET_OK && bo_dev_run(&d, 1) == DUET_OK) {
        best = 1e30;
        double spent = 0;
        for (int i = 0; i < 30 && (i < 5 || spent < 0.5); i++) {
            double t0 = bench_now();
            if (bo_dev_run(&d, reps) != DUET_OK) {
                best = -1;
                break;
            }
            double dt = bench_now() - t0;
            spent += dt;
            if (dt / reps < best) best = dt / reps;
        }
        bo_dev_free(&d);
    }
    bo_host_free(&h);
    return best;
}

/* A device's own bandwidth for GPUs: the biggest ADD case (read 2, write 1). */
static double device_gbs(duet_backend *be) {
    double gbs = 0;
    for (int ci = 0; ci < BO_N_CASES; ci++) {
        const bo_case *c = &bo_cases[ci];
        if (c->kind != DUET_OP_ADD || !(c->modes & BO_PERF)) continue;
        double s = time_case(be, ci, 20), bytes, flops;
        bo_case_cost(c, &bytes, &flops);
        if (s > 0 && bytes / s / 1e9 > gbs) gbs = bytes / s / 1e9;
    }
    return gbs;
}

typedef struct path {
    const char *name, *tune; /* DUET_VK_TUNE for it; NULL: the table's choice */
} path;

static void bench_matvec(int device, double peak, bool cpu_device, cJSON *out, double *floor_frac) {
    const path paths[] = {
        {"table", NULL},
        {"tile", "matmul=tile,dot=0"},
        {"tile+dot", "matmul=tile,dot=1"},
        {"subgroup", "matmul=subgroup,dot=0"},
        {"subgroup+dot", "matmul=subgroup,dot=1"},
    };
    for (size_t p = 0; p < sizeof paths / sizeof *paths; p++) {
        if (paths[p].tune) setenv("DUET_VK_TUNE", paths[p].tune, 1);
        else unsetenv("DUET_VK_TUNE");
        duet_backend *be;
        if (duet_backend_open("vulkan", device, NULL, &be) != DUET_OK) {
            printf("  %-13s (not on this device: %s)\n", paths[p].name, duet_last_error());
            continue;
        }
        if (p == 0) printf("  the table picks: %s\n", strstr(be->info.features, "tuning="));
        for (int ci = 0; ci < BO_N_CASES; ci++) {
            const bo_case *c = &bo_cases[ci];
            if (c->kind != DUET_OP_MATMUL || c->dtype != DUET_DTYPE_Q8_0 || c->n_tokens != 1 || !(c->modes & BO_PERF))
                continue;
            double s = time_case(be, ci, 10), bytes, flops;
            if (s <= 0) continue;
            bo_case_cost(c, &bytes, &flops);
            double gbs = bytes / s / 1e9;
            char label[160];
            bo_case_label(c, label, sizeof label);
            printf("  %-13s %-44s %9.1f us %7.2f GB/s %5.1f%% of %s\n", paths[p].name, label, s * 1e6, gbs,
                   100 * gbs / peak, cpu_device ? "triad" : "device");
            cJSON *e = cJSON_CreateObject();
            cJSON_AddStringToObject(e, "path", paths[p].name);
            cJSON_AddStringToObject(e, "case", label);
            cJSON_AddNumberToObject(e, "us", s * 1e6);
            cJSON_AddNumberToObject(e, "gbs", gbs);
            cJSON_AddNumberToObject(e, "frac_peak", gbs / peak);
            cJSON_AddItemToArray(out, e);
            /* The floor is for what the table runs, on the largest matrix
             * (the one that streams from memory rather than cache). */
            if (p == 0 && c->rows >= 32000) *floor_frac = gbs / peak;
        }
        duet_backend_close(be);
    }
    unsetenv("DUET_VK_TUNE");
}

static const char *synthetic(const char *shape, const char *type) {
    static char path[256];
    snprintf(path, sizeof path, "/tmp/duet-bench-%s-%s.gguf", shape, type);
    struct stat sb;
    if (stat(path, &sb) == 0) return path;
    duet_mkmodel_params p = {.shape = shape, .type = type, .seed = 1};
    if (duet_mkmodel(&p, path) != DUET_OK) {
        fprintf(stderr, "bench_vulkan: mkmodel %s %s: %s\n", shape, type, duet_last_error());
        return NULL;
    }
    return path;
}

/* Prefill (64 or 128 tokens) and decode tokens/s through the public API. */
static double bench_model(const char *model, int device, int n_decode, cJSON *out) {
    char shape[16], type[16];
    if (sscanf(model, "%15[^-]-%15s", shape, type) != 2) return -1;
    const char *path = synthetic(shape, type);
    if (!path) return -1;
    duet_open_params op = duet_open_params_default();
    op.backend = "vulkan";
    op.device = device;
    op.n_ctx = 512;
    duet_model *m;
    if (duet_model_open(path, &op, &m) != DUET_OK) {
        printf("  %-12s error: %s\n", model, duet_last_error());
        return -1;
    }
    duet_model_desc d;
    duet_model_describe(m, &d);
    const bool big = strcmp(shape, "125m") != 0;
    const int n_prompt = big ? 64 : 128, reps = big ? 1 : 3;
    if (big) n_decode /= 4;
    int32_t prompt[128];
    for (int i = 0; i < 128; i++) prompt[i] = 3 + (i * 7919) % (d.n_vocab - 3);
    duet_status st = duet_eval(m, prompt, 8, 0, NULL); /* warm-up: pipelines made, caches warm */
    double best_p = 1e30, best_d = 1e30;
    for (int r = 0; r < reps && st == DUET_OK; r++) {
        double t0 = bench_now();
        st = duet_eval(m, prompt, n_prompt, 0, NULL);
        double dt = bench_now() - t0;
        if (dt < best_p) best_p = dt;
    }
    for (int r = 0; r < reps && st == DUET_OK; r++) {
        st = duet_eval(m, prompt, 8, 0, NULL);
        double t0 = bench_now();
        for (int i = 0; i < n_decode && st == DUET_OK; i++) st = duet_eval(m, &prompt[(8 + i) % 128], 1, 8 + i, NULL);
        double dt = bench_now() - t0;
        if (dt < best_d) best_d = dt;
    }
    double decode = -1;
    if (st != DUET_OK) {
        printf("  %-12s error: %s\n", model, duet_last_error());
    } else {
        decode = n_decode / best_d;
        printf("  %-12s prefill %7.1f tok/s (%d tokens)   decode %6.2f tok/s   %.0f MB of weights per token\n", model,
               n_prompt / best_p, n_prompt, decode, d.weight_bytes / 1e6);
        cJSON *e = cJSON_CreateObject();
        cJSON_AddStringToObject(e, "model", model);
        cJSON_AddNumberToObject(e, "prefill_tokens", n_prompt);
        cJSON_AddNumberToObject(e, "prefill_tokens_per_s", n_prompt / best_p);
        cJSON_AddNumberToObject(e, "decode_tokens", n_decode);
        cJSON_AddNumberToObject(e, "decode_tokens_per_s", decode);
        cJSON_AddNumberToObject(e, "weight_mb_per_token", d.weight_bytes / 1e6);
        cJSON_AddItemToArray(out, e);
    }
    duet_model_close(m);
    return decode;
}

int main(int argc, char **argv) {
    int device = 0, n_decode = 64;
    const char *models = "125m-q8_0,1b-q8_0", *out_path = NULL;
    for (int i = 1; i < argc; i++) {
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(argv[i], "--device") && v) device = atoi(v), i++;
        else if (!strcmp(argv[i], "--decode-tokens") && v) n_decode = atoi(v), i++;
        else if (!strcmp(argv[i], "--models") && v) models = v, i++;
        else if (!strcmp(argv[i], "--out") && v) out_path = v, i++;
        else {
            fprintf(stderr, "usage: bench_vulkan [--device N] [--decode-tokens N] [--models 125m-q8_0,1b-q8_0] [--out FILE]\n");
            return 2;
        }
    }
    if (n_decode < 4) n_decode = 4;
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
    double peak = triad;
    if (!cpu_device) {
        duet_backend *be;
        if (duet_backend_open("vulkan", device, NULL, &be) == DUET_OK) {
            peak = device_gbs(be);
            duet_backend_close(be);
        }
    }
    printf("vulkan/%d: %s (%s)\n", device, info.name, info.driver);
    printf("machine triad (2 threads): %.1f GB/s; peak used: %.1f GB/s (%s)\n\n", triad, peak,
           cpu_device ? "triad: a CPU device" : "a large ADD on the device");

    cJSON *root = cJSON_CreateObject();
    cJSON_AddStringToObject(root, "device", info.name);
    cJSON_AddStringToObject(root, "driver", info.driver);
    cJSON_AddNumberToObject(root, "triad_gbs", triad);
    cJSON_AddNumberToObject(root, "peak_gbs", peak);
    cJSON *mv = cJSON_AddArrayToObject(root, "q8_0_matvec");
    cJSON *e2e = cJSON_AddArrayToObject(root, "end_to_end");

    printf("Q8_0 matrix-vector, by path:\n");
    double frac = -1;
    bench_matvec(device, peak, cpu_device, mv, &frac);
    printf("\nend to end:\n");
    double dec125 = -1;
    char list[256];
    snprintf(list, sizeof list, "%s", models);
    char *save = NULL;
    for (char *m = strtok_r(list, ",", &save); m; m = strtok_r(NULL, ",", &save)) {
        double d = bench_model(m, device, n_decode, e2e);
        if (!strcmp(m, "125m-q8_0")) dec125 = d;
    }

    /* Floors (issue: Vulkan backend). */
    bool ok = true;
    cJSON *floors = cJSON_AddObjectToObject(root, "floors");
    const double mv_floor = cpu_device ? 0.10 : 0.80;
    printf("\n");
    if (frac >= 0) {
        cJSON_AddNumberToObject(floors, "q8_0_matvec_frac_peak", frac);
        cJSON_AddNumberToObject(floors, "q8_0_matvec_floor", mv_floor);
        printf("floor: Q8_0 matrix-vector %.1f%% of %s (>= %.0f%%): %s\n", 100 * frac, cpu_device ? "triad" : "device bandwidth",
               100 * mv_floor, frac >= mv_floor ? "ok" : "BELOW");
        ok = ok && frac >= mv_floor;
    }
    if (cpu_device && dec125 >= 0) {
        cJSON_AddNumberToObject(floors, "125m_q8_0_decode_tokens_per_s", dec125);
        printf("floor: 125m q8_0 decode %.1f tokens/s (>= 10): %s\n", dec125, dec125 >= 10 ? "ok" : "BELOW");
        ok = ok && dec125 >= 10;
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
