// common.glsl — helpers shared by duet's compute shaders.
//
// Reading: every input arrives as a uvec4 texel view (R32G32B32A32_UINT) of
// its buffer and is read with texelFetch; offsets are byte offsets from the
// view's start, passed in push constants. Writing: storage buffers of uint
// or float words, offsets in words. (Why texel views: vk_internal.h.)

// Bits a shader sets in the status word when an index input is out of range.
#define ST_BAD_TOKEN 1u
#define ST_BAD_POS 2u
#define ST_BAD_SEQ 4u
#define ST_BAD_ROW 8u

uint pick(uvec4 t, uint c) { return c == 0u ? t.x : c == 1u ? t.y : c == 2u ? t.z : t.w; }

// The 32-bit word at word index w.
uint word_at(usamplerBuffer b, uint w) { return pick(texelFetch(b, int(w >> 2)), w & 3u); }

// The 32 bits starting at byte offset `byte` (any multiple of 2). Branch
// free: CPU implementations run both sides of a branch they cannot prove
// uniform, so choices known when the pipeline is made are specialization
// constants throughout these shaders, and the rest are selects.
uint word_at_byte(usamplerBuffer b, uint byte) {
    uint w = byte >> 2, lo = word_at(b, w), hi = word_at(b, w + 1u);
    return (byte & 2u) == 0u ? lo : (lo >> 16) | (hi << 16);
}

float f32_at(usamplerBuffer b, uint byte) { return uintBitsToFloat(word_at(b, byte >> 2)); }
int i32_at(usamplerBuffer b, uint byte) { return int(word_at(b, byte >> 2)); }

// The 16 bits at byte offset `byte` (a multiple of 2).
uint u16_at(usamplerBuffer b, uint byte) { return (word_at(b, byte >> 2) >> ((byte & 2u) * 8u)) & 0xffffu; }
int i8_at(usamplerBuffer b, uint byte) { return int(word_at(b, byte >> 2) << (24u - (byte & 3u) * 8u)) >> 24; }

float f16_bits(uint h) { return unpackHalf2x16(h).x; }
float bf16_bits(uint h) { return uintBitsToFloat(h << 16); }

// Four int8 in a word, as floats (lowest byte first).
vec4 i8x4(uint q) { return vec4(ivec4(int(q << 24) >> 24, int(q << 16) >> 24, int(q << 8) >> 24, int(q) >> 24)); }

// Weight types, as GGUF numbers them.
#define DT_F32 0u
#define DT_F16 1u
#define DT_Q8_0 8u
#define DT_BF16 30u

// Element e of a row of dtype dt starting at byte `row` of view b, as f32.
float elem_at(usamplerBuffer b, uint dt, uint row, uint e) {
    if (dt == DT_F32) return f32_at(b, row + e * 4u);
    if (dt == DT_F16) return f16_bits(u16_at(b, row + e * 2u));
    if (dt == DT_BF16) return bf16_bits(u16_at(b, row + e * 2u));
    // Q8_0: blocks of 34 bytes (f16 scale, 32 int8).
    uint blk = row + (e >> 5) * 34u;
    return f16_bits(u16_at(b, blk)) * float(i8_at(b, blk + 2u + (e & 31u)));
}
#define ST_BAD_BLOCK 16u

// ---- q8_0 blocks (32 int8 + an fp16 scale, 34 bytes) ------------------------
//
// The rule of duet_quantize_row_q8_0 (backends/dtype.c): amax over the 32
// values (NaN never wins), d = amax / 127, id = d ? 1 / d : 0, q = x * id
// rounded half away from zero, clamped to [-127, 127] (NaN -> 0), stored
// scale fp16(d). A shader's "/" may be 2.5 ulp off and its fma() need not
// be fused, so d and id are made correctly rounded (as on the host) by
// comparing exact residuals of the neighbouring floats: `precise` keeps the
// compiler from reassociating or fusing those steps.

// a * b == p + e exactly (Dekker's product), for operands well inside the
// float range.
void two_prod(float a, float b, out float p, out float e) {
    precise float pp = a * b;
    precise float ca = 4097.0 * a;
    precise float ah = ca - (ca - a);
    precise float al = a - ah;
    precise float cb = 4097.0 * b;
    precise float bh = cb - (cb - b);
    precise float bl = b - bh;
    precise float ee = ((ah * bh - pp) + ah * bl + al * bh) + al * bl;
    p = pp;
    e = ee;
}

// |n - c * den|, precise enough to rank neighbouring candidates c.
float div_resid(float n, float c, float den) {
    float p, e;
    two_prod(c, den, p, e);
    precise float r = (n - p) - e;
    return abs(r);
}

// n / den rounded to nearest for positive normal operands: the shader's
// quotient, moved to a neighbour while that one's residual is smaller.
float div_rn(float n, float den) {
    float q = n / den;
    if (!(q > 1e-30 && q < 1e30 && n > 1e-30 && n < 1e30)) return q;
    [[unroll]] for (int i = 0; i < 3; i++) {
        float lo = uintBitsToFloat(floatBitsToUint(q) - 1u), hi = uintBitsToFloat(floatBitsToUint(q) + 1u);
        float r = div_resid(n, q, den), rl = div_resid(n, lo, den), rh = div_resid(n, hi, den);
        q = rl < r ? lo : rh < r ? hi : q;
    }
    return q;
}

vec4 round_away(vec4 v) {
    vec4 t = trunc(v);
    precise vec4 f = v - t; // exact
    return t + mix(vec4(0.0), sign(v), greaterThanEqual(abs(f), vec4(0.5)));
}

