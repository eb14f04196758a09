/* ocl_backend.c — the OpenCL backend's interface: devices, instances (one
 * context and one in-order queue each), buffers, op validation, steps and
 * profiling.
 *
 * A step enqueues its ops as they are recorded (no host round-trip inside
 * it); submit flushes the queue, wait finishes it. Every view is checked
 * against its buffer's size and its element's alignment before anything is
 * enqueued: a bad op returns DUET_INVALID_ARGUMENT and never reaches the
 * device. Index data (tokens, positions, sequence slots, rows) lives on the
 * device, so the kernels guard those themselves (core also validates them
 * before a step). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend_checks.h"
#include "ocl_internal.h"

/* ---- devices --------------------------------------------------------------------- */

static bool ocl_available(char *why, size_t why_size) {
    const ocl_device *list;
    int n;
    return duet__ocl_devices(&list, &n, why, why_size);
}

static int ocl_device_count(void) {
    const ocl_device *list;
    int n;
    duet__ocl_devices(&list, &n, NULL, 0);
    return n;
}

static duet_status ocl_device_get(int index, const ocl_device **out) {
    const ocl_device *list;
    int n;
    char why[256] = "";
    if (!duet__ocl_devices(&list, &n, why, sizeof why))
        return duet__error(DUET_NO_DEVICE, "opencl: unavailable (%s)", why);
    if (index < 0 || index >= n)
        return duet__error(DUET_NO_DEVICE, "opencl: no device %d (it has %d)", index, n);
    *out = &list[index];
    return DUET_OK;
}

static duet_status ocl_device_info(int index, duet_device_info *out) {
    const ocl_device *d;
    duet_status st = ocl_device_get(index, &d);
    if (st == DUET_OK) *out = d->info;
    return st;
}

/* ---- profiling ------------------------------------------------------------------- */

static const char *const ocl_prof_names[OCL_PROF_KINDS] = {
    [DUET_OP_EMBED] = "embed",
    [DUET_OP_RMSNORM] = "rmsnorm",
    [DUET_OP_MATMUL] = "matmul",
    [DUET_OP_ROPE_KV] = "rope_kv",
    [DUET_OP_ATTENTION] = "attention",
    [DUET_OP_SWIGLU] = "swiglu",
    [DUET_OP_ADD] = "add",
    [DUET_OP_GATHER_ROWS] = "gather_rows",
    [DUET_OP_ARGMAX] = "argmax",
    [OCL_PROF_CLBLAST] = "matmul (clblast)",
};

cl_event *duet__ocl_event_slot(ocl_backend *be, int kind) {
    if (!be->profile) return NULL;
    if (be->n_events == be->cap_events) {
        int cap = be->cap_events ? 2 * be->cap_events : 256;
        cl_event *ev = realloc(be->events, (size_t)cap * sizeof *ev);
        if (ev) be->events = ev;
        int *kinds = realloc(be->event_kinds, (size_t)cap * sizeof *kinds);
        if (kinds) be->event_kinds = kinds;
        if (!ev || !kinds) return NULL; /* profiling is best effort */
        be->cap_events = cap;
    }
    be->event_kinds[be->n_events] = kind;
    be->events[be->n_events] = NULL;
    return &be->events[be->n_events++];
}

void duet__ocl_event_drop(ocl_backend *be) {
    if (be->profile && be->n_events > 0) be->n_events--;
}

/* Adds the finished events' device time to the per-kind totals. */
static void collect_events(ocl_backend *be) {
    for (int i = 0; i < be->n_events; i++) {
        cl_event e = be->events[i];
        if (!e) continue;
        cl_ulong t0 = 0, t1 = 0;
        if (clGetEventProfilingInfo(e, CL_PROFILING_COMMAND_START, sizeof t0, &t0, NULL) == CL_SUCCESS &&
            clGetEventProfilingInfo(e, CL_PROFILING_COMMAND_END, sizeof t1, &t1, NULL) == CL_SUCCESS &&
            t1 >= t0) {
            be->prof_ms[be->event_kinds[i]] += (double)(t1 - t0) * 1e-6;
            be->prof_count[be->event_kinds[i]]++;
        }
        clReleaseEvent(e);
    }
    be->n_events = 0;
}

void duet__ocl_profile(const ocl_backend *be, double *ms, long *count) {
    for (int k = 0; k < OCL_PROF_KINDS; k++) {
        ms[k] = be->prof_ms[k];
        count[k] = be->prof_count[k];
    }
}

