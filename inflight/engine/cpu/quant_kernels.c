/* Weight-quantized linear layers for CPU inference: y = x W^T (+ bias) with W kept in 32-value blocks
 * (engine/cpu/quantized.py repacks GGUF Q8_0 / Q4_0 / Q4_1 / Q4_K and int8-per-channel weights into
 * these two layouts once, at load):
 *
 *   QFORMAT_S8: per block 32 signed bytes q and a float scale d:      w = d * q
 *   QFORMAT_U4: per block 16 bytes, byte j holding value j in its low nibble and value j + 16 in its
 *               high nibble (GGUF Q4_0's order), a float scale d and a float offset m:  w = d * q + m
 *
 * The weights stay quantized in memory; the kernel dequantizes a tile of output rows into a float buffer
 * the size of the L1/L2 cache and runs a float32 register-tiled dot-product micro-kernel over it (4 rows of
 * x by 4 rows of W; AVX-512 16 lanes, AVX2 + FMA 8 lanes, plain C elsewhere), so the activations stay
 * float32 (no second rounding of x) and the result is the dequantized float matmul up to summation order.
 * Built beside kernels.c by kernels.py with the same flags; -march=native picks the path at build time on
 * the machine that runs it.
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
        if (dtype == QDTYPE_BFLOAT16)
            for (int64_t p = 0; p < k; p++) ((uint16_t *)out)[r * k + p] = q_float_to_bf16(row[p]);
    }
    free(row);
    return 0;
}
