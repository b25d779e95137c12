/* A decode step's decoder layers in one call (engine/model/decode_layer.py), for weights kept quantized
 * (products by quant_linear) or float weights at the rows dense_linear takes (products by dense_linear): each
 * layer's weights struct says which.
 *
 * At batch 1 a quantized layer's work is ~0.2 ms of products (a float SmolLM2 layer's ~0.25 ms in
 * bfloat16) and a few tens of microseconds of elementwise steps, while the per-op path (model/llama.py)
 * made ten Python calls a layer, each with its tensor checks, allocations and a ctypes call: several
 * milliseconds a step over 30 layers. Even one Python call a layer, with its checks, cost ~0.2 ms of a
 * ~10 ms SmolLM2 bfloat16 step at batch 1, so decode_layers runs a whole run of layers in one call. Each
 * layer chains the same kernels (kernels.h: kernels.c's and quant_kernels.c's exported functions, nothing
 * duplicated) in C:
 *
 *   (first layer: hidden = the rows' embeddings, residual = hidden; else residual += hidden)
 *   normed = RMSNorm(residual)
 *   qkv = normed Wqkv^T (+ b); rotary on q and k; k, v -> the KV cache at the rows' slots
 *   attended = (paged decode attention of q) Wo^T (+ b)
 *   residual += attended; normed = RMSNorm(residual)
 *   hidden = (silu(gate) * up of normed Wgate_up^T) Wdown^T
 *   (after the model's last layer: hidden = RMSNorm(residual + hidden), the model's output)
 *
 * with the arguments the per-op path gives each kernel, so the outputs are bit-identical to it
 * (tests/engine/test_decode_layer.py, tests/engine/test_dense_layer.py). The one step written here is the
 * float8 KV cache store (quantized weights only): keys and values saturated to +-448 and rounded to nearest
 * even, as kv_store.to_cache does with torch (c10's fp8e4m3fn_from_fp32_value, below).
 *
 * The rows' rotary values are looked up here in the model's tables by their positions, once a call, and the
 * embedding lookup and the last norm run here too: in Python and torch calls the three cost ~0.3 ms of a
 * ~12 ms SmolLM2 bfloat16 step at batch 1 (docs/benchmarks.md).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "float_bits.h"
#include "kernels.h"

enum { LAYER_FLOAT32 = 0, LAYER_BFLOAT16 = 1, LAYER_FP8_E4M3 = 2 };
/* struct decode_layer_weights' `product`: how its matrices are multiplied. */
enum { PRODUCT_QUANTIZED = 0, PRODUCT_DENSE = 1 };
/* decode_layers' refusals of its inputs (decode_layer.py raises IndexError). */
enum { DECODE_TOKEN_OUT_OF_RANGE = -2, DECODE_POSITION_OUT_OF_RANGE = -3 };

/* A weight matrix with its bias (NULL: none). PRODUCT_QUANTIZED: `weight` in quant_kernels.c's interleaved
 * layout, with `scales`, `mins` and `format`; PRODUCT_DENSE: `weight` [rows, columns] as the checkpoint
 * holds it (scales and mins NULL). */
struct matrix {
    const void *weight;
    const void *scales; /* float16 or float32, as `format` says */
    const void *mins;   /* NULL for the s8 format */
    const void *bias;
    int64_t rows;      /* output features */
    int64_t format;
};

/* A layer's weights and shapes: fixed after loading (decode_layer.py builds it once per layer). */
struct decode_layer_weights {
    int64_t product;
    const void *input_norm, *post_norm;
    struct matrix qkv, o, gate_up, down;
    int64_t hidden, num_heads, num_kv_heads, head_dim, intermediate;
    float eps, scale;
};

