// yirage CPU library kernels for LLM inference: linear layers on GGML-quantized weights
// (q4_1, q8_0) and on fp32 weights, embedding lookups, rotary position embedding (RoPE),
// causal grouped-query attention (GQA) with a KV cache (full or in a sliding window), and argmax.
//
// Built by yirage/runtime/toolchain.py (-O3 -march=native -fopenmp) and bound through
// ctypes by yirage/backends/cpu/native.py, whose SIGNATURES table lists every
// extern "C" entry point of the library (this file, library_quants.cpp, library_encoder.cpp). Pointers arrive as plain integers (tensor.data_ptr()),
// sizes as int64, floats as float.
//
// Rules for the kernels:
// - They never allocate, resize or free memory the caller owns: every input and output
//   buffer (the KV cache included) is allocated by the caller, contiguous and row-major.
//   The only memory a kernel allocates is its own per-thread scratch (thread_local
//   vectors, grown to the largest size seen and kept for the thread's lifetime).
// - They never call torch or Python. Shapes are the caller's job (checked when the graph is
//   built), but every run-time index (token ids, start_pos) is checked against the extent
//   of the buffer it indexes before any read or write: a bad one is recorded in the
//   caller's int64 status[4] = {1, value, lo, hi} (valid range [lo, hi)), the access is
//   skipped, and the executor raises IndexOutOfRangeError after the run.
// - SIMD code (AVX-512, AVX2/FMA/F16C) sits under #if defined(__AVX512F__) etc.; a
//   portable scalar version is always compiled when those macros are missing (ARM, old
//   x86), so the source builds for any target.
// - Quantized formats are GGML's (llama.cpp ggml-common.h), blocks of 32 weights:
//   q8_0 = 34 bytes {fp16 d; int8 q[32]}, w = d*q;
//   q4_1 = 20 bytes {fp16 d; fp16 m; uint8 qs[16]}, weight j is the low nibble of qs[j]
//   and weight j+16 its high nibble, w = d*q + m.
//   Dequantized weights equal gguf.quants.dequantize bitwise: d*q is exact in float32
//   (11-bit d times a <= 8-bit integer), so d*q + m rounds once whether fused or not.
//   Dot products accumulate in float32, in any order.
//
// Threads: yr_threads.h's loops and regions; with OpenMP, the omp_get_max_threads() of the
// process (torch's set_num_threads sets it too: torch and this library share libgomp), else
// yirage's own pool. Small problems run on the calling thread, because a parallel region
// costs microseconds.
//
// The kernels of this file are built on library_core.h; library_quants.cpp and
// library_encoder.cpp hold the rest of the library's entry points.

#include "library_core.h"

extern "C" {

// =================================================================================
// Linear layers: y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]); bias may be null.
// Quantized W: N rows of K/32 blocks (K % 32 == 0).
// =================================================================================

// The widest SIMD path this build compiled in (out[0]): 512 (AVX-512), 256 (AVX2/FMA/F16C),
// 128 (Arm NEON) or 0 (the portable scalar code). The target comes from the build flags
// (runtime/toolchain.py: -march=native, or YIRAGE_ISA's level), never from the CPU at run time.
void yr_simd_bits(int64_t* out) {
#if defined(YR_AVX512)
    out[0] = 512;
#elif defined(YR_AVX2)
    out[0] = 256;
#elif defined(__ARM_NEON)
    out[0] = 128;
#else
    out[0] = 0;
#endif
}

// Sets where prefetch_bytes prefetches: 0 L1, 1 L2; other values leave it unchanged. Not
// to be called while kernels run.
void yr_set_prefetch_level(int64_t level) {
    if (level == 0 || level == 1) g_prefetch_level = (int)level;
}

void yr_linear_q4_1(const float* x, const uint8_t* w, const float* bias, float* y,
                    int64_t M, int64_t N, int64_t K) {
    if (M <= 0 || N <= 0) return;
    const int64_t nb = K / QK, rb = nb * Q4_1_BYTES;
    if (quant_rows_launch(M, K)) {
        gemm_quant_rows<DecodeQ4_1>(x, w, bias, y, M, N, K);
        return;
    }
    if (M >= GEMM_MIN_M) {
        linear_packed(x, bias, y, M, N, K, [&](int64_t n0, int nr, float* P) {
            pack_quant<dequant_block_q4_1, Q4_1_BYTES>(w + n0 * rb, rb, K, nr, P);
        });
        return;
    }
    gemv_q4_1(x, w, bias, y, M, N, K, YR_ALL_GROUPS);
}

// y = x @ W^T (+ bias) with x quantized to int8 per block of 32 (compute_dtype='int8'; see
// gemv_q8_act): a GEMV per x row for any M, weight rows split over the threads.
void yr_linear_q4_1_q8(const float* x, const uint8_t* w, const float* bias, float* y, int64_t M, int64_t N,
                       int64_t K) {
    if (M <= 0 || N <= 0) return;
    gemv_q8_act<true>(quantize_rows_q8(x, M, K), w, bias, y, M, N, K, YR_ALL_GROUPS);
}

void yr_linear_q8_0_q8(const float* x, const uint8_t* w, const float* bias, float* y, int64_t M, int64_t N,
                       int64_t K) {
    if (M <= 0 || N <= 0) return;
    gemv_q8_act<false>(quantize_rows_q8(x, M, K), w, bias, y, M, N, K, YR_ALL_GROUPS);
}

void yr_linear_q8_0(const float* x, const uint8_t* w, const float* bias, float* y,
                    int64_t M, int64_t N, int64_t K) {
    if (M <= 0 || N <= 0) return;
    const int64_t nb = K / QK, rb = nb * Q8_0_BYTES;
    if (quant_rows_launch(M, K)) {
        gemm_quant_rows<DecodeQ8_0>(x, w, bias, y, M, N, K);
        return;
    }
    if (M >= GEMM_MIN_M) {
        linear_packed(x, bias, y, M, N, K, [&](int64_t n0, int nr, float* P) {
            pack_quant<dequant_block_q8_0, Q8_0_BYTES>(w + n0 * rb, rb, K, nr, P);
        });
        return;
    }
    gemv_q8_0(x, w, bias, y, M, N, K, YR_ALL_GROUPS);
}

// Dequantization of nblocks consecutive blocks into nblocks * 32 floats, bitwise equal to
// gguf.quants.dequantize (the vendor GEMM providers of backends/cpu/providers.py dequantize a block of
// weight rows per call; the other formats' yr_dequant_T are in ggml_quants.h).
void yr_dequant_q4_1(const uint8_t* src, float* dst, int64_t nblocks) {
    yr::parallel_for(nblocks, nblocks * QK >= PAR_MIN_ELEMS,
                     [&](int64_t b) { dequant_block_q4_1(src + b * Q4_1_BYTES, dst + b * QK); });
}

void yr_dequant_q8_0(const uint8_t* src, float* dst, int64_t nblocks) {
    yr::parallel_for(nblocks, nblocks * QK >= PAR_MIN_ELEMS,
                     [&](int64_t b) { dequant_block_q8_0(src + b * Q8_0_BYTES, dst + b * QK); });
}

void yr_linear_f32(const float* x, const float* w, const float* bias, float* y,
                   int64_t M, int64_t N, int64_t K) {
    if (M <= 0 || N <= 0) return;
    if (M >= GEMM_MIN_M) {
        linear_packed(x, bias, y, M, N, K, [&](int64_t n0, int nr, float* P) {
            pack_f32(w + n0 * K, K, nr, P);
        });
        return;
    }
    gemv_f32(x, w, bias, y, M, N, K, YR_ALL_GROUPS);
}

// =================================================================================
// Embedding: out[t, :] = dequantized row ids[t] of table [V, D]. Every id is checked
// against [0, V) first (see embedding_rows).
// =================================================================================

void yr_embedding_q8_0(const int64_t* ids, const uint8_t* table, float* out, int64_t T, int64_t D,
                       int64_t V, int64_t* status) {
    const int64_t rb = D / QK * Q8_0_BYTES;
    embedding_rows(ids, out, T, D, V, status, [&](int64_t id, float* dst) {
        dequant_row<dequant_block_q8_0, Q8_0_BYTES>(table + id * rb, dst, D);
    });
}

void yr_embedding_q4_1(const int64_t* ids, const uint8_t* table, float* out, int64_t T, int64_t D,
                       int64_t V, int64_t* status) {
    const int64_t rb = D / QK * Q4_1_BYTES;
    embedding_rows(ids, out, T, D, V, status, [&](int64_t id, float* dst) {
        dequant_row<dequant_block_q4_1, Q4_1_BYTES>(table + id * rb, dst, D);
    });
}

void yr_embedding_f32(const int64_t* ids, const float* table, float* out, int64_t T, int64_t D,
                      int64_t V, int64_t* status) {
    embedding_rows(ids, out, T, D, V, status, [&](int64_t id, float* dst) {
        std::memcpy(dst, table + id * D, (size_t)D * sizeof(float));
    });
}

// =================================================================================
// RoPE, Hugging Face rotate_half convention. x, out: [T, H, Dh] (out may alias x);
// tables [S, Dh/2]; token t sits at position start_pos[0] + t, which must satisfy
// 0 <= start_pos[0] <= S - T (else nothing is read or written and the call reports it).
// out[i] = x[i] c_i - x[i+Dh/2] s_i,  out[i+Dh/2] = x[i+Dh/2] c_i + x[i] s_i  (i < Dh/2)
// =================================================================================

void yr_rope(const float* x, const float* cos_table, const float* sin_table, const int64_t* start_pos,
             float* out, int64_t T, int64_t H, int64_t Dh, int64_t S, int64_t* status) {
    const int64_t p0 = start_pos[0];
    if (p0 < 0 || p0 > S - T) {
        report(status, p0, 0, S - T + 1);
        return;
    }
    yr::parallel_for(T * H, T * H * Dh >= PAR_MIN_ELEMS,
                     [&](int64_t th) { rope_row(x, cos_table, sin_table, p0, out, th, H, Dh); });
}

// =================================================================================
// Causal grouped-query attention with a KV cache, full or in a sliding window.
// q: [T, Hq, Dh]; k, v: [T, Hkv, Dh]; caches: [max_seq, Hkv, Dh]; out: [T, Hq, Dh].
// Appends k, v at positions p0 .. p0+T-1 (p0 = start_pos[0], which must satisfy
// 0 <= p0 <= max_seq - T: else nothing is read or written and the call reports it), then
// query t (position p = p0+t) of head h attends keys first_key(p, window) .. p of kv head
// h / (Hq / Hkv) (window 0: keys 0 .. p; window W >= 1: p - W < j <= p):
// out = softmax(scale * q.k) @ v, max subtracted first. Work is O(min(p, window)) per query.
// yr_attention is yr_attention_window with window 0. The _f16kv forms take float16 caches
// (IEEE half bits): k, v are rounded to nearest even as they are appended, and the keys and
// values are read back as floats; everything else is computed in float32 as above.
// =================================================================================

}  // extern "C"

