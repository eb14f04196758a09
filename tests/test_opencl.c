/* test_opencl.c — what is OpenCL-specific: the program binary cache, the
 * build log on a compile failure, the $DUET_KERNEL_DIR override, the
 * tuning override, CLBlast and the GPU-style kernel paths forced on a CPU
 * device, profiling, "unavailable" without an ICD, and every kernel under
 * oclgrind (invalid memory accesses, uninitialised reads, data races).
 *
 * The op parity itself lives in test_backend_ops (shared with Vulkan); the
 * oclgrind and forced-path tests rerun that binary with a different
 * environment. Tests that need an OpenCL device skip when there is none,
 * unless DUET_REQUIRE_BACKENDS names opencl (CI). */
#include <errno.h>
#include <math.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include "../backends/opencl/ocl_internal.h"
#include "backend_ops_cases.h"
#include "test_util.h"

/* Leaks inside the OpenCL drivers and their compilers are theirs. */
const char *__lsan_default_suppressions(void) {
    return "leak:libpocl\nleak:libLLVM\nleak:libOpenCL\nleak:libclblast\nleak:liboclgrind\n";
}

static bool required(void) {
    const char *r = getenv("DUET_REQUIRE_BACKENDS");
    return r && strstr(r, "opencl");
}

/* True when an OpenCL device is there; otherwise prints SKIP (and fails
 * when opencl is required). */
static bool have_device(void) {
    char why[256] = "";
    if (duet_opencl_backend_iface.available(why, sizeof why)) return true;
    printf("SKIP opencl: %s\n", why);
    ck_assert_msg(!required(), "opencl is required (DUET_REQUIRE_BACKENDS) but unavailable: %s", why);
    return false;
}

static char *make_temp_dir(void) {
    static char dirs[8][64];
    static int n;
    char *d = dirs[n++ & 7];
    snprintf(d, 64, "/tmp/duet-ocl-test-XXXXXX");
    ck_assert_msg(mkdtemp(d) != NULL, "mkdtemp: %s", strerror(errno));
    return d;
}

/* Removes one of our mkdtemp directories. */
static void remove_tree(const char *dir) {
    char cmd[256];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir);
}

static int count_files(const char *dir, const char *suffix) {
    char cmd[512];
    snprintf(cmd, sizeof cmd, "ls %s 2>/dev/null | grep -c '%s$'", dir, suffix);
    FILE *p = popen(cmd, "r");
    int n = 0;
    if (p && fscanf(p, "%d", &n) != 1) n = 0;
    if (p) pclose(p);
    return n;
}

/* Runs one small rmsnorm through `be` and returns its first output. */
static float run_rmsnorm(duet_backend *be, duet_status *st_out) {
    float x[40], w[40], y[40] = {0};
    for (int i = 0; i < 40; i++)
        x[i] = (float)i - 20.0f, w[i] = 1.0f + (float)i / 40;
    duet_buffer *bx, *bw, *by;
    ck_assert_int_eq(duet_buffer_alloc(be, sizeof x, &bx), DUET_OK);
    ck_assert_int_eq(duet_buffer_alloc(be, sizeof w, &bw), DUET_OK);
    ck_assert_int_eq(duet_buffer_alloc(be, sizeof y, &by), DUET_OK);
    ck_assert_int_eq(duet_buffer_upload(be, bx, 0, x, sizeof x), DUET_OK);
    ck_assert_int_eq(duet_buffer_upload(be, bw, 0, w, sizeof w), DUET_OK);
    duet_op op = {.kind = DUET_OP_RMSNORM, .n_tokens = 1};
    op.rmsnorm.x = (duet_view){bx, 0};
    op.rmsnorm.w = (duet_view){bw, 0};
    op.rmsnorm.out = (duet_view){by, 0};
    op.rmsnorm.dim = 40;
    op.rmsnorm.eps = 1e-5f;
    duet_status st = duet_step_begin(be);
    if (st == DUET_OK) st = duet_step_op(be, &op);
    duet_step_submit(be);
    duet_step_wait(be);
    if (st == DUET_OK) st = duet_buffer_download(be, by, 0, y, sizeof y);
    duet_buffer_free(be, bx);
    duet_buffer_free(be, bw);
    duet_buffer_free(be, by);
    *st_out = st;
    return y[0];
}

static ocl_backend *open_ocl(void) {
    duet_backend *be;
    ck_assert_msg(duet_backend_open("opencl", 0, NULL, &be) == DUET_OK, "open: %s", duet_last_error());
    return (ocl_backend *)be;
}

/* ---- device info -------------------------------------------------------------- */

START_TEST(test_device_info) {
    if (!have_device()) return;
    ck_assert_int_gt(duet_opencl_backend_iface.device_count(), 0);
    duet_device_info info;
    ck_assert_int_eq(duet_opencl_backend_iface.device_info(0, &info), DUET_OK);
    ck_assert_msg(info.name[0] && info.vendor[0] && info.driver[0], "empty name/vendor/driver");
    ck_assert_msg(info.memory_bytes > 0 && info.compute_units > 0, "memory %llu, units %d",
                  (unsigned long long)info.memory_bytes, info.compute_units);
    ck_assert_msg(strstr(info.features, "local memory") != NULL, "features: %s", info.features);
    ck_assert_int_eq(duet_opencl_backend_iface.device_info(999, &info), DUET_NO_DEVICE);
    const ocl_device *list;
    int n;
    ck_assert(duet__ocl_devices(&list, &n, NULL, 0));
    for (int i = 0; i < n; i++)
        if (strstr(list[i].platform_name, "Portable Computing Language") &&
            list[i].info.type == DUET_DEVICE_CPU) {
            /* PoCL 3.1 (CI): no half arithmetic, no subgroups, no integer dot products. */
            ck_assert_msg(!list[i].info.fp16 && !list[i].subgroups && !list[i].info.int8_dot,
                          "PoCL reports fp16 %d subgroups %d int dot %d", list[i].info.fp16,
                          list[i].subgroups, list[i].info.int8_dot);
            ocl_tuning t;
            unsetenv("DUET_OPENCL_TUNE");
            ck_assert_int_eq(duet__ocl_tuning_for(&list[i], &t), DUET_OK);
            ck_assert_str_eq(t.entry, "pocl-cpu");
        }
}
END_TEST

/* ---- no ICD: unavailable with a reason, the cpu backend still works ------------------ */

START_TEST(test_no_platform) {
    /* Enumeration happens once per process: look from a fresh child. */
    char *empty = make_temp_dir();
    int fd[2];
    ck_assert_int_eq(pipe(fd), 0);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        close(fd[0]);
        setenv("OCL_ICD_VENDORS", empty, 1); /* ocl-icd: no vendor files here */
        setenv("OCL_ICD_FILENAMES", "", 1);
        char why[256] = "";
        bool ok = duet_opencl_backend_iface.available(why, sizeof why);
        duet_backend *be = NULL;
        duet_status st = duet_backend_open("opencl", 0, NULL, &be);
        char msg[512];
        snprintf(msg, sizeof msg, "%d|%s|%d|%s", ok, why, (int)st, duet_last_error());
        duet_backend *cpu = NULL;
        duet_status cst = duet_backend_open("auto", -1, &(duet_backend_params){.n_threads = 1}, &cpu);
        size_t len = strlen(msg);
        snprintf(msg + len, sizeof msg - len, "|%d|%s", (int)cst, cpu ? cpu->iface->name : "none");
        if (write(fd[1], msg, strlen(msg) + 1) < 0) _exit(2);
        _exit(0);
    }
    close(fd[1]);
    char buf[512] = "";
    ssize_t got = read(fd[0], buf, sizeof buf - 1);
    close(fd[0]);
    int status;
    waitpid(pid, &status, 0);
    remove_tree(empty);
    ck_assert_msg(got > 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0, "child failed");
    int ok = -1, st = 0, cst = -1;
    char why[256] = "", err[256] = "", name[32] = "";
    sscanf(buf, "%d|%255[^|]|%d|%255[^|]|%d|%31s", &ok, why, &st, err, &cst, name);
    ck_assert_msg(ok == 0, "available() said yes without an ICD: %s", buf);
    ck_assert_msg(strstr(why, "no OpenCL platform") != NULL, "reason: '%s'", why);
    ck_assert_msg(st == DUET_NO_DEVICE && strstr(err, "unavailable"), "open: %d %s", st, err);
    ck_assert_msg(cst == DUET_OK && strcmp(name, "opencl") != 0, "auto without OpenCL: %d %s", cst, name);
}
END_TEST

/* ---- program binary cache ---------------------------------------------------------- */

