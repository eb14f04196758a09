/* metrics.c — counters, gauges and histograms of one engine instance, and
 * their Prometheus text exposition (format 0.0.4).
 *
 * Time base: the recording calls stamp their samples with CLOCK_MONOTONIC
 * seconds, so duet__metrics_window's `now_s` must be on that clock too (the
 * same clock as the engine's timings).
 *
 * Everything is allocated in duet__metrics_new; the recording calls only
 * add under one mutex. Rendering snapshots the numbers under the mutex and
 * formats them outside it, so a scrape never stalls the engine thread for
 * longer than a memcpy.
 *
 * Every metric carries a model_name label. Where vLLM exports a metric with
 * the same meaning, it is exported a second time under vLLM's name (vllm:*),
 * from the same storage, so dashboards and inference gateways built for
 * vLLM read duet unchanged.
 */
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "metrics.h"
#include "speculative.h"

#include "controller.h"

#define N_PRIO 2
static const char *const prio_names[N_PRIO] = {"interactive", "batch"};

/* Request outcomes: the finish reasons, then the refusals at submit. */
enum { OUT_STOP, OUT_LENGTH, OUT_CANCELLED, OUT_ERROR, OUT_REJECTED, OUT_INVALID, N_OUT };
static const char *const out_names[N_OUT] = {"stop", "length", "cancelled", "error", "rejected", "invalid"};
/* vLLM's finished_reason label for the finished outcomes. */
static const char *const vllm_reasons[OUT_REJECTED] = {"stop", "length", "abort", "error"};

/* Bucket upper bounds (inclusive, Prometheus `le`). The latency buckets
 * extend vLLM's lists downwards, because small models on a CPU produce
 * tokens in a few milliseconds. */
static const double ttft_bounds[] = {0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15,
                                     0.2,   0.25,   0.3,   0.4,  0.5,  0.75, 1,    1.5,  2,   2.5,
                                     5,     7.5,    10,    20,   40,   80,   160,  640,  2560};
static const double itl_bounds[] = {0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03,
                                    0.04,  0.05,   0.075, 0.1,    0.15, 0.2,   0.3,  0.4,   0.5,
                                    0.75,  1,      2.5,   5,      7.5,  10,    20,   40,    80};
static const double e2e_bounds[] = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.3, 0.5,  0.8,
                                    1,     1.5,  2,     2.5,  5,   10,   15,  20,   30,
                                    40,    50,   60,    120,  240, 480,  960, 1920, 7680};
static const double seqs_bounds[] = {1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 512};
static const double tokens_bounds[] = {1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384};
static const double len_bounds[] = {1,   2,    5,    10,   20,    50,    100,   200,
                                    500, 1000, 2000, 5000, 10000, 20000, 50000, 100000};

_Static_assert(DUET_CTL_N_ACTIONS == 4, "duet_metrics_gauges.ctl_decisions has a slot per action");

#define MAX_BOUNDS 32
#define N_BOUNDS(a) ((int)(sizeof(a) / sizeof *(a)))
_Static_assert(N_BOUNDS(ttft_bounds) < MAX_BOUNDS && N_BOUNDS(itl_bounds) < MAX_BOUNDS &&
                   N_BOUNDS(e2e_bounds) < MAX_BOUNDS && N_BOUNDS(seqs_bounds) < MAX_BOUNDS &&
                   N_BOUNDS(tokens_bounds) < MAX_BOUNDS && N_BOUNDS(len_bounds) < MAX_BOUNDS,
               "a histogram needs a slot for +Inf");

typedef struct hist {
    uint64_t bucket[MAX_BOUNDS]; /* per bucket, not cumulative; the last slot is +Inf */
    uint64_t count;
    double sum;
} hist;

/* The numbers a scrape copies: fixed size, no pointers. */
typedef struct counters {
    uint64_t requests[N_PRIO][N_OUT];
    uint64_t preemptions[N_PRIO];
    uint64_t prompt_tokens, generated_tokens;
    double busy_s;
    uint64_t spec_drafts, spec_draft_tokens, spec_accepted, spec_accepted_pos[DUET_SPEC_MAX_K];
    double spec_draft_s;
    hist e2e[N_PRIO], ttft[N_PRIO], queue[N_PRIO];
    hist itl, tpot_req, batch_seqs, batch_tokens, prompt_len, gen_len;
    duet_metrics_gauges gauges;
    bool unhealthy; /* stored inverted so that a fresh (zeroed) engine is healthy */
} counters;

/* A ring of the most recent (time, value) samples for the windowed view.
 * When it wraps, the oldest samples go: a window longer than the ring
 * covers sees only the newest `cap` samples. */
typedef struct ring {
    double *t, *v;
    int cap, head, n;
} ring;

/* The _P0/_P1 rings hold the same samples by class (interactive, batch). */
enum {
    RING_TTFT,
    RING_ITL,
    RING_E2E,
    RING_ARRIVAL,
    RING_BUSY,
    RING_TTFT_P0,
    RING_TTFT_P1,
    RING_ITL_P0,
    RING_ITL_P1,
    N_RINGS
};
static const int ring_caps[N_RINGS] = {4096, 32768, 4096, 8192, 16384, 4096, 4096, 32768, 32768};

