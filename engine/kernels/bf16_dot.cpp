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
namespace sk {
namespace bf16dot {  // (the prompt GEMM's sizes: plain arithmetic, outside the AVX-512 region: any host sizes buffers)
constexpr int64_t GEMM_LANES = 16, GEMM_R = 8, GEMM_C = 2;  // a tile: 8 rows of x by 2 panels (16 zmm sums)

inline int64_t panel_bytes(int64_t K) { return K * GEMM_LANES * 2; }
// A thread's scratch for the prompt GEMM: a tile's panels, and room to align them to 64 bytes.
inline int64_t gemm_scratch_bytes(int64_t K) { return panel_bytes(K) * GEMM_C + 64; }
}  // namespace bf16dot
}  // namespace sk

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")
namespace sk {
namespace bf16dot {
constexpr int64_t TILE_M = 4, TILE_N = 2;  // rows of x a tile reads a pair of weight rows for (16 zmm sums)
// Tiles of this many rows of x prefetch the next pair of weight rows: at 8 rows of SmolLM2's shapes, weights in
// DRAM, 33-34 -> 40-42 GMAC/s on one Zen 4 core (5 rows: within a few percent).
constexpr int PREFETCH_ROWS = 4;

inline bool runs() { return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw"); }

// The row xr (K a multiple of 16) as bf16, nearest even, into xb's row r
inline void round_into(const float *xr, uint16_t *xb, int64_t K, int64_t r) {
    for (int64_t k = 0; k < K; k += 16)
        _mm256_storeu_si256((__m256i *)(xb + r * K + k), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(xr + k)));
}

// x's row r into xb's row r
inline void round_row(const float *x, uint16_t *xb, int64_t K, int64_t r) { round_into(x + r * K, xb, K, r); }

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
        if constexpr (MT >= PREFETCH_ROWS)  // the next tile's weight rows (as linear.inc's prefetch_next_row)
            for (int j = 0; j < NT; j++) {
                const char *next = (const char *)(wr + (NT + j) * K * 2 + 2 * k);
                _mm_prefetch(next, _MM_HINT_T0);
                _mm_prefetch(next + 64, _MM_HINT_T0);
            }
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

// Prompt rows: a GEMM whose lanes are 16 weight rows (for rows a caller marks as a prompt's, decode_layers.cpp). A
// panel of 16 weight rows is laid out once a call as pairs of values [K / 2][16 rows][2], so that each pair of a row
// of x, broadcast, meets all 16 rows' pairs in one vdpbf16ps; each output is one fp32 lane summed over k in order,
// then the bias. Its order is its own (not the kernel's two chains and horizontal sum): batch-invariant among the
// rows that take it, at every row count, tiling and thread split. At 128 rows of SmolLM2's shapes ~1.5x the tiles
// above, whose x rows are read again for each pair of weight rows.

// Weight rows [n, n + nb) (nb <= 16; the rest zero) of w (BF16 rows of K values) into P [K / 2][16][2].
inline void pack_panel(const uint8_t *w, int64_t K, int64_t n, int64_t nb, uint32_t *P) {
    const uint32_t *rows = (const uint32_t *)w;  // a pair of values as one 32-bit lane
    for (int64_t k2 = 0; k2 < K / 2; k2 += 8)
        for (int64_t h = 0; h < 2; h++) {
            __m256i in[8], out[8];
            for (int r = 0; r < 8; r++) {
                const int64_t i = 8 * h + r;
                in[r] = i < nb ? _mm256_loadu_si256((const __m256i *)(rows + (n + i) * (K / 2) + k2))
                               : _mm256_setzero_si256();
            }
            transpose8x8(in, out);
            for (int g = 0; g < 8; g++) _mm256_store_si256((__m256i *)(P + (k2 + g) * GEMM_LANES + 8 * h), out[g]);
        }
}

template <int R, int C>
inline void gemm_tile(const uint16_t *xb, int64_t K, int64_t m, const uint32_t *const P[C], float *acc) {
    __m512 a[R][C];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) a[r][c] = _mm512_setzero_ps();
    const uint32_t *x = (const uint32_t *)(xb + m * K);
    for (int64_t k2 = 0; k2 < K / 2; k2++) {
        __m512bh w[C];
        for (int c = 0; c < C; c++) w[c] = (__m512bh)_mm512_load_si512(P[c] + k2 * GEMM_LANES);
        for (int r = 0; r < R; r++) {
            const __m512bh xp = (__m512bh)_mm512_set1_epi32((int)x[r * (K / 2) + k2]);
            for (int c = 0; c < C; c++) a[r][c] = _mm512_dpbf16_ps(a[r][c], w[c], xp);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) _mm512_storeu_ps(acc + (r * C + c) * GEMM_LANES, a[r][c]);
}

template <int R>
inline void gemm_rows(const uint16_t *xb, int64_t K, int64_t m, const uint32_t *const P[GEMM_C], int C, float *acc) {
    if (C == 2)
        gemm_tile<R, 2>(xb, K, m, P, acc);
    else
        gemm_tile<R, 1>(xb, K, m, P, acc);
}

// y's row rows[i] (i for null rows) [n0, n1) = xb's row i (bf16 already) times weight rows [n0, n1) of w, plus the
// bias. scratch: gemm_scratch_bytes(K).
void gemm_range(const uint16_t *xb, int64_t M, const int64_t *rows, int64_t K, const uint8_t *w, int64_t N,
                const float *bias, float *y, int64_t n0, int64_t n1, void *scratch) {
    uint32_t *panels = (uint32_t *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    alignas(64) float acc[GEMM_R * GEMM_C * GEMM_LANES];
    for (int64_t n = n0; n < n1; n += GEMM_C * GEMM_LANES) {
        const int64_t width = n1 - n < GEMM_C * GEMM_LANES ? n1 - n : GEMM_C * GEMM_LANES;
        const int C = width > GEMM_LANES ? 2 : 1;
        const uint32_t *P[GEMM_C] = {panels, panels + K / 2 * GEMM_LANES};
        for (int c = 0; c < C; c++) {
            const int64_t lo = n + c * GEMM_LANES, cnt = width - c * GEMM_LANES < GEMM_LANES ? width - c * GEMM_LANES
                                                                                               : GEMM_LANES;
            pack_panel(w, K, lo, cnt, panels + c * (K / 2) * GEMM_LANES);
        }
        for (int64_t m = 0; m < M; m += GEMM_R) {
            const int R = M - m < GEMM_R ? (int)(M - m) : GEMM_R;
            switch (R) {
                case 8: gemm_rows<8>(xb, K, m, P, C, acc); break;
                case 7: gemm_rows<7>(xb, K, m, P, C, acc); break;
                case 6: gemm_rows<6>(xb, K, m, P, C, acc); break;
                case 5: gemm_rows<5>(xb, K, m, P, C, acc); break;
                case 4: gemm_rows<4>(xb, K, m, P, C, acc); break;
                case 3: gemm_rows<3>(xb, K, m, P, C, acc); break;
                case 2: gemm_rows<2>(xb, K, m, P, C, acc); break;
                default: gemm_rows<1>(xb, K, m, P, C, acc); break;
            }
            for (int r = 0; r < R; r++) {
                float *yr = y + (rows ? rows[m + r] : m + r) * N;
                for (int64_t j = 0; j < width; j++)
                    yr[n + j] =
                        acc[(r * C + j / GEMM_LANES) * GEMM_LANES + j % GEMM_LANES] + (bias ? bias[n + j] : 0.f);
            }
        }
    }
}
}  // namespace bf16dot
}  // namespace sk
#pragma GCC pop_options
