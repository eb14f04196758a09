/* duet_bench_sim.c — duet-bench --simulate: every sweep point run on a
 * virtual clock by duet_simulate (the engine's own scheduler per instance,
 * a least-outstanding-work router, steps costed by a `duet profile` model)
 * instead of against a server. The prompts, lengths, priorities and
 * arrival times are the ones a real run of the same flags sends, so the
 * same report comes out and real and simulated runs compare one to one.
 *
 * Also: traces (arrival, prompt and output tokens per request, from a
 * file) and --find-instances, which sweeps the fleet size until every
 * offered load meets the p99 targets and draws the curve.
 */
#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "duet_bench.h"

/* ---- one simulated point ------------------------------------------------------ */

typedef struct sim_ctx {
    db_result *res;
    double *t_last;
    double latency; /* seconds added to every token's time */
    bool oom;
    db_hist batch; /* steps by sequences in them: bucket k holds size k + 1 */
    /* --sim-step-log: a line a step, in the columns of `duet serve
     * --step-log` (the point and instance first). */
    FILE *steps;
    int point;
    const duet_step_cost *cost;
    double last_end[64]; /* each instance's last step end; NAN before its first */
} sim_ctx;

static void on_token(int r, int index, double t, void *user) {
    sim_ctx *c = user;
    if (index > 0 && !db_result_add_itl(&c->res[r], t - c->t_last[r])) c->oom = true;
    c->t_last[r] = t;
}

static void on_step(int instance, double t, double seconds, int n_seqs, const duet_step_shape *sh,
                    void *user) {
    sim_ctx *c = user;
    if (c->steps) {
        fprintf(c->steps, "%d,%d,%.6f,", c->point, instance, t);
        if (!isnan(c->last_end[instance])) fprintf(c->steps, "%.6f", t - c->last_end[instance]);
        fprintf(c->steps, ",%d,%d,%d,%.0f,%.0f,%.6f,%.6f\n", n_seqs, sh->n_decode, sh->n_prefill,
                sh->decode_ctx, sh->prefill_ctx, seconds, duet_step_cost_predict(c->cost, sh));
        c->last_end[instance] = t + seconds;
    }
    int k = n_seqs < 1 ? 0 : n_seqs > DB_MAX_BUCKETS ? DB_MAX_BUCKETS - 1 : n_seqs - 1;
    if (k >= c->batch.n) {
        for (int j = c->batch.n; j <= k; j++)
            c->batch.le[j] = j + 1;
        c->batch.n = k + 1;
    }
    if (k == DB_MAX_BUCKETS - 1) c->batch.le[k] = INFINITY; /* larger steps share the last bucket */
    c->batch.count[k]++;
    c->batch.sum += n_seqs;
    c->batch.total++;
}

/* Prompt tokens of a prompt: its ids, else its words (the random text
 * prompts are one common word per token). */
static int prompt_tokens(const db_prompt *p) {
    if (p->n_ids > 0) return p->n_ids;
    int n = 0;
    for (const char *s = p->text; s && *s;) {
        while (*s == ' ' || *s == '\n' || *s == '\t')
            s++;
        if (!*s) break;
        n++;
        while (*s && *s != ' ' && *s != '\n' && *s != '\t')
            s++;
    }
    return n;
}

int db_sim_requests_needed(const db_config *cfg) {
    double rate = cfg->load.rate;
    for (int i = 0; i < cfg->n_sweep_rate; i++)
        if (i == 0 || cfg->sweep_rate[i] > rate) rate = cfg->sweep_rate[i];
    double n = cfg->profile.n ? db_profile_cumulative(&cfg->profile, db_profile_end(&cfg->profile))
               : cfg->load.duration_s <= 0 || isinf(rate) ? NAN
                                                          : rate * cfg->load.duration_s;
    if (isnan(n)) return 20000;
    /* The Poisson count stays under its mean plus 6 standard deviations. */
    n += 6 * sqrt(n) + 16;
    return n > 50000000 ? 50000000 : (int)n;
}

