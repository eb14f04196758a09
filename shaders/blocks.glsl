// blocks.glsl — GGUF's block weight types beyond q8_0, read 32 weights (a
// "chunk") at a time, for the matmul and embed shaders. Needs common.glsl.
//
// Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL are one chunk a block; Q2_K, Q3_K, Q4_K,
// Q5_K, Q6_K, IQ4_XS are super-blocks of 8 chunks. Layouts: the structs of
// backends/backend.h; values: backends/quants.c's dequantizers, which these
// reproduce bit for bit (see blk_chunk).
//
// A chunk comes out as its 32 codes q, packed int8 in 8 words (byte j of
// word k is weight 4k + j), and a scale s and a min m per 16 weights:
//     w = s * q - m
// where q is signed wherever the type has a fixed offset (q4_0's q - 8,
// q3_K's q - 4, q6_K's q - 32, ...), so m is non-zero only for the types
// with a real min (Q4_1, Q5_1, Q2_K, Q4_K, Q5_K; blk_has_min). Against a
// q8_0 activation block (scale dx, quants qx) a chunk contributes
//     dx * (s.x * sum_lo(q qx) + s.y * sum_hi(q qx)) - dot(m, dx * (sum_lo qx, sum_hi qx)).
// All codes fit int8 (|q| <= 127), so the int8 dot products of the q8_0
// path apply unchanged.
//
// The type is a function argument that the shaders pass from a
// specialization constant: a pipeline's compiler folds every test on it,
// and one SPIR-V module serves all eleven types.
//
// Reading: a block starts at any even byte (rows are whole blocks of an
// even size, and the HAL allows rows at any 2-byte offset). blk_ld* fetch
// the texels holding a byte range and shift the words into place by the
// range's word and half-word phase, as load_q8_block does; texel indices are
// clamped to the view (blk_last, which the shader sets from textureSize),
// so a range that ends early in its last texel never reads past the view.

#define DT_Q4_0 2u
#define DT_Q4_1 3u
#define DT_Q5_0 6u
#define DT_Q5_1 7u
#define DT_Q2_K 10u
#define DT_Q3_K 11u
#define DT_Q4_K 12u
#define DT_Q5_K 13u
#define DT_Q6_K 14u
#define DT_IQ4_NL 20u
#define DT_IQ4_XS 23u

bool blk_is_block(uint dt) {
    return dt == DT_Q4_0 || dt == DT_Q4_1 || dt == DT_Q5_0 || dt == DT_Q5_1 || dt == DT_IQ4_NL || dt == DT_Q2_K ||
           dt == DT_Q3_K || dt == DT_Q4_K || dt == DT_Q5_K || dt == DT_Q6_K || dt == DT_IQ4_XS;
}

// Bytes per block.
uint blk_bytes(uint dt) {
    return dt == DT_Q4_0 || dt == DT_IQ4_NL ? 18u
         : dt == DT_Q4_1                    ? 20u
         : dt == DT_Q5_0                    ? 22u
         : dt == DT_Q5_1                    ? 24u
         : dt == DT_Q2_K                    ? 84u
         : dt == DT_Q3_K                    ? 110u
         : dt == DT_Q4_K                    ? 144u
         : dt == DT_Q5_K                    ? 176u
         : dt == DT_Q6_K                    ? 210u
                                            : 136u; // IQ4_XS
}

// Chunks (32 weights) per block.
uint blk_chunks(uint dt) {
    return (dt >= DT_Q2_K && dt <= DT_Q6_K) || dt == DT_IQ4_XS ? 8u : 1u;
}

// Blocks per whole number of texels: in a row that starts on a texel, block
// j's phase (byte offset in its texel) repeats with this period.
uint blk_group(uint dt) {
    return dt == DT_Q4_K || dt == DT_Q5_K          ? 1u
         : dt == DT_Q5_1 || dt == DT_IQ4_XS        ? 2u
         : dt == DT_Q4_1 || dt == DT_Q2_K          ? 4u
                                                   : 8u; // 18, 22, 110, 210 bytes
}

bool blk_has_min(uint dt) {
    return dt == DT_Q4_1 || dt == DT_Q5_1 || dt == DT_Q2_K || dt == DT_Q4_K || dt == DT_Q5_K;
}

// The last texel of the weights' view: a shader sets it once, before any
// load (textureSize per load costs as much as a fetch on CPU devices).
int blk_last;