START_TEST(test_program_cache) {
    if (!have_device()) return;
    char *dir = make_temp_dir();
    setenv("DUET_OPENCL_CACHE_DIR", dir, 1);
    unsetenv("DUET_KERNEL_DIR");
    duet_status st;

    /* Left to itself, the cache is off on a driver that keeps its own
     * (PoCL) and on elsewhere; DUET_OPENCL_CACHE=1 forces it on. */
    ocl_backend *d = open_ocl();
    const bool own = d->dev->own_kernel_cache;
    ck_assert_msg(own == (strstr(d->dev->platform_name, "Portable Computing Language") != NULL),
                  "own kernel cache %d on %s", own, d->dev->platform_name);
    run_rmsnorm(&d->base, &st);
    ck_assert_msg(st == DUET_OK, "run: %s", duet_last_error());
    ck_assert_int_eq(d->stats.programs_cache_saved, own ? 0 : 1);
    duet_backend_close(&d->base);
    ck_assert_int_eq(count_files(dir, ".bin"), own ? 0 : 1);
    if (!own) { /* start the checks below from an empty cache */
        char rm[256];
        snprintf(rm, sizeof rm, "rm -f %s/*.bin", dir);
        ck_assert_int_eq(system(rm), 0);
    }
    setenv("DUET_OPENCL_CACHE", "1", 1);

    ocl_backend *a = open_ocl();
    float ya = run_rmsnorm(&a->base, &st);
    ck_assert_msg(st == DUET_OK, "run: %s", duet_last_error());
    ck_assert_int_eq(a->stats.programs_built, 1);
    ck_assert_int_eq(a->stats.programs_cached, 0);
    ck_assert_int_eq(a->stats.programs_cache_saved, 1);
    duet_backend_close(&a->base);
    ck_assert_int_eq(count_files(dir, ".bin"), 1);

    /* A second instance loads the binary instead of compiling. */
    ocl_backend *b = open_ocl();
    float yb = run_rmsnorm(&b->base, &st);
    ck_assert_msg(st == DUET_OK, "run: %s", duet_last_error());
    ck_assert_int_eq(b->stats.programs_built, 0);
    ck_assert_int_eq(b->stats.programs_cached, 1);
    ck_assert_msg(ya == yb, "cached program gave %g, compiled %g", (double)yb, (double)ya);
    duet_backend_close(&b->base);

    /* A corrupt cache file is rebuilt from source and replaced. */
    char cmd[256];
    snprintf(cmd, sizeof cmd, "for f in %s/*.bin; do echo garbage > $f; done", dir);
    ck_assert_int_eq(system(cmd), 0);
    ocl_backend *c = open_ocl();
    float yc = run_rmsnorm(&c->base, &st);
    ck_assert_msg(st == DUET_OK, "run after corruption: %s", duet_last_error());
    ck_assert_int_eq(c->stats.programs_built, 1);
    ck_assert_msg(ya == yc, "rebuilt program gave %g", (double)yc);
    duet_backend_close(&c->base);

    /* DUET_OPENCL_CACHE=0 turns the cache off. */
    setenv("DUET_OPENCL_CACHE", "0", 1);
    char path[256];
    duet__ocl_cache_dir(path, sizeof path);
    ck_assert_str_eq(path, "");
    ocl_backend *e = open_ocl();
    ck_assert(!duet__ocl_use_cache(e->dev));
    duet_backend_close(&e->base);
    unsetenv("DUET_OPENCL_CACHE");
    unsetenv("DUET_OPENCL_CACHE_DIR");
    remove_tree(dir);
}
END_TEST

/* ---- DUET_KERNEL_DIR and the build log ------------------------------------------------ */

START_TEST(test_kernel_dir_and_build_log) {
    if (!have_device()) return;
    char *dir = make_temp_dir();
    setenv("DUET_OPENCL_CACHE", "0", 1);
    char cmd[512];
    snprintf(cmd, sizeof cmd, "cp %s/kernels/*.cl %s/", DUET_SOURCE_DIR, dir);
    ck_assert_int_eq(system(cmd), 0);
    setenv("DUET_KERNEL_DIR", dir, 1);

    /* The sources on disk are used: an intact copy works... */
    ocl_backend *a = open_ocl();
    duet_status st;
    run_rmsnorm(&a->base, &st);
    ck_assert_msg(st == DUET_OK, "kernels from DUET_KERNEL_DIR: %s", duet_last_error());
    duet_backend_close(&a->base);

    /* ...and a broken one fails with DUET_COMPILE and the compiler's log. */
    snprintf(cmd, sizeof cmd, "echo 'kernel void broken( { this is not OpenCL C }' >> %s/rmsnorm.cl", dir);
    ck_assert_int_eq(system(cmd), 0);
    ocl_backend *b = open_ocl();
    run_rmsnorm(&b->base, &st);
    const char *err = duet_last_error();
    ck_assert_msg(st == DUET_COMPILE, "broken kernel gave %s: %s", duet_status_name(st), err);
    ck_assert_msg(strstr(err, "rmsnorm.cl") && strstr(err, "build log") && strstr(err, "error"),
                  "message lacks the file or the log: %s", err);
    duet_backend_close(&b->base);

    /* A directory without the file is an I/O error naming the path. */
    snprintf(cmd, sizeof cmd, "rm %s/rmsnorm.cl", dir);
    ck_assert_int_eq(system(cmd), 0);
    ocl_backend *c = open_ocl();
    run_rmsnorm(&c->base, &st);
    ck_assert_msg(st == DUET_IO && strstr(duet_last_error(), "rmsnorm.cl"), "missing file gave %s: %s",
                  duet_status_name(st), duet_last_error());
    duet_backend_close(&c->base);
    unsetenv("DUET_KERNEL_DIR");
    unsetenv("DUET_OPENCL_CACHE");
    remove_tree(dir);
}
END_TEST

/* ---- feature paths: fp16 / subgroup code, and the fallback when it can't build ---- */

START_TEST(test_feature_fallback) {
    if (!have_device()) return;
    const ocl_device *list;
    int n;
    ck_assert(duet__ocl_devices(&list, &n, NULL, 0));
    setenv("DUET_OPENCL_CACHE", "0", 1);
    /* Claim half arithmetic and subgroups: a device without them (PoCL)
     * fails to compile that code, and the backend must fall back to the
     * portable kernels and still compute the same result. */
    setenv("DUET_OPENCL_FEATURES", "fp16,subgroups,fp64", 1);
    ocl_backend *be = open_ocl();
    unsetenv("DUET_OPENCL_FEATURES");
    ck_assert_msg(strstr(be->dev_options, "HAVE_FP16") && strstr(be->dev_options, "HAVE_SUBGROUPS"),
                  "options: %s", be->dev_options);
    duet_status st;
    float y = run_rmsnorm(&be->base, &st);
    ck_assert_msg(st == DUET_OK, "rmsnorm with claimed features: %s", duet_last_error());
    if (!list[0].fp16 || !list[0].subgroups) {
        ck_assert_int_eq(be->stats.feature_fallbacks, 1);
        ck_assert_msg(!strstr(be->dev_options, "HAVE_FP16") && strstr(be->dev_options, "HAVE_FP64"),
                      "after fallback: %s", be->dev_options);
    }
    duet_backend_close(&be->base);
    ocl_backend *plain = open_ocl();
    float y0 = run_rmsnorm(&plain->base, &st);
    ck_assert_int_eq(plain->stats.feature_fallbacks, 0);
    duet_backend_close(&plain->base);
    ck_assert_msg(y == y0, "fallback gave %g, plain %g", (double)y, (double)y0);
    unsetenv("DUET_OPENCL_CACHE");
}
END_TEST

/* ---- tuning overrides -------------------------------------------------------------------- */

START_TEST(test_tuning_override) {
    if (!have_device()) return;
    duet_backend *be;
    setenv("DUET_OPENCL_TUNE", "mv_r=3", 1);
    ck_assert_int_eq(duet_backend_open("opencl", 0, NULL, &be), DUET_INVALID_ARGUMENT);
    ck_assert_msg(strstr(duet_last_error(), "power of two"), "%s", duet_last_error());
    setenv("DUET_OPENCL_TUNE", "no_such_knob=1", 1);
    ck_assert_int_eq(duet_backend_open("opencl", 0, NULL, &be), DUET_INVALID_ARGUMENT);
    ck_assert_msg(strstr(duet_last_error(), "unknown knob"), "%s", duet_last_error());
    setenv("DUET_OPENCL_TUNE", "mv_wg=4,mv_r=8", 1);
    ck_assert_int_eq(duet_backend_open("opencl", 0, NULL, &be), DUET_INVALID_ARGUMENT);
    /* dot=1 demands the extension; a device without it refuses to open. */
    duet_device_info info;
    ck_assert_int_eq(duet_opencl_backend_iface.device_info(0, &info), DUET_OK);
    setenv("DUET_OPENCL_TUNE", "dot=1", 1);
    duet_status dst = duet_backend_open("opencl", 0, NULL, &be);
    if (info.int8_dot) {
        ck_assert_msg(dst == DUET_OK, "dot=1 on a device with the extension: %s", duet_last_error());
        ck_assert_int_ne(((ocl_backend *)be)->int_dot, 0);
        duet_backend_close(be);
    } else {
        ck_assert_int_eq(dst, DUET_INVALID_ARGUMENT);
        ck_assert_msg(strstr(duet_last_error(), "cl_khr_integer_dot_product"), "%s", duet_last_error());
    }
    setenv("DUET_OPENCL_TUNE", "mv_r=16,mv_wg=32,clblast_min=7", 1);
    ck_assert_msg(duet_backend_open("opencl", 0, NULL, &be) == DUET_OK, "%s", duet_last_error());
    ocl_backend *o = (ocl_backend *)be;
    ck_assert_int_eq(o->tune.mv_r, 16);
    ck_assert_int_eq(o->tune.clblast_min, 7);
    ck_assert_msg(strstr(o->tune.entry, "+env"), "entry %s", o->tune.entry);
    duet_op op = {.kind = DUET_OP_MATMUL, .n_tokens = 7};
    op.matmul.dtype = DUET_DTYPE_F16;
    ck_assert_str_eq(duet__ocl_matmul_path(o, &op), "clblast");
    op.n_tokens = 6;
    ck_assert_str_eq(duet__ocl_matmul_path(o, &op), "matvec");
    op.n_tokens = 100;
    op.matmul.dtype = DUET_DTYPE_Q8_0; /* Q8_0 is always ours */
    ck_assert_str_eq(duet__ocl_matmul_path(o, &op), "matvec");
    duet_backend_close(be);
    unsetenv("DUET_OPENCL_TUNE");
}
END_TEST

