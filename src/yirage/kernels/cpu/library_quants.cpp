// The CPU library's kernels for GGML's other block formats (Q4_0, Q5_0, Q5_1, Q2_K .. Q6_K:
// dequantization, GEMV and GEMM read in place) and for q4_1 repacked in groups of 16 rows
// (DType q4_1r16: the decode GEMVs without horizontal sums). One translation unit of the
// library that library.cpp heads (its rules hold here); see library_core.h.

#include "library_core.h"

#include "ggml_quants.h"
#include "row_groups.h"
