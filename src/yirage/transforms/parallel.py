"""Merging parallel linear layers and convolutions: the k ``linear`` ops that read the same input
(a transformer's q/k/v projections, an MLP's gate and up projections) become one
``linear_stack`` (one GEMM over the stacked weights) whose output planes are the old outputs,
taken as free views (``slice_rows`` then ``reshape``, both aliases of the stacked buffer);
the k ``conv2d`` ops of one input and one geometry (an Inception module's 1x1 branches, a
ResNet stage's first 1x1 convolution and its projection shortcut) become one
``conv2d_stack`` (``merge_parallel_convs``, below).

``merge_parallel_linears(graph, decide)`` returns a new graph computing the same outputs from
the same inputs (or ``graph`` itself when nothing merges). ``KNGraph.compile`` runs it on graphs
that set ``merge_parallel_ops`` (torch.compile's static-shape partitions do; the LLM engines'
decode graphs do not: their persistent kernel schedules each linear as tasks of its own, and a
symbolic partition would change structure between sizes). A group merges when:
- each op is a plain float ``linear`` (no GGUF-block weight, no ``compute_dtype``) with a
  weight of x's dtype, all of one weight shape and layout, all with a bias or none;
- its weights and biases are graph inputs (the model's parameters, available before any op);
- ``decide(case)`` says so: the backend's answer for a ``LinearGroup``, by measurement on the
  CPU (backends/cpu/backend.py), since one wider GEMM is not faster everywhere.

Linears of the same input include those of reshapes of one tensor to one shape (torch.compile's
graphs flatten x for each linear apart). The stacked op takes the place of the group's first
linear and reads that linear's x; the views of the later parts are made there too, which is safe
because every input of the group exists by then.

Source: the "batch optimization" of the YiRage/Mirage documents and the horizontal fusion of
TensorRT and TorchInductor's ``concat_linear`` (vLLM's ``QKVParallelLinear`` does it by hand).

``merge_parallel_convs(graph, decide)`` does the same for convolutions, after the convolution
passes (transforms/conv.py: epilogues fused, NHWC chosen), on the graphs that set
``merge_parallel_ops``. A group merges when its ``conv2d`` ops read the same x with the
same window, stride, padding, dilation, groups and layout, none has a residual (it would be
computed later), every weight, bias and batch-norm tensor is a graph input, and ``decide(case)``
(a ``ConvGroup``) says so. Each part keeps its own epilogue (batch norm, activation); the
widths may differ. The ``conv2d_stack``'s output is the parts' outputs one after another,
each a free view (``slice_rows`` of the flat buffer, then ``reshape``).

This module must never run a graph or depend on a backend.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from ..ir.conv import conv_inputs
from ..ir.graph import KernelGraph, OpNode
from ..ir.ops import OPS, linear_nk


@dataclass(frozen=True)
class LinearGroup:
    """k linear layers of one input: x [M, K] (leading dims flattened) times k weights of N out
    features each; ``dtype`` the IR dtype name; ``layout`` the weights' layout ("nk"/"kn")."""

    M: int
    N: int
    K: int
    parts: int
    dtype: str
    layout: str
    bias: bool


def _candidate(graph: KernelGraph, node: OpNode, inputs: set[int], reshaped: dict[int, int]):
    """The grouping key of a linear that may merge, or None. x is keyed by the tensor it is a
    reshape of (torch.compile's graphs flatten x once per linear) and its shape."""
    if node.op != "linear" or set(node.attrs) - {"weight_layout"}:
        return None
    x, w = graph.tensors[node.inputs[0]], graph.tensors[node.inputs[1]]
    if not x.dtype.is_float or w.dtype != x.dtype or any(t not in inputs for t in node.inputs[1:]):
        return None
    root = node.inputs[0]
    while root in reshaped:
        root = reshaped[root]
    return root, tuple(x.shape), node.attrs.get("weight_layout", "nk"), len(node.inputs) == 3, tuple(w.shape)