/* ---- CLBlast really runs (and matches the cpu) when forced ----------------------------------- */

START_TEST(test_clblast_path) {
    if (!have_device()) return;
    setenv("DUET_OPENCL_TUNE", "clblast_min=2,clblast_scratch_mb=1", 1);
    duet_backend *cpu;
    ck_assert_int_eq(duet_backend_open("cpu", 0, &(duet_backend_params){.n_threads = 2}, &cpu), DUET_OK);
    ocl_backend *be = open_ocl();
    int ran = 0;
    for (int ci = 0; ci < BO_N_CASES; ci++) {
        const bo_case *c = &bo_cases[ci];
        if (!(c->modes & BO_TEST) || c->kind != DUET_OP_MATMUL || c->n_tokens < 2 ||
            (c->dtype != DUET_DTYPE_F32 && c->dtype != DUET_DTYPE_F16))
            continue;
        bo_host h;
        bo_host_build(ci, &h);
        bo_dev ref, got;
        ck_assert_int_eq(bo_dev_setup(cpu, &h, &ref), DUET_OK);
        ck_assert_int_eq(bo_dev_setup(&be->base, &h, &got), DUET_OK);
        ck_assert_str_eq(duet__ocl_matmul_path(be, &got.op), "clblast");
        int before = be->stats.clblast_calls;
        ck_assert_int_eq(bo_dev_run(&ref, 1), DUET_OK);
        ck_assert_msg(bo_dev_run(&got, 1) == DUET_OK, "clblast: %s", duet_last_error());
        ck_assert_int_eq(be->stats.clblast_calls, before + 1);
        int oi = h.n - 1; /* out is the last operand */
        uint8_t *a = bo_dev_image(&ref, &h, oi), *b = bo_dev_image(&got, &h, oi);
        const float *fa = (const float *)(a + BO_GUARD), *fb = (const float *)(b + BO_GUARD);
        double err = 0, norm = 0;
        for (size_t i = 0; i < h.ops[oi].bytes / 4; i++)
            err += (fa[i] - fb[i]) * (double)(fa[i] - fb[i]), norm += (double)fa[i] * fa[i];
        char label[160];
        bo_case_label(c, label, sizeof label);
        ck_assert_msg(err / norm < 1e-7, "%s via CLBlast: NMSE %g", label, err / norm);
        for (int g = 0; g < BO_GUARD; g++)
            ck_assert_msg(b[g] == BO_GUARD_BYTE && b[BO_GUARD + h.ops[oi].bytes + g] == BO_GUARD_BYTE,
                          "%s via CLBlast: guard overwritten", label);
        free(a);
        free(b);
        bo_dev_free(&ref);
        bo_dev_free(&got);
        bo_host_free(&h);
        ran++;
    }
    ck_assert_int_ge(ran, 4);
    duet_backend_close(&be->base);
    duet_backend_close(cpu);
    unsetenv("DUET_OPENCL_TUNE");
}
END_TEST

/* ---- profiling -------------------------------------------------------------------------------- */

START_TEST(test_profiling) {
    if (!have_device()) return;
    setenv("DUET_PROFILE", "1", 1);
    ocl_backend *be = open_ocl();
    unsetenv("DUET_PROFILE");
    duet_status st;
    run_rmsnorm(&be->base, &st);
    run_rmsnorm(&be->base, &st);
    ck_assert_int_eq(st, DUET_OK);
    double ms[OCL_PROF_KINDS];
    long count[OCL_PROF_KINDS];
    duet__ocl_profile(be, ms, count);
    ck_assert_int_eq(count[DUET_OP_RMSNORM], 2);
    ck_assert_msg(ms[DUET_OP_RMSNORM] > 0, "no device time recorded");
    ck_assert_int_eq(count[DUET_OP_MATMUL], 0);
    duet_backend_close(&be->base);
}
END_TEST

/* ---- kernel checks against host references -------------------------------------------
 *
 * Paged attention, rope_kv into paged pools, the fused q8_0 outputs and the
 * q8 x q8 matmul, each under several tunings that force every kernel path
 * (decode splits with one or many work-items, the prefill tiles, the int8
 * dot product variants, the tiled GEMM). The references are computed here
 * in double from the same inputs, so these run without the cpu backend.
 * $DUET_OCL_TEST_SMALL shrinks the shapes (the oclgrind rerun). */

static bool small_mode(void) {
    const char *e = getenv("DUET_OCL_TEST_SMALL");
    return e && *e && strcmp(e, "0") != 0;
}

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static float frand(void) { /* uniform in [-1, 1) */
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (float)((rng >> 40) & 0xffffff) / (float)(1 << 23) - 1.0f;
}

/* Opens the opencl backend with DUET_OPENCL_TUNE=tune ("" = the table's). */
static duet_backend *open_tuned(const char *tune) {
    if (tune && *tune)
        setenv("DUET_OPENCL_TUNE", tune, 1);
    else
        unsetenv("DUET_OPENCL_TUNE");
    duet_backend *be = NULL;
    duet_status st = duet_backend_open("opencl", 0, NULL, &be);
    unsetenv("DUET_OPENCL_TUNE");
    ck_assert_msg(st == DUET_OK, "open with tuning '%s': %s", tune, duet_last_error());
    return be;
}

#define GUARD 64 /* bytes checked before and after each output */

/* A device buffer holding `data` (n bytes; zeros when NULL) between two
 * guard zones of 0xA5. */
static duet_buffer *dev_buf(duet_backend *be, const void *data, size_t n) {
    duet_buffer *b;
    ck_assert_int_eq(duet_buffer_alloc(be, n + 2 * GUARD, &b), DUET_OK);
    uint8_t *img = malloc(n + 2 * GUARD);
    memset(img, 0xA5, n + 2 * GUARD);
    if (data)
        memcpy(img + GUARD, data, n);
    else
        memset(img + GUARD, 0, n);
    ck_assert_int_eq(duet_buffer_upload(be, b, 0, img, n + 2 * GUARD), DUET_OK);
    free(img);
    return b;
}

static duet_view dv(duet_buffer *b) {
    return (duet_view){b, GUARD};
}

/* Downloads the n bytes of a dev_buf and checks its guards. */
static void *dev_get(duet_backend *be, duet_buffer *b, size_t n, const char *what) {
    uint8_t *img = malloc(n + 2 * GUARD);
    ck_assert_int_eq(duet_buffer_download(be, b, 0, img, n + 2 * GUARD), DUET_OK);
    for (int i = 0; i < GUARD; i++)
        ck_assert_msg(img[i] == 0xA5 && img[GUARD + n + i] == 0xA5,
                      "%s: guard byte %d of a %zu-byte output overwritten (before: %02x, after: %02x)", what,
                      i, n, img[i], img[GUARD + n + i]);
    void *out = malloc(n ? n : 1);
    memcpy(out, img + GUARD, n);
    free(img);
    return out;
}

static duet_status run_op(duet_backend *be, const duet_op *op) {
    duet_status st = duet_step_begin(be);
    if (st == DUET_OK) st = duet_step_op(be, op);
    duet_status st2 = duet_step_submit(be);
    duet_status st3 = duet_step_wait(be);
    return st ? st : st2 ? st2 : st3;
}

/* Every q8_0 block of `q` against the host quantisation of the f32 values
 * it was made from: same scale (within one fp16 step: 1/d may round
 * differently on the device) and quants within one step. */
static void check_q8_of(const duet_block_q8_0 *q, const float *x, int64_t n, const char *what) {
    duet_block_q8_0 *ref = malloc((size_t)(n / 32) * sizeof *ref);
    duet_quantize_row_q8_0(x, ref, n);
    for (int64_t b = 0; b < n / 32; b++) {
        ck_assert_msg(abs((int)q[b].d - (int)ref[b].d) <= 1, "%s: block %lld scale %04x, host %04x", what,
                      (long long)b, q[b].d, ref[b].d);
        for (int j = 0; j < 32; j++)
            ck_assert_msg(abs(q[b].qs[j] - ref[b].qs[j]) <= 1, "%s: block %lld quant %d is %d, host %d", what,
                          (long long)b, j, q[b].qs[j], ref[b].qs[j]);
    }
    free(ref);
}

/* max |got - ref| <= atol + rtol * max |ref|. */
static void check_close(const float *got, const double *ref, int64_t n, double atol, double rtol,
                        const char *what) {
    double mx = 0, worst = 0;
    int64_t wi = 0;
    for (int64_t i = 0; i < n; i++)
        mx = fmax(mx, fabs(ref[i]));
    for (int64_t i = 0; i < n; i++) {
        ck_assert_msg(isfinite(got[i]), "%s: element %lld is %g", what, (long long)i, (double)got[i]);
        double e = fabs(got[i] - ref[i]);
        if (e > worst) worst = e, wi = i;
    }
    ck_assert_msg(worst <= atol + rtol * mx, "%s: element %lld is %.7g, reference %.7g (max |ref| %g)", what,
                  (long long)wi, (double)got[wi], ref[wi], mx);
}

/* ---- paged KV fixtures ---- */

typedef struct paged {
    int n_tokens, n_head, n_head_kv, hd, bs, n_blocks, n_seqs, max_blocks;
    duet_dtype dt;
    int32_t *pos, *seq, *table;
    uint8_t *kpool, *vpool; /* device images */
    float *kf, *vf;         /* the pools as f32 (what the kernels read) */
    size_t row_bytes, pool_bytes;
} paged;

