/* fault_backend.h — wraps a backend instance's interface so that tests can
 * make its ops fail on demand: device errors are otherwise hard to provoke,
 * and the paths that handle them need tests like any other. */
#ifndef DUET_FAULT_BACKEND_H
#define DUET_FAULT_BACKEND_H

#include <stdatomic.h>
#include <stdbool.h>

#include "backend.h"

static const duet_backend_iface *fault_real;
static duet_backend_iface fault_iface;
/* Ops that still succeed; 0 = every op fails from now on, -1 = none fails. */
static _Atomic int fault_ops_left = -1;
/* Submit leaves a message of its own, as a driver reporting a second
 * problem would: the first failure's message must survive it. */
static _Atomic bool fault_noisy_submit;

static duet_status fault_op(duet_backend *be, const duet_op *op) {
    int left = atomic_load(&fault_ops_left);
    if (left == 0) return duet__error(DUET_DEVICE, "injected op failure (op kind %d)", (int)op->kind);
    if (left > 0) atomic_fetch_sub(&fault_ops_left, 1);
    return fault_real->op(be, op);
}

static duet_status fault_submit(duet_backend *be) {
    duet_status st = fault_real->submit(be);
    if (atomic_load(&fault_noisy_submit)) duet__error(DUET_DEVICE, "submit noise");
    return st;
}

/* Routes be's ops through the fault layer (one backend at a time). */
static inline void fault_install(duet_backend *be) {
    fault_real = be->iface;
    fault_iface = *be->iface;
    fault_iface.op = fault_op;
    fault_iface.submit = fault_submit;
    atomic_store(&fault_ops_left, -1);
    atomic_store(&fault_noisy_submit, false);
    be->iface = &fault_iface;
}

static inline void fault_remove(duet_backend *be) { be->iface = fault_real; }

#endif