static void print_profile(const ocl_backend *be) {
    double total = 0;
    for (int k = 0; k < OCL_PROF_KINDS; k++)
        total += be->prof_ms[k];
    fprintf(stderr, "opencl profile (%s): device time per op kind\n", be->dev->info.name);
    fprintf(stderr, "  %-18s %8s %12s %10s %7s\n", "op", "count", "total ms", "avg us", "share");
    for (int k = 0; k < OCL_PROF_KINDS; k++) {
        if (!be->prof_count[k]) continue;
        fprintf(stderr, "  %-18s %8ld %12.3f %10.1f %6.1f%%\n", ocl_prof_names[k], be->prof_count[k],
                be->prof_ms[k], 1e3 * be->prof_ms[k] / (double)be->prof_count[k],
                total > 0 ? 100 * be->prof_ms[k] / total : 0.0);
    }
}

/* ---- instance ----------------------------------------------------------------------- */

static void ocl_close(duet_backend *base) {
    ocl_backend *be = (ocl_backend *)base;
    if (!be) return;
    if (be->queue) {
        clFinish(be->queue);
        collect_events(be);
        if (be->profile) print_profile(be);
    }
    duet__ocl_programs_free(be);
    if (be->scratch) clReleaseMemObject(be->scratch);
    if (be->att_part) clReleaseMemObject(be->att_part);
    if (be->att_rows) clReleaseMemObject(be->att_rows);
    if (be->q8_rows) clReleaseMemObject(be->q8_rows);
    if (be->queue) clReleaseCommandQueue(be->queue);
    if (be->ctx) clReleaseContext(be->ctx);
    free(be->events);
    free(be->event_kinds);
    free(be);
}

static duet_status ocl_open(int index, const duet_backend_params *params, duet_backend **out) {
    *out = NULL;
    const ocl_device *dev;
    duet_status st = ocl_device_get(index, &dev);
    if (st != DUET_OK) return st;
    ocl_backend *be = calloc(1, sizeof *be);
    if (!be) return duet__error(DUET_OUT_OF_MEMORY, "opencl: backend");
    be->base.iface = &duet_opencl_backend_iface;
    be->base.device_index = index;
    be->base.info = dev->info;
    be->dev = dev;
    if ((st = duet__ocl_tuning_for(dev, &be->tune)) != DUET_OK) goto fail;
    /* $DUET_OPENCL_FEATURES overrides what the device reports ("none", or
     * a list of fp16, fp64, subgroups): to work around a driver whose
     * extension is broken, and for tests of the fallback below. */
    bool fp16 = dev->fp16, fp64 = dev->fp64, sg = dev->subgroups;
    const char *feat = getenv("DUET_OPENCL_FEATURES");
    if (feat && *feat) {
        fp16 = strstr(feat, "fp16") != NULL;
        fp64 = strstr(feat, "fp64") != NULL;
        sg = strstr(feat, "subgroups") != NULL;
    }
    /* CPU runtimes convert scalar halves in library code: kernels then
     * convert fp16 scales with integer ops (SOFT_HALF, kernels/common.cl). */
    snprintf(be->dev_options, sizeof be->dev_options, "%s%s%s%s", fp16 ? "-DHAVE_FP16=1 " : "",
             fp64 ? "-DHAVE_FP64=1 " : "", sg ? "-DHAVE_SUBGROUPS=1 " : "",
             dev->info.type == DUET_DEVICE_CPU ? "-DSOFT_HALF=1" : "");
    /* The q8 x q8 dot product: the extension's packed words where the
     * device has them, its char4 form where only that is reported, the
     * portable code otherwise or when the tuning says dot=0. */
    if (be->tune.dot == 0)
        be->int_dot = 0;
    else if (be->tune.dot == 2)
        be->int_dot = 1; /* emulated built-ins (tests) */
    else
        be->int_dot = dev->int_dot ? (dev->int_dot_packed ? 1 : 2) : 0;
    const char *prof = getenv("DUET_PROFILE");
    be->profile = prof && strcmp(prof, "0") != 0 && *prof;

    cl_int err;
    cl_context_properties props[] = {CL_CONTEXT_PLATFORM, (cl_context_properties)dev->platform, 0};
    be->ctx = clCreateContext(props, 1, &dev->id, NULL, NULL, &err);
    if (!be->ctx) {
        st = duet__ocl_fail(err, "clCreateContext", __FILE__, __LINE__);
        goto fail;
    }
    be->queue = clCreateCommandQueue(be->ctx, dev->id, be->profile ? CL_QUEUE_PROFILING_ENABLE : 0, &err);
    if (!be->queue) {
        st = duet__ocl_fail(err, "clCreateCommandQueue", __FILE__, __LINE__);
        goto fail;
    }
    *out = &be->base;
    return DUET_OK;
fail:
    ocl_close(&be->base);
    return st;
}

