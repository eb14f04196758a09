/* backend_ops_cases.h — the one case table of the backend op tests.
 *
 * Each case is an op x dtype x shape class. tests/test_backend_ops.c runs
 * the BO_TEST cases on every device of every backend, under each of the
 * backend's tuning variants (bo_variants below: every forced path),
 * against the oracle (tests/op_oracle.h); bench/bench_backend_ops.c times
 * the BO_PERF cases. Both build the operands here, from the same
 * deterministic data, so a benchmark number always belongs to a shape the
 * parity test covers.
 *
 * Shapes include ragged sizes (not a multiple of any tile: 7, 37, 100,
 * 129...), single-token and multi-token batches, GQA, several sequences in
 * one batch and positions up to a few hundred. Every operand lives at a
 * non-zero offset inside a larger buffer: the bytes around it are guard
 * bytes that the test checks after the op (an out-of-bounds write shows).
 *
 * Backend-agnostic: only backends/backend.h (and the oracle's declarations:
 * bo_host_oracle needs tests/op_oracle.c linked). */
#ifndef DUET_BACKEND_OPS_CASES_H
#define DUET_BACKEND_OPS_CASES_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "op_oracle.h"

enum {
    BO_TEST = 1,  /* parity test */
    BO_PERF = 2,  /* benchmark */
    BO_SMALL = 4, /* small enough for a simulator (oclgrind) */
    BO_PATHS = 8, /* with the small ones, what a forced attention path runs (tuning variants below) */
    BO_HOT = 16,  /* benchmark: weights stay in cache (no rotating pool for a one-token matmul) */
};

typedef struct bo_case {
    const char *shape; /* shape class: "decode", "prefill", "ragged", "gqa", ... */
    duet_op_kind kind;
    duet_dtype dtype; /* weights (embed, matmul) or the KV cache (rope_kv, attention); else f32 */
    int n_tokens;
    int dim;  /* embed/rmsnorm/swiglu/add/gather/argmax: row width; matmul: n_in; rope/attention: head_dim */
    int rows; /* embed: vocab rows; gather: rows of x; matmul: n_out; rope/attention: n_ctx */
    int n_head, n_head_kv, n_seqs, pos0, n_rot; /* rope/attention */
    bool bias, accumulate, neox, inplace;
    unsigned modes;
    /* rmsnorm/swiglu/attention: 1 = out and out_q8, 2 = out_q8 only;
     * matmul (q8_0): 1 = x as pre-quantised x_q8. */
    int q8act;
    int block;   /* rope/attention: KV block size (0 = 16) */
    int lens[6]; /* rope/attention: context length of each sequence (0 = from pos0) */
    int window;  /* rope: a scaled table (uneven per-pair factors, mscale) when 1;
                  * attention: the sliding window (0 = none) */
} bo_case;

#define F32 DUET_DTYPE_F32
#define F16 DUET_DTYPE_F16
#define BF16 DUET_DTYPE_BF16
#define Q8 DUET_DTYPE_Q8_0
#define T BO_TEST
#define P BO_PERF
#define S BO_SMALL
#define PA BO_PATHS
#define H BO_HOT

