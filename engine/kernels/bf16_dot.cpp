// BF16 weights times bf16 activations in AVX-512 BF16 dot products (`vdpbf16ps`): the kernel layer's "bf16"
// arithmetic, for a bf16 checkpoint on a CPU that has them (kernels.cpp's table: BF16/bf16/avx512).
//
// x's rows are rounded to bf16 (nearest even, `vcvtneps2bf16`) once a call; each weight row's bf16 values, as the
// file holds them, are read 32 at a time into a dot product whose bf16 products are exact in fp32 and added in
// the instruction's fixed order into 16 fp32 lanes. Two chains a row, over alternate 32-value steps, so a decode
// step's one row is not one dependent chain (the instruction's latency a step); the row ends in a fixed horizontal
// sum, then the bias. Every output's operations are fixed by its weight row and row of x alone: batch-invariant at
// every row count, tiling and thread split. Not exact against fp32 activations (x loses its low 16 bits: what the
// checkpoint's dtype computes in every other engine); `--activations fp32` keeps the exact widening (linear.inc).
// Against that widening (fp32 FMAs over weights widened a block at a time), 1.7x at one row and 2x at 5-8 rows, from
// L2 on one AMD EPYC (Zen 4) core.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")
namespace sk {
namespace bf16dot {
constexpr int64_t TILE = 8;  // rows of x a weight row is read for at once (16 zmm sums)

inline bool runs() { return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw"); }

// x's row r (K a multiple of 16) as bf16, nearest even, into xb's row r
inline void round_row(const float *x, uint16_t *xb, int64_t K, int64_t r) {
    for (int64_t k = 0; k < K; k += 16)
        _mm256_storeu_si256((__m256i *)(xb + r * K + k), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + r * K + k)));
}

inline float hsum16(__m512 v) {
    return avx2::hsum(_mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)));
}

template <int MT>
inline void tile(const uint16_t *xb, int64_t K, const uint8_t *wrow, float *y, int64_t N, int64_t n,
                 const float *bias) {
    __m512 a0[MT], a1[MT];
    for (int i = 0; i < MT; i++) a0[i] = a1[i] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wrow + 2 * k);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wrow + 2 * k + 64);
        for (int i = 0; i < MT; i++) {
            a0[i] = _mm512_dpbf16_ps(a0[i], (__m512bh)_mm512_loadu_si512(xb + i * K + k), w0);
            a1[i] = _mm512_dpbf16_ps(a1[i], (__m512bh)_mm512_loadu_si512(xb + i * K + k + 32), w1);
        }
    }
    if (k < K) {  // (K a multiple of 32, not of 64: the last 32 values on the first chain)
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wrow + 2 * k);
        for (int i = 0; i < MT; i++)
            a0[i] = _mm512_dpbf16_ps(a0[i], (__m512bh)_mm512_loadu_si512(xb + i * K + k), w0);
    }
    for (int i = 0; i < MT; i++) y[i * N + n] = hsum16(_mm512_add_ps(a0[i], a1[i])) + (bias ? bias[n] : 0.f);
}

// Weight rows [n0, n1) of xb's M rows (bf16 already), on the calling thread; w: BF16 rows of K values.
void range(const uint16_t *xb, int64_t M, int64_t K, const uint8_t *w, int64_t N, const float *bias, float *y,
           int64_t n0, int64_t n1) {
    const int64_t fit = avx512::ROW_BLOCK_BYTES / (K * 2) / TILE * TILE;  // x's rows a row block holds in L2
    const int64_t rb = fit > TILE ? fit : TILE;
    for (int64_t m0 = 0; m0 < M; m0 += rb) {
        const int64_t m1 = m0 + rb < M ? m0 + rb : M;
        for (int64_t n = n0; n < n1; n++)
            for (int64_t m = m0; m < m1; m += TILE) {
                const uint16_t *xm = xb + m * K;
                float *ym = y + m * N;
                const uint8_t *wr = w + n * K * 2;
                switch (m1 - m < TILE ? m1 - m : TILE) {
                    case 8: tile<8>(xm, K, wr, ym, N, n, bias); break;
                    case 7: tile<7>(xm, K, wr, ym, N, n, bias); break;
                    case 6: tile<6>(xm, K, wr, ym, N, n, bias); break;
                    case 5: tile<5>(xm, K, wr, ym, N, n, bias); break;
                    case 4: tile<4>(xm, K, wr, ym, N, n, bias); break;
                    case 3: tile<3>(xm, K, wr, ym, N, n, bias); break;
                    case 2: tile<2>(xm, K, wr, ym, N, n, bias); break;
                    default: tile<1>(xm, K, wr, ym, N, n, bias); break;
                }
            }
    }
}
}  // namespace bf16dot
}  // namespace sk
#pragma GCC pop_options
