// The AVX-512 form of `cpu_attention.cpp`'s item, for head sizes of 64 and 128; built only through it, compiled
// for AVX-512 by the target pragma below and called only where the CPU has it (`avx512_ok`).
//
// A row's arithmetic, the same whatever shares its step (so decode and verify rows stay bitwise equal), but not
// the AVX2 form's bits (a host runs one form, chosen by its flags):
//     s_j = (q . k_j) * scale    the dot product lane-wise over D in 16-float chunks (chunk order), then the 16
//                                lanes summed by a fixed tree: (i, i + 8), then (i, i + 4), (i, i + 2), (i, i + 1)
//     m = max_j s_j;  p_j = exp(s_j - m) (exp_nonpositive16: the AVX2 form's exp, lane for lane);
//     l = sum_j p_j              lane-wise over 16-key vectors in key order, then the same tree
//     o = (sum_j p_j v_j) / l    sequential in key order, lane-wise over D
// Why: the AVX2 form sums each key's dot product horizontally on its own and walks D in 8s; here 16 keys' sums
// share one transposing tree and D goes in 16s, about half the instructions a key, and an item's query rows share
// its K and V reads (`attend_rows16`). `python -m benchmarks.bench_attention` (AMX Xeon host, 2 threads, 30 layers,
// 150 keys, a ctypes call and thread wake-up a layer included): 1.01x / 1.05x at batch 1 (1 / 5 rows a lane),
// 1.07x / 1.20x at batch 8; in a batch-8 verify step the attention phase took 0.79x the time.

#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx512bw,avx512vl")

constexpr int KV16 = 16;  // keys a score vector holds
// score vectors ahead whose K and V rows the first pass over an item's keys asks for (it asks for the first one
// at the start; 2 and 4 ahead measured the same in a batch-8 step)
constexpr int64_t FETCH_AHEAD = 1;

// exp_nonpositive in 16 lanes: the AVX2 form's operations lane for lane (the same polynomial, rounding and
// exponent bits), so its bits. The MLP gate (`decode_layers.cpp`) takes it for its 16-lane form.
inline __m512 exp_nonpositive16(__m512 x) {
    const __m512 lo = _mm512_set1_ps(EXP_FLOOR);
    const __mmask16 zero = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_max_ps(x, lo);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), r);
    __m512 p = _mm512_set1_ps(EXP_POLY[0]);
    for (int i = 1; i < 6; i++) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_POLY[i]));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps((__mmask16)~zero, p, _mm512_castsi512_ps(e));
}

// a[j] (one key's 16 lane-wise partial sums each) -> lane j = key j's sum, every key by the same tree of lane
// pairs: (i, i + 8), (i, i + 4), (i, i + 2), (i, i + 1).
inline __m512 tree_sums16(const __m512 *a) {
    __m512 b[8], c[4], d[2];
    for (int i = 0; i < 8; i++)  // [a.q0 + a.q2, a.q1 + a.q3] of keys 2i and 2i + 1 (q: 128-bit quarters)
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)  // quarter k: key 4i + k's lanes (0..3) + (4..7)
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)  // quarter k: [key k, key k, key k + 4, key k + 4] (+ 8i), lanes (0, 2), (1, 3)
        d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0xEE));
    // quarter k, position p: key k + 4p, its lanes (0, 1)
    const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
    const __m512i key_at = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(key_at, e);
}

