/* rope_kv.cl — ROPE_KV: rotate q and k in place at each token's position,
 * then store k and v into the paged KV pools (KV_TYPE f32, f16 or q8_0) at
 * the token's (sequence, position) row. theta_i = pos * freqs[i] (the
 * host's table of inverse frequencies, every scaling folded in) on pairs
 * (2i, 2i+1), or (i, i + n_rot/2) when neox, cos and sin scaled by mscale;
 * dims past n_rot stay as they are.
 *
 * One work-group of ROPE_WG work-items per token, NDRange (ROPE_WG,
 * n_tokens): the angles are computed once per token into local memory,
 * then the work-items walk (head, pair) for q and k, then the stores. A
 * q8_0 row is quantised per 32-value block from the rotated f32 values the
 * op also leaves in k, one block per work-item; the global barrier between
 * the rotation and the stores makes the rotated k visible to the whole
 * work-group.
 *
 * A token whose slot is outside the table (p < 0, p >= max_blocks * bs, s
 * outside [0, n_seqs); the host validates positions, this only keeps the
 * device inside its buffers) is left alone. Block indices from the table
 * are clamped into [0, n_blocks). */
#ifndef KV_TYPE
#define KV_TYPE DT_F32
#endif
#ifndef ROPE_WG
#define ROPE_WG 64
#endif
#ifndef ROPE_HALF_MAX
#define ROPE_HALF_MAX 128 /* largest n_rot / 2 */
#endif

#if KV_TYPE != DT_Q8_0
inline void kv_store(global uchar *pool, ulong off, ulong idx, float v) {
#if KV_TYPE == DT_F16
    vstore_half_rte(v, idx, AT(half, pool, off));
#else
    AT(float, pool, off)[idx] = v;
#endif
}
#endif

kernel void rope_kv(global uchar *q, ulong q_off, global uchar *k, ulong k_off, gbytes v, ulong v_off, gbytes pos,
                    ulong pos_off, gbytes seq, ulong seq_off, global uchar *kp, ulong kp_off, global uchar *vp,
                    ulong vp_off, gbytes tab, ulong tab_off, gbytes freqs, ulong freqs_off, int n_head,
                    int n_head_kv, int hd, int n_rot, float mscale, int neox, int bs, int n_blocks, int n_seqs,
                    int max_blocks) {
    local float cs[ROPE_HALF_MAX], sn[ROPE_HALF_MAX];
    const int lid = get_local_id(0), t = get_group_id(1);
    const int half_rot = n_rot / 2;
    const int p = AT_CONST(int, pos, pos_off)[t], s = AT_CONST(int, seq, seq_off)[t];
    /* Uniform; no early return (PoCL miscompiles a return followed by
     * barriers): an invalid token runs through the barriers idle. */
    const bool valid = p >= 0 && s >= 0 && s < n_seqs && p / bs < max_blocks;
    const int half_work = valid ? half_rot : 0;

    for (int j = lid; j < half_work; j += ROPE_WG) {
        const float f = AT_CONST(float, freqs, freqs_off)[j];
#ifdef HAVE_FP64
        /* Angles reach pos radians: double keeps them as exact as the cpu's. */
        const double th = (double)p * (double)f;
        cs[j] = (float)(cos(th) * mscale);
        sn[j] = (float)(sin(th) * mscale);
#else
        const float th = (float)p * f;
        cs[j] = cos(th) * mscale;
        sn[j] = sin(th) * mscale;
#endif
    }
    barrier(CLK_LOCAL_MEM_FENCE);

    /* q and k heads as one list: (head, pair) work items. */
    const int n_rows = n_head + n_head_kv;
    for (int e = lid; e < n_rows * half_work; e += ROPE_WG) {
        int h, j;
        DIVMOD(e, half_rot, h, j);
        global float *x = h < n_head ? AT(float, q, q_off) + ((ulong)t * n_head + h) * hd
                                     : AT(float, k, k_off) + ((ulong)t * n_head_kv + (h - n_head)) * hd;
        const int i0 = neox ? j : 2 * j, i1 = neox ? j + half_rot : 2 * j + 1;
        const float x0 = x[i0], x1 = x[i1];
        x[i0] = x0 * cs[j] - x1 * sn[j];
        x[i1] = x0 * sn[j] + x1 * cs[j];
    }
    barrier(CLK_GLOBAL_MEM_FENCE); /* the rotated k is read back below */
    if (!valid) return;

    const int kvw = n_head_kv * hd;
    const ulong row = kv_row(AT_CONST(int, tab, tab_off), s, p, bs, n_blocks, max_blocks);
    global const float *kt = AT_CONST(float, k, k_off) + (ulong)t * kvw;
    global const float *vt = AT_CONST(float, v, v_off) + (ulong)t * kvw;
#if KV_TYPE == DT_Q8_0
    /* kvw % 32 == 0 (head_dim % 32 == 0): blocks never straddle heads. */
    const int nb = kvw / QK8_0;
    global uchar *kd = kp + kp_off + row * nb * Q8_0_BYTES;
    global uchar *vd = vp + vp_off + row * nb * Q8_0_BYTES;
    for (int b = lid; b < 2 * nb; b += ROPE_WG) {
        const bool is_k = b < nb;
        const int bb = is_k ? b : b - nb;
        global const float *src = (is_k ? kt : vt) + bb * QK8_0;
        q8_store_block((is_k ? kd : vd) + (ulong)bb * Q8_0_BYTES, vload8(0, src), vload8(1, src), vload8(2, src),
                       vload8(3, src));
    }
#else
    const ulong dst = row * kvw;
    for (int i = lid; i < kvw; i += ROPE_WG) {
        kv_store(kp, kp_off, dst + i, kt[i]);
        kv_store(vp, vp_off, dst + i, vt[i]);
    }
#endif
}
