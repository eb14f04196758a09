/* controller.c — the adaptive controller's law (see controller.h). */
#include "controller.h"

#include <math.h>
#include <string.h>

#include "../backends/backend.h"

/* Thresholds of the bands (ratios of measured p99 to target). */
#define ITL_HIGH 0.9      /* smoothed over (or one window over 1): protect */
#define ITL_HEADROOM 0.65 /* under: catching up may grow the steps */
#define ITL_QUIET 0.5
#define TTFT_HIGH 1.0
#define TTFT_QUIET 0.5
#define GROW 1.08          /* one window's growth */
#define CUT_MIN 0.60       /* deepest cut in one window */
#define CUT_MAX 0.92       /* shallowest cut */
#define CUT_AIM 0.8        /* a cut aims at this ratio */
#define TIMEOUT_SHARE 0.02 /* batch_timeout at most this share of the TTFT target */

duet_status duet__ctl_init(duet_ctl *c, const duet_ctl_config *cfg) {
    memset(c, 0, sizeof *c);
    if (cfg->seqs_min < 1 || cfg->seqs_max < cfg->seqs_min || cfg->tokens_min < 1 ||
        cfg->tokens_max < cfg->tokens_min || cfg->timeout_min_ns < 0 ||
        cfg->timeout_max_ns < cfg->timeout_min_ns || !(cfg->share_max >= 0 && cfg->share_max <= 1) ||
        (cfg->share_max > 0 && !(cfg->share_min > 0 && cfg->share_min <= cfg->share_max)))
        return duet__error(DUET_INVALID_ARGUMENT,
                           "controller: bad bounds (seqs %d..%d, tokens %d..%d, timeout %lld..%lld ns, "
                           "budget share %g..%g)",
                           cfg->seqs_min, cfg->seqs_max, cfg->tokens_min, cfg->tokens_max,
                           (long long)cfg->timeout_min_ns, (long long)cfg->timeout_max_ns, cfg->share_min,
                           cfg->share_max);
    for (int p = 0; p < 2; p++)
        if (!(cfg->ttft_target_s[p] >= 0) || !(cfg->itl_target_s[p] >= 0) || isinf(cfg->ttft_target_s[p]) ||
            isinf(cfg->itl_target_s[p]))
            return duet__error(DUET_INVALID_ARGUMENT, "controller: latency targets must be finite and >= 0");
    c->cfg = *cfg;
    c->itl_ratio = c->ttft_ratio = -1;
    return DUET_OK;
}

bool duet__ctl_active(const duet_ctl *c) {
    for (int p = 0; p < 2; p++)
        if (c->cfg.ttft_target_s[p] > 0 || c->cfg.itl_target_s[p] > 0) return true;
    return false;
}

const char *duet__ctl_action_name(duet_ctl_action a) {
    static const char *const names[DUET_CTL_N_ACTIONS] = {"hold", "protect", "catch_up", "relax"};
    return a >= 0 && a < DUET_CTL_N_ACTIONS ? names[a] : "?";
}

/* The worst p99 / target over the classes with a target and samples; -1
 * when none has both. */
static double worst_ratio(const double *target, const double *p99, const int *n) {
    double r = -1;
    for (int p = 0; p < 2; p++)
        if (target[p] > 0 && n[p] > 0 && p99[p] >= 0 && p99[p] / target[p] > r) r = p99[p] / target[p];
    return r;
}

/* Half the old value, half the new; a window without samples keeps it. */
static double smooth(double old, double now) {
    if (now < 0) return old;
    return old < 0 ? now : 0.5 * old + 0.5 * now;
}

static int clamp_int(long v, int lo, int hi) {
    return v < lo ? lo : v > hi ? hi : (int)v;
}
static int64_t clamp_i64(int64_t v, int64_t lo, int64_t hi) {
    return v < lo ? lo : v > hi ? hi : v;
}
static double clamp_d(double v, double lo, double hi) {
    return v < lo ? lo : v > hi ? hi : v;
}

/* v * f, moving by at least 1 when f != 1. */
static long scale(int v, double f) {
    long s = lround(v * f);
    if (f > 1 && s <= v) s = v + 1;
    if (f < 1 && s >= v) s = v - 1;
    return s;
}

