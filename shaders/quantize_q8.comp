#version 450
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"

// quantize_q8: activations for Q8_0 matmuls, quantized once per op the way
// the cpu backend does it: per block of 32, d = amax / 127 (f32) and
// q = round_to_even(x * 127 / amax). One invocation per (block, token).
//
// Layout of the result (words): q[t][b][8] (4 int8 per word) from word 0;
// then, from word d_off, d[t][nb_pad] with nb_pad = nb rounded up to 8, so
// each group of 8 blocks has its scales in two whole texels.
layout(local_size_x_id = 0) in;
layout(constant_id = 1) const bool ALIGNED = false; // x_off % 16 == 0: whole texels

layout(binding = 0) uniform usamplerBuffer X;
layout(std430, binding = 1) writeonly buffer Q { uint xq[]; };

layout(push_constant) uniform P {
    uint x_off;   // bytes
    uint nb;      // blocks per row
    uint nb_pad;
    uint d_off;   // words
} p;

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
    vec4 m = abs(v[0]);
    [[unroll]] for (int i = 1; i < 8; i++) m = max(m, abs(v[i]));
    float amax = max(max(m.x, m.y), max(m.z, m.w));
    float id = amax > 0.0 ? 127.0 / amax : 0.0;
    uint o = (t * p.nb + b) * 8u;
    [[unroll]] for (int i = 0; i < 8; i++) {
        vec4 r = roundEven(v[i] * id);
        // NaN -> 0 and saturation, as the cpu backend does.
        r = mix(clamp(r, -127.0, 127.0), vec4(0.0), isnan(r));
        ivec4 q = ivec4(r);
        xq[o + uint(i)] = uint(q.x & 0xff) | uint(q.y & 0xff) << 8 | uint(q.z & 0xff) << 16 | uint(q.w & 0xff) << 24;
    }
    xq[p.d_off + t * p.nb_pad + b] = floatBitsToUint(amax / 127.0);
}
