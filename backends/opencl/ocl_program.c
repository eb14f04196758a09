/* ocl_program.c — kernel sources, run-time compilation and the on-disk
 * program binary cache.
 *
 * A program is kernels/common.cl followed by kernels/<family>.cl, built
 * with the device's feature defines and the op's -D options. Sources come
 * from the library (embedded at build time) or, when $DUET_KERNEL_DIR is
 * set, from .cl files in that directory (edit a kernel, rerun, no rebuild).
 *
 * Binaries are cached under duet__ocl_cache_dir(), one file per program
 * (unless the driver caches builds itself: duet__ocl_use_cache),
 * named by a 64-bit FNV-1a hash of the device name, driver version,
 * sources and options: a new driver or an edited kernel gets a new key. A
 * cached binary that fails to load is rebuilt from source and replaced. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ocl_internal.h"
#include "ocl_sources.h"

/* ---- sources ------------------------------------------------------------------- */

/* The text of kernels/<name>.cl: from $DUET_KERNEL_DIR when set (malloc'd,
 * *owned = true), else the embedded copy. */
static duet_status source_text(const char *name, const char **text, bool *owned) {
    *owned = false;
    const char *dir = getenv("DUET_KERNEL_DIR");
    if (dir && *dir) {
        char path[1024];
        snprintf(path, sizeof path, "%s/%s.cl", dir, name);
        FILE *f = fopen(path, "rb");
        if (!f)
            return duet__error(DUET_IO, "opencl: DUET_KERNEL_DIR: cannot open %s: %s", path, strerror(errno));
        char *buf = NULL;
        long n = -1;
        if (fseek(f, 0, SEEK_END) == 0 && (n = ftell(f)) >= 0 && fseek(f, 0, SEEK_SET) == 0)
            buf = malloc((size_t)n + 1);
        if (!buf || fread(buf, 1, (size_t)n, f) != (size_t)n) {
            free(buf);
            fclose(f);
            return duet__error(DUET_IO, "opencl: DUET_KERNEL_DIR: cannot read %s", path);
        }
        fclose(f);
        buf[n] = 0;
        *text = buf;
        *owned = true;
        return DUET_OK;
    }
    for (int i = 0; i < duet__ocl_source_count; i++)
        if (strcmp(duet__ocl_sources[i].name, name) == 0) {
            *text = duet__ocl_sources[i].text;
            return DUET_OK;
        }
    return duet__error(DUET_INVALID_ARGUMENT, "opencl: no kernel source '%s.cl' in this build", name);
}

/* ---- the disk cache ---------------------------------------------------------------- */

void duet__ocl_cache_dir(char *out, size_t size) {
    out[0] = 0;
    const char *off = getenv("DUET_OPENCL_CACHE");
    if (off && strcmp(off, "0") == 0) return;
    const char *dir = getenv("DUET_OPENCL_CACHE_DIR");
    if (dir && *dir) {
        snprintf(out, size, "%s", dir);
        return;
    }
    const char *xdg = getenv("XDG_CACHE_HOME"), *home = getenv("HOME");
    if (xdg && *xdg)
        snprintf(out, size, "%s/duet/opencl", xdg);
    else if (home && *home)
        snprintf(out, size, "%s/.cache/duet/opencl", home);
}

bool duet__ocl_use_cache(const ocl_device *dev) {
    const char *on = getenv("DUET_OPENCL_CACHE");
    if (on && strcmp(on, "0") == 0) return false;
    if (on && strcmp(on, "1") == 0) return true;
    return !dev->own_kernel_cache;
}

static uint64_t fnv1a(uint64_t h, const void *data, size_t n) {
    const unsigned char *p = data;
    for (size_t i = 0; i < n; i++)
        h = (h ^ p[i]) * 0x100000001b3ull;
    return h;
}

/* mkdir -p */
static bool make_dirs(const char *path) {
    char buf[1024];
    snprintf(buf, sizeof buf, "%s", path);
    for (char *p = buf + 1; *p; p++) {
        if (*p != '/') continue;
        *p = 0;
        if (mkdir(buf, 0755) != 0 && errno != EEXIST) return false;
        *p = '/';
    }
    return mkdir(buf, 0755) == 0 || errno == EEXIST;
}

static unsigned char *read_all(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    unsigned char *buf = NULL;
    long len = -1;
    if (fseek(f, 0, SEEK_END) == 0 && (len = ftell(f)) > 0 && fseek(f, 0, SEEK_SET) == 0)
        buf = malloc((size_t)len);
    if (buf && fread(buf, 1, (size_t)len, f) != (size_t)len) {
        free(buf);
        buf = NULL;
    }
    fclose(f);
    if (buf) *n = (size_t)len;
    return buf;
}

/* Writes the program's binary to `path` through a temporary file and a
 * rename, so a concurrent reader never sees half a file. Failure only
 * costs a rebuild next time. */
