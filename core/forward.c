/* forward.c — the Llama forward pass as a stream of HAL ops.
 *
 *   x = embed(tokens)
 *   per layer:  xn = rmsnorm(x);  q,k,v = xn·Wq,Wk,Wv (+bias);  rope(q,k) + store k,v
 *               att = attention(q, cache);  x += att·Wo            (fused residual)
 *               xn = rmsnorm(x);  gate = silu(xn·Wg) * (xn·Wu);  x += gate·Wd
 *   logits = rmsnorm(x[out rows])·Wout
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "forward.h"

static duet_view V(duet_buffer *b) { return (duet_view){b, 0}; }

duet_status duet__state_new(duet_backend *be, const duet_hparams *hp, int max_tokens, int max_out, int n_ctx,
                            int n_seqs, duet_dtype kv_type, duet_state **out) {
    *out = NULL;
    if (max_tokens < 1 || max_out < 1 || max_out > max_tokens || n_ctx < 1 || n_seqs < 1)
        return duet__error(DUET_INVALID_ARGUMENT, "state: bad sizes (tokens %d, out %d, ctx %d, seqs %d)",
                           max_tokens, max_out, n_ctx, n_seqs);
    if (kv_type != DUET_DTYPE_F32 && kv_type != DUET_DTYPE_F16)
        return duet__error(DUET_UNSUPPORTED, "state: kv cache type must be f32 or f16");
    duet_state *s = calloc(1, sizeof *s);
    if (!s) return duet__error(DUET_OUT_OF_MEMORY, "state: out of memory");
    s->be = be;
    s->max_tokens = max_tokens;
    s->max_out = max_out;
    s->n_ctx = n_ctx;
    s->n_seqs = n_seqs;
    s->kv_type = kv_type;
    s->n_layer = hp->n_layer;
    const size_t T = (size_t)max_tokens, F4 = sizeof(float);
    const size_t qw = (size_t)hp->n_head * hp->head_dim, kvw = (size_t)hp->n_head_kv * hp->head_dim;
    duet_status st;
    if ((st = duet_buffer_alloc(be, T * hp->n_embd * F4, &s->x)) ||
        (st = duet_buffer_alloc(be, T * hp->n_embd * F4, &s->xn)) ||
        (st = duet_buffer_alloc(be, T * qw * F4, &s->q)) || (st = duet_buffer_alloc(be, T * kvw * F4, &s->k)) ||
        (st = duet_buffer_alloc(be, T * kvw * F4, &s->v)) || (st = duet_buffer_alloc(be, T * qw * F4, &s->att)) ||
        (st = duet_buffer_alloc(be, T * hp->n_ff * F4, &s->gate)) ||
        (st = duet_buffer_alloc(be, T * hp->n_ff * F4, &s->up)) ||
        (st = duet_buffer_alloc(be, (size_t)max_out * hp->n_embd * F4, &s->xo)) ||
        (st = duet_buffer_alloc(be, (size_t)max_out * hp->n_vocab * F4, &s->logits)) ||
        (st = duet_buffer_alloc(be, T * 4, &s->tokens)) || (st = duet_buffer_alloc(be, T * 4, &s->pos)) ||
        (st = duet_buffer_alloc(be, T * 4, &s->seq)) || (st = duet_buffer_alloc(be, T * 4, &s->out)))
        goto fail;
    s->k_cache = calloc((size_t)hp->n_layer, sizeof *s->k_cache);
    s->v_cache = calloc((size_t)hp->n_layer, sizeof *s->v_cache);
    if (!s->k_cache || !s->v_cache) {
        st = duet__error(DUET_OUT_OF_MEMORY, "state: out of memory");
        goto fail;
    }
    const size_t cache_bytes = duet_dtype_row_bytes(kv_type, (int64_t)kvw) * (size_t)n_ctx * (size_t)n_seqs;
    for (int l = 0; l < hp->n_layer; l++)
        if ((st = duet_buffer_alloc(be, cache_bytes, &s->k_cache[l])) ||
            (st = duet_buffer_alloc(be, cache_bytes, &s->v_cache[l])))
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
    duet_buffer *bufs[] = {s->x,  s->xn,     s->q,      s->k,      s->v,   s->att, s->gate,
                           s->up, s->xo,     s->logits, s->tokens, s->pos, s->seq, s->out};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) duet_buffer_free(be, bufs[i]);
    for (int l = 0; l < s->n_layer; l++) {
        if (s->k_cache) duet_buffer_free(be, s->k_cache[l]);
        if (s->v_cache) duet_buffer_free(be, s->v_cache[l]);
    }
    free(s->k_cache);
    free(s->v_cache);
    free(s);
}

/* ---- op builders: one short function per op keeps forward() readable ---- */