namespace {
template <typename KV>
void attention_window(const float* q, const float* k, const float* v, KV* k_cache, KV* v_cache,
                      const int64_t* start_pos, float* out, int64_t T, int64_t Hq, int64_t Hkv, int64_t Dh,
                      int64_t max_seq, float scale, int64_t window, int64_t* status) {
    const int64_t p0 = start_pos[0];
    if (p0 < 0 || p0 > max_seq - T) {
        report(status, p0, 0, max_seq - T + 1);
        return;
    }
    const int64_t kv_row = Hkv * Dh;   // elements per cache position
    store_kv(k_cache + p0 * kv_row, k, T * kv_row);
    store_kv(v_cache + p0 * kv_row, v, T * kv_row);
    if (T > 1) {   // prefill: in tiles
        attention_prefill_tiled(q, k_cache, v_cache, p0, out, T, Hq, Hkv, Dh, scale, window);
        return;
    }
    const int64_t group = Hq / Hkv;
    const int64_t work = T * Hq * (p0 + T - first_key(p0, window)) * Dh;
    yr::parallel_for_dynamic(T * Hq, work >= PAR_MIN_MACS / 4, [&](int64_t th) {
        static thread_local std::vector<float> score_buf;
        const int64_t t = th / Hq, h = th % Hq, kvh = h / group;
        const int64_t j0 = first_key(p0 + t, window);   // keys j0 .. p0+t
        const int64_t L = p0 + t + 1 - j0;
        float* s = scratch(score_buf, (size_t)(std::max<int64_t>(max_seq, L) + VL));
        attend_keys(q + th * Dh, k_cache + kvh * Dh + j0 * kv_row, v_cache + kvh * Dh + j0 * kv_row, kv_row, L, Dh,
                    scale, s, out + th * Dh);
    });
}
}  // namespace

