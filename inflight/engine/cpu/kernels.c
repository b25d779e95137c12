/* Small C kernels for CPU inference: paged decode attention that reads K/V blocks where they lie, the
 * model's elementwise steps fused into one pass each (add + RMSNorm, SiLU * up, rotary embedding), and the
 * greedy choice (each row's argmax).
 *
 * Compiled at first use by kernels.py (cc -O3 -march=native -fopenmp -fno-trapping-math -fno-math-errno:
 * without the last two gcc keeps float selects and sqrtf out of vector loops) and called through ctypes.
 * Element type: float32 (dtype 0) or bfloat16 (dtype 1); arithmetic is float32 either way. The attention
 * kernels also read a KV cache of float8 e4m3 (kv_dtype 2, `--kv-cache-dtype fp8`), widened to float as
 * it is read (exact; see fp8_to_float).
 * Parallel loops use `num_threads` OpenMP threads (the OpenMP runtime torch already loaded).
 * -march=native decides the instruction set when the library is built on the machine that runs it:
 * bfloat16 rows are converted 16 at a time with AVX-512, rounded by the AVX512-BF16 instruction where the
 * CPU has it; every path has a plain C version that the others must match.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "float_bits.h"
#include "kernels.h"
#include "simd_common.h"
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

enum { DTYPE_FLOAT32 = 0, DTYPE_BFLOAT16 = 1, DTYPE_FP8_E4M3 = 2 };

/* Work is split over threads only where there is enough to pay for waking them: from 16384 elements (a
 * decode step's RMSNorm of 64 rows of 576 took 8.8 us on one thread, 5.8 on two), or query-key products
 * in paged_decode (one row over 59 keys, SmolLM2's 30 layers: 0.25 ms on two threads against 0.29 on one;
 * docs/benchmarks.md). */
static inline int threads_for(int64_t elements, int num_threads) { return elements >= 16384 ? num_threads : 1; }

/* ---- bfloat16 rows <-> float rows ---------------------------------------------------------------- */

#if defined(__AVX512F__)
/* 16 bfloat16 values as floats: exact (the bits shifted into the high half). */
static ALWAYS_INLINE __m512 bf16x16_to_float(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static ALWAYS_INLINE __m512 bf16x16_load(const uint16_t *src) {
    return bf16x16_to_float(_mm256_loadu_si256((const __m256i *)src));
}

/* 16 floats to bfloat16, round to nearest even like float_to_bf16. AVX512-BF16 does it in one instruction
 * (which also treats float32 denormals, below 1.2e-38, as zero: a difference far below bfloat16's
 * precision); plain AVX-512 does float_to_bf16's integer arithmetic 16 lanes at a time. */
static ALWAYS_INLINE __m256i float_to_bf16x16(__m512 f) {
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
    return (__m256i)_mm512_cvtneps_pbh(f);
#else
    const __m512i bits = _mm512_castps_si512(f);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
    rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q),
                                    _mm512_or_si512(bits, _mm512_set1_epi32(0x400000)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
#endif
}

static ALWAYS_INLINE void bf16x16_store(uint16_t *dst, __m512 f) {
    _mm256_storeu_si256((__m256i *)dst, float_to_bf16x16(f));
}

/* f rounded to bfloat16 and back: where torch keeps an intermediate in bfloat16. */
static ALWAYS_INLINE __m512 round_bf16x16(__m512 f) { return bf16x16_to_float(float_to_bf16x16(f)); }
#endif

static inline void bf16_to_float_n(const uint16_t *src, float *dst, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, bf16x16_load(src + i));
#endif
    for (; i < n; i++) dst[i] = bf16_to_float(src[i]);
}

static inline void float_to_bf16_n(const float *src, uint16_t *dst, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) bf16x16_store(dst + i, _mm512_loadu_ps(src + i));
#endif
    for (; i < n; i++) dst[i] = float_to_bf16(src[i]);
}

/* x rounded to bfloat16 and back, in place: where torch keeps an intermediate in bfloat16. */
static inline void round_to_bf16_n(float *x, uint16_t *tmp, int64_t n) {
    float_to_bf16_n(x, tmp, n);
    bf16_to_float_n(tmp, x, n);
}

/* ---- float8 e4m3 -> float ---------------------------------------------------------------------------
 * e4m3 (sign, 4 exponent bits biased by 7, 3 mantissa bits; no infinities) as float, exactly. The KV
 * cache never holds NaN (0x7f / 0xff): writers saturate to +-448 (attention/kv_store.py), so these read
 * those bits as +-480 like every other code. No CPU has an e4m3 instruction: the plain C version builds
 * the float's bits (subnormals, exponent 0, are m * 2^-9); the AVX-512 one moves the 7 magnitude bits
 * into a float16's exponent and mantissa (the same number times 2^-8, subnormals included), widens it with
 * the F16C conversion, which AVX-512 has, and multiplies by 2^8 (exact: a power of two, result normal). */
static inline float fp8_to_float(uint8_t x) {
    const uint32_t exponent = (x >> 3) & 15u, mantissa = x & 7u;
    float f;
    if (exponent != 0) {
        const uint32_t bits = ((exponent + 120u) << 23) | (mantissa << 20);
        memcpy(&f, &bits, sizeof f);
    } else {
        f = (float)mantissa * 0x1p-9f;
    }
    return x & 0x80u ? -f : f;
}

#if defined(__AVX512F__)
static ALWAYS_INLINE __m512 fp8x16_load(const uint8_t *src) {
    const __m256i h = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)src));
    const __m256i magnitude = _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x7f)), 7);
    const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x80)), 8);
    return _mm512_mul_ps(_mm512_cvtph_ps(_mm256_or_si256(magnitude, sign)), _mm512_set1_ps(256.0f));
}
#endif

static inline void fp8_to_float_n(const uint8_t *src, float *dst, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, fp8x16_load(src + i));
#endif
    for (; i < n; i++) dst[i] = fp8_to_float(src[i]);
}

/* The elementwise kernels take bfloat16 rows TILE elements at a time through float buffers on the stack. */
enum { TILE = 256 };

/* ---- exp that vectorizes ------------------------------------------------------------------------ */

/* e^x in plain C that gcc vectorizes (no libm call, no branch but a clamp): x = n ln2 + r with
 * |r| <= ln2 / 2, e^r from the Cephes polynomial, 2^n put straight into the exponent bits. Relative error
 * below 2e-7 against expf over [-87.3, 88]. x is clamped to [-88, 88]: below, the result is exactly 0
 * (expf gives less than 1.2e-38); above, e^88. NaN stays NaN. */
static inline float exp_approx(float x) {
    const float xc = x < -88.0f ? -88.0f : (x > 88.0f ? 88.0f : x);
    const float t = xc * 1.44269504088896341f + 12582912.0f;   /* 1.5 * 2^23: the sum rounds to an integer */
    const float n = t - 12582912.0f;
    float r = xc - n * 0.693359375f;                           /* Cody-Waite: n * 0.693359375 is exact */
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    uint32_t bits;
    memcpy(&bits, &t, sizeof bits);
    bits = (bits + 127u) << 23; /* t's low bits hold n (offset by 0x4B400000, which the shift drops) */
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

#if defined(__AVX512F__)
/* e^r for |r| <= ln2 / 2 on 16 lanes: exp_approx's polynomial, in fused multiply-adds. */
static ALWAYS_INLINE __m512 exp_poly16(__m512 r) {
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    return p;
}

/* exp_approx on 16 lanes, step for step (the polynomial in fused multiply-adds; NaN stays NaN: max/min
 * return their second operand when either is NaN). */
static ALWAYS_INLINE __m512 exp_approx16(__m512 x) {
    const __m512 xc = _mm512_min_ps(_mm512_set1_ps(88.0f), _mm512_max_ps(_mm512_set1_ps(-88.0f), x));
    const __m512 t = _mm512_add_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)), _mm512_set1_ps(12582912.0f));
    const __m512 n = _mm512_sub_ps(t, _mm512_set1_ps(12582912.0f));
    __m512 r = _mm512_sub_ps(xc, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f)));
    r = _mm512_sub_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(-2.12194440e-4f)));
    const __m512 p = exp_poly16(r);
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_castps_si512(t), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

/* Lanes j .. j + 15 that lie in [lo, hi). */
static ALWAYS_INLINE __mmask16 lanes_between(int64_t j, int64_t lo, int64_t hi) {
    const uint32_t from = lo <= j ? 0 : (lo - j >= 16 ? 16 : (uint32_t)(lo - j));
    const uint32_t to = hi >= j + 16 ? 16 : (hi <= j ? 0 : (uint32_t)(hi - j));
    return from >= to ? 0 : (__mmask16)(((1u << to) - 1) & ~((1u << from) - 1));
}

/* e^x on 16 lanes for x <= 0 (the prompt softmax's scores minus their peak): exp_approx16's reduction and
 * polynomial without its clamps, the reduction in fused multiply-adds, and 2^n applied by vscalefps (which
 * underflows gradually to 0) instead of built in the exponent bits: 11 instructions instead of 19 (float32
 * prompt attention 1.02-1.03x). */
static ALWAYS_INLINE __m512 exp_scalef16(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    return _mm512_scalef_ps(exp_poly16(r), n);
}

/* A vector's softmax weights over a block of keys, in place of its scores s: e^(s[j] - peak) for j in
 * [lo, hi), else 0, over [0, span) (a multiple of 16; scores outside [lo, hi) are never read as numbers);
 * returns their sum. */
static ALWAYS_INLINE float row_weights16(float *s, int64_t lo, int64_t hi, int64_t span, float peak) {
    const __m512 b = _mm512_set1_ps(peak);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < span; j += 16) {
        const __mmask16 keep = lanes_between(j, lo, hi);
        const __m512 p = keep ? _mm512_maskz_mov_ps(keep, exp_scalef16(_mm512_sub_ps(_mm512_loadu_ps(s + j), b)))
                              : _mm512_setzero_ps();
        sum = _mm512_add_ps(sum, p);
        _mm512_storeu_ps(s + j, p);
    }
    return _mm512_reduce_add_ps(sum);
}
#endif

/* `n` elements at `offset` as floats, copied into dst. */
static inline void load_as_float(const void *base, int64_t offset, int64_t n, int dtype, float *dst) {
    if (dtype == DTYPE_FLOAT32)
        memcpy(dst, (const float *)base + offset, sizeof(float) * (size_t)n);
    else if (dtype == DTYPE_FP8_E4M3)
        fp8_to_float_n((const uint8_t *)base + offset, dst, n);
    else
        bf16_to_float_n((const uint16_t *)base + offset, dst, n);
}

/* `n` elements at `offset` as floats: the memory itself for float32, converted into `tmp` otherwise. */
static inline const float *row_as_float(const void *base, int64_t offset, int64_t n, int dtype, float *tmp) {
    if (dtype == DTYPE_FLOAT32) return (const float *)base + offset;
    load_as_float(base, offset, n, dtype, tmp);
    return tmp;
}

static inline void store_row(void *base, int64_t offset, const float *src, int64_t n, int dtype) {
    if (dtype == DTYPE_FLOAT32) {
        float *dst = (float *)base + offset;
        for (int64_t d = 0; d < n; d++) dst[d] = src[d];
    } else {
        float_to_bf16_n(src, (uint16_t *)base + offset, n);
    }
}

/* ---- paged decode attention ---------------------------------------------------------------------
 * Layout contract: attention/metadata.py. q is [T, num_heads, head_dim] rows `q_row_stride` elements
 * apart (a view into the fused q|k|v projection), out is [T, num_heads, head_dim]; k_cache and v_cache are
 * [num_blocks, block_size, num_kv_heads, head_dim]; block_tables is [num_seqs, stride].
 * A work item is one sequence's KV heads (all, or one): its query heads score every key (one pass over
 * K), take an exact softmax, then sum the values (one pass over V). */

/* Keys and values are visited a chunk at a time: at most CHUNK consecutive tokens of one block, every KV
 * head of the item before the next chunk. A chunk's rows are contiguous across heads, so a small chunk
 * keeps the reads close to address order, which memory streams fastest (measured on Zen1: 4 beat 2, 8
 * and 16 by 25-40% at 20 MB of K/V; it also bounds the bfloat16 conversion buffer). */
enum { CHUNK = 4 };

/* Blocks lie at random addresses, so the hardware prefetcher cannot run ahead across them; the kernel
 * prefetches rows PREFETCH_BYTES ahead of the one it reads, in the order it reads them (K rows, then V
 * rows). 8 KiB: 4-32 KiB measured within 5-10 %. */
enum { PREFETCH_BYTES = 8192 };

/* A decode row attending more keys than this is split into parts of this many keys (from the first it
 * attends), each a work item of its own, merged at the end; by the row's own length only, never by what
 * else shares the call, so a row's outputs are the same bits whatever shares the step. */
enum { DECODE_PART_KEYS = 1024 };

/* Into L2 (prefetcht1), as the dense and quantized products prefetch their weights. The non-temporal hint
 * (prefetchnta, used before 5 December) left a 30-layer float32 decode step's K/V at 15 GB/s on an AMD
 * EPYC (Zen 4): this hint reads them at 25 GB/s (bfloat16 15 -> 18 GB/s; docs/benchmarks.md). */
static ALWAYS_INLINE void prefetch_line(const char *p) {
#if defined(__GNUC__) || defined(__clang__)
    __builtin_prefetch(p, 0, 2);
#else
    (void)p;
#endif
}

#if defined(__AVX2__) && defined(__FMA__)
/* x86 with AVX2 + FMA: the micro-kernels below in intrinsics, since gcc's own vectorization of them
 * spills or falls back to scalar code. The plain C versions after the #else are the reference. */

/* Sums of the 8 lanes of each of a, b, c, d. */
static inline __m128 sum4_lanes(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

/* Scores of `count` key rows (row j at rows + j * stride) against two query heads at once, so each key
 * row is loaded once for both: 4 tokens x 2 heads = 8 running sums in registers. Past `count` the
 * last real row is repeated (computed and discarded). */
static inline void score_rows2(const float *q0, const float *q1, const float *rows, int64_t stride,
                               int64_t count, int64_t head_dim, float *out0, float *out1) {
    const int64_t dv = head_dim & ~(int64_t)7;
    for (int64_t j = 0; j < count; j += 4) {
        const float *k[4];
        for (int64_t i = 0; i < 4; i++) k[i] = rows + (j + i < count ? j + i : j) * stride;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
        for (int64_t d = 0; d < dv; d += 8) {
            const __m256 x = _mm256_loadu_ps(q0 + d), y = _mm256_loadu_ps(q1 + d);
            const __m256 k0 = _mm256_loadu_ps(k[0] + d), k1 = _mm256_loadu_ps(k[1] + d);
            const __m256 k2 = _mm256_loadu_ps(k[2] + d), k3 = _mm256_loadu_ps(k[3] + d);
            a0 = _mm256_fmadd_ps(x, k0, a0);
            a1 = _mm256_fmadd_ps(x, k1, a1);
            a2 = _mm256_fmadd_ps(x, k2, a2);
            a3 = _mm256_fmadd_ps(x, k3, a3);
            b0 = _mm256_fmadd_ps(y, k0, b0);
            b1 = _mm256_fmadd_ps(y, k1, b1);
            b2 = _mm256_fmadd_ps(y, k2, b2);
            b3 = _mm256_fmadd_ps(y, k3, b3);
        }
        float a[4], b[4];
        _mm_storeu_ps(a, sum4_lanes(a0, a1, a2, a3));
        _mm_storeu_ps(b, sum4_lanes(b0, b1, b2, b3));
        for (int64_t d = dv; d < head_dim; d++)
            for (int64_t i = 0; i < 4; i++) {
                a[i] += q0[d] * k[i][d];
                b[i] += q1[d] * k[i][d];
            }
        for (int64_t i = 0; i < 4 && j + i < count; i++) {
            out0[j + i] = a[i];
            out1[j + i] = b[i];
        }
    }
}

/* The same for one query head: 8 tokens at a time. */
static inline void score_rows1(const float *q0, const float *rows, int64_t stride, int64_t count,
                               int64_t head_dim, float *out0) {
    const int64_t dv = head_dim & ~(int64_t)7;
    for (int64_t j = 0; j < count; j += 8) {
        const float *k[8];
        for (int64_t i = 0; i < 8; i++) k[i] = rows + (j + i < count ? j + i : j) * stride;
        __m256 s[8];
        for (int i = 0; i < 8; i++) s[i] = _mm256_setzero_ps();
        for (int64_t d = 0; d < dv; d += 8) {
            const __m256 x = _mm256_loadu_ps(q0 + d);
            for (int i = 0; i < 8; i++) s[i] = _mm256_fmadd_ps(x, _mm256_loadu_ps(k[i] + d), s[i]);
        }
        float a[8];
        _mm_storeu_ps(a, sum4_lanes(s[0], s[1], s[2], s[3]));
        _mm_storeu_ps(a + 4, sum4_lanes(s[4], s[5], s[6], s[7]));
        for (int64_t d = dv; d < head_dim; d++)
            for (int64_t i = 0; i < 8; i++) a[i] += q0[d] * k[i][d];
        for (int64_t i = 0; i < 8 && j + i < count; i++) out0[j + i] = a[i];
    }
}

/* acc0 += sum_j p0[j] * row j (and acc1 with p1 when two heads share the rows, p1 != NULL). A 32-wide
 * strip of the accumulators stays in registers over all `count` rows: each row element is loaded once
 * for both heads, and the accumulators are read and written once per call. */
static inline void weigh_rows(const float *p0, const float *p1, const float *rows, int64_t stride,
                              int64_t count, int64_t head_dim, float *acc0, float *acc1) {
    int64_t d0 = 0;
    if (p1 != NULL) {
        for (; d0 + 32 <= head_dim; d0 += 32) {
            __m256 a0 = _mm256_loadu_ps(acc0 + d0), a1 = _mm256_loadu_ps(acc0 + d0 + 8);
            __m256 a2 = _mm256_loadu_ps(acc0 + d0 + 16), a3 = _mm256_loadu_ps(acc0 + d0 + 24);
            __m256 b0 = _mm256_loadu_ps(acc1 + d0), b1 = _mm256_loadu_ps(acc1 + d0 + 8);
            __m256 b2 = _mm256_loadu_ps(acc1 + d0 + 16), b3 = _mm256_loadu_ps(acc1 + d0 + 24);
            for (int64_t j = 0; j < count; j++) {
                const float *v = rows + j * stride + d0;
                const __m256 x = _mm256_broadcast_ss(p0 + j), y = _mm256_broadcast_ss(p1 + j);
                const __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8);
                const __m256 v2 = _mm256_loadu_ps(v + 16), v3 = _mm256_loadu_ps(v + 24);
                a0 = _mm256_fmadd_ps(x, v0, a0);
                a1 = _mm256_fmadd_ps(x, v1, a1);
                a2 = _mm256_fmadd_ps(x, v2, a2);
                a3 = _mm256_fmadd_ps(x, v3, a3);
                b0 = _mm256_fmadd_ps(y, v0, b0);
                b1 = _mm256_fmadd_ps(y, v1, b1);
                b2 = _mm256_fmadd_ps(y, v2, b2);
                b3 = _mm256_fmadd_ps(y, v3, b3);
            }
            _mm256_storeu_ps(acc0 + d0, a0);
            _mm256_storeu_ps(acc0 + d0 + 8, a1);
            _mm256_storeu_ps(acc0 + d0 + 16, a2);
            _mm256_storeu_ps(acc0 + d0 + 24, a3);
            _mm256_storeu_ps(acc1 + d0, b0);
            _mm256_storeu_ps(acc1 + d0 + 8, b1);
            _mm256_storeu_ps(acc1 + d0 + 16, b2);
            _mm256_storeu_ps(acc1 + d0 + 24, b3);
        }
    } else {
        for (; d0 + 32 <= head_dim; d0 += 32) {
            __m256 a0 = _mm256_loadu_ps(acc0 + d0), a1 = _mm256_loadu_ps(acc0 + d0 + 8);
            __m256 a2 = _mm256_loadu_ps(acc0 + d0 + 16), a3 = _mm256_loadu_ps(acc0 + d0 + 24);
            for (int64_t j = 0; j < count; j++) {
                const float *v = rows + j * stride + d0;
                const __m256 x = _mm256_broadcast_ss(p0 + j);
                a0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(v), a0);
                a1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(v + 8), a1);
                a2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(v + 16), a2);
                a3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(v + 24), a3);
            }
            _mm256_storeu_ps(acc0 + d0, a0);
            _mm256_storeu_ps(acc0 + d0 + 8, a1);
            _mm256_storeu_ps(acc0 + d0 + 16, a2);
            _mm256_storeu_ps(acc0 + d0 + 24, a3);
        }
    }
    for (; d0 + 8 <= head_dim; d0 += 8) { /* head_dim not a multiple of 32 */
        __m256 a = _mm256_loadu_ps(acc0 + d0), b = p1 != NULL ? _mm256_loadu_ps(acc1 + d0) : a;
        for (int64_t j = 0; j < count; j++) {
            const __m256 v = _mm256_loadu_ps(rows + j * stride + d0);
            a = _mm256_fmadd_ps(_mm256_broadcast_ss(p0 + j), v, a);
            if (p1 != NULL) b = _mm256_fmadd_ps(_mm256_broadcast_ss(p1 + j), v, b);
        }
        _mm256_storeu_ps(acc0 + d0, a);
        if (p1 != NULL) _mm256_storeu_ps(acc1 + d0, b);
    }
    for (int64_t j = 0; j < count && d0 < head_dim; j++) { /* head_dim not a multiple of 8 */
        const float *v = rows + j * stride;
        for (int64_t d = d0; d < head_dim; d++) acc0[d] += p0[j] * v[d];
        if (p1 != NULL)
            for (int64_t d = d0; d < head_dim; d++) acc1[d] += p1[j] * v[d];
    }
}

#else /* generic C */

/* Scores of `count` key rows (row j at rows + j * stride) against two query heads at once, so each key
 * row is loaded once for both: 4 tokens x 2 heads = 8 running sums, which fit the registers. Past `count`
 * the last row is repeated (computed and discarded). */
static inline void score_rows2(const float *q0, const float *q1, const float *rows, int64_t stride,
                               int64_t count, int64_t head_dim, float *out0, float *out1) {
    for (int64_t j = 0; j < count; j += 4) {
        const float *k0 = rows + j * stride;
        const float *k1 = rows + (j + 1 < count ? j + 1 : j) * stride;
        const float *k2 = rows + (j + 2 < count ? j + 2 : j) * stride;
        const float *k3 = rows + (j + 3 < count ? j + 3 : j) * stride;
        float a0 = 0, a1 = 0, a2 = 0, a3 = 0, b0 = 0, b1 = 0, b2 = 0, b3 = 0;
#pragma omp simd reduction(+ : a0, a1, a2, a3, b0, b1, b2, b3)
        for (int64_t d = 0; d < head_dim; d++) {
            const float x = q0[d], y = q1[d];
            a0 += x * k0[d];
            a1 += x * k1[d];
            a2 += x * k2[d];
            a3 += x * k3[d];
            b0 += y * k0[d];
            b1 += y * k1[d];
            b2 += y * k2[d];
            b3 += y * k3[d];
        }
        const float a[4] = {a0, a1, a2, a3}, b[4] = {b0, b1, b2, b3};
        for (int64_t i = 0; i < 4 && j + i < count; i++) {
            out0[j + i] = a[i];
            out1[j + i] = b[i];
        }
    }
}