bool db_sim_run(const db_config *cfg, const db_knobs *kn, const db_prompt *prompts, int n,
                const db_load *load, db_result *results, int *n_sent, double *duration,
                db_server_stats *server, FILE *steps, int point, char *err, size_t esize) {
    *n_sent = 0;
    *duration = 0;
    memset(server, 0, sizeof *server);
    server->mean_batch = server->busy_ratio = server->preemptions = NAN;
    server->max_batch_seqs = server->batch_timeout_ms = server->max_batch_tokens = server->prefill_chunk =
        NAN;
    if (load->max_concurrency > 0) {
        snprintf(err, esize, "--simulate runs open-loop arrivals only (no --max-concurrency)");
        return false;
    }
    duet_sim_request *rq = calloc((size_t)n + 1, sizeof *rq);
    duet_sim_outcome *out = calloc((size_t)n + 1, sizeof *out);
    double *t_last = calloc((size_t)n + 1, sizeof *t_last);
    if (!rq || !out || !t_last) {
        free(rq), free(out), free(t_last);
        snprintf(err, esize, "out of memory");
        return false;
    }
    /* Arrivals: the trace's (rescaled to the point's rate when one is set),
     * or the same gamma/Poisson draws db_http_run and db_inproc_run make. */
    double scale = 1;
    if (cfg->trace_path && !isinf(load->rate) && n > 1 && prompts[n - 1].arrival > 0)
        scale = (double)(n - 1) / prompts[n - 1].arrival / load->rate;
    db_arrivals arr;
    db_arrivals_init(&arr, load);
    double arrival = 0;
    int sent = 0;
    for (int i = 0; i < n; i++) {
        arrival = cfg->trace_path ? prompts[i].arrival * scale : db_arrivals_next(&arr);
        if (isinf(arrival) || (load->duration_s > 0 && arrival >= load->duration_s)) break;
        rq[i] = (duet_sim_request){.arrival = arrival,
                                   .n_prompt = prompt_tokens(&prompts[i]),
                                   .n_output = prompts[i].output_len,
                                   .priority = prompts[i].priority};
        sent++;
    }
    duet_sim_params sp = {.n_instances = cfg->sim_instances > 0 ? cfg->sim_instances : 1,
                          .engine = duet_engine_params_default(),
                          .n_ctx = cfg->sim_n_ctx,
                          .cost = cfg->sim_cost,
                          .step_noise = !cfg->sim_no_step_noise,
                          .prompt_scale = cfg->sim_kind_scale[0],
                          .decode_scale = cfg->sim_kind_scale[1],
                          /* The point's workload seed: its own draws, the same on a rerun. */
                          .noise_seed = load->seed ^ UINT64_C(0x5DEECE66D) ^
                                        cfg->sim_noise_seed * UINT64_C(0x9E3779B97F4A7C15),
                          .on_token = on_token,
                          .on_step = on_step};
    memcpy(sp.engine.slo_ttft_ms, cfg->sim_slo_ttft_ms, sizeof sp.engine.slo_ttft_ms);
    memcpy(sp.engine.slo_itl_ms, cfg->sim_slo_itl_ms, sizeof sp.engine.slo_itl_ms);
    sp.engine.static_knobs = cfg->sim_static_knobs;
    if (kn->max_batch_seqs > 0) sp.engine.max_batch_seqs = kn->max_batch_seqs;
    if (kn->batch_timeout_ms >= 0) sp.engine.batch_timeout_ms = kn->batch_timeout_ms;
    if (kn->max_batch_tokens > 0) sp.engine.max_batch_tokens = kn->max_batch_tokens;
    if (kn->prefill_chunk > 0) sp.engine.prefill_chunk = kn->prefill_chunk;
    if (sp.engine.max_batch_tokens < sp.engine.max_batch_seqs)
        sp.engine.max_batch_tokens = sp.engine.max_batch_seqs;
    if (sp.engine.prefill_chunk > sp.engine.max_batch_tokens)
        sp.engine.prefill_chunk = sp.engine.max_batch_tokens;
    if (cfg->max_waiting > 0)
        sp.engine.max_waiting = cfg->max_waiting;
    else
        sp.engine.max_waiting = sent < 256 ? 256 : sent > 100000 ? 100000 : sent;
    sim_ctx ctx = {.res = results,
                   .t_last = t_last,
                   .latency = cfg->sim_latency_ms / 1e3,
                   .steps = steps,
                   .point = point,
                   .cost = &sp.cost};
    for (int k = 0; k < 64; k++)
        ctx.last_end[k] = NAN;
    sp.user = &ctx;
    for (int i = 0; i < sent; i++) {
        db_result *r = &results[i];
        memset(r, 0, sizeof *r);
        r->ttft = NAN;
        r->priority = prompts[i].priority;
        r->t_arrival = r->t_sent = rq[i].arrival;
        r->prompt_tokens = rq[i].n_prompt;
    }
    duet_sim_stats stats;
    bool ok = duet_simulate(&sp, rq, sent, out, &stats) == DUET_OK;
    if (!ok) snprintf(err, esize, "simulate: %s", duet_last_error());
    double end = 0;
    for (int i = 0; ok && i < sent; i++) {
        db_result *r = &results[i];
        const duet_sim_outcome *o = &out[i];
        r->ok = o->status == DUET_OK;
        if (!r->ok) {
            snprintf(r->error, sizeof r->error, "%s (simulated refusal)", duet_status_name(o->status));
        } else {
            r->ttft = o->first_token + ctx.latency - rq[i].arrival;
            r->output_tokens = o->n_generated;
        }
        r->e2el = o->done + (r->ok ? ctx.latency : 0) - rq[i].arrival;
        if (rq[i].arrival + r->e2el > end) end = rq[i].arrival + r->e2el;
    }
    if (ok && ctx.oom) {
        snprintf(err, esize, "out of memory recording inter-token gaps");
        ok = false;
    }
    if (ok) {
        server->have_batch = true;
        server->batch = ctx.batch;
        server->mean_batch = ctx.batch.total > 0 ? ctx.batch.sum / ctx.batch.total : NAN;
        server->busy_ratio = end > 0 ? stats.busy_s / end : NAN; /* summed over instances, as a fleet's */
        server->preemptions = (double)stats.preemptions;
    }
    free(rq), free(out), free(t_last);
    *n_sent = sent;
    *duration = end;
    return ok;
}

