/* Weight-quantized linear layers for CPU inference: y = x W^T (+ bias) with W kept in 32-value blocks
 * (engine/cpu/quantized.py repacks GGUF Q8_0 / Q4_0 / Q4_1 / Q4_K and int8-per-channel weights into
 * these two layouts once, at load):
 *
 *   QFORMAT_S8: per block 32 signed bytes q and a float scale d:      w = d * q
 *   QFORMAT_U4: per block 16 bytes, byte j holding value j in its low nibble and value j + 16 in its
 *               high nibble (GGUF Q4_0's order), a float scale d and a float offset m:  w = d * q + m
 *
 * The weights stay quantized in memory. Two products, chosen at build time by -march=native (kernels.py
 * builds on the machine that runs it):
 * - AVX-512 VNNI: x quantized per row and block of 32 to int8 (llama.cpp's Q8_0 activations), each block
 *   pair one vpdpbusd (64 byte products) scaled in float: the fastest here (docs/models.md), and x's int8
 *   rounding is its only difference from the dequantized float product (relative 1e-3..1e-2 of a dot).
 * - elsewhere: a tile of output rows dequantized into a float buffer and a float32 register-tiled
 *   micro-kernel over it (4 rows of x by 4 rows of W; AVX-512 16 lanes, AVX2 + FMA 8 lanes, plain C):
 *   the dequantized float product up to summation order.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

enum { QDTYPE_FLOAT32 = 0, QDTYPE_BFLOAT16 = 1 };
enum { QFORMAT_S8 = 0, QFORMAT_U4 = 1 };
enum { QBLOCK = 32 };
/* Output rows dequantized together (4 micro-tiles of 4) and activation rows per micro-tile. */
enum { QROWS_N = 16, QTILE_N = 4, QTILE_M = 4 };

static inline float q_bf16_to_float(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t q_float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

static inline int64_t qblock_bytes(int format) { return format == QFORMAT_S8 ? QBLOCK : QBLOCK / 2; }

#if defined(__GNUC__) || defined(__clang__)
#define Q_INLINE inline __attribute__((always_inline))
#else
#define Q_INLINE inline
#endif

/* Row n of W (k values) as floats: 16 values per vector with AVX-512, plain loops elsewhere (which gcc
 * vectorizes for AVX2). */
static void dequantize_row(const uint8_t *qweight, const float *scales, const float *mins, int format,
                           int64_t n, int64_t k, float *out) {
    const int64_t blocks = k / QBLOCK;
    const uint8_t *q = qweight + n * blocks * qblock_bytes(format);
    const float *d = scales + n * blocks;
    if (format == QFORMAT_S8) {
        for (int64_t b = 0; b < blocks; b++) {
            const int8_t *qb = (const int8_t *)(q + b * QBLOCK);
            float *o = out + b * QBLOCK;
#if defined(__AVX512F__)
            const __m512 dv = _mm512_set1_ps(d[b]);
            const __m512i q0 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)qb));
            const __m512i q1 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qb + 16)));
            _mm512_storeu_ps(o, _mm512_mul_ps(dv, _mm512_cvtepi32_ps(q0)));
            _mm512_storeu_ps(o + 16, _mm512_mul_ps(dv, _mm512_cvtepi32_ps(q1)));
#else
            for (int j = 0; j < QBLOCK; j++) o[j] = d[b] * (float)qb[j];
#endif
        }
        return;
    }
    const float *m = mins + n * blocks;
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *qb = q + b * (QBLOCK / 2);
        float *o = out + b * QBLOCK;
#if defined(__AVX512F__)
        const __m128i raw = _mm_loadu_si128((const __m128i *)qb), low4 = _mm_set1_epi8(0x0F);
        const __m512i lo = _mm512_cvtepu8_epi32(_mm_and_si128(raw, low4));
        const __m512i hi = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), low4));
        const __m512 dv = _mm512_set1_ps(d[b]), mv = _mm512_set1_ps(m[b]);
        _mm512_storeu_ps(o, _mm512_add_ps(_mm512_mul_ps(dv, _mm512_cvtepi32_ps(lo)), mv));
        _mm512_storeu_ps(o + 16, _mm512_add_ps(_mm512_mul_ps(dv, _mm512_cvtepi32_ps(hi)), mv));
#else
        for (int j = 0; j < QBLOCK / 2; j++) {
            o[j] = d[b] * (float)(qb[j] & 0x0F) + m[b];
            o[j + QBLOCK / 2] = d[b] * (float)(qb[j] >> 4) + m[b];
        }
