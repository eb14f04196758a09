/* backend.h — the hardware abstraction layer (HAL).
 *
 * Layers: registry -> device (answers questions) -> backend instance (does
 * the work: buffers and a stream of ops) -> buffer. The forward pass in core/
 * is written once against this header; each backend turns ops into its own
 * command stream. Core never names a specific backend.
 *
 * A forward step is: upload inputs, begin, op, op, ..., submit, wait,
 * download outputs. Ops inside one step run in recording order; a backend
 * inserts barriers where a later op reads what an earlier one wrote.
 */
#ifndef DUET_BACKEND_H
#define DUET_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "../core/duet.h"

/* ---- errors (shared by core and backends) ------------------------------ */

/* Records a printf-style message for duet_last_error() and returns status. */
duet_status duet__error(duet_status status, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* ---- element types ----------------------------------------------------- */

/* Values match GGUF's ggml_type ids so files map without a table. */
typedef enum duet_dtype {
    DUET_DTYPE_F32 = 0,
    DUET_DTYPE_F16 = 1,
    DUET_DTYPE_Q4_0 = 2,
    DUET_DTYPE_Q4_1 = 3,
    DUET_DTYPE_Q5_0 = 6,
    DUET_DTYPE_Q5_1 = 7,
    DUET_DTYPE_Q8_0 = 8,
    DUET_DTYPE_Q2_K = 10,
    DUET_DTYPE_Q3_K = 11,
    DUET_DTYPE_Q4_K = 12,
    DUET_DTYPE_Q5_K = 13,
    DUET_DTYPE_Q6_K = 14,
    DUET_DTYPE_Q8_K = 15, /* activations only (the k-quants' int-dot partner), never a weight */
    DUET_DTYPE_IQ4_NL = 20,
    DUET_DTYPE_IQ4_XS = 23,
    DUET_DTYPE_I32 = 26,
    DUET_DTYPE_BF16 = 30,
} duet_dtype;

/* GGUF's block formats, byte for byte as llama.cpp stores them (little
 * endian; fp16 scales as raw bits). "w" is the weight a block encodes. */

#define DUET_QK8_0 32
/* GGUF's Q8_0 block: 32 weights = fp16 scale d + 32 int8; w = d * q. */
typedef struct duet_block_q8_0 {
    uint16_t d;
    int8_t qs[DUET_QK8_0];
} duet_block_q8_0;

#define DUET_QK4_0 32
/* w[j] = d * (q[j] - 8); q[j] is the low nibble of qs[j] for j < 16 and
 * the high nibble of qs[j - 16] above. */
typedef struct duet_block_q4_0 {
    uint16_t d;
    uint8_t qs[DUET_QK4_0 / 2];
} duet_block_q4_0;

#define DUET_QK4_1 32
/* w[j] = d * q[j] + m, q as in q4_0 (unsigned). */
typedef struct duet_block_q4_1 {
    uint16_t d, m;
    uint8_t qs[DUET_QK4_1 / 2];
} duet_block_q4_1;

#define DUET_QK5_0 32
/* w[j] = d * (q[j] - 16); q's low 4 bits as in q4_0, bit 4 is bit j of the
 * little-endian uint32 qh. */
typedef struct duet_block_q5_0 {
    uint16_t d;
    uint8_t qh[4];
    uint8_t qs[DUET_QK5_0 / 2];
} duet_block_q5_0;

#define DUET_QK5_1 32
/* w[j] = d * q[j] + m, q as in q5_0 (unsigned). */
typedef struct duet_block_q5_1 {
    uint16_t d, m;
    uint8_t qh[4];
    uint8_t qs[DUET_QK5_1 / 2];
} duet_block_q5_1;

/* The k-quants: 256-weight super-blocks of 16- or 32-weight sub-blocks,
 * each with a small integer scale (and min) under the fp16 super scale. */
#define DUET_QK_K 256
#define DUET_K_SCALE_SIZE 12

/* 16 sub-blocks of 16: w = d * (scales & 15) * q - dmin * (scales >> 4),
 * q 2 bits: weight 128h + 32s + l is bits 2s of qs[32h + l]. */
typedef struct duet_block_q2_K {
    uint8_t scales[DUET_QK_K / 16];
    uint8_t qs[DUET_QK_K / 4];
    uint16_t d, dmin;
} duet_block_q2_K;

/* 16 sub-blocks of 16: w = d * (scale - 32) * q, 6-bit scales packed in
 * 12 bytes; q in -4..3 is its low 2 bits (placed as in q2_K) minus 4
 * unless bit (i / 32) of hmask[i % 32] is set. */
typedef struct duet_block_q3_K {
    uint8_t hmask[DUET_QK_K / 8];
    uint8_t qs[DUET_QK_K / 4];
    uint8_t scales[DUET_K_SCALE_SIZE];
    uint16_t d;
} duet_block_q3_K;

/* 8 sub-blocks of 32: w = d * sc * q - dmin * m, 6-bit sc and m packed in
 * 12 bytes; weight 64c + l is the low nibble of qs[32c + l], 64c + 32 + l
 * its high nibble. */
typedef struct duet_block_q4_K {
    uint16_t d, dmin;
    uint8_t scales[DUET_K_SCALE_SIZE];
    uint8_t qs[DUET_QK_K / 2];
} duet_block_q4_K;

/* As q4_K with a fifth bit: weight i's is bit (i / 32) of qh[i % 32]. */
typedef struct duet_block_q5_K {
    uint16_t d, dmin;
    uint8_t scales[DUET_K_SCALE_SIZE];
    uint8_t qh[DUET_QK_K / 8];
    uint8_t qs[DUET_QK_K / 2];
} duet_block_q5_K;

/* 16 sub-blocks of 16: w = d * scales[i / 16] * (q - 32), q 6 bits: 4 in
 * ql, 2 in qh (see dequantize in backends/quants.c for the interleave). */
typedef struct duet_block_q6_K {
    uint8_t ql[DUET_QK_K / 2];
    uint8_t qh[DUET_QK_K / 4];
    int8_t scales[DUET_QK_K / 16];
    uint16_t d;
} duet_block_q6_K;

/* The k-quants' activation format: w = d * qs; bsums are the sums of each
 * 16 qs, so a dot product with a min term needs no second pass. */
typedef struct duet_block_q8_K {
    float d;
    int8_t qs[DUET_QK_K];
    int16_t bsums[DUET_QK_K / 16];
} duet_block_q8_K;

/* IQ4_NL: q4_0's layout, w = d * duet_iq4nl_values[q] (non-linear). */
#define DUET_QK4_NL 32
typedef struct duet_block_iq4_nl {
    uint16_t d;
    uint8_t qs[DUET_QK4_NL / 2];
} duet_block_iq4_nl;

/* IQ4_XS: 8 sub-blocks of 32 with 6-bit scales (low 4 bits in scales_l,
 * high 2 in scales_h): w = d * (scale - 32) * duet_iq4nl_values[q]; each
 * sub-block's 16 qs bytes as in iq4_nl. */
typedef struct duet_block_iq4_xs {
    uint16_t d;
    uint16_t scales_h;
    uint8_t scales_l[DUET_QK_K / 64];
    uint8_t qs[DUET_QK_K / 2];
} duet_block_iq4_xs;

/* The 16 levels of IQ4_NL and IQ4_XS. */
extern const int8_t duet_iq4nl_values[16];

_Static_assert(sizeof(duet_block_q8_0) == 34, "q8_0 block");
_Static_assert(sizeof(duet_block_q4_0) == 18, "q4_0 block");
_Static_assert(sizeof(duet_block_q4_1) == 20, "q4_1 block");
_Static_assert(sizeof(duet_block_q5_0) == 22, "q5_0 block");
_Static_assert(sizeof(duet_block_q5_1) == 24, "q5_1 block");
_Static_assert(sizeof(duet_block_q2_K) == 84, "q2_K block");
_Static_assert(sizeof(duet_block_q3_K) == 110, "q3_K block");
_Static_assert(sizeof(duet_block_q4_K) == 144, "q4_K block");
_Static_assert(sizeof(duet_block_q5_K) == 176, "q5_K block");
_Static_assert(sizeof(duet_block_q6_K) == 210, "q6_K block");
_Static_assert(sizeof(duet_block_q8_K) == 292, "q8_K block");
_Static_assert(sizeof(duet_block_iq4_nl) == 18, "iq4_nl block");
_Static_assert(sizeof(duet_block_iq4_xs) == 136, "iq4_xs block");

/* Elements per block and bytes per block of a dtype (block 1 for scalars). */
int duet_dtype_block(duet_dtype t);
size_t duet_dtype_block_bytes(duet_dtype t);
/* Bytes of a row of n elements (n a multiple of the block size). */
size_t duet_dtype_row_bytes(duet_dtype t, int64_t n);
const char *duet_dtype_name(duet_dtype t); /* "f32", ... or NULL if unknown */
bool duet_dtype_is_weight(duet_dtype t);   /* a type a weight may have */
/* A weight type whose quants are packed below a byte each (Q4_0 ... Q6_K,
 * IQ4_NL, IQ4_XS): the types every backend's block kernels read, by
 * unpacking in registers. */
bool duet_dtype_is_packed_quant(duet_dtype t);
/* Whether a matmul with these weights can read q8_0 activations (x_q8)
 * and run integer dot products on them. */
bool duet_dtype_takes_q8_activations(duet_dtype t);

float duet_fp16_to_fp32(uint16_t h);
uint16_t duet_fp32_to_fp16(float f); /* round to nearest even */
float duet_bf16_to_fp32(uint16_t h);
uint16_t duet_fp32_to_bf16(float f); /* round to nearest even */

/* Row conversions (n elements, a multiple of the type's block). */
void duet_quantize_row_q8_0(const float *x, duet_block_q8_0 *y, int64_t n);
/* The k-quants' activations (llama.cpp's rounding: nearest even). */
void duet_quantize_row_q8_K(const float *x, duet_block_q8_K *y, int64_t n);
void duet_dequantize_row(duet_dtype t, const void *x, float *y, int64_t n);
/* Converts n f32 values into dtype t (any type of the table but i32).
 * Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 round as GGUF's reference quantizer (the same
 * bytes as the gguf Python package); the k-quants and IQ4 search their
 * scales as llama.cpp's reference quantizers do (no importance matrix). */
void duet_convert_row(duet_dtype t, const float *x, void *y, int64_t n);

/* The block formats' row converters (backends/quants.c), which dtype.c's
 * type table points at; n is a multiple of the type's block. */
void duet__q4_0_to_f32(const void *x, float *y, int64_t n);
void duet__q4_0_from_f32(const float *x, void *y, int64_t n);
void duet__q4_1_to_f32(const void *x, float *y, int64_t n);
void duet__q4_1_from_f32(const float *x, void *y, int64_t n);
void duet__q5_0_to_f32(const void *x, float *y, int64_t n);
void duet__q5_0_from_f32(const float *x, void *y, int64_t n);
void duet__q5_1_to_f32(const void *x, float *y, int64_t n);
void duet__q5_1_from_f32(const float *x, void *y, int64_t n);
void duet__q2_K_to_f32(const void *x, float *y, int64_t n);
void duet__q2_K_from_f32(const float *x, void *y, int64_t n);
void duet__q3_K_to_f32(const void *x, float *y, int64_t n);
void duet__q3_K_from_f32(const float *x, void *y, int64_t n);
void duet__q4_K_to_f32(const void *x, float *y, int64_t n);
void duet__q4_K_from_f32(const float *x, void *y, int64_t n);
void duet__q5_K_to_f32(const void *x, float *y, int64_t n);
void duet__q5_K_from_f32(const float *x, void *y, int64_t n);
void duet__q6_K_to_f32(const void *x, float *y, int64_t n);
void duet__q6_K_from_f32(const float *x, void *y, int64_t n);
void duet__q8_K_to_f32(const void *x, float *y, int64_t n);
void duet__q8_K_from_f32(const float *x, void *y, int64_t n);
void duet__iq4_nl_to_f32(const void *x, float *y, int64_t n);
void duet__iq4_nl_from_f32(const float *x, void *y, int64_t n);
void duet__iq4_xs_to_f32(const void *x, float *y, int64_t n);
void duet__iq4_xs_from_f32(const float *x, void *y, int64_t n);

/* ---- devices ------------------------------------------------------------ */

typedef enum duet_device_type {
    DUET_DEVICE_DISCRETE_GPU,
    DUET_DEVICE_INTEGRATED_GPU,
    DUET_DEVICE_CPU,  /* a CPU exposed by a GPU API (lavapipe, PoCL) */
    DUET_DEVICE_HOST, /* the cpu backend itself */
    DUET_DEVICE_OTHER,
} duet_device_type;

typedef struct duet_device_info {
    char name[256];
    char vendor[64];
    char driver[128];
    duet_device_type type;
    uint64_t memory_bytes;
    int compute_units;
    bool fp16;          /* fp16 arithmetic */
    bool int8_dot;      /* packed int8 dot products */
    bool coopmat;       /* cooperative matrix / matrix cores */
    bool q8_activations; /* the fused int8 activation path: out_q8 outputs and x_q8 matmuls
                            (DUET_ACT_Q8=0 turns it off on every device, for A/B runs) */
    int subgroup_size;  /* 0 if unknown */
    char features[512]; /* anything else, human readable */
} duet_device_info;

/* ---- buffers and tensors ------------------------------------------------ */

typedef struct duet_buffer duet_buffer; /* a backend's own, starting with a duet_buffer_head */

typedef enum duet_buffer_kind {
    DUET_BUFFER_DEVICE, /* device-local: reached through upload/download */
    DUET_BUFFER_HOST,   /* host-visible: the host may read it (buffer_host_ptr) */
} duet_buffer_kind;

/* The public head every backend's buffer starts with, so the registry can
 * check views against sizes without knowing the backend. */
typedef struct duet_buffer_head {
    size_t size;
    duet_buffer_kind kind;
} duet_buffer_head;

static inline const duet_buffer_head *duet_buffer_head_of(const duet_buffer *b) {
    return (const duet_buffer_head *)(const void *)b;
}

/* A view of a buffer: ops address data as buffer + byte offset. */
typedef struct duet_view {
    duet_buffer *buf;
    size_t offset;
} duet_view;

/* ---- ops ---------------------------------------------------------------- */

typedef enum duet_op_kind {
    DUET_OP_EMBED,       /* out[t][:] = f32(table[tokens[t]][:])                     */
    DUET_OP_RMSNORM,     /* out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w            */
    DUET_OP_MATMUL,      /* out[t][o] = sum_i W[o][i] x[t][i] (+ bias[o]) (+ out)    */
    DUET_OP_ROPE_KV,     /* rotate q, k in place; store k, v into the KV cache        */
    DUET_OP_ATTENTION,   /* causal (windowed) softmax(q K^T * scale) V over the cache */
    DUET_OP_SWIGLU,      /* out = silu(gate) * up                                     */
    DUET_OP_ADD,         /* out = a + b (out may alias a)                             */
    DUET_OP_GATHER_ROWS, /* out[i][:] = x[rows[i]][:]                                */
    DUET_OP_ARGMAX,      /* out[t] = argmax_j x[t][j] (lowest index wins ties), i32  */
    DUET_OP_COUNT
} duet_op_kind;

/* Its name ("matmul", ...), or "op?" for a kind out of range. */
const char *duet_op_name(duet_op_kind kind);

/* Paged KV cache (rope_kv, attention). Per layer one K pool and one V pool,
 * each n_blocks blocks x block_size tokens x kv width (n_head_kv*head_dim),
 * allocated once. Element type f32, f16 or q8_0; a q8_0 token row is
 * kv_width/32 duet_block_q8_0 blocks (head_dim % 32 == 0), the same block
 * format as Q8_0 weights. Position p of sequence slot s lives in row
 * p % block_size of block block_table[s * max_blocks + p / block_size].
 * The caller guarantees table entries covering 0..pos are in [0, n_blocks);
 * device kernels still clamp them so a bad table cannot write out of bounds. */
typedef struct duet_kv_pages {
    duet_view k_pool, v_pool; /* dtype [n_blocks][block_size][kv width] */
    duet_view block_table;    /* i32 [n_seqs][max_blocks] */
    duet_dtype dtype;         /* f32, f16 or q8_0 */
    int block_size;           /* tokens per block (16 or 32 in practice) */
    int n_blocks;             /* blocks in each pool */
    int n_seqs, max_blocks;   /* table shape: a sequence holds up to max_blocks * block_size tokens */
} duet_kv_pages;

/* Bytes of one pool: n_blocks * block_size rows of n_head_kv*head_dim
 * (SIZE_MAX when that overflows, which then fails every bounds check). */
size_t duet_kv_pool_bytes(const duet_kv_pages *kv, int kv_width);

/* All activations are f32, row-major [n_tokens][width]. Index arrays are
 * i32. Weights are row-major [rows][cols] in their dtype (GGUF's ne0 = cols).
 *
 * INT8 activations: rmsnorm, swiglu and attention can also (or only) write
 * their output quantised, `out_q8`: duet_block_q8_0 [n_tokens][width/32]
 * (width % 32 == 0), one fp16 scale per 32 values, fused into the op so no
 * separate pass reads the f32 rows back. A Q8_0 matmul given `x_q8` reads
 * those blocks instead of `x` and runs int8 x int8 dot products. Either of
 * out/out_q8 may be absent (buf NULL), not both. */
typedef struct duet_op {
    duet_op_kind kind;
    int n_tokens; /* rows of the activation operands */
    union {
        struct {
            duet_view tokens; /* i32 [n_tokens] */
            duet_view table;  /* dtype [n_vocab][dim] */
            duet_dtype dtype;
            int dim;
            duet_view out; /* f32 [n_tokens][dim] */
        } embed;
        struct {
            duet_view x, w, out; /* x, out: [n_tokens][dim]; w: f32 [dim] */
            duet_view out_q8;    /* optional q8_0 [n_tokens][dim/32] */
            int dim;
            float eps;
        } rmsnorm;
        struct {
            duet_view w; /* dtype [n_out][n_in] */
            duet_dtype dtype;
            duet_view x;     /* f32 [n_tokens][n_in] */
            duet_view x_q8;  /* optional (q8_0 weights only): q8_0 [n_tokens][n_in/32], used instead of x */
            duet_view bias;  /* f32 [n_out], buf NULL when none */
            bool accumulate; /* out += W x (fused residual add) */
            int n_in, n_out;
            duet_view out; /* f32 [n_tokens][n_out] */
        } matmul;
        struct {
            duet_view q, k, v;  /* f32 [n_tokens][n_head*head_dim], k/v [n_tokens][n_head_kv*head_dim] */
            duet_view pos, seq; /* i32 [n_tokens]: position and sequence slot of each token */
            /* f32 [n_rot/2]: pair i turns by theta_i = pos * freqs[i]. The
             * caller computes the inverse frequencies once (base^(-2i/n_rot)
             * with any scaling: linear, llama3's per-band factors, YaRN's
             * ramp), so one kernel serves every RoPE variant. */
            duet_view freqs;
            duet_kv_pages kv; /* k, v are stored at (seq, pos) */
            int n_head, n_head_kv, head_dim, n_rot;
            float mscale; /* cos and sin are multiplied by this (YaRN's attention factor); 0 reads as 1 */
            bool neox;    /* pairs (i, i + n_rot/2) instead of (2i, 2i+1) */
        } rope_kv;
        struct {
            duet_view q;        /* f32 [n_tokens][n_head*head_dim], already rotated */
            duet_view pos, seq; /* i32 [n_tokens]: token t sees positions 0..pos[t] of seq[t] */
            duet_kv_pages kv;
            int n_head, n_head_kv, head_dim; /* n_head % n_head_kv == 0 (GQA/MQA) */
            float scale;                     /* usually 1/sqrt(head_dim) */
            /* Optional: max over the tokens of pos[t] + 1, which the caller
             * knows on the host (0: not given). Backends size key splits
             * from it instead of the table's capacity; a token past it is
             * an error where the backend can see it, else gets zeros (or,
             * from a kernel that does not split, the whole context). */
            int n_keys;
            /* Sliding window: > 0, token t sees only positions
             * pos[t] - window + 1 .. pos[t]; 0: the whole context. */
            int window;
            duet_view out;    /* f32 [n_tokens][n_head*head_dim] */
            duet_view out_q8; /* optional q8_0 [n_tokens][n_head*head_dim/32] */
        } attention;
        struct {
            duet_view gate, up, out; /* f32 [n_tokens][dim] */
            duet_view out_q8;        /* optional q8_0 [n_tokens][dim/32] */
            int dim;
        } swiglu;
        struct {
            duet_view a, b, out; /* f32 [n_tokens][dim] */
            int dim;
        } add;
        struct {
            duet_view x;    /* f32 [*][dim] */
            duet_view rows; /* i32 [n_tokens] */
            duet_view out;  /* f32 [n_tokens][dim] */
            int dim;
        } gather;
        struct {
            duet_view x;   /* f32 [n_tokens][dim] */
            duet_view out; /* i32 [n_tokens] */
            int dim;
        } argmax;
    };
} duet_op;

/* ---- operands: every op's contract, described once (backends/operands.c) --

   An op's operands are its views with the bytes each may touch, the
   alignment its element needs and whether the op reads or writes it. The
   registry checks every op against them (presence, alignment, bounds,
   overlaps) before a backend sees it, so backends check only their own
   device limits; Vulkan takes its barrier ranges from the same list. */

typedef enum duet_access { DUET_READ = 1, DUET_WRITE = 2, DUET_READ_WRITE = 3 } duet_access;

typedef struct duet_operand {
    const char *name; /* "x", "w", "out", "k_pool", ... */
    duet_view view;   /* buf NULL: absent (only when optional) */
    uint64_t bytes;   /* the range [offset, offset + bytes) the op may touch; UINT64_MAX on overflow */
    uint64_t need;    /* bytes that must fit (less than `bytes` for tables sized by their buffer) */
    size_t align;     /* the offset's required alignment */
    duet_access access;
    bool optional;
    uint32_t alias_ok; /* bit i: may be exactly operand i (same offset and size: in place) */
} duet_operand;

#define DUET_MAX_OPERANDS 10

/* The shape rules of an op that do not depend on a device (positive
 * dimensions, block multiples, head counts, paged-KV geometry, which
 * optional outputs and inputs go together). */
duet_status duet_op_check_shape(const duet_op *op);
/* Fills ops' operand list (after duet_op_check_shape passed); returns its
 * length. Tables sized by their buffer (embed's table, gather's x) extend
 * to the last whole row that fits. */
int duet_op_operands(const duet_op *op, duet_operand out[DUET_MAX_OPERANDS]);
/* Shape, then every operand: present, aligned, inside its buffer, and no
 * written range overlapping another operand except an allowed exact alias. */
duet_status duet_op_check(const duet_op *op);

/* ---- backend instance --------------------------------------------------- */

typedef struct duet_backend duet_backend;

/* Where an instance's device time went, per op kind. */
typedef struct duet_profile {
    bool enabled;                  /* false: the instance does not profile (the rest is zero) */
    uint64_t count[DUET_OP_COUNT]; /* dispatches or kernel launches */
    double ms[DUET_OP_COUNT];      /* device time */
    int steps;                     /* steps submitted while profiling */
} duet_profile;

typedef struct duet_backend_params {
    int n_threads; /* cpu: worker threads, 0 = all cores (a stream: 0 = the device's pool) */
} duet_backend_params;

typedef struct duet_backend_iface {
    const char *name; /* "cpu", "vulkan", "opencl" */

    /* Device discovery. `available` fills `why` when the backend cannot run
     * here (no loader, no driver) and returns false. */
    bool (*available)(char *why, size_t why_size);
    int (*device_count)(void);
    duet_status (*device_info)(int index, duet_device_info *out);

    duet_status (*open)(int index, const duet_backend_params *params, duet_backend **out);
    void (*close)(duet_backend *be);

    /* Optional: another stream of work on an open instance's device (see
     * duet_backend_stream_open); closed with close. */
    duet_status (*stream_open)(duet_backend *parent, const duet_backend_params *params, duet_backend **out);

    /* Whether device `index` runs this op (its kinds, dtypes and shapes;
     * views may be absent): asked without opening an instance, and by the
     * registry before every op, which refuses the rest. */
    bool (*supports_op)(int index, const duet_op *op);

    duet_status (*buffer_alloc)(duet_backend *be, size_t size, duet_buffer **out);
    void (*buffer_free)(duet_backend *be, duet_buffer *buf);
    duet_status (*upload)(duet_backend *be, duet_buffer *buf, size_t offset, const void *src, size_t size);
    duet_status (*download)(duet_backend *be, duet_buffer *buf, size_t offset, void *dst, size_t size);

    duet_status (*begin)(duet_backend *be);
    duet_status (*op)(duet_backend *be, const duet_op *op);
    duet_status (*submit)(duet_backend *be);
    duet_status (*wait)(duet_backend *be);

    /* Optional: a host pointer to the buffer's memory (cpu backend), or NULL. */
    void *(*buffer_host_ptr)(duet_backend *be, duet_buffer *buf);

    /* Optional: per-op-kind device time since open, when profiling is on
     * ($DUET_PROFILE=1; GPU backends time with device timestamps or
     * events, which cost a little). */
    void (*profile)(duet_backend *be, duet_profile *out);

    /* Bytes of device memory the backend holds besides the caller's
     * buffers (scratch of attention splits, quantised activations, staging),
     * as a high-water mark since open. Tests use it to show attention's
     * memory stays linear in the context. */
    size_t (*scratch_bytes)(duet_backend *be);
} duet_backend_iface;

/* Every backend instance starts with this header. */
struct duet_backend {
    const duet_backend_iface *iface;
    int device_index;
    duet_device_info info;
};

/* ---- registry (backends/registry.c) ------------------------------------ */

int duet_backend_count(void);
const duet_backend_iface *duet_backend_get(int i);
const duet_backend_iface *duet_backend_find(const char *name); /* NULL if not compiled in */

/* Opens `name` ("auto" or NULL ranks every device) at `device` (-1 = best). */
duet_status duet_backend_open(const char *name, int device, const duet_backend_params *params,
                              duet_backend **out);
void duet_backend_close(duet_backend *be);

/* Streams: several instances on one device, each with its own queue.
 *
 * A stream is a backend instance opened on the device of an open one (the
 * parent, itself a stream of it): it shares the device, its compiled
 * kernels and every buffer, so weights uploaded through the parent are read
 * by the stream's ops, and buffers allocated through either may be used,
 * uploaded, downloaded and freed through either. What records and runs a
 * step is its own: begin/op/submit/wait, upload and download on a stream
 * never wait for another stream's step and touch none of its state, so
 * streams (and the parent) may each be driven from their own thread at
 * once; one stream is still used by one thread at a time.
 *   vulkan: its own command pool and buffers, fence, descriptor sets and
 *     scratch; a queue of its own where the compute family has more than
 *     one, else the parent's, submissions to it serialised by a mutex.
 *   opencl: its own in-order command queue and kernel objects on the
 *     parent's context and programs.
 *   cpu: its scratch and step; its steps run on the device's worker pool,
 *     a whole step at a time (begin to submit) with other streams
 *     (params->n_threads 0: the cores are the device; the work between
 *     steps overlaps), or on a pool of its own of n_threads workers.
 * Streams are not ordered against each other: a buffer one stream writes
 * may be read by another only after the writer's wait. Profiles and
 * scratch_bytes are per stream. The parent and its streams close in any
 * order; the device goes with the last. DUET_UNSUPPORTED when the backend
 * has no streams (callers then take turns on the parent). */
duet_status duet_backend_stream_open(duet_backend *parent, const duet_backend_params *params,
                                     duet_backend **out);

/* Checked wrappers: ops pass duet_op_check and the backend's supports_op
 * before the backend records them. */
duet_status duet_buffer_alloc(duet_backend *be, size_t size, duet_buffer **out);
void duet_buffer_free(duet_backend *be, duet_buffer *buf);
duet_status duet_buffer_upload(duet_backend *be, duet_buffer *buf, size_t offset, const void *src,
                               size_t size);
duet_status duet_buffer_download(duet_backend *be, duet_buffer *buf, size_t offset, void *dst, size_t size);
duet_status duet_step_begin(duet_backend *be);
duet_status duet_step_op(duet_backend *be, const duet_op *op);
duet_status duet_step_submit(duet_backend *be);
duet_status duet_step_wait(duet_backend *be);
/* A device's answers without an instance (the device layer): its info
 * (with the DUET_ACT_Q8 override applied) and whether it runs an op. */
duet_status duet_device_info_get(const duet_backend_iface *iface, int index, duet_device_info *out);
bool duet_device_supports_op(const duet_backend_iface *iface, int index, const duet_op *op);
/* The instance's profile (enabled false when it keeps none); and the same
 * as a table on `f`, which close prints when $DUET_PROFILE is set. */
void duet_backend_profile(duet_backend *be, duet_profile *out);
void duet_profile_print(const duet_profile *p, const char *who, FILE *f);
/* The backend's scratch_bytes high-water mark. */
size_t duet_backend_scratch_bytes(duet_backend *be);

/* The backends compiled in. */
extern const duet_backend_iface duet_cpu_backend_iface;

#endif /* DUET_BACKEND_H */
