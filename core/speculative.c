/* speculative.c — the n-gram drafter, the verifier (greedy acceptance and
 * rejection sampling) and adaptive k (see speculative.h). */
#include "speculative.h"

#include <assert.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../backends/backend.h"

duet_status duet__spec_params(const duet_open_params *p, duet_spec_mode *mode, int *k) {
    *mode = DUET_SPEC_OFF;
    *k = DUET_SPEC_DEFAULT_K;
    bool named = p->spec && strcmp(p->spec, "off") != 0 && strcmp(p->spec, "") != 0;
    if (named && strcmp(p->spec, "ngram") == 0)
        *mode = DUET_SPEC_NGRAM;
    else if (named && strcmp(p->spec, "draft") == 0)
        *mode = DUET_SPEC_DRAFT;
    else if (named)
        return duet__error(
            DUET_INVALID_ARGUMENT,
            "speculative decoding '%s' is not known (use off, ngram, or draft with a draft model)", p->spec);
    if (p->draft && *p->draft) {
        if (*mode == DUET_SPEC_NGRAM)
            return duet__error(DUET_INVALID_ARGUMENT, "spec ngram and a draft model: choose one");
        *mode = DUET_SPEC_DRAFT;
    } else if (*mode == DUET_SPEC_DRAFT) {
        return duet__error(DUET_INVALID_ARGUMENT, "spec draft needs a draft model (--draft MODEL)");
    }
    if (p->spec_k < 0 || p->spec_k > DUET_SPEC_MAX_K)
        return duet__error(DUET_INVALID_ARGUMENT, "spec_k %d out of range [1, %d] (0 = %d)", p->spec_k,
                           DUET_SPEC_MAX_K, DUET_SPEC_DEFAULT_K);
    if (p->spec_k) *k = p->spec_k;
    return DUET_OK;
}

/* ---- draft models ------------------------------------------------------------- */

duet_sampling duet__spec_draft_sampling(const duet_sampling *request) {
    duet_sampling d = *request;
    d.repetition_penalty = 1.0f;
    d.presence_penalty = d.frequency_penalty = 0.0f;
    d.seed ^= 0xD4AF7ull;
    return d;
}

int32_t duet__spec_draw(duet_sampler *dsmp, float *logits, int n_vocab, int32_t *ids, float *probs,
                        int *n_q) {
    *n_q = 0;
    if (!dsmp || !ids || !probs) return duet_argmax(logits, n_vocab);
    int n = *n_q = duet_sampler_dist(dsmp, logits, ids, probs);
    double u = duet_sampler_uniform(dsmp), cum = 0;
    for (int i = 0; i < n; i++)
        if ((cum += probs[i]) > u) return ids[i];
    return ids[n - 1];
}

/* ---- n-gram drafter --------------------------------------------------------- */

int duet__spec_ngram(const int32_t *tokens, int n, int n_min, int n_max, int k, int32_t *draft) {
    if (k <= 0 || n < 2 || n_min < 1) return 0;
    if (n_max > n - 1) n_max = n - 1;
    for (int m = n_max; m >= n_min; m--) {
        const int32_t *suffix = tokens + n - m;
        /* Latest start i with tokens[i..i+m) == suffix and i + m < n (at
         * least one token follows the occurrence). */
        for (int i = n - m - 1; i >= 0; i--) {
            if (tokens[i + m - 1] != suffix[m - 1] || memcmp(tokens + i, suffix, (size_t)m * sizeof *tokens))
                continue;
            /* Copy what followed; past the end the copy reads its own
             * output, so a repeating run continues periodically. */
            for (int j = 0; j < k; j++) {
                int src = i + m + j;
                draft[j] = src < n ? tokens[src] : draft[src - n];
            }
            return k;
        }
    }
    return 0;
}

/* ---- verifier ----------------------------------------------------------------- */

struct duet_spec_verifier {
    int n_vocab;
    int32_t *ids; /* [n_vocab] p's support, ascending */
    float *probs; /* [n_vocab] p over it */
    float *res;   /* [n_vocab] the residual max(0, p - q) over it */
    float *qd;    /* [n_vocab] q by id (dense), all zero between calls */
    bool broken;  /* tests: draw from p on rejection */
};

