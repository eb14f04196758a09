#version 450
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"
#include "kv.glsl"

// rope_kv: rotate q and k in place, then store k and v into the paged KV
// pools at (seq, pos). One workgroup per token: first every rotation pair
// is turned by its own invocation, then (after a barrier, so the rotated k
// is seen) the pool rows are written. Pair i turns by pos * freqs[i] (the
// host's table of inverse frequencies, every scaling folded in), an angle
// reduced exactly enough that cos/sin stay near the cpu's double ones (see
// rope_cs), both scaled by mscale.
//
// f16 rows may start mid-word (odd widths) and q8_0 blocks are 34 bytes:
// words shared with a neighbour are written with atomics on their own half.
// A pool larger than one storage binding is written by one dispatch per
// window of blocks [blk_lo, blk_hi); only the first also rotates.
layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 64;
layout(constant_id = 1) const uint KVT = 0;      // KV_F32, KV_F16, KV_Q8_0
layout(constant_id = 2) const bool NEOX = false; // pairs (i, i + n_rot/2) instead of (2i, 2i+1)

layout(binding = 0) uniform usamplerBuffer POS;
layout(binding = 1) uniform usamplerBuffer SEQ;
layout(binding = 2) uniform usamplerBuffer V;
layout(binding = 3) uniform usamplerBuffer FR;  // f32 [n_rot/2] inverse frequencies
layout(binding = 4) uniform usamplerBuffer BT;  // i32 [n_seqs][max_blocks]
layout(std430, binding = 5) buffer Q { float q[]; };
layout(std430, binding = 6) coherent buffer K { float k[]; };
layout(std430, binding = 7) buffer KP { uint kp[]; };
layout(std430, binding = 8) buffer VP { uint vp[]; };
layout(std430, binding = 9) buffer Status { uint status; };

layout(push_constant) uniform P {
    uint q_off, k_off;                          // words
    uint v_off, pos_off, seq_off, fr_off, bt_off; // bytes
    uint kp_off, vp_off; // of the binding's first row: f32 words, f16 halves, q8_0 bytes
    uint n_head, n_head_kv, hd, n_rot, n_pos;
    uint block_size, n_blocks, max_blocks, n_seqs;
    uint blk_lo, blk_hi; // the blocks this dispatch's pool bindings hold
    uint rotate;         // this dispatch rotates q and k (the first window)
    float mscale;        // of cos and sin
} p;

// (cos, sin) of pos * f, within ~1e-7 of the double-precision values the
// cpu backend computes even where pos * f is thousands of radians (an f32
// product alone would be off by pos * f * 6e-8). pos and f are split into
// halves of at most 12 significant bits, so their four products are
// exact; the nearest multiple n of 2 pi comes off as n times six 8-bit
// parts of 2 pi (exact for n < 2^16); the ten exact terms are summed with
// error-free additions (TwoSum; precise keeps the compiler from fusing or
// reordering them: no fma is needed, which some drivers do not fuse).
vec2 rope_cs(uint pos, float f) {
    precise float fh = uintBitsToFloat(floatBitsToUint(f) & 0xfffff000u);
    precise float fl = f - fh;
    precise float ph = float(pos & 0xfffff000u), pl = float(pos & 0xfffu);
    float n = round(float(pos) * f * 0.159154943091895336);
    precise float t[10];
    t[0] = ph * fh;
    t[1] = -n * 6.28125;
    t[2] = pl * fh;
    t[3] = ph * fl;
    t[4] = -n * 0.00193023681640625;
    t[5] = pl * fl;
    t[6] = -n * 5.066394805908203e-06;
    t[7] = -n * 3.958120942115784e-09;
    t[8] = -n * 1.0231815394945443e-11;
    t[9] = -n * 2.1538326677728037e-14;
    precise float sum = 0.0, err = 0.0;
    [[unroll]] for (uint i = 0u; i < 10u; i++) {
        precise float x = t[i];
        precise float u = sum + x;
        precise float bp = u - sum;
        err += (sum - (u - bp)) + (x - bp);
        sum = u;
    }
    precise float r = sum + err;
    return vec2(cos(r), sin(r)) * p.mscale;
}

DEFINE_Q8_STORE(store_k_q8, kp)
DEFINE_Q8_STORE(store_v_q8, vp)

void store_half(uint which, uint h, uint bits, bool whole, uint lo_bits) {
    // Writes f16 `bits` at half index h; `whole`: also writes lo_bits at h-1
    // as one plain word store (both halves belong to this row).
    uint w = h >> 1;
    if (whole) {
        uint v = lo_bits | (bits << 16);
        if (which == 0u) kp[w] = v;
        else vp[w] = v;
        return;
    }
    uint sh = (h & 1u) * 16u;
    uint keep = ~(0xffffu << sh), set = bits << sh;
    if (which == 0u) {
        atomicAnd(kp[w], keep);
        atomicOr(kp[w], set);
    } else {
        atomicAnd(vp[w], keep);
        atomicOr(vp[w], set);
    }
}

