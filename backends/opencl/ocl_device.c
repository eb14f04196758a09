/* ocl_device.c — OpenCL platforms and devices through the ICD loader, the
 * device info the HAL reports, and CL error names.
 *
 * Devices are enumerated once per process (pthread_once): the list is
 * read-only afterwards, so every instance and thread shares it. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ocl_internal.h"

#include <CL/cl_ext.h>

/* ---- errors ----------------------------------------------------------------- */

const char *duet__ocl_error_name(cl_int err) {
    switch (err) {
#define E(x)                                                                                                 \
    case x:                                                                                                  \
        return #x;
        E(CL_SUCCESS)
        E(CL_DEVICE_NOT_FOUND)
        E(CL_DEVICE_NOT_AVAILABLE)
        E(CL_COMPILER_NOT_AVAILABLE)
        E(CL_MEM_OBJECT_ALLOCATION_FAILURE)
        E(CL_OUT_OF_RESOURCES)
        E(CL_OUT_OF_HOST_MEMORY)
        E(CL_PROFILING_INFO_NOT_AVAILABLE)
        E(CL_MEM_COPY_OVERLAP)
        E(CL_IMAGE_FORMAT_MISMATCH)
        E(CL_IMAGE_FORMAT_NOT_SUPPORTED)
        E(CL_BUILD_PROGRAM_FAILURE)
        E(CL_MAP_FAILURE)
        E(CL_MISALIGNED_SUB_BUFFER_OFFSET)
        E(CL_EXEC_STATUS_ERROR_FOR_EVENTS_IN_WAIT_LIST)
        E(CL_COMPILE_PROGRAM_FAILURE)
        E(CL_LINKER_NOT_AVAILABLE)
        E(CL_LINK_PROGRAM_FAILURE)
        E(CL_DEVICE_PARTITION_FAILED)
        E(CL_KERNEL_ARG_INFO_NOT_AVAILABLE)
        E(CL_INVALID_VALUE)
        E(CL_INVALID_DEVICE_TYPE)
        E(CL_INVALID_PLATFORM)
        E(CL_INVALID_DEVICE)
        E(CL_INVALID_CONTEXT)
        E(CL_INVALID_QUEUE_PROPERTIES)
        E(CL_INVALID_COMMAND_QUEUE)
        E(CL_INVALID_HOST_PTR)
        E(CL_INVALID_MEM_OBJECT)
        E(CL_INVALID_IMAGE_FORMAT_DESCRIPTOR)
        E(CL_INVALID_IMAGE_SIZE)
        E(CL_INVALID_SAMPLER)
        E(CL_INVALID_BINARY)
        E(CL_INVALID_BUILD_OPTIONS)
        E(CL_INVALID_PROGRAM)
        E(CL_INVALID_PROGRAM_EXECUTABLE)
        E(CL_INVALID_KERNEL_NAME)
        E(CL_INVALID_KERNEL_DEFINITION)
        E(CL_INVALID_KERNEL)
        E(CL_INVALID_ARG_INDEX)
        E(CL_INVALID_ARG_VALUE)
        E(CL_INVALID_ARG_SIZE)
        E(CL_INVALID_KERNEL_ARGS)
        E(CL_INVALID_WORK_DIMENSION)
        E(CL_INVALID_WORK_GROUP_SIZE)
        E(CL_INVALID_WORK_ITEM_SIZE)
        E(CL_INVALID_GLOBAL_OFFSET)
        E(CL_INVALID_EVENT_WAIT_LIST)
        E(CL_INVALID_EVENT)
        E(CL_INVALID_OPERATION)
        E(CL_INVALID_GL_OBJECT)
        E(CL_INVALID_BUFFER_SIZE)
        E(CL_INVALID_MIP_LEVEL)
        E(CL_INVALID_GLOBAL_WORK_SIZE)
        E(CL_INVALID_PROPERTY)
        E(CL_INVALID_IMAGE_DESCRIPTOR)
        E(CL_INVALID_COMPILER_OPTIONS)
        E(CL_INVALID_LINKER_OPTIONS)
        E(CL_INVALID_DEVICE_PARTITION_COUNT)
#undef E
    case -1001:
        return "CL_PLATFORM_NOT_FOUND_KHR";
    }
    return "unknown CL error";
}

