/* step_cost.c — the step-cost model: features of a step, the
 * non-negative least-squares fit (offline over samples, online with
 * forgetting), the JSON file, and the Prometheus gauges.
 *
 * The offline fit minimises relative errors (each sample weighted by
 * 1/seconds^2); the online one absolute errors with forgetting. Both solve
 * the normal equations in scaled coordinates (each column
 * divided by its root mean square, so a per-token term and a per-position
 * term of very different sizes are equally well conditioned) by Cholesky,
 * with a small ridge towards the prior. A coefficient that comes out
 * negative is fixed at zero and the rest refitted (the time a step takes
 * never shrinks with more work in it).
 */
#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../backends/backend.h"
#include "step_cost.h"

#define N DUET__SC_N
#define FORMAT_NAME "duet-step-cost"
#define FORMAT_VERSION 1

static const char *const term_names[N] = {"intercept", "per_decode_token", "per_prefill_token",
                                          "per_decode_context", "per_prefill_context"};

const char *duet_step_cost_term(int i) {
    return i >= 0 && i < N ? term_names[i] : NULL;
}

static void features(const duet_step_shape *s, double x[N]) {
    x[0] = 1;
    x[1] = s->n_decode;
    x[2] = s->n_prefill;
    x[3] = s->decode_ctx;
    x[4] = s->prefill_ctx;
}

void duet_step_shape_add(duet_step_shape *s, int pos, int n_tokens, bool decode) {
    /* Token t of the entry sits at pos + t and attends to pos + t + 1 positions. */
    double span = (double)n_tokens * pos + (double)n_tokens * (n_tokens + 1) / 2;
    if (decode) {
        s->n_decode += n_tokens;
        s->decode_ctx += span;
    } else {
        s->n_prefill += n_tokens;
        s->prefill_ctx += span;
    }
}

/* The token-count correction at a step of `tokens` tokens. */
static double curve(const duet_step_cost *m, double tokens) {
    int n = m->n_knots < DUET_STEP_COST_KNOTS ? m->n_knots : DUET_STEP_COST_KNOTS;
    if (n <= 0) return 0;
    if (tokens <= m->knot_tokens[0]) return m->knot_s[0];
    for (int k = 1; k < n; k++)
        if (tokens <= m->knot_tokens[k]) {
            double a = m->knot_tokens[k - 1], b = m->knot_tokens[k], f = (tokens - a) / (b - a);
            return m->knot_s[k - 1] + f * (m->knot_s[k] - m->knot_s[k - 1]);
        }
    return m->knot_s[n - 1];
}

static double linear(const duet_step_cost *m, const duet_step_shape *s) {
    double x[N], t = 0;
    features(s, x);
    for (int j = 0; j < N; j++)
        t += m->coef[j] * x[j];
    return t;
}

double duet_step_cost_predict(const duet_step_cost *m, const duet_step_shape *s) {
    double t = linear(m, s) + curve(m, (double)s->n_decode + s->n_prefill);
    return t > 0 ? t : 0;
}

void duet_step_cost_scale(duet_step_cost *m, double f) {
    if (!m || !(f > 0) || !isfinite(f)) return;
    for (int j = 0; j < N; j++)
        m->coef[j] *= f;
    for (int k = 0; k < m->n_knots; k++)
        m->knot_s[k] *= f;
    m->rmse_s *= f;
}

/* Cholesky solve of M[P][P] s = r over the indices set[0..k) (M symmetric
 * positive definite); false when it is not, numerically. */
static bool solve_subset(const double M[N][N], const double r[N], const int *set, int k, double s[N]) {
    double L[N][N], y[N];
    for (int p = 0; p < k; p++)
        for (int q = 0; q <= p; q++) {
            double sum = M[set[p]][set[q]];
            for (int t = 0; t < q; t++)
                sum -= L[p][t] * L[q][t];
            if (p == q) {
                if (!(sum > 0)) return false;
                L[p][p] = sqrt(sum);
            } else {
                L[p][q] = sum / L[q][q];
            }
        }
    for (int p = 0; p < k; p++) { /* L y = r */
        double sum = r[set[p]];
        for (int t = 0; t < p; t++)
            sum -= L[p][t] * y[t];
        y[p] = sum / L[p][p];
    }
    for (int p = k - 1; p >= 0; p--) { /* L^T s = y */
        double sum = y[p];
        for (int t = p + 1; t < k; t++)
            sum -= L[t][p] * s[set[t]];
        s[set[p]] = sum / L[p][p];
    }
    return true;
}

