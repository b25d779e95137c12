/* dense_tile16 (kernels.c's products of a few rows with float weights), written once and included there
 * once per size of its accumulator array: DENSE_TILE16, the function's name (its step and its form for
 * weight rows `row_step` apart add _step and _rows to it), for at most DENSE_TILE16_ROWS rows. The size is
 * the instance's own because it changes the code generated: with an array for 8 rows the one-to-four-row
 * instance's (batch 1's) code was not the same. The unroll pragmas keep the wide instance's accumulators in
 * registers (without them the loops over 5-6 rows were not unrolled and the accumulators went through
 * memory every step); the 1-4 row code is the same with or without them. */

#define DENSE_TILE16_NAMED(suffix) DENSE_TILE16_JOIN(DENSE_TILE16, suffix)
#define DENSE_TILE16_JOIN(name, suffix) DENSE_TILE16_PASTE(name, suffix)
#define DENSE_TILE16_PASTE(name, suffix) name##suffix

/* One 64-byte step of DENSE_TILE16_NAMED(_rows) at column i: the weight rows' prefetches, then every x row
 * times every weight row, `mask` the step's columns (all 16 or 32 but in the last step of a row whose k they
 * do not divide). */
static ALWAYS_INLINE void DENSE_TILE16_NAMED(_step)(__m512 acc[DENSE_TILE16_ROWS][DENSE_TILE], const void *x,
                                                   const int rows, int64_t k, const void *w, const int bf16,
                                                   int64_t n0, int64_t row_step, const int outs, int64_t i,
                                                   int64_t ahead, __mmask32 mask) {
    const int64_t elem = bf16 ? 2 : 4;
    for (int t = 0; t < outs; t++)
        _mm_prefetch((const char *)w + ((n0 + t * row_step) * k + i) * elem + ahead, _MM_HINT_T1);
#if defined(DENSE_BFLOAT16_VECTOR)
    if (bf16) {
        __m512bh wv[DENSE_TILE];
        for (int t = 0; t < outs; t++)
            wv[t] = (__m512bh)_mm512_maskz_loadu_epi16(mask, (const uint16_t *)w + (n0 + t * row_step) * k + i);
        for (int r = 0; r < rows; r++) {
            const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, (const uint16_t *)x + r * k + i);
            for (int t = 0; t < outs; t++) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], xv, wv[t]);
        }
        return;
    }
#endif
    const __mmask16 mask16 = (__mmask16)mask;
    __m512 wv[DENSE_TILE];
    for (int t = 0; t < outs; t++)
        wv[t] = _mm512_maskz_loadu_ps(mask16, (const float *)w + (n0 + t * row_step) * k + i);
    for (int r = 0; r < rows; r++) {
        const __m512 xv = _mm512_maskz_loadu_ps(mask16, (const float *)x + r * k + i);
        for (int t = 0; t < outs; t++) acc[r][t] = _mm512_fmadd_ps(xv, wv[t], acc[r][t]);
    }
}

/* sums[r * DENSE_TILE + t] = x row r . W row n0 + t * row_step, for r < rows and t < outs: dense_tile_plain's
 * arithmetic with AVX-512, ROWS x OUTS accumulators in registers (constants after inlining), each weight row
 * also prefetched into L2 `ahead` bytes past the step it loads. Whole 64-byte steps load without a mask (the
 * constant mask folds away), only a row's last partial step with one. */
static ALWAYS_INLINE void DENSE_TILE16_NAMED(_rows)(const void *x, const int rows, int64_t k, const void *w,
                                                   const int bf16, int64_t n0, int64_t row_step, const int outs,
                                                   int64_t ahead, float *sums) {
    __m512 acc[DENSE_TILE16_ROWS][DENSE_TILE];
#pragma GCC unroll 8
    for (int r = 0; r < rows; r++)
        for (int t = 0; t < outs; t++) acc[r][t] = _mm512_setzero_ps();
    const int64_t step = bf16 ? 32 : 16; /* columns per 64 bytes */
    int64_t i = 0;
    for (; i + step <= k; i += step)
        DENSE_TILE16_NAMED(_step)(acc, x, rows, k, w, bf16, n0, row_step, outs, i, ahead, (__mmask32)0xffffffffu);
    if (i < k) {
        const __mmask32 mask = (__mmask32)((1u << (k - i)) - 1u);
        DENSE_TILE16_NAMED(_step)(acc, x, rows, k, w, bf16, n0, row_step, outs, i, ahead, mask);
    }
#pragma GCC unroll 8
    for (int r = 0; r < rows; r++)
        for (int t = 0; t < outs; t++) sums[r * DENSE_TILE + t] = dense_reduce(acc[r][t]);
}

/* DENSE_TILE16_NAMED(_rows) for a tile of adjacent weight rows n0 .. n0 + outs - 1, each prefetched at the
 * same column of a tile of rows DENSE_PREFETCH_BYTES or more ahead (the hardware prefetcher alone, over four
 * interleaved row streams, left the products at ~17 GB/s on two cores that read 25-30). */
static ALWAYS_INLINE void DENSE_TILE16(const void *x, const int rows, int64_t k, const void *w, const int bf16,
                                      int64_t n0, const int outs, float *sums) {
    const int64_t tile_bytes = DENSE_TILE * k * (bf16 ? 2 : 4);
    const int64_t ahead = (DENSE_PREFETCH_BYTES + tile_bytes - 1) / tile_bytes * tile_bytes;
    DENSE_TILE16_NAMED(_rows)(x, rows, k, w, bf16, n0, 1, outs, ahead, sums);
}

#undef DENSE_TILE16_NAMED
#undef DENSE_TILE16_JOIN
#undef DENSE_TILE16_PASTE
