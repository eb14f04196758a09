/* sampler.h — turns a row of logits into a token.
 *
 * Order: penalties (repetition, presence, frequency over the recent window)
 * -> greedy if temperature <= 0 -> top-k -> temperature -> softmax -> top-p
 * -> min-p -> draw with the sampler's own RNG (seeded: same seed and same
 * settings give the same tokens). The draw takes u uniform in [0, 1) from
 * the RNG and returns the first kept token, in ascending id order, whose
 * cumulative weight exceeds u times the kept total. A sampler belongs to
 * one sequence and is used by one thread at a time. Nothing is allocated
 * per token.
 *
 * Seed: duet_sampling.seed is used verbatim (splitmix64 expands it into the
 * state of a xoshiro256** generator), so a given seed always gives the same
 * tokens for the same logits; callers that want fresh randomness per run
 * pass a seed taken from the clock or the OS themselves.
 *
 * Penalties act on the last penalty_last_n accepted tokens (0 = all of
 * them), once per distinct token t with count c in that window:
 * repetition (x > 0 ? x / r : x * r), then x -= c * frequency + presence.
 *
 * Non-finite logits: NaN and -inf are never sampled; +inf counts as FLT_MAX.
 * If no logit is finite, the result is duet_argmax(logits).
 */
#ifndef DUET_SAMPLER_H
#define DUET_SAMPLER_H

#include <stdint.h>

#include "duet.h"
#include "grammar.h"

typedef struct duet_sampler duet_sampler;

/* Validates the settings (DUET_INVALID_ARGUMENT with a message for NaN,
 * negative temperature, top_p outside (0,1], min_p outside [0,1], ...). */
duet_status duet_sampler_new(const duet_sampling *s, int n_vocab, duet_sampler **out);
void duet_sampler_free(duet_sampler *smp);

/* Samples from logits[n_vocab]; `logits` may be modified in place. */
int32_t duet_sampler_sample(duet_sampler *smp, float *logits);
/* Records a token (prompt or generated) for the penalties; an id outside
 * [0, n_vocab) is ignored. */
void duet_sampler_accept(duet_sampler *smp, int32_t token);
/* Forgets the accepted tokens and reseeds the RNG: the sampler behaves as
 * if it had just been created. */
void duet_sampler_reset(duet_sampler *smp);

/* The distribution duet_sampler_sample draws from (for speculative decoding
 * and tests): applies the penalties to `logits` in place, then writes the
 * tokens that survive truncation to ids[] and their renormalised
 * probabilities to probs[] (both must hold n_vocab entries) and returns how
 * many there are (>= 1). Greedy settings give the argmax with probability 1.
 * ids[] ascend. Does not advance the RNG. */
int duet_sampler_dist(duet_sampler *smp, float *logits, int32_t *ids, float *probs);

/* One uniform number in [0, 1) from the sampler's RNG (the stream its
 * draws use): speculative verification draws its accept/reject decisions
 * and residual draws here, so a seeded sequence stays reproducible. */
double duet_sampler_uniform(duet_sampler *smp);

/* Constrains the tokens drawn from here on to those the grammar accepts
 * (core/grammar.h), end-of-generation tokens only where its sentence is
 * whole; duet_sampler_accept advances it (call this after accepting the
 * prompt). Takes `g` (freed with the sampler, also on failure); `voc`
 * must outlive the sampler. duet_sampler_dist ignores the grammar. */
duet_status duet_sampler_set_grammar(duet_sampler *smp, duet_grammar *g, const duet_vocab *voc);
/* The mask is computed only when a first draw is refused (see sampler.c);
 * DUET_GRAMMAR_EAGER=1 in the environment computes it before every draw
 * instead, to measure what it costs. */
/* Whether a grammar constrains this sampler's draws. */
bool duet_sampler_has_grammar(const duet_sampler *smp);
/* Whether the grammar is closed after the accepted tokens (nothing may follow). */
bool duet_sampler_grammar_done(const duet_sampler *smp);

/* Log-softmax of the raw logits[n] (no penalties, temperature or
 * truncation): returns log p(token) and writes the k (<= n) most likely
 * tokens, best first (ties: lower id first), to top[]. NaN counts as -inf. */
float duet_logprobs(const float *logits, int n, int32_t token, int k, duet_token_logprob *top);

/* Argmax with the lowest index winning ties (what greedy uses). */
int32_t duet_argmax(const float *x, int n);

#endif /* DUET_SAMPLER_H */
