/* vk_device.c — the loader, the process-wide instance, and what each
 * physical device offers.
 *
 * volk loads libvulkan at run time: a machine without a loader or without a
 * driver gets a reason string from duet__vk_global() and the backend reports
 * itself unavailable, nothing else changes. The instance is created once per
 * process and kept (devices are enumerated from it); each backend instance
 * creates its own VkDevice. */
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "vk_internal.h"

/* ---- errors --------------------------------------------------------------------- */

const char *duet__vk_result_str(VkResult r) {
    switch (r) {
#define VK_RESULT_CASE(x)                                                                                    \
    case x:                                                                                                  \
        return #x;
        VK_RESULT_CASE(VK_SUCCESS)
        VK_RESULT_CASE(VK_NOT_READY)
        VK_RESULT_CASE(VK_TIMEOUT)
        VK_RESULT_CASE(VK_INCOMPLETE)
        VK_RESULT_CASE(VK_ERROR_OUT_OF_HOST_MEMORY)
        VK_RESULT_CASE(VK_ERROR_OUT_OF_DEVICE_MEMORY)
        VK_RESULT_CASE(VK_ERROR_INITIALIZATION_FAILED)
        VK_RESULT_CASE(VK_ERROR_DEVICE_LOST)
        VK_RESULT_CASE(VK_ERROR_MEMORY_MAP_FAILED)
        VK_RESULT_CASE(VK_ERROR_LAYER_NOT_PRESENT)
        VK_RESULT_CASE(VK_ERROR_EXTENSION_NOT_PRESENT)
        VK_RESULT_CASE(VK_ERROR_FEATURE_NOT_PRESENT)
        VK_RESULT_CASE(VK_ERROR_INCOMPATIBLE_DRIVER)
        VK_RESULT_CASE(VK_ERROR_TOO_MANY_OBJECTS)
        VK_RESULT_CASE(VK_ERROR_FORMAT_NOT_SUPPORTED)
        VK_RESULT_CASE(VK_ERROR_FRAGMENTED_POOL)
        VK_RESULT_CASE(VK_ERROR_OUT_OF_POOL_MEMORY)
        VK_RESULT_CASE(VK_ERROR_INVALID_EXTERNAL_HANDLE)
        VK_RESULT_CASE(VK_ERROR_FRAGMENTATION)
        VK_RESULT_CASE(VK_ERROR_UNKNOWN)
#undef VK_RESULT_CASE
    default:
        return "VK_ERROR_(unlisted)";
    }
}

duet_status duet__vk_fail(VkResult r, const char *expr, const char *file, int line) {
    duet_status st = DUET_DEVICE;
    if (r == VK_ERROR_OUT_OF_HOST_MEMORY || r == VK_ERROR_OUT_OF_DEVICE_MEMORY ||
        r == VK_ERROR_FRAGMENTED_POOL || r == VK_ERROR_OUT_OF_POOL_MEMORY || r == VK_ERROR_TOO_MANY_OBJECTS)
        st = DUET_OUT_OF_MEMORY;
    else if (r == VK_ERROR_INCOMPATIBLE_DRIVER || r == VK_ERROR_INITIALIZATION_FAILED)
        st = DUET_NO_DEVICE;
    else if (r == VK_ERROR_DEVICE_LOST)
        st = DUET_DEVICE_LOST; /* the VkDevice is unusable from now on: the engine stops serving */
    const char *base = strrchr(file, '/');
    return duet__error(st, "vulkan: %s failed: %s (%d) at %s:%d", expr, duet__vk_result_str(r), (int)r,
                       base ? base + 1 : file, line);
}

/* ---- validation messages ------------------------------------------------------------ */

static atomic_int vk_val_errors;
static char vk_val_first[512];
static pthread_mutex_t vk_val_lock = PTHREAD_MUTEX_INITIALIZER;