inline float tree_sum16(__m512 v) {  // tree_sums16's tree over one vector's lanes
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

// 16 cache values as fp32 (`load8`'s widening)
inline __m512 load16(const float *p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

// s[j0, j0 + 16) = (q . k_j) * scale for one query head and the n <= 16 keys from j0 it sees, -inf past them.
template <int DC, class KV>
inline void score_vector16(const float *qr, float *s, const KV *k_cache, const int64_t *slots, int64_t j0,
                           int64_t n, int64_t Hkv, int64_t kvh, __m512 vscale) {
    constexpr int64_t D = DC * 16;
    __m512 qv[DC];
    for (int c = 0; c < DC; c++) qv[c] = _mm512_loadu_ps(qr + 16 * c);
    __m512 acc[KV16];
    for (int j = 0; j < KV16; j++) {
        if (j >= n) {
            acc[j] = _mm512_setzero_ps();
            continue;
        }
        const KV *kr = k_cache + (slots[j0 + j] * Hkv + kvh) * D;
        __m512 a = _mm512_mul_ps(qv[0], load16(kr));
        for (int c = 1; c < DC; c++) a = _mm512_fmadd_ps(qv[c], load16(kr + 16 * c), a);
        acc[j] = a;
    }
    const __m512 sv = _mm512_mul_ps(tree_sums16(acc), vscale);
    _mm512_storeu_ps(s + j0, _mm512_mask_blend_ps((__mmask16)((1u << n) - 1), _mm512_set1_ps(-INFINITY), sv));
}

// p_j = exp(s_j - max) in place over whole vectors (the padding's -inf gives 0); returns l = sum_j p_j.
inline float softmax16(float *s, int64_t seen) {
    __m512 m = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < seen; j += KV16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + j));
    const __m512 vm = _mm512_set1_ps(_mm512_reduce_max_ps(m));  // a max: exact in any order
    __m512 l = _mm512_setzero_ps();
    for (int64_t j = 0; j < seen; j += KV16) {
        const __m512 p = exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(s + j), vm));
        _mm512_storeu_ps(s + j, p);
        l = _mm512_add_ps(l, p);
    }
    return tree_sum16(l);
}

// The item's query rows together, so that they share its K and V reads (a row's arithmetic is the header's, in
// the same order whatever rows share the call). Scores go key vector by key vector, every row and head reading
// that vector's 16 K rows from L1; values go VB keys at a time, every row and head group accumulating those keys'
// V rows into its output (kept there between blocks: the same FMAs in the same key order), in groups of heads
// whose accumulators fit the registers (5 heads of 64, 2 of 128), scaled by 1 / l at the end. Row by row, the
// item's K and V were streamed from L2 or further once a row: a batch-8 verify step's attention (5 rows an item)
// took 4.99 ms a thread, 3.94 ms this way.
constexpr int64_t VB = 64;  // keys a values block takes (64 V rows of 128 floats: 32 KB, within L1)

template <int DC, int GN, class KV>
inline void values_block16(const float *const *p, float *const *o, const KV *v_cache, const int64_t *slots,
                           int64_t j0, int64_t j1, int64_t Hkv, int64_t kvh) {
    constexpr int64_t D = DC * 16;
    __m512 acc[GN][DC];
    for (int g = 0; g < GN; g++)
        for (int c = 0; c < DC; c++) acc[g][c] = j0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(o[g] + 16 * c);
    for (int64_t j = j0; j < j1; j++) {
        const KV *vr = v_cache + (slots[j] * Hkv + kvh) * D;
        __m512 v[DC];
        for (int c = 0; c < DC; c++) v[c] = load16(vr + 16 * c);
        for (int g = 0; g < GN; g++) {
            const __m512 pj = _mm512_set1_ps(p[g][j]);
            for (int c = 0; c < DC; c++) acc[g][c] = _mm512_fmadd_ps(pj, v[c], acc[g][c]);
        }
    }
    for (int g = 0; g < GN; g++)
        for (int c = 0; c < DC; c++) _mm512_storeu_ps(o[g] + 16 * c, acc[g][c]);
}