#endif
    }
}

/* out[i][j] = dot(x[i], w[j]) over k values, for `mt` (1..4) rows of x and 4 rows of w (k a multiple of
 * 32). Inlined with constant `mt`, so the accumulators stay in registers. */
static Q_INLINE void dot_tile(const float *const x[QTILE_M], int mt, const float *w, int64_t k,
                              float out[QTILE_M][QTILE_N]) {
#if defined(__AVX512F__)
    __m512 acc[QTILE_M][QTILE_N];
#pragma GCC unroll 4
    for (int i = 0; i < mt; i++)
#pragma GCC unroll 4
        for (int j = 0; j < QTILE_N; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t p = 0; p < k; p += 16) {
        const __m512 w0 = _mm512_loadu_ps(w + p), w1 = _mm512_loadu_ps(w + k + p);
        const __m512 w2 = _mm512_loadu_ps(w + 2 * k + p), w3 = _mm512_loadu_ps(w + 3 * k + p);
#pragma GCC unroll 4
        for (int i = 0; i < mt; i++) {
            const __m512 xv = _mm512_loadu_ps(x[i] + p);
            acc[i][0] = _mm512_fmadd_ps(xv, w0, acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(xv, w1, acc[i][1]);
            acc[i][2] = _mm512_fmadd_ps(xv, w2, acc[i][2]);
            acc[i][3] = _mm512_fmadd_ps(xv, w3, acc[i][3]);
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < mt; i++)
#pragma GCC unroll 4
        for (int j = 0; j < QTILE_N; j++) out[i][j] = _mm512_reduce_add_ps(acc[i][j]);
#elif defined(__AVX2__) && defined(__FMA__)
    /* 16 ymm registers: two rows of x at a time (8 accumulators, 2 x, 1 w). */
    for (int i0 = 0; i0 < mt; i0 += 2) {
        const float *x0p = x[i0], *x1p = x[i0 + 1 < mt ? i0 + 1 : i0];
        __m256 acc[2][QTILE_N];
#pragma GCC unroll 4
        for (int j = 0; j < QTILE_N; j++) acc[0][j] = acc[1][j] = _mm256_setzero_ps();
        for (int64_t p = 0; p < k; p += 8) {
            const __m256 x0 = _mm256_loadu_ps(x0p + p), x1 = _mm256_loadu_ps(x1p + p);
#pragma GCC unroll 4
            for (int j = 0; j < QTILE_N; j++) {
                const __m256 wv = _mm256_loadu_ps(w + j * k + p);
                acc[0][j] = _mm256_fmadd_ps(x0, wv, acc[0][j]);
                acc[1][j] = _mm256_fmadd_ps(x1, wv, acc[1][j]);
            }
        }
        for (int i = 0; i < 2 && i0 + i < mt; i++)
            for (int j = 0; j < QTILE_N; j++) {
                const __m128 half = _mm_add_ps(_mm256_castps256_ps128(acc[i][j]), _mm256_extractf128_ps(acc[i][j], 1));
                const __m128 pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
                out[i0 + i][j] = _mm_cvtss_f32(_mm_add_ss(pair, _mm_shuffle_ps(pair, pair, 1)));
            }
    }
#else
    for (int i = 0; i < mt; i++)
        for (int j = 0; j < QTILE_N; j++) {
            const float *xi = x[i], *wj = w + j * k;
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t p = 0; p < k; p++) sum += xi[p] * wj[p];
            out[i][j] = sum;
        }
#endif
}

/* dot_tile for the first `mt` of 4 rows, each count a separate inlined copy. */
static void dot_tile_rows(const float *const x[QTILE_M], int mt, const float *w, int64_t k,
                          float out[QTILE_M][QTILE_N]) {
    switch (mt) {
    case 1: dot_tile(x, 1, w, k, out); break;
    case 2: dot_tile(x, 2, w, k, out); break;
    case 3: dot_tile(x, 3, w, k, out); break;
    default: dot_tile(x, 4, w, k, out); break;
    }
}

/* ---- AVX-512 VNNI: int8 dot products (the path where the CPU has them) ---------------------------------
 * x is quantized once per call like llama.cpp's Q8_0 activations: per row and block of 32, a float scale
 * dx = max |x| / 127 and int8 values qx = round(x / dx). A block's dot product with a weight block is then
 * one integer sum: vpdpbusd multiplies 64 unsigned by 64 signed bytes (two blocks) into 16 int32 lanes,
 * 8 per block, scaled by dw * dx and accumulated in float. u4 weights are unsigned already (the offset m
 * adds m * dx * sum(qx)); s8 weights go in as |w| with qx negated where w < 0. */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define QUANT_VNNI 1

/* rows x [rows, k] (float) as int8 qx [rows, k] and, per row and pair of blocks (2p, 2p + 1), 16 lanes
 * for the kernel: dx2 holds block 2p's scale dx in lanes 0-7 and block 2p + 1's in lanes 8-15 (0 past the
 * last block); sx2 likewise holds dx * sum(qx) / 8 (the u4 offset's factor: 8 lanes sum to it). */
static void quantize_activations(const float *x, int64_t rows, int64_t k, int8_t *qx, float *dx2, float *sx2) {
    const int64_t blocks = k / QBLOCK, pairs = (blocks + 1) / 2;
    for (int64_t r = 0; r < rows; r++) {
        float *d2 = dx2 + r * pairs * 16, *s2 = sx2 + r * pairs * 16;
        if (blocks % 2) {
            memset(d2 + (pairs - 1) * 16 + 8, 0, 8 * sizeof(float));
            memset(s2 + (pairs - 1) * 16 + 8, 0, 8 * sizeof(float));
        }
        for (int64_t b = 0; b < blocks; b++) {
            const float *xb = x + r * k + b * QBLOCK;
            const __m512 lo = _mm512_loadu_ps(xb), hi = _mm512_loadu_ps(xb + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
            const float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(inv)));
            const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(inv)));
            _mm_storeu_si128((__m128i *)(qx + r * k + b * QBLOCK), _mm512_cvtsepi32_epi8(q0));
            _mm_storeu_si128((__m128i *)(qx + r * k + b * QBLOCK + 16), _mm512_cvtsepi32_epi8(q1));
            const float sum = d * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)) * 0.125f;
            _mm256_storeu_ps(d2 + b * 8, _mm256_set1_ps(d));
            _mm256_storeu_ps(s2 + b * 8, _mm256_set1_ps(sum));
        }
    }
}

