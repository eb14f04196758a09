/* test_scheduler.c — the continuous-batching scheduler on a virtual clock:
 * ordering, fairness, priorities, batch_timeout, chunked prefill, continuous
 * batching, preemption and resume, cancellation in every state, refusals,
 * and a randomized simulation that checks invariants at every event. */
#include <check.h>
#include <math.h>

#include "scheduler.h"
#include "test_util.h"

#define MS DUET_SCHED_NS_PER_MS
#define MAX_ID 8192

/* The fake engine's view of each request: how many tokens it samples before
 * it finishes, what it has sampled, and how often it finished. */
static int g_target[MAX_ID], g_gen[MAX_ID], g_done[MAX_ID];

static duet_sched_config base_config(void) {
    duet_sched_config c = {
        .max_seqs = 4,
        .max_tokens = 64,
        .max_waiting = 16,
        .n_ctx = 256,
        .kv_block_size = 16,
        .kv_blocks = 64,
        .knobs = {.max_batch_seqs = 4,
                  .max_batch_tokens = 64,
                  .prefill_chunk = 16,
                  .max_waiting = 16,
                  .batch_timeout_ns = 0},
    };
    return c;
}

static duet_sched *make(const duet_sched_config *c) {
    memset(g_target, 0, sizeof g_target);
    memset(g_gen, 0, sizeof g_gen);
    memset(g_done, 0, sizeof g_done);
    duet_sched *s = NULL;
    duet_status st = duet__sched_new(c, &s);
    ck_assert_msg(st == DUET_OK && s, "sched_new failed: %s", duet_last_error());
    return s;
}

static void check_ok(const duet_sched *s, const char *where) {
    duet_status st = duet__sched_check(s);
    ck_assert_msg(st == DUET_OK, "invariants broken %s: %s", where, duet_last_error());
}

static void arrive(duet_sched *s, int64_t now, uint64_t id, int n_prompt, int max_new, duet_priority prio) {
    duet_sched_admit a = duet__sched_arrival(s, now, id, n_prompt, max_new, prio);
    ck_assert_msg(a == DUET_SCHED_ADMITTED, "arrival of %llu (prompt %d, max_new %d) got %d",
                  (unsigned long long)id, n_prompt, max_new, a);
    g_target[id] = max_new;
    check_ok(s, "after arrival");
}

static int find_seq(const duet_sched_plan *p, uint64_t id) {
    for (int k = 0; k < p->n_seqs; k++)
        if (p->seqs[k].id == id) return k;
    return -1;
}

static bool was_preempted(const duet_sched_plan *p, uint64_t id) {
    for (int k = 0; k < p->n_preempted; k++)
        if (p->preempted[k] == id) return true;
    return false;
}

/* Plans and insists on a step. */
static void plan_step(duet_sched *s, int64_t now, duet_sched_plan *p) {
    duet_sched_action a = duet__sched_plan(s, now, p);
    ck_assert_msg(a == DUET_SCHED_STEP, "expected a step at t=%lld, got action %d", (long long)now, a);
    check_ok(s, "after plan");
}

/* Completes the outstanding step like an engine: every logits row samples
 * one token; a request finishes when it reaches its target. */
static void complete(duet_sched *s, int64_t now, const duet_sched_plan *p) {
    duet_sched_result r[256];
    ck_assert(p->n_seqs <= 256);
    for (int k = 0; k < p->n_seqs; k++) {
        uint64_t id = p->seqs[k].id;
        r[k].id = id;
        r[k].n_generated = p->seqs[k].logits ? 1 : 0;
        r[k].finished = false;
        if (p->seqs[k].logits && g_done[id] == 0) {
            g_gen[id]++;
            if (g_gen[id] >= g_target[id]) {
                r[k].finished = true;
                g_done[id]++;
            }
        }
    }
    duet_status st = duet__sched_step_done(s, now, r, p->n_seqs);
    ck_assert_msg(st == DUET_OK, "step_done refused: %s", duet_last_error());
    check_ok(s, "after step_done");
}

/* Runs steps until the scheduler has nothing to do; returns the steps run. */
static int run_to_idle(duet_sched *s, int64_t *now, int max_steps) {
    duet_sched_plan p;
    for (int n = 0; n < max_steps; n++) {
        duet_sched_action a = duet__sched_plan(s, *now, &p);
        if (a == DUET_SCHED_IDLE) return n;
        if (a == DUET_SCHED_WAIT) {
            *now = p.wake_at;
            continue;
        }
        check_ok(s, "run_to_idle plan");
        *now += MS;
        complete(s, *now, &p);
    }
    ck_abort_msg("scheduler still busy after %d steps", max_steps);
    return -1;
}

/* ---- basic life cycle ---------------------------------------------------- */

START_TEST(test_single_request_lifecycle) {
    duet_sched_config c = base_config();
    c.knobs.prefill_chunk = 4;
    duet_sched *s = make(&c);
    duet_sched_plan p;
    ck_assert_msg(duet__sched_plan(s, 0, &p) == DUET_SCHED_IDLE, "an empty scheduler is idle");
    ck_assert(!duet__sched_busy(s));
    arrive(s, 0, 7, 10, 3, DUET_PRIORITY_INTERACTIVE);
    ck_assert(duet__sched_busy(s));
    /* Prompt of 10 in chunks of 4: 0..3, 4..7, 8..9 (logits on the last). */
    int want_pos[] = {0, 4, 8, 10, 11}, want_n[] = {4, 4, 2, 1, 1};
    bool want_logits[] = {false, false, true, true, true}, want_decode[] = {false, false, false, true, true};
    for (int i = 0; i < 5; i++) {
        plan_step(s, i * MS, &p);
        ck_assert_msg(p.n_seqs == 1 && p.seqs[0].id == 7, "step %d: one entry for request 7", i);
        const duet_sched_seq *e = &p.seqs[0];
        ck_assert_msg(e->pos == want_pos[i] && e->n_tokens == want_n[i] && e->logits == want_logits[i] &&
                          e->decode == want_decode[i],
                      "step %d: pos %d n %d logits %d decode %d; want pos %d n %d logits %d decode %d", i,
                      e->pos, e->n_tokens, e->logits, e->decode, want_pos[i], want_n[i], want_logits[i],
                      want_decode[i]);
        ck_assert_msg(e->first_schedule == (i == 0), "first_schedule only on the first step (step %d)", i);
        ck_assert_msg(e->slot == 0 && e->n_blocks == 1 && e->blocks[0] >= 0,
                      "one slot, one block of 16 tokens");
        ck_assert_msg(e->n_prompt == 10 && e->n_generated == (i < 3 ? 0 : i - 2), "stream layout at step %d",
                      i);
        ck_assert_int_eq(p.n_tokens, want_n[i]);
        ck_assert_int_eq(p.n_logits, want_logits[i] ? 1 : 0);
        complete(s, i * MS + MS / 2, &p);
    }
    ck_assert_msg(g_gen[7] == 3 && g_done[7] == 1, "request 7 generated %d (want 3), finished %d times",
                  g_gen[7], g_done[7]);
    ck_assert_msg(duet__sched_plan(s, 10 * MS, &p) == DUET_SCHED_IDLE,
                  "idle after the only request finished");
    duet_sched_stats st;
    duet__sched_stats(s, &st);
    ck_assert_msg(st.finished == 1 && st.arrivals == 1 && st.kv_blocks_used == 0 && st.steps == 5 &&
                      st.step_tokens == 12,
                  "stats: finished %llu arrivals %llu kv used %d steps %llu tokens %llu",
                  (unsigned long long)st.finished, (unsigned long long)st.arrivals, st.kv_blocks_used,
                  (unsigned long long)st.steps, (unsigned long long)st.step_tokens);
    duet__sched_free(s);
}
END_TEST

/* ---- ordering and fairness ------------------------------------------------ */

/* Runs to idle with max_batch_seqs = 1 and records the first-schedule order. */
static int run_recording_order(duet_sched *s, int64_t now, uint64_t *order, int max) {
    int n = 0;
    duet_sched_plan p;
    for (int it = 0; it < 10000; it++) {
        duet_sched_action a = duet__sched_plan(s, now, &p);
        if (a == DUET_SCHED_IDLE) return n;
        ck_assert(a == DUET_SCHED_STEP);
        for (int k = 0; k < p.n_seqs; k++)
            if (p.seqs[k].first_schedule && n < max) order[n++] = p.seqs[k].id;
        now += MS;
        complete(s, now, &p);
    }
    ck_abort_msg("did not finish");
    return n;
}

START_TEST(test_fifo_within_class) {
    duet_sched_config c = base_config();
    c.knobs.max_batch_seqs = 1;
    duet_sched *s = make(&c);
    /* Arrival order differs from id order to catch sorting by id. */
    uint64_t ids[] = {5, 3, 9, 1, 7};
    for (int i = 0; i < 5; i++)
        arrive(s, i, ids[i], 3 + i, 2, DUET_PRIORITY_BATCH);
    uint64_t order[8];
    int n = run_recording_order(s, 10, order, 8);
    ck_assert_int_eq(n, 5);
    for (int i = 0; i < 5; i++)
        ck_assert_msg(order[i] == ids[i], "position %d started request %llu, want %llu (FIFO by arrival)", i,
                      (unsigned long long)order[i], (unsigned long long)ids[i]);
    duet__sched_free(s);
}
END_TEST

START_TEST(test_interactive_before_batch) {
    duet_sched_config c = base_config();
    c.knobs.max_batch_seqs = 1;
    duet_sched *s = make(&c);
    duet_sched_plan p;
    arrive(s, 0, 1, 4, 3, DUET_PRIORITY_BATCH);
    plan_step(s, 0, &p);
    ck_assert(find_seq(&p, 1) == 0);
    complete(s, MS, &p);
    arrive(s, MS, 2, 4, 2, DUET_PRIORITY_BATCH);
    arrive(s, 2 * MS, 3, 4, 2, DUET_PRIORITY_INTERACTIVE);
    arrive(s, 3 * MS, 4, 4, 2, DUET_PRIORITY_BATCH);
    arrive(s, 4 * MS, 5, 4, 2, DUET_PRIORITY_INTERACTIVE);
    duet_sched_stats st;
    duet__sched_stats(s, &st);
    ck_assert_msg(st.waiting[DUET_PRIORITY_INTERACTIVE] == 2 && st.waiting[DUET_PRIORITY_BATCH] == 2 &&
                      st.running[DUET_PRIORITY_BATCH] == 1,
                  "gauges: waiting %d/%d running %d/%d", st.waiting[0], st.waiting[1], st.running[0],
                  st.running[1]);
    uint64_t order[8];
    int n = run_recording_order(s, 5 * MS, order, 8);
    uint64_t want[] = {3, 5, 2, 4};
    ck_assert_int_eq(n, 4);
    for (int i = 0; i < 4; i++)
        ck_assert_msg(order[i] == want[i],
                      "position %d started %llu, want %llu (interactive first, FIFO within)", i,
                      (unsigned long long)order[i], (unsigned long long)want[i]);
    duet__sched_stats(s, &st);
    ck_assert_msg(st.preemptions == 0, "plenty of KV: the running batch request must not be preempted");
    ck_assert_msg(g_done[1] == 1 && g_gen[1] == 3, "the first batch request ran to the end");
    duet__sched_free(s);
}
END_TEST

/* ---- batch_timeout ------------------------------------------------------------ */

START_TEST(test_batch_timeout_waits_then_starts) {
    duet_sched_config c = base_config();
    c.knobs.max_batch_seqs = 3;
    c.knobs.batch_timeout_ns = 10 * MS;
    duet_sched *s = make(&c);
    duet_sched_plan p;
    arrive(s, 0, 1, 8, 4, DUET_PRIORITY_INTERACTIVE);
    ck_assert_msg(duet__sched_plan(s, 0, &p) == DUET_SCHED_WAIT && p.wake_at == 10 * MS,
                  "an idle engine waits until arrival + batch_timeout (wake_at %lld)", (long long)p.wake_at);
    arrive(s, 4 * MS, 2, 8, 4, DUET_PRIORITY_BATCH);
    ck_assert_msg(duet__sched_plan(s, 4 * MS, &p) == DUET_SCHED_WAIT && p.wake_at == 10 * MS,
                  "the deadline follows the oldest arrival (wake_at %lld)", (long long)p.wake_at);
    ck_assert_msg(duet__sched_plan(s, 10 * MS - 1, &p) == DUET_SCHED_WAIT,
                  "still waiting 1 ns before the deadline");
    plan_step(s, 10 * MS, &p);
    ck_assert_msg(p.n_seqs == 2 && find_seq(&p, 1) == 0 && find_seq(&p, 2) == 1,
                  "at the deadline both start, interactive first (%d entries)", p.n_seqs);
    complete(s, 11 * MS, &p);
    /* While running, a new arrival joins the next step without waiting. */
    arrive(s, 11 * MS, 3, 8, 4, DUET_PRIORITY_BATCH);
    plan_step(s, 11 * MS, &p);
    ck_assert_msg(find_seq(&p, 3) >= 0, "a busy engine admits arrivals at once");
    complete(s, 12 * MS, &p);
    int64_t now = 12 * MS;
    run_to_idle(s, &now, 100);
    duet__sched_free(s);
}
END_TEST

START_TEST(test_batch_timeout_starts_early_when_full) {
    duet_sched_config c = base_config();
    c.knobs.max_batch_seqs = 3;
    c.knobs.batch_timeout_ns = 50 * MS;
    duet_sched *s = make(&c);
    duet_sched_plan p;
    arrive(s, 100 * MS, 1, 5, 2, DUET_PRIORITY_BATCH);
    arrive(s, 100 * MS + 1, 2, 5, 2, DUET_PRIORITY_BATCH);
    ck_assert(duet__sched_plan(s, 100 * MS + 1, &p) == DUET_SCHED_WAIT);
    arrive(s, 100 * MS + 2, 3, 5, 2, DUET_PRIORITY_BATCH);
    plan_step(s, 100 * MS + 2, &p);
    ck_assert_msg(p.n_seqs == 3, "a full batch starts before the timeout (%d entries)", p.n_seqs);
    complete(s, 101 * MS, &p);
    int64_t now = 101 * MS;
    run_to_idle(s, &now, 100);
    /* A zero timeout never waits. */
    duet_sched_knobs k = duet__sched_knobs(s);
    k.batch_timeout_ns = 0;
    ck_assert(duet__sched_set_knobs(s, &k) == DUET_OK);
    arrive(s, now, 4, 5, 2, DUET_PRIORITY_BATCH);
    plan_step(s, now, &p);
    ck_assert_int_eq(p.n_seqs, 1);
    duet__sched_free(s);
}
END_TEST

/* ---- chunked prefill mixed with decodes ----------------------------------------- */