extern "C" {

void yr_attention_window(const float* q, const float* k, const float* v, float* k_cache, float* v_cache,
                         const int64_t* start_pos, float* out, int64_t T, int64_t Hq, int64_t Hkv, int64_t Dh,
                         int64_t max_seq, float scale, int64_t window, int64_t* status) {
    attention_window(q, k, v, k_cache, v_cache, start_pos, out, T, Hq, Hkv, Dh, max_seq, scale, window, status);
}

void yr_attention_window_f16kv(const float* q, const float* k, const float* v, uint16_t* k_cache,
                               uint16_t* v_cache, const int64_t* start_pos, float* out, int64_t T, int64_t Hq,
                               int64_t Hkv, int64_t Dh, int64_t max_seq, float scale, int64_t window,
                               int64_t* status) {
    attention_window(q, k, v, k_cache, v_cache, start_pos, out, T, Hq, Hkv, Dh, max_seq, scale, window, status);
}

void yr_attention(const float* q, const float* k, const float* v, float* k_cache, float* v_cache,
                  const int64_t* start_pos, float* out, int64_t T, int64_t Hq, int64_t Hkv, int64_t Dh,
                  int64_t max_seq, float scale, int64_t* status) {
    yr_attention_window(q, k, v, k_cache, v_cache, start_pos, out, T, Hq, Hkv, Dh, max_seq, scale, 0, status);
}

// =================================================================================
// Batched-step ops (continuous batching): rows of several sequences in one call, each row
// with its own position and KV-cache slot.
//
// yr_rope_rows: RoPE as yr_rope, row t of x [T, H, Dh] at position positions[t]; every
// position must be in [0, S) (S = table rows), else nothing is written and the call reports
// the first bad one.
// =================================================================================

void yr_rope_rows(const float* x, const float* cos_table, const float* sin_table, const int64_t* positions,
                  float* out, int64_t T, int64_t H, int64_t Dh, int64_t S, int64_t* status) {
    if (!rows_in_range(positions, T, S, status)) return;
    const int64_t half = Dh / 2;
    yr::parallel_for(T * H, T * H * Dh >= PAR_MIN_ELEMS, [&](int64_t th) {
        const int64_t p = positions[th / H];
        rope_vec(x + th * Dh, cos_table + p * half, sin_table + p * half, out + th * Dh, Dh);
    });
}

// yr_rotary_emb: rotate-half RoPE with per-element tables (the IR's rotary_emb; transformers'
// apply_rotary_pos_emb): out = x * cos + rotate_half(x) * sin over rows of D (even) values,
// rotate_half(x) = [-x[D/2:], x[:D/2]], all four tensors of one dtype (dtype 0: float32,
// 1: bfloat16, 2: float16), computed in float32. geo (geo_len >= 20 values): {n0, n1, n2, D,
// then the strides over dims 0..3 of x, cos, sin and out}: the rows are indexed by
// (i0, i1, i2) < (n0, n1, n2) and each tensor's row starts at i0*s0 + i1*s1 + i2*s2 with its
// last dim contiguous (s3 must be 1); stride 0 broadcasts cos/sin (e.g. over heads), any
// stride reads a permuted x (heads of a [B, S, H, D] buffer). status: a dtype other than
// 0..2, a size outside [1, 2^31), an odd D, a stride outside [0, 2^31) or a last-dim stride
// other than 1, or a tensor whose strides reach past its length (x_len, cos_len, sin_len,
// out_len elements); then nothing is written.
void yr_rotary_emb(const void* x, const void* cos, const void* sin, void* out, const int64_t* geo, int64_t geo_len,
                   int64_t dtype, int64_t x_len, int64_t cos_len, int64_t sin_len, int64_t out_len, int64_t* status) {
    if (geo_len < 20) { report(status, geo_len, 20, INT64_MAX); return; }
    if (dtype < 0 || dtype > 2) { report(status, dtype, 0, 3); return; }
    const int64_t n[4] = {geo[0], geo[1], geo[2], geo[3]};
    for (int64_t v : n)
        if (v < 1 || v >= INT32_MAX) { report(status, v, 1, INT32_MAX); return; }
    const int64_t D = n[3];
    if (D % 2) { report(status, D, 2, 2); return; }
    const int64_t lens[4] = {x_len, cos_len, sin_len, out_len};
    for (int t = 0; t < 4; ++t) {
        const int64_t* st = geo + 4 + 4 * t;
        int64_t last = D;   // one past the last element the tensor's strides reach (saturated)
        for (int d = 0; d < 3; ++d) {
            if (st[d] < 0 || st[d] >= INT32_MAX) { report(status, st[d], 0, INT32_MAX); return; }
            if (__builtin_add_overflow(last, (n[d] - 1) * st[d], &last)) last = INT64_MAX;   // each term < 2^62
        }
        if (st[3] != 1) { report(status, st[3], 1, 2); return; }
        if (last > lens[t]) { report(status, last, 0, lens[t] + 1); return; }
    }
    if (dtype == 0) rotary_rows<float>(x, cos, sin, out, n, geo + 4);
    else if (dtype == 1) rotary_rows<Bf16Val>(x, cos, sin, out, n, geo + 4);
    else rotary_rows<F16Val>(x, cos, sin, out, n, geo + 4);
}

}  // extern "C"

namespace {

// attention_rows' two halves (yr_attention_rows and its task form): the rows' k, v written at
// cache[slots[t], positions[t]] in row order (slots and positions already checked) ...
template <typename KV>
inline void attention_rows_append(const float* k, const float* v, KV* k_cache, KV* v_cache,
                                  const int64_t* slots, const int64_t* positions, int64_t T, int64_t kv_row,
                                  int64_t slot_len) {
    for (int64_t t = 0; t < T; ++t) {
        const int64_t at = slots[t] * slot_len + positions[t] * kv_row;
        store_kv(k_cache + at, k + t * kv_row, kv_row);
        store_kv(v_cache + at, v + t * kv_row, kv_row);
    }
}

// ... and the query heads of KV head kvh of row t (pair = t * Hkv + kvh; heads kvh * group ..
// + group - 1) over keys first_key(p, window) .. p of its slot: out = softmax(scale * q.k) @ v,
// the max subtracted first (defined below, with the grouped loops).
template <typename KV>
inline void attention_row_group(const float* q, const KV* k_cache, const KV* v_cache, const int64_t* slots,
                                const int64_t* positions, float* out, int64_t pair, int64_t Hq, int64_t Hkv,
                                int64_t Dh, int64_t slot_len, float scale, int64_t window);

}  // namespace

extern "C" {

// yr_attention_rows: causal GQA attention of T rows, each over its own slot of the caches.
// q: [T, Hq, Dh]; k, v: [T, Hkv, Dh]; caches: [num_slots, max_seq, Hkv, Dh]; out: [T, Hq, Dh];
// slots, positions: int64 [T]. Every slot must be in [0, num_slots) and every position in
// [0, max_seq) (checked first, slots then positions: else nothing is read or written and the
// call reports the first bad one). Then row t writes k[t], v[t] at cache[slots[t], positions[t]]
// (in row order), and query head h of row t (p = positions[t]) attends keys
// first_key(p, window) .. p of its slot, kv head h / (Hq / Hkv): out = softmax(scale * q.k) @ v,
// max subtracted first. One (row, KV head) per work item (its query heads together: each key
// and value read and converted once for them), dynamic schedule.
// yr_attention_rows_f16kv: the same over float16 caches (as yr_attention_window_f16kv).
}  // extern "C"

namespace {
template <typename KV>
void attention_rows(const float* q, const float* k, const float* v, KV* k_cache, KV* v_cache,
                    const int64_t* slots, const int64_t* positions, float* out, int64_t T, int64_t Hq,
                    int64_t Hkv, int64_t Dh, int64_t num_slots, int64_t max_seq, float scale, int64_t window,
                    int64_t* status) {
    if (T <= 0) return;
    if (!rows_in_range(slots, T, num_slots, status) || !rows_in_range(positions, T, max_seq, status)) return;
    const int64_t kv_row = Hkv * Dh;            // floats per cache position
    const int64_t slot_len = max_seq * kv_row;  // floats per slot
    attention_rows_append(k, v, k_cache, v_cache, slots, positions, T, kv_row, slot_len);
    int64_t work = 0;
    for (int64_t t = 0; t < T; ++t) work += (positions[t] + 1 - first_key(positions[t], window)) * Hq * Dh;
    yr::parallel_for_dynamic(T * Hkv, work >= PAR_MIN_MACS / 4, [&](int64_t pair) {
        attention_row_group(q, k_cache, v_cache, slots, positions, out, pair, Hq, Hkv, Dh, slot_len, scale, window);
    });
}
}  // namespace

extern "C" {

void yr_attention_rows(const float* q, const float* k, const float* v, float* k_cache, float* v_cache,
                       const int64_t* slots, const int64_t* positions, float* out, int64_t T, int64_t Hq,
                       int64_t Hkv, int64_t Dh, int64_t num_slots, int64_t max_seq, float scale, int64_t window,
                       int64_t* status) {
    attention_rows(q, k, v, k_cache, v_cache, slots, positions, out, T, Hq, Hkv, Dh, num_slots, max_seq, scale,
                   window, status);
}

void yr_attention_rows_f16kv(const float* q, const float* k, const float* v, uint16_t* k_cache, uint16_t* v_cache,
                             const int64_t* slots, const int64_t* positions, float* out, int64_t T, int64_t Hq,
                             int64_t Hkv, int64_t Dh, int64_t num_slots, int64_t max_seq, float scale,
                             int64_t window, int64_t* status) {
    attention_rows(q, k, v, k_cache, v_cache, slots, positions, out, T, Hq, Hkv, Dh, num_slots, max_seq, scale,
                   window, status);
}

// =================================================================================
// argmax over the last axis of x [R, D] (first occurrence of the maximum).
// =================================================================================

void yr_argmax(const float* x, int64_t* out, int64_t R, int64_t D) {
    if (D <= 0) return;
    yr::parallel_for(R, R * D >= PAR_MIN_ELEMS && R > 1, [&](int64_t r) { out[r] = argmax_row(x + r * D, D); });
}

// =================================================================================
// Task entry points for the persistent kernel runtime (persistent.cpp).
// void yr_task_X(const int64_t* a, int64_t lo, int64_t hi): a holds the op's arguments as
// int64 (pointers, sizes, a float's bits), [lo, hi) is the slice of the op's work this
// task does (listed per function). They never start parallel regions: the runtime's workers
// are the parallelism. Shapes were checked when the task graph was built; run-time indices
// (ids, start_pos) are checked here, as in the entry points above.
// =================================================================================

}  // extern "C"

