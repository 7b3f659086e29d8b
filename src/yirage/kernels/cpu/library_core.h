// The CPU library's shared internals: SIMD helpers, float vectors, GGML block
// dequantization, the decode GEMVs, the packed prefill GEMM and the int8-activation GEMV, in
// an anonymous namespace. Each translation unit of the library includes this header:
// library.cpp (the entry points of the LLM kernels), library_quants.cpp (GGML's other block
// formats, q4_1 row groups) and library_encoder.cpp (the embedding engine's packed GEMMs and
// attention, convolutions). yirage/runtime/toolchain.py compiles the three in parallel and links
// them into one shared library (as one unit, g++ took about 30 s). The rules for the kernels
// are library.cpp's.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#include "yr_threads.h"
#if defined(__AVX2__) || defined(__AVX512F__) || defined(__F16C__) || defined(__FMA__)
#include <immintrin.h>
#endif
#if defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#endif

#include "yirage_prelude.h"

// The SIMD path of a build (runtime/toolchain.py's target flags decide it): AVX-512, AVX2,
// NEON (every AArch64 CPU has it: Apple silicon, Graviton, Ampere, Raspberry Pi), else scalar.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__F16C__)
#define YR_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define YR_AVX2 1
#elif defined(__aarch64__) && defined(__ARM_NEON)
#define YR_NEON 1
#endif

namespace {

// =================================================================================
// Helpers
// =================================================================================

constexpr int64_t QK = 32;            // weights per block (both formats)
constexpr int64_t Q8_0_BYTES = 34;    // {fp16 d; int8 q[32]}
constexpr int64_t Q4_1_BYTES = 20;    // {fp16 d; fp16 m; uint8 qs[16]}

// Work (multiply-adds or elements) below which a kernel runs on the calling thread.
constexpr int64_t PAR_MIN_MACS = 1 << 17;
constexpr int64_t PAR_MIN_ELEMS = 1 << 16;
// Linear layers with at least this many x rows dequantize and pack the weights once
// (GEMM); fewer rows read the quantized weights directly (GEMV per row).
constexpr int64_t GEMM_MIN_M = 6;

inline uint16_t load_u16(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return v; }

// IEEE half -> float, exact (F16C, AArch64's fcvt, or bit manipulation covering
// subnormals/inf/nan).
inline float fp16_to_fp32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#elif defined(__aarch64__)
    __fp16 v;
    std::memcpy(&v, &h, 2);
    return (float)v;
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu;
    const uint32_t mant = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (mant << 13);                 // inf / nan
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (mant << 13);        // normal: rebias 15 -> 127
    } else {
        const float f = (float)mant * 5.9604644775390625e-08f;    // subnormal: mant * 2^-24
        std::memcpy(&bits, &f, 4);
        bits |= sign;
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
#endif
}

// float -> IEEE half, rounded to nearest even as torch's .half() rounds (overflow gives inf,
// tiny values subnormals or zero, NaN a quiet NaN with the top bits of its payload, as F16C).
inline uint16_t fp32_to_fp16(float f) {
#if defined(__F16C__)
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#elif defined(__aarch64__)
    const __fp16 v = (__fp16)f;   // fcvt: the FPCR's rounding, nearest even by default
    uint16_t h;
    std::memcpy(&h, &v, 2);
    return h;
#else
    uint32_t x;
    std::memcpy(&x, &f, 4);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    const uint32_t ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return sign | 0x7e00u | (uint16_t)((ax >> 13) & 0x3ffu);   // nan
    if (ax == 0x7f800000u) return sign | 0x7c00u;                                     // inf
    if (ax >= 0x477ff000u) return sign | 0x7c00u;   // rounds to >= 65520: inf
    if (ax < 0x38800000u) {                          // below 2^-14: a subnormal half (or zero)
        if (ax < 0x33000000u) return sign;           // at most 2^-25: rounds to zero
        const uint32_t e = ax >> 23, mant = (ax & 0x7fffffu) | 0x800000u;
        const uint32_t shift = 126u - e;             // 14..24: mant * 2^(e - 150) in units of 2^-24
        uint32_t h = mant >> shift;
        const uint32_t rem = mant & ((1u << shift) - 1u), half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (h & 1u))) ++h;
        return sign | (uint16_t)h;
    }
    uint32_t h = ((ax >> 13) - (112u << 10));       // rebias 127 -> 15, keep 10 mantissa bits
    const uint32_t rem = ax & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;   // a carry into the exponent is right
    return sign | (uint16_t)h;
#endif
}

#if defined(YR_AVX512) || defined(YR_AVX2)
// fp16 -> fp32 of all 65536 bit patterns (256 KiB, filled when the library loads). The
// SIMD kernels read block scales from it: a scalar load that feeds a memory-broadcast
// operand is cheaper than converting and broadcasting in vector registers.
struct Fp16Table {
    float v[65536];
    Fp16Table() { for (uint32_t i = 0; i < 65536; ++i) v[i] = fp16_to_fp32((uint16_t)i); }
};
const Fp16Table F16;
#endif

// Keeps a vector in a register (GCC otherwise folds the reload of x from L1 into every
// FMA of every weight row).
#if defined(__GNUC__) && defined(__x86_64__)
#define YR_IN_REGISTER(v) __asm__("" : "+v"(v))
#else
#define YR_IN_REGISTER(v) (void)0
#endif

// Per-thread scratch owned by the library (never the caller's memory).
float* scratch(std::vector<float>& buf, size_t n) {
    if (buf.size() < n) buf.resize(n);
    return buf.data();
}

// =================================================================================
// Float vectors: vf holds VL floats (AVX-512: 16, AVX2: 8, scalar: 1)
// =================================================================================

#if defined(YR_AVX512) || defined(YR_AVX2)
// The sum of the 8 floats of a ymm register.
inline float hsum8(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

#if defined(YR_AVX512)
typedef __m512 vf;
constexpr int VL = 16;
#define YR_PM 8                 // packed GEMM tile: 8 x rows x 2 vectors = 16 accumulators
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vf a) { _mm512_storeu_ps(p, a); }
inline vf vbroadcast(const float* p) { return _mm512_set1_ps(*p); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline void vreg(vf& a) { __asm__("" : "+v"(a)); }   // see the AVX2 vreg
inline float vsum(vf a) { return _mm512_reduce_add_ps(a); }
// [vsum(a0), vsum(a1), vsum(a2), vsum(a3)]: the four halved to ymm, then three hadds.
inline __m128 vsum4(vf a0, vf a1, vf a2, vf a3) {
    const auto half = [](__m512 a) {
        return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
    };
    const __m256 d = _mm256_hadd_ps(_mm256_hadd_ps(half(a0), half(a1)), _mm256_hadd_ps(half(a2), half(a3)));
    return _mm_add_ps(_mm256_castps256_ps128(d), _mm256_extractf128_ps(d, 1));
}
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }   // b where either is NaN
inline float vhmax(vf a) { return _mm512_reduce_max_ps(a); }
#elif defined(YR_AVX2)
typedef __m256 vf;
constexpr int VL = 8;
#define YR_PM 6                 // 6 x rows x 2 vectors = 12 accumulators of 16 registers
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vf a) { _mm256_storeu_ps(p, a); }
inline vf vbroadcast(const float* p) { return _mm256_broadcast_ss(p); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
// Keeps a loaded vector in a register: g++ otherwise folds a load that feeds two FMAs into both
// as a memory operand, one load per FMA (quant_rows_dots: 14 loads per 12 FMAs instead of 8).
inline void vreg(vf& a) { __asm__("" : "+x"(a)); }
inline float vsum(vf a) { return hsum8(a); }
// [vsum(a0), vsum(a1), vsum(a2), vsum(a3)] by three hadds.
inline __m128 vsum4(vf a0, vf a1, vf a2, vf a3) {
    const __m256 d = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(d), _mm256_extractf128_ps(d, 1));
}
inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }   // b where either is NaN
inline float vhmax(vf a) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
#elif defined(YR_NEON)
typedef float32x4_t vf;
constexpr int VL = 4;
#define YR_PM 8                 // 8 x rows x 2 vectors = 16 accumulators of 32 registers
inline vf vzero() { return vdupq_n_f32(0.0f); }
inline vf vload(const float* p) { return vld1q_f32(p); }
inline void vstore(float* p, vf a) { vst1q_f32(p, a); }
inline vf vbroadcast(const float* p) { return vld1q_dup_f32(p); }
inline vf vadd(vf a, vf b) { return vaddq_f32(a, b); }
inline vf vmul(vf a, vf b) { return vmulq_f32(a, b); }
inline vf vfma(vf a, vf b, vf c) { return vfmaq_f32(c, a, b); }
inline void vreg(vf&) {}   // NEON FMAs take no memory operand
inline float vsum(vf a) { return vaddvq_f32(a); }
inline vf vmax(vf a, vf b) { return vbslq_f32(vcgtq_f32(a, b), a, b); }   // b where either is NaN (as maxps)
inline float vhmax(vf a) { return vmaxvq_f32(a); }
#else
typedef float vf;
constexpr int VL = 1;
#define YR_PM 4
inline vf vzero() { return 0.0f; }
inline vf vload(const float* p) { return *p; }
inline void vstore(float* p, vf a) { *p = a; }
inline vf vbroadcast(const float* p) { return *p; }
inline vf vadd(vf a, vf b) { return a + b; }
inline vf vmul(vf a, vf b) { return a * b; }
inline vf vfma(vf a, vf b, vf c) { return a * b + c; }
inline void vreg(vf&) {}
inline float vsum(vf a) { return a; }
inline vf vmax(vf a, vf b) { return a > b ? a : b; }   // b where either is NaN
inline float vhmax(vf a) { return a; }
#endif

// A float16 KV cache (kv_cache_dtype float16) holds IEEE half bits; the attention kernels take
// either element type as KV and load VL of them as floats.
typedef uint16_t f16;
inline float to_f32(float x) { return x; }
inline float to_f32(f16 h) { return fp16_to_fp32(h); }

// Element types of rotary_rows: float32, bfloat16 and float16 by tag (the two halves share
// uint16_t storage), each loaded as and stored from float32 (bfloat16 rounds to nearest even,
// yirage_prelude.h's conversions).
struct Bf16Val {
    uint16_t bits;
};
struct F16Val {
    uint16_t bits;
};
inline float load_f32(const float* p, int64_t i) { return p[i]; }
inline float load_f32(const Bf16Val* p, int64_t i) { return yr_bf16_to_f32(p[i].bits); }
inline float load_f32(const F16Val* p, int64_t i) { return fp16_to_fp32(p[i].bits); }
inline void store_f32(float* p, int64_t i, float v) { p[i] = v; }
inline void store_f32(Bf16Val* p, int64_t i, float v) { p[i].bits = yr_f32_to_bf16(v); }
inline void store_f32(F16Val* p, int64_t i, float v) { p[i].bits = fp32_to_fp16(v); }

// The rows of yr_rotary_emb (checked by it): geometry n[4], strides st[16] (x, cos, sin, out).
template <typename T>
void rotary_rows(const void* xv, const void* cv, const void* sv, void* ov, const int64_t* n, const int64_t* st) {
    const T *x = (const T*)xv, *cos = (const T*)cv, *sin = (const T*)sv;
    T* out = (T*)ov;
    const int64_t half = n[3] / 2, rows = n[0] * n[1] * n[2];
    const int64_t *xs = st, *cs = st + 4, *ss = st + 8, *os = st + 12;
    yr::parallel_for(rows, rows * n[3] >= PAR_MIN_ELEMS, [&](int64_t r) {
        const int64_t i2 = r % n[2], i1 = r / n[2] % n[1], i0 = r / (n[1] * n[2]);
        const T* xr = x + i0 * xs[0] + i1 * xs[1] + i2 * xs[2];
        const T* cr = cos + i0 * cs[0] + i1 * cs[1] + i2 * cs[2];
        const T* sr = sin + i0 * ss[0] + i1 * ss[1] + i2 * ss[2];
        T* o = out + i0 * os[0] + i1 * os[1] + i2 * os[2];
#pragma omp simd
        for (int64_t j = 0; j < half; ++j) {
            const float a = load_f32(xr, j), b = load_f32(xr, j + half);
            store_f32(o, j, a * load_f32(cr, j) - b * load_f32(sr, j));
            store_f32(o, j + half, b * load_f32(cr, j + half) + a * load_f32(sr, j + half));
        }
    });
}
#if defined(YR_AVX512)
inline vf vload(const f16* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
#elif defined(YR_AVX2)
inline vf vload(const f16* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
#elif defined(YR_NEON)
inline vf vload(const f16* p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p))); }
#else
inline vf vload(const f16* p) { return fp16_to_fp32(*p); }
#endif

