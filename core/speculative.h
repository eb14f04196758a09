/* speculative.h — the pure pieces of speculative decoding: a drafter that
 * proposes tokens without a model (n-gram / prompt lookup) and the
 * verifier that turns a drafted position's target logits into the token
 * the sequence keeps.
 *
 * A speculative step: the drafter proposes d[0..k); the target evaluates
 * the sequence's newest token and d[0..k) in one forward pass, which gives
 * k + 1 logit rows. Row j is the target's distribution for the position
 * that d[j] would fill. The caller walks the rows in order:
 *
 *     for (j = 0; j < k; j++) {
 *         t = duet__spec_verify(v, smp, row[j], d[j], q_j..., &accepted);
 *         duet_sampler_accept(smp, t); emit t;
 *         if (!accepted || the sequence finished) break;
 *     }
 *     if (all k accepted and not finished) t = duet_sampler_sample(smp, row[k]);  // the bonus token
 *
 * so the penalties at row j see exactly the tokens before it, as they
 * would without speculation. Rows after the first rejection are discarded
 * (their KV entries roll back: the caller shortens the sequence).
 *
 * Lossless: with greedy settings the kept tokens are the target's argmax
 * at every position (identical to decoding without speculation when the
 * logits are). Otherwise this is rejection sampling (Leviathan et al. 2023,
 * Chen et al. 2023): the draft token x is kept with probability
 * min(1, p(x) / q(x)); on rejection the token is drawn from the normalised
 * residual max(0, p - q). p is the distribution the sampler itself draws
 * from (duet_sampler_dist: penalties, temperature, top-k, top-p, min-p) and
 * q must be the draft's distribution after the same transformation; a
 * deterministic drafter (n-gram) has q = one-hot(x), which makes the rule
 * "keep x with probability p(x), else draw from p without x". The output
 * distribution then equals the target's. Random numbers come from the
 * sequence's sampler (duet_sampler_uniform), drawn only when the outcome
 * is not already certain, so seeded runs are reproducible and greedy runs
 * draw nothing.
 *
 * A sequence with a grammar is not speculated (its constraint acts on
 * draws, not on the distribution duet_sampler_dist returns).
 */
#ifndef DUET_SPECULATIVE_H
#define DUET_SPECULATIVE_H

#include <stdbool.h>
#include <stdint.h>

#include "duet.h"
#include "sampler.h"

/* Draft tokens one step may propose per sequence, at most. */
#define DUET_SPEC_MAX_K 16
/* n-gram drafter: the longest and shortest suffix it looks up (a single
 * token matches too often by chance: its drafts were mostly rejected). */
#define DUET_SPEC_NGRAM_MAX 3
#define DUET_SPEC_NGRAM_MIN 2

/* The default of duet_open_params.spec_k. */
#define DUET_SPEC_DEFAULT_K 8

typedef enum duet_spec_mode { DUET_SPEC_OFF = 0, DUET_SPEC_NGRAM, DUET_SPEC_DRAFT } duet_spec_mode;

/* Reads duet_open_params' spec, spec_k and draft: *mode (spec "ngram", or
 * a draft model) and *k (1..DUET_SPEC_MAX_K). DUET_INVALID_ARGUMENT with a
 * message naming the accepted values otherwise. */
duet_status duet__spec_params(const duet_open_params *p, duet_spec_mode *mode, int *k);

/* Proposes up to k tokens to follow tokens[0..n): for m from n_max down to
 * n_min, finds the latest earlier occurrence of the last m tokens and
 * copies what followed it (an overlapping copy, as in LZ77: a repeating
 * run continues periodically). Returns the number proposed, 0 when no
 * suffix of length >= n_min occurs earlier (or k <= 0, n < 2). O(n * n_max). */
int duet__spec_ngram(const int32_t *tokens, int n, int n_min, int n_max, int k, int32_t *draft);

/* Draft models. The draft samples with the request's settings without its
 * penalties (q need not match p for the output to be the target's; a
 * closer q is kept more often), from a seed of its own. */
duet_sampling duet__spec_draft_sampling(const duet_sampling *request);

/* Draws a draft token from a draft model's logits row (modified in place).
 * With `dsmp` and room for q (ids, probs: n_vocab each), the token is drawn
 * from q = duet_sampler_dist(dsmp), which lands in ids/probs with *n_q its
 * size, as duet__spec_verify takes it. Otherwise (greedy requests, or no
 * room) it is the argmax and *n_q = 0: a deterministic drafter, whose q is
 * one-hot, verified exactly as such. */
