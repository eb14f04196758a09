/* test_backends.h — whether a test may run on a backend: every test that
 * loops over backends asks here, so a missing backend is reported the same
 * way everywhere and CI (DUET_REQUIRE_BACKENDS) never skips one. */
#ifndef DUET_TEST_BACKENDS_H
#define DUET_TEST_BACKENDS_H

#include <check.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"

/* Whether the comma-separated list names `name`. */
static inline bool test_list_has(const char *list, const char *name) {
    if (!list || !*list) return false;
    char buf[256];
    snprintf(buf, sizeof buf, "%s", list);
    char *save = NULL;
    for (char *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save))
        if (strcmp(t, name) == 0) return true;
    return false;
}

/* True when the backend `name` runs here (compiled in, available, with a
 * device). Otherwise prints "SKIP <what> on <name>: <why>" and fails when
 * DUET_REQUIRE_BACKENDS names it: the test command sets it to every
 * backend, so CI runs them all (PoCL and lavapipe stand in for GPUs). */
static inline bool test_backend_usable(const char *name, const char *what) {
    const duet_backend_iface *iface = duet_backend_find(name);
    char why[256] = "not compiled in";
    if (iface && iface->available(why, sizeof why)) {
        if (iface->device_count() > 0) return true;
        snprintf(why, sizeof why, "no device");
    }
    printf("SKIP %s on %s: %s\n", what, name, why);
    fflush(stdout);
    ck_assert_msg(!test_list_has(getenv("DUET_REQUIRE_BACKENDS"), name),
                  "%s is required (DUET_REQUIRE_BACKENDS) but unavailable: %s", name, why);
    return false;
}

#endif