// dst[0 : n] = src[0 : n] in the cache's element type (float16: rounded to nearest even).
inline void store_kv(float* dst, const float* src, int64_t n) { std::memcpy(dst, src, (size_t)n * sizeof(float)); }
inline void store_kv(f16* dst, const float* src, int64_t n) {
    int64_t i = 0;
#if defined(YR_AVX512)
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i*)(dst + i), _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT |
                                                                                            _MM_FROUND_NO_EXC));
#elif defined(YR_AVX2)
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i*)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT |
                                                                                         _MM_FROUND_NO_EXC));
#elif defined(YR_NEON)
    for (; i + 4 <= n; i += 4)   // fcvtn rounds to nearest even (the FPCR default)
        vst1_u16(dst + i, vreinterpret_u16_f16(vcvt_f16_f32(vld1q_f32(src + i))));
#endif
    for (; i < n; ++i) dst[i] = fp32_to_fp16(src[i]);
}

// exp(x) of VL floats: Cephes expf (range reduction by ln 2, degree-6 polynomial),
// about 1 ulp. x above 88 is clamped to 88; below -87.3 the result is 0 (flushed: not the
// subnormal, whose products would run at a fraction of the FMA rate, as a masked key's
// probability times V did in attention: 24x slower causal attention); NaN stays NaN.
inline vf vexp(vf x) {
#if defined(YR_AVX512) || defined(YR_AVX2)
#if defined(YR_AVX512)
    const auto set = [](float c) { return _mm512_set1_ps(c); };
    const __mmask16 normal = _mm512_cmp_ps_mask(x, set(-87.3365447504f), _CMP_NLT_UQ);   // NaN too
    x = _mm512_min_ps(set(88.0f), _mm512_max_ps(set(-87.3365447504f), x));
    const vf n = _mm512_roundscale_ps(vmul(x, set(1.44269504088896341f)),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
    const auto set = [](float c) { return _mm256_set1_ps(c); };
    const vf normal = _mm256_cmp_ps(x, set(-87.3365447504f), _CMP_NLT_UQ);   // NaN too
    x = _mm256_min_ps(set(88.0f), _mm256_max_ps(set(-87.3365447504f), x));
    const vf n = _mm256_round_ps(vmul(x, set(1.44269504088896341f)),
                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#endif
    vf r = vfma(n, set(-0.693359375f), x);                 // x - n ln2, ln2 split in two
    r = vfma(n, set(2.12194440e-4f), r);
    vf p = set(1.9875691500e-4f);
    p = vfma(p, r, set(1.3981999507e-3f));
    p = vfma(p, r, set(8.3334519073e-3f));
    p = vfma(p, r, set(4.1665795894e-2f));
    p = vfma(p, r, set(1.6666665459e-1f));
    p = vfma(p, r, set(5.0000001201e-1f));
    p = vfma(p, vmul(r, r), vadd(r, set(1.0f)));           // e^r
#if defined(YR_AVX512)
    return _mm512_maskz_scalef_ps(normal, p, n);            // p * 2^n
#else
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(normal, vmul(p, _mm256_castsi256_ps(e)));
#endif
#elif defined(YR_NEON)
    const uint32x4_t normal = vmvnq_u32(vcltq_f32(x, vdupq_n_f32(-87.3365447504f)));   // NaN too
    x = vminq_f32(vdupq_n_f32(88.0f), vmaxq_f32(vdupq_n_f32(-87.3365447504f), x));   // NaN stays NaN
    const vf n = vrndnq_f32(vmulq_n_f32(x, 1.44269504088896341f));
    vf r = vfmaq_n_f32(x, n, -0.693359375f);              // x - n ln2, ln2 split in two
    r = vfmaq_n_f32(r, n, 2.12194440e-4f);
    vf p = vdupq_n_f32(1.9875691500e-4f);
    p = vfmaq_f32(vdupq_n_f32(1.3981999507e-3f), p, r);
    p = vfmaq_f32(vdupq_n_f32(8.3334519073e-3f), p, r);
    p = vfmaq_f32(vdupq_n_f32(4.1665795894e-2f), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.6666665459e-1f), p, r);
    p = vfmaq_f32(vdupq_n_f32(5.0000001201e-1f), p, r);
    p = vfmaq_f32(vaddq_f32(r, vdupq_n_f32(1.0f)), p, vmulq_f32(r, r));   // e^r
    const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23);
    return vreinterpretq_f32_u32(vandq_u32(normal, vreinterpretq_u32_f32(vmulq_f32(p, vreinterpretq_f32_s32(e)))));
#else
    return std::exp(x);
#endif
}

// sum_k a[k] * b[k]
template <typename KV>
inline float dot(const float* a, const KV* b, int64_t n) {
    vf acc0 = vzero(), acc1 = vzero();
    int64_t k = 0;
    for (; k + 2 * VL <= n; k += 2 * VL) {
        acc0 = vfma(vload(a + k), vload(b + k), acc0);
        acc1 = vfma(vload(a + k + VL), vload(b + k + VL), acc1);
    }
    float s = vsum(vadd(acc0, acc1));
    for (; k < n; ++k) s += a[k] * to_f32(b[k]);
    return s;
}

// y[k] += alpha * x[k]
template <typename KV>
inline void axpy(float alpha, const KV* x, float* y, int64_t n) {
    const vf a = vbroadcast(&alpha);
    int64_t k = 0;
    for (; k + VL <= n; k += VL) vstore(y + k, vfma(a, vload(x + k), vload(y + k)));
    for (; k < n; ++k) y[k] += alpha * to_f32(x[k]);
}

// max(mx, s[0], ..., s[n-1]), NaNs skipped (as std::max(mx, s[j]) in a loop): VL lanes at a time,
// where the scalar loop was one dependent vmaxss per score (80% of a decode attention task's
// own time at 785 keys).
inline float max_scores(const float* s, int64_t n, float mx) {
    vf m = vbroadcast(&mx);
    int64_t j = 0;
    for (; j + VL <= n; j += VL) m = vmax(vload(s + j), m);
    mx = vhmax(m);
    for (; j < n; ++j) mx = std::max(mx, s[j]);
    return mx;
}

// s[j] = exp(s[j] - mx) for j < n (vectorized); returns their sum (the softmax denominator).
inline float exp_shifted_sum(float* s, int64_t n, float mx) {
    const float neg_mx = -mx;
    const vf vneg = vbroadcast(&neg_mx);
    vf vs = vzero();
    int64_t j = 0;
    for (; j + VL <= n; j += VL) {
        const vf e = vexp(vadd(vload(s + j), vneg));
        vstore(s + j, e);
        vs = vadd(vs, e);
    }
    float sum = vsum(vs);
    for (; j < n; ++j) {
        s[j] = std::exp(s[j] - mx);
        sum += s[j];
    }
    return sum;
}

// Register-tiled score and weighted-sum loops of one head (defined with the task kernels below).
inline int head_vectors(int64_t Dh);
template <typename KV>
inline void head_dots(int nv, const float* q, const KV* k, int64_t ld, int64_t n, int64_t Dh, float scale, float* s);
template <typename KV>
inline void head_weighted(int nv, const float* p, const KV* v, int64_t ld, int64_t n, int64_t Dh, float c, float* o);

// One query's attention over L cached keys (rows kv_row elements apart from kc, vc):
// o = softmax(scale * q.k) @ v, the max subtracted first; s: scratch of >= L + VL floats.
template <typename KV>
inline void attend_keys(const float* qv, const KV* kc, const KV* vc, int64_t kv_row, int64_t L, int64_t Dh,
                        float scale, float* s, float* o) {
    const int nv = head_vectors(Dh);
    head_dots(nv, qv, kc, kv_row, L, Dh, scale, s);
    const float sum = exp_shifted_sum(s, L, max_scores(s, L, -INFINITY));
    std::fill(o, o + Dh, 0.0f);
    head_weighted(nv, s, vc, kv_row, L, Dh, 0.0f, o);
    const float inv = 1.0f / sum;
    for (int64_t d = 0; d < Dh; ++d) o[d] *= inv;
}

// =================================================================================
// Block dequantization (bitwise equal to gguf.quants.dequantize)
// =================================================================================

// q8_0: fp16 d, then 32 int8 q; w[j] = d * q[j].
inline void dequant_block_q8_0(const uint8_t* blk, float* out) {
#if defined(YR_AVX512)
    const __m512 d = _mm512_set1_ps(F16.v[load_u16(blk)]);
    for (int h = 0; h < 2; ++h) {
        const __m512i q = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(blk + 2 + 16 * h)));
        _mm512_storeu_ps(out + 16 * h, _mm512_mul_ps(d, _mm512_cvtepi32_ps(q)));
    }
#elif defined(YR_AVX2)
    const __m256 d = _mm256_set1_ps(F16.v[load_u16(blk)]);
    for (int h = 0; h < 4; ++h) {
        const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(blk + 2 + 8 * h)));
        _mm256_storeu_ps(out + 8 * h, _mm256_mul_ps(d, _mm256_cvtepi32_ps(q)));
    }
#else
    const float d = fp16_to_fp32(load_u16(blk));
    const int8_t* q = (const int8_t*)(blk + 2);
    for (int j = 0; j < 32; ++j) out[j] = d * (float)q[j];
#endif
}

// q4_1: fp16 d, fp16 m, 16 bytes qs; w[j] = d*(qs[j] & 15) + m, w[j+16] = d*(qs[j] >> 4) + m.
inline void dequant_block_q4_1(const uint8_t* blk, float* out) {
#if defined(YR_AVX512)
    // lut[q] = d*q + m for q = 0..15; vpermps indexes it with the low 4 bits of each lane.
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 lut = _mm512_fmadd_ps(_mm512_set1_ps(F16.v[load_u16(blk)]), iota,
                                       _mm512_set1_ps(F16.v[load_u16(blk + 2)]));
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(blk + 4)));
    _mm512_storeu_ps(out, _mm512_permutexvar_ps(q, lut));                          // low nibbles
    _mm512_storeu_ps(out + 16, _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), lut));  // high
#elif defined(YR_AVX2)
    const __m256 d = _mm256_set1_ps(F16.v[load_u16(blk)]);
    const __m256 m = _mm256_set1_ps(F16.v[load_u16(blk + 2)]);
    const __m128i raw = _mm_loadu_si128((const __m128i*)(blk + 4));
    const __m128i low4 = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(raw, low4), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low4);
    const __m128i part[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int h = 0; h < 4; ++h)
        _mm256_storeu_ps(out + 8 * h, _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(part[h])), m));
#else
    const float d = fp16_to_fp32(load_u16(blk));
    const float m = fp16_to_fp32(load_u16(blk + 2));
    const uint8_t* qs = blk + 4;
    for (int j = 0; j < 16; ++j) {
        out[j] = d * (float)(qs[j] & 15) + m;
        out[j + 16] = d * (float)(qs[j] >> 4) + m;
    }
#endif
}

