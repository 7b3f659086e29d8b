// Loading and storing one element of a float32 / float16 / bfloat16 (uint16_t bits) buffer as
// float32: the kernels that take their element type as a code (strided.cpp, conv.cpp) compute
// in float32 and store in that type.
#pragma once

#include "yirage_prelude.h"

namespace yr_elements {

template <typename T> inline float load(const T* p, int64_t i);
template <> inline float load<float>(const float* p, int64_t i) { return p[i]; }
template <> inline float load<_Float16>(const _Float16* p, int64_t i) { return (float)p[i]; }
template <> inline float load<uint16_t>(const uint16_t* p, int64_t i) { return yr_bf16_to_f32(p[i]); }

template <typename T> inline void store(T* p, int64_t i, float v);
template <> inline void store<float>(float* p, int64_t i, float v) { p[i] = v; }
template <> inline void store<_Float16>(_Float16* p, int64_t i, float v) { p[i] = (_Float16)v; }
template <> inline void store<uint16_t>(uint16_t* p, int64_t i, float v) { p[i] = yr_f32_to_bf16(v); }

}  // namespace yr_elements
