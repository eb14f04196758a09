/* step_log.c — reads a step log back (see step_log.h). The logs are plain
 * numeric CSV, written by duet itself: no quoting to handle. */
#include "step_log.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_COLS 32

enum { C_DECODE, C_PREFILL, C_DECODE_CTX, C_PREFILL_CTX, C_SECONDS, C_LEARNT, N_WANT };
static const char *const want[N_WANT] = {"decode_tokens", "prefill_tokens", "decode_ctx",
                                         "prefill_ctx",   "seconds",        "learnt"};

/* Splits a line in place at commas (empty fields kept); the field count. */
static int split(char *line, char **field) {
    int n = 0;
    line[strcspn(line, "\r\n")] = 0;
    for (char *p = line;; p++) {
        if (n < MAX_COLS) field[n] = p;
        n++;
        if (!(p = strchr(p, ','))) break;
        *p = 0;
    }
    return n;
}

bool step_log_read(const char *path, duet_step_sample **out, int *n, int *n_cold, char *err, size_t esize) {
    *out = NULL;
    *n = *n_cold = 0;
    FILE *f = fopen(path, "r");
    if (!f) {
        snprintf(err, esize, "%s: %s", path, strerror(errno));
        return false;
    }
    char *line = NULL;
    size_t cap = 0;
    char *field[MAX_COLS];
    int col[N_WANT], n_cols = 0, cap_s = 0, lineno = 1;
    duet_step_sample *s = NULL;
    bool ok = getline(&line, &cap, f) > 0;
    if (!ok) snprintf(err, esize, "%s: empty, not a step log", path);
    if (ok) {
        n_cols = split(line, field);
        for (int w = 0; w < N_WANT; w++) {
            col[w] = -1;
            for (int c = 0; c < n_cols && c < MAX_COLS; c++)
                if (!strcmp(field[c], want[w])) col[w] = c;
            if (col[w] < 0 && w != C_LEARNT) { /* a simulated log has no learnt column: every step counts */
                snprintf(err, esize, "%s: no column \"%s\" in the header: not a step log", path, want[w]);
                ok = false;
                break;
            }
        }
    }
    while (ok && getline(&line, &cap, f) > 0) {
        lineno++;
        int got = split(line, field);
        if (got != n_cols) {
            snprintf(err, esize, "%s:%d: %d columns where the header has %d", path, lineno, got, n_cols);
            ok = false;
            break;
        }
        double v[N_WANT] = {0};
        for (int w = 0; w < N_WANT && ok; w++) {
            if (col[w] < 0) continue;
            char *end;
            errno = 0;
            v[w] = strtod(field[col[w]], &end);
            if (end == field[col[w]] || *end || errno || !isfinite(v[w]) || v[w] < 0) {
                snprintf(err, esize, "%s:%d: %s is '%s', not a number >= 0", path, lineno, want[w],
                         field[col[w]]);
                ok = false;
            } else if ((w == C_DECODE || w == C_PREFILL) && !(v[w] == floor(v[w]) && v[w] <= 1 << 30)) {
                /* token counts: whole, and within an int (the cast below) */
                snprintf(err, esize, "%s:%d: %s is '%s', not a whole token count", path, lineno, want[w],
                         field[col[w]]);
                ok = false;
            }
        }
        if (!ok) break;
        if (col[C_LEARNT] >= 0 && v[C_LEARNT] == 0) {
            (*n_cold)++;
            continue;
        }
        if (*n == cap_s) {
            int nc = cap_s ? 2 * cap_s : 1024;
            duet_step_sample *g = realloc(s, (size_t)nc * sizeof *g);
            if (!g) {
                snprintf(err, esize, "out of memory reading %s", path);
                ok = false;
                break;
            }
            s = g, cap_s = nc;
        }
        s[(*n)++] = (duet_step_sample){.shape = {.n_decode = (int)v[C_DECODE],
                                                 .n_prefill = (int)v[C_PREFILL],
                                                 .decode_ctx = v[C_DECODE_CTX],
                                                 .prefill_ctx = v[C_PREFILL_CTX]},
                                       .seconds = v[C_SECONDS]};
    }
    if (ok && ferror(f)) {
        snprintf(err, esize, "%s: %s", path, strerror(errno));
        ok = false;
    }
    free(line);
    fclose(f);
    if (!ok) {
        free(s);
        *n = *n_cold = 0;
        return false;
    }
    *out = s;
    return true;
}
