/* Weight-quantized linear layers for CPU inference: y = x W^T (+ bias) with W kept in 32-value blocks
 * (engine/cpu/quantized.py repacks GGUF Q8_0 / Q4_0 / Q4_1 / Q4_K and int8-per-channel weights into
 * these two formats once, at load, and interleaves them before the first product or lookup):
 *
 *   QFORMAT_S8: per block 32 signed bytes q and a float scale d:      w = d * q
 *   QFORMAT_U4: per block 32 nibbles q, a float scale d and a float offset m:  w = d * q + m
 *
 * with the matrix's scales and offsets stored as float16 (format + QSCALES_F16: GGUF's own float16
 * values, 2 bytes a block less to read than float32) or float32 (where float16 cannot hold them: Q4_K's
 * products of two scales). They are widened to float32 as they are loaded (vcvtph2ps), so a float16 scale
 * gives the same products as the same value stored as float32. The layout's constants (QBLOCK, QGROUP,
 * the format codes) are defined once, in quant_layout.py, and given to the compiler as -D flags.
 *
 * The kernels read W interleaved by groups of QGROUP (16) output rows, so that one 64-byte load holds 4
 * consecutive bytes of each of the group's 16 rows (one int32 lane per row) and the group's 16 scales
 * are one vector. For group g (rows 16g..16g+15, zero rows past the last) and block b:
 *   qweight + (g * blocks + b) * 16 * bytes_per_block:
 *     s8: 8 x [16 rows x 4 bytes]: chunk j lane r holds row r's values 4j..4j+3, each stored + 128
 *         (as unsigned bytes: value q is byte q ^ 0x80)
 *     u4: 4 x [16 rows x 4 bytes]: chunk j lane r holds row r's row-major bytes 4j..4j+3, byte i holding
 *         value i in its low nibble and value i + 16 in its high nibble (GGUF Q4_0's order)
 *   scales (and mins) + (g * blocks + b) * 16 elements: the 16 rows' scales (offsets).
 *
 * The weights stay quantized in memory. Two products, chosen at build time by -march=native (kernels.py
 * builds on the machine that runs it):
 * - AVX-512 VNNI: x quantized per row and block of 32 to int8 (llama.cpp's Q8_0 activations); per block
 *   and group, 8 vpdpbusd (unsigned weight bytes by x's 4 bytes broadcast) give the 16 rows' integer dot
 *   products at once, then one float multiply-add by the 16 scales times x's scale: the fastest here
 *   (docs/models.md). x's int8 rounding is its only difference from the dequantized float product
 *   (relative 1e-3..1e-2 of a dot). s8's + 128 comes back out as 128 * sum(qx), u4's offset as
 *   m * dx * sum(qx).
 * - AVX2 + FMA without AVX-512 (quant_linear_few_rows): float x by 8-output vectors of the weights taken
 *   straight from the interleaved chunks, each block's sums scaled once: the dequantized float product up to
 *   rounding and summation order.
 * - elsewhere (AVX-512 without VNNI, plain C): a group's rows dequantized into a float buffer and a float32
 *   register-tiled micro-kernel over it (4 rows of x by 4 rows of W): the dequantized float product up to
 *   summation order.
 * Prompt rows (quantized.py sends more than 8 rows outside a decode step to them) take quant_linear_float on
 * AVX-512 and AVX2 + FMA builds: float32 x by the weights dequantized panel by panel (below), the dequantized
 * float product; quant_rows dequantizes rows (an embedding lookup, or a whole matrix for the other builds' float products).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "float_bits.h"
#include "kernels.h"
#include "simd_common.h"
#if defined(__AVX2__) || defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif
/* AVX2 + FMA (+ F16C) without AVX-512: quant_linear multiplies float x by the weights as they lie
 * (quant_linear_few_rows, below the panel product), not through a dequantized copy, and the panel product's
 * vector operations are AVX2's (8 lanes). */
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
#define QUANT_FEW_ROWS 1
#endif

#if !defined(QBLOCK) || !defined(QGROUP) || !defined(QFORMAT_S8) || !defined(QFORMAT_U4) || \
    !defined(QSCALES_F16) || !defined(QS8_OFFSET)
#error "the quantized layout comes from quant_layout.py: build through kernels.py (-D flags)"
#endif
/* QBLOCK values per block, QGROUP rows per interleaved group (dequantized together: 4 micro-tiles of 4). */
_Static_assert(QBLOCK == 32 && QGROUP == 16,
               "the vector code holds a group's 16 rows in one 512-bit register and a block in 8 chunks of 4");

enum { QDTYPE_FLOAT32 = 0, QDTYPE_BFLOAT16 = 1 };
/* Activation rows and weight rows per micro-tile of the float product. */
enum { QTILE_N = 4, QTILE_M = 4 };
/* Rows of x per pass of the VNNI product over a group of weight rows: one unpacking of the group's weights
 * serves up to 8 rows (a 5-row verify step's rows in one pass, not 4 and then 1 alone). */
enum { QVNNI_ROWS = 8 };
/* Multiply-adds (rows x n x k) per OpenMP thread of quant_linear: a decoder layer's projections at batch 1
 * (SmolLM2's 0.3-1.8 M) are split over the threads as the LM head is: one thread reads the weights at ~15
 * GB/s, two at 25-30 (docs/models.md). Below 64 K (a 64 KB product: a few microseconds) one thread. */
#define QWORK_PER_THREAD ((int64_t)1 << 16)
/* OpenMP threads for `work` units at `per_thread` units a thread: at least one, at most num_threads and
 * `parts` (the pieces the work is split into). */
static inline int threads_for_work(int64_t work, int64_t per_thread, int num_threads, int64_t parts) {
    int64_t threads = work / per_thread;
    if (threads > num_threads) threads = num_threads;
    if (threads > parts) threads = parts;
    return threads < 1 ? 1 : (int)threads;
}
/* The VNNI product prefetches the weights into L2 this many bytes ahead of the block it reads: a group's
 * blocks, and the groups one after another, lie in one stream (see the top of the file). */
#define QPREFETCH_BYTES 8192

/* A format argument's layout (QFORMAT_S8 or QFORMAT_U4) and whether its scales are float16. */
static inline int qkind(int format) { return format & ~QSCALES_F16; }
static inline int qhalf(int format) { return (format & QSCALES_F16) != 0; }
static inline int64_t qblock_bytes(int format) { return qkind(format) == QFORMAT_S8 ? QBLOCK : QBLOCK / 2; }

/* IEEE float16 bits as a float (exact). */
static inline float q_half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu;
    uint32_t bits;
    if (exponent == 0x1F) {
        bits = sign | 0x7F800000u | (mantissa << 13);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else {
        bits = sign | bits_of((float)mantissa * 0x1p-24f); /* zero or subnormal: exact in float */
    }
    return float_of(bits);
#endif
}

/* Element i of a matrix's scales (or offsets), float16 (`half`) or float32, as a float. */
static ALWAYS_INLINE float scale_at(const void *scales, int64_t i, int half) {
    return half ? q_half_to_float(((const uint16_t *)scales)[i]) : ((const float *)scales)[i];
}