// Defines `void FN(usamplerBuffer b, int tex, uint ph, out uint o[NW])`:
// o[k] = the 32 bits at byte 16 * tex + ph + 4k (ph even, any size), from
// NT texel fetches. NT texels hold any 16 * NT - 14 bytes that start on an
// even byte; words past those are undefined. NW <= 4 * NT - 1. Where ph is
// a compile-time constant (the aligned paths of the shaders) the shifting
// folds away.
#define DEFINE_BLK_LOAD(FN, NT, NW)                                                                   \
    void FN(usamplerBuffer b, int tex, uint ph, out uint o[NW]) {                                     \
        int base = tex + int(ph >> 4);                                                                \
        uint u[4 * NT + 3];                                                                           \
        [[unroll]] for (int t = 0; t < NT; t++) {                                                     \
            uvec4 v = texelFetch(b, min(base + t, blk_last));                                         \
            u[4 * t] = v.x;                                                                           \
            u[4 * t + 1] = v.y;                                                                       \
            u[4 * t + 2] = v.z;                                                                       \
            u[4 * t + 3] = v.w;                                                                       \
        }                                                                                             \
        [[unroll]] for (int k = 4 * NT; k < 4 * NT + 3; k++) u[k] = 0u;                               \
        uint w0 = (ph >> 2) & 3u;                                                                     \
        uint v2[4 * NT + 1];                                                                          \
        [[unroll]] for (int k = 0; k < 4 * NT + 1; k++) v2[k] = (w0 & 2u) != 0u ? u[k + 2] : u[k];    \
        uint a[4 * NT];                                                                               \
        [[unroll]] for (int k = 0; k < 4 * NT; k++) a[k] = (w0 & 1u) != 0u ? v2[k + 1] : v2[k];       \
        bool odd = (ph & 2u) != 0u;                                                                   \
        [[unroll]] for (int k = 0; k < NW; k++) o[k] = odd ? (a[k] >> 16) | (a[k + 1] << 16) : a[k];  \
    }

DEFINE_BLK_LOAD(blk_ld2x2, 2, 2)
DEFINE_BLK_LOAD(blk_ld2x4, 2, 4)
DEFINE_BLK_LOAD(blk_ld2x5, 2, 5)
DEFINE_BLK_LOAD(blk_ld3x6, 3, 6)
DEFINE_BLK_LOAD(blk_ld3x8, 3, 8)

// Word i (0..3, run-time) of hw through selects: a run-time index into a
// private array costs CPU devices far more (llvmpipe cannot keep the
// array in registers; Q4_K/Q5_K's GEMV took 1.5x the time that way).
uint blk_hw_word(uint hw[5], uint i) {
    return (i & 2u) != 0u ? ((i & 1u) != 0u ? hw[3] : hw[2]) : ((i & 1u) != 0u ? hw[1] : hw[0]);
}

// Each byte of x (all < 128) minus k, as int8.
uint blk_sub_bytes(uint x, uint k) {
    return ((x | 0x80808080u) - k * 0x01010101u) ^ 0x80808080u;
}

// Bits 0..3 of h as bit `at` of bytes 0..3.
uint blk_spread4(uint h, uint at) {
    return ((h & 1u) | ((h & 2u) << 7) | ((h & 4u) << 14) | ((h & 8u) << 21)) << at;
}

// The IQ4 levels, four int8 a word.
#define BLK_IQ4_W0 0xbfad9881u // -127, -104, -83, -65
#define BLK_IQ4_W1 0xf6eaddcfu // -49, -35, -22, -10
#define BLK_IQ4_W2 0x26190d01u // 1, 13, 25, 38
#define BLK_IQ4_W3 0x71594535u // 53, 69, 89, 113

// The IQ4 level of nibble n (the low 4 bits), as an int8 in the low byte:
// selects, not an indexed table (which CPU implementations gather).
uint blk_iq4_1(uint n) {
    uint w = (n & 8u) != 0u ? ((n & 4u) != 0u ? BLK_IQ4_W3 : BLK_IQ4_W2) : ((n & 4u) != 0u ? BLK_IQ4_W1 : BLK_IQ4_W0);
    return (w >> ((n & 3u) * 8u)) & 0xffu;
}

// The IQ4 levels of four nibbles (one a byte), as int8.
uint blk_iq4(uint n) {
    return blk_iq4_1(n) | blk_iq4_1(n >> 8) << 8 | blk_iq4_1(n >> 16) << 16 | blk_iq4_1(n >> 24) << 24;
}

// The low and the high nibbles of 16 bytes (4 words) as 32 codes.
void blk_nibbles(uint w[4], bool iq4, uint sub, out uint q[8]) {
    [[unroll]] for (int k = 0; k < 4; k++) {
        uint lo = w[k] & 0x0f0f0f0fu, hi = (w[k] >> 4) & 0x0f0f0f0fu;
        q[k] = iq4 ? blk_iq4(lo) : blk_sub_bytes(lo, sub);
        q[k + 4] = iq4 ? blk_iq4(hi) : blk_sub_bytes(hi, sub);
    }
}

