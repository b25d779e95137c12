/* Small C kernels for CPU inference: paged decode attention that reads K/V blocks where they lie, and
 * the model's elementwise steps fused into one pass each (add + RMSNorm, SiLU * up, rotary embedding).
 *
 * Compiled at first use by cpu_kernels.py (cc -O3 -march=native -fopenmp) and called through ctypes.
 * Element type: float32 (dtype 0) or bfloat16 (dtype 1); arithmetic is float32 either way.
 * Parallel loops use `num_threads` OpenMP threads (the OpenMP runtime torch already loaded).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { DTYPE_FLOAT32 = 0, DTYPE_BFLOAT16 = 1 };

static inline float bf16_to_float(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    /* Round to nearest even, as torch does; NaN stays NaN. */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* ---- exp that vectorizes ------------------------------------------------------------------------ */

/* e^x for float32 without a libm call, so loops over it vectorize: x = n ln2 + r with |r| <= ln2 / 2,
 * e^r by a degree-6 polynomial (Taylor, relative error below 2e-7 over that range), times 2^n built in
 * the exponent bits. Inputs below -87.3 give 0 (as expf underflows); above 88.7 are clamped. */
static inline float exp_approx(float x) {
    x = x < -87.3f ? -87.3f : (x > 88.7f ? 88.7f : x);
    const float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
    const float r = (x - n * 0.693145751953125f) - n * 1.42860682030941723e-06f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* `n` elements at `offset` as floats: the memory itself for float32, converted into `tmp` for bfloat16. */
static inline const float *row_as_float(const void *base, int64_t offset, int64_t n, int dtype, float *tmp) {
    if (dtype == DTYPE_FLOAT32) return (const float *)base + offset;
    const uint16_t *src = (const uint16_t *)base + offset;
    for (int64_t d = 0; d < n; d++) tmp[d] = bf16_to_float(src[d]);
    return tmp;
}

static inline void store_row(void *base, int64_t offset, const float *src, int64_t n, int dtype) {
    if (dtype == DTYPE_FLOAT32) {
        float *dst = (float *)base + offset;
        for (int64_t d = 0; d < n; d++) dst[d] = src[d];
    } else {
        uint16_t *dst = (uint16_t *)base + offset;
        for (int64_t d = 0; d < n; d++) dst[d] = float_to_bf16(src[d]);
    }
}

/* ---- paged decode attention ---------------------------------------------------------------------
 * Layout contract: attention/metadata.py. q is [T, num_heads, head_dim] rows `q_row_stride` elements
 * apart (a view into the fused q|k|v projection), out is [T, num_heads, head_dim]; k_cache and v_cache are
 * [num_blocks, block_size, num_kv_heads, head_dim]; block_tables is [num_seqs, stride].
 * A work item is one sequence's KV heads (all, or one): its query heads score every key (one pass over
 * K), take an exact softmax, then sum the values (one pass over V). */

/* Keys and values are visited TILE tokens at a time (never across a block edge): TILE independent dot
 * products per pass keep the FMA units busy where one would wait on its own additions. */
enum { TILE = 8 };

/* Up to TILE consecutive tokens of one block, starting at `t`: their rows of `cache` for `kv_head` as floats.
 * Unused entries repeat the first row (computed and discarded). Returns how many are real. */
static inline int64_t tile_rows(const void *cache, int64_t first_slot, int64_t count, int64_t kv_head,
                                int64_t num_kv_heads, int64_t head_dim, int dtype, float *tmp,
                                const float *rows[TILE]) {
    for (int64_t j = 0; j < TILE; j++) {
        const int64_t slot = first_slot + (j < count ? j : 0);
        rows[j] = row_as_float(cache, (slot * num_kv_heads + kv_head) * head_dim, head_dim, dtype,
                               tmp + j * head_dim);
    }
    return count;
}

/* How many tokens from `t` on lie in one block and one tile (and before `end`). */
static inline int64_t tile_count(int64_t t, int64_t end, int64_t block_size) {
    int64_t count = block_size - t % block_size;
    if (count > end - t) count = end - t;
    return count < TILE ? count : TILE;
}

/* One item: KV heads [head_begin, head_end) of one sequence. For each tile of tokens every head of the
 * range is done before the next tile, so a block is read from memory once while it is hot.
 * scratch holds group * heads * (seq_len + 2 * head_dim) + TILE * head_dim floats. */
static void decode_item(const void *q, int64_t q_row_stride, const void *k_cache, const void *v_cache, const int32_t *table,
                        int64_t seq_len, int64_t row, int64_t head_begin, int64_t head_end, int64_t num_heads,
                        int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t window,
                        float scale, int dtype, void *out, float *scratch) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t heads = (head_end - head_begin) * group; /* query heads of this item */
    const int64_t first = (window > 0 && seq_len > window) ? seq_len - window : 0;
    const int64_t len = seq_len - first;
    float *scores = scratch;                  /* [heads, len] */
    float *queries = scores + heads * len;    /* [heads, head_dim], scaled */
    float *acc = queries + heads * head_dim;  /* [heads, head_dim] */
    float *tmp = acc + heads * head_dim;      /* [TILE, head_dim]: converted bfloat16 rows */
    const float *rows[TILE];

    for (int64_t h = 0; h < heads; h++) {
        const int64_t offset = row * q_row_stride + (head_begin * group + h) * head_dim;
        const float *src = row_as_float(q, offset, head_dim, dtype, tmp);
        for (int64_t d = 0; d < head_dim; d++) queries[h * head_dim + d] = src[d] * scale;
    }

    for (int64_t t = first; t < seq_len;) {
        const int64_t count = tile_count(t, seq_len, block_size);
        const int64_t first_slot = (int64_t)table[t / block_size] * block_size + t % block_size;
        for (int64_t kv_head = head_begin; kv_head < head_end; kv_head++) {
            tile_rows(k_cache, first_slot, count, kv_head, num_kv_heads, head_dim, dtype, tmp, rows);
            const float *k0 = rows[0], *k1 = rows[1], *k2 = rows[2], *k3 = rows[3];
            const float *k4 = rows[4], *k5 = rows[5], *k6 = rows[6], *k7 = rows[7];
            for (int64_t h = (kv_head - head_begin) * group; h < (kv_head - head_begin + 1) * group; h++) {
                const float *qh = queries + h * head_dim;
                float s0 = 0, s1 = 0, s2 = 0, s3 = 0, s4 = 0, s5 = 0, s6 = 0, s7 = 0;
#pragma omp simd reduction(+ : s0, s1, s2, s3, s4, s5, s6, s7)
                for (int64_t d = 0; d < head_dim; d++) {
                    const float x = qh[d];
                    s0 += x * k0[d];
                    s1 += x * k1[d];
                    s2 += x * k2[d];
                    s3 += x * k3[d];
                    s4 += x * k4[d];
                    s5 += x * k5[d];
                    s6 += x * k6[d];
                    s7 += x * k7[d];
                }
                const float tile[TILE] = {s0, s1, s2, s3, s4, s5, s6, s7};
                for (int64_t j = 0; j < count; j++) scores[h * len + (t - first) + j] = tile[j];
            }
        }
        t += count;
    }

    for (int64_t h = 0; h < heads; h++) {
        float *sh = scores + h * len;
        float peak = -INFINITY;
        for (int64_t j = 0; j < len; j++) peak = sh[j] > peak ? sh[j] : peak;
        float sum = 0.0f;
        for (int64_t j = 0; j < len; j++) {
            sh[j] = expf(sh[j] - peak);
            sum += sh[j];
        }
        const float inv = 1.0f / sum;
        for (int64_t j = 0; j < len; j++) sh[j] *= inv;
    }

    memset(acc, 0, sizeof(float) * (size_t)(heads * head_dim));
    for (int64_t t = first; t < seq_len;) {
        const int64_t count = tile_count(t, seq_len, block_size);
        const int64_t first_slot = (int64_t)table[t / block_size] * block_size + t % block_size;
        for (int64_t kv_head = head_begin; kv_head < head_end; kv_head++) {
            tile_rows(v_cache, first_slot, count, kv_head, num_kv_heads, head_dim, dtype, tmp, rows);
            const float *v0 = rows[0], *v1 = rows[1], *v2 = rows[2], *v3 = rows[3];
            const float *v4 = rows[4], *v5 = rows[5], *v6 = rows[6], *v7 = rows[7];
            for (int64_t h = (kv_head - head_begin) * group; h < (kv_head - head_begin + 1) * group; h++) {
                float p[TILE] = {0};
                for (int64_t j = 0; j < count; j++) p[j] = scores[h * len + (t - first) + j];
                float *ah = acc + h * head_dim;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; d++) {
                    ah[d] += p[0] * v0[d] + p[1] * v1[d] + p[2] * v2[d] + p[3] * v3[d] + p[4] * v4[d] +
                             p[5] * v5[d] + p[6] * v6[d] + p[7] * v7[d];
                }
            }
        }
        t += count;
    }

    for (int64_t h = 0; h < heads; h++) {
        store_row(out, (row * num_heads + head_begin * group + h) * head_dim, acc + h * head_dim, head_dim, dtype);
    }
}

