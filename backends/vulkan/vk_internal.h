/* vk_internal.h — shared state of the Vulkan backend's files.
 *
 * vk_device.c    the loader (volk), the process-wide instance, physical
 *                devices and their features, validation messages
 * vk_tuning.c    the per-device tuning table (exact device -> vendor/arch ->
 *                default), chosen at open
 * vk_pipelines.c shader modules, pipelines (specialization constants),
 *                the on-disk pipeline cache, descriptor-set cache
 * vk_backend.c   the interface: open/close, buffers, upload/download, steps
 *                (one command buffer per step, barriers, timestamps)
 * vk_ops.c       op validation and recording: which shader, bindings, push
 *                constants and dispatch size each op becomes
 * vk_attention.c rope_kv and attention over the paged KV cache
 *                (FlashAttention tiles, flash-decoding splits)
 *
 * How memory is read and written. Every buffer has "texel views"
 * (VK_FORMAT_R32G32B32A32_UINT uniform texel buffers) that shaders read
 * through texelFetch, and is written through storage-buffer bindings. Texel
 * fetches are the fastest gather on CPU implementations (llvmpipe turns a
 * storage-buffer load into a per-lane scalar loop, a texel fetch into a
 * vector gather: 10x the bandwidth, measured) and an ordinary cached load
 * on GPUs; a view also spans far more than maxStorageBufferRange (128 MiB
 * on lavapipe), so weights never need splitting on common devices.
 * Offsets inside a view or binding travel in push constants, so views and
 * bindings only ever start at aligned offsets.
 *
 * CPU implementations also run both sides of any branch they cannot prove
 * uniform, so every choice known when an op is recorded (dtype, alignment,
 * bias, accumulate, f16 KV) is a specialization constant, and loops over
 * small arrays carry [[unroll]] (an array indexed by a loop variable lives
 * in memory there).
 *
 * Environment:
 *   DUET_VK_VALIDATION=1     Khronos validation + synchronization layer;
 *                            an error fails the step that caused it
 *   DUET_VK_TUNE=k=v,...     override the tuning table (vk_tuning.c), e.g.
 *                            dot=0 (int8 dot products through the
 *                            packed-integer fallback), matmul=subgroup,
 *                            attn=flash|lane, shuffle=0, attn_par=N
 *   DUET_PROFILE=1           per-dispatch timestamps, a table at close
 *   DUET_VK_PIPELINE_CACHE=0 no pipeline cache on disk
 *   DUET_VK_LIMITS=ssbo=N,texel=N,alloc=N   smaller device limits (tests)
 *   DUET_VK_STAGING=N        a staging buffer of N bytes even on
 *                            host-visible memory (tests) */
#ifndef DUET_VK_INTERNAL_H
#define DUET_VK_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <volk.h>

#include "../backend.h"
#include "vk_spirv.h"

/* ---- errors ---------------------------------------------------------------- */

/* Turns a failed VkResult into a duet_status with a message naming the
 * expression and where it failed. */
duet_status duet__vk_fail(VkResult r, const char *expr, const char *file, int line);
const char *duet__vk_result_str(VkResult r);

