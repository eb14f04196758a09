/* rope_kv.cl — ROPE_KV: rotate q and k in place at each token's position,
 * then store k and v into the KV cache (KV_TYPE f32 or f16) at the token's
 * (sequence, position) slot. theta_i = pos * base^(-2i/n_rot) on pairs
 * (2i, 2i+1), or (i, i + n_rot/2) when neox; dims past n_rot stay as they are.
 *
 * NDRange (n_rot/2 + head_dim - n_rot, n_tokens): work-item j of a token
 * handles rotation pair j (or, past the pairs, one unrotated dim) in every
 * q, k and v head, so each angle is computed once per token. A token whose
 * slot lies outside the cache (core validates positions; this only keeps
 * the device inside the buffer) is left alone. */
#ifndef KV_TYPE
#define KV_TYPE DT_F32
#endif

inline void kv_store(global uchar *cache, ulong off, ulong idx, float v) {
#if KV_TYPE == DT_F16
    vstore_half_rte(v, idx, AT(half, cache, off));
#else
    AT(float, cache, off)[idx] = v;
#endif
}

kernel void rope_kv(global uchar *q, ulong q_off, global uchar *k, ulong k_off, gbytes v, ulong v_off, gbytes pos,
                    ulong pos_off, gbytes seq, ulong seq_off, global uchar *kc, ulong kc_off, global uchar *vc,
                    ulong vc_off, ulong cache_rows, int n_head, int n_head_kv, int hd, int n_rot, int n_ctx,
                    float freq_base, int neox) {
    const int j = get_global_id(0), t = get_global_id(1);
    const int half_rot = n_rot / 2;
    if (j >= half_rot + (hd - n_rot)) return;
    const int p = AT_CONST(int, pos, pos_off)[t], s = AT_CONST(int, seq, seq_off)[t];
    if (p < 0 || p >= n_ctx || s < 0 || (ulong)s * n_ctx + p >= cache_rows) return;
    const ulong slot = ((ulong)s * n_ctx + p) * (ulong)(n_head_kv * hd);

    int i0, i1 = -1; /* the pair, or one unrotated dim */
    float cs = 1.0f, sn = 0.0f;
    if (j < half_rot) {
        i0 = neox ? j : 2 * j;
        i1 = neox ? j + half_rot : 2 * j + 1;
#ifdef HAVE_FP64
        /* Angles reach pos radians: double keeps them as exact as the cpu's. */
        const double th = (double)p * pow((double)freq_base, -2.0 * j / n_rot);
        cs = (float)cos(th);
        sn = (float)sin(th);
#else
        const float th = (float)p * pow(freq_base, -2.0f * j / (float)n_rot);
        cs = cos(th);
        sn = sin(th);
#endif
    } else {
        i0 = n_rot + (j - half_rot);
    }

    if (i1 >= 0) {
        global float *qt = AT(float, q, q_off) + (ulong)t * n_head * hd;
        for (int h = 0; h < n_head; h++) {
            global float *x = qt + h * hd;
            const float x0 = x[i0], x1 = x[i1];
            x[i0] = x0 * cs - x1 * sn;
            x[i1] = x0 * sn + x1 * cs;
        }
    }
    global float *kt = AT(float, k, k_off) + (ulong)t * n_head_kv * hd;
    global const float *vt = AT_CONST(float, v, v_off) + (ulong)t * n_head_kv * hd;
    for (int h = 0; h < n_head_kv; h++) {
        global float *x = kt + h * hd;
        const ulong dst = slot + (ulong)h * hd;
        if (i1 >= 0) {
            const float x0 = x[i0], x1 = x[i1];
            const float y0 = x0 * cs - x1 * sn, y1 = x0 * sn + x1 * cs;
            x[i0] = y0;
            x[i1] = y1;
            kv_store(kc, kc_off, dst + i0, y0);
            kv_store(kc, kc_off, dst + i1, y1);
            kv_store(vc, vc_off, dst + i1, vt[h * hd + i1]);
        } else {
            kv_store(kc, kc_off, dst + i0, x[i0]);
        }
        kv_store(vc, vc_off, dst + i0, vt[h * hd + i0]);
    }
}
