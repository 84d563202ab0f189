// Greedy readout on CPU: each row's argmax, the index torch.argmax(dim=-1) returns (the first maximum; a row with
// a NaN: its first NaN), in two vector passes a row where torch's reduction tracks an index per element.
//
// Why: a step's greedy tokens are the argmax of its logits rows (49152 a row for SmolLM2), and torch's CPU
// reduction carries an index beside every element: 70 us a row warm, 2.4 ms for a batch-8 verify step's 40 rows.

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>

namespace argmax_kernel {

// The row's first NaN, or -1.
inline int64_t first_nan(const float *x, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const int m = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(x + i), _CMP_UNORD_Q));
        if (m) return i + __builtin_ctz(m);
    }
    for (; i < n; i++)
        if (isnan(x[i])) return i;
    return -1;
}

inline int64_t row_argmax(const float *x, int64_t n) {
    // pass 1: the largest value and whether a NaN is there (max_ps drops a NaN in its first operand: unordered
    // lanes are caught apart)
    __m256 mx = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        mx = _mm256_max_ps(v, mx);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    float best = -INFINITY, lanes[8];
    _mm256_storeu_ps(lanes, mx);
    for (int k = 0; k < 8; k++) best = lanes[k] > best ? lanes[k] : best;
    bool any_nan = _mm256_movemask_ps(nan) != 0;
    for (int64_t t = i; t < n; t++) {
        any_nan |= isnan(x[t]) != 0;
        best = x[t] > best ? x[t] : best;
    }
    if (any_nan) return first_nan(x, n);
    // pass 2: the first index holding it (the row is in the cache now)
    const __m256 b = _mm256_set1_ps(best);
    for (i = 0; i + 8 <= n; i += 8) {
        const int m = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), b, _CMP_EQ_OQ));
        if (m) return i + __builtin_ctz(m);
    }
    for (; i < n; i++)
        if (x[i] == best) return i;
    return 0;  // a row of -inf only: torch answers 0 too
}

}  // namespace argmax_kernel

extern "C" {
// x [rows, n] float32 (row r at x + r * stride) -> out [rows] int64. Threads split the rows.
void argmax_rows(const float *x, int64_t rows, int64_t n, int64_t stride, int64_t *out, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_kernel::row_argmax(x + r * stride, n);
}
}
