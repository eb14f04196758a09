/* vk_tuning.c — per-device choices: which matmul path, workgroup and tile
 * sizes (passed to shaders as specialization constants), and whether Q8_0
 * and the block types (Q4_0 ... IQ4_XS) use integer dot products.
 *
 * Looked up like CLBlast's database: the exact device first (vendor and
 * device id), then the vendor or driver (architecture), then a default by
 * device type. DUET_VK_TUNE overrides any field for experiments and tests,
 * e.g. DUET_VK_TUNE=matmul=subgroup,dot=0 (dot=0: int8 dot products
 * through the packed-integer fallback instead of OpSDotAccSat). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "vk_internal.h"

typedef struct vk_tuning_entry {
    const char *name;
    uint32_t vendor, device; /* 0 = any */
    VkDriverId driver;       /* 0 = any */
    int dot;                 /* -1: when the device has it; 0: never; 1: when it is accelerated */
    vk_tuning t;
} vk_tuning_entry;

/* Measured numbers behind the llvmpipe entry (2-core Xeon, Mesa 22.3,
 * 32000x768 Q8_0 matrix-vector product): one invocation per 8 rows reaches
 * 4.4 GB/s with float activations and 5.8 GB/s with int8 activations and
 * OpSDotAccSat (8 rows x 256 columns per texel group), vs 0.4 GB/s for a
 * storage-buffer shader. Wider tiles spill without gaining. Workgroups of 8
 * invocations are one SIMD vector: small matrices still split across
 * cores. With q8_0 activations (x_q8), 16 rows an invocation measured
 * 5-10% faster than 8 on that cache-resident matrix (the activations'
 * int8 -> float unpacking is shared by more rows; F16 spills there); end
 * to end on the 1b model, which streams from DRAM, 8 and 16 were within
 * run-to-run noise (six alternated bench_decode runs). */
/* Attention: on llvmpipe a workgroup runs on one core with its lanes as
 * SIMD lanes, and shared memory is read and written lane by lane (texel
 * fetches are vector gathers): attn_flash's tiles in shared memory ran
 * 20-30x slower than attn_lane there (125m decode at 1024 keys: 23.6 ms vs
 * about 1 ms, one DUET_PROFILE run on a loaded machine, not kept in
 * bench/results), so CPU devices take the lane kernel, a
 * row per lane (splitting a row over lanes costs shuffles that cost more
 * than they save there), 8 lanes (one vector) per workgroup, split until 8
 * workgroups keep 2 cores busy. GPUs take
 * attn_flash: 4 lanes per query row in prefill (registers for q and the
 * accumulator stay small), a subgroup per head in decode, and splits until
 * a few hundred workgroups are in flight. */
// clang-format off
static const vk_tuning_entry vk_table[] = {
    /* exact devices go first: none measured yet */

    /* drivers / architectures */
    {"llvmpipe", 0, 0, VK_DRIVER_ID_MESA_LLVMPIPE, 1,
     {.matmul = VK_MATMUL_TILE, .tile_wg = 8, .tile_rows = 8, .tile_tokens = 4, .tile_rows_q8 = 16,
      .sg_wg = 64, .sg_rows = 1, .mm_min = 0, .mm_bm = 32, .mm_bn = 32,
      .attn_lane = true, .attn_wg = 8, .attn_c = 1, .attn_dc = 1, .attn_kt = 16, .attn_par = 8, .attn_chunk = 512,
      .norm_wg = 8, .ew_wg = 64}},
    {"nvidia", 0x10DE, 0, 0, 1,
     {.matmul = VK_MATMUL_SUBGROUP, .tile_wg = 64, .tile_rows = 4, .tile_tokens = 4, .tile_rows_q8 = 4,
      .sg_wg = 128, .sg_rows = 2, .mm_min = 16, .mm_bm = 64, .mm_bn = 32,
      .attn_wg = 128, .attn_c = 4, .attn_dc = 32, .attn_kt = 32, .attn_par = 512, .attn_chunk = 256,
      .norm_wg = 256, .ew_wg = 256}},
    {"amd", 0x1002, 0, 0, 1,
     {.matmul = VK_MATMUL_SUBGROUP, .tile_wg = 64, .tile_rows = 4, .tile_tokens = 4, .tile_rows_q8 = 4,
      .sg_wg = 64, .sg_rows = 2, .mm_min = 16, .mm_bm = 64, .mm_bn = 32,
      .attn_wg = 128, .attn_c = 4, .attn_dc = 32, .attn_kt = 32, .attn_par = 512, .attn_chunk = 256,
      .norm_wg = 256, .ew_wg = 256}},
    {"intel", 0x8086, 0, 0, 1,
     {.matmul = VK_MATMUL_SUBGROUP, .tile_wg = 64, .tile_rows = 4, .tile_tokens = 4, .tile_rows_q8 = 4,
      .sg_wg = 64, .sg_rows = 2, .mm_min = 16, .mm_bm = 32, .mm_bn = 32,
      .attn_wg = 64, .attn_c = 4, .attn_dc = 16, .attn_kt = 16, .attn_par = 128, .attn_chunk = 256,
      .norm_wg = 128, .ew_wg = 128}},
};
// clang-format on

