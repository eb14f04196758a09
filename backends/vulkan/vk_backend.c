/* vk_backend.c — the Vulkan backend's interface: devices, instances and
 * their streams (vk_device: what they share), buffers, and steps.
 *
 * A step is one command buffer: begin() starts recording, each op records
 * its dispatches (vk_ops.c), with a pipeline barrier only where a dispatch
 * touches bytes an earlier one in the step wrote (or writes bytes one
 * read), submit() hands the buffer to the queue with a fence, wait() waits
 * for the fence and reports device-side index errors and, when the
 * validation layer is on, its errors. Buffers are allocated once by their
 * owner; the backend's own scratch (quantized activations, the RoPE table,
 * attention's split partials) grows to the largest op seen and is then
 * reused, so steady-state steps allocate nothing; scratch_bytes reports the
 * high-water mark of that memory. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "vk_internal.h"

/* ---- discovery ---------------------------------------------------------------------- */

static bool vk_available(char *why, size_t why_size) {
    return duet__vk_global(why, why_size) != NULL;
}

static int vk_device_count(void) {
    const vk_global *g = duet__vk_global(NULL, 0);
    return g ? g->n_devices : 0;
}

static duet_status vk_device_info(int index, duet_device_info *out) {
    char why[256];
    const vk_global *g = duet__vk_global(why, sizeof why);
    if (!g) return duet__error(DUET_NO_DEVICE, "vulkan: unavailable (%s)", why);
    if (index < 0 || index >= g->n_devices)
        return duet__error(DUET_NO_DEVICE, "vulkan: no device %d (it has %d)", index, g->n_devices);
    *out = g->devices[index].info;
    return DUET_OK;
}

/* ---- memory -------------------------------------------------------------------------- */

static int find_type(const VkPhysicalDeviceMemoryProperties *mp, uint32_t bits, VkMemoryPropertyFlags want) {
    for (uint32_t i = 0; i < mp->memoryTypeCount; i++)
        if ((bits >> i & 1) && (mp->memoryTypes[i].propertyFlags & want) == want) return (int)i;
    return -1;
}

/* Buffers live in device-local memory. When a device-local type is also
 * host-visible and its heap is (nearly) all of device memory (integrated
 * GPUs, CPU devices, resizable BAR), buffers use it and uploads are memcpy;
 * otherwise uploads go through a staging buffer. */
static void choose_memory(vk_backend *be) {
    const VkPhysicalDeviceMemoryProperties *mp = &be->phys->mem;
    VkDeviceSize largest_local = 0;
    for (uint32_t i = 0; i < mp->memoryHeapCount; i++)
        if ((mp->memoryHeaps[i].flags & VK_MEMORY_HEAP_DEVICE_LOCAL_BIT) &&
            mp->memoryHeaps[i].size > largest_local)
            largest_local = mp->memoryHeaps[i].size;
    const VkMemoryPropertyFlags uma = VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT |
                                      VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT |
                                      VK_MEMORY_PROPERTY_HOST_COHERENT_BIT;
    const VkMemoryPropertyFlags host =
        VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT | VK_MEMORY_PROPERTY_HOST_COHERENT_BIT;
    int t = find_type(mp, ~0u, uma);
    if (t >= 0 && mp->memoryHeaps[mp->memoryTypes[t].heapIndex].size * 10 >= largest_local * 9) {
        be->mem_type = (uint32_t)t;
        be->mem_host_visible = true;
    } else {
        t = find_type(mp, ~0u, VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT);
        be->mem_type = t >= 0 ? (uint32_t)t : 0;
        be->mem_host_visible = t >= 0 && (mp->memoryTypes[t].propertyFlags & host) == host;
    }
    t = find_type(mp, ~0u, host | VK_MEMORY_PROPERTY_HOST_CACHED_BIT);
    if (t < 0) t = find_type(mp, ~0u, host);
    be->staging_type = t >= 0 ? (uint32_t)t : be->mem_type;
    be->staging_bytes = (size_t)64 << 20;
    /* DUET_VK_STAGING=N: go through an N-byte staging buffer even when the
     * memory is host-visible, as on a discrete GPU (tests use it). */
    const char *env = getenv("DUET_VK_STAGING");
    long long n = env ? atoll(env) : 0;
    if (n > 0) {
        be->mem_host_visible = false;
        be->staging_bytes = (size_t)n < 256 ? 256 : (size_t)n;
    }
}