/* Minimises beta^T A beta - 2 b^T beta plus a ridge toward the prior over
 * beta >= 0 (Lawson and Hanson's active-set method on the normal
 * equations): columns never exercised (A[j][j] == 0) keep the prior's
 * value; a term leaves the free set when its coefficient would turn
 * negative and comes back when the gradient says it helps. (Pinning the
 * most negative term and never freeing it again missed the optimum: in
 * test_step_cost's random devices it held an intercept at 0 that the
 * optimum has positive.) `eps` is the ridge in scaled coordinates
 * (relative to each column's mean square). */
static void solve_nonneg(const double A[N][N], const double b[N], const double prior[N], double eps,
                         double beta[N]) {
    int idx[N], m = 0;
    for (int j = 0; j < N; j++) {
        beta[j] = prior[j] > 0 ? prior[j] : 0;
        if (A[j][j] > 0) idx[m++] = j;
    }
    if (m == 0) return;
    /* The scaled problem over the exercised columns: minimise
     * z^T Q z / 2 - c^T z, z >= 0, with beta = D z. */
    double d[N], Q[N][N], c[N], z[N] = {0}, cmax = 0;
    for (int p = 0; p < m; p++)
        d[p] = 1 / sqrt(A[idx[p]][idx[p]]);
    for (int p = 0; p < m; p++) {
        int j = idx[p];
        double rhs = b[j];
        for (int k = 0; k < N; k++)
            if (!(A[k][k] > 0)) rhs -= A[j][k] * beta[k];
        c[p] = d[p] * rhs + eps * (prior[j] > 0 ? prior[j] : 0) / d[p];
        cmax = fmax(cmax, fabs(c[p]));
        for (int q = 0; q < m; q++)
            Q[p][q] = d[p] * A[j][idx[q]] * d[q] + (p == q ? eps : 0);
    }
    bool free_[N] = {false};
    const double tol = 1e-12 * (1 + cmax);
    for (int iter = 0; iter < 3 * N; iter++) {
        /* The most helpful held term: the largest descent direction. */
        int t = -1;
        double best = tol;
        for (int p = 0; p < m; p++) {
            if (free_[p]) continue;
            double w = c[p];
            for (int q = 0; q < m; q++)
                w -= Q[p][q] * z[q];
            if (w > best) best = w, t = p;
        }
        if (t < 0) break;
        free_[t] = true;
        for (int inner = 0; inner < N; inner++) {
            int set[N], k = 0;
            for (int p = 0; p < m; p++)
                if (free_[p]) set[k++] = p;
            double s[N] = {0};
            if (!solve_subset((const double(*)[N])Q, c, set, k, s)) { /* numerically singular */
                for (int p = 0; p < m; p++)
                    beta[idx[p]] = prior[idx[p]] > 0 ? prior[idx[p]] : 0;
                return;
            }
            double alpha = 1;
            for (int p = 0; p < k; p++)
                if (s[set[p]] <= 0) alpha = fmin(alpha, z[set[p]] / (z[set[p]] - s[set[p]]));
            for (int p = 0; p < k; p++)
                z[set[p]] += alpha * (s[set[p]] - z[set[p]]);
            if (alpha >= 1) break;
            for (int p = 0; p < k; p++) /* those that reached 0 are held again */
                if (z[set[p]] <= 0) z[set[p]] = 0, free_[set[p]] = false;
        }
    }
    for (int p = 0; p < m; p++)
        beta[idx[p]] = d[p] * z[p];
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static bool sample_ok(const duet_step_sample *s) {
    const duet_step_shape *h = &s->shape;
    return isfinite(s->seconds) && s->seconds >= 0 && h->n_decode >= 0 && h->n_prefill >= 0 &&
           isfinite(h->decode_ctx) && h->decode_ctx >= 0 && isfinite(h->prefill_ctx) && h->prefill_ctx >= 0;
}

/* Fit quality of m over the samples. */
static void quality(duet_step_cost *m, const duet_step_sample *samples, int n) {
    double mean = 0, ss_res = 0, ss_tot = 0, rel = 0;
    int n_rel = 0;
    for (int i = 0; i < n; i++)
        mean += samples[i].seconds / n;
    for (int i = 0; i < n; i++) {
        double y = samples[i].seconds, e = duet_step_cost_predict(m, &samples[i].shape) - y;
        ss_res += e * e;
        ss_tot += (y - mean) * (y - mean);
        if (y > 0) rel += fabs(e) / y, n_rel++;
    }
    m->n_samples = n;
    m->rmse_s = sqrt(ss_res / n);
    m->mean_rel_err = n_rel ? rel / n_rel : 0;
    m->r2 = ss_tot > 0 ? 1 - ss_res / ss_tot : 1;
}

/* The token-count correction of a linear fit: a knot at each distinct
 * token count of the samples (at most DUET_STEP_COST_KNOTS, spread over
 * the range; a sample goes to its nearest knot), valued at the median of
 * its samples' residuals. None with fewer than two distinct counts. */
static void fit_curve(duet_step_cost *m, const duet_step_sample *samples, int n) {
    m->n_knots = 0;
    int *tok = malloc((size_t)n * sizeof *tok), *counts = malloc((size_t)n * sizeof *counts);
    double *res = malloc((size_t)n * sizeof *res);
    int n_counts = 0;
    for (int i = 0; tok && counts && res && i < n; i++)
        tok[i] = samples[i].shape.n_decode + samples[i].shape.n_prefill;
    /* The distinct counts, ascending (a selection sort over a small grid). */
    for (int last = -1; tok && counts && res;) {
        int next = -1;
        for (int i = 0; i < n; i++)
            if (tok[i] > last && (next < 0 || tok[i] < next)) next = tok[i];
        if (next < 0) break;
        counts[n_counts++] = last = next;
    }
    if (n_counts >= 2) {
        int kn = n_counts < DUET_STEP_COST_KNOTS ? n_counts : DUET_STEP_COST_KNOTS;
        for (int k = 0; k < kn; k++)
            m->knot_tokens[k] =
                counts[kn == n_counts ? k : (int)((double)k * (n_counts - 1) / (kn - 1) + 0.5)];
        for (int k = 0; k < kn; k++) {
            int r = 0;
            for (int i = 0; i < n; i++) {
                int best = 0; /* the sample's nearest knot */
                for (int q = 1; q < kn; q++)
                    if (abs(tok[i] - m->knot_tokens[q]) < abs(tok[i] - m->knot_tokens[best])) best = q;
                if (best == k) res[r++] = samples[i].seconds - linear(m, &samples[i].shape);
            }
            qsort(res, (size_t)r, sizeof *res, cmp_double);
            m->knot_s[k] = r == 0 ? 0 : r % 2 ? res[r / 2] : (res[r / 2 - 1] + res[r / 2]) / 2;
        }
        m->n_knots = kn;
    }
    free(tok), free(counts), free(res);
}

duet_status duet_step_cost_fit(const duet_step_sample *samples, int n, duet_step_cost *out) {
    if (!samples || n < 1 || !out) return duet__error(DUET_INVALID_ARGUMENT, "step-cost fit: no samples");
    double A[N][N] = {{0}}, b[N] = {0}, zero[N] = {0};
    for (int i = 0; i < n; i++) {
        if (!sample_ok(&samples[i]))
            return duet__error(DUET_INVALID_ARGUMENT,
                               "step-cost fit: sample %d is not finite and non-negative (%g s)", i,
                               samples[i].seconds);
        /* Relative errors: each shape counts alike, so a 1 ms decode step is
         * fitted as closely as a 100 ms prompt chunk. */
        double x[N], y = samples[i].seconds, w = 1 / (y > 1e-9 ? y * y : 1e-18);
        features(&samples[i].shape, x);
        for (int j = 0; j < N; j++) {
            b[j] += w * x[j] * y;
            for (int k = 0; k < N; k++)
                A[j][k] += w * x[j] * x[k];
        }
    }
    memset(out, 0, sizeof *out);
    solve_nonneg((const double(*)[N])A, b, zero, 1e-10, out->coef);
    fit_curve(out, samples, n);
    quality(out, samples, n);
    return DUET_OK;
}

/* ---- dispersion ------------------------------------------------------------ */

/* Dense in the upper tail, where queueing feels it. */
static const double noise_levels[] = {0,   0.01, 0.05, 0.1, 0.2,  0.3,  0.4, 0.5,
                                      0.6, 0.7,  0.8,  0.9, 0.95, 0.99, 1};
#define N_NOISE_LEVELS ((int)(sizeof noise_levels / sizeof noise_levels[0]))
_Static_assert(N_NOISE_LEVELS <= DUET_STEP_COST_NOISE_Q, "noise quantiles");

void duet_step_cost_fit_noise(duet_step_cost *m, const duet_step_sample *steps, int n) {
    m->n_noise = 0;
    double *r = n > 0 ? malloc((size_t)n * sizeof *r) : NULL;
    int k = 0;
    for (int i = 0; r && i < n; i++) {
        double pred = duet_step_cost_predict(m, &steps[i].shape);
        if (sample_ok(&steps[i]) && steps[i].seconds > 0 && pred > 0) r[k++] = steps[i].seconds / pred;
    }
    if (k >= 2) {
        qsort(r, (size_t)k, sizeof *r, cmp_double);
        for (int q = 0; q < N_NOISE_LEVELS; q++) {
            double at = noise_levels[q] * (k - 1);
            int lo = (int)at;
            double f = at - lo;
            m->noise_level[q] = noise_levels[q];
            m->noise_ratio[q] = lo + 1 < k ? r[lo] + f * (r[lo + 1] - r[lo]) : r[k - 1];
        }
        m->n_noise = N_NOISE_LEVELS;
    }
    free(r);
}

double duet_step_cost_noise_at(const duet_step_cost *m, double u) {
    int n = m->n_noise < DUET_STEP_COST_NOISE_Q ? m->n_noise : DUET_STEP_COST_NOISE_Q;
    if (n <= 0) return 1;
    if (u <= m->noise_level[0]) return m->noise_ratio[0];
    for (int k = 1; k < n; k++)
        if (u <= m->noise_level[k]) {
            double a = m->noise_level[k - 1], b = m->noise_level[k], f = b > a ? (u - a) / (b - a) : 1;
            return m->noise_ratio[k - 1] + f * (m->noise_ratio[k] - m->noise_ratio[k - 1]);
        }
    return m->noise_ratio[n - 1];
}

/* ---- online ---------------------------------------------------------------- */

#define ONLINE_REFIT_EVERY 8

void duet__step_cost_online_init(duet_step_cost_online *o, const duet_step_cost *prior, double forget,
                                 double prior_weight) {
    memset(o, 0, sizeof *o);
    o->forget = forget > 0 && forget <= 1 ? forget : 0.998;
    if (prior) {
        o->prior = *prior;
        o->current = *prior;
    }
    o->prior_weight = prior ? (prior_weight > 0 ? prior_weight : 2) : 1e-3;
}

static void online_refit(duet_step_cost_online *o) {
    o->since_fit = 0;
    if (o->wsum <= 0) return;
    duet_step_cost *c = &o->current;
    /* The prior counts as prior_weight steps of the recent mix: relative to
     * the weighted step count so far. */
    double eps = o->prior_weight / o->wsum;
    solve_nonneg((const double(*)[N])o->A, o->b, o->prior.coef, eps, c->coef);
    /* Fit quality from the sufficient statistics: the weighted residual sum
     * of squares is yy - 2 beta.b + beta^T A beta. */
    double res = o->yy, mean = o->b[0] / o->wsum;
    for (int j = 0; j < N; j++) {
        res -= 2 * c->coef[j] * o->b[j];
        for (int k = 0; k < N; k++)
            res += c->coef[j] * o->A[j][k] * c->coef[k];
    }
    if (res < 0) res = 0;
    double tot = o->yy - o->wsum * mean * mean;
    c->rmse_s = sqrt(res / o->wsum);
    c->r2 = tot > 0 ? 1 - res / tot : 1;
    c->mean_rel_err = o->rel_err_ewma;
    c->n_samples = o->n_steps > INT32_MAX ? INT32_MAX : (int)o->n_steps;
}

void duet__step_cost_online_observe(duet_step_cost_online *o, const duet_step_shape *s, double seconds) {
    if (!(isfinite(seconds) && seconds > 0)) return;
    duet_step_sample smp = {.shape = *s, .seconds = seconds};
    if (!sample_ok(&smp)) return;
    /* How well the model knew this step before learning from it. */
    double pred = duet_step_cost_predict(&o->current, s);
    double rel = pred > 0 ? fabs(pred - seconds) / seconds : 1;
    o->rel_err_ewma = o->n_steps ? 0.98 * o->rel_err_ewma + 0.02 * rel : rel;
    /* The linear terms learn what the prior's token-count correction
     * leaves (the correction itself stays the prior's). */
    seconds -= curve(&o->current, (double)s->n_decode + s->n_prefill);
    double x[N];
    features(s, x);
    for (int j = 0; j < N; j++) {
        o->b[j] = o->forget * o->b[j] + x[j] * seconds;
        for (int k = 0; k < N; k++)
            o->A[j][k] = o->forget * o->A[j][k] + x[j] * x[k];
    }
    o->yy = o->forget * o->yy + seconds * seconds;
    o->wsum = o->forget * o->wsum + 1;
    o->n_steps++;
    if (++o->since_fit >= ONLINE_REFIT_EVERY || o->n_steps <= ONLINE_REFIT_EVERY) online_refit(o);
}

const duet_step_cost *duet__step_cost_online_get(duet_step_cost_online *o) {
    if (o->since_fit) online_refit(o);
    return &o->current;
}

/* ---- the file ---------------------------------------------------------------- */

/* [a, b] as a JSON array of two numbers. */
static cJSON *num_pair(double a, double b) {
    cJSON *pair = cJSON_CreateArray();
    cJSON_AddItemToArray(pair, cJSON_CreateNumber(a));
    cJSON_AddItemToArray(pair, cJSON_CreateNumber(b));
    return pair;
}

duet_status duet_step_cost_save(const duet_step_cost *m, const duet_step_sample *samples, int n_samples,
                                const char *path) {
    if (!m || !path) return duet__error(DUET_INVALID_ARGUMENT, "step-cost save: NULL argument");
    cJSON *root = cJSON_CreateObject();
    cJSON_AddStringToObject(root, "format", FORMAT_NAME);
    cJSON_AddNumberToObject(root, "version", FORMAT_VERSION);
    cJSON_AddStringToObject(root, "model", m->model);
    cJSON_AddStringToObject(root, "backend", m->backend);
    cJSON_AddStringToObject(root, "device", m->device);
    cJSON_AddNumberToObject(root, "n_ctx", m->n_ctx);
    cJSON_AddStringToObject(root, "formula",
                            "seconds = intercept + per_decode_token*n_decode + per_prefill_token*n_prefill"
                            " + per_decode_context*decode_ctx + per_prefill_context*prefill_ctx");
    cJSON *terms = cJSON_AddObjectToObject(root, "terms");
    for (int j = 0; j < N; j++)
        cJSON_AddNumberToObject(terms, term_names[j], m->coef[j]);
    cJSON *fit = cJSON_AddObjectToObject(root, "fit");
    cJSON_AddNumberToObject(fit, "samples", m->n_samples);
    cJSON_AddNumberToObject(fit, "rmse_s", m->rmse_s);
    cJSON_AddNumberToObject(fit, "mean_rel_err", m->mean_rel_err);
    cJSON_AddNumberToObject(fit, "r2", m->r2);
    if (m->n_knots > 0) {
        /* [[tokens, seconds], ...]: the token-count correction. */
        cJSON *kn = cJSON_AddArrayToObject(root, "token_curve");
        for (int k = 0; k < m->n_knots && k < DUET_STEP_COST_KNOTS; k++)
            cJSON_AddItemToArray(kn, num_pair(m->knot_tokens[k], m->knot_s[k]));
    }
    if (m->n_noise > 0) {
        /* [[level, ratio], ...]: quantiles of measured / predicted. */
        cJSON *nq = cJSON_AddArrayToObject(root, "step_noise");
        for (int k = 0; k < m->n_noise && k < DUET_STEP_COST_NOISE_Q; k++)
            cJSON_AddItemToArray(nq, num_pair(m->noise_level[k], m->noise_ratio[k]));
    }
    if (samples && n_samples > 0) {
        cJSON *arr = cJSON_AddArrayToObject(root, "samples");
        for (int i = 0; i < n_samples; i++) {
            const duet_step_sample *s = &samples[i];
            cJSON *o = cJSON_CreateObject();
            cJSON_AddNumberToObject(o, "n_decode", s->shape.n_decode);
            cJSON_AddNumberToObject(o, "n_prefill", s->shape.n_prefill);
            cJSON_AddNumberToObject(o, "decode_ctx", s->shape.decode_ctx);
            cJSON_AddNumberToObject(o, "prefill_ctx", s->shape.prefill_ctx);
            cJSON_AddNumberToObject(o, "seconds", s->seconds);
            cJSON_AddItemToArray(arr, o);
        }
    }
    char *text = cJSON_Print(root);
    cJSON_Delete(root);
    if (!text) return duet__error(DUET_OUT_OF_MEMORY, "step-cost save: out of memory");
    FILE *f = fopen(path, "w");
    if (!f) {
        duet_status st = duet__error(DUET_IO, "%s: cannot write: %s", path, strerror(errno));
        free(text);
        return st;
    }
    bool ok = fputs(text, f) >= 0 && fputc('\n', f) != EOF;
    ok = (fclose(f) == 0) && ok;
    free(text);
    return ok ? DUET_OK : duet__error(DUET_IO, "%s: write failed: %s", path, strerror(errno));
}

static void copy_str(const cJSON *root, const char *key, char *dst, size_t size) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, key);
    snprintf(dst, size, "%s", cJSON_IsString(v) ? v->valuestring : "");
}

