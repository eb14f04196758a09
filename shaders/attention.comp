#version 450
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"

// attention: out[t][h] = softmax(scale * q[t][h] . K[seq][0..pos]) V, causal,
// with grouped KV heads. The n x n score matrix never exists: each lane runs
// an online softmax (running max, running sum, running weighted V in
// registers: HD4 vec4s, a specialization constant) over its keys.
//
// SPLIT lanes share one (token, head) pair and take keys j = s, s + SPLIT,
// ...; their partial results then merge through shared memory. SPLIT = 1
// (CPU devices: lanes are SIMD lanes, and every (token, head) pair is
// already a lane) needs no merge at all; GPUs split long contexts across
// lanes. Grid: x = ceil(n_tokens * n_head / (WG / SPLIT)).
layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 8;
layout(constant_id = 1) const int HD4 = 16;
layout(constant_id = 2) const uint SPLIT = 1;
layout(constant_id = 3) const bool KV_F16 = false;
// 0: read elements one by one; 1: every 4-element group of a head's row
// (and q) starts a half (f16) or whole (f32) texel; 2 (f16): rows are whole
// texels, 8 elements a fetch.
layout(constant_id = 4) const uint ALIGNED = 0;

layout(binding = 0) uniform usamplerBuffer Qv;
layout(binding = 1) uniform usamplerBuffer POS;
layout(binding = 2) uniform usamplerBuffer SEQ;
layout(binding = 3) uniform usamplerBuffer KC;
layout(binding = 4) uniform usamplerBuffer VC;
layout(std430, binding = 5) writeonly buffer Out { float out_[]; };
layout(std430, binding = 6) buffer Status { uint status; };

layout(push_constant) uniform P {
    uint q_off, pos_off, seq_off, kc_off, vc_off; // bytes
    uint out_off;                                  // words
    uint n_head, n_head_kv, hd, n_ctx, n_tok;
    float scale;
    uint avail_rows; // cache rows (seq * n_ctx + pos) both caches hold
} p;

// Merge buffers, one slot per lane (a single slot when SPLIT == 1).
const uint NM = SPLIT > 1u ? WG : 1u;
shared float sm_m[NM], sm_l[NM];
shared vec4 sm_acc[NM][HD4];

// Elements e..e+3 of a cache row that starts `off` bytes into its view.
vec4 kv4(usamplerBuffer c, uint off, uint e) {
    if (!KV_F16) {
        if (ALIGNED != 0u) return uintBitsToFloat(texelFetch(c, int((off >> 4) + (e >> 2))));
        vec4 r;
        [[unroll]] for (uint i = 0u; i < 4u; i++) r[i] = e + i < p.hd ? f32_at(c, off + (e + i) * 4u) : 0.0;
        return r;
    }
    if (ALIGNED != 0u) {
        uint byte = off + e * 2u;
        uvec4 t = texelFetch(c, int(byte >> 4));
        bool hi = (byte & 8u) != 0u;
        return vec4(unpackHalf2x16(hi ? t.z : t.x), unpackHalf2x16(hi ? t.w : t.y));
    }
    vec4 r;
    [[unroll]] for (uint i = 0u; i < 4u; i++) r[i] = e + i < p.hd ? f16_bits(u16_at(c, off + (e + i) * 2u)) : 0.0;
    return r;
}

// q . K[row] and acc += w * V[row]: one texel per 8 f16 elements when the
// rows are whole texels, else 4 elements at a time.
float qk(vec4 qv[HD4], uint off) {
    float s = 0.0;
    if (ALIGNED == 2u) {
        [[unroll]] for (int i = 0; i < HD4; i += 2) {
            uvec4 t = texelFetch(KC, int((off >> 4) + uint(i / 2)));
            s += dot(qv[i], vec4(unpackHalf2x16(t.x), unpackHalf2x16(t.y)));
            if (i + 1 < HD4) s += dot(qv[i + 1], vec4(unpackHalf2x16(t.z), unpackHalf2x16(t.w)));
        }
    } else {
        [[unroll]] for (int i = 0; i < HD4; i++) s += dot(qv[i], kv4(KC, off, uint(i) * 4u));
    }
    return s;
}

