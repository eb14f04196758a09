/* attention.cl — ATTENTION over the paged KV pools: out[t][h] =
 * softmax(scale * q[t][h] . K^T) V over positions 0..pos[t] of sequence
 * seq[t], query head h reading KV head h / (n_head / n_head_kv) (GQA/MQA).
 * KV_TYPE is f32, f16 or q8_0; ATT_HD is the exact head_dim (a few
 * variants serve every model, and loops over it unroll).
 *
 * FlashAttention-style: the n x n score matrix never exists. Two variants,
 * both correct for any batch (ragged lengths, several tokens of one
 * sequence, tokens of many sequences); the host picks by batch shape:
 *
 * attn_decode (flash-decoding): one work-group per (token, ATT_G query
 *   heads, split of the context): ATT_NKV adjacent KV heads with ATT_GK
 *   query heads each. Query heads of one KV head share every K/V slice the
 *   group reads; several KV heads per group (CPUs) make each key's read
 *   one contiguous run of the row. A split scores its keys into local
 *   memory (one key per work-item at a time, the row read once), takes one
 *   max and one sum per head over the split, then accumulates V with the
 *   work-items spread over head dims (V rows read coalesced, once). With
 *   one split the work-group writes the output itself; otherwise it writes
 *   a partial (m, l, acc[hd]) and attn_reduce combines the splits.
 *
 * attn_prefill: one work-group per tile of ATT_BQ query rows (a row is a
 *   (token, head) pair of one KV group) and the KV head. K/V tiles of
 *   ATT_BK positions go through local memory; ATT_TPR work-items share a
 *   row (scores for every ATT_TPR-th key, every ATT_TPR-th output dim);
 *   online softmax (running max m, sum l, rescaled accumulator); the
 *   causal mask per row. A tile whose tokens belong to several sequences
 *   is run once per sequence with the other rows masked.
 *
 * The host builds the decode kernels (-DATT_DECODE) and the prefill kernel
 * (-DATT_PREFILL) as separate programs, each with local arrays sized for
 * its plan.
 *
 * Outputs: out (f32, flags bit 0) and/or out_q8 (flags bit 1), the q8_0
 * blocks quantised from the same f32 values. A token whose position or
 * slot is outside the table (host-validated; this only keeps the device
 * inside its buffers) gets zeros. Block indices are clamped into
 * [0, n_blocks). out may alias q: every work-group copies its q rows to
 * local memory before a barrier and only then writes. */
#ifndef KV_TYPE
#define KV_TYPE DT_F32
#endif
#ifndef ATT_HD
#define ATT_HD 64
#endif
#ifndef ATT_WG
#define ATT_WG 64
#endif
#ifndef ATT_GK
#define ATT_GK 1 /* decode: query heads per KV head in a work-group */
#endif
#ifndef ATT_NKV
#define ATT_NKV 1 /* decode: KV heads per work-group */
#endif
#define ATT_G (ATT_GK * ATT_NKV) /* decode: query heads per work-group */
#ifndef ATT_SPLIT
#define ATT_SPLIT 256
#endif
#ifndef ATT_BQ
#define ATT_BQ 16
#endif
#ifndef ATT_BK
#define ATT_BK 16
#endif
#ifndef ATT_TPR
#define ATT_TPR 4
#endif
#ifndef RED_WG
#define RED_WG 64
#endif

#define F_OUT 1    /* write out */
#define F_Q8 2     /* write out_q8 */
#define F_DIRECT 4 /* decode: one split, the work-group writes the output */

/* Horizontal sums through private memory: Oclgrind's checkers crash on
 * vector lane shuffles (.lo/.hi). */
inline float hsum8(float8 v) {
    float l[8];
    vstore8(v, 0, l);
    return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}

/* A tree, not a loop: floating-point adds are not reassociated, so a loop
 * is a 16-add dependency chain (a third of the decode time on CPUs). */
inline float hsum16(float16 v) {
    float l[16];
    vstore16(v, 0, l);
    return (((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))) +
           (((l[8] + l[9]) + (l[10] + l[11])) + ((l[12] + l[13]) + (l[14] + l[15])));
}

/* ---- KV element access (e = element index in the pool) --------------------- */

