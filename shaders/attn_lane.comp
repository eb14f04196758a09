#version 450
#extension GL_EXT_control_flow_attributes : require
#ifdef USE_SHUFFLE
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_shuffle : require
#extension GL_KHR_shader_subgroup_arithmetic : require
#endif
#include "common.glsl"
#include "kv.glsl"

// attn_lane: attention over the paged KV cache for CPU devices (lavapipe),
// the shared-memory-free shape of attn_flash.comp. On a CPU device a
// workgroup runs on one core with its invocations as SIMD lanes; shared
// memory is accessed lane by lane while texel fetches are vector gathers.
// So here a row (token, head, key split) belongs to C lanes that stream
// its keys straight from the pools: each lane reads its own slice of every
// K and V row (one texel: the C lanes read C neighbouring texels, one
// gather), the slices' q . k partial sums meet through subgroup shuffles,
// and every lane keeps the online softmax (running max m, running sum l)
// and the accumulator of its slice in registers. No shared memory, no
// barriers.
//
// Splits (flash-decoding) give a single decode token enough rows to fill
// the cores; with PARTIAL set a split writes (acc, m, l) for
// attn_reduce.comp, else the normalised output. Same bindings and push
// constants as attn_flash.comp. Grid: x = ceil(rows * C / WG), rows =
// n_tok * n_head * n_split.
layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 8;
layout(constant_id = 1) const uint C = 1;   // lanes per row (a power of two within a subgroup)
layout(constant_id = 2) const uint NU = 1;  // units of a head per lane (see UNIT)
layout(constant_id = 3) const uint KVT = 1; // KV_F32, KV_F16, KV_Q8_0
// f32/f16: 1 when head rows start on texels and span whole ones (f32: 4 a
// fetch, f16: 8); 0: element by element. q8_0: 1 when head rows start on
// words and hold whole pairs of blocks (head_dim % 64 == 0), read a pair at
// a time.
layout(constant_id = 4) const uint ALIGNED = 0;
layout(constant_id = 5) const bool PARTIAL = false;
// C == the subgroup size and subgroup arithmetic: the C partial sums meet
// through one subgroupAdd (a horizontal reduction on CPU devices) instead of
// log2(C) shuffles.
layout(constant_id = 6) const bool SG_ADD = false;

// A lane's slice is NU units; unit u of a head covers elements
// [u * UNIT, (u + 1) * UNIT): a texel (f32: 4, f16: 8), a q8_0 block (a
// quarter of one when several lanes share a row), or 4 elements read one
// by one.
const uint UNIT = KVT == KV_Q8_0 ? (C == 1u ? 32u : 8u) : ALIGNED == 0u ? 4u : KVT == KV_F16 ? 8u : 4u;
const uint V4 = UNIT / 4u; // vec4s per unit
const uint KB = 4u;        // keys per softmax step
const bool Q8_BLOCKS = KVT == KV_Q8_0 && UNIT == 32u; // a lane owns whole q8_0 blocks (C == 1)
const bool Q8_PAIRS = Q8_BLOCKS && ALIGNED != 0u;     // ... read two at a time

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
    uint gh, bq;         // (attn_flash only)
    uint window;         // > 0: a row sees keys pos - window + 1 .. pos only
} p;

const float NEG = -3.0e38; // a finite -inf: exp() of it underflows to 0 everywhere

