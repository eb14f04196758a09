/* metrics.h — counters, gauges and histograms of one engine instance.
 *
 * The engine records at every arrow of the data flow; the server exports
 * the same numbers at /metrics (Prometheus text format, with vLLM-named
 * aliases where the meaning is the same); the adaptive controller and
 * duet-bench read them too. Every function is thread-safe (one mutex; the
 * recording calls are a few additions each). No allocation after _new.
 */
#ifndef DUET_METRICS_H
#define DUET_METRICS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "duet.h"

typedef struct duet_metrics duet_metrics;

duet_metrics *duet__metrics_new(const char *model_name);
void duet__metrics_free(duet_metrics *m);

/* A request left the system: its outcome, priority and timings (seconds). */
void duet__metrics_request_done(duet_metrics *m, duet_priority prio, duet_finish finish, double e2e_s,
                                double ttft_s, double queue_s, int prompt_tokens, int generated_tokens);
/* A request was refused at submit (queue full -> "rejected", invalid -> "invalid"). */
void duet__metrics_request_refused(duet_metrics *m, duet_priority prio, const char *reason);
/* One inter-token gap of a running request (of a priority class, for the
 * per-class window; the first form leaves it out of the classes). */
void duet__metrics_inter_token(duet_metrics *m, double seconds);
void duet__metrics_inter_token_prio(duet_metrics *m, duet_priority prio, double seconds);
/* One engine step: sequences and tokens in it, and device time it took. */
void duet__metrics_step(duet_metrics *m, int n_seqs, int n_tokens, double busy_s);
/* A preemption (KV pressure). */
void duet__metrics_preempted(duet_metrics *m, duet_priority prio);
/* One speculative verification: n_draft draft tokens, of which the first
 * n_accepted were kept (vllm:spec_decode_*). */
void duet__metrics_spec(duet_metrics *m, int n_draft, int n_accepted);
/* Seconds one step spent in the draft model's forward passes. */
void duet__metrics_spec_draft_time(duet_metrics *m, double seconds);

/* Gauges, set by the engine after each step. */
typedef struct duet_metrics_gauges {
    int waiting[2], running[2]; /* by duet_priority */
    double kv_usage;            /* 0..1 */
    int max_batch_seqs, max_batch_tokens, prefill_chunk;
    double batch_timeout_s;
    int kv_block_size, kv_blocks;  /* the KV pool's geometry (vllm:cache_config_info); 0: not known */
    bool prefix_cache;             /* automatic prefix caching is on */
    uint64_t prefix_cache_queries; /* prompt tokens looked up in the prefix cache (cumulative) */
    uint64_t prefix_cache_hits;    /* of those, found cached (cumulative) */
    int kv_blocks_cached;          /* blocks with a prefix cache entry now */
    /* Speculative decoding: the most draft tokens per sequence (0: off, and
     * no spec metric is exported), the hard cap on a drafting step's
     * decodes, whether the measured decision runs; draft tokens offered,
     * refused (by the decision or the cap) and refused by the cap; steps
     * with offers by the scheduler's DUET_SPEC_STEP_* kind (draft, plain,
     * explore, capped, always); the last decision's predicted speed-up of
     * its best grants, mean acceptance estimate and predicted draft
     * seconds; the draft model's step-cost coefficients (draft_model:
     * there is one). */
    int spec_k, spec_max_batch;
    bool spec_measured, spec_draft_model;
    uint64_t spec_offered_tokens, spec_throttled_tokens, spec_capped_tokens;
    uint64_t spec_steps[5];
    double spec_speedup, spec_alpha, spec_draft_predicted_s;
    double spec_draft_coef[DUET_STEP_COST_TERMS];
    /* The adaptive controller (core/controller.h): whether it runs, its
     * targets per class (seconds, 0 = none), its smoothed pressure ratios
     * (p99 / target, -1 = no samples yet) and its decisions by action. */
    bool controller;
    double slo_ttft_s[2], slo_itl_s[2];
    double ctl_itl_ratio, ctl_ttft_ratio;
    uint64_t ctl_decisions[4];
    /* Stall-free steps: the step budget per class (seconds, 0 = none), its
     * share of the ITL target, and the steps whose prompt chunks it cut /
     * that the model predicted over it (cumulative). */
    double step_budget_s[2], budget_share;
    uint64_t budget_cut_steps, budget_over_steps;
} duet_metrics_gauges;
void duet__metrics_set_gauges(duet_metrics *m, const duet_metrics_gauges *g);
/* The engine's health (duet_engine_healthy); a new instance is healthy. */
void duet__metrics_set_healthy(duet_metrics *m, bool healthy);

/* Recent-window view for the adaptive controller and benchmarks. */
typedef struct duet_metrics_window {
    double ttft_p99_s, itl_p99_s, e2e_p99_s;      /* over the last window_s seconds */
    double ttft_p99_prio_s[2], itl_p99_prio_s[2]; /* the same by duet_priority (0 without samples) */
    int ttft_n[2], itl_n[2];                      /* samples behind them */
    double arrival_rate;                          /* requests per second */
    double busy_ratio;                            /* device busy time / wall time */
    int n_requests;
} duet_metrics_window;
void duet__metrics_window(duet_metrics *m, double now_s, double window_s, duet_metrics_window *out);

/* A growing text, as the exposition is built: appends printf-style; a
 * failed allocation sets oom (and later appends do nothing). p is malloc'd,
 * NUL-terminated once anything was appended. */
typedef struct duet_text {
    char *p;
    size_t len, cap;
    bool oom;
} duet_text;
void duet__text_printf(duet_text *t, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

/* Prometheus text exposition (malloc'd; caller frees). */
char *duet__metrics_render(duet_metrics *m);
/* The same families over several instances (the first one's model name):
 * counters and histograms summed; gauges: waiting and running summed, KV
 * usage over all pools' blocks, max_batch_seqs/tokens and kv_blocks summed
 * (the fleet's capacity), the step-budget step counts summed, prefill_chunk, batch_timeout and kv_block_size
 * the first instance's; busy ratio the mean; healthy while any one is. */
char *duet__metrics_render_sum(duet_metrics *const *ms, int n);

/* What a router and per-instance exports read of one instance. */
typedef struct duet_metrics_summary {
    duet_metrics_gauges gauges;
    bool healthy;
    double step_tokens, busy_s; /* tokens computed in steps, device seconds of those steps */
    uint64_t prompt_tokens, generated_tokens, finished;
} duet_metrics_summary;
void duet__metrics_summary(duet_metrics *m, duet_metrics_summary *out);
/* The model_name label's value, escaped (lives as long as m). */
const char *duet__metrics_model_name(const duet_metrics *m);

#endif /* DUET_METRICS_H */
