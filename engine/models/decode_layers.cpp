// A Llama-family decoder layer's work around its GGUF linears and its attention, in C++ (x86 AVX2 + FMA, fp32):
// the CPU's counterpart of a captured graph. Eager torch runs ~40 small ops a layer (norms, rotary, the KV
// write, residuals, the MLP gate, views and casts), each a dispatch from Python; at batch 1 on a 2-core host
// they cost as much as the weights' reads (~18 ms of a 42 ms SmolLM2 step, measured). Here a layer is two calls
// (`attention_in`, `attention_out_mlp`) around any attention, and a step of few positions is one call for the
// whole stack (`decode_stack`, which calls the same two functions and the C++ attention kernel).
//
// The GGUF linear (`gguf_kernel.cpp`) and the attention kernel (`cpu_attention.cpp`) are not compiled in: the
// caller passes their entry points (`Kernels`), so each source keeps one build and one cache key.
//
// Batch invariance: every op below computes a row on its own, in a fixed order, so a row's bits never depend on
// how many rows share the call, and the stack and the per-layer calls give the same bits (one set of functions):
//     rms_norm   ss = sum_i x_i^2 (8 lanes over chunks of 8 in index order, then a fixed horizontal sum);
//                r = 1 / sqrt(ss / H + eps);  y_i = (x_i * r) * w_i
//     rotary     (neox layout, half = D / 2)  y_i = x_i c_i - x_{i+half} s_i,  y_{i+half} = x_{i+half} c_{i+half}
//                + x_i s_{i+half}: each product rounded, then the sum (bitwise torch's x * cos + rotate_half(x) *
//                sin, built with -ffp-contract=off)
//     silu_mul   a_i = g_i / (1 + exp(-g_i)) * u_i, exp by a fixed polynomial (below)
//     residual   x_i + o_i (torch's add)

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

extern "C" {
typedef int (*linear_fn)(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, int fmt,
                         const float *bias, float *y, int threads);
typedef int (*attention_fn)(const float *q, float *out, const float *k_cache, const float *v_cache, int64_t B,
                            int64_t Q, int64_t H, int64_t Hkv, int64_t D, const int64_t *q_index,
                            const uint8_t *q_valid, const int64_t *q_pos, const int64_t *kv_len,
                            const int64_t *page_table, int64_t P, int64_t page_size, float scale, int threads);

// One GGUF linear: blocks [n, k / 32] of GGML type `fmt` (gguf_kernel's numbering), an fp32 bias [n] or null.
struct Linear {
    const uint8_t *blocks;
    const float *bias;
    int64_t n, k, fmt;
};

struct Layer {
    const float *norm_in, *norm_post;  // [hidden] RMSNorm weights
    Linear qkv, o, gate_up, down;      // q/k/v and gate/up merged, rows in that order
};

struct Shape {
    int64_t hidden, heads, kv_heads, head_dim, inter;
    float eps, scale;
};

// Entry points and threads: a linear takes `all_threads` from `always_all` multiply-adds, else `threads`.
struct Kernels {
    linear_fn linear;
    attention_fn attention;
    int64_t threads, all_threads, always_all;
};

// A step's paged-attention indices (cpu_attention's): q_index / q_valid / q_pos [B, Q], kv_len [B], table [B, P].
struct Paging {
    const int64_t *q_index;
    const uint8_t *q_valid;
    const int64_t *q_pos, *kv_len, *table;
    int64_t B, Q, P, page_size;
};
}

namespace {

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// exp(x) for any x: clamped to [-87, 88] (the MLP gate's tails: silu is then x or 0 to fp32 precision),
// x = n ln2 + r with |r| <= ln2 / 2, e^r by Cephes' degree-6 polynomial (relative error ~2e-7), 2^n by exponent
// bits. Pure arithmetic: the same bits on every call.
inline __m256 exp_any(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
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
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

void rms_norm(const float *x, const float *w, float *y, int64_t M, int64_t H, float eps) {
    for (int64_t r = 0; r < M; r++) {
        const float *xr = x + r * H;
        float *yr = y + r * H;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t i = 0; i < H; i += 8) {
            const __m256 v = _mm256_loadu_ps(xr + i);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        const __m256 inv = _mm256_set1_ps(1.0f / sqrtf(hsum(acc) / (float)H + eps));
        for (int64_t i = 0; i < H; i += 8)
            _mm256_storeu_ps(yr + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + i), inv),
                                                   _mm256_loadu_ps(w + i)));
    }
}

// Rotate `heads` heads of D at the start of each row (row stride `stride`) in place; cos / sin [M, D].
void rotary(float *x, int64_t M, int64_t stride, int64_t heads, int64_t D, const float *cos, const float *sin) {
    const int64_t half = D / 2;
    for (int64_t r = 0; r < M; r++) {
        const float *c = cos + r * D, *s = sin + r * D;
        for (int64_t h = 0; h < heads; h++) {
            float *v = x + r * stride + h * D;
            for (int64_t i = 0; i < half; i++) {
                const float a = v[i], b = v[i + half];
                const float lo = a * c[i] - b * s[i];
                const float hi = b * c[i + half] + a * s[i + half];
                v[i] = lo;
                v[i + half] = hi;
            }
        }
    }
}

// gu [M, 2 * I] (gate then up) -> a [M, I]
void silu_mul(const float *gu, float *a, int64_t M, int64_t I) {
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (int64_t r = 0; r < M; r++) {
        const float *g = gu + r * 2 * I, *u = g + I;
        float *ar = a + r * I;
        for (int64_t i = 0; i < I; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, exp_any(_mm256_sub_ps(zero, gv))));
            _mm256_storeu_ps(ar + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
        }
    }
}