/* ---- internal buffers ------------------------------------------------------------------ */

duet_status duet__ocl_scratch(ocl_backend *be, cl_mem *mem, size_t *cur, size_t size, const char *what) {
    if (*cur >= size) return DUET_OK;
    if (size > be->dev->max_alloc)
        return duet__error(DUET_OUT_OF_MEMORY,
                           "opencl: %s needs %zu bytes, over %s's largest allocation (%llu)", what, size,
                           be->dev->info.name, (unsigned long long)be->dev->max_alloc);
    /* The new buffer comes first and the old one is released after it:
     * enqueued work may still use the old one (the runtime keeps it alive
     * until that work is done), so both count towards the high-water
     * mark. (Releasing first would also let a simulator hand the same
     * addresses out again while kernels still hold the old object as an
     * argument; Oclgrind then loses track of what is initialised.) */
    cl_int err;
    cl_mem fresh = clCreateBuffer(be->ctx, CL_MEM_READ_WRITE, size, NULL, &err);
    if (!fresh) {
        char expr[96];
        snprintf(expr, sizeof expr, "clCreateBuffer(%s, %zu bytes)", what, size);
        return duet__ocl_fail(err, expr, __FILE__, __LINE__);
    }
    be->scratch_live += size;
    if (be->scratch_live > be->scratch_peak) be->scratch_peak = be->scratch_live;
    if (*mem) clReleaseMemObject(*mem);
    be->scratch_live -= *cur;
    *mem = fresh;
    *cur = size;
    return DUET_OK;
}

static size_t ocl_scratch_bytes(duet_backend *base) {
    return ((ocl_backend *)base)->scratch_peak;
}

/* ---- buffers ------------------------------------------------------------------------- */

static duet_status ocl_buffer_alloc(duet_backend *base, size_t size, duet_buffer **out) {
    ocl_backend *be = (ocl_backend *)base;
    *out = NULL;
    if (size > be->dev->max_alloc)
        return duet__error(DUET_OUT_OF_MEMORY,
                           "opencl: a buffer of %zu bytes exceeds %s's largest allocation (%llu)", size,
                           be->dev->info.name, (unsigned long long)be->dev->max_alloc);
    duet_buffer *b = malloc(sizeof *b);
    if (!b) return duet__error(DUET_OUT_OF_MEMORY, "opencl: buffer handle");
    cl_int err;
    b->mem = clCreateBuffer(be->ctx, CL_MEM_READ_WRITE, size, NULL, &err);
    if (!b->mem) {
        free(b);
        return duet__ocl_fail(err, "clCreateBuffer", __FILE__, __LINE__);
    }
    b->size = size;
    *out = b;
    return DUET_OK;
}

static void ocl_buffer_free(duet_backend *be, duet_buffer *buf) {
    if (!buf) return;
    clReleaseMemObject(buf->mem);
    free(buf);
}

static duet_status check_range(const char *what, duet_buffer *buf, size_t offset, size_t size) {
    if (offset > buf->size || size > buf->size - offset)
        return duet__error(DUET_INVALID_ARGUMENT,
                           "opencl %s: %zu bytes at offset %zu run past a %zu-byte buffer", what, size,
                           offset, buf->size);
    return DUET_OK;
}

/* Blocking: the caller may reuse `src` at once, and in-order execution puts
 * the write after the ops already enqueued. */
static duet_status ocl_upload(duet_backend *base, duet_buffer *buf, size_t offset, const void *src,
                              size_t size) {
    ocl_backend *be = (ocl_backend *)base;
    duet_status st = check_range("upload", buf, offset, size);
    if (st != DUET_OK || size == 0) return st;
    CL_TRY(clEnqueueWriteBuffer(be->queue, buf->mem, CL_TRUE, offset, size, src, 0, NULL, NULL));
    return DUET_OK;
}