/* Decode attention for n sequences with one new token each.
 *   q, out      [T, num_heads, head_dim] (q's rows q_row_stride apart); item i reads and writes row rows[i]
 *   seqs[i]     item i's index into block_tables and seq_lens
 *   window      keys older than `window` positions are skipped (0 = no sliding window)
 *   max_seq_len the longest seq_lens[seqs[i]] (sizes the per-thread scratch)
 * A work item is a whole sequence when there are enough of them to keep every thread busy, else one
 * KV head of a sequence. Returns 0, or 1 when scratch memory could not be allocated (out is then
 * incomplete).
 */
int paged_decode(const void *q, int64_t q_row_stride, const void *k_cache, const void *v_cache, const int32_t *block_tables,
                 int64_t table_stride, const int32_t *seq_lens, const int64_t *rows, const int64_t *seqs,
                 int64_t n, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                 int64_t window, float scale, int dtype, void *out, int64_t max_seq_len, int num_threads) {
    const int64_t heads_per_item = n >= 4 * (int64_t)num_threads ? num_kv_heads : 1;
    const int64_t items_per_seq = num_kv_heads / heads_per_item;
    const int64_t query_heads = heads_per_item * (num_heads / num_kv_heads);
    const size_t scratch_floats = (size_t)(query_heads * (max_seq_len + 2 * head_dim) + TILE * head_dim);
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *scratch = (float *)malloc(sizeof(float) * scratch_floats);
        if (scratch == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < n * items_per_seq; item++) {
            if (scratch == NULL) continue;
            const int64_t i = item / items_per_seq;
            const int64_t head_begin = (item % items_per_seq) * heads_per_item;
            decode_item(q, q_row_stride, k_cache, v_cache, block_tables + seqs[i] * table_stride, seq_lens[seqs[i]], rows[i],
                        head_begin, head_begin + heads_per_item, num_heads, num_kv_heads, head_dim, block_size,
                        window, scale, dtype, out, scratch);
        }
        free(scratch);
    }
    return failed;
}

