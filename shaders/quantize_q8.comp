#version 450
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"

// quantize_q8: f32 activations of a Q8_0 matmul as q8_0 blocks, by the rule
// of duet_quantize_row_q8_0 (as the cpu backend quantizes them): the same
// [n_tok][n_in/32] block rows an op's out_q8 holds, so the matmul shaders
// read one layout. One invocation per (block, token).
layout(local_size_x_id = 0) in;
layout(constant_id = 1) const bool ALIGNED = false; // x_off % 16 == 0: whole texels

layout(binding = 0) uniform usamplerBuffer X;
layout(std430, binding = 1) buffer Q { uint xq[]; };

layout(push_constant) uniform P {
    uint x_off; // bytes
    uint nb;    // blocks per row
} p;

DEFINE_Q8_STORE(store_q8, xq)

void main() {
    uint b = gl_GlobalInvocationID.x, t = gl_WorkGroupID.y;
    if (b >= p.nb) return;
    uint row = p.x_off + (t * p.nb + b) * 128u; // 32 floats per block
    vec4 v[8];
    if (ALIGNED) {
        [[unroll]] for (int i = 0; i < 8; i++) v[i] = uintBitsToFloat(texelFetch(X, int(row / 16u) + i));
    } else {
        [[unroll]] for (int i = 0; i < 8; i++)
            v[i] = vec4(f32_at(X, row + i * 16u), f32_at(X, row + i * 16u + 4u), f32_at(X, row + i * 16u + 8u),
                        f32_at(X, row + i * 16u + 12u));
    }
    uint dh, qw[8];
    quantize_block(v, dh, qw);
    store_q8((t * p.nb + b) * 34u, dh, qw);
}
