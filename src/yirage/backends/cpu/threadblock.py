"""The CPU backend's ``customized`` op: a threadblock graph (ir/threadblock.py) compiled to
C++ (codegen/threadblock_cpp.py, runtime/threadblock_kernels.py): one kernel for all the
outputs of one block graph (``bind_customized_group``; the executor groups them), else one per
output.

``customized_ok`` says which cases have a kernel (float32, tile buffers within
``MAX_ARENA_FLOATS`` per thread); the executor runs every other case as the op's torch
reference (``ir.threadblock.run_threadblock``). Binders run once per plan.
"""
from __future__ import annotations

from ...codegen.threadblock_cpp import arena_floats
from ...dtypes import DType
from ...runtime.threadblock_kernels import bind_threadblock, compile_threadblock

#: the most tile-buffer floats one thread may hold (64 MiB); larger block graphs fall back
MAX_ARENA_FLOATS = 16 * 1024 * 1024


def customized_ok(node, graph) -> bool:
    """float32 block graphs whose per-thread tiles fit ``MAX_ARENA_FLOATS``."""
    tb = node.attrs["tb"]
    return (all(inp.dtype == DType.float32 for inp in tb.inputs)
            and arena_floats(tb, node.attrs["output"]) <= MAX_ARENA_FLOATS)


def bind_customized(node, graph, args, out, status):
    """Thunk running the compiled block graph output ``node.attrs['output']`` into ``out``."""
    fn = compile_threadblock(node.attrs["tb"], node.attrs["output"])
    if all(a.is_contiguous() for a in args):
        return bind_threadblock(fn, args, out)
    staged = [a.contiguous().clone() for a in args]  # strided views: copied in on every run
    run = bind_threadblock(fn, staged, out)

    def thunk():
        for s, a in zip(staged, args):
            s.copy_(a)
        run()
    return thunk


def bind_customized_group(nodes, graph, args, outs):
    """One thunk computing every output of one block graph (``nodes``: its ``customized`` ops,
    in output order, sharing ``args``) into ``outs``, so that the ops they share run once; None
    when a single kernel does not apply (then each node is bound alone)."""
    tb = nodes[0].attrs["tb"]
    ks = tuple(n.attrs["output"] for n in nodes)
    if (not all(inp.dtype == DType.float32 for inp in tb.inputs) or arena_floats(tb, ks) > MAX_ARENA_FLOATS
            or not all(a.is_contiguous() for a in args)):
        return None
    return bind_threadblock(compile_threadblock(tb, ks), args, outs)
