#version 450
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"

// attn_reduce: combines the (acc, m, l) partials of attn_flash's key splits
// into the attention output (flash-decoding's second pass), as f32 and/or
// as q8_0 blocks. One workgroup per token: first one factor
// exp(m_s - M) / L per (head, split), then an invocation per 32 outputs
// (a q8_0 block; a block may span two heads when head_dim % 32 != 0).
layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 64;
layout(constant_id = 1) const bool HAS_OUT = true;
layout(constant_id = 2) const bool HAS_Q8 = false;
layout(constant_id = 3) const uint MAXF = 1024; // n_head * n_split <= MAXF

layout(binding = 0) uniform usamplerBuffer PART; // f32 [n_tok][n_head][n_split][head_dim + 2]
layout(std430, binding = 1) writeonly buffer Out { float out_[]; };
layout(std430, binding = 2) buffer OQ { uint oq[]; };

layout(push_constant) uniform P {
    uint part_off; // bytes
    uint out_off;  // words
    uint oq_off;   // bytes
    uint n_head, hd, n_split;
} p;

shared float fac[MAXF];

DEFINE_Q8_STORE(store_q8, oq)

void main() {
    uint t = gl_WorkGroupID.y, l = gl_LocalInvocationID.x;
    uint stride = p.hd + 2u, nhs = p.n_head * p.n_split;
    uint row0 = p.part_off / 4u + t * nhs * stride; // words
    for (uint h = l; h < p.n_head; h += WG) {
        uint b = row0 + h * p.n_split * stride;
        float mx = -3.0e38;
        for (uint s = 0u; s < p.n_split; s++) mx = max(mx, uintBitsToFloat(word_at(PART, b + s * stride + p.hd)));
        float total = 0.0;
        for (uint s = 0u; s < p.n_split; s++) {
            uint w = b + s * stride + p.hd;
            total += uintBitsToFloat(word_at(PART, w + 1u)) * exp(uintBitsToFloat(word_at(PART, w)) - mx);
        }
        float inv = total > 0.0 ? 1.0 / total : 0.0;
        for (uint s = 0u; s < p.n_split; s++)
            fac[h * p.n_split + s] = exp(uintBitsToFloat(word_at(PART, b + s * stride + p.hd)) - mx) * inv;
    }
    barrier();
    uint width = p.n_head * p.hd, nb = (width + 31u) / 32u;
    for (uint b = l; b < nb; b += WG) {
        vec4 v[8];
        [[unroll]] for (uint i = 0u; i < 8u; i++)
            [[unroll]] for (uint k = 0u; k < 4u; k++) {
                uint e = b * 32u + i * 4u + k;
                float x = 0.0;
                if (e < width) {
                    uint h = e / p.hd, d = e % p.hd, hb = row0 + h * p.n_split * stride + d;
                    for (uint s = 0u; s < p.n_split; s++)
                        x += uintBitsToFloat(word_at(PART, hb + s * stride)) * fac[h * p.n_split + s];
                }
                v[i][k] = x;
            }
        if (HAS_OUT)
            [[unroll]] for (uint i = 0u; i < 8u; i++)
                [[unroll]] for (uint k = 0u; k < 4u; k++) {
                    uint e = b * 32u + i * 4u + k;
                    if (e < width) out_[p.out_off + t * width + e] = v[i][k];
                }
        if (HAS_Q8) {
            uint dh, qw[8];
            quantize_block(v, dh, qw);
            store_q8(p.oq_off + (t * nb + b) * 34u, dh, qw);
        }
    }
}
