/* bench_decode.c — end-to-end CPU decode and prefill tokens/s, with the
 * fraction of the machine's triad bandwidth that decode reaches
 * (weight bytes per token x tokens/s / triad GB/s).
 *
 * usage: bench_decode [--threads N] [--tokens N] [--json] [--shared DIR] [--models a,b,...]
 * Models: stories260K (from ../shared), and synthetic ones made with
 * duet_mkmodel into /tmp (125m-q8_0 by default; also 125m-f16, 1b-q8_0, 1b-f16).
 */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "bench_util.h"
#include "duet.h"

typedef struct result {
    char name[64];
    double prefill_tps, decode_tps, weight_mb, frac_bw;
} result;

static int bench_model(const char *name, const char *path, int threads, int n_tokens, double triad,
                       result *r) {
    duet_open_params op = duet_open_params_default();
    op.backend = "cpu";
    op.n_threads = threads;
    op.n_ctx = 1024;
    duet_model *m;
    if (duet_model_open(path, &op, &m)) {
        fprintf(stderr, "bench_decode: %s: %s\n", path, duet_last_error());
        return 1;
    }
    duet_model_desc d;
    duet_model_describe(m, &d);
    int32_t prompt[128];
    for (int i = 0; i < 128; i++) prompt[i] = 3 + (i * 7919) % (d.n_vocab - 3);
    /* Prefill: 128 tokens in one call (best of 3). */
    double best_prefill = 1e30;
    for (int rep = 0; rep < 3; rep++) {
        double t0 = bench_now();
        duet_eval(m, prompt, 128, 0, NULL);
        double dt = bench_now() - t0;
        if (dt < best_prefill) best_prefill = dt;
    }
    /* Decode: one token per step after a short prompt (best of 3 runs). */
    double best_decode = 1e30;
    for (int rep = 0; rep < 3; rep++) {
        duet_eval(m, prompt, 8, 0, NULL);
        double t0 = bench_now();
        for (int i = 0; i < n_tokens; i++) duet_eval(m, &prompt[(8 + i) % 128], 1, 8 + i, NULL);
        double dt = bench_now() - t0;
        if (dt < best_decode) best_decode = dt;
    }
    snprintf(r->name, sizeof r->name, "%s", name);
    r->prefill_tps = 128 / best_prefill;
    r->decode_tps = n_tokens / best_decode;
    r->weight_mb = d.weight_bytes / 1e6;
    r->frac_bw = d.weight_bytes * r->decode_tps / (triad * 1e9);
    duet_model_close(m);
    return 0;
}

static const char *synthetic(const char *shape, const char *type) {
    static char path[256];
    snprintf(path, sizeof path, "/tmp/duet-bench-%s-%s.gguf", shape, type);
    struct stat sb;
    if (stat(path, &sb) == 0) return path;
    duet_mkmodel_params p = {.shape = shape, .type = type, .seed = 1};
    if (duet_mkmodel(&p, path)) {
        fprintf(stderr, "bench_decode: mkmodel: %s\n", duet_last_error());
        return NULL;
    }
    return path;
}

int main(int argc, char **argv) {
    int threads = 2, n_tokens = 64;
    bool json = false;
    const char *shared = "../shared", *models = "stories260K,125m-q8_0";
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--threads") && i + 1 < argc) threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--tokens") && i + 1 < argc) n_tokens = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--shared") && i + 1 < argc) shared = argv[++i];
        else if (!strcmp(argv[i], "--models") && i + 1 < argc) models = argv[++i];
        else if (!strcmp(argv[i], "--json")) json = true;
        else {
            fprintf(stderr, "usage: bench_decode [--threads N] [--tokens N] [--json] [--shared DIR] "
                            "[--models stories260K,125m-q8_0,125m-f16,1b-q8_0,1b-f16]\n");
            return 2;
        }
    }
    double triad = bench_triad_gbs(threads, 5);
    result res[8];
    int n = 0;
    char list[256];
    snprintf(list, sizeof list, "%s", models);
    for (char *tok = strtok(list, ","); tok && n < 8; tok = strtok(NULL, ",")) {
        char path[512];
        if (!strcmp(tok, "stories260K")) {
            snprintf(path, sizeof path, "%s/models/stories260K.gguf", shared);
        } else {
            char shape[16], type[16];
            if (sscanf(tok, "%15[^-]-%15s", shape, type) != 2) continue;
            const char *p = synthetic(shape, type);
            if (!p) return 1;
            snprintf(path, sizeof path, "%s", p);
        }
        if (bench_model(tok, path, threads, n_tokens, triad, &res[n]) == 0) n++;
    }
    if (json) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "backend", "cpu");
        cJSON_AddNumberToObject(o, "threads", threads);
        cJSON_AddNumberToObject(o, "triad_gbs", triad);
        cJSON *a = cJSON_AddArrayToObject(o, "models");
        for (int i = 0; i < n; i++) {
            cJSON *e = cJSON_CreateObject();
            cJSON_AddStringToObject(e, "model", res[i].name);
            cJSON_AddNumberToObject(e, "weight_mb_per_token", res[i].weight_mb);
            cJSON_AddNumberToObject(e, "prefill_tokens_per_s", res[i].prefill_tps);
            cJSON_AddNumberToObject(e, "decode_tokens_per_s", res[i].decode_tps);
            cJSON_AddNumberToObject(e, "decode_fraction_of_triad", res[i].frac_bw);
            cJSON_AddItemToArray(a, e);
        }
        char *s = cJSON_Print(o);
        puts(s);
        cJSON_free(s);
        cJSON_Delete(o);
    } else {
        printf("triad bandwidth (%d threads): %.1f GB/s\n", threads, triad);
        printf("%-14s %10s %14s %14s %10s\n", "model", "MB/token", "prefill tok/s", "decode tok/s", "% triad");
        for (int i = 0; i < n; i++)
            printf("%-14s %10.1f %14.1f %14.1f %9.1f%%\n", res[i].name, res[i].weight_mb, res[i].prefill_tps,
                   res[i].decode_tps, 100 * res[i].frac_bw);
    }
    return 0;
}