static VKAPI_ATTR VkBool32 VKAPI_CALL vk_debug_cb(VkDebugUtilsMessageSeverityFlagBitsEXT severity,
                                                  VkDebugUtilsMessageTypeFlagsEXT types,
                                                  const VkDebugUtilsMessengerCallbackDataEXT *data,
                                                  void *user) {
    (void)types;
    (void)user;
    if (!(severity & VK_DEBUG_UTILS_MESSAGE_SEVERITY_ERROR_BIT_EXT)) return VK_FALSE;
    const char *msg = data && data->pMessage ? data->pMessage : "(no message)";
    if (atomic_fetch_add(&vk_val_errors, 1) == 0) {
        pthread_mutex_lock(&vk_val_lock);
        snprintf(vk_val_first, sizeof vk_val_first, "%s", msg);
        pthread_mutex_unlock(&vk_val_lock);
    }
    fprintf(stderr, "duet vulkan validation: %s\n", msg);
    return VK_FALSE;
}

static atomic_bool vk_val_on;

int duet__vk_validation_errors(void) {
    return atomic_load(&vk_val_on) ? atomic_load(&vk_val_errors) : -1;
}

const char *duet__vk_validation_first(void) {
    return vk_val_first;
}

/* ---- the instance ---------------------------------------------------------------------- */

static pthread_mutex_t vk_global_lock = PTHREAD_MUTEX_INITIALIZER;
static vk_global vk_g;
static bool vk_g_tried;
static char vk_g_why[256];

static bool has_ext(const VkExtensionProperties *e, uint32_t n, const char *name) {
    for (uint32_t i = 0; i < n; i++)
        if (strcmp(e[i].extensionName, name) == 0) return true;
    return false;
}

static bool has_layer(const char *name) {
    uint32_t n = 0;
    if (vkEnumerateInstanceLayerProperties(&n, NULL) != VK_SUCCESS || n == 0) return false;
    VkLayerProperties *l = calloc(n, sizeof *l);
    bool found = false;
    if (l && vkEnumerateInstanceLayerProperties(&n, l) == VK_SUCCESS)
        for (uint32_t i = 0; i < n && !found; i++)
            found = strcmp(l[i].layerName, name) == 0;
    free(l);
    return found;
}

static const char *vendor_name(uint32_t id) {
    switch (id) {
    case 0x10DE:
        return "NVIDIA";
    case 0x1002:
        return "AMD";
    case 0x1022:
        return "AMD";
    case 0x8086:
        return "Intel";
    case 0x13B5:
        return "ARM";
    case 0x5143:
        return "Qualcomm";
    case 0x1010:
        return "Imagination";
    case 0x106B:
        return "Apple";
    case 0x10005:
        return "Mesa";
    default:
        return NULL;
    }
}

static duet_device_type device_type(VkPhysicalDeviceType t) {
    switch (t) {
    case VK_PHYSICAL_DEVICE_TYPE_DISCRETE_GPU:
        return DUET_DEVICE_DISCRETE_GPU;
    case VK_PHYSICAL_DEVICE_TYPE_INTEGRATED_GPU:
        return DUET_DEVICE_INTEGRATED_GPU;
    case VK_PHYSICAL_DEVICE_TYPE_CPU:
        return DUET_DEVICE_CPU;
    default:
        return DUET_DEVICE_OTHER;
    }
}

/* Appends printf output to a fixed buffer (truncating). */
static void appendf(char *buf, size_t size, const char *fmt, ...) {
    size_t len = strlen(buf);
    if (len + 1 >= size) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf + len, size - len, fmt, ap);
    va_end(ap);
}

/* Fills one vk_physical; false (with a reason) if the device cannot run
 * the backend (no compute queue, Vulkan < 1.2). */
