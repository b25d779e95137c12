/* One decoder layer of a decode step in one call, for weights kept quantized (engine/model/decode_layer.py).
 *
 * At batch 1 a layer's work is ~0.2 ms of products and a few tens of microseconds of elementwise steps,
 * while the per-op path (model/llama.py) made ten Python calls a layer, each with its tensor checks,
 * allocations and a ctypes call: several milliseconds a step over 30 layers. decode_layer chains the same
 * kernels (kernels.h: kernels.c's and quant_kernels.c's exported functions, nothing duplicated) in C:
 *
 *   residual += hidden; normed = RMSNorm(residual)         (first layer: residual = hidden)
 *   qkv = normed Wqkv^T (+ b); rotary on q and k; k, v -> the KV cache at the rows' slots
 *   attended = (paged decode attention of q) Wo^T (+ b)
 *   residual += attended; normed = RMSNorm(residual)
 *   hidden = (silu(gate) * up of normed Wgate_up^T) Wdown^T
 *
 * with the arguments the per-op path gives each kernel, so the outputs are bit-identical to it
 * (tests/engine/test_decode_layer.py). The one step written here is the float8 KV cache store: keys and
 * values saturated to +-448 and rounded to nearest even, as kv_store.to_cache does with torch (c10's
 * fp8e4m3fn_from_fp32_value, below).
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define HELPER_PAUSE() _mm_pause()
#else
#define HELPER_PAUSE() ((void)0)
#endif

#include "kernels.h"

enum { LAYER_FLOAT32 = 0, LAYER_BFLOAT16 = 1, LAYER_FP8_E4M3 = 2 };

/* A weight matrix in quant_kernels.c's interleaved layout, with its bias (NULL: none). */
struct qmatrix {
    const uint8_t *qweight;
    const float *scales;
    const float *mins; /* NULL for the s8 format */
    const void *bias;
    int64_t rows;      /* output features */
    int64_t format;
};

/* A layer's weights and shapes: fixed after loading (decode_layer.py builds it once per layer). */
struct decode_layer_weights {
    const void *input_norm, *post_norm;
    struct qmatrix qkv, o, gate_up, down;
    int64_t hidden, num_heads, num_kv_heads, head_dim, intermediate;
    float eps, scale;
};

/* The step's rows and where they attend: the same for every layer (decode_layer.py builds it once a step). */
struct decode_step {
    const float *cos, *sin;        /* [rows, head_dim / 2] float32 */
    const int64_t *slots;          /* [rows]: each row's KV cache slot */
    const int32_t *block_tables;   /* [seqs, table_stride] */
    const int32_t *lens;           /* paged_decode's rows / seqs / lens */
    const int64_t *query_rows, *seqs;
    int64_t rows, table_stride, block_size, window, max_seq_len;
    int64_t dtype, kv_dtype, num_threads;
};

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
                kf = float_of((uint32_t)((const uint16_t *)k)[t * row_stride + i] << 16);
                vf = float_of((uint32_t)((const uint16_t *)v)[t * row_stride + i] << 16);
            } else {
                kf = ((const float *)k)[t * row_stride + i];
                vf = ((const float *)v)[t * row_stride + i];
            }
            kd[i] = to_fp8(kf);
            vd[i] = to_fp8(vf);
        }
    }
}

/* ---- the helper thread ----------------------------------------------------------------------------
 * A batch-1 layer's products take 10-40 us each: waking an OpenMP thread for one cost more than it saved
 * on a shared machine, and its barrier waits for a thread that another process preempted. Here one
 * persistent helper thread shares a product's output groups with the calling thread instead: a job is
 * published as one 64-bit word (generation << 32 | next chunk), and either thread claims the next chunk
 * with a compare-and-swap on it. The caller claims chunks too and then waits only for the chunks the
 * helper did claim, so a helper that is asleep or preempted before claiming costs nothing: the caller
 * does the work. The helper spins on the word for HELPER_SPINS pauses (a step's products follow each
 * other within that), then sleeps on a condition variable until the next job. The output of a group
 * does not depend on the thread that computes it. */
enum { HELPER_SPINS = 1 << 14, HELPER_CHUNKS = 16 };

