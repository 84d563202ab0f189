// GGUF's block formats as rows of one table (ggml's type traits, in this engine's terms). Each row says how a
// block of `qk` weights lies in `bytes` bytes, and gives two views of it:
//   dequant: the block's fp32 weights, bit for bit what `gguf.quants.dequantize` computes (the same fp32
//            operations in the same order; the build does not contract them into FMAs), for fp32 activations;
//   Scales:  the block in the int8 arithmetic's terms (int8 activations, `linear.inc`; built in registers, or for
//            Q2_K through an Unpacked its `unpack` fills):
//                w = d * (sc_j * u - off_j) + dm * mn_j        for value i of 16-value group j = i / 16
//            with u the unsigned integer weights (0..63), sc_j / off_j / mn_j small integers and d / dm floats,
//            so that a block's dot product with activations quantised as q (scale dx, group sums bs_j) is
//                d dx (sum_i sc_j(i) u_i q_i - sum_j off_j bs_j) + dm dx (sum_j mn_j bs_j)
//            in exact integers, then fp32 products (linear.inc): llama.cpp's arithmetic for the K-quants, against
//            per-256 Q8_K blocks with block sums. The legacy formats (one 32-value block, one scale: `off`, and a
//            min for Q5_1) take llama.cpp's arithmetic against per-32 Q8 blocks instead, in 8 lanes of 4 values:
//                d dx sum_lane (u - off) q  (+ dm dx sum_lane q)
//            with no view (their u from `chunk`, d and dm the block's fp16s).
// Adding a format is adding a struct here and a row in kernels.cpp's table.
#pragma once
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

namespace sk {
constexpr int QK_K = 256;  // a K-quant super-block
constexpr int GROUP = 16;  // the int8 arithmetic's group: activation block sums and weight scales per 16 values

inline float f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

inline float bf16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

// One block's scalars in the int8 arithmetic's terms (see the header; the u come from the format's `chunk`, 32
// at a time, in registers); groups past qk / 16 are unused.
struct Unpacked {
    int16_t sc[QK_K / GROUP];
    alignas(32) int16_t off[QK_K / GROUP];  // (16-bit: a K-quant block's 16 terms in one vpmaddwd)
    alignas(32) int16_t mn[QK_K / GROUP];
    float d, dm;
};

// pshufb masks that give chunk c (values 32 c .. 32 c + 31) its scales from a block's 16 group scales (int16) held
// in both 128-bit lanes (groups 0-7 for c < 4, 8-15 after): bytes 0-15 group 2c's, bytes 16-31 group 2c + 1's.
struct ChunkScaleMasks {
    alignas(32) uint8_t m[QK_K / 32][32];
};
constexpr ChunkScaleMasks chunk_scale_masks() {
    ChunkScaleMasks t{};
    for (int c = 0; c < QK_K / 32; c++)
        for (int i = 0; i < 16; i++) {
            t.m[c][i] = (uint8_t)(2 * ((2 * c) % 8) + (i & 1));
            t.m[c][16 + i] = (uint8_t)(2 * ((2 * c + 1) % 8) + (i & 1));
        }
    return t;
}
inline constexpr ChunkScaleMasks CHUNK_SCALE_MASKS = chunk_scale_masks();

// A block's group scales (Unpacked::sc) as the two lane-duplicated halves chunk_scale reads.
struct BlockScales {
    __m256i lo, hi;
    explicit BlockScales(const int16_t *sc) : BlockScales(_mm256_loadu_si256((const __m256i *)sc)) {}
    explicit BlockScales(__m256i v) : lo(_mm256_permute4x64_epi64(v, 0x44)), hi(_mm256_permute4x64_epi64(v, 0xEE)) {}
    // chunk c's scales as vpmaddwd's operand: 16-bit lanes 0-7 group 2c's, 8-15 group 2c + 1's (one pshufb, where
    // building them from two scalars took four operations a chunk)
    __m256i chunk(int c) const {
        return _mm256_shuffle_epi8(c < 4 ? lo : hi, _mm256_load_si256((const __m256i *)CHUNK_SCALE_MASKS.m[c]));
    }
};

// A block's scalars as a tile reads them (linear.inc): `chunk(c)` (BlockScales::chunk), the 16 offset terms and the
// 16 min terms as int16 lanes (`off16`, `mn16`: what the activations' 16 group sums multiply), `d` and `dm`. A
// format names its view `Scales`; this one goes through the Unpacked a format's `unpack` fills (Q2_K's).
template <class F> struct UnpackedScales {
    BlockScales scales;
    const Unpacked &u;
    float d, dm;
    UnpackedScales(const uint8_t *b, Unpacked &un) : scales((F::unpack(b, un), un.sc)), u(un), d(un.d), dm(un.dm) {}
    __m256i chunk(int c) const { return scales.chunk(c); }
    __m256i off16() const { return _mm256_load_si256((const __m256i *)u.off); }
    __m256i mn16() const { return _mm256_load_si256((const __m256i *)u.mn); }
};

// the K-quants' 6-bit scales and mins, 8 of each in 12 bytes (gguf's Q4_K.get_scale_min)
inline void scale_min_k4(const uint8_t *s, int j, int &sc, int &mn) {
    if (j < 4) {
        sc = s[j] & 63;
        mn = s[j + 4] & 63;
    } else {
        sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 2) & 0x30);
        mn = (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
    }
}

