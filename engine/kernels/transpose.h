// An 8 x 8 transpose of 32-bit lanes (AVX2): the prompt GEMMs lay weight rows into vector lanes with it
// (int8_gemm.inc, bf16_dot.cpp).
#pragma once
#include <immintrin.h>

namespace sk {
// out[i] = dword i of each of in[0..8)
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
}  // namespace sk
