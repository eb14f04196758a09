/* ocl_ops.c — one enqueue function per op: the kernel variant (-D options
 * from the op's types and the device's tuning), its arguments and its
 * NDRange; and CLBlast for F32/F16 matmuls with many tokens.
 *
 * Ops arrive validated (ocl_backend.c). Views reach kernels as a cl_mem and
 * a byte offset. */
/* First: it sets CL_TARGET_OPENCL_VERSION before clblast_c.h pulls in CL/cl.h. */
#include "ocl_internal.h"

#include <clblast_c.h>
#include <stdio.h>
#include <string.h>

/* ---- kernel arguments ------------------------------------------------------------ */

typedef struct argset {
    cl_kernel k;
    cl_uint i;
    cl_int err;
} argset;

static void arg(argset *a, size_t size, const void *p) {
    if (a->err == CL_SUCCESS) a->err = clSetKernelArg(a->k, a->i, size, p);
    a->i++;
}
static void arg_view(argset *a, duet_view v) {
    cl_ulong off = v.offset;
    arg(a, sizeof(cl_mem), &v.buf->mem);
    arg(a, sizeof off, &off);
}
static void arg_int(argset *a, int v) {
    cl_int x = v;
    arg(a, sizeof x, &x);
}
static void arg_ulong(argset *a, uint64_t v) {
    cl_ulong x = v;
    arg(a, sizeof x, &x);
}
static void arg_float(argset *a, float v) {
    cl_float x = v;
    arg(a, sizeof x, &x);
}

static duet_status args_done(const argset *a, const char *kernel) {
    if (a->err != CL_SUCCESS) {
        char what[96];
        snprintf(what, sizeof what, "clSetKernelArg(%s, %u)", kernel, a->i - 1);
        return duet__ocl_fail(a->err, what, __FILE__, __LINE__);
    }
    return DUET_OK;
}

/* Enqueues k over `global` (rounded up to whole work-groups; local may be
 * NULL for the driver's choice). */
static duet_status launch(ocl_backend *be, cl_kernel k, int kind, cl_uint dims, const size_t *global,
                          const size_t *local) {
    size_t g[3];
    for (cl_uint d = 0; d < dims; d++)
        g[d] = local ? (global[d] + local[d] - 1) / local[d] * local[d] : global[d];
    cl_event *ev = duet__ocl_event_slot(be, kind);
    cl_int err = clEnqueueNDRangeKernel(be->queue, k, dims, NULL, g, local, 0, NULL, ev);
    if (err != CL_SUCCESS) {
        if (ev) duet__ocl_event_drop(be);
        if (err == CL_INVALID_WORK_GROUP_SIZE && local) {
            /* A kernel may allow fewer work-items than the device (registers). */
            size_t allowed = 0;
            clGetKernelWorkGroupInfo(k, be->dev->id, CL_KERNEL_WORK_GROUP_SIZE, sizeof allowed, &allowed,
                                     NULL);
            return duet__error(
                DUET_DEVICE,
                "opencl: tuning '%s' asks for work-groups of %zu but this kernel allows %zu on %s; "
                "lower it with DUET_OPENCL_TUNE",
                be->tune.entry, local[0] * (dims > 1 ? local[1] : 1), allowed, be->dev->info.name);
        }
        return duet__ocl_fail(err, "clEnqueueNDRangeKernel", __FILE__, __LINE__);
    }
    return DUET_OK;
}

#define TRY(expr)                                                                                            \
    do {                                                                                                     \
        duet_status st_ = (expr);                                                                            \
        if (st_ != DUET_OK) return st_;                                                                      \
    } while (0)

static uint64_t view_avail(duet_view v) {
    return v.buf && v.offset <= v.buf->head.size ? v.buf->head.size - v.offset : 0;
}

/* Elementwise work-group: the tuned size, or the driver's choice (NULL). */
static const size_t *ew_local(const ocl_backend *be, size_t *l2) {
    if (be->tune.ew_wg <= 0) return NULL;
    l2[0] = (size_t)be->tune.ew_wg;
    l2[1] = 1;
    return l2;
}

/* ---- ops ---------------------------------------------------------------------------- */

/* The block weight types other than q8_0 (Q4_0 .. IQ4_XS): their embed and
 * matmul kernels decode 32-weight chunks (blk_chunk in common.cl). */
static bool blk_dtype(duet_dtype t) {
    return t != DUET_DTYPE_Q8_0 && duet_dtype_block(t) > 1;
}

static duet_status op_embed(ocl_backend *be, const duet_op *op) {
    char opts[64];
    snprintf(opts, sizeof opts, "-DWTYPE=%d", (int)op->embed.dtype);
    const bool blk = blk_dtype(op->embed.dtype);
    cl_kernel k;
    TRY(duet__ocl_kernel(be, "embed", opts, blk ? "embed_blk" : "embed", &k));
    const int dim = op->embed.dim;
    argset a = {k, 0, CL_SUCCESS};
    arg_view(&a, op->embed.tokens);
    arg_view(&a, op->embed.table);
    arg_ulong(&a, view_avail(op->embed.table) / duet_dtype_row_bytes(op->embed.dtype, dim));
    arg_view(&a, op->embed.out);
    arg_int(&a, dim);
    TRY(args_done(&a, "embed"));
    size_t g[2] = {(size_t)(blk ? dim / 32 : dim), (size_t)op->n_tokens}, l[2];
    return launch(be, k, DUET_OP_EMBED, 2, g, ew_local(be, l));
}

