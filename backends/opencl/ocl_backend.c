/* ocl_backend.c — the OpenCL backend's interface: devices, instances (one
 * context and one in-order queue each) and their streams (another in-order
 * queue on the same context and programs), buffers, op validation, steps
 * and profiling.
 *
 * A step enqueues its ops as they are recorded (no host round-trip inside
 * it); submit flushes the queue, wait finishes it. Every view is checked
 * against its buffer's size and its element's alignment before anything is
 * enqueued: a bad op returns DUET_INVALID_ARGUMENT and never reaches the
 * device. Index data (tokens, positions, sequence slots, rows) lives on the
 * device, so the kernels guard those themselves (core also validates them
 * before a step). */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend_checks.h"
#include "ocl_internal.h"

#include <clblast_c.h> /* after ocl_internal.h: it picks the OpenCL version */

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

/* CLBlast's GEMMs count as matmul (they also have a counter of their
 * own, for tests). */
static void ocl_profile(duet_backend *base, duet_profile *out) {
    ocl_backend *be = (ocl_backend *)base;
    if (!be->profile) return;
    if (be->queue && !be->in_step) { /* finished work only: a step in flight is counted at its wait */
        clFinish(be->queue);
        collect_events(be);
    }
    out->enabled = true;
    out->steps = be->prof_steps;
    for (int k = 0; k < OCL_PROF_KINDS; k++) {
        const int op = k == OCL_PROF_CLBLAST ? DUET_OP_MATMUL : k;
        out->count[op] += (uint64_t)be->prof_count[k];
        out->ms[op] += be->prof_ms[k];
    }
}

void duet__ocl_profile(const ocl_backend *be, double *ms, long *count) {
    for (int k = 0; k < OCL_PROF_KINDS; k++) {
        ms[k] = be->prof_ms[k];
        count[k] = be->prof_count[k];
    }
}

/* ---- instance ----------------------------------------------------------------------- */

/* Open instances. CLBlast caches compiled programs per context for the
 * life of the process, and a cached program keeps its context alive: the
 * last instance to close empties that cache, so closing frees the device
 * memory and CLBlast's globals are not torn down after the driver's at
 * exit (Oclgrind's LLVM fails then). Clearing on every close would make
 * other live instances recompile. */
static atomic_int live_instances;

