"""The Triton backends' ``customized`` op: a threadblock graph (ir/threadblock.py) rendered as
a Triton kernel per output (codegen/threadblock_triton.py, runtime/threadblock_kernels.py).

``customized_ok`` says which cases have a kernel (every op of the output renders, see
``triton_supported``); the executor runs every other case as the op's torch reference.
"""
from __future__ import annotations

from ..codegen.threadblock_triton import triton_supported
from ..runtime.threadblock_kernels import compile_threadblock_triton


def customized_ok(node, graph) -> bool:
    """Block graphs whose output renders to Triton (no concat or sum_todimx yet)."""
    return triton_supported(node.attrs["tb"], node.attrs["output"])


def bind_customized(node, graph, args, out, status):
    """Thunk launching the block graph's Triton kernel for output ``node.attrs['output']``."""
    run = compile_threadblock_triton(node.attrs["tb"], node.attrs["output"])
    ins = list(args)
    return lambda: run(ins, out)
