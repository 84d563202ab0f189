// specstep's CPU kernel layer: GGUF block formats (formats.h) times fp32 or int8 activations (linear.inc), and BF16
// weights times bf16 activations (bf16_dot.cpp); prompt rows' GEMMs for the block formats' int8 rows (int8_gemm.inc)
// and BF16's bf16 row; one dispatch table keyed by names (weight format x activation arithmetic x ISA), one C surface
// (binding.py).
//
// linear.inc (the decode kernels) and int8_gemm.inc (the prompt rows' int8 GEMM, in its `int8gemm` namespace after
// its own SIMD layer) are written once and compiled once per ISA inside that ISA's namespace, after its SIMD layer:
//   avx2    AVX2 + FMA + F16C (the build's baseline flags): int8 products by vpmaddubsw + vpmaddwd;
//   avx512  AVX-512 F/BW/VL/DQ + VNNI (a target region): int8 products by vpdpbusd (4-byte sums) and vpdpwssd
//           (scaled pairs).
// Both form the same exact integer sums and the same fp32 operations, so they give the same bits (tested); the
// host probe (`sk_isa_runs`) says which run here.
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <type_traits>

#include "formats.h"
#include "quantize.h"
#include "transpose.h"

namespace sk {
namespace avx2 {
inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
// acc + 8 int32 lanes, lane k: sc * sum of bytes 4k..4k+3's products (u unsigned <= 63, q signed: no saturation)
inline __m256i dot_scaled_add(__m256i acc, __m256i u, __m256i q, __m256i sc) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, q), sc));
}
// acc + 8 int32 lanes, lane k: the sum of bytes 4k..4k+3's products (u unsigned <= 31, q signed: no saturation)
inline __m256i dot4_add(__m256i acc, __m256i u, __m256i q) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, q), _mm256_set1_epi16(1)));
}
#include "linear.inc"

namespace int8gemm {  // the prompt GEMM's SIMD layer: 8 weight rows a ymm
constexpr int64_t LANES = 8;
constexpr int TILE_R = 6, TILE_C = 1;  // (16 ymm registers: 12 sums)
using VI = __m256i;
using VF = __m256;
inline VI v_zero() { return _mm256_setzero_si256(); }
inline VI v_load(const void *p) { return _mm256_load_si256((const __m256i *)p); }
inline VI v_set1(int32_t x) { return _mm256_set1_epi32(x); }
inline VI v_dot4(VI acc, VI u, VI q) { return dot4_add(acc, u, q); }
inline VI v_pairs(VI acc, VI a, VI b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }
inline VI v_mullo(VI a, VI b) { return _mm256_mullo_epi32(a, b); }
inline VI v_add(VI a, VI b) { return _mm256_add_epi32(a, b); }
inline VI v_sub(VI a, VI b) { return _mm256_sub_epi32(a, b); }
inline VF v_fzero() { return _mm256_setzero_ps(); }
inline VF v_fload(const float *p) { return _mm256_load_ps(p); }
inline VF v_fset1(float x) { return _mm256_set1_ps(x); }
inline VF v_fmul(VF a, VF b) { return _mm256_mul_ps(a, b); }
inline VF v_fadd(VF a, VF b) { return _mm256_add_ps(a, b); }
inline VF v_cvt(VI a) { return _mm256_cvtepi32_ps(a); }
inline void v_fstoreu(float *p, VF a) { _mm256_storeu_ps(p, a); }
#include "int8_gemm.inc"
}  // namespace int8gemm
}  // namespace avx2
}  // namespace sk

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
namespace sk {
namespace avx512 {
using avx2::hsum;
// the pairs' sums times the scales, accumulated in one VNNI instruction (vpdpwssd) where AVX2 takes a multiply-add
// and an add: the same exact integers. (vpdpbusd's 4-byte sums need a 32-bit multiply by the scale after it, which
// measured slower than AVX2's lanes on a Q4_K_M model's layers, AMD EPYC.)
inline __m256i dot_scaled_add(__m256i acc, __m256i u, __m256i q, __m256i sc) {
    return _mm256_dpwssd_epi32(acc, _mm256_maddubs_epi16(u, q), sc);
}
inline __m256i dot4_add(__m256i acc, __m256i u, __m256i q) { return _mm256_dpbusd_epi32(acc, u, q); }
#include "linear.inc"

namespace int8gemm {  // the prompt GEMM's SIMD layer: 16 weight rows a zmm
constexpr int64_t LANES = 16;
constexpr int TILE_R = 6, TILE_C = 2;  // 24 zmm of sums
using VI = __m512i;
using VF = __m512;
inline VI v_zero() { return _mm512_setzero_si512(); }
inline VI v_load(const void *p) { return _mm512_load_si512(p); }
inline VI v_set1(int32_t x) { return _mm512_set1_epi32(x); }
inline VI v_dot4(VI acc, VI u, VI q) { return _mm512_dpbusd_epi32(acc, u, q); }
inline VI v_pairs(VI acc, VI a, VI b) { return _mm512_dpwssd_epi32(acc, a, b); }
inline VI v_mullo(VI a, VI b) { return _mm512_mullo_epi32(a, b); }
inline VI v_add(VI a, VI b) { return _mm512_add_epi32(a, b); }
inline VI v_sub(VI a, VI b) { return _mm512_sub_epi32(a, b); }
inline VF v_fzero() { return _mm512_setzero_ps(); }
inline VF v_fload(const float *p) { return _mm512_load_ps(p); }
inline VF v_fset1(float x) { return _mm512_set1_ps(x); }
inline VF v_fmul(VF a, VF b) { return _mm512_mul_ps(a, b); }
inline VF v_fadd(VF a, VF b) { return _mm512_add_ps(a, b); }
inline VF v_cvt(VI a) { return _mm512_cvtepi32_ps(a); }
inline void v_fstoreu(float *p, VF a) { _mm512_storeu_ps(p, a); }
#include "int8_gemm.inc"
}  // namespace int8gemm
}  // namespace avx512
}  // namespace sk
#pragma GCC pop_options
#include "bf16_dot.cpp"