template <void (*deq)(const uint8_t*, float*), int64_t block_bytes>
void dequant_row(const uint8_t* row, float* out, int64_t K) {
    for (int64_t b = 0; b < K / QK; ++b) deq(row + b * block_bytes, out + b * QK);
}

// =================================================================================
// GEMV (few x rows, decode): R weight rows at a time, read straight from the blocks
// =================================================================================

#if defined(YR_NEON)
// The 32 products of a block's quants (as 4 x 8 int16, widened to float here) with x's 8
// vectors of the block, summed per lane.
inline float32x4_t neon_dot_block(const float32x4_t* xv, const int16x8_t* h) {
    float32x4_t t = vmulq_f32(xv[0], vcvtq_f32_s32(vmovl_s16(vget_low_s16(h[0]))));
    t = vfmaq_f32(t, xv[1], vcvtq_f32_s32(vmovl_high_s16(h[0])));
    for (int i = 1; i < 4; ++i) {
        t = vfmaq_f32(t, xv[2 * i], vcvtq_f32_s32(vmovl_s16(vget_low_s16(h[i]))));
        t = vfmaq_f32(t, xv[2 * i + 1], vcvtq_f32_s32(vmovl_high_s16(h[i])));
    }
    return t;
}
#endif

// q4_1: y[r] = sum_b d * (sum_j x[32b+j] q_j) + m * sx[b], sx[b] = sum of x over block b.
template <int R>
inline void gemv_q4_1_rows(const float* x, const float* sx, const uint8_t* w, int64_t rb,
                           int64_t nb, const float* bias, float* y) {
#if defined(YR_AVX512)
    // Nibbles -> floats: the low half by vpermps from {0..15} (it reads the low 4 bits
    // of each index), the high half by shift + convert, which spreads the work over
    // the shuffle and FP units.
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        __m512 xlo = _mm512_loadu_ps(x + b * QK);          // pairs with the low nibbles
        __m512 xhi = _mm512_loadu_ps(x + b * QK + 16);     // pairs with the high nibbles
        YR_IN_REGISTER(xlo);
        YR_IN_REGISTER(xhi);
        for (int r = 0; r < R; ++r) {
            const uint8_t* blk = w + r * rb + b * Q4_1_BYTES;
            const __m512 lut = _mm512_fmadd_ps(_mm512_set1_ps(F16.v[load_u16(blk)]), iota,
                                               _mm512_set1_ps(F16.v[load_u16(blk + 2)]));
            const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(blk + 4)));
            acc[r] = _mm512_fmadd_ps(xlo, _mm512_permutexvar_ps(q, lut), acc[r]);
            acc[r] = _mm512_fmadd_ps(xhi, _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), lut), acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) {
        const float s = vsum(acc[r]);
        y[r] = bias ? s + bias[r] : s;
    }
#elif defined(YR_AVX2)
    const __m128i low4 = _mm_set1_epi8(0x0F);
    __m256 acc[R];
    float macc[R];
    for (int r = 0; r < R; ++r) { acc[r] = _mm256_setzero_ps(); macc[r] = 0.0f; }
    for (int64_t b = 0; b < nb; ++b) {
        const float* xb = x + b * QK;
        const __m256 x0 = _mm256_loadu_ps(xb), x1 = _mm256_loadu_ps(xb + 8);
        const __m256 x2 = _mm256_loadu_ps(xb + 16), x3 = _mm256_loadu_ps(xb + 24);
        for (int r = 0; r < R; ++r) {
            const uint8_t* blk = w + r * rb + b * Q4_1_BYTES;
            const __m128i raw = _mm_loadu_si128((const __m128i*)(blk + 4));
            const __m128i lo = _mm_and_si128(raw, low4);                        // weights 0..15
            const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low4);     // weights 16..31
            __m256 t = _mm256_mul_ps(x0, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)));
            t = _mm256_fmadd_ps(x1, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), t);
            t = _mm256_fmadd_ps(x2, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), t);
            t = _mm256_fmadd_ps(x3, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), t);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(F16.v[load_u16(blk)]), t, acc[r]);
            macc[r] += F16.v[load_u16(blk + 2)] * sx[b];
        }
    }
    for (int r = 0; r < R; ++r) {
        const float s = vsum(acc[r]) + macc[r];
        y[r] = bias ? s + bias[r] : s;
    }
#elif defined(YR_NEON)
    // the nibbles widened to floats (u8 -> u16 -> u32 -> f32) against x's 8 vectors of the
    // block, one d per block, m times the block's sum of x (sx) on the side
    float32x4_t acc[R];
    float macc[R];
    for (int r = 0; r < R; ++r) { acc[r] = vdupq_n_f32(0.0f); macc[r] = 0.0f; }
    for (int64_t b = 0; b < nb; ++b) {
        float32x4_t xv[8];
        for (int i = 0; i < 8; ++i) xv[i] = vld1q_f32(x + b * QK + 4 * i);
        for (int r = 0; r < R; ++r) {
            const uint8_t* blk = w + r * rb + b * Q4_1_BYTES;
            const uint8x16_t raw = vld1q_u8(blk + 4);
            // weights 0..15 (low nibbles), 16..31 (high nibbles)
            const uint16x8_t h[4] = {vmovl_u8(vget_low_u8(vandq_u8(raw, vdupq_n_u8(0x0F)))),
                                     vmovl_high_u8(vandq_u8(raw, vdupq_n_u8(0x0F))),
                                     vmovl_u8(vget_low_u8(vshrq_n_u8(raw, 4))), vmovl_high_u8(vshrq_n_u8(raw, 4))};
            const int16x8_t* hs = reinterpret_cast<const int16x8_t*>(h);   // 0..15: the same bits signed
            acc[r] = vfmaq_n_f32(acc[r], neon_dot_block(xv, hs), fp16_to_fp32(load_u16(blk)));
            macc[r] += fp16_to_fp32(load_u16(blk + 2)) * sx[b];
        }
    }
    for (int r = 0; r < R; ++r) {
        const float s = vaddvq_f32(acc[r]) + macc[r];
        y[r] = bias ? s + bias[r] : s;
    }
#else
    for (int r = 0; r < R; ++r) {
        float s = 0.0f;
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t* blk = w + r * rb + b * Q4_1_BYTES;
            const uint8_t* qs = blk + 4;
            float t = 0.0f;
            for (int j = 0; j < 16; ++j)
                t += x[b * QK + j] * (float)(qs[j] & 15) + x[b * QK + j + 16] * (float)(qs[j] >> 4);
            s += fp16_to_fp32(load_u16(blk)) * t + fp16_to_fp32(load_u16(blk + 2)) * sx[b];
        }
        y[r] = bias ? s + bias[r] : s;
    }
#endif
}

// Where the software prefetches of streamed weights and caches go: 0 L1 (prefetcht0), 1 L2
// (prefetcht2). Chosen per machine by measurement (backends/cpu/native.py
// prefetch_level): on a Zen 4 (EPYC, KVM guest) prefetcht0 stalls the core once L1's miss
// buffers are full (a quarter of a decode step's samples sat on it) and L2 gave 1.4x the decode
// tokens/s; other cores may differ. Set by yr_set_prefetch_level before kernels run. One
// variable for the whole library (a C++17 inline variable, outside the anonymous namespace):
// the kernels of library_quants.cpp read what library.cpp's entry point set.
}  // namespace
inline int g_prefetch_level = 0;
namespace {

// Software prefetch of [p, p + bytes) into the level g_prefetch_level says. On x86-64 the
// instructions are volatile asm: GCC treats __builtin_prefetch as free of side effects and,
// with the level test around it, deleted whole prefetch loops as dead code. Elsewhere the
// level is ignored: an unconditioned __builtin_prefetch to L1, as before the level existed
// (an L2 variant for AArch64 has not been built or measured).
inline void prefetch_bytes(const void* p, int64_t bytes) {
    const char* c = static_cast<const char*>(p);
#if defined(__GNUC__) && defined(__x86_64__)
    if (g_prefetch_level == 1)
        for (int64_t off = 0; off < bytes; off += 64) asm volatile("prefetcht2 %0" : : "m"(c[off]));
    else
        for (int64_t off = 0; off < bytes; off += 64) asm volatile("prefetcht0 %0" : : "m"(c[off]));
#elif defined(__GNUC__)
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 3);
#else
    (void)c; (void)bytes;
#endif
}

// q8_0: y[r] = sum_b d * sum_j x[32b+j] q_j.
template <int R>
inline void gemv_q8_0_rows(const float* x, const uint8_t* w, int64_t rb, int64_t nb,
                           const float* bias, float* y) {
#if defined(YR_AVX512)
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        __m512 xlo = _mm512_loadu_ps(x + b * QK);
        __m512 xhi = _mm512_loadu_ps(x + b * QK + 16);
        YR_IN_REGISTER(xlo);
        YR_IN_REGISTER(xhi);
        // The rows' blocks 24 ahead, every 8 blocks: on top of gemv_range's prefetch of whole row
        // groups, 1.05-1.15x the GB/s from DRAM (34-byte blocks; see ggml_quants.h prefetch_rows).
        if (b % 8 == 0)
            for (int r = 0; r < R; ++r) prefetch_bytes(w + r * rb + (b + 24) * Q8_0_BYTES, 8 * Q8_0_BYTES + 64);
        for (int r = 0; r < R; ++r) {
            const uint8_t* blk = w + r * rb + b * Q8_0_BYTES;
            const __m512i q0 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(blk + 2)));
            const __m512i q1 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(blk + 18)));
            __m512 t = _mm512_mul_ps(xlo, _mm512_cvtepi32_ps(q0));
            t = _mm512_fmadd_ps(xhi, _mm512_cvtepi32_ps(q1), t);
            acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(F16.v[load_u16(blk)]), t, acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) {
        const float s = vsum(acc[r]);
        y[r] = bias ? s + bias[r] : s;
    }
#elif defined(YR_AVX2)
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const float* xb = x + b * QK;
        const __m256 x0 = _mm256_loadu_ps(xb), x1 = _mm256_loadu_ps(xb + 8);
        const __m256 x2 = _mm256_loadu_ps(xb + 16), x3 = _mm256_loadu_ps(xb + 24);
        for (int r = 0; r < R; ++r) {
            const uint8_t* blk = w + r * rb + b * Q8_0_BYTES;
            const uint8_t* q = blk + 2;
            const auto qf = [q](int o) {
                return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(q + o))));
            };
            __m256 t = _mm256_mul_ps(x0, qf(0));
            t = _mm256_fmadd_ps(x1, qf(8), t);
            t = _mm256_fmadd_ps(x2, qf(16), t);
            t = _mm256_fmadd_ps(x3, qf(24), t);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(F16.v[load_u16(blk)]), t, acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) {
        const float s = vsum(acc[r]);
        y[r] = bias ? s + bias[r] : s;
    }
#elif defined(YR_NEON)
    // the int8 quants widened to floats (s8 -> s16 -> s32 -> f32) against x's 8 vectors
    float32x4_t acc[R];
    for (int r = 0; r < R; ++r) acc[r] = vdupq_n_f32(0.0f);
    for (int64_t b = 0; b < nb; ++b) {
        float32x4_t xv[8];
        for (int i = 0; i < 8; ++i) xv[i] = vld1q_f32(x + b * QK + 4 * i);
        for (int r = 0; r < R; ++r) {
            const uint8_t* blk = w + r * rb + b * Q8_0_BYTES;
            const int8x16_t q0 = vld1q_s8((const int8_t*)(blk + 2)), q1 = vld1q_s8((const int8_t*)(blk + 18));
            const int16x8_t h[4] = {vmovl_s8(vget_low_s8(q0)), vmovl_high_s8(q0), vmovl_s8(vget_low_s8(q1)),
                                    vmovl_high_s8(q1)};
            acc[r] = vfmaq_n_f32(acc[r], neon_dot_block(xv, h), fp16_to_fp32(load_u16(blk)));
        }
    }
    for (int r = 0; r < R; ++r) {
        const float s = vaddvq_f32(acc[r]);
        y[r] = bias ? s + bias[r] : s;
    }
