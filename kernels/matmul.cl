/* matmul.cl — MATMUL: out[t][o] = sum_i W[o][i] x[t][i] (+ bias[o]) (+ out[t][o]).
 *
 * W is row-major [n_out][n_in] in WTYPE (f32, f16, bf16 or q8_0 blocks),
 * x and out are f32. One source for decode (one token) and prefill (many):
 *
 *   - MV_R work-items share one dot product (1 on CPUs; a warp or wave on
 *     GPUs, reduced through local memory at the end);
 *   - each work-item computes MV_NR rows x MV_MT tokens, so every weight
 *     vector it loads is used MV_MT times and every x vector MV_NR times;
 *   - the inner loop walks 32-element chunks (one q8_0 block) as vectors of
 *     MV_VW floats: explicit vectors that a CPU compiler (PoCL) maps onto
 *     SIMD registers, and that GPUs split into scalars;
 *   - q8_0 with MV_QG = 8 converts the fp16 scales of 8 consecutive blocks
 *     at once with vector integer ops: a CPU without half conversion
 *     instructions in OpenCL (PoCL) otherwise spends most of its time in a
 *     scalar vload_half per block. GPUs keep MV_QG = 1 (one block per lane).
 *
 * NDRange: dim 0 = MV_R x ceil(n_out / MV_NR) row groups (rounded up to the
 * work-group size MV_WG), dim 1 = ceil(n_tokens / MV_MT). Work-items past
 * the edge clamp their reads and skip their writes, so ragged sizes need no
 * padding. flags: bit 0 = add bias, bit 1 = accumulate into out. */

#ifndef WTYPE
#define WTYPE DT_F32
#endif
#ifndef MV_R
#define MV_R 1
#endif
#ifndef MV_NR
#define MV_NR 2
#endif
#ifndef MV_VW
#define MV_VW 16
#endif
#ifndef MV_WG
#define MV_WG 8
#endif
#ifndef MV_MT
#define MV_MT 1
#endif
#ifndef MV_QG
#define MV_QG 1
#endif
#if MV_QG != 1 && MV_QG != 8
#error "matmul.cl: MV_QG must be 1 or 8"
#endif

#define FV CAT(float, MV_VW)
#define NV (QK8_0 / MV_VW) /* vectors per 32-element chunk */
#define VLOAD CAT(vload, MV_VW)
#define VLOAD_HALF CAT(vload_half, MV_VW)
#define CONVERT_FV CAT(convert_float, MV_VW)
#define CONVERT_UV CAT(convert_uint, MV_VW)
#define AS_FV CAT(as_float, MV_VW)

/* Vector v of chunk c of a weight row, as f32 (q8_0: before its scale). */
inline FV load_w(gbytes row, int c, int v) {
#if WTYPE == DT_F32
    return VLOAD(c * NV + v, (global const float *)row);
#elif WTYPE == DT_F16
#ifdef HAVE_FP16
    return CONVERT_FV(VLOAD(c * NV + v, (global const half *)row));
#else
    return VLOAD_HALF(c * NV + v, (global const half *)row);
#endif
#elif WTYPE == DT_BF16
    return AS_FV(CONVERT_UV(VLOAD(c * NV + v, (global const ushort *)row)) << 16);
#elif WTYPE == DT_Q8_0
    return CONVERT_FV(VLOAD(v, (global const char *)(row + (ulong)c * Q8_0_BYTES + 2)));
#else
#error "matmul.cl: unknown WTYPE"
#endif
}

/* Exact fp16 -> f32 of eight raw halves (zeros, subnormals, inf, NaN too). */
inline float8 half8_to_float8(ushort8 h) {
    const uint8 u = convert_uint8(h);
    const uint8 ex = u & 0x7c00u, man = u & 0x3ffu;
    const float8 normal = as_float8(((u & 0x7fffu) << 13) + 0x38000000u); /* rebias 15 -> 127 */
    const float8 sub = convert_float8(man) * 0x1.0p-24f;
    const float8 infnan = as_float8((man << 13) | 0x7f800000u);
    float8 f = select(normal, sub, ex == (uint8)(0u));
    f = select(f, infnan, ex == (uint8)(0x7c00u));
    return as_float8(as_uint8(f) | ((u & 0x8000u) << 16));
}

/* The scales of blocks c0 .. c0 + 7 of a q8_0 row. */
inline float8 q8_scales8(gbytes row, int c0) {
    global const ushort *s = (global const ushort *)(row + (ulong)c0 * Q8_0_BYTES);
    const int k = Q8_0_BYTES / 2; /* block stride in ushorts */
    return half8_to_float8((ushort8)(s[0], s[k], s[2 * k], s[3 * k], s[4 * k], s[5 * k], s[6 * k], s[7 * k]));
}

inline float chunk_scale(gbytes row, int c) {
#if WTYPE == DT_Q8_0
    return vload_half(0, (global const half *)(row + (ulong)c * Q8_0_BYTES));
#else
    return 1.0f;
#endif
}

/* Sum of a vector's lanes, through private memory: Oclgrind's
 * uninitialised-value checker mistracks lane shuffles (.lo/.hi/.s0123) and
 * would report (or crash on) correct code. Once per row: cost negligible. */
inline float hsum(FV v) {
    float lanes[MV_VW];
    CAT(vstore, MV_VW)(v, 0, lanes);
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < MV_VW; i++) s += lanes[i];
    return s;
}

