/* test_util.h — shared helpers for the Check tests. */
#ifndef DUET_TEST_UTIL_H
#define DUET_TEST_UTIL_H

#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Path of a file under ../shared (override with DUET_SHARED). */
static inline const char *test_shared_path(const char *rel) {
    static char buf[4][4096];
    static int slot;
    const char *root = getenv("DUET_SHARED");
    if (!root) root = DUET_SHARED_DIR;
    char *out = buf[slot++ & 3];
    snprintf(out, sizeof buf[0], "%s/%s", root, rel);
    return out;
}

/* Reads a whole file into a NUL-terminated malloc'd buffer, or NULL. */
static inline char *test_read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)n + 1);
    if (b && fread(b, 1, (size_t)n, f) != (size_t)n) {
        free(b);
        b = NULL;
    }
    fclose(f);
    if (b) {
        b[n] = 0;
        if (len) *len = (size_t)n;
    }
    return b;
}

/* Runs a suite and returns the process exit code. */
static inline int test_run_suite(Suite *s) {
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}

#endif
