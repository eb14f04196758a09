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
#define DT_Q8_0 8
#define DT_BF16 30

#define QK8_0 32
#define Q8_0_BYTES 34 /* fp16 scale + 32 int8 */

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