#else
    for (int r = 0; r < R; ++r) {
        float s = 0.0f;
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t* blk = w + r * rb + b * Q8_0_BYTES;
            const int8_t* q = (const int8_t*)(blk + 2);
            float t = 0.0f;
            for (int j = 0; j < 32; ++j) t += x[b * QK + j] * (float)q[j];
            s += fp16_to_fp32(load_u16(blk)) * t;
        }
        y[r] = bias ? s + bias[r] : s;
    }
#endif
}

// fp32: y[r] = x . w[r, :] (K floats per row).
template <int R>
inline void gemv_f32_rows(const float* x, const float* w, int64_t K, const float* bias, float* y) {
    vf acc[R];
    for (int r = 0; r < R; ++r) acc[r] = vzero();
    int64_t k = 0;
    for (; k + VL <= K; k += VL) {
        vf xv = vload(x + k);
        YR_IN_REGISTER(xv);
        for (int r = 0; r < R; ++r) acc[r] = vfma(xv, vload(w + r * K + k), acc[r]);
    }
    for (int r = 0; r < R; ++r) {
        float s = vsum(acc[r]);
        for (int64_t kk = k; kk < K; ++kk) s += x[kk] * w[r * K + kk];
        y[r] = bias ? s + bias[r] : s;
    }
}

// Weight rows per GEMV step: each x vector is loaded once for them, and as many independent
// accumulator chains keep the FMA pipes busy. With AVX-512 (32 vector registers) 8 rows
// measured 1.2-1.5x the GB/s of 4 (benchmarks/kernels_cpu.py, AMD EPYC); 16 spills.
// AVX2 has 16 registers: 4.
#if defined(YR_AVX512)
constexpr int GEMV_ROWS = 8;
#else
constexpr int GEMV_ROWS = 4;
#endif
// Software prefetch distance of the GEMV loops, in bytes of weight. A row of a decode GEMV is a
// few hundred bytes, too short a stream for the hardware prefetcher to reach full speed:
// asking for the bytes PREFETCH_BYTES ahead keeps enough DRAM reads in flight.
// 3-6 KB measured alike (sweeps of benchmarks/kernels_cpu.py "cold" and of the decode
// step); the row-count distance used before got 0.6x of this (it skipped each slice's first rows).
constexpr int64_t PREFETCH_BYTES = 4096;

// Prefetches the weight bytes [a, b) of w, clipped to [.., end).
inline void prefetch_span(const void* w, int64_t a, int64_t b, int64_t end) {
    b = std::min(b, end);
    if (a < b) prefetch_bytes(static_cast<const char*>(w) + a, b - a);
}

// Runs rows(n0, r) over the row groups of [lo, hi) (w: the weight, rb bytes per row, for
// prefetching): the first PREFETCH_BYTES up front, then each group asks for the bytes
// PREFETCH_BYTES past its own. Past hi the prefetches run on into the rows [next_lo, next_hi)
// (the slice this thread will likely take next, empty by default), so that its first bytes
// are on their way when it starts: a task slice of a decode GEMV is tens of KB, and starting
// each one cold cost ~15% of the GB/s on the Zen 4 (8 slices of a 553 KB q4_1 weight).
template <typename RowsFn>
inline void gemv_range(int64_t lo, int64_t hi, const void* w, int64_t rb, RowsFn rows, int64_t next_lo = 0,
                       int64_t next_hi = 0) {
    const int64_t own = (hi - lo) * rb;
    // bytes [a, b) of the stream {own rows, then the next slice's}, from lo's first byte
    const auto ahead = [&](int64_t a, int64_t b) {
        prefetch_span(w, lo * rb + a, lo * rb + std::min(b, own), hi * rb);
        if (b > own && next_hi > next_lo)
            prefetch_span(w, next_lo * rb + std::max<int64_t>(a - own, 0), next_lo * rb + (b - own), next_hi * rb);
    };
    ahead(0, PREFETCH_BYTES);
    for (int64_t n0 = lo; n0 < hi; n0 += GEMV_ROWS) {
        const int64_t r = std::min<int64_t>(GEMV_ROWS, hi - n0);
        ahead((n0 - lo) * rb + PREFETCH_BYTES, (n0 + r - lo) * rb + PREFETCH_BYTES);
        rows(n0, (int)r);
    }
}

// Runs fn(u0, u1) on each thread's contiguous, equal slice [u0, u1) of [0, units) (on the
// calling thread alone below PAR_MIN_MACS multiply-adds).
template <typename Fn>
void parallel_slices(int64_t units, int64_t macs, Fn fn) {
    yr::parallel_chunks(units, macs >= PAR_MIN_MACS, fn);
}

// Runs rows(n0, r) over groups of GEMV_ROWS weight rows: each thread takes one
// contiguous, equal slice of whole groups (gemv_range).
template <typename RowsFn>
void gemv_groups(int64_t N, int64_t macs, const void* w, int64_t rb, RowsFn rows) {
    parallel_slices((N + GEMV_ROWS - 1) / GEMV_ROWS, macs, [&](int64_t g0, int64_t g1) {
        gemv_range(g0 * GEMV_ROWS, std::min(N, g1 * GEMV_ROWS), w, rb, rows);
    });
}

// Calls fn<R>() with R = r (1..8): turns the row count of a group into a template argument.
#define YR_DISPATCH_ROWS(r, CALL) \
    switch (r) { case 8: CALL(8); break; case 7: CALL(7); break; case 6: CALL(6); break; \
                 case 5: CALL(5); break; case 4: CALL(4); break; case 3: CALL(3); break; \
                 case 2: CALL(2); break; default: CALL(1); }

// =================================================================================
// Packed GEMM (prefill). PR weight rows are packed into a panel P[k][PR] (row n0+j of W
// is column j), and every x row broadcasts x[m,k] against it: outer-product form, no
// horizontal sums, whole-vector stores. Quantized weights are dequantized while packing,
// once per call, and reused for all M rows.
// =================================================================================

constexpr int PR = 2 * VL;     // weight rows per panel (two vectors)
constexpr int PM = YR_PM;      // x rows per micro-tile

// y[i, 0:nr] = x[i, :] . P[:, 0:nr] (+ bias) for i < mr.
template <int mr>
void panel_kernel(const float* x, int64_t K, const float* P, const float* bias, float* y,
                  int64_t ldy, int nr) {
    vf acc0[mr], acc1[mr];
    for (int i = 0; i < mr; ++i) acc0[i] = acc1[i] = vzero();
    for (int64_t k = 0; k < K; ++k) {
        const vf w0 = vload(P + k * PR), w1 = vload(P + k * PR + VL);
        for (int i = 0; i < mr; ++i) {
            const vf xb = vbroadcast(x + i * K + k);
            acc0[i] = vfma(xb, w0, acc0[i]);
            acc1[i] = vfma(xb, w1, acc1[i]);
        }
    }
    for (int i = 0; i < mr; ++i) {
        float* yi = y + i * ldy;
        if (nr == PR) {
            if (bias) { acc0[i] = vadd(acc0[i], vload(bias)); acc1[i] = vadd(acc1[i], vload(bias + VL)); }
            vstore(yi, acc0[i]);
            vstore(yi + VL, acc1[i]);
        } else {                                  // last panel: only nr columns exist
            float tmp[PR];
            vstore(tmp, acc0[i]);
            vstore(tmp + VL, acc1[i]);
            for (int j = 0; j < nr; ++j) yi[j] = bias ? tmp[j] + bias[j] : tmp[j];
        }
    }
}

#define YR_PANEL_CASE(a) case a: panel_kernel<a>(x, K, P, bias, y, ldy, nr); return;
void panel_any(int mr, const float* x, int64_t K, const float* P, const float* bias, float* y,
               int64_t ldy, int nr) {
    switch (mr) {
        YR_PANEL_CASE(1) YR_PANEL_CASE(2) YR_PANEL_CASE(3) YR_PANEL_CASE(4)
#if YR_PM >= 6
        YR_PANEL_CASE(5) YR_PANEL_CASE(6)
#endif
#if YR_PM >= 8
        YR_PANEL_CASE(7) YR_PANEL_CASE(8)
#endif
        default: return;
    }
}
#undef YR_PANEL_CASE

// dst[t * ldd + l] = src[l][t] for l, t < VL: transposes VL rows of VL floats.
inline void transpose_block(const float* const* src, float* dst, int64_t ldd) {
#if defined(YR_AVX512)
    // unpack_ps + unpack_pd turn each group g of 4 rows into v[4g+c] (c < 4), whose
    // 128-bit lane L holds column 4L+c of those rows; two rounds of shuffle_f32x4 then
    // collect lane L of the 4 groups into column 4L+c.
    __m512 r[16], v[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src[i]);
    for (int g = 0; g < 4; ++g) {
        const __m512d ab_lo = _mm512_castps_pd(_mm512_unpacklo_ps(r[4 * g], r[4 * g + 1]));
        const __m512d ab_hi = _mm512_castps_pd(_mm512_unpackhi_ps(r[4 * g], r[4 * g + 1]));
        const __m512d cd_lo = _mm512_castps_pd(_mm512_unpacklo_ps(r[4 * g + 2], r[4 * g + 3]));
        const __m512d cd_hi = _mm512_castps_pd(_mm512_unpackhi_ps(r[4 * g + 2], r[4 * g + 3]));
        v[4 * g + 0] = _mm512_castpd_ps(_mm512_unpacklo_pd(ab_lo, cd_lo));
        v[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(ab_lo, cd_lo));
        v[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(ab_hi, cd_hi));
        v[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(ab_hi, cd_hi));
    }
    for (int c = 0; c < 4; ++c) {
        const __m512 p0 = _mm512_shuffle_f32x4(v[c], v[4 + c], 0x44);       // g0.L0 g0.L1 g1.L0 g1.L1
        const __m512 p1 = _mm512_shuffle_f32x4(v[c], v[4 + c], 0xEE);       // g0.L2 g0.L3 g1.L2 g1.L3
        const __m512 p2 = _mm512_shuffle_f32x4(v[8 + c], v[12 + c], 0x44);  // g2, g3 likewise
        const __m512 p3 = _mm512_shuffle_f32x4(v[8 + c], v[12 + c], 0xEE);
        _mm512_storeu_ps(dst + (0 + c) * ldd, _mm512_shuffle_f32x4(p0, p2, 0x88));
        _mm512_storeu_ps(dst + (4 + c) * ldd, _mm512_shuffle_f32x4(p0, p2, 0xDD));
        _mm512_storeu_ps(dst + (8 + c) * ldd, _mm512_shuffle_f32x4(p1, p3, 0x88));
        _mm512_storeu_ps(dst + (12 + c) * ldd, _mm512_shuffle_f32x4(p1, p3, 0xDD));
    }
#elif defined(YR_AVX2)
    // Same scheme with two 128-bit lanes: column 4L+c = lane L of v[c] and of v[4+c].
    __m256 r[8], v[8];
    for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src[i]);
    for (int g = 0; g < 2; ++g) {
        const __m256d ab_lo = _mm256_castps_pd(_mm256_unpacklo_ps(r[4 * g], r[4 * g + 1]));
        const __m256d ab_hi = _mm256_castps_pd(_mm256_unpackhi_ps(r[4 * g], r[4 * g + 1]));
        const __m256d cd_lo = _mm256_castps_pd(_mm256_unpacklo_ps(r[4 * g + 2], r[4 * g + 3]));
        const __m256d cd_hi = _mm256_castps_pd(_mm256_unpackhi_ps(r[4 * g + 2], r[4 * g + 3]));
        v[4 * g + 0] = _mm256_castpd_ps(_mm256_unpacklo_pd(ab_lo, cd_lo));
        v[4 * g + 1] = _mm256_castpd_ps(_mm256_unpackhi_pd(ab_lo, cd_lo));
        v[4 * g + 2] = _mm256_castpd_ps(_mm256_unpacklo_pd(ab_hi, cd_hi));
        v[4 * g + 3] = _mm256_castpd_ps(_mm256_unpackhi_pd(ab_hi, cd_hi));
    }
    for (int c = 0; c < 4; ++c) {
        _mm256_storeu_ps(dst + c * ldd, _mm256_permute2f128_ps(v[c], v[4 + c], 0x20));
        _mm256_storeu_ps(dst + (4 + c) * ldd, _mm256_permute2f128_ps(v[c], v[4 + c], 0x31));
    }
