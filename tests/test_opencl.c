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
    for (int i = 0; i < 40; i++) x[i] = (float)i - 20.0f, w[i] = 1.0f + (float)i / 40;
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
        if (strstr(list[i].platform_name, "Portable Computing Language") && list[i].info.type == DUET_DEVICE_CPU) {
            /* PoCL 3.1 (CI): no half arithmetic, no subgroups, no integer dot products. */
            ck_assert_msg(!list[i].info.fp16 && !list[i].subgroups && !list[i].info.int8_dot,
                          "PoCL reports fp16 %d subgroups %d int dot %d", list[i].info.fp16, list[i].subgroups,
                          list[i].info.int8_dot);
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
    ck_assert_msg(strstr(be->dev_options, "HAVE_FP16") && strstr(be->dev_options, "HAVE_SUBGROUPS"), "options: %s",
                  be->dev_options);
    duet_status st;
    float y = run_rmsnorm(&be->base, &st);
    ck_assert_msg(st == DUET_OK, "rmsnorm with claimed features: %s", duet_last_error());
    if (!list[0].fp16 || !list[0].subgroups) {
        ck_assert_int_eq(be->stats.feature_fallbacks, 1);
        ck_assert_msg(!strstr(be->dev_options, "HAVE_FP16") && strstr(be->dev_options, "HAVE_FP64"), "after fallback: %s",
                      be->dev_options);
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
        for (size_t i = 0; i < h.ops[oi].bytes / 4; i++) err += (fa[i] - fb[i]) * (double)(fa[i] - fb[i]), norm += (double)fa[i] * fa[i];
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
        for (int i = 0; env[i]; i++) putenv((char *)env[i]);
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
 * memory, multi-work-item attention, chunked CLBlast) forced on this
 * device, and the most serial CPU-style settings: parity must hold for
 * every tuning, not just the table's. */
START_TEST(test_forced_paths) {
    if (!have_device()) return;
    static const char *const tunes[] = {
        "DUET_OPENCL_TUNE=mv_r=16,mv_wg=64,mv_nr=4,mv_vw=4,mv_mt=3,mv_qg=8,norm_wg=64,att_wg=32,ew_wg=64,clblast_min=8,"
        "clblast_scratch_mb=1",
        "DUET_OPENCL_TUNE=mv_r=1,mv_wg=1,mv_nr=1,mv_vw=8,mv_mt=8,mv_qg=1,norm_wg=1,att_wg=1,ew_wg=0,clblast_min=0",
    };
    for (int i = 0; i < 2; i++) {
        const char *env[] = {tunes[i], "DUET_OPS_BACKENDS=opencl", "CK_FORK=no", NULL};
        char *argv[] = {(char *)ops_binary(), NULL};
        char *out;
        int rc = run_with_env(argv, env, &out);
        ck_assert_msg(rc == 0 && strstr(out, "0 failed"), "%s: test_backend_ops failed (rc %d):\n%s", tunes[i], rc, tail(out, 2000));
        free(out);
    }
}
END_TEST

/* Every kernel on small shapes under oclgrind, twice: with the simulator's
 * own tuning entry (work-group reductions, barriers) and with CPU-style
 * single-work-item settings. Any report fails the test. */
START_TEST(test_oclgrind) {
    if (system("command -v oclgrind >/dev/null 2>&1") != 0) {
        printf("SKIP oclgrind: not installed\n");
        ck_assert_msg(!required(), "opencl is required but oclgrind (the kernel checker) is not installed");
        return;
    }
    static const char *const tunes[] = {
        "DUET_OPENCL_TUNE=clblast_min=0",
        "DUET_OPENCL_TUNE=mv_r=1,mv_wg=4,mv_nr=4,mv_vw=16,mv_mt=4,mv_qg=8,norm_wg=1,att_wg=1,ew_wg=0,clblast_min=0",
    };
    for (int i = 0; i < 2; i++) {
        char log[128];
        snprintf(log, sizeof log, "/tmp/duet-oclgrind-%ld-%d.log", (long)getpid(), i);
        remove(log);
        /* Under ASan: oclgrind preloads its runtime ahead of ASan's, and leaks. */
        const char *env[] = {tunes[i], "DUET_OPS_BACKENDS=opencl", "DUET_OPS_CASES=small", "DUET_OPENCL_CACHE=0",
                             "DUET_REQUIRE_BACKENDS=opencl", "CK_FORK=no",
                             "ASAN_OPTIONS=verify_asan_link_order=0:detect_leaks=0", NULL};
        char *argv[] = {"oclgrind", "--check-api", "--data-races", "--uninitialized", "--log", log,
                        (char *)ops_binary(), NULL};
        char *out;
        int rc = run_with_env(argv, env, &out);
        size_t n = 0;
        char *report = test_read_file(log, &n);
        ck_assert_msg(rc == 0 && strstr(out, "Oclgrind Simulator") && strstr(out, "0 failed"),
                      "%s: the small cases under oclgrind failed (rc %d):\n%s", tunes[i], rc, tail(out, 2000));
        ck_assert_msg(n == 0, "%s: oclgrind reported problems:\n%.2000s", tunes[i], report ? report : "");
        free(report);
        free(out);
        remove(log);
    }
}
END_TEST

int main(void) {
    Suite *s = suite_create("opencl");
    TCase *tc = tcase_create("opencl");
    tcase_set_timeout(tc, 1200);
    tcase_add_test(tc, test_device_info);
    tcase_add_test(tc, test_no_platform);
    tcase_add_test(tc, test_program_cache);
    tcase_add_test(tc, test_kernel_dir_and_build_log);
    tcase_add_test(tc, test_feature_fallback);
    tcase_add_test(tc, test_tuning_override);
    tcase_add_test(tc, test_clblast_path);
    tcase_add_test(tc, test_profiling);
    tcase_add_test(tc, test_forced_paths);
    tcase_add_test(tc, test_oclgrind);
    suite_add_tcase(s, tc);
    return test_run_suite(s);
}