// Quantises 32 values: *dh = the fp16 scale bits, qw[k] = int8 4k..4k+3
// (lowest byte first).
void quantize_block(vec4 v[8], out uint dh, out uint qw[8]) {
    float amax = 0.0;
    [[unroll]] for (int i = 0; i < 8; i++) {
        vec4 a = abs(v[i]);
        [[unroll]] for (int c = 0; c < 4; c++) amax = a[c] > amax ? a[c] : amax;
    }
    float d = div_rn(amax, 127.0);
    float id = d != 0.0 ? div_rn(1.0, d) : 0.0;
    dh = packHalf2x16(vec2(d, 0.0)) & 0xffffu;
    [[unroll]] for (int i = 0; i < 8; i++) {
        // precise: x * id rounded to f32 before rounding to an integer (a
        // fused multiply-add would decide some halves differently).
        precise vec4 y = v[i] * id;
        vec4 r = round_away(y);
        r = mix(clamp(r, -127.0, 127.0), vec4(0.0), isnan(r));
        ivec4 q = ivec4(r);
        qw[i] = uint(q.x & 0xff) | uint(q.y & 0xff) << 8 | uint(q.z & 0xff) << 16 | uint(q.w & 0xff) << 24;
    }
}

// Defines `void FN(uint byte, uint dh, uint qw[8])`: stores a q8_0 block at
// byte offset `byte` (even) of the uint array BUF. Blocks are 34 bytes, so
// every other one starts mid-word: the word it shares with its neighbour is
// written with atomics on its own half (the neighbour does the same with
// the other half), every other word with a plain store.
#define DEFINE_Q8_STORE(FN, BUF)                                          \
    void FN(uint byte, uint dh, uint qw[8]) {                             \
        uint w = byte >> 2;                                               \
        if ((byte & 2u) == 0u) {                                          \
            BUF[w] = dh | (qw[0] << 16);                                  \
            [[unroll]] for (uint k = 1u; k < 8u; k++)                     \
                BUF[w + k] = (qw[k - 1u] >> 16) | (qw[k] << 16);          \
            atomicAnd(BUF[w + 8u], 0xffff0000u);                          \
            atomicOr(BUF[w + 8u], qw[7] >> 16);                           \
        } else {                                                          \
            atomicAnd(BUF[w], 0x0000ffffu);                               \
            atomicOr(BUF[w], dh << 16);                                   \
            [[unroll]] for (uint k = 0u; k < 8u; k++) BUF[w + 1u + k] = qw[k]; \
        }                                                                 \
    }

// The q8_0 block at byte offset `byte` (even) of view b: the scale and the
// 32 quants as 8 words. Three texel fetches cover any 34 bytes that start
// on an even byte; the block's words are shifted into place by its word
// phase (two levels of selects: by 2 words, then by 1), then by its
// half-word phase.
uint word12(uvec4 t0, uvec4 t1, uvec4 t2, uint i) {
    uvec4 t = i < 4u ? t0 : i < 8u ? t1 : t2;
    return t[i & 3u];
}

void load_q8_block(usamplerBuffer b, uint byte, out float d, out uint qw[8]) {
    int base = int(byte >> 4);
    uvec4 t0 = texelFetch(b, base), t1 = texelFetch(b, base + 1), t2 = texelFetch(b, base + 2);
    uint u[12] = uint[12](t0.x, t0.y, t0.z, t0.w, t1.x, t1.y, t1.z, t1.w, t2.x, t2.y, t2.z, t2.w);
    uint w0 = (byte & 15u) >> 2; // first word, 0..3
    uint v[10], a[9];
    [[unroll]] for (uint k = 0u; k < 10u; k++) v[k] = (w0 & 2u) != 0u ? u[k + 2u] : u[k];
    [[unroll]] for (uint k = 0u; k < 9u; k++) a[k] = (w0 & 1u) != 0u ? v[k + 1u] : v[k];
    bool odd = (byte & 2u) != 0u; // the block starts in the high half of a[0]
    d = unpackHalf2x16(odd ? a[0] >> 16 : a[0]).x;
    [[unroll]] for (uint k = 0u; k < 8u; k++) qw[k] = odd ? a[k + 1u] : (a[k] >> 16) | (a[k + 1u] << 16);
}

// Two q8_0 blocks starting at byte offset `byte` (a multiple of 4): 17
// words, from five texel fetches, shifted by their word phase. The first
// block's quants sit 2 bytes into its words, the second's are aligned.
void load_q8_pair(usamplerBuffer b, uint byte, out float d0, out float d1, out uint q0[8], out uint q1[8]) {
    int base = int(byte >> 4);
    uvec4 t0 = texelFetch(b, base), t1 = texelFetch(b, base + 1), t2 = texelFetch(b, base + 2),
          t3 = texelFetch(b, base + 3), t4 = texelFetch(b, base + 4);
    uint u[20] = uint[20](t0.x, t0.y, t0.z, t0.w, t1.x, t1.y, t1.z, t1.w, t2.x, t2.y, t2.z, t2.w, t3.x, t3.y, t3.z,
                          t3.w, t4.x, t4.y, t4.z, t4.w);
    uint w0 = (byte >> 2) & 3u;
    uint v[18], a[17];
    [[unroll]] for (uint k = 0u; k < 18u; k++) v[k] = (w0 & 2u) != 0u ? u[k + 2u] : u[k];
    [[unroll]] for (uint k = 0u; k < 17u; k++) a[k] = (w0 & 1u) != 0u ? v[k + 1u] : v[k];
    d0 = unpackHalf2x16(a[0]).x;
    d1 = unpackHalf2x16(a[8]).y;
    [[unroll]] for (uint k = 0u; k < 8u; k++) {
        q0[k] = (a[k] >> 16) | (a[k + 1u] << 16);
        q1[k] = a[k + 9u];
    }
}
