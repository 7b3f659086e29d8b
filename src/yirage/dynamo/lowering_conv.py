"""Lowerings of the conv-net ATen ops onto the IR's conv-net ops (ir/conv.py), registered in
``lowering.LOWERINGS`` like the others:

| ATen op | IR | lowered when |
|---|---|---|
| ``convolution`` | ``conv2d`` | 2-d, not transposed |
| ``_native_batch_norm_legit_no_training`` | ``batch_norm`` | only output 0 used; statistics float32 or the input's dtype |
| ``max_pool2d_with_indices`` | ``max_pool2d`` | only output 0 (not the indices) used; ceil mode: the input padded with -inf at its end (``pad``) |
| ``avg_pool2d`` | ``avg_pool2d`` | no divisor_override; ceil mode where its windows are floor mode's, or one window over the whole map (then ``mean``) |

(``adaptive_avg_pool2d`` to 1x1 reaches the partitioner as ``mean.dim``, already lowered.)

This module must never compile or run a graph: it only builds IR.
"""
from __future__ import annotations

import operator

import torch
from torch.fx import Node

from .lowering import FIRST_OUTPUT_ONLY, _all_of, _no_kwargs, _val, lowers, tensor_problem

aten = torch.ops.aten


def _ints(v, n: int = 2) -> list[int] | None:
    """``v`` as a list of ``n`` ints (a single int, or a list of one, repeated: torch's int[2]
    arguments, e.g. ``padding=[0]`` of a ``padding="valid"`` convolution), or None."""
    if isinstance(v, (list, tuple)) and len(v) == 1:
        v = v[0]
    if isinstance(v, int) and not isinstance(v, bool):
        return [v] * n
    if isinstance(v, (list, tuple)) and len(v) == n and all(isinstance(i, int) and not isinstance(i, bool) for i in v):
        return list(v)
    return None


def _only_output_0(node: Node) -> str | None:
    for u in node.users:
        if u.target is not operator.getitem or u.args[1] != 0:
            return "an output other than 0 is used (only output 0 is lowered)"
    return None


def _tensors(*nodes) -> str | None:
    for n in nodes:
        if n is not None and (why := tensor_problem(n)):
            return why
    return None


def _check_conv(node):
    x, w, b, stride, padding, dilation, transposed, output_padding, groups = node.args[:9]
    if transposed:
        return "a transposed convolution"
    if _val(x) is None or _val(x).dim() != 4:
        return "not a 2-d convolution (input not 4-d NCHW)"
    if any(_ints(v) is None for v in (stride, padding, dilation)):
        return f"stride/padding/dilation {stride}, {padding}, {dilation} are not pairs of integers"
    if _val(w).dtype != _val(x).dtype or (b is not None and _val(b).dtype != _val(x).dtype):
        return "weight/bias dtype differs from the input's"
    return _all_of(_no_kwargs(), lambda n: _tensors(n, x, w, b))(node)


@lowers(aten.convolution.default, check=_check_conv)
def _conv(e, node):
    x, w, b, stride, padding, dilation, _, _, groups = node.args[:9]
    return e.g.conv2d(e[x], e[w], e[b] if b is not None else None, _ints(stride), _ints(padding), _ints(dilation),
                      groups)


def _check_batch_norm(node):
    x, w, b, mean, var = node.args[:5]
    why = _only_output_0(node) or _no_kwargs()(node) or _tensors(x, mean, var, w, b)
    if why:
        return why
    if any(t is not None and _val(t).dtype not in (torch.float32, _val(x).dtype) for t in (mean, var, w, b)):
        return "statistics or affine parameters neither float32 nor in the input's dtype"
    if (w is None) != (b is None):
        return "only one of weight and bias"
    return None


@lowers(aten._native_batch_norm_legit_no_training.default, check=_check_batch_norm)
def _batch_norm(e, node):
    x, w, b, mean, var, _, eps = node.args[:7]
    return (e.g.batch_norm(e[x], e[mean], e[var], e[w] if w is not None else None, e[b] if b is not None else None,
                           eps),)


def _pool_args(node):
    args = list(node.args) + [None] * 7
    kernel = _ints(args[1])
    stride = _ints(args[2]) if args[2] not in (None, []) else kernel
    padding = _ints(args[3] if args[3] is not None else 0)
    return kernel, stride, padding, args


