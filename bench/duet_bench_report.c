/* duet_bench_report.c — what a sweep leaves behind: points.csv (one row per
 * sweep point), requests.csv (one row per request, with --save-detailed), batch_hist.csv,
 * results.json (all of it plus where it came from), summary.md, and
 * gnuplot plots; for --all-devices a side-by-side comparison. Also the
 * progress line.
 */
#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "duet_bench.h"

/* ---- progress ------------------------------------------------------------- */

void db_progress_update(db_progress *p, int done, int total, int in_flight, double elapsed, bool force) {
    if (!p || !p->enabled) return;
    double now = db_now();
    /* A terminal gets a redrawn line; a log gets a line every 10 s. */
    double every = p->tty ? 0.25 : 10.0;
    if (!force && p->t_last > 0 && now - p->t_last < every) return;
    if (!force && p->t_last == 0 && !p->tty) {
        p->t_last = now; /* the first log line after 10 s, not at once */
        return;
    }
    p->t_last = now;
    fprintf(stderr, "%s%s %d/%d done, %d in flight, %.1f s%s", p->tty ? "\r" : "", p->label, done, total,
            in_flight, elapsed, p->tty ? "\033[K" : "\n");
    fflush(stderr);
}

void db_progress_end(db_progress *p) {
    if (p && p->enabled && p->tty && p->t_last > 0) {
        fprintf(stderr, "\r\033[K");
        fflush(stderr);
    }
}

/* ---- helpers ---------------------------------------------------------------- */

