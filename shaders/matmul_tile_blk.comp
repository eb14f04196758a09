#version 450
#extension GL_EXT_control_flow_attributes : require
#ifdef USE_INT_DOT
#ifdef HAVE_EXT_INTEGER_DOT
#extension GL_EXT_integer_dot_product : require
#else
#extension GL_EXT_spirv_intrinsics : require
#endif
#endif
#include "common.glsl"
#include "blocks.glsl"

// matmul_tile_blk (the block types of blocks.glsl, one module for all, the
// type a specialization constant): the tile path of matmul_tile_q8.comp for
// Q4_0 ... IQ4_XS weights against q8_0 activation blocks,
//     out[t][r] = sum_chunks dx (s.x lo + s.y hi) - dot(m, xm)   (+ bias[r]) (+ out[t][r])
// with lo, hi the int8 dot products of a chunk's two halves and xm the
// activation block's two 16-sums times dx (blocks.glsl).
//
// Each invocation computes R rows x T tokens, a chunk (32 columns) at a
// time: a token's activation block is read and unpacked once per R rows, a
// weight chunk decoded once per T tokens, and a super-block's scales once
// per 8 chunks. Blocks are read at any even byte, so any row works; where
// rows start on a texel (ALIGNED), the blocks are walked in runs of
// blk_group whole texels, unrolled, so that every block's phase is a
// constant and its loads need no shifting. With
// USE_INT_DOT the products are OpSDotAccSat; without, the int8 values are
// unpacked to floats and summed with FMAs (exact: |sum| < 2^24).
// Grid: x covers ceil(rows / (WG*R)) workgroups, y covers ceil(tokens / T).
layout(local_size_x_id = 0) in;
layout(constant_id = 1) const int R = 8;
layout(constant_id = 2) const int T = 1;
layout(constant_id = 3) const bool BIAS = false;
layout(constant_id = 4) const bool ACCUMULATE = false; // out += W x
layout(constant_id = 5) const uint BT = 2;             // the weight type (GGUF's number)
layout(constant_id = 6) const bool ALIGNED = false;    // w_off and row_bytes are whole texels

layout(binding = 0) uniform usamplerBuffer W;
layout(binding = 1) uniform usamplerBuffer XQ;
layout(binding = 2) uniform usamplerBuffer B;
layout(std430, binding = 3) buffer Out { float out_[]; };

layout(push_constant) uniform P {
    uint w_off;      // bytes, of row 0 of this dispatch (even)
    uint row_bytes;  // of a weight row
    uint q_off;      // bytes into XQ of token 0's blocks (even)
    uint nb;         // 32-column chunks per row (q8_0 blocks per activation row)
    uint bias_off;   // bytes
    uint out_off;    // words
    uint out_stride; // words
    uint n_rows, n_tok;
} p;

#ifdef USE_INT_DOT
#ifdef HAVE_EXT_INTEGER_DOT
#define DOT4(a, b, acc) dotPacked4x8AccSatEXT(a, b, acc)
#else
spirv_instruction(extensions = ["SPV_KHR_integer_dot_product"], capabilities = [6019, 6018], id = 4453)
int sdot_acc_sat(uint a, uint b, int acc, spirv_literal int fmt);
#define DOT4(a, b, acc) sdot_acc_sat(a, b, acc, 0)
#endif
#endif

// A token's q8_0 activation block, as the inner products take it.
struct xblk {
    float d; // its scale
    vec2 m;  // d times the two 16-sums (for the types' mins)
#ifdef USE_INT_DOT
    uint q[8];
#else
    vec2 s;    // the two 16-sums (for the codes' fixed offset)
    vec4 f[8]; // the int8 values as floats, times XS (blk_codesf's byte weights undone)
#endif
};

xblk load_x(uint byte, vec4 XS) {
    xblk x;
#ifdef USE_INT_DOT
    load_q8_block(XQ, byte, x.d, x.q);
    int s0 = 0, s1 = 0;
    [[unroll]] for (int k = 0; k < 4; k++) {
        s0 = DOT4(x.q[k], 0x01010101u, s0);
        s1 = DOT4(x.q[k + 4], 0x01010101u, s1);
    }
    x.m = x.d * vec2(float(s0), float(s1));
#else
    uint xq[8];
    load_q8_block(XQ, byte, x.d, xq);
    vec4 s4 = vec4(0.0), h4 = vec4(0.0);
    [[unroll]] for (int k = 0; k < 4; k++) {
        vec4 a = i8x4(xq[k]), b = i8x4(xq[k + 4]);
        s4 += a;
        h4 += b;
        x.f[k] = a * XS;
        x.f[k + 4] = b * XS;
    }
    x.s = vec2(dot(s4, vec4(1.0)), dot(h4, vec4(1.0)));
    x.m = x.d * x.s;
#endif
    return x;
}