static bool probe_device(VkPhysicalDevice pd, vk_physical *p, char *why, size_t why_size) {
    memset(p, 0, sizeof *p);
    p->pd = pd;
    vkGetPhysicalDeviceProperties(pd, &p->props);
    vkGetPhysicalDeviceMemoryProperties(pd, &p->mem);
    if (p->props.apiVersion < VK_API_VERSION_1_2) {
        snprintf(why, why_size, "%s supports Vulkan %u.%u; duet needs 1.2", p->props.deviceName,
                 VK_API_VERSION_MAJOR(p->props.apiVersion), VK_API_VERSION_MINOR(p->props.apiVersion));
        return false;
    }

    uint32_t nq = 0;
    vkGetPhysicalDeviceQueueFamilyProperties(pd, &nq, NULL);
    VkQueueFamilyProperties *qf = calloc(nq ? nq : 1, sizeof *qf);
    if (!qf) return false;
    vkGetPhysicalDeviceQueueFamilyProperties(pd, &nq, qf);
    /* Prefer a compute-only family (an async compute queue on GPUs), else
     * any family with compute. */
    int best = -1;
    for (uint32_t i = 0; i < nq; i++) {
        if (!(qf[i].queueFlags & VK_QUEUE_COMPUTE_BIT)) continue;
        bool compute_only = !(qf[i].queueFlags & VK_QUEUE_GRAPHICS_BIT);
        if (best < 0 || (compute_only && (qf[best].queueFlags & VK_QUEUE_GRAPHICS_BIT))) best = (int)i;
    }
    if (best < 0) {
        free(qf);
        snprintf(why, why_size, "%s has no compute queue", p->props.deviceName);
        return false;
    }
    p->queue_family = (uint32_t)best;
    p->queue_count = qf[best].queueCount ? qf[best].queueCount : 1;
    p->timestamp_bits = p->props.limits.timestampComputeAndGraphics ? qf[best].timestampValidBits : 0;
    free(qf);

    uint32_t ne = 0;
    vkEnumerateDeviceExtensionProperties(pd, NULL, &ne, NULL);
    VkExtensionProperties *ext = calloc(ne ? ne : 1, sizeof *ext);
    if (!ext) return false;
    vkEnumerateDeviceExtensionProperties(pd, NULL, &ne, ext);
    bool api13 = p->props.apiVersion >= VK_API_VERSION_1_3;
    p->has_int_dot_ext = !api13 && has_ext(ext, ne, VK_KHR_SHADER_INTEGER_DOT_PRODUCT_EXTENSION_NAME);
    p->has_coopmat_ext =
        has_ext(ext, ne, "VK_KHR_cooperative_matrix") || has_ext(ext, ne, "VK_NV_cooperative_matrix");
    free(ext);

    /* Features (1.1/1.2 structs are core at 1.2; integer dot is core at 1.3). */
    VkPhysicalDeviceShaderIntegerDotProductFeatures dotf = {
        .sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SHADER_INTEGER_DOT_PRODUCT_FEATURES};
    VkPhysicalDeviceVulkan12Features f12 = {.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_2_FEATURES};
    VkPhysicalDeviceVulkan11Features f11 = {.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_1_FEATURES,
                                            .pNext = &f12};
    if (api13 || p->has_int_dot_ext) f12.pNext = &dotf;
    VkPhysicalDeviceFeatures2 f2 = {.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2, .pNext = &f11};
    vkGetPhysicalDeviceFeatures2(pd, &f2);
    p->fp16 = f12.shaderFloat16;
    p->int8 = f12.shaderInt8;
    p->storage8 = f12.storageBuffer8BitAccess;
    p->storage16 = f11.storageBuffer16BitAccess;
    p->int_dot = dotf.shaderIntegerDotProduct;

    VkPhysicalDeviceShaderIntegerDotProductProperties dotp = {
        .sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SHADER_INTEGER_DOT_PRODUCT_PROPERTIES};
    VkPhysicalDeviceSubgroupProperties sg = {.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SUBGROUP_PROPERTIES};
    VkPhysicalDeviceDriverProperties drv = {.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_DRIVER_PROPERTIES,
                                            .pNext = &sg};
    if (p->int_dot) sg.pNext = &dotp;
    VkPhysicalDeviceProperties2 pr2 = {.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2,
                                       .pNext = &drv};
    vkGetPhysicalDeviceProperties2(pd, &pr2);
    p->driver_id = drv.driverID;
    p->subgroup_size = sg.subgroupSize;
    p->subgroup_ops = sg.supportedOperations;
    p->subgroup_arith = (sg.supportedStages & VK_SHADER_STAGE_COMPUTE_BIT) &&
                        (sg.supportedOperations & VK_SUBGROUP_FEATURE_ARITHMETIC_BIT);
    p->subgroup_shuffle = (sg.supportedStages & VK_SHADER_STAGE_COMPUTE_BIT) &&
                          (sg.supportedOperations & VK_SUBGROUP_FEATURE_SHUFFLE_BIT);
    p->int_dot_accel =
        p->int_dot && (dotp.integerDotProduct4x8BitPackedSignedAccelerated ||
                       dotp.integerDotProductAccumulatingSaturating4x8BitPackedSignedAccelerated);
    p->coopmat = p->has_coopmat_ext;

    /* The public description. */
    duet_device_info *info = &p->info;
    snprintf(info->name, sizeof info->name, "%s", p->props.deviceName);
    const char *vn = vendor_name(p->props.vendorID);
    if (vn)
        snprintf(info->vendor, sizeof info->vendor, "%s", vn);
    else
        snprintf(info->vendor, sizeof info->vendor, "0x%04x", p->props.vendorID);
    snprintf(info->driver, sizeof info->driver, "%.40s %.60s (Vulkan %u.%u.%u)", drv.driverName,
             drv.driverInfo, VK_API_VERSION_MAJOR(p->props.apiVersion),
             VK_API_VERSION_MINOR(p->props.apiVersion), VK_API_VERSION_PATCH(p->props.apiVersion));
    info->type = device_type(p->props.deviceType);
    uint64_t local = 0, any = 0;
    for (uint32_t i = 0; i < p->mem.memoryHeapCount; i++) {
        any += p->mem.memoryHeaps[i].size;
        if (p->mem.memoryHeaps[i].flags & VK_MEMORY_HEAP_DEVICE_LOCAL_BIT)
            local += p->mem.memoryHeaps[i].size;
    }
    info->memory_bytes = local ? local : any;
    info->compute_units = 0; /* Vulkan does not say */
    info->fp16 = p->fp16;
    info->int8_dot = p->int_dot;
    info->coopmat = p->coopmat;
    info->q8_activations = true;
    info->subgroup_size = (int)p->subgroup_size;
    char *f = info->features;
    f[0] = 0;
    appendf(f, sizeof info->features, "fp16-arith=%s fp16-storage=%s int8-storage=%s int8-dot=%s%s",
            p->fp16 ? "yes" : "no", p->storage16 ? "yes" : "no", p->storage8 ? "yes" : "no",
            p->int_dot ? "yes" : "no", p->int_dot ? (p->int_dot_accel ? "(accelerated)" : "(emulated)") : "");
    appendf(f, sizeof info->features, " subgroup=%u ops=%s%s%s%s%s", p->subgroup_size,
            (sg.supportedOperations & VK_SUBGROUP_FEATURE_ARITHMETIC_BIT) ? "arith," : "",
            (sg.supportedOperations & VK_SUBGROUP_FEATURE_BALLOT_BIT) ? "ballot," : "",
            (sg.supportedOperations & VK_SUBGROUP_FEATURE_SHUFFLE_BIT) ? "shuffle," : "",
            (sg.supportedOperations & VK_SUBGROUP_FEATURE_VOTE_BIT) ? "vote," : "",
            (sg.supportedOperations & VK_SUBGROUP_FEATURE_CLUSTERED_BIT) ? "clustered" : "");
    appendf(f, sizeof info->features, " coopmat=%s timestamps=%s", p->coopmat ? "yes" : "no",
            p->timestamp_bits ? "yes" : "no");
    appendf(f, sizeof info->features, " heaps=");
    for (uint32_t i = 0; i < p->mem.memoryHeapCount && i < 4; i++)
        appendf(f, sizeof info->features, "%s%.1fGiB%s", i ? "," : "",
                (double)p->mem.memoryHeaps[i].size / (1024.0 * 1024 * 1024),
                (p->mem.memoryHeaps[i].flags & VK_MEMORY_HEAP_DEVICE_LOCAL_BIT) ? "(local)" : "");
    appendf(f, sizeof info->features, " max-storage-range=%uMiB",
            p->props.limits.maxStorageBufferRange >> 20);
    return true;
}