duet_status duet__ocl_fail(cl_int err, const char *expr, const char *file, int line) {
    duet_status st = DUET_DEVICE;
    if (err == CL_OUT_OF_HOST_MEMORY || err == CL_MEM_OBJECT_ALLOCATION_FAILURE || err == CL_OUT_OF_RESOURCES)
        st = DUET_OUT_OF_MEMORY;
    else if (err == CL_BUILD_PROGRAM_FAILURE || err == CL_COMPILE_PROGRAM_FAILURE)
        st = DUET_COMPILE;
    const char *base = strrchr(file, '/');
    return duet__error(st, "opencl: %s failed: %s (%d) at %s:%d", expr, duet__ocl_error_name(err), (int)err,
                       base ? base + 1 : file, line);
}

/* ---- enumeration ---------------------------------------------------------------- */

#define OCL_MAX_DEVICES 32

static pthread_once_t ocl_once = PTHREAD_ONCE_INIT;
static ocl_device ocl_list[OCL_MAX_DEVICES];
static int ocl_n;
static char ocl_why[256];

static bool has_ext(const char *exts, const char *name) {
    size_t n = strlen(name);
    for (const char *p = exts; (p = strstr(p, name)) != NULL; p += n)
        if ((p == exts || p[-1] == ' ') && (p[n] == ' ' || p[n] == 0)) return true;
    return false;
}

static void get_str(cl_device_id d, cl_device_info what, char *out, size_t size) {
    out[0] = 0;
    if (clGetDeviceInfo(d, what, size, out, NULL) != CL_SUCCESS) out[0] = 0;
    out[size - 1] = 0;
}

/* Vendor names as people say them (PoCL reports the CPU's "GenuineIntel"). */
static const char *vendor_name(const char *v) {
    if (strstr(v, "NVIDIA")) return "NVIDIA";
    if (strstr(v, "Advanced Micro Devices") || strstr(v, "AMD") || strstr(v, "AuthenticAMD")) return "AMD";
    if (strstr(v, "Intel") || strstr(v, "GenuineIntel")) return "Intel";
    if (strstr(v, "ARM") || strstr(v, "Arm")) return "ARM";
    if (strstr(v, "Qualcomm")) return "Qualcomm";
    if (strstr(v, "Apple")) return "Apple";
    return v;
}

