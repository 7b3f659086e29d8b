// Kernels over strided views: a strided copy (the layout ops), and, over a tensor viewed as
// [outer, n, inner] (contiguous), reductions and softmax over the middle dim, for the IR ops whose dim is not the last one (a reduction over the trailing
// dims is a fused row program instead: codegen/cpp.py), and the running sum (cumsum) along any
// dim. Bound by backends/cpu/strided.py.
//
// Every entry takes its element type as a code (0 float32, 1 float16, 2 bfloat16), computes in
// float32 and stores in that type. No entry reads an index from memory, so none needs a status.
// Work is split over (outer, a chunk of inner) pairs on threads (yr_threads.h); each pair walks
// n with the inner chunk as the contiguous (vectorized) axis, accumulating in a float32 row buffer.
#include "yirage_prelude.h"

#include "yr_threads.h"

#include <type_traits>

namespace {

constexpr int64_t CHUNK = 256;  // inner elements per work item: one float32 buffer of 1 KiB

template <typename T> inline float load(const T* p, int64_t i);
template <> inline float load<float>(const float* p, int64_t i) { return p[i]; }
template <> inline float load<yr_f16>(const yr_f16* p, int64_t i) { return (float)p[i]; }
template <> inline float load<uint16_t>(const uint16_t* p, int64_t i) { return yr_bf16_to_f32(p[i]); }

template <typename T> inline void store(T* p, int64_t i, float v);
template <> inline void store<float>(float* p, int64_t i, float v) { p[i] = v; }
template <> inline void store<yr_f16>(yr_f16* p, int64_t i, float v) { p[i] = (yr_f16)v; }
template <> inline void store<uint16_t>(uint16_t* p, int64_t i, float v) { p[i] = yr_f32_to_bf16(v); }

enum Reduce { SUM = 0, MEAN = 1, AMAX = 2, AMIN = 3, VAR = 4 };

// torch.maximum / minimum semantics: NaN wins
inline float nan_max(float a, float b) { return (a != a || b != b) ? a + b : std::max(a, b); }
inline float nan_min(float a, float b) { return (a != a || b != b) ? a + b : std::min(a, b); }

// Calls fn(o, i0, len) for every (outer index, inner chunk) pair, in parallel.
template <typename F> void for_chunks(int64_t outer, int64_t n, int64_t inner, F fn) {
    const int64_t chunks = (inner + CHUNK - 1) / CHUNK;
    yr::parallel_for(outer * chunks, outer * n * inner >= 32768, [&](int64_t w) {
        const int64_t o = w / chunks, i0 = (w % chunks) * CHUNK;
        fn(o, i0, std::min(CHUNK, inner - i0));
    });
}

template <typename T>
void reduce_mid(const T* x, T* out, int64_t outer, int64_t n, int64_t inner, int op, float correction) {
    for_chunks(outer, n, inner, [&](int64_t o, int64_t i0, int64_t len) {
        float acc[CHUNK], mean[CHUNK];
        const T* base = x + o * n * inner + i0;
        const float init = op == AMAX ? -std::numeric_limits<float>::infinity()
                         : op == AMIN ? std::numeric_limits<float>::infinity() : 0.0f;
        for (int64_t i = 0; i < len; ++i) acc[i] = init;
        for (int64_t j = 0; j < n; ++j) {
            const T* row = base + j * inner;
            if (op == AMAX) {
                for (int64_t i = 0; i < len; ++i) acc[i] = nan_max(acc[i], load(row, i));
            } else if (op == AMIN) {
                for (int64_t i = 0; i < len; ++i) acc[i] = nan_min(acc[i], load(row, i));
            } else {
                #pragma omp simd
                for (int64_t i = 0; i < len; ++i) acc[i] += load(row, i);
            }
        }
        if (op == VAR) {  // two passes: the mean, then the sum of squared deviations
            for (int64_t i = 0; i < len; ++i) { mean[i] = acc[i] / (float)n; acc[i] = 0.0f; }
            for (int64_t j = 0; j < n; ++j) {
                const T* row = base + j * inner;
                #pragma omp simd
                for (int64_t i = 0; i < len; ++i) { const float d = load(row, i) - mean[i]; acc[i] += d * d; }
            }
            // torch: divide by max(0, n - correction) (0 gives inf, or NaN for a zero sum)
            const float denom = std::max(0.0f, (float)n - correction);
            for (int64_t i = 0; i < len; ++i) acc[i] = acc[i] / denom;
        } else if (op == MEAN) {
            for (int64_t i = 0; i < len; ++i) acc[i] = acc[i] / (float)n;
        }
        T* dst = out + o * inner + i0;
        for (int64_t i = 0; i < len; ++i) store(dst, i, acc[i]);
    });
}

// softmax (log_softmax when log) over the middle dim: max, sum of exp(x - max), then the output.
template <typename T>
void softmax_mid(const T* x, T* out, int64_t outer, int64_t n, int64_t inner, bool log) {
    for_chunks(outer, n, inner, [&](int64_t o, int64_t i0, int64_t len) {
        float m[CHUNK], s[CHUNK];
        const int64_t off = o * n * inner + i0;
        for (int64_t i = 0; i < len; ++i) { m[i] = -std::numeric_limits<float>::infinity(); s[i] = 0.0f; }
        for (int64_t j = 0; j < n; ++j)
            for (int64_t i = 0; i < len; ++i) m[i] = std::max(m[i], load(x + off + j * inner, i));
        for (int64_t j = 0; j < n; ++j)
            for (int64_t i = 0; i < len; ++i) s[i] += std::exp(load(x + off + j * inner, i) - m[i]);
        for (int64_t j = 0; j < n; ++j) {
            const T* row = x + off + j * inner;
            T* dst = out + off + j * inner;
            for (int64_t i = 0; i < len; ++i) {
                const float v = load(row, i) - m[i];
                store(dst, i, log ? v - std::log(s[i]) : std::exp(v) / s[i]);
            }
        }
    });
}

template <typename F> void by_dtype(int dtype, const void* x, void* out, F fn) {
    if (dtype == 0) fn((const float*)x, (float*)out);
    else if (dtype == 1) fn((const yr_f16*)x, (yr_f16*)out);
    else fn((const uint16_t*)x, (uint16_t*)out);
}

// dst[at(m, dst_strides) + dst_off] = src[at(m, src_strides) + src_off] for every index m of
// `sizes` (ndim <= 8; strides in elements, 0 for a broadcast dim), elements of type T.
template <typename T>
void strided_copy(const T* src, T* dst, int64_t ndim, const int64_t* sizes, const int64_t* ss, int64_t so,
                  const int64_t* ds, int64_t doff) {
    const int64_t last = sizes[ndim - 1], ls = ss[ndim - 1], ld = ds[ndim - 1];
    int64_t rows = 1;
    for (int64_t d = 0; d < ndim - 1; ++d) rows *= sizes[d];
    yr::parallel_for(rows, rows * last >= 65536, [&](int64_t r) {
        int64_t rem = r, s_at = so, d_at = doff;
        for (int64_t d = ndim - 2; d >= 0; --d) {
            const int64_t i = rem % sizes[d];
            rem /= sizes[d];
            s_at += i * ss[d];
            d_at += i * ds[d];
        }
        for (int64_t j = 0; j < last; ++j) dst[d_at + j * ld] = src[s_at + j * ls];
    });
}

// out[o, i, :] = sum_{j <= i} x[o, j, :] with the running sums in A (double for floats, as
// torch's CPU cumsum accumulates; int64 for integers and bool, wrapping as two's complement).
template <typename A, typename TI, typename TO>
void cumsum_mid(const TI* x, TO* out, int64_t outer, int64_t n, int64_t inner) {
    for_chunks(outer, n, inner, [&](int64_t o, int64_t i0, int64_t len) {
        A acc[CHUNK];
        for (int64_t k = 0; k < len; ++k) acc[k] = 0;
        for (int64_t j = 0; j < n; ++j) {
            const int64_t at = (o * n + j) * inner + i0;
            for (int64_t k = 0; k < len; ++k) {
                if constexpr (std::is_same_v<A, double>) {
                    acc[k] += (double)load(x, at + k);
                    store(out, at + k, (float)acc[k]);
                } else {
                    acc[k] = (int64_t)((uint64_t)acc[k] + (uint64_t)(int64_t)x[at + k]);
                    out[at + k] = acc[k];
                }
            }
        }
    });
}

}  // namespace

