/* common.cl — definitions shared by every kernel source (the host builds
 * each program as common.cl + <family>.cl).
 *
 * OpenCL C 1.2. Device features arrive as defines: HAVE_FP16
 * (cl_khr_fp16), HAVE_FP64 (cl_khr_fp64), HAVE_SUBGROUPS (cl_khr_subgroups).
 * Every kernel has a path without them: half data goes through the core
 * vload_half/vstore_half, reductions through local memory.
 *
 * Buffers arrive as byte pointers plus byte offsets (a duet_view), so one
 * cl_mem can hold many tensors without sub-buffer alignment rules. The host
 * checks every view's size and alignment before it enqueues. */
#ifdef HAVE_FP16
#pragma OPENCL EXTENSION cl_khr_fp16 : enable
#endif
#ifdef HAVE_FP64
#pragma OPENCL EXTENSION cl_khr_fp64 : enable
#endif
#ifdef HAVE_SUBGROUPS
#pragma OPENCL EXTENSION cl_khr_subgroups : enable
#endif

#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)

/* Element types: the values of duet_dtype (= GGUF's ggml_type). */
#define DT_F32 0
#define DT_F16 1
#define DT_Q4_0 2
#define DT_Q4_1 3
#define DT_Q5_0 6
#define DT_Q5_1 7
#define DT_Q8_0 8
#define DT_Q2_K 10
#define DT_Q3_K 11
#define DT_Q4_K 12
#define DT_Q5_K 13
#define DT_Q6_K 14
#define DT_IQ4_NL 20
#define DT_IQ4_XS 23
#define DT_BF16 30

#define QK8_0 32
#define Q8_0_BYTES 34 /* fp16 scale + 32 int8 */

/* The block weight types other than q8_0 (backends/backend.h has their
 * layouts): 32-value blocks, or 256-value super-blocks (DT_IS_K). */
#define DT_IS_K(t) (((t) >= DT_Q2_K && (t) <= DT_Q6_K) || (t) == DT_IQ4_XS)
#define DT_IS_BLK(t) ((t) == DT_Q4_0 || (t) == DT_Q4_1 || (t) == DT_Q5_0 || (t) == DT_Q5_1 || (t) == DT_IQ4_NL || DT_IS_K(t))
#define DT_BLK_QK(t) (DT_IS_K(t) ? 256 : 32)
#define DT_BLK_BYTES(t)                                                                                      \
    ((t) == DT_Q4_0 || (t) == DT_IQ4_NL ? 18                                                                 \
     : (t) == DT_Q4_1                   ? 20                                                                 \
     : (t) == DT_Q5_0                   ? 22                                                                 \
     : (t) == DT_Q5_1                   ? 24                                                                 \
     : (t) == DT_Q2_K                   ? 84                                                                 \
     : (t) == DT_Q3_K                   ? 110                                                                \
     : (t) == DT_Q4_K                   ? 144                                                                \
     : (t) == DT_Q5_K                   ? 176                                                                \
     : (t) == DT_Q6_K                   ? 210                                                                \
                                        : 136)

typedef global const uchar *gbytes;

#define AT(type, base, off) ((global type *)((global uchar *)(base) + (off)))
#define AT_CONST(type, base, off) ((global const type *)((global const uchar *)(base) + (off)))

inline float bf16_to_f32(ushort h) { return as_float((uint)h << 16); }

/* Horizontal max/sum of eight lanes through private memory (Oclgrind's
 * uninitialised-value checker mistracks lane shuffles like .lo/.hi). */
inline float hmax8(float8 v) {
    float l[8];
    vstore8(v, 0, l);
    return fmax(fmax(fmax(l[0], l[1]), fmax(l[2], l[3])), fmax(fmax(l[4], l[5]), fmax(l[6], l[7])));
}

/* ---- q8_0 activations ------------------------------------------------------
 * One block = fp16 scale d + 32 int8, quantised exactly as the host's
 * duet_quantize_row_q8_0: d = amax/127, id = d ? 1/d : 0, q = round half
 * away from zero of x*id clamped to [-127, 127] (NaN gives 0), the scale
 * stored rounded to nearest even. The block's 32 values arrive as four
 * float8 (x0 = values 0..7, ...); dst is the block's first byte (2-byte
 * aligned: blocks are 34 bytes). */