int32_t duet__spec_draw(duet_sampler *dsmp, float *logits, int n_vocab, int32_t *ids, float *probs, int *n_q);

/* Scratch for verification, sized for one vocabulary (allocated once;
 * nothing is allocated per token). One thread at a time. */
typedef struct duet_spec_verifier duet_spec_verifier;

duet_status duet__spec_verifier_new(int n_vocab, duet_spec_verifier **out);
void duet__spec_verifier_free(duet_spec_verifier *v);

/* Verifies one drafted position. `logits` is the target's row (modified in
 * place); `draft` the proposed token; q_ids[0..n_q) / q_probs the draft's
 * distribution (ids ascending, probabilities summing to 1), or n_q = 0 for
 * a deterministic drafter (q = one-hot(draft)). Returns the token to keep:
 * the draft (*accepted = true) or a draw from the residual. Does not call
 * duet_sampler_accept. */
int32_t duet__spec_verify(duet_spec_verifier *v, duet_sampler *smp, float *logits, int32_t draft,
                          const int32_t *q_ids, const float *q_probs, int n_q, bool *accepted);

/* For tests only: a verifier that, on rejection, draws from p instead of
 * the residual max(0, p - q) (a classic bug: it over-weights the draft's
 * tokens). The distribution test uses it to show that it can fail. */
void duet__spec_verifier_break_residual(duet_spec_verifier *v, bool broken);

/* Adaptive k of one sequence. Each drafted token is kept with some
 * probability alpha (the acceptance rate); a step that drafts k tokens
 * keeps a run of them, so it holds kept + (1 if one was rejected) trials.
 * alpha is the maximum-likelihood value over the recent trials and a
 * prior: kept over trials, both sums decayed by `decay` per trial (a memory
 * of about 50 trials), starting from the prior's pseudo-trials. A short
 * memory (an average of per-step estimates, 0.3 per trial) read a good pair
 * (98% of drafts kept) at 0.93 on average: one rejection dropped a
 * sequence to 0.7, the decision then refused it, and with no drafts nothing
 * lifted it again (bench/results/spec-draft-smollm2-xeon-2c.md). The next
 * k is the largest whose last token still has a chance alpha^k >=
 * DUET_SPEC_ADAPT_MIN_GAIN of being reached and kept: one more drafted
 * position costs a fraction of a step, and it pays only while its expected
 * gain exceeds that. */
#define DUET_SPEC_ADAPT_MIN_GAIN 0.15f
#define DUET_SPEC_ADAPT_DECAY 0.98f
/* The engine's acceptance over every sequence's drafts sees every
 * sequence's trials, up to 16 sequences' worth of 9 each in a step: a
 * memory of about 500 trials, so that one step in which its sequences
 * rejected together (the same prompt, the same near-tie) does not set every
 * new sequence's prior low. */
#define DUET_SPEC_POOL_DECAY 0.998f
/* The most pseudo-trials the population's acceptance weighs as a new
 * sequence's prior: one early rejection (6 of 8 kept) then moves a
 * sequence from the population's 0.98 to 0.95, not to 0.87 as with one
 * trial's weight, which the decision refused at 4 streams; a sequence that
 * really keeps half its drafts still falls below 0.9 within 4 steps. */
#define DUET_SPEC_PRIOR_TRIALS 32.0f
/* The weight of the first prior, 0.5 before any draft: a quarter of a
 * trial, so that the first evidence decides (one exploration keeping 8
 * drafts reads 0.985, not the 0.95 of one trial's weight, which the
 * decision refused again at 4 streams and lost a second round to). An
 * estimate with more trials than this has seen a draft. */
#define DUET_SPEC_ADAPT_PRIOR_TRIALS 0.25f

typedef struct duet_spec_adapt {
    float alpha;        /* estimated per-token acceptance, kept / trials, in [0, 1] */
    int k;              /* draft length for the next step, in [1, k_max] */
    float kept, trials; /* the decayed sums */
    float decay;        /* per trial: DUET_SPEC_ADAPT_DECAY from init; the caller may set another */
} duet_spec_adapt;

/* Starts from the prior 0.5 (DUET_SPEC_ADAPT_PRIOR_TRIALS) with k = k_max. */
void duet__spec_adapt_init(duet_spec_adapt *a, int k_max);
/* Starts over from the prior `alpha` worth `trials` (> 0) pseudo-trials: a
 * sequence that has not drafted yet takes the population's acceptance. k
 * is left as it is (the next update picks it), so a request's draft
 * lengths, and with sampling its tokens, do not depend on the requests
 * before it. */