/* The scales from element i on. */
static ALWAYS_INLINE const void *scales_from(const void *scales, int64_t i, int half) {
    return half ? (const void *)((const uint16_t *)scales + i) : (const void *)((const float *)scales + i);
}

#if defined(__AVX512F__)
/* Elements i..i+15 of a matrix's scales (or offsets) as floats: one load (and vcvtph2ps for float16). */
static ALWAYS_INLINE __m512 scales16(const void *scales, int64_t i, int half) {
    return half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)scales + i)))
                : _mm512_loadu_ps((const float *)scales + i);
}
#endif

/* Row n of W (k values, interleaved: see the top of the file) as floats; `kind` and `half` split from
 * the format (constants in each inlined copy). */
static ALWAYS_INLINE void dequantize_row_as(const uint8_t *qweight, const void *scales, const void *mins, int kind,
                                           int half, int64_t n, int64_t k, float *out) {
    const int64_t blocks = k / QBLOCK, g = n / QGROUP, r = n % QGROUP;
    const int64_t group_block = QGROUP * qblock_bytes(kind);
    const uint8_t *q = qweight + g * blocks * group_block + r * 4;
    const int64_t first = g * blocks * QGROUP + r; /* the row's first scale */
    if (kind == QFORMAT_S8) {
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t *qb = q + b * group_block;
            float *o = out + b * QBLOCK;
            const float db = scale_at(scales, first + b * QGROUP, half);
#if defined(__AVX512F__)
            /* The 8 chunks' 4 bytes of this row: 32 values in order. */
            const __m256i offsets = _mm256_setr_epi32(0, 64, 128, 192, 256, 320, 384, 448);
            const __m256i raw = _mm256_xor_si256(_mm256_i32gather_epi32((const int *)qb, offsets, 1),
                                                 _mm256_set1_epi8((char)QS8_OFFSET));
            const __m512 dv = _mm512_set1_ps(db);
            const __m512i q0 = _mm512_cvtepi8_epi32(_mm256_castsi256_si128(raw));
            const __m512i q1 = _mm512_cvtepi8_epi32(_mm256_extracti128_si256(raw, 1));
            _mm512_storeu_ps(o, _mm512_mul_ps(dv, _mm512_cvtepi32_ps(q0)));
            _mm512_storeu_ps(o + 16, _mm512_mul_ps(dv, _mm512_cvtepi32_ps(q1)));
#else
            for (int j = 0; j < QBLOCK / 4; j++)
                for (int t = 0; t < 4; t++) o[4 * j + t] = db * (float)((int)qb[j * 64 + t] - QS8_OFFSET);
#endif
        }
        return;
    }
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *qb = q + b * group_block;
        float *o = out + b * QBLOCK;
        const float db = scale_at(scales, first + b * QGROUP, half), mb = scale_at(mins, first + b * QGROUP, half);
#if defined(__AVX512F__)
        const __m128i raw = _mm_i32gather_epi32((const int *)qb, _mm_setr_epi32(0, 64, 128, 192), 1);
        const __m128i low4 = _mm_set1_epi8(0x0F);
        const __m512i lo = _mm512_cvtepu8_epi32(_mm_and_si128(raw, low4));
        const __m512i hi = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), low4));
        const __m512 dv = _mm512_set1_ps(db), mv = _mm512_set1_ps(mb);
        _mm512_storeu_ps(o, _mm512_add_ps(_mm512_mul_ps(dv, _mm512_cvtepi32_ps(lo)), mv));
        _mm512_storeu_ps(o + 16, _mm512_add_ps(_mm512_mul_ps(dv, _mm512_cvtepi32_ps(hi)), mv));
#else
        for (int j = 0; j < QBLOCK / 8; j++)
            for (int t = 0; t < 4; t++) {
                const uint8_t byte = qb[j * 64 + t];
                o[4 * j + t] = db * (float)(byte & 0x0F) + mb;
                o[4 * j + t + QBLOCK / 2] = db * (float)(byte >> 4) + mb;
            }
#endif
    }
}

/* dequantize_row_as for a format argument (one inlined copy per layout and scale type). */
static void dequantize_row(const uint8_t *qweight, const void *scales, const void *mins, int format, int64_t n,
                           int64_t k, float *out) {
    if (qkind(format) == QFORMAT_S8) {
        if (qhalf(format)) dequantize_row_as(qweight, scales, mins, QFORMAT_S8, 1, n, k, out);
        else dequantize_row_as(qweight, scales, mins, QFORMAT_S8, 0, n, k, out);
    } else {
        if (qhalf(format)) dequantize_row_as(qweight, scales, mins, QFORMAT_U4, 1, n, k, out);
        else dequantize_row_as(qweight, scales, mins, QFORMAT_U4, 0, n, k, out);
    }
}

#if !defined(QUANT_FEW_ROWS)
/* out[i][j] = dot(x[i], w[j]) over k values, for `mt` (1..4) rows of x and 4 rows of w (k a multiple of
 * 32). Inlined with constant `mt`, so the accumulators stay in registers. */
static ALWAYS_INLINE void dot_tile(const float *const x[QTILE_M], int mt, const float *w, int64_t k,
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
#endif

/* ---- AVX-512 VNNI: int8 dot products (the path where the CPU has them) ---------------------------------
 * x is quantized once per call like llama.cpp's Q8_0 activations: per row and block of 32, a float scale
 * dx = max |x| / 127, int8 values qx = round(x / dx) and their sum sq. A block's dot products with a group
 * of 16 weight rows are then 8 vpdpbusd: chunk j of the weights (16 rows x 4 unsigned bytes, u4 nibbles
 * unpacked) by qx's bytes 4j..4j+3 broadcast, summed in the 16 int32 lanes; scaled by the 16 dw times dx
 * and accumulated in float. s8 weights carry + 128 (the sum starts at -128 sq); u4's offset m adds
 * m * dx * sq. */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define QUANT_VNNI 1

/* rows x [rows, k] (float) as int8 qx [rows, k], and per row and block its scale dx, sum sq and dx * sq (the
 * factor of u4's offsets, computed once here instead of once per group of weight rows). */
static void quantize_activations(const float *x, int64_t rows, int64_t k, int8_t *qx, float *dx, int32_t *sq,
                                 float *dsq) {
    const int64_t blocks = k / QBLOCK;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < blocks; b++) {
            const float *xb = x + r * k + b * QBLOCK;
            const __m512 lo = _mm512_loadu_ps(xb), hi = _mm512_loadu_ps(xb + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
            const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(inv)));
            const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(inv)));
            _mm_storeu_si128((__m128i *)(qx + r * k + b * QBLOCK), _mm512_cvtsepi32_epi8(q0));
            _mm_storeu_si128((__m128i *)(qx + r * k + b * QBLOCK + 16), _mm512_cvtsepi32_epi8(q1));
            dx[r * blocks + b] = amax / 127.0f;
            sq[r * blocks + b] = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
            dsq[r * blocks + b] = dx[r * blocks + b] * (float)sq[r * blocks + b];
        }
}