// 32 nibbles of 16 bytes: low nibbles to bytes 0-15, high ones to 16-31
inline __m256i nibbles32(const uint8_t *b) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)b);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(15));
}

// 0x10 in byte l where bit l of the 32 bits at b is set (llama.cpp's bytes_from_bits_32)
inline __m256i high_bits32(const uint8_t *b) {
    uint32_t x;
    memcpy(&x, b, 4);
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)x), shuf);
    v = _mm256_or_si256(v, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    return _mm256_and_si256(_mm256_cmpeq_epi8(v, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(0x10));
}

// Q4_0: fp16 d, 16 bytes; byte l holds value l (low nibble) and l + 16 (high). w = d (q - 8).
struct Q4_0 {
    static constexpr int qk = 32, bytes = 18;
    static constexpr bool int8 = true, has_off = true, has_min = false;
    static constexpr int off = 8;
    static inline __m256i chunk(const uint8_t *b, int) { return nibbles32(b + 2); }
    static void dequant(const uint8_t *b, float *w) {
        alignas(32) uint8_t u[32];
        _mm256_store_si256((__m256i *)u, chunk(b, 0));
        const float d = f16(b);
        for (int l = 0; l < 32; l++) w[l] = d * (float)(u[l] - 8);
    }
};

// Q5_0: fp16 d, 32 high bits (bit l: value l's), 16 bytes of low nibbles as Q4_0's. w = d (q - 16).
struct Q5_0 {
    static constexpr int qk = 32, bytes = 22;
    static constexpr bool int8 = true, has_off = true, has_min = false;
    static constexpr int off = 16;
    // the 32 values' q (b: from the high bits on)
    static inline __m256i quants(const uint8_t *b) { return _mm256_or_si256(nibbles32(b + 4), high_bits32(b)); }
    static inline __m256i chunk(const uint8_t *b, int) { return quants(b + 2); }
    static void dequant(const uint8_t *b, float *w) {
        alignas(32) uint8_t u[32];
        _mm256_store_si256((__m256i *)u, quants(b + 2));
        const float d = f16(b);
        for (int l = 0; l < 32; l++) w[l] = d * (float)(u[l] - 16);
    }
};

// Q5_1: fp16 d, fp16 m, then Q5_0's bits. w = d q + m.
struct Q5_1 {
    static constexpr int qk = 32, bytes = 24;
    static constexpr bool int8 = true, has_off = false, has_min = true;
    static constexpr int off = 0;
    static inline __m256i chunk(const uint8_t *b, int) { return Q5_0::quants(b + 4); }
    static void dequant(const uint8_t *b, float *w) {
        alignas(32) uint8_t u[32];
        _mm256_store_si256((__m256i *)u, chunk(b, 0));
        const float d = f16(b), m = f16(b + 2);
        for (int l = 0; l < 32; l++) w[l] = d * (float)u[l] + m;
    }
};

// Q4_K's and Q5_K's shared header: fp16 d, fp16 dmin, then 8 sub-blocks' 6-bit scales and mins (12 bytes).
// w = (d sc_j) q - (dmin m_j), q the format's sub-block values (F::chunk).
template <class F> static void k4_dequant(const uint8_t *b, float *w) {
    const float d = f16(b), dmin = f16(b + 2);
    for (int j = 0; j < 8; j++) {
        int sc, mn;
        scale_min_k4(b + 4, j, sc, mn);
        const float ds = d * (float)sc, dm = dmin * (float)mn;
        alignas(32) uint8_t u[32];
        _mm256_store_si256((__m256i *)u, F::chunk(b, j));
        for (int l = 0; l < 32; l++) w[32 * j + l] = ds * (float)u[l] - dm;
    }
}

// pshufb masks over a Q4_K / Q5_K block's 8 scale (or min) bytes, held in every 64-bit lane: chunk c's scale in all
// 16 int16 lanes; and the 16 groups' mins (group j: sub-block j / 2's) as int16 lanes.
struct K4Masks {
    alignas(32) uint8_t chunk[8][32];
    alignas(32) uint8_t groups[32];
};
constexpr K4Masks k4_masks() {
    K4Masks t{};
    for (int i = 0; i < 32; i++) {
        for (int c = 0; c < 8; c++) t.chunk[c][i] = i & 1 ? 0x80 : (uint8_t)c;
        t.groups[i] = i & 1 ? 0x80 : (uint8_t)(4 * (i / 16) + (i % 16) / 4);  // (lane l of half h: 4h + l/2)
    }
    return t;
}
inline constexpr K4Masks K4_MASKS = k4_masks();

// Q4_K's and Q5_K's view (UnpackedScales' interface) straight from the header into registers: a decode step
// unpacks each block for one row, and the trip through Unpacked and BlockScales was about a quarter of it.
struct K4Scales {
    __m256i sc, mn;  // the 8 scales' / mins' bytes in every 64-bit lane
    float d, dm;
    K4Scales(const uint8_t *b, Unpacked &) {
        uint32_t t[3];
        memcpy(t, b + 4, 12);
        const uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, low2 = 0x03030303;  // llama.cpp's kmask arrangement
        const uint64_t s = t[0] & low6, s_hi = (t[2] & low4) | (((t[0] >> 6) & low2) << 4);         // scales 0-3, 4-7
        const uint64_t m = t[1] & low6, m_hi = ((t[2] >> 4) & low4) | (((t[1] >> 6) & low2) << 4);  // mins 0-3, 4-7
        sc = _mm256_set1_epi64x((long long)(s | s_hi << 32)), mn = _mm256_set1_epi64x((long long)(m | m_hi << 32));
        d = f16(b), dm = -f16(b + 2);
    }
    __m256i chunk(int c) const {
        return _mm256_shuffle_epi8(sc, _mm256_load_si256((const __m256i *)K4_MASKS.chunk[c]));
    }
    __m256i off16() const { return _mm256_setzero_si256(); }
    __m256i mn16() const { return _mm256_shuffle_epi8(mn, _mm256_load_si256((const __m256i *)K4_MASKS.groups)); }
};

// Q4_K: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes; sub-block j (32 values) is the low
// (j even) or high nibbles of bytes 32 (j / 2) .. + 31. w = (d sc_j) q - (dmin m_j).
struct Q4_K {
    static constexpr int qk = QK_K, bytes = 144;
    static constexpr bool int8 = true, has_off = false, has_min = true;
    static constexpr int scale_group = 32;  // values that share a scale
    static void dequant(const uint8_t *b, float *w) { k4_dequant<Q4_K>(b, w); }
    // sub-block j's 32 values
    static inline __m256i chunk(const uint8_t *b, int j) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * (j / 2)));
        return _mm256_and_si256(j & 1 ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(15));
    }
    using Scales = K4Scales;
};

