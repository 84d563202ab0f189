// Int8 activations for `gguf_kernel.cpp` (which includes this file after its block formats `Q41`, `Q80`, `QK` and
// `hsum`; built only through it): each row of x quantised per 32-value block, the blocks multiplied in integers.
// The arithmetic is stated in that file's header; every output takes the same operations whatever its tile.

namespace gguf_kernel {

// An fp16 at p in all 8 lanes.
inline __m256 broadcast_half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _mm256_cvtph_ps(_mm_set1_epi16((short)h));
}

// Int8 activations: q [M, K] int8, d [M, nblk] and s [M, sblk] fp32 (the scales and the blocks' d_x * sum(q_x); s's rows
// are padded with zeros to whole 8-block chunks), carved from `scratch` (xsum_floats(M, K) floats).
struct XQ8 {
    int8_t *q;
    float *d, *s;
    int64_t nblk, sblk;
    XQ8 rows_from(int64_t m, int64_t K) const { return XQ8{q + m * K, d + m * nblk, s + m * sblk, nblk, sblk}; }
};

constexpr int64_t MAX_BLOCKS_I8 = 1024;  // the widest input int8 activations take (K <= 32768): a weight row's m's

inline XQ8 xq8_view(float *scratch, int64_t M, int64_t K) {
    const int64_t nblk = K / QK, sblk = (nblk + 7) / 8 * 8;
    return XQ8{(int8_t *)(scratch + M * (nblk + sblk)), scratch, scratch + M * nblk, nblk, sblk};
}

// Row r of x -> its q, d and s (the header's quantisation).
inline void quantize_row(const float *x, XQ8 xq, int64_t r) {
    const int64_t K = xq.nblk * QK;
    for (int64_t b = 0; b < xq.nblk; b++) {
        const float *xb = x + r * K + b * QK;
        const __m256 v0 = _mm256_loadu_ps(xb), v1 = _mm256_loadu_ps(xb + 8), v2 = _mm256_loadu_ps(xb + 16),
                     v3 = _mm256_loadu_ps(xb + 24);
        const __m256 sign = _mm256_set1_ps(-0.0f);
        const __m256 a = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                                       _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        xq.d[r * xq.nblk + b] = amax / 127.0f;
        const __m256 id = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        const __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, id)), q1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, id)),
                      q2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, id)), q3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, id));
        // packs work within 128-bit halves: the permute puts the 32 bytes back in index order
        const __m256i q = _mm256_packs_epi16(_mm256_packs_epi32(q0, q1), _mm256_packs_epi32(q2, q3));
        _mm256_storeu_si256((__m256i *)(xq.q + r * K + b * QK),
                            _mm256_permutevar8x32_epi32(q, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        // s = d_x * sum(q_x), llama.cpp's Q8_1 sum: Q4_1's offset then multiplies the same quantised x as its
        // nibbles do, so the error is sum_i (d u_i + m) e_i over the centred weights. The exact fp32 sum of x left
        // sum_i d u_i e_i over the uncentred nibbles: twice the error a layer, +1.26% perplexity against llama.cpp's
        // +0.28% on SmolLM2 Q4_1 (`bench_perplexity`, argparse.py, 32 chunks).
        const __m256i qs = _mm256_add_epi32(_mm256_add_epi32(q0, q1), _mm256_add_epi32(q2, q3));
        __m128i h = _mm_add_epi32(_mm256_castsi256_si128(qs), _mm256_extracti128_si256(qs, 1));
        h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
        h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1));
        xq.s[r * xq.sblk + b] = xq.d[r * xq.nblk + b] * (float)_mm_cvtsi128_si32(h);
    }
    for (int64_t b = xq.nblk; b < xq.sblk; b++) xq.s[r * xq.sblk + b] = 0.0f;
}

// Every row of x [M, K] quantised into scratch (xsum_floats(M, K) floats): the int8 ranges' input.
inline XQ8 quantize_rows(const float *x, float *scratch, int64_t M, int64_t K) {
    const XQ8 xq = xq8_view(scratch, M, K);
    for (int64_t r = 0; r < M; r++) quantize_row(x, xq, r);
    return xq;
}