/* The step's rows and where they attend: the same for every layer (decode_layer.py builds it once a step). */
struct decode_step {
    const int64_t *positions;      /* [rows]: each row's position, its row of `cos` and `sin` */
    const float *cos, *sin;        /* [positions_held, head_dim / 2] float32: the model's rotary tables */
    int64_t positions_held;
    const int64_t *token_ids;      /* [rows]: looked up in `embedding` where the first layer runs here */
    const void *embedding;         /* [vocab, hidden] in the activations' dtype; NULL: `hidden` holds them */
    int64_t vocab;
    const void *final_norm;        /* [hidden]: the model's last RMSNorm, applied after its last layer */
    float final_eps;
    const int64_t *slots;          /* [rows]: each row's KV cache slot */
    const int32_t *block_tables;   /* [seqs, table_stride] */
    const int32_t *lens;           /* paged_decode's rows / seqs / lens */
    const int64_t *query_rows, *seqs;
    int64_t rows, table_stride, block_size, window, max_seq_len;
    int64_t dtype, kv_dtype, num_threads;
};

/* float -> float8 e4m3fn: torch's conversion (c10 fp8e4m3fn_from_fp32_value), after saturating to +-448
 * (kv_store.to_cache's clamp; NaN stays NaN). */
static uint8_t to_fp8(float f) {
    if (f > 448.0f) f = 448.0f;
    else if (f < -448.0f) f = -448.0f;
    const uint32_t fp8_max = UINT32_C(1087) << 20, denorm_mask = UINT32_C(141) << 23;
    uint32_t f_bits = bits_of(f);
    const uint32_t sign = f_bits & UINT32_C(0x80000000);
    f_bits ^= sign;
    uint8_t result;
    if (f_bits >= fp8_max) {
        result = f_bits > UINT32_C(0x7F800000) ? 0x7f : 0x7e;
    } else if (f_bits < (UINT32_C(121) << 23)) {
        f_bits = bits_of(float_of(f_bits) + float_of(denorm_mask));
        result = (uint8_t)(f_bits - denorm_mask);
    } else {
        const uint32_t mant_odd = (f_bits >> 20) & 1;
        f_bits += ((uint32_t)(7 - 127) << 23) + 0x7FFFF;
        f_bits += mant_odd;
        result = (uint8_t)(f_bits >> 20);
        if (result == 0x7f) result = 0x7e;
    }
    return (uint8_t)(result | (sign >> 24));
}

/* Row t of k and of v (`count` values each, rows `row_stride` elements apart, in `dtype`) stored as float8
 * at slot slots[t] of k_cache and v_cache. */
static void write_kv_fp8(const void *k, const void *v, int64_t row_stride, int64_t dtype, uint8_t *k_cache,
                         uint8_t *v_cache, const int64_t *slots, int64_t rows, int64_t count) {
    for (int64_t t = 0; t < rows; t++) {
        uint8_t *kd = k_cache + slots[t] * count, *vd = v_cache + slots[t] * count;
        for (int64_t i = 0; i < count; i++) {
            float kf, vf;
            if (dtype == LAYER_BFLOAT16) {
                kf = bf16_to_float(((const uint16_t *)k)[t * row_stride + i]);
                vf = bf16_to_float(((const uint16_t *)v)[t * row_stride + i]);
            } else {
                kf = ((const float *)k)[t * row_stride + i];
                vf = ((const float *)v)[t * row_stride + i];
            }
            kd[i] = to_fp8(kf);
            vd[i] = to_fp8(vf);
        }
    }
}

/* out = x m^T (+ bias) for `rows` rows of x [rows, k], by the kernel the layer's `product` names. */
static int product(int64_t kind, const struct matrix *m, const void *x, int64_t rows, int64_t k, int dtype,
                   void *out, int num_threads) {
    if (kind == PRODUCT_DENSE)
        return dense_linear(x, rows, k, m->weight, m->rows, m->bias, dtype, out, dtype, num_threads);
    return quant_linear(x, rows, k, m->weight, m->scales, m->mins, (int)m->format, m->rows, m->bias, dtype, out,
                        dtype, num_threads);
}

