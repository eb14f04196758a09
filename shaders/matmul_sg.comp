#version 450
#extension GL_EXT_control_flow_attributes : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_arithmetic : require
#ifdef USE_INT_DOT
#ifdef HAVE_EXT_INTEGER_DOT
#extension GL_EXT_integer_dot_product : require
#else
#extension GL_EXT_spirv_intrinsics : require
#endif
#endif
#include "common.glsl"
#ifdef WTYPE_BLK
#include "blocks.glsl"
#endif

// matmul_sg: out[t][r] = sum_i W[r][i] x[t][i] (+ bias[r]) (+ out[t][r]),
// the GPU path. A workgroup computes ROWS rows for one token: its lanes
// stride over the row (neighbouring lanes read neighbouring texels or
// blocks), then the partial sums meet through subgroupAdd and shared memory.
// It takes any alignment the HAL allows (2 bytes for 16-bit and Q8_0 rows),
// so it is also the fallback of the tile path for ragged shapes.
//
// Q8_0 reads q8_0 activation blocks (an op's out_q8, or quantize_q8.comp's
// from f32 x, like the cpu backend), a token's row laid out like a weight
// row.
// WTYPE_BLK: the block types of blocks.glsl (the type the specialization
// constant BT), against q8_0 activation blocks like Q8_0: a lane takes
// whole 32-column chunks, decoding its super-block's scales per chunk.
// Grid: x = ceil(rows / ROWS), y = tokens.
layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 64;
layout(constant_id = 1) const int ROWS = 1;
layout(constant_id = 2) const uint NSG = 64; // bound on subgroups per workgroup
layout(constant_id = 3) const bool BIAS = false;
layout(constant_id = 4) const bool ACCUMULATE = false; // out += W x
layout(constant_id = 5) const bool ALIGNED = false;    // rows and x are whole texels
layout(constant_id = 6) const bool GROUPED = false;    // Q8_0 rows are whole 8-block groups of 17 texels
#ifdef WTYPE_BLK
layout(constant_id = 7) const uint BT = 2; // the block type (GGUF's number)
#endif

layout(binding = 0) uniform usamplerBuffer W;
layout(binding = 1) uniform usamplerBuffer X; // f32 activations, or the quantized ones for Q8_0
layout(binding = 2) uniform usamplerBuffer B;
layout(std430, binding = 3) buffer Out { float out_[]; };

layout(push_constant) uniform P {
    uint w_off;      // bytes, of row 0
    uint row_bytes;
    uint x_off;      // bytes, of token 0 (f32), or of token 0's blocks (Q8_0)
    uint n_in;       // columns (Q8_0 and the block types: q8_0 blocks per activation row)
    uint bias_off;   // bytes
    uint out_off;    // words
    uint out_stride; // words
    uint n_rows, n_tok;
} p;

shared float part[ROWS][NSG]; // one partial sum per subgroup and row

#if defined(WTYPE_Q8_0) || defined(WTYPE_BLK)
#ifdef USE_INT_DOT
#ifdef HAVE_EXT_INTEGER_DOT
#define DOT4(a, b, acc) dotPacked4x8AccSatEXT(a, b, acc)
#else
spirv_instruction(extensions = ["SPV_KHR_integer_dot_product"], capabilities = [6019, 6018], id = 4453)
int sdot_acc_sat(uint a, uint b, int acc, spirv_literal int fmt);
#define DOT4(a, b, acc) sdot_acc_sat(a, b, acc, 0)
#endif
#else
int DOT4(uint a, uint b, int acc) {
    ivec4 x = ivec4(int(a << 24) >> 24, int(a << 16) >> 24, int(a << 8) >> 24, int(a) >> 24);
    ivec4 y = ivec4(int(b << 24) >> 24, int(b << 16) >> 24, int(b << 8) >> 24, int(b) >> 24);
    return acc + x.x * y.x + x.y * y.y + x.z * y.z + x.w * y.w;
}
#endif
#endif