/* The same for one query head: 8 tokens at a time. */
static inline void score_rows1(const float *q0, const float *rows, int64_t stride, int64_t count,
                               int64_t head_dim, float *out0) {
    for (int64_t j = 0; j < count; j += 8) {
        const float *k[8];
        for (int64_t i = 0; i < 8; i++) k[i] = rows + (j + i < count ? j + i : j) * stride;
        const float *k0 = k[0], *k1 = k[1], *k2 = k[2], *k3 = k[3], *k4 = k[4], *k5 = k[5], *k6 = k[6], *k7 = k[7];
        float s0 = 0, s1 = 0, s2 = 0, s3 = 0, s4 = 0, s5 = 0, s6 = 0, s7 = 0;
#pragma omp simd reduction(+ : s0, s1, s2, s3, s4, s5, s6, s7)
        for (int64_t d = 0; d < head_dim; d++) {
            const float x = q0[d];
            s0 += x * k0[d];
            s1 += x * k1[d];
            s2 += x * k2[d];
            s3 += x * k3[d];
            s4 += x * k4[d];
            s5 += x * k5[d];
            s6 += x * k6[d];
            s7 += x * k7[d];
        }
        const float s[8] = {s0, s1, s2, s3, s4, s5, s6, s7};
        for (int64_t i = 0; i < 8 && j + i < count; i++) out0[j + i] = s[i];
    }
}

/* acc0 += sum_j p0[j] * row j (and acc1 with p1 when two heads share the rows). Each SLICE-wide strip of
 * the accumulators stays in registers over all `count` rows, so a row element is loaded once per
 * chunk for both heads and the accumulators are read and written once per chunk. */
enum { SLICE = 16 };
static inline void weigh_rows(const float *p0, const float *p1, const float *rows, int64_t stride,
                              int64_t count, int64_t head_dim, float *acc0, float *acc1) {
    int64_t d0 = 0;
    for (; d0 + SLICE <= head_dim; d0 += SLICE) {
        float a[SLICE], b[SLICE];
        for (int w = 0; w < SLICE; w++) a[w] = acc0[d0 + w];
        if (p1 != NULL) {
            for (int w = 0; w < SLICE; w++) b[w] = acc1[d0 + w];
            for (int64_t j = 0; j < count; j++) {
                const float *v = rows + j * stride + d0;
                const float x = p0[j], y = p1[j];
                for (int w = 0; w < SLICE; w++) {
                    a[w] += x * v[w];
                    b[w] += y * v[w];
                }
            }
            for (int w = 0; w < SLICE; w++) acc1[d0 + w] = b[w];
        } else {
            for (int64_t j = 0; j < count; j++) {
                const float *v = rows + j * stride + d0;
                const float x = p0[j];
                for (int w = 0; w < SLICE; w++) a[w] += x * v[w];
            }
        }
        for (int w = 0; w < SLICE; w++) acc0[d0 + w] = a[w];
    }
    if (d0 < head_dim) { /* head_dim not a multiple of SLICE */
        for (int64_t j = 0; j < count; j++) {
            const float *v = rows + j * stride;
            for (int64_t d = d0; d < head_dim; d++) acc0[d] += p0[j] * v[d];
            if (p1 != NULL)
                for (int64_t d = d0; d < head_dim; d++) acc1[d] += p1[j] * v[d];
        }
    }
}

#endif

/* How many tokens from `t` on lie in one block and one chunk (and before `end`). */
static inline int64_t chunk_count(int64_t t, int64_t end, int64_t block_size) {
    int64_t count = block_size - t % block_size;
    if (count > end - t) count = end - t;
    return count < CHUNK ? count : CHUNK;
}

/* Everything one item needs to find its rows. */
struct item_ctx {
    const void *k_cache, *v_cache;
    const int32_t *table;
    int64_t first, len;                /* keys [first, first + len) */
    int64_t head_begin, kv_heads;      /* KV heads [head_begin, head_begin + kv_heads) */
    int64_t num_kv_heads, head_dim, block_size, elem_size;
};

/* Cache slot of the first token of a chunk (chunks never cross a block edge). */
static inline int64_t first_slot(const struct item_ctx *c, int64_t t) {
    return (int64_t)c->table[t / c->block_size] * c->block_size + t % c->block_size;
}

/* Prefetch cursor over the item's rows in the order they are read: the K rows of keys first.. then
 * the V rows. v is the stream position (v < len: K row of key first + v, else V row of key
 * first + v - len); block and offset locate that key, kept up to date without divisions. */
struct prefetcher {
    int64_t v, block, offset;
};

/* Prefetch the rows of the item's KV heads (contiguous for one token) for stream positions up to `until`. */
static ALWAYS_INLINE void prefetch_until(const struct item_ctx *c, struct prefetcher *pf, int64_t until) {
    const int64_t bytes = c->kv_heads * c->head_dim * c->elem_size;
    if (until > 2 * c->len) until = 2 * c->len;
    for (; pf->v < until; pf->v++) {
        if (pf->v == c->len) { /* on to the V rows */
            pf->block = c->first / c->block_size;
            pf->offset = c->first % c->block_size;
        }
        const void *cache = pf->v < c->len ? c->k_cache : c->v_cache;
        const int64_t slot = (int64_t)c->table[pf->block] * c->block_size + pf->offset;
        const char *row = (const char *)cache + (slot * c->num_kv_heads + c->head_begin) * c->head_dim * c->elem_size;
        for (const char *p = row - ((uintptr_t)row & 63); p < row + bytes; p += 64) prefetch_line(p);
        if (++pf->offset == c->block_size) {
            pf->offset = 0;
            pf->block++;
        }
    }
}

/* Rows of the `count` tokens from cache slot `slot` on for `kv_head` as floats: row j at
 * *rows + j * (return value). float32 is read in place; bfloat16 and float8 are converted into tmp. */
static inline int64_t chunk_rows(const struct item_ctx *c, const void *cache, int64_t slot, int64_t count,
                                 int64_t kv_head, float *tmp, const float **rows) {
    const int64_t offset = (slot * c->num_kv_heads + kv_head) * c->head_dim;
    if (c->elem_size == 4) {
        *rows = (const float *)cache + offset;
        return c->num_kv_heads * c->head_dim;
    }
    for (int64_t j = 0; j < count; j++)
        load_as_float(cache, offset + j * c->num_kv_heads * c->head_dim, c->head_dim,
                      c->elem_size == 2 ? DTYPE_BFLOAT16 : DTYPE_FP8_E4M3, tmp + j * c->head_dim);
    *rows = tmp;
    return c->head_dim;
}

/* An item's float buffers, carved from its thread's scratch (group * heads * (seq_len + 2 * head_dim) +
 * CHUNK * head_dim floats). */
struct item_buffers {
    float *scores;  /* [heads, len] */
    float *queries; /* [heads, head_dim], scaled; then each head's 1 / sum of its softmax weights */
    const uint16_t *raw_queries; /* bfloat16 items: the same heads as they lie in q (unscaled) */
    float scale;
    float *acc;     /* [heads, head_dim] */
    float *tmp;     /* [CHUNK, head_dim]: converted bfloat16 / float8 rows */
};

static struct item_buffers item_buffers(float *scratch, int64_t heads, int64_t len, int64_t head_dim) {
    struct item_buffers b;
    b.scores = scratch;
    b.queries = b.scores + heads * len;
    b.acc = b.queries + heads * head_dim;
    b.tmp = b.acc + heads * head_dim;
    return b;
}

/* The item's query heads as floats times `scale`, into b->queries. */
static void load_queries(const void *q, int64_t offset, int64_t heads, int64_t head_dim, float scale, int dtype,
                         const struct item_buffers *b) {
    for (int64_t h = 0; h < heads; h++) {
        const float *src = row_as_float(q, offset + h * head_dim, head_dim, dtype, b->tmp);
        for (int64_t d = 0; d < head_dim; d++) b->queries[h * head_dim + d] = src[d] * scale;
    }
}

/* Exact softmax of each head's scores in place, unnormalized: the 1 / sum of head h goes to b->queries[h]
 * (the queries are no longer needed) and is applied to the weighted sum at the end; with `stats`, head h's
 * largest score and sum of weights also go to stats[h * (head_dim + 2)] and the float after it. */
static void softmax_rows(int64_t heads, int64_t len, const struct item_buffers *b, float *stats, int64_t head_dim) {
    for (int64_t h = 0; h < heads; h++) {
        float *sh = b->scores + h * len;
        float peak = -INFINITY;
        for (int64_t j = 0; j < len; j++) peak = sh[j] > peak ? sh[j] : peak;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < len; j++) {
            sh[j] = exp_approx(sh[j] - peak);
            sum += sh[j];
        }
        b->queries[h] = 1.0f / sum;
        if (stats != NULL) {
            stats[h * (head_dim + 2)] = peak;
            stats[h * (head_dim + 2) + 1] = sum;
        }
    }
}

/* out's rows for the item's heads: each head's weighted sum of values over its sum of weights. */
static void store_outputs(void *out, int64_t offset, int64_t heads, int64_t head_dim, int dtype,
                          const struct item_buffers *b) {
    for (int64_t h = 0; h < heads; h++) {
        float *ah = b->acc + h * head_dim;
        for (int64_t d = 0; d < head_dim; d++) ah[d] *= b->queries[h];
        store_row(out, offset + h * head_dim, ah, head_dim, dtype);
    }
}

/* The K chunk of one KV head: its query heads' scores of the chunk's `count` keys, into scores[h * len]. */
static ALWAYS_INLINE void score_chunk(const struct item_ctx *c, const struct item_buffers *b, int64_t slot,
                                      int64_t count, int64_t kv_head, int64_t group, float *scores) {
    const float *rows;
    const int64_t stride = chunk_rows(c, c->k_cache, slot, count, kv_head, b->tmp, &rows);
    const int64_t head_dim = c->head_dim, len = c->len;
    int64_t h = (kv_head - c->head_begin) * group;
    const int64_t h_end = h + group;
    for (; h + 2 <= h_end; h += 2)
        score_rows2(b->queries + h * head_dim, b->queries + (h + 1) * head_dim, rows, stride, count, head_dim,
                    scores + h * len, scores + (h + 1) * len);
    if (h < h_end) score_rows1(b->queries + h * head_dim, rows, stride, count, head_dim, scores + h * len);
}

/* The V chunk of one KV head: its query heads' weighted sums += weights[h * len + j] * value row j. */
static ALWAYS_INLINE void weigh_chunk(const struct item_ctx *c, const struct item_buffers *b, int64_t slot,
                                      int64_t count, int64_t kv_head, int64_t group, const float *weights) {
    const float *rows;
    const int64_t stride = chunk_rows(c, c->v_cache, slot, count, kv_head, b->tmp, &rows);
    const int64_t head_dim = c->head_dim, len = c->len;
    int64_t h = (kv_head - c->head_begin) * group;
    const int64_t h_end = h + group;
    for (; h < h_end; h += 2) {
        const int two = h + 1 < h_end;
        weigh_rows(weights + h * len, two ? weights + (h + 1) * len : NULL, rows, stride, count, head_dim,
                   b->acc + h * head_dim, two ? b->acc + (h + 1) * head_dim : NULL);
    }
}

#if defined(__AVX512F__)
/* ---- AVX-512 chunks ------------------------------------------------------------------------------
 * For head_dim a multiple of 16, the chunks above with rows read where they lie in the cache: bfloat16
 * is widened in registers (exact: its bits into a float's high half), so a bfloat16 cache costs half
 * float32's memory traffic and no conversion pass. Each K row is loaded once for up to HEAD_BLOCK query
 * heads of its GQA group, four tokens at a time (16 running sums in registers); each V row once per
 * HEAD_BLOCK heads. Measured on AMD EPYC (Zen 5), a decode step over 30 layers' bfloat16 caches: 1.4x
 * faster than the AVX2 chunks, float32 the same (docs/benchmarks.md). Where the CPU has AVX512-BF16, bfloat16
 * scores take its dot product instead (score4_bf16: 1.15-1.2x the widening score4's attention). A float8
 * cache is widened in registers the same way (fp8x16_load): a quarter of float32's memory traffic. The
 * `kv` argument is the cache's dtype code. */
enum { HEAD_BLOCK = 4 };

/* 16 elements of a cache row from element i on, as floats. */
static ALWAYS_INLINE __m512 load16(const void *row, int64_t i, int kv) {
    if (kv == DTYPE_FP8_E4M3) return fp8x16_load((const uint8_t *)row + i);
    if (kv == DTYPE_BFLOAT16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)row + i))), 16));
    return _mm512_loadu_ps((const float *)row + i);
}

/* The lane sums of a, b, c and d. */
static ALWAYS_INLINE __m128 sum4_lanes16(__m512 a, __m512 b, __m512 c, __m512 d) {
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    /* each 128-bit lane: partial sums of a, b, c, d */
    const __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xEE));
    const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1));
    const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd), high);
    return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}

/* Scores of four key rows against `hn` (<= HEAD_BLOCK) queries [hn, head_dim]: head i's score of row j
 * goes to out[i * len + j] for j < count (rows past count repeat a real row; their sums are dropped). */
static ALWAYS_INLINE void score4(const float *queries, int hn, const void *const rows[4], int64_t head_dim,
                                 int kv, float *out, int64_t len, int64_t count) {
    __m512 acc[HEAD_BLOCK][4];
    for (int i = 0; i < HEAD_BLOCK; i++)
        for (int j = 0; j < 4; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t d = 0; d < head_dim; d += 16) {
        const __m512 k0 = load16(rows[0], d, kv), k1 = load16(rows[1], d, kv);
        const __m512 k2 = load16(rows[2], d, kv), k3 = load16(rows[3], d, kv);
        for (int i = 0; i < hn; i++) {
            const __m512 x = _mm512_loadu_ps(queries + i * head_dim + d);
            acc[i][0] = _mm512_fmadd_ps(x, k0, acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(x, k1, acc[i][1]);
            acc[i][2] = _mm512_fmadd_ps(x, k2, acc[i][2]);
            acc[i][3] = _mm512_fmadd_ps(x, k3, acc[i][3]);
        }
    }
    for (int i = 0; i < hn; i++) {
        float s[4];
        _mm_storeu_ps(s, sum4_lanes16(acc[i][0], acc[i][1], acc[i][2], acc[i][3]));
        for (int64_t j = 0; j < count; j++) out[i * len + j] = s[j];
    }
}

#if defined(__AVX512BF16__)
/* score4 for bfloat16 rows and queries (head_dim a multiple of 32), with the AVX512-BF16 dot product: 32
 * products a step, each exact in float32 and summed in float32 as score4 does, no widening of the rows;
 * the sums are scaled afterwards. */
static ALWAYS_INLINE void score4_bf16(const uint16_t *queries, int hn, const void *const rows[4], int64_t head_dim,
                                      float scale, float *out, int64_t len, int64_t count) {
    __m512 acc[HEAD_BLOCK][4];
    for (int i = 0; i < HEAD_BLOCK; i++)
        for (int j = 0; j < 4; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t d = 0; d < head_dim; d += 32) {
        __m512bh k[4];
        for (int j = 0; j < 4; j++) k[j] = (__m512bh)_mm512_loadu_si512((const uint16_t *)rows[j] + d);
        for (int i = 0; i < hn; i++) {
            const __m512bh x = (__m512bh)_mm512_loadu_si512(queries + i * head_dim + d);
            for (int j = 0; j < 4; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], x, k[j]);
        }
    }
    for (int i = 0; i < hn; i++) {
        float s[4];
        _mm_storeu_ps(s, _mm_mul_ps(sum4_lanes16(acc[i][0], acc[i][1], acc[i][2], acc[i][3]), _mm_set1_ps(scale)));
        for (int64_t j = 0; j < count; j++) out[i * len + j] = s[j];
    }
}
#endif

/* acc[i] += sum_j p[i * len + j] * row j for `hn` (<= HEAD_BLOCK) heads; row j at `rows` + j * stride bytes. */
static ALWAYS_INLINE void weigh4(const float *p, int64_t len, int hn, const char *rows, int64_t stride, int64_t count,
                                 int64_t head_dim, int kv, float *acc) {
    for (int64_t d = 0; d < head_dim; d += 16) {
        __m512 a[HEAD_BLOCK];
        for (int i = 0; i < hn; i++) a[i] = _mm512_loadu_ps(acc + i * head_dim + d);
        for (int64_t j = 0; j < count; j++) {
            const __m512 v = load16(rows + j * stride, d, kv);
            for (int i = 0; i < hn; i++) a[i] = _mm512_fmadd_ps(_mm512_set1_ps(p[i * len + j]), v, a[i]);
        }
        for (int i = 0; i < hn; i++) _mm512_storeu_ps(acc + i * head_dim + d, a[i]);
    }
}

/* `call` with HN a compile-time constant equal to min(hn, HEAD_BLOCK), so its sums stay in registers. */
#define WITH_CONSTANT_HN(hn, call)                       \
    switch ((hn) < HEAD_BLOCK ? (hn) : HEAD_BLOCK) {     \
    case 1: { enum { HN = 1 }; call; break; }            \
    case 2: { enum { HN = 2 }; call; break; }            \
    case 3: { enum { HN = 3 }; call; break; }            \
    default: { enum { HN = 4 }; call; break; }           \
    }

/* Where token `slot`'s row of `kv_head` starts in `cache`, in bytes. */
static ALWAYS_INLINE const char *row_at(const struct item_ctx *c, const void *cache, int64_t slot, int64_t kv_head) {
    return (const char *)cache + (slot * c->num_kv_heads + kv_head) * c->head_dim * c->elem_size;
}

static ALWAYS_INLINE void score_chunk_wide(const struct item_ctx *c, const struct item_buffers *b, int64_t slot,
                                           int64_t count, int64_t kv_head, int64_t group, float *scores, int kv) {
    const int64_t token_bytes = c->num_kv_heads * c->head_dim * c->elem_size;
    const char *base = row_at(c, c->k_cache, slot, kv_head);
    const void *rows[4];
    for (int64_t j = 0; j < 4; j++) rows[j] = base + (j < count ? j : count - 1) * token_bytes;
    const int64_t h_end = (kv_head - c->head_begin + 1) * group;
#if defined(__AVX512BF16__)
    if (kv == DTYPE_BFLOAT16 && b->raw_queries != NULL && c->head_dim % 32 == 0) {
        for (int64_t h = h_end - group; h < h_end; h += HEAD_BLOCK)
            WITH_CONSTANT_HN(h_end - h, score4_bf16(b->raw_queries + h * c->head_dim, HN, rows, c->head_dim, b->scale,
                                                    scores + h * c->len, c->len, count))
        return;
    }
#endif
    for (int64_t h = h_end - group; h < h_end; h += HEAD_BLOCK)
        WITH_CONSTANT_HN(h_end - h, score4(b->queries + h * c->head_dim, HN, rows, c->head_dim, kv,
                                           scores + h * c->len, c->len, count))
}

static ALWAYS_INLINE void weigh_chunk_wide(const struct item_ctx *c, const struct item_buffers *b, int64_t slot,
                                           int64_t count, int64_t kv_head, int64_t group, const float *weights,
                                           int kv) {
    const int64_t token_bytes = c->num_kv_heads * c->head_dim * c->elem_size;
    const char *base = row_at(c, c->v_cache, slot, kv_head);
    const int64_t h_end = (kv_head - c->head_begin + 1) * group;
    for (int64_t h = h_end - group; h < h_end; h += HEAD_BLOCK)
        WITH_CONSTANT_HN(h_end - h, weigh4(weights + h * c->len, c->len, HN, base, token_bytes, count, c->head_dim,
                                           kv, b->acc + h * c->head_dim))
}
#endif

/* One pass over the item's keys, a chunk at a time, every KV head of the chunk before the next chunk:
 * `values` 0 scores the K rows into b->scores, 1 adds the V rows weighted by b->scores into b->acc. The
 * prefetch stream runs `ahead` tokens in front (K rows first, then V rows), a share of a chunk before each
 * KV head. `kv`: the cache's dtype code (the AVX-512 chunks take it as a constant). */
static ALWAYS_INLINE void visit_chunks(const struct item_ctx *c, const struct item_buffers *b, struct prefetcher *pf,
                                       int64_t ahead, int64_t group, int values, int wide, int kv) {
    const int64_t end = c->first + c->len, stream = values ? c->len : 0;
    for (int64_t t = c->first; t < end;) {
        const int64_t count = chunk_count(t, end, c->block_size);
        const int64_t slot = first_slot(c, t), share = (count + c->kv_heads - 1) / c->kv_heads;
        float *scores = b->scores + (t - c->first);
        for (int64_t kv_head = c->head_begin; kv_head < c->head_begin + c->kv_heads; kv_head++) {
            prefetch_until(c, pf, stream + t - c->first + ahead + (kv_head - c->head_begin + 1) * share);
#if defined(__AVX512F__)
            if (wide) {
                if (values)
                    weigh_chunk_wide(c, b, slot, count, kv_head, group, scores, kv);
                else
                    score_chunk_wide(c, b, slot, count, kv_head, group, scores, kv);
                continue;
            }
#endif
            if (values)
                weigh_chunk(c, b, slot, count, kv_head, group, scores);
            else
                score_chunk(c, b, slot, count, kv_head, group, scores);
        }
        t += count;
    }
    (void)wide;
    (void)kv;
}

/* The first key a row attending keys [0, keys) reads: 0, or the start of the sliding window. */
static inline int64_t window_start(int64_t keys, int64_t window) {
    return window > 0 && keys > window ? keys - window : 0;
}

/* How many parts of at most DECODE_PART_KEYS keys a row attending `keys` keys (before the window) has. */
static inline int64_t decode_parts(int64_t keys, int64_t window) {
    const int64_t len = keys - window_start(keys, window);
    return len > DECODE_PART_KEYS ? (len + DECODE_PART_KEYS - 1) / DECODE_PART_KEYS : 1;
}

/* One item: KV heads [head_begin, head_end) of one sequence, over its keys' part `part` (DECODE_PART_KEYS keys
 * from the first it attends). For each chunk of tokens every head of the range is done before the next chunk,
 * so a block is read from memory once while it is hot; `wide`: the AVX-512 chunks (AVX-512 builds only), for
 * `dtype` (q, out) and `kv_dtype` (the caches) fixed at compile time. Without `partial` the item's keys are
 * all the row's and its outputs go to `out`; with it, head h's largest score, sum of weights and unnormalized
 * weighted sum go to partial[h * (head_dim + 2)] on, for paged_decode to merge the parts. */
