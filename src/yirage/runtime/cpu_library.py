"""Binds library ops (GEMM/GEMV, embedding, RoPE, attention, argmax) to CPU kernels.

Quantized weights, embeddings, RoPE, attention and argmax use the hand-written C++ of
codegen/cpp_library.py; float matmuls use torch (BLAS). Returns None for a case it does
not handle, so the executor runs the op's torch reference (same device, same numbers).
It must never allocate: outputs are given.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..dtypes import DType


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def bind_cpu_library(node, args: list[torch.Tensor], out: torch.Tensor, graph) -> Callable[[], None] | None:
    """A thunk computing ``node`` into ``out`` on the CPU, or None if no kernel applies."""
    binder = _BINDERS.get(node.op)
    return binder(node, args, out, graph) if binder else None


def _lib():
    from ..codegen.cpp_library import library
    return library()


def _linear(node, args, out, graph):
    x, w = args[0], args[1]
    bias = args[2] if len(args) == 3 else None
    wt = graph.tensors[node.inputs[1]].dtype
    N, K = graph.tensors[node.inputs[1]].shape
    M = x.numel() // K
    if wt.is_quantized:
        fn = getattr(_lib(), f"yr_linear_{wt.value}")
        p = (_ptr(x), _ptr(w), _ptr(bias), _ptr(out), M, N, K)
        return lambda: fn(*p)
    x2, o2, wT = x.view(M, K), out.view(M, N), w.t()
    if bias is None:
        return lambda: torch.mm(x2, wT, out=o2)
    return lambda: torch.addmm(bias, x2, wT, out=o2)


def _matmul(node, args, out, graph):
    a, b = args
    return lambda: torch.matmul(a, b, out=out)


def _embedding(node, args, out, graph):
    ids, table = args
    tt = graph.tensors[node.inputs[1]].dtype
    if ids.dtype != torch.int64 or tt not in (DType.q8_0, DType.q4_1, DType.float32):
        return None
    fn = getattr(_lib(), "yr_embedding_" + ("f32" if tt == DType.float32 else tt.value))
    p = (_ptr(ids), _ptr(table), _ptr(out), ids.numel(), graph.tensors[node.inputs[1]].shape[1])
    return lambda: fn(*p)


def _rope(node, args, out, graph):
    x, cos, sin, pos = args
    T, H, Dh = x.shape
    fn = _lib().yr_rope
    p = (_ptr(x), _ptr(cos), _ptr(sin), _ptr(pos), _ptr(out), T, H, Dh)
    return lambda: fn(*p)


def _attention(node, args, out, graph):
    q, k, v, kc, vc, pos = args
    if q.dtype != torch.float32:
        return None
    T, Hq, Dh = q.shape
    fn = _lib().yr_attention
    p = (*map(_ptr, (q, k, v, kc, vc, pos, out)), T, Hq, k.shape[1], Dh, kc.shape[0], node.attrs["scale"])
    return lambda: fn(*p)


def _argmax(node, args, out, graph):
    x = args[0]
    if x.dtype != torch.float32:
        return None
    D = x.shape[-1]
    fn = _lib().yr_argmax
    p = (_ptr(x), _ptr(out), x.numel() // D, D)
    return lambda: fn(*p)


_BINDERS = {"linear": _linear, "matmul": _matmul, "embedding": _embedding, "rope": _rope,
            "attention": _attention, "argmax": _argmax}