duet_status duet__vk_buffer_create(vk_backend *be, size_t size, bool host_visible, duet_buffer **out) {
    *out = NULL;
    /* Views read whole 16-byte texels: round the allocation up so the last
     * partial texel is inside the buffer. */
    size_t padded = (size + 15) & ~(size_t)15;
    if (padded < size || padded > be->max_alloc)
        return duet__error(
            DUET_OUT_OF_MEMORY,
            "vulkan: a buffer of %zu bytes is larger than %s allows in one allocation (%" PRIu64 ")", size,
            be->base.info.name, (uint64_t)be->max_alloc);
    duet_buffer *b = calloc(1, sizeof *b);
    if (!b) return duet__error(DUET_OUT_OF_MEMORY, "vulkan: buffer handle");
    b->head = (duet_buffer_head){.size = size, .kind = DUET_BUFFER_DEVICE};
    b->id = atomic_fetch_add(&be->shared->next_buffer_id, 1) + 1; /* unique on the device */
    VkBufferCreateInfo bi = {
        .sType = VK_STRUCTURE_TYPE_BUFFER_CREATE_INFO,
        .size = padded,
        .usage = VK_BUFFER_USAGE_STORAGE_BUFFER_BIT | VK_BUFFER_USAGE_UNIFORM_TEXEL_BUFFER_BIT |
                 VK_BUFFER_USAGE_TRANSFER_SRC_BIT | VK_BUFFER_USAGE_TRANSFER_DST_BIT,
        .sharingMode = VK_SHARING_MODE_EXCLUSIVE,
    };
    duet_status st = DUET_OK;
    VkResult r = vkCreateBuffer(be->dev, &bi, NULL, &b->buf);
    if (r != VK_SUCCESS) {
        free(b);
        return duet__vk_fail(r, "vkCreateBuffer", __FILE__, __LINE__);
    }
    VkMemoryRequirements req;
    vkGetBufferMemoryRequirements(be->dev, b->buf, &req);
    uint32_t type = host_visible ? be->staging_type : be->mem_type;
    if (!(req.memoryTypeBits >> type & 1)) {
        int t = find_type(&be->phys->mem, req.memoryTypeBits,
                          host_visible
                              ? VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT | VK_MEMORY_PROPERTY_HOST_COHERENT_BIT
                              : VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT);
        if (t < 0) {
            st = duet__error(DUET_DEVICE, "vulkan: no memory type for a buffer");
            goto fail;
        }
        type = (uint32_t)t;
    }
    VkMemoryAllocateInfo ai = {
        .sType = VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_INFO,
        .allocationSize = req.size,
        .memoryTypeIndex = type,
    };
    r = vkAllocateMemory(be->dev, &ai, NULL, &b->mem);
    if (r != VK_SUCCESS) {
        st = r == VK_ERROR_OUT_OF_DEVICE_MEMORY || r == VK_ERROR_OUT_OF_HOST_MEMORY
                 ? duet__error(DUET_OUT_OF_MEMORY, "vulkan: out of device memory allocating %zu bytes on %s",
                               size, be->base.info.name)
                 : duet__vk_fail(r, "vkAllocateMemory", __FILE__, __LINE__);
        goto fail;
    }
    if ((r = vkBindBufferMemory(be->dev, b->buf, b->mem, 0)) != VK_SUCCESS) {
        st = duet__vk_fail(r, "vkBindBufferMemory", __FILE__, __LINE__);
        goto fail;
    }
    if ((host_visible || be->mem_host_visible) &&
        (be->phys->mem.memoryTypes[type].propertyFlags & VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT)) {
        if ((r = vkMapMemory(be->dev, b->mem, 0, VK_WHOLE_SIZE, 0, &b->map)) != VK_SUCCESS) {
            st = duet__vk_fail(r, "vkMapMemory", __FILE__, __LINE__);
            goto fail;
        }
        b->head.kind = DUET_BUFFER_HOST;
    }
    /* Texel views: one, or overlapping windows (each spanning at most the
     * device's texel limit, starting every half limit) so that any range of
     * up to half the limit lies inside one view. */
    size_t span = (size_t)be->max_texel_bytes, stride = padded <= span ? padded : span / 2;
    stride &= ~(size_t)(be->texel_align - 1);
    for (size_t start = 0; start < padded && st == DUET_OK; start += stride) {
        if (b->n_views == VK_MAX_VIEWS) {
            st = duet__error(DUET_UNSUPPORTED,
                             "vulkan: a %zu-byte buffer needs more than %d texel views on %s", size,
                             VK_MAX_VIEWS, be->base.info.name);
            break;
        }
        size_t len = padded - start < span ? padded - start : span;
        VkBufferViewCreateInfo vi = {
            .sType = VK_STRUCTURE_TYPE_BUFFER_VIEW_CREATE_INFO,
            .buffer = b->buf,
            .format = VK_FORMAT_R32G32B32A32_UINT,
            .offset = start,
            .range = len,
        };
        if ((r = vkCreateBufferView(be->dev, &vi, NULL, &b->views[b->n_views])) != VK_SUCCESS) {
            st = duet__vk_fail(r, "vkCreateBufferView", __FILE__, __LINE__);
            break;
        }
        b->view_span[b->n_views++] = len;
        b->view_stride = stride;
        if (start + len >= padded) break;
    }
    if (st != DUET_OK) goto fail;
    b->alloc_bytes = (size_t)req.size;
    *out = b;
    return DUET_OK;
fail:
    duet__vk_buffer_destroy(be, b);
    return st;
}

duet_status duet__vk_own_buffer_create(vk_backend *be, size_t size, bool host_visible, duet_buffer **out) {
    duet_status st = duet__vk_buffer_create(be, size, host_visible, out);
    if (st != DUET_OK) return st;
    (*out)->own = true;
    be->scratch_now += (*out)->alloc_bytes;
    if (be->scratch_now > be->scratch_peak) be->scratch_peak = be->scratch_now;
    return DUET_OK;
}

duet_status duet__vk_retire(vk_backend *be, duet_buffer *b) {
    if (!b) return DUET_OK;
    if (!be->in_step) {
        duet__vk_buffer_destroy(be, b);
        return DUET_OK;
    }
    /* The step recorded so far may use it. */
    if (be->n_retired == (int)(sizeof be->retired / sizeof be->retired[0]))
        return duet__error(DUET_UNSUPPORTED, "vulkan: scratch regrown too often in one step");
    be->retired[be->n_retired++] = b;
    return DUET_OK;
}

