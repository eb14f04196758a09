/* vk_ops.c — each HAL op as dispatches: the shader variant, bindings, push
 * constants and grid. The registry checked every view (duet_op_check);
 * what is left here are the device's limits (grid, bindings, texel views).
 *
 * Index inputs (token ids, positions, sequence slots, rows) are checked on
 * the host when their buffer is mapped and no dispatch of this step writes
 * it (the usual case: the caller uploaded them before begin); otherwise the
 * shaders check them and wait() reports a violation. Either way nothing is
 * read or written out of bounds.
 *
 * Ranges larger than the device's limits are split: matmul by rows (weights
 * larger than a texel view) and tokens (outputs larger than a storage
 * binding), embed by table rows, rope_kv by block windows of the pools.
 *
 * rope_kv and attention live in vk_attention.c. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend_checks.h"
#include "vk_internal.h"

/* Whole rows of `row` bytes a view holds from its offset to its buffer's end. */
static uint64_t rows_in(duet_view v, uint64_t row) {
    return v.offset <= v.buf->head.size ? (v.buf->head.size - v.offset) / row : 0;
}

/* The i32 index data of a view, readable now: mapped, and not written by a
 * dispatch of this step (else its final values are not known yet). */
static const int32_t *host_indices(const vk_backend *be, duet_view v) {
    if (!v.buf->map || be->n_written > VK_MAX_WRITTEN) return NULL;
    for (int i = 0; i < be->n_written; i++)
        if (be->written[i] == v.buf->id) return NULL;
    return (const int32_t *)((const char *)v.buf->map + v.offset);
}

/* ---- bindings ---------------------------------------------------------------------------- */

/* A read of [v.offset, v.offset + bytes) through the texel view holding it;
 * *rel is the byte offset from that view's start. */
static duet_status tex_bind(vk_backend *be, const char *op, const char *name, duet_buffer *b, size_t off,
                            uint64_t bytes, vk_binding *bind, uint32_t *rel) {
    int k = b->n_views == 1 ? 0 : (int)(off / b->view_stride);
    if (k >= b->n_views) k = b->n_views - 1;
    size_t start = (size_t)k * b->view_stride;
    if (off + bytes > start + b->view_span[k])
        return duet__error(
            DUET_UNSUPPORTED, "%s: %s spans %llu bytes; one texel view on %s holds at most %llu", op, name,
            (unsigned long long)bytes, be->base.info.name, (unsigned long long)be->max_texel_bytes / 2);
    *bind = (vk_binding){.buf = b, .view = k};
    *rel = (uint32_t)(off - start);
    return DUET_OK;
}

/* A write (or read-write) of [off, off + bytes) through a storage binding
 * that starts at an aligned offset; *rel is off's byte offset inside it. */
static duet_status ssbo_bind(vk_backend *be, const char *op, const char *name, duet_buffer *b, size_t off,
                             uint64_t bytes, vk_binding *bind, uint32_t *rel) {
    /* At least 16-byte aligned: shaders address words (and q8_0 blocks by
     * their word phase) from the binding's start. */
    const size_t align = be->ssbo_align < 16 ? 16 : (size_t)be->ssbo_align;
    size_t start = off & ~(align - 1);
    uint64_t range = ((off - start) + bytes + 3) & ~(uint64_t)3;
    size_t padded = (b->head.size + 15) & ~(size_t)15;
    if (start + range > padded) range = padded - start;
    if (range > be->max_ssbo_range)
        return duet__error(
            DUET_UNSUPPORTED, "%s: %s writes %llu bytes; one storage binding on %s holds at most %llu", op,
            name, (unsigned long long)bytes, be->base.info.name, (unsigned long long)be->max_ssbo_range);
    *bind = (vk_binding){.buf = b, .offset = start, .range = range};
    *rel = (uint32_t)(off - start);
    return DUET_OK;
}

/* What a one-dispatch op reads and writes, for its barriers: the ranges
 * of its operands, the list the registry checked (duet_op_operands). Ops
 * split over several dispatches (matmul, rope_kv, attention) list the
 * part of each operand a dispatch touches instead, so that their splits
 * need no barriers between them, plus their own scratch. */