// The part of a super-block every chunk needs (scales, d), loaded once per
// block: see blk_chunk for what each word holds. Nothing for the 32-blocks.
// A block is addressed as (tex, ph): its first byte is 16 * tex + ph.
void blk_head(usamplerBuffer W, uint dt, int tex, uint ph, out uint hw[5]) {
    hw = uint[5](0u, 0u, 0u, 0u, 0u);
    if (dt == DT_Q2_K) {
        uint o[4], e[2];
        blk_ld2x4(W, tex, ph, o); // scales[16]
        blk_ld2x2(W, tex, ph + 80u, e); // d, dmin
        hw = uint[5](o[0], o[1], o[2], o[3], e[0]);
    } else if (dt == DT_Q3_K) {
        uint o[4];
        blk_ld2x4(W, tex, ph + 96u, o); // scales[12], d
        hw = uint[5](o[0], o[1], o[2], o[3], 0u);
    } else if (dt == DT_Q4_K || dt == DT_Q5_K) {
        uint o[4];
        blk_ld2x4(W, tex, ph, o); // d, dmin, scales[12]
        hw = uint[5](o[0], o[1], o[2], o[3], 0u);
    } else if (dt == DT_Q6_K) {
        uint o[5];
        blk_ld2x5(W, tex, ph + 192u, o); // scales[16], d
        hw = o;
    } else if (dt == DT_IQ4_XS) {
        uint o[2];
        blk_ld2x2(W, tex, ph, o); // d, scales_h, scales_l[4]
        hw = uint[5](o[0], o[1], 0u, 0u, 0u);
    }
}

// A 32-value block (Q4_0 ... IQ4_NL) from its first 24 bytes, o[k] the 32
// bits at byte 4k of the block (bytes past the block ignored): q, s, m and
// uq as blk_chunk_x gives them.
void blk_decode32(uint dt, uint o[6], bool uq, out uint q[8], out vec2 s, out vec2 m) {
    m = vec2(0.0);
    s = vec2(f16_bits(o[0] & 0xffffu));
    if (dt == DT_Q4_0 || dt == DT_IQ4_NL) {
        uint w[4];
        [[unroll]] for (int k = 0; k < 4; k++) w[k] = (o[k] >> 16) | (o[k + 1] << 16);
        blk_nibbles(w, dt == DT_IQ4_NL && !uq, uq ? 0u : 8u, q);
    } else if (dt == DT_Q4_1) {
        m = vec2(-f16_bits(o[0] >> 16));
        blk_nibbles(uint[4](o[1], o[2], o[3], o[4]), false, 0u, q);
    } else { // Q5_0, Q5_1
        uint w[4], qh;
        if (dt == DT_Q5_0) {
            qh = (o[0] >> 16) | (o[1] << 16);
            [[unroll]] for (int k = 0; k < 4; k++) w[k] = (o[k + 1] >> 16) | (o[k + 2] << 16);
        } else {
            m = vec2(-f16_bits(o[0] >> 16));
            qh = o[1];
            [[unroll]] for (int k = 0; k < 4; k++) w[k] = o[k + 2];
        }
        uint sub = dt == DT_Q5_0 && !uq ? 16u : 0u;
        [[unroll]] for (int k = 0; k < 4; k++) {
            uint lo = (w[k] & 0x0f0f0f0fu) | blk_spread4(qh >> (4 * k), 4u);
            uint hi = ((w[k] >> 4) & 0x0f0f0f0fu) | blk_spread4(qh >> (16 + 4 * k), 4u);
            q[k] = blk_sub_bytes(lo, sub);
            q[k + 4] = blk_sub_bytes(hi, sub);
        }
    }
}