#define VK_TRY(expr)                                                                                         \
    do {                                                                                                     \
        VkResult vk_r_ = (expr);                                                                             \
        if (vk_r_ != VK_SUCCESS) return duet__vk_fail(vk_r_, #expr, __FILE__, __LINE__);                     \
    } while (0)

/* ---- process-wide state: loader, instance, physical devices ---------------- */

#define VK_MAX_DEVICES 16

typedef struct vk_physical {
    VkPhysicalDevice pd;
    VkPhysicalDeviceProperties props;
    VkPhysicalDeviceMemoryProperties mem;
    VkDriverId driver_id;
    uint32_t queue_family;   /* a family with compute */
    uint32_t queue_count;    /* queues that family offers */
    uint32_t timestamp_bits; /* of that family; 0 = no timestamps */
    /* What the device offers. The shaders need none of the 8/16-bit
     * features (they read 32-bit texels and unpack); integer dot products
     * are enabled when the tuning uses them. */
    bool fp16;             /* shaderFloat16 */
    bool storage16;        /* storageBuffer16BitAccess */
    bool storage8;         /* storageBuffer8BitAccess */
    bool int8;             /* shaderInt8 */
    bool int_dot;          /* shaderIntegerDotProduct (VK 1.3 or the KHR extension) */
    bool int_dot_accel;    /* 4x8-bit packed signed dot products are accelerated */
    bool coopmat;          /* VK_KHR_cooperative_matrix is offered */
    bool subgroup_arith;   /* subgroup arithmetic in compute shaders */
    bool subgroup_shuffle; /* subgroup shuffles in compute shaders */
    uint32_t subgroup_size;
    uint32_t subgroup_ops; /* VkSubgroupFeatureFlags */
    bool has_int_dot_ext;  /* the KHR extension must be enabled (API < 1.3) */
    bool has_coopmat_ext;
    duet_device_info info;
} vk_physical;

typedef struct vk_global {
    VkInstance instance;
    uint32_t api_version;
    int n_devices;
    vk_physical devices[VK_MAX_DEVICES];
    bool validation; /* VK_LAYER_KHRONOS_validation is on */
    VkDebugUtilsMessengerEXT messenger;
} vk_global;

/* Loads the loader and creates the instance once per process. On failure,
 * returns NULL and writes the reason (no loader, no driver, ...) to `why`.
 * DUET_VK_VALIDATION=1 in the environment at that moment turns on the
 * Khronos validation layer with a messenger that counts errors. */
const vk_global *duet__vk_global(char *why, size_t why_size);

/* Validation errors reported since the process started; -1 when the
 * validation layer is off. */
int duet__vk_validation_errors(void);
/* The first validation error's message ("" if none). */
const char *duet__vk_validation_first(void);

/* ---- tuning ------------------------------------------------------------------ */

typedef enum vk_matmul_path {
    /* Each invocation computes a tile of rows x tokens over whole rows: few,
     * wide texel fetches and no cross-lane traffic. The path for CPU
     * implementations (lavapipe), where lanes are SIMD lanes of one core. */
    VK_MATMUL_TILE,
    /* A workgroup per row (block): lanes stride over the row, coalesced,
     * then a subgroup reduction. The path for GPUs. */
    VK_MATMUL_SUBGROUP,
} vk_matmul_path;

typedef struct vk_tuning {
    char source[96]; /* which table entry (and overrides) chose these */
    vk_matmul_path matmul;
    bool int_dot; /* Q8_0 and the block types through OpSDotAccSat (needs the feature) */
    /* tile path: workgroup size, rows per invocation, tokens per invocation;
     * rows per invocation of the Q8_0 and block-type decode GEMV (one token) */
    int tile_wg, tile_rows, tile_tokens, tile_rows_q8;
    /* subgroup path: workgroup size, rows per workgroup */
    int sg_wg, sg_rows;
    /* Q8_0 and block-type prefill on the subgroup path: from mm_min tokens
     * (0: never) a tiled GEMM (matmul_mm_q8.comp, matmul_mm_blk.comp) of
     * mm_bm rows x mm_bn tokens a workgroup, 4 x 4 outputs an invocation. */
    int mm_min, mm_bm, mm_bn;
    /* Attention. attn_lane: attn_lane.comp (a lane per token, head and key
     * split; CPU devices) instead of attn_flash.comp (query tiles x key
     * tiles in shared memory; GPUs). Flash prefill: attn_wg lanes, attn_c
     * of them per query row; flash decode: up to attn_dc lanes per row (0:
     * the subgroup size), the GQA heads of a KV head as rows; attn_kt keys
     * per tile (fewer when shared memory is short). Lane: attn_wg lanes per
     * workgroup. A context is split until about attn_par workgroups run, but
     * never into pieces of fewer than attn_chunk keys. */
    bool attn_lane;
    int attn_wg, attn_c, attn_dc, attn_kt, attn_par, attn_chunk;
    bool no_shuffle; /* never use subgroup shuffles (one lane per row) */
    int norm_wg;     /* lanes per token row of rmsnorm / argmax */
    int ew_wg;       /* elementwise ops */
} vk_tuning;

/* Chooses the table entry for a device, then applies DUET_VK_TUNE
 * ("matmul=tile|subgroup,dot=0|1,tile_rows=N,..."; dot=0 forces the
 * packed-integer fallback of the int8 dot products). Fails on a malformed
 * override. */
duet_status duet__vk_tuning_select(const vk_physical *phys, vk_tuning *out);

/* ---- buffers ------------------------------------------------------------------ */

#define VK_MAX_VIEWS 8

struct duet_buffer {
    duet_buffer_head head; /* first: the registry reads it */
    VkBuffer buf;
    VkDeviceMemory mem;
    void *map;          /* host pointer when the memory is host-visible */
    uint64_t id;        /* unique per instance, never reused: descriptor-cache key */
    size_t alloc_bytes; /* device memory behind it */
    bool own;           /* the backend's own (scratch_bytes counts it) */
    /* Texel views: view k starts at k * view_stride bytes and spans
     * view_span[k] bytes (one view unless the buffer passes the device's
     * texel limit). */
    int n_views;
    size_t view_stride;
    VkBufferView views[VK_MAX_VIEWS];
    size_t view_span[VK_MAX_VIEWS];
};

/* ---- pipelines --------------------------------------------------------------- */

#define VK_MAX_SPEC 9
#define VK_MAX_BINDINGS 10
#define VK_PUSH_BYTES 128

typedef struct vk_pipeline {
    vk_shader shader;
    int n_spec;
    uint32_t spec[VK_MAX_SPEC];
    int n_tex, n_ssbo;                /* bindings: texel views first, then storage buffers */
    VkDescriptorSetLayout set_layout; /* shared, owned by vk_device.layouts */
    VkPipelineLayout layout;          /* shared */
    VkPipeline pipe;
} vk_pipeline;

typedef struct vk_layout {
    int n_tex, n_ssbo;
    VkDescriptorSetLayout set_layout;
    VkPipelineLayout layout;
} vk_layout;

/* One binding of a dispatch: a texel view, or a storage-buffer range. */
typedef struct vk_binding {
    duet_buffer *buf;
    int view;            /* texel: which view */
    VkDeviceSize offset; /* storage: aligned start */
    VkDeviceSize range;  /* storage: bytes */
} vk_binding;

typedef struct vk_desc_entry {
    uint64_t hash;
    VkDescriptorSetLayout set_layout;
    int n;
    uint64_t key[VK_MAX_BINDINGS][3]; /* (buffer id, view or offset, range) */
    VkDescriptorSet set;
} vk_desc_entry;

/* ---- the device, shared by an instance and its streams --------------------------- */

#define VK_MAX_QUEUES 4
#define VK_MAX_LAYOUTS 16

/* Everything of a VkDevice that every stream on it uses: the device, its
 * queues, the pipelines and their layouts, the pipeline cache, buffer ids.
 * Freed with the last stream (the instance opened first counts as one).
 *
 * Vulkan leaves the host synchronisation of a VkQueue (vkQueueSubmit) and
 * of command pools, descriptor pools and fences to the application; creating
 * buffers, memory, views and pipelines on a VkDevice from several threads is
 * allowed. So each stream owns its pools and fence, a queue used by several
 * streams is submitted to under its mutex, and `mu` guards only the tables
 * below (lookups and inserts). */
typedef struct vk_device {
    atomic_int refs;
    VkDevice dev;
    int n_queues;
    VkQueue queues[VK_MAX_QUEUES];
    pthread_mutex_t queue_mu[VK_MAX_QUEUES];
    atomic_int next_queue; /* streams take the queues in turn */
    _Atomic uint64_t next_buffer_id;

    pthread_mutex_t mu;
    /* Pipelines (created on first use, never moved: streams hold pointers)
     * and their layouts. */
    VkPipelineCache pcache;
    char pcache_path[1024];
    vk_pipeline **pipes;
    int n_pipes, cap_pipes;
    vk_layout layouts[VK_MAX_LAYOUTS];
    int n_layouts;
} vk_device;

/* ---- the backend instance (a stream on a device) ---------------------------------- */

/* A byte range of a buffer an op reads or writes, for barrier tracking. */
typedef struct vk_range {
    uint64_t id;
    size_t lo, hi;
} vk_range;

/* The range an op reads or writes: bytes at off of b. */
static inline vk_range vk_rng(const duet_buffer *b, size_t off, uint64_t bytes) {
    return (vk_range){b->id, off, off + bytes};
}

#define VK_MAX_TRACKED 64
#define VK_MAX_WRITTEN 256
#define VK_PROFILE_MAX_OPS 4096

typedef struct vk_backend {
    duet_backend base; /* must be first */
    const vk_physical *phys;
    vk_tuning tune;
    vk_device *shared; /* the device, its pipelines and queues */
    VkDevice dev;      /* shared->dev */
    VkQueue queue;     /* this stream's queue; submissions hold queue_mu */
    pthread_mutex_t *queue_mu;

    /* Memory: the type for buffers (device-local, host-visible when the
     * device has such a type: then uploads and downloads are memcpy). */
    uint32_t mem_type;
    bool mem_host_visible;
    uint32_t staging_type; /* host-visible, for the staging buffer */
    duet_buffer *staging;  /* NULL when mem_host_visible */
    size_t staging_bytes;

    /* Limits (the device's, or smaller ones from DUET_VK_LIMITS for tests). */
    VkDeviceSize max_ssbo_range, ssbo_align, texel_align, max_alloc;
    VkDeviceSize max_texel_bytes; /* bytes one texel view may span */
    uint32_t max_groups[3];

    /* Descriptor sets: cached by (layout, bindings); a step that repeats the
     * last one's ops allocates nothing. */
    VkDescriptorPool *pools;
    int n_pools, pool_used; /* sets used in the last pool */
    vk_desc_entry *desc;    /* open-addressing table */
    int desc_cap, desc_count;

    /* The step. */
    VkCommandPool cmd_pool;
    VkCommandBuffer cmd;  /* the step's command buffer */
    VkCommandBuffer xfer; /* staging copies outside steps */
    VkFence fence;
    bool in_step, submitted;
    vk_range reads[VK_MAX_TRACKED], writes[VK_MAX_TRACKED]; /* since the last barrier */
    int n_reads, n_writes;
    uint64_t written[VK_MAX_WRITTEN]; /* buffers any dispatch of this step writes */
    int n_written;                    /* > VK_MAX_WRITTEN: too many to know */
    int n_barriers, n_dispatches;     /* this step, for tests and profiles */

    /* Device-side bounds checks: shaders set bits in this host-visible word
     * when an index input (token id, position, sequence, row) is out of
     * range; wait() reports them. */
    duet_buffer *status;
    int validation_seen; /* validation errors already reported */

    /* Scratch owned by the backend: quantized activations for Q8_0 matmuls
     * (grown to the largest op seen, then kept), the RoPE cos/sin table and
     * attention's split partials. scratch_now/peak: bytes of device memory
     * in the backend's own buffers (staging and status too). */
    size_t scratch_now, scratch_peak;
    duet_buffer *attn_part;
    duet_buffer *xq;
    uint64_t xq_src_id; /* the activation range xq currently holds */
    size_t xq_src_off, xq_src_bytes;
    int xq_tokens, xq_n_in;
    duet_buffer *retired[8]; /* scratch replaced during a step, freed at wait */
    int n_retired;

    /* Profiling (DUET_PROFILE=1): two timestamps per op. */
    bool profile;
    VkQueryPool ts_pool;
    int ts_count;
    duet_op_kind ts_kind[VK_PROFILE_MAX_OPS];
    double prof_ms[DUET_OP_COUNT];
    long prof_n[DUET_OP_COUNT];
    int prof_steps;
} vk_backend;

/* vk_backend.c */
extern const duet_backend_iface duet_vulkan_backend_iface;
/* For tests and benchmarks: out[0] dispatches and out[1] barriers of the
 * last step, out[2] pipelines, out[3] cached descriptor sets, out[4]
 * buffers ever created (the backend's own scratch included). */
void duet__vk_stats(duet_backend *be, long out[5]);
/* The pipeline cache file this instance reads and writes ("" if none). */
const char *duet__vk_pipeline_cache_path(duet_backend *be);
duet_status duet__vk_buffer_create(vk_backend *be, size_t size, bool host_visible, duet_buffer **out);
/* The same for the backend's own buffers (counted by scratch_bytes). */
duet_status duet__vk_own_buffer_create(vk_backend *be, size_t size, bool host_visible, duet_buffer **out);
/* Frees an own buffer now, or after the step's wait when one is open. */
duet_status duet__vk_retire(vk_backend *be, duet_buffer *b);
void duet__vk_buffer_destroy(vk_backend *be, duet_buffer *b);
/* Writes bytes into a buffer outside a step (memcpy or staging). */
duet_status duet__vk_write(vk_backend *be, duet_buffer *b, size_t off, const void *src, size_t size);
/* Makes `b` (scratch) at least `size` bytes; a buffer replaced during a
 * step is freed after the step's wait. */
duet_status duet__vk_scratch_reserve(vk_backend *be, duet_buffer **b, size_t size);

/* vk_pipelines.c */
duet_status duet__vk_pipeline_get(vk_backend *be, vk_shader shader, int n_tex, int n_ssbo, int n_spec,
                                  const uint32_t *spec, const vk_pipeline **out);
void duet__vk_pipelines_destroy(vk_device *d);
duet_status duet__vk_pipeline_cache_open(vk_device *d, const vk_physical *phys);
void duet__vk_pipeline_cache_save(vk_device *d);
duet_status duet__vk_descriptor_set(vk_backend *be, const vk_pipeline *p, const vk_binding *b,
                                    VkDescriptorSet *out);
/* Called at begin(): drops the cached sets when the cache has grown large. */
void duet__vk_descriptors_trim(vk_backend *be);
void duet__vk_descriptors_destroy(vk_backend *be);

/* vk_ops.c */
bool duet__vk_supports_op(int index, const duet_op *op);
duet_status duet__vk_record_op(vk_backend *be, const duet_op *op);

/* Helpers of the op recorders (vk_ops.c), shared with vk_attention.c. */
/* The i32 data of a view when the host can read its final value now
 * (mapped, and no dispatch of this step writes it), else NULL. */
const int32_t *duet__vk_host_indices(const vk_backend *be, duet_view v);
/* A read of `bytes` at `off` through the texel view holding it (*rel: the
 * byte offset from the view's start), or a write through a storage binding
 * starting at an aligned offset (*rel: off's byte offset inside it). */
duet_status duet__vk_tex_bind(vk_backend *be, const char *op, const char *name, duet_buffer *b, size_t off,
                              uint64_t bytes, struct vk_binding *bind, uint32_t *rel);
duet_status duet__vk_ssbo_bind(vk_backend *be, const char *op, const char *name, duet_buffer *b, size_t off,
                               uint64_t bytes, struct vk_binding *bind, uint32_t *rel);
/* A storage binding nothing writes, for an absent optional output. */
struct vk_binding duet__vk_unused_ssbo(vk_backend *be);

/* vk_attention.c */
duet_status duet__vk_rec_rope_kv(vk_backend *be, const duet_op *op);
duet_status duet__vk_rec_attention(vk_backend *be, const duet_op *op);
#define VK_MAX_HEAD_DIM 256

/* Records one dispatch: barrier if it depends on an earlier one in this
 * step, bindings, push constants, and (when profiling) timestamps. `reads`
 * and `writes` are the byte ranges it touches. */
typedef struct vk_dispatch {
    const vk_pipeline *pipe;
    vk_binding bind[VK_MAX_BINDINGS];
    const void *push;
    uint32_t push_size;
    uint32_t groups[3];
    vk_range reads[VK_MAX_BINDINGS], writes[VK_MAX_BINDINGS];
    int n_reads, n_writes;
    duet_op_kind kind;
} vk_dispatch;
duet_status duet__vk_dispatch(vk_backend *be, const vk_dispatch *d);

#endif /* DUET_VK_INTERNAL_H */