def _ceil_extra(node, kernel, stride, padding, dilation) -> list[int] | None:
    """Rows and columns that ceil mode's last windows reach past the input's end and its
    padding, [rows, cols] (0 where ceil and floor mode make the same windows); None when the
    input's height or width is symbolic. The output size is torch's ``pooling_output_shape``:
    ceil((size + 2p - d(k-1) - 1) / s) + 1, less one when that last window would start past
    the input and the left padding."""
    extra = []
    for size, k, s, p, d in zip(_val(node.args[0]).shape[2:], kernel, stride, padding, dilation):
        if not isinstance(size, int):
            return None
        span = size + 2 * p - d * (k - 1) - 1
        extra.append(max(0, (_ceil_out(size, k, s, p, d) - 1) * s - span))
    return extra


def _ceil_out(size: int, k: int, s: int, p: int, d: int) -> int:
    """Ceil mode's output size along one dim (torch's ``pooling_output_shape``)."""
    span = size + 2 * p - d * (k - 1) - 1
    out = -(-span // s) + 1
    return out - 1 if (out - 1) * s >= size + p else out


def _whole_map_window(node, kernel, stride, padding) -> bool:
    """Is this ceil-mode average pool one window over the whole (static) map: no padding, a
    kernel at least the map's size and an output of 1x1, so the window, clipped to the map,
    holds every element (EfficientNet's pooler: a 1280 kernel over a 7x7 map)? It is then the
    mean."""
    sizes = _val(node.args[0]).shape[2:]
    return (padding == [0, 0] and all(isinstance(n, int) for n in sizes)
            and all(k >= n and _ceil_out(n, k, s, 0, 1) == 1 for n, k, s in zip(sizes, kernel, stride)))


def _check_max_pool(node):
    kernel, stride, padding, args = _pool_args(node)
    dilation = _ints(args[4] if args[4] is not None else 1)
    if None in (kernel, stride, padding, dilation):
        return "kernel/stride/padding/dilation are not pairs of integers"
    if _val(node.args[0]).dim() != 4:
        return "not a 4-d NCHW input"
    if args[5] and _ceil_extra(node, kernel, stride, padding, dilation) is None:
        return "ceil_mode=True with a symbolic height or width"
    return _only_output_0(node) or _no_kwargs()(node) or _tensors(node.args[0])


@lowers(aten.max_pool2d_with_indices.default, check=_check_max_pool)
def _max_pool(e, node):
    """Ceil mode is floor mode over the input padded at its end with -inf, as far as the last
    windows reach (torch's max ignores padding; every window holds an input element)."""
    kernel, stride, padding, args = _pool_args(node)
    dilation = _ints(args[4] if args[4] is not None else 1)
    x = e[node.args[0]]
    if args[5] and any(extra := _ceil_extra(node, kernel, stride, padding, dilation)):
        x = e.g.pad(x, [(0, 0), (0, 0), (0, extra[0]), (0, extra[1])], float("-inf"))
    return (e.g.max_pool2d(x, kernel, stride, padding, dilation),)


def _check_avg_pool(node):
    kernel, stride, padding, args = _pool_args(node)
    if None in (kernel, stride, padding):
        return "kernel/stride/padding are not pairs of integers"
    if args[6] is not None:
        return "divisor_override"
    if _val(node.args[0]).dim() != 4:
        return "not a 4-d NCHW input"
    if (args[4] and _ceil_extra(node, kernel, stride, padding, [1, 1]) != [0, 0]
            and not _whole_map_window(node, kernel, stride, padding)):
        # the divisor of a window past the end counts the padding only up to size + padding
        return "ceil_mode=True with windows past the input's end (or a symbolic height or width)"
    return _all_of(_no_kwargs(), lambda n: _tensors(n, n.args[0]))(node)


@lowers(aten.avg_pool2d.default, check=_check_avg_pool)
def _avg_pool(e, node):
    """Ceil mode only where its windows are floor mode's, or as the mean of a whole map
    (``_check_avg_pool``)."""
    kernel, stride, padding, args = _pool_args(node)
    if args[4] and _ceil_extra(node, kernel, stride, padding, [1, 1]) != [0, 0]:
        return e.g.mean(e[node.args[0]], [2, 3], keepdim=True)
    return e.g.avg_pool2d(e[node.args[0]], kernel, stride, padding, True if args[5] is None else bool(args[5]))


FIRST_OUTPUT_ONLY.update({aten._native_batch_norm_legit_no_training.default, aten.max_pool2d_with_indices.default})
