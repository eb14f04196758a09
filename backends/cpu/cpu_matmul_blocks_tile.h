/* cpu_matmul_blocks_tile.h — the SIMD tile of cpu_matmul_blocks.c, included
 * there once per ISA with BLK_TARGET (the target attribute), BLK_NAME (the
 * prefix of the functions made) and BLK_DOT(u, s) (8 int32 sums of 4
 * u8 x s8 products each) defined. The type and the tile shape are constants
 * after inlining, so each (type, shape) gets its own straight-line loop. */

/* NR rows x NT tokens over nsb super-blocks, from the tile's first token
 * tok. Per chunk and (row, token): the products' 8 lanes times the scales
 * of their halves and dx, minus the mins times the activations' lane sums. */
BLK_TARGET CPU_INLINE void BLK_NAME(body)(duet_dtype DT, const int NR, const int NT, const uint8_t *w,
                                          size_t ws, const blk_act *x, int64_t tok, int64_t nsb, blk_res res,
                                          int j0) {
    const int cps = DT == DUET_DTYPE_Q4_0 || DT == DUET_DTYPE_Q4_1 || DT == DUET_DTYPE_Q5_0 ||
                            DT == DUET_DTYPE_Q5_1 || DT == DUET_DTYPE_IQ4_NL
                        ? 1
                        : 8;
    const bool one_scale =
        cps == 1 || DT == DUET_DTYPE_Q4_K || DT == DUET_DTYPE_Q5_K || DT == DUET_DTYPE_IQ4_XS;
    /* m = offset * s for the types that store q - offset. */
    const float offset = DT == DUET_DTYPE_Q4_0   ? 8.0f
                         : DT == DUET_DTYPE_Q5_0 ? 16.0f
                         : DT == DUET_DTYPE_Q6_K ? 32.0f
                         : DT == DUET_DTYPE_Q3_K ? 4.0f
                                                 : 0.0f;
    const size_t bb = DT == DUET_DTYPE_Q4_0     ? sizeof(duet_block_q4_0)
                      : DT == DUET_DTYPE_Q4_1   ? sizeof(duet_block_q4_1)
                      : DT == DUET_DTYPE_Q5_0   ? sizeof(duet_block_q5_0)
                      : DT == DUET_DTYPE_Q5_1   ? sizeof(duet_block_q5_1)
                      : DT == DUET_DTYPE_IQ4_NL ? sizeof(duet_block_iq4_nl)
                      : DT == DUET_DTYPE_Q2_K   ? sizeof(duet_block_q2_K)
                      : DT == DUET_DTYPE_Q3_K   ? sizeof(duet_block_q3_K)
                      : DT == DUET_DTYPE_Q4_K   ? sizeof(duet_block_q4_K)
                      : DT == DUET_DTYPE_Q5_K   ? sizeof(duet_block_q5_K)
                      : DT == DUET_DTYPE_Q6_K   ? sizeof(duet_block_q6_K)
                                                : sizeof(duet_block_iq4_xs); /* a constant per type */
    __m256 acc[BLK_MR][BLK_MT];
    const int8_t *xq[BLK_MT];
    const float *xd[BLK_MT], *xl[BLK_MT];
#pragma GCC unroll 4
    for (int j = 0; j < NT; j++) {
        xq[j] = x->q + (tok + j) * x->qs;
        xd[j] = x->d + (tok + j) * x->ds;
        xl[j] = x->xl + (tok + j) * 8 * x->ds;
#pragma GCC unroll 4
        for (int i = 0; i < NR; i++)
            acc[i][j] = _mm256_setzero_ps();
    }
    for (int64_t sb = 0; sb < nsb; sb++) {
        blk_scales sc[BLK_MR];
#pragma GCC unroll 4
        for (int i = 0; i < NR; i++)
            simd_scales(DT, w + (size_t)i * ws + (size_t)sb * bb, &sc[i]);
            /* Unrolled: c is a constant in each copy (immediate shifts and offsets). */
#pragma GCC unroll 8
        for (int c = 0; c < cps; c++) {
            const int64_t b = sb * cps + c;
            __m256i xv[BLK_MT];
            __m256 dxv[BLK_MT], xlv[BLK_MT];
#pragma GCC unroll 4
            for (int j = 0; j < NT; j++) {
                xv[j] = _mm256_loadu_si256((const __m256i *)(xq[j] + b * 32));
                dxv[j] = _mm256_broadcast_ss(xd[j] + b);
                if (has_min(DT)) xlv[j] = _mm256_loadu_ps(xl[j] + 8 * b);
            }
#pragma GCC unroll 4
            for (int i = 0; i < NR; i++) {
                const uint8_t *blk = w + (size_t)i * ws + (size_t)sb * bb;
                /* The rows BLK_MR ahead (the next tile of this thread): each
                 * 32-block, or a super-block's lines at its first chunk. */
                if (cps == 1)
                    _mm_prefetch((const char *)(blk + BLK_MR * ws), _MM_HINT_T0);
                else if (c == 0)
                    for (size_t off = 0; off < bb; off += 64)
                        _mm_prefetch((const char *)(blk + BLK_MR * ws + off), _MM_HINT_T0);
                const __m256i q = simd_unpack(DT, blk, c);
                const __m256 sv = one_scale ? _mm256_broadcast_ss(&sc[i].s[2 * c])
                                            : _mm256_set_m128(_mm_broadcast_ss(&sc[i].s[2 * c + 1]),
                                                              _mm_broadcast_ss(&sc[i].s[2 * c]));
                __m256 mv = _mm256_setzero_ps();
                if (offset != 0.0f)
                    mv = _mm256_mul_ps(sv, _mm256_set1_ps(offset));
                else if (has_min(DT))
                    mv = one_scale ? _mm256_broadcast_ss(&sc[i].m[2 * c])
                                   : _mm256_set_m128(_mm_broadcast_ss(&sc[i].m[2 * c + 1]),
                                                     _mm_broadcast_ss(&sc[i].m[2 * c]));
                /* Signed q (IQ4): |q| against x with q's sign. */
                const __m256i u = signed_q(DT) ? _mm256_sign_epi8(q, q) : q;
#pragma GCC unroll 4
                for (int j = 0; j < NT; j++) {
                    const __m256i s = signed_q(DT) ? _mm256_sign_epi8(xv[j], q) : xv[j];
                    const __m256 p = _mm256_cvtepi32_ps(BLK_DOT(u, s));
                    acc[i][j] = _mm256_fmadd_ps(p, _mm256_mul_ps(sv, dxv[j]), acc[i][j]);
                    if (has_min(DT)) acc[i][j] = _mm256_fnmadd_ps(mv, xlv[j], acc[i][j]);
                }
            }
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < NR; i++)
#pragma GCC unroll 4
        for (int j = 0; j < NT; j++)
            res[i][j0 + j] = avx2_hsum(acc[i][j]);
}

/* The tile shapes of one type: BLK_MR rows by BLK_TILE_MT tokens (4 on
 * avx512, 2 on avx2), then 2 and 1 tokens; single rows at the end. */
BLK_TARGET CPU_INLINE void BLK_NAME(shapes)(duet_dtype DT, int nr, int nt, const uint8_t *w, size_t ws,
                                            const blk_act *x, int64_t tok, int64_t nsb, blk_res res) {
    for (int j0 = 0; j0 < nt;) {
        const int left = nt - j0;
        const int n = BLK_TILE_MT >= 4 && left >= 4 ? 4 : left >= 2 ? 2 : 1;
        if (nr == BLK_MR) {
            if (n == 4)
                BLK_NAME(body)(DT, BLK_MR, 4, w, ws, x, tok + j0, nsb, res, j0);
            else if (n == 2)
                BLK_NAME(body)(DT, BLK_MR, 2, w, ws, x, tok + j0, nsb, res, j0);
            else
                BLK_NAME(body)(DT, BLK_MR, 1, w, ws, x, tok + j0, nsb, res, j0);
        } else {
            for (int i = 0; i < nr; i++) {
                float(*r)[BLK_MT] = (float(*)[BLK_MT])res[i];
                if (n == 4)
                    BLK_NAME(body)(DT, 1, 4, w + (size_t)i * ws, ws, x, tok + j0, nsb, r, j0);
                else if (n == 2)
                    BLK_NAME(body)(DT, 1, 2, w + (size_t)i * ws, ws, x, tok + j0, nsb, r, j0);
                else
                    BLK_NAME(body)(DT, 1, 1, w + (size_t)i * ws, ws, x, tok + j0, nsb, r, j0);
            }
        }
        j0 += n;
    }
}

BLK_TARGET static void BLK_NAME(tile)(duet_dtype DT, int nr, int nt, const uint8_t *w, size_t ws,
                                      const blk_act *x, int64_t tok, int64_t nsb, blk_res res) {
    switch (DT) {
#define BLK_CASE(T)                                                                                          \
    case T:                                                                                                  \
        BLK_NAME(shapes)(T, nr, nt, w, ws, x, tok, nsb, res);                                                \
        return;
        BLK_CASE(DUET_DTYPE_Q4_0)
        BLK_CASE(DUET_DTYPE_Q4_1)
        BLK_CASE(DUET_DTYPE_Q5_0)
        BLK_CASE(DUET_DTYPE_Q5_1)
        BLK_CASE(DUET_DTYPE_IQ4_NL)
        BLK_CASE(DUET_DTYPE_Q2_K)
        BLK_CASE(DUET_DTYPE_Q3_K)
        BLK_CASE(DUET_DTYPE_Q4_K)
        BLK_CASE(DUET_DTYPE_Q5_K)
        BLK_CASE(DUET_DTYPE_Q6_K)
        BLK_CASE(DUET_DTYPE_IQ4_XS)
#undef BLK_CASE
    default:
        return;
    }
}