static FILE *open_in(const char *dir, const char *name, char *path, size_t size) {
    snprintf(path, size, "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    if (!f) fprintf(stderr, "duet-bench: cannot write %s: %s\n", path, strerror(errno));
    return f;
}

/* A CSV number: empty for NAN (no data), "inf" for infinity. */
static void csv_num(FILE *f, double v) {
    if (isnan(v)) return;
    if (isinf(v))
        fprintf(f, "inf");
    else
        fprintf(f, "%.6g", v);
}

/* A CSV text field, quoted when it needs to be. */
static void csv_str(FILE *f, const char *s) {
    if (!strpbrk(s, ",\"\n\r")) {
        fputs(s, f);
        return;
    }
    fputc('"', f);
    for (const char *p = s; *p; p++) {
        if (*p == '"') fputc('"', f);
        fputc(*p == '\n' || *p == '\r' ? ' ' : *p, f);
    }
    fputc('"', f);
}

/* JSON has no NAN or infinity: null for "no data", the string "inf". */
static void json_num(cJSON *o, const char *key, double v) {
    if (isnan(v))
        cJSON_AddNullToObject(o, key);
    else if (isinf(v))
        cJSON_AddStringToObject(o, key, "inf");
    else
        cJSON_AddNumberToObject(o, key, v);
}

static const char *metric_names[4] = {"ttft", "tpot", "itl", "e2el"};

static const db_summary *metric(const db_run_stats *s, int i) {
    return i == 0 ? &s->ttft : i == 1 ? &s->tpot : i == 2 ? &s->itl : &s->e2el;
}

static bool point_meets(const db_config *cfg, const db_point *pt) {
    db_op_candidate c = {.output_throughput = pt->stats.output_throughput,
                         .ttft_p99_ms = pt->ttft_p99_ms,
                         .itl_p99_ms = pt->itl_p99_ms,
                         .completed = pt->stats.completed,
                         .failed = pt->stats.failed};
    return db_operating_point(&c, 1, cfg->slo_ttft_ms, cfg->slo_itl_ms) == 0;
}

static void knob_text(const db_knobs *k, char *buf, size_t size) {
    char bt[32], mbs[32];
    db_fmt_num(bt, sizeof bt, k->batch_timeout_ms < 0 ? NAN : k->batch_timeout_ms);
    db_fmt_num(mbs, sizeof mbs, k->max_batch_seqs <= 0 ? NAN : k->max_batch_seqs);
    snprintf(buf, size, "batch_timeout_ms=%s max_batch_seqs=%s", bt, mbs);
}

static void load_text(const db_load *l, char *buf, size_t size) {
    char r[32];
    db_fmt_num(r, sizeof r, l->rate);
    if (l->max_concurrency > 0)
        snprintf(buf, size, "rate=%s max_concurrency=%d", r, l->max_concurrency);
    else
        snprintf(buf, size, "rate=%s", r);
}

/* ---- CSV -------------------------------------------------------------------- */

static bool write_points_csv(const db_config *cfg, const db_sweep *s, const char *dir) {
    char path[1200];
    FILE *f = open_in(dir, "points.csv", path, sizeof path);
    if (!f) return false;
    const db_meta *m = &s->meta;
    fprintf(
        f,
        "point,backend,device,driver,model,commit,request_rate,burstiness,max_concurrency,batch_timeout_ms,"
        "max_batch_seqs,num_requests,completed,failed,duration_s,request_throughput,output_throughput,"
        "total_token_throughput,goodput");
    for (int i = 0; i < 4; i++) {
        fprintf(f, ",%s_mean_ms,%s_median_ms,%s_std_ms", metric_names[i], metric_names[i], metric_names[i]);
        for (int j = 0; j < cfg->n_ps; j++)
            fprintf(f, ",%s_p%g_ms", metric_names[i], cfg->ps[j]);
    }
    fprintf(f, ",mean_batch_size,engine_steps,device_busy_ratio,preemptions,meets_slo,operating_point,"
               "interactive_completed,interactive_ttft_p99_ms,interactive_itl_p99_ms,batch_completed,"
               "batch_ttft_p99_ms,batch_itl_p99_ms,other_cpu_ratio\n");
    for (int p = 0; p < s->n_points; p++) {
        const db_point *pt = &s->points[p];
        const db_run_stats *st = &pt->stats;
        fprintf(f, "%d,", p);
        csv_str(f, m->backend), fputc(',', f), csv_str(f, m->device), fputc(',', f), csv_str(f, m->driver);
        fputc(',', f), csv_str(f, m->model), fputc(',', f), csv_str(f, m->commit), fputc(',', f);
        csv_num(f, pt->load.rate), fputc(',', f), csv_num(f, pt->load.burstiness), fputc(',', f);
        if (pt->load.max_concurrency > 0) fprintf(f, "%d", pt->load.max_concurrency);
        fputc(',', f);
        if (pt->knobs.batch_timeout_ms >= 0) csv_num(f, pt->knobs.batch_timeout_ms);
        fputc(',', f);
        if (pt->knobs.max_batch_seqs > 0) fprintf(f, "%d", pt->knobs.max_batch_seqs);
        fprintf(f, ",%d,%d,%d,", st->n_requests, st->completed, st->failed);
        csv_num(f, st->duration), fputc(',', f), csv_num(f, st->request_throughput), fputc(',', f);
        csv_num(f, st->output_throughput), fputc(',', f), csv_num(f, st->total_token_throughput),
            fputc(',', f);
        csv_num(f, st->goodput);
        for (int i = 0; i < 4; i++) {
            const db_summary *sm = metric(st, i);
            fputc(',', f), csv_num(f, sm->mean), fputc(',', f), csv_num(f, sm->median), fputc(',', f);
            csv_num(f, sm->std);
            for (int j = 0; j < cfg->n_ps; j++)
                fputc(',', f), csv_num(f, sm->pct[j]);
        }
        fputc(',', f), csv_num(f, pt->server.mean_batch), fputc(',', f);
        if (pt->server.have_batch) csv_num(f, pt->server.batch.total);
        fputc(',', f), csv_num(f, pt->server.busy_ratio), fputc(',', f), csv_num(f, pt->server.preemptions);
        fprintf(f, ",%d,%d", point_meets(cfg, pt), p == s->op);
        for (int c = 0; c < 2; c++) {
            fprintf(f, ",%d,", pt->n_prio[c]);
            csv_num(f, pt->ttft_p99_prio_ms[c]), fputc(',', f), csv_num(f, pt->itl_p99_prio_ms[c]);
        }
        fputc(',', f), csv_num(f, pt->other_cpu);
        fputc('\n', f);
    }
    return fclose(f) == 0;
}

static bool write_requests_csv(const db_sweep *s, const char *dir) {
    char path[1200];
    FILE *f = open_in(dir, "requests.csv", path, sizeof path);
    if (!f) return false;
    fprintf(
        f,
        "point,request,priority,ok,arrival_s,sent_s,ttft_ms,tpot_ms,e2el_ms,itl_count,itl_mean_ms,itl_max_ms,"
        "prompt_tokens,output_tokens,error\n");
    for (int p = 0; p < s->n_points; p++)
        for (int i = 0; i < s->points[p].n_sent; i++) {
            const db_result *r = &s->points[p].results[i];
            double sum = 0, mx = NAN;
            for (int k = 0; k < r->n_itl; k++) {
                sum += r->itl[k];
                if (isnan(mx) || r->itl[k] > mx) mx = r->itl[k];
            }
            fprintf(f, "%d,%d,%s,%d,", p, i, r->priority == DUET_PRIORITY_BATCH ? "batch" : "interactive",
                    r->ok);
            csv_num(f, r->t_arrival), fputc(',', f), csv_num(f, r->t_sent), fputc(',', f);
            csv_num(f, r->ttft * 1e3), fputc(',', f), csv_num(f, db_result_tpot(r) * 1e3), fputc(',', f);
            csv_num(f, r->e2el * 1e3);
            fprintf(f, ",%d,", r->n_itl);
            csv_num(f, r->n_itl ? sum / r->n_itl * 1e3 : NAN), fputc(',', f), csv_num(f, mx * 1e3);
            fprintf(f, ",%d,%d,", r->prompt_tokens, r->output_tokens);
            csv_str(f, r->ok ? "" : r->error);
            fputc('\n', f);
        }
    return fclose(f) == 0;
}

static bool write_batch_csv(const db_sweep *s, const char *dir) {
    char path[1200];
    FILE *f = open_in(dir, "batch_hist.csv", path, sizeof path);
    if (!f) return false;
    fprintf(f, "point,batch_size_le,steps\n");
    for (int p = 0; p < s->n_points; p++) {
        const db_hist *h = &s->points[p].server.batch;
        if (!s->points[p].server.have_batch) continue;
        for (int k = 0; k < h->n; k++) {
            fprintf(f, "%d,", p);
            csv_num(f, h->le[k]);
            fprintf(f, ",%.0f\n", h->count[k]);
        }
    }
    return fclose(f) == 0;
}

/* ---- JSON ------------------------------------------------------------------- */

static cJSON *meta_json(const db_config *cfg, const db_meta *m) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "tool", "duet-bench");
    cJSON_AddStringToObject(o, "mode", m->mode);
    cJSON_AddStringToObject(o, "backend", m->backend);
    cJSON_AddStringToObject(o, "device", m->device);
    cJSON_AddNumberToObject(o, "device_index", m->device_index);
    cJSON_AddStringToObject(o, "driver", m->driver);
    if (m->instance[0]) {
        cJSON_AddStringToObject(o, "instance", m->instance);
        cJSON_AddStringToObject(o, "tier", m->tier);
    }
    cJSON_AddStringToObject(o, "model", m->model);
    cJSON_AddStringToObject(o, "commit", m->commit);
    cJSON_AddStringToObject(o, "started", m->started);
    cJSON_AddStringToObject(o, "host", m->host);
    cJSON_AddStringToObject(o, "command", m->command);
    cJSON *w = cJSON_AddObjectToObject(o, "workload");
    if (cfg->workload.dataset_path) cJSON_AddStringToObject(w, "dataset_path", cfg->workload.dataset_path);
    cJSON_AddNumberToObject(w, "random_input_len", cfg->workload.input_len);
    cJSON_AddNumberToObject(w, "random_prefix_len", cfg->workload.prefix_len);
    cJSON_AddNumberToObject(w, "random_output_len", cfg->workload.output_len);
    cJSON_AddNumberToObject(w, "random_range_ratio", cfg->workload.range_ratio);
    json_num(w, "interactive_share",
             cfg->workload.interactive_share < 0 ? NAN : cfg->workload.interactive_share);
    cJSON_AddNumberToObject(w, "num_prompts", cfg->num_prompts);
    json_num(w, "duration_s", cfg->load.duration_s > 0 ? cfg->load.duration_s : NAN);
    cJSON_AddNumberToObject(w, "seed", (double)cfg->workload.seed);
    cJSON_AddNumberToObject(w, "temperature", cfg->req.temperature);
    cJSON_AddBoolToObject(w, "ignore_eos", cfg->req.ignore_eos);
    json_num(w, "warmup", cfg->warmup >= 0 ? cfg->warmup : NAN); /* null: auto (max_batch_seqs) */
    cJSON *k = cJSON_AddObjectToObject(o, "engine");
    cJSON_AddNumberToObject(k, "threads", cfg->n_threads);
    cJSON_AddNumberToObject(k, "n_ctx", cfg->n_ctx);
    json_num(k, "max_batch_tokens", cfg->knobs.max_batch_tokens > 0 ? cfg->knobs.max_batch_tokens : NAN);
    json_num(k, "prefill_chunk", cfg->knobs.prefill_chunk > 0 ? cfg->knobs.prefill_chunk : NAN);
    cJSON *slo = cJSON_AddObjectToObject(o, "targets");
    json_num(slo, "ttft_p99_ms", cfg->slo_ttft_ms > 0 ? cfg->slo_ttft_ms : NAN);
    json_num(slo, "itl_p99_ms", cfg->slo_itl_ms > 0 ? cfg->slo_itl_ms : NAN);
    cJSON *g = cJSON_AddObjectToObject(o, "goodput_slo_ms");
    json_num(g, "ttft", cfg->goodput.ttft_ms > 0 ? cfg->goodput.ttft_ms : NAN);
    json_num(g, "tpot", cfg->goodput.tpot_ms > 0 ? cfg->goodput.tpot_ms : NAN);
    json_num(g, "itl", cfg->goodput.itl_ms > 0 ? cfg->goodput.itl_ms : NAN);
    json_num(g, "e2el", cfg->goodput.e2el_ms > 0 ? cfg->goodput.e2el_ms : NAN);
    return o;
}