void duet__vk_buffer_destroy(vk_backend *be, duet_buffer *b) {
    if (!b) return;
    if (b->own) be->scratch_now -= b->alloc_bytes;
    for (int i = 0; i < b->n_views; i++)
        vkDestroyBufferView(be->dev, b->views[i], NULL);
    if (b->buf) vkDestroyBuffer(be->dev, b->buf, NULL);
    if (b->mem) vkFreeMemory(be->dev, b->mem, NULL); /* unmaps too */
    free(b);
}

static duet_status vk_wait(duet_backend *base);

/* ---- submission helpers ---------------------------------------------------------------- */

static duet_status fence_wait(vk_backend *be) {
    VK_TRY(vkWaitForFences(be->dev, 1, &be->fence, VK_TRUE, UINT64_MAX));
    VK_TRY(vkResetFences(be->dev, 1, &be->fence));
    return DUET_OK;
}

/* Submits to the stream's queue, which other streams may share: the host
 * access to a VkQueue must be externally synchronised. */
static VkResult queue_submit(vk_backend *be, const VkSubmitInfo *si) {
    pthread_mutex_lock(be->queue_mu);
    VkResult r = vkQueueSubmit(be->queue, 1, si, be->fence);
    pthread_mutex_unlock(be->queue_mu);
    return r;
}

/* Copies between a buffer and the staging buffer: one command buffer,
 * submitted and waited. */
static duet_status staged_copy(vk_backend *be, duet_buffer *b, size_t off, size_t size, bool to_device) {
    VK_TRY(vkResetCommandBuffer(be->xfer, 0));
    VkCommandBufferBeginInfo bi = {.sType = VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO,
                                   .flags = VK_COMMAND_BUFFER_USAGE_ONE_TIME_SUBMIT_BIT};
    VK_TRY(vkBeginCommandBuffer(be->xfer, &bi));
    VkBufferCopy c = {.srcOffset = to_device ? 0 : off, .dstOffset = to_device ? off : 0, .size = size};
    if (to_device)
        vkCmdCopyBuffer(be->xfer, be->staging->buf, b->buf, 1, &c);
    else
        vkCmdCopyBuffer(be->xfer, b->buf, be->staging->buf, 1, &c);
    VK_TRY(vkEndCommandBuffer(be->xfer));
    VkSubmitInfo si = {
        .sType = VK_STRUCTURE_TYPE_SUBMIT_INFO, .commandBufferCount = 1, .pCommandBuffers = &be->xfer};
    VK_TRY(queue_submit(be, &si));
    return fence_wait(be);
}

/* Data moves between steps: finish a submitted step first. */
static duet_status settle(vk_backend *be, const char *what) {
    if (be->in_step)
        return duet__error(DUET_INVALID_ARGUMENT, "vulkan: %s inside a step (between begin and submit)",
                           what);
    if (be->submitted) return vk_wait(&be->base);
    return DUET_OK;
}

duet_status duet__vk_write(vk_backend *be, duet_buffer *b, size_t off, const void *src, size_t size) {
    if (b->map) {
        memcpy((char *)b->map + off, src, size);
        return DUET_OK;
    }
    size_t cap = be->staging->head.size;
    for (size_t done = 0; done < size;) {
        size_t n = size - done < cap ? size - done : cap;
        memcpy(be->staging->map, (const char *)src + done, n);
        duet_status st = staged_copy(be, b, off + done, n, true);
        if (st != DUET_OK) return st;
        done += n;
    }
    return DUET_OK;
}

static duet_status vk_upload(duet_backend *base, duet_buffer *buf, size_t offset, const void *src,
                             size_t size) {
    vk_backend *be = (vk_backend *)base;
    duet_status st = settle(be, "upload"); /* the registry checked the range */
    if (st != DUET_OK) return st;
    /* The bytes change under any cached quantization of them. */
    if (buf->id == be->xq_src_id) be->xq_src_id = 0;
    return duet__vk_write(be, buf, offset, src, size);
}

static duet_status vk_download(duet_backend *base, duet_buffer *buf, size_t offset, void *dst, size_t size) {
    vk_backend *be = (vk_backend *)base;
    duet_status st = settle(be, "download"); /* the registry checked the range */
    if (st != DUET_OK) return st;
    if (buf->map) {
        memcpy(dst, (const char *)buf->map + offset, size);
        return DUET_OK;
    }
    size_t cap = be->staging->head.size;
    for (size_t done = 0; done < size;) {
        size_t n = size - done < cap ? size - done : cap;
        if ((st = staged_copy(be, buf, offset + done, n, false)) != DUET_OK) return st;
        memcpy((char *)dst + done, be->staging->map, n);
        done += n;
    }
    return DUET_OK;
}

static duet_status vk_buffer_alloc(duet_backend *base, size_t size, duet_buffer **out) {
    return duet__vk_buffer_create((vk_backend *)base, size, false, out);
}

static void vk_buffer_free(duet_backend *base, duet_buffer *buf) {
    vk_backend *be = (vk_backend *)base;
    if (!buf) return;
    /* A submitted step may still read it. */
    if (be->submitted) vk_wait(base);
    if (buf->id == be->xq_src_id) be->xq_src_id = 0;
    duet__vk_buffer_destroy(be, buf);
}

