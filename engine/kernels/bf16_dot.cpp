// BF16 weights times bf16 activations in AVX-512 BF16 dot products (`vdpbf16ps`): the kernel layer's "bf16"
// arithmetic, for a bf16 checkpoint on a CPU that has them (kernels.cpp's table: BF16/bf16/avx512).
//
// x's rows are rounded to bf16 once a call (nearest even, `vcvtneps2bf16`, which flushes denormal inputs to zero);
// each weight row's bf16 values, as the file holds them, are read 32 at a time into a dot product whose bf16 products
// are exact in fp32 and added in the instruction's fixed order into 16 fp32 lanes. Two chains a row, over alternate
// 32-value steps, so a decode step's one row is not one dependent chain (the instruction's latency a step); the row
// ends in a fixed horizontal sum, then the bias. Every output's operations are fixed by its weight row and row of x
// alone: batch-invariant at every row count, tiling and thread split. Not exact against fp32 activations (x loses
// its low 16 bits: what the checkpoint's dtype computes in every other engine); `--activations fp32` keeps the exact
// widening (linear.inc). Against that widening (fp32 FMAs over weights widened a block at a time), 1.7x at one row
// and 2x at 5-8 rows from L2 on one AMD EPYC (Zen 4) core; a decode step's one row streams its weights from memory
// at the same speed in either form.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")
namespace sk {
namespace bf16dot {
constexpr int64_t TILE_M = 4, TILE_N = 2;  // rows of x a tile reads a pair of weight rows for (16 zmm sums)

inline bool runs() { return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw"); }

// x's row r (K a multiple of 16) as bf16, nearest even, into xb's row r
inline void round_row(const float *x, uint16_t *xb, int64_t K, int64_t r) {
    for (int64_t k = 0; k < K; k += 16)
        _mm256_storeu_si256((__m256i *)(xb + r * K + k), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + r * K + k)));
}

inline float hsum16(__m512 v) {
    return avx2::hsum(_mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)));
}

// x's rows m .. m + MT - 1 against weight rows n .. n + NT - 1 (w: every row, K values apart)
template <int MT, int NT>
inline void tile(const uint16_t *xb, int64_t K, const uint8_t *w, float *y, int64_t N, int64_t n,
                 const float *bias) {
    __m512 a0[MT][NT], a1[MT][NT];
    for (int i = 0; i < MT; i++)
        for (int j = 0; j < NT; j++) a0[i][j] = a1[i][j] = _mm512_setzero_ps();
    const uint8_t *wr = w + n * K * 2;
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
        __m512bh w0[NT], w1[NT];
        for (int j = 0; j < NT; j++) {
            w0[j] = (__m512bh)_mm512_loadu_si512(wr + j * K * 2 + 2 * k);
            w1[j] = (__m512bh)_mm512_loadu_si512(wr + j * K * 2 + 2 * k + 64);
        }
        for (int i = 0; i < MT; i++) {
            const __m512bh x0 = (__m512bh)_mm512_loadu_si512(xb + i * K + k);
            const __m512bh x1 = (__m512bh)_mm512_loadu_si512(xb + i * K + k + 32);
            for (int j = 0; j < NT; j++) {
                a0[i][j] = _mm512_dpbf16_ps(a0[i][j], x0, w0[j]);
                a1[i][j] = _mm512_dpbf16_ps(a1[i][j], x1, w1[j]);
            }
        }
    }
    if (k < K)  // (K a multiple of 32, not of 64: the last 32 values on the first chain)
        for (int j = 0; j < NT; j++) {
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wr + j * K * 2 + 2 * k);
            for (int i = 0; i < MT; i++)
                a0[i][j] = _mm512_dpbf16_ps(a0[i][j], (__m512bh)_mm512_loadu_si512(xb + i * K + k), w0);
        }
    for (int i = 0; i < MT; i++)
        for (int j = 0; j < NT; j++)
            y[i * N + n + j] = hsum16(_mm512_add_ps(a0[i][j], a1[i][j])) + (bias ? bias[n + j] : 0.f);
}

template <int NT>
inline void tiles(const uint16_t *xb, int64_t rows, int64_t K, const uint8_t *w, float *y, int64_t N, int64_t n,
                  const float *bias) {
    switch (rows) {
        case 4: return tile<4, NT>(xb, K, w, y, N, n, bias);
        case 3: return tile<3, NT>(xb, K, w, y, N, n, bias);
        case 2: return tile<2, NT>(xb, K, w, y, N, n, bias);
        default: return tile<1, NT>(xb, K, w, y, N, n, bias);
    }
}

// Weight rows [n0, n1) of xb's M rows (bf16 already), on the calling thread; w: BF16 rows of K values. Rows of x
// in blocks that stay in L2; within one, tiles of 4 rows of x by 2 weight rows (1.2-1.7x one weight row by 8 rows
// of x at 8-64 rows: each weight load serves 4 products, each x load 2). One row of x reads one weight row at a
// time: a decode step's weights stream from memory, and two streams a thread read slower. Every output's chains
// and order are the same in every tile.
void range(const uint16_t *xb, int64_t M, int64_t K, const uint8_t *w, int64_t N, const float *bias, float *y,
           int64_t n0, int64_t n1) {
    const int64_t fit = avx512::ROW_BLOCK_BYTES / (K * 2) / TILE_M * TILE_M;  // x's rows a row block holds in L2
    const int64_t rb = fit > TILE_M ? fit : TILE_M;
    for (int64_t m0 = 0; m0 < M; m0 += rb) {
        const int64_t m1 = m0 + rb < M ? m0 + rb : M;
        for (int64_t n = n0; n < n1; n += M > 1 && n + TILE_N <= n1 ? TILE_N : 1)
            for (int64_t m = m0; m < m1; m += TILE_M) {
                const int64_t rows = m1 - m < TILE_M ? m1 - m : TILE_M;
                if (M > 1 && n + TILE_N <= n1)
                    tiles<TILE_N>(xb + m * K, rows, K, w, y + m * N, N, n, bias);
                else
                    tiles<1>(xb + m * K, rows, K, w, y + m * N, N, n, bias);
            }
    }
}
}  // namespace bf16dot
}  // namespace sk
#pragma GCC pop_options