/* The 4 bytes of qx at `p` in every int32 lane. */
static ALWAYS_INLINE __m512i broadcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm512_set1_epi32(v);
}

/* out[i] (16 lanes: the group's rows) = dot(x row i, W's group) for `mt` (1..8) quantized rows of x; with
 * `prefetch`, each block's weight lines also prefetched into L2 QPREFETCH_BYTES ahead (for the first tile
 * of x's rows: the later ones find the group in cache). */
static ALWAYS_INLINE void vnni_group(const int8_t *const qx[QVNNI_ROWS], const float *const dx[QVNNI_ROWS],
                                     const int32_t *const sq[QVNNI_ROWS], const float *const dsq[QVNNI_ROWS], int mt,
                                     const uint8_t *q, const void *dw, const void *mw, int kind, int half,
                                     int64_t blocks, int prefetch, __m512 out[QVNNI_ROWS]) {
    const int64_t group_block = QGROUP * qblock_bytes(kind);
    __m512 acc[QVNNI_ROWS];
#pragma GCC unroll 8
    for (int i = 0; i < mt; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *qb = q + b * group_block;
        if (prefetch)
            for (int64_t line = 0; line < group_block; line += 64)
                _mm_prefetch((const char *)qb + line + QPREFETCH_BYTES, _MM_HINT_T1);
        __m512i w[8];
        if (kind == QFORMAT_S8) {
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) w[j] = _mm512_loadu_si512((const void *)(qb + 64 * j));
        } else {
            const __m512i low4 = _mm512_set1_epi8(0x0F);
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                const __m512i raw = _mm512_loadu_si512((const void *)(qb + 64 * j));
                w[j] = _mm512_and_si512(raw, low4);
                w[j + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
            }
        }
        /* The group's 16 scales (and offsets) for this block: one load each, widened once for the x rows. */
        const __m512 dwv = scales16(dw, b * QGROUP, half);
        const __m512 mwv = kind == QFORMAT_U4 ? scales16(mw, b * QGROUP, half) : _mm512_setzero_ps();
#pragma GCC unroll 8
        for (int i = 0; i < mt; i++) {
            const int8_t *xb = qx[i] + b * QBLOCK;
            const int32_t sum = sq[i][b];
            /* Two chains of 4 dependent vpdpbusd instead of one of 8. */
            __m512i s0 = kind == QFORMAT_S8 ? _mm512_set1_epi32(-QS8_OFFSET * sum) : _mm512_setzero_si512();
            __m512i s1 = _mm512_setzero_si512();
#pragma GCC unroll 4
            for (int j = 0; j < 8; j += 2) {
                s0 = _mm512_dpbusd_epi32(s0, w[j], broadcast4(xb + 4 * j));
                s1 = _mm512_dpbusd_epi32(s1, w[j + 1], broadcast4(xb + 4 * j + 4));
            }
            const float d = dx[i][b];
            const __m512i dot = _mm512_add_epi32(s0, s1);
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dwv, _mm512_set1_ps(d)), acc[i]);
            if (kind == QFORMAT_U4)
                acc[i] = _mm512_fmadd_ps(mwv, _mm512_set1_ps(dsq[i][b]), acc[i]);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < mt; i++) out[i] = acc[i];
}

