// Int8 activations in AMX tiles for `gguf_kernel.cpp` (which includes this file after `gguf_int8.cpp`; built only
// through it, compiled for AMX-INT8 and AVX-512 by the target pragma below and called only where the host has them
// and the kernel granted the process its tile state: `gguf_amx_init`).
//
// The arithmetic (`fmt` bit 2, "block sums"): x quantised per 32-value block as `quantize_row` does (q_x, d_x,
// s_x), each block's 32 products summed in integers (exact: the tile multiply sums i8 x u8 or i8 x i8 products in
// int32), then per output, in block order,
//     acc = fma(d_w, (float)p * d_x, acc)
// and y = (acc + macc) + bias with Q4_1's offset term macc as `min_term` computes it (lane j over blocks j, j + 8,
// ..., then the 8-lane sum in hsum's order; here 16 outputs at once, the same operations per output). That is
// llama.cpp's order for these formats (a block's integer sum, then its scales), where the lane-wise int8
// arithmetic keeps 8 partial sums a block: the same quantised product, other roundings. A tile multiply sums a
// block for up to 16 rows of x and 16 weight rows at once, so a step's extra rows cost the tile a few cycles and a
// multiply-add a block for 16 outputs, not a multiply-add chain of their own: verify rows are nearly free. Every
// output's operations are the same whatever the rows beside it, the tiling and the threads (batch-invariant).
//
// Weights are repacked once at load (`gguf_amx_pack`: `tiles_bytes` a linear) into groups of 16 weight rows, block
// by block: the 16 rows' fp16 d's, their fp16 m's (Q4_1), then their quantised values as the tile multiply's
// right-hand operand wants them (row k of the tile: 4 consecutive weights of each of the 16 weight rows). For
// Q4_1 the nibbles stay packed (weights 4k..4k+3 in the low nibbles, 4k+16.. in the high ones: split with two
// vector ops a tile row pair), so a group's block is 20 bytes a weight row, as in the file.

#include <sys/syscall.h>
#include <unistd.h>

namespace gguf_kernel {
constexpr int64_t AMX_GROUP = 16;  // weight rows a tile's columns hold
constexpr int64_t AMX_ROWS = 8;    // rows of x a tile pass holds: 2 groups x 8 accumulators in registers

// Bytes a packed block of a 16-row group: d's and m's (fp16) and the quantised values.
template <bool Q41> constexpr int64_t amx_block_bytes() { return Q41 ? 32 + 32 + 256 : 32 + 512; }

inline int64_t amx_groups(int64_t N) { return (N + AMX_GROUP - 1) / AMX_GROUP; }
}  // namespace gguf_kernel

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,amx-tile,amx-int8")

namespace gguf_kernel {

struct alignas(64) TileConfig {
    uint8_t palette, start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

// Tiles: 0 and 1 a block's sums for two weight groups (rows x 16 int32), 2 x's block (rows x 32 int8), 3 and 4 the
// two groups' weights (8 x 64 bytes).
inline void amx_configure(int rows) {
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    c.rows[0] = c.rows[1] = (uint8_t)rows;
    c.colsb[0] = c.colsb[1] = 64;
    c.rows[2] = (uint8_t)rows;
    c.colsb[2] = 32;
    c.rows[3] = c.rows[4] = 8;
    c.colsb[3] = c.colsb[4] = 64;
    __asm__ volatile("" : : "r"(&c) : "memory");  // GCC 12 dropped the colsb stores: it does not see ldtilecfg read them
    _tile_loadconfig(&c);
}

// A Q4_1 group's block of weights as the tile wants them (nibbles split), into bt (8 x 64 bytes).
template <bool Q41>
inline void amx_weights(const uint8_t *qs, uint8_t *bt) {
    const __m512i mask = _mm512_set1_epi8(0x0F);
    for (int k = 0; k < 4; k++) {
        const __m512i v = _mm512_loadu_si512(qs + 64 * k);
        _mm512_store_si512(bt + 64 * k, _mm512_and_si512(v, mask));
        _mm512_store_si512(bt + 64 * (k + 4), _mm512_and_si512(_mm512_srli_epi16(v, 4), mask));
    }
}

// One block's tile products for the two groups' weights in tiles 3 and 4 and x's block in tile 2 -> c0, c1.
template <bool Q41>
inline void amx_block_sums(int32_t *c0, int32_t *c1) {
    _tile_zero(0);
    _tile_zero(1);
    if (Q41) {  // signed x times unsigned weights (0..15)
        _tile_dpbsud(0, 2, 3);
        _tile_dpbsud(1, 2, 4);
    } else {
        _tile_dpbssd(0, 2, 3);
        _tile_dpbssd(1, 2, 4);
    }
    _tile_stored(0, c0, 64);
    _tile_stored(1, c1, 64);
}

// Q4_1's offset term for row i of x and 16 weight rows (fp16 m's of block b at mb + b * stride): min_term's
// operations for each of them.
inline __m512 amx_min_term(const uint8_t *mb, int64_t stride, const float *s, int64_t nblk) {
    __m512 a[8];
    for (int j = 0; j < 8; j++) a[j] = _mm512_setzero_ps();
    // lane j takes blocks j, j + 8, ...; min_term's zero-padded blocks add fma(0, 0, acc) = acc (acc is never -0)
    for (int64_t b = 0; b < nblk; b++)
        a[b & 7] = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mb + b * stride))),
                                   _mm512_set1_ps(s[b]), a[b & 7]);
    // hsum's order: ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))
    const __m512 t0 = _mm512_add_ps(_mm512_add_ps(a[0], a[4]), _mm512_add_ps(a[2], a[6]));
    const __m512 t1 = _mm512_add_ps(_mm512_add_ps(a[1], a[5]), _mm512_add_ps(a[3], a[7]));
    return _mm512_add_ps(t0, t1);
}