struct duet_metrics {
    pthread_mutex_t mu;
    char *model_name; /* already escaped for a label value */
    double t_start;
    counters c;
    ring rings[N_RINGS];
    double *scratch; /* for sorting one ring's window: max ring cap */
};

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Label values escape backslash, double quote and newline. */
static char *escape_label(const char *s) {
    size_t n = 0;
    for (const char *p = s; *p; p++)
        n += (*p == '\\' || *p == '"' || *p == '\n') ? 2 : 1;
    char *out = malloc(n + 1), *o = out;
    if (!out) return NULL;
    for (const char *p = s; *p; p++) {
        if (*p == '\\' || *p == '"')
            *o++ = '\\', *o++ = *p;
        else if (*p == '\n')
            *o++ = '\\', *o++ = 'n';
        else
            *o++ = *p;
    }
    *o = 0;
    return out;
}

duet_metrics *duet__metrics_new(const char *model_name) {
    duet_metrics *m = calloc(1, sizeof *m);
    if (!m) return NULL;
    pthread_mutex_init(&m->mu, NULL);
    m->model_name = escape_label(model_name ? model_name : "");
    int max_cap = 0;
    bool ok = m->model_name != NULL;
    for (int i = 0; i < N_RINGS && ok; i++) {
        ring *r = &m->rings[i];
        r->cap = ring_caps[i];
        r->t = malloc((size_t)r->cap * sizeof *r->t);
        r->v = malloc((size_t)r->cap * sizeof *r->v);
        ok = r->t && r->v;
        if (r->cap > max_cap) max_cap = r->cap;
    }
    if (ok) ok = (m->scratch = malloc((size_t)max_cap * sizeof *m->scratch)) != NULL;
    if (!ok) {
        duet__metrics_free(m);
        return NULL;
    }
    m->t_start = now_s();
    return m;
}

void duet__metrics_free(duet_metrics *m) {
    if (!m) return;
    for (int i = 0; i < N_RINGS; i++)
        free(m->rings[i].t), free(m->rings[i].v);
    free(m->scratch);
    free(m->model_name);
    pthread_mutex_destroy(&m->mu);
    free(m);
}

/* ---- recording ---------------------------------------------------------- */

static void hist_add(hist *h, const double *bounds, int nb, double v) {
    if (!isfinite(v)) return; /* a NaN would poison _sum forever */
    int i = 0;
    while (i < nb && v > bounds[i])
        i++;
    h->bucket[i]++;
    h->count++;
    h->sum += v;
}

static void ring_push(ring *r, double t, double v) {
    r->t[r->head] = t;
    r->v[r->head] = v;
    r->head = (r->head + 1) % r->cap;
    if (r->n < r->cap) r->n++;
}

static int prio_index(duet_priority p) {
    return p == DUET_PRIORITY_BATCH ? 1 : 0;
}

static int finish_outcome(duet_finish f) {
    switch (f) {
    case DUET_FINISH_STOP:
        return OUT_STOP;
    case DUET_FINISH_LENGTH:
        return OUT_LENGTH;
    case DUET_FINISH_CANCELLED:
        return OUT_CANCELLED;
    default:
        return OUT_ERROR; /* ERROR, or NONE which a finished request should never have */
    }
}

void duet__metrics_request_done(duet_metrics *m, duet_priority prio, duet_finish finish, double e2e_s,
                                double ttft_s, double queue_s, int prompt_tokens, int generated_tokens) {
    double t = now_s();
    int p = prio_index(prio);
    pthread_mutex_lock(&m->mu);
    counters *c = &m->c;
    c->requests[p][finish_outcome(finish)]++;
    if (prompt_tokens > 0) c->prompt_tokens += (uint64_t)prompt_tokens;
    if (generated_tokens > 0) c->generated_tokens += (uint64_t)generated_tokens;
    hist_add(&c->e2e[p], e2e_bounds, N_BOUNDS(e2e_bounds), e2e_s);
    hist_add(&c->queue[p], e2e_bounds, N_BOUNDS(e2e_bounds), queue_s);
    hist_add(&c->prompt_len, len_bounds, N_BOUNDS(len_bounds), prompt_tokens);
    hist_add(&c->gen_len, len_bounds, N_BOUNDS(len_bounds), generated_tokens);
    /* Time to first token exists only for requests that produced one. */
    if (generated_tokens > 0 && ttft_s >= 0) {
        hist_add(&c->ttft[p], ttft_bounds, N_BOUNDS(ttft_bounds), ttft_s);
        ring_push(&m->rings[RING_TTFT], t, ttft_s);
        ring_push(&m->rings[RING_TTFT_P0 + p], t, ttft_s);
    }
    if (generated_tokens > 1 && e2e_s > ttft_s && ttft_s >= 0)
        hist_add(&c->tpot_req, itl_bounds, N_BOUNDS(itl_bounds), (e2e_s - ttft_s) / (generated_tokens - 1));
    if (isfinite(e2e_s) && e2e_s >= 0) {
        ring_push(&m->rings[RING_E2E], t, e2e_s);
        ring_push(&m->rings[RING_ARRIVAL], t - e2e_s, 1);
    }
    pthread_mutex_unlock(&m->mu);
}