static void fill_device(ocl_device *d, cl_platform_id p, cl_device_id id) {
    memset(d, 0, sizeof *d);
    d->platform = p;
    d->id = id;
    duet_device_info *info = &d->info;
    get_str(id, CL_DEVICE_NAME, info->name, sizeof info->name);
    char vendor[128];
    get_str(id, CL_DEVICE_VENDOR, vendor, sizeof vendor);
    snprintf(info->vendor, sizeof info->vendor, "%s", vendor_name(vendor));
    char drv[96];
    get_str(id, CL_DRIVER_VERSION, drv, sizeof drv);
    if (clGetPlatformInfo(p, CL_PLATFORM_NAME, sizeof d->platform_name, d->platform_name, NULL) != CL_SUCCESS)
        d->platform_name[0] = 0;
    d->platform_name[sizeof d->platform_name - 1] = 0;
    /* PoCL keeps every build in its kcache ($POCL_CACHE_DIR, ~/.cache/pocl). */
    d->own_kernel_cache = strstr(d->platform_name, "Portable Computing Language") != NULL;
    snprintf(info->driver, sizeof info->driver, "%s %s", d->platform_name, drv);
    get_str(id, CL_DEVICE_VERSION, d->version, sizeof d->version);

    cl_device_type type = 0;
    cl_bool unified = CL_FALSE;
    clGetDeviceInfo(id, CL_DEVICE_TYPE, sizeof type, &type, NULL);
    clGetDeviceInfo(id, CL_DEVICE_HOST_UNIFIED_MEMORY, sizeof unified, &unified, NULL);
    d->unified = unified;
    if (type & CL_DEVICE_TYPE_CPU)
        info->type = DUET_DEVICE_CPU;
    else if (type & CL_DEVICE_TYPE_GPU)
        info->type = unified ? DUET_DEVICE_INTEGRATED_GPU : DUET_DEVICE_DISCRETE_GPU;
    else
        info->type = DUET_DEVICE_OTHER;

    cl_ulong mem = 0;
    cl_uint cu = 0;
    clGetDeviceInfo(id, CL_DEVICE_GLOBAL_MEM_SIZE, sizeof mem, &mem, NULL);
    clGetDeviceInfo(id, CL_DEVICE_MAX_COMPUTE_UNITS, sizeof cu, &cu, NULL);
    clGetDeviceInfo(id, CL_DEVICE_LOCAL_MEM_SIZE, sizeof d->local_mem, &d->local_mem, NULL);
    clGetDeviceInfo(id, CL_DEVICE_MAX_MEM_ALLOC_SIZE, sizeof d->max_alloc, &d->max_alloc, NULL);
    clGetDeviceInfo(id, CL_DEVICE_MAX_WORK_GROUP_SIZE, sizeof d->max_wg, &d->max_wg, NULL);
    cl_device_local_mem_type lt = CL_LOCAL;
    clGetDeviceInfo(id, CL_DEVICE_LOCAL_MEM_TYPE, sizeof lt, &lt, NULL);
    d->local_is_global = lt == CL_GLOBAL;
    info->memory_bytes = mem;
    info->compute_units = (int)cu;

    size_t ext_size = 0;
    char *exts = NULL;
    if (clGetDeviceInfo(id, CL_DEVICE_EXTENSIONS, 0, NULL, &ext_size) == CL_SUCCESS && ext_size) {
        exts = calloc(1, ext_size + 1);
        if (exts && clGetDeviceInfo(id, CL_DEVICE_EXTENSIONS, ext_size, exts, NULL) != CL_SUCCESS)
            exts[0] = 0;
    }
    const char *e = exts ? exts : "";
    d->fp16 = has_ext(e, "cl_khr_fp16");
    d->fp64 = has_ext(e, "cl_khr_fp64");
    d->subgroups = has_ext(e, "cl_khr_subgroups");
    if (has_ext(e, "cl_khr_integer_dot_product")) {
        /* The extension alone says little: its capability bits say which
         * built-ins exist (packed words and/or char4), and the acceleration
         * properties whether they map to hardware instructions. */
        cl_ulong caps = 0;
        if (clGetDeviceInfo(id, CL_DEVICE_INTEGER_DOT_PRODUCT_CAPABILITIES_KHR, sizeof caps, &caps, NULL) ==
            CL_SUCCESS) {
            d->int_dot_packed = (caps & CL_DEVICE_INTEGER_DOT_PRODUCT_INPUT_4x8BIT_PACKED_KHR) != 0;
            d->int_dot = d->int_dot_packed || (caps & CL_DEVICE_INTEGER_DOT_PRODUCT_INPUT_4x8BIT_KHR) != 0;
        }
        cl_device_integer_dot_product_acceleration_properties_khr acc;
        memset(&acc, 0, sizeof acc);
        if (d->int_dot &&
            clGetDeviceInfo(id,
                            d->int_dot_packed
                                ? CL_DEVICE_INTEGER_DOT_PRODUCT_ACCELERATION_PROPERTIES_4x8BIT_PACKED_KHR
                                : CL_DEVICE_INTEGER_DOT_PRODUCT_ACCELERATION_PROPERTIES_8BIT_KHR,
                            sizeof acc, &acc, NULL) == CL_SUCCESS)
            d->int_dot_accel = acc.signed_accelerated || acc.accumulating_saturating_signed_accelerated;
    }
    free(exts);
    char cver[128];
    get_str(id, CL_DEVICE_OPENCL_C_VERSION, cver, sizeof cver);
    int major = 0;
    d->cl30 = sscanf(cver, "OpenCL C %d", &major) == 1 && major >= 3;
    info->fp16 = d->fp16;
    info->int8_dot = d->int_dot;
    info->coopmat = false;
    info->q8_activations = true;
    info->subgroup_size = 0; /* OpenCL 1.2 has no query; cl_khr_subgroups sizes are per kernel */
    snprintf(
        info->features, sizeof info->features,
        "%s; local memory %llu KiB%s; max alloc %llu MiB; max work-group %zu; fp64 %s; cl_khr_subgroups %s; "
        "cl_khr_integer_dot_product %s",
        d->version, (unsigned long long)(d->local_mem >> 10), d->local_is_global ? " (global)" : "",
        (unsigned long long)(d->max_alloc >> 20), d->max_wg, d->fp64 ? "yes" : "no",
        d->subgroups ? "yes" : "no",
        !d->int_dot         ? "no"
        : d->int_dot_packed ? (d->int_dot_accel ? "packed 4x8, accelerated" : "packed 4x8")
        : d->int_dot_accel  ? "4x8, accelerated"
                            : "4x8");
}

