// Prompt rows of the block formats with int8 activations: a GEMM in AVX-512 VNNI whose lanes are 16 weight rows, for
// the rows a caller marks as a prompt's (decode_layers.cpp: chosen by the row's own lane, never by how many rows
// share a call). kernels.cpp's table gives it to the int8 rows on AVX-512 (`Kernel::gemm`).
//
// The decode kernel (linear.inc) reads one weight row against a few rows of x and keeps 8 fp32 lanes a row: its
// multiply-adds are 8 lanes wide (vpmaddubsw + vpdpwssd, two a 32 values) and every row of x is read again for each
// weight row. At a prompt's hundreds of rows that ran at ~55 GMAC/s on one AMD EPYC (Zen 4) core. Here a panel of 16
// weight rows is unpacked once a call into the columns of zmm registers (their u bytes 4 values a lane, their
// integer scales and offset or min terms, d and dm), and each 4 values of a row of x, broadcast, meet all 16 in one
// vpdpbusd.
//
// The arithmetic is llama.cpp's for the K-quants (formats.h's int8 terms, against the same per-256 Q8_K rows of x
// with their per-16 sums), with exact integer totals a block instead of the decode kernel's 8 lanes:
//     S = sum_j sc_j (sum_{i in group j} u_i q_i) - sum_j off_j bs_j            (exact int32)
//     T = sum_j mn_j bs_j                                                        (exact int32, formats with a min)
//     acc = acc + float(S) * (d * dx), then acc = acc + float(T) * (dm * dx)    (fp32, each operation rounded)
// over the blocks in order from acc = 0, then the bias. Every output's operations are fixed by its weight row and row
// of x alone: batch-invariant among the rows that take it, at every row count, tiling and thread split. Its bits
// differ from the decode kernel's (another fp32 order), so a row must take one or the other by what it is.
#include <type_traits>