void duet__metrics_request_refused(duet_metrics *m, duet_priority prio, const char *reason) {
    double t = now_s();
    /* "rejected" is the overload refusal; every other reason is an invalid request. */
    int out = reason && strcmp(reason, "rejected") == 0 ? OUT_REJECTED : OUT_INVALID;
    pthread_mutex_lock(&m->mu);
    m->c.requests[prio_index(prio)][out]++;
    ring_push(&m->rings[RING_ARRIVAL], t, 1);
    pthread_mutex_unlock(&m->mu);
}

void duet__metrics_inter_token(duet_metrics *m, double seconds) {
    double t = now_s();
    pthread_mutex_lock(&m->mu);
    hist_add(&m->c.itl, itl_bounds, N_BOUNDS(itl_bounds), seconds);
    if (isfinite(seconds)) ring_push(&m->rings[RING_ITL], t, seconds);
    pthread_mutex_unlock(&m->mu);
}

void duet__metrics_inter_token_prio(duet_metrics *m, duet_priority prio, double seconds) {
    double t = now_s();
    pthread_mutex_lock(&m->mu);
    hist_add(&m->c.itl, itl_bounds, N_BOUNDS(itl_bounds), seconds);
    if (isfinite(seconds)) {
        ring_push(&m->rings[RING_ITL], t, seconds);
        ring_push(&m->rings[RING_ITL_P0 + prio_index(prio)], t, seconds);
    }
    pthread_mutex_unlock(&m->mu);
}

void duet__metrics_step(duet_metrics *m, int n_seqs, int n_tokens, double busy_s) {
    double t = now_s();
    pthread_mutex_lock(&m->mu);
    hist_add(&m->c.batch_seqs, seqs_bounds, N_BOUNDS(seqs_bounds), n_seqs);
    hist_add(&m->c.batch_tokens, tokens_bounds, N_BOUNDS(tokens_bounds), n_tokens);
    if (isfinite(busy_s) && busy_s > 0) {
        m->c.busy_s += busy_s;
        ring_push(&m->rings[RING_BUSY], t, busy_s);
    }
    pthread_mutex_unlock(&m->mu);
}

void duet__metrics_preempted(duet_metrics *m, duet_priority prio) {
    pthread_mutex_lock(&m->mu);
    m->c.preemptions[prio_index(prio)]++;
    pthread_mutex_unlock(&m->mu);
}

void duet__metrics_spec(duet_metrics *m, int n_draft, int n_accepted) {
    if (n_draft <= 0) return;
    pthread_mutex_lock(&m->mu);
    counters *c = &m->c;
    c->spec_drafts++;
    c->spec_draft_tokens += (uint64_t)n_draft;
    c->spec_accepted += (uint64_t)(n_accepted > 0 ? n_accepted : 0);
    for (int j = 0; j < n_accepted && j < DUET_SPEC_MAX_K; j++)
        c->spec_accepted_pos[j]++;
    pthread_mutex_unlock(&m->mu);
}

void duet__metrics_spec_draft_time(duet_metrics *m, double seconds) {
    if (!(seconds > 0)) return;
    pthread_mutex_lock(&m->mu);
    m->c.spec_draft_s += seconds;
    pthread_mutex_unlock(&m->mu);
}

void duet__metrics_set_gauges(duet_metrics *m, const duet_metrics_gauges *g) {
    pthread_mutex_lock(&m->mu);
    m->c.gauges = *g;
    pthread_mutex_unlock(&m->mu);
}

void duet__metrics_set_healthy(duet_metrics *m, bool healthy) {
    pthread_mutex_lock(&m->mu);
    m->c.unhealthy = !healthy;
    pthread_mutex_unlock(&m->mu);
}

/* ---- the window ------------------------------------------------------- */

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Copies the ring's values stamped in (lo, hi] into out; returns the count. */
static int ring_collect(const ring *r, double lo, double hi, double *out) {
    int n = 0;
    for (int i = 0; i < r->n; i++) {
        int k = (r->head - 1 - i + r->cap) % r->cap;
        if (r->t[k] > lo && r->t[k] <= hi) out[n++] = r->v[k];
    }
    return n;
}

/* Nearest-rank p99: the smallest value with at least 99% of samples <= it. */
static double p99_of(double *v, int n) {
    if (n == 0) return 0;
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    int rank = (int)ceil(0.99 * n);
    return v[rank < 1 ? 0 : rank - 1];
}

static double busy_ratio_locked(duet_metrics *m, double now, double window_s) {
    double span = now - m->t_start < window_s ? now - m->t_start : window_s;
    if (span <= 0) return 0;
    int n = ring_collect(&m->rings[RING_BUSY], now - window_s, now, m->scratch);
    double busy = 0;
    for (int i = 0; i < n; i++)
        busy += m->scratch[i];
    double r = busy / span;
    return r > 1 ? 1 : r;
}

