/* duet_bench_util.c — small helpers of duet-bench: the clock, number lists,
 * names, directories. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <time.h>

#include "duet_bench.h"

double db_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

bool db_parse_list(const char *s, double *out, int max, int *n) {
    *n = 0;
    const char *p = s;
    while (*p) {
        if (*n == max) return false;
        const char *comma = strchr(p, ',');
        size_t len = comma ? (size_t)(comma - p) : strlen(p);
        char item[64];
        if (len == 0 || len >= sizeof item) return false;
        memcpy(item, p, len);
        item[len] = 0;
        double v;
        if (!strcasecmp(item, "inf") || !strcasecmp(item, "infinity")) {
            v = INFINITY;
        } else {
            char *end;
            errno = 0;
            v = strtod(item, &end);
            if (*end || errno || isnan(v) || v < 0) return false;
        }
        out[(*n)++] = v;
        p = comma ? comma + 1 : p + len;
    }
    return *n > 0;
}

const char *db_fmt_num(char *buf, size_t size, double v) {
    if (isinf(v))
        snprintf(buf, size, "inf");
    else if (isnan(v))
        snprintf(buf, size, "default");
    else
        snprintf(buf, size, "%g", v);
    return buf;
}

void db_utc_now(char *buf, size_t size) {
    time_t t = time(NULL);
    struct tm tm;
    gmtime_r(&t, &tm);
    strftime(buf, size, "%Y-%m-%dT%H:%M:%SZ", &tm);
}

void db_slug(char *out, size_t size, const char *in) {
    size_t o = 0;
    bool dash = false;
    for (const char *p = in; *p && o + 1 < size; p++) {
        char c = *p;
        bool keep = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
                    c == '_';
        if (keep) {
            out[o++] = c;
            dash = false;
        } else if (!dash && o > 0) {
            out[o++] = '-';
            dash = true;
        }
    }
    while (o > 0 && out[o - 1] == '-')
        o--;
    if (size) out[o] = 0;
}

bool db_mkdirs(const char *path) {
    char buf[2048];
    if (snprintf(buf, sizeof buf, "%s", path) >= (int)sizeof buf) {
        errno = ENAMETOOLONG;
        return false;
    }
    for (char *p = buf + 1; *p; p++) {
        if (*p != '/') continue;
        *p = 0;
        if (mkdir(buf, 0777) != 0 && errno != EEXIST) return false;
        *p = '/';
    }
    if (mkdir(buf, 0777) != 0 && errno != EEXIST) return false;
    return true;
}

db_cpu db_cpu_sample(void) {
    db_cpu c = {0};
    FILE *f = fopen("/proc/stat", "r");
    if (!f) return c;
    unsigned long long v[8] = {0};
    int n = fscanf(f, "cpu %llu %llu %llu %llu %llu %llu %llu %llu", &v[0], &v[1], &v[2], &v[3], &v[4], &v[5],
                   &v[6], &v[7]);
    fclose(f);
    if (n < 4) return c;
    /* user nice system idle iowait irq softirq steal: idle and iowait are not busy. */
    for (int i = 0; i < 8; i++)
        c.total += (double)v[i];
    c.busy = c.total - (double)v[3] - (double)v[4];
    f = fopen("/proc/self/stat", "r");
    if (!f) return c;
    char buf[1024];
    size_t len = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[len] = 0;
    /* Fields after the command name (which may hold spaces) start at ')'. */
    const char *p = strrchr(buf, ')');
    unsigned long long ut = 0, st = 0;
    if (!p || sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &ut, &st) != 2) return c;
    c.self = (double)(ut + st);
    c.ok = true;
    return c;
}

double db_cpu_other_ratio(const db_cpu *a, const db_cpu *b) {
    if (!a->ok || !b->ok || b->total <= a->total) return NAN;
    double other = (b->busy - a->busy) - (b->self - a->self);
    double r = other / (b->total - a->total);
    return r < 0 ? 0 : r > 1 ? 1 : r;
}
