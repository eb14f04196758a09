/* cpu_backend.c — the cpu backend's interface: one host device, host-memory
 * buffers, and ops that run when they are recorded.
 *
 * The cpu backend is the fallback where there is no GPU and the oracle the
 * GPU backends are tested against, so every op validates its operands
 * against the buffers' sizes (and its index inputs against the tables they
 * index) before touching memory: a bad op returns DUET_INVALID_ARGUMENT
 * naming the op and operand, never reads or writes out of bounds. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
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
    duet__cpu_pool_free(&be->pool);
    free(be->act.p);
    free(be->work.p);
    free(be->attn.p);
    free(be->rope_freq);
    free(be);
}

static duet_status cpu_open(int index, const duet_backend_params *params, duet_backend **out) {
    *out = NULL;
    if (index != 0) return duet__error(DUET_NO_DEVICE, "cpu: no device %d (it has 1)", index);
    int n = params ? params->n_threads : 0;
    if (n < 0 || n > 1024) return duet__error(DUET_INVALID_ARGUMENT, "cpu: n_threads %d (0 = all cores)", n);
    if (n == 0) n = cpu_online();
    cpu_backend *be = calloc(1, sizeof *be);
    if (!be) return duet__error(DUET_OUT_OF_MEMORY, "cpu: backend");
    be->base.iface = &duet_cpu_backend_iface;
    be->base.device_index = 0;
    be->isa = duet__cpu_isa_detect();
    cpu_fill_info(&be->base.info, be->isa, n);
    duet_status st = duet__cpu_pool_init(&be->pool, n);
    if (st != DUET_OK) {
        free(be);
        return st;
    }
    *out = &be->base;
    return DUET_OK;
}

/* ---- buffers ----------------------------------------------------------------- */

/* Weight-sized buffers get 2 MiB alignment and a transparent-huge-page hint:
 * decode streams every weight once per token, and fewer TLB misses help. */
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
#ifdef MADV_HUGEPAGE
    if (align == CPU_HUGE_ALIGN) madvise(b->data, padded, MADV_HUGEPAGE); /* a hint; failure is fine */
#endif
    b->size = size;
    *out = b;
    return DUET_OK;
}

static void cpu_buffer_free(duet_backend *be, duet_buffer *buf) {
    if (!buf) return;
    free(buf->data);
    free(buf);
}

static duet_status cpu_check_range(const char *what, duet_buffer *buf, size_t offset, size_t size) {
    if (offset > buf->size || size > buf->size - offset)
        return duet__error(DUET_INVALID_ARGUMENT,
                           "cpu %s: %zu bytes at offset %zu run past a %zu-byte buffer", what, size, offset,
                           buf->size);
    return DUET_OK;
}

static duet_status cpu_upload(duet_backend *be, duet_buffer *buf, size_t offset, const void *src,
                              size_t size) {
    duet_status st = cpu_check_range("upload", buf, offset, size);
    if (st == DUET_OK && size) memcpy((char *)buf->data + offset, src, size);
    return st;
}

static duet_status cpu_download(duet_backend *be, duet_buffer *buf, size_t offset, void *dst, size_t size) {
    duet_status st = cpu_check_range("download", buf, offset, size);
    if (st == DUET_OK && size) memcpy(dst, (const char *)buf->data + offset, size);
    return st;
}

static void *cpu_buffer_host_ptr(duet_backend *be, duet_buffer *buf) {
    return buf ? buf->data : NULL;
}

/* ---- steps ------------------------------------------------------------------- */

static duet_status cpu_begin(duet_backend *base) {
    cpu_backend *be = (cpu_backend *)base;
    if (be->in_step) return duet__error(DUET_INVALID_ARGUMENT, "cpu: begin while a step is open");
    be->in_step = true;
    return DUET_OK;
}

static duet_status cpu_submit(duet_backend *base) {
    cpu_backend *be = (cpu_backend *)base;
    if (!be->in_step) return duet__error(DUET_INVALID_ARGUMENT, "cpu: submit without begin");
    be->in_step = false;
    return DUET_OK;
}

