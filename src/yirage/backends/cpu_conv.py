"""The CPU backend's convolutional-network ops (ir/conv.py), over NCHW tensors:

- ``conv2d``: oneDNN's convolution inside torch (``aten.convolution.out``, written straight into
  the plan's output), the vendor provider; yirage's own implicit-GEMM and depthwise kernels are
  still to come (issue 21), and will be chosen against it by measurement;
- ``max_pool2d``, ``avg_pool2d``, ``adaptive_avg_pool2d`` and ``batch_norm`` (inference):
  hand-written C++ (kernels/cpu/conv.cpp), float32/float16/bfloat16.

Binders run once per plan and return a thunk; they never allocate per call. This module must
never run a kernel on a tensor whose shape differs from the graph's.
"""
from __future__ import annotations

import ctypes
import functools
from typing import Callable

import torch

from ..dtypes import DType
from ..runtime.toolchain import kernel_source, load_library

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float

#: entry points of conv.cpp and their argtypes (restype None)
SIGNATURES: dict[str, tuple] = {
    # x, y, N, C, H, W, kh, kw, sh, sw, ph, pw, dh, dw, Ho, Wo, dtype
    "yr_max_pool2d": (_P, _P, *([_I] * 14), _I),
    # x, y, N, C, H, W, kh, kw, sh, sw, ph, pw, Ho, Wo, count_include_pad, dtype
    "yr_avg_pool2d": (_P, _P, *([_I] * 12), _I, _I),
    "yr_adaptive_avg_pool2d": (_P, _P, _I, _I, _I, _I, _I, _I, _I),   # x, y, N, C, H, W, oh, ow, dtype
    # x, y, mean, var, weight|None, bias|None, N, C, S, eps, dtype
    "yr_batch_norm": (_P, _P, _P, _P, _P, _P, _I, _I, _I, _F, _I),
}
#: element type codes of conv.cpp
DTYPE_CODES = {DType.float32: 0, DType.float16: 1, DType.bfloat16: 2}


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL:
    """conv.cpp, built on first use (cached on disk), with signatures set.

    Raises ToolchainError: no C++ compiler, or it rejected the source."""
    lib = load_library(kernel_source("conv.cpp"), symbols=tuple(SIGNATURES))
    for name, argtypes in SIGNATURES.items():
        getattr(lib, name).argtypes = list(argtypes)
        getattr(lib, name).restype = None
    return lib


def _typed(node, graph) -> bool:
    return graph.tensors[node.inputs[0]].dtype in DTYPE_CODES


def _conv2d(node, graph, args, out, status):
    x, w = args[0], args[1]
    b = args[2] if len(args) == 3 else None
    a = node.attrs
    conv = torch.ops.aten.convolution.out
    stride, padding, dilation = list(a["stride"]), list(a["padding"]), list(a["dilation"])
    return lambda: conv(x, w, b, stride, padding, dilation, False, [0, 0], a["groups"], out=out)


def _max_pool2d(node, graph, args, out, status):
    t = graph.tensors[node.inputs[0]]
    a, (N, C, H, W), (Ho, Wo) = node.attrs, t.shape, graph.tensors[node.output].shape[2:]
    p = (args[0].data_ptr(), out.data_ptr(), N, C, H, W, *a["kernel"], *a["stride"], *a["padding"],
         *a["dilation"], Ho, Wo, DTYPE_CODES[t.dtype])
    fn = library().yr_max_pool2d
    return lambda: fn(*p)


def _avg_pool2d(node, graph, args, out, status):
    t = graph.tensors[node.inputs[0]]
    a, (N, C, H, W), (Ho, Wo) = node.attrs, t.shape, graph.tensors[node.output].shape[2:]
    p = (args[0].data_ptr(), out.data_ptr(), N, C, H, W, *a["kernel"], *a["stride"], *a["padding"], Ho, Wo,
         int(a["count_include_pad"]), DTYPE_CODES[t.dtype])
    fn = library().yr_avg_pool2d
    return lambda: fn(*p)


def _adaptive_avg_pool2d(node, graph, args, out, status):
    t = graph.tensors[node.inputs[0]]
    p = (args[0].data_ptr(), out.data_ptr(), *t.shape, *node.attrs["output_size"], DTYPE_CODES[t.dtype])
    fn = library().yr_adaptive_avg_pool2d
    return lambda: fn(*p)


def _batch_norm(node, graph, args, out, status):
    t = graph.tensors[node.inputs[0]]
    N, C = t.shape[:2]
    S = 1
    for d in t.shape[2:]:
        S *= d
    w, b = (args[3].data_ptr(), args[4].data_ptr()) if node.attrs["affine"] else (None, None)
    p = (args[0].data_ptr(), out.data_ptr(), args[1].data_ptr(), args[2].data_ptr(), w, b, N, C, S,
         float(node.attrs["eps"]), DTYPE_CODES[t.dtype])
    fn = library().yr_batch_norm
    return lambda: fn(*p)


#: op -> (supported?(node, graph), binder(node, graph, args, out, status))
OPS: dict[str, tuple[Callable, Callable]] = {
    "conv2d": (_typed, _conv2d),
    "max_pool2d": (_typed, _max_pool2d),
    "avg_pool2d": (_typed, _avg_pool2d),
    "adaptive_avg_pool2d": (_typed, _adaptive_avg_pool2d),
    "batch_norm": (_typed, _batch_norm),
}