/* A view for a kernel argument that may be absent (its flag bit clear):
 * the kernel never touches it, but the argument needs a buffer. */
static duet_view or_view(duet_view v, duet_view fallback) {
    return v.buf ? v : fallback;
}

static duet_status op_rmsnorm(ocl_backend *be, const duet_op *op) {
    char opts[64];
    snprintf(opts, sizeof opts, "-DNORM_WG=%d", be->tune.norm_wg);
    cl_kernel k;
    TRY(duet__ocl_kernel(be, "rmsnorm", opts, "rmsnorm", &k));
    argset a = {k, 0, CL_SUCCESS};
    arg_view(&a, op->rmsnorm.x);
    arg_view(&a, op->rmsnorm.w);
    arg_view(&a, or_view(op->rmsnorm.out, op->rmsnorm.x));
    arg_view(&a, or_view(op->rmsnorm.out_q8, op->rmsnorm.x));
    arg_int(&a, op->rmsnorm.dim);
    arg_float(&a, op->rmsnorm.eps);
    arg_int(&a, (op->rmsnorm.out.buf ? 1 : 0) | (op->rmsnorm.out_q8.buf ? 2 : 0));
    TRY(args_done(&a, "rmsnorm"));
    size_t g[2] = {(size_t)be->tune.norm_wg, (size_t)op->n_tokens}, l[2] = {(size_t)be->tune.norm_wg, 1};
    return launch(be, k, DUET_OP_RMSNORM, 2, g, l);
}

/* The matmul program for this dtype and token count: single-token ops get
 * MV_MT = 1 (no wasted token lanes), the rest the tuned tile. */
static duet_status matmul_kernel(ocl_backend *be, duet_dtype dt, int mt, const char *name, cl_kernel *k) {
    const ocl_tuning *t = &be->tune;
    char opts[160];
    snprintf(opts, sizeof opts, "-DWTYPE=%d -DMV_R=%d -DMV_NR=%d -DMV_VW=%d -DMV_WG=%d -DMV_MT=%d -DMV_QG=%d",
             (int)dt, t->mv_r, t->mv_nr, t->mv_vw, t->mv_wg, mt, dt == DUET_DTYPE_Q8_0 ? t->mv_qg : 1);
    return duet__ocl_kernel(be, "matmul", opts, name, k);
}

static duet_status matmul_ours(ocl_backend *be, const duet_op *op) {
    const ocl_tuning *t = &be->tune;
    const int mt = op->n_tokens == 1 ? 1 : t->mv_mt;
    cl_kernel k;
    TRY(matmul_kernel(be, op->matmul.dtype, mt, "matmul", &k));
    const bool bias = op->matmul.bias.buf != NULL;
    argset a = {k, 0, CL_SUCCESS};
    arg_view(&a, op->matmul.w);
    arg_view(&a, op->matmul.x);
    arg_view(&a, bias ? op->matmul.bias : op->matmul.x); /* never read without the flag */
    arg_view(&a, op->matmul.out);
    arg_int(&a, op->matmul.n_in);
    arg_int(&a, op->matmul.n_out);
    arg_int(&a, op->n_tokens);
    arg_int(&a, (bias ? 1 : 0) | (op->matmul.accumulate ? 2 : 0));
    TRY(args_done(&a, "matmul"));
    size_t groups = ((size_t)op->matmul.n_out + (size_t)t->mv_nr - 1) / (size_t)t->mv_nr;
    size_t g[2] = {groups * (size_t)t->mv_r, ((size_t)op->n_tokens + (size_t)mt - 1) / (size_t)mt};
    size_t l[2] = {(size_t)t->mv_wg, 1};
    return launch(be, k, DUET_OP_MATMUL, 2, g, l);
}

static duet_status clblast_fail(CLBlastStatusCode s, const char *what) {
    return duet__error(DUET_DEVICE, "opencl: CLBlast %s failed with status %d%s", what, (int)s,
                       s == CLBlastNoHalfPrecision ? " (device has no half precision)" : "");
}

/* out = x · Wᵀ through CLBlast's row-major SGEMM (C[T][n_out] = A[T][n_in] ·
 * B[n_out][n_in]ᵀ), beta = 1 to accumulate. F16 weights are converted to an
 * f32 scratch buffer a chunk of rows at a time, since SGEMM is the routine
 * every device has (HGEMM needs cl_khr_fp16 and half activations). */
