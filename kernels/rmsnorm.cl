/* rmsnorm.cl — RMSNORM: y[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w, written
 * to out (f32) and/or out_q8 (q8_0 blocks quantised from the same f32
 * values, fused so no later pass reads y back).
 *
 * One work-group of NORM_WG work-items per row, NDRange (NORM_WG, n_tokens).
 * The sum of squares walks the row with a stride of NORM_WG (coalesced on
 * GPUs). The output pass is element-strided the same way when only f32 is
 * written; with q8 each work-item owns whole 32-value blocks (four float8
 * loads, a full 32-byte sector each on GPUs) so a block's amax needs no
 * cross-work-item reduction. out may be x: every work-item reads and writes
 * the same elements. flags: bit 0 = write out, bit 1 = write out_q8. */
#ifndef NORM_WG
#define NORM_WG 16
#endif

kernel void rmsnorm(gbytes x, ulong x_off, gbytes w, ulong w_off, global uchar *out, ulong out_off,
                    global uchar *oq, ulong oq_off, int dim, float eps, int flags) {
    local float scratch[NORM_WG];
    const int lid = get_local_id(0);
    const ulong t = get_global_id(1);
    global const float *xr = AT_CONST(float, x, x_off) + t * dim;
    global const float *wr = AT_CONST(float, w, w_off);
    global float *yr = AT(float, out, out_off) + t * dim;
    float acc = 0.0f;
    for (int i = lid; i < dim; i += NORM_WG) acc = fma(xr[i], xr[i], acc);
    const float ss = group_sum(acc, scratch, lid, NORM_WG);
    const float scale = 1.0f / sqrt(ss / (float)dim + eps);
    if (!(flags & 2)) {
        for (int i = lid; i < dim; i += NORM_WG) yr[i] = xr[i] * scale * wr[i];
        return;
    }
    const int nb = dim / QK8_0;
    global uchar *qr = AT(uchar, oq, oq_off) + t * (ulong)nb * Q8_0_BYTES;
    for (int b = lid; b < nb; b += NORM_WG) {
        float8 y[4];
#pragma unroll
        for (int v = 0; v < 4; v++) {
            y[v] = vload8(4 * b + v, xr) * scale * vload8(4 * b + v, wr);
            if (flags & 1) vstore8(y[v], 4 * b + v, yr);
        }
        q8_store_block(qr + (ulong)b * Q8_0_BYTES, y[0], y[1], y[2], y[3]);
    }
}