/* vnni_group with `mt`, the layout and the scale type constants in each copy. */
static void vnni_groups(const int8_t *const qx[QVNNI_ROWS], const float *const dx[QVNNI_ROWS],
                        const int32_t *const sq[QVNNI_ROWS], const float *const dsq[QVNNI_ROWS], int mt,
                        const uint8_t *q, const void *dw, const void *mw, int format, int64_t blocks, int prefetch,
                        __m512 out[QVNNI_ROWS]) {
#define VNNI_CASES(KIND, HALF)                                                                     \
    switch (mt) {                                                                                  \
    case 1: vnni_group(qx, dx, sq, dsq, 1, q, dw, mw, KIND, HALF, blocks, prefetch, out); break;   \
    case 2: vnni_group(qx, dx, sq, dsq, 2, q, dw, mw, KIND, HALF, blocks, prefetch, out); break;   \
    case 3: vnni_group(qx, dx, sq, dsq, 3, q, dw, mw, KIND, HALF, blocks, prefetch, out); break;   \
    case 4: vnni_group(qx, dx, sq, dsq, 4, q, dw, mw, KIND, HALF, blocks, prefetch, out); break;   \
    case 5: vnni_group(qx, dx, sq, dsq, 5, q, dw, mw, KIND, HALF, blocks, prefetch, out); break;   \
    case 6: vnni_group(qx, dx, sq, dsq, 6, q, dw, mw, KIND, HALF, blocks, prefetch, out); break;   \
    case 7: vnni_group(qx, dx, sq, dsq, 7, q, dw, mw, KIND, HALF, blocks, prefetch, out); break;   \
    default: vnni_group(qx, dx, sq, dsq, 8, q, dw, mw, KIND, HALF, blocks, prefetch, out); break;  \
    }
    if (qkind(format) == QFORMAT_S8) {
        if (qhalf(format)) {
            VNNI_CASES(QFORMAT_S8, 1)
        } else {
            VNNI_CASES(QFORMAT_S8, 0)
        }
    } else {
        if (qhalf(format)) {
            VNNI_CASES(QFORMAT_U4, 1)
        } else {
            VNNI_CASES(QFORMAT_U4, 0)
        }
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

/* out[row, col] = value (+ bias[col], in `dtype`) in `out_dtype`. */
static ALWAYS_INLINE void store_output(void *out, const void *bias, int dtype, int out_dtype, int64_t n, int64_t row,
                                       int64_t col, float value) {
    if (bias != NULL)
        value += dtype == QDTYPE_BFLOAT16 ? bf16_to_float(((const uint16_t *)bias)[col]) : ((const float *)bias)[col];
    if (out_dtype == QDTYPE_BFLOAT16)
        ((uint16_t *)out)[row * n + col] = float_to_bf16(value);
    else
        ((float *)out)[row * n + col] = value;
}

#if defined(QUANT_FEW_ROWS)
static int quant_linear_few_rows(const float *x, int64_t rows, int64_t k, const uint8_t *qweight, const void *scales,
                                 const void *mins, int format, int64_t n, const void *bias, int dtype, void *out,
                                 int out_dtype, int threads);
#endif

/* out [rows, n] = x [rows, k] W^T (+ bias [n]) for W [n, k] in `format` (QFORMAT_*, + QSCALES_F16 for
 * float16 scales), interleaved (see the top of the file). x and bias in `dtype` (bias may be NULL), out in `out_dtype` (float32 logits from bfloat16
 * activations: no bfloat16 rounding of the sums); k a multiple of 32. Returns 0, or -1 when out of memory. */
int quant_linear(const void *x, int64_t rows, int64_t k, const uint8_t *qweight, const void *scales,
                 const void *mins, int format, int64_t n, const void *bias, int dtype, void *out, int out_dtype,
                 int num_threads) {
    const float *xf = (const float *)x;
    float *converted = NULL;
    if (dtype == QDTYPE_BFLOAT16) {
        converted = malloc((size_t)(rows * k) * sizeof(float));
        if (converted == NULL) return -1;
        const uint16_t *xb = (const uint16_t *)x;
        for (int64_t i = 0; i < rows * k; i++) converted[i] = bf16_to_float(xb[i]);
        xf = converted;
    }
    const int64_t groups = (n + QGROUP - 1) / QGROUP;
    /* A thread per QWORK_PER_THREAD products (at least one), at most num_threads and never more than
     * groups. Each group's sums are the same whichever thread computes them: the outputs do not depend on
     * the thread count. */
    const int threads = threads_for_work(rows * n * k, QWORK_PER_THREAD, num_threads, groups);
    int failed = 0;
#if defined(QUANT_VNNI)
    {
        const int64_t blocks = k / QBLOCK;
        int8_t *qx = malloc((size_t)(rows * k));
        float *dx = malloc((size_t)(rows * blocks) * sizeof(float));
        int32_t *sq = malloc((size_t)(rows * blocks) * sizeof(int32_t));
        float *dsq = malloc((size_t)(rows * blocks) * sizeof(float));
        if (qx == NULL || dx == NULL || sq == NULL || dsq == NULL) failed = 1;
        else quantize_activations(xf, rows, k, qx, dx, sq, dsq);
        const int64_t group_bytes = blocks * QGROUP * qblock_bytes(format), group_scales = blocks * QGROUP;
#pragma omp parallel for num_threads(threads) schedule(static) if (!failed)
        for (int64_t g = 0; g < groups; g++) {
            if (failed) continue;
            const int64_t valid = n - g * QGROUP < QGROUP ? n - g * QGROUP : QGROUP;
            for (int64_t m0 = 0; m0 < rows; m0 += QVNNI_ROWS) {
                const int mt = rows - m0 < QVNNI_ROWS ? (int)(rows - m0) : QVNNI_ROWS;
                const int8_t *qrows[QVNNI_ROWS];
                const float *drows[QVNNI_ROWS];
                const int32_t *srows[QVNNI_ROWS];
                const float *dsrows[QVNNI_ROWS];
                for (int i = 0; i < QVNNI_ROWS; i++) {
                    const int64_t r = i < mt ? m0 + i : m0;
                    qrows[i] = qx + r * k;
                    drows[i] = dx + r * blocks;
                    srows[i] = sq + r * blocks;
                    dsrows[i] = dsq + r * blocks;
                }
                __m512 values[QVNNI_ROWS];
                vnni_groups(qrows, drows, srows, dsrows, mt, qweight + g * group_bytes,
                            scales_from(scales, g * group_scales, qhalf(format)),
                            mins == NULL ? NULL : scales_from(mins, g * group_scales, qhalf(format)), format,
                            blocks, m0 == 0, values);
                for (int i = 0; i < mt; i++) {
                    float lanes[QGROUP];
                    _mm512_storeu_ps(lanes, values[i]);
                    for (int64_t j = 0; j < valid; j++)
                        store_output(out, bias, dtype, out_dtype, n, m0 + i, g * QGROUP + j, lanes[j]);
                }
            }
        }
        free(qx);
        free(dx);
        free(sq);
        free(dsq);
        free(converted);
        return failed ? -1 : 0;
    }
#endif
#if defined(QUANT_FEW_ROWS)
    failed = quant_linear_few_rows(xf, rows, k, qweight, scales, mins, format, n, bias, dtype, out, out_dtype, threads);
#else
#pragma omp parallel num_threads(threads)
    {
        float *wbuf = malloc((size_t)(QGROUP * k) * sizeof(float));
        if (wbuf == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            if (wbuf == NULL) continue;
            const int64_t n0 = g * QGROUP;
            const int64_t valid_n = n - n0 < QGROUP ? n - n0 : QGROUP;
            for (int64_t j = 0; j < QGROUP; j++) {
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
                        for (int j = 0; j < QTILE_N && t + j < valid_n; j++)
                            store_output(out, bias, dtype, out_dtype, n, m0 + i, n0 + t + j, tile[i][j]);
                }
            }
        }
        free(wbuf);
    }
#endif
    free(converted);
    return failed ? -1 : 0;
}

/* ---- float32 prompt rows by the dequantized weights, panel by panel (AVX-512 or AVX2 + FMA) -------------
 * Prompt rows (more than the fused kernel's 8, outside a decode step) meet the float weights, not int8-rounded
 * x (docs/models.md). Rather than dequantizing a whole matrix into memory and handing it to a GEMM (which
 * copies it once more into its own packed layout), this product dequantizes QPANEL_GROUPS groups of 16
 * output rows, QPANEL_BLOCKS blocks of k at a time, straight into the layout a register tile reads: k-major,
 * the panel's 48 outputs side by side (the interleaved groups give one row's 4 consecutive values per int32
 * lane, so value t of a chunk is a shift and a mask away from a vector of outputs of one input). A tile of
 * QPANEL_TILE_ROWS rows of x by QPANEL_TILE_VECS vectors of the panel keeps its sums in registers: per k,
 * the vectors' loads and a broadcast of x a row. AVX-512: 8 rows by the panel's 3 vectors of 16 (24 sums of
 * 32 registers); AVX2: 6 rows by 2 vectors of 8, the panel's three thirds one after the other (12 sums, 2
 * weight vectors and the broadcast: 15 of 16 registers; with 4 rows by 3 vectors GCC read the weights as
 * memory operands of every multiply-add, and a SmolLM2 layer's four Q4_1 products of 64 rows took 1.6x as
 * long on AMD Zen 3). Each output is one thread's, summed over k in order by fused multiply-adds, with the bias
 * added last: the dequantized float product up to summation order, the same bits for any thread count and
 * on both instruction sets. The code is written once over the few vector operations below. */
#if defined(__AVX512F__)
#define QUANT_PANELS 1
enum { QLANES = 16, QPANEL_TILE_VECS = 3 };
#define QPANEL_TILE_ROWS 8
/* Rows of x per pass over a panel: 256 rows x one chunk of k (128 KB of x) stay in L2 while the chunk's
 * tiles run; a longer prompt dequantizes each panel once per 256 rows. */
#define QPANEL_ROW_BLOCK 256
typedef __m512 qvec;
typedef __m512i qint;
typedef __mmask16 qmask;
static ALWAYS_INLINE qvec qv_zero(void) { return _mm512_setzero_ps(); }
static ALWAYS_INLINE qvec qv_set1(float v) { return _mm512_set1_ps(v); }
static ALWAYS_INLINE qvec qv_load(const float *p) { return _mm512_loadu_ps(p); }
static ALWAYS_INLINE void qv_store(float *p, qvec v) { _mm512_storeu_ps(p, v); }
static ALWAYS_INLINE qvec qv_fmadd(qvec a, qvec b, qvec c) { return _mm512_fmadd_ps(a, b, c); }
static ALWAYS_INLINE qvec qv_add(qvec a, qvec b) { return _mm512_add_ps(a, b); }
static ALWAYS_INLINE qvec qv_mul(qvec a, qvec b) { return _mm512_mul_ps(a, b); }
static ALWAYS_INLINE qvec qv_from_int(qint v) { return _mm512_cvtepi32_ps(v); }
static ALWAYS_INLINE qint qi_load(const uint8_t *p) { return _mm512_loadu_si512((const void *)p); }
static ALWAYS_INLINE qint qi_xor(qint a, qint b) { return _mm512_xor_si512(a, b); }
static ALWAYS_INLINE qint qi_and(qint a, qint b) { return _mm512_and_si512(a, b); }
static ALWAYS_INLINE qint qi_bytes(char v) { return _mm512_set1_epi8(v); }
static ALWAYS_INLINE qint qi_words(int v) { return _mm512_set1_epi32(v); }
#define qi_shl(v, bits) _mm512_slli_epi32(v, bits)
#define qi_shr(v, bits) _mm512_srli_epi32(v, bits)
#define qi_sar(v, bits) _mm512_srai_epi32(v, bits)
/* Elements i..i+15 of a matrix's scales (or offsets) as floats: one load (and vcvtph2ps for float16). */
static ALWAYS_INLINE qvec qv_scales(const void *scales, int64_t i, int half) { return scales16(scales, i, half); }
/* The first `valid` lanes (all from QLANES on, none from 0 down). */
static ALWAYS_INLINE qmask qmask_first(int64_t valid) {
    return valid >= QLANES ? (qmask)0xFFFF : valid <= 0 ? (qmask)0 : (qmask)((1u << valid) - 1);
}
static ALWAYS_INLINE qvec qv_load_masked(qmask m, const float *p) { return _mm512_maskz_loadu_ps(m, p); }
static ALWAYS_INLINE void qv_store_masked(float *p, qmask m, qvec v) { _mm512_mask_storeu_ps(p, m, v); }
#elif defined(QUANT_FEW_ROWS)
#define QUANT_PANELS 1
enum { QLANES = 8, QPANEL_TILE_VECS = 2 };
#define QPANEL_TILE_ROWS 6
/* 64 rows (32 KB of x a chunk): on AMD Zen 3 a decoder layer's four Q4_1 products of 256 rows took 1.12x
 * oneDNN's float32 time against 1.34x with 256 (benchmarks/quantized_matmul.py, one run each). */
#define QPANEL_ROW_BLOCK 64
typedef __m256 qvec;
typedef __m256i qint;
typedef __m256i qmask;
static ALWAYS_INLINE qvec qv_zero(void) { return _mm256_setzero_ps(); }
static ALWAYS_INLINE qvec qv_set1(float v) { return _mm256_set1_ps(v); }
static ALWAYS_INLINE qvec qv_load(const float *p) { return _mm256_loadu_ps(p); }
static ALWAYS_INLINE void qv_store(float *p, qvec v) { _mm256_storeu_ps(p, v); }
static ALWAYS_INLINE qvec qv_fmadd(qvec a, qvec b, qvec c) { return _mm256_fmadd_ps(a, b, c); }
static ALWAYS_INLINE qvec qv_add(qvec a, qvec b) { return _mm256_add_ps(a, b); }
static ALWAYS_INLINE qvec qv_mul(qvec a, qvec b) { return _mm256_mul_ps(a, b); }
static ALWAYS_INLINE qvec qv_from_int(qint v) { return _mm256_cvtepi32_ps(v); }
static ALWAYS_INLINE qint qi_load(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static ALWAYS_INLINE qint qi_xor(qint a, qint b) { return _mm256_xor_si256(a, b); }
static ALWAYS_INLINE qint qi_and(qint a, qint b) { return _mm256_and_si256(a, b); }
static ALWAYS_INLINE qint qi_bytes(char v) { return _mm256_set1_epi8(v); }
static ALWAYS_INLINE qint qi_words(int v) { return _mm256_set1_epi32(v); }
#define qi_shl(v, bits) _mm256_slli_epi32(v, bits)
#define qi_shr(v, bits) _mm256_srli_epi32(v, bits)
#define qi_sar(v, bits) _mm256_srai_epi32(v, bits)
/* Elements i..i+7 of a matrix's scales (or offsets) as floats: one load (and vcvtph2ps for float16). */
static ALWAYS_INLINE qvec qv_scales(const void *scales, int64_t i, int half) {
    return half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)scales + i)))
                : _mm256_loadu_ps((const float *)scales + i);
}
/* The first `valid` lanes (all from QLANES on, none from 0 down). */
static ALWAYS_INLINE qmask qmask_first(int64_t valid) { return avx2_first_lanes(valid); }
static ALWAYS_INLINE qvec qv_load_masked(qmask m, const float *p) { return _mm256_maskload_ps(p, m); }
static ALWAYS_INLINE void qv_store_masked(float *p, qmask m, qvec v) { _mm256_maskstore_ps(p, m, v); }
#endif

