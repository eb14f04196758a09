/* cpu_internal.h — shared state of the cpu backend's files.
 *
 * cpu_backend.c   the interface, device info, buffers, op validation
 * cpu_threadpool.c the persistent worker pool (the caller is worker 0)
 * cpu_matmul.c    MATMUL for f32/f16/bf16/q8_0 weights
 * cpu_matmul_blocks.c MATMUL for the other block-quantised weight types, and
 *                 Q4_0's and Q5_0's repacked layout (repacking them and F16,
 *                 kernels, embedding rows; F16's kernels are in cpu_matmul.c)
 * cpu_ops.c       the other ops and the small vector kernels they use
 *
 * Kernels come in three paths chosen at run time from the CPU's features
 * (one portable binary): scalar, avx2 (avx2+fma+f16c) and avx512
 * (avx512f/bw/vl + avx512_vnni on top of avx2). */
#ifndef DUET_CPU_INTERNAL_H
#define DUET_CPU_INTERNAL_H

#include <stdatomic.h>
#include <pthread.h>

#include "../backend.h"

typedef enum cpu_isa {
    CPU_ISA_SCALAR = 0,
    CPU_ISA_AVX2 = 1,
    CPU_ISA_AVX512 = 2,
} cpu_isa;

const char *duet__cpu_isa_name(cpu_isa isa);
/* The best path this CPU runs, capped by $DUET_CPU_ISA (scalar|avx2|avx512)
 * so tests can exercise every path on one machine. */
cpu_isa duet__cpu_isa_detect(void);

/* ---- thread pool ----------------------------------------------------------- */

/* A task is split into n_chunks chunks; fn runs once per chunk, on whichever
 * worker claims it. `worker` (0 = the caller) indexes per-thread scratch. */
typedef void (*cpu_task_fn)(void *ctx, int chunk, int n_chunks, int worker);

typedef struct cpu_pool {
    int n_threads; /* workers including the caller */
    pthread_t *threads;
    /* The current task. Atomics (relaxed) only because a late worker may
     * read them while the next task is written; it then fails to claim. */
    _Atomic(cpu_task_fn) fn;
    _Atomic(void *) ctx;
    /* (task sequence << 32) | (chunk count << 16) | next unclaimed chunk:
     * everything a worker needs to claim a chunk is in this one word, so a
     * successful CAS proves the task it read is still running and the
     * count it read is that task's own (no separate field to go stale). */
    _Atomic uint64_t claim;
    /* Futex words (32-bit): `gen` is the task sequence workers sleep on;
     * `done` counts the current task's finished chunks. */
    _Atomic uint32_t gen;
    _Atomic uint32_t done;
    _Atomic int sleepers;       /* workers blocked in futex_wait on gen */
    _Atomic int caller_waiting; /* the caller is blocked on done */
    _Atomic int stop;
    pthread_mutex_t run_mu; /* held by the caller of a task: streams sharing the pool take turns */
} cpu_pool;

duet_status duet__cpu_pool_init(cpu_pool *pool, int n_threads);
void duet__cpu_pool_free(cpu_pool *pool);
/* The most chunks one task is cut into (the claim word's 16-bit fields);
 * duet__cpu_pool_run caps n_chunks here and passes fn the capped count. */
#define CPU_POOL_MAX_CHUNKS 0xffff
/* Test-only: when set, called at the points where a delay exposes a race
 * (0: between publishing a task's fields and its claim word; 1: between a
 * worker's read of the claim word and its CAS; 2: after a chunk runs). */
extern void (*duet__cpu_pool_delay_hook)(int where);
/* Runs fn on chunks 0..n_chunks-1 and returns when all are done. Callers on
 * several threads (streams sharing the pool) run their tasks one at a time
 * (run_mu). The caller
 * claims chunks too, so work never waits for a worker that the OS has not
 * scheduled; only a chunk a worker already started is waited for.
 * n_chunks <= 1 or a one-thread pool runs inline, with no synchronisation. */
void duet__cpu_pool_run(cpu_pool *pool, int n_chunks, cpu_task_fn fn, void *ctx);
/* Chunks to cut a task of `units` independent units into: a few per
 * thread, so a slow or descheduled thread's share gets picked up. */
static inline int cpu_chunks(const cpu_pool *pool, int64_t units) {
    int64_t want = (int64_t)pool->n_threads * 4;
    return (int)(units < want ? units : want);
}

/* Splits [0, n) into nth contiguous parts, each a multiple of `align`
 * (except the last); sets [*lo, *hi) for part ith. */
static inline void cpu_split(int64_t n, int ith, int nth, int64_t align, int64_t *lo, int64_t *hi) {
    int64_t units = (n + align - 1) / align;
    int64_t a = units * ith / nth * align, b = units * (ith + 1) / nth * align;
    *lo = a < n ? a : n;
    *hi = b < n ? b : n;
}

