/* The exported kernels of kernels.c and quant_kernels.c that decode_layer.c chains into one decoder layer:
 * one declaration for the files that define them and the file that calls them (compiled into the same
 * library by kernels.py). Argument meanings: at each definition. */
#ifndef INFLIGHT_KERNELS_H
#define INFLIGHT_KERNELS_H

#include <stdint.h>

int paged_decode(const void *q, int64_t q_row_stride, const void *k_cache, const void *v_cache, const int32_t *block_tables,
                 int64_t table_stride, const int32_t *lens, const int64_t *rows, const int64_t *seqs,
                 int64_t n, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                 int64_t window, float scale, int dtype, int kv_dtype, void *out, int64_t max_seq_len,
                 int num_threads);
void rms_norm(const void *x, void *residual, const void *weight, void *out, int64_t rows, int64_t hidden,
              float eps, int dtype, int num_threads);
void silu_and_mul(const void *gate_up, void *out, int64_t rows, int64_t width, int dtype, int num_threads);
void rotary(void *x, int64_t row_stride, const float *cos, const float *sin, int64_t rows, int64_t heads,
            int64_t head_dim, int dtype, int num_threads);
void write_kv(const void *k, const void *v, int64_t row_stride, void *k_cache, void *v_cache, const int64_t *slots,
              int64_t rows, int64_t row_bytes);
int dense_linear(const void *x, int64_t rows, int64_t k, const void *w, int64_t n, const void *bias, int dtype,
                 void *out, int out_dtype, int num_threads);
int quant_linear(const void *x, int64_t rows, int64_t k, const uint8_t *qweight, const void *scales,
                 const void *mins, int format, int64_t n, const void *bias, int dtype, void *out, int out_dtype,
                 int num_threads);

#endif
