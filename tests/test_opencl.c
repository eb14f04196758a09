/* test_opencl.c — what is OpenCL-specific: the program binary cache, the
 * build log on a compile failure, the $DUET_KERNEL_DIR override, the
 * tuning override, CLBlast forced on a CPU device, profiling, "unavailable"
 * without an ICD, kernels clamping a bad block table, the scratch of
 * attention's splits, and every kernel under oclgrind (invalid memory
 * accesses, uninitialised reads, data races).
 *
 * The op parity itself, every forced tuning path included
 * (DUET_OPENCL_TUNE: GPU-style and serial kernels, the attention kernels,
 * the int8 dot products, the tiled GEMM, CLBlast), is test_backend_ops'
 * case table against the oracle (op_oracle.h); the oclgrind test reruns
 * that binary under the simulator. Tests that need an OpenCL device skip
 * when there is none, unless DUET_REQUIRE_BACKENDS names opencl (CI). */
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

/* ---- CLBlast really runs when forced -------------------------------------------------------- */

/* clblast_min=2: every F32/F16 matmul of the case table with 2 or more
 * tokens takes CLBlast (its results, against the oracle, are the table's
 * clblast variant; here the path and the calls, with the oracle too). */
START_TEST(test_clblast_path) {
    if (!have_device()) return;
    setenv("DUET_OPENCL_TUNE", "clblast_min=2,clblast_scratch_mb=1", 1);
    ocl_backend *be = open_ocl();
    int ran = 0;
    for (int ci = 0; ci < BO_N_CASES; ci++) {
        const bo_case *c = &bo_cases[ci];
        if (!(c->modes & BO_TEST) || c->kind != DUET_OP_MATMUL || c->n_tokens < 2 ||
            (c->dtype != DUET_DTYPE_F32 && c->dtype != DUET_DTYPE_F16))
            continue;
        bo_host h, want;
        bo_host_build(ci, &h);
        bo_host_build(ci, &want);
        bo_host_oracle(&want);
        bo_dev got;
        ck_assert_int_eq(bo_dev_setup(&be->base, &h, &got), DUET_OK);
        ck_assert_str_eq(duet__ocl_matmul_path(be, &got.op), "clblast");
        int before = be->stats.clblast_calls;
        ck_assert_msg(bo_dev_run(&got, 1) == DUET_OK, "clblast: %s", duet_last_error());
        ck_assert_int_eq(be->stats.clblast_calls, before + 1);
        int oi = h.n - 1; /* out is the last operand */
        uint8_t *b = bo_dev_image(&got, &h, oi);
        const float *fa = want.ops[oi].host, *fb = (const float *)(b + BO_GUARD);
        double err = 0, norm = 0;
        for (size_t i = 0; i < h.ops[oi].bytes / 4; i++)
            err += (fa[i] - fb[i]) * (double)(fa[i] - fb[i]), norm += (double)fa[i] * fa[i];
        char label[160];
        bo_case_label(c, label, sizeof label);
        ck_assert_msg(err / norm < 1e-7, "%s via CLBlast: NMSE %g", label, err / norm);
        for (int g = 0; g < BO_GUARD; g++)
            ck_assert_msg(b[g] == BO_GUARD_BYTE && b[BO_GUARD + h.ops[oi].bytes + g] == BO_GUARD_BYTE,
                          "%s via CLBlast: guard overwritten", label);
        free(b);
        bo_dev_free(&got);
        bo_host_free(&h);
        bo_host_free(&want);
        ran++;
    }
    ck_assert_int_ge(ran, 4);
    duet_backend_close(&be->base);
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

/* ---- kernels where only this backend's behaviour is defined ---------------------------
 *
 * What each kernel path computes, every path forced through
 * DUET_OPENCL_TUNE, is test_backend_ops' case table (against the oracle).
 * Here: a block table pointing outside the pools (the kernels clamp its
 * entries), and the scratch the decode splits allocate (an "api" test). */

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

/* max |got - want| <= atol + rtol * max |want|. */
static void check_close(const float *got, const float *want, int64_t n, double atol, double rtol,
                        const char *what) {
    double mx = 0, worst = 0;
    int64_t wi = 0;
    for (int64_t i = 0; i < n; i++)
        mx = fmax(mx, fabs(want[i]));
    for (int64_t i = 0; i < n; i++) {
        ck_assert_msg(isfinite(got[i]), "%s: element %lld is %g", what, (long long)i, (double)got[i]);
        double e = fabs((double)got[i] - want[i]);
        if (e > worst) worst = e, wi = i;
    }
    ck_assert_msg(worst <= atol + rtol * mx, "%s: element %lld is %.7g, the oracle's %.7g (max |want| %g)",
                  what, (long long)wi, (double)got[wi], (double)want[wi], mx);
}

/* ---- a paged KV cache: the oracle's host model ---- */

/* A batch of tokens (seq[i], pos[i]) over n_seqs sequences whose blocks are
 * scattered through the pools, a few blocks owned by nobody; table entries
 * past a sequence's blocks hold an out-of-range block that no kernel may
 * follow. k values in [-1, 1), v in [-2, 2). */
typedef struct paged {
    int n_tokens;
    int32_t pos[24], seq[24];
    oracle_kv kv;
} paged;

static void paged_init(paged *pg, duet_dtype dt, int n_head_kv, int hd, int bs, int n_seqs, int n_tokens,
                       const int *seqs, const int *poss) {
    int lens[16] = {0}, need = 0, mb = 1;
    ck_assert_int_le(n_seqs, 16);
    ck_assert_int_le(n_tokens, 24);
    pg->n_tokens = n_tokens;
    for (int t = 0; t < n_tokens; t++) {
        pg->seq[t] = seqs[t], pg->pos[t] = poss[t];
        if (poss[t] + 1 > lens[seqs[t]]) lens[seqs[t]] = poss[t] + 1;
    }
    for (int s = 0; s < n_seqs; s++) {
        need += (lens[s] + bs - 1) / bs;
        if ((lens[s] + bs - 1) / bs > mb) mb = (lens[s] + bs - 1) / bs;
    }
    oracle_kv_alloc(&pg->kv, dt, n_head_kv * hd, bs, need + 3, n_seqs, mb + 1);
    oracle_kv_scatter(&pg->kv, lens, 1 << 30, rng += 0x9e3779b97f4a7c15ull);
    oracle_kv_fill(&pg->kv, rng += 0x9e3779b97f4a7c15ull, 1.0f, 2.0f);
}

/* The cache's buffers on the device and the HAL descriptor over them. */
typedef struct paged_dev {
    duet_buffer *k, *v, *table;
} paged_dev;

static paged_dev paged_upload(duet_backend *be, const paged *pg) {
    return (paged_dev){dev_buf(be, pg->kv.k, oracle_kv_pool_bytes(&pg->kv)),
                       dev_buf(be, pg->kv.v, oracle_kv_pool_bytes(&pg->kv)),
                       dev_buf(be, pg->kv.table, oracle_kv_table_bytes(&pg->kv))};
}

static duet_kv_pages paged_views(const paged *pg, paged_dev d) {
    return oracle_kv_pages(&pg->kv, dv(d.k), dv(d.v), dv(d.table));
}

static void paged_dev_free(duet_backend *be, paged_dev d) {
    duet_buffer_free(be, d.k), duet_buffer_free(be, d.v), duet_buffer_free(be, d.table);
}

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
        paged_init(&pg, DUET_DTYPE_Q8_0, 1, 32, 4, 2, 3, seqs, poss);
        for (int i = 0; i < pg.kv.n_seqs * pg.kv.max_blocks; i++)
            pg.kv.table[i] = i % 2 ? -1000000 : 1 << 30;
        const size_t qbytes = 3 * 64 * 4;
        float q[3 * 64];
        for (int i = 0; i < 3 * 64; i++)
            q[i] = frand();
        paged_dev d = paged_upload(be, &pg);
        duet_buffer *bq = dev_buf(be, q, qbytes), *bpos = dev_buf(be, pg.pos, 12),
                    *bseq = dev_buf(be, pg.seq, 12), *bo = dev_buf(be, NULL, qbytes);
        float k[3 * 32], v[3 * 32];
        for (int i = 0; i < 96; i++)
            k[i] = frand(), v[i] = frand();
        duet_buffer *bkk = dev_buf(be, k, sizeof k), *bvv = dev_buf(be, v, sizeof v);
        duet_op rope = {.kind = DUET_OP_ROPE_KV, .n_tokens = 3};
        rope.rope_kv.q = dv(bq), rope.rope_kv.k = dv(bkk), rope.rope_kv.v = dv(bvv);
        rope.rope_kv.pos = dv(bpos), rope.rope_kv.seq = dv(bseq);
        rope.rope_kv.kv = paged_views(&pg, d);
        rope.rope_kv.n_head = 2, rope.rope_kv.n_head_kv = 1, rope.rope_kv.head_dim = 32,
        rope.rope_kv.n_rot = 32;
        float fr[16];
        oracle_rope_freqs(10000.0f, 32, fr);
        duet_buffer *bfr = dev_buf(be, fr, sizeof fr);
        rope.rope_kv.freqs = dv(bfr);
        ck_assert_msg(run_op(be, &rope) == DUET_OK, "rope_kv with a bad table: %s", duet_last_error());
        duet_op op = {.kind = DUET_OP_ATTENTION, .n_tokens = 3};
        op.attention.q = dv(bq), op.attention.pos = dv(bpos), op.attention.seq = dv(bseq);
        op.attention.kv = paged_views(&pg, d);
        op.attention.n_head = 2, op.attention.n_head_kv = 1, op.attention.head_dim = 32;
        op.attention.scale = 0.2f, op.attention.out = dv(bo);
        ck_assert_msg(run_op(be, &op) == DUET_OK, "attention with a bad table: %s", duet_last_error());
        float *got = dev_get(be, bo, qbytes, "attention (bad table)");
        for (int i = 0; i < 3 * 64; i++)
            ck_assert_msg(isfinite(got[i]), "out[%d] = %g", i, (double)got[i]);
        free(got);
        free(dev_get(be, d.k, oracle_kv_pool_bytes(&pg.kv), "k pool (bad table)"));
        free(dev_get(be, d.v, oracle_kv_pool_bytes(&pg.kv), "v pool (bad table)"));
        paged_dev_free(be, d);
        duet_buffer_free(be, bq), duet_buffer_free(be, bpos), duet_buffer_free(be, bseq);
        duet_buffer_free(be, bo), duet_buffer_free(be, bkk), duet_buffer_free(be, bvv),
            duet_buffer_free(be, bfr);
        oracle_kv_free(&pg.kv);
        duet_backend_close(be);
    }
}
END_TEST