namespace sk {
// out[i] = dword i of each of in[0..8) (an 8 x 8 transpose of 32-bit lanes; AVX2: the GEMMs' panels, int8 and bf16)
inline void transpose8x8(const __m256i in[8], __m256i out[8]) {
    __m256i t[8], s[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_epi32(in[i], in[i + 1]);
        t[i + 1] = _mm256_unpackhi_epi32(in[i], in[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        s[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
        s[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
        s[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
        s[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        out[i] = _mm256_permute2x128_si256(s[i], s[i + 4], 0x20);
        out[i + 4] = _mm256_permute2x128_si256(s[i], s[i + 4], 0x31);
    }
}

namespace int8gemm {  // (the panels' layout and sizes: plain types, outside the AVX-512 region)
constexpr int64_t LANES = 16;  // weight rows a panel: one zmm of int32 columns
constexpr int64_t GROUPS = QK_K / GROUP;  // 16-value groups a block

// A panel's block, unpacked: u bytes [64 groups of 4 values][16 rows][4], each 16-value group's scale [16][16 rows]
// (int32: vpmulld's operand), its offset or min terms in pairs of groups [8][16 rows][2] (int16: vpdpwssd's), and the
// rows' d and dm.
struct PanelBlock {
    alignas(64) uint8_t u[QK_K / 4][LANES][4];
    alignas(64) int32_t sc[GROUPS][LANES];
    alignas(64) int16_t e[GROUPS / 2][LANES][2];
    alignas(64) float d[LANES], dm[LANES];
};

// A panel's 32-value block of a legacy format (one scale, an offset or a min): u bytes [8 groups of 4 values][16
// rows][4], the rows' d and m.
struct PanelBlock32 {
    alignas(64) uint8_t u[8][LANES][4];
    alignas(64) float d[LANES], m[LANES];
};

inline int64_t panel_bytes(int64_t K, int qk) {
    return qk == QK_K ? K / QK_K * (int64_t)sizeof(PanelBlock) : K / 32 * (int64_t)sizeof(PanelBlock32);
}

constexpr int TILE_R = 6, TILE_C = 2;  // rows of x and panels a tile: 24 zmm of sums

// A thread's scratch for blocks of qk values: a tile's panels, and room to align them to 64 bytes.
inline int64_t scratch_bytes(int64_t K, int qk = QK_K) { return panel_bytes(K, qk) * TILE_C + 64; }
}  // namespace int8gemm
}  // namespace sk

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
namespace sk {
namespace int8gemm {
// Weight rows [n, n + nb) (nb <= 16; the rest of the panel zero) of blocks w into P (K / 256 PanelBlocks).
template <class F>
void unpack_panel(const uint8_t *w, int64_t row_bytes, int64_t K, int64_t n, int64_t nb, PanelBlock *P) {
    const __m256i zero = _mm256_setzero_si256();
    for (int64_t b = 0; b < K / QK_K; b++) {
        PanelBlock &pb = P[b];
        alignas(32) int16_t off[GROUPS], mn[GROUPS];
        for (int64_t i = 0; i < LANES; i++) {
            if (i >= nb) {
                for (int j = 0; j < GROUPS; j++) pb.sc[j][i] = 0;
                for (int j = 0; j < GROUPS / 2; j++) pb.e[j][i][0] = pb.e[j][i][1] = 0;
                pb.d[i] = pb.dm[i] = 0.f;
                continue;
            }
            Unpacked U{};
            const uint8_t *blk = w + (n + i) * row_bytes + b * F::bytes;
            const typename F::Scales S(blk, U);
            for (int c = 0; c < QK_K / 32; c++) {  // group 2c's scale in int16 lane 0, 2c + 1's in lane 8
                const __m256i s = S.chunk(c);
                pb.sc[2 * c][i] = (int16_t)_mm256_extract_epi16(s, 0);
                pb.sc[2 * c + 1][i] = (int16_t)_mm256_extract_epi16(s, 8);
            }
            _mm256_store_si256((__m256i *)off, S.off16());
            _mm256_store_si256((__m256i *)mn, S.mn16());
            const int16_t *e = F::has_off ? off : mn;
            for (int j = 0; j < GROUPS / 2; j++) pb.e[j][i][0] = e[2 * j], pb.e[j][i][1] = e[2 * j + 1];
            pb.d[i] = S.d, pb.dm[i] = S.dm;
        }
        for (int c = 0; c < QK_K / 32; c++)  // 32 values of 16 rows -> their 8 groups of 4 in lanes
            for (int h = 0; h < 2; h++) {
                __m256i rows[8], cols[8];
                for (int r = 0; r < 8; r++) {
                    const int64_t i = 8 * h + r;
                    rows[r] = i < nb ? F::chunk(w + (n + i) * row_bytes + b * F::bytes, c) : zero;
                }
                transpose8x8(rows, cols);
                for (int g = 0; g < 8; g++) _mm256_store_si256((__m256i *)pb.u[8 * c + g][8 * h], cols[g]);
            }
    }
}

// Rows m .. m + R - 1 of xq against C panels (16 C weight rows) of P, into acc [R][C][16] (fp32, summed over the
// blocks in order).
template <class F, int R, int C>
inline void tile(const XQ &xq, int64_t m, const PanelBlock *const P[C], float *acc) {
    constexpr int SG = F::scale_group;
    const int64_t K = xq.K, nb = K / QK_K, ng = K / GROUP;
    __m512 a[R][C];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) a[r][c] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512i s[R][C], t[R][C];
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++) s[r][c] = _mm512_setzero_si512();
        const int8_t *xb = xq.q + m * K + b * QK_K;
        for (int j = 0; j < QK_K / SG; j++) {
            for (int r = 0; r < R; r++)
                for (int c = 0; c < C; c++) t[r][c] = _mm512_setzero_si512();
#pragma GCC unroll 8
            for (int g = 0; g < SG / 4; g++) {
                const int kg = j * (SG / 4) + g;
                __m512i u[C];
                for (int c = 0; c < C; c++) u[c] = _mm512_load_si512(P[c][b].u[kg]);
                for (int r = 0; r < R; r++) {
                    int32_t q4;
                    memcpy(&q4, xb + r * K + 4 * kg, 4);
                    const __m512i q = _mm512_set1_epi32(q4);
                    for (int c = 0; c < C; c++) t[r][c] = _mm512_dpbusd_epi32(t[r][c], u[c], q);
                }
            }
            for (int c = 0; c < C; c++) {
                const __m512i sc = _mm512_load_si512(P[c][b].sc[j * (SG / GROUP)]);
                for (int r = 0; r < R; r++) s[r][c] = _mm512_add_epi32(s[r][c], _mm512_mullo_epi32(t[r][c], sc));
            }
        }
        for (int r = 0; r < R; r++)  // the offset or min terms: group sums of x times the panel's, two groups a lane
            for (int c = 0; c < C; c++) t[r][c] = _mm512_setzero_si512();
        for (int j = 0; j < GROUPS / 2; j++)
            for (int c = 0; c < C; c++) {
                const __m512i e = _mm512_load_si512(P[c][b].e[j]);
                for (int r = 0; r < R; r++) {
                    int32_t bs2;
                    memcpy(&bs2, xq.bs + (m + r) * ng + b * GROUPS + 2 * j, 4);
                    t[r][c] = _mm512_dpwssd_epi32(t[r][c], e, _mm512_set1_epi32(bs2));
                }
            }
        for (int r = 0; r < R; r++) {
            const __m512 dx = _mm512_set1_ps(xq.d[(m + r) * nb + b]);
            for (int c = 0; c < C; c++) {
                const __m512i tot = F::has_off ? _mm512_sub_epi32(s[r][c], t[r][c]) : s[r][c];
                const __m512 dd = _mm512_mul_ps(_mm512_load_ps(P[c][b].d), dx);
                a[r][c] = _mm512_add_ps(a[r][c], _mm512_mul_ps(_mm512_cvtepi32_ps(tot), dd));
                if (F::has_min) {
                    const __m512 ddm = _mm512_mul_ps(_mm512_load_ps(P[c][b].dm), dx);
                    a[r][c] = _mm512_add_ps(a[r][c], _mm512_mul_ps(_mm512_cvtepi32_ps(t[r][c]), ddm));
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) _mm512_storeu_ps(acc + (r * C + c) * LANES, a[r][c]);
}


// The legacy formats (Q4_0, Q5_0, Q5_1): per 32-value block
//     S = sum_i u_i q_i - off sum_i q_i                                          (exact int32)
//     acc = acc + float(S) * (d * dx), then for a min acc = acc + float(sum_i q_i) * (m * dx)
// against rows of x quantised per 32 values (llama.cpp's Q8_0 with its sums: the formats' own int8 terms).
template <class F>
void unpack_panel32(const uint8_t *w, int64_t row_bytes, int64_t K, int64_t n, int64_t nb, PanelBlock32 *P) {
    for (int64_t b = 0; b < K / 32; b++) {
        PanelBlock32 &pb = P[b];
        for (int h = 0; h < 2; h++) {
            __m256i rows[8], cols[8];
            for (int r = 0; r < 8; r++) {
                const int64_t i = 8 * h + r;
                rows[r] = i < nb ? F::chunk(w + (n + i) * row_bytes + b * F::bytes, 0) : _mm256_setzero_si256();
            }
            transpose8x8(rows, cols);
            for (int g = 0; g < 8; g++) _mm256_store_si256((__m256i *)pb.u[g][8 * h], cols[g]);
        }
        for (int64_t i = 0; i < LANES; i++) {
            const uint8_t *blk = w + (n + i) * row_bytes + b * F::bytes;
            pb.d[i] = i < nb ? f16(blk) : 0.f;
            pb.m[i] = i < nb && F::has_min ? f16(blk + 2) : 0.f;
        }
    }
}

template <class F, int R, int C>
inline void tile32(const XQ &xq, int64_t m, const PanelBlock32 *const P[C], float *acc) {
    const int64_t K = xq.K, nb = K / 32, ng = K / GROUP;
    __m512 a[R][C];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) a[r][c] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512i s[R][C];
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++) s[r][c] = _mm512_setzero_si512();
        const int8_t *xb = xq.q + m * K + b * 32;
#pragma GCC unroll 8
        for (int g = 0; g < 8; g++) {
            __m512i u[C];
            for (int c = 0; c < C; c++) u[c] = _mm512_load_si512(P[c][b].u[g]);
            for (int r = 0; r < R; r++) {
                int32_t q4;
                memcpy(&q4, xb + r * K + 4 * g, 4);
                const __m512i q = _mm512_set1_epi32(q4);
                for (int c = 0; c < C; c++) s[r][c] = _mm512_dpbusd_epi32(s[r][c], u[c], q);
            }
        }
        for (int r = 0; r < R; r++) {
            const int32_t qsum = xq.bs[(m + r) * ng + 2 * b] + xq.bs[(m + r) * ng + 2 * b + 1];
            const __m512 dx = _mm512_set1_ps(xq.d[(m + r) * nb + b]);
            for (int c = 0; c < C; c++) {
                const __m512i tot = F::has_off ? _mm512_sub_epi32(s[r][c], _mm512_set1_epi32(F::off * qsum)) : s[r][c];
                const __m512 dd = _mm512_mul_ps(_mm512_load_ps(P[c][b].d), dx);
                a[r][c] = _mm512_add_ps(a[r][c], _mm512_mul_ps(_mm512_cvtepi32_ps(tot), dd));
                if (F::has_min) {
                    const __m512 mm = _mm512_mul_ps(_mm512_load_ps(P[c][b].m), dx);
                    a[r][c] = _mm512_add_ps(a[r][c], _mm512_mul_ps(_mm512_set1_ps((float)qsum), mm));
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) _mm512_storeu_ps(acc + (r * C + c) * LANES, a[r][c]);
}

// A tile of R rows against C panels, either layout.
template <class F, int R, int C, class P>
inline void any_tile(const XQ &xq, int64_t m, const P *const panels[C], float *acc) {
    if constexpr (F::qk == QK_K)
        tile<F, R, C>(xq, m, panels, acc);
    else
        tile32<F, R, C>(xq, m, panels, acc);
}

template <class F, int R, class P>
inline void tile_rows(const XQ &xq, int64_t m, const P *const panels[TILE_C], int C, float *acc) {
    if (C == 2)
        any_tile<F, R, 2>(xq, m, panels, acc);
    else
        any_tile<F, R, 1>(xq, m, panels, acc);
}

// y's row rows[i] (i for null rows) [n0, n1) = xq's row i times weight rows [n0, n1) of w, plus the bias; xq's M rows
// quantised per block of the format already (sk::quantize_row). scratch: scratch_bytes(K, F::qk).
template <class F>
void range(const XQ &xq, int64_t M, const int64_t *rows, const uint8_t *w, int64_t N, const float *bias, float *y,
           int64_t n0, int64_t n1, void *scratch) {
    using P = std::conditional_t<F::qk == QK_K, PanelBlock, PanelBlock32>;
    const int64_t K = xq.K, row_bytes = K / F::qk * F::bytes, nb = K / F::qk;
    P *panels = (P *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    alignas(64) float acc[TILE_R * TILE_C * LANES];
    for (int64_t n = n0; n < n1; n += TILE_C * LANES) {
        const int64_t width = n1 - n < TILE_C * LANES ? n1 - n : TILE_C * LANES;
        const int C = width > LANES ? 2 : 1;
        const P *pp[TILE_C] = {panels, panels + nb};
        for (int c = 0; c < C; c++) {
            const int64_t lo = n + c * LANES, cnt = width - c * LANES < LANES ? width - c * LANES : LANES;
            if constexpr (F::qk == QK_K)
                unpack_panel<F>(w, row_bytes, K, lo, cnt, panels + c * nb);
            else
                unpack_panel32<F>(w, row_bytes, K, lo, cnt, panels + c * nb);
        }
        for (int64_t m = 0; m < M; m += TILE_R) {
            const int R = M - m < TILE_R ? (int)(M - m) : TILE_R;
            switch (R) {
                case 6: tile_rows<F, 6>(xq, m, pp, C, acc); break;
                case 5: tile_rows<F, 5>(xq, m, pp, C, acc); break;
                case 4: tile_rows<F, 4>(xq, m, pp, C, acc); break;
                case 3: tile_rows<F, 3>(xq, m, pp, C, acc); break;
                case 2: tile_rows<F, 2>(xq, m, pp, C, acc); break;
                default: tile_rows<F, 1>(xq, m, pp, C, acc); break;
            }
            for (int r = 0; r < R; r++) {
                float *yr = y + (rows ? rows[m + r] : m + r) * N;
                for (int64_t j = 0; j < width; j++)
                    yr[n + j] = acc[(r * C + j / LANES) * LANES + j % LANES] + (bias ? bias[n + j] : 0.f);
            }
        }
    }
}
}  // namespace int8gemm
}  // namespace sk
#pragma GCC pop_options