#else
    for (int l = 0; l < VL; ++l)
        for (int t = 0; t < VL; ++t) dst[t * ldd + l] = src[l][t];
#endif
}

// Panel packers: P[k * PR + j] = W[j, k] for j < nr, 0 for nr <= j < PR.
void pack_f32(const float* w, int64_t K, int nr, float* P) {
    static const float zeros[VL] = {};
    const int64_t kv = K / VL * VL;
    for (int64_t k0 = 0; k0 < kv; k0 += VL)
        for (int h = 0; h < 2; ++h) {                 // the two vectors of a panel row
            const float* src[VL];
            for (int l = 0; l < VL; ++l) {
                const int j = h * VL + l;
                src[l] = j < nr ? w + j * K + k0 : zeros;
            }
            transpose_block(src, P + k0 * PR + h * VL, PR);
        }
    for (int64_t k = kv; k < K; ++k)
        for (int j = 0; j < PR; ++j) P[k * PR + j] = j < nr ? w[j * K + k] : 0.0f;
}

// Quantized rows: block b of the nr rows is dequantized into tmp[PR][32] (deq(j, b, out): the 32
// weights of block b of the panel's row j), then transposed.
template <typename Deq>
void pack_blocks(int64_t K, int nr, float* P, Deq deq) {
    alignas(64) float tmp[PR][QK];
    for (int j = nr; j < PR; ++j)
        for (int t = 0; t < QK; ++t) tmp[j][t] = 0.0f;
    for (int64_t b = 0; b < K / QK; ++b) {
        for (int j = 0; j < nr; ++j) deq(j, b, tmp[j]);
        for (int h = 0; h < 2; ++h)
            for (int t0 = 0; t0 < QK; t0 += VL) {
                const float* src[VL];
                for (int l = 0; l < VL; ++l) src[l] = tmp[h * VL + l] + t0;
                transpose_block(src, P + (b * QK + t0) * PR + h * VL, PR);
            }
    }
}

// The same for rows of a plain block format, row_bytes apart.
template <void (*deq)(const uint8_t*, float*), int64_t block_bytes>
void pack_quant(const uint8_t* w, int64_t row_bytes, int64_t K, int nr, float* P) {
    pack_blocks(K, nr, P, [&](int j, int64_t b, float* out) { deq(w + j * row_bytes + b * block_bytes, out); });
}

// y[M, N] = x[M, K] @ W^T (+ bias), one panel of PR weight rows per task;
// pack(n0, nr, P) fills the panel of rows n0 .. n0+nr-1.
template <typename Pack>
void linear_packed(const float* x, const float* bias, float* y, int64_t M, int64_t N, int64_t K,
                   Pack pack) {
    const int64_t npanels = (N + PR - 1) / PR;
    yr::parallel_for_dynamic(npanels, M * N * K >= PAR_MIN_MACS, [&](int64_t p) {
        static thread_local std::vector<float> buf;
        float* P = scratch(buf, (size_t)(K * PR));
        const int64_t n0 = p * PR;
        const int nr = (int)std::min<int64_t>(PR, N - n0);
        pack(n0, nr, P);
        for (int64_t m0 = 0; m0 < M; m0 += PM)
            panel_any((int)std::min<int64_t>(PM, M - m0), x + m0 * K, K, P,
                      bias ? bias + n0 : nullptr, y + m0 * N + n0, N, nr);
    });
}

// Records an out-of-range run-time index: status = {1, value, lo, hi} (the first one wins).
// The caller (yirage's executor) reads status after the run and raises IndexOutOfRangeError.
inline void report(int64_t* status, int64_t value, int64_t lo, int64_t hi) {
    if (status && status[0] == 0) {
        status[1] = value;
        status[2] = lo;
        status[3] = hi;
        status[0] = 1;
    }
}

// True if every id is in [0, V); else reports the first bad one.
inline bool ids_in_range(const int64_t* ids, int64_t T, int64_t V, int64_t* status) {
    for (int64_t t = 0; t < T; ++t)
        if (ids[t] < 0 || ids[t] >= V) {
            report(status, ids[t], 0, V);
            return false;
        }
    return true;
}

// Embedding rows: row ids[t] of the table, decoded by row_fn(src_row, dst, D); an id outside
// [0, V) reads nothing and gives a row of zeros (the call also reports it).
template <typename RowFn>
void embedding_rows(const int64_t* ids, float* out, int64_t T, int64_t D, int64_t V, int64_t* status,
                    RowFn row_fn) {
    const bool all_ok = ids_in_range(ids, T, V, status);
    yr::parallel_for(T, T * D >= PAR_MIN_ELEMS, [&](int64_t t) {
        const int64_t id = ids[t];
        if (!all_ok && (id < 0 || id >= V)) std::fill(out + t * D, out + (t + 1) * D, 0.0f);
        else row_fn(id, out + t * D);
    });
}

// The embedding task of the block formats: a = {ids, table, out, T, D, V, status, *}; [lo, hi):
// tokens; row_fn(id, dst) decodes row id. An id outside [0, V) is reported and gives a row of
// zeros (as yr_task_embedding).
template <typename RowFn>
void task_embedding_rows(const int64_t* a, int64_t lo, int64_t hi, int64_t V, RowFn row_fn) {
    const int64_t* ids = reinterpret_cast<const int64_t*>(a[0]);
    float* out = reinterpret_cast<float*>(a[2]);
    const int64_t D = a[4];
    int64_t* status = reinterpret_cast<int64_t*>(a[6]);
    for (int64_t t = lo; t < hi; ++t) {
        const int64_t id = ids[t];
        float* dst = out + t * D;
        if (id < 0 || id >= V) {
            report(status, id, 0, V);
            std::fill(dst, dst + D, 0.0f);
        } else {
            row_fn(id, dst);
        }
    }
}

// Bit i set where lane i of a is NaN / equals lane i of b (ordered).
#if defined(YR_AVX512)
inline uint32_t nan_lanes(vf a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q); }
inline uint32_t equal_lanes(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
#elif defined(YR_AVX2)
inline uint32_t nan_lanes(vf a) { return (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q)); }
inline uint32_t equal_lanes(vf a, vf b) { return (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_EQ_OQ)); }
#endif

// argmax of one row: first index of the maximum; NaN counts as the maximum (torch.argmax).
// SIMD builds: the maximum over whole vectors (the first NaN returned as soon as its vector is
// seen), then the first index holding it; 10x the scalar loop on a 49152-wide LM-head row.
int64_t argmax_row(const float* x, int64_t D) {
#if defined(YR_AVX512) || defined(YR_AVX2)
    if (D >= 4 * VL) {
        vf m[2] = {vload(x), vload(x + VL)};   // two chains: vmax latency
        int64_t i = 0;
        for (; i + 2 * VL <= D; i += 2 * VL) {
            const vf a = vload(x + i), b = vload(x + i + VL);
            if (const uint32_t n = nan_lanes(a) | (nan_lanes(b) << VL)) return i + __builtin_ctz(n);
            m[0] = vmax(m[0], a), m[1] = vmax(m[1], b);
        }
        float bv = vhmax(vmax(m[0], m[1]));
        for (int64_t j = i; j < D; ++j) {
            if (x[j] != x[j]) return j;
            bv = std::max(bv, x[j]);
        }
        const vf target = vbroadcast(&bv);
        for (int64_t j = 0; j + VL <= D; j += VL)
            if (const uint32_t e = equal_lanes(vload(x + j), target)) return j + __builtin_ctz(e);
        for (int64_t j = D / VL * VL; j < D; ++j)
            if (x[j] == bv) return j;
    }
#endif
    int64_t best = 0;
    float bv = x[0];
    if (bv != bv) return 0;
    for (int64_t i = 1; i < D; ++i) {
        const float v = x[i];
        if (v > bv) { bv = v; best = i; }
        else if (v != v) return i;
    }
    return best;
}

// RoPE of one head vector xi [Dh] with table rows c, s [Dh/2] into oi (oi may alias xi).
inline void rope_vec(const float* xi, const float* c, const float* s, float* oi, int64_t Dh) {
    const int64_t half = Dh / 2;
    // Chunks through local copies, so that out == x is safe and the loops vectorize.
    constexpr int CH = 16;
    for (int64_t i0 = 0; i0 < half; i0 += CH) {
        const int n = (int)std::min<int64_t>(CH, half - i0);
        float a[CH], b[CH], ra[CH], rb[CH];
        for (int i = 0; i < n; ++i) { a[i] = xi[i0 + i]; b[i] = xi[half + i0 + i]; }
        for (int i = 0; i < n; ++i) {
            ra[i] = a[i] * c[i0 + i] - b[i] * s[i0 + i];
            rb[i] = b[i] * c[i0 + i] + a[i] * s[i0 + i];
        }
        for (int i = 0; i < n; ++i) { oi[i0 + i] = ra[i]; oi[half + i0 + i] = rb[i]; }
    }
}

// RoPE of row th = t * H + h of x [T, H, Dh] at position p0 + t (see yr_rope).
inline void rope_row(const float* x, const float* cos_table, const float* sin_table, int64_t p0, float* out,
                     int64_t th, int64_t H, int64_t Dh) {
    const int64_t half = Dh / 2, p = p0 + th / H;
    rope_vec(x + th * Dh, cos_table + p * half, sin_table + p * half, out + th * Dh, Dh);
}

// True if every values[t] (t < T) is in [0, hi); else reports the first bad one.
inline bool rows_in_range(const int64_t* values, int64_t T, int64_t hi, int64_t* status) {
    for (int64_t t = 0; t < T; ++t)
        if (values[t] < 0 || values[t] >= hi) {
            report(status, values[t], 0, hi);
            return false;
        }
    return true;
}

}  // namespace

namespace {
// The first key position the query at absolute position p attends: p - W + 1 (clamped at 0)
// in a sliding window of W >= 1 positions, 0 for full causal attention (W = 0). A query sees
// keys first_key(p, W) .. p, i.e. p - W < j <= p: transformers' sliding-window causal mask
// (masking_utils.sliding_window_causal_mask_function: kv_idx > q_idx - W and kv_idx <= q_idx).
inline int64_t first_key(int64_t p, int64_t W) { return W > 0 ? std::max<int64_t>(0, p - W + 1) : 0; }
// Defined with the task kernels below (it shares their register-tiled helpers).
template <typename KV>
void attention_prefill_tiled(const float* q, const KV* k_cache, const KV* v_cache, int64_t p0,
                             float* out, int64_t T, int64_t Hq, int64_t Hkv, int64_t Dh, float scale,
                             int64_t window);
// GEMV (M < GEMM_MIN_M rows of x) for each weight format: y[m, n] for the weight rows that
// groups(w, row_bytes, rows) hands to rows(n0, r): all of N on every thread (gemv_groups, the
// yr_linear_* launches) or one task's slice (gemv_range, the yr_task_linear_* tasks).
template <typename Groups>
void gemv_q4_1(const float* x, const uint8_t* w, const float* bias, float* y, int64_t M, int64_t N, int64_t K,
               Groups groups) {
    const int64_t nb = K / QK, rb = nb * Q4_1_BYTES;
    // sx[m][b] = sum of x row m over block b, for the m * sum(x) term.
    static thread_local std::vector<float> sx_buf;
    float* sx = scratch(sx_buf, (size_t)(M * nb + 1));
    for (int64_t i = 0; i < M * nb; ++i) {
        float s = 0.0f;
        for (int j = 0; j < QK; ++j) s += x[i * QK + j];
        sx[i] = s;
    }
    groups(w, rb, [&](int64_t n0, int r) {
        for (int64_t m = 0; m < M; ++m) {   // the group's weights stay in L1 across the x rows
#define YR_CALL(R) gemv_q4_1_rows<R>(x + m * K, sx + m * nb, w + n0 * rb, rb, nb, \
                                     bias ? bias + n0 : nullptr, y + m * N + n0)
            YR_DISPATCH_ROWS(r, YR_CALL)
#undef YR_CALL
        }
    });
}

