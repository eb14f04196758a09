/* prom_check.h — a strict reader of the Prometheus text exposition format
 * (0.0.4) for the metrics and server tests: it checks the format rules a
 * scraper relies on and looks up sample values.
 *
 * Checked: metric and label name syntax; label value quoting and escapes;
 * float syntax of values (+Inf, -Inf, NaN included); HELP and TYPE at most
 * once per family and TYPE before its samples; the samples of a family
 * contiguous; no duplicate series; counters non-negative; histograms with
 * only _bucket/_sum/_count series, buckets in increasing `le` order with
 * non-decreasing cumulative counts, a +Inf bucket equal to _count, and a
 * _sum; every line ending in a newline.
 */
#ifndef DUET_PROM_CHECK_H
#define DUET_PROM_CHECK_H

#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct prom_sample {
    char name[128];
    char labels[512]; /* canonical: k="v",k="v" in the order written, without le */
    bool has_le;
    double le;
    double value;
    int family;
} prom_sample;

typedef struct prom_family {
    char name[128];
    char type[16]; /* "" when untyped */
    bool has_help, has_samples, closed;
} prom_family;

typedef struct prom_doc {
    prom_sample *s;
    int n, cap;
    prom_family f[1024];
    int nf;
} prom_doc;

static bool prom_err(char *err, size_t size, int line, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int k = snprintf(err, size, "line %d: ", line);
    if (k > 0 && (size_t)k < size) vsnprintf(err + k, size - (size_t)k, fmt, ap);
    va_end(ap);
    return false;
}

static bool prom_name_ok(const char *s, size_t n, bool colon) {
    if (n == 0) return false;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || (colon && c == ':') ||
                  (i > 0 && c >= '0' && c <= '9');
        if (!ok) return false;
    }
    return true;
}

static bool prom_float(const char *s, double *out) {
    if (!strcmp(s, "+Inf") || !strcmp(s, "Inf")) return *out = INFINITY, true;
    if (!strcmp(s, "-Inf")) return *out = -INFINITY, true;
    if (!strcmp(s, "NaN")) return *out = NAN, true;
    char *end;
    *out = strtod(s, &end);
    if (end == s || *end) return false;
    /* strtod also takes "inf", "nan" and hex; Prometheus does not. */
    for (const char *p = s; *p; p++)
        if (!strchr("0123456789+-.eE", *p)) return false;
    return true;
}

static int prom_family_find(prom_doc *d, const char *name) {
    for (int i = 0; i < d->nf; i++)
        if (!strcmp(d->f[i].name, name)) return i;
    return -1;
}

static int prom_family_add(prom_doc *d, const char *name) {
    int i = prom_family_find(d, name);
    if (i >= 0 || d->nf == (int)(sizeof d->f / sizeof *d->f)) return i;
    memset(&d->f[d->nf], 0, sizeof d->f[0]);
    snprintf(d->f[d->nf].name, sizeof d->f[0].name, "%s", name);
    return d->nf++;
}

/* The family a sample name belongs to: a histogram/summary declared with
 * the name less its suffix, or the name itself. */
static int prom_family_of(prom_doc *d, const char *name) {
    static const char *const suffixes[] = {"_bucket", "_sum", "_count"};
    for (int k = 0; k < 3; k++) {
        size_t n = strlen(name), m = strlen(suffixes[k]);
        if (n > m && !strcmp(name + n - m, suffixes[k])) {
            char base[128];
            snprintf(base, sizeof base, "%.*s", (int)(n - m), name);
            int i = prom_family_find(d, base);
            if (i >= 0 && (!strcmp(d->f[i].type, "histogram") || !strcmp(d->f[i].type, "summary"))) return i;
        }
    }
    return prom_family_add(d, name);
}

/* Parses `{...}` at *pp into canonical labels; reports le separately. */
static bool prom_labels(const char **pp, prom_sample *s, char *err, size_t esz, int line) {
    const char *p = *pp;
    size_t o = 0;
    s->labels[0] = 0;
    if (*p != '{') return true;
    p++;
    while (*p != '}') {
        const char *k = p;
        while (*p && *p != '=' && *p != '}' && *p != ',') p++;
        if (*p != '=') return prom_err(err, esz, line, "label without '='");
        size_t kn = (size_t)(p - k);
        if (!prom_name_ok(k, kn, false)) return prom_err(err, esz, line, "bad label name '%.*s'", (int)kn, k);
        p++;
        if (*p != '"') return prom_err(err, esz, line, "label value not quoted");
        p++;
        char val[256];
        size_t vn = 0;
        while (*p && *p != '"') {
            char c = *p++;
            if (c == '\\') {
                char e = *p++;
                if (e == 'n') c = '\n';
                else if (e == '\\' || e == '"') c = e;
                else return prom_err(err, esz, line, "bad escape '\\%c' in a label value", e ? e : '0');
            } else if (c == '\n') {
                return prom_err(err, esz, line, "raw newline in a label value");
            }
            if (vn + 1 < sizeof val) val[vn++] = c;
        }
        val[vn] = 0;
        if (*p != '"') return prom_err(err, esz, line, "unterminated label value");
        p++;
        if (kn == 2 && !strncmp(k, "le", 2)) {
            if (!prom_float(val, &s->le)) return prom_err(err, esz, line, "le=\"%s\" is not a float", val);
            s->has_le = true;
        } else {
            int w = snprintf(s->labels + o, sizeof s->labels - o, "%s%.*s=\"%s\"", o ? "," : "", (int)kn, k, val);
            if (w < 0 || (size_t)w >= sizeof s->labels - o) return prom_err(err, esz, line, "labels too long");
            o += (size_t)w;
        }
        if (*p == ',') p++;
        else if (*p != '}') return prom_err(err, esz, line, "expected ',' or '}' after a label");
    }
    *pp = p + 1;
    return true;
}