// Q5_K: Q4_K's header, 32 bytes of high bits (bit j of byte l: value 32 j + l's), then Q4_K's 128 bytes.
struct Q5_K {
    static constexpr int qk = QK_K, bytes = 176;
    static constexpr bool int8 = true, has_off = false, has_min = true;
    static constexpr int scale_group = 32;  // values that share a scale
    static void dequant(const uint8_t *b, float *w) { k4_dequant<Q5_K>(b, w); }
    static inline __m256i chunk(const uint8_t *b, int j) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(b + 48 + 32 * (j / 2)));
        const __m256i lo = _mm256_and_si256(j & 1 ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(15));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16));
        const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(j)), _mm256_set1_epi8(1));
        return _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
    }
    using Scales = K4Scales;
};

// The K-quants with a signed scale a 16 values and no min (Q3_K, Q6_K: F gives `chunk` and `scale`):
// w = (d sc_j) (u - OFF) in gguf's order, d the fp16 at byte D_AT; in the int8 terms sc_j and off_j = OFF sc_j.
template <class F, int OFF, int D_AT> struct SignedScales16 {
    static void dequant(const uint8_t *b, float *w) {
        const float d = f16(b + D_AT);
        alignas(32) uint8_t u[32];
        for (int c = 0; c < 8; c++) {
            _mm256_store_si256((__m256i *)u, F::chunk(b, c));
            for (int g = 0; g < 2; g++) {
                const float ds = d * (float)F::scale(b, 2 * c + g);
                for (int l = 0; l < 16; l++) w[32 * c + 16 * g + l] = ds * (float)(u[16 * g + l] - OFF);
            }
        }
    }
    // the view (UnpackedScales' interface) in registers
    struct Scales {
        BlockScales scales;
        __m256i off;
        float d, dm = 0.f;
        Scales(const uint8_t *b, Unpacked &) : Scales(F::scales16(b), f16(b + D_AT)) {}
        Scales(__m256i sc, float d_) : scales(sc), off(_mm256_mullo_epi16(sc, _mm256_set1_epi16(OFF))), d(d_) {}
        __m256i chunk(int c) const { return scales.chunk(c); }
        __m256i off16() const { return off; }
        __m256i mn16() const { return _mm256_setzero_si256(); }
    };
};

