// fp32 activations two weight rows at a time in AVX-512 for `gguf_kernel.cpp` (which includes this file after its
// AVX2 tiles; built only through it, compiled for AVX-512 by the target pragma below and called only where the
// CPU has it: `avx512_ok`).
//
// The same arithmetic, to the bit: a 512-bit register holds two outputs' 8-lane accumulators side by side (lanes
// 0-7 weight row n, lanes 8-15 weight row n + 1), every lane takes the header's operations in its order (the x
// chunk and its block sum broadcast to both halves, each half's d and m its row's), and each half is summed by
// hsum. So an output's bits are the AVX2 kernel's whatever path, tile or host computed it, and a weight row pair
// costs one 512-bit FMA where the AVX2 kernel spends two 256-bit ones.

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")

namespace gguf_kernel {

// Two weight rows' blocks (at a and b): q[c] lanes 0-7 a's chunk c, lanes 8-15 b's; d, m likewise.
template <class F> struct Pair;

template <> struct Pair<Q41> {
    static inline void load(const uint8_t *a, const uint8_t *b, __m512 q[4], __m512 &d, __m512 &m) {
        uint32_t da, db;
        memcpy(&da, a, 4);
        memcpy(&db, b, 4);
        const __m128 dm = _mm_cvtph_ps(_mm_setr_epi32((int)da, (int)db, 0, 0));  // d_a, m_a, d_b, m_b
        const __m512 dm5 = _mm512_castps128_ps512(dm);
        d = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2), dm5);
        m = _mm512_permutexvar_ps(_mm512_setr_epi32(1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3), dm5);
        const __m128i lo = _mm_castpd_si128(
            _mm_loadh_pd(_mm_castsi128_pd(_mm_loadl_epi64((const __m128i *)(a + 4))), (const double *)(b + 4)));
        const __m128i hi = _mm_castpd_si128(
            _mm_loadh_pd(_mm_castsi128_pd(_mm_loadl_epi64((const __m128i *)(a + 12))), (const double *)(b + 12)));
        const __m512i b0 = _mm512_cvtepu8_epi32(lo), b1 = _mm512_cvtepu8_epi32(hi);
        const __m512i mask = _mm512_set1_epi32(0x0F);
        q[0] = _mm512_cvtepi32_ps(_mm512_and_si512(b0, mask));  // weights 0-7 of each row
        q[1] = _mm512_cvtepi32_ps(_mm512_and_si512(b1, mask));  // 8-15
        q[2] = _mm512_cvtepi32_ps(_mm512_srli_epi32(b0, 4));    // 16-23
        q[3] = _mm512_cvtepi32_ps(_mm512_srli_epi32(b1, 4));    // 24-31
    }
};

template <> struct Pair<Q80> {
    static inline void load(const uint8_t *a, const uint8_t *b, __m512 q[4], __m512 &d, __m512 &m) {
        uint16_t ha, hb;
        memcpy(&ha, a, 2);
        memcpy(&hb, b, 2);
        const __m256 da = _mm256_set1_ps(_cvtsh_ss(ha)), db = _mm256_set1_ps(_cvtsh_ss(hb));
        d = _mm512_insertf32x8(_mm512_castps256_ps512(da), db, 1);
        m = _mm512_setzero_ps();
        for (int c = 0; c < 4; c++) {
            const __m128i v = _mm_castpd_si128(_mm_loadh_pd(
                _mm_castsi128_pd(_mm_loadl_epi64((const __m128i *)(a + 2 + 8 * c))), (const double *)(b + 2 + 8 * c)));
            q[c] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v));
        }
    }
};

inline __m512 both_halves(const float *p) { return _mm512_broadcast_f32x8(_mm256_loadu_ps(p)); }