/* Entry k of arr as a pair of numbers [a, b]; false when it is not one. */
static bool pair_at(const cJSON *arr, int k, double *a, double *b) {
    const cJSON *pair = cJSON_GetArrayItem(arr, k);
    const cJSON *x = cJSON_GetArrayItem(pair, 0), *y = cJSON_GetArrayItem(pair, 1);
    if (!cJSON_IsArray(pair) || cJSON_GetArraySize(pair) != 2 || !cJSON_IsNumber(x) || !cJSON_IsNumber(y))
        return false;
    *a = x->valuedouble, *b = y->valuedouble;
    return true;
}

/* The optional "token_curve": [[tokens, seconds], ...], tokens ascending
 * and positive, seconds finite. */
static duet_status load_curve(const cJSON *root, const char *path, duet_step_cost *out) {
    const cJSON *kn = cJSON_GetObjectItemCaseSensitive(root, "token_curve");
    if (!kn) return DUET_OK;
    int n = cJSON_IsArray(kn) ? cJSON_GetArraySize(kn) : -1;
    if (n < 0 || n > DUET_STEP_COST_KNOTS)
        return duet__error(DUET_INVALID_ARGUMENT, "%s: \"token_curve\" must be an array of at most %d pairs",
                           path, DUET_STEP_COST_KNOTS);
    for (int k = 0; k < n; k++) {
        double t, v;
        if (!pair_at(kn, k, &t, &v) || !(t >= 1 && t <= 1e6 && t == (int)t) ||
            (k && t <= out->knot_tokens[k - 1]) || !isfinite(v))
            return duet__error(DUET_INVALID_ARGUMENT,
                               "%s: \"token_curve\" entry %d must be [tokens, seconds]: whole tokens >= 1, "
                               "ascending, and finite seconds",
                               path, k);
        out->knot_tokens[k] = (int)t;
        out->knot_s[k] = v;
    }
    out->n_knots = n;
    return DUET_OK;
}

