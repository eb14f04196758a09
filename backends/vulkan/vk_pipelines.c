/* vk_pipelines.c — compute pipelines and descriptor sets.
 *
 * A pipeline is (shader, specialization constants): created on its first
 * use and kept for the instance, through a VkPipelineCache persisted on
 * disk ($XDG_CACHE_HOME/duet/vulkan or ~/.cache/duet/vulkan, one file per
 * device and driver, written at close when the driver has something to
 * cache), so later runs skip the driver's compiler. DUET_VK_PIPELINE_CACHE=0
 * keeps it in memory only.
 *
 * Descriptor sets are cached by (layout, bindings). A forward step binds
 * the same buffers every time, so after the first step every lookup hits
 * and a step allocates nothing. */
#include <assert.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "vk_internal.h"

/* ---- layouts ------------------------------------------------------------------- */

/* The caller holds d->mu. */
static duet_status layout_get(vk_device *d, int n_tex, int n_ssbo, const vk_layout **out) {
    for (int i = 0; i < d->n_layouts; i++)
        if (d->layouts[i].n_tex == n_tex && d->layouts[i].n_ssbo == n_ssbo) {
            *out = &d->layouts[i];
            return DUET_OK;
        }
    if (d->n_layouts == VK_MAX_LAYOUTS)
        return duet__error(DUET_UNSUPPORTED, "vulkan: too many descriptor layouts");
    assert(n_tex + n_ssbo <= VK_MAX_BINDINGS);
    VkDescriptorSetLayoutBinding b[VK_MAX_BINDINGS];
    for (int i = 0; i < n_tex + n_ssbo; i++)
        b[i] = (VkDescriptorSetLayoutBinding){
            .binding = (uint32_t)i,
            .descriptorType = i < n_tex ? VK_DESCRIPTOR_TYPE_UNIFORM_TEXEL_BUFFER : VK_DESCRIPTOR_TYPE_STORAGE_BUFFER,
            .descriptorCount = 1,
            .stageFlags = VK_SHADER_STAGE_COMPUTE_BIT,
        };
    vk_layout *l = &d->layouts[d->n_layouts];
    *l = (vk_layout){.n_tex = n_tex, .n_ssbo = n_ssbo};
    VkDescriptorSetLayoutCreateInfo dci = {
        .sType = VK_STRUCTURE_TYPE_DESCRIPTOR_SET_LAYOUT_CREATE_INFO,
        .bindingCount = (uint32_t)(n_tex + n_ssbo),
        .pBindings = b,
    };
    VK_TRY(vkCreateDescriptorSetLayout(d->dev, &dci, NULL, &l->set_layout));
    VkPushConstantRange pcr = {VK_SHADER_STAGE_COMPUTE_BIT, 0, VK_PUSH_BYTES};
    VkPipelineLayoutCreateInfo pci = {
        .sType = VK_STRUCTURE_TYPE_PIPELINE_LAYOUT_CREATE_INFO,
        .setLayoutCount = 1,
        .pSetLayouts = &l->set_layout,
        .pushConstantRangeCount = 1,
        .pPushConstantRanges = &pcr,
    };
    VkResult r = vkCreatePipelineLayout(d->dev, &pci, NULL, &l->layout);
    if (r != VK_SUCCESS) {
        vkDestroyDescriptorSetLayout(d->dev, l->set_layout, NULL);
        return duet__vk_fail(r, "vkCreatePipelineLayout", __FILE__, __LINE__);
    }
    d->n_layouts++;
    *out = l;
    return DUET_OK;
}

/* ---- pipelines ------------------------------------------------------------------- */