static bool prom_check_histograms(prom_doc *d, char *err, size_t esz) {
    for (int fi = 0; fi < d->nf; fi++) {
        prom_family *f = &d->f[fi];
        if (strcmp(f->type, "histogram")) continue;
        for (int i = 0; i < d->n; i++) {
            prom_sample *s = &d->s[i];
            if (s->family != fi) continue;
            size_t fl = strlen(f->name);
            const char *suf = s->name + fl;
            if (strcmp(suf, "_bucket") && strcmp(suf, "_sum") && strcmp(suf, "_count"))
                return prom_err(err, esz, 0, "histogram %s has a series named %s", f->name, s->name);
            if (!strcmp(suf, "_bucket") != s->has_le)
                return prom_err(err, esz, 0, "%s{%s}: le belongs on _bucket series only", s->name, s->labels);
            /* Check each label set once, at its first bucket. */
            if (!s->has_le) continue;
            bool first = true;
            for (int j = 0; j < i && first; j++)
                if (d->s[j].family == fi && d->s[j].has_le && !strcmp(d->s[j].labels, s->labels)) first = false;
            if (!first) continue;
            double prev_le = -INFINITY, prev_v = 0, inf_v = -1, count = -1, sum = NAN;
            for (int j = i; j < d->n; j++) {
                prom_sample *t = &d->s[j];
                if (t->family != fi || strcmp(t->labels, s->labels)) continue;
                if (t->has_le) {
                    if (!(t->le > prev_le))
                        return prom_err(err, esz, 0, "%s{%s}: le=%g after le=%g", t->name, t->labels, t->le, prev_le);
                    if (t->value < prev_v)
                        return prom_err(err, esz, 0, "%s{%s}: bucket le=%g count %g below the previous %g",
                                        t->name, t->labels, t->le, t->value, prev_v);
                    prev_le = t->le;
                    prev_v = t->value;
                    if (isinf(t->le)) inf_v = t->value;
                } else if (!strcmp(t->name + fl, "_count")) {
                    count = t->value;
                } else {
                    sum = t->value;
                }
            }
            if (inf_v < 0) return prom_err(err, esz, 0, "%s{%s}: no +Inf bucket", f->name, s->labels);
            if (count != inf_v)
                return prom_err(err, esz, 0, "%s{%s}: _count %g != +Inf bucket %g", f->name, s->labels, count, inf_v);
            if (isnan(sum)) return prom_err(err, esz, 0, "%s{%s}: no _sum", f->name, s->labels);
        }
    }
    return true;
}

/* Parses and checks `text`; on failure writes the reason to err. The doc
 * must be freed with prom_free either way. */
