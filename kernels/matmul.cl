/* matmul.cl — MATMUL: out[t][o] = sum_i W[o][i] x[t][i] (+ bias[o]) (+ out[t][o]).
 *
 * W is row-major [n_out][n_in] in WTYPE (f32, f16, bf16 or q8_0 blocks;
 * the other block types have their own kernels at the end), x and out are
 * f32. One source for decode (one token) and prefill (many):
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

#if !DT_IS_BLK(WTYPE)
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
#endif

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

/* Eight fp16 values k ushorts apart from p, as f32. */
inline float8 halves8(gbytes p, int k) {
    global const ushort *s = (global const ushort *)p;
    return half8_to_float8((ushort8)(s[0], s[k], s[2 * k], s[3 * k], s[4 * k], s[5 * k], s[6 * k], s[7 * k]));
}

/* The scales of blocks c0 .. c0 + 7 of a q8_0 row. */
inline float8 q8_scales8(gbytes row, int c0) { return halves8(row + (ulong)c0 * Q8_0_BYTES, Q8_0_BYTES / 2); }

inline float chunk_scale(gbytes row, int c) {
#if WTYPE == DT_Q8_0
    return load_half(row + (ulong)c * Q8_0_BYTES);
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

/* Sums the MV_R partial dot products of each row group (a segment of the
 * work-group; lane 0 of the segment holds the total), then writes
 * out[t0 + t][r0 + r] (+ bias) (+ out) for the first mt (<= MV_MT) tokens.
 * Every work-item calls it. */
inline void mv_store(float (*res)[MV_MT], local float *red, int lane, int r0, int t0, int n_out, int n_tokens,
                     gbytes bias, ulong bias_off, global uchar *out, ulong out_off, int flags, const int mt) {
#if MV_R > 1
    const int lid = get_local_id(0);
#pragma unroll
    for (int r = 0; r < MV_NR; r++)
#pragma unroll
        for (int t = 0; t < MV_MT; t++) {
            if (t >= mt) continue;
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
            if (t >= mt || t0 + t >= n_tokens) break;
            global float *dst = AT(float, out, out_off) + (ulong)(t0 + t) * n_out + o;
            float v = res[r][t] + b;
            if (flags & 2) v += *dst;
            *dst = v;
        }
    }
}

#if !DT_IS_BLK(WTYPE)
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
    local float red[MV_WG];
#else
    local float *red = 0;
#endif
    mv_store(res, red, lane, r0, t0, n_out, n_tokens, bias, bias_off, out, out_off, flags, MV_MT);
}

/* f32 copy of weight rows [r0, r0 + n_rows) for CLBlast's SGEMM (F16
 * weights on devices without half arithmetic). NDRange (n_in, n_rows). */
kernel void dequantize_rows(gbytes w, ulong w_off, int n_in, int r0, int n_rows, global float *out) {
    const int i = get_global_id(0), r = get_global_id(1);
    if (i >= n_in || r >= n_rows) return;
    gbytes row = w + w_off + (ulong)(r0 + r) * row_bytes(WTYPE, n_in);
    out[(ulong)r * n_in + i] = load_elem(WTYPE, row, i);
}
#endif /* !DT_IS_BLK(WTYPE) */

/* ---- Q8_0 weights x q8_0 activations: int8 dot products ----------------------
 *
 * out[t][o] = sum over blocks b of d_w[o][b] * d_x[t][b] * sum_i qw[o][32b+i] * qx[t][32b+i]
 *
 * Built when the host passes -DMQ_KERNELS (with WTYPE = q8_0). INT_DOT picks
 * the 32-value dot product:
 *   1  cl_khr_integer_dot_product, packed: dot_acc_sat_4x8packed_ss_int
 *      on the block's eight 32-bit words (one DP4A-class instruction each);
 *   2  the same extension with char4 operands (devices that only report
 *      the unpacked 4x8-bit capability): dot_acc_sat(char4, char4, int);
 *   0  portable: the bytes widened to int and multiplied (char16 -> int16:
 *      SIMD multiply-adds on CPUs, scalar mad on GPUs).
 * The 32 products of one block never overflow an int (32 * 128 * 128), so
 * saturation never triggers and every path gives the same integers.
 * OCL_DOT_EMULATE (tests only) defines the extension's built-ins in plain
 * OpenCL C so the INT_DOT code runs on a device without it.
 *
 * Block bytes sit at 2 mod 4 (34-byte blocks), so the words are read as
 * ushort pairs (2-byte aligned loads). */