static ALWAYS_INLINE void decode_item_as(const void *q, int64_t q_row_stride, const void *k_cache, const void *v_cache,
                                         const int32_t *table, int64_t seq_len, int64_t part, int64_t row,
                                         int64_t head_begin, int64_t head_end, int64_t num_heads, int64_t num_kv_heads,
                                         int64_t head_dim, int64_t block_size, int64_t window, float scale, int dtype,
                                         int kv_dtype, void *out, float *partial, float *scratch, int wide) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t heads = (head_end - head_begin) * group; /* query heads of this item */
    const int64_t first = window_start(seq_len, window) + part * DECODE_PART_KEYS;
    const int64_t len = seq_len - first < DECODE_PART_KEYS || partial == NULL ? seq_len - first : DECODE_PART_KEYS;
    struct item_buffers b = item_buffers(scratch, heads, len, head_dim);
    const int64_t query_offset = row * q_row_stride + head_begin * group * head_dim;
    b.raw_queries = dtype == DTYPE_BFLOAT16 ? (const uint16_t *)q + query_offset : NULL;
    b.scale = scale;
    const struct item_ctx c = {k_cache, v_cache, table, first, len, head_begin, head_end - head_begin,
                               num_kv_heads, head_dim, block_size,
                               kv_dtype == DTYPE_FLOAT32 ? 4 : (kv_dtype == DTYPE_BFLOAT16 ? 2 : 1)};
    /* Prefetch `ahead` tokens ahead of the chunk being read, a share of a chunk before each KV head. */
    const int64_t ahead = PREFETCH_BYTES / (c.kv_heads * head_dim * c.elem_size);
    struct prefetcher pf = {0, first / block_size, first % block_size};
    prefetch_until(&c, &pf, ahead);
    load_queries(q, query_offset, heads, head_dim, scale, dtype, &b);
    visit_chunks(&c, &b, &pf, ahead, group, 0, wide, kv_dtype);
    float *stats = partial == NULL ? NULL : partial + head_begin * group * (head_dim + 2);
    softmax_rows(heads, len, &b, stats, head_dim);
    memset(b.acc, 0, sizeof(float) * (size_t)(heads * head_dim));
    visit_chunks(&c, &b, &pf, ahead, group, 1, wide, kv_dtype);
    if (stats != NULL) {
        for (int64_t h = 0; h < heads; h++)
            memcpy(stats + h * (head_dim + 2) + 2, b.acc + h * head_dim, sizeof(float) * (size_t)head_dim);
        return;
    }
    store_outputs(out, (row * num_heads + head_begin * group) * head_dim, heads, head_dim, dtype, &b);
}

/* decode_item_as compiled for each case: the portable / AVX2 chunks (any dtypes), and the AVX-512 chunks
 * for float32, for bfloat16 and for a float8 cache (queries of either dtype). */
#define DECODE_ITEM_PARAMS                                                                                           \
    const void *q, int64_t q_row_stride, const void *k_cache, const void *v_cache, const int32_t *table,             \
        int64_t seq_len, int64_t part, int64_t row, int64_t head_begin, int64_t head_end, int64_t num_heads,         \
        int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t window, float scale, int dtype,          \
        int kv_dtype, void *out, float *partial, float *scratch
#define DECODE_ITEM_ARGS                                                                                             \
    q, q_row_stride, k_cache, v_cache, table, seq_len, part, row, head_begin, head_end, num_heads, num_kv_heads,     \
        head_dim, block_size, window, scale
typedef void (*decode_item_fn)(DECODE_ITEM_PARAMS);

static void decode_item(DECODE_ITEM_PARAMS) { decode_item_as(DECODE_ITEM_ARGS, dtype, kv_dtype, out, partial, scratch, 0); }
#if defined(__AVX512F__)
static void decode_item_wide_float32(DECODE_ITEM_PARAMS) {
    (void)dtype;
    (void)kv_dtype;
    decode_item_as(DECODE_ITEM_ARGS, DTYPE_FLOAT32, DTYPE_FLOAT32, out, partial, scratch, 1);
}
static void decode_item_wide_bfloat16(DECODE_ITEM_PARAMS) {
    (void)dtype;
    (void)kv_dtype;
    decode_item_as(DECODE_ITEM_ARGS, DTYPE_BFLOAT16, DTYPE_BFLOAT16, out, partial, scratch, 1);
}
static void decode_item_wide_fp8(DECODE_ITEM_PARAMS) {
    (void)kv_dtype;
    decode_item_as(DECODE_ITEM_ARGS, dtype, DTYPE_FP8_E4M3, out, partial, scratch, 1);
}
#endif

/* The item function for these inputs (kv_dtype: the caches'; float32 and bfloat16 caches have q's dtype). */
static decode_item_fn pick_decode_item(int64_t head_dim, int dtype, int kv_dtype) {
#if defined(__AVX512F__)
    if (head_dim % 16 == 0) {
        if (kv_dtype == DTYPE_FP8_E4M3) return decode_item_wide_fp8;
        return dtype == DTYPE_BFLOAT16 ? decode_item_wide_bfloat16 : decode_item_wide_float32;
    }
#endif
    (void)head_dim;
    (void)dtype;
    (void)kv_dtype;
    return decode_item;
}

/* Runs work items 0 .. items - 1 on num_threads OpenMP threads, handed out one at a time, each thread with a
 * scratch buffer of its own (scratch_floats floats): run(context, item, scratch). Returns 0, or 1 when a
 * thread's scratch could not be allocated (its items are then skipped). */
typedef void (*item_runner)(const void *context, int64_t item, float *scratch);

static int run_items(int64_t items, size_t scratch_floats, int num_threads, item_runner run, const void *context) {
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        /* Cache-line aligned: the AMX tile loads and stores of the prefill items read and write whole
         * 64-byte rows of it (a misaligned buffer splits every one of them in two lines). */
        float *scratch = (float *)aligned_alloc(64, (sizeof(float) * scratch_floats + 63) / 64 * 64);
        if (scratch == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++)
            if (scratch != NULL) run(context, item, scratch);
        free(scratch);
    }
    return failed;
}

/* paged_decode's arguments, for its items. */
struct decode_call {
    const void *q, *k_cache, *v_cache;
    const int32_t *block_tables, *lens;
    const int64_t *rows, *seqs;
    int64_t q_row_stride, table_stride, num_heads, num_kv_heads, head_dim, block_size, window;
    int64_t n, items_per_part, heads_per_item;
    const int64_t *part_starts; /* row i's parts are [part_starts[i], part_starts[i + 1]); NULL: one part a row */
    float *partials;            /* [parts][num_heads][head_dim + 2]: each part's stats (rows of several parts) */
    float scale;
    int dtype, kv_dtype;
    void *out;
    decode_item_fn item_fn;
};

static void run_decode_item(const void *context, int64_t item, float *scratch) {
    const struct decode_call *c = (const struct decode_call *)context;
    const int64_t global_part = item / c->items_per_part;
    const int64_t head_begin = (item % c->items_per_part) * c->heads_per_item;
    int64_t i = global_part, part = 0;
    float *partial = NULL;
    if (c->part_starts != NULL) {
        /* The row whose parts hold global_part: the last i with part_starts[i] <= global_part. */
        int64_t lo = 0, hi = c->n;
        while (hi - lo > 1) {
            const int64_t mid = (lo + hi) / 2;
            if (c->part_starts[mid] <= global_part) lo = mid;
            else hi = mid;
        }
        i = lo;
        part = global_part - c->part_starts[i];
        if (c->part_starts[i + 1] - c->part_starts[i] > 1)
            partial = c->partials + global_part * c->num_heads * (c->head_dim + 2);
    }
    c->item_fn(c->q, c->q_row_stride, c->k_cache, c->v_cache, c->block_tables + c->seqs[i] * c->table_stride, c->lens[i],
               part, c->rows[i], head_begin, head_begin + c->heads_per_item, c->num_heads, c->num_kv_heads, c->head_dim,
               c->block_size, c->window, c->scale, c->dtype, c->kv_dtype, c->out, partial, scratch);
}

/* Row i's output from its parts' stats: each head's weighted sums rescaled to the largest score of all its
 * parts, added, over the parts' sums of weights rescaled alike. */
static void merge_parts(const struct decode_call *c, int64_t i, float *row_out) {
    const int64_t first = c->part_starts[i], parts = c->part_starts[i + 1] - first, width = c->head_dim + 2;
    for (int64_t h = 0; h < c->num_heads; h++) {
        const float *stats = c->partials + first * c->num_heads * width + h * width;
        float peak = -INFINITY;
        for (int64_t p = 0; p < parts; p++) peak = fmaxf(peak, stats[p * c->num_heads * width]);
        float sum = 0.0f;
        for (int64_t d = 0; d < c->head_dim; d++) row_out[d] = 0.0f;
        for (int64_t p = 0; p < parts; p++) {
            const float *part = stats + p * c->num_heads * width, factor = expf(part[0] - peak);
            sum += factor * part[1];
            for (int64_t d = 0; d < c->head_dim; d++) row_out[d] += factor * part[2 + d];
        }
        for (int64_t d = 0; d < c->head_dim; d++) row_out[d] /= sum;
        store_row(c->out, (c->rows[i] * c->num_heads + h) * c->head_dim, row_out, c->head_dim, c->dtype);
    }
}

/* Attention of n query rows, each over its own sequence's keys 0 .. lens[i] - 1: a decode token (lens[i]
 * = its sequence's length), or one row of a prompt (lens[i] = its position + 1: causal).
 *   q, out      [T, num_heads, head_dim] (q's rows q_row_stride apart); item i reads and writes row rows[i]
 *   seqs[i]     item i's row of block_tables
 *   lens[i]     how many keys item i attends (before the sliding window)
 *   window      keys older than `window` positions are skipped (0 = no sliding window)
 *   max_seq_len the longest lens[i] (sizes the per-thread scratch)
 *   dtype       q's and out's; kv_dtype the caches' (dtype's, or DTYPE_FP8_E4M3)
 * A row over more than DECODE_PART_KEYS keys is split into parts of that many keys, and the parts' softmax
 * sums and weighted sums merged at the end (merge_parts): one row over 13 K float32 keys read 12.0 -> 18.9
 * GB/s on 2 threads (Sapphire Rapids; docs/benchmarks.md). A work item is a whole part (every KV head of its
 * row) when there are at least as many parts as threads, else one KV head of a part. A KV head's rows are a
 * quarter to a third of each token's K/V bytes, so items of one KV head read the memory in strided pieces:
 * float32 and bfloat16 steps over 2-7 sequences of 1.6-3.9 K tokens read their K/V 1.2-1.4x faster as whole
 * rows on 2 threads, odd counts' uneven split included. Returns 0, or 1 when memory for the scratch or the
 * parts could not be allocated (out is then incomplete).
 */
int paged_decode(const void *q, int64_t q_row_stride, const void *k_cache, const void *v_cache, const int32_t *block_tables,
                 int64_t table_stride, const int32_t *lens, const int64_t *rows, const int64_t *seqs,
                 int64_t n, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                 int64_t window, float scale, int dtype, int kv_dtype, void *out, int64_t max_seq_len,
                 int num_threads) {
    /* Each row's parts: rows longer than DECODE_PART_KEYS are split, and their parts merged below. */
    int64_t *part_starts = (int64_t *)malloc(sizeof(int64_t) * (size_t)(n + 1));
    if (part_starts == NULL) return 1;
    part_starts[0] = 0;
    for (int64_t i = 0; i < n; i++) part_starts[i + 1] = part_starts[i] + decode_parts(lens[i], window);
    const int64_t parts = part_starts[n];
    const int split = parts > n;
    float *partials = split ? (float *)malloc(sizeof(float) * (size_t)(parts * num_heads * (head_dim + 2))) : NULL;
    if (split && partials == NULL) {
        free(part_starts);
        return 1;
    }
    const int64_t heads_per_item = parts >= (int64_t)num_threads ? num_kv_heads : 1;
    const int64_t items_per_part = num_kv_heads / heads_per_item;
    const int64_t query_heads = heads_per_item * (num_heads / num_kv_heads);
    /* No item attends more keys than a part. */
    const int64_t longest = max_seq_len < DECODE_PART_KEYS ? max_seq_len : DECODE_PART_KEYS;
    const size_t scratch_floats = (size_t)(query_heads * (longest + 2 * head_dim) + CHUNK * head_dim);
    const struct decode_call call = {
        .q = q, .k_cache = k_cache, .v_cache = v_cache, .block_tables = block_tables, .lens = lens, .rows = rows,
        .seqs = seqs, .q_row_stride = q_row_stride, .table_stride = table_stride, .num_heads = num_heads,
        .num_kv_heads = num_kv_heads, .head_dim = head_dim, .block_size = block_size, .window = window, .n = n,
        .items_per_part = items_per_part, .heads_per_item = heads_per_item, .part_starts = split ? part_starts : NULL,
        .partials = partials, .scale = scale, .dtype = dtype, .kv_dtype = kv_dtype, .out = out,
        .item_fn = pick_decode_item(head_dim, dtype, kv_dtype)};
    /* Every thread from a few keys: one row over 222-1482 keys (a decode step of one sequence, SmolLM2's
     * 3 KV heads as items on two threads) took 1.15-1.39x less time than on one thread. */
    const int threads = threads_for(n * max_seq_len * num_heads * head_dim, num_threads);
    int failed = run_items(parts * items_per_part, scratch_floats, threads, run_decode_item, &call);
    if (split && !failed) {
        float *row_out = (float *)malloc(sizeof(float) * (size_t)head_dim);
        if (row_out == NULL) failed = 1;
        for (int64_t i = 0; i < n && row_out != NULL; i++)
            if (part_starts[i + 1] - part_starts[i] > 1) merge_parts(&call, i, row_out);
        free(row_out);
    }
    free(part_starts);
    free(partials);
    return failed;
}

/* ---- paged prefill attention -------------------------------------------------------------------
 * The new rows of prompts (prefill, chunked prefill): each attends causally to its sequence's keys up to
 * its own position. A work item is PREFILL_ROWS consecutive rows of one prompt and one KV head
 * (AMX_PREFILL_ROWS where the products run on the AMX tiles: the keys' conversion, then the largest cost
 * left, is shared by twice the rows: 2048 rows 6.3 -> 5.8 ms, 2048 after 2048 keys 18.9 -> 16.6), and twice
 * that where a call still has eight items per thread (the tiles: 5-15 % on chunks of 1024-4096 rows; float32:
 * 1.05-1.1x on chunks of 256-4096 rows, where each block of keys then serves twice the vectors). The item
 * goes over the keys its rows attend PREFILL_KEYS at a time (flash-attention style): each block of keys is
 * converted once into tiles, K transposed ([head_dim][keys]) and V as rows (float32 V rows are read where
 * they lie in the cache), and every query head of the KV head's group, for every row of the item, scores
 * and weighs against those tiles: the scores are rank-1 updates over 16 keys at a time (no horizontal
 * sums), the weighted sums rank-1 updates over 16 dimensions, added to each vector's running sum. The
 * softmax is online: each vector keeps its largest score so far and the sum of its weights, and a block
 * with a larger score rescales both and the running sum first; an item whose keys fit in one block
 * computes exactly the two-pass softmax. Query vectors are ordered row by row, each row's group heads
 * together.
 * 32 rows: the keys of a long prompt are converted once per 32 rows instead of once per 16 (1.2-1.5x the
 * 16-row items' speed on a 2048-token step of SmolLM2 prompts). Blocks of keys keep an item's tiles and
 * scores in L2 however long the prompt (they took 3 MB per item at 4096 keys); blocks of 128 keys keep a
 * block's K or V tile (32 KB at head_dim 64) within L1 while the vectors go over it (float32 attention
 * 1.03-1.1x the speed with 256-key blocks, the tiles level). Where the CPU has AVX512-BF16, bfloat16 scores take its dot product on keys and queries kept in
 * bfloat16 (prefill_scores8_bf16: 1.25-1.3x the float tiles' attention), and so do the weighted sums, on
 * the weights rounded to bfloat16 as torch's CPU attention rounds them (prefill_weigh4_bf16). */
enum { PREFILL_ROWS = 32, AMX_PREFILL_ROWS = 64, PREFILL_KEYS = 128, KEY_PAD = 16 };

/* A prompt as the kernel reads it: [table row, first query row, query_len, seq_len] (int64 each). */
enum { PROMPT_FIELDS = 4 };

/* An item's tiles, carved from its thread's scratch. */
struct prefill_tiles {
    float *kt;      /* [head_dim][PREFILL_KEYS]: the block's keys, zero past the last */
    float *v;       /* [PREFILL_KEYS][head_dim]; bfloat16 weighted sums: [PREFILL_KEYS / 2][head_dim] pairs */
    const float *vrows[PREFILL_KEYS]; /* float weighted sums: each key's V row (in the cache for float32) */
    float *queries; /* [vectors][head_dim], scaled; bfloat16 dot products: [vectors][head_dim / 2] pairs */
    float *scores;  /* [vectors][PREFILL_KEYS]: scores, then weights (zero outside each row's keys) */
    float *acc;     /* [vectors][head_dim]: running weighted sums */
    float *peak;    /* [vectors]: largest score so far (-inf before the first) */
    float *block_peak; /* [vectors]: largest score in the block, where the score kernel took exactly the
                        * vector's keys of the block (NaN where the softmax must find it) */
    float *sum;     /* [vectors]: sum of the weights so far */
    float *row;     /* [head_dim]: a key row converted to float */
};

/* Query vectors of an item, rounded up to whole blocks of the score micro-kernels (8 vectors) and of the
 * tiles (16); padding vectors are zero. */
static inline int64_t padded_vectors(int64_t rows, int64_t group) { return (rows * group + 15) / 16 * 16; }

static size_t prefill_scratch_floats(int64_t rows, int64_t group, int64_t head_dim) {
    const int64_t vectors = padded_vectors(rows, group);
    return (size_t)(2 * head_dim * PREFILL_KEYS + vectors * (2 * head_dim + PREFILL_KEYS + 3) + head_dim);
}

#if defined(__AVX512F__)
/* Each of 8 vectors' largest score (NaN ignored, -inf for none) from its running maxima m[i], into peaks
 * unless it is NULL. */
static ALWAYS_INLINE void store_peaks8(const __m512 m[8], float *peaks) {
    if (peaks != NULL)
        for (int i = 0; i < 8; i++) peaks[i] = _mm512_reduce_max_ps(m[i]);
}

/* Scores of 8 query vectors against keys [0, keys) of the transposed tile (keys a multiple of 16):
 * 8 x 32 running sums in registers, two K loads per 16 broadcast multiply-adds. Each vector's largest
 * score goes to peaks unless NULL (the softmax's first pass, done while the scores are in registers:
 * float32 attention 1.02-1.05x). */
static ALWAYS_INLINE void prefill_scores8(const float *queries, const float *kt, int64_t stride, int64_t keys,
                                          int64_t head_dim, float *scores, float *peaks) {
    __m512 m[8];
    for (int i = 0; i < 8; i++) m[i] = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < keys; j += 32) {
        const int two = j + 16 < keys;
        __m512 a[8][2];
        for (int i = 0; i < 8; i++) a[i][0] = a[i][1] = _mm512_setzero_ps();
        for (int64_t d = 0; d < head_dim; d++) {
            const __m512 k0 = _mm512_loadu_ps(kt + d * stride + j);
            const __m512 k1 = two ? _mm512_loadu_ps(kt + d * stride + j + 16) : k0;
            for (int i = 0; i < 8; i++) {
                const __m512 x = _mm512_set1_ps(queries[i * head_dim + d]);
                a[i][0] = _mm512_fmadd_ps(x, k0, a[i][0]);
                a[i][1] = _mm512_fmadd_ps(x, k1, a[i][1]);
            }
        }
        for (int i = 0; i < 8; i++) {
            /* Without a second 16 keys, a[i][1] repeats a[i][0]. */
            m[i] = _mm512_max_ps(a[i][1], _mm512_max_ps(a[i][0], m[i]));
            _mm512_storeu_ps(scores + i * stride + j, a[i][0]);
            if (two) _mm512_storeu_ps(scores + i * stride + j + 16, a[i][1]);
        }
    }
    store_peaks8(m, peaks);
}

/* out[i] += sum over keys [from, to) of weights[i][j] * V row j (at rows[j]) for 8 vectors, 32 dimensions at a
 * time (head_dim a multiple of 32): 8 x 32 running sums in registers, two V loads per 16 multiply-adds (4
 * vectors x 64 dimensions, four loads per 16, was 1.1-1.15x slower: the V rows come from L2, and each pass
 * over them now serves twice the vectors). The empty asm keeps each V load in a register: without it gcc
 * folds the load into the multiply-adds that use it (a load per multiply-add from L2: float32 attention
 * 1.2x slower). */
static ALWAYS_INLINE void prefill_weigh8(const float *weights, int64_t stride, const float *const *rows, int64_t from,
                                         int64_t to, int64_t head_dim, float *out) {
    for (int64_t d0 = 0; d0 < head_dim; d0 += 32) {
        __m512 a[8][2];
        for (int i = 0; i < 8; i++)
            for (int c = 0; c < 2; c++) a[i][c] = _mm512_loadu_ps(out + i * head_dim + d0 + 16 * c);
        for (int64_t j = from; j < to; j++) {
            __m512 x[2];
            for (int c = 0; c < 2; c++) {
                x[c] = _mm512_loadu_ps(rows[j] + d0 + 16 * c);
                __asm__("" : "+v"(x[c]));
            }
            for (int i = 0; i < 8; i++) {
                const __m512 p = _mm512_set1_ps(weights[i * stride + j]);
                for (int c = 0; c < 2; c++) a[i][c] = _mm512_fmadd_ps(p, x[c], a[i][c]);
            }
        }
        for (int i = 0; i < 8; i++)
            for (int c = 0; c < 2; c++) _mm512_storeu_ps(out + i * head_dim + d0 + 16 * c, a[i][c]);
    }
}
#endif

#if defined(__AVX512BF16__)
/* prefill_scores8 for bfloat16 keys and queries, with the AVX512-BF16 dot product: the tile holds key
 * dimensions in pairs (dimensions 2p and 2p + 1 of key j in the 32 bits at kt2[p * stride + j]) and a query
 * vector its own pairs, so each step multiplies two dimensions of 16 keys; products exact, sums in float32;
 * the scores are scaled at the end. */
