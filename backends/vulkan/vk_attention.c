/* vk_attention.c — rope_kv and attention over the paged KV cache.
 *
 * rope_kv (shaders/rope_kv.comp) rotates q and k and stores k and v into
 * the K and V pools through the block table, quantising q8_0 rows per 32
 * values in the shader.
 *
 * attention (shaders/attn_flash.comp, attn_reduce.comp) is FlashAttention:
 * a workgroup owns a tile of query rows and walks the keys in tiles held in
 * shared memory with an online softmax, so the score matrix never exists.
 * (CPU devices run attn_lane.comp instead, the same algorithm with one lane
 * per query row and no shared memory: see vk_tuning.c.) The flash shader
 * runs two shapes, chosen per op:
 *   - prefill (tokens of a sequence come in runs): rows are tokens (x the
 *     GQA heads of a KV head), few lanes per row;
 *   - decode (about one token per sequence): rows are the GQA heads of one
 *     token, a subgroup of lanes per row.
 * When the rows alone give too few workgroups to fill the device, the keys
 * are split too (flash-decoding): each split writes (acc, m, l) partials to
 * a scratch buffer, and attn_reduce combines them; it also writes the q8_0
 * output (out_q8) when one is asked for. The partials are
 * n_tokens x n_head x n_splits x (head_dim + 2) floats: linear in the
 * context, counted by scratch_bytes.
 *
 * Index inputs (positions, sequence slots, block table entries) are checked
 * on the host when it can read them at record time, the same way the cpu
 * backend checks them; otherwise the shaders clamp block indices into the
 * pools, leave the outputs of bad tokens zero and report them at wait(). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend_checks.h"
#include "vk_internal.h"

static uint32_t pow2_ceil(uint32_t v) {
    uint32_t p = 1;
    while (p < v)
        p <<= 1;
    return p;
}

/* The shaders' names for KV element types (kv.glsl). */
static uint32_t kv_code(duet_dtype t) {
    return t == DUET_DTYPE_Q8_0 ? 8u : t == DUET_DTYPE_F16 ? 1u : 0u;
}

/* A pool's row and pool bytes, within what the shaders address (the
 * registry checked the views: duet_op_check); *rb = bytes of a row. */
static duet_status kv_check(const char *op, const duet_kv_pages *kv, int n_head_kv, int head_dim,
                            uint64_t *rb, uint64_t *pool_bytes) {
    const uint64_t kvw = (uint64_t)n_head_kv * (uint64_t)head_dim;
    *rb = duet_dtype_row_bytes(kv->dtype, (int64_t)kvw);
    *pool_bytes = duet_kv_pool_bytes(kv, (int)kvw);
    /* Shaders address pool bytes with 32-bit offsets. */
    REQUIRE(*pool_bytes < ((uint64_t)1 << 31), "%s: a pool of %llu bytes (at most 2 GiB)", op,
            (unsigned long long)*pool_bytes);
    return DUET_OK;
}

/* What the host knows about the tokens at record time. */
typedef struct tok_info {
    bool known;       /* pos and seq readable now (then checked) */
    uint64_t max_ctx; /* largest pos + 1 */
    uint64_t runs;    /* runs of consecutive tokens of one sequence */
} tok_info;

/* Checks pos and seq (and the block table entries they use: the one at pos
 * for rope_kv, those of 0..pos for attention) when the host can read them,
 * with the cpu backend's rules. */
