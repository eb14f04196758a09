/* operands.c — every op's contract in one place: its shape rules and its
 * operands (views, bytes, alignment, access, allowed aliases), and the one
 * check the registry runs on every op for every backend. Backends keep
 * only what their device limits (index widths, local memory). */
#include <stdio.h>

#include "backend.h"
#include "backend_checks.h"

static const char *const op_names[DUET_OP_COUNT] = {
    [DUET_OP_EMBED] = "embed",     [DUET_OP_RMSNORM] = "rmsnorm",         [DUET_OP_MATMUL] = "matmul",
    [DUET_OP_ROPE_KV] = "rope_kv", [DUET_OP_ATTENTION] = "attention",     [DUET_OP_SWIGLU] = "swiglu",
    [DUET_OP_ADD] = "add",         [DUET_OP_GATHER_ROWS] = "gather_rows", [DUET_OP_ARGMAX] = "argmax",
};

const char *duet_op_name(duet_op_kind kind) {
    return (unsigned)kind < DUET_OP_COUNT ? op_names[kind] : "op?";
}

/* ---- shapes ------------------------------------------------------------------------------ */

/* Paged-KV geometry shared by rope_kv and attention. */
static duet_status check_kv_pages(const char *op, const duet_kv_pages *kv, int head_dim, int n_head,
                                  int n_head_kv) {
    if (kv->dtype != DUET_DTYPE_F32 && kv->dtype != DUET_DTYPE_F16 && kv->dtype != DUET_DTYPE_Q8_0)
        return duet__error(DUET_UNSUPPORTED, "%s: kv dtype %d (f32, f16 or q8_0)", op, (int)kv->dtype);
    REQUIRE(kv->block_size >= 1 && kv->n_blocks >= 1 && kv->n_seqs >= 1 && kv->max_blocks >= 1,
            "%s: kv pages %d blocks x %d tokens, table %d x %d", op, kv->n_blocks, kv->block_size, kv->n_seqs,
            kv->max_blocks);
    REQUIRE(head_dim >= 1 && n_head >= 1 && n_head_kv >= 1, "%s: %d heads over %d kv heads of %d", op, n_head,
            n_head_kv, head_dim);
    REQUIRE((int64_t)n_head * head_dim <= INT32_MAX && (int64_t)n_head_kv * head_dim <= INT32_MAX,
            "%s: %d x %d heads too wide", op, n_head, head_dim);
    if (kv->dtype == DUET_DTYPE_Q8_0 && head_dim % DUET_QK8_0)
        return duet__error(DUET_UNSUPPORTED, "%s: q8_0 kv needs head_dim %% 32 == 0 (got %d)", op, head_dim);
    return DUET_OK;
}

/* Outputs out and out_q8: at least one; out_q8 needs whole q8_0 blocks. */
static duet_status check_outputs(const char *op, duet_view out, duet_view out_q8, int width) {
    REQUIRE(out.buf || out_q8.buf, "%s: neither out nor out_q8", op);
    REQUIRE(!out_q8.buf || width % DUET_QK8_0 == 0,
            "%s: out_q8 needs a width that is a multiple of 32 (got %d)", op, width);
    return DUET_OK;
}