duet_ctl_action duet__ctl_update(duet_ctl *c, const duet_ctl_window *w, const duet_ctl_knobs *cur,
                                 duet_ctl_knobs *next) {
    const duet_ctl_config *g = &c->cfg;
    c->windows++;
    double itl_now = worst_ratio(g->itl_target_s, w->itl_p99_s, w->itl_n);
    c->itl_ratio = smooth(c->itl_ratio, itl_now);
    c->ttft_ratio = smooth(c->ttft_ratio, worst_ratio(g->ttft_target_s, w->ttft_p99_s, w->ttft_n));
    int seqs = clamp_int(cur->max_batch_seqs, g->seqs_min, g->seqs_max);
    int tokens = clamp_int(cur->max_batch_tokens, g->tokens_min, g->tokens_max);
    int64_t timeout = clamp_i64(cur->batch_timeout_ns, g->timeout_min_ns, g->timeout_max_ns);
    /* The step budget: a share of the ITL targets (timed), or tokens. */
    const bool timed = g->share_max > 0;
    const bool binds = w->budget_cut > 0; /* a time budget that shortened a chunk: growing it helps */
    double share = timed ? clamp_d(cur->budget_share, g->share_min, g->share_max) : cur->budget_share;
    /* The longest timeout that TTFT targets allow. */
    double tightest = 0;
    for (int p = 0; p < 2; p++)
        if (g->ttft_target_s[p] > 0 && (tightest == 0 || g->ttft_target_s[p] < tightest))
            tightest = g->ttft_target_s[p];
    int64_t timeout_cap =
        clamp_i64((int64_t)(tightest * TIMEOUT_SHARE * 1e9), g->timeout_min_ns, g->timeout_max_ns);

    double itl = c->itl_ratio, ttft = c->ttft_ratio;
    bool backlog = w->waiting > 0 && w->running >= seqs;
    duet_ctl_action a = DUET_CTL_HOLD;
    if (!duet__ctl_active(c)) {
        a = DUET_CTL_HOLD;
    } else if (itl > ITL_HIGH || itl_now > 1) {
        a = DUET_CTL_PROTECT;
        /* One window over the target acts at once, but the depth of the
         * cut follows the smoothed ratio: a lone slow step (a p99 of one
         * window is about its slowest gaps) trims the budget by
         * CUT_MAX, a lasting excess cuts deeper. Cutting by the window's
         * own ratio took 40% off the budget per outlier, which the 8%
         * growth per quiet window then took 7 windows to give back:
         * prefill starved under load (SmolLM2, cpu 2t, 3.5 req/s: p99
         * TTFT 5.5 s at p99 ITL 73 ms). */
        double f = CUT_AIM / itl;
        f = f < CUT_MIN ? CUT_MIN : f > CUT_MAX ? CUT_MAX : f;
        int floor_tokens = seqs > g->tokens_min ? seqs : g->tokens_min;
        if (timed && share > g->share_min) {
            share = clamp_d(share * f, g->share_min, g->share_max);
        } else if (!timed && tokens > floor_tokens) {
            tokens = clamp_int(scale(tokens, f), floor_tokens, g->tokens_max);
        } else {
            seqs = clamp_int(scale(seqs, f), g->seqs_min, g->seqs_max);
            tokens = clamp_int(tokens, seqs > g->tokens_min ? seqs : g->tokens_min, g->tokens_max);
        }
    } else if (ttft > TTFT_HIGH || backlog) {
        a = DUET_CTL_CATCH_UP;
        if (itl < ITL_HEADROOM) {
            if (!timed)
                tokens = clamp_int(scale(tokens, GROW), g->tokens_min, g->tokens_max);
            else if (binds)
                share = clamp_d(share * GROW, g->share_min, g->share_max);
            if (backlog) seqs = clamp_int(scale(seqs, GROW), g->seqs_min, g->seqs_max);
        }
    } else if (ttft < TTFT_QUIET && w->waiting == 0) { /* -1: no samples, quiet */
        a = DUET_CTL_RELAX;
        if (itl < ITL_QUIET && !timed)
            tokens = clamp_int(scale(tokens, GROW), g->tokens_min, g->tokens_max);
        else if (itl < ITL_QUIET && binds)
            share = clamp_d(share * GROW, g->share_min, g->share_max);
    }
    /* The timeout follows the TTFT headroom, not the branch: all of its cap
     * while p99 TTFT is under TTFT_QUIET of its target (or unmeasured),
     * nothing at the target, linear between. A set point of the smoothed
     * ratio rather than 8% steps: at constant load it stays put (growing 8%
     * a 2 s window took 70 s to reach its cap and moved 3x per 30 s at a
     * steady quiet load: the load ramp of
     * bench/results/ramp-smollm2-xeon-2c.md). It costs at most 2% of the
     * TTFT target, so it hardly feeds back on the ratio. A backlog does not
     * move it: the timeout only delays a step when nothing runs, and
     * halving it on each window that sampled a queue made it saw-tooth
     * between its cap and half near capacity. Without a TTFT target it
     * stays as configured. */
    if (tightest > 0) {
        double room = ttft < 0 ? 1 : clamp_d((TTFT_HIGH - ttft) / (TTFT_HIGH - TTFT_QUIET), 0, 1);
        int64_t set = g->timeout_min_ns + (int64_t)(room * (double)(timeout_cap - g->timeout_min_ns));
        timeout = clamp_i64(set, g->timeout_min_ns, timeout_cap);
    }
    /* Every running sequence decodes each step: the budget covers the batch. */
    if (tokens < seqs) tokens = clamp_int(seqs, g->tokens_min, g->tokens_max);
    if (tokens < seqs) seqs = tokens;
    *next = (duet_ctl_knobs){.max_batch_seqs = seqs,
                             .max_batch_tokens = tokens,
                             .batch_timeout_ns = timeout,
                             .budget_share = share};
    if (seqs == cur->max_batch_seqs && tokens == cur->max_batch_tokens && timeout == cur->batch_timeout_ns &&
        share == cur->budget_share)
        a = DUET_CTL_HOLD; /* nothing moved (at the bounds) */
    c->actions[a]++;
    c->last = a;
    return a;
}