#if (defined(MQ_KERNELS) && WTYPE == DT_Q8_0) || DT_IS_BLK(WTYPE)
#ifndef INT_DOT
#define INT_DOT 0
#endif
#ifndef MT_BN
#define MT_BN 64 /* tiled GEMM: weight rows and tokens per work-group tile */
#endif
#ifndef MT_TR
#define MT_TR 4 /* tiled GEMM: rows and tokens per work-item (MT_TR x MT_TR outputs) */
#endif
#define MT_KB 2 /* tiled GEMM: q8_0 blocks per K step */
#ifndef MQ_SHORT
#define MQ_SHORT 1
#endif
#if MQ_SHORT
/* |w x| <= 128 * 127 (activations are clamped to +-127), so the sum of
 * two products fits a short: 16-bit multiplies, half the register width. */
#define MQ_XT short16
#define MQ_CONV convert_short16
#else
#define MQ_XT int16
#define MQ_CONV convert_int16
#endif

#if INT_DOT != 0
#ifdef OCL_DOT_EMULATE
inline int dot_acc_sat(char4 a, char4 b, int acc) {
    long s = (long)acc + (int)a.x * b.x + (int)a.y * b.y + (int)a.z * b.z + (int)a.w * b.w;
    return (int)clamp(s, (long)INT_MIN, (long)INT_MAX);
}
inline int dot_acc_sat_4x8packed_ss_int(uint a, uint b, int acc) { return dot_acc_sat(as_char4(a), as_char4(b), acc); }
#else
#pragma OPENCL EXTENSION cl_khr_integer_dot_product : enable
#endif
inline int dot4(uint a, uint b, int acc) {
#if INT_DOT == 1
    return dot_acc_sat_4x8packed_ss_int(a, b, acc);
#else
    return dot_acc_sat(as_char4(a), as_char4(b), acc);
#endif
}
#else
/* Portable 4 x int8 dot product of two packed words (GPUs without the
 * extension): sign-extend each byte with shifts, multiply-add. */
inline int dot4(uint a, uint b, int acc) {
    const int ia = (int)a, ib = (int)b;
    acc = mad24((ia << 24) >> 24, (ib << 24) >> 24, acc);
    acc = mad24((ia << 16) >> 24, (ib << 16) >> 24, acc);
    acc = mad24((ia << 8) >> 24, (ib << 8) >> 24, acc);
    return mad24(ia >> 24, ib >> 24, acc);
}
#endif
#endif /* int8 dot products */

#if defined(MQ_KERNELS) && WTYPE == DT_Q8_0

/* Word i (0..7) of a q8_0 block's 32 quants. */
inline uint q8_word(gbytes blk, int i) {
    global const ushort *h = (global const ushort *)(blk + 2);
    return (uint)h[2 * i] | ((uint)h[2 * i + 1] << 16);
}

inline float q8_d(gbytes blk) { return load_half(blk); }

/* Decode GEMV and small-batch GEMM: the work split of `matmul` above (MV_R
 * lanes per row group, MV_NR rows x MV_MT tokens per work-item), one
 * q8_0 block per step. Every weight byte is read once per MV_MT tokens.
 * NDRange as for `matmul`. */
