/* bench_batching.c — continuous batching against batch size 1 at the same
 * offered load, in process through the engine API: aggregate generation
 * tokens/s and latency percentiles.
 *
 * usage: bench_batching [-m MODEL] [--backend B] [--threads N] [--concurrency 1,4,16]
 *                       [--requests N] [--tokens N] [--repeat N] [--json]
 * Without -m it benchmarks the synthetic 125m q8_0 model (made once in /tmp).
 * --repeat runs the whole concurrency list N times, interleaved (so a noisy
 * neighbour hits every level alike), and reports the median of each level
 * and the median of the rounds' speedups over the first level.
 */
#include <cjson/cJSON.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "bench_util.h"
#include "duet.h"

typedef struct run_state {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int done, tokens;
    double *latency; /* per request, seconds */
    double *ttft;
    double *t_submit;
} run_state;

typedef struct req_ctx {
    run_state *rs;
    int i;
    bool first;
} req_ctx;

static void on_event(const duet_event *ev, void *user) {
    req_ctx *x = user;
    run_state *rs = x->rs;
    pthread_mutex_lock(&rs->mu);
    if (ev->kind == DUET_EVENT_TOKEN && ev->token >= 0) {
        rs->tokens++;
        if (!x->first) rs->ttft[x->i] = bench_now() - rs->t_submit[x->i], x->first = true;
    } else if (ev->kind == DUET_EVENT_DONE) {
        rs->latency[x->i] = bench_now() - rs->t_submit[x->i];
        rs->done++;
        pthread_cond_broadcast(&rs->cv);
    }
    pthread_mutex_unlock(&rs->mu);
}

static double percentile(double *v, int n, double p) {
    qsort(v, (size_t)n, sizeof *v, bench_cmp_double);
    int i = (int)(p / 100.0 * (n - 1) + 0.5);
    return v[i < n ? i : n - 1];
}

typedef struct result {
    int concurrency;
    double tokens_per_s, p50, p99, ttft_p99;
} result;

/* Closed loop: `conc` requests in flight until `n_req` have completed. */
static result run(const char *model, const char *backend, int threads, int conc, int n_req, int n_tokens) {
    duet_engine_params p = duet_engine_params_default();
    p.open.backend = backend;
    p.open.n_threads = threads;
    p.open.n_ctx = 512;
    p.max_batch_seqs = conc;
    p.max_batch_tokens = conc > 64 ? conc : 64;
    p.batch_timeout_ms = 0;
    p.prefill_chunk = 64;
    duet_engine *e;
    if (duet_engine_start(model, &p, &e)) {
        fprintf(stderr, "bench_batching: %s\n", duet_last_error());
        exit(1);
    }
    run_state rs = {.latency = calloc(n_req, sizeof(double)),
                    .ttft = calloc(n_req, sizeof(double)),
                    .t_submit = calloc(n_req, sizeof(double))};
    pthread_mutex_init(&rs.mu, NULL);
    pthread_cond_init(&rs.cv, NULL);
    req_ctx *ctx = calloc(n_req, sizeof *ctx);
    int32_t prompt[32];
    const duet_model *m = duet_engine_model(e);
    int np = duet_tokenize(m, "Once upon a time there was", 26, true, false, prompt, 32);
    double t0 = bench_now();
    int submitted = 0;
    pthread_mutex_lock(&rs.mu);
    while (rs.done < n_req) {
        while (submitted < n_req && submitted - rs.done < conc) {
            ctx[submitted] = (req_ctx){&rs, submitted, false};
            duet_request q = {.prompt = prompt, .n_prompt = np, .max_tokens = n_tokens, .ignore_eos = true};
            q.sampling = duet_sampling_default();
            q.sampling.temperature = 0;
            rs.t_submit[submitted] = bench_now();
            pthread_mutex_unlock(&rs.mu);
            if (duet_engine_submit(e, &q, on_event, &ctx[submitted], NULL)) {
                fprintf(stderr, "bench_batching: submit: %s\n", duet_last_error());
                exit(1);
            }
            pthread_mutex_lock(&rs.mu);
            submitted++;
        }
        pthread_cond_wait(&rs.cv, &rs.mu);
    }
    pthread_mutex_unlock(&rs.mu);
    double wall = bench_now() - t0;
    result r = {.concurrency = conc, .tokens_per_s = rs.tokens / wall};
    r.p50 = percentile(rs.latency, n_req, 50);
    r.p99 = percentile(rs.latency, n_req, 99);
    r.ttft_p99 = percentile(rs.ttft, n_req, 99);
    duet_engine_stop(e, true);
    free(rs.latency), free(rs.ttft), free(rs.t_submit), free(ctx);
    return r;
}

