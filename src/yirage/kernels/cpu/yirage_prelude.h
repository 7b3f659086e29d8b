// Helpers that every generated fused row kernel (yirage/codegen/cpp.py) includes, with
// yr_threads.h's parallel loops.
// All arithmetic in generated kernels is float32; float16 is stored as yr_f16 (the compiler's
// half type, converted by casts), bfloat16 as uint16_t and converted with the two functions below.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "yr_threads.h"

// IEEE binary16: __fp16 on Arm (g++'s C++ has no _Float16 there; __fp16 converts to and from
// float with casts, which is all the kernels do with it), _Float16 elsewhere (x86-64: SSE2 and up).
#if defined(__aarch64__) || defined(__arm__)
typedef __fp16 yr_f16;
#else
typedef _Float16 yr_f16;
#endif
static_assert(sizeof(yr_f16) == 2, "yr_f16 must be a 16-bit float");

// bfloat16 -> float32: the 16 bits are the high half of a float32 (exact).
static inline float yr_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// float32 -> bfloat16, rounding to nearest even; NaN stays a (quiet) NaN.
static inline uint16_t yr_f32_to_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

// erf(x) in float32 without libm: a rational approximation (odd degree-13 numerator over an
// even degree-8 denominator in x, the one Eigen and XLA use for float erf) on x clamped to
// [-4, 4] (erf is +-1 to float precision beyond). Absolute error <= 5e-7 (measured against
// float64 erf on a 2e6-point grid over [-6, 6]). Pure arithmetic, so GCC vectorizes it in the
// `omp simd` row loops (std::erf is a scalar libm call: GELU (erf) ran ~15x slower).
static inline float yr_erf(float x) {
    x = std::min(std::max(x, -4.0f), 4.0f);
    const float x2 = x * x;
    float p = -2.72614225801306e-10f;
    p = p * x2 + 2.77068142495902e-08f;
    p = p * x2 - 2.10102402082508e-06f;
    p = p * x2 - 5.69250639462346e-05f;
    p = p * x2 - 7.34990630326855e-04f;
    p = p * x2 - 2.95459980854025e-03f;
    p = p * x2 - 1.60960333262415e-02f;
    float q = -1.45660718464996e-05f;
    q = q * x2 - 2.13374055278905e-04f;
    q = q * x2 - 1.68282697438203e-03f;
    q = q * x2 - 7.37332916720468e-03f;
    q = q * x2 - 1.42647390514189e-02f;
    return x * p / q;
}

// exp(x) in float32 without libm (Cephes expf: x = n ln2 + r, |r| <= ln2/2, e^r by a degree-6
// polynomial, times 2^n built in the exponent bits), within 1.3 ulp of float64 exp (measured on
// a 4e6-point grid over [-87, 88]). Pure arithmetic, so GCC vectorizes it in the `omp simd` row
// loops; std::exp is a scalar libm call there (softmax, SiLU and sigmoid ran several times slower).
// x >= 88.7228 gives inf (x is clamped to 88.8: n = 128 and e^r > 1, so the scaling overflows),
// x < -87.33 gives 0 (libm gives a subnormal there, below 1.2e-38), NaN stays NaN. n is rounded
// with the 1.5 * 2^23 trick (round to nearest; exact for |n| < 2^22); 2^n is applied as
// 2^(n >> 1) * 2^(n - (n >> 1)), both factors normal for n in [-126, 128], so one select (the
// flush below -87.33) is the only branch-like step left: the AVX2 loops were 4 blends a value.
static inline float yr_exp(float x) {
    const float xc = std::min(std::max(x, -87.33654475f), 88.8f);
    const float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = xc - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + (r + 1.0f);
    const int32_t ni = (int32_t)n, n1 = ni >> 1;
    const int32_t b1 = (n1 + 127) << 23, b2 = (ni - n1 + 127) << 23;
    float s1, s2;
    std::memcpy(&s1, &b1, 4);
    std::memcpy(&s2, &b2, 4);
    const float y = (p * s1) * s2;
    return x < -87.33654475f ? 0.0f : y;
}

// tanh(x): an odd polynomial for |x| < 0.625 (Cephes tanhf), else sign(x) (1 - 2 / (e^2|x| + 1))
// with yr_exp; within 1.4 ulp of float64 tanh (measured on a 4e6-point grid over [-12, 12]). Vectorizes like yr_exp.
static inline float yr_tanh(float x) {
    const float a = std::fabs(x);
    const float z = x * x;
    float p = -5.70498872745e-3f;
    p = p * z + 2.06390887954e-2f;
    p = p * z - 5.37397155531e-2f;
    p = p * z + 1.33314422036e-1f;
    p = p * z - 3.33332819422e-1f;
    const float small = p * z * x + x;
    const float t = 1.0f - 2.0f / (yr_exp(std::min(2.0f * a, 88.0f)) + 1.0f);
    return a < 0.625f ? small : (x < 0.0f ? -t : t);
}