/* One attention op of n_head heads over pg (f32 out) against the oracle;
 * returns the backend's plan for it, its split length and split count. */
static const char *attention_check(duet_backend *be, const paged *pg, int n_head, int hd, float scale,
                                   int *split_len, int *n_splits, const char *what) {
    const int nt = pg->n_tokens, width = n_head * hd, n_head_kv = pg->kv.width / hd;
    const size_t qbytes = (size_t)nt * width * 4;
    float *q = malloc(qbytes), *want = malloc(qbytes);
    for (int i = 0; i < nt * width; i++)
        q[i] = frand();
    duet_buffer *bq = dev_buf(be, q, qbytes), *bpos = dev_buf(be, pg->pos, (size_t)nt * 4),
                *bseq = dev_buf(be, pg->seq, (size_t)nt * 4);
    paged_dev d = paged_upload(be, pg);
    duet_buffer *bo = dev_buf(be, NULL, qbytes);
    duet_op op = {.kind = DUET_OP_ATTENTION, .n_tokens = nt};
    op.attention.q = dv(bq), op.attention.pos = dv(bpos), op.attention.seq = dv(bseq);
    op.attention.kv = paged_views(pg, d);
    op.attention.n_head = n_head, op.attention.n_head_kv = n_head_kv, op.attention.head_dim = hd;
    op.attention.scale = scale;
    op.attention.out = dv(bo);
    const char *plan = duet__ocl_attention_plan((ocl_backend *)be, &op, split_len, n_splits);
    ck_assert_ptr_nonnull(plan);
    ck_assert_msg(run_op(be, &op) == DUET_OK, "%s: %s", what, duet_last_error());
    float *got = dev_get(be, bo, qbytes, what);
    oracle_attention(q, pg->pos, pg->seq, nt, n_head, n_head_kv, hd, scale, 0, &pg->kv, want, NULL);
    check_close(got, want, (int64_t)nt * width, 2e-5, 2e-5, what);
    free(got), free(q), free(want);
    duet_buffer_free(be, bq), duet_buffer_free(be, bpos), duet_buffer_free(be, bseq);
    paged_dev_free(be, d);
    duet_buffer_free(be, bo);
    return plan;
}

