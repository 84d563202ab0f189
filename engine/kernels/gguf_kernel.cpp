// GGUF's quantised blocks times fp32 activations on x86 AVX2 (+FMA, F16C): y = x @ W.T (+ bias), where W is a
// weight matrix stored as llama.cpp's Q4_1 or Q8_0 blocks, read as they are (5 or 8.5 bits a weight against
// fp32's 32: a batch-1 decode step is a pass over the weights, so this is what sets its speed).
//
// Every output y[m, n] is computed the same way whatever the number of rows M, the tiling and the threads, so a
// row's bits never depend on the rows beside it (batch invariance: a verify row's logits are bitwise the plain
// decode step's at that position). Per 32-weight block b of weight row n, lane-wise over the block's four
// 8-value chunks c (q: the block's quantised values as fp32, exact small integers; d, m: its scale and offset):
//     s = q0 x0;  s = fma(q1, x1, s);  s = fma(q2, x2, s);  s = fma(q3, x3, s)
//     acc = fma(d, s, acc);  acc = fma(m, xsum_b, acc)        (Q4_1 only; xsum_b = ((x0 + x1) + (x2 + x3)))
// in block order, then a fixed horizontal sum of acc's 8 lanes and the bias. That is sum_k x_k (d q_k + m), the
// dequantised weights' dot product with fp32 roundings in another order (as close to the fp64 result as MKL's
// fp32 GEMV on these weights, measured), with d and m applied once a block rather than once a weight.
//
// With int8 activations (`fmt` bit 1, `--activations int8`: llama.cpp's arithmetic for these formats, faster and
// not exact) each row of x is first quantised per 32-value block: d_x = amax / 127, q_x = round(x * (127 / amax))
// (nearest, ties to even; amax = 0 gives d_x = 0, q_x = 0), s_x = d_x * sum(q_x) (llama.cpp's Q8_1 sum, in fp32:
// the offset multiplies the same quantised x as the nibbles). Then per block, with p the block's integer products summed in pairs (exact: vpmaddubsw,
// vpmaddwd) as 8 int32 lanes converted to fp32 (exact, |p| < 2^24):
//     acc = fma(d, p * d_x, acc)
// in block order; Q4_1's offset term macc = sum_b m_b s_x,b runs lane j over blocks j, j + 8, ... (fma), then
// hsum; y = (hsum(acc) + macc) + bias. Per row, so batch-invariant the same way.
//
// Threads split the weight rows (OpenMP, the process's runtime: torch's libgomp is loaded first and has the same
// soname), so each weight byte is read once per call whatever M is.

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "transpose.h"

namespace gguf_kernel {
constexpr int QK = 32;  // weights a block
constexpr int64_t ROW_BLOCK_BYTES = 192 << 10;  // activations a row block holds (L2 is 512 KiB a core here)
constexpr int64_t MAX_TILE = 6;  // rows a tile: 6 accumulators, 4 converted chunks, d, m and temporaries in 16 ymm

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

inline float half_to_float(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

// Q4_1: fp16 d, fp16 m, 16 bytes; byte j holds weight j in its low nibble and weight j + 16 in its high one.
// Bytes 0-7 and 8-15 are widened to 32-bit lanes straight from memory (vpmovzxbd m64) and split into nibbles
// there, and d and m come from one 4-byte load and one conversion: 1.6x the one-row kernel's speed on SmolLM2's
// layers (Zen 3, L3-resident weights) against splitting the nibbles in bytes first (two byte shifts, four
// register widenings, two scalar fp16 loads), with the same q, d and m, so the same bits.
struct Q41 {
    static constexpr int bytes = 20;
    static constexpr bool has_min = true;
    static inline void load(const uint8_t *blk, __m256 q[4], __m256 &d, __m256 &m) {
        uint32_t dm;
        memcpy(&dm, blk, 4);
        const __m128 dmf = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dm));  // d, m, 0, 0
        d = _mm256_broadcastss_ps(dmf);
        m = _mm256_broadcastss_ps(_mm_movehdup_ps(dmf));
        const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 4)));
        const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 12)));
        const __m256i mask = _mm256_set1_epi32(0x0F);
        q[0] = _mm256_cvtepi32_ps(_mm256_and_si256(b0, mask));  // weights 0-7
        q[1] = _mm256_cvtepi32_ps(_mm256_and_si256(b1, mask));  // 8-15
        q[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4));    // 16-23
        q[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4));    // 24-31
    }
};