static bool save_binary(cl_program prog, const char *dir, const char *path) {
    size_t size = 0;
    if (clGetProgramInfo(prog, CL_PROGRAM_BINARY_SIZES, sizeof size, &size, NULL) != CL_SUCCESS || size == 0)
        return false;
    unsigned char *bin = malloc(size);
    if (!bin) return false;
    unsigned char *bins[1] = {bin};
    bool ok =
        clGetProgramInfo(prog, CL_PROGRAM_BINARIES, sizeof bins, bins, NULL) == CL_SUCCESS && make_dirs(dir);
    if (ok) {
        char tmp[1100];
        /* Unique per process and program: instances may build at once. */
        snprintf(tmp, sizeof tmp, "%s.%ld.%p.tmp", path, (long)getpid(), (void *)prog);
        FILE *f = fopen(tmp, "wb");
        ok = f && fwrite(bin, 1, size, f) == size;
        if (f) ok = fclose(f) == 0 && ok;
        ok = ok && rename(tmp, path) == 0;
        if (!ok) remove(tmp);
    }
    free(bin);
    return ok;
}

/* ---- building ------------------------------------------------------------------------- */

static duet_status build_log_error(ocl_backend *be, cl_program prog, const char *family, const char *opts) {
    size_t n = 0;
    clGetProgramBuildInfo(prog, be->dev->id, CL_PROGRAM_BUILD_LOG, 0, NULL, &n);
    char *log = malloc(n + 1);
    if (log && clGetProgramBuildInfo(prog, be->dev->id, CL_PROGRAM_BUILD_LOG, n, log, NULL) != CL_SUCCESS)
        log[0] = 0;
    if (log) log[n] = 0;
    duet_status st = duet__error(DUET_COMPILE,
                                 "opencl: building kernels/%s.cl for %s failed (options: %s); build log:\n%s",
                                 family, be->dev->info.name, opts, log ? log : "(no log)");
    free(log);
    return st;
}

static duet_status build_program(ocl_backend *be, const char *family, const char *options, cl_program *out) {
    *out = NULL;
    const char *common = NULL, *body = NULL;
    bool own_common = false, own_body = false;
    duet_status st = source_text("common", &common, &own_common);
    if (st == DUET_OK) st = source_text(family, &body, &own_body);
    if (st != DUET_OK) {
        if (own_common) free((void *)common);
        return st;
    }
    char opts[1024];
    /* OpenCL C 1.2 unless the variant asks for another version. */
    snprintf(opts, sizeof opts, "%s %s %s", strstr(options, "-cl-std=") ? "" : "-cl-std=CL1.2",
             be->dev_options, options);

    /* The cache key covers everything that changes the binary. */
    uint64_t h = 0xcbf29ce484222325ull;
    h = fnv1a(h, be->dev->info.name, strlen(be->dev->info.name) + 1);
    h = fnv1a(h, be->dev->info.driver, strlen(be->dev->info.driver) + 1);
    h = fnv1a(h, be->dev->version, strlen(be->dev->version) + 1);
    h = fnv1a(h, common, strlen(common) + 1);
    h = fnv1a(h, body, strlen(body) + 1);
    h = fnv1a(h, opts, strlen(opts) + 1);
    char dir[900] = "", path[1024];
    if (duet__ocl_use_cache(be->dev)) duet__ocl_cache_dir(dir, sizeof dir);
    path[0] = 0;
    if (dir[0]) snprintf(path, sizeof path, "%s/%s-%016llx.bin", dir, family, (unsigned long long)h);

    cl_int err;
    cl_program prog = NULL;
    if (path[0]) {
        size_t n = 0;
        unsigned char *bin = read_all(path, &n);
        if (bin) {
            const unsigned char *bins[1] = {bin};
            cl_int bin_status = CL_SUCCESS;
            prog = clCreateProgramWithBinary(be->ctx, 1, &be->dev->id, &n, bins, &bin_status, &err);
            if (prog && (err != CL_SUCCESS || bin_status != CL_SUCCESS ||
                         clBuildProgram(prog, 1, &be->dev->id, opts, NULL, NULL) != CL_SUCCESS)) {
                clReleaseProgram(prog);
                prog = NULL;
            }
            free(bin);
            if (prog) be->stats.programs_cached++;
        }
    }
    if (!prog) {
        const char *srcs[2] = {common, body};
        prog = clCreateProgramWithSource(be->ctx, 2, srcs, NULL, &err);
        if (!prog)
            st = duet__ocl_fail(err, "clCreateProgramWithSource", __FILE__, __LINE__);
        else if ((err = clBuildProgram(prog, 1, &be->dev->id, opts, NULL, NULL)) != CL_SUCCESS) {
            st = err == CL_BUILD_PROGRAM_FAILURE ? build_log_error(be, prog, family, opts)
                                                 : duet__ocl_fail(err, "clBuildProgram", __FILE__, __LINE__);
            clReleaseProgram(prog);
            prog = NULL;
        } else {
            be->stats.programs_built++;
            if (path[0] && save_binary(prog, dir, path)) be->stats.programs_cache_saved++;
        }
    }
    if (own_common) free((void *)common);
    if (own_body) free((void *)body);
    *out = prog;
    return st;
}

