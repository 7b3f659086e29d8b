"""The WebGPU backend (backend.py): yirage's kernels in WGSL on any adapter ``wgpu`` finds. Its
library kernels: library.py (float32 GEMM and GEMV, and the template renderer the others use),
quant.py (GGUF block-quantized linear), conv.py (the conv nets' ops), ops.py (the LLM ops) and
threadblock.py (block graphs).
"""
from .backend import WebGPUBackend

__all__ = ["WebGPUBackend"]
