/* test_util.h — shared helpers for the Check tests. */
#ifndef DUET_TEST_UTIL_H
#define DUET_TEST_UTIL_H

#include <check.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
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

/* The slow-test watchdog: ctest sets DUET_TEST_BUDGET (its timeout, in
 * seconds) and DUET_TEST_NAME; at 80% of the budget this thread prints one
 * line naming the test, so a timeout never comes bare. It lives in the
 * Check runner's process only (fork copies just the forking thread). */
static void *test_watchdog(void *arg) {
    const double budget = *(const double *)arg;
    const double warn = budget * 0.8;
    struct timespec ts = {(time_t)warn, (long)((warn - (double)(time_t)warn) * 1e9)};
    while (nanosleep(&ts, &ts) != 0) {
    }
    const char *name = getenv("DUET_TEST_NAME");
    fprintf(stderr,
            "SLOW: %s still running after %.0f s of its %.0f s ctest timeout (on a cold machine, PoCL, "
            "Mesa and duet compile every kernel variant on first use; see tests/README.md)\n",
            name ? name : "this test", warn, budget);
    return NULL;
}

/* Runs a suite and returns the process exit code. Each test's result is
 * printed as it finishes (CK_VERBOSE), so the output of a test that timed
 * out shows how far it got. A run that selects no test (CK_RUN_CASE names
 * no case) fails rather than passing with nothing checked. */
static inline int test_run_suite(Suite *s) {
    static double budget;
    const char *b = getenv("DUET_TEST_BUDGET");
    budget = b ? atof(b) : 0;
    pthread_t watchdog;
    if (budget > 0 && pthread_create(&watchdog, NULL, test_watchdog, &budget) == 0) pthread_detach(watchdog);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_VERBOSE);
    const int ran = srunner_ntests_run(sr), failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    if (ran == 0) {
        const char *c = getenv("CK_RUN_CASE");
        fprintf(stderr, "no test ran%s%s%s\n", c ? " (CK_RUN_CASE=" : "", c ? c : "",
                c ? ": no such case)" : "");
        return EXIT_FAILURE;
    }
    return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}

#endif