static duet_status host_tokens(const vk_backend *be, const char *op, duet_view pos_v, duet_view seq_v, int n,
                               const duet_kv_pages *kv, bool whole_ctx, tok_info *ti) {
    *ti = (tok_info){0};
    const int32_t *pos = duet__vk_host_indices(be, pos_v), *seq = duet__vk_host_indices(be, seq_v);
    if (!pos || !seq) return DUET_OK;
    const int32_t *tab = duet__vk_host_indices(be, kv->block_table);
    const int64_t cap = (int64_t)kv->max_blocks * kv->block_size;
    ti->known = true;
    int64_t run_max = -1;
    for (int t = 0; t < n; t++) {
        REQUIRE(pos[t] >= 0 && pos[t] < cap,
                "%s: token %d has position %d outside [0, %lld) (%d blocks of %d)", op, t, pos[t],
                (long long)cap, kv->max_blocks, kv->block_size);
        REQUIRE(seq[t] >= 0 && seq[t] < kv->n_seqs, "%s: token %d has sequence slot %d outside [0, %d)", op,
                t, seq[t], kv->n_seqs);
        if ((uint64_t)pos[t] + 1 > ti->max_ctx) ti->max_ctx = (uint64_t)pos[t] + 1;
        if (t == 0 || seq[t] != seq[t - 1]) ti->runs++;
        if (!tab) continue;
        const int32_t *row = tab + (size_t)seq[t] * (size_t)kv->max_blocks;
        if (!whole_ctx) {
            int32_t e = row[pos[t] / kv->block_size];
            REQUIRE(e >= 0 && e < kv->n_blocks,
                    "%s: token %d: block table entry %d of sequence %d is %d, outside [0, %d)", op, t,
                    pos[t] / kv->block_size, seq[t], e, kv->n_blocks);
            continue;
        }
        /* Attention reads blocks 0..pos/bs: checked once per run. */
        if (pos[t] > run_max) run_max = pos[t];
        if (t + 1 < n && seq[t + 1] == seq[t]) continue;
        for (int b = 0; b <= run_max / kv->block_size; b++)
            REQUIRE(row[b] >= 0 && row[b] < kv->n_blocks,
                    "%s: token %d: block table entry %d of sequence %d is %d, outside [0, %d)", op, t, b,
                    seq[t], row[b], kv->n_blocks);
        run_max = -1;
    }
    return DUET_OK;
}

/* ---- rope_kv ---------------------------------------------------------------------------- */

