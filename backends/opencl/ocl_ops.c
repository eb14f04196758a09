/* ocl_ops.c — one enqueue function per op: the kernel variant (-D options
 * from the op's types and the device's tuning), its arguments and its
 * NDRange; and CLBlast for F32/F16 matmuls with many tokens.
 *
 * Ops arrive validated (ocl_backend.c). Views reach kernels as a cl_mem and
 * a byte offset. */
#include <clblast_c.h>
#include <stdio.h>
#include <string.h>

#include "ocl_internal.h"

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
    for (cl_uint d = 0; d < dims; d++) g[d] = local ? (global[d] + local[d] - 1) / local[d] * local[d] : global[d];
    cl_event *ev = duet__ocl_event_slot(be, kind);
    cl_int err = clEnqueueNDRangeKernel(be->queue, k, dims, NULL, g, local, 0, NULL, ev);
    if (err != CL_SUCCESS) {
        if (ev) duet__ocl_event_drop(be);
        if (err == CL_INVALID_WORK_GROUP_SIZE && local) {
            /* A kernel may allow fewer work-items than the device (registers). */
            size_t allowed = 0;
            clGetKernelWorkGroupInfo(k, be->dev->id, CL_KERNEL_WORK_GROUP_SIZE, sizeof allowed, &allowed, NULL);
            return duet__error(DUET_DEVICE,
                               "opencl: tuning '%s' asks for work-groups of %zu but this kernel allows %zu on %s; "
                               "lower it with DUET_OPENCL_TUNE",
                               be->tune.entry, local[0] * (dims > 1 ? local[1] : 1), allowed, be->dev->info.name);
        }
        return duet__ocl_fail(err, "clEnqueueNDRangeKernel", __FILE__, __LINE__);
    }
    return DUET_OK;
}

#define TRY(expr)                       \
    do {                                \
        duet_status st_ = (expr);       \
        if (st_ != DUET_OK) return st_; \
    } while (0)

static uint64_t view_avail(duet_view v) { return v.buf && v.offset <= v.buf->size ? v.buf->size - v.offset : 0; }

/* Elementwise work-group: the tuned size, or the driver's choice (NULL). */
static const size_t *ew_local(const ocl_backend *be, size_t *l2) {
    if (be->tune.ew_wg <= 0) return NULL;
    l2[0] = (size_t)be->tune.ew_wg;
    l2[1] = 1;
    return l2;
}

/* ---- ops ---------------------------------------------------------------------------- */

static duet_status op_embed(ocl_backend *be, const duet_op *op) {
    char opts[64];
    snprintf(opts, sizeof opts, "-DWTYPE=%d", (int)op->embed.dtype);
    cl_kernel k;
    TRY(duet__ocl_kernel(be, "embed", opts, "embed", &k));
    const int dim = op->embed.dim;
    argset a = {k, 0, CL_SUCCESS};
    arg_view(&a, op->embed.tokens);
    arg_view(&a, op->embed.table);
    arg_ulong(&a, view_avail(op->embed.table) / duet_dtype_row_bytes(op->embed.dtype, dim));
    arg_view(&a, op->embed.out);
    arg_int(&a, dim);
    TRY(args_done(&a, "embed"));
    size_t g[2] = {(size_t)dim, (size_t)op->n_tokens}, l[2];
    return launch(be, k, DUET_OP_EMBED, 2, g, ew_local(be, l));
}

static duet_status op_rmsnorm(ocl_backend *be, const duet_op *op) {
    char opts[64];
    snprintf(opts, sizeof opts, "-DNORM_WG=%d", be->tune.norm_wg);
    cl_kernel k;
    TRY(duet__ocl_kernel(be, "rmsnorm", opts, "rmsnorm", &k));
    argset a = {k, 0, CL_SUCCESS};
    arg_view(&a, op->rmsnorm.x);
    arg_view(&a, op->rmsnorm.w);
    arg_view(&a, op->rmsnorm.out);
    arg_int(&a, op->rmsnorm.dim);
    arg_float(&a, op->rmsnorm.eps);
    TRY(args_done(&a, "rmsnorm"));
    size_t g[2] = {(size_t)be->tune.norm_wg, (size_t)op->n_tokens}, l[2] = {(size_t)be->tune.norm_wg, 1};
    return launch(be, k, DUET_OP_RMSNORM, 2, g, l);
}

