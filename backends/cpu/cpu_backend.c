/* cpu_backend.c — the cpu backend's interface: one host device, host-memory
 * buffers, and ops that run when they are recorded; an instance's streams
 * share its worker pool (cpu_device) and run their steps on it in turn.
 *
 * The cpu backend is the fallback where there is no GPU and the oracle the
 * GPU backends are tested against, so every op validates its operands
 * against the buffers' sizes (and its index inputs against the tables they
 * index) before touching memory: a bad op returns DUET_INVALID_ARGUMENT
 * naming the op and operand, never reads or writes out of bounds. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/mman.h>
#include <unistd.h>

#include "backend_checks.h"
#include "cpu_internal.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

/* ---- which SIMD path ------------------------------------------------------- */

const char *duet__cpu_isa_name(cpu_isa isa) {
    switch (isa) {
    case CPU_ISA_AVX512:
        return "avx512";
    case CPU_ISA_AVX2:
        return "avx2";
    case CPU_ISA_SCALAR:
        return "scalar";
    }
    return "scalar";
}

static cpu_isa cpu_isa_hardware(void) {
#if defined(__x86_64__) || defined(__i386__)
    /* cpuid says what the core has, xgetbv what the OS saves on a context
     * switch; a path needs both. (Not __builtin_cpu_supports: clang's lacks
     * "f16c".) */
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return CPU_ISA_SCALAR;
    bool fma = c & (1u << 12), osxsave = c & (1u << 27), avx = c & (1u << 28), f16c = c & (1u << 29);
    if (!osxsave || !avx) return CPU_ISA_SCALAR;
    unsigned xlo, xhi;
    __asm__ volatile("xgetbv" : "=a"(xlo), "=d"(xhi) : "c"(0));
    (void)xhi;
    if ((xlo & 0x6) != 0x6) return CPU_ISA_SCALAR; /* xmm + ymm state */
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return CPU_ISA_SCALAR;
    bool avx2 = b & (1u << 5);
    if (!(avx2 && fma && f16c)) return CPU_ISA_SCALAR;
    bool avx512 = (b & (1u << 16)) && (b & (1u << 17)) && (b & (1u << 30)) && (b & (1u << 31)) &&
                  (c & (1u << 11)) && (xlo & 0xe0) == 0xe0; /* f dq bw vl vnni + zmm state */
    return avx512 ? CPU_ISA_AVX512 : CPU_ISA_AVX2;
#else
    return CPU_ISA_SCALAR;
#endif
}

cpu_isa duet__cpu_isa_detect(void) {
    cpu_isa isa = cpu_isa_hardware();
    const char *want = getenv("DUET_CPU_ISA");
    if (want) {
        cpu_isa cap = strcmp(want, "scalar") == 0 ? CPU_ISA_SCALAR
                      : strcmp(want, "avx2") == 0 ? CPU_ISA_AVX2
                                                  : CPU_ISA_AVX512;
        if (cap < isa) isa = cap;
    }
    return isa;
}

static const char *cpu_isa_features(cpu_isa isa) {
    switch (isa) {
    case CPU_ISA_AVX512:
        return "avx512f avx512bw avx512vl avx512dq avx512_vnni avx2 fma f16c";
    case CPU_ISA_AVX2:
        return "avx2 fma f16c";
    case CPU_ISA_SCALAR:
        return "scalar";
    }
    return "scalar";
}

/* ---- device ---------------------------------------------------------------- */

