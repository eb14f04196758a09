/* profile.c — `duet profile`: times real steps of a grid of shapes on one
 * backend and device and fits the step-cost model (step_cost.c) to them.
 *
 * A step here is what the engine runs: one batched forward pass (decode
 * tokens of several sequences and prompt chunks together), the logits of
 * every decode and of each chunk's last token copied to the host, and a
 * greedy pick from each row. Context comes from one prompt prefilled once
 * into sequence slot 0: every other slot's block table starts with slot
 * 0's blocks (prefix sharing) and continues with blocks of its own, where
 * the step writes. So a step at context 512 costs what it costs in
 * serving without prefilling 512 tokens for each sequence first.
 *
 * A step costs more in the wake of a bigger one: on the 2-core Xeon a
 * one-token decode right after a 128-token chunk takes 7.5 ms, then 6.9,
 * 6.1, 5.8 and 5.6 ms as the same decode repeats (at one thread 12.8 ms
 * just after, 9.5-11.5 ms twelve steps later; Q4_0 profiled 4.9-5.4 ms
 * a decode in the old order against 2.9 ms steady). A server's steps come
 * in runs of similar shapes, so each timed step here is one of a run of
 * its own shape: untimed steps of it go first (PROFILE_SETTLE_S of them),
 * and a round visits the shapes by size, alternately up and down, so each
 * follows its neighbours in size (and a round's first its own shape).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../backends/backend.h"
#include "duet_internal.h"

#define PROFILE_BLOCK 16
/* Untimed steps of a shape before each timed one: at least one, and as
 * many as this long takes (a decode's slowdown after a prompt chunk is
 * gone within ~25 ms); at most PROFILE_SETTLE_MAX. */
#define PROFILE_SETTLE_S 0.025
#define PROFILE_SETTLE_MAX 32

void (*duet__profile_step_hook)(const duet_step_shape *shape, double *seconds);

static const int default_decode[] = {1, 2, 4, 8, 16};
static const int default_chunk[] = {16, 32, 64, 128};
static const int default_context[] = {16, 128, 512};