static duet_status matmul_clblast(ocl_backend *be, const duet_op *op) {
    const int n_in = op->matmul.n_in, n_out = op->matmul.n_out, T = op->n_tokens;
    const float beta = op->matmul.accumulate ? 1.0f : 0.0f;
    cl_mem xm = op->matmul.x.buf->mem, om = op->matmul.out.buf->mem;
    const size_t x_off = op->matmul.x.offset / 4, o_off = op->matmul.out.offset / 4;
    CLBlastStatusCode s;
    if (op->matmul.dtype == DUET_DTYPE_F32) {
        s = CLBlastSgemm(CLBlastLayoutRowMajor, CLBlastTransposeNo, CLBlastTransposeYes, (size_t)T,
                         (size_t)n_out, (size_t)n_in, 1.0f, xm, x_off, (size_t)n_in, op->matmul.w.buf->mem,
                         op->matmul.w.offset / 4, (size_t)n_in, beta, om, o_off, (size_t)n_out, &be->queue,
                         duet__ocl_event_slot(be, OCL_PROF_CLBLAST));
        if (s != CLBlastSuccess) {
            duet__ocl_event_drop(be);
            return clblast_fail(s, "SGEMM");
        }
    } else {
        const size_t row_f32 = (size_t)n_in * 4;
        size_t rows = be->tune.clblast_scratch / row_f32;
        if (rows < 1) rows = 1;
        if (rows > (size_t)n_out) rows = (size_t)n_out;
        TRY(duet__ocl_scratch(be, &be->scratch, &be->scratch_size, rows * row_f32, "clblast scratch"));
        cl_kernel k;
        TRY(matmul_kernel(be, op->matmul.dtype, 1, "dequantize_rows", &k));
        for (size_t r0 = 0; r0 < (size_t)n_out; r0 += rows) {
            const size_t nr = (size_t)n_out - r0 < rows ? (size_t)n_out - r0 : rows;
            argset a = {k, 0, CL_SUCCESS};
            arg_view(&a, op->matmul.w);
            arg_int(&a, n_in);
            arg_int(&a, (int)r0);
            arg_int(&a, (int)nr);
            arg(&a, sizeof(cl_mem), &be->scratch);
            TRY(args_done(&a, "dequantize_rows"));
            size_t g[2] = {(size_t)n_in, nr}, l[2];
            TRY(launch(be, k, DUET_OP_MATMUL, 2, g, ew_local(be, l)));
            s = CLBlastSgemm(CLBlastLayoutRowMajor, CLBlastTransposeNo, CLBlastTransposeYes, (size_t)T, nr,
                             (size_t)n_in, 1.0f, xm, x_off, (size_t)n_in, be->scratch, 0, (size_t)n_in, beta,
                             om, o_off + r0, (size_t)n_out, &be->queue,
                             duet__ocl_event_slot(be, OCL_PROF_CLBLAST));
            if (s != CLBlastSuccess) {
                duet__ocl_event_drop(be);
                return clblast_fail(s, "SGEMM");
            }
        }
    }
    be->stats.clblast_calls++;
    if (!op->matmul.bias.buf) return DUET_OK;
    cl_kernel k;
    TRY(duet__ocl_kernel(be, "elementwise", "", "bias_add", &k));
    argset a = {k, 0, CL_SUCCESS};
    arg_view(&a, op->matmul.bias);
    arg_view(&a, op->matmul.out);
    arg_int(&a, n_out);
    TRY(args_done(&a, "bias_add"));
    size_t g[2] = {(size_t)n_out, (size_t)T}, l[2];
    return launch(be, k, DUET_OP_MATMUL, 2, g, ew_local(be, l));
}

/* The q8 x q8 program: the int8 dot product variant (be->int_dot) and the
 * tile sizes. A device that advertises cl_khr_integer_dot_product but
 * cannot build its use falls back to the portable code for this instance
 * (unless the tuning demands the extension). */
static duet_status mq_kernel(ocl_backend *be, int mt, const char *name, cl_kernel *k) {
    const ocl_tuning *t = &be->tune;
    for (;;) {
        char opts[320];
        const bool emulate = t->dot == 2;
        /* The built-ins are core OpenCL C 3.0 features where the compiler
         * speaks 3.0; older compilers take the extension pragma. */
        snprintf(opts, sizeof opts,
                 "-DWTYPE=%d -DMV_R=%d -DMV_NR=%d -DMV_VW=%d -DMV_WG=%d -DMV_MT=%d -DMV_QG=1 -DMQ_KERNELS "
                 "-DINT_DOT=%d "
                 "-DMT_BN=%d -DMT_TR=%d%s%s",
                 (int)DUET_DTYPE_Q8_0, t->mv_r, t->mq_nr, t->mv_vw, t->mv_wg, mt, be->int_dot, t->mm_bn,
                 t->mm_tr, emulate ? " -DOCL_DOT_EMULATE" : "",
                 be->int_dot && !emulate && be->dev->cl30 ? " -cl-std=CL3.0" : "");
        duet_status st = duet__ocl_kernel(be, "matmul", opts, name, k);
        if (st != DUET_COMPILE || be->int_dot == 0 || t->dot != -1) return st;
        be->int_dot = 0;
        be->stats.feature_fallbacks++;
    }
}

static duet_status matmul_q8(ocl_backend *be, const duet_op *op) {
    const ocl_tuning *t = &be->tune;
    const bool tiled = strcmp(duet__ocl_matmul_path(be, op), "q8_tiled") == 0;
    const int mt = op->n_tokens == 1 ? 1 : t->mv_mt;
    cl_kernel k;
    TRY(mq_kernel(be, mt, tiled ? "matmul_q8_0_q8_0_tiled" : "matmul_q8_0_q8_0", &k));
    const bool bias = op->matmul.bias.buf != NULL;
    argset a = {k, 0, CL_SUCCESS};
    arg_view(&a, op->matmul.w);
    arg_view(&a, op->matmul.x_q8);
    arg_view(&a, bias ? op->matmul.bias : op->matmul.x_q8); /* never read without the flag */
    arg_view(&a, op->matmul.out);
    arg_int(&a, op->matmul.n_in);
    arg_int(&a, op->matmul.n_out);
    arg_int(&a, op->n_tokens);
    arg_int(&a, (bias ? 1 : 0) | (op->matmul.accumulate ? 2 : 0));
    TRY(args_done(&a, tiled ? "matmul_q8_0_q8_0_tiled" : "matmul_q8_0_q8_0"));
    if (tiled) {
        const size_t th = (size_t)(t->mm_bn / t->mm_tr), bn = (size_t)t->mm_bn;
        size_t g[2] = {th * th * (((size_t)op->matmul.n_out + bn - 1) / bn),
                       ((size_t)op->n_tokens + bn - 1) / bn};
        size_t l[2] = {th * th, 1};
        return launch(be, k, DUET_OP_MATMUL, 2, g, l);
    }
    size_t groups = ((size_t)op->matmul.n_out + (size_t)t->mq_nr - 1) / (size_t)t->mq_nr;
    size_t g[2] = {groups * (size_t)t->mv_r, ((size_t)op->n_tokens + (size_t)mt - 1) / (size_t)mt};
    size_t l[2] = {(size_t)t->mv_wg, 1};
    return launch(be, k, DUET_OP_MATMUL, 2, g, l);
}