static duet_status ocl_download(duet_backend *base, duet_buffer *buf, size_t offset, void *dst, size_t size) {
    ocl_backend *be = (ocl_backend *)base;
    duet_status st = check_range("download", buf, offset, size);
    if (st != DUET_OK || size == 0) return st;
    CL_TRY(clEnqueueReadBuffer(be->queue, buf->mem, CL_TRUE, offset, size, dst, 0, NULL, NULL));
    return DUET_OK;
}

/* ---- steps ----------------------------------------------------------------------------- */

static duet_status ocl_begin(duet_backend *base) {
    ocl_backend *be = (ocl_backend *)base;
    if (be->in_step) return duet__error(DUET_INVALID_ARGUMENT, "opencl: begin while a step is open");
    be->in_step = true;
    return DUET_OK;
}

static duet_status ocl_submit(duet_backend *base) {
    ocl_backend *be = (ocl_backend *)base;
    if (!be->in_step) return duet__error(DUET_INVALID_ARGUMENT, "opencl: submit without begin");
    be->in_step = false;
    CL_TRY(clFlush(be->queue));
    return DUET_OK;
}

static duet_status ocl_wait(duet_backend *base) {
    ocl_backend *be = (ocl_backend *)base;
    cl_int err = clFinish(be->queue);
    /* OpenCL has no device-lost code. clFinish allocates nothing, so these
     * mean the queued work itself failed on the device (NVIDIA reports a
     * kernel fault or an Xid this way, AMD a GPU reset) and the context
     * does not recover. */
    if (err == CL_OUT_OF_RESOURCES || err == CL_DEVICE_NOT_AVAILABLE)
        return duet__error(DUET_DEVICE_LOST,
                           "opencl: clFinish failed: %s (%d) on %s: the device lost the step",
                           duet__ocl_error_name(err), (int)err, be->dev->info.name);
    if (err != CL_SUCCESS) return duet__ocl_fail(err, "clFinish", __FILE__, __LINE__);
    collect_events(be);
    return DUET_OK;
}

/* ---- op validation ----------------------------------------------------------------------- */

static const char *const ocl_op_names[DUET_OP_COUNT] = {
    [DUET_OP_EMBED] = "embed",     [DUET_OP_RMSNORM] = "rmsnorm",         [DUET_OP_MATMUL] = "matmul",
    [DUET_OP_ROPE_KV] = "rope_kv", [DUET_OP_ATTENTION] = "attention",     [DUET_OP_SWIGLU] = "swiglu",
    [DUET_OP_ADD] = "add",         [DUET_OP_GATHER_ROWS] = "gather_rows", [DUET_OP_ARGMAX] = "argmax",
};

/* A view that must hold `bytes` bytes at an offset aligned for its element. */
static duet_status view_check(const char *op, const char *name, duet_view v, uint64_t bytes, size_t align) {
    if (!v.buf) return duet__error(DUET_INVALID_ARGUMENT, "%s: %s has no buffer", op, name);
    if (v.offset % align)
        return duet__error(DUET_INVALID_ARGUMENT, "%s: %s offset %zu is not a multiple of %zu", op, name,
                           v.offset, align);
    if (v.offset > v.buf->size || bytes > (uint64_t)(v.buf->size - v.offset))
        return duet__error(DUET_INVALID_ARGUMENT,
                           "%s: %s needs %llu bytes at offset %zu but its buffer holds %zu", op, name,
                           (unsigned long long)bytes, v.offset, v.buf->size);
    return DUET_OK;
}

static uint64_t view_avail(duet_view v) {
    return v.buf && v.offset <= v.buf->size ? v.buf->size - v.offset : 0;
}

static bool views_overlap(duet_view a, uint64_t an, duet_view b, uint64_t bn) {
    return a.buf && a.buf == b.buf && a.offset < b.offset + bn && b.offset < a.offset + an;
}

/* Elementwise ops may write in place (out == input) but not over a shifted
 * copy of an input. */
static duet_status check_inplace(const char *op, const char *name, duet_view in, duet_view out,
                                 uint64_t bytes) {
    if (views_overlap(in, bytes, out, bytes) && in.offset != out.offset)
        return duet__error(DUET_INVALID_ARGUMENT, "%s: out partly overlaps %s", op, name);
    return DUET_OK;
}

static size_t weight_align(duet_dtype t) {
    return t == DUET_DTYPE_F32 ? 4 : 2;
}

/* Kernels index elements with 32-bit ints. */
#define OCL_MAX_DIM (1 << 30)