// R rows: q_rows[r] / o_rows[r] a row's [H, D], s_rows[r] its G score rows (`stride` floats apart), seen[r] its
// keys; l: R * G floats. The rows' outputs must be distinct (each is accumulated in place between values blocks);
// a step's rows of one item are distinct tokens.
template <int DC, class KV>
inline void attend_rows16(int64_t R, const float *const *q_rows, float *const *o_rows, float *const *s_rows,
                          const int64_t *seen, int64_t stride, float *l, const KV *k_cache, const KV *v_cache,
                          const int64_t *slots, int64_t G, int64_t Hkv, int64_t kvh, float scale) {
    constexpr int64_t D = DC * 16, GV = DC == 4 ? 5 : 2;
    int64_t most = 0;
    for (int64_t r = 0; r < R; r++) most = seen[r] > most ? seen[r] : most;
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t j0 = 0; j0 < most; j0 += KV16) {
        // ask for the K and V rows of the vector FETCH_AHEAD ahead (of the first FETCH_AHEAD + 1 at the start)
        const int64_t ask_end = j0 + (FETCH_AHEAD + 1) * KV16 < most ? j0 + (FETCH_AHEAD + 1) * KV16 : most;
        for (int64_t j = j0 == 0 ? 0 : j0 + FETCH_AHEAD * KV16; j < ask_end; j++) {
            const int64_t at = (slots[j] * Hkv + kvh) * D;
            prefetch_row(k_cache + at, D);
            prefetch_row(v_cache + at, D);
        }
        for (int64_t r = 0; r < R; r++) {
            if (seen[r] <= j0) continue;
            const int64_t n = seen[r] - j0 < KV16 ? seen[r] - j0 : KV16;
            for (int64_t g = 0; g < G; g++)
                score_vector16<DC, KV>(q_rows[r] + (kvh * G + g) * D, s_rows[r] + g * stride, k_cache, slots, j0, n,
                                   Hkv, kvh, vscale);
        }
    }
    for (int64_t r = 0; r < R; r++)
        for (int64_t g = 0; g < G; g++) l[r * G + g] = softmax16(s_rows[r] + g * stride, seen[r]);
    for (int64_t j0 = 0; j0 < most; j0 += VB)
        for (int64_t r = 0; r < R; r++) {
            if (seen[r] <= j0) continue;
            const int64_t j1 = j0 + VB < seen[r] ? j0 + VB : seen[r];
            for (int64_t g0 = 0; g0 < G; g0 += GV) {
                const float *p[GV];
                float *o[GV];
                const int64_t gn = G - g0 < GV ? G - g0 : GV;
                for (int64_t g = 0; g < gn; g++)
                    p[g] = s_rows[r] + (g0 + g) * stride, o[g] = o_rows[r] + (kvh * G + g0 + g) * D;
                switch (gn) {  // GV is at most 5
                    case 5: values_block16<DC, 5, KV>(p, o, v_cache, slots, j0, j1, Hkv, kvh); break;
                    case 4: values_block16<DC, 4, KV>(p, o, v_cache, slots, j0, j1, Hkv, kvh); break;
                    case 3: values_block16<DC, 3, KV>(p, o, v_cache, slots, j0, j1, Hkv, kvh); break;
                    case 2: values_block16<DC, 2, KV>(p, o, v_cache, slots, j0, j1, Hkv, kvh); break;
                    default: values_block16<DC, 1, KV>(p, o, v_cache, slots, j0, j1, Hkv, kvh); break;
                }
            }
        }
    for (int64_t r = 0; r < R; r++)
        for (int64_t g = 0; g < G; g++) {  // o = acc * (1 / l)
            float *o = o_rows[r] + (kvh * G + g) * D;
            const __m512 inv = _mm512_set1_ps(1.0f / l[r * G + g]);
            for (int c = 0; c < DC; c++) _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(o + 16 * c), inv));
        }
}

#pragma GCC pop_options

inline bool avx512_cpu() {
    static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    return ok;
}
inline int avx512_off = 0;  // cpu_attention_use_avx512(0): the AVX2 form on an AVX-512 CPU too (tests, A/Bs)
// The AVX-512 form takes heads of 64 and 128 (at most 64 query heads a KV head) where the CPU has it.
constexpr int64_t MOST_HEADS16 = 64;  // query heads a KV head the AVX-512 form takes
inline bool avx512_ok(int64_t D, int64_t G) {
    return !avx512_off && (D == 64 || D == 128) && G <= MOST_HEADS16 && avx512_cpu();
}