/* The bytes of decode_layer's intermediates for layer w at `rows` rows of `elem` bytes: normed [rows,
 * hidden], qkv [rows, qkv width], attention output [rows, q size], gate_up [rows, 2 * intermediate], silu * up
 * [rows, intermediate]. */
static int64_t intermediate_bytes(const struct decode_layer_weights *w, int64_t rows, int64_t elem) {
    return rows * (w->hidden + w->qkv.rows + w->num_heads * w->head_dim + 3 * w->intermediate) * elem;
}

/* One decoder layer for s->rows decode rows (see the top of the file), with the rows' rotary `cos` and `sin`
 * ([rows, head_dim / 2]), its intermediates in `buffer` (intermediate_bytes). `hidden` [rows, hidden]: the
 * previous layer's MLP output (the embeddings for the first layer), replaced by this layer's; `residual` [rows, hidden]: the residual stream, updated in place
 * (`first`: it is set from `hidden`). Returns 0, or -1 when a kernel refused (the outputs are then
 * incomplete). */
static int decode_layer(const struct decode_layer_weights *w, const struct decode_step *s, const float *cos,
                        const float *sin, void *hidden, void *residual, int first, void *k_cache, void *v_cache,
                        char *buffer) {
    const int64_t rows = s->rows, h = w->hidden, d = w->head_dim;
    const int dtype = (int)s->dtype, threads = (int)s->num_threads;
    const int64_t elem = dtype == LAYER_BFLOAT16 ? 2 : 4;
    const int64_t q_size = w->num_heads * d, kv_size = w->num_kv_heads * d, qkv_width = w->qkv.rows;
    char *normed = buffer, *qkv = normed + rows * h * elem, *attention = qkv + rows * qkv_width * elem;
    char *gate_up = attention + rows * q_size * elem, *act = gate_up + rows * 2 * w->intermediate * elem;
    int failed = 0;

    if (first) {
        memcpy(residual, hidden, (size_t)(rows * h * elem));
        rms_norm(residual, NULL, w->input_norm, normed, rows, h, w->eps, dtype, threads);
    } else {
        rms_norm(hidden, residual, w->input_norm, normed, rows, h, w->eps, dtype, threads);
    }
    failed |= product(w->product, &w->qkv, normed, rows, h, dtype, qkv, threads);
    rotary(qkv, qkv_width, cos, sin, rows, w->num_heads + w->num_kv_heads, d, dtype, threads);
    const char *k = qkv + q_size * elem, *v = k + kv_size * elem;
    if (s->kv_dtype == LAYER_FP8_E4M3)
        write_kv_fp8(k, v, qkv_width, dtype, k_cache, v_cache, s->slots, rows, kv_size);
    else
        write_kv(k, v, qkv_width * elem, k_cache, v_cache, s->slots, rows, kv_size * elem);
    failed |= paged_decode(qkv, qkv_width, k_cache, v_cache, s->block_tables, s->table_stride, s->lens,
                           s->query_rows, s->seqs, rows, w->num_heads, w->num_kv_heads, d, s->block_size,
                           s->window, w->scale, dtype, (int)s->kv_dtype, attention, s->max_seq_len, threads);
    /* The o_proj output goes into `hidden` (the layer's input is in `residual` by now). */
    failed |= product(w->product, &w->o, attention, rows, q_size, dtype, hidden, threads);
    rms_norm(hidden, residual, w->post_norm, normed, rows, h, w->eps, dtype, threads);
    failed |= product(w->product, &w->gate_up, normed, rows, h, dtype, gate_up, threads);
    silu_and_mul(gate_up, act, rows, w->intermediate, dtype, threads);
    failed |= product(w->product, &w->down, act, rows, w->intermediate, dtype, hidden, threads);
    return failed ? -1 : 0;
}

