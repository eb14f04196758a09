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
    return vload_half(0, (global const half *)b) * (float)((global const char *)b)[2 + i % QK8_0];
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
