// The prompt GEMM over GGUF's quantised blocks, for `gguf_kernel.cpp` (which includes this file after its block
// formats `Q41`, `Q80` and `QK`; built only through it). Another arithmetic than that file's kernel: see below.

// Prompts: a GEMM of the dequantised weights. At hundreds of rows the kernel (`gguf_kernel.cpp`) spends 6 FMA-port
// operations a row per 32 weights and converts each block once a tile of 6 rows; unpacking a panel of 16 weight rows to
// fp32 once (d q + m: exactly the converted checkpoint's weights, as the gguf package computes them) and running a 6 x
// 16 register tile over it spends 4, and reached 116 against 48 GFLOP/s at 1,024 rows (2 threads, SmolLM2's layer
// shapes), 2x at 128 rows. Its sums are another order (each output: a running FMA sum per 32 k, the blocks' sums added
// in order), so a row's bits differ from the kernel's: callers take it for prompt rows only, chosen per row by
// something the row's own step decides (`decode_layers.cpp`), never by how many rows share a call.
namespace gguf_kernel {
constexpr int64_t PANEL = 16;  // weight rows a packed panel: two ymm of outputs
constexpr int64_t GEMM_TILE = 6;  // rows a GEMM tile: 12 accumulators

// out[i] = lane i of each of in[0..8): an 8 x 8 transpose (transpose.h's, on fp32 lanes).
inline void transpose8(const __m256 in[8], __m256 out[8]) {
    __m256i a[8], b[8];
    for (int i = 0; i < 8; i++) a[i] = _mm256_castps_si256(in[i]);
    sk::transpose8x8(a, b);
    for (int i = 0; i < 8; i++) out[i] = _mm256_castsi256_ps(b[i]);
}

// Eight weight rows' values at columns [k0, k0 + 8 * chunks) (vals[r] + 8 c: chunk c of row r) transposed 8 x 8
// into the panel's columns [j0, j0 + 8) (one float a store was ~13% of a 128-row prompt's time on an AVX2 EPYC).
inline void transpose_into_panel(const float *const vals[8], int64_t chunks, float *P, int64_t k0, int64_t j0) {
    for (int64_t c = 0; c < chunks; c++) {
        __m256 rows[8], cols[8];
        for (int r = 0; r < 8; r++) rows[r] = _mm256_load_ps(vals[r] + 8 * c);
        transpose8(rows, cols);
        for (int i = 0; i < 8; i++) _mm256_store_ps(P + (k0 + 8 * c + i) * PANEL + j0, cols[i]);
    }
}

// Weight rows [n, n + nb) as fp32 into P [K][PANEL] (columns past nb zero). Eight weight rows at a time: each
// block's values (d q + m, as the converted checkpoint has them) into a row-major scratch, then into the panel.
template <class F>
inline void pack_panel(const uint8_t *w, int64_t row_bytes, int64_t K, int64_t n, int64_t nb, float *P) {
    const int64_t nblk = K / QK;
    alignas(32) float vals[8][QK];
    const float *const rows[8] = {vals[0], vals[1], vals[2], vals[3], vals[4], vals[5], vals[6], vals[7]};
    for (int64_t j0 = 0; j0 < PANEL; j0 += 8) {
        for (int64_t b = 0; b < nblk; b++) {
            for (int r = 0; r < 8; r++) {
                if (j0 + r >= nb) {
                    for (int c = 0; c < 4; c++) _mm256_store_ps(vals[r] + 8 * c, _mm256_setzero_ps());
                    continue;
                }
                __m256 q[4], d, m;
                F::load(w + (n + j0 + r) * row_bytes + b * F::bytes, q, d, m);
                for (int c = 0; c < 4; c++)
                    _mm256_store_ps(vals[r] + 8 * c,
                                    F::has_min ? _mm256_add_ps(_mm256_mul_ps(d, q[c]), m) : _mm256_mul_ps(d, q[c]));
            }
            transpose_into_panel(rows, 4, P, b * QK, j0);
        }
    }
}

// pack_panel for any block format by its dequantiser (`dequant`: a block of qk <= 256 values, gguf's bits; the
// kernel layer's formats, engine/kernels/formats.h).
inline void pack_panel_dequant(void (*dequant)(const uint8_t *, float *), int64_t qk, int64_t bytes,
                               const uint8_t *w, int64_t K, int64_t n, int64_t nb, float *P) {
    const int64_t row_bytes = K / qk * bytes;
    alignas(32) float vals[8][256];
    const float *const rows[8] = {vals[0], vals[1], vals[2], vals[3], vals[4], vals[5], vals[6], vals[7]};
    for (int64_t j0 = 0; j0 < PANEL; j0 += 8)
        for (int64_t b = 0; b < K / qk; b++) {
            for (int r = 0; r < 8; r++) {
                if (j0 + r < nb) dequant(w + (n + j0 + r) * row_bytes + b * bytes, vals[r]);
                else memset(vals[r], 0, sizeof(float) * qk);
            }
            transpose_into_panel(rows, qk / 8, P, b * qk, j0);
        }
}

template <int MB>
inline void gemm_tile(const float *x, int64_t K, const float *P, float *y, int64_t N, int64_t n, int64_t nb,
                      const float *bias) {
    // each output: a sum per 32 k (FMAs in k order), the blocks' sums added in order (error ~(32 + K/32) eps,
    // not ~K eps of one running sum)
    __m256 acc[MB][2];
    for (int i = 0; i < MB; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    alignas(32) float sums[MB][PANEL];
    for (int i = 0; i < MB; i++) {
        _mm256_store_ps(sums[i], acc[i][0]);
        _mm256_store_ps(sums[i] + 8, acc[i][1]);
    }
    for (int64_t k0 = 0; k0 < K; k0 += QK) {
        for (int i = 0; i < MB; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
        for (int64_t k = k0; k < k0 + QK; k++) {
            const __m256 w0 = _mm256_load_ps(P + k * PANEL), w1 = _mm256_load_ps(P + k * PANEL + 8);
            for (int i = 0; i < MB; i++) {
                const __m256 xi = _mm256_broadcast_ss(x + i * K + k);
                acc[i][0] = _mm256_fmadd_ps(xi, w0, acc[i][0]);
                acc[i][1] = _mm256_fmadd_ps(xi, w1, acc[i][1]);
            }
        }
        for (int i = 0; i < MB; i++) {
            _mm256_store_ps(sums[i], _mm256_add_ps(_mm256_load_ps(sums[i]), acc[i][0]));
            _mm256_store_ps(sums[i] + 8, _mm256_add_ps(_mm256_load_ps(sums[i] + 8), acc[i][1]));
        }
    }
    for (int i = 0; i < MB; i++)
        for (int64_t j = 0; j < nb; j++) y[i * N + n + j] = sums[i][j] + (bias ? bias[n + j] : 0.f);
}

}  // namespace gguf_kernel

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")
namespace gguf_kernel {
constexpr int64_t GEMM_TILE_512 = 12;  // rows an AVX-512 tile: 12 accumulators of 16 outputs

// gemm_tile where the CPU has AVX-512: a panel's 16 outputs in one 512-bit register, each lane gemm_tile's
// operations in its order (the same bits), for twice the rows a tile at the same registers.
template <int MB>
inline void gemm_tile_512(const float *x, int64_t K, const float *P, float *y, int64_t N, int64_t n, int64_t nb,
                          const float *bias) {
    __m512 acc[MB], sums[MB];
    for (int i = 0; i < MB; i++) sums[i] = _mm512_setzero_ps();
    for (int64_t k0 = 0; k0 < K; k0 += QK) {
        for (int i = 0; i < MB; i++) acc[i] = _mm512_setzero_ps();
        for (int64_t k = k0; k < k0 + QK; k++) {
            const __m512 wk = _mm512_loadu_ps(P + k * PANEL);  // (P is 32-byte aligned)
            for (int i = 0; i < MB; i++) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(x[i * K + k]), wk, acc[i]);
        }
        for (int i = 0; i < MB; i++) sums[i] = _mm512_add_ps(sums[i], acc[i]);
    }
    const __mmask16 keep = (__mmask16)((1u << nb) - 1);
    for (int i = 0; i < MB; i++) {
        const __m512 bv = bias ? _mm512_maskz_loadu_ps(keep, bias + n) : _mm512_setzero_ps();
        _mm512_mask_storeu_ps(y + i * N + n, keep, _mm512_add_ps(sums[i], bv));
    }
}

// Rows [0, M) of x times the panel in P (weight rows [n, n + nb)).
inline void gemm_panel_512(const float *x, int64_t M, int64_t K, const float *P, float *y, int64_t N, int64_t n,
                           int64_t nb, const float *bias) {
    int64_t m = 0;
    for (; m + GEMM_TILE_512 <= M; m += GEMM_TILE_512)
        gemm_tile_512<GEMM_TILE_512>(x + m * K, K, P, y + m * N, N, n, nb, bias);
    const float *xm = x + m * K;
    float *ym = y + m * N;
    switch (M - m) {
#define GEMM_REST(R) \
        case R: gemm_tile_512<R>(xm, K, P, ym, N, n, nb, bias); break;
        GEMM_REST(11) GEMM_REST(10) GEMM_REST(9) GEMM_REST(8) GEMM_REST(7) GEMM_REST(6) GEMM_REST(5) GEMM_REST(4)
        GEMM_REST(3) GEMM_REST(2) GEMM_REST(1)
#undef GEMM_REST
        default: break;
    }
}
}  // namespace gguf_kernel
#pragma GCC pop_options

namespace gguf_kernel {
// Rows [0, M) of x times weight rows [n0, n1), on the calling thread, each panel packed by pack(n, nb, P);
// P: panel_floats(K) floats, 32-byte aligned.
template <class Pack>
void gemm_panels(const float *x, int64_t M, int64_t K, int64_t N, const float *bias, float *y, int64_t n0,
                 int64_t n1, float *P, Pack pack) {
    for (int64_t n = n0; n < n1; n += PANEL) {
        const int64_t nb = n1 - n < PANEL ? n1 - n : PANEL;
        pack(n, nb, P);
        if (avx512_ok()) {
            gemm_panel_512(x, M, K, P, y, N, n, nb, bias);
            continue;
        }
        int64_t m = 0;
        for (; m + GEMM_TILE <= M; m += GEMM_TILE) gemm_tile<6>(x + m * K, K, P, y + m * N, N, n, nb, bias);
        switch (M - m) {
            case 5: gemm_tile<5>(x + m * K, K, P, y + m * N, N, n, nb, bias); break;
            case 4: gemm_tile<4>(x + m * K, K, P, y + m * N, N, n, nb, bias); break;
            case 3: gemm_tile<3>(x + m * K, K, P, y + m * N, N, n, nb, bias); break;
            case 2: gemm_tile<2>(x + m * K, K, P, y + m * N, N, n, nb, bias); break;
            case 1: gemm_tile<1>(x + m * K, K, P, y + m * N, N, n, nb, bias); break;
            default: break;
        }
    }
}

template <class F>
void gemm_range(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, const float *bias, float *y,
                int64_t n0, int64_t n1, float *P) {
    const int64_t row_bytes = K / QK * F::bytes;
    gemm_panels(x, M, K, N, bias, y, n0, n1, P,
                [&](int64_t n, int64_t nb, float *panel) { pack_panel<F>(w, row_bytes, K, n, nb, panel); });
}
inline int64_t panel_floats(int64_t K) { return K * PANEL; }

inline void gemm_range(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, int fmt, const float *bias,
                       float *y, int64_t n0, int64_t n1, float *P) {
    if ((fmt & 1) == 0) gemm_range<Q41>(x, M, K, w, N, bias, y, n0, n1, P);  // fp32 activations whatever bit 1 says
    else gemm_range<Q80>(x, M, K, w, N, bias, y, n0, n1, P);
}
}  // namespace gguf_kernel
