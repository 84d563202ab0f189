// Int8 activations in AMX tiles for `gguf_kernel.cpp` (which includes this file after `gguf_int8.cpp`; built only
// through it, compiled for AMX-INT8 and AVX-512 (VNNI) by the target pragma below and called only where the host
// has them and the kernel granted the process its tile state: `gguf_amx_init`).
//
// The arithmetic (`fmt` bit 2, "block sums"): x quantised per 32-value block as `quantize_row` does (q_x, d_x,
// s_x), each block's 32 products summed in integers (exact: the tile multiply sums i8 x u8 or i8 x i8 products in
// int32), then per output, in block order,
//     acc = fma(d_w, (float)p * d_x, acc)
// and y = (acc + macc) + bias with Q4_1's offset term macc as `min_term` computes it (lane j over blocks j, j + 8,
// ..., then the 8-lane sum in hsum's order; here 16 outputs at once, the same operations per output). That is
// llama.cpp's order for these formats (a block's integer sum, then its scales), where the lane-wise int8
// arithmetic keeps 8 partial sums a block: the same quantised product, other roundings. A tile multiply sums a
// block for up to 16 rows of x and 16 weight rows at once, so a step's extra rows cost a block's readout (a
// convert, a multiply and an FMA for 16 outputs), not multiply-add chains of their own: on SmolLM2's Q4_1 layers
// 5 rows cost 1.5-1.7x one row, where the AVX2 lanes' cost 2.4-2.6x. Calls of few rows run the same arithmetic
// in AVX-512 VNNI lanes instead (`amx_lane_pass`: the same integer sums and readout, so the same bits), which read
// the weights faster where the tiles' fixed costs dominate. Every output's operations are the same whatever the
// rows beside it, the tiling, lanes or tiles and the threads (batch-invariant).
//
// Weights are repacked once at load (`gguf_amx_pack`: `gguf_amx_bytes` a linear) into groups of 16 weight rows,
// block by block: the 16 rows' fp16 d's, their fp16 m's (Q4_1), then their quantised values as the tile multiply's
// right-hand operand wants them (row k of the tile: 4 consecutive weights of each of the 16 weight rows). For
// Q4_1 the nibbles stay packed (weights 4k..4k+3 in the low nibbles, 4k+16.. in the high ones: split with two
// vector ops a tile row pair), so a group's block is 20 bytes a weight row, as in the file.

#include <sys/syscall.h>
#include <unistd.h>

namespace gguf_kernel {
constexpr int64_t AMX_GROUP = 16;  // weight rows a tile's columns hold
// Rows of x a tile pass holds: a tile's 16 (a group's accumulator for each in a register). One weight group a
// pass, both formats: with its blocks' tiles in two sets in turn (`amx_tile_pass`) one group measured faster than
// three groups' products in flight for Q8_0 too (SmolLM2's lm_head, 2 threads: 0.79 / 0.81 / 2.48 ms at 5 / 8 /
// 40 rows against 0.81 / 0.83 / 2.88).
constexpr int64_t AMX_ROWS = 16;

// Bytes a packed block of a 16-row group: d's and m's (fp16) and the quantised values.
template <bool Q41> constexpr int64_t amx_block_bytes() { return Q41 ? 32 + 32 + 256 : 32 + 512; }

inline int64_t amx_groups(int64_t N) { return (N + AMX_GROUP - 1) / AMX_GROUP; }

// The outputs of a group starting at weight row n that exist (rows past N are the copy's zero padding).
inline uint16_t group_keep(int64_t N, int64_t n) {
    return N - n >= AMX_GROUP ? (uint16_t)0xFFFF : (uint16_t)((1u << (N - n)) - 1);
}

// Calls of at most this many rows of x take the VNNI lanes (`amx_lane_pass`), more the tiles (the same bits either
// way). Where the crossover lies differs between hosts of one kind, so the loader measures it on the model's own
// linears and sets it per format (`gguf_amx_lane_defaults`; `engine.models.amx_crossover`): on one AMX host the
// tiles' time / the lanes' was Q4_1 1.17 / 1.16 / 1.09 / 1.06 / 0.95 at 1 / 2 / 4 / 5 / 8 rows, on another of the
// same kind 1.15 / 1.13 / 1.15 / 1.22 / 1.12 (tiles ahead only from 16 rows; `benchmarks/bench_gguf_kernel.py
// --activations int8-tiles,int8-vnni`, one thread). The built-in defaults below (the first host's) hold until
// then; `gguf_amx_lane_rows` overrides both for tests and A/Bs.
constexpr int64_t AMX_LANES_MOST = 8;
inline int amx_lanes_set = -1;                 // -1: the defaults
inline int amx_lanes_measured[2] = {-1, -1};  // [Q8_0, Q4_1]: the loader's measured crossovers (-1: built-in)
template <bool Q41> inline int64_t amx_lane_rows() {
    if (amx_lanes_set >= 0) return amx_lanes_set;
    return amx_lanes_measured[Q41] >= 0 ? amx_lanes_measured[Q41] : (Q41 ? 4 : 1);
}
constexpr int64_t PREFETCH = 2560;  // bytes ahead of the weight reads a software prefetch asks for
}  // namespace gguf_kernel

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,amx-tile,amx-int8")