kernel void matmul(gbytes w, ulong w_off, gbytes x, ulong x_off, gbytes bias, ulong bias_off, global uchar *out,
                   ulong out_off, int n_in, int n_out, int n_tokens, int flags) {
    const int lane = get_local_id(0) % MV_R;
    const int r0 = (int)(get_global_id(0) / MV_R) * MV_NR;
    const int t0 = (int)get_global_id(1) * MV_MT;
    const ulong rb = row_bytes(WTYPE, n_in);

    gbytes wrow[MV_NR];
#pragma unroll
    for (int r = 0; r < MV_NR; r++) wrow[r] = w + w_off + (ulong)min(r0 + r, n_out - 1) * rb;
    global const float *xs[MV_MT];
#pragma unroll
    for (int t = 0; t < MV_MT; t++) xs[t] = AT_CONST(float, x, x_off) + (ulong)min(t0 + t, n_tokens - 1) * n_in;

    FV acc[MV_NR][MV_MT];
#pragma unroll
    for (int r = 0; r < MV_NR; r++)
#pragma unroll
        for (int t = 0; t < MV_MT; t++) acc[r][t] = (FV)(0.0f);

/* acc[r][t] += W[row r][chunk c] . x[token t][chunk c], row r scaled by d[r]. */
#if WTYPE == DT_Q8_0
#define MV_WEIGHT(r, c, v, d) (load_w(wrow[r], c, v) * d[r])
#else
#define MV_WEIGHT(r, c, v, d) load_w(wrow[r], c, v)
#endif
#define MV_CHUNK(c, d)                                                                  \
    do {                                                                                \
        _Pragma("unroll") for (int v = 0; v < NV; v++) {                                \
            FV xv[MV_MT];                                                               \
            _Pragma("unroll") for (int t = 0; t < MV_MT; t++) xv[t] = VLOAD((c) * NV + v, xs[t]); \
            _Pragma("unroll") for (int r = 0; r < MV_NR; r++) {                         \
                const FV wv = MV_WEIGHT(r, c, v, d);                                    \
                _Pragma("unroll") for (int t = 0; t < MV_MT; t++) acc[r][t] = fma(wv, xv[t], acc[r][t]); \
            }                                                                           \
        }                                                                               \
    } while (0)

    const int nc = n_in / QK8_0;
    int c_first = 0; /* first chunk of the one-chunk-at-a-time loop */
#if WTYPE == DT_Q8_0 && MV_QG == 8
    const int ng = nc / 8;
    for (int g = lane; g < ng; g += MV_R) {
        float ds[MV_NR][8];
#pragma unroll
        for (int r = 0; r < MV_NR; r++) vstore8(q8_scales8(wrow[r], g * 8), 0, ds[r]);
#pragma unroll
        for (int b = 0; b < 8; b++) {
            float d[MV_NR];
#pragma unroll
            for (int r = 0; r < MV_NR; r++) d[r] = ds[r][b];
            MV_CHUNK(g * 8 + b, d);
        }
    }
    c_first = ng * 8;
#endif
    for (int c = c_first + lane; c < nc; c += MV_R) {
        float d[MV_NR];
#pragma unroll
        for (int r = 0; r < MV_NR; r++) d[r] = chunk_scale(wrow[r], c);
        MV_CHUNK(c, d);
    }

    float res[MV_NR][MV_MT];
#pragma unroll
    for (int r = 0; r < MV_NR; r++)
#pragma unroll
        for (int t = 0; t < MV_MT; t++) res[r][t] = hsum(acc[r][t]);

#if WTYPE != DT_Q8_0
    /* Float weights allow any n_in: the last n_in % 32 columns one by one. */
    for (int i = nc * QK8_0 + lane; i < n_in; i += MV_R)
#pragma unroll
        for (int r = 0; r < MV_NR; r++) {
            float wi = load_elem(WTYPE, wrow[r], i);
#pragma unroll
            for (int t = 0; t < MV_MT; t++) res[r][t] = fma(wi, xs[t][i], res[r][t]);
        }
#endif

#if MV_R > 1
    /* Sum the MV_R partial dot products of each row group (a segment of the
     * work-group); lane 0 of the segment writes. */
    local float red[MV_WG];
    const int lid = get_local_id(0);
#pragma unroll
    for (int r = 0; r < MV_NR; r++)
#pragma unroll
        for (int t = 0; t < MV_MT; t++) {
            red[lid] = res[r][t];
            barrier(CLK_LOCAL_MEM_FENCE);
            for (int o = MV_R / 2; o > 0; o >>= 1) {
                if (lane < o) red[lid] += red[lid + o];
                barrier(CLK_LOCAL_MEM_FENCE);
            }
            res[r][t] = red[lid - lane];
            barrier(CLK_LOCAL_MEM_FENCE);
        }
    if (lane != 0) return;
#endif

#pragma unroll
    for (int r = 0; r < MV_NR; r++) {
        const int o = r0 + r;
        if (o >= n_out) break;
        const float b = (flags & 1) ? AT_CONST(float, bias, bias_off)[o] : 0.0f;
#pragma unroll
        for (int t = 0; t < MV_MT; t++) {
            if (t0 + t >= n_tokens) break;
            global float *dst = AT(float, out, out_off) + (ulong)(t0 + t) * n_out + o;
            float v = res[r][t] + b;
            if (flags & 2) v += *dst;
            *dst = v;
        }
    }
}

/* f32 copy of weight rows [r0, r0 + n_rows) for CLBlast's SGEMM (F16
 * weights on devices without half arithmetic). NDRange (n_in, n_rows). */
kernel void dequantize_rows(gbytes w, ulong w_off, int n_in, int r0, int n_rows, global float *out) {
    const int i = get_global_id(0), r = get_global_id(1);
    if (i >= n_in || r >= n_rows) return;
    gbytes row = w + w_off + (ulong)(r0 + r) * row_bytes(WTYPE, n_in);
    out[(ulong)r * n_in + i] = load_elem(WTYPE, row, i);
}