inline char8 q8_quant8(float8 x, float id) {
    float8 v = round(x * id);
    v = select(v, (float8)(0.0f), isnan(v)); /* NaN inputs give 0, as on the host */
    return convert_char8(clamp(v, -127.0f, 127.0f));
}

inline void q8_store_block(global uchar *dst, float8 x0, float8 x1, float8 x2, float8 x3) {
    /* fmax ignores NaN: NaN never wins the amax, as on the host. */
    const float amax = hmax8(fmax(fmax(fabs(x0), fabs(x1)), fmax(fabs(x2), fabs(x3))));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    vstore_half_rte(d, 0, (global half *)dst);
    global char *qs = (global char *)(dst + 2);
    vstore8(q8_quant8(x0, id), 0, qs);
    vstore8(q8_quant8(x1, id), 1, qs);
    vstore8(q8_quant8(x2, id), 2, qs);
    vstore8(q8_quant8(x3, id), 3, qs);
}

/* The same from 32 floats in local memory. */
inline void q8_store_block_local(global uchar *dst, local const float *x) {
    q8_store_block(dst, vload8(0, x), vload8(1, x), vload8(2, x), vload8(3, x));
}

/* q = x / y, r = x % y for 0 <= x, 0 < y and x / y < 2^23 (every caller).
 * The remainder goes through mul24 so the compiler does not pair it with
 * the division: LLVM then inserts `freeze`, which Oclgrind's
 * uninitialised-value checker cannot run. */
#define DIVMOD(x, y, q, r)             \
    do {                               \
        (q) = (x) / (y);               \
        (r) = (x) - mul24((q), (y));   \
    } while (0)

/* ---- paged KV cache --------------------------------------------------------
 * Position p of sequence slot s lives in row p % bs of block
 * table[s * max_blocks + p / bs]. The host validates p and s; the block
 * index read from the table is clamped into [0, n_blocks) so a bad table
 * entry can never move an access outside the pool. Returns the pool row. */
inline ulong kv_row(global const int *table, int s, int p, int bs, int n_blocks, int max_blocks) {
    int bi, off;
    DIVMOD(p, bs, bi, off);
    const int b = clamp(table[(ulong)s * max_blocks + bi], 0, n_blocks - 1);
    return (ulong)b * bs + off;
}

/* The fp16 scale at p (2-byte aligned) as f32. SOFT_HALF (the host sets
 * it for CPU devices) converts with integer ops: PoCL's scalar vload_half
 * is a slow library call, while GPUs have a conversion instruction. Exact
 * for every input (zeros, subnormals, inf, NaN). */
inline float load_half(gbytes p) {
#ifdef SOFT_HALF
    const uint u = *(global const ushort *)p;
    const uint ex = u & 0x7c00u, man = u & 0x3ffu;
    float f = as_float(((u & 0x7fffu) << 13) + 0x38000000u); /* rebias 15 -> 127 */
    if (ex == 0u) f = (float)man * 0x1.0p-24f;
    else if (ex == 0x7c00u) f = as_float((man << 13) | 0x7f800000u);
    return as_float(as_uint(f) | ((u & 0x8000u) << 16));
#else
    return vload_half(0, (global const half *)p);
#endif
}

/* Bytes of a row of n elements of type dt. */
inline ulong row_bytes(int dt, int n) {
    if (DT_IS_BLK(dt)) return (ulong)(n / DT_BLK_QK(dt)) * DT_BLK_BYTES(dt);
    return dt == DT_F32 ? (ulong)n * 4 : dt == DT_Q8_0 ? (ulong)(n / QK8_0) * Q8_0_BYTES : (ulong)n * 2;
}

/* Element i of a row of type dt, as f32. */
inline float load_elem(int dt, gbytes row, int i) {
    if (dt == DT_F32) return ((global const float *)row)[i];
    if (dt == DT_F16) return vload_half(i, (global const half *)row);
    if (dt == DT_BF16) return bf16_to_f32(((global const ushort *)row)[i]);
    gbytes b = row + (i / QK8_0) * Q8_0_BYTES;
    return load_half(b) * (float)((global const char *)b)[2 + i % QK8_0];
}

