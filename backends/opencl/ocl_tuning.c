/* ocl_tuning.c — the per-device tuning table.
 *
 * Looked up exact device -> vendor/architecture -> device type -> default
 * (the first entry that matches, in table order). Numbers for PoCL come
 * from bench_backend_ops on a 2-core Xeon (bench/results/); GPU entries are
 * the usual starting points for each vendor's wave/warp size, to be
 * replaced by measurements on that hardware.
 *
 * $DUET_OPENCL_TUNE overrides any knob ("mv_r=32,mv_wg=64,clblast_min=0"):
 * the benchmark sweeps with it and the tests force every code path with it.
 * The knobs that pick a code path rather than a size:
 *   dot=0          q8 x q8 matmuls use the portable integer code even where
 *                  the device has cl_khr_integer_dot_product (dot=1 requires
 *                  the extension: open fails without it; dot=2, for tests,
 *                  runs the extension's code with the built-ins emulated in
 *                  OpenCL C). Without the knob: the extension when the
 *                  device reports a 4x8-bit capability, else portable.
 *   att_mode=1|2   every attention takes the decode (flash-decoding) or the
 *                  prefill (tiled) kernel; 0 picks by batch shape.
 *   mm_tile_min=N  q8 x q8 matmuls of N or more tokens use the local-memory
 *                  tiled GEMM (0 = never: the register-tiled matvec kernel).
 *   q8_f32_min=N   q8 matmuls of N or more tokens dequantise their q8_0
 *                  activations to f32 and take the f32-activation kernel
 *                  (0 = never).
 *   clblast_min=N  F32/F16 matmuls of N or more tokens go to CLBlast. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ocl_internal.h"

typedef struct tune_entry {
    const char *device;   /* substring of the device name, or NULL */
    const char *platform; /* substring of the platform name, or NULL */
    const char *vendor;   /* duet_device_info.vendor, or NULL */
    int type;             /* duet_device_type, or -1 for any */
    ocl_tuning t;
} tune_entry;

#define MiB ((size_t)1 << 20)

