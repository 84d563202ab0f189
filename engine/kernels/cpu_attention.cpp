// Paged attention for steps of few query positions (decode, verify, draft, refill), and prompts of up to a few
// hundred (`cpu_attention.takes_prompt`), on x86 AVX2 + FMA, fp32: one call a layer where the torch path runs a
// dozen small ops, and batch-invariant by construction.
//
// Every query row (lane b, position i, head h) is computed on its own, in the same order whatever shares its
// step, so its bits never depend on the other rows, lanes, the page table's width or the threads:
//     s_j = (q . k_j) * scale    for the keys j the row sees (j < kv_len[b] and j <= q_pos[b, i]), in key order;
//                                the dot product over D in 8-float chunks into one accumulator, then a fixed
//                                horizontal sum
//     m = max_j s_j;  p_j = exp(s_j - m) (a fixed polynomial, below);  l = sum_j p_j  (sequential, key order)
//     o = (sum_j p_j v_j) / l    (sequential in key order, lane-wise over D)
// A row marked invalid (padding) is skipped (the caller's output starts as zeros). Threads split (lane, KV head,
// query row) units in shares of near-equal work (`unit_share`, `attend_units`); an item's query heads share each
// key's load (in the AVX-512 form its query rows too).
// That is the AVX2 form. Where the CPU has AVX-512, heads of 64 and 128 take `cpu_attention_avx512.cpp`'s form:
// its own fixed order (other bits than this form's), as independent of the rest of the step. A host runs one form.
//
// The caches hold fp32 or bf16 (`--kv-cache-dtype bfloat16`: half the bytes a key, which a long context's or a
// large batch's attention reads once a step). A bf16 value widens to fp32 exactly (its bits in the high half), so
// both caches run the same arithmetic on the values they hold.

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

namespace cpu_attention_kernel {
constexpr int64_t GB = 4;  // query heads of a row that share a key's loads
// Keys ahead whose K and V rows a key's iteration asks the cache for: a lane's keys sit one KV head's slice of a
// slot apart, in pages anywhere, where the hardware's prefetch does not follow. At SmolLM2's batch-1 step (~150
// keys, 3 KV heads) the attention phase (a thread's work and wait) went from 1.40 M to 0.93 M cycles a step, 5 rows
// from 3.2 M to 2.65 M (4 and 16 keys ahead measured no better).
constexpr int64_t KV_AHEAD = 8;

using bf16_t = uint16_t;  // a bfloat16's bits

// 8 cache values as fp32 (a bf16's bits are an fp32's high half: exact)
inline __m256 load8(const float *p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

// Ask the cache for one key's row of D values (every 64 bytes of it).
template <class KV>
inline void prefetch_row(const KV *row, int64_t D) {
    for (int64_t b = 0; b < D * (int64_t)sizeof(KV); b += 64) _mm_prefetch((const char *)row + b, _MM_HINT_T0);
}

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// exp(x) for x <= 0 (softmax arguments): x = n ln2 + r, |r| <= ln2 / 2, e^r by a degree-6 polynomial (relative
// error ~2e-7), 2^n by exponent bits; below -87 it is 0. Pure arithmetic: the same bits on every call. Its constants,
// shared with the 16-lane form (`exp_nonpositive16`, the same operations lane for lane):
constexpr float EXP_FLOOR = -87.0f, EXP_LOG2E = 1.44269504088896341f;
constexpr float EXP_LN2_HI = 0.693359375f, EXP_LN2_LO = -2.12194440e-4f;  // ln 2 in two parts: r exact
constexpr float EXP_POLY[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};  // highest degree first
inline __m256 exp_nonpositive(__m256 x) {
    const __m256 lo = _mm256_set1_ps(EXP_FLOOR);
    const __m256 zero_mask = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), r);
    __m256 p = _mm256_set1_ps(EXP_POLY[0]);
    for (int i = 1; i < 6; i++) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_POLY[i]));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(zero_mask, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

inline float dot(const float *a, const float *b, int64_t d) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t c = 0; c < d; c += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + c), _mm256_loadu_ps(b + c), acc);
    return hsum(acc);
}