duet_status duet__vk_rec_rope_kv(vk_backend *be, const duet_op *op) {
    const char *name = "rope_kv";
    const int nh = op->rope_kv.n_head, nkv = op->rope_kv.n_head_kv, hd = op->rope_kv.head_dim,
              n_rot = op->rope_kv.n_rot;
    const duet_kv_pages *kv = &op->rope_kv.kv;
    const uint64_t nt = (uint64_t)op->n_tokens;
    /* The shader maps query heads onto kv heads in groups. */
    REQUIRE(nh % nkv == 0, "rope_kv: n_head %d is not a multiple of n_head_kv %d", nh, nkv);
    uint64_t rb, pool_bytes;
    CHECK(kv_check(name, kv, nkv, hd, &rb, &pool_bytes));
    const uint64_t kvw = (uint64_t)nkv * (uint64_t)hd;
    const uint64_t qbytes = mul2(mul2(nt, (uint64_t)nh * (uint64_t)hd), 4), kbytes = mul2(mul2(nt, kvw), 4);
    const duet_view q = op->rope_kv.q, k = op->rope_kv.k, v = op->rope_kv.v, pos = op->rope_kv.pos,
                    seq = op->rope_kv.seq;
    REQUIRE(nt <= be->max_groups[1], "rope_kv: %d tokens exceed the grid limit", op->n_tokens);
    tok_info ti;
    CHECK(host_tokens(be, name, pos, seq, op->n_tokens, kv, false, &ti));
    const int64_t cap = (int64_t)kv->max_blocks * kv->block_size;
    const uint64_t fr_bytes = (uint64_t)(n_rot / 2) * 4;

    const uint32_t spec[3] = {(uint32_t)be->tune.ew_wg, kv_code(kv->dtype), op->rope_kv.neox};
    vk_dispatch d = {.kind = DUET_OP_ROPE_KV};
    CHECK(duet__vk_pipeline_get(be, VK_SHADER_ROPE_KV, 5, 5, 3, spec, &d.pipe));
    struct {
        uint32_t q_off, k_off, v_off, pos_off, seq_off, fr_off, bt_off, kp_off, vp_off;
        uint32_t n_head, n_head_kv, hd, n_rot, n_pos, block_size, n_blocks, max_blocks, n_seqs, blk_lo,
            blk_hi, rotate;
        float mscale;
    } pc = {.n_head = (uint32_t)nh,
            .n_head_kv = (uint32_t)nkv,
            .hd = (uint32_t)hd,
            .n_rot = (uint32_t)n_rot,
            .n_pos = (uint32_t)(cap > UINT32_MAX ? UINT32_MAX : cap),
            .mscale = op->rope_kv.mscale == 0.0f ? 1.0f : op->rope_kv.mscale,
            .block_size = (uint32_t)kv->block_size,
            .n_blocks = (uint32_t)kv->n_blocks,
            .max_blocks = (uint32_t)kv->max_blocks,
            .n_seqs = (uint32_t)kv->n_seqs};
    const uint64_t bt_bytes = (uint64_t)kv->n_seqs * (uint64_t)kv->max_blocks * 4;
    uint32_t rel;
    CHECK(duet__vk_tex_bind(be, name, "pos", pos.buf, pos.offset, nt * 4, &d.bind[0], &pc.pos_off));
    CHECK(duet__vk_tex_bind(be, name, "seq", seq.buf, seq.offset, nt * 4, &d.bind[1], &pc.seq_off));
    CHECK(duet__vk_tex_bind(be, name, "v", v.buf, v.offset, kbytes, &d.bind[2], &pc.v_off));
    if (n_rot > 0)
        CHECK(duet__vk_tex_bind(be, name, "freqs", op->rope_kv.freqs.buf, op->rope_kv.freqs.offset, fr_bytes,
                                &d.bind[3], &pc.fr_off));
    else
        d.bind[3] = d.bind[0]; /* unread */
    CHECK(duet__vk_tex_bind(be, name, "block_table", kv->block_table.buf, kv->block_table.offset, bt_bytes,
                            &d.bind[4], &pc.bt_off));
    CHECK(duet__vk_ssbo_bind(be, name, "q", q.buf, q.offset, qbytes, &d.bind[5], &rel));
    pc.q_off = rel / 4;
    CHECK(duet__vk_ssbo_bind(be, name, "k", k.buf, k.offset, kbytes, &d.bind[6], &rel));
    pc.k_off = rel / 4;
    d.bind[9] = duet__vk_unused_ssbo(be); /* the status word */
    d.push = &pc;
    d.push_size = sizeof pc;
    d.groups[0] = 1;
    d.groups[1] = (uint32_t)nt;
    d.groups[2] = 1;

    /* Block windows: each dispatch's pool bindings hold whole blocks. */
    const uint64_t blk_bytes = (uint64_t)kv->block_size * rb;
    const uint64_t win = (be->max_ssbo_range - 32) / blk_bytes;
    if (win == 0)
        return duet__error(DUET_UNSUPPORTED,
                           "rope_kv: one block of the KV pool (%llu bytes) exceeds a storage binding on %s",
                           (unsigned long long)blk_bytes, be->base.info.name);
    const uint32_t es = kv->dtype == DUET_DTYPE_F32 ? 4 : kv->dtype == DUET_DTYPE_F16 ? 2 : 1;
    for (uint64_t b0 = 0; b0 < (uint64_t)kv->n_blocks; b0 += win) {
        const uint64_t b1 = b0 + win < (uint64_t)kv->n_blocks ? b0 + win : (uint64_t)kv->n_blocks;
        const uint64_t bytes = (b1 - b0) * blk_bytes;
        CHECK(duet__vk_ssbo_bind(be, name, "k_pool", kv->k_pool.buf, kv->k_pool.offset + b0 * blk_bytes,
                                 bytes, &d.bind[7], &rel));
        pc.kp_off = rel / es;
        CHECK(duet__vk_ssbo_bind(be, name, "v_pool", kv->v_pool.buf, kv->v_pool.offset + b0 * blk_bytes,
                                 bytes, &d.bind[8], &rel));
        pc.vp_off = rel / es;
        pc.blk_lo = (uint32_t)b0;
        pc.blk_hi = (uint32_t)b1;
        pc.rotate = b0 == 0;
        d.n_reads = d.n_writes = 0;
        d.reads[d.n_reads++] = vk_rng(pos.buf, pos.offset, nt * 4);
        d.reads[d.n_reads++] = vk_rng(seq.buf, seq.offset, nt * 4);
        d.reads[d.n_reads++] = vk_rng(v.buf, v.offset, kbytes);
        d.reads[d.n_reads++] = vk_rng(kv->block_table.buf, kv->block_table.offset, bt_bytes);
        if (n_rot > 0)
            d.reads[d.n_reads++] = vk_rng(op->rope_kv.freqs.buf, op->rope_kv.freqs.offset, fr_bytes);
        d.writes[d.n_writes++] = vk_rng(q.buf, q.offset, qbytes);
        d.writes[d.n_writes++] = vk_rng(k.buf, k.offset, kbytes);
        d.writes[d.n_writes++] = vk_rng(kv->k_pool.buf, kv->k_pool.offset + b0 * blk_bytes, bytes);
        d.writes[d.n_writes++] = vk_rng(kv->v_pool.buf, kv->v_pool.offset + b0 * blk_bytes, bytes);
        CHECK(duet__vk_dispatch(be, &d));
    }
    return DUET_OK;
}

