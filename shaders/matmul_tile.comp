#version 450
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"

// matmul_tile (f32/f16/bf16 weights): out[t][r] = sum_i W[r][i] x[t][i]
// (+ bias[r]) (+ out[t][r]).
//
// Each invocation computes a tile of R rows x T tokens over whole rows,
// stepping one 16-byte texel of W at a time (4 f32 or 8 f16/bf16 weights),
// so every texel fetched is used T times and every activation R times,
// and no invocation waits for another. This is the path for CPU devices
// (lavapipe), where invocations are SIMD lanes and a fetch is the unit of
// cost. Needs texel-aligned rows: row_bytes, w_off, x_off multiples of 16.
//
// Grid: x covers ceil(rows / (WG*R)) workgroups, y covers ceil(tokens / T).
layout(local_size_x_id = 0) in;
layout(constant_id = 1) const int R = 8;
layout(constant_id = 2) const int T = 1;
layout(constant_id = 3) const bool BIAS = false;
layout(constant_id = 4) const bool ACCUMULATE = false; // out += W x

#if defined(WTYPE_F32)
#define CPT 4u // columns per texel
#else
#define CPT 8u
#endif

layout(binding = 0) uniform usamplerBuffer W;
layout(binding = 1) uniform usamplerBuffer X;
layout(binding = 2) uniform usamplerBuffer B;
layout(std430, binding = 3) buffer Out { float out_[]; };

layout(push_constant) uniform P {
    uint w_off;      // bytes, of row 0 of this dispatch
    uint row_bytes;
    uint x_off;      // bytes, of token 0
    uint n_in;
    uint bias_off;   // bytes, of row 0's bias
    uint out_off;    // words, of out[0][row 0]
    uint out_stride; // words between tokens of out (n_out)
    uint n_rows, n_tok;
} p;

void main() {
    int r0 = int(gl_GlobalInvocationID.x) * R;
    int t0 = int(gl_WorkGroupID.y) * T;
    if (r0 >= int(p.n_rows)) return;
    int wrow[R];
    [[unroll]] for (int i = 0; i < R; i++) wrow[i] = int(p.w_off / 16u) + min(r0 + i, int(p.n_rows) - 1) * int(p.row_bytes / 16u);
    int xrow[T];
    [[unroll]] for (int j = 0; j < T; j++) xrow[j] = int(p.x_off / 16u) + min(t0 + j, int(p.n_tok) - 1) * int(p.n_in / 4u);

    float acc[R][T];
    [[unroll]] for (int i = 0; i < R; i++) [[unroll]] for (int j = 0; j < T; j++) acc[i][j] = 0.0;

    int n_tex = int(p.n_in / CPT);
    for (int c = 0; c < n_tex; c++) {
        vec4 xa[T];
#if !defined(WTYPE_F32)
        vec4 xb[T];
#endif
        [[unroll]] for (int j = 0; j < T; j++) {
#if defined(WTYPE_F32)
            xa[j] = uintBitsToFloat(texelFetch(X, xrow[j] + c));
#else
            xa[j] = uintBitsToFloat(texelFetch(X, xrow[j] + 2 * c));
            xb[j] = uintBitsToFloat(texelFetch(X, xrow[j] + 2 * c + 1));
#endif
        }
        [[unroll]] for (int i = 0; i < R; i++) {
            uvec4 w = texelFetch(W, wrow[i] + c);
#if defined(WTYPE_F32)
            vec4 wa = uintBitsToFloat(w);
            [[unroll]] for (int j = 0; j < T; j++) acc[i][j] += dot(wa, xa[j]);
#else
#if defined(WTYPE_F16)
            vec4 wa = vec4(unpackHalf2x16(w.x), unpackHalf2x16(w.y));
            vec4 wb = vec4(unpackHalf2x16(w.z), unpackHalf2x16(w.w));
#else // bf16: the high 16 bits of an f32
            vec4 wa = uintBitsToFloat(uvec4(w.x << 16, w.x & 0xffff0000u, w.y << 16, w.y & 0xffff0000u));
            vec4 wb = uintBitsToFloat(uvec4(w.z << 16, w.z & 0xffff0000u, w.w << 16, w.w & 0xffff0000u));
#endif
            [[unroll]] for (int j = 0; j < T; j++) acc[i][j] += dot(wa, xa[j]) + dot(wb, xb[j]);
#endif
        }
    }

    [[unroll]] for (int i = 0; i < R; i++) {
        int r = r0 + i;
        if (r >= int(p.n_rows)) break;
        float bias = BIAS ? f32_at(B, p.bias_off + uint(r) * 4u) : 0.0;
        [[unroll]] for (int j = 0; j < T; j++) {
            int t = t0 + j;
            if (t >= int(p.n_tok)) break;
            uint o = p.out_off + uint(t) * p.out_stride + uint(r);
            float v = acc[i][j] + bias;
            if (ACCUMULATE) v += out_[o];
            out_[o] = v;
        }
    }
}
