/* argmax.cl — ARGMAX: out[t] = argmax_j x[t][j] as i32; the lowest index
 * wins ties and NaN never wins (an all-NaN row gives 0), as on the cpu
 * backend. One work-group of NORM_WG work-items per row. */
#ifndef NORM_WG
#define NORM_WG 16
#endif

/* Whether candidate (v2, i2) beats (v, i); index -1 = nothing yet. */
inline bool better(float v2, int i2, float v, int i) {
    return i2 >= 0 && (i < 0 || v2 > v || (v2 == v && i2 < i));
}

kernel void argmax(gbytes x, ulong x_off, global uchar *out, ulong out_off, int dim) {
    local float sv[NORM_WG];
    local int si[NORM_WG];
    const int lid = get_local_id(0);
    const ulong t = get_global_id(1);
    global const float *xr = AT_CONST(float, x, x_off) + t * dim;
    float bv = -INFINITY;
    int bi = -1;
    for (int j = lid; j < dim; j += NORM_WG) {
        const float v = xr[j];
        if (v > bv || (bi < 0 && v == bv)) {
            bv = v;
            bi = j;
        }
    }
    sv[lid] = bv;
    si[lid] = bi;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int o = NORM_WG / 2; o > 0; o >>= 1) {
        if (lid < o && better(sv[lid + o], si[lid + o], sv[lid], si[lid])) {
            sv[lid] = sv[lid + o];
            si[lid] = si[lid + o];
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    if (lid == 0) AT(int, out, out_off)[t] = max(si[0], 0);
}