// Chunk c of the block at (tex, ph) (hw: its blk_head). The scales are
// formed in the order of quants.c's dequantizers (d * sub-block scale
// first), so s * q - m is the reference value exactly: every product
// there is exact in f32.
// Chunk offsets inside a block that depend on c are whole texels (added to
// tex), so a constant ph stays constant.
//
// uq: q unsigned (0..63) wherever the type has a fixed offset (the codes
// less blk_offset are the signed ones; m stays 0), and IQ4's q the nibbles
// (0..15), not their levels (see blk_iq4f). The tile float path takes it
// and subtracts the offset from its exact integer sums: folding the offset
// into m (m = offset * s) instead rounds differently, and SmolLM2 Q4_K_M
// on lavapipe lost its greedy match with llama.cpp that way.
//
// blk_chunk_xh: the same, Q3_K's hmask (32 bytes at the block's start, the
// same for every chunk) given as hm (blk_hmask), not read again per chunk.
void blk_chunk_xh(usamplerBuffer W, uint dt, int tex, uint ph, uint hw[5], uint hm[8], uint c, bool uq, out uint q[8],
                  out vec2 s, out vec2 m) {
    m = vec2(0.0);
    if (blk_chunks(dt) == 1u) {
        uint o[6];
        if (dt == DT_Q4_0 || dt == DT_IQ4_NL) {
            uint o5[5];
            blk_ld2x5(W, tex, ph, o5);
            o = uint[6](o5[0], o5[1], o5[2], o5[3], o5[4], 0u);
        } else {
            blk_ld3x6(W, tex, ph, o);
        }
        blk_decode32(dt, o, uq, q, s, m);
    } else if (dt == DT_Q2_K) {
        // hw: scales[16] in 0..3, d | dmin << 16 in 4.
        uint o[8], sh = 2u * (c & 3u);
        blk_ld3x8(W, tex + 2 * int(c >> 2), ph + 16u, o);
        [[unroll]] for (int k = 0; k < 8; k++) q[k] = (o[k] >> sh) & 0x03030303u;
        uint sw = blk_hw_word(hw, c >> 1) >> (16u * (c & 1u)); // scales[2c], [2c + 1]
        uint sc0 = sw & 0xffu, sc1 = (sw >> 8) & 0xffu;
        float d = f16_bits(hw[4] & 0xffffu), dmin = f16_bits(hw[4] >> 16);
        s = vec2(d * float(sc0 & 15u), d * float(sc1 & 15u));
        m = vec2(dmin * float(sc0 >> 4), dmin * float(sc1 >> 4));
    } else if (dt == DT_Q3_K) {
        // hw: scales[12] in bytes 0..11, d in bytes 12..13.
        uint o[8], sh = 2u * (c & 3u);
        blk_ld3x8(W, tex + 2 * int(c >> 2), ph + 32u, o);
        [[unroll]] for (int k = 0; k < 8; k++)
            q[k] = blk_sub_bytes(((o[k] >> sh) & 0x03030303u) | (((hm[k] >> c) & 0x01010101u) << 2), uq ? 0u : 4u);
        float d = f16_bits(hw[3] & 0xffffu);
        vec2 sc;
        // Scale j: the low (j < 8) or high nibble of byte j % 8, 2 bits of
        // byte 8 + j % 4 above; hw indexed by constants (blk_hw_word).
        uint lw = (c & 2u) != 0u ? hw[1] : hw[0];
        [[unroll]] for (int h = 0; h < 2; h++) {
            uint j = 2u * c + uint(h);
            uint lo = (lw >> (8u * (j & 3u) + (c >= 4u ? 4u : 0u))) & 15u;
            uint hi = (hw[2] >> (8u * (j & 3u) + 2u * (j >> 2))) & 3u;
            sc[h] = d * float(int(lo | hi << 4) - 32);
        }
        s = sc;
    } else if (dt == DT_Q4_K || dt == DT_Q5_K) {
        // hw: d | dmin << 16 in 0, scales[12] in bytes 4..15.
        uint o[8];
        blk_ld3x8(W, tex + 2 * int(c >> 1), ph + (dt == DT_Q4_K ? 16u : 48u), o);
        uint sh = 4u * (c & 1u);
        [[unroll]] for (int k = 0; k < 8; k++) q[k] = (o[k] >> sh) & 0x0f0f0f0fu;
        if (dt == DT_Q5_K) {
            uint qh[8];
            blk_ld3x8(W, tex, ph + 16u, qh);
            [[unroll]] for (int k = 0; k < 8; k++) q[k] |= ((qh[k] >> c) & 0x01010101u) << 4;
        }
        // Byte c % 4 of scales[0..3], [4..7], [8..11] (hw[1..3]): shifts,
        // not a run-time index into hw (see blk_hw_word).
        uint sh4 = 8u * (c & 3u), a = hw[1] >> sh4, b = hw[2] >> sh4, e = hw[3] >> sh4;
        uint sc, mn;
        if (c < 4u) {
            sc = a & 63u;
            mn = b & 63u;
        } else {
            sc = (e & 15u) | ((a >> 6) & 3u) << 4;
            mn = ((e >> 4) & 15u) | ((b >> 6) & 3u) << 4;
        }
        float d = f16_bits(hw[0] & 0xffffu), dmin = f16_bits(hw[0] >> 16);
        s = vec2(d * float(sc));
        m = vec2(dmin * float(mn));
    } else if (dt == DT_Q6_K) {
        // hw: scales[16] (int8) in 0..3, d in 4.
        uint ql[8], qh[8], h = c >> 2, k4 = c & 3u;
        blk_ld3x8(W, tex + 4 * int(h) + 2 * int(k4 & 1u), ph, ql);
        blk_ld3x8(W, tex + 2 * int(h), ph + 128u, qh);
        [[unroll]] for (int k = 0; k < 8; k++)
            q[k] = blk_sub_bytes(((ql[k] >> (4u * (k4 >> 1))) & 0x0f0f0f0fu) | (((qh[k] >> (2u * k4)) & 0x03030303u) << 4),
                                 uq ? 0u : 32u);
        float d = f16_bits(hw[4] & 0xffffu);
        uint sw = blk_hw_word(hw, c >> 1) >> (16u * (c & 1u)); // scales[2c], [2c + 1]
        s = vec2(d * float(int(sw << 24) >> 24), d * float(int(sw << 16) >> 24));
    } else { // IQ4_XS; hw: d | scales_h << 16 in 0, scales_l[4] in 1.
        uint o[4];
        blk_ld2x4(W, tex + int(c), ph + 8u, o);
        blk_nibbles(o, !uq, 0u, q);
        uint ls = ((hw[1] >> (4u * c)) & 15u) | ((hw[0] >> (16u + 2u * c)) & 3u) << 4; // nibble c of scales_l
        s = vec2(f16_bits(hw[0] & 0xffffu) * float(int(ls) - 32));
    }
}