/* ---- block weight types: one chunk of 32 weights at a time ------------------
 * Built when WTYPE is one of DT_IS_BLK. Every type reads as 32-weight
 * chunks (a 32-block is one chunk, a super-block eight) of w = s * q - m,
 * with q small integers and s, m per 16 weights (the k-quants' sub-block
 * scale and min; a 32-block's one scale twice), the layout of
 * backends/cpu/cpu_matmul_blocks.c. Where m is a fixed multiple of s
 * (q4_0: 8s, q5_0: 16s, q3_K: 4s, q6_K: 32s) the offset is subtracted
 * from q instead, and IQ4's q are its signed table values: m = 0 unless
 * BLK_MIN. Every q fits a char. Blocks sit at any even byte (rows are
 * whole blocks of 18..210 bytes): bytes through vload16 of uchar, fp16
 * and 16-bit fields through ushort loads. */
#if defined(WTYPE) && DT_IS_BLK(WTYPE)
/* Every helper below is inlined into its kernel: its chunk index and type
 * branches must become constants there (PoCL's inliner left the larger
 * decoders as calls with run-time shifts, 3-5x slower). */
#define BLK_INLINE inline __attribute__((always_inline))
#define BLK_QK DT_BLK_QK(WTYPE)
#define BLK_BYTES DT_BLK_BYTES(WTYPE)
#define BLK_CPB (BLK_QK / 32) /* chunks per block */
#define BLK_MIN                                                                                              \
    (WTYPE == DT_Q4_1 || WTYPE == DT_Q5_1 || WTYPE == DT_Q2_K || WTYPE == DT_Q4_K || WTYPE == DT_Q5_K)

BLK_INLINE uint blk_u16(gbytes p) { return *(global const ushort *)p; }

/* IQ4_NL / IQ4_XS: the 16 levels of 16 nibbles, through a tree of selects
 * on the nibbles' bits (each moved into the sign bit, which select tests):
 * 15 blends per 16 lanes, where shuffle() with a variable mask becomes
 * one extract and insert per lane on PoCL. */
BLK_INLINE char16 iq4_lookup(uchar16 nib) {
#if defined(__x86_64__) && defined(__SSSE3__) && defined(__has_builtin)
#if __has_builtin(__builtin_ia32_pshufb128)
    /* x86 CPUs (PoCL compiles for the host): one byte shuffle does the 16
     * lookups (pshufb), as llama.cpp's IQ4 kernels do. */
    const char16 lv = (char16)(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113);
    return __builtin_ia32_pshufb128(lv, as_char16(nib));
#define IQ4_PSHUFB
#endif
#endif
#ifndef IQ4_PSHUFB
#define IQ4_C(v) ((char16)(v))
    const char16 b0 = as_char16(nib << (uchar)7), b1 = as_char16(nib << (uchar)6);
    const char16 b2 = as_char16(nib << (uchar)5), b3 = as_char16(nib << (uchar)4);
    const char16 l0 = select(select(IQ4_C(-127), IQ4_C(-104), b0), select(IQ4_C(-83), IQ4_C(-65), b0), b1);
    const char16 l1 = select(select(IQ4_C(-49), IQ4_C(-35), b0), select(IQ4_C(-22), IQ4_C(-10), b0), b1);
    const char16 h0 = select(select(IQ4_C(1), IQ4_C(13), b0), select(IQ4_C(25), IQ4_C(38), b0), b1);
    const char16 h1 = select(select(IQ4_C(53), IQ4_C(69), b0), select(IQ4_C(89), IQ4_C(113), b0), b1);
#undef IQ4_C
    return select(select(l0, l1, b2), select(h0, h1, b2), b3);
#endif
}

/* Bit j of h, j = 0..15, as 16 in lane j (the fifth bit of q5 quants):
 * byte ops on one 16-byte vector (each byte of h broadcast to 8 lanes,
 * tested against its lane's bit), not 32-bit shifts of 16 lanes. */
BLK_INLINE uchar16 bit4_16(uint h) {
    const uchar16 b = (uchar16)((uchar8)((uchar)h), (uchar8)((uchar)(h >> 8)));
    const uchar16 bit = (uchar16)(1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128);
    return as_uchar16((b & bit) != (uchar16)(0)) & (uchar16)(16);
}