duet_status duet__vk_scratch_reserve(vk_backend *be, duet_buffer **b, size_t size) {
    if (*b && (*b)->head.size >= size) return DUET_OK;
    size_t want = size + size / 2; /* grow geometrically: rare reallocations */
    if (be->in_step && be->n_retired == (int)(sizeof be->retired / sizeof be->retired[0]))
        return duet__error(DUET_UNSUPPORTED, "vulkan: scratch regrown too often in one step");
    duet_buffer *nb;
    duet_status st = duet__vk_own_buffer_create(be, want, false, &nb);
    if (st != DUET_OK) return st;
    duet__vk_retire(be, *b); /* cannot fail: a slot was checked above */
    *b = nb;
    return DUET_OK;
}

static size_t vk_scratch_bytes(duet_backend *base) {
    return ((vk_backend *)base)->scratch_peak;
}

/* ---- instance ------------------------------------------------------------------------ */

/* DUET_VK_LIMITS=ssbo=N,texel=N,alloc=N shrinks the device's limits (bytes)
 * so tests reach the range-splitting paths with small tensors. */
static duet_status apply_limits(vk_backend *be) {
    const char *env = getenv("DUET_VK_LIMITS");
    if (!env || !*env) return DUET_OK;
    char buf[256];
    snprintf(buf, sizeof buf, "%s", env);
    for (char *save = NULL, *kv = strtok_r(buf, ",", &save); kv; kv = strtok_r(NULL, ",", &save)) {
        char *eq = strchr(kv, '='), *end = NULL;
        unsigned long long v = eq ? strtoull(eq + 1, &end, 10) : 0;
        if (!eq || !*(eq + 1) || *end || v < 256 || v % 256)
            return duet__error(DUET_INVALID_ARGUMENT,
                               "DUET_VK_LIMITS: '%s' (want ssbo=N, texel=N or alloc=N, N a multiple of 256)",
                               kv);
        *eq = 0;
        if (strcmp(kv, "ssbo") == 0 && v < be->max_ssbo_range)
            be->max_ssbo_range = v;
        else if (strcmp(kv, "texel") == 0 && v < be->max_texel_bytes)
            be->max_texel_bytes = v;
        else if (strcmp(kv, "alloc") == 0 && v < be->max_alloc)
            be->max_alloc = v;
        else if (strcmp(kv, "ssbo") && strcmp(kv, "texel") && strcmp(kv, "alloc"))
            return duet__error(DUET_INVALID_ARGUMENT, "DUET_VK_LIMITS: unknown limit '%s'", kv);
    }
    return DUET_OK;
}

static void vk_profile(duet_backend *base, duet_profile *out) {
    const vk_backend *be = (const vk_backend *)base;
    if (!be->profile) return;
    out->enabled = true;
    out->steps = be->prof_steps;
    for (int k = 0; k < DUET_OP_COUNT; k++) {
        out->count[k] = (uint64_t)be->prof_n[k];
        out->ms[k] = be->prof_ms[k];
    }
}

/* Drops one reference to the device; the last destroys it (every stream's
 * objects are gone by then). */
static void device_release(vk_device *d) {
    if (!d || atomic_fetch_sub(&d->refs, 1) > 1) return;
    if (d->dev) {
        vkDeviceWaitIdle(d->dev); /* no stream is left to use a queue */
        duet__vk_pipeline_cache_save(d);
        duet__vk_pipelines_destroy(d);
        if (d->pcache) vkDestroyPipelineCache(d->dev, d->pcache, NULL);
        vkDestroyDevice(d->dev, NULL);
    }
    for (int i = 0; i < VK_MAX_QUEUES; i++)
        pthread_mutex_destroy(&d->queue_mu[i]);
    pthread_mutex_destroy(&d->mu);
    free(d);
}

static void vk_close(duet_backend *base) {
    vk_backend *be = (vk_backend *)base;
    if (!be) return;
    if (be->dev) {
        /* This stream's work only: other streams may still be running. */
        if (be->submitted) vk_wait(base);
        duet__vk_buffer_destroy(be, be->xq);
        duet__vk_buffer_destroy(be, be->attn_part);
        duet__vk_buffer_destroy(be, be->status);
        duet__vk_buffer_destroy(be, be->staging);
        for (int i = 0; i < be->n_retired; i++)
            duet__vk_buffer_destroy(be, be->retired[i]);
        duet__vk_descriptors_destroy(be);
        if (be->ts_pool) vkDestroyQueryPool(be->dev, be->ts_pool, NULL);
        if (be->fence) vkDestroyFence(be->dev, be->fence, NULL);
        if (be->cmd_pool) vkDestroyCommandPool(be->dev, be->cmd_pool, NULL);
    }
    device_release(be->shared);
    free(be);
}

/* The VkDevice of physical device p for tuning tu: every queue of the
 * compute family (up to VK_MAX_QUEUES), integer dot products if the tuning
 * uses them, and the pipeline cache. */