static void ocl_close(duet_backend *base) {
    ocl_backend *be = (ocl_backend *)base;
    if (!be) return;
    const bool counted = be->counted;
    if (be->queue) {
        clFinish(be->queue);
        collect_events(be);
    }
    duet__ocl_programs_free(be);
    if (be->shared && atomic_fetch_sub(&be->shared->refs, 1) == 1) {
        for (int i = 0; i < be->shared->n_programs; i++)
            clReleaseProgram(be->shared->programs[i].prog);
        pthread_mutex_destroy(&be->shared->mu);
        free(be->shared);
    }
    if (be->scratch) clReleaseMemObject(be->scratch);
    if (be->att_part) clReleaseMemObject(be->att_part);
    if (be->att_rows) clReleaseMemObject(be->att_rows);
    if (be->q8_rows) clReleaseMemObject(be->q8_rows);
    if (be->queue) clReleaseCommandQueue(be->queue);
    if (be->ctx) clReleaseContext(be->ctx);
    free(be->events);
    free(be->event_kinds);
    free(be);
    if (counted && atomic_fetch_sub(&live_instances, 1) == 1) CLBlastClearCache();
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
    atomic_fetch_add(&live_instances, 1);
    be->counted = true;
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

    if (!(be->shared = calloc(1, sizeof *be->shared))) {
        st = duet__error(DUET_OUT_OF_MEMORY, "opencl: device");
        goto fail;
    }
    atomic_init(&be->shared->refs, 1);
    pthread_mutex_init(&be->shared->mu, NULL);
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

/* A stream: the parent's context, programs, tuning and device options; a
 * command queue and kernel objects of its own. */
static duet_status ocl_stream_open(duet_backend *parent, const duet_backend_params *params,
                                   duet_backend **out) {
    (void)params;
    *out = NULL;
    ocl_backend *pb = (ocl_backend *)parent;
    ocl_backend *be = calloc(1, sizeof *be);
    if (!be) return duet__error(DUET_OUT_OF_MEMORY, "opencl: stream");
    be->base = pb->base;
    be->dev = pb->dev;
    be->tune = pb->tune;
    be->int_dot = pb->int_dot;
    be->profile = pb->profile;
    atomic_fetch_add(&live_instances, 1);
    be->counted = true;
    atomic_fetch_add(&pb->shared->refs, 1);
    be->shared = pb->shared;
    pthread_mutex_lock(&pb->shared->mu); /* a build's fallback may rewrite them */
    memcpy(be->dev_options, pb->dev_options, sizeof be->dev_options);
    pthread_mutex_unlock(&pb->shared->mu);
    clRetainContext(pb->ctx);
    be->ctx = pb->ctx;
    cl_int err;
    be->queue = clCreateCommandQueue(be->ctx, be->dev->id, be->profile ? CL_QUEUE_PROFILING_ENABLE : 0, &err);
    if (!be->queue) {
        duet_status st = duet__ocl_fail(err, "clCreateCommandQueue", __FILE__, __LINE__);
        ocl_close(&be->base);
        return st;
    }
    *out = &be->base;
    return DUET_OK;
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
    b->head = (duet_buffer_head){.size = size, .kind = DUET_BUFFER_DEVICE};
    *out = b;
    return DUET_OK;
}

static void ocl_buffer_free(duet_backend *be, duet_buffer *buf) {
    if (!buf) return;
    clReleaseMemObject(buf->mem);
    free(buf);
}

/* Blocking: the caller may reuse `src` at once, and in-order execution puts
 * the write after the ops already enqueued. */
static duet_status ocl_upload(duet_backend *base, duet_buffer *buf, size_t offset, const void *src,
                              size_t size) {
    ocl_backend *be = (ocl_backend *)base;
    if (size == 0) return DUET_OK; /* the registry checked the range */
    CL_TRY(clEnqueueWriteBuffer(be->queue, buf->mem, CL_TRUE, offset, size, src, 0, NULL, NULL));
    return DUET_OK;
}

static duet_status ocl_download(duet_backend *base, duet_buffer *buf, size_t offset, void *dst, size_t size) {
    ocl_backend *be = (ocl_backend *)base;
    if (size == 0) return DUET_OK; /* the registry checked the range */
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
    be->prof_steps += be->profile;
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

/* Kernels index elements with 32-bit ints. */
#define OCL_MAX_DIM (1 << 30)

/* What this device's kernels can address (the registry checked the views,
 * their bounds and overlaps: duet_op_check). */
static duet_status kv_limits(const char *op, const duet_kv_pages *kv) {
    /* Kernels split positions with mul24: block counts stay under 2^23. */
    REQUIRE(kv->block_size < (1 << 23) && kv->n_blocks < OCL_MAX_DIM && kv->max_blocks < (1 << 23) &&
                kv->n_seqs < OCL_MAX_DIM &&
                mul2((uint64_t)kv->n_blocks, (uint64_t)kv->block_size) < OCL_MAX_DIM &&
                mul2((uint64_t)kv->max_blocks, (uint64_t)kv->block_size) < OCL_MAX_DIM,
            "%s: kv pages of %d blocks x %d tokens, table %d x %d", op, kv->n_blocks, kv->block_size,
            kv->n_seqs, kv->max_blocks);
    return DUET_OK;
}

static duet_status device_limits(const duet_op *op) {
    const uint64_t nt = (uint64_t)op->n_tokens;
    switch (op->kind) {
    case DUET_OP_EMBED:
        REQUIRE(op->embed.dim < OCL_MAX_DIM, "embed: dim %d", op->embed.dim);
        return DUET_OK;
    case DUET_OP_RMSNORM:
        REQUIRE(op->rmsnorm.dim < OCL_MAX_DIM, "rmsnorm: dim %d", op->rmsnorm.dim);
        return DUET_OK;
    case DUET_OP_MATMUL:
        REQUIRE(op->matmul.n_in < OCL_MAX_DIM && op->matmul.n_out < OCL_MAX_DIM, "matmul: n_in %d, n_out %d",
                op->matmul.n_in, op->matmul.n_out);
        return DUET_OK;
    case DUET_OP_ROPE_KV: {
        const int nh = op->rope_kv.n_head, nkv = op->rope_kv.n_head_kv, hd = op->rope_kv.head_dim;
        REQUIRE((uint64_t)(nh + nkv) * hd < OCL_MAX_DIM, "rope_kv: n_head %d, n_head_kv %d, head_dim %d", nh,
                nkv, hd);
        return kv_limits("rope_kv", &op->rope_kv.kv);
    }
    case DUET_OP_ATTENTION: {
        const int nh = op->attention.n_head, nkv = op->attention.n_head_kv, hd = op->attention.head_dim;
        REQUIRE((uint64_t)nh * hd < OCL_MAX_DIM && nt < (1 << 23),
                "attention: n_head %d, n_head_kv %d, head_dim %d, %llu tokens", nh, nkv, hd,
                (unsigned long long)nt);
        return kv_limits("attention", &op->attention.kv);
    }
    case DUET_OP_SWIGLU:
    case DUET_OP_ADD:
        return DUET_OK;
    case DUET_OP_GATHER_ROWS:
        REQUIRE(op->gather.dim < OCL_MAX_DIM, "gather_rows: dim %d", op->gather.dim);
        return DUET_OK;
    case DUET_OP_ARGMAX:
        REQUIRE(op->argmax.dim < OCL_MAX_DIM, "argmax: dim %d", op->argmax.dim);
        return DUET_OK;
    case DUET_OP_COUNT:
        break;
    }
    return duet__error(DUET_INVALID_ARGUMENT, "opencl: unknown op kind %d", (int)op->kind);
}

static bool kv_dtype_ok(duet_dtype t) {
    return t == DUET_DTYPE_F32 || t == DUET_DTYPE_F16 || t == DUET_DTYPE_Q8_0;
}

/* The weight types the kernels read (matmul and embedding). */
static bool weight_ok(duet_dtype t) {
    return t == DUET_DTYPE_F32 || t == DUET_DTYPE_F16 || t == DUET_DTYPE_BF16 || t == DUET_DTYPE_Q8_0 ||
           duet_dtype_is_packed_quant(t);
}

static bool ocl_supports_op(int index, const duet_op *op) {
    (void)index;
    switch (op->kind) {
    case DUET_OP_EMBED:
        return weight_ok(op->embed.dtype);
    case DUET_OP_MATMUL:
        return weight_ok(op->matmul.dtype);
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
    CHECK(device_limits(op));
    return duet__ocl_enqueue(be, op);
}

const duet_backend_iface duet_opencl_backend_iface = {
    .name = "opencl",
    .available = ocl_available,
    .device_count = ocl_device_count,
    .device_info = ocl_device_info,
    .open = ocl_open,
    .stream_open = ocl_stream_open,
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
    .profile = ocl_profile,
    .scratch_bytes = ocl_scratch_bytes,
};