/* Two weight blocks (b, b + 1; only b when `one`) as 64 bytes in value order: u4 nibbles unpacked. */
static Q_INLINE __m512i weight_pair(const uint8_t *q, int format, int64_t b, int one) {
    if (format == QFORMAT_S8) {
        return one ? _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)(q + b * QBLOCK)))
                   : _mm512_loadu_si512((const void *)(q + b * QBLOCK));
    }
    const __m256i packed = one ? _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)(q + b * 16)))
                               : _mm256_loadu_si256((const __m256i *)(q + b * 16));
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const __m256i lo = _mm256_and_si256(packed, low4);                         /* [A.lo, B.lo] */
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);   /* [A.hi, B.hi] */
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); /* [A.lo B.lo A.hi B.hi] */
    return _mm512_shuffle_i64x2(both, both, _MM_SHUFFLE(3, 1, 2, 0));         /* [A.lo A.hi B.lo B.hi] */
}

/* out[i] = dot(x row i, W row n) for `mt` (1..4) quantized rows of x (dx2 / sx2 rows: see above). */
static Q_INLINE void vnni_row(const int8_t *const qx[QTILE_M], const float *const dx2[QTILE_M],
                              const float *const sx2[QTILE_M], int mt, const uint8_t *q, const float *dw,
                              const float *mw, int format, int64_t blocks, float out[QTILE_M]) {
    __m512 acc[QTILE_M];
#pragma GCC unroll 4
    for (int i = 0; i < mt; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b += 2) {
        const int one = b + 1 == blocks;
        const __m512i w = weight_pair(q, format, b, one);
        const __m512i wu = format == QFORMAT_S8 ? _mm512_abs_epi8(w) : w;
        const __mmask64 negative = format == QFORMAT_S8 ? _mm512_movepi8_mask(w) : 0;
        const __mmask64 valid = one ? 0xFFFFFFFFull : ~0ull;
        const __m512 dwv = _mm512_insertf32x8(_mm512_set1_ps(dw[b]), _mm256_set1_ps(one ? 0.0f : dw[b + 1]), 1);
        const __m512 mwv = format == QFORMAT_U4
            ? _mm512_insertf32x8(_mm512_set1_ps(mw[b]), _mm256_set1_ps(one ? 0.0f : mw[b + 1]), 1)
            : _mm512_setzero_ps();
#pragma GCC unroll 4
        for (int i = 0; i < mt; i++) {
            __m512i a = _mm512_maskz_loadu_epi8(valid, qx[i] + b * QBLOCK);
            if (format == QFORMAT_S8) a = _mm512_mask_sub_epi8(a, negative, _mm512_setzero_si512(), a);
            const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wu, a);
            const __m512 scale = _mm512_mul_ps(dwv, _mm512_loadu_ps(dx2[i] + b * 8));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[i]);
            if (format == QFORMAT_U4) acc[i] = _mm512_fmadd_ps(mwv, _mm512_loadu_ps(sx2[i] + b * 8), acc[i]);
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < mt; i++) out[i] = _mm512_reduce_add_ps(acc[i]);
}