#define YR_ARG(i, T) reinterpret_cast<T>(a[i])

namespace {

// s[j] = scale * (q . k[j * ld + 0 : NV*VL]) for j < n, q kept in NV registers, the rows 16
// ahead prefetched.
template <int NV, typename KV>
inline void row_dots(const float* q, const KV* k, int64_t ld, int64_t n, float scale, float* s) {
    vf qr[NV];
    for (int i = 0; i < NV; ++i) qr[i] = vload(q + i * VL);
    int64_t j = 0;
#if defined(YR_AVX512) || defined(YR_AVX2)
    const __m128 vscale = _mm_set1_ps(scale);
    for (; j + 4 <= n; j += 4) {   // four rows' sums reduced together (vsum4), as group_dots
        for (int r = 0; r < 4; ++r)
            if (j + 16 + r < n) prefetch_bytes(k + (j + 16 + r) * ld, NV * VL * sizeof(KV));
        vf acc[4];
        for (int r = 0; r < 4; ++r) acc[r] = vmul(qr[0], vload(k + (j + r) * ld));
        for (int i = 1; i < NV; ++i)
            for (int r = 0; r < 4; ++r) acc[r] = vfma(qr[i], vload(k + (j + r) * ld + i * VL), acc[r]);
        _mm_storeu_ps(s + j, _mm_mul_ps(vscale, vsum4(acc[0], acc[1], acc[2], acc[3])));
    }
#endif
    for (; j < n; ++j) {
        if (j + 16 < n) prefetch_bytes(k + (j + 16) * ld, NV * VL * sizeof(KV));
        const KV* kj = k + j * ld;
        vf acc = vmul(qr[0], vload(kj));
        for (int i = 1; i < NV; ++i) acc = vfma(qr[i], vload(kj + i * VL), acc);
        s[j] = scale * vsum(acc);
    }
}

// o = c * o + sum_j p[j] * v[j * ld + 0 : NV*VL] (the online-softmax update; c = 0 with o
// zeroed for a plain weighted sum), the accumulator kept in NV registers (accumulating in
// memory serializes the rows on store-to-load forwarding), the rows 16 ahead prefetched.
template <int NV, typename KV>
inline void weighted_rows_acc(const float* p, const KV* v, int64_t ld, int64_t n, float c, float* o) {
    vf acc[NV];
    const vf cv = vbroadcast(&c);
    for (int i = 0; i < NV; ++i) acc[i] = vmul(cv, vload(o + i * VL));
    for (int64_t j = 0; j < n; ++j) {
        if (j + 16 < n) prefetch_bytes(v + (j + 16) * ld, NV * VL * sizeof(KV));
        const vf pj = vbroadcast(p + j);
        const KV* vj = v + j * ld;
        for (int i = 0; i < NV; ++i) acc[i] = vfma(pj, vload(vj + i * VL), acc[i]);
    }
    for (int i = 0; i < NV; ++i) vstore(o + i * VL, acc[i]);
}

// The G query heads of one KV head at once (GQA decode): s[g * ss + j] = scale * (q_g . k_j)
// for the G heads q_g = q + g * NV*VL, each key row loaded once for all of them (the per-head
// loop read every row G times).
// Four rows at a time (SIMD builds), their G x 4 sums reduced together (vsum4): one horizontal
// sum per score cost more than the dot product itself (2 of 3 of this loop's samples).
template <int NV, int G, typename KV>
inline void group_dots(const float* q, const KV* k, int64_t ld, int64_t n, float scale, float* s, int64_t ss) {
    vf qr[G][NV];
    for (int g = 0; g < G; ++g)
        for (int i = 0; i < NV; ++i) qr[g][i] = vload(q + g * NV * VL + i * VL);
    int64_t j = 0;
#if defined(YR_AVX512) || defined(YR_AVX2)
    const __m128 vscale = _mm_set1_ps(scale);
    for (; j + 4 <= n; j += 4) {
        for (int r = 0; r < 4; ++r)
            if (j + 16 + r < n) prefetch_bytes(k + (j + 16 + r) * ld, NV * VL * sizeof(KV));
        vf acc[G][4];
        for (int i = 0; i < NV; ++i) {
            vf kr[4];
            for (int r = 0; r < 4; ++r) kr[r] = vload(k + (j + r) * ld + i * VL);
            for (int g = 0; g < G; ++g)
                for (int r = 0; r < 4; ++r) acc[g][r] = i ? vfma(qr[g][i], kr[r], acc[g][r]) : vmul(qr[g][0], kr[r]);
        }
        for (int g = 0; g < G; ++g)
            _mm_storeu_ps(s + g * ss + j, _mm_mul_ps(vscale, vsum4(acc[g][0], acc[g][1], acc[g][2], acc[g][3])));
    }
#endif
    for (; j < n; ++j) {
        if (j + 16 < n) prefetch_bytes(k + (j + 16) * ld, NV * VL * sizeof(KV));
        const KV* kj = k + j * ld;
        vf kr[NV];
        for (int i = 0; i < NV; ++i) kr[i] = vload(kj + i * VL);
        for (int g = 0; g < G; ++g) {
            vf acc = vmul(qr[g][0], kr[0]);
            for (int i = 1; i < NV; ++i) acc = vfma(qr[g][i], kr[i], acc);
            s[g * ss + j] = scale * vsum(acc);
        }
    }
}

// o_g = sum_j p[g * ps + j] * v_j for the G heads (o_g = o + g * os), each value row loaded once.
template <int NV, int G, typename KV>
inline void group_weighted(const float* p, int64_t ps, const KV* v, int64_t ld, int64_t n, float* o, int64_t os) {
    vf acc[G][NV];
    for (int g = 0; g < G; ++g)
        for (int i = 0; i < NV; ++i) acc[g][i] = vzero();
    for (int64_t j = 0; j < n; ++j) {
        if (j + 16 < n) prefetch_bytes(v + (j + 16) * ld, NV * VL * sizeof(KV));
        const KV* vj = v + j * ld;
        vf vr[NV];
        for (int i = 0; i < NV; ++i) vr[i] = vload(vj + i * VL);
        for (int g = 0; g < G; ++g) {
            const vf pj = vbroadcast(p + g * ps + j);
            for (int i = 0; i < NV; ++i) acc[g][i] = vfma(pj, vr[i], acc[g][i]);
        }
    }
    for (int g = 0; g < G; ++g)
        for (int i = 0; i < NV; ++i) vstore(o + g * os + i * VL, acc[g][i]);
}

// Runs CALL(NV, G) for the (register width, group) pairs group_dots/group_weighted take (at most
// 16 accumulators); false for others.
#define YR_GROUP_CASES(nv, G, CALL)                                                        \
    ((nv) == 4 && (G) == 2 ? (CALL(4, 2), true) : (nv) == 4 && (G) == 3 ? (CALL(4, 3), true) : \
     (nv) == 4 && (G) == 4 ? (CALL(4, 4), true) : (nv) == 8 && (G) == 2 ? (CALL(8, 2), true) : false)

// Register width of a head of Dh floats for row_dots / weighted_rows (0: no register path).
inline int head_vectors(int64_t Dh) { return Dh == VL * 8 ? 8 : Dh == VL * 4 ? 4 : Dh == VL * 2 ? 2 : 0; }

// row_dots with the register width nv = head_vectors(Dh), or the plain loop.
template <typename KV>
inline void head_dots(int nv, const float* q, const KV* k, int64_t ld, int64_t n, int64_t Dh, float scale,
                      float* s) {
    switch (nv) {
        case 8: row_dots<8, KV>(q, k, ld, n, scale, s); break;
        case 4: row_dots<4, KV>(q, k, ld, n, scale, s); break;
        case 2: row_dots<2, KV>(q, k, ld, n, scale, s); break;
        default: for (int64_t j = 0; j < n; ++j) s[j] = scale * dot(q, k + j * ld, Dh);
    }
}

// o = c * o + sum_j p[j] * v[j * ld : +Dh], with the register width nv = head_vectors(Dh).
template <typename KV>
inline void head_weighted(int nv, const float* p, const KV* v, int64_t ld, int64_t n, int64_t Dh, float c,
                          float* o) {
    switch (nv) {
        case 8: weighted_rows_acc<8, KV>(p, v, ld, n, c, o); break;
        case 4: weighted_rows_acc<4, KV>(p, v, ld, n, c, o); break;
        case 2: weighted_rows_acc<2, KV>(p, v, ld, n, c, o); break;
        default:
            for (int64_t d = 0; d < Dh; ++d) o[d] *= c;
            for (int64_t j = 0; j < n; ++j) axpy(p[j], v + j * ld, o, Dh);
    }
}

template <typename KV>
inline void attention_row_group(const float* q, const KV* k_cache, const KV* v_cache, const int64_t* slots,
                                const int64_t* positions, float* out, int64_t pair, int64_t Hq, int64_t Hkv,
                                int64_t Dh, int64_t slot_len, float scale, int64_t window) {
    static thread_local std::vector<float> score_buf;
    const int64_t t = pair / Hkv, kvh = pair % Hkv, group = Hq / Hkv, p = positions[t], kv_row = Hkv * Dh;
    const int64_t j0 = first_key(p, window);   // keys j0 .. p
    const int64_t L = p + 1 - j0, ss = L + VL;
    float* s = scratch(score_buf, (size_t)(group * ss));
    const int64_t base = slots[t] * slot_len + kvh * Dh + j0 * kv_row;
    const float* q0 = q + (t * Hq + kvh * group) * Dh;
    float* o0 = out + (t * Hq + kvh * group) * Dh;
    const int nv = head_vectors(Dh);
    // the group's heads together where their accumulators fit in registers (the same sums, in
    // the same order, as the one-head loops)
#define YR_DOTS(NV, G) group_dots<NV, G>(q0, k_cache + base, kv_row, L, scale, s, ss)
    const bool grouped = YR_GROUP_CASES(nv, group, YR_DOTS);
#undef YR_DOTS
    if (!grouped) {
        for (int64_t g = 0; g < group; ++g)
            attend_keys(q0 + g * Dh, k_cache + base, v_cache + base, kv_row, L, Dh, scale, s, o0 + g * Dh);
        return;
    }
    float inv[4];   // YR_GROUP_CASES: G <= 4
    for (int64_t g = 0; g < group; ++g) {
        float* sg = s + g * ss;
        inv[g] = 1.0f / exp_shifted_sum(sg, L, max_scores(sg, L, -INFINITY));
    }
#define YR_WEIGHTED(NV, G) group_weighted<NV, G>(s, ss, v_cache + base, kv_row, L, o0, Dh)
    YR_GROUP_CASES(nv, group, YR_WEIGHTED);
#undef YR_WEIGHTED
    for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < Dh; ++d) o0[g * Dh + d] *= inv[g];
}

