// The CPU library's encoder kernels: the embedding engine's float32/bfloat16/int8 GEMMs on
// packed weights and its varlen attention (embed_kernels.h), and convolutions as implicit GEMMs
// on the same packed GEMM (conv_gemm.h). One translation unit of the library that library.cpp
// heads (its rules hold here); see library_core.h.

#include "library_core.h"

#include "embed_kernels.h"
#include "conv_gemm.h"