/* The optional "step_noise": [[level, ratio], ...], at least two, levels
 * ascending in [0, 1], ratios positive, finite and non-decreasing (a
 * quantile function). Older files have none: no dispersion. */
static duet_status load_noise(const cJSON *root, const char *path, duet_step_cost *out) {
    const cJSON *nq = cJSON_GetObjectItemCaseSensitive(root, "step_noise");
    if (!nq) return DUET_OK;
    int n = cJSON_IsArray(nq) ? cJSON_GetArraySize(nq) : -1;
    if (n < 2 || n > DUET_STEP_COST_NOISE_Q)
        return duet__error(DUET_INVALID_ARGUMENT, "%s: \"step_noise\" must be an array of 2 to %d pairs",
                           path, DUET_STEP_COST_NOISE_Q);
    for (int k = 0; k < n; k++) {
        double l, v;
        if (!pair_at(nq, k, &l, &v) || !(l >= 0 && l <= 1) || (k && l <= out->noise_level[k - 1]) ||
            !(isfinite(v) && v > 0) || (k && v < out->noise_ratio[k - 1]))
            return duet__error(
                DUET_INVALID_ARGUMENT,
                "%s: \"step_noise\" entry %d must be [level, ratio]: levels ascending in [0, 1], "
                "ratios positive, finite and non-decreasing",
                path, k);
        out->noise_level[k] = l;
        out->noise_ratio[k] = v;
    }
    out->n_noise = n;
    return DUET_OK;
}

