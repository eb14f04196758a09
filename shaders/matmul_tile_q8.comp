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

// matmul_tile_q8 (Q8_0 weights): the tile path of matmul_tile.comp for
// Q8_0 against int8 activations: out[t][r] = sum_b d_w d_x sum_k q_w q_x.
// The activations are q8_0 blocks, a token's row laid out exactly like a
// weight row: written by an earlier op (rmsnorm/swiglu/attention out_q8),
// or by quantize_q8.comp from f32 x (as the cpu backend quantizes them).
//
// A row is a run of 34-byte blocks; 8 blocks are 272 bytes = 17 texels, so
// with texel-aligned rows (blocks per row a multiple of 8) an invocation
// walks each row in half-groups of 4 blocks = 8.5 texels: 9 fetches, two
// words of phase for the odd half. Activation rows are read the same way,
// once per R weight rows. USE_INT_DOT takes the int8 dot products
// with OpSDotAccSat (where the device accelerates it); without it the int8
// values are unpacked to floats once (activations once per R rows, weights
// once per T tokens) and multiplied with FMAs.
layout(local_size_x_id = 0) in;
layout(constant_id = 1) const int R = 8;
layout(constant_id = 2) const int T = 1;
layout(constant_id = 3) const bool BIAS = false;
layout(constant_id = 4) const bool ACCUMULATE = false; // out += W x

layout(binding = 0) uniform usamplerBuffer W;
layout(binding = 1) uniform usamplerBuffer XQ;
layout(binding = 2) uniform usamplerBuffer B;
layout(std430, binding = 3) buffer Out { float out_[]; };

layout(push_constant) uniform P {
    uint w_off;      // bytes, of row 0 of this dispatch (16-aligned)
    uint row_bytes;  // nb * 34, a multiple of 16
    uint q_off;      // bytes into XQ of token 0's blocks (16-aligned)
    uint nb;         // blocks per row
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
    int t0 = int(gl_WorkGroupID.y) * T;
    if (r0 >= int(p.n_rows)) return;
    int wrow[R];
    [[unroll]] for (int i = 0; i < R; i++) wrow[i] = int(p.w_off / 16u) + min(r0 + i, int(p.n_rows) - 1) * int(p.row_bytes / 16u);
    int qrow[T];
    [[unroll]] for (int j = 0; j < T; j++) qrow[j] = int(p.q_off / 16u) + min(t0 + j, int(p.n_tok) - 1) * int(p.row_bytes / 16u);

    float acc[R][T];
    [[unroll]] for (int i = 0; i < R; i++) [[unroll]] for (int j = 0; j < T; j++) acc[i][j] = 0.0;

    int ng = int(p.nb / 8u);
    for (int g = 0; g < ng; g++) {
        [[unroll]] for (int h = 0; h < 2; h++) { // half-group: 4 blocks, 128 columns
            vec4 xd[T];
            uvec4 xq[T][8]; // quants of the 4 blocks: word 8b + k of block b is xq[.][(8b + k) / 4][k % 4]
            [[unroll]] for (int j = 0; j < T; j++) {
                uvec4 x9[9];
                [[unroll]] for (int k = 0; k < 9; k++) x9[k] = texelFetch(XQ, qrow[j] + g * 17 + h * 8 + k);
#define XD(n) x9[((n) + 2 * h) >> 2][((n) + 2 * h) & 3]
                [[unroll]] for (int pr = 0; pr < 2; pr++) {
                    int o = pr * 17;
                    xd[j][2 * pr] = unpackHalf2x16(XD(o)).x;
                    xd[j][2 * pr + 1] = unpackHalf2x16(XD(o + 8)).y;
                    [[unroll]] for (int k = 0; k < 8; k++) {
                        xq[j][(pr * 16 + k) >> 2][k & 3] = (XD(o + k) >> 16) | (XD(o + k + 1) << 16);
                        xq[j][(pr * 16 + 8 + k) >> 2][k & 3] = XD(o + 9 + k);
                    }
                }
#undef XD
            }
#ifndef USE_INT_DOT
            vec4 xf[T][32]; // the int8 activations as floats: unpacked once, used by R rows
            [[unroll]] for (int j = 0; j < T; j++)
                [[unroll]] for (int i = 0; i < 8; i++)
                    [[unroll]] for (int c = 0; c < 4; c++) xf[j][4 * i + c] = i8x4(xq[j][i][c]);
#endif
            [[unroll]] for (int i = 0; i < R; i++) {
                uvec4 t9[9];
                [[unroll]] for (int k = 0; k < 9; k++) t9[k] = texelFetch(W, wrow[i] + g * 17 + h * 8 + k);
                // Word n of this half-group (the odd half starts 2 words into
                // its first texel).
#define WD(n) t9[((n) + 2 * h) >> 2][((n) + 2 * h) & 3]
                [[unroll]] for (int pr = 0; pr < 2; pr++) { // block pairs: 17 words
                    int o = pr * 17;
                    // Even block: scale in the low half of word 0, quants
                    // 2 bytes off word alignment; odd block: scale in the
                    // high half of word 8, quants in words 9..16.
                    float d0 = unpackHalf2x16(WD(o)).x, d1 = unpackHalf2x16(WD(o + 8)).y;
                    uint w0[8], w1[8];
                    [[unroll]] for (int k = 0; k < 8; k++) {
                        w0[k] = (WD(o + k) >> 16) | (WD(o + k + 1) << 16);
                        w1[k] = WD(o + 9 + k);
                    }
#ifdef USE_INT_DOT
                    [[unroll]] for (int j = 0; j < T; j++) {
                        int s0 = 0, s1 = 0;
                        [[unroll]] for (int k = 0; k < 8; k++) {
                            s0 = DOT4(w0[k], xq[j][(pr * 16 + k) >> 2][k & 3], s0);
                            s1 = DOT4(w1[k], xq[j][(pr * 16 + 8 + k) >> 2][k & 3], s1);
                        }
                        acc[i][j] += d0 * xd[j][2 * pr] * float(s0) + d1 * xd[j][2 * pr + 1] * float(s1);
                    }
#else
                    // int8 x int8 products summed in f32 are exact (|sum| <=
                    // 32 * 127 * 127 < 2^24): the same sums as the integer
                    // dot product, one FMA per weight.
                    vec4 wf0[8], wf1[8];
                    [[unroll]] for (int k = 0; k < 8; k++) {
                        wf0[k] = i8x4(w0[k]);
                        wf1[k] = i8x4(w1[k]);
                    }
                    [[unroll]] for (int j = 0; j < T; j++) {
                        float s0 = 0.0, s1 = 0.0;
                        [[unroll]] for (int k = 0; k < 8; k++) {
                            s0 += dot(wf0[k], xf[j][pr * 16 + k]);
                            s1 += dot(wf1[k], xf[j][pr * 16 + 8 + k]);
                        }
                        acc[i][j] += d0 * xd[j][2 * pr] * s0 + d1 * xd[j][2 * pr + 1] * s1;
                    }
#endif
                }
#undef WD
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
