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
from .task_graph import TaskOp, split_range, task_op
from .toolchain import load_library

_ARGTYPES = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int64]


class CppKernel:
    """A fused kernel compiled to a C++ entry point ``void f(void** args, int64_t R)``, and
    its task entry ``void f_task(const int64_t* args, int64_t lo, int64_t hi)`` (rows lo..hi-1)
    at address ``task_fn``."""

    def __init__(self, fn, task_fn: int, name: str = "fused", runtime_d: int | None = None):
        self.fn = fn
        self.task_fn = task_fn
        self.name = name
        self.runtime_d = runtime_d   # D passed after the pointers (FusedKernel.runtime_d), or None

    def arg_words(self, tensors: list[torch.Tensor]) -> list[int]:
        """The kernel's ``args`` as integers: the tensors' data pointers, then D when the
        kernel takes it at run time."""
        return [t.data_ptr() for t in tensors] + ([self.runtime_d] if self.runtime_d is not None else [])

    def task(self, tensors: list[torch.Tensor], rows: int, num_workers: int) -> TaskOp:
        """The kernel as one op of a persistent task graph: ``rows`` rows cut into up to
        ``num_workers`` slices when the work is large enough to share (>= 32768 elements,
        the same threshold as the OpenMP launch)."""
        D = max(1, tensors[-1].numel() // max(rows, 1))
        tasks = num_workers if rows * D >= 32768 else 1
        return task_op(self.name, self.task_fn, self.arg_words(tensors), split_range(rows, tasks))

    def bind(self, tensors: list[torch.Tensor], rows: int) -> Callable[[], None]:
        """Thunk running the kernel on ``tensors`` (inputs then outputs, contiguous CPU)."""
        words = self.arg_words(tensors)
        ptrs = (ctypes.c_void_p * len(words))(*words)
        fn, r = self.fn, ctypes.c_int64(rows)
        return lambda: fn(ptrs, r)


def compile_cpp(kernels: list[FusedKernel]) -> list[CppKernel]:
    """Build all ``kernels`` as one shared library (cached by source hash).

    Raises ToolchainError when no compiler is installed or the build fails.
    """
    if not kernels:
        return []
    source, names = render_module(kernels)
    lib = load_library(source, symbols=tuple(names) + tuple(n + "_task" for n in names))
    out = []
    for name, kernel in zip(names, kernels):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = _ARGTYPES, None
        task_fn = ctypes.cast(getattr(lib, name + "_task"), ctypes.c_void_p).value
        out.append(CppKernel(fn, task_fn, kernel_label(kernel), kernel.D if kernel.runtime_d else None))
    return out


def kernel_label(kernel: FusedKernel) -> str:
    """A short name for traces: the ops of the fused kernel, e.g. 'fused rms_norm+mul'."""
    ops = []
    for s in kernel.stmts:
        if s.op not in ("load", "affine") and s.op not in ops:
            ops.append(s.op)
    return "fused " + "+".join(ops[:4]) + ("+..." if len(ops) > 4 else "")