START_TEST(test_chunked_prefill_mixed_with_decodes) {
    duet_sched_config c = base_config();
    c.knobs.max_batch_tokens = 12;
    c.knobs.prefill_chunk = 8;
    duet_sched *s = make(&c);
    duet_sched_plan p;
    for (uint64_t id = 1; id <= 3; id++)
        arrive(s, 0, id, 2, 100, DUET_PRIORITY_INTERACTIVE);
    plan_step(s, 0, &p);
    ck_assert_msg(p.n_seqs == 3 && p.n_tokens == 6 && p.n_logits == 3, "three 2-token prompts in one step");
    complete(s, MS, &p);
    arrive(s, MS, 4, 40, 5, DUET_PRIORITY_BATCH);
    int expect_pos = 0, step = 0;
    int64_t now = MS;
    while (expect_pos < 40) {
        if (step == 2) {
            /* Squeeze the budget: the decodes still go first. */
            duet_sched_knobs k = duet__sched_knobs(s);
            k.max_batch_tokens = 5;
            ck_assert(duet__sched_set_knobs(s, &k) == DUET_OK);
        }
        int budget = duet__sched_knobs(s).max_batch_tokens;
        plan_step(s, now, &p);
        ck_assert_msg(p.n_tokens <= budget, "step %d uses %d tokens over the budget %d", step, p.n_tokens,
                      budget);
        ck_assert_msg(p.n_seqs == 4, "step %d: 3 decodes + 1 chunk (got %d)", step, p.n_seqs);
        for (int k = 0; k < 3; k++)
            ck_assert_msg(p.seqs[k].decode && p.seqs[k].n_tokens == 1 && p.seqs[k].logits,
                          "step %d: entry %d must be a decode (decodes first)", step, k);
        const duet_sched_seq *e = &p.seqs[3];
        int want_n = budget - 3 < 8 ? budget - 3 : 8;
        if (want_n > 40 - expect_pos) want_n = 40 - expect_pos;
        ck_assert_msg(e->id == 4 && !e->decode && e->pos == expect_pos && e->n_tokens == want_n,
                      "step %d: chunk of request 4 at pos %d n %d, want pos %d n %d", step, e->pos,
                      e->n_tokens, expect_pos, want_n);
        ck_assert_msg(e->logits == (expect_pos + want_n == 40), "step %d: logits only on the last chunk",
                      step);
        ck_assert_msg(e->n_blocks == duet__kv_blocks_needed(duet__sched_kv(s), e->pos + e->n_tokens),
                      "step %d: the table covers the chunk (%d blocks)", step, e->n_blocks);
        expect_pos += want_n;
        now += MS;
        complete(s, now, &p);
        step++;
    }
    ck_assert_msg(g_gen[4] == 1, "the prompt's last chunk produced the first token");
    duet__sched_free(s);
}
END_TEST

/* ---- stall-free steps: the time budget ------------------------------------------ */

/* A device where prefill is expensive: 4 ms a step, 1 ms a decode token,
 * 2 ms a prompt token (a 128-token chunk costs 256 ms), and a little per
 * position attended. */
static duet_step_cost costly_prefill(void) {
    duet_step_cost m = {0};
    m.coef[0] = 4e-3, m.coef[1] = 1e-3, m.coef[2] = 2e-3, m.coef[3] = 1e-6, m.coef[4] = 1e-6;
    return m;
}

/* The step's predicted time, computed here from the plan's entries. */
static double predict_plan(const duet_step_cost *m, const duet_sched_plan *p, double *decodes_only) {
    duet_step_shape all = {0}, dec = {0};
    for (int k = 0; k < p->n_seqs; k++) {
        duet_step_shape_add(&all, p->seqs[k].pos, p->seqs[k].n_tokens, p->seqs[k].decode);
        if (p->seqs[k].decode) duet_step_shape_add(&dec, p->seqs[k].pos, p->seqs[k].n_tokens, true);
    }
    if (decodes_only) *decodes_only = duet_step_cost_predict(m, &dec);
    return duet_step_cost_predict(m, &all);
}

static duet_sched_config budget_config(int64_t interactive_ns, int64_t batch_ns) {
    duet_sched_config c = base_config();
    c.max_seqs = 8, c.max_tokens = 512, c.kv_blocks = 256, c.n_ctx = 1024;
    c.knobs.max_batch_seqs = 8, c.knobs.max_batch_tokens = 512, c.knobs.prefill_chunk = 128;
    c.knobs.step_budget_ns[DUET_PRIORITY_INTERACTIVE] = interactive_ns;
    c.knobs.step_budget_ns[DUET_PRIORITY_BATCH] = batch_ns;
    return c;
}

/* A scheduler with those budgets that predicts steps with model m. */
static duet_sched *budget_sched(int64_t interactive_ns, int64_t batch_ns, const duet_step_cost *m) {
    duet_sched_config c = budget_config(interactive_ns, batch_ns);
    duet_sched *s = make(&c);
    duet__sched_set_cost(s, m);
    return s;
}

/* Starts n requests of class prio with 2-token prompts and runs the step
 * that prefills them: they decode from the next step on. */
static void start_decoders(duet_sched *s, int64_t *now, uint64_t first, int n, duet_priority prio) {
    duet_sched_plan p;
    for (int i = 0; i < n; i++)
        arrive(s, *now, first + (uint64_t)i, 2, 1000, prio);
    plan_step(s, *now, &p);
    *now += MS;
    complete(s, *now, &p);
}

/* Runs request `id` (arrived) through its prefill under the budget and
 * checks every step: decodes first and all present, the predicted time
 * within the budget (or over it by at most the minimum chunk when the
 * decodes alone fill it), chunks whole or at least the minimum. Returns the
 * steps its prefill took. */
static int prefill_under_budget(duet_sched *s, int64_t *now, uint64_t id, int n_prompt, int n_decoders,
                                const duet_step_cost *m, int64_t budget_ns) {
    duet_sched_plan p;
    int pos = 0, steps = 0;
    while (pos < n_prompt) {
        plan_step(s, *now, &p);
        ck_assert_msg(steps++ < 1000, "prefill of %llu starves", (unsigned long long)id);
        int dec = 0;
        for (int k = 0; k < p.n_seqs; k++)
            dec += p.seqs[k].decode;
        ck_assert_msg(dec == n_decoders, "step %d: %d of %d decodes", steps, dec, n_decoders);
        int k = find_seq(&p, id);
        ck_assert_msg(k >= 0, "step %d: the prefill made no progress (no starvation)", steps);
        const duet_sched_seq *e = &p.seqs[k];
        ck_assert_int_eq(e->pos, pos);
        ck_assert_msg(e->n_tokens >= DUET_SCHED_MIN_CHUNK || e->pos + e->n_tokens == n_prompt,
                      "step %d: a chunk of %d tokens mid-prompt (under the minimum)", steps, e->n_tokens);
        double decodes_only, t = predict_plan(m, &p, &decodes_only);
        ck_assert_msg(fabs(t - p.predicted_s) < 1e-12, "the plan's prediction %g, the model's %g",
                      p.predicted_s, t);
        ck_assert_msg(p.budget_ns == budget_ns, "step %d sized to %lld ns, want %lld", steps,
                      (long long)p.budget_ns, (long long)budget_ns);
        double b = (double)budget_ns * 1e-9;
        if (decodes_only + 2e-3 * DUET_SCHED_MIN_CHUNK < b) {
            ck_assert_msg(t <= b + 1e-12, "step %d predicted %.2f ms over the budget %.2f ms", steps, t * 1e3,
                          b * 1e3);
            /* ...and not much under it: the chunk fills what the budget leaves. */
            if (e->pos + e->n_tokens < n_prompt)
                ck_assert_msg(t > b - 2 * 2.1e-3, "step %d predicted %.2f ms, the budget %.2f ms left unused",
                              steps, t * 1e3, b * 1e3);
        } else {
            ck_assert_msg(e->n_tokens == DUET_SCHED_MIN_CHUNK || e->pos + e->n_tokens == n_prompt,
                          "decodes alone fill the budget: the minimum chunk, got %d", e->n_tokens);
        }
        pos += e->n_tokens;
        *now += MS;
        complete(s, *now, &p);
    }
    return steps;
}

START_TEST(test_budget_keeps_decode_steps_short) {
    duet_step_cost m = costly_prefill();
    duet_sched *s = budget_sched(60 * MS, 0, &m);
    int64_t now = 0;
    start_decoders(s, &now, 1, 4, DUET_PRIORITY_INTERACTIVE);
    /* A 300-token prompt while 4 interactive streams decode: about 24 of
     * its tokens per step (60 ms less 8 ms of decodes, at 2 ms a token). */
    arrive(s, now, 10, 300, 4, DUET_PRIORITY_BATCH);
    int steps = prefill_under_budget(s, &now, 10, 300, 4, &m, 60 * MS);
    ck_assert_msg(steps >= 12 && steps <= 14, "300 tokens in %d steps of about 24", steps);
    duet_sched_stats st;
    duet__sched_stats(s, &st);
    ck_assert_msg(st.budget_cut >= 12 && st.budget_over == 0, "cut %llu over %llu",
                  (unsigned long long)st.budget_cut, (unsigned long long)st.budget_over);

    /* Without the model, the same step takes the whole chunk (as before). */
    duet__sched_set_cost(s, NULL);
    arrive(s, now, 11, 300, 4, DUET_PRIORITY_BATCH);
    duet_sched_plan p;
    plan_step(s, now, &p);
    int k = find_seq(&p, 11);
    ck_assert_msg(k >= 0 && p.seqs[k].n_tokens == 128 && p.budget_ns == 0 && p.predicted_s == 0,
                  "no model: a full chunk (%d)", k >= 0 ? p.seqs[k].n_tokens : -1);
    complete(s, now + MS, &p);
    duet__sched_free(s);
}
END_TEST

START_TEST(test_budget_full_chunks_without_decodes) {
    duet_step_cost m = costly_prefill();
    duet_sched *s = budget_sched(60 * MS, 60 * MS, &m);
    /* Nobody decodes: time to first token matters, full chunks. */
    arrive(s, 0, 1, 300, 4, DUET_PRIORITY_INTERACTIVE);
    arrive(s, 0, 2, 300, 4, DUET_PRIORITY_INTERACTIVE);
    duet_sched_plan p;
    plan_step(s, 0, &p);
    ck_assert_msg(p.n_seqs == 2 && p.seqs[0].n_tokens == 128 && p.seqs[1].n_tokens == 128 && p.budget_ns == 0,
                  "two full chunks, no budget (%d entries)", p.n_seqs);
    ck_assert_msg(p.predicted_s > 0.5, "the model still predicts the step (%g s)", p.predicted_s);
    complete(s, MS, &p);
    duet__sched_free(s);
}
END_TEST

START_TEST(test_budget_by_class_and_starvation) {
    duet_step_cost m = costly_prefill();
    /* Only batch streams decode and batch has no budget: full chunks. */
    duet_sched *s = budget_sched(60 * MS, 0, &m);
    int64_t now = 0;
    start_decoders(s, &now, 1, 3, DUET_PRIORITY_BATCH);
    arrive(s, now, 10, 200, 2, DUET_PRIORITY_INTERACTIVE);
    duet_sched_plan p;
    plan_step(s, now, &p);
    int k = find_seq(&p, 10);
    ck_assert_msg(k >= 0 && p.seqs[k].n_tokens == 128 && p.budget_ns == 0,
                  "batch decodes only: a full chunk");
    complete(s, now += MS, &p);
    duet__sched_free(s);

    /* Both classes decode: the tighter budget (interactive's 50 ms) rules. */
    s = budget_sched(50 * MS, 200 * MS, &m);
    now = 0;
    start_decoders(s, &now, 1, 2, DUET_PRIORITY_BATCH);
    start_decoders(s, &now, 3, 1, DUET_PRIORITY_INTERACTIVE);
    arrive(s, now, 10, 100, 2, DUET_PRIORITY_BATCH);
    prefill_under_budget(s, &now, 10, 100, 3, &m, 50 * MS);
    duet__sched_free(s);

    /* Decodes alone over the budget (7 decodes, 11 ms, budget 10 ms): the
     * prefill still moves by the minimum chunk each step, the rest waits. */
    s = budget_sched(10 * MS, 0, &m);
    now = 0;
    start_decoders(s, &now, 1, 7, DUET_PRIORITY_INTERACTIVE);
    arrive(s, now, 10, 64, 2, DUET_PRIORITY_INTERACTIVE);
    arrive(s, now, 11, 64, 2, DUET_PRIORITY_INTERACTIVE);
    /* Only 8 slots: request 11 waits for a free one after 10 is admitted. */
    int steps = prefill_under_budget(s, &now, 10, 64, 7, &m, 10 * MS);
    ck_assert_int_eq(steps, 64 / DUET_SCHED_MIN_CHUNK);
    duet_sched_stats st;
    duet__sched_stats(s, &st);
    ck_assert_msg(st.budget_over == (uint64_t)steps, "every such step is counted over (%llu)",
                  (unsigned long long)st.budget_over);
    duet__sched_free(s);
}
END_TEST

START_TEST(test_budget_admission_waits_for_time) {
    duet_step_cost m = costly_prefill();
    duet_sched *s = budget_sched(60 * MS, 0, &m);
    int64_t now = 0;
    start_decoders(s, &now, 1, 2, DUET_PRIORITY_INTERACTIVE);
    /* Two long prompts arrive: the first gets the step's time (a chunk of
     * 26 tokens: 60 - 6 ms of decodes, at 2 ms a token); the second finds
     * less than a minimum chunk left and is not admitted yet. */
    arrive(s, now, 10, 300, 2, DUET_PRIORITY_INTERACTIVE);
    arrive(s, now, 11, 300, 2, DUET_PRIORITY_INTERACTIVE);
    duet_sched_plan p;
    plan_step(s, now, &p);
    ck_assert_msg(p.n_seqs == 3 && find_seq(&p, 10) == 2 && find_seq(&p, 11) < 0, "decodes + one chunk");
    ck_assert_msg(p.seqs[2].n_tokens >= DUET_SCHED_MIN_CHUNK && p.predicted_s <= 0.060 + 1e-12,
                  "chunk %d, predicted %.2f ms", p.seqs[2].n_tokens, p.predicted_s * 1e3);
    duet_sched_stats st;
    duet__sched_stats(s, &st);
    ck_assert_int_eq(st.waiting[0], 1);
    complete(s, now + MS, &p);
    /* Knobs: a negative budget is refused. */
    duet_sched_knobs k = duet__sched_knobs(s);
    k.step_budget_ns[1] = -1;
    ck_assert_int_eq(duet__sched_set_knobs(s, &k), DUET_INVALID_ARGUMENT);
    /* A broken model (not finite) is ignored: full chunks again. */
    duet_step_cost bad = m;
    bad.coef[2] = NAN;
    duet__sched_set_cost(s, &bad);
    plan_step(s, now + MS, &p);
    ck_assert_msg(p.budget_ns == 0 && find_seq(&p, 10) >= 0 && p.seqs[find_seq(&p, 10)].n_tokens == 128,
                  "a non-finite model is not used");
    complete(s, now + 2 * MS, &p);
    duet__sched_free(s);
}
END_TEST

/* ---- continuous batching --------------------------------------------------------- */