static ALWAYS_INLINE void prefill_scores8_bf16(const uint32_t *queries, const uint32_t *kt2, int64_t stride,
                                               int64_t keys, int64_t pairs, float scale, float *scores, float *peaks) {
    const __m512 factor = _mm512_set1_ps(scale);
    __m512 m[8];
    for (int i = 0; i < 8; i++) m[i] = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < keys; j += 32) {
        const int two = j + 16 < keys;
        __m512 a[8][2];
        for (int i = 0; i < 8; i++) a[i][0] = a[i][1] = _mm512_setzero_ps();
        for (int64_t p = 0; p < pairs; p++) {
            const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kt2 + p * stride + j);
            const __m512bh k1 = two ? (__m512bh)_mm512_loadu_si512(kt2 + p * stride + j + 16) : k0;
            for (int i = 0; i < 8; i++) {
                const __m512bh x = (__m512bh)_mm512_set1_epi32((int)queries[i * pairs + p]);
                a[i][0] = _mm512_dpbf16_ps(a[i][0], x, k0);
                a[i][1] = _mm512_dpbf16_ps(a[i][1], x, k1);
            }
        }
        for (int i = 0; i < 8; i++) {
            const __m512 s0 = _mm512_mul_ps(a[i][0], factor), s1 = _mm512_mul_ps(a[i][1], factor);
            m[i] = _mm512_max_ps(s1, _mm512_max_ps(s0, m[i]));
            _mm512_storeu_ps(scores + i * stride + j, s0);
            if (two) _mm512_storeu_ps(scores + i * stride + j + 16, s1);
        }
    }
    store_peaks8(m, peaks);
}

/* The weighted sums for bfloat16 weights and values, 4 vectors x 64 dimensions, with the AVX512-BF16 dot
 * product over pairs of keys: weights row i holds bfloat16 weights, key pair jp in the 32 bits at
 * weights[i * stride + jp]; the value tile holds dimension d of keys 2jp and 2jp + 1 in the 32 bits at
 * v2[jp * head_dim + d]. Key pairs [from, to), added to out; products exact, sums in float32. */
static ALWAYS_INLINE void prefill_weigh4_bf16(const uint32_t *weights, int64_t stride, const uint32_t *v2,
                                              int64_t from, int64_t to, int64_t head_dim, float *out) {
    for (int64_t d0 = 0; d0 < head_dim; d0 += 64) {
        __m512 a[4][4];
        for (int i = 0; i < 4; i++)
            for (int c = 0; c < 4; c++) a[i][c] = _mm512_loadu_ps(out + i * head_dim + d0 + 16 * c);
        for (int64_t jp = from; jp < to; jp++) {
            __m512bh x[4];
            for (int c = 0; c < 4; c++) x[c] = (__m512bh)_mm512_loadu_si512(v2 + jp * head_dim + d0 + 16 * c);
            for (int i = 0; i < 4; i++) {
                const __m512bh p = (__m512bh)_mm512_set1_epi32((int)weights[i * stride + jp]);
                for (int c = 0; c < 4; c++) a[i][c] = _mm512_dpbf16_ps(a[i][c], p, x[c]);
            }
        }
        for (int i = 0; i < 4; i++)
            for (int c = 0; c < 4; c++) _mm512_storeu_ps(out + i * head_dim + d0 + 16 * c, a[i][c]);
    }
}

/* A row of n floats (n a multiple of 16) rounded to bfloat16 in place: the bfloat16 row takes the first
 * half of the floats' bytes (each 16 floats are read before their 32 bytes are written). */
static ALWAYS_INLINE void to_bf16_in_place(float *row, int64_t n) {
    for (int64_t j = 0; j < n; j += 16) {
        const __m256i h = float_to_bf16x16(_mm512_loadu_ps(row + j));
        _mm256_storeu_si256((__m256i *)((uint16_t *)row + j), h);
    }
}
#endif

/* The same in plain C, any head_dim. */
static void prefill_scores_c(const float *queries, int64_t m, const float *kt, int64_t stride, int64_t keys,
                             int64_t head_dim, float *scores) {
    for (int64_t i = 0; i < m; i++) {
        float *s = scores + i * stride;
        for (int64_t j = 0; j < keys; j++) s[j] = 0.0f;
        for (int64_t d = 0; d < head_dim; d++) {
            const float x = queries[i * head_dim + d];
            const float *k = kt + d * stride;
#pragma omp simd
            for (int64_t j = 0; j < keys; j++) s[j] += x * k[j];
        }
    }
}

static void prefill_weigh_c(const float *weights, int64_t m, int64_t stride, const float *const *rows, int64_t from,
                            int64_t to, int64_t head_dim, float *out) {
    for (int64_t i = 0; i < m; i++) {
        float *o = out + i * head_dim;
        for (int64_t j = from; j < to; j++) {
            const float p = weights[i * stride + j];
#pragma omp simd
            for (int64_t d = 0; d < head_dim; d++) o[d] += p * rows[j][d];
        }
    }
}

/* Where key `key` of a sequence and KV head `kv_head` lies in the cache, in elements. */
static inline int64_t key_offset(const int32_t *table, int64_t key, int64_t block_size, int64_t num_kv_heads,
                                 int64_t kv_head, int64_t head_dim) {
    const int64_t slot = (int64_t)table[key / block_size] * block_size + key % block_size;
    return (slot * num_kv_heads + kv_head) * head_dim;
}

#if defined(__AVX512F__)
/* r[i] becomes column i of the 16 x 16 matrix of 32-bit elements whose rows are r[0..15]. */
static ALWAYS_INLINE void transpose16x16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int h = 0; h < 2; h++)
        for (int i = 0; i < 4; i++) {
            t[8 * h + i] = _mm512_shuffle_f32x4(r[8 * h + i], r[8 * h + i + 4], 0x88);
            t[8 * h + i + 4] = _mm512_shuffle_f32x4(r[8 * h + i], r[8 * h + i + 4], 0xdd);
        }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
    }
}
#endif

/* Keys [kb, kb + count) of the item (counted from its first key, klo) into the block's tiles: each K row
 * into its column of the transposed tile (bfloat16 key pairs as they lie; float32 keys and key pairs 16
 * keys at a time through a register transpose), each V row into place (bfloat16 value pairs: two keys'
 * rows interleaved); past the last key the K tile is zero up to a whole KEY_PAD, and an odd last key's
 * pair partner too (its weight is zero, and 0 * garbage may be NaN). */
static void prefill_load_keys(const void *k_cache, const void *v_cache, const int32_t *table, int64_t klo, int64_t kb,
                              int64_t count, int64_t kv_head, int64_t num_kv_heads, int64_t head_dim,
                              int64_t block_size, int kv_dtype, int pairs, int value_pairs, struct prefill_tiles *t) {
    uint32_t *kt2 = (uint32_t *)t->kt;
    const int64_t first = klo + kb;
    int64_t j = 0;
#if defined(__AVX512F__)
    /* 32-bit columns of a key row, 16 at a time, when the cache holds them as they go into the tile. */
    const int64_t columns = pairs ? pairs : head_dim;
    if (columns % 16 == 0 && (pairs || kv_dtype == DTYPE_FLOAT32))
        for (; j + 16 <= count; j += 16) {
            const float *rows[16];
            for (int i = 0; i < 16; i++) {
                const int64_t offset = key_offset(table, first + j + i, block_size, num_kv_heads, kv_head, head_dim);
                rows[i] = pairs ? (const float *)((const uint16_t *)k_cache + offset) : (const float *)k_cache + offset;
            }
            for (int64_t c = 0; c < columns; c += 16) {
                __m512 r[16];
                for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(rows[i] + c);
                transpose16x16(r);
                for (int i = 0; i < 16; i++) _mm512_storeu_ps(t->kt + (c + i) * PREFILL_KEYS + j, r[i]);
            }
        }
#endif
    for (; j < count; j++) {
        const int64_t offset = key_offset(table, first + j, block_size, num_kv_heads, kv_head, head_dim);
        if (pairs) {
            const uint32_t *k = (const uint32_t *)((const uint16_t *)k_cache + offset);
            for (int64_t p = 0; p < pairs; p++) kt2[p * PREFILL_KEYS + j] = k[p];
        } else {
            const float *k = row_as_float(k_cache, offset, head_dim, kv_dtype, t->row);
            for (int64_t d = 0; d < head_dim; d++) t->kt[d * PREFILL_KEYS + j] = k[d];
        }
    }
#if defined(__AVX512BF16__)
    if (value_pairs) {
        /* Key 2jp's dimensions in the low halves, key 2jp + 1's in the high halves (zero past the last). */
        uint32_t *v2 = (uint32_t *)t->v;
        for (int64_t jp = 0; 2 * jp < count; jp++) {
            const uint16_t *v0 = (const uint16_t *)v_cache +
                                 key_offset(table, first + 2 * jp, block_size, num_kv_heads, kv_head, head_dim);
            const uint16_t *v1 = 2 * jp + 1 < count ? (const uint16_t *)v_cache + key_offset(table, first + 2 * jp + 1,
                                                                                              block_size, num_kv_heads,
                                                                                              kv_head, head_dim)
                                                    : NULL;
            for (int64_t d = 0; d < head_dim; d += 16) {
                const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(v0 + d)));
                const __m512i hi = v1 ? _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(v1 + d))), 16)
                                      : _mm512_setzero_si512();
                _mm512_storeu_si512(v2 + jp * head_dim + d, _mm512_or_si512(lo, hi));
            }
        }
    }
#endif
    if (!value_pairs)
        for (j = 0; j < count; j++) {
            const int64_t offset = key_offset(table, first + j, block_size, num_kv_heads, kv_head, head_dim);
            t->vrows[j] = row_as_float(v_cache, offset, head_dim, kv_dtype, t->v + j * head_dim);
        }
    /* 0.0f and a zero bfloat16 pair are the same 32 bits. */
    const int64_t kt_rows = pairs ? pairs : head_dim, padded = (count + KEY_PAD - 1) / KEY_PAD * KEY_PAD;
    for (int64_t r = 0; r < kt_rows; r++) memset(t->kt + r * PREFILL_KEYS + count, 0, sizeof(float) * (size_t)(padded - count));
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define AMX_TILES 1
/* ---- prompt attention on the AMX tiles (Intel Sapphire Rapids+) ---------------------------------------
 * Where the CPU has AMX-BF16, a bfloat16 item's scores and weighted sums are tile products: the same tiles
 * as the AVX512-BF16 path (keys transposed in dimension pairs, values in key pairs, weights rounded to
 * bfloat16 in place), read by the tile loads with their strides, 16 query vectors at a time; the online
 * softmax between them runs in AVX-512 on the same running peaks and sums (raise_peak). Eight tile registers of 16 rows x 64 bytes: 0 the left operand
 * (16 vectors x 32 bfloat16), 1-3 the right (16 pairs x 16 columns), 4-7 four 16 x 16 float32 results.
 * Linux hands the tiles' state to a process only after it asks (arch_prctl); without that, or built for
 * another CPU, the items take the AVX512-BF16 path. */
#include <sys/syscall.h>
#include <unistd.h>

enum { ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18, TILE_BYTES = 64, TILE_ROWS = 16 };

static int amx_permission = -1; /* -1: not asked yet; then 1 granted, 0 refused */

static int amx_tiles_permitted(void) {
    if (amx_permission < 0) amx_permission = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return amx_permission;
}

static void amx_configure(void) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t bytes_per_row[16];
        uint8_t rows[16];
    } config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; t++) {
        config.bytes_per_row[t] = TILE_BYTES;
        config.rows[t] = TILE_ROWS;
    }
    _tile_loadconfig(&config);
}

/* c[16 x 64] (+)= a[16 x 32 steps] . b[32 steps x 64] in float32, the products of bfloat16 pairs: row r of
 * a's step s at a + s * a_step + r * a_stride (32 bfloat16), row p of b's step s and its 16-column block q
 * at b + s * b_step + q * TILE_BYTES + p * b_stride (16 pairs); c's rows c_stride bytes apart. With
 * `accumulate`, c's values are the starting sums, else zero. */
static ALWAYS_INLINE void amx_product16x64(const char *a, int64_t a_stride, int64_t a_step, const char *b,
                                           int64_t b_stride, int64_t b_step, int64_t steps, char *c,
                                           int64_t c_stride, int accumulate) {
    if (accumulate) {
        _tile_loadd(4, c, c_stride);
        _tile_loadd(5, c + TILE_BYTES, c_stride);
        _tile_loadd(6, c + 2 * TILE_BYTES, c_stride);
        _tile_loadd(7, c + 3 * TILE_BYTES, c_stride);
    } else {
        _tile_zero(4);
        _tile_zero(5);
        _tile_zero(6);
        _tile_zero(7);
    }
    for (int64_t s = 0; s < steps; s++) {
        const char *bs = b + s * b_step;
        _tile_loadd(0, a + s * a_step, a_stride);
        _tile_loadd(1, bs, b_stride);
        _tile_dpbf16ps(4, 0, 1);
        _tile_loadd(2, bs + TILE_BYTES, b_stride);
        _tile_dpbf16ps(5, 0, 2);
        _tile_loadd(3, bs + 2 * TILE_BYTES, b_stride);
        _tile_dpbf16ps(6, 0, 3);
        _tile_loadd(1, bs + 3 * TILE_BYTES, b_stride);
        _tile_dpbf16ps(7, 0, 1);
    }
    _tile_stored(4, c, c_stride);
    _tile_stored(5, c + TILE_BYTES, c_stride);
    _tile_stored(6, c + 2 * TILE_BYTES, c_stride);
    _tile_stored(7, c + 3 * TILE_BYTES, c_stride);
}

/* Unscaled scores of 16 query vectors (bfloat16 pairs, head_dim / 2 per vector) against the block's keys
 * [0, keys), 64 at a time (scores past `keys` are garbage the softmax never reads). */
static void amx_scores16(const uint32_t *queries, const uint32_t *kt2, int64_t keys, int64_t head_dim, float *scores) {
    const int64_t key_row = PREFILL_KEYS * (int64_t)sizeof(float);
    for (int64_t j = 0; j < keys; j += 64)
        amx_product16x64((const char *)queries, head_dim * 2, TILE_BYTES, (const char *)(kt2 + j), key_row,
                         TILE_ROWS * key_row, head_dim / 32, (char *)(scores + j), key_row, 0);
}

/* 2^x on 16 lanes: x = n + f with |f| <= 1/2, 2^f by a degree-4 polynomial fitted for relative error
 * (below 2.7e-6 over the interval: the weights are then rounded to bfloat16, 2^-9), times 2^n by vscalefps,
 * which gives 0 where 2^n underflows. Finite x only (-inf gives NaN): the callers mask lanes outside a
 * vector's keys after this. One multiply-add fewer than degree 5 was 2-3 % of a long prompt's attention. */
static ALWAYS_INLINE __m512 exp2_16(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(9.5700826495885849e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5917844176292419e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4024744331836700e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9312179088592529e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.9999928474426270e-1f));
    return _mm512_scalef_ps(p, n);
}

/* The largest of s[lo, hi). */
static ALWAYS_INLINE float amx_row_peak(const float *s, int64_t lo, int64_t hi) {
    __m512 m = _mm512_set1_ps(-INFINITY);
    for (int64_t j = lo / 16 * 16; j < hi; j += 16)
        m = _mm512_mask_max_ps(m, lanes_between(j, lo, hi), m, _mm512_loadu_ps(s + j));
    return _mm512_reduce_max_ps(m);
}

/* A vector's weights over the block: e^(scale * s[j] - peak) for j in [lo, hi), else 0, over [0, span)
 * (span a multiple of 16), rounded to bfloat16 in place (the bfloat16 row takes the first half of the
 * floats' bytes); returns the sum of the unrounded weights. */
static ALWAYS_INLINE float amx_row_weights(float *s, int64_t lo, int64_t hi, int64_t span, float scale, float peak) {
    const float log2e = 1.44269504088896341f;
    const __m512 c = _mm512_set1_ps(scale * log2e), b = _mm512_set1_ps(peak * log2e);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < span; j += 16) {
        const __mmask16 keep = lanes_between(j, lo, hi);
        const __m512 p = _mm512_maskz_mov_ps(keep, exp2_16(_mm512_fmsub_ps(_mm512_loadu_ps(s + j), c, b)));
        sum = _mm512_add_ps(sum, p);
        _mm256_storeu_si256((__m256i *)((uint16_t *)s + j), float_to_bf16x16(p));
    }
    return _mm512_reduce_add_ps(sum);
}

/* acc[16 x head_dim] += weights (bfloat16, in place of 16 vectors' scores) . the value pairs, keys [from, to),
 * both multiples of 32 (weights zero past each vector's keys, values zero past the block's). */
static void amx_weigh16(const float *weights, const uint32_t *v2, int64_t from, int64_t to, int64_t head_dim,
                        float *acc) {
    const int64_t weight_row = PREFILL_KEYS * (int64_t)sizeof(float), value_row = head_dim * (int64_t)sizeof(float);
    for (int64_t d = 0; d < head_dim; d += 64)
        amx_product16x64((const char *)((const uint16_t *)weights + from), weight_row, TILE_BYTES,
                         (const char *)(v2 + from / 2 * head_dim + d), value_row, TILE_ROWS * value_row, (to - from) / 32,
                         (char *)(acc + d), value_row, 1);
}
#endif

/* Keys [lo, hi) of a block (its keys [kb, kb + count) of those from klo) that the row at position `position`
 * attends, counted from the block's first: lo >= hi where it attends none of them. */
static ALWAYS_INLINE void vector_keys(int64_t position, int64_t klo, int64_t kb, int64_t count, int64_t window,
                                      int64_t *lo, int64_t *hi) {
    const int64_t begin = window_start(position + 1, window) - klo, end = position + 1 - klo;
    *lo = (begin > kb ? begin : kb) - kb;
    *hi = (end < kb + count ? end : kb + count) - kb;
}

/* Keys [*from, *to) of a block that any row at positions first .. last attends (a later row attends the
 * block's keys up to a later one, and its window starts no earlier). */
static ALWAYS_INLINE void rows_keys(int64_t first, int64_t last, int64_t klo, int64_t kb, int64_t count, int64_t window,
                                    int64_t *from, int64_t *to) {
    int64_t unused;
    vector_keys(first, klo, kb, count, window, from, &unused);
    vector_keys(last, klo, kb, count, window, &unused, to);
}

/* Vector i's scores row of the block and, in *lo and *hi, the block's keys its row (at `position`) attends
 * (vector_keys); where it attends none of them, its `count_padded` weights are zero and the row is NULL. */
static ALWAYS_INLINE float *vector_scores(struct prefill_tiles *t, int64_t i, int64_t position, int64_t klo, int64_t kb,
                                          int64_t count, int64_t count_padded, int64_t window, int64_t *lo,
                                          int64_t *hi) {
    vector_keys(position, klo, kb, count, window, lo, hi);
    float *s = t->scores + i * PREFILL_KEYS;
    if (*lo < *hi) return s;
    memset(s, 0, sizeof(float) * (size_t)count_padded);
    return NULL;
}

/* Vector i's largest score so far, raised to `peak` where that is larger: its sum of weights and running
 * weighted sums are rescaled to the new peak first. Returns the largest score so far. */
static ALWAYS_INLINE float raise_peak(struct prefill_tiles *t, int64_t i, float peak, int64_t head_dim) {
    if (peak > t->peak[i]) {
        if (t->peak[i] > -INFINITY) {
            const float factor = exp_approx(t->peak[i] - peak);
            t->sum[i] *= factor;
            for (int64_t d = 0; d < head_dim; d++) t->acc[i * head_dim + d] *= factor;
        }
        t->peak[i] = peak;
    }
    return t->peak[i];
}

/* Rows [r0, r1) of a prompt, one KV head. Row r sits at position ctx + r and attends keys
 * [key_lo(r), ctx + r + 1), key_lo = 0 or the start of the sliding window. */