static duet_status device_create(const vk_physical *p, const vk_tuning *tu, vk_device **out) {
    *out = NULL;
    vk_device *d = calloc(1, sizeof *d);
    if (!d) return duet__error(DUET_OUT_OF_MEMORY, "vulkan: device");
    atomic_init(&d->refs, 1);
    pthread_mutex_init(&d->mu, NULL);
    for (int i = 0; i < VK_MAX_QUEUES; i++)
        pthread_mutex_init(&d->queue_mu[i], NULL);
    d->n_queues = p->queue_count < VK_MAX_QUEUES ? (int)p->queue_count : VK_MAX_QUEUES;
    if (d->n_queues < 1) d->n_queues = 1;
    float prio[VK_MAX_QUEUES] = {1.0f, 1.0f, 1.0f, 1.0f};
    VkDeviceQueueCreateInfo qi = {
        .sType = VK_STRUCTURE_TYPE_DEVICE_QUEUE_CREATE_INFO,
        .queueFamilyIndex = p->queue_family,
        .queueCount = (uint32_t)d->n_queues,
        .pQueuePriorities = prio,
    };
    VkPhysicalDeviceShaderIntegerDotProductFeatures dotf = {
        .sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SHADER_INTEGER_DOT_PRODUCT_FEATURES,
        .shaderIntegerDotProduct = VK_TRUE,
    };
    const char *exts[1];
    uint32_t n_exts = 0;
    if (tu->int_dot && p->has_int_dot_ext) exts[n_exts++] = VK_KHR_SHADER_INTEGER_DOT_PRODUCT_EXTENSION_NAME;
    VkDeviceCreateInfo dci = {
        .sType = VK_STRUCTURE_TYPE_DEVICE_CREATE_INFO,
        .pNext = tu->int_dot ? &dotf : NULL,
        .queueCreateInfoCount = 1,
        .pQueueCreateInfos = &qi,
        .enabledExtensionCount = n_exts,
        .ppEnabledExtensionNames = exts,
    };
    VkResult r = vkCreateDevice(p->pd, &dci, NULL, &d->dev);
    duet_status st = DUET_OK;
    if (r != VK_SUCCESS) {
        d->dev = VK_NULL_HANDLE;
        st = duet__vk_fail(r, "vkCreateDevice", __FILE__, __LINE__);
    } else {
        for (int i = 0; i < d->n_queues; i++)
            vkGetDeviceQueue(d->dev, p->queue_family, (uint32_t)i, &d->queues[i]);
        st = duet__vk_pipeline_cache_open(d, p);
    }
    if (st != DUET_OK) {
        device_release(d);
        return st;
    }
    *out = d;
    return DUET_OK;
}

/* What a stream records and submits with: its queue (the device's next
 * one, in turn), command pool and buffers, fence, staging, status word and
 * timestamps. The device-level fields (phys, tune, limits, memory types)
 * are set. */
static duet_status stream_init(vk_backend *be) {
    const vk_physical *p = be->phys;
    vk_device *d = be->shared;
    int q = atomic_fetch_add(&d->next_queue, 1) % d->n_queues;
    be->dev = d->dev;
    be->queue = d->queues[q];
    be->queue_mu = &d->queue_mu[q];
    VkCommandPoolCreateInfo cpi = {
        .sType = VK_STRUCTURE_TYPE_COMMAND_POOL_CREATE_INFO,
        .flags = VK_COMMAND_POOL_CREATE_RESET_COMMAND_BUFFER_BIT,
        .queueFamilyIndex = p->queue_family,
    };
    VK_TRY(vkCreateCommandPool(be->dev, &cpi, NULL, &be->cmd_pool));
    VkCommandBuffer cbs[2];
    VkCommandBufferAllocateInfo cai = {
        .sType = VK_STRUCTURE_TYPE_COMMAND_BUFFER_ALLOCATE_INFO,
        .commandPool = be->cmd_pool,
        .level = VK_COMMAND_BUFFER_LEVEL_PRIMARY,
        .commandBufferCount = 2,
    };
    VK_TRY(vkAllocateCommandBuffers(be->dev, &cai, cbs));
    be->cmd = cbs[0];
    be->xfer = cbs[1];
    VkFenceCreateInfo fi = {.sType = VK_STRUCTURE_TYPE_FENCE_CREATE_INFO};
    VK_TRY(vkCreateFence(be->dev, &fi, NULL, &be->fence));
    duet_status st;
    if (!be->mem_host_visible &&
        (st = duet__vk_own_buffer_create(be, be->staging_bytes, true, &be->staging)) != DUET_OK)
        return st;
    if ((st = duet__vk_own_buffer_create(be, 16, true, &be->status)) != DUET_OK) return st;
    if (!be->status->map)
        return duet__error(DUET_UNSUPPORTED, "vulkan: %s has no host-visible memory", p->props.deviceName);
    memset(be->status->map, 0, 16);
    be->validation_seen = duet__vk_validation_errors();
    const char *prof = getenv("DUET_PROFILE");
    if (prof && strcmp(prof, "0") != 0 && p->timestamp_bits) {
        VkQueryPoolCreateInfo qpi = {
            .sType = VK_STRUCTURE_TYPE_QUERY_POOL_CREATE_INFO,
            .queryType = VK_QUERY_TYPE_TIMESTAMP,
            .queryCount = 2 * VK_PROFILE_MAX_OPS,
        };
        VK_TRY(vkCreateQueryPool(be->dev, &qpi, NULL, &be->ts_pool));
        be->profile = true;
    }
    return DUET_OK;
}