/* Trailing fields (q8act, block, lens) default to 0 where a row stops. */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"
/* clang-format off */
// clang-format off
static const bo_case bo_cases[] = {
    /* shape        kind                 dtype tok  dim   rows   nh nkv seqs pos0 rot  bias  acc    neox   inplace modes */
    {"decode",      DUET_OP_EMBED,       F32,   1,  64,    100,  0, 0, 0, 0, 0, false, false, false, false, T|S},
    {"prefill",     DUET_OP_EMBED,       F32,  37, 100,    50,   0, 0, 0, 0, 0, false, false, false, false, T},
    {"prefill",     DUET_OP_EMBED,       F16,  37, 100,    50,   0, 0, 0, 0, 0, false, false, false, false, T|S},
    {"prefill",     DUET_OP_EMBED,       BF16, 37, 100,    50,   0, 0, 0, 0, 0, false, false, false, false, T|S},
    {"prefill",     DUET_OP_EMBED,       Q8,   37, 96,     50,   0, 0, 0, 0, 0, false, false, false, false, T|S},
    {"125m",        DUET_OP_EMBED,       Q8,  128, 768,  32000,  0, 0, 0, 0, 0, false, false, false, false, P},

    {"decode",      DUET_OP_RMSNORM,     F32,   1, 768,      0,  0, 0, 0, 0, 0, false, false, false, false, T|P},
    {"ragged",      DUET_OP_RMSNORM,     F32,   7, 100,      0,  0, 0, 0, 0, 0, false, false, false, false, T|S},
    {"inplace",     DUET_OP_RMSNORM,     F32,  37, 129,      0,  0, 0, 0, 0, 0, false, false, false, true,  T|S},
    {"prefill",     DUET_OP_RMSNORM,     F32, 128, 768,      0,  0, 0, 0, 0, 0, false, false, false, false, T|P},

    /* matmul: decode GEMV, ragged edges, small batches, prefill tiles */
    {"decode",      DUET_OP_MATMUL,      F32,   1, 256,    100,  0, 0, 0, 0, 0, false, false, false, false, T|S},
    {"decode",      DUET_OP_MATMUL,      F16,   1, 256,    100,  0, 0, 0, 0, 0, false, false, false, false, T|S},
    {"decode",      DUET_OP_MATMUL,      BF16,  1, 256,    100,  0, 0, 0, 0, 0, false, false, false, false, T|S},
    {"decode",      DUET_OP_MATMUL,      Q8,    1, 256,    100,  0, 0, 0, 0, 0, false, false, false, false, T|S},
    {"ragged",      DUET_OP_MATMUL,      F32,   3, 100,     37,  0, 0, 0, 0, 0, true,  false, false, false, T|S},
    {"ragged",      DUET_OP_MATMUL,      F16,   5, 129,     33,  0, 0, 0, 0, 0, false, true,  false, false, T|S},
    {"ragged",      DUET_OP_MATMUL,      BF16,  7,  70,     19,  0, 0, 0, 0, 0, true,  true,  false, false, T|S},
    {"ragged",      DUET_OP_MATMUL,      Q8,    5, 96,      37,  0, 0, 0, 0, 0, true,  true,  false, false, T|S},
    {"batch",       DUET_OP_MATMUL,      Q8,   13, 320,    130,  0, 0, 0, 0, 0, false, false, false, false, T},
    {"prefill",     DUET_OP_MATMUL,      F32,  77, 288,    131,  0, 0, 0, 0, 0, true,  true,  false, false, T},
    {"prefill",     DUET_OP_MATMUL,      F16,  77, 288,    131,  0, 0, 0, 0, 0, false, true,  false, false, T},
    {"prefill",     DUET_OP_MATMUL,      BF16, 77, 288,    131,  0, 0, 0, 0, 0, true,  false, false, false, T},
    {"prefill",     DUET_OP_MATMUL,      Q8,   77, 288,    131,  0, 0, 0, 0, 0, true,  true,  false, false, T},
    /* the 125m and 1b models' matrices, decode and prefill */
    {"125m-qkv",    DUET_OP_MATMUL,      Q8,    1, 768,    768,  0, 0, 0, 0, 0, false, false, false, false, P},
    {"125m-up",     DUET_OP_MATMUL,      Q8,    1, 768,   2048,  0, 0, 0, 0, 0, false, false, false, false, T|P},
    {"125m-down",   DUET_OP_MATMUL,      Q8,    1, 2048,   768,  0, 0, 0, 0, 0, false, true,  false, false, P},
    {"125m-out",    DUET_OP_MATMUL,      Q8,    1, 768,  32000,  0, 0, 0, 0, 0, false, false, false, false, P},
    {"125m-up",     DUET_OP_MATMUL,      F16,   1, 768,   2048,  0, 0, 0, 0, 0, false, false, false, false, P},
    {"125m-up",     DUET_OP_MATMUL,      F32,   1, 768,   2048,  0, 0, 0, 0, 0, false, false, false, false, P},
    {"1b-up",       DUET_OP_MATMUL,      Q8,    1, 2048,  5632,  0, 0, 0, 0, 0, false, false, false, false, P},
    {"1b-up",       DUET_OP_MATMUL,      F16,   1, 2048,  5632,  0, 0, 0, 0, 0, false, false, false, false, P},
    {"125m-up-pf",  DUET_OP_MATMUL,      Q8,  128, 768,   2048,  0, 0, 0, 0, 0, false, false, false, false, P},
    {"125m-up-pf",  DUET_OP_MATMUL,      F16, 128, 768,   2048,  0, 0, 0, 0, 0, false, false, false, false, T|P},
    {"125m-up-pf",  DUET_OP_MATMUL,      F32, 128, 768,   2048,  0, 0, 0, 0, 0, false, false, false, false, T|P},
    {"125m-up-pf32", DUET_OP_MATMUL,     F32,  32, 768,   2048,  0, 0, 0, 0, 0, false, false, false, false, P},
    {"125m-up-pf32", DUET_OP_MATMUL,     F16,  32, 768,   2048,  0, 0, 0, 0, 0, false, false, false, false, P},
    {"1b-up-pf",    DUET_OP_MATMUL,      F16, 128, 2048,  5632,  0, 0, 0, 0, 0, false, false, false, false, P},

    /* the other block types (embedding and matmul): decode, ragged with bias and
     * accumulate, batches past 64; 32-blocks at widths that are not a multiple
     * of 256, odd row counts throughout */
#define BO_BLOCK_ROWS(DT, W)                                                                                  \
    {"embed",   DUET_OP_EMBED,  DT,  7, W,       20, 0, 0, 0, 0, 0, false, false, false, false, T},              \
    {"decode",  DUET_OP_MATMUL, DT,  1, W,       37, 0, 0, 0, 0, 0, false, false, false, false, T},              \
    {"ragged",  DUET_OP_MATMUL, DT,  5, 2 * W,   19, 0, 0, 0, 0, 0, true,  true,  false, false, T},              \
    {"batch",   DUET_OP_MATMUL, DT, 67, W,       33, 0, 0, 0, 0, 0, false, false, false, false, T},              \
    {"x_q8",    DUET_OP_MATMUL, DT,  3, W,       21, 0, 0, 0, 0, 0, false, true,  false, false, T, 1}
    BO_BLOCK_ROWS(DUET_DTYPE_Q4_0, 96), BO_BLOCK_ROWS(DUET_DTYPE_Q4_1, 160), BO_BLOCK_ROWS(DUET_DTYPE_Q5_0, 96),
    BO_BLOCK_ROWS(DUET_DTYPE_Q5_1, 160), BO_BLOCK_ROWS(DUET_DTYPE_IQ4_NL, 96),
    BO_BLOCK_ROWS(DUET_DTYPE_Q2_K, 256), BO_BLOCK_ROWS(DUET_DTYPE_Q3_K, 256), BO_BLOCK_ROWS(DUET_DTYPE_Q4_K, 256),
    BO_BLOCK_ROWS(DUET_DTYPE_Q5_K, 256), BO_BLOCK_ROWS(DUET_DTYPE_Q6_K, 256), BO_BLOCK_ROWS(DUET_DTYPE_IQ4_XS, 256),
#undef BO_BLOCK_ROWS
    /* Q4_0 as the cpu backend repacks it (16-row groups from the first matmul
     * on, plain tail rows: 53 = 3 x 16 + 5): decode, and 19 tokens (passes
     * of 8, 2 and 1) with bias and accumulate */
    {"repack",  DUET_OP_MATMUL, DUET_DTYPE_Q4_0,  1, 192,  53, 0, 0, 0, 0, 0, false, false, false, false, T},
    {"repack",  DUET_OP_MATMUL, DUET_DTYPE_Q4_0, 19, 192,  53, 0, 0, 0, 0, 0, true,  true,  false, false, T},

    /* rope + KV store: adjacent and NeoX pairs, partial rotation, GQA, several sequences */
    {"decode",      DUET_OP_ROPE_KV,     F32,   1, 64,     300,  4, 4, 1, 250, 64, false, false, false, false, T|S},
    {"decode",      DUET_OP_ROPE_KV,     F16,   1, 64,     300,  4, 4, 1, 299, 64, false, false, true,  false, T|S},
    {"gqa-seqs",    DUET_OP_ROPE_KV,     F32,   9, 32,     200,  8, 2, 3, 120, 32, false, false, false, false, T|S},
    {"partial",     DUET_OP_ROPE_KV,     F16,   6, 48,      64,  4, 2, 2, 10, 32, false, false, true,  false, T|S},
    {"odd-dims",    DUET_OP_ROPE_KV,     F32,   5, 15,      40,  3, 1, 1, 3,  10, false, false, false, false, T|S},
    {"q8-pool",     DUET_OP_ROPE_KV,     Q8,    9, 64,     100,  4, 2, 3, 40, 64, false, false, true,  false, T|S},
    {"q8-block32",  DUET_OP_ROPE_KV,     Q8,   40, 32,      64,  4, 4, 1, 0,  32, false, false, false, false, T|S, 0, 32},
    {"f16-block32", DUET_OP_ROPE_KV,     F16,   5, 64,    1000,  4, 2, 5, 0,  64, false, false, false, false, T|S, 0, 32, {7, 64, 1000, 33, 1}},
    {"125m",        DUET_OP_ROPE_KV,     F16,   1, 64,     512, 12, 12, 1, 256, 64, false, false, false, false, P},

    /* attention: online softmax over paged pools, causal, GQA/MQA, sequences;
     * contexts 1, 7, 64, 1000, 4096 and ragged mixes of them, f16 and q8_0 KV */
    {"decode",      DUET_OP_ATTENTION,   F32,   1, 64,     300,  4, 4, 1, 250, 0, false, false, false, false, T|S},
    {"decode",      DUET_OP_ATTENTION,   F16,   1, 64,     300,  4, 2, 1, 299, 0, false, false, false, false, T|S},
    {"gqa-seqs",    DUET_OP_ATTENTION,   F32,  11, 32,     160,  8, 2, 3, 100, 0, false, false, false, false, T|S},
    {"gqa-seqs",    DUET_OP_ATTENTION,   F16,  11, 100,    160,  6, 3, 2, 7,   0, false, false, false, false, T},
    {"prefill",     DUET_OP_ATTENTION,   F16,  40, 128,     64,  4, 1, 1, 0,   0, false, false, false, false, T},
    {"inplace",     DUET_OP_ATTENTION,   F32,   4, 8,       20,  8, 4, 2, 0,   0, false, false, false, true,  T|S},
    {"hd256",       DUET_OP_ATTENTION,   F32,   2, 256,     30,  2, 1, 1, 17,  0, false, false, false, false, T},
    {"ctx1",        DUET_OP_ATTENTION,   F16,   1, 64,       1,  4, 2, 1, 0,   0, false, false, false, false, T|S, 0, 16, {1}},
    {"ctx1",        DUET_OP_ATTENTION,   Q8,    1, 64,       1,  4, 2, 1, 0,   0, false, false, false, false, T|S, 0, 16, {1}},
    {"ctx7",        DUET_OP_ATTENTION,   F16,   7, 64,       7,  4, 1, 1, 0,   0, false, false, false, false, T|S, 0, 16, {7}},
    {"ctx7",        DUET_OP_ATTENTION,   Q8,    7, 32,       7,  4, 4, 1, 0,   0, false, false, false, false, T|S, 0, 32, {7}},
    {"ctx64",       DUET_OP_ATTENTION,   F16,  64, 64,      64,  8, 2, 1, 0,   0, false, false, false, false, T|PA, 0, 16, {64}},
    {"ctx64",       DUET_OP_ATTENTION,   Q8,   64, 64,      64,  8, 2, 1, 0,   0, false, false, false, false, T|PA, 0, 32, {64}},
    {"ctx1000",     DUET_OP_ATTENTION,   F16,   1, 64,    1000, 12, 12, 1, 0,  0, false, false, false, false, T, 0, 16, {1000}},
    {"ctx1000",     DUET_OP_ATTENTION,   Q8,    1, 64,    1000, 12, 12, 1, 0,  0, false, false, false, false, T, 0, 16, {1000}},
    {"ctx600",      DUET_OP_ATTENTION,   Q8,    1, 64,     600,  2, 1, 1, 0,   0, false, false, false, false, T|PA, 0, 16, {600}},
    {"ctx1000-pf",  DUET_OP_ATTENTION,   F16,  37, 128,   1000,  4, 1, 1, 0,   0, false, false, false, false, T, 0, 32, {1000}},
    {"ctx4096",     DUET_OP_ATTENTION,   F16,   1, 64,    4096, 12, 12, 1, 0,  0, false, false, false, false, T, 0, 16, {4096}},
    {"ctx4096",     DUET_OP_ATTENTION,   Q8,    1, 64,    4096, 12, 12, 1, 0,  0, false, false, false, false, T, 0, 16, {4096}},
    {"ctx4096-pf",  DUET_OP_ATTENTION,   Q8,   16, 64,    4096,  8, 2, 1, 0,   0, false, false, false, false, T, 0, 32, {4096}},
    {"ctx4096-mqa", DUET_OP_ATTENTION,   F32,   2, 64,    4096,  8, 1, 1, 0,   0, false, false, false, false, T, 0, 16, {4096}},
    {"mix-decode",  DUET_OP_ATTENTION,   F16,   5, 64,    4096,  4, 2, 5, 0,   0, false, false, false, false, T, 0, 16, {7, 64, 1000, 4096, 1}},
    {"mix-decode",  DUET_OP_ATTENTION,   Q8,    5, 64,    4096,  4, 2, 5, 0,   0, false, false, false, false, T, 0, 16, {7, 64, 1000, 4096, 1}},
    {"mix-chunks",  DUET_OP_ATTENTION,   F16,  20, 64,    4096,  4, 4, 4, 0,   0, false, false, false, false, T, 0, 32, {7, 64, 1000, 4096}},
    {"mix-chunks",  DUET_OP_ATTENTION,   Q8,   20, 32,    4096,  4, 1, 4, 0,   0, false, false, false, false, T, 0, 16, {7, 64, 1000, 4096}},
    /* MQA, a head of 15 (rows not texel-aligned), a 17-token prefill */
    {"odd-mqa",     DUET_OP_ATTENTION,   F16,  17, 15,      40,  3, 1, 1, 20,  0, false, false, false, false, T|S},
    {"out-q8",      DUET_OP_ATTENTION,   F16,   9, 64,     200,  4, 2, 3, 50,  0, false, false, false, false, T|S, 1},
    {"out-q8-only", DUET_OP_ATTENTION,   Q8,    3, 64,     100,  2, 1, 3, 20,  0, false, false, false, false, T|S, 2},
    {"125m",        DUET_OP_ATTENTION,   F16,   1, 64,     512, 12, 12, 1, 255, 0, false, false, false, false, P},
    {"125m-pf",     DUET_OP_ATTENTION,   F16, 128, 64,     512, 12, 12, 1, 0,  0, false, false, false, false, P},
    {"125m-c128",   DUET_OP_ATTENTION,   F16,   1, 64,     128, 12, 12, 1, 0,  0, false, false, false, false, P, 0, 16, {128}},
    {"125m-c1024",  DUET_OP_ATTENTION,   F16,   1, 64,    1024, 12, 12, 1, 0,  0, false, false, false, false, P, 0, 16, {1024}},
    {"125m-c4096",  DUET_OP_ATTENTION,   F16,   1, 64,    4096, 12, 12, 1, 0,  0, false, false, false, false, P, 0, 16, {4096}},
    {"125m-c4096",  DUET_OP_ATTENTION,   Q8,    1, 64,    4096, 12, 12, 1, 0,  0, false, false, false, false, P, 0, 16, {4096}},
    {"125m-16seq",  DUET_OP_ATTENTION,   F16,  16, 64,    1024, 12, 12, 16, 900, 0, false, false, false, false, P},
    {"125m-pf4096", DUET_OP_ATTENTION,   F16, 128, 64,    4096, 12, 12, 1, 0,  0, false, false, false, false, P, 0, 16, {4096}},

    /* fused int8 activations: rmsnorm/swiglu q8 outputs, q8 x q8 matmuls */
    {"out-q8",      DUET_OP_RMSNORM,     F32,   7, 96,       0,  0, 0, 0, 0, 0, false, false, false, false, T|S, 1},
    {"out-q8-only", DUET_OP_RMSNORM,     F32,  37, 768,      0,  0, 0, 0, 0, 0, false, false, false, false, T|S, 2},
    {"out-q8",      DUET_OP_SWIGLU,      F32,   5, 160,      0,  0, 0, 0, 0, 0, false, false, false, false, T|S, 1},
    {"out-q8-only", DUET_OP_SWIGLU,      F32,  13, 2048,     0,  0, 0, 0, 0, 0, false, false, false, false, T|S, 2},
    {"x-q8",        DUET_OP_MATMUL,      Q8,    1, 256,    100,  0, 0, 0, 0, 0, false, false, false, false, T|S, 1},
    {"x-q8",        DUET_OP_MATMUL,      Q8,    5, 96,      37,  0, 0, 0, 0, 0, true,  true,  false, false, T|S, 1},
    {"x-q8",        DUET_OP_MATMUL,      Q8,   16, 768,    200,  0, 0, 0, 0, 0, false, true,  false, false, T, 1},
    {"x-q8",        DUET_OP_MATMUL,      Q8,   77, 288,    131,  0, 0, 0, 0, 0, true,  true,  false, false, T, 1},
    {"125m-up-q8",  DUET_OP_MATMUL,      Q8,    1, 768,   2048,  0, 0, 0, 0, 0, false, false, false, false, P, 1},
    {"1b-up-q8",    DUET_OP_MATMUL,      Q8,    1, 2048,  5632,  0, 0, 0, 0, 0, false, false, false, false, P, 1},
    /* the rest of a 1b decode step, q8_0 (int8 activations) against f16 */
    {"1b-qo-q8",    DUET_OP_MATMUL,      Q8,    1, 2048,  2048,  0, 0, 0, 0, 0, false, false, false, false, P, 1},
    {"1b-qo",       DUET_OP_MATMUL,      F16,   1, 2048,  2048,  0, 0, 0, 0, 0, false, false, false, false, P},
    {"1b-kv-q8",    DUET_OP_MATMUL,      Q8,    1, 2048,   256,  0, 0, 0, 0, 0, false, false, false, false, P, 1},
    {"1b-kv",       DUET_OP_MATMUL,      F16,   1, 2048,   256,  0, 0, 0, 0, 0, false, false, false, false, P},
    {"1b-down-q8",  DUET_OP_MATMUL,      Q8,    1, 5632,  2048,  0, 0, 0, 0, 0, false, true,  false, false, P, 1},
    {"1b-down",     DUET_OP_MATMUL,      F16,   1, 5632,  2048,  0, 0, 0, 0, 0, false, true,  false, false, P},
    {"1b-out-q8",   DUET_OP_MATMUL,      Q8,    1, 2048, 32000,  0, 0, 0, 0, 0, false, false, false, false, P, 1},
    {"1b-out",      DUET_OP_MATMUL,      F16,   1, 2048, 32000,  0, 0, 0, 0, 0, false, false, false, false, P},
    {"125m-up-q8",  DUET_OP_MATMUL,      Q8,   16, 768,   2048,  0, 0, 0, 0, 0, false, false, false, false, P, 1},
    {"125m-up-pf-q8", DUET_OP_MATMUL,    Q8,  128, 768,   2048,  0, 0, 0, 0, 0, false, false, false, false, P, 1},

    {"ragged",      DUET_OP_SWIGLU,      F32,   3, 129,      0,  0, 0, 0, 0, 0, false, false, false, false, T|S},
    {"inplace",     DUET_OP_SWIGLU,      F32,  37, 100,      0,  0, 0, 0, 0, 0, false, false, false, true,  T|S},
    {"125m",        DUET_OP_SWIGLU,      F32,   1, 2048,     0,  0, 0, 0, 0, 0, false, false, false, false, P},
    {"ragged",      DUET_OP_ADD,         F32,   3, 129,      0,  0, 0, 0, 0, 0, false, false, false, false, T|S},
    {"inplace",     DUET_OP_ADD,         F32,  37, 100,      0,  0, 0, 0, 0, 0, false, false, false, true,  T|S},
    {"125m",        DUET_OP_ADD,         F32, 128, 768,      0,  0, 0, 0, 0, 0, false, false, false, false, P},
    {"ragged",      DUET_OP_GATHER_ROWS, F32,   5, 100,     37,  0, 0, 0, 0, 0, false, false, false, false, T|S},
    {"125m",        DUET_OP_GATHER_ROWS, F32,   1, 768,    128,  0, 0, 0, 0, 0, false, false, false, false, P},
    {"ragged",      DUET_OP_ARGMAX,      F32,   7, 1000,     0,  0, 0, 0, 0, 0, false, false, false, false, T|S},
    {"vocab",       DUET_OP_ARGMAX,      F32,   2, 32000,    0,  0, 0, 0, 0, 0, false, false, false, false, T|P},

    /* ---- benchmark only (appended: a row's index seeds its data, so the rows
     * above keep theirs). The GEMVs of every weight type at the 125m and 1b
     * shapes (one-token matmuls: bench_backend_ops cycles their weights
     * through a pool larger than the last-level cache) */
    {"125m-qkv",    DUET_OP_MATMUL,      F16,   1, 768,    768,  0, 0, 0, 0, 0, false, false, false, false, P},
    {"125m-qkv",    DUET_OP_MATMUL,      F32,   1, 768,    768,  0, 0, 0, 0, 0, false, false, false, false, P},
    {"125m-down",   DUET_OP_MATMUL,      F16,   1, 2048,   768,  0, 0, 0, 0, 0, false, true,  false, false, P},
    {"125m-down",   DUET_OP_MATMUL,      F32,   1, 2048,   768,  0, 0, 0, 0, 0, false, true,  false, false, P},
    {"125m-out",    DUET_OP_MATMUL,      F16,   1, 768,  32000,  0, 0, 0, 0, 0, false, false, false, false, P},
    {"125m-out",    DUET_OP_MATMUL,      F32,   1, 768,  32000,  0, 0, 0, 0, 0, false, false, false, false, P},
    {"125m-out-q8", DUET_OP_MATMUL,      Q8,    1, 768,  32000,  0, 0, 0, 0, 0, false, false, false, false, P, 1},
    {"1b-up",       DUET_OP_MATMUL,      F32,   1, 2048,  5632,  0, 0, 0, 0, 0, false, false, false, false, P},
    {"1b-down",     DUET_OP_MATMUL,      Q8,    1, 5632,  2048,  0, 0, 0, 0, 0, false, true,  false, false, P},
    /* prefill at the 1b shape, every weight type (f16 above) */
    {"1b-up-pf",    DUET_OP_MATMUL,      Q8,  128, 2048,  5632,  0, 0, 0, 0, 0, false, false, false, false, P},
    {"1b-up-pf",    DUET_OP_MATMUL,      F32, 128, 2048,  5632,  0, 0, 0, 0, 0, false, false, false, false, P},
    /* batched matmuls, 125m up projection, hot weights: 1..128 tokens with
     * the 125m-up-* rows above (q8_0 from f32 x and from x_q8; f16 and f32,
     * where CLBlast overtakes our kernels: the clblast_min perf variants) */
    {"125m-up-bt",  DUET_OP_MATMUL,      Q8,    1, 768,   2048,  0, 0, 0, 0, 0, false, false, false, false, P|H},
    {"125m-up-bt",  DUET_OP_MATMUL,      Q8,    4, 768,   2048,  0, 0, 0, 0, 0, false, false, false, false, P|H},
    {"125m-up-bt",  DUET_OP_MATMUL,      Q8,    8, 768,   2048,  0, 0, 0, 0, 0, false, false, false, false, P|H},
    {"125m-up-bt",  DUET_OP_MATMUL,      Q8,   16, 768,   2048,  0, 0, 0, 0, 0, false, false, false, false, P|H},
    {"125m-up-bt",  DUET_OP_MATMUL,      Q8,   32, 768,   2048,  0, 0, 0, 0, 0, false, false, false, false, P|H},
    {"125m-up-bt",  DUET_OP_MATMUL,      Q8,   64, 768,   2048,  0, 0, 0, 0, 0, false, false, false, false, P|H},
    {"125m-up-bt-q8", DUET_OP_MATMUL,    Q8,    1, 768,   2048,  0, 0, 0, 0, 0, false, false, false, false, P|H, 1},
    {"125m-up-bt-q8", DUET_OP_MATMUL,    Q8,    4, 768,   2048,  0, 0, 0, 0, 0, false, false, false, false, P|H, 1},
    {"125m-up-bt-q8", DUET_OP_MATMUL,    Q8,    8, 768,   2048,  0, 0, 0, 0, 0, false, false, false, false, P|H, 1},
    {"125m-up-bt-q8", DUET_OP_MATMUL,    Q8,   32, 768,   2048,  0, 0, 0, 0, 0, false, false, false, false, P|H, 1},
    {"125m-up-bt-q8", DUET_OP_MATMUL,    Q8,   64, 768,   2048,  0, 0, 0, 0, 0, false, false, false, false, P|H, 1},
    {"125m-up-bt",  DUET_OP_MATMUL,      F16,   4, 768,   2048,  0, 0, 0, 0, 0, false, false, false, false, P|H},
    {"125m-up-bt",  DUET_OP_MATMUL,      F16,   8, 768,   2048,  0, 0, 0, 0, 0, false, false, false, false, P|H},
    {"125m-up-bt",  DUET_OP_MATMUL,      F16,  16, 768,   2048,  0, 0, 0, 0, 0, false, false, false, false, P|H},
    {"125m-up-bt",  DUET_OP_MATMUL,      F16,  64, 768,   2048,  0, 0, 0, 0, 0, false, false, false, false, P|H},
    {"125m-up-bt",  DUET_OP_MATMUL,      F32,   4, 768,   2048,  0, 0, 0, 0, 0, false, false, false, false, P|H},
    {"125m-up-bt",  DUET_OP_MATMUL,      F32,   8, 768,   2048,  0, 0, 0, 0, 0, false, false, false, false, P|H},
    {"125m-up-bt",  DUET_OP_MATMUL,      F32,  16, 768,   2048,  0, 0, 0, 0, 0, false, false, false, false, P|H},
    {"125m-up-bt",  DUET_OP_MATMUL,      F32,  64, 768,   2048,  0, 0, 0, 0, 0, false, false, false, false, P|H},
    /* attention decode of the 125m shape at contexts 128 and 1024, q8_0 KV
     * (f16 at 128/1024/4096 and q8_0 at 4096 above) */
    {"125m-c128",   DUET_OP_ATTENTION,   Q8,    1, 64,     128, 12, 12, 1, 0,  0, false, false, false, false, P, 0, 16, {128}},
    {"125m-c1024",  DUET_OP_ATTENTION,   Q8,    1, 64,    1024, 12, 12, 1, 0,  0, false, false, false, false, P, 0, 16, {1024}},
    /* per-op overhead: a tiny add and a tiny q8_0 GEMV (64 KiB of weights),
     * many to a step */
    {"overhead",    DUET_OP_ADD,         F32,   1, 16,       0,  0, 0, 0, 0, 0, false, false, false, false, P|H},
    {"overhead",    DUET_OP_MATMUL,      Q8,    1, 256,    256,  0, 0, 0, 0, 0, false, false, false, false, P|H},
    /* the block weight types at the 1b up-projection: GEMV from memory
     * (x_q8, as the forward pass feeds it) and 128-token prefill */
#define BO_BLOCK_PERF(DT)                                                                                     \
    {"1b-up-q8",    DUET_OP_MATMUL,      DT,    1, 2048,  5632,  0, 0, 0, 0, 0, false, false, false, false, P, 1}, \
    {"1b-up-pf",    DUET_OP_MATMUL,      DT,  128, 2048,  5632,  0, 0, 0, 0, 0, false, false, false, false, P}
    BO_BLOCK_PERF(DUET_DTYPE_Q4_0), BO_BLOCK_PERF(DUET_DTYPE_Q4_1), BO_BLOCK_PERF(DUET_DTYPE_Q5_0),
    BO_BLOCK_PERF(DUET_DTYPE_Q5_1), BO_BLOCK_PERF(DUET_DTYPE_IQ4_NL), BO_BLOCK_PERF(DUET_DTYPE_Q2_K),
    BO_BLOCK_PERF(DUET_DTYPE_Q3_K), BO_BLOCK_PERF(DUET_DTYPE_Q4_K), BO_BLOCK_PERF(DUET_DTYPE_Q5_K),
    BO_BLOCK_PERF(DUET_DTYPE_Q6_K), BO_BLOCK_PERF(DUET_DTYPE_IQ4_XS),
#undef BO_BLOCK_PERF

    /* ---- RoPE variants and sliding windows (appended, as above) ----
     * rope_kv with a scaled table (llama3/YaRN-like uneven factors, mscale),
     * adjacent and NeoX pairs, positions into the thousands; attention with
     * a window: decodes whose early key splits see nothing and a prefill
     * whose early tokens still see everything, the last two under every
     * forced attention path (PA). */
    {"scaled",      DUET_OP_ROPE_KV,     F32,   9, 64,    4096,  4, 2, 3, 3000, 64, false, false, false, false, T, 0, 16, {0}, 1},
    {"scaled",      DUET_OP_ROPE_KV,     F16,   5, 128,    300,  2, 1, 1, 250, 128, false, false, true,  false, T, 0, 16, {0}, 1},
    {"window",      DUET_OP_ATTENTION,   F16,   3, 64,     300,  4, 2, 3, 0,   0, false, false, false, false, T, 0, 16, {300, 90, 200}, 100},
    {"window-pf",   DUET_OP_ATTENTION,   F32,  24, 32,      64,  4, 1, 1, 0,   0, false, false, false, false, T|PA, 0, 16, {40}, 7},
    {"window-q8",   DUET_OP_ATTENTION,   Q8,    2, 32,     100,  2, 2, 2, 0,   0, false, false, false, false, T|PA, 0, 32, {100, 33}, 32},
};
// clang-format on
/* clang-format on */
#pragma GCC diagnostic pop
#undef F32
#undef F16
#undef BF16
#undef Q8
#undef T
#undef P
#undef S
#undef PA
#undef H

