// The prompt GEMM for the AMX formats' copy (`gguf_amx.cpp`'s `amx_pack` layout) in AMX-BF16 tiles: prompt rows
// of `--activations int8` on hosts with AMX-BF16 (`gguf_kernel.cpp` includes this file after `gguf_amx.cpp`;
// compiled for AMX-BF16 and AVX512-BF16 by the target pragma below and called only where the host has them and
// the process holds its tile state: `gguf_amx_init`).
//
// The arithmetic: each weight dequantised in fp32 as the fp32 prompt GEMM's pack does it (Q4_1 d * q + m, here as
// fma(d, q, m): d * q is exact in fp32, so the same value; Q8_0 d * q) and rounded to bf16 (to nearest even), x
// rounded to bf16 likewise (`bf16_rows`, by the caller, once for all threads), and per output the tile multiply's
// fp32 sums over K, 32 values a multiply in K order (`tdpbf16ps`: each bf16 product exact in fp32; the order inside
// one multiply is the hardware's, fixed and independent of the other rows), then + bias. Not the block sums'
// bits (x is not quantised per block here, the weights are rounded instead) and not exact, as int8 activations are
// not: x's 8-bit significand against int8's per-block step, about the same precision. Why: the block sums' per-block
// readout (the tile's sums stored, converted, scaled and added for every row, block and output) is most of a
// prompt's time in tiles, where a bf16 multiply accumulates over all of K inside the tile: one store per 16 x 16
// outputs. Every output's operations depend only on its row of x and its weights (batch-invariant over the rows
// beside it, the row tiling and the threads), as the fp32 prompt GEMM's.
//
// Loop order: a panel of two 16-row weight groups (32 outputs) dequantised once into `panel` as the tile multiply's
// right-hand operand (per block and group 16 rows of 64 bytes: row kk holds weights 2kk, 2kk + 1 of each of the 16
// outputs), then every 32 rows of x against it: four accumulator tiles (2 x 16 rows by 2 x 16 outputs) stay in
// the tiles over all of K.

#include <cpuid.h>

namespace gguf_kernel {
// bf16 values of a panel: two groups' blocks of 16 x 32 weights
inline int64_t bf16_panel_halves(int64_t K) { return 2 * AMX_GROUP * K; }
}  // namespace gguf_kernel

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")

namespace gguf_kernel {

// Tiles 0-3 the accumulators (rows r0 / r1 of x by the panel's two groups), 4 / 5 x's rows (r0 / r1 x 32 bf16),
// 6 / 7 the two groups' weights (16 x 64 bytes). r1 = 0 leaves tiles 2, 3 and 5 unconfigured.
inline void bf16_configure(int r0, int r1) {
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    c.rows[0] = c.rows[1] = c.rows[4] = (uint8_t)r0;
    c.colsb[0] = c.colsb[1] = c.colsb[4] = 64;
    if (r1 > 0) {
        c.rows[2] = c.rows[3] = c.rows[5] = (uint8_t)r1;
        c.colsb[2] = c.colsb[3] = c.colsb[5] = 64;
    }
    c.rows[6] = c.rows[7] = 16;
    c.colsb[6] = c.colsb[7] = 64;
    __asm__ volatile("" : : "r"(&c) : "memory");  // as amx_configure: keep the stores ldtilecfg reads
    _tile_loadconfig(&c);
}

// Rows [0, M) of x as bf16 into xb [M, K] (to nearest even). (M * K is a multiple of 32 for GGUF's K; the tail
// keeps the helper whole.)
inline void bf16_rows(const float *x, int64_t M, int64_t K, uint16_t *xb) {
    const int64_t n = M * K;
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(x + i));
        _mm512_storeu_si512(xb + i, (__m512i)v);
    }
    for (; i < n; i += 16) {
        const __mmask16 keep = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        const __m256bh v = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(keep, x + i));
        _mm256_mask_storeu_epi16(xb + i, keep, (__m256i)v);
    }
}