static int cpu_online(void) {
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

/* Copies the value of the first "key<spaces>: value" line of /proc/cpuinfo. */
static bool cpuinfo_field(const char *key, char *out, size_t size) {
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (!f) return false;
    char line[512];
    bool found = false;
    size_t klen = strlen(key);
    while (!found && fgets(line, sizeof line, f)) {
        if (strncmp(line, key, klen) != 0) continue;
        char *colon = strchr(line + klen, ':');
        if (!colon) continue;
        char *v = colon + 1;
        while (*v == ' ' || *v == '\t')
            v++;
        v[strcspn(v, "\n")] = 0;
        snprintf(out, size, "%s", v);
        found = *v != 0;
    }
    fclose(f);
    return found;
}

static void cpu_fill_info(duet_device_info *info, cpu_isa isa, int threads) {
    memset(info, 0, sizeof *info);
    if (!cpuinfo_field("model name", info->name, sizeof info->name))
        snprintf(info->name, sizeof info->name, "cpu");
    char vendor[64] = "";
    if (cpuinfo_field("vendor_id", vendor, sizeof vendor))
        snprintf(info->vendor, sizeof info->vendor, "%s",
                 strcmp(vendor, "GenuineIntel") == 0   ? "Intel"
                 : strcmp(vendor, "AuthenticAMD") == 0 ? "AMD"
                                                       : vendor);
    else
        snprintf(info->vendor, sizeof info->vendor, "unknown");
    snprintf(info->driver, sizeof info->driver, "duet-cpu/%s", duet__cpu_isa_name(isa));
    info->type = DUET_DEVICE_HOST;
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    info->memory_bytes = pages > 0 && page > 0 ? (uint64_t)pages * (uint64_t)page : 0;
    info->compute_units = threads;
    info->fp16 = isa >= CPU_ISA_AVX2;       /* f16 weights/KV converted in hardware (f16c) */
    info->int8_dot = isa == CPU_ISA_AVX512; /* vpdpbusd */
    info->coopmat = false;
    info->q8_activations = true;
    info->subgroup_size = 0;
    snprintf(info->features, sizeof info->features, "%s", cpu_isa_features(isa));
}

static bool cpu_available(char *why, size_t why_size) {
    (void)why;
    (void)why_size;
    return true;
}

static int cpu_device_count(void) {
    return 1;
}

static duet_status cpu_device_info(int index, duet_device_info *out) {
    if (index != 0) return duet__error(DUET_NO_DEVICE, "cpu: no device %d (it has 1)", index);
    cpu_fill_info(out, duet__cpu_isa_detect(), cpu_online());
    return DUET_OK;
}

/* ---- instance ---------------------------------------------------------------- */

duet_status duet__cpu_scratch_reserve(cpu_scratch *s, size_t size) {
    if (s->size >= size) return DUET_OK;
    size_t want = size + size / 2; /* grow geometrically: rare reallocations */
    void *p = NULL;
    if (posix_memalign(&p, 64, (want + 63) & ~(size_t)63) != 0)
        return duet__error(DUET_OUT_OF_MEMORY, "cpu: %zu bytes of scratch", want);
    free(s->p);
    s->p = p;
    s->size = want;
    return DUET_OK;
}

static void cpu_close(duet_backend *base) {
    cpu_backend *be = (cpu_backend *)base;
    if (!be) return;
    if (be->pool == &be->own_pool) duet__cpu_pool_free(&be->own_pool);
    if (be->in_step && be->pool == &be->dev->pool) pthread_mutex_unlock(&be->dev->step_mu);
    if (be->dev && atomic_fetch_sub(&be->dev->refs, 1) == 1) {
        duet__cpu_pool_free(&be->dev->pool);
        pthread_mutex_destroy(&be->dev->step_mu);
        pthread_rwlock_destroy(&be->dev->layout);
        free(be->dev);
    }
    free(be->act.p);
    free(be->work.p);
    free(be->attn.p);
    free(be);
}

/* A stream's own state on device dev (one reference taken): its scratch,
 * its step and profile, and its worker pool: dev's, or its own of
 * n_threads (> 0). */
static duet_status cpu_stream_new(cpu_device *dev, const duet_device_info *info, int n_threads,
                                  cpu_backend **out) {
    *out = NULL;
    cpu_backend *be = calloc(1, sizeof *be);
    if (!be) return duet__error(DUET_OUT_OF_MEMORY, "cpu: backend");
    be->base.iface = &duet_cpu_backend_iface;
    be->base.device_index = 0;
    be->base.info = *info;
    be->isa = duet__cpu_isa_detect();
    const char *prof = getenv("DUET_PROFILE");
    be->profile = prof && *prof && strcmp(prof, "0") != 0;
    const char *rp = getenv("DUET_CPU_REPACK");
    be->repack = be->isa >= CPU_ISA_AVX2 && !(rp && strcmp(rp, "0") == 0);
    atomic_fetch_add(&dev->refs, 1);
    be->dev = dev;
    be->pool = &dev->pool;
    if (n_threads > 0) {
        duet_status st = duet__cpu_pool_init(&be->own_pool, n_threads);
        if (st != DUET_OK) {
            cpu_close(&be->base);
            return st;
        }
        be->pool = &be->own_pool;
        be->base.info.compute_units = n_threads;
    }
    *out = be;
    return DUET_OK;
}

static duet_status cpu_open(int index, const duet_backend_params *params, duet_backend **out) {
    *out = NULL;
    if (index != 0) return duet__error(DUET_NO_DEVICE, "cpu: no device %d (it has 1)", index);
    int n = params ? params->n_threads : 0;
    if (n < 0 || n > 1024) return duet__error(DUET_INVALID_ARGUMENT, "cpu: n_threads %d (0 = all cores)", n);
    if (n == 0) n = cpu_online();
    cpu_device *dev = calloc(1, sizeof *dev);
    if (!dev) return duet__error(DUET_OUT_OF_MEMORY, "cpu: device");
    pthread_rwlock_init(&dev->layout, NULL);
    pthread_mutex_init(&dev->step_mu, NULL);
    duet_status st = duet__cpu_pool_init(&dev->pool, n);
    if (st != DUET_OK) {
        pthread_mutex_destroy(&dev->step_mu);
        pthread_rwlock_destroy(&dev->layout);
        free(dev);
        return st;
    }
    duet_device_info info;
    cpu_fill_info(&info, duet__cpu_isa_detect(), n);
    cpu_backend *be;
    st = cpu_stream_new(dev, &info, 0, &be);
    if (st != DUET_OK) {
        duet__cpu_pool_free(&dev->pool);
        pthread_mutex_destroy(&dev->step_mu);
        pthread_rwlock_destroy(&dev->layout);
        free(dev);
        return st;
    }
    *out = &be->base;
    return DUET_OK;
}

/* Streams take turns on the device's pool, a step at a time (step_mu,
 * begin to submit; host work between steps overlaps), unless the stream
 * asks for a pool of its own: two pools on the same cores oversubscribe
 * them, and the pool's join then waits for descheduled workers. */
static duet_status cpu_stream_open(duet_backend *parent, const duet_backend_params *params,
                                   duet_backend **out) {
    *out = NULL;
    cpu_backend *p = (cpu_backend *)parent;
    int n = params ? params->n_threads : 0;
    if (n < 0 || n > 1024)
        return duet__error(DUET_INVALID_ARGUMENT, "cpu: n_threads %d (0 = the device's pool)", n);
    cpu_backend *be;
    duet_status st = cpu_stream_new(p->dev, &parent->info, n, &be);
    if (st == DUET_OK) *out = &be->base;
    return st;
}

/* ---- buffers ----------------------------------------------------------------- */

/* Weight-sized buffers get 2 MiB alignment and, when they are uploaded whole
 * (weights), a transparent-huge-page hint: decode streams every weight once
 * per token, and fewer TLB misses help. Not at allocation: the KV pools are
 * as big, and there each huge page is zeroed at its first touch, 2 MiB in
 * each layer's K and V at once. With SmolLM2's pools (60 buffers), a step
 * that took the first block of a new 2 MiB stretch stalled 470-525 ms on
 * the 2-core Xeon VM (perf: clear_page_erms under avx512_to_f16), about one
 * step in every few hundred requests while the prefix cache keeps old
 * blocks; in 4 KiB pages a new block costs its own few pages. */
#define CPU_HUGE_MIN ((size_t)8 << 20)
#define CPU_HUGE_ALIGN ((size_t)2 << 20)

static duet_status cpu_buffer_alloc(duet_backend *be, size_t size, duet_buffer **out) {
    *out = NULL;
    duet_buffer *b = malloc(sizeof *b);
    if (!b) return duet__error(DUET_OUT_OF_MEMORY, "cpu: buffer handle");
    size_t align = size >= CPU_HUGE_MIN ? CPU_HUGE_ALIGN : 64;
    size_t padded = (size + align - 1) & ~(align - 1);
    if (padded < size || posix_memalign(&b->data, align, padded) != 0) {
        free(b);
        return duet__error(DUET_OUT_OF_MEMORY, "cpu: cannot allocate a buffer of %zu bytes", size);
    }
    b->head = (duet_buffer_head){.size = size, .kind = DUET_BUFFER_HOST};
    b->rp_rows = b->rp_cols = 0;
    b->rp_off = 0;
    b->rp_dtype = DUET_DTYPE_Q4_0;
    b->rp_never = false;
    *out = b;
    return DUET_OK;
}

static void cpu_buffer_free(duet_backend *be, duet_buffer *buf) {
    if (!buf) return;
    if (buf->rp_rows) atomic_fetch_sub(&((cpu_backend *)be)->dev->n_repacked, 1);
    free(buf->data);
    free(buf);
}

/* Makes buf's bytes plain for a host access (a repacked layout restored
 * first, under the layout lock for writing). Returns with dev->layout held
 * for reading on success; the caller unlocks. */
static duet_status cpu_host_access(cpu_backend *be, duet_buffer *buf) {
    pthread_rwlock_rdlock(&be->dev->layout);
    while (buf->rp_rows) {
        pthread_rwlock_unlock(&be->dev->layout);
        pthread_rwlock_wrlock(&be->dev->layout);
        duet_status st = duet__cpu_rp_restore(be, buf);
        pthread_rwlock_unlock(&be->dev->layout);
        if (st != DUET_OK) return st;
        pthread_rwlock_rdlock(&be->dev->layout);
    }
    return DUET_OK;
}

static duet_status cpu_upload(duet_backend *be, duet_buffer *buf, size_t offset, const void *src,
                              size_t size) {
    /* The registry checked the range. Bytes go in as the caller's layout. */
    duet_status st = cpu_host_access((cpu_backend *)be, buf);
    if (st != DUET_OK) return st;
#ifdef MADV_HUGEPAGE
    if (offset == 0 && size == buf->head.size && size >= CPU_HUGE_MIN) /* a hint; failure is fine */
        madvise(buf->data, (size + CPU_HUGE_ALIGN - 1) & ~(CPU_HUGE_ALIGN - 1), MADV_HUGEPAGE);
#endif
    if (size) memcpy((char *)buf->data + offset, src, size);
    pthread_rwlock_unlock(&((cpu_backend *)be)->dev->layout);
    return DUET_OK;
}

static duet_status cpu_download(duet_backend *be, duet_buffer *buf, size_t offset, void *dst, size_t size) {
    duet_status st = cpu_host_access((cpu_backend *)be, buf); /* the registry checked the range */
    if (st != DUET_OK) return st;
    if (size) memcpy(dst, (const char *)buf->data + offset, size);
    pthread_rwlock_unlock(&((cpu_backend *)be)->dev->layout);
    return DUET_OK;
}

/* The plain layout until the next matmul that repacks the buffer. */
static void *cpu_buffer_host_ptr(duet_backend *be, duet_buffer *buf) {
    if (!buf || cpu_host_access((cpu_backend *)be, buf) != DUET_OK) return NULL;
    pthread_rwlock_unlock(&((cpu_backend *)be)->dev->layout);
    return buf->data;
}

/* ---- steps ------------------------------------------------------------------- */

static duet_status cpu_begin(duet_backend *base) {
    cpu_backend *be = (cpu_backend *)base;
    if (be->in_step) return duet__error(DUET_INVALID_ARGUMENT, "cpu: begin while a step is open");
    if (be->pool == &be->dev->pool) pthread_mutex_lock(&be->dev->step_mu); /* released at submit */
    be->in_step = true;
    return DUET_OK;
}

static duet_status cpu_submit(duet_backend *base) {
    cpu_backend *be = (cpu_backend *)base;
    if (!be->in_step) return duet__error(DUET_INVALID_ARGUMENT, "cpu: submit without begin");
    be->in_step = false;
    if (be->pool == &be->dev->pool) pthread_mutex_unlock(&be->dev->step_mu);
    be->prof_steps += be->profile;
    return DUET_OK;
}

/* Ops already ran when they were recorded. */
static duet_status cpu_wait(duet_backend *base) {
    return DUET_OK;
}

/* ---- op validation ------------------------------------------------------------- */

/* The host address of a view, or NULL when it is absent. The registry
 * checked every view against its buffer (duet_op_check) before the op gets
 * here; what is left for this backend are the index values, which it can
 * read: a bad one is an error rather than a clamp, and nothing has been
 * written when it fails. */
static void *at(duet_view v) {
    return v.buf ? (char *)v.buf->data + v.offset : NULL;
}

/* Whole rows of `row` bytes a view holds from its offset to its buffer's end. */
static uint64_t rows_in(duet_view v, uint64_t row) {
    return v.offset <= v.buf->head.size ? (v.buf->head.size - v.offset) / row : 0;
}

/* Every token's position and sequence slot, and the block-table entries
 * covering positions 0..pos of its sequence (the rows it writes or reads). */
static duet_status check_pages(const char *op, const duet_kv_pages *kv, const int32_t *table,
                               const int32_t *pos, const int32_t *seq, int n_tokens) {
    const int64_t n_pos = (int64_t)kv->max_blocks * kv->block_size;
    /* Tokens of one sequence usually come in a run of rising positions:
     * table entries already checked for the previous token are skipped. */
    int32_t last_seq = -1;
    int64_t checked = 0;
    for (int i = 0; i < n_tokens; i++) {
        REQUIRE(pos[i] >= 0 && pos[i] < n_pos,
                "%s: token %d has position %d outside [0, %lld) (table of %d blocks x %d tokens)", op, i,
                pos[i], (long long)n_pos, kv->max_blocks, kv->block_size);
        REQUIRE(seq[i] >= 0 && seq[i] < kv->n_seqs, "%s: token %d has sequence slot %d outside [0, %d)", op,
                i, seq[i], kv->n_seqs);
        if (seq[i] != last_seq) last_seq = seq[i], checked = 0;
        const int32_t *entries = table + (size_t)seq[i] * (size_t)kv->max_blocks;
        int64_t need = pos[i] / kv->block_size + 1;
        for (int64_t j = checked; j < need; j++)
            REQUIRE(entries[j] >= 0 && entries[j] < kv->n_blocks,
                    "%s: token %d (sequence %d, position %d) uses block table entry %lld = %d, outside the "
                    "pool's %d blocks",
                    op, i, seq[i], pos[i], (long long)j, entries[j], kv->n_blocks);
        if (need > checked) checked = need;
    }
    return DUET_OK;
}

static duet_status cpu_run_op(cpu_backend *be, const duet_op *op) {
    switch (op->kind) {
    case DUET_OP_EMBED: {
        const uint64_t n_rows =
            rows_in(op->embed.table, duet_dtype_row_bytes(op->embed.dtype, op->embed.dim));
        const int32_t *tok = at(op->embed.tokens);
        for (int t = 0; t < op->n_tokens; t++)
            REQUIRE(tok[t] >= 0 && (uint64_t)tok[t] < n_rows,
                    "embed: token %d is %d, outside the %llu-row table", t, tok[t],
                    (unsigned long long)n_rows);
        return duet__cpu_embed(be, op, at(op->embed.tokens), at(op->embed.table), op->embed.table.buf,
                               at(op->embed.out));
    }
    case DUET_OP_RMSNORM:
        return duet__cpu_rmsnorm(be, op, at(op->rmsnorm.x), at(op->rmsnorm.w), at(op->rmsnorm.out),
                                 at(op->rmsnorm.out_q8));
    case DUET_OP_MATMUL: {
        /* Pre-quantised activations (x_q8) replace x when given. */
        const bool xq = op->matmul.x_q8.buf != NULL;
        const duet_buffer *wb = op->matmul.w.buf;
        if (wb->rp_rows && wb->rp_dtype == DUET_DTYPE_F16)
            return duet__cpu_matmul_f16_rp(be, op, at(op->matmul.w), wb->rp_rows, at(op->matmul.x),
                                           at(op->matmul.bias), at(op->matmul.out));
        if (wb->rp_rows)
            return duet__cpu_matmul_rp(be, op, at(op->matmul.w), wb->rp_rows, xq ? NULL : at(op->matmul.x),
                                       at(op->matmul.x_q8), at(op->matmul.bias), at(op->matmul.out));
        return duet__cpu_matmul(be, op, at(op->matmul.w), xq ? NULL : at(op->matmul.x), at(op->matmul.x_q8),
                                at(op->matmul.bias), at(op->matmul.out));
    }
    case DUET_OP_ROPE_KV: {
        const duet_kv_pages *kv = &op->rope_kv.kv;
        CHECK(check_pages("rope_kv", kv, at(kv->block_table), at(op->rope_kv.pos), at(op->rope_kv.seq),
                          op->n_tokens));
        return duet__cpu_rope_kv(be, op, at(op->rope_kv.q), at(op->rope_kv.k), at(op->rope_kv.v),
                                 at(op->rope_kv.pos), at(op->rope_kv.seq), at(op->rope_kv.freqs),
                                 at(kv->block_table), at(kv->k_pool), at(kv->v_pool));
    }
    case DUET_OP_ATTENTION: {
        const duet_kv_pages *kv = &op->attention.kv;
        const int32_t *pos = at(op->attention.pos);
        CHECK(check_pages("attention", kv, at(kv->block_table), pos, at(op->attention.seq), op->n_tokens));
        for (int i = 0; i < op->n_tokens && op->attention.n_keys > 0; i++)
            REQUIRE(pos[i] < op->attention.n_keys, "attention: token %d has position %d past n_keys %d", i,
                    pos[i], op->attention.n_keys);
        return duet__cpu_attention(be, op, at(op->attention.q), pos, at(op->attention.seq),
                                   at(kv->block_table), at(kv->k_pool), at(kv->v_pool), at(op->attention.out),
                                   at(op->attention.out_q8));
    }
    case DUET_OP_SWIGLU:
        return duet__cpu_swiglu(be, op, at(op->swiglu.gate), at(op->swiglu.up), at(op->swiglu.out),
                                at(op->swiglu.out_q8));
    case DUET_OP_ADD:
        return duet__cpu_add(be, op, at(op->add.a), at(op->add.b), at(op->add.out));
    case DUET_OP_GATHER_ROWS: {
        const uint64_t n_rows = rows_in(op->gather.x, (uint64_t)op->gather.dim * 4);
        const int32_t *rows = at(op->gather.rows);
        for (int t = 0; t < op->n_tokens; t++)
            REQUIRE(rows[t] >= 0 && (uint64_t)rows[t] < n_rows,
                    "gather_rows: row %d is %d, outside the %llu rows of x", t, rows[t],
                    (unsigned long long)n_rows);
        return duet__cpu_gather(be, op, at(op->gather.x), rows, at(op->gather.out));
    }
    case DUET_OP_ARGMAX:
        return duet__cpu_argmax(be, op, at(op->argmax.x), at(op->argmax.out));
    case DUET_OP_COUNT:
        break;
    }
    return duet__error(DUET_INVALID_ARGUMENT, "cpu: unknown op kind %d", (int)op->kind);
}

/* Paged KV in f32, f16 or q8_0; q8_0 activations (out_q8, x_q8) everywhere. */
static bool cpu_kv_dtype_ok(duet_dtype t) {
    return t == DUET_DTYPE_F32 || t == DUET_DTYPE_F16 || t == DUET_DTYPE_Q8_0;
}

/* The weight types the cpu kernels read (matmul and embedding). */
static bool cpu_weight_ok(duet_dtype t) {
    return t == DUET_DTYPE_F32 || t == DUET_DTYPE_F16 || t == DUET_DTYPE_BF16 || t == DUET_DTYPE_Q8_0 ||
           duet_dtype_is_packed_quant(t);
}

static bool cpu_supports_op(int index, const duet_op *op) {
    (void)index;
    switch (op->kind) {
    case DUET_OP_EMBED:
        return cpu_weight_ok(op->embed.dtype);
    case DUET_OP_MATMUL:
        return cpu_weight_ok(op->matmul.dtype);
    case DUET_OP_ROPE_KV:
        return cpu_kv_dtype_ok(op->rope_kv.kv.dtype);
    case DUET_OP_ATTENTION:
        return cpu_kv_dtype_ok(op->attention.kv.dtype);
    case DUET_OP_RMSNORM:
    case DUET_OP_SWIGLU:
    case DUET_OP_ADD:
    case DUET_OP_GATHER_ROWS:
    case DUET_OP_ARGMAX:
        return true;
    case DUET_OP_COUNT:
        break;
    }
    return false;
}

/* The op under the device's layout lock: for reading, or for writing when
 * a weight's layout must change first (rare: a Q4_0, Q5_0 or F16 matrix's first matmul). */
static duet_status cpu_run_op_locked(cpu_backend *be, const duet_op *op) {
    bool stale;
    pthread_rwlock_rdlock(&be->dev->layout);
    duet_status st = duet__cpu_rp_prepare(be, op, false, &stale);
    if (st == DUET_OK && stale) {
        pthread_rwlock_unlock(&be->dev->layout);
        pthread_rwlock_wrlock(&be->dev->layout);
        st = duet__cpu_rp_prepare(be, op, true, &stale); /* the weights' layout for this op */
    }
    if (st == DUET_OK) st = cpu_run_op(be, op);
    pthread_rwlock_unlock(&be->dev->layout);
    return st;
}

static duet_status cpu_op(duet_backend *base, const duet_op *op) {
    cpu_backend *be = (cpu_backend *)base;
    if (!be->in_step) return duet__error(DUET_INVALID_ARGUMENT, "cpu: op outside a step (call begin first)");
    if (!be->profile) return cpu_run_op_locked(be, op);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    duet_status st = cpu_run_op_locked(be, op);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    be->prof_n[op->kind]++;
    be->prof_ms[op->kind] += (double)(t1.tv_sec - t0.tv_sec) * 1e3 + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-6;
    return st;
}

static void cpu_profile(duet_backend *base, duet_profile *out) {
    const cpu_backend *be = (const cpu_backend *)base;
    if (!be->profile) return;
    out->enabled = true;
    out->steps = be->prof_steps;
    for (int k = 0; k < DUET_OP_COUNT; k++) {
        out->count[k] = be->prof_n[k];
        out->ms[k] = be->prof_ms[k];
    }
}

/* Every allocation the backend makes for itself: scratch only grows until
 * close, so the current sizes are the high-water mark. */
static size_t cpu_scratch_bytes(duet_backend *base) {
    const cpu_backend *be = (const cpu_backend *)base;
    return be->act.size + be->work.size + be->attn.size;
}

const duet_backend_iface duet_cpu_backend_iface = {
    .name = "cpu",
    .available = cpu_available,
    .device_count = cpu_device_count,
    .device_info = cpu_device_info,
    .open = cpu_open,
    .stream_open = cpu_stream_open,
    .close = cpu_close,
    .supports_op = cpu_supports_op,
    .profile = cpu_profile,
    .buffer_alloc = cpu_buffer_alloc,
    .buffer_free = cpu_buffer_free,
    .upload = cpu_upload,
    .download = cpu_download,
    .begin = cpu_begin,
    .op = cpu_op,
    .submit = cpu_submit,
    .wait = cpu_wait,
    .buffer_host_ptr = cpu_buffer_host_ptr,
    .scratch_bytes = cpu_scratch_bytes,
};