/* ---- attention ----------------------------------------------------------------------------- */

/* How one attention op runs (see the file comment). */
typedef struct attn_plan {
    bool lane; /* attn_lane.comp (else attn_flash.comp) */
    bool prefill;
    uint32_t wg, c, nv, kt;  /* attn_flash specialization */
    uint32_t gh, bq, n_hg;   /* heads and tokens per workgroup, head groups per KV head */
    uint32_t n_split, chunk; /* key splits */
    bool partial;            /* through partials and attn_reduce */
} attn_plan;

#define ATTN_MAX_FACTORS 4096 /* attn_reduce: n_head * n_split */

static uint64_t flash_shared_bytes(uint32_t kt, uint32_t hd4, uint32_t rows) {
    return 2ull * kt * hd4 * 16 + kt * 4ull + rows * 8ull + 16;
}

/* Whether every head row of both pools starts on a texel and spans whole
 * texels (4 f32 or 8 f16 a fetch). Offsets count from the texel view that
 * holds the pool, which starts on a texel. */
static bool lane_aligned(const duet_op *op) {
    const duet_kv_pages *kv = &op->attention.kv;
    const uint64_t hd = (uint64_t)op->attention.head_dim, kvw = (uint64_t)op->attention.n_head_kv * hd;
    const uint32_t per = kv->dtype == DUET_DTYPE_F16 ? 8 : 4;
    return kv->dtype != DUET_DTYPE_Q8_0 && kv->k_pool.offset % 16 == 0 && kv->v_pool.offset % 16 == 0 &&
           kvw % per == 0 && hd % per == 0;
}

/* attn_flash: C lanes per query row (prefill: attn_c; decode: up to
 * attn_dc or a subgroup), the GQA heads of a KV head as rows in decode,
 * attn_kt keys a tile (fewer when shared memory is short). */
static void plan_flash(const vk_backend *be, const duet_op *op, attn_plan *pl) {
    const uint32_t nh = (uint32_t)op->attention.n_head, nkv = (uint32_t)op->attention.n_head_kv;
    const uint32_t hd = (uint32_t)op->attention.head_dim, G = nh / nkv, hd4 = (hd + 3) / 4;
    const vk_tuning *tu = &be->tune;
    const uint32_t sgs = be->phys->subgroup_size ? be->phys->subgroup_size : 1;
    const uint32_t max_wg = be->phys->props.limits.maxComputeWorkGroupInvocations;
    uint32_t c = pl->prefill ? (uint32_t)tu->attn_c : tu->attn_dc ? (uint32_t)tu->attn_dc : sgs;
    if (!be->phys->subgroup_shuffle || tu->no_shuffle) c = 1;
    while (c > 1 && c > sgs)
        c >>= 1;
    if (c > pow2_ceil(hd4)) c = pow2_ceil(hd4);
    uint32_t wg;
    if (pl->prefill) {
        wg = (uint32_t)tu->attn_wg;
        if (wg < c) wg = c;
    } else {
        uint32_t rows = pow2_ceil(G);
        while (rows > 1 && c * rows > 256)
            rows >>= 1;
        wg = c * rows;
    }
    while (wg > max_wg && wg > c)
        wg >>= 1;
    pl->c = c;
    pl->wg = wg;
    pl->nv = (hd4 + c - 1) / c;
    const uint32_t rows = wg / c;
    pl->gh = G < rows ? G : rows;
    pl->bq = pl->prefill ? rows / pl->gh : 1;
    pl->n_hg = (G + pl->gh - 1) / pl->gh;
    uint32_t kt = (uint32_t)tu->attn_kt;
    while (kt > 1 &&
           flash_shared_bytes(kt, pl->nv * c, rows) > be->phys->props.limits.maxComputeSharedMemorySize)
        kt >>= 1;
    pl->kt = kt;
}