void duet__metrics_window(duet_metrics *m, double now, double window_s, duet_metrics_window *out) {
    memset(out, 0, sizeof *out);
    if (!(window_s > 0)) return;
    double lo = now - window_s;
    pthread_mutex_lock(&m->mu);
    out->ttft_p99_s = p99_of(m->scratch, ring_collect(&m->rings[RING_TTFT], lo, now, m->scratch));
    out->itl_p99_s = p99_of(m->scratch, ring_collect(&m->rings[RING_ITL], lo, now, m->scratch));
    for (int p = 0; p < N_PRIO; p++) {
        out->ttft_n[p] = ring_collect(&m->rings[RING_TTFT_P0 + p], lo, now, m->scratch);
        out->ttft_p99_prio_s[p] = p99_of(m->scratch, out->ttft_n[p]);
        out->itl_n[p] = ring_collect(&m->rings[RING_ITL_P0 + p], lo, now, m->scratch);
        out->itl_p99_prio_s[p] = p99_of(m->scratch, out->itl_n[p]);
    }
    out->n_requests = ring_collect(&m->rings[RING_E2E], lo, now, m->scratch);
    out->e2e_p99_s = p99_of(m->scratch, out->n_requests);
    /* Arrivals are known when requests finish or are refused, so the rate
     * counts those; requests still in flight join it when they finish. */
    out->arrival_rate = ring_collect(&m->rings[RING_ARRIVAL], lo, now, m->scratch) / window_s;
    out->busy_ratio = busy_ratio_locked(m, now, window_s);
    pthread_mutex_unlock(&m->mu);
}

/* ---- rendering ---------------------------------------------------------- */

/* The window of duet_device_busy_ratio (a scrape interval or two). */
#define BUSY_GAUGE_WINDOW_S 10.0

typedef duet_text wbuf;

void duet__text_printf(duet_text *w, const char *fmt, ...) {
    if (w->oom) return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(w->p + w->len, w->cap - w->len, fmt, ap);
        va_end(ap);
        if (n < 0) {
            w->oom = true;
            return;
        }
        if ((size_t)n < w->cap - w->len) {
            w->len += (size_t)n;
            return;
        }
        size_t cap = (w->cap + (size_t)n + 1) * 2;
        char *p = realloc(w->p, cap);
        if (!p) {
            w->oom = true;
            return;
        }
        w->p = p;
        w->cap = cap;
    }
}

/* Shortest text that reads back as the same double, in Prometheus' float
 * syntax (+Inf, -Inf, NaN). */
static void fmt_double(char *buf, size_t size, double v) {
    if (isnan(v)) {
        snprintf(buf, size, "NaN");
        return;
    }
    if (isinf(v)) {
        snprintf(buf, size, v > 0 ? "+Inf" : "-Inf");
        return;
    }
    for (int prec = 6; prec <= 17; prec++) {
        snprintf(buf, size, "%.*g", prec, v);
        if (strtod(buf, NULL) == v) return;
    }
}

