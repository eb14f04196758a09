#version 450
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"

// Elementwise ops over [n_tokens][dim] rows: OP_SWIGLU out = silu(a) * b,
// OP_ADD out = a + b. One invocation per four elements (grid x), a row of
// workgroups per token (grid y). out may be a or b itself: each element is
// read and then written by the same invocation.
//
// OP_SWIGLU with HAS_Q8: one invocation per 32 elements instead, which it
// also (or only, without HAS_OUT) writes as one q8_0 block quantised from
// the same f32 values.
layout(local_size_x_id = 0) in;
layout(constant_id = 1) const bool ALIGNED = false; // a and b rows are whole texels
layout(constant_id = 2) const bool HAS_OUT = true;
layout(constant_id = 3) const bool HAS_Q8 = false;

layout(binding = 0) uniform usamplerBuffer A;
layout(binding = 1) uniform usamplerBuffer B;
layout(std430, binding = 2) writeonly buffer Out { float out_[]; };
layout(std430, binding = 3) buffer OQ { uint oq[]; };

layout(push_constant) uniform P {
    uint a_off, b_off; // bytes
    uint out_off;      // words
    uint dim;
    uint oq_off;       // bytes
} p;

DEFINE_Q8_STORE(store_q8, oq)

float f(float a, float b) {
#if defined(OP_SWIGLU)
    return a / (1.0 + exp(-a)) * b;
#else
    return a + b;
#endif
}

vec4 ld4(usamplerBuffer v, uint off, uint e) {
    if (ALIGNED) return uintBitsToFloat(texelFetch(v, int(off / 16u + e / 4u)));
    return vec4(f32_at(v, off + e * 4u), f32_at(v, off + e * 4u + 4u), f32_at(v, off + e * 4u + 8u),
                f32_at(v, off + e * 4u + 12u));
}

void main() {
    uint t = gl_WorkGroupID.y;
    uint row = t * p.dim;
#if defined(OP_SWIGLU)
    if (HAS_Q8) {
        // dim % 32 == 0 (the registry checks it).
        uint b = gl_GlobalInvocationID.x, nb = p.dim / 32u;
        if (b >= nb) return;
        vec4 r[8];
        [[unroll]] for (uint i = 0u; i < 8u; i++) {
            vec4 a = ld4(A, p.a_off, row + b * 32u + i * 4u), bb = ld4(B, p.b_off, row + b * 32u + i * 4u);
            [[unroll]] for (uint k = 0u; k < 4u; k++) r[i][k] = f(a[k], bb[k]);
        }
        if (HAS_OUT)
            [[unroll]] for (uint i = 0u; i < 8u; i++)
                [[unroll]] for (uint k = 0u; k < 4u; k++) out_[p.out_off + row + b * 32u + i * 4u + k] = r[i][k];
        uint dh, qw[8];
        quantize_block(r, dh, qw);
        store_q8(p.oq_off + (t * nb + b) * 34u, dh, qw);
        return;
    }
#endif
    uint e0 = gl_GlobalInvocationID.x * 4u;
    if (e0 >= p.dim) return;
    uint o = p.out_off + row + e0;
    if (ALIGNED) {
        vec4 a = uintBitsToFloat(texelFetch(A, int(p.a_off / 16u + (row + e0) / 4u)));
        vec4 b = uintBitsToFloat(texelFetch(B, int(p.b_off / 16u + (row + e0) / 4u)));
        [[unroll]] for (uint k = 0u; k < 4u; k++) out_[o + k] = f(a[k], b[k]);
        return;
    }
    for (uint k = 0u; k < 4u && e0 + k < p.dim; k++)
        out_[o + k] = f(f32_at(A, p.a_off + (row + e0 + k) * 4u), f32_at(B, p.b_off + (row + e0 + k) * 4u));
}