void main() {
    uint t = gl_WorkGroupID.y, l = gl_LocalInvocationID.x;
    int pos = i32_at(POS, p.pos_off + t * 4u), seq = i32_at(SEQ, p.seq_off + t * 4u);
    bool bad_pos = pos < 0 || uint(pos) / p.block_size >= p.max_blocks || uint(pos) >= p.n_pos;
    bool bad_seq = seq < 0 || uint(seq) >= p.n_seqs;
    if (bad_pos || bad_seq) {
        if (p.rotate != 0u && l == 0u) atomicOr(status, (bad_pos ? ST_BAD_POS : 0u) | (bad_seq ? ST_BAD_SEQ : 0u));
        return;
    }
    bool bad_blk = false;
    uint prow = kv_row(BT, p.bt_off, uint(seq), uint(pos), p.block_size, p.max_blocks, p.n_blocks, bad_blk);
    if (bad_blk && p.rotate != 0u && l == 0u) atomicOr(status, ST_BAD_BLOCK);
    uint half_rot = p.n_rot / 2u;
    uint kvw = p.n_head_kv * p.hd;
    if (p.rotate != 0u && half_rot > 0u) {
        uint nq = p.n_head * half_rot, nk = p.n_head_kv * half_rot;
        for (uint u = l; u < nq + nk; u += WG) {
            bool is_q = u < nq;
            uint v = is_q ? u : u - nq;
            uint h = v / half_rot, i = v % half_rot;
            uint a = NEOX ? i : 2u * i, b = NEOX ? i + half_rot : 2u * i + 1u;
            vec2 cs = rope_cs(uint(pos), f32_at(FR, p.fr_off + i * 4u));
            float c = cs.x, s = cs.y;
            if (is_q) {
                uint base = p.q_off + t * p.n_head * p.hd + h * p.hd;
                float x0 = q[base + a], x1 = q[base + b];
                q[base + a] = x0 * c - x1 * s;
                q[base + b] = x0 * s + x1 * c;
            } else {
                uint base = p.k_off + t * kvw + h * p.hd;
                float x0 = k[base + a], x1 = k[base + b];
                k[base + a] = x0 * c - x1 * s;
                k[base + b] = x0 * s + x1 * c;
            }
        }
    }
    memoryBarrierBuffer();
    barrier();
    uint blk = prow / p.block_size;
    if (blk < p.blk_lo || blk >= p.blk_hi) return;
    uint row = prow - p.blk_lo * p.block_size; // within this dispatch's bindings
    uint kbase = p.k_off + t * kvw, vbase = p.v_off + t * kvw * 4u;
    if (KVT == KV_F32) {
        for (uint e = l; e < kvw; e += WG) {
            kp[p.kp_off + row * kvw + e] = floatBitsToUint(k[kbase + e]);
            vp[p.vp_off + row * kvw + e] = word_at(V, (vbase + e * 4u) >> 2);
        }
        return;
    }
    if (KVT == KV_Q8_0) {
        // One invocation per 32-block of the k row, then of the v row.
        uint nb = kvw / 32u;
        for (uint j = l; j < 2u * nb; j += WG) {
            bool is_v = j >= nb;
            uint b = is_v ? j - nb : j;
            vec4 x[8];
            [[unroll]] for (uint i = 0u; i < 8u; i++) {
                uint e = b * 32u + i * 4u;
                if (is_v)
                    x[i] = vec4(f32_at(V, vbase + e * 4u), f32_at(V, vbase + e * 4u + 4u), f32_at(V, vbase + e * 4u + 8u),
                                f32_at(V, vbase + e * 4u + 12u));
                else
                    x[i] = vec4(k[kbase + e], k[kbase + e + 1u], k[kbase + e + 2u], k[kbase + e + 3u]);
            }
            uint dh, qw[8];
            quantize_block(x, dh, qw);
            uint byte = (is_v ? p.vp_off : p.kp_off) + row * nb * 34u + b * 34u;
            if (is_v) store_v_q8(byte, dh, qw);
            else store_k_q8(byte, dh, qw);
        }
        return;
    }
    // f16: walk the words that hold halves [h0, h0 + kvw) of each pool row.
    [[unroll]] for (uint which = 0u; which < 2u; which++) {
        uint h0 = (which == 0u ? p.kp_off : p.vp_off) + row * kvw;
        uint w_first = h0 >> 1, w_last = (h0 + kvw - 1u) >> 1;
        for (uint w = w_first + l; w <= w_last; w += WG) {
            uint lo = 2u * w, hi = lo + 1u;
            bool has_lo = lo >= h0, has_hi = hi < h0 + kvw;
            uint lo_bits = 0u, hi_bits = 0u;
            if (has_lo) {
                float x = which == 0u ? k[kbase + lo - h0] : f32_at(V, vbase + (lo - h0) * 4u);
                lo_bits = packHalf2x16(vec2(x, 0.0)) & 0xffffu;
            }
            if (has_hi) {
                float x = which == 0u ? k[kbase + hi - h0] : f32_at(V, vbase + (hi - h0) * 4u);
                hi_bits = packHalf2x16(vec2(x, 0.0)) & 0xffffu;
            }
            if (has_lo && has_hi) store_half(which, hi, hi_bits, true, lo_bits);
            else if (has_lo) store_half(which, lo, lo_bits, false, 0u);
            else store_half(which, hi, hi_bits, false, 0u);
        }
    }
}