/* Ops already ran when they were recorded. */
static duet_status cpu_wait(duet_backend *base) {
    return DUET_OK;
}

/* ---- op validation ------------------------------------------------------------- */

static const char *const cpu_op_names[DUET_OP_COUNT] = {
    [DUET_OP_EMBED] = "embed",     [DUET_OP_RMSNORM] = "rmsnorm",         [DUET_OP_MATMUL] = "matmul",
    [DUET_OP_ROPE_KV] = "rope_kv", [DUET_OP_ATTENTION] = "attention",     [DUET_OP_SWIGLU] = "swiglu",
    [DUET_OP_ADD] = "add",         [DUET_OP_GATHER_ROWS] = "gather_rows", [DUET_OP_ARGMAX] = "argmax",
};

/* Resolves a view that must hold `bytes` bytes, aligned for its element. */
static duet_status view_ptr(const char *op, const char *name, duet_view v, uint64_t bytes, size_t align,
                            void **out) {
    *out = NULL;
    if (!v.buf) return duet__error(DUET_INVALID_ARGUMENT, "%s: %s has no buffer", op, name);
    if (v.offset % align)
        return duet__error(DUET_INVALID_ARGUMENT, "%s: %s offset %zu is not a multiple of %zu", op, name,
                           v.offset, align);
    if (v.offset > v.buf->size || bytes > (uint64_t)(v.buf->size - v.offset))
        return duet__error(DUET_INVALID_ARGUMENT,
                           "%s: %s needs %llu bytes at offset %zu but its buffer holds %zu", op, name,
                           (unsigned long long)bytes, v.offset, v.buf->size);
    *out = (char *)v.buf->data + v.offset;
    return DUET_OK;
}

/* Bytes a view has from its offset to the end of its buffer. */
static uint64_t view_avail(duet_view v) {
    return v.buf && v.offset <= v.buf->size ? v.buf->size - v.offset : 0;
}

/* Whether [a, a+an) and [b, b+bn) share bytes of the same buffer. */
static bool views_overlap(duet_view a, uint64_t an, duet_view b, uint64_t bn) {
    return a.buf && a.buf == b.buf && a.offset < b.offset + bn && b.offset < a.offset + an;
}

/* Elementwise ops may write in place (out == input) but not over a shifted
 * copy of an input, which would read values already overwritten. */
static duet_status check_inplace(const char *op, const char *name, duet_view in, duet_view out,
                                 uint64_t bytes) {
    if (views_overlap(in, bytes, out, bytes) && in.offset != out.offset)
        return duet__error(DUET_INVALID_ARGUMENT, "%s: out partly overlaps %s", op, name);
    return DUET_OK;
}

/* The paged KV operands of rope_kv/attention: both pools, the block table,
 * and for every token its position, sequence slot and the table entries
 * covering positions 0..pos of its sequence (the rows it writes or reads).
 * The cpu backend can read the table, so a bad entry is an error here rather
 * than a clamp in the kernel, and nothing has been written when it fails. */
typedef struct kv_operands {
    void *k, *v;          /* pools */
    const int32_t *table; /* [n_seqs][max_blocks] */
    uint64_t pool_bytes;
} kv_operands;

/* (The registry checked the dtype, the geometry's signs and q8_0's
 * head_dim.) */