/* A batch of tokens (seq[i], pos[i]) over n_seqs sequences whose blocks are
 * scattered through the pools; table entries past a sequence's blocks hold
 * out-of-range garbage that no kernel may follow. */
static void paged_init(paged *pg, duet_dtype dt, int n_head, int n_head_kv, int hd, int bs, int n_seqs,
                       int n_tokens, const int *seqs, const int *poss) {
    memset(pg, 0, sizeof *pg);
    pg->dt = dt, pg->n_head = n_head, pg->n_head_kv = n_head_kv, pg->hd = hd, pg->bs = bs;
    pg->n_seqs = n_seqs, pg->n_tokens = n_tokens;
    int need[16] = {0}, mb = 1;
    for (int t = 0; t < n_tokens; t++) {
        int nb = poss[t] / bs + 1;
        if (nb > need[seqs[t]]) need[seqs[t]] = nb;
        if (nb > mb) mb = nb;
    }
    pg->max_blocks = mb + 1;
    int total = 0;
    for (int s = 0; s < n_seqs; s++)
        total += need[s];
    pg->n_blocks = total + 3; /* a few blocks nobody owns */
    int *perm = malloc((size_t)pg->n_blocks * sizeof *perm);
    for (int i = 0; i < pg->n_blocks; i++)
        perm[i] = i;
    for (int i = pg->n_blocks - 1; i > 0; i--) {
        int j = (int)((rng = rng * 6364136223846793005ull + 1442695040888963407ull) >> 33) % (i + 1);
        int tmp = perm[i];
        perm[i] = perm[j], perm[j] = tmp;
    }
    pg->table = malloc((size_t)n_seqs * pg->max_blocks * sizeof(int32_t));
    int next = 0;
    for (int s = 0; s < n_seqs; s++)
        for (int b = 0; b < pg->max_blocks; b++)
            pg->table[s * pg->max_blocks + b] = b < need[s] ? perm[next++] : (b % 2 ? 1 << 30 : -7);
    free(perm);
    pg->pos = malloc((size_t)n_tokens * 4);
    pg->seq = malloc((size_t)n_tokens * 4);
    memcpy(pg->pos, poss, (size_t)n_tokens * 4);
    memcpy(pg->seq, seqs, (size_t)n_tokens * 4);
    const int kvw = n_head_kv * hd, rows = pg->n_blocks * bs;
    pg->row_bytes = duet_dtype_row_bytes(dt, kvw);
    pg->pool_bytes = pg->row_bytes * (size_t)rows;
    pg->kpool = malloc(pg->pool_bytes);
    pg->vpool = malloc(pg->pool_bytes);
    pg->kf = malloc((size_t)rows * kvw * 4);
    pg->vf = malloc((size_t)rows * kvw * 4);
    float *tmp = malloc((size_t)kvw * 4);
    for (int r = 0; r < rows; r++)
        for (int kv = 0; kv < 2; kv++) {
            for (int i = 0; i < kvw; i++)
                tmp[i] = frand() * (kv ? 2.0f : 1.0f);
            uint8_t *dst = (kv ? pg->vpool : pg->kpool) + (size_t)r * pg->row_bytes;
            duet_convert_row(dt, tmp, dst, kvw);
            duet_dequantize_row(dt, dst, (kv ? pg->vf : pg->kf) + (size_t)r * kvw, kvw);
        }
    free(tmp);
}

static void paged_free(paged *pg) {
    free(pg->pos), free(pg->seq), free(pg->table), free(pg->kpool), free(pg->vpool), free(pg->kf),
        free(pg->vf);
}

static duet_kv_pages paged_views(const paged *pg, duet_buffer *kp, duet_buffer *vp, duet_buffer *tab) {
    return (duet_kv_pages){.k_pool = dv(kp),
                           .v_pool = dv(vp),
                           .block_table = dv(tab),
                           .dtype = pg->dt,
                           .block_size = pg->bs,
                           .n_blocks = pg->n_blocks,
                           .n_seqs = pg->n_seqs,
                           .max_blocks = pg->max_blocks};
}

/* Pool row of (seq s, position p). */
static int paged_row(const paged *pg, int s, int p) {
    return pg->table[s * pg->max_blocks + p / pg->bs] * pg->bs + p % pg->bs;
}

/* softmax(scale q.K^T) V in double, per token and head. */
static double *attention_ref(const paged *pg, const float *q, float scale) {
    const int nh = pg->n_head, hd = pg->hd, kvw = pg->n_head_kv * hd, grp = nh / pg->n_head_kv;
    double *out = calloc((size_t)pg->n_tokens * nh * hd, sizeof *out);
    double *w = malloc((size_t)(pg->max_blocks * pg->bs) * sizeof *w);
    for (int t = 0; t < pg->n_tokens; t++)
        for (int h = 0; h < nh; h++) {
            const float *qr = q + ((size_t)t * nh + h) * hd;
            const int kvh = h / grp, P = pg->pos[t] + 1;
            double mx = -INFINITY, sum = 0;
            for (int p = 0; p < P; p++) {
                const float *k = pg->kf + (size_t)paged_row(pg, pg->seq[t], p) * kvw + kvh * hd;
                double d = 0;
                for (int i = 0; i < hd; i++)
                    d += (double)qr[i] * k[i];
                w[p] = d * scale;
                mx = fmax(mx, w[p]);
            }
            for (int p = 0; p < P; p++)
                sum += (w[p] = exp(w[p] - mx));
            double *o = out + ((size_t)t * nh + h) * hd;
            for (int p = 0; p < P; p++) {
                const float *v = pg->vf + (size_t)paged_row(pg, pg->seq[t], p) * kvw + kvh * hd;
                for (int i = 0; i < hd; i++)
                    o[i] += w[p] / sum * v[i];
            }
        }
    free(w);
    return out;
}

typedef struct att_shape {
    const char *name;
    int n_head, n_head_kv, hd, bs, n_seqs, n_tokens;
    int seqs[24], poss[24];
} att_shape;

/* Runs one attention op (out and out_q8 as asked) and checks it against
 * the reference; returns the plan the backend chose. */
static const char *attention_case(duet_backend *be, const att_shape *sh, duet_dtype dt, bool want_out,
                                  bool want_q8, const char *tune) {
    paged pg;
    paged_init(&pg, dt, sh->n_head, sh->n_head_kv, sh->hd, sh->bs, sh->n_seqs, sh->n_tokens, sh->seqs,
               sh->poss);
    const int nt = sh->n_tokens, width = sh->n_head * sh->hd;
    const size_t qbytes = (size_t)nt * width * 4,
                 q8bytes = (size_t)nt * (width / 32) * sizeof(duet_block_q8_0);
    float *q = malloc(qbytes);
    for (int i = 0; i < nt * width; i++)
        q[i] = frand();
    const float scale = 1.0f / sqrtf((float)sh->hd);
    duet_buffer *bq = dev_buf(be, q, qbytes), *bpos = dev_buf(be, pg.pos, (size_t)nt * 4),
                *bseq = dev_buf(be, pg.seq, (size_t)nt * 4), *bk = dev_buf(be, pg.kpool, pg.pool_bytes),
                *bv = dev_buf(be, pg.vpool, pg.pool_bytes),
                *btab = dev_buf(be, pg.table, (size_t)pg.n_seqs * pg.max_blocks * 4);
    duet_buffer *bo = want_out ? dev_buf(be, NULL, qbytes) : NULL,
                *bq8 = want_q8 ? dev_buf(be, NULL, q8bytes) : NULL;
    duet_op op = {.kind = DUET_OP_ATTENTION, .n_tokens = nt};
    op.attention.q = dv(bq);
    op.attention.pos = dv(bpos);
    op.attention.seq = dv(bseq);
    op.attention.kv = paged_views(&pg, bk, bv, btab);
    op.attention.n_head = sh->n_head;
    op.attention.n_head_kv = sh->n_head_kv;
    op.attention.head_dim = sh->hd;
    op.attention.scale = scale;
    if (bo) op.attention.out = dv(bo);
    if (bq8) op.attention.out_q8 = dv(bq8);
    int split_len = 0, n_splits = 0;
    const char *plan = duet__ocl_attention_plan((ocl_backend *)be, &op, &split_len, &n_splits);
    ck_assert_msg(plan != NULL, "%s: no attention plan", sh->name);
    duet_status st = run_op(be, &op);
    char what[200];
    snprintf(what, sizeof what, "attention %s kv %s [%s] %s%s (%s, %d splits)", sh->name, duet_dtype_name(dt),
             tune, want_out ? "out" : "", want_q8 ? "+q8" : "", plan, n_splits);
    ck_assert_msg(st == DUET_OK, "%s: %s", what, duet_last_error());
    double *ref = attention_ref(&pg, q, scale);
    float *got = NULL;
    if (bo) {
        got = dev_get(be, bo, qbytes, what);
        check_close(got, ref, (int64_t)nt * width, 2e-5, 2e-5, what);
    }
    if (bq8) {
        duet_block_q8_0 *gq = dev_get(be, bq8, q8bytes, what);
        if (got)
            check_q8_of(gq, got, (int64_t)nt * width, what);
        else {
            /* Alone, the blocks must hold the reference within a step. */
            float *deq = malloc(qbytes);
            duet_dequantize_row(DUET_DTYPE_Q8_0, gq, deq, (int64_t)nt * width);
            for (int i = 0; i < nt * width; i++) {
                const double step = duet_fp16_to_fp32(gq[i / 32].d);
                ck_assert_msg(fabs(deq[i] - ref[i]) <= 1.01 * step + 1e-6,
                              "%s: q8 value %d is %g, reference %g", what, i, (double)deq[i], ref[i]);
            }
            free(deq);
        }
        free(gq);
    }
    /* Attention leaves its inputs alone. */
    float *q_after = dev_get(be, bq, qbytes, what);
    ck_assert_msg(memcmp(q_after, q, qbytes) == 0, "%s: q changed", what);
    free(q_after);
    free(got), free(ref), free(q);
    duet_buffer_free(be, bq), duet_buffer_free(be, bpos), duet_buffer_free(be, bseq),
        duet_buffer_free(be, bk);
    duet_buffer_free(be, bv), duet_buffer_free(be, btab), duet_buffer_free(be, bo), duet_buffer_free(be, bq8);
    paged_free(&pg);
    return plan;
}