/* attn_lane: C lanes per (token, head, split) row, each owning units of
 * the head (see attn_lane.comp: texels; q8_0 blocks, or quarters of them
 * when lanes share a row); splits on block boundaries. */
static void plan_lane(const vk_backend *be, const duet_op *op, attn_plan *pl) {
    const duet_kv_pages *kv = &op->attention.kv;
    const uint32_t hd = (uint32_t)op->attention.head_dim;
    const vk_tuning *tu = &be->tune;
    const uint32_t sgs = be->phys->subgroup_size ? be->phys->subgroup_size : 1;
    const uint32_t max_wg = be->phys->props.limits.maxComputeWorkGroupInvocations;
    const bool al = lane_aligned(op);
    uint32_t lc = tu->attn_dc ? (uint32_t)tu->attn_dc : sgs;
    if (!be->phys->subgroup_shuffle || !be->phys->subgroup_arith || tu->no_shuffle) lc = 1;
    while (lc > 1 && lc > sgs)
        lc >>= 1;
    uint32_t unit = kv->dtype == DUET_DTYPE_Q8_0 ? 8 : al ? (kv->dtype == DUET_DTYPE_F16 ? 8 : 4) : 4;
    while (lc > 1 && lc > pow2_ceil((hd + unit - 1) / unit))
        lc >>= 1;
    if (kv->dtype == DUET_DTYPE_Q8_0 && lc == 1) unit = 32;
    const uint32_t n_units = (hd + unit - 1) / unit;
    pl->c = lc;
    pl->nv = (n_units + lc - 1) / lc;
    pl->wg = (uint32_t)tu->attn_wg < lc ? lc : (uint32_t)tu->attn_wg;
    while (pl->wg > max_wg && pl->wg > lc)
        pl->wg >>= 1;
    pl->kt = (uint32_t)kv->block_size;
    pl->gh = pl->bq = 1; /* attn_flash's; unread by attn_lane */
    pl->n_hg = 1;
}