/* The step's rows' rotary values, [rows, half] each in cos and sin, gathered from the model's tables;
 * DECODE_POSITION_OUT_OF_RANGE where a position is not in them. */
static int gather_rotary(const struct decode_step *s, int64_t half, float *cos, float *sin) {
    for (int64_t r = 0; r < s->rows; r++) {
        const int64_t p = s->positions[r];
        if (p < 0 || p >= s->positions_held) return DECODE_POSITION_OUT_OF_RANGE;
        memcpy(cos + r * half, s->cos + p * half, (size_t)half * sizeof(float));
        memcpy(sin + r * half, s->sin + p * half, (size_t)half * sizeof(float));
    }
    return 0;
}

/* The rows' embeddings (rows of s->embedding by s->token_ids) into `hidden`, as the embedding lookup copies
 * them; DECODE_TOKEN_OUT_OF_RANGE where an id is not in the vocabulary. */
static int gather_embeddings(const struct decode_step *s, int64_t h, int64_t elem, char *hidden) {
    for (int64_t r = 0; r < s->rows; r++) {
        const int64_t id = s->token_ids[r];
        if (id < 0 || id >= s->vocab) return DECODE_TOKEN_OUT_OF_RANGE;
        memcpy(hidden + r * h * elem, (const char *)s->embedding + id * h * elem, (size_t)(h * elem));
    }
    return 0;
}

/* `count` consecutive decoder layers of a decode step, layers[i] with its caches k_caches[i] and
 * v_caches[i], each as decode_layer runs it: `hidden` and `residual` as decode_layer takes them. `first`:
 * layers[0] is the model's first layer (with s->embedding, `hidden` is filled with the rows' embeddings
 * first); `last`: the last layer is the model's, and `hidden` ends as the model's output, RMSNorm(residual +
 * hidden) * s->final_norm, as the model's last norm gives it. Returns 0; -1 when a buffer could not be
 * allocated or a kernel refused (the outputs are then incomplete); DECODE_TOKEN_OUT_OF_RANGE or
 * DECODE_POSITION_OUT_OF_RANGE before any work. */
int decode_layers(const struct decode_layer_weights *const *layers, void *const *k_caches, void *const *v_caches,
                  int64_t count, const struct decode_step *s, void *hidden, void *residual, int first, int last) {
    const int64_t elem = s->dtype == LAYER_BFLOAT16 ? 2 : 4, h = layers[0]->hidden;
    const int64_t half = layers[0]->head_dim / 2;
    /* The rows' cos and sin first, the layers' intermediates after them, from a 64-byte boundary. */
    const int64_t rotary_bytes = (2 * s->rows * half * (int64_t)sizeof(float) + 63) / 64 * 64;
    int64_t bytes = 0;
    for (int64_t i = 0; i < count; i++) {
        const int64_t layer_bytes = intermediate_bytes(layers[i], s->rows, elem);
        if (layer_bytes > bytes) bytes = layer_bytes;
    }
    char *allocated = malloc((size_t)(rotary_bytes + bytes));
    if (allocated == NULL) return -1;
    float *cos = (float *)allocated, *sin = cos + s->rows * half;
    char *buffer = allocated + rotary_bytes;
    int failed = gather_rotary(s, half, cos, sin);
    if (!failed && first && s->embedding != NULL) failed = gather_embeddings(s, h, elem, hidden);
    for (int64_t i = 0; i < count && !failed; i++)
        failed = decode_layer(layers[i], s, cos, sin, hidden, residual, first && i == 0, k_caches[i], v_caches[i],
                              buffer);
    if (!failed && last) {
        /* normed into the buffer, then over `hidden`: rms_norm reads x while it writes out. */
        rms_norm(hidden, residual, s->final_norm, buffer, s->rows, h, s->final_eps, (int)s->dtype,
                 (int)s->num_threads);
        memcpy(hidden, buffer, (size_t)(s->rows * h * elem));
    }
    free(allocated);
    return failed;
}