static void prefill_item(const void *q, int64_t q_row_stride, const void *k_cache, const void *v_cache,
                         const int32_t *table, int64_t first_row, int64_t ctx, int64_t r0, int64_t r1, int64_t kv_head,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t window,
                         float scale, int dtype, int kv_dtype, int tiles, void *out, float *scratch) {
    const int64_t group = num_heads / num_kv_heads, vectors = (r1 - r0) * group;
    const int64_t padded = padded_vectors(r1 - r0, group);
    const int64_t klo = window_start(ctx + r0 + 1, window);
    const int64_t n = ctx + r1 - klo;
    struct prefill_tiles t;
    t.kt = scratch;
    t.v = t.kt + head_dim * PREFILL_KEYS;
    t.queries = t.v + head_dim * PREFILL_KEYS;
    t.scores = t.queries + padded * head_dim;
    t.acc = t.scores + padded * PREFILL_KEYS;
    t.peak = t.acc + padded * head_dim;
    t.sum = t.peak + padded;
    t.block_peak = t.sum + padded;
    t.row = t.block_peak + padded;
    /* bfloat16 scores by dot product (prefill_scores8_bf16): keys and queries stay bfloat16, in pairs; and
     * weighted sums by dot product over pairs of keys (prefill_weigh4_bf16). */
#if defined(__AVX512BF16__)
    const int pairs = dtype == DTYPE_BFLOAT16 && kv_dtype == DTYPE_BFLOAT16 && head_dim % 32 == 0 ? (int)(head_dim / 2) : 0;
#else
    const int pairs = 0;
#endif
    const int value_pairs = pairs && head_dim % 64 == 0;
    /* Tile products (AMX) where the caller found them usable: they take what the AVX512-BF16 path takes. */
#if defined(AMX_TILES)
    const int amx = tiles && value_pairs;
    if (amx) amx_configure();
#else
    (void)tiles;
    const int amx = 0;
#endif
    uint32_t *q2 = (uint32_t *)t.queries;
    /* The queries: bfloat16 pairs as they lie, or scaled floats; the padding vectors zero. */
    const size_t query_bytes = (pairs ? sizeof(uint16_t) : sizeof(float)) * (size_t)head_dim;
    for (int64_t i = 0; i < padded; i++) {
        void *x = pairs ? (void *)(q2 + i * pairs) : (void *)(t.queries + i * head_dim);
        if (i >= vectors) {
            memset(x, 0, query_bytes);
            continue;
        }
        const int64_t offset = (first_row + r0 + i / group) * q_row_stride + (kv_head * group + i % group) * head_dim;
        if (pairs) {
            memcpy(x, (const uint16_t *)q + offset, query_bytes);
        } else {
            float *xf = (float *)x;
            load_as_float(q, offset, head_dim, dtype, xf);
            for (int64_t d = 0; d < head_dim; d++) xf[d] *= scale;
        }
    }
    memset(t.acc, 0, sizeof(float) * (size_t)(padded * head_dim));
    for (int64_t i = 0; i < vectors; i++) {
        t.peak[i] = -INFINITY;
        t.sum[i] = 0.0f;
    }
    for (int64_t kb = 0; kb < n; kb += PREFILL_KEYS) {
        const int64_t count = n - kb < PREFILL_KEYS ? n - kb : PREFILL_KEYS;
        /* The tiles take keys 32 at a time (16 value pairs). */
        const int64_t pad = amx ? 2 * KEY_PAD : KEY_PAD, count_padded = (count + pad - 1) / pad * pad;
        prefill_load_keys(k_cache, v_cache, table, klo, kb, count, kv_head, num_kv_heads, head_dim, block_size, kv_dtype,
                          pairs, value_pairs, &t);
#if defined(AMX_TILES)
        if (amx) {
            /* Value pairs past the block's zero too (weights there are zero, and 0 * garbage may be NaN). */
            const int64_t loaded = (count + 1) / 2;
            memset((uint32_t *)t.v + loaded * head_dim, 0, sizeof(uint32_t) * (size_t)((count_padded / 2 - loaded) * head_dim));
            /* The three steps each over all the item's vectors (scores, softmax and weighted sums tile by tile
             * instead measured 5-10 % slower). */
            for (int64_t i0 = 0; i0 < vectors; i0 += TILE_ROWS) {
                const int64_t last = i0 + TILE_ROWS < vectors ? i0 + TILE_ROWS - 1 : vectors - 1;
                int64_t lo, hi;
                vector_keys(ctx + r0 + last / group, klo, kb, count, window, &lo, &hi);
                if (hi > 0)
                    amx_scores16(q2 + i0 * pairs, (const uint32_t *)t.kt, hi, head_dim, t.scores + i0 * PREFILL_KEYS);
            }
            for (int64_t i = 0; i < vectors; i++) {
                int64_t lo, hi;
                float *s = vector_scores(&t, i, ctx + r0 + i / group, klo, kb, count, count_padded, window, &lo, &hi);
                if (s == NULL) continue;
                const float peak = raise_peak(&t, i, amx_row_peak(s, lo, hi) * scale, head_dim);
                t.sum[i] += amx_row_weights(s, lo, hi, count_padded, scale, peak);
            }
            for (int64_t i0 = 0; i0 < vectors; i0 += TILE_ROWS) {
                const int64_t last = i0 + TILE_ROWS < vectors ? i0 + TILE_ROWS - 1 : vectors - 1;
                int64_t from, to;
                rows_keys(ctx + r0 + i0 / group, ctx + r0 + last / group, klo, kb, count, window, &from, &to);
                if (to > from)
                    amx_weigh16(t.scores + i0 * PREFILL_KEYS, (const uint32_t *)t.v, from / 32 * 32, (to + 31) / 32 * 32,
                                head_dim, t.acc + i0 * head_dim);
            }
            continue;
        }
#endif
        /* Scores, 8 vectors at a time, over the block's keys that the 8's last row attends. */
        for (int64_t i0 = 0; i0 < vectors; i0 += 8) {
            const int64_t last = i0 + 8 < vectors ? i0 + 7 : vectors - 1;
            const int64_t end = ctx + r0 + last / group + 1 - klo;
            if (end <= kb) continue;
            const int64_t keys = ((end < kb + count ? end : kb + count) - kb + 15) / 16 * 16;
            float *scores = t.scores + i0 * PREFILL_KEYS, *peaks = t.block_peak + i0;
            /* The kernel's peaks are the softmax's where it scores exactly each vector's keys of the block:
             * all of them, for every row of the 8 (the first row attends to the block's end, the last row
             * from its start), and no padding. */
            const int64_t first_end = ctx + r0 + i0 / group + 1 - klo;
            const int64_t last_begin = window_start(ctx + r0 + last / group + 1, window) - klo;
            const int whole = first_end >= kb + count && last_begin <= kb && keys == count;
            for (int i = 0; i < 8; i++) peaks[i] = NAN;
            if (!whole) peaks = NULL;
#if defined(__AVX512BF16__)
            if (pairs) {
                prefill_scores8_bf16(q2 + i0 * pairs, (const uint32_t *)t.kt, PREFILL_KEYS, keys, pairs, scale, scores,
                                     peaks);
                continue;
            }
#endif
#if defined(__AVX512F__)
            if (head_dim % 16 == 0) {
                prefill_scores8(t.queries + i0 * head_dim, t.kt, PREFILL_KEYS, keys, head_dim, scores, peaks);
                continue;
            }
#endif
            prefill_scores_c(t.queries + i0 * head_dim, 8, t.kt, PREFILL_KEYS, keys, head_dim, scores);
        }
        /* Online softmax: each vector's weights over the block's keys of its row, against its largest score
         * so far (a larger one rescales what came before); weights outside the row's keys are zero. */
        for (int64_t i = 0; i < vectors; i++) {
            int64_t lo, hi;
            float *s = vector_scores(&t, i, ctx + r0 + i / group, klo, kb, count, count_padded, window, &lo, &hi);
            if (s == NULL) continue;
            float peak = t.block_peak[i];
            if (isnan(peak)) {
                peak = -INFINITY;
#pragma omp simd reduction(max : peak)
                for (int64_t j = lo; j < hi; j++) peak = s[j] > peak ? s[j] : peak;
            }
            peak = raise_peak(&t, i, peak, head_dim);
#if defined(__AVX512F__)
            t.sum[i] += row_weights16(s, lo, hi, count_padded, peak);
#else
            float sum = 0.0f;
            for (int64_t j = 0; j < lo; j++) s[j] = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t j = lo; j < hi; j++) {
                s[j] = exp_approx(s[j] - peak);
                sum += s[j];
            }
            for (int64_t j = hi; j < count_padded; j++) s[j] = 0.0f;
            t.sum[i] += sum;
#endif
#if defined(__AVX512BF16__)
            if (value_pairs) to_bf16_in_place(s, count_padded);
#endif
        }
        /* Weighted sums, 8 vectors (float) or 4 (bfloat16 pairs) at a time over the block's keys any of them
         * attends. */
#if defined(__AVX512F__)
        const int64_t weigh_step = !value_pairs && head_dim % 32 == 0 ? 8 : 4;
#else
        const int64_t weigh_step = 4;
#endif
        for (int64_t i0 = 0; i0 < vectors; i0 += weigh_step) {
            const int64_t last = i0 + weigh_step < vectors ? i0 + weigh_step - 1 : vectors - 1;
            int64_t from, to;
            rows_keys(ctx + r0 + i0 / group, ctx + r0 + last / group, klo, kb, count, window, &from, &to);
            if (to <= from) continue;
            const float *weights = t.scores + i0 * PREFILL_KEYS;
            float *acc = t.acc + i0 * head_dim;
#if defined(__AVX512BF16__)
            if (value_pairs) {
                prefill_weigh4_bf16((const uint32_t *)weights, PREFILL_KEYS, (const uint32_t *)t.v, from / 2, (to + 1) / 2,
                                    head_dim, acc);
                continue;
            }
#endif
#if defined(__AVX512F__)
            if (weigh_step == 8) {
                prefill_weigh8(weights, PREFILL_KEYS, t.vrows, from, to, head_dim, acc);
                continue;
            }
#endif
            prefill_weigh_c(weights, last - i0 + 1, PREFILL_KEYS, t.vrows, from, to, head_dim, acc);
        }
    }
    for (int64_t r = r0; r < r1; r++)
        for (int64_t h = 0; h < group; h++) {
            const int64_t i = (r - r0) * group + h;
            float *a = t.acc + i * head_dim;
            const float inv = 1.0f / t.sum[i];
            for (int64_t d = 0; d < head_dim; d++) a[d] *= inv;
            store_row(out, ((first_row + r) * num_heads + kv_head * group + h) * head_dim, a, head_dim, dtype);
        }
#if defined(AMX_TILES)
    if (amx) _tile_release();
#endif
}

/* paged_prefill's arguments, for its items. */
struct prefill_call {
    const void *q, *k_cache, *v_cache;
    const int32_t *block_tables;
    const int64_t *prompts, *item_starts;
    int64_t items, rows, q_row_stride, table_stride, num_heads, num_kv_heads, head_dim, block_size, window;
    float scale;
    int dtype, kv_dtype, tiles;
    void *out;
};

/* Item `item` counted from the last: a prompt's last tiles attend the most keys, so they go first. */
static void run_prefill_item(const void *context, int64_t item, float *scratch) {
    const struct prefill_call *c = (const struct prefill_call *)context;
    const int64_t k = c->items - 1 - item;
    int64_t i = 0;
    while (c->item_starts[i + 1] <= k) i++;
    const int64_t *p = c->prompts + i * PROMPT_FIELDS;
    const int64_t local = k - c->item_starts[i], tile = local / c->num_kv_heads, kv_head = local % c->num_kv_heads;
    const int64_t query_len = p[2], seq_len = p[3];
    const int64_t r0 = tile * c->rows, r1 = r0 + c->rows < query_len ? r0 + c->rows : query_len;
    prefill_item(c->q, c->q_row_stride, c->k_cache, c->v_cache, c->block_tables + p[0] * c->table_stride, p[1],
                 seq_len - query_len, r0, r1, kv_head, c->num_heads, c->num_kv_heads, c->head_dim, c->block_size,
                 c->window, c->scale, c->dtype, c->kv_dtype, c->tiles, c->out, scratch);
}

/* 1 where bfloat16 prompt attention multiplies on the AMX tiles: the library was built for a CPU with
 * AMX-BF16 and Linux let this process use them; else 0. */
int prefill_tiles(void) {
#if defined(AMX_TILES)
    return amx_tiles_permitted();
#else
    return 0;
#endif
}

/* Work items of a prompt at `rows` rows an item: its rows' groups times the KV heads. */
static inline int64_t prompt_items(const int64_t *prompt, int64_t rows, int64_t num_kv_heads) {
    return (prompt[2] + rows - 1) / rows * num_kv_heads;
}

/* How many work items n prompts make at `rows` rows an item. */
static int64_t prefill_items(const int64_t *prompts, int64_t n, int64_t rows, int64_t num_kv_heads) {
    int64_t items = 0;
    for (int64_t i = 0; i < n; i++) items += prompt_items(prompts + i * PROMPT_FIELDS, rows, num_kv_heads);
    return items;
}

/* Attention of the new rows of n prompts (query_len > 1), each over its own keys, causally.
 *   prompts     [n, PROMPT_FIELDS]: block table row, first row in q / out, query_len, seq_len
 *   q, out      [T, num_heads, head_dim] (q's rows q_row_stride apart)
 *   window      keys older than `window` positions are skipped (0 = no sliding window)
 *   max_seq_len unused: the scratch holds a block of keys however long the prompts (the argument is
 *               there for the argument list paged_decode shares)
 *   dtype       q's and out's; kv_dtype the caches' (dtype's, or DTYPE_FP8_E4M3)
 * Returns 0, or 1 when scratch memory could not be allocated (out is then incomplete). */
int paged_prefill(const void *q, int64_t q_row_stride, const void *k_cache, const void *v_cache, const int32_t *block_tables,
                  int64_t table_stride, const int64_t *prompts, int64_t n, int64_t num_heads, int64_t num_kv_heads,
                  int64_t head_dim, int64_t block_size, int64_t window, float scale, int dtype, int kv_dtype, void *out,
                  int64_t max_seq_len, int num_threads) {
    (void)max_seq_len;
    const int tiles = prefill_tiles() && dtype == DTYPE_BFLOAT16 && kv_dtype == DTYPE_BFLOAT16 && head_dim % 64 == 0;
    int64_t rows = tiles ? AMX_PREFILL_ROWS : PREFILL_ROWS;
    /* Items of twice the rows where there are still enough of them for the threads. */
    if (prefill_items(prompts, n, 2 * rows, num_kv_heads) >= 8 * (int64_t)num_threads) rows *= 2;
    /* Item k of prompt i is tile k / num_kv_heads, KV head k % num_kv_heads; item_starts: prefix sums. */
    int64_t *item_starts = (int64_t *)malloc(sizeof(int64_t) * (size_t)(n + 1));
    if (item_starts == NULL) return 1;
    item_starts[0] = 0;
    for (int64_t i = 0; i < n; i++)
        item_starts[i + 1] = item_starts[i] + prompt_items(prompts + i * PROMPT_FIELDS, rows, num_kv_heads);
    const struct prefill_call call = {
        .q = q, .k_cache = k_cache, .v_cache = v_cache, .block_tables = block_tables, .prompts = prompts,
        .item_starts = item_starts, .items = item_starts[n], .q_row_stride = q_row_stride,
        .table_stride = table_stride, .num_heads = num_heads, .num_kv_heads = num_kv_heads, .head_dim = head_dim,
        .block_size = block_size, .window = window, .scale = scale, .dtype = dtype, .kv_dtype = kv_dtype,
        .rows = rows, .tiles = tiles, .out = out};
    const int failed = run_items(item_starts[n], prefill_scratch_floats(rows, num_heads / num_kv_heads, head_dim),
                                 num_threads, run_prefill_item, &call);
    free(item_starts);
    return failed;
}

/* ---- the model's elementwise steps ---------------------------------------------------------------- */

#if defined(__AVX512F__)
/* One bfloat16 row of rms_norm (below) held in registers, 16 elements at a time: hidden % 16 == 0. The
 * same roundings as the tiled path; the squares are summed in 16 lanes, then across them. */
static void rms_norm_row_bf16x16(const uint16_t *x, uint16_t *residual, const uint16_t *weight, uint16_t *out,
                                 int64_t hidden, float eps) {
    __m512 sum_sq = _mm512_setzero_ps();
    for (int64_t i = 0; i < hidden; i += 16) {
        __m512 h = bf16x16_load(x + i);
        if (residual) {
            h = round_bf16x16(_mm512_add_ps(h, bf16x16_load(residual + i)));
            bf16x16_store(residual + i, h);
        }
        sum_sq = _mm512_fmadd_ps(h, h, sum_sq);
    }
    const uint16_t *src = residual ? residual : x;
    const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(sum_sq) / (float)hidden + eps));
    for (int64_t i = 0; i < hidden; i += 16) {
        const __m512 normed = round_bf16x16(_mm512_mul_ps(bf16x16_load(src + i), inv));
        bf16x16_store(out + i, _mm512_mul_ps(normed, bf16x16_load(weight + i)));
    }
}

/* One bfloat16 row of silu_and_mul (below) in registers: width % 16 == 0. */
static void silu_and_mul_row_bf16x16(const uint16_t *gate, const uint16_t *up, uint16_t *out, int64_t width) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t i = 0; i < width; i += 16) {
        const __m512 g = bf16x16_load(gate + i);
        const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one, exp_approx16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        bf16x16_store(out + i, _mm512_mul_ps(round_bf16x16(silu), bf16x16_load(up + i)));
    }
}
#endif

/* out = weight * x / sqrt(mean(x^2) + eps), row by row over [rows, hidden].
 * With `residual` (not NULL): residual = x + residual first (in place), and it is what is normalized:
 * the decoder's "add the sublayer's output, then normalize" in one pass. bfloat16 rounds where torch
 * would: the sum, the normalized value, the product with the weight. */
void rms_norm(const void *x, void *residual, const void *weight, void *out, int64_t rows, int64_t hidden,
              float eps, int dtype, int num_threads) {
#pragma omp parallel for num_threads(threads_for(rows * hidden, num_threads)) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t base = r * hidden;
        float sum_sq = 0.0f;
        if (dtype == DTYPE_FLOAT32) {
            const float *xr = (const float *)x + base;
            float *res = residual ? (float *)residual + base : NULL;
            if (res) {
#pragma omp simd reduction(+ : sum_sq)
                for (int64_t i = 0; i < hidden; i++) {
                    res[i] += xr[i];
                    sum_sq += res[i] * res[i];
                }
                xr = res;
            } else {
#pragma omp simd reduction(+ : sum_sq)
                for (int64_t i = 0; i < hidden; i++) sum_sq += xr[i] * xr[i];
            }
            const float inv = 1.0f / sqrtf(sum_sq / (float)hidden + eps);
            const float *w = (const float *)weight;
            float *o = (float *)out + base;
#pragma omp simd
            for (int64_t i = 0; i < hidden; i++) o[i] = w[i] * (xr[i] * inv);
        } else {
            const uint16_t *xr = (const uint16_t *)x + base;
            uint16_t *res = residual ? (uint16_t *)residual + base : NULL;
#if defined(__AVX512F__)
            if (hidden % 16 == 0) {
                rms_norm_row_bf16x16(xr, res, (const uint16_t *)weight, (uint16_t *)out + base, hidden, eps);
                continue;
            }
#endif
            float a[TILE], b[TILE];
            uint16_t tmp[TILE];
            for (int64_t i0 = 0; i0 < hidden; i0 += TILE) {
                const int64_t n = hidden - i0 < TILE ? hidden - i0 : TILE;
                bf16_to_float_n(xr + i0, a, n);
                if (res) {
                    bf16_to_float_n(res + i0, b, n);
#pragma omp simd
                    for (int64_t i = 0; i < n; i++) a[i] += b[i];
                    float_to_bf16_n(a, res + i0, n);
                    bf16_to_float_n(res + i0, a, n);
                }
#pragma omp simd reduction(+ : sum_sq)
                for (int64_t i = 0; i < n; i++) sum_sq += a[i] * a[i];
            }
            const uint16_t *src = res ? res : xr;
            const float inv = 1.0f / sqrtf(sum_sq / (float)hidden + eps);
            const uint16_t *w = (const uint16_t *)weight;
            uint16_t *o = (uint16_t *)out + base;
            for (int64_t i0 = 0; i0 < hidden; i0 += TILE) {
                const int64_t n = hidden - i0 < TILE ? hidden - i0 : TILE;
                bf16_to_float_n(src + i0, a, n);
#pragma omp simd
                for (int64_t i = 0; i < n; i++) a[i] *= inv;
                round_to_bf16_n(a, tmp, n);
                bf16_to_float_n(w + i0, b, n);
#pragma omp simd
                for (int64_t i = 0; i < n; i++) a[i] *= b[i];
                float_to_bf16_n(a, o + i0, n);
            }
        }
    }
}

/* out[r] = silu(gate[r]) * up[r] where gate_up[r] = [gate (width) | up (width)]; out is [rows, width]. */
void silu_and_mul(const void *gate_up, void *out, int64_t rows, int64_t width, int dtype, int num_threads) {
#pragma omp parallel for num_threads(threads_for(rows * width, num_threads)) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        if (dtype == DTYPE_FLOAT32) {
            const float *g = (const float *)gate_up + r * 2 * width, *u = g + width;
            float *o = (float *)out + r * width;
#pragma omp simd
            for (int64_t i = 0; i < width; i++) o[i] = g[i] / (1.0f + exp_approx(-g[i])) * u[i];
        } else {
            const uint16_t *g = (const uint16_t *)gate_up + r * 2 * width, *u = g + width;
            uint16_t *o = (uint16_t *)out + r * width;
#if defined(__AVX512F__)
            if (width % 16 == 0) {
                silu_and_mul_row_bf16x16(g, u, o, width);
                continue;
            }
#endif
            float a[TILE], b[TILE];
            uint16_t tmp[TILE];
            for (int64_t i0 = 0; i0 < width; i0 += TILE) {
                const int64_t n = width - i0 < TILE ? width - i0 : TILE;
                bf16_to_float_n(g + i0, a, n);
#pragma omp simd
                for (int64_t i = 0; i < n; i++) a[i] = a[i] / (1.0f + exp_approx(-a[i]));
                round_to_bf16_n(a, tmp, n); /* torch's silu output is bfloat16 */
                bf16_to_float_n(u + i0, b, n);
#pragma omp simd
                for (int64_t i = 0; i < n; i++) a[i] *= b[i];
                float_to_bf16_n(a, o + i0, n);
            }
        }
    }
}

/* Rotary embedding (rotate-half form), in place on the first `heads` heads of each row of x:
 * x is [rows, row_stride] (the fused q|k|v projection: q and k heads come first), cos and sin are float32
 * [rows, head_dim / 2]. Each head's halves (a, b) become (a cos - b sin, b cos + a sin). */
void rotary(void *x, int64_t row_stride, const float *cos, const float *sin, int64_t rows, int64_t heads,
            int64_t head_dim, int dtype, int num_threads) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for num_threads(threads_for(rows * heads * head_dim, num_threads)) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos + r * half, *s = sin + r * half;
        for (int64_t h = 0; h < heads; h++) {
            const int64_t base = r * row_stride + h * head_dim;
            if (dtype == DTYPE_FLOAT32) {
                float *a = (float *)x + base, *b = a + half;
#pragma omp simd
                for (int64_t i = 0; i < half; i++) {
                    const float ai = a[i], bi = b[i];
                    a[i] = ai * c[i] - bi * s[i];
                    b[i] = bi * c[i] + ai * s[i];
                }
            } else {
                uint16_t *a = (uint16_t *)x + base, *b = a + half;
                float fa[TILE], fb[TILE], ra[TILE], rb[TILE];
                for (int64_t i0 = 0; i0 < half; i0 += TILE) {
                    const int64_t n = half - i0 < TILE ? half - i0 : TILE;
                    const float *ci = c + i0, *si = s + i0;
                    bf16_to_float_n(a + i0, fa, n);
                    bf16_to_float_n(b + i0, fb, n);
#pragma omp simd
                    for (int64_t i = 0; i < n; i++) {
                        ra[i] = fa[i] * ci[i] - fb[i] * si[i];
                        rb[i] = fb[i] * ci[i] + fa[i] * si[i];
                    }
                    float_to_bf16_n(ra, a + i0, n);
                    float_to_bf16_n(rb, b + i0, n);
                }
            }
        }
    }
}

/* ---- products of a few rows with float weights -------------------------------------------------------
 * out = x W^T (+ bias) for x [rows, k], rows <= DENSE_BFLOAT16_ROWS for bfloat16 and DENSE_FLOAT32_ROWS for
 * float32 (a decode step of one to a few dozen sequences),
 * W [n, k] float32 or bfloat16 as the checkpoint holds it (row-major, one row per output). oneDNN's GEMM
 * runs these shapes at about half of the memory's speed (docs/benchmarks.md); here each weight row is read
 * from memory once, four rows at a time, and multiplied into up to DENSE_MAX_ROWS x rows while it is in
 * registers. More x rows take their own loop (dense_linear_wide), so that the code of the one-to-four-row
 * loop (batch 1's) stays what it was: up to DENSE_PASS_ROWS x rows in one pass over each tile of weight
 * rows, the rest in more passes over the same tile, from L1 or L2.
 *
 * The arithmetic is fixed, whatever the thread count or the number of rows, so a row's output does not
 * depend on the other rows of the batch. Each output sums in float32 over 16 lanes, then adds the lanes in
 * a fixed tree (lanes_sum), adds the bias, and a bfloat16 output rounds that to nearest even. float32: lane
 * l takes the products of columns c = l (mod 16) in column order, by fused multiply-add. bfloat16 (the
 * AVX512-BF16 dot product's order): lane l takes, for each 32 columns from c0, the product of column
 * c0 + 2l + 1 and then of column c0 + 2l, each exact in float32 and added with one rounding; values and
 * sums below float32's normal range (1.2e-38) count as zero there, as the instruction has them. Columns
 * past k count as 0 * 0. The AVX-512 path, and the float32 one for AVX2 without AVX-512 (dense_linear_avx2),
 * are bit-identical to the plain C one (tests/engine/test_dense_linear.py); the engine runs only those
 * (dense_linear_max_rows). */