static const tune_entry tune_table[] = {
    /* Oclgrind simulates a GPU-like device: use the cooperative (work-group
     * reduction) paths so the race and memory checks cover them. */
    {"Oclgrind",
     NULL,
     NULL,
     -1,
     {"oclgrind",      .mv_r = 8,    .mv_nr = 2,    .mv_vw = 4,       .mv_wg = 16,
      .mv_mt = 2,      .mv_qg = 1,   .norm_wg = 16, .att_wg = 8,      .att_g = 0,
      .att_split = 16, .att_occ = 0, .att_bq = 4,   .att_bk = 8,      .att_tpr = 2,
      .att_pf_min = 4, .rope_wg = 8, .dot = -1,     .mq_nr = 2,       .mm_tile_min = 4,
      .mm_bn = 8,      .mm_tr = 2,   .ew_wg = 16,   .clblast_min = 0, .clblast_scratch = 16 * MiB}},
    /* PoCL on CPUs: one work-item per group of rows, explicit vectors in the
     * inner loop (LLVM turns them into AVX/AVX-512), few barriers; one
     * work-item per (token, head) in attention; q8_0 scales converted 8
     * blocks at a time (+27% matrix-vector). CLBlast's untuned kernels run
     * at 6-10 GFLOP/s here against our 45-80 at every token count the
     * benchmark sweeps, 4 to 128 (bench/results/opencl-pocl-xeon-2c.json):
     * never. Attention always takes the flash-decoding kernel (one
     * work-item per split, rows in vector registers): the local-memory
     * prefill tiles, built for GPUs, ran a 128-token prompt of the 125m
     * model 4-5x slower here (one bench_decode run with DUET_PROFILE=1,
     * not kept in bench/results). q8 x q8
     * matvec: 4 rows per work-item amortise the activation scales. No
     * cl_khr_integer_dot_product in PoCL 3.1: the portable int8 code,
     * compute-bound once weights are reused across tokens: batches of 64
     * tokens or more (prompt chunks; speculative batches and a few
     * concurrent decodes stay below, on the int8 path) dequantise the
     * activations and take the f32-activation kernel: 1.4-1.45x the 125m
     * prefill of a 256-token prompt (bench/results/opencl-pocl-q8-prefill-
     * xeon-2c.json). */
    {NULL,
     "Portable Computing Language",
     NULL,
     DUET_DEVICE_CPU,
     {"pocl-cpu",        .mv_r = 1,
      .mv_nr = 2,        .mv_vw = 16,
      .mv_wg = 8,        .mv_mt = 4,
      .mv_qg = 8,        .norm_wg = 16,
      .att_wg = 1,       .att_g = 64,
      .att_split = 1024, .att_occ = 2,
      .att_bq = 16,      .att_bk = 16,
      .att_tpr = 1,      .att_pf_min = 0,
      .rope_wg = 1,      .dot = -1,
      .mq_nr = 4,        .mm_tile_min = 0,
      .q8_f32_min = 64,  .mm_bn = 32,
      .mm_tr = 4,        .ew_wg = 0,
      .clblast_min = 0,  .clblast_scratch = 64 * MiB}},
    {NULL,
     NULL,
     "NVIDIA",
     DUET_DEVICE_DISCRETE_GPU,
     {"nvidia-gpu",     .mv_r = 32,    .mv_nr = 2,     .mv_vw = 4,        .mv_wg = 128,
      .mv_mt = 4,       .mv_qg = 1,    .norm_wg = 256, .att_wg = 64,      .att_g = 0,
      .att_split = 512, .att_occ = 4,  .att_bq = 32,   .att_bk = 32,      .att_tpr = 4,
      .att_pf_min = 8,  .rope_wg = 64, .dot = -1,      .mq_nr = 2,        .mm_tile_min = 16,
      .mm_bn = 64,      .mm_tr = 4,    .ew_wg = 256,   .clblast_min = 16, .clblast_scratch = 256 * MiB}},
    {NULL,
     NULL,
     "AMD",
     DUET_DEVICE_DISCRETE_GPU,
     {"amd-gpu",        .mv_r = 64,    .mv_nr = 2,     .mv_vw = 4,        .mv_wg = 256,
      .mv_mt = 4,       .mv_qg = 1,    .norm_wg = 256, .att_wg = 64,      .att_g = 0,
      .att_split = 512, .att_occ = 4,  .att_bq = 32,   .att_bk = 32,      .att_tpr = 4,
      .att_pf_min = 8,  .rope_wg = 64, .dot = -1,      .mq_nr = 2,        .mm_tile_min = 16,
      .mm_bn = 64,      .mm_tr = 4,    .ew_wg = 256,   .clblast_min = 16, .clblast_scratch = 256 * MiB}},
    {NULL,
     NULL,
     "Intel",
     DUET_DEVICE_INTEGRATED_GPU,
     {"intel-igpu",     .mv_r = 16,    .mv_nr = 2,     .mv_vw = 4,        .mv_wg = 64,
      .mv_mt = 4,       .mv_qg = 1,    .norm_wg = 128, .att_wg = 32,      .att_g = 0,
      .att_split = 256, .att_occ = 4,  .att_bq = 16,   .att_bk = 16,      .att_tpr = 4,
      .att_pf_min = 8,  .rope_wg = 32, .dot = -1,      .mq_nr = 2,        .mm_tile_min = 16,
      .mm_bn = 32,      .mm_tr = 4,    .ew_wg = 128,   .clblast_min = 16, .clblast_scratch = 64 * MiB}},
    /* Any other CPU runtime (Intel's, Arm's). */
    {NULL,
     NULL,
     NULL,
     DUET_DEVICE_CPU,
     {"cpu",
      .mv_r = 1,
      .mv_nr = 2,
      .mv_vw = 16,
      .mv_wg = 8,
      .mv_mt = 4,
      .mv_qg = 8,
      .norm_wg = 16,
      .att_wg = 1,
      .att_g = 64,
      .att_split = 1024,
      .att_occ = 2,
      .att_bq = 16,
      .att_bk = 16,
      .att_tpr = 1,
      .att_pf_min = 0,
      .rope_wg = 1,
      .dot = -1,
      .mq_nr = 4,
      .mm_tile_min = 0,
      .mm_bn = 32,
      .mm_tr = 4,
      .ew_wg = 0,
      .clblast_min = 0,
      .clblast_scratch = 64 * MiB}},
    /* Any other GPU or accelerator. */
    {NULL,
     NULL,
     NULL,
     -1,
     {"default",        .mv_r = 32,    .mv_nr = 2,     .mv_vw = 4,        .mv_wg = 64,
      .mv_mt = 2,       .mv_qg = 1,    .norm_wg = 128, .att_wg = 32,      .att_g = 0,
      .att_split = 256, .att_occ = 4,  .att_bq = 16,   .att_bk = 16,      .att_tpr = 4,
      .att_pf_min = 8,  .rope_wg = 32, .dot = -1,      .mq_nr = 2,        .mm_tile_min = 16,
      .mm_bn = 32,      .mm_tr = 4,    .ew_wg = 128,   .clblast_min = 32, .clblast_scratch = 64 * MiB}},
};