extern "C" {

// out[o, i, :] = x[o, 0, :] + ... + x[o, i, :] over [outer, n, inner]. dtype: the input's code
// (0 float32, 1 float16, 2 bfloat16: out the same type; 3 bool (uint8), 4 int32, 5 int64:
// out int64). An unknown code writes nothing.
void yr_cumsum_mid(const void* x, void* out, int64_t outer, int64_t n, int64_t inner, int64_t dtype) {
    if (outer <= 0 || n <= 0 || inner <= 0) return;
    if (dtype >= 0 && dtype <= 2)
        by_dtype((int)dtype, x, out, [&](auto* xs, auto* os) { cumsum_mid<double>(xs, os, outer, n, inner); });
    else if (dtype == 3) cumsum_mid<int64_t>((const uint8_t*)x, (int64_t*)out, outer, n, inner);
    else if (dtype == 4) cumsum_mid<int64_t>((const int32_t*)x, (int64_t*)out, outer, n, inner);
    else if (dtype == 5) cumsum_mid<int64_t>((const int64_t*)x, (int64_t*)out, outer, n, inner);
}

// A strided copy of elements of `elem_bytes` (1, 2, 4 or 8) bytes: see strided_copy. The layout
// ops (permute, expand, slice, select, cat) are this with strides computed from static shapes.
void yr_strided_copy(const void* src, void* dst, int64_t ndim, const int64_t* sizes, const int64_t* src_strides,
                     int64_t src_offset, const int64_t* dst_strides, int64_t dst_offset, int64_t elem_bytes) {
    if (elem_bytes == 1)
        strided_copy((const uint8_t*)src, (uint8_t*)dst, ndim, sizes, src_strides, src_offset, dst_strides, dst_offset);
    else if (elem_bytes == 2)
        strided_copy((const uint16_t*)src, (uint16_t*)dst, ndim, sizes, src_strides, src_offset, dst_strides, dst_offset);
    else if (elem_bytes == 4)
        strided_copy((const uint32_t*)src, (uint32_t*)dst, ndim, sizes, src_strides, src_offset, dst_strides, dst_offset);
    else
        strided_copy((const uint64_t*)src, (uint64_t*)dst, ndim, sizes, src_strides, src_offset, dst_strides, dst_offset);
}

// out[o, i] = reduce_j x[o, j, i] (op: 0 sum, 1 mean, 2 amax, 3 amin, 4 var with `correction`)
void yr_reduce_mid(const void* x, void* out, int64_t outer, int64_t n, int64_t inner, int64_t op,
                   float correction, int64_t dtype) {
    by_dtype(dtype, x, out, [&](auto* xs, auto* os) { reduce_mid(xs, os, outer, n, inner, (int)op, correction); });
}

// out[o, :, i] = softmax (log_softmax when log != 0) of x[o, :, i]
void yr_softmax_mid(const void* x, void* out, int64_t outer, int64_t n, int64_t inner, int64_t log,
                    int64_t dtype) {
    by_dtype(dtype, x, out, [&](auto* xs, auto* os) { softmax_mid(xs, os, outer, n, inner, log != 0); });
}

}  // extern "C"