/* ---- the model's elementwise steps ---------------------------------------------------------------- */

/* Rows are split over threads only when there is enough work to pay for waking them. */
static inline int threads_for(int64_t elements, int num_threads) { return elements >= 65536 ? num_threads : 1; }

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
            for (int64_t i = 0; i < hidden; i++) {
                float v = bf16_to_float(xr[i]);
                if (res) {
                    res[i] = float_to_bf16(v + bf16_to_float(res[i]));
                    v = bf16_to_float(res[i]);
                }
                sum_sq += v * v;
            }
            const uint16_t *src = res ? res : xr;
            const float inv = 1.0f / sqrtf(sum_sq / (float)hidden + eps);
            const uint16_t *w = (const uint16_t *)weight;
            uint16_t *o = (uint16_t *)out + base;
            for (int64_t i = 0; i < hidden; i++) {
                const float normed = bf16_to_float(float_to_bf16(bf16_to_float(src[i]) * inv));
                o[i] = float_to_bf16(bf16_to_float(w[i]) * normed);
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
            for (int64_t i = 0; i < width; i++) {
                const float gi = bf16_to_float(g[i]);
                const float act = bf16_to_float(float_to_bf16(gi / (1.0f + exp_approx(-gi))));
                o[i] = float_to_bf16(act * bf16_to_float(u[i]));
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
                for (int64_t i = 0; i < half; i++) {
                    const float ai = bf16_to_float(a[i]), bi = bf16_to_float(b[i]);
                    a[i] = float_to_bf16(ai * c[i] - bi * s[i]);
                    b[i] = float_to_bf16(bi * c[i] + ai * s[i]);
                }
            }
        }
    }
}