/* The program of (family, options) for be's device options: built once per
 * device and shared by its streams (a cl_program may be used from several
 * threads; the kernel objects made from it may not, so each stream makes
 * its own). Returns a reference of the caller's own. The caller holds
 * be->shared->mu. */
static duet_status shared_program(ocl_backend *be, const char *family, const char *options, cl_program *out) {
    ocl_shared *sh = be->shared;
    for (int i = 0; i < sh->n_programs; i++)
        if (!strcmp(sh->programs[i].family, family) && !strcmp(sh->programs[i].options, options) &&
            !strcmp(sh->programs[i].dev_options, be->dev_options)) {
            clRetainProgram(sh->programs[i].prog);
            *out = sh->programs[i].prog;
            return DUET_OK;
        }
    if (sh->n_programs == OCL_MAX_PROGRAMS)
        return duet__error(DUET_OUT_OF_MEMORY, "opencl: more than %d kernel variants", OCL_MAX_PROGRAMS);
    cl_program prog;
    duet_status st = build_program(be, family, options, &prog);
    if (st == DUET_COMPILE &&
        (strstr(be->dev_options, "HAVE_FP16") || strstr(be->dev_options, "HAVE_SUBGROUPS"))) {
        /* A driver that advertises cl_khr_fp16 or cl_khr_subgroups but
         * cannot compile their use under OpenCL C 1.2: fall back to the
         * portable paths (vload_half, local-memory reductions) for this
         * instance, keeping fp64 and SOFT_HALF. */
        const bool fp64 = strstr(be->dev_options, "HAVE_FP64") != NULL;
        const bool soft_half = strstr(be->dev_options, "SOFT_HALF") != NULL;
        snprintf(be->dev_options, sizeof be->dev_options, "%s%s", fp64 ? "-DHAVE_FP64=1 " : "",
                 soft_half ? "-DSOFT_HALF=1" : "");
        be->stats.feature_fallbacks++;
        st = build_program(be, family, options, &prog);
    }
    if (st != DUET_OK) return st;
    ocl_shared_program *p = &sh->programs[sh->n_programs++];
    snprintf(p->family, sizeof p->family, "%s", family);
    snprintf(p->options, sizeof p->options, "%s", options);
    snprintf(p->dev_options, sizeof p->dev_options, "%s", be->dev_options);
    p->prog = prog;
    clRetainProgram(prog);
    *out = prog;
    return DUET_OK;
}

duet_status duet__ocl_kernel(ocl_backend *be, const char *family, const char *options, const char *name,
                             cl_kernel *out) {
    *out = NULL;
    ocl_program *p = NULL;
    for (int i = 0; i < be->n_programs && !p; i++)
        if (!strcmp(be->programs[i].family, family) && !strcmp(be->programs[i].options, options))
            p = &be->programs[i];
    if (!p) {
        if (be->n_programs == OCL_MAX_PROGRAMS)
            return duet__error(DUET_OUT_OF_MEMORY, "opencl: more than %d kernel variants", OCL_MAX_PROGRAMS);
        if (strlen(options) >= sizeof p->options || strlen(family) >= sizeof p->family)
            return duet__error(DUET_INVALID_ARGUMENT, "opencl: kernel options too long");
        cl_program prog = NULL;
        pthread_mutex_lock(&be->shared->mu);
        duet_status st = shared_program(be, family, options, &prog);
        pthread_mutex_unlock(&be->shared->mu);
        if (st != DUET_OK) return st;
        p = &be->programs[be->n_programs++];
        memset(p, 0, sizeof *p);
        snprintf(p->family, sizeof p->family, "%s", family);
        snprintf(p->options, sizeof p->options, "%s", options);
        p->prog = prog;
    }
    for (int i = 0; i < p->n_kernels; i++)
        if (!strcmp(p->kernel_names[i], name)) {
            *out = p->kernels[i];
            return DUET_OK;
        }
    if (p->n_kernels == OCL_MAX_KERNELS || strlen(name) >= sizeof p->kernel_names[0])
        return duet__error(DUET_INVALID_ARGUMENT, "opencl: too many kernels in %s.cl", family);
    cl_int err;
    cl_kernel k = clCreateKernel(p->prog, name, &err);
    if (!k) return duet__ocl_fail(err, name, __FILE__, __LINE__);
    snprintf(p->kernel_names[p->n_kernels], sizeof p->kernel_names[0], "%s", name);
    p->kernels[p->n_kernels++] = k;
    *out = k;
    return DUET_OK;
}

void duet__ocl_programs_free(ocl_backend *be) {
    for (int i = 0; i < be->n_programs; i++) {
        for (int k = 0; k < be->programs[i].n_kernels; k++)
            clReleaseKernel(be->programs[i].kernels[k]);
        clReleaseProgram(be->programs[i].prog);
    }
    be->n_programs = 0;
}
