/* embed.cl — EMBED: out[t][:] = f32(table[tokens[t]][:]) for a table of
 * WTYPE rows. A token outside the table's n_rows rows (core validates
 * tokens before a step; this only keeps the device inside the buffer)
 * gives a zero row.
 *
 * embed: one work-item per value, NDRange (dim, n_tokens).
 * embed_blk (the block types of DT_IS_BLK): one work-item per 32-value
 * chunk, decoded in registers (blk_chunk_f32), NDRange (dim / 32, n_tokens). */
#ifndef WTYPE
#define WTYPE DT_F32
#endif

#if DT_IS_BLK(WTYPE)
kernel void embed_blk(gbytes tokens, ulong tok_off, gbytes table, ulong table_off, ulong n_rows, global uchar *out,
                      ulong out_off, int dim) {
    const int cg = get_global_id(0), t = get_global_id(1);
    if (cg >= dim / 32) return;
    const int tok = AT_CONST(int, tokens, tok_off)[t];
    float16 wa = (float16)(0.0f), wb = (float16)(0.0f);
    if (tok >= 0 && (ulong)tok < n_rows) {
        int b, c;
        DIVMOD(cg, BLK_CPB, b, c);
        blk_chunk_f32(table + table_off + (ulong)tok * row_bytes(WTYPE, dim) + (ulong)b * BLK_BYTES, c, &wa, &wb);
    }
    global float *dst = AT(float, out, out_off) + (ulong)t * dim + (ulong)cg * 32;
    vstore16(wa, 0, dst);
    vstore16(wb, 1, dst);
}
#else
kernel void embed(gbytes tokens, ulong tok_off, gbytes table, ulong table_off, ulong n_rows, global uchar *out,
                  ulong out_off, int dim) {
    const int i = get_global_id(0), t = get_global_id(1);
    if (i >= dim) return;
    const int tok = AT_CONST(int, tokens, tok_off)[t];
    float v = 0.0f;
    if (tok >= 0 && (ulong)tok < n_rows) v = load_elem(WTYPE, table + table_off + (ulong)tok * row_bytes(WTYPE, dim), i);
    AT(float, out, out_off)[(ulong)t * dim + i] = v;
}
#endif