static duet_status op_rmsnorm(duet_backend *be, int n, duet_buffer *x, const duet_weight *w, float eps,
                              duet_buffer *out, int dim) {
    duet_op op = {.kind = DUET_OP_RMSNORM, .n_tokens = n};
    op.rmsnorm.x = V(x);
    op.rmsnorm.w = V(w->buf);
    op.rmsnorm.out = V(out);
    op.rmsnorm.dim = dim;
    op.rmsnorm.eps = eps;
    return duet_step_op(be, &op);
}

/* out = x·Wᵀ (+ bias) (+ out when accumulate). */
static duet_status op_matmul(duet_backend *be, int n, const duet_weight *w, duet_buffer *x,
                             const duet_weight *bias, bool accumulate, duet_buffer *out) {
    duet_op op = {.kind = DUET_OP_MATMUL, .n_tokens = n};
    op.matmul.w = V(w->buf);
    op.matmul.dtype = w->type;
    op.matmul.x = V(x);
    op.matmul.bias = V(bias ? bias->buf : NULL);
    op.matmul.accumulate = accumulate;
    op.matmul.n_in = (int)w->cols;
    op.matmul.n_out = (int)w->rows;
    op.matmul.out = V(out);
    return duet_step_op(be, &op);
}

duet_status duet__forward(duet_state *s, const duet_hparams *hp, const duet_weights *w, const duet_batch *b,
                          float *logits) {
    duet_backend *be = s->be;
    const int n = b->n_tokens;
    if (n < 1 || n > s->max_tokens || b->n_out < 0 || b->n_out > s->max_out)
        return duet__error(DUET_INVALID_ARGUMENT, "forward: batch of %d tokens / %d outputs exceeds %d / %d", n,
                           b->n_out, s->max_tokens, s->max_out);
    for (int i = 0; i < n; i++) {
        if (b->tokens[i] < 0 || b->tokens[i] >= hp->n_vocab)
            return duet__error(DUET_INVALID_ARGUMENT, "forward: token id %d out of range [0, %d)", b->tokens[i],
                               hp->n_vocab);
        if (b->pos[i] < 0 || b->pos[i] >= s->n_ctx)
            return duet__error(DUET_CONTEXT_FULL, "forward: position %d outside the context of %d", b->pos[i],
                               s->n_ctx);
        if (b->seq[i] < 0 || b->seq[i] >= s->n_seqs)
            return duet__error(DUET_INVALID_ARGUMENT, "forward: sequence slot %d out of range [0, %d)",
                               b->seq[i], s->n_seqs);
    }
    for (int i = 0; i < b->n_out; i++)
        if (b->out[i] < 0 || b->out[i] >= n)
            return duet__error(DUET_INVALID_ARGUMENT, "forward: output row %d out of range", b->out[i]);

    duet_status st;
    if ((st = duet_buffer_upload(be, s->tokens, 0, b->tokens, (size_t)n * 4)) ||
        (st = duet_buffer_upload(be, s->pos, 0, b->pos, (size_t)n * 4)) ||
        (st = duet_buffer_upload(be, s->seq, 0, b->seq, (size_t)n * 4)) ||
        (b->n_out && (st = duet_buffer_upload(be, s->out, 0, b->out, (size_t)b->n_out * 4))))
        return st;
    if ((st = duet_step_begin(be))) return st;

    const int E = hp->n_embd;
#define TRY(expr)                                                                                        \
    do {                                                                                                 \
        if ((st = (expr))) goto fail;                                                                    \
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
        TRY(op_rmsnorm(be, n, s->x, &L->attn_norm, hp->norm_eps, s->xn, E));
        TRY(op_matmul(be, n, &L->wq, s->xn, L->bq.buf ? &L->bq : NULL, false, s->q));
        TRY(op_matmul(be, n, &L->wk, s->xn, L->bk.buf ? &L->bk : NULL, false, s->k));
        TRY(op_matmul(be, n, &L->wv, s->xn, L->bv.buf ? &L->bv : NULL, false, s->v));

        op = (duet_op){.kind = DUET_OP_ROPE_KV, .n_tokens = n};
        op.rope_kv.q = V(s->q);
        op.rope_kv.k = V(s->k);
        op.rope_kv.v = V(s->v);
        op.rope_kv.pos = V(s->pos);
        op.rope_kv.seq = V(s->seq);
        op.rope_kv.k_cache = V(s->k_cache[l]);
        op.rope_kv.v_cache = V(s->v_cache[l]);
        op.rope_kv.kv_dtype = s->kv_type;
        op.rope_kv.n_head = hp->n_head;
        op.rope_kv.n_head_kv = hp->n_head_kv;
        op.rope_kv.head_dim = hp->head_dim;
        op.rope_kv.n_rot = hp->n_rot;
        op.rope_kv.n_ctx = s->n_ctx;
        op.rope_kv.freq_base = hp->rope_base;
        op.rope_kv.neox = hp->rope_neox;
        TRY(duet_step_op(be, &op));

        op = (duet_op){.kind = DUET_OP_ATTENTION, .n_tokens = n};
        op.attention.q = V(s->q);
        op.attention.pos = V(s->pos);
        op.attention.seq = V(s->seq);
        op.attention.k_cache = V(s->k_cache[l]);
        op.attention.v_cache = V(s->v_cache[l]);
        op.attention.kv_dtype = s->kv_type;
        op.attention.n_head = hp->n_head;
        op.attention.n_head_kv = hp->n_head_kv;
        op.attention.head_dim = hp->head_dim;
        op.attention.n_ctx = s->n_ctx;
        op.attention.scale = 1.0f / sqrtf((float)hp->head_dim);
        op.attention.out = V(s->att);
        TRY(duet_step_op(be, &op));

        TRY(op_matmul(be, n, &L->wo, s->att, NULL, true, s->x)); /* x += att·Wo */

        /* feed-forward block */
        TRY(op_rmsnorm(be, n, s->x, &L->ffn_norm, hp->norm_eps, s->xn, E));
        TRY(op_matmul(be, n, &L->w_gate, s->xn, NULL, false, s->gate));
        TRY(op_matmul(be, n, &L->w_up, s->xn, NULL, false, s->up));
        op = (duet_op){.kind = DUET_OP_SWIGLU, .n_tokens = n};
        op.swiglu.gate = V(s->gate);
        op.swiglu.up = V(s->up);
        op.swiglu.out = V(s->gate);
        op.swiglu.dim = hp->n_ff;
        TRY(duet_step_op(be, &op));
        TRY(op_matmul(be, n, &L->w_down, s->gate, NULL, true, s->x)); /* x += ffn·Wd */
    }

    if (b->n_out > 0) {
        /* Only rows that need logits go through the (large) output matmul. */
        op = (duet_op){.kind = DUET_OP_GATHER_ROWS, .n_tokens = b->n_out};
        op.gather.x = V(s->x);
        op.gather.rows = V(s->out);
        op.gather.out = V(s->xo);
        op.gather.dim = E;
        TRY(duet_step_op(be, &op));
        TRY(op_rmsnorm(be, b->n_out, s->xo, &w->output_norm, hp->norm_eps, s->xn, E));
        TRY(op_matmul(be, b->n_out, &w->output, s->xn, NULL, false, s->logits));
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
