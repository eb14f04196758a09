#version 450
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"

// argmax: out[t] = the index of the largest x[t][j]; the lowest index wins
// ties and NaN never wins (an all-NaN row gives 0), like the cpu backend.
// One workgroup per row: each invocation scans j = lane, lane + WG, ...
// in order, then a shared-memory tree picks the best (found, value, index).
layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 64;

layout(binding = 0) uniform usamplerBuffer X;
layout(std430, binding = 1) writeonly buffer Out { int out_[]; };

layout(push_constant) uniform P {
    uint x_off;   // bytes
    uint out_off; // words
    uint dim;
} p;

shared float sv[WG];
shared int si[WG];

// Whether candidate (v, i) beats (w, k); index -1 means "none found".
bool better(float v, int i, float w, int k) {
    if (i < 0) return false;
    if (k < 0) return true;
    return v > w || (v == w && i < k);
}

void main() {
    uint t = gl_WorkGroupID.y, l = gl_LocalInvocationID.x;
    uint row = p.x_off + t * p.dim * 4u;
    float bv = 0.0;
    int bi = -1;
    for (uint j = l; j < p.dim; j += WG) {
        float v = f32_at(X, row + j * 4u);
        if (!isnan(v) && (bi < 0 || v > bv)) {
            bv = v;
            bi = int(j);
        }
    }
    sv[l] = bv;
    si[l] = bi;
    barrier();
    for (uint s = WG / 2u; s > 0u; s >>= 1) {
        if (l < s && better(sv[l + s], si[l + s], sv[l], si[l])) {
            sv[l] = sv[l + s];
            si[l] = si[l + s];
        }
        barrier();
    }
    if (l == 0u) out_[p.out_off + t] = max(si[0], 0);
}
