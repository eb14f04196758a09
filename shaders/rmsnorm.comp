#version 450
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"

// rmsnorm: out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w. One workgroup per
// token row; its WG invocations split the row (so the reduction is spread
// over WG lanes, not done by one), then share the sum through a tree.
layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 64;
layout(constant_id = 1) const bool ALIGNED = false; // x and w rows start on 16 bytes and dim % 4 == 0
#include "reduce.glsl"

layout(binding = 0) uniform usamplerBuffer X;
layout(binding = 1) uniform usamplerBuffer W;
layout(std430, binding = 2) writeonly buffer Out { float out_[]; };

layout(push_constant) uniform P {
    uint x_off, w_off; // bytes
    uint out_off;      // words
    uint dim;
    float eps;
} p;

void main() {
    uint t = gl_WorkGroupID.y, l = gl_LocalInvocationID.x;
    uint xrow = p.x_off + t * p.dim * 4u;
    float ss = 0.0;
    if (ALIGNED) {
        for (uint i = l; i < p.dim / 4u; i += WG) {
            vec4 v = uintBitsToFloat(texelFetch(X, int(xrow / 16u + i)));
            ss += dot(v, v);
        }
    } else {
        for (uint i = l; i < p.dim; i += WG) {
            float v = f32_at(X, xrow + i * 4u);
            ss += v * v;
        }
    }
    float scale = 1.0 / sqrt(wg_sum(ss) / float(p.dim) + p.eps);
    uint o = p.out_off + t * p.dim;
    if (ALIGNED) {
        for (uint i = l; i < p.dim / 4u; i += WG) {
            vec4 v = uintBitsToFloat(texelFetch(X, int(xrow / 16u + i)));
            vec4 w = uintBitsToFloat(texelFetch(W, int(p.w_off / 16u + i)));
            vec4 r = v * scale * w;
            out_[o + 4u * i] = r.x;
            out_[o + 4u * i + 1u] = r.y;
            out_[o + 4u * i + 2u] = r.z;
            out_[o + 4u * i + 3u] = r.w;
        }
    } else {
        for (uint i = l; i < p.dim; i += WG) out_[o + i] = f32_at(X, xrow + i * 4u) * scale * f32_at(W, p.w_off + i * 4u);
    }
}