template <typename Groups>
void gemv_q8_0(const float* x, const uint8_t* w, const float* bias, float* y, int64_t M, int64_t N, int64_t K,
               Groups groups) {
    const int64_t nb = K / QK, rb = nb * Q8_0_BYTES;
    groups(w, rb, [&](int64_t n0, int r) {
        for (int64_t m = 0; m < M; ++m) {
#define YR_CALL(R) gemv_q8_0_rows<R>(x + m * K, w + n0 * rb, rb, nb, bias ? bias + n0 : nullptr, \
                                     y + m * N + n0)
            YR_DISPATCH_ROWS(r, YR_CALL)
#undef YR_CALL
        }
    });
}

template <typename Groups>
void gemv_f32(const float* x, const float* w, const float* bias, float* y, int64_t M, int64_t N, int64_t K,
              Groups groups) {
    groups(w, K * (int64_t)sizeof(float), [&](int64_t n0, int r) {
        for (int64_t m = 0; m < M; ++m) {
#define YR_CALL(R) gemv_f32_rows<R>(x + m * K, w + n0 * K, K, bias ? bias + n0 : nullptr, y + m * N + n0)
            YR_DISPATCH_ROWS(r, YR_CALL)
#undef YR_CALL
        }
    });
}

// =================================================================================
// int8-activation GEMV (opt-in: linear's compute_dtype='int8', yr.LLM(decode_dtype='int8'))
// =================================================================================
// llama.cpp's decode numerics: each row of x is quantized per block of 32 values to int8
// (dx = amax / 127, xq = round-half-even(x / dx), 0 where amax == 0; ir.ops
// quantize_blocks_int8 is the reference), and each weight block's dot product runs in
// integers: y[r] = sum_b d_b * dx_b * sum_j q_j xq_j (+ m_b * dx_b * sum_j xq_j for q4_1).
// The integer sums are exact; only the float combination rounds. A dot of 32 quants is
// one vpdpbusd (AVX512-VNNI or AVX-VNNI: u8 x s8 in groups of 4 into int32), else vpmaddubsw
// + vpmaddwd (AVX2, q4_1: |q * xq| pairs fit int16) or int16 widening (AVX2, q8_0), else
// scalar. On a Zen 4 (2 cores, q4_1 1536 x 576 GEMVs streamed from DRAM) it read 1.2x the
// GB/s of the float32 kernel, which is bound by its own instructions there.

// Quantizes n blocks of 32 floats: xq[32b + j], dx[b] and sxq[b] = dx[b] * sum_j xq[32b + j].
inline void quantize_blocks_q8(const float* x, int64_t n, int8_t* xq, float* dx, float* sxq) {
    for (int64_t b = 0; b < n; ++b) {
        const float* xb = x + b * QK;
        int8_t* qb = xq + b * QK;
#if defined(YR_AVX512)
        const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
#else
        float amax = 0.0f;
        for (int j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(xb[j]));
#endif
        const float d = amax / 127.0f;
        dx[b] = d;
        if (!(d > 0.0f)) {   // zeros (or a NaN amax): all quants 0
            std::memset(qb, 0, QK);
            sxq[b] = 0.0f;
            continue;
        }
        int sum = 0;
#if defined(YR_AVX512)
        const __m512 dv = _mm512_set1_ps(d), lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
        const auto q16 = [&](__m512 v) {   // x / d, rounded half-even, clamped (a NaN becomes 127)
            const __m512 r = _mm512_roundscale_ps(_mm512_div_ps(v, dv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            return _mm512_cvtps_epi32(_mm512_max_ps(_mm512_min_ps(r, hi), lo));
        };
        const __m512i i0 = q16(v0), i1 = q16(v1);
        _mm_storeu_si128((__m128i*)qb, _mm512_cvtepi32_epi8(i0));
        _mm_storeu_si128((__m128i*)(qb + 16), _mm512_cvtepi32_epi8(i1));
        sum = _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
#else
        for (int j = 0; j < QK; ++j) {
            const float r = std::nearbyint(xb[j] / d);   // the default rounding mode: half-even
            const int q = (int)std::max(-127.0f, std::min(127.0f, r == r ? r : 127.0f));
            qb[j] = (int8_t)q;
            sum += q;
        }
#endif
        sxq[b] = d * (float)sum;
    }
}

#if defined(YR_AVX512) || defined(YR_AVX2)
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(YR_AVX512)
#define YR_Q8_VNNI 1
// 8 int32: sums of u[4i..4i+3] * s[4i..4i+3] (u unsigned, s signed bytes), exact.
inline __m256i dot_u8s8(__m256i u, __m256i s) { return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s); }
#elif defined(__AVXVNNI__)
#define YR_Q8_VNNI 1
inline __m256i dot_u8s8(__m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s); }
#endif
#endif

#if defined(YR_NEON)
// sum over 4 int32 lanes = a0 . b0 + a1 . b1 (32 signed bytes each side), exact: sdot
// (ARMv8.2 dotprod) where the target has it, else widening multiplies (smull/smlal2: a pair
// of products fits int16, |127 * 128| * 2 < 2^15) and pairwise adds into int32.
inline int32x4_t dot_s8x32(int8x16_t a0, int8x16_t b0, int8x16_t a1, int8x16_t b1) {
#if defined(__ARM_FEATURE_DOTPROD)
    return vdotq_s32(vdotq_s32(vdupq_n_s32(0), a0, b0), a1, b1);
#else
    const int16x8_t p0 = vmlal_high_s8(vmull_s8(vget_low_s8(a0), vget_low_s8(b0)), a0, b0);
    const int16x8_t p1 = vmlal_high_s8(vmull_s8(vget_low_s8(a1), vget_low_s8(b1)), a1, b1);
    return vpadalq_s16(vpaddlq_s16(p0), p1);
#endif
}
#endif

// q4_1 x int8: R weight rows; xq/dx/sxq: one x row quantized (quantize_blocks_q8).
template <int R>
inline void gemv_q4_1_q8_rows(const int8_t* xq, const float* dx, const float* sxq, const uint8_t* w, int64_t rb,
                              int64_t nb, const float* bias, float* y) {
#if defined(YR_AVX512) || defined(YR_AVX2)
    float macc[R];
    for (int r = 0; r < R; ++r) macc[r] = 0.0f;
    const __m256i low4 = _mm256_set1_epi8(0x0F);
#if !defined(YR_Q8_VNNI)
    const __m256i ones16 = _mm256_set1_epi16(1);
#endif
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        __m256i xv = _mm256_loadu_si256((const __m256i*)(xq + b * QK));
        YR_IN_REGISTER(xv);
        const float dxb = dx[b], sb = sxq[b];
        for (int r = 0; r < R; ++r) {
            const uint8_t* blk = w + r * rb + b * Q4_1_BYTES;
            const __m128i raw = _mm_loadu_si128((const __m128i*)(blk + 4));
            // quants 0..15 (low nibbles), then 16..31 (high nibbles): x's order
            const __m256i q = _mm256_and_si256(
                _mm256_inserti128_si256(_mm256_castsi128_si256(raw), _mm_srli_epi16(raw, 4), 1), low4);
#if defined(YR_Q8_VNNI)
            const __m256i s = dot_u8s8(q, xv);
#else
            const __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), ones16);  // |pair| <= 3810
#endif
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(F16.v[load_u16(blk)] * dxb), _mm256_cvtepi32_ps(s), acc[r]);
            macc[r] += F16.v[load_u16(blk + 2)] * sb;
        }
    }
    for (int r = 0; r < R; ++r) {
        const float s = hsum8(acc[r]) + macc[r];
        y[r] = bias ? s + bias[r] : s;
    }
#elif defined(YR_NEON)
    float32x4_t acc[R];
    float macc[R];
    for (int r = 0; r < R; ++r) { acc[r] = vdupq_n_f32(0.0f); macc[r] = 0.0f; }
    for (int64_t b = 0; b < nb; ++b) {
        const int8x16_t x0 = vld1q_s8(xq + b * QK), x1 = vld1q_s8(xq + b * QK + 16);
        const float dxb = dx[b], sb = sxq[b];
        for (int r = 0; r < R; ++r) {
            const uint8_t* blk = w + r * rb + b * Q4_1_BYTES;
            const uint8x16_t raw = vld1q_u8(blk + 4);
            // quants 0..15 (low nibbles) pair with x[0..15], 16..31 (high nibbles) with x[16..31]
            const int32x4_t s = dot_s8x32(vreinterpretq_s8_u8(vandq_u8(raw, vdupq_n_u8(0x0F))), x0,
                                          vreinterpretq_s8_u8(vshrq_n_u8(raw, 4)), x1);
            acc[r] = vfmaq_n_f32(acc[r], vcvtq_f32_s32(s), fp16_to_fp32(load_u16(blk)) * dxb);
            macc[r] += fp16_to_fp32(load_u16(blk + 2)) * sb;
        }
    }
    for (int r = 0; r < R; ++r) {
        const float s = vaddvq_f32(acc[r]) + macc[r];
        y[r] = bias ? s + bias[r] : s;
    }
#else
    for (int r = 0; r < R; ++r) {
        float s = 0.0f;
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t* blk = w + r * rb + b * Q4_1_BYTES;
            const int8_t* xb = xq + b * QK;
            int t = 0;
            for (int j = 0; j < 16; ++j) t += (blk[4 + j] & 15) * xb[j] + (blk[4 + j] >> 4) * xb[j + 16];
            s += fp16_to_fp32(load_u16(blk)) * dx[b] * (float)t + fp16_to_fp32(load_u16(blk + 2)) * sxq[b];
        }
        y[r] = bias ? s + bias[r] : s;
    }
#endif
}

// q8_0 x int8: R weight rows (sxq unused: q8_0 has no offset).
template <int R>
inline void gemv_q8_0_q8_rows(const int8_t* xq, const float* dx, const float*, const uint8_t* w, int64_t rb,
                              int64_t nb, const float* bias, float* y) {
#if defined(YR_AVX512) || defined(YR_AVX2)
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
#if defined(YR_Q8_VNNI)
    // vpdpbusd multiplies unsigned by signed bytes: xq + 128 (unsigned) times q, minus 128 * sum(q)
    const __m256i bias128 = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi8(1);
#endif
    for (int64_t b = 0; b < nb; ++b) {
        const __m256i xs = _mm256_loadu_si256((const __m256i*)(xq + b * QK));
#if defined(YR_Q8_VNNI)
        __m256i xv = _mm256_xor_si256(xs, bias128);   // xq + 128 as an unsigned byte
#else
        __m256i xv = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(xs));
        __m256i xv1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(xs, 1));
        YR_IN_REGISTER(xv1);