static duet_status check_pages(const char *op, const duet_kv_pages *kv, int kv_width, const int32_t *pos,
                               const int32_t *seq, int n_tokens, kv_operands *out) {
    const duet_dtype dt = kv->dtype;
    out->pool_bytes = duet_kv_pool_bytes(kv, kv_width);
    size_t align = dt == DUET_DTYPE_F32 ? 4 : 2;
    void *t = NULL;
    CHECK(view_ptr(op, "k_pool", kv->k_pool, out->pool_bytes, align, &out->k));
    CHECK(view_ptr(op, "v_pool", kv->v_pool, out->pool_bytes, align, &out->v));
    CHECK(view_ptr(op, "block_table", kv->block_table,
                   mul3((uint64_t)kv->n_seqs, (uint64_t)kv->max_blocks, 4), 4, &t));
    out->table = t;
    REQUIRE(!views_overlap(kv->k_pool, out->pool_bytes, kv->v_pool, out->pool_bytes),
            "%s: k_pool overlaps v_pool", op);
    const uint64_t table_bytes = (uint64_t)kv->n_seqs * (uint64_t)kv->max_blocks * 4;
    REQUIRE(!views_overlap(kv->k_pool, out->pool_bytes, kv->block_table, table_bytes) &&
                !views_overlap(kv->v_pool, out->pool_bytes, kv->block_table, table_bytes),
            "%s: a kv pool overlaps the block table", op);
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
        const int32_t *entries = out->table + (size_t)seq[i] * (size_t)kv->max_blocks;
        int64_t need = pos[i] / kv->block_size + 1;
        for (int64_t j = checked; j < need; j++)
            REQUIRE(entries[j] >= 0 && entries[j] < kv->n_blocks,
                    "%s: token %d (sequence %d, position %d) uses block table entry %lld = %d, outside the "
                    "pool's "
                    "%d blocks",
                    op, i, seq[i], pos[i], (long long)j, entries[j], kv->n_blocks);
        if (need > checked) checked = need;
    }
    return DUET_OK;
}

/* An optional q8_0 output of [n_tokens][width/32] blocks. */
static duet_status q8_out_ptr(const char *op, duet_view v, uint64_t n_tokens, int width, uint64_t *bytes,
                              void **out) {
    *out = NULL;
    *bytes = 0;
    if (!v.buf) return DUET_OK;
    REQUIRE(width % DUET_QK8_0 == 0, "%s: out_q8 needs a width that is a multiple of 32 (got %d)", op, width);
    *bytes = mul3(n_tokens, (uint64_t)(width / DUET_QK8_0), sizeof(duet_block_q8_0));
    return view_ptr(op, "out_q8", v, *bytes, 2, out);
}

