#version 450
#extension GL_EXT_control_flow_attributes : require
#ifdef USE_SHUFFLE
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_shuffle : require
#endif
#include "common.glsl"
#include "kv.glsl"

// attn_flash: causal softmax(scale q K^T) V over the paged KV cache,
// FlashAttention style: the score matrix never exists. A workgroup owns a
// tile of query rows (BQ tokens x GH heads of one KV head group, so GQA
// heads share every K/V load) and walks the keys in tiles of KT: each tile
// is read once from the pools through the block table, converted to f32
// into shared memory, and used by every row; each row keeps an online
// softmax (running max m, running sum l, rescaled accumulator) in
// registers.
//
// C lanes share a row, each holding NV vec4s of q and of the accumulator
// (q . k partial sums meet through subgroup shuffles), so the same shader
// is a prefill kernel (many rows, few lanes each: 4 on the GPU entries of
// vk_tuning.c) and a decode kernel (one token: the GQA heads are the rows,
// a subgroup each). CPU devices run attn_lane.comp instead (shared memory
// is slow there). Grid: x = token tiles, y = KV head groups, z = key
// splits; with
// PARTIAL set, a split writes its (acc, m, l) for attn_reduce.comp to
// combine (flash-decoding), else the normalised output.
//
// Ragged batches: the tokens of a tile may belong to different sequences.
// The workgroup takes them a sequence at a time (almost always one pass);
// a row sees keys 0..pos of its own sequence.
layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 64;
layout(constant_id = 1) const uint C = 1;       // lanes per row: a power of two within a subgroup
layout(constant_id = 2) const uint NV = 16;     // vec4s of a head per lane (head_dim/4 padded, / C)
layout(constant_id = 3) const uint KT = 16;     // keys per tile
layout(constant_id = 4) const uint KVT = 1;     // KV_F32, KV_F16, KV_Q8_0
// f32/f16: 1 when every head's row starts on a texel and spans whole
// texels (then a fetch reads 4 f32 or 8 f16); 0 reads element by element.
layout(constant_id = 5) const uint ALIGNED = 0;
layout(constant_id = 6) const bool PARTIAL = false;

layout(binding = 0) uniform usamplerBuffer Qv;
layout(binding = 1) uniform usamplerBuffer POS;
layout(binding = 2) uniform usamplerBuffer SEQ;
layout(binding = 3) uniform usamplerBuffer BT;
layout(binding = 4) uniform usamplerBuffer KPv;
layout(binding = 5) uniform usamplerBuffer VPv;
layout(std430, binding = 6) writeonly buffer Out { float out_[]; };
layout(std430, binding = 7) buffer Status { uint status; };

layout(push_constant) uniform P {
    uint q_off, pos_off, seq_off, bt_off, kp_off, vp_off; // bytes
    uint out_off;                                          // words
    uint n_tok, n_head, n_head_kv, hd;
    uint block_size, n_blocks, max_blocks, n_seqs;
    float scale;
    uint n_split, chunk; // split s covers keys [s * chunk, (s + 1) * chunk)
    uint gh, bq;         // heads and tokens per workgroup (gh * bq <= WG / C)
    uint window;         // > 0: a row sees keys pos - window + 1 .. pos only
} p;

const uint RW = WG / C;   // rows
const uint HD4 = NV * C;  // vec4s of a head row in shared memory
shared vec4 k_sh[KT * HD4];
shared vec4 v_sh[KT * HD4];
shared uint key_row[KT];
shared int row_seq[RW], row_end[RW];
shared int seg_seq, seg_end, seg_lo;

const float NEG = -3.0e38; // a finite -inf: exp() of it underflows to 0 everywhere

// Element e..e+3 of a head row starting at byte `off`, element by element.
vec4 elems4(usamplerBuffer b, uint off, uint e) {
    vec4 r;
    [[unroll]] for (uint i = 0u; i < 4u; i++) {
        float x = 0.0;
        if (KVT == KV_F16) x = f16_bits(u16_at(b, off + (e + i) * 2u));
        else x = f32_at(b, off + (e + i) * 4u);
        r[i] = e + i < p.hd ? x : 0.0;
    }
    return r;
}

