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
float32/float16/bfloat16 with positive dims and at least one dim; a lowering
declines anything else rather than guess. Where the IR op takes more, so does its lowering,
and no further: bool tensors for comparisons, logical ops, ``where``, casts and the layout
ops (views, permute, expand, slice, select, cat, clone), int64 for the indices of
``embedding``/``index_select``/``gather`` and for what the layout ops move; 0-d operands of
the elementwise ops (they broadcast).

Constants: a node that computes a tensor from nothing the graph is called with (``arange``,
``full``, ``zeros``, ``ones``, ``scalar_tensor``, the ``*_like`` factories, and any pure op
all of whose tensor arguments are such constants: the int64 arithmetic transformers does on
position ids, T5's relative-position buckets, the bool masks built from ``arange``) is folded:
it lowers whenever a lowered op reads it, torch computes its value once when the partition is
built (static shapes only), and the partition takes it as a constant input. A constant
declines when only torch ops read it, when it is larger than ``MAX_CONSTANT_BYTES``, or when
its dtype is not one the IR has.

Dims may be symbolic (dynamic shapes): a check must then not branch on their values (that
would add guards); the partition runs ``emit`` on a copy specialized to each concrete input
signature (specialize.py), where every dim is an int and integer arguments that were symbolic
are literals.

Also here, the graph rewrites before partitioning: ``rewrite_linear`` turns the
``addmm(bias, x, permute(w, [1, 0]))`` that the decompositions make of ``nn.Linear`` back
into ``aten.linear``, ``rewrite_rotary_emb`` turns transformers' rotate-half RoPE into
``yirage::rotary_emb``, and ``rewrite_gelu_tanh`` turns a tanh GELU written out in ATen ops
(GPT-2's NewGELU) into ``aten.gelu(approximate="tanh")`` (torch ops too, so the graph stays
runnable where it is not lowered).

This module must never compile or run a graph, nor know a backend: it only builds IR.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx import GraphModule, Node

from ..dtypes import as_dtype
from ..ir.graph import DTensor, KernelGraph

aten = torch.ops.aten

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: what the comparisons, ``where`` and casts take: the float types and bool (a row program's dtypes)
ROW_DTYPES = (*FLOAT_DTYPES, torch.bool)
#: what the layout ops (views, permute, expand, slice, select, cat, clone) and the indexing ops move
LAYOUT_DTYPES = (*ROW_DTYPES, torch.int32, torch.int64)


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
    named as None, are skipped) with the precondition ``check``. A node of these ops whose
    value is a constant (``constant_problem``) lowers as a folded constant instead."""
    def register(emit):
        for t in targets:
            if t is not None:
                LOWERINGS[t] = Lowering(_or_constant(check), _or_constant_emit(emit))
        return emit
    return register


def _or_constant(check):
    def check_or_fold(node):
        if constant_problem(node) is None:
            return None if _read_by_lowered(node) else "a constant that only torch ops read"
        return check(node)
    check_or_fold.own = check
    return check_or_fold


def _or_constant_emit(emit):
    def emit_or_fold(e, node):
        return _Constant(node) if constant_problem(node) is None else emit(e, node)
    return emit_or_fold


@dataclass(frozen=True)
class _Constant:
    """A folded constant node whose DTensor is made only when a lowered op reads it."""

    node: Node


class Emitter:
    """Builds one partition's kernel graph: ``env`` maps FX nodes to their DTensors;
    scalar operands become (1,)-shaped graph inputs whose values are kept in ``constants``
    (passed after the partition's own inputs at every call), and so do folded constants (see
    ``value``). Build it outside any fake tensor mode (AOTAutograd compiles under one), so
    constants hold real values."""

    def __init__(self, graph: KernelGraph, gemm_dtype: str | None = None):
        self.g = graph
        self.env: dict[Node, object] = {}
        self.constants: list[torch.Tensor] = []
        self.gemm_dtype = gemm_dtype   # options.dtype: float32 linears compute in it ("bfloat16")

    def __getitem__(self, node: Node) -> DTensor:
        got = self.env[node]
        if isinstance(got, _Constant):
            got = self.env[node] = self.constant(self.value(node))
        return got

    def value(self, node: Node) -> torch.Tensor:
        """The value of a constant node (``constant_value``)."""
        return constant_value(node)

    def constant(self, value: torch.Tensor) -> DTensor:
        """A graph input holding ``value`` at every call (a uniform tensor of more than 1024
        elements is held as one element and expanded)."""
        value = value.detach()
        if value.numel() > 1024 and bool((value == value.reshape(-1)[0]).all()):
            return self.g.expand(self.constant(value.reshape(-1)[0].clone()), tuple(value.shape))
        self.constants.append(value.contiguous().clone())
        return self.g.new_input(tuple(value.shape), dtype=as_dtype(value.dtype))

    def operand(self, arg, dtype: torch.dtype) -> DTensor:
        """The DTensor of a node argument, or a constant input holding a Python scalar."""
        if isinstance(arg, Node):
            return self[arg]
        self.constants.append(torch.tensor([arg], dtype=dtype))
        return self.g.new_input((1,), dtype=as_dtype(dtype))


# ---- preconditions ------------------------------------------------------------------------

def _val(node):
    return node.meta.get("val") if isinstance(node, Node) else None


def tensor_problem(node: Node, val=None, dtypes=FLOAT_DTYPES) -> str | None:
    """Why the tensor ``node`` produces (or ``val``) cannot be an IR tensor of one of ``dtypes``
    (default: the float types), or None."""
    v = _val(node) if val is None else val
    if not isinstance(v, torch.Tensor):
        return f"{node.name} has no tensor metadata"
    if v.dtype not in dtypes:
        return f"{node.name} is {v.dtype}; this lowering takes {'/'.join(str(d)[6:] for d in dtypes)}"
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


def _tensors_ok(node: Node, same_dtype: bool = True, output=True, dtypes=FLOAT_DTYPES,
                scalar_args: bool = False) -> str | None:
    """The shared precondition: the output and every tensor argument pass ``tensor_problem``
    with ``dtypes`` (and share the output's dtype when ``same_dtype``); ``scalar_args``: 0-d
    arguments pass too (operands of broadcasting elementwise ops). Integer arguments that are
    nodes (symbolic sizes, such as a view's ``[s0, 64]``) are not tensors and are skipped: the
    partition specializes them to their values (specialize.py)."""
    args = [n for n in node.all_input_nodes if not is_size(n)]
    for n in ([node] if output else []) + args:
        why = tensor_problem(n, dtypes=dtypes)
        if why and not (scalar_args and n is not node and isinstance(_val(n), torch.Tensor)
                        and _val(n).dim() == 0 and _val(n).dtype in dtypes):
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


# ---- constants ----------------------------------------------------------------------------

#: the dtypes a folded constant may have (those the IR has)
CONSTANT_DTYPES = (*FLOAT_DTYPES, torch.bool, torch.int32, torch.int64)
#: the largest constant folded into a partition
MAX_CONSTANT_BYTES = 1 << 24
#: factories: their value depends on their arguments only
FACTORIES = {aten.arange.default, aten.arange.start, aten.arange.start_step, aten.full.default,
             aten.zeros.default, aten.ones.default, aten.scalar_tensor.default}
#: factories whose one tensor argument gives only a shape and dtype
LIKE_FACTORIES = {aten.full_like.default, aten.zeros_like.default, aten.ones_like.default}


def constant_problem(node) -> str | None:
    """None when ``node`` computes a constant the IR can hold: a factory (``FACTORIES``,
    ``LIKE_FACTORIES``) or a pure, deterministic ATen op whose tensor arguments are all
    constants, with a static shape, a dtype of ``CONSTANT_DTYPES`` and at most
    ``MAX_CONSTANT_BYTES``; else why not. Memoized in ``node.meta``."""
    if not isinstance(node, Node):
        return "not a node"
    if "yirage_constant" not in node.meta:
        why = _constant_problem(node)
        if why is None:
            try:
                node.meta["yirage_constant_value"] = _evaluate(node)
            except Exception as e:  # noqa: BLE001 - then it is simply not folded
                why = f"torch could not evaluate it: {type(e).__name__}: {e}"
        node.meta["yirage_constant"] = why
    return node.meta["yirage_constant"]


def constant_value(node: Node) -> torch.Tensor:
    """The value of a constant node (``constant_problem(node)`` is None), computed by torch once
    when it was first checked and kept in ``node.meta`` (which the partitioner copies along with
    the node, and onto the placeholder of a partition that reads a constant computed in another)."""
    return node.meta["yirage_constant_value"]


def _evaluate(node: Node) -> torch.Tensor:
    """Run the constant ``node``'s op on real values (outside any fake tensor mode)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    v, args = _val(node), node.args
    with unset_fake_temporarily():
        if node.target in LIKE_FACTORIES:  # only the shape and dtype of the input matter
            x = _val(args[0])
            args = (torch.empty(tuple(x.shape), dtype=x.dtype, device=v.device), *args[1:])
        args, kwargs = torch.fx.node.map_arg((args, node.kwargs), constant_value)
        return node.target(*args, **kwargs)


def _constant_problem(node: Node) -> str | None:
    t = node.target
    if node.op != "call_function" or not isinstance(t, torch._ops.OpOverload):
        return "not an ATen op"
    if t._schema.is_mutable or torch.Tag.nondeterministic_seeded in t.tags:
        return "not a pure op"
    v = _val(node)
    if not isinstance(v, torch.Tensor) or v.dtype not in CONSTANT_DTYPES:
        return "not a tensor of an IR dtype"
    if any(not isinstance(d, int) for d in v.shape) or v.numel() * v.element_size() > MAX_CONSTANT_BYTES:
        return "symbolic or too large"
    if t in FACTORIES:
        return None
    args = node.all_input_nodes
    if t in LIKE_FACTORIES:
        return None if all(isinstance(_val(a), torch.Tensor) for a in args) else "no input metadata"
    if not args:
        return "not a known factory"
    for a in args:
        if constant_problem(a) is not None:
            return f"{a.name} is not constant"
    return None


def _read_by_lowered(node: Node) -> bool:
    """Whether a user of the constant ``node`` lowers as an op of its own (not as a constant),
    directly or through other constants."""
    for u in node.users:
        if constant_problem(u) is None:
            if _read_by_lowered(u):
                return True
            continue
        lowering = LOWERINGS.get(u.target)
        if lowering is not None and getattr(lowering.check, "own", lowering.check)(u) is None:
            return True
    return False


def _factory_check(node):
    return constant_problem(node) or "unreachable"  # a constant factory never reaches this


def _never(e, node):
    raise AssertionError(f"{node.name} is not a constant")  # the check declines it first


lowers(*FACTORIES, *LIKE_FACTORIES, check=_factory_check)(_never)


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
    return _all_of(_no_kwargs("alpha"), lambda n: _tensors_ok(n, scalar_args=True))(node)


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
              "reciprocal", "cos", "sin", "floor", "ceil", "trunc"):
    lowers(getattr(aten, _name).default, check=_unary_check)(
        (lambda ir: lambda e, node: getattr(e.g, ir)(e[node.args[0]]))(_name))


def _check_two_tensors(node: Node) -> str | None:
    if not all(isinstance(a, Node) for a in node.args[:2]):
        return "a scalar operand"
    return _all_of(_no_kwargs(), lambda n: _tensors_ok(n, scalar_args=True))(node)


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
    if node.target is aten.hardtanh.default:   # ReLU6 is hardtanh(x, 0, 6)
        lo = node.kwargs.get("min_val", node.args[1] if len(node.args) > 1 else -1.0)
        hi = node.kwargs.get("max_val", node.args[2] if len(node.args) > 2 else 1.0)
    elif node.target is aten.clamp.default:
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
    return _all_of(_no_kwargs("min", "max", "min_val", "max_val"), _tensors_ok)(node)


@lowers(aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default, aten.hardtanh.default,
        check=_check_clamp)
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
    # from any dtype a row program loads (the float types, bool, int32, int64: a mask's int64
    # to bool or float) to one it stores (the float types and bool)
    return _all_of(_no_kwargs("dtype", "layout", "device", "memory_format", "pin_memory"),
                   lambda n: _tensors_ok(n, same_dtype=False, output=False, dtypes=LAYOUT_DTYPES),
                   lambda n: tensor_problem(n, dtypes=ROW_DTYPES))(node)


def _check_narrowing(node):
    """A cast to a half type (float16, bfloat16) from another dtype is lowered only where
    nothing lowered reads it: a fused kernel rounds a value to its dtype only when it stores it
    (transforms/fusion.py treats ``cast`` as the value itself), so ``x.to(bfloat16) * 2`` fused
    would skip the rounding (and float16's overflow to inf) that eager does. Casts to and from
    bool are exact in a fused kernel (``x != 0``; 0 and 1)."""
    src, dst = _val(node.args[0]).dtype, _val(node).dtype
    if (dst != src and dst in (torch.float16, torch.bfloat16) and src != torch.bool
            and any(u.target in LOWERINGS for u in node.users)):
        return (f"a narrowing cast {src} -> {dst} read by lowered ops (a fused kernel would not "
                "round between them)")
    return None


@lowers(aten._to_copy.default, check=_all_of(_check_to_copy, _check_narrowing))
def _to_copy(e, node):
    return e.g.cast(e[node.args[0]], as_dtype(_val(node).dtype))


# ---- views --------------------------------------------------------------------------------

_layout_check = _all_of(_no_kwargs(), lambda n: _tensors_ok(n, dtypes=LAYOUT_DTYPES))


@lowers(aten.view.default, aten._unsafe_view.default, check=_layout_check)
def _reshape(e, node):
    src, shape = e[node.args[0]], tuple(_val(node).shape)
    if tuple(src.shape) == shape != tuple(getattr(_val(node.args[0]), "shape", shape)):
        return src   # a GEMM gave its rows this shape already (_rows_source)
    return e.g.reshape(src, shape)


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


def _norm_problem(node, x, w, b) -> str | None:
    """Why a norm with (output, mean, rstd) outputs (LayerNorm, GroupNorm) is not lowered, or
    None: its statistics are used (only output 0 is lowered), kwargs, a tensor yirage does not
    take, or a weight/bias of another dtype than x's."""
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
    return None


def _check_layer_norm(node):
    x, shape, w, b, eps = node.args[:5]
    if why := _norm_problem(node, x, w, b):
        return why
    if w is not None and tuple(_val(w).shape) != tuple(shape) or b is not None and tuple(_val(b).shape) != tuple(shape):
        return "weight/bias shape differs from normalized_shape"
    return None


@lowers(aten.native_layer_norm.default, check=_check_layer_norm)
def _layer_norm(e, node):
    x, shape, w, b, eps = node.args[:5]
    return (e.g.layer_norm(e[x], tuple(shape), e[w] if w is not None else None,
                           e[b] if b is not None else None, eps),)


def _check_group_norm(node):
    x, w, b, _, _, _, groups = node.args[:7]
    if why := _norm_problem(node, x, w, b):
        return why
    xv = _val(x)
    if xv.dim() < 2 or not isinstance(groups, int) or not isinstance(xv.shape[1], int) or xv.shape[1] % groups:
        return "not [N, C, ...] with a static channel count that the groups divide"
    return None


@lowers(aten.native_group_norm.default, check=_check_group_norm)
def _group_norm(e, node):
    """GroupNorm (PoolFormer's, diffusion U-Nets'): the IR builder's ``group_norm``, a
    ``layer_norm`` over each (sample, group)'s channels and positions with the affine step."""
    x, w, b, _, _, _, groups, eps = node.args[:8]
    return (e.g.group_norm(e[x], groups, e[w] if w is not None else None, e[b] if b is not None else None,
                           eps),)


def _check_getitem(node):
    src, i = node.args
    if not isinstance(src, Node) or src.target not in LOWERINGS or not isinstance(_val(src), (tuple, list)):
        return "getitem of a value that is not a lowered op's outputs"
    if src.target in FIRST_OUTPUT_ONLY and i != 0:
        return f"output {i} of {src.target}"
    return LOWERINGS[src.target].check(src)


#: ops with several outputs of which only output 0 is lowered (their checks decline a node whose
#: other outputs are used); lowering_conv.py adds batch norm and max pooling
FIRST_OUTPUT_ONLY = {aten.native_layer_norm.default, aten.native_group_norm.default}


@lowers(operator.getitem, check=_check_getitem)
def _getitem(e, node):
    return e.env[node.args[0]][node.args[1]]


def _reduce_dims(node):
    """The reduced dims of a sum/mean/amax/amin/var node (None: every dim)."""
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    return [dims] if isinstance(dims, int) else dims


def _check_reduce(node):
    dt = node.kwargs.get("dtype")
    if dt is not None and (_val(node.args[0]) is None or dt != _val(node.args[0]).dtype):
        return f"dtype={dt} (a cast before the reduction is not lowered)"
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


def _norm_args(node):
    """(ord, dims or None, keepdim) of ``linalg_vector_norm(x, ord=2, dim=None, keepdim=False)``."""
    a = list(node.args[1:]) + [None] * (3 - len(node.args[1:]))
    order = node.kwargs.get("ord", a[0] if a[0] is not None else 2)
    dims = node.kwargs.get("dim", a[1])
    keepdim = node.kwargs.get("keepdim", a[2] if a[2] is not None else False)
    return order, ([dims] if isinstance(dims, int) else dims), bool(keepdim)


def _check_vector_norm(node):
    order, dims, _ = _norm_args(node)
    if not _is_scalar(order) or not (order > 0 or order == float("-inf")):
        return f"ord={order!r} (a positive real, inf or -inf is lowered)"
    if node.kwargs.get("dtype") is not None:
        return f"dtype={node.kwargs['dtype']}"
    n = _val(node.args[0]).dim() if isinstance(_val(node.args[0]), torch.Tensor) else 0
    if dims is not None:
        ds = sorted(d % n for d in dims) if n else []
        if not ds or ds != list(range(ds[0], ds[0] + len(ds))):
            return f"dims {dims} are not adjacent"
    return _all_of(_no_kwargs("ord", "dim", "keepdim", "dtype"), _tensors_ok)(node)


@lowers(aten.linalg_vector_norm.default, check=_check_vector_norm)
def _vector_norm(e, node):
    """The vector p-norm over dims: sqrt(sum(x*x)) for p = 2, sum |x| for 1, max / min |x| for
    +-inf, (sum |x|^p)^(1/p) otherwise (torch.linalg.vector_norm's definition)."""
    order, dims, keepdim = _norm_args(node)
    x, g = e[node.args[0]], e.g
    dims = None if dims is None else list(dims)
    if order == 2:
        r = g.sqrt(g.sum(g.mul(x, x), dims, keepdim=True))
    elif order == 1:
        r = g.sum(g.abs(x), dims, keepdim=True)
    elif order in (float("inf"), float("-inf")):
        r = (g.amax if order > 0 else g.amin)(g.abs(x), dims, keepdim=True)
    else:
        r = g.pow(g.sum(g.pow(g.abs(x), float(order)), dims, keepdim=True), 1.0 / float(order))
    out_shape = tuple(_val(node).shape)
    return r if out_shape == tuple(r.shape) else g.reshape(r, out_shape)


def _check_cumsum(node):
    x, v = _val(node.args[0]), _val(node)
    if not isinstance(x, torch.Tensor) or not isinstance(v, torch.Tensor):
        return "no tensor metadata"
    natural = x.dtype if x.dtype.is_floating_point else torch.int64
    if v.dtype != natural:
        return f"dtype={v.dtype} (a {x.dtype} cumsum sums into {natural}; a cast in the op is not lowered)"
    return _all_of(_no_kwargs("dtype"), lambda n: _tensors_ok(n, same_dtype=False, dtypes=LAYOUT_DTYPES))(node)


@lowers(aten.cumsum.default, check=_check_cumsum)
def _cumsum(e, node):
    return e.g.cumsum(e[node.args[0]], node.args[1])


# ---- layout: permute, expand, slice, select, cat (copies) ---------------------------------

@lowers(aten.permute.default, check=_layout_check)
def _permute(e, node):
    return e.g.permute(e[node.args[0]], list(node.args[1]))


def _check_expand(node):
    if node.kwargs.get("implicit", False):
        return "implicit=True"
    return _all_of(_no_kwargs("implicit"), lambda n: _tensors_ok(n, dtypes=LAYOUT_DTYPES))(node)


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
    return _layout_check(node)


@lowers(aten.slice.Tensor, check=_check_slice)
def _slice(e, node):
    args = list(node.args[1:]) + [None] * (4 - len(node.args[1:]))
    dim, start, end, step = (args[0] if args[0] is not None else 0), args[1], args[2], args[3] or 1
    n = _val(node.args[0]).shape[dim]
    end = None if end is not None and end >= n else end   # INT64_MAX: to the end
    return e.g.slice(e[node.args[0]], dim, start, end, step)


@lowers(aten.select.int, check=_layout_check)
def _select(e, node):
    return e.g.select(e[node.args[0]], node.args[1], node.args[2])


def _check_cat(node):
    tensors = node.args[0]
    if not isinstance(tensors, (list, tuple)) or not all(isinstance(t, Node) for t in tensors):
        return "its inputs are not a list of tensors"
    shapes = [tuple(_val(t).shape) for t in tensors if _val(t) is not None]
    if any(len(sh) != len(shapes[0]) for sh in shapes):
        return "inputs of different ranks (legacy empty tensors)"
    return _all_of(_no_kwargs("dim"), lambda n: _tensors_ok(n, dtypes=LAYOUT_DTYPES))(node)


@lowers(aten.cat.default, check=_check_cat)
def _cat(e, node):
    if len(node.args[0]) == 1:   # the value itself (a KV cache's update with an empty past): no copy
        return e[node.args[0][0]]
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
    return e.g.cat([e[t] for t in node.args[0]], dim)


def _check_pad(node):
    pad = node.args[1]
    value = node.kwargs.get("value", node.args[2] if len(node.args) > 2 else 0.0)
    rank = _val(node.args[0]).dim()
    if (not isinstance(pad, (list, tuple)) or len(pad) % 2 or len(pad) > 2 * rank
            or not all(isinstance(p, int) and p >= 0 for p in pad)):
        return f"pad {pad!r} is not pairs of non-negative integers (cropping stays in torch)"
    if not _is_scalar(value):
        return f"pad value {value!r} is not a real scalar"
    return _all_of(_no_kwargs("value"), lambda n: _tensors_ok(n, dtypes=LAYOUT_DTYPES))(node)


@lowers(aten.constant_pad_nd.default, check=_check_pad)
def _constant_pad(e, node):
    """``F.pad(x, pad, value=v)``: torch lists (before, after) pairs from the last dim backwards."""
    x, pad = node.args[:2]
    value = node.kwargs.get("value", node.args[2] if len(node.args) > 2 else 0.0)
    rank = _val(x).dim()
    pairs = [(0, 0)] * rank
    for i in range(len(pad) // 2):
        pairs[rank - 1 - i] = (pad[2 * i], pad[2 * i + 1])
    return e.g.pad(e[x], pairs, float(value))


def _check_sdpa(node):
    args = list(node.args) + [None] * (5 - len(node.args))
    q, k, v, dropout, _causal = args[:5]
    if dropout not in (None, 0, 0.0):
        return f"dropout_p={dropout} (inference has none)"
    mask = node.kwargs.get("attn_mask")
    for u in node.users:
        if u.target is not operator.getitem or u.args[1] != 0:
            return "its logsumexp output is used (only the attention output is lowered)"
    vals = [_val(t) for t in (q, k, v)] + ([_val(mask)] if mask is not None else [])
    if any(not isinstance(t, torch.Tensor) or t.dim() != 4 for t in vals):
        return "q, k, v (and the mask) are not 4-d tensors"
    if any(t.dtype != vals[0].dtype for t in vals):
        return "a mask of another dtype than q (a bool mask)"
    bad = set(node.kwargs) - {"attn_mask", "scale"}
    return f"keyword(s) {sorted(bad)}" if bad else _tensors_ok(node, output=False)


@lowers(aten._scaled_dot_product_flash_attention_for_cpu.default, check=_check_sdpa)
def _sdpa(e, node):
    """``F.scaled_dot_product_attention`` as one op (torch gives CPU graphs this overload; its
    output 1, the logsumexp, is not lowered)."""
    args = list(node.args) + [None] * (5 - len(node.args))
    q, k, v, _dropout, causal = args[:5]
    mask, scale = node.kwargs.get("attn_mask"), node.kwargs.get("scale")
    return (e.g.sdpa(e[q], e[k], e[v], e[mask] if mask is not None else None, bool(causal),
                     None if scale is None else float(scale)),)


FIRST_OUTPUT_ONLY.add(aten._scaled_dot_product_flash_attention_for_cpu.default)


def _check_split(node):
    x, sizes = node.args[:2]
    if not isinstance(sizes, (list, tuple)) or not all(isinstance(n, int) and n > 0 for n in sizes):
        return f"split sizes {sizes!r} are not positive integers"
    for u in node.users:
        if u.target is not operator.getitem:
            return "its output list is used whole"
    return _all_of(_no_kwargs("dim"), lambda n: _tensors_ok(n, output=False, dtypes=LAYOUT_DTYPES))(node)


@lowers(aten.split_with_sizes.default, check=_check_split)
def _split(e, node):
    """Each piece a ``slice`` along dim (a copy, as the other layout ops)."""
    x, sizes = node.args[:2]
    dim = node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else 0)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return tuple(e.g.slice(e[x], dim, a, a + n) for a, n in zip(starts, sizes))


# ---- comparisons, logical ops, where (bool tensors) ---------------------------------------

def _check_compare(node: Node) -> str | None:
    a, b = node.args[:2]
    if not isinstance(a, Node):
        return "no tensor operand"
    if not isinstance(b, Node) and not isinstance(b, (int, float)):
        return f"operand {b!r} is neither a tensor nor a real scalar"
    x = _val(a)
    if isinstance(x, torch.Tensor) and x.dtype == torch.bool and not isinstance(b, (Node, bool)):
        return "a bool tensor compared with a number"
    if isinstance(b, Node) and isinstance(x, torch.Tensor) and _val(b).dtype != x.dtype:
        return f"mixed dtypes ({x.dtype} and {_val(b).dtype}); type promotion is not lowered"
    return _all_of(_no_kwargs(), lambda n: _tensors_ok(n, same_dtype=False, dtypes=ROW_DTYPES, scalar_args=True),
                   lambda n: None if _val(n).dtype == torch.bool else "not a bool result")(node)


def _compare(ir_op: str):
    def emit(e: Emitter, node: Node):
        a, b = node.args[:2]
        return getattr(e.g, ir_op)(e[a], e.operand(b, _val(a).dtype))
    return emit


for _name in ("eq", "ne", "lt", "le", "gt", "ge"):
    _packet = getattr(aten, _name)
    lowers(_packet.Tensor, _packet.Scalar, check=_check_compare)(_compare(_name))


def _bools(node: Node) -> str | None:
    """Every tensor (output, arguments) is bool; 0-d arguments broadcast."""
    if any(not isinstance(a, Node) for a in node.args):
        return "a scalar operand"
    return _all_of(_no_kwargs(), lambda n: _tensors_ok(n, dtypes=(torch.bool,), scalar_args=True))(node)


for _name, _targets in (("logical_and", (aten.logical_and.default, aten.bitwise_and.Tensor)),
                        ("logical_or", (aten.logical_or.default, aten.bitwise_or.Tensor)),
                        ("logical_not", (aten.logical_not.default, aten.bitwise_not.default))):
    lowers(*_targets, check=_bools)(
        (lambda ir: lambda e, node: getattr(e.g, ir)(*(e[a] for a in node.args)))(_name))


def _check_where(node: Node) -> str | None:
    cond, a, b = node.args[:3]
    if not all(isinstance(x, Node) for x in (cond, a, b)):
        return "a scalar operand"
    if _val(cond).dtype != torch.bool:
        return f"the condition is {_val(cond).dtype}, not bool"
    if _val(a).dtype != _val(b).dtype:
        return f"mixed dtypes ({_val(a).dtype} and {_val(b).dtype}); type promotion is not lowered"
    return _all_of(_no_kwargs(), lambda n: _tensors_ok(n, same_dtype=False, dtypes=ROW_DTYPES,
                                                       scalar_args=True))(node)


@lowers(aten.where.self, check=_check_where)
def _where(e, node):
    return e.g.where(*(e[x] for x in node.args[:3]))


def _check_any(node: Node) -> str | None:
    x = node.args[0]
    if _val(x) is None or _val(x).dtype != torch.bool:
        return "not a bool input"
    return _all_of(_no_kwargs(), lambda n: _tensors_ok(n, dtypes=(torch.bool,)))(node)


@lowers(aten.any.dim, check=_check_any)
def _any(e, node):
    """any over one dim: the largest of the 0/1 values, compared with 0."""
    x = e[node.args[0]]
    m = e.g.amax(e.g.cast(x, "float32"), [node.args[1]], keepdim=True)
    r = e.g.ne(m, e.constant(torch.zeros((), dtype=torch.float32)))
    out_shape = tuple(_val(node).shape)
    return r if out_shape == tuple(r.shape) else e.g.reshape(r, out_shape)


# ---- identities and shape-only views --------------------------------------------------------

def _check_identity(node):
    mf = node.kwargs.get("memory_format")
    if mf not in (None, torch.preserve_format, torch.contiguous_format):
        return f"memory_format {mf}"
    return _all_of(_no_kwargs("memory_format"), lambda n: _tensors_ok(n, dtypes=ROW_DTYPES))(node)


@lowers(aten.clone.default, aten.lift_fresh_copy.default, aten.alias.default, check=_check_identity)
def _identity(e, node):
    """A copy is the value itself (IR tensors are values, every one contiguous), except a copy
    of a partition input, which gets a buffer of its own (the partition never returns its
    input as an output: the caller may write to one)."""
    x = node.args[0]
    if x.op == "placeholder":
        return e.g.cast(e[x], as_dtype(_val(x).dtype))
    return e[x]


@lowers(aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
        check=_layout_check)
def _unsqueeze(e, node):
    return e.g.reshape(e[node.args[0]], tuple(_val(node).shape))


# ---- indexing: embedding, index_select, gather, index with constant indices -----------------

def _check_embedding(node):
    table, ids = node.args[:2]
    if not isinstance(ids, Node) or _val(ids) is None or _val(ids).dtype != torch.int64:
        return "ids are not an int64 tensor"
    if _val(table).dim() != 2:
        return "the table is not 2-d"
    if node.args[3:] and any(node.args[3:]):
        return "scale_grad_by_freq/sparse"   # training-only flags; padding_idx changes no forward value
    return _all_of(_no_kwargs(), lambda n: _tensors_ok(n, same_dtype=False, dtypes=(*FLOAT_DTYPES, torch.int64)),
                   lambda n: tensor_problem(table) or tensor_problem(ids, dtypes=(torch.int64,)))(node)


@lowers(aten.embedding.default, check=_check_embedding)
def _embedding(e, node):
    table, ids = node.args[:2]
    return e.g.embedding(e[ids], e[table])


def _check_indexed(node):
    x, dim, index = node.args[:3]
    if not isinstance(index, Node) or _val(index) is None or _val(index).dtype != torch.int64:
        return "the index is not an int64 tensor"
    if node.kwargs.get("sparse_grad"):
        return "sparse_grad=True"
    if _val(index).dim() == 0 or _val(x).dim() == 0:
        return "a 0-d index or input"
    return _all_of(_no_kwargs("sparse_grad"), lambda n: _tensors_ok(n, same_dtype=False, dtypes=LAYOUT_DTYPES),
                   lambda n: None if _val(n).dtype == _val(x).dtype else "a different output dtype")(node)


@lowers(aten.index_select.default, aten.gather.default, check=_check_indexed)
def _index_select_gather(e, node):
    x, dim, index = node.args[:3]
    op = "gather" if node.target is aten.gather.default else "index_select"
    return getattr(e.g, op)(e[x], dim, e[index])


def _check_index(node):
    x, indices = node.args[:2]
    for i in indices:
        if i is not None and constant_problem(i) is not None:
            return f"index {i} is not a constant ({constant_problem(i)}); run-time indices of aten.index are not lowered"
    return _all_of(_no_kwargs(), lambda n: _tensors_ok(n, same_dtype=False, dtypes=LAYOUT_DTYPES),
                   lambda n: None if _val(n).dtype == _val(x).dtype else "a different output dtype")(node)


@lowers(aten.index.Tensor, check=_check_index)
def _index(e, node):
    """x[indices] with constant indices: the flat positions it reads, computed once by torch,
    as an index_select of the flattened x."""
    x, indices = node.args[:2]
    xv = _val(x)
    positions = torch.arange(xv.numel()).view(tuple(xv.shape))
    flat = aten.index.Tensor(positions, [None if i is None else e.value(i) for i in indices]).reshape(-1)
    n = xv.numel()
    picked = e.g.index_select(e.g.reshape(e[x], (n,)), 0, e.constant(flat))
    return e.g.reshape(picked, tuple(_val(node).shape))


# ---- matmuls ------------------------------------------------------------------------------

def _ranks(*ranks):
    def check(node):
        got = [_val(a).dim() for a in node.args[-len(ranks):]]
        return None if got == list(ranks) else f"operand ranks {got}, expected {list(ranks)}"
    return check


_VIEWS = (aten.view.default, aten._unsafe_view.default)


def _rows_source(x, node):
    """``y`` when the GEMM ``node`` multiplies ``x = view(y, [rows, K])`` of an N-d ``y`` and its
    only user views the [rows, N] result back to ``y``'s leading dims (what the decompositions
    make of ``nn.Linear`` or GPT-2's Conv1D on [batch, seq, K]), else None. The GEMM then runs
    on ``y`` and gives the N-d result itself, which ``_reshape`` passes on: no reshape step stands
    between it and the row kernel after it, which the backend fuses into the GEMM's epilogue.
    Static dims only (no guards)."""
    if not (isinstance(x, Node) and x.target in _VIEWS and isinstance(x.args[0], Node)):
        return None
    y, users = x.args[0], list(node.users)
    yv, xv, ov = _val(y), _val(x), _val(node)
    if (len(users) != 1 or users[0].target not in _VIEWS
            or not all(isinstance(v, torch.Tensor) for v in (yv, xv, ov, _val(users[0])))
            or yv.dim() < 3 or xv.dim() != 2 or ov.dim() != 2):
        return None
    dims = (*yv.shape, *xv.shape, *ov.shape, *_val(users[0]).shape)
    if not all(isinstance(d, int) for d in dims):
        return None
    if yv.shape[-1] != xv.shape[-1] or tuple(_val(users[0]).shape) != (*yv.shape[:-1], ov.shape[-1]):
        return None
    return y


def _gemm(e, x, w, bias=None, layout: str = "nk", node=None) -> DTensor:
    """A ``linear``; float32 ones compute in ``e.gemm_dtype`` (the ``dtype`` option) when set.
    ``node``: the GEMM's FX node, to run it on the N-d rows of ``x`` (``_rows_source``)."""
    compute = e.gemm_dtype if (e.gemm_dtype and _val(x).dtype == torch.float32
                               and _val(w).dtype == torch.float32) else None
    rows = _rows_source(x, node) if node is not None else None
    return e.g.linear(e[x if rows is None else rows], e[w], e[bias] if bias is not None else None,
                      compute_dtype=compute, weight_layout=layout)


@lowers(aten.mm.default, check=_all_of(_no_kwargs(), _tensors_ok, _ranks(2, 2)))
def _mm(e, node):
    """x @ w as a ``linear`` with a [K, N] weight (``weight_layout='kn'``): the backend's GEMM
    providers, prepacked when w is a frozen weight (GPT-2's Conv1D)."""
    return _gemm(e, node.args[0], node.args[1], layout="kn", node=node)


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
    """bias + a @ b: a ``linear`` with a [K, N] weight when the bias is one row of N (as
    ``_mm``), else a matmul and a broadcast add."""
    bias, a, b = node.args[:3]
    bv, av = _val(bias), _val(a)
    if bv.dim() == 1 and bv.dtype == av.dtype:
        return _gemm(e, a, b, bias, layout="kn", node=node)
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
    return _gemm(e, x, w, node.args[2] if len(node.args) > 2 else None, node=node)


def _never(target) -> bool:
    return False


def rewrite_linear(gm: GraphModule, in_torch: Callable[[object], bool] = _never) -> int:
    """Turn ``addmm(bias, x, permute(w, [1, 0]))`` and ``mm(x, permute(w, [1, 0]))`` (what
    the decompositions make of ``nn.Linear``) into ``aten.linear(x, w[, bias])`` with a 1-d
    bias, in place; a permute left without users is erased. ``in_torch(target)``: the ops the
    user keeps in torch (``torch_executed_ops``), which no rewrite folds away. Returns the
    number rewritten."""
    if in_torch(aten.permute.default):
        return 0
    count = 0
    for node in list(gm.graph.nodes):
        is_addmm = node.target is aten.addmm.default and not node.kwargs
        if not (is_addmm or node.target is aten.mm.default) or in_torch(node.target):
            continue
        bias, x, wt = (node.args[:3] if is_addmm else (None, *node.args[:2]))
        if not (isinstance(wt, Node) and wt.target is aten.permute.default and list(wt.args[1]) == [1, 0]):
            continue
        if bias is not None and not (isinstance(_val(bias), torch.Tensor) and _val(bias).dim() == 1):
            continue
        _replace_node(gm, node, aten.linear.default, (x, wt.args[0]) + ((bias,) if bias is not None else ()))
        count += 1
    return _recompiled(gm, count)


def _replace_node(gm: GraphModule, node: Node, target, args: tuple) -> Node:
    """Put ``target(*args)`` (with ``node``'s meta) in the place of ``node``, then erase
    ``node`` and the nodes that fed it, other than ``args``, that are left without users (the
    rest of the pattern it ended). Returns the new node."""
    with gm.graph.inserting_before(node):
        new = gm.graph.call_function(target, args)
    new.meta = dict(node.meta)
    node.replace_all_uses_with(new)
    dead = [node]
    while dead:
        n = dead.pop()
        if n.users or n.op != "call_function" or n in args:
            continue
        dead.extend(n.all_input_nodes)
        gm.graph.erase_node(n)
    return new


def _recompiled(gm: GraphModule, count: int) -> int:
    """``count``, after checking and recompiling ``gm`` when a rewrite changed it."""
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


# ---- RoPE: transformers' apply_rotary_pos_emb as one op -------------------------------------

@torch.library.custom_op("yirage::rotary_emb", mutates_args=())
def rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` (``ir.ops.rotary_emb_reference``): the torch op
    ``rewrite_rotary_emb`` puts in a graph, which runs as this where it is not lowered."""
    from ..ir.ops import rotary_emb_reference
    return rotary_emb_reference(x, cos, sin)


@rotary_emb.register_fake
def _rotary_emb_fake(x, cos, sin):
    return torch.empty_like(x)


@lowers(torch.ops.yirage.rotary_emb.default, check=_all_of(_no_kwargs(), _tensors_ok))
def _rotary_emb(e, node):
    return e.g.rotary_emb(*(e[a] for a in node.args))


def _same_shape(a, b) -> bool:
    """Equal shapes, symbolic dims compared by expression (no guard)."""
    return a.dim() == b.dim() and all(str(x) == str(y) for x, y in zip(a.shape, b.shape))


def _rotary_parts(node: Node) -> tuple[Node, Node, Node] | None:
    """(x, cos, sin) when ``node`` is ``x * cos + cat([-x[..., D/2:], x[..., :D/2]], -1) * sin``
    (transformers' ``apply_rotary_pos_emb`` after decomposition) over a float x of 1 to 4 dims
    with a static even last dim D, cos and sin of x's dtype with last dim D broadcasting to x's
    shape; else None."""
    if node.target is not aten.add.Tensor or node.kwargs or len(node.args) != 2:
        return None
    out = _val(node)
    if not isinstance(out, torch.Tensor) or not 1 <= out.dim() <= 4 or out.dtype not in FLOAT_DTYPES:
        return None
    D = out.shape[-1]
    if not isinstance(D, int) or D % 2:
        return None

    def mul_operands(n):
        ok = isinstance(n, Node) and n.target is aten.mul.Tensor and not n.kwargs and len(n.args) == 2
        return list(n.args) if ok and all(isinstance(a, Node) for a in n.args) else None

    def last_dim(d, rank) -> bool:
        return isinstance(d, int) and d % rank == rank - 1

    def rotated(n) -> Node | None:   # x when n is cat([neg(x[..., D/2:]), x[..., :D/2]], -1)
        if not (isinstance(n, Node) and n.target is aten.cat.default and len(n.args[0]) == 2
                and last_dim(n.args[1] if len(n.args) > 1 else 0, out.dim())):
            return None
        neg, lo = n.args[0]
        if not (isinstance(neg, Node) and neg.target is aten.neg.default):
            return None
        hi = neg.args[0]
        bounds = []
        for sl in (hi, lo):
            if not (isinstance(sl, Node) and sl.target is aten.slice.Tensor and len(sl.args) >= 4
                    and last_dim(sl.args[1], out.dim()) and (len(sl.args) < 5 or sl.args[4] == 1)):
                return None
            bounds.append((sl.args[2], sl.args[3]))
        if hi.args[0] is not lo.args[0] or bounds[0][0] != D // 2 or not (
                isinstance(bounds[0][1], int) and bounds[0][1] >= D) or bounds[1] != (0, D // 2):
            return None
        return hi.args[0]

    for first, second in ((node.args[0], node.args[1]), (node.args[1], node.args[0])):
        plain, rot = mul_operands(first), mul_operands(second)
        if plain is None or rot is None:
            continue
        for cat, sin in ((rot[0], rot[1]), (rot[1], rot[0])):
            x = rotated(cat)
            if x is None or x not in plain:
                continue
            cos = plain[1] if plain[0] is x else plain[0]
            xv, cv, sv = _val(x), _val(cos), _val(sin)
            if (isinstance(xv, torch.Tensor) and _same_shape(xv, out) and _same_shape(_val(first), out)
                    and _same_shape(_val(second), out)
                    and all(isinstance(t, torch.Tensor) and t.dtype == out.dtype and xv.dtype == out.dtype
                            and 1 <= t.dim() <= out.dim() and str(t.shape[-1]) == str(D) for t in (cv, sv))):
                return x, cos, sin
    return None


def rewrite_rotary_emb(gm: GraphModule, in_torch: Callable[[object], bool] = _never) -> int:
    """Turn each rotate-half RoPE (``_rotary_parts``: two multiplies, two slices, a negation, a
    cat and an add, which the fused row kernels cannot express as one and which cost copies)
    into one ``yirage::rotary_emb(x, cos, sin)``, lowered to the IR's ``rotary_emb``, in place;
    the nodes it leaves without users are erased. Nothing is rewritten when the user keeps one
    of those ops in torch (``in_torch``, as ``rewrite_linear``). Returns the number rewritten."""
    if any(map(in_torch, (aten.add.Tensor, aten.mul.Tensor, aten.slice.Tensor, aten.neg.default,
                          aten.cat.default))):
        return 0
    count = 0
    for node in list(gm.graph.nodes):
        parts = _rotary_parts(node)
        if parts is None:
            continue
        _replace_node(gm, node, torch.ops.yirage.rotary_emb.default, parts)
        count += 1
    return _recompiled(gm, count)


# ---- tanh GELU written out: transformers' NewGELU / FastGELU as one gelu --------------------

#: the elementwise ATen ops a written-out tanh GELU is made of (x and Python scalars only)
_GELU_PARTS = {aten.mul.Tensor, aten.add.Tensor, aten.sub.Tensor, aten.div.Tensor, aten.pow.Tensor_Scalar,
               aten.tanh.default, aten.neg.default}
#: the most nodes such a GELU may take (NewGELU: 8 after decomposition)
_GELU_MAX_NODES = 12
#: probe points (float64) at which a candidate must equal F.gelu(x, approximate="tanh")
_GELU_PROBE = torch.linspace(-8.0, 8.0, 97, dtype=torch.float64)


def _written_out_gelu_tanh(node: Node) -> Node | None:
    """x when ``node`` ends an elementwise expression of one float tensor x and Python scalars,
    built of ``_GELU_PARTS`` with a tanh among them, that equals ``0.5 x (1 + tanh(sqrt(2/pi)
    (x + 0.044715 x^3)))`` (Hendrycks & Gimpel, 2016; transformers' ``NewGELUActivation``,
    ``FastGELUActivation`` and the like, which decompose into 8-10 ATen ops); else None.

    The expression is recognised by what it computes, not by its op order: its nodes are
    evaluated in float64 at ``_GELU_PROBE`` and must match torch's tanh GELU to 1e-12."""
    if node.target is not aten.mul.Tensor or node.kwargs:
        return None
    out = _val(node)
    if not isinstance(out, torch.Tensor) or out.dtype not in FLOAT_DTYPES:
        return None
    inner, leaves, stack = [], set(), [node]
    while stack:
        n = stack.pop()
        if n in inner:
            continue
        if (isinstance(n, Node) and n.op == "call_function" and n.target in _GELU_PARTS and not n.kwargs
                and len(inner) < _GELU_MAX_NODES):
            inner.append(n)
            stack.extend(a for a in n.args if isinstance(a, Node))
            if not all(isinstance(a, (Node, int, float)) and not isinstance(a, bool) for a in n.args):
                return None
        else:
            leaves.add(n)
    if len(leaves) != 1 or not any(n.target is aten.tanh.default for n in inner):
        return None
    (x,) = leaves
    xv = _val(x)
    if not (isinstance(x, Node) and isinstance(xv, torch.Tensor) and xv.dtype == out.dtype
            and _same_shape(xv, out) and all(_same_shape(_val(n), out) for n in inner)):
        return None
    values = {x: _GELU_PROBE}

    def value(n: Node):   # n's probe values, its arguments' first (the expression is a DAG)
        if n not in values:
            values[n] = n.target(*(value(a) if isinstance(a, Node) else a for a in n.args))
        return values[n]
    with unset_fake_temporarily():   # a backend compiles under dynamo's fake mode: probe with real tensors
        want = torch.nn.functional.gelu(_GELU_PROBE, approximate="tanh")
        return x if torch.allclose(value(node), want, rtol=1e-12, atol=1e-12) else None


def rewrite_gelu_tanh(gm: GraphModule, in_torch: Callable[[object], bool] = _never) -> int:
    """Turn each written-out tanh GELU (``_written_out_gelu_tanh``) into one
    ``aten.gelu(x, approximate="tanh")``, in place; the nodes it leaves without users are
    erased. Its 8 ops would be 8 steps of a fused row kernel (a cube, a tanh, an add ...);
    the one op is the fused kernels' ``gelu_tanh`` (x * sigmoid(2u), one exponential).
    Nothing is rewritten when the user keeps gelu or one of the parts in torch (``in_torch``).
    Returns the number rewritten."""
    if any(map(in_torch, (aten.gelu.default, *_GELU_PARTS))):
        return 0
    found = [(node, x) for node in gm.graph.nodes if (x := _written_out_gelu_tanh(node)) is not None]
    count = 0
    for node, x in found:
        if node not in set(gm.graph.nodes):   # erased with an earlier one's expression
            continue
        new = _replace_node(gm, node, aten.gelu.default, (x,))
        new.kwargs = {"approximate": "tanh"}
        count += 1
    return _recompiled(gm, count)


def _legacy_empty(t) -> bool:
    v = _val(t) if isinstance(t, Node) else None
    return (isinstance(v, torch.Tensor) and v.dim() == 1 and isinstance(v.shape[0], int)
            and v.shape[0] == 0)


def drop_legacy_empty_cat_inputs(gm: GraphModule) -> int:
    """Remove from each ``aten.cat`` the inputs torch.cat skips: 1-d tensors of 0 elements
    (the "legacy empty" tensors, e.g. a KV cache's empty past concatenated with the new keys),
    in place; an input left without users (``lift_fresh_copy`` of the empty constant) is erased.
    A cat left with one input lowers to that input (``_cat``). Returns the number of inputs removed."""
    count = 0
    for node in list(gm.graph.nodes):
        if node.target is not aten.cat.default or not isinstance(node.args[0], (list, tuple)):
            continue
        tensors = list(node.args[0])
        keep = [t for t in tensors if not _legacy_empty(t)]
        if len(keep) == len(tensors) or not keep:
            continue
        node.args = (keep, *node.args[1:])
        count += len(tensors) - len(keep)
        for t in tensors:
            if t not in keep and not t.users and t.op == "call_function":
                gm.graph.erase_node(t)
    return _recompiled(gm, count)


# the conv-net ops (convolution, batch norm, pooling) register themselves
from . import lowering_conv as _lowering_conv  # noqa: E402,F401
