/* The float32 blocked product (kernels.c's dense_linear_blocked) timed on its own, against the FMA peak of
 * one core: ROWS x rows times an N x K weight, REPS products a timing, the best of 5 timings; and a loop of
 * 24 independent 512-bit multiply-adds in registers (what one core can do at most). With the weight in L2
 * (N 64, K 2048: 512 KB) and one thread it measures the kernel's own code; with llama-1b's shapes and two
 * threads, the kernel reading the weights from memory. Build it against any kernels.c (another commit's:
 * `git show REV:inflight/engine/cpu/kernels.c > inflight/engine/cpu/old.c`, and KERNELS=old.c):

    gcc -O3 -march=native -fopenmp -fno-trapping-math -fno-math-errno -std=gnu11 -Iinflight/engine/cpu \
        -DKERNELS='"kernels.c"' -o /tmp/dense_blocked benchmarks/dense_blocked.c -lm
    /tmp/dense_blocked ROWS N K REPS THREADS       e.g. 16 64 2048 2000 1, 16 16384 2048 20 2
 */
#include KERNELS

#include <stdio.h>
#include <time.h>

static double seconds_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* GFLOP/s of 24 chains of 512-bit multiply-adds, in registers. */
static double fma_peak(void) {
    __m512 a[24];
    for (int i = 0; i < 24; i++) a[i] = _mm512_set1_ps((float)i * 0.001f);
    __m512 b = _mm512_set1_ps(0.9999f);
    const __m512 c = _mm512_set1_ps(1e-6f);
    const long iterations = 10000000;
    const double start = seconds_now();
    for (long it = 0; it < iterations; it++) {
#pragma GCC unroll 24
        for (int i = 0; i < 24; i++) a[i] = _mm512_fmadd_ps(a[i], b, c);
        __asm__ volatile("" : "+v"(b)); /* keeps the loop from being folded */
    }
    const double elapsed = seconds_now() - start;
    float sum = 0.0f;
    for (int i = 0; i < 24; i++) sum += _mm512_reduce_add_ps(a[i]);
    return sum == 0.0f ? 0.0 : (double)iterations * 24 * 32 / elapsed / 1e9;
}

int main(int argc, char **argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: %s ROWS N K REPS THREADS\n", argv[0]);
        return 2;
    }
    const int64_t rows = atoll(argv[1]), n = atoll(argv[2]), k = atoll(argv[3]);
    const int reps = atoi(argv[4]), threads = atoi(argv[5]);
    if (rows <= DENSE_MAX_ROWS || rows > DENSE_FLOAT32_ROWS || k < DENSE_BLOCKED_K) {
        fprintf(stderr, "the blocked product takes %d to %d rows by %d inputs or more\n", DENSE_MAX_ROWS + 1,
                DENSE_FLOAT32_ROWS, DENSE_BLOCKED_K);
        return 2;
    }
    float *x = aligned_alloc(64, (size_t)(rows * k) * sizeof(float));
    float *w = aligned_alloc(64, (size_t)(n * k) * sizeof(float));
    float *out = aligned_alloc(64, (size_t)(rows * n) * sizeof(float));
    for (int64_t i = 0; i < rows * k; i++) x[i] = (float)(i % 7) * 0.1f;
    for (int64_t i = 0; i < n * k; i++) w[i] = (float)(i % 5) * 0.1f;
    dense_linear_blocked(x, rows, k, w, n, NULL, out, threads); /* (returns void before 6 December) */
    double best = 1e30;
    for (int timing = 0; timing < 5; timing++) {
        const double start = seconds_now();
        for (int r = 0; r < reps; r++) dense_linear_blocked(x, rows, k, w, n, NULL, out, threads);
        const double each = (seconds_now() - start) / reps;
        best = each < best ? each : best;
    }
    printf("%ld rows x %ld x %ld, %d threads: %.1f us, %.1f GFLOP/s; one core's FMA peak %.1f GFLOP/s\n", (long)rows,
           (long)n, (long)k, threads, best * 1e6, 2.0 * (double)(rows * n * k) / best / 1e9, fma_peak());
    free(x), free(w), free(out);
    return 0;
}