/* ---- traces --------------------------------------------------------------------- */

static bool parse_priority(const char *s, duet_priority *p) {
    if (!strcmp(s, "interactive") || !strcmp(s, "0"))
        *p = DUET_PRIORITY_INTERACTIVE;
    else if (!strcmp(s, "batch") || !strcmp(s, "1"))
        *p = DUET_PRIORITY_BATCH;
    else
        return false;
    return true;
}

/* One trace line into p; false with a message. */
static bool trace_line(char *line, db_prompt *p, char *why, size_t wsize) {
    double t = NAN, in = NAN, outl = NAN;
    duet_priority prio = DUET_PRIORITY_INTERACTIVE;
    bool prio_set = false;
    if (line[0] == '{') {
        cJSON *o = cJSON_Parse(line);
        if (!o) {
            snprintf(why, wsize, "not JSON");
            return false;
        }
        const cJSON *a = cJSON_GetObjectItemCaseSensitive(o, "arrival");
        const cJSON *pi = cJSON_GetObjectItemCaseSensitive(o, "prompt_tokens");
        const cJSON *po = cJSON_GetObjectItemCaseSensitive(o, "output_tokens");
        const cJSON *pr = cJSON_GetObjectItemCaseSensitive(o, "priority");
        if (cJSON_IsNumber(a)) t = a->valuedouble;
        if (cJSON_IsNumber(pi)) in = pi->valuedouble;
        if (cJSON_IsNumber(po)) outl = po->valuedouble;
        bool bad_prio = pr && !(cJSON_IsString(pr) && parse_priority(pr->valuestring, &prio));
        prio_set = pr != NULL;
        cJSON_Delete(o);
        if (bad_prio) {
            snprintf(why, wsize, "\"priority\" must be \"interactive\" or \"batch\"");
            return false;
        }
    } else {
        char *save, *f[5];
        int k = 0;
        for (char *tok = strtok_r(line, ",", &save); tok && k < 5; tok = strtok_r(NULL, ",", &save))
            f[k++] = tok;
        char *end;
        if (k >= 3) {
            t = strtod(f[0], &end);
            if (*end) t = NAN;
            in = strtod(f[1], &end);
            if (*end) in = NAN;
            outl = strtod(f[2], &end);
            if (*end) outl = NAN;
        }
        if (k == 4) {
            if (!parse_priority(f[3], &prio)) {
                snprintf(why, wsize, "priority '%s' is not interactive or batch", f[3]);
                return false;
            }
            prio_set = true;
        }
        if (k < 3 || k > 4) {
            snprintf(why, wsize, "want arrival_s,prompt_tokens,output_tokens[,priority]");
            return false;
        }
    }
    if (!(isfinite(t) && t >= 0)) {
        snprintf(why, wsize, "the arrival time is missing or not a number >= 0");
        return false;
    }
    if (!(in >= 1 && in <= 1 << 24 && in == floor(in)) ||
        !(outl >= 1 && outl <= 1 << 24 && outl == floor(outl))) {
        snprintf(why, wsize, "prompt_tokens and output_tokens must be whole numbers >= 1");
        return false;
    }
    *p = (db_prompt){
        .n_ids = (int)in, .output_len = (int)outl, .priority = prio, .priority_set = prio_set, .arrival = t};
    return true;
}

