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

// matmul_mm_q8: the prefill GEMM for Q8_0 weights on GPUs, against q8_0
// activation blocks: out[t][r] = sum_b d_w d_x sum_k q_w q_x
// (+ bias[r]) (+ out[t][r]).
//
// A workgroup computes a BM x BN tile (weight rows x tokens). Each step
// stages BK blocks of its BM weight rows and of its BN token rows in shared
// memory (int8 quants as words, planes by word so neighbouring invocations
// read neighbouring words; scales as floats), then every invocation
// accumulates its TM x TN outputs with int8 x int8 dot products (OpSDotAccSat
// with USE_INT_DOT, else the same sums on unpacked bytes). A weight block
// is read from memory once per BN tokens, an activation block once per BM
// rows, instead of once per token (matmul_sg.comp, the decode GEMV).
// Blocks are loaded at any 2-byte alignment, so any row length works.
// Grid: x = ceil(rows / BM), y = ceil(tokens / BN).
layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 128; // (BM / TM) * (BN / TN)
layout(constant_id = 1) const uint BM = 64;
layout(constant_id = 2) const uint BN = 32;
layout(constant_id = 3) const uint TM = 4;
layout(constant_id = 4) const uint TN = 4;
layout(constant_id = 5) const uint BK = 2; // blocks per step
layout(constant_id = 6) const bool BIAS = false;
layout(constant_id = 7) const bool ACCUMULATE = false; // out += W x

layout(binding = 0) uniform usamplerBuffer W;
layout(binding = 1) uniform usamplerBuffer X; // q8_0 blocks, token rows laid out like weight rows
layout(binding = 2) uniform usamplerBuffer B;
layout(std430, binding = 3) buffer Out { float out_[]; };

layout(push_constant) uniform P {
    uint w_off;      // bytes, of row 0 of this dispatch
    uint row_bytes;  // nb * 34 (weights and activations alike)
    uint x_off;      // bytes, of token 0's blocks
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
#else
int DOT4(uint a, uint b, int acc) {
    ivec4 x = ivec4(int(a << 24) >> 24, int(a << 16) >> 24, int(a << 8) >> 24, int(a) >> 24);
    ivec4 y = ivec4(int(b << 24) >> 24, int(b << 16) >> 24, int(b << 8) >> 24, int(b) >> 24);
    return acc + x.x * y.x + x.y * y.y + x.z * y.z + x.w * y.w;
}
#endif

shared uint wq[BK * 8 * BM]; // [block][word][row]
shared float wd[BK * BM];
shared uint xq[BK * 8 * BN]; // [block][word][token]
shared float xd[BK * BN];

void main() {
    const uint MT = BM / TM; // invocations along the rows
    uint l = gl_LocalInvocationID.x, im = l % MT, in_ = l / MT;
    uint r0 = gl_WorkGroupID.x * BM, t0 = gl_WorkGroupID.y * BN;
    float acc[TM][TN];
    [[unroll]] for (uint m = 0u; m < TM; m++) [[unroll]] for (uint n = 0u; n < TN; n++) acc[m][n] = 0.0;

    for (uint kb = 0u; kb < p.nb; kb += BK) {
        // Stage: one block per job, weights first (consecutive jobs are
        // consecutive blocks of a row: neighbouring loads).
        for (uint job = l; job < (BM + BN) * BK; job += WG) {
            bool is_x = job >= BM * BK;
            uint j = is_x ? job - BM * BK : job, i = j / BK, b = j % BK, blk = kb + b;
            float d = 0.0;
            uint qw[8] = uint[8](0u, 0u, 0u, 0u, 0u, 0u, 0u, 0u);
            if (blk < p.nb) {
                if (is_x) load_q8_block(X, p.x_off + min(t0 + i, p.n_tok - 1u) * p.row_bytes + blk * 34u, d, qw);
                else load_q8_block(W, p.w_off + min(r0 + i, p.n_rows - 1u) * p.row_bytes + blk * 34u, d, qw);
            }
            if (is_x) {
                [[unroll]] for (uint k = 0u; k < 8u; k++) xq[(b * 8u + k) * BN + i] = qw[k];
                xd[b * BN + i] = d;
            } else {
                [[unroll]] for (uint k = 0u; k < 8u; k++) wq[(b * 8u + k) * BM + i] = qw[k];
                wd[b * BM + i] = d;
            }
        }
        barrier();
        [[unroll]] for (uint b = 0u; b < BK; b++) {
            uint wr[TM][8], xr[TN][8];
            float dw[TM], dx[TN];
            [[unroll]] for (uint m = 0u; m < TM; m++) {
                uint row = im + m * MT;
                [[unroll]] for (uint k = 0u; k < 8u; k++) wr[m][k] = wq[(b * 8u + k) * BM + row];
                dw[m] = wd[b * BM + row];
            }
            [[unroll]] for (uint n = 0u; n < TN; n++) {
                uint tok = in_ + n * (BN / TN);
                [[unroll]] for (uint k = 0u; k < 8u; k++) xr[n][k] = xq[(b * 8u + k) * BN + tok];
                dx[n] = xd[b * BN + tok];
            }
            [[unroll]] for (uint m = 0u; m < TM; m++)
                [[unroll]] for (uint n = 0u; n < TN; n++) {
                    int s = 0;
                    [[unroll]] for (uint k = 0u; k < 8u; k++) s = DOT4(wr[m][k], xr[n][k], s);
                    acc[m][n] += dw[m] * dx[n] * float(s);
                }
        }
        barrier();
    }

    [[unroll]] for (uint m = 0u; m < TM; m++) {
        uint r = r0 + im + m * MT;
        if (r >= p.n_rows) continue;
        float bias = BIAS ? f32_at(B, p.bias_off + r * 4u) : 0.0;
        [[unroll]] for (uint n = 0u; n < TN; n++) {
            uint t = t0 + in_ + n * (BN / TN);
            if (t >= p.n_tok) continue;
            uint o = p.out_off + t * p.out_stride + r;
            float v = acc[m][n] + bias;
            if (ACCUMULATE) v += out_[o];
            out_[o] = v;
        }
    }
}