void add_into(float *x, const float *o, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] += o[i];
}

int linear(const Kernels *kn, const Linear &l, const float *x, int64_t M, float *y) {
    const int threads = (int)(M * l.n * l.k >= kn->always_all ? kn->all_threads : kn->threads);
    return kn->linear(x, M, l.k, l.blocks, l.n, (int)l.fmt, l.bias, y, threads);
}

bool shape_ok(const Shape *s) {
    return s->hidden % 8 == 0 && s->inter % 8 == 0 && s->head_dim % 2 == 0 && s->heads % s->kv_heads == 0;
}

// A float scratch that frees itself (malloc, not new: no exceptions across the C boundary).
struct Scratch {
    float *p;
    explicit Scratch(int64_t n) : p((float *)malloc(sizeof(float) * (size_t)(n > 0 ? n : 1))) {}
    ~Scratch() { free(p); }
};
}  // namespace

extern "C" {
// The library's version: bump it with any change to the arithmetic above.
int decode_layers_version(void) { return 1; }

// x [M, hidden] (the residual stream, read) -> q [M, heads * D] rotated, and the rotated keys and the values
// written to k_cache / v_cache [num_slots, kv_heads, D] at slots [M]. Returns 0, -1 for a bad shape or slot,
// -2 if scratch cannot be allocated, or the linear's own code.
int attention_in(const Shape *s, const Layer *layer, const Kernels *kn, const float *x, int64_t M, const float *cos,
                 const float *sin, const int64_t *slots, float *k_cache, float *v_cache, int64_t num_slots,
                 float *q) {
    if (!shape_ok(s)) return -1;
    const int64_t D = s->head_dim, qn = s->heads * D, kvn = s->kv_heads * D, width = qn + 2 * kvn;
    if (layer->qkv.n != width || layer->qkv.k != s->hidden) return -1;
    for (int64_t r = 0; r < M; r++)
        if (slots[r] < 0 || slots[r] >= num_slots) return -1;
    Scratch h(M * s->hidden), qkv(M * width);
    if (!h.p || !qkv.p) return -2;
    rms_norm(x, layer->norm_in, h.p, M, s->hidden, s->eps);
    int rc = linear(kn, layer->qkv, h.p, M, qkv.p);
    if (rc != 0) return rc;
    rotary(qkv.p, M, width, s->heads + s->kv_heads, D, cos, sin);
    for (int64_t r = 0; r < M; r++) {
        const float *row = qkv.p + r * width;
        memcpy(q + r * qn, row, sizeof(float) * qn);
        memcpy(k_cache + slots[r] * kvn, row + qn, sizeof(float) * kvn);
        memcpy(v_cache + slots[r] * kvn, row + qn + kvn, sizeof(float) * kvn);
    }
    return 0;
}

// x [M, hidden] += o_proj(attn); x += down(silu(gate) * up) of post_attention_norm(x). attn [M, heads * D].
int attention_out_mlp(const Shape *s, const Layer *layer, const Kernels *kn, float *x, int64_t M,
                      const float *attn) {
    if (!shape_ok(s)) return -1;
    const int64_t H = s->hidden, I = s->inter;
    if (layer->o.n != H || layer->o.k != s->heads * s->head_dim || layer->gate_up.n != 2 * I ||
        layer->gate_up.k != H || layer->down.n != H || layer->down.k != I)
        return -1;
    Scratch o(M * H), gu(M * 2 * I), a(M * I);
    if (!o.p || !gu.p || !a.p) return -2;
    int rc = linear(kn, layer->o, attn, M, o.p);
    if (rc != 0) return rc;
    add_into(x, o.p, M * H);
    rms_norm(x, layer->norm_post, o.p, M, H, s->eps);
    if ((rc = linear(kn, layer->gate_up, o.p, M, gu.p)) != 0) return rc;
    silu_mul(gu.p, a.p, M, I);
    if ((rc = linear(kn, layer->down, a.p, M, o.p)) != 0) return rc;
    add_into(x, o.p, M * H);
    return 0;
}

// Every layer of a step whose attention runs in the C++ kernel (few positions a lane): per layer attention_in,
// the kernel over the paged caches, attention_out_mlp. x [M, hidden] is updated in place.
int decode_stack(const Shape *s, const Layer *layers, int64_t L, const Kernels *kn, float *x, int64_t M,
                 const float *cos, const float *sin, const int64_t *slots, float *const *k_caches,
                 float *const *v_caches, int64_t num_slots, const Paging *pg) {
    const int64_t qn = s->heads * s->head_dim;
    Scratch q(M * qn), out(M * qn);
    if (!q.p || !out.p) return -2;
    for (int64_t l = 0; l < L; l++) {
        int rc = attention_in(s, layers + l, kn, x, M, cos, sin, slots, k_caches[l], v_caches[l], num_slots, q.p);
        if (rc != 0) return rc;
        memset(out.p, 0, sizeof(float) * M * qn);  // rows no valid query writes (padding lanes) stay 0
        const int64_t work = 2 * pg->B * pg->Q * s->heads * pg->P * pg->page_size * s->head_dim;
        rc = kn->attention(q.p, out.p, k_caches[l], v_caches[l], pg->B, pg->Q, s->heads, s->kv_heads, s->head_dim,
                           pg->q_index, pg->q_valid, pg->q_pos, pg->kv_len, pg->table, pg->P, pg->page_size,
                           s->scale, (int)(work >= kn->always_all ? kn->all_threads : kn->threads));
        if (rc != 0) return rc;
        if ((rc = attention_out_mlp(s, layers + l, kn, x, M, out.p)) != 0) return rc;
    }
    return 0;
}
}