duet_status duet_step_cost_load(const char *path, duet_step_cost *out) {
    if (!path || !out) return duet__error(DUET_INVALID_ARGUMENT, "step-cost load: NULL argument");
    memset(out, 0, sizeof *out);
    FILE *f = fopen(path, "rb");
    if (!f) return duet__error(DUET_IO, "%s: cannot open: %s", path, strerror(errno));
    char *text = NULL;
    size_t len = 0, cap = 0;
    for (;;) {
        if (len + 4096 + 1 > cap) {
            cap = cap ? cap * 2 : 8192;
            char *t = cap > ((size_t)64 << 20) ? NULL : realloc(text, cap);
            if (!t) {
                free(text);
                fclose(f);
                return duet__error(DUET_INVALID_ARGUMENT, "%s: too large for a step-cost file", path);
            }
            text = t;
        }
        size_t got = fread(text + len, 1, 4096, f);
        len += got;
        if (got < 4096) break;
    }
    bool rerr = ferror(f);
    fclose(f);
    if (rerr) {
        free(text);
        return duet__error(DUET_IO, "%s: read error", path);
    }
    text[len] = 0;
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithOpts(text, &end, false);
    duet_status st = DUET_OK;
    if (!root) {
        st = duet__error(DUET_INVALID_ARGUMENT, "%s: not JSON (error near byte %ld)", path,
                         end ? (long)(end - text) : 0L);
        free(text);
        return st;
    }
    free(text);
    const cJSON *fmt = cJSON_GetObjectItemCaseSensitive(root, "format");
    const cJSON *ver = cJSON_GetObjectItemCaseSensitive(root, "version");
    const cJSON *terms = cJSON_GetObjectItemCaseSensitive(root, "terms");
    if (!cJSON_IsObject(root) || !cJSON_IsString(fmt) || strcmp(fmt->valuestring, FORMAT_NAME) != 0) {
        st = duet__error(DUET_INVALID_ARGUMENT, "%s: not a step-cost file (\"format\" is not \"%s\")", path,
                         FORMAT_NAME);
    } else if (!cJSON_IsNumber(ver) || ver->valuedouble != FORMAT_VERSION) {
        st = duet__error(DUET_INVALID_ARGUMENT, "%s: step-cost format version %g; this duet reads %d", path,
                         cJSON_IsNumber(ver) ? ver->valuedouble : -1.0, FORMAT_VERSION);
    } else if (!cJSON_IsObject(terms)) {
        st = duet__error(DUET_INVALID_ARGUMENT, "%s: no \"terms\" object", path);
    }
    for (int j = 0; !st && j < N; j++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(terms, term_names[j]);
        if (!cJSON_IsNumber(v))
            st = duet__error(DUET_INVALID_ARGUMENT, "%s: term \"%s\" is missing or not a number", path,
                             term_names[j]);
        else if (!isfinite(v->valuedouble) || v->valuedouble < 0)
            st = duet__error(DUET_INVALID_ARGUMENT, "%s: term \"%s\" is %g; it must be finite and >= 0", path,
                             term_names[j], v->valuedouble);
        else
            out->coef[j] = v->valuedouble;
    }
    if (!st) {
        copy_str(root, "model", out->model, sizeof out->model);
        copy_str(root, "backend", out->backend, sizeof out->backend);
        copy_str(root, "device", out->device, sizeof out->device);
        const cJSON *nc = cJSON_GetObjectItemCaseSensitive(root, "n_ctx");
        out->n_ctx = cJSON_IsNumber(nc) && nc->valuedouble >= 0 && nc->valuedouble < 1e8 ? nc->valueint : 0;
        const cJSON *fit = cJSON_GetObjectItemCaseSensitive(root, "fit");
        const cJSON *v;
        if ((v = cJSON_GetObjectItemCaseSensitive(fit, "samples")) && cJSON_IsNumber(v) &&
            v->valuedouble >= 0 && v->valuedouble < 1e9)
            out->n_samples = v->valueint;
        if ((v = cJSON_GetObjectItemCaseSensitive(fit, "rmse_s")) && cJSON_IsNumber(v))
            out->rmse_s = v->valuedouble;
        if ((v = cJSON_GetObjectItemCaseSensitive(fit, "mean_rel_err")) && cJSON_IsNumber(v))
            out->mean_rel_err = v->valuedouble;
        if ((v = cJSON_GetObjectItemCaseSensitive(fit, "r2")) && cJSON_IsNumber(v)) out->r2 = v->valuedouble;
        st = load_curve(root, path, out);
        if (!st) st = load_noise(root, path, out);
    }
    if (st) memset(out, 0, sizeof *out);
    cJSON_Delete(root);
    return st;
}