static void enumerate(void) {
    cl_uint np = 0;
    cl_int err = clGetPlatformIDs(0, NULL, &np);
    if (err != CL_SUCCESS || np == 0) {
        snprintf(ocl_why, sizeof ocl_why, "no OpenCL platform (ICD loader: %s)",
                 err != CL_SUCCESS ? duet__ocl_error_name(err) : "0 platforms");
        return;
    }
    cl_platform_id plats[16];
    if (np > 16) np = 16;
    if ((err = clGetPlatformIDs(np, plats, NULL)) != CL_SUCCESS) {
        snprintf(ocl_why, sizeof ocl_why, "clGetPlatformIDs: %s", duet__ocl_error_name(err));
        return;
    }
    for (cl_uint p = 0; p < np && ocl_n < OCL_MAX_DEVICES; p++) {
        cl_uint nd = 0;
        cl_device_id ids[OCL_MAX_DEVICES];
        if (clGetDeviceIDs(plats[p], CL_DEVICE_TYPE_ALL, OCL_MAX_DEVICES, ids, &nd) != CL_SUCCESS) continue;
        if (nd > OCL_MAX_DEVICES) nd = OCL_MAX_DEVICES;
        for (cl_uint i = 0; i < nd && ocl_n < OCL_MAX_DEVICES; i++) {
            cl_bool ok = CL_FALSE, compiler = CL_FALSE;
            clGetDeviceInfo(ids[i], CL_DEVICE_AVAILABLE, sizeof ok, &ok, NULL);
            clGetDeviceInfo(ids[i], CL_DEVICE_COMPILER_AVAILABLE, sizeof compiler, &compiler, NULL);
            /* Kernels are compiled at run time: a device without a compiler can't run them. */
            if (!ok || !compiler) continue;
            fill_device(&ocl_list[ocl_n++], plats[p], ids[i]);
        }
    }
    if (ocl_n == 0) snprintf(ocl_why, sizeof ocl_why, "%u OpenCL platform(s) but no usable device", np);
}

bool duet__ocl_devices(const ocl_device **list, int *n, char *why, size_t why_size) {
    pthread_once(&ocl_once, enumerate);
    *list = ocl_list;
    *n = ocl_n;
    if (ocl_n == 0 && why && why_size) snprintf(why, why_size, "%s", ocl_why);
    return ocl_n > 0;
}