#define BO_N_CASES ((int)(sizeof bo_cases / sizeof bo_cases[0]))
#define BO_GUARD 256 /* guard bytes before and after every operand */
#define BO_GUARD_BYTE 0xA5
#define BO_MAX_OPERANDS 10

/* ---- tuning variants: every forced path on every backend that has it ---------------- */

/* A backend opened with one forced setting. Each backend reads its
 * variable once, when an instance opens (DUET_CPU_ISA in cpu_backend.c's
 * open, DUET_VK_TUNE in vk_tuning.c's duet__vk_tuning_select,
 * DUET_OPENCL_TUNE in ocl_tuning.c's duet__ocl_tuning_for), so the runner
 * sets it, opens an instance, runs the cases and closes it. A variant runs
 * only the op kinds its setting changes, on the cases of `modes`: every
 * forced path runs, without multiplying shapes (and cold kernel compiles)
 * that the setting does not touch. Forced attention kernels run the
 * BO_SMALL | BO_PATHS cases: decode and prefill, splits, GQA and MQA, each
 * KV type and output form, at head sizes 8, 15, 32 and 64 (every head size
 * is a pipeline of its own to compile, and a GPU-style kernel on a CPU
 * device is at its slowest on the long contexts); the backend's own
 * choice (the default variant) runs every case. */