int main(int argc, char **argv) {
    const char *model = NULL, *backend = "cpu", *conc_list = "1,4,16";
    int threads = 2, n_req = 0, n_tokens = 32, repeat = 1;
    bool json = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-m") && i + 1 < argc)
            model = argv[++i];
        else if (!strcmp(argv[i], "--backend") && i + 1 < argc)
            backend = argv[++i];
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc)
            threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--concurrency") && i + 1 < argc)
            conc_list = argv[++i];
        else if (!strcmp(argv[i], "--requests") && i + 1 < argc)
            n_req = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--tokens") && i + 1 < argc)
            n_tokens = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--repeat") && i + 1 < argc)
            repeat = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--json"))
            json = true;
        else {
            fprintf(stderr,
                    "usage: bench_batching [-m MODEL] [--backend B] [--threads N] [--concurrency 1,4,16] "
                    "[--requests N] [--tokens N] [--repeat N] [--json]\n");
            return 2;
        }
    }
    static char path[4096];
    if (!model) {
        duet_mkmodel_params mp = {.shape = "125m", .type = "q8_0", .seed = 1};
        if (duet_mkmodel_cached(&mp, path, sizeof path, NULL)) {
            fprintf(stderr, "bench_batching: %s\n", duet_last_error());
            return 1;
        }
        model = path;
    }
    enum { MAX_LEVELS = 16, MAX_ROUNDS = 64 };
    int levels[MAX_LEVELS], n = 0;
    char list[128];
    snprintf(list, sizeof list, "%s", conc_list);
    for (char *t = strtok(list, ","); t && n < MAX_LEVELS; t = strtok(NULL, ","))
        levels[n++] = atoi(t);
    if (n == 0 || repeat < 1 || repeat > MAX_ROUNDS) {
        fprintf(stderr, "bench_batching: need a concurrency list and 1 <= --repeat <= %d\n", MAX_ROUNDS);
        return 2;
    }
    static result res[MAX_ROUNDS][MAX_LEVELS];
    for (int r = 0; r < repeat; r++)
        for (int i = 0; i < n; i++) {
            int c = levels[i];
            res[r][i] = run(model, backend, threads, c, n_req ? n_req : 2 * c, n_tokens);
            if (!json)
                fprintf(stderr,
                        "%sconcurrency %3d: %8.1f tokens/s (%.2fx), latency p50 %.3f s p99 %.3f s, ttft p99 "
                        "%.3f s\n",
                        repeat > 1 ? "  " : "", c, res[r][i].tokens_per_s,
                        res[r][i].tokens_per_s / res[r][0].tokens_per_s, res[r][i].p50, res[r][i].p99,
                        res[r][i].ttft_p99);
        }
    /* Per level: median tokens/s, and the median of the rounds' ratios. */
    double med_tps[MAX_LEVELS], med_ratio[MAX_LEVELS], v[MAX_ROUNDS];
    for (int i = 0; i < n; i++) {
        for (int r = 0; r < repeat; r++)
            v[r] = res[r][i].tokens_per_s;
        med_tps[i] = bench_median(v, repeat);
        for (int r = 0; r < repeat; r++)
            v[r] = res[r][i].tokens_per_s / res[r][0].tokens_per_s;
        med_ratio[i] = bench_median(v, repeat);
    }
    if (!json && repeat > 1)
        for (int i = 0; i < n; i++)
            fprintf(stderr, "concurrency %3d: median %8.1f tokens/s, median speedup %.2fx (%d rounds)\n",
                    levels[i], med_tps[i], med_ratio[i], repeat);
    if (json) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "model", model);
        cJSON_AddStringToObject(o, "backend", backend);
        cJSON_AddNumberToObject(o, "threads", threads);
        cJSON_AddNumberToObject(o, "tokens_per_request", n_tokens);
        cJSON_AddNumberToObject(o, "rounds", repeat);
        cJSON *a = cJSON_AddArrayToObject(o, "runs");
        for (int i = 0; i < n; i++) {
            cJSON *e = cJSON_CreateObject();
            cJSON_AddNumberToObject(e, "concurrency", levels[i]);
            /* Medians over the rounds (the values themselves with one round). */
            cJSON_AddNumberToObject(e, "generation_tokens_per_s", med_tps[i]);
            cJSON_AddNumberToObject(e, "speedup_vs_first", med_ratio[i]);
            for (int r = 0; r < repeat; r++)
                v[r] = res[r][i].p50;
            cJSON_AddNumberToObject(e, "latency_p50_s", bench_median(v, repeat));
            for (int r = 0; r < repeat; r++)
                v[r] = res[r][i].p99;
            cJSON_AddNumberToObject(e, "latency_p99_s", bench_median(v, repeat));
            for (int r = 0; r < repeat; r++)
                v[r] = res[r][i].ttft_p99;
            cJSON_AddNumberToObject(e, "ttft_p99_s", bench_median(v, repeat));
            cJSON *rounds = cJSON_AddArrayToObject(e, "round_tokens_per_s");
            for (int r = 0; r < repeat; r++)
                cJSON_AddItemToArray(rounds, cJSON_CreateNumber(res[r][i].tokens_per_s));
            cJSON_AddItemToArray(a, e);
        }
        char *s = cJSON_Print(o);
        puts(s);
        cJSON_free(s);
        cJSON_Delete(o);
    }
    return 0;
}
