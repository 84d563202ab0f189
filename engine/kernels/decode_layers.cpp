// A Llama-family decoder layer around its GGUF linears and its attention, in C++ (x86 AVX2 + FMA, fp32): the
// CPU's counterpart of a captured graph. Eager torch runs ~40 small ops a layer (norms, rotary, the KV write,
// residuals, the MLP gate, views and casts), each a dispatch from Python; at batch 1 on a 2-core host they cost
// as much as the weights' reads (~18 ms of a 42 ms SmolLM2 step, measured). Here a layer is two calls
// (`attention_in`, `attention_out_mlp`) around any attention, and a step the attention kernel takes (few positions
// a lane, or prompts of its sizes) is one call for the whole stack (`decode_stack`: the same phases and the kernel).
//
// Threads: one OpenMP region a call, its threads splitting every phase (a linear's weight rows, attention's
// items, the elementwise ops' rows) and meeting at a barrier between phases that spins briefly before it yields.
// A region a linear, with `OMP_WAIT_POLICY=PASSIVE` (which serving needs: spinning idle threads starve the other
// core), woke a sleeping thread at 0.2-0.3 ms a linear, as much as a small linear's work at one row; here a
// step wakes it once, and the spinning lasts only while both threads have work in the step.
//
// The GGUF linears (`gguf_kernel.cpp`, `kernels.cpp`) and the attention (`cpu_attention.cpp`) share this file's
// library (`library.cpp`): their range functions compute exactly the outputs their own entry points compute.
//
// Batch invariance: every op below computes a row on its own, in a fixed order, so a row's bits never depend on
// how many rows share the call, the threads, or whether the layer ran as one call or two:
//     rms_norm   ss = sum_i x_i^2 (8 lanes over chunks of 8 in index order, then a fixed horizontal sum);
//                r = 1 / sqrt(ss / H + eps);  y_i = (x_i * r) * w_i
//     rotary     (neox layout, half = D / 2)  y_i = x_i c_i - x_{i+half} s_i,  y_{i+half} = x_{i+half} c_{i+half}
//                + x_i s_{i+half}: each product rounded, then the sum (bitwise torch's x * cos + rotate_half(x) *
//                sin, built with -ffp-contract=off)
//     silu_mul   a_i = silu(g_i) * u_i, by the attention kernel's exp of a nonpositive argument (below)
//     residual   x_i + o_i (torch's add)

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <atomic>
#include <initializer_list>

// (library.cpp includes cpu_attention.cpp, gguf_kernel.cpp and kernels.cpp before this file)

extern "C" {
// One GGUF linear: blocks [n, k / 32] of GGML type `fmt` (gguf_kernel's numbering), an fp32 bias [n] or null;
// packed: the blocks repacked by gguf_amx_pack or gguf_lanes_pack, which the AMX and lanes formats read (null
// otherwise; prompt rows read blocks).
struct Linear {
    const uint8_t *blocks;
    const float *bias;
    int64_t n, k, fmt;
    const uint8_t *packed;
    const Linear *rest;  // the kernel layer's formats: the next rows' linear (a merged projection of several
                         // formats: a Q4_K_M file's q and k in Q4_K, v in Q6_K), or null
};

// A linear's rows: its own and its `rest`'s.
inline int64_t total_rows(const Linear &l) {
    int64_t n = 0;
    for (const Linear *s = &l; s; s = s->rest) n += s->n;
    return n;
}

// Thread t's rows of a table linear, split by weight bytes: a merged projection's parts differ in bytes a row (a
// Q4_K_M file's q and k in Q4_K, v in Q6_K: 144 and 210 bytes a block), and a decode step's linear reads its weights
// once, so its time follows their bytes. Row r goes to the thread whose byte share its first byte falls in.
inline void byte_share(const Linear &l, int t, int nt, int64_t &a, int64_t &b) {
    auto row_bytes = [](const Linear *s) {
        const sk::Kernel &k = *sk::from_handle(s->fmt);
        return s->k / k.qk * k.bytes;
    };
    int64_t total = 0;
    for (const Linear *s = &l; s; s = s->rest) total += s->n * row_bytes(s);
    auto rows_before = [&](int64_t at) {  // rows whose first byte lies before byte `at`
        int64_t rows = 0, bytes = 0;
        for (const Linear *s = &l; s; s = s->rest) {
            const int64_t rb = row_bytes(s);
            if (at <= bytes + s->n * rb) return rows + (at - bytes + rb - 1) / rb;
            rows += s->n, bytes += s->n * rb;
        }
        return rows;
    };
    a = rows_before(total * t / nt), b = rows_before(total * (t + 1) / nt);
}

struct Layer {
    const float *norm_in, *norm_post;  // [hidden] RMSNorm weights
    Linear qkv, o, gate_up, down;      // q/k/v and gate/up merged, rows in that order
};

struct Shape {
    int64_t hidden, heads, kv_heads, head_dim, inter;
    float eps, scale;
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

constexpr int SPINS = 1 << 12;  // pauses at a barrier before yielding the core (~0.1 ms)
// Up to this many rows, every thread computes an RMS norm's rows and the MLP gate's (silu(gate) * up) whole, into
// rows of its own, and its next linear reads them there: no barrier between the op and the linear (3 of a layer's 9
// go), for a few microseconds of arithmetic repeated. Calls of more rows, or whose threads' own rows would pass
// OWN_FLOATS (many threads, a wide model), split those rows and meet at a barrier. Same bits either way. Where
// they cross (rdtsc marks per phase in SmolLM2's steps, 2 threads, AMX host; thousands of cycles a step for the
// two norms and the gate, barriers included, own / split): 2 rows 293 / 310, 3 rows 378 / 433, 4 rows 542 / 453,
// 5 rows 572 / 423, and 3.65 M / 1.93 M at a batch-8 verify step's 40 (a limit of 64 rows repeated all of that).
constexpr int64_t OWN_ROWS = 3, OWN_FLOATS = 1 << 20;

// Threads meet here between phases: spin (the other thread is mid-phase, microseconds away), then yield.
class Barrier {
   public:
    void join(int threads) { n_.store(threads, std::memory_order_relaxed); }  // every thread, same count
    void wait() {
        const int n = n_.load(std::memory_order_relaxed);
        if (n == 1) return;
        const int phase = phase_.load(std::memory_order_acquire);
        if (arrived_.fetch_add(1, std::memory_order_acq_rel) == n - 1) {
            arrived_.store(0, std::memory_order_relaxed);
            phase_.store(phase + 1, std::memory_order_release);
            return;
        }
        for (int spins = 0; phase_.load(std::memory_order_acquire) == phase; spins++) {
            if (spins < SPINS) _mm_pause();
            else sched_yield();
        }
    }

   private:
    std::atomic<int> n_{1}, arrived_{0}, phase_{0};
};

// Thread t's share [a, b) of n items.
struct Range {
    int64_t a, b;
    Range(int64_t n, int t, int nt) : a(n * t / nt), b(n * (t + 1) / nt) {}
};

void rms_norm(const float *x, const float *w, float *y, Range rows, int64_t H, float eps) {
    for (int64_t r = rows.a; r < rows.b; r++) {
        const float *xr = x + r * H;
        float *yr = y + r * H;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t i = 0; i < H; i += 8) {
            const __m256 v = _mm256_loadu_ps(xr + i);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        const __m256 inv = _mm256_set1_ps(1.0f / sqrtf(cpu_attention_kernel::hsum(acc) / (float)H + eps));
        for (int64_t i = 0; i < H; i += 8)
            _mm256_storeu_ps(yr + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + i), inv),
                                                   _mm256_loadu_ps(w + i)));
    }
}