// Q8_0: fp16 d, 32 int8 weights.
struct Q80 {
    static constexpr int bytes = 34;
    static constexpr bool has_min = false;
    static inline void load(const uint8_t *blk, __m256 q[4], __m256 &d, __m256 &m) {
        d = _mm256_set1_ps(half_to_float(blk));
        m = _mm256_setzero_ps();
        for (int c = 0; c < 4; c++)
            q[c] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 2 + 8 * c))));
    }
};

}  // namespace gguf_kernel

// Int8 activations (the header's second arithmetic): their quantisation, block formats and tiles.
#include "gguf_int8.cpp"
// Int8 activations in AMX tiles (block sums: a third arithmetic, on repacked weights, where the host has AMX-INT8).
#include "gguf_amx.cpp"
// Prompt rows over the AMX formats' copy in AMX-BF16 tiles (bf16 products summed in fp32, where the host has AMX-BF16).
#include "gguf_amx_bf16.cpp"

namespace gguf_kernel {
// Rows [0, MT) of x (row stride K) times weight row n: each block's values are converted once for MT rows.
template <class F, int MT>
inline void rows_times_weight_row(const float *x, const float *xsum, int64_t K, const uint8_t *wrow, float *y,
                                  int64_t N, int64_t n, const float *bias) {
    const int64_t nblk = K / QK;
    __m256 acc[MT];
    for (int i = 0; i < MT; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nblk; b++) {
        __m256 q[4], d, m;
        F::load(wrow + b * F::bytes, q, d, m);
        for (int i = 0; i < MT; i++) {
            const float *xb = x + i * K + b * QK;
            __m256 s = _mm256_mul_ps(q[0], _mm256_loadu_ps(xb));
            s = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xb + 8), s);
            s = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xb + 16), s);
            s = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xb + 24), s);
            acc[i] = _mm256_fmadd_ps(d, s, acc[i]);
            if (F::has_min) acc[i] = _mm256_fmadd_ps(m, _mm256_load_ps(xsum + (i * nblk + b) * 8), acc[i]);
        }
    }
    for (int i = 0; i < MT; i++) y[i * N + n] = hsum(acc[i]) + (bias ? bias[n] : 0.f);
}

// One row of x times weight rows [n, n + NW): NW accumulator chains where rows_times_weight_row<F, 1> has one
// (a lone row's chain is latency-bound: 4 weight rows at once measured 1.1x on SmolLM2's Q4_1 layers at one row;
// on the Q8_0 lm_head, 2x slower: its rows' streams lost bandwidth, so only Q4_1 takes it). Each output's
// operations are rows_times_weight_row<F, 1>'s in the same order: the same bits.
template <class F, int NW>
inline void row_times_weight_rows(const float *x, const float *xsum, int64_t K, const uint8_t *w, int64_t row_bytes,
                                  float *y, int64_t n, const float *bias) {
    const int64_t nblk = K / QK;
    __m256 acc[NW];
    for (int j = 0; j < NW; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nblk; b++) {
        const float *xb = x + b * QK;
        for (int j = 0; j < NW; j++) {
            __m256 q[4], d, m;
            F::load(w + (n + j) * row_bytes + b * F::bytes, q, d, m);
            __m256 s = _mm256_mul_ps(q[0], _mm256_loadu_ps(xb));
            s = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xb + 8), s);
            s = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xb + 16), s);
            s = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xb + 24), s);
            acc[j] = _mm256_fmadd_ps(d, s, acc[j]);
            if (F::has_min) acc[j] = _mm256_fmadd_ps(m, _mm256_load_ps(xsum + b * 8), acc[j]);
        }
    }
    for (int j = 0; j < NW; j++) y[n + j] = hsum(acc[j]) + (bias ? bias[n + j] : 0.f);
}