static void operand_ranges(const duet_op *op, vk_dispatch *d) {
    duet_operand o[DUET_MAX_OPERANDS];
    const int n = duet_op_operands(op, o);
    d->n_reads = d->n_writes = 0;
    for (int i = 0; i < n; i++) {
        if (!o[i].view.buf) continue;
        const vk_range r = vk_rng(o[i].view.buf, o[i].view.offset, o[i].bytes);
        if (o[i].access & DUET_READ) d->reads[d->n_reads++] = r;
        if (o[i].access & DUET_WRITE) d->writes[d->n_writes++] = r;
    }
}

static vk_binding status_bind(vk_backend *be) {
    return (vk_binding){.buf = be->status, .offset = 0, .range = 16};
}

/* ---- exported for vk_attention.c ------------------------------------------------------- */

const int32_t *duet__vk_host_indices(const vk_backend *be, duet_view v) {
    return host_indices(be, v);
}
duet_status duet__vk_tex_bind(vk_backend *be, const char *op, const char *name, duet_buffer *b, size_t off,
                              uint64_t bytes, vk_binding *bind, uint32_t *rel) {
    return tex_bind(be, op, name, b, off, bytes, bind, rel);
}
duet_status duet__vk_ssbo_bind(vk_backend *be, const char *op, const char *name, duet_buffer *b, size_t off,
                               uint64_t bytes, vk_binding *bind, uint32_t *rel) {
    return ssbo_bind(be, op, name, b, off, bytes, bind, rel);
}
vk_binding duet__vk_unused_ssbo(vk_backend *be) {
    return status_bind(be);
}

static duet_status pipe(vk_backend *be, vk_shader s, int n_tex, int n_ssbo, int n_spec, const uint32_t *spec,
                        vk_dispatch *d) {
    return duet__vk_pipeline_get(be, s, n_tex, n_ssbo, n_spec, spec, &d->pipe);
}

/* ---- embed --------------------------------------------------------------------------------- */

static duet_status rec_embed(vk_backend *be, const duet_op *op) {
    const char *name = "embed";
    const duet_dtype dt = op->embed.dtype;
    const int dim = op->embed.dim;
    const uint64_t nt = (uint64_t)op->n_tokens;
    uint64_t row = duet_dtype_row_bytes(dt, dim);
    uint64_t n_rows = rows_in(op->embed.table, row);
    const int32_t *tok = host_indices(be, op->embed.tokens);
    for (int t = 0; tok && t < op->n_tokens; t++)
        REQUIRE(tok[t] >= 0 && (uint64_t)tok[t] < n_rows, "embed: token %d is %d, outside the %llu-row table",
                t, tok[t], (unsigned long long)n_rows);
    REQUIRE(n_rows <= INT32_MAX, "embed: table of %llu rows", (unsigned long long)n_rows);

    const uint32_t wg = (uint32_t)be->tune.ew_wg;
    const uint32_t spec[2] = {wg, (uint32_t)dt};
    vk_dispatch d = {.kind = DUET_OP_EMBED};
    operand_ranges(op, &d);
    CHECK(pipe(be, VK_SHADER_EMBED, 2, 2, 2, spec, &d));
    struct {
        uint32_t tok_off, table_off, out_off, dim, row_bytes;
        int32_t row_lo, n_rows, n_total;
    } pc = {.dim = (uint32_t)dim, .row_bytes = (uint32_t)row, .n_total = (int32_t)n_rows};
    uint32_t rel;
    CHECK(tex_bind(be, name, "tokens", op->embed.tokens.buf, op->embed.tokens.offset, nt * 4, &d.bind[0],
                   &pc.tok_off));
    CHECK(ssbo_bind(be, name, "out", op->embed.out.buf, op->embed.out.offset, nt * (uint64_t)dim * 4,
                    &d.bind[2], &rel));
    pc.out_off = rel / 4;
    d.bind[3] = status_bind(be);
    d.groups[0] = div_up((uint64_t)dim, 4u * wg);
    d.groups[1] = (uint32_t)nt;
    d.groups[2] = 1;
    d.push = &pc;
    d.push_size = sizeof pc;
    /* One dispatch per texel view the table's rows fall into. */
    duet_buffer *tb = op->embed.table.buf;
    for (uint64_t lo = 0; lo < n_rows;) {
        size_t byte = op->embed.table.offset + (size_t)(lo * row);
        int k = tb->n_views == 1 ? 0 : (int)(byte / tb->view_stride);
        if (k >= tb->n_views) k = tb->n_views - 1;
        uint64_t fit = ((size_t)k * tb->view_stride + tb->view_span[k] - byte) / row;
        if (fit == 0)
            return duet__error(DUET_UNSUPPORTED, "embed: a %llu-byte row does not fit a texel view",
                               (unsigned long long)row);
        uint64_t n = n_rows - lo < fit ? n_rows - lo : fit;
        CHECK(tex_bind(be, name, "table", tb, byte, n * row, &d.bind[1], &pc.table_off));
        pc.row_lo = (int32_t)lo;
        pc.n_rows = (int32_t)n;
        CHECK(duet__vk_dispatch(be, &d));
        lo += n;
    }
    return DUET_OK;
}