/* A ragged batch: a prefill chunk of sequence 0 interleaved with a decode
 * token of sequence 1 and a two-token start of sequence 2 (GQA 4:1);
 * one long decode; a head_dim that is neither a multiple of 32 nor of 8. */
static const att_shape att_shapes[] = {
    {"ragged",
     8,
     2,
     64,
     16,
     3,
     13,
     {0, 1, 0, 0, 2, 0, 0, 0, 2, 0, 0, 0, 0},
     {20, 70, 21, 22, 0, 23, 24, 25, 1, 26, 27, 28, 29}},
    {"long", 4, 4, 64, 16, 2, 2, {1, 0}, {1000, 5}},
    {"hd36", 8, 2, 36, 8, 2, 5, {0, 1, 0, 1, 0}, {40, 3, 41, 4, 42}},
};
static const att_shape att_small[] = {
    {"ragged-small", 4, 2, 32, 4, 3, 6, {0, 1, 0, 2, 0, 2}, {25, 40, 26, 0, 27, 1}},
    {"hd36-small", 8, 2, 36, 4, 2, 3, {0, 1, 0}, {30, 2, 31}},
};

START_TEST(test_attention_paged) {
    if (!have_device()) return;
    /* Each tuning forces a path: the table's choice, flash-decoding with a
     * short split (many splits + reduce) with one work-item and with
     * GPU-sized groups (dims split across work-items, key groups when the
     * group is wider than head_dim), work-groups of one KV head's query
     * heads or of several KV heads (att_g), and the prefill tiles. */
    static const char *const tunes[] = {
        "",
        "att_mode=1,att_wg=1,att_split=16,att_g=64",
        "att_mode=1,att_wg=16,att_split=32,att_g=0",
        "att_mode=1,att_wg=128,att_split=256,att_g=8",
        "att_mode=2,att_bq=8,att_bk=8,att_tpr=4",
        "att_mode=2,att_bq=3,att_bk=5,att_tpr=1",
    };
    const bool small = small_mode();
    const att_shape *shapes = small ? att_small : att_shapes;
    const int n_shapes = small ? 2 : 3;
    for (int ti = 0; ti < (int)(sizeof tunes / sizeof tunes[0]); ti++) {
        if (small && ti == 3) continue; /* 128 work-items: too slow to simulate */
        duet_backend *be = open_tuned(tunes[ti]);
        for (int si = 0; si < n_shapes; si++) {
            const att_shape *sh = &shapes[si];
            const duet_dtype dts[3] = {DUET_DTYPE_F32, DUET_DTYPE_F16, DUET_DTYPE_Q8_0};
            for (int di = 0; di < 3; di++) {
                if (dts[di] == DUET_DTYPE_Q8_0 && sh->hd % 32) continue;
                if (small && di == 0) continue;
                const char *plan = attention_case(be, sh, dts[di], true, di == 2 || !small, tunes[ti]);
                if (strstr(tunes[ti], "att_mode=1")) ck_assert_str_eq(plan, "decode");
                if (strstr(tunes[ti], "att_mode=2")) ck_assert_str_eq(plan, "prefill");
            }
            /* The q8 output alone (out absent). */
            attention_case(be, sh, DUET_DTYPE_F16, false, true, tunes[ti]);
        }
        duet_backend_close(be);
    }
}
END_TEST

/* A block table that points outside the pools (negative, huge) must not
 * make a kernel read or write outside them: indices are clamped. The
 * result is unspecified but finite, the guards intact (and oclgrind sees
 * every access). */
START_TEST(test_attention_bad_table) {
    if (!have_device()) return;
    static const char *const tunes[] = {"att_mode=1,att_split=16", "att_mode=2"};
    for (int ti = 0; ti < 2; ti++) {
        duet_backend *be = open_tuned(tunes[ti]);
        paged pg;
        const int seqs[3] = {0, 1, 0}, poss[3] = {9, 31, 10}; /* distinct rows even when clamped */
        paged_init(&pg, DUET_DTYPE_Q8_0, 2, 1, 32, 4, 2, 3, seqs, poss);
        for (int i = 0; i < pg.n_seqs * pg.max_blocks; i++)
            pg.table[i] = i % 2 ? -1000000 : 1 << 30;
        const size_t qbytes = 3 * 64 * 4;
        float q[3 * 64];
        for (int i = 0; i < 3 * 64; i++)
            q[i] = frand();
        duet_buffer *bq = dev_buf(be, q, qbytes), *bpos = dev_buf(be, pg.pos, 12),
                    *bseq = dev_buf(be, pg.seq, 12), *bk = dev_buf(be, pg.kpool, pg.pool_bytes),
                    *bv = dev_buf(be, pg.vpool, pg.pool_bytes),
                    *btab = dev_buf(be, pg.table, (size_t)pg.n_seqs * pg.max_blocks * 4),
                    *bo = dev_buf(be, NULL, qbytes);
        float k[3 * 32], v[3 * 32];
        for (int i = 0; i < 96; i++)
            k[i] = frand(), v[i] = frand();
        duet_buffer *bkk = dev_buf(be, k, sizeof k), *bvv = dev_buf(be, v, sizeof v);
        duet_op rope = {.kind = DUET_OP_ROPE_KV, .n_tokens = 3};
        rope.rope_kv.q = dv(bq), rope.rope_kv.k = dv(bkk), rope.rope_kv.v = dv(bvv);
        rope.rope_kv.pos = dv(bpos), rope.rope_kv.seq = dv(bseq);
        rope.rope_kv.kv = paged_views(&pg, bk, bv, btab);
        rope.rope_kv.n_head = 2, rope.rope_kv.n_head_kv = 1, rope.rope_kv.head_dim = 32,
        rope.rope_kv.n_rot = 32;
        rope.rope_kv.freq_base = 10000.0f;
        ck_assert_msg(run_op(be, &rope) == DUET_OK, "rope_kv with a bad table: %s", duet_last_error());
        duet_op op = {.kind = DUET_OP_ATTENTION, .n_tokens = 3};
        op.attention.q = dv(bq), op.attention.pos = dv(bpos), op.attention.seq = dv(bseq);
        op.attention.kv = paged_views(&pg, bk, bv, btab);
        op.attention.n_head = 2, op.attention.n_head_kv = 1, op.attention.head_dim = 32;
        op.attention.scale = 0.2f, op.attention.out = dv(bo);
        ck_assert_msg(run_op(be, &op) == DUET_OK, "attention with a bad table: %s", duet_last_error());
        float *got = dev_get(be, bo, qbytes, "attention (bad table)");
        for (int i = 0; i < 3 * 64; i++)
            ck_assert_msg(isfinite(got[i]), "out[%d] = %g", i, (double)got[i]);
        free(got);
        free(dev_get(be, bk, pg.pool_bytes, "k pool (bad table)"));
        free(dev_get(be, bv, pg.pool_bytes, "v pool (bad table)"));
        duet_buffer_free(be, bq), duet_buffer_free(be, bpos), duet_buffer_free(be, bseq),
            duet_buffer_free(be, bk);
        duet_buffer_free(be, bv), duet_buffer_free(be, btab), duet_buffer_free(be, bo),
            duet_buffer_free(be, bkk);
        duet_buffer_free(be, bvv);
        paged_free(&pg);
        duet_backend_close(be);
    }
}
END_TEST

/* rope_kv: q and k rotated in place (against a double reference), k and v
 * stored at their (sequence, position) rows through a scattered table
 * (f32 exactly, f16 rounded, q8_0 quantised from the rotated f32 values),
 * and every other pool row untouched. */