/* Bytes of n_tokens rows of width/32 q8_0 blocks. */
static uint64_t q8_bytes(uint64_t nt, int width) {
    return mul3(nt, (uint64_t)(width / DUET_QK8_0), sizeof(duet_block_q8_0));
}

/* The paged KV views (the registry checked the geometry's signs and the
 * dtype): pools of n_blocks x block_size rows, the table of n_seqs x
 * max_blocks i32, none overlapping another. */
static duet_status kv_check(const char *op, const duet_kv_pages *kv, int kv_width) {
    /* Kernels split positions with mul24: block counts stay under 2^23. */
    REQUIRE(kv->block_size < (1 << 23) && kv->n_blocks < OCL_MAX_DIM && kv->max_blocks < (1 << 23) &&
                kv->n_seqs < OCL_MAX_DIM &&
                mul2((uint64_t)kv->n_blocks, (uint64_t)kv->block_size) < OCL_MAX_DIM &&
                mul2((uint64_t)kv->max_blocks, (uint64_t)kv->block_size) < OCL_MAX_DIM,
            "%s: kv pages of %d blocks x %d tokens, table %d x %d", op, kv->n_blocks, kv->block_size,
            kv->n_seqs, kv->max_blocks);
    const uint64_t pool = duet_kv_pool_bytes(kv, kv_width);
    const uint64_t table = mul3((uint64_t)kv->n_seqs, (uint64_t)kv->max_blocks, 4);
    const size_t align = kv->dtype == DUET_DTYPE_F32 ? 4 : 2;
    CHECK(view_check(op, "k_pool", kv->k_pool, pool, align));
    CHECK(view_check(op, "v_pool", kv->v_pool, pool, align));
    CHECK(view_check(op, "block_table", kv->block_table, table, 4));
    REQUIRE(!views_overlap(kv->k_pool, pool, kv->v_pool, pool), "%s: k_pool overlaps v_pool", op);
    REQUIRE(!views_overlap(kv->k_pool, pool, kv->block_table, table) &&
                !views_overlap(kv->v_pool, pool, kv->block_table, table),
            "%s: the block table overlaps a pool", op);
    return DUET_OK;
}

