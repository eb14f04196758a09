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

void main() {
    int r0 = int(gl_GlobalInvocationID.x) * R;
    blk_last = textureSize(W) - 1;
    int t0 = int(gl_WorkGroupID.y) * T;
    if (r0 >= int(p.n_rows)) return;
    uint CPB = blk_chunks(BT), BB = blk_bytes(BT);
    bool MIN = blk_has_min(BT);
#ifndef USE_INT_DOT
    // The float path takes unsigned codes as blk_codesf gives them (code k
    // of a word times 2^(8k)), so activation k of a word is scaled by
    // 2^(-8k); the codes' fixed offset OFF comes off the sums. IQ4's levels
    // are floats already (XS = 1, OFF = 0).
    const vec4 XS = blk_signed(BT) ? vec4(1.0) : vec4(1.0, 1.0 / 256.0, 1.0 / 65536.0, 1.0 / 16777216.0);
    const float OFF = float(blk_offset(BT));
#endif
    uint wrow[R];
    [[unroll]] for (int i = 0; i < R; i++) wrow[i] = p.w_off + uint(min(r0 + i, int(p.n_rows) - 1)) * p.row_bytes;
    uint xrow[T];
    [[unroll]] for (int j = 0; j < T; j++) xrow[j] = p.q_off + uint(min(t0 + j, int(p.n_tok) - 1)) * p.nb * 34u;

    float acc[R][T];
    [[unroll]] for (int i = 0; i < R; i++) [[unroll]] for (int j = 0; j < T; j++) acc[i][j] = 0.0;

    uint nblk = p.nb / CPB, G = ALIGNED ? blk_group(BT) : 1u, GT = G * BB / 16u;
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
            uint hw[R][5];
            [[unroll]] for (int i = 0; i < R; i++) blk_head(W, BT, wtex[i], wph[i], hw[i]);
            for (uint c = 0u; c < CPB; c++) {
                uint g = b * CPB + c;
                float xd[T];
                vec2 xm[T];
#ifdef USE_INT_DOT
                uint xq[T][8];
                [[unroll]] for (int j = 0; j < T; j++) {
                    load_q8_block(XQ, xrow[j] + g * 34u, xd[j], xq[j]);
                    int s0 = 0, s1 = 0;
                    [[unroll]] for (int k = 0; k < 4; k++) {
                        s0 = DOT4(xq[j][k], 0x01010101u, s0);
                        s1 = DOT4(xq[j][k + 4], 0x01010101u, s1);
                    }
                    xm[j] = xd[j] * vec2(float(s0), float(s1));
                }
#else
                // The int8 activations as floats, unpacked once and used by R
                // rows, times XS (blk_codesf's byte weights undone), and
                // their two 16-sums xs (for the codes' offsets).
                vec4 xf[T][8];
                vec2 xs[T];
                [[unroll]] for (int j = 0; j < T; j++) {
                    uint xq[8];
                    load_q8_block(XQ, xrow[j] + g * 34u, xd[j], xq);
                    vec4 s4 = vec4(0.0), h4 = vec4(0.0);
                    [[unroll]] for (int k = 0; k < 4; k++) {
                        vec4 a = i8x4(xq[k]), b = i8x4(xq[k + 4]);
                        s4 += a;
                        h4 += b;
                        xf[j][k] = a * XS;
                        xf[j][k + 4] = b * XS;
                    }
                    xs[j] = vec2(dot(s4, vec4(1.0)), dot(h4, vec4(1.0)));
                    xm[j] = xd[j] * xs[j];
                }
#endif
                [[unroll]] for (int i = 0; i < R; i++) {
                    uint q[8];
                    vec2 s, m;
#ifdef USE_INT_DOT
                    blk_chunk(W, BT, wtex[i], wph[i], hw[i], c, q, s, m);
#else
                    // Unsigned codes (IQ4: the nibbles, for blk_iq4f); m is
                    // used only for the types with a real min.
                    blk_chunk_x(W, BT, wtex[i], wph[i], hw[i], c, true, q, s, m);
#endif
#ifdef USE_INT_DOT
                    [[unroll]] for (int j = 0; j < T; j++) {
                        int lo = 0, hi = 0;
                        [[unroll]] for (int k = 0; k < 4; k++) {
                            lo = DOT4(q[k], xq[j][k], lo);
                            hi = DOT4(q[k + 4], xq[j][k + 4], hi);
                        }
                        acc[i][j] += xd[j] * (s.x * float(lo) + s.y * float(hi));
                        if (MIN) acc[i][j] -= dot(m, xm[j]);
                    }
#else
                    vec4 wf[8];
                    [[unroll]] for (int k = 0; k < 8; k++)
                        wf[k] = blk_signed(BT) ? blk_iq4f(blk_u8x4(q[k])) : blk_codesf(q[k]);
                    [[unroll]] for (int j = 0; j < T; j++) {
                        float lo = 0.0, hi = 0.0;
                        [[unroll]] for (int k = 0; k < 4; k++) {
                            lo += dot(wf[k], xf[j][k]);
                            hi += dot(wf[k + 4], xf[j][k + 4]);
                        }
                        // The signed codes' sums: every term an integer below
                        // 2^24, so exact, and the same as summing signed codes.
                        lo -= OFF * xs[j].x;
                        hi -= OFF * xs[j].y;
                        acc[i][j] += xd[j] * (s.x * lo + s.y * hi);
                        if (MIN) acc[i][j] -= dot(m, xm[j]);
                    }
#endif
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