kernel void matmul_q8_0_q8_0(gbytes w, ulong w_off, gbytes x, ulong x_off, gbytes bias, ulong bias_off,
                             global uchar *out, ulong out_off, int n_in, int n_out, int n_tokens, int flags) {
    const int lane = get_local_id(0) % MV_R;
    const int r0 = (int)(get_global_id(0) / MV_R) * MV_NR;
    const int t0 = (int)get_global_id(1) * MV_MT;
    const int nb = n_in / QK8_0;
    const ulong rb = (ulong)nb * Q8_0_BYTES;
    gbytes wrow[MV_NR], xrow[MV_MT];
#pragma unroll
    for (int r = 0; r < MV_NR; r++) wrow[r] = w + w_off + (ulong)min(r0 + r, n_out - 1) * rb;
#pragma unroll
    for (int t = 0; t < MV_MT; t++) xrow[t] = x + x_off + (ulong)min(t0 + t, n_tokens - 1) * rb;

#if INT_DOT == 0 && MV_R == 1
    /* CPUs: vector products of a block's 32 int8 pairs, scaled into
     * float16 accumulators that are summed across lanes once at the end.
     * The fp16 scales of 8 consecutive blocks convert together with
     * integer ops (q8_scales8): a scalar vload_half per block costs more
     * than the block's products on CPUs without half instructions. */
    float16 acc[MV_NR][MV_MT];
#pragma unroll
    for (int r = 0; r < MV_NR; r++)
#pragma unroll
        for (int t = 0; t < MV_MT; t++) acc[r][t] = (float16)(0.0f);
    for (int b0 = 0; b0 < nb; b0 += 8) {
        float dw[MV_NR][8], dx[MV_MT][8];
        const int nblk = min(8, nb - b0);
        if (nblk == 8) {
#pragma unroll
            for (int r = 0; r < MV_NR; r++) vstore8(q8_scales8(wrow[r], b0), 0, dw[r]);
#pragma unroll
            for (int t = 0; t < MV_MT; t++) vstore8(q8_scales8(xrow[t], b0), 0, dx[t]);
        } else {
            for (int i = 0; i < nblk; i++) {
#pragma unroll
                for (int r = 0; r < MV_NR; r++) dw[r][i] = q8_d(wrow[r] + (ulong)(b0 + i) * Q8_0_BYTES);
#pragma unroll
                for (int t = 0; t < MV_MT; t++) dx[t][i] = q8_d(xrow[t] + (ulong)(b0 + i) * Q8_0_BYTES);
            }
        }
        for (int i = 0; i < nblk; i++) {
            const ulong bo = (ulong)(b0 + i) * Q8_0_BYTES + 2;
            MQ_XT xa[MV_MT], xb[MV_MT];
#pragma unroll
            for (int t = 0; t < MV_MT; t++) {
                xa[t] = MQ_CONV(vload16(0, (global const char *)(xrow[t] + bo)));
                xb[t] = MQ_CONV(vload16(1, (global const char *)(xrow[t] + bo)));
            }
#pragma unroll
            for (int r = 0; r < MV_NR; r++) {
                const MQ_XT wa = MQ_CONV(vload16(0, (global const char *)(wrow[r] + bo)));
                const MQ_XT wb = MQ_CONV(vload16(1, (global const char *)(wrow[r] + bo)));
#pragma unroll
                for (int t = 0; t < MV_MT; t++)
                    acc[r][t] = fma(convert_float16(wa * xa[t] + wb * xb[t]), (float16)(dw[r][i] * dx[t][i]), acc[r][t]);
            }
        }
    }
    float res[MV_NR][MV_MT];
#pragma unroll
    for (int r = 0; r < MV_NR; r++)
#pragma unroll
        for (int t = 0; t < MV_MT; t++) {
            float l[16];
            vstore16(acc[r][t], 0, l);
            float s = 0.0f;
#pragma unroll
            for (int i = 0; i < 16; i++) s += l[i];
            res[r][t] = s;
        }
#else
    /* GPUs: lanes stride over blocks; eight word dot products per block. */
    float res[MV_NR][MV_MT];
#pragma unroll
    for (int r = 0; r < MV_NR; r++)
#pragma unroll
        for (int t = 0; t < MV_MT; t++) res[r][t] = 0.0f;
    for (int b = lane; b < nb; b += MV_R) {
        uint xw[MV_MT][8];
        float dx[MV_MT];
#pragma unroll
        for (int t = 0; t < MV_MT; t++) {
            gbytes blk = xrow[t] + (ulong)b * Q8_0_BYTES;
#pragma unroll
            for (int i = 0; i < 8; i++) xw[t][i] = q8_word(blk, i);
            dx[t] = q8_d(blk);
        }
#pragma unroll
        for (int r = 0; r < MV_NR; r++) {
            gbytes blk = wrow[r] + (ulong)b * Q8_0_BYTES;
            uint ww[8];
#pragma unroll
            for (int i = 0; i < 8; i++) ww[i] = q8_word(blk, i);
            const float dw = q8_d(blk);
#pragma unroll
            for (int t = 0; t < MV_MT; t++) {
                int s = 0;
#pragma unroll
                for (int i = 0; i < 8; i++) s = dot4(ww[i], xw[t][i], s);
                res[r][t] = fma((float)s, dw * dx[t], res[r][t]);
            }
        }
    }
#endif
#if MV_R > 1
    local float red[MV_WG];
#else
    local float *red = 0;
#endif
    mv_store(res, red, lane, r0, t0, n_out, n_tokens, bias, bias_off, out, out_off, flags, MV_MT);
}

