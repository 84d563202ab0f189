// Greedy readout on CPU: each row's argmax, the index torch.argmax(dim=-1) returns (the first maximum; a row with
// a NaN: its first NaN), in two vector passes a row where torch's reduction tracks an index per element.
//
// Why: a step's greedy tokens are the argmax of its logits rows (49152 a row for SmolLM2), and torch's CPU
// reduction carries an index beside every element: 70 us a row warm, 2.4 ms for a batch-8 verify step's 40 rows.
// Greedy acceptance (`greedy_accept`) reads a verify step's rows only up to each request's first rejection, and
// compares the drafts in the same pass: in torch that was five more small ops after the argmax, each slow in a
// step whose weights have just streamed through the caches (about 110 us of a batch-1 verify step).

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

// Greedy acceptance of a verify step. x: B requests' k1 = k + 1 logits rows each (row (b, j) at x + (b * k1 + j) *
// stride); drafts [B, k] int64 (row b at drafts + b * draft_stride); num_draft [B]. Request by request, the argmax
// of rows j = 0, 1, ... in turn while draft j is one of the request's and equals it: out [B, k1] gets those
// argmaxes (the accepted drafts, then the corrected or bonus token at a = accepted[b]) and out[b, a] again past a.
// Rows past the first rejection are never read: at n-gram's acceptance a batch-1 verify step reads about two of its
// five rows. Threads split the requests.
void greedy_accept(const float *x, int64_t B, int64_t k1, int64_t n, int64_t stride, const int64_t *drafts,
                   int64_t draft_stride, const int64_t *num_draft, int64_t *out, int64_t *accepted, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t b = 0; b < B; b++) {
        const float *rows = x + b * k1 * stride;
        int64_t *o = out + b * k1, j = 0, token;
        while (true) {
            token = argmax_kernel::row_argmax(rows + j * stride, n);
            o[j] = token;
            if (j + 1 >= k1 || j >= num_draft[b] || drafts[b * draft_stride + j] != token) break;
            j++;
        }
        accepted[b] = j;
        for (int64_t t = j + 1; t < k1; t++) o[t] = token;
    }
}
}
