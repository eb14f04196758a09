/* test_util.h — shared helpers for the Check tests. */
#ifndef DUET_TEST_UTIL_H
#define DUET_TEST_UTIL_H

#include <check.h>
#include <signal.h>
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

/* The slow-test warning: ctest sets DUET_TEST_BUDGET (its timeout, in
 * seconds) and DUET_TEST_NAME; at 80% of the budget a one-shot timer's
 * signal writes one line naming the test, so a timeout never comes bare.
 * A timer, not a thread: Check forks a child per test, and a fork taken
 * while another thread holds a lock (malloc's, ASan's) leaves the child
 * waiting for it forever. Timers are not inherited by fork; SA_RESTART
 * keeps the interrupted system calls going. */
static char test_slow_line[512];
static size_t test_slow_len;

static void test_slow_signal(int sig) {
    (void)sig;
    ssize_t w = write(2, test_slow_line, test_slow_len);
    (void)w;
}

static void test_arm_slow_warning(void) {
    const char *b = getenv("DUET_TEST_BUDGET"), *name = getenv("DUET_TEST_NAME");
    const double budget = b ? atof(b) : 0;
    if (budget <= 0) return;
    const double warn = budget * 0.8;
    int n =
        snprintf(test_slow_line, sizeof test_slow_line,
                 "SLOW: %s still running after %.0f s of its %.0f s ctest timeout (on a cold machine, PoCL, "
                 "Mesa and duet compile every kernel variant on first use; see tests/README.md)\n",
                 name ? name : "this test", warn, budget);
    test_slow_len = n > 0 && (size_t)n < sizeof test_slow_line ? (size_t)n : 0;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = test_slow_signal;
    sa.sa_flags = SA_RESTART;
    sigemptyset(&sa.sa_mask);
    struct sigevent sev;
    memset(&sev, 0, sizeof sev);
    sev.sigev_notify = SIGEV_SIGNAL;
    sev.sigev_signo = SIGUSR2;
    timer_t timer;
    if (sigaction(SIGUSR2, &sa, NULL) != 0 || timer_create(CLOCK_MONOTONIC, &sev, &timer) != 0) return;
    struct itimerspec its;
    memset(&its, 0, sizeof its);
    its.it_value.tv_sec = (time_t)warn;
    its.it_value.tv_nsec = (long)((warn - (double)(time_t)warn) * 1e9);
    timer_settime(timer, 0, &its, NULL);
}

/* Runs a suite and returns the process exit code, listing every test's
 * result (CK_VERBOSE). A run that selects no test (CK_RUN_CASE names no
 * case) fails rather than passing with nothing checked. */
static inline int test_run_suite(Suite *s) {
    test_arm_slow_warning();
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