/* Prefill GEMM: a work-group computes an MT_BN (weight rows) x MT_BN
 * (tokens) tile of out, MT_KB blocks of K at a time through local memory
 * (quants as 32-bit words, scales as floats; rows padded by one word so
 * work-items reading different rows hit different banks). Work-item
 * (tx, ty) owns rows tx + i * MT_TH and tokens ty + j * MT_TH: neighbours
 * read neighbouring rows and write neighbouring outputs.
 * NDRange (MT_TH * MT_TH * ceil(n_out / MT_BN), ceil(n_tokens / MT_BN)),
 * work-group (MT_TH * MT_TH, 1). */
#define MT_TH (MT_BN / MT_TR)
#define MT_WS (MT_KB * 8 + 1) /* words per local row */
kernel void matmul_q8_0_q8_0_tiled(gbytes w, ulong w_off, gbytes x, ulong x_off, gbytes bias, ulong bias_off,
                                   global uchar *out, ulong out_off, int n_in, int n_out, int n_tokens, int flags) {
    local uint wq[MT_BN * MT_WS], xq[MT_BN * MT_WS];
    local float wd[MT_BN * MT_KB], xd[MT_BN * MT_KB];
    const int lid = get_local_id(0);
    int tx, ty;
    DIVMOD(lid, MT_TH, ty, tx);
    const int row0 = (get_global_id(0) / (MT_TH * MT_TH)) * MT_BN, tok0 = get_global_id(1) * MT_BN;
    const int nb = n_in / QK8_0;
    const ulong rb = (ulong)nb * Q8_0_BYTES;

    float acc[MT_TR][MT_TR];
#pragma unroll
    for (int i = 0; i < MT_TR; i++)
#pragma unroll
        for (int j = 0; j < MT_TR; j++) acc[i][j] = 0.0f;

    for (int b0 = 0; b0 < nb; b0 += MT_KB) {
        /* Load: units of (row, block, word 0..7 or 8 = the scale). */
        for (int e = lid; e < MT_BN * MT_KB * 9; e += MT_TH * MT_TH) {
            int rr, rest, kb, u;
            DIVMOD(e, MT_KB * 9, rr, rest);
            DIVMOD(rest, 9, kb, u);
            const int b = b0 + kb;
            const bool in_k = b < nb;
            gbytes wb = w + w_off + (ulong)min(row0 + rr, n_out - 1) * rb + (ulong)min(b, nb - 1) * Q8_0_BYTES;
            gbytes xb = x + x_off + (ulong)min(tok0 + rr, n_tokens - 1) * rb + (ulong)min(b, nb - 1) * Q8_0_BYTES;
            if (u < 8) {
                wq[rr * MT_WS + kb * 8 + u] = in_k ? q8_word(wb, u) : 0u;
                xq[rr * MT_WS + kb * 8 + u] = in_k ? q8_word(xb, u) : 0u;
            } else {
                wd[rr * MT_KB + kb] = in_k ? q8_d(wb) : 0.0f;
                xd[rr * MT_KB + kb] = in_k ? q8_d(xb) : 0.0f;
            }
        }
        barrier(CLK_LOCAL_MEM_FENCE);
#pragma unroll
        for (int kb = 0; kb < MT_KB; kb++) {
            int s[MT_TR][MT_TR];
#pragma unroll
            for (int i = 0; i < MT_TR; i++)
#pragma unroll
                for (int j = 0; j < MT_TR; j++) s[i][j] = 0;
#pragma unroll
            for (int u = 0; u < 8; u++) {
                uint a[MT_TR], c[MT_TR];
#pragma unroll
                for (int i = 0; i < MT_TR; i++) a[i] = wq[(tx + i * MT_TH) * MT_WS + kb * 8 + u];
#pragma unroll
                for (int j = 0; j < MT_TR; j++) c[j] = xq[(ty + j * MT_TH) * MT_WS + kb * 8 + u];
#pragma unroll
                for (int i = 0; i < MT_TR; i++)
#pragma unroll
                    for (int j = 0; j < MT_TR; j++) s[i][j] = dot4(a[i], c[j], s[i][j]);
            }
#pragma unroll
            for (int i = 0; i < MT_TR; i++)
#pragma unroll
                for (int j = 0; j < MT_TR; j++)
                    acc[i][j] = fma((float)s[i][j], wd[(tx + i * MT_TH) * MT_KB + kb] * xd[(ty + j * MT_TH) * MT_KB + kb],
                                    acc[i][j]);
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }
#pragma unroll
    for (int i = 0; i < MT_TR; i++) {
        const int o = row0 + tx + i * MT_TH;
        if (o >= n_out) continue;
        const float bv = (flags & 1) ? AT_CONST(float, bias, bias_off)[o] : 0.0f;
#pragma unroll
        for (int j = 0; j < MT_TR; j++) {
            const int t = tok0 + ty + j * MT_TH;
            if (t >= n_tokens) continue;
            global float *dst = AT(float, out, out_off) + (ulong)t * n_out + o;
            float v = acc[i][j] + bv;
            if (flags & 2) v += *dst;
            *dst = v;
        }
    }
}
#endif /* MQ_KERNELS */

/* ---- the other block weight types (DT_IS_BLK) ---------------------------------
 *
 * Q4_0 .. IQ4_XS weights read 32 at a time as w = s * q - m (blk_chunk in
 * common.cl), decoded in registers; the work split of `matmul` (MV_R
 * lanes per row group striding over the blocks, MV_NR rows x mt tokens
 * per work-item). On CPUs a super-block's eight chunks are unrolled, so
 * their shifts and scale offsets are constants and its fp16 scales load
 * once. Four kernels in one program per type:
 *
 *   matvec_blk_f32, matmul_blk_f32      f32 x; 1 or MV_MT tokens per work-item
 *   matvec_blk_q8_0, matmul_blk_q8_0    q8_0 x (x_q8), the same
 *
 * With q8_0 activations, GPU-style work splits (MV_R > 1) and the int8 dot
 * extension (INT_DOT != 0) take word dot products (dot4) per half chunk:
 *     dx * (s0 * sum_lo(q qx) + s1 * sum_hi(q qx) - m0 * sum_lo(qx) - m1 * sum_hi(qx));
 * CPUs without the extension (INT_DOT = 0, MV_R = 1) convert the 32 qx to
 * floats once per token and chunk and share the float loop of f32 x, which
 * reuses each decoded weight vector for every token (int16 products would
 * need a multiply, a conversion and an fma per token and half). */
#if DT_IS_BLK(WTYPE)
#define BLK_INT (INT_DOT != 0 || MV_R > 1)
/* CPUs (MV_R = 1) unroll a super-block's chunks; GPUs shift by a run-time
 * amount at no cost, and the test variants that force GPU work splits on
 * PoCL compile several times faster without the unrolled copies. */
#if MV_R == 1
#define BLK_UNROLL_C _Pragma("unroll")
#else
#define BLK_UNROLL_C _Pragma("unroll 1")
#endif

BLK_INLINE float hsum16(float16 v) {
    float l[16];
    vstore16(v, 0, l);
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; i++) s += l[i];
    return s;
}

