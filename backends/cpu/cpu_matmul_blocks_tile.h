/* cpu_matmul_blocks_tile.h — the SIMD tile of cpu_matmul_blocks.c, included
 * there once per ISA with BLK_TARGET (the target attribute), BLK_NAME (the
 * prefix of the functions made), BLK_DOT(u, s) (8 int32 sums of 4
 * u8 x s8 products each) and BLK_TILE_MT (the most tokens per tile) defined.
 * The type and the tile shape are constants after inlining, so each
 * (type, shape) gets its own straight-line loop. */

/* NR rows x NT tokens (NR * NT dots per chunk) over nsb super-blocks, from
 * the tile's first token tok. Per chunk each (row, token) gets its int8 dot
 * product as 8 lanes; eight such are folded into one vector of their halves'
 * sums (lane = one (row, token) pair), whose float sum is then exactly the
 * panel's for that row and token:
 *     acc += dot_lo * (s_lo dx) + dot_hi * (s_hi dx) - m_lo xh_lo - m_hi xh_hi
 * (one dot and one scale when the halves share theirs), op for op. So the
 * tiles and the avx512 panel give the same bits for a token whatever the
 * batch, and the float work is done 8 pairs at a time. */
BLK_TARGET CPU_INLINE void BLK_NAME(body)(duet_dtype DT, const int NR, const int NT, const uint8_t *w,
                                          size_t ws, const blk_act *x, int64_t tok, int64_t nsb, blk_res res,
                                          int i0, int j0) {
    const int cps = blk_cps(DT);
    const bool two = DT == DUET_DTYPE_Q2_K || DT == DUET_DTYPE_Q3_K || DT == DUET_DTYPE_Q6_K;
    /* m = offset * s for the types that store q - offset. */
    const float offset = DT == DUET_DTYPE_Q4_0   ? 8.0f
                         : DT == DUET_DTYPE_Q5_0 ? 16.0f
                         : DT == DUET_DTYPE_Q6_K ? 32.0f
                         : DT == DUET_DTYPE_Q3_K ? 4.0f
                                                 : 0.0f;
    const size_t bb = blk_bytes(DT);
    enum { G_MAX = (BLK_MR * BLK_MT + 7) / 8 };
    const int G = (NR * NT + 7) / 8; /* groups of 8 (row, token) pairs; lane l of group g: pair 8g + l */
    __m256 acc[G_MAX];
    /* Per group: the lanes' rows as offsets into the scales (blk_scales
     * apart), their tokens as offsets into the activations' rows. */
    __m256i s_idx[G_MAX], d_idx[G_MAX], h_idx[G_MAX];
#pragma GCC unroll 2
    for (int g = 0; g < G; g++) {
        int si[8], di[8], hi[8];
        for (int l = 0; l < 8; l++) {
            const int k = 8 * g + l < NR * NT ? 8 * g + l : 0; /* padding lanes repeat pair 0 */
            si[l] = (k / NT) * (int)(sizeof(blk_scales) / sizeof(float));
            di[l] = (k % NT) * (int)x->ds;
            hi[l] = (k % NT) * 3 * (int)x->ds;
        }
        s_idx[g] = _mm256_loadu_si256((const __m256i *)si);
        d_idx[g] = _mm256_loadu_si256((const __m256i *)di);
        h_idx[g] = _mm256_loadu_si256((const __m256i *)hi);
        acc[g] = _mm256_setzero_ps();
    }
    const int8_t *xq[BLK_MT];
#pragma GCC unroll 4
    for (int j = 0; j < NT; j++)
        xq[j] = x->q + (tok + j) * x->qs;
    const float *xd = x->d + tok * x->ds, *xh = x->xh + tok * 3 * x->ds;
    for (int64_t sb = 0; sb < nsb; sb++) {
        blk_scales sc[BLK_MR];
#pragma GCC unroll 8
        for (int i = 0; i < NR; i++)
            simd_scales(DT, w + (size_t)i * ws + (size_t)sb * bb, &sc[i]);
#pragma GCC unroll 8
        for (int c = 0; c < cps; c++) {
            const int64_t b = sb * cps + c;
            __m256i xv[BLK_MT];
#pragma GCC unroll 4
            for (int j = 0; j < NT; j++)
                xv[j] = _mm256_loadu_si256((const __m256i *)(xq[j] + b * 32));
            __m256i dots[8 * G_MAX];
#pragma GCC unroll 8
            for (int i = 0; i < NR; i++) {
                const uint8_t *blk = w + (size_t)i * ws + (size_t)sb * bb;
                /* The rows NR ahead (the next tile of this thread): each
                 * 32-block, or a super-block's lines at its first chunk. */
                if (cps == 1)
                    _mm_prefetch((const char *)(blk + (size_t)NR * ws), _MM_HINT_T0);
                else if (c == 0)
                    for (size_t off = 0; off < bb; off += 64)
                        _mm_prefetch((const char *)(blk + (size_t)NR * ws + off), _MM_HINT_T0);
                const __m256i q = simd_unpack(DT, blk, c);
                /* Signed q (IQ4): |q| against x with q's sign. */
                const __m256i u = signed_q(DT) ? _mm256_sign_epi8(q, q) : q;
#pragma GCC unroll 4
                for (int j = 0; j < NT; j++)
                    dots[i * NT + j] = BLK_DOT(u, signed_q(DT) ? _mm256_sign_epi8(xv[j], q) : xv[j]);
            }
#pragma GCC unroll 8
            for (int k = NR * NT; k < 8 * G; k++)
                dots[k] = _mm256_setzero_si256();
#pragma GCC unroll 2
            for (int g = 0; g < G; g++) {
                const __m256i *a = dots + 8 * g;
                /* Lane sums of 8 vectors: q0 = [a0..a3 lanes 0-3 | a0..a3 lanes 4-7]. */
                const __m256i q0 =
                    _mm256_hadd_epi32(_mm256_hadd_epi32(a[0], a[1]), _mm256_hadd_epi32(a[2], a[3]));
                const __m256i q1 =
                    _mm256_hadd_epi32(_mm256_hadd_epi32(a[4], a[5]), _mm256_hadd_epi32(a[6], a[7]));
                const __m256i lo = _mm256_permute2x128_si256(q0, q1, 0x20); /* the first 16 of each chunk */
                const __m256i hi = _mm256_permute2x128_si256(q0, q1, 0x31); /* the last 16 */
                const __m256 dx =
                    NT == 1 ? _mm256_broadcast_ss(xd + b) : _mm256_i32gather_ps(xd + b, d_idx[g], 4);
                const float *h = xh + 3 * b;
                if (two) {
                    const __m256 s_lo = _mm256_i32gather_ps(&sc[0].s[2 * c], s_idx[g], 4);
                    const __m256 s_hi = _mm256_i32gather_ps(&sc[0].s[2 * c + 1], s_idx[g], 4);
                    acc[g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), _mm256_mul_ps(s_lo, dx), acc[g]);
                    acc[g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_mul_ps(s_hi, dx), acc[g]);
                    const __m256 m_lo = offset != 0.0f ? _mm256_mul_ps(s_lo, _mm256_set1_ps(offset))
                                                       : _mm256_i32gather_ps(&sc[0].m[2 * c], s_idx[g], 4);
                    const __m256 m_hi = offset != 0.0f
                                            ? _mm256_mul_ps(s_hi, _mm256_set1_ps(offset))
                                            : _mm256_i32gather_ps(&sc[0].m[2 * c + 1], s_idx[g], 4);
                    const __m256 h_lo =
                        NT == 1 ? _mm256_broadcast_ss(h) : _mm256_i32gather_ps(h, h_idx[g], 4);
                    const __m256 h_hi =
                        NT == 1 ? _mm256_broadcast_ss(h + 1) : _mm256_i32gather_ps(h + 1, h_idx[g], 4);
                    acc[g] = _mm256_fnmadd_ps(m_lo, h_lo, acc[g]);
                    acc[g] = _mm256_fnmadd_ps(m_hi, h_hi, acc[g]);
                } else {
                    const __m256 s = _mm256_i32gather_ps(&sc[0].s[2 * c], s_idx[g], 4);
                    acc[g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(lo, hi)),
                                             _mm256_mul_ps(s, dx), acc[g]);
                    if (has_min(DT)) {
                        const __m256 m = offset != 0.0f ? _mm256_mul_ps(s, _mm256_set1_ps(offset))
                                                        : _mm256_i32gather_ps(&sc[0].m[2 * c], s_idx[g], 4);
                        const __m256 hv =
                            NT == 1 ? _mm256_broadcast_ss(h + 2) : _mm256_i32gather_ps(h + 2, h_idx[g], 4);
                        acc[g] = _mm256_fnmadd_ps(m, hv, acc[g]);
                    }
                }
            }
        }
    }
