#version 450
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"
#include "blocks.glsl"

// embed: out[t][:] = f32(table[tokens[t]][:]). One invocation per four
// elements of a row (grid x), one row of workgroups per token (grid y).
// The block types (blocks.glsl) decode the 32-weight chunk holding an
// invocation's four elements, exactly as the reference dequantizer does.
// A table larger than one texel view is embedded by one dispatch per view,
// each writing the tokens whose rows it holds.
layout(local_size_x_id = 0) in;
layout(constant_id = 1) const uint DTYPE = 0; // of the table

layout(binding = 0) uniform usamplerBuffer tokens;
layout(binding = 1) uniform usamplerBuffer table;
layout(std430, binding = 2) writeonly buffer Out { float out_[]; };
layout(std430, binding = 3) buffer Status { uint status; };

layout(push_constant) uniform P {
    uint tok_off;   // bytes into `tokens`
    uint table_off; // bytes into `table` of row row_lo
    uint out_off;   // words into out_
    uint dim, row_bytes;
    int row_lo, n_rows; // the rows this view holds: [row_lo, row_lo + n_rows)
    int n_total;        // rows of the whole table
} p;

void main() {
    uint t = gl_WorkGroupID.y;
    uint e0 = gl_GlobalInvocationID.x * 4u;
    if (e0 >= p.dim) return;
    uint o = p.out_off + t * p.dim + e0;
    uint n = min(4u, p.dim - e0);
    int tok = i32_at(tokens, p.tok_off + t * 4u);
    if (tok < 0 || tok >= p.n_total) {
        // Defined output, and the host learns of it at wait().
        if (p.row_lo == 0) {
            if (e0 == 0u) atomicOr(status, ST_BAD_TOKEN);
            for (uint k = 0u; k < n; k++) out_[o + k] = 0.0;
        }
        return;
    }
    if (tok < p.row_lo || tok >= p.row_lo + p.n_rows) return;
    uint row = p.table_off + uint(tok - p.row_lo) * p.row_bytes;
    if (blk_is_block(DTYPE)) {
        // e0 is a multiple of 4, so the four elements share a chunk; rows
        // are whole blocks.
        uint g = e0 >> 5, c = g % blk_chunks(DTYPE), blk = row + (g / blk_chunks(DTYPE)) * blk_bytes(DTYPE);
        uint hw[5], q[8];
        blk_last = textureSize(table) - 1;
        vec2 s, m;
        blk_head(table, DTYPE, int(blk >> 4), blk & 15u, hw);
        blk_chunk(table, DTYPE, int(blk >> 4), blk & 15u, hw, c, q, s, m);
        uint i = e0 & 31u, h = i >> 4;
        vec4 v = i8x4(q[i >> 2]);
        for (uint k = 0u; k < n; k++) out_[o + k] = s[h] * v[k] - m[h];
        return;
    }
    for (uint k = 0u; k < n; k++) out_[o + k] = elem_at(table, DTYPE, row, e0 + k);
}
