/* One decoder layer of a decode step in one call, for float weights (engine/model/dense_layer.py).
 *
 * The counterpart of decode_layer.c for float32 / bfloat16 weights at the rows dense_linear takes (one to
 * four): a SmolLM2 layer's products then take ~0.4 ms (bfloat16) while the per-op path (model/llama.py)
 * made ten Python calls a layer, ~0.2 ms of tensor checks, allocations and ctypes calls. The same kernels
 * with the same arguments as the per-op path, so the outputs are bit-identical to it
 * (tests/engine/test_dense_layer.py):
 *
 *   residual += hidden; normed = RMSNorm(residual)         (first layer: residual = hidden)
 *   qkv = normed Wqkv^T (+ b); rotary on q and k; k, v -> the KV cache at the rows' slots
 *   attended = (paged decode attention of q) Wo^T (+ b)
 *   residual += attended; normed = RMSNorm(residual)
 *   hidden = (silu(gate) * up of normed Wgate_up^T) Wdown^T
 *
 * The KV cache holds the activations' dtype (a float8 cache takes the per-op path).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

enum { DENSE_LAYER_BFLOAT16 = 1 };

/* A weight [rows, columns] as the checkpoint holds it, with its bias (NULL: none). */
struct dense_matrix {
    const void *weight;
    const void *bias;
    int64_t rows; /* output features */
};

/* A layer's weights and shapes: fixed after loading (dense_layer.py builds it once per layer). */
struct dense_layer_weights {
    const void *input_norm, *post_norm;
    struct dense_matrix qkv, o, gate_up, down;
    int64_t hidden, num_heads, num_kv_heads, head_dim, intermediate;
    float eps, scale;
};

/* The step's rows and where they attend: the same for every layer (dense_layer.py builds it once a step). */
struct dense_step {
    const float *cos, *sin;        /* [rows, head_dim / 2] float32 */
    const int64_t *slots;          /* [rows]: each row's KV cache slot */
    const int32_t *block_tables;   /* [seqs, table_stride] */
    const int32_t *lens;           /* paged_decode's rows / seqs / lens */
    const int64_t *query_rows, *seqs;
    int64_t rows, table_stride, block_size, window, max_seq_len;
    int64_t dtype, num_threads;
};

static int product(const struct dense_matrix *m, const void *x, int64_t rows, int64_t k, int dtype, void *out,
                   int num_threads) {
    return dense_linear(x, rows, k, m->weight, m->rows, m->bias, dtype, out, num_threads);
}

/* One decoder layer for s->rows decode rows (see the top of the file). `hidden` [rows, hidden]: the
 * previous layer's MLP output (the embeddings for the first layer), replaced by this layer's;
 * `residual` [rows, hidden]: the residual stream, updated in place (`first`: it is set from `hidden`).
 * Returns 0, or -1 when a buffer could not be allocated or a kernel refused (the outputs are then
 * incomplete). */
int dense_decode_layer(const struct dense_layer_weights *w, const struct dense_step *s, void *hidden,
                       void *residual, int first, void *k_cache, void *v_cache) {
    const int64_t rows = s->rows, h = w->hidden, d = w->head_dim;
    const int dtype = (int)s->dtype, threads = (int)s->num_threads;
    const int64_t elem = dtype == DENSE_LAYER_BFLOAT16 ? 2 : 4;
    const int64_t q_size = w->num_heads * d, kv_size = w->num_kv_heads * d, qkv_width = w->qkv.rows;
    /* One buffer for the step's intermediates: normed [rows, h], qkv [rows, qkv_width], attention
     * output [rows, q_size], gate_up [rows, 2 * intermediate], silu * up [rows, intermediate]. */
    const int64_t total = rows * (h + qkv_width + q_size + 3 * w->intermediate);
    char *buffer = malloc((size_t)(total * elem));
    if (buffer == NULL) return -1;
    char *normed = buffer, *qkv = normed + rows * h * elem, *attention = qkv + rows * qkv_width * elem;
    char *gate_up = attention + rows * q_size * elem, *act = gate_up + rows * 2 * w->intermediate * elem;
    int failed = 0;

    if (first) {
        memcpy(residual, hidden, (size_t)(rows * h * elem));
        rms_norm(residual, NULL, w->input_norm, normed, rows, h, w->eps, dtype, threads);
    } else {
        rms_norm(hidden, residual, w->input_norm, normed, rows, h, w->eps, dtype, threads);
    }
    failed |= product(&w->qkv, normed, rows, h, dtype, qkv, threads);
    rotary(qkv, qkv_width, s->cos, s->sin, rows, w->num_heads + w->num_kv_heads, d, dtype, threads);
    const char *k = qkv + q_size * elem, *v = k + kv_size * elem;
    write_kv(k, v, qkv_width * elem, k_cache, v_cache, s->slots, rows, kv_size * elem);
    failed |= paged_decode(qkv, qkv_width, k_cache, v_cache, s->block_tables, s->table_stride, s->lens,
                           s->query_rows, s->seqs, rows, w->num_heads, w->num_kv_heads, d, s->block_size,
                           s->window, w->scale, dtype, dtype, attention, s->max_seq_len, threads);
    /* The o_proj output goes into `hidden` (the layer's input is in `residual` by now). */
    failed |= product(&w->o, attention, rows, q_size, dtype, hidden, threads);
    rms_norm(hidden, residual, w->post_norm, normed, rows, h, w->eps, dtype, threads);
    failed |= product(&w->gate_up, normed, rows, h, dtype, gate_up, threads);
    silu_and_mul(gate_up, act, rows, w->intermediate, dtype, threads);
    failed |= product(&w->down, act, rows, w->intermediate, dtype, hidden, threads);
    free(buffer);
    return failed ? -1 : 0;
}