namespace gguf_kernel {

struct alignas(64) TileConfig {
    uint8_t palette, start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

// `rows` split into as few passes as `most` allows, of near-equal sizes (13 rows at most 8: 7 + 6, not 8 + 5, so
// no pass is left with a sliver): pass(first row, rows) for each, in order.
template <class Pass>
inline void near_equal_passes(int64_t rows, int64_t most, Pass &&pass) {
    for (int64_t p = (rows + most - 1) / most, m = 0; p > 0; p--) {
        const int64_t mt = (rows - m + p - 1) / p;
        pass(m, mt);
        m += mt;
    }
}

// Tiles, two sets used in turn: 0 / 1 a block's sums (rows x 16 int32), 3 / 7 x's block (rows x 32 int8), 4 / 5
// the group's weights (8 x 64 bytes).
inline void amx_configure(int rows) {
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    c.rows[0] = c.rows[1] = c.rows[3] = c.rows[7] = (uint8_t)rows;
    c.colsb[0] = c.colsb[1] = 64;
    c.colsb[3] = c.colsb[7] = 32;
    c.rows[4] = c.rows[5] = 8;
    c.colsb[4] = c.colsb[5] = 64;
    // GCC 12 dropped the colsb stores: it does not see ldtilecfg read them
    __asm__ volatile("" : : "r"(&c) : "memory");
    _tile_loadconfig(&c);
}

// A Q4_1 group's block of weights as the tile wants them (nibbles split), into bt (8 x 64 bytes).
inline void amx_q41_weights(const uint8_t *qs, uint8_t *bt) {
    const __m512i mask = _mm512_set1_epi8(0x0F);
    for (int k = 0; k < 4; k++) {
        const __m512i v = _mm512_loadu_si512(qs + 64 * k);
        _mm512_store_si512(bt + 64 * k, _mm512_and_si512(v, mask));
        _mm512_store_si512(bt + 64 * (k + 4), _mm512_and_si512(_mm512_srli_epi16(v, 4), mask));
    }
}

// Q4_1's offset term for row i of x and 16 weight rows (fp16 m's of block b at mb + b * stride): min_term's
// operations for each of them.
inline __m512 amx_min_term(const uint8_t *mb, int64_t stride, const float *s, int64_t nblk) {
    __m512 a[8];
    for (int j = 0; j < 8; j++) a[j] = _mm512_setzero_ps();
    // lane j takes blocks j, j + 8, ...; min_term's zero-padded blocks add fma(0, 0, acc) = acc (acc is never -0).
    // Each FMA names its lane as a constant: indexed at run time (a[b & 7]) the lanes lived in memory.
    for (int64_t b0 = 0; b0 < nblk; b0 += 8) {
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++)
            if (b0 + j < nblk)
                a[j] = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mb + (b0 + j) * stride))),
                                       _mm512_set1_ps(s[b0 + j]), a[j]);
    }
    // hsum's order: ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))
    const __m512 t0 = _mm512_add_ps(_mm512_add_ps(a[0], a[4]), _mm512_add_ps(a[2], a[6]));
    const __m512 t1 = _mm512_add_ps(_mm512_add_ps(a[1], a[5]), _mm512_add_ps(a[3], a[7]));
    return _mm512_add_ps(t0, t1);
}