/* DENSE_MAX_ROWS (DENSE_PASS_ROWS in the wide loop) x rows times DENSE_TILE weight rows: the register tile.
 * DENSE_FLOAT32_ROWS: float32 takes up to 24 rows, DENSE_PASS_ROWS at a time over each tile of weight rows:
 * with a decode step's layers in one C call, SmolLM2's float32 steps of 12-24 rows took 12-28 % less time
 * than with oneDNN's products (32 rows level, 64 rows 15 % more). DENSE_BFLOAT16_ROWS: bfloat16 (on the
 * AVX512-BF16 path) up to 16 rows the same way. On AMD Zen 4, with the layers in one C call, llama-1b's decode
 * steps of 10-16 rows took 6-24 % less time than with oneDNN's products and SmolLM2's of 12-16 rows 20-36 %
 * less; at 24 rows llama-1b's took 3-6 % more (SmolLM2's still 10-25 % less). Until 7 December the limit was
 * 8, from a measurement of 5 December that did not name its CPU (docs/benchmarks.md). */
enum {
    DENSE_MAX_ROWS = 4,
    DENSE_PASS_ROWS = 6,
    DENSE_BFLOAT16_ROWS = 16,
    DENSE_FLOAT32_ROWS = 24,
    DENSE_TILE = 4,
    DENSE_PREFETCH_BYTES = 8192,
    DENSE_STREAM_PREFETCH_BYTES = 2048
};

/* s[0] + ... + s[15] in the tree the vector path adds them in: lanes i and i + 8, then i + 4, i + 2, i + 1. */
static inline float lanes_sum(float s[16]) {
    for (int width = 8; width >= 1; width /= 2)
        for (int i = 0; i < width; i++) s[i] += s[i + width];
    return s[0];
}

/* f, or a zero of its sign below float32's normal range (AVX512-BF16's treatment of denormals). */
static inline float flush_denormal(float f) { return fabsf(f) < 0x1p-126f ? copysignf(0.0f, f) : f; }

/* Element c of a bfloat16 row of k as the dot product reads it: 0 past k, denormals as zero. */
static inline float dense_bf16_at(const uint16_t *row, int64_t k, int64_t c) {
    return c < k ? flush_denormal(bf16_to_float(row[c])) : 0.0f;
}

/* sums[r * DENSE_TILE + t] = x row r . W row n0 + t, for r < rows and t < outs: the plain C version. */
static void dense_tile_plain(const void *x, int64_t rows, int64_t k, const void *w, int bf16, int64_t n0,
                             int64_t outs, float *sums) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t t = 0; t < outs; t++) {
            float lane[16] = {0.0f};
            if (bf16) {
                const uint16_t *xr = (const uint16_t *)x + r * k, *wr = (const uint16_t *)w + (n0 + t) * k;
                for (int64_t c0 = 0; c0 < k; c0 += 32)
                    for (int l = 0; l < 16; l++)
                        for (int64_t c = c0 + 2 * l + 1; c >= c0 + 2 * l; c--)
                            lane[l] = flush_denormal(lane[l] + dense_bf16_at(xr, k, c) * dense_bf16_at(wr, k, c));
            } else {
                const float *xr = (const float *)x + r * k, *wr = (const float *)w + (n0 + t) * k;
                for (int64_t c0 = 0; c0 < k; c0 += 16)
                    for (int l = 0; l < 16; l++) {
                        const int64_t c = c0 + l;
                        lane[l] = fmaf(c < k ? xr[c] : 0.0f, c < k ? wr[c] : 0.0f, lane[l]);
                    }
            }
            sums[r * DENSE_TILE + t] = lanes_sum(lane);
        }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define DENSE_FLOAT32_VECTOR 1
#if defined(__AVX512BF16__)
#define DENSE_BFLOAT16_VECTOR 1
#endif

static ALWAYS_INLINE float dense_reduce(__m512 v) {
    const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v),
                                   _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
    return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
}

#define DENSE_TILE16 dense_tile16
#define DENSE_TILE16_ROWS DENSE_MAX_ROWS
#include "dense_tile16.h"
#undef DENSE_TILE16
#undef DENSE_TILE16_ROWS
#define DENSE_TILE16 dense_tile16_wide
#define DENSE_TILE16_ROWS DENSE_PASS_ROWS
#include "dense_tile16.h"
#undef DENSE_TILE16
#undef DENSE_TILE16_ROWS

/* dense_tile16 for ROWS rows, the dtype and the tile's width made constants. */
#define DENSE_TILE_CASE(ROWS)                                                                  \
    case ROWS:                                                                                 \
        for (int64_t t = 0; t < outs; t += outs == DENSE_TILE ? DENSE_TILE : 1) {              \
            float one[DENSE_MAX_ROWS * DENSE_TILE];                                            \
            if (outs == DENSE_TILE && bf16) dense_tile16(x, ROWS, k, w, 1, n0, DENSE_TILE, one);  \
            else if (outs == DENSE_TILE) dense_tile16(x, ROWS, k, w, 0, n0, DENSE_TILE, one);  \
            else if (bf16) dense_tile16(x, ROWS, k, w, 1, n0 + t, 1, one);                     \
            else dense_tile16(x, ROWS, k, w, 0, n0 + t, 1, one);                               \
            for (int r = 0; r < ROWS; r++)                                                     \
                for (int64_t j = 0; j < (outs == DENSE_TILE ? DENSE_TILE : 1); j++)            \
                    sums[r * DENSE_TILE + t + j] = one[r * DENSE_TILE + j];                    \
        }                                                                                      \
        return;

/* dense_tile16_wide for ROWS rows (DENSE_MAX_ROWS < ROWS <= DENSE_PASS_ROWS), the dtype and the tile's
 * width made constants. */
#define DENSE_PASS_CASE(ROWS)                                                                  \
    case ROWS:                                                                                 \
        for (int64_t t = 0; t < outs; t += outs == DENSE_TILE ? DENSE_TILE : 1) {              \
            if (outs == DENSE_TILE && bf16) dense_tile16_wide(x, ROWS, k, w, 1, n0, DENSE_TILE, sums); \
            else if (outs == DENSE_TILE) dense_tile16_wide(x, ROWS, k, w, 0, n0, DENSE_TILE, sums); \
            else if (bf16) dense_tile16_wide(x, ROWS, k, w, 1, n0 + t, 1, sums + t);           \
            else dense_tile16_wide(x, ROWS, k, w, 0, n0 + t, 1, sums + t);                     \
        }                                                                                      \
        return 1;
#endif

#if !defined(DENSE_FLOAT32_VECTOR) && defined(__AVX2__) && defined(__FMA__)
#define DENSE_FLOAT32_AVX2 1 /* float32 on AVX2 + FMA without AVX-512: dense_linear_avx2, below */
#endif

/* The products of one tile of outputs, n0 .. n0 + outs - 1 (outs <= DENSE_TILE), for every row. */
static void dense_tile(const void *x, int64_t rows, int64_t k, const void *w, int bf16, int64_t n0, int64_t outs,
                       float *sums) {
#if defined(DENSE_FLOAT32_VECTOR)
#if !defined(DENSE_BFLOAT16_VECTOR)
    if (!bf16)
#endif
        switch (rows) {
            DENSE_TILE_CASE(1)
            DENSE_TILE_CASE(2)
            DENSE_TILE_CASE(3)
            DENSE_TILE_CASE(4)
        }
#endif
    dense_tile_plain(x, rows, k, w, bf16, n0, outs, sums);
}

/* The products of one tile of outputs for DENSE_MAX_ROWS < rows <= DENSE_PASS_ROWS in one pass over the
 * weights (rows x DENSE_TILE accumulators, 24 of the 32 vector registers at most): 1, or 0 where this build
 * does not vectorize the dtype. */
static ALWAYS_INLINE int dense_tile_pass(const void *x, int64_t rows, int64_t k, const void *w, int bf16,
                                         int64_t n0, int64_t outs, float *sums) {
#if defined(DENSE_FLOAT32_VECTOR)
#if !defined(DENSE_BFLOAT16_VECTOR)
    if (!bf16)
#endif
        switch (rows) {
            DENSE_PASS_CASE(5)
            DENSE_PASS_CASE(6)
        }
#else
    (void)x, (void)rows, (void)k, (void)w, (void)bf16, (void)n0, (void)outs, (void)sums;
#endif
    return 0;
}

/* dense_tile for DENSE_MAX_ROWS < rows <= DENSE_FLOAT32_ROWS: DENSE_PASS_ROWS rows or fewer a pass over the
 * tile's weight rows (from memory the first time, then from L1 or L2), the last one to four by dense_tile.
 * Not vectorized, dense_tile DENSE_MAX_ROWS rows at a time (dense_tile_plain called here too would no
 * longer be inlined into dense_tile, changing the one-to-four-row code). */
static void dense_tile_wide(const void *x, int64_t rows, int64_t k, const void *w, int bf16, int64_t n0,
                            int64_t outs, float *sums) {
    const int64_t row_bytes = k * (bf16 ? 2 : 4);
    int64_t done = 0;
    while (rows - done > DENSE_MAX_ROWS) {
        const char *xs = (const char *)x + done * row_bytes;
        int64_t pass = rows - done < DENSE_PASS_ROWS ? rows - done : DENSE_PASS_ROWS;
        if (!dense_tile_pass(xs, pass, k, w, bf16, n0, outs, sums + done * DENSE_TILE)) {
            pass = DENSE_MAX_ROWS;
            dense_tile(xs, pass, k, w, bf16, n0, outs, sums + done * DENSE_TILE);
        }
        done += pass;
    }
    if (done < rows)
        dense_tile((const char *)x + done * row_bytes, rows - done, k, w, bf16, n0, outs, sums + done * DENSE_TILE);
}

#if defined(AMX_TILES)
/* ---- products of more rows with bfloat16 weights on the AMX tiles (Sapphire Rapids+) ------------------
 * From DENSE_MAX_ROWS + 1 rows up to AMX_LINEAR_MAX_ROWS (decode steps of five to 64 sequences), bfloat16
 * products on CPUs with AMX-BF16 are tile products on the plain weight as the checkpoint holds it, no
 * packed copy: out^T = W x^T. 32 weight rows at a time (tiles of 16 rows x 32 columns, loaded with the
 * weight's row stride) times x's rows transposed in column pairs (xt: built once a call, each 16 x 16 pair
 * tile contiguous) into float32 tiles: up to 32 rows of x a pass over two weight tiles (amx_weight_rows),
 * or 48-64 a pass over one (amx_weight_rows16, for long weight rows; AMX_SHORT). The weight rows are
 * prefetched into L1 a few steps ahead of their tile loads, across into the next 32 rows: a tile load has
 * to wait for the products that still read its register, so one from memory or L2 stalls them. The
 * float32 tiles are transposed back in AVX-512 and stored with the bias in out's dtype, as dense_linear's
 * stores do. Against oneDNN's products: SmolLM2's bfloat16 decode steps of 8 to 64 rows took 22-33 % less
 * time, llama-1b's offline run 1.18x the tokens/s (docs/benchmarks.md).
 *
 * Each output is the tile instruction's float32 sum over k, 32 columns a step in column order (bfloat16
 * pairs' products, denormals as zero): a row's result does not depend on the other rows or the thread
 * count. It is not the AVX-512 arithmetic (16 lanes, then a tree), so a row's output moves in the last bits
 * between a step of four rows and one of five, as it did with oneDNN above eight. k must be a multiple of
 * 32 (dense_linear_max_rows says DENSE_BFLOAT16_ROWS otherwise). */
/* AMX_AHEAD: how many steps (64 bytes of each weight row) ahead the weights are prefetched into L1: 4, 8 and
 * 16 measured, 4 the fastest. AMX_SHORT: below this many inputs, 33-64 rows of x go in two passes of 32
 * over each 32 weight rows (the rows from L1 the second time) instead of one pass over each 16 (x's tiles
 * from L2 for every 16 weight rows), which gave SmolLM2's 576-input products 10-20 % more speed at 64
 * rows and llama-1b's 2048-8192-input ones 11-27 % less. */
enum { AMX_LINEAR_MAX_ROWS = 64, AMX_LINEAR_COLUMNS = 64, AMX_AHEAD = 4, AMX_SHORT = 1024 };

/* x's rows transposed in column pairs for the tile products, 16 x 16 pairs at a time through a register
 * transpose: tile (s, q) (1024 bytes at xt + (s * cols / 16 + q) * 256) holds in its row i, column j x's row
 * 16q + j, columns 32s + 2i and 32s + 2i + 1 (one 32-bit pair), zero for rows past `rows`; each tile is
 * contiguous so that its load reads 1024 bytes in order. This call: the tiles of step s = p0 / 16. */
static void amx_pairs_transposed(const uint16_t *x, int64_t rows, int64_t k, int64_t cols, int64_t p0, uint32_t *xt) {
    const uint32_t *x2 = (const uint32_t *)x;
    for (int64_t r0 = 0; r0 < cols; r0 += 16) {
        __m512 r[16];
        for (int i = 0; i < 16; i++)
            r[i] = r0 + i < rows ? _mm512_loadu_ps((const float *)(x2 + (r0 + i) * (k / 2) + p0)) : _mm512_setzero_ps();
        transpose16x16(r);
        uint32_t *tile = xt + (p0 / 16 * (cols / 16) + r0 / 16) * 256;
        for (int i = 0; i < 16; i++) _mm512_store_ps((float *)(tile + i * 16), r[i]);
    }
}

/* The weight rows' 64 bytes at step t (32 columns) into L1: `rows` rows of `a` for t < steps, then of `next`
 * (rows of the same length; NULL: none). */
static ALWAYS_INLINE void amx_prefetch_step(const char *a, const char *next, int64_t t, int64_t steps,
                                            int64_t stride, const int rows) {
    const char *at = NULL;
    if (t < steps) at = a + t * TILE_BYTES;
    else if (next != NULL && t - steps < steps) at = next + (t - steps) * TILE_BYTES;
    if (at != NULL)
        for (int j = 0; j < rows; j++) _mm_prefetch(at + j * stride, _MM_HINT_T0);
}

/* c[32 x 16 * XTILES] = a[32 weight rows x k] . xt[k / 2 pairs x 16 * XTILES] (XTILES 1 or 2; c's rows
 * AMX_LINEAR_COLUMNS floats apart): tiles 4 and 6 the sums of weight rows 0-15 and 16-31 with x's columns
 * 0-15, 5 and 7 with columns 16-31; 0-1 the weights, 2-3 the transposed x: each tile loaded per step serves
 * XTILES or two products. The weight rows are prefetched AMX_AHEAD steps ahead, into the 32 rows at `next`
 * (NULL: none). */
static ALWAYS_INLINE void amx_weight_rows(const char *a, int64_t k, const char *xt, int64_t xt_step, const char *next,
                                          float *c, const int xtiles) {
    _tile_zero(4);
    _tile_zero(6);
    if (xtiles > 1) {
        _tile_zero(5);
        _tile_zero(7);
    }
    const int64_t a_stride = k * 2, second = 16 * a_stride, steps = k / 32;
    for (int64_t s = 0; s < steps; s++) {
        const char *b = xt + s * xt_step;
        amx_prefetch_step(a, next, s + AMX_AHEAD, steps, a_stride, 32);
        _tile_loadd(0, a + s * TILE_BYTES, a_stride);
        _tile_loadd(2, b, TILE_BYTES);
        _tile_dpbf16ps(4, 0, 2);
        if (xtiles > 1) {
            _tile_loadd(3, b + 1024, TILE_BYTES);
            _tile_dpbf16ps(5, 0, 3);
        }
        _tile_loadd(1, a + second + s * TILE_BYTES, a_stride);
        _tile_dpbf16ps(6, 1, 2);
        if (xtiles > 1) _tile_dpbf16ps(7, 1, 3);
    }
    const int64_t c_stride = AMX_LINEAR_COLUMNS * (int64_t)sizeof(float);
    _tile_stored(4, c, c_stride);
    _tile_stored(6, c + 16 * AMX_LINEAR_COLUMNS, c_stride);
    if (xtiles > 1) {
        _tile_stored(5, c + 16, c_stride);
        _tile_stored(7, c + 16 * AMX_LINEAR_COLUMNS + 16, c_stride);
    }
}

/* c[16 x 16 * XTILES] = a[16 weight rows x k] . xt[k / 2 pairs x 16 * XTILES] (XTILES 3 or 4): tiles 4-7 the
 * sums, 0 the weights (each loaded once for XTILES products), 1-3 the transposed x in turn. The weight rows
 * are prefetched AMX_AHEAD steps ahead, into the 16 rows at `next` (NULL: none). */
static ALWAYS_INLINE void amx_weight_rows16(const char *a, int64_t k, const char *xt, int64_t xt_step, const char *next,
                                            float *c, const int xtiles) {
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    if (xtiles > 3) _tile_zero(7);
    const int64_t a_stride = k * 2, steps = k / 32;
    for (int64_t s = 0; s < steps; s++) {
        const char *b = xt + s * xt_step;
        amx_prefetch_step(a, next, s + AMX_AHEAD, steps, a_stride, 16);
        _tile_loadd(0, a + s * TILE_BYTES, a_stride);
        _tile_loadd(1, b, TILE_BYTES);
        _tile_dpbf16ps(4, 0, 1);
        _tile_loadd(2, b + 1024, TILE_BYTES);
        _tile_dpbf16ps(5, 0, 2);
        _tile_loadd(3, b + 2048, TILE_BYTES);
        _tile_dpbf16ps(6, 0, 3);
        if (xtiles > 3) {
            _tile_loadd(1, b + 3072, TILE_BYTES);
            _tile_dpbf16ps(7, 0, 1);
        }
    }
    const int64_t c_stride = AMX_LINEAR_COLUMNS * (int64_t)sizeof(float);
    _tile_stored(4, c, c_stride);
    _tile_stored(5, c + 16, c_stride);
    _tile_stored(6, c + 32, c_stride);
    if (xtiles > 3) _tile_stored(7, c + 48, c_stride);
}

/* Rows 0 .. count - 1 of out [rows, n], outputs n0 .. n0 + outs - 1: c's columns (transposed) plus the
 * bias, rounded to bfloat16; out bfloat16, or float32 holding the rounded values. */
static void amx_store(const float *c, int64_t count, int64_t n, int64_t n0, int64_t outs,
                      const uint16_t *bias, void *out, int out_bf16) {
    const __mmask16 live = outs >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << outs) - 1u);
    const __m512 b = bias == NULL ? _mm512_setzero_ps()
                                  : bf16x16_to_float(_mm256_maskz_loadu_epi16(live, bias + n0));
    for (int64_t q = 0; q < count; q += 16) {
        __m512 r[16];
        for (int i = 0; i < 16; i++) r[i] = _mm512_load_ps(c + i * AMX_LINEAR_COLUMNS + q);
        transpose16x16(r);
        const int64_t last = count - q < 16 ? count - q : 16;
        for (int64_t m = 0; m < last; m++) {
            const __m256i v = float_to_bf16x16(_mm512_add_ps(r[m], b));
            const int64_t at = (q + m) * n + n0;
            if (out_bf16) _mm256_mask_storeu_epi16((uint16_t *)out + at, live, v);
            else _mm512_mask_storeu_ps((float *)out + at, live, bf16x16_to_float(v));
        }
    }
}

/* dense_linear for bfloat16 and DENSE_MAX_ROWS < rows <= AMX_LINEAR_MAX_ROWS (see above): 0, or -1 where a
 * buffer could not be allocated. */
static int amx_linear(const uint16_t *x, int64_t rows, int64_t k, const uint16_t *w, int64_t n, const uint16_t *bias,
                      void *out, int out_bf16, int num_threads) {
    const int64_t cols = (rows + 15) / 16 * 16, units = (n + 31) / 32;
    uint32_t *xt = aligned_alloc(64, (size_t)(k / 2 * cols) * sizeof(uint32_t));
    if (xt == NULL) return -1;
    int failed = 0;
#pragma omp parallel num_threads(threads_for(n * k, num_threads)) reduction(| : failed)
    {
#pragma omp for schedule(static)
        for (int64_t p0 = 0; p0 < k / 2; p0 += 16) amx_pairs_transposed(x, rows, k, cols, p0, xt);
        amx_configure();
        float c[32 * AMX_LINEAR_COLUMNS] __attribute__((aligned(64)));
        uint16_t *padded = NULL; /* the last 32 weight rows, zero past n, where n is not a multiple of 32 */
#pragma omp for schedule(static)
        for (int64_t unit = 0; unit < units; unit++) {
            const int64_t n0 = unit * 32, outs = n - n0 < 32 ? n - n0 : 32;
            const char *a = (const char *)(w + n0 * k);
            if (outs < 32) {
                if (padded == NULL) padded = calloc((size_t)(32 * k), sizeof(uint16_t));
                if (padded == NULL) {
                    failed = 1;
                    continue;
                }
                memcpy(padded, a, (size_t)(outs * k) * sizeof(uint16_t));
                a = (const char *)padded;
            }
            const char *next = n - n0 >= 64 ? a + 64 * k : NULL;
            if (cols <= 32 || k < AMX_SHORT)
                for (int64_t m = 0; m < cols; m += 32) { /* the second pass's rows are in cache */
                    const char *ahead = m + 32 >= cols ? next : NULL, *xm = (const char *)(xt + m * 16);
                    if (cols - m == 16) amx_weight_rows(a, k, xm, cols * 64, ahead, c + m, 1);
                    else amx_weight_rows(a, k, xm, cols * 64, ahead, c + m, 2);
                }
            else {
                const char *half = a + 32 * k;
                const int xtiles = (int)(cols / 16);
                amx_weight_rows16(a, k, (const char *)xt, cols * 64, half, c, xtiles);
                amx_weight_rows16(half, k, (const char *)xt, cols * 64, next, c + 16 * AMX_LINEAR_COLUMNS, xtiles);
            }
            amx_store(c, rows, n, n0, outs < 16 ? outs : 16, bias, out, out_bf16);
            if (outs > 16) amx_store(c + 16 * AMX_LINEAR_COLUMNS, rows, n, n0 + 16, outs - 16, bias, out, out_bf16);
        }
        free(padded);
        _tile_release();
    }
    free(xt);
    return failed ? -1 : 0;
}

/* Whether dense_linear multiplies `rows` rows of bfloat16 on the AMX tiles, by k columns. */
static int amx_linear_takes(int dtype, int64_t rows, int64_t k) {
    return dtype == DTYPE_BFLOAT16 && rows > DENSE_MAX_ROWS && rows <= AMX_LINEAR_MAX_ROWS && k % 32 == 0 &&
           amx_tiles_permitted();
}
#endif

