#version 450
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"

// rmsnorm: out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w. One workgroup per
// token row; its WG invocations split the row (so the reduction is spread
// over WG lanes, not done by one), then share the sum through a tree.
//
// HAS_Q8: the row is also (or only, without HAS_OUT) written as q8_0
// blocks; an invocation computes 32 outputs, writes them as f32 if asked,
// and quantises those same values (amax, scale, int8) into one block.
layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 64;
layout(constant_id = 1) const bool ALIGNED = false; // x and w rows start on 16 bytes and dim % 4 == 0
layout(constant_id = 2) const bool HAS_OUT = true;
layout(constant_id = 3) const bool HAS_Q8 = false;
#include "reduce.glsl"

layout(binding = 0) uniform usamplerBuffer X;
layout(binding = 1) uniform usamplerBuffer W;
layout(std430, binding = 2) writeonly buffer Out { float out_[]; };
layout(std430, binding = 3) buffer OQ { uint oq[]; };

layout(push_constant) uniform P {
    uint x_off, w_off; // bytes
    uint out_off;      // words
    uint dim;
    float eps;
    uint oq_off;       // bytes
} p;

DEFINE_Q8_STORE(store_q8, oq)

vec4 x4(uint xrow, uint i) {
    if (ALIGNED) return uintBitsToFloat(texelFetch(X, int(xrow / 16u + i)));
    return vec4(f32_at(X, xrow + i * 16u), f32_at(X, xrow + i * 16u + 4u), f32_at(X, xrow + i * 16u + 8u),
                f32_at(X, xrow + i * 16u + 12u));
}
vec4 w4(uint i) {
    if (ALIGNED) return uintBitsToFloat(texelFetch(W, int(p.w_off / 16u + i)));
    return vec4(f32_at(W, p.w_off + i * 16u), f32_at(W, p.w_off + i * 16u + 4u), f32_at(W, p.w_off + i * 16u + 8u),
                f32_at(W, p.w_off + i * 16u + 12u));
}

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
    if (HAS_Q8) {
        // dim % 32 == 0 (the registry checks it).
        uint nb = p.dim / 32u;
        for (uint b = l; b < nb; b += WG) {
            vec4 r[8];
            [[unroll]] for (uint i = 0u; i < 8u; i++) r[i] = x4(xrow, b * 8u + i) * scale * w4(b * 8u + i);
            if (HAS_OUT)
                [[unroll]] for (uint i = 0u; i < 8u; i++)
                    [[unroll]] for (uint c = 0u; c < 4u; c++) out_[o + b * 32u + i * 4u + c] = r[i][c];
            uint dh, qw[8];
            quantize_block(r, dh, qw);
            store_q8(p.oq_off + (t * nb + b) * 34u, dh, qw);
        }
        return;
    }
    if (ALIGNED) {
        for (uint i = l; i < p.dim / 4u; i += WG) {
            vec4 r = x4(xrow, i) * scale * w4(i);
            out_[o + 4u * i] = r.x;
            out_[o + 4u * i + 1u] = r.y;
            out_[o + 4u * i + 2u] = r.z;
            out_[o + 4u * i + 3u] = r.w;
        }
    } else {
        for (uint i = l; i < p.dim; i += WG) out_[o + i] = f32_at(X, xrow + i * 4u) * scale * f32_at(W, p.w_off + i * 4u);
    }
}
