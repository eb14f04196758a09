/* op_oracle.h — the one reference implementation of every HAL op.
 *
 * Every parity test checks backends against these functions (test_backend_ops
 * on the shared case table, the per-backend tests, test_forward's whole-model
 * reference). They run on host memory, straight from the definitions in
 * backends/backend.h, one function per op:
 *
 *   - Weights and KV rows of any dtype are read through duet_dequantize_row,
 *     so a new weight type needs nothing here but its dequantizer in
 *     backends/dtype.c.
 *   - Dot products, the softmax and rmsnorm's sum of squares accumulate in
 *     double; every output is then rounded once to f32, as the HAL defines
 *     its outputs.
 *   - q8_0 outputs (out_q8) are duet_quantize_row_q8_0 of that f32 output,
 *     the definition backend.h gives; q8_0 inputs (x_q8) are read as their
 *     exact values d * q.
 *   - In-place forms the HAL allows (rmsnorm, attention and swiglu/add with
 *     out over an input) give the same result as separate buffers.
 *
 * The paged KV cache has one host model, oracle_kv: the pools and the block
 * table in the HAL's layout (a test uploads them as they are), written and
 * read by (sequence, position). rope_kv stores into it, attention reads it.
 *
 * oracle_run() takes an op descriptor whose views point at host memory
 * (through a caller's map from view to pointer), so the shared case table
 * describes each op once for the backends and for the oracle.
 *
 * Programmer errors (a table entry outside the pools for a position an op
 * reads) abort with a message: the oracle is only run on valid operands. */
#ifndef DUET_OP_ORACLE_H
#define DUET_OP_ORACLE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "../backends/backend.h"

/* ---- the paged KV cache ------------------------------------------------------ */

typedef struct oracle_kv {
    duet_dtype dtype;       /* f32, f16 or q8_0 */
    int width;              /* values in a token's row: n_head_kv * head_dim */
    int block_size;         /* tokens per block */
    int n_blocks;           /* blocks in each pool */
    int n_seqs, max_blocks; /* block table shape */
    size_t row_bytes;       /* duet_dtype_row_bytes(dtype, width) */
    uint8_t *k, *v;         /* pools: n_blocks * block_size rows of row_bytes */
    int32_t *table;         /* [n_seqs][max_blocks]: the block holding positions b*block_size.. */
    bool owned;             /* k, v and table were allocated by oracle_kv_alloc */
} oracle_kv;

/* Allocates zeroed pools and a table of -1 (no block). */
void oracle_kv_alloc(oracle_kv *kv, duet_dtype dtype, int width, int block_size, int n_blocks, int n_seqs,
                     int max_blocks);
/* A model over memory the caller owns (host images of a backend's operands). */
oracle_kv oracle_kv_wrap(const duet_kv_pages *pages, int width, uint8_t *k_pool, uint8_t *v_pool,
                         int32_t *table);
void oracle_kv_free(oracle_kv *kv);
/* dst: a copy of src's shape, pools and table that dst owns. */
void oracle_kv_clone(oracle_kv *dst, const oracle_kv *src);

size_t oracle_kv_pool_bytes(const oracle_kv *kv);
size_t oracle_kv_table_bytes(const oracle_kv *kv);

/* Hands sequence s the blocks covering lens[s] tokens, in the order of a
 * shuffle of the whole pool (seeded), so neighbouring positions live far
 * apart and the blocks left over are owned by nobody; table entries past a
 * sequence's blocks get `unused` (-1, or garbage no kernel may follow). */
void oracle_kv_scatter(oracle_kv *kv, const int *lens, int32_t unused, uint64_t seed);
/* Every pool row random: k values in [-k_scale, k_scale), v in [-v_scale,
 * v_scale), converted to the pool's dtype (seeded). */
void oracle_kv_fill(oracle_kv *kv, uint64_t seed, float k_scale, float v_scale);

