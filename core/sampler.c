/* sampler.c — logits -> token: penalties, truncation, seeded draw.
 *
 * Per token the work is one O(n_vocab) pass plus the truncation that is
 * switched on: top-k keeps a heap of the k best during that pass
 * (quickselect for k > HEAP_MAX_K); top-p bins the candidates by
 * log-probability and orders only the bin where the nucleus ends; min-p is
 * a filter. No full sort of the vocabulary ever happens. Nothing is
 * allocated per token: every buffer is sized in duet_sampler_new.
 *
 * Determinism: the RNG is integer-only (xoshiro256** seeded by splitmix64),
 * candidates are ordered by (logit descending, id ascending) so every
 * selection and sort has one answer whatever qsort's stability, the draw
 * walks the kept tokens in id order, and sums run in double precision. The
 * one platform-dependent step is libm's expf: a different libm can move a
 * probability by an ulp, which changes a token only when the draw lands
 * within that distance of a boundary.
 */
#include "sampler.h"

#include <assert.h>
#include <float.h>
#include <math.h>
#include <stdbool.h>
#include <string.h>
#include <stdlib.h>

#include "../backends/backend.h"
#include "grammar.h"

/* Largest top_k served by the one-pass heap; above it, quickselect. */
#define HEAP_MAX_K 1024
/* top-p bins: TOPP_BINS_PER_NAT per unit of -log p, so they cover [0, 32);
 * the last bin also takes everything below. */
#define TOPP_BINS 1024
#define TOPP_BINS_PER_NAT 32.0f

typedef struct cand {
    float x;    /* logit after penalties; finite */
    float p;    /* exp((x - max) / T), unnormalised */
    int32_t id; /* token */
} cand;

struct duet_sampler {
    duet_sampling s;
    int n_vocab;
    uint64_t rng[4]; /* xoshiro256** state */

    /* Penalty window: the last `cap` accepted tokens (cap 0 = unbounded, no
     * ring). count[t] is how often t occurs in the window; distinct[] lists
     * the tokens with count > 0 and where[t] is t's slot in it, so removal
     * is O(1) and applying penalties costs O(distinct) <= O(window). */
    int32_t *ring;
    int cap, len, head; /* head: slot of the oldest token */
    int32_t *count;
    int32_t *distinct;
    int32_t *where;
    int n_distinct;

    cand *c;                /* n_vocab candidates (scratch) */
    float *pv;              /* n_vocab probabilities by id (scratch) */
    double mass[TOPP_BINS]; /* top-p: probability mass per bin */

    /* The constraint (duet_sampler_set_grammar), or NULL. */
    duet_grammar *g;
    duet_grammar_state *gs;
    const duet_vocab *voc;
    float *orig;    /* [n_vocab] the logits before the first draw changed them */
    uint32_t *mask; /* [(n_vocab + 31) / 32] tokens the grammar allows */
    bool g_done;    /* the grammar is closed: nothing may follow */
    bool g_eager;   /* mask before every draw (DUET_GRAMMAR_EAGER=1: to measure the mask's cost) */
};

/* ---- RNG: splitmix64 expands the seed, xoshiro256** draws --------------- */

