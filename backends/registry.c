/* registry.c — the compiled-in backends, found by name, and the checked
 * wrappers around their interface (preconditions live here so backends stay
 * small). */
#include <string.h>

#include "backend.h"
#include "backend_checks.h"

#if DUET_BACKEND_VULKAN
extern const duet_backend_iface duet_vulkan_backend_iface;
#endif
#if DUET_BACKEND_OPENCL
extern const duet_backend_iface duet_opencl_backend_iface;
#endif

/* Build composition only: which backends this binary carries. Whether a
 * carried backend can run is decided at run time (`available`). */
static const duet_backend_iface *const duet__backends[] = {
#if DUET_BACKEND_VULKAN
    &duet_vulkan_backend_iface,
#endif
#if DUET_BACKEND_OPENCL
    &duet_opencl_backend_iface,
#endif
    &duet_cpu_backend_iface,
};
#define DUET__N_BACKENDS ((int)(sizeof duet__backends / sizeof duet__backends[0]))

int duet_backend_count(void) {
    return DUET__N_BACKENDS;
}

const duet_backend_iface *duet_backend_get(int i) {
    return i >= 0 && i < DUET__N_BACKENDS ? duet__backends[i] : NULL;
}

const duet_backend_iface *duet_backend_find(const char *name) {
    for (int i = 0; i < DUET__N_BACKENDS; i++)
        if (strcmp(duet__backends[i]->name, name) == 0) return duet__backends[i];
    return NULL;
}

/* auto ranks devices: discrete GPU > integrated GPU > cpu backend > a CPU
 * exposed through a GPU API (lavapipe, PoCL) > anything else. The native
 * cpu backend beats a GPU API's CPU emulation on the same cores, so those
 * are used only when asked for by name (tests, vendor comparisons). */
static int duet__device_rank(duet_device_type t) {
    switch (t) {
    case DUET_DEVICE_DISCRETE_GPU:
        return 4;
    case DUET_DEVICE_INTEGRATED_GPU:
        return 3;
    case DUET_DEVICE_HOST:
        return 2;
    case DUET_DEVICE_CPU:
        return 1;
    case DUET_DEVICE_OTHER:
        return 0;
    }
    return 0;
}

duet_status duet_backend_open(const char *name, int device, const duet_backend_params *params,
                              duet_backend **out) {
    *out = NULL;
    duet_backend_params defaults = {0};
    if (!params) params = &defaults;
    char why[256];
    if (name && strcmp(name, "auto") != 0) {
        const duet_backend_iface *be = duet_backend_find(name);
        if (!be) {
            char list[256] = "";
            for (int i = 0; i < DUET__N_BACKENDS; i++) {
                strcat(list, i ? ", " : "");
                strcat(list, duet__backends[i]->name);
            }
            return duet__error(DUET_NO_DEVICE, "backend '%s' is not compiled in (have: auto, %s)", name,
                               list);
        }
        why[0] = 0;
        if (!be->available(why, sizeof why))
            return duet__error(DUET_NO_DEVICE, "%s: unavailable (%s)", be->name, why);
        int n = be->device_count();
        if (device < 0) device = 0;
        if (device >= n)
            return duet__error(DUET_NO_DEVICE, "%s: no device %d (it has %d; see `duet devices`)", be->name,
                               device, n);
        return be->open(device, params, out);
    }
    /* auto: best-ranked device over every available backend. */
    const duet_backend_iface *best = NULL;
    int best_dev = -1, best_rank = -1;
    for (int i = 0; i < DUET__N_BACKENDS; i++) {
        const duet_backend_iface *be = duet__backends[i];
        if (!be->available(why, sizeof why)) continue;
        for (int d = 0; d < be->device_count(); d++) {
            duet_device_info info;
            if (be->device_info(d, &info) != DUET_OK) continue;
            int rank = duet__device_rank(info.type);
            if (rank > best_rank) best = be, best_dev = d, best_rank = rank;
        }
    }
    if (!best) return duet__error(DUET_NO_DEVICE, "no backend has a usable device");
    if (device >= 0) {
        /* An explicit index picks within the best backend; check it here, as
         * the named path does, rather than trusting every backend's open. */
        int n = best->device_count();
        if (device >= n)
            return duet__error(DUET_NO_DEVICE,
                               "auto chose %s, which has no device %d (it has %d; see `duet devices`)",
                               best->name, device, n);
        best_dev = device;
    }
    return best->open(best_dev, params, out);
}

void duet_backend_close(duet_backend *be) {
    if (be) be->iface->close(be);
}

duet_status duet_buffer_alloc(duet_backend *be, size_t size, duet_buffer **out) {
    *out = NULL;
    if (size == 0) size = 16; /* zero-sized tensors still get a valid handle */
    return be->iface->buffer_alloc(be, size, out);
}

void duet_buffer_free(duet_backend *be, duet_buffer *buf) {
    if (buf) be->iface->buffer_free(be, buf);
}

duet_status duet_buffer_upload(duet_backend *be, duet_buffer *buf, size_t offset, const void *src,
                               size_t size) {
    if (!buf || (size && !src)) return duet__error(DUET_INVALID_ARGUMENT, "upload: null buffer or source");
    if (size == 0) return DUET_OK;
    return be->iface->upload(be, buf, offset, src, size);
}

duet_status duet_buffer_download(duet_backend *be, duet_buffer *buf, size_t offset, void *dst, size_t size) {
    if (!buf || (size && !dst)) return duet__error(DUET_INVALID_ARGUMENT, "download: null buffer or target");
    if (size == 0) return DUET_OK;
    return be->iface->download(be, buf, offset, dst, size);
}