static cJSON *point_json(const db_config *cfg, const db_sweep *s, int p) {
    const db_point *pt = &s->points[p];
    const db_run_stats *st = &pt->stats;
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "point", p);
    cJSON *l = cJSON_AddObjectToObject(o, "load");
    json_num(l, "request_rate", pt->load.rate);
    cJSON_AddNumberToObject(l, "burstiness", pt->load.burstiness);
    json_num(l, "max_concurrency", pt->load.max_concurrency > 0 ? pt->load.max_concurrency : NAN);
    cJSON *k = cJSON_AddObjectToObject(o, "knobs");
    json_num(k, "batch_timeout_ms", pt->knobs.batch_timeout_ms >= 0 ? pt->knobs.batch_timeout_ms : NAN);
    json_num(k, "max_batch_seqs", pt->knobs.max_batch_seqs > 0 ? pt->knobs.max_batch_seqs : NAN);
    cJSON_AddNumberToObject(o, "num_requests", st->n_requests);
    cJSON_AddNumberToObject(o, "completed", st->completed);
    cJSON_AddNumberToObject(o, "failed", st->failed);
    json_num(o, "duration_s", st->duration);
    cJSON_AddNumberToObject(o, "total_input_tokens", st->total_input);
    cJSON_AddNumberToObject(o, "total_output_tokens", st->total_output);
    json_num(o, "request_throughput", st->request_throughput);
    json_num(o, "output_throughput", st->output_throughput);
    json_num(o, "total_token_throughput", st->total_token_throughput);
    json_num(o, "goodput", st->goodput);
    for (int i = 0; i < 4; i++) {
        const db_summary *sm = metric(st, i);
        char key[64];
        snprintf(key, sizeof key, "%s_ms", metric_names[i]);
        cJSON *mo = cJSON_AddObjectToObject(o, key);
        cJSON_AddNumberToObject(mo, "count", (double)sm->n);
        json_num(mo, "mean", sm->mean);
        json_num(mo, "median", sm->median);
        json_num(mo, "std", sm->std);
        json_num(mo, "min", sm->min);
        json_num(mo, "max", sm->max);
        for (int j = 0; j < cfg->n_ps; j++) {
            char pk[32];
            snprintf(pk, sizeof pk, "p%g", cfg->ps[j]);
            json_num(mo, pk, sm->pct[j]);
        }
    }
    cJSON *e = cJSON_AddObjectToObject(o, "engine");
    json_num(e, "mean_batch_size", pt->server.mean_batch);
    json_num(e, "device_busy_ratio", pt->server.busy_ratio);
    json_num(e, "preemptions", pt->server.preemptions);
    if (pt->server.have_batch) {
        cJSON *h = cJSON_AddArrayToObject(e, "batch_size_hist");
        for (int b = 0; b < pt->server.batch.n; b++) {
            cJSON *bo = cJSON_CreateObject();
            json_num(bo, "le", pt->server.batch.le[b]);
            cJSON_AddNumberToObject(bo, "steps", pt->server.batch.count[b]);
            cJSON_AddItemToArray(h, bo);
        }
    }
    cJSON *bp = cJSON_AddObjectToObject(o, "by_priority");
    for (int c = 0; c < 2; c++) {
        cJSON *po = cJSON_AddObjectToObject(bp, c ? "batch" : "interactive");
        cJSON_AddNumberToObject(po, "completed", pt->n_prio[c]);
        json_num(po, "ttft_p99_ms", pt->ttft_p99_prio_ms[c]);
        json_num(po, "itl_p99_ms", pt->itl_p99_prio_ms[c]);
    }
    json_num(o, "other_cpu_ratio", pt->other_cpu);
    cJSON_AddBoolToObject(o, "meets_targets", point_meets(cfg, pt));
    return o;
}

static bool write_json(const db_config *cfg, const db_sweep *s, const char *dir) {
    cJSON *root = cJSON_CreateObject();
    cJSON_AddItemToObject(root, "meta", meta_json(cfg, &s->meta));
    cJSON_AddBoolToObject(root, "complete", !s->failed);
    if (s->failed) cJSON_AddStringToObject(root, "error", s->why);
    cJSON *pts = cJSON_AddArrayToObject(root, "points");
    for (int p = 0; p < s->n_points; p++)
        cJSON_AddItemToArray(pts, point_json(cfg, s, p));
    if (s->op >= 0) {
        cJSON *op = cJSON_AddObjectToObject(root, "operating_point");
        const db_point *pt = &s->points[s->op];
        cJSON_AddNumberToObject(op, "point", s->op);
        json_num(op, "request_rate", pt->load.rate);
        json_num(op, "max_concurrency", pt->load.max_concurrency > 0 ? pt->load.max_concurrency : NAN);
        json_num(op, "batch_timeout_ms", pt->knobs.batch_timeout_ms >= 0 ? pt->knobs.batch_timeout_ms : NAN);
        json_num(op, "max_batch_seqs", pt->knobs.max_batch_seqs > 0 ? pt->knobs.max_batch_seqs : NAN);
        json_num(op, "output_throughput", pt->stats.output_throughput);
        json_num(op, "request_throughput", pt->stats.request_throughput);
        json_num(op, "ttft_p99_ms", pt->ttft_p99_ms);
        json_num(op, "itl_p99_ms", pt->itl_p99_ms);
    } else {
        cJSON_AddNullToObject(root, "operating_point");
    }
    char *text = cJSON_Print(root);
    cJSON_Delete(root);
    char path[1200];
    FILE *f = text ? open_in(dir, "results.json", path, sizeof path) : NULL;
    bool ok = f && fputs(text, f) >= 0 && fputc('\n', f) != EOF;
    if (f && fclose(f) != 0) ok = false;
    cJSON_free(text);
    return ok;
}