static void attn_choose(const vk_backend *be, const duet_op *op, const tok_info *ti, attn_plan *pl) {
    const duet_kv_pages *kv = &op->attention.kv;
    const uint32_t nh = (uint32_t)op->attention.n_head, nkv = (uint32_t)op->attention.n_head_kv;
    const uint64_t nt = (uint64_t)op->n_tokens;
    const vk_tuning *tu = &be->tune;
    /* Prefill when the tokens of a sequence come in runs (they share every
     * K/V tile); unknown positions: when there are several tokens per
     * sequence slot on average. */
    uint64_t runs = ti->known ? ti->runs : (nt < (uint64_t)kv->n_seqs ? nt : (uint64_t)kv->n_seqs);
    pl->prefill = nt >= 4 * runs && nt >= 4;
    pl->lane = tu->attn_lane;
    if (pl->lane)
        plan_lane(be, op, pl);
    else
        plan_flash(be, op, pl);

    /* Splits: until about attn_par workgroups run, keeping attn_chunk keys
     * or more per split. */
    const uint64_t cap = (uint64_t)kv->max_blocks * (uint64_t)kv->block_size;
    /* Keys to cover: the positions when the host can read them, else the
     * caller's n_keys, else the table's capacity. */
    const uint64_t ctx = ti->known                  ? ti->max_ctx
                         : op->attention.n_keys > 0 ? (uint64_t)op->attention.n_keys
                                                    : cap;
    const uint64_t base =
        pl->lane ? div_up(nt * nh, pl->wg / pl->c) : (uint64_t)div_up(nt, pl->bq) * nkv * pl->n_hg;
    uint64_t n_split = base < (uint64_t)tu->attn_par ? div_up((uint64_t)tu->attn_par, base) : 1;
    uint64_t most = div_up(ctx, (uint64_t)tu->attn_chunk);
    if (n_split > most) n_split = most;
    if (n_split > ATTN_MAX_FACTORS / nh) n_split = ATTN_MAX_FACTORS / nh;
    if (n_split > be->max_groups[2]) n_split = be->max_groups[2];
    if (n_split < 1) n_split = 1;
    uint64_t chunk = (ctx + n_split - 1) / n_split;
    chunk = (chunk + pl->kt - 1) / pl->kt * pl->kt; /* whole tiles (flash) or blocks (lane) */
    pl->chunk = (uint32_t)(chunk > UINT32_MAX ? UINT32_MAX : chunk);
    pl->n_split = (uint32_t)((ctx + chunk - 1) / chunk);
    if (pl->n_split < 1) pl->n_split = 1;
    pl->partial = pl->n_split > 1 || op->attention.out_q8.buf;
}

