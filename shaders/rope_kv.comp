#version 450
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"

// rope_kv: rotate q and k in place, then store k and v into the KV cache at
// (seq, pos). One workgroup per token: first every rotation pair is turned
// by its own invocation, then (after a barrier, so the rotated k is seen)
// the cache row is written word by word. cos/sin come from a table the
// host computed in double precision, as the cpu backend does.
//
// An f16 cache row may start in the middle of a word (odd row lengths):
// the two words it shares with its neighbours are written with atomics.
// A cache larger than one storage binding is written by one dispatch per
// window of sequences [seq_lo, seq_hi); only the first also rotates.
layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 64;
layout(constant_id = 1) const bool KV_F16 = false;
layout(constant_id = 2) const bool NEOX = false; // pairs (i, i + n_rot/2) instead of (2i, 2i+1)

layout(binding = 0) uniform usamplerBuffer POS;
layout(binding = 1) uniform usamplerBuffer SEQ;
layout(binding = 2) uniform usamplerBuffer V;
layout(binding = 3) uniform usamplerBuffer TAB; // [n_ctx][n_rot/2] (cos, sin)
layout(std430, binding = 4) buffer Q { float q[]; };
layout(std430, binding = 5) coherent buffer K { float k[]; };
layout(std430, binding = 6) buffer KC { uint kc[]; };
layout(std430, binding = 7) buffer VC { uint vc[]; };
layout(std430, binding = 8) buffer Status { uint status; };

layout(push_constant) uniform P {
    uint q_off, k_off;        // words
    uint v_off, pos_off, seq_off, tab_off; // bytes
    uint kc_off, vc_off;      // elements (f32 words or f16 halves) of the binding's seq_lo row
    uint n_head, n_head_kv, hd, n_rot, n_ctx;
    uint seq_lo, seq_hi;      // the sequences this dispatch's cache bindings hold
    uint rotate;              // this dispatch rotates q and k (the first window)
    uint avail_rows;          // cache rows (seq * n_ctx + pos) both caches hold
} p;

void store_half(uint which, uint h, uint bits, bool whole, uint lo_bits) {
    // Writes f16 `bits` at half index h; `whole`: also writes lo_bits at h-1
    // as one plain word store (both halves belong to this row).
    uint w = h >> 1;
    if (whole) {
        uint v = lo_bits | (bits << 16);
        if (which == 0u) kc[w] = v;
        else vc[w] = v;
        return;
    }
    uint sh = (h & 1u) * 16u;
    uint keep = ~(0xffffu << sh), set = bits << sh;
    if (which == 0u) {
        atomicAnd(kc[w], keep);
        atomicOr(kc[w], set);
    } else {
        atomicAnd(vc[w], keep);
        atomicOr(vc[w], set);
    }
}

void main() {
    uint t = gl_WorkGroupID.y, l = gl_LocalInvocationID.x;
    int pos = i32_at(POS, p.pos_off + t * 4u), seq = i32_at(SEQ, p.seq_off + t * 4u);
    bool bad_pos = pos < 0 || uint(pos) >= p.n_ctx;
    bool bad_seq = seq < 0 || (!bad_pos && uint(seq) * p.n_ctx + uint(pos) >= p.avail_rows);
    if (bad_pos || bad_seq) {
        if (p.rotate != 0u && l == 0u) atomicOr(status, (bad_pos ? ST_BAD_POS : 0u) | (bad_seq ? ST_BAD_SEQ : 0u));
        return;
    }
    uint half_rot = p.n_rot / 2u;
    uint kvw = p.n_head_kv * p.hd;
    if (p.rotate != 0u && half_rot > 0u) {
        uint nq = p.n_head * half_rot, nk = p.n_head_kv * half_rot;
        for (uint u = l; u < nq + nk; u += WG) {
            bool is_q = u < nq;
            uint v = is_q ? u : u - nq;
            uint h = v / half_rot, i = v % half_rot;
            uint a = NEOX ? i : 2u * i, b = NEOX ? i + half_rot : 2u * i + 1u;
            uint tw = (uint(pos) * half_rot + i) * 8u + p.tab_off;
            float c = f32_at(TAB, tw), s = f32_at(TAB, tw + 4u);
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
    if (uint(seq) < p.seq_lo || uint(seq) >= p.seq_hi) return;
    uint row = (uint(seq) - p.seq_lo) * p.n_ctx + uint(pos);
    uint kbase = p.k_off + t * kvw, vbase = p.v_off + t * kvw * 4u;
    if (!KV_F16) {
        for (uint e = l; e < kvw; e += WG) {
            kc[p.kc_off + row * kvw + e] = floatBitsToUint(k[kbase + e]);
            vc[p.vc_off + row * kvw + e] = word_at(V, (vbase + e * 4u) >> 2);
        }
        return;
    }
    // f16: walk the words that hold halves [h0, h0 + kvw) of each cache.
    [[unroll]] for (uint which = 0u; which < 2u; which++) {
        uint h0 = (which == 0u ? p.kc_off : p.vc_off) + row * kvw;
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
