/* step_log.h — reads a step log back: `duet serve --step-log` or
 * `duet-bench --simulate --sim-step-log` (sim_steps.csv), for `duet profile
 * --from-step-log`, which fits the step-cost model to served steps. */
#ifndef DUET_TOOLS_STEP_LOG_H
#define DUET_TOOLS_STEP_LOG_H

#include <stdbool.h>
#include <stddef.h>

#include "duet.h"

/* A sample per line (its shape and seconds), by the header's column names;
 * lines whose `learnt` column is 0 (the engine's first step of a kind: a
 * cold one) are left out and counted in *n_cold. *out is malloc'd (the
 * caller frees it). false with a message naming the file, the line and
 * what is wrong. */
bool step_log_read(const char *path, duet_step_sample **out, int *n, int *n_cold, char *err, size_t esize);

#endif