duet_status duet__spec_verifier_new(int n_vocab, duet_spec_verifier **out) {
    *out = NULL;
    if (n_vocab < 1)
        return duet__error(DUET_INVALID_ARGUMENT, "speculative: n_vocab must be >= 1 (got %d)", n_vocab);
    duet_spec_verifier *v = calloc(1, sizeof *v);
    if (!v) return duet__error(DUET_OUT_OF_MEMORY, "speculative: out of memory");
    v->n_vocab = n_vocab;
    v->ids = malloc((size_t)n_vocab * sizeof *v->ids);
    v->probs = malloc((size_t)n_vocab * sizeof *v->probs);
    v->res = malloc((size_t)n_vocab * sizeof *v->res);
    v->qd = calloc((size_t)n_vocab, sizeof *v->qd);
    if (!v->ids || !v->probs || !v->res || !v->qd) {
        duet__spec_verifier_free(v);
        return duet__error(DUET_OUT_OF_MEMORY, "speculative: out of memory for n_vocab=%d", n_vocab);
    }
    *out = v;
    return DUET_OK;
}

void duet__spec_verifier_free(duet_spec_verifier *v) {
    if (!v) return;
    free(v->ids);
    free(v->probs);
    free(v->res);
    free(v->qd);
    free(v);
}

void duet__spec_verifier_break_residual(duet_spec_verifier *v, bool broken) {
    v->broken = broken;
}

