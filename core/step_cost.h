/* step_cost.h — the step-cost model's online fit (the public half, the
 * model itself, its offline fit and its file, is in duet.h).
 *
 * Pure: no clock, no thread, no allocation. The engine feeds it every step
 * it runs (shape and measured seconds); the scheduler and the metrics read
 * the current coefficients. The fit is weighted least squares with
 * exponential forgetting (recent steps count more, so it follows a device
 * that warms up or a machine that gets busier), regularised towards a prior
 * (a profile's model, or zero): a term the recent steps do not exercise
 * (no prompt chunks lately, say) keeps the prior's value instead of
 * drifting. Not thread safe: one owner.
 */
#ifndef DUET_STEP_COST_H
#define DUET_STEP_COST_H

#include <stdint.h>

#include "duet.h"
#include "metrics.h"

#define DUET__SC_N DUET_STEP_COST_TERMS

typedef struct duet_step_cost_online {
    double A[DUET__SC_N][DUET__SC_N]; /* weighted sum of x x^T */
    double b[DUET__SC_N];             /* weighted sum of x y */
    double yy, wsum;                  /* weighted sum of y^2, of weights */
    double forget;                    /* weight multiplier per step, (0, 1] */
    double prior_weight;              /* pseudo-steps the prior counts as */
    duet_step_cost prior;             /* coefficients to fall back to */
    duet_step_cost current;           /* the latest fit */
    uint64_t n_steps;                 /* steps observed in all */
    int since_fit;                    /* steps since the last refit */
    double rel_err_ewma;              /* recent |predicted - measured| / measured, before each update */
} duet_step_cost_online;

/* A fresh fit: prior NULL = all zero (weakly held), else the prior's
 * coefficients (held as `prior_weight` steps' worth of evidence). */
void duet__step_cost_online_init(duet_step_cost_online *o, const duet_step_cost *prior, double forget,
                                 double prior_weight);
/* One measured step. Non-finite or non-positive seconds are ignored. The
 * coefficients are refitted every few steps (and at the first ones). */
void duet__step_cost_online_observe(duet_step_cost_online *o, const duet_step_shape *s, double seconds);
/* The current coefficients (refits first when steps came in since). */
const duet_step_cost *duet__step_cost_online_get(duet_step_cost_online *o);

/* The upper bounds of the served-ratio histogram's buckets. */
#define DUET__SERVED_RATIO_BUCKETS 25
extern const double duet__served_ratio_le[DUET__SERVED_RATIO_BUCKETS];

/* Serving's speed against the profile that seeded the engine (duet serve
 * --step-cost): the served steps' seconds since, measured and as that
 * profile predicted them. Their ratio is what the profile's settled steps
 * can miss (cache state, other threads, the machine's drift): what
 * duet-bench --simulate --sim-step-scale takes. */
typedef struct duet_served_speed {
    double served_s, profiled_s;
    /* How each served step's time spreads around the profile's prediction:
     * counts of measured / predicted per bucket (at most
     * duet__served_ratio_le[k]; the last, past them all), a Prometheus
     * histogram. Its top buckets show stalls the profile never saw. */
    uint64_t ratio_count[DUET__SERVED_RATIO_BUCKETS + 1];
    double ratio_sum;
} duet_served_speed;

/* Adds one served step (measured seconds, the profile's prediction). */
void duet__served_speed_add(duet_served_speed *s, double measured_s, double predicted_s);

/* One engine's step-cost model as /metrics shows it. */
typedef struct duet_step_cost_report {
    duet_step_cost model; /* the online fit; mean_rel_err its recent error */
    uint64_t n_steps;     /* steps it learnt from */
    bool seeded;          /* by a profile: speed is against it */
    duet_served_speed speed;
} duet_step_cost_report;

/* Prometheus text of n models (an instance each) appended to t:
 * duet_step_cost_seconds{term=...} gauges, the fit quality and, for seeded
 * ones, the served and profiled seconds; each sample with its label set
 * labels[i] (label pairs, already escaped: `model_name="m",instance="0"`). */
void duet__step_cost_prom_families(duet_text *t, const duet_step_cost_report *r, const char *const *labels,
                                   int n);
/* The same for one model, labelled with model_name: malloc'd text (NULL
 * when out of memory). */
char *duet__step_cost_render_prom(const duet_step_cost_report *r, const char *model_name);

#endif /* DUET_STEP_COST_H */