typedef struct bo_variant {
    const char *backend; /* registry name */
    const char *env;     /* the variable it sets, NULL: the backend as the environment leaves it */
    const char *value;
    int n_threads;     /* duet_backend_params.n_threads (cpu), 0: the default */
    unsigned kinds;    /* op kinds it runs (BO_KIND bits), 0: every op */
    unsigned modes;    /* the cases it runs: BO_TEST; BO_SMALL for slow serial settings;
                        * BO_SMALL | BO_PATHS for forced attention kernels */
    bool int8_dot;     /* needs the device's int8 dot product (else: not on this device) */
    const char *proof; /* a substring of the instance's driver string that shows the path was
                        * taken (else: not on this device, e.g. avx512 on an avx2 CPU) */
} bo_variant;

#define BO_KIND(k) (1u << (k))
#define BO_MM BO_KIND(DUET_OP_MATMUL)
#define BO_ATT BO_KIND(DUET_OP_ATTENTION)

// clang-format off
static const bo_variant bo_variants[] = {
    /* cpu: each SIMD path the CPU has, on 1, 2 and 3 threads */
    {"cpu",    NULL,           NULL,     2, 0, BO_TEST, false, NULL},
    {"cpu",    "DUET_CPU_ISA", "scalar", 1, 0, BO_TEST, false, "duet-cpu/scalar"},
    {"cpu",    "DUET_CPU_ISA", "avx2",   3, 0, BO_TEST, false, "duet-cpu/avx2"},
    {"cpu",    "DUET_CPU_ISA", "avx512", 2, 0, BO_TEST, false, "duet-cpu/avx512"},

    /* vulkan: the tuning table's entry, then the matmul paths (tile and
     * subgroup GEMV, the tiled GEMM at three tile shapes; Q8_0 through the
     * packed-integer fallback and through integer dot products) and the
     * attention kernels (lane, flash; split into many key ranges and
     * reduced; GPU-like lanes per row and subgroups per head; no shuffles) */
    {"vulkan", NULL,           NULL, 0, 0, BO_TEST, false, NULL},
    {"vulkan", "DUET_VK_TUNE", "matmul=tile,dot=0", 0, BO_MM, BO_TEST, false, NULL},
    {"vulkan", "DUET_VK_TUNE", "matmul=subgroup,dot=0,mm_min=0", 0, BO_MM, BO_TEST, false, NULL},
    {"vulkan", "DUET_VK_TUNE", "matmul=subgroup,dot=0,mm_min=4", 0, BO_MM, BO_TEST, false, NULL},
    {"vulkan", "DUET_VK_TUNE", "matmul=subgroup,dot=0,mm_min=2,mm_bm=16,mm_bn=8", 0, BO_MM, BO_TEST, false, NULL},
    {"vulkan", "DUET_VK_TUNE", "matmul=tile,dot=1", 0, BO_MM, BO_TEST, true, NULL},
    {"vulkan", "DUET_VK_TUNE", "matmul=subgroup,dot=1,mm_min=0", 0, BO_MM, BO_TEST, true, NULL},
    {"vulkan", "DUET_VK_TUNE", "matmul=subgroup,dot=1,mm_min=2,mm_bm=32,mm_bn=16", 0, BO_MM, BO_TEST, true, NULL},
    {"vulkan", "DUET_VK_TUNE", "attn=lane,attn_par=65536,attn_chunk=16", 0, BO_ATT, BO_SMALL | BO_PATHS, false, NULL},
    {"vulkan", "DUET_VK_TUNE", "attn=flash", 0, BO_ATT, BO_SMALL | BO_PATHS, false, NULL},
    {"vulkan", "DUET_VK_TUNE", "attn=flash,attn_wg=32,attn_c=4,attn_dc=4,attn_kt=8", 0, BO_ATT, BO_SMALL | BO_PATHS, false, NULL},
    {"vulkan", "DUET_VK_TUNE", "attn=flash,attn_par=65536,attn_chunk=16,attn_kt=8", 0, BO_ATT, BO_SMALL | BO_PATHS, false, NULL},
    {"vulkan", "DUET_VK_TUNE", "attn=flash,shuffle=0,attn_wg=16,attn_kt=4", 0, BO_ATT, BO_SMALL | BO_PATHS, false, NULL},

    /* opencl: the tuning table's entry; attention forced to flash-decoding
     * (one work-item, GPU-sized groups, key groups) or to the prefill tiles;
     * q8 x q8 matmuls through the portable and the (emulated) extension
     * int8 dot products, vector and word matvec loops, the tiled GEMM;
     * CLBlast for F32/F16 batches (its scratch chunked); and every kernel at
     * once GPU-style (work-group reductions) and serial (one work-item) */
    {"opencl", NULL,               NULL, 0, 0, BO_TEST, false, NULL},
    {"opencl", "DUET_OPENCL_TUNE", "att_mode=1,att_wg=1,att_split=16,att_g=64", 0, BO_ATT, BO_SMALL | BO_PATHS, false, NULL},
    {"opencl", "DUET_OPENCL_TUNE", "att_mode=1,att_wg=16,att_split=32,att_g=0", 0, BO_ATT, BO_SMALL | BO_PATHS, false, NULL},
    {"opencl", "DUET_OPENCL_TUNE", "att_mode=1,att_wg=128,att_split=256,att_g=8", 0, BO_ATT, BO_SMALL | BO_PATHS, false, NULL},
    {"opencl", "DUET_OPENCL_TUNE", "att_mode=2,att_bq=8,att_bk=8,att_tpr=4", 0, BO_ATT, BO_SMALL | BO_PATHS, false, NULL},
    {"opencl", "DUET_OPENCL_TUNE", "att_mode=2,att_bq=3,att_bk=5,att_tpr=1", 0, BO_ATT, BO_SMALL | BO_PATHS, false, NULL},
    {"opencl", "DUET_OPENCL_TUNE", "dot=0,mv_r=1,mv_wg=4,mv_nr=2,mv_mt=4", 0, BO_MM, BO_TEST, false, NULL},
    {"opencl", "DUET_OPENCL_TUNE", "dot=0,mv_r=8,mv_wg=16,mv_nr=2,mv_mt=3", 0, BO_MM, BO_TEST, false, NULL},
    {"opencl", "DUET_OPENCL_TUNE", "dot=2,mv_r=4,mv_wg=8,mv_nr=1,mv_mt=2", 0, BO_MM, BO_TEST, false, NULL},
    {"opencl", "DUET_OPENCL_TUNE", "dot=2,mv_r=1,mv_wg=4,mv_nr=4,mv_mt=4", 0, BO_MM, BO_TEST, false, NULL},
    {"opencl", "DUET_OPENCL_TUNE", "dot=0,mm_tile_min=1,mm_bn=8,mm_tr=2", 0, BO_MM, BO_TEST, false, NULL},
    {"opencl", "DUET_OPENCL_TUNE", "dot=2,mm_tile_min=2,mm_bn=16,mm_tr=4", 0, BO_MM, BO_TEST, false, NULL},
    {"opencl", "DUET_OPENCL_TUNE", "clblast_min=2,clblast_scratch_mb=1", 0, BO_MM, BO_TEST, false, NULL},
    {"opencl", "DUET_OPENCL_TUNE",
     "mv_r=16,mv_wg=64,mv_nr=4,mv_vw=4,mv_mt=3,mv_qg=8,norm_wg=64,att_wg=32,att_split=64,att_mode=2,att_bq=8,"
     "att_bk=16,att_tpr=4,rope_wg=16,dot=2,mq_nr=2,mm_tile_min=4,mm_bn=16,mm_tr=4,ew_wg=64,clblast_min=8,"
     "clblast_scratch_mb=1", 0, 0, BO_SMALL, false, NULL},
    {"opencl", "DUET_OPENCL_TUNE",
     "mv_r=1,mv_wg=1,mv_nr=1,mv_vw=8,mv_mt=8,mv_qg=1,norm_wg=1,att_wg=1,att_mode=1,att_split=32,rope_wg=1,"
     "dot=0,mq_nr=8,ew_wg=0,clblast_min=0,q8_f32_min=2", 0, 0, BO_SMALL, false, NULL},
};
// clang-format on
#define BO_N_VARIANTS ((int)(sizeof bo_variants / sizeof bo_variants[0]))