namespace sk {
using Fp32Fn = void (*)(const float *, int64_t, int64_t, const uint8_t *, int64_t, const float *, float *, int64_t,
                        int64_t);
using Int8Fn = void (*)(const XQ &, int64_t, const uint8_t *, int64_t, const float *, float *, int64_t, int64_t);
using DequantFn = void (*)(const uint8_t *, float *);
using Bf16Fn = void (*)(const uint16_t *, int64_t, int64_t, const uint8_t *, int64_t, const float *, float *, int64_t,
                        int64_t);
using GemmFn = void (*)(const XQ &, int64_t, const int64_t *, const uint8_t *, int64_t, const float *, float *, int64_t,
                        int64_t, void *);
using GemmScratchFn = int64_t (*)(int64_t, int);
using Bf16GemmFn = void (*)(const uint16_t *, int64_t, const int64_t *, int64_t, const uint8_t *, int64_t,
                            const float *, float *, int64_t, int64_t, void *);

// One row of the table: a kernel and what it reads.
struct Kernel {
    const char *format, *arith, *isa;
    int qk, bytes;
    Fp32Fn fp32;  // set for arith "fp32"
    Int8Fn int8;  // set for arith "int8"
    DequantFn dequant;  // the format's block -> fp32 (a prompt GEMM's panels: decode_layers.cpp)
    Bf16Fn bf16 = nullptr;  // set for arith "bf16" (x rounded to bf16 first; AVX-512 BF16 hosts)
    // The prompt rows' GEMM (its own fp32 order, for rows a caller marks as a prompt's): the block formats' int8 rows
    // on AVX-512 (int8_gemm.inc, over x quantised as for `int8`), BF16's bf16 row (bf16_dot.cpp, x rounded as for it)
    GemmFn gemm = nullptr;
    GemmScratchFn gemm_scratch = nullptr;  // a thread's scratch bytes for `gemm` (rows of K values, blocks of qk)
    Bf16GemmFn bf16_gemm = nullptr;
};

struct Format {
    const char *name;
    int qk, bytes;
    DequantFn dequant;
};

#define SK_FORMAT(F) Format{#F, F::qk, F::bytes, F::dequant}
// (Q4_1 and Q8_0: dequantisation only, no rows in the table)
const Format FORMATS[] = {SK_FORMAT(Q4_0), SK_FORMAT(Q5_0), SK_FORMAT(Q5_1), SK_FORMAT(Q2_K), SK_FORMAT(Q3_K),
                          SK_FORMAT(Q4_K), SK_FORMAT(Q5_K), SK_FORMAT(Q6_K), SK_FORMAT(F16),  SK_FORMAT(BF16),
                          SK_FORMAT(Q4_1), SK_FORMAT(Q8_0)};

#define SK_FP32(F, ISA) Kernel{#F, "fp32", #ISA, F::qk, F::bytes, ISA::fp32_range<F>, nullptr, F::dequant}
#define SK_INT8(F, ISA)                                                                                          \
    Kernel{#F, "int8", #ISA, F::qk, F::bytes, nullptr, ISA::int8_range<F>, F::dequant, nullptr, ISA::int8gemm::range<F>, \
           ISA::int8gemm::scratch_bytes}
#define SK_BLOCKS(F) SK_FP32(F, avx2), SK_FP32(F, avx512), SK_INT8(F, avx2), SK_INT8(F, avx512)
#define SK_WIDE(F) SK_FP32(F, avx2), SK_FP32(F, avx512)
const Kernel TABLE[] = {SK_BLOCKS(Q4_0), SK_BLOCKS(Q5_0), SK_BLOCKS(Q5_1), SK_BLOCKS(Q2_K), SK_BLOCKS(Q3_K),
                        SK_BLOCKS(Q4_K), SK_BLOCKS(Q5_K), SK_BLOCKS(Q6_K), SK_WIDE(F16),    SK_WIDE(BF16),
                        Kernel{"BF16", "bf16", "avx512", BF16::qk, BF16::bytes, nullptr, nullptr, BF16::dequant,
                               bf16dot::range, nullptr, nullptr, bf16dot::gemm_range}};
constexpr int TABLE_SIZE = sizeof(TABLE) / sizeof(TABLE[0]);

// A C++ caller's handle on a row (decode_layers.cpp's `fmt` field): TABLE_BIT | row << 4, apart from the older
// kernel's small fmt codes and clear of their flag bits (1-3).
constexpr int64_t TABLE_BIT = 1 << 16;
inline const Kernel *from_handle(int64_t handle) {
    const int64_t row = (handle & ~TABLE_BIT) >> 4;
    return (handle & TABLE_BIT) && !(handle & 15) && row >= 0 && row < TABLE_SIZE ? &TABLE[row] : nullptr;
}

inline bool isa_runs(const char *isa) {
    if (!strcmp(isa, "avx2")) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (!strcmp(isa, "avx512"))
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
               __builtin_cpu_supports("avx512vnni");
    return false;
}

// Whether row `k` runs on this CPU: its ISA, and AVX-512 BF16 for the bf16 arithmetic.
inline bool runs(const Kernel &k) { return isa_runs(k.isa) && (!k.bf16 || bf16dot::runs()); }

// Scratch bytes kernel `k` needs for M rows of width K on one thread (the quantised or rounded rows; none for fp32).
inline int64_t scratch_bytes(const Kernel &k, int64_t M, int64_t K) {
    return k.int8 ? xq_bytes(M, K, k.qk) : k.bf16 ? M * K * 2 : 0;
}

// Scratch bytes a thread of row `k`'s prompt GEMM needs for its weight panels (rows of K values), 0 without one.
inline int64_t gemm_panel_bytes(const Kernel &k, int64_t K) {
    return k.gemm ? k.gemm_scratch(K, k.qk) : k.bf16_gemm ? bf16dot::gemm_scratch_bytes(K) : 0;
}

// Weight rows [n0, n1) on the calling thread, x quantised into `scratch` first (int8): the same bits as
// sk_linear's. For callers that split a linear's rows over their own threads (decode_layers.cpp).
inline void linear_range(const Kernel &k, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N,
                         const float *bias, float *y, int64_t n0, int64_t n1, void *scratch) {
    if (k.fp32) return k.fp32(x, M, K, w, N, bias, y, n0, n1);
    if (k.bf16) {
        uint16_t *xb = (uint16_t *)scratch;
        for (int64_t r = 0; r < M; r++) bf16dot::round_row(x, xb, K, r);
        return k.bf16(xb, M, K, w, N, bias, y, n0, n1);
    }
    const XQ xq = xq_view(scratch, M, K, k.qk);
    for (int64_t r = 0; r < M; r++) quantize_row(x, xq, r);
    k.int8(xq, M, w, N, bias, y, n0, n1);
}
}  // namespace sk