/* How many rows dense_linear takes for weights of `dtype` with k columns on this build: AMX_LINEAR_MAX_ROWS
 * for bfloat16 where it multiplies on the AMX tiles; where it runs vectorized (AVX-512 or AVX2 + FMA for
 * float32, AVX512-BF16 for bfloat16), DENSE_FLOAT32_ROWS for float32 and DENSE_BFLOAT16_ROWS for bfloat16;
 * else 0: the plain C version is slower than oneDNN, so the engine keeps oneDNN there (tests still call
 * dense_linear on such builds). */
int dense_linear_max_rows(int dtype, int64_t k) {
#if defined(AMX_TILES)
    if (amx_linear_takes(dtype, AMX_LINEAR_MAX_ROWS, k)) return AMX_LINEAR_MAX_ROWS;
#endif
#if defined(DENSE_BFLOAT16_VECTOR)
    (void)k;
    return dtype == DTYPE_FLOAT32 ? DENSE_FLOAT32_ROWS : DENSE_BFLOAT16_ROWS;
#elif defined(DENSE_FLOAT32_VECTOR) || defined(DENSE_FLOAT32_AVX2)
    (void)k;
    return dtype == DTYPE_FLOAT32 ? DENSE_FLOAT32_ROWS : 0;
#else
    (void)dtype, (void)k;
    return 0;
#endif
}

/* Rows r < rows, outputs n0 + t * row_step (t < outs) of out [rows, n]: sums[r * DENSE_TILE + t] plus the
 * bias, in out's dtype (see dense_linear). A macro, not a function: inlined as a function it changed the code
 * generated for the one-to-four-row loop. DENSE_STORE: a tile of adjacent outputs. */
#define DENSE_STORE_STRIDED(sums, row_step)                                                                    \
    for (int64_t r = 0; r < rows; r++)                                                                         \
        for (int64_t t = 0; t < outs; t++) {                                                                   \
            const int64_t c = n0 + t * (row_step);                                                             \
            float v = (sums)[r * DENSE_TILE + t];                                                              \
            if (bias != NULL) v += bf16 ? bf16_to_float(((const uint16_t *)bias)[c]) : ((const float *)bias)[c]; \
            if (out_bf16) ((uint16_t *)out)[r * n + c] = float_to_bf16(v);                                     \
            else ((float *)out)[r * n + c] = bf16 ? bf16_to_float(float_to_bf16(v)) : v;                       \
        }
#define DENSE_STORE(sums) DENSE_STORE_STRIDED(sums, 1)

#if defined(DENSE_FLOAT32_VECTOR)
/* dense_share's streams for ROWS rows of dtype BF16 (constants: dense_tile16_rows inlined once). */
#define DENSE_STREAMS_CASE(ROWS, BF16)                                                                 \
    case ROWS * 2 + BF16:                                                                              \
        for (int64_t j = 0; j < part; j++) {                                                           \
            const int64_t n0 = first + j, outs = DENSE_TILE;                                           \
            float sums[DENSE_MAX_ROWS * DENSE_TILE];                                                   \
            dense_tile16_rows(x, ROWS, k, w, BF16, n0, part, DENSE_TILE, DENSE_STREAM_PREFETCH_BYTES, sums); \
            DENSE_STORE_STRIDED(sums, part)                                                            \
        }                                                                                              \
        tiled = first + DENSE_TILE * part;                                                             \
        break;
#endif

/* dense_linear for 1 <= rows <= DENSE_MAX_ROWS: the outputs first .. last - 1 (one thread's share), stored.
 * The share's weight rows are cut into DENSE_TILE parts of equal length, read side by side a row of each
 * at a time (dense_tile16_rows' tile with its rows `part` apart), so that each part is one stream through
 * memory, prefetched DENSE_STREAM_PREFETCH_BYTES ahead. The last count % DENSE_TILE rows (all of them where
 * the build has no vector tile for the dtype: plain C, or bfloat16 without AVX512-BF16) go in tiles of
 * adjacent rows (dense_tile). Each output's arithmetic is
 * dense_tile's, whichever tile it is in. SmolLM2's float32 batch-1 products (30 layers and the LM head,
 * alone in a loop on AMD Zen 4) took 8-23 % less time than with tiles of four adjacent rows, whose four
 * streams lie one weight row apart (2.3-6 KB there) and were read more slowly (docs/benchmarks.md). */
static void dense_share(const void *x, int64_t rows, int64_t k, const void *w, int64_t n, const void *bias, int bf16,
                        void *out, int out_bf16, int64_t first, int64_t last) {
    int64_t tiled = first;
#if defined(DENSE_FLOAT32_VECTOR)
    const int64_t part = (last - first) / DENSE_TILE;
    switch (rows * 2 + bf16) {
        DENSE_STREAMS_CASE(1, 0)
        DENSE_STREAMS_CASE(2, 0)
        DENSE_STREAMS_CASE(3, 0)
        DENSE_STREAMS_CASE(4, 0)
#if defined(DENSE_BFLOAT16_VECTOR)
        DENSE_STREAMS_CASE(1, 1)
        DENSE_STREAMS_CASE(2, 1)
        DENSE_STREAMS_CASE(3, 1)
        DENSE_STREAMS_CASE(4, 1)
#endif
    }
#undef DENSE_STREAMS_CASE
#endif
    for (int64_t n0 = tiled; n0 < last; n0 += DENSE_TILE) {
        const int64_t outs = last - n0 < DENSE_TILE ? last - n0 : DENSE_TILE;
        float sums[DENSE_MAX_ROWS * DENSE_TILE];
        dense_tile(x, rows, k, w, bf16, n0, outs, sums);
        DENSE_STORE(sums)
    }
}

#if defined(DENSE_FLOAT32_VECTOR) || defined(DENSE_FLOAT32_AVX2)
/* float32 dense_linear for DENSE_DIRECT_ROWS < rows <= DENSE_FLOAT32_ROWS and k >= DENSE_BLOCKED_K, in blocks of
 * DENSE_BLOCK_COLUMNS columns (both per instruction set, below): x is first copied block by block into one buffer (a
 * block's rows side by side), then for each block every tile of a group of DENSE_GROUP_TILES tiles of weight rows is
 * multiplied into all the x rows, DENSE_PASS_ROWS at a time (dense_block_pass), the group's running sums (dense_acc)
 * kept in memory between blocks. The weights are fetched into L2 DENSE_BLOCKS_AHEAD blocks ahead while the group's
 * blocks are multiplied (dense_block16, dense_block8), and whole steps load without a mask. The copy: in x itself a
 * block's rows lie k floats apart (8 KB for llama-1b), so the same columns of every row fall in the same L1 sets,
 * more lines than a set holds at 16 rows and more; copied, the block's rows are contiguous. On AMD Zen 4, with the
 * weights in L2, one thread (the FMA peak measured there: 117 GFLOP/s): 16 rows 79 -> 84 GFLOP/s, 24 rows 75 -> 86
 * (docs/benchmarks.md). On AMD Zen 2 (AVX2), llama-1b's products of 8-24 rows 1.23-1.4x faster than
 * dense_linear_avx2's passes straight from x. Each lane sums its columns in the same order as dense_tile16's, and
 * the lanes add up in the same tree: the same bits. */
/* DENSE_BLOCKED_K: from this many inputs (two blocks); SmolLM2's 576-input products measured 1.05-1.35x
 * slower in blocks (a short last block, the running sums stored per block for little work), its 1536-input
 * ones 1.08-1.13x faster. DENSE_BLOCK_COLUMNS: 512 rather than 256 (the running sums loaded and stored half
 * as often): llama-1b's products of 12-24 rows from memory 1.02-1.11x faster on Zen 4 (with x copied; before
 * the copy, Sapphire Rapids had measured 512 and 1024 slower than 256). DENSE_GROUP_TILES: two tiles (8
 * weight rows, whose blocks the memory streams side by side) rather than eight (32): llama-1b's products of
 * 6-24 rows from memory 1.02-1.12x faster on Sapphire Rapids; one tile measured the same as two.
 * DENSE_BLOCKS_AHEAD: the prefetch distance (dense_block16). One block, without going on into the next
 * group, left the next group's first blocks unfetched when it began; four, across into the next group, made
 * the same products another 1.02-1.16x faster (two measured about the same, eight a little slower). */
enum { DENSE_GROUP_TILES = 2, DENSE_BLOCKED_K = 1024, DENSE_BLOCKS_AHEAD = 4 };
/* On AVX2 (three x rows a pass, not six), 256 columns: llama-1b's products of 4-24 rows on AMD Zen 2 up to
 * 1.1x faster than in 512 (8 rows the same). DENSE_DIRECT_ROWS: up to this many rows the products read x where
 * it is (dense_tile's register tile, dense_linear_avx2's passes); on AVX2 four rows were 1.09-1.23x faster in
 * blocks and two or three 1.1-1.2x slower (the copy and the sums' loads and stores for little work). */
#if defined(DENSE_FLOAT32_AVX2)
enum { DENSE_BLOCK_COLUMNS = 256, DENSE_DIRECT_ROWS = 3 };
#else
enum { DENSE_BLOCK_COLUMNS = 512, DENSE_DIRECT_ROWS = DENSE_MAX_ROWS };
#endif
/* Floats from a weight row's column c0 to the line the blocked passes prefetch there: DENSE_BLOCKS_AHEAD
 * blocks further in the order a group reads its rows (see dense_block16). */
static ALWAYS_INLINE int64_t dense_block_ahead(int64_t c0, int64_t k) {
    return c0 + DENSE_BLOCKS_AHEAD * DENSE_BLOCK_COLUMNS < k
               ? DENSE_BLOCKS_AHEAD * DENSE_BLOCK_COLUMNS
               : DENSE_BLOCKS_AHEAD * DENSE_BLOCK_COLUMNS - k + DENSE_GROUP_TILES * DENSE_TILE * k;
}
#endif

#if defined(DENSE_FLOAT32_VECTOR)
/* The running sums of one row and output between blocks: one vector of 16 lanes. */
typedef __m512 dense_acc;
static ALWAYS_INLINE dense_acc dense_acc_zero(void) { return _mm512_setzero_ps(); }
static ALWAYS_INLINE float dense_acc_sum(dense_acc a) { return dense_reduce(a); }

/* acc[r * DENSE_TILE + t] += x row r . W row n0 + t over columns [c0, c1), for ROWS (<= DENSE_PASS_ROWS)
 * rows and OUTS (DENSE_TILE or 1) outputs, constants after inlining; columns past k count as 0 * 0. x: the
 * block's copy (column i of row r at x[r * DENSE_BLOCK_COLUMNS + i - c0], 64-byte aligned). Each step loads
 * the x rows' 16 columns once and multiplies each weight row's into all of them (6 x 4 sums, 6 x vectors and
 * one weight vector: 31 of the 32 registers); with the x rows loaded inside the weight rows' loop, GCC read
 * each x vector from L1 once per weight row (Zen 4, one thread, weights in L2: 16 rows 76 -> 79 GFLOP/s,
 * 24 rows 63 -> 75). Each step prefetches into L2 the weight rows' line DENSE_BLOCKS_AHEAD blocks further in
 * the order the group reads them: in the same row, or past its end in the next group's row at the same place
 * (every pass does: prefetching in the first pass only, the memory idled while the other passes multiplied,
 * 1.02-1.1x slower). The last group's prefetches past the weight's end are harmless: a prefetch never
 * faults. */