// Q4_1 x int8: the block's 32 weights as unsigned bytes (0..15) in index order, d and m.
struct Q41i8 {
    static constexpr int bytes = 20;
    static constexpr bool has_min = true;
    static inline __m256i load(const uint8_t *blk, __m256 &d) {
        d = broadcast_half(blk);
        const __m128i mask = _mm_set1_epi8(0x0F);
        const __m128i qs = _mm_loadu_si128((const __m128i *)(blk + 4));
        return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), mask), _mm_and_si128(qs, mask));
    }
    static inline __m256i prepare(__m256i w) { return w; }
    static inline __m256i dot(__m256i w, __m256i, __m256i x) {  // 8 lanes of 4 products each
        return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
    }
};

// Q8_0 x int8: |w| as unsigned bytes, the sign moved onto x (vpmaddubsw multiplies unsigned by signed).
struct Q80i8 {
    static constexpr int bytes = 34;
    static constexpr bool has_min = false;
    static inline __m256i load(const uint8_t *blk, __m256 &d) {
        d = broadcast_half(blk);
        return _mm256_loadu_si256((const __m256i *)(blk + 2));
    }
    static inline __m256i prepare(__m256i w) { return _mm256_abs_epi8(w); }
    static inline __m256i dot(__m256i aw, __m256i w, __m256i x) {
        return _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(x, w)), _mm256_set1_epi16(1));
    }
};

// The m term of one output: sum_b m_b s_b over 8-block chunks (lane j takes blocks j, j + 8, ...), then hsum; mw:
// the weight row's m's as fp16 bits, zero-padded to whole chunks.
inline float min_term(const uint16_t *mw, const float *s, int64_t sblk) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t c = 0; c < sblk; c += 8)
        acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mw + c))), _mm256_loadu_ps(s + c), acc);
    return hsum(acc);
}

// A Q4_1 weight row's m's (fp16 bits) into mw, zero-padded to whole 8-block chunks (after the block loop: the row
// is in L1 then, and a store in that loop kept the accumulators in memory).
template <class F>
inline void gather_mins(const uint8_t *wrow, uint16_t *mw, XQ8 xq) {
    for (int64_t b = 0; b < xq.nblk; b++) memcpy(mw + b, wrow + b * F::bytes + 2, 2);
    for (int64_t b = xq.nblk; b < xq.sblk; b++) mw[b] = 0;
}

// Block b's products of rows [0, MT) with NW weight rows (their bytes wv, as F::prepare left them pw, their d's dv)
// into acc: the header's int8 arithmetic for each output, the same whatever the tile and the weights' layout.
template <class F, int MT, int NW>
__attribute__((always_inline)) inline void block_products(__m256 (&acc)[MT][NW], const __m256i (&pw)[NW],
                                                          const __m256i (&wv)[NW], const __m256 (&dv)[NW], XQ8 xq,
                                                          int64_t K, int64_t b) {
    for (int i = 0; i < MT; i++) {
        const __m256i x = _mm256_loadu_si256((const __m256i *)(xq.q + i * K + b * QK));
        const __m256 dx = _mm256_broadcast_ss(xq.d + i * xq.nblk + b);
        for (int j = 0; j < NW; j++) {
            const __m256 px = _mm256_mul_ps(_mm256_cvtepi32_ps(F::dot(pw[j], wv[j], x)), dx);
            acc[i][j] = _mm256_fmadd_ps(dv[j], px, acc[i][j]);
        }
    }
}