duet_status duet__vk_rec_attention(vk_backend *be, const duet_op *op) {
    const char *name = "attention";
    const int nh = op->attention.n_head, nkv = op->attention.n_head_kv, hd = op->attention.head_dim;
    const duet_kv_pages *kv = &op->attention.kv;
    const uint64_t nt = (uint64_t)op->n_tokens;
    if (hd > VK_MAX_HEAD_DIM)
        return duet__error(DUET_UNSUPPORTED, "attention: head_dim %d (the vulkan backend handles up to %d)",
                           hd, VK_MAX_HEAD_DIM);
    uint64_t rb, pool_bytes;
    CHECK(kv_check(name, kv, nkv, hd, &rb, &pool_bytes));
    const uint64_t width = (uint64_t)nh * (uint64_t)hd, qbytes = mul2(mul2(nt, width), 4);
    const duet_view q = op->attention.q, pos = op->attention.pos, seq = op->attention.seq,
                    out = op->attention.out, oq = op->attention.out_q8;
    const bool has_out = out.buf != NULL, has_q8 = oq.buf != NULL;
    const uint64_t oq_bytes = has_q8 ? mul3(nt, width / DUET_QK8_0, sizeof(duet_block_q8_0)) : 0;
    REQUIRE(nt <= be->max_groups[1], "attention: %d tokens exceed the grid limit", op->n_tokens);
    tok_info ti;
    CHECK(host_tokens(be, name, pos, seq, op->n_tokens, kv, true, &ti));
    REQUIRE(!ti.known || op->attention.n_keys == 0 || ti.max_ctx <= (uint64_t)op->attention.n_keys,
            "attention: a position %llu past n_keys %d", (unsigned long long)ti.max_ctx - 1,
            op->attention.n_keys);
    attn_plan pl;
    attn_choose(be, op, &ti, &pl);
    const uint32_t grid_x = pl.lane ? 0 : div_up(nt, pl.bq), grid_y = pl.lane ? 1 : (uint32_t)nkv * pl.n_hg;

    /* Partials: f32 [n_tok][n_head][n_split][head_dim + 2]. */
    const uint64_t part_bytes =
        pl.partial ? mul2(mul2(mul2(nt, (uint64_t)nh), pl.n_split), ((uint64_t)hd + 2) * 4) : 0;
    if (pl.partial) {
        if (part_bytes > be->max_ssbo_range - 32 || part_bytes > be->max_texel_bytes / 2)
            return duet__error(
                DUET_UNSUPPORTED,
                "attention: %d tokens x %d heads x %u splits of partials exceed a binding on %s",
                op->n_tokens, nh, pl.n_split, be->base.info.name);
        CHECK(duet__vk_scratch_reserve(be, &be->attn_part, part_bytes));
    }

    /* The flash pass. */
    const uint64_t bt_bytes = (uint64_t)kv->n_seqs * (uint64_t)kv->max_blocks * 4;
    vk_dispatch d = {.kind = DUET_OP_ATTENTION};
    struct {
        uint32_t q_off, pos_off, seq_off, bt_off, kp_off, vp_off, out_off;
        uint32_t n_tok, n_head, n_head_kv, hd, block_size, n_blocks, max_blocks, n_seqs;
        float scale;
        uint32_t n_split, chunk, gh, bq, window;
    } pc = {.n_tok = (uint32_t)nt,
            .n_head = (uint32_t)nh,
            .n_head_kv = (uint32_t)nkv,
            .hd = (uint32_t)hd,
            .block_size = (uint32_t)kv->block_size,
            .n_blocks = (uint32_t)kv->n_blocks,
            .max_blocks = (uint32_t)kv->max_blocks,
            .n_seqs = (uint32_t)kv->n_seqs,
            .scale = op->attention.scale,
            .n_split = pl.n_split,
            .chunk = pl.chunk,
            .gh = pl.gh,
            .bq = pl.bq,
            .window = (uint32_t)op->attention.window};
    uint32_t rel;
    CHECK(duet__vk_tex_bind(be, name, "q", q.buf, q.offset, qbytes, &d.bind[0], &pc.q_off));
    CHECK(duet__vk_tex_bind(be, name, "pos", pos.buf, pos.offset, nt * 4, &d.bind[1], &pc.pos_off));
    CHECK(duet__vk_tex_bind(be, name, "seq", seq.buf, seq.offset, nt * 4, &d.bind[2], &pc.seq_off));
    CHECK(duet__vk_tex_bind(be, name, "block_table", kv->block_table.buf, kv->block_table.offset, bt_bytes,
                            &d.bind[3], &pc.bt_off));
    CHECK(duet__vk_tex_bind(be, name, "k_pool", kv->k_pool.buf, kv->k_pool.offset, pool_bytes, &d.bind[4],
                            &pc.kp_off));
    CHECK(duet__vk_tex_bind(be, name, "v_pool", kv->v_pool.buf, kv->v_pool.offset, pool_bytes, &d.bind[5],
                            &pc.vp_off));
    if (pl.partial) {
        CHECK(duet__vk_ssbo_bind(be, name, "partials", be->attn_part, 0, part_bytes, &d.bind[6], &rel));
        d.writes[d.n_writes++] = vk_rng(be->attn_part, 0, part_bytes);
    } else {
        CHECK(duet__vk_ssbo_bind(be, name, "out", out.buf, out.offset, qbytes, &d.bind[6], &rel));
        d.writes[d.n_writes++] = vk_rng(out.buf, out.offset, qbytes);
    }
    pc.out_off = rel / 4;
    d.bind[7] = duet__vk_unused_ssbo(be); /* the status word */
    /* Whole texels per head row: 4 f32 or 8 f16 a fetch. */
    const bool aligned = lane_aligned(op);
    if (pl.lane) {
        const bool shuffle = be->phys->subgroup_shuffle && be->phys->subgroup_arith && !be->tune.no_shuffle;
        const bool sg_add = shuffle && pl.c > 1 && pl.c == be->phys->subgroup_size && pl.wg == pl.c;
        /* q8_0: head rows on words holding whole block pairs (17 words). */
        const uint64_t kvw = (uint64_t)nkv * (uint64_t)hd;
        const bool pairs = kv->dtype == DUET_DTYPE_Q8_0 && pl.c == 1 && hd % 64 == 0 && kvw % 64 == 0 &&
                           pc.kp_off % 4 == 0 && pc.vp_off % 4 == 0;
        const uint32_t spec[7] = {pl.wg,      pl.c,  pl.nv, kv_code(kv->dtype), aligned || pairs,
                                  pl.partial, sg_add};
        CHECK(duet__vk_pipeline_get(be, shuffle ? VK_SHADER_ATTN_LANE : VK_SHADER_ATTN_LANE_NOSHUFFLE, 6, 2,
                                    7, spec, &d.pipe));
    } else {
        const uint32_t spec[7] = {pl.wg, pl.c, pl.nv, pl.kt, kv_code(kv->dtype), aligned, pl.partial};
        const vk_shader flash = be->phys->subgroup_shuffle && !be->tune.no_shuffle
                                    ? VK_SHADER_ATTN_FLASH
                                    : VK_SHADER_ATTN_FLASH_NOSHUFFLE;
        CHECK(duet__vk_pipeline_get(be, flash, 6, 2, 7, spec, &d.pipe));
    }
    d.reads[d.n_reads++] = vk_rng(q.buf, q.offset, qbytes);
    d.reads[d.n_reads++] = vk_rng(pos.buf, pos.offset, nt * 4);
    d.reads[d.n_reads++] = vk_rng(seq.buf, seq.offset, nt * 4);
    d.reads[d.n_reads++] = vk_rng(kv->block_table.buf, kv->block_table.offset, bt_bytes);
    d.reads[d.n_reads++] = vk_rng(kv->k_pool.buf, kv->k_pool.offset, pool_bytes);
    d.reads[d.n_reads++] = vk_rng(kv->v_pool.buf, kv->v_pool.offset, pool_bytes);
    if (pl.lane) {
        const uint64_t rows = nt * (uint64_t)nh * pl.n_split;
        if (div_up(rows, pl.wg / pl.c) > be->max_groups[0])
            return duet__error(DUET_UNSUPPORTED, "attention: %llu rows exceed the grid limit",
                               (unsigned long long)rows);
        d.groups[0] = div_up(rows, pl.wg / pl.c);
        d.groups[1] = d.groups[2] = 1;
    } else {
        d.groups[0] = grid_x;
        d.groups[1] = grid_y;
        d.groups[2] = pl.n_split;
    }
    d.push = &pc;
    d.push_size = sizeof pc;
    CHECK(duet__vk_dispatch(be, &d));
    if (!pl.partial) return DUET_OK;

    /* The reduce pass: partials -> out (f32) and/or out_q8. */
    vk_dispatch r = {.kind = DUET_OP_ATTENTION};
    struct {
        uint32_t part_off, out_off, oq_off, n_head, hd, n_split;
    } rc = {.n_head = (uint32_t)nh, .hd = (uint32_t)hd, .n_split = pl.n_split};
    CHECK(duet__vk_tex_bind(be, name, "partials", be->attn_part, 0, part_bytes, &r.bind[0], &rc.part_off));
    r.reads[r.n_reads++] = vk_rng(be->attn_part, 0, part_bytes);
    r.bind[1] = r.bind[2] = duet__vk_unused_ssbo(be);
    if (has_out) {
        CHECK(duet__vk_ssbo_bind(be, name, "out", out.buf, out.offset, qbytes, &r.bind[1], &rel));
        rc.out_off = rel / 4;
        r.writes[r.n_writes++] = vk_rng(out.buf, out.offset, qbytes);
    }
    if (has_q8) {
        CHECK(duet__vk_ssbo_bind(be, name, "out_q8", oq.buf, oq.offset, oq_bytes, &r.bind[2], &rc.oq_off));
        r.writes[r.n_writes++] = vk_rng(oq.buf, oq.offset, oq_bytes);
    }
    uint32_t maxf = pow2_ceil((uint32_t)nh * pl.n_split);
    if (maxf < 64) maxf = 64;
    const uint32_t rspec[4] = {(uint32_t)be->tune.norm_wg, has_out, has_q8, maxf};
    CHECK(duet__vk_pipeline_get(be, VK_SHADER_ATTN_REDUCE, 1, 2, 4, rspec, &r.pipe));
    r.groups[0] = 1;
    r.groups[1] = (uint32_t)nt;
    r.groups[2] = 1;
    r.push = &rc;
    r.push_size = sizeof rc;
    return duet__vk_dispatch(be, &r);
}