inline float kv_at(gbytes pool, ulong e) {
#if KV_TYPE == DT_F16
    return vload_half(e, (global const half *)pool);
#elif KV_TYPE == DT_Q8_0
    gbytes b = pool + (e / QK8_0) * Q8_0_BYTES;
    return load_half(b) * (float)((global const char *)b)[2 + e % QK8_0];
#else
    return ((global const float *)pool)[e];
#endif
}

#if ATT_HD % 8 == 0
#if KV_TYPE != DT_Q8_0
/* Eight values from element e (a multiple of 8). */
inline float8 kv_raw8(gbytes pool, ulong e) {
#if KV_TYPE == DT_F16
    return vload_half8(e / 8, (global const half *)pool);
#else
    return vload8(e / 8, (global const float *)pool);
#endif
}
#endif


#if KV_TYPE == DT_Q8_0
/* The 32 quants of the q8_0 block at blk as two float16 (one 16-byte load
 * each: CPUs turn these into one widening load per half). */
inline float16 q8_lo(gbytes blk) { return convert_float16(vload16(0, (global const char *)(blk + 2))); }
inline float16 q8_hi(gbytes blk) { return convert_float16(vload16(1, (global const char *)(blk + 2))); }

#endif

/* q (local, ATT_HD floats) . the KV row slice starting at element e (for
 * q8_0 a multiple of 32: the slice is whole blocks). */
__attribute__((always_inline)) inline float kv_dot(gbytes pool, ulong e, local const float *q) {
#if KV_TYPE == DT_Q8_0
    gbytes blk = pool + e / QK8_0 * Q8_0_BYTES;
    float16 acc = (float16)(0.0f);
#pragma unroll
    for (int b = 0; b < ATT_HD / QK8_0; b++, blk += Q8_0_BYTES)
        acc = fma(fma(vload16(2 * b, q), q8_lo(blk), vload16(2 * b + 1, q) * q8_hi(blk)), (float16)(load_half(blk)), acc);
    return hsum16(acc);
#else
    float8 acc = (float8)(0.0f);
#pragma unroll
    for (int c = 0; c < ATT_HD / 8; c++) acc = fma(vload8(c, q), kv_raw8(pool, e + 8 * c), acc);
    return hsum8(acc);
#endif
}
#else
__attribute__((always_inline)) inline float kv_dot(gbytes pool, ulong e, local const float *q) {
    float acc = 0.0f;
    for (int d = 0; d < ATT_HD; d++) acc = fma(q[d], kv_at(pool, e + d), acc);
    return acc;
}
#endif

/* A token's (position, slot), or p = -1 when they are outside the table. */
inline int2 token_slot(gbytes pos, ulong pos_off, gbytes seq, ulong seq_off, int t, int bs, int n_seqs,
                       int max_blocks) {
    const int p = AT_CONST(int, pos, pos_off)[t], s = AT_CONST(int, seq, seq_off)[t];
    if (p < 0 || s < 0 || s >= n_seqs || p / bs >= max_blocks) return (int2)(-1, 0);
    return (int2)(p, s);
}

/* Walks the pool rows of positions p0, p0 + 1, ... of slot s: one table
 * read per block instead of a division per position (the one-work-item
 * loops on CPUs). Reads the table only for positions below p0 + n. */
typedef struct kv_walk {
    global const int *entry; /* the table entry of the current block */
    ulong row;               /* pool row of the current position */
    int off;                 /* its row within the block */
} kv_walk;

inline kv_walk kv_walk_start(global const int *table, int s, int p0, int n, int bs, int n_blocks, int max_blocks) {
    kv_walk w;
    int bi;
    DIVMOD(p0, bs, bi, w.off);
    w.entry = table + (ulong)s * max_blocks + bi;
    w.row = n > 0 ? (ulong)clamp(*w.entry, 0, n_blocks - 1) * bs + w.off : 0;
    return w;
}

/* Steps to the next position; `more` says whether it is still wanted. */
inline void kv_walk_next(kv_walk *w, bool more, int bs, int n_blocks) {
    if (++w->off < bs) {
        w->row++;
    } else {
        w->off = 0;
        w->entry++;
        if (more) w->row = (ulong)clamp(*w->entry, 0, n_blocks - 1) * bs;
    }
}

