/* A float's bits and back, and bfloat16 <-> float: one definition for the library's C files (kernels.c,
 * quant_kernels.c, decode_layer.c). Kept apart from kernels.h so that an older kernels.c with its own copies
 * (the attention benchmarks' --compare) still builds beside it. */
#ifndef INFLIGHT_FLOAT_BITS_H
#define INFLIGHT_FLOAT_BITS_H

#include <stdint.h>
#include <string.h>

static inline uint32_t bits_of(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float float_of(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float bf16_to_float(uint16_t x) { return float_of((uint32_t)x << 16); }

/* Round to nearest even, as torch does; NaN stays NaN. */
static inline uint16_t float_to_bf16(float f) {
    uint32_t bits = bits_of(f);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

#endif