// Group g's block b (packed at blk) as the multiply's right-hand operand: out [16][32] bf16, row kk = weights 2kk,
// 2kk + 1 of each output. The block's 8 tile rows (4 consecutive weights of each output, `amx_pack`) go through
// fp32 four outputs at a time, then two bf16 rows each: the even 32-bit pairs to row 2r, the odd ones to 2r + 1.
template <bool Q41>
inline void bf16_weights(const uint8_t *blk, uint16_t *out) {
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
    const __m512 m = Q41 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 32))) : _mm512_setzero_ps();
    // output 4c + j's scale in lanes 4j..4j + 3
    __m512 dc[4], mc[4];
    for (int c = 0; c < 4; c++) {
        const __m512i idx = _mm512_set_epi32(4 * c + 3, 4 * c + 3, 4 * c + 3, 4 * c + 3, 4 * c + 2, 4 * c + 2,
                                             4 * c + 2, 4 * c + 2, 4 * c + 1, 4 * c + 1, 4 * c + 1, 4 * c + 1, 4 * c,
                                             4 * c, 4 * c, 4 * c);
        dc[c] = _mm512_permutexvar_ps(idx, d);
        mc[c] = _mm512_permutexvar_ps(idx, m);
    }
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    __m512i rows[8];
    if (Q41) {  // nibbles: weights 4k.. of each output in the low ones of bytes 64k.., 4k + 16.. in the high ones
        const __m512i low = _mm512_set1_epi8(0x0F);
        for (int k = 0; k < 4; k++) {
            const __m512i v = _mm512_loadu_si512(blk + 64 + 64 * k);
            rows[k] = _mm512_and_si512(v, low);
            rows[k + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        }
    } else {
        for (int r = 0; r < 8; r++) rows[r] = _mm512_loadu_si512(blk + 32 + 64 * r);
    }
    for (int r = 0; r < 8; r++) {
        __m512 f[4];
        for (int c = 0; c < 4; c++) {
            const __m128i q = _mm512_extracti32x4_epi32(rows[r], c);
            const __m512 v = _mm512_cvtepi32_ps(Q41 ? _mm512_cvtepu8_epi32(q) : _mm512_cvtepi8_epi32(q));
            f[c] = Q41 ? _mm512_fmadd_ps(dc[c], v, mc[c]) : _mm512_mul_ps(dc[c], v);
        }
        const __m512i lo = (__m512i)_mm512_cvtne2ps_pbh(f[1], f[0]), hi = (__m512i)_mm512_cvtne2ps_pbh(f[3], f[2]);
        _mm512_storeu_si512(out + 32 * (2 * r), _mm512_permutex2var_epi32(lo, even, hi));
        _mm512_storeu_si512(out + 32 * (2 * r + 1), _mm512_permutex2var_epi32(lo, odd, hi));
    }
}

// y's rows [m, m + rows) and outputs [n, n + 16) from a stored accumulator tile c [rows][16], + bias, only the
// outputs under N.
inline void bf16_store(const float *c, int64_t rows, float *y, int64_t m, int64_t N, int64_t n, const float *bias) {
    const __mmask16 keep = group_keep(N, n);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(keep, bias + n) : _mm512_setzero_ps();
    for (int64_t i = 0; i < rows; i++)
        _mm512_mask_storeu_ps(y + (m + i) * N + n, keep, _mm512_add_ps(_mm512_load_ps(c + 16 * i), bv));
}