/* ---- rmsnorm ------------------------------------------------------------------------------- */

static duet_status rec_rmsnorm(vk_backend *be, const duet_op *op) {
    const char *name = "rmsnorm";
    const int dim = op->rmsnorm.dim;
    const uint64_t nt = (uint64_t)op->n_tokens;
    const duet_view x = op->rmsnorm.x, w = op->rmsnorm.w, out = op->rmsnorm.out, oq = op->rmsnorm.out_q8;
    const bool has_out = out.buf != NULL, has_q8 = oq.buf != NULL;
    uint64_t bytes = mul3(nt, (uint64_t)dim, 4);
    uint64_t qbytes = has_q8 ? mul3(nt, (uint64_t)dim / 32, 34) : 0;
    REQUIRE(nt <= be->max_groups[1], "rmsnorm: %d tokens exceed the grid limit", op->n_tokens);

    vk_dispatch d = {.kind = DUET_OP_RMSNORM};
    operand_ranges(op, &d);
    struct {
        uint32_t x_off, w_off, out_off, dim;
        float eps;
        uint32_t oq_off;
    } pc = {.dim = (uint32_t)dim, .eps = op->rmsnorm.eps};
    uint32_t rel;
    CHECK(tex_bind(be, name, "x", x.buf, x.offset, bytes, &d.bind[0], &pc.x_off));
    CHECK(tex_bind(be, name, "w", w.buf, w.offset, (uint64_t)dim * 4, &d.bind[1], &pc.w_off));
    d.bind[2] = d.bind[3] = status_bind(be);
    if (has_out) {
        CHECK(ssbo_bind(be, name, "out", out.buf, out.offset, bytes, &d.bind[2], &rel));
        pc.out_off = rel / 4;
    }
    if (has_q8) CHECK(ssbo_bind(be, name, "out_q8", oq.buf, oq.offset, qbytes, &d.bind[3], &pc.oq_off));
    const uint32_t spec[4] = {(uint32_t)be->tune.norm_wg,
                              pc.x_off % 16 == 0 && pc.w_off % 16 == 0 && dim % 4 == 0, has_out, has_q8};
    CHECK(pipe(be, VK_SHADER_RMSNORM, 2, 2, 4, spec, &d));
    d.groups[0] = 1;
    d.groups[1] = (uint32_t)nt;
    d.groups[2] = 1;
    d.push = &pc;
    d.push_size = sizeof pc;
    return duet__vk_dispatch(be, &d);
}

/* ---- matmul -------------------------------------------------------------------------------- */

/* Quantizes x [n_tok][n_in] into be->xq as q8_0 block rows (the layout of
 * an op's out_q8) unless it already holds exactly this range, unchanged
 * since. */
static duet_status quantize_x(vk_backend *be, duet_view x, int n_tok, int n_in) {
    const uint64_t nb = (uint64_t)n_in / 32;
    const uint64_t xbytes = (uint64_t)n_tok * (uint64_t)n_in * 4, qbytes = (uint64_t)n_tok * nb * 34;
    if (be->xq_src_id == x.buf->id && be->xq_src_off == x.offset && be->xq_src_bytes == xbytes &&
        be->xq_tokens == n_tok && be->xq_n_in == n_in)
        return DUET_OK;
    CHECK(duet__vk_scratch_reserve(be, &be->xq, qbytes));
    const uint32_t wg = (uint32_t)be->tune.ew_wg;
    vk_dispatch d = {.kind = DUET_OP_MATMUL, .n_reads = 1, .n_writes = 1};
    struct {
        uint32_t x_off, nb;
    } pc = {.nb = (uint32_t)nb};
    uint32_t rel;
    CHECK(tex_bind(be, "matmul", "x", x.buf, x.offset, xbytes, &d.bind[0], &pc.x_off));
    CHECK(ssbo_bind(be, "matmul", "quantized x", be->xq, 0, qbytes, &d.bind[1], &rel));
    const uint32_t spec[2] = {wg, pc.x_off % 16 == 0};
    CHECK(pipe(be, VK_SHADER_QUANTIZE_Q8, 1, 1, 2, spec, &d));
    d.reads[0] = vk_rng(x.buf, x.offset, xbytes);
    d.writes[0] = vk_rng(be->xq, 0, qbytes);
    d.groups[0] = div_up(nb, wg);
    d.groups[1] = (uint32_t)n_tok;
    d.groups[2] = 1;
    d.push = &pc;
    d.push_size = sizeof pc;
    CHECK(duet__vk_dispatch(be, &d));
    be->xq_src_id = x.buf->id;
    be->xq_src_off = x.offset;
    be->xq_src_bytes = xbytes;
    be->xq_tokens = n_tok;
    be->xq_n_in = n_in;
    return DUET_OK;
}

