/* rmsnorm.cl — RMSNORM: out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w.
 * One work-group of NORM_WG work-items per row, NDRange (NORM_WG, n_tokens).
 * out may be x: each work-item reads and writes the same elements. */
#ifndef NORM_WG
#define NORM_WG 16
#endif

kernel void rmsnorm(gbytes x, ulong x_off, gbytes w, ulong w_off, global uchar *out, ulong out_off, int dim,
                    float eps) {
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
    for (int i = lid; i < dim; i += NORM_WG) yr[i] = xr[i] * scale * wr[i];
}
