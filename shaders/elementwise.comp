#version 450
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"

// Elementwise ops over [n_tokens][dim] rows: OP_SWIGLU out = silu(a) * b,
// OP_ADD out = a + b. One invocation per four elements (grid x), a row of
// workgroups per token (grid y). out may be a or b itself: each element is
// read and then written by the same invocation.
layout(local_size_x_id = 0) in;
layout(constant_id = 1) const bool ALIGNED = false; // a and b rows are whole texels

layout(binding = 0) uniform usamplerBuffer A;
layout(binding = 1) uniform usamplerBuffer B;
layout(std430, binding = 2) writeonly buffer Out { float out_[]; };

layout(push_constant) uniform P {
    uint a_off, b_off; // bytes
    uint out_off;      // words
    uint dim;
} p;

float f(float a, float b) {
#if defined(OP_SWIGLU)
    return a / (1.0 + exp(-a)) * b;
#else
    return a + b;
#endif
}

void main() {
    uint t = gl_WorkGroupID.y, e0 = gl_GlobalInvocationID.x * 4u;
    if (e0 >= p.dim) return;
    uint row = t * p.dim;
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