// Rows [0, MT) of xq times weight groups g and g + 1 (where g + 1 < g_end; else g alone, computed twice): the
// header's arithmetic for each output. Tiles configured for MT rows.
template <bool Q41, int MT>
inline void amx_tile_pass(XQ8 xq, int64_t K, const uint8_t *packed, int64_t g, int64_t g_end, float *y,
                          int64_t N, const float *bias) {
    constexpr int64_t BB = amx_block_bytes<Q41>();
    const int64_t nblk = xq.nblk, group_bytes = nblk * BB;
    const int64_t g1 = g + 1 < g_end ? g + 1 : g;
    const uint8_t *w0 = packed + g * group_bytes, *w1 = packed + g1 * group_bytes;
    // Weights unpacked AHEAD blocks before their tile loads read them (a ring of buffers): a tile load right after
    // the vector stores that wrote its operand waited for them (1.5x slower at one row than loading packed bytes).
    constexpr int64_t AHEAD = 3, RING = AHEAD + 1;
    alignas(64) uint8_t bt[RING][2][512];
    alignas(64) int32_t c0[MT * 16], c1[MT * 16];
    __m512 acc0[MT], acc1[MT];
    for (int i = 0; i < MT; i++) acc0[i] = acc1[i] = _mm512_setzero_ps();
    const int64_t qs_at = Q41 ? 64 : 32;
    auto unpack = [&](int64_t b) {
        amx_weights<Q41>(w0 + b * BB + qs_at, bt[b % RING][0]);
        amx_weights<Q41>(w1 + b * BB + qs_at, bt[b % RING][1]);
    };
    if (Q41)
        for (int64_t b = 0; b < AHEAD && b < nblk; b++) unpack(b);
    for (int64_t b = 0; b < nblk; b++) {
        if (Q41) {
            if (b + AHEAD < nblk) unpack(b + AHEAD);
            _tile_loadd(3, bt[b % RING][0], 64);
            _tile_loadd(4, bt[b % RING][1], 64);
        } else {  // Q8_0's packed bytes are the tile operand as they are
            _tile_loadd(3, w0 + b * BB + qs_at, 64);
            _tile_loadd(4, w1 + b * BB + qs_at, 64);
        }
        _tile_loadd(2, xq.q + b * QK, K);
        amx_block_sums<Q41>(c0, c1);
        const __m512 d0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w0 + b * BB)));
        const __m512 d1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w1 + b * BB)));
        for (int i = 0; i < MT; i++) {
            const __m512 dx = _mm512_set1_ps(xq.d[i * nblk + b]);
            const __m512 p0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c0 + 16 * i)), dx);
            const __m512 p1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c1 + 16 * i)), dx);
            acc0[i] = _mm512_fmadd_ps(d0, p0, acc0[i]);
            acc1[i] = _mm512_fmadd_ps(d1, p1, acc1[i]);
        }
    }
    for (int half = 0; half < (g1 != g ? 2 : 1); half++) {
        const int64_t n = (g + half) * AMX_GROUP;
        const __mmask16 keep = N - n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (N - n)) - 1);
        const __m512 bv = bias ? _mm512_maskz_loadu_ps(keep, bias + n) : _mm512_setzero_ps();
        const uint8_t *w = half ? w1 : w0;
        for (int i = 0; i < MT; i++) {
            const __m512 mt = Q41 ? amx_min_term(w + 32, BB, xq.s + i * xq.sblk, nblk) : _mm512_setzero_ps();
            _mm512_mask_storeu_ps(y + i * N + n, keep, _mm512_add_ps(_mm512_add_ps(half ? acc1[i] : acc0[i], mt), bv));
        }
    }
}

