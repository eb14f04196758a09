/* model.h — a Llama-family model: hyperparameters from GGUF metadata and its
 * weights, mapped from GGUF tensor names and uploaded to a backend once. */
#ifndef DUET_MODEL_H
#define DUET_MODEL_H

#include "../backends/backend.h"
#include "gguf.h"

typedef struct duet_hparams {
    char arch[32];       /* "llama", "qwen2", "mistral" */
    int n_vocab;
    int n_embd;          /* model width */
    int n_layer;
    int n_head, n_head_kv;
    int head_dim;        /* n_embd / n_head unless attention.key_length says otherwise */
    int n_rot;           /* rotated dims per head */
    int n_ff;            /* feed-forward width */
    int n_ctx_train;
    float norm_eps;
    float rope_base;
    bool rope_neox;      /* pairs (i, i + n_rot/2): qwen2; adjacent pairs: llama, mistral */
    bool qkv_bias;       /* qwen2 */
} duet_hparams;

/* A weight on the device: rows x cols in `type` (GGUF ne0 = cols). */
typedef struct duet_weight {
    duet_buffer *buf;
    duet_dtype type;
    int64_t rows, cols;
} duet_weight;

typedef struct duet_layer {
    duet_weight attn_norm;       /* f32 [n_embd] */
    duet_weight wq, wk, wv, wo;  /* [n_head*hd][n_embd], [n_kv*hd][n_embd] x2, [n_embd][n_head*hd] */
    duet_weight bq, bk, bv;      /* f32 biases (qwen2), buf NULL otherwise */
    duet_weight ffn_norm;        /* f32 [n_embd] */
    duet_weight w_gate, w_up;    /* [n_ff][n_embd] */
    duet_weight w_down;          /* [n_embd][n_ff] */
} duet_layer;

typedef struct duet_weights {
    duet_weight tok_embd;    /* [n_vocab][n_embd] */
    duet_weight output_norm; /* f32 [n_embd] */
    duet_weight output;      /* [n_vocab][n_embd]; shares tok_embd's buffer when tied */
    bool tied;
    duet_layer *layers;      /* n_layer */
    int n_layer;
    uint64_t bytes;          /* bytes read per token (embedding row aside) */
} duet_weights;

/* Reads and checks hyperparameters; DUET_BAD_MODEL / DUET_UNSUPPORTED with
 * a message naming the key when something is missing or inconsistent. */
duet_status duet__hparams_load(const duet_gguf *g, duet_hparams *hp);

/* Finds, checks and uploads every weight. Norms and biases become f32. */
duet_status duet__weights_load(const duet_gguf *g, const duet_hparams *hp, duet_backend *be,
                               duet_weights *w);
void duet__weights_free(duet_backend *be, duet_weights *w);

#endif /* DUET_MODEL_H */