/* ---- decode: flash-decoding splits -------------------------------------------- */
#ifdef ATT_DECODE

/* ATT_G values reduced across the work-group (max when is_max, else sum);
 * every work-item gets the results. red holds ATT_G * ATT_WG floats. */
inline void group_reduce_g(float *v, local float *red, int lid, bool is_max) {
#if ATT_WG > 1
    for (int g = 0; g < ATT_G; g++) red[g * ATT_WG + lid] = v[g];
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int o = ATT_WG / 2; o > 0; o >>= 1) {
        if (lid < o)
            for (int g = 0; g < ATT_G; g++) {
                const float a = red[g * ATT_WG + lid], b = red[g * ATT_WG + lid + o];
                red[g * ATT_WG + lid] = is_max ? fmax(a, b) : a + b;
            }
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    for (int g = 0; g < ATT_G; g++) v[g] = red[g * ATT_WG];
    barrier(CLK_LOCAL_MEM_FENCE);
#endif
}

#define ATT_KG (ATT_WG >= ATT_HD ? ATT_WG / ATT_HD : 1)             /* key groups in the V pass */
#define ATT_DPT (ATT_WG >= ATT_HD ? 1 : (ATT_HD + ATT_WG - 1) / ATT_WG) /* dims per work-item */

/* NDRange (ATT_WG * n_tokens * n_head / ATT_G, n_splits). Partials: float
 * [n_tokens][n_head][n_splits][2 + ATT_HD] = (m, l, acc). */
