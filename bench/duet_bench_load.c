/* duet_bench_load.c — the workload: random numbers, arrival gaps, and the
 * prompts (random token ids, word prompts, or a JSONL dataset) with their
 * output lengths and priorities; --rate-profile's load over time (arrivals
 * mapped through the integral of a piecewise-linear rate). Everything is a function of the seed, so
 * every sweep point and every device sees the same requests. */
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "duet_bench.h"

/* ---- random numbers: xoshiro256** seeded through splitmix64 ------------------ */

static uint64_t splitmix64(uint64_t *s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

void db_rng_seed(db_rng *r, uint64_t seed) {
    for (int i = 0; i < 4; i++)
        r->s[i] = splitmix64(&seed);
}

static uint64_t rotl(uint64_t x, int k) {
    return (x << k) | (x >> (64 - k));
}

uint64_t db_rng_next(db_rng *r) {
    uint64_t *s = r->s;
    uint64_t out = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return out;
}

double db_rng_uniform(db_rng *r) {
    return (double)(db_rng_next(r) >> 11) * 0x1.0p-53;
}

/* A standard normal by Box-Muller (one of the pair; simplicity over speed). */
static double rng_normal(db_rng *r) {
    double u1 = db_rng_uniform(r), u2 = db_rng_uniform(r);
    if (u1 < 1e-300) u1 = 1e-300;
    return sqrt(-2.0 * log(u1)) * cos(2.0 * M_PI * u2);
}

double db_rng_gamma(db_rng *r, double shape, double scale) {
    if (shape < 1) {
        /* Gamma(a) = Gamma(a+1) * U^(1/a). */
        double u = db_rng_uniform(r);
        if (u < 1e-300) u = 1e-300;
        return db_rng_gamma(r, shape + 1, scale) * pow(u, 1.0 / shape);
    }
    double d = shape - 1.0 / 3.0, c = 1.0 / sqrt(9.0 * d);
    for (;;) {
        double x, v;
        do {
            x = rng_normal(r);
            v = 1.0 + c * x;
        } while (v <= 0);
        v = v * v * v;
        double u = db_rng_uniform(r);
        if (u < 1 - 0.0331 * x * x * x * x) return d * v * scale;
        if (u > 0 && log(u) < 0.5 * x * x + d * (1 - v + log(v))) return d * v * scale;
    }
}

double db_next_gap(db_rng *r, double rate, double burstiness) {
    if (isinf(rate) || rate <= 0) return 0;
    double shape = burstiness > 0 ? burstiness : 1.0;
    /* Mean shape*scale = 1/rate whatever the burstiness. */
    return db_rng_gamma(r, shape, 1.0 / (rate * shape));
}

/* ---- the rate profile ------------------------------------------------------- */

bool db_profile_parse(const char *s, db_profile *out, char *err, size_t esize) {
    memset(out, 0, sizeof *out);
    const char *p = s;
    while (*p) {
        char *end;
        double t = strtod(p, &end);
        if (end == p || *end != ':') goto bad;
        p = end + 1;
        double r = strtod(p, &end);
        if (end == p || (*end && *end != ',')) goto bad;
        p = *end ? end + 1 : end;
        if (out->n == DB_MAX_KNOTS) {
            snprintf(err, esize, "--rate-profile: at most %d knots", DB_MAX_KNOTS);
            return false;
        }
        if (!isfinite(t) || !isfinite(r) || r < 0 || r > 1e6 || t > 1e7 ||
            (out->n ? t < out->t[out->n - 1] : t != 0)) {
            snprintf(err, esize,
                     "--rate-profile: knot %d (%g:%g): times start at 0 and do not decrease, rates are in "
                     "[0, 1e6]",
                     out->n + 1, t, r);
            return false;
        }
        out->t[out->n] = t, out->rate[out->n] = r;
        out->n++;
    }
    if (out->n < 2 || out->t[out->n - 1] <= 0 || db_profile_cumulative(out, db_profile_end(out)) <= 0) {
        snprintf(err, esize, "--rate-profile: at least two knots, a positive end time and some load");
        return false;
    }
    return true;
bad:
    snprintf(err, esize,
             "--rate-profile wants SECONDS:RATE,SECONDS:RATE,... (e.g. 0:1,300:6,600:1), got '%s'", s);
    return false;
}

double db_profile_end(const db_profile *p) {
    return p->n ? p->t[p->n - 1] : 0;
}

double db_profile_rate(const db_profile *p, double t) {
    if (p->n == 0 || t < 0 || t > db_profile_end(p)) return 0;
    for (int i = 1; i < p->n; i++)
        if (t <= p->t[i] && p->t[i] > p->t[i - 1])
            return p->rate[i - 1] +
                   (p->rate[i] - p->rate[i - 1]) * (t - p->t[i - 1]) / (p->t[i] - p->t[i - 1]);
    return p->rate[p->n - 1];
}

double db_profile_cumulative(const db_profile *p, double t) {
    double sum = 0;
    for (int i = 1; i < p->n && t > p->t[i - 1]; i++) {
        double len = p->t[i] - p->t[i - 1];
        if (len <= 0) continue;
        double x = t < p->t[i] ? t - p->t[i - 1] : len;
        sum += x * (p->rate[i - 1] + 0.5 * (p->rate[i] - p->rate[i - 1]) / len * x);
    }
    return sum;
}

double db_profile_invert(const db_profile *p, double u) {
    double sum = 0;
    for (int i = 1; i < p->n; i++) {
        double len = p->t[i] - p->t[i - 1];
        if (len <= 0) continue;
        double r0 = p->rate[i - 1], a = (p->rate[i] - r0) / len;
        double seg = len * (r0 + 0.5 * a * len);
        if (u <= sum + seg) {
            /* Solve r0 x + a x^2 / 2 = du in the stable form (no
             * cancellation when a is small or negative). */
            double du = u - sum, disc = r0 * r0 + 2 * a * du;
            double x = 2 * du / (r0 + sqrt(disc > 0 ? disc : 0));
            if (!isfinite(x)) x = 0; /* du = 0 at a rate of 0 */
            return p->t[i - 1] + (x < len ? x : len);
        }
        sum += seg;
    }
    return INFINITY;
}

void db_arrivals_init(db_arrivals *a, const db_load *load) {
    memset(a, 0, sizeof *a);
    a->load = load;
    db_rng_seed(&a->rng, load->seed);
}

double db_arrivals_next(db_arrivals *a) {
    const db_load *l = a->load;
    if (l->profile && l->profile->n) {
        a->u += db_next_gap(&a->rng, 1.0, l->burstiness);
        return a->t = db_profile_invert(l->profile, a->u);
    }
    if (a->started) a->t += db_next_gap(&a->rng, l->rate, l->burstiness);
    a->started = true;
    return a->t;
}

/* ---- prompts -------------------------------------------------------------- */

/* vLLM's random dataset: a length uniform in [len*(1-r), len*(1+r)], at least 1. */
static int draw_len(db_rng *r, int len, double ratio) {
    if (ratio <= 0) return len > 0 ? len : 1;
    int lo = (int)floor(len * (1 - ratio)), hi = (int)floor(len * (1 + ratio));
    if (lo < 1) lo = 1;
    if (hi < lo) hi = lo;
    return lo + (int)(db_rng_uniform(r) * (hi - lo + 1));
}

/* Words for text prompts when no tokenizer is at hand: short, common, so
 * most tokenizers give about one token per word. */
static const char *const words[] = {"the",  "a",      "of",   "and",   "to",   "in",  "is",   "it",
                                    "on",   "was",    "he",   "she",   "they", "we",  "you",  "day",
                                    "time", "sun",    "tree", "house", "dog",  "cat", "bird", "red",
                                    "big",  "little", "good", "new",   "old",  "man"};

static bool random_prompt(db_rng *r, const db_vocab *v, int in_len, db_prompt *p) {
    if (v && v->model && v->n_vocab > 4) {
        if (!(p->ids = malloc((size_t)in_len * sizeof *p->ids))) return false;
        int k = 0;
        if (v->bos >= 0) p->ids[k++] = v->bos;
        while (k < in_len) {
            /* Skip the first ids (unknown and control tokens in the usual
             * vocabularies) and the ends of text. */
            int32_t id = 3 + (int32_t)(db_rng_uniform(r) * (v->n_vocab - 3));
            if (id == v->bos || id == v->eos) continue;
            p->ids[k++] = id;
        }
        p->n_ids = in_len;
        return true;
    }
    size_t cap = (size_t)in_len * 8 + 1, o = 0;
    if (!(p->text = malloc(cap))) return false;
    for (int i = 0; i < in_len; i++) {
        const char *w = words[(size_t)(db_rng_uniform(r) * (sizeof words / sizeof *words))];
        o += (size_t)snprintf(p->text + o, cap - o, "%s%s", i ? " " : "", w);
    }
    return true;
}

/* Prepends the shared prefix pre to p (both made by random_prompt; p's
 * own beginning-of-text token, if any, goes: pre has one). */
static bool prepend(const db_prompt *pre, const db_vocab *v, db_prompt *p) {
    if (pre->ids) {
        int skip = v->bos >= 0 && p->n_ids > 0 && p->ids[0] == v->bos;
        int n = pre->n_ids + p->n_ids - skip;
        int32_t *ids = malloc((size_t)n * sizeof *ids);
        if (!ids) return false;
        memcpy(ids, pre->ids, (size_t)pre->n_ids * sizeof *ids);
        memcpy(ids + pre->n_ids, p->ids + skip, (size_t)(p->n_ids - skip) * sizeof *ids);
        free(p->ids);
        p->ids = ids;
        p->n_ids = n;
        return true;
    }
    size_t a = strlen(pre->text), b = strlen(p->text);
    char *t = malloc(a + b + 2);
    if (!t) return false;
    memcpy(t, pre->text, a);
    t[a] = ' ';
    memcpy(t + a + 1, p->text, b + 1);
    free(p->text);
    p->text = t;
    return true;
}

typedef struct dataset {
    char **prompt;
    int *output_len; /* 0 = not given */
    int n;
} dataset;

static void dataset_free(dataset *d) {
    for (int i = 0; i < d->n; i++)
        free(d->prompt[i]);
    free(d->prompt);
    free(d->output_len);
}

static bool dataset_load(const char *path, dataset *d, char *err, size_t esize) {
    memset(d, 0, sizeof *d);
    FILE *f = fopen(path, "r");
    if (!f) {
        snprintf(err, esize, "cannot open dataset %s", path);
        return false;
    }
    char *line = NULL;
    size_t lcap = 0;
    ssize_t len;
    int line_no = 0, cap = 0;
    bool ok = true;
    while (ok && (len = getline(&line, &lcap, f)) >= 0) {
        line_no++;
        while (len > 0 && (line[len - 1] == '\n' || line[len - 1] == '\r' || line[len - 1] == ' '))
            line[--len] = 0;
        if (len == 0) continue;
        cJSON *o = cJSON_Parse(line);
        const cJSON *pr = o ? cJSON_GetObjectItemCaseSensitive(o, "prompt") : NULL;
        const cJSON *ol = o ? cJSON_GetObjectItemCaseSensitive(o, "output_len") : NULL;
        if (!cJSON_IsString(pr) ||
            (ol && !(cJSON_IsNumber(ol) && ol->valuedouble >= 1 && ol->valuedouble <= 1e6))) {
            snprintf(err, esize, "%s:%d: expected {\"prompt\": string, \"output_len\": positive integer}",
                     path, line_no);
            ok = false;
        } else {
            if (d->n == cap) {
                cap = cap ? cap * 2 : 64;
                char **np = realloc(d->prompt, (size_t)cap * sizeof *np);
                if (np) d->prompt = np;
                int *nl = realloc(d->output_len, (size_t)cap * sizeof *nl);
                if (nl) d->output_len = nl;
                if (!np || !nl) {
                    snprintf(err, esize, "out of memory reading %s", path);
                    ok = false;
                }
            }
            if (ok) {
                d->prompt[d->n] = strdup(pr->valuestring);
                d->output_len[d->n] = ol ? (int)ol->valuedouble : 0;
                if (!d->prompt[d->n]) {
                    snprintf(err, esize, "out of memory reading %s", path);
                    ok = false;
                } else {
                    d->n++;
                }
            }
        }
        cJSON_Delete(o);
    }
    free(line);
    fclose(f);
    if (ok && d->n == 0) {
        snprintf(err, esize, "dataset %s has no prompts", path);
        ok = false;
    }
    if (!ok) dataset_free(d);
    return ok;
}

void db_workload_free(db_prompt *p, int n) {
    if (!p) return;
    for (int i = 0; i < n; i++)
        free(p[i].text), free(p[i].ids);
    free(p);
}

bool db_workload_make(const db_workload_cfg *cfg, const db_vocab *vocab, db_prompt **out, char *err,
                      size_t esize) {
    *out = NULL;
    if (esize) err[0] = 0;
    if (cfg->n <= 0) {
        snprintf(err, esize, "no requests to make");
        return false;
    }
    db_prompt *p = calloc((size_t)cfg->n, sizeof *p);
    if (!p) {
        snprintf(err, esize, "out of memory");
        return false;
    }
    dataset ds = {0};
    if (cfg->dataset_path && !dataset_load(cfg->dataset_path, &ds, err, esize)) {
        free(p);
        return false;
    }
    db_rng rng;
    db_rng_seed(&rng, cfg->seed);
    bool ok = true;
    /* The shared prefix, from its own stream of the seed (so it does not
     * shift the prompts that follow it). */
    db_prompt pre = {0};
    if (cfg->prefix_len > 0 && !ds.n) {
        db_rng prng;
        db_rng_seed(&prng, cfg->seed ^ UINT64_C(0x5A17ED9F3C1B2E4D));
        ok = random_prompt(&prng, vocab, cfg->prefix_len, &pre);
    }
    for (int i = 0; ok && i < cfg->n; i++) {
        if (ds.n) {
            /* The dataset in file order, again from the top when it runs out. */
            int k = i % ds.n;
            p[i].output_len =
                ds.output_len[k] ? ds.output_len[k] : draw_len(&rng, cfg->output_len, cfg->range_ratio);
            if (vocab && vocab->model) {
                size_t len = strlen(ds.prompt[k]);
                int n = duet_tokenize(vocab->model, ds.prompt[k], len, true, false, NULL, 0);
                if (n <= 0 || !(p[i].ids = malloc((size_t)n * sizeof *p[i].ids)) ||
                    duet_tokenize(vocab->model, ds.prompt[k], len, true, false, p[i].ids, n) != n) {
                    snprintf(err, esize, "cannot tokenize dataset prompt %d", k + 1);
                    ok = false;
                }
                p[i].n_ids = n;
            }
            /* Over HTTP the server tokenizes the text itself. */
            if (ok && !(p[i].text = strdup(ds.prompt[k]))) ok = false;
        } else {
            int in_len = draw_len(&rng, cfg->input_len, cfg->range_ratio);
            p[i].output_len = draw_len(&rng, cfg->output_len, cfg->range_ratio);
            if (!random_prompt(&rng, vocab, in_len, &p[i]) ||
                (cfg->prefix_len > 0 && !prepend(&pre, vocab, &p[i]))) {
                snprintf(err, esize, "out of memory");
                ok = false;
            }
        }
        /* The interactive share spread evenly (a Bresenham walk): exact
         * counts even for short runs, the same for every sweep point. */
        double s = cfg->interactive_share;
        p[i].priority_set = s >= 0;
        if (s >= 0)
            p[i].priority =
                floor((i + 1) * s) > floor(i * s) ? DUET_PRIORITY_INTERACTIVE : DUET_PRIORITY_BATCH;
        else
            p[i].priority = DUET_PRIORITY_INTERACTIVE;
    }
    dataset_free(&ds);
    free(pre.ids), free(pre.text);
    if (!ok) {
        if (!err[0]) snprintf(err, esize, "out of memory");
        db_workload_free(p, cfg->n);
        return false;
    }
    *out = p;
    return true;
}
