/* embed.cl — EMBED: out[t][:] = f32(table[tokens[t]][:]) for a table of
 * WTYPE rows. NDRange (dim, n_tokens). A token outside the table's n_rows
 * rows (core validates tokens before a step; this only keeps the device
 * inside the buffer) gives a zero row. */
#ifndef WTYPE
#define WTYPE DT_F32
#endif

kernel void embed(gbytes tokens, ulong tok_off, gbytes table, ulong table_off, ulong n_rows, global uchar *out,
                  ulong out_off, int dim) {
    const int i = get_global_id(0), t = get_global_id(1);
    if (i >= dim) return;
    const int tok = AT_CONST(int, tokens, tok_off)[t];
    float v = 0.0f;
    if (tok >= 0 && (ulong)tok < n_rows) v = load_elem(WTYPE, table + table_off + (ulong)tok * row_bytes(WTYPE, dim), i);
    AT(float, out, out_off)[(ulong)t * dim + i] = v;
}