// One query row's heads [g0, g0 + GN) of KV head kvh over its `seen` keys (slots): scores into s[g], the output
// into o[g]. Every head's operations are the header's, in its order: interleaving independent heads, which share
// each key's loads, changes no head's bits.
template <int GN, class KV>
inline void attend_heads(const float *const *qr, float *const *s, float *const *o, const KV *k_cache,
                         const KV *v_cache, const int64_t *slots, int64_t seen, int64_t Hkv, int64_t kvh, int64_t D,
                         float scale) {
    for (int64_t j = 0; j < seen; j++) {
        const KV *kr = k_cache + (slots[j] * Hkv + kvh) * D;
        if (j + KV_AHEAD < seen) {
            const int64_t at = (slots[j + KV_AHEAD] * Hkv + kvh) * D;
            prefetch_row(k_cache + at, D);
            prefetch_row(v_cache + at, D);
        }
        __m256 acc[GN];
        for (int g = 0; g < GN; g++) acc[g] = _mm256_setzero_ps();
        for (int64_t c = 0; c < D; c += 8) {
            const __m256 kv = load8(kr + c);
            for (int g = 0; g < GN; g++) acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qr[g] + c), kv, acc[g]);
        }
        for (int g = 0; g < GN; g++) s[g][j] = hsum(acc[g]) * scale;
    }
    float m[GN], l[GN];
    for (int g = 0; g < GN; g++) m[g] = -INFINITY, l[g] = 0.f;
    for (int64_t j = 0; j < seen; j++)
        for (int g = 0; g < GN; g++) m[g] = s[g][j] > m[g] ? s[g][j] : m[g];
    for (int g = 0; g < GN; g++) {
        // p_j = exp(s_j - m) in 8-key vectors (a row's tail padded with -inf: exp gives 0)
        for (int64_t j = seen; j < (seen + 7) / 8 * 8; j++) s[g][j] = -INFINITY;
        const __m256 vm = _mm256_set1_ps(m[g]);
        for (int64_t j = 0; j < seen; j += 8)
            _mm256_storeu_ps(s[g] + j, exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s[g] + j), vm)));
    }
    for (int64_t j = 0; j < seen; j++)
        for (int g = 0; g < GN; g++) l[g] += s[g][j];
    // o = sum_j p_j v_j / l, 16 of D at a time (GN x 2 accumulators in registers)
    for (int64_t c0 = 0; c0 < D; c0 += 16) {
        const bool two = c0 + 8 < D;
        __m256 a0[GN], a1[GN];
        for (int g = 0; g < GN; g++) a0[g] = a1[g] = _mm256_setzero_ps();
        for (int64_t j = 0; j < seen; j++) {
            const KV *vr = v_cache + (slots[j] * Hkv + kvh) * D + c0;
            const __m256 v0 = load8(vr), v1 = two ? load8(vr + 8) : v0;
            for (int g = 0; g < GN; g++) {
                const __m256 p = _mm256_set1_ps(s[g][j]);
                a0[g] = _mm256_fmadd_ps(p, v0, a0[g]);
                a1[g] = _mm256_fmadd_ps(p, v1, a1[g]);
            }
        }
        for (int g = 0; g < GN; g++) {
            const __m256 inv = _mm256_set1_ps(1.0f / l[g]);
            _mm256_storeu_ps(o[g] + c0, _mm256_mul_ps(a0[g], inv));
            if (two) _mm256_storeu_ps(o[g] + c0 + 8, _mm256_mul_ps(a1[g], inv));
        }
    }
}

#include "cpu_attention_avx512.cpp"

constexpr int64_t SCORE_PAD = 16;  // a row of scores: most_keys + this (whole 8- and 16-key vectors; and in
                                   // cpu_attention.py, which bounds a prompt's scores)

