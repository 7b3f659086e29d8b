"""Shape arithmetic shared by the CPU and Triton kernels over strided views: the [outer, n,
inner] view of a reduction or softmax over a non-last dim, and the strided copies the layout ops
(permute, expand, slice, select, cat) are made of. Pure Python over static shapes: it must never
touch a tensor or a device.
"""
from __future__ import annotations

import math
from typing import NamedTuple


def reduced_dims(node, graph) -> list[int]:
    """The dims (non-negative, sorted) a reduction or softmax node works over."""
    rank = len(graph.tensors[node.inputs[0]].shape)
    dims = node.attrs["dims"] if "dims" in node.attrs else (node.attrs["dim"],)
    return sorted(d % rank for d in dims)


def mid_view(shape, dims: list[int]) -> tuple[int, int, int]:
    """(outer, n, inner) of ``shape`` around the adjacent ``dims``."""
    return math.prod(shape[:dims[0]]), math.prod(shape[dims[0]:dims[-1] + 1]), math.prod(shape[dims[-1] + 1:])


def contiguous_strides(shape) -> list[int]:
    """Element strides of a contiguous tensor of ``shape``."""
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return strides[::-1]


class Copy(NamedTuple):
    """``dst[dst_offset + m . dst_strides] = src[src_offset + m . src_strides]`` for every index
    ``m`` of ``sizes``; ``src`` is input number ``input`` of the node, ``dst`` its output."""

    input: int
    sizes: tuple[int, ...]
    src_strides: tuple[int, ...]
    src_offset: int
    dst_strides: tuple[int, ...]
    dst_offset: int


def copies(node, graph) -> list[Copy]:
    """The strided copies that compute a layout op (permute, expand, slice, select, cat, pad)
    from contiguous inputs into its contiguous output (``pad``: only its interior; the borders
    are filled by the binder). 0-d shapes are copied as (1,)."""
    xs = [graph.tensors[i].shape for i in node.inputs]
    out = graph.tensors[node.output].shape
    a = node.attrs
    x, xst = xs[0], contiguous_strides(xs[0])
    ost = contiguous_strides(out)
    if node.op == "permute":
        return [_copy(0, out, [xst[d] for d in a["dims"]], 0, ost, 0)]
    if node.op == "expand":
        lead = len(out) - len(x)
        src = [0 if i < lead or x[i - lead] == 1 and out[i] != 1 else xst[i - lead] for i in range(len(out))]
        return [_copy(0, out, src, 0, ost, 0)]
    if node.op == "slice":
        d = a["dim"]
        src = list(xst)
        src[d] *= a["step"]
        return [_copy(0, out, src, a["start"] * xst[d], ost, 0)]
    if node.op == "select":
        d = a["dim"]
        return [_copy(0, out, xst[:d] + xst[d + 1:], a["index"] * xst[d], ost, 0)]
    if node.op == "pad":   # the input into the interior (the binder fills the rest)
        at = sum(lo * s for (lo, _), s in zip(a["pads"], ost))
        return [_copy(0, x, xst, 0, ost, at)]
    if node.op == "cat":
        d, at, result = a["dim"], 0, []
        for i, shape in enumerate(xs):
            result.append(_copy(i, shape, contiguous_strides(shape), 0, ost, at * ost[d]))
            at += shape[d]
        return result
    raise ValueError(f"{node.op} is not a layout op")


def _copy(i, sizes, src, src_off, dst, dst_off) -> Copy:
    if not sizes:  # a 0-d tensor: one element
        return Copy(i, (1,), (0,), src_off, (0,), dst_off)
    return Copy(i, tuple(sizes), tuple(src), src_off, tuple(dst), dst_off)