const char *duet__ocl_matmul_path(const ocl_backend *be, const duet_op *op) {
    const duet_dtype dt = op->matmul.dtype;
    if (op->matmul.x_q8.buf && be->tune.q8_f32_min > 0 && op->n_tokens >= be->tune.q8_f32_min)
        return "q8_as_f32";
    /* The block types have no local-memory tiled GEMM (yet): their matvec
     * kernels take MV_MT tokens per work-item at any batch. */
    if (blk_dtype(dt)) return op->matmul.x_q8.buf ? "blk_q8" : "blk";
    if (op->matmul.x_q8.buf)
        return be->tune.mm_tile_min > 0 && op->n_tokens >= be->tune.mm_tile_min ? "q8_tiled" : "q8_matvec";
    if ((dt == DUET_DTYPE_F32 || dt == DUET_DTYPE_F16) && be->tune.clblast_min > 0 &&
        op->n_tokens >= be->tune.clblast_min)
        return "clblast";
    return "matvec";
}

/* The program of a block weight type: four kernels (f32 or q8_0
 * activations, one or MV_MT tokens per work-item) and one -D set per
 * instance, so a model builds one program per type. The int8 dot variant
 * falls back as in mq_kernel. */
static duet_status blk_kernel(ocl_backend *be, duet_dtype dt, const char *name, cl_kernel *k) {
    const ocl_tuning *t = &be->tune;
    for (;;) {
        char opts[256];
        const bool emulate = t->dot == 2;
        snprintf(opts, sizeof opts, "-DWTYPE=%d -DMV_R=%d -DMV_NR=%d -DMV_WG=%d -DMV_MT=%d -DINT_DOT=%d%s%s",
                 (int)dt, t->mv_r, t->mv_nr, t->mv_wg, t->mv_mt, be->int_dot,
                 emulate ? " -DOCL_DOT_EMULATE" : "",
                 be->int_dot && !emulate && be->dev->cl30 ? " -cl-std=CL3.0" : "");
        duet_status st = duet__ocl_kernel(be, "matmul", opts, name, k);
        if (st != DUET_COMPILE || be->int_dot == 0 || t->dot != -1) return st;
        be->int_dot = 0;
        be->stats.feature_fallbacks++;
    }
}

/* A block-type matmul with f32 x or q8_0 x_q8. NDRange as for `matmul`. */
static duet_status matmul_blk(ocl_backend *be, const duet_op *op) {
    const ocl_tuning *t = &be->tune;
    const bool q8 = op->matmul.x_q8.buf != NULL;
    const int mt = op->n_tokens == 1 ? 1 : t->mv_mt;
    const char *name = q8 ? (mt == 1 ? "matvec_blk_q8_0" : "matmul_blk_q8_0")
                          : (mt == 1 ? "matvec_blk_f32" : "matmul_blk_f32");
    cl_kernel k;
    TRY(blk_kernel(be, op->matmul.dtype, name, &k));
    const duet_view x = q8 ? op->matmul.x_q8 : op->matmul.x;
    const bool bias = op->matmul.bias.buf != NULL;
    argset a = {k, 0, CL_SUCCESS};
    arg_view(&a, op->matmul.w);
    arg_view(&a, x);
    arg_view(&a, bias ? op->matmul.bias : x); /* never read without the flag */
    arg_view(&a, op->matmul.out);
    arg_int(&a, op->matmul.n_in);
    arg_int(&a, op->matmul.n_out);
    arg_int(&a, op->n_tokens);
    arg_int(&a, (bias ? 1 : 0) | (op->matmul.accumulate ? 2 : 0));
    TRY(args_done(&a, name));
    size_t groups = ((size_t)op->matmul.n_out + (size_t)t->mv_nr - 1) / (size_t)t->mv_nr;
    size_t g[2] = {groups * (size_t)t->mv_r, ((size_t)op->n_tokens + (size_t)mt - 1) / (size_t)mt};
    size_t l[2] = {(size_t)t->mv_wg, 1};
    return launch(be, k, DUET_OP_MATMUL, 2, g, l);
}

/* q8_0 activations dequantised to f32 rows, then the f32-activation
 * kernel: the same int8 values and scales, summed in float. */