START_TEST(test_continuous_batching_reuses_slot) {
    duet_sched_config c = base_config();
    c.knobs.max_batch_seqs = 2;
    duet_sched *s = make(&c);
    duet_sched_plan p;
    arrive(s, 0, 1, 4, 2, DUET_PRIORITY_BATCH);
    arrive(s, 0, 2, 4, 10, DUET_PRIORITY_BATCH);
    arrive(s, 0, 3, 4, 3, DUET_PRIORITY_BATCH);
    int64_t now = 0;
    plan_step(s, now, &p);
    ck_assert_msg(p.n_seqs == 2 && find_seq(&p, 3) < 0, "two slots: request 3 waits");
    int slot1 = p.seqs[find_seq(&p, 1)].slot;
    complete(s, ++now, &p); /* 1 and 2 sample their first token */
    plan_step(s, now, &p);
    ck_assert_msg(find_seq(&p, 3) < 0, "no slot yet for request 3");
    complete(s, ++now, &p); /* 1 samples its 2nd token and finishes */
    ck_assert_int_eq(g_done[1], 1);
    duet_sched_stats st;
    duet__sched_stats(s, &st);
    ck_assert_msg(st.running[1] == 1 && st.waiting[1] == 1, "the finished sequence left at once");
    plan_step(s, now, &p);
    int k3 = find_seq(&p, 3);
    ck_assert_msg(k3 >= 0 && p.seqs[k3].slot == slot1 && p.seqs[k3].first_schedule,
                  "request 3 joins the very next step in the freed slot %d", slot1);
    ck_assert_msg(find_seq(&p, 2) == 0 && p.seqs[0].decode, "request 2 keeps decoding, first in the step");
    complete(s, ++now, &p);
    run_to_idle(s, &now, 100);
    ck_assert_msg(g_gen[2] == 10 && g_gen[3] == 3, "all ran to length");
    duet__sched_free(s);
}
END_TEST

/* ---- preemption ------------------------------------------------------------------ */

START_TEST(test_interactive_preempts_batch_and_batch_resumes) {
    duet_sched_config c = base_config();
    c.kv_block_size = 4;
    c.kv_blocks = 8; /* 32 tokens */
    c.n_ctx = 32;
    c.knobs.prefill_chunk = 32;
    duet_sched *s = make(&c);
    duet_sched_plan p;
    int64_t now = 0;
    arrive(s, now, 10, 12, 12, DUET_PRIORITY_BATCH);
    for (int i = 0; i < 6; i++) { /* prefill + 5 decodes: 6 tokens generated */
        plan_step(s, now, &p);
        complete(s, ++now, &p);
    }
    ck_assert_int_eq(g_gen[10], 6);
    /* Stream of 18, 17 computed: 5 blocks, and the next decode keeps it at 5. */
    arrive(s, now, 20, 20, 4, DUET_PRIORITY_INTERACTIVE); /* needs 5 blocks, 3 free */
    plan_step(s, now, &p);
    ck_assert_msg(p.n_preempted == 1 && p.preempted[0] == 10, "the batch request is preempted (%d preempted)",
                  p.n_preempted);
    ck_assert_msg(p.n_seqs == 1 && p.seqs[0].id == 20 && p.seqs[0].n_tokens == 20 && p.seqs[0].logits,
                  "the interactive prompt runs whole in the same step");
    duet_sched_stats st;
    duet__sched_stats(s, &st);
    ck_assert_msg(st.waiting[DUET_PRIORITY_BATCH] == 1 && st.running[DUET_PRIORITY_INTERACTIVE] == 1 &&
                      st.preemptions == 1,
                  "after preemption: batch waiting %d, interactive running %d, preemptions %llu",
                  st.waiting[1], st.running[0], (unsigned long long)st.preemptions);
    complete(s, ++now, &p);
    /* While the interactive request runs, the batch one cannot come back:
     * it needs 5 blocks for its 18-token stream. */
    bool resumed = false;
    int resumed_tokens = -1;
    for (int it = 0; it < 100; it++) {
        duet_sched_action a = duet__sched_plan(s, now, &p);
        if (a == DUET_SCHED_IDLE) break;
        ck_assert(a == DUET_SCHED_STEP);
        int k = find_seq(&p, 10);
        if (k >= 0 && p.seqs[k].resumed) {
            ck_assert_msg(g_done[20] == 1,
                          "the batch request resumes only after the interactive one is done");
            ck_assert_msg(p.seqs[k].pos == 0 && !p.seqs[k].first_schedule && p.seqs[k].logits,
                          "resume re-prefills from position 0 and samples at the end");
            resumed = true;
            resumed_tokens = p.seqs[k].n_tokens;
        }
        complete(s, ++now, &p);
    }
    ck_assert_msg(resumed && resumed_tokens == 18, "resume re-prefills prompt + 6 generated = 18 (got %d)",
                  resumed_tokens);
    ck_assert_msg(g_gen[10] == 12 && g_done[10] == 1,
                  "batch request finished once with 12 tokens (got %d, %d times)", g_gen[10], g_done[10]);
    ck_assert_msg(g_gen[20] == 4 && g_done[20] == 1, "interactive request finished once with 4 tokens");
    duet__sched_stats(s, &st);
    ck_assert_msg(st.finished == 2 && st.kv_blocks_used == 0 && st.preemptions == 1,
                  "nothing lost, nothing leaked");
    duet__sched_free(s);
}
END_TEST

START_TEST(test_decode_growth_preempts_youngest) {
    duet_sched_config c = base_config();
    c.kv_block_size = 4;
    c.kv_blocks = 6;
    c.n_ctx = 24;
    duet_sched *s = make(&c);
    duet_sched_plan p;
    int64_t now = 0;
    arrive(s, now, 1, 8, 12, DUET_PRIORITY_BATCH);
    arrive(s, now, 2, 8, 12, DUET_PRIORITY_BATCH);
    uint64_t first_victim = 0;
    for (int it = 0; it < 200; it++) {
        duet_sched_action a = duet__sched_plan(s, now, &p);
        if (a == DUET_SCHED_IDLE) break;
        ck_assert(a == DUET_SCHED_STEP);
        check_ok(s, "growth plan");
        if (p.n_preempted && !first_victim) {
            first_victim = p.preempted[0];
            ck_assert_msg(find_seq(&p, 1) >= 0, "the older request keeps running when the pool runs dry");
        }
        complete(s, ++now, &p);
    }
    ck_assert_msg(first_victim == 2, "the younger request is the victim (got %llu)",
                  (unsigned long long)first_victim);
    ck_assert_msg(g_gen[1] == 12 && g_gen[2] == 12 && g_done[1] == 1 && g_done[2] == 1,
                  "both finish with all their tokens");
    duet__sched_free(s);
}
END_TEST

START_TEST(test_batch_never_preempts_interactive) {
    duet_sched_config c = base_config();
    c.kv_block_size = 4;
    c.kv_blocks = 6;
    c.n_ctx = 24;
    duet_sched *s = make(&c);
    duet_sched_plan p;
    int64_t now = 0;
    arrive(s, now, 1, 16, 4, DUET_PRIORITY_INTERACTIVE); /* 4 blocks of 6 */
    plan_step(s, now, &p);
    complete(s, ++now, &p);
    arrive(s, now, 2, 12, 2, DUET_PRIORITY_BATCH); /* needs 3 blocks; 2 free */
    for (int it = 0; it < 50; it++) {
        duet_sched_action a = duet__sched_plan(s, now, &p);
        if (a == DUET_SCHED_IDLE) break;
        ck_assert_msg(p.n_preempted == 0, "a batch arrival must not preempt interactive work");
        ck_assert_msg(find_seq(&p, 2) < 0 || g_done[1] == 1, "the batch request waits for the KV it needs");
        complete(s, ++now, &p);
    }
    ck_assert(g_done[1] == 1 && g_done[2] == 1);
    duet__sched_free(s);
}
END_TEST

/* An old prompt being chunked while two younger requests decode, in a pool
 * that runs dry at the fifth chunk (see the comments for the arithmetic).
 * Returns the plan that carries the chunk at position 20. */
static void chunk_under_pressure(duet_priority first, duet_sched **out_s, duet_sched_plan *out_p) {
    duet_sched_config c = base_config();
    c.kv_block_size = 4;
    c.kv_blocks = 10;
    c.n_ctx = 40;
    c.knobs.prefill_chunk = 5;
    duet_sched *s = make(&c);
    arrive(s, 0, 1, 28, 2, first); /* chunks 0..5, 5..10, ..., 20..25 */
    arrive(s, 0, 2, 4, 10, DUET_PRIORITY_BATCH);
    arrive(s, 0, 3, 4, 10, DUET_PRIORITY_BATCH);
    int64_t now = 0;
    for (int it = 0; it < 10; it++) {
        plan_step(s, now, out_p);
        int k = find_seq(out_p, 1);
        /* By then request 1 holds 5 blocks (20 tokens), 2 and 3 two each:
         * one block is free, so the 5-token chunk does not fit whole. */
        if (k >= 0 && out_p->seqs[k].pos == 20) {
            *out_s = s;
            return;
        }
        complete(s, ++now, out_p);
    }
    ck_abort_msg("request 1 never reached position 20");
}

START_TEST(test_chunk_shrinks_rather_than_preempting_own_class) {
    duet_sched *s;
    duet_sched_plan p;
    chunk_under_pressure(DUET_PRIORITY_BATCH, &s, &p);
    const duet_sched_seq *e = &p.seqs[find_seq(&p, 1)];
    ck_assert_msg(e->n_tokens == 4 && !e->logits && p.n_preempted == 0,
                  "the chunk shrinks to the 4 tokens that fit (got %d, %d preempted)", e->n_tokens,
                  p.n_preempted);
    ck_assert_msg(find_seq(&p, 2) >= 0 && find_seq(&p, 3) >= 0, "younger decodes keep flowing");
    complete(s, 100, &p);
    int64_t now = 100;
    run_to_idle(s, &now, 200);
    ck_assert(g_done[1] == 1 && g_done[2] == 1 && g_done[3] == 1 && g_gen[2] == 10 && g_gen[3] == 10);
    duet__sched_free(s);
}
END_TEST

START_TEST(test_interactive_chunk_preempts_batch) {
    duet_sched *s;
    duet_sched_plan p;
    chunk_under_pressure(DUET_PRIORITY_INTERACTIVE, &s, &p);
    const duet_sched_seq *e = &p.seqs[find_seq(&p, 1)];
    ck_assert_msg(
        e->n_tokens == 5 && p.n_preempted == 1 && p.preempted[0] == 3 && find_seq(&p, 3) < 0,
        "an interactive chunk takes its blocks from the youngest batch request (n %d, %d preempted)",
        e->n_tokens, p.n_preempted);
    complete(s, 100, &p);
    int64_t now = 100;
    run_to_idle(s, &now, 200);
    ck_assert(g_done[1] == 1 && g_done[2] == 1 && g_done[3] == 1 && g_gen[3] == 10);
    duet__sched_free(s);
}
END_TEST

/* ---- cancellation ---------------------------------------------------------------- */

START_TEST(test_cancel_in_every_state) {
    duet_sched_config c = base_config();
    c.kv_block_size = 4;
    c.kv_blocks = 8;
    c.n_ctx = 32;
    c.knobs.prefill_chunk = 4;
    duet_sched *s = make(&c);
    duet_sched_plan p;
    duet_sched_stats st;
    int64_t now = 0;

    ck_assert_msg(duet__sched_cancel(s, now, 99) == DUET_INVALID_ARGUMENT, "unknown id");

    /* Waiting (held back by batch_timeout). */
    duet_sched_knobs k = duet__sched_knobs(s);
    k.batch_timeout_ns = 100 * MS;
    ck_assert(duet__sched_set_knobs(s, &k) == DUET_OK);
    arrive(s, now, 1, 8, 4, DUET_PRIORITY_BATCH);
    ck_assert(duet__sched_plan(s, now, &p) == DUET_SCHED_WAIT);
    ck_assert(duet__sched_cancel(s, now, 1) == DUET_OK);
    ck_assert_msg(duet__sched_cancel(s, now, 1) == DUET_INVALID_ARGUMENT, "a second cancel finds nothing");
    ck_assert_msg(duet__sched_plan(s, now, &p) == DUET_SCHED_IDLE,
                  "nothing left after cancelling the only waiter");
    k.batch_timeout_ns = 0;
    ck_assert(duet__sched_set_knobs(s, &k) == DUET_OK);

    /* Prefilling: one chunk of a 12-token prompt done. */
    arrive(s, now, 2, 12, 4, DUET_PRIORITY_BATCH);
    plan_step(s, now, &p);
    complete(s, ++now, &p);
    duet__sched_stats(s, &st);
    ck_assert(st.prefilling == 1 && st.kv_blocks_used == 1);
    ck_assert(duet__sched_cancel(s, now, 2) == DUET_OK);
    duet__sched_stats(s, &st);
    ck_assert_msg(st.running[1] == 0 && st.kv_blocks_used == 0,
                  "a cancelled prefill frees its slot and blocks");
    check_ok(s, "after cancelling a prefill");

    /* Decoding. */
    arrive(s, now, 3, 4, 10, DUET_PRIORITY_BATCH);
    for (int i = 0; i < 3; i++) {
        plan_step(s, now, &p);
        complete(s, ++now, &p);
    }
    ck_assert_int_eq(g_gen[3], 3);
    ck_assert(duet__sched_cancel(s, now, 3) == DUET_OK);
    duet__sched_stats(s, &st);
    ck_assert_msg(st.running[1] == 0 && st.kv_blocks_used == 0,
                  "a cancelled decode frees its slot and blocks");

    /* In flight: cancelled between plan and step_done. */
    arrive(s, now, 4, 4, 10, DUET_PRIORITY_BATCH);
    arrive(s, now, 5, 4, 3, DUET_PRIORITY_BATCH);
    plan_step(s, now, &p);
    ck_assert(p.n_seqs == 2);
    ck_assert(duet__sched_cancel(s, now, 4) == DUET_OK);
    duet__sched_stats(s, &st);
    ck_assert_msg(st.kv_blocks_used == 2,
                  "blocks of an in-flight sequence stay until its step ends (%d used)", st.kv_blocks_used);
    ck_assert_msg(st.running[1] == 1, "but it no longer counts as running");
    ck_assert_msg(duet__sched_cancel(s, now, 4) == DUET_INVALID_ARGUMENT, "cancelled already");
    complete(s, ++now, &p);
    duet__sched_stats(s, &st);
    ck_assert_msg(st.kv_blocks_used == 1 && st.running[1] == 1, "released at step_done (%d used)",
                  st.kv_blocks_used);
    run_to_idle(s, &now, 100);
    ck_assert_msg(g_done[5] == 1, "the other sequence of the step is unaffected");

    /* Preempted: waiting again after losing its blocks. */
    arrive(s, now, 6, 12, 12, DUET_PRIORITY_BATCH);
    for (int i = 0; i < 9; i++) { /* 3 chunks + 6 decodes */
        plan_step(s, now, &p);
        complete(s, ++now, &p);
    }
    arrive(s, now, 7, 20, 4, DUET_PRIORITY_INTERACTIVE);
    plan_step(s, now, &p);
    ck_assert_msg(was_preempted(&p, 6), "request 6 was preempted");
    complete(s, ++now, &p);
    ck_assert(duet__sched_cancel(s, now, 6) == DUET_OK);
    check_ok(s, "after cancelling a preempted request");
    for (int it = 0; it < 50; it++) {
        duet_sched_action a = duet__sched_plan(s, now, &p);
        if (a == DUET_SCHED_IDLE) break;
        ck_assert_msg(find_seq(&p, 6) < 0, "a cancelled preempted request never resumes");
        complete(s, ++now, &p);
    }
    duet__sched_stats(s, &st);
    ck_assert_msg(st.cancelled == 5 && st.finished == 2 && st.arrivals == 7 && st.kv_blocks_used == 0,
                  "cancelled %llu finished %llu arrivals %llu kv %d", (unsigned long long)st.cancelled,
                  (unsigned long long)st.finished, (unsigned long long)st.arrivals, st.kv_blocks_used);
    duet__sched_free(s);
}
END_TEST