kernel void attn_decode(gbytes q, ulong q_off, gbytes pos, ulong pos_off, gbytes seq, ulong seq_off, gbytes kp,
                        ulong kp_off, gbytes vp, ulong vp_off, gbytes tab, ulong tab_off, global float *part,
                        global uchar *out, ulong out_off, global uchar *oq, ulong oq_off, int n_head, int n_head_kv,
                        float scale, int split_len, int n_splits, int bs, int n_blocks, int n_seqs, int max_blocks,
                        int flags, int window) {
    local float qs[ATT_G * ATT_HD];
    local float sc[ATT_G * ATT_SPLIT]; /* scores, then probabilities; then the V-pass combine */
#if ATT_WG > 1
    local float red[ATT_G * ATT_WG];
#else
    local float *red = 0;
#endif
    /* Head groups vary fastest: the groups of one split read the same K/V
     * rows (each its own slice), so on CPUs the rows are still in cache
     * for the next group. */
    const int lid = get_local_id(0), sp = get_group_id(1);
    int t, hg; /* dim 0 is (token, head group) */
    DIVMOD((int)get_group_id(0), n_head / ATT_G, t, hg);
    const int h0 = hg * ATT_G;
    const int kvh0 = h0 / (n_head / n_head_kv); /* the work-group's first KV head */
    const int kvw = n_head_kv * ATT_HD;
    const int2 ps = token_slot(pos, pos_off, seq, seq_off, t, bs, n_seqs, max_blocks);
    const ulong orow = (ulong)t * n_head * ATT_HD + (ulong)h0 * ATT_HD; /* first output value */
    /* A split past the token's position (or a token outside the table)
     * has no keys: it runs through the barriers doing nothing (see the
     * note on returns below); attn_reduce ignores its partial. */
    const int ks = sp * split_len;
    /* A position past the last split (the host planned the splits for
     * fewer keys) is a bad slot too, not silently fewer keys. */
    const bool valid = ps.x >= 0 && ps.x < n_splits * split_len && ks <= ps.x;
    /* Keys k0 .. k0 + n - 1: the split's, from the sliding window's first
     * on (a split wholly before it sees none: m = -inf, l = 0, weight 0
     * in attn_reduce). */
    const int k0 = window > 0 ? max(ks, ps.x - window + 1) : ks;
    const int n = valid ? max(0, min(ks + split_len, ps.x + 1) - k0) : 0;
    global const int *table = AT_CONST(int, tab, tab_off);
    gbytes kbase = kp + kp_off, vbase = vp + vp_off;

    for (int i = lid; i < ATT_G * ATT_HD; i += ATT_WG)
        qs[i] = AT_CONST(float, q, q_off)[orow + i] * scale;
    barrier(CLK_LOCAL_MEM_FENCE);

    /* Scores: one key per work-item, its K row slice read once for all heads. */
    float m[ATT_G], l[ATT_G];
    for (int g = 0; g < ATT_G; g++) m[g] = -INFINITY, l[g] = 0.0f;
#if ATT_WG == 1
    kv_walk w = kv_walk_start(table, ps.y, k0, n, bs, n_blocks, max_blocks);
    for (int c = 0; c < n; c++, kv_walk_next(&w, c < n, bs, n_blocks)) {
        const ulong e0 = w.row * kvw + (ulong)kvh0 * ATT_HD;
#else
    for (int c = lid; c < n; c += ATT_WG) {
        const ulong e0 = kv_row(table, ps.y, k0 + c, bs, n_blocks, max_blocks) * kvw + (ulong)kvh0 * ATT_HD;
#endif
        for (int kv = 0; kv < ATT_NKV; kv++)
            for (int j = 0; j < ATT_GK; j++) {
                const int g = kv * ATT_GK + j;
                const float s = kv_dot(kbase, e0 + kv * ATT_HD, qs + g * ATT_HD);
                sc[g * ATT_SPLIT + c] = s;
                m[g] = fmax(m[g], s);
            }
    }
    group_reduce_g(m, red, lid, true);
#if ATT_WG == 1
    /* Sixteen exponentials at a time (the runtime's vector exp). */
    for (int g = 0; g < ATT_G; g++) {
        local float *sg = sc + g * ATT_SPLIT;
        float16 l16 = (float16)(0.0f);
        int c = 0;
        for (; c + 16 <= n; c += 16) {
            const float16 e = exp(vload16(0, sg + c) - m[g]);
            vstore16(e, 0, sg + c);
            l16 += e;
        }
        float lg = hsum16(l16);
        for (; c < n; c++) {
            const float e = exp(sg[c] - m[g]);
            sg[c] = e;
            lg += e;
        }
        l[g] = lg;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
#else
    for (int c = lid; c < n; c += ATT_WG)
        for (int g = 0; g < ATT_G; g++) {
            const float e = exp(sc[g * ATT_SPLIT + c] - m[g]);
            sc[g * ATT_SPLIT + c] = e;
            l[g] += e;
        }
    group_reduce_g(l, red, lid, false); /* its barriers also publish sc */
#endif

    /* V: work-items over head dims (coalesced rows); with more work-items
     * than dims, ATT_KG groups take every ATT_KG-th key. */
    float acc[ATT_G][ATT_DPT];
    for (int g = 0; g < ATT_G; g++)
        for (int i = 0; i < ATT_DPT; i++) acc[g][i] = 0.0f;
    int kg = 0, d0 = lid;
    if (ATT_WG >= ATT_HD) DIVMOD(lid, ATT_HD, kg, d0);
    const bool vactive = kg < ATT_KG;
#if ATT_WG == 1 && KV_TYPE == DT_Q8_0
    {
        /* One work-item (CPUs), q8_0: the row in float16 registers, one
         * widening load per 16 quants and one scale per block. */
        float16 a16[ATT_G][ATT_HD / 16];
        for (int g = 0; g < ATT_G; g++)
            for (int i = 0; i < ATT_HD / 16; i++) a16[g][i] = (float16)(0.0f);
        kv_walk w = kv_walk_start(table, ps.y, k0, n, bs, n_blocks, max_blocks);
        for (int c = 0; c < n; c++, kv_walk_next(&w, c < n, bs, n_blocks)) {
            /* The work-group's KV heads are adjacent: one run of blocks. */
            gbytes blk = vbase + (w.row * kvw + (ulong)kvh0 * ATT_HD) / QK8_0 * Q8_0_BYTES;
            for (int kv = 0; kv < ATT_NKV; kv++)
                for (int b = 0; b < ATT_HD / QK8_0; b++, blk += Q8_0_BYTES) {
                    const float16 lo = q8_lo(blk), hi = q8_hi(blk);
                    const float dv = load_half(blk);
                    for (int j = 0; j < ATT_GK; j++) {
                        const int g = kv * ATT_GK + j;
                        const float16 w = (float16)(sc[g * ATT_SPLIT + c] * dv);
                        a16[g][2 * b] = fma(w, lo, a16[g][2 * b]);
                        a16[g][2 * b + 1] = fma(w, hi, a16[g][2 * b + 1]);
                    }
                }
        }
        for (int g = 0; g < ATT_G; g++)
            for (int i = 0; i < ATT_HD / 16; i++) vstore16(a16[g][i], i, acc[g]);
    }
#elif ATT_WG == 1 && ATT_HD % 8 == 0
    {
        /* One work-item (CPUs): the row in float8 registers. */
        float8 a8[ATT_G][ATT_HD / 8];
        for (int g = 0; g < ATT_G; g++)
            for (int i = 0; i < ATT_HD / 8; i++) a8[g][i] = (float8)(0.0f);
        kv_walk w = kv_walk_start(table, ps.y, k0, n, bs, n_blocks, max_blocks);
        for (int c = 0; c < n; c++, kv_walk_next(&w, c < n, bs, n_blocks)) {
            const ulong e0 = w.row * kvw + (ulong)kvh0 * ATT_HD;
            for (int kv = 0; kv < ATT_NKV; kv++)
#pragma unroll
                for (int i = 0; i < ATT_HD / 8; i++) {
                    const float8 vv = kv_raw8(vbase, e0 + kv * ATT_HD + 8 * i);
                    for (int j = 0; j < ATT_GK; j++) {
                        const int g = kv * ATT_GK + j;
                        a8[g][i] = fma((float8)(sc[g * ATT_SPLIT + c]), vv, a8[g][i]);
                    }
                }
        }
        for (int g = 0; g < ATT_G; g++)
            for (int i = 0; i < ATT_HD / 8; i++) vstore8(a8[g][i], i, acc[g]);
    }
#else
    if (vactive)
        for (int c = kg; c < n; c += ATT_KG) {
            const ulong e0 = kv_row(table, ps.y, k0 + c, bs, n_blocks, max_blocks) * kvw + (ulong)kvh0 * ATT_HD;
            for (int i = 0; i < ATT_DPT; i++) {
                const int d = d0 + i * ATT_WG;
                if (d < ATT_HD)
                    for (int kv = 0; kv < ATT_NKV; kv++) {
                        const float vv = kv_at(vbase, e0 + kv * ATT_HD + d);
                        for (int j = 0; j < ATT_GK; j++) {
                            const int g = kv * ATT_GK + j;
                            acc[g][i] = fma(sc[g * ATT_SPLIT + c], vv, acc[g][i]);
                        }
                    }
            }
        }
#endif
#if ATT_KG > 1
    /* Sum the key groups' accumulators (sc is free once every work-item is here). */
    barrier(CLK_LOCAL_MEM_FENCE);
    if (vactive)
        for (int g = 0; g < ATT_G; g++) sc[(kg * ATT_G + g) * ATT_HD + d0] = acc[g][0];
    barrier(CLK_LOCAL_MEM_FENCE);
    if (kg == 0)
        for (int g = 0; g < ATT_G; g++) {
            float a = 0.0f;
            for (int j = 0; j < ATT_KG; j++) a += sc[(j * ATT_G + g) * ATT_HD + d0];
            acc[g][0] = a;
        }
#endif
    const bool owner = kg == 0; /* holds the final acc of dims d0 + i * ATT_WG */

    /* No return from here on: PoCL 3.1 miscompiles a uniform return that
     * is followed by more barriers (work-items then run past their loop
     * bounds), so both outputs run through the same barriers. */
    if (!(flags & F_DIRECT) && valid)
        for (int g = 0; g < ATT_G; g++) {
            global float *pt = part + (((ulong)t * n_head + h0 + g) * n_splits + sp) * (2 + ATT_HD);
            if (lid == 0) pt[0] = m[g], pt[1] = l[g];
            if (owner)
                for (int i = 0; i < ATT_DPT; i++) {
                    const int d = d0 + i * ATT_WG;
                    if (d < ATT_HD) pt[2 + d] = acc[g][i];
                }
        }
    /* One split: normalise and write (q8 through local memory, one block
     * per work-item; the host picks this only when ATT_HD % 32 == 0). */
    barrier(CLK_LOCAL_MEM_FENCE); /* qs is reused */
    if ((flags & F_DIRECT) && owner)
        for (int g = 0; g < ATT_G; g++)
            for (int i = 0; i < ATT_DPT; i++) {
                const int d = d0 + i * ATT_WG;
                if (d < ATT_HD) {
                    const float o = valid ? acc[g][i] / l[g] : 0.0f; /* zeros for a bad slot */
                    if (flags & F_OUT) AT(float, out, out_off)[orow + g * ATT_HD + d] = o;
                    if (flags & F_Q8) qs[g * ATT_HD + d] = o;
                }
            }
    barrier(CLK_LOCAL_MEM_FENCE);
    if ((flags & F_DIRECT) && (flags & F_Q8))
        for (int b = lid; b < ATT_G * ATT_HD / QK8_0; b += ATT_WG)
            q8_store_block_local(AT(uchar, oq, oq_off) + (orow / QK8_0 + b) * Q8_0_BYTES, qs + b * QK8_0);
}

/* Combines the splits of attn_decode: one work-item per output value,
 * NDRange (RED_WG * ceil(n_head * ATT_HD / RED_WG), n_tokens); RED_WG is a
 * multiple of 32 so a work-group owns whole q8_0 blocks. */
kernel void attn_reduce(gbytes pos, ulong pos_off, gbytes seq, ulong seq_off, global const float *part,
                        global uchar *out, ulong out_off, global uchar *oq, ulong oq_off, int n_head,
                        int split_len, int n_splits, int bs, int n_seqs, int max_blocks, int flags) {
    local float vals[RED_WG];
    const int lid = get_local_id(0), t = get_group_id(1);
    const int i = get_global_id(0);
    const int width = n_head * ATT_HD;
    const int2 ps = token_slot(pos, pos_off, seq, seq_off, t, bs, n_seqs, max_blocks);
    float o = 0.0f;
    if (i < width && ps.x >= 0 && ps.x < n_splits * split_len) {
        int h, d;
        DIVMOD(i, ATT_HD, h, d);
        const int ns = ps.x / split_len + 1; /* splits that saw keys */
        global const float *pt = part + ((ulong)t * n_head + h) * n_splits * (2 + ATT_HD);
        float mx = -INFINITY;
        for (int s = 0; s < ns; s++) mx = fmax(mx, pt[s * (2 + ATT_HD)]);
        float l = 0.0f, a = 0.0f;
        for (int s = 0; s < ns; s++) {
            global const float *ps_ = pt + s * (2 + ATT_HD);
            const float w = exp(ps_[0] - mx);
            l = fma(ps_[1], w, l);
            a = fma(ps_[2 + d], w, a);
        }
        o = a / l;
    }
    if ((flags & F_OUT) && i < width) AT(float, out, out_off)[(ulong)t * width + i] = o;
    if (flags & F_Q8) {
        vals[lid] = o;
        barrier(CLK_LOCAL_MEM_FENCE);
        const int b = lid * QK8_0; /* the first RED_WG / 32 work-items quantise */
        const int i0 = get_group_id(0) * RED_WG + b;
        if (b < RED_WG && i0 < width)
            q8_store_block_local(AT(uchar, oq, oq_off) + ((ulong)t * width + i0) / QK8_0 * Q8_0_BYTES, vals + b);
    }
}

#endif /* ATT_DECODE */

/* ---- prefill: query tiles x K/V tiles in local memory ----------------------------- */
#ifdef ATT_PREFILL

#define ATT_PWG (ATT_BQ * ATT_TPR)                /* work-group size */
#define ATT_QS (ATT_HD + 1)                       /* padded row strides: no bank conflicts */
#define ATT_SS (ATT_BK + 1)
#define ATT_PDPT ((ATT_HD + ATT_TPR - 1) / ATT_TPR) /* output dims per work-item */

/* NDRange (ATT_PWG * ceil(n_tokens * G / ATT_BQ), n_head_kv), G = n_head / n_head_kv.
 * Row R of KV head kvh is token R / G, query head kvh * G + R % G. */
kernel void attn_prefill(gbytes q, ulong q_off, gbytes pos, ulong pos_off, gbytes seq, ulong seq_off, gbytes kp,
                         ulong kp_off, gbytes vp, ulong vp_off, gbytes tab, ulong tab_off, global uchar *out,
                         ulong out_off, global uchar *oq, ulong oq_off, int n_tokens, int n_head, int n_head_kv,
                         float scale, int bs, int n_blocks, int n_seqs, int max_blocks, int flags, int window) {
    local float qs[ATT_BQ * ATT_QS];
    local float ks[ATT_BK * ATT_QS];
    local float vs[ATT_BK * ATT_HD];
    local float ss[ATT_BQ * ATT_SS];
    local float part[ATT_BQ * ATT_TPR]; /* per-row partial max, then partial sums */
    local int rseq[ATT_BQ], rpos[ATT_BQ], rstate[ATT_BQ];
    const int lid = get_local_id(0), kvh = get_group_id(1);
    int r, j; /* my row, my lane in it */
    DIVMOD(lid, ATT_TPR, r, j);
    const int G = n_head / n_head_kv;
    const int R0 = get_group_id(0) * ATT_BQ;
    const int kvw = n_head_kv * ATT_HD;
    global const int *table = AT_CONST(int, tab, tab_off);
    gbytes kbase = kp + kp_off, vbase = vp + vp_off;

    /* Row states: 0 = to do, 1 = done, 2 = bad slot (zeros), 3 = past the batch. */
    if (lid < ATT_BQ) {
        const int R = R0 + lid;
        int st = 3, p = -1, s = 0;
        if (R < n_tokens * G) {
            const int2 ps = token_slot(pos, pos_off, seq, seq_off, R / G, bs, n_seqs, max_blocks);
            p = ps.x;
            s = ps.y;
            st = p < 0 ? 2 : 0;
        }
        rstate[lid] = st, rpos[lid] = p, rseq[lid] = s;
    }
    for (int e = lid; e < ATT_BQ * ATT_HD; e += ATT_PWG) {
        int rr, d, tq, tg;
        DIVMOD(e, ATT_HD, rr, d);
        const int R = R0 + rr;
        DIVMOD(R, G, tq, tg);
        float v = 0.0f;
        if (R < n_tokens * G) v = AT_CONST(float, q, q_off)[((ulong)tq * n_head + kvh * G + tg) * ATT_HD + d] * scale;
        qs[rr * ATT_QS + d] = v;
    }
    /* Global too: out may alias q (in place), and other work-items of the
     * group write out rows whose q this group has just read. */
    barrier(CLK_LOCAL_MEM_FENCE | CLK_GLOBAL_MEM_FENCE);

    float acc[ATT_PDPT];
    for (int i = 0; i < ATT_PDPT; i++) acc[i] = 0.0f;
    float m = -INFINITY, lp = 0.0f; /* lp: this work-item's share of the row's sum */

    for (;;) {
        /* The next sequence to run (uniform: every work-item scans the same
         * local state) and the furthest position any of its rows sees. */
        int target = -1, kmax = -1, kmin = INT_MAX; /* kmin: the earliest key a windowed row sees */
        for (int rr = 0; rr < ATT_BQ; rr++)
            if (rstate[rr] == 0) {
                if (target < 0) target = rseq[rr];
                if (rseq[rr] == target) kmax = max(kmax, rpos[rr]), kmin = min(kmin, rpos[rr] - window + 1);
            }
        if (target < 0) break;
        const bool active = rstate[r] == 0 && rseq[r] == target;
        const int my_pos = rpos[r];

        for (int kb = window > 0 ? max(0, kmin) : 0; kb <= kmax; kb += ATT_BK) {
            /* K/V tile: consecutive work-items read consecutive dims of a row. */
            for (int e = lid; e < ATT_BK * ATT_HD; e += ATT_PWG) {
                int c, d;
                DIVMOD(e, ATT_HD, c, d);
                float kv = 0.0f, vv = 0.0f;
                if (kb + c <= kmax) {
                    const ulong el =
                        kv_row(table, target, kb + c, bs, n_blocks, max_blocks) * kvw + (ulong)kvh * ATT_HD + d;
                    kv = kv_at(kbase, el);
                    vv = kv_at(vbase, el);
                }
                ks[c * ATT_QS + d] = kv;
                vs[c * ATT_HD + d] = vv;
            }
            barrier(CLK_LOCAL_MEM_FENCE);

            /* Scores of my keys j, j + ATT_TPR, ...: each q value loaded once
             * for all of them. */
            float sacc[ATT_BK / ATT_TPR];
            for (int i = 0; i < ATT_BK / ATT_TPR; i++) sacc[i] = 0.0f;
            if (active)
                for (int d = 0; d < ATT_HD; d++) {
                    const float qd = qs[r * ATT_QS + d];
#pragma unroll
                    for (int i = 0; i < ATT_BK / ATT_TPR; i++)
                        sacc[i] = fma(qd, ks[(j + i * ATT_TPR) * ATT_QS + d], sacc[i]);
                }
            float mt = -INFINITY;
            for (int i = 0; i < ATT_BK / ATT_TPR; i++) {
                const int c = j + i * ATT_TPR;
                const float s = active && kb + c <= my_pos && (window == 0 || kb + c > my_pos - window) ? sacc[i]
                                                                                                      : -INFINITY;
                ss[r * ATT_SS + c] = s;
                mt = fmax(mt, s);
            }
            part[lid] = mt;
            barrier(CLK_LOCAL_MEM_FENCE);
            for (int i = 0; i < ATT_TPR; i++) mt = fmax(mt, part[r * ATT_TPR + i]);
            const float m_new = fmax(m, mt);
            /* All masked so far: nothing to rescale (and no inf - inf). */
            const float corr = m_new == -INFINITY ? 1.0f : exp(m - m_new);
            float lsum = 0.0f;
            for (int c = j; c < ATT_BK; c += ATT_TPR) {
                const float s = ss[r * ATT_SS + c];
                const float p = s == -INFINITY ? 0.0f : exp(s - m_new);
                ss[r * ATT_SS + c] = p;
                lsum += p;
            }
            lp = lp * corr + lsum;
            m = m_new;
            barrier(CLK_LOCAL_MEM_FENCE);
            for (int i = 0; i < ATT_PDPT; i++) {
                const int d = j + i * ATT_TPR;
                if (d < ATT_HD) {
                    float a = acc[i] * corr;
                    for (int c = 0; c < ATT_BK; c++) a = fma(ss[r * ATT_SS + c], vs[c * ATT_HD + d], a);
                    acc[i] = a;
                }
            }
            barrier(CLK_LOCAL_MEM_FENCE); /* ks, vs, ss, part are rewritten next tile */
        }
        if (lid < ATT_BQ && rstate[lid] == 0 && rseq[lid] == target) rstate[lid] = 1;
        barrier(CLK_LOCAL_MEM_FENCE);
    }

    /* The row's sum from its ATT_TPR shares, then the output. */
    part[lid] = lp;
    barrier(CLK_LOCAL_MEM_FENCE);
    float l = 0.0f;
    for (int i = 0; i < ATT_TPR; i++) l += part[r * ATT_TPR + i];
    const int R = R0 + r;
    const int st = rstate[r];
    int tq, tg;
    DIVMOD(R, G, tq, tg);
    const ulong orow = (ulong)tq * n_head * ATT_HD + (ulong)(kvh * G + tg) * ATT_HD;
    for (int i = 0; i < ATT_PDPT; i++) {
        const int d = j + i * ATT_TPR;
        if (d < ATT_HD && st != 3) {
            const float o = st == 1 ? acc[i] / l : 0.0f;
            if (flags & F_OUT) AT(float, out, out_off)[orow + d] = o;
            if (flags & F_Q8) qs[r * ATT_QS + d] = o; /* qs is only read before the last barrier */
        }
    }
    if (flags & F_Q8) {
        /* ATT_HD % 32 == 0 here (the host checks): a row's blocks are its own. */
        barrier(CLK_LOCAL_MEM_FENCE);
        for (int b = j; b < ATT_HD / QK8_0 && st != 3; b += ATT_TPR)
            q8_store_block_local(AT(uchar, oq, oq_off) + (orow / QK8_0 + b) * Q8_0_BYTES, qs + r * ATT_QS + b * QK8_0);
    }
}
#endif /* ATT_PREFILL */