/* Push constants of the three matmul shaders (see their sources). */
typedef struct mm_tile_push {
    uint32_t w_off, row_bytes, x_off, n_in, bias_off, out_off, out_stride, n_rows, n_tok;
} mm_tile_push;
typedef struct mm_tile_q8_push {
    uint32_t w_off, row_bytes, q_off, nb, bias_off, out_off, out_stride, n_rows, n_tok;
} mm_tile_q8_push;
typedef mm_tile_push mm_sg_push;

static vk_shader matmul_shader(duet_dtype dt, bool tile, bool dot) {
    switch (dt) {
    case DUET_DTYPE_F32:
        return tile ? VK_SHADER_MATMUL_TILE_F32 : VK_SHADER_MATMUL_SG_F32;
    case DUET_DTYPE_F16:
        return tile ? VK_SHADER_MATMUL_TILE_F16 : VK_SHADER_MATMUL_SG_F16;
    case DUET_DTYPE_BF16:
        return tile ? VK_SHADER_MATMUL_TILE_BF16 : VK_SHADER_MATMUL_SG_BF16;
    case DUET_DTYPE_Q8_0:
        if (tile) return dot ? VK_SHADER_MATMUL_TILE_Q8_0_DOT : VK_SHADER_MATMUL_TILE_Q8_0;
        return dot ? VK_SHADER_MATMUL_SG_Q8_0_DOT : VK_SHADER_MATMUL_SG_Q8_0;
    default: /* the block types */
        if (tile) return dot ? VK_SHADER_MATMUL_TILE_BLK_DOT : VK_SHADER_MATMUL_TILE_BLK;
        return dot ? VK_SHADER_MATMUL_SG_BLK_DOT : VK_SHADER_MATMUL_SG_BLK;
    }
}