/* ---- refusals and rejections -------------------------------------------------- */

START_TEST(test_queue_full_refuses) {
    duet_sched_config c = base_config();
    c.max_waiting = 3;
    c.knobs.max_waiting = 3;
    c.knobs.max_batch_seqs = 1;
    duet_sched *s = make(&c);
    duet_sched_plan p;
    for (uint64_t id = 1; id <= 3; id++)
        arrive(s, 0, id, 4, 4, DUET_PRIORITY_BATCH);
    ck_assert_msg(duet__sched_arrival(s, 0, 4, 4, 4, DUET_PRIORITY_INTERACTIVE) == DUET_SCHED_QUEUE_FULL,
                  "a fourth waiter is refused");
    duet_sched_stats st;
    duet__sched_stats(s, &st);
    ck_assert_int_eq(st.refused, 1);
    plan_step(s, 0, &p); /* request 1 starts: one place frees up */
    arrive(s, 0, 4, 4, 4, DUET_PRIORITY_INTERACTIVE);
    ck_assert(duet__sched_arrival(s, 0, 5, 4, 4, DUET_PRIORITY_BATCH) == DUET_SCHED_QUEUE_FULL);
    ck_assert(duet__sched_cancel(s, 0, 2) == DUET_OK);
    arrive(s, 0, 5, 4, 4, DUET_PRIORITY_BATCH);
    /* A knob of 0 refuses everything. */
    duet_sched_knobs k = duet__sched_knobs(s);
    k.max_waiting = 0;
    ck_assert(duet__sched_set_knobs(s, &k) == DUET_OK);
    ck_assert(duet__sched_arrival(s, 0, 6, 4, 4, DUET_PRIORITY_BATCH) == DUET_SCHED_QUEUE_FULL);
    complete(s, 1, &p);
    int64_t now = 1;
    run_to_idle(s, &now, 200);
    ck_assert(g_done[1] == 1 && g_done[3] == 1 && g_done[4] == 1 && g_done[5] == 1 && g_done[2] == 0);
    duet__sched_free(s);
}
END_TEST

START_TEST(test_rejects_what_can_never_fit) {
    duet_sched_config c = base_config();
    c.n_ctx = 128;
    c.kv_block_size = 16;
    c.kv_blocks = 4; /* 64 tokens in the whole pool */
    duet_sched *s = make(&c);
    ck_assert_msg(duet__sched_arrival(s, 0, 1, 100, 40, DUET_PRIORITY_BATCH) == DUET_SCHED_TOO_LONG,
                  "prompt + max_new beyond n_ctx");
    ck_assert_msg(duet__sched_arrival(s, 0, 2, 50, 20, DUET_PRIORITY_BATCH) == DUET_SCHED_TOO_LONG,
                  "prompt + max_new beyond the KV pool");
    ck_assert_msg(duet__sched_arrival(s, 0, 3, 0, 5, DUET_PRIORITY_BATCH) == DUET_SCHED_INVALID,
                  "empty prompt");
    ck_assert_msg(duet__sched_arrival(s, 0, 4, 5, 0, DUET_PRIORITY_BATCH) == DUET_SCHED_INVALID, "max_new 0");
    ck_assert_msg(duet__sched_arrival(s, 0, 5, 5, 5, (duet_priority)7) == DUET_SCHED_INVALID,
                  "unknown priority");
    ck_assert_msg(duet__sched_arrival(s, 0, 6, 5, INT32_MAX, DUET_PRIORITY_BATCH) == DUET_SCHED_TOO_LONG,
                  "huge max_new must not overflow");
    arrive(s, 0, 7, 50, 14, DUET_PRIORITY_BATCH); /* exactly the pool */
    ck_assert_msg(duet__sched_arrival(s, 0, 7, 5, 5, DUET_PRIORITY_BATCH) == DUET_SCHED_INVALID,
                  "duplicate id");
    duet_sched_stats st;
    duet__sched_stats(s, &st);
    ck_assert_msg(st.rejected == 7 && st.arrivals == 1 && st.refused == 0, "rejected %llu arrivals %llu",
                  (unsigned long long)st.rejected, (unsigned long long)st.arrivals);
    int64_t now = 0;
    run_to_idle(s, &now, 100);
    ck_assert_msg(g_gen[7] == 14, "a request that fills the pool exactly still runs to the end");
    duet__sched_free(s);
}
END_TEST

/* ---- knobs and engine-contract checks ------------------------------------------ */

START_TEST(test_knobs_validated_and_applied) {
    duet_sched_config c = base_config();
    duet_sched *bad = NULL;
    duet_sched_config cb = c;
    cb.knobs.max_batch_seqs = 5;
    ck_assert_msg(duet__sched_new(&cb, &bad) == DUET_INVALID_ARGUMENT && !bad,
                  "knobs beyond capacity at creation");
    cb = c;
    cb.kv_blocks = 0;
    ck_assert(duet__sched_new(&cb, &bad) == DUET_INVALID_ARGUMENT);
    c.knobs.max_batch_seqs = 1;
    duet_sched *s = make(&c);
    duet_sched_knobs k = duet__sched_knobs(s), keep = k;
    k.max_batch_seqs = 5;
    ck_assert(duet__sched_set_knobs(s, &k) == DUET_INVALID_ARGUMENT);
    k = keep;
    k.max_batch_tokens = 0;
    ck_assert(duet__sched_set_knobs(s, &k) == DUET_INVALID_ARGUMENT);
    k = keep;
    k.batch_timeout_ns = -1;
    ck_assert(duet__sched_set_knobs(s, &k) == DUET_INVALID_ARGUMENT);
    k = keep;
    k.prefill_chunk = 0;
    ck_assert(duet__sched_set_knobs(s, &k) == DUET_INVALID_ARGUMENT);
    ck_assert_msg(duet__sched_knobs(s).max_batch_seqs == 1, "a refused setting changes nothing");

    duet_sched_plan p;
    for (uint64_t id = 1; id <= 3; id++)
        arrive(s, 0, id, 4, 5, DUET_PRIORITY_BATCH);
    plan_step(s, 0, &p);
    ck_assert_int_eq(p.n_seqs, 1);
    complete(s, 1, &p);
    k = keep;
    k.max_batch_seqs = 3;
    ck_assert(duet__sched_set_knobs(s, &k) == DUET_OK);
    ck_assert_int_eq(duet__sched_config(s).knobs.max_batch_seqs, 3);
    plan_step(s, 1, &p);
    ck_assert_msg(p.n_seqs == 3, "raising max_batch_seqs admits at the next plan (%d)", p.n_seqs);
    complete(s, 2, &p);
    /* Lowering it preempts nothing; running sequences keep decoding. */
    k.max_batch_seqs = 1;
    ck_assert(duet__sched_set_knobs(s, &k) == DUET_OK);
    plan_step(s, 2, &p);
    ck_assert_msg(p.n_seqs == 3 && p.n_preempted == 0, "lowering max_batch_seqs drains, does not preempt");
    complete(s, 3, &p);
    duet__sched_free(s);
}
END_TEST

START_TEST(test_step_done_validates_results) {
    duet_sched_config c = base_config();
    duet_sched *s = make(&c);
    duet_sched_plan p;
    arrive(s, 0, 1, 4, 1, DUET_PRIORITY_BATCH);
    arrive(s, 0, 2, 4, 5, DUET_PRIORITY_BATCH);
    plan_step(s, 0, &p);
    ck_assert_int_eq(p.n_seqs, 2);
    duet_sched_result r[2] = {{.id = 1, .n_generated = 1, .finished = true}, {.id = 2, .n_generated = 1}};
    ck_assert_msg(duet__sched_step_done(s, 1, r, 1) == DUET_INVALID_ARGUMENT, "too few results");
    r[1].id = 3;
    ck_assert_msg(duet__sched_step_done(s, 1, r, 2) == DUET_INVALID_ARGUMENT, "wrong id");
    r[1].id = 2;
    r[0].finished = false;
    ck_assert_msg(duet__sched_step_done(s, 1, r, 2) == DUET_INVALID_ARGUMENT,
                  "past max_new without finishing");
    r[0].finished = true;
    r[1].n_generated = 0;
    ck_assert_msg(duet__sched_step_done(s, 1, r, 2) == DUET_INVALID_ARGUMENT, "logits row without a token");
    r[1].n_generated = 1;
    check_ok(s, "after refused results");
    ck_assert_msg(duet__sched_step_done(s, 1, r, 2) == DUET_OK, "correct results: %s", duet_last_error());
    ck_assert_msg(duet__sched_step_done(s, 1, r, 2) == DUET_INVALID_ARGUMENT, "no step outstanding");
    plan_step(s, 1, &p);
    ck_assert_msg(p.n_seqs == 1 && p.seqs[0].id == 2 && p.seqs[0].pos == 4,
                  "request 1 finished, 2 decodes at 4");
    duet__sched_free(s);
}
END_TEST

START_TEST(test_step_failed_keeps_state) {
    duet_sched_config c = base_config();
    c.knobs.prefill_chunk = 4;
    duet_sched *s = make(&c);
    duet_sched_plan p;
    arrive(s, 0, 1, 10, 2, DUET_PRIORITY_BATCH);
    plan_step(s, 0, &p);
    complete(s, 1, &p);
    plan_step(s, 1, &p);
    ck_assert(p.seqs[0].pos == 4);
    duet__sched_step_failed(s, 2);
    check_ok(s, "after step_failed");
    plan_step(s, 2, &p);
    ck_assert_msg(p.seqs[0].pos == 4 && p.seqs[0].n_tokens == 4 && !p.seqs[0].first_schedule,
                  "a failed step is planned again from the same position");
    complete(s, 3, &p);
    ck_assert(duet__sched_cancel(s, 3, 1) == DUET_OK);
    check_ok(s, "after cancel");
    duet__sched_free(s);
}
END_TEST

/* ---- speculative decoding ----------------------------------------------------------- */

/* Plans one step with request id decoding after offering n drafts. */
static const duet_sched_seq *plan_with_draft(duet_sched *s, int64_t now, uint64_t id, int n,
                                             duet_sched_plan *p) {
    duet__sched_set_draft(s, id, n, 1.0f, 1);
    plan_step(s, now, p);
    int k = find_seq(p, id);
    ck_assert_msg(k >= 0, "request %llu not in the step", (unsigned long long)id);
    return &p->seqs[k];
}

static void done_one(duet_sched *s, int64_t now, uint64_t id, int n_generated, bool finished) {
    duet_sched_result r = {.id = id, .n_generated = n_generated, .finished = finished};
    duet_status st = duet__sched_step_done(s, now, &r, 1);
    ck_assert_msg(st == DUET_OK, "step_done: %s", duet_last_error());
    check_ok(s, "after a speculative step");
}

/* A scheduler with blocks of 4 for the speculative tests, and request id
 * past its prefill (decoding next). */
static duet_sched *spec_sched(int kv_blocks, int spec_max_batch, int max_batch_tokens) {
    duet_sched_config c = base_config();
    c.kv_block_size = 4;
    c.kv_blocks = kv_blocks;
    c.knobs.spec_max_batch = spec_max_batch;
    c.knobs.max_batch_tokens = max_batch_tokens;
    return make(&c);
}

static void prefilled(duet_sched *s, int64_t now, uint64_t id, int n_prompt, int max_new,
                      duet_priority prio) {
    duet_sched_plan p;
    arrive(s, now, id, n_prompt, max_new, prio);
    plan_step(s, now, &p);
    complete(s, now + 1, &p);
}

/* A decode grows by its drafts; the rejected ones roll back (blocks and
 * counts); drafts never exceed max_new; results are validated. */
START_TEST(test_spec_drafts_and_rollback) {
    duet_sched *s = spec_sched(64, 4, 64);
    const duet_kv_blocks *kv = duet__sched_kv(s);
    duet_sched_plan p;
    arrive(s, 0, 1, 6, 20, DUET_PRIORITY_INTERACTIVE);
    /* An offer before the request decodes is ignored (waiting, then prefill). */
    duet__sched_set_draft(s, 1, 3, 1.0f, 1);
    plan_step(s, 0, &p);
    ck_assert(p.seqs[0].n_tokens == 6 && p.seqs[0].n_draft == 0 && p.n_draft == 0);
    complete(s, 1, &p);
    /* Decode at pos 6 with 5 drafts: 6 tokens, 6 logit rows, blocks cover 12. */
    const duet_sched_seq *e = plan_with_draft(s, 1, 1, 5, &p);
    ck_assert_msg(e->decode && e->pos == 6 && e->n_tokens == 6 && e->n_draft == 5 && e->logits,
                  "pos %d n %d draft %d", e->pos, e->n_tokens, e->n_draft);
    ck_assert_int_eq(p.n_logits, 6);
    ck_assert_int_eq(p.n_draft, 5);
    ck_assert_int_eq(e->n_blocks, 3);
    /* Results outside 1..1 + n_draft are refused. */
    duet_sched_result bad = {.id = 1, .n_generated = 0};
    ck_assert(duet__sched_step_done(s, 2, &bad, 1) == DUET_INVALID_ARGUMENT);
    bad.n_generated = 7;
    ck_assert(duet__sched_step_done(s, 2, &bad, 1) == DUET_INVALID_ARGUMENT);
    /* Two drafts kept and the target's own token: 3 generated, 9 computed
     * (the stream is 6 + 1 + 3 = 10 long), blocks back to 3 covering 9. */
    done_one(s, 2, 1, 3, false);
    ck_assert_int_eq(duet__kv_blocks_seq_blocks(kv, 0), 3);
    e = plan_with_draft(s, 2, 1, 1, &p);
    ck_assert_msg(e->pos == 9 && e->n_tokens == 2 && e->n_generated == 4, "pos %d n %d gen %d", e->pos,
                  e->n_tokens, e->n_generated);
    /* None kept: 1 generated; the draft's block (position 10 is in block 2) stays. */
    done_one(s, 3, 1, 1, false);
    e = plan_with_draft(s, 3, 1, 8, &p);
    ck_assert_msg(e->pos == 10 && e->n_draft == 8 && e->n_blocks == 5, "pos %d draft %d blocks %d", e->pos,
                  e->n_draft, e->n_blocks);
    /* Nothing kept: the 8 drafts' blocks go back (pos 11 -> 3 blocks). */
    int free_before = duet__kv_blocks_n_free(kv);
    done_one(s, 4, 1, 1, false);
    ck_assert_int_eq(duet__kv_blocks_seq_blocks(kv, 0), 3);
    ck_assert_int_eq(duet__kv_blocks_n_free(kv), free_before + 2);
    /* Generated 6 of 20: 13 may still come, the last from the target, so at most 13 drafts... */
    e = plan_with_draft(s, 4, 1, 16, &p);
    ck_assert_int_eq(e->n_draft, 13);
    /* ...and all kept plus the last token finishes it at max_new. */
    done_one(s, 5, 1, 14, true);
    duet_sched_stats st;
    duet__sched_stats(s, &st);
    ck_assert_int_eq(st.kv_blocks_used, 0);
    ck_assert_int_eq(st.finished, 1);
    ck_assert_uint_eq(st.spec_granted, 5 + 1 + 8 + 13);
    duet__sched_free(s);
}
END_TEST