/* ---- markdown ------------------------------------------------------------ */

static void md_num(FILE *f, const char *fmt, double v) {
    if (isnan(v))
        fprintf(f, " – |");
    else if (isinf(v))
        fprintf(f, " inf |");
    else {
        fputc(' ', f);
        fprintf(f, fmt, v);
        fprintf(f, " |");
    }
}

static void op_sentence(const db_config *cfg, const db_sweep *s, char *buf, size_t size) {
    char t[64] = "", i[64] = "";
    if (cfg->slo_ttft_ms > 0) snprintf(t, sizeof t, "p99 TTFT <= %g ms", cfg->slo_ttft_ms);
    if (cfg->slo_itl_ms > 0) snprintf(i, sizeof i, "p99 ITL <= %g ms", cfg->slo_itl_ms);
    char targets[160];
    snprintf(targets, sizeof targets, "%s%s%s", t, t[0] && i[0] ? " and " : "", i);
    if (!targets[0]) snprintf(targets, sizeof targets, "no latency targets");
    if (s->op < 0) {
        snprintf(buf, size, "operating point (%s): none meets the targets", targets);
        return;
    }
    const db_point *pt = &s->points[s->op];
    char kn[128], ld[128];
    knob_text(&pt->knobs, kn, sizeof kn);
    load_text(&pt->load, ld, sizeof ld);
    snprintf(
        buf, size,
        "operating point (%s): %.1f output tok/s (%.2f req/s) at %s, %s; p99 TTFT %.1f ms, p99 ITL %.1f ms",
        targets, pt->stats.output_throughput, pt->stats.request_throughput, ld, kn, pt->ttft_p99_ms,
        pt->itl_p99_ms);
}

void db_report_print_op(const db_config *cfg, const db_sweep *s) {
    char buf[512];
    op_sentence(cfg, s, buf, sizeof buf);
    printf("%s on %s: %s\n", s->meta.backend, s->meta.device, buf);
    fflush(stdout);
}

static bool write_summary_md(const db_config *cfg, const db_sweep *s, const char *dir, bool plotted) {
    char path[1200];
    FILE *f = open_in(dir, "summary.md", path, sizeof path);
    if (!f) return false;
    const db_meta *m = &s->meta;
    fprintf(f, "# duet-bench: %s on %s\n\n", m->backend, m->device);
    fprintf(
        f,
        "- device: %s (backend %s, driver %s)\n- model: %s\n- mode: %s\n- commit: %s\n- started: %s on %s\n",
        m->device, m->backend, m->driver, m->model, m->mode, m->commit, m->started, m->host);
    char n_req[32], mix[64] = "";
    if (cfg->num_prompts > 0)
        snprintf(n_req, sizeof n_req, "%d requests", cfg->num_prompts);
    else
        snprintf(n_req, sizeof n_req, "requests for %g s", cfg->load.duration_s);
    if (cfg->workload.interactive_share >= 0)
        snprintf(mix, sizeof mix, ", %.0f%% interactive", cfg->workload.interactive_share * 100);
    fprintf(f, "- workload: %s per point, input %d, output %d tokens (range ratio %g)%s%s%s\n", n_req,
            cfg->workload.input_len, cfg->workload.output_len, cfg->workload.range_ratio,
            cfg->workload.dataset_path ? ", dataset " : "",
            cfg->workload.dataset_path ? cfg->workload.dataset_path : "", mix);
    fprintf(f, "- command: `%s`\n\n", m->command);
    if (s->failed) fprintf(f, "**The sweep did not complete:** %s\n\n", s->why);
    char buf[512];
    op_sentence(cfg, s, buf, sizeof buf);
    fprintf(f, "**%c%s**\n\n", buf[0] - 32, buf + 1);
    fprintf(f, "| # | load | knobs | ok/failed | req/s | out tok/s | goodput | TTFT p50 | TTFT p99 | ITL p50 "
               "| ITL p99 "
               "| TPOT p50 | E2EL p99 | mean batch | busy | other CPU | meets |\n");
    fprintf(f, "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (int p = 0; p < s->n_points; p++) {
        const db_point *pt = &s->points[p];
        const db_run_stats *st = &pt->stats;
        char kn[128], ld[128];
        knob_text(&pt->knobs, kn, sizeof kn);
        load_text(&pt->load, ld, sizeof ld);
        fprintf(f, "| %d%s | %s | %s | %d/%d |", p, p == s->op ? " (op)" : "", ld, kn, st->completed,
                st->failed);
        md_num(f, "%.2f", st->request_throughput);
        md_num(f, "%.1f", st->output_throughput);
        md_num(f, "%.2f", st->goodput);
        md_num(f, "%.1f", pt->ttft_p50_ms);
        md_num(f, "%.1f", pt->ttft_p99_ms);
        md_num(f, "%.1f", pt->itl_p50_ms);
        md_num(f, "%.1f", pt->itl_p99_ms);
        md_num(f, "%.1f", db_stats_pct(st, &st->tpot, 50));
        md_num(f, "%.1f", db_stats_pct(st, &st->e2el, 99));
        md_num(f, "%.2f", pt->server.mean_batch);
        md_num(f, "%.0f%%", pt->server.busy_ratio * 100);
        md_num(f, "%.0f%%", pt->other_cpu * 100);
        fprintf(f, " %s |\n", point_meets(cfg, pt) ? "yes" : "no");
    }
    fprintf(
        f,
        "\nTimes in ms. TTFT and ITL percentiles are numpy-'linear' over all requests of a point (ITL: over "
        "every gap). Mean batch and busy come from the engine's /metrics, diffed over the run. Other CPU: "
        "the share "
        "of the machine's CPU time used by other processes during the point (in HTTP mode, the server too); "
        "when it is high the latencies are noisy.\n");
    if (plotted)
        fprintf(
            f, "\n![latency against throughput](latency_throughput.png)\n\n![batch sizes](batch_size.png)\n");
    else
        fprintf(f, "\nNo plots: gnuplot was not available or failed.\n");
    return fclose(f) == 0;
}

/* ---- gnuplot ---------------------------------------------------------------- */

const char *db_gnuplot_terminal(void) {
    static int checked;
    static const char *term;
    if (checked) return term;
    checked = 1;
    FILE *f = popen("gnuplot -e 'set terminal' 2>&1 < /dev/null", "r");
    if (!f) return NULL;
    char line[256];
    bool cairo = false, png = false;
    while (fgets(line, sizeof line, f)) {
        char name[64];
        if (sscanf(line, " %63s", name) != 1) continue;
        if (!strcmp(name, "pngcairo")) cairo = true;
        if (!strcmp(name, "png")) png = true;
    }
    int rc = pclose(f);
    if (rc != 0 && !cairo && !png) return NULL;
    term = cairo ? "pngcairo" : png ? "png" : NULL;
    return term;
}