/* Creates the instance: Vulkan 1.2, portability enumeration where the
 * loader has it, validation when asked. */
static bool create_instance(char *why, size_t why_size) {
    uint32_t api = VK_API_VERSION_1_0;
    if (vkEnumerateInstanceVersion) vkEnumerateInstanceVersion(&api);
    if (api < VK_API_VERSION_1_2) {
        snprintf(why, why_size, "the Vulkan loader is %u.%u; duet needs 1.2", VK_API_VERSION_MAJOR(api),
                 VK_API_VERSION_MINOR(api));
        return false;
    }
    vk_g.api_version = api;

    uint32_t ne = 0;
    vkEnumerateInstanceExtensionProperties(NULL, &ne, NULL);
    VkExtensionProperties *ext = calloc(ne ? ne : 1, sizeof *ext);
    if (!ext) return false;
    vkEnumerateInstanceExtensionProperties(NULL, &ne, ext);
    const char *exts[5];
    uint32_t n_exts = 0;
    VkInstanceCreateFlags flags = 0;
    if (has_ext(ext, ne, VK_KHR_PORTABILITY_ENUMERATION_EXTENSION_NAME)) {
        exts[n_exts++] = VK_KHR_PORTABILITY_ENUMERATION_EXTENSION_NAME;
        flags |= VK_INSTANCE_CREATE_ENUMERATE_PORTABILITY_BIT_KHR;
    }
    const char *want_val = getenv("DUET_VK_VALIDATION");
    bool validation = want_val && strcmp(want_val, "0") != 0;
    const char *layers[1] = {"VK_LAYER_KHRONOS_validation"};
    bool sync_validation = false;
    if (validation) {
        if (!has_layer(layers[0])) {
            free(ext);
            snprintf(why, why_size,
                     "DUET_VK_VALIDATION is set but VK_LAYER_KHRONOS_validation is not installed");
            return false;
        }
        exts[n_exts++] = VK_EXT_DEBUG_UTILS_EXTENSION_NAME;
        /* Synchronization validation too: it checks that the barriers the
         * backend records cover every hazard between dispatches. */
        uint32_t nl = 0;
        vkEnumerateInstanceExtensionProperties(layers[0], &nl, NULL);
        VkExtensionProperties *le = calloc(nl ? nl : 1, sizeof *le);
        if (le && vkEnumerateInstanceExtensionProperties(layers[0], &nl, le) == VK_SUCCESS &&
            has_ext(le, nl, VK_EXT_VALIDATION_FEATURES_EXTENSION_NAME)) {
            exts[n_exts++] = VK_EXT_VALIDATION_FEATURES_EXTENSION_NAME;
            sync_validation = true;
        }
        free(le);
    }
    free(ext);

    VkApplicationInfo app = {
        .sType = VK_STRUCTURE_TYPE_APPLICATION_INFO,
        .pApplicationName = "duet",
        .pEngineName = "duet",
        .apiVersion = VK_API_VERSION_1_3 <= api ? VK_API_VERSION_1_3 : VK_API_VERSION_1_2,
    };
    VkDebugUtilsMessengerCreateInfoEXT dbg = {
        .sType = VK_STRUCTURE_TYPE_DEBUG_UTILS_MESSENGER_CREATE_INFO_EXT,
        .messageSeverity =
            VK_DEBUG_UTILS_MESSAGE_SEVERITY_ERROR_BIT_EXT | VK_DEBUG_UTILS_MESSAGE_SEVERITY_WARNING_BIT_EXT,
        .messageType = VK_DEBUG_UTILS_MESSAGE_TYPE_GENERAL_BIT_EXT |
                       VK_DEBUG_UTILS_MESSAGE_TYPE_VALIDATION_BIT_EXT |
                       VK_DEBUG_UTILS_MESSAGE_TYPE_PERFORMANCE_BIT_EXT,
        .pfnUserCallback = vk_debug_cb,
    };
    const VkValidationFeatureEnableEXT enables[1] = {
        VK_VALIDATION_FEATURE_ENABLE_SYNCHRONIZATION_VALIDATION_EXT};
    VkValidationFeaturesEXT features = {
        .sType = VK_STRUCTURE_TYPE_VALIDATION_FEATURES_EXT,
        .enabledValidationFeatureCount = 1,
        .pEnabledValidationFeatures = enables,
    };
    if (sync_validation) dbg.pNext = &features;
    VkInstanceCreateInfo ci = {
        .sType = VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO,
        .pNext = validation ? &dbg : NULL, /* also catches errors of create/destroy itself */
        .flags = flags,
        .pApplicationInfo = &app,
        .enabledLayerCount = validation ? 1 : 0,
        .ppEnabledLayerNames = layers,
        .enabledExtensionCount = n_exts,
        .ppEnabledExtensionNames = exts,
    };
    VkResult r = vkCreateInstance(&ci, NULL, &vk_g.instance);
    if (r != VK_SUCCESS) {
        snprintf(why, why_size, "vkCreateInstance failed: %s", duet__vk_result_str(r));
        return false;
    }
    volkLoadInstance(vk_g.instance); /* device functions go through the loader's trampolines: right for any
                                        number of devices */
    vk_g.validation = validation;
    atomic_store(&vk_val_on, validation);
    if (validation && vkCreateDebugUtilsMessengerEXT) {
        dbg.pNext = NULL; /* the validation features belong to the instance only */
        vkCreateDebugUtilsMessengerEXT(vk_g.instance, &dbg, NULL, &vk_g.messenger);
    }
    return true;
}