def merge_parallel_linears(graph: KernelGraph, decide: Callable[[LinearGroup], bool]) -> KernelGraph:
    """The graph with each group of parallel linear layers that ``decide`` accepts merged into
    one ``linear_stack`` (see the module docstring); ``graph`` itself when none is, or when the
    graph holds threadblock ``customized`` ops (they stay bound to their graph)."""
    if any(n.op == "customized" for n in graph.ops):
        return graph
    inputs = set(graph.inputs)
    reshaped = {n.output: n.inputs[0] for n in graph.ops if n.op == "reshape"}
    groups: dict[tuple, list[int]] = {}
    for i, n in enumerate(graph.ops):
        key = _candidate(graph, n, inputs, reshaped)
        if key is not None:
            groups.setdefault(key, []).append(i)
    merged: dict[int, list[int]] = {}   # first op index -> the group's op indices
    for (_, x_shape, layout, bias, w_shape), idx in groups.items():
        if len(idx) < 2:
            continue
        N, K = linear_nk(w_shape, {"weight_layout": layout})
        x = graph.tensors[graph.ops[idx[0]].inputs[0]]
        case = LinearGroup(math.prod(x_shape[:-1]), N, K, len(idx), x.dtype.value, layout, bias)
        if decide(case):
            merged[idx[0]] = idx
    if not merged:
        return graph

    def stack(g: KernelGraph, n: OpNode, parts: list[OpNode]) -> None:
        bias = len(n.inputs) == 3
        attrs = {"parts": len(parts), "bias": bias, **({"weight_layout": n.attrs["weight_layout"]}
                                                      if "weight_layout" in n.attrs else {})}
        ins = [n.inputs[0]] + [p.inputs[1] for p in parts] + ([p.inputs[2] for p in parts] if bias else [])
        stacked = _append(g, "linear_stack", ins, attrs)
        for k, p in enumerate(parts):
            plane = _append(g, "slice_rows", [stacked], {"start": k, "end": k + 1})
            _append(g, "reshape", [plane], {"shape": list(graph.tensors[p.output].shape)}, out=p.output)
    return _rebuild(graph, merged, stack)


def _append(g: KernelGraph, op: str, ins: list[int], attrs: dict, out: int | None = None) -> int:
    """Append ``op`` to ``g`` (its output a new tensor, or the existing ``out``); its output id."""
    if out is None:
        g.tensors.append(OPS[op].infer([g.tensors[t] for t in ins], attrs))
        out = len(g.tensors) - 1
    g.ops.append(OpNode(op, ins, attrs, out))
    return out


def _rebuild(graph: KernelGraph, merged: dict[int, list[int]], stack) -> KernelGraph:
    """``graph`` with each group ``merged[first] = [op indices]`` replaced, at its first op, by
    what ``stack(g, first_op, parts)`` appends (the stacked op and the views that give each
    part's old output id)."""
    absorbed = {i for idx in merged.values() for i in idx}
    g = graph.blank_like()
    g.tensors, g.names = list(graph.tensors), dict(graph.names)
    g.inputs, g.outputs = list(graph.inputs), list(graph.outputs)
    for i, n in enumerate(graph.ops):
        if i in merged:
            stack(g, n, [graph.ops[j] for j in merged[i]])
        elif i not in absorbed:
            g.ops.append(n)
    return g


@dataclass(frozen=True)
class ConvGroup:
    """k ``conv2d`` ops of one x: ``x_shape`` as the ops take it (NCHW, or NHWC with layout
    'nhwc'), ``dtype`` the IR dtype name, ``weights`` each part's weight shape [O_i, C / groups,
    kh, kw], ``parts`` each part's conv2d attrs (stride, padding, dilation, groups, layout,
    ``bias``, and its epilogue: ``bn``, ``activation``, ``act_args``)."""

    x_shape: tuple
    dtype: str
    weights: tuple
    parts: tuple