bool db_gnuplot(const char *script_path, char *err, size_t esize) {
    if (!db_gnuplot_terminal()) {
        snprintf(err, esize,
                 "gnuplot not found (or it has neither the pngcairo nor the png terminal): no plots; "
                 "install gnuplot (e.g. apt-get install gnuplot-nox)");
        return false;
    }
    char cmd[1400];
    snprintf(cmd, sizeof cmd, "gnuplot '%s' 2>&1", script_path);
    FILE *f = popen(cmd, "r");
    if (!f) {
        snprintf(err, esize, "cannot run gnuplot: %s", strerror(errno));
        return false;
    }
    char out[512] = "", line[256];
    while (fgets(line, sizeof line, f))
        if (strlen(out) + strlen(line) < sizeof out) strcat(out, line);
    int rc = pclose(f);
    if (rc != 0) {
        snprintf(err, esize, "gnuplot failed on %s: %s", script_path, out);
        return false;
    }
    return true;
}

void db_gp_header(FILE *f, const char *out_png, int w, int h) {
    const char *t = db_gnuplot_terminal();
    if (t && !strcmp(t, "pngcairo"))
        fprintf(f, "set terminal pngcairo size %d,%d font 'sans,10'\n", w, h);
    else
        fprintf(f, "set terminal png size %d,%d\n", w, h);
    fprintf(f, "set output '%s'\nset grid\nset key outside right top\n", out_png);
}

/* Escapes a title for a single-quoted gnuplot string. */
static void gp_title(char *out, size_t size, const char *in) {
    size_t o = 0;
    for (const char *p = in; *p && o + 3 < size; p++) {
        if (*p == '\'') out[o++] = '\'';
        if (*p == '_' || *p == '@' || *p == '^' || *p == '&') out[o++] = '\\';
        out[o++] = *p;
    }
    out[o] = 0;
}

/* The data file: one block per knob setting (gnuplot `index`), points
 * in load order, columns: throughput, TTFT p50, TTFT p99, ITL p50,
 * ITL p99, the point number. */
static int write_plot_data(const db_sweep *s, const char *path, char titles[][128], int max_blocks) {
    FILE *f = fopen(path, "w");
    if (!f) return -1;
    int n_blocks = 0;
    bool *used = calloc((size_t)s->n_points + 1, 1);
    for (int p = 0; used && p < s->n_points && n_blocks < max_blocks; p++) {
        if (used[p]) continue;
        const db_knobs *k = &s->points[p].knobs;
        int idx[DB_MAX_SWEEP * 4], n = 0;
        for (int q = p; q < s->n_points; q++) {
            const db_knobs *kq = &s->points[q].knobs;
            if (!used[q] && kq->batch_timeout_ms == k->batch_timeout_ms &&
                kq->max_batch_seqs == k->max_batch_seqs && n < (int)(sizeof idx / sizeof *idx))
                idx[n++] = q, used[q] = true;
        }
        /* In sweep (offered-load) order: past saturation throughput stops
         * growing while latency climbs, and the line shows it. */
        fprintf(f, "# %s\n", "throughput ttft_p50 ttft_p99 itl_p50 itl_p99 point");
        for (int i = 0; i < n; i++) {
            const db_point *pt = &s->points[idx[i]];
            if (isnan(pt->stats.output_throughput)) continue;
            fprintf(f, "%.6g %.6g %.6g %.6g %.6g %d\n", pt->stats.output_throughput, pt->ttft_p50_ms,
                    pt->ttft_p99_ms, pt->itl_p50_ms, pt->itl_p99_ms, idx[i]);
        }
        fprintf(f, "\n\n");
        knob_text(k, titles[n_blocks], 128);
        n_blocks++;
    }
    free(used);
    fclose(f);
    return n_blocks;
}

