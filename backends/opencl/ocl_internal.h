/* ocl_internal.h — shared state of the OpenCL backend's files.
 *
 * ocl_device.c   platforms and devices through the ICD loader, device info,
 *                CL error names and the CL_TRY macro's target
 * ocl_program.c  kernel sources (embedded or $DUET_KERNEL_DIR), run-time
 *                compilation with -D options, the on-disk binary cache
 * ocl_tuning.c   the per-device tuning table (exact device -> vendor/arch
 *                -> default) and the $DUET_OPENCL_TUNE override
 * ocl_backend.c  the interface: instances, buffers, op validation, steps,
 *                profiling
 * ocl_ops.c      one enqueue function per op (kernel arguments and
 *                NDRanges), CLBlast for large F32/F16 GEMMs
 */
#ifndef DUET_OCL_INTERNAL_H
#define DUET_OCL_INTERNAL_H

#ifndef CL_TARGET_OPENCL_VERSION
#define CL_TARGET_OPENCL_VERSION 120
#endif
#include <CL/cl.h>
#include <pthread.h>
#include <stdatomic.h>

#include "../backend.h"

extern const duet_backend_iface duet_opencl_backend_iface;

/* ---- errors -------------------------------------------------------------- */

const char *duet__ocl_error_name(cl_int err); /* "CL_OUT_OF_RESOURCES", ... */
/* Records "opencl: <expr> failed: <CL name> (<code>) at file:line" and
 * returns the matching duet_status. */
duet_status duet__ocl_fail(cl_int err, const char *expr, const char *file, int line);

