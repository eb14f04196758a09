/* duet_bench_stats.c — the maths of duet-bench: percentiles, per-run
 * aggregates, goodput, the operating-point choice, and reading Prometheus
 * text (/metrics) into histograms that can be diffed.
 *
 * Definitions follow `vllm bench serve` so numbers compare:
 *   - percentiles are numpy's default ('linear') method;
 *   - TPOT of a request is (e2el - ttft) / (output_tokens - 1);
 *   - ITL percentiles are over every gap of every request, flattened;
 *   - throughputs and goodput divide by the run's duration (first send to
 *     last completion);
 *   - goodput counts completed requests that meet every SLO that is set.
 */
#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "duet_bench.h"

/* ---- percentiles and summaries --------------------------------------------- */

double db_percentile_sorted(const double *sorted, size_t n, double p) {
    if (n == 0) return NAN;
    if (p <= 0) return sorted[0];
    if (p >= 100) return sorted[n - 1];
    double h = (double)(n - 1) * p / 100.0;
    size_t lo = (size_t)floor(h);
    if (lo + 1 >= n) return sorted[n - 1];
    double frac = h - (double)lo;
    /* numpy's _lerp form: exact at both ends, monotone in frac. */
    double a = sorted[lo], b = sorted[lo + 1], d = b - a;
    return frac >= 0.5 ? b - d * (1.0 - frac) : a + d * frac;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

bool db_summarize(const double *vals, size_t n, const double *ps, int n_ps, db_summary *out) {
    memset(out, 0, sizeof *out);
    out->n = n;
    if (n == 0) {
        out->mean = out->median = out->std = out->min = out->max = NAN;
        for (int i = 0; i < DB_MAX_PCT; i++)
            out->pct[i] = NAN;
        return true;
    }
    double *s = malloc(n * sizeof *s);
    if (!s) return false;
    memcpy(s, vals, n * sizeof *s);
    qsort(s, n, sizeof *s, cmp_double);
    double sum = 0;
    for (size_t i = 0; i < n; i++)
        sum += s[i];
    out->mean = sum / (double)n;
    double ss = 0;
    for (size_t i = 0; i < n; i++)
        ss += (s[i] - out->mean) * (s[i] - out->mean);
    out->std = sqrt(ss / (double)n);
    out->median = db_percentile_sorted(s, n, 50);
    out->min = s[0];
    out->max = s[n - 1];
    for (int i = 0; i < DB_MAX_PCT; i++)
        out->pct[i] = i < n_ps ? db_percentile_sorted(s, n, ps[i]) : NAN;
    free(s);
    return true;
}

/* ---- per request ------------------------------------------------------------ */

double db_result_tpot(const db_result *r) {
    if (!r->ok || r->output_tokens < 2 || isnan(r->ttft)) return NAN;
    return (r->e2el - r->ttft) / (double)(r->output_tokens - 1);
}

bool db_result_add_itl(db_result *r, double gap) {
    if (r->n_itl == r->cap_itl) {
        int cap = r->cap_itl ? r->cap_itl * 2 : 64;
        double *p = realloc(r->itl, (size_t)cap * sizeof *p);
        if (!p) return false;
        r->itl = p;
        r->cap_itl = cap;
    }
    r->itl[r->n_itl++] = gap;
    return true;
}

void db_result_free(db_result *r) {
    free(r->itl);
    r->itl = NULL;
    r->n_itl = r->cap_itl = 0;
}

/* ---- SLOs and goodput --------------------------------------------------------- */

bool db_slo_parse(const char *s, db_slo *out, char *err, size_t err_size) {
    memset(out, 0, sizeof *out);
    const char *p = s;
    while (*p) {
        while (*p == ' ' || *p == ',')
            p++;
        if (!*p) break;
        const char *colon = strchr(p, ':');
        size_t klen = colon ? (size_t)(colon - p) : 0;
        if (!colon || klen == 0 || klen > 8) {
            snprintf(err, err_size, "goodput: expected KEY:MS, got '%s'", p);
            return false;
        }
        char key[9];
        memcpy(key, p, klen);
        key[klen] = 0;
        errno = 0;
        char *end;
        double v = strtod(colon + 1, &end);
        if (end == colon + 1 || errno || !(v > 0) || isinf(v) || (*end && *end != ' ' && *end != ',')) {
            snprintf(err, err_size, "goodput: '%s' needs a positive number of milliseconds", key);
            return false;
        }
        if (!strcmp(key, "ttft"))
            out->ttft_ms = v;
        else if (!strcmp(key, "tpot"))
            out->tpot_ms = v;
        else if (!strcmp(key, "itl"))
            out->itl_ms = v;
        else if (!strcmp(key, "e2el"))
            out->e2el_ms = v;
        else {
            snprintf(err, err_size, "goodput: unknown metric '%s' (have ttft, tpot, itl, e2el)", key);
            return false;
        }
        p = end;
    }
    return true;
}

bool db_slo_any(const db_slo *s) {
    return s->ttft_ms > 0 || s->tpot_ms > 0 || s->itl_ms > 0 || s->e2el_ms > 0;
}

bool db_result_meets(const db_result *r, const db_slo *slo) {
    if (!r->ok) return false;
    if (slo->ttft_ms > 0 && !(r->ttft * 1e3 <= slo->ttft_ms)) return false;
    if (slo->e2el_ms > 0 && !(r->e2el * 1e3 <= slo->e2el_ms)) return false;
    if (slo->tpot_ms > 0) {
        double t = db_result_tpot(r);
        /* One-token outputs have no TPOT: nothing to violate (as vLLM, which
         * counts their TPOT as 0). */
        if (!isnan(t) && !(t * 1e3 <= slo->tpot_ms)) return false;
    }
    if (slo->itl_ms > 0)
        for (int i = 0; i < r->n_itl; i++)
            if (!(r->itl[i] * 1e3 <= slo->itl_ms)) return false;
    return true;
}

/* ---- per run ---------------------------------------------------------------- */

bool db_run_stats_compute(const db_result *res, int n, double duration, const db_slo *goodput_slo,
                          const double *ps, int n_ps, db_run_stats *out) {
    memset(out, 0, sizeof *out);
    out->n_requests = n;
    out->duration = duration;
    out->n_ps = n_ps < DB_MAX_PCT ? n_ps : DB_MAX_PCT;
    memcpy(out->ps, ps, (size_t)out->n_ps * sizeof *ps);
    size_t n_itl = 0;
    for (int i = 0; i < n; i++)
        if (res[i].ok) n_itl += (size_t)res[i].n_itl;
    double *ttft = malloc(((size_t)n + 1) * sizeof *ttft), *tpot = malloc(((size_t)n + 1) * sizeof *tpot);
    double *e2el = malloc(((size_t)n + 1) * sizeof *e2el), *itl = malloc((n_itl + 1) * sizeof *itl);
    bool ok = ttft && tpot && e2el && itl;
    size_t nt = 0, np = 0, ne = 0, ni = 0;
    for (int i = 0; ok && i < n; i++) {
        const db_result *r = &res[i];
        if (!r->ok) {
            out->failed++;
            continue;
        }
        out->completed++;
        out->total_input += r->prompt_tokens;
        out->total_output += r->output_tokens;
        if (!isnan(r->ttft)) ttft[nt++] = r->ttft * 1e3;
        double t = db_result_tpot(r);
        if (!isnan(t)) tpot[np++] = t * 1e3;
        e2el[ne++] = r->e2el * 1e3;
        for (int k = 0; k < r->n_itl; k++)
            itl[ni++] = r->itl[k] * 1e3;
        if (goodput_slo && db_slo_any(goodput_slo) && db_result_meets(r, goodput_slo)) out->good++;
    }
    ok = ok && db_summarize(ttft, nt, ps, out->n_ps, &out->ttft) &&
         db_summarize(tpot, np, ps, out->n_ps, &out->tpot) &&
         db_summarize(itl, ni, ps, out->n_ps, &out->itl) && db_summarize(e2el, ne, ps, out->n_ps, &out->e2el);
    free(ttft), free(tpot), free(e2el), free(itl);
    if (duration > 0) {
        out->request_throughput = out->completed / duration;
        out->output_throughput = out->total_output / duration;
        out->total_token_throughput = (out->total_input + out->total_output) / duration;
    } else {
        out->request_throughput = out->output_throughput = out->total_token_throughput = NAN;
    }
    out->goodput = goodput_slo && db_slo_any(goodput_slo) && duration > 0 ? out->good / duration : NAN;
    return ok;
}

double db_stats_pct(const db_run_stats *s, const db_summary *m, double p) {
    for (int i = 0; i < s->n_ps; i++)
        if (s->ps[i] == p) return m->pct[i];
    return NAN;
}

/* ---- the operating point ------------------------------------------------------- */

int db_operating_point(const db_op_candidate *c, int n, double slo_ttft_ms, double slo_itl_ms) {
    int best = -1;
    for (int i = 0; i < n; i++) {
        if (c[i].completed <= 0 || c[i].failed > 0 || isnan(c[i].output_throughput)) continue;
        if (slo_ttft_ms > 0 && !(c[i].ttft_p99_ms <= slo_ttft_ms)) continue;
        if (slo_itl_ms > 0 && !isnan(c[i].itl_p99_ms) && !(c[i].itl_p99_ms <= slo_itl_ms)) continue;
        if (best < 0 || c[i].output_throughput > c[best].output_throughput ||
            (c[i].output_throughput == c[best].output_throughput && c[i].ttft_p99_ms < c[best].ttft_p99_ms))
            best = i;
    }
    return best;
}

/* ---- Prometheus text ---------------------------------------------------------- */

static bool prom_push(db_prom *p, const char *name, size_t nlen, const char *labels, size_t llen, double v) {
    if (p->n == p->cap) {
        int cap = p->cap ? p->cap * 2 : 256;
        db_prom_sample *s = realloc(p->s, (size_t)cap * sizeof *s);
        if (!s) return false;
        p->s = s;
        p->cap = cap;
    }
    db_prom_sample *s = &p->s[p->n];
    s->name = strndup(name, nlen);
    s->labels = strndup(labels, llen);
    if (!s->name || !s->labels) {
        free(s->name), free(s->labels);
        return false;
    }
    s->value = v;
    p->n++;
    return true;
}

/* Prometheus' float syntax: also +Inf, -Inf, NaN (strtod reads those). */
static bool parse_value(const char *s, const char **end, double *v) {
    char *e;
    errno = 0;
    *v = strtod(s, &e);
    if (e == s) return false;
    *end = e;
    return true;
}

bool db_prom_parse(const char *text, db_prom *out, int *bad_line) {
    memset(out, 0, sizeof *out);
    int line_no = 0;
    const char *p = text;
    while (*p) {
        line_no++;
        const char *eol = strchr(p, '\n');
        if (!eol) eol = p + strlen(p);
        const char *q = p;
        while (q < eol && (*q == ' ' || *q == '\t'))
            q++;
        if (q < eol && *q != '#') {
            const char *name = q;
            /* Metric names: [a-zA-Z_:][a-zA-Z0-9_:]* */
            while (q < eol && (isalnum((unsigned char)*q) || *q == '_' || *q == ':'))
                q++;
            size_t nlen = (size_t)(q - name);
            const char *labels = "";
            size_t llen = 0;
            bool ok = nlen > 0;
            if (ok && q < eol && *q == '{') {
                labels = ++q;
                /* Find the closing brace outside quoted values. */
                bool quoted = false;
                while (q < eol && (quoted || *q != '}')) {
                    if (*q == '\\' && quoted && q + 1 < eol)
                        q++;
                    else if (*q == '"')
                        quoted = !quoted;
                    q++;
                }
                ok = q < eol;
                llen = (size_t)(q - labels);
                q++;
            }
            double v = 0;
            const char *end = q;
            ok = ok && q < eol && (*q == ' ' || *q == '\t') && parse_value(q, &end, &v);
            /* An optional timestamp may follow; nothing else. */
            while (ok && end < eol &&
                   (*end == ' ' || *end == '\t' || isdigit((unsigned char)*end) || *end == '-'))
                end++;
            ok = ok && (end == eol || (*end == '\r' && end + 1 == eol));
            if (!ok) {
                if (bad_line) *bad_line = line_no;
                db_prom_free(out);
                return false;
            }
            if (!prom_push(out, name, nlen, labels, llen, v)) {
                if (bad_line) *bad_line = 0;
                db_prom_free(out);
                return false;
            }
        }
        p = *eol ? eol + 1 : eol;
    }
    return true;
}

void db_prom_free(db_prom *p) {
    for (int i = 0; i < p->n; i++)
        free(p->s[i].name), free(p->s[i].labels);
    free(p->s);
    memset(p, 0, sizeof *p);
}

bool db_prom_label(const char *labels, const char *key, char *buf, size_t size) {
    size_t klen = strlen(key);
    const char *p = labels;
    while (*p) {
        while (*p == ' ' || *p == ',')
            p++;
        const char *k = p;
        while (*p && *p != '=')
            p++;
        if (*p != '=' || p[1] != '"') return false;
        bool match = (size_t)(p - k) == klen && !strncmp(k, key, klen);
        p += 2;
        size_t o = 0;
        while (*p && *p != '"') {
            char c = *p++;
            if (c == '\\' && *p) {
                c = *p++;
                if (c == 'n') c = '\n';
            }
            if (match && o + 1 < size) buf[o++] = c;
        }
        if (*p != '"') return false;
        p++;
        if (match) {
            if (size) buf[o] = 0;
            return true;
        }
    }
    return false;
}

double db_prom_sum(const db_prom *p, const char *name) {
    double s = 0;
    bool found = false;
    for (int i = 0; i < p->n; i++)
        if (!strcmp(p->s[i].name, name)) s += p->s[i].value, found = true;
    return found ? s : NAN;
}

bool db_prom_hist(const db_prom *p, const char *name, db_hist *out) {
    memset(out, 0, sizeof *out);
    char bname[256], sname[256], cname[256];
    snprintf(bname, sizeof bname, "%s_bucket", name);
    snprintf(sname, sizeof sname, "%s_sum", name);
    snprintf(cname, sizeof cname, "%s_count", name);
    /* Cumulative counts per bound, summed over label sets: a sum of
     * cumulative series is the cumulative series of the sum. */
    double cum[DB_MAX_BUCKETS] = {0};
    bool found = false;
    for (int i = 0; i < p->n; i++) {
        const db_prom_sample *s = &p->s[i];
        if (strcmp(s->name, bname) != 0) continue;
        char le_s[64];
        if (!db_prom_label(s->labels, "le", le_s, sizeof le_s)) continue;
        double le = strtod(le_s, NULL);
        int k = 0;
        while (k < out->n && out->le[k] < le)
            k++;
        if (k == out->n || out->le[k] != le) {
            if (out->n == DB_MAX_BUCKETS) return false;
            memmove(&out->le[k + 1], &out->le[k], (size_t)(out->n - k) * sizeof(double));
            memmove(&cum[k + 1], &cum[k], (size_t)(out->n - k) * sizeof(double));
            out->le[k] = le;
            cum[k] = 0;
            out->n++;
        }
        cum[k] += s->value;
        found = true;
    }
    if (!found) return false;
    for (int k = 0; k < out->n; k++)
        out->count[k] = cum[k] - (k ? cum[k - 1] : 0);
    out->sum = db_prom_sum(p, sname);
    out->total = db_prom_sum(p, cname);
    if (isnan(out->total)) out->total = cum[out->n - 1];
    return true;
}

bool db_hist_diff(const db_hist *after, const db_hist *before, db_hist *out) {
    if (after->n != before->n) return false;
    for (int k = 0; k < after->n; k++)
        if (after->le[k] != before->le[k]) return false;
    *out = *after;
    for (int k = 0; k < after->n; k++)
        out->count[k] = after->count[k] - before->count[k];
    out->sum = after->sum - before->sum;
    out->total = after->total - before->total;
    return true;
}

void db_server_stats_from(const char *before, const char *after, double wall_s, db_server_stats *out) {
    memset(out, 0, sizeof *out);
    out->mean_batch = out->busy_ratio = out->preemptions = NAN;
    out->max_batch_seqs = out->batch_timeout_ms = out->max_batch_tokens = out->prefill_chunk = NAN;
    if (!before || !after) return;
    db_prom a, b;
    if (!db_prom_parse(before, &b, NULL)) return;
    if (!db_prom_parse(after, &a, NULL)) {
        db_prom_free(&b);
        return;
    }
    db_hist ha, hb;
    if (db_prom_hist(&a, "duet_batch_size", &ha) && db_prom_hist(&b, "duet_batch_size", &hb) &&
        db_hist_diff(&ha, &hb, &out->batch)) {
        out->have_batch = true;
        out->mean_batch = out->batch.total > 0 ? out->batch.sum / out->batch.total : NAN;
    }
    double busy =
        db_prom_sum(&a, "duet_device_busy_seconds_total") - db_prom_sum(&b, "duet_device_busy_seconds_total");
    if (!isnan(busy) && wall_s > 0) out->busy_ratio = busy / wall_s;
    out->preemptions = db_prom_sum(&a, "duet_preemptions_total") - db_prom_sum(&b, "duet_preemptions_total");
    out->max_batch_seqs = db_prom_sum(&a, "duet_max_batch_seqs");
    out->batch_timeout_ms = db_prom_sum(&a, "duet_batch_timeout_seconds") * 1e3;
    out->max_batch_tokens = db_prom_sum(&a, "duet_max_batch_tokens");
    out->prefill_chunk = db_prom_sum(&a, "duet_prefill_chunk");
    db_prom_free(&a);
    db_prom_free(&b);
}
