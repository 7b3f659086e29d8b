"""Threadblock graphs as kernels: one output rendered as C++ (codegen/threadblock_cpp.py, built
and cached by source hash, runtime/toolchain.py) or as Triton (codegen/threadblock_triton.py,
cached like the fused Triton kernels), and bound to tensors.

A bound launcher is a zero-argument thunk calling ``void NAME(void** args)`` through ctypes
with a pointer array built once. It must never allocate the tensors it is bound to.
"""
from __future__ import annotations

import ctypes
import hashlib
import math
import weakref
from typing import Callable, Sequence

import torch

from ..codegen.threadblock_cpp import render_threadblock
from .toolchain import load_library


# per block graph: {(output, ops, outputs): ctypes function}; rendering the C++ costs about
# 0.1 ms, which a graph called again and again (a new Plan per call) must not pay each time
_BUILT: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def compile_threadblock(tb, k):
    """The ctypes function computing output ``k`` of threadblock graph ``tb`` (float32), or
    every output of the tuple ``k`` in one kernel; remembered per block graph (and its op and
    output counts, should it grow).

    Raises ToolchainError when no compiler is installed or the build fails.
    """
    key = (k, len(tb.ops), len(tb.outputs))
    built = _BUILT.setdefault(tb, {})
    if key not in built:
        built[key] = _compile_threadblock(tb, k)
    return built[key]


def _compile_threadblock(tb, k):
    probe = render_threadblock(tb, k, "yr_tb")
    name = "yr_tb_" + hashlib.sha256(probe.encode()).hexdigest()[:16]
    source = probe.replace("void yr_tb(", f"void {name}(")
    fn = getattr(load_library(source, symbols=(name,)), name)
    fn.argtypes, fn.restype = [ctypes.POINTER(ctypes.c_void_p)], None
    return fn


def bind_threadblock(fn, inputs: Sequence[torch.Tensor], out) -> Callable[[], None]:
    """Thunk running ``fn`` on ``inputs`` (contiguous float32 CPU tensors) into ``out`` (a
    tensor, or a list of them for a kernel of several outputs)."""
    tensors = list(inputs) + (list(out) if isinstance(out, (list, tuple)) else [out])
    ptrs = (ctypes.c_void_p * len(tensors))(*[t.data_ptr() for t in tensors])
    return lambda: fn(ptrs)


def compile_threadblock_triton(tb, k):
    """A launcher ``run(inputs, out)`` for output ``k`` of ``tb`` (``out`` a tensor), or for
    every output of the tuple ``k`` in one kernel (``out`` a list), as a Triton kernel on the grid
    ``tb.grid_dim`` (codegen/threadblock_triton.py; the module is cached like the fused
    Triton kernels, runtime/triton_kernels.py). Tensors: contiguous, on one Triton device (CPU
    tensors under ``TRITON_INTERPRET=1``).

    Raises NotImplementedError for block graphs ``triton_supported`` rejects.
    """
    from ..codegen.threadblock_triton import render_threadblock_triton
    from .triton_kernels import _load_module

    fn = getattr(_load_module(render_threadblock_triton(tb, k, "yr_tb")), "yr_tb")
    grid = tuple(tb.grid_dim)
    warps = 1 << min(5, max(0, (math.prod(tb.block_dim) // 32).bit_length() - 1))  # threads/32, a power of 2

    def run(inputs: Sequence[torch.Tensor], out) -> None:
        fn[grid](*inputs, *(out if isinstance(out, (list, tuple)) else [out]), num_warps=warps)
    return run