/* scratch_bytes: nothing before any op; a split decode allocates exactly
 * its partials, linear in the context the block table allows (tokens x
 * heads x splits x (head_dim + 2) floats); a larger op raises the
 * high-water mark, a smaller one leaves it. Not rerun under oclgrind: in a
 * process of its own there (it used to follow the paged attention checks)
 * the simulator loses track of what is initialised once the partials
 * buffer grows, and reports the reduce's reads of the partials the decode
 * kernel wrote (the test as it was before the oracle does the same; see
 * duet__ocl_scratch). */
START_TEST(test_scratch_bytes) {
    if (!have_device()) return;
    duet_backend *be = open_tuned("att_mode=1,att_occ=0,att_split=32");
    ck_assert_int_eq(duet_backend_scratch_bytes(be), 0);
    size_t prev = 0, peak = 0;
    for (int ctx = 64; ctx <= 256; ctx *= 2) {
        const int seqs[2] = {0, 1}, poss[2] = {ctx - 1, ctx / 2};
        paged pg;
        paged_init(&pg, DUET_DTYPE_F16, 1, 32, 16, 2, 2, seqs, poss);
        int split_len, n_splits;
        ck_assert_str_eq(attention_check(be, &pg, 2, 32, 0.2f, &split_len, &n_splits, "attention (scratch)"),
                         "decode");
        ck_assert_int_eq(split_len, 32);
        ck_assert_int_eq(n_splits, (pg.kv.max_blocks * pg.kv.block_size + 31) / 32);
        /* tokens x heads x splits x (m, l, acc); while the buffer grows the
         * old one still counts (enqueued work may use it). */
        const size_t part = (size_t)2 * 2 * n_splits * (32 + 2) * 4;
        ck_assert_msg(part > prev, "partials did not grow with the context");
        ck_assert_msg(duet_backend_scratch_bytes(be) == prev + part,
                      "ctx %d: scratch %zu, expected %zu + %zu", ctx, duet_backend_scratch_bytes(be), prev,
                      part);
        peak = prev + part;
        prev = part;
        oracle_kv_free(&pg.kv);
    }
    /* A one-split op needs no partials and leaves the mark where it was. */
    paged one;
    paged_init(&one, DUET_DTYPE_F32, 1, 32, 16, 1, 1, (int[]){0}, (int[]){3});
    int split_len, n_splits;
    attention_check(be, &one, 2, 32, 0.2f, &split_len, &n_splits, "attention (one split)");
    oracle_kv_free(&one.kv);
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

/* Runs binary under oclgrind's checks with env; fails on a failed run, an
 * output lacking `want`, or any report, naming `what`. */
static void under_oclgrind(const char *binary, const char *const env[], const char *want, const char *what) {
    char log[128];
    snprintf(log, sizeof log, "/tmp/duet-oclgrind-%ld-%s.log", (long)getpid(), what);
    remove(log);
    char *argv[] = {"oclgrind", "--check-api", "--data-races", "--uninitialized",
                    "--log",    log,           (char *)binary, NULL};
    char *out;
    int rc = run_with_env(argv, env, &out);
    size_t n = 0;
    char *report = test_read_file(log, &n);
    ck_assert_msg(rc == 0 && strstr(out, want), "%s under oclgrind failed (rc %d):\n%s", what, rc,
                  tail(out, 2000));
    ck_assert_msg(n == 0, "%s: oclgrind reported problems:\n%.2000s", what, report ? report : "");
    free(report);
    free(out);
    remove(log);
}

/* Every kernel on small shapes under oclgrind: the case table's OpenCL
 * variants (the simulator's own tuning entry, with work-group reductions
 * and barriers, then every forced path), in two halves (one ctest case
 * each: the longest test on a cold machine), the first with the HAL checks
 * and this file's kernel checks. Any report fails the test. */
START_TEST(test_oclgrind) {
    if (system("command -v oclgrind >/dev/null 2>&1") != 0) {
        printf("SKIP oclgrind: not installed\n");
        ck_assert_msg(!required(), "opencl is required but oclgrind (the kernel checker) is not installed");
        return;
    }
    /* The first half runs every test case of the binary (the HAL checks
     * too), the second only the OpenCL variants. Not the CLBlast variant:
     * CLBlast keeps its programs in a static cache that it releases at exit,
     * after the simulator has torn down its LLVM, and the process aborts
     * there ("corrupted double-linked list" in clblast::Cache's destructor;
     * the kernels are CLBlast's, not ours). Under ASan: oclgrind preloads
     * its runtime ahead of ASan's, and leaks. The HAL's streams test runs
     * its streams in turn here (oclgrind's checkers are not thread-safe). */
    const char *ops_env[] = {_i == 0 ? "DUET_OPS_SHARD=0/2" : "DUET_OPS_SHARD=1/2",
                             "DUET_OPS_VARIANTS=!clblast_min=2",
                             "DUET_OPS_BACKENDS=opencl",
                             "DUET_OPS_CASES=small",
                             "DUET_OPENCL_CACHE=0",
                             "DUET_REQUIRE_BACKENDS=opencl",
                             "DUET_TEST_STREAMS_SERIAL=1",
                             "CK_FORK=no",
                             "ASAN_OPTIONS=verify_asan_link_order=0:detect_leaks=0",
                             _i == 0 ? NULL : "CK_INCLUDE_TAGS=variants",
                             NULL};
    under_oclgrind(ops_binary(), ops_env, "Oclgrind Simulator",
                   _i == 0 ? "the case table (first half)" : "the case table (second half)");
    if (_i != 0) return;
    char self[1024];
    snprintf(self, sizeof self, "%s/test_opencl", DUET_BINARY_DIR);
    const char *env[] = {"CK_INCLUDE_TAGS=kernels",
                         "DUET_OPENCL_CACHE=0",
                         "DUET_REQUIRE_BACKENDS=opencl",
                         "CK_FORK=no",
                         "ASAN_OPTIONS=verify_asan_link_order=0:detect_leaks=0",
                         NULL};
    under_oclgrind(self, env, "100%: Checks: 1", "the kernel checks");
}
END_TEST

int main(void) {
    Suite *s = suite_create("opencl");
    /* One ctest test per case (tests/check_tests.cmake): the API checks,
     * oclgrind, and the kernel checks. */
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
    tcase_add_test(tc, test_scratch_bytes);
    suite_add_tcase(s, tc);
    TCase *tg[2] = {tcase_create("oclgrind_a"), tcase_create("oclgrind_b")};
    for (int i = 0; i < 2; i++) {
        tcase_set_timeout(tg[i], 1200);
        tcase_add_loop_test(tg[i], test_oclgrind, i, i + 1);
        suite_add_tcase(s, tg[i]);
    }
    /* Kernel checks (also rerun under oclgrind, which selects them by their tag). */
    TCase *tk = tcase_create("kernels");
    tcase_set_timeout(tk, 1200);
    tcase_set_tags(tk, "kernels");
    tcase_add_test(tk, test_attention_bad_table);
    suite_add_tcase(s, tk);
    return test_run_suite(s);
}