// Rows [0, MT) of x times weight rows n and n + 1 (at wa, wb): rows_times_weight_row's operations per output.
template <class F, int MT>
inline void rows_times_weight_pair(const float *x, const float *xsum, int64_t K, const uint8_t *wa,
                                   const uint8_t *wb, float *y, int64_t N, int64_t n, const float *bias) {
    const int64_t nblk = K / QK;
    __m512 acc[MT];
    for (int i = 0; i < MT; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nblk; b++) {
        __m512 q[4], d, m;
        Pair<F>::load(wa + b * F::bytes, wb + b * F::bytes, q, d, m);
        for (int i = 0; i < MT; i++) {
            const float *xb = x + i * K + b * QK;
            __m512 s = _mm512_mul_ps(q[0], both_halves(xb));
            s = _mm512_fmadd_ps(q[1], both_halves(xb + 8), s);
            s = _mm512_fmadd_ps(q[2], both_halves(xb + 16), s);
            s = _mm512_fmadd_ps(q[3], both_halves(xb + 24), s);
            acc[i] = _mm512_fmadd_ps(d, s, acc[i]);
            if (F::has_min) acc[i] = _mm512_fmadd_ps(m, both_halves(xsum + (i * nblk + b) * 8), acc[i]);
        }
    }
    for (int i = 0; i < MT; i++) {
        y[i * N + n] = hsum(_mm512_castps512_ps256(acc[i])) + (bias ? bias[n] : 0.f);
        y[i * N + n + 1] = hsum(_mm512_extractf32x8_ps(acc[i], 1)) + (bias ? bias[n + 1] : 0.f);
    }
}

// One row of x times weight rows [n, n + 2 NP) as NP pairs (NP accumulator chains, as row_times_weight_rows).
template <class F, int NP>
inline void row_times_weight_pairs(const float *x, const float *xsum, int64_t K, const uint8_t *w, int64_t row_bytes,
                                   float *y, int64_t n, const float *bias) {
    const int64_t nblk = K / QK;
    __m512 acc[NP];
    for (int j = 0; j < NP; j++) acc[j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nblk; b++) {
        const float *xb = x + b * QK;
        const __m512 x0 = both_halves(xb), x1 = both_halves(xb + 8), x2 = both_halves(xb + 16),
                     x3 = both_halves(xb + 24);
        for (int j = 0; j < NP; j++) {
            __m512 q[4], d, m;
            const uint8_t *wa = w + (n + 2 * j) * row_bytes + b * F::bytes;
            Pair<F>::load(wa, wa + row_bytes, q, d, m);
            __m512 s = _mm512_mul_ps(q[0], x0);
            s = _mm512_fmadd_ps(q[1], x1, s);
            s = _mm512_fmadd_ps(q[2], x2, s);
            s = _mm512_fmadd_ps(q[3], x3, s);
            acc[j] = _mm512_fmadd_ps(d, s, acc[j]);
            if (F::has_min) acc[j] = _mm512_fmadd_ps(m, both_halves(xsum + b * 8), acc[j]);
        }
    }
    for (int j = 0; j < NP; j++) {
        y[n + 2 * j] = hsum(_mm512_castps512_ps256(acc[j])) + (bias ? bias[n + 2 * j] : 0.f);
        y[n + 2 * j + 1] = hsum(_mm512_extractf32x8_ps(acc[j], 1)) + (bias ? bias[n + 2 * j + 1] : 0.f);
    }
}

// Rows a tile of the pair kernel, more than the AVX2 form's MAX_TILE (its 16 registers hold 6 accumulators; here
// 32). Each tile converts the weight rows' blocks again, which costs most of a one-row pass (compute-bound on the
// conversion): over SmolLM2's stack, one thread, alternating, 7 / 8 / 12 / 16 rows took 24.4 / 26.3 / 33.9 / 45.5
// ms a pass in tiles of 6 and 21.2 / 23.7 / 34.6 / 43.6 in tiles of 8 (one tile of 12 measured slower than two
// of 6). A row's operations are the same in any tile.
constexpr int64_t MAX_TILE512 = 8;