static ALWAYS_INLINE void dense_block16(const float *x, const int rows, int64_t k, const float *w, int64_t n0,
                                        const int outs, int64_t c0, int64_t c1, __m512 *acc) {
    __m512 a[DENSE_PASS_ROWS][DENSE_TILE];
#pragma GCC unroll 8
    for (int r = 0; r < rows; r++)
        for (int t = 0; t < outs; t++) a[r][t] = acc[r * DENSE_TILE + t];
    const float *wr[DENSE_TILE];
    for (int t = 0; t < outs; t++) wr[t] = w + (n0 + t) * k;
    const int64_t ahead = dense_block_ahead(c0, k);
    const int64_t whole = c0 + (c1 - c0) / 16 * 16;
    for (int64_t i = c0; i < c1; i += 16) {
        const __mmask16 mask = i < whole ? (__mmask16)0xffff : (__mmask16)((1u << (k - i)) - 1u);
        __m512 xv[DENSE_PASS_ROWS];
#pragma GCC unroll 8
        for (int r = 0; r < rows; r++)
            xv[r] = i < whole ? _mm512_load_ps(x + r * DENSE_BLOCK_COLUMNS + i - c0)
                              : _mm512_maskz_load_ps(mask, x + r * DENSE_BLOCK_COLUMNS + i - c0);
        for (int t = 0; t < outs; t++) {
            const __m512 wv = i < whole ? _mm512_loadu_ps(wr[t] + i) : _mm512_maskz_loadu_ps(mask, wr[t] + i);
            _mm_prefetch((const char *)(wr[t] + i + ahead), _MM_HINT_T1);
#pragma GCC unroll 8
            for (int r = 0; r < rows; r++) a[r][t] = _mm512_fmadd_ps(xv[r], wv, a[r][t]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < rows; r++)
        for (int t = 0; t < outs; t++) acc[r * DENSE_TILE + t] = a[r][t];
}

/* dense_block16 for ROWS rows, the tile's width made a constant. */
#define DENSE_BLOCK_CASE(ROWS)                                                                         \
    case ROWS:                                                                                         \
        if (outs == DENSE_TILE) dense_block16(x, ROWS, k, w, n0, DENSE_TILE, c0, c1, acc);             \
        else                                                                                           \
            for (int64_t t = 0; t < outs; t++) dense_block16(x, ROWS, k, w, n0 + t, 1, c0, c1, acc + t); \
        return;

/* One pass of `rows` (<= DENSE_PASS_ROWS) x rows over one tile's block of columns. */
static void dense_block_pass(const float *x, int64_t rows, int64_t k, const float *w, int64_t n0, int64_t outs,
                             int64_t c0, int64_t c1, dense_acc *acc) {
    switch (rows) {
        DENSE_BLOCK_CASE(1)
        DENSE_BLOCK_CASE(2)
        DENSE_BLOCK_CASE(3)
        DENSE_BLOCK_CASE(4)
        DENSE_BLOCK_CASE(5)
        DENSE_BLOCK_CASE(6)
    }
}

#endif

#if defined(DENSE_FLOAT32_AVX2)
/* ---- float32 products of a few rows on AVX2 + FMA without AVX-512 (AMD Zen 2 and 3, older Intel) --------
 * On AMD Zen 3 (two cores that read 20 GB/s) oneDNN streamed llama-1b's weights at 15-18 GB/s for one row and 10-12
 * GB/s for eight (benchmarks/dense_rows.py). Here, as in the AVX-512 path, each weight row comes from memory once: a
 * tile of DENSE_TILE weight rows (prefetched into L2 DENSE_PREFETCH_BYTES or more ahead) is multiplied into every x
 * row, DENSE_AVX2_PASS_ROWS x rows by DENSE_AVX2_OUTS weight rows a pass. The arithmetic is dense_tile_plain's: each
 * of its 16 lanes is kept, lanes 0-7 and 8-15 of every 16 columns in two 8-lane sums (lo, hi), by fused multiply-add
 * in column order (dense_step8), and dense_reduce2 adds them up in lanes_sum's tree: the same bits as the plain and
 * AVX-512 paths. One x row takes the tile's four weight rows at once (8 sums, 4 weight vectors, x: 13 of the 16
 * registers), more rows pairs of weight rows three x rows at a time (12 sums, 2 weight vectors, x: 15). Up to
 * DENSE_DIRECT_ROWS rows the passes read x where it is (dense_linear_avx2); more rows with k >= DENSE_BLOCKED_K go
 * in dense_linear_blocked's blocks (dense_block8), where each pass reads its x rows and weight rows from L1.
 * Straight from x they read them from L2 (the tile's rows and three x rows are more than L1 holds), and ran at about
 * a third of the FMA peak: on AMD Zen 2 the blocks made llama-1b's products of 8-24 rows 1.23-1.4x faster, 4 rows
 * 1.09-1.23x, while 2-3 rows were 1.1-1.2x slower in blocks (the copy and the sums' loads and stores for little
 * work). Against oneDNN there, llama-1b's products from memory: 1-8 rows 1.2-1.5x the speed, 12 rows 1.18-1.25x, 16
 * rows 1.08-1.13x, 24 about the same (0.99-1.03x); with a decode step's layers in one C call, llama-1b's float32
 * steps of 16 rows took 10 % less time than with oneDNN's products above eight rows, 24 rows 1 % less:
 * dense_linear_max_rows gives the engine DENSE_FLOAT32_ROWS here as with AVX-512. The prefetches past the weight's
 * last rows are harmless: a prefetch never faults. */
enum { DENSE_AVX2_OUTS = 2, DENSE_AVX2_PASS_ROWS = 3, DENSE_AVX2_ROW_PAD = 16 };

/* The sum of lo's and hi's 16 lanes in lanes_sum's tree (dense_reduce's, for a vector in two halves). */
static ALWAYS_INLINE float dense_reduce2(__m256 lo, __m256 hi) {
    const __m256 a = _mm256_add_ps(lo, hi);
    const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
    return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
}

/* v, loaded into a register where it stands: GCC would otherwise read a vector that two or three
 * multiply-adds use as a memory operand of each (18 loads for the 3 x 2 pass's 12 multiply-adds, not 10;
 * held in registers, llama-1b's products of 8-16 rows took 0-16 % less time on AMD Zen 3). */
static ALWAYS_INLINE __m256 dense_in_register(__m256 v) {
    __asm__("" : "+x"(v));
    return v;
}

/* One step of 16 columns from column i: lo[r][t] (lanes 0-7) and hi[r][t] (lanes 8-15) += x row r's columns
 * times W row t's (from wr[t] + i), for r < ROWS and t < OUTS, constants after inlining (ROWS * OUTS <= 6);
 * x row r's column i at x[r * xs]. `whole`: all 16 columns lie before k; else those past k count as 0 * 0. */
static ALWAYS_INLINE void dense_step8(const float *x, int64_t xs, const int rows, const float *const *wr, int64_t i,
                                      int64_t k, int whole, const int outs, __m256 lo[][DENSE_TILE],
                                      __m256 hi[][DENSE_TILE]) {
    if (whole) {
        __m256 wv[DENSE_TILE];
        for (int t = 0; t < outs; t++) wv[t] = dense_in_register(_mm256_loadu_ps(wr[t] + i));
        for (int r = 0; r < rows; r++) {
            const __m256 xv = dense_in_register(_mm256_loadu_ps(x + r * xs));
            for (int t = 0; t < outs; t++) lo[r][t] = _mm256_fmadd_ps(xv, wv[t], lo[r][t]);
        }
        for (int t = 0; t < outs; t++) wv[t] = dense_in_register(_mm256_loadu_ps(wr[t] + i + 8));
        for (int r = 0; r < rows; r++) {
            const __m256 xv = dense_in_register(_mm256_loadu_ps(x + r * xs + 8));
            for (int t = 0; t < outs; t++) hi[r][t] = _mm256_fmadd_ps(xv, wv[t], hi[r][t]);
        }
    } else {
        const __m256i mlo = avx2_first_lanes(k - i), mhi = avx2_first_lanes(k - i - 8);
        for (int t = 0; t < outs; t++) {
            const __m256 wlo = _mm256_maskload_ps(wr[t] + i, mlo), whi = _mm256_maskload_ps(wr[t] + i + 8, mhi);
            for (int r = 0; r < rows; r++) {
                lo[r][t] = _mm256_fmadd_ps(_mm256_maskload_ps(x + r * xs, mlo), wlo, lo[r][t]);
                hi[r][t] = _mm256_fmadd_ps(_mm256_maskload_ps(x + r * xs + 8, mhi), whi, hi[r][t]);
            }
        }
    }
}

/* sums[r * DENSE_TILE + t] = x row r . W row n0 + t * row_step, for r < ROWS (<= DENSE_AVX2_PASS_ROWS) and
 * t < OUTS (<= DENSE_TILE; ROWS * OUTS <= 6), constants after inlining. `ahead`: floats to the prefetched
 * column. */
static ALWAYS_INLINE void dense_tile8(const float *x, int64_t xs, const int rows, int64_t k, const float *w,
                                      int64_t n0, int64_t row_step, const int outs, int64_t ahead, float *sums) {
    __m256 lo[DENSE_AVX2_PASS_ROWS][DENSE_TILE], hi[DENSE_AVX2_PASS_ROWS][DENSE_TILE];
    for (int r = 0; r < rows; r++)
        for (int t = 0; t < outs; t++) lo[r][t] = hi[r][t] = _mm256_setzero_ps();
    const float *wr[DENSE_TILE];
    for (int t = 0; t < outs; t++) wr[t] = w + (n0 + t * row_step) * k;
    const int64_t whole = k / 16 * 16;
    for (int64_t i = 0; i < k; i += 16) {
        for (int t = 0; t < outs; t++) _mm_prefetch((const char *)(wr[t] + i + ahead), _MM_HINT_T1);
        dense_step8(x + i, xs, rows, wr, i, k, i < whole, outs, lo, hi);
    }
    for (int r = 0; r < rows; r++)
        for (int t = 0; t < outs; t++) sums[r * DENSE_TILE + t] = dense_reduce2(lo[r][t], hi[r][t]);
}

/* CALL(ROWS, OUTS) for `rows` (1 to DENSE_AVX2_PASS_ROWS) x rows by `outs` (1 or DENSE_AVX2_OUTS) weight rows,
 * the counts made constants: the one ladder of dense_tile8_pass and dense_block_pass. */
#define DENSE_AVX2_CONSTANTS(rows, outs, CALL)                 \
    if ((outs) == DENSE_AVX2_OUTS && (rows) == 3)              \
        CALL(3, DENSE_AVX2_OUTS);                              \
    else if ((outs) == DENSE_AVX2_OUTS && (rows) == 2)         \
        CALL(2, DENSE_AVX2_OUTS);                              \
    else if ((outs) == DENSE_AVX2_OUTS)                        \
        CALL(1, DENSE_AVX2_OUTS);                              \
    else if ((rows) == 3)                                      \
        CALL(3, 1);                                            \
    else if ((rows) == 2)                                      \
        CALL(2, 1);                                            \
    else                                                       \
        CALL(1, 1)

/* dense_tile8 with its row and output counts made constants (one row by DENSE_TILE weight rows too). */
static void dense_tile8_pass(const float *x, int64_t xs, int rows, int64_t k, const float *w, int64_t n0,
                             int64_t row_step, int outs, int64_t ahead, float *sums) {
#define DENSE_TILE8(ROWS, OUTS) dense_tile8(x, xs, ROWS, k, w, n0, row_step, OUTS, ahead, sums)
    if (rows == 1 && outs == DENSE_TILE) DENSE_TILE8(1, DENSE_TILE);
    else DENSE_AVX2_CONSTANTS(rows, outs, DENSE_TILE8);
#undef DENSE_TILE8
}

/* The running sums of one row and output between blocks: lanes 0-7 and 8-15 of 16 (see dense_step8). */
typedef struct {
    __m256 lo, hi;
} dense_acc;
static ALWAYS_INLINE dense_acc dense_acc_zero(void) { return (dense_acc){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static ALWAYS_INLINE float dense_acc_sum(dense_acc a) { return dense_reduce2(a.lo, a.hi); }

/* dense_block16 on these builds: acc[r * DENSE_TILE + t] += x row r . W row n0 + t over columns [c0, c1), for
 * r < ROWS (<= DENSE_AVX2_PASS_ROWS) and t < OUTS (<= DENSE_AVX2_OUTS), constants after inlining; x: the
 * block's copy. Each step prefetches as dense_block16's. Measured and not kept: each pass in two sweeps,
 * lanes 0-7 and then 8-15, six x rows at a time (12 sums in registers, 8 loads per 12 multiply-adds, not
 * 10): 2-7 % slower on AMD Zen 2. */
static ALWAYS_INLINE void dense_block8(const float *x, const int rows, int64_t k, const float *w, int64_t n0,
                                       const int outs, int64_t c0, int64_t c1, dense_acc *acc) {
    __m256 lo[DENSE_AVX2_PASS_ROWS][DENSE_TILE], hi[DENSE_AVX2_PASS_ROWS][DENSE_TILE];
    for (int r = 0; r < rows; r++)
        for (int t = 0; t < outs; t++) lo[r][t] = acc[r * DENSE_TILE + t].lo, hi[r][t] = acc[r * DENSE_TILE + t].hi;
    const float *wr[DENSE_TILE];
    for (int t = 0; t < outs; t++) wr[t] = w + (n0 + t) * k;
    const int64_t ahead = dense_block_ahead(c0, k), whole = c0 + (c1 - c0) / 16 * 16;
    for (int64_t i = c0; i < c1; i += 16) {
        for (int t = 0; t < outs; t++) _mm_prefetch((const char *)(wr[t] + i + ahead), _MM_HINT_T1);
        dense_step8(x + i - c0, DENSE_BLOCK_COLUMNS, rows, wr, i, k, i < whole, outs, lo, hi);
    }
    for (int r = 0; r < rows; r++)
        for (int t = 0; t < outs; t++) acc[r * DENSE_TILE + t] = (dense_acc){lo[r][t], hi[r][t]};
}

/* One pass of `rows` (<= DENSE_PASS_ROWS) x rows over one tile's block of columns: DENSE_AVX2_OUTS weight
 * rows by up to DENSE_AVX2_PASS_ROWS x rows at a time, the counts made constants. */
static void dense_block_pass(const float *x, int64_t rows, int64_t k, const float *w, int64_t n0, int64_t outs,
                             int64_t c0, int64_t c1, dense_acc *acc) {
    for (int64_t t = 0; t < outs; t += DENSE_AVX2_OUTS)
        for (int64_t r = 0; r < rows; r += DENSE_AVX2_PASS_ROWS) {
            const float *xr = x + r * DENSE_BLOCK_COLUMNS;
            dense_acc *a = acc + r * DENSE_TILE + t;
            const int64_t part = outs - t < DENSE_AVX2_OUTS ? outs - t : DENSE_AVX2_OUTS;
            const int64_t pass = rows - r < DENSE_AVX2_PASS_ROWS ? rows - r : DENSE_AVX2_PASS_ROWS;
            const int64_t n1 = n0 + t;
#define DENSE_BLOCK8(ROWS, OUTS) dense_block8(xr, ROWS, k, w, n1, OUTS, c0, c1, a)
            DENSE_AVX2_CONSTANTS(pass, part, DENSE_BLOCK8);
#undef DENSE_BLOCK8
        }
}
#undef DENSE_AVX2_CONSTANTS
#endif

#if defined(DENSE_FLOAT32_VECTOR) || defined(DENSE_FLOAT32_AVX2)
static int dense_linear_blocked(const float *x, int64_t rows, int64_t k, const float *w, int64_t n,
                                const float *bias, float *out, int num_threads) {
    const int bf16 = 0, out_bf16 = 0; /* for DENSE_STORE */
    const int64_t tiles = (n + DENSE_TILE - 1) / DENSE_TILE;
    const int64_t groups = (tiles + DENSE_GROUP_TILES - 1) / DENSE_GROUP_TILES;
    const int64_t blocks = (k + DENSE_BLOCK_COLUMNS - 1) / DENSE_BLOCK_COLUMNS;
    float *xp = aligned_alloc(64, (size_t)(blocks * rows * DENSE_BLOCK_COLUMNS) * sizeof(float));
    if (xp == NULL) return -1;
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t r = 0; r < rows; r++) {
            const int64_t c0 = b * DENSE_BLOCK_COLUMNS;
            const int64_t width = k - c0 < DENSE_BLOCK_COLUMNS ? k - c0 : DENSE_BLOCK_COLUMNS;
            memcpy(xp + (b * rows + r) * DENSE_BLOCK_COLUMNS, x + r * k + c0, (size_t)width * sizeof(float));
        }
#pragma omp parallel for num_threads(threads_for(n * k, num_threads)) schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        dense_acc acc[DENSE_GROUP_TILES][DENSE_FLOAT32_ROWS * DENSE_TILE];
        const int64_t first = g * DENSE_GROUP_TILES;
        const int64_t count = tiles - first < DENSE_GROUP_TILES ? tiles - first : DENSE_GROUP_TILES;
        for (int64_t c0 = 0; c0 < k; c0 += DENSE_BLOCK_COLUMNS) {
            const int64_t c1 = k - c0 < DENSE_BLOCK_COLUMNS ? k : c0 + DENSE_BLOCK_COLUMNS;
            for (int64_t i = 0; i < count; i++) {
                const int64_t n0 = (first + i) * DENSE_TILE, outs = n - n0 < DENSE_TILE ? n - n0 : DENSE_TILE;
                if (c0 == 0)
                    for (int64_t j = 0; j < rows * DENSE_TILE; j++) acc[i][j] = dense_acc_zero();
                for (int64_t done = 0; done < rows; done += DENSE_PASS_ROWS)
                    dense_block_pass(xp + (c0 / DENSE_BLOCK_COLUMNS * rows + done) * DENSE_BLOCK_COLUMNS,
                                     rows - done < DENSE_PASS_ROWS ? rows - done : DENSE_PASS_ROWS, k, w,
                                     n0, outs, c0, c1, acc[i] + done * DENSE_TILE);
            }
        }
        for (int64_t i = 0; i < count; i++) {
            const int64_t n0 = (first + i) * DENSE_TILE, outs = n - n0 < DENSE_TILE ? n - n0 : DENSE_TILE;
            float sums[DENSE_FLOAT32_ROWS * DENSE_TILE];
            for (int64_t r = 0; r < rows; r++)
                for (int64_t t = 0; t < outs; t++) sums[r * DENSE_TILE + t] = dense_acc_sum(acc[i][r * DENSE_TILE + t]);
            DENSE_STORE(sums)
        }
    }
    free(xp);
    return 0;
}
#endif

/* dense_linear for DENSE_MAX_ROWS < rows <= DENSE_FLOAT32_ROWS (float32 only below DENSE_BLOCKED_K inputs;
 * dense_linear_blocked above): each tile of weight rows multiplied into up to DENSE_PASS_ROWS x rows in one
 * pass (read from memory), then into the others (from L1 or L2; dense_tile_wide). Its own loop and buffer, though the same as dense_linear's below, so that the
 * one-to-four-row loop's code is the same as without it. */
static void dense_linear_wide(const void *x, int64_t rows, int64_t k, const void *w, int64_t n, const void *bias,
                              int bf16, void *out, int out_bf16, int num_threads) {
    const int64_t tiles = (n + DENSE_TILE - 1) / DENSE_TILE;
#pragma omp parallel for num_threads(threads_for(n * k, num_threads)) schedule(static)
    for (int64_t tile = 0; tile < tiles; tile++) {
        const int64_t n0 = tile * DENSE_TILE, outs = n - n0 < DENSE_TILE ? n - n0 : DENSE_TILE;
        float sums[DENSE_FLOAT32_ROWS * DENSE_TILE];
        dense_tile_wide(x, rows, k, w, bf16, n0, outs, sums);
        DENSE_STORE(sums)
    }
}


#if defined(DENSE_FLOAT32_AVX2)
/* dense_linear_avx2 for one row: the outputs first .. last - 1 (one thread's share), stored, the share's
 * weight rows read as four streams as dense_share reads them on AVX-512 builds (a tile is one row of each
 * quarter of the share), then the last count % DENSE_TILE rows one at a time: each stream, and those consecutive
 * rows, prefetched DENSE_STREAM_PREFETCH_BYTES ahead. */
static void dense_avx2_share(const float *x, int64_t k, const float *w, int64_t n, const float *bias, float *out,
                             int64_t first, int64_t last) {
    const int bf16 = 0, out_bf16 = 0, rows = 1; /* for DENSE_STORE */
    const int64_t part = (last - first) / DENSE_TILE, ahead = DENSE_STREAM_PREFETCH_BYTES / 4;
    float sums[DENSE_TILE];
    for (int64_t j = 0; j < part; j++) {
        const int64_t n0 = first + j, outs = DENSE_TILE;
        dense_tile8_pass(x, k, 1, k, w, n0, part, DENSE_TILE, ahead, sums);
        DENSE_STORE_STRIDED(sums, part)
    }
    for (int64_t n0 = first + DENSE_TILE * part; n0 < last; n0++) {
        const int64_t outs = 1;
        dense_tile8_pass(x, k, 1, k, w, n0, 1, 1, ahead, sums);
        DENSE_STORE(sums)
    }
}

/* dense_linear (float32) on these builds where it does not go in blocks (up to DENSE_DIRECT_ROWS rows, or k <
 * DENSE_BLOCKED_K), 1 <= rows <= DENSE_FLOAT32_ROWS: -1 where x's copy could not be allocated. One row goes by four
 * streams a thread (dense_avx2_share: SmolLM2's batch-1 products, alone in a loop, took 10-17 % less time than in tiles
 * of adjacent rows, in this build on an AMD Zen 4). More than one row are first copied DENSE_AVX2_ROW_PAD floats further
 * apart than k: rows k floats apart (8 KB for llama-1b) put the same column of every row, and of the tile's weight
 * rows, in the same L1 sets, more lines than a set holds. */
static int dense_linear_avx2(const float *x, int64_t rows, int64_t k, const float *w, int64_t n, const float *bias,
                             float *out, int num_threads) {
    if (rows == 1) {
        const int shares = threads_for(n * k, num_threads);
#pragma omp parallel for num_threads(shares) schedule(static)
        for (int share = 0; share < shares; share++)
            dense_avx2_share(x, k, w, n, bias, out, share * n / shares, (share + 1) * n / shares);
        return 0;
    }
    const int bf16 = 0, out_bf16 = 0; /* for DENSE_STORE */
    const int64_t tiles = (n + DENSE_TILE - 1) / DENSE_TILE, tile_floats = DENSE_TILE * k;
    const int64_t ahead = (DENSE_PREFETCH_BYTES / 4 + tile_floats - 1) / tile_floats * tile_floats;
    const int64_t xs = k + DENSE_AVX2_ROW_PAD;
    float *xp = aligned_alloc(64, (size_t)((rows * xs * 4 + 63) / 64 * 64));
    if (xp == NULL) return -1;
    for (int64_t r = 0; r < rows; r++) memcpy(xp + r * xs, x + r * k, (size_t)k * sizeof(float));
#pragma omp parallel for num_threads(threads_for(n * k, num_threads)) schedule(static)
    for (int64_t tile = 0; tile < tiles; tile++) {
        const int64_t n0 = tile * DENSE_TILE, outs = n - n0 < DENSE_TILE ? n - n0 : DENSE_TILE;
        float sums[DENSE_FLOAT32_ROWS * DENSE_TILE];
        for (int64_t t = 0; t < outs; t += DENSE_AVX2_OUTS) {
            const int part = outs - t < DENSE_AVX2_OUTS ? (int)(outs - t) : DENSE_AVX2_OUTS;
            for (int64_t r = 0; r < rows; r += DENSE_AVX2_PASS_ROWS) {
                const int pass = rows - r < DENSE_AVX2_PASS_ROWS ? (int)(rows - r) : DENSE_AVX2_PASS_ROWS;
                dense_tile8_pass(xp + r * xs, xs, pass, k, w, n0 + t, 1, part, ahead, sums + r * DENSE_TILE + t);
            }
        }
        DENSE_STORE(sums)
    }
    free(xp);
    return 0;
}
#endif

/* out [rows, n] = x [rows, k] W^T (+ bias [n]), x, W and bias of `dtype` (float32 or bfloat16), 1 <= rows <=
 * dense_linear_max_rows(dtype, k) (see the top of this section, and the AMX tiles' above). `out` is of
 * `out_dtype`: `dtype`, or float32 holding the result rounded to `dtype` (for bfloat16, what widening the
 * bfloat16 output would give: the LM head's logits without a separate pass). Returns 0, or -1 for another
 * number of rows or output dtype, or where the AMX tiles' or the float32 blocks' copy of x could not be
 * allocated. */
int dense_linear(const void *x, int64_t rows, int64_t k, const void *w, int64_t n, const void *bias, int dtype,
                 void *out, int out_dtype, int num_threads) {
    if (out_dtype != dtype && out_dtype != DTYPE_FLOAT32) return -1;
    const int bf16 = dtype == DTYPE_BFLOAT16, out_bf16 = out_dtype == DTYPE_BFLOAT16;
#if defined(AMX_TILES)
    if (amx_linear_takes(dtype, rows, k)) return amx_linear(x, rows, k, w, n, bias, out, out_bf16, num_threads);
#endif
    if (rows < 1 || rows > (bf16 ? DENSE_BFLOAT16_ROWS : DENSE_FLOAT32_ROWS)) return -1;
#if defined(DENSE_FLOAT32_VECTOR) || defined(DENSE_FLOAT32_AVX2)
    if (rows > DENSE_DIRECT_ROWS && !bf16 && k >= DENSE_BLOCKED_K) {
        return dense_linear_blocked((const float *)x, rows, k, (const float *)w, n, (const float *)bias,
                                    (float *)out, num_threads);
    }
#endif
#if defined(DENSE_FLOAT32_AVX2)
    if (!bf16) {
        return dense_linear_avx2((const float *)x, rows, k, (const float *)w, n, (const float *)bias, (float *)out,
                                 num_threads);
    }
#endif
    if (rows > DENSE_MAX_ROWS) {
        dense_linear_wide(x, rows, k, w, n, bias, bf16, out, out_bf16, num_threads);
        return 0;
    }
    const int shares = threads_for(n * k, num_threads);
#pragma omp parallel for num_threads(shares) schedule(static)
    for (int share = 0; share < shares; share++)
        dense_share(x, rows, k, w, n, bias, bf16, out, out_bf16, share * n / shares, (share + 1) * n / shares);
    return 0;
}

/* ---- the KV cache ------------------------------------------------------------------------------- */

/* Store the step's new keys and values at their cache slots: row t of k and of v (`row_bytes` bytes each,
 * rows `row_stride` bytes apart: views into the fused q|k|v projection) go to slot slots[t] of k_cache and
 * v_cache ([slots, row_bytes]). One copy per row, no dtype conversion (the caller checks the dtypes). */
void write_kv(const void *k, const void *v, int64_t row_stride, void *k_cache, void *v_cache, const int64_t *slots,
              int64_t rows, int64_t row_bytes) {
    for (int64_t t = 0; t < rows; t++) {
        memcpy((char *)k_cache + slots[t] * row_bytes, (const char *)k + t * row_stride, (size_t)row_bytes);
        memcpy((char *)v_cache + slots[t] * row_bytes, (const char *)v + t * row_stride, (size_t)row_bytes);
    }
}

/* ---- greedy choice ------------------------------------------------------------------------------ */

/* The index of the first NaN of row[0, cols), or -1 where there is none. */
static int64_t first_nan(const float *row, int64_t cols) {
    for (int64_t i = 0; i < cols; i++)
        if (row[i] != row[i]) return i;
    return -1;
}

#if defined(__AVX512F__)
/* argmax_row (below) 16 lanes at a time, for 16 <= cols < 2^31: each lane keeps the first index of its
 * largest value (strictly greater replaces it); the answer is the smallest index among the lanes that hold
 * the row's largest value. */
static int64_t argmax_row16(const float *row, int64_t cols) {
    const __m512i step = _mm512_set1_epi32(16);
    __m512i index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 best = _mm512_loadu_ps(row);
    __m512i best_index = index;
    __mmask16 nan = _mm512_cmp_ps_mask(best, best, _CMP_UNORD_Q);
    for (int64_t i = 16; i < cols; i += 16) {
        index = _mm512_add_epi32(index, step);
        const __mmask16 live = cols - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (cols - i)) - 1u);
        const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), live, row + i);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        const __mmask16 greater = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
        best = _mm512_mask_mov_ps(best, greater, v);
        best_index = _mm512_mask_mov_epi32(best_index, greater, index);
    }
    if (nan) return first_nan(row, cols);
    const __mmask16 top = _mm512_cmp_ps_mask(best, _mm512_set1_ps(_mm512_reduce_max_ps(best)), _CMP_EQ_OQ);
    return _mm512_mask_reduce_min_epi32(top, best_index);
}
#endif

/* The index of the largest value of row[0, cols): the first of equal largest values, the first NaN in a
 * row that has one; what torch.argmax answers. */
static int64_t argmax_row(const float *row, int64_t cols) {
#if defined(__AVX512F__)
    if (cols >= 16 && cols < INT32_MAX) return argmax_row16(row, cols);
#endif
    const int64_t nan = first_nan(row, cols);
    if (nan >= 0) return nan;
    int64_t at = 0;
    for (int64_t i = 1; i < cols; i++)
        if (row[i] > row[at]) at = i;
    return at;
}

/* out[r] = argmax_row of row r of x [rows, cols] (float32). */
void argmax_rows(const float *x, int64_t rows, int64_t cols, int64_t *out, int num_threads) {
    /* One compare per element: the threshold counts 16-element vectors, not elements. */
#pragma omp parallel for num_threads(threads_for(rows * cols / 16, num_threads)) schedule(static)
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row(x + r * cols, cols);
}

/* The sampling weights of each row r of logits [rows, vocab] (float32): e^((x - the row's largest) *
 * inv_temperature[r]) (exp_approx), 0 where that is below min_p[r] (the min-p filter: the largest weighs 1),
 * into out [rows, vocab]; unnormalized, as the race (race_rows) and every other reader take them. A row
 * without a finite logit gets 0 everywhere; the peak is argmax_row's (a row with a NaN: NaN weights, as
 * softmax gives). One pass for the peak and one for the weights, where torch's
 * quotient by the temperature and softmax took two temporaries of the rows' size and three passes. */
void tempered_weights(const float *logits, int64_t rows, int64_t vocab, const float *inv_temperature,
                      const float *min_p, float *out, int num_threads) {
#pragma omp parallel for num_threads(threads_for(rows * vocab / 16, num_threads)) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *x = logits + r * vocab;
        float *w = out + r * vocab;
        const float peak = x[argmax_row(x, vocab)];
        const float scale = inv_temperature[r], floor = min_p[r];
        if (peak == -INFINITY) {
            memset(w, 0, (size_t)vocab * sizeof(float));
            continue;
        }
        for (int64_t i = 0; i < vocab; i++) {
            const float e = exp_approx((x[i] - peak) * scale);
            w[i] = e < floor || x[i] == -INFINITY ? 0.0f : e; /* a filtered token: never drawn */
        }
    }
}

/* The sum of w[0, n), in 16 lanes (vectorized: one running sum would make each add wait for the last). */
static float lane_sum(const float *w, int64_t n) {
    float lanes[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j++) lanes[j] += w[i + j];
    float sum = 0;
    for (; i < n; i++) sum += w[i];
    for (int j = 0; j < 16; j++) sum += lanes[j];
    return sum;
}

/* The exponential race in two rounds (engine/sampler.py `race`) over each row r of weights [rows, vocab]
 * (float32, non-negative, unnormalized), with the row's Exp(1) draws noise[r * (blocks + block) ...] (the
 * blocks' draws first): the block of `block` entries whose mass over its draw is largest, then the entry of
 * that block whose weight over its draw is largest; the first of equal largest in both rounds, as
 * torch.argmax answers. out[r]: the entry's index. One pass over the weights, where torch's blocks' sums,
 * quotients, argmaxes and gather took ~75 us a row of SmolLM2's 49,152 entries. */
void race_rows(const float *weights, int64_t rows, int64_t vocab, int64_t block, const float *noise, int64_t *out,
               int num_threads) {
    const int64_t blocks = (vocab + block - 1) / block;
#pragma omp parallel for num_threads(threads_for(rows * vocab / 16, num_threads)) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *w = weights + r * vocab, *draws = noise + r * (blocks + block);
        int64_t won = 0;
        float best = -INFINITY;
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t start = b * block, n = start + block < vocab ? block : vocab - start;
            const float score = lane_sum(w + start, n) / draws[b];
            if (score > best) best = score, won = b;
        }
        const int64_t start = won * block, n = start + block < vocab ? block : vocab - start;
        int64_t at = 0;
        best = -INFINITY;
        for (int64_t i = 0; i < n; i++) {
            const float score = w[start + i] / draws[blocks + i];
            if (score > best) best = score, at = i;
        }
        out[r] = start + at;
    }
}

/* Constrained decoding's token bitmasks (engine/guided.py): row rows[i] of logits (float32, row_stride
 * floats apart) gets -inf at every token t < vocab whose bit (t % 32 of word t / 32 of bitmask row i) is
 * clear; other rows and allowed tokens are left as they are. One pass over the packed words: a word with
 * every bit set (32 allowed tokens) is skipped without touching the logits. */
void apply_token_bitmask(float *logits, int64_t row_stride, const int64_t *rows, const int32_t *bitmask,
                         int64_t n, int64_t words, int64_t vocab, int num_threads) {
#pragma omp parallel for num_threads(threads_for(n * vocab / 16, num_threads)) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        float *row = logits + rows[i] * row_stride;
        const uint32_t *mask = (const uint32_t *)(bitmask + i * words);
        for (int64_t w = 0; w < words && w * 32 < vocab; w++) {
            const uint32_t allowed = mask[w];
            if (allowed == UINT32_MAX) continue;
            const int64_t end = w * 32 + 32 < vocab ? w * 32 + 32 : vocab;
            for (int64_t t = w * 32; t < end; t++)
                if (!((allowed >> (t - w * 32)) & 1u)) row[t] = -INFINITY;
        }
    }
}
