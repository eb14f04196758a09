/* engine_config.h — an instance's configuration from its knobs
 * (duet_engine_params): the defaults filled in and checked, the
 * scheduler's capacities and first knobs, the adaptive controller's bounds
 * and targets, the stall-free step budgets, and one controller window
 * applied to the scheduler. duet_engine_start and duet_simulate both
 * derive their instances from here, so a simulated instance is configured
 * (and retuned) as a served one is: same defaults, same knobs from the
 * same options.
 *
 * Pure: no clock, no thread, no allocation.
 */
#ifndef DUET_ENGINE_CONFIG_H
#define DUET_ENGINE_CONFIG_H

#include "controller.h"
#include "duet.h"
#include "scheduler.h"

typedef struct duet_engine_setup {
    duet_sched_config sched; /* capacities and first knobs (with the step budgets) */
    duet_ctl_config ctl;     /* for duet__ctl_init; duet__ctl_active says whether it runs */
    double budget_share;     /* a step with decodes of a class may take this share of the class's
                                ITL target, predicted (the controller retunes it) */
    double slo_itl_s[2];     /* the ITL targets per duet_priority (0: none) */
    int64_t ctl_window_ns;   /* one controller window */
    bool static_knobs;       /* the controller never runs (duet_engine_params.static_knobs) */
} duet_engine_setup;

/* The knobs with their defaults filled in and checked (before anything
 * loads); DUET_INVALID_ARGUMENT with a message naming the knob. */
duet_status duet__engine_params_check(const duet_engine_params *params, duet_engine_params *out);
/* DUET_INVALID_ARGUMENT unless every term of m is finite and >= 0. */
duet_status duet__step_cost_check(const duet_step_cost *m);
/* The instance of checked params p with n_ctx positions per sequence,
 * kv_blocks blocks in its pool and speculation's batch limit. */
void duet__engine_setup(const duet_engine_params *p, int n_ctx, int kv_blocks, int spec_max_batch,
                        duet_engine_setup *out);
/* The scheduler's step budgets: `share` of each class's ITL target. */
void duet__engine_step_budgets(double share, const double slo_itl_s[2], duet_sched_knobs *k);
/* One controller window: w's latencies (its queue fields are filled here
 * from the scheduler) and the scheduler's knobs in; the controller's
 * knobs, *share and the step budgets set in the scheduler. */
duet_ctl_action duet__engine_ctl_tick(duet_ctl *c, duet_ctl_window *w, duet_sched *s, double *share,
                                      const double slo_itl_s[2]);

#endif /* DUET_ENGINE_CONFIG_H */