static bool write_plots(const db_config *cfg, const db_sweep *s, const char *dir, char *err, size_t esize) {
    if (!db_gnuplot_terminal()) return db_gnuplot("", err, esize);
    char dat[1200], gp[1200], png[1200];
    snprintf(dat, sizeof dat, "%s/latency_throughput.dat", dir);
    char titles[16][128];
    int nb = write_plot_data(s, dat, titles, 16);
    if (nb < 0) {
        snprintf(err, esize, "cannot write %.600s", dat);
        return false;
    }
    snprintf(gp, sizeof gp, "%s/latency_throughput.gp", dir);
    snprintf(png, sizeof png, "%s/latency_throughput.png", dir);
    FILE *f = fopen(gp, "w");
    if (!f) {
        snprintf(err, esize, "cannot write %.600s", gp);
        return false;
    }
    char dev[300];
    gp_title(dev, sizeof dev, s->meta.device);
    db_gp_header(f, png, 1400, 620 + 14 * nb);
    fprintf(f,
            "set multiplot layout 1,2 title '%s (%s): latency against output throughput "
            "(p50 dashed, p99 solid; points in order of offered load)'\n",
            dev, s->meta.backend);
    fprintf(f, "set xlabel 'output tokens/s'\nset logscale y\nset key outside below font ',8' maxcols 1\n");
    fprintf(f, "set datafile missing 'nan'\n");
    const char *what[2] = {"TTFT", "ITL"};
    const int col50[2] = {2, 4}, col99[2] = {3, 5};
    const double slo[2] = {cfg->slo_ttft_ms, cfg->slo_itl_ms};
    for (int w = 0; w < 2; w++) {
        fprintf(f, "set title '%s'\nset ylabel '%s (ms)'\n", what[w], what[w]);
        fprintf(f, "unset arrow\nunset label\n");
        if (slo[w] > 0)
            fprintf(f,
                    "set arrow from graph 0, first %g to graph 1, first %g nohead dt 3 lc rgb 'red'\n"
                    "set label 'target %g ms' at graph 0.02, first %g offset 0,0.6 tc rgb 'red'\n",
                    slo[w], slo[w], slo[w], slo[w] * 1.0);
        if (s->op >= 0) {
            const db_point *op = &s->points[s->op];
            double y = w == 0 ? op->ttft_p99_ms : op->itl_p99_ms;
            if (!isnan(y))
                fprintf(f,
                        "set label 'operating point' at first %g, first %g right point pt 6 ps 3 lc rgb "
                        "'black' offset -1,1\n",
                        op->stats.output_throughput, y);
        }
        fprintf(f, "plot ");
        for (int b = 0; b < nb; b++) {
            char t[300];
            gp_title(t, sizeof t, titles[b]);
            fprintf(f,
                    "%s'%s' index %d using 1:%d with linespoints lc %d dt 2 pt 7 notitle, "
                    "'%s' index %d using 1:%d with linespoints lc %d dt 1 pt 5 title '%s'",
                    b ? ", " : "", dat, b, col50[w], b + 1, dat, b, col99[w], b + 1, t);
        }
        fprintf(f, "\n");
    }
    fprintf(f, "unset multiplot\n");
    fclose(f);
    if (!db_gnuplot(gp, err, esize)) return false;

    /* Batch sizes: one stacked bar per point, its engine steps split by
     * batch-size bucket. Only buckets some point used get a column. */
    snprintf(dat, sizeof dat, "%s/batch_size.dat", dir);
    f = fopen(dat, "w");
    if (!f) {
        snprintf(err, esize, "cannot write %.600s", dat);
        return false;
    }
    double les[DB_MAX_BUCKETS];
    int n_le = 0, n_rows = 0;
    for (int p = 0; p < s->n_points; p++) {
        const db_server_stats *sv = &s->points[p].server;
        for (int k = 0; sv->have_batch && k < sv->batch.n; k++) {
            if (sv->batch.count[k] <= 0) continue;
            int j = 0;
            while (j < n_le && les[j] < sv->batch.le[k])
                j++;
            if (j < n_le && les[j] == sv->batch.le[k]) continue;
            if (n_le == DB_MAX_BUCKETS) continue;
            memmove(&les[j + 1], &les[j], (size_t)(n_le - j) * sizeof *les);
            les[j] = sv->batch.le[k];
            n_le++;
        }
    }
    fprintf(f, "# point label, then the share of steps with batch size in each bucket (upper bounds:");
    for (int j = 0; j < n_le; j++)
        fprintf(f, " %g", les[j]);
    fprintf(f, "), then the mean batch size\n");
    for (int p = 0; p < s->n_points; p++) {
        const db_point *pt = &s->points[p];
        const db_server_stats *sv = &pt->server;
        if (!sv->have_batch || sv->batch.total <= 0) continue;
        char r[32];
        db_fmt_num(r, sizeof r, pt->load.rate);
        char lab[96];
        if (pt->load.max_concurrency > 0)
            snprintf(lab, sizeof lab, "#%d c%d", p, pt->load.max_concurrency);
        else
            snprintf(lab, sizeof lab, "#%d r%s", p, r);
        if (pt->knobs.max_batch_seqs > 0)
            snprintf(lab + strlen(lab), sizeof lab - strlen(lab), " s%d", pt->knobs.max_batch_seqs);
        if (pt->knobs.batch_timeout_ms >= 0)
            snprintf(lab + strlen(lab), sizeof lab - strlen(lab), " t%g", pt->knobs.batch_timeout_ms);
        fprintf(f, "\"%s\"", lab);
        for (int j = 0; j < n_le; j++) {
            double c = 0;
            for (int k = 0; k < sv->batch.n; k++)
                if (sv->batch.le[k] == les[j]) c = sv->batch.count[k];
            fprintf(f, " %.6g", c / sv->batch.total);
        }
        fprintf(f, " %.6g\n", sv->mean_batch);
        n_rows++;
    }
    fclose(f);
    snprintf(gp, sizeof gp, "%s/batch_size.gp", dir);
    snprintf(png, sizeof png, "%s/batch_size.png", dir);
    f = fopen(gp, "w");
    if (!f) {
        snprintf(err, esize, "cannot write %.600s", gp);
        return false;
    }
    int width = 500 + 28 * n_rows;
    db_gp_header(f, png, width < 900 ? 900 : width, 620);
    fprintf(
        f,
        "set title '%s (%s): sequences per engine step, by sweep point'\n"
        "set xlabel 'point: r = request rate, c = concurrency, s = max\\_batch\\_seqs, t = batch\\_timeout "
        "(ms)'\n"
        "set ylabel 'share of engine steps'\nset yrange [0:1]\nset y2label 'mean batch size'\n"
        "set y2range [0:*]\nset y2tics\nset ytics nomirror\nset xtics rotate by -60 font ',8'\n"
        "set style data histograms\nset style histogram rowstacked\nset style fill solid 0.9 border -1\n"
        "set boxwidth 0.75\nset key outside right title 'batch size'\n",
        dev, s->meta.backend);
    if (n_rows == 0 || n_le == 0) {
        fprintf(
            f, "set label 'no batch-size histogram in /metrics' at graph 0.3, graph 0.5\nplot 1/0 notitle\n");
    } else {
        fprintf(f, "plot ");
        for (int j = 0; j < n_le; j++) {
            /* The bucket's own lower bound: the previous bound of the full
             * histogram (every point shares the bounds). */
            double lo = 0;
            for (int p = 0; p < s->n_points; p++) {
                const db_hist *h = &s->points[p].server.batch;
                if (!s->points[p].server.have_batch) continue;
                for (int k = 1; k < h->n; k++)
                    if (h->le[k] == les[j]) lo = h->le[k - 1];
                break;
            }
            char t[64];
            if (isinf(les[j]))
                snprintf(t, sizeof t, "> %g", lo);
            else if (lo + 1 >= les[j])
                snprintf(t, sizeof t, "%g", les[j]);
            else
                snprintf(t, sizeof t, "%g-%g", lo + 1, les[j]);
            fprintf(f, "%s'%s' using %d%s title '%s'", j ? ", " : "", dat, j + 2, j ? "" : ":xtic(1)", t);
        }
        fprintf(f, ", '%s' using 0:%d axes x1y2 with linespoints lc rgb 'black' lw 2 pt 7 title 'mean'\n",
                dat, n_le + 2);
    }
    fclose(f);
    return db_gnuplot(gp, err, esize);
}

bool db_report_write(const db_config *cfg, const db_sweep *s, const char *dir) {
    if (!db_mkdirs(dir)) {
        fprintf(stderr, "duet-bench: cannot create %s: %s\n", dir, strerror(errno));
        return false;
    }
    /* Every file is attempted even when one fails. */
    bool ok = write_points_csv(cfg, s, dir);
    if (cfg->save_requests) ok = write_requests_csv(s, dir) && ok;
    ok = write_batch_csv(s, dir) && ok;
    ok = write_json(cfg, s, dir) && ok;
    bool plotted = false;
    if (cfg->plots && s->n_points > 0) {
        char err[700] = "";
        plotted = write_plots(cfg, s, dir, err, sizeof err);
        if (!plotted) fprintf(stderr, "duet-bench: %s\n", err);
    }
    ok = write_summary_md(cfg, s, dir, plotted) && ok;
    ok = db_timeline_write(cfg, s, dir) && ok;
    return ok;
}