static void family(wbuf *w, const char *name, const char *type, const char *help) {
    duet__text_printf(w, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

/* One sample: name{model_name="...",<extra>} value. `extra` is "" or
 * `key="value"` pairs, comma-separated, already escaped. */
static void sample(wbuf *w, const duet_metrics *m, const char *name, const char *extra, double v) {
    char num[40];
    fmt_double(num, sizeof num, v);
    duet__text_printf(w, "%s{model_name=\"%s\"%s%s} %s\n", name, m->model_name, extra[0] ? "," : "", extra,
                      num);
}

static void sample_u64(wbuf *w, const duet_metrics *m, const char *name, const char *extra, uint64_t v) {
    duet__text_printf(w, "%s{model_name=\"%s\"%s%s} %llu\n", name, m->model_name, extra[0] ? "," : "", extra,
                      (unsigned long long)v);
}

/* The _bucket/_sum/_count series of one histogram (one label set). */
static void hist_series(wbuf *w, const duet_metrics *m, const char *name, const char *extra,
                        const double *bounds, int nb, const hist *h) {
    char sname[160], lab[256], num[40];
    snprintf(sname, sizeof sname, "%s_bucket", name);
    uint64_t cum = 0;
    for (int i = 0; i <= nb; i++) {
        cum += h->bucket[i];
        if (i < nb)
            fmt_double(num, sizeof num, bounds[i]);
        else
            snprintf(num, sizeof num, "+Inf");
        snprintf(lab, sizeof lab, "%s%sle=\"%s\"", extra, extra[0] ? "," : "", num);
        sample_u64(w, m, sname, lab, cum);
    }
    snprintf(sname, sizeof sname, "%s_sum", name);
    sample(w, m, sname, extra, h->sum);
    snprintf(sname, sizeof sname, "%s_count", name);
    sample_u64(w, m, sname, extra, h->count);
}

static void hist_merge(hist *dst, const hist *src, int nb) {
    for (int i = 0; i <= nb; i++)
        dst->bucket[i] += src->bucket[i];
    dst->count += src->count;
    dst->sum += src->sum;
}

/* A histogram family split by priority (duet_*), or summed over it (vllm:*). */
static void hist_by_prio(wbuf *w, const duet_metrics *m, const char *name, const char *help,
                         const double *bounds, int nb, const hist h[N_PRIO], bool split) {
    family(w, name, "histogram", help);
    if (split) {
        for (int p = 0; p < N_PRIO; p++) {
            char extra[64];
            snprintf(extra, sizeof extra, "priority=\"%s\"", prio_names[p]);
            hist_series(w, m, name, extra, bounds, nb, &h[p]);
        }
    } else {
        hist all = {0};
        for (int p = 0; p < N_PRIO; p++)
            hist_merge(&all, &h[p], nb);
        hist_series(w, m, name, "", bounds, nb, &all);
    }
}

static void hist_one(wbuf *w, const duet_metrics *m, const char *name, const char *help, const double *bounds,
                     int nb, const hist *h) {
    family(w, name, "histogram", help);
    hist_series(w, m, name, "", bounds, nb, h);
}

static void gauge_by_prio(wbuf *w, const duet_metrics *m, const char *name, const char *help,
                          const int v[N_PRIO]) {
    family(w, name, "gauge", help);
    for (int p = 0; p < N_PRIO; p++) {
        char extra[64];
        snprintf(extra, sizeof extra, "priority=\"%s\"", prio_names[p]);
        sample(w, m, name, extra, v[p]);
    }
}

static void gauge_one(wbuf *w, const duet_metrics *m, const char *name, const char *help, double v) {
    family(w, name, "gauge", help);
    sample(w, m, name, "", v);
}

static void counter_one(wbuf *w, const duet_metrics *m, const char *name, const char *help, double v) {
    family(w, name, "counter", help);
    sample(w, m, name, "", v);
}

/* Renders counters c (a copy) under m's model name; frees c. */
static char *render(const duet_metrics *m, counters *c, double now, double busy_ratio) {
    wbuf w = {0};
    const duet_metrics_gauges *g = &c->gauges;
    char extra[128];

    /* ---- duet's own names ---- */
    family(
        &w, "duet_requests_total", "counter",
        "Requests by priority and outcome (stop, length, cancelled, error; rejected and invalid at submit).");
    for (int p = 0; p < N_PRIO; p++)
        for (int o = 0; o < N_OUT; o++) {
            snprintf(extra, sizeof extra, "priority=\"%s\",status=\"%s\"", prio_names[p], out_names[o]);
            sample_u64(&w, m, "duet_requests_total", extra, c->requests[p][o]);
        }
    family(&w, "duet_preemptions_total", "counter",
           "Sequences preempted under KV cache pressure, by priority.");
    for (int p = 0; p < N_PRIO; p++) {
        snprintf(extra, sizeof extra, "priority=\"%s\"", prio_names[p]);
        sample_u64(&w, m, "duet_preemptions_total", extra, c->preemptions[p]);
    }
    hist_by_prio(&w, m, "duet_request_latency_seconds", "End-to-end request latency, arrival to last token.",
                 e2e_bounds, N_BOUNDS(e2e_bounds), c->e2e, true);
    hist_by_prio(&w, m, "duet_time_to_first_token_seconds", "Time from arrival to the first generated token.",
                 ttft_bounds, N_BOUNDS(ttft_bounds), c->ttft, true);
    hist_by_prio(&w, m, "duet_queue_time_seconds", "Time a request waited before its first step.", e2e_bounds,
                 N_BOUNDS(e2e_bounds), c->queue, true);
    hist_one(&w, m, "duet_inter_token_latency_seconds", "Gap between consecutive tokens of a request.",
             itl_bounds, N_BOUNDS(itl_bounds), &c->itl);
    hist_one(&w, m, "duet_batch_size", "Sequences in one engine step.", seqs_bounds, N_BOUNDS(seqs_bounds),
             &c->batch_seqs);
    hist_one(&w, m, "duet_batch_tokens", "Tokens (decodes and prefill chunks) in one engine step.",
             tokens_bounds, N_BOUNDS(tokens_bounds), &c->batch_tokens);
    gauge_by_prio(&w, m, "duet_requests_waiting", "Requests queued and not yet running, by priority.",
                  g->waiting);
    gauge_by_prio(&w, m, "duet_requests_running", "Requests holding a batch slot, by priority.", g->running);
    gauge_one(&w, m, "duet_kv_cache_usage_ratio", "Fraction of KV cache blocks in use (0..1).", g->kv_usage);
    gauge_one(&w, m, "duet_max_batch_seqs", "Scheduler knob: sequences decoded together.", g->max_batch_seqs);
    gauge_one(&w, m, "duet_max_batch_tokens", "Scheduler knob: token budget of one step.",
              g->max_batch_tokens);
    gauge_one(&w, m, "duet_prefill_chunk", "Scheduler knob: prompt tokens per sequence per step.",
              g->prefill_chunk);
    gauge_one(&w, m, "duet_batch_timeout_seconds",
              "Scheduler knob: how long an idle engine waits for more arrivals.", g->batch_timeout_s);
    counter_one(
        &w, m, "duet_prefix_cache_queries_total",
        "Prompt tokens looked up in the prefix cache at admissions (re-admissions after preemption too).",
        (double)g->prefix_cache_queries);
    counter_one(&w, m, "duet_prefix_cache_hits_total",
                "Of the looked-up tokens, those found cached (not computed).", (double)g->prefix_cache_hits);
    gauge_one(&w, m, "duet_controller_active",
              "1 while the adaptive controller retunes the knobs (some latency target is set).",
              g->controller);
    family(&w, "duet_slo_ttft_seconds", "gauge",
           "The controller's p99 time-to-first-token target by priority (0 = none).");
    for (int p = 0; p < N_PRIO; p++) {
        snprintf(extra, sizeof extra, "priority=\"%s\"", prio_names[p]);
        sample(&w, m, "duet_slo_ttft_seconds", extra, g->slo_ttft_s[p]);
    }
    family(&w, "duet_slo_itl_seconds", "gauge",
           "The controller's p99 inter-token latency target by priority (0 = none).");
    for (int p = 0; p < N_PRIO; p++) {
        snprintf(extra, sizeof extra, "priority=\"%s\"", prio_names[p]);
        sample(&w, m, "duet_slo_itl_seconds", extra, g->slo_itl_s[p]);
    }
    gauge_one(&w, m, "duet_controller_itl_ratio",
              "The controller's smoothed worst p99 ITL / target over the classes (-1 = no samples yet).",
              g->ctl_itl_ratio);
    gauge_one(&w, m, "duet_controller_ttft_ratio",
              "The controller's smoothed worst p99 TTFT / target over the classes (-1 = no samples yet).",
              g->ctl_ttft_ratio);
    family(&w, "duet_controller_decisions_total", "counter",
           "The controller's decisions, one per window: hold, protect (ITL over target: smaller steps), "
           "catch_up (TTFT over target or a backlog), relax (quiet: longer batch timeout, larger steps).");
    for (int a = 0; a < DUET_CTL_N_ACTIONS; a++) {
        snprintf(extra, sizeof extra, "action=\"%s\"", duet__ctl_action_name((duet_ctl_action)a));
        sample_u64(&w, m, "duet_controller_decisions_total", extra, g->ctl_decisions[a]);
    }
    family(&w, "duet_step_budget_seconds", "gauge",
           "Stall-free steps: the predicted time a step with decodes of the class may take; prompt chunks "
           "shrink to fit (0 = none: token counts only).");
    for (int p = 0; p < N_PRIO; p++) {
        snprintf(extra, sizeof extra, "priority=\"%s\"", prio_names[p]);
        sample(&w, m, "duet_step_budget_seconds", extra, g->step_budget_s[p]);
    }
    gauge_one(&w, m, "duet_step_budget_share",
              "The step budget as a share of each class's ITL target (0 = no ITL target).", g->budget_share);
    counter_one(&w, m, "duet_step_budget_cut_steps_total", "Steps whose prompt chunks the step budget cut.",
                (double)g->budget_cut_steps);
    counter_one(&w, m, "duet_step_budget_over_steps_total",
                "Steps predicted over their budget (decodes alone, or the minimum prompt chunk).",
                (double)g->budget_over_steps);
    gauge_one(&w, m, "duet_prefix_cache_blocks", "KV blocks with a prefix cache entry (in use or evictable).",
              g->kv_blocks_cached);
    counter_one(&w, m, "duet_prompt_tokens_total", "Prompt tokens of finished requests.",
                (double)c->prompt_tokens);
    counter_one(&w, m, "duet_generation_tokens_total", "Tokens generated by finished requests.",
                (double)c->generated_tokens);
    counter_one(&w, m, "duet_device_busy_seconds_total", "Device time spent on engine steps.", c->busy_s);
    gauge_one(&w, m, "duet_device_busy_ratio",
              "Device busy time over wall time in the last 10 seconds (0..1).", busy_ratio);
    gauge_one(&w, m, "duet_uptime_seconds", "Seconds since the metrics were created.", now - m->t_start);
    gauge_one(
        &w, m, "duet_engine_healthy",
        "1 while the engine serves; 0 once its device is lost (it refuses every request until restarted).",
        c->unhealthy ? 0 : 1);

    /* ---- vLLM's names, same meaning ---- */
    int running = g->running[0] + g->running[1], waiting = g->waiting[0] + g->waiting[1];
    gauge_one(&w, m, "vllm:num_requests_running", "Number of requests in model execution batches.", running);
    gauge_one(&w, m, "vllm:num_requests_waiting", "Number of requests waiting to be processed.", waiting);
    gauge_one(&w, m, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", g->kv_usage);
    gauge_one(&w, m, "vllm:gpu_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage (older name).",
              g->kv_usage);
    if (g->kv_block_size > 0) { /* vLLM's CacheConfig labels that a KV pool of duet's has */
        family(&w, "vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig");
        snprintf(extra, sizeof extra, "block_size=\"%d\",enable_prefix_caching=\"%s\",num_gpu_blocks=\"%d\"",
                 g->kv_block_size, g->prefix_cache ? "True" : "False", g->kv_blocks);
        sample(&w, m, "vllm:cache_config_info", extra, 1);
    }
    counter_one(&w, m, "vllm:prefix_cache_queries_total",
                "Prefix cache queries, in terms of number of queried tokens.",
                (double)g->prefix_cache_queries);
    counter_one(&w, m, "vllm:prefix_cache_hits_total",
                "Prefix cache hits, in terms of number of cached tokens.", (double)g->prefix_cache_hits);
    counter_one(&w, m, "vllm:num_preemptions_total", "Cumulative number of preemptions.",
                (double)(c->preemptions[0] + c->preemptions[1]));
    counter_one(&w, m, "vllm:prompt_tokens_total", "Number of prefill tokens processed.",
                (double)c->prompt_tokens);
    counter_one(&w, m, "vllm:generation_tokens_total", "Number of generation tokens processed.",
                (double)c->generated_tokens);
    family(&w, "vllm:request_success_total", "counter", "Count of finished requests by finished reason.");
    for (int o = 0; o < OUT_REJECTED; o++) {
        snprintf(extra, sizeof extra, "finished_reason=\"%s\"", vllm_reasons[o]);
        sample_u64(&w, m, "vllm:request_success_total", extra, c->requests[0][o] + c->requests[1][o]);
    }
    hist_by_prio(&w, m, "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                 ttft_bounds, N_BOUNDS(ttft_bounds), c->ttft, false);
    hist_one(&w, m, "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
             itl_bounds, N_BOUNDS(itl_bounds), &c->itl);
    hist_one(&w, m, "vllm:time_per_output_token_seconds",
             "Histogram of time per output token in seconds (older name of inter-token latency).", itl_bounds,
             N_BOUNDS(itl_bounds), &c->itl);
    hist_one(&w, m, "vllm:request_time_per_output_token_seconds",
             "Histogram of each request's mean time per output token after the first.", itl_bounds,
             N_BOUNDS(itl_bounds), &c->tpot_req);
    hist_by_prio(&w, m, "vllm:e2e_request_latency_seconds",
                 "Histogram of end to end request latency in seconds.", e2e_bounds, N_BOUNDS(e2e_bounds),
                 c->e2e, false);
    hist_by_prio(&w, m, "vllm:request_queue_time_seconds", "Histogram of time spent in the waiting queue.",
                 e2e_bounds, N_BOUNDS(e2e_bounds), c->queue, false);
    hist_one(&w, m, "vllm:request_prompt_tokens", "Number of prefill tokens processed per request.",
             len_bounds, N_BOUNDS(len_bounds), &c->prompt_len);
    hist_one(&w, m, "vllm:request_generation_tokens", "Number of generation tokens processed per request.",
             len_bounds, N_BOUNDS(len_bounds), &c->gen_len);
    hist_one(&w, m, "vllm:iteration_tokens_total", "Histogram of the number of tokens per engine step.",
             tokens_bounds, N_BOUNDS(tokens_bounds), &c->batch_tokens);
    if (g->spec_k > 0) { /* speculative decoding is on */
        counter_one(&w, m, "vllm:spec_decode_num_drafts_total", "Number of spec decoding drafts.",
                    (double)c->spec_drafts);
        counter_one(&w, m, "vllm:spec_decode_num_draft_tokens_total", "Number of draft tokens.",
                    (double)c->spec_draft_tokens);
        counter_one(&w, m, "vllm:spec_decode_num_accepted_tokens_total", "Number of accepted tokens.",
                    (double)c->spec_accepted);
        family(&w, "vllm:spec_decode_num_accepted_tokens_per_pos_total", "counter",
               "Accepted tokens per draft position.");
        for (int j = 0; j < g->spec_k && j < DUET_SPEC_MAX_K; j++) {
            snprintf(extra, sizeof extra, "position=\"%d\"", j);
            sample_u64(&w, m, "vllm:spec_decode_num_accepted_tokens_per_pos_total", extra,
                       c->spec_accepted_pos[j]);
        }
        gauge_one(&w, m, "duet_spec_decode_max_batch",
                  "Hard cap: steps with more decodes than this verify no drafts.", g->spec_max_batch);
        gauge_one(&w, m, "duet_spec_decode_measured",
                  "1 when drafts are granted by the measured decision (step-cost models and acceptance).",
                  g->spec_measured);
        counter_one(&w, m, "duet_spec_decode_offered_tokens_total", "Draft tokens offered to the scheduler.",
                    (double)g->spec_offered_tokens);
        counter_one(&w, m, "duet_spec_decode_throttled_tokens_total",
                    "Draft tokens offered but not verified: the decision predicted no gain, or the hard cap.",
                    (double)g->spec_throttled_tokens);
        counter_one(&w, m, "duet_spec_decode_capped_tokens_total",
                    "Draft tokens refused because the step had more decodes than duet_spec_decode_max_batch.",
                    (double)g->spec_capped_tokens);
        static const char *const kinds[5] = {"draft", "plain", "explore", "capped", "always"};
        family(&w, "duet_spec_decode_steps_total", "counter",
               "Steps with draft offers by decision: draft (predicted to pay), plain (predicted not to), "
               "explore (refused, one granted to keep measuring), capped, always (no decision).");
        for (int j = 0; j < 5; j++) {
            snprintf(extra, sizeof extra, "decision=\"%s\"", kinds[j]);
            sample_u64(&w, m, "duet_spec_decode_steps_total", extra, g->spec_steps[j]);
        }
        gauge_one(&w, m, "duet_spec_decode_predicted_speedup",
                  "The last decision: predicted tokens per second of the best drafts found over none "
                  "(drafts are granted above 1.02).",
                  g->spec_speedup);
        gauge_one(&w, m, "duet_spec_decode_acceptance_estimate",
                  "The last decision: mean estimated per-token acceptance of the offers.", g->spec_alpha);
        gauge_one(&w, m, "duet_spec_decode_predicted_draft_seconds",
                  "The last decision: predicted seconds of the draft model's passes in the step.",
                  g->spec_draft_predicted_s);
        counter_one(&w, m, "duet_spec_decode_draft_seconds_total",
                    "Seconds spent in the draft model's forward passes.", c->spec_draft_s);
        if (g->spec_draft_model) {
            family(&w, "duet_spec_draft_step_cost_seconds", "gauge",
                   "The draft model's step-cost model, per forward pass, fitted online (seconds per unit).");
            for (int j = 0; j < DUET_STEP_COST_TERMS; j++) {
                snprintf(extra, sizeof extra, "term=\"%s\"", duet_step_cost_term(j));
                sample(&w, m, "duet_spec_draft_step_cost_seconds", extra, g->spec_draft_coef[j]);
            }
        }
    }
    free(c);
    if (w.oom) {
        free(w.p);
        return NULL;
    }
    return w.p ? w.p : calloc(1, 1);
}

char *duet__metrics_render(duet_metrics *m) {
    return duet__metrics_render_sum(&m, 1);
}

static void hist_add_all(hist *dst, const hist *src) {
    hist_merge(dst, src, MAX_BOUNDS - 1);
}

/* dst += src, counters and histograms; gauges as the sum says in metrics.h. */
static void counters_add(counters *dst, const counters *src) {
    for (int p = 0; p < N_PRIO; p++) {
        for (int o = 0; o < N_OUT; o++)
            dst->requests[p][o] += src->requests[p][o];
        dst->preemptions[p] += src->preemptions[p];
        hist_add_all(&dst->e2e[p], &src->e2e[p]);
        hist_add_all(&dst->ttft[p], &src->ttft[p]);
        hist_add_all(&dst->queue[p], &src->queue[p]);
    }
    dst->prompt_tokens += src->prompt_tokens;
    dst->generated_tokens += src->generated_tokens;
    dst->busy_s += src->busy_s;
    hist *d[6] = {&dst->itl,          &dst->tpot_req,   &dst->batch_seqs,
                  &dst->batch_tokens, &dst->prompt_len, &dst->gen_len};
    const hist *sr[6] = {&src->itl,          &src->tpot_req,   &src->batch_seqs,
                         &src->batch_tokens, &src->prompt_len, &src->gen_len};
    for (int i = 0; i < 6; i++)
        hist_add_all(d[i], sr[i]);
    duet_metrics_gauges *g = &dst->gauges;
    const duet_metrics_gauges *h = &src->gauges;
    /* KV usage: blocks in use over all pools' blocks. */
    double used = g->kv_usage * g->kv_blocks + h->kv_usage * h->kv_blocks;
    for (int p = 0; p < N_PRIO; p++)
        g->waiting[p] += h->waiting[p], g->running[p] += h->running[p];
    g->max_batch_seqs += h->max_batch_seqs;
    g->budget_cut_steps += h->budget_cut_steps;
    g->budget_over_steps += h->budget_over_steps;
    dst->spec_drafts += src->spec_drafts;
    dst->spec_draft_tokens += src->spec_draft_tokens;
    dst->spec_accepted += src->spec_accepted;
    for (int j = 0; j < DUET_SPEC_MAX_K; j++)
        dst->spec_accepted_pos[j] += src->spec_accepted_pos[j];
    dst->spec_draft_s += src->spec_draft_s;
    g->spec_offered_tokens += h->spec_offered_tokens;
    g->spec_throttled_tokens += h->spec_throttled_tokens;
    g->spec_capped_tokens += h->spec_capped_tokens;
    for (int j = 0; j < 5; j++)
        g->spec_steps[j] += h->spec_steps[j];
    g->max_batch_tokens += h->max_batch_tokens;
    g->kv_blocks += h->kv_blocks;
    g->kv_usage = g->kv_blocks ? used / g->kv_blocks : 0;
    if (!g->kv_block_size) g->kv_block_size = h->kv_block_size;
    if (!g->prefill_chunk) g->prefill_chunk = h->prefill_chunk, g->batch_timeout_s = h->batch_timeout_s;
}

char *duet__metrics_render_sum(duet_metrics *const *ms, int n) {
    counters *c = calloc(1, sizeof *c), *one = malloc(sizeof *one);
    if (!c || !one || n < 1) {
        free(c), free(one);
        return NULL;
    }
    double now = now_s(), busy_ratio = 0;
    int healthy = 0;
    for (int i = 0; i < n; i++) {
        pthread_mutex_lock(&ms[i]->mu);
        *one = ms[i]->c;
        busy_ratio += busy_ratio_locked(ms[i], now, BUSY_GAUGE_WINDOW_S) / n;
        pthread_mutex_unlock(&ms[i]->mu);
        healthy += !one->unhealthy;
        if (i == 0) {
            *c = *one;
            continue;
        }
        counters_add(c, one);
    }
    c->unhealthy = healthy == 0;
    free(one);
    return render(ms[0], c, now, busy_ratio);
}

const char *duet__metrics_model_name(const duet_metrics *m) {
    return m->model_name;
}

void duet__metrics_summary(duet_metrics *m, duet_metrics_summary *out) {
    pthread_mutex_lock(&m->mu);
    out->gauges = m->c.gauges;
    out->healthy = !m->c.unhealthy;
    out->step_tokens = m->c.batch_tokens.sum;
    out->busy_s = m->c.busy_s;
    out->prompt_tokens = m->c.prompt_tokens;
    out->generated_tokens = m->c.generated_tokens;
    out->finished = 0;
    for (int p = 0; p < N_PRIO; p++)
        for (int o = 0; o < OUT_REJECTED; o++)
            out->finished += m->c.requests[p][o];
    pthread_mutex_unlock(&m->mu);
}
