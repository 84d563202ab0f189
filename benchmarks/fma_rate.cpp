// This host's peak 8-lane fp32 FMA rate, for `bench_steps`' arithmetic floor of a verify step (built by
// `engine.native.load_kernel` like the engine's kernels). Ten independent chains a thread cover the FMA latency
// of the x86 cores this project meets (4 cycles, 2 FMA units: 8 chains in flight); the chains' values stay
// bounded (a * 0.9999 + 1e-4) and are returned, so the compiler cannot drop the loop.

#include <immintrin.h>
#include <omp.h>

extern "C" {
// FMA instructions a second over `threads` OpenMP threads, each running `iters` rounds of ten FMAs.
double fma_rate(long iters, int threads, float *sink) {
    const double t0 = omp_get_wtime();
    float total = 0.f;
    #pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        __m256 a0 = _mm256_set1_ps(1.f), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0,
               a9 = a0;
        const __m256 m = _mm256_set1_ps(0.9999f), c = _mm256_set1_ps(1e-4f);
        for (long i = 0; i < iters; i++) {
            a0 = _mm256_fmadd_ps(a0, m, c); a1 = _mm256_fmadd_ps(a1, m, c); a2 = _mm256_fmadd_ps(a2, m, c);
            a3 = _mm256_fmadd_ps(a3, m, c); a4 = _mm256_fmadd_ps(a4, m, c); a5 = _mm256_fmadd_ps(a5, m, c);
            a6 = _mm256_fmadd_ps(a6, m, c); a7 = _mm256_fmadd_ps(a7, m, c); a8 = _mm256_fmadd_ps(a8, m, c);
            a9 = _mm256_fmadd_ps(a9, m, c);
        }
        __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
                                 _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(_mm256_add_ps(a6, a7),
                                                                                    _mm256_add_ps(a8, a9))));
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, s);
        total += lanes[0];
    }
    *sink = total;
    return 10.0 * (double)iters * threads / (omp_get_wtime() - t0);
}
}
