/* engine_config.c — an instance's configuration from its knobs, for the
 * engine and the simulator alike (engine_config.h). */
#include <math.h>

#include "duet_internal.h"
#include "engine_config.h"
#include "speculative.h"

duet_status duet__step_cost_check(const duet_step_cost *m) {
    for (int j = 0; j < DUET_STEP_COST_TERMS; j++)
        if (!(isfinite(m->coef[j]) && m->coef[j] >= 0))
            return duet__error(DUET_INVALID_ARGUMENT, "step-cost term %s is %g; it must be finite and >= 0",
                               duet_step_cost_term(j), m->coef[j]);
    return DUET_OK;
}

duet_status duet__engine_params_check(const duet_engine_params *params, duet_engine_params *out) {
    duet_engine_params p = params ? *params : duet_engine_params_default();
    duet_engine_params d = duet_engine_params_default();
    if (!p.max_batch_seqs) p.max_batch_seqs = d.max_batch_seqs;
    if (!p.max_batch_tokens) p.max_batch_tokens = d.max_batch_tokens;
    if (p.batch_timeout_ms < 0) p.batch_timeout_ms = d.batch_timeout_ms;
    if (!p.prefill_chunk) p.prefill_chunk = d.prefill_chunk;
    if (!p.max_waiting) p.max_waiting = d.max_waiting;
    if (!p.kv_block_size) p.kv_block_size = d.kv_block_size;
    if (p.max_batch_seqs < 1 || p.max_batch_seqs > 1024)
        return duet__error(DUET_INVALID_ARGUMENT, "max_batch_seqs %d out of range [1, 1024]",
                           p.max_batch_seqs);
    if (p.max_batch_tokens < p.max_batch_seqs || p.max_batch_tokens > 65536)
        return duet__error(DUET_INVALID_ARGUMENT, "max_batch_tokens %d out of range [max_batch_seqs, 65536]",
                           p.max_batch_tokens);
    if (p.prefill_chunk < 1 || p.prefill_chunk > p.max_batch_tokens)
        return duet__error(DUET_INVALID_ARGUMENT, "prefill_chunk %d out of range [1, max_batch_tokens]",
                           p.prefill_chunk);
    if (p.max_waiting < 1 || p.max_waiting > 100000)
        return duet__error(DUET_INVALID_ARGUMENT, "max_waiting %d out of range [1, 100000]", p.max_waiting);
    if (!(p.batch_timeout_ms <= 60000))
        return duet__error(DUET_INVALID_ARGUMENT, "batch_timeout_ms %g out of range [0, 60000]",
                           p.batch_timeout_ms);
    if (p.kv_block_size != 16 && p.kv_block_size != 32)
        return duet__error(DUET_INVALID_ARGUMENT, "kv_block_size %d must be 16 or 32", p.kv_block_size);
    duet_spec_mode spec_mode;
    int spec_k;
    duet_status st = duet__spec_params(&p.open, &spec_mode, &spec_k);
    if (st) return st;
    if (p.spec_max_batch < -1)
        return duet__error(DUET_INVALID_ARGUMENT, "spec_max_batch %d must be >= -1", p.spec_max_batch);
    for (int c = 0; c < 2; c++)
        if (!(p.slo_ttft_ms[c] >= 0 && p.slo_ttft_ms[c] <= 3.6e6) ||
            !(p.slo_itl_ms[c] >= 0 && p.slo_itl_ms[c] <= 3.6e6))
            return duet__error(DUET_INVALID_ARGUMENT,
                               "latency targets must be in [0, 3600000] ms (0 = none)");
    if (!p.controller_window_ms) p.controller_window_ms = 2000;
    if (!p.step_budget_share) p.step_budget_share = 0.8;
    if (!(p.step_budget_share >= 0.25 && p.step_budget_share <= 1))
        return duet__error(DUET_INVALID_ARGUMENT, "step_budget_share %g out of range [0.25, 1]",
                           p.step_budget_share);
    if (!(p.controller_window_ms >= 10 && p.controller_window_ms <= 3.6e6))
        return duet__error(DUET_INVALID_ARGUMENT, "controller_window_ms %g out of range [10, 3600000]",
                           p.controller_window_ms);
    if (p.step_cost && (st = duet__step_cost_check(p.step_cost))) return st;
    *out = p;
    return DUET_OK;
}

