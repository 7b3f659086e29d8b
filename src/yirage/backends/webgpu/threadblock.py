"""The webgpu backend's ``customized`` op: a threadblock graph (ir/threadblock.py) rendered as
one WGSL compute shader for all the outputs of one block graph (``bind_customized_group``; the
executor groups them), else one per output (codegen/threadblock_wgsl.py,
runtime/threadblock_wgsl.py): a workgroup per block of ``tb.grid_dim``, the tiles in
workgroup memory, the for-loop inside the shader.

``customized_ok`` says which cases have a kernel (float32, every op renders, the tiles fit
WebGPU's guaranteed 16 KiB of workgroup memory, storage buffers within the device's limit);
the executor runs every other case as the op's torch reference on the host. Binders run once
per plan.
"""
from __future__ import annotations

from ...dtypes import DType
from ...runtime.threadblock_wgsl import bind_threadblock_wgsl, device_reason


def customized_ok(node, graph) -> bool:
    """float32 block graphs whose output renders to WGSL within the device's limits."""
    tb = node.attrs["tb"]
    if any(graph.tensors[i].dtype != DType.float32 for i in node.inputs):
        return False
    return device_reason(tb, node.attrs["output"]) is None


def bind_customized(node, graph, args, out, status=None):
    """Thunk recording the block graph's kernel for output ``node.attrs['output']`` into ``out``."""
    return bind_threadblock_wgsl(node.attrs["tb"], node.attrs["output"], list(args), out)


def bind_customized_group(nodes, graph, args, outs):
    """One dispatch computing every output of one block graph (``nodes``: its ``customized``
    ops in output order, sharing ``args``) into ``outs``; None when the outputs together do not
    render (then each node is bound alone)."""
    tb = nodes[0].attrs["tb"]
    ks = tuple(n.attrs["output"] for n in nodes)
    if device_reason(tb, ks) is not None:
        return None
    return bind_threadblock_wgsl(tb, ks, list(args), list(outs))


__all__ = ["customized_ok", "bind_customized", "bind_customized_group"]
