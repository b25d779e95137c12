/* What the library's vectorized C files share (kernels.c, quant_kernels.c): forced inlining, and the load
 * mask of an AVX2 vector's first lanes. Kept apart from kernels.h for the reason float_bits.h is. */
#ifndef INFLIGHT_SIMD_COMMON_H
#define INFLIGHT_SIMD_COMMON_H

#include <stdint.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

/* Forced inlining: for the micro-kernels, so constant arguments specialize them; and for the prefetching
 * functions, which gcc otherwise judges pure (they only prefetch) and drops. */
#if defined(__GNUC__) || defined(__clang__)
#define ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define ALWAYS_INLINE inline
#endif

#if defined(__AVX2__)
/* The mask of an 8-float AVX2 masked load or store that takes its first `valid` lanes (all from 8 on, none
 * from 0 down). */
static ALWAYS_INLINE __m256i avx2_first_lanes(int64_t valid) {
    const int v = valid >= 8 ? 8 : valid <= 0 ? 0 : (int)valid;
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(v), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
#endif

#endif