duet_status duet_op_check_shape(const duet_op *op) {
    REQUIRE((unsigned)op->kind < DUET_OP_COUNT, "op: unknown kind %d", (int)op->kind);
    const char *name = op_names[op->kind];
    REQUIRE(op->n_tokens > 0, "%s: n_tokens %d", name, op->n_tokens);
    switch (op->kind) {
    case DUET_OP_EMBED: {
        const duet_dtype dt = op->embed.dtype;
        if (!duet_dtype_is_weight(dt))
            return duet__error(DUET_UNSUPPORTED, "embed: dtype %d is not a weight type", (int)dt);
        REQUIRE(op->embed.dim > 0 && op->embed.dim % duet_dtype_block(dt) == 0,
                "embed: dim %d is not a positive multiple of %s's block", op->embed.dim, duet_dtype_name(dt));
        return DUET_OK;
    }
    case DUET_OP_RMSNORM:
        REQUIRE(op->rmsnorm.dim > 0, "rmsnorm: dim %d", op->rmsnorm.dim);
        return check_outputs(name, op->rmsnorm.out, op->rmsnorm.out_q8, op->rmsnorm.dim);
    case DUET_OP_MATMUL: {
        const duet_dtype dt = op->matmul.dtype;
        const int n_in = op->matmul.n_in, n_out = op->matmul.n_out;
        if (!duet_dtype_is_weight(dt))
            return duet__error(DUET_UNSUPPORTED, "matmul: dtype %d is not a weight type", (int)dt);
        REQUIRE(n_in > 0 && n_out > 0, "matmul: n_in %d, n_out %d", n_in, n_out);
        REQUIRE(n_in % duet_dtype_block(dt) == 0, "matmul: n_in %d is not a multiple of %s's block of %d",
                n_in, duet_dtype_name(dt), duet_dtype_block(dt));
        REQUIRE(!op->matmul.x_q8.buf || duet_dtype_takes_q8_activations(dt),
                "matmul: %s weights do not take q8 activations (x_q8)", duet_dtype_name(dt));
        REQUIRE(op->matmul.x_q8.buf || op->matmul.x.buf, "matmul: no input");
        return DUET_OK;
    }
    case DUET_OP_ROPE_KV: {
        const int nh = op->rope_kv.n_head, nkv = op->rope_kv.n_head_kv, hd = op->rope_kv.head_dim;
        CHECK(check_kv_pages(name, &op->rope_kv.kv, hd, nh, nkv));
        REQUIRE(op->rope_kv.n_rot >= 0 && op->rope_kv.n_rot <= hd && op->rope_kv.n_rot % 2 == 0,
                "rope_kv: n_rot %d must be even and at most head_dim %d", op->rope_kv.n_rot, hd);
        REQUIRE(op->rope_kv.mscale >= 0.0f && op->rope_kv.mscale < 1e6f, "rope_kv: mscale %g",
                (double)op->rope_kv.mscale);
        return DUET_OK;
    }
    case DUET_OP_ATTENTION: {
        const int nh = op->attention.n_head, nkv = op->attention.n_head_kv, hd = op->attention.head_dim;
        const duet_kv_pages *kv = &op->attention.kv;
        CHECK(check_kv_pages(name, kv, hd, nh, nkv));
        REQUIRE(nh % nkv == 0, "attention: n_head %d must be a multiple of n_head_kv %d", nh, nkv);
        REQUIRE(op->attention.n_keys >= 0 &&
                    (int64_t)op->attention.n_keys <= (int64_t)kv->max_blocks * kv->block_size,
                "attention: n_keys %d outside [0, %lld] (the table's capacity)", op->attention.n_keys,
                (long long)kv->max_blocks * kv->block_size);
        REQUIRE(op->attention.window >= 0, "attention: window %d", op->attention.window);
        return check_outputs(name, op->attention.out, op->attention.out_q8, nh * hd);
    }
    case DUET_OP_SWIGLU:
        REQUIRE(op->swiglu.dim > 0, "swiglu: dim %d", op->swiglu.dim);
        return check_outputs(name, op->swiglu.out, op->swiglu.out_q8, op->swiglu.dim);
    case DUET_OP_ADD:
        REQUIRE(op->add.dim > 0, "add: dim %d", op->add.dim);
        return DUET_OK;
    case DUET_OP_GATHER_ROWS:
        REQUIRE(op->gather.dim > 0, "gather_rows: dim %d", op->gather.dim);
        return DUET_OK;
    case DUET_OP_ARGMAX:
        REQUIRE(op->argmax.dim > 0, "argmax: dim %d", op->argmax.dim);
        return DUET_OK;
    case DUET_OP_COUNT:
        break;
    }
    return duet__error(DUET_INVALID_ARGUMENT, "op: unknown kind %d", (int)op->kind);
}

/* ---- operands ---------------------------------------------------------------------------- */

typedef struct list {
    duet_operand *o;
    int n;
} list;

/* Adds an operand; returns its index (for alias masks). */
static int add(list *l, const char *name, duet_view v, uint64_t bytes, size_t align, duet_access access,
               bool optional) {
    l->o[l->n] = (duet_operand){.name = name,
                                .view = v,
                                .bytes = bytes,
                                .need = bytes,
                                .align = align,
                                .access = access,
                                .optional = optional};
    return l->n++;
}

/* A table of whole `row`-byte rows sized by its buffer: at least one row
 * must fit; the op may touch every row that does. */
static int add_table(list *l, const char *name, duet_view v, uint64_t row, size_t align) {
    int i = add(l, name, v, row, align, DUET_READ, false);
    if (v.buf) {
        const size_t size = duet_buffer_head_of(v.buf)->size;
        const uint64_t avail = v.offset <= size ? size - v.offset : 0;
        if (avail >= row) l->o[i].bytes = avail / row * row;
    }
    return i;
}

static size_t elem_align(duet_dtype t) {
    return t == DUET_DTYPE_F32 || t == DUET_DTYPE_I32 ? 4 : 2;
}