#if defined(QUANT_PANELS)
enum {
    QPANEL_GROUPS = 3,
    QPANEL_WIDTH = QPANEL_GROUPS * QGROUP,
    QPANEL_VECS = QPANEL_WIDTH / QLANES,
    QGROUP_VECS = QGROUP / QLANES
};
_Static_assert(QPANEL_VECS % QPANEL_TILE_VECS == 0, "a panel is a whole number of tiles wide");

/* The interleaved layout's values, per int32 lane of a chunk (one row's 4 consecutive bytes): chunk j of a
 * block's lanes lies QGROUP * 4 * j bytes in. s8: byte t is value 4j + t, stored with QS8_OFFSET added;
 * u4: byte t holds value 4j + t in its low nibble and value QBLOCK / 2 + 4j + t in its high one. */
static ALWAYS_INLINE qint qs8_chunk(const uint8_t *block_lanes, int j) {
    return qi_xor(qi_load(block_lanes + QGROUP * 4 * j), qi_bytes((char)QS8_OFFSET));
}
static ALWAYS_INLINE qint qs8_value(qint chunk, int t) { return qi_sar(qi_shl(chunk, 24 - 8 * t), 24); }
static ALWAYS_INLINE qint qu4_chunk(const uint8_t *block_lanes, int j) { return qi_load(block_lanes + QGROUP * 4 * j); }
static ALWAYS_INLINE qint qu4_low(qint chunk, int t) { return qi_and(qi_shr(chunk, 8 * t), qi_words(0x0F)); }
static ALWAYS_INLINE qint qu4_high(qint chunk, int t) { return qi_and(qi_shr(chunk, 8 * t + 4), qi_words(0x0F)); }
/* Blocks of k per dequantized chunk: 128 values x 48 outputs (24 KB, in L1) of the panel; 8 and 16 blocks
 * measured level or up to 5 % slower (benchmarks/quantized_matmul.py, 100 and 1024 rows). */