bool db_trace_load(const char *path, db_prompt **out, int *n, char *err, size_t esize) {
    *out = NULL;
    *n = 0;
    FILE *f = fopen(path, "r");
    if (!f) {
        snprintf(err, esize, "%s: %s", path, strerror(errno));
        return false;
    }
    db_prompt *p = NULL;
    int cap = 0, count = 0, lineno = 0;
    char line[4096];
    bool ok = true;
    double t0 = 0;
    while (ok && fgets(line, sizeof line, f)) {
        lineno++;
        line[strcspn(line, "\r\n")] = 0;
        char *s = line;
        while (*s == ' ' || *s == '\t')
            s++;
        if (!*s || *s == '#') continue;
        /* A CSV header: its first field is not a number. */
        if (count == 0 && *s != '{' && !(*s == '.' || (*s >= '0' && *s <= '9'))) continue;
        if (count == cap) {
            cap = cap ? cap * 2 : 1024;
            db_prompt *q = realloc(p, (size_t)cap * sizeof *p);
            if (!q) {
                snprintf(err, esize, "out of memory");
                ok = false;
                break;
            }
            p = q;
        }
        char why[200];
        if (!trace_line(s, &p[count], why, sizeof why)) {
            snprintf(err, esize, "%s:%d: %s", path, lineno, why);
            ok = false;
            break;
        }
        if (count == 0) t0 = p[0].arrival;
        p[count].arrival -= t0; /* times from the first arrival */
        if (count > 0 && p[count].arrival < p[count - 1].arrival) {
            snprintf(err, esize, "%s:%d: arrival %g s comes before the previous line's", path, lineno,
                     p[count].arrival + t0);
            ok = false;
            break;
        }
        count++;
    }
    fclose(f);
    if (ok && count == 0) {
        snprintf(err, esize, "%s: no requests in the trace", path);
        ok = false;
    }
    if (!ok) {
        free(p);
        return false;
    }
    *out = p;
    *n = count;
    return true;
}

/* ---- --find-instances -------------------------------------------------------------- */

/* Whether a point meets the p99 targets (no failures, some completions). */
static bool meets(const db_config *cfg, const db_point *pt) {
    if (pt->stats.failed > 0 || pt->stats.completed == 0) return false;
    if (cfg->slo_ttft_ms > 0 && !(pt->ttft_p99_ms <= cfg->slo_ttft_ms)) return false;
    if (cfg->slo_itl_ms > 0 && !isnan(pt->itl_p99_ms) && !(pt->itl_p99_ms <= cfg->slo_itl_ms)) return false;
    return true;
}

