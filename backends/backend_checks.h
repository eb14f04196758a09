/* backend_checks.h — the small helpers every backend's op validation uses:
 * early returns on a failed status or condition, and products of
 * dimensions that cannot overflow silently. Private to backends/. */
#ifndef DUET_BACKEND_CHECKS_H
#define DUET_BACKEND_CHECKS_H

#include <stdint.h>

#include "backend.h"

#define CHECK(expr)                                                                                          \
    do {                                                                                                     \
        duet_status st_ = (expr);                                                                            \
        if (st_ != DUET_OK) return st_;                                                                      \
    } while (0)
#define REQUIRE(cond, ...)                                                                                   \
    do {                                                                                                     \
        if (!(cond)) return duet__error(DUET_INVALID_ARGUMENT, __VA_ARGS__);                                 \
    } while (0)

/* Products of dimensions in 64 bits; UINT64_MAX on overflow, which then
 * fails every bounds check. */
static inline uint64_t mul2(uint64_t a, uint64_t b) {
    uint64_t r;
    return __builtin_mul_overflow(a, b, &r) ? UINT64_MAX : r;
}
static inline uint64_t mul3(uint64_t a, uint64_t b, uint64_t c) {
    return mul2(mul2(a, b), c);
}

static inline uint32_t div_up(uint64_t a, uint64_t b) {
    return (uint32_t)((a + b - 1) / b);
}

#endif