static duet_status matmul_q8_as_f32(ocl_backend *be, const duet_op *op) {
    const int n_in = op->matmul.n_in, nt = op->n_tokens;
    TRY(duet__ocl_scratch(be, &be->q8_rows, &be->q8_rows_size, (size_t)nt * n_in * 4,
                          "dequantised activations"));
    cl_kernel k;
    TRY(matmul_kernel(be, DUET_DTYPE_Q8_0, 1, "dequantize_rows", &k));
    argset a = {k, 0, CL_SUCCESS};
    arg_view(&a, op->matmul.x_q8);
    arg_int(&a, n_in);
    arg_int(&a, 0);
    arg_int(&a, nt);
    arg(&a, sizeof(cl_mem), &be->q8_rows);
    TRY(args_done(&a, "dequantize_rows"));
    size_t g[2] = {(size_t)n_in, (size_t)nt}, l[2];
    TRY(launch(be, k, DUET_OP_MATMUL, 2, g, ew_local(be, l)));
    duet_buffer rows = {.head = {.size = be->q8_rows_size, .kind = DUET_BUFFER_DEVICE}, .mem = be->q8_rows};
    duet_op f = *op;
    f.matmul.x = (duet_view){&rows, 0};
    f.matmul.x_q8 = (duet_view){0};
    return blk_dtype(op->matmul.dtype) ? matmul_blk(be, &f) : matmul_ours(be, &f);
}

static duet_status op_matmul(ocl_backend *be, const duet_op *op) {
    const char *path = duet__ocl_matmul_path(be, op);
    if (strcmp(path, "q8_as_f32") == 0) return matmul_q8_as_f32(be, op);
    if (blk_dtype(op->matmul.dtype)) return matmul_blk(be, op);
    if (op->matmul.x_q8.buf) return matmul_q8(be, op);
    if (strcmp(path, "clblast") == 0) return matmul_clblast(be, op);
    return matmul_ours(be, op);
}

/* The paged-KV arguments every KV kernel takes after its pools: block
 * size, pool blocks, table rows and width. */
static void arg_kv_shape(argset *a, const duet_kv_pages *kv) {
    arg_int(a, kv->block_size);
    arg_int(a, kv->n_blocks);
    arg_int(a, kv->n_seqs);
    arg_int(a, kv->max_blocks);
}

static duet_status op_rope_kv(ocl_backend *be, const duet_op *op) {
    const duet_kv_pages *kv = &op->rope_kv.kv;
    char opts[96];
    snprintf(opts, sizeof opts, "-DKV_TYPE=%d -DROPE_WG=%d -DROPE_HALF_MAX=%d", (int)kv->dtype,
             be->tune.rope_wg, OCL_ROPE_HALF_MAX);
    cl_kernel k;
    TRY(duet__ocl_kernel(be, "rope_kv", opts, "rope_kv", &k));
    argset a = {k, 0, CL_SUCCESS};
    arg_view(&a, op->rope_kv.q);
    arg_view(&a, op->rope_kv.k);
    arg_view(&a, op->rope_kv.v);
    arg_view(&a, op->rope_kv.pos);
    arg_view(&a, op->rope_kv.seq);
    arg_view(&a, kv->k_pool);
    arg_view(&a, kv->v_pool);
    arg_view(&a, kv->block_table);
    /* Never read without rotary pairs: any buffer stands in. */
    arg_view(&a, op->rope_kv.n_rot > 0 ? op->rope_kv.freqs : kv->block_table);
    arg_int(&a, op->rope_kv.n_head);
    arg_int(&a, op->rope_kv.n_head_kv);
    arg_int(&a, op->rope_kv.head_dim);
    arg_int(&a, op->rope_kv.n_rot);
    arg_float(&a, op->rope_kv.mscale == 0.0f ? 1.0f : op->rope_kv.mscale);
    arg_int(&a, op->rope_kv.neox ? 1 : 0);
    arg_kv_shape(&a, kv);
    TRY(args_done(&a, "rope_kv"));
    size_t g[2] = {(size_t)be->tune.rope_wg, (size_t)op->n_tokens}, l[2] = {(size_t)be->tune.rope_wg, 1};
    return launch(be, k, DUET_OP_ROPE_KV, 2, g, l);
}

/* ---- attention ---------------------------------------------------------------------- */

#define OCL_RED_WG 64                           /* attn_reduce work-group (whole q8_0 blocks) */
#define OCL_ATT_SCRATCH_MAX ((size_t)256 << 20) /* decode partials past this take the prefill kernel */

typedef struct att_plan {
    bool prefill;
    int g;         /* decode: query heads per work-group */
    int gk;        /* decode: ... of them per KV head (g / gk adjacent KV heads) */
    int split_cap; /* decode: keys a split holds in local memory (ATT_SPLIT) */
    int split_len; /* decode: keys per split for this op */
    int n_splits;
    bool direct; /* decode: one split writes the output itself */
    int bq, bk;  /* prefill tile */
    size_t part_bytes;
} att_plan;

/* Local memory the kernels may use: the device's, less a margin for the
 * runtime, capped (CPU devices report their caches). */
static size_t local_budget(const ocl_backend *be) {
    size_t b = be->dev->local_mem > 1024 ? (size_t)be->dev->local_mem - 512 : 0;
    return b > 65536 ? 65536 : b;
}

static size_t decode_local(int hd, int g, int split, int wg) {
    return 4 * ((size_t)g * hd + (size_t)g * split + (wg > 1 ? (size_t)g * wg : 0));
}

static size_t prefill_local(int hd, int bq, int bk, int tpr) {
    return 4 * ((size_t)bq * (hd + 1) + (size_t)bk * (hd + 1) + (size_t)bk * hd + (size_t)bq * (bk + 1) +
                (size_t)bq * tpr) +
           12 * (size_t)bq;
}