/* ---- the backend ---------------------------------------------------------- */

struct duet_buffer {
    duet_buffer_head head; /* first: the registry reads it */
    void *data;            /* 64-byte aligned */
    /* A Q4_0, Q5_0 or F16 (rp_dtype) matrix of rp_cols columns at byte rp_off
     * whose first rp_rows rows (a multiple of CPU_RP_ROWS) the backend
     * re-laid out for its kernels (cpu_matmul_blocks.c); rp_rows 0: the
     * bytes are as uploaded. */
    int64_t rp_rows, rp_cols;
    size_t rp_off;
    duet_dtype rp_dtype;
    /* An op read these bytes otherwise (another shape or offset: a buffer
     * of several matrices): never repacked again, so uses that take turns
     * do not convert the bytes back and forth. */
    bool rp_never;
};

typedef struct cpu_scratch {
    void *p;
    size_t size;
} cpu_scratch;

/* What a device's instance and its streams share (cpu_backend.c): the
 * worker pool (unless a stream has its own) and the weights' layouts. */
typedef struct cpu_device {
    atomic_int refs; /* the instance and each stream open on it */
    cpu_pool pool;
    /* Held by a stream on `pool` from begin to submit: steps take the pool
     * in turn, whole (two steps' ops interleaved op by op ran slower: each
     * op then waits for a wake-up). */
    pthread_mutex_t step_mu;
    /* Q4_0, Q5_0 and F16 weights are repacked in place at their first matmul (and
     * restored for other uses): a layout change takes it for writing, an op
     * and a host access of the bytes for reading, so no stream reads a
     * buffer while another converts it. */
    pthread_rwlock_t layout;
    atomic_int n_repacked; /* buffers that hold the repacked layout now */
} cpu_device;

typedef struct cpu_backend {
    duet_backend base; /* must be first */
    cpu_isa isa;
    cpu_device *dev; /* shared with the device's other streams */
    cpu_pool *pool;  /* dev->pool, or own_pool (a stream opened with n_threads) */
    cpu_pool own_pool;
    bool in_step;
    /* Scratch grown on demand and kept: the token loop never allocates in
     * steady state. */
    cpu_scratch act;  /* matmul: quantized activations */
    cpu_scratch work; /* per-thread rows: attention tiles, rope tables, q8 rows */
    cpu_scratch attn; /* attention: query tiles and split partials (linear in tokens) */
    /* Q4_0, Q5_0 and F16 weights are repacked at their first matmul ($DUET_CPU_REPACK=0:
     * never, for A/B runs); dev->n_repacked buffers hold the layout now. */
    bool repack;
    /* $DUET_PROFILE: wall time of each op (ops run when recorded). */
    bool profile;
    int prof_steps;
    uint64_t prof_n[DUET_OP_COUNT];
    double prof_ms[DUET_OP_COUNT];
} cpu_backend;

/* Grows s to at least `size` bytes (64-byte aligned); contents are lost. */
duet_status duet__cpu_scratch_reserve(cpu_scratch *s, size_t size);

/* Ops, run after validation (cpu_backend.c); operand pointers resolved. */
/* x or xq (pre-quantised q8_0 activations, q8_0 weights only; NULL when
 * absent) is the input; exactly one is non-NULL. */
duet_status duet__cpu_matmul(cpu_backend *be, const duet_op *op, const void *w, const float *x,
                             const duet_block_q8_0 *xq, const float *bias, float *out);
/* The same for the packed block types (duet_dtype_is_packed_quant;
 * cpu_matmul_blocks.c); x or xq as above. */
duet_status duet__cpu_matmul_blocks(cpu_backend *be, const duet_op *op, const void *w, const float *x,
                                    const duet_block_q8_0 *xq, const float *bias, float *out);
/* The same for a Q4_0 or Q5_0 matrix whose first rp_rows rows are repacked. */
duet_status duet__cpu_matmul_rp(cpu_backend *be, const duet_op *op, const void *w, int64_t rp_rows,
                                const float *x, const duet_block_q8_0 *xq, const float *bias, float *out);
/* The same for an F16 matrix whose first rp_rows rows are repacked
 * (cpu_matmul.c; avx512 only). */
duet_status duet__cpu_matmul_f16_rp(cpu_backend *be, const duet_op *op, const void *w, int64_t rp_rows,
                                    const float *x, const float *bias, float *out);
