/* forward.c — the Llama forward pass as a stream of HAL ops.
 *
 *   x = embed(tokens)
 *   per layer:  xn = rmsnorm(x);  q,k,v = xn·Wq,Wk,Wv (+bias);  (qwen3: rmsnorm of each q, k head)
 *               rope(q,k) + store k,v;  att = attention(q, cache (sliding window));  x += att·Wo
 *               xn = rmsnorm(x);  gate = silu(xn·Wg) * (xn·Wu);  x += gate·Wd
 *   logits = rmsnorm(x[out rows])·Wout
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "forward.h"

static duet_view V(duet_buffer *b) {
    return (duet_view){b, 0};
}

static size_t q8_bytes(size_t rows, int width) {
    return rows * duet_dtype_row_bytes(DUET_DTYPE_Q8_0, width);
}

static bool is_q8(const duet_weight *w) {
    return duet_dtype_takes_q8_activations(w->type);
}

/* Whether any layer has a q8_0 consumer for each activation. */
static void q8_consumers(const duet_weights *w, bool *xn, bool *att, bool *gate) {
    *xn = is_q8(&w->output), *att = *gate = false;
    for (int l = 0; l < w->n_layer; l++) {
        const duet_layer *L = &w->layers[l];
        *xn |= is_q8(&L->wq) || is_q8(&L->wk) || is_q8(&L->wv) || is_q8(&L->w_gate) || is_q8(&L->w_up);
        *att |= is_q8(&L->wo);
        *gate |= is_q8(&L->w_down);
    }
}