/* Speculation backs off as the batch fills; drafts fit the budget and the
 * free blocks and never preempt; offers last one plan. */
START_TEST(test_spec_throttle_budget_and_blocks) {
    duet_sched *s = spec_sched(8, 1, 8);
    duet_sched_plan p;
    prefilled(s, 0, 1, 4, 20, DUET_PRIORITY_INTERACTIVE);
    /* Alone: drafts granted up to the token budget (8 - 1 decode). */
    const duet_sched_seq *e = plan_with_draft(s, 1, 1, 9, &p);
    ck_assert_int_eq(e->n_draft, 7);
    done_one(s, 2, 1, 1, false);
    /* An offer lasts one plan. */
    plan_step(s, 2, &p);
    ck_assert_int_eq(p.seqs[0].n_draft, 0);
    complete(s, 3, &p);
    /* A second decoding request: two decodes > spec_max_batch 1: no drafts. */
    arrive(s, 3, 2, 4, 20, DUET_PRIORITY_INTERACTIVE);
    plan_step(s, 3, &p);
    complete(s, 4, &p); /* 1 decodes, 2 prefills */
    duet__sched_set_draft(s, 2, 3, 1.0f, 1);
    e = plan_with_draft(s, 4, 1, 3, &p);
    ck_assert_int_eq(p.n_seqs, 2);
    ck_assert_int_eq(p.n_draft, 0);
    duet_sched_stats st;
    duet__sched_stats(s, &st);
    ck_assert_uint_eq(st.spec_throttled, 6);
    complete(s, 5, &p);
    /* Room for one more decode: raise the knob; the pool (8 blocks of 4)
     * then bounds the drafts, and nobody is preempted for them. */
    duet_sched_knobs k = duet__sched_knobs(s);
    k.spec_max_batch = 2;
    k.max_batch_tokens = 64;
    ck_assert(duet__sched_set_knobs(s, &k) == DUET_OK);
    duet__sched_set_draft(s, 2, 16, 1.0f, 1);
    e = plan_with_draft(s, 5, 1, 16, &p);
    ck_assert_int_eq(p.n_preempted, 0);
    duet__sched_stats(s, &st);
    ck_assert_msg(st.kv_blocks_used == 8, "drafts took the free blocks (%d used)", st.kv_blocks_used);
    ck_assert_msg(p.n_draft > 0 && p.n_draft <= 8 * 4 - 6 - 7, "drafts %d", p.n_draft);
    complete(s, 6, &p);
    duet__sched_stats(s, &st);
    ck_assert_msg(st.kv_blocks_used == 5, "rejected drafts gave their blocks back (%d used)",
                  st.kv_blocks_used);
    k.spec_max_batch = -1;
    ck_assert(duet__sched_set_knobs(s, &k) == DUET_INVALID_ARGUMENT);
    duet__sched_free(s);
}
END_TEST

/* The measured decision in the plan: on a compute-bound step-cost model 16
 * decodes get no drafts (counted as refused, the steps as plain) but one
 * candidate in turn gets its offer after DUET_SCHED_SPEC_EXPLORE refused
 * plans; alone, a decode gets drafts; a draft model dearer than the target
 * turns it off; without spec_measured every offer is granted. */
START_TEST(test_spec_measured_decision) {
    duet_sched_config c = base_config();
    c.max_seqs = c.knobs.max_batch_seqs = 16;
    c.max_tokens = c.knobs.max_batch_tokens = 256;
    c.knobs.prefill_chunk = 64;
    c.kv_blocks = 256;
    c.knobs.spec_max_batch = 16;
    c.knobs.spec_measured = true;
    duet_sched *s = make(&c);
    duet_step_cost m = {0};
    m.coef[0] = 0.010, m.coef[1] = 0.005; /* compute-bound: a token costs half a step's fixed part */
    duet__sched_set_cost(s, &m);
    duet_sched_plan p;
    for (uint64_t id = 1; id <= 16; id++)
        arrive(s, 0, id, 4, 200, DUET_PRIORITY_INTERACTIVE);
    plan_step(s, 0, &p); /* the 16 prompts */
    complete(s, 1, &p);
    int64_t t = 2;
    for (int step = 1; step <= DUET_SCHED_SPEC_EXPLORE; step++, t++) {
        for (uint64_t id = 1; id <= 16; id++)
            duet__sched_set_draft(s, id, 8, 0.8f, 1);
        plan_step(s, t, &p);
        ck_assert_int_eq(p.n_seqs, 16);
        if (step < DUET_SCHED_SPEC_EXPLORE) {
            ck_assert_msg(p.n_draft == 0, "step %d: %d drafts at batch 16, compute-bound", step, p.n_draft);
        } else {
            int with = 0;
            for (int k = 0; k < p.n_seqs; k++)
                with += p.seqs[k].n_draft > 0;
            ck_assert_msg(with == 1 && p.n_draft == 8, "exploration: %d sequences, %d drafts", with,
                          p.n_draft);
        }
        complete(s, t, &p);
    }
    duet_sched_stats st;
    duet__sched_stats(s, &st);
    ck_assert_uint_eq(st.spec_steps[DUET_SPEC_STEP_PLAIN], DUET_SCHED_SPEC_EXPLORE - 1);
    ck_assert_uint_eq(st.spec_steps[DUET_SPEC_STEP_EXPLORE], 1);
    ck_assert_uint_eq(st.spec_offered, 16 * 8 * DUET_SCHED_SPEC_EXPLORE);
    ck_assert_uint_eq(st.spec_throttled, st.spec_offered - 8);
    duet_spec_decision d;
    ck_assert(duet__sched_spec_decision(s, &d) && d.n_granted == 0 && d.speedup < 1 + DUET_SPEC_MIN_GAIN);
    /* Alone, the same model pays for drafts. */
    for (uint64_t id = 2; id <= 16; id++)
        ck_assert(duet__sched_cancel(s, t, id) == DUET_OK);
    const duet_sched_seq *e = plan_with_draft(s, t, 1, 8, &p);
    ck_assert_msg(e->n_draft > 0 && p.predicted_s > 0.015, "alone: %d drafts, %.3f s", e->n_draft,
                  p.predicted_s);
    ck_assert(duet__sched_spec_decision(s, &d) && d.n_granted == 1 && d.speedup > 1.02);
    done_one(s, t + 1, 1, 1, false);
    t += 2;
    /* A draft model whose every pass costs more than the target's step:
     * nothing; its predicted time is part of a granted step's. */
    duet_step_cost dear = {0};
    dear.coef[0] = 0.020;
    duet__sched_set_draft_cost(s, &dear);
    e = plan_with_draft(s, t, 1, 8, &p);
    ck_assert_int_eq(e->n_draft, 0);
    complete(s, t++, &p);
    duet_step_cost cheap = {0};
    cheap.coef[0] = 0.001;
    duet__sched_set_draft_cost(s, &cheap);
    e = plan_with_draft(s, t, 1, 8, &p);
    ck_assert_msg(e->n_draft > 0 &&
                      fabs(p.predicted_s - (0.015 + 0.005 * e->n_draft + 0.001 * e->n_draft)) < 1e-3,
                  "%d drafts, predicted %.4f s", e->n_draft, p.predicted_s);
    done_one(s, t++, 1, 1, false);
    /* Without the decision: the whole offer. */
    duet_sched_knobs k = duet__sched_knobs(s);
    k.spec_measured = false;
    ck_assert(duet__sched_set_knobs(s, &k) == DUET_OK);
    duet__sched_set_draft_cost(s, &dear);
    e = plan_with_draft(s, t, 1, 8, &p);
    ck_assert_int_eq(e->n_draft, 8);
    duet__sched_stats(s, &st);
    ck_assert_uint_eq(st.spec_steps[DUET_SPEC_STEP_ALWAYS], 1);
    done_one(s, t + 1, 1, 1, false);
    duet__sched_free(s);
}
END_TEST

/* A wrong refusal is corrected quickly (the engine's loop, driven by
 * hand): a draft model that pays at batch 1 only at high acceptance (its
 * pass costs 0.7 of the target's step), a sequence whose acceptance is not
 * known yet (0.5: refused) but which keeps every draft. Each step it offers
 * spec_k drafts at its adaptive alpha; after DUET_SCHED_SPEC_EXPLORE
 * refused plans one exploration grants the whole offer, the kept run lifts
 * alpha (duet__spec_adapt_update weighs each trial) and from the next step
 * on the decision grants drafts by itself. With exploration every 64 plans,
 * or an alpha that one run of 8 kept drafts moves only to 0.65, the
 * sequence decoded with nothing verified far longer. A draft too dear to
 * pay even if every draft were kept is not explored. */
START_TEST(test_spec_refusal_recovers) {
    enum { SPEC_K = 8, STEPS = 64 };
    duet_sched_config c = base_config();
    c.max_seqs = c.knobs.max_batch_seqs = 1;
    c.n_ctx = 2048;
    c.kv_blocks = 128;
    c.knobs.spec_max_batch = 1;
    c.knobs.spec_measured = true;
    duet_sched *s = make(&c);
    duet_step_cost target = {0}, draft = {0};
    target.coef[0] = 0.040, target.coef[1] = 0.002;
    draft.coef[0] = 0.028, draft.coef[1] = 0.001;
    duet__sched_set_cost(s, &target);
    duet__sched_set_draft_cost(s, &draft);
    duet_sched_plan p;
    arrive(s, 0, 1, 8, 1500, DUET_PRIORITY_INTERACTIVE);
    plan_step(s, 0, &p);
    done_one(s, 1, 1, 1, false);
    duet_spec_adapt a;
    duet__spec_adapt_init(&a, SPEC_K);
    int first_granted = 0, granted_steps = 0, explored = 0;
    for (int step = 1; step <= STEPS; step++) {
        duet__sched_set_draft(s, 1, SPEC_K, a.alpha, 1);
        plan_step(s, 1 + step, &p);
        ck_assert_int_eq(p.n_seqs, 1);
        int n = p.seqs[0].n_draft;
        duet_spec_decision d;
        ck_assert(duet__sched_spec_decision(s, &d));
        if (n > 0 && d.n_granted > 0) {
            granted_steps++;
            if (!first_granted) first_granted = step;
        } else if (n > 0) {
            explored++;
            ck_assert_msg(n == SPEC_K, "an exploration grants the whole offer (%d)", n);
        }
        done_one(s, 2 + step, 1, 1 + n, false);
        if (n > 0) duet__spec_adapt_update(&a, n, n, SPEC_K);
    }
    duet_sched_stats st;
    duet__sched_stats(s, &st);
    fprintf(stderr, "refusal recovers: first granted at step %d, %d of %d steps granted, %d explorations\n",
            first_granted, granted_steps, STEPS, explored);
    ck_assert_msg(first_granted > 0 && first_granted <= DUET_SCHED_SPEC_EXPLORE + 1 && first_granted <= 17,
                  "the first step the decision granted: %d", first_granted);
    ck_assert_msg(granted_steps >= STEPS - 17, "%d of %d steps granted", granted_steps, STEPS);
    ck_assert_uint_eq(st.spec_steps[DUET_SPEC_STEP_EXPLORE], (uint64_t)explored);
    ck_assert_int_eq(explored, 1);
    /* A draft model whose pass costs more than the target's step pays at
     * no acceptance: refused, and never explored (an exploration would only
     * cost its passes and its KV's catch-up). */
    duet_step_cost dear = {0};
    dear.coef[0] = 0.045;
    duet__sched_set_draft_cost(s, &dear);
    for (int step = 1; step <= 3 * DUET_SCHED_SPEC_EXPLORE; step++) {
        duet__sched_set_draft(s, 1, SPEC_K, a.alpha, 1);
        plan_step(s, 100 + step, &p);
        ck_assert_msg(p.seqs[0].n_draft == 0, "dear draft, step %d: %d drafts", step, p.seqs[0].n_draft);
        done_one(s, 101 + step, 1, 1, false);
    }
    duet__sched_stats(s, &st);
    ck_assert_uint_eq(st.spec_steps[DUET_SPEC_STEP_EXPLORE], 1);
    duet__sched_free(s);
}
END_TEST

/* Cancellation in the middle of a speculative step: the blocks of the
 * drafts go back at step_done, like the rest; preemption of a sequence
 * whose decode carries drafts takes them out of the plan. */
START_TEST(test_spec_cancel_and_preempt) {
    duet_sched *s = spec_sched(6, 4, 64);
    duet_sched_plan p;
    prefilled(s, 0, 1, 4, 16, DUET_PRIORITY_BATCH);
    plan_with_draft(s, 1, 1, 6, &p);
    ck_assert_int_eq(p.n_draft, 6);
    ck_assert(duet__sched_cancel(s, 2, 1) == DUET_OK);
    check_ok(s, "cancelled with a speculative step in flight");
    done_one(s, 3, 1, 4, false); /* ignored: cancelled */
    duet_sched_stats st;
    duet__sched_stats(s, &st);
    ck_assert_int_eq(st.kv_blocks_used, 0);
    /* A batch request speculates into most of the pool; an interactive
     * arrival needs it: the batch request is preempted, drafts and all. */
    prefilled(s, 3, 2, 4, 16, DUET_PRIORITY_BATCH);
    plan_with_draft(s, 4, 2, 12, &p);
    ck_assert_int_eq(p.n_draft, 12);
    complete(s, 5, &p); /* none kept */
    arrive(s, 5, 3, 20, 4, DUET_PRIORITY_INTERACTIVE);
    duet__sched_set_draft(s, 2, 12, 1.0f, 1);
    plan_step(s, 5, &p);
    ck_assert(was_preempted(&p, 2) && find_seq(&p, 2) < 0 && find_seq(&p, 3) >= 0);
    complete(s, 6, &p);
    run_to_idle(s, &(int64_t){6}, 200);
    duet__sched_stats(s, &st);
    ck_assert_int_eq(st.kv_blocks_used, 0);
    duet__sched_free(s);
}
END_TEST

/* ---- randomized simulation -------------------------------------------------------- */

/* Check's ck_assert records a mark point per passing call, which dominates
 * a simulation that asserts thousands of times per step: fail through
 * ck_abort_msg only. */
#define SIM_ASSERT(cond, ...)                                                                                \
    do {                                                                                                     \
        if (!(cond)) ck_abort_msg(__VA_ARGS__);                                                              \
    } while (0)
#define SIM_CHECK(cond) SIM_ASSERT(cond, "%s", #cond)

/* ---- prefix caching -------------------------------------------------------- */

static void arrive_stream(duet_sched *s, int64_t now, uint64_t id, const int32_t *stream, int n_prompt,
                          int max_new, bool lookup) {
    arrive(s, now, id, n_prompt, max_new, DUET_PRIORITY_INTERACTIVE);
    ck_assert_int_eq(duet__sched_set_stream(s, id, stream, lookup), DUET_OK);
}

