"""Fusion: turns a KernelGraph into a schedule of fused row kernels and library calls.

A fused kernel (``FusedKernel``) is a *row program*: every value it computes is either a
``vec`` value (one element per position of a row of width ``D``) or an ``rs`` value (one
scalar per row, e.g. a sum). The tensors it touches are viewed as ``(R, D)`` where
``D`` is the product of the ``k`` trailing dims of the group's shape. Elementwise ops,
``reduction``/``sum``/``mean``/``amax``/``amin``/``var`` over the trailing dims,
``softmax``/``log_softmax`` over the last dim and the norms are expanded into the primitive
statements below (the same ops over other dims are library steps: kernels of their own) and fused greedily in topological order:
an op joins the open kernel when its shape fits, otherwise (or after any library op) a
new kernel starts. Composite ops are expanded as
  rms_norm(x)  = x * rsqrt(sum(x*x) / D + eps)
  layer_norm(x, w, b) = xc * rsqrt(sum(xc*xc) / D + eps) * w + b,  xc = x - sum(x) / D
  softmax(x)   = e / sum(e)  with  e = exp(x - max(x))
  reduction(x) = sum(x);  mean(x) = sum(x) / D;  amax(x) = max(x);  amin(x) = -max(-x)
  var(x) = sum(xc*xc) / max(0, D - correction),  xc = x - sum(x) / D
  log_softmax(x) = (x - max(x)) - log(sum(exp(x - max(x))))

Statements: ``load`` (an input in one of the modes ``full`` [R, D], ``row`` [D] broadcast
over rows, ``col`` [R] one per row, ``scalar``), unary/binary ops from ir.ops (``UNARY``,
``BINARY``, ``COMPARE``, ``LOGICAL``), ``where`` (three arguments), ``pow_scalar`` (attr
``exponent``), ``to_bool`` (x != 0), ``affine`` (a*x + b), and the row reductions
``sum``/``max``.

Every value is float32, bool values included: a bool is carried as 0.0 or 1.0 (a bool input
is loaded as 0/1, comparisons and logical ops make 0/1, a cast to bool is ``to_bool``), and
stored as ``v != 0`` into a bool output; ``where`` takes its condition as ``c != 0``.

This pass must never emit code: codegen renders FusedKernel for a target language.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..dtypes import DType
from ..ir.ops import BINARY, COMPARE, LOGICAL, OPS, UNARY

VEC, RS = "vec", "rs"
VIEW_OPS = ("reshape", "slice_rows")  # library ops that alias their input's buffer


@dataclass
class KInput:
    tid: int
    mode: str  # full | row | col | scalar | expand (materialized to full by the executor)
    dtype: DType


@dataclass
class Stmt:
    id: int
    kind: str  # vec | rs
    op: str
    args: tuple[int, ...] = ()
    attrs: dict = field(default_factory=dict)


@dataclass
class FusedKernel:
    """A row program over an (R, D) iteration space; R is a run-time argument."""

    shape: tuple[int, ...]
    k: int
    inputs: list[KInput] = field(default_factory=list)
    stmts: list[Stmt] = field(default_factory=list)
    outputs: list[tuple[int, int, DType]] = field(default_factory=list)  # (stmt id, tid, dtype)
    values: dict[int, int] = field(default_factory=dict)  # graph tid -> stmt id
    ops: list = field(default_factory=list)  # the IR OpNodes it covers
    #: D is a run-time argument of the generated code, not a constant in it (see ``schedule``)
    runtime_d: bool = False

    @property
    def D(self) -> int:
        return math.prod(self.shape[-self.k:])

    @property
    def R(self) -> int:
        return math.prod(self.shape[:-self.k])

    @property
    def rs_shape(self) -> tuple[int, ...]:
        return (*self.shape[:-self.k], *([1] * self.k))

    def key(self, with_d: bool = True) -> str:
        """Structural signature: equal keys render to equal code (R excluded; D excluded too
        when ``with_d`` is False, for a code generator that takes D at run time)."""
        ins = ",".join(f"{i.mode}:{i.dtype.value}" for i in self.inputs)
        st = ";".join(f"{s.kind}{s.id}={s.op}{s.args}{sorted(s.attrs.items())}" for s in self.stmts)
        outs = ",".join(f"{s}:{d.value}" for s, _, d in self.outputs)
        return f"D={self.D if with_d else '*'}|{ins}|{st}|{outs}"

    # ---- building ---------------------------------------------------------------------
    def stmt(self, kind: str, op: str, args=(), **attrs) -> int:
        self.stmts.append(Stmt(len(self.stmts), kind, op, tuple(args), attrs))
        return len(self.stmts) - 1

    def kind_of(self, sid: int) -> str:
        return self.stmts[sid].kind

    def load(self, graph, tid: int) -> int:
        """Statement id of graph tensor ``tid`` inside this kernel (loading it if external)."""
        if tid in self.values:
            return self.values[tid]
        t = graph.tensors[tid]
        mode = input_mode(t.shape, self.shape, self.k)
        self.inputs.append(KInput(tid, mode, t.dtype))
        sid = self.stmt(RS if mode in ("col", "scalar") else VEC, "load", (len(self.inputs) - 1,))
        self.values[tid] = sid
        return sid


def phases(kernel: FusedKernel) -> tuple[dict[int, int], dict[int, int]]:
    """How a row splits into loops: (phase of every vec statement and row reduction, i.e.
    the loop over the row it runs in; phase from which every rs value is available).

    A row reduction accumulates in its argument's loop and its value is available from the
    next one. Every code generator that walks a row in loops (codegen/cpp.py,
    codegen/triton.py's looped shape) uses this one analysis.
    """
    phase: dict[int, int] = {}
    avail: dict[int, int] = {}
    for s in kernel.stmts:
        if s.kind == VEC:
            phase[s.id] = 0 if s.op == "load" else max(
                [avail[x] if x in avail else phase[x] for x in s.args], default=0)
        elif s.op == "load":
            avail[s.id] = 0
        elif s.op in ("sum", "max"):
            phase[s.id] = phase[s.args[0]]
            avail[s.id] = phase[s.id] + 1
        else:
            avail[s.id] = max([avail[x] for x in s.args], default=0)
    return phase, avail


@dataclass
class LibraryStep:
    """An op that runs as its own kernel (GEMM, attention, ...)."""

    node: object


def input_mode(shape, S, k) -> str:
    """How a tensor of ``shape`` (broadcastable to S) is indexed in an (R, D) view of S."""
    shape = (1,) * (len(S) - len(shape)) + tuple(shape)
    lead, trail = shape[:-k], shape[-k:]
    if tuple(shape) == tuple(S):
        return "full"
    if math.prod(shape) == 1:
        return "scalar"
    if tuple(trail) == tuple(S[-k:]) and all(d == 1 for d in lead):
        return "row"
    if all(d == 1 for d in trail) and tuple(lead) == tuple(S[:-k]):
        return "col"
    return "expand"


def _row_k(node, graph) -> int | None:
    """Trailing dims a row op works on, or None if it cannot be fused (non-last dim)."""
    x = graph.tensors[node.inputs[0]]
    if node.op in ("rms_norm", "layer_norm"):
        return len(node.attrs["normalized_shape"])
    if "dims" in node.attrs:  # sum, mean, amax, amin, var: adjacent dims, fused when they are trailing
        dims = sorted(d % len(x.shape) for d in node.attrs["dims"])
        return len(dims) if dims[-1] == len(x.shape) - 1 else None
    if node.attrs["dim"] % len(x.shape) == len(x.shape) - 1:
        return 1
    return None


def _fits(kern: FusedKernel | None, node, graph) -> str | None:
    """VEC/RS if ``node`` can join ``kern``, else None."""
    if kern is None:
        return None
    out = graph.tensors[node.output].shape
    kind = OPS[node.op].kind
    if kind == "row":
        x = graph.tensors[node.inputs[0]].shape
        return VEC if x == kern.shape and _row_k(node, graph) == kern.k else None
    if out == kern.shape:
        return VEC
    if out == kern.rs_shape and all(
            (i in kern.values and kern.kind_of(kern.values[i]) == RS)
            or (i not in kern.values and input_mode(graph.tensors[i].shape, kern.shape, kern.k) in ("col", "scalar"))
            for i in node.inputs):
        return RS
    return None


def _new_kernel(node, graph) -> FusedKernel | None:
    out = graph.tensors[node.output]
    if OPS[node.op].kind == "row":
        k = _row_k(node, graph)
        if k is None:
            return None
        return FusedKernel(graph.tensors[node.inputs[0]].shape, k)
    if not out.shape:
        return None
    return FusedKernel(out.shape, 1)


def _emit(kern: FusedKernel, node, graph, kind: str) -> None:
    """Append the statements of ``node`` to ``kern``."""
    args = [kern.load(graph, i) for i in node.inputs]
    op, a = node.op, node.attrs
    if OPS[op].kind == "row" and kern.kind_of(args[0]) == RS:
        # a row op over a per-row value (rows of one element, D == 1): reductions read vec
        # values, so spread it over the (one-element) row first
        args = [kern.stmt(VEC, "affine", [args[0]], a=1.0, b=0.0)]
    if op in UNARY or op in BINARY or op in COMPARE or op in LOGICAL or op == "where":
        kind = RS if all(kern.kind_of(s) == RS for s in args) else VEC
        sid = kern.stmt(kind, op, args)
    elif op == "pow_scalar":
        sid = kern.stmt(kind, "pow_scalar", args, exponent=a["exponent"])
    elif op == "cast" and a["dtype"] == DType.bool.value:  # 0/1 from here on, as a bool value is
        sid = kern.stmt(kern.kind_of(args[0]), "to_bool", args)
    elif op == "cast":  # the value itself; the output's dtype decides the store
        sid = args[0]
    elif op == "clamp":
        sid = kern.stmt(kind, "clamp", args, lo=a["min_val"], hi=a["max_val"])
    elif op == "scale":
        sid = kern.stmt(kind, "affine", args, a=a["factor"], b=0.0)
    elif op in ("reduction", "sum"):
        sid = kern.stmt(RS, "sum", args)
    elif op == "mean":
        sid = kern.stmt(RS, "affine", [kern.stmt(RS, "sum", args)], a=1.0 / kern.D, b=0.0)
    elif op == "amax":
        sid = kern.stmt(RS, "max", args)
    elif op == "amin":  # min(x) = -max(-x)
        sid = kern.stmt(RS, "neg", [kern.stmt(RS, "max", [kern.stmt(VEC, "neg", args)])])
    elif op == "var":  # sum((x - mean)^2) / max(0, D - correction), two passes as torch.var
        mean = kern.stmt(RS, "affine", [kern.stmt(RS, "sum", args)], a=1.0 / kern.D, b=0.0)
        xc = kern.stmt(VEC, "sub", [args[0], mean])
        denom = max(0.0, kern.D - a["correction"])
        sid = kern.stmt(RS, "affine", [kern.stmt(RS, "sum", [kern.stmt(VEC, "square", [xc])])],
                        a=1.0 / denom if denom else math.inf, b=0.0)
    elif op == "log_softmax":  # x - max - log(sum(exp(x - max)))
        xm = kern.stmt(VEC, "sub", [args[0], kern.stmt(RS, "max", args)])
        lse = kern.stmt(RS, "log", [kern.stmt(RS, "sum", [kern.stmt(VEC, "exp", [xm])])])
        sid = kern.stmt(VEC, "sub", [xm, lse])
    elif op == "rms_norm":
        x = args[0]
        ss = kern.stmt(RS, "sum", [kern.stmt(VEC, "square", [x])])
        inv = kern.stmt(RS, "rsqrt", [kern.stmt(RS, "affine", [ss], a=1.0 / kern.D, b=a["eps"])])
        sid = kern.stmt(VEC, "mul", [x, inv])
    elif op == "layer_norm":
        x, affine = args[0], args[1:]
        mean = kern.stmt(RS, "affine", [kern.stmt(RS, "sum", [x])], a=1.0 / kern.D, b=0.0)
        xc = kern.stmt(VEC, "sub", [x, mean])
        var = kern.stmt(RS, "affine", [kern.stmt(RS, "sum", [kern.stmt(VEC, "square", [xc])])],
                        a=1.0 / kern.D, b=a["eps"])
        sid = kern.stmt(VEC, "mul", [xc, kern.stmt(RS, "rsqrt", [var])])
        if a.get("has_weight"):
            sid = kern.stmt(VEC, "mul", [sid, affine.pop(0)])
        if a.get("has_bias"):
            sid = kern.stmt(VEC, "add", [sid, affine.pop(0)])
    elif op == "softmax":
        x = args[0]
        m = kern.stmt(RS, "max", [x])
        e = kern.stmt(VEC, "exp", [kern.stmt(VEC, "sub", [x, m])])
        sid = kern.stmt(VEC, "div", [e, kern.stmt(RS, "sum", [e])])
    else:  # pragma: no cover - the op table and this pass are kept in sync
        raise NotImplementedError(op)
    kern.values[node.output] = sid
    kern.ops.append(node)


def alias_roots(graph) -> dict[int, int]:
    """For every output of a view op (reshape, slice_rows), the tensor whose buffer it shares."""
    root: dict[int, int] = {}
    for node in graph.ops:
        if node.op in VIEW_OPS:
            root[node.output] = root.get(node.inputs[0], node.inputs[0])
    return root


def _can_sink(steps: list, kern: FusedKernel, roots: dict[int, int]) -> bool:
    """True if ``kern`` may move after every step that follows it: none of them reads one
    of its values, and none writes in place (``OpDef.mutates``) a buffer it reads."""
    pos = next(i for i in range(len(steps) - 1, -1, -1) if steps[i] is kern)
    later = steps[pos + 1:]
    if any(tid in kern.values for st in later
           for tid in (st.node.inputs if isinstance(st, LibraryStep) else [i.tid for i in st.inputs])):
        return False
    reads = {roots.get(i.tid, i.tid) for i in kern.inputs}
    written = {roots.get(st.node.inputs[m], st.node.inputs[m]) for st in later
               if isinstance(st, LibraryStep) for m in OPS[st.node.op].mutates}
    return not reads & written


def schedule(graph) -> list:
    """Partition ``graph`` into an ordered list of FusedKernel and LibraryStep.

    The open kernel stays open across library steps that do not read it: an op that
    joins it moves (sinks) the kernel after those steps, so ``silu(x @ Wg) * (x @ Wu)``
    is one kernel after both GEMMs. It never sinks past a step that writes in place a
    buffer the kernel reads (attention's KV cache), which would change what it reads.

    Every kernel output that is read by a later step or is a graph output is recorded in
    ``FusedKernel.outputs``; everything else stays in registers/row buffers.

    A graph with ``runtime_row_width = True`` (the torch.compile front end sets it on graphs
    specialized from symbolic shapes) gets kernels with ``runtime_d``: code generators that
    can (C++) take the row width D as a run-time argument, so one build serves every
    sequence length, not only every row count.
    """
    steps: list = []
    kern: FusedKernel | None = None
    roots = alias_roots(graph)
    for node in graph.ops:
        if OPS[node.op].kind == "library":
            steps.append(LibraryStep(node))
            continue
        kind = _fits(kern, node, graph)
        if kind is not None and steps[-1] is not kern:
            if _can_sink(steps, kern, roots):
                steps.remove(kern)
                steps.append(kern)
            else:
                kind = None
        if kind is None:
            kern = _new_kernel(node, graph)
            if kern is None:
                steps.append(LibraryStep(node))
                continue
            steps.append(kern)
            kind = VEC if graph.tensors[node.output].shape == kern.shape else RS
        _emit(kern, node, graph, kind)
    _mark_outputs(steps, graph)
    if getattr(graph, "runtime_row_width", False):
        for step in steps:
            if isinstance(step, FusedKernel):
                step.runtime_d = True
    return steps


def _mark_outputs(steps: list, graph) -> None:
    needed: set[int] = set(graph.outputs)
    for step in steps:
        if isinstance(step, LibraryStep):
            needed.update(step.node.inputs)
        else:
            needed.update(i.tid for i in step.inputs)
    for step in steps:
        if isinstance(step, FusedKernel):
            for node in step.ops:
                if node.output in needed:
                    step.outputs.append((step.values[node.output], node.output, graph.tensors[node.output].dtype))
