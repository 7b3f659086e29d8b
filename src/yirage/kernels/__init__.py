"""Hand-written kernels as real source files, shipped as package data.

- ``cpu/``: C++ (``*.cpp``, ``*.h``) built by runtime/toolchain.py: the library kernels
  (quantized GEMV/GEMM, embedding, RoPE, attention, argmax) and the prelude that generated
  row kernels include.
- ``triton/``: Triton library kernels for CUDA, ROCm and XPU (one source for all three).
- ``webgpu/``: WGSL library kernels (``*.wgsl``, GEMM and GEMV) for the WebGPU backend, with
  ``{{NAME}}`` placeholders (tile sizes) that backends/webgpu/library.py fills before compiling.

Nothing here builds, loads or picks a backend; the backends do.
"""
