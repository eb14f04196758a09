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

// matmul_mm_blk: matmul_mm_q8.comp's prefill GEMM for the block types of
// blocks.glsl (one module for all, the type a specialization constant),
// against q8_0 activation blocks:
//     out[t][r] = sum_chunks dx (s.x lo + s.y hi) - dot(m, xm)   (+ bias[r]) (+ out[t][r]).
//
// A workgroup computes a BM x BN tile (weight rows x tokens). Each step
// decodes BK chunks (32 columns each) of its BM weight rows into shared
// memory as int8 codes with their scales and mins (blocks.glsl), stages BK
// activation blocks of its BN tokens with their two 16-sums, then every
// invocation accumulates its TM x TN outputs with int8 x int8 dot products.
// A weight chunk is decoded once per BN tokens instead of once per token.
// Grid: x = ceil(rows / BM), y = ceil(tokens / BN).
layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 128; // (BM / TM) * (BN / TN)
layout(constant_id = 1) const uint BM = 64;
layout(constant_id = 2) const uint BN = 32;
layout(constant_id = 3) const uint TM = 4;
layout(constant_id = 4) const uint TN = 4;
layout(constant_id = 5) const uint BK = 2; // chunks per step
layout(constant_id = 6) const bool BIAS = false;
layout(constant_id = 7) const bool ACCUMULATE = false; // out += W x
layout(constant_id = 8) const uint BT = 2;             // the weight type (GGUF's number)

layout(binding = 0) uniform usamplerBuffer W;
layout(binding = 1) uniform usamplerBuffer X; // q8_0 blocks, one row of nb blocks a token
layout(binding = 2) uniform usamplerBuffer B;
layout(std430, binding = 3) buffer Out { float out_[]; };

layout(push_constant) uniform P {
    uint w_off;      // bytes, of row 0 of this dispatch
    uint row_bytes;  // of a weight row
    uint x_off;      // bytes, of token 0's blocks
    uint nb;         // 32-column chunks per row
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

shared uint wq[BK * 8 * BM]; // [chunk][word][row]
shared vec4 wsm[BK * BM];    // (s.x, s.y, m.x, m.y)
shared uint xq[BK * 8 * BN]; // [chunk][word][token]
shared vec4 xdm[BK * BN];    // (dx, dx * sum_lo, dx * sum_hi, -)

void main() {
    const uint MT = BM / TM; // invocations along the rows
    blk_last = textureSize(W) - 1;
    uint l = gl_LocalInvocationID.x, im = l % MT, in_ = l / MT;
    uint r0 = gl_WorkGroupID.x * BM, t0 = gl_WorkGroupID.y * BN;
    uint CPB = blk_chunks(BT), BB = blk_bytes(BT);
    float acc[TM][TN];
    [[unroll]] for (uint m = 0u; m < TM; m++) [[unroll]] for (uint n = 0u; n < TN; n++) acc[m][n] = 0.0;

    for (uint kb = 0u; kb < p.nb; kb += BK) {
        // Stage: one chunk per job, weights first.
        for (uint job = l; job < (BM + BN) * BK; job += WG) {
            bool is_x = job >= BM * BK;
            uint j = is_x ? job - BM * BK : job, i = j / BK, b = j % BK, g = kb + b;
            uint q[8] = uint[8](0u, 0u, 0u, 0u, 0u, 0u, 0u, 0u);
            vec4 sm = vec4(0.0);
            if (g < p.nb) {
                if (is_x) {
                    float d;
                    load_q8_block(X, p.x_off + min(t0 + i, p.n_tok - 1u) * p.nb * 34u + g * 34u, d, q);
                    int s0 = 0, s1 = 0;
                    [[unroll]] for (uint k = 0u; k < 4u; k++) {
                        s0 = DOT4(0x01010101u, q[k], s0);
                        s1 = DOT4(0x01010101u, q[k + 4u], s1);
                    }
                    sm = vec4(d, d * float(s0), d * float(s1), 0.0);
                } else {
                    uint blk = p.w_off + min(r0 + i, p.n_rows - 1u) * p.row_bytes + (g / CPB) * BB, hw[5];
                    vec2 s, m;
                    blk_head(W, BT, int(blk >> 4), blk & 15u, hw);
                    blk_chunk(W, BT, int(blk >> 4), blk & 15u, hw, g % CPB, q, s, m);
                    sm = vec4(s, m);
                }
            }
            if (is_x) {
                [[unroll]] for (uint k = 0u; k < 8u; k++) xq[(b * 8u + k) * BN + i] = q[k];
                xdm[b * BN + i] = sm;
            } else {
                [[unroll]] for (uint k = 0u; k < 8u; k++) wq[(b * 8u + k) * BM + i] = q[k];
                wsm[b * BM + i] = sm;
            }
        }
        barrier();
        [[unroll]] for (uint b = 0u; b < BK; b++) {
            uint wr[TM][8], xr[TN][8];
            vec4 ws[TM], xs[TN];
            [[unroll]] for (uint m = 0u; m < TM; m++) {
                uint row = im + m * MT;
                [[unroll]] for (uint k = 0u; k < 8u; k++) wr[m][k] = wq[(b * 8u + k) * BM + row];
                ws[m] = wsm[b * BM + row];
            }
            [[unroll]] for (uint n = 0u; n < TN; n++) {
                uint tok = in_ + n * (BN / TN);
                [[unroll]] for (uint k = 0u; k < 8u; k++) xr[n][k] = xq[(b * 8u + k) * BN + tok];
                xs[n] = xdm[b * BN + tok];
            }
            [[unroll]] for (uint m = 0u; m < TM; m++)
                [[unroll]] for (uint n = 0u; n < TN; n++) {
                    int lo = 0, hi = 0;
                    [[unroll]] for (uint k = 0u; k < 4u; k++) {
                        lo = DOT4(wr[m][k], xr[n][k], lo);
                        hi = DOT4(wr[m][k + 4u], xr[n][k + 4u], hi);
                    }
                    acc[m][n] += xs[n].x * (ws[m].x * float(lo) + ws[m].y * float(hi));
                    if (blk_has_min(BT)) acc[m][n] -= ws[m].z * xs[n].y + ws[m].w * xs[n].z;
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