/* "DUET_VK_TUNE=attn=flash", or "default" (and the thread count where set). */
static inline void bo_variant_label(const bo_variant *v, char *buf, size_t size) {
    int n = snprintf(buf, size, "%s%s%s", v->env ? v->env : "default", v->env ? "=" : "",
                     v->value ? v->value : "");
    if (v->n_threads && n >= 0 && (size_t)n < size)
        snprintf(buf + n, size - (size_t)n, " (%d threads)", v->n_threads);
}

/* Whether variant v runs case c. */
/* A variant that forces a GPU path runs the packed block types' rows for
 * one type of each unpacking family only: the unpacking is the same code
 * under every path, and the default variant runs every type, while each
 * type is a pipeline or program of its own to compile on a cold machine
 * (11 types under every forced path cost lavapipe and PoCL minutes). */
static inline bool bo_block_type_sampled(duet_dtype t) {
    return t == DUET_DTYPE_Q4_0 || t == DUET_DTYPE_Q5_1 || t == DUET_DTYPE_IQ4_NL || t == DUET_DTYPE_Q4_K ||
           t == DUET_DTYPE_Q6_K;
}

static inline bool bo_variant_runs(const bo_variant *v, const bo_case *c) {
    if (v->env && strcmp(v->backend, "cpu") != 0 && duet_dtype_is_packed_quant(c->dtype) &&
        (c->kind == DUET_OP_MATMUL || c->kind == DUET_OP_EMBED) && !bo_block_type_sampled(c->dtype))
        return false;
    return (c->modes & v->modes) && (!v->kinds || (v->kinds & BO_KIND(c->kind)));
}

/* Paths only the benchmark times, next to each backend's default (the
 * parity test never opens these: each forces a path a bo_variants row
 * above already checks). bench_backend_ops --mode perf runs the default
 * variants and these; --variants all adds bo_variants. */
// clang-format off
static const bo_variant bo_perf_variants[] = {
    /* vulkan: each matmul path the tuning table can pick */
    {"vulkan", "DUET_VK_TUNE",     "matmul=tile,dot=0",     0, BO_MM, BO_PERF, false, NULL},
    {"vulkan", "DUET_VK_TUNE",     "matmul=tile,dot=1",     0, BO_MM, BO_PERF, true,  NULL},
    {"vulkan", "DUET_VK_TUNE",     "matmul=subgroup,dot=0", 0, BO_MM, BO_PERF, false, NULL},
    {"vulkan", "DUET_VK_TUNE",     "matmul=subgroup,dot=1", 0, BO_MM, BO_PERF, true,  NULL},
    /* opencl: q8 x q8 through the portable code where the device has the
     * int8 dot extension; F32/F16 matmuls through our kernels only and
     * through CLBlast from one token (where it starts to win: clblast_min) */
    {"opencl", "DUET_OPENCL_TUNE", "dot=0",                 0, BO_MM, BO_PERF, true,  NULL},
    {"opencl", "DUET_OPENCL_TUNE", "clblast_min=0",         0, BO_MM, BO_PERF, false, NULL},
    {"opencl", "DUET_OPENCL_TUNE", "clblast_min=1",         0, BO_MM, BO_PERF, false, NULL},
};
// clang-format on
#define BO_N_PERF_VARIANTS ((int)(sizeof bo_perf_variants / sizeof bo_perf_variants[0]))

/* Whether the benchmark times case c under variant v: the BO_PERF rows of
 * the op kinds v changes. */
static inline bool bo_variant_times(const bo_variant *v, const bo_case *c) {
    return (c->modes & BO_PERF) && (!v->kinds || (v->kinds & BO_KIND(c->kind)));
}

static inline const char *bo_op_name(duet_op_kind k) {
    static const char *const names[DUET_OP_COUNT] = {
        [DUET_OP_EMBED] = "embed",     [DUET_OP_RMSNORM] = "rmsnorm",         [DUET_OP_MATMUL] = "matmul",
        [DUET_OP_ROPE_KV] = "rope_kv", [DUET_OP_ATTENTION] = "attention",     [DUET_OP_SWIGLU] = "swiglu",
        [DUET_OP_ADD] = "add",         [DUET_OP_GATHER_ROWS] = "gather_rows", [DUET_OP_ARGMAX] = "argmax",
    };
    return (unsigned)k < DUET_OP_COUNT ? names[k] : "?";
}

/* "matmul q8_0 ragged 5x96->37 +bias +acc" */
static inline void bo_case_label(const bo_case *c, char *buf, size_t size) {
    const char *dt = duet_dtype_name(c->dtype);
    switch (c->kind) {
    case DUET_OP_MATMUL:
        snprintf(buf, size, "matmul %s %s %dx%d->%d%s%s", dt, c->shape, c->n_tokens, c->dim, c->rows,
                 c->bias ? " +bias" : "", c->accumulate ? " +acc" : "");
        break;
    case DUET_OP_ROPE_KV:
    case DUET_OP_ATTENTION:
        snprintf(buf, size, "%s kv=%s %s t=%d hd=%d heads=%d/%d seqs=%d pos0=%d%s%s%s", bo_op_name(c->kind),
                 dt, c->shape, c->n_tokens, c->dim, c->n_head, c->n_head_kv, c->n_seqs, c->pos0,
                 c->neox ? " neox" : "", c->inplace ? " inplace" : "",
                 c->window ? (c->kind == DUET_OP_ROPE_KV ? " scaled" : " window") : "");
        break;
    default:
        snprintf(buf, size, "%s %s %s t=%d dim=%d%s", bo_op_name(c->kind), dt, c->shape, c->n_tokens, c->dim,
                 c->inplace ? " inplace" : "");
    }
}

/* ---- operands ------------------------------------------------------------------ */

/* How outputs are compared: f32 values, exact i32, raw data of the case's
 * dtype (weights, KV pools), or q8_0 blocks (quantised activations). */
typedef enum bo_elem { BO_ELEM_F32, BO_ELEM_I32, BO_ELEM_RAW, BO_ELEM_Q8 } bo_elem;

typedef struct bo_operand {
    const char *name;
    size_t bytes; /* the view's size */
    void *host;   /* initial content (malloc'd) */
    bo_elem elem; /* how outputs are compared */
    bool output;  /* compared after the op */
    int alias;    /* >= 0: the op uses operand `alias`'s view here (in place) */
} bo_operand;

/* Host side of one case: operands and the op with views left empty. */
typedef struct bo_host {
    const bo_case *c;
    int n;
    bo_operand ops[BO_MAX_OPERANDS];
    int block_size, max_blocks, n_blocks; /* rope/attention: the KV cache's shape */
} bo_host;

/* Deterministic data: a 64-bit LCG per (case, operand). */
static inline float bo_rand(uint64_t *s) {
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((*s >> 40) & 0xffffff) / (float)0x800000 - 1.0f; /* [-1, 1) */
}

static inline void *bo_fill_f32(size_t n, uint64_t seed, float scale) {
    float *p = malloc(n * sizeof(float) + 1);
    for (size_t i = 0; i < n; i++)
        p[i] = bo_rand(&seed) * scale;
    return p;
}

/* rows x cols random values in [-scale, scale) converted to dtype. */
static inline void *bo_fill_typed(duet_dtype t, int64_t rows, int64_t cols, uint64_t seed, float scale) {
    size_t rb = duet_dtype_row_bytes(t, cols);
    uint8_t *p = malloc((size_t)rows * rb + 1);
    float *tmp = malloc((size_t)cols * sizeof(float));
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t i = 0; i < cols; i++)
            tmp[i] = bo_rand(&seed) * scale;
        duet_convert_row(t, tmp, p + (size_t)r * rb, cols);
    }
    free(tmp);
    return p;
}

static inline int bo_add(bo_host *h, const char *name, size_t bytes, void *data, bo_elem elem, bool output) {
    bo_operand *o = &h->ops[h->n];
    o->name = name;
    o->bytes = bytes;
    o->host = data;
    o->elem = elem;
    o->output = output;
    o->alias = -1;
    return h->n++;
}

static inline int32_t *bo_ints(size_t n) {
    return malloc(n * sizeof(int32_t) + 1);
}

/* Positions and sequences of rope/attention. Token t belongs to sequence
 * t % n_seqs. With lens[], sequence s's tokens are the last ones of its
 * context of lens[s] (a decode or the final prompt chunk); otherwise token t
 * sits at pos0 + 3s + t / n_seqs (distinct slots, several tokens of one
 * sequence in one batch, causal order inside it). */
static inline void bo_positions(const bo_case *c, int32_t *pos, int32_t *seq) {
    for (int t = 0; t < c->n_tokens; t++) {
        const int s = t % c->n_seqs, j = t / c->n_seqs;
        seq[t] = s;
        if (c->lens[0]) {
            const int count = (c->n_tokens - s + c->n_seqs - 1) / c->n_seqs;
            pos[t] = c->lens[s] - count + j;
            if (pos[t] < 0) pos[t] = j; /* a context shorter than its tokens: a prefill from 0 */
            continue;
        }
        pos[t] = c->pos0 + 3 * s + j;
        if (pos[t] >= c->rows) pos[t] = c->rows - 1 - j; /* stay inside n_ctx */
    }
}

static inline int bo_block_size(const bo_case *c) {
    return c->block ? c->block : 16;
}