static bool prom_parse(const char *text, prom_doc *d, char *err, size_t esz) {
    memset(d, 0, sizeof *d);
    int cur = -1, line = 0;
    const char *p = text;
    if (*p && text[strlen(text) - 1] != '\n') return prom_err(err, esz, 0, "the text does not end with a newline");
    while (*p) {
        line++;
        const char *eol = strchr(p, '\n');
        size_t n = (size_t)(eol - p);
        char buf[1024];
        if (n >= sizeof buf) return prom_err(err, esz, line, "line too long");
        memcpy(buf, p, n);
        buf[n] = 0;
        p = eol + 1;
        if (n == 0) continue;
        if (buf[0] == '#') {
            char kw[8], name[160];
            int used = 0;
            if (sscanf(buf, "# %7s %159s %n", kw, name, &used) < 2 || (strcmp(kw, "HELP") && strcmp(kw, "TYPE")))
                continue; /* a plain comment */
            if (!prom_name_ok(name, strlen(name), true)) return prom_err(err, esz, line, "bad metric name '%s'", name);
            int fi = prom_family_add(d, name);
            if (fi < 0) return prom_err(err, esz, line, "too many families");
            prom_family *f = &d->f[fi];
            if (!strcmp(kw, "HELP")) {
                if (f->has_help) return prom_err(err, esz, line, "second HELP for %s", name);
                f->has_help = true;
            } else {
                const char *ty = buf + used;
                if (f->type[0]) return prom_err(err, esz, line, "second TYPE for %s", name);
                if (f->has_samples) return prom_err(err, esz, line, "TYPE for %s after its samples", name);
                if (strcmp(ty, "counter") && strcmp(ty, "gauge") && strcmp(ty, "histogram") &&
                    strcmp(ty, "summary") && strcmp(ty, "untyped"))
                    return prom_err(err, esz, line, "unknown type '%s'", ty);
                snprintf(f->type, sizeof f->type, "%s", ty);
            }
            continue;
        }
        if (d->n == d->cap) {
            int cap = d->cap ? d->cap * 2 : 256;
            prom_sample *s = realloc(d->s, (size_t)cap * sizeof *s);
            if (!s) return prom_err(err, esz, line, "out of memory");
            d->s = s;
            d->cap = cap;
        }
        prom_sample *s = &d->s[d->n];
        memset(s, 0, sizeof *s);
        const char *q = buf;
        while (*q && *q != '{' && *q != ' ') q++;
        size_t nn = (size_t)(q - buf);
        if (!prom_name_ok(buf, nn, true) || nn >= sizeof s->name)
            return prom_err(err, esz, line, "bad metric name in '%s'", buf);
        memcpy(s->name, buf, nn);
        if (!prom_labels(&q, s, err, esz, line)) return false;
        if (*q != ' ') return prom_err(err, esz, line, "expected a space before the value in '%s'", buf);
        q++;
        char val[64];
        size_t vn = strcspn(q, " ");
        if (vn == 0 || vn >= sizeof val) return prom_err(err, esz, line, "missing value in '%s'", buf);
        memcpy(val, q, vn);
        val[vn] = 0;
        if (!prom_float(val, &s->value)) return prom_err(err, esz, line, "value '%s' is not a float", val);
        if (q[vn] == ' ') { /* optional integer timestamp */
            const char *ts = q + vn + 1;
            if (!*ts || strspn(ts, "-0123456789") != strlen(ts))
                return prom_err(err, esz, line, "bad timestamp in '%s'", buf);
        }
        int fi = prom_family_of(d, s->name);
        if (fi < 0) return prom_err(err, esz, line, "too many families");
        if (fi != cur) {
            if (d->f[fi].closed) return prom_err(err, esz, line, "samples of %s are not contiguous", d->f[fi].name);
            if (cur >= 0) d->f[cur].closed = true;
            cur = fi;
        }
        d->f[fi].has_samples = true;
        s->family = fi;
        if (!strcmp(d->f[fi].type, "counter") && !(s->value >= 0))
            return prom_err(err, esz, line, "counter %s is %g", s->name, s->value);
        if (s->has_le && strcmp(d->f[fi].type, "histogram"))
            return prom_err(err, esz, line, "le label on %s which is not a histogram", s->name);
        for (int j = 0; j < d->n; j++)
            if (!strcmp(d->s[j].name, s->name) && !strcmp(d->s[j].labels, s->labels) &&
                d->s[j].has_le == s->has_le && (!s->has_le || d->s[j].le == s->le))
                return prom_err(err, esz, line, "duplicate series %s{%s}", s->name, s->labels);
        d->n++;
    }
    return prom_check_histograms(d, err, esz);
}

static void prom_free(prom_doc *d) {
    free(d->s);
    d->s = NULL;
    d->n = d->cap = 0;
}

/* Does a label set contain every k="v" pair of `filter` (comma-separated;
 * "" matches all)? */
static bool prom_match(const char *labels, const char *filter) {
    char f[512];
    snprintf(f, sizeof f, "%s", filter);
    for (char *save = NULL, *tok = strtok_r(f, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        const char *hit = strstr(labels, tok);
        size_t n = strlen(tok);
        /* The pair must be whole: at the start or after a comma. */
        while (hit && !(hit == labels || hit[-1] == ',')) hit = strstr(hit + 1, tok);
        if (!hit || (hit[n] && hit[n] != ',')) return false;
    }
    return true;
}

/* Sum of the samples named `name` (le ignored: use for non-bucket series)
 * whose labels match `filter`; returns the number of samples found. */
static int prom_sum(const prom_doc *d, const char *name, const char *filter, double *out) {
    int found = 0;
    *out = 0;
    for (int i = 0; i < d->n; i++)
        if (!strcmp(d->s[i].name, name) && !d->s[i].has_le && prom_match(d->s[i].labels, filter)) {
            *out += d->s[i].value;
            found++;
        }
    return found;
}

/* The type of a family ("" when untyped or absent). */
static const char *prom_type(prom_doc *d, const char *family) {
    int i = prom_family_find(d, family);
    return i < 0 ? "" : d->f[i].type;
}

#endif /* DUET_PROM_CHECK_H */