duet_status duet__state_new(duet_backend *be, const duet_hparams *hp, const duet_weights *w,
                            const duet_state_params *params, duet_state **out) {
    *out = NULL;
    duet_state_params p = *params;
    if (!p.block_size) p.block_size = 16;
    if (p.max_tokens < 1 || p.max_out < 1 || p.max_out > p.max_tokens || p.n_ctx < 1 || p.n_seqs < 1 ||
        p.block_size < 1 || p.block_size > 4096)
        return duet__error(DUET_INVALID_ARGUMENT,
                           "state: bad sizes (tokens %d, out %d, ctx %d, seqs %d, block %d, blocks %d)",
                           p.max_tokens, p.max_out, p.n_ctx, p.n_seqs, p.block_size, p.n_blocks);
    if (p.kv_type != DUET_DTYPE_F32 && p.kv_type != DUET_DTYPE_F16 && p.kv_type != DUET_DTYPE_Q8_0)
        return duet__error(DUET_UNSUPPORTED, "state: kv cache type must be f32, f16 or q8_0");
    if (p.kv_type == DUET_DTYPE_Q8_0 && hp->head_dim % DUET_QK8_0)
        return duet__error(DUET_UNSUPPORTED,
                           "state: a q8_0 kv cache needs head_dim %% 32 == 0 (this model: %d)", hp->head_dim);
    const int max_blocks = (p.n_ctx + p.block_size - 1) / p.block_size;
    const int64_t full = (int64_t)max_blocks * p.n_seqs;
    if (full > INT32_MAX) return duet__error(DUET_INVALID_ARGUMENT, "state: KV block count overflows");
    if (!p.n_blocks) p.n_blocks = (int)full;
    if (p.n_blocks < 0 || p.n_blocks > full) /* 0 = every slot at full context */
        return duet__error(
            DUET_INVALID_ARGUMENT,
            "kv_blocks %d out of range [1, %lld] (%d sequences x %d positions in blocks of %d)", p.n_blocks,
            (long long)full, p.n_seqs, p.n_ctx, p.block_size);
    duet_state *s = calloc(1, sizeof *s);
    if (!s) return duet__error(DUET_OUT_OF_MEMORY, "state: out of memory");
    s->be = be;
    s->p = p;
    s->max_blocks = max_blocks;
    s->n_layer = hp->n_layer;
    const size_t T = (size_t)p.max_tokens, F4 = sizeof(float);
    const int qw = hp->n_head * hp->head_dim, kvw = hp->n_head_kv * hp->head_dim;
    duet_status st;
    if ((st = duet_buffer_alloc(be, T * hp->n_embd * F4, &s->x)) ||
        (st = duet_buffer_alloc(be, T * hp->n_embd * F4, &s->xn)) ||
        (st = duet_buffer_alloc(be, T * qw * F4, &s->q)) ||
        (st = duet_buffer_alloc(be, T * kvw * F4, &s->k)) ||
        (st = duet_buffer_alloc(be, T * kvw * F4, &s->v)) ||
        (st = duet_buffer_alloc(be, T * qw * F4, &s->att)) ||
        (st = duet_buffer_alloc(be, T * hp->n_ff * F4, &s->gate)) ||
        (st = duet_buffer_alloc(be, T * hp->n_ff * F4, &s->up)) ||
        (st = duet_buffer_alloc(be, (size_t)p.max_out * hp->n_embd * F4, &s->xo)) ||
        (st = duet_buffer_alloc(be, (size_t)p.max_out * hp->n_vocab * F4, &s->logits)) ||
        (st = duet_buffer_alloc(be, T * 4, &s->tokens)) || (st = duet_buffer_alloc(be, T * 4, &s->pos)) ||
        (st = duet_buffer_alloc(be, T * 4, &s->seq)) || (st = duet_buffer_alloc(be, T * 4, &s->out)) ||
        (st = duet_buffer_alloc(be, (size_t)full * 4, &s->block_table)))
        goto fail;

    /* INT8 activations where a q8_0 matmul reads them, the width splits
     * into 32-blocks and the device runs the fused path. */
    bool want_xn, want_att, want_gate;
    q8_consumers(w, &want_xn, &want_att, &want_gate);
    const bool q8_acts = be->info.q8_activations && (want_xn || want_att || want_gate);
    if (q8_acts) {
        if (want_xn && hp->n_embd % DUET_QK8_0 == 0 &&
            (st = duet_buffer_alloc(be, q8_bytes(T, hp->n_embd), &s->xn_q8)))
            goto fail;
        if (want_att && qw % DUET_QK8_0 == 0 && (st = duet_buffer_alloc(be, q8_bytes(T, qw), &s->att_q8)))
            goto fail;
        if (want_gate && hp->n_ff % DUET_QK8_0 == 0 &&
            (st = duet_buffer_alloc(be, q8_bytes(T, hp->n_ff), &s->gate_q8)))
            goto fail;
    }

    /* Identity tables: slot s owns blocks s*max_blocks .. (while they exist). */
    s->host_table = malloc((size_t)full * sizeof(int32_t));
    s->k_pool = calloc((size_t)hp->n_layer, sizeof *s->k_pool);
    s->v_pool = calloc((size_t)hp->n_layer, sizeof *s->v_pool);
    if (!s->host_table || !s->k_pool || !s->v_pool) {
        st = duet__error(DUET_OUT_OF_MEMORY, "state: out of memory");
        goto fail;
    }
    for (int64_t i = 0; i < full; i++)
        s->host_table[i] = i < p.n_blocks ? (int32_t)i : -1;
    if ((st = duet_buffer_upload(be, s->block_table, 0, s->host_table, (size_t)full * 4))) goto fail;
    const size_t pool_bytes = duet_kv_pool_bytes(
        &(duet_kv_pages){.dtype = p.kv_type, .block_size = p.block_size, .n_blocks = p.n_blocks}, (int)kvw);
    for (int l = 0; l < hp->n_layer; l++)
        if ((st = duet_buffer_alloc(be, pool_bytes, &s->k_pool[l])) ||
            (st = duet_buffer_alloc(be, pool_bytes, &s->v_pool[l])))
            goto fail;
    *out = s;
    return DUET_OK;
fail:
    duet__state_free(s);
    return st;
}

void duet__state_free(duet_state *s) {
    if (!s) return;
    duet_backend *be = s->be;
    duet_buffer *bufs[] = {s->x,    s->xn,  s->q,     s->k,      s->v,       s->att,
                           s->gate, s->up,  s->xo,    s->logits, s->tokens,  s->pos,
                           s->seq,  s->out, s->xn_q8, s->att_q8, s->gate_q8, s->block_table};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++)
        duet_buffer_free(be, bufs[i]);
    for (int l = 0; l < s->n_layer; l++) {
        if (s->k_pool) duet_buffer_free(be, s->k_pool[l]);
        if (s->v_pool) duet_buffer_free(be, s->v_pool[l]);
    }
    free(s->k_pool);
    free(s->v_pool);
    free(s->host_table);
    free(s);
}