// Rows [0, M) of xb (x's rows as bf16, `bf16_rows`) times the weight groups that start in weight rows [n0, n1) (as
// amx_range's), on the calling thread. panel: bf16_panel_halves(K) bf16 of the thread's own.
template <bool Q41>
void bf16_gemm_range(const uint16_t *xb, int64_t M, int64_t K, const uint8_t *packed, int64_t N, const float *bias,
                     float *y, int64_t n0, int64_t n1, uint16_t *panel) {
    constexpr int64_t BB = amx_block_bytes<Q41>();
    const int64_t g0 = amx_groups(n0), g1 = amx_groups(n1), nblk = K / QK;
    if (g0 >= g1 || M <= 0) return;
    alignas(64) float c[4][AMX_ROWS * 16];
    int conf0 = -1, conf1 = -1;
    for (int64_t g = g0; g < g1; g += 2) {
        const int64_t groups = g1 - g < 2 ? g1 - g : 2;
        for (int64_t b = 0; b < nblk; b++)
            for (int64_t i = 0; i < groups; i++)
                bf16_weights<Q41>(packed + ((g + i) * nblk + b) * BB, panel + (b * 2 + i) * AMX_GROUP * 32);
        for (int64_t m = 0; m < M; m += 2 * AMX_ROWS) {
            const int r0 = (int)(M - m < AMX_ROWS ? M - m : AMX_ROWS);
            const int r1 = (int)(M - m - r0 < AMX_ROWS ? M - m - r0 : AMX_ROWS);
            if (r0 != conf0 || r1 != conf1) bf16_configure(conf0 = r0, conf1 = r1);
            _tile_zero(0);
            _tile_zero(1);
            if (r1 > 0) {
                _tile_zero(2);
                _tile_zero(3);
            }
            const uint16_t *x0 = xb + m * K, *x1 = xb + (m + r0) * K;
            for (int64_t b = 0; b < nblk; b++) {
                const uint16_t *w = panel + b * 2 * AMX_GROUP * 32;
                _tile_loadd(4, x0 + b * QK, K * 2);
                _tile_loadd(6, w, 64);
                _tile_dpbf16ps(0, 4, 6);
                if (groups > 1) {
                    _tile_loadd(7, w + AMX_GROUP * 32, 64);
                    _tile_dpbf16ps(1, 4, 7);
                }
                if (r1 > 0) {
                    _tile_loadd(5, x1 + b * QK, K * 2);
                    _tile_dpbf16ps(2, 5, 6);
                    if (groups > 1) _tile_dpbf16ps(3, 5, 7);
                }
            }
            _tile_stored(0, c[0], 64);
            if (groups > 1) _tile_stored(1, c[1], 64);
            if (r1 > 0) {
                _tile_stored(2, c[2], 64);
                if (groups > 1) _tile_stored(3, c[3], 64);
            }
            for (int64_t i = 0; i < groups; i++) {
                bf16_store(c[i], r0, y, m, N, (g + i) * AMX_GROUP, bias);
                if (r1 > 0) bf16_store(c[2 + i], r1, y, m + r0, N, (g + i) * AMX_GROUP, bias);
            }
        }
    }
    _tile_release();
}

// bf16_gemm_range for GGML type q8 (0: Q4_1, 1: Q8_0).
inline void bf16_gemm_range(const uint16_t *xb, int64_t M, int64_t K, const uint8_t *packed, int64_t N, int q8,
                            const float *bias, float *y, int64_t n0, int64_t n1, uint16_t *panel) {
    if (q8) bf16_gemm_range<false>(xb, M, K, packed, N, bias, y, n0, n1, panel);
    else bf16_gemm_range<true>(xb, M, K, packed, N, bias, y, n0, n1, panel);
}

}  // namespace gguf_kernel

#pragma GCC pop_options

namespace gguf_kernel {
// Whether this process may run the AMX-BF16 forms: the CPU's AMX-BF16 and AVX512-BF16 (CPUID leaf 7) and the tile
// state granted (`gguf_amx_init`; a grant is never taken back, so once seen it is kept). The Python side checks
// before it asks; this keeps a wrong call a -1, not a SIGILL.
inline bool bf16_tiles_ok() {
    static const bool cpu = [] {
        unsigned a, b, c, d;
        if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 22)) || !(d & (1u << 24))) return false;
        return __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a & (1u << 5));  // AMX-BF16, AMX-TILE; AVX512-BF16
    }();
    static bool granted = false;
    if (cpu && !granted) {
        const long ARCH_GET_XCOMP_PERM = 0x1022, XFEATURE_XTILEDATA = 18;
        unsigned long mask = 0;
        granted = syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &mask) == 0 && (mask >> XFEATURE_XTILEDATA & 1);
    }
    return cpu && granted;
}
}  // namespace gguf_kernel
