/* model.h — a Llama-family model: hyperparameters from GGUF metadata and its
 * weights, mapped from GGUF tensor names and uploaded to a backend once. */
#ifndef DUET_MODEL_H
#define DUET_MODEL_H

#include "../backends/backend.h"
#include "gguf.h"

/* RoPE scaling as the file's <arch>.rope.scaling.* keys give it (llama.cpp's
 * names and defaults). */
typedef enum duet_rope_scaling {
    DUET_ROPE_SCALING_NONE,
    DUET_ROPE_SCALING_LINEAR, /* positions divided by factor */
    DUET_ROPE_SCALING_YARN,   /* linear on low frequencies, none on high ones, a ramp between */
} duet_rope_scaling;

typedef struct duet_hparams {
    char arch[32]; /* "llama", "mistral", "qwen2", "qwen3" */
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
    bool rope_neox;      /* pairs (i, i + n_rot/2): qwen2, qwen3; adjacent pairs: llama, mistral */
    bool qkv_bias;       /* qwen2 */
    bool qk_norm;        /* qwen3: per-head RMS norm of q and k before RoPE */
    /* RoPE scaling (rope.scaling.*): the inverse frequencies of
     * duet__rope_freqs and the cos/sin scale rope_mscale follow from these
     * and the file's optional rope_freqs tensor (Llama 3.1's per-band factors). */
    duet_rope_scaling rope_scaling;
    float rope_factor;      /* scaling.factor (1: none) */
    int rope_n_ctx_orig;    /* scaling.original_context_length (YaRN), else context_length */
    float rope_attn_factor; /* scaling.attn_factor */
    float yarn_ext_factor;  /* scaling.yarn_ext_factor: 1 for YaRN, 0 otherwise, unless given */
    float yarn_beta_fast, yarn_beta_slow;
    float rope_mscale;  /* what cos and sin are multiplied by (YaRN's magnitude correction) */
    int sliding_window; /* attention.sliding_window: a token sees the last this many; 0: all */
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
    duet_weight q_norm, k_norm;  /* f32 [head_dim] (qwen3), buf NULL otherwise */
    duet_weight ffn_norm;        /* f32 [n_embd] */
    duet_weight w_gate, w_up;    /* [n_ff][n_embd] */
    duet_weight w_down;          /* [n_embd][n_ff] */
} duet_layer;

typedef struct duet_weights {
    duet_weight tok_embd;    /* [n_vocab][n_embd] */
    duet_weight output_norm; /* f32 [n_embd] */
    duet_weight output;      /* [n_vocab][n_embd]; shares tok_embd's buffer when tied */
    bool tied;
    duet_weight rope_freqs;  /* f32 [n_rot/2]: the rope_kv op's inverse frequencies */
    duet_layer *layers;      /* n_layer */
    int n_layer;
    uint64_t bytes;          /* bytes read per token (embedding row aside) */
} duet_weights;

/* Reads and checks hyperparameters; DUET_BAD_MODEL / DUET_UNSUPPORTED with
 * a message naming the key when something is missing or inconsistent. */
duet_status duet__hparams_load(const duet_gguf *g, duet_hparams *hp);

/* The inverse frequency of each of the n_rot/2 rotary pairs: base^(-2i/n_rot)
 * divided by factors[i] (the rope_freqs tensor, or NULL), then scaled as
 * hp->rope_scaling says (llama.cpp's rope_yarn, folded into one number per
 * pair: its angles are linear in the position). */
void duet__rope_freqs(const duet_hparams *hp, const float *factors, float *freqs);

/* Finds, checks and uploads every weight. Norms and biases become f32. */
duet_status duet__weights_load(const duet_gguf *g, const duet_hparams *hp, duet_backend *be,
                               duet_weights *w);
void duet__weights_free(duet_backend *be, duet_weights *w);

#endif /* DUET_MODEL_H */