const vk_global *duet__vk_global(char *why, size_t why_size) {
    pthread_mutex_lock(&vk_global_lock);
    if (!vk_g_tried) {
        vk_g_tried = true;
        VkResult r = volkInitialize();
        if (r != VK_SUCCESS) {
            snprintf(vk_g_why, sizeof vk_g_why, "no Vulkan loader (libvulkan.so.1 not found)");
        } else if (create_instance(vk_g_why, sizeof vk_g_why)) {
            uint32_t n = 0;
            r = vkEnumeratePhysicalDevices(vk_g.instance, &n, NULL);
            VkPhysicalDevice pds[VK_MAX_DEVICES];
            if (n > VK_MAX_DEVICES) n = VK_MAX_DEVICES;
            if (r == VK_SUCCESS || r == VK_INCOMPLETE) r = vkEnumeratePhysicalDevices(vk_g.instance, &n, pds);
            if (r != VK_SUCCESS && r != VK_INCOMPLETE) {
                snprintf(vk_g_why, sizeof vk_g_why, "vkEnumeratePhysicalDevices failed: %s",
                         duet__vk_result_str(r));
                n = 0;
            }
            char skip[256] = "";
            for (uint32_t i = 0; i < n; i++) {
                char reason[256];
                if (probe_device(pds[i], &vk_g.devices[vk_g.n_devices], reason, sizeof reason))
                    vk_g.n_devices++;
                else if (!skip[0])
                    snprintf(skip, sizeof skip, "%s", reason);
            }
            if (vk_g.n_devices == 0 && !vk_g_why[0])
                snprintf(vk_g_why, sizeof vk_g_why, "%s",
                         n == 0 ? "no Vulkan driver or device (the loader found no ICD)" : skip);
        }
    }
    const vk_global *g = vk_g.n_devices > 0 ? &vk_g : NULL;
    if (!g && why) snprintf(why, why_size, "%s", vk_g_why);
    pthread_mutex_unlock(&vk_global_lock);
    return g;
}