static struct {
    pthread_mutex_t mutex;     /* guards `sleeping` transitions with `wake` */
    pthread_cond_t wake;
    pthread_mutex_t caller;    /* one calling thread at a time; others run their products alone */
    pthread_once_t once;
    int started;               /* the helper thread exists */
    _Atomic uint64_t word;     /* generation << 32 | next chunk */
    _Atomic int64_t done;      /* chunks of the current job finished */
    _Atomic int sleeping;
    /* The current job: written before its word is published, checked by the claim's compare-and-swap. */
    _Atomic(group_fn) fn;
    _Atomic(const void *) context;
    _Atomic int64_t groups, chunk, chunks;
} helper = {.mutex = PTHREAD_MUTEX_INITIALIZER, .wake = PTHREAD_COND_INITIALIZER,
            .caller = PTHREAD_MUTEX_INITIALIZER, .once = PTHREAD_ONCE_INIT};

/* Claim and run chunks of job `generation` until none is left; returns how many this thread ran. */
static int64_t helper_work(uint32_t generation) {
    int64_t ran = 0;
    uint64_t word = atomic_load(&helper.word);
    for (;;) {
        if ((uint32_t)(word >> 32) != generation) return ran;
        const int64_t next = (int64_t)(uint32_t)word, chunks = atomic_load_explicit(&helper.chunks, memory_order_relaxed);
        if (next >= chunks) return ran;
        const group_fn fn = atomic_load_explicit(&helper.fn, memory_order_relaxed);
        const void *context = atomic_load_explicit(&helper.context, memory_order_relaxed);
        const int64_t groups = atomic_load_explicit(&helper.groups, memory_order_relaxed);
        const int64_t chunk = atomic_load_explicit(&helper.chunk, memory_order_relaxed);
        /* Success: the word was unchanged since it was read, so the fields above were this job's. */
        if (!atomic_compare_exchange_weak(&helper.word, &word, word + 1)) continue;
        const int64_t g1 = (next + 1) * chunk < groups ? (next + 1) * chunk : groups;
        fn(context, next * chunk, g1);
        atomic_fetch_add(&helper.done, 1);
        ran++;
        word = atomic_load(&helper.word);
    }
}

static void *helper_main(void *unused) {
    (void)unused;
    uint32_t seen = (uint32_t)(atomic_load(&helper.word) >> 32);
    for (;;) {
        int spins = 0;
        while ((uint32_t)(atomic_load(&helper.word) >> 32) == seen) {
            if (++spins < HELPER_SPINS) {
                HELPER_PAUSE();
                continue;
            }
            pthread_mutex_lock(&helper.mutex);
            atomic_store(&helper.sleeping, 1);
            while ((uint32_t)(atomic_load(&helper.word) >> 32) == seen) pthread_cond_wait(&helper.wake, &helper.mutex);
            atomic_store(&helper.sleeping, 0);
            pthread_mutex_unlock(&helper.mutex);
        }
        seen = (uint32_t)(atomic_load(&helper.word) >> 32);
        helper_work(seen);
    }
    return NULL;
}

static void helper_start(void) {
    pthread_t thread;
    pthread_attr_t attr;
    if (pthread_attr_init(&attr) != 0) return;
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    helper.started = pthread_create(&thread, &attr, helper_main, NULL) == 0;
    pthread_attr_destroy(&attr);
}

/* group_spreader over the calling thread and the helper (the caller holds helper.caller). */
static void helper_spread(int64_t groups, group_fn fn, const void *context) {
    const int64_t chunk = (groups + HELPER_CHUNKS - 1) / HELPER_CHUNKS, chunks = (groups + chunk - 1) / chunk;
    atomic_store_explicit(&helper.fn, fn, memory_order_relaxed);
    atomic_store_explicit(&helper.context, context, memory_order_relaxed);
    atomic_store_explicit(&helper.groups, groups, memory_order_relaxed);
    atomic_store_explicit(&helper.chunk, chunk, memory_order_relaxed);
    atomic_store_explicit(&helper.chunks, chunks, memory_order_relaxed);
    atomic_store(&helper.done, 0);
    const uint32_t generation = (uint32_t)(atomic_load(&helper.word) >> 32) + 1;
    atomic_store(&helper.word, (uint64_t)generation << 32);
    if (atomic_load(&helper.sleeping)) {
        pthread_mutex_lock(&helper.mutex);
        pthread_cond_signal(&helper.wake);
        pthread_mutex_unlock(&helper.mutex);
    }
    helper_work(generation);
    while (atomic_load(&helper.done) < chunks) HELPER_PAUSE();
}