duet_profile_params duet_profile_params_default(void) {
    duet_profile_params p = {.open = duet_open_params_default(), .repeats = 3, .budget_s = 45};
    return p;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int max_of(const int *v, int n) {
    int m = 0;
    for (int i = 0; i < n; i++)
        if (v[i] > m) m = v[i];
    return m;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* One shape of the grid: n_dec decodes at context dec_ctx, and (when
 * chunk > 0) one prompt chunk of `chunk` tokens starting at chunk_pos. */
typedef struct grid_shape {
    int n_dec, dec_ctx, chunk, chunk_pos;
} grid_shape;

/* By step size: tokens, then decodes, then contexts. */
static int cmp_shape(const grid_shape *a, const grid_shape *b) {
    int d = (a->n_dec + a->chunk) - (b->n_dec + b->chunk);
    if (!d) d = a->n_dec - b->n_dec;
    if (!d) d = a->dec_ctx - b->dec_ctx;
    if (!d) d = a->chunk_pos - b->chunk_pos;
    return d;
}

static void shape_of(const grid_shape *g, duet_step_shape *s) {
    *s = (duet_step_shape){0};
    for (int k = 0; k < g->n_dec; k++)
        duet_step_shape_add(s, g->dec_ctx, 1, true);
    if (g->chunk > 0) duet_step_shape_add(s, g->chunk_pos, g->chunk, false);
}

typedef struct profiler {
    duet_model *m;
    int max_blocks, chunk_slot;
    int max_step; /* tokens the step arrays hold (the run state may take more) */
    int32_t *tok, *pos, *seq, *out, *tables;
} profiler;

/* Fills the block tables for a shape: slot 0's first blocks shared, then
 * blocks of each slot's own (identity layout: slot s owns s*max_blocks..). */
static void set_tables(profiler *pr, const grid_shape *g) {
    const int n_seqs = pr->m->run.state->p.n_seqs, mb = pr->max_blocks;
    for (int i = 0; i < n_seqs * mb; i++)
        pr->tables[i] = -1;
    for (int j = 0; j < mb; j++) /* slot 0: the shared prompt */
        pr->tables[j] = j;
    for (int s = 1; s <= g->n_dec; s++) {
        int shared = g->dec_ctx / PROFILE_BLOCK;
        for (int j = 0; j < shared; j++)
            pr->tables[s * mb + j] = j;
        pr->tables[s * mb + shared] = s * mb + shared;
    }
    if (g->chunk > 0) {
        int c = pr->chunk_slot, shared = g->chunk_pos / PROFILE_BLOCK;
        int last = (g->chunk_pos + g->chunk - 1) / PROFILE_BLOCK;
        for (int j = 0; j < shared; j++)
            pr->tables[c * mb + j] = j;
        for (int j = shared; j <= last; j++)
            pr->tables[c * mb + j] = c * mb + j;
    }
}

static int32_t token_at(int i, int n_vocab) {
    return (int32_t)(1 + ((int64_t)i * 7919 + 13) % (n_vocab - 1));
}

/* Runs one step of shape g; *seconds gets its wall time. */
static duet_status run_shape(profiler *pr, const grid_shape *g, double *seconds) {
    duet_model *m = pr->m;
    int n = 0, n_out = 0;
    for (int s = 1; s <= g->n_dec; s++) {
        pr->tok[n] = token_at(s, m->hp.n_vocab);
        pr->pos[n] = g->dec_ctx;
        pr->seq[n] = s;
        pr->out[n_out++] = n;
        n++;
    }
    for (int t = 0; t < g->chunk; t++) {
        pr->tok[n] = token_at(g->chunk_pos + t, m->hp.n_vocab);
        pr->pos[n] = g->chunk_pos + t;
        pr->seq[n] = pr->chunk_slot;
        n++;
    }
    if (g->chunk > 0) pr->out[n_out++] = n - 1;
    set_tables(pr, g);
    duet_batch b = {.n_tokens = n,
                    .tokens = pr->tok,
                    .pos = pr->pos,
                    .seq = pr->seq,
                    .n_out = n_out,
                    .out = pr->out,
                    .block_tables = pr->tables};
    double t0 = now_s();
    duet_status st = duet__run_forward(m, &m->run, &b, m->run.logits);
    /* The engine then samples each row: a greedy pick costs about as much. */
    volatile int32_t sink = 0;
    for (int r = 0; !st && r < n_out; r++) {
        const float *row = m->run.logits + (size_t)r * m->hp.n_vocab;
        int best = 0;
        for (int v = 1; v < m->hp.n_vocab; v++)
            if (row[v] > row[best]) best = v;
        sink = best;
    }
    (void)sink;
    *seconds = now_s() - t0;
    if (!st && duet__profile_step_hook) {
        duet_step_shape sh;
        shape_of(g, &sh);
        duet__profile_step_hook(&sh, seconds);
    }
    return st;
}

/* Runs shape g untimed until PROFILE_SETTLE_S have gone by in it (at
 * least once): the timed step that follows is one of a run of its shape. */
static duet_status settle(profiler *pr, const grid_shape *g) {
    double spent = 0, t;
    duet_status st = DUET_OK;
    for (int k = 0; !st && k < PROFILE_SETTLE_MAX && (k == 0 || spent < PROFILE_SETTLE_S); k++)
        if (!(st = run_shape(pr, g, &t))) spent += t;
    return st;
}

/* Prefills slot 0 with `n` tokens (the shared context), in steps. */
static duet_status prefill_shared(profiler *pr, int n) {
    duet_model *m = pr->m;
    const int mb = pr->max_blocks, n_seqs = m->run.state->p.n_seqs;
    for (int i = 0; i < n_seqs * mb; i++)
        pr->tables[i] = i / mb == 0 ? i : -1;
    for (int at = 0; at < n;) {
        int k = n - at < pr->max_step ? n - at : pr->max_step;
        for (int t = 0; t < k; t++) {
            pr->tok[t] = token_at(at + t, m->hp.n_vocab);
            pr->pos[t] = at + t;
            pr->seq[t] = 0;
        }
        pr->out[0] = k - 1;
        duet_batch b = {.n_tokens = k,
                        .tokens = pr->tok,
                        .pos = pr->pos,
                        .seq = pr->seq,
                        .n_out = 1,
                        .out = pr->out,
                        .block_tables = pr->tables};
        duet_status st = duet__run_forward(m, &m->run, &b, m->run.logits);
        if (st) return st;
        at += k;
    }
    return DUET_OK;
}

duet_status duet_profile_run(const char *model_path, const duet_profile_params *params,
                             duet_step_sample **samples, int *n_samples, duet_step_cost *fit) {
    if (!model_path || !samples || !n_samples || !fit)
        return duet__error(DUET_INVALID_ARGUMENT, "duet_profile_run: NULL argument");
    *samples = NULL;
    *n_samples = 0;
    duet_profile_params p = params ? *params : duet_profile_params_default();
    const int *dec = p.decode_batch ? p.decode_batch : default_decode;
    int n_dec = p.decode_batch ? p.n_decode_batch : (int)(sizeof default_decode / sizeof *default_decode);
    const int *chk = p.chunk ? p.chunk : default_chunk;
    int n_chk = p.chunk ? p.n_chunk : (int)(sizeof default_chunk / sizeof *default_chunk);
    const int *ctx = p.context ? p.context : default_context;
    int n_cx = p.context ? p.n_context : (int)(sizeof default_context / sizeof *default_context);
    if (p.repeats <= 0) p.repeats = 3;
    if (p.budget_s <= 0) p.budget_s = 45;
    if (n_dec < 1 || n_chk < 1 || n_cx < 1 || n_dec > 64 || n_chk > 64 || n_cx > 64 || p.repeats > 1000)
        return duet__error(DUET_INVALID_ARGUMENT,
                           "profile: 1 to 64 decode batches, chunk sizes and contexts each, repeats <= 1000");
    for (int i = 0; i < n_dec; i++)
        if (dec[i] < 1 || dec[i] > 1024)
            return duet__error(DUET_INVALID_ARGUMENT, "profile: decode batch %d out of range [1, 1024]",
                               dec[i]);
    for (int i = 0; i < n_chk; i++)
        if (chk[i] < 1 || chk[i] > 8192)
            return duet__error(DUET_INVALID_ARGUMENT, "profile: chunk %d out of range [1, 8192]", chk[i]);
    for (int i = 0; i < n_cx; i++)
        if (ctx[i] < 1 || ctx[i] > 65536)
            return duet__error(DUET_INVALID_ARGUMENT, "profile: context %d out of range [1, 65536]", ctx[i]);

    /* The context the engine would serve with, recorded in the model file. */
    duet_open_params vo = p.open;
    vo.vocab_only = true;
    duet_model *vm = NULL;
    duet_status st = duet_model_open(model_path, &vo, &vm);
    if (st) return st;
    duet_model_desc vd;
    duet_model_describe(vm, &vd);
    int serve_ctx = vd.n_ctx;
    duet_model_close(vm);

    /* Contexts round down to whole blocks (at least one); every step fits. */
    const int max_dec = max_of(dec, n_dec), max_chk = max_of(chk, n_chk);
    int cx[64];
    for (int i = 0; i < n_cx; i++)
        cx[i] = ctx[i] < PROFILE_BLOCK ? PROFILE_BLOCK : ctx[i] / PROFILE_BLOCK * PROFILE_BLOCK;
    const int max_cx = max_of(cx, n_cx);
    duet_open_params op = p.open;
    op.vocab_only = false;
    op.n_ctx = (max_cx + max_chk + PROFILE_BLOCK) / PROFILE_BLOCK * PROFILE_BLOCK;
    op.n_seqs = max_dec + 2; /* slot 0 shared, 1..max_dec decodes, the last for chunks */
    const int mid_dec = dec[n_dec / 2];
    int max_step = max_dec > mid_dec + max_chk ? max_dec : mid_dec + max_chk;
    if (max_step < max_chk) max_step = max_chk;
    duet_model *m = NULL;
    if ((st = duet__model_open(model_path, &op, max_step, max_dec + 1, PROFILE_BLOCK, 0, &m))) return st;

    /* The grid: decodes; chunks from position 0 and from every context;
     * the middle decode batch with every chunk (mixed steps). */
    int cap = n_dec * n_cx + n_chk * (n_cx + 1) + n_chk;
    grid_shape *grid = calloc((size_t)cap, sizeof *grid);
    profiler pr = {
        .m = m, .max_blocks = m->run.state->max_blocks, .chunk_slot = op.n_seqs - 1, .max_step = max_step};
    pr.tok = malloc((size_t)max_step * sizeof(int32_t));
    pr.pos = malloc((size_t)max_step * sizeof(int32_t));
    pr.seq = malloc((size_t)max_step * sizeof(int32_t));
    pr.out = malloc((size_t)(max_dec + 1) * sizeof(int32_t));
    pr.tables = malloc((size_t)op.n_seqs * pr.max_blocks * sizeof(int32_t));
    duet_step_sample *out = calloc((size_t)cap, sizeof *out);
    double *times = malloc((size_t)cap * (size_t)p.repeats * sizeof *times);
    /* Every timed repeat, for the dispersion. */
    duet_step_sample *all = malloc(((size_t)cap * (size_t)p.repeats + 1) * sizeof *all);
    int *order = malloc((size_t)cap * sizeof *order);
    if (!grid || !order || !pr.tok || !pr.pos || !pr.seq || !pr.out || !pr.tables || !out || !times || !all) {
        st = duet__error(DUET_OUT_OF_MEMORY, "profile: out of memory");
        goto done;
    }
    int n = 0;
    for (int c = 0; c < n_cx; c++)
        for (int d = 0; d < n_dec; d++)
            grid[n++] = (grid_shape){.n_dec = dec[d], .dec_ctx = cx[c]};
    for (int c = -1; c < n_cx; c++)
        for (int k = 0; k < n_chk; k++)
            grid[n++] = (grid_shape){.chunk = chk[k], .chunk_pos = c < 0 ? 0 : cx[c]};
    for (int k = 0; k < n_chk; k++)
        grid[n++] = (grid_shape){.n_dec = mid_dec, .dec_ctx = cx[n_cx / 2], .chunk = chk[k]};

    /* The order a round runs in: by step size (see the top). */
    for (int i = 0; i < n; i++)
        order[i] = i;
    for (int i = 1; i < n; i++) /* insertion sort: a grid of at most a few hundred shapes */
        for (int j = i; j > 0 && cmp_shape(&grid[order[j - 1]], &grid[order[j]]) > 0; j--) {
            int t = order[j];
            order[j] = order[j - 1];
            order[j - 1] = t;
        }

    double t_start = now_s();
    if ((st = prefill_shared(&pr, max_cx))) goto done;
    /* Each shape once untimed (first use), smallest first, then the
     * repeats in rounds over the whole grid: a slow moment of the machine
     * lands on one round of every shape, not on all repeats of one (its
     * median stays clean). Shapes past the budget are left out. */
    int warmed = 0, rounds = 0;
    for (int i = 0; i < n && !st; i++) {
        if (now_s() - t_start > p.budget_s) break;
        double t;
        if (!(st = run_shape(&pr, &grid[order[i]], &t))) warmed++;
    }
    for (int r = 0; r < p.repeats && !st; r++) {
        int k = 0;
        for (; k < warmed && !st; k++) {
            if (r > 0 && now_s() - t_start > p.budget_s) break;
            int i = order[r % 2 ? warmed - 1 - k : k]; /* down in odd rounds */
            if (!(st = settle(&pr, &grid[i])))
                st = run_shape(&pr, &grid[i], &times[(size_t)i * p.repeats + r]);
        }
        if (k < warmed) break; /* out of time: the rounds so far */
        rounds++;
        if (p.progress) p.progress(rounds * warmed / p.repeats, n, p.user);
    }
    /* The samples in the grid's order (decodes, chunks, mixed). */
    int done = 0, n_all = 0;
    for (int i = 0; i < n && !st && rounds > 0; i++) {
        bool ran = false;
        for (int k = 0; k < warmed && !ran; k++)
            ran = order[k] == i;
        if (!ran) continue;
        double *ti = &times[(size_t)i * p.repeats];
        qsort(ti, (size_t)rounds, sizeof *ti, cmp_double);
        duet_step_sample *s = &out[done++];
        s->seconds = rounds % 2 ? ti[rounds / 2] : (ti[rounds / 2 - 1] + ti[rounds / 2]) / 2;
        shape_of(&grid[i], &s->shape);
        for (int r = 0; r < rounds; r++)
            all[n_all++] = (duet_step_sample){.shape = s->shape, .seconds = ti[r]};
    }
    if (p.progress && done) p.progress(n, n, p.user);
    if (!st && done < 2)
        st = duet__error(DUET_INVALID_ARGUMENT, "profile: only %d shape(s) ran within the %g s budget", done,
                         p.budget_s);
    if (!st) st = duet_step_cost_fit(out, done, fit);
    /* The dispersion: every timed repeat against the fit (the fit used
     * each shape's median; a server meets the whole spread). */
    if (!st) duet_step_cost_fit_noise(fit, all, n_all);
    if (!st) {
        duet_model_desc d;
        duet_model_describe(m, &d);
        if (duet_model_meta(m, "general.name", fit->model, sizeof fit->model) < 0)
            snprintf(fit->model, sizeof fit->model, "%s", model_path);
        snprintf(fit->backend, sizeof fit->backend, "%s", d.backend ? d.backend : "");
        snprintf(fit->device, sizeof fit->device, "%s", d.device ? d.device : "");
        fit->n_ctx = serve_ctx;
        *samples = out;
        *n_samples = done;
        out = NULL;
    }
done:
    free(grid);
    free(order);
    free(pr.tok), free(pr.pos), free(pr.seq), free(pr.out), free(pr.tables);
    free(out);
    free(all);
    free(times);
    duet_model_close(m);
    return st;
}