// rows_times_weight for weight rows n and n + 1 in near-equal tiles of at most MAX_TILE512 rows.
template <class F>
inline void rows_times_weight_pair_tiled(const float *x, const float *xsum, int64_t m0, int64_t m1, int64_t K,
                                         const uint8_t *wa, const uint8_t *wb, float *y, int64_t N, int64_t n,
                                         const float *bias) {
    const int64_t nblk = K / QK;
    int64_t m = m0;
    for (int64_t tiles = (m1 - m0 + MAX_TILE512 - 1) / MAX_TILE512; tiles > 0; tiles--) {
        const int64_t mt = (m1 - m + tiles - 1) / tiles;
        const float *xm = x + m * K, *sm = xsum + m * nblk * 8;
        float *ym = y + m * N;
        switch (mt) {
            case 8: rows_times_weight_pair<F, 8>(xm, sm, K, wa, wb, ym, N, n, bias); break;
            case 7: rows_times_weight_pair<F, 7>(xm, sm, K, wa, wb, ym, N, n, bias); break;
            case 6: rows_times_weight_pair<F, 6>(xm, sm, K, wa, wb, ym, N, n, bias); break;
            case 5: rows_times_weight_pair<F, 5>(xm, sm, K, wa, wb, ym, N, n, bias); break;
            case 4: rows_times_weight_pair<F, 4>(xm, sm, K, wa, wb, ym, N, n, bias); break;
            case 3: rows_times_weight_pair<F, 3>(xm, sm, K, wa, wb, ym, N, n, bias); break;
            case 2: rows_times_weight_pair<F, 2>(xm, sm, K, wa, wb, ym, N, n, bias); break;
            default: rows_times_weight_pair<F, 1>(xm, sm, K, wa, wb, ym, N, n, bias); break;
        }
        m += mt;
    }
}

// Pairs of weight rows a lone row of x takes at once (Q4_1): 2, 3 and 4 measured 1.11x / 1.05x / 1.11x the AVX2
// form's four weight rows on SmolLM2's Q4_1 shapes (one thread, this file's A/B of both forms in one build).
constexpr int LONE_PAIRS = 2;
// range_body's AVX-512 form: weight rows in pairs (a lone last one in AVX2), the same bits.
template <class F>
void range_body_avx512(const float *x, const float *xsum, int64_t M, int64_t K, const uint8_t *w, int64_t N,
                       const float *bias, float *y, int64_t n0, int64_t n1) {
    const int64_t nblk = K / QK, row_bytes = nblk * F::bytes, rb = rows_a_block(K);
    for (int64_t m0 = 0; m0 < M; m0 += rb) {
        const int64_t m1 = m0 + rb < M ? m0 + rb : M;
        int64_t n = n0;
        if (F::has_min && m1 - m0 == 1)  // Q4_1, a lone row: NP pairs of weight rows at once
            for (; n + 2 * LONE_PAIRS <= n1; n += 2 * LONE_PAIRS)
                row_times_weight_pairs<F, LONE_PAIRS>(x + m0 * K, xsum + m0 * nblk * 8, K, w, row_bytes, y + m0 * N, n,
                                                      bias);
        if (!F::has_min && m1 - m0 == 1) {  // Q8_0, a lone row: one weight row at a time (two streams ran 0.89x)
            for (; n < n1; n++) rows_times_weight<F>(x, xsum, m0, m1, K, w + n * row_bytes, y, N, n, bias);
            continue;
        }
        for (; n + 2 <= n1; n += 2)
            rows_times_weight_pair_tiled<F>(x, xsum, m0, m1, K, w + n * row_bytes, w + (n + 1) * row_bytes, y, N, n,
                                            bias);
        for (; n < n1; n++) rows_times_weight<F>(x, xsum, m0, m1, K, w + n * row_bytes, y, N, n, bias);
    }
}

}  // namespace gguf_kernel

#pragma GCC pop_options

namespace gguf_kernel {
inline bool avx512_cpu() {
    static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    return ok;
}
inline int avx512_off = 0;  // gguf_use_avx512(0): the AVX2 forms on an AVX-512 CPU too (tests compare the two)
// Whether the AVX-512 forms run: the CPU has them and they are not turned off.
inline bool avx512_ok() { return !avx512_off && avx512_cpu(); }
}  // namespace gguf_kernel