// n cache rows (ld elements apart) as floats, with ld set to their row stride: a float cache's
// own memory (ld unchanged) ...
inline const float* tile_floats(const float* c, int64_t cache_ld, int64_t, int64_t, float*, int64_t& ld) {
    ld = cache_ld;
    return c;
}

// ... or a float16 cache's rows converted into buf [n, Dh] (ld = Dh).
inline const float* tile_floats(const f16* c, int64_t cache_ld, int64_t n, int64_t Dh, float* buf, int64_t& ld) {
    for (int64_t j = 0; j < n; ++j) {
        const f16* src = c + j * cache_ld;
        float* dst = buf + j * Dh;
        int64_t d = 0;
        for (; d + VL <= Dh; d += VL) vstore(dst + d, vload(src + d));
        for (; d < Dh; ++d) dst[d] = fp16_to_fp32(src[d]);
    }
    ld = Dh;
    return buf;
}

// Causal GQA prefill attention in tiles (FlashAttention's online softmax, Dao et al. 2022):
// a task is (KV head, tile of PQ queries) and covers the query heads of that KV head's group,
// so each tile of PK cached keys and values is read from memory once and reused from L1 by
// every query row of the task. Keys are visited tile by tile with a running max, sum and
// output per query row; query t sees keys first_key(p0+t, window) .. p0+t (causal, and in a
// sliding window of `window` positions when window > 0: the key tiles then start at the
// tile's first visible key, so a task reads about window + PQ keys, not p0 + t). The caches
// already hold the new keys and values (yr_attention_window appends them first). With a
// float16 cache each tile's keys and values are converted to floats once per task (tile_floats)
// and every row reads the floats.
template <typename KV>
void attention_prefill_tiled(const float* q, const KV* k_cache, const KV* v_cache, int64_t p0,
                             float* out, int64_t T, int64_t Hq, int64_t Hkv, int64_t Dh, float scale,
                             int64_t window) {
    constexpr int64_t PQ = 16, PK = 64;
    const int64_t group = Hq / Hkv, kv_row = Hkv * Dh, qtiles = (T + PQ - 1) / PQ;
    const int nv = head_vectors(Dh);
    yr::parallel_for_dynamic(Hkv * qtiles, true, [&](int64_t task) {
        const int64_t qt = qtiles - 1 - task / Hkv, kvh = task % Hkv;   // longest (last) tiles first
        const int64_t t0 = qt * PQ, t1 = std::min(T, t0 + PQ), rows = (t1 - t0) * group;
        static thread_local std::vector<float> buf;
        float* S = scratch(buf, (size_t)(rows * (PK + VL) + rows * Dh + 2 * rows + 2 * PK * Dh));
        float* O = S + rows * (PK + VL);
        float* M = O + rows * Dh;
        float* L = M + rows;
        float* KT = L + rows;        // a float16 cache's tile as floats: PK x Dh keys ...
        float* VT = KT + PK * Dh;    // ... and values
        std::fill(O, O + rows * Dh, 0.0f);
        std::fill(M, M + rows, -INFINITY);
        std::fill(L, L + rows, 0.0f);
        const KV* kb = k_cache + kvh * Dh;
        const KV* vb = v_cache + kvh * Dh;
        for (int64_t j0 = first_key(p0 + t0, window); j0 < p0 + t1; j0 += PK) {
            const int64_t tile = std::min(PK, p0 + t1 - j0);   // keys of the tile any row sees
            int64_t ld;   // elements between the tile's rows
            const float* ktile = tile_floats(kb + j0 * kv_row, kv_row, tile, Dh, KT, ld);
            const float* vtile = tile_floats(vb + j0 * kv_row, kv_row, tile, Dh, VT, ld);
            for (int64_t r = 0; r < rows; ++r) {
                const int64_t t = t0 + r / group, h = kvh * group + r % group;
                const int64_t a = std::max(j0, first_key(p0 + t, window));   // sliding window
                const int64_t n = std::min(j0 + PK, p0 + t + 1) - a;          // causal
                if (n <= 0) continue;
                const float* qv = q + (t * Hq + h) * Dh;
                float* sr = S + r * (PK + VL);
                float* o = O + r * Dh;
                const float* k0 = ktile + (a - j0) * ld;
                const float* v0 = vtile + (a - j0) * ld;
                head_dots(nv, qv, k0, ld, n, Dh, scale, sr);
                float mx = M[r];
                mx = max_scores(sr, n, mx);
                const float c = M[r] == -INFINITY ? 0.0f : std::exp(M[r] - mx);
                L[r] = L[r] * c + exp_shifted_sum(sr, n, mx);
                M[r] = mx;
                head_weighted(nv, sr, v0, ld, n, Dh, c, o);
            }
        }
        for (int64_t r = 0; r < rows; ++r) {
            const int64_t t = t0 + r / group, h = kvh * group + r % group;
            const float inv = 1.0f / L[r];
            float* dst = out + (t * Hq + h) * Dh;
            for (int64_t d = 0; d < Dh; ++d) dst[d] = O[r * Dh + d] * inv;
        }
    });
}

