/* elementwise.cl — SWIGLU, ADD, GATHER_ROWS, the bias add that follows a
 * CLBlast GEMM, and the q8_0 quantisation of f32 rows. One work-item per
 * element: CPU compilers vectorise across work-items, GPUs coalesce. out
 * may alias an input (same index). */

inline float silu_mul(float g, float u) { return g / (1.0f + exp(-g)) * u; }

kernel void swiglu(gbytes g, ulong g_off, gbytes u, ulong u_off, global uchar *out, ulong out_off, ulong n) {
    const ulong i = get_global_id(0);
    if (i >= n) return;
    AT(float, out, out_off)[i] = silu_mul(AT_CONST(float, g, g_off)[i], AT_CONST(float, u, u_off)[i]);
}

inline float8 silu_mul8(float8 g, float8 u) { return g / (1.0f + exp(-g)) * u; }

/* SWIGLU with a q8_0 output (and optionally the f32 one too, flags bit 0):
 * one work-item per 32-value block, so the block's amax is its own.
 * n_blocks = n_tokens * dim / 32 (rows are whole blocks). */
kernel void swiglu_q8(gbytes g, ulong g_off, gbytes u, ulong u_off, global uchar *out, ulong out_off,
                      global uchar *oq, ulong oq_off, ulong n_blocks, int flags) {
    const ulong b = get_global_id(0);
    if (b >= n_blocks) return;
    global const float *gb = AT_CONST(float, g, g_off) + b * QK8_0;
    global const float *ub = AT_CONST(float, u, u_off) + b * QK8_0;
    global float *ob = AT(float, out, out_off) + b * QK8_0;
    float8 y[4];
#pragma unroll
    for (int v = 0; v < 4; v++) {
        y[v] = silu_mul8(vload8(v, gb), vload8(v, ub));
        if (flags & 1) vstore8(y[v], v, ob);
    }
    q8_store_block(AT(uchar, oq, oq_off) + b * Q8_0_BYTES, y[0], y[1], y[2], y[3]);
}

kernel void add(gbytes a, ulong a_off, gbytes b, ulong b_off, global uchar *out, ulong out_off, ulong n) {
    const ulong i = get_global_id(0);
    if (i >= n) return;
    AT(float, out, out_off)[i] = AT_CONST(float, a, a_off)[i] + AT_CONST(float, b, b_off)[i];
}

/* out[t][:] = x[rows[t]][:]; a row outside x's n_rows gives zeros.
 * NDRange (dim, n_tokens). */
kernel void gather_rows(gbytes x, ulong x_off, ulong n_rows, gbytes rows, ulong rows_off, global uchar *out,
                        ulong out_off, int dim) {
    const int i = get_global_id(0), t = get_global_id(1);
    if (i >= dim) return;
    const int r = AT_CONST(int, rows, rows_off)[t];
    float v = 0.0f;
    if (r >= 0 && (ulong)r < n_rows) v = AT_CONST(float, x, x_off)[(ulong)r * dim + i];
    AT(float, out, out_off)[(ulong)t * dim + i] = v;
}

/* out[t][o] += bias[o]. NDRange (n_out, n_tokens). */
kernel void bias_add(gbytes bias, ulong bias_off, global uchar *out, ulong out_off, int n_out) {
    const int o = get_global_id(0), t = get_global_id(1);
    if (o >= n_out) return;
    AT(float, out, out_off)[(ulong)t * n_out + o] += AT_CONST(float, bias, bias_off)[o];
}

/* q8_0 blocks of f32 rows (attention's q8 output when a head is not a
 * whole number of blocks). One work-item per block. */
kernel void quantize_q8(gbytes x, ulong x_off, global uchar *oq, ulong oq_off, ulong n_blocks) {
    const ulong b = get_global_id(0);
    if (b >= n_blocks) return;
    global const float *xb = AT_CONST(float, x, x_off) + b * QK8_0;
    q8_store_block(AT(uchar, oq, oq_off) + b * Q8_0_BYTES, vload8(0, xb), vload8(1, xb), vload8(2, xb),
                   vload8(3, xb));
}