// clang-format off
static const vk_tuning vk_default_gpu = {
    .matmul = VK_MATMUL_SUBGROUP, .tile_wg = 64, .tile_rows = 4, .tile_tokens = 4, .tile_rows_q8 = 4,
    .sg_wg = 64, .sg_rows = 1, .mm_min = 16, .mm_bm = 32, .mm_bn = 32,
    .attn_wg = 64, .attn_c = 4, .attn_dc = 0, .attn_kt = 16, .attn_par = 256, .attn_chunk = 256,
    .norm_wg = 128, .ew_wg = 128};
static const vk_tuning vk_default_cpu = {
    .matmul = VK_MATMUL_TILE, .tile_wg = 8, .tile_rows = 8, .tile_tokens = 4, .tile_rows_q8 = 16,
    .sg_wg = 64, .sg_rows = 1, .mm_min = 0, .mm_bm = 32, .mm_bn = 32,
    .attn_lane = true, .attn_wg = 8, .attn_c = 1, .attn_dc = 1, .attn_kt = 16, .attn_par = 8, .attn_chunk = 512,
    .norm_wg = 8, .ew_wg = 64};
// clang-format on

static bool pow2_in(long v, long lo, long hi) {
    return v >= lo && v <= hi && (v & (v - 1)) == 0;
}