// Rows [0, MT) of xq times weight group g: the header's arithmetic for each output. Tiles configured for MT rows.
// Two sets of tiles used in turn (`amx_configure`): block b's sums are stored after block b + 1's multiply is
// issued and read out a block later still. With one set, each block's zero, multiply, store and readout waited
// for each other in turn: ~1/3 of a Q4_1 pass stalled at the store (perf), and this order measured 0.90x / 0.80x
// its time at 5 / 8 rows over SmolLM2's stack (one thread).
template <bool Q41, int MT>
inline void amx_tile_pass(XQ8 xq, int64_t K, const uint8_t *packed, int64_t g, float *y, int64_t N,
                          const float *bias) {
    constexpr int64_t BB = amx_block_bytes<Q41>();
    const int64_t nblk = xq.nblk;
    const uint8_t *w = packed + g * nblk * BB;
    // Q4_1's weights unpacked AHEAD blocks before their tile loads read them (a ring of buffers): a tile load right
    // after the vector stores that wrote its operand waited for them (1.5x slower at one row than loading packed
    // bytes). Q8_0's packed bytes are the tile operand as they are.
    constexpr int64_t AHEAD = 3, RING = AHEAD + 1;
    alignas(64) uint8_t bt[RING][512];
    alignas(64) int32_t c[2][MT * 16];
    __m512 acc[MT];
#pragma GCC unroll 16
    for (int i = 0; i < MT; i++) acc[i] = _mm512_setzero_ps();
    auto unpack = [&](int64_t b) {
        if (!Q41) return;
        amx_q41_weights(w + b * BB + 64, bt[b % RING]);
        // The tile load that reads these bytes is an asm with no memory operand: keep the vector stores before
        // it, and the next unpack of this buffer after the load of its last use.
        __asm__ volatile("" : : : "memory");
    };
    auto source = [&](int64_t b) -> const void * { return Q41 ? (const void *)bt[b % RING] : w + b * BB + 32; };
    for (int64_t b = 0; b < AHEAD && b < nblk; b++) unpack(b);
    // Two steps past the last block: the last block's store, then the last two readouts. The readout is written
    // once, here: in a lambda (called from three places) the accumulators were address-taken, and the tile
    // store's memory clobber then kept them in memory, loaded and stored around every FMA.
    for (int64_t b = 0; b < nblk + 2; b++) {
        if (b < nblk) {
            for (int64_t o = 0; o < BB; o += 64)  // as the lanes' (1.25-1.3x at 5 and 8 rows, weights past the cache)
                _mm_prefetch((const char *)(w + b * BB + o + PREFETCH), _MM_HINT_T0);
            if (b + AHEAD < nblk) unpack(b + AHEAD);
            if (b & 1) {
                _tile_loadd(5, source(b), 64);
                _tile_loadd(7, xq.q + b * QK, K);
                _tile_zero(1);
                if (Q41)  // signed x times unsigned weights (0..15)
                    _tile_dpbsud(1, 7, 5);
                else
                    _tile_dpbssd(1, 7, 5);
                _tile_stored(0, c[0], 64);
            } else {
                _tile_loadd(4, source(b), 64);
                _tile_loadd(3, xq.q + b * QK, K);
                _tile_zero(0);
                if (Q41)
                    _tile_dpbsud(0, 3, 4);
                else
                    _tile_dpbssd(0, 3, 4);
                if (b > 0) _tile_stored(1, c[1], 64);
            }
        } else if (b == nblk) {
            if ((nblk - 1) & 1)
                _tile_stored(1, c[1], 64);
            else
                _tile_stored(0, c[0], 64);
        }
        if (b < 2) continue;
        const int64_t r = b - 2;  // block r's readout
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + r * BB)));
#pragma GCC unroll 16
        for (int i = 0; i < MT; i++) {
            const __m512 dx = _mm512_set1_ps(xq.d[i * nblk + r]);
            const __m512 p = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c[r & 1] + 16 * i)), dx);
            acc[i] = _mm512_fmadd_ps(d, p, acc[i]);
        }
    }
    const int64_t n = g * AMX_GROUP;
    const __mmask16 keep = group_keep(N, n);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(keep, bias + n) : _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int i = 0; i < MT; i++) {
        const __m512 mt = Q41 ? amx_min_term(w + 32, BB, xq.s + i * xq.sblk, nblk) : _mm512_setzero_ps();
        _mm512_mask_storeu_ps(y + i * N + n, keep, _mm512_add_ps(_mm512_add_ps(acc[i], mt), bv));
    }
}

