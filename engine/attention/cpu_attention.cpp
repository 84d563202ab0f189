// Paged attention for steps of few query positions (decode, verify, draft, refill) on x86 AVX2 + FMA, fp32:
// one call a layer where the torch path runs a dozen small ops, and batch-invariant by construction.
//
// Every query row (lane b, position i, head h) is computed on its own, in the same order whatever shares its
// step, so its bits never depend on the other rows, lanes, the page table's width or the threads:
//     s_j = (q . k_j) * scale    for the keys j the row sees (j < kv_len[b] and j <= q_pos[b, i]), in key order;
//                                the dot product over D in 8-float chunks into one accumulator, then a fixed
//                                horizontal sum
//     m = max_j s_j;  p_j = exp(s_j - m) (a fixed polynomial, below);  l = sum_j p_j  (sequential, key order)
//     o = (sum_j p_j v_j) / l    (sequential in key order, lane-wise over D)
// A row marked invalid (padding) is skipped (the caller's output starts as zeros). Threads split (lane, KV head) items; an item's query heads share
// each key's load.

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

namespace cpu_attention_kernel {

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// exp(x) for x <= 0 (softmax arguments): x = n ln2 + r, |r| <= ln2 / 2, e^r by a degree-6 polynomial (relative
// error ~2e-7), 2^n by exponent bits; below -87 it is 0. Pure arithmetic: the same bits on every call.
inline __m256 exp_nonpositive(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    const __m256 zero_mask = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(zero_mask, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

inline float dot(const float *a, const float *b, int64_t d) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t c = 0; c < d; c += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + c), _mm256_loadu_ps(b + c), acc);
    return hsum(acc);
}

// The attention of one item (lane b = it / Hkv, KV head it % Hkv): every valid query row of the lane and every
// query head of the KV head. slots: most_keys + 1 int64; scores: scores_floats(G, Q, most_keys), 32-byte aligned.
inline void attend_item(int64_t it, const float *q, float *out, const float *k_cache, const float *v_cache,
                        int64_t Q, int64_t H, int64_t Hkv, int64_t D, const int64_t *q_index, const uint8_t *q_valid,
                        const int64_t *q_pos, const int64_t *kv_len, const int64_t *page_table, int64_t P,
                        int64_t page_size, float scale, int64_t most_keys, int64_t *slots, float *scores) {
    const int64_t G = H / Hkv, b = it / Hkv, kvh = it % Hkv, keys = kv_len[b];
    for (int64_t j = 0; j < keys; j++) slots[j] = page_table[b * P + j / page_size] * page_size + j % page_size;
    for (int64_t i = 0; i < Q; i++) {
        // a padding row (it points at token 0, a real row of lane 0's) writes nothing
        if (!q_valid[b * Q + i]) continue;
        const int64_t t = q_index[b * Q + i];
        const int64_t seen = q_pos[b * Q + i] + 1 < keys ? q_pos[b * Q + i] + 1 : keys;
        for (int64_t g = 0; g < G; g++) {
            const int64_t h = kvh * G + g;
            const float *qr = q + (t * H + h) * D;
            float *s = scores + (i * G + g) * (most_keys + 8);
            float m = -INFINITY;
            for (int64_t j = 0; j < seen; j++) {
                s[j] = dot(qr, k_cache + (slots[j] * Hkv + kvh) * D, D) * scale;
                m = s[j] > m ? s[j] : m;
            }
            // p_j = exp(s_j - m) in 8-key vectors (a row's tail padded with -inf: exp gives 0)
            for (int64_t j = seen; j < (seen + 7) / 8 * 8; j++) s[j] = -INFINITY;
            const __m256 vm = _mm256_set1_ps(m);
            for (int64_t j = 0; j < seen; j += 8)
                _mm256_storeu_ps(s + j, exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + j), vm)));
            float l = 0.f;
            for (int64_t j = 0; j < seen; j++) l += s[j];
            __m256 acc[32];
            const int64_t dc = D / 8;
            for (int64_t c = 0; c < dc; c++) acc[c] = _mm256_setzero_ps();
            for (int64_t j = 0; j < seen; j++) {
                const __m256 p = _mm256_set1_ps(s[j]);
                const float *vr = v_cache + (slots[j] * Hkv + kvh) * D;
                for (int64_t c = 0; c < dc; c++) acc[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vr + 8 * c), acc[c]);
            }
            const __m256 inv = _mm256_set1_ps(1.0f / l);
            float *o = out + (t * H + h) * D;
            for (int64_t c = 0; c < dc; c++) _mm256_storeu_ps(o + 8 * c, _mm256_mul_ps(acc[c], inv));
        }
    }
}

inline int64_t longest(const int64_t *kv_len, int64_t B) {
    int64_t most = 0;
    for (int64_t b = 0; b < B; b++) most = kv_len[b] > most ? kv_len[b] : most;
    return most;
}

// Floats of an item's scores (every row and query head of it, each padded to whole 8-key vectors).
inline int64_t scores_floats(int64_t G, int64_t Q, int64_t most_keys) { return G * Q * (most_keys + 8); }

}  // namespace cpu_attention_kernel

extern "C" {
int cpu_attention_version(void) { return 1; }

// q [T, H, D] (flat tokens), out [T, H, D]; caches [slots, Hkv, D]; per lane b: q_index [B, Q] (flat token of
// each query row), q_valid [B, Q] (uint8), q_pos [B, Q], kv_len [B], page_table [B, P] (int64 all). D must be
// a multiple of 8. Returns 0, -1 for a bad shape, -2 if scratch cannot be allocated.
int cpu_attention(const float *q, float *out, const float *k_cache, const float *v_cache, int64_t B, int64_t Q,
                  int64_t H, int64_t Hkv, int64_t D, const int64_t *q_index, const uint8_t *q_valid,
                  const int64_t *q_pos, const int64_t *kv_len, const int64_t *page_table, int64_t P,
                  int64_t page_size, float scale, int threads) {
    if (D % 8 != 0 || H % Hkv != 0 || D > 256) return -1;
    namespace ak = cpu_attention_kernel;
    const int64_t G = H / Hkv, items = B * Hkv, most_keys = ak::longest(kv_len, B);
    if (most_keys > P * page_size) return -1;
    int failed = 0;
    #pragma omp parallel num_threads(threads)
    {
        // per thread: the keys' slots, and every row's scores of one item
        int64_t *slots = (int64_t *)malloc(sizeof(int64_t) * (most_keys + 1));
        float *scores = (float *)aligned_alloc(32, (sizeof(float) * ak::scores_floats(G, Q, most_keys) + 31) / 32 * 32);
        if (!slots || !scores) {
            #pragma omp atomic write
            failed = 1;
        } else {
            #pragma omp for schedule(static)
            for (int64_t it = 0; it < items; it++)
                ak::attend_item(it, q, out, k_cache, v_cache, Q, H, Hkv, D, q_index, q_valid, q_pos, kv_len,
                                page_table, P, page_size, scale, most_keys, slots, scores);
        }
        free(slots);
        free(scores);
    }
    return failed ? -2 : 0;
}
}