/* ---- repacked weights (cpu_matmul_blocks.c) ----------------------------------------
 *
 * Decode reads every weight once per token, so the GEMV's cost per weight
 * byte decides its speed. A Q4_0 matrix (avx2 and avx512 paths) is stored
 * CPU_RP_ROWS rows at a time with one 32-block of all 16 rows together:
 * their 16 fp16 scales (32 bytes), then 4 x 64 bytes where bytes
 * 64c + 4l .. 64c + 4l + 3 are row l's qs[4c .. 4c + 3]. A vector lane is
 * then a row: the 8 dwords of unpacked nibbles come from 4 loads, the
 * activation dwords are broadcast, 16 rows' integer dots accumulate in one
 * vector with no horizontal sums, and the scales convert in one op. The
 * group takes the bytes its 16 plain rows took (288 per 32 columns); rows
 * past the last whole group stay plain. The float work per row and token
 * is the tiles' and the panel's op for op, so results are the same bits.
 *
 * A Q5_0 matrix takes the same layout with its fifth bits between the
 * scales and the nibbles: per 32-block the 16 scales (32 bytes), the 16
 * rows' qh dwords (64 bytes, row l's at 4l), then the nibbles as Q4_0's
 * (352 bytes, the plain rows' too). A row's qh is permuted so that byte k
 * holds in bit c the fifth bit of weight 4c + k and in bit 4 + c that of
 * weight 16 + 4c + k: for nibble chunk c the low weights' bits are
 * (qh << (4 - c)) & 0x10 in each byte and the high weights' (qh >> c) &
 * 0x10, immediate shifts of the lane that holds the row.
 *
 * The backend cannot see a tensor's type at upload, so the first matmul
 * that reads a buffer as a Q4_0 or Q5_0 matrix repacks it in place; any other use
 * of those bytes (a download, an upload, a host pointer, another op or
 * shape) first restores the plain layout, and after another op or shape
 * the buffer stays plain. Embedding lookups read the layout.
 *
 * An F16 matrix (avx512 path, f32 activations) is stored CPU_RP_ROWS rows
 * at a time column by column: for each column k the 16 rows' halves (32
 * bytes), so one load and one conversion give 16 rows' weights at column
 * k, a vector lane per row. The kernels broadcast each token's x[k] and
 * FMA it into 16-row accumulators (an outer product): every row's sum runs
 * over k in order, in one lane, whatever the number of tokens or groups
 * the kernel takes at once. */
#define CPU_RP_ROWS 16
/* Repacks buf's matrix when the op is a matmul the layout serves; restores
 * the plain layout of every other buffer the op touches. With apply false
 * it changes nothing and sets *stale when it would change a layout. The
 * caller holds dev->layout: for writing to apply, for reading to ask. */
duet_status duet__cpu_rp_prepare(cpu_backend *be, const duet_op *op, bool apply, bool *stale);
/* Restores buf's plain layout (no-op when it has none); fails only out of
 * memory (16 rows of staging), leaving the layout as it was. */
duet_status duet__cpu_rp_restore(cpu_backend *be, duet_buffer *buf);
/* Row `row` of a repacked Q4_0, Q5_0 or F16 table as n floats. */
void duet__cpu_rp_dequant_row(const duet_buffer *buf, int64_t row, float *out);

/* Quantises n floats (n % 32 == 0) to q8_0 blocks with the fastest path of
 * be's ISA: the fused outputs of rmsnorm/swiglu/attention and matmul's own
 * quantisation of f32 activations share it (cpu_matmul.c). */
void duet__cpu_quantize_q8_0(const cpu_backend *be, const float *x, duet_block_q8_0 *y, int64_t n);
/* table_buf: the table's buffer when its rows are repacked, else NULL. */
duet_status duet__cpu_embed(cpu_backend *be, const duet_op *op, const int32_t *tokens, const void *table,
                            const duet_buffer *table_buf, float *out);
/* out_q8 (NULL when absent) gets the q8_0 blocks of each f32 out row; out
 * may then be NULL too (rows go through per-thread scratch). */
duet_status duet__cpu_rmsnorm(cpu_backend *be, const duet_op *op, const float *x, const float *w, float *out,
                              duet_block_q8_0 *out_q8);
/* Paged KV: table is the validated i32 [n_seqs][max_blocks] block table. */
duet_status duet__cpu_rope_kv(cpu_backend *be, const duet_op *op, float *q, float *k, const float *v,
                              const int32_t *pos, const int32_t *seq, const float *freqs,
                              const int32_t *table, void *k_pool, void *v_pool);
duet_status duet__cpu_attention(cpu_backend *be, const duet_op *op, const float *q, const int32_t *pos,
                                const int32_t *seq, const int32_t *table, const void *k_pool,
                                const void *v_pool, float *out, duet_block_q8_0 *out_q8);
duet_status duet__cpu_swiglu(cpu_backend *be, const duet_op *op, const float *gate, const float *up,
                             float *out, duet_block_q8_0 *out_q8);
duet_status duet__cpu_add(cpu_backend *be, const duet_op *op, const float *a, const float *b, float *out);
duet_status duet__cpu_gather(cpu_backend *be, const duet_op *op, const float *x, const int32_t *rows,
                             float *out);
duet_status duet__cpu_argmax(cpu_backend *be, const duet_op *op, const float *x, int32_t *out);

#endif /* DUET_CPU_INTERNAL_H */