/* Picks the kernel and its sizes for an attention op (no side effects).
 * False when no variant fits the device. */
static bool plan_attention(const ocl_backend *be, const duet_op *op, att_plan *p) {
    const ocl_tuning *t = &be->tune;
    const duet_kv_pages *kv = &op->attention.kv;
    const int hd = op->attention.head_dim, nh = op->attention.n_head, nt = op->n_tokens;
    const int group = nh / op->attention.n_head_kv;
    const size_t budget = local_budget(be);
    memset(p, 0, sizeof *p);

    /* Prefill: shrink the key tile, then the query tile, until it fits. */
    bool pf_ok = false;
    p->bq = t->att_bq;
    p->bk = t->att_bk;
    while (!(pf_ok = prefill_local(hd, p->bq, p->bk, t->att_tpr) <= budget)) {
        const int half = p->bk / 2 / t->att_tpr * t->att_tpr;
        if (p->bk > t->att_tpr)
            p->bk = half > t->att_tpr ? half : t->att_tpr;
        else if (p->bq > 1)
            p->bq /= 2;
        else
            break;
    }
    const bool want_pf =
        t->att_mode == 2 || (t->att_mode == 0 && t->att_pf_min > 0 && nt >= t->att_pf_min && nt > kv->n_seqs);

    /* Decode: the most heads per work-group whose scores fit a useful
     * split: within one KV head's query heads (GPUs, at most 8), or whole
     * GQA groups of adjacent KV heads up to att_g heads (CPUs: a key's
     * row is then read as one run). */
    bool dec_ok = false;
    const int gcap = t->att_g > 0 ? t->att_g : group < 8 ? group : 8;
    for (int g = gcap < nh ? gcap : nh; g >= 1 && !dec_ok; g--) {
        if (nh % g || (group % g && g % group)) continue;
        int split = t->att_split;
        while (split > t->att_wg && decode_local(hd, g, split, t->att_wg) > budget)
            split = split / 2 / t->att_wg * t->att_wg;
        if (split >= t->att_wg && decode_local(hd, g, split, t->att_wg) <= budget) {
            dec_ok = true;
            p->g = g;
            p->gk = g <= group ? g : group;
            p->split_cap = split;
        }
    }
    if (dec_ok) {
        /* Keys to cover: the caller's n_keys, else the table's capacity. */
        const long max_ctx =
            op->attention.n_keys > 0 ? (long)op->attention.n_keys : (long)kv->max_blocks * kv->block_size;
        int len = p->split_cap;
        const long groups = (long)nt * (nh / p->g);
        const long want =
            (long)t->att_occ * (be->dev->info.compute_units > 0 ? be->dev->info.compute_units : 1);
        if (t->att_occ > 0 && groups < want) {
            /* More splits for parallelism, but none shorter than 256 keys
             * (or att_wg): below that the reduce pass costs more than the
             * parallelism gains. */
            const long splits = (want + groups - 1) / groups;
            const long floor_len = t->att_wg > 256 ? t->att_wg : 256;
            long l = (max_ctx + splits - 1) / splits;
            l = (l + t->att_wg - 1) / t->att_wg * t->att_wg;
            if (l < floor_len) l = floor_len;
            if (l < len) len = (int)l;
        }
        p->split_len = len;
        p->n_splits = (int)((max_ctx + len - 1) / len);
        p->direct = p->n_splits == 1 && (!op->attention.out_q8.buf || hd % DUET_QK8_0 == 0);
        p->part_bytes = p->direct ? 0 : (size_t)nt * nh * (size_t)p->n_splits * (size_t)(hd + 2) * 4;
        if (p->part_bytes > OCL_ATT_SCRATCH_MAX) dec_ok = false;
    }
    if (pf_ok && (want_pf || !dec_ok)) {
        p->prefill = true;
        return true;
    }
    return dec_ok;
}

const char *duet__ocl_attention_plan(const ocl_backend *be, const duet_op *op, int *split_len,
                                     int *n_splits) {
    att_plan p;
    if (!plan_attention(be, op, &p)) return NULL;
    *split_len = p.prefill ? 0 : p.split_len;
    *n_splits = p.prefill ? 0 : p.n_splits;
    return p.prefill ? "prefill" : "decode";
}

/* The shared arguments of attn_decode and attn_prefill up to the pools. */
static void arg_att_inputs(argset *a, const duet_op *op) {
    arg_view(a, op->attention.q);
    arg_view(a, op->attention.pos);
    arg_view(a, op->attention.seq);
    arg_view(a, op->attention.kv.k_pool);
    arg_view(a, op->attention.kv.v_pool);
    arg_view(a, op->attention.kv.block_table);
}