// Q6_K: 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 int8 scales (one per 16 values), fp16 d.
// Value 128 h + r: low nibble of byte 64 h + r % 64 (shifted 4 (r / 64)), high bits 2 (r / 32) of byte
// 128 + 32 h + r % 32. w = (d sc_j) (q - 32).
struct Q6_K : SignedScales16<Q6_K, 32, 208> {
    static constexpr int qk = QK_K, bytes = 210;
    static constexpr bool int8 = true, has_off = true, has_min = false;
    static constexpr int scale_group = 16;  // values that share a scale
    // values 32 c .. 32 c + 31
    static inline __m256i chunk(const uint8_t *b, int c) {
        const int h = c / 4, r = c % 4;
        const __m256i lo = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32 * (r & 1)));
        const __m256i hi = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
        const __m256i l4 = _mm256_and_si256(r & 2 ? _mm256_srli_epi16(lo, 4) : lo, _mm256_set1_epi8(15));
        const __m256i h2 = _mm256_and_si256(_mm256_srl_epi16(hi, _mm_cvtsi32_si128(2 * r)), _mm256_set1_epi8(3));
        return _mm256_or_si256(l4, _mm256_slli_epi16(h2, 4));
    }
    static int scale(const uint8_t *b, int j) { return (int8_t)b[192 + j]; }
    static inline __m256i scales16(const uint8_t *b) {
        return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 192)));
    }
};

// The 2-bit planes Q2_K and Q3_K share: 64 bytes whose bits 2 s of byte 32 h + l hold value 128 h + 32 s + l.
// Values 32 c .. 32 c + 31 (h = c / 4, s = c % 4).
inline __m256i plane2(const uint8_t *qs, int c) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * (c / 4)));
    return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(2 * (c % 4))), _mm256_set1_epi8(3));
}

// Q2_K: 16 bytes of scales (low nibble) and mins (high nibble), one pair a 16 values; 64 bytes of 2-bit quants
// (plane2); fp16 d, fp16 dmin. w = (d sc_j) q - (dmin m_j).
struct Q2_K {
    static constexpr int qk = QK_K, bytes = 84;
    static constexpr bool int8 = true, has_off = false, has_min = true;
    static constexpr int scale_group = 16;  // values that share a scale
    static inline __m256i chunk(const uint8_t *b, int c) { return plane2(b + 16, c); }
    static void dequant(const uint8_t *b, float *w) {
        const float d = f16(b + 80), dmin = f16(b + 82);
        alignas(32) uint8_t u[32];
        for (int c = 0; c < 8; c++) {
            _mm256_store_si256((__m256i *)u, chunk(b, c));
            for (int g = 0; g < 2; g++) {
                const int j = 2 * c + g;
                const float ds = d * (float)(b[j] & 15), dm = dmin * (float)(b[j] >> 4);
                for (int l = 0; l < 16; l++) w[32 * c + 16 * g + l] = ds * (float)u[16 * g + l] - dm;
            }
        }
    }
    using Scales = UnpackedScales<Q2_K>;
    static void unpack(const uint8_t *b, Unpacked &u) {
        const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)b));
        _mm256_storeu_si256((__m256i *)u.sc, _mm256_and_si256(v, _mm256_set1_epi16(15)));
        _mm256_store_si256((__m256i *)u.mn, _mm256_srli_epi16(v, 4));
        _mm256_store_si256((__m256i *)u.off, _mm256_setzero_si256());
        u.d = f16(b + 80), u.dm = -f16(b + 82);
    }
};

