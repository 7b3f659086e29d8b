"""The CPU backend's kernels over strided views (kernels/cpu/strided.cpp): the layout ops
(``permute``, ``expand``, ``slice``, ``select``, ``cat``) as strided copies, and over [outer, n,
inner] views the
reductions (``reduction``, ``sum``, ``mean``, ``amax``, ``amin``, ``var``) and ``softmax`` /
``log_softmax`` over a dim that is not the last one (over the trailing dims those ops are fused
row programs, transforms/fusion.py, and never reach this module), and ``cumsum`` along any dim.

Binders run once per plan and return a thunk; they never allocate per call. This module must
never run a kernel on a tensor whose shape differs from the graph's.
"""
from __future__ import annotations

import ctypes
import functools
from typing import Callable

from ...dtypes import DType
from ...runtime.toolchain import load_kernel_library
from ..strided_views import copies, mid_view, reduced_dims

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float

#: entry points of strided.cpp and their argtypes (restype None)
SIGNATURES: dict[str, tuple] = {
    "yr_reduce_mid": (_P, _P, _I, _I, _I, _I, _F, _I),   # x, out, outer, n, inner, op, correction, dtype
    "yr_softmax_mid": (_P, _P, _I, _I, _I, _I, _I),      # x, out, outer, n, inner, log, dtype
    "yr_cumsum_mid": (_P, _P, _I, _I, _I, _I),           # x, out, outer, n, inner, input dtype
    # src, dst, ndim, sizes, src strides, src offset, dst strides, dst offset, element bytes
    "yr_strided_copy": (_P, _P, _I, _P, _P, _I, _P, _I, _I),
}
#: the layout ops, copies of strided views of their inputs
LAYOUT_OPS = ("permute", "expand", "slice", "select", "cat", "pad")
#: element type codes of strided.cpp
DTYPE_CODES = {DType.float32: 0, DType.float16: 1, DType.bfloat16: 2}
#: reduction op codes of strided.cpp (``reduction`` is a sum)
REDUCE_CODES = {"reduction": 0, "sum": 0, "mean": 1, "amax": 2, "amin": 3, "var": 4}


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL:
    """strided.cpp, built on first use (cached on disk), with signatures set.

    Raises ToolchainError: no C++ compiler, or it rejected the source."""
    lib = load_kernel_library("strided", symbols=tuple(SIGNATURES))
    for name, argtypes in SIGNATURES.items():
        getattr(lib, name).argtypes = list(argtypes)
        getattr(lib, name).restype = None
    return lib


def supports(node, graph) -> bool:
    """A float input of one of the float dtypes strided.cpp handles."""
    return graph.tensors[node.inputs[0]].dtype in DTYPE_CODES


def _reduce(node, graph, args, out, status):
    x = args[0]
    t = graph.tensors[node.inputs[0]]
    outer, n, inner = mid_view(t.shape, reduced_dims(node, graph))
    fn = library().yr_reduce_mid
    p = (x.data_ptr(), out.data_ptr(), outer, n, inner, REDUCE_CODES[node.op],
         float(node.attrs.get("correction", 0.0)), DTYPE_CODES[t.dtype])
    return lambda: fn(*p)


def _softmax(node, graph, args, out, status):
    x = args[0]
    t = graph.tensors[node.inputs[0]]
    outer, n, inner = mid_view(t.shape, reduced_dims(node, graph))
    fn = library().yr_softmax_mid
    p = (x.data_ptr(), out.data_ptr(), outer, n, inner, int(node.op == "log_softmax"), DTYPE_CODES[t.dtype])
    return lambda: fn(*p)


#: input type codes of strided.cpp's cumsum (floats keep their type, the others sum into int64)
CUMSUM_CODES = {**DTYPE_CODES, DType.bool: 3, DType.int32: 4, DType.int64: 5}


def _cumsum(node, graph, args, out, status):
    t = graph.tensors[node.inputs[0]]
    outer, n, inner = mid_view(t.shape, [node.attrs["dim"]])
    fn = library().yr_cumsum_mid
    p = (args[0].data_ptr(), out.data_ptr(), outer, n, inner, CUMSUM_CODES[t.dtype])
    return lambda: fn(*p)


def _always(node, graph) -> bool:
    return True


def _layout(node, graph, args, out, status):
    """permute, expand, slice, select, cat, pad: strided copies (strided_views.copies), their size
    and stride arrays made once here; pad fills its output with its value first."""
    fn, calls, keep = library().yr_strided_copy, [], []
    for c in copies(node, graph):
        arrays = [(ctypes.c_int64 * len(v))(*v) for v in (c.sizes, c.src_strides, c.dst_strides)]
        keep.append(arrays)
        calls.append((args[c.input].data_ptr(), out.data_ptr(), len(c.sizes), arrays[0], arrays[1], c.src_offset,
                      arrays[2], c.dst_offset, out.element_size()))

    if node.op == "pad":   # the borders: the whole output filled first (one pass), then the interior
        value = node.attrs["value"]

        def run_pad(calls=calls, keep=keep):
            out.fill_(value)
            for p in calls:
                fn(*p)
        return run_pad

    def run(calls=calls, keep=keep):
        for p in calls:
            fn(*p)
    return run


#: op -> (supported?(node, graph), binder(node, graph, args, out, status))
OPS: dict[str, tuple[Callable, Callable]] = {
    **{op: (supports, _reduce) for op in REDUCE_CODES},
    "softmax": (supports, _softmax),
    "log_softmax": (supports, _softmax),
    "cumsum": (lambda node, graph: graph.tensors[node.inputs[0]].dtype in CUMSUM_CODES, _cumsum),
    **{op: (_always, _layout) for op in LAYOUT_OPS},
}
