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