static uint64_t splitmix64(uint64_t *state) {
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static inline uint64_t rotl64(uint64_t x, int k) {
    return (x << k) | (x >> (64 - k));
}

static uint64_t rng_next(uint64_t s[4]) {
    uint64_t out = rotl64(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl64(s[3], 45);
    return out;
}

static void rng_seed(uint64_t s[4], uint64_t seed) {
    /* splitmix64's outputs are a bijection of four distinct states, so at
     * most one word is zero: never xoshiro's all-zero fixed point. */
    for (int i = 0; i < 4; i++)
        s[i] = splitmix64(&seed);
}

/* Uniform double in [0, 1) from the top 53 bits. */
static double rng_uniform(uint64_t s[4]) {
    return (double)(rng_next(s) >> 11) * 0x1.0p-53;
}

/* ---- settings ------------------------------------------------------------- */

duet_sampling duet_sampling_default(void) {
    duet_sampling s = {
        .temperature = 0.8f,
        .top_k = 40,
        .top_p = 0.95f,
        .min_p = 0.05f,
        .repetition_penalty = 1.0f,
        .presence_penalty = 0.0f,
        .frequency_penalty = 0.0f,
        .penalty_last_n = 64,
        .seed = 0xC0FFEEu,
    };
    return s;
}

static duet_status check_settings(const duet_sampling *s, int n_vocab) {
    if (n_vocab <= 0)
        return duet__error(DUET_INVALID_ARGUMENT, "sampler: n_vocab must be > 0 (got %d)", n_vocab);
    if (!isfinite(s->temperature) || s->temperature < 0.0f)
        return duet__error(DUET_INVALID_ARGUMENT, "sampling.temperature must be finite and >= 0 (got %g)",
                           (double)s->temperature);
    if (s->top_k < 0)
        return duet__error(DUET_INVALID_ARGUMENT, "sampling.top_k must be >= 0 (got %d)", s->top_k);
    if (!(s->top_p > 0.0f && s->top_p <= 1.0f))
        return duet__error(DUET_INVALID_ARGUMENT, "sampling.top_p must be in (0, 1] (got %g)",
                           (double)s->top_p);
    if (!(s->min_p >= 0.0f && s->min_p <= 1.0f))
        return duet__error(DUET_INVALID_ARGUMENT, "sampling.min_p must be in [0, 1] (got %g)",
                           (double)s->min_p);
    if (!isfinite(s->repetition_penalty) || s->repetition_penalty <= 0.0f)
        return duet__error(DUET_INVALID_ARGUMENT,
                           "sampling.repetition_penalty must be finite and > 0 (got %g)",
                           (double)s->repetition_penalty);
    if (!isfinite(s->presence_penalty))
        return duet__error(DUET_INVALID_ARGUMENT, "sampling.presence_penalty must be finite (got %g)",
                           (double)s->presence_penalty);
    if (!isfinite(s->frequency_penalty))
        return duet__error(DUET_INVALID_ARGUMENT, "sampling.frequency_penalty must be finite (got %g)",
                           (double)s->frequency_penalty);
    if (s->penalty_last_n < 0)
        return duet__error(DUET_INVALID_ARGUMENT, "sampling.penalty_last_n must be >= 0 (got %d)",
                           s->penalty_last_n);
    return DUET_OK;
}

duet_status duet_sampler_new(const duet_sampling *s, int n_vocab, duet_sampler **out) {
    if (!s || !out) return duet__error(DUET_INVALID_ARGUMENT, "sampler: NULL settings or out");
    *out = NULL;
    duet_status st = check_settings(s, n_vocab);
    if (st != DUET_OK) return st;

    duet_sampler *smp = calloc(1, sizeof *smp);
    if (!smp) return duet__error(DUET_OUT_OF_MEMORY, "sampler: out of memory");
    smp->s = *s;
    smp->n_vocab = n_vocab;
    smp->cap = s->penalty_last_n;
    size_t nv = (size_t)n_vocab;
    smp->count = calloc(nv, sizeof *smp->count);
    smp->distinct = malloc(nv * sizeof *smp->distinct);
    smp->where = malloc(nv * sizeof *smp->where);
    smp->c = malloc(nv * sizeof *smp->c);
    smp->pv = malloc(nv * sizeof *smp->pv);
    if (smp->cap > 0) smp->ring = malloc((size_t)smp->cap * sizeof *smp->ring);
    if (!smp->count || !smp->distinct || !smp->where || !smp->c || !smp->pv || (smp->cap > 0 && !smp->ring)) {
        duet_sampler_free(smp);
        return duet__error(DUET_OUT_OF_MEMORY, "sampler: out of memory for n_vocab=%d", n_vocab);
    }
    rng_seed(smp->rng, s->seed);
    *out = smp;
    return DUET_OK;
}

void duet_sampler_free(duet_sampler *smp) {
    if (!smp) return;
    free(smp->ring);
    free(smp->count);
    free(smp->distinct);
    free(smp->where);
    free(smp->c);
    free(smp->pv);
    duet_grammar_state_free(smp->gs);
    duet_grammar_free(smp->g);
    free(smp->orig);
    free(smp->mask);
    free(smp);
}

duet_status duet_sampler_set_grammar(duet_sampler *smp, duet_grammar *g, const duet_vocab *voc) {
    assert(smp && g && voc && !smp->g);
    if (duet_vocab_size(voc) != smp->n_vocab) {
        duet_grammar_free(g);
        return duet__error(DUET_INVALID_ARGUMENT, "sampler: the vocabulary has %d tokens, the sampler %d",
                           duet_vocab_size(voc), smp->n_vocab);
    }
    smp->g = g;
    smp->voc = voc;
    smp->orig = malloc((size_t)smp->n_vocab * sizeof *smp->orig);
    smp->mask = malloc(((size_t)smp->n_vocab + 31) / 32 * sizeof *smp->mask);
    duet_status st = smp->orig && smp->mask ? duet_grammar_state_new(g, &smp->gs)
                                            : duet__error(DUET_OUT_OF_MEMORY, "sampler: out of memory");
    smp->g_done = false;
    const char *eager = getenv("DUET_GRAMMAR_EAGER");
    smp->g_eager = eager && eager[0] == '1';
    return st;
}

bool duet_sampler_has_grammar(const duet_sampler *smp) {
    return smp->g != NULL;
}

bool duet_sampler_grammar_done(const duet_sampler *smp) {
    return smp->g_done;
}

void duet_sampler_reset(duet_sampler *smp) {
    for (int i = 0; i < smp->n_distinct; i++)
        smp->count[smp->distinct[i]] = 0;
    smp->n_distinct = 0;
    smp->len = smp->head = 0;
    rng_seed(smp->rng, smp->s.seed);
    if (smp->gs) duet_grammar_state_reset(smp->gs);
    smp->g_done = false;
}

/* ---- penalty window --------------------------------------------------------- */

static void window_add(duet_sampler *smp, int32_t t) {
    if (smp->count[t]++ == 0) {
        smp->where[t] = smp->n_distinct;
        smp->distinct[smp->n_distinct++] = t;
    }
}

static void window_remove(duet_sampler *smp, int32_t t) {
    assert(smp->count[t] > 0);
    if (--smp->count[t] == 0) {
        /* Swap the last distinct token into t's slot. */
        int32_t last = smp->distinct[--smp->n_distinct];
        smp->distinct[smp->where[t]] = last;
        smp->where[last] = smp->where[t];
    }
}

void duet_sampler_accept(duet_sampler *smp, int32_t token) {
    /* An id outside the vocabulary cannot be penalised; it is ignored. */
    if (token < 0 || token >= smp->n_vocab) return;
    if (smp->gs && duet_grammar_accept_token(smp->gs, smp->voc, token))
        smp->g_done = !duet_grammar_can_continue(smp->gs);
    if (smp->cap > 0) {
        if (smp->len == smp->cap) {
            window_remove(smp, smp->ring[smp->head]);
            smp->ring[smp->head] = token;
            smp->head = (smp->head + 1) % smp->cap;
        } else {
            smp->ring[(smp->head + smp->len) % smp->cap] = token;
            smp->len++;
        }
    }
    window_add(smp, token);
}

static void apply_penalties(const duet_sampler *smp, float *logits) {
    const duet_sampling *s = &smp->s;
    if (s->repetition_penalty == 1.0f && s->presence_penalty == 0.0f && s->frequency_penalty == 0.0f) return;
    for (int i = 0; i < smp->n_distinct; i++) {
        int32_t t = smp->distinct[i];
        float x = logits[t];
        if (s->repetition_penalty != 1.0f)
            x = x > 0.0f ? x / s->repetition_penalty : x * s->repetition_penalty;
        x -= (float)smp->count[t] * s->frequency_penalty + s->presence_penalty;
        logits[t] = x;
    }
}

/* ---- selection -------------------------------------------------------------- */

/* The one total order every selection and sort uses. */
static inline bool before(const cand *a, const cand *b) {
    return a->x > b->x || (a->x == b->x && a->id < b->id);
}

static int cand_cmp(const void *pa, const void *pb) {
    const cand *a = pa, *b = pb;
    return before(a, b) ? -1 : before(b, a) ? 1 : 0;
}

static int cand_cmp_id(const void *pa, const void *pb) {
    const cand *a = pa, *b = pb;
    return (a->id > b->id) - (a->id < b->id);
}

static inline void cand_swap(cand *a, cand *b) {
    cand t = *a;
    *a = *b;
    *b = t;
}

/* Rearranges c[0..n) so that c[0..k) holds the k first candidates in the
 * order above (in no particular order among themselves). Quickselect with a
 * median-of-three pivot; if it degenerates, the rest is sorted instead, so
 * the worst case stays O(n log n). */
static void select_top(cand *c, int n, int k) {
    if (k <= 0 || k >= n) return;
    int lo = 0, hi = n; /* lo <= k <= hi; [0,lo) < [lo,hi) < [hi,n) */
    int budget = 8;
    for (int m = n; m > 1; m >>= 1)
        budget += 2;
    while (hi - lo > 16) {
        if (budget-- == 0) {
            qsort(c + lo, (size_t)(hi - lo), sizeof *c, cand_cmp);
            return;
        }
        int mid = lo + (hi - lo) / 2;
        if (before(&c[mid], &c[lo])) cand_swap(&c[mid], &c[lo]);
        if (before(&c[hi - 1], &c[lo])) cand_swap(&c[hi - 1], &c[lo]);
        if (before(&c[hi - 1], &c[mid])) cand_swap(&c[hi - 1], &c[mid]);
        cand pivot = c[mid];
        /* Hoare partition; keys are distinct (ids break ties), and the
         * pivot and the sorted ends bound both scans. */
        int i = lo, j = hi - 1;
        while (i <= j) {
            while (before(&c[i], &pivot))
                i++;
            while (before(&pivot, &c[j]))
                j--;
            if (i <= j) {
                cand_swap(&c[i], &c[j]);
                i++;
                j--;
            }
        }
        /* Now [lo, j] precede [i, hi), and anything in between is the pivot. */
        if (k <= j + 1)
            hi = j + 1;
        else if (k >= i)
            lo = i;
        else
            return;
    }
    /* Small range: insertion sort settles it. */
    for (int i = lo + 1; i < hi; i++) {
        cand v = c[i];
        int j = i - 1;
        while (j >= lo && before(&v, &c[j])) {
            c[j + 1] = c[j];
            j--;
        }
        c[j + 1] = v;
    }
}

/* ---- the distribution -------------------------------------------------------- */

int32_t duet_argmax(const float *x, int n) {
    assert(x && n > 0);
    int best = -1;
    for (int i = 0; i < n; i++) {
        if (isnan(x[i])) continue;
        if (best < 0 || x[i] > x[best]) best = i;
    }
    return best < 0 ? 0 : best;
}

float duet_logprobs(const float *logits, int n, int32_t token, int k, duet_token_logprob *top) {
    assert(logits && n > 0 && k >= 0 && k <= n && (k == 0 || top));
    float mx = -INFINITY;
    for (int i = 0; i < n; i++)
        if (logits[i] > mx) mx = logits[i]; /* NaN compares false */
    if (!isfinite(mx)) mx = mx > 0 ? FLT_MAX : 0;
    /* Top k by insertion into a sorted list: after the first few tokens
     * almost every logit fails the first comparison. */
    int have = 0;
    double sum = 0;
    for (int i = 0; i < n; i++) {
        float x = logits[i];
        if (isnan(x)) x = -INFINITY;
        if (x > FLT_MAX) x = FLT_MAX;
        sum += exp((double)x - mx);
        if (k == 0 || (have == k && !(x > top[k - 1].logprob))) continue;
        int j = have < k ? have++ : k - 1;
        while (j > 0 && x > top[j - 1].logprob) {
            top[j] = top[j - 1];
            j--;
        }
        top[j] = (duet_token_logprob){i, x};
    }
    double lse = mx + log(sum);
    for (int i = 0; i < have; i++)
        top[i].logprob = (float)((double)top[i].logprob - lse);
    for (int i = have; i < k; i++)
        top[i] = (duet_token_logprob){-1, -INFINITY};
    float x = token >= 0 && token < n ? logits[token] : -INFINITY;
    if (isnan(x)) x = -INFINITY;
    if (x > FLT_MAX) x = FLT_MAX;
    return (float)((double)x - lse);
}

/* top-k for small k: one pass over the logits keeping a heap of the k best
 * (root = the worst of them), so most tokens cost a single comparison.
 * Writes the kept candidates (unordered) to c and returns how many (fewer
 * than k when fewer logits are finite). */
static int heap_top_k(const float *logits, int n_vocab, int k, cand *c) {
    int n = 0;
    for (int i = 0; i < n_vocab; i++) {
        float x = logits[i];
        if (!(x > -INFINITY)) continue; /* NaN, -inf */
        if (x > FLT_MAX) x = FLT_MAX;
        cand v = {.x = x, .id = i};
        int j;
        if (n < k) {
            /* Sift up: the parent must not precede the child. */
            j = n++;
            while (j > 0 && before(&c[(j - 1) / 2], &v)) {
                c[j] = c[(j - 1) / 2];
                j = (j - 1) / 2;
            }
            c[j] = v;
            continue;
        }
        /* Ids ascend, so an equal logit loses the tie to the root. */
        if (!(x > c[0].x)) continue;
        j = 0;
        for (;;) {
            int l = 2 * j + 1, w = j;
            const cand *worst = &v;
            if (l < n && before(worst, &c[l])) worst = &c[w = l];
            if (l + 1 < n && before(worst, &c[l + 1])) worst = &c[w = l + 1];
            if (w == j) break;
            c[j] = *worst;
            j = w;
        }
        c[j] = v;
    }
    return n;
}

/* The top-p bin of a candidate: -log p scaled, so it never decreases
 * along the total order and equal logits share a bin. */
static inline int topp_bin(float x, float xmax, float inv_t) {
    float d = xmax - x;
    if (d == 0.0f) return 0; /* 1/T may be inf: avoid 0 * inf */
    float key = d * inv_t * TOPP_BINS_PER_NAT;
    return key < (float)(TOPP_BINS - 1) ? (int)key : TOPP_BINS - 1;
}

/* top-p over c[0..n) with unnormalised probabilities: moves the smallest
 * prefix (in the total order) whose mass reaches `target` to the front and
 * returns its length (>= 1). Candidates are binned by -log p; every bin
 * before the one where the mass crosses `target` is kept whole (no
 * sorting), and only the crossing bin is ordered, as far as it needs to be. */

static int top_p_prefix(cand *c, int n, double target, float xmax, float inv_t, double *mass) {
    for (int b = 0; b < TOPP_BINS; b++)
        mass[b] = 0.0;
    for (int i = 0; i < n; i++)
        mass[topp_bin(c[i].x, xmax, inv_t)] += c[i].p;
    double cum = 0.0;
    int edge = 0;
    for (; edge < TOPP_BINS - 1; edge++) {
        if (cum + mass[edge] >= target) break;
        cum += mass[edge];
    }
    /* Keep bins < edge in place order; bin `edge` goes right after them;
     * later bins are dropped. */
    int m = 0;
    for (int i = 0; i < n; i++)
        if (topp_bin(c[i].x, xmax, inv_t) <= edge) c[m++] = c[i];
    int lo = 0, hi = m - 1;
    while (lo <= hi) {
        if (topp_bin(c[lo].x, xmax, inv_t) < edge)
            lo++;
        else
            cand_swap(&c[lo], &c[hi--]);
    }
    /* c[lo..m) is the crossing bin: sort its best chunk, doubling, until the
     * mass is reached (or the bin runs out, when rounding undercounted). */
    int done = lo, i = lo;
    while (i < m) {
        if (i == done) {
            int want = done + (done - lo < 32 ? 32 : done - lo);
            if (want > m) want = m;
            select_top(c + done, m - done, want - done);
            qsort(c + done, (size_t)(want - done), sizeof *c, cand_cmp);
            done = want;
        }
        cum += c[i++].p;
        if (cum >= target) break;
    }
    return i > 0 ? i : 1;
}

/* Penalties and truncation. Leaves the kept candidates in smp->c[0..n), in
 * ascending id order, with unnormalised probabilities in .p and their sum
 * (added in that order) in *total. Returns n, or 0 when no logit is finite
 * or greedy decoding applies (the caller then uses duet_argmax on the
 * penalised logits). */
static int build_dist(duet_sampler *smp, float *logits, double *total) {
    const duet_sampling *s = &smp->s;
    apply_penalties(smp, logits);
    if (s->temperature <= 0.0f) return 0;

    /* Candidates: finite logits only. NaN and -inf are never sampled; +inf
     * becomes FLT_MAX so that the softmax stays finite (all +inf tokens then
     * share the mass). top-k comes first: it does not depend on T. */
    cand *c = smp->c;
    int n = 0;
    bool by_id = true; /* c[] in ascending id order */
    if (s->top_k > 0 && s->top_k <= HEAP_MAX_K && s->top_k < smp->n_vocab) {
        n = heap_top_k(logits, smp->n_vocab, s->top_k, c);
        by_id = false;
    } else {
        for (int i = 0; i < smp->n_vocab; i++) {
            float x = logits[i];
            if (!(x > -INFINITY)) continue;
            c[n].x = x > FLT_MAX ? FLT_MAX : x;
            c[n].id = i;
            n++;
        }
        if (s->top_k > 0 && s->top_k < n) {
            select_top(c, n, s->top_k);
            n = s->top_k;
            by_id = false;
        }
    }
    if (n == 0) return 0;

    /* Stable softmax numerators: subtract the max before dividing by T, so
     * FLT_MAX logits and tiny temperatures cannot overflow. */
    float xmax = c[0].x;
    for (int i = 1; i < n; i++)
        xmax = c[i].x > xmax ? c[i].x : xmax;
    const float inv_t = 1.0f / s->temperature;
    double z = 0.0;
    for (int i = 0; i < n; i++) {
        float d = c[i].x - xmax;
        /* d = 0 first: with 1/T = inf, 0 * inf would be NaN. */
        float p = d == 0.0f ? 1.0f : expf(d * inv_t);
        c[i].p = p;
        z += p;
    }

    /* min-p keeps p >= min_p * p_max, and p_max is exactly 1 here. It runs
     * before top-p only because it is a cheap filter that shrinks what top-p
     * orders: both keep a prefix of the same order, top-p measures mass
     * against z of the unfiltered set, so the result is the shorter prefix —
     * exactly "top-p, then min-p". */
    if (s->min_p > 0.0f) {
        int m = 0;
        for (int i = 0; i < n; i++)
            if (c[i].p >= s->min_p) c[m++] = c[i];
        n = m; /* >= 1: the max has p = 1 */
    }

    if (s->top_p < 1.0f) {
        n = top_p_prefix(c, n, (double)s->top_p * z, xmax, inv_t, smp->mass);
        by_id = false;
    }

    /* The draw walks the kept tokens in id order, so which token a given
     * random number picks depends on the distribution alone, not on how
     * the selection above happened to arrange it. */
    if (!by_id) {
        if (n <= 4096) {
            qsort(c, (size_t)n, sizeof *c, cand_cmp_id);
        } else {
            /* Large sets: scatter by id and gather, O(n_vocab). */
            float *pv = smp->pv;
            for (int i = 0; i < smp->n_vocab; i++)
                pv[i] = -1.0f;
            for (int i = 0; i < n; i++)
                pv[c[i].id] = c[i].p;
            int m = 0;
            for (int i = 0; i < smp->n_vocab; i++) {
                if (pv[i] < 0.0f) continue;
                c[m].id = i;
                c[m].x = logits[i]; /* not read again: only .p and .id are */
                c[m].p = pv[i];
                m++;
            }
            assert(m == n);
        }
    }

    double sum = 0.0;
    for (int i = 0; i < n; i++)
        sum += c[i].p;
    *total = sum;
    return n;
}

static int32_t sample_plain(duet_sampler *smp, float *logits);

/* With a grammar: draw as usual and keep the token when the grammar allows
 * it; otherwise draw again from the original logits with every token the
 * grammar refuses masked out. Keeping an allowed first draw and redrawing
 * from the masked distribution after a refused one picks each allowed
 * token with its masked probability p / p(allowed), so the mask is only
 * computed when the model strays. */
int32_t duet_sampler_sample(duet_sampler *smp, float *logits) {
    if (!smp->gs) return sample_plain(smp, logits);
    const int n = smp->n_vocab;
    memcpy(smp->orig, logits, (size_t)n * sizeof *logits);
    int32_t id = -1;
    if (!smp->g_eager) {
        id = sample_plain(smp, logits);
        if (duet_grammar_allows(smp->gs, smp->voc, id)) return id;
    }
    if (duet_grammar_mask(smp->gs, smp->voc, smp->mask) == 0) {
        /* A dead end (cannot happen with a grammar that closes): end here. */
        for (int i = 0; i < n; i++)
            if (duet_grammar_allows(smp->gs, smp->voc, i) || duet_vocab_is_eog(smp->voc, i)) return i;
        return id >= 0 ? id : duet_argmax(logits, n);
    }
    const uint32_t *m = smp->mask;
    for (int i = 0; i < n; i++)
        if (!((m[i >> 5] >> (i & 31)) & 1)) smp->orig[i] = -INFINITY;
    id = sample_plain(smp, smp->orig);
    if ((m[id >> 5] >> (id & 31)) & 1) return id;
    /* Every allowed token was cut by truncation or has no finite logit:
     * the allowed token with the largest original logit. */
    int32_t best = -1;
    for (int i = 0; i < n; i++)
        if (((m[i >> 5] >> (i & 31)) & 1) && (best < 0 || logits[i] > logits[best])) best = i;
    return best;
}

static int32_t sample_plain(duet_sampler *smp, float *logits) {
    double total = 0.0;
    int n = build_dist(smp, logits, &total);
    if (n == 0) return duet_argmax(logits, smp->n_vocab);
    const cand *c = smp->c;
    /* Inverse CDF over the kept tokens in id order; strict '>' means a
     * token with p = 0 is never drawn. */
    double r = rng_uniform(smp->rng) * total;
    double cum = 0.0;
    int last = -1;
    for (int i = 0; i < n; i++) {
        if (c[i].p <= 0.0f) continue;
        cum += c[i].p;
        last = i;
        if (cum > r) return c[i].id;
    }
    /* Rounding left r at the very top: the last token with mass. */
    return last >= 0 ? c[last].id : c[0].id;
}

double duet_sampler_uniform(duet_sampler *smp) {
    return rng_uniform(smp->rng);
}

int duet_sampler_dist(duet_sampler *smp, float *logits, int32_t *ids, float *probs) {
    double total = 0.0;
    int n = build_dist(smp, logits, &total);
    if (n == 0) {
        ids[0] = duet_argmax(logits, smp->n_vocab);
        probs[0] = 1.0f;
        return 1;
    }
    for (int i = 0; i < n; i++) {
        ids[i] = smp->c[i].id;
        probs[i] = (float)(smp->c[i].p / total);
    }
    return n;
}