#define QPANEL_BLOCKS 4

/* Blocks b0..b0 + nb of group g (rows 16g..16g+15) as floats into column gi's 16 outputs of `panel`
 * (k-major, QPANEL_WIDTH floats a row): the values of dequantize_row_as, QLANES rows at a time (a chunk's
 * 64 bytes hold 4 bytes of each of the 16 rows; QLANES rows' are QLANES * 4 of them). */
static ALWAYS_INLINE void dequantize_group_blocks(const uint8_t *qweight, const void *scales, const void *mins,
                                                  int kind, int half, int64_t g, int64_t blocks, int64_t b0,
                                                  int64_t nb, int gi, float *panel) {
    const int64_t group_block = QGROUP * qblock_bytes(kind);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *qb = qweight + (g * blocks + b0 + b) * group_block;
        const int64_t si = (g * blocks + b0 + b) * QGROUP;
#pragma GCC unroll 2
        for (int h = 0; h < QGROUP_VECS; h++) {
            const qvec dv = qv_scales(scales, si + h * QLANES, half);
            float *o = panel + b * QBLOCK * QPANEL_WIDTH + gi * QGROUP + h * QLANES;
            const uint8_t *qh = qb + h * QLANES * 4;
            if (kind == QFORMAT_S8) {
#pragma GCC unroll 8
                for (int j = 0; j < QBLOCK / 4; j++) {
                    const qint raw = qs8_chunk(qh, j);
#pragma GCC unroll 4
                    for (int t = 0; t < 4; t++)
                        qv_store(o + (4 * j + t) * QPANEL_WIDTH, qv_mul(dv, qv_from_int(qs8_value(raw, t))));
                }
            } else {
                const qvec mv = qv_scales(mins, si + h * QLANES, half);
#pragma GCC unroll 4
                for (int j = 0; j < QBLOCK / 8; j++) {
                    const qint raw = qu4_chunk(qh, j);
#pragma GCC unroll 4
                    for (int t = 0; t < 4; t++) {
                        const qvec lo = qv_from_int(qu4_low(raw, t)), hi = qv_from_int(qu4_high(raw, t));
                        qv_store(o + (4 * j + t) * QPANEL_WIDTH, qv_add(qv_mul(dv, lo), mv));
                        qv_store(o + (QBLOCK / 2 + 4 * j + t) * QPANEL_WIDTH, qv_add(qv_mul(dv, hi), mv));
                    }
                }
            }
        }
    }
}

/* The panel of groups 3p..3p+2 (zeros past the matrix's last group), blocks b0..b0 + nb. */
static void dequantize_panel(const uint8_t *qweight, const void *scales, const void *mins, int format,
                             int64_t panel_index, int64_t groups, int64_t blocks, int64_t b0, int64_t nb,
                             float *panel) {
    for (int gi = 0; gi < QPANEL_GROUPS; gi++) {
        const int64_t g = panel_index * QPANEL_GROUPS + gi;
        if (g >= groups) {
            for (int64_t v = 0; v < nb * QBLOCK; v++)
                for (int h = 0; h < QGROUP_VECS; h++) qv_store(panel + v * QPANEL_WIDTH + gi * QGROUP + h * QLANES, qv_zero());
            continue;
        }
#define DEQUANTIZE_GROUP_AS(KIND, HALF) \
    dequantize_group_blocks(qweight, scales, mins, KIND, HALF, g, blocks, b0, nb, gi, panel)
        if (qkind(format) == QFORMAT_S8) {
            if (qhalf(format)) DEQUANTIZE_GROUP_AS(QFORMAT_S8, 1);
            else DEQUANTIZE_GROUP_AS(QFORMAT_S8, 0);
        } else {
            if (qhalf(format)) DEQUANTIZE_GROUP_AS(QFORMAT_U4, 1);
            else DEQUANTIZE_GROUP_AS(QFORMAT_U4, 0);
        }
#undef DEQUANTIZE_GROUP_AS
    }
}

/* out rows 0..mt (stride n; the tile's QPANEL_TILE_VECS vectors of outputs, lanes under `mask`) += x rows
 * (stride k) . the panel's columns from `panel` on (rows QPANEL_WIDTH apart) over `kc` values (from zero
 * where `first`; + bias where `bias` is not NULL: after the last chunk). Where `whole` (every lane under the
 * mask, the tiles of all but a matrix's last panel), the sums load and store without the mask: AVX2's masked
 * store (vmaskmovps) is microcoded on AMD Zen 3, and without it a SmolLM2 layer's four Q4_1 products of 64,
 * 256 and 1024 rows took 8-12 % less time there. */
