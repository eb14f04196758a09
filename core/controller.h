/* controller.h — the adaptive controller of one instance: from the metrics
 * window and per priority-class latency targets, new values for the
 * scheduler's knobs (batch_timeout, max_batch_seqs, and the step budget:
 * with time budgets (share_max > 0) the share of each class's ITL target
 * that a step with its decodes may take (the scheduler's step_budget_ns,
 * sized with the step-cost model), else max_batch_tokens, the step token
 * budget).
 *
 * Pure, like the scheduler: it reads no clock, starts no thread and
 * allocates nothing; its state is a few numbers in a struct the caller
 * owns. The engine thread calls duet__ctl_update once per window with the
 * real clock's window; tests call it on a virtual clock with the real
 * scheduler under them.
 *
 * The law, once per window:
 * - Pressure ratios: p99 ITL / target and p99 TTFT / target, the worst over
 *   the classes that have a target and samples in the window, smoothed
 *   (half the old value, half the new) so one noisy window moves little.
 * - ITL over 0.9 of its target (smoothed), or this window over the target:
 *   the step is too long. Cut the step budget (prefill rides along with
 *   the decodes) by 0.8 / the smoothed ratio, at least 8% and at most 40%
 *   per window (a lone window over the target: about 8%);
 *   once the budget is down to its floor (the batch size for tokens,
 *   share_min for a time budget), cut max_batch_seqs the same way.
 * - Else TTFT over its target, or requests waiting while every slot is
 *   full: requests wait too long. While ITL has clear headroom (ratio <
 *   0.65) grow the budget, and with a full batch and a queue,
 *   max_batch_seqs, by 8%.
 * - Else a quiet window (TTFT ratio < 0.5, nobody waiting): with ITL ratio
 *   < 0.5 grow the budget by 8%, using the headroom for faster prefill.
 * - A time budget grows only in a window where it shortened a prompt chunk
 *   (budget_cut): where it never binds, growing it buys nothing, and it
 *   climbed to its ceiling in quiet windows until one step ran over the
 *   target and was cut (a saw-tooth at constant load).
 * - Else hold.
 * - batch_timeout, whatever the branch, is set from the smoothed TTFT
 *   ratio: 2% of the tightest TTFT target (its cap) at a ratio under 0.5
 *   or with no samples, so an idle engine gathers a batch; the minimum at
 *   1 and over; linear between.
 * The bands between the thresholds are wider than one window's step (8%
 * up from below 0.65 or 0.5; cuts land near 0.8), so at constant load the
 * knobs settle and stay (no limit cycle between cutting and growing).
 * Knobs stay within the configured bounds, and a token budget never goes
 * below max_batch_seqs (every running sequence decodes each step). With a
 * time budget max_batch_tokens is left as it is (it sizes the steps
 * without decodes, where time to first token matters).
 */
#ifndef DUET_CONTROLLER_H
#define DUET_CONTROLLER_H

#include <stdbool.h>
#include <stdint.h>

#include "duet.h"

typedef struct duet_ctl_config {
    double ttft_target_s[2];                /* p99 time-to-first-token target per duet_priority; 0 = none */
    double itl_target_s[2];                 /* p99 inter-token latency target per class; 0 = none */
    int seqs_min, seqs_max;                 /* bounds of max_batch_seqs (1 <= min <= max) */
    int tokens_min, tokens_max;             /* bounds of max_batch_tokens */
    int64_t timeout_min_ns, timeout_max_ns; /* bounds of batch_timeout */
    double share_min, share_max;            /* bounds of budget_share; share_max 0: no time budget */
} duet_ctl_config;

/* What the last window measured. */
typedef struct duet_ctl_window {
    double arrival_rate;  /* requests per second */
    int waiting;          /* requests queued now */
    int running;          /* requests holding a slot now */
    double ttft_p99_s[2]; /* per class; ignored where ttft_n is 0 */
    int ttft_n[2];
    double itl_p99_s[2]; /* per class; ignored where itl_n is 0 */
    int itl_n[2];
    int budget_cut; /* steps whose prompt chunks the time budget shortened */
} duet_ctl_window;

typedef struct duet_ctl_knobs {
    int max_batch_seqs, max_batch_tokens;
    int64_t batch_timeout_ns;
    double budget_share; /* time budgets: a step with decodes of a class may take this share of the
                            class's ITL target (predicted); ignored when cfg.share_max is 0 */
} duet_ctl_knobs;

typedef enum duet_ctl_action {
    DUET_CTL_HOLD = 0, /* inside the bands (or no targets, or no samples) */
    DUET_CTL_PROTECT,  /* ITL over target: smaller steps */
    DUET_CTL_CATCH_UP, /* TTFT over target or a backlog: admit sooner, more */
    DUET_CTL_RELAX,    /* quiet: wait longer to batch, larger steps */
    DUET_CTL_N_ACTIONS
} duet_ctl_action;

typedef struct duet_ctl {
    duet_ctl_config cfg;
    double itl_ratio, ttft_ratio; /* smoothed; < 0 until the first sample */
    uint64_t windows, actions[DUET_CTL_N_ACTIONS];
    duet_ctl_action last;
    uint64_t budget_cut_seen; /* the caller's: the scheduler's budget_cut count at the last window */
} duet_ctl;

/* Checks cfg (bounds ordered and positive, targets >= 0) and resets c.
 * DUET_INVALID_ARGUMENT with a message otherwise. */
duet_status duet__ctl_init(duet_ctl *c, const duet_ctl_config *cfg);
/* Whether any target is set (without one the controller always holds). */
bool duet__ctl_active(const duet_ctl *c);
/* One window: writes the knobs for the next one to *next (cur clamped to
 * the bounds when it holds) and returns what it decided. */
duet_ctl_action duet__ctl_update(duet_ctl *c, const duet_ctl_window *w, const duet_ctl_knobs *cur,
                                 duet_ctl_knobs *next);
/* "hold", "protect", "catch_up", "relax". */
const char *duet__ctl_action_name(duet_ctl_action a);

#endif /* DUET_CONTROLLER_H */