#pragma GCC unroll 2
    for (int g = 0; g < G; g++) {
        float v[8];
        _mm256_storeu_ps(v, acc[g]);
        for (int l = 0; l < 8 && 8 * g + l < NR * NT; l++)
            res[i0 + (8 * g + l) / NT][j0 + (8 * g + l) % NT] = v[l];
    }
}

/* The tile shapes of one type: 8 rows by 1 token (decode); 4 rows by
 * BLK_TILE_MT tokens (4 on avx512, 2 on avx2), then 2 and 1; single rows
 * at the end. */
BLK_TARGET CPU_INLINE void BLK_NAME(shapes)(duet_dtype DT, int nr, int nt, const uint8_t *w, size_t ws,
                                            const blk_act *x, int64_t tok, int64_t nsb, blk_res res) {
    if (nr == BLK_MR && nt == 1) {
        BLK_NAME(body)(DT, BLK_MR, 1, w, ws, x, tok, nsb, res, 0, 0);
        return;
    }
    for (int i0 = 0; i0 < nr;) {
        const int rows = nr - i0 >= 4 ? 4 : 1;
        const uint8_t *wr = w + (size_t)i0 * ws;
        for (int j0 = 0; j0 < nt;) {
            const int left = nt - j0;
            const int n = BLK_TILE_MT >= 4 && left >= 4 ? 4 : left >= 2 ? 2 : 1;
            if (rows == 4) {
                if (n == 4)
                    BLK_NAME(body)(DT, 4, 4, wr, ws, x, tok + j0, nsb, res, i0, j0);
                else if (n == 2)
                    BLK_NAME(body)(DT, 4, 2, wr, ws, x, tok + j0, nsb, res, i0, j0);
                else
                    BLK_NAME(body)(DT, 4, 1, wr, ws, x, tok + j0, nsb, res, i0, j0);
            } else {
                if (n == 4)
                    BLK_NAME(body)(DT, 1, 4, wr, ws, x, tok + j0, nsb, res, i0, j0);
                else if (n == 2)
                    BLK_NAME(body)(DT, 1, 2, wr, ws, x, tok + j0, nsb, res, i0, j0);
                else
                    BLK_NAME(body)(DT, 1, 1, wr, ws, x, tok + j0, nsb, res, i0, j0);
            }
            j0 += n;
        }
        i0 += rows;
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