void main() {
    uint l = gl_LocalInvocationID.x;
    uint pair = gl_WorkGroupID.x * (WG / SPLIT) + l / SPLIT, sub = l % SPLIT;
    bool live = pair < p.n_tok * p.n_head;
    uint t = live ? pair / p.n_head : 0u, h = live ? pair % p.n_head : 0u;
    uint kvh = h / (p.n_head / p.n_head_kv), kvw = p.n_head_kv * p.hd;
    uint o = p.out_off + (t * p.n_head + h) * p.hd;
    int pos = i32_at(POS, p.pos_off + t * 4u), seq = i32_at(SEQ, p.seq_off + t * 4u);
    bool bad_pos = pos < 0 || uint(pos) >= p.n_ctx;
    bool bad_seq = seq < 0 || (!bad_pos && uint(seq) * p.n_ctx + uint(pos) >= p.avail_rows);
    bool bad = live && (bad_pos || bad_seq);
    if (bad && h == 0u && sub == 0u) atomicOr(status, (bad_pos ? ST_BAD_POS : 0u) | (bad_seq ? ST_BAD_SEQ : 0u));
    int last = live && !bad ? pos : -1; // keys 0..last

    vec4 qv[HD4];
    uint qrow = p.q_off + (t * p.n_head + h) * p.hd * 4u;
    [[unroll]] for (int i = 0; i < HD4; i++) {
        uint e = uint(i) * 4u;
        if (ALIGNED != 0u) qv[i] = uintBitsToFloat(texelFetch(Qv, int((qrow >> 4) + uint(i))));
        else [[unroll]] for (uint c = 0u; c < 4u; c++) qv[i][c] = e + c < p.hd ? f32_at(Qv, qrow + (e + c) * 4u) : 0.0;
    }

    // A finite "minus infinity": exp() of it underflows to 0 without relying
    // on how a driver treats exp(-inf).
    float m = -3.0e38, lsum = 0.0;
    vec4 acc[HD4];
    [[unroll]] for (int i = 0; i < HD4; i++) acc[i] = vec4(0.0);
    const uint eb = KV_F16 ? 2u : 4u;
    for (int j = int(sub); j <= last; j += int(SPLIT)) {
        uint row = (uint(seq) * p.n_ctx + uint(j)) * kvw + kvh * p.hd;
        float s = qk(qv, p.kc_off + row * eb) * p.scale;
        float mn = max(m, s);
        float corr = exp(m - mn), w = exp(s - mn);
        lsum = lsum * corr + w;
        uint voff = p.vc_off + row * eb;
        if (ALIGNED == 2u) {
            [[unroll]] for (int i = 0; i < HD4; i += 2) {
                uvec4 tv = texelFetch(VC, int((voff >> 4) + uint(i / 2)));
                acc[i] = acc[i] * corr + w * vec4(unpackHalf2x16(tv.x), unpackHalf2x16(tv.y));
                if (i + 1 < HD4) acc[i + 1] = acc[i + 1] * corr + w * vec4(unpackHalf2x16(tv.z), unpackHalf2x16(tv.w));
            }
        } else {
            [[unroll]] for (int i = 0; i < HD4; i++) acc[i] = acc[i] * corr + w * kv4(VC, voff, uint(i) * 4u);
        }
        m = mn;
    }

    if (SPLIT == 1u) {
        if (!live) return;
        float inv = lsum > 0.0 ? 1.0 / lsum : 0.0;
        [[unroll]] for (int i = 0; i < HD4; i++)
            [[unroll]] for (uint c = 0u; c < 4u; c++)
                if (uint(i) * 4u + c < p.hd) out_[o + uint(i) * 4u + c] = acc[i][c] * inv;
        return;
    }
    sm_m[l] = m;
    sm_l[l] = lsum;
    [[unroll]] for (int i = 0; i < HD4; i++) sm_acc[l][i] = acc[i];
    barrier();
    if (!live) return;
    // The lanes of this pair merge their partial results, each writing
    // a share of the head's elements.
    uint base = l - sub;
    float mx = sm_m[base];
    for (uint s = 1u; s < SPLIT; s++) mx = max(mx, sm_m[base + s]);
    float total = 0.0;
    for (uint s = 0u; s < SPLIT; s++) total += sm_l[base + s] * exp(sm_m[base + s] - mx);
    float inv = total > 0.0 ? 1.0 / total : 0.0;
    for (uint d = sub; d < p.hd; d += SPLIT) {
        float v = 0.0;
        for (uint s = 0u; s < SPLIT; s++) v += sm_acc[base + s][d >> 2][d & 3u] * exp(sm_m[base + s] - mx);
        out_[o + d] = v * inv;
    }
}