static bool entry_matches(const tune_entry *e, const ocl_device *d) {
    if (e->device && !strstr(d->info.name, e->device)) return false;
    if (e->platform && !strstr(d->platform_name, e->platform)) return false;
    if (e->vendor && strcmp(d->info.vendor, e->vendor) != 0) return false;
    if (e->type >= 0 && (int)d->info.type != e->type) return false;
    return true;
}

static bool pow2(int v) {
    return v > 0 && (v & (v - 1)) == 0;
}

/* Checks the knobs against each other and the device's limits. */
static duet_status check(const ocl_tuning *t, const ocl_device *d) {
    const char *bad = NULL;
    if (!pow2(t->mv_r))
        bad = "mv_r must be a power of two";
    else if (t->mv_nr != 1 && t->mv_nr != 2 && t->mv_nr != 4)
        bad = "mv_nr must be 1, 2 or 4";
    else if (t->mv_vw != 4 && t->mv_vw != 8 && t->mv_vw != 16)
        bad = "mv_vw must be 4, 8 or 16";
    else if (t->mv_wg < t->mv_r || t->mv_wg % t->mv_r)
        bad = "mv_wg must be a multiple of mv_r";
    else if (t->mv_mt < 1 || t->mv_mt > 8)
        bad = "mv_mt must be 1..8";
    else if (t->mv_qg != 1 && t->mv_qg != 8)
        bad = "mv_qg must be 1 or 8";
    else if (!pow2(t->norm_wg))
        bad = "norm_wg must be a power of two";
    else if (!pow2(t->att_wg))
        bad = "att_wg must be a power of two";
    else if (t->att_split < t->att_wg || t->att_split % t->att_wg || t->att_split > 16384)
        bad = "att_split must be a multiple of att_wg, at most 16384";
    else if (t->att_g < 0 || t->att_g > 64)
        bad = "att_g must be 0..64";
    else if (t->att_occ < 0 || t->att_occ > 64)
        bad = "att_occ must be 0..64";
    else if (t->att_bq < 1 || t->att_bq > 128 || t->att_bk < 1 || t->att_bk > 128)
        bad = "att_bq and att_bk must be 1..128";
    else if (!pow2(t->att_tpr) || t->att_bk % t->att_tpr)
        bad = "att_tpr must be a power of two dividing att_bk";
    else if (t->att_pf_min < 0)
        bad = "att_pf_min must be >= 0";
    else if (t->att_mode < 0 || t->att_mode > 2)
        bad = "att_mode must be 0, 1 or 2";
    else if (!pow2(t->rope_wg))
        bad = "rope_wg must be a power of two";
    else if (t->dot < -1 || t->dot > 2)
        bad = "dot must be 0, 1 or 2";
    else if (t->dot == 1 && !d->int_dot)
        bad = "dot=1 needs cl_khr_integer_dot_product, which this device lacks";
    else if (t->mq_nr != 1 && t->mq_nr != 2 && t->mq_nr != 4 && t->mq_nr != 8)
        bad = "mq_nr must be 1, 2, 4 or 8";
    else if (t->mm_tile_min < 0)
        bad = "mm_tile_min must be >= 0";
    else if (t->q8_f32_min < 0)
        bad = "q8_f32_min must be >= 0";
    else if (t->mm_tr < 1 || t->mm_tr > 8 || t->mm_bn % t->mm_tr || t->mm_bn > 128)
        bad = "mm_bn must be a multiple of mm_tr (1..8), at most 128";
    else if (t->ew_wg < 0)
        bad = "ew_wg must be >= 0";
    else if (t->clblast_min < 0)
        bad = "clblast_min must be >= 0";
    else if (t->clblast_scratch < MiB)
        bad = "clblast_scratch must be at least 1 MiB";
    else if ((size_t)t->mv_wg > d->max_wg || (size_t)t->norm_wg > d->max_wg ||
             (size_t)t->att_wg > d->max_wg || (size_t)t->ew_wg > d->max_wg ||
             (size_t)t->rope_wg > d->max_wg || (size_t)(t->att_bq * t->att_tpr) > d->max_wg ||
             (size_t)(t->mm_bn / t->mm_tr) * (size_t)(t->mm_bn / t->mm_tr) > d->max_wg)
        bad = "a work-group size exceeds the device's maximum";
    if (bad)
        return duet__error(DUET_INVALID_ARGUMENT, "opencl tuning '%s': %s (device allows %zu work-items)",
                           t->entry, bad, d->max_wg);
    return DUET_OK;
}