// Rotate the first `heads` heads of D of each row (row stride `stride`) in place; cos / sin [M, D].
void rotary(float *x, Range rows, int64_t stride, int64_t heads, int64_t D, const float *cos, const float *sin) {
    const int64_t half = D / 2;
    for (int64_t r = rows.a; r < rows.b; r++) {
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

// gu [M, 2 * I] (gate then up) -> a [M, I]. silu(g) = g / (1 + e^-g) = g e^g / (1 + e^g): with t = e^-|g| (the
// attention kernel's exp of a nonpositive argument), g / (1 + t) for g >= 0 and g t / (1 + t) below. Outputs
// [i0, I) of each row: the 16-lane form below does the leading multiple of 16 where the CPU has AVX-512.
void silu_mul8(const float *gu, float *a, Range rows, int64_t I, int64_t i0) {
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (int64_t r = rows.a; r < rows.b; r++) {
        const float *g = gu + r * 2 * I, *u = g + I;
        float *ar = a + r * I;
        for (int64_t i = i0; i < I; i += 8) {  // (I: a multiple of 8, `layer_ok`)
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 neg = _mm256_cmp_ps(gv, zero, _CMP_LT_OQ);
            const __m256 t = cpu_attention_kernel::exp_nonpositive(_mm256_or_ps(gv, _mm256_set1_ps(-0.0f)));
            const __m256 num = _mm256_blendv_ps(gv, _mm256_mul_ps(gv, t), neg);
            const __m256 s = _mm256_div_ps(num, _mm256_add_ps(one, t));
            _mm256_storeu_ps(ar + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
        }
    }
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx512bw,avx512vl")
// The same operations in 16 lanes (each lane's bits are the 8-lane form's): a verify step's gate is 5-40 rows of
// SmolLM2's 1,536, where the 8-lane form took ~2.2 cycles an output (rdtsc marks, AMX host).
void silu_mul16(const float *gu, float *a, Range rows, int64_t I) {
    const __m512 one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps(), sign = _mm512_set1_ps(-0.0f);
    for (int64_t r = rows.a; r < rows.b; r++) {
        const float *g = gu + r * 2 * I, *u = g + I;
        float *ar = a + r * I;
        for (int64_t i = 0; i + 16 <= I; i += 16) {
            const __m512 gv = _mm512_loadu_ps(g + i);
            const __mmask16 neg = _mm512_cmp_ps_mask(gv, zero, _CMP_LT_OQ);
            const __m512 t = cpu_attention_kernel::exp_nonpositive16(_mm512_or_ps(gv, sign));
            const __m512 num = _mm512_mask_blend_ps(neg, gv, _mm512_mul_ps(gv, t));
            const __m512 s = _mm512_div_ps(num, _mm512_add_ps(one, t));
            _mm512_storeu_ps(ar + i, _mm512_mul_ps(s, _mm512_loadu_ps(u + i)));
        }
    }
}
#pragma GCC pop_options

// wide = false: the 8-lane form on an AVX-512 CPU too (`silu_mul_rows`: tests compare the forms)
void silu_mul(const float *gu, float *a, Range rows, int64_t I, bool wide = true) {
    int64_t done = 0;
    if (wide && cpu_attention_kernel::avx512_cpu()) {
        silu_mul16(gu, a, rows, I);
        done = I / 16 * 16;
    }
    if (done < I) silu_mul8(gu, a, rows, I, done);
}

// The memory a call's buffers take, kept by the calling thread for its next calls, up to KEEP bytes (grown to the
// largest call's, as a caching allocator keeps it); a larger call allocates for itself and frees after. Freshly
// allocated each call, a prompt's buffers (tens of MB at 1,024 rows) came from new pages every time: a 1,024-row
// SmolLM2 prefill spent about a quarter of its time in the kernel's page faults (perf). One per calling thread:
// the engine's steps and a scheduler thread may call.
struct Scratch {
    static constexpr size_t KEEP = (size_t)64 << 20;  // a batch-8 SmolLM2 prefill of 128-token prompts: ~37 MB
    void *mem = nullptr;
    size_t bytes = 0;
    ~Scratch() { free(mem); }
    void *get(size_t want) {
        if (want > bytes) {
            free(mem);
            want = (want + 4095) / 4096 * 4096;
            mem = aligned_alloc(64, want);
            bytes = mem ? want : 0;
        }
        return mem;
    }
};
thread_local Scratch scratch;

// Whether a table linear of layers [0, n) rounds its input rows to bf16 (the bf16 arithmetic: `Buffers` sizes each
// thread's scratch for them only then).
bool bf16_rows(const Layer *layers, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        for (const Linear *l : {&layers[i].qkv, &layers[i].o, &layers[i].gate_up, &layers[i].down})
            for (const Linear *p = l; p; p = p->rest) {
                const sk::Kernel *k = sk::from_handle(p->fmt);
                if (k && k->bf16) return true;
            }
    return false;
}

// A call's buffers: shared ones [M, width], each thread's scratch (a linear's block sums and GEMM panel,
// attention's slots and scores, the kernel rows of a call that mixes prompt rows with others), and the list of
// those kernel rows, in one allocation.
struct Buffers {
    float *h, *qkv, *q, *out, *gu, *a;
    float *xsum, *panel, *scores, *xk, *yk, *own_h, *own_a, *xb, *xq, *xg;
    int64_t *slots, *kernel_rows, *gemm_index;
    int64_t xsum_n, panel_n, scores_n, slots_n, xk_n, yk_n, own_h_n, own_a_n, xb_n, xq_n, xg_n;
    bool own;  // every thread computes a norm's and the MLP gate's rows whole, into its own rows (OWN_ROWS)
    int64_t gemm_rows = 0, n_kernel = 0;  // rows the GEMM computes (0: none), rows the kernel computes
    // the call's flags: 1 (each linear's prompt GEMM: the fp32 one, or the kernel layer's own) and 2 (for AMX-format
    // linears the AMX-BF16 form: per call, a model's prompt rows take one kind); a call with both is refused
    // (`gemm_flags_ok`)
    bool gemm_fp32 = false, gemm_bf16 = false;
    bool owned = false;  // mem is the call's own (larger than Scratch::KEEP), freed with it
    // a table linear found its thread's scratch (xsum_n floats) smaller than its rows need: it computed nothing, and
    // the call returns -3 (a sizing bug, reported rather than written past)
    std::atomic<bool> short_scratch{false};
    void *mem;

    // gemm: [M] uint8, the rows that take the prompt GEMM (1; 2: its AMX-BF16 form for AMX-format linears), or
    // null (none)
    // q_rows: the most query rows a lane has (attention's scores), 0 where the call does not attend
    // rounds: a linear of the layers rounds its input rows to bf16 (its scratch: 2 bytes a value, `bf16_rows`)
    Buffers(const Shape *s, int64_t M, int threads, int64_t most_keys, int64_t q_rows, const uint8_t *gemm,
            bool rounds)
        : mem(nullptr) {
        const int64_t D = s->head_dim, qn = s->heads * D, width = qn + 2 * s->kv_heads * D;
        auto most = [](int64_t a, int64_t b, int64_t c) { return a > b ? (a > c ? a : c) : (b > c ? b : c); };
        const int64_t widest = most(s->hidden, s->inter, qn);  // a linear's input width: o_proj's is qn
        const int64_t widest_out = most(width, 2 * s->inter, s->hidden);
        if (gemm)
            for (int64_t r = 0; r < M; r++) gemm_rows += gemm[r] != 0, gemm_fp32 |= gemm[r] == 1, gemm_bf16 |= gemm[r] == 2;
        n_kernel = gemm_rows ? M - gemm_rows : M;
        const int64_t mixed = gemm_rows && n_kernel;
        auto up = [](int64_t n) { return (n + 7) / 8 * 8; };  // whole 32-byte lines: every buffer stays aligned
        // (a table linear's scratch too: sk::scratch_bytes, within the block sums' but for bf16 rows)
        const int64_t sums = gguf_kernel::xsum_floats(M, widest), rounded = rounds ? (M * widest + 1) / 2 : 0;
        xsum_n = up(sums > rounded ? sums : rounded);
        // (the bf16 panel is as large: 32 outputs x 2 bytes a k against 16 x 4; the int8 GEMM's panels smaller)
        panel_n = gemm_rows ? up(gguf_kernel::panel_floats(widest)) : 0;
        // the prompt rows once for a table linear's prompt GEMM (shared): quantised per 256 values for the K-quants'
        // int8 one (sk::quantize_row's), or rounded to bf16 for BF16's
        // (2 bytes a value: more than int8's 1 and its scales and sums, at most 1/4 a value)
        xg_n = gemm_rows ? up((gemm_rows * widest + 1) / 2) : 0;
        if (gemm_rows) {
            const int64_t panels = (sk::bf16dot::gemm_scratch_bytes(widest) + 3) / 4;  // the largest GEMM's panels
            panel_n = up(panel_n > panels ? panel_n : panels);
        }
        xb_n = gemm_bf16 ? up((M * widest + 1) / 2) : 0;  // a linear's input rows as bf16 (shared)
        scores_n = most_keys ? up(cpu_attention_kernel::scores_floats(s->heads / s->kv_heads, q_rows, most_keys)) : 0;
        slots_n = most_keys ? up(most_keys + 1) : 0;
        xk_n = mixed ? up(n_kernel * widest) : 0;
        yk_n = mixed ? up(n_kernel * widest_out) : 0;
        own = M <= OWN_ROWS && threads * M * (s->hidden + s->inter) <= OWN_FLOATS;
        own_h_n = own ? up(M * s->hidden) : 0;
        own_a_n = own ? up(M * s->inter) : 0;
        // split rows (not own), no prompt GEMM: an int8 linear's input rows quantised once, a share a thread
        const int64_t quantized = s->hidden > s->inter ? s->hidden : s->inter;  // the norms' rows, the gate's
        xq_n = !own && !gemm_rows ? up(gguf_kernel::xsum_floats(M, quantized)) : 0;
        const int64_t shared = up(M * s->hidden) + up(M * width) + 2 * up(M * qn) + up(M * 2 * s->inter) +
                               up(M * s->inter) + 2 * up(mixed ? n_kernel : 0) +  // kernel_rows: int64
                               2 * up(gemm_rows) + xg_n;  // gemm_index: int64
        // an int64 is 2 floats
        const int64_t floats =
            shared + xb_n + xq_n +
            threads * (xsum_n + panel_n + scores_n + slots_n * 2 + xk_n + yk_n + own_h_n + own_a_n);
        const size_t bytes = sizeof(float) * (size_t)floats;
        owned = bytes > Scratch::KEEP;
        mem = owned ? aligned_alloc(64, (bytes + 63) / 64 * 64) : scratch.get(bytes);
        if (!mem) return;
        float *p = (float *)mem;
        h = p, p += up(M * s->hidden);
        qkv = p, p += up(M * width);
        q = p, p += up(M * qn);
        out = p, p += up(M * qn);
        gu = p, p += up(M * 2 * s->inter);
        a = p, p += up(M * s->inter);
        kernel_rows = (int64_t *)p, p += 2 * up(mixed ? n_kernel : 0);
        gemm_index = (int64_t *)p, p += 2 * up(gemm_rows);
        xg = p, p += xg_n;
        xsum = p, p += threads * xsum_n;
        panel = p, p += threads * panel_n;
        scores = p, p += threads * scores_n;
        xk = p, p += threads * xk_n;
        yk = p, p += threads * yk_n;
        own_h = p, p += threads * own_h_n;
        own_a = p, p += threads * own_a_n;
        xb = p, p += xb_n;
        xq = p, p += xq_n;
        slots = (int64_t *)p;
        if (mixed)
            for (int64_t r = 0, i = 0; r < M; r++)
                if (!gemm[r]) kernel_rows[i++] = r;
        if (gemm_rows)
            for (int64_t r = 0, i = 0; r < M; r++)
                if (gemm[r]) gemm_index[i++] = r;
    }
    ~Buffers() {
        if (owned) free(mem);
    }
    Buffers(const Buffers &) = delete;
    Buffers &operator=(const Buffers &) = delete;
    // whether the call's prompt-row flags can run: one kind a call, and the AMX-BF16 form only where it may run
    bool gemm_flags_ok() const { return !(gemm_fp32 && gemm_bf16) && (!gemm_bf16 || gguf_kernel::bf16_tiles_ok()); }
};

// The rows of a call that mixes prompt rows with others which the kernel computes (gathered), over a table linear's
// part `s`'s weight rows [a, b), after its prompt GEMM has written the prompt rows.
void kernel_rows(const sk::Kernel &k, const Linear &s, const float *in, int64_t N, float *y, int64_t a, int64_t b,
                 Buffers &buf, int t) {
    if (!buf.n_kernel) return;
    float *xk = buf.xk + t * buf.xk_n, *yk = buf.yk + t * buf.yk_n;
    for (int64_t i = 0; i < buf.n_kernel; i++) memcpy(xk + i * s.k, in + buf.kernel_rows[i] * s.k, sizeof(float) * s.k);
    sk::linear_range(k, xk, buf.n_kernel, s.k, s.blocks, N, s.bias, yk, a, b, buf.xsum + t * buf.xsum_n);
    for (int64_t i = 0; i < buf.n_kernel; i++)
        memcpy(y + buf.kernel_rows[i] * N + a, yk + i * N + a, sizeof(float) * (b - a));
}

// Weight rows [a, b) of a table linear's part `s` (fp32 arithmetic) for M rows, y's rows N apart: the prompt GEMM over
// its format's dequantised panels (gguf's bits: the fp32 weights the kernel's arithmetic multiplies) for every row,
// then the rows the kernel computes (gathered) overwrite theirs, as `linear` does for the older kernel's formats.
// At 128-512 prompt rows of a bf16 SmolLM2 folder the kernel's two 8-lane chains a row ran at ~35 GMAC/s.
void table_gemm(const sk::Kernel &k, const Linear &s, const float *in, int64_t M, int64_t N, float *y, int64_t a,
                int64_t b, Buffers &buf, int t) {
    gguf_kernel::gemm_panels(in, M, s.k, N, s.bias, y, a, b, buf.panel + t * buf.panel_n,
                             [&](int64_t n, int64_t nb, float *P) {
                                 gguf_kernel::pack_panel_dequant(k.dequant, k.qk, k.bytes, s.blocks, s.k, n, nb, P);
                             });
    kernel_rows(k, s, in, N, y, a, b, buf, t);
}

// A table linear's prompt GEMM (the kernel layer's own: Kernel::gemm, bf16_gemm) for this call's prompt rows: int8
// over rows quantised per `qk` values, or bf16, by the first part that has one (a part of another kind or block
// takes its kernel for every row); kind NO_GEMM where none does.
enum GemmKind { NO_GEMM = 0, INT8_GEMM = 1, BF16_GEMM = 2 };
struct OwnGemm {
    GemmKind kind;
    int qk;
    bool takes(const sk::Kernel &k) const { return kind == INT8_GEMM ? k.gemm && k.qk == qk : kind && k.bf16_gemm; }
};
OwnGemm own_gemm(const Linear &l, const Buffers &buf) {
    if (!buf.gemm_rows || !buf.xg_n) return {NO_GEMM, 0};
    for (const Linear *s = &l; s; s = s->rest) {
        const sk::Kernel &k = *sk::from_handle(s->fmt);
        if (k.gemm) return {INT8_GEMM, k.qk};
        if (k.bf16_gemm) return {BF16_GEMM, 0};
    }
    return {NO_GEMM, 0};
}

// The call's prompt rows of `in` into buf.xg as `own` reads them (quantised per block, or rounded to bf16), a share
// a thread; every thread's linear reads them once the barrier has passed (the barrier after the previous linear kept
// its readers of buf.xg apart from these writes).
void prepare_gemm_rows(OwnGemm own, const float *in, int64_t K, Buffers &buf, Barrier &bar, int t, int nt) {
    const Range rows(buf.gemm_rows, t, nt);
    if (own.kind == INT8_GEMM) {
        const sk::XQ xg = sk::xq_view(buf.xg, buf.gemm_rows, K, own.qk);
        for (int64_t i = rows.a; i < rows.b; i++) sk::quantize_into(in + buf.gemm_index[i] * K, xg, i);
    } else {
        for (int64_t i = rows.a; i < rows.b; i++)
            sk::bf16dot::round_into(in + buf.gemm_index[i] * K, (uint16_t *)buf.xg, K, i);
    }
    bar.wait();
}

// A table linear's part that `own` takes: the GEMM over the prompt rows, which buf.xg holds as it reads them
// (`prepare_gemm_rows`), then the kernel's rows.
void table_own_gemm(OwnGemm own, const sk::Kernel &k, const Linear &s, const float *in, int64_t N, float *y, int64_t a,
                    int64_t b, Buffers &buf, int t) {
    void *panels = buf.panel + t * buf.panel_n;
    if (own.kind == INT8_GEMM)
        k.gemm(sk::xq_view(buf.xg, buf.gemm_rows, s.k, own.qk), buf.gemm_rows, buf.gemm_index, s.blocks, N, s.bias,
               y, a, b, panels);
    else
        k.bf16_gemm((const uint16_t *)buf.xg, buf.gemm_rows, buf.gemm_index, s.k, s.blocks, N, s.bias, y, a, b, panels);
    kernel_rows(k, s, in, N, y, a, b, buf, t);
}

// Thread t's weight rows of `l` times in [M, l.k] -> y [M, l.n]; with `residual`, then x += y on those columns.
// Rows the call marked for the prompt GEMM take it; the others the kernel (gathered, when a call has both: the fp32
// GEMM runs over every row, then the kernel's rows overwrite theirs; the kernel layer's own GEMMs over the marked rows
// alone). `xq`: in's rows quantised already (an int8 format, `quantized_share`), where each thread would quantise
// every row itself.
void linear(const Linear &l, const float *in, int64_t M, float *y, float *residual, Buffers &buf, Barrier &bar, int t,
            int nt, const gguf_kernel::XQ8 *xq = nullptr) {
    Range cols(l.n, t, nt);
    if (sk::from_handle(l.fmt)) {  // the kernel layer's table: every row, each part in its own format and arithmetic
        // (int8 rows quantise `in` into the thread's scratch, bf16 rows round it: sk::scratch_bytes, within xsum_n)
        const int64_t N = total_rows(l);
        byte_share(l, t, nt, cols.a, cols.b);
        const OwnGemm own = own_gemm(l, buf);
        if (own.kind) prepare_gemm_rows(own, in, l.k, buf, bar, t, nt);
        int64_t first = 0;
        for (const Linear *s = &l; s; first += s->n, s = s->rest) {
            const int64_t a = cols.a > first ? cols.a : first, b = cols.b < first + s->n ? cols.b : first + s->n;
            const sk::Kernel &k = *sk::from_handle(s->fmt);
            if (a < b && (sk::scratch_bytes(k, M, s->k) > (int64_t)sizeof(float) * buf.xsum_n ||
                          (own.takes(k) && sk::gemm_panel_bytes(k, s->k) > (int64_t)sizeof(float) * buf.panel_n))) {
                buf.short_scratch = true;
                continue;
            }
            if (a < b && own.takes(k))
                table_own_gemm(own, k, *s, in, N, y + first, a - first, b - first, buf, t);
            else if (a < b && buf.gemm_rows && k.fp32)
                table_gemm(k, *s, in, M, N, y + first, a - first, b - first, buf, t);
            else if (a < b)
                sk::linear_range(k, in, M, s->k, s->blocks, N, s->bias, y + first, a - first, b - first,
                                 buf.xsum + t * buf.xsum_n);
        }
        if (residual)
            for (int64_t r = 0; r < M; r++)
                for (int64_t n = cols.a; n < cols.b; n++) residual[r * N + n] += y[r * N + n];
        return;
    }
    const bool amx = l.fmt & gguf_kernel::FMT_AMX;
    if (amx) {  // whole 16-row groups: the tiles' unit
        const Range g(gguf_kernel::amx_groups(l.n), t, nt);
        cols.a = g.a * 16 < l.n ? g.a * 16 : l.n, cols.b = g.b * 16 < l.n ? g.b * 16 : l.n;
    }
    const uint8_t *w = l.fmt & (gguf_kernel::FMT_AMX | gguf_kernel::FMT_LANES) ? l.packed : l.blocks;
    float *xsum = buf.xsum + t * buf.xsum_n;
    if (buf.gemm_rows && buf.gemm_bf16 && amx && !(l.fmt & gguf_kernel::FMT_LANES)) {
        // every thread rounds its share of the rows to bf16, then each multiplies all of them by its weights
        const Range rows(M, t, nt);
        uint16_t *xb = (uint16_t *)buf.xb;
        gguf_kernel::bf16_rows(in + rows.a * l.k, rows.b - rows.a, l.k, xb + rows.a * l.k);
        bar.wait();
        gguf_kernel::bf16_gemm_range(xb, M, l.k, l.packed, l.n, (int)(l.fmt & 1), l.bias, y, cols.a, cols.b,
                                     (uint16_t *)(buf.panel + t * buf.panel_n));
    } else if (buf.gemm_rows)
        gguf_kernel::gemm_range(in, M, l.k, l.blocks, l.n, (int)l.fmt, l.bias, y, cols.a, cols.b,
                                buf.panel + t * buf.panel_n);
    if (!buf.gemm_rows && xq) {
        gguf_kernel::linear_range_xq(*xq, M, l.k, w, l.n, (int)l.fmt, l.bias, y, cols.a, cols.b);
    } else if (!buf.gemm_rows) {
        gguf_kernel::linear_range(in, M, l.k, w, l.n, (int)l.fmt, l.bias, y, cols.a, cols.b, xsum);
    } else if (buf.n_kernel) {
        float *xk = buf.xk + t * buf.xk_n, *yk = buf.yk + t * buf.yk_n;
        for (int64_t i = 0; i < buf.n_kernel; i++)
            memcpy(xk + i * l.k, in + buf.kernel_rows[i] * l.k, sizeof(float) * l.k);
        gguf_kernel::linear_range(xk, buf.n_kernel, l.k, w, l.n, (int)l.fmt, l.bias, yk, cols.a, cols.b,
                                  xsum);
        for (int64_t i = 0; i < buf.n_kernel; i++)
            memcpy(y + buf.kernel_rows[i] * l.n + cols.a, yk + i * l.n + cols.a, sizeof(float) * (cols.b - cols.a));
    }
    if (residual)
        for (int64_t r = 0; r < M; r++)
            for (int64_t n = cols.a; n < cols.b; n++) residual[r * l.n + n] += y[r * l.n + n];
}

// One layer's K and V caches, [num_slots, kv_heads, D]: fp32, or bf16 (`--kv-cache-dtype bfloat16`).
struct Caches {
    void *k, *v;
    bool bf16;
};

// fp32 -> bf16 as torch's `.to(torch.bfloat16)` rounds (to nearest, ties to even), so a cache the C++ layers write
// holds the bits the torch layers' index_copy_ writes; a NaN becomes c10::BFloat16's 0x7FC0 (torch's vector path
// writes 0xFFFF: a NaN either way).
inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// n values of src into slot `slot`'s row of a cache (rows of n values)
inline void store_row(void *cache, bool bf16, int64_t slot, const float *src, int64_t n) {
    if (!bf16) {
        memcpy((float *)cache + slot * n, src, sizeof(float) * n);
        return;
    }
    uint16_t *dst = (uint16_t *)cache + slot * n;
    for (int64_t i = 0; i < n; i++) dst[i] = to_bf16(src[i]);
}

// Where a linear of an int8 format takes rows the threads split (buf.xq: split rows, no prompt GEMM), thread t
// quantises its share of them (`rows`) into buf.xq as the linear would each of them, and returns the view every
// thread's linear then reads, once the barrier after the rows' own phase has passed (the rows are the phase's
// output: a norm's, the MLP gate's). Without it each thread quantised every row for each of these linears: at a
// batch-8 verify step's 40 rows about 8% of a step's thread time (perf). Null where it does not apply.
const gguf_kernel::XQ8 *quantized_share(const Linear &l, const float *in, int64_t M, Range rows, Buffers &buf,
                                        gguf_kernel::XQ8 &view) {
    if (!buf.xq || !buf.xq_n || sk::from_handle(l.fmt) || !(l.fmt & gguf_kernel::FMT_INT8)) return nullptr;
    view = gguf_kernel::xq8_view(buf.xq, M, l.k);
    for (int64_t r = rows.a; r < rows.b; r++) gguf_kernel::quantize_row(in, view, r);
    return &view;
}

// x -> norm -> qkv -> rotary; keys and values into the caches at `slots`, queries into buf.q; buf.out zeroed.
void phase_in(const Shape *s, const Layer *L, const float *x, int64_t M, const float *cos, const float *sin,
              const int64_t *slots, Caches c, Buffers &buf, Barrier &bar, int t, int nt) {
    const int64_t D = s->head_dim, qn = s->heads * D, kvn = s->kv_heads * D, width = qn + 2 * kvn;
    const Range rows(M, t, nt);
    float *h = buf.own ? buf.own_h + t * buf.own_h_n : buf.h;
    rms_norm(x, L->norm_in, h, buf.own ? Range(M, 0, 1) : rows, s->hidden, s->eps);
    gguf_kernel::XQ8 view;
    const gguf_kernel::XQ8 *xq = quantized_share(L->qkv, h, M, rows, buf, view);  // (never with own rows)
    if (!buf.own) bar.wait();
    linear(L->qkv, h, M, buf.qkv, nullptr, buf, bar, t, nt, xq);
    bar.wait();
    rotary(buf.qkv, rows, width, s->heads + s->kv_heads, D, cos, sin);
    for (int64_t r = rows.a; r < rows.b; r++) {
        const float *row = buf.qkv + r * width;
        memcpy(buf.q + r * qn, row, sizeof(float) * qn);
        // lanes that keep no K/V all write the dummy page's slot (never read as a key): the same bytes' last
        // writer wins, as with torch's index_copy_
        store_row(c.k, c.bf16, slots[r], row + qn, kvn);
        store_row(c.v, c.bf16, slots[r], row + qn + kvn, kvn);
        memset(buf.out + r * qn, 0, sizeof(float) * qn);  // rows no valid query writes (padding lanes) stay 0
    }
    bar.wait();
}

// units: this thread's share of (item, query row) units, cpu_attention's (`unit_share`)
template <class KV>
void attend_share(const Shape *s, const Paging *pg, const KV *k_cache, const KV *v_cache, int64_t most_keys,
                  Range units, Buffers &buf, int t) {
    cpu_attention_kernel::attend_units(units.a, units.b, buf.q, buf.out, k_cache, v_cache, pg->Q, s->heads,
                                       s->kv_heads, s->head_dim, pg->q_index, pg->q_valid, pg->q_pos, pg->kv_len,
                                       pg->table, pg->P, pg->page_size, s->scale, most_keys,
                                       buf.slots + t * buf.slots_n, buf.scores + t * buf.scores_n);
}

void phase_attention(const Shape *s, const Paging *pg, Caches c, int64_t most_keys, Range units, Buffers &buf,
                     Barrier &bar, int t) {
    if (c.bf16)
        attend_share(s, pg, (const cpu_attention_kernel::bf16_t *)c.k, (const cpu_attention_kernel::bf16_t *)c.v,
                     most_keys, units, buf, t);
    else
        attend_share(s, pg, (const float *)c.k, (const float *)c.v, most_keys, units, buf, t);
    bar.wait();
}

// x += o_proj(attn); x += down(silu(gate) * up) of post_attention_norm(x).
void phase_out(const Shape *s, const Layer *L, float *x, int64_t M, const float *attn, Buffers &buf, Barrier &bar,
               int t, int nt) {
    const Range rows(M, t, nt);
    linear(L->o, attn, M, buf.h, x, buf, bar, t, nt);
    bar.wait();
    const Range mine = buf.own ? Range(M, 0, 1) : rows;
    float *h = buf.own ? buf.own_h + t * buf.own_h_n : buf.h, *a = buf.own ? buf.own_a + t * buf.own_a_n : buf.a;
    rms_norm(x, L->norm_post, h, mine, s->hidden, s->eps);
    gguf_kernel::XQ8 view;
    const gguf_kernel::XQ8 *xq = quantized_share(L->gate_up, h, M, rows, buf, view);
    if (!buf.own) bar.wait();
    linear(L->gate_up, h, M, buf.gu, nullptr, buf, bar, t, nt, xq);
    bar.wait();
    silu_mul(buf.gu, a, mine, s->inter);
    xq = quantized_share(L->down, a, M, rows, buf, view);  // buf.xq's gate_up rows: read by all, a barrier ago
    if (!buf.own) bar.wait();
    linear(L->down, a, M, buf.h, x, buf, bar, t, nt, xq);
    bar.wait();
}

bool layer_ok(const Shape *s, const Layer *L) {
    const int64_t qn = s->heads * s->head_dim, width = qn + 2 * s->kv_heads * s->head_dim;
    auto ok = [](const Linear &l, int64_t n, int64_t k) {
        if (sk::from_handle(l.fmt)) {
            for (const Linear *s = &l; s; s = s->rest)
                if (!sk::from_handle(s->fmt) || s->k != k || k % sk::from_handle(s->fmt)->qk) return false;
            return total_rows(l) == n;
        }
        return l.n == n && l.k == k && l.k % 32 == 0 && gguf_kernel::fmt_ok(l.fmt, l.k) &&
               (!(l.fmt & (gguf_kernel::FMT_AMX | gguf_kernel::FMT_LANES)) || l.packed);
    };
    return s->hidden % 8 == 0 && s->inter % 8 == 0 && s->head_dim % 8 == 0 && s->head_dim <= 256 &&
           s->heads % s->kv_heads == 0 && ok(L->qkv, width, s->hidden) && ok(L->o, s->hidden, qn) &&
           ok(L->gate_up, 2 * s->inter, s->hidden) && ok(L->down, s->hidden, s->inter);
}

bool slots_ok(const int64_t *slots, int64_t M, int64_t num_slots) {
    for (int64_t r = 0; r < M; r++)
        if (slots[r] < 0 || slots[r] >= num_slots) return false;
    return true;
}
// One layer's phase over M rows in a parallel region (attention_in's, attention_out_mlp's): the call's buffers,
// the phase on every thread, then `done` with the buffers (what the caller copies out); their return codes.
template <class Phase, class Done>
int one_layer_phase(const Shape *s, const Layer *layer, int64_t M, const uint8_t *gemm_rows, int threads,
                    Phase phase, Done done) {
    if (!layer_ok(s, layer)) return -1;
    Buffers buf(s, M, threads, 0, 0, gemm_rows, bf16_rows(layer, 1));
    if (!buf.gemm_flags_ok()) return -1;
    if (!buf.mem) return -2;
    Barrier bar;
    #pragma omp parallel num_threads(threads)
    {
        bar.join(omp_get_num_threads());
        phase(buf, bar, omp_get_thread_num(), omp_get_num_threads());
    }
    if (buf.short_scratch) return -3;
    done(buf);
    return 0;
}

}  // namespace

extern "C" {
// The MLP gate alone, for tests: gu [M, 2 * I] -> a [M, I]; lanes 8: the 8-lane form, else the CPU's widest.
void silu_mul_rows(const float *gu, float *a, int64_t M, int64_t I, int lanes) {
    silu_mul(gu, a, Range(M, 0, 1), I, lanes != 8);
}

// fp32 -> bf16 as the caches are written (`to_bf16`), for tests: x [n] -> out [n] (bf16 bits).
void bf16_round_rows(const float *x, uint16_t *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = to_bf16(x[i]);
}

// x [M, hidden] (the residual stream, read) -> q [M, heads * D] rotated, and the rotated keys and the values
// written to k_cache / v_cache [num_slots, kv_heads, D] (fp32, or bf16 with kv_bf16) at slots [M]. gemm_rows [M]
// (uint8) or null: the rows whose linears take the prompt GEMM (1), or for AMX-format linears its AMX-BF16 form (2;
// one kind a call). Returns 0, -1 for a bad shape, slot or flags (both kinds, or AMX-BF16 where it cannot run), -2
// if scratch cannot be allocated, -3 if a linear's rows would not fit its thread's scratch (`Buffers::short_scratch`;
// attention_out_mlp and decode_stack return the same codes).
int attention_in(const Shape *s, const Layer *layer, const float *x, int64_t M, const float *cos, const float *sin,
                 const int64_t *slots, void *k_cache, void *v_cache, int64_t num_slots, float *q,
                 const uint8_t *gemm_rows, int kv_bf16, int threads) {
    if (!slots_ok(slots, M, num_slots)) return -1;
    return one_layer_phase(s, layer, M, gemm_rows, threads, [&](Buffers &buf, Barrier &bar, int t, int nt) {
        phase_in(s, layer, x, M, cos, sin, slots, Caches{k_cache, v_cache, kv_bf16 != 0}, buf, bar, t, nt);
    }, [&](Buffers &buf) { memcpy(q, buf.q, sizeof(float) * M * s->heads * s->head_dim); });
}

// x [M, hidden] += o_proj(attn); x += down(silu(gate) * up) of post_attention_norm(x). attn [M, heads * D];
// gemm_rows as attention_in's.
int attention_out_mlp(const Shape *s, const Layer *layer, float *x, int64_t M, const float *attn,
                      const uint8_t *gemm_rows, int threads) {
    return one_layer_phase(s, layer, M, gemm_rows, threads, [&](Buffers &buf, Barrier &bar, int t, int nt) {
        phase_out(s, layer, x, M, attn, buf, bar, t, nt);
    }, [](Buffers &) {});
}

// x [M, hidden] = the model's final RMS norm of x (weight w [hidden]), in place: the per-layer calls' last step
// (decode_stack's own ends with the same arithmetic).
void final_norm(const Shape *s, const float *w, float *x, int64_t M) {
    rms_norm(x, w, x, Range(M, 0, 1), s->hidden, s->eps);
}

// Every layer of a step whose attention runs in the C++ kernel (few positions a lane, or prompts it takes), in one
// region: per layer phase_in, attention over the paged caches, phase_out; then the model's final RMS norm (weight
// norm [hidden]). x [M, hidden] is updated in place: the normed final hidden states. gemm_rows and kv_bf16 as
// attention_in's (every layer's caches of the one dtype).
int decode_stack(const Shape *s, const Layer *layers, int64_t L, const float *norm, float *x, int64_t M,
                 const float *cos, const float *sin, const int64_t *slots, void *const *k_caches,
                 void *const *v_caches, int64_t num_slots, const Paging *pg, const uint8_t *gemm_rows, int kv_bf16,
                 int threads) {
    for (int64_t l = 0; l < L; l++)
        if (!layer_ok(s, layers + l)) return -1;
    const int64_t most_keys = cpu_attention_kernel::longest(pg->kv_len, pg->B);
    if (!slots_ok(slots, M, num_slots) || most_keys > pg->P * pg->page_size || pg->Q > M) return -1;
    for (int64_t i = 0; i < pg->B * pg->Q; i++)  // every query row names one of the call's rows
        if (pg->q_valid[i] && (pg->q_index[i] < 0 || pg->q_index[i] >= M)) return -1;
    Buffers buf(s, M, threads, most_keys, pg->Q, gemm_rows, bf16_rows(layers, L));
    if (!buf.gemm_flags_ok()) return -1;
    if (!buf.mem) return -2;
    Barrier bar;
    #pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        bar.join(nt);
        Range units(0, 0, 1);  // the same share every layer
        cpu_attention_kernel::unit_share(pg->B * s->kv_heads * pg->Q, pg->Q, s->kv_heads, pg->q_valid, pg->q_pos,
                                         pg->kv_len, t, nt, &units.a, &units.b);
        for (int64_t l = 0; l < L; l++) {
            const Caches c{k_caches[l], v_caches[l], kv_bf16 != 0};
            phase_in(s, layers + l, x, M, cos, sin, slots, c, buf, bar, t, nt);
            phase_attention(s, pg, c, most_keys, units, buf, bar, t);
            phase_out(s, layers + l, x, M, buf.out, buf, bar, t, nt);
        }
        rms_norm(x, norm, x, Range(M, t, nt), s->hidden, s->eps);  // a row at a time: in place is safe
    }
    return buf.short_scratch ? -3 : 0;
}
}
