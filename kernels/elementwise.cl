/* elementwise.cl — SWIGLU, ADD, GATHER_ROWS, and the bias add that follows
 * a CLBlast GEMM. One work-item per element: CPU compilers vectorise
 * across work-items, GPUs coalesce. out may alias an input (same index). */

kernel void swiglu(gbytes g, ulong g_off, gbytes u, ulong u_off, global uchar *out, ulong out_off, ulong n) {
    const ulong i = get_global_id(0);
    if (i >= n) return;
    const float gv = AT_CONST(float, g, g_off)[i];
    AT(float, out, out_off)[i] = gv / (1.0f + exp(-gv)) * AT_CONST(float, u, u_off)[i];
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