#endif
        YR_IN_REGISTER(xv);
        const float dxb = dx[b];
        if (b % 8 == 0)   // as gemv_q8_0_rows
            for (int r = 0; r < R; ++r) prefetch_bytes(w + r * rb + (b + 24) * Q8_0_BYTES, 8 * Q8_0_BYTES + 64);
        for (int r = 0; r < R; ++r) {
            const uint8_t* blk = w + r * rb + b * Q8_0_BYTES;
            const __m256i q = _mm256_loadu_si256((const __m256i*)(blk + 2));
#if defined(YR_Q8_VNNI)
            const __m256i s = _mm256_sub_epi32(dot_u8s8(xv, q), _mm256_slli_epi32(dot_u8s8(ones, q), 7));
#else
            const __m256i s = _mm256_add_epi32(
                _mm256_madd_epi16(xv, _mm256_cvtepi8_epi16(_mm256_castsi256_si128(q))),
                _mm256_madd_epi16(xv1, _mm256_cvtepi8_epi16(_mm256_extracti128_si256(q, 1))));
#endif
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(F16.v[load_u16(blk)] * dxb), _mm256_cvtepi32_ps(s), acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) {
        const float s = hsum8(acc[r]);
        y[r] = bias ? s + bias[r] : s;
    }
#elif defined(YR_NEON)
    float32x4_t acc[R];
    for (int r = 0; r < R; ++r) acc[r] = vdupq_n_f32(0.0f);
    for (int64_t b = 0; b < nb; ++b) {
        const int8x16_t x0 = vld1q_s8(xq + b * QK), x1 = vld1q_s8(xq + b * QK + 16);
        const float dxb = dx[b];
        for (int r = 0; r < R; ++r) {
            const uint8_t* blk = w + r * rb + b * Q8_0_BYTES;
            const int32x4_t s = dot_s8x32(vld1q_s8((const int8_t*)(blk + 2)), x0, vld1q_s8((const int8_t*)(blk + 18)), x1);
            acc[r] = vfmaq_n_f32(acc[r], vcvtq_f32_s32(s), fp16_to_fp32(load_u16(blk)) * dxb);
        }
    }
    for (int r = 0; r < R; ++r) {
        const float s = vaddvq_f32(acc[r]);
        y[r] = bias ? s + bias[r] : s;
    }
#else
    for (int r = 0; r < R; ++r) {
        float s = 0.0f;
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t* blk = w + r * rb + b * Q8_0_BYTES;
            const int8_t* q = (const int8_t*)(blk + 2);
            int t = 0;
            for (int j = 0; j < QK; ++j) t += q[j] * xq[b * QK + j];
            s += fp16_to_fp32(load_u16(blk)) * dx[b] * (float)t;
        }
        y[r] = bias ? s + bias[r] : s;
    }
#endif
}

// x [M, K] quantized by quantize_blocks_q8: xq [M * K], dx and sxq [M * K / 32].
struct QuantizedRows {
    const int8_t* xq;
    const float* dx;
    const float* sxq;
};

// ... into the calling thread's scratch (valid until its next call): the launch forms.
inline QuantizedRows quantize_rows_q8(const float* x, int64_t M, int64_t K) {
    const int64_t nb = K / QK;
    static thread_local std::vector<float> s_buf;
    static thread_local std::vector<int8_t> q_buf;
    float* dx = scratch(s_buf, (size_t)(2 * M * nb + 1));
    if (q_buf.size() < (size_t)(M * K + 1)) q_buf.resize((size_t)(M * K + 1));
    quantize_blocks_q8(x, M * nb, q_buf.data(), dx, dx + M * nb);
    return {q_buf.data(), dx, dx + M * nb};
}

// ... into one buffer that an op of its own fills for the task forms (yr_task_quantize_rows_q8),
// so that x is quantized once per linear, not once per task: xq, then dx and sxq from the
// 64-byte-aligned offset q8_rows_scales_at (q8_rows_bytes in all).
inline int64_t q8_rows_scales_at(int64_t M, int64_t K) { return (M * K + 63) / 64 * 64; }
inline int64_t q8_rows_bytes(int64_t M, int64_t K) { return q8_rows_scales_at(M, K) + 2 * M * (K / QK) * 4; }
inline QuantizedRows q8_rows_in(const uint8_t* buf, int64_t M, int64_t K) {
    const float* dx = reinterpret_cast<const float*>(buf + q8_rows_scales_at(M, K));
    return {reinterpret_cast<const int8_t*>(buf), dx, dx + M * (K / QK)};
}

// The int8-activation GEMV of every x row (M of them, quantized: q) on the weight rows
// groups(...) hands out (as gemv_q4_1).
template <bool Q4_1, typename Groups>
void gemv_q8_act(const QuantizedRows& q, const uint8_t* w, const float* bias, float* y, int64_t M, int64_t N,
                 int64_t K, Groups groups) {
    const int64_t nb = K / QK, rb = nb * (Q4_1 ? Q4_1_BYTES : Q8_0_BYTES);
    const int8_t* xq = q.xq;
    const float *dx = q.dx, *sxq = q.sxq;
    groups(w, rb, [&](int64_t n0, int r) {
        for (int64_t m = 0; m < M; ++m) {
#define YR_CALL(R) (Q4_1 ? gemv_q4_1_q8_rows<R>(xq + m * K, dx + m * nb, sxq + m * nb, w + n0 * rb, rb, nb, \
                                                bias ? bias + n0 : nullptr, y + m * N + n0)                 \
                         : gemv_q8_0_q8_rows<R>(xq + m * K, dx + m * nb, sxq + m * nb, w + n0 * rb, rb, nb, \
                                                bias ? bias + n0 : nullptr, y + m * N + n0))
            YR_DISPATCH_ROWS(r, YR_CALL)
#undef YR_CALL
        }
    });
}

#if defined(YR_AVX512)
// Small-batch GEMM on q4_1 / q8_0 blocks (continuous batching's decode steps: QUANT_ROWS_MIN_M ..
// QUANT_ROWS_MAX_M rows of x; the tied LM head is q8_0 in the default model). The packed GEMM
// below dequantizes and transposes every weight into panels, which at 16 rows costs about as much
// as the multiply-adds. Here each block of two weight rows is decoded once per tile of up to 8 x
// rows into four vectors and multiplied in dot-product form: 16 accumulators (2 weight rows x 8
// x rows), a horizontal sum per output. Weight rows are split over the threads, so each weight
// is read from memory once.
// From 2 rows on: the GEMV decodes each block once per x row, the tiles once per 8 rows (a
// SmolLM2-135M step of 2 / 4 rows on 2 Zen 4 cores: 14.9 -> 11.5 / 27.4 -> 16.5 ms).
constexpr int64_t QUANT_ROWS_MIN_M = 2, QUANT_ROWS_MAX_M = 16;
inline bool quant_rows_launch(int64_t M, int64_t) { return M >= QUANT_ROWS_MIN_M && M <= QUANT_ROWS_MAX_M; }

// A block's 32 weights as two vectors (0..15, 16..31).
struct DecodeQ4_1 {
    static constexpr int64_t BYTES = Q4_1_BYTES;
    static inline void decode(const uint8_t* blk, __m512& lo, __m512& hi) {
        // gemv_q4_1_rows' table: d * {0..15} + m, looked up by vpermps with each nibble
        const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512 lut = _mm512_fmadd_ps(_mm512_set1_ps(F16.v[load_u16(blk)]), iota,
                                           _mm512_set1_ps(F16.v[load_u16(blk + 2)]));
        const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(blk + 4)));
        lo = _mm512_permutexvar_ps(q, lut);
        hi = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), lut);
    }
};

struct DecodeQ8_0 {
    static constexpr int64_t BYTES = Q8_0_BYTES;
    static inline void decode(const uint8_t* blk, __m512& lo, __m512& hi) {
        const __m512 d = _mm512_set1_ps(F16.v[load_u16(blk)]);
        lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(blk + 2)))));
        hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(blk + 18)))));
    }
};

template <typename D, int MR, int NR>
inline void quant_rows_tile(const float* x, int64_t K, const uint8_t* w, int64_t rb, int64_t nb,
                            const float* bias, float* y, int64_t ldy) {
    __m512 acc[NR][MR];
    for (int r = 0; r < NR; ++r)
        for (int i = 0; i < MR; ++i) acc[r][i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        __m512 lo[NR], hi[NR];
        for (int r = 0; r < NR; ++r) D::decode(w + r * rb + b * D::BYTES, lo[r], hi[r]);
        for (int i = 0; i < MR; ++i) {
            __m512 xlo = _mm512_loadu_ps(x + i * K + b * QK), xhi = _mm512_loadu_ps(x + i * K + b * QK + 16);
            if (NR > 1) {   // one load for the NR FMAs (see vreg)
                vreg(xlo);
                vreg(xhi);
            }
            for (int r = 0; r < NR; ++r) {
                acc[r][i] = _mm512_fmadd_ps(xlo, lo[r], acc[r][i]);
                acc[r][i] = _mm512_fmadd_ps(xhi, hi[r], acc[r][i]);
            }
        }
    }
    for (int r = 0; r < NR; ++r)
        for (int i = 0; i < MR; ++i) {
            const float s = _mm512_reduce_add_ps(acc[r][i]);
            y[i * ldy + r] = bias ? s + bias[r] : s;
        }
}

#else
// The same small-batch GEMM without AVX-512 (AVX2, NEON, scalar), in dot-product form. Up to
// QROWS_BLOCK_M x rows, one weight row at a time, each block dequantized (dequant_block_*:
// vectorized) into 32 floats in L1 and multiplied against the rows (8 accumulators; up to 4
// rows, both weight rows at once); above, two weight rows dequantized whole into a row buffer
// once per call, then tiles of QROWS_TILE_M x rows against it (2 x 6 accumulators: 12 of 16 ymm).
// The packed GEMM dequantizes and transposes every weight into panels, which costs more than it
// saves up to about 128 rows. q4_1 1536 x 576 on 2 threads at YIRAGE_ISA=avx2 (AMD EPYC Zen 5),
// blocks / row buffer / packed GEMM: 8 rows 76 / 101 / 147 us, 32 rows 365 / 332 / 451, 128 rows
// 1454 / 1233 / 1709; 256 rows even; 2 rows, both weight rows per block 31 us, one 43, the GEMV 44.
constexpr int64_t QUANT_ROWS_MIN_M = 2;
#ifndef YR_QROWS_MAX_M
#define YR_QROWS_MAX_M 128
#endif
constexpr int64_t QUANT_ROWS_MAX_M = YR_QROWS_MAX_M;
// A launch (not a task slice) takes the row path above QUANT_ROWS_MAX_M rows too while x holds
// at most this many floats (8 MiB: each group of weight rows reads x once, from L2/L3): with
// the x vectors kept in registers (vreg) it beats the packed GEMM, whose dequantize-and-pack of
// every weight costs it; q4_1 785 x 576 -> 1536 on 2 threads at YIRAGE_ISA=avx2: 9877 us packed,
// 5978 rows.
constexpr int64_t QUANT_ROWS_MAX_X = int64_t(1) << 21;
inline bool quant_rows_launch(int64_t M, int64_t K) {
    return M >= QUANT_ROWS_MIN_M && (M <= QUANT_ROWS_MAX_M || M * K <= QUANT_ROWS_MAX_X);
}

struct DecodeQ4_1 {
    static constexpr int64_t BYTES = Q4_1_BYTES;
    static inline void decode(const uint8_t* blk, float* out) { dequant_block_q4_1(blk, out); }
};

struct DecodeQ8_0 {
    static constexpr int64_t BYTES = Q8_0_BYTES;
    static inline void decode(const uint8_t* blk, float* out) { dequant_block_q8_0(blk, out); }
};

constexpr int QROWS_TILE_M = 6;
#ifndef YR_QROWS_GROUP_PAIRS
#define YR_QROWS_GROUP_PAIRS 4
#endif
#ifndef YR_QROWS_GROUP_MAX_PAIRS
#define YR_QROWS_GROUP_MAX_PAIRS 48
#endif
constexpr int64_t QROWS_GROUP_PAIRS = YR_QROWS_GROUP_PAIRS, QROWS_GROUP_MAX_PAIRS = YR_QROWS_GROUP_MAX_PAIRS;