/* vnni_row with `mt` a constant in each copy, and the layout's branches resolved once per row. */
static void vnni_rows(const int8_t *const qx[QTILE_M], const float *const dx2[QTILE_M],
                      const float *const sx2[QTILE_M], int mt, const uint8_t *q, const float *dw,
                      const float *mw, int format, int64_t blocks, float out[QTILE_M]) {
#define VNNI_CASES(FORMAT)                                                                   \
    switch (mt) {                                                                            \
    case 1: vnni_row(qx, dx2, sx2, 1, q, dw, mw, FORMAT, blocks, out); break;                \
    case 2: vnni_row(qx, dx2, sx2, 2, q, dw, mw, FORMAT, blocks, out); break;                \
    case 3: vnni_row(qx, dx2, sx2, 3, q, dw, mw, FORMAT, blocks, out); break;                \
    default: vnni_row(qx, dx2, sx2, 4, q, dw, mw, FORMAT, blocks, out); break;               \
    }
    if (format == QFORMAT_S8) {
        VNNI_CASES(QFORMAT_S8)
    } else {
        VNNI_CASES(QFORMAT_U4)
    }
#undef VNNI_CASES
}
#endif

/* Which product quant_linear computes: 1 int8 dot products (x quantized per 32-block), 0 float. */
int quant_linear_int8_activations(void) {
#if defined(QUANT_VNNI)
    return 1;
#else
    return 0;
#endif
}

/* out [rows, n] = x [rows, k] W^T (+ bias [n]) for W [n, k] in `format` (see the top of the file).
 * x, bias and out in `dtype` (bias may be NULL); k a multiple of 32. Returns 0, or -1 when out of memory. */