static duet_status op_attention(ocl_backend *be, const duet_op *op) {
    const ocl_tuning *t = &be->tune;
    const duet_kv_pages *kv = &op->attention.kv;
    const int hd = op->attention.head_dim, nh = op->attention.n_head, nt = op->n_tokens;
    att_plan p;
    if (!plan_attention(be, op, &p))
        return duet__error(DUET_UNSUPPORTED, "attention: head_dim %d does not fit %s's local memory", hd,
                           be->dev->info.name);
    const bool q8 = op->attention.out_q8.buf != NULL;
    /* The prefill kernel quantises a row's own blocks; with head_dim not a
     * multiple of 32 the f32 rows go through out (or scratch) and a
     * separate quantise pass. */
    const bool unfused = q8 && p.prefill && hd % DUET_QK8_0 != 0;
    duet_view out = op->attention.out;
    if (unfused && !out.buf) {
        TRY(duet__ocl_scratch(be, &be->att_rows, &be->att_rows_size, (size_t)nt * nh * hd * 4,
                              "attention rows"));
        out = (duet_view){NULL, 0};
    }
    int flags = (op->attention.out.buf || unfused ? 1 : 0) | (q8 && !unfused ? 2 : 0);
    /* Decode (+ reduce) and prefill are separate programs: each sizes its
     * local arrays for its own plan. */
    char opts[256];
    if (p.prefill)
        snprintf(opts, sizeof opts,
                 "-DATT_PREFILL -DKV_TYPE=%d -DATT_HD=%d -DATT_BQ=%d -DATT_BK=%d -DATT_TPR=%d",
                 (int)kv->dtype, hd, p.bq, p.bk, t->att_tpr);
    else
        snprintf(opts, sizeof opts,
                 "-DATT_DECODE -DKV_TYPE=%d -DATT_HD=%d -DATT_WG=%d -DATT_GK=%d -DATT_NKV=%d -DATT_SPLIT=%d "
                 "-DRED_WG=%d",
                 (int)kv->dtype, hd, t->att_wg, p.gk, p.g / p.gk, p.split_cap, OCL_RED_WG);
    cl_kernel k;
    const cl_mem out_mem = out.buf ? out.buf->mem : be->att_rows;
    const cl_ulong out_off = out.buf ? out.offset : 0;
    const duet_view oq = or_view(op->attention.out_q8, op->attention.q);
    if (p.prefill) {
        TRY(duet__ocl_kernel(be, "attention", opts, "attn_prefill", &k));
        argset a = {k, 0, CL_SUCCESS};
        arg_att_inputs(&a, op);
        arg(&a, sizeof(cl_mem), flags & 1 ? &out_mem : &op->attention.q.buf->mem);
        arg_ulong(&a, flags & 1 ? out_off : op->attention.q.offset);
        arg_view(&a, oq);
        arg_int(&a, nt);
        arg_int(&a, nh);
        arg_int(&a, op->attention.n_head_kv);
        arg_float(&a, op->attention.scale);
        arg_kv_shape(&a, kv);
        arg_int(&a, flags);
        arg_int(&a, op->attention.window);
        TRY(args_done(&a, "attn_prefill"));
        const size_t rows = (size_t)nt * (size_t)(nh / op->attention.n_head_kv);
        const size_t wg = (size_t)p.bq * (size_t)t->att_tpr;
        size_t g[2] = {wg * ((rows + (size_t)p.bq - 1) / (size_t)p.bq), (size_t)op->attention.n_head_kv};
        size_t l[2] = {wg, 1};
        TRY(launch(be, k, DUET_OP_ATTENTION, 2, g, l));
    } else {
        if (!p.direct)
            TRY(duet__ocl_scratch(be, &be->att_part, &be->att_part_size, p.part_bytes, "attention partials"));
        TRY(duet__ocl_kernel(be, "attention", opts, "attn_decode", &k));
        argset a = {k, 0, CL_SUCCESS};
        arg_att_inputs(&a, op);
        arg(&a, sizeof(cl_mem), p.direct ? &op->attention.q.buf->mem : &be->att_part);
        arg(&a, sizeof(cl_mem), flags & 1 ? &out_mem : &op->attention.q.buf->mem);
        arg_ulong(&a, flags & 1 ? out_off : op->attention.q.offset);
        arg_view(&a, oq);
        arg_int(&a, nh);
        arg_int(&a, op->attention.n_head_kv);
        arg_float(&a, op->attention.scale);
        arg_int(&a, p.split_len);
        arg_int(&a, p.n_splits);
        arg_kv_shape(&a, kv);
        arg_int(&a, flags | (p.direct ? 4 : 0));
        arg_int(&a, op->attention.window);
        TRY(args_done(&a, "attn_decode"));
        size_t g[2] = {(size_t)t->att_wg * (size_t)(nh / p.g) * (size_t)nt, (size_t)p.n_splits};
        size_t l[2] = {(size_t)t->att_wg, 1};
        TRY(launch(be, k, DUET_OP_ATTENTION, 2, g, l));
        if (!p.direct) {
            cl_kernel r;
            TRY(duet__ocl_kernel(be, "attention", opts, "attn_reduce", &r));
            argset b = {r, 0, CL_SUCCESS};
            arg_view(&b, op->attention.pos);
            arg_view(&b, op->attention.seq);
            arg(&b, sizeof(cl_mem), &be->att_part);
            arg(&b, sizeof(cl_mem), flags & 1 ? &out_mem : &op->attention.q.buf->mem);
            arg_ulong(&b, flags & 1 ? out_off : op->attention.q.offset);
            arg_view(&b, oq);
            arg_int(&b, nh);
            arg_int(&b, p.split_len);
            arg_int(&b, p.n_splits);
            arg_int(&b, kv->block_size);
            arg_int(&b, kv->n_seqs);
            arg_int(&b, kv->max_blocks);
            arg_int(&b, flags);
            TRY(args_done(&b, "attn_reduce"));
            const size_t width = (size_t)nh * (size_t)hd;
            size_t g2[2] = {OCL_RED_WG * ((width + OCL_RED_WG - 1) / OCL_RED_WG), (size_t)nt};
            size_t l2[2] = {OCL_RED_WG, 1};
            TRY(launch(be, r, DUET_OP_ATTENTION, 2, g2, l2));
        }
    }
    if (!unfused) return DUET_OK;
    /* The separate quantise pass over the f32 rows just written. */
    cl_kernel qk;
    TRY(duet__ocl_kernel(be, "elementwise", "", "quantize_q8", &qk));
    const uint64_t nb = (uint64_t)nt * (uint64_t)nh * (uint64_t)hd / DUET_QK8_0;
    argset a = {qk, 0, CL_SUCCESS};
    arg(&a, sizeof(cl_mem), &out_mem);
    arg_ulong(&a, out_off);
    arg_view(&a, op->attention.out_q8);
    arg_ulong(&a, nb);
    TRY(args_done(&a, "quantize_q8"));
    size_t g[1] = {(size_t)nb}, l[2];
    return launch(be, qk, DUET_OP_ATTENTION, 1, g, ew_local(be, l));
}