void duet__spec_adapt_prior(duet_spec_adapt *a, float alpha, float trials);
/* After a step that drafted n_draft tokens (> 0) and kept n_accepted of
 * them: updates alpha and picks the next k in [1, k_max]. */
void duet__spec_adapt_update(duet_spec_adapt *a, int n_draft, int n_accepted, int k_max);

/* The speculation decision of one step (pure: no clock, no state). Each
 * decoding sequence with drafts on offer is a candidate; the decision
 * grants each some k in [0, offer] so that the step's predicted decode
 * throughput (expected tokens over predicted seconds) is highest, and
 * grants nothing where drafting does not pay.
 *
 * - Expected tokens: a decode yields 1; with k drafts each kept with
 *   probability alpha (independently, a run ending at the first rejection)
 *   it yields 1 + alpha + ... + alpha^k = (1 - alpha^(k+1)) / (1 - alpha).
 * - Seconds: the target's step-cost model of the step's shape (its decodes,
 *   each grown by its k verification tokens at the positions after it),
 *   plus with a draft model its own passes, predicted by the draft's
 *   step-cost model per pass: pass 0 takes each drafting sequence's
 *   steady catch-up tokens (its newest token, and the last draft after a
 *   step that kept every draft) and gives draft 0; pass j > 0 takes one
 *   token of each sequence with k > j. A pass costs its intercept once,
 *   however many sequences share it. n-gram drafts cost nothing (draft ==
 *   NULL).
 * - The backlog: a sequence that starts drafting after steps without
 *   drafts (or after its admission) first feeds the draft every token its
 *   KV missed. That is paid once and serves every later drafting step, so
 *   the step is charged the share of it that its expected tokens are of
 *   the tokens the sequence may still generate (all of it when that is not
 *   known, or fewer remain than one drafting step yields): a long stream
 *   near its end never starts drafting for a few tokens' gain.
 *
 * On a memory-bound device a verification token costs a small fraction of
 * a step, so speculation pays even at modest acceptance; on a
 * compute-bound one (a large batch on a cpu) each token costs nearly its
 * share, so it pays only at high acceptance and small batch, and turns off
 * as the batch fills. The search grows k one candidate at a time, taking
 * the move (a candidate and a new k for it, so fixed costs are paid by a
 * run of drafts together) that gives the best throughput, while that
 * improves on the current one by more than DUET_SPEC_MIN_GAIN. */
#define DUET_SPEC_MIN_GAIN 0.02

typedef struct duet_spec_cand {
    int pos;       /* position of the sequence's newest token (its decode) */
    int offer;     /* draft tokens on offer, 0..DUET_SPEC_MAX_K */
    float alpha;   /* estimated per-token acceptance, [0, 1] */
    int catchup;   /* draft model: tokens its pass 0 takes for this sequence in the steady state (1..2) */
    int backlog;   /* draft model: tokens more its KV missed (steps without drafts, an admission) */
    int remaining; /* tokens the sequence may still generate (0: unknown, the backlog charged whole) */
    int k;         /* out: draft tokens granted, 0..offer */
} duet_spec_cand;

typedef struct duet_spec_decision {
    double tokens_plain, tokens_spec;   /* expected tokens of the step without / with the grants */
    double seconds_plain, seconds_spec; /* predicted seconds: target (+ draft passes, backlogs' shares) */
    double draft_seconds;               /* the draft's passes' predicted seconds, backlogs whole */
    double alpha_mean;                  /* mean alpha of the candidates (0 without) */
    double speedup;                     /* predicted tokens/s of the best grants found over plain's
                                           (granted only when above 1 + DUET_SPEC_MIN_GAIN); 0: no model */
    int n_granted;                      /* candidates granted k > 0 */
    int tokens_offered, tokens_granted; /* draft tokens */
} duet_spec_decision;

/* Decides k for cand[0..n) in a step whose plain shape (decodes, one
 * token each, and nothing else) is `base`. `target` predicts the target's
 * step; `draft` one pass of the draft model (NULL: drafts are free). The
 * candidates' positions must be among base's decodes. */
void duet__spec_decide(const duet_step_cost *target, const duet_step_cost *draft, const duet_step_shape *base,
                       duet_spec_cand *cand, int n, duet_spec_decision *out);

#endif /* DUET_SPECULATIVE_H */
