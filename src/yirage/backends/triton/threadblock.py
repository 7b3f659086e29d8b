"""The Triton backends' ``customized`` op: a threadblock graph (ir/threadblock.py) rendered as
one Triton kernel for all the outputs of one block graph (``bind_customized_group``; the
executor groups them), else one per output (codegen/threadblock_triton.py,
runtime/threadblock_kernels.py).

``customized_ok`` says which cases have a kernel (every op of the output renders, see
``triton_supported``); the executor runs every other case as the op's torch reference.
"""
from __future__ import annotations

from ...codegen.threadblock_triton import triton_supported
from ...runtime.threadblock_kernels import compile_threadblock_triton


def customized_ok(node, graph) -> bool:
    """Block graphs whose output renders to Triton (no concat or sum_todimx yet)."""
    return triton_supported(node.attrs["tb"], node.attrs["output"])


def bind_customized(node, graph, args, out, status):
    """Thunk launching the block graph's Triton kernel for output ``node.attrs['output']``."""
    run = compile_threadblock_triton(node.attrs["tb"], node.attrs["output"])
    ins = list(args)
    return lambda: run(ins, out)


def bind_customized_group(nodes, graph, args, outs):
    """One launch computing every output of one block graph (``nodes``: its ``customized``
    ops in output order, sharing ``args``) into ``outs``; None when it does not render."""
    tb = nodes[0].attrs["tb"]
    ks = tuple(n.attrs["output"] for n in nodes)
    if not triton_supported(tb, ks):
        return None
    run = compile_threadblock_triton(tb, ks)
    ins, dst = list(args), list(outs)
    return lambda: run(ins, dst)