inline float float_arg(int64_t bits) {
    const uint32_t u = (uint32_t)bits;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

}  // namespace

extern "C" {

// a = {x, w, bias|0, y, M, N, K, stride}; [lo, hi): output columns (weight rows) of y (stride:
// YR_TASK_GROUPS).
void yr_task_linear_q4_1(const int64_t* a, int64_t lo, int64_t hi) {
    const int64_t M = a[4], N = a[5], K = a[6];
    if (M >= QUANT_ROWS_MIN_M && M <= QUANT_ROWS_MAX_M) {   // as yr_linear_q4_1: the small-batch row tiles
        gemm_quant_rows_range<DecodeQ4_1>(YR_ARG(0, const float*), YR_ARG(1, const uint8_t*),
                                          YR_ARG(2, const float*), YR_ARG(3, float*), M, N, K, lo, hi);
        return;
    }
    gemv_q4_1(YR_ARG(0, const float*), YR_ARG(1, const uint8_t*), YR_ARG(2, const float*), YR_ARG(3, float*),
              M, N, K, YR_TASK_GROUPS);
}

// a = {x, w, bias|0, y, M, N, K, stride}; [lo, hi): weight rows.
void yr_task_linear_q8_0(const int64_t* a, int64_t lo, int64_t hi) {
    const int64_t M = a[4], N = a[5], K = a[6];
    if (M >= QUANT_ROWS_MIN_M && M <= QUANT_ROWS_MAX_M) {
        gemm_quant_rows_range<DecodeQ8_0>(YR_ARG(0, const float*), YR_ARG(1, const uint8_t*),
                                          YR_ARG(2, const float*), YR_ARG(3, float*), M, N, K, lo, hi);
        return;
    }
    gemv_q8_0(YR_ARG(0, const float*), YR_ARG(1, const uint8_t*), YR_ARG(2, const float*), YR_ARG(3, float*),
              M, N, K, YR_TASK_GROUPS);
}

// out[0]: bytes of the buffer that holds M rows of K (K % 32 == 0) quantized per block of 32 for
// the int8-activation task forms below (q8_rows_bytes); 0 for sizes out of range.
void yr_quantized_rows_bytes(int64_t M, int64_t K, int64_t* out) {
    out[0] = M > 0 && K > 0 && K % QK == 0 && M <= (INT64_C(1) << 40) / K ? q8_rows_bytes(M, K) : 0;
}

// a = {x, buf, M, K}; [lo, hi): blocks of 32 of x's M * K / 32 (clipped), quantized into buf
// (yr_quantized_rows_bytes(M, K) bytes) as the int8-activation launches quantize x.
void yr_task_quantize_rows_q8(const int64_t* a, int64_t lo, int64_t hi) {
    const int64_t M = a[2], K = a[3], n = M * (K / QK);
    lo = std::max<int64_t>(lo, 0), hi = std::min(hi, n);
    if (lo >= hi) return;
    uint8_t* buf = YR_ARG(1, uint8_t*);
    float* dx = reinterpret_cast<float*>(buf + q8_rows_scales_at(M, K));
    quantize_blocks_q8(YR_ARG(0, const float*) + lo * QK, hi - lo, reinterpret_cast<int8_t*>(buf) + lo * QK, dx + lo,
                       dx + n + lo);
}

// a = {buf, w, bias|0, y, M, N, K, stride}, buf: x quantized by yr_task_quantize_rows_q8;
// [lo, hi): weight rows. The product of yr_linear_q4_1_q8.
void yr_task_linear_q4_1_q8(const int64_t* a, int64_t lo, int64_t hi) {
    const int64_t M = a[4], N = a[5], K = a[6];
    gemv_q8_act<true>(q8_rows_in(YR_ARG(0, const uint8_t*), M, K), YR_ARG(1, const uint8_t*),
                      YR_ARG(2, const float*), YR_ARG(3, float*), M, N, K, YR_TASK_GROUPS);
}

void yr_task_linear_q8_0_q8(const int64_t* a, int64_t lo, int64_t hi) {
    const int64_t M = a[4], N = a[5], K = a[6];
    gemv_q8_act<false>(q8_rows_in(YR_ARG(0, const uint8_t*), M, K), YR_ARG(1, const uint8_t*),
                       YR_ARG(2, const float*), YR_ARG(3, float*), M, N, K, YR_TASK_GROUPS);
}

// a = {x, w, bias|0, y, M, N, K, stride}; [lo, hi): weight rows.
void yr_task_linear_f32(const int64_t* a, int64_t lo, int64_t hi) {
    const int64_t M = a[4], N = a[5], K = a[6];
    gemv_f32(YR_ARG(0, const float*), YR_ARG(1, const float*), YR_ARG(2, const float*), YR_ARG(3, float*),
             M, N, K, YR_TASK_GROUPS);
}

// out[0], out[1]: the most x rows for which yr_task_linear_{q4_1,q8_0} and the other formats'
// task forms compute as the launches do (the row tiles, or the GEMV below GEMM_MIN_M rows); with
// more rows the launch's packed GEMM is the better kernel, and a task form would be a GEMV per row.
void yr_linear_task_rows(int64_t* out) {
    out[0] = QUANT_ROWS_MAX_M;
    out[1] = GEMM_MIN_M - 1;
}

// a = {x, cos, sin, positions, out, T, H, Dh, S, status}; [lo, hi): (row, head) pairs t * H + h.
// yr_rope_rows as tasks: each task checks every position (a step's few rows) and writes nothing
// if one is out of [0, S); the task of pair 0 reports it.
void yr_task_rope_rows(const int64_t* a, int64_t lo, int64_t hi) {
    const int64_t* positions = YR_ARG(3, const int64_t*);
    const int64_t T = a[5], H = a[6], Dh = a[7], S = a[8];
    if (!rows_in_range(positions, T, S, lo == 0 ? YR_ARG(9, int64_t*) : nullptr)) return;
    const float* x = YR_ARG(0, const float*);
    const float* cos_table = YR_ARG(1, const float*);
    const float* sin_table = YR_ARG(2, const float*);
    float* out = YR_ARG(4, float*);
    const int64_t half = Dh / 2;
    for (int64_t th = lo; th < hi; ++th) {
        const int64_t p = positions[th / H];
        rope_vec(x + th * Dh, cos_table + p * half, sin_table + p * half, out + th * Dh, Dh);
    }
}

// a = {k, v, k_cache, v_cache, slots, positions, T, Hkv, Dh, num_slots, max_seq, status}; one task:
// yr_attention_rows' checks (slots, then positions: the first bad one reported, nothing written)
// and its writes of the rows' k, v into their slots.
// The _f16kv task forms below take float16 caches, as yr_attention_window_f16kv does.
}  // extern "C"

