/* forward.h — one forward step of a Llama-family model, written once against
 * the HAL. A step evaluates a ragged batch: tokens of several sequences at
 * their own positions, and returns logits for the rows that ask for them. */
#ifndef DUET_FORWARD_H
#define DUET_FORWARD_H

#include "model.h"

typedef struct duet_batch {
    int n_tokens;
    const int32_t *tokens; /* [n_tokens] */
    const int32_t *pos;    /* [n_tokens] position of each token in its sequence */
    const int32_t *seq;    /* [n_tokens] sequence slot of each token */
    int n_out;             /* rows whose logits are wanted */
    const int32_t *out;    /* [n_out] indices into the batch */
} duet_batch;

/* Run state: activations sized for the largest step and the KV cache,
 * allocated once per instance, never per step. */
typedef struct duet_state {
    duet_backend *be;
    int max_tokens, max_out, n_ctx, n_seqs;
    duet_dtype kv_type;
    duet_buffer *x;      /* f32 [max_tokens][n_embd] residual stream */
    duet_buffer *xn;     /* f32 [max_tokens][n_embd] normed input of a block */
    duet_buffer *q;      /* f32 [max_tokens][n_head*head_dim] */
    duet_buffer *k, *v;  /* f32 [max_tokens][n_head_kv*head_dim] */
    duet_buffer *att;    /* f32 [max_tokens][n_head*head_dim] attention output */
    duet_buffer *gate;   /* f32 [max_tokens][n_ff] silu(gate)*up lands here */
    duet_buffer *up;     /* f32 [max_tokens][n_ff] */
    duet_buffer *xo;     /* f32 [max_out][n_embd] rows that produce logits */
    duet_buffer *logits; /* f32 [max_out][n_vocab] */
    duet_buffer *tokens, *pos, *seq, *out; /* i32 batch inputs */
    duet_buffer **k_cache, **v_cache;      /* per layer: kv_type [n_seqs][n_ctx][n_head_kv*head_dim] */
    int n_layer;
} duet_state;

duet_status duet__state_new(duet_backend *be, const duet_hparams *hp, int max_tokens, int max_out, int n_ctx,
                            int n_seqs, duet_dtype kv_type, duet_state **out);
void duet__state_free(duet_state *s);

/* Runs one step; writes n_out x n_vocab logits to `logits` (host memory). */
duet_status duet__forward(duet_state *s, const duet_hparams *hp, const duet_weights *w, const duet_batch *b,
                          float *logits);

#endif /* DUET_FORWARD_H */