extern "C" {
// The table's row for these names, or -1 (no such row), -2 (the ISA does not run on this CPU).
int sk_lookup(const char *format, const char *arith, const char *isa) {
    for (int i = 0; i < sk::TABLE_SIZE; i++) {
        const sk::Kernel &k = sk::TABLE[i];
        if (!strcmp(k.format, format) && !strcmp(k.arith, arith) && !strcmp(k.isa, isa))
            return sk::runs(k) ? i : -2;
    }
    return -1;
}

int sk_table_size(void) { return sk::TABLE_SIZE; }

// Row i's names as "format/arith/isa" into out (at least 64 bytes).
void sk_row_name(int i, char *out) {
    const sk::Kernel &k = sk::TABLE[i];
    snprintf(out, 64, "%s/%s/%s", k.format, k.arith, k.isa);
}

int sk_isa_runs(const char *isa) { return sk::isa_runs(isa); }

// Whether row i has a prompt GEMM (Kernel::gemm).
int sk_has_gemm(int i) { return i >= 0 && i < sk::TABLE_SIZE && (sk::TABLE[i].gemm || sk::TABLE[i].bf16_gemm); }

// A format's block: values and bytes; 0, or -1 for an unknown name.
int sk_format(const char *format, int64_t *qk, int64_t *bytes) {
    for (const sk::Format &f : sk::FORMATS)
        if (!strcmp(f.name, format)) {
            *qk = f.qk, *bytes = f.bytes;
            return 0;
        }
    return -1;
}

// nblocks blocks of `format` -> their fp32 weights (gguf's bits), over `threads` threads. 0, or -1.
int sk_dequantize(const char *format, const uint8_t *blocks, int64_t nblocks, float *out, int threads) {
    for (const sk::Format &f : sk::FORMATS)
        if (!strcmp(f.name, format)) {
            #pragma omp parallel for num_threads(threads) schedule(static)
            for (int64_t b = 0; b < nblocks; b++) f.dequant(blocks + b * f.bytes, out + b * f.qk);
            return 0;
        }
    return -1;
}

// y [M, N] = x [M, K] @ W.T (+ bias [N]) by table row `kernel`, W as [N, K / qk] blocks. x's rows quantised or
// rounded once (int8, bf16: the threads split them), then the threads split the weight rows. 0, -1 (a bad row or K,
// or a row this CPU cannot run), -2 (no memory).
int sk_linear(int kernel, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, const float *bias,
              float *y, int threads) {
    if (kernel < 0 || kernel >= sk::TABLE_SIZE || K % sk::TABLE[kernel].qk) return -1;
    const sk::Kernel &k = sk::TABLE[kernel];
    if (!sk::runs(k)) return -1;
    void *scratch = nullptr;
    const int64_t need = sk::scratch_bytes(k, M, K);
    if (need && !(scratch = aligned_alloc(64, (need + 63) / 64 * 64))) return -2;
    const sk::XQ xq = sk::xq_view(scratch, M, K, k.qk);
    #pragma omp parallel num_threads(threads)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        if (k.bf16) {
            uint16_t *xb = (uint16_t *)scratch;
            for (int64_t r = M * t / nt; r < M * (t + 1) / nt; r++) sk::bf16dot::round_row(x, xb, K, r);
            #pragma omp barrier
            k.bf16(xb, M, K, w, N, bias, y, N * t / nt, N * (t + 1) / nt);
        } else if (k.int8) {
            for (int64_t r = M * t / nt; r < M * (t + 1) / nt; r++) sk::quantize_row(x, xq, r);
            #pragma omp barrier
            k.int8(xq, M, w, N, bias, y, N * t / nt, N * (t + 1) / nt);
        } else {
            k.fp32(x, M, K, w, N, bias, y, N * t / nt, N * (t + 1) / nt);
        }
    }
    free(scratch);
    return 0;
}