/* ---- --all-devices ------------------------------------------------------------ */

/* The trade-off frontier of one device: the points no other point beats
 * on both throughput and p99 latency (w = 0: TTFT, 1: ITL), by
 * throughput, as "throughput latency" lines. */
static void write_frontier(FILE *f, const db_point *pts, int n, int w) {
    int *idx = malloc((size_t)(n + 1) * sizeof *idx), m = 0;
    if (!idx) return;
    for (int p = 0; p < n; p++) {
        double y = w ? pts[p].itl_p99_ms : pts[p].ttft_p99_ms;
        if (!isnan(pts[p].stats.output_throughput) && !isnan(y)) idx[m++] = p;
    }
    /* By throughput, descending; keep a point when its latency beats every
     * point of higher throughput. */
    for (int a = 1; a < m; a++)
        for (int b = a;
             b > 0 && pts[idx[b]].stats.output_throughput > pts[idx[b - 1]].stats.output_throughput; b--) {
            int t = idx[b];
            idx[b] = idx[b - 1];
            idx[b - 1] = t;
        }
    int k = 0;
    double best = INFINITY;
    for (int a = 0; a < m; a++) {
        double y = w ? pts[idx[a]].itl_p99_ms : pts[idx[a]].ttft_p99_ms;
        if (y < best) best = y, idx[k++] = idx[a];
    }
    for (int a = k - 1; a >= 0; a--)
        fprintf(f, "%.6g %.6g\n", pts[idx[a]].stats.output_throughput,
                w ? pts[idx[a]].itl_p99_ms : pts[idx[a]].ttft_p99_ms);
    free(idx);
}