// The partial dot product of this lane for row r and token t.
float row_dot(uint row, uint t) {
    uint l = gl_LocalInvocationID.x;
    float s = 0.0;
#if defined(WTYPE_BLK)
    uint CPB = blk_chunks(BT), BB = blk_bytes(BT);
    uint xrow = p.x_off + t * p.n_in * 34u;
    blk_last = textureSize(W) - 1;
    for (uint g = l; g < p.n_in; g += WG) {
        uint blk = row + (g / CPB) * BB, c = g % CPB, hw[5], q[8], xq[8];
        vec2 sc, m;
        float dx;
        blk_head(W, BT, int(blk >> 4), blk & 15u, hw);
        blk_chunk(W, BT, int(blk >> 4), blk & 15u, hw, c, q, sc, m);
        load_q8_block(X, xrow + g * 34u, dx, xq);
        int lo = 0, hi = 0, xl = 0, xh = 0;
        [[unroll]] for (int k = 0; k < 4; k++) {
            lo = DOT4(q[k], xq[k], lo);
            hi = DOT4(q[k + 4], xq[k + 4], hi);
            if (blk_has_min(BT)) {
                xl = DOT4(0x01010101u, xq[k], xl);
                xh = DOT4(0x01010101u, xq[k + 4], xh);
            }
        }
        s += dx * (sc.x * float(lo) + sc.y * float(hi));
        if (blk_has_min(BT)) s -= dot(m, dx * vec2(float(xl), float(xh)));
    }
#elif defined(WTYPE_Q8_0)
    uint nb = p.n_in;
    if (GROUPED) {
        // Lanes take whole groups of 8 blocks (272 bytes = 17 texels), as
        // the tile path does: 16 bytes a fetch. Each half-group (4 blocks,
        // 8.5 texels) is 9 fetches; the odd half starts 2 words in.
        int xq0 = int(p.x_off / 16u + t * (p.row_bytes / 16u));
        for (uint g = l; g < nb / 8u; g += WG) {
            [[unroll]] for (int h = 0; h < 2; h++) {
                uvec4 t9[9], x9[9], xq[8];
                vec4 xd;
                [[unroll]] for (int k = 0; k < 9; k++) t9[k] = texelFetch(W, int(row / 16u + g * 17u) + h * 8 + k);
                [[unroll]] for (int k = 0; k < 9; k++) x9[k] = texelFetch(X, xq0 + int(g) * 17 + h * 8 + k);
#define XD(n) x9[((n) + 2 * h) >> 2][((n) + 2 * h) & 3]
                [[unroll]] for (int pr = 0; pr < 2; pr++) {
                    int o = pr * 17;
                    xd[2 * pr] = unpackHalf2x16(XD(o)).x;
                    xd[2 * pr + 1] = unpackHalf2x16(XD(o + 8)).y;
                    [[unroll]] for (int k = 0; k < 8; k++) {
                        xq[(pr * 16 + k) >> 2][k & 3] = (XD(o + k) >> 16) | (XD(o + k + 1) << 16);
                        xq[(pr * 16 + 8 + k) >> 2][k & 3] = XD(o + 9 + k);
                    }
                }
#undef XD
#define WD(n) t9[((n) + 2 * h) >> 2][((n) + 2 * h) & 3]
                [[unroll]] for (int pr = 0; pr < 2; pr++) {
                    int o = pr * 17, s0 = 0, s1 = 0;
                    [[unroll]] for (int k = 0; k < 8; k++) {
                        s0 = DOT4((WD(o + k) >> 16) | (WD(o + k + 1) << 16), xq[(pr * 16 + k) >> 2][k & 3], s0);
                        s1 = DOT4(WD(o + 9 + k), xq[(pr * 16 + 8 + k) >> 2][k & 3], s1);
                    }
                    s += unpackHalf2x16(WD(o)).x * xd[2 * pr] * float(s0) + unpackHalf2x16(WD(o + 8)).y * xd[2 * pr + 1] * float(s1);
                }
#undef WD
            }
        }
        return s;
    }
    uint xrow = p.x_off + t * p.row_bytes;
    for (uint b = l; b < nb; b += WG) {
        uint blk = row + b * 34u, xb = xrow + b * 34u;
        int acc = 0;
        [[unroll]] for (uint k = 0u; k < 8u; k++)
            acc = DOT4(word_at_byte(W, blk + 2u + 4u * k), word_at_byte(X, xb + 2u + 4u * k), acc);
        s += f16_bits(u16_at(W, blk)) * f16_bits(u16_at(X, xb)) * float(acc);
    }
#else
    uint xrow = p.x_off + t * p.n_in * 4u;
#if defined(WTYPE_F32)
    const uint CPT = 4u;
#else
    const uint CPT = 8u;
#endif
    if (ALIGNED) {
        for (uint c = l; c < p.n_in / CPT; c += WG) {
            uvec4 w = texelFetch(W, int(row / 16u + c));
#if defined(WTYPE_F32)
            s += dot(uintBitsToFloat(w), uintBitsToFloat(texelFetch(X, int(xrow / 16u + c))));
#else
#if defined(WTYPE_F16)
            vec4 wa = vec4(unpackHalf2x16(w.x), unpackHalf2x16(w.y)), wb = vec4(unpackHalf2x16(w.z), unpackHalf2x16(w.w));
#else
            vec4 wa = uintBitsToFloat(uvec4(w.x << 16, w.x & 0xffff0000u, w.y << 16, w.y & 0xffff0000u));
            vec4 wb = uintBitsToFloat(uvec4(w.z << 16, w.z & 0xffff0000u, w.w << 16, w.w & 0xffff0000u));
#endif
            s += dot(wa, uintBitsToFloat(texelFetch(X, int(xrow / 16u + 2u * c)))) +
                 dot(wb, uintBitsToFloat(texelFetch(X, int(xrow / 16u + 2u * c + 1u))));
#endif
        }
    } else {
#if defined(WTYPE_F32)
        const uint dt = DT_F32;
#elif defined(WTYPE_F16)
        const uint dt = DT_F16;
#else
        const uint dt = DT_BF16;
#endif
        for (uint i = l; i < p.n_in; i += WG) s += elem_at(W, dt, row, i) * f32_at(X, xrow + i * 4u);
    }
#endif
    return s;
}

