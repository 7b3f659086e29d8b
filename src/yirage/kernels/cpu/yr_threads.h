// Threads of the hand-written kernels: OpenMP where the compiler has it (runtime/toolchain.py's
// openmp_flags: -fopenmp, or Homebrew's libomp for Apple's clang). A compiler without it builds
// with -fopenmp-simd alone: `#pragma omp simd` still vectorizes, `#pragma omp parallel` is
// ignored, and these stand-ins make every kernel run on one thread, correctly.
#pragma once
#if defined(_OPENMP)
#include <omp.h>
#else
inline int omp_get_max_threads() { return 1; }
inline int omp_get_num_threads() { return 1; }
inline int omp_get_thread_num() { return 0; }
#endif