#: the attrs that must agree for convolutions to merge
_CONV_GEOMETRY = ("stride", "padding", "dilation", "groups", "layout")


def _conv_candidate(graph: KernelGraph, node: OpNode, inputs: set[int]):
    """The grouping key of a conv2d that may merge, or None."""
    if node.op != "conv2d" or node.attrs.get("residual"):
        return None
    x, w = graph.tensors[node.inputs[0]], graph.tensors[node.inputs[1]]
    if not x.dtype.is_float or any(t not in inputs for t in node.inputs[1:]):
        return None
    geometry = tuple(str(node.attrs.get(k, "nchw" if k == "layout" else None)) for k in _CONV_GEOMETRY)
    return node.inputs[0], tuple(w.shape[1:]), geometry


def merge_parallel_convs(graph: KernelGraph, decide: Callable[[ConvGroup], bool]) -> KernelGraph:
    """The graph with each group of parallel convolutions that ``decide`` accepts merged into
    one ``conv2d_stack`` (see the module docstring); ``graph`` itself when none is, or when the
    graph holds threadblock ``customized`` ops."""
    if not any(n.op == "conv2d" for n in graph.ops) or any(n.op == "customized" for n in graph.ops):
        return graph
    inputs = set(graph.inputs)
    groups: dict[tuple, list[int]] = {}
    for i, n in enumerate(graph.ops):
        key = _conv_candidate(graph, n, inputs)
        if key is not None:
            groups.setdefault(key, []).append(i)
    merged: dict[int, list[int]] = {}   # first op index -> the group's op indices
    part_attrs: dict[int, dict] = {}     # op index -> its attrs as a part (``bias`` explicit)
    for idx in groups.values():
        if len(idx) < 2:
            continue
        for j in idx:
            n = graph.ops[j]
            part_attrs[j] = dict(n.attrs, bias=conv_inputs(n.inputs, n.attrs).bias is not None)
        x = graph.tensors[graph.ops[idx[0]].inputs[0]]
        case = ConvGroup(tuple(x.shape), x.dtype.value,
                         tuple(tuple(graph.tensors[graph.ops[j].inputs[1]].shape) for j in idx),
                         tuple(part_attrs[j] for j in idx))
        if decide(case):
            merged[idx[0]] = idx
    if not merged:
        return graph
    index = {id(n): i for i, n in enumerate(graph.ops)}

    def stack(g: KernelGraph, n: OpNode, parts: list[OpNode]) -> None:
        ins = [n.inputs[0]] + [t for p in parts for t in p.inputs[1:]]
        stacked = _append(g, "conv2d_stack", ins, {"parts": [part_attrs[index[id(p)]] for p in parts]})
        off = 0
        for p in parts:
            shape = list(graph.tensors[p.output].shape)
            view = _append(g, "slice_rows", [stacked], {"start": off, "end": off + math.prod(shape)})
            _append(g, "reshape", [view], {"shape": shape}, out=p.output)
            off += math.prod(shape)
    return _rebuild(graph, merged, stack)


def linear_stack_parts(node: OpNode) -> list[tuple[OpNode, list[int]]]:
    """The ``linear`` ops a ``linear_stack`` node stands for: ``(op, positions)`` per part, the
    positions of its inputs (x, weight[, bias]) among the stacked node's inputs; each op's
    output id is the stacked node's (a backend binds it into that part's plane)."""
    k, bias = node.attrs["parts"], node.attrs.get("bias")
    attrs = {"weight_layout": node.attrs["weight_layout"]} if "weight_layout" in node.attrs else {}
    parts = []
    for i in range(k):
        pos = [0, 1 + i] + ([1 + k + i] if bias else [])
        parts.append((OpNode("linear", [node.inputs[p] for p in pos], dict(attrs), node.output), pos))
    return parts


__all__ = ["ConvGroup", "LinearGroup", "linear_stack_parts", "merge_parallel_convs", "merge_parallel_linears"]