static void rope_case(duet_backend *be, duet_dtype dt, bool neox, int n_rot, const char *tune) {
    const bool small = small_mode();
    const int nh = 4, nkv = 2, hd = small ? 32 : 64, nt = small ? 3 : 6;
    const int seqs[6] = {0, 1, 0, 1, 1, 0}, poss[6] = {0, 17, 1, 18, 40, 2};
    paged pg;
    paged_init(&pg, dt, nh, nkv, hd, small ? 4 : 16, 2, nt, seqs, poss);
    const int kvw = nkv * hd, qw = nh * hd;
    float *q = malloc((size_t)nt * qw * 4), *k = malloc((size_t)nt * kvw * 4),
          *v = malloc((size_t)nt * kvw * 4);
    for (int i = 0; i < nt * qw; i++)
        q[i] = frand() * 3;
    for (int i = 0; i < nt * kvw; i++)
        k[i] = frand() * 3, v[i] = frand() * 3;
    duet_buffer *bq = dev_buf(be, q, (size_t)nt * qw * 4), *bk = dev_buf(be, k, (size_t)nt * kvw * 4),
                *bv = dev_buf(be, v, (size_t)nt * kvw * 4), *bpos = dev_buf(be, pg.pos, (size_t)nt * 4),
                *bseq = dev_buf(be, pg.seq, (size_t)nt * 4), *kp = dev_buf(be, pg.kpool, pg.pool_bytes),
                *vp = dev_buf(be, pg.vpool, pg.pool_bytes),
                *btab = dev_buf(be, pg.table, (size_t)pg.n_seqs * pg.max_blocks * 4);
    duet_op op = {.kind = DUET_OP_ROPE_KV, .n_tokens = nt};
    op.rope_kv.q = dv(bq), op.rope_kv.k = dv(bk), op.rope_kv.v = dv(bv);
    op.rope_kv.pos = dv(bpos), op.rope_kv.seq = dv(bseq);
    op.rope_kv.kv = paged_views(&pg, kp, vp, btab);
    op.rope_kv.n_head = nh, op.rope_kv.n_head_kv = nkv, op.rope_kv.head_dim = hd, op.rope_kv.n_rot = n_rot;
    op.rope_kv.freq_base = 10000.0f, op.rope_kv.neox = neox;
    char what[160];
    snprintf(what, sizeof what, "rope_kv kv %s %s n_rot %d [%s]", duet_dtype_name(dt),
             neox ? "neox" : "normal", n_rot, tune);
    ck_assert_msg(run_op(be, &op) == DUET_OK, "%s: %s", what, duet_last_error());
    float *gq = dev_get(be, bq, (size_t)nt * qw * 4, what), *gk = dev_get(be, bk, (size_t)nt * kvw * 4, what);
    uint8_t *gkp = dev_get(be, kp, pg.pool_bytes, what), *gvp = dev_get(be, vp, pg.pool_bytes, what);
    /* The rotation, in double. */
    for (int pass = 0; pass < 2; pass++) {
        const float *in = pass ? k : q, *got = pass ? gk : gq;
        const int heads = pass ? nkv : nh;
        double *ref = malloc((size_t)nt * heads * hd * sizeof *ref);
        for (int t = 0; t < nt; t++)
            for (int h = 0; h < heads; h++) {
                const float *x = in + ((size_t)t * heads + h) * hd;
                double *y = ref + ((size_t)t * heads + h) * hd;
                for (int i = 0; i < hd; i++)
                    y[i] = x[i];
                for (int j = 0; j < n_rot / 2; j++) {
                    const int i0 = neox ? j : 2 * j, i1 = neox ? j + n_rot / 2 : 2 * j + 1;
                    const double th = poss[t] * pow(10000.0, -2.0 * j / n_rot);
                    y[i0] = x[i0] * cos(th) - x[i1] * sin(th);
                    y[i1] = x[i0] * sin(th) + x[i1] * cos(th);
                }
            }
        check_close(got, ref, (int64_t)nt * heads * hd, 1e-5, 1e-5, what);
        free(ref);
    }
    /* The stored rows, from the device's rotated k and the input v. */
    uint8_t *row = malloc(pg.row_bytes);
    bool *written = calloc((size_t)pg.n_blocks * pg.bs, 1);
    for (int t = 0; t < nt; t++) {
        const int r = paged_row(&pg, seqs[t], poss[t]);
        written[r] = true;
        for (int kv = 0; kv < 2; kv++) {
            const float *src = kv ? v + (size_t)t * kvw : gk + (size_t)t * kvw;
            const uint8_t *dst = (kv ? gvp : gkp) + (size_t)r * pg.row_bytes;
            if (dt == DUET_DTYPE_Q8_0)
                check_q8_of((const duet_block_q8_0 *)dst, src, kvw, what);
            else {
                duet_convert_row(dt, src, row, kvw);
                ck_assert_msg(memcmp(row, dst, pg.row_bytes) == 0, "%s: token %d %s row differs", what, t,
                              kv ? "v" : "k");
            }
        }
    }
    for (int r = 0; r < pg.n_blocks * pg.bs; r++)
        if (!written[r])
            ck_assert_msg(
                !memcmp(gkp + (size_t)r * pg.row_bytes, pg.kpool + (size_t)r * pg.row_bytes, pg.row_bytes) &&
                    !memcmp(gvp + (size_t)r * pg.row_bytes, pg.vpool + (size_t)r * pg.row_bytes,
                            pg.row_bytes),
                "%s: pool row %d changed but no token maps to it", what, r);
    free(row), free(written), free(gq), free(gk), free(gkp), free(gvp), free(q), free(k), free(v);
    duet_buffer_free(be, bq), duet_buffer_free(be, bk), duet_buffer_free(be, bv), duet_buffer_free(be, bpos);
    duet_buffer_free(be, bseq), duet_buffer_free(be, kp), duet_buffer_free(be, vp),
        duet_buffer_free(be, btab);
    paged_free(&pg);
}

START_TEST(test_rope_kv_paged) {
    if (!have_device()) return;
    static const char *const tunes[] = {"", "rope_wg=1", "rope_wg=16"};
    for (int ti = 0; ti < 3; ti++) {
        duet_backend *be = open_tuned(tunes[ti]);
        const duet_dtype dts[3] = {DUET_DTYPE_F32, DUET_DTYPE_F16, DUET_DTYPE_Q8_0};
        for (int di = 0; di < 3; di++) {
            rope_case(be, dts[di], di == 1, small_mode() ? 32 : 64, tunes[ti]);
            rope_case(be, dts[di], di != 1, small_mode() ? 16 : 48, tunes[ti]); /* partial rotation */
        }
        duet_backend_close(be);
    }
}
END_TEST

/* rmsnorm and swiglu with out_q8: f32 against the host, the blocks against
 * the host quantisation of the device's f32, and the blocks alone (out
 * absent) identical to the blocks written with out. */
START_TEST(test_q8_outputs) {
    if (!have_device()) return;
    static const char *const tunes[] = {"", "norm_wg=1,ew_wg=0", "norm_wg=64,ew_wg=32"};
    const bool small = small_mode();
    const int nt = 3, dims[2] = {96, small ? 64 : 2048};
    for (int ti = 0; ti < 3; ti++) {
        duet_backend *be = open_tuned(tunes[ti]);
        for (int di = 0; di < 2; di++) {
            const int dim = dims[di], n = nt * dim;
            const size_t fb = (size_t)n * 4, qb = (size_t)(n / 32) * sizeof(duet_block_q8_0);
            float *x = malloc(fb), *w = malloc((size_t)dim * 4), *u = malloc(fb);
            for (int i = 0; i < n; i++)
                x[i] = frand() * 4, u[i] = frand();
            for (int i = 0; i < dim; i++)
                w[i] = 0.5f + frand();
            for (int i = 32; i < 64; i++)
                x[i] = 0.0f; /* an all-zero block: scale 0 */
            for (int kind = 0; kind < 2; kind++) {
                char what[128];
                snprintf(what, sizeof what, "%s dim %d [%s]", kind ? "swiglu" : "rmsnorm", dim, tunes[ti]);
                duet_buffer *bx = dev_buf(be, x, fb), *bw = dev_buf(be, w, (size_t)dim * 4),
                            *bu = dev_buf(be, u, fb);
                duet_buffer *bo = dev_buf(be, NULL, fb), *bq1 = dev_buf(be, NULL, qb),
                            *bq2 = dev_buf(be, NULL, qb);
                duet_op op = {.kind = kind ? DUET_OP_SWIGLU : DUET_OP_RMSNORM, .n_tokens = nt};
                if (kind)
                    op.swiglu.gate = dv(bx), op.swiglu.up = dv(bu), op.swiglu.out = dv(bo),
                    op.swiglu.out_q8 = dv(bq1), op.swiglu.dim = dim;
                else
                    op.rmsnorm.x = dv(bx), op.rmsnorm.w = dv(bw), op.rmsnorm.out = dv(bo),
                    op.rmsnorm.out_q8 = dv(bq1), op.rmsnorm.dim = dim, op.rmsnorm.eps = 1e-5f;
                ck_assert_msg(run_op(be, &op) == DUET_OK, "%s: %s", what, duet_last_error());
                if (kind)
                    op.swiglu.out = (duet_view){0}, op.swiglu.out_q8 = dv(bq2);
                else
                    op.rmsnorm.out = (duet_view){0}, op.rmsnorm.out_q8 = dv(bq2);
                ck_assert_msg(run_op(be, &op) == DUET_OK, "%s (q8 only): %s", what, duet_last_error());
                float *got = dev_get(be, bo, fb, what);
                duet_block_q8_0 *g1 = dev_get(be, bq1, qb, what), *g2 = dev_get(be, bq2, qb, what);
                double *ref = malloc((size_t)n * sizeof *ref);
                for (int t = 0; t < nt; t++) {
                    double ss = 0;
                    for (int i = 0; i < dim; i++)
                        ss += (double)x[t * dim + i] * x[t * dim + i];
                    const double sc = 1.0 / sqrt(ss / dim + 1e-5);
                    for (int i = 0; i < dim; i++) {
                        const double g = x[t * dim + i];
                        ref[t * dim + i] = kind ? g / (1 + exp(-g)) * u[t * dim + i] : g * sc * w[i];
                    }
                }
                check_close(got, ref, n, 1e-5, 1e-5, what);
                check_q8_of(g1, got, n, what);
                ck_assert_msg(memcmp(g1, g2, qb) == 0, "%s: q8 alone differs from q8 with out", what);
                free(ref), free(got), free(g1), free(g2);
                duet_buffer_free(be, bx), duet_buffer_free(be, bw), duet_buffer_free(be, bu);
                duet_buffer_free(be, bo), duet_buffer_free(be, bq1), duet_buffer_free(be, bq2);
            }
            free(x), free(w), free(u);
        }
        duet_backend_close(be);
    }
}
END_TEST