static duet_status vk_open(int index, const duet_backend_params *params, duet_backend **out) {
    (void)params;
    *out = NULL;
    char why[256];
    const vk_global *g = duet__vk_global(why, sizeof why);
    if (!g) return duet__error(DUET_NO_DEVICE, "vulkan: unavailable (%s)", why);
    if (index < 0 || index >= g->n_devices)
        return duet__error(DUET_NO_DEVICE, "vulkan: no device %d (it has %d; see `duet devices`)", index,
                           g->n_devices);
    const vk_physical *p = &g->devices[index];
    const VkPhysicalDeviceLimits *lim = &p->props.limits;
    if (lim->maxPerStageDescriptorStorageBuffers < 5 || lim->maxPerStageDescriptorSampledImages < 5)
        return duet__error(DUET_UNSUPPORTED,
                           "vulkan: %s binds too few buffers per shader (%u storage, %u texel)",
                           p->props.deviceName, lim->maxPerStageDescriptorStorageBuffers,
                           lim->maxPerStageDescriptorSampledImages);
    VkFormatProperties fp;
    vkGetPhysicalDeviceFormatProperties(p->pd, VK_FORMAT_R32G32B32A32_UINT, &fp);
    if (!(fp.bufferFeatures & VK_FORMAT_FEATURE_UNIFORM_TEXEL_BUFFER_BIT))
        return duet__error(DUET_UNSUPPORTED, "vulkan: %s cannot read R32G32B32A32_UINT texel buffers",
                           p->props.deviceName);

    vk_backend *be = calloc(1, sizeof *be);
    if (!be) return duet__error(DUET_OUT_OF_MEMORY, "vulkan: backend");
    be->base.iface = &duet_vulkan_backend_iface;
    be->base.device_index = index;
    be->base.info = p->info;
    be->phys = p;
    duet_status st = duet__vk_tuning_select(p, &be->tune);
    if (st != DUET_OK) goto fail;
    /* The subgroup path reduces with subgroup arithmetic. */
    if (be->tune.matmul == VK_MATMUL_SUBGROUP && !p->subgroup_arith) be->tune.matmul = VK_MATMUL_TILE;
    if ((st = device_create(p, &be->tune, &be->shared)) != DUET_OK) goto fail;

    /* Limits. maxMemoryAllocationSize is 1.1 core (maintenance3). */
    VkPhysicalDeviceMaintenance3Properties m3 = {
        .sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MAINTENANCE_3_PROPERTIES};
    VkPhysicalDeviceProperties2 pr2 = {.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2, .pNext = &m3};
    vkGetPhysicalDeviceProperties2(p->pd, &pr2);
    be->max_ssbo_range = lim->maxStorageBufferRange;
    be->ssbo_align = lim->minStorageBufferOffsetAlignment ? lim->minStorageBufferOffsetAlignment : 1;
    be->texel_align = lim->minTexelBufferOffsetAlignment > 16 ? lim->minTexelBufferOffsetAlignment : 16;
    be->max_alloc = m3.maxMemoryAllocationSize ? m3.maxMemoryAllocationSize : ((VkDeviceSize)1 << 31);
    /* Texel indices are ints in the shaders, byte offsets uints: stay < 2 GiB. */
    uint64_t tb = (uint64_t)lim->maxTexelBufferElements * 16u;
    be->max_texel_bytes = tb < ((uint64_t)1 << 31) ? tb : ((uint64_t)1 << 31) - 16u * 16u;
    be->max_texel_bytes &= ~(uint64_t)(be->texel_align - 1);
    memcpy(be->max_groups, lim->maxComputeWorkGroupCount, sizeof be->max_groups);
    if ((st = apply_limits(be)) != DUET_OK) goto fail;
    choose_memory(be);
    if ((st = stream_init(be)) != DUET_OK) goto fail;
    snprintf(be->base.info.features + strlen(be->base.info.features),
             sizeof be->base.info.features - strlen(be->base.info.features), " tuning=%s matmul=%s%s",
             be->tune.source, be->tune.matmul == VK_MATMUL_TILE ? "tile" : "subgroup",
             be->tune.int_dot ? "+dot" : "");
    *out = &be->base;
    return DUET_OK;
fail:
    vk_close(&be->base);
    return st;
}

/* A stream: the parent's device, tuning, limits and memory choices; its
 * own recording state (stream_init). */
static duet_status vk_stream_open(duet_backend *parent, const duet_backend_params *params,
                                  duet_backend **out) {
    (void)params;
    *out = NULL;
    const vk_backend *pb = (const vk_backend *)parent;
    vk_backend *be = calloc(1, sizeof *be);
    if (!be) return duet__error(DUET_OUT_OF_MEMORY, "vulkan: stream");
    be->base = pb->base;
    be->phys = pb->phys;
    be->tune = pb->tune;
    atomic_fetch_add(&pb->shared->refs, 1);
    be->shared = pb->shared;
    be->mem_type = pb->mem_type;
    be->mem_host_visible = pb->mem_host_visible;
    be->staging_type = pb->staging_type;
    be->staging_bytes = pb->staging_bytes;
    be->max_ssbo_range = pb->max_ssbo_range;
    be->ssbo_align = pb->ssbo_align;
    be->texel_align = pb->texel_align;
    be->max_alloc = pb->max_alloc;
    be->max_texel_bytes = pb->max_texel_bytes;
    memcpy(be->max_groups, pb->max_groups, sizeof be->max_groups);
    duet_status st = stream_init(be);
    if (st != DUET_OK) {
        vk_close(&be->base);
        return st;
    }
    *out = &be->base;
    return DUET_OK;
}