/* Applies "key=value,key=value" overrides. */
static duet_status apply_overrides(const vk_physical *p, vk_tuning *t, const char *spec) {
    char buf[256];
    snprintf(buf, sizeof buf, "%s", spec);
    uint32_t max_wg = p->props.limits.maxComputeWorkGroupInvocations;
    for (char *save = NULL, *kv = strtok_r(buf, ",", &save); kv; kv = strtok_r(NULL, ",", &save)) {
        char *eq = strchr(kv, '=');
        if (!eq) return duet__error(DUET_INVALID_ARGUMENT, "DUET_VK_TUNE: '%s' is not key=value", kv);
        *eq = 0;
        const char *key = kv, *val = eq + 1;
        char *end;
        long v = strtol(val, &end, 10);
        bool num = *val && !*end;
        if (strcmp(key, "matmul") == 0) {
            if (strcmp(val, "tile") == 0)
                t->matmul = VK_MATMUL_TILE;
            else if (strcmp(val, "subgroup") == 0)
                t->matmul = VK_MATMUL_SUBGROUP;
            else
                return duet__error(DUET_INVALID_ARGUMENT, "DUET_VK_TUNE: matmul=%s (have: tile, subgroup)",
                                   val);
        } else if (strcmp(key, "dot") == 0 && num && (v == 0 || v == 1)) {
            if (v && !p->int_dot)
                return duet__error(DUET_UNSUPPORTED, "DUET_VK_TUNE: dot=1 but %s has no integer dot product",
                                   p->props.deviceName);
            t->int_dot = v;
        } else if (strcmp(key, "attn") == 0) {
            if (strcmp(val, "lane") == 0)
                t->attn_lane = true;
            else if (strcmp(val, "flash") == 0)
                t->attn_lane = false;
            else
                return duet__error(DUET_INVALID_ARGUMENT, "DUET_VK_TUNE: attn=%s (have: lane, flash)", val);
        } else if (strcmp(key, "shuffle") == 0 && num && (v == 0 || v == 1)) {
            t->no_shuffle = !v;
        } else if (strcmp(key, "tile_rows") == 0 && num && pow2_in(v, 1, 16))
            t->tile_rows = (int)v;
        else if (strcmp(key, "tile_tokens") == 0 && num && pow2_in(v, 1, 8))
            t->tile_tokens = (int)v;
        else if (strcmp(key, "tile_rows_q8") == 0 && num && pow2_in(v, 1, 32))
            t->tile_rows_q8 = (int)v;
        else if (strcmp(key, "tile_wg") == 0 && num && pow2_in(v, 1, max_wg))
            t->tile_wg = (int)v;
        else if (strcmp(key, "sg_wg") == 0 && num && pow2_in(v, 1, max_wg))
            t->sg_wg = (int)v;
        else if (strcmp(key, "sg_rows") == 0 && num && pow2_in(v, 1, 8))
            t->sg_rows = (int)v;
        else if (strcmp(key, "mm_min") == 0 && num && v >= 0 && v <= 65536)
            t->mm_min = (int)v;
        else if (strcmp(key, "mm_bm") == 0 && num && pow2_in(v, 8, 128))
            t->mm_bm = (int)v;
        else if (strcmp(key, "mm_bn") == 0 && num && pow2_in(v, 8, 128))
            t->mm_bn = (int)v;
        else if (strcmp(key, "attn_wg") == 0 && num && pow2_in(v, 1, max_wg < 1024 ? max_wg : 1024))
            t->attn_wg = (int)v;
        else if (strcmp(key, "attn_c") == 0 && num && pow2_in(v, 1, 128))
            t->attn_c = (int)v;
        else if (strcmp(key, "attn_dc") == 0 && num && (v == 0 || pow2_in(v, 1, 128)))
            t->attn_dc = (int)v;
        else if (strcmp(key, "attn_kt") == 0 && num && pow2_in(v, 1, 64))
            t->attn_kt = (int)v;
        else if (strcmp(key, "attn_par") == 0 && num && v >= 1 && v <= 65536)
            t->attn_par = (int)v;
        else if (strcmp(key, "attn_chunk") == 0 && num && v >= 1 && v <= (1 << 20))
            t->attn_chunk = (int)v;
        else if (strcmp(key, "norm_wg") == 0 && num && pow2_in(v, 1, max_wg))
            t->norm_wg = (int)v;
        else if (strcmp(key, "ew_wg") == 0 && num && pow2_in(v, 1, max_wg))
            t->ew_wg = (int)v;
        else
            return duet__error(DUET_INVALID_ARGUMENT,
                               "DUET_VK_TUNE: bad '%s=%s' (keys: matmul=tile|subgroup, dot=0|1, "
                               "attn=lane|flash, shuffle=0|1, tile_rows<=16, tile_rows_q8<=32, "
                               "tile_tokens<=8, tile_wg, sg_wg, sg_rows<=8, mm_min (0: never), mm_bm, mm_bn "
                               "(8..128), attn_wg, attn_c<=128, attn_dc<=128 (0: subgroup), "
                               "attn_kt<=64, attn_par, attn_chunk, norm_wg, ew_wg; sizes are powers of two)",
                               key, val);
    }
    return DUET_OK;
}

duet_status duet__vk_tuning_select(const vk_physical *p, vk_tuning *out) {
    const vk_tuning_entry *hit = NULL;
    /* Pass 0: exact device; pass 1: vendor or driver. */
    for (int pass = 0; pass < 2 && !hit; pass++)
        for (size_t i = 0; i < sizeof vk_table / sizeof vk_table[0] && !hit; i++) {
            const vk_tuning_entry *e = &vk_table[i];
            bool exact = e->device != 0;
            if ((pass == 0) != exact) continue;
            if (e->vendor && e->vendor != p->props.vendorID) continue;
            if (e->device && e->device != p->props.deviceID) continue;
            if (e->driver && e->driver != p->driver_id) continue;
            hit = e;
        }
    if (hit) {
        *out = hit->t;
        out->int_dot = hit->dot < 0 ? p->int_dot : hit->dot > 0 ? p->int_dot_accel : false;
        snprintf(out->source, sizeof out->source, "%s", hit->name);
    } else {
        bool cpu = p->props.deviceType == VK_PHYSICAL_DEVICE_TYPE_CPU;
        *out = cpu ? vk_default_cpu : vk_default_gpu;
        out->int_dot = cpu ? p->int_dot : p->int_dot_accel;
        snprintf(out->source, sizeof out->source, "default-%s", cpu ? "cpu" : "gpu");
    }
    /* The subgroup path reduces with subgroup arithmetic or shared memory;
     * workgroups smaller than a subgroup waste lanes but stay correct. */
    const char *env = getenv("DUET_VK_TUNE");
    if (env && *env) {
        duet_status st = apply_overrides(p, out, env);
        if (st != DUET_OK) return st;
        size_t len = strlen(out->source);
        snprintf(out->source + len, sizeof out->source - len, "+env");
    }
    return DUET_OK;
}
