/* registry.c — the compiled-in backends, found by name, and the checked
 * wrappers around their interface (preconditions live here so backends stay
 * small). */
#include <stdlib.h>
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

/* Process-wide switches the HAL owns (so core never reads the environment). */
static void apply_overrides(duet_device_info *info) {
    const char *act = getenv("DUET_ACT_Q8");
    if (act && strcmp(act, "0") == 0) info->q8_activations = false;
}

duet_status duet_device_info_get(const duet_backend_iface *iface, int index, duet_device_info *out) {
    duet_status st = iface->device_info(index, out);
    if (st == DUET_OK) apply_overrides(out);
    return st;
}

bool duet_device_supports_op(const duet_backend_iface *iface, int index, const duet_op *op) {
    return !iface->supports_op || iface->supports_op(index, op);
}

static duet_status open_device(const duet_backend_iface *iface, int device, const duet_backend_params *params,
                               duet_backend **out) {
    duet_status st = iface->open(device, params, out);
    if (st == DUET_OK) apply_overrides(&(*out)->info);
    return st;
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
        return open_device(be, device, params, out);
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
    return open_device(best, best_dev, params, out);
}

duet_status duet_backend_stream_open(duet_backend *parent, const duet_backend_params *params,
                                     duet_backend **out) {
    *out = NULL;
    if (!parent->iface->stream_open)
        return duet__error(DUET_UNSUPPORTED, "%s: no streams on %s", parent->iface->name, parent->info.name);
    duet_backend_params defaults = {0};
    /* A stream copies its parent's info, overrides (DUET_ACT_Q8) included. */
    return parent->iface->stream_open(parent, params ? params : &defaults, out);
}

void duet_backend_profile(duet_backend *be, duet_profile *out) {
    memset(out, 0, sizeof *out);
    if (be && be->iface->profile) be->iface->profile(be, out);
}

void duet_profile_print(const duet_profile *p, const char *who, FILE *f) {
    double total = 0;
    for (int k = 0; k < DUET_OP_COUNT; k++)
        total += p->ms[k];
    fprintf(f, "duet profile (%s, %d steps, %.3f ms of device time):\n", who, p->steps, total);
    fprintf(f, "  %-12s %10s %12s %10s %7s\n", "op", "count", "total ms", "avg us", "share");
    for (int k = 0; k < DUET_OP_COUNT; k++)
        if (p->count[k])
            fprintf(f, "  %-12s %10llu %12.3f %10.1f %6.1f%%\n", duet_op_name((duet_op_kind)k),
                    (unsigned long long)p->count[k], p->ms[k], 1e3 * p->ms[k] / (double)p->count[k],
                    total > 0 ? 100 * p->ms[k] / total : 0.0);
}

void duet_backend_close(duet_backend *be) {
    if (!be) return;
    duet_profile p;
    duet_backend_profile(be, &p);
    const char *env = getenv("DUET_PROFILE");
    if (p.enabled && env && *env && strcmp(env, "0") != 0) {
        char who[320];
        snprintf(who, sizeof who, "%s on %s", be->iface->name, be->info.name);
        duet_profile_print(&p, who, stderr);
    }
    be->iface->close(be);
}

duet_status duet_buffer_alloc(duet_backend *be, size_t size, duet_buffer **out) {
    *out = NULL;
    if (size == 0) size = 16; /* zero-sized tensors still get a valid handle */
    return be->iface->buffer_alloc(be, size, out);
}

void duet_buffer_free(duet_backend *be, duet_buffer *buf) {
    if (buf) be->iface->buffer_free(be, buf);
}

static duet_status check_range(const char *what, const duet_buffer *buf, size_t offset, size_t size) {
    const size_t have = duet_buffer_head_of(buf)->size;
    if (offset > have || size > have - offset)
        return duet__error(DUET_INVALID_ARGUMENT, "%s: %zu bytes at offset %zu run past a %zu-byte buffer",
                           what, size, offset, have);
    return DUET_OK;
}

duet_status duet_buffer_upload(duet_backend *be, duet_buffer *buf, size_t offset, const void *src,
                               size_t size) {
    if (!buf || (size && !src)) return duet__error(DUET_INVALID_ARGUMENT, "upload: null buffer or source");
    CHECK(check_range("upload", buf, offset, size));
    if (size == 0) return DUET_OK;
    return be->iface->upload(be, buf, offset, src, size);
}

duet_status duet_buffer_download(duet_backend *be, duet_buffer *buf, size_t offset, void *dst, size_t size) {
    if (!buf || (size && !dst)) return duet__error(DUET_INVALID_ARGUMENT, "download: null buffer or target");
    CHECK(check_range("download", buf, offset, size));
    if (size == 0) return DUET_OK;
    return be->iface->download(be, buf, offset, dst, size);
}

duet_status duet_step_begin(duet_backend *be) {
    return be->iface->begin(be);
}

duet_status duet_step_op(duet_backend *be, const duet_op *op) {
    duet_status st = duet_op_check(op);
    if (st) return st;
    if (!duet_device_supports_op(be->iface, be->device_index, op))
        return duet__error(DUET_UNSUPPORTED, "%s: %s is not supported on %s (dtype or shape)",
                           be->iface->name, duet_op_name(op->kind), be->info.name);
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

duet_status duet_step_submit(duet_backend *be) {
    return be->iface->submit(be);
}
duet_status duet_step_wait(duet_backend *be) {
    return be->iface->wait(be);
}