// y[i, n + j] for the tile's outputs: (sum + the m term) + bias, the m term over mins(j) (weight row n + j's m's
// as fp16 bits, zero-padded to whole 8-block chunks).
template <bool HAS_MIN, int MT, int NW, class Mins>
inline void store_outputs(const float (&sums)[MT][NW], XQ8 xq, Mins mins, float *y, int64_t N, int64_t n,
                          const float *bias) {
    for (int j = 0; j < NW; j++) {
        const uint16_t *mw = HAS_MIN ? mins(j) : nullptr;
        for (int i = 0; i < MT; i++) {
            const float mt = HAS_MIN ? min_term(mw, xq.s + i * xq.sblk, xq.sblk) : 0.0f;
            y[i * N + n + j] = (sums[i][j] + mt) + (bias ? bias[n + j] : 0.f);
        }
    }
}

// Int8 rows [0, MT) times weight rows [n, n + NW) (row stride row_bytes): the header's int8 arithmetic for each of
// the MT x NW outputs, the same operations whatever the tile (MT x NW accumulator chains: a lone chain is
// latency-bound, so few rows take several weight rows at once).
template <class F, int MT, int NW>
inline void tile_i8(XQ8 xq, int64_t K, const uint8_t *w, int64_t row_bytes, float *y, int64_t N, int64_t n,
                    const float *bias) {
    __m256 acc[MT][NW];
    for (int i = 0; i < MT; i++)
        for (int j = 0; j < NW; j++) acc[i][j] = _mm256_setzero_ps();
    for (int64_t b = 0; b < xq.nblk; b++) {
        __m256 dv[NW];
        __m256i wv[NW], pw[NW];
        for (int j = 0; j < NW; j++) {
            wv[j] = F::load(w + (n + j) * row_bytes + b * F::bytes, dv[j]);
            pw[j] = F::prepare(wv[j]);
        }
        block_products<F, MT, NW>(acc, pw, wv, dv, xq, K, b);
    }
    // acc read in loops GCC unrolls: one it did not (min_term's, or 8 hsums) kept acc in memory, a store per
    // accumulator and block in the block loop
    float sums[MT][NW];
    #pragma GCC unroll 8
    for (int i = 0; i < MT; i++)
        #pragma GCC unroll 4
        for (int j = 0; j < NW; j++) sums[i][j] = hsum(acc[i][j]);
    uint16_t mw[MAX_BLOCKS_I8];
    store_outputs<F::has_min, MT, NW>(sums, xq, [&](int j) {
        gather_mins<F>(w + (n + j) * row_bytes, mw, xq);
        return (const uint16_t *)mw;
    }, y, N, n, bias);
}

// Q4_1 for int8 lanes, repacked once at load (`gguf_lanes_pack`, fmt 10): the same nibbles, d's and m's, laid
// out for the lanes. A row: its blocks in pairs, 32 bytes a pair (byte k: block 2p's weight k in the low nibble,
// block 2p + 1's in the high one; an odd last block pairs with zeros), then its d's and its m's as fp16, each
// zero-padded to whole 8-block chunks. A pair's 32 weights a block come from one aligned load and a shift, where
// the GGUF block's 16 bytes take two shifts, two masks and a lane insert, and the m's are read where they lie
// instead of gathered. SmolLM2's Q4_1 stack on an AVX2 EPYC, one thread, weights past the cache
// (`bench_gguf_kernel --activations int8,int8-packed`): 1.35x at one row, 1.14x at five; a batch-1 decode step's
// C++ layers (two threads) 6.7 -> 4.3 ms. Each output takes the same integer sums and float operations: the
// same bits.
inline int64_t lanes_pairs(int64_t nblk) { return (nblk + 1) / 2; }
inline int64_t lanes_row_bytes(int64_t K) {
    const int64_t nblk = K / QK, sblk = (nblk + 7) / 8 * 8;
    return lanes_pairs(nblk) * 32 + sblk * 4;
}
constexpr int64_t LANES_PREFETCH = 4096;  // bytes ahead a software prefetch asks for at 1-2 rows: 1.2-1.3x there