/* The matmul program for this dtype and token count: single-token ops get
 * MV_MT = 1 (no wasted token lanes), the rest the tuned tile. */
static duet_status matmul_kernel(ocl_backend *be, duet_dtype dt, int mt, const char *name, cl_kernel *k) {
    const ocl_tuning *t = &be->tune;
    char opts[160];
    snprintf(opts, sizeof opts, "-DWTYPE=%d -DMV_R=%d -DMV_NR=%d -DMV_VW=%d -DMV_WG=%d -DMV_MT=%d -DMV_QG=%d", (int)dt,
             t->mv_r, t->mv_nr, t->mv_vw, t->mv_wg, mt, dt == DUET_DTYPE_Q8_0 ? t->mv_qg : 1);
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
        s = CLBlastSgemm(CLBlastLayoutRowMajor, CLBlastTransposeNo, CLBlastTransposeYes, (size_t)T, (size_t)n_out,
                         (size_t)n_in, 1.0f, xm, x_off, (size_t)n_in, op->matmul.w.buf->mem, op->matmul.w.offset / 4,
                         (size_t)n_in, beta, om, o_off, (size_t)n_out, &be->queue,
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
        if (be->scratch_size < rows * row_f32) {
            if (be->scratch) clReleaseMemObject(be->scratch);
            be->scratch = NULL;
            be->scratch_size = 0;
            cl_int err;
            be->scratch = clCreateBuffer(be->ctx, CL_MEM_READ_WRITE, rows * row_f32, NULL, &err);
            if (!be->scratch) return duet__ocl_fail(err, "clCreateBuffer(clblast scratch)", __FILE__, __LINE__);
            be->scratch_size = rows * row_f32;
        }
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
                             (size_t)n_in, 1.0f, xm, x_off, (size_t)n_in, be->scratch, 0, (size_t)n_in, beta, om,
                             o_off + r0, (size_t)n_out, &be->queue, duet__ocl_event_slot(be, OCL_PROF_CLBLAST));
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

const char *duet__ocl_matmul_path(const ocl_backend *be, const duet_op *op) {
    const duet_dtype dt = op->matmul.dtype;
    if ((dt == DUET_DTYPE_F32 || dt == DUET_DTYPE_F16) && be->tune.clblast_min > 0 &&
        op->n_tokens >= be->tune.clblast_min)
        return "clblast";
    return "matvec";
}

static duet_status op_matmul(ocl_backend *be, const duet_op *op) {
    if (strcmp(duet__ocl_matmul_path(be, op), "clblast") == 0) return matmul_clblast(be, op);
    return matmul_ours(be, op);
}

static uint64_t cache_rows(duet_view kc, duet_view vc, duet_dtype kvt, int n_head_kv, int head_dim) {
    uint64_t row = (uint64_t)n_head_kv * (uint64_t)head_dim * duet_dtype_block_bytes(kvt);
    uint64_t a = view_avail(kc), b = view_avail(vc);
    return (a < b ? a : b) / row;
}

static duet_status op_rope_kv(ocl_backend *be, const duet_op *op) {
    char opts[64];
    snprintf(opts, sizeof opts, "-DKV_TYPE=%d", (int)op->rope_kv.kv_dtype);
    cl_kernel k;
    TRY(duet__ocl_kernel(be, "rope_kv", opts, "rope_kv", &k));
    const int nh = op->rope_kv.n_head, nkv = op->rope_kv.n_head_kv, hd = op->rope_kv.head_dim;
    const int n_rot = op->rope_kv.n_rot;
    argset a = {k, 0, CL_SUCCESS};
    arg_view(&a, op->rope_kv.q);
    arg_view(&a, op->rope_kv.k);
    arg_view(&a, op->rope_kv.v);
    arg_view(&a, op->rope_kv.pos);
    arg_view(&a, op->rope_kv.seq);
    arg_view(&a, op->rope_kv.k_cache);
    arg_view(&a, op->rope_kv.v_cache);
    arg_ulong(&a, cache_rows(op->rope_kv.k_cache, op->rope_kv.v_cache, op->rope_kv.kv_dtype, nkv, hd));
    arg_int(&a, nh);
    arg_int(&a, nkv);
    arg_int(&a, hd);
    arg_int(&a, n_rot);
    arg_int(&a, op->rope_kv.n_ctx);
    arg_float(&a, op->rope_kv.freq_base);
    arg_int(&a, op->rope_kv.neox ? 1 : 0);
    TRY(args_done(&a, "rope_kv"));
    size_t g[2] = {(size_t)(n_rot / 2 + hd - n_rot), (size_t)op->n_tokens};
    return launch(be, k, DUET_OP_ROPE_KV, 2, g, NULL);
}

static duet_status op_attention(ocl_backend *be, const duet_op *op) {
    const int hd = op->attention.head_dim;
    /* Private and local arrays are sized at compile time: round head_dim up
     * so a few variants serve every model. */
    const int dmax = hd <= 64 ? 64 : hd <= 128 ? 128 : OCL_ATT_DMAX;
    char opts[96];
    snprintf(opts, sizeof opts, "-DKV_TYPE=%d -DATT_WG=%d -DATT_DMAX=%d", (int)op->attention.kv_dtype,
             be->tune.att_wg, dmax);
    cl_kernel k;
    TRY(duet__ocl_kernel(be, "attention", opts, "attention", &k));
    argset a = {k, 0, CL_SUCCESS};
    arg_view(&a, op->attention.q);
    arg_view(&a, op->attention.pos);
    arg_view(&a, op->attention.seq);
    arg_view(&a, op->attention.k_cache);
    arg_view(&a, op->attention.v_cache);
    arg_ulong(&a, cache_rows(op->attention.k_cache, op->attention.v_cache, op->attention.kv_dtype,
                             op->attention.n_head_kv, hd));
    arg_view(&a, op->attention.out);
    arg_int(&a, op->attention.n_head);
    arg_int(&a, op->attention.n_head_kv);
    arg_int(&a, hd);
    arg_int(&a, op->attention.n_ctx);
    arg_float(&a, op->attention.scale);
    TRY(args_done(&a, "attention"));
    size_t g[3] = {(size_t)be->tune.att_wg, (size_t)op->attention.n_head, (size_t)op->n_tokens};
    size_t l[3] = {(size_t)be->tune.att_wg, 1, 1};
    return launch(be, k, DUET_OP_ATTENTION, 3, g, l);
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
    case DUET_OP_EMBED: return op_embed(be, op);
    case DUET_OP_RMSNORM: return op_rmsnorm(be, op);
    case DUET_OP_MATMUL: return op_matmul(be, op);
    case DUET_OP_ROPE_KV: return op_rope_kv(be, op);
    case DUET_OP_ATTENTION: return op_attention(be, op);
    case DUET_OP_SWIGLU:
        return op_binary(be, op, "swiglu", op->swiglu.gate, op->swiglu.up, op->swiglu.out, op->swiglu.dim);
    case DUET_OP_ADD: return op_binary(be, op, "add", op->add.a, op->add.b, op->add.out, op->add.dim);
    case DUET_OP_GATHER_ROWS: return op_gather(be, op);
    case DUET_OP_ARGMAX: return op_argmax(be, op);
    case DUET_OP_COUNT: break;
    }
    return duet__error(DUET_INVALID_ARGUMENT, "opencl: unknown op kind %d", (int)op->kind);
}