/* The pool row of (seq, pos), or -1 when its table entry is outside the pools. */
int64_t oracle_kv_row(const oracle_kv *kv, int seq, int pos);
/* Row `row` of a pool (kv->k, kv->v, or a device image of one) as f32. */
void oracle_kv_load(const oracle_kv *kv, const uint8_t *pool, int64_t row, float *out);
/* Stores k and v (f32, width values each) at (seq, pos), converted to the pool's dtype. */
void oracle_kv_store(oracle_kv *kv, int seq, int pos, const float *k, const float *v);

/* The HAL descriptor of device copies of this cache. */
duet_kv_pages oracle_kv_pages(const oracle_kv *kv, duet_view k_pool, duet_view v_pool, duet_view table);

/* ---- ops ----------------------------------------------------------------------- */

/* out[t][:] = f32(table[tokens[t]][:]) */
void oracle_embed(const int32_t *tokens, int n_tokens, const void *table, duet_dtype dtype, int dim,
                  float *out);

/* out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w; out and/or out_q8 may be NULL;
 * out may be x. */
void oracle_rmsnorm(const float *x, const float *w, int n_tokens, int dim, float eps, float *out,
                    duet_block_q8_0 *out_q8);

/* out[t][o] = sum_i W[o][i] x[t][i] (+ bias[o]) (+ out[t][o] when accumulate).
 * W is [n_out][n_in] in any dtype duet_dequantize_row reads; x_q8, when not
 * NULL, is read instead of x (n_in / 32 blocks a token); bias may be NULL. */
void oracle_matmul(const void *w, duet_dtype dtype, const float *x, const duet_block_q8_0 *x_q8,
                   const float *bias, bool accumulate, int n_tokens, int n_in, int n_out, float *out);

/* The plain RoPE table: freqs[i] = base^(-2i/n_rot), for i < n_rot/2. */
void oracle_rope_freqs(float base, int n_rot, float *freqs);

/* Rotates one token's heads in place: pairs (2i, 2i+1), or (i, i + n_rot/2)
 * with neox, by theta_i = pos * freqs[i], for i < n_rot/2; cos and sin
 * scaled by mscale (0 reads as 1). */
void oracle_rope(float *x, int n_heads, int head_dim, int n_rot, const float *freqs, float mscale, bool neox,
                 int pos);

/* rope_kv: rotates q and k in place and stores k and v at (seq[t], pos[t]). */
void oracle_rope_kv(float *q, float *k, const float *v, const int32_t *pos, const int32_t *seq, int n_tokens,
                    int n_head, int n_head_kv, int head_dim, int n_rot, const float *freqs, float mscale,
                    bool neox, oracle_kv *kv);

/* Causal attention: token t attends to positions 0..pos[t] of sequence
 * seq[t] through the cache (head h reads KV head h / (n_head / n_head_kv)),
 * or with window > 0 only to pos[t] - window + 1 .. pos[t].
 * out and/or out_q8 may be NULL; out may be q. */
void oracle_attention(const float *q, const int32_t *pos, const int32_t *seq, int n_tokens, int n_head,
                      int n_head_kv, int head_dim, float scale, int window, const oracle_kv *kv, float *out,
                      duet_block_q8_0 *out_q8);

/* out = silu(gate) * up; out and/or out_q8 may be NULL; out may be gate or up. */
void oracle_swiglu(const float *gate, const float *up, int n_tokens, int dim, float *out,
                   duet_block_q8_0 *out_q8);

/* out = a + b; out may be a or b. */
void oracle_add(const float *a, const float *b, int n_tokens, int dim, float *out);

/* out[t][:] = x[rows[t]][:] */
void oracle_gather_rows(const float *x, const int32_t *rows, int n_tokens, int dim, float *out);

/* out[t] = the index of row t's largest value: the lowest index among ties,
 * NaN never wins (a row of NaN only gives 0). */
void oracle_argmax(const float *x, int n_tokens, int dim, int32_t *out);

/* ---- a descriptor on host memory --------------------------------------------- */

/* The host address of view v (NULL for an absent view, buf == NULL). */
typedef uint8_t *(*oracle_map_fn)(void *ctx, duet_view v);

/* Runs `op` with every view resolved by `map`. */
void oracle_run(const duet_op *op, oracle_map_fn map, void *ctx);

#endif /* DUET_OP_ORACLE_H */