static ALWAYS_INLINE void panel_tile(const float *x, int64_t k, int mt, const float *panel, int64_t kc, float *out,
                                     int64_t n, const qmask mask[QPANEL_TILE_VECS], int whole, int first,
                                     const float *bias) {
    qvec acc[QPANEL_TILE_ROWS][QPANEL_TILE_VECS];
#pragma GCC unroll 8
    for (int i = 0; i < mt; i++)
#pragma GCC unroll 3
        for (int j = 0; j < QPANEL_TILE_VECS; j++)
            acc[i][j] = first ? qv_zero()
                        : whole ? qv_load(out + i * n + j * QLANES)
                                : qv_load_masked(mask[j], out + i * n + j * QLANES);
    for (int64_t p = 0; p < kc; p++) {
        const float *w = panel + p * QPANEL_WIDTH;
        qvec wv[QPANEL_TILE_VECS];
#pragma GCC unroll 3
        for (int j = 0; j < QPANEL_TILE_VECS; j++) wv[j] = qv_load(w + j * QLANES);
#pragma GCC unroll 8
        for (int i = 0; i < mt; i++) {
            const qvec xv = qv_set1(x[i * k + p]);
#pragma GCC unroll 3
            for (int j = 0; j < QPANEL_TILE_VECS; j++) acc[i][j] = qv_fmadd(xv, wv[j], acc[i][j]);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < mt; i++)
#pragma GCC unroll 3
        for (int j = 0; j < QPANEL_TILE_VECS; j++) {
            qvec v = acc[i][j];
            if (bias != NULL)
                v = qv_add(v, whole ? qv_load(bias + j * QLANES) : qv_load_masked(mask[j], bias + j * QLANES));
            if (whole) qv_store(out + i * n + j * QLANES, v);
            else qv_store_masked(out + i * n + j * QLANES, mask[j], v);
        }
}

/* panel_tile for the first `mt` of QPANEL_TILE_ROWS rows, each count a separate inlined copy. */
static void panel_tile_rows(const float *x, int64_t k, int mt, const float *panel, int64_t kc, float *out, int64_t n,
                            const qmask mask[QPANEL_TILE_VECS], int whole, int first, const float *bias) {
    switch (mt) {
    case 1: panel_tile(x, k, 1, panel, kc, out, n, mask, whole, first, bias); break;
    case 2: panel_tile(x, k, 2, panel, kc, out, n, mask, whole, first, bias); break;
    case 3: panel_tile(x, k, 3, panel, kc, out, n, mask, whole, first, bias); break;
    case 4: panel_tile(x, k, 4, panel, kc, out, n, mask, whole, first, bias); break;
    case 5: panel_tile(x, k, 5, panel, kc, out, n, mask, whole, first, bias); break;
#if QPANEL_TILE_ROWS == 8
    case 6: panel_tile(x, k, 6, panel, kc, out, n, mask, whole, first, bias); break;
    case 7: panel_tile(x, k, 7, panel, kc, out, n, mask, whole, first, bias); break;
#endif
    default: panel_tile(x, k, QPANEL_TILE_ROWS, panel, kc, out, n, mask, whole, first, bias); break;
    }
}

/* Rows r0..r1 of out (their outputs c0..c0 + QPANEL_WIDTH, those before n) += x's rows . the panel over `kc`
 * values, tile by tile. */
static void panel_rows(const float *x, int64_t k, int64_t r0, int64_t r1, const float *panel, int64_t kc, float *out,
                       int64_t n, int64_t c0, int first, const float *bias) {
    for (int v0 = 0; v0 < QPANEL_VECS; v0 += QPANEL_TILE_VECS) {
        qmask mask[QPANEL_TILE_VECS];
        for (int j = 0; j < QPANEL_TILE_VECS; j++) mask[j] = qmask_first(n - c0 - (v0 + j) * QLANES);
        const int whole = n - c0 >= (v0 + QPANEL_TILE_VECS) * QLANES;
        for (int64_t m0 = r0; m0 < r1; m0 += QPANEL_TILE_ROWS) {
            const int mt = r1 - m0 < QPANEL_TILE_ROWS ? (int)(r1 - m0) : QPANEL_TILE_ROWS;
            panel_tile_rows(x + m0 * k, k, mt, panel + v0 * QLANES, kc, out + m0 * n + c0 + v0 * QLANES, n, mask,
                            whole, first, bias != NULL ? bias + c0 + v0 * QLANES : NULL);
        }
    }
}
#endif

#if defined(QUANT_FEW_ROWS)
/* ---- AVX2: a few rows of float x by the weights as they lie --------------------------------------------
 * A group's 16 rows are read as two halves of 8 straight from the interleaved layout: a chunk's 32 bytes of
 * a half hold 4 bytes of each of its 8 rows, so value t of the chunk is a shift and a mask (u4) or two
 * shifts (s8) away from an 8-output vector of one input, multiplied into x's value broadcast. Each block's
 * sums of x * q are scaled once: d * sum(x q), + m * sum(x) for u4 (the VNNI path's arithmetic, in float).
 * The weights are never written out as floats: before, each row was dequantized element by element into a
 * buffer and then multiplied (on AMD Zen 3 SmolLM2's batch-1 steps took 43 ms; docs/models.md). Each output
 * is one thread's, its blocks summed in order: the same bits for any thread count. */
enum { QFEW_TILE_ROWS = 4 };

/* sums[i] (the half's 8 outputs) = x row i (stride k) . the half's rows, for `mt` rows; `xsum` [rows of the
 * tile][blocks] the rows' block sums (u4); qg, sg, mg: the group's first block, scales and offsets. */
static ALWAYS_INLINE void few_rows_tile(const float *x, int64_t k, int mt, const float *xsum, const uint8_t *qg,
                                        const void *sg, const void *mg, int kind, int half, int64_t blocks, int h,
                                        qvec sums[QFEW_TILE_ROWS]) {
    const int64_t group_block = QGROUP * qblock_bytes(kind);
    qvec acc[QFEW_TILE_ROWS];
#pragma GCC unroll 4
    for (int i = 0; i < mt; i++) acc[i] = qv_zero();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *qb = qg + b * group_block + h * QLANES * 4;
        const float *xb = x + b * QBLOCK;
        qvec s[QFEW_TILE_ROWS];
#pragma GCC unroll 4
        for (int i = 0; i < mt; i++) s[i] = qv_zero();
        if (kind == QFORMAT_S8) {
#pragma GCC unroll 8
            for (int j = 0; j < QBLOCK / 4; j++) {
                const qint raw = qs8_chunk(qb, j);
#pragma GCC unroll 4
                for (int t = 0; t < 4; t++) {
                    const qvec q = qv_from_int(qs8_value(raw, t));
#pragma GCC unroll 4
                    for (int i = 0; i < mt; i++) s[i] = qv_fmadd(qv_set1(xb[i * k + 4 * j + t]), q, s[i]);
                }
            }
        } else {
#pragma GCC unroll 4
            for (int j = 0; j < QBLOCK / 8; j++) {
                const qint raw = qu4_chunk(qb, j);
#pragma GCC unroll 4
                for (int t = 0; t < 4; t++) {
                    const qvec lo = qv_from_int(qu4_low(raw, t)), hi = qv_from_int(qu4_high(raw, t));
#pragma GCC unroll 4
                    for (int i = 0; i < mt; i++) {
                        s[i] = qv_fmadd(qv_set1(xb[i * k + 4 * j + t]), lo, s[i]);
                        s[i] = qv_fmadd(qv_set1(xb[i * k + QBLOCK / 2 + 4 * j + t]), hi, s[i]);
                    }
                }
            }
        }
        const qvec dv = qv_scales(sg, b * QGROUP + h * QLANES, half);
        if (kind == QFORMAT_S8) {
#pragma GCC unroll 4
            for (int i = 0; i < mt; i++) acc[i] = qv_fmadd(dv, s[i], acc[i]);
        } else {
            const qvec mv = qv_scales(mg, b * QGROUP + h * QLANES, half);
#pragma GCC unroll 4
            for (int i = 0; i < mt; i++)
                acc[i] = qv_fmadd(dv, s[i], qv_fmadd(mv, qv_set1(xsum[i * blocks + b]), acc[i]));
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < mt; i++) sums[i] = acc[i];
}

/* few_rows_tile for a format argument and 1..QFEW_TILE_ROWS rows: one inlined copy per layout, scale type
 * and row count. */
static void few_rows_tile_as(const float *x, int64_t k, int mt, const float *xsum, const uint8_t *qg, const void *sg,
                             const void *mg, int format, int64_t blocks, int h, qvec sums[QFEW_TILE_ROWS]) {
#define FEW_ROWS_AS(KIND, HALF)                                                                  \
    switch (mt) {                                                                                \
    case 1: few_rows_tile(x, k, 1, xsum, qg, sg, mg, KIND, HALF, blocks, h, sums); break;        \
    case 2: few_rows_tile(x, k, 2, xsum, qg, sg, mg, KIND, HALF, blocks, h, sums); break;        \
    case 3: few_rows_tile(x, k, 3, xsum, qg, sg, mg, KIND, HALF, blocks, h, sums); break;        \
    default: few_rows_tile(x, k, QFEW_TILE_ROWS, xsum, qg, sg, mg, KIND, HALF, blocks, h, sums); \
    }
    if (qkind(format) == QFORMAT_S8) {
        if (qhalf(format)) FEW_ROWS_AS(QFORMAT_S8, 1) else FEW_ROWS_AS(QFORMAT_S8, 0)
    } else {
        if (qhalf(format)) FEW_ROWS_AS(QFORMAT_U4, 1) else FEW_ROWS_AS(QFORMAT_U4, 0)
    }
#undef FEW_ROWS_AS
}

/* quant_linear's product on these builds (x float32, converted from bfloat16 by the caller): returns 0, or
 * 1 when out of memory. */
static int quant_linear_few_rows(const float *x, int64_t rows, int64_t k, const uint8_t *qweight, const void *scales,
                                 const void *mins, int format, int64_t n, const void *bias, int dtype, void *out,
                                 int out_dtype, int threads) {
    const int64_t groups = (n + QGROUP - 1) / QGROUP, blocks = k / QBLOCK;
    const int64_t group_bytes = blocks * QGROUP * qblock_bytes(format), group_scales = blocks * QGROUP;
    float *xsum = malloc((size_t)(rows * blocks) * sizeof(float));
    if (xsum == NULL) return 1;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < blocks; b++) {
            float sum = 0.0f;
            for (int c = 0; c < QBLOCK; c++) sum += x[r * k + b * QBLOCK + c];
            xsum[r * blocks + b] = sum;
        }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t valid = n - g * QGROUP < QGROUP ? n - g * QGROUP : QGROUP;
        const uint8_t *qg = qweight + g * group_bytes;
        const void *sg = scales_from(scales, g * group_scales, qhalf(format));
        const void *mg = mins == NULL ? NULL : scales_from(mins, g * group_scales, qhalf(format));
        for (int64_t m0 = 0; m0 < rows; m0 += QFEW_TILE_ROWS) {
            const int mt = rows - m0 < QFEW_TILE_ROWS ? (int)(rows - m0) : QFEW_TILE_ROWS;
            for (int h = 0; h < QGROUP_VECS; h++) {
                qvec sums[QFEW_TILE_ROWS];
                few_rows_tile_as(x + m0 * k, k, mt, xsum + m0 * blocks, qg, sg, mg, format, blocks, h, sums);
                for (int i = 0; i < mt; i++) {
                    float lanes[QLANES];
                    qv_store(lanes, sums[i]);
                    for (int64_t j = 0; j < QLANES && h * QLANES + j < valid; j++)
                        store_output(out, bias, dtype, out_dtype, n, m0 + i, g * QGROUP + h * QLANES + j, lanes[j]);
                }
            }
        }
    }
    free(xsum);
    return 0;
}
#endif