static duet_status cpu_run_op(cpu_backend *be, const duet_op *op) {
    const char *name = cpu_op_names[op->kind];
    const uint64_t nt = (uint64_t)op->n_tokens;
    void *a = NULL, *b = NULL, *c = NULL, *d = NULL, *e = NULL, *f = NULL, *g = NULL;
    switch (op->kind) {
    case DUET_OP_EMBED: {
        const duet_dtype dt = op->embed.dtype;
        const int dim = op->embed.dim;
        REQUIRE(dim > 0 && dim % duet_dtype_block(dt) == 0,
                "embed: dim %d is not a positive multiple of %s's block", dim, duet_dtype_name(dt));
        uint64_t row = duet_dtype_row_bytes(dt, dim);
        CHECK(view_ptr(name, "tokens", op->embed.tokens, nt * 4, 4, &a));
        CHECK(view_ptr(name, "table", op->embed.table, row, dt == DUET_DTYPE_F32 ? 4 : 2, &b));
        CHECK(view_ptr(name, "out", op->embed.out, mul3(nt, (uint64_t)dim, 4), 4, &c));
        uint64_t n_rows = view_avail(op->embed.table) / row;
        const int32_t *tok = a;
        for (int t = 0; t < op->n_tokens; t++)
            REQUIRE(tok[t] >= 0 && (uint64_t)tok[t] < n_rows,
                    "embed: token %d is %d, outside the %llu-row table", t, tok[t],
                    (unsigned long long)n_rows);
        return duet__cpu_embed(be, op, a, b, c);
    }
    case DUET_OP_RMSNORM: {
        const int dim = op->rmsnorm.dim;
        REQUIRE(dim > 0, "rmsnorm: dim %d", dim);
        uint64_t bytes = mul3(nt, (uint64_t)dim, 4);
        uint64_t qbytes;
        REQUIRE(op->rmsnorm.out.buf || op->rmsnorm.out_q8.buf, "rmsnorm: neither out nor out_q8");
        CHECK(view_ptr(name, "x", op->rmsnorm.x, bytes, 4, &a));
        CHECK(view_ptr(name, "w", op->rmsnorm.w, (uint64_t)dim * 4, 4, &b));
        if (op->rmsnorm.out.buf) CHECK(view_ptr(name, "out", op->rmsnorm.out, bytes, 4, &c));
        CHECK(q8_out_ptr(name, op->rmsnorm.out_q8, nt, dim, &qbytes, &d));
        CHECK(check_inplace(name, "x", op->rmsnorm.x, op->rmsnorm.out, bytes));
        REQUIRE(!views_overlap(op->rmsnorm.w, (uint64_t)dim * 4, op->rmsnorm.out, bytes),
                "rmsnorm: out overlaps w");
        /* Other threads still read x and w while a row's blocks are written. */
        REQUIRE(!views_overlap(op->rmsnorm.out_q8, qbytes, op->rmsnorm.x, bytes) &&
                    !views_overlap(op->rmsnorm.out_q8, qbytes, op->rmsnorm.w, (uint64_t)dim * 4) &&
                    !views_overlap(op->rmsnorm.out_q8, qbytes, op->rmsnorm.out, bytes),
                "rmsnorm: out_q8 overlaps x, w or out");
        return duet__cpu_rmsnorm(be, op, a, b, c, d);
    }
    case DUET_OP_MATMUL: {
        const duet_dtype dt = op->matmul.dtype;
        const int n_in = op->matmul.n_in, n_out = op->matmul.n_out;
        REQUIRE(n_in > 0 && n_out > 0, "matmul: n_in %d, n_out %d", n_in, n_out);
        REQUIRE(n_in % duet_dtype_block(dt) == 0, "matmul: n_in %d is not a multiple of %s's block of %d",
                n_in, duet_dtype_name(dt), duet_dtype_block(dt));
        uint64_t wbytes = mul2((uint64_t)n_out, duet_dtype_row_bytes(dt, n_in));
        uint64_t obytes = mul3(nt, (uint64_t)n_out, 4);
        /* Pre-quantised activations (x_q8) replace x when given. */
        const bool xq = op->matmul.x_q8.buf != NULL;
        REQUIRE(!xq || dt == DUET_DTYPE_Q8_0, "matmul: x_q8 needs q8_0 weights (got %s)",
                duet_dtype_name(dt));
        duet_view xv = xq ? op->matmul.x_q8 : op->matmul.x;
        uint64_t xbytes = xq ? mul3(nt, (uint64_t)(n_in / DUET_QK8_0), sizeof(duet_block_q8_0))
                             : mul3(nt, (uint64_t)n_in, 4);
        CHECK(view_ptr(name, "w", op->matmul.w, wbytes, dt == DUET_DTYPE_F32 ? 4 : 2, &a));
        CHECK(view_ptr(name, xq ? "x_q8" : "x", xv, xbytes, xq ? 2 : 4, &b));
        if (op->matmul.bias.buf) CHECK(view_ptr(name, "bias", op->matmul.bias, (uint64_t)n_out * 4, 4, &c));
        CHECK(view_ptr(name, "out", op->matmul.out, obytes, 4, &d));
        /* Threads write out while others still read x and W. */
        REQUIRE(!views_overlap(op->matmul.out, obytes, xv, xbytes), "matmul: out overlaps %s",
                xq ? "x_q8" : "x");
        REQUIRE(!views_overlap(op->matmul.out, obytes, op->matmul.w, wbytes), "matmul: out overlaps w");
        REQUIRE(!views_overlap(op->matmul.out, obytes, op->matmul.bias, (uint64_t)n_out * 4),
                "matmul: out overlaps bias");
        return duet__cpu_matmul(be, op, a, xq ? NULL : b, xq ? b : NULL, c, d);
    }
    case DUET_OP_ROPE_KV: {
        const int nh = op->rope_kv.n_head, nkv = op->rope_kv.n_head_kv, hd = op->rope_kv.head_dim;
        const int n_rot = op->rope_kv.n_rot;
        REQUIRE(nh > 0 && nkv > 0 && hd > 0, "rope_kv: n_head %d, n_head_kv %d, head_dim %d", nh, nkv, hd);
        REQUIRE(n_rot >= 0 && n_rot <= hd && n_rot % 2 == 0,
                "rope_kv: n_rot %d must be even and at most head_dim %d", n_rot, hd);
        REQUIRE(n_rot == 0 || op->rope_kv.freq_base > 0.0f, "rope_kv: freq_base %g",
                (double)op->rope_kv.freq_base);
        REQUIRE((int64_t)nkv * hd <= INT32_MAX && (int64_t)nh * hd <= INT32_MAX,
                "rope_kv: %d x %d heads too wide", nh, hd);
        uint64_t qbytes = mul2(mul3(nt, (uint64_t)nh, (uint64_t)hd), 4),
                 kbytes = mul2(mul3(nt, (uint64_t)nkv, (uint64_t)hd), 4);
        CHECK(view_ptr(name, "q", op->rope_kv.q, qbytes, 4, &a));
        CHECK(view_ptr(name, "k", op->rope_kv.k, kbytes, 4, &b));
        CHECK(view_ptr(name, "v", op->rope_kv.v, kbytes, 4, &c));
        CHECK(view_ptr(name, "pos", op->rope_kv.pos, nt * 4, 4, &d));
        CHECK(view_ptr(name, "seq", op->rope_kv.seq, nt * 4, 4, &e));
        kv_operands kv;
        CHECK(check_pages(name, &op->rope_kv.kv, nkv * hd, d, e, op->n_tokens, &kv));
        REQUIRE(!views_overlap(op->rope_kv.q, qbytes, op->rope_kv.k, kbytes), "rope_kv: q overlaps k");
        /* Pools are written while other threads read the activations. */
        const duet_view ins[] = {op->rope_kv.q, op->rope_kv.k, op->rope_kv.v, op->rope_kv.pos,
                                 op->rope_kv.seq};
        const uint64_t in_bytes[] = {qbytes, kbytes, kbytes, nt * 4, nt * 4};
        for (int i = 0; i < 5; i++)
            REQUIRE(!views_overlap(op->rope_kv.kv.k_pool, kv.pool_bytes, ins[i], in_bytes[i]) &&
                        !views_overlap(op->rope_kv.kv.v_pool, kv.pool_bytes, ins[i], in_bytes[i]),
                    "rope_kv: a kv pool overlaps q, k, v, pos or seq");
        return duet__cpu_rope_kv(be, op, a, b, c, d, e, kv.table, kv.k, kv.v);
    }
    case DUET_OP_ATTENTION: {
        const int nh = op->attention.n_head, nkv = op->attention.n_head_kv, hd = op->attention.head_dim;
        REQUIRE(nh > 0 && nkv > 0 && hd > 0 && nh % nkv == 0,
                "attention: n_head %d must be a positive multiple of n_head_kv %d; head_dim %d", nh, nkv, hd);
        REQUIRE((int64_t)nh * hd <= INT32_MAX, "attention: %d x %d heads too wide", nh, hd);
        REQUIRE(op->attention.out.buf || op->attention.out_q8.buf, "attention: neither out nor out_q8");
        uint64_t qbytes = mul2(mul3(nt, (uint64_t)nh, (uint64_t)hd), 4), q8bytes;
        CHECK(view_ptr(name, "q", op->attention.q, qbytes, 4, &a));
        CHECK(view_ptr(name, "pos", op->attention.pos, nt * 4, 4, &b));
        CHECK(view_ptr(name, "seq", op->attention.seq, nt * 4, 4, &c));
        if (op->attention.out.buf) CHECK(view_ptr(name, "out", op->attention.out, qbytes, 4, &f));
        CHECK(q8_out_ptr(name, op->attention.out_q8, nt, nh * hd, &q8bytes, &g));
        kv_operands kv;
        CHECK(check_pages(name, &op->attention.kv, nkv * hd, b, c, op->n_tokens, &kv));
        CHECK(check_inplace(name, "q", op->attention.q, op->attention.out, qbytes));
        const duet_kv_pages *pg = &op->attention.kv;
        const uint64_t table_bytes = (uint64_t)pg->n_seqs * (uint64_t)pg->max_blocks * 4;
        /* Outputs are written while other threads read every input. */
        const duet_view outs[] = {op->attention.out, op->attention.out_q8};
        const uint64_t out_bytes[] = {qbytes, q8bytes};
        for (int i = 0; i < 2; i++) {
            REQUIRE(!views_overlap(outs[i], out_bytes[i], pg->k_pool, kv.pool_bytes) &&
                        !views_overlap(outs[i], out_bytes[i], pg->v_pool, kv.pool_bytes) &&
                        !views_overlap(outs[i], out_bytes[i], pg->block_table, table_bytes),
                    "attention: %s overlaps the KV cache", i ? "out_q8" : "out");
            REQUIRE(!views_overlap(outs[i], out_bytes[i], op->attention.pos, nt * 4) &&
                        !views_overlap(outs[i], out_bytes[i], op->attention.seq, nt * 4),
                    "attention: %s overlaps pos or seq", i ? "out_q8" : "out");
        }
        REQUIRE(!views_overlap(op->attention.out_q8, q8bytes, op->attention.q, qbytes) &&
                    !views_overlap(op->attention.out_q8, q8bytes, op->attention.out, qbytes),
                "attention: out_q8 overlaps q or out");
        const int32_t *pos = b;
        for (int i = 0; i < op->n_tokens && op->attention.n_keys > 0; i++)
            REQUIRE(pos[i] < op->attention.n_keys, "attention: token %d has position %d past n_keys %d", i,
                    pos[i], op->attention.n_keys);
        return duet__cpu_attention(be, op, a, b, c, kv.table, kv.k, kv.v, f, g);
    }
    case DUET_OP_SWIGLU: {
        REQUIRE(op->swiglu.dim > 0, "swiglu: dim %d", op->swiglu.dim);
        uint64_t bytes = mul3(nt, (uint64_t)op->swiglu.dim, 4);
        uint64_t qbytes;
        REQUIRE(op->swiglu.out.buf || op->swiglu.out_q8.buf, "swiglu: neither out nor out_q8");
        CHECK(view_ptr(name, "gate", op->swiglu.gate, bytes, 4, &a));
        CHECK(view_ptr(name, "up", op->swiglu.up, bytes, 4, &b));
        if (op->swiglu.out.buf) CHECK(view_ptr(name, "out", op->swiglu.out, bytes, 4, &c));
        CHECK(q8_out_ptr(name, op->swiglu.out_q8, nt, op->swiglu.dim, &qbytes, &d));
        CHECK(check_inplace(name, "gate", op->swiglu.gate, op->swiglu.out, bytes));
        CHECK(check_inplace(name, "up", op->swiglu.up, op->swiglu.out, bytes));
        REQUIRE(!views_overlap(op->swiglu.out_q8, qbytes, op->swiglu.gate, bytes) &&
                    !views_overlap(op->swiglu.out_q8, qbytes, op->swiglu.up, bytes) &&
                    !views_overlap(op->swiglu.out_q8, qbytes, op->swiglu.out, bytes),
                "swiglu: out_q8 overlaps gate, up or out");
        return duet__cpu_swiglu(be, op, a, b, c, d);
    }
    case DUET_OP_ADD: {
        REQUIRE(op->add.dim > 0, "add: dim %d", op->add.dim);
        uint64_t bytes = mul3(nt, (uint64_t)op->add.dim, 4);
        CHECK(view_ptr(name, "a", op->add.a, bytes, 4, &a));
        CHECK(view_ptr(name, "b", op->add.b, bytes, 4, &b));
        CHECK(view_ptr(name, "out", op->add.out, bytes, 4, &c));
        CHECK(check_inplace(name, "a", op->add.a, op->add.out, bytes));
        CHECK(check_inplace(name, "b", op->add.b, op->add.out, bytes));
        return duet__cpu_add(be, op, a, b, c);
    }
    case DUET_OP_GATHER_ROWS: {
        const int dim = op->gather.dim;
        REQUIRE(dim > 0, "gather_rows: dim %d", dim);
        uint64_t row = (uint64_t)dim * 4, obytes = mul2(nt, row);
        CHECK(view_ptr(name, "x", op->gather.x, row, 4, &a));
        CHECK(view_ptr(name, "rows", op->gather.rows, nt * 4, 4, &b));
        CHECK(view_ptr(name, "out", op->gather.out, obytes, 4, &c));
        uint64_t n_rows = view_avail(op->gather.x) / row;
        const int32_t *rows = b;
        for (int t = 0; t < op->n_tokens; t++)
            REQUIRE(rows[t] >= 0 && (uint64_t)rows[t] < n_rows,
                    "gather_rows: row %d is %d, outside the %llu rows of x", t, rows[t],
                    (unsigned long long)n_rows);
        REQUIRE(!views_overlap(op->gather.out, obytes, op->gather.x, n_rows * row),
                "gather_rows: out overlaps x");
        return duet__cpu_gather(be, op, a, b, c);
    }
    case DUET_OP_ARGMAX: {
        REQUIRE(op->argmax.dim > 0, "argmax: dim %d", op->argmax.dim);
        CHECK(view_ptr(name, "x", op->argmax.x, mul3(nt, (uint64_t)op->argmax.dim, 4), 4, &a));
        CHECK(view_ptr(name, "out", op->argmax.out, nt * 4, 4, &b));
        return duet__cpu_argmax(be, op, a, b);
    }
    case DUET_OP_COUNT:
        break;
    }
    return duet__error(DUET_INVALID_ARGUMENT, "cpu: unknown op kind %d", (int)op->kind);
}