// Rows [m0, m1) times weight row n in near-equal tiles of at most MAX_TILE rows: the block's values are converted
// once a tile, and every tile has several accumulator chains to hide their latency (5 rows as 4 + 1 converted the
// weights twice and left the last row's chain alone: 1.2-1.3x slower at 5 rows, measured).
template <class F>
inline void rows_times_weight(const float *x, const float *xsum, int64_t m0, int64_t m1, int64_t K,
                              const uint8_t *wrow, float *y, int64_t N, int64_t n, const float *bias) {
    const int64_t nblk = K / QK;
    int64_t m = m0;
    for (int64_t tiles = (m1 - m0 + MAX_TILE - 1) / MAX_TILE; tiles > 0; tiles--) {
        const int64_t mt = (m1 - m + tiles - 1) / tiles;
        const float *xm = x + m * K, *sm = xsum + m * nblk * 8;
        float *ym = y + m * N;
        switch (mt) {
            case 6: rows_times_weight_row<F, 6>(xm, sm, K, wrow, ym, N, n, bias); break;
            case 5: rows_times_weight_row<F, 5>(xm, sm, K, wrow, ym, N, n, bias); break;
            case 4: rows_times_weight_row<F, 4>(xm, sm, K, wrow, ym, N, n, bias); break;
            case 3: rows_times_weight_row<F, 3>(xm, sm, K, wrow, ym, N, n, bias); break;
            case 2: rows_times_weight_row<F, 2>(xm, sm, K, wrow, ym, N, n, bias); break;
            default: rows_times_weight_row<F, 1>(xm, sm, K, wrow, ym, N, n, bias); break;
        }
        m += mt;
    }
}

// Activations a row block holds: rows in blocks that stay in L2 (a prompt's 1,024 rows streamed from L3 once per
// weight row ran at a fraction of the kernel's speed); each block passes over every weight row.
inline int64_t rows_a_block(int64_t K) {
    const int64_t fit = ROW_BLOCK_BYTES / (K * 4) / MAX_TILE * MAX_TILE;
    return fit > MAX_TILE ? fit : MAX_TILE;
}

// xsum for block i of x (Q4_1's offset term)
inline void block_sum(const float *x, float *xsum, int64_t i) {
    const float *xb = x + i * QK;
    const __m256 a = _mm256_add_ps(_mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 8));
    const __m256 b = _mm256_add_ps(_mm256_loadu_ps(xb + 16), _mm256_loadu_ps(xb + 24));
    _mm256_store_ps(xsum + i * 8, _mm256_add_ps(a, b));
}
}  // namespace gguf_kernel

// fp32 activations two weight rows at a time in AVX-512 (the same bits), where the CPU has it.
#include "gguf_avx512.cpp"