/* Chunk cg of an activation row as f32: q8_0 blocks (x_q8) times their
 * scale dx, or f32 values. xa = values 0..15, xb = 16..31. */
BLK_INLINE void blk_x_chunk(gbytes xrow, int cg, bool xq8, float dx, float16 *xa, float16 *xb) {
    if (xq8) {
        global const char *q = (global const char *)(xrow + (ulong)cg * Q8_0_BYTES + 2);
        *xa = convert_float16(vload16(0, q)) * dx;
        *xb = convert_float16(vload16(1, q)) * dx;
    } else {
        *xa = vload16(2 * cg, (global const float *)xrow);
        *xb = vload16(2 * cg + 1, (global const float *)xrow);
    }
}

/* acc[t] += wa * xa[t] + wb * xb[t] for the first mt tokens: a chunk's
 * weights (as f32) against its activations, lane by lane. */
BLK_INLINE void blk_fma_tokens(float16 *acc, float16 wa, float16 wb, const float16 *xa, const float16 *xb, int mt) {
#pragma unroll
    for (int t = 0; t < MV_MT; t++) {
        if (t >= mt) continue;
        acc[t] = fma(wa, xa[t], acc[t]);
        acc[t] = fma(wb, xb[t], acc[t]);
    }
}

BLK_INLINE void matmul_blk(gbytes w, ulong w_off, gbytes x, ulong x_off, gbytes bias, ulong bias_off, global uchar *out,
                       ulong out_off, int n_in, int n_out, int n_tokens, int flags, const int mt, const bool xq8,
                       local float *red) {
    const int lane = get_local_id(0) % MV_R;
    const int r0 = (int)(get_global_id(0) / MV_R) * MV_NR;
    const int t0 = (int)get_global_id(1) * mt;
    const int nc = n_in / 32, nb = n_in / BLK_QK;
    const ulong rb = row_bytes(WTYPE, n_in), xrb = xq8 ? (ulong)nc * Q8_0_BYTES : (ulong)n_in * 4;
    gbytes wrow[MV_NR], xrow[MV_MT];
#pragma unroll
    for (int r = 0; r < MV_NR; r++) wrow[r] = w + w_off + (ulong)min(r0 + r, n_out - 1) * rb;
#pragma unroll
    for (int t = 0; t < MV_MT; t++) xrow[t] = x + x_off + (ulong)min(t0 + t, n_tokens - 1) * xrb;
    float res[MV_NR][MV_MT];
#pragma unroll
    for (int r = 0; r < MV_NR; r++)
#pragma unroll
        for (int t = 0; t < MV_MT; t++) res[r][t] = 0.0f;

    if (xq8 && BLK_INT) {
        for (int b = lane; b < nb; b += MV_R)
        _Pragma("unroll 1") for (int c = 0; c < BLK_CPB; c++) {
            const int cg = b * BLK_CPB + c;
            uint xw[MV_MT][8];
            float dx[MV_MT];
            int xs0[MV_MT], xs1[MV_MT];
#pragma unroll
            for (int t = 0; t < MV_MT; t++) {
                if (t >= mt) continue; /* (not break: loops with one exit unroll) */
                gbytes xblk = xrow[t] + (ulong)cg * Q8_0_BYTES;
                global const ushort *h = (global const ushort *)(xblk + 2);
#pragma unroll
                for (int i = 0; i < 8; i++) xw[t][i] = (uint)h[2 * i] | ((uint)h[2 * i + 1] << 16);
                dx[t] = load_half(xblk);
                xs0[t] = xs1[t] = 0;
#if BLK_MIN
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    xs0[t] = dot4(xw[t][i], 0x01010101u, xs0[t]);
                    xs1[t] = dot4(xw[t][i + 4], 0x01010101u, xs1[t]);
                }
#endif
            }
#pragma unroll
            for (int r = 0; r < MV_NR; r++) {
                char16 qa, qb;
                float s0, s1, m0, m1;
                blk_chunk(wrow[r] + (ulong)b * BLK_BYTES, c, &qa, &qb, &s0, &s1, &m0, &m1);
                const uint4 wa = as_uint4(qa), wb = as_uint4(qb);
#pragma unroll
                for (int t = 0; t < MV_MT; t++) {
                    if (t >= mt) continue;
                    int lo = dot4(wa.x, xw[t][0], 0), hi = dot4(wb.x, xw[t][4], 0);
                    lo = dot4(wa.y, xw[t][1], lo);
                    hi = dot4(wb.y, xw[t][5], hi);
                    lo = dot4(wa.z, xw[t][2], lo);
                    hi = dot4(wb.z, xw[t][6], hi);
                    lo = dot4(wa.w, xw[t][3], lo);
                    hi = dot4(wb.w, xw[t][7], hi);
                    float v = fma(s0, (float)lo, s1 * (float)hi);
#if BLK_MIN
                    v -= fma(m0, (float)xs0[t], m1 * (float)xs1[t]);
#endif
                    res[r][t] = fma(v, dx[t], res[r][t]);
                }
            }
        }
    } else {
        float16 acc[MV_NR][MV_MT];
#pragma unroll
        for (int r = 0; r < MV_NR; r++)
#pragma unroll
            for (int t = 0; t < MV_MT; t++) acc[r][t] = (float16)(0.0f);
#if BLK_CPB == 1 && MV_R == 1
        /* CPUs, 32-blocks: the fp16 scales (and mins) of 8 blocks, of every
         * row and token, convert together, as q8_0's do (q8_scales8): one
         * scalar conversion a block, row and token cost as much as the
         * block's products. The same values as blk_chunk_f32's. */
        for (int b0 = 0; b0 < nb; b0 += 8) {
            const int nblk = min(8, nb - b0);
            float ds[MV_NR][8], ms[MV_NR][8], dxs[MV_MT][8];
            if (nblk == 8) {
#pragma unroll
                for (int r = 0; r < MV_NR; r++) {
                    gbytes b = wrow[r] + (ulong)b0 * BLK_BYTES;
                    vstore8(halves8(b, BLK_BYTES / 2), 0, ds[r]);
                    if (BLK_MIN) vstore8(halves8(b + 2, BLK_BYTES / 2), 0, ms[r]);
                }
#pragma unroll
                for (int t = 0; t < MV_MT; t++)
                    if (t < mt && xq8) vstore8(q8_scales8(xrow[t], b0), 0, dxs[t]);
            } else {
                for (int i = 0; i < nblk; i++) {
#pragma unroll
                    for (int r = 0; r < MV_NR; r++) {
                        gbytes b = wrow[r] + (ulong)(b0 + i) * BLK_BYTES;
                        ds[r][i] = load_half(b);
                        if (BLK_MIN) ms[r][i] = load_half(b + 2);
                    }
#pragma unroll
                    for (int t = 0; t < MV_MT; t++)
                        if (t < mt && xq8) dxs[t][i] = load_half(xrow[t] + (ulong)(b0 + i) * Q8_0_BYTES);
                }
            }
            for (int i = 0; i < nblk; i++) {
                const int b = b0 + i;
                float16 xa[MV_MT], xb[MV_MT];
#pragma unroll
                for (int t = 0; t < MV_MT; t++)
                    if (t < mt) blk_x_chunk(xrow[t], b, xq8, xq8 ? dxs[t][i] : 1.0f, &xa[t], &xb[t]);
#pragma unroll
                for (int r = 0; r < MV_NR; r++) {
                    char16 qa, qb;
                    blk_quants32(wrow[r] + (ulong)b * BLK_BYTES, &qa, &qb);
                    const float16 s = (float16)(ds[r][i]);
#if BLK_MIN
                    const float16 wa = fma(convert_float16(qa), s, (float16)(ms[r][i]));
                    const float16 wb = fma(convert_float16(qb), s, (float16)(ms[r][i]));
#else
                    const float16 wa = convert_float16(qa) * s, wb = convert_float16(qb) * s;
#endif
                    blk_fma_tokens(acc[r], wa, wb, xa, xb, mt);
                }
            }
        }
#else
        for (int b = lane; b < nb; b += MV_R) {
            /* The activation scales of the block's chunks (a super-block's
             * eight convert together, as in q8_scales8's other users). */
            float dxs[MV_MT][BLK_CPB];
#pragma unroll
            for (int t = 0; t < MV_MT; t++) {
                if (t >= mt || !xq8) continue;
#if BLK_CPB == 8
                vstore8(q8_scales8(xrow[t], b * 8), 0, dxs[t]);
#else
                dxs[t][0] = load_half(xrow[t] + (ulong)b * Q8_0_BYTES);
#endif
            }
#if BLK_CPB == 8 && MV_R == 1
            /* CPUs: the scales and mins of every row's super-block decoded
             * together (blk_scales16), not chunk by chunk. */
            float ks[MV_NR][16], km[MV_NR][16];
#pragma unroll
            for (int r = 0; r < MV_NR; r++) {
                float16 s16, m16;
                blk_scales16(wrow[r] + (ulong)b * BLK_BYTES, &s16, &m16);
                vstore16(s16, 0, ks[r]);
                vstore16(m16, 0, km[r]);
            }
#endif
        BLK_UNROLL_C for (int c = 0; c < BLK_CPB; c++) {
            const int cg = b * BLK_CPB + c;
            float16 xa[MV_MT], xb[MV_MT];
#pragma unroll
            for (int t = 0; t < MV_MT; t++)
                if (t < mt) blk_x_chunk(xrow[t], cg, xq8, xq8 ? dxs[t][c] : 1.0f, &xa[t], &xb[t]);
#pragma unroll
            for (int r = 0; r < MV_NR; r++) {
                float16 wa, wb;
#if BLK_CPB == 8 && MV_R == 1
                char16 qa, qb;
                blk_codes_k(wrow[r] + (ulong)b * BLK_BYTES, c, &qa, &qb);
#if BLK_MIN
                wa = fma(convert_float16(qa), (float16)(ks[r][2 * c]), (float16)(-km[r][2 * c]));
                wb = fma(convert_float16(qb), (float16)(ks[r][2 * c + 1]), (float16)(-km[r][2 * c + 1]));
#else
                wa = convert_float16(qa) * ks[r][2 * c];
                wb = convert_float16(qb) * ks[r][2 * c + 1];
#endif
#else
                blk_chunk_f32(wrow[r] + (ulong)b * BLK_BYTES, c, &wa, &wb);
#endif
                blk_fma_tokens(acc[r], wa, wb, xa, xb, mt);
            }
        }
        }
#endif
#pragma unroll
        for (int r = 0; r < MV_NR; r++)
#pragma unroll
            for (int t = 0; t < MV_MT; t++)
                if (t < mt) res[r][t] = hsum16(acc[r][t]);
    }
    mv_store(res, red, lane, r0, t0, n_out, n_tokens, bias, bias_off, out, out_off, flags, mt);
}

#if MV_R > 1
#define BLK_RED local float red[MV_WG]
#else
#define BLK_RED local float *red = 0
#endif
#define BLK_KERNEL(NAME, MT, XQ8)                                                                            \
    kernel void NAME(gbytes w, ulong w_off, gbytes x, ulong x_off, gbytes bias, ulong bias_off,               \
                     global uchar *out, ulong out_off, int n_in, int n_out, int n_tokens, int flags) {        \
        BLK_RED;                                                                                             \
        matmul_blk(w, w_off, x, x_off, bias, bias_off, out, out_off, n_in, n_out, n_tokens, flags, MT, XQ8, red); \
    }
BLK_KERNEL(matvec_blk_f32, 1, false)
BLK_KERNEL(matmul_blk_f32, MV_MT, false)
BLK_KERNEL(matvec_blk_q8_0, 1, true)
BLK_KERNEL(matmul_blk_q8_0, MV_MT, true)
#endif /* DT_IS_BLK(WTYPE) */