/* Scattered block tables: every (sequence, entry) gets a distinct block of
 * a shuffled pool with a few spare blocks nobody references, so a kernel
 * that ignores the table or mixes sequences up reads the wrong rows. */
static inline int32_t *bo_block_tables(const bo_case *c, int *max_blocks, int *n_blocks) {
    const int bs = bo_block_size(c);
    *max_blocks = (c->rows + bs - 1) / bs;
    *n_blocks = c->n_seqs * *max_blocks + 5;
    int32_t *perm = malloc(sizeof(int32_t) * (size_t)*n_blocks);
    for (int i = 0; i < *n_blocks; i++)
        perm[i] = i;
    uint64_t st = 0x2545F4914F6CDD1Dull + (uint64_t)c->rows;
    for (int i = *n_blocks - 1; i > 0; i--) {
        st = st * 6364136223846793005ull + 1442695040888963407ull;
        int j = (int)((st >> 33) % (uint64_t)(i + 1));
        int32_t tmp = perm[i];
        perm[i] = perm[j];
        perm[j] = tmp;
    }
    int32_t *table = malloc(sizeof(int32_t) * (size_t)c->n_seqs * (size_t)*max_blocks + 1);
    memcpy(table, perm, sizeof(int32_t) * (size_t)c->n_seqs * (size_t)*max_blocks);
    free(perm);
    return table;
}

/* n rows of width floats quantised to q8_0 blocks (malloc'd). */
static inline void *bo_quantize_rows(const float *x, size_t rows, int width) {
    size_t rb = duet_dtype_row_bytes(DUET_DTYPE_Q8_0, width);
    uint8_t *p = malloc(rows * rb + 1);
    for (size_t r = 0; r < rows; r++)
        duet_quantize_row_q8_0(x + r * (size_t)width, (duet_block_q8_0 *)(p + r * rb), width);
    return p;
}

/* Builds the host operands of case `ci`. Operand order per op:
 *   embed: tokens table out | rmsnorm: x w out? out_q8? | matmul: w x|x_q8 bias? out
 *   rope_kv: q k v freqs? pos seq block_table k_pool v_pool
 *   attention: q pos seq block_table k_pool v_pool out? out_q8?
 *   swiglu: gate up out? out_q8? | add: a b out | gather: x rows out | argmax: x out
 * The op refers to operands by name (bo_dev_setup). */
static inline void bo_host_build_case(const bo_case *c, int ci, bo_host *h) {
    memset(h, 0, sizeof *h);
    h->c = c;
    const size_t T = (size_t)c->n_tokens, D = (size_t)c->dim;
    uint64_t seed = 0x9e3779b97f4a7c15ull * (uint64_t)(ci + 1);
    switch (c->kind) {
    case DUET_OP_EMBED: {
        int32_t *tok = bo_ints(T);
        for (size_t t = 0; t < T; t++)
            tok[t] = (int32_t)((t * 7919 + 3) % (size_t)c->rows);
        bo_add(h, "tokens", T * 4, tok, BO_ELEM_I32, false);
        bo_add(h, "table", (size_t)c->rows * duet_dtype_row_bytes(c->dtype, c->dim),
               bo_fill_typed(c->dtype, c->rows, c->dim, seed + 1, 1.0f), BO_ELEM_RAW, false);
        bo_add(h, "out", T * D * 4, bo_fill_f32(T * D, seed + 2, 1.0f), BO_ELEM_F32, true);
        break;
    }
    case DUET_OP_RMSNORM:
        bo_add(h, "x", T * D * 4, bo_fill_f32(T * D, seed + 1, 2.0f), BO_ELEM_F32, c->inplace);
        bo_add(h, "w", D * 4, bo_fill_f32(D, seed + 2, 1.0f), BO_ELEM_F32, false);
        if (c->q8act != 2) bo_add(h, "out", T * D * 4, bo_fill_f32(T * D, seed + 3, 1.0f), BO_ELEM_F32, true);
        if (c->inplace) h->ops[2].alias = 0;
        if (c->q8act)
            bo_add(h, "out_q8", T * duet_dtype_row_bytes(DUET_DTYPE_Q8_0, c->dim),
                   bo_fill_typed(DUET_DTYPE_Q8_0, c->n_tokens, c->dim, seed + 4, 1.0f), BO_ELEM_Q8, true);
        break;
    case DUET_OP_MATMUL: {
        const size_t O = (size_t)c->rows;
        bo_add(h, "w", O * duet_dtype_row_bytes(c->dtype, c->dim),
               bo_fill_typed(c->dtype, c->rows, c->dim, seed + 1, 1.0f), BO_ELEM_RAW, false);
        float *x = bo_fill_f32(T * D, seed + 2, 1.0f);
        if (c->q8act) {
            bo_add(h, "x_q8", T * duet_dtype_row_bytes(DUET_DTYPE_Q8_0, c->dim),
                   bo_quantize_rows(x, T, c->dim), BO_ELEM_Q8, false);
            free(x);
        } else {
            bo_add(h, "x", T * D * 4, x, BO_ELEM_F32, false);
        }
        if (c->bias) bo_add(h, "bias", O * 4, bo_fill_f32(O, seed + 3, 1.0f), BO_ELEM_F32, false);
        bo_add(h, "out", T * O * 4, bo_fill_f32(T * O, seed + 4, 4.0f), BO_ELEM_F32, true);
        break;
    }
    case DUET_OP_ROPE_KV:
    case DUET_OP_ATTENTION: {
        const size_t qw = (size_t)c->n_head * D, kvw = (size_t)c->n_head_kv * D;
        h->block_size = bo_block_size(c);
        int32_t *table = bo_block_tables(c, &h->max_blocks, &h->n_blocks);
        const size_t pool_rows = (size_t)h->n_blocks * (size_t)h->block_size;
        const bool rope = c->kind == DUET_OP_ROPE_KV;
        bo_add(h, "q", T * qw * 4, bo_fill_f32(T * qw, seed + 1, 1.0f), BO_ELEM_F32, rope || c->inplace);
        if (rope) {
            bo_add(h, "k", T * kvw * 4, bo_fill_f32(T * kvw, seed + 2, 1.0f), BO_ELEM_F32, true);
            bo_add(h, "v", T * kvw * 4, bo_fill_f32(T * kvw, seed + 3, 1.0f), BO_ELEM_F32, false);
            /* The table of inverse frequencies: base 10000, or with uneven
             * per-pair factors as llama3 and YaRN scaling give them. */
            const int half = c->n_rot / 2;
            if (half > 0) {
                float *fr = (float *)malloc(sizeof(float) * (size_t)half);
                oracle_rope_freqs(10000.0f, c->n_rot, fr);
                for (int i = 0; c->window && i < half; i++)
                    fr[i] *= i < half / 4 ? 1.0f : i < half / 2 ? 1.0f / (1.0f + (float)i / half) : 0.125f;
                bo_add(h, "freqs", (size_t)half * 4, fr, BO_ELEM_F32, false);
            }
        }
        int32_t *pos = bo_ints(T), *seq = bo_ints(T);
        bo_positions(c, pos, seq);
        bo_add(h, "pos", T * 4, pos, BO_ELEM_I32, false);
        bo_add(h, "seq", T * 4, seq, BO_ELEM_I32, false);
        bo_add(h, "block_table", (size_t)c->n_seqs * (size_t)h->max_blocks * 4, table, BO_ELEM_I32, false);
        /* Pools start full of random rows: attention reads them, rope_kv
         * must change exactly the rows it stores (compared whole). */
        size_t pool_bytes = pool_rows * duet_dtype_row_bytes(c->dtype, (int64_t)kvw);
        bo_add(h, "k_pool", pool_bytes,
               bo_fill_typed(c->dtype, (int64_t)pool_rows, (int64_t)kvw, seed + 4, 1.0f), BO_ELEM_RAW, rope);
        bo_add(h, "v_pool", pool_bytes,
               bo_fill_typed(c->dtype, (int64_t)pool_rows, (int64_t)kvw, seed + 5, 1.0f), BO_ELEM_RAW, rope);
        if (!rope) {
            if (c->q8act != 2) {
                bo_add(h, "out", T * qw * 4, bo_fill_f32(T * qw, seed + 6, 1.0f), BO_ELEM_F32, true);
                if (c->inplace) h->ops[h->n - 1].alias = 0;
            }
            if (c->q8act)
                bo_add(h, "out_q8", T * duet_dtype_row_bytes(DUET_DTYPE_Q8_0, (int64_t)qw),
                       bo_fill_typed(DUET_DTYPE_Q8_0, c->n_tokens, (int64_t)qw, seed + 7, 1.0f), BO_ELEM_Q8,
                       true);
        }
        break;
    }
    case DUET_OP_SWIGLU:
    case DUET_OP_ADD:
        bo_add(h, c->kind == DUET_OP_ADD ? "a" : "gate", T * D * 4, bo_fill_f32(T * D, seed + 1, 3.0f),
               BO_ELEM_F32, c->inplace);
        bo_add(h, c->kind == DUET_OP_ADD ? "b" : "up", T * D * 4, bo_fill_f32(T * D, seed + 2, 1.0f),
               BO_ELEM_F32, false);
        if (c->q8act != 2) bo_add(h, "out", T * D * 4, bo_fill_f32(T * D, seed + 3, 1.0f), BO_ELEM_F32, true);
        if (c->inplace) h->ops[2].alias = 0;
        if (c->q8act)
            bo_add(h, "out_q8", T * duet_dtype_row_bytes(DUET_DTYPE_Q8_0, c->dim),
                   bo_fill_typed(DUET_DTYPE_Q8_0, c->n_tokens, c->dim, seed + 4, 1.0f), BO_ELEM_Q8, true);
        break;
    case DUET_OP_GATHER_ROWS: {
        bo_add(h, "x", (size_t)c->rows * D * 4, bo_fill_f32((size_t)c->rows * D, seed + 1, 1.0f), BO_ELEM_F32,
               false);
        int32_t *rows = bo_ints(T);
        for (size_t t = 0; t < T; t++)
            rows[t] = (int32_t)((t * 13 + 5) % (size_t)c->rows);
        bo_add(h, "rows", T * 4, rows, BO_ELEM_I32, false);
        bo_add(h, "out", T * D * 4, bo_fill_f32(T * D, seed + 2, 1.0f), BO_ELEM_F32, true);
        break;
    }
    case DUET_OP_ARGMAX: {
        float *x = bo_fill_f32(T * D, seed + 1, 1.0f);
        /* Ties (lowest index must win), a NaN and an -inf on some rows. */
        for (size_t t = 0; t < T; t++) {
            float *r = x + t * D;
            if (t % 3 == 0) r[D / 3] = r[D / 2] = r[D - 1] = 2.0f;
            if (t % 3 == 1) r[t % D] = NAN;
            if (t % 3 == 2) r[0] = -INFINITY;
        }
        bo_add(h, "x", T * D * 4, x, BO_ELEM_F32, false);
        bo_add(h, "out", T * 4, bo_ints(T), BO_ELEM_I32, true);
        memset(h->ops[1].host, 0xff, T * 4);
        break;
    }
    case DUET_OP_COUNT:
        break;
    }
}