namespace gguf_kernel {

// Weight rows [n0, n1) of x's rows, their block sums in xsum (Q4_1): AVX2 one weight row at a time (a lone row of
// x: four), or AVX-512 two at a time where the CPU has it (the same bits).
template <class F>
void range_body(const float *x, const float *xsum, int64_t M, int64_t K, const uint8_t *w, int64_t N,
                const float *bias, float *y, int64_t n0, int64_t n1) {
    if (avx512_ok()) return range_body_avx512<F>(x, xsum, M, K, w, N, bias, y, n0, n1);
    const int64_t nblk = K / QK, row_bytes = nblk * F::bytes, rb = rows_a_block(K);
    for (int64_t m0 = 0; m0 < M; m0 += rb) {
        const int64_t m1 = m0 + rb < M ? m0 + rb : M;
        int64_t n = n0;
        if (F::has_min && m1 - m0 == 1)  // Q4_1, a lone row: four weight rows at once
            for (; n + 4 <= n1; n += 4)
                row_times_weight_rows<F, 4>(x + m0 * K, xsum + m0 * nblk * 8, K, w, row_bytes, y + m0 * N, n, bias);
        for (; n < n1; n++) rows_times_weight<F>(x, xsum, m0, m1, K, w + n * row_bytes, y, N, n, bias);
    }
}

// Every weight row over `threads` threads (contiguous shares), block sums split first.
template <class F>
void run(const float *x, float *xsum, int64_t M, int64_t K, const uint8_t *w, int64_t N, const float *bias,
         float *y, int threads) {
    const int64_t nblk = K / QK;
    #pragma omp parallel num_threads(threads)
    {
        if (F::has_min) {
            #pragma omp for schedule(static)
            for (int64_t i = 0; i < M * nblk; i++) block_sum(x, xsum, i);
        }  // (the loop's implied barrier: every block sum is in before any thread reads them)
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        range_body<F>(x, xsum, M, K, w, N, bias, y, N * t / nt, N * (t + 1) / nt);
    }
}

// Weight rows [n0, n1) only, on the calling thread (callers that split a linear's rows over their own threads:
// decode_layers.cpp). The same operations per output as `run`, so the same bits.
template <class F>
void run_range(const float *x, float *xsum, int64_t M, int64_t K, const uint8_t *w, int64_t N, const float *bias,
               float *y, int64_t n0, int64_t n1) {
    if (F::has_min)
        for (int64_t i = 0; i < M * (K / QK); i++) block_sum(x, xsum, i);
    range_body<F>(x, xsum, M, K, w, N, bias, y, n0, n1);
}

// Scratch floats `linear_range` needs for M rows of width K: fp32 activations' block sums (8 a block) or int8
// activations (32 bytes, d and s a block).
inline int64_t xsum_floats(int64_t M, int64_t K) { return M * (K / QK) * 8 + M * (2 * (K / QK) + 8); }

// `fmt`: bit 0 the GGML type (0: Q4_1, 1: Q8_0), bit 1 int8 activations (the header's two arithmetics), bit 2
// (with bit 1) int8 activations in AMX tiles over weights repacked by gguf_amx_pack (gguf_amx.cpp's block sums).
// bit 3 (with bits 1 and Q4_1): int8 activations in AVX2 lanes over weights repacked by gguf_lanes_pack (the same
// bits as fmt 2); bits 2 and 3 (with bit 1): the AMX formats' arithmetic and layout in AVX-512 VNNI lanes at every
// row count (the same bits as fmt 6 / 7, on hosts without AMX).
constexpr int FMT_INT8 = 2, FMT_AMX = 4, FMT_LANES = 8;
inline bool fmt_ok(int64_t fmt, int64_t K) {
    return (fmt >= 0 && fmt <= 3 && (fmt < FMT_INT8 || K / QK <= MAX_BLOCKS_I8)) || fmt == 6 || fmt == 7 || fmt == 14 || fmt == 15 ||
           (fmt == 10 && K / QK <= MAX_BLOCKS_I8);
}

// run_range for `fmt`; xsum: xsum_floats(M, K) floats, 32-byte aligned. With FMT_AMX, w is gguf_amx_pack's layout
// and [n0, n1) takes the 16-row groups that start in it.
inline void linear_range(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, int fmt,
                         const float *bias, float *y, int64_t n0, int64_t n1, float *xsum) {
    switch (fmt) {
        case 0: run_range<Q41>(x, xsum, M, K, w, N, bias, y, n0, n1); break;
        case 1: run_range<Q80>(x, xsum, M, K, w, N, bias, y, n0, n1); break;
        case 2: run_range_i8<Q41i8>(x, xsum, M, K, w, N, bias, y, n0, n1); break;
        case 3: run_range_i8<Q80i8>(x, xsum, M, K, w, N, bias, y, n0, n1); break;
        case 10: run_range_i8<Q41i8, true>(x, xsum, M, K, w, N, bias, y, n0, n1); break;
        case 6: amx_range<true>(x, xsum, M, K, w, N, bias, y, n0, n1); break;
        case 14: vnni_range<true>(x, xsum, M, K, w, N, bias, y, n0, n1); break;
        case 15: vnni_range<false>(x, xsum, M, K, w, N, bias, y, n0, n1); break;
        default: amx_range<false>(x, xsum, M, K, w, N, bias, y, n0, n1); break;
    }
}

// linear_range for an int8 format (`fmt` & FMT_INT8) over x's M rows quantised already (xq: quantize_row's), so
// that the threads of a call can each quantise a share of the rows once for all of them. The same bits.
inline void linear_range_xq(XQ8 xq, int64_t M, int64_t K, const uint8_t *w, int64_t N, int fmt, const float *bias,
                            float *y, int64_t n0, int64_t n1) {
    switch (fmt) {
        case 2: run_range_i8_xq<Q41i8>(xq, M, K, w, N, bias, y, n0, n1); break;
        case 3: run_range_i8_xq<Q80i8>(xq, M, K, w, N, bias, y, n0, n1); break;
        case 10: run_range_i8_xq<Q41i8, true>(xq, M, K, w, N, bias, y, n0, n1); break;
        case 6: amx_range_xq<true>(xq, M, K, w, N, bias, y, n0, n1); break;
        case 14: vnni_range_xq<true>(xq, M, K, w, N, bias, y, n0, n1); break;
        case 15: vnni_range_xq<false>(xq, M, K, w, N, bias, y, n0, n1); break;
        default: amx_range_xq<false>(xq, M, K, w, N, bias, y, n0, n1); break;  // 7
    }
}
}  // namespace gguf_kernel

