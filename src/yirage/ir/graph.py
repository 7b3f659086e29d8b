"""The kernel-graph builder: a Mirage-compatible front end that records typed ops.

    g = yr.new_kernel_graph()
    X = g.new_input(dims=(8, 4096), dtype=yr.float32)
    W = g.new_input(dims=(4096, 4096), dtype=yr.float32)
    O = g.silu(g.matmul(g.rms_norm(X, normalized_shape=(4096,)), W))
    g.mark_output(O)

Shapes and dtypes are inferred and checked when an op is added, and so are the builder's
arguments: ``GraphError`` (a ``ValueError``) naming the op and the rule broken. Dims, dims
of shapes and ``dim``/``start``/``end`` arguments are integers: Python ints and numpy/torch
integer scalars; floats (even integral ones such as ``8.0``) and bools are rejected, never
truncated. Number attributes (clamp bounds, scale factor, eps, attention scale) are real
numbers, never NaN; see each method for its rule. Op inputs are DTensors of the same graph.

Semantics follow Mirage (python/mirage/kernel.py): ``matmul`` multiplies the last two dims
and batches over the leading ones, ``reduction(x, dim)`` sums over ``dim`` keeping it with
size 1, binary ops broadcast like torch.

This module is the IR: it must never generate code, run kernels or know a backend.
``interpret`` runs the reference interpreter; compiling and calling a graph is the front
end's (yirage/kernel.py ``KNGraph``), JSON is ir/serialize.py's.
"""
from __future__ import annotations

import math
import numbers
import operator
from dataclasses import dataclass, field
from collections.abc import Iterable, Mapping, Set
from typing import Sequence

import torch

from ..dtypes import DType, as_dtype
from ..errors import GraphError
from .interpret import interpret
from .ops import OPS, TensorType


# ---- argument checks of the builder (shape rules live in ops.py) ----------------------------

def _as_int(value) -> int | None:
    """``value`` as a Python int if it is an int or a numpy/torch integer scalar, else None
    (bools and floats, even integral ones such as 8.0, are not integers here)."""
    if isinstance(value, (bool, float)) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _describe(value) -> str:
    hint = f"; use int({value!r}) if that is what you mean" if isinstance(value, float) and value.is_integer() else ""
    return f"{value!r} ({type(value).__name__}){hint}"


def _int(op: str, what: str, value) -> int:
    """``value`` as a Python int; GraphError naming ``op`` and ``what`` if it is not an integer."""
    n = _as_int(value)
    if n is None:
        raise GraphError(f"{op}: {what} must be an integer, got {_describe(value)}")
    return n


def _pair(op: str, what: str, value, low: int = 1) -> tuple[int, int]:
    """An integer or a pair of integers (>= ``low``) as a pair; GraphError otherwise."""
    pair = (value, value) if _as_int(value) is not None else value
    if isinstance(pair, (str, bytes, Mapping, Set)) or not isinstance(pair, Iterable):
        raise GraphError(f"{op}: {what} must be an integer or a pair of integers, got {_describe(value)}")
    pair = tuple(pair)
    if len(pair) != 2 or any(_as_int(v) is None or _as_int(v) < low for v in pair):
        raise GraphError(f"{op}: {what} must be an integer or a pair of integers >= {low}, got {value!r}")
    return (_as_int(pair[0]), _as_int(pair[1]))


def _shape(op: str, what: str, value) -> tuple[int, ...]:
    """A shape: a sequence of positive integers (a lone integer means a 1-d shape)."""
    if _as_int(value) is not None:
        value = (value,)
    if isinstance(value, (str, bytes, Mapping, Set)) or not isinstance(value, Iterable):
        raise GraphError(f"{op}: {what} must be a tuple of positive integers, got {_describe(value)}")
    value = tuple(value)
    dims = []
    for i, d in enumerate(value):
        n = _as_int(d)
        if n is None or n <= 0:
            raise GraphError(f"{op}: {what} must be positive integers, got {value!r}: dim {i} is "
                             + (f"{n}" if n is not None else _describe(d)))
        dims.append(n)
    return tuple(dims)