/* The caller holds d->mu. */
static duet_status pipeline_get(vk_device *d, vk_shader shader, int n_tex, int n_ssbo, int n_spec,
                                const uint32_t *spec, const vk_pipeline **out) {
    for (int i = 0; i < d->n_pipes; i++) {
        const vk_pipeline *p = d->pipes[i];
        if (p->shader == shader && p->n_spec == n_spec && p->n_tex == n_tex && p->n_ssbo == n_ssbo &&
            memcmp(p->spec, spec, (size_t)n_spec * sizeof *spec) == 0) {
            *out = p;
            return DUET_OK;
        }
    }
    if (d->n_pipes == d->cap_pipes) {
        int cap = d->cap_pipes ? d->cap_pipes * 2 : 32;
        vk_pipeline **np = realloc(d->pipes, (size_t)cap * sizeof *np);
        if (!np) return duet__error(DUET_OUT_OF_MEMORY, "vulkan: pipeline table");
        d->pipes = np;
        d->cap_pipes = cap;
    }
    const vk_layout *lay = NULL;
    duet_status st = layout_get(d, n_tex, n_ssbo, &lay);
    if (st != DUET_OK) return st;

    const vk_spirv *spv = &duet__vk_spirv[shader];
    VkShaderModuleCreateInfo smi = {
        .sType = VK_STRUCTURE_TYPE_SHADER_MODULE_CREATE_INFO,
        .codeSize = spv->size,
        .pCode = spv->code,
    };
    VkShaderModule mod;
    VK_TRY(vkCreateShaderModule(d->dev, &smi, NULL, &mod));
    VkSpecializationMapEntry map[VK_MAX_SPEC];
    for (int i = 0; i < n_spec; i++) map[i] = (VkSpecializationMapEntry){(uint32_t)i, (uint32_t)(i * 4), 4};
    VkSpecializationInfo si = {
        .mapEntryCount = (uint32_t)n_spec,
        .pMapEntries = map,
        .dataSize = (size_t)n_spec * 4,
        .pData = spec,
    };
    VkComputePipelineCreateInfo ci = {
        .sType = VK_STRUCTURE_TYPE_COMPUTE_PIPELINE_CREATE_INFO,
        .stage =
            {
                .sType = VK_STRUCTURE_TYPE_PIPELINE_SHADER_STAGE_CREATE_INFO,
                .stage = VK_SHADER_STAGE_COMPUTE_BIT,
                .module = mod,
                .pName = "main",
                .pSpecializationInfo = n_spec ? &si : NULL,
            },
        .layout = lay->layout,
    };
    vk_pipeline *p = malloc(sizeof *p);
    if (!p) {
        vkDestroyShaderModule(d->dev, mod, NULL);
        return duet__error(DUET_OUT_OF_MEMORY, "vulkan: pipeline");
    }
    *p = (vk_pipeline){.shader = shader, .n_spec = n_spec, .n_tex = n_tex, .n_ssbo = n_ssbo,
                       .set_layout = lay->set_layout, .layout = lay->layout};
    memcpy(p->spec, spec, (size_t)n_spec * sizeof *spec);
    VkResult r = vkCreateComputePipelines(d->dev, d->pcache, 1, &ci, NULL, &p->pipe);
    vkDestroyShaderModule(d->dev, mod, NULL);
    if (r != VK_SUCCESS) {
        free(p);
        return duet__error(r == VK_ERROR_OUT_OF_HOST_MEMORY || r == VK_ERROR_OUT_OF_DEVICE_MEMORY ? DUET_OUT_OF_MEMORY
                                                                                                 : DUET_COMPILE,
                           "vulkan: creating the %s pipeline failed: %s", spv->name, duet__vk_result_str(r));
    }
    d->pipes[d->n_pipes++] = p;
    *out = p;
    return DUET_OK;
}

duet_status duet__vk_pipeline_get(vk_backend *be, vk_shader shader, int n_tex, int n_ssbo, int n_spec,
                                  const uint32_t *spec, const vk_pipeline **out) {
    assert(n_spec <= VK_MAX_SPEC && shader < VK_SHADER_COUNT);
    pthread_mutex_lock(&be->shared->mu);
    duet_status st = pipeline_get(be->shared, shader, n_tex, n_ssbo, n_spec, spec, out);
    pthread_mutex_unlock(&be->shared->mu);
    return st;
}

void duet__vk_pipelines_destroy(vk_device *d) {
    for (int i = 0; i < d->n_pipes; i++) {
        vkDestroyPipeline(d->dev, d->pipes[i]->pipe, NULL);
        free(d->pipes[i]);
    }
    free(d->pipes);
    d->pipes = NULL;
    d->n_pipes = d->cap_pipes = 0;
    for (int i = 0; i < d->n_layouts; i++) {
        vkDestroyPipelineLayout(d->dev, d->layouts[i].layout, NULL);
        vkDestroyDescriptorSetLayout(d->dev, d->layouts[i].set_layout, NULL);
    }
    d->n_layouts = 0;
}