/* [n][width] q8_0 blocks. */
static uint64_t q8_bytes(uint64_t n, int width) {
    return mul3(n, (uint64_t)(width / DUET_QK8_0), sizeof(duet_block_q8_0));
}

static void add_kv(list *l, const duet_kv_pages *kv, int kv_width, duet_access pools) {
    const uint64_t pool = duet_kv_pool_bytes(kv, kv_width);
    add(l, "k_pool", kv->k_pool, pool, elem_align(kv->dtype), pools, false);
    add(l, "v_pool", kv->v_pool, pool, elem_align(kv->dtype), pools, false);
    add(l, "block_table", kv->block_table, mul3((uint64_t)kv->n_seqs, (uint64_t)kv->max_blocks, 4), 4,
        DUET_READ, false);
}

int duet_op_operands(const duet_op *op, duet_operand out[DUET_MAX_OPERANDS]) {
    list l = {out, 0};
    const uint64_t nt = (uint64_t)op->n_tokens;
    switch (op->kind) {
    case DUET_OP_EMBED: {
        const duet_dtype dt = op->embed.dtype;
        add(&l, "tokens", op->embed.tokens, nt * 4, 4, DUET_READ, false);
        add_table(&l, "table", op->embed.table, duet_dtype_row_bytes(dt, op->embed.dim), elem_align(dt));
        add(&l, "out", op->embed.out, mul3(nt, (uint64_t)op->embed.dim, 4), 4, DUET_WRITE, false);
        break;
    }
    case DUET_OP_RMSNORM: {
        const int dim = op->rmsnorm.dim;
        const uint64_t bytes = mul3(nt, (uint64_t)dim, 4);
        int x = add(&l, "x", op->rmsnorm.x, bytes, 4, DUET_READ, false);
        add(&l, "w", op->rmsnorm.w, (uint64_t)dim * 4, 4, DUET_READ, false);
        int o = add(&l, "out", op->rmsnorm.out, bytes, 4, DUET_WRITE, true);
        out[o].alias_ok = 1u << x;
        add(&l, "out_q8", op->rmsnorm.out_q8, q8_bytes(nt, dim), 2, DUET_WRITE, true);
        break;
    }
    case DUET_OP_MATMUL: {
        const duet_dtype dt = op->matmul.dtype;
        const int n_in = op->matmul.n_in, n_out = op->matmul.n_out;
        add(&l, "w", op->matmul.w, mul2((uint64_t)n_out, duet_dtype_row_bytes(dt, n_in)), elem_align(dt),
            DUET_READ, false);
        /* Pre-quantised activations replace x when given. */
        if (op->matmul.x_q8.buf)
            add(&l, "x_q8", op->matmul.x_q8, q8_bytes(nt, n_in), 2, DUET_READ, false);
        else
            add(&l, "x", op->matmul.x, mul3(nt, (uint64_t)n_in, 4), 4, DUET_READ, false);
        add(&l, "bias", op->matmul.bias, (uint64_t)n_out * 4, 4, DUET_READ, true);
        add(&l, "out", op->matmul.out, mul3(nt, (uint64_t)n_out, 4), 4,
            op->matmul.accumulate ? DUET_READ_WRITE : DUET_WRITE, false);
        break;
    }
    case DUET_OP_ROPE_KV: {
        const int hd = op->rope_kv.head_dim;
        const uint64_t qw = (uint64_t)op->rope_kv.n_head * hd, kw = (uint64_t)op->rope_kv.n_head_kv * hd;
        add(&l, "q", op->rope_kv.q, mul3(nt, qw, 4), 4, DUET_READ_WRITE, false);
        add(&l, "k", op->rope_kv.k, mul3(nt, kw, 4), 4, DUET_READ_WRITE, false);
        add(&l, "v", op->rope_kv.v, mul3(nt, kw, 4), 4, DUET_READ, false);
        add(&l, "pos", op->rope_kv.pos, nt * 4, 4, DUET_READ, false);
        add(&l, "seq", op->rope_kv.seq, nt * 4, 4, DUET_READ, false);
        /* Read only when something turns. */
        add(&l, "freqs", op->rope_kv.freqs, (uint64_t)(op->rope_kv.n_rot / 2) * 4, 4, DUET_READ,
            op->rope_kv.n_rot == 0);
        add_kv(&l, &op->rope_kv.kv, (int)kw, DUET_READ_WRITE);
        break;
    }
    case DUET_OP_ATTENTION: {
        const uint64_t width = (uint64_t)op->attention.n_head * op->attention.head_dim;
        int q = add(&l, "q", op->attention.q, mul3(nt, width, 4), 4, DUET_READ, false);
        add(&l, "pos", op->attention.pos, nt * 4, 4, DUET_READ, false);
        add(&l, "seq", op->attention.seq, nt * 4, 4, DUET_READ, false);
        add_kv(&l, &op->attention.kv, op->attention.n_head_kv * op->attention.head_dim, DUET_READ);
        int o = add(&l, "out", op->attention.out, mul3(nt, width, 4), 4, DUET_WRITE, true);
        out[o].alias_ok = 1u << q;
        add(&l, "out_q8", op->attention.out_q8, q8_bytes(nt, (int)width), 2, DUET_WRITE, true);
        break;
    }
    case DUET_OP_SWIGLU: {
        const uint64_t bytes = mul3(nt, (uint64_t)op->swiglu.dim, 4);
        int g = add(&l, "gate", op->swiglu.gate, bytes, 4, DUET_READ, false);
        int u = add(&l, "up", op->swiglu.up, bytes, 4, DUET_READ, false);
        int o = add(&l, "out", op->swiglu.out, bytes, 4, DUET_WRITE, true);
        out[o].alias_ok = 1u << g | 1u << u;
        add(&l, "out_q8", op->swiglu.out_q8, q8_bytes(nt, op->swiglu.dim), 2, DUET_WRITE, true);
        break;
    }
    case DUET_OP_ADD: {
        const uint64_t bytes = mul3(nt, (uint64_t)op->add.dim, 4);
        int a = add(&l, "a", op->add.a, bytes, 4, DUET_READ, false);
        int b = add(&l, "b", op->add.b, bytes, 4, DUET_READ, false);
        int o = add(&l, "out", op->add.out, bytes, 4, DUET_WRITE, false);
        out[o].alias_ok = 1u << a | 1u << b;
        break;
    }
    case DUET_OP_GATHER_ROWS: {
        const uint64_t row = (uint64_t)op->gather.dim * 4;
        add_table(&l, "x", op->gather.x, row, 4);
        add(&l, "rows", op->gather.rows, nt * 4, 4, DUET_READ, false);
        add(&l, "out", op->gather.out, mul2(nt, row), 4, DUET_WRITE, false);
        break;
    }
    case DUET_OP_ARGMAX:
        add(&l, "x", op->argmax.x, mul3(nt, (uint64_t)op->argmax.dim, 4), 4, DUET_READ, false);
        add(&l, "out", op->argmax.out, nt * 4, 4, DUET_WRITE, false);
        break;
    case DUET_OP_COUNT:
        break;
    }
    return l.n;
}