/* Turns a CL result into a duet_status at the backend boundary. */
#define CL_TRY(expr)                                                                                         \
    do {                                                                                                     \
        cl_int cl_try_err_ = (expr);                                                                         \
        if (cl_try_err_ != CL_SUCCESS) return duet__ocl_fail(cl_try_err_, #expr, __FILE__, __LINE__);        \
    } while (0)

/* ---- devices (ocl_device.c) ------------------------------------------------- */

typedef struct ocl_device {
    cl_platform_id platform;
    cl_device_id id;
    duet_device_info info;
    char platform_name[128];
    char version[128];     /* CL_DEVICE_VERSION */
    cl_ulong local_mem;    /* bytes of local memory per work-group */
    cl_ulong max_alloc;    /* largest single buffer */
    size_t max_wg;         /* largest work-group */
    bool fp16;             /* cl_khr_fp16 */
    bool fp64;             /* cl_khr_fp64 */
    bool subgroups;        /* cl_khr_subgroups */
    bool int_dot;          /* cl_khr_integer_dot_product with a 4x8-bit capability */
    bool int_dot_packed;   /* ... including packed 4x8-bit words (dot_*_4x8packed_*) */
    bool int_dot_accel;    /* the driver says signed 4x8 dot products are accelerated */
    bool cl30;             /* OpenCL C 3.0 compiler (CL_DEVICE_OPENCL_C_ALL_VERSIONS) */
    bool unified;          /* host-unified memory */
    bool local_is_global;  /* CL_GLOBAL local memory (CPU devices) */
    bool own_kernel_cache; /* the driver caches compiled kernels on disk itself (PoCL) */
} ocl_device;

/* Every OpenCL device of every platform, enumerated once per process. On
 * failure (no loader vendors, no platform, no device) returns false and
 * fills `why`. */
bool duet__ocl_devices(const ocl_device **list, int *n, char *why, size_t why_size);

/* ---- tuning (ocl_tuning.c) ------------------------------------------------- */

/* Every knob a kernel or the dispatcher reads. Kernels get them as -D
 * options (CLBlast style: #ifndef NAME / #define NAME default). */
typedef struct ocl_tuning {
    char entry[64];         /* which table entry matched (for logs and tests) */
    int mv_r;               /* matmul: work-items sharing one dot product (1 = none) */
    int mv_nr;              /* matmul: output rows per work-item (1, 2, 4) */
    int mv_vw;              /* matmul: vector width of the inner loop (4, 8, 16) */
    int mv_wg;              /* matmul: work-group size (a multiple of mv_r) */
    int mv_mt;              /* matmul: tokens per work-item when n_tokens > 1 (1..8) */
    int mv_qg;              /* matmul q8_0: blocks whose scales convert together (1 or 8) */
    int norm_wg;            /* rmsnorm and argmax: work-items per row (power of two) */
    int att_wg;             /* attention decode: work-items per (token, head group, split) (power of two) */
    int att_g;              /* attention decode: most query heads per work-group, whole GQA groups of
                             * adjacent KV heads (0 = only heads of one KV head, at most 8) */
    int att_split;          /* attention decode: most keys per split (local memory holds their scores) */
    int att_occ;            /* attention decode: split long contexts until there are this many
                             * work-groups per compute unit (0 = only att_split bounds a split) */
    int att_bq, att_bk;     /* attention prefill: query rows and keys per tile */
    int att_tpr;            /* attention prefill: work-items per query row */
    int att_pf_min;         /* attention: batches of at least this many tokens (and more tokens
                             * than sequence slots) take the prefill kernel; 0 = never */
    int att_mode;           /* attention: 0 = pick by batch, 1 = always decode, 2 = always prefill */
    int rope_wg;            /* rope_kv: work-items per token */
    int dot;                /* q8 x q8 matmul: -1 = int dot products when the device has them,
                             * 0 = portable fallback, 1 = require the extension, 2 = the
                             * extension's code with emulated built-ins (tests) */
    int mq_nr;              /* q8 x q8 matvec: output rows per work-item (1, 2, 4, 8) */
    int mm_tile_min;        /* q8 x q8 matmuls with at least this many tokens use the tiled GEMM; 0 = never */
    int q8_f32_min;         /* q8 matmuls with at least this many tokens dequantise x_q8 to f32 and take
                             * the f32-activation kernel (where int8 dot products are slow); 0 = never */
    int mm_bn, mm_tr;       /* tiled GEMM: tile edge and work-item micro-tile edge */
    int ew_wg;              /* elementwise ops: work-group size (0 = the driver's choice) */
    int clblast_min;        /* F32/F16 matmuls with at least this many tokens use CLBlast; 0 = never */
    size_t clblast_scratch; /* bytes of f32 scratch for F16 weights converted for CLBlast */
} ocl_tuning;

/* The entry for `dev`, then any overrides from $DUET_OPENCL_TUNE
 * ("mv_r=32,clblast_min=0"). Fails on a malformed override. */
duet_status duet__ocl_tuning_for(const ocl_device *dev, ocl_tuning *out);

/* ---- programs (ocl_program.c) ---------------------------------------------- */

#define OCL_MAX_PROGRAMS 64
#define OCL_MAX_KERNELS 8

typedef struct ocl_program {
    char family[32];   /* kernels/<family>.cl */
    char options[512]; /* the -D options it was built with (beyond the device's) */
    cl_program prog;
    int n_kernels;
    char kernel_names[OCL_MAX_KERNELS][32];
    cl_kernel kernels[OCL_MAX_KERNELS];
} ocl_program;

/* A device's programs, shared by an instance and its streams (ocl_backend.c):
 * each built once, keyed by family, options and the device options used. */
typedef struct ocl_shared_program {
    char family[32];
    char options[512];
    char dev_options[256];
    cl_program prog;
} ocl_shared_program;

/* What an instance and its streams share: the context (each holds a
 * reference of its own) and the programs. OpenCL calls are thread-safe but
 * for clSetKernelArg on one kernel object (the spec's thread-safety
 * appendix), so the streams' kernel objects are their own; `mu` guards the
 * program table (lookup, build, insert). */
typedef struct ocl_shared {
    atomic_int refs;
    pthread_mutex_t mu;
    int n_programs;
    ocl_shared_program programs[OCL_MAX_PROGRAMS];
} ocl_shared;

typedef struct ocl_stats {
    int programs_built;  /* compiled from source */
    int programs_cached; /* loaded from the on-disk cache */
    int programs_cache_saved;
    int clblast_calls;     /* GEMMs that went to CLBlast */
    int feature_fallbacks; /* builds retried without fp16/subgroup/int-dot code */
} ocl_stats;

typedef struct ocl_backend ocl_backend;

/* The kernel `name` of kernels/<family>.cl built with `options` (plus the
 * device's feature defines and common.cl), compiled on first use. */
duet_status duet__ocl_kernel(ocl_backend *be, const char *family, const char *options, const char *name,
                             cl_kernel *out);
void duet__ocl_programs_free(ocl_backend *be);
/* Where program binaries are cached: $DUET_OPENCL_CACHE_DIR, else
 * $XDG_CACHE_HOME/duet/opencl, else ~/.cache/duet/opencl; "" when off
 * (DUET_OPENCL_CACHE=0). */
void duet__ocl_cache_dir(char *out, size_t size);
/* Whether programs built for `dev` go through that cache: DUET_OPENCL_CACHE=0
 * never, =1 always, unset unless the driver keeps a kernel cache of its own
 * (asking PoCL for a program binary makes it compile every kernel of the
 * program, used or not, for any work-group size: three times the cold
 * build time of the kernels a run uses, for nothing its own cache lacks). */
bool duet__ocl_use_cache(const ocl_device *dev);

/* ---- the instance (ocl_backend.c) ------------------------------------------- */

struct duet_buffer {
    duet_buffer_head head; /* first: the registry reads it */
    cl_mem mem;
};

/* Profiling counters: every op kind, plus CLBlast's GEMMs apart. */
#define OCL_PROF_CLBLAST DUET_OP_COUNT
#define OCL_PROF_KINDS (DUET_OP_COUNT + 1)

struct ocl_backend {
    duet_backend base; /* must be first */
    const ocl_device *dev;
    ocl_shared *shared;     /* the programs, shared with the device's other streams */
    cl_context ctx;         /* shared too (a reference of this stream's own) */
    cl_command_queue queue; /* this stream's, in order: ops run in recording order */
    ocl_tuning tune;
    char dev_options[256]; /* -D options from the device's features */
    bool in_step;
    bool counted; /* in live_instances (ocl_backend.c) */

    ocl_program programs[OCL_MAX_PROGRAMS]; /* a reference to each shared program, its own kernels */
    int n_programs;
    ocl_stats stats;

    /* f32 copy of F16 weight rows for CLBlast, grown on first need. */
    cl_mem scratch;
    size_t scratch_size;
    /* Attention: flash-decoding partials and the f32 rows of an unfused
     * q8 output, grown on need (one step's ops run in order, so one
     * buffer serves every layer). */
    cl_mem att_part;
    size_t att_part_size;
    cl_mem att_rows;
    size_t att_rows_size;
    /* q8_0 activations dequantised to f32 (q8_f32_min), grown on need. */
    cl_mem q8_rows;
    size_t q8_rows_size;
    /* Bytes of the internal buffers above live now, and their high-water mark. */
    size_t scratch_live, scratch_peak;
    int int_dot; /* the INT_DOT kernel variant in use: 0 portable, 1 packed, 2 char4 */

    /* Profiling ($DUET_PROFILE=1): an event per enqueue, read at wait. */
    bool profile;
    int prof_steps;
    cl_event *events;
    int *event_kinds;
    int n_events, cap_events;
    double prof_ms[OCL_PROF_KINDS];
    long prof_count[OCL_PROF_KINDS];
};

/* The event slot for the next enqueue of kind `kind` when profiling, else
 * NULL. The enqueue that receives it must succeed or call ocl_event_drop. */
cl_event *duet__ocl_event_slot(ocl_backend *be, int kind);
void duet__ocl_event_drop(ocl_backend *be);

/* Per-op-kind device time since open (ms) and op counts; zeros unless
 * profiling. Fills at most OCL_PROF_KINDS entries. */
void duet__ocl_profile(const ocl_backend *be, double *ms, long *count);

/* ---- ops (ocl_ops.c) ----------------------------------------------------------- */

/* Enqueues one validated op. */
duet_status duet__ocl_enqueue(ocl_backend *be, const duet_op *op);
/* Which path a matmul of this shape takes: "matvec", "clblast", "q8_matvec",
 * "q8_tiled", "q8_as_f32", or for the block types other than q8_0 "blk"
 * (f32 x) and "blk_q8" (x_q8). */
const char *duet__ocl_matmul_path(const ocl_backend *be, const duet_op *op);

/* Largest head_dim the attention kernels take, and n_rot / 2 rope_kv takes. */
#define OCL_ATT_DMAX 256
#define OCL_ROPE_HALF_MAX 128

/* An internal device buffer of at least `size` bytes in *mem (grown by
 * release + create; its old contents are lost), counted in scratch_bytes. */
duet_status duet__ocl_scratch(ocl_backend *be, cl_mem *mem, size_t *cur, size_t size, const char *what);
/* Which attention kernel an op takes ("decode", "prefill") and, for decode,
 * its split length and count. */
const char *duet__ocl_attention_plan(const ocl_backend *be, const duet_op *op, int *split_len, int *n_splits);

#endif /* DUET_OCL_INTERNAL_H */