/* q4_K / q5_K: the 6-bit scale and min of sub-block j from the 12 packed bytes at q. */
BLK_INLINE void k4_scale_min(gbytes q, int j, float *sc, float *mn) {
    if (j < 4) {
        *sc = (float)(q[j] & 63);
        *mn = (float)(q[j + 4] & 63);
    } else {
        *sc = (float)((q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4));
        *mn = (float)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

/* q3_K: the 6-bit scale of sub-block k, less 32. */
BLK_INLINE float k3_scale(gbytes q, int k) {
    const int lo = k < 8 ? q[k] & 0xf : q[k - 8] >> 4;
    const int hi = (q[8 + k % 4] >> (2 * (k / 4))) & 3;
    return (float)((lo | hi << 4) - 32);
}

#if BLK_CPB == 8
/* The codes of chunk c (0..7) of the super-block at blk: qa = q of its
 * weights 0..15, qb = 16..31 (the scales: blk_chunk or blk_scales16). */
BLK_INLINE void blk_codes_k(gbytes blk, int c, char16 *qa, char16 *qb) {
    const uchar16 m4 = (uchar16)(0xf), m2 = (uchar16)(3);
#if WTYPE == DT_Q2_K
    /* scales[16], qs[64], d, dmin */
    gbytes qs = blk + 16 + 32 * (c / 4);
    const uchar sh = (uchar)(2 * (c % 4));
    *qa = as_char16((vload16(0, qs) >> sh) & m2);
    *qb = as_char16((vload16(1, qs) >> sh) & m2);
#elif WTYPE == DT_Q3_K
    /* hmask[32], qs[64], scales[12], d */
    gbytes qs = blk + 32 + 32 * (c / 4);
    const uchar sh = (uchar)(2 * (c % 4)), hs = (uchar)c;
    const uchar16 one = (uchar16)(1);
    *qa = as_char16(((vload16(0, qs) >> sh) & m2) | (((vload16(0, blk) >> hs) & one) << (uchar)2)) - (char)4;
    *qb = as_char16(((vload16(1, qs) >> sh) & m2) | (((vload16(1, blk) >> hs) & one) << (uchar)2)) - (char)4;
#elif WTYPE == DT_Q4_K || WTYPE == DT_Q5_K
    /* d, dmin, scales[12], (q5_K: qh[32],) qs[128] */
    gbytes qs = blk + (WTYPE == DT_Q5_K ? 48 : 16) + 32 * (c / 2);
    const uchar sh = (uchar)(4 * (c % 2));
    uchar16 a = (vload16(0, qs) >> sh) & m4, b = (vload16(1, qs) >> sh) & m4;
#if WTYPE == DT_Q5_K
    const uchar hs = (uchar)c;
    const uchar16 one = (uchar16)(1);
    a |= ((vload16(0, blk + 16) >> hs) & one) << (uchar)4;
    b |= ((vload16(1, blk + 16) >> hs) & one) << (uchar)4;
#endif
    *qa = as_char16(a);
    *qb = as_char16(b);
#elif WTYPE == DT_Q6_K
    /* ql[128], qh[64], scales[16] (int8), d */
    const int h = c / 4, k = c % 4;
    gbytes ql = blk + 64 * h + 32 * (k & 1), qh = blk + 128 + 32 * h;
    const uchar ls = (uchar)(4 * (k >> 1)), hs = (uchar)(2 * k);
    *qa = as_char16(((vload16(0, ql) >> ls) & m4) | (((vload16(0, qh) >> hs) & m2) << (uchar)4)) - (char)32;
    *qb = as_char16(((vload16(1, ql) >> ls) & m4) | (((vload16(1, qh) >> hs) & m2) << (uchar)4)) - (char)32;
#else /* IQ4_XS: d, scales_h, scales_l[4], qs[128] */
    const uchar16 v = vload16(0, blk + 8 + 16 * c);
    *qa = iq4_lookup(v & m4);
    *qb = iq4_lookup(v >> (uchar)4);
#endif
}

/* Each 8-lane value twice, in order (a chunk's scale for both its halves). */
BLK_INLINE float16 blk_twice8(float8 v) { return (float16)(v.s00112233, v.s44556677); }

/* The scales s and mins m of the super-block's 16 half-chunks (chunk c's
 * are lanes 2c and 2c + 1) at once, with byte-vector ops: the values
 * blk_chunk forms one chunk at a time, the same products (CPUs, where
 * per-chunk scalar decoding costs as much as the chunk's weights). */
BLK_INLINE void blk_scales16(gbytes blk, float16 *s, float16 *m) {
    *m = (float16)(0.0f);
#if WTYPE == DT_Q2_K
    const uchar16 sc = vload16(0, blk);
    *s = load_half(blk + 80) * convert_float16(sc & (uchar)15);
    *m = load_half(blk + 82) * convert_float16(sc >> (uchar)4);
#elif WTYPE == DT_Q3_K
    /* k3_scale for k = 0..15: low nibbles of bytes 0..7, then their high
     * nibbles; bits 2(k/4) of byte 8 + k%4 above them. */
    const uchar8 lq = vload8(0, blk + 96);
    const uchar4 hq = vload4(0, blk + 104);
    const uchar16 lo = (uchar16)(lq & (uchar)15, lq >> (uchar)4);
    const uchar16 hi = (uchar16)(hq, hq >> (uchar)2, hq >> (uchar)4, hq >> (uchar)6) & (uchar)3;
    *s = load_half(blk + 108) * convert_float16(as_char16(lo | hi << (uchar)4) - (char)32);
#elif WTYPE == DT_Q4_K || WTYPE == DT_Q5_K
    /* k4_scale_min for j = 0..7 from scales[12] = a (0..3), b (4..7), c (8..11). */
    const uchar4 a = vload4(0, blk + 4), b = vload4(0, blk + 8), c = vload4(0, blk + 12);
    const uchar8 sc = (uchar8)(a & (uchar)63, (c & (uchar)15) | ((a >> (uchar)6) << (uchar)4));
    const uchar8 mn = (uchar8)(b & (uchar)63, (c >> (uchar)4) | ((b >> (uchar)6) << (uchar)4));
    *s = blk_twice8(load_half(blk) * convert_float8(sc));
    *m = blk_twice8(load_half(blk + 2) * convert_float8(mn));
#elif WTYPE == DT_Q6_K
    *s = load_half(blk + 208) * convert_float16(vload16(0, (global const char *)(blk + 192)));
#else /* IQ4_XS: chunk c's 6-bit scale: nibble c % 2 of scales_l[c / 2], bits 2c of scales_h above */
    const uchar4 sl = vload4(0, blk + 4);
    const uchar8 lo = (uchar8)(sl.s00112233) >> (uchar8)(0, 4, 0, 4, 0, 4, 0, 4) & (uchar)15;
    const uint8 hi = ((uint8)(blk_u16(blk + 2)) >> (uint8)(0, 2, 4, 6, 8, 10, 12, 14)) & (uint8)(3u);
    *s = blk_twice8(load_half(blk) * convert_float8(convert_int8(lo) + convert_int8(hi << 4u) - 32));
#endif
}
#endif

#if BLK_CPB == 1
/* The quants of the 32-block at blk (its fp16 scale at byte 0 and, with
 * BLK_MIN, its min at byte 2 are read apart): qa = weights 0..15, qb =
 * 16..31. */
BLK_INLINE void blk_quants32(gbytes blk, char16 *qa, char16 *qb) {
    const uchar16 m4 = (uchar16)(0xf);
#if WTYPE == DT_Q4_0 || WTYPE == DT_IQ4_NL || WTYPE == DT_Q4_1
    const uchar16 v = vload16(0, blk + (WTYPE == DT_Q4_1 ? 4 : 2));
#if WTYPE == DT_IQ4_NL
    *qa = iq4_lookup(v & m4);
    *qb = iq4_lookup(v >> (uchar)4);
#elif WTYPE == DT_Q4_0
    *qa = as_char16(v & m4) - (char)8;
    *qb = as_char16(v >> (uchar)4) - (char)8;
#else
    *qa = as_char16(v & m4);
    *qb = as_char16(v >> (uchar)4);
#endif
#else /* Q5_0, Q5_1 */
    const int o = WTYPE == DT_Q5_1 ? 4 : 2;
    const uint qh = blk_u16(blk + o) | blk_u16(blk + o + 2) << 16;
    const uchar16 v = vload16(0, blk + o + 4);
    const uchar16 a = (v & m4) | bit4_16(qh), b = (v >> (uchar)4) | bit4_16(qh >> 16);
#if WTYPE == DT_Q5_0
    *qa = as_char16(a) - (char)16;
    *qb = as_char16(b) - (char)16;
#else
    *qa = as_char16(a);
    *qb = as_char16(b);
#endif
#endif
}
#endif

/* Chunk c (0 .. BLK_CPB - 1) of the block at blk: qa = q of its weights
 * 0..15, qb = 16..31; s0, m0 and s1, m1 their scales and mins. */
BLK_INLINE void blk_chunk(gbytes blk, int c, char16 *qa, char16 *qb, float *s0, float *s1, float *m0, float *m1) {
    *m0 = *m1 = 0.0f;
#if BLK_CPB == 1
    blk_quants32(blk, qa, qb);
    *s0 = *s1 = load_half(blk);
#if BLK_MIN
    *m0 = *m1 = -load_half(blk + 2);
#endif
#else
    blk_codes_k(blk, c, qa, qb);
#if WTYPE == DT_Q2_K
    const float d = load_half(blk + 80), dm = load_half(blk + 82);
    const uint sa = blk[2 * c], sb = blk[2 * c + 1];
    *s0 = d * (float)(sa & 15);
    *s1 = d * (float)(sb & 15);
    *m0 = dm * (float)(sa >> 4);
    *m1 = dm * (float)(sb >> 4);
#elif WTYPE == DT_Q3_K
    const float d = load_half(blk + 108);
    *s0 = d * k3_scale(blk + 96, 2 * c);
    *s1 = d * k3_scale(blk + 96, 2 * c + 1);
#elif WTYPE == DT_Q4_K || WTYPE == DT_Q5_K
    float sc, mn;
    k4_scale_min(blk + 4, c, &sc, &mn);
    *s0 = *s1 = load_half(blk) * sc;
    *m0 = *m1 = load_half(blk + 2) * mn;
#elif WTYPE == DT_Q6_K
    const float d = load_half(blk + 208);
    global const char *sc = (global const char *)(blk + 192);
    *s0 = d * (float)sc[2 * c];
    *s1 = d * (float)sc[2 * c + 1];
#else /* IQ4_XS */
    const int l = ((blk[4 + c / 2] >> (4 * (c % 2))) & 0xf) | (((blk_u16(blk + 2) >> (2 * c)) & 3) << 4);
    *s0 = *s1 = load_half(blk) * (float)(l - 32);
#endif
#endif
}

/* Chunk c of the block at blk as f32: wa = weights 0..15, wb = 16..31. */
BLK_INLINE void blk_chunk_f32(gbytes blk, int c, float16 *wa, float16 *wb) {
    char16 qa, qb;
    float s0, s1, m0, m1;
    blk_chunk(blk, c, &qa, &qb, &s0, &s1, &m0, &m1);
#if BLK_MIN
    *wa = fma(convert_float16(qa), (float16)(s0), (float16)(-m0));
    *wb = fma(convert_float16(qb), (float16)(s1), (float16)(-m1));
#else
    *wa = convert_float16(qa) * s0;
    *wb = convert_float16(qb) * s1;
#endif
}
#endif /* block WTYPE */

/* ---- work-group reductions (every work-item calls them; all get the result).
 * n = the work-group size, a power of two; s = local scratch of n floats. */

inline float group_sum(float v, local float *s, int lid, int n) {
#ifdef HAVE_SUBGROUPS
    float r = sub_group_reduce_add(v);
    uint nsg = get_num_sub_groups();
    if (nsg == 1) return r;
    if (get_sub_group_local_id() == 0) s[get_sub_group_id()] = r;
    barrier(CLK_LOCAL_MEM_FENCE);
    float t = 0.0f;
    for (uint i = 0; i < nsg; i++) t += s[i];
    barrier(CLK_LOCAL_MEM_FENCE);
    return t;
#else
    if (n == 1) return v;
    s[lid] = v;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int o = n / 2; o > 0; o >>= 1) {
        if (lid < o) s[lid] += s[lid + o];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    float r = s[0];
    barrier(CLK_LOCAL_MEM_FENCE); /* s is free again when we return */
    return r;
#endif
}

inline float group_max(float v, local float *s, int lid, int n) {
#ifdef HAVE_SUBGROUPS
    float r = sub_group_reduce_max(v);
    uint nsg = get_num_sub_groups();
    if (nsg == 1) return r;
    if (get_sub_group_local_id() == 0) s[get_sub_group_id()] = r;
    barrier(CLK_LOCAL_MEM_FENCE);
    float t = -INFINITY;
    for (uint i = 0; i < nsg; i++) t = fmax(t, s[i]);
    barrier(CLK_LOCAL_MEM_FENCE);
    return t;
#else
    if (n == 1) return v;
    s[lid] = v;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int o = n / 2; o > 0; o >>= 1) {
        if (lid < o) s[lid] = fmax(s[lid], s[lid + o]);
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    float r = s[0];
    barrier(CLK_LOCAL_MEM_FENCE);
    return r;
#endif
}