// Weight rows per group of gemm_quant_rows (even): more rows per pass over x, up to 96, while
// every thread still gets 4 groups or more. x is read once per group: q4_1 on 2 threads at
// YIRAGE_ISA=avx2 (AMD EPYC Zen 5), 785 x 576 -> 1536 with 8 rows per group 6749 us, 32 rows
// 6049, 96 rows 5837; at 128 x 576 -> 1536 alike (1001-1032 us).
inline int64_t quant_rows_group_rows(int64_t N) {
    const int64_t per_thread = N / (4 * (int64_t)yr::max_threads());
    return 2 * std::max(QROWS_GROUP_PAIRS, std::min(QROWS_GROUP_MAX_PAIRS, per_thread / 2));
}
#ifndef YR_QROWS_BLOCK_M
#define YR_QROWS_BLOCK_M 16
#endif
constexpr int64_t QROWS_BLOCK_M = YR_QROWS_BLOCK_M;

// y[i, r] = x[i] . w_r (+ bias[r]) for i < MR, r < NR: the NR weight rows (rb bytes apart)
// read block by block.
template <typename D, int MR, int NR>
inline void quant_rows_blocks(const float* x, int64_t K, const uint8_t* w, int64_t rb, int64_t nb, const float* bias,
                              float* y, int64_t ldy) {
    alignas(64) float wb[NR][QK];
    vf acc[NR][MR];
    for (int r = 0; r < NR; ++r)
        for (int i = 0; i < MR; ++i) acc[r][i] = vzero();
    for (int64_t b = 0; b < nb; ++b) {
        for (int r = 0; r < NR; ++r) D::decode(w + r * rb + b * D::BYTES, wb[r]);
#pragma GCC unroll 8
        for (int v = 0; v < QK; v += VL) {
            vf wv[NR];
#pragma GCC unroll 2
            for (int r = 0; r < NR; ++r) wv[r] = vload(wb[r] + v);
#pragma GCC unroll 8
            for (int i = 0; i < MR; ++i) {
                vf xv = vload(x + i * K + b * QK + v);
                if (NR > 1) vreg(xv);   // one load for the NR FMAs
#pragma GCC unroll 2
                for (int r = 0; r < NR; ++r) acc[r][i] = vfma(xv, wv[r], acc[r][i]);
            }
        }
    }
    for (int r = 0; r < NR; ++r)
        for (int i = 0; i < MR; ++i) {
            const float s = vsum(acc[r][i]);
            y[i * ldy + r] = bias ? s + bias[r] : s;
        }
}

// y[i, r] = x[i] . wr[r] (+ bias[r]) for i < MR, r < NR: dequantized weight rows wr (K floats
// each, ldw apart) against MR rows of x.
template <int MR, int NR>
inline void quant_rows_dots(const float* x, int64_t K, const float* wr, int64_t ldw, const float* bias, float* y,
                            int64_t ldy) {
    vf acc[NR][MR];
    for (int r = 0; r < NR; ++r)
        for (int i = 0; i < MR; ++i) acc[r][i] = vzero();
    int64_t k = 0;
    for (; k + VL <= K; k += VL) {
        vf wv[NR];
#pragma GCC unroll 4
        for (int r = 0; r < NR; ++r) wv[r] = vload(wr + r * ldw + k);
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) {
            vf xv = vload(x + i * K + k);
            if (NR > 1) vreg(xv);   // one load for the NR FMAs
#pragma GCC unroll 4
            for (int r = 0; r < NR; ++r) acc[r][i] = vfma(xv, wv[r], acc[r][i]);
        }
    }
    for (int r = 0; r < NR; ++r)
        for (int i = 0; i < MR; ++i) {
            float s = vsum(acc[r][i]);
            for (int64_t t = k; t < K; ++t) s += x[i * K + t] * wr[r * ldw + t];   // K % VL (never: K % 32 == 0)
            y[i * ldy + r] = bias ? s + bias[r] : s;
        }
}

// Outputs (weight rows) n0 and n0 + 1 (n0 alone when n0 + 1 == n_end) of every x row, for up to
// QROWS_BLOCK_M rows (more take quant_rows_group).
template <typename D>
inline void quant_rows_pair(const float* x, const uint8_t* w, const float* bias, float* y, int64_t M, int64_t N,
                            int64_t K, int64_t n0, int64_t n_end) {
    const int64_t nb = K / QK, rb = nb * D::BYTES;
    const int nr = n0 + 1 < n_end ? 2 : 1;
    const float* bn = bias ? bias + n0 : nullptr;
    if (M <= 4) {   // both weight rows per block: 2 x M accumulators
#define YR_CALL(R) (nr == 2 ? quant_rows_blocks<D, R, 2>(x, K, w + n0 * rb, rb, nb, bn, y + n0, N) \
                            : quant_rows_blocks<D, R, 1>(x, K, w + n0 * rb, rb, nb, bn, y + n0, N))
        YR_DISPATCH_ROWS((int)M, YR_CALL)
#undef YR_CALL
        return;
    }
    // one weight row at a time: two rows' blocks and 2 x 8 sums outgrow 16 ymm
    for (int r = 0; r < nr; ++r)
        for (int64_t m0 = 0; m0 < M; m0 += 8) {
            const int mr = (int)std::min<int64_t>(8, M - m0);
            const float* br = bias ? bias + n0 + r : nullptr;
#define YR_CALL(R) quant_rows_blocks<D, R, 1>(x + m0 * K, K, w + (n0 + r) * rb, rb, nb, br, y + m0 * N + n0 + r, N)
            YR_DISPATCH_ROWS(mr, YR_CALL)
#undef YR_CALL
        }
}

// Above QROWS_BLOCK_M rows: the weight rows [n0, n1) (up to 2 * QROWS_GROUP_MAX_PAIRS)
// dequantized whole into a row buffer (L2), then for each tile of QROWS_TILE_M x rows (kept in L1) every
// pair of them: 2 x 6 accumulators. Walking the pairs inside the tile streams the weights, 2
// loads per 12 FMAs, from L2 instead of the x rows, 6 per 12: with one pair per pass over x,
// the x rows (M x K floats, more than L1 holds) came from L2 at 6 loads per 12 FMAs. With vreg
// keeping each x vector in a register for both FMAs, q4_1 on 2 threads at YIRAGE_ISA=avx2 (AMD
// EPYC Zen 5), 128 x 576 -> 1536: 1337 us (169 GFLOP/s) -> 1249 (groups) -> 1001 (226 GFLOP/s);
// 128 x 1536 -> 576: 1383 -> 972 us; 64 x 576 -> 1536: 683 -> 523 us.
template <typename D>
inline void quant_rows_group(const float* x, const uint8_t* w, const float* bias, float* y, int64_t M, int64_t N,
                             int64_t K, int64_t n0, int64_t n1) {
    static thread_local std::vector<float> buf;
    const int64_t nb = K / QK, rb = nb * D::BYTES, rows = n1 - n0;
    float* wr = scratch(buf, (size_t)(rows * K));
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t b = 0; b < nb; ++b) D::decode(w + (n0 + r) * rb + b * D::BYTES, wr + r * K + b * QK);
    for (int64_t m0 = 0; m0 < M; m0 += QROWS_TILE_M) {
        const int mr = (int)std::min<int64_t>(QROWS_TILE_M, M - m0);
        const float* xm = x + m0 * K;
        for (int64_t p = 0; p < rows; p += 2) {
            const int nr = p + 1 < rows ? 2 : 1;
            const float* wp = wr + p * K;
            const float* bn = bias ? bias + n0 + p : nullptr;
            float* yo = y + m0 * N + n0 + p;
#define YR_CALL(R) (nr == 2 ? quant_rows_dots<R, 2>(xm, K, wp, K, bn, yo, N) : quant_rows_dots<R, 1>(xm, K, wp, K, bn, yo, N))
            YR_DISPATCH_ROWS(mr, YR_CALL)
#undef YR_CALL
        }
    }
}
#endif

#if defined(YR_AVX512)
// Outputs (weight rows) n0 and n0 + 1 (n0 alone when n0 + 1 == n_end) of every x row.
template <typename D>
inline void quant_rows_pair(const float* x, const uint8_t* w, const float* bias, float* y, int64_t M, int64_t N,
                            int64_t K, int64_t n0, int64_t n_end) {
    const int64_t nb = K / QK, rb = nb * D::BYTES;
    const bool two = n0 + 1 < n_end;
    for (int64_t m0 = 0; m0 < M; m0 += 8) {
        const int mr = (int)std::min<int64_t>(8, M - m0);
        const float* xm = x + m0 * K;
        const float* bn = bias ? bias + n0 : nullptr;
        float* yo = y + m0 * N + n0;
#define YR_CALL(R) (two ? quant_rows_tile<D, R, 2>(xm, K, w + n0 * rb, rb, nb, bn, yo, N) \
                        : quant_rows_tile<D, R, 1>(xm, K, w + n0 * rb, rb, nb, bn, yo, N))
        YR_DISPATCH_ROWS(mr, YR_CALL)
#undef YR_CALL
    }
}
#endif

template <typename D>
void gemm_quant_rows(const float* x, const uint8_t* w, const float* bias, float* y, int64_t M, int64_t N, int64_t K) {
#if !defined(YR_AVX512)
    if (M > QROWS_BLOCK_M) {   // groups of weight rows against L1-sized tiles of x
        const int64_t per = quant_rows_group_rows(N), groups = (N + per - 1) / per;
        yr::parallel_for(groups, M * N * K >= PAR_MIN_MACS, [&](int64_t g) {
            quant_rows_group<D>(x, w, bias, y, M, N, K, g * per, std::min(N, (g + 1) * per));
        });
        return;
    }
#endif
    const int64_t pairs = (N + 1) / 2;
    yr::parallel_for(pairs, M * N * K >= PAR_MIN_MACS,
                     [&](int64_t p) { quant_rows_pair<D>(x, w, bias, y, M, N, K, 2 * p, N); });
}

// The same for the weight rows [lo, hi) (a task's slice; lo even, as GEMV_ROWS slices are).
template <typename D>
void gemm_quant_rows_range(const float* x, const uint8_t* w, const float* bias, float* y, int64_t M, int64_t N,
                           int64_t K, int64_t lo, int64_t hi) {
#if !defined(YR_AVX512)
    if (M > QROWS_BLOCK_M) {
        const int64_t per = 2 * QROWS_GROUP_PAIRS;   // a task's slice: already one of many
        for (int64_t n0 = lo; n0 < hi; n0 += per) quant_rows_group<D>(x, w, bias, y, M, N, K, n0, std::min(hi, n0 + per));
        return;
    }
#endif
    for (int64_t n0 = lo; n0 < hi; n0 += 2) quant_rows_pair<D>(x, w, bias, y, M, N, K, n0, hi);
}

// The two ways of handing out row groups (see gemv_q4_1).
#define YR_ALL_GROUPS [&](const void* wp, int64_t rowb, auto rows) { gemv_groups(N, M * N * K, wp, rowb, rows); }
// A linear task's argument block ends with `stride`: its next slice (the one its worker likely
// takes next, on W workers: W slices on) starts stride rows after lo; 0: none. Only its
// prefetches use it, clipped to the weight's N rows.
#define YR_TASK_GROUPS [&](const void* wp, int64_t rowb, auto rows) {                           \
        const int64_t next_lo = a[7] > 0 && a[7] < N - lo ? lo + a[7] : N;                        \
        gemv_range(lo, hi, wp, rowb, rows, next_lo, std::min(N, next_lo + (hi - lo))); }

}  // namespace
