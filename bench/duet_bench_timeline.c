/* duet_bench_timeline.c — what a run did over time: the /metrics samples
 * taken during it, and --timeline's per-window table and plot (offered and
 * served load, p99 latencies per class, the controller's knobs). The load
 * over time itself (--rate-profile) is in duet_bench_load.c. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "duet_bench.h"

/* ---- /metrics samples ------------------------------------------------------- */

bool db_scrapes_add(db_scrapes *sc, double t, const char *text) {
    if (sc->n == sc->cap) {
        int cap = sc->cap ? 2 * sc->cap : 256;
        db_scrape *s = realloc(sc->s, (size_t)cap * sizeof *s);
        if (!s) return false;
        sc->s = s, sc->cap = cap;
    }
    db_scrape *o = &sc->s[sc->n++];
    *o = (db_scrape){t, NAN, NAN, NAN, NAN, NAN, NAN};
    db_prom pm = {0};
    int bad;
    if (text && db_prom_parse(text, &pm, &bad)) {
        o->max_batch_seqs = db_prom_sum(&pm, "duet_max_batch_seqs");
        o->batch_timeout_ms = db_prom_sum(&pm, "duet_batch_timeout_seconds") * 1e3;
        o->max_batch_tokens = db_prom_sum(&pm, "duet_max_batch_tokens");
        o->budget_share = db_prom_sum(&pm, "duet_step_budget_share");
        o->waiting = db_prom_sum(&pm, "vllm:num_requests_waiting");
        o->running = db_prom_sum(&pm, "vllm:num_requests_running");
    }
    db_prom_free(&pm);
    return true;
}

void db_scrapes_free(db_scrapes *sc) {
    free(sc->s);
    sc->s = NULL;
    sc->n = sc->cap = 0;
}

/* ---- the timeline ------------------------------------------------------------ */

/* Values falling in each window, grown as they come. */
typedef struct vals {
    double *v;
    int n, cap;
} vals;

static void vals_add(vals *x, double v) {
    if (x->n == x->cap) {
        int cap = x->cap ? 2 * x->cap : 64;
        double *nv = realloc(x->v, (size_t)cap * sizeof *nv);
        if (!nv) return; /* a sample short, not a crash */
        x->v = nv, x->cap = cap;
    }
    x->v[x->n++] = v;
}

static double vals_p99(const vals *x) {
    const double p = 99;
    db_summary sm;
    return db_summarize(x->v, (size_t)x->n, &p, 1, &sm) ? sm.pct[0] : NAN;
}

typedef struct window {
    int arrived[2], completed, failed;
    double tokens;
    vals ttft[2], itl[2];
    const db_scrape *knobs; /* the last sample in the window */
} window;

static void csv_cell(FILE *f, double v) {
    if (isfinite(v))
        fprintf(f, ",%.6g", v);
    else
        fprintf(f, ",");
}