// The attention of one item (lane b = it / Hkv, KV head it % Hkv): its valid query rows in [i0, i1) and every
// query head of the KV head. slots: most_keys + 1 int64; scores: scores_floats(G, Q, most_keys), 32-byte aligned.
template <class KV>
inline void attend_item(int64_t it, int64_t i0, int64_t i1, const float *q, float *out, const KV *k_cache,
                        const KV *v_cache, int64_t Q, int64_t H, int64_t Hkv, int64_t D, const int64_t *q_index,
                        const uint8_t *q_valid, const int64_t *q_pos, const int64_t *kv_len,
                        const int64_t *page_table, int64_t P, int64_t page_size, float scale, int64_t most_keys,
                        int64_t *slots, float *scores) {
    const int64_t G = H / Hkv, b = it / Hkv, kvh = it % Hkv, keys = kv_len[b];
    for (int64_t j = 0, p = 0; j < keys; p++)  // (pages in order: no division a key)
        for (int64_t r = 0, base = page_table[b * P + p] * page_size; r < page_size && j < keys; r++)
            slots[j++] = base + r;
    if (avx512_ok(D, G)) {  // the rows together (attend_rows16), at most ROWS_TOGETHER at a time
        constexpr int64_t ROWS_TOGETHER = 32;
        const float *q_rows[ROWS_TOGETHER];
        float *o_rows[ROWS_TOGETHER], *s_rows[ROWS_TOGETHER], l[ROWS_TOGETHER * MOST_HEADS16];
        int64_t seen[ROWS_TOGETHER], R = 0;
        for (int64_t i = i0; i < i1; i++) {
            // a padding row (it points at token 0, a real row of lane 0's) writes nothing
            if (q_valid[b * Q + i]) {
                const int64_t t = q_index[b * Q + i];
                q_rows[R] = q + t * H * D, o_rows[R] = out + t * H * D;
                s_rows[R] = scores + i * G * (most_keys + SCORE_PAD);
                seen[R++] = q_pos[b * Q + i] + 1 < keys ? q_pos[b * Q + i] + 1 : keys;
            }
            if (R == ROWS_TOGETHER || (i + 1 == i1 && R > 0)) {
                if (D == 64)
                    attend_rows16<4>(R, q_rows, o_rows, s_rows, seen, most_keys + SCORE_PAD, l, k_cache, v_cache,
                                     slots, G, Hkv, kvh, scale);
                else
                    attend_rows16<8>(R, q_rows, o_rows, s_rows, seen, most_keys + SCORE_PAD, l, k_cache, v_cache,
                                     slots, G, Hkv, kvh, scale);
                R = 0;
            }
        }
        return;
    }
    for (int64_t i = i0; i < i1; i++) {
        // a padding row (it points at token 0, a real row of lane 0's) writes nothing
        if (!q_valid[b * Q + i]) continue;
        const int64_t t = q_index[b * Q + i];
        const int64_t seen = q_pos[b * Q + i] + 1 < keys ? q_pos[b * Q + i] + 1 : keys;
        for (int64_t g0 = 0; g0 < G; g0 += GB) {
            const int64_t gn = G - g0 < GB ? G - g0 : GB;
            const float *qr[GB];
            float *s[GB], *o[GB];
            for (int64_t g = 0; g < gn; g++) {
                const int64_t h = kvh * G + g0 + g;
                qr[g] = q + (t * H + h) * D;
                s[g] = scores + (i * G + g0 + g) * (most_keys + SCORE_PAD);
                o[g] = out + (t * H + h) * D;
            }
            switch (gn) {
                case 4: attend_heads<4>(qr, s, o, k_cache, v_cache, slots, seen, Hkv, kvh, D, scale); break;
                case 3: attend_heads<3>(qr, s, o, k_cache, v_cache, slots, seen, Hkv, kvh, D, scale); break;
                case 2: attend_heads<2>(qr, s, o, k_cache, v_cache, slots, seen, Hkv, kvh, D, scale); break;
                default: attend_heads<1>(qr, s, o, k_cache, v_cache, slots, seen, Hkv, kvh, D, scale); break;
            }
        }
    }
}

// Units [u0, u1) of a step's attention, unit u = (item u / Q, query row u % Q): a thread's contiguous share. Rows,
// not items, are the unit because a batch-1 step has as few items as KV heads (3 for SmolLM2), which split
// unevenly over 2 threads; its verify rows (5 an item) split evenly. A row's arithmetic does not depend on the
// split.
template <class KV>
inline void attend_units(int64_t u0, int64_t u1, const float *q, float *out, const KV *k_cache,
                         const KV *v_cache, int64_t Q, int64_t H, int64_t Hkv, int64_t D, const int64_t *q_index,
                         const uint8_t *q_valid, const int64_t *q_pos, const int64_t *kv_len,
                         const int64_t *page_table, int64_t P, int64_t page_size, float scale, int64_t most_keys,
                         int64_t *slots, float *scores) {
    for (int64_t u = u0; u < u1;) {
        const int64_t it = u / Q, i0 = u % Q, i1 = (it + 1) * Q < u1 ? Q : u1 - it * Q;
        attend_item(it, i0, i1, q, out, k_cache, v_cache, Q, H, Hkv, D, q_index, q_valid, q_pos, kv_len, page_table,
                    P, page_size, scale, most_keys, slots, scores);
        u = it * Q + i1;
    }
}

