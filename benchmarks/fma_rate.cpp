// This host's peak 8-lane fp32 FMA rate, for `bench_steps`' arithmetic floor of a verify step (built by
// `engine.native.load_kernel` like the engine's kernels). Ten independent chains a thread cover the FMA latency
// of the x86 cores this project meets (4 cycles, 2 FMA units: 8 chains in flight); the chains' values stay
// bounded (a * 0.9999 + 1e-4) and are returned.
//
// The chains start from the caller's ten values, read at run time: started from one constant, they are ten copies
// of one computation, and GCC -O3 computes it once (one latency-bound chain counted ten times: 7.9 G "FMAs" a
// second on one Zen 3 core, whose two FMA units at ~3.15 GHz do 6.3; measured).

#include <immintrin.h>
#include <omp.h>

extern "C" {
// FMA instructions a second over `threads` OpenMP threads, each running `iters` rounds of ten FMAs, chain i
// starting from seeds[i]. out[10 t + i]: chain i's final value on thread t (lane 0); every thread writes its
// own, so no thread's loop is without an effect the compiler must keep.
double fma_rate(long iters, int threads, const float *seeds, float *out) {
    const double t0 = omp_get_wtime();
    #pragma omp parallel num_threads(threads)
    {
        __m256 a0 = _mm256_set1_ps(seeds[0]), a1 = _mm256_set1_ps(seeds[1]), a2 = _mm256_set1_ps(seeds[2]),
               a3 = _mm256_set1_ps(seeds[3]), a4 = _mm256_set1_ps(seeds[4]), a5 = _mm256_set1_ps(seeds[5]),
               a6 = _mm256_set1_ps(seeds[6]), a7 = _mm256_set1_ps(seeds[7]), a8 = _mm256_set1_ps(seeds[8]),
               a9 = _mm256_set1_ps(seeds[9]);
        const __m256 m = _mm256_set1_ps(0.9999f), c = _mm256_set1_ps(1e-4f);
        for (long i = 0; i < iters; i++) {
            a0 = _mm256_fmadd_ps(a0, m, c); a1 = _mm256_fmadd_ps(a1, m, c); a2 = _mm256_fmadd_ps(a2, m, c);
            a3 = _mm256_fmadd_ps(a3, m, c); a4 = _mm256_fmadd_ps(a4, m, c); a5 = _mm256_fmadd_ps(a5, m, c);
            a6 = _mm256_fmadd_ps(a6, m, c); a7 = _mm256_fmadd_ps(a7, m, c); a8 = _mm256_fmadd_ps(a8, m, c);
            a9 = _mm256_fmadd_ps(a9, m, c);
        }
        const __m256 chains[10] = {a0, a1, a2, a3, a4, a5, a6, a7, a8, a9};
        for (int j = 0; j < 10; j++) out[10 * omp_get_thread_num() + j] = _mm256_cvtss_f32(chains[j]);
    }
    return 10.0 * (double)iters * threads / (omp_get_wtime() - t0);
}
}