void main() {
    uint r0 = gl_WorkGroupID.x * uint(ROWS), t = gl_WorkGroupID.y;
    float s[ROWS];
    [[unroll]] for (int i = 0; i < ROWS; i++) {
        uint r = min(r0 + uint(i), p.n_rows - 1u);
        s[i] = subgroupAdd(row_dot(p.w_off + r * p.row_bytes, t));
    }
    if (gl_NumSubgroups > 1u) {
        if (subgroupElect()) [[unroll]] for (int i = 0; i < ROWS; i++) part[i][gl_SubgroupID] = s[i];
        barrier();
        if (gl_LocalInvocationID.x == 0u)
            [[unroll]] for (int i = 0; i < ROWS; i++) {
                s[i] = 0.0;
                for (uint k = 0u; k < gl_NumSubgroups; k++) s[i] += part[i][k];
            }
    }
    if (gl_LocalInvocationID.x != 0u) return;
    [[unroll]] for (int i = 0; i < ROWS; i++) {
        uint r = r0 + uint(i);
        if (r >= p.n_rows) break;
        uint o = p.out_off + t * p.out_stride + r;
        float v = s[i];
        if (BIAS) v += f32_at(B, p.bias_off + r * 4u);
        if (ACCUMULATE) v += out_[o];
        out_[o] = v;
    }
}