/* ---- metrics ----------------------------------------------------------------- */

/* Finest around 1, where a settled profile's steps fall; up to 10x for a
 * machine busy elsewhere. */
const double duet__served_ratio_le[DUET__SERVED_RATIO_BUCKETS] = {
    0.5,  0.7, 0.8, 0.85, 0.9, 0.93, 0.96, 0.98, 1.0, 1.02, 1.04, 1.07, 1.1,
    1.15, 1.2, 1.3, 1.4,  1.5, 1.75, 2,    2.5,  3,   4,    6,    10};

void duet__served_speed_add(duet_served_speed *s, double measured_s, double predicted_s) {
    if (!(measured_s >= 0) || !(predicted_s > 0) || !isfinite(measured_s) || !isfinite(predicted_s)) return;
    double ratio = measured_s / predicted_s;
    int k = 0;
    while (k < DUET__SERVED_RATIO_BUCKETS && ratio > duet__served_ratio_le[k])
        k++;
    s->ratio_count[k]++;
    s->ratio_sum += ratio;
    s->served_s += measured_s;
    s->profiled_s += predicted_s;
}

void duet__step_cost_prom_families(duet_text *t, const duet_step_cost_report *r, const char *const *labels,
                                   int n) {
    duet__text_printf(
        t, "# HELP duet_step_cost_seconds The step-cost model the engine fits online from its steps "
           "(seconds per unit of each term).\n"
           "# TYPE duet_step_cost_seconds gauge\n");
    for (int i = 0; i < n; i++)
        for (int j = 0; j < N; j++)
            duet__text_printf(t, "duet_step_cost_seconds{%s,term=\"%s\"} %.9g\n", labels[i], term_names[j],
                              r[i].model.coef[j]);
    duet__text_printf(t, "# HELP duet_step_cost_steps_total Steps the step-cost model has learnt from.\n"
                         "# TYPE duet_step_cost_steps_total counter\n");
    for (int i = 0; i < n; i++)
        duet__text_printf(t, "duet_step_cost_steps_total{%s} %llu\n", labels[i],
                          (unsigned long long)r[i].n_steps);
    duet__text_printf(
        t, "# HELP duet_step_cost_relative_error Recent mean |predicted - measured| / measured step "
           "time.\n# TYPE duet_step_cost_relative_error gauge\n");
    for (int i = 0; i < n; i++)
        duet__text_printf(t, "duet_step_cost_relative_error{%s} %.6g\n", labels[i], r[i].model.mean_rel_err);
    duet__text_printf(t, "# HELP duet_step_cost_served_seconds_total Measured seconds of the steps served "
                         "since a profile seeded the step-cost model (--step-cost).\n"
                         "# TYPE duet_step_cost_served_seconds_total counter\n");
    for (int i = 0; i < n; i++)
        if (r[i].seeded)
            duet__text_printf(t, "duet_step_cost_served_seconds_total{%s} %.9g\n", labels[i],
                              r[i].speed.served_s);
    duet__text_printf(t, "# HELP duet_step_cost_profiled_seconds_total The seeding profile's prediction for "
                         "the same steps: served / profiled is serving's speed against the profile's.\n"
                         "# TYPE duet_step_cost_profiled_seconds_total counter\n");
    for (int i = 0; i < n; i++)
        if (r[i].seeded)
            duet__text_printf(t, "duet_step_cost_profiled_seconds_total{%s} %.9g\n", labels[i],
                              r[i].speed.profiled_s);
    duet__text_printf(t,
                      "# HELP duet_step_cost_served_ratio Each served step's measured time over the seeding "
                      "profile's prediction.\n"
                      "# TYPE duet_step_cost_served_ratio histogram\n");
    for (int i = 0; i < n; i++) {
        if (!r[i].seeded) continue;
        uint64_t cum = 0;
        for (int k = 0; k <= DUET__SERVED_RATIO_BUCKETS; k++) {
            cum += r[i].speed.ratio_count[k];
            if (k < DUET__SERVED_RATIO_BUCKETS)
                duet__text_printf(t, "duet_step_cost_served_ratio_bucket{%s,le=\"%g\"} %llu\n", labels[i],
                                  duet__served_ratio_le[k], (unsigned long long)cum);
            else
                duet__text_printf(t, "duet_step_cost_served_ratio_bucket{%s,le=\"+Inf\"} %llu\n", labels[i],
                                  (unsigned long long)cum);
        }
        duet__text_printf(t, "duet_step_cost_served_ratio_sum{%s} %.9g\n", labels[i], r[i].speed.ratio_sum);
        duet__text_printf(t, "duet_step_cost_served_ratio_count{%s} %llu\n", labels[i],
                          (unsigned long long)cum);
    }
}

char *duet__step_cost_render_prom(const duet_step_cost_report *r, const char *model_name) {
    char label[512 + 16];
    size_t k = snprintf(label, sizeof label, "model_name=\"");
    for (const char *p = model_name ? model_name : ""; *p && k + 4 < sizeof label; p++) {
        if (*p == '\\' || *p == '"')
            label[k++] = '\\', label[k++] = *p;
        else if (*p == '\n')
            label[k++] = '\\', label[k++] = 'n';
        else
            label[k++] = *p;
    }
    label[k++] = '"';
    label[k] = 0;
    const char *labels[1] = {label};
    duet_text t = {0};
    duet__step_cost_prom_families(&t, r, labels, 1);
    if (t.oom) {
        free(t.p);
        return NULL;
    }
    return t.p;
}