/* Paged KV in f32, f16 or q8_0; q8_0 activations (out_q8, x_q8) everywhere. */
static bool cpu_kv_dtype_ok(duet_dtype t) {
    return t == DUET_DTYPE_F32 || t == DUET_DTYPE_F16 || t == DUET_DTYPE_Q8_0;
}

static bool cpu_supports_op(duet_backend *be, const duet_op *op) {
    switch (op->kind) {
    case DUET_OP_EMBED:
        return duet_dtype_is_weight(op->embed.dtype);
    case DUET_OP_MATMUL:
        return duet_dtype_is_weight(op->matmul.dtype);
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

static duet_status cpu_op(duet_backend *base, const duet_op *op) {
    cpu_backend *be = (cpu_backend *)base;
    if (!be->in_step) return duet__error(DUET_INVALID_ARGUMENT, "cpu: op outside a step (call begin first)");
    if ((unsigned)op->kind >= DUET_OP_COUNT)
        return duet__error(DUET_INVALID_ARGUMENT, "cpu: unknown op kind %d", (int)op->kind);
    if (op->n_tokens <= 0)
        return duet__error(DUET_INVALID_ARGUMENT, "%s: n_tokens %d", cpu_op_names[op->kind], op->n_tokens);
    if (!cpu_supports_op(base, op))
        return duet__error(DUET_UNSUPPORTED, "%s: unsupported dtype on the cpu backend",
                           cpu_op_names[op->kind]);
    return cpu_run_op(be, op);
}

/* Every allocation the backend makes for itself: scratch only grows until
 * close, so the current sizes are the high-water mark. */
static size_t cpu_scratch_bytes(duet_backend *base) {
    const cpu_backend *be = (const cpu_backend *)base;
    size_t rope = be->rope_freq ? (size_t)(be->rope_n_rot / 2) * sizeof(double) : 0;
    return be->act.size + be->work.size + be->attn.size + rope;
}

const duet_backend_iface duet_cpu_backend_iface = {
    .name = "cpu",
    .available = cpu_available,
    .device_count = cpu_device_count,
    .device_info = cpu_device_info,
    .open = cpu_open,
    .close = cpu_close,
    .supports_op = cpu_supports_op,
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