/* ---- the on-disk pipeline cache ----------------------------------------------------- */

/* mkdir -p; false if the directory cannot be made. */
static bool make_dirs(char *path) {
    for (char *s = path + 1; *s; s++) {
        if (*s != '/') continue;
        *s = 0;
        bool ok = mkdir(path, 0755) == 0 || errno == EEXIST;
        *s = '/';
        if (!ok) return false;
    }
    return mkdir(path, 0755) == 0 || errno == EEXIST;
}

/* A pipeline cache file starts with VkPipelineCacheHeaderVersionOne: data
 * from another device or driver is not handed to this one. */
static bool cache_header_matches(const vk_physical *phys, const uint8_t *d, size_t n) {
    if (n < 16 + VK_UUID_SIZE) return false;
    uint32_t h[4];
    memcpy(h, d, sizeof h);
    const VkPhysicalDeviceProperties *pr = &phys->props;
    return h[0] >= 16 + VK_UUID_SIZE && h[1] == VK_PIPELINE_CACHE_HEADER_VERSION_ONE && h[2] == pr->vendorID &&
           h[3] == pr->deviceID && memcmp(d + 16, pr->pipelineCacheUUID, VK_UUID_SIZE) == 0;
}

duet_status duet__vk_pipeline_cache_open(vk_device *be, const vk_physical *phys) {
    be->pcache_path[0] = 0;
    const char *off = getenv("DUET_VK_PIPELINE_CACHE");
    bool use_disk = !(off && strcmp(off, "0") == 0);
    const char *xdg = getenv("XDG_CACHE_HOME"), *home = getenv("HOME");
    char dir[900] = "";
    if (use_disk && xdg && *xdg) snprintf(dir, sizeof dir, "%s/duet/vulkan", xdg);
    else if (use_disk && home && *home) snprintf(dir, sizeof dir, "%s/.cache/duet/vulkan", home);
    void *data = NULL;
    size_t size = 0;
    if (dir[0]) {
        const VkPhysicalDeviceProperties *pr = &phys->props;
        char uuid[2 * VK_UUID_SIZE + 1];
        for (int i = 0; i < (int)VK_UUID_SIZE; i++) snprintf(uuid + 2 * i, 3, "%02x", pr->pipelineCacheUUID[i]);
        snprintf(be->pcache_path, sizeof be->pcache_path, "%s/%04x-%04x-%08x-%s.bin", dir, pr->vendorID, pr->deviceID,
                 pr->driverVersion, uuid);
        FILE *f = fopen(be->pcache_path, "rb");
        if (f) {
            if (fseek(f, 0, SEEK_END) == 0) {
                long n = ftell(f);
                if (n > 0 && n < (256l << 20) && fseek(f, 0, SEEK_SET) == 0 && (data = malloc((size_t)n)) &&
                    fread(data, 1, (size_t)n, f) == (size_t)n && cache_header_matches(phys, data, (size_t)n))
                    size = (size_t)n;
            }
            fclose(f);
        }
    }
    VkPipelineCacheCreateInfo ci = {
        .sType = VK_STRUCTURE_TYPE_PIPELINE_CACHE_CREATE_INFO,
        .initialDataSize = size,
        .pInitialData = size ? data : NULL,
    };
    VkResult r = vkCreatePipelineCache(be->dev, &ci, NULL, &be->pcache);
    if (r != VK_SUCCESS && size) { /* a stale or corrupt file: start empty */
        ci.initialDataSize = 0;
        ci.pInitialData = NULL;
        r = vkCreatePipelineCache(be->dev, &ci, NULL, &be->pcache);
    }
    free(data);
    if (r != VK_SUCCESS) return duet__vk_fail(r, "vkCreatePipelineCache", __FILE__, __LINE__);
    return DUET_OK;
}

const char *duet__vk_pipeline_cache_path(duet_backend *be) {
    return ((vk_backend *)be)->shared->pcache_path;
}

/* Writes the cache next to the old file and renames it over, so a crash or
 * a concurrent writer never leaves a torn file. Failure only costs speed. */