inline void lanes_pack(const uint8_t *blocks, int64_t N, int64_t K, uint8_t *out) {
    const int64_t nblk = K / QK, sblk = (nblk + 7) / 8 * 8, rb = lanes_row_bytes(K);
    memset(out, 0, (size_t)(N * rb));
    for (int64_t n = 0; n < N; n++) {
        uint8_t *o = out + n * rb;
        uint8_t *d = o + lanes_pairs(nblk) * 32, *m = d + sblk * 2;
        for (int64_t b = 0; b < nblk; b++) {
            const uint8_t *blk = blocks + (n * nblk + b) * Q41i8::bytes;
            memcpy(d + b * 2, blk, 2);
            memcpy(m + b * 2, blk + 2, 2);
            for (int k = 0; k < QK; k++) {  // weight k: low nibbles hold 0-15, high ones 16-31
                const uint8_t q = k < 16 ? (blk[4 + k] & 0x0F) : (blk[4 + k - 16] >> 4);
                o[b / 2 * 32 + k] |= (uint8_t)(b & 1 ? q << 4 : q);
            }
        }
    }
}

// tile_i8 for Q4_1 over lanes_pack's rows (stride rb).
template <int MT, int NW>
inline void tile_i8_lanes(XQ8 xq, int64_t K, const uint8_t *w, int64_t rb, float *y, int64_t N, int64_t n,
                          const float *bias) {
    const int64_t nblk = xq.nblk, dm = lanes_pairs(nblk) * 32;
    const __m256i mask = _mm256_set1_epi8(0x0F);
    __m256 acc[MT][NW];
    for (int i = 0; i < MT; i++)
        for (int j = 0; j < NW; j++) acc[i][j] = _mm256_setzero_ps();
    auto block = [&](const __m256i (&wv)[NW], int64_t b) {  // (Q4_1's prepared bytes are its bytes)
        __m256 dv[NW];
        for (int j = 0; j < NW; j++) dv[j] = broadcast_half(w + (n + j) * rb + dm + b * 2);
        block_products<Q41i8, MT, NW>(acc, wv, wv, dv, xq, K, b);
    };
    __m256i lo[NW], hi[NW];
    auto load_pair = [&](int64_t b) {
        for (int j = 0; j < NW; j++) {
            const uint8_t *pair = w + (n + j) * rb + b * 16;
            if (MT <= 2) _mm_prefetch((const char *)pair + LANES_PREFETCH, _MM_HINT_T0);
            const __m256i v = _mm256_load_si256((const __m256i *)pair);
            lo[j] = _mm256_and_si256(v, mask);
            hi[j] = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
        }
    };
    int64_t b = 0;
    for (; b + 1 < nblk; b += 2) {
        load_pair(b);
        block(lo, b);
        block(hi, b + 1);
    }
    if (b < nblk) {  // an odd last block
        load_pair(b);
        block(lo, b);
    }
    float sums[MT][NW];
    #pragma GCC unroll 8
    for (int i = 0; i < MT; i++)
        #pragma GCC unroll 4
        for (int j = 0; j < NW; j++) sums[i][j] = hsum(acc[i][j]);
    const int64_t sblk = xq.sblk;
    store_outputs<true, MT, NW>(sums, xq, [&](int j) {
        return (const uint16_t *)(w + (n + j) * rb + dm + sblk * 2);
    }, y, N, n, bias);
}

// A tile of fmt F's blocks (row stride row_bytes), or with LANES of lanes_pack's rows (Q4_1).
template <class F, int MT, int NW, bool LANES>
inline void tile_any(XQ8 xq, int64_t K, const uint8_t *w, int64_t row_bytes, float *y, int64_t N, int64_t n,
                     const float *bias) {
    if constexpr (LANES) tile_i8_lanes<MT, NW>(xq, K, w, row_bytes, y, N, n, bias);
    else tile_i8<F, MT, NW>(xq, K, w, row_bytes, y, N, n, bias);
}