// Unit u of the head row that starts `off` bytes into view c, as V4 vec4s
// (elements past head_dim read as 0).
void load_unit(usamplerBuffer c, uint off, uint u, out vec4 x[V4]) {
    if (KVT == KV_Q8_0 && UNIT == 32u) {
        float d;
        uint qw[8];
        load_q8_block(c, off + u * 34u, d, qw);
        [[unroll]] for (uint i = 0u; i < 8u; i++) x[i] = d * i8x4(qw[i]);
    } else if (KVT == KV_Q8_0) {
        // Quarter u % 4 of block u / 4: its scale, then 8 int8 at a 2-byte
        // aligned offset (two words, across at most two texels).
        uint blk = off + (u >> 2) * 34u, qb = blk + 2u + (u & 3u) * 8u;
        float d = f16_bits(u16_at(c, blk));
        int t0 = int(qb >> 4);
        uvec4 a = texelFetch(c, t0), b = texelFetch(c, t0 + 1);
        uint w0 = (qb & 15u) >> 2;
        uint x0 = word12(a, b, b, w0), x1 = word12(a, b, b, w0 + 1u), x2 = word12(a, b, b, w0 + 2u);
        bool odd = (qb & 2u) != 0u;
        x[0] = d * i8x4(odd ? (x0 >> 16) | (x1 << 16) : x0);
        x[V4 - 1u] = d * i8x4(odd ? (x1 >> 16) | (x2 << 16) : x1);
    } else if (ALIGNED != 0u) {
        uvec4 t = texelFetch(c, int((off >> 4) + u));
        if (KVT == KV_F16) {
            x[0] = vec4(unpackHalf2x16(t.x), unpackHalf2x16(t.y));
            x[V4 - 1u] = vec4(unpackHalf2x16(t.z), unpackHalf2x16(t.w));
        } else {
            x[0] = uintBitsToFloat(t);
        }
    } else {
        vec4 r;
        [[unroll]] for (uint i = 0u; i < 4u; i++) {
            uint e = u * 4u + i;
            float v = KVT == KV_F16 ? f16_bits(u16_at(c, off + e * 2u)) : f32_at(c, off + e * 4u);
            r[i] = e < p.hd ? v : 0.0;
        }
        x[0] = r;
    }
}

