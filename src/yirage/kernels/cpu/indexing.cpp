// Indexing with run-time indices: index_select and gather (the IR ops of the same names), for
// elements of 1, 2, 4 or 8 bytes (the ops only move elements). Bound by backends/cpu/indexing.py.
//
// Both are one loop over the output's coordinates m (the output is contiguous, `sizes` its
// shape, ndim <= 8): the source element is
//     src[sum_{d != dim} m[d] * src_strides[d] + v * src_strides[dim]]
// with v = index[m[dim]] (index_select: a 1-d index) or v = index[flat(m)] (gather: the index
// has the output's shape). Every v is checked against [0, n) (n = the source's size along dim)
// before it forms an address: an index out of range writes a zero element instead and records
// status = {1, v, 0, n} (the first violation wins), which the executor raises as
// IndexOutOfRangeError. The index is never trusted.
#include "yirage_prelude.h"

#include <type_traits>
#include <cstring>
#include "yr_threads.h"

namespace {

// Records an out-of-range index once: status = {1, value, lo, hi}. Threads race on status[0]
// with a compare-exchange so the four words always describe one violation.
inline void report(int64_t* status, int64_t value, int64_t lo, int64_t hi) {
    if (!status) return;
    int64_t expected = 0;
    if (__atomic_compare_exchange_n(&status[0], &expected, -1, false, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) {
        status[1] = value;
        status[2] = lo;
        status[3] = hi;
        __atomic_store_n(&status[0], 1, __ATOMIC_RELEASE);
    }
}

template <typename T>
void index_copy(const T* src, const int64_t* index, T* dst, int64_t ndim, const int64_t* sizes,
                const int64_t* ss, int64_t dim, int64_t n, bool gather, int64_t* status) {
    const int64_t last = sizes[ndim - 1];
    int64_t rows = 1;
    for (int64_t d = 0; d < ndim - 1; ++d) rows *= sizes[d];
    yr::parallel_for(rows, rows * last >= 65536, [&](int64_t r) {
        int64_t rem = r, s_at = 0, m_dim = 0;
        for (int64_t d = ndim - 2; d >= 0; --d) {
            const int64_t i = rem % sizes[d];
            rem /= sizes[d];
            if (d == dim) m_dim = i;
            else s_at += i * ss[d];
        }
        T* out = dst + r * last;
        const int64_t ls = ss[ndim - 1];
        for (int64_t j = 0; j < last; ++j) {
            const int64_t at_dim = dim == ndim - 1 ? j : m_dim;
            const int64_t v = gather ? index[r * last + j] : index[at_dim];
            if (v < 0 || v >= n) {
                report(status, v, 0, n);
                std::memset(&out[j], 0, sizeof(T));
                continue;
            }
            const int64_t off = dim == ndim - 1 ? s_at + v * ls : s_at + v * ss[dim] + j * ls;
            out[j] = src[off];
        }
    });
}

template <typename F> void by_size(int64_t elem_bytes, F fn) {
    if (elem_bytes == 1) fn((uint8_t*)nullptr);
    else if (elem_bytes == 2) fn((uint16_t*)nullptr);
    else if (elem_bytes == 4) fn((uint32_t*)nullptr);
    else fn((uint64_t*)nullptr);
}

}  // namespace

extern "C" {

// index_select (gather = 0) or gather (gather = 1): see the top of this file. src_strides are the
// source's element strides (contiguous source), `n` its size along `dim`; sizes is the output's
// shape. status: int64[4], zero on entry, or NULL (violations then only zeroed).
void yr_index_copy(const void* src, const int64_t* index, void* dst, int64_t ndim, const int64_t* sizes,
                   const int64_t* src_strides, int64_t dim, int64_t n, int64_t gather, int64_t elem_bytes,
                   int64_t* status) {
    by_size(elem_bytes, [&](auto* tag) {
        using T = std::remove_pointer_t<decltype(tag)>;
        index_copy((const T*)src, index, (T*)dst, ndim, sizes, src_strides, dim, n, gather != 0, status);
    });
}

}  // extern "C"
