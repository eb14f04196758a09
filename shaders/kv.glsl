// kv.glsl — the paged KV cache (backends/backend.h, duet_kv_pages).
//
// Position p of sequence s lives in row p % block_size of block
// block_table[s * max_blocks + p / block_size] of each pool. A table entry
// outside [0, n_blocks) is clamped into it (and reported), so a bad table
// can never make a shader read or write outside the pools.

#define KV_F32 0u
#define KV_F16 1u
#define KV_Q8_0 8u

// The pool row of (seq, pos); the caller has checked seq and pos. Sets
// *bad when the table entry had to be clamped.
uint kv_row(usamplerBuffer bt, uint bt_off, uint seq, uint pos, uint block_size, uint max_blocks, uint n_blocks,
            inout bool bad) {
    int e = i32_at(bt, bt_off + (seq * max_blocks + pos / block_size) * 4u);
    bad = bad || e < 0 || uint(e) >= n_blocks;
    uint blk = uint(clamp(e, 0, int(n_blocks) - 1));
    return blk * block_size + pos % block_size;
}

// Bytes of one pool row of kvw elements.
uint kv_row_bytes(uint kvt, uint kvw) { return kvt == KV_Q8_0 ? kvw / 32u * 34u : kvt == KV_F16 ? kvw * 2u : kvw * 4u; }
