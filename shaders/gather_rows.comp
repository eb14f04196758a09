#version 450
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"

// gather_rows: out[i][:] = x[rows[i]][:]. One invocation per four elements
// (grid x), a row of workgroups per output row (grid y).
layout(local_size_x_id = 0) in;

layout(binding = 0) uniform usamplerBuffer X;
layout(binding = 1) uniform usamplerBuffer ROWS;
layout(std430, binding = 2) writeonly buffer Out { float out_[]; };
layout(std430, binding = 3) buffer Status { uint status; };

layout(push_constant) uniform P {
    uint x_off, rows_off; // bytes
    uint out_off;         // words
    uint dim;
    uint n_rows;          // rows x holds
} p;

void main() {
    uint i = gl_WorkGroupID.y, e0 = gl_GlobalInvocationID.x * 4u;
    if (e0 >= p.dim) return;
    int r = i32_at(ROWS, p.rows_off + i * 4u);
    uint o = p.out_off + i * p.dim + e0;
    bool bad = r < 0 || uint(r) >= p.n_rows;
    if (bad && e0 == 0u) atomicOr(status, ST_BAD_ROW);
    for (uint k = 0u; k < 4u && e0 + k < p.dim; k++)
        out_[o + k] = bad ? 0.0 : f32_at(X, p.x_off + (uint(r) * p.dim + e0 + k) * 4u);
}
