// Activations quantised for the int8 arithmetic, one row at a time (llama.cpp's Q8_0 / Q8_K, with block sums):
// per `qk` values (32 for the legacy formats, 256 for the K-quants: the weights' block) a scale
//     dx = amax / 127,   q_i = nearest-even(x_i * (127 / amax))   (amax = 0: dx = 0, q = 0)
// and per 16 values the exact sum of q (bs, what the formats' offsets and mins multiply). A row's quantisation
// reads that row only, so a row's bits never depend on the rows beside it.
#pragma once
#include <immintrin.h>
#include <stdint.h>

namespace sk {
// M rows of width K quantised per qk: q [M, K], d [M, K / qk], bs [M, K / 16], in one scratch buffer.
struct XQ {
    int8_t *q;
    float *d;
    int16_t *bs;
    int64_t K, qk;
};

inline int64_t xq_bytes(int64_t M, int64_t K, int64_t qk) {
    return M * K + M * (K / qk) * 4 + M * (K / GROUP) * 2;  // (no alignment needed: unaligned loads)
}

inline XQ xq_view(void *scratch, int64_t M, int64_t K, int64_t qk) {
    uint8_t *p = (uint8_t *)scratch;
    XQ xq{(int8_t *)p, nullptr, nullptr, K, qk};
    p += M * K;
    xq.d = (float *)p;
    p += M * (K / qk) * 4;
    xq.bs = (int16_t *)p;
    return xq;
}

// The row xr into xq's row r. (8 lanes at a time: the scalar loop, with a libm fmaxf call a value, was a few percent of a Q4_K_M decode step.
// The same bits: max is exact, and vcvtps2dq rounds to nearest even as nearbyintf does in the default mode;
// |x * 127 / amax| rounds to at most 127, so packing's saturation stands in for the clamp.)
inline void quantize_into(const float *xr, const XQ &xq, int64_t r) {
    const int64_t K = xq.K, qk = xq.qk;
    int8_t *q = xq.q + r * K;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t b = 0; b < K / qk; b++) {
        __m256 m = _mm256_setzero_ps();
        for (int64_t i = 0; i < qk; i += 8)  // (a NaN keeps the running max, as fmaxf did)
            m = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(xr + b * qk + i)), m);
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        const __m256 id = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
        xq.d[r * (K / qk) + b] = amax / 127.f;
        for (int64_t i = 0; i < qk; i += 32) {
            const float *xi = xr + b * qk + i;
            __m256i v[4];
            for (int j = 0; j < 4; j++) v[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xi + 8 * j), id));
            // packs work within 128-bit halves: the permute puts the 32 bytes back in index order
            const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
            _mm256_storeu_si256((__m256i *)(q + b * qk + i),
                                _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        }
    }
    for (int64_t g = 0; g < K / GROUP; g++) {
        int s = 0;
        for (int i = 0; i < GROUP; i++) s += q[g * GROUP + i];
        xq.bs[r * (K / GROUP) + g] = (int16_t)s;
    }
}

// x's row r into xq's row r.
inline void quantize_row(const float *x, const XQ &xq, int64_t r) { quantize_into(x + r * xq.K, xq, r); }
}  // namespace sk