void main() {
    uint l = gl_LocalInvocationID.x, c = l % C;
    uint row = gl_WorkGroupID.x * (WG / C) + l / C;
    bool live = row < p.n_tok * p.n_head * p.n_split;
    uint split = row % p.n_split, pair = row / p.n_split;
    uint t = live ? pair / p.n_head : 0u, h = live ? pair % p.n_head : 0u;
    uint kvh = h / (p.n_head / p.n_head_kv), kvw = p.n_head_kv * p.hd;
    uint rb = kv_row_bytes(KVT, kvw);
    uint hoff = KVT == KV_Q8_0 ? kvh * (p.hd / 32u) * 34u : kvh * p.hd * (KVT == KV_F32 ? 4u : 2u);
    uint n_units = (p.hd + UNIT - 1u) / UNIT;

    int pos = i32_at(POS, p.pos_off + t * 4u), seq = i32_at(SEQ, p.seq_off + t * 4u);
    // Past the splits (the host planned them for fewer keys): an error, not
    // silently fewer keys.
    bool bad_pos = pos < 0 || uint(pos) / p.block_size >= p.max_blocks || uint(pos) >= p.n_split * p.chunk;
    bool bad_seq = seq < 0 || uint(seq) >= p.n_seqs;
    bool bad = live && (bad_pos || bad_seq);
    if (bad && h == 0u && split == 0u && c == 0u)
        atomicOr(status, (bad_pos ? ST_BAD_POS : 0u) | (bad_seq ? ST_BAD_SEQ : 0u));
    uint klo = split * p.chunk;
    uint kend = live && !bad ? min(uint(pos) + 1u, klo + p.chunk) : 0u; // keys [klo, kend)
    // A sliding window starts the row's keys at pos - window + 1.
    if (p.window != 0u && kend > 0u && uint(pos) + 1u > p.window) klo = max(klo, uint(pos) + 1u - p.window);

    // q, pre-scaled: this lane's units c, c + C, ... (read once, element by element).
    vec4 qv[NU * V4], acc[NU * V4];
    uint qrow = p.q_off + (t * p.n_head + h) * p.hd * 4u;
    [[unroll]] for (uint i = 0u; i < NU; i++)
        [[unroll]] for (uint k = 0u; k < V4; k++) {
            uint e = (i * C + c) * UNIT + k * 4u;
            vec4 x;
            [[unroll]] for (uint j = 0u; j < 4u; j++) x[j] = e + j < p.hd ? f32_at(Qv, qrow + (e + j) * 4u) : 0.0;
            qv[i * V4 + k] = x * p.scale;
            acc[i * V4 + k] = vec4(0.0);
        }
    float m = NEG, lsum = 0.0;
    bool bad_blk = false;
    // Block by block: one table lookup per block_size keys, then KB keys
    // per step: one running-max update and rescale per step (KB + 1 exps,
    // not 2 KB), and each unit of the head is loaded for all KB keys before
    // it is used, so a chunk of q or of the accumulator (registers spill on
    // CPU devices: a head is 2 x head_dim floats a lane) is touched once per
    // step, not once per key. The C lanes of a row run the same loop (same
    // bounds), so the shuffles stay in step. Keys past the range read the
    // last valid row (a real, written one) with weight exp(NEG) = 0.
    for (uint b0 = klo - klo % p.block_size; b0 < kend; b0 += p.block_size) {
        uint row0 = kv_row(BT, p.bt_off, uint(seq), b0, p.block_size, p.max_blocks, p.n_blocks, bad_blk);
        uint j0 = max(b0, klo), j1 = min(b0 + p.block_size, kend);
        for (uint j = j0; j < j1; j += KB) {
            uint off[KB];
            float s[KB];
            [[unroll]] for (uint q = 0u; q < KB; q++) {
                off[q] = (row0 + min(j + q, j1 - 1u) - b0) * rb + hoff;
                s[q] = 0.0;
            }
            [[unroll]] for (uint i = 0u; i < NU; i++) {
                uint u = min(i * C + c, n_units - 1u);
                bool in_head = i * C + c < n_units;
                if (Q8_PAIRS) {
                    // Blocks i and i + 1 (odd i: done with i - 1).
                    if ((i & 1u) != 0u) continue;
                    float sc[KB][2];
                    uint qw[KB][2][8];
                    [[unroll]] for (uint q = 0u; q < KB; q++)
                        load_q8_pair(KPv, p.kp_off + off[q] + i * 34u, sc[q][0], sc[q][1], qw[q][0], qw[q][1]);
                    [[unroll]] for (uint h = 0u; h < 2u; h++) {
                        float bd[KB];
                        [[unroll]] for (uint q = 0u; q < KB; q++) bd[q] = 0.0;
                        [[unroll]] for (uint e = 0u; e < 8u; e++) {
                            vec4 qe = qv[(i + h) * 8u + e];
                            [[unroll]] for (uint q = 0u; q < KB; q++) bd[q] += dot(qe, i8x4(qw[q][h][e]));
                        }
                        [[unroll]] for (uint q = 0u; q < KB; q++) s[q] += sc[q][h] * bd[q];
                    }
                } else if (Q8_BLOCKS) {
                    // Whole blocks: a block's scale multiplies its sum once.
                    float sc[KB];
                    uint qw[KB][8];
                    [[unroll]] for (uint q = 0u; q < KB; q++) load_q8_block(KPv, p.kp_off + off[q] + u * 34u, sc[q], qw[q]);
                    float bd[KB];
                    [[unroll]] for (uint q = 0u; q < KB; q++) bd[q] = 0.0;
                    [[unroll]] for (uint e = 0u; e < 8u; e++) {
                        vec4 qe = qv[i * 8u + e];
                        [[unroll]] for (uint q = 0u; q < KB; q++) bd[q] += dot(qe, i8x4(qw[q][e]));
                    }
                    [[unroll]] for (uint q = 0u; q < KB; q++) s[q] += sc[q] * bd[q];
                } else {
                    vec4 k[KB][V4];
                    [[unroll]] for (uint q = 0u; q < KB; q++) load_unit(KPv, p.kp_off + off[q], u, k[q]);
                    [[unroll]] for (uint e = 0u; e < V4; e++) {
                        vec4 qe = in_head ? qv[i * V4 + e] : vec4(0.0);
                        [[unroll]] for (uint q = 0u; q < KB; q++) s[q] += dot(qe, k[q][e]);
                    }
                }
            }
#ifdef USE_SHUFFLE
            if (SG_ADD) {
                [[unroll]] for (uint q = 0u; q < KB; q++) s[q] = subgroupAdd(s[q]);
            } else {
                [[unroll]] for (uint o = 1u; o < C; o <<= 1)
                    [[unroll]] for (uint q = 0u; q < KB; q++) s[q] += subgroupShuffleXor(s[q], o);
            }
#endif
            float mn = m;
            [[unroll]] for (uint q = 0u; q < KB; q++) {
                s[q] = j + q < j1 ? s[q] : NEG;
                mn = max(mn, s[q]);
            }
            float corr = exp(m - mn), w[KB];
            lsum *= corr;
            [[unroll]] for (uint q = 0u; q < KB; q++) {
                w[q] = exp(s[q] - mn);
                lsum += w[q];
            }
            m = mn;
            [[unroll]] for (uint i = 0u; i < NU; i++) {
                uint u = min(i * C + c, n_units - 1u);
                if (Q8_PAIRS) {
                    if ((i & 1u) != 0u) continue;
                    float sc[KB][2];
                    uint qw[KB][2][8];
                    [[unroll]] for (uint q = 0u; q < KB; q++)
                        load_q8_pair(VPv, p.vp_off + off[q] + i * 34u, sc[q][0], sc[q][1], qw[q][0], qw[q][1]);
                    [[unroll]] for (uint h = 0u; h < 2u; h++)
                        [[unroll]] for (uint e = 0u; e < 8u; e++) {
                            vec4 a = acc[(i + h) * 8u + e] * corr;
                            [[unroll]] for (uint q = 0u; q < KB; q++) a += (sc[q][h] * w[q]) * i8x4(qw[q][h][e]);
                            acc[(i + h) * 8u + e] = a;
                        }
                } else if (Q8_BLOCKS) {
                    // The block's scale folds into the weight.
                    float sc[KB];
                    uint qw[KB][8];
                    [[unroll]] for (uint q = 0u; q < KB; q++) load_q8_block(VPv, p.vp_off + off[q] + u * 34u, sc[q], qw[q]);
                    [[unroll]] for (uint q = 0u; q < KB; q++) sc[q] *= w[q];
                    [[unroll]] for (uint e = 0u; e < 8u; e++) {
                        vec4 a = acc[i * 8u + e] * corr;
                        [[unroll]] for (uint q = 0u; q < KB; q++) a += sc[q] * i8x4(qw[q][e]);
                        acc[i * 8u + e] = a;
                    }
                } else {
                    vec4 v[KB][V4];
                    [[unroll]] for (uint q = 0u; q < KB; q++) load_unit(VPv, p.vp_off + off[q], u, v[q]);
                    [[unroll]] for (uint e = 0u; e < V4; e++) {
                        vec4 a = acc[i * V4 + e] * corr;
                        [[unroll]] for (uint q = 0u; q < KB; q++) a += w[q] * v[q][e];
                        acc[i * V4 + e] = a;
                    }
                }
            }
        }
    }
    if (bad_blk && c == 0u) atomicOr(status, ST_BAD_BLOCK);

    if (!live) return;
    uint base = PARTIAL ? p.out_off + ((t * p.n_head + h) * p.n_split + split) * (p.hd + 2u)
                        : p.out_off + (t * p.n_head + h) * p.hd;
    float inv = PARTIAL ? 1.0 : lsum > 0.0 ? 1.0 / lsum : 0.0;
    [[unroll]] for (uint i = 0u; i < NU; i++)
        [[unroll]] for (uint k = 0u; k < V4; k++)
            [[unroll]] for (uint j = 0u; j < 4u; j++) {
                uint e = (i * C + c) * UNIT + k * 4u + j;
                if (e < p.hd) out_[base + e] = acc[i * V4 + k][j] * inv;
            }
    if (PARTIAL && c == 0u) {
        out_[base + p.hd] = m;
        out_[base + p.hd + 1u] = lsum;
    }
}