static duet_status rec_matmul(vk_backend *be, const duet_op *op) {
    const char *name = "matmul";
    const duet_dtype dt = op->matmul.dtype;
    const int n_in = op->matmul.n_in, n_out = op->matmul.n_out, n = op->n_tokens;
    const uint64_t nt = (uint64_t)n;
    const duet_view w = op->matmul.w, x = op->matmul.x, xq8 = op->matmul.x_q8, bias = op->matmul.bias,
                    out = op->matmul.out;
    /* q8: Q8_0 weights; blk: a type of shaders/blocks.glsl (one module per
     * path serves them all, the type a specialization constant); either reads
     * q8_0 activations (qa). */
    const bool q8 = dt == DUET_DTYPE_Q8_0, blk = duet_dtype_is_packed_quant(dt), qa = q8 || blk,
               xb = xq8.buf != NULL;
    const uint64_t rb = duet_dtype_row_bytes(dt, n_in);
    const uint64_t nb = qa ? (uint64_t)n_in / 32 : 0;

    /* The tile path wants texel-aligned rows (and q8_0 activation rows, which
     * are laid out like weight rows); anything else takes the subgroup path,
     * which reads at any alignment. The block types' tile shader reads
     * blocks at any even byte. */
    bool tile = be->tune.matmul == VK_MATMUL_TILE &&
                (blk || (rb % 16 == 0 && w.offset % 16 == 0 &&
                         (q8 ? nb % 8 == 0 && (!xb || xq8.offset % 16 == 0)
                             : (x.offset % 16 == 0 && ((uint64_t)n_in * 4) % 16 == 0))));
    /* f32 activations of a q8_0 or block-type matmul are quantized first,
     * by the rule of duet_quantize_row_q8_0 (as the cpu backend does); q8_0
     * activations are read as they are. Either way the shaders read q8_0
     * block rows (xa). */
    duet_view xa = xq8;
    if (qa && !xb) {
        CHECK(quantize_x(be, x, n, n_in));
        xa = (duet_view){be->xq, 0};
    }

    const bool dot = qa && be->tune.int_dot;
    /* GPU prefill of Q8_0 and the block types: the tiled GEMM (BM rows x BN
     * tokens a group). */
    const bool mm = qa && !tile && be->tune.mm_min > 0 && n >= be->tune.mm_min;
    if (!tile && !mm && !be->phys->subgroup_arith)
        return duet__error(DUET_UNSUPPORTED,
                           "matmul: %s rows of %d that are not 16-byte aligned need subgroup "
                           "arithmetic, which %s lacks",
                           duet_dtype_name(dt), n_in, be->base.info.name);
    const uint32_t BM = (uint32_t)be->tune.mm_bm, BN = (uint32_t)be->tune.mm_bn;
    const uint32_t WG = mm ? (BM / 4) * (BN / 4) : (uint32_t)(tile ? be->tune.tile_wg : be->tune.sg_wg);
    const uint32_t R = mm ? BM
                          : (uint32_t)(!tile          ? be->tune.sg_rows
                                       : qa && n == 1 ? be->tune.tile_rows_q8
                                                      : be->tune.tile_rows);
    const uint32_t T = mm ? BN : tile && n > 1 ? (uint32_t)be->tune.tile_tokens : 1;
    const bool has_bias = bias.buf != NULL, acc = op->matmul.accumulate;
    const bool sg_aligned =
        !qa && rb % 16 == 0 && w.offset % 16 == 0 && x.offset % 16 == 0 && ((uint64_t)n_in * 4) % 16 == 0;
    const bool sg_grouped = q8 && nb % 8 == 0 && rb % 16 == 0 && w.offset % 16 == 0 && xa.offset % 16 == 0;
    vk_dispatch d = {.kind = DUET_OP_MATMUL};
    if (mm) {
        if (WG > be->phys->props.limits.maxComputeWorkGroupInvocations)
            return duet__error(DUET_UNSUPPORTED, "matmul: a %u x %u tile needs %u invocations", BM, BN, WG);
        const uint32_t mspec[9] = {WG, BM, BN, 4, 4, 2, has_bias, acc, (uint32_t)dt};
        vk_shader s = blk ? (dot ? VK_SHADER_MATMUL_MM_BLK_DOT : VK_SHADER_MATMUL_MM_BLK)
                          : (dot ? VK_SHADER_MATMUL_MM_Q8_0_DOT : VK_SHADER_MATMUL_MM_Q8_0);
        CHECK(pipe(be, s, 3, 1, blk ? 9 : 8, mspec, &d));
    } else if (blk && tile) {
        const uint32_t spec[7] = {WG, R, T, has_bias, acc, (uint32_t)dt, rb % 16 == 0 && w.offset % 16 == 0};
        CHECK(pipe(be, matmul_shader(dt, true, dot), 3, 1, 7, spec, &d));
    } else if (blk) {
        const uint32_t spec[8] = {WG, R, WG, has_bias, acc, false, false, (uint32_t)dt};
        CHECK(pipe(be, matmul_shader(dt, false, dot), 3, 1, 8, spec, &d));
    } else {
        const uint32_t spec[7] = {WG, R, tile ? T : WG, has_bias, acc, sg_aligned, sg_grouped};
        CHECK(pipe(be, matmul_shader(dt, tile, dot), 3, 1, tile ? 5 : 7, spec, &d));
    }
    mm_sg_push sg;
    mm_tile_push tf;
    mm_tile_q8_push tq;

    /* Tokens per dispatch: the output rows must fit one storage binding. */
    uint64_t tok_chunk = be->max_ssbo_range / ((uint64_t)n_out * 4);
    if (tok_chunk == 0)
        return duet__error(DUET_UNSUPPORTED,
                           "matmul: an output row of %d floats exceeds a storage binding on %s", n_out,
                           be->base.info.name);
    if (tok_chunk > (uint64_t)be->max_groups[1] * T) tok_chunk = (uint64_t)be->max_groups[1] * T;
    /* Rows per dispatch: the grid limit; texel views bound them below. */
    uint64_t row_cap = (uint64_t)be->max_groups[0] * (tile ? WG * R : R); /* mm: R = BM */
    for (uint64_t t0 = 0; t0 < nt; t0 += tok_chunk) {
        const uint64_t tc = nt - t0 < tok_chunk ? nt - t0 : tok_chunk;
        for (uint64_t r0 = 0; r0 < (uint64_t)n_out;) {
            size_t wbyte = w.offset + (size_t)(r0 * rb);
            int k = w.buf->n_views == 1 ? 0 : (int)(wbyte / w.buf->view_stride);
            if (k >= w.buf->n_views) k = w.buf->n_views - 1;
            uint64_t fit = ((size_t)k * w.buf->view_stride + w.buf->view_span[k] - wbyte) / rb;
            if (fit == 0)
                return duet__error(DUET_UNSUPPORTED, "matmul: a %llu-byte row does not fit a texel view",
                                   (unsigned long long)rb);
            uint64_t rc = (uint64_t)n_out - r0;
            if (rc > fit) rc = fit;
            if (rc > row_cap) rc = row_cap;

            uint32_t w_rel, x_rel, b_rel = 0, o_rel;
            CHECK(tex_bind(be, name, "w", w.buf, wbyte, rc * rb, &d.bind[0], &w_rel));
            const uint64_t orange = ((tc - 1) * (uint64_t)n_out + rc) * 4;
            const size_t obyte = out.offset + (size_t)((t0 * (uint64_t)n_out + r0) * 4);
            CHECK(ssbo_bind(be, name, "out", out.buf, obyte, orange, &d.bind[3], &o_rel));
            if (bias.buf)
                CHECK(tex_bind(be, name, "bias", bias.buf, bias.offset + r0 * 4, rc * 4, &d.bind[2], &b_rel));
            else
                d.bind[2] = d.bind[0]; /* unread: any valid view */
            d.n_reads = d.n_writes = 0;
            d.reads[d.n_reads++] = vk_rng(w.buf, wbyte, rc * rb);
            if (bias.buf) d.reads[d.n_reads++] = vk_rng(bias.buf, bias.offset + r0 * 4, rc * 4);
            if (op->matmul.accumulate) d.reads[d.n_reads++] = vk_rng(out.buf, obyte, orange);
            d.writes[d.n_writes++] = vk_rng(out.buf, obyte, orange);
            if (qa) {
                const size_t xo = xa.offset + (size_t)(t0 * nb * 34);
                CHECK(tex_bind(be, name, xb ? "x_q8" : "quantized x", xa.buf, xo, tc * nb * 34, &d.bind[1],
                               &x_rel));
                d.reads[d.n_reads++] = vk_rng(xa.buf, xo, tc * nb * 34);
            } else {
                CHECK(tex_bind(be, name, "x", x.buf, x.offset + t0 * (uint64_t)n_in * 4,
                               tc * (uint64_t)n_in * 4, &d.bind[1], &x_rel));
                d.reads[d.n_reads++] =
                    vk_rng(x.buf, x.offset + t0 * (uint64_t)n_in * 4, tc * (uint64_t)n_in * 4);
            }
            if ((tile || mm || blk) && qa) {
                /* The block types' three shaders, Q8_0's tile and GEMM:
                 * weight rows of rb bytes, activation rows of nb blocks. */
                tq = (mm_tile_q8_push){w_rel,     (uint32_t)rb,    x_rel,        (uint32_t)nb, b_rel,
                                       o_rel / 4, (uint32_t)n_out, (uint32_t)rc, (uint32_t)tc};
                d.push = &tq;
                d.push_size = sizeof tq;
            } else if (tile) {
                tf = (mm_tile_push){w_rel,     (uint32_t)rb,    x_rel,        (uint32_t)n_in, b_rel,
                                    o_rel / 4, (uint32_t)n_out, (uint32_t)rc, (uint32_t)tc};
                d.push = &tf;
                d.push_size = sizeof tf;
            } else {
                sg = (mm_sg_push){
                    w_rel,       (uint32_t)rb, x_rel,           q8 ? (uint32_t)nb : (uint32_t)n_in,
                    b_rel,       o_rel / 4,    (uint32_t)n_out, (uint32_t)rc,
                    (uint32_t)tc};
                d.push = &sg;
                d.push_size = sizeof sg;
            }
            d.groups[0] = tile ? div_up(rc, (uint64_t)WG * R) : div_up(rc, R);
            d.groups[1] = tile || mm ? div_up(tc, T) : (uint32_t)tc;
            d.groups[2] = 1;
            CHECK(duet__vk_dispatch(be, &d));
            r0 += rc;
        }
    }
    return DUET_OK;
}