// sk_linear through row `kernel`'s prompt GEMM (every row a prompt's): 0, -1 (a bad row or K, a row without the
// GEMM, one this CPU cannot run, or fewer than one thread: each thread's panels are sized by the count), -2 (no
// memory).
int sk_gemm(int kernel, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, const float *bias,
            float *y, int threads) {
    if (!sk_has_gemm(kernel) || K % sk::TABLE[kernel].qk || !sk::runs(sk::TABLE[kernel]) || threads < 1) return -1;
    const sk::Kernel &k = sk::TABLE[kernel];
    const int64_t xbytes = (sk::scratch_bytes(k, M, K) + 63) / 64 * 64, pbytes = sk::gemm_panel_bytes(k, K);
    uint8_t *scratch = (uint8_t *)aligned_alloc(64, xbytes + threads * pbytes);
    if (!scratch) return -2;
    const sk::XQ xq = sk::xq_view(scratch, M, K, k.qk);
    #pragma omp parallel num_threads(threads)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        void *panels = scratch + xbytes + t * pbytes;
        if (k.bf16_gemm) {
            uint16_t *xb = (uint16_t *)scratch;
            for (int64_t r = M * t / nt; r < M * (t + 1) / nt; r++) sk::bf16dot::round_row(x, xb, K, r);
            #pragma omp barrier
            k.bf16_gemm(xb, M, nullptr, K, w, N, bias, y, N * t / nt, N * (t + 1) / nt, panels);
        } else {
            for (int64_t r = M * t / nt; r < M * (t + 1) / nt; r++) sk::quantize_row(x, xq, r);
            #pragma omp barrier
            k.gemm(xq, M, nullptr, w, N, bias, y, N * t / nt, N * (t + 1) / nt, panels);
        }
    }
    free(scratch);
    return 0;
}
}