namespace {
template <typename KV>
void task_attention_rows_append(const int64_t* a) {
    const int64_t* slots = YR_ARG(4, const int64_t*);
    const int64_t* positions = YR_ARG(5, const int64_t*);
    const int64_t T = a[6], kv_row = a[7] * a[8], num_slots = a[9], max_seq = a[10];
    int64_t* status = YR_ARG(11, int64_t*);
    if (!rows_in_range(slots, T, num_slots, status) || !rows_in_range(positions, T, max_seq, status)) return;
    attention_rows_append(YR_ARG(0, const float*), YR_ARG(1, const float*), YR_ARG(2, KV*), YR_ARG(3, KV*),
                          slots, positions, T, kv_row, max_seq * kv_row);
}

template <typename KV>
void task_attention_rows(const int64_t* a, int64_t lo, int64_t hi) {
    const int64_t* slots = YR_ARG(3, const int64_t*);
    const int64_t* positions = YR_ARG(4, const int64_t*);
    const int64_t T = a[6], Hq = a[7], Hkv = a[8], Dh = a[9], num_slots = a[10], max_seq = a[11];
    if (!rows_in_range(slots, T, num_slots, nullptr) || !rows_in_range(positions, T, max_seq, nullptr)) return;
    hi = std::min(hi, T * Hkv);
    for (int64_t pair = std::max<int64_t>(lo, 0); pair < hi; ++pair)
        attention_row_group(YR_ARG(0, const float*), YR_ARG(1, const KV*), YR_ARG(2, const KV*), slots, positions,
                            YR_ARG(5, float*), pair, Hq, Hkv, Dh, max_seq * Hkv * Dh, float_arg(a[12]), a[13]);
}
}  // namespace

extern "C" {

void yr_task_attention_rows_append(const int64_t* a, int64_t, int64_t) { task_attention_rows_append<float>(a); }
void yr_task_attention_rows_append_f16kv(const int64_t* a, int64_t, int64_t) { task_attention_rows_append<f16>(a); }

// a = {q, k_cache, v_cache, slots, positions, out, T, Hq, Hkv, Dh, num_slots, max_seq, scale bits, window};
// [lo, hi): (row, KV head) pairs t * Hkv + kvh, as yr_attention_rows computes them (after the
// append task). With a slot or position out of range (reported by the append task) nothing is
// read or written.
void yr_task_attention_rows(const int64_t* a, int64_t lo, int64_t hi) { task_attention_rows<float>(a, lo, hi); }
void yr_task_attention_rows_f16kv(const int64_t* a, int64_t lo, int64_t hi) { task_attention_rows<f16>(a, lo, hi); }

// a = {ids, table, out, T, D, V, status, format (0 f32, 1 q8_0, 2 q4_1)}; [lo, hi): tokens.
void yr_task_embedding(const int64_t* a, int64_t lo, int64_t hi) {
    const uint8_t* table = YR_ARG(1, const uint8_t*);
    const int64_t D = a[4];
    task_embedding_rows(a, lo, hi, a[5], [&](int64_t id, float* dst) {
        if (a[7] == 1) dequant_row<dequant_block_q8_0, Q8_0_BYTES>(table + id * (D / QK * Q8_0_BYTES), dst, D);
        else if (a[7] == 2) dequant_row<dequant_block_q4_1, Q4_1_BYTES>(table + id * (D / QK * Q4_1_BYTES), dst, D);
        else std::memcpy(dst, reinterpret_cast<const float*>(table) + id * D, (size_t)D * sizeof(float));
    });
}

// a = {x, cos, sin, start_pos, out, T, H, Dh, S, status}; [lo, hi): rows t * H + h.
void yr_task_rope(const int64_t* a, int64_t lo, int64_t hi) {
    const int64_t p0 = YR_ARG(3, const int64_t*)[0], T = a[5], S = a[8];
    if (p0 < 0 || p0 > S - T) {
        report(YR_ARG(9, int64_t*), p0, 0, S - T + 1);
        return;
    }
    for (int64_t th = lo; th < hi; ++th)
        rope_row(YR_ARG(0, const float*), YR_ARG(1, const float*), YR_ARG(2, const float*), p0,
                 YR_ARG(4, float*), th, a[6], a[7]);
}

// Attention as three ops (flash-decoding, Dao et al. 2023): append k, v to the caches; the
// partial softmax of each (query, KV head, KV split); the combination of the splits.
// The part buffer holds, per (t, q head, split), {max score, sum of exp, Dh weighted values}.

// a = {k, v, k_cache, v_cache, start_pos, T, Hkv, Dh, max_seq, status}; one task.
// The _f16kv forms take float16 caches, as yr_attention_window_f16kv does.
}  // extern "C"