/* ---- op builders: one short function per op keeps forward() readable ---- */

/* An activation as its consumers want it: f32 rows and/or q8_0 blocks. */
typedef struct act {
    duet_buffer *f32, *q8; /* either may be NULL */
} act;

/* Which forms of an activation (f32 buffer f, q8 buffer q or NULL) the
 * given matmul weights read. */
static act act_for(duet_buffer *f, duet_buffer *q, const duet_weight *const *ws, int n) {
    act a = {NULL, NULL};
    for (int i = 0; i < n; i++) {
        if (q && is_q8(ws[i]))
            a.q8 = q;
        else
            a.f32 = f;
    }
    return a;
}

static duet_status op_rmsnorm(duet_backend *be, int n, duet_buffer *x, const duet_weight *w, float eps,
                              act out, int dim) {
    duet_op op = {.kind = DUET_OP_RMSNORM, .n_tokens = n};
    op.rmsnorm.x = V(x);
    op.rmsnorm.w = V(w->buf);
    op.rmsnorm.out = V(out.f32);
    op.rmsnorm.out_q8 = V(out.q8);
    op.rmsnorm.dim = dim;
    op.rmsnorm.eps = eps;
    return duet_step_op(be, &op);
}

/* out = x·Wᵀ (+ bias) (+ out when accumulate); x in the form W reads. */
static duet_status op_matmul(duet_backend *be, int n, const duet_weight *w, act x, const duet_weight *bias,
                             bool accumulate, duet_buffer *out) {
    duet_op op = {.kind = DUET_OP_MATMUL, .n_tokens = n};
    op.matmul.w = V(w->buf);
    op.matmul.dtype = w->type;
    if (is_q8(w) && x.q8)
        op.matmul.x_q8 = V(x.q8);
    else
        op.matmul.x = V(x.f32);
    op.matmul.bias = V(bias ? bias->buf : NULL);
    op.matmul.accumulate = accumulate;
    op.matmul.n_in = (int)w->cols;
    op.matmul.n_out = (int)w->rows;
    op.matmul.out = V(out);
    return duet_step_op(be, &op);
}

static duet_kv_pages kv_pages(const duet_state *s, int l) {
    return (duet_kv_pages){.k_pool = V(s->k_pool[l]),
                           .v_pool = V(s->v_pool[l]),
                           .block_table = V(s->block_table),
                           .dtype = s->p.kv_type,
                           .block_size = s->p.block_size,
                           .n_blocks = s->p.n_blocks,
                           .n_seqs = s->p.n_seqs,
                           .max_blocks = s->max_blocks};
}

/* Every block a token touches (positions 0..pos of its sequence) must be a
 * real block: device kernels clamp, but a wrong table is a caller bug that
 * deserves an error rather than attention over someone else's tokens. */
static duet_status check_tables(const duet_state *s, const duet_batch *b) {
    for (int i = 0; i < b->n_tokens; i++) {
        const int32_t *row = s->host_table + (size_t)b->seq[i] * s->max_blocks;
        for (int j = 0; j <= b->pos[i] / s->p.block_size; j++)
            if (row[j] < 0 || row[j] >= s->p.n_blocks)
                return duet__error(DUET_INVALID_ARGUMENT,
                                   "forward: sequence slot %d has block %d at table entry %d (pool of %d)",
                                   b->seq[i], row[j], j, s->p.n_blocks);
    }
    return DUET_OK;
}