/* Q8_0 weights x q8_0 activations: the exact integer sums scaled per block,
 * through the vector (CPU) and word (GPU) matvec loops, the portable and
 * the (emulated) extension dot product, and the tiled GEMM. */
START_TEST(test_matmul_q8) {
    if (!have_device()) return;
    static const char *const tunes[] = {
        "",
        "dot=0,mv_r=1,mv_wg=4,mv_nr=2,mv_mt=4",
        "dot=0,mv_r=8,mv_wg=16,mv_nr=2,mv_mt=3",
        "dot=2,mv_r=4,mv_wg=8,mv_nr=1,mv_mt=2",
        "dot=2,mv_r=1,mv_wg=4,mv_nr=4,mv_mt=4",
        "dot=0,mm_tile_min=1,mm_bn=8,mm_tr=2",
        "dot=2,mm_tile_min=2,mm_bn=16,mm_tr=4",
    };
    const bool small = small_mode();
    const int shapes[][3] = {{1, 96, 37}, {5, 256, 33}, {small ? 9 : 70, small ? 64 : 288, small ? 19 : 65}};
    for (int ti = 0; ti < (int)(sizeof tunes / sizeof tunes[0]); ti++) {
        duet_backend *be = open_tuned(tunes[ti]);
        if (strstr(tunes[ti], "dot=2")) ck_assert_int_eq(((ocl_backend *)be)->int_dot, 1);
        if (strstr(tunes[ti], "dot=0")) ck_assert_int_eq(((ocl_backend *)be)->int_dot, 0);
        for (int si = 0; si < 3; si++) {
            const int nt = shapes[si][0], n_in = shapes[si][1], n_out = shapes[si][2], nb = n_in / 32;
            duet_block_q8_0 *w = malloc((size_t)n_out * nb * sizeof *w),
                            *x = malloc((size_t)nt * nb * sizeof *x);
            for (int i = 0; i < n_out * nb; i++) {
                w[i].d = duet_fp32_to_fp16(0.01f + 0.02f * (frand() + 1));
                for (int j = 0; j < 32; j++)
                    w[i].qs[j] = (int8_t)(frand() * 128); /* -128 included */
            }
            for (int i = 0; i < nt * nb; i++) {
                x[i].d = duet_fp32_to_fp16(0.05f * (frand() + 1.5f));
                for (int j = 0; j < 32; j++)
                    x[i].qs[j] = (int8_t)(frand() * 127);
            }
            float *bias = malloc((size_t)n_out * 4), *o0 = malloc((size_t)nt * n_out * 4);
            for (int i = 0; i < n_out; i++)
                bias[i] = frand();
            for (int i = 0; i < nt * n_out; i++)
                o0[i] = frand();
            for (int variant = 0; variant < 2; variant++) { /* plain; bias + accumulate */
                duet_buffer *bw = dev_buf(be, w, (size_t)n_out * nb * sizeof *w),
                            *bx = dev_buf(be, x, (size_t)nt * nb * sizeof *x),
                            *bb = dev_buf(be, bias, (size_t)n_out * 4),
                            *bo = dev_buf(be, o0, (size_t)nt * n_out * 4);
                duet_op op = {.kind = DUET_OP_MATMUL, .n_tokens = nt};
                op.matmul.w = dv(bw), op.matmul.dtype = DUET_DTYPE_Q8_0, op.matmul.x_q8 = dv(bx);
                op.matmul.n_in = n_in, op.matmul.n_out = n_out, op.matmul.out = dv(bo);
                if (variant) op.matmul.bias = dv(bb), op.matmul.accumulate = true;
                char what[160];
                snprintf(what, sizeof what, "matmul q8 x q8 %dx%d->%d%s [%s] (%s)", nt, n_in, n_out,
                         variant ? " +bias +acc" : "", tunes[ti],
                         duet__ocl_matmul_path((ocl_backend *)be, &op));
                ck_assert_msg(run_op(be, &op) == DUET_OK, "%s: %s", what, duet_last_error());
                float *got = dev_get(be, bo, (size_t)nt * n_out * 4, what);
                double *ref = malloc((size_t)nt * n_out * sizeof *ref);
                for (int t = 0; t < nt; t++)
                    for (int o = 0; o < n_out; o++) {
                        double acc = variant ? (double)o0[t * n_out + o] + bias[o] : 0;
                        for (int b = 0; b < nb; b++) {
                            const duet_block_q8_0 *wb = &w[o * nb + b], *xb = &x[t * nb + b];
                            int s = 0;
                            for (int j = 0; j < 32; j++)
                                s += wb->qs[j] * xb->qs[j];
                            acc += (double)duet_fp16_to_fp32(wb->d) * duet_fp16_to_fp32(xb->d) * s;
                        }
                        ref[t * n_out + o] = acc;
                    }
                check_close(got, ref, (int64_t)nt * n_out, 1e-5, 2e-6, what);
                free(got), free(ref);
                duet_buffer_free(be, bw), duet_buffer_free(be, bx), duet_buffer_free(be, bb),
                    duet_buffer_free(be, bo);
            }
            free(w), free(x), free(bias), free(o0);
        }
        duet_backend_close(be);
    }
}
END_TEST

/* scratch_bytes: nothing before any op; a split decode allocates exactly
 * its partials, linear in the context the block table allows (tokens x
 * heads x splits x (head_dim + 2) floats); a larger op raises the
 * high-water mark, a smaller one leaves it. */
START_TEST(test_scratch_bytes) {
    if (!have_device()) return;
    duet_backend *be = open_tuned("att_mode=1,att_occ=0,att_split=32");
    ck_assert_int_eq(duet_backend_scratch_bytes(be), 0);
    size_t prev = 0, peak = 0;
    for (int ctx = 64; ctx <= 256; ctx *= 2) {
        const int seqs[2] = {0, 1}, poss[2] = {ctx - 1, ctx / 2};
        paged pg;
        paged_init(&pg, DUET_DTYPE_F16, 2, 1, 32, 16, 2, 2, seqs, poss);
        float q[2 * 64];
        for (int i = 0; i < 128; i++)
            q[i] = frand();
        duet_buffer *bq = dev_buf(be, q, sizeof q), *bpos = dev_buf(be, pg.pos, 8),
                    *bseq = dev_buf(be, pg.seq, 8), *bk = dev_buf(be, pg.kpool, pg.pool_bytes),
                    *bv = dev_buf(be, pg.vpool, pg.pool_bytes),
                    *btab = dev_buf(be, pg.table, (size_t)pg.n_seqs * pg.max_blocks * 4),
                    *bo = dev_buf(be, NULL, sizeof q);
        duet_op op = {.kind = DUET_OP_ATTENTION, .n_tokens = 2};
        op.attention.q = dv(bq), op.attention.pos = dv(bpos), op.attention.seq = dv(bseq);
        op.attention.kv = paged_views(&pg, bk, bv, btab);
        op.attention.n_head = 2, op.attention.n_head_kv = 1, op.attention.head_dim = 32,
        op.attention.scale = 0.2f;
        op.attention.out = dv(bo);
        int split_len, n_splits;
        ck_assert_str_eq(duet__ocl_attention_plan((ocl_backend *)be, &op, &split_len, &n_splits), "decode");
        const int max_ctx = pg.max_blocks * pg.bs;
        ck_assert_int_eq(split_len, 32);
        ck_assert_int_eq(n_splits, (max_ctx + 31) / 32);
        ck_assert_msg(run_op(be, &op) == DUET_OK, "%s", duet_last_error());
        float *got = dev_get(be, bo, sizeof q, "attention (scratch)");
        double *ref = attention_ref(&pg, q, 0.2f);
        check_close(got, ref, 128, 2e-5, 2e-5, "attention (scratch)");
        free(got), free(ref);
        /* tokens x heads x splits x (m, l, acc); while the buffer grows the
         * old one still counts (enqueued work may use it). */
        const size_t part = (size_t)2 * 2 * n_splits * (32 + 2) * 4;
        ck_assert_msg(part > prev, "partials did not grow with the context");
        ck_assert_msg(duet_backend_scratch_bytes(be) == prev + part,
                      "ctx %d: scratch %zu, expected %zu + %zu", ctx, duet_backend_scratch_bytes(be), prev,
                      part);
        peak = prev + part;
        prev = part;
        duet_buffer_free(be, bq), duet_buffer_free(be, bpos), duet_buffer_free(be, bseq),
            duet_buffer_free(be, bk);
        duet_buffer_free(be, bv), duet_buffer_free(be, btab), duet_buffer_free(be, bo);
        paged_free(&pg);
    }
    /* A one-split op needs no partials and leaves the mark where it was. */
    const att_shape one = {"one", 2, 1, 32, 16, 1, 1, {0}, {3}};
    attention_case(be, &one, DUET_DTYPE_F32, true, false, "");
    ck_assert_int_eq(duet_backend_scratch_bytes(be), peak);
    duet_backend_close(be);
}
END_TEST

/* ---- subprocess runs of test_backend_ops -------------------------------------------------------- */

/* Runs argv with extra environment (NAME=VALUE strings, NULL-terminated);
 * returns the exit status (or -1) and the output in *out (malloc'd). */