// Thread t's share [*u0, *u1) of `units` (item, query row) units, split by their work rather than their count: a
// unit costs the keys its row sees plus UNIT_COST (its set-up), and the threads' shares hold near-equal sums. A
// prompt's rows see 1 to Q keys (causal), so equal counts gave one thread ~40% more work than the other at 3 KV
// heads (a 256-token SmolLM2 prefill, int8, 89.5 -> 83.8 ms; neutral at 128 tokens and in batch-1 and batch-8
// decode and verify steps). Every thread computes the same sums, so the shares cover the units once, in order.
constexpr int64_t UNIT_COST = 16;
inline void unit_share(int64_t units, int64_t Q, int64_t Hkv, const uint8_t *q_valid, const int64_t *q_pos,
                       const int64_t *kv_len, int t, int nt, int64_t *u0, int64_t *u1) {
    auto cost = [&](int64_t u) {
        const int64_t it = u / Q, i = u % Q, b = it / Hkv;
        if (!q_valid[b * Q + i]) return (int64_t)1;
        const int64_t seen = q_pos[b * Q + i] + 1 < kv_len[b] ? q_pos[b * Q + i] + 1 : kv_len[b];
        return seen + UNIT_COST;
    };
    int64_t total = 0;
    for (int64_t u = 0; u < units; u++) total += cost(u);
    // unit u goes to the thread whose share holds the midpoint of its cost in [0, total)
    const int64_t lo = total * t / nt, hi = total * (t + 1) / nt;
    int64_t acc = 0, a = units, b = units;
    for (int64_t u = 0; u < units; u++) {
        const int64_t c = cost(u), mid2 = 2 * acc + c;  // twice the unit's midpoint
        if (a == units && mid2 >= 2 * lo) a = u;
        if (mid2 >= 2 * hi) { b = u; break; }
        acc += c;
    }
    *u0 = a < b ? a : b;
    *u1 = b;
}

inline int64_t longest(const int64_t *kv_len, int64_t B) {
    int64_t most = 0;
    for (int64_t b = 0; b < B; b++) most = kv_len[b] > most ? kv_len[b] : most;
    return most;
}

// Floats of an item's scores (every row and query head of it, each padded to whole 16-key vectors).
inline int64_t scores_floats(int64_t G, int64_t Q, int64_t most_keys) { return G * Q * (most_keys + SCORE_PAD); }

}  // namespace cpu_attention_kernel

extern "C" {
// 0: the AVX2 form on an AVX-512 host too (tests compare the two forms); 1: by the CPU. Returns whether the
// AVX-512 form now runs for heads of 64.
int cpu_attention_use_avx512(int on) {
    cpu_attention_kernel::avx512_off = !on;
    return cpu_attention_kernel::avx512_ok(64, 1);
}

// q [T, H, D] (flat tokens), out [T, H, D]; caches [slots, Hkv, D] of fp32, or of bf16 with kv_bf16; per lane b:
// q_index [B, Q] (flat token of each query row), q_valid [B, Q] (uint8), q_pos [B, Q], kv_len [B], page_table
// [B, P] (int64 all). D must be a multiple of 8. Returns 0, -1 for a bad shape, -2 if scratch cannot be allocated.
int cpu_attention(const float *q, float *out, const void *k_cache, const void *v_cache, int kv_bf16, int64_t B,
                  int64_t Q, int64_t H, int64_t Hkv, int64_t D, const int64_t *q_index, const uint8_t *q_valid,
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
            const int t = omp_get_thread_num(), nt = omp_get_num_threads();
            int64_t u0, u1;
            ak::unit_share(items * Q, Q, Hkv, q_valid, q_pos, kv_len, t, nt, &u0, &u1);
            if (kv_bf16)
                ak::attend_units(u0, u1, q, out, (const ak::bf16_t *)k_cache, (const ak::bf16_t *)v_cache, Q, H, Hkv,
                                 D, q_index, q_valid, q_pos, kv_len, page_table, P, page_size, scale, most_keys, slots,
                                 scores);
            else
                ak::attend_units(u0, u1, q, out, (const float *)k_cache, (const float *)v_cache, Q, H, Hkv, D,
                                 q_index, q_valid, q_pos, kv_len, page_table, P, page_size, scale, most_keys, slots,
                                 scores);
        }
        free(slots);
        free(scores);
    }
    return failed ? -2 : 0;
}
}