/* swiglu and add: out[i] = f(a[i], b[i]) over n_tokens x dim elements. */
static duet_status op_binary(ocl_backend *be, const duet_op *op, const char *name, duet_view a0, duet_view b0,
                             duet_view out, int dim) {
    cl_kernel k;
    TRY(duet__ocl_kernel(be, "elementwise", "", name, &k));
    const uint64_t n = (uint64_t)op->n_tokens * (uint64_t)dim;
    argset a = {k, 0, CL_SUCCESS};
    arg_view(&a, a0);
    arg_view(&a, b0);
    arg_view(&a, out);
    arg_ulong(&a, n);
    TRY(args_done(&a, name));
    size_t g[1] = {(size_t)n}, l[2];
    return launch(be, k, op->kind, 1, g, ew_local(be, l));
}

static duet_status op_swiglu(ocl_backend *be, const duet_op *op) {
    if (!op->swiglu.out_q8.buf)
        return op_binary(be, op, "swiglu", op->swiglu.gate, op->swiglu.up, op->swiglu.out, op->swiglu.dim);
    cl_kernel k;
    TRY(duet__ocl_kernel(be, "elementwise", "", "swiglu_q8", &k));
    const uint64_t nb = (uint64_t)op->n_tokens * (uint64_t)(op->swiglu.dim / DUET_QK8_0);
    argset a = {k, 0, CL_SUCCESS};
    arg_view(&a, op->swiglu.gate);
    arg_view(&a, op->swiglu.up);
    arg_view(&a, or_view(op->swiglu.out, op->swiglu.gate));
    arg_view(&a, op->swiglu.out_q8);
    arg_ulong(&a, nb);
    arg_int(&a, op->swiglu.out.buf ? 1 : 0);
    TRY(args_done(&a, "swiglu_q8"));
    size_t g[1] = {(size_t)nb}, l[2];
    return launch(be, k, DUET_OP_SWIGLU, 1, g, ew_local(be, l));
}

static duet_status op_gather(ocl_backend *be, const duet_op *op) {
    cl_kernel k;
    TRY(duet__ocl_kernel(be, "elementwise", "", "gather_rows", &k));
    const int dim = op->gather.dim;
    argset a = {k, 0, CL_SUCCESS};
    arg_view(&a, op->gather.x);
    arg_ulong(&a, view_avail(op->gather.x) / ((uint64_t)dim * 4));
    arg_view(&a, op->gather.rows);
    arg_view(&a, op->gather.out);
    arg_int(&a, dim);
    TRY(args_done(&a, "gather_rows"));
    size_t g[2] = {(size_t)dim, (size_t)op->n_tokens}, l[2];
    return launch(be, k, DUET_OP_GATHER_ROWS, 2, g, ew_local(be, l));
}

static duet_status op_argmax(ocl_backend *be, const duet_op *op) {
    char opts[64];
    snprintf(opts, sizeof opts, "-DNORM_WG=%d", be->tune.norm_wg);
    cl_kernel k;
    TRY(duet__ocl_kernel(be, "argmax", opts, "argmax", &k));
    argset a = {k, 0, CL_SUCCESS};
    arg_view(&a, op->argmax.x);
    arg_view(&a, op->argmax.out);
    arg_int(&a, op->argmax.dim);
    TRY(args_done(&a, "argmax"));
    size_t g[2] = {(size_t)be->tune.norm_wg, (size_t)op->n_tokens}, l[2] = {(size_t)be->tune.norm_wg, 1};
    return launch(be, k, DUET_OP_ARGMAX, 2, g, l);
}

duet_status duet__ocl_enqueue(ocl_backend *be, const duet_op *op) {
    switch (op->kind) {
    case DUET_OP_EMBED:
        return op_embed(be, op);
    case DUET_OP_RMSNORM:
        return op_rmsnorm(be, op);
    case DUET_OP_MATMUL:
        return op_matmul(be, op);
    case DUET_OP_ROPE_KV:
        return op_rope_kv(be, op);
    case DUET_OP_ATTENTION:
        return op_attention(be, op);
    case DUET_OP_SWIGLU:
        return op_swiglu(be, op);
    case DUET_OP_ADD:
        return op_binary(be, op, "add", op->add.a, op->add.b, op->add.out, op->add.dim);
    case DUET_OP_GATHER_ROWS:
        return op_gather(be, op);
    case DUET_OP_ARGMAX:
        return op_argmax(be, op);
    case DUET_OP_COUNT:
        break;
    }
    return duet__error(DUET_INVALID_ARGUMENT, "opencl: unknown op kind %d", (int)op->kind);
}