static inline void bo_host_build(int ci, bo_host *h) {
    bo_host_build_case(&bo_cases[ci], ci, h);
}

static inline void bo_host_free(bo_host *h) {
    for (int i = 0; i < h->n; i++)
        free(h->ops[i].host);
    memset(h, 0, sizeof *h);
}

/* ---- one backend's copy: buffers with guard bytes ------------------------------------ */

typedef struct bo_dev {
    duet_backend *be;
    duet_buffer *buf[BO_MAX_OPERANDS];
    duet_op op;
} bo_dev;

/* The operand called `name`, or -1. */
static inline int bo_find(const bo_host *h, const char *name) {
    for (int i = 0; i < h->n; i++)
        if (strcmp(h->ops[i].name, name) == 0) return i;
    return -1;
}

/* The view of operand `name` (its alias's in place) among views[] (one per
 * operand); an empty view when the case has none. */
static inline duet_view bo_view_named(const bo_host *h, const duet_view *views, const char *name) {
    int i = bo_find(h, name);
    if (i < 0) return (duet_view){NULL, 0};
    return views[h->ops[i].alias >= 0 ? h->ops[i].alias : i];
}

/* The largest position + 1 of a rope/attention case's tokens (its n_keys). */
static inline int bo_n_keys(const bo_host *h) {
    const int32_t *pos = (const int32_t *)h->ops[bo_find(h, "pos")].host;
    int n = 0;
    for (int t = 0; t < h->c->n_tokens; t++)
        if (pos[t] + 1 > n) n = pos[t] + 1;
    return n;
}

static inline void bo_op_build(const bo_host *h, const duet_view *views, duet_op *op);

/* Allocates every operand as [guard][data][guard], uploads it and builds
 * the op. Returns the first failure. */
static inline duet_status bo_dev_setup(duet_backend *be, const bo_host *h, bo_dev *d) {
    memset(d, 0, sizeof *d);
    d->be = be;
    duet_status st = DUET_OK;
    for (int i = 0; i < h->n && st == DUET_OK; i++) {
        if (h->ops[i].alias >= 0) continue;
        size_t total = BO_GUARD + h->ops[i].bytes + BO_GUARD;
        uint8_t *img = malloc(total);
        memset(img, BO_GUARD_BYTE, total);
        memcpy(img + BO_GUARD, h->ops[i].host, h->ops[i].bytes);
        st = duet_buffer_alloc(be, total, &d->buf[i]);
        if (st == DUET_OK) st = duet_buffer_upload(be, d->buf[i], 0, img, total);
        free(img);
    }
    if (st != DUET_OK) return st;
    duet_view views[BO_MAX_OPERANDS];
    for (int i = 0; i < h->n; i++)
        views[i] = (duet_view){d->buf[i], BO_GUARD};
    bo_op_build(h, views, &d->op);
    return DUET_OK;
}

/* The op of case h with operand i at views[i]. */
static inline void bo_op_build(const bo_host *h, const duet_view *views, duet_op *op) {
    const bo_case *c = h->c;
    memset(op, 0, sizeof *op);
    op->kind = c->kind;
    op->n_tokens = c->n_tokens;
#define VW(name) bo_view_named(h, views, name)
    duet_kv_pages kv = {0};
    if (c->kind == DUET_OP_ROPE_KV || c->kind == DUET_OP_ATTENTION)
        kv = (duet_kv_pages){.k_pool = VW("k_pool"),
                             .v_pool = VW("v_pool"),
                             .block_table = VW("block_table"),
                             .dtype = c->dtype,
                             .block_size = h->block_size,
                             .n_blocks = h->n_blocks,
                             .n_seqs = c->n_seqs,
                             .max_blocks = h->max_blocks};
    switch (c->kind) {
    case DUET_OP_EMBED:
        op->embed.tokens = VW("tokens");
        op->embed.table = VW("table");
        op->embed.out = VW("out");
        op->embed.dtype = c->dtype;
        op->embed.dim = c->dim;
        break;
    case DUET_OP_RMSNORM:
        op->rmsnorm.x = VW("x");
        op->rmsnorm.w = VW("w");
        op->rmsnorm.out = VW("out");
        op->rmsnorm.out_q8 = VW("out_q8");
        op->rmsnorm.dim = c->dim;
        op->rmsnorm.eps = 1e-5f;
        break;
    case DUET_OP_MATMUL:
        op->matmul.w = VW("w");
        op->matmul.dtype = c->dtype;
        op->matmul.x = VW("x");
        op->matmul.x_q8 = VW("x_q8");
        op->matmul.bias = VW("bias");
        op->matmul.out = VW("out");
        op->matmul.accumulate = c->accumulate;
        op->matmul.n_in = c->dim;
        op->matmul.n_out = c->rows;
        break;
    case DUET_OP_ROPE_KV:
        op->rope_kv.q = VW("q");
        op->rope_kv.k = VW("k");
        op->rope_kv.v = VW("v");
        op->rope_kv.pos = VW("pos");
        op->rope_kv.seq = VW("seq");
        op->rope_kv.kv = kv;
        op->rope_kv.n_head = c->n_head;
        op->rope_kv.n_head_kv = c->n_head_kv;
        op->rope_kv.head_dim = c->dim;
        op->rope_kv.n_rot = c->n_rot;
        op->rope_kv.freqs = VW("freqs");
        op->rope_kv.mscale = c->window ? 1.1386f : 0.0f; /* YaRN's 1 + 0.1 ln(4) */
        op->rope_kv.neox = c->neox;
        break;
    case DUET_OP_ATTENTION:
        op->attention.q = VW("q");
        op->attention.pos = VW("pos");
        op->attention.seq = VW("seq");
        op->attention.kv = kv;
        op->attention.out = VW("out");
        op->attention.out_q8 = VW("out_q8");
        op->attention.n_head = c->n_head;
        op->attention.n_head_kv = c->n_head_kv;
        op->attention.head_dim = c->dim;
        op->attention.scale = 1.0f / sqrtf((float)c->dim);
        /* n_keys as the forward pass gives it: the largest position + 1
         * (splits then cover the keys in use, not the table's capacity). */
        op->attention.n_keys = bo_n_keys(h);
        op->attention.window = c->window;
        break;
    case DUET_OP_SWIGLU:
        op->swiglu.gate = VW("gate");
        op->swiglu.up = VW("up");
        op->swiglu.out = VW("out");
        op->swiglu.out_q8 = VW("out_q8");
        op->swiglu.dim = c->dim;
        break;
    case DUET_OP_ADD:
        op->add.a = VW("a");
        op->add.b = VW("b");
        op->add.out = VW("out");
        op->add.dim = c->dim;
        break;
    case DUET_OP_GATHER_ROWS:
        op->gather.x = VW("x");
        op->gather.rows = VW("rows");
        op->gather.out = VW("out");
        op->gather.dim = c->dim;
        break;
    case DUET_OP_ARGMAX:
        op->argmax.x = VW("x");
        op->argmax.out = VW("out");
        op->argmax.dim = c->dim;
        break;
    case DUET_OP_COUNT:
        break;
    }
#undef VW
}

/* ---- the oracle's answer ------------------------------------------------------------- */

/* Host operands as views: buf holds the operand's index + 1 (a handle, not
 * a device buffer), resolved by bo_host_map. */
static inline uint8_t *bo_host_map(void *ctx, duet_view v) {
    if (!v.buf) return NULL;
    const bo_host *h = (const bo_host *)ctx;
    return (uint8_t *)h->ops[(uintptr_t)v.buf - 1].host + v.offset;
}

/* Runs the oracle (tests/op_oracle.c, which the caller links) on h's host
 * operands, in place: the outputs then hold the reference. */
static inline void bo_host_oracle(bo_host *h) {
    duet_view views[BO_MAX_OPERANDS];
    for (int i = 0; i < h->n; i++)
        views[i] = (duet_view){(duet_buffer *)(uintptr_t)(i + 1), 0};
    duet_op op;
    bo_op_build(h, views, &op);
    oracle_run(&op, bo_host_map, h);
}

/* One step with the op, `reps` times. */
static inline duet_status bo_dev_run(bo_dev *d, int reps) {
    duet_status st = duet_step_begin(d->be);
    for (int r = 0; r < reps && st == DUET_OK; r++)
        st = duet_step_op(d->be, &d->op);
    duet_status st2 = duet_step_submit(d->be);
    duet_status st3 = duet_step_wait(d->be);
    return st ? st : st2 ? st2 : st3;
}

/* Downloads operand i with its guards into a malloc'd image. */
static inline uint8_t *bo_dev_image(bo_dev *d, const bo_host *h, int i) {
    size_t total = BO_GUARD + h->ops[i].bytes + BO_GUARD;
    uint8_t *img = malloc(total);
    if (duet_buffer_download(d->be, d->buf[i], 0, img, total) != DUET_OK) {
        free(img);
        return NULL;
    }
    return img;
}

static inline void bo_dev_free(bo_dev *d) {
    for (int i = 0; i < BO_MAX_OPERANDS; i++)
        duet_buffer_free(d->be, d->buf[i]);
    memset(d->buf, 0, sizeof d->buf);
}

/* ---- what an op moves and computes (for the benchmark) ---------------------------------- */