static int run_with_env(char *const argv[], const char *const env[], char **out) {
    int fd[2];
    ck_assert_int_eq(pipe(fd), 0);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        dup2(fd[1], 1);
        dup2(fd[1], 2);
        close(fd[0]);
        /* This test's own case selection must not reach the child. */
        unsetenv("CK_RUN_CASE");
        unsetenv("CK_RUN_SUITE");
        unsetenv("DUET_TEST_BUDGET");
        for (int i = 0; env[i]; i++)
            putenv((char *)env[i]);
        execvp(argv[0], argv);
        _exit(127);
    }
    close(fd[1]);
    size_t cap = 1 << 16, len = 0;
    char *buf = malloc(cap);
    ssize_t n;
    while ((n = read(fd[0], buf + len, cap - len - 1)) > 0) {
        len += (size_t)n;
        if (cap - len < 4096) buf = realloc(buf, cap *= 2);
    }
    buf[len] = 0;
    close(fd[0]);
    int status;
    waitpid(pid, &status, 0);
    *out = buf;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/* The last n bytes of s (Check caps a message's length). */
static const char *tail(const char *s, size_t n) {
    size_t len = strlen(s);
    return len > n ? s + len - n : s;
}

static const char *ops_binary(void) {
    static char path[1024];
    snprintf(path, sizeof path, "%s/test_backend_ops", DUET_BINARY_DIR);
    return path;
}

/* The GPU-style paths (cooperative dot products and reductions in local
 * memory, the prefill attention tiles, the int8 dot-product code with
 * emulated built-ins, the tiled q8 GEMM, chunked CLBlast) forced on this
 * device, and the most serial CPU-style settings (flash-decoding with one
 * work-item and short splits, the portable int8 code for one token and
 * dequantised q8 activations from two): parity with the
 * cpu backend must hold for every tuning, not just the table's. */
START_TEST(test_forced_paths) {
    if (!have_device()) return;
    static const char *const tunes[] = {
        "DUET_OPENCL_TUNE=mv_r=16,mv_wg=64,mv_nr=4,mv_vw=4,mv_mt=3,mv_qg=8,norm_wg=64,att_wg=32,att_split=64,"
        "att_mode=2,att_bq=8,att_bk=16,att_tpr=4,rope_wg=16,dot=2,mq_nr=2,mm_tile_min=4,mm_bn=16,mm_tr=4,ew_"
        "wg=64,"
        "clblast_min=8,clblast_scratch_mb=1",
        "DUET_OPENCL_TUNE=mv_r=1,mv_wg=1,mv_nr=1,mv_vw=8,mv_mt=8,mv_qg=1,norm_wg=1,att_wg=1,att_mode=1,att_"
        "split=32,"
        "rope_wg=1,dot=0,mq_nr=8,ew_wg=0,clblast_min=0,q8_f32_min=2",
    };
    {
        const int i = _i; /* one tuning per loop index: each its own ctest case */
        /* The small cases: contexts up to 300 still cross every split
         * length forced here, and serial tunings on 4096-token cases would
         * take many minutes on a CPU device. */
        const char *env[] = {tunes[i], "DUET_OPS_BACKENDS=opencl", "DUET_OPS_CASES=small", "CK_FORK=no",
                             NULL};
        char *argv[] = {(char *)ops_binary(), NULL};
        char *out;
        int rc = run_with_env(argv, env, &out);
        ck_assert_msg(rc == 0 && strstr(out, "0 failed"), "%s: test_backend_ops failed (rc %d):\n%s",
                      tunes[i], rc, tail(out, 2000));
        free(out);
    }
}
END_TEST

/* Every kernel on small shapes under oclgrind: the op parity cases twice,
 * with the simulator's own tuning entry (work-group reductions, barriers)
 * and with CPU-style single-work-item settings, then this file's kernel
 * checks (paged attention, rope_kv, q8 outputs, q8 x q8 matmul; each
 * forcing its paths through tunings). Any report fails the test. */
START_TEST(test_oclgrind) {
    if (system("command -v oclgrind >/dev/null 2>&1") != 0) {
        printf("SKIP oclgrind: not installed\n");
        ck_assert_msg(!required(), "opencl is required but oclgrind (the kernel checker) is not installed");
        return;
    }
    static const char *const tunes[] = {
        "DUET_OPENCL_TUNE=clblast_min=0,dot=2",
        "DUET_OPENCL_TUNE=mv_r=1,mv_wg=4,mv_nr=4,mv_vw=16,mv_mt=4,mv_qg=8,norm_wg=1,att_wg=1,att_mode=1,att_"
        "split=16,"
        "rope_wg=1,dot=0,mq_nr=4,ew_wg=0,clblast_min=0",
    };
    for (int i = 0; i < 2; i++) {
        char log[128];
        snprintf(log, sizeof log, "/tmp/duet-oclgrind-%ld-%d.log", (long)getpid(), i);
        remove(log);
        /* Under ASan: oclgrind preloads its runtime ahead of ASan's, and leaks. */
        const char *env[] = {tunes[i],
                             "DUET_OPS_BACKENDS=opencl",
                             "DUET_OPS_CASES=small",
                             "DUET_OPENCL_CACHE=0",
                             "DUET_REQUIRE_BACKENDS=opencl",
                             "CK_FORK=no",
                             "ASAN_OPTIONS=verify_asan_link_order=0:detect_leaks=0",
                             NULL};
        char *argv[] = {"oclgrind", "--check-api", "--data-races",       "--uninitialized",
                        "--log",    log,           (char *)ops_binary(), NULL};
        char *out;
        int rc = run_with_env(argv, env, &out);
        size_t n = 0;
        char *report = test_read_file(log, &n);
        ck_assert_msg(rc == 0 && strstr(out, "Oclgrind Simulator") && strstr(out, "0 failed"),
                      "%s: the small cases under oclgrind failed (rc %d):\n%s", tunes[i], rc,
                      tail(out, 2000));
        ck_assert_msg(n == 0, "%s: oclgrind reported problems:\n%.2000s", tunes[i], report ? report : "");
        free(report);
        free(out);
        remove(log);
    }
    char log[128], self[1024];
    snprintf(log, sizeof log, "/tmp/duet-oclgrind-%ld-k.log", (long)getpid());
    snprintf(self, sizeof self, "%s/test_opencl", DUET_BINARY_DIR);
    remove(log);
    const char *env[] = {"CK_INCLUDE_TAGS=kernels",
                         "DUET_OCL_TEST_SMALL=1",
                         "DUET_OPENCL_CACHE=0",
                         "DUET_REQUIRE_BACKENDS=opencl",
                         "CK_FORK=no",
                         "ASAN_OPTIONS=verify_asan_link_order=0:detect_leaks=0",
                         NULL};
    char *argv[] = {"oclgrind", "--check-api", "--data-races", "--uninitialized", "--log", log, self, NULL};
    char *out;
    int rc = run_with_env(argv, env, &out);
    size_t n = 0;
    char *report = test_read_file(log, &n);
    ck_assert_msg(rc == 0 && strstr(out, "100%: Checks: 6"),
                  "the kernel checks under oclgrind failed (rc %d):\n%s", rc, tail(out, 2000));
    ck_assert_msg(n == 0, "the kernel checks: oclgrind reported problems:\n%.2000s", report ? report : "");
    free(report);
    free(out);
    remove(log);
}
END_TEST

int main(void) {
    Suite *s = suite_create("opencl");
    /* One ctest test per case (tests/check_tests.cmake): the API checks,
     * each forced tuning, oclgrind, and the kernel checks in two halves. */
    TCase *tc = tcase_create("api");
    tcase_set_timeout(tc, 1200);
    tcase_add_test(tc, test_device_info);
    tcase_add_test(tc, test_no_platform);
    tcase_add_test(tc, test_program_cache);
    tcase_add_test(tc, test_kernel_dir_and_build_log);
    tcase_add_test(tc, test_feature_fallback);
    tcase_add_test(tc, test_tuning_override);
    tcase_add_test(tc, test_clblast_path);
    tcase_add_test(tc, test_profiling);
    suite_add_tcase(s, tc);
    TCase *tf = tcase_create("forced_gpu");
    tcase_set_timeout(tf, 1200);
    tcase_add_loop_test(tf, test_forced_paths, 0, 1);
    suite_add_tcase(s, tf);
    TCase *ts = tcase_create("forced_serial");
    tcase_set_timeout(ts, 1200);
    tcase_add_loop_test(ts, test_forced_paths, 1, 2);
    suite_add_tcase(s, ts);
    TCase *tg = tcase_create("oclgrind");
    tcase_set_timeout(tg, 1200);
    tcase_add_test(tg, test_oclgrind);
    suite_add_tcase(s, tg);
    /* Kernel checks against host references (also rerun under oclgrind,
     * which selects both halves by their tag). */
    TCase *ta = tcase_create("kernels_attention");
    tcase_set_timeout(ta, 1200);
    tcase_set_tags(ta, "kernels");
    tcase_add_test(ta, test_attention_paged);
    tcase_add_test(ta, test_attention_bad_table);
    tcase_add_test(ta, test_scratch_bytes);
    suite_add_tcase(s, ta);
    TCase *tk = tcase_create("kernels_matmul");
    tcase_set_timeout(tk, 1200);
    tcase_set_tags(tk, "kernels");
    tcase_add_test(tk, test_rope_kv_paged);
    tcase_add_test(tk, test_q8_outputs);
    tcase_add_test(tk, test_matmul_q8);
    suite_add_tcase(s, tk);
    return test_run_suite(s);
}