// acc += a chunk's q, s, m (blk_chunk, or blk_chunk_x's unsigned codes on
// the float path) against activation block x.
void chunk_acc(inout float acc, xblk x, uint q[8], vec2 s, vec2 m, float OFF) {
#ifdef USE_INT_DOT
    int lo = 0, hi = 0;
    [[unroll]] for (int k = 0; k < 4; k++) {
        lo = DOT4(q[k], x.q[k], lo);
        hi = DOT4(q[k + 4], x.q[k + 4], hi);
    }
    acc += x.d * (s.x * float(lo) + s.y * float(hi));
#else
    float lo = 0.0, hi = 0.0;
    [[unroll]] for (int k = 0; k < 4; k++) {
        lo += dot(blk_signed(BT) ? blk_iq4f(q[k]) : blk_codesf(q[k]), x.f[k]);
        hi += dot(blk_signed(BT) ? blk_iq4f(q[k + 4]) : blk_codesf(q[k + 4]), x.f[k + 4]);
    }
    // The signed codes' sums: every term an integer below 2^24, so exact,
    // and the same as summing signed codes.
    lo -= OFF * x.s.x;
    hi -= OFF * x.s.y;
    acc += x.d * (s.x * lo + s.y * hi);
#endif
    if (blk_has_min(BT)) acc -= dot(m, x.m);
}