int db_sim_find_instances(db_config *cfg, const char *command) {
    if (cfg->slo_ttft_ms <= 0 && cfg->slo_itl_ms <= 0) {
        fprintf(stderr,
                "duet-bench: --find-instances needs --slo-ttft-ms and/or --slo-itl-ms (p99 targets)\n");
        return 2;
    }
    char top[1000];
    if (cfg->output_dir)
        snprintf(top, sizeof top, "%s", cfg->output_dir);
    else {
        char ts[32];
        db_utc_now(ts, sizeof ts);
        char slug[64];
        db_slug(slug, sizeof slug, ts);
        snprintf(top, sizeof top, "bench/results/%s-find-instances", slug);
    }
    if (!db_mkdirs(top)) {
        fprintf(stderr, "duet-bench: cannot create %s: %s\n", top, strerror(errno));
        return 1;
    }
    char csv[1200], dat[1200];
    snprintf(csv, sizeof csv, "%s/instances.csv", top);
    FILE *f = fopen(csv, "w");
    if (!f) {
        fprintf(stderr, "duet-bench: cannot write %s: %s\n", csv, strerror(errno));
        return 1;
    }
    fprintf(f, "instances,request_rate,completed,failed,request_throughput,output_throughput,goodput,"
               "ttft_p50_ms,ttft_p99_ms,itl_p50_ms,itl_p99_ms,meets_slo\n");
    int n_loads = cfg->n_sweep_rate ? cfg->n_sweep_rate : 1;
    int needed[DB_MAX_SWEEP];
    for (int i = 0; i < DB_MAX_SWEEP; i++)
        needed[i] = 0;
    double rates[DB_MAX_SWEEP];
    int rc = 0, last_n = 0;
    for (int n = 1; n <= cfg->find_instances; n++) {
        cfg->sim_instances = n;
        db_sweep s = {0};
        snprintf(s.dir, sizeof s.dir, "%.1000s/x%d", top, n);
        bool ok = db_sweep_run(cfg, NULL, -1, &s);
        snprintf(s.meta.command, sizeof s.meta.command, "%s", command);
        if (!ok) {
            fprintf(stderr, "duet-bench: %s\n", s.why);
            db_sweep_free(&s);
            rc = 1;
            break;
        }
        db_report_write(cfg, &s, s.dir);
        bool all = true;
        for (int p = 0; p < s.n_points && p < DB_MAX_SWEEP; p++) {
            const db_point *pt = &s.points[p];
            rates[p] = pt->load.rate;
            bool m = meets(cfg, pt);
            if (m && !needed[p]) needed[p] = n;
            all = all && needed[p];
            fprintf(f, "%d,%g,%d,%d,%.6g,%.6g,%.6g,%.6g,%.6g,%.6g,%.6g,%d\n", n, pt->load.rate,
                    pt->stats.completed, pt->stats.failed, pt->stats.request_throughput,
                    pt->stats.output_throughput, pt->stats.goodput, pt->ttft_p50_ms, pt->ttft_p99_ms,
                    pt->itl_p50_ms, pt->itl_p99_ms, m);
            printf("x%-3d rate %-8g p99 TTFT %10.1f ms, p99 ITL %8.2f ms%s\n", n, pt->load.rate,
                   pt->ttft_p99_ms, pt->itl_p99_ms, m ? "  meets the targets" : "");
        }
        db_sweep_free(&s);
        last_n = n;
        /* Two more past the answer, for the curve's shape. */
        int max_needed = 0;
        for (int p = 0; p < n_loads; p++)
            if (needed[p] > max_needed) max_needed = needed[p];
        if (all && n >= max_needed + 2) break;
    }
    fclose(f);
    if (rc) return rc;
    printf("\ninstances needed (p99 TTFT <= %g ms, p99 ITL <= %g ms):\n", cfg->slo_ttft_ms, cfg->slo_itl_ms);
    for (int p = 0; p < n_loads; p++) {
        if (needed[p])
            printf("  rate %g req/s: %d\n", rates[p], needed[p]);
        else
            printf("  rate %g req/s: more than %d\n", rates[p], last_n);
    }
    snprintf(dat, sizeof dat, "%s/needed.csv", top);
    FILE *d = fopen(dat, "w");
    if (d) {
        fprintf(d, "request_rate,instances_needed\n");
        for (int p = 0; p < n_loads; p++)
            if (needed[p]) fprintf(d, "%g,%d\n", rates[p], needed[p]);
        fclose(d);
    }
    printf("curve: %s (and needed.csv, one sweep folder per fleet size)\n", csv);
    if (!cfg->plots || !db_gnuplot_terminal()) return 0;
    char gp[1200], png[1200];
    snprintf(gp, sizeof gp, "%s/instances.gp", top);
    snprintf(png, sizeof png, "%s/instances.png", top);
    FILE *g = fopen(gp, "w");
    if (!g) return 0;
    db_gp_header(g, png, 1400, 560);
    fprintf(g, "set datafile separator ','\nset multiplot layout 1,%d\n", n_loads > 1 ? 3 : 2);
    fprintf(g, "set xlabel 'instances'\nset logscale y\nset ylabel 'p99 TTFT (ms)'\nset title 'p99 time to "
               "first token'\n");
    fprintf(g, "plot ");
    for (int p = 0; p < n_loads; p++)
        fprintf(g, "%s'%s' skip 1 using ($2==%.17g?$1:1/0):9 with linespoints title 'rate %g'", p ? ", " : "",
                csv, rates[p], rates[p]);
    if (cfg->slo_ttft_ms > 0)
        fprintf(g, ", %g with lines dt 2 lc rgb 'red' title 'target'", cfg->slo_ttft_ms);
    fprintf(g, "\nset ylabel 'p99 ITL (ms)'\nset title 'p99 inter-token latency'\nplot ");
    for (int p = 0; p < n_loads; p++)
        fprintf(g, "%s'%s' skip 1 using ($2==%.17g?$1:1/0):11 with linespoints title 'rate %g'",
                p ? ", " : "", csv, rates[p], rates[p]);
    if (cfg->slo_itl_ms > 0) fprintf(g, ", %g with lines dt 2 lc rgb 'red' title 'target'", cfg->slo_itl_ms);
    fprintf(g, "\n");
    if (n_loads > 1)
        fprintf(
            g,
            "unset logscale y\nset xlabel 'offered load (req/s)'\nset ylabel 'instances'\n"
            "set title 'instances needed'\nplot '%s' skip 1 using 1:2 with linespoints title 'fewest meeting "
            "the targets'\n",
            dat);
    fprintf(g, "unset multiplot\n");
    fclose(g);
    char err[700];
    if (!db_gnuplot(gp, err, sizeof err))
        fprintf(stderr, "duet-bench: %s\n", err);
    else
        printf("plot: %s\n", png);
    return 0;
}
