/* fault_backend.h — wraps a backend instance's interface so that tests can
 * make it fail on demand: device errors are otherwise hard to provoke, and
 * the paths that handle them need tests like any other.
 *
 * Fault kinds (fault_kind), each armed on its own with fault_arm():
 *   FAULT_OP      an op is refused (DUET_DEVICE), as a driver rejecting a
 *                 dispatch; the op is not recorded.
 *   FAULT_ALLOC   an allocation fails (DUET_OUT_OF_MEMORY): buffer_alloc,
 *                 and the attention op, which grows its scratch at run time
 *                 in every backend (the engine itself allocates no buffer
 *                 after start: the run state is sized once).
 *   FAULT_SUBMIT  submit fails (DUET_DEVICE).
 *   FAULT_WAIT    wait fails (DUET_DEVICE).
 * A failed submit or wait still lets the real backend finish the step (its
 * results are then ignored), as a driver that reports an error and recovers
 * would: these kinds are transient, the next step must work.
 *
 * fault_lose_device() is the fatal kind: from that moment every op, begin,
 * submit, wait, upload, download and buffer_alloc fails with
 * DUET_DEVICE_LOST and never reaches the real backend again (closing and
 * freeing still do, so that the backend is released).
 *
 * One backend at a time: the state is global. Set it from any thread. */
#ifndef DUET_FAULT_BACKEND_H
#define DUET_FAULT_BACKEND_H

#include <stdatomic.h>
#include <stdbool.h>

#include "backend.h"

typedef enum fault_kind { FAULT_OP, FAULT_ALLOC, FAULT_SUBMIT, FAULT_WAIT, FAULT_KINDS } fault_kind;

static const duet_backend_iface *fault_real;
static duet_backend_iface fault_iface;
/* Per kind: calls that still succeed before the fault fires (0 = the next
 * one fails, -1 = disarmed), then how many calls fail (-1 = every one from
 * then on), and how many failures were injected. */
static _Atomic int fault_left[FAULT_KINDS] = {-1, -1, -1, -1};
static _Atomic int fault_times[FAULT_KINDS] = {-1, -1, -1, -1};
static _Atomic int fault_fired[FAULT_KINDS];
static _Atomic bool fault_lost;
static _Atomic int fault_lost_fired;
/* Ops that still succeed; 0 = every op fails from now on, -1 = none fails. */
#define fault_ops_left (fault_left[FAULT_OP])
/* Submit leaves a message of its own, as a driver reporting a second
 * problem would: the first failure's message must survive it. */
static _Atomic bool fault_noisy_submit;

/* After `after` more successful calls of kind k, the next `times` calls
 * fail (-1: all of them until disarmed). */
static inline void fault_arm(fault_kind k, int after, int times) {
    atomic_store(&fault_times[k], times);
    atomic_store(&fault_left[k], after);
}

static inline void fault_disarm(fault_kind k) {
    atomic_store(&fault_left[k], -1);
}

static inline void fault_lose_device(void) {
    atomic_store(&fault_lost, true);
}

/* Whether this call of kind k fails (consumes one success or one failure). */
static bool fault_fires(fault_kind k) {
    int left = atomic_load(&fault_left[k]);
    while (left > 0)
        if (atomic_compare_exchange_weak(&fault_left[k], &left, left - 1)) return false;
    if (left < 0) return false;
    /* The last of a limited number of failures disarms the fault. */
    if (atomic_load(&fault_times[k]) > 0 && atomic_fetch_sub(&fault_times[k], 1) == 1) fault_disarm(k);
    atomic_fetch_add(&fault_fired[k], 1);
    return true;
}

static duet_status fault_lost_error(const char *call) {
    atomic_fetch_add(&fault_lost_fired, 1);
    return duet__error(DUET_DEVICE_LOST, "injected device loss (in %s)", call);
}

static duet_status fault_op(duet_backend *be, const duet_op *op) {
    if (atomic_load(&fault_lost)) return fault_lost_error("op");
    if (fault_fires(FAULT_OP))
        return duet__error(DUET_DEVICE, "injected op failure (op kind %d)", (int)op->kind);
    if (op->kind == DUET_OP_ATTENTION && fault_fires(FAULT_ALLOC))
        return duet__error(DUET_OUT_OF_MEMORY, "injected allocation failure (attention scratch)");
    return fault_real->op(be, op);
}

static duet_status fault_submit(duet_backend *be) {
    if (atomic_load(&fault_lost)) return fault_lost_error("submit");
    duet_status st = fault_real->submit(be);
    if (!st && fault_fires(FAULT_SUBMIT)) {
        fault_real->wait(be); /* the step ran, but its results are not trusted */
        st = duet__error(DUET_DEVICE, "injected submit failure");
    }
    if (atomic_load(&fault_noisy_submit)) duet__error(DUET_DEVICE, "submit noise");
    return st;
}

static duet_status fault_wait(duet_backend *be) {
    if (atomic_load(&fault_lost)) return fault_lost_error("wait");
    duet_status st = fault_real->wait(be);
    if (!st && fault_fires(FAULT_WAIT)) st = duet__error(DUET_DEVICE, "injected wait failure");
    return st;
}

static duet_status fault_begin(duet_backend *be) {
    if (atomic_load(&fault_lost)) return fault_lost_error("begin");
    return fault_real->begin(be);
}

static duet_status fault_buffer_alloc(duet_backend *be, size_t size, duet_buffer **out) {
    *out = NULL;
    if (atomic_load(&fault_lost)) return fault_lost_error("buffer_alloc");
    if (fault_fires(FAULT_ALLOC))
        return duet__error(DUET_OUT_OF_MEMORY, "injected allocation failure (%zu bytes)", size);
    return fault_real->buffer_alloc(be, size, out);
}

static duet_status fault_upload(duet_backend *be, duet_buffer *buf, size_t offset, const void *src,
                                size_t size) {
    if (atomic_load(&fault_lost)) return fault_lost_error("upload");
    return fault_real->upload(be, buf, offset, src, size);
}

static duet_status fault_download(duet_backend *be, duet_buffer *buf, size_t offset, void *dst, size_t size) {
    if (atomic_load(&fault_lost)) return fault_lost_error("download");
    return fault_real->download(be, buf, offset, dst, size);
}

/* Routes be's calls through the fault layer, every fault disarmed. */
static inline void fault_install(duet_backend *be) {
    fault_real = be->iface;
    fault_iface = *be->iface;
    fault_iface.op = fault_op;
    fault_iface.submit = fault_submit;
    fault_iface.wait = fault_wait;
    fault_iface.begin = fault_begin;
    fault_iface.buffer_alloc = fault_buffer_alloc;
    fault_iface.upload = fault_upload;
    fault_iface.download = fault_download;
    for (int k = 0; k < FAULT_KINDS; k++) {
        fault_arm((fault_kind)k, -1, -1);
        atomic_store(&fault_fired[k], 0);
    }
    atomic_store(&fault_lost, false);
    atomic_store(&fault_lost_fired, 0);
    atomic_store(&fault_noisy_submit, false);
    be->iface = &fault_iface;
}

static inline void fault_remove(duet_backend *be) { be->iface = fault_real; }

#endif