/* Whether this call's products share their groups with the helper: int8 products (the others are
 * float and OpenMP's), at least 2 threads, and no other thread using the helper now. Takes
 * helper.caller when it answers 1. */
static int helper_acquire(int num_threads) {
    if (num_threads < 2 || !quant_linear_int8_activations()) return 0;
    pthread_once(&helper.once, helper_start);
    return helper.started && pthread_mutex_trylock(&helper.caller) == 0;
}

static int product(const struct qmatrix *w, const void *x, int64_t rows, int64_t k, int dtype, void *out,
                   int num_threads, int shared) {
    return quant_linear_spread(x, rows, k, w->qweight, w->scales, w->mins, (int)w->format, w->rows, w->bias,
                               dtype, out, dtype, num_threads, shared ? helper_spread : NULL);
}

/* One decoder layer for s->rows decode rows (see the top of the file). `hidden` [rows, hidden]: the
 * previous layer's MLP output (the embeddings for the first layer), replaced by this layer's;
 * `residual` [rows, hidden]: the residual stream, updated in place (`first`: it is set from `hidden`).
 * Returns 0, or -1 when a buffer could not be allocated (the outputs are then incomplete). */
int decode_layer(const struct decode_layer_weights *w, const struct decode_step *s, void *hidden, void *residual,
                 int first, void *k_cache, void *v_cache) {
    const int64_t rows = s->rows, h = w->hidden, d = w->head_dim;
    const int dtype = (int)s->dtype, threads = (int)s->num_threads;
    const int64_t elem = dtype == LAYER_BFLOAT16 ? 2 : 4;
    const int64_t q_size = w->num_heads * d, kv_size = w->num_kv_heads * d, qkv_width = w->qkv.rows;
    /* One buffer for the step's intermediates: normed [rows, h], qkv [rows, qkv_width], attention
     * output [rows, q_size], gate_up [rows, 2 * intermediate], silu * up [rows, intermediate]. */
    const int64_t total = rows * (h + qkv_width + q_size + 3 * w->intermediate);
    char *buffer = malloc((size_t)(total * elem));
    if (buffer == NULL) return -1;
    char *normed = buffer, *qkv = normed + rows * h * elem, *attention = qkv + rows * qkv_width * elem;
    char *gate_up = attention + rows * q_size * elem, *act = gate_up + rows * 2 * w->intermediate * elem;
    int failed = 0;
    const int shared = helper_acquire(threads);

    if (first) {
        memcpy(residual, hidden, (size_t)(rows * h * elem));
        rms_norm(residual, NULL, w->input_norm, normed, rows, h, w->eps, dtype, threads);
    } else {
        rms_norm(hidden, residual, w->input_norm, normed, rows, h, w->eps, dtype, threads);
    }
    failed |= product(&w->qkv, normed, rows, h, dtype, qkv, threads, shared);
    rotary(qkv, qkv_width, s->cos, s->sin, rows, w->num_heads + w->num_kv_heads, d, dtype, threads);
    const char *k = qkv + q_size * elem, *v = k + kv_size * elem;
    if (s->kv_dtype == LAYER_FP8_E4M3)
        write_kv_fp8(k, v, qkv_width, dtype, k_cache, v_cache, s->slots, rows, kv_size);
    else
        write_kv(k, v, qkv_width * elem, k_cache, v_cache, s->slots, rows, kv_size * elem);
    failed |= paged_decode(qkv, qkv_width, k_cache, v_cache, s->block_tables, s->table_stride, s->lens,
                           s->query_rows, s->seqs, rows, w->num_heads, w->num_kv_heads, d, s->block_size,
                           s->window, w->scale, dtype, (int)s->kv_dtype, attention, s->max_seq_len, threads);
    /* The o_proj output goes into `hidden` (the layer's input is in `residual` by now). */
    failed |= product(&w->o, attention, rows, q_size, dtype, hidden, threads, shared);
    rms_norm(hidden, residual, w->post_norm, normed, rows, h, w->eps, dtype, threads);
    failed |= product(&w->gate_up, normed, rows, h, dtype, gate_up, threads, shared);
    silu_and_mul(gate_up, act, rows, w->intermediate, dtype, threads);
    failed |= product(&w->down, act, rows, w->intermediate, dtype, hidden, threads, shared);
    if (shared) pthread_mutex_unlock(&helper.caller);
    free(buffer);
    return failed ? -1 : 0;
}