void main() {
    int r0 = int(gl_GlobalInvocationID.x) * R;
    blk_last = textureSize(W) - 1;
    int t0 = int(gl_WorkGroupID.y) * T;
    if (r0 >= int(p.n_rows)) return;
    uint CPB = blk_chunks(BT), BB = blk_bytes(BT);
    // The float path takes unsigned codes as blk_codesf gives them (code k
    // of a word times 2^(8k)), so activation k of a word is scaled by
    // 2^(-8k); the codes' fixed offset OFF comes off the sums. IQ4's levels
    // are floats already (XS = 1, OFF = 0). Unsigned codes: UQ.
#ifdef USE_INT_DOT
    const vec4 XS = vec4(1.0);
    const float OFF = 0.0;
    const bool UQ = false;
#else
    const vec4 XS = blk_signed(BT) ? vec4(1.0) : vec4(1.0, 1.0 / 256.0, 1.0 / 65536.0, 1.0 / 16777216.0);
    const float OFF = float(blk_offset(BT));
    const bool UQ = true;
#endif
    uint wrow[R];
    [[unroll]] for (int i = 0; i < R; i++) wrow[i] = p.w_off + uint(min(r0 + i, int(p.n_rows) - 1)) * p.row_bytes;
    uint xrow[T];
    [[unroll]] for (int j = 0; j < T; j++) xrow[j] = p.q_off + uint(min(t0 + j, int(p.n_tok) - 1)) * p.nb * 34u;

    float acc[R][T];
    [[unroll]] for (int i = 0; i < R; i++) [[unroll]] for (int j = 0; j < T; j++) acc[i][j] = 0.0;

    uint nblk = p.nb / CPB;
    if (ALIGNED && CPB == 1u) {
        // The 32-value blocks in texel-aligned rows: a group of G blocks is
        // GT whole texels (ALIGNED rows are whole groups), fetched once per
        // row (a fetch is a call on CPU devices; per block it took two)
        // and cut into blocks at constant byte offsets, as
        // matmul_tile_q8.comp walks its rows; the G activation blocks are
        // read once per group.
        uint G = blk_group(BT), GT = G * BB / 16u;
        for (uint b0 = 0u; b0 < nblk; b0 += G) {
            xblk xa[8][T];
            [[unroll]] for (uint jb = 0u; jb < 8u; jb++)
                if (jb < G) [[unroll]] for (int j = 0; j < T; j++) xa[jb][j] = load_x(xrow[j] + (b0 + jb) * 34u, XS);
            int gt = int((b0 / G) * GT);
            [[unroll]] for (int i = 0; i < R; i++) {
                uint u[46]; // the group's words (GT <= 11 texels), zeros past them
                [[unroll]] for (int t = 0; t < 11; t++) {
                    uvec4 v = uint(t) < GT ? texelFetch(W, int(wrow[i] >> 4) + gt + t) : uvec4(0u);
                    u[4 * t] = v.x;
                    u[4 * t + 1] = v.y;
                    u[4 * t + 2] = v.z;
                    u[4 * t + 3] = v.w;
                }
                u[44] = 0u;
                u[45] = 0u;
                [[unroll]] for (uint jb = 0u; jb < 8u; jb++) {
                    if (jb >= G) continue;
                    uint o[6];
                    [[unroll]] for (uint k = 0u; k < 6u; k++) {
                        uint at = jb * BB + 4u * k, w = at >> 2; // blocks start at even bytes
                        o[k] = (at & 2u) != 0u ? (u[w] >> 16) | (u[w + 1u] << 16) : u[w];
                    }
                    uint q[8];
                    vec2 s, m;
                    blk_decode32(BT, o, UQ, q, s, m);
                    [[unroll]] for (int j = 0; j < T; j++) chunk_acc(acc[i][j], xa[jb][j], q, s, m, OFF);
                }
            }
        }
    } else if (ALIGNED && BT == DT_IQ4_XS) {
        // IQ4_XS in texel-aligned rows: a block (136 bytes) starts at byte 0
        // or 8 of a texel and lies in 9 texels, fetched once per row (per
        // chunk it took two, and the head two more), its 8 chunks cut out
        // at constant offsets, the phase a select of the words.
        for (uint b = 0u; b < nblk; b++) {
            xblk xa[8][T];
            [[unroll]] for (uint c = 0u; c < 8u; c++)
                [[unroll]] for (int j = 0; j < T; j++) xa[c][j] = load_x(xrow[j] + (b * 8u + c) * 34u, XS);
            uint bt = b * 136u;
            bool odd = (bt & 8u) != 0u;
            [[unroll]] for (int i = 0; i < R; i++) {
                uint u[38];
                [[unroll]] for (int t = 0; t < 9; t++) {
                    uvec4 v = texelFetch(W, int((wrow[i] + bt) >> 4) + t);
                    u[4 * t] = v.x;
                    u[4 * t + 1] = v.y;
                    u[4 * t + 2] = v.z;
                    u[4 * t + 3] = v.w;
                }
                u[36] = 0u;
                u[37] = 0u;
                uint w[34]; // the block's words
                [[unroll]] for (int k = 0; k < 34; k++) w[k] = odd ? u[k + 2] : u[k];
                // d | scales_h << 16 in w[0], scales_l[4] in w[1] (blk_chunk_xh).
                float d = f16_bits(w[0] & 0xffffu);
                [[unroll]] for (uint c = 0u; c < 8u; c++) {
                    uint q[8];
                    blk_nibbles(uint[4](w[2u + 4u * c], w[3u + 4u * c], w[4u + 4u * c], w[5u + 4u * c]), !UQ, 0u, q);
                    uint ls = ((w[1] >> (4u * c)) & 15u) | ((w[0] >> (16u + 2u * c)) & 3u) << 4;
                    vec2 s = vec2(d * float(int(ls) - 32));
                    [[unroll]] for (int j = 0; j < T; j++) chunk_acc(acc[i][j], xa[c][j], q, s, vec2(0.0), OFF);
                }
            }
        }
    } else {
        // Any other row: blocks at any even byte, a super-block's scales
        // once per 8 chunks; where rows start on a texel (ALIGNED), in runs
        // of blk_group whole texels, so that every block's phase is a
        // constant.
        uint G = ALIGNED ? blk_group(BT) : 1u, GT = G * BB / 16u;
        for (uint b0 = 0u; b0 < nblk; b0 += G) {
            [[unroll]] for (uint jb = 0u; jb < 8u; jb++) {
                if (jb >= G) break;
                uint b = b0 + jb;
                int wtex[R];
                uint wph[R];
                [[unroll]] for (int i = 0; i < R; i++) {
                    if (ALIGNED) {
                        wtex[i] = int(wrow[i] >> 4) + int((b0 / G) * GT + (jb * BB >> 4));
                        wph[i] = (jb * BB) & 15u;
                    } else {
                        uint byte = wrow[i] + b * BB;
                        wtex[i] = int(byte >> 4);
                        wph[i] = byte & 15u;
                    }
                }
                uint hw[R][5], hm[R][8];
                [[unroll]] for (int i = 0; i < R; i++) {
                    blk_head(W, BT, wtex[i], wph[i], hw[i]);
                    blk_hmask(W, BT, wtex[i], wph[i], hm[i]);
                }
                for (uint c = 0u; c < CPB; c++) {
                    uint g = b * CPB + c;
                    xblk xa[T];
                    [[unroll]] for (int j = 0; j < T; j++) xa[j] = load_x(xrow[j] + g * 34u, XS);
                    [[unroll]] for (int i = 0; i < R; i++) {
                        uint q[8];
                        vec2 s, m;
                        blk_chunk_xh(W, BT, wtex[i], wph[i], hw[i], hm[i], c, UQ, q, s, m);
                        [[unroll]] for (int j = 0; j < T; j++) chunk_acc(acc[i][j], xa[j], q, s, m, OFF);
                    }
                }
            }
        }
    }

    [[unroll]] for (int i = 0; i < R; i++) {
        int r = r0 + i;
        if (r >= int(p.n_rows)) break;
        float bias = BIAS ? f32_at(B, p.bias_off + uint(r) * 4u) : 0.0;
        [[unroll]] for (int j = 0; j < T; j++) {
            int t = t0 + j;
            if (t >= int(p.n_tok)) break;
            uint o = p.out_off + uint(t) * p.out_stride + uint(r);
            float v = acc[i][j] + bias;
            if (ACCUMULATE) v += out_[o];
            out_[o] = v;
        }
    }
}