static bool write_one(const db_config *cfg, const db_sweep *s, int ip, const char *dir) {
    const db_point *pt = &s->points[ip];
    double w = cfg->timeline_s, end = pt->stats.duration;
    const db_profile *prof = pt->load.profile;
    if (prof && db_profile_end(prof) > end) end = db_profile_end(prof);
    int nw = (int)ceil(end / w);
    if (nw < 1) nw = 1;
    if (nw > 100000) nw = 100000;
    window *win = calloc((size_t)nw, sizeof *win);
    if (!win) return false;
#define WIN(t) (&win[(int)fmin(fmax(floor((t) / w), 0), nw - 1)])
    for (int i = 0; i < pt->n_sent; i++) {
        const db_result *r = &pt->results[i];
        int c = r->priority == DUET_PRIORITY_BATCH ? 1 : 0;
        window *a = WIN(r->t_sent);
        a->arrived[c]++;
        if (!r->ok) {
            a->failed++;
            continue;
        }
        WIN(r->t_sent + r->e2el)->completed++;
        if (isnan(r->ttft)) continue;
        vals_add(&a->ttft[c], r->ttft * 1e3);
        /* A token at the first token's time and at the end of each gap;
         * tokens that came in one chunk with another land at the end. */
        double t = r->t_sent + r->ttft;
        WIN(t)->tokens += 1;
        for (int g = 0; g < r->n_itl; g++) {
            t += r->itl[g];
            window *x = WIN(t);
            x->tokens += 1;
            vals_add(&x->itl[c], r->itl[g] * 1e3);
        }
        int rest = r->output_tokens - 1 - r->n_itl;
        if (rest > 0) WIN(r->t_sent + r->e2el)->tokens += rest;
    }
    for (int k = 0; k < pt->scrapes.n; k++)
        WIN(pt->scrapes.s[k].t)->knobs = &pt->scrapes.s[k];
#undef WIN

    char name[64], path[1200];
    if (s->n_points > 1)
        snprintf(name, sizeof name, "timeline-%d", ip + 1);
    else
        snprintf(name, sizeof name, "timeline");
    snprintf(path, sizeof path, "%s/%s.csv", dir, name);
    FILE *f = fopen(path, "w");
    bool ok = f != NULL;
    if (f) {
        fprintf(f,
                "t_start_s,t_end_s,profile_rate,arrival_rate,served_rate,output_tokens_per_s,"
                "interactive_arrivals,batch_arrivals,failed,interactive_ttft_p99_ms,interactive_itl_p99_ms,"
                "batch_ttft_p99_ms,batch_itl_p99_ms,max_batch_seqs,batch_timeout_ms,budget_share,"
                "max_batch_tokens,waiting,running\n");
        for (int k = 0; k < nw; k++) {
            window *x = &win[k];
            double t0 = k * w, t1 = (k + 1) * w;
            fprintf(f, "%.6g,%.6g", t0, t1);
            csv_cell(f, prof ? (db_profile_cumulative(prof, t1) - db_profile_cumulative(prof, t0)) / w : NAN);
            csv_cell(f, (x->arrived[0] + x->arrived[1]) / w);
            csv_cell(f, x->completed / w);
            csv_cell(f, x->tokens / w);
            fprintf(f, ",%d,%d,%d", x->arrived[0], x->arrived[1], x->failed);
            csv_cell(f, vals_p99(&x->ttft[0]));
            csv_cell(f, vals_p99(&x->itl[0]));
            csv_cell(f, vals_p99(&x->ttft[1]));
            csv_cell(f, vals_p99(&x->itl[1]));
            const db_scrape *kn = x->knobs;
            csv_cell(f, kn ? kn->max_batch_seqs : NAN);
            csv_cell(f, kn ? kn->batch_timeout_ms : NAN);
            csv_cell(f, kn ? kn->budget_share : NAN);
            csv_cell(f, kn ? kn->max_batch_tokens : NAN);
            csv_cell(f, kn ? kn->waiting : NAN);
            csv_cell(f, kn ? kn->running : NAN);
            fprintf(f, "\n");
        }
        ok = fclose(f) == 0;
    }
    if (!ok) fprintf(stderr, "duet-bench: cannot write %s\n", path);
    for (int k = 0; k < nw; k++)
        for (int c = 0; c < 2; c++)
            free(win[k].ttft[c].v), free(win[k].itl[c].v);
    free(win);
    if (!ok || !cfg->plots || !db_gnuplot_terminal()) return ok;

    /* Three panels on one time axis: load, latency, knobs. */
    char gp[1200], png[1200], err[800];
    snprintf(gp, sizeof gp, "%s/%s.gp", dir, name);
    snprintf(png, sizeof png, "%s/%s.png", dir, name);
    if (!(f = fopen(gp, "w"))) return false;
    db_gp_header(f, png, 1400, 1100);
    fprintf(f,
            "set datafile separator ','\n"
            "set key autotitle columnhead\n"
            "set multiplot layout 3,1 title 'duet-bench timeline (%g s windows)'\n"
            "set xlabel 'time (s)'\n"
            "set ylabel 'requests/s'\nset y2label 'output tokens/s'\nset y2tics\nset ytics nomirror\n"
            "plot '%s/%s.csv' using 1:3 with lines lw 2 title 'offered (profile)', '' using 1:4 with steps "
            "title 'arrived', '' using 1:5 with steps title 'served', '' using 1:6 axes x1y2 with steps "
            "title 'output tokens/s'\n"
            "unset y2tics\nunset y2label\nset ytics mirror\n"
            "set ylabel 'p99 (ms)'\nset logscale y\n",
            w, dir, name);
    /* The targets as dashed lines (ITL, then TTFT). */
    const double slo[2] = {cfg->slo_itl_ms, cfg->slo_ttft_ms};
    for (int k = 0; k < 2; k++)
        if (slo[k] > 0)
            fprintf(f, "set arrow from graph 0, first %g to graph 1, first %g nohead dt %d\n", slo[k], slo[k],
                    2 + k);
    fprintf(f,
            "plot '%s/%s.csv' using 1:11 with linespoints title 'interactive ITL p99', '' using 1:13 with "
            "linespoints title 'batch ITL p99', '' using 1:10 with linespoints title 'interactive TTFT p99'\n"
            "unset arrow\nunset logscale y\n"
            /* Seqs and the timeout (ms) share a scale from 0; the share (0..1) has its own, so neither
               sits flat on a panel edge. */
            "set ylabel 'max batch seqs / batch timeout (ms)'\nset yrange [0:*]\nset offsets 0, 0, graph "
            "0.15, 0\n"
            "set y2label 'step budget share'\nset y2range [0:1.1]\nset y2tics\nset ytics nomirror\n"
            "plot '%s/%s.csv' using 1:14 with steps lw 2 title 'max batch seqs', '' using 1:15 with steps "
            "title 'batch timeout (ms)', '' using 1:16 axes x1y2 with steps title 'step budget share'\n"
            "unset multiplot\n",
            dir, name, dir, name);
    fclose(f);
    if (!db_gnuplot(gp, err, sizeof err)) {
        fprintf(stderr, "duet-bench: %s\n", err);
        return false;
    }
    return true;
}

bool db_timeline_write(const db_config *cfg, const db_sweep *s, const char *dir) {
    if (cfg->timeline_s <= 0) return true;
    bool ok = true;
    for (int p = 0; p < s->n_points; p++)
        ok = write_one(cfg, s, p, dir) && ok;
    return ok;
}