// Q3_K's hmask: what blk_chunk_xh takes as hm (zeros for the other types).
void blk_hmask(usamplerBuffer W, uint dt, int tex, uint ph, out uint hm[8]) {
    hm = uint[8](0u, 0u, 0u, 0u, 0u, 0u, 0u, 0u);
    if (dt == DT_Q3_K) blk_ld3x8(W, tex, ph, hm);
}

void blk_chunk_x(usamplerBuffer W, uint dt, int tex, uint ph, uint hw[5], uint c, bool uq, out uint q[8], out vec2 s,
                 out vec2 m) {
    uint hm[8];
    blk_hmask(W, dt, tex, ph, hm);
    blk_chunk_xh(W, dt, tex, ph, hw, hm, c, uq, q, s, m);
}

void blk_chunk(usamplerBuffer W, uint dt, int tex, uint ph, uint hw[5], uint c, out uint q[8], out vec2 s, out vec2 m) {
    blk_chunk_x(W, dt, tex, ph, hw, c, false, q, s, m);
}

bool blk_signed(uint dt) {
    return dt == DT_IQ4_NL || dt == DT_IQ4_XS;
}

// The IQ4 levels of the four nibbles of q (one a byte, unsigned), as
// floats: a quartic that is within 0.477 of every level, rounded (exact in
// f32, fused or not; CPU devices would gather a table). Byte k converts as
// n * 2^(8k) (blk_codesf's mask and conversion, no shift) and the
// coefficient of n^j carries 2^(-8kj) instead: every intermediate is the
// unscaled one times a power of two (all normal), so the rounding is the
// same.
vec4 blk_iq4f(uint q) {
    const vec4 S1 = vec4(1.0, 1.0 / 256.0, 1.0 / 65536.0, 1.0 / 16777216.0), S2 = S1 * S1, S3 = S2 * S1,
               S4 = S2 * S2;
    vec4 n = vec4(ivec4(uvec4(q & 0xfu, q & 0xf00u, q & 0xf0000u, q & 0xf000000u)));
    vec4 a = (0.0013247201714693974 * S4) * n + 0.041216824111560954 * S3;
    a = a * n - 1.5001835754544732 * S2;
    a = a * n + 24.74324574634172 * S1;
    return roundEven(a * n - 127.04360165118679);
}

// The fixed offset of a type's codes (q4_0's 8, ...): blk_chunk_x's
// unsigned codes less it are the signed ones.
uint blk_offset(uint dt) {
    return dt == DT_Q4_0 ? 8u : dt == DT_Q5_0 ? 16u : dt == DT_Q3_K ? 4u : dt == DT_Q6_K ? 32u : 0u;
}

// Four unsigned codes (bytes, each < 128) as floats, byte k times 2^(8k):
// a mask and a conversion a code, where unpacking to the code itself
// takes a shift more (exact: at most 7 significant bits).
vec4 blk_codesf(uint q) {
    return vec4(ivec4(uvec4(q & 0xffu, q & 0xff00u, q & 0xff0000u, q & 0xff000000u)));
}
