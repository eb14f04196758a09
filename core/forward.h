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
    /* KV block tables [n_seqs][max_blocks] (the paged cache's, see
     * kv_blocks.h); NULL keeps the tables of the previous step (at first the
     * identity: slot s owns blocks s*max_blocks ...). */
    const int32_t *block_tables;
} duet_batch;

/* Sizes of a run state. */
typedef struct duet_state_params {
    int max_tokens, max_out; /* largest step: tokens and logit rows */
    int n_ctx, n_seqs;       /* positions per sequence, sequence slots */
    duet_dtype kv_type;      /* f32, f16 or q8_0 */
    int block_size;          /* tokens per KV block; 0 = 16 */
    int n_blocks;            /* blocks per pool; 0 = n_seqs * ceil(n_ctx / block_size) */
} duet_state_params;

/* Run state: activations sized for the largest step and the paged KV
 * cache, allocated once per instance, never per step. */
typedef struct duet_state {
    duet_backend *be;
    duet_state_params p;
    int max_blocks;      /* table entries per sequence: ceil(n_ctx / block_size) */
    duet_buffer *x;      /* f32 [max_tokens][n_embd] residual stream */
    duet_buffer *xn;     /* f32 [max_tokens][n_embd] normed input of a block */
    duet_buffer *q;      /* f32 [max_tokens][n_head*head_dim] */
    duet_buffer *k, *v;  /* f32 [max_tokens][n_head_kv*head_dim] */
    duet_buffer *att;    /* f32 [max_tokens][n_head*head_dim] attention output */
    duet_buffer *gate;   /* f32 [max_tokens][n_ff] silu(gate)*up lands here */
    duet_buffer *up;     /* f32 [max_tokens][n_ff] */
    duet_buffer *xo;     /* f32 [max_out][n_embd] rows that produce logits */
    duet_buffer *logits; /* f32 [max_out][n_vocab] */
    /* q8_0 copies of xn, att and gate for the int8 matmuls (NULL if unused). */
    duet_buffer *xn_q8, *att_q8, *gate_q8;
    duet_buffer *tokens, *pos, *seq, *out; /* i32 batch inputs */
    duet_buffer *block_table;              /* i32 [n_seqs][max_blocks] */
    int32_t *host_table;                   /* what block_table holds, for checks */
    duet_buffer **k_pool, **v_pool;        /* per layer: kv_type [n_blocks][block_size][kv width] */
    int n_layer;
} duet_state;

duet_status duet__state_new(duet_backend *be, const duet_hparams *hp, const duet_weights *w,
                            const duet_state_params *p, duet_state **out);
void duet__state_free(duet_state *s);

/* Runs one step; writes n_out x n_vocab logits to `logits` (host memory). */
duet_status duet__forward(duet_state *s, const duet_hparams *hp, const duet_weights *w, const duet_batch *b,
                          float *logits);

#endif /* DUET_FORWARD_H */
