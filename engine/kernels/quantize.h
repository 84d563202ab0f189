// Activations quantised for the int8 arithmetic, one row at a time (llama.cpp's Q8_0 / Q8_K, with block sums):
// per `qk` values (32 for the legacy formats, 256 for the K-quants: the weights' block) a scale
//     dx = amax / 127,   q_i = nearest-even(x_i * (127 / amax))   (amax = 0: dx = 0, q = 0)
// and per 16 values the exact sum of q (bs, what the formats' offsets and mins multiply). A row's quantisation
// reads that row only, so a row's bits never depend on the rows beside it.
#pragma once
#include <math.h>
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

inline void quantize_row(const float *x, const XQ &xq, int64_t r) {
    const int64_t K = xq.K, qk = xq.qk;
    const float *xr = x + r * K;
    int8_t *q = xq.q + r * K;
    for (int64_t b = 0; b < K / qk; b++) {
        float amax = 0.f;
        for (int64_t i = 0; i < qk; i++) amax = fmaxf(amax, fabsf(xr[b * qk + i]));
        const float id = amax > 0.f ? 127.f / amax : 0.f;
        xq.d[r * (K / qk) + b] = amax / 127.f;
        for (int64_t i = 0; i < qk; i++) {
            const float v = nearbyintf(xr[b * qk + i] * id);  // the default rounding mode: nearest, ties to even
            q[b * qk + i] = (int8_t)(v > 127.f ? 127.f : v < -127.f ? -127.f : v);
        }
    }
    for (int64_t g = 0; g < K / GROUP; g++) {
        int s = 0;
        for (int i = 0; i < GROUP; i++) s += q[g * GROUP + i];
        xq.bs[r * (K / GROUP) + g] = (int16_t)s;
    }
}
}  // namespace sk
