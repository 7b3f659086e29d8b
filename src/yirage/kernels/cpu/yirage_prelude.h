// Helpers that every generated fused row kernel (yirage/codegen/cpp.py) includes.
// All arithmetic in generated kernels is float32; float16 uses the compiler's _Float16,
// bfloat16 is stored as uint16_t and converted with the two functions below.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

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