bool db_report_compare(const db_config *cfg, const db_sweep *sw, int n, const char *dir) {
    if (!db_mkdirs(dir)) return false;
    char path[1200];
    FILE *f = open_in(dir, "comparison.md", path, sizeof path);
    if (!f) return false;
    fprintf(f, "# duet-bench: the same load on every target\n\n");
    /* Over HTTP each target names its own model (GET /v1/models). */
    fprintf(f, "- model:");
    if (cfg->model_path)
        fprintf(f, " %s", cfg->model_path);
    else
        for (int i = 0; i < n; i++)
            fprintf(f, "%s %s: %s", i ? ";" : "", sw[i].meta.device,
                    sw[i].meta.model[0] ? sw[i].meta.model : "?");
    fprintf(f, "\n- commit: %s\n- started: %s on %s\n- command: `%s`\n", n ? sw[0].meta.commit : "",
            n ? sw[0].meta.started : "", n ? sw[0].meta.host : "", n ? sw[0].meta.command : "");
    fprintf(f, "- targets: p99 TTFT <= %g ms, p99 ITL <= %g ms\n\n", cfg->slo_ttft_ms, cfg->slo_itl_ms);
    /* --per-instance: the instances of one server, named as it names them. */
    bool inst = n > 0 && sw[0].meta.instance[0];
    if (inst)
        fprintf(f,
                "| instance | backend | device | tier | status | best out tok/s | operating point | op out "
                "tok/s | op req/s | op TTFT p99 | op ITL p99 | results |\n"
                "|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    else
        fprintf(
            f,
            "| backend | device | driver | status | best out tok/s | operating point | op out tok/s | op "
            "req/s | op TTFT p99 | op ITL p99 | results |\n|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (int i = 0; i < n; i++) {
        const db_sweep *s = &sw[i];
        double best = NAN;
        for (int p = 0; p < s->n_points; p++)
            if (isnan(best) || s->points[p].stats.output_throughput > best)
                best = s->points[p].stats.output_throughput;
        char rel[256];
        const char *slash = strrchr(s->dir, '/');
        snprintf(rel, sizeof rel, "%s", slash ? slash + 1 : s->dir);
        if (inst)
            fprintf(f, "| %s | %s | %s | %s |", s->meta.instance, s->meta.backend, s->meta.device,
                    s->meta.tier);
        else
            fprintf(f, "| %s | %s | %s |", s->meta.backend, s->meta.device, s->meta.driver);
        fprintf(f, " %s |", s->failed ? (s->n_points ? "incomplete" : "unavailable") : "ok");
        md_num(f, "%.1f", best);
        if (s->op >= 0) {
            const db_point *pt = &s->points[s->op];
            char kn[128], ld[128];
            knob_text(&pt->knobs, kn, sizeof kn);
            load_text(&pt->load, ld, sizeof ld);
            fprintf(f, " %s, %s |", ld, kn);
            md_num(f, "%.1f", pt->stats.output_throughput);
            md_num(f, "%.2f", pt->stats.request_throughput);
            md_num(f, "%.1f", pt->ttft_p99_ms);
            md_num(f, "%.1f", pt->itl_p99_ms);
        } else {
            fprintf(f, " %s | – | – | – | – |", s->n_points ? "none meets the targets" : "–");
        }
        if (s->n_points)
            fprintf(f, " [%s](%s/summary.md) |\n", rel, rel);
        else
            fprintf(f, " – |\n");
    }
    for (int i = 0; i < n; i++)
        if (sw[i].failed) fprintf(f, "\n- %s/%s: %s", sw[i].meta.backend, sw[i].meta.device, sw[i].why);
    /* Every load point, the targets side by side. */
    int most = 0;
    for (int i = 0; i < n; i++)
        if (sw[i].n_points > most) most = sw[i].n_points;
    fprintf(f, "\n\n## Every point\n\n| point | load | target | completed | failed | out tok/s | TTFT p50 | "
               "TTFT p90 | TTFT p99 | ITL p50 | ITL p90 | ITL p99 |\n"
               "|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (int p = 0; p < most; p++)
        for (int i = 0; i < n; i++) {
            if (p >= sw[i].n_points) continue;
            const db_point *pt = &sw[i].points[p];
            char ld[128], who[400];
            load_text(&pt->load, ld, sizeof ld);
            if (inst)
                snprintf(who, sizeof who, "%s: %s/%s/%s", sw[i].meta.instance, sw[i].meta.backend,
                         sw[i].meta.device, sw[i].meta.tier);
            else
                snprintf(who, sizeof who, "%s/%s", sw[i].meta.backend, sw[i].meta.device);
            fprintf(f, "| %d | %s | %s | %d | %d |", p, ld, who, pt->stats.completed, pt->stats.failed);
            md_num(f, "%.1f", pt->stats.output_throughput);
            const db_summary *m[2] = {&pt->stats.ttft, &pt->stats.itl};
            for (int k = 0; k < 2; k++)
                for (int q = 0; q < 3; q++)
                    md_num(f, "%.1f", db_stats_pct(&pt->stats, m[k], q == 0 ? 50 : q == 1 ? 90 : 99));
            fputc('\n', f);
        }
    fprintf(f, "\nTimes in ms. Points alternate between the targets (--peer, --per-instance) or follow each "
               "other (--all-devices); see each target's summary.md for the machine's load.\n");
    fprintf(f, "\n![p99 latency against throughput on every device](comparison.png)\n");
    fclose(f);

    /* comparison.csv: every point of every device, one table. */
    f = open_in(dir, "comparison.csv", path, sizeof path);
    if (!f) return false;
    fprintf(f, "backend,device,driver,instance,tier,point,request_rate,max_concurrency,batch_timeout_ms,max_"
               "batch_seqs,completed,"
               "failed,output_throughput,request_throughput,ttft_p50_ms,ttft_p99_ms,itl_p50_ms,itl_p99_ms,"
               "mean_batch_size,device_busy_ratio,operating_point\n");
    for (int i = 0; i < n; i++)
        for (int p = 0; p < sw[i].n_points; p++) {
            const db_point *pt = &sw[i].points[p];
            csv_str(f, sw[i].meta.backend), fputc(',', f), csv_str(f, sw[i].meta.device), fputc(',', f);
            csv_str(f, sw[i].meta.driver), fputc(',', f), csv_str(f, sw[i].meta.instance), fputc(',', f);
            csv_str(f, sw[i].meta.tier);
            fprintf(f, ",%d,", p);
            csv_num(f, pt->load.rate), fputc(',', f);
            if (pt->load.max_concurrency > 0) fprintf(f, "%d", pt->load.max_concurrency);
            fputc(',', f);
            if (pt->knobs.batch_timeout_ms >= 0) csv_num(f, pt->knobs.batch_timeout_ms);
            fputc(',', f);
            if (pt->knobs.max_batch_seqs > 0) fprintf(f, "%d", pt->knobs.max_batch_seqs);
            fprintf(f, ",%d,%d,", pt->stats.completed, pt->stats.failed);
            csv_num(f, pt->stats.output_throughput), fputc(',', f), csv_num(f, pt->stats.request_throughput);
            fputc(',', f), csv_num(f, pt->ttft_p50_ms), fputc(',', f), csv_num(f, pt->ttft_p99_ms);
            fputc(',', f), csv_num(f, pt->itl_p50_ms), fputc(',', f), csv_num(f, pt->itl_p99_ms);
            fputc(',', f), csv_num(f, pt->server.mean_batch), fputc(',', f),
                csv_num(f, pt->server.busy_ratio);
            fprintf(f, ",%d\n", p == sw[i].op);
        }
    fclose(f);

    if (!cfg->plots) return true;
    char err[700] = "";
    if (!db_gnuplot_terminal()) {
        db_gnuplot("", err, sizeof err);
        fprintf(stderr, "duet-bench: %s\n", err);
        return true;
    }
    char dat[1200], gp[1200], png[1200];
    snprintf(dat, sizeof dat, "%s/comparison.dat", dir);
    snprintf(gp, sizeof gp, "%s/comparison.gp", dir);
    snprintf(png, sizeof png, "%s/comparison.png", dir);
    FILE *d = fopen(dat, "w");
    FILE *g = fopen(gp, "w");
    if (!d || !g) {
        if (d) fclose(d);
        if (g) fclose(g);
        return false;
    }
    db_gp_header(g, png, 1400, 560);
    fprintf(
        g, "set multiplot layout 1,2 title 'p99 latency against output throughput, every device (dots: every "
           "sweep point; lines: the best latency reached at each throughput)'\n"
           "set xlabel 'output tokens/s'\nset logscale xy\nset key bottom right inside font ',8'\n");
    int blocks = 0;
    char names[32][300];
    for (int i = 0; i < n && blocks < 32; i++) {
        if (!sw[i].n_points) continue;
        /* Three blocks per device: every point (throughput, p99 TTFT, p99
         * ITL), then the TTFT frontier and the ITL frontier. */
        int m = sw[i].n_points < 1024 ? sw[i].n_points : 1024;
        for (int a = 0; a < m; a++) {
            const db_point *pt = &sw[i].points[a];
            if (!isnan(pt->stats.output_throughput))
                fprintf(d, "%.6g %.6g %.6g\n", pt->stats.output_throughput, pt->ttft_p99_ms, pt->itl_p99_ms);
        }
        fprintf(d, "\n\n");
        for (int w = 0; w < 2; w++) {
            write_frontier(d, sw[i].points, m, w);
            fprintf(d, "\n\n");
        }
        char both[400];
        if (sw[i].meta.instance[0])
            snprintf(both, sizeof both, "%s: %s, %s", sw[i].meta.instance, sw[i].meta.backend,
                     sw[i].meta.tier);
        else
            snprintf(both, sizeof both, "%s: %s", sw[i].meta.backend, sw[i].meta.device);
        gp_title(names[blocks], sizeof names[blocks], both);
        blocks++;
    }
    fclose(d);
    for (int w = 0; w < 2; w++) {
        double slo = w == 0 ? cfg->slo_ttft_ms : cfg->slo_itl_ms;
        fprintf(g, "set title 'p99 %s'\nset ylabel 'p99 %s (ms)'\nunset arrow\n", w ? "ITL" : "TTFT",
                w ? "ITL" : "TTFT");
        if (slo > 0)
            fprintf(g, "set arrow from graph 0, first %g to graph 1, first %g nohead dt 3 lc rgb 'red'\n",
                    slo, slo);
        if (blocks == 0) {
            fprintf(g, "plot 1/0 notitle\n");
            continue;
        }
        /* Faint dots: every point; line: the best latency at each throughput. */
        fprintf(g, "plot ");
        for (int b = 0; b < blocks; b++)
            fprintf(g,
                    "%s'%s' index %d using 1:%d with points pt 7 ps 0.6 lc %d notitle, "
                    "'%s' index %d using 1:2 with linespoints pt 7 lw 2 lc %d title '%s'",
                    b ? ", " : "", dat, 3 * b, 2 + w, b + 1, dat, 3 * b + 1 + w, b + 1, names[b]);
        fprintf(g, "\n");
    }
    fprintf(g, "unset multiplot\n");
    fclose(g);
    if (!db_gnuplot(gp, err, sizeof err)) fprintf(stderr, "duet-bench: %s\n", err);
    return true;
}