// Keys kb .. kb+n-1 (rows in key_row) of KV head kvh into k_sh/v_sh; the
// slots of keys >= n hold zeros (a masked key must not bring NaN from
// memory nobody wrote).
void load_tile(uint n, uint kvh, uint rb) {
    uint l = gl_LocalInvocationID.x;
    if (KVT == KV_Q8_0) {
        uint nbh = p.hd / 32u, jobs = KT * nbh;
        for (uint job = l; job < 2u * jobs; job += WG) {
            bool is_v = job >= jobs;
            uint r = is_v ? job - jobs : job, j = r / nbh, b = r % nbh;
            vec4 o[8];
            [[unroll]] for (uint i = 0u; i < 8u; i++) o[i] = vec4(0.0);
            if (j < n) {
                uint byte = key_row[j] * rb + (kvh * nbh + b) * 34u;
                float d;
                uint qw[8];
                if (is_v) load_q8_block(VPv, p.vp_off + byte, d, qw);
                else load_q8_block(KPv, p.kp_off + byte, d, qw);
                [[unroll]] for (uint i = 0u; i < 8u; i++) o[i] = d * i8x4(qw[i]);
            }
            [[unroll]] for (uint i = 0u; i < 8u; i++) {
                if (is_v) v_sh[j * HD4 + b * 8u + i] = o[i];
                else k_sh[j * HD4 + b * 8u + i] = o[i];
            }
        }
    } else if (ALIGNED != 0u) {
        // Whole texels: 8 f16 (two vec4) or 4 f32 (one).
        const uint per = KVT == KV_F16 ? 8u : 4u;
        uint nt = p.hd / per, jobs = KT * nt, eb = KVT == KV_F16 ? 2u : 4u;
        for (uint job = l; job < 2u * jobs; job += WG) {
            bool is_v = job >= jobs;
            uint r = is_v ? job - jobs : job, j = r / nt, u = r % nt;
            uvec4 t = uvec4(0u);
            if (j < n) {
                int at = int((key_row[j] * rb + kvh * p.hd * eb) / 16u + u);
                t = is_v ? texelFetch(VPv, int(p.vp_off / 16u) + at) : texelFetch(KPv, int(p.kp_off / 16u) + at);
            }
            if (KVT == KV_F16) {
                vec4 a = vec4(unpackHalf2x16(t.x), unpackHalf2x16(t.y)), b = vec4(unpackHalf2x16(t.z), unpackHalf2x16(t.w));
                if (is_v) {
                    v_sh[j * HD4 + 2u * u] = a;
                    v_sh[j * HD4 + 2u * u + 1u] = b;
                } else {
                    k_sh[j * HD4 + 2u * u] = a;
                    k_sh[j * HD4 + 2u * u + 1u] = b;
                }
            } else {
                if (is_v) v_sh[j * HD4 + u] = uintBitsToFloat(t);
                else k_sh[j * HD4 + u] = uintBitsToFloat(t);
            }
        }
    } else {
        uint nc = (p.hd + 3u) / 4u, jobs = KT * nc, eb = KVT == KV_F16 ? 2u : 4u;
        for (uint job = l; job < 2u * jobs; job += WG) {
            bool is_v = job >= jobs;
            uint r = is_v ? job - jobs : job, j = r / nc, u = r % nc;
            vec4 o = vec4(0.0);
            if (j < n) {
                uint off = key_row[j] * rb + kvh * p.hd * eb;
                o = is_v ? elems4(VPv, p.vp_off + off, 4u * u) : elems4(KPv, p.kp_off + off, 4u * u);
            }
            if (is_v) v_sh[j * HD4 + u] = o;
            else k_sh[j * HD4 + u] = o;
        }
    }
}