static duet_status validate(const duet_op *op) {
    const char *name = ocl_op_names[op->kind];
    const uint64_t nt = (uint64_t)op->n_tokens;
    switch (op->kind) {
    case DUET_OP_EMBED: {
        const duet_dtype dt = op->embed.dtype;
        const int dim = op->embed.dim;
        REQUIRE(dim > 0 && dim < OCL_MAX_DIM && dim % duet_dtype_block(dt) == 0,
                "embed: dim %d is not a positive multiple of %s's block", dim, duet_dtype_name(dt));
        CHECK(view_check(name, "tokens", op->embed.tokens, nt * 4, 4));
        CHECK(view_check(name, "table", op->embed.table, duet_dtype_row_bytes(dt, dim), weight_align(dt)));
        CHECK(view_check(name, "out", op->embed.out, mul3(nt, (uint64_t)dim, 4), 4));
        return DUET_OK;
    }
    case DUET_OP_RMSNORM: {
        const int dim = op->rmsnorm.dim;
        REQUIRE(dim > 0 && dim < OCL_MAX_DIM, "rmsnorm: dim %d", dim);
        uint64_t bytes = mul3(nt, (uint64_t)dim, 4), qbytes = q8_bytes(nt, dim);
        CHECK(view_check(name, "x", op->rmsnorm.x, bytes, 4));
        CHECK(view_check(name, "w", op->rmsnorm.w, (uint64_t)dim * 4, 4));
        if (op->rmsnorm.out.buf) {
            CHECK(view_check(name, "out", op->rmsnorm.out, bytes, 4));
            CHECK(check_inplace(name, "x", op->rmsnorm.x, op->rmsnorm.out, bytes));
            REQUIRE(!views_overlap(op->rmsnorm.w, (uint64_t)dim * 4, op->rmsnorm.out, bytes),
                    "rmsnorm: out overlaps w");
        }
        if (op->rmsnorm.out_q8.buf) {
            CHECK(view_check(name, "out_q8", op->rmsnorm.out_q8, qbytes, 2));
            REQUIRE(!views_overlap(op->rmsnorm.out_q8, qbytes, op->rmsnorm.x, bytes) &&
                        !views_overlap(op->rmsnorm.out_q8, qbytes, op->rmsnorm.w, (uint64_t)dim * 4) &&
                        !views_overlap(op->rmsnorm.out_q8, qbytes, op->rmsnorm.out, bytes),
                    "rmsnorm: out_q8 overlaps x, w or out");
        }
        return DUET_OK;
    }
    case DUET_OP_MATMUL: {
        const duet_dtype dt = op->matmul.dtype;
        const int n_in = op->matmul.n_in, n_out = op->matmul.n_out;
        REQUIRE(n_in > 0 && n_out > 0 && n_in < OCL_MAX_DIM && n_out < OCL_MAX_DIM,
                "matmul: n_in %d, n_out %d", n_in, n_out);
        REQUIRE(n_in % duet_dtype_block(dt) == 0, "matmul: n_in %d is not a multiple of %s's block of %d",
                n_in, duet_dtype_name(dt), duet_dtype_block(dt));
        uint64_t wbytes = mul2((uint64_t)n_out, duet_dtype_row_bytes(dt, n_in));
        uint64_t obytes = mul3(nt, (uint64_t)n_out, 4);
        const bool q8x = op->matmul.x_q8.buf != NULL;
        duet_view xv = q8x ? op->matmul.x_q8 : op->matmul.x;
        uint64_t xbytes = q8x ? q8_bytes(nt, n_in) : mul3(nt, (uint64_t)n_in, 4);
        CHECK(view_check(name, "w", op->matmul.w, wbytes, weight_align(dt)));
        CHECK(view_check(name, q8x ? "x_q8" : "x", xv, xbytes, q8x ? 2 : 4));
        if (op->matmul.bias.buf) CHECK(view_check(name, "bias", op->matmul.bias, (uint64_t)n_out * 4, 4));
        CHECK(view_check(name, "out", op->matmul.out, obytes, 4));
        /* Work-items write out while others still read x and W. */
        REQUIRE(!views_overlap(op->matmul.out, obytes, xv, xbytes), "matmul: out overlaps x");
        REQUIRE(!views_overlap(op->matmul.out, obytes, op->matmul.w, wbytes), "matmul: out overlaps w");
        REQUIRE(!views_overlap(op->matmul.out, obytes, op->matmul.bias, (uint64_t)n_out * 4),
                "matmul: out overlaps bias");
        return DUET_OK;
    }
    case DUET_OP_ROPE_KV: {
        const int nh = op->rope_kv.n_head, nkv = op->rope_kv.n_head_kv, hd = op->rope_kv.head_dim;
        const int n_rot = op->rope_kv.n_rot;
        REQUIRE(nh > 0 && nkv > 0 && hd > 0 && (uint64_t)(nh + nkv) * hd < OCL_MAX_DIM,
                "rope_kv: n_head %d, n_head_kv %d, head_dim %d", nh, nkv, hd);
        REQUIRE(n_rot >= 0 && n_rot <= hd && n_rot % 2 == 0,
                "rope_kv: n_rot %d must be even and at most head_dim %d", n_rot, hd);
        REQUIRE(n_rot == 0 || op->rope_kv.freq_base > 0.0f, "rope_kv: freq_base %g",
                (double)op->rope_kv.freq_base);
        uint64_t qbytes = mul2(mul3(nt, (uint64_t)nh, (uint64_t)hd), 4);
        uint64_t kbytes = mul2(mul3(nt, (uint64_t)nkv, (uint64_t)hd), 4);
        CHECK(view_check(name, "q", op->rope_kv.q, qbytes, 4));
        CHECK(view_check(name, "k", op->rope_kv.k, kbytes, 4));
        CHECK(view_check(name, "v", op->rope_kv.v, kbytes, 4));
        CHECK(view_check(name, "pos", op->rope_kv.pos, nt * 4, 4));
        CHECK(view_check(name, "seq", op->rope_kv.seq, nt * 4, 4));
        CHECK(kv_check(name, &op->rope_kv.kv, nkv * hd));
        REQUIRE(!views_overlap(op->rope_kv.q, qbytes, op->rope_kv.k, kbytes), "rope_kv: q overlaps k");
        const uint64_t pool = duet_kv_pool_bytes(&op->rope_kv.kv, nkv * hd);
        const duet_view pools[2] = {op->rope_kv.kv.k_pool, op->rope_kv.kv.v_pool};
        for (int i = 0; i < 2; i++)
            REQUIRE(!views_overlap(pools[i], pool, op->rope_kv.q, qbytes) &&
                        !views_overlap(pools[i], pool, op->rope_kv.k, kbytes) &&
                        !views_overlap(pools[i], pool, op->rope_kv.v, kbytes) &&
                        !views_overlap(pools[i], pool, op->rope_kv.pos, nt * 4) &&
                        !views_overlap(pools[i], pool, op->rope_kv.seq, nt * 4),
                    "rope_kv: a KV pool overlaps q, k, v, pos or seq");
        return DUET_OK;
    }
    case DUET_OP_ATTENTION: {
        const int nh = op->attention.n_head, nkv = op->attention.n_head_kv, hd = op->attention.head_dim;
        REQUIRE(nh > 0 && nkv > 0 && hd > 0 && nh % nkv == 0 && (uint64_t)nh * hd < OCL_MAX_DIM &&
                    nt < (1 << 23),
                "attention: n_head %d, n_head_kv %d, head_dim %d, %llu tokens", nh, nkv, hd,
                (unsigned long long)nt);
        uint64_t qbytes = mul2(mul3(nt, (uint64_t)nh, (uint64_t)hd), 4), q8b = q8_bytes(nt, nh * hd);
        CHECK(view_check(name, "q", op->attention.q, qbytes, 4));
        CHECK(view_check(name, "pos", op->attention.pos, nt * 4, 4));
        CHECK(view_check(name, "seq", op->attention.seq, nt * 4, 4));
        CHECK(kv_check(name, &op->attention.kv, nkv * hd));
        const uint64_t pool = duet_kv_pool_bytes(&op->attention.kv, nkv * hd);
        const duet_view kp = op->attention.kv.k_pool, vp = op->attention.kv.v_pool;
        if (op->attention.out.buf) {
            CHECK(view_check(name, "out", op->attention.out, qbytes, 4));
            CHECK(check_inplace(name, "q", op->attention.q, op->attention.out, qbytes));
            REQUIRE(!views_overlap(op->attention.out, qbytes, kp, pool) &&
                        !views_overlap(op->attention.out, qbytes, vp, pool),
                    "attention: out overlaps the KV pools");
        }
        if (op->attention.out_q8.buf) {
            CHECK(view_check(name, "out_q8", op->attention.out_q8, q8b, 2));
            REQUIRE(!views_overlap(op->attention.out_q8, q8b, op->attention.q, qbytes) &&
                        !views_overlap(op->attention.out_q8, q8b, op->attention.out, qbytes) &&
                        !views_overlap(op->attention.out_q8, q8b, kp, pool) &&
                        !views_overlap(op->attention.out_q8, q8b, vp, pool),
                    "attention: out_q8 overlaps q, out or the KV pools");
        }
        return DUET_OK;
    }
    case DUET_OP_SWIGLU: {
        const int dim = op->swiglu.dim;
        REQUIRE(dim > 0, "swiglu: dim %d", dim);
        uint64_t bytes = mul3(nt, (uint64_t)dim, 4), qbytes = q8_bytes(nt, dim);
        CHECK(view_check(name, "gate", op->swiglu.gate, bytes, 4));
        CHECK(view_check(name, "up", op->swiglu.up, bytes, 4));
        if (op->swiglu.out.buf) {
            CHECK(view_check(name, "out", op->swiglu.out, bytes, 4));
            CHECK(check_inplace(name, "gate", op->swiglu.gate, op->swiglu.out, bytes));
            CHECK(check_inplace(name, "up", op->swiglu.up, op->swiglu.out, bytes));
        }
        if (op->swiglu.out_q8.buf) {
            CHECK(view_check(name, "out_q8", op->swiglu.out_q8, qbytes, 2));
            REQUIRE(!views_overlap(op->swiglu.out_q8, qbytes, op->swiglu.gate, bytes) &&
                        !views_overlap(op->swiglu.out_q8, qbytes, op->swiglu.up, bytes) &&
                        !views_overlap(op->swiglu.out_q8, qbytes, op->swiglu.out, bytes),
                    "swiglu: out_q8 overlaps gate, up or out");
        }
        return DUET_OK;
    }
    case DUET_OP_ADD: {
        REQUIRE(op->add.dim > 0, "add: dim %d", op->add.dim);
        uint64_t bytes = mul3(nt, (uint64_t)op->add.dim, 4);
        CHECK(view_check(name, "a", op->add.a, bytes, 4));
        CHECK(view_check(name, "b", op->add.b, bytes, 4));
        CHECK(view_check(name, "out", op->add.out, bytes, 4));
        CHECK(check_inplace(name, "a", op->add.a, op->add.out, bytes));
        CHECK(check_inplace(name, "b", op->add.b, op->add.out, bytes));
        return DUET_OK;
    }
    case DUET_OP_GATHER_ROWS: {
        const int dim = op->gather.dim;
        REQUIRE(dim > 0 && dim < OCL_MAX_DIM, "gather_rows: dim %d", dim);
        uint64_t row = (uint64_t)dim * 4, obytes = mul2(nt, row);
        CHECK(view_check(name, "x", op->gather.x, row, 4));
        CHECK(view_check(name, "rows", op->gather.rows, nt * 4, 4));
        CHECK(view_check(name, "out", op->gather.out, obytes, 4));
        REQUIRE(!views_overlap(op->gather.out, obytes, op->gather.x, view_avail(op->gather.x) / row * row),
                "gather_rows: out overlaps x");
        return DUET_OK;
    }
    case DUET_OP_ARGMAX: {
        REQUIRE(op->argmax.dim > 0 && op->argmax.dim < OCL_MAX_DIM, "argmax: dim %d", op->argmax.dim);
        CHECK(view_check(name, "x", op->argmax.x, mul3(nt, (uint64_t)op->argmax.dim, 4), 4));
        CHECK(view_check(name, "out", op->argmax.out, nt * 4, 4));
        return DUET_OK;
    }
    case DUET_OP_COUNT:
        break;
    }
    return duet__error(DUET_INVALID_ARGUMENT, "opencl: unknown op kind %d", (int)op->kind);
}

