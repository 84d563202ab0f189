// This host's peak rates of the vector instructions a verify step's extra rows cost at the fewest, for `bench_steps`'
// arithmetic floor of it (built by `engine.native.load_kernel` like the engine's kernels): 8-lane fp32 FMAs,
// 16-lane ones where the CPU has AVX-512 (fp32 activations), and 512-bit vpdpbusd (64 int8 multiply-adds each)
// where it has AVX-512 VNNI (int8 activations in VNNI lanes). Ten independent chains a thread cover the FMA latency
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

#pragma GCC push_options
#pragma GCC target("avx512f,avx512vnni")

extern "C" {
// fma_rate's chains in 16 lanes: 512-bit FMA instructions a second (call only where the CPU has AVX-512F).
double fma_rate512(long iters, int threads, const float *seeds, float *out) {
    const double t0 = omp_get_wtime();
    #pragma omp parallel num_threads(threads)
    {
        __m512 a[10];
        for (int j = 0; j < 10; j++) a[j] = _mm512_set1_ps(seeds[j]);
        __m512 a0 = a[0], a1 = a[1], a2 = a[2], a3 = a[3], a4 = a[4], a5 = a[5], a6 = a[6], a7 = a[7], a8 = a[8],
               a9 = a[9];
        const __m512 m = _mm512_set1_ps(0.9999f), c = _mm512_set1_ps(1e-4f);
        for (long i = 0; i < iters; i++) {
            a0 = _mm512_fmadd_ps(a0, m, c); a1 = _mm512_fmadd_ps(a1, m, c); a2 = _mm512_fmadd_ps(a2, m, c);
            a3 = _mm512_fmadd_ps(a3, m, c); a4 = _mm512_fmadd_ps(a4, m, c); a5 = _mm512_fmadd_ps(a5, m, c);
            a6 = _mm512_fmadd_ps(a6, m, c); a7 = _mm512_fmadd_ps(a7, m, c); a8 = _mm512_fmadd_ps(a8, m, c);
            a9 = _mm512_fmadd_ps(a9, m, c);
        }
        const __m512 chains[10] = {a0, a1, a2, a3, a4, a5, a6, a7, a8, a9};
        for (int j = 0; j < 10; j++) out[10 * omp_get_thread_num() + j] = _mm512_cvtss_f32(chains[j]);
    }
    return 10.0 * (double)iters * threads / (omp_get_wtime() - t0);
}

// vpdpbusd instructions a second (512-bit: 16 lanes x 4 u8 x s8 products each), ten chains a thread as above:
// chain j starts at seeds[j] in every lane and adds x . y (bytes x_bytes unsigned, y_bytes signed, each 4 of them
// in every lane) per iteration, wrapping in int32; out[10 t + j] its lane 0 (call only where the CPU has AVX-512
// VNNI).
double vnni_rate(long iters, int threads, const int *seeds, int x_bytes, int y_bytes, int *out) {
    const double t0 = omp_get_wtime();
    #pragma omp parallel num_threads(threads)
    {
        const __m512i x = _mm512_set1_epi32(x_bytes), y = _mm512_set1_epi32(y_bytes);
        __m512i a0 = _mm512_set1_epi32(seeds[0]), a1 = _mm512_set1_epi32(seeds[1]), a2 = _mm512_set1_epi32(seeds[2]),
                a3 = _mm512_set1_epi32(seeds[3]), a4 = _mm512_set1_epi32(seeds[4]), a5 = _mm512_set1_epi32(seeds[5]),
                a6 = _mm512_set1_epi32(seeds[6]), a7 = _mm512_set1_epi32(seeds[7]), a8 = _mm512_set1_epi32(seeds[8]),
                a9 = _mm512_set1_epi32(seeds[9]);
        for (long i = 0; i < iters; i++) {
            a0 = _mm512_dpbusd_epi32(a0, x, y); a1 = _mm512_dpbusd_epi32(a1, x, y); a2 = _mm512_dpbusd_epi32(a2, x, y);
            a3 = _mm512_dpbusd_epi32(a3, x, y); a4 = _mm512_dpbusd_epi32(a4, x, y); a5 = _mm512_dpbusd_epi32(a5, x, y);
            a6 = _mm512_dpbusd_epi32(a6, x, y); a7 = _mm512_dpbusd_epi32(a7, x, y); a8 = _mm512_dpbusd_epi32(a8, x, y);
            a9 = _mm512_dpbusd_epi32(a9, x, y);
            // the compiler may not see that each chain adds a constant a step and fold the loop into a multiply
            __asm__ volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4));
            __asm__ volatile("" : "+v"(a5), "+v"(a6), "+v"(a7), "+v"(a8), "+v"(a9));
        }
        const __m512i chains[10] = {a0, a1, a2, a3, a4, a5, a6, a7, a8, a9};
        for (int j = 0; j < 10; j++)
            out[10 * omp_get_thread_num() + j] = _mm_cvtsi128_si32(_mm512_castsi512_si128(chains[j]));
    }
    return 10.0 * (double)iters * threads / (omp_get_wtime() - t0);
}
}

#pragma GCC pop_options
