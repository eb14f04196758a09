/* error.c — status strings and the per-thread last-error message. */
#include <stdarg.h>
#include <stdio.h>

#include "../backends/backend.h"

static _Thread_local char duet__last_error[1024];

const char *duet_status_str(duet_status status) {
    switch (status) {
#define DUET__STATUS_DESC(name, value, desc) \
    case DUET_##name:                       \
        return desc;
        DUET_STATUS_MAP(DUET__STATUS_DESC)
#undef DUET__STATUS_DESC
    }
    return "unknown status";
}

const char *duet_status_name(duet_status status) {
    switch (status) {
#define DUET__STATUS_NAME(name, value, desc) \
    case DUET_##name:                       \
        return "DUET_" #name;
        DUET_STATUS_MAP(DUET__STATUS_NAME)
#undef DUET__STATUS_NAME
    }
    return "DUET_UNKNOWN";
}

const char *duet_last_error(void) { return duet__last_error; }

duet_status duet__error(duet_status status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(duet__last_error, sizeof duet__last_error, fmt, ap);
    va_end(ap);
    return status;
}
