"""Fused row kernels for WebGPU: render (codegen/wgsl.py), compile (runtime/webgpu.py's
``Pipeline``, once per shader text in the process) and bind.

``WGSLKernel.bind(tensors, R)`` builds the launch once: the uniform parameters (R, D, each
tensor's element offset) and the workgroup grid (a workgroup per row for a kernel with a row
reduction, else one invocation per element). The thunk it returns only records the dispatch.

A kernel with float16 tensors is rendered for the device at hand: native ``array<f16>``
storage where it has ``shader-f16`` (``runtime.webgpu.has_f16``), else the packed ``u32``
words. ``WGSLKernel.f16`` says which, the pipeline's label (``kernel_name``: ``_f16`` at the
end) and cache key carry it, and the choice is logged at debug level (logger ``yirage``).

This module must never import a backend.
"""
from __future__ import annotations

import math

from ..codegen import wgsl
from ..config import logger
from ..errors import YirageError
from ..transforms.fusion import FusedKernel
from .webgpu import DeviceTensor, Pipeline, grid, has_f16, limit


class WGSLKernel:
    """A fused kernel compiled to a WGSL compute pipeline.

    Raises NotImplementedError (from codegen) for a dtype or statement WGSL cannot express
    here, YirageError when the shader does not compile on this device or needs more storage
    buffers than the adapter binds (naming the limit)."""

    def __init__(self, kernel: FusedKernel):
        self.kernel = kernel
        buffers = len(kernel.inputs) + len(kernel.outputs)
        cap = limit("max-storage-buffers-per-shader-stage")
        if buffers > cap:
            raise YirageError(f"webgpu: a fused kernel needs {buffers} storage buffers, but this adapter's "
                              f"max-storage-buffers-per-shader-stage is {cap}; run this graph on another backend")
        #: float16 tensors bound as array<f16> (the device has shader-f16), not packed words
        self.f16 = wgsl.uses_float16(kernel) and has_f16()
        self.name = wgsl.kernel_name(kernel, self.f16)
        self.source = wgsl.render_kernel(kernel, self.f16)
        if wgsl.uses_float16(kernel):
            logger.debug("webgpu: fused kernel %s stores float16 %s", self.name,
                         "natively (shader-f16)" if self.f16 else "packed in u32 words (no shader-f16)")
        self.pipeline = Pipeline(self.source, label=self.name)
        self.shape = wgsl.shape_of(kernel)

    def bind(self, tensors: list[DeviceTensor], rows: int):
        """A thunk recording the kernel over ``rows`` rows of ``tensors`` (``DeviceTensor``s: the
        kernel's inputs, then its outputs). Raises YirageError for a tensor that is not a device
        tensor or holds fewer elements than the kernel reads or writes."""
        k = self.kernel
        D = k.D
        need = {"full": rows * D, "expand": rows * D, "row": D, "col": rows, "scalar": 1}
        sizes = [need[inp.mode] for inp in k.inputs] + [rows * D if k.stmts[sid].kind == "vec" else rows
                                                          for sid, _, _ in k.outputs]
        for t, n in zip(tensors, sizes):
            if not isinstance(t, DeviceTensor) or t.numel() < n:
                raise YirageError(f"webgpu kernel: argument {t!r} must be a device tensor of at least {n} elements")
        params = [rows, D] + [t.offset for t in tensors]
        groups = rows if self.shape == "row" else math.ceil(rows * D / wgsl.ELEMENTWISE_WG)
        return self.pipeline.bind(tensors, params, grid(groups))


def compile_wgsl(kernels: list[FusedKernel]) -> list[WGSLKernel]:
    """One ``WGSLKernel`` per fused kernel (pipelines shared by equal shader texts)."""
    return [WGSLKernel(k) for k in kernels]


__all__ = ["WGSLKernel", "compile_wgsl"]