/* ---- steps ----------------------------------------------------------------------------- */

static duet_status vk_begin(duet_backend *base) {
    vk_backend *be = (vk_backend *)base;
    if (be->in_step) return duet__error(DUET_INVALID_ARGUMENT, "vulkan: begin while a step is open");
    duet_status st;
    if (be->submitted && (st = vk_wait(base)) != DUET_OK) return st;
    duet__vk_descriptors_trim(be);
    VK_TRY(vkResetCommandBuffer(be->cmd, 0));
    VkCommandBufferBeginInfo bi = {.sType = VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO,
                                   .flags = VK_COMMAND_BUFFER_USAGE_ONE_TIME_SUBMIT_BIT};
    VK_TRY(vkBeginCommandBuffer(be->cmd, &bi));
    if (be->profile) vkCmdResetQueryPool(be->cmd, be->ts_pool, 0, 2 * VK_PROFILE_MAX_OPS);
    be->in_step = true;
    be->n_reads = be->n_writes = be->n_written = 0;
    be->n_barriers = be->n_dispatches = 0;
    be->ts_count = 0;
    be->xq_src_id = 0; /* activations were re-uploaded or will be rewritten */
    return DUET_OK;
}

static duet_status vk_op(duet_backend *base, const duet_op *op) {
    vk_backend *be = (vk_backend *)base;
    if (!be->in_step)
        return duet__error(DUET_INVALID_ARGUMENT, "vulkan: op outside a step (call begin first)");
    return duet__vk_record_op(be, op);
}

static duet_status vk_submit(duet_backend *base) {
    vk_backend *be = (vk_backend *)base;
    if (!be->in_step) return duet__error(DUET_INVALID_ARGUMENT, "vulkan: submit without begin");
    be->in_step = false;
    VK_TRY(vkEndCommandBuffer(be->cmd));
    VkSubmitInfo si = {
        .sType = VK_STRUCTURE_TYPE_SUBMIT_INFO, .commandBufferCount = 1, .pCommandBuffers = &be->cmd};
    VK_TRY(queue_submit(be, &si));
    be->submitted = true;
    return DUET_OK;
}

static void profile_collect(vk_backend *be) {
    if (!be->profile || be->ts_count == 0) return;
    uint64_t *ts = malloc(sizeof(uint64_t) * 2 * (size_t)be->ts_count);
    if (!ts) return;
    if (vkGetQueryPoolResults(be->dev, be->ts_pool, 0, 2 * (uint32_t)be->ts_count,
                              sizeof(uint64_t) * 2 * (size_t)be->ts_count, ts, sizeof(uint64_t),
                              VK_QUERY_RESULT_64_BIT | VK_QUERY_RESULT_WAIT_BIT) == VK_SUCCESS) {
        double period_ms = be->phys->props.limits.timestampPeriod * 1e-6;
        uint64_t mask = be->phys->timestamp_bits >= 64 ? ~0ull : (1ull << be->phys->timestamp_bits) - 1;
        for (int i = 0; i < be->ts_count; i++) {
            uint64_t dt = (ts[2 * i + 1] - ts[2 * i]) & mask;
            be->prof_ms[be->ts_kind[i]] += (double)dt * period_ms;
            be->prof_n[be->ts_kind[i]]++;
        }
        be->prof_steps++;
    }
    free(ts);
}

static duet_status vk_wait(duet_backend *base) {
    vk_backend *be = (vk_backend *)base;
    if (!be->submitted) return DUET_OK;
    be->submitted = false;
    duet_status st = fence_wait(be);
    for (int i = 0; i < be->n_retired; i++)
        duet__vk_buffer_destroy(be, be->retired[i]);
    be->n_retired = 0;
    if (st != DUET_OK) return st;
    profile_collect(be);
    uint32_t bad = *(volatile uint32_t *)be->status->map;
    if (bad) {
        *(volatile uint32_t *)be->status->map = 0;
        return duet__error(
            DUET_INVALID_ARGUMENT,
            "vulkan: the step read an index out of range:%s%s%s%s%s (those outputs are zero; a bad block "
            "table entry was clamped into the pools)",
            bad & 1 ? " a token id outside the embedding table" : "",
            bad & 2 ? " a position outside the block table (or past the attention's n_keys)" : "",
            bad & 4 ? " a sequence slot outside the block table" : "",
            bad & 8 ? " a row outside the gathered tensor" : "",
            bad & 16 ? " a block table entry outside the KV pools" : "");
    }
    int n = duet__vk_validation_errors(); /* -1: the layer is off */
    if (n > be->validation_seen) {
        be->validation_seen = n;
        return duet__error(DUET_DEVICE, "vulkan: the validation layer reported %d error(s); first: %s", n,
                           duet__vk_validation_first());
    }
    return DUET_OK;
}

/* ---- dispatch recording -------------------------------------------------------------------- */

static bool overlaps(const vk_range *a, const vk_range *b) {
    return a->id == b->id && a->lo < b->hi && b->lo < a->hi;
}

static bool conflicts(const vk_range *set, int n, const vk_range *r) {
    for (int i = 0; i < n; i++)
        if (overlaps(&set[i], r)) return true;
    return false;
}

