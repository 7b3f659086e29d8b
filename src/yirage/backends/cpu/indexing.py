"""The CPU backend's indexing ops with run-time indices, ``index_select`` and ``gather``
(kernels/cpu/indexing.cpp): one strided loop over the output that checks every index against
the indexed dim before it forms an address, and records a violation in the executor's status
slot (``OpDef.index_input``), which the executor raises as ``IndexOutOfRangeError``.

Binders run once per plan and return a thunk; they never allocate per call. This module must
never read an index on the host.
"""
from __future__ import annotations

import ctypes
import functools
from typing import Callable

from ...runtime.toolchain import load_kernel_library
from ..strided_views import contiguous_strides

_P, _I = ctypes.c_void_p, ctypes.c_int64

#: entry points of indexing.cpp and their argtypes (restype None)
SIGNATURES: dict[str, tuple] = {
    # src, index, dst, ndim, out sizes, src strides, dim, n (src size along dim), gather?, element bytes, status
    "yr_index_copy": (_P, _P, _P, _I, _P, _P, _I, _I, _I, _I, _P),
}
#: most dims the kernel handles
MAX_DIMS = 8


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL:
    """indexing.cpp, built on first use (cached on disk), with signatures set.

    Raises ToolchainError: no C++ compiler, or it rejected the source."""
    lib = load_kernel_library("indexing", symbols=tuple(SIGNATURES))
    for name, argtypes in SIGNATURES.items():
        getattr(lib, name).argtypes = list(argtypes)
        getattr(lib, name).restype = None
    return lib


def supports(node, graph) -> bool:
    """At most ``MAX_DIMS`` dims (the op table checks dtypes and shapes)."""
    return len(graph.tensors[node.inputs[0]].shape) <= MAX_DIMS


def _bind(node, graph, args, out, status):
    x, index = args
    xt, ot = graph.tensors[node.inputs[0]], graph.tensors[node.output]
    dim = node.attrs["dim"]
    sizes = (ctypes.c_int64 * len(ot.shape))(*ot.shape)
    strides = (ctypes.c_int64 * len(xt.shape))(*contiguous_strides(xt.shape))
    fn = library().yr_index_copy
    p = (x.data_ptr(), index.data_ptr(), out.data_ptr(), len(ot.shape), sizes, strides, dim, xt.shape[dim],
         int(node.op == "gather"), out.element_size(), None if status is None else status.data_ptr())

    def run(p=p, keep=(sizes, strides)):
        fn(*p)
    return run


#: op -> (supported?(node, graph), binder(node, graph, args, out, status))
OPS: dict[str, tuple[Callable, Callable]] = {"index_select": (supports, _bind), "gather": (supports, _bind)}