// Few rows of x in AVX-512 VNNI lanes, over the same layout and with the same arithmetic: row r of a block's
// weight tile (4 consecutive weights of the group's 16 weight rows) is one 512-bit register, and vpdpbusd of it
// with x's 4 bytes at 4r broadcast adds those 4 products into each output's int32 lane. A block's 8 rows give its
// exact integer sum per output, the tile multiply's sum; the readout is the tile pass's, so the outputs are the
// same bits (tested against the tiles at every row count). Why lanes at few rows: a tile pass pays for its nibble
// split stored to memory, the tile loads and a readout through memory whatever the rows, the lanes split the
// nibbles in registers and read x from memory once a block: at one row of SmolLM2's shapes the tile pass reads
// 16-20 GB/s of weights where the lanes reach 23-26 (2 threads, weights past the cache; 48 GB/s one thread in
// L2), while each extra row costs the lanes 8 more multiplies a block and the tiles almost nothing.
// Q8_0's weights are signed: vpdpbusd multiplies unsigned by signed bytes, so the weights go in as w + 128 (the
// sign bit flipped) and each output's sum starts at -128 * sum(q_x) of the block (corr), exact in int32.
template <bool Q41, int MT>
inline void amx_lane_pass(XQ8 xq, int64_t K, const uint8_t *packed, int64_t g, float *y, int64_t N,
                          const float *bias, const int32_t *corr) {
    constexpr int64_t BB = amx_block_bytes<Q41>(), QS = Q41 ? 64 : 32;
    const int64_t nblk = xq.nblk;
    const uint8_t *w = packed + g * nblk * BB;
    __m512 acc[MT];
    for (int i = 0; i < MT; i++) acc[i] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8((char)0x80);
    for (int64_t b = 0; b < nblk; b++) {
        const uint8_t *blk = w + b * BB;
        // the stream of weights past the cache: a software prefetch 2.5 KB ahead measured 1.1-1.2x at one row
        for (int64_t o = 0; o < BB; o += 64) _mm_prefetch((const char *)(blk + o + PREFETCH), _MM_HINT_T0);
        __m512i wr[8];
        if (Q41) {
            for (int k = 0; k < 4; k++) {
                const __m512i v = _mm512_loadu_si512(blk + QS + 64 * k);
                wr[k] = _mm512_and_si512(v, low);
                wr[k + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            }
        } else {
            for (int k = 0; k < 8; k++) wr[k] = _mm512_xor_si512(_mm512_loadu_si512(blk + QS + 64 * k), flip);
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
        // One chain a row, the rows' chains side by side (integer sums: the order does not matter); at one row,
        // two chains
        constexpr int CH = MT == 1 ? 2 : MT;
        __m512i s[CH];
#pragma GCC unroll 8
        for (int i = 0; i < CH; i++)
            s[i] = Q41 || i >= MT ? _mm512_setzero_si512() : _mm512_set1_epi32(-corr[i * nblk + b]);
#pragma GCC unroll 8
        for (int r = 0; r < 8; r++)
#pragma GCC unroll 8
            for (int i = 0; i < MT; i++) {
                int32_t xr;
                memcpy(&xr, xq.q + i * K + b * QK + 4 * r, sizeof xr);
                const int c = MT == 1 ? (r & 1) : i;
                s[c] = _mm512_dpbusd_epi32(s[c], wr[r], _mm512_set1_epi32(xr));
            }
        if (MT == 1) s[0] = _mm512_add_epi32(s[0], s[CH - 1]);
#pragma GCC unroll 8
        for (int i = 0; i < MT; i++) {
            const __m512 dx = _mm512_set1_ps(xq.d[i * nblk + b]);
            const __m512 p = _mm512_mul_ps(_mm512_cvtepi32_ps(s[i]), dx);
            acc[i] = _mm512_fmadd_ps(d, p, acc[i]);
        }
    }
    const int64_t n = g * AMX_GROUP;
    const __mmask16 keep = group_keep(N, n);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(keep, bias + n) : _mm512_setzero_ps();
    for (int i = 0; i < MT; i++) {
        const __m512 mt = Q41 ? amx_min_term(w + 32, BB, xq.s + i * xq.sblk, nblk) : _mm512_setzero_ps();
        _mm512_mask_storeu_ps(y + i * N + n, keep, _mm512_add_ps(_mm512_add_ps(acc[i], mt), bv));
    }
}

// Q8_0's correction for rows [0, M) of xq: 128 * sum(q_x) a block, exact in int32 (`amx_lane_pass`).
inline void lanes_corr(XQ8 xq, int64_t M, int64_t K, int32_t *corr) {
    for (int64_t i = 0; i < M; i++)
        for (int64_t b = 0; b < xq.nblk; b++) {
            int32_t s = 0;
            for (int k = 0; k < QK; k++) s += xq.q[i * K + b * QK + k];
            corr[i * xq.nblk + b] = 128 * s;
        }
}

// Group g for M <= AMX_LANES_MOST rows of xq in lanes.
template <bool Q41>
inline void amx_lane_group(XQ8 xq, int64_t M, int64_t K, const uint8_t *packed, int64_t g, float *y, int64_t N,
                           const float *bias, const int32_t *corr) {
    switch (M) {
        case 1: amx_lane_pass<Q41, 1>(xq, K, packed, g, y, N, bias, corr); break;
        case 2: amx_lane_pass<Q41, 2>(xq, K, packed, g, y, N, bias, corr); break;
        case 3: amx_lane_pass<Q41, 3>(xq, K, packed, g, y, N, bias, corr); break;
        case 4: amx_lane_pass<Q41, 4>(xq, K, packed, g, y, N, bias, corr); break;
        case 5: amx_lane_pass<Q41, 5>(xq, K, packed, g, y, N, bias, corr); break;
        case 6: amx_lane_pass<Q41, 6>(xq, K, packed, g, y, N, bias, corr); break;
        case 7: amx_lane_pass<Q41, 7>(xq, K, packed, g, y, N, bias, corr); break;
        default: amx_lane_pass<Q41, 8>(xq, K, packed, g, y, N, bias, corr); break;
    }
}

// Groups [g0, g1) for M <= AMX_LANES_MOST rows in lanes.
template <bool Q41>
void amx_lanes(XQ8 xq, int64_t M, int64_t K, const uint8_t *packed, int64_t N, const float *bias, float *y,
               int64_t g0, int64_t g1) {
    int32_t corr[AMX_LANES_MOST * MAX_BLOCKS_I8];
    if (!Q41) lanes_corr(xq, M, K, corr);
    for (int64_t g = g0; g < g1; g++) amx_lane_group<Q41>(xq, M, K, packed, g, y, N, bias, corr);
}

// Every row count in the VNNI lanes, over the tile layout (fmt 14 / 15: hosts with AVX-512 VNNI and no AMX, such
// as AMD Zen 4): the tile formats' arithmetic, so their bits. Group by group, the rows in passes of near-equal
// sizes of at most AMX_LANES_MOST (a group's weights, 6-16 KB on SmolLM2's shapes, stay in L1 across the passes).
// Why not the AVX2 lanes' layout on such hosts: vpdpbusd sums 4 products into each of 16 int32 lanes in one
// instruction, where AVX2's maddubs / madd / add take three for 8; a verify step's extra rows cost that much less.
// x's M rows quantised already (xq).
template <bool Q41>
void vnni_range_xq(XQ8 xq, int64_t M, int64_t K, const uint8_t *packed, int64_t N, const float *bias, float *y,
                   int64_t n0, int64_t n1) {
    const int64_t g0 = amx_groups(n0), g1 = amx_groups(n1);
    if (g0 >= g1) return;
    // Q8_0's corrections on the stack, for as many rows at a time as it holds (any step; prompts in chunks)
    int32_t corr[AMX_LANES_MOST * MAX_BLOCKS_I8];
    const int64_t chunk = Q41 ? M : (int64_t)(sizeof corr / sizeof *corr) / xq.nblk / AMX_LANES_MOST * AMX_LANES_MOST;
    for (int64_t c0 = 0; c0 < M; c0 += chunk) {
        const int64_t rows = M - c0 < chunk ? M - c0 : chunk;
        const XQ8 xc = xq.rows_from(c0, K);
        if (!Q41) lanes_corr(xc, rows, K, corr);
        for (int64_t g = g0; g < g1; g++)
            near_equal_passes(rows, AMX_LANES_MOST, [&](int64_t m, int64_t mt) {
                amx_lane_group<Q41>(xc.rows_from(m, K), mt, K, packed, g, y + (c0 + m) * N, N, bias,
                                    corr + m * xq.nblk);
            });
    }
}

// The weight groups that start in weight rows [n0, n1), on the calling thread (ranges that split [0, N) split
// its groups), x's M rows quantised already (xq).
template <bool Q41>
void amx_range_xq(XQ8 xq, int64_t M, int64_t K, const uint8_t *packed, int64_t N, const float *bias, float *y,
                  int64_t n0, int64_t n1) {
    const int64_t g0 = amx_groups(n0), g1 = amx_groups(n1);
    if (g0 >= g1) return;
    if (M <= amx_lane_rows<Q41>()) return amx_lanes<Q41>(xq, M, K, packed, N, bias, y, g0, g1);
    // Group by group, every pass of rows over the group (its weights stay in L1 across the passes); passes of
    // near-equal sizes, at most two, so the tile configuration changes at most twice a group.
    int configured = 0;
    for (int64_t g = g0; g < g1; g++)
        near_equal_passes(M, AMX_ROWS, [&](int64_t m, int64_t mt) {
            if (mt != configured) amx_configure((int)(configured = (int)mt));
            const XQ8 xm = xq.rows_from(m, K);
            float *ym = y + m * N;
            switch (mt) {
#define AMX_PASS(R) \
                case R: amx_tile_pass<Q41, R>(xm, K, packed, g, ym, N, bias); break;
                AMX_PASS(16) AMX_PASS(15) AMX_PASS(14) AMX_PASS(13) AMX_PASS(12) AMX_PASS(11) AMX_PASS(10) AMX_PASS(9)
                AMX_PASS(8) AMX_PASS(7) AMX_PASS(6) AMX_PASS(5) AMX_PASS(4) AMX_PASS(3) AMX_PASS(2)
#undef AMX_PASS
                default: amx_tile_pass<Q41, 1>(xm, K, packed, g, ym, N, bias); break;
            }
        });
    _tile_release();  // no tile state left for the next context switch to save
}

// vnni_range_xq / amx_range_xq with every row of x quantised first (into scratch: xsum_floats).
template <bool Q41>
void vnni_range(const float *x, float *scratch, int64_t M, int64_t K, const uint8_t *packed, int64_t N,
                const float *bias, float *y, int64_t n0, int64_t n1) {
    if (amx_groups(n0) < amx_groups(n1))
        vnni_range_xq<Q41>(quantize_rows(x, scratch, M, K), M, K, packed, N, bias, y, n0, n1);
}

template <bool Q41>
void amx_range(const float *x, float *scratch, int64_t M, int64_t K, const uint8_t *packed, int64_t N,
               const float *bias, float *y, int64_t n0, int64_t n1) {
    if (amx_groups(n0) < amx_groups(n1))
        amx_range_xq<Q41>(quantize_rows(x, scratch, M, K), M, K, packed, N, bias, y, n0, n1);
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