#include "gguf_gemm.cpp"

extern "C" {
// x [M, K] fp32 contiguous; w [N, K / 32 blocks] of `fmt` (0: Q4_1, 1: Q8_0; + 2: int8 activations; + 4 more:
// in AMX tiles, w repacked by gguf_amx_pack); bias [N] or null; y [M, N]. Returns 0, or -1 if K is not a
// multiple of 32 or fmt is unknown, -2 if the scratch cannot be allocated.
int gguf_linear(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, int fmt, const float *bias,
                float *y, int threads) {
    if (K % gguf_kernel::QK != 0 || !gguf_kernel::fmt_ok(fmt, K)) return -1;
    if (fmt & gguf_kernel::FMT_INT8) {  // each thread quantises x for itself (M x K: small against the weights)
        const int64_t per = (gguf_kernel::xsum_floats(M, K) + 7) / 8 * 8;
        float *scratch = (float *)aligned_alloc(32, sizeof(float) * (size_t)(per * threads));
        if (!scratch) return -2;
        #pragma omp parallel num_threads(threads)
        {
            const int t = omp_get_thread_num(), nt = omp_get_num_threads();
            gguf_kernel::linear_range(x, M, K, w, N, fmt, bias, y, N * t / nt, N * (t + 1) / nt, scratch + t * per);
        }
        free(scratch);
        return 0;
    }
    float *xsum = nullptr;
    if (fmt == 0) {
        xsum = (float *)aligned_alloc(32, (size_t)(M * (K / gguf_kernel::QK) * 8) * sizeof(float) + 32);
        if (!xsum) return -2;
    }
    if (fmt == 0) gguf_kernel::run<gguf_kernel::Q41>(x, xsum, M, K, w, N, bias, y, threads);
    else gguf_kernel::run<gguf_kernel::Q80>(x, xsum, M, K, w, N, bias, y, threads);
    free(xsum);
    return 0;
}

// Ask the kernel for this process's AMX tile state (Linux grants it per process, once): 0 if granted, else -1. The
// AMX formats (fmt 6, 7) must not run before it returned 0.
int gguf_amx_init(void) {
    const long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : -1;
}

// on = 0: fp32 activations take the AVX2 forms even where the CPU has AVX-512 (the same bits: tests and A/Bs
// compare them); 1: the AVX-512 forms where the CPU has them (the default). Returns whether they run now.
int gguf_use_avx512(int on) {
    gguf_kernel::avx512_off = !on;
    return gguf_kernel::avx512_ok();
}

// Calls of at most `rows` rows (0-8) of x take the AMX formats' VNNI lanes, more the tiles (the same bits);
// -1 restores the defaults (`gguf_amx_lane_defaults`). Returns the previous setting.
int gguf_amx_lane_rows(int rows) {
    const int was = gguf_kernel::amx_lanes_set;
    const int most = (int)gguf_kernel::AMX_LANES_MOST;
    gguf_kernel::amx_lanes_set = rows < -1 ? -1 : rows > most ? most : rows;
    return was;
}

// The defaults `gguf_amx_lane_rows(-1)` restores, per format (Q4_1, Q8_0): calls of at most that many rows (0-8)
// take the VNNI lanes; -1 the built-in default. The loader sets the crossovers it measured. Returns 0.
int gguf_amx_lane_defaults(int q41_rows, int q80_rows) {
    const int most = (int)gguf_kernel::AMX_LANES_MOST;
    auto clamp = [most](int r) { return r < -1 ? -1 : r > most ? most : r; };
    gguf_kernel::amx_lanes_measured[1] = clamp(q41_rows);
    gguf_kernel::amx_lanes_measured[0] = clamp(q80_rows);
    return 0;
}

// The row count up to which calls of format `fmt` (0: Q4_1, 1: Q8_0) take the VNNI lanes now.
int gguf_amx_lane_rows_now(int fmt) {
    return (int)(fmt == 0 ? gguf_kernel::amx_lane_rows<true>() : gguf_kernel::amx_lane_rows<false>());
}

// Bytes gguf_amx_pack writes for an [N, K] weight of GGML type `fmt` (0: Q4_1, 1: Q8_0).
int64_t gguf_amx_bytes(int fmt, int64_t N, int64_t K) {
    return gguf_kernel::amx_groups(N) * (K / gguf_kernel::QK) *
           (fmt == 0 ? gguf_kernel::amx_block_bytes<true>() : gguf_kernel::amx_block_bytes<false>());
}

// blocks [N, K / 32] of `fmt` -> out (gguf_amx_bytes): the AMX formats' weights. Returns 0, -1 for a bad fmt or K.
int gguf_amx_pack(const uint8_t *blocks, int64_t N, int64_t K, int fmt, uint8_t *out) {
    if (K % gguf_kernel::QK != 0 || (fmt != 0 && fmt != 1)) return -1;
    if (fmt == 0) gguf_kernel::amx_pack<true>(blocks, N, K, out);
    else gguf_kernel::amx_pack<false>(blocks, N, K, out);
    return 0;
}

// Bytes gguf_lanes_pack writes for an [N, K] weight of GGML type `fmt` (0: Q4_1; -1 for another).
int64_t gguf_lanes_bytes(int fmt, int64_t N, int64_t K) {
    return fmt == 0 ? N * gguf_kernel::lanes_row_bytes(K) : -1;
}

// Q4_1 blocks [N, K / 32] -> out (gguf_lanes_bytes): what fmt 10 reads. Returns 0, -1 for a bad fmt or K.
int gguf_lanes_pack(const uint8_t *blocks, int64_t N, int64_t K, int fmt, uint8_t *out) {
    if (K % gguf_kernel::QK != 0 || fmt != 0) return -1;
    gguf_kernel::lanes_pack(blocks, N, K, out);
    return 0;
}

// The prompt GEMM over all of w's rows: x [M, K] fp32 contiguous; w, bias, y as gguf_linear's. fmt 0 / 1: the
// dequantised blocks in fp32 panels (gguf_gemm.cpp); 6 / 7 (w: gguf_amx_pack's copy): in AMX-BF16 tiles
// (gguf_amx_bf16.cpp: only where the host has AMX-BF16 and gguf_amx_init returned 0). Returns 0, -1 if K is not a
// multiple of 32 or fmt is not one of those, -2 if the scratch cannot be allocated.
static_assert(gguf_kernel::PANEL * sizeof(float) == 2 * gguf_kernel::AMX_GROUP * sizeof(uint16_t),
              "one panel buffer serves both prompt GEMMs: bf16_panel_halves(K) bf16 are panel_floats(K) floats");
int gguf_gemm(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, int fmt, const float *bias, float *y,
              int threads) {
    const bool bf16 = fmt == 6 || fmt == 7;
    if (K % gguf_kernel::QK != 0 || (fmt != 0 && fmt != 1 && !bf16) || (bf16 && !gguf_kernel::bf16_tiles_ok()))
        return -1;
    // x's rows as bf16, converted once by all threads (shared)
    uint16_t *xb = bf16 ? (uint16_t *)aligned_alloc(64, (size_t)(M * K + 31) / 32 * 64) : nullptr;
    if (bf16 && !xb) return -2;
    int failed = 0;
    #pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        if (bf16) {
            const int64_t r0 = M * t / nt, r1 = M * (t + 1) / nt;
            gguf_kernel::bf16_rows(x + r0 * K, r1 - r0, K, xb + r0 * K);
            #pragma omp barrier
        }
        // each thread's panel: fp32 panel_floats(K), or bf16_panel_halves(K) bf16 (the same bytes)
        float *P = (float *)aligned_alloc(64, sizeof(float) * (size_t)gguf_kernel::panel_floats(K));
        if (!P) {
            #pragma omp atomic write
            failed = 1;
        } else if (bf16) {
            gguf_kernel::bf16_gemm_range(xb, M, K, w, N, fmt & 1, bias, y, N * t / nt, N * (t + 1) / nt,
                                         (uint16_t *)P);
        } else {
            gguf_kernel::gemm_range(x, M, K, w, N, fmt, bias, y, N * t / nt, N * (t + 1) / nt, P);
        }
        free(P);
    }
    free(xb);
    return failed ? -2 : 0;
}
}