START_TEST(test_prefix_cache_shares_prompt_blocks) {
    duet_sched_config c = base_config();
    duet_sched *s = make(&c);
    duet_sched_plan p;
    int64_t now = 0;
    static int32_t a[64], b[64], d[64];
    for (int i = 0; i < 64; i++)
        a[i] = b[i] = d[i] = 1000 + i;
    for (int i = 35; i < 64; i++)
        b[i] = 5000 + i;
    /* A computes its 40 prompt tokens and 2 generated: 2 full blocks cached. */
    arrive_stream(s, now, 1, a, 40, 3, true);
    run_to_idle(s, &now, 100);
    duet_sched_stats st;
    duet__sched_stats(s, &st);
    ck_assert_msg(st.prefix_queries == 40 && st.prefix_hits == 0 && st.kv_blocks_cached == 2,
                  "after A: queries %llu hits %llu cached %d", (unsigned long long)st.prefix_queries,
                  (unsigned long long)st.prefix_hits, st.kv_blocks_cached);
    ck_assert_int_eq(st.kv_blocks_used, 0);
    int32_t cached[4];
    uint64_t h = 0;
    ck_assert_int_eq(duet__kv_blocks_lookup(duet__sched_kv(s), a, 64, 4, cached, &h), 2);
    /* B shares A's first 35 tokens: 2 blocks; it computes from 32. */
    arrive_stream(s, now, 2, b, 45, 2, true);
    plan_step(s, now, &p);
    ck_assert_msg(p.n_seqs == 1 && p.seqs[0].pos == 32 && p.seqs[0].n_tokens == 13 && p.seqs[0].logits &&
                      p.seqs[0].first_schedule && !p.seqs[0].resumed,
                  "B starts after the cached prefix: pos %d n %d", p.seqs[0].pos, p.seqs[0].n_tokens);
    ck_assert_msg(p.seqs[0].n_blocks == 3 && p.seqs[0].blocks[0] == cached[0] &&
                      p.seqs[0].blocks[1] == cached[1],
                  "B's table starts with A's cached blocks");
    duet__sched_stats(s, &st);
    ck_assert_msg(st.prefix_queries == 85 && st.prefix_hits == 32 && st.kv_blocks_used == 3,
                  "after B's admission: queries %llu hits %llu used %d",
                  (unsigned long long)st.prefix_queries, (unsigned long long)st.prefix_hits,
                  st.kv_blocks_used);
    complete(s, ++now, &p);
    run_to_idle(s, &now, 100);
    /* A prompt that is exactly 2 cached blocks still computes its last
     * token, so only 1 block is shared (whole blocks only). */
    arrive_stream(s, now, 3, d, 32, 1, true);
    plan_step(s, now, &p);
    ck_assert_msg(p.seqs[0].pos == 16 && p.seqs[0].n_tokens == 16 && p.seqs[0].logits,
                  "full hit: pos %d n %d", p.seqs[0].pos, p.seqs[0].n_tokens);
    complete(s, ++now, &p);
    /* Without lookup (or without a stream) nothing is shared or counted. */
    arrive_stream(s, now, 4, a, 40, 1, false);
    arrive(s, now, 5, 40, 1, DUET_PRIORITY_INTERACTIVE);
    duet__sched_stats(s, &st);
    uint64_t q = st.prefix_queries;
    plan_step(s, now, &p);
    ck_assert_msg(p.n_seqs == 2 && p.seqs[0].pos == 0 && p.seqs[1].pos == 0, "no lookup: from position 0");
    complete(s, ++now, &p);
    run_to_idle(s, &now, 100);
    duet__sched_stats(s, &st);
    ck_assert_msg(st.prefix_queries == q, "requests without lookup are not queries");
    ck_assert_msg(duet__sched_set_stream(s, 99, a, true) == DUET_INVALID_ARGUMENT, "unknown request refused");
    arrive(s, now, 6, 8, 4, DUET_PRIORITY_INTERACTIVE);
    plan_step(s, now, &p);
    ck_assert_msg(duet__sched_set_stream(s, 6, a, true) == DUET_INVALID_ARGUMENT,
                  "a started request is refused");
    complete(s, ++now, &p);
    run_to_idle(s, &now, 100);
    duet__sched_free(s);
}
END_TEST

START_TEST(test_prefix_admission_needs_only_missing_blocks) {
    /* 6 blocks of 16. A (48-token prompt) runs and holds 4 blocks. B has
     * the same 48 tokens and 16 more: 4 blocks in all, only 1 not cached,
     * and 2 are free. With the cache B is admitted at once; without it B
     * waits (it cannot preempt A, of its own class). */
    for (int cache = 0; cache < 2; cache++) {
        duet_sched_config c = base_config();
        c.kv_blocks = 6;
        c.n_ctx = 96;
        c.knobs.prefill_chunk = 64;
        duet_sched *s = make(&c);
        duet_sched_plan p;
        int64_t now = 0;
        static int32_t a[96], b[96];
        for (int i = 0; i < 96; i++)
            a[i] = b[i] = 7 + i;
        for (int i = 48; i < 96; i++)
            b[i] = 900 + i;
        arrive_stream(s, now, 1, a, 48, 40, true);
        for (int i = 0; i < 3; i++) { /* the prompt, then 2 decodes */
            plan_step(s, now, &p);
            complete(s, ++now, &p);
        }
        duet_sched_stats st;
        duet__sched_stats(s, &st);
        ck_assert_msg(st.kv_blocks_used == 4 && st.kv_blocks_cached == 3, "A holds %d blocks, %d cached",
                      st.kv_blocks_used, st.kv_blocks_cached);
        arrive(s, now, 2, 64, 16, DUET_PRIORITY_INTERACTIVE);
        if (cache) ck_assert_int_eq(duet__sched_set_stream(s, 2, b, true), DUET_OK);
        plan_step(s, now, &p);
        int k = find_seq(&p, 2);
        if (cache) {
            ck_assert_msg(k >= 0 && p.seqs[k].pos == 48 && p.seqs[k].n_tokens == 16,
                          "B admitted after its prefix");
            ck_assert_msg(p.n_preempted == 0 && find_seq(&p, 1) >= 0, "A keeps running");
            duet__sched_stats(s, &st);
            ck_assert_int_eq(st.kv_blocks_used, 5);
        } else {
            ck_assert_msg(k < 0 && p.n_seqs == 1, "without the cache B does not fit");
        }
        complete(s, ++now, &p);
        run_to_idle(s, &now, 200);
        duet__sched_stats(s, &st);
        ck_assert_msg(st.finished == 2 && st.kv_blocks_used == 0, "both finish, nothing leaks");
        duet__sched_free(s);
    }
}
END_TEST

START_TEST(test_prefix_survives_preemption_and_cancel) {
    /* A batch request preempted by an interactive one re-admits with its
     * own cached blocks (prompt and generated), computing only the rest; a
     * cancelled sharer leaves the shared blocks to the others. */
    duet_sched_config c = base_config();
    c.kv_block_size = 4;
    c.kv_blocks = 8;
    c.n_ctx = 32;
    c.knobs.prefill_chunk = 32;
    duet_sched *s = make(&c);
    duet_sched_plan p;
    int64_t now = 0;
    static int32_t a[32], b[32];
    for (int i = 0; i < 32; i++)
        a[i] = 50 + i, b[i] = 70000 + i;
    arrive(s, now, 10, 12, 12, DUET_PRIORITY_BATCH);
    ck_assert_int_eq(duet__sched_set_stream(s, 10, a, true), DUET_OK);
    for (int i = 0; i < 6; i++) {
        plan_step(s, now, &p);
        complete(s, ++now, &p);
    }
    /* Stream of 18, 17 computed: 4 full blocks cached. */
    duet_sched_stats st;
    duet__sched_stats(s, &st);
    ck_assert_int_eq(st.kv_blocks_cached, 4);
    arrive(s, now, 20, 20, 4, DUET_PRIORITY_INTERACTIVE);
    ck_assert_int_eq(duet__sched_set_stream(s, 20, b, true), DUET_OK);
    plan_step(s, now, &p);
    ck_assert_msg(p.n_preempted == 1 && p.preempted[0] == 10, "the batch request is preempted");
    complete(s, ++now, &p);
    bool resumed = false;
    for (int it = 0; it < 100; it++) {
        duet_sched_action act = duet__sched_plan(s, now, &p);
        if (act == DUET_SCHED_IDLE) break;
        ck_assert(act == DUET_SCHED_STEP);
        int k = find_seq(&p, 10);
        if (k >= 0 && p.seqs[k].resumed) {
            /* 18 tokens: (18 - 1) / 4 = 4 blocks may be shared, if the
             * interactive request left them in the pool. */
            ck_assert_msg(p.seqs[k].pos % 4 == 0 && p.seqs[k].pos + p.seqs[k].n_tokens == 18 &&
                              p.seqs[k].logits,
                          "resume at %d of 18", p.seqs[k].pos);
            resumed = true;
        }
        complete(s, ++now, &p);
    }
    ck_assert(resumed);
    duet__sched_stats(s, &st);
    ck_assert_msg(st.prefix_hits > 0, "the resume found some of its blocks");
    ck_assert_msg(st.finished == 2 && st.kv_blocks_used == 0, "nothing lost, nothing leaked");
    /* Two sharers of A's stream; one is cancelled mid-step, one finishes. */
    arrive(s, now, 30, 20, 4, DUET_PRIORITY_INTERACTIVE);
    ck_assert_int_eq(duet__sched_set_stream(s, 30, a, true), DUET_OK);
    arrive(s, now, 31, 20, 4, DUET_PRIORITY_INTERACTIVE);
    ck_assert_int_eq(duet__sched_set_stream(s, 31, a, true), DUET_OK);
    plan_step(s, now, &p);
    ck_assert_msg(p.n_seqs == 2 && p.seqs[0].pos == 16 && p.seqs[1].pos == 16, "both share 4 blocks");
    ck_assert_int_eq(duet__sched_cancel(s, now, 30), DUET_OK);
    complete(s, ++now, &p);
    run_to_idle(s, &now, 100);
    duet__sched_stats(s, &st);
    ck_assert_msg(st.kv_blocks_used == 0 && st.cancelled == 1, "nothing leaked after the cancel");
    duet__sched_prefix_clear(s);
    duet__sched_stats(s, &st);
    ck_assert_int_eq(st.kv_blocks_cached, 0);
    check_ok(s, "after clear");
    duet__sched_free(s);
}
END_TEST

typedef struct sim_cfg {
    uint64_t seed;
    int n_arrivals;
    duet_sched_config c;
    int max_prompt, max_new;
    double mean_gap_ms; /* mean inter-arrival time */
    double cancel_prob; /* per event, cancel a random live request */
    double fail_prob;   /* per step, the device "fails" the step */
    bool retune;        /* change knobs at random */
    int n_prefixes;     /* > 0: streams start with one of this many shared token runs (prefix caching) */
    double spec_prob;   /* per decoding request and plan, offer 1..6 drafts */
    bool timed;         /* a step-cost model and step budgets (retuned at random with retune) */
} sim_cfg;

/* The simulation's step-cost model (timed runs): its fake device's costs. */
static const duet_step_cost *g_sim_cost;

enum { SH_NONE = 0, SH_WAITING, SH_RUNNING, SH_DONE, SH_REFUSED };

typedef struct shadow {
    int n_prompt, max_new, target, prio, state, computed, gen, slot, outcomes;
    bool finished, cancelled;
} shadow;