void duet__vk_pipeline_cache_save(vk_device *be) {
    if (!be->pcache || !be->pcache_path[0] || be->n_pipes == 0) return;
    size_t size = 0;
    /* A driver with nothing to cache (lavapipe) returns only the header:
     * then no file, and no directory, is made. */
    if (vkGetPipelineCacheData(be->dev, be->pcache, &size, NULL) != VK_SUCCESS ||
        size <= sizeof(VkPipelineCacheHeaderVersionOne))
        return;
    char dir[1024];
    snprintf(dir, sizeof dir, "%s", be->pcache_path);
    char *slash = strrchr(dir, '/');
    if (!slash) return;
    *slash = 0;
    if (!make_dirs(dir)) return;
    void *data = malloc(size);
    if (!data) return;
    if (vkGetPipelineCacheData(be->dev, be->pcache, &size, data) == VK_SUCCESS) {
        char tmp[1100];
        snprintf(tmp, sizeof tmp, "%s.%ld.tmp", be->pcache_path, (long)getpid());
        FILE *f = fopen(tmp, "wb");
        if (f) {
            bool ok = fwrite(data, 1, size, f) == size;
            ok = fclose(f) == 0 && ok;
            if (!ok || rename(tmp, be->pcache_path) != 0) remove(tmp);
        }
    }
    free(data);
}

/* ---- descriptor sets ----------------------------------------------------------------- */

#define VK_SETS_PER_POOL 256
#define VK_DESC_TRIM 4096 /* cached sets kept across steps */

static uint64_t mix64(uint64_t h, uint64_t v) {
    h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    return h * 0xff51afd7ed558ccdull;
}

static duet_status pool_add(vk_backend *be) {
    VkDescriptorPool *np = realloc(be->pools, (size_t)(be->n_pools + 1) * sizeof *np);
    if (!np) return duet__error(DUET_OUT_OF_MEMORY, "vulkan: descriptor pools");
    be->pools = np;
    VkDescriptorPoolSize sizes[2] = {
        {VK_DESCRIPTOR_TYPE_UNIFORM_TEXEL_BUFFER, VK_SETS_PER_POOL * VK_MAX_BINDINGS},
        {VK_DESCRIPTOR_TYPE_STORAGE_BUFFER, VK_SETS_PER_POOL * VK_MAX_BINDINGS},
    };
    VkDescriptorPoolCreateInfo ci = {
        .sType = VK_STRUCTURE_TYPE_DESCRIPTOR_POOL_CREATE_INFO,
        .maxSets = VK_SETS_PER_POOL,
        .poolSizeCount = 2,
        .pPoolSizes = sizes,
    };
    VK_TRY(vkCreateDescriptorPool(be->dev, &ci, NULL, &be->pools[be->n_pools]));
    be->n_pools++;
    be->pool_used = 0;
    return DUET_OK;
}

static duet_status table_grow(vk_backend *be) {
    int cap = be->desc_cap ? be->desc_cap * 2 : 1024;
    vk_desc_entry *t = calloc((size_t)cap, sizeof *t);
    if (!t) return duet__error(DUET_OUT_OF_MEMORY, "vulkan: descriptor cache");
    for (int i = 0; i < be->desc_cap; i++) {
        const vk_desc_entry *e = &be->desc[i];
        if (!e->set) continue;
        int j = (int)(e->hash & (uint64_t)(cap - 1));
        while (t[j].set) j = (j + 1) & (cap - 1);
        t[j] = *e;
    }
    free(be->desc);
    be->desc = t;
    be->desc_cap = cap;
    return DUET_OK;
}