static bool kv_dtype_ok(duet_dtype t) {
    return t == DUET_DTYPE_F32 || t == DUET_DTYPE_F16 || t == DUET_DTYPE_Q8_0;
}

static bool ocl_supports_op(duet_backend *be, const duet_op *op) {
    switch (op->kind) {
    case DUET_OP_EMBED:
        return duet_dtype_is_weight(op->embed.dtype);
    case DUET_OP_MATMUL:
        return duet_dtype_is_weight(op->matmul.dtype);
    case DUET_OP_ROPE_KV:
        return kv_dtype_ok(op->rope_kv.kv.dtype) && op->rope_kv.n_rot <= 2 * OCL_ROPE_HALF_MAX;
    case DUET_OP_ATTENTION:
        /* Kernels are built for the exact head_dim. Whether a plan fits the
         * device's local memory is found once, when the op is recorded
         * (an UNSUPPORTED error then); this check runs twice per op. */
        return kv_dtype_ok(op->attention.kv.dtype) && op->attention.head_dim <= OCL_ATT_DMAX;
    case DUET_OP_RMSNORM:
    case DUET_OP_SWIGLU:
    case DUET_OP_ADD:
    case DUET_OP_GATHER_ROWS:
    case DUET_OP_ARGMAX:
        return true;
    case DUET_OP_COUNT:
        break;
    }
    return false;
}