void main() {
    uint l = gl_LocalInvocationID.x, r = l / C, c = l % C;
    uint G = p.n_head / p.n_head_kv, n_hg = (G + p.gh - 1u) / p.gh;
    uint kvh = gl_WorkGroupID.y / n_hg, g = (gl_WorkGroupID.y % n_hg) * p.gh + r % p.gh;
    uint t = gl_WorkGroupID.x * p.bq + r / p.gh;
    uint split = gl_WorkGroupID.z;
    bool live = r < p.gh * p.bq && t < p.n_tok && g < G;
    uint h = kvh * G + g;
    uint kvw = p.n_head_kv * p.hd, rb = kv_row_bytes(KVT, kvw);

    int pos = -1, seq = -1;
    bool bad = false;
    if (live) {
        pos = i32_at(POS, p.pos_off + t * 4u);
        seq = i32_at(SEQ, p.seq_off + t * 4u);
        // Past the splits (planned for fewer keys): an error, not fewer keys.
        bool bad_pos = pos < 0 || uint(pos) / p.block_size >= p.max_blocks || uint(pos) >= p.n_split * p.chunk;
        bool bad_seq = seq < 0 || uint(seq) >= p.n_seqs;
        bad = bad_pos || bad_seq;
        if (bad && g == 0u && c == 0u && split == 0u && gl_WorkGroupID.y == 0u)
            atomicOr(status, (bad_pos ? ST_BAD_POS : 0u) | (bad_seq ? ST_BAD_SEQ : 0u));
    }
    bool valid = live && !bad; // a real row with a usable position and sequence
    uint klo = split * p.chunk, khi = klo + p.chunk;

    // q, pre-scaled: lane c holds vec4s c, c + C, ... of the head.
    vec4 qv[NV], acc[NV];
    uint qrow = p.q_off + (t * p.n_head + h) * p.hd * 4u;
    [[unroll]] for (uint i = 0u; i < NV; i++) {
        uint e = (i * C + c) * 4u;
        vec4 x = vec4(0.0);
        if (valid) [[unroll]] for (uint k = 0u; k < 4u; k++) x[k] = e + k < p.hd ? f32_at(Qv, qrow + (e + k) * 4u) : 0.0;
        qv[i] = x * p.scale;
        acc[i] = vec4(0.0);
    }
    float m = NEG, lsum = 0.0;

    // Padding vec4s past the head (head_dim/4 rounded up to NV * C) stay 0.
    for (uint u = l; u < KT * HD4; u += WG) {
        if (u % HD4 >= (p.hd + 3u) / 4u) {
            k_sh[u] = vec4(0.0);
            v_sh[u] = vec4(0.0);
        }
    }
    if (c == 0u) {
        row_seq[r] = valid ? seq : -1;
        row_end[r] = pos + 1;
    }
    for (;;) {
        barrier();
        if (l == 0u) {
            // The next sequence among the rows left, how far its rows see,
            // and (sliding window) the first key any of them sees.
            int s = -1, e = 0, b = 0x7fffffff;
            for (uint i = 0u; i < RW; i++) {
                if (row_seq[i] < 0) continue;
                if (s < 0) s = row_seq[i];
                if (row_seq[i] == s) e = max(e, row_end[i]), b = min(b, row_end[i]);
            }
            seg_seq = s;
            seg_end = int(min(uint(e), khi));
            seg_lo = p.window == 0u ? 0 : max(0, b - int(p.window));
        }
        barrier();
        int S = seg_seq;
        if (S < 0) break;
        uint E = uint(seg_end);
        bool mine = valid && seq == S;
        for (uint kb = max(klo, uint(seg_lo)); kb < E; kb += KT) {
            uint n = min(KT, E - kb);
            for (uint j = l; j < KT; j += WG) {
                bool bad_blk = false;
                key_row[j] = j < n ? kv_row(BT, p.bt_off, uint(S), kb + j, p.block_size, p.max_blocks, p.n_blocks, bad_blk) : 0u;
                if (bad_blk) atomicOr(status, ST_BAD_BLOCK);
            }
            barrier();
            load_tile(n, kvh, rb);
            barrier();
            float s[KT];
            [[unroll]] for (uint j = 0u; j < KT; j++) {
                float d = 0.0;
                [[unroll]] for (uint i = 0u; i < NV; i++) d += dot(qv[i], k_sh[j * HD4 + i * C + c]);
                s[j] = d;
            }
#ifdef USE_SHUFFLE
            [[unroll]] for (uint o = 1u; o < C; o <<= 1)
                [[unroll]] for (uint j = 0u; j < KT; j++) s[j] += subgroupShuffleXor(s[j], o);
#endif
            float mt = m;
            [[unroll]] for (uint j = 0u; j < KT; j++) {
                bool ok = mine && j < n && int(kb + j) <= pos && (p.window == 0u || int(kb + j) > pos - int(p.window));
                s[j] = ok ? s[j] : NEG;
                mt = max(mt, s[j]);
            }
            float corr = exp(m - mt), sum = 0.0;
            [[unroll]] for (uint i = 0u; i < NV; i++) acc[i] *= corr;
            [[unroll]] for (uint j = 0u; j < KT; j++) {
                float pj = s[j] > NEG ? exp(s[j] - mt) : 0.0;
                sum += pj;
                [[unroll]] for (uint i = 0u; i < NV; i++) acc[i] += pj * v_sh[j * HD4 + i * C + c];
            }
            lsum = lsum * corr + sum;
            m = mt;
            barrier();
        }
        if (mine && c == 0u) row_seq[r] = -1;
    }

    if (!live) return;
    if (PARTIAL) {
        uint base = p.out_off + ((t * p.n_head + h) * p.n_split + split) * (p.hd + 2u);
        [[unroll]] for (uint i = 0u; i < NV; i++)
            [[unroll]] for (uint k = 0u; k < 4u; k++) {
                uint e = (i * C + c) * 4u + k;
                if (e < p.hd) out_[base + e] = acc[i][k];
            }
        if (c == 0u) {
            out_[base + p.hd] = m;
            out_[base + p.hd + 1u] = lsum;
        }
        return;
    }
    float inv = lsum > 0.0 ? 1.0 / lsum : 0.0;
    uint o = p.out_off + (t * p.n_head + h) * p.hd;
    [[unroll]] for (uint i = 0u; i < NV; i++)
        [[unroll]] for (uint k = 0u; k < 4u; k++) {
            uint e = (i * C + c) * 4u + k;
            if (e < p.hd) out_[o + e] = acc[i][k] * inv;
        }
}