int quant_linear(const void *x, int64_t rows, int64_t k, const uint8_t *qweight, const float *scales,
                 const float *mins, int format, int64_t n, const void *bias, int dtype, void *out,
                 int num_threads) {
    const float *xf = (const float *)x;
    float *converted = NULL;
    if (dtype == QDTYPE_BFLOAT16) {
        converted = malloc((size_t)(rows * k) * sizeof(float));
        if (converted == NULL) return -1;
        const uint16_t *xb = (const uint16_t *)x;
        for (int64_t i = 0; i < rows * k; i++) converted[i] = q_bf16_to_float(xb[i]);
        xf = converted;
    }
    const int64_t groups = (n + QROWS_N - 1) / QROWS_N;
    int failed = 0;
#if defined(QUANT_VNNI)
    {
        const int64_t blocks = k / QBLOCK, pair_lanes = (blocks + 1) / 2 * 16;
        int8_t *qx = malloc((size_t)(rows * k));
        float *dx = malloc((size_t)(rows * pair_lanes) * sizeof(float));
        float *sx = malloc((size_t)(rows * pair_lanes) * sizeof(float));
        if (qx == NULL || dx == NULL || sx == NULL) failed = 1;
        else quantize_activations(xf, rows, k, qx, dx, sx);
        const int64_t row_bytes = blocks * qblock_bytes(format);
        const int threads = (int)(groups < num_threads ? groups : num_threads);
#pragma omp parallel for num_threads(threads > 0 ? threads : 1) schedule(static) if (!failed)
        for (int64_t g = 0; g < groups; g++) {
            if (failed) continue;
            const int64_t n_end = (g + 1) * QROWS_N < n ? (g + 1) * QROWS_N : n;
            for (int64_t m0 = 0; m0 < rows; m0 += QTILE_M) {
                const int mt = rows - m0 < QTILE_M ? (int)(rows - m0) : QTILE_M;
                const int8_t *qrows[QTILE_M];
                const float *drows[QTILE_M], *srows[QTILE_M];
                for (int i = 0; i < QTILE_M; i++) {
                    const int64_t r = i < mt ? m0 + i : m0;
                    qrows[i] = qx + r * k;
                    drows[i] = dx + r * pair_lanes;
                    srows[i] = sx + r * pair_lanes;
                }
                for (int64_t col = g * QROWS_N; col < n_end; col++) {
                    float values[QTILE_M];
                    vnni_rows(qrows, drows, srows, mt, qweight + col * row_bytes, scales + col * blocks,
                              mins == NULL ? NULL : mins + col * blocks, format, blocks, values);
                    for (int i = 0; i < mt; i++) {
                        float value = values[i];
                        if (dtype == QDTYPE_BFLOAT16) {
                            if (bias != NULL) value += q_bf16_to_float(((const uint16_t *)bias)[col]);
                            ((uint16_t *)out)[(m0 + i) * n + col] = q_float_to_bf16(value);
                        } else {
                            if (bias != NULL) value += ((const float *)bias)[col];
                            ((float *)out)[(m0 + i) * n + col] = value;
                        }
                    }
                }
            }
        }
        free(qx);
        free(dx);
        free(sx);
        free(converted);
        return failed ? -1 : 0;
    }
#endif
    /* Few groups (a small layer) or little work: fewer threads than asked, never more than groups. */
    const int threads = (int)(groups < num_threads ? groups : num_threads);
#pragma omp parallel num_threads(threads > 0 ? threads : 1)
    {
        float *wbuf = malloc((size_t)(QROWS_N * k) * sizeof(float));
        if (wbuf == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            if (wbuf == NULL) continue;
            const int64_t n0 = g * QROWS_N;
            const int64_t valid_n = n - n0 < QROWS_N ? n - n0 : QROWS_N;
            for (int64_t j = 0; j < QROWS_N; j++) {
                if (j < valid_n)
                    dequantize_row(qweight, scales, mins, format, n0 + j, k, wbuf + j * k);
                else
                    memset(wbuf + j * k, 0, (size_t)k * sizeof(float));
            }
            for (int64_t m0 = 0; m0 < rows; m0 += QTILE_M) {
                const float *xrows[QTILE_M];
                const int mt = rows - m0 < QTILE_M ? (int)(rows - m0) : QTILE_M;
                for (int i = 0; i < QTILE_M; i++) xrows[i] = xf + (i < mt ? m0 + i : m0) * k;
                for (int64_t t = 0; t < valid_n; t += QTILE_N) {
                    float tile[QTILE_M][QTILE_N];
                    dot_tile_rows(xrows, mt, wbuf + t * k, k, tile);
                    for (int i = 0; i < mt; i++)
                        for (int j = 0; j < QTILE_N && t + j < valid_n; j++) {
                            const int64_t col = n0 + t + j;
                            float value = tile[i][j];
                            if (dtype == QDTYPE_BFLOAT16) {
                                if (bias != NULL) value += q_bf16_to_float(((const uint16_t *)bias)[col]);
                                ((uint16_t *)out)[(m0 + i) * n + col] = q_float_to_bf16(value);
                            } else {
                                if (bias != NULL) value += ((const float *)bias)[col];
                                ((float *)out)[(m0 + i) * n + col] = value;
                            }
                        }
                }
            }
        }
        free(wbuf);
    }
    free(converted);
    return failed ? -1 : 0;
}

/* out [count, k] = rows ids[0..count) of W [_, k] dequantized (an embedding lookup), in `dtype`.
 * Returns 0, or -1 when out of memory. */
int quant_rows(const uint8_t *qweight, const float *scales, const float *mins, int format, int64_t k,
                const int64_t *ids, int64_t count, int dtype, void *out) {
    float *row = malloc((size_t)k * sizeof(float));
    if (row == NULL) return -1;
    for (int64_t r = 0; r < count; r++) {
        float *dst = dtype == QDTYPE_FLOAT32 ? (float *)out + r * k : row;
        dequantize_row(qweight, scales, mins, format, ids[r], k, dst);
        if (dtype == QDTYPE_BFLOAT16) {
            uint16_t *o = (uint16_t *)out + r * k;
            int64_t p = 0;
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
            for (; p + 16 <= k; p += 16)
                _mm256_storeu_si256((__m256i *)(o + p), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(row + p)));
#endif
            for (; p < k; p++) o[p] = q_float_to_bf16(row[p]);
        }
    }
    free(row);
    return 0;
}