def _real(op: str, what: str, value, finite: bool = True) -> float:
    """``value`` as a float: a real number (bools rejected), never NaN; when ``finite``, not
    +-inf either."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.dtype != torch.bool:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise GraphError(f"{op}: {what} must be a real number, got {value!r} ({type(value).__name__})")
    try:
        x = float(value)
    except OverflowError:
        x = math.inf if value > 0 else -math.inf
    if math.isnan(x):
        raise GraphError(f"{op}: {what} must not be NaN")
    if finite and math.isinf(x):
        raise GraphError(f"{op}: {what} must be finite, got {value!r}")
    return x


def _dtype(op: str, value) -> DType:
    try:
        return as_dtype(value)
    except (ValueError, TypeError, KeyError) as e:
        raise GraphError(f"{op}: {e}") from None


@dataclass(eq=False)
class DTensor:
    """A tensor of a kernel graph (a value, not data). ``dims``/``shape`` and ``dtype`` are static."""

    graph: "KernelGraph"
    id: int
    type: TensorType
    name: str | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.type.shape

    dims = shape

    @property
    def dtype(self) -> DType:
        return self.type.dtype

    def __repr__(self) -> str:
        return f"DTensor(t{self.id}, shape={self.shape}, dtype={self.dtype.value})"


@dataclass
class OpNode:
    """One op: ``op`` names an entry of ``ir.ops.OPS``; inputs/output are tensor ids."""

    op: str
    inputs: list[int]
    attrs: dict = field(default_factory=dict)
    output: int = -1


class KernelGraph:
    """A DAG of ops over typed tensors, built in topological order.

    Args:
        backend: name of the backend the graph runs on when called (None: the default
            backend, see ``yr.set_backend``).
    """

    def __init__(self, backend: str | None = None):
        self.backend = backend
        self.tensors: list[TensorType] = []
        self.names: dict[int, str] = {}
        self.ops: list[OpNode] = []
        self.inputs: list[int] = []
        self.outputs: list[int] = []
        self._compiled = {}  # derived state of front ends (compiled plans); cleared on any edit

    def blank_like(self) -> "KernelGraph":
        """A new, empty graph of this graph's class and backend that carries the front-end
        settings set on this one (attributes such as ``runtime_row_width``): what a graph pass
        (transforms/) builds its result into."""
        g = type(self)(self.backend)
        for k, v in vars(self).items():
            if k not in vars(g):
                setattr(g, k, v)
        return g

    # ---- building -------------------------------------------------------------------------
    def _new_tensor(self, ttype: TensorType, name: str | None = None) -> DTensor:
        self.tensors.append(ttype)
        tid = len(self.tensors) - 1
        if name:
            self.names[tid] = name
        self._compiled.clear()
        return DTensor(self, tid, ttype, name)

    def new_input(self, dims: Sequence[int], dtype=DType.float32, name: str | None = None) -> DTensor:
        """Declare a graph input of logical shape ``dims``.

        For block-quantized dtypes (``yr.q4_1``, ``yr.q8_0``) the tensor passed at run time
        is the raw ``uint8`` storage of shape ``dtype.storage_shape(dims)``.

        Raises GraphError: a dim is not a positive integer (floats such as ``2.7`` or ``8.0``
        and bools are rejected, not truncated), an unknown dtype, or a quantized dtype whose
        last dim is not a multiple of its block size.
        """
        dims = _shape("new_input", "dims", dims)
        dtype = _dtype("new_input", dtype)
        try:
            dtype.storage_shape(dims)  # validates block alignment
        except ValueError as e:
            raise GraphError(f"new_input: {e}") from None
        if name is not None and not isinstance(name, str):
            raise GraphError(f"new_input: name must be a string or None, got {name!r}")
        t = self._new_tensor(TensorType(dims, dtype), name)
        self.inputs.append(t.id)
        return t

    def _check_tensors(self, op: str, inputs: Sequence) -> None:
        """GraphError unless every input is a DTensor of this graph."""
        for i, x in enumerate(inputs):
            if not isinstance(x, DTensor):
                if isinstance(x, torch.Tensor):
                    got = f"a torch.Tensor of shape {tuple(x.shape)} (data goes in at call time: g(inputs=[...]))"
                elif hasattr(x, "shape"):
                    got = f"{type(x).__name__} of shape {tuple(x.shape)}"
                else:
                    got = f"{type(x).__name__} {' '.join(repr(x).split()):.60}"
                raise GraphError(f"{op}: input {i} must be a tensor of this graph (a DTensor from its "
                                 f"new_input or an op), got {got}")
            if x.graph is not self:
                raise GraphError(f"{op}: input {i} ({x!r}) belongs to another graph: build every op "
                                 "of a graph from tensors of that same graph")

    def _add(self, op: str, inputs: Sequence[DTensor], **attrs) -> DTensor:
        self._check_tensors(op, inputs)
        if OPS[op].arity >= 0 and len(inputs) != OPS[op].arity:
            raise GraphError(f"{op}: takes {OPS[op].arity} inputs, got {len(inputs)}")
        ttype = OPS[op].infer([x.type for x in inputs], attrs)
        out = self._new_tensor(ttype)
        self.ops.append(OpNode(op, [x.id for x in inputs], attrs, out.id))
        return out

    def mark_output(self, t: DTensor) -> None:
        """Make ``t`` an output: ``g(inputs)`` returns outputs in the order they were marked."""
        self._check_tensors("mark_output", [t])
        self.outputs.append(t.id)
        self._compiled.clear()

    # elementwise
    def add(self, a, b): return self._add("add", [a, b])
    def sub(self, a, b): return self._add("sub", [a, b])
    def mul(self, a, b): return self._add("mul", [a, b])
    def div(self, a, b): return self._add("div", [a, b])
    def exp(self, x): return self._add("exp", [x])
    def sqrt(self, x): return self._add("sqrt", [x])
    def rsqrt(self, x): return self._add("rsqrt", [x])
    def square(self, x): return self._add("square", [x])
    def neg(self, x): return self._add("neg", [x])
    def silu(self, x): return self._add("silu", [x])
    def relu(self, x): return self._add("relu", [x])

    def tanh(self, x):
        """Elementwise ``torch.tanh`` of a float tensor (same shape and dtype; computed in float32)."""
        return self._add("tanh", [x])

    def sigmoid(self, x):
        """Elementwise ``torch.sigmoid``: ``1 / (1 + exp(-x))`` (float; computed in float32)."""
        return self._add("sigmoid", [x])

    def erf(self, x):
        """Elementwise ``torch.erf`` (float; computed in float32, absolute error <= 5e-7 on the CPU)."""
        return self._add("erf", [x])

    def log(self, x):
        """Elementwise natural logarithm ``torch.log`` (float; -inf at 0, NaN below)."""
        return self._add("log", [x])

    def exp2(self, x):
        """Elementwise ``2 ** x`` (``torch.exp2``; float)."""
        return self._add("exp2", [x])

    def abs(self, x):
        """Elementwise ``|x|`` (``torch.abs``; float)."""
        return self._add("abs", [x])

    def reciprocal(self, x):
        """Elementwise ``1 / x`` (``torch.reciprocal``; float; inf at 0)."""
        return self._add("reciprocal", [x])

    def floor(self, x):
        """Elementwise ``torch.floor`` (float; -inf, inf and NaN unchanged)."""
        return self._add("floor", [x])

    def ceil(self, x):
        """Elementwise ``torch.ceil`` (float; -inf, inf and NaN unchanged)."""
        return self._add("ceil", [x])

    def trunc(self, x):
        """Elementwise ``torch.trunc``: rounded toward zero (float; -inf, inf and NaN unchanged)."""
        return self._add("trunc", [x])

    def cos(self, x):
        """Elementwise ``torch.cos`` (radians; float; computed in float32): RoPE tables."""
        return self._add("cos", [x])

    def sin(self, x):
        """Elementwise ``torch.sin`` (radians; float; computed in float32): RoPE tables."""
        return self._add("sin", [x])

    def maximum(self, a, b):
        """Elementwise ``torch.maximum(a, b)`` with broadcasting: one float dtype; NaN if either is NaN."""
        return self._add("maximum", [a, b])

    def minimum(self, a, b):
        """Elementwise ``torch.minimum(a, b)`` with broadcasting: one float dtype; NaN if either is NaN."""
        return self._add("minimum", [a, b])

    def pow(self, x, exponent):
        """``torch.pow(x, exponent)``: ``exponent`` a tensor of x's float dtype (broadcast, op ``pow``)
        or a real number (op ``pow_scalar``, attr ``exponent``; +-inf allowed, NaN rejected). A
        negative base gives a real result only for an integer exponent (NaN otherwise), as in
        torch. GraphError for non-float inputs, mismatched dtypes or shapes that do not broadcast."""
        if isinstance(exponent, DTensor):
            return self._add("pow", [x, exponent])
        return self._add("pow_scalar", [x], exponent=_real("pow", "exponent", exponent, finite=False))

    # comparisons and logical ops: bool outputs (yr.bool, torch.bool storage)
    def _compare(self, op: str, a, b):
        """``op`` (a name of ``ir.ops.COMPARE``) of two tensors of one float or bool dtype,
        broadcast; a bool tensor. GraphError for other dtypes or shapes that do not broadcast."""
        return self._add(op, [a, b])

    def eq(self, a, b):
        """Elementwise ``a == b`` (``torch.eq``): one float (or bool) dtype, broadcast; bool out."""
        return self._compare("eq", a, b)

    def ne(self, a, b):
        """Elementwise ``a != b`` (``torch.ne``; true where either is NaN); bool out."""
        return self._compare("ne", a, b)

    def lt(self, a, b):
        """Elementwise ``a < b`` (``torch.lt``): one float (or bool) dtype, broadcast; bool out."""
        return self._compare("lt", a, b)

    def le(self, a, b):
        """Elementwise ``a <= b`` (``torch.le``); bool out."""
        return self._compare("le", a, b)

    def gt(self, a, b):
        """Elementwise ``a > b`` (``torch.gt``); bool out."""
        return self._compare("gt", a, b)

    def ge(self, a, b):
        """Elementwise ``a >= b`` (``torch.ge``); bool out."""
        return self._compare("ge", a, b)

    def logical_and(self, a, b):
        """Elementwise ``a & b`` of two bool tensors, broadcast (``torch.logical_and``); GraphError
        for a non-bool input."""
        return self._add("logical_and", [a, b])

    def logical_or(self, a, b):
        """Elementwise ``a | b`` of two bool tensors, broadcast (``torch.logical_or``)."""
        return self._add("logical_or", [a, b])

    def logical_not(self, x):
        """Elementwise ``~x`` of a bool tensor (``torch.logical_not``)."""
        return self._add("logical_not", [x])

    def where(self, cond, a, b):
        """``torch.where(cond, a, b)``: ``a`` where the bool ``cond`` is true, else ``b``; the three
        broadcast together; ``a`` and ``b`` share one float (or bool) dtype, which the output has.
        GraphError for a non-bool condition, mismatched branch dtypes or shapes that do not broadcast."""
        return self._add("where", [cond, a, b])

    def gelu(self, x, approximate: str = "none"):
        """GELU (Hendrycks & Gimpel 2016), as torch's ``F.gelu(x, approximate=...)``:
        ``"none"`` is the exact erf form ``0.5 x (1 + erf(x / sqrt(2)))`` (op ``gelu``),
        ``"tanh"`` the tanh approximation (op ``gelu_tanh``, see ``gelu_tanh``). GraphError
        for any other ``approximate``."""
        if approximate == "tanh":
            return self.gelu_tanh(x)
        if approximate != "none":
            raise GraphError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
        return self._add("gelu", [x])

    def gelu_tanh(self, x):
        """GELU, tanh approximation: ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``, torch's
        ``F.gelu(x, approximate="tanh")`` (transformers' ``gelu_pytorch_tanh``: Gemma's gated
        MLP). Elementwise: it fuses like ``silu``."""
        return self._add("gelu_tanh", [x])

    def clamp(self, x, min_val: float, max_val: float):
        """Elementwise ``min(max(x, min_val), max_val)``.

        The bounds are real numbers, +-inf allowed (a one-sided clamp); GraphError when
        either is NaN or ``min_val > max_val``."""
        lo = _real("clamp", "min_val", min_val, finite=False)
        hi = _real("clamp", "max_val", max_val, finite=False)
        if lo > hi:
            raise GraphError(f"clamp: min_val {min_val} is greater than max_val {max_val}")
        return self._add("clamp", [x], min_val=lo, max_val=hi)

    def cast(self, x, dtype):
        """Elementwise conversion to a floating-point dtype or bool (yr.float32/float16/bfloat16/
        bool) from those or from int32/int64 (to half types rounding to nearest even, like
        torch's ``Tensor.to``; to bool ``x != 0``; from bool 0 or 1; from an integer the nearest
        float32, as torch rounds it, then that). GraphError for another source or target dtype."""
        dtype = _dtype("cast", dtype)
        if not (dtype.is_float or dtype == DType.bool):
            raise GraphError(f"cast: target dtype must be floating point or bool, got {dtype.value}")
        return self._add("cast", [x], dtype=dtype.value)

    def scale(self, x, factor: float):
        """Elementwise ``x * factor`` for a finite real number ``factor``.

        GraphError when ``factor`` is NaN or +-inf (torch would allow inf, but it only makes
        inf/NaN outputs, so yirage treats it as a mistake)."""
        return self._add("scale", [x], factor=_real("scale", "factor", factor))

    # reductions and normalizations
    def reduction(self, x, dim: int):
        """Sum over ``dim`` (an integer, negative counts from the end), keeping it with size 1
        (Mirage semantics)."""
        return self._add("reduction", [x], dim=_int("reduction", "dim", dim))

    def _reduce(self, op: str, x, dim, keepdim: bool, **attrs):
        """``op`` (a name of ``ir.ops.REDUCTIONS``) of ``x`` over ``dim``: an integer, a sequence of
        adjacent integers, or None for every dim. The IR op keeps the dims with size 1; with
        ``keepdim=False`` a ``reshape`` (a view, no copy) drops them (every dim: a 0-d tensor)."""
        self._check_tensors(op, [x])
        if dim is None:
            dims = tuple(range(len(x.shape)))
        elif _as_int(dim) is not None:
            dims = (_int(op, "dim", dim),)
        elif isinstance(dim, (list, tuple)):
            dims = tuple(_int(op, "dim", d) for d in dim)
        else:
            raise GraphError(f"{op}: dim must be an integer, a sequence of integers or None, got {_describe(dim)}")
        if not isinstance(keepdim, bool):
            raise GraphError(f"{op}: keepdim must be a bool, got {_describe(keepdim)}")
        if len({d % max(1, len(x.shape)) for d in dims}) != len(dims):
            raise GraphError(f"{op}: dim {dims} names a dim twice")
        out = self._add(op, [x], dims=dims, **attrs)
        if keepdim:
            return out
        drop = {d % len(x.shape) for d in dims}
        return self._add("reshape", [out], shape=tuple(n for i, n in enumerate(x.shape) if i not in drop))

    def sum(self, x, dim=None, keepdim: bool = False):
        """``torch.sum(x, dim, keepdim)`` of a float tensor, computed in float32, in x's dtype.

        ``dim``: an integer, a sequence of adjacent dims (negative count from the end), or None
        (every dim). Over the trailing dims it is a fused row program; over others a kernel of
        its own (the CPU's C++ / a Triton kernel over an [outer, n, inner] view). GraphError for
        a non-float x, a dim out of range, repeated or non-adjacent dims, or a non-bool keepdim."""
        return self._reduce("sum", x, dim, keepdim)

    def mean(self, x, dim=None, keepdim: bool = False):
        """``torch.mean(x, dim, keepdim)``; ``dim`` and errors as ``sum``."""
        return self._reduce("mean", x, dim, keepdim)

    def amax(self, x, dim=None, keepdim: bool = False):
        """``torch.amax(x, dim, keepdim)`` (NaN wins); ``dim`` and errors as ``sum``."""
        return self._reduce("amax", x, dim, keepdim)

    def amin(self, x, dim=None, keepdim: bool = False):
        """``torch.amin(x, dim, keepdim)`` (NaN wins); ``dim`` and errors as ``sum``."""
        return self._reduce("amin", x, dim, keepdim)

    def var(self, x, dim=None, correction: float = 1, keepdim: bool = False):
        """``torch.var(x, dim, correction=correction, keepdim=keepdim)``: the sum of squared
        deviations from the mean over ``dim`` divided by ``max(0, N - correction)`` (N elements;
        1 is Bessel's correction, 0 the biased variance). ``correction`` a finite real >= 0;
        ``dim`` and other errors as ``sum``."""
        c = _real("var", "correction", correction)
        if c < 0:
            raise GraphError(f"var: correction must be >= 0, got {correction!r}")
        return self._reduce("var", x, dim, keepdim, correction=c)

    def log_softmax(self, x, dim: int = -1):
        """``torch.log_softmax(x, dim)`` of a float tensor (computed in float32): ``x - max -
        log(sum(exp(x - max)))`` over ``dim``. GraphError for a non-float x or a bad dim."""
        return self._add("log_softmax", [x], dim=_int("log_softmax", "dim", dim))

    def rms_norm(self, x, normalized_shape: Sequence[int], eps: float = 1e-6):
        """RMSNorm without weight (Zhang & Sennrich 2019): x / sqrt(mean(x^2) + eps) over
        the trailing dims ``normalized_shape`` (positive integers; a lone integer means one
        dim, like torch). Multiply by a weight with ``mul``. GraphError when ``eps`` is not a
        finite number >= 0."""
        shape = _shape("rms_norm", "normalized_shape", normalized_shape)
        e = _real("rms_norm", "eps", eps)
        if e < 0:
            raise GraphError(f"rms_norm: eps must be >= 0, got {eps!r}")
        return self._add("rms_norm", [x], normalized_shape=shape, eps=e)

    def layer_norm(self, x, normalized_shape: Sequence[int], weight=None, bias=None, eps: float = 1e-5):
        """LayerNorm (Ba et al. 2016), torch's ``F.layer_norm(x, normalized_shape, weight, bias, eps)``:
        ``(x - mean) / sqrt(var + eps) * weight + bias`` over the trailing dims ``normalized_shape``
        (biased variance, computed in float32). ``weight``/``bias`` are optional tensors of shape
        ``normalized_shape`` and x's dtype. A row op: it fuses with the elementwise ops around it
        (BERT's ``layer_norm(x + residual)`` is one kernel). GraphError for a bad shape, dtype or
        ``eps`` (must be a finite number >= 0)."""
        shape = _shape("layer_norm", "normalized_shape", normalized_shape)
        e = _real("layer_norm", "eps", eps)
        if e < 0:
            raise GraphError(f"layer_norm: eps must be >= 0, got {eps!r}")
        affine = [t for t in (weight, bias) if t is not None]
        self._check_tensors("layer_norm", [x, *affine])
        return self._add("layer_norm", [x, *affine], normalized_shape=shape, eps=e,
                         has_weight=weight is not None, has_bias=bias is not None)

    def group_norm(self, x, num_groups: int, weight=None, bias=None, eps: float = 1e-5):
        """GroupNorm (Wu & He 2018), torch's ``F.group_norm(x, num_groups, weight, bias, eps)``: x
        [N, C, *spatial] (a float dtype), its C channels split into ``num_groups`` groups, each
        (sample, group) normalized over its C / G channels and spatial positions ((x - mean) /
        sqrt(var + eps), biased variance, in float32), then ``* weight[c] + bias[c]`` (optional [C]
        tensors of x's dtype).

        Not an op of its own: the builder records ``reshape`` to [N, G, C/G * prod(spatial)],
        ``layer_norm`` over the last dim (a fused row program), ``reshape`` back, then ``mul``/``add``
        with the weight and bias as [C, 1, ...] (one elementwise kernel). With a half dtype the
        normalized value is rounded to it before the affine step (F.group_norm rounds once).

        GraphError: x has fewer than 2 dims, ``num_groups`` is not a positive integer dividing C,
        ``eps`` is not a finite number >= 0, or weight/bias are not [C] of x's dtype."""
        self._check_tensors("group_norm", [x] + [t for t in (weight, bias) if t is not None])
        G = _int("group_norm", "num_groups", num_groups)
        if len(x.shape) < 2:
            raise GraphError(f"group_norm: x must be [N, C, *spatial], got shape {x.shape}")
        N, C = x.shape[0], x.shape[1]
        if G <= 0 or C % G:
            raise GraphError(f"group_norm: num_groups {G} must be a positive divisor of the {C} channels "
                             f"of x (shape {x.shape})")
        for name, t in (("weight", weight), ("bias", bias)):
            if t is not None and (t.shape != (C,) or t.dtype != x.dtype):
                raise GraphError(f"group_norm: {name} must be ({C},) of x's dtype {x.dtype.value}, "
                                 f"got {t.shape} {t.dtype.value}")
        D = math.prod(x.shape) // (N * G)
        y = self.reshape(self.layer_norm(self.reshape(x, (N, G, D)), (D,), eps=eps), x.shape)
        per_channel = (C, *([1] * (len(x.shape) - 2)))
        if weight is not None:
            y = self.mul(y, self.reshape(weight, per_channel))
        if bias is not None:
            y = self.add(y, self.reshape(bias, per_channel))
        return y

    def softmax(self, x, dim: int = -1):
        """Softmax over ``dim`` (an integer, any dim; computed in float32). Over the last dim a
        fused row program, over another a kernel of its own."""
        return self._add("softmax", [x], dim=_int("softmax", "dim", dim))

    # library ops
    def matmul(self, a, b):
        """``a @ b`` over the last two dims, batched (with broadcasting) over leading dims."""
        return self._add("matmul", [a, b])

    def linear(self, x, w, bias=None, compute_dtype: str | None = None, weight_layout: str = "nk"):
        """``x @ w.T (+ bias)``: x [..., K], w [N, K] (float, or GGUF blocks such as q4_1/q8_0),
        bias [N]. A bfloat16 ``w`` with float32 ``x`` is a bfloat16 GEMM with float32 accumulation
        and float32 output (``ir.ops`` ``_linear_ref`` gives the rounding). ``compute_dtype``
        'bfloat16' (float32 or GGUF-block ``w`` with float32 ``x``) computes the same way on the
        (decoded) weight rounded to bfloat16; 'int8' (q4_1/q8_0 ``w``, float32 ``x``) quantizes x to
        int8 per block of 32 values (scale amax / 127: ``ir.ops.quantize_blocks_int8``) and sums
        the blocks' products in integers, as llama.cpp's quantized GEMVs do (the CPU backend's
        kernels; others refuse it). ``weight_layout`` 'kn': ``w`` is stored [K, N] and the op is
        ``x @ w (+ bias)`` (float weights only; GPT-2's Conv1D, ``torch.addmm``), read in place.
        GraphError for bad shapes, dtypes, compute_dtype or weight_layout."""
        self._check_tensors("linear", [x, w] + ([bias] if bias is not None else []))
        attrs = {"w_dtype": w.dtype.value, "w_shape": list(w.shape)} if w.dtype.is_quantized else {}
        if compute_dtype is not None:
            attrs["compute_dtype"] = compute_dtype
        if weight_layout != "nk":
            attrs["weight_layout"] = weight_layout
        return self._add("linear", [x, w] + ([bias] if bias is not None else []), **attrs)

    def linear_stack(self, x, weights, biases=None, weight_layout: str = "nk"):
        """The k linear layers of one input as one op (horizontal fusion: q/k/v projections):
        ``stack([x @ w.T (+ b) for w, b in zip(weights, biases)])``, [k, ..., N] for x [..., K]
        and k float weights [N, K] of x's dtype (or [K, N] with ``weight_layout`` 'kn'), biases
        None or k tensors [N]. Output ``i`` is a contiguous plane, so ``slice_rows`` of it is free.
        GraphError for an empty list, weights of different shapes or dtypes, or bad biases."""
        weights = list(weights)
        biases = None if biases is None else list(biases)
        if not weights or (biases is not None and len(biases) != len(weights)):
            raise GraphError(f"linear_stack: needs one or more weights and as many biases (or None), got "
                             f"{len(weights)} weights and {'no' if biases is None else len(biases)} biases")
        attrs = {"parts": len(weights), "bias": biases is not None}
        if weight_layout != "nk":
            attrs["weight_layout"] = weight_layout
        return self._add("linear_stack", [x, *weights, *(biases or [])], **attrs)

    def linear_w8a8(self, x, w_t, w_scale, bias=None, group_size: int = 0):
        """int8 linear layer: ``x`` float32 [..., K] quantized per token (row) to int8 at run time,
        times the per-channel int8 weight ``w_t`` [K, N] (transposed: in x out features) with
        float32 scales ``w_scale`` [N], in integer arithmetic; plus float32 ``bias`` [N]. Returns
        float32 [..., N]; see ``ir.ops.linear_w8a8_reference``. ``group_size`` G > 0: each token
        quantized per group of G features (a multiple of 4 dividing K). GraphError for bad
        shapes/dtypes or group size."""
        extra = [bias] if bias is not None else []
        self._check_tensors("linear_w8a8", [x, w_t, w_scale, *extra])
        attrs = {"group_size": int(group_size)} if group_size else {}
        return self._add("linear_w8a8", [x, w_t, w_scale, *extra], **attrs)

    def embedding(self, ids, table):
        """Rows of ``table`` [vocab, D] (float or q4_1/q8_0) at integer ``ids`` [...]: [..., D]."""
        self._check_tensors("embedding", [ids, table])
        attrs = {"w_dtype": table.dtype.value, "w_shape": list(table.shape)} if table.dtype.is_quantized else {}
        return self._add("embedding", [ids, table], **attrs)

    def index_select(self, x, dim: int, index):
        """``torch.index_select(x, dim, index)``: the slices of ``x`` along ``dim`` (negative counts
        from the end) at ``index`` (int64 [K]); shape of x with that dim of size K, x's dtype
        (float32/float16/bfloat16, bool, int32 or int64). GraphError for a bad dim, dtype or
        index rank; an index outside ``[0, x.shape[dim])`` raises IndexOutOfRangeError when
        the graph runs (kernels check every index before reading)."""
        d = self._dim("index_select", x, dim)
        self._check_tensors("index_select", [x, index])
        return self._add("index_select", [x, index], dim=d)

    def gather(self, x, dim: int, index):
        """``torch.gather(x, dim, index)``: ``out[p] = x[p with coordinate dim replaced by
        index[p]]``; index int64 of x's rank, no dim larger than x's except ``dim``; the output
        has index's shape and x's dtype (as ``index_select``). GraphError for bad shapes or
        dtypes; an index outside ``[0, x.shape[dim])`` raises IndexOutOfRangeError when the
        graph runs."""
        d = self._dim("gather", x, dim)
        self._check_tensors("gather", [x, index])
        return self._add("gather", [x, index], dim=d)

    def rope(self, x, cos, sin, start_pos):
        """Rotate-half RoPE of x [T, H, Dh] at positions start_pos[0] + t, with tables
        cos/sin [max_seq, Dh/2] (float32). Source: Su et al. 2021; transformers' Llama."""
        return self._add("rope", [x, cos, sin, start_pos])

    def rotary_emb(self, x, cos, sin):
        """Rotate-half RoPE with per-element tables, as transformers' ``apply_rotary_pos_emb``:
        ``x * cos + rotate_half(x) * sin``, ``rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])``.
        x [..., D] (1 to 4 dims, D even, float); cos and sin of x's dtype, broadcasting to x's
        shape with last dim D (e.g. [B, 1, S, D] for x [B, H, S, D]). Returns x's shape and
        dtype (computed in float32). GraphError for other shapes or dtypes. Source: Su et al.
        2021 (RoFormer)."""
        return self._add("rotary_emb", [x, cos, sin])

    def attention(self, q, k, v, k_cache, v_cache, start_pos, scale: float | None = None,
                  window: int | None = None):
        """Causal grouped-query attention over a KV cache, optionally in a sliding window.

        q [T, Hq, Dh]; k, v [T, Hkv, Dh]; caches [max_seq, Hkv, Dh] (updated in place at
        rows start_pos[0] .. start_pos[0]+T-1); start_pos int64 (1,); all one float dtype.
        Returns [T, Hq, Dh]. ``scale`` multiplies q.k (default ``Dh ** -0.5``); GraphError
        unless it is finite.

        ``window``: None or 0 is full causal attention: the query at absolute position
        ``p = start_pos + t`` sees keys ``j <= p``. An integer ``W >= 1`` is a sliding window:
        it sees keys ``p - W < j <= p`` (the last W positions, itself included), exactly
        transformers' ``masking_utils.sliding_window_causal_mask_function`` (``kv_idx <= q_idx``
        and ``kv_idx > q_idx - sliding_window``), which Mistral, Qwen2/3 and Gemma 3's sliding
        layers use with ``W = config.sliding_window``. The KV cache keeps every position; only
        the range attended changes. GraphError when ``window`` is not an integer (floats and
        bools included) or is negative.
        """
        self._check_tensors("attention", [q, k, v, k_cache, v_cache, start_pos])
        scale = _real("attention", "scale", scale) if scale is not None else q.shape[-1] ** -0.5
        w = 0 if window is None else _int("attention", "window", window)
        if w < 0:
            raise GraphError(f"attention: window must be None, 0 (full causal) or a positive integer, got {w}")
        return self._add("attention", [q, k, v, k_cache, v_cache, start_pos], scale=scale, window=w)

    def rope_rows(self, x, cos, sin, positions):
        """Rotate-half RoPE with a position per row (continuous batching: rows of several
        sequences at their own positions). x [T, H, Dh] (float), cos/sin [max_seq, Dh/2]
        (float32), positions int64 [T]: row t is rotated at positions[t]. Returns [T, H, Dh].
        GraphError for bad shapes or dtypes; a position outside [0, max_seq) raises
        IndexOutOfRangeError when the graph runs. Source: Su et al. 2021; transformers' Llama."""
        return self._add("rope_rows", [x, cos, sin, positions])

    def attention_rows(self, q, k, v, k_cache, v_cache, slots, positions, scale: float | None = None,
                       window: int | None = None):
        """Causal grouped-query attention of rows from several sequences, each over its own slot
        of a KV cache: the attention of a continuous-batching step (decode rows and chunked
        prefill rows together).

        q [T, Hq, Dh]; k, v [T, Hkv, Dh]; caches [num_slots, max_seq, Hkv, Dh] (one float dtype,
        updated in place); slots, positions int64 [T]. First each row t writes its k/v at
        ``cache[slots[t], positions[t]]``; then row t attends the keys ``j <= positions[t]`` of
        its own slot (``window`` W >= 1: also ``j > positions[t] - W``, as ``attention``), so
        the rows of one sequence's prefill chunk see each other causally. Returns [T, Hq, Dh].
        ``scale`` multiplies q.k (default ``Dh ** -0.5``). GraphError for bad shapes, dtypes, a
        non-finite scale or a window that is not a non-negative integer; a slot outside
        [0, num_slots) or a position outside [0, max_seq) raises IndexOutOfRangeError when the
        graph runs (nothing is written).
        """
        self._check_tensors("attention_rows", [q, k, v, k_cache, v_cache, slots, positions])
        scale = _real("attention_rows", "scale", scale) if scale is not None else q.shape[-1] ** -0.5
        w = 0 if window is None else _int("attention_rows", "window", window)
        if w < 0:
            raise GraphError(f"attention_rows: window must be None, 0 (full causal) or a positive integer, got {w}")
        return self._add("attention_rows", [q, k, v, k_cache, v_cache, slots, positions], scale=scale, window=w)

    def attention_bidir(self, qkv, key_mask, num_heads: int, scale: float | None = None):
        """Bidirectional multi-head attention (encoders: BERT) with a key-padding mask.

        qkv [B, S, 3 * H * Dh] (q, k, v packed along the last dim, as one QKV projection makes
        them), key_mask float32 [B, S] added to the scores of each key (0 keeps, -inf drops a
        padding key). Returns [B, S, H * Dh]. ``scale`` multiplies q.k (default ``Dh ** -0.5``).
        GraphError for bad shapes, a non-positive ``num_heads`` or a non-finite ``scale``."""
        return self._packed_attention("attention_bidir", qkv, key_mask, num_heads, scale)

    def argmax(self, x, dim: int = -1):
        """Index of the maximum over the last dim (int64); ``dim`` is an integer naming it."""
        return self._add("argmax", [x], dim=_int("argmax", "dim", dim))

    def allreduce(self, x):
        """The sum of ``x`` over every rank of the tensor-parallel group (same shape and float
        dtype): the reduction after a row-parallel linear. On one process (no group) it is ``x``.
        The group is torch.distributed's default one (``yirage.runtime.distributed``)."""
        return self._add("allreduce", [x])

    def reshape(self, x, shape: Sequence[int]):
        """Same elements, new shape (positive integers; a view of contiguous data)."""
        return self._add("reshape", [x], shape=_shape("reshape", "shape", shape))

    # layout ops: each a copy into a new contiguous tensor (a kernel of its own; any dtype)
    def _dim(self, op: str, x, dim) -> int:
        """``dim`` as a non-negative int for ``x``; GraphError when not an in-range integer."""
        self._check_tensors(op, [x])
        d, n = _int(op, "dim", dim), len(x.shape)
        if not -n <= d < n:
            raise GraphError(f"{op}: dim {d} is out of range for a {n}-d tensor (shape {x.shape})")
        return d % n

    def permute(self, x, dims: Sequence[int]):
        """``x.permute(dims).contiguous()``: output dim i is input dim ``dims[i]`` (a permutation;
        negative dims count from the end). A copy. GraphError unless ``dims`` is a permutation."""
        self._check_tensors("permute", [x])
        n = len(x.shape)
        if not isinstance(dims, (list, tuple)):
            raise GraphError(f"permute: dims must be a sequence of integers, got {_describe(dims)}")
        ds = tuple(d + n if d < 0 else d for d in (_int("permute", "dims", d) for d in dims))
        return self._add("permute", [x], dims=ds)

    def transpose(self, x, dim0: int, dim1: int):
        """``x.transpose(dim0, dim1).contiguous()`` (a ``permute``; a copy). GraphError for a bad dim."""
        d0, d1 = self._dim("transpose", x, dim0), self._dim("transpose", x, dim1)
        dims = list(range(len(x.shape)))
        dims[d0], dims[d1] = dims[d1], dims[d0]
        return self._add("permute", [x], dims=tuple(dims))

    def expand(self, x, shape: Sequence[int]):
        """``x.expand(shape).contiguous()`` (torch's ``broadcast_to``, materialized): dims of size 1
        repeat, new dims go in front, -1 keeps a dim. A copy. GraphError when x does not broadcast
        to ``shape``."""
        self._check_tensors("expand", [x])
        if not isinstance(shape, (list, tuple)):
            raise GraphError(f"expand: shape must be a sequence of integers, got {_describe(shape)}")
        lead = len(shape) - len(x.shape)
        dims = tuple(x.shape[i - lead] if _int("expand", "shape", n) == -1 and i >= lead else _int("expand", "shape", n)
                     for i, n in enumerate(shape))
        return self._add("expand", [x], shape=dims)

    broadcast_to = expand

    def slice(self, x, dim: int = 0, start: int | None = None, end: int | None = None, step: int = 1):
        """``x[..., start:end:step, ...]`` along ``dim``, copied (torch's ``aten.slice``): start/end as
        in Python (None: the ends; negative counts from the end; clamped to the dim), step >= 1.
        GraphError for a bad dim, a step < 1 or an empty result."""
        d = self._dim("slice", x, dim)
        n = x.shape[d]
        st = _int("slice", "step", step)
        lo = 0 if start is None else _int("slice", "start", start)
        hi = n if end is None else _int("slice", "end", end)
        lo, hi = (lo + n if lo < 0 else lo), (hi + n if hi < 0 else hi)
        lo, hi = min(max(lo, 0), n), min(max(hi, 0), n)
        return self._add("slice", [x], dim=d, start=lo, end=hi, step=st)

    def select(self, x, dim: int, index: int):
        """``x.select(dim, index)``, copied: the dim is removed (a 1-d x gives a 0-d tensor); a
        negative index counts from the end. GraphError for a bad dim or an index out of range."""
        d = self._dim("select", x, dim)
        i = _int("select", "index", index)
        return self._add("select", [x], dim=d, index=i + x.shape[d] if i < 0 else i)

    def pad(self, x, pads: Sequence, value: float = 0.0):
        """``x`` with ``pads[d] = (before, after)`` elements of ``value`` added on each side of
        every dim d (one pair per dim, first dim first, non-negative: ``F.pad``'s constant mode
        with its pairs in dim order). Copied. GraphError for pads of the wrong length or sign,
        or a value that is not a real number (the convolutions' "same" padding of
        TensorFlow-style models is asymmetric: this op, then a conv with padding 0)."""
        pads = [tuple(_int("pad", "pads", n) for n in p) for p in pads]
        return self._add("pad", [x], pads=[list(p) for p in pads],
                         value=_real("pad", "value", value, finite=False))

    def cat(self, tensors: Sequence, dim: int = 0):
        """``torch.cat(tensors, dim)``: one dtype and rank, equal sizes except along ``dim``. GraphError
        for an empty list, mismatched inputs or a bad dim."""
        tensors = list(tensors)
        if not tensors:
            raise GraphError("cat: needs at least one tensor")
        self._check_tensors("cat", tensors)
        return self._add("cat", tensors, dim=self._dim("cat", tensors[0], dim))

    # ---- convolutional networks (ir/conv.py): NCHW ----------------------------------------
    def conv2d(self, x, weight, bias=None, stride=1, padding=0, dilation=1, groups: int = 1):
        """``F.conv2d``: x [N, C, H, W], weight [O, C / groups, kh, kw], bias [O] (one float dtype;
        computed with float32 accumulation) -> [N, O, Ho, Wo]. ``stride``/``padding``/``dilation``:
        an integer or a pair (padding zeros); ``groups`` divides C and O (``groups == C``:
        depthwise). GraphError for bad shapes, dtypes or attributes."""
        extra = [bias] if bias is not None else []
        self._check_tensors("conv2d", [x, weight, *extra])
        return self._add("conv2d", [x, weight, *extra], stride=_pair("conv2d", "stride", stride),
                         padding=_pair("conv2d", "padding", padding, 0),
                         dilation=_pair("conv2d", "dilation", dilation), groups=_int("conv2d", "groups", groups))

    def max_pool2d(self, x, kernel_size, stride=None, padding=0, dilation=1):
        """``F.max_pool2d`` over x [N, C, H, W] (padding is -inf; floor mode). ``stride`` defaults
        to the kernel. GraphError for bad attributes (padding above half the kernel, a window
        that does not fit)."""
        k = _pair("max_pool2d", "kernel_size", kernel_size)
        return self._add("max_pool2d", [x], kernel=k, stride=k if stride is None else _pair("max_pool2d", "stride", stride),
                         padding=_pair("max_pool2d", "padding", padding, 0),
                         dilation=_pair("max_pool2d", "dilation", dilation))

    def avg_pool2d(self, x, kernel_size, stride=None, padding=0, count_include_pad: bool = True):
        """``F.avg_pool2d`` over x [N, C, H, W] (floor mode; ``count_include_pad``: padding zeros
        count in the divisor). GraphError for bad attributes."""
        k = _pair("avg_pool2d", "kernel_size", kernel_size)
        return self._add("avg_pool2d", [x], kernel=k, stride=k if stride is None else _pair("avg_pool2d", "stride", stride),
                         padding=_pair("avg_pool2d", "padding", padding, 0), count_include_pad=bool(count_include_pad))

    def adaptive_avg_pool2d(self, x, output_size):
        """``F.adaptive_avg_pool2d``: x [N, C, H, W] -> [N, C, oh, ow] (``output_size`` an integer or
        a pair). GraphError for a non-positive size."""
        return self._add("adaptive_avg_pool2d", [x], output_size=_pair("adaptive_avg_pool2d", "output_size", output_size))

    def batch_norm(self, x, running_mean, running_var, weight=None, bias=None, eps: float = 1e-5):
        """Inference BatchNorm over channel dim 1 of x [N, C, ...] with float32 [C] running
        statistics and (optional, both or neither) affine weight and bias: ``(x - mean) /
        sqrt(var + eps) * weight + bias``. GraphError for bad shapes, dtypes or eps."""
        if (weight is None) != (bias is None):
            raise GraphError("batch_norm: give both weight and bias, or neither")
        ins = [x, running_mean, running_var, *([weight, bias] if weight is not None else [])]
        self._check_tensors("batch_norm", ins)
        e = _real("batch_norm", "eps", eps)
        if e < 0:
            raise GraphError(f"batch_norm: eps must be >= 0, got {eps!r}")
        return self._add("batch_norm", ins, eps=e, affine=weight is not None)

    def cumsum(self, x, dim: int):
        """``torch.cumsum(x, dim)``: running sums along ``dim`` (negative counts from the end).
        Float x keeps its dtype (sums kept in float64 on the CPU, as torch's CPU kernel does);
        bool, int32 and int64 x give int64 (exact, wrapping as torch's). GraphError for a bad
        dim or dtype."""
        d = self._dim("cumsum", x, dim)
        return self._add("cumsum", [x], dim=d)

    def slice_rows(self, x, start: int, end: int):
        """Rows ``start:end`` of the first dim (a view; no copy). ``start`` and ``end`` are
        integers with ``0 <= start < end <= rows`` (GraphError otherwise)."""
        return self._add("slice_rows", [x], start=_int("slice_rows", "start", start),
                         end=_int("slice_rows", "end", end))

    def sdpa(self, q, k, v, mask=None, causal: bool = False, scale: float | None = None):
        """Scaled dot-product attention, ``torch.nn.functional.scaled_dot_product_attention``:
        q [B, H, S, D], k [B, Hk, T, D], v [B, Hk, T, Dv] (Hk dividing H: GQA), ``mask`` None or
        an additive float mask [B or 1, H or 1, S or 1, T] of q's dtype, ``causal`` (query i sees
        keys j <= i), ``scale`` (None: 1/sqrt(D)). Returns [B, H, S, Dv]. GraphError for
        mismatched shapes or dtypes."""
        if scale is not None:
            scale = _real("sdpa", "scale", scale)
        return self._add("sdpa", [q, k, v] + ([mask] if mask is not None else []), causal=bool(causal),
                         scale=scale)

    def attention_varlen(self, qkv, offsets, num_heads: int, scale: float | None = None):
        """Bidirectional multi-head attention over sentences packed back to back (no padding).

        qkv [T, 3 * H * Dh] (q, k, v packed along the last dim); offsets int64 [B + 1]: sentence
        b is rows offsets[b] .. offsets[b+1]-1, and each token attends only its own sentence.
        Rows past offsets[B] (padding of a bucketed T) come out zero. Returns [T, H * Dh].
        ``scale`` multiplies q.k (default ``Dh ** -0.5``). GraphError for bad shapes, a
        non-positive ``num_heads`` or a non-finite ``scale``; offsets that are not 0, then
        non-decreasing up to at most T raise IndexOutOfRangeError when the graph runs."""
        return self._packed_attention("attention_varlen", qkv, offsets, num_heads, scale)

    def _packed_attention(self, op: str, qkv, aux, num_heads, scale):
        """The checks and attrs shared by the attention ops over packed qkv [..., 3 * H * Dh]:
        ``num_heads`` a positive integer, ``scale`` finite (default ``Dh ** -0.5``)."""
        self._check_tensors(op, [qkv, aux])
        h = _int(op, "num_heads", num_heads)
        if h <= 0:
            raise GraphError(f"{op}: num_heads must be positive, got {h}")
        dh = qkv.shape[-1] // (3 * h) if qkv.shape[-1] >= 3 * h else 1
        scale = _real(op, "scale", scale) if scale is not None else dh ** -0.5
        return self._add(op, [qkv, aux], num_heads=h, scale=scale)

    def customized(self, inputs: Sequence[DTensor], tb_graph) -> list[DTensor]:
        """Run threadblock graph ``tb_graph`` (``yr.new_threadblock_graph``, ir/threadblock.py)
        on ``inputs`` (the DTensors given to its ``new_input``, in order): Mirage's
        ``graph.customized``. Returns one DTensor per ``tb_graph.new_output``, in order.
        GraphError when the inputs do not match or the block graph has no output."""
        from .threadblock import add_customized
        return add_customized(self, inputs, tb_graph)

    # ---- the reference ----------------------------------------------------------------------
    def interpret(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Run the reference interpreter (torch eager); see ir/interpret.py."""
        return interpret(self, inputs)

    # ---- drawing ----------------------------------------------------------------------------
    def visualize(self, path) -> str:
        """Draw the graph (and the block graph of every ``customized`` op) into file ``path``.

        ``.svg``/``.png``: rendered with Graphviz when the ``graphviz`` package and the ``dot``
        binary are available, else the DOT text is written to ``path`` with suffix ``.dot``;
        ``.dot``/``.gv``: the DOT text. See ir/visualize.py ``render``.

        Returns the path written (a str). Raises GraphError for any other suffix.
        """
        from .visualize import render
        return render(self, path)