/* Applies "key=value,key=value" on top of *t. */
static duet_status apply_overrides(ocl_tuning *t, const char *spec) {
    char buf[512];
    snprintf(buf, sizeof buf, "%s", spec);
    char *save = NULL;
    for (char *kv = strtok_r(buf, ",", &save); kv; kv = strtok_r(NULL, ",", &save)) {
        char *eq = strchr(kv, '=');
        char *end = NULL;
        long v = eq ? strtol(eq + 1, &end, 10) : 0;
        if (!eq || end == eq + 1 || *end || v < 0 || v > (1L << 30))
            return duet__error(DUET_INVALID_ARGUMENT, "DUET_OPENCL_TUNE: '%s' is not key=number", kv);
        *eq = 0;
        if (!strcmp(kv, "mv_r"))
            t->mv_r = (int)v;
        else if (!strcmp(kv, "mv_nr"))
            t->mv_nr = (int)v;
        else if (!strcmp(kv, "mv_vw"))
            t->mv_vw = (int)v;
        else if (!strcmp(kv, "mv_wg"))
            t->mv_wg = (int)v;
        else if (!strcmp(kv, "mv_mt"))
            t->mv_mt = (int)v;
        else if (!strcmp(kv, "mv_qg"))
            t->mv_qg = (int)v;
        else if (!strcmp(kv, "norm_wg"))
            t->norm_wg = (int)v;
        else if (!strcmp(kv, "att_wg"))
            t->att_wg = (int)v;
        else if (!strcmp(kv, "att_g"))
            t->att_g = (int)v;
        else if (!strcmp(kv, "att_split"))
            t->att_split = (int)v;
        else if (!strcmp(kv, "att_occ"))
            t->att_occ = (int)v;
        else if (!strcmp(kv, "att_bq"))
            t->att_bq = (int)v;
        else if (!strcmp(kv, "att_bk"))
            t->att_bk = (int)v;
        else if (!strcmp(kv, "att_tpr"))
            t->att_tpr = (int)v;
        else if (!strcmp(kv, "att_pf_min"))
            t->att_pf_min = (int)v;
        else if (!strcmp(kv, "att_mode"))
            t->att_mode = (int)v;
        else if (!strcmp(kv, "rope_wg"))
            t->rope_wg = (int)v;
        else if (!strcmp(kv, "dot"))
            t->dot = (int)v;
        else if (!strcmp(kv, "mq_nr"))
            t->mq_nr = (int)v;
        else if (!strcmp(kv, "mm_tile_min"))
            t->mm_tile_min = (int)v;
        else if (!strcmp(kv, "q8_f32_min"))
            t->q8_f32_min = (int)v;
        else if (!strcmp(kv, "mm_bn"))
            t->mm_bn = (int)v;
        else if (!strcmp(kv, "mm_tr"))
            t->mm_tr = (int)v;
        else if (!strcmp(kv, "ew_wg"))
            t->ew_wg = (int)v;
        else if (!strcmp(kv, "clblast_min"))
            t->clblast_min = (int)v;
        else if (!strcmp(kv, "clblast_scratch_mb"))
            t->clblast_scratch = (size_t)v * MiB;
        else
            return duet__error(
                DUET_INVALID_ARGUMENT,
                "DUET_OPENCL_TUNE: unknown knob '%s' (have mv_r, mv_nr, mv_vw, mv_wg, mv_mt, mv_qg, "
                "norm_wg, att_wg, att_g, att_split, att_occ, att_bq, att_bk, att_tpr, att_pf_min, att_mode, "
                "rope_wg, dot, mq_nr, mm_tile_min, q8_f32_min, mm_bn, mm_tr, ew_wg, clblast_min, "
                "clblast_scratch_mb)",
                kv);
    }
    size_t n = strlen(t->entry);
    snprintf(t->entry + n, sizeof t->entry - n, "+env");
    return DUET_OK;
}

duet_status duet__ocl_tuning_for(const ocl_device *dev, ocl_tuning *out) {
    const int n = (int)(sizeof tune_table / sizeof tune_table[0]);
    *out = tune_table[n - 1].t;
    for (int i = 0; i < n; i++)
        if (entry_matches(&tune_table[i], dev)) {
            *out = tune_table[i].t;
            break;
        }
    const char *env = getenv("DUET_OPENCL_TUNE");
    if (env && *env) {
        duet_status st = apply_overrides(out, env);
        if (st != DUET_OK) return st;
    }
    return check(out, dev);
}