namespace {
template <typename KV>
void task_attention_append(const int64_t* a) {
    const int64_t p0 = YR_ARG(4, const int64_t*)[0], T = a[5], row = a[6] * a[7], max_seq = a[8];
    if (p0 < 0 || p0 > max_seq - T) {
        report(YR_ARG(9, int64_t*), p0, 0, max_seq - T + 1);
        return;
    }
    store_kv(YR_ARG(2, KV*) + p0 * row, YR_ARG(0, const float*), T * row);
    store_kv(YR_ARG(3, KV*) + p0 * row, YR_ARG(1, const float*), T * row);
}

// a = {q, k_cache, v_cache, start_pos, part, T, Hq, Hkv, Dh, max_seq, scale bits, splits, window};
// [lo, hi): pairs kvh * splits + s, for every query t and every q head of KV head kvh.
// The keys any query attends, first_key(p0, window) .. p0+T-1 (all of 0 .. p0+T-1 for
// window 0; the last window + T - 1 positions in a sliding window, so decode reads O(window)
// keys), are cut into `splits` slices; query t uses the part of a slice inside its own range
// first_key(p0+t, window) .. p0+t.
// Per (t, group): the scores of the group's heads over the split's keys, one vectorized
// exp pass per head (max subtracted), then each value row read once for all the heads.
template <typename KV>
void task_attention_partial(const int64_t* a, int64_t lo, int64_t hi) {
    const float* q = YR_ARG(0, const float*);
    const KV* k_cache = YR_ARG(1, const KV*);
    const KV* v_cache = YR_ARG(2, const KV*);
    const int64_t p0 = YR_ARG(3, const int64_t*)[0];
    float* part = YR_ARG(4, float*);
    const int64_t T = a[5], Hq = a[6], Hkv = a[7], Dh = a[8], max_seq = a[9], S = a[11], window = a[12];
    const float scale = float_arg(a[10]);
    if (p0 < 0 || p0 > max_seq - T) return;   // the append task reported it
    const int64_t kv_row = Hkv * Dh, group = Hq / Hkv;
    const int64_t base = first_key(p0, window);                           // first key any query sees
    const int64_t chunk = ((p0 + T - base + S - 1) / S + 15) / 16 * 16;   // keys per split
    const int64_t stride = chunk + VL;                              // scores per head in scratch
    static thread_local std::vector<float> score_buf;
    float* sc = scratch(score_buf, (size_t)(group * stride));
    for (int64_t pair = lo; pair < hi; ++pair) {
        const int64_t kvh = pair / S, s = pair % S;
        for (int64_t t = 0; t < T; ++t) {
            const int64_t j0 = std::max(base + s * chunk, first_key(p0 + t, window));
            const int64_t j1 = std::min(p0 + t + 1, base + (s + 1) * chunk), n = j1 - j0;
            const int64_t h0 = kvh * group;
            for (int64_t g = 0; g < group; ++g) {
                float* pr = part + ((t * Hq + h0 + g) * S + s) * (Dh + 2);
                std::fill(pr + 2, pr + 2 + Dh, 0.0f);
                pr[0] = -INFINITY;
                pr[1] = 0.0f;
            }
            if (n <= 0) continue;
            const KV* kbase = k_cache + kvh * Dh;
            const KV* vbase = v_cache + kvh * Dh;
            const int nv = head_vectors(Dh);
            const float* q0 = q + (t * Hq + h0) * Dh;
            // the group's heads together where their accumulators fit in registers
#define YR_DOTS(NV, G) group_dots<NV, G>(q0, kbase + j0 * kv_row, kv_row, n, scale, sc, stride)
            const bool grouped = YR_GROUP_CASES(nv, group, YR_DOTS);
#undef YR_DOTS
            for (int64_t g = 0; g < group; ++g) {
                const float* qv = q + (t * Hq + h0 + g) * Dh;
                float* sg = sc + g * stride;
                if (!grouped) head_dots(nv, qv, kbase + j0 * kv_row, kv_row, n, Dh, scale, sg);
                const float mx = max_scores(sg, n, -INFINITY);
                const float sum = exp_shifted_sum(sg, n, mx);
                float* pr = part + ((t * Hq + h0 + g) * S + s) * (Dh + 2);
                pr[0] = mx;
                pr[1] = sum;
            }
            float* o0 = part + ((t * Hq + h0) * S + s) * (Dh + 2) + 2;
#define YR_WEIGHTED(NV, G) group_weighted<NV, G>(sc, stride, vbase + j0 * kv_row, kv_row, n, o0, S * (Dh + 2))
            if (!(grouped && YR_GROUP_CASES(nv, group, YR_WEIGHTED)))
#undef YR_WEIGHTED
                for (int64_t g = 0; g < group; ++g) {
                    float* o = part + ((t * Hq + h0 + g) * S + s) * (Dh + 2) + 2;
                    const float* pg = sc + g * stride;
                    head_weighted(nv, pg, vbase + j0 * kv_row, kv_row, n, Dh, 0.0f, o);  // o is zero
                }
        }
    }
}
}  // namespace

extern "C" {

void yr_task_attention_append(const int64_t* a, int64_t, int64_t) { task_attention_append<float>(a); }
void yr_task_attention_append_f16kv(const int64_t* a, int64_t, int64_t) { task_attention_append<f16>(a); }
void yr_task_attention_partial(const int64_t* a, int64_t lo, int64_t hi) { task_attention_partial<float>(a, lo, hi); }
void yr_task_attention_partial_f16kv(const int64_t* a, int64_t lo, int64_t hi) {
    task_attention_partial<f16>(a, lo, hi);
}

// a = {part, out, T, Hq, Dh, splits}; [lo, hi): rows t * Hq + h of out [T, Hq, Dh].
void yr_task_attention_combine(const int64_t* a, int64_t lo, int64_t hi) {
    const float* part = YR_ARG(0, const float*);
    float* out = YR_ARG(1, float*);
    const int64_t Dh = a[4], S = a[5];
    for (int64_t th = lo; th < hi; ++th) {
        const float* pr = part + th * S * (Dh + 2);
        float mx = -INFINITY;
        for (int64_t s = 0; s < S; ++s) mx = std::max(mx, pr[s * (Dh + 2)]);
        float* o = out + th * Dh;
        std::fill(o, o + Dh, 0.0f);
        float sum = 0.0f;
        for (int64_t s = 0; s < S; ++s) {
            const float* ps = pr + s * (Dh + 2);
            if (ps[1] == 0.0f) continue;   // an empty split
            const float w = std::exp(ps[0] - mx);
            sum += w * ps[1];
            axpy(w, ps + 2, o, Dh);
        }
        const float inv = 1.0f / sum;
        for (int64_t d = 0; d < Dh; ++d) o[d] *= inv;
    }
}

// argmax in two ops: per chunk of a row, then over the chunks (first maximum; NaN wins).
// a = {x, vals, idx, R, D, chunks}; [lo, hi): pairs r * chunks + c.
void yr_task_argmax_partial(const int64_t* a, int64_t lo, int64_t hi) {
    const float* x = YR_ARG(0, const float*);
    float* vals = YR_ARG(1, float*);
    int64_t* idx = YR_ARG(2, int64_t*);
    const int64_t D = a[4], C = a[5], chunk = (D + C - 1) / C;
    for (int64_t rc = lo; rc < hi; ++rc) {
        const int64_t r = rc / C, c = rc % C, b = c * chunk, e = std::min(D, b + chunk);
        if (b >= e) { vals[rc] = -INFINITY; idx[rc] = -1; continue; }
        const int64_t i = b + argmax_row(x + r * D + b, e - b);
        vals[rc] = x[r * D + i];
        idx[rc] = i;
    }
}

// a = {vals, idx, out, chunks}; [lo, hi): rows.
void yr_task_argmax_reduce(const int64_t* a, int64_t lo, int64_t hi) {
    const float* vals = YR_ARG(0, const float*);
    const int64_t* idx = YR_ARG(1, const int64_t*);
    int64_t* out = YR_ARG(2, int64_t*);
    const int64_t C = a[3];
    for (int64_t r = lo; r < hi; ++r) {
        int64_t best = -1;
        float bv = 0.0f;
        for (int64_t c = r * C; c < (r + 1) * C; ++c) {
            if (idx[c] < 0) continue;
            const float v = vals[c];
            if (v != v) { best = idx[c]; break; }
            if (best < 0 || v > bv) { best = idx[c]; bv = v; }
        }
        out[r] = best < 0 ? 0 : best;
    }
}

#undef YR_ARG

// Runs a row task (void fn(const int64_t* args, int64_t lo, int64_t hi): a fused row program's
// task entry) over rows [lo, hi), cut into chunks of at least min_rows rows shared by the
// threads (yr_threads.h): the epilogue of a GEMM whose provider has no epilogue hook (a vendor GEMM
// through torch), run on each row block right after the GEMM wrote it. Rows outside
// [0, rows) are refused (status), nothing is run then. One chunk per thread at most.
void yr_rows_parallel(void (*fn)(const int64_t*, int64_t, int64_t), const int64_t* args, int64_t lo, int64_t hi,
                      int64_t rows, int64_t min_rows, int64_t* status) {
    if (lo < 0 || lo > hi) { report(status, lo, 0, hi + 1); return; }
    if (hi > rows) { report(status, hi, 0, rows + 1); return; }
    if (fn == nullptr || lo == hi) return;
    const int64_t threads = yr::max_threads();
    const int64_t step = std::max<int64_t>(std::max<int64_t>(1, min_rows), (hi - lo + threads - 1) / threads);
    const int64_t chunks = (hi - lo + step - 1) / step;
    yr::parallel_for(chunks, chunks > 1, [&](int64_t c) { fn(args, lo + c * step, std::min(hi, lo + (c + 1) * step)); });
}

}  // extern "C"