// The weight groups that start in weight rows [n0, n1), on the calling thread (ranges that split [0, N) split
// its groups), every row of x quantised first (into scratch: xsum_floats).
template <bool Q41>
void amx_range(const float *x, float *scratch, int64_t M, int64_t K, const uint8_t *packed, int64_t N,
               const float *bias, float *y, int64_t n0, int64_t n1) {
    const int64_t g0 = amx_groups(n0), g1 = amx_groups(n1);
    if (g0 >= g1) return;
    const XQ8 xq = xq8_view(scratch, M, K);
    for (int64_t r = 0; r < M; r++) quantize_row(x, xq, r);
    int configured = 0;
    for (int64_t tiles = (M + AMX_ROWS - 1) / AMX_ROWS, m = 0; tiles > 0; tiles--) {
        const int64_t mt = (M - m + tiles - 1) / tiles;  // near-equal passes of at most AMX_ROWS rows
        if (mt != configured) amx_configure((int)(configured = (int)mt));
        const XQ8 xm = xq.rows_from(m, K);
        float *ym = y + m * N;
        for (int64_t g = g0; g < g1; g += 2) {
            switch (mt) {
                case 8: amx_tile_pass<Q41, 8>(xm, K, packed, g, g1, ym, N, bias); break;
                case 7: amx_tile_pass<Q41, 7>(xm, K, packed, g, g1, ym, N, bias); break;
                case 6: amx_tile_pass<Q41, 6>(xm, K, packed, g, g1, ym, N, bias); break;
                case 5: amx_tile_pass<Q41, 5>(xm, K, packed, g, g1, ym, N, bias); break;
                case 4: amx_tile_pass<Q41, 4>(xm, K, packed, g, g1, ym, N, bias); break;
                case 3: amx_tile_pass<Q41, 3>(xm, K, packed, g, g1, ym, N, bias); break;
                case 2: amx_tile_pass<Q41, 2>(xm, K, packed, g, g1, ym, N, bias); break;
                default: amx_tile_pass<Q41, 1>(xm, K, packed, g, g1, ym, N, bias); break;
            }
        }
        m += mt;
    }
    _tile_release();  // no tile state left for the next context switch to save
}

}  // namespace gguf_kernel

#pragma GCC pop_options

namespace gguf_kernel {
// Repack `blocks` [N, K / 32] (GGUF Q4_1 or Q8_0) into the tile layout above; rows past N are zeros. Plain code,
// outside the AMX target: it runs on any host (tests check the layout everywhere).
template <bool Q41>
void amx_pack(const uint8_t *blocks, int64_t N, int64_t K, uint8_t *out) {
    constexpr int64_t BB = amx_block_bytes<Q41>(), FB = Q41 ? 20 : 34;
    const int64_t nblk = K / QK, groups = amx_groups(N);
    memset(out, 0, (size_t)(groups * nblk * BB));
    for (int64_t g = 0; g < groups; g++)
        for (int64_t b = 0; b < nblk; b++) {
            uint8_t *o = out + (g * nblk + b) * BB;
            for (int64_t j = 0; j < AMX_GROUP && g * AMX_GROUP + j < N; j++) {
                const uint8_t *blk = blocks + ((g * AMX_GROUP + j) * nblk + b) * FB;
                memcpy(o + 2 * j, blk, 2);  // d
                if (Q41) {
                    memcpy(o + 32 + 2 * j, blk + 2, 2);  // m
                    for (int k = 0; k < 4; k++) memcpy(o + 64 + 64 * k + 4 * j, blk + 4 + 4 * k, 4);
                } else {
                    for (int k = 0; k < 8; k++) memcpy(o + 32 + 64 * k + 4 * j, blk + 2 + 4 * k, 4);
                }
            }
        }
}
}  // namespace gguf_kernel