duet_status duet__vk_dispatch(vk_backend *be, const vk_dispatch *d) {
    for (int i = 0; i < 3; i++)
        if (d->groups[i] > be->max_groups[i])
            return duet__error(DUET_UNSUPPORTED,
                               "vulkan: %u workgroups in dimension %d exceed %s's limit of %u", d->groups[i],
                               i, be->base.info.name, be->max_groups[i]);
    if (d->groups[0] == 0 || d->groups[1] == 0 || d->groups[2] == 0) return DUET_OK;
    VkDescriptorSet set;
    duet_status st = duet__vk_descriptor_set(be, d->pipe, d->bind, &set);
    if (st != DUET_OK) return st;

    /* A barrier when this dispatch reads or writes what an earlier one
     * (since the last barrier) wrote, or writes what one read. */
    bool hazard = be->n_reads + d->n_reads > VK_MAX_TRACKED || be->n_writes + d->n_writes > VK_MAX_TRACKED;
    for (int i = 0; i < d->n_reads && !hazard; i++)
        hazard = conflicts(be->writes, be->n_writes, &d->reads[i]);
    for (int i = 0; i < d->n_writes && !hazard; i++)
        hazard = conflicts(be->writes, be->n_writes, &d->writes[i]) ||
                 conflicts(be->reads, be->n_reads, &d->writes[i]);
    if (hazard) {
        VkMemoryBarrier mb = {
            .sType = VK_STRUCTURE_TYPE_MEMORY_BARRIER,
            .srcAccessMask = VK_ACCESS_SHADER_WRITE_BIT | VK_ACCESS_SHADER_READ_BIT,
            .dstAccessMask = VK_ACCESS_SHADER_READ_BIT | VK_ACCESS_SHADER_WRITE_BIT,
        };
        vkCmdPipelineBarrier(be->cmd, VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT,
                             VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT, 0, 1, &mb, 0, NULL, 0, NULL);
        be->n_reads = be->n_writes = 0;
        be->n_barriers++;
    }
    for (int i = 0; i < d->n_reads; i++)
        be->reads[be->n_reads++] = d->reads[i];
    for (int i = 0; i < d->n_writes; i++) {
        be->writes[be->n_writes++] = d->writes[i];
        bool known = false;
        for (int j = 0; j < be->n_written && j < VK_MAX_WRITTEN && !known; j++)
            known = be->written[j] == d->writes[i].id;
        if (!known && be->n_written <= VK_MAX_WRITTEN) {
            if (be->n_written < VK_MAX_WRITTEN) be->written[be->n_written] = d->writes[i].id;
            be->n_written++;
        }
        /* Writing the activations a cached quantization came from voids it. */
        vk_range src = {be->xq_src_id, be->xq_src_off, be->xq_src_off + be->xq_src_bytes};
        if (be->xq_src_id && overlaps(&d->writes[i], &src)) be->xq_src_id = 0;
    }

    vkCmdBindPipeline(be->cmd, VK_PIPELINE_BIND_POINT_COMPUTE, d->pipe->pipe);
    vkCmdBindDescriptorSets(be->cmd, VK_PIPELINE_BIND_POINT_COMPUTE, d->pipe->layout, 0, 1, &set, 0, NULL);
    if (d->push_size)
        vkCmdPushConstants(be->cmd, d->pipe->layout, VK_SHADER_STAGE_COMPUTE_BIT, 0, d->push_size, d->push);
    bool ts = be->profile && be->ts_count < VK_PROFILE_MAX_OPS;
    if (ts)
        vkCmdWriteTimestamp(be->cmd, VK_PIPELINE_STAGE_BOTTOM_OF_PIPE_BIT, be->ts_pool,
                            2 * (uint32_t)be->ts_count);
    vkCmdDispatch(be->cmd, d->groups[0], d->groups[1], d->groups[2]);
    if (ts) {
        vkCmdWriteTimestamp(be->cmd, VK_PIPELINE_STAGE_BOTTOM_OF_PIPE_BIT, be->ts_pool,
                            2 * (uint32_t)be->ts_count + 1);
        be->ts_kind[be->ts_count++] = d->kind;
    }
    be->n_dispatches++;
    return DUET_OK;
}

void duet__vk_stats(duet_backend *base, long out[5]) {
    const vk_backend *be = (const vk_backend *)base;
    out[0] = be->n_dispatches;
    out[1] = be->n_barriers;
    pthread_mutex_lock(&be->shared->mu);
    out[2] = be->shared->n_pipes;
    pthread_mutex_unlock(&be->shared->mu);
    out[3] = be->desc_count;
    out[4] = (long)atomic_load(&be->shared->next_buffer_id);
}

const duet_backend_iface duet_vulkan_backend_iface = {
    .name = "vulkan",
    .available = vk_available,
    .device_count = vk_device_count,
    .device_info = vk_device_info,
    .open = vk_open,
    .stream_open = vk_stream_open,
    .close = vk_close,
    .supports_op = duet__vk_supports_op,
    .profile = vk_profile,
    .buffer_alloc = vk_buffer_alloc,
    .buffer_free = vk_buffer_free,
    .upload = vk_upload,
    .download = vk_download,
    .begin = vk_begin,
    .op = vk_op,
    .submit = vk_submit,
    .wait = vk_wait,
    /* buffer_host_ptr stays NULL: even mapped memory is written by ops that
     * run later, on the device. */
    .scratch_bytes = vk_scratch_bytes,
};