// Q3_K: 32 bytes of high bits (bit c of byte l: value 32 c + l's), 64 bytes of low 2 bits (plane2), 12 bytes of
// 16 six-bit scales (low nibbles in bytes 0-7, two high bits in bytes 8-11; minus 32), fp16 d.
// w = (d sc_j) (q - 4), q = low + 4 high (a clear high bit subtracts 4: gguf's Q3_K).
struct Q3_K : SignedScales16<Q3_K, 4, 108> {
    static constexpr int qk = QK_K, bytes = 110;
    static constexpr bool int8 = true, has_off = true, has_min = false;
    static constexpr int scale_group = 16;  // values that share a scale
    static inline __m256i chunk(const uint8_t *b, int c) {
        const __m256i hm = _mm256_loadu_si256((const __m256i *)b);
        const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(hm, _mm_cvtsi32_si128(c)), _mm256_set1_epi8(1));
        return _mm256_or_si256(plane2(b + 32, c), _mm256_slli_epi16(hi, 2));
    }
    static int scale(const uint8_t *b, int j) {
        const uint8_t *s = b + 96;
        const int lo = (s[j % 8] >> (4 * (j / 8))) & 15, hi = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
        return (lo | (hi << 4)) - 32;
    }
    // the 16 scales at once (llama.cpp's kmask arrangement): scales 0-3 take the low nibbles of bytes 0-3 and
    // bits 0-1 of bytes 8-11, 4-7 the low nibbles of bytes 4-7 and bits 2-3, 8-11 the high nibbles of bytes 0-3
    // and bits 4-5, 12-15 those of bytes 4-7 and bits 6-7. (Scalar stores read back as one vector missed store
    // forwarding: a one-row Q3_K call ran at 5.7 GB/s, a third of Q2_K's.)
    static inline __m256i scales16(const uint8_t *b) {
        uint32_t a[3];
        memcpy(a, b + 96, 12);
        const uint32_t low4 = 0x0f0f0f0f, low2 = 0x03030303;
        const __m128i u = _mm_setr_epi32((int)((a[0] & low4) | ((a[2] & low2) << 4)),
                                         (int)((a[1] & low4) | (((a[2] >> 2) & low2) << 4)),
                                         (int)(((a[0] >> 4) & low4) | (((a[2] >> 4) & low2) << 4)),
                                         (int)(((a[1] >> 4) & low4) | (((a[2] >> 6) & low2) << 4)));
        return _mm256_cvtepi8_epi16(_mm_sub_epi8(u, _mm_set1_epi8(32)));
    }
};

// Q4_1 and Q8_0 (dequantisation only: their linears run in the older kernel, gguf_kernel.cpp, with
// its AMX and repacked forms; this reads their rows for embedding lookups, bit for bit gguf's).
// Q4_1: fp16 d, fp16 m, 16 bytes as Q4_0's. w = d q + m.
struct Q4_1 {
    static constexpr int qk = 32, bytes = 20;
    static void dequant(const uint8_t *b, float *w) {
        alignas(32) uint8_t u[32];
        _mm256_store_si256((__m256i *)u, nibbles32(b + 4));
        const float d = f16(b), m = f16(b + 2);
        for (int l = 0; l < 32; l++) w[l] = d * (float)u[l] + m;
    }
};

// Q8_0: fp16 d, 32 int8 quants. w = q d.
struct Q8_0 {
    static constexpr int qk = 32, bytes = 34;
    static void dequant(const uint8_t *b, float *w) {
        const float d = f16(b);
        for (int l = 0; l < 32; l++) w[l] = (float)(int8_t)b[2 + l] * d;
    }
};

// F16 / BF16 tensors, read 32 values at a time: fp32 activations only (exact widening).
struct F16 {
    static constexpr int qk = 32, bytes = 64;
    static constexpr bool int8 = false, has_off = false, has_min = false;
    static void dequant(const uint8_t *b, float *w) {
        for (int c = 0; c < 4; c++)
            _mm256_storeu_ps(w + 8 * c, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + 16 * c))));
    }
};

struct BF16 {
    static constexpr int qk = 32, bytes = 64;
    static constexpr bool int8 = false, has_off = false, has_min = false;
    static void dequant(const uint8_t *b, float *w) {
        for (int c = 0; c < 4; c++) {
            const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(b + 16 * c)));
            _mm256_storeu_ps(w + 8 * c, _mm256_castsi256_ps(_mm256_slli_epi32(h, 16)));
        }
    }
};
}  // namespace sk
