"""The lowering table: which ATen ops become yirage IR, and the IR each one emits.

``LOWERINGS`` maps an ATen overload (``torch.ops.aten.gelu.default``, ...) to a ``Lowering``:
- ``check(node) -> str | None``: None when this FX node lowers, else the reason it stays a
  torch op (read by the partitioner's operator support and printed by ``yr.explain``). It
  looks only at the node's arguments and the shapes and dtypes dynamo recorded in
  ``node.meta["val"]``;
- ``emit(emitter, node)``: adds the node's IR ops to the partition's kernel graph and returns
  the DTensor of its result.

Adding an op is one ``@lowers(...)`` entry here and one test (tests/dynamo/test_lowering.py
runs every entry against eager). Shared preconditions: every tensor a lowering touches is
float32/float16/bfloat16 with positive dims and at least one dim; a lowering declines
anything else rather than guess. Dims may be symbolic (dynamic shapes): a check must then
not branch on their values (that would add guards); the partition runs ``emit`` on a copy
specialized to each concrete input signature (specialize.py), where every dim is an int
and integer arguments that were symbolic are literals.

Also here: ``rewrite_linear``, the one graph rewrite before partitioning, which turns the
``addmm(bias, x, permute(w, [1, 0]))`` that the decompositions make of ``nn.Linear`` back
into ``aten.linear`` (a torch op too, so the graph stays runnable if it is not lowered).

This module must never compile or run a graph, nor know a backend: it only builds IR.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable

import torch
from torch.fx import GraphModule, Node

from ..dtypes import as_dtype
from ..ir.graph import DTensor, KernelGraph

aten = torch.ops.aten

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Lowering:
    """How one ATen overload becomes IR: ``check(node)`` returns None or the reason it
    declines; ``emit(emitter, node)`` returns the result's DTensor (a tuple for an op with
    several outputs, such as ``native_layer_norm``)."""

    check: Callable[[Node], str | None]
    emit: Callable[["Emitter", Node], object]


LOWERINGS: dict[object, Lowering] = {}


def lowers(*targets, check: Callable[[Node], str | None]):
    """Register the decorated ``emit`` for every overload in ``targets`` (missing overloads,
    named as None, are skipped) with the precondition ``check``."""
    def register(emit):
        for t in targets:
            if t is not None:
                LOWERINGS[t] = Lowering(check, emit)
        return emit
    return register


class Emitter:
    """Builds one partition's kernel graph: ``env`` maps FX nodes to their DTensors;
    scalar operands become (1,)-shaped graph inputs whose values are kept in ``constants``
    (passed after the partition's own inputs at every call). Build it outside any fake
    tensor mode (AOTAutograd compiles under one), so constants hold real values."""

    def __init__(self, graph: KernelGraph):
        self.g = graph
        self.env: dict[Node, object] = {}
        self.constants: list[torch.Tensor] = []

    def __getitem__(self, node: Node) -> DTensor:
        return self.env[node]

    def operand(self, arg, dtype: torch.dtype) -> DTensor:
        """The DTensor of a node argument, or a constant input holding a Python scalar."""
        if isinstance(arg, Node):
            return self.env[arg]
        self.constants.append(torch.tensor([arg], dtype=dtype))
        return self.g.new_input((1,), dtype=as_dtype(dtype))


# ---- preconditions ------------------------------------------------------------------------

def _val(node):
    return node.meta.get("val") if isinstance(node, Node) else None


def tensor_problem(node: Node, val=None) -> str | None:
    """Why the tensor ``node`` produces (or ``val``) cannot be an IR tensor, or None."""
    v = _val(node) if val is None else val
    if not isinstance(v, torch.Tensor):
        return f"{node.name} has no tensor metadata"
    if v.dtype not in FLOAT_DTYPES:
        return f"{node.name} is {v.dtype}; these lowerings take float32/float16/bfloat16"
    if v.dim() == 0:
        return f"{node.name} is a 0-d tensor"
    if any(isinstance(d, int) and d == 0 for d in v.shape):   # a symbolic dim is >= 2 (dynamo)
        return f"{node.name} is empty {tuple(v.shape)}"
    return None


def is_size(node) -> bool:
    """Whether ``node`` is an FX node that computes an integer (a symbolic size)."""
    v = _val(node)
    return isinstance(node, Node) and isinstance(v, (int, torch.SymInt)) and not isinstance(v, bool)


def _is_scalar(a) -> bool:
    return isinstance(a, (int, float)) and not isinstance(a, bool)


def _tensors_ok(node: Node, same_dtype: bool = True, output=True) -> str | None:
    """The shared precondition: the output and every tensor argument pass ``tensor_problem``
    (and share the output's dtype when ``same_dtype``). Integer arguments that are nodes
    (symbolic sizes, such as a view's ``[s0, 64]``) are not tensors and are skipped: the
    partition specializes them to their values (specialize.py)."""
    args = [n for n in node.all_input_nodes if not is_size(n)]
    for n in ([node] if output else []) + args:
        why = tensor_problem(n)
        if why:
            return why
    if same_dtype and output:
        dt = _val(node).dtype
        for n in args:
            if _val(n).dtype != dt:
                return f"mixed dtypes ({_val(n).dtype} {n.name} -> {dt}); type promotion is not lowered"
    return None


def _all_of(*checks):
    def check(node):
        for c in checks:
            why = c(node)
            if why:
                return why
        return None
    return check


def _no_kwargs(*allowed):
    def check(node):
        extra = sorted(set(node.kwargs) - set(allowed))
        return f"keyword argument(s) {extra} are not lowered" if extra else None
    return check


# ---- elementwise --------------------------------------------------------------------------

def _check_binary(node: Node) -> str | None:
    a, b = node.args[:2]
    if not any(isinstance(x, Node) for x in (a, b)):
        return "no tensor operand"
    for x in (a, b):
        if not isinstance(x, Node) and not _is_scalar(x):
            return f"operand {x!r} is neither a tensor nor a real scalar"
    alpha = node.kwargs.get("alpha", 1)
    if not _is_scalar(alpha):
        return f"alpha {alpha!r} is not a real scalar"
    return _all_of(_no_kwargs("alpha"), _tensors_ok)(node)


def _binary(ir_op: str):
    def emit(e: Emitter, node: Node):
        a, b = node.args[:2]
        dtype = _val(node).dtype
        alpha = node.kwargs.get("alpha", 1)
        if alpha != 1 and not isinstance(b, Node):
            b, alpha = b * alpha, 1
        if ir_op == "mul" and not isinstance(b, Node):
            return e.g.scale(e[a], b)
        if ir_op == "mul" and not isinstance(a, Node):
            return e.g.scale(e[b], a)
        y = e.operand(b, dtype)
        if alpha != 1:
            y = e.g.scale(y, alpha)
        return getattr(e.g, ir_op)(e.operand(a, dtype), y)
    return emit


for _name in ("add", "sub", "mul", "div"):
    _packet = getattr(aten, _name)
    lowers(_packet.Tensor, _packet.Scalar, check=_check_binary)(_binary(_name))

_unary_check = _all_of(_no_kwargs(), _tensors_ok)
for _name in ("exp", "sqrt", "rsqrt", "neg", "relu", "silu", "tanh", "sigmoid", "erf", "log", "exp2", "abs",
              "reciprocal"):
    lowers(getattr(aten, _name).default, check=_unary_check)(
        (lambda ir: lambda e, node: getattr(e.g, ir)(e[node.args[0]]))(_name))


def _check_two_tensors(node: Node) -> str | None:
    if not all(isinstance(a, Node) for a in node.args[:2]):
        return "a scalar operand"
    return _all_of(_no_kwargs(), _tensors_ok)(node)


for _name in ("maximum", "minimum"):
    lowers(getattr(aten, _name).default, check=_check_two_tensors)(
        (lambda ir: lambda e, node: getattr(e.g, ir)(e[node.args[0]], e[node.args[1]]))(_name))


@lowers(aten.pow.Tensor_Tensor, check=_check_two_tensors)
def _pow(e, node):
    return e.g.pow(e[node.args[0]], e[node.args[1]])


def _check_pow_scalar(node):
    if not _is_scalar(node.args[1]):
        return f"exponent {node.args[1]!r} is not a real scalar"
    return _all_of(_no_kwargs(), _tensors_ok)(node)


@lowers(aten.pow.Tensor_Scalar, check=_check_pow_scalar)
def _pow_scalar(e, node):
    return e.g.pow(e[node.args[0]], float(node.args[1]))


def _check_gelu(node):
    approx = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
    if approx not in ("none", "tanh"):
        return f"approximate={approx!r}"
    return _all_of(_no_kwargs("approximate"), _tensors_ok)(node)


@lowers(aten.gelu.default, check=_check_gelu)
def _gelu(e, node):
    return e.g.gelu(e[node.args[0]], node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none"))


def _clamp_bounds(node):
    if node.target is aten.clamp.default:
        lo = node.kwargs.get("min", node.args[1] if len(node.args) > 1 else None)
        hi = node.kwargs.get("max", node.args[2] if len(node.args) > 2 else None)
    elif node.target is aten.clamp_min.default:
        lo, hi = node.args[1], None
    else:
        lo, hi = None, node.args[1]
    return lo, hi


def _check_clamp(node):
    lo, hi = _clamp_bounds(node)
    if any(b is not None and not _is_scalar(b) for b in (lo, hi)) or (lo is None and hi is None):
        return f"bounds {lo!r}, {hi!r} are not real scalars"
    if lo is not None and hi is not None and lo > hi:
        return f"min {lo} > max {hi}"
    return _all_of(_no_kwargs("min", "max"), _tensors_ok)(node)


@lowers(aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default, check=_check_clamp)
def _clamp(e, node):
    lo, hi = _clamp_bounds(node)
    return e.g.clamp(e[node.args[0]], float("-inf") if lo is None else lo, float("inf") if hi is None else hi)


def _check_to_copy(node):
    x = node.args[0]
    v, xv = _val(node), _val(x)
    if isinstance(v, torch.Tensor) and isinstance(xv, torch.Tensor) and v.device != xv.device:
        return f"a copy from {xv.device} to {v.device}"
    if node.kwargs.get("layout") not in (None, torch.strided):
        return f"layout {node.kwargs['layout']}"
    if node.kwargs.get("memory_format") not in (None, torch.preserve_format, torch.contiguous_format):
        return f"memory_format {node.kwargs['memory_format']}"
    return _all_of(_no_kwargs("dtype", "layout", "device", "memory_format", "pin_memory"),
                   lambda n: _tensors_ok(n, same_dtype=False))(node)


def _check_narrowing(node):
    """A cast to a half type (float16, bfloat16) from another dtype is lowered only where
    nothing lowered reads it: a fused kernel rounds a value to its dtype only when it stores it
    (transforms/fusion.py treats ``cast`` as the value itself), so ``x.to(bfloat16) * 2`` fused
    would skip the rounding (and float16's overflow to inf) that eager does."""
    src, dst = _val(node.args[0]).dtype, _val(node).dtype
    if dst != src and dst != torch.float32 and any(u.target in LOWERINGS for u in node.users):
        return (f"a narrowing cast {src} -> {dst} read by lowered ops (a fused kernel would not "
                "round between them)")
    return None


@lowers(aten._to_copy.default, check=_all_of(_check_to_copy, _check_narrowing))
def _to_copy(e, node):
    return e.g.cast(e[node.args[0]], as_dtype(_val(node).dtype))


# ---- views --------------------------------------------------------------------------------

@lowers(aten.view.default, aten._unsafe_view.default, check=_all_of(_no_kwargs(), _tensors_ok))
def _reshape(e, node):
    return e.g.reshape(e[node.args[0]], tuple(_val(node).shape))


#: ops that only change the shape: they do not count towards ``min_block_size``
VIEW_TARGETS = {aten.view.default, aten._unsafe_view.default, operator.getitem}


# ---- row ops: softmax, layer_norm, sum/mean over the last dim -----------------------------

def _check_softmax(node):
    if node.args[2]:
        return "half_to_float=True"
    return _all_of(_no_kwargs(), _tensors_ok)(node)


@lowers(aten._softmax.default, check=_check_softmax)
def _softmax(e, node):
    return e.g.softmax(e[node.args[0]], node.args[1])


@lowers(aten._log_softmax.default, check=_check_softmax)
def _log_softmax(e, node):
    return e.g.log_softmax(e[node.args[0]], node.args[1])


def _check_layer_norm(node):
    x, shape, w, b, eps = node.args[:5]
    for u in node.users:
        if u.target is not operator.getitem or u.args[1] != 0:
            return "its mean/rstd outputs are used (only output 0 is lowered)"
    why = _no_kwargs()(node) or tensor_problem(node, _val(node)[0] if isinstance(_val(node), tuple) else None)
    if why:
        return why
    xv = _val(x)
    for t in (x, w, b):
        if t is not None and (why := tensor_problem(t)):
            return why
        if t is not None and _val(t).dtype != xv.dtype:
            return f"weight/bias dtype {_val(t).dtype} differs from the input's {xv.dtype}"
    if w is not None and tuple(_val(w).shape) != tuple(shape) or b is not None and tuple(_val(b).shape) != tuple(shape):
        return "weight/bias shape differs from normalized_shape"
    return None


@lowers(aten.native_layer_norm.default, check=_check_layer_norm)
def _layer_norm(e, node):
    x, shape, w, b, eps = node.args[:5]
    return (e.g.layer_norm(e[x], tuple(shape), e[w] if w is not None else None,
                           e[b] if b is not None else None, eps),)


def _check_getitem(node):
    src, i = node.args
    if not isinstance(src, Node) or src.target not in LOWERINGS or not isinstance(_val(src), tuple):
        return "getitem of a value that is not a lowered op's outputs"
    if src.target is aten.native_layer_norm.default and i != 0:
        return f"output {i} of native_layer_norm"
    return LOWERINGS[src.target].check(src)


@lowers(operator.getitem, check=_check_getitem)
def _getitem(e, node):
    return e.env[node.args[0]][node.args[1]]


def _reduce_dims(node):
    """The reduced dims of a sum/mean/amax/amin/var node (None: every dim)."""
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    return [dims] if isinstance(dims, int) else dims


def _check_reduce(node):
    if node.kwargs.get("dtype") is not None:
        return f"dtype={node.kwargs['dtype']}"
    dims, n = _reduce_dims(node), _val(node.args[0]).dim() if _val(node.args[0]) is not None else 0
    if dims is not None and len(dims) > 0:
        ds = sorted(d % n for d in dims) if n else []
        if ds and ds != list(range(ds[0], ds[0] + len(ds))):
            return f"dims {list(dims)} are not adjacent"
    elif dims is not None:
        return "an empty dim list"
    if node.target is aten.var.correction:
        c = node.kwargs.get("correction", 1)
        if not _is_scalar(c if c is not None else 1) or (c is not None and c < 0):
            return f"correction {c!r}"
    return _all_of(_no_kwargs("dtype", "keepdim", "correction"), _tensors_ok)(node)


@lowers(aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default, aten.var.correction,
        check=_check_reduce)
def _reduce(e, node):
    x, dims = e[node.args[0]], _reduce_dims(node)
    name = {aten.sum.dim_IntList: "sum", aten.mean.dim: "mean", aten.amax.default: "amax",
            aten.amin.default: "amin", aten.var.correction: "var"}[node.target]
    extra = {}
    if name == "var":
        c = node.kwargs.get("correction", 1)
        extra["correction"] = 1 if c is None else c
    r = getattr(e.g, name)(x, None if dims is None else list(dims), keepdim=True, **extra)
    out_shape = tuple(_val(node).shape)
    return r if out_shape == tuple(r.shape) else e.g.reshape(r, out_shape)


# ---- layout: permute, expand, slice, select, cat (copies) ---------------------------------

@lowers(aten.permute.default, check=_all_of(_no_kwargs(), _tensors_ok))
def _permute(e, node):
    return e.g.permute(e[node.args[0]], list(node.args[1]))


def _check_expand(node):
    if node.kwargs.get("implicit", False):
        return "implicit=True"
    return _all_of(_no_kwargs("implicit"), _tensors_ok)(node)


@lowers(aten.expand.default, check=_check_expand)
def _expand(e, node):
    return e.g.expand(e[node.args[0]], tuple(_val(node).shape))


def _check_slice(node):
    args = list(node.args[1:]) + [None] * (4 - len(node.args[1:]))
    dim, start, end, step = (args[0] if args[0] is not None else 0), args[1], args[2], args[3] or 1
    for a in (dim, step, *(x for x in (start, end) if x is not None and not is_size(x))):
        if not isinstance(a, int):
            return f"slice bound {a!r} is not an integer"
    if step < 1:
        return f"step {step}"
    return _all_of(_no_kwargs(), _tensors_ok)(node)


@lowers(aten.slice.Tensor, check=_check_slice)
def _slice(e, node):
    args = list(node.args[1:]) + [None] * (4 - len(node.args[1:]))
    dim, start, end, step = (args[0] if args[0] is not None else 0), args[1], args[2], args[3] or 1
    n = _val(node.args[0]).shape[dim]
    end = None if end is not None and end >= n else end   # INT64_MAX: to the end
    return e.g.slice(e[node.args[0]], dim, start, end, step)


@lowers(aten.select.int, check=_all_of(_no_kwargs(), _tensors_ok))
def _select(e, node):
    return e.g.select(e[node.args[0]], node.args[1], node.args[2])


def _check_cat(node):
    tensors = node.args[0]
    if not isinstance(tensors, (list, tuple)) or not all(isinstance(t, Node) for t in tensors):
        return "its inputs are not a list of tensors"
    shapes = [tuple(_val(t).shape) for t in tensors if _val(t) is not None]
    if any(len(sh) != len(shapes[0]) for sh in shapes):
        return "inputs of different ranks (legacy empty tensors)"
    return _all_of(_no_kwargs("dim"), _tensors_ok)(node)


@lowers(aten.cat.default, check=_check_cat)
def _cat(e, node):
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
    return e.g.cat([e[t] for t in node.args[0]], dim)


# ---- matmuls ------------------------------------------------------------------------------

def _ranks(*ranks):
    def check(node):
        got = [_val(a).dim() for a in node.args[-len(ranks):]]
        return None if got == list(ranks) else f"operand ranks {got}, expected {list(ranks)}"
    return check


@lowers(aten.mm.default, check=_all_of(_no_kwargs(), _tensors_ok, _ranks(2, 2)))
def _mm(e, node):
    return e.g.matmul(e[node.args[0]], e[node.args[1]])


@lowers(aten.bmm.default, check=_all_of(_no_kwargs(), _tensors_ok, _ranks(3, 3)))
def _bmm(e, node):
    return e.g.matmul(e[node.args[0]], e[node.args[1]])


def _check_addmm(node):
    if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
        return "beta/alpha other than 1"
    return _all_of(_no_kwargs("beta", "alpha"), _tensors_ok,
                   lambda n: _ranks(2, 2)(n) if isinstance(n.args[0], Node) else "a scalar bias")(node)


@lowers(aten.addmm.default, check=_check_addmm)
def _addmm(e, node):
    bias, a, b = node.args[:3]
    return e.g.add(e.g.matmul(e[a], e[b]), e[bias])


def _check_linear(node):
    x, w = node.args[:2]
    bias = node.args[2] if len(node.args) > 2 else None
    if _val(w) is None or _val(w).dim() != 2 or (bias is not None and _val(bias).dim() != 1):
        return "weight not 2-d or bias not 1-d"
    return _all_of(_no_kwargs(), _tensors_ok)(node)


@lowers(aten.linear.default, check=_check_linear)
def _linear(e, node):
    x, w = node.args[:2]
    bias = node.args[2] if len(node.args) > 2 else None
    return e.g.linear(e[x], e[w], e[bias] if bias is not None else None)


def rewrite_linear(gm: GraphModule) -> int:
    """Turn ``addmm(bias, x, permute(w, [1, 0]))`` and ``mm(x, permute(w, [1, 0]))`` (what
    the decompositions make of ``nn.Linear``) into ``aten.linear(x, w[, bias])`` with a 1-d
    bias, in place; a permute left without users is erased. Returns the number rewritten."""
    count = 0
    for node in list(gm.graph.nodes):
        is_addmm = node.target is aten.addmm.default and not node.kwargs
        if not (is_addmm or node.target is aten.mm.default):
            continue
        bias, x, wt = (node.args[:3] if is_addmm else (None, *node.args[:2]))
        if not (isinstance(wt, Node) and wt.target is aten.permute.default and list(wt.args[1]) == [1, 0]):
            continue
        if bias is not None and not (isinstance(_val(bias), torch.Tensor) and _val(bias).dim() == 1):
            continue
        w = wt.args[0]
        with gm.graph.inserting_before(node):
            lin = gm.graph.call_function(aten.linear.default, (x, w) + ((bias,) if bias is not None else ()))
        lin.meta = dict(node.meta)
        node.replace_all_uses_with(lin)
        gm.graph.erase_node(node)
        if not wt.users:
            gm.graph.erase_node(wt)
        count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count
