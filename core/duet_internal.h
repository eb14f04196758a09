/* duet_internal.h — the model handle's insides, shared by the public API
 * (duet.c) and the serving engine (engine.c). Not installed. */
#ifndef DUET_INTERNAL_H
#define DUET_INTERNAL_H

#include "duet.h"
#include "forward.h"
#include "tokenizer.h"

struct duet_model {
    duet_gguf *gguf;
    duet_tokenizer *tok;
    duet_hparams hp;
    bool vocab_only;
    duet_backend *be;
    duet_weights w;
    duet_state *state;    /* activations for max_step_tokens, KV for n_seqs */
    float *logits;        /* host [max_out][n_vocab] */
    int n_ctx, n_seqs;
    int max_step_tokens, max_out;
    size_t detok_size; /* bytes a detokenizer buffer needs for any one token */
};

/* duet_model_open with the step sizes the caller needs (the engine batches
 * up to max_step_tokens tokens and max_out logit rows per step) and the
 * paged KV cache's geometry (kv_block_size 0 = 16; kv_blocks 0 = enough
 * for every slot at full context, with identity block tables). */
duet_status duet__model_open(const char *path, const duet_open_params *params, int max_step_tokens, int max_out,
                             int kv_block_size, int kv_blocks, duet_model **out);

#endif