duet_status duet__forward(duet_state *s, const duet_hparams *hp, const duet_weights *w, const duet_batch *b,
                          float *logits) {
    duet_backend *be = s->be;
    const int n = b->n_tokens;
    if (n < 1 || n > s->p.max_tokens || b->n_out < 0 || b->n_out > s->p.max_out)
        return duet__error(DUET_INVALID_ARGUMENT, "forward: batch of %d tokens / %d outputs exceeds %d / %d",
                           n, b->n_out, s->p.max_tokens, s->p.max_out);
    int n_keys = 0; /* keys the batch's attention sees: its largest position + 1 */
    for (int i = 0; i < n; i++) {
        if (b->tokens[i] < 0 || b->tokens[i] >= hp->n_vocab)
            return duet__error(DUET_INVALID_ARGUMENT, "forward: token id %d out of range [0, %d)",
                               b->tokens[i], hp->n_vocab);
        if (b->pos[i] < 0 || b->pos[i] >= s->p.n_ctx)
            return duet__error(DUET_CONTEXT_FULL, "forward: position %d outside the context of %d", b->pos[i],
                               s->p.n_ctx);
        if (b->seq[i] < 0 || b->seq[i] >= s->p.n_seqs)
            return duet__error(DUET_INVALID_ARGUMENT, "forward: sequence slot %d out of range [0, %d)",
                               b->seq[i], s->p.n_seqs);
        if (b->pos[i] >= n_keys) n_keys = b->pos[i] + 1;
    }
    for (int i = 0; i < b->n_out; i++)
        if (b->out[i] < 0 || b->out[i] >= n)
            return duet__error(DUET_INVALID_ARGUMENT, "forward: output row %d out of range", b->out[i]);

    duet_status st;
    /* Block tables: only the span of sequence rows that changed goes up
     * (usually the one row that gained a block), in one upload. */
    if (b->block_tables) {
        const size_t row_bytes = (size_t)s->max_blocks * sizeof(int32_t);
        int lo = -1, hi = -1;
        for (int r = 0; r < s->p.n_seqs; r++)
            if (memcmp(b->block_tables + (size_t)r * s->max_blocks, s->host_table + (size_t)r * s->max_blocks,
                       row_bytes) != 0) {
                if (lo < 0) lo = r;
                hi = r;
            }
        if (lo >= 0) {
            const size_t off = (size_t)lo * row_bytes, bytes = (size_t)(hi - lo + 1) * row_bytes;
            if ((st =
                     duet_buffer_upload(be, s->block_table, off, (const char *)b->block_tables + off, bytes)))
                return st;
            memcpy((char *)s->host_table + off, (const char *)b->block_tables + off, bytes);
        }
    }
    if ((st = check_tables(s, b))) return st;
    if ((st = duet_buffer_upload(be, s->tokens, 0, b->tokens, (size_t)n * 4)) ||
        (st = duet_buffer_upload(be, s->pos, 0, b->pos, (size_t)n * 4)) ||
        (st = duet_buffer_upload(be, s->seq, 0, b->seq, (size_t)n * 4)) ||
        (b->n_out && (st = duet_buffer_upload(be, s->out, 0, b->out, (size_t)b->n_out * 4))))
        return st;
    if ((st = duet_step_begin(be))) return st;

    const int E = hp->n_embd;
#define TRY(expr)                                                                                            \
    do {                                                                                                     \
        if ((st = (expr))) goto fail;                                                                        \
    } while (0)

    /* x = embed(tokens) */
    duet_op op = {.kind = DUET_OP_EMBED, .n_tokens = n};
    op.embed.tokens = V(s->tokens);
    op.embed.table = V(w->tok_embd.buf);
    op.embed.dtype = w->tok_embd.type;
    op.embed.dim = E;
    op.embed.out = V(s->x);
    TRY(duet_step_op(be, &op));

    for (int l = 0; l < hp->n_layer; l++) {
        const duet_layer *L = &w->layers[l];
        /* attention block */
        const duet_weight *qkv[3] = {&L->wq, &L->wk, &L->wv};
        act xn = act_for(s->xn, s->xn_q8, qkv, 3);
        TRY(op_rmsnorm(be, n, s->x, &L->attn_norm, hp->norm_eps, xn, E));
        TRY(op_matmul(be, n, &L->wq, xn, L->bq.buf ? &L->bq : NULL, false, s->q));
        TRY(op_matmul(be, n, &L->wk, xn, L->bk.buf ? &L->bk : NULL, false, s->k));
        TRY(op_matmul(be, n, &L->wv, xn, L->bv.buf ? &L->bv : NULL, false, s->v));

        if (hp->qk_norm) { /* qwen3: RMS norm of every head of q and k, rows of head_dim */
            TRY(op_rmsnorm(be, n * hp->n_head, s->q, &L->q_norm, hp->norm_eps, (act){s->q, NULL},
                           hp->head_dim));
            TRY(op_rmsnorm(be, n * hp->n_head_kv, s->k, &L->k_norm, hp->norm_eps, (act){s->k, NULL},
                           hp->head_dim));
        }

        op = (duet_op){.kind = DUET_OP_ROPE_KV, .n_tokens = n};
        op.rope_kv.q = V(s->q);
        op.rope_kv.k = V(s->k);
        op.rope_kv.v = V(s->v);
        op.rope_kv.pos = V(s->pos);
        op.rope_kv.seq = V(s->seq);
        op.rope_kv.kv = kv_pages(s, l);
        op.rope_kv.n_head = hp->n_head;
        op.rope_kv.n_head_kv = hp->n_head_kv;
        op.rope_kv.head_dim = hp->head_dim;
        op.rope_kv.n_rot = hp->n_rot;
        op.rope_kv.freqs = V(w->rope_freqs.buf);
        op.rope_kv.mscale = hp->rope_mscale;
        op.rope_kv.neox = hp->rope_neox;
        TRY(duet_step_op(be, &op));

        const duet_weight *wo[1] = {&L->wo};
        act att = act_for(s->att, s->att_q8, wo, 1);
        op = (duet_op){.kind = DUET_OP_ATTENTION, .n_tokens = n};
        op.attention.q = V(s->q);
        op.attention.pos = V(s->pos);
        op.attention.seq = V(s->seq);
        op.attention.kv = kv_pages(s, l);
        op.attention.n_head = hp->n_head;
        op.attention.n_head_kv = hp->n_head_kv;
        op.attention.head_dim = hp->head_dim;
        op.attention.scale = 1.0f / sqrtf((float)hp->head_dim);
        op.attention.n_keys = n_keys;
        op.attention.window = hp->sliding_window;
        op.attention.out = V(att.f32);
        op.attention.out_q8 = V(att.q8);
        TRY(duet_step_op(be, &op));

        TRY(op_matmul(be, n, &L->wo, att, NULL, true, s->x)); /* x += att·Wo */

        /* feed-forward block */
        const duet_weight *gu[2] = {&L->w_gate, &L->w_up};
        xn = act_for(s->xn, s->xn_q8, gu, 2);
        TRY(op_rmsnorm(be, n, s->x, &L->ffn_norm, hp->norm_eps, xn, E));
        TRY(op_matmul(be, n, &L->w_gate, xn, NULL, false, s->gate));
        TRY(op_matmul(be, n, &L->w_up, xn, NULL, false, s->up));
        const duet_weight *wd[1] = {&L->w_down};
        act g = act_for(s->gate, s->gate_q8, wd, 1);
        op = (duet_op){.kind = DUET_OP_SWIGLU, .n_tokens = n};
        op.swiglu.gate = V(s->gate);
        op.swiglu.up = V(s->up);
        op.swiglu.out = V(g.f32);
        op.swiglu.out_q8 = V(g.q8);
        op.swiglu.dim = hp->n_ff;
        TRY(duet_step_op(be, &op));
        TRY(op_matmul(be, n, &L->w_down, g, NULL, true, s->x)); /* x += ffn·Wd */
    }

    if (b->n_out > 0) {
        /* Only rows that need logits go through the (large) output matmul. */
        op = (duet_op){.kind = DUET_OP_GATHER_ROWS, .n_tokens = b->n_out};
        op.gather.x = V(s->x);
        op.gather.rows = V(s->out);
        op.gather.out = V(s->xo);
        op.gather.dim = E;
        TRY(duet_step_op(be, &op));
        const duet_weight *wout[1] = {&w->output};
        act xn = act_for(s->xn, s->xn_q8, wout, 1);
        TRY(op_rmsnorm(be, b->n_out, s->xo, &w->output_norm, hp->norm_eps, xn, E));
        TRY(op_matmul(be, b->n_out, &w->output, xn, NULL, false, s->logits));
    }
#undef TRY
    if ((st = duet_step_submit(be)) || (st = duet_step_wait(be))) return st;
    if (b->n_out > 0 && logits)
        return duet_buffer_download(be, s->logits, 0, logits, (size_t)b->n_out * hp->n_vocab * sizeof(float));
    return DUET_OK;
fail:;
    /* Close the step so the backend is ready for the next one, keeping the
     * message of the op that failed (closing may set its own). */
    char msg[512];
    snprintf(msg, sizeof msg, "%s", duet_last_error());
    duet_step_submit(be);
    duet_step_wait(be);
    return duet__error(st, "%s", msg);
}