duet_status duet__vk_descriptor_set(vk_backend *be, const vk_pipeline *p, const vk_binding *b, VkDescriptorSet *out) {
    const int n = p->n_tex + p->n_ssbo;
    uint64_t key[VK_MAX_BINDINGS][3];
    uint64_t h = mix64(0, (uint64_t)(uintptr_t)p->set_layout);
    for (int i = 0; i < n; i++) {
        key[i][0] = b[i].buf->id;
        key[i][1] = i < p->n_tex ? (uint64_t)b[i].view : b[i].offset;
        key[i][2] = i < p->n_tex ? 0 : b[i].range;
        h = mix64(mix64(mix64(h, key[i][0]), key[i][1]), key[i][2]);
    }
    if (be->desc_cap) {
        for (int j = (int)(h & (uint64_t)(be->desc_cap - 1));; j = (j + 1) & (be->desc_cap - 1)) {
            const vk_desc_entry *e = &be->desc[j];
            if (!e->set) break;
            if (e->hash == h && e->set_layout == p->set_layout && e->n == n &&
                memcmp(e->key, key, (size_t)n * sizeof key[0]) == 0) {
                *out = e->set;
                return DUET_OK;
            }
        }
    }
    /* Miss: allocate and write a new set. */
    duet_status st;
    if (be->desc_count * 2 >= be->desc_cap && (st = table_grow(be)) != DUET_OK) return st;
    if ((be->n_pools == 0 || be->pool_used == VK_SETS_PER_POOL) && (st = pool_add(be)) != DUET_OK) return st;
    VkDescriptorSetAllocateInfo ai = {
        .sType = VK_STRUCTURE_TYPE_DESCRIPTOR_SET_ALLOCATE_INFO,
        .descriptorPool = be->pools[be->n_pools - 1],
        .descriptorSetCount = 1,
        .pSetLayouts = &p->set_layout,
    };
    VkDescriptorSet set;
    VK_TRY(vkAllocateDescriptorSets(be->dev, &ai, &set));
    be->pool_used++;
    VkWriteDescriptorSet w[VK_MAX_BINDINGS];
    VkDescriptorBufferInfo bi[VK_MAX_BINDINGS];
    for (int i = 0; i < n; i++) {
        w[i] = (VkWriteDescriptorSet){
            .sType = VK_STRUCTURE_TYPE_WRITE_DESCRIPTOR_SET,
            .dstSet = set,
            .dstBinding = (uint32_t)i,
            .descriptorCount = 1,
        };
        if (i < p->n_tex) {
            w[i].descriptorType = VK_DESCRIPTOR_TYPE_UNIFORM_TEXEL_BUFFER;
            w[i].pTexelBufferView = &b[i].buf->views[b[i].view];
        } else {
            bi[i] = (VkDescriptorBufferInfo){b[i].buf->buf, b[i].offset, b[i].range};
            w[i].descriptorType = VK_DESCRIPTOR_TYPE_STORAGE_BUFFER;
            w[i].pBufferInfo = &bi[i];
        }
    }
    vkUpdateDescriptorSets(be->dev, (uint32_t)n, w, 0, NULL);
    int j = (int)(h & (uint64_t)(be->desc_cap - 1));
    while (be->desc[j].set) j = (j + 1) & (be->desc_cap - 1);
    vk_desc_entry *e = &be->desc[j];
    e->hash = h;
    e->set_layout = p->set_layout;
    e->n = n;
    memcpy(e->key, key, (size_t)n * sizeof key[0]);
    e->set = set;
    be->desc_count++;
    *out = set;
    return DUET_OK;
}

void duet__vk_descriptors_trim(vk_backend *be) {
    /* Sets of freed buffers are never hit again (ids are not reused); drop
     * everything once the cache is large, between steps. */
    if (be->desc_count < VK_DESC_TRIM) return;
    for (int i = 0; i < be->n_pools; i++) vkResetDescriptorPool(be->dev, be->pools[i], 0);
    memset(be->desc, 0, (size_t)be->desc_cap * sizeof *be->desc);
    be->desc_count = 0;
    be->pool_used = 0;
    /* Keep one pool; the rest were only needed by a larger working set. */
    for (int i = 1; i < be->n_pools; i++) vkDestroyDescriptorPool(be->dev, be->pools[i], NULL);
    be->n_pools = be->n_pools ? 1 : 0;
}

void duet__vk_descriptors_destroy(vk_backend *be) {
    for (int i = 0; i < be->n_pools; i++) vkDestroyDescriptorPool(be->dev, be->pools[i], NULL);
    free(be->pools);
    free(be->desc);
    be->pools = NULL;
    be->desc = NULL;
    be->n_pools = be->desc_cap = be->desc_count = be->pool_used = 0;
}
