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
