/* attention.cl — ATTENTION: out[t][h] = softmax(scale * q[t][h] . K^T) V over
 * cache positions 0..pos[t] of sequence seq[t], with GQA (query head h
 * reads KV head h / (n_head / n_head_kv)). KV_TYPE is f32 or f16.
 *
 * FlashAttention-style online softmax: no n x n matrix and no per-token
 * score array. One work-group of ATT_WG work-items per (token, head),
 * NDRange (ATT_WG, n_head, n_tokens). Positions go by in tiles of ATT_WG:
 * work-item i scores position p0 + i, the tile's max and sum come from
 * group reductions, then each work-item updates its share of the head's
 * dims (d = lid, lid + ATT_WG, ...). With ATT_WG = 1 (CPUs) it is one loop
 * per (token, head) and every barrier compiles away.
 *
 * out may alias q: a work-group reads q[t][h] into local memory before it
 * writes out[t][h], and no other work-group touches either. */
#ifndef KV_TYPE
#define KV_TYPE DT_F32
#endif
#ifndef ATT_WG
#define ATT_WG 1
#endif
#ifndef ATT_DMAX
#define ATT_DMAX 128
#endif
#define ATT_DPT ((ATT_DMAX + ATT_WG - 1) / ATT_WG) /* dims per work-item */

/* Eight consecutive cache values from element idx (a multiple of 8). */
inline float8 kv_load8(gbytes cache, ulong idx) {
#if KV_TYPE == DT_F16
    return vload_half8(idx / 8, (global const half *)cache);
#else
    return vload8(idx / 8, (global const float *)cache);
#endif
}

inline float hsum8(float8 v) {
    float lanes[8];
    vstore8(v, 0, lanes); /* not .lo/.hi: see hsum in matmul.cl */
    return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

inline float kv_load(gbytes cache, ulong idx) {
#if KV_TYPE == DT_F16
    return vload_half(idx, (global const half *)cache);
#else
    return ((global const float *)cache)[idx];
#endif
}

kernel void attention(gbytes q, ulong q_off, gbytes pos, ulong pos_off, gbytes seq, ulong seq_off, gbytes kc,
                      ulong kc_off, gbytes vc, ulong vc_off, ulong cache_rows, global uchar *out, ulong out_off,
                      int n_head, int n_head_kv, int hd, int n_ctx, float scale) {
    local float qs[ATT_DMAX];
    local float ws[ATT_WG];
    local float red[ATT_WG];
    const int lid = get_local_id(0), h = get_global_id(1), t = get_global_id(2);
    const int p_last = AT_CONST(int, pos, pos_off)[t], s = AT_CONST(int, seq, seq_off)[t];
    global float *o = AT(float, out, out_off) + ((ulong)t * n_head + h) * hd;
    /* Uniform across the work-group: every work-item returns or none does. */
    if (p_last < 0 || p_last >= n_ctx || s < 0 || (ulong)s * n_ctx + p_last >= cache_rows) {
        for (int d = lid; d < hd; d += ATT_WG) o[d] = 0.0f;
        return;
    }
    global const float *qr = AT_CONST(float, q, q_off) + ((ulong)t * n_head + h) * hd;
    for (int d = lid; d < hd; d += ATT_WG) qs[d] = qr[d];
    barrier(CLK_LOCAL_MEM_FENCE);

    const int kvh = h / (n_head / n_head_kv);
    const ulong kvw = (ulong)n_head_kv * hd;
    gbytes kbase = kc + kc_off, vbase = vc + vc_off;
    const ulong row0 = (ulong)s * n_ctx; /* cache row of position 0 */

#if ATT_WG == 1
    /* One work-item per (token, head): keep q and the output row in float8
     * registers, convert cache rows eight values at a time, and rescale
     * only when the running max grows. */
    if (hd % 8 == 0) {
        const int nv = hd / 8;
        float8 q8[ATT_DMAX / 8], a8[ATT_DMAX / 8];
        for (int c = 0; c < nv; c++) {
            q8[c] = vload8(c, qs);
            a8[c] = (float8)(0.0f);
        }
        float m8 = -INFINITY, l8 = 0.0f;
        for (int p = 0; p <= p_last; p++) {
            const ulong r = (row0 + p) * kvw + (ulong)kvh * hd;
            float8 d8 = (float8)(0.0f);
            for (int c = 0; c < nv; c++) d8 = fma(q8[c], kv_load8(kbase, r + 8 * c), d8);
            const float sc = hsum8(d8) * scale;
            if (sc > m8) {
                const float corr = exp(m8 - sc); /* 0 on the first position */
                l8 *= corr;
                for (int c = 0; c < nv; c++) a8[c] *= corr;
                m8 = sc;
            }
            const float e = exp(sc - m8);
            l8 += e;
            for (int c = 0; c < nv; c++) a8[c] = fma((float8)(e), kv_load8(vbase, r + 8 * c), a8[c]);
        }
        const float inv8 = 1.0f / l8;
        for (int c = 0; c < nv; c++) vstore8(a8[c] * inv8, c, o);
        return;
    }
#endif
    float acc[ATT_DPT];
    for (int j = 0; j < ATT_DPT; j++) acc[j] = 0.0f;
    float m = -INFINITY, l = 0.0f;

    for (int p0 = 0; p0 <= p_last; p0 += ATT_WG) {
        const int p = p0 + lid;
        float sc = -INFINITY;
        if (p <= p_last) {
            const ulong kr = (row0 + p) * kvw + (ulong)kvh * hd;
            float dot = 0.0f;
            for (int d = 0; d < hd; d++) dot = fma(qs[d], kv_load(kbase, kr + d), dot);
            sc = dot * scale;
        }
        const float m_new = fmax(m, group_max(sc, red, lid, ATT_WG));
        const float corr = exp(m - m_new); /* 0 on the first tile (m = -inf) */
        const float e = p <= p_last ? exp(sc - m_new) : 0.0f;
        l = l * corr + group_sum(e, red, lid, ATT_WG);
        ws[lid] = e;
        barrier(CLK_LOCAL_MEM_FENCE);
        const int n = min(ATT_WG, p_last - p0 + 1);
        for (int j = 0; j < ATT_DPT; j++) {
            const int d = lid + j * ATT_WG;
            if (d < hd) {
                float a = acc[j] * corr;
                for (int i = 0; i < n; i++) a = fma(ws[i], kv_load(vbase, (row0 + p0 + i) * kvw + (ulong)kvh * hd + d), a);
                acc[j] = a;
            }
        }
        m = m_new;
        barrier(CLK_LOCAL_MEM_FENCE); /* ws is rewritten by the next tile */
    }
    const float inv = 1.0f / l;
    for (int j = 0; j < ATT_DPT; j++) {
        const int d = lid + j * ATT_WG;
        if (d < hd) o[d] = acc[j] * inv;
    }
}