/* ---- swiglu, add ------------------------------------------------------------------------------ */

static duet_status rec_binary(vk_backend *be, const duet_op *op) {
    const bool swiglu = op->kind == DUET_OP_SWIGLU;
    const char *name = duet_op_name(op->kind);
    const int dim = swiglu ? op->swiglu.dim : op->add.dim;
    const duet_view a = swiglu ? op->swiglu.gate : op->add.a, b = swiglu ? op->swiglu.up : op->add.b,
                    out = swiglu ? op->swiglu.out : op->add.out,
                    oq = swiglu ? op->swiglu.out_q8 : (duet_view){0};
    const bool has_out = out.buf != NULL, has_q8 = oq.buf != NULL;
    const uint64_t nt = (uint64_t)op->n_tokens;
    uint64_t bytes = mul3(nt, (uint64_t)dim, 4);
    uint64_t qbytes = has_q8 ? mul3(nt, (uint64_t)dim / 32, 34) : 0;
    REQUIRE(nt <= be->max_groups[1], "%s: %d tokens exceed the grid limit", name, op->n_tokens);

    const uint32_t wg = (uint32_t)be->tune.ew_wg;
    vk_dispatch d = {.kind = op->kind};
    operand_ranges(op, &d);
    struct {
        uint32_t a_off, b_off, out_off, dim, oq_off;
    } pc = {.dim = (uint32_t)dim};
    uint32_t rel;
    CHECK(tex_bind(be, name, "a", a.buf, a.offset, bytes, &d.bind[0], &pc.a_off));
    CHECK(tex_bind(be, name, "b", b.buf, b.offset, bytes, &d.bind[1], &pc.b_off));
    d.bind[2] = d.bind[3] = status_bind(be);
    if (has_out) {
        CHECK(ssbo_bind(be, name, "out", out.buf, out.offset, bytes, &d.bind[2], &rel));
        pc.out_off = rel / 4;
    }
    if (has_q8) CHECK(ssbo_bind(be, name, "out_q8", oq.buf, oq.offset, qbytes, &d.bind[3], &pc.oq_off));
    const uint32_t spec[4] = {wg, pc.a_off % 16 == 0 && pc.b_off % 16 == 0 && dim % 4 == 0, has_out, has_q8};
    CHECK(pipe(be, swiglu ? VK_SHADER_SWIGLU : VK_SHADER_ADD, 2, 2, 4, spec, &d));
    d.groups[0] = has_q8 ? div_up((uint64_t)dim / 32, wg) : div_up((uint64_t)dim, 4u * wg);
    d.groups[1] = (uint32_t)nt;
    d.groups[2] = 1;
    d.push = &pc;
    d.push_size = sizeof pc;
    return duet__vk_dispatch(be, &d);
}

