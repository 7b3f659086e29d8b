"""The Triton backends: one source of kernels (backend.py: the shared ``TritonBackend`` and
Triton's CPU interpreter, 'triton-interpret'), with a subclass per device that says how to find
it (cuda.py, rocm.py, xpu.py); providers.py chooses between a Triton kernel and torch's own op
by measurement; threadblock.py compiles block graphs.
"""
from .backend import TritonBackend, TritonInterpreterBackend, triton_missing_reason
from .cuda import CUDABackend
from .rocm import ROCmBackend
from .xpu import XPUBackend

__all__ = ["CUDABackend", "ROCmBackend", "TritonBackend", "TritonInterpreterBackend", "XPUBackend",
           "triton_missing_reason"]