// Int8 rows [0, M) times weight rows [n, n + NW) in near-equal tiles of at most MAX_TILE_I8 rows (an int8 row
// holds one accumulator a weight row and reads one vector a block: 8 fit the registers).
constexpr int64_t MAX_TILE_I8 = 8;
template <class F, int NW, bool LANES>
inline void rows_times_weights_i8(XQ8 xq, int64_t M, int64_t K, const uint8_t *w, int64_t row_bytes, float *y,
                                  int64_t N, int64_t n, const float *bias) {
    int64_t m = 0;
    for (int64_t tiles = (M + MAX_TILE_I8 - 1) / MAX_TILE_I8; tiles > 0; tiles--) {
        const int64_t mt = (M - m + tiles - 1) / tiles;
        const XQ8 xm = xq.rows_from(m, K);
        float *ym = y + m * N;
        switch (mt) {
            case 8: tile_any<F, 8, NW, LANES>(xm, K, w, row_bytes, ym, N, n, bias); break;
            case 7: tile_any<F, 7, NW, LANES>(xm, K, w, row_bytes, ym, N, n, bias); break;
            case 6: tile_any<F, 6, NW, LANES>(xm, K, w, row_bytes, ym, N, n, bias); break;
            case 5: tile_any<F, 5, NW, LANES>(xm, K, w, row_bytes, ym, N, n, bias); break;
            case 4: tile_any<F, 4, NW, LANES>(xm, K, w, row_bytes, ym, N, n, bias); break;
            case 3: tile_any<F, 3, NW, LANES>(xm, K, w, row_bytes, ym, N, n, bias); break;
            case 2: tile_any<F, 2, NW, LANES>(xm, K, w, row_bytes, ym, N, n, bias); break;
            default: tile_any<F, 1, NW, LANES>(xm, K, w, row_bytes, ym, N, n, bias); break;
        }
        m += mt;
    }
}

// rows_a_block's count for int8 rows (4x smaller than fp32 ones)
inline int64_t rows_a_block_i8(int64_t K) {
    const int64_t fit = ROW_BLOCK_BYTES / K / MAX_TILE_I8 * MAX_TILE_I8;
    return fit > MAX_TILE_I8 ? fit : MAX_TILE_I8;
}

// Int8 activations: weight rows [n0, n1) on the calling thread, x's M rows quantised already (xq).
// LANES: w is lanes_pack's copy (F Q4_1).
template <class F, bool LANES = false>
void run_range_i8_xq(XQ8 xq, int64_t M, int64_t K, const uint8_t *w, int64_t N, const float *bias, float *y,
                     int64_t n0, int64_t n1) {
    static_assert(!LANES || F::has_min, "lanes_pack holds Q4_1");
    const int64_t row_bytes = LANES ? lanes_row_bytes(K) : K / QK * F::bytes, rb = rows_a_block_i8(K);
    for (int64_t m0 = 0; m0 < M; m0 += rb) {
        const int64_t m1 = m0 + rb < M ? m0 + rb : M, rows = m1 - m0;
        const XQ8 xm = xq.rows_from(m0, K);
        float *ym = y + m0 * N;
        int64_t n = n0;
        // Q4_1 at few rows: several weight rows at once (on the Q8_0 lm_head four at one row ran 1.4x slower, as
        // with fp32 activations: its rows' streams lost bandwidth)
        if (F::has_min && rows == 1)
            for (; n + 4 <= n1; n += 4) rows_times_weights_i8<F, 4, LANES>(xm, rows, K, w, row_bytes, ym, N, n, bias);
        else if (F::has_min && rows <= 4)
            for (; n + 2 <= n1; n += 2) rows_times_weights_i8<F, 2, LANES>(xm, rows, K, w, row_bytes, ym, N, n, bias);
        for (; n < n1; n++) rows_times_weights_i8<F, 1, LANES>(xm, rows, K, w, row_bytes, ym, N, n, bias);
    }
}

// run_range_i8_xq with every row of x quantised first (into scratch).
template <class F, bool LANES = false>
void run_range_i8(const float *x, float *scratch, int64_t M, int64_t K, const uint8_t *w, int64_t N,
                  const float *bias, float *y, int64_t n0, int64_t n1) {
    run_range_i8_xq<F, LANES>(quantize_rows(x, scratch, M, K), M, K, w, N, bias, y, n0, n1);
}
}  // namespace gguf_kernel