/* ---- gather_rows -------------------------------------------------------------------------------- */

static duet_status rec_gather(vk_backend *be, const duet_op *op) {
    const char *name = "gather_rows";
    const int dim = op->gather.dim;
    const uint64_t nt = (uint64_t)op->n_tokens;
    uint64_t row = (uint64_t)dim * 4, obytes = mul2(nt, row);
    const duet_view x = op->gather.x, rows = op->gather.rows, out = op->gather.out;
    uint64_t n_rows = rows_in(x, row);
    const int32_t *hr = host_indices(be, rows);
    for (int t = 0; hr && t < op->n_tokens; t++)
        REQUIRE(hr[t] >= 0 && (uint64_t)hr[t] < n_rows,
                "gather_rows: row %d is %d, outside the %llu rows of x", t, hr[t],
                (unsigned long long)n_rows);
    REQUIRE(nt <= be->max_groups[1], "gather_rows: %d rows exceed the grid limit", op->n_tokens);
    if (n_rows > UINT32_MAX) n_rows = UINT32_MAX;

    const uint32_t wg = (uint32_t)be->tune.ew_wg;
    vk_dispatch d = {.kind = DUET_OP_GATHER_ROWS};
    operand_ranges(op, &d);
    CHECK(pipe(be, VK_SHADER_GATHER_ROWS, 2, 2, 1, &wg, &d));
    struct {
        uint32_t x_off, rows_off, out_off, dim, n_rows;
    } pc = {.dim = (uint32_t)dim, .n_rows = (uint32_t)n_rows};
    uint32_t rel;
    CHECK(tex_bind(be, name, "x", x.buf, x.offset, n_rows * row, &d.bind[0], &pc.x_off));
    CHECK(tex_bind(be, name, "rows", rows.buf, rows.offset, nt * 4, &d.bind[1], &pc.rows_off));
    CHECK(ssbo_bind(be, name, "out", out.buf, out.offset, obytes, &d.bind[2], &rel));
    pc.out_off = rel / 4;
    d.bind[3] = status_bind(be);
    d.groups[0] = div_up((uint64_t)dim, 4u * wg);
    d.groups[1] = (uint32_t)nt;
    d.groups[2] = 1;
    d.push = &pc;
    d.push_size = sizeof pc;
    return duet__vk_dispatch(be, &d);
}