/* Bytes read + written and floating-point operations of one run. */
static inline void bo_case_cost(const bo_case *c, double *bytes, double *flops) {
    const double T = c->n_tokens, D = c->dim;
    switch (c->kind) {
    case DUET_OP_EMBED:
        *bytes = T * (4 + (double)duet_dtype_row_bytes(c->dtype, c->dim) + D * 4);
        *flops = 0;
        break;
    case DUET_OP_RMSNORM:
        *bytes = T * D * 8 + D * 4;
        *flops = T * D * 4;
        break;
    case DUET_OP_MATMUL:
        *bytes = (double)c->rows * (double)duet_dtype_row_bytes(c->dtype, c->dim) +
                 T * D * (c->q8act ? 34.0 / 32 : 4) + T * c->rows * 4 * (c->accumulate ? 2 : 1);
        *flops = 2 * T * D * c->rows;
        break;
    case DUET_OP_ROPE_KV: {
        double kvw = (double)c->n_head_kv * D,
               es = (double)duet_dtype_row_bytes(c->dtype, 32 * (int64_t)kvw) / (32.0 * kvw);
        *bytes = T * ((c->n_head * D + kvw) * 8 + kvw * 4 + 2 * kvw * es);
        *flops = T * (c->n_head + c->n_head_kv) * c->n_rot * 3;
        break;
    }
    case DUET_OP_ATTENTION: {
        int32_t *pos = malloc(sizeof(int32_t) * (size_t)c->n_tokens),
                *seq = malloc(sizeof(int32_t) * (size_t)c->n_tokens);
        bo_positions(c, pos, seq);
        double ctx = 0;
        for (int t = 0; t < c->n_tokens; t++)
            ctx += pos[t] + 1;
        free(pos);
        free(seq);
        /* bytes per K/V element (q8_0: 34 bytes per 32) */
        double es = (double)duet_dtype_row_bytes(c->dtype, 32 * (int64_t)c->n_head_kv * c->dim) /
                    (32.0 * c->n_head_kv * c->dim);
        /* K and V rows of each (token, kv head) read once; q and out. */
        *bytes = ctx * c->n_head_kv * D * 2 * es + T * c->n_head * D * 8;
        *flops = ctx * c->n_head * D * 4;
        break;
    }
    case DUET_OP_SWIGLU:
    case DUET_OP_ADD:
        *bytes = T * D * 12;
        *flops = T * D * (c->kind == DUET_OP_SWIGLU ? 5 : 1);
        break;
    case DUET_OP_GATHER_ROWS:
        *bytes = T * (4 + D * 8);
        *flops = 0;
        break;
    case DUET_OP_ARGMAX:
        *bytes = T * (D * 4 + 4);
        *flops = T * D;
        break;
    default:
        *bytes = *flops = 0;
    }
}

/* ---- checking a backend's outputs against the oracle ------------------------------------ */

/* The oracle's outputs of one case (NULL for inputs), and for a Q8_0 matmul
 * of f32 activations, out from those activations quantised to q8_0 first
 * (the cpu and Vulkan backends quantise them by duet_quantize_row_q8_0's
 * rule): such a matmul may match either. */
typedef struct bo_answer {
    bool done;
    uint8_t *want[BO_MAX_OPERANDS];
    float *want_q8x;
} bo_answer;

static inline bool bo_quantises_x(const bo_case *c) {
    return c->kind == DUET_OP_MATMUL && !c->q8act &&
           (c->dtype == DUET_DTYPE_Q8_0 || duet_dtype_block(c->dtype) >= 32);
}

/* Computes a's outputs for case c (its index ci seeds the data, as
 * bo_host_build_case's). */
static inline void bo_answer_compute(const bo_case *c, int ci, bo_answer *a) {
    memset(a, 0, sizeof *a);
    bo_host h;
    bo_host_build_case(c, ci, &h);
    bo_host_oracle(&h);
    for (int i = 0; i < h.n; i++)
        if (h.ops[i].output && h.ops[i].alias < 0) {
            a->want[i] = (uint8_t *)h.ops[i].host;
            h.ops[i].host = NULL;
        }
    bo_host_free(&h);
    if (bo_quantises_x(c)) {
        bo_host_build_case(c, ci, &h);
        duet_block_q8_0 *xq = (duet_block_q8_0 *)bo_quantize_rows((const float *)h.ops[bo_find(&h, "x")].host,
                                                                  (size_t)c->n_tokens, c->dim);
        const int b = bo_find(&h, "bias"), o = bo_find(&h, "out");
        oracle_matmul(h.ops[bo_find(&h, "w")].host, c->dtype, NULL, xq,
                      b >= 0 ? (const float *)h.ops[b].host : NULL, c->accumulate, c->n_tokens, c->dim,
                      c->rows, (float *)h.ops[o].host);
        free(xq);
        a->want_q8x = (float *)h.ops[o].host;
        h.ops[o].host = NULL;
        bo_host_free(&h);
    }
    a->done = true;
}

static inline void bo_answer_free(bo_answer *a) {
    for (int i = 0; i < BO_MAX_OPERANDS; i++)
        free(a->want[i]);
    free(a->want_q8x);
    memset(a, 0, sizeof *a);
}

/* Largest NMSE an output may show against the oracle (which accumulates
 * in double): f32 summation order, the rounding of exp and rsqrt on a
 * device, nothing more. q8_0 values (fused outputs, pools rope_kv stored):
 * a value on a rounding boundary may land one step apart; f16 pools: one
 * rounding. */
static inline double bo_tolerance(const bo_case *c, const bo_operand *o) {
    if (o->elem == BO_ELEM_Q8 || (o->elem == BO_ELEM_RAW && c->dtype == DUET_DTYPE_Q8_0)) return 1e-4;
    if (o->elem == BO_ELEM_RAW && c->dtype == DUET_DTYPE_F16) return 1e-6;
    switch (c->kind) {
    case DUET_OP_EMBED:
    case DUET_OP_GATHER_ROWS:
        return 0; /* copies of exactly representable values */
    case DUET_OP_MATMUL:
        /* q8_0 activations: exact products, f32 sums. f32 activations of
         * q8_0 weights: against the nearer of the two references. */
        if (c->q8act) return 1e-12;
        return duet_dtype_block(c->dtype) >= 32 ? 1e-10 : 1e-11; /* q8_0 and the other blocks */
    case DUET_OP_ATTENTION:
        return c->dtype == DUET_DTYPE_Q8_0 ? 1e-9 : 1e-10;
    default:
        return 1e-12; /* rmsnorm, rope_kv's q and k, swiglu, add */
    }
}

/* Value i of n values of dtype t at p, as f32. */
static inline float bo_raw_at(duet_dtype t, const uint8_t *p, size_t i) {
    if (t == DUET_DTYPE_Q8_0) {
        const duet_block_q8_0 *b = (const duet_block_q8_0 *)p + i / DUET_QK8_0;
        uint16_t d;
        memcpy(&d, &b->d, 2);
        return duet_fp16_to_fp32(d) * b->qs[i % DUET_QK8_0];
    }
    if (t == DUET_DTYPE_F16) return duet_fp16_to_fp32(((const uint16_t *)p)[i]);
    if (t == DUET_DTYPE_BF16) return duet_bf16_to_fp32(((const uint16_t *)p)[i]);
    float f;
    memcpy(&f, p + 4 * i, 4);
    return f;
}

/* NMSE of got against want (n values of dtype t); -1 with msg filled when a
 * value is non-finite where the other is not. */
static inline double bo_nmse(duet_dtype t, const uint8_t *want, const uint8_t *got, size_t n,
                             const char *name, char *msg, size_t msg_size) {
    double err = 0, norm = 0;
    for (size_t i = 0; i < n; i++) {
        const float a = bo_raw_at(t, want, i), b = bo_raw_at(t, got, i);
        if (isfinite(a) != isfinite(b) || (isnan(a) != isnan(b))) {
            snprintf(msg, msg_size, "%s[%zu] = %g, the oracle says %g", name, i, (double)b, (double)a);
            return -1;
        }
        if (!isfinite(a)) continue;
        err += ((double)a - b) * ((double)a - b);
        norm += (double)a * a;
    }
    return norm > 0 ? err / norm : err;
}

/* Output operand oi of case c, downloaded with its guards (got_img), against
 * a's: guards intact, index outputs exact, values within bo_tolerance.
 * Fills msg on failure. */
static inline bool bo_compare(const bo_case *c, const bo_operand *o, const bo_answer *a, int oi,
                              const uint8_t *got_img, double *nmse_out, char *msg, size_t msg_size) {
    *nmse_out = 0;
    for (size_t i = 0; i < 2 * BO_GUARD; i++) {
        const size_t at = i < BO_GUARD ? i : o->bytes + i; /* before the view, then after it */
        if (got_img[at] != BO_GUARD_BYTE) {
            snprintf(msg, msg_size, "%s: guard byte %lld (relative to the view) was overwritten", o->name,
                     (long long)at - BO_GUARD);
            return false;
        }
    }
    const uint8_t *want = a->want[oi], *got = got_img + BO_GUARD;
    if (o->elem == BO_ELEM_I32) {
        for (size_t i = 0; i < o->bytes / 4; i++) {
            int32_t x, y;
            memcpy(&x, want + 4 * i, 4);
            memcpy(&y, got + 4 * i, 4);
            if (x != y) {
                snprintf(msg, msg_size, "%s[%zu] = %d, the oracle says %d", o->name, i, y, x);
                return false;
            }
        }
        return true;
    }
    const duet_dtype t = o->elem == BO_ELEM_F32  ? DUET_DTYPE_F32
                         : o->elem == BO_ELEM_Q8 ? DUET_DTYPE_Q8_0
                                                 : c->dtype;
    const size_t n = o->bytes / duet_dtype_block_bytes(t) * (size_t)duet_dtype_block(t);
    double nmse = bo_nmse(t, want, got, n, o->name, msg, msg_size);
    if (nmse < 0) return false;
    if (a->want_q8x && strcmp(o->name, "out") == 0) {
        double q = bo_nmse(t, (const uint8_t *)a->want_q8x, got, n, o->name, msg, msg_size);
        if (q >= 0 && q < nmse) nmse = q;
    }
    *nmse_out = nmse;
    const double tol = bo_tolerance(c, o);
    if (!(nmse <= tol)) {
        size_t worst = 0;
        double wd = -1;
        for (size_t i = 0; i < n; i++) {
            double d = fabs((double)bo_raw_at(t, want, i) - bo_raw_at(t, got, i));
            if (d > wd) wd = d, worst = i;
        }
        snprintf(msg, msg_size, "%s: NMSE %.3g > %.1g (worst [%zu]: %g vs the oracle's %g)", o->name, nmse,
                 tol, worst, (double)bo_raw_at(t, got, worst), (double)bo_raw_at(t, want, worst));
        return false;
    }
    return true;
}

/* After one run of d (set up from h): every output against a's. The
 * largest NMSE goes to *nmse; msg says what the first mismatch was. */
static inline bool bo_dev_check(bo_dev *d, const bo_host *h, const bo_answer *a, double *nmse, char *msg,
                                size_t msg_size) {
    *nmse = 0;
    for (int i = 0; i < h->n; i++) {
        if (!h->ops[i].output || h->ops[i].alias >= 0) continue;
        uint8_t *img = bo_dev_image(d, h, i);
        if (!img) {
            snprintf(msg, msg_size, "%s: download failed: %s", h->ops[i].name, duet_last_error());
            return false;
        }
        double e = 0;
        const bool ok = bo_compare(h->c, &h->ops[i], a, i, img, &e, msg, msg_size);
        free(img);
        if (e > *nmse) *nmse = e;
        if (!ok) return false;
    }
    return true;
}

#endif /* DUET_BACKEND_OPS_CASES_H */