duet_status duet_step_begin(duet_backend *be) {
    return be->iface->begin(be);
}

static duet_status check_shared(const duet_op *op);

duet_status duet_step_op(duet_backend *be, const duet_op *op) {
    if (op->kind < 0 || op->kind >= DUET_OP_COUNT)
        return duet__error(DUET_INVALID_ARGUMENT, "op: unknown kind %d", (int)op->kind);
    if (op->n_tokens <= 0) return duet__error(DUET_INVALID_ARGUMENT, "op: n_tokens %d", op->n_tokens);
    duet_status st = check_shared(op);
    if (st) return st;
    if (be->iface->supports_op && !be->iface->supports_op(be, op))
        return duet__error(DUET_UNSUPPORTED, "%s: op %d is not supported on %s", be->iface->name,
                           (int)op->kind, be->info.name);
    return be->iface->op(be, op);
}

size_t duet_backend_scratch_bytes(duet_backend *be) {
    return be->iface->scratch_bytes ? be->iface->scratch_bytes(be) : 0;
}

size_t duet_kv_pool_bytes(const duet_kv_pages *kv, int kv_width) {
    const uint64_t b =
        mul3(duet_dtype_row_bytes(kv->dtype, kv_width), (uint64_t)kv->block_size, (uint64_t)kv->n_blocks);
    return b > SIZE_MAX ? SIZE_MAX : (size_t)b;
}

/* Shape rules every backend shares: paged-KV geometry and q8 widths. */
static duet_status check_kv_pages(const char *op, const duet_kv_pages *kv, int head_dim, int n_head,
                                  int n_head_kv) {
    if (kv->dtype != DUET_DTYPE_F32 && kv->dtype != DUET_DTYPE_F16 && kv->dtype != DUET_DTYPE_Q8_0)
        return duet__error(DUET_UNSUPPORTED, "%s: kv dtype %d (f32, f16 or q8_0)", op, (int)kv->dtype);
    if (kv->block_size < 1 || kv->n_blocks < 1 || kv->n_seqs < 1 || kv->max_blocks < 1)
        return duet__error(DUET_INVALID_ARGUMENT, "%s: kv pages %d blocks x %d tokens, table %d x %d", op,
                           kv->n_blocks, kv->block_size, kv->n_seqs, kv->max_blocks);
    if (!kv->k_pool.buf || !kv->v_pool.buf || !kv->block_table.buf)
        return duet__error(DUET_INVALID_ARGUMENT, "%s: kv pools and block table are required", op);
    if (head_dim < 1 || n_head < 1 || n_head_kv < 1 || n_head % n_head_kv)
        return duet__error(DUET_INVALID_ARGUMENT, "%s: %d heads over %d kv heads of %d", op, n_head,
                           n_head_kv, head_dim);
    if (kv->dtype == DUET_DTYPE_Q8_0 && head_dim % DUET_QK8_0)
        return duet__error(DUET_UNSUPPORTED, "%s: q8_0 kv needs head_dim %% 32 == 0 (got %d)", op, head_dim);
    return DUET_OK;
}

static duet_status check_q8_out(const char *op, duet_view out, duet_view out_q8, int width) {
    if (!out.buf && !out_q8.buf) return duet__error(DUET_INVALID_ARGUMENT, "%s: no output", op);
    if (out_q8.buf && width % DUET_QK8_0)
        return duet__error(DUET_INVALID_ARGUMENT, "%s: q8 output needs width %% 32 == 0 (got %d)", op, width);
    return DUET_OK;
}

static duet_status check_shared(const duet_op *op) {
    switch (op->kind) {
    case DUET_OP_ROPE_KV:
        return check_kv_pages("rope_kv", &op->rope_kv.kv, op->rope_kv.head_dim, op->rope_kv.n_head,
                              op->rope_kv.n_head_kv);
    case DUET_OP_ATTENTION: {
        duet_status st = check_kv_pages("attention", &op->attention.kv, op->attention.head_dim,
                                        op->attention.n_head, op->attention.n_head_kv);
        const duet_kv_pages *kv = &op->attention.kv;
        if (!st && (op->attention.n_keys < 0 ||
                    (int64_t)op->attention.n_keys > (int64_t)kv->max_blocks * kv->block_size))
            st = duet__error(DUET_INVALID_ARGUMENT,
                             "attention: n_keys %d outside [0, %lld] (the table's capacity)",
                             op->attention.n_keys, (long long)kv->max_blocks * kv->block_size);
        return st ? st
                  : check_q8_out("attention", op->attention.out, op->attention.out_q8,
                                 op->attention.n_head * op->attention.head_dim);
    }
    case DUET_OP_RMSNORM:
        return check_q8_out("rmsnorm", op->rmsnorm.out, op->rmsnorm.out_q8, op->rmsnorm.dim);
    case DUET_OP_SWIGLU:
        return check_q8_out("swiglu", op->swiglu.out, op->swiglu.out_q8, op->swiglu.dim);
    case DUET_OP_MATMUL:
        if (op->matmul.x_q8.buf && op->matmul.dtype != DUET_DTYPE_Q8_0)
            return duet__error(DUET_INVALID_ARGUMENT, "matmul: q8 activations need q8_0 weights");
        if (!op->matmul.x_q8.buf && !op->matmul.x.buf)
            return duet__error(DUET_INVALID_ARGUMENT, "matmul: no input");
        return DUET_OK;
    default:
        return DUET_OK;
    }
}

duet_status duet_step_submit(duet_backend *be) {
    return be->iface->submit(be);
}
duet_status duet_step_wait(duet_backend *be) {
    return be->iface->wait(be);
}