static uint64_t sim_rng;
static uint64_t sim_next(void) { /* splitmix64 */
    uint64_t z = (sim_rng += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}
static int sim_int(int lo, int hi) {
    return lo + (int)(sim_next() % (uint64_t)(hi - lo + 1));
}
static double sim_unit(void) {
    return (double)(sim_next() >> 11) / 9007199254740992.0;
}

typedef struct sim_out {
    uint64_t trace_hash;
    uint64_t steps, preemptions, finished, cancelled, refused, rejected, tokens;
    uint64_t prefix_hits, prefix_queries;
    uint64_t drafts, kept, throttled;
    uint64_t budget_cut, budget_over;
} sim_out;

static uint64_t mix(uint64_t h, uint64_t v) {
    return (h ^ v) * 0x100000001B3ULL;
}

/* Prefix caching in the simulation: each request's whole stream (prompt and
 * the tokens it will "generate"), and what each KV block position holds
 * (written by the steps that compute it), to check that a shared block
 * holds exactly the tokens of the stream that shares it. NULL when off. */
static int32_t *g_streams; /* [n_arrivals][n_ctx] */
static int32_t *g_content; /* [kv_blocks][kv_block_size], -1 unwritten */
static int g_stream_len;

static void sim_set_outcome(shadow *sh, uint64_t id, bool finished) {
    SIM_ASSERT(sh[id].outcomes == 0, "request %llu ended twice", (unsigned long long)id);
    sh[id].outcomes++;
    sh[id].state = SH_DONE;
    sh[id].slot = -1;
    if (finished)
        sh[id].finished = true;
    else
        sh[id].cancelled = true;
}

/* Checks one plan against the shadow and applies its preemptions/admissions. */
/* Ids below lo have ended and ids from hi on have not arrived, so the scans
 * over the shadow look at [lo, hi) only. */
static void sim_check_plan(duet_sched *s, shadow *sh, int lo, int n_ids, const duet_sched_plan *p,
                           const duet_sched_knobs *kn, const duet_sched_config *c, uint64_t *hash) {
    SIM_ASSERT(p->n_seqs >= 1 && p->n_seqs <= c->max_seqs, "plan has %d entries", p->n_seqs);
    SIM_ASSERT(p->n_tokens <= kn->max_batch_tokens, "plan uses %d tokens, budget %d", p->n_tokens,
               kn->max_batch_tokens);
    /* Preemptions: only of running requests, which go back to waiting. */
    bool interactive_preempted = false;
    for (int k = 0; k < p->n_preempted; k++) {
        uint64_t id = p->preempted[k];
        SIM_ASSERT(id < (uint64_t)n_ids && sh[id].state == SH_RUNNING, "preempted %llu was not running",
                   (unsigned long long)id);
        SIM_ASSERT(find_seq(p, id) < 0, "preempted %llu is also in the step", (unsigned long long)id);
        sh[id].state = SH_WAITING;
        sh[id].computed = 0;
        sh[id].slot = -2; /* marks "preempted in this plan" until the end of this check */
        if (sh[id].prio == DUET_PRIORITY_INTERACTIVE) interactive_preempted = true;
        *hash = mix(*hash, id + 1000000);
    }
    /* Admissions must be a FIFO prefix of each class's waiting queue. */
    int admitted[2] = {0, 0};
    uint64_t last_admitted[2] = {0, 0}, last_chunk[2] = {0, 0}; /* last_chunk: id + 1 */
    bool seen_slot[256] = {false}, seen_chunk = false;
    int n_logits = 0, sum = 0, n_drafts = 0, n_decodes = 0;
    for (int k = 0; k < p->n_seqs; k++) {
        const duet_sched_seq *e = &p->seqs[k];
        uint64_t id = e->id;
        SIM_ASSERT(id < (uint64_t)n_ids, "unknown id %llu in plan", (unsigned long long)id);
        shadow *r = &sh[id];
        SIM_ASSERT(e->slot >= 0 && e->slot < c->max_seqs && !seen_slot[e->slot], "slot %d reused in one step",
                   e->slot);
        seen_slot[e->slot] = true;
        if (r->state == SH_WAITING) {
            SIM_ASSERT(r->slot != -2, "request %llu re-admitted in the plan that preempted it",
                       (unsigned long long)id);
            int bs = c->kv_block_size;
            SIM_ASSERT(e->pos == 0 || (g_streams && e->pos % bs == 0 && e->pos < r->n_prompt + r->gen),
                       "admission of %llu starts at %d", (unsigned long long)id, e->pos);
            /* Shared blocks hold exactly this stream's tokens. */
            for (int q = 0; q < e->pos; q++)
                SIM_ASSERT(g_content[(size_t)e->blocks[q / bs] * bs + q % bs] ==
                               g_streams[(size_t)id * g_stream_len + q],
                           "request %llu shares block %d whose position %d holds another token",
                           (unsigned long long)id, e->blocks[q / bs], q % bs);
            r->computed = e->pos;
            admitted[r->prio]++;
            /* In plan order, but for a re-admission whose cached blocks
             * left only its newest token: that is a decode, moved first. */
            if (!e->decode) {
                SIM_ASSERT(id + 1 > last_chunk[r->prio], "admissions out of order");
                last_chunk[r->prio] = id + 1;
            }
            if (id > last_admitted[r->prio]) last_admitted[r->prio] = id;
            r->state = SH_RUNNING;
            r->slot = e->slot;
        } else {
            SIM_ASSERT(r->state == SH_RUNNING, "request %llu in the plan is in state %d",
                       (unsigned long long)id, r->state);
            SIM_ASSERT(r->slot == e->slot, "request %llu moved from slot %d to %d while running",
                       (unsigned long long)id, r->slot, e->slot);
        }
        int len = r->n_prompt + r->gen;
        int n_real = e->n_tokens - e->n_draft; /* stream tokens; drafts follow */
        SIM_ASSERT(e->pos == r->computed && n_real >= 1 && e->pos + n_real <= len,
                   "request %llu: entry pos %d n %d, shadow computed %d of %d", (unsigned long long)id,
                   e->pos, e->n_tokens, r->computed, len);
        SIM_ASSERT(e->logits == (e->pos + n_real == len), "request %llu: logits flag wrong",
                   (unsigned long long)id);
        SIM_ASSERT(e->n_draft >= 0 &&
                       (e->n_draft == 0 || (e->decode && e->n_draft <= r->max_new - r->gen - 1)),
                   "request %llu: %d drafts (decode %d, %d of %d generated)", (unsigned long long)id,
                   e->n_draft, e->decode, r->gen, r->max_new);
        SIM_ASSERT(e->n_prompt == r->n_prompt && e->n_generated == r->gen, "request %llu: stream layout",
                   (unsigned long long)id);
        if (e->decode) {
            SIM_ASSERT(!seen_chunk, "a decode after a prompt chunk");
            SIM_ASSERT(n_real == 1 && r->gen > 0, "decode entry of %d tokens", e->n_tokens);
        } else {
            seen_chunk = true;
            SIM_ASSERT(e->n_tokens <= kn->prefill_chunk, "chunk of %d over prefill_chunk %d", e->n_tokens,
                       kn->prefill_chunk);
        }
        SIM_ASSERT(e->n_blocks >= duet__kv_blocks_needed(duet__sched_kv(s), e->pos + e->n_tokens),
                   "request %llu: %d blocks do not cover %d tokens", (unsigned long long)id, e->n_blocks,
                   e->pos + e->n_tokens);
        for (int q = e->pos; g_streams && q < e->pos + e->n_tokens; q++) {
            int bs = c->kv_block_size, b = e->blocks[q / bs];
            SIM_ASSERT(duet__kv_blocks_refcount(duet__sched_kv(s), b) == 1 &&
                           !duet__kv_blocks_is_cached(duet__sched_kv(s), b),
                       "request %llu writes position %d into a shared or cached block %d",
                       (unsigned long long)id, q, b);
            g_content[(size_t)b * bs + q % bs] = g_streams[(size_t)id * g_stream_len + q];
        }
        n_logits += e->logits ? 1 + e->n_draft : 0;
        sum += e->n_tokens;
        n_drafts += e->n_draft;
        n_decodes += e->decode;
        *hash = mix(mix(mix(*hash, id), (uint64_t)e->pos), (uint64_t)e->n_tokens);
    }
    SIM_ASSERT(n_drafts == p->n_draft, "plan counts %d drafts, entries %d", p->n_draft, n_drafts);
    /* The time budget: within it, or over by the step's first chunk only
     * (the minimum chunk prefill always gets). */
    if (g_sim_cost && p->budget_ns > 0) {
        duet_step_shape all = {0}, dec = {0}, first = {0}, none = {0};
        bool seen = false;
        for (int k = 0; k < p->n_seqs; k++) {
            const duet_sched_seq *e = &p->seqs[k];
            duet_step_shape_add(&all, e->pos, e->n_tokens, e->decode);
            if (e->decode) duet_step_shape_add(&dec, e->pos, e->n_tokens, true);
            if (!e->decode && !seen) duet_step_shape_add(&first, e->pos, e->n_tokens, false), seen = true;
        }
        double t = duet_step_cost_predict(g_sim_cost, &all), d = duet_step_cost_predict(g_sim_cost, &dec);
        double f = duet_step_cost_predict(g_sim_cost, &first) - duet_step_cost_predict(g_sim_cost, &none);
        double b = (double)p->budget_ns * 1e-9;
        SIM_ASSERT(fabs(t - p->predicted_s) < 1e-9 && t <= (b > d + f ? b : d + f) + 1e-9,
                   "step predicted %.3f ms (plan %.3f), budget %.3f ms, decodes %.3f ms, first chunk %.3f ms",
                   t * 1e3, p->predicted_s * 1e3, b * 1e3, d * 1e3, f * 1e3);
    }
    SIM_ASSERT(n_drafts == 0 || n_decodes <= kn->spec_max_batch,
               "%d drafts in a step of %d decodes (limit %d)", n_drafts, n_decodes, kn->spec_max_batch);
    SIM_ASSERT(sum == p->n_tokens && n_logits == p->n_logits, "plan totals wrong");
    /* FIFO prefix: every waiting request older than an admitted one of the
     * same class was admitted too (except those preempted by this plan). */
    for (int q = 0; q < 2; q++) {
        if (!admitted[q]) continue;
        for (int id = lo; id < n_ids; id++)
            if (sh[id].state == SH_WAITING && sh[id].prio == q && sh[id].slot != -2)
                SIM_ASSERT((uint64_t)id > last_admitted[q],
                           "class %d: request %d still waits but %llu, younger, was admitted", q, id,
                           (unsigned long long)last_admitted[q]);
    }
    /* Priority: batch admitted only when no interactive request is waiting;
     * interactive preempted only when no batch request holds a slot. */
    int waiting_interactive = 0, running_batch = 0, running_total = 0;
    for (int id = lo; id < n_ids; id++) {
        if (sh[id].state == SH_WAITING && sh[id].prio == 0) waiting_interactive++;
        if (sh[id].state == SH_RUNNING) {
            running_total++;
            if (sh[id].prio == 1) running_batch++;
        }
        if (sh[id].slot == -2) sh[id].slot = -1;
    }
    if (admitted[1]) SIM_ASSERT(waiting_interactive == 0, "batch admitted while interactive requests wait");
    if (interactive_preempted)
        SIM_ASSERT(running_batch == 0, "interactive work preempted while batch work holds %d slots",
                   running_batch);
    SIM_ASSERT(running_total <= c->max_seqs, "%d running over %d slots", running_total, c->max_seqs);
    if (admitted[0] + admitted[1] > 0)
        SIM_ASSERT(running_total <= kn->max_batch_seqs,
                   "admitted beyond max_batch_seqs (%d running, knob %d)", running_total, kn->max_batch_seqs);
    /* Continuous batching: a running decode skips a step only when the
     * budget is spent or the plan had to preempt. */
    if (p->n_tokens < kn->max_batch_tokens && p->n_preempted == 0) {
        for (int id = lo; id < n_ids; id++) {
            const shadow *r = &sh[id];
            if (r->state == SH_RUNNING && r->gen > 0 && r->computed == r->n_prompt + r->gen - 1)
                SIM_ASSERT(find_seq(p, (uint64_t)id) >= 0, "running decode %d left out of a step with budget",
                           id);
        }
    }
    /* KV: blocks of the running requests add up to what the pool lent. */
    duet_sched_stats st;
    duet__sched_stats(s, &st);
    int held = 0;
    static bool seen_block[4096];
    SIM_CHECK(c->kv_blocks <= 4096);
    memset(seen_block, 0, sizeof seen_block);
    for (int slot = 0; slot < c->max_seqs; slot++) {
        int nb = 0;
        const int32_t *t = duet__kv_blocks_table(duet__sched_kv(s), slot, &nb);
        for (int j = 0; j < nb; j++) { /* shared blocks count once */
            held += !seen_block[t[j]];
            seen_block[t[j]] = true;
        }
    }
    SIM_ASSERT(held == st.kv_blocks_used, "tables hold %d blocks, pool lent %d", held, st.kv_blocks_used);
}

static sim_out run_sim(const sim_cfg *cfg) {
    sim_rng = cfg->seed;
    int n = cfg->n_arrivals;
    shadow *sh = calloc((size_t)n, sizeof *sh);
    int64_t *arrival_at = malloc((size_t)n * sizeof *arrival_at);
    int *live = malloc((size_t)n * sizeof *live);
    SIM_CHECK(sh && arrival_at && live);
    int n_live = 0;
    double t = 0;
    for (int i = 0; i < n; i++) {
        t += -log(1.0 - sim_unit()) * cfg->mean_gap_ms;
        arrival_at[i] = (int64_t)(t * (double)MS);
    }
    g_streams = g_content = NULL;
    if (cfg->n_prefixes > 0) {
        g_stream_len = cfg->c.n_ctx;
        g_streams = malloc((size_t)n * g_stream_len * sizeof *g_streams);
        g_content = malloc((size_t)cfg->c.kv_blocks * cfg->c.kv_block_size * sizeof *g_content);
        SIM_CHECK(g_streams && g_content);
        memset(g_content, 0xff, (size_t)cfg->c.kv_blocks * cfg->c.kv_block_size * sizeof *g_content);
    }
    duet_sched *s = NULL;
    SIM_ASSERT(duet__sched_new(&cfg->c, &s) == DUET_OK, "sched_new: %s", duet_last_error());
    /* The fake device below: 2 ms a step, 20 us a token, 50 us a sequence. */
    static const duet_step_cost sim_cost = {.coef = {2e-3, 70e-6, 20e-6, 0, 1e-9}};
    g_sim_cost = cfg->timed ? &sim_cost : NULL;
    duet__sched_set_cost(s, g_sim_cost);
    sim_out out = {.trace_hash = 1469598103934665603ULL};
    int next = 0, lo = 0;
    int64_t now = 0, step_end = 0, wake = 0;
    bool outstanding = false;
    duet_sched_action act = DUET_SCHED_IDLE;
    duet_sched_plan p;
    duet_sched_knobs plan_knobs = cfg->c.knobs;
    for (long it = 0;; it++) {
        SIM_ASSERT(it < 50L * n + 100000, "simulation does not converge");
        if (!outstanding) {
            plan_knobs = duet__sched_knobs(s);
            for (int j = 0; cfg->spec_prob > 0 && j < n_live; j++) {
                const shadow *q = &sh[live[j]];
                if (q->state == SH_RUNNING && q->gen > 0 && q->computed == q->n_prompt + q->gen - 1 &&
                    sim_unit() < cfg->spec_prob)
                    duet__sched_set_draft(s, (uint64_t)live[j], sim_int(1, 6), 1.0f, 1);
            }
            act = duet__sched_plan(s, now, &p);
            if (act == DUET_SCHED_STEP) {
                while (lo < next && (sh[lo].state == SH_DONE || sh[lo].state == SH_REFUSED))
                    lo++;
                sim_check_plan(s, sh, lo, next, &p, &plan_knobs, &cfg->c, &out.trace_hash);
                outstanding = true;
                /* Fake cost model: fixed overhead + per token + per sequence. */
                step_end = now + 2 * MS + (int64_t)p.n_tokens * 20000 + (int64_t)p.n_seqs * 50000;
                out.steps++;
                out.tokens += (uint64_t)p.n_tokens;
            } else if (act == DUET_SCHED_WAIT) {
                SIM_ASSERT(p.wake_at > now, "WAIT until %lld is not in the future (%lld)",
                           (long long)p.wake_at, (long long)now);
                wake = p.wake_at;
            } else if (next >= n) {
                break;
            }
            duet_status cs = duet__sched_check(s);
            SIM_ASSERT(cs == DUET_OK, "invariants after plan: %s", duet_last_error());
        }
        int64_t tn = INT64_MAX;
        if (outstanding)
            tn = step_end;
        else if (act == DUET_SCHED_WAIT)
            tn = wake;
        if (next < n && arrival_at[next] < tn) tn = arrival_at[next];
        SIM_CHECK(tn != INT64_MAX);
        if (tn > now) now = tn;

        if (outstanding && step_end <= now) {
            outstanding = false;
            if (sim_unit() < cfg->fail_prob) {
                duet__sched_step_failed(s, now);
            } else {
                duet_sched_result r[256];
                for (int k = 0; k < p.n_seqs; k++) {
                    const duet_sched_seq *e = &p.seqs[k];
                    shadow *q = &sh[e->id];
                    r[k].id = e->id;
                    r[k].n_generated = e->logits ? 1 : 0;
                    r[k].finished = false;
                    if (q->state != SH_RUNNING) continue; /* cancelled in flight */
                    if (e->n_draft > 0) {
                        /* Keep a run of drafts, then the target's token; stop at the target. */
                        int kept = sim_int(0, e->n_draft);
                        int n_gen = kept + 1 < q->target - q->gen ? kept + 1 : q->target - q->gen;
                        out.drafts += (uint64_t)e->n_draft;
                        out.kept += (uint64_t)kept;
                        r[k].n_generated = n_gen;
                        q->computed += n_gen;
                        q->gen += n_gen;
                        if (q->gen == q->target) {
                            r[k].finished = true;
                            sim_set_outcome(sh, e->id, true);
                            for (int j = 0; j < n_live; j++)
                                if (live[j] == (int)e->id) live[j] = live[--n_live];
                        }
                        continue;
                    }
                    q->computed += e->n_tokens;
                    if (e->logits) {
                        q->gen++;
                        if (q->gen == q->target) {
                            r[k].finished = true;
                            sim_set_outcome(sh, e->id, true);
                            for (int j = 0; j < n_live; j++)
                                if (live[j] == (int)e->id) live[j] = live[--n_live];
                        }
                    }
                }
                duet_status st = duet__sched_step_done(s, now, r, p.n_seqs);
                SIM_ASSERT(st == DUET_OK, "step_done: %s", duet_last_error());
            }
        }
        while (next < n && arrival_at[next] <= now) {
            int id = next++;
            shadow *q = &sh[id];
            q->n_prompt = sim_int(1, cfg->max_prompt);
            q->max_new = sim_int(1, cfg->max_new);
            q->target = sim_unit() < 0.5 ? q->max_new : sim_int(1, q->max_new); /* EOS early */
            q->prio = sim_unit() < 0.3 ? DUET_PRIORITY_INTERACTIVE : DUET_PRIORITY_BATCH;
            duet_sched_stats st;
            duet__sched_stats(s, &st);
            int waiting = st.waiting[0] + st.waiting[1];
            bool too_long =
                q->n_prompt + q->max_new > cfg->c.n_ctx ||
                duet__kv_blocks_needed(duet__sched_kv(s), q->n_prompt + q->max_new) > cfg->c.kv_blocks;
            duet_sched_admit a =
                duet__sched_arrival(s, now, (uint64_t)id, q->n_prompt, q->max_new, (duet_priority)q->prio);
            if (g_streams && a == DUET_SCHED_ADMITTED) {
                /* One of the shared runs for a random length, then its own
                 * tokens; "generated" tokens follow the same rule, so equal
                 * prompts also share their generated blocks. */
                int k = sim_int(0, cfg->n_prefixes - 1), share = sim_int(0, g_stream_len);
                int32_t *t = g_streams + (size_t)id * g_stream_len;
                for (int j = 0; j < g_stream_len; j++)
                    t[j] = j < share ? k * 10000 + j : 1000000 + id * 1000 + j;
                SIM_CHECK(duet__sched_set_stream(s, (uint64_t)id, t, sim_unit() < 0.9) == DUET_OK);
            }
            duet_sched_admit want = too_long                                      ? DUET_SCHED_TOO_LONG
                                    : waiting >= duet__sched_knobs(s).max_waiting ? DUET_SCHED_QUEUE_FULL
                                                                                  : DUET_SCHED_ADMITTED;
            SIM_ASSERT(a == want, "arrival %d: got %d, want %d", id, a, want);
            if (a == DUET_SCHED_ADMITTED) {
                q->state = SH_WAITING;
                q->slot = -1;
                live[n_live++] = id;
            } else {
                q->state = SH_REFUSED;
                if (a == DUET_SCHED_QUEUE_FULL)
                    out.refused++;
                else
                    out.rejected++;
            }
        }
        if (n_live > 0 && sim_unit() < cfg->cancel_prob) {
            int j = sim_int(0, n_live - 1);
            int id = live[j];
            live[j] = live[--n_live];
            SIM_ASSERT(duet__sched_cancel(s, now, (uint64_t)id) == DUET_OK, "cancel of live %d: %s", id,
                       duet_last_error());
            sim_set_outcome(sh, (uint64_t)id, false);
            out.cancelled++;
        }
        if (cfg->retune && sim_unit() < 0.01) {
            duet_sched_knobs k = {
                .max_batch_seqs = sim_int(1, cfg->c.max_seqs),
                .max_batch_tokens = sim_int(1, cfg->c.max_tokens),
                .prefill_chunk = sim_int(1, 64),
                .max_waiting = sim_int(0, cfg->c.max_waiting),
                .batch_timeout_ns = sim_int(0, 5) * MS,
                .spec_max_batch = sim_int(0, cfg->c.max_seqs),
            };
            if (cfg->timed)
                k.step_budget_ns[0] = sim_int(0, 6) * MS, k.step_budget_ns[1] = sim_int(0, 12) * MS;
            SIM_CHECK(duet__sched_set_knobs(s, &k) == DUET_OK);
        }
        duet_status cs = duet__sched_check(s);
        SIM_ASSERT(cs == DUET_OK, "invariants at t=%lld: %s", (long long)now, duet_last_error());
    }
    /* Every admitted request ended exactly once; finished ones got all
     * their tokens; the pool is whole again. */
    duet_sched_stats st;
    duet__sched_stats(s, &st);
    for (int id = 0; id < n; id++) {
        if (sh[id].state == SH_REFUSED) continue;
        SIM_ASSERT(sh[id].outcomes == 1, "request %d ended %d times", id, sh[id].outcomes);
        if (sh[id].finished)
            SIM_ASSERT(sh[id].gen == sh[id].target, "request %d finished with %d of %d tokens", id,
                       sh[id].gen, sh[id].target);
        if (sh[id].finished) out.finished++;
    }
    SIM_ASSERT(st.finished == out.finished && st.cancelled == out.cancelled &&
                   st.arrivals == out.finished + out.cancelled && st.refused == out.refused &&
                   st.rejected == out.rejected,
               "scheduler counters disagree: finished %llu/%llu cancelled %llu/%llu arrivals %llu",
               (unsigned long long)st.finished, (unsigned long long)out.finished,
               (unsigned long long)st.cancelled, (unsigned long long)out.cancelled,
               (unsigned long long)st.arrivals);
    SIM_ASSERT(st.kv_blocks_used == 0 && st.running[0] + st.running[1] == 0 &&
                   st.waiting[0] + st.waiting[1] == 0,
               "leftovers: kv %d running %d waiting %d", st.kv_blocks_used, st.running[0] + st.running[1],
               st.waiting[0] + st.waiting[1]);
    out.preemptions = st.preemptions;
    out.throttled = st.spec_throttled;
    out.budget_cut = st.budget_cut;
    out.budget_over = st.budget_over;
    g_sim_cost = NULL;
    out.prefix_hits = st.prefix_hits;
    out.prefix_queries = st.prefix_queries;
    free(g_streams), free(g_content);
    g_streams = g_content = NULL;
    duet__sched_free(s);
    free(sh);
    free(arrival_at);
    free(live);
    return out;
}

static sim_cfg sim_tight_kv(uint64_t seed) {
    sim_cfg c = {
        .seed = seed,
        .n_arrivals = 3000,
        .c = {.max_seqs = 8,
              .max_tokens = 128,
              .max_waiting = 32,
              .n_ctx = 256,
              .kv_block_size = 16,
              .kv_blocks = 24,
              .knobs = {.max_batch_seqs = 8,
                        .max_batch_tokens = 128,
                        .prefill_chunk = 32,
                        .max_waiting = 32,
                        .batch_timeout_ns = 2 * MS}},
        .max_prompt = 200,
        .max_new = 80,
        .mean_gap_ms = 20,
        .cancel_prob = 0.02,
        .fail_prob = 0.005,
        .retune = false,
    };
    return c;
}

START_TEST(test_sim_tight_kv) {
    sim_cfg c = sim_tight_kv(1 + (uint64_t)_i);
    sim_out o = run_sim(&c);
    fprintf(stderr,
            "sim tight kv seed %d: steps %llu tokens %llu finished %llu cancelled %llu refused %llu rejected "
            "%llu "
            "preemptions %llu\n",
            _i + 1, (unsigned long long)o.steps, (unsigned long long)o.tokens, (unsigned long long)o.finished,
            (unsigned long long)o.cancelled, (unsigned long long)o.refused, (unsigned long long)o.rejected,
            (unsigned long long)o.preemptions);
    ck_assert_msg(o.preemptions > 0, "the tight pool must force preemptions (else the test proves little)");
    ck_assert_msg(o.finished > 1000, "most requests finish (%llu)", (unsigned long long)o.finished);
    ck_assert_msg(o.rejected > 0, "some requests are too long for n_ctx");
}
END_TEST

START_TEST(test_sim_retuned_knobs) {
    sim_cfg c = sim_tight_kv(100 + (uint64_t)_i);
    c.retune = true;
    c.cancel_prob = 0.05;
    c.c.max_seqs = 16;
    c.c.knobs.max_batch_seqs = 16;
    c.mean_gap_ms = 8;
    sim_out o = run_sim(&c);
    fprintf(stderr,
            "sim retuned seed %d: steps %llu finished %llu cancelled %llu refused %llu preemptions %llu\n",
            _i + 100, (unsigned long long)o.steps, (unsigned long long)o.finished,
            (unsigned long long)o.cancelled, (unsigned long long)o.refused,
            (unsigned long long)o.preemptions);
    ck_assert_msg(o.refused > 0, "overload with a retuned queue limit must refuse some arrivals");
}
END_TEST

START_TEST(test_sim_step_budget) {
    /* Step budgets (retuned at random) with the prefill chunks they cut,
     * under preemption, cancels, failures and speculation. */
    sim_cfg c = sim_tight_kv(300 + (uint64_t)_i);
    c.timed = true;
    c.retune = _i == 1;
    c.spec_prob = 0.3;
    c.c.max_tokens = 256;
    c.c.knobs.max_batch_tokens = 256, c.c.knobs.prefill_chunk = 64, c.c.knobs.spec_max_batch = 4;
    c.c.knobs.step_budget_ns[0] = 4 * MS, c.c.knobs.step_budget_ns[1] = 6 * MS;
    sim_out o = run_sim(&c);
    fprintf(stderr, "sim step budget seed %d: steps %llu finished %llu preemptions %llu cut %llu over %llu\n",
            _i + 300, (unsigned long long)o.steps, (unsigned long long)o.finished,
            (unsigned long long)o.preemptions, (unsigned long long)o.budget_cut,
            (unsigned long long)o.budget_over);
    ck_assert_msg(o.budget_cut > 100, "the budget must cut chunks (else the test proves little)");
    ck_assert_msg(o.finished > 1000, "most requests finish (%llu)", (unsigned long long)o.finished);
}
END_TEST

START_TEST(test_sim_tiny_pool) {
    sim_cfg c = {
        .seed = 77,
        .n_arrivals = 4000,
        .c = {.max_seqs = 3,
              .max_tokens = 8,
              .max_waiting = 8,
              .n_ctx = 40,
              .kv_block_size = 4,
              .kv_blocks = 10,
              .knobs = {.max_batch_seqs = 3,
                        .max_batch_tokens = 8,
                        .prefill_chunk = 3,
                        .max_waiting = 8,
                        .batch_timeout_ns = 0}},
        .max_prompt = 30,
        .max_new = 12,
        .mean_gap_ms = 10,
        .cancel_prob = 0.03,
        .fail_prob = 0.01,
    };
    sim_out o = run_sim(&c);
    fprintf(stderr, "sim tiny pool: steps %llu finished %llu cancelled %llu refused %llu preemptions %llu\n",
            (unsigned long long)o.steps, (unsigned long long)o.finished, (unsigned long long)o.cancelled,
            (unsigned long long)o.refused, (unsigned long long)o.preemptions);
    ck_assert(o.preemptions > 0);
}
END_TEST

START_TEST(test_sim_prefix_cache) {
    /* Shared prefixes under a tight pool, cancels, failed steps and (on the
     * second seed) retuned knobs: shared blocks always hold the right
     * tokens, no shared block is written, and the pool is whole at the end. */
    sim_cfg c = sim_tight_kv(500 + (uint64_t)_i);
    c.n_prefixes = 3;
    c.c.kv_blocks = 40;
    c.retune = _i == 1;
    sim_out o = run_sim(&c);
    fprintf(stderr,
            "sim prefix seed %d: steps %llu finished %llu cancelled %llu preemptions %llu hits %llu/%llu\n",
            _i + 500, (unsigned long long)o.steps, (unsigned long long)o.finished,
            (unsigned long long)o.cancelled, (unsigned long long)o.preemptions,
            (unsigned long long)o.prefix_hits, (unsigned long long)o.prefix_queries);
    ck_assert_msg(o.preemptions > 0, "the pool must force preemptions");
    ck_assert_msg(o.prefix_hits > o.prefix_queries / 10, "shared prefixes must hit (%llu of %llu)",
                  (unsigned long long)o.prefix_hits, (unsigned long long)o.prefix_queries);
}
END_TEST

/* Speculation in the tight-pool simulation: drafts with random acceptance,
 * preemptions and cancellations in the middle of speculative steps, the
 * throttle engaged at times; invariants (KV blocks conserved, counts) at
 * every event and nothing left at the end. */
START_TEST(test_sim_speculative) {
    sim_cfg c = sim_tight_kv(300 + (uint64_t)_i);
    c.spec_prob = 0.8;
    c.c.knobs.spec_max_batch = 2;
    c.retune = _i == 1;
    sim_out o = run_sim(&c);
    fprintf(stderr,
            "sim speculative seed %d: steps %llu finished %llu cancelled %llu preemptions %llu drafts %llu "
            "kept %llu "
            "throttled %llu\n",
            _i + 300, (unsigned long long)o.steps, (unsigned long long)o.finished,
            (unsigned long long)o.cancelled, (unsigned long long)o.preemptions, (unsigned long long)o.drafts,
            (unsigned long long)o.kept, (unsigned long long)o.throttled);
    ck_assert_msg(o.drafts > 1000 && o.preemptions > 0 && o.cancelled > 0 && o.throttled > 0,
                  "the simulation must exercise drafts, preemption, cancellation and the throttle");
}
END_TEST

START_TEST(test_sim_is_deterministic) {
    sim_cfg c = sim_tight_kv(4242);
    c.n_arrivals = 1000;
    c.retune = true;
    sim_out a = run_sim(&c);
    sim_out b = run_sim(&c);
    ck_assert_msg(a.trace_hash == b.trace_hash && a.steps == b.steps,
                  "same events, same plans (hash %llx vs %llx)", (unsigned long long)a.trace_hash,
                  (unsigned long long)b.trace_hash);
}
END_TEST

static Suite *suite(void) {
    Suite *s = suite_create("scheduler");
    TCase *tc = tcase_create("policies");
    tcase_add_test(tc, test_single_request_lifecycle);
    tcase_add_test(tc, test_fifo_within_class);
    tcase_add_test(tc, test_interactive_before_batch);
    tcase_add_test(tc, test_batch_timeout_waits_then_starts);
    tcase_add_test(tc, test_batch_timeout_starts_early_when_full);
    tcase_add_test(tc, test_chunked_prefill_mixed_with_decodes);
    tcase_add_test(tc, test_budget_keeps_decode_steps_short);
    tcase_add_test(tc, test_budget_full_chunks_without_decodes);
    tcase_add_test(tc, test_budget_by_class_and_starvation);
    tcase_add_test(tc, test_budget_admission_waits_for_time);
    tcase_add_test(tc, test_continuous_batching_reuses_slot);
    tcase_add_test(tc, test_interactive_preempts_batch_and_batch_resumes);
    tcase_add_test(tc, test_decode_growth_preempts_youngest);
    tcase_add_test(tc, test_batch_never_preempts_interactive);
    tcase_add_test(tc, test_chunk_shrinks_rather_than_preempting_own_class);
    tcase_add_test(tc, test_interactive_chunk_preempts_batch);
    tcase_add_test(tc, test_cancel_in_every_state);
    tcase_add_test(tc, test_queue_full_refuses);
    tcase_add_test(tc, test_rejects_what_can_never_fit);
    tcase_add_test(tc, test_knobs_validated_and_applied);
    tcase_add_test(tc, test_step_done_validates_results);
    tcase_add_test(tc, test_step_failed_keeps_state);
    tcase_add_test(tc, test_prefix_cache_shares_prompt_blocks);
    tcase_add_test(tc, test_prefix_admission_needs_only_missing_blocks);
    tcase_add_test(tc, test_prefix_survives_preemption_and_cancel);
    tcase_add_test(tc, test_spec_drafts_and_rollback);
    tcase_add_test(tc, test_spec_throttle_budget_and_blocks);
    tcase_add_test(tc, test_spec_cancel_and_preempt);
    tcase_add_test(tc, test_spec_measured_decision);
    tcase_add_test(tc, test_spec_refusal_recovers);
    suite_add_tcase(s, tc);
    TCase *sim = tcase_create("simulation");
    tcase_set_timeout(sim, 600);
    tcase_add_loop_test(sim, test_sim_tight_kv, 0, 3);
    tcase_add_loop_test(sim, test_sim_retuned_knobs, 0, 2);
    tcase_add_test(sim, test_sim_tiny_pool);
    tcase_add_loop_test(sim, test_sim_step_budget, 0, 2);
    tcase_add_loop_test(sim, test_sim_speculative, 0, 2);
    tcase_add_test(sim, test_sim_is_deterministic);
    tcase_add_loop_test(sim, test_sim_prefix_cache, 0, 2);
    suite_add_tcase(s, sim);
    return s;
}

int main(void) {
    return test_run_suite(suite());
}
