// reduce.glsl — workgroup reductions through shared memory (a tree of
// log2(WG) steps). Include after declaring `layout(local_size_x_id = 0) in;`
// and `layout(constant_id = 0) const uint WG`. Every invocation of the
// workgroup must call them (they contain barriers).

shared float red_f[WG];

float wg_sum(float v) {
    uint l = gl_LocalInvocationID.x;
    red_f[l] = v;
    barrier();
    for (uint s = WG / 2u; s > 0u; s >>= 1) {
        if (l < s) red_f[l] += red_f[l + s];
        barrier();
    }
    float r = red_f[0];
    barrier();
    return r;
}

float wg_max(float v) {
    uint l = gl_LocalInvocationID.x;
    red_f[l] = v;
    barrier();
    for (uint s = WG / 2u; s > 0u; s >>= 1) {
        if (l < s) red_f[l] = max(red_f[l], red_f[l + s]);
        barrier();
    }
    float r = red_f[0];
    barrier();
    return r;
}