/* p(token) over the support ids[0..n) (ascending): binary search. */
static float prob_of(const int32_t *ids, const float *probs, int n, int32_t token) {
    int lo = 0, hi = n;
    while (lo < hi) {
        int mid = lo + (hi - lo) / 2;
        if (ids[mid] < token)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < n && ids[lo] == token ? probs[lo] : 0.0f;
}

/* Draws from weights w[0..n) over ids (not necessarily normalised), in id
 * order, like the sampler's own draw; the RNG is used only when more than
 * one token has mass. Returns -1 when no weight is positive. */
static int32_t draw(duet_sampler *smp, const int32_t *ids, const float *w, int n) {
    double total = 0.0;
    int with_mass = 0, last = -1;
    for (int i = 0; i < n; i++)
        if (w[i] > 0.0f) {
            total += w[i];
            with_mass++;
            last = i;
        }
    if (with_mass == 0) return -1;
    if (with_mass == 1) return ids[last];
    double r = duet_sampler_uniform(smp) * total, cum = 0.0;
    for (int i = 0; i < n; i++) {
        if (w[i] <= 0.0f) continue;
        cum += w[i];
        if (cum > r) return ids[i];
    }
    return ids[last]; /* rounding left r at the very top */
}

int32_t duet__spec_verify(duet_spec_verifier *v, duet_sampler *smp, float *logits, int32_t draft,
                          const int32_t *q_ids, const float *q_probs, int n_q, bool *accepted) {
    assert(v && smp && logits && accepted && n_q >= 0 && (n_q == 0 || (q_ids && q_probs)));
    int n = duet_sampler_dist(smp, logits, v->ids, v->probs);
    float p = draft >= 0 && draft < v->n_vocab ? prob_of(v->ids, v->probs, n, draft) : 0.0f;
    /* q(x): a deterministic drafter, or a draft token outside its own
     * distribution (it cannot have been drawn from q), counts as one-hot. */
    float q = n_q > 0 && draft >= 0 && draft < v->n_vocab ? prob_of(q_ids, q_probs, n_q, draft) : 0.0f;
    bool one_hot = !(q > 0.0f);
    if (one_hot) q = 1.0f;

    /* Keep x with probability min(1, p / q); draw only when it is not certain. */
    double ratio = (double)p / (double)q;
    bool keep = ratio >= 1.0 || (ratio > 0.0 && duet_sampler_uniform(smp) < ratio);
    *accepted = keep;
    if (keep) return draft;

    /* Rejected: the residual max(0, p - q), over p's support (q's mass
     * elsewhere does not matter: p is 0 there). */
    memcpy(v->res, v->probs, (size_t)n * sizeof *v->res);
    if (!v->broken) {
        if (one_hot) {
            for (int i = 0; i < n; i++)
                if (v->ids[i] == draft) v->res[i] = 0.0f;
        } else {
            for (int i = 0; i < n_q; i++)
                v->qd[q_ids[i]] = q_probs[i];
            for (int i = 0; i < n; i++) {
                float r = v->probs[i] - v->qd[v->ids[i]];
                v->res[i] = r > 0.0f ? r : 0.0f;
            }
            for (int i = 0; i < n_q; i++)
                v->qd[q_ids[i]] = 0.0f;
        }
    }
    int32_t t = draw(smp, v->ids, v->res, n);
    if (t >= 0) return t;
    /* p == q up to rounding (then rejection had probability ~0): draw from p. */
    t = draw(smp, v->ids, v->probs, n);
    return t >= 0 ? t : v->ids[0];
}

/* ---- adaptive k ----------------------------------------------------------------- */

/* The k whose last token is still reached and kept with a chance >= DUET_SPEC_ADAPT_MIN_GAIN. */
static void adapt_pick_k(duet_spec_adapt *a, int k_max) {
    if (k_max < 1) k_max = 1;
    int k;
    if (a->alpha >= 0.999f)
        k = k_max;
    else if (a->alpha <= 0.0f)
        k = 1;
    else
        k = (int)floorf(logf(DUET_SPEC_ADAPT_MIN_GAIN) / logf(a->alpha));
    a->k = k < 1 ? 1 : k > k_max ? k_max : k;
}

void duet__spec_adapt_prior(duet_spec_adapt *a, float alpha, float trials) {
    a->alpha = alpha > 1 ? 1 : alpha > 0 ? alpha : 0;
    a->trials = trials > 0 ? trials : 1;
    a->kept = a->alpha * a->trials;
}

void duet__spec_adapt_init(duet_spec_adapt *a, int k_max) {
    duet__spec_adapt_prior(a, 0.5f, DUET_SPEC_ADAPT_PRIOR_TRIALS);
    a->decay = DUET_SPEC_ADAPT_DECAY;
    a->k = k_max < 1 ? 1 : k_max; /* unknown acceptance: offer the most */
}

void duet__spec_adapt_update(duet_spec_adapt *a, int n_draft, int n_accepted, int k_max) {
    if (n_draft > 0) {
        int trials = n_accepted + (n_accepted < n_draft ? 1 : 0);
        float decay = powf(a->decay, (float)trials);
        a->kept = a->kept * decay + (float)n_accepted;
        a->trials = a->trials * decay + (float)trials;
        if (a->trials > 0) a->alpha = a->kept / a->trials;
    }
    adapt_pick_k(a, k_max);
}

/* ---- the speculation decision ------------------------------------------------------ */

/* The linear step-cost model's seconds for a shape (0 for an empty pass). */
static double pass_seconds(const duet_step_cost *m, const duet_step_shape *s) {
    return s->n_decode + s->n_prefill > 0 ? duet_step_cost_predict(m, s) : 0;
}

/* alpha^(a+1) + ... + alpha^b: the tokens drafts a..b-1 add to a decode's expectation. */
static double run_gain(float alpha, int a, int b) {
    double g = 0, p = pow((double)alpha, a + 1);
    for (int m = a + 1; m <= b; m++, p *= alpha)
        g += p;
    return g;
}

/* The draft's passes (pass j: the tokens it takes) with candidate c at k. */
static void add_passes(duet_step_shape *pass, const duet_spec_cand *c, int a, int b) {
    if (a == 0 && b > 0) duet_step_shape_add(&pass[0], c->pos - c->catchup + 1, c->catchup, true);
    for (int j = a > 1 ? a : 1; j < b; j++)
        duet_step_shape_add(&pass[j], c->pos + j, 1, true);
}

/* The share of c's backlog this step pays when c starts drafting
 * (speculative.h): the backlog's own seconds (what it adds to a pass of
 * the steady catch-up) times the step's expected tokens over those the
 * sequence may still generate. */
static double backlog_seconds(const duet_step_cost *draft, const duet_spec_cand *c, bool whole) {
    if (!draft || c->backlog <= 0) return 0;
    duet_step_shape steady = {0}, all = {0};
    duet_step_shape_add(&steady, c->pos - c->catchup + 1, c->catchup, true);
    duet_step_shape_add(&all, c->pos - c->catchup - c->backlog + 1, c->catchup + c->backlog, true);
    double s = pass_seconds(draft, &all) - pass_seconds(draft, &steady);
    double yield = 1 + run_gain(c->alpha, 0, c->offer);
    double share = !whole && c->remaining > 0 && yield < c->remaining ? yield / c->remaining : 1;
    return s > 0 ? s * share : 0;
}

/* Seconds the target's step and the draft's passes gain when c goes from a to b drafts. */
static double move_seconds(const duet_step_cost *target, const duet_step_cost *draft,
                           const duet_step_shape *pass, const duet_spec_cand *c, int a, int b) {
    duet_step_shape v = {0};
    duet_step_shape_add(&v, c->pos + 1 + a, b - a, true);
    double t = duet_step_cost_predict(target, &v) - target->coef[0];
    if (!draft) return t;
    if (a == 0) t += backlog_seconds(draft, c, false);
    duet_step_shape p[DUET_SPEC_MAX_K];
    memcpy(p, pass, sizeof p);
    add_passes(p, c, a, b);
    for (int j = 0; j < b; j++)
        t += pass_seconds(draft, &p[j]) - pass_seconds(draft, &pass[j]);
    return t;
}

void duet__spec_decide(const duet_step_cost *target, const duet_step_cost *draft, const duet_step_shape *base,
                       duet_spec_cand *cand, int n, duet_spec_decision *out) {
    memset(out, 0, sizeof *out);
    duet_step_shape pass[DUET_SPEC_MAX_K];
    memset(pass, 0, sizeof pass);
    double E = base->n_decode, T = duet_step_cost_predict(target, base), D = 0;
    out->tokens_plain = E, out->seconds_plain = T;
    for (int i = 0; i < n; i++) {
        duet_spec_cand *c = &cand[i];
        c->k = 0;
        if (c->offer > DUET_SPEC_MAX_K) c->offer = DUET_SPEC_MAX_K;
        if (c->offer < 0) c->offer = 0;
        if (c->catchup < 1) c->catchup = 1;
        if (c->backlog > c->pos - c->catchup + 1) c->backlog = c->pos - c->catchup + 1;
        if (c->backlog < 0) c->backlog = 0;
        c->alpha = c->alpha > 1 ? 1 : c->alpha > 0 ? c->alpha : 0;
        out->tokens_offered += c->offer;
        out->alpha_mean += c->alpha / n;
    }
    if (!(T > 0) || E < 1) return; /* no model: nothing to weigh */
    for (;;) {
        /* The best single move: one candidate from k to b (b - k drafts at once). */
        double best = E / T, bE = 0, bT = 0;
        int bi = -1, bb = 0;
        for (int i = 0; i < n; i++) {
            const duet_spec_cand *c = &cand[i];
            for (int b = c->k + 1; b <= c->offer; b++) {
                double dE = run_gain(c->alpha, c->k, b), dT = move_seconds(target, draft, pass, c, c->k, b);
                if ((E + dE) / (T + dT) > best) best = (E + dE) / (T + dT), bE = dE, bT = dT, bi = i, bb = b;
            }
        }
        /* Or every candidate below b up to b together (a pass's fixed cost
         * may pay only when shared). */
        int gb = 0;
        for (int b = 1; draft && b <= DUET_SPEC_MAX_K; b++) {
            double dE = 0, dT = 0;
            duet_step_shape p[DUET_SPEC_MAX_K];
            memcpy(p, pass, sizeof p);
            int moved = 0;
            for (int i = 0; i < n; i++) {
                const duet_spec_cand *c = &cand[i];
                int to = b < c->offer ? b : c->offer;
                if (to <= c->k) continue;
                duet_step_shape v = {0};
                duet_step_shape_add(&v, c->pos + 1 + c->k, to - c->k, true);
                dT += duet_step_cost_predict(target, &v) - target->coef[0];
                if (c->k == 0) dT += backlog_seconds(draft, c, false);
                dE += run_gain(c->alpha, c->k, to);
                add_passes(p, c, c->k, to);
                moved++;
            }
            if (moved < 2) continue;
            for (int j = 0; j < DUET_SPEC_MAX_K; j++)
                dT += pass_seconds(draft, &p[j]) - pass_seconds(draft, &pass[j]);
            if ((E + dE) / (T + dT) > best) best = (E + dE) / (T + dT), bE = dE, bT = dT, gb = b, bi = -1;
        }
        if (bi < 0 && gb == 0) break;
        for (int i = 0; i < n; i++) {
            duet_spec_cand *c = &cand[i];
            int to = gb ? (gb < c->offer ? gb : c->offer) : i == bi ? bb : c->k;
            if (to <= c->k) continue;
            if (draft) add_passes(pass, c, c->k, to);
            c->k = to;
        }
        E += bE, T += bT;
    }
    for (int j = 0; draft && j < DUET_SPEC_MAX_K; j++)
        D += pass_seconds(draft, &pass[j]);
    for (int i = 0; i < n; i++) /* the time the passes will take: every backlog whole */
        D += cand[i].k > 0 ? backlog_seconds(draft, &cand[i], true) : 0;
    out->speedup = E / T / (out->tokens_plain / out->seconds_plain);
    /* Worth it only by a margin over the model's error. */
    if (out->speedup <= 1 + DUET_SPEC_MIN_GAIN) {
        for (int i = 0; i < n; i++)
            cand[i].k = 0;
        return;
    }
    out->tokens_spec = E, out->seconds_spec = T, out->draft_seconds = D;
    for (int i = 0; i < n; i++) {
        out->n_granted += cand[i].k > 0;
        out->tokens_granted += cand[i].k;
    }
}
