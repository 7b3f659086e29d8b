"""Fused row kernels for the CPU: render as C++ (codegen/cpp.py), build (cached), bind pointers.

A bound launcher is a zero-argument thunk that calls the kernel through ctypes with a
pointer array built once, so a decode step pays one foreign call per kernel and nothing
else. It must never allocate the tensors it is bound to.
"""
from __future__ import annotations

import ctypes
from typing import Callable

import torch

from ..codegen.cpp import render_module
from ..transforms.fusion import FusedKernel
from .toolchain import load_library

_ARGTYPES = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int64]


class CppKernel:
    """A fused kernel compiled to a C++ entry point ``void f(void** args, int64_t R)``."""

    def __init__(self, fn):
        self.fn = fn

    def bind(self, tensors: list[torch.Tensor], rows: int) -> Callable[[], None]:
        """Thunk running the kernel on ``tensors`` (inputs then outputs, contiguous CPU)."""
        ptrs = (ctypes.c_void_p * len(tensors))(*[t.data_ptr() for t in tensors])
        fn, r = self.fn, ctypes.c_int64(rows)
        return lambda: fn(ptrs, r)


def compile_cpp(kernels: list[FusedKernel]) -> list[CppKernel]:
    """Build all ``kernels`` as one shared library (cached by source hash).

    Raises ToolchainError when no compiler is installed or the build fails.
    """
    if not kernels:
        return []
    source, names = render_module(kernels)
    lib = load_library(source, symbols=tuple(names))
    out = []
    for name in names:
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = _ARGTYPES, None
        out.append(CppKernel(fn))
    return out