/* Whether this build has quant_linear_float (AVX-512, or AVX2 + FMA + F16C): 1, else 0 (prompt rows dequantize
 * whole chunks). */
int quant_linear_float_built(void) {
#if defined(QUANT_PANELS)
    return 1;
#else
    return 0;
#endif
}

/* out [rows, n] (float32) = x [rows, k] (float32) W^T (+ bias [n], float32, or NULL) for W [n, k] in `format`,
 * interleaved, dequantized panel by panel (above); k a multiple of 32. Returns 0, -1 when out of memory, -2
 * where the build has no panel product (quant_linear_float_built). */
int quant_linear_float(const float *x, int64_t rows, int64_t k, const uint8_t *qweight, const void *scales,
                       const void *mins, int format, int64_t n, const float *bias, float *out, int num_threads) {
#if defined(QUANT_PANELS)
    const int64_t groups = (n + QGROUP - 1) / QGROUP, blocks = k / QBLOCK;
    const int64_t panels = (groups + QPANEL_GROUPS - 1) / QPANEL_GROUPS;
    const int64_t row_blocks = (rows + QPANEL_ROW_BLOCK - 1) / QPANEL_ROW_BLOCK;
    const int64_t items = panels * row_blocks;
    const int threads = threads_for_work(rows * n * k, QWORK_PER_THREAD, num_threads, items);
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *panel = aligned_alloc(64, (size_t)(QPANEL_BLOCKS * QBLOCK * QPANEL_WIDTH) * sizeof(float));
        if (panel == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t item = 0; item < items; item++) {
            if (panel == NULL) continue;
            const int64_t rb = item / panels, p = item % panels;
            const int64_t r0 = rb * QPANEL_ROW_BLOCK;
            const int64_t r1 = r0 + QPANEL_ROW_BLOCK < rows ? r0 + QPANEL_ROW_BLOCK : rows;
            const int64_t c0 = p * QPANEL_WIDTH;
            for (int64_t b0 = 0; b0 < blocks; b0 += QPANEL_BLOCKS) {
                const int64_t nb = blocks - b0 < QPANEL_BLOCKS ? blocks - b0 : QPANEL_BLOCKS;
                dequantize_panel(qweight, scales, mins, format, p, groups, blocks, b0, nb, panel);
                const int last = b0 + nb == blocks;
                panel_rows(x + b0 * QBLOCK, k, r0, r1, panel, nb * QBLOCK, out, n, c0, b0 == 0,
                           last ? bias : NULL);
            }
        }
        free(panel);
    }
    return failed ? -1 : 0;
#else
    (void)x, (void)rows, (void)k, (void)qweight, (void)scales, (void)mins, (void)format, (void)n, (void)bias;
    (void)out, (void)num_threads;
    return -2;
#endif
}

/* Values per OpenMP thread of quant_rows: a prompt step's whole matrix (SmolLM2's gate/up, 1.8 M values)
 * is dequantized on two threads, an embedding lookup of a few hundred tokens on one. */
#define QDEQUANTIZE_PER_THREAD ((int64_t)1 << 18)

/* out [count, k] = rows ids[0..count) of W [_, k] (interleaved) dequantized (an embedding lookup, or a whole
 * matrix for a float product), in `dtype`, on up to num_threads threads. Returns 0, or -1 when out of
 * memory. */
int quant_rows(const uint8_t *qweight, const void *scales, const void *mins, int format, int64_t k,
               const int64_t *ids, int64_t count, int dtype, void *out, int num_threads) {
    const int threads = threads_for_work(count * k, QDEQUANTIZE_PER_THREAD, num_threads, count);
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *row = malloc((size_t)k * sizeof(float));
        if (row == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < count; r++) {
            if (row == NULL) continue;
            float *dst = dtype == QDTYPE_FLOAT32 ? (float *)out + r * k : row;
            dequantize_row(qweight, scales, mins, format, ids[r], k, dst);
            if (dtype == QDTYPE_BFLOAT16) {
                uint16_t *o = (uint16_t *)out + r * k;
                int64_t p = 0;
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
                for (; p + 16 <= k; p += 16)
                    _mm256_storeu_si256((__m256i *)(o + p), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(row + p)));
#endif
                for (; p < k; p++) o[p] = float_to_bf16(row[p]);
            }
        }
        free(row);
    }
    return failed ? -1 : 0;
}