/* ---- the check --------------------------------------------------------------------------- */

static bool overlap(const duet_operand *a, const duet_operand *b) {
    return a->view.buf == b->view.buf && a->view.offset < b->view.offset + b->bytes &&
           b->view.offset < a->view.offset + a->bytes;
}

duet_status duet_op_check(const duet_op *op) {
    CHECK(duet_op_check_shape(op));
    const char *name = op_names[op->kind];
    duet_operand o[DUET_MAX_OPERANDS];
    const int n = duet_op_operands(op, o);
    for (int i = 0; i < n; i++) {
        const duet_view v = o[i].view;
        if (!v.buf) {
            REQUIRE(o[i].optional, "%s: %s has no buffer", name, o[i].name);
            continue;
        }
        REQUIRE(v.offset % o[i].align == 0, "%s: %s offset %zu is not a multiple of %zu", name, o[i].name,
                v.offset, o[i].align);
        const size_t size = duet_buffer_head_of(v.buf)->size;
        REQUIRE(v.offset <= size && o[i].need <= (uint64_t)(size - v.offset),
                "%s: %s needs %llu bytes at offset %zu but its buffer holds %zu", name, o[i].name,
                (unsigned long long)o[i].need, v.offset, size);
    }
    /* Work-items write an output while others still read the inputs: a
     * written range may meet another operand only as an allowed exact
     * alias (an elementwise op in place). */
    for (int i = 0; i < n; i++)
        for (int j = i + 1; j < n; j++) {
            const duet_operand *a = &o[i], *b = &o[j];
            if (!a->view.buf || !b->view.buf || !((a->access | b->access) & DUET_WRITE) || !overlap(a, b))
                continue;
            const bool exact = a->view.offset == b->view.offset && a->bytes == b->bytes;
            const bool allowed = (a->alias_ok >> j & 1) || (b->alias_ok >> i & 1);
            if (exact && allowed) continue;
            return duet__error(DUET_INVALID_ARGUMENT, "%s: %s %soverlaps %s", name, a->name,
                               allowed ? "partly " : "", b->name);
        }
    return DUET_OK;
}