static duet_status ocl_op(duet_backend *base, const duet_op *op) {
    ocl_backend *be = (ocl_backend *)base;
    if (!be->in_step)
        return duet__error(DUET_INVALID_ARGUMENT, "opencl: op outside a step (call begin first)");
    if ((unsigned)op->kind >= DUET_OP_COUNT)
        return duet__error(DUET_INVALID_ARGUMENT, "opencl: unknown op kind %d", (int)op->kind);
    if (op->n_tokens <= 0)
        return duet__error(DUET_INVALID_ARGUMENT, "%s: n_tokens %d", ocl_op_names[op->kind], op->n_tokens);
    if (!ocl_supports_op(base, op))
        return duet__error(DUET_UNSUPPORTED, "%s: unsupported dtype or shape on opencl",
                           ocl_op_names[op->kind]);
    CHECK(validate(op));
    return duet__ocl_enqueue(be, op);
}

const duet_backend_iface duet_opencl_backend_iface = {
    .name = "opencl",
    .available = ocl_available,
    .device_count = ocl_device_count,
    .device_info = ocl_device_info,
    .open = ocl_open,
    .close = ocl_close,
    .supports_op = ocl_supports_op,
    .buffer_alloc = ocl_buffer_alloc,
    .buffer_free = ocl_buffer_free,
    .upload = ocl_upload,
    .download = ocl_download,
    .begin = ocl_begin,
    .op = ocl_op,
    .submit = ocl_submit,
    .wait = ocl_wait,
    .buffer_host_ptr = NULL,
    .scratch_bytes = ocl_scratch_bytes,
};