void duet__engine_setup(const duet_engine_params *p, int n_ctx, int kv_blocks, int spec_max_batch,
                        duet_engine_setup *out) {
    *out = (duet_engine_setup){
        .sched = {.max_seqs = p->max_batch_seqs,
                  .max_tokens = p->max_batch_tokens,
                  .max_waiting = p->max_waiting,
                  .n_ctx = n_ctx,
                  .kv_block_size = p->kv_block_size,
                  .kv_blocks = kv_blocks,
                  .knobs = {.max_batch_seqs = p->max_batch_seqs,
                            .max_batch_tokens = p->max_batch_tokens,
                            .prefill_chunk = p->prefill_chunk,
                            .max_waiting = p->max_waiting,
                            .batch_timeout_ns = (int64_t)(p->batch_timeout_ms * 1e6),
                            .spec_max_batch = spec_max_batch,
                            .spec_measured = p->spec_max_batch >= 0 && !p->spec_always}},
        /* Stall-free steps under ITL targets: the budget starts at this
         * share of each class's target. */
        .budget_share = p->step_budget_share,
        .static_knobs = p->static_knobs,
        .ctl = {.seqs_min = 1,
                .seqs_max = p->max_batch_seqs,
                .tokens_min = p->max_batch_tokens < 16 ? p->max_batch_tokens : 16,
                .tokens_max = p->max_batch_tokens,
                .timeout_min_ns = 0,
                .timeout_max_ns = (int64_t)((p->batch_timeout_ms > 100 ? p->batch_timeout_ms : 100) * 1e6)},
        .ctl_window_ns = (int64_t)(p->controller_window_ms * 1e6)};
    for (int c = 0; c < 2; c++) {
        out->slo_itl_s[c] = p->slo_itl_ms[c] * 1e-3;
        out->ctl.ttft_target_s[c] = p->slo_ttft_ms[c] * 1e-3;
        out->ctl.itl_target_s[c] = p->slo_itl_ms[c] * 1e-3;
        if (out->ctl.itl_target_s[c] > 0)
            out->ctl.share_min = 0.25, out->ctl.share_max = 1; /* time budgets */
    }
    duet__engine_step_budgets(out->budget_share, out->slo_itl_s, &out->sched.knobs);
}

void duet__engine_step_budgets(double share, const double slo_itl_s[2], duet_sched_knobs *k) {
    for (int c = 0; c < 2; c++)
        k->step_budget_ns[c] = (int64_t)(share * slo_itl_s[c] * 1e9);
}

duet_ctl_action duet__engine_ctl_tick(duet_ctl *c, duet_ctl_window *w, duet_sched *s, double *share,
                                      const double slo_itl_s[2]) {
    duet_sched_stats st;
    duet__sched_stats(s, &st);
    w->waiting = st.waiting[0] + st.waiting[1];
    w->running = st.running[0] + st.running[1];
    w->budget_cut = (int)(st.budget_cut - c->budget_cut_seen);
    c->budget_cut_seen = st.budget_cut;
    duet_sched_knobs k = duet__sched_knobs(s);
    duet_ctl_knobs cur = {k.max_batch_seqs, k.max_batch_tokens, k.batch_timeout_ns, *share}, next;
    duet_ctl_action a = duet__ctl_update(c, w, &cur, &next);
    k.max_batch_seqs = next.max_batch_seqs;
    k.max_batch_tokens = next.max_batch_tokens;
    k.batch_timeout_ns = next.batch_timeout_ns;
    if (c->cfg.share_max > 0) *share = next.budget_share;
    duet__engine_step_budgets(*share, slo_itl_s, &k);
    duet__sched_set_knobs(s, &k); /* within the configured capacities by construction */
    return a;
}