/* ---- argmax ---------------------------------------------------------------------------------------- */

static duet_status rec_argmax(vk_backend *be, const duet_op *op) {
    const char *name = "argmax";
    const int dim = op->argmax.dim;
    const uint64_t nt = (uint64_t)op->n_tokens;
    uint64_t xbytes = mul3(nt, (uint64_t)dim, 4);
    REQUIRE(nt <= be->max_groups[1], "argmax: %d rows exceed the grid limit", op->n_tokens);

    const uint32_t wg = (uint32_t)be->tune.norm_wg;
    vk_dispatch d = {.kind = DUET_OP_ARGMAX};
    operand_ranges(op, &d);
    CHECK(pipe(be, VK_SHADER_ARGMAX, 1, 1, 1, &wg, &d));
    struct {
        uint32_t x_off, out_off, dim;
    } pc = {.dim = (uint32_t)dim};
    uint32_t rel;
    CHECK(tex_bind(be, name, "x", op->argmax.x.buf, op->argmax.x.offset, xbytes, &d.bind[0], &pc.x_off));
    CHECK(ssbo_bind(be, name, "out", op->argmax.out.buf, op->argmax.out.offset, nt * 4, &d.bind[1], &rel));
    pc.out_off = rel / 4;
    d.groups[0] = 1;
    d.groups[1] = (uint32_t)nt;
    d.groups[2] = 1;
    d.push = &pc;
    d.push_size = sizeof pc;
    return duet__vk_dispatch(be, &d);
}

/* ---- the interface ----------------------------------------------------------------------------------- */

/* The weight types the shaders read (matmul and embedding). */
static bool vk_weight_ok(duet_dtype t) {
    return t == DUET_DTYPE_F32 || t == DUET_DTYPE_F16 || t == DUET_DTYPE_BF16 || t == DUET_DTYPE_Q8_0 ||
           duet_dtype_is_packed_quant(t);
}

bool duet__vk_supports_op(int index, const duet_op *op) {
    (void)index;
    switch (op->kind) {
    case DUET_OP_EMBED:
        return vk_weight_ok(op->embed.dtype);
    case DUET_OP_MATMUL:
        return vk_weight_ok(op->matmul.dtype);
    case DUET_OP_ROPE_KV:
        return op->rope_kv.kv.dtype == DUET_DTYPE_F32 || op->rope_kv.kv.dtype == DUET_DTYPE_F16 ||
               op->rope_kv.kv.dtype == DUET_DTYPE_Q8_0;
    case DUET_OP_ATTENTION:
        return (op->attention.kv.dtype == DUET_DTYPE_F32 || op->attention.kv.dtype == DUET_DTYPE_F16 ||
                op->attention.kv.dtype == DUET_DTYPE_Q8_0) &&
               op->attention.head_dim <= VK_MAX_HEAD_DIM;
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

duet_status duet__vk_record_op(vk_backend *be, const duet_op *op) {
    switch (op->kind) {
    case DUET_OP_EMBED:
        return rec_embed(be, op);
    case DUET_OP_RMSNORM:
        return rec_rmsnorm(be, op);
    case DUET_OP_MATMUL:
        return rec_matmul(be, op);
    case DUET_OP_ROPE_KV:
        return duet__vk_rec_rope_kv(be, op);
    case DUET_OP_ATTENTION:
        return duet__vk_rec_attention(be, op);
    case DUET_OP_SWIGLU:
    case DUET_OP_ADD:
        return rec_binary(be, op);
    case DUET_OP_GATHER_ROWS:
        return rec_gather(be, op);
    case DUET_OP_ARGMAX:
        return rec_argmax(be, op);
    case DUET_OP_COUNT:
        break;
    }
    return duet__error(DUET_INVALID_ARGUMENT, "vulkan: unknown op kind %d", (int)op->kind);
}
