"""The backend conformance suite behind ``yirage test [BACKEND]`` (llama.cpp's
``tests/test-backend-ops.cpp`` for ggml, here for yirage's backends).

``CASES`` holds small kernel graphs at a few odd sizes: every op of the op table
(``yirage.ir.ops.OPS``) and the fused kernels ``transforms/fusion.py`` makes (chains of
elementwise ops and casts, row reductions, softmax, RMSNorm/LayerNorm with their neighbours,
row programs after a GEMM). ``run_case`` builds one on the CPU, runs it on a backend (inputs
copied to its device) and compares every output, and every input the graph writes in place
(the KV caches), with the reference interpreter (``g.interpret``, torch eager) within a
tolerance suited to the outputs' dtype; where the case has one, also with a plain-torch
expectation (``F.gelu``, ``F.linear``, ...) that does not go through the op table. A case
reports PASS, FAIL (the largest error and how many elements are off) or ERROR (the
exception, in one line); ``fallback`` lists its library ops that the backend has no kernel
for, which ran as their torch reference (they pass without testing a kernel).

``run_conformance`` runs the cases on one backend, ``all`` of them, or the default, and,
in a full run, reports a FAIL for every op of ``OPS`` that no case runs and that
``NOT_APPLICABLE`` does not excuse: a new op without a case fails the suite.
tests/backends/test_ops.py runs the same ``CASES`` under pytest on every backend present.

This module must never loosen a tolerance for one backend, skip a case silently, or hand the
reference's result off as the backend's: what it reports is what the backend computed.
"""
from __future__ import annotations

import contextlib
import functools
import math
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Callable, Iterable

import torch
import torch.nn.functional as F

from ..backends import Backend, get_available_backends, get_backend, get_backend_impl, resolve_backend
from ..dtypes import DType
from ..ir import threadblock  # noqa: F401  (registers the 'customized' op in OPS)
from ..ir.ops import OPS, PLAIN_TYPES, dequantize, to_row_groups
from ..kernel import KNGraph, new_kernel_graph
from ..transforms.fusion import VIEW_OPS, LibraryStep

#: (atol, rtol) by output dtype: float32 rounding, and the half types' mantissas (10 and 7 bits)
#: through a few roundings. Integer outputs (argmax) are exact. A case may name its own.
TOLERANCES = {DType.float32: (1e-5, 1e-5), DType.float16: (2e-3, 2e-3), DType.bfloat16: (2e-2, 2e-2)}

#: ops of OPS that no case can run, with the reason (none today: every op has a case)
NOT_APPLICABLE: dict[str, str] = {}

#: (graph, CPU inputs, {output index: what plain torch computes for it})
Built = tuple[KNGraph, list[torch.Tensor], dict[int, torch.Tensor]]


@dataclass(frozen=True)
class Case:
    """One conformance case.

    ``op``: the op it is about (a name of ``OPS``) or ``fused: ...`` for a fused pattern;
    ``name``: its sizes and dtypes, unique within ``op``; ``build() -> Built``: the graph, its
    CPU inputs (drawn from torch's RNG, which ``run_case`` seeds) and plain-torch expectations
    for some outputs; ``tol``: (atol, rtol), None for ``TOLERANCES`` of the outputs' dtypes.
    An element passes when ``|got - want| <= atol + rtol * |want|`` (torch.isclose).
    """

    op: str
    name: str
    build: Callable[[], Built]
    tol: tuple[float, float] | None = None

    @property
    def id(self) -> str:
        """``op/name``, what ``-k`` matches and pytest shows."""
        return f"{self.op}/{self.name}"


@dataclass
class CaseResult:
    """The outcome of one case on one backend: ``status`` PASS, FAIL or ERROR; ``max_error`` the
    largest absolute difference (None when nothing was compared); ``message`` what failed (one
    line); ``fallback`` the library ops that ran as their torch reference; ``seconds`` wall time
    (graph compile included)."""

    op: str
    case: str
    backend: str
    status: str
    atol: float
    rtol: float
    max_error: float | None = None
    message: str = ""
    fallback: tuple[str, ...] = ()
    seconds: float = 0.0

    def to_dict(self) -> dict:
        """A JSON-ready dict of the fields (an infinite max_error becomes None)."""
        data = asdict(self)
        if data["max_error"] is not None and not math.isfinite(data["max_error"]):
            data["max_error"] = None
        data["fallback"] = list(self.fallback)
        return data


# ---- comparing --------------------------------------------------------------------------------

def compare(got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float) -> tuple[float, str | None]:
    """(largest absolute error, None when every element is close else what is off) of ``got``
    against ``want`` (CPU tensors). Equal infinities and NaN against NaN count as equal; a NaN
    or infinity against a number counts as an infinite error."""
    if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
        return math.inf, (f"shape {tuple(got.shape)} {got.dtype} where the reference has "
                          f"{tuple(want.shape)} {want.dtype}")
    if got.numel() == 0:
        return 0.0, None
    g, w = got.double(), want.double()
    err = torch.where((g == w) | (g.isnan() & w.isnan()), 0.0, (g - w).abs()).nan_to_num(nan=math.inf)
    bad = err > atol + rtol * w.abs().nan_to_num(nan=0.0, posinf=0.0)
    worst = float(err.max())
    if not bool(bad.any()):
        return worst, None
    at = tuple(int(i) for i in torch.unravel_index(err.argmax(), err.shape))
    return worst, (f"{int(bad.sum())} of {err.numel()} elements off (largest error {worst:.3g} at {at}: "
                   f"got {float(g[at]):.6g}, expected {float(w[at]):.6g})")


def _one_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {' '.join(str(error).split())}"


def _tolerance(case: Case, graph: KNGraph) -> tuple[float, float]:
    if case.tol is not None:
        return case.tol
    dtypes = [graph.tensors[t].dtype for t in graph.outputs]
    tols = [TOLERANCES[d] for d in dtypes if d in TOLERANCES] or [(0.0, 0.0)]
    return max(t[0] for t in tols), max(t[1] for t in tols)


def _written_inputs(graph: KNGraph) -> list[int]:
    """Positions of the graph inputs that some op writes in place (OpDef.mutates)."""
    tids = {node.inputs[m] for node in graph.ops for m in OPS[node.op].mutates}
    return [i for i, tid in enumerate(graph.inputs) if tid in tids]


def _fallback_ops(graph: KNGraph, backend: Backend) -> tuple[str, ...]:
    """Library ops of ``graph`` that ``backend`` has no kernel for (the executor runs their
    torch reference): what a PASS of this case does not test there."""
    impl, cg = get_backend_impl(backend), graph.compile(backend.value)
    # the compiled graph's own nodes and tensors: the layout and merge passes rewrite the graph
    return tuple(sorted({s.node.op for s in cg.steps if isinstance(s, LibraryStep)
                         and s.node.op not in VIEW_OPS and not impl.supports(s.node, cg.graph)}))


# ---- running ----------------------------------------------------------------------------------

@contextlib.contextmanager
def ieee_float32():
    """float32 GEMMs and convolutions in IEEE float32 inside the block, TF32 off for both
    (torch's default turns it on for cuDNN's convolutions, whose 10-bit mantissa puts a
    40-channel convolution's sums about 1e-3 from float32's). The conformance cases check
    float32 semantics, so yirage's choice of torch's cuDNN convolution must compute them too;
    the previous settings are restored on exit (a process-wide setting: not for concurrent
    callers that want TF32)."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def _run_on_backend(graph: KNGraph, inputs: list[torch.Tensor], backend: Backend) -> list[torch.Tensor]:
    """The graph's outputs, then the inputs it writes in place, computed on ``backend`` from
    copies of ``inputs`` on its device, in IEEE float32 (``ieee_float32``); returned on the CPU."""
    dev = get_backend_impl(backend).torch_device
    on_device = [x.to(dev, copy=True) for x in inputs]
    with warnings.catch_warnings(), ieee_float32():
        # Triton's interpreter computes the padded lanes of a block too (exp(-inf - -inf), 1/0) and
        # numpy warns; those lanes are never stored, and what is stored is compared below
        warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"triton\.runtime\.interpreter")
        outs = graph(inputs=on_device, backend=backend.value)
    return [t.cpu() for t in (*outs, *(on_device[i] for i in _written_inputs(graph)))]


def _reference(graph: KNGraph, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The same as ``_run_on_backend`` from the reference interpreter, on copies of ``inputs``."""
    copies = [x.clone() for x in inputs]
    outs = graph.interpret(copies)
    return [*outs, *(copies[i] for i in _written_inputs(graph))]


def _check(got: list[torch.Tensor], want: list[torch.Tensor], expect: dict[int, torch.Tensor],
           n_outputs: int, tol: tuple[float, float]) -> tuple[float, str | None]:
    """Compare every output and written input with the reference, then the outputs that have a
    plain-torch expectation with it: (largest error, the first failure or None)."""
    names = [f"output {i}" for i in range(n_outputs)] + [f"written input {i}" for i in range(len(got) - n_outputs)]
    pairs = [(n, g, w) for n, g, w in zip(names, got, want)]
    pairs += [(f"output {i} against plain torch", got[i], e) for i, e in expect.items()]
    worst, failure = 0.0, None
    for name, g, w in pairs:
        err, problem = compare(g, w, *tol)
        worst = max(worst, err)
        if problem and failure is None:
            failure = f"{name}: {problem}"
    return worst, failure


def run_case(case: Case, backend: str | Backend) -> CaseResult:
    """Run ``case`` on ``backend`` (a name or Backend; must be available) and compare it with the
    reference interpreter. Inputs come from torch's RNG seeded with 0 inside
    ``torch.random.fork_rng``, so the caller's RNG state is left as it was.

    Raises:
        BackendUnavailableError: ``backend`` is unknown or unavailable here. Anything the
        backend or the reference raises is reported as an ERROR result instead.
    """
    b = resolve_backend(backend)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        graph, inputs, expect = case.build()
    atol, rtol = _tolerance(case, graph)
    result = CaseResult(case.op, case.name, b.value, "ERROR", atol, rtol)
    start = time.perf_counter()
    try:
        result.fallback = _fallback_ops(graph, b)
        got = _run_on_backend(graph, inputs, b)
    except Exception as error:  # a kernel that raises is a result of the suite, not its end
        result.message = _one_line(error)
    else:
        try:
            want = _reference(graph, inputs)
        except Exception as error:
            result.message = f"the reference interpreter failed: {_one_line(error)}"
        else:
            result.max_error, failure = _check(got, want, expect, len(graph.outputs), (atol, rtol))
            result.status, result.message = ("FAIL", failure) if failure else ("PASS", "")
    result.seconds = time.perf_counter() - start
    return result


def conformance_backends(name: str | Backend | None = None) -> list[Backend]:
    """The backends ``run_conformance`` runs on for ``name``: None -> the default backend
    (``yr.get_backend()``), 'all' -> every available backend, else the named one ('auto' too).

    Raises:
        BackendUnavailableError: an unknown or unavailable backend.
        ConfigError: the default is asked for and the user config file is unusable.
    """
    if name is None:
        return [get_backend()]
    if isinstance(name, str) and name.strip().lower() == "all":
        return get_available_backends()
    return [resolve_backend(name)]


def select_cases(select: str | None = None) -> list[Case]:
    """The cases whose id (``op/name``) contains ``select`` (case-insensitive); all for None."""
    if not select:
        return list(CASES)
    return [c for c in CASES if select.lower() in c.id.lower()]


@functools.lru_cache(maxsize=1)
def covered_ops() -> frozenset[str]:
    """Every op that some case's graph contains."""
    with torch.random.fork_rng(devices=[]):
        return frozenset(node.op for case in CASES for node in case.build()[0].ops)


def coverage_failures() -> list[CaseResult]:
    """A FAIL for each op of ``OPS`` that no case runs and ``NOT_APPLICABLE`` does not list."""
    missing = sorted(set(OPS) - covered_ops() - set(NOT_APPLICABLE))
    return [CaseResult(op, "coverage", "-", "FAIL", 0.0, 0.0,
                       message=f"no conformance case runs op {op!r}: add one to CASES in yirage/tools/"
                               "conformance.py, or list it in NOT_APPLICABLE with the reason")
            for op in missing]


def run_conformance(backend: str | Backend | None = None, select: str | None = None,
                    on_result: Callable[[CaseResult], None] | None = None) -> list[CaseResult]:
    """Run the suite: every case of ``select_cases(select)`` on every backend of
    ``conformance_backends(backend)``, in order; ``on_result`` is called with each result as it
    comes (for progress). A full run (``select`` None) starts with ``coverage_failures()``.

    Returns the results (a case that fails or raises is a result, never an exception).

    Raises:
        BackendUnavailableError: an unknown or unavailable backend (before any case runs).
        ConfigError: the default backend is asked for and the user config file is unusable.
    """
    backends = conformance_backends(backend)
    results = []
    for result in coverage_failures() if not select else []:
        results.append(result)
        if on_result:
            on_result(result)
    for b in backends:
        for case in select_cases(select):
            results.append(run_case(case, b))
            if on_result:
                on_result(results[-1])
    return results


# ---- the cases --------------------------------------------------------------------------------
# Sizes: one element, a small odd square, and a row longer than any vector block (4097).

SIZES = [(1, 1), (7, 7), (3, 4097)]


def _dims(shape) -> str:
    return "x".join(map(str, shape))


def _one_op(op: str, shapes, make_inputs: Callable[[], list[torch.Tensor]], attrs: Callable[[], dict] | None = None,
            expect: Callable | None = None) -> Callable[[], Built]:
    """A builder: ``op`` (a builder method of the graph) applied to new inputs of ``shapes``."""
    def build():
        g = new_kernel_graph()
        ins = [g.new_input(s) for s in shapes]
        g.mark_output(getattr(g, op)(*ins, **(attrs() if attrs else {})))
        data = make_inputs()
        return g, data, {0: expect(*data)} if expect else {}
    return build


#: plain-torch meaning of each unary op (its keys are the unary ops the cases run)
_TORCH_UNARY = {
    "exp": torch.exp, "sqrt": torch.sqrt, "square": torch.square, "silu": F.silu, "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": torch.relu, "rsqrt": torch.rsqrt,
    "neg": torch.neg, "tanh": torch.tanh, "sigmoid": torch.sigmoid, "erf": torch.erf, "log": torch.log,
    "exp2": torch.exp2, "abs": torch.abs, "reciprocal": torch.reciprocal, "cos": torch.cos, "sin": torch.sin,
    "floor": torch.floor, "ceil": torch.ceil, "trunc": torch.trunc,
}


def _unary_cases() -> list[Case]:
    def data(op, shape):
        positive = op in ("sqrt", "rsqrt", "log", "reciprocal")
        return lambda: [torch.rand(shape) + 0.1 if positive else torch.randn(shape)]
    return [Case(op, _dims(s), _one_op(op, [s], data(op, s), expect=f)) for op, f in _TORCH_UNARY.items()
            for s in SIZES]


_BROADCASTS = [((7, 33), (7, 33)), ((7, 33), (33,)), ((7, 33), (7, 1)), ((7, 33), (1,)), ((7, 1), (7, 33)),
               ((2, 3, 5), (3, 1)), ((1, 4097), (1, 4097)), ((4, 1, 6), (1, 5, 6))]


def _binary_cases() -> list[Case]:
    def data(a, b):
        return lambda: [torch.randn(a), torch.rand(b) + 0.5]  # the divisor kept away from 0
    return [Case(op, f"{_dims(a)},{_dims(b)}", _one_op(op, [a, b], data(a, b), expect=getattr(torch, op)))
            for op in ("add", "sub", "mul", "div") for a, b in _BROADCASTS]


def _typed(op: str, specs, data: list[torch.Tensor], expect: Callable | None = None, **attrs) -> Built:
    """``op`` (a builder method) applied to new inputs of (shape, DType) ``specs`` holding ``data``."""
    g = new_kernel_graph()
    g.mark_output(getattr(g, op)(*[g.new_input(shape, d) for shape, d in specs], **attrs))
    return g, data, {0: expect(*data)} if expect else {}


_HALF_AND_FLOAT = (DType.float32, DType.float16, DType.bfloat16)


def _minmax_pow_cases() -> list[Case]:
    """maximum/minimum (NaN propagates), pow with a tensor exponent (negative bases with integer
    exponents, NaN with others) and with a scalar one."""
    def minmax(op, a, b, d):
        def build():
            x, y = torch.randn(a), torch.randn(b)
            x.view(-1)[0] = math.nan   # NaN wins in torch.maximum / minimum
            x, y = x.to(d.torch_dtype), y.to(d.torch_dtype)
            return _typed(op, [(a, d), (b, d)], [x, y], getattr(torch, op))
        return build

    def pow_tensor(a, b, d):
        def build():
            x = torch.randn(a).to(d.torch_dtype)
            e = torch.randint(-3, 4, b).float()
            e.view(-1)[-1] = 0.5      # a non-integer exponent: NaN for a negative base
            return _typed("pow", [(a, d), (b, d)], [x, e.to(d.torch_dtype)], torch.pow)
        return build

    def pow_scalar(shape, exponent, positive):
        def build():
            x = torch.rand(shape) + 0.5 if positive else torch.randn(shape)
            return _typed("pow", [(shape, DType.float32)], [x], lambda t: torch.pow(t, exponent), exponent=exponent)
        return build

    cases = [Case(op, f"{_dims(a)},{_dims(b)} {d.value}", minmax(op, a, b, d))
             for op in ("maximum", "minimum") for a, b in [((7, 33), (33,)), ((3, 4097), (3, 1)), ((1, 1), (1,))]
             for d in _HALF_AND_FLOAT]
    cases += [Case("pow", f"{_dims(a)},{_dims(b)} {d.value}", pow_tensor(a, b, d), tol=(1e-4, 1e-4))
              for a, b in [((7, 33), (33,)), ((2, 3, 5), (3, 1))] for d in _HALF_AND_FLOAT]
    cases += [Case("pow_scalar", f"{_dims(s)} ** {e}", pow_scalar(s, e, pos), tol=(1e-5, 1e-4))
              for s, e, pos in [((7, 33), 2.0, False), ((7, 33), 3.0, False), ((3, 4097), 0.5, True),
                                ((1, 1), -1.5, True)]]
    return cases


def _bool_cases() -> list[Case]:
    """Comparisons (ties included), logical ops, where and casts to and from bool."""
    def ints(shape, d):  # small integers: equal elements are common
        return torch.randint(-2, 3, shape).to(d.torch_dtype)

    def compare(op, a, b, d):
        def build():
            if d == DType.bool:
                x, y = torch.randn(a) > 0, torch.randn(b) > 0
            else:
                x, y = ints(a, d), ints(b, d)
                x.view(-1)[0] = math.nan  # NaN compares unequal to everything
            return _typed(op, [(a, d), (b, d)], [x, y], getattr(torch, op))
        return build

    def logical(op, shapes):
        def build():
            data = [torch.randn(s) > 0 for s in shapes]
            return _typed(op, [(s, DType.bool) for s in shapes], data, getattr(torch, op))
        return build

    def where(c, a, b, d):
        def build():
            make = (lambda s: torch.randn(s) > 0) if d == DType.bool else (lambda s: torch.randn(s).to(d.torch_dtype))
            data = [torch.randn(c) > 0, make(a), make(b)]
            return _typed("where", [(c, DType.bool), (a, d), (b, d)], data, torch.where)
        return build

    def casts(d):
        def build():
            g = new_kernel_graph()
            x = g.new_input((7, 33), d)
            m = g.cast(x, DType.bool)
            g.mark_output(m)
            g.mark_output(g.cast(m, d))
            g.mark_output(g.cast(g.gt(x, x), DType.float32))
            data = ints((7, 33), d)
            return g, [data], {0: data != 0, 1: (data != 0).to(d.torch_dtype)}
        return build

    cases = [Case(op, f"{_dims(a)},{_dims(b)} {d.value}", compare(op, a, b, d))
             for op in ("eq", "ne", "lt", "le", "gt", "ge") for a, b in [((7, 33), (33,)), ((3, 4097), (3, 1))]
             for d in _HALF_AND_FLOAT]
    cases += [Case(op, "7x33,7x1 bool", compare(op, (7, 33), (7, 1), DType.bool)) for op in ("eq", "ne")]
    cases += [Case(op, ",".join(map(_dims, shapes)), logical(op, shapes))
              for op, shapes in [("logical_and", [(7, 33), (33,)]), ("logical_or", [(3, 4097), (3, 1)]),
                                 ("logical_not", [(7, 33)]), ("logical_not", [(1, 1)])]]
    cases += [Case("where", f"{_dims(c)},{_dims(a)},{_dims(b)} {d.value}", where(c, a, b, d))
              for c, a, b in [((7, 33), (7, 33), (7, 33)), ((7, 1), (33,), (7, 33)), ((3, 4097), (1,), (3, 1))]
              for d in (*_HALF_AND_FLOAT, DType.bool)]
    cases += [Case("cast", f"{d.value}<->bool", casts(d)) for d in _HALF_AND_FLOAT]
    return cases


def _new_elementwise_fused(dtype: DType) -> Built:
    """tanh, sigmoid, erf, log, exp2, abs, reciprocal, pow and a mask in one kernel, in ``dtype``."""
    g = new_kernel_graph()
    x, y = g.new_input((5, 67), dtype), g.new_input((67,), dtype)
    a = g.mul(g.tanh(x), g.sigmoid(y))
    b = g.add(g.erf(x), g.log(g.add(g.abs(x), g.exp2(y))))
    c = g.where(g.lt(a, b), g.reciprocal(g.add(g.abs(b), g.abs(a))), g.pow(g.abs(x), 1.5))
    g.mark_output(c)
    g.mark_output(g.softmax(g.minimum(c, g.maximum(a, b)), -1))
    return g, [torch.randn(5, 67).to(dtype.torch_dtype), torch.randn(67).to(dtype.torch_dtype)], {}


def _elementwise_attr_cases() -> list[Case]:
    cases = []
    for s in SIZES:
        cases.append(Case("clamp", _dims(s), _one_op("clamp", [s], lambda s=s: [torch.randn(s)],
                                                     attrs=lambda: {"min_val": -0.5, "max_val": 0.25},
                                                     expect=lambda x: x.clamp(-0.5, 0.25))))
        cases.append(Case("scale", _dims(s), _one_op("scale", [s], lambda s=s: [torch.randn(s)],
                                                     attrs=lambda: {"factor": 3.0}, expect=lambda x: x * 3.0)))
    return cases


def _cast(src: DType, dst: DType) -> Built:
    """exp, cast, add in one kernel; a reduction cast after it."""
    g = new_kernel_graph()
    x = g.new_input((7, 33), src)
    y = g.cast(g.exp(x), dst)
    g.mark_output(g.add(y, y))
    g.mark_output(g.cast(g.reduction(x, 1), dst))
    return g, [torch.randn(7, 33).to(src.torch_dtype)], {}


def _cast_from_int(src: DType, dst: DType) -> Built:
    """An integer tensor (an attention mask, ids) cast to ``dst`` in a fused kernel, used by
    arithmetic after it: values past float32's exact range round as torch's ``.to()`` does."""
    g = new_kernel_graph()
    x = g.new_input((3, 7), src)
    y = g.cast(x, dst)
    g.mark_output(y if dst == DType.bool else g.mul(y, y))
    xf = g.cast(x, DType.float32)
    g.mark_output(g.where(g.cast(x, DType.bool), g.scale(xf, 2.0), g.neg(xf)))
    big = 2 ** 40 + 1 if src == DType.int64 else 2 ** 30 + 1
    data = torch.randint(-3, 4, (3, 7), dtype=src.torch_dtype)
    data[0, :3] = torch.tensor([big, -big, 16777217])
    want_y = data.to(dst.torch_dtype)
    want = want_y if dst == DType.bool else (want_y.float() * want_y.float()).to(dst.torch_dtype)
    return g, [data], {0: want, 1: torch.where(data != 0, data.float() * 2.0, -data.float())}


def _cast_cases() -> list[Case]:
    # from float32 the cast is the same rounding as torch's .to(); from a half type the reference
    # rounds exp's result to that type first, the fused kernel keeps float32
    pairs = [(DType.float32, DType.float16), (DType.float32, DType.bfloat16), (DType.bfloat16, DType.float32),
             (DType.float16, DType.bfloat16)]
    return [Case("cast", f"{s.value}->{d.value}", functools.partial(_cast, s, d),
                 tol=(0.0, 0.0) if s == DType.float32 else (1e-2, 1e-2)) for s, d in pairs] + [
        Case("cast", f"{s.value}->{d.value}", functools.partial(_cast_from_int, s, d), tol=(0.0, 0.0))
        for s in (DType.int64, DType.int32) for d in (DType.bool, DType.float32)]


def _rows(op: str, R: int, D: int) -> Built:
    """A row op at both ends of a 2-d tensor (reduction and softmax over dim 1 and 0)."""
    g = new_kernel_graph()
    x = g.new_input((R, D))
    data = torch.randn(R, D)
    if op == "rms_norm":
        g.mark_output(g.rms_norm(x, (D,)))
        return g, [data], {0: F.rms_norm(data, (D,), eps=1e-6)}
    g.mark_output(getattr(g, op)(x, 1))
    g.mark_output(getattr(g, op)(x, 0))
    if op == "reduction":
        return g, [data], {0: data.sum(1, keepdim=True), 1: data.sum(0, keepdim=True)}
    return g, [data], {0: torch.softmax(data, 1), 1: torch.softmax(data, 0)}


def _rms_norm_3d() -> Built:
    g = new_kernel_graph()
    x = g.new_input((2, 3, 5, 8))
    g.mark_output(g.rms_norm(x, (5, 8), eps=1e-5))
    data = torch.randn(2, 3, 5, 8)
    return g, [data], {0: F.rms_norm(data, (5, 8), eps=1e-5)}


def _layer_norm(shape, normalized, affine: bool) -> Built:
    g = new_kernel_graph()
    x = g.new_input(shape)
    w, b = (g.new_input(normalized), g.new_input(normalized)) if affine else (None, None)
    g.mark_output(g.layer_norm(x, normalized, w, b, eps=1e-5))
    data = [torch.randn(shape)] + ([torch.randn(normalized), torch.randn(normalized)] if affine else [])
    return g, data, {0: F.layer_norm(data[0], normalized, *data[1:], eps=1e-5)}


def _any_dim(op: str, shape, dim, keepdim: bool, dtype: DType, **attrs) -> Built:
    """One any-dim reduction (or softmax/log_softmax when ``keepdim`` is None) of a ``dtype`` input
    with a NaN in its first element for amax/amin (it must win)."""
    g = new_kernel_graph()
    x = g.new_input(shape, dtype)
    data = torch.randn(shape)
    if op in ("amax", "amin"):
        data.view(-1)[0] = math.nan
    data = data.to(dtype.torch_dtype)
    if keepdim is None:
        g.mark_output(getattr(g, op)(x, dim))
        return g, [data], {0: getattr(torch, op)(data.float(), dim).to(dtype.torch_dtype)}
    g.mark_output(getattr(g, op)(x, dim, keepdim=keepdim, **attrs))
    f = getattr(torch, op)
    with warnings.catch_warnings():  # var over one element (N - correction = 0): NaN, as asked
        warnings.filterwarnings("ignore", message="var\\(\\): degrees of freedom")
        want = (f(data.float(), dim=dim, keepdim=keepdim, **attrs) if dim is not None
                else f(data.float(), **attrs) if op == "var" else f(data.float()))
    return g, [data], {0: want.to(dtype.torch_dtype)}


def _any_dim_cases() -> list[Case]:
    part = functools.partial
    cases = []
    for op in ("sum", "mean", "amax", "amin", "var"):
        for shape, dim, keep in [((7, 33), 0, True), ((7, 33), 1, False), ((2, 3, 5, 8), (1, 2), False),
                                 ((2, 3, 5, 8), (-2, -1), True), ((3, 4097), -1, True), ((5, 1, 3), 1, False),
                                 ((4, 7, 9), None, False)]:
            for d in _HALF_AND_FLOAT if shape == (7, 33) else (DType.float32,):
                attrs = {"correction": 0 if dim == 0 else 1} if op == "var" else {}
                cases.append(Case(op, f"{_dims(shape)} dim={dim} keepdim={keep} {d.value}",
                                  part(_any_dim, op, shape, dim, keep, d, **attrs), tol=(1e-4, 1e-4)
                                  if d == DType.float32 else None))
    cases += [Case("fused: group_norm", f"{_dims(s)} groups={G}{' affine' if a else ''} {d.value}",
                   part(_group_norm, s, G, a, d), tol=(1e-4, 1e-4) if d == DType.float32 else (2e-2, 2e-2))
              for s, G, a, d in [((2, 6, 5, 7), 3, True, DType.float32), ((3, 4), 2, False, DType.float32),
                                 ((1, 8, 33), 8, True, DType.float32), ((2, 6, 5, 7), 2, True, DType.float16),
                                 ((2, 6, 5, 7), 6, True, DType.bfloat16)]]
    cases += [Case("cumsum", f"{_dims(s)} dim={dim} {d.value}", part(_cumsum, s, dim, d),
                   tol=(0.0, 0.0) if not d.is_float else (1e-5, 1e-5) if d == DType.float32 else (2e-2, 2e-2))
              for s, dim, d in [((7, 33), -1, DType.int64), ((2, 9, 3), 1, DType.int32), ((5, 6), 0, DType.bool),
                                ((3, 300), 1, DType.float32), ((4, 5, 3), 0, DType.float32),
                                ((2, 40), 1, DType.bfloat16), ((2, 40), 1, DType.float16)]]
    for op in ("softmax", "log_softmax"):
        for shape, dim in [((7, 33), 0), ((7, 33), -1), ((2, 3, 5, 8), 1), ((3, 4097), 0)]:
            for d in _HALF_AND_FLOAT if shape == (7, 33) else (DType.float32,):
                cases.append(Case(op, f"{_dims(shape)} dim={dim} {d.value}", part(_any_dim, op, shape, dim, None, d),
                                  tol=(1e-4, 1e-4) if d == DType.float32 else None))
    return cases


def _cumsum(shape, dim: int, dtype: DType) -> Built:
    """cumsum along ``dim`` of a float, bool or integer tensor (integers and bool into int64)."""
    g = new_kernel_graph()
    g.mark_output(g.cumsum(g.new_input(shape, dtype), dim))
    data = _data(shape, dtype)
    if dtype == DType.int64:
        data.view(-1)[0] = 2 ** 62   # int64 sums stay exact (wrapping as torch's)
    return g, [data], {0: torch.cumsum(data, dim)}


def _group_norm(shape, groups: int, affine: bool, dtype: DType) -> Built:
    """group_norm (a builder composite: reshape, layer_norm, reshape, mul, add) against F.group_norm."""
    g = new_kernel_graph()
    C = shape[1]
    x = g.new_input(shape, dtype)
    w, b = (g.new_input((C,), dtype), g.new_input((C,), dtype)) if affine else (None, None)
    g.mark_output(g.group_norm(x, groups, w, b, eps=1e-5))
    td = dtype.torch_dtype
    data = [torch.randn(shape).to(td)] + ([torch.randn(C).to(td), torch.randn(C).to(td)] if affine else [])
    want = F.group_norm(data[0].float(), groups, *[t.float() for t in data[1:]], eps=1e-5).to(td)
    return g, data, {0: want}


def _data(shape, dtype: DType) -> torch.Tensor:
    """Random values of ``dtype``: normals (float), a random mask (bool), -50..49 (integers)."""
    if dtype == DType.bool:
        return torch.randn(shape) > 0
    if dtype.is_float:
        return torch.randn(shape).to(dtype.torch_dtype)
    return torch.randint(-50, 50, shape, dtype=dtype.torch_dtype)


def _layout(op: str, shapes, dtype: DType, torch_fn: Callable, *args, **kwargs) -> Built:
    """One layout op over inputs of ``shapes`` (``cat`` takes them as a list) against ``torch_fn``."""
    g = new_kernel_graph()
    xs = [g.new_input(s, dtype) for s in shapes]
    g.mark_output(getattr(g, op)(xs if op == "cat" else xs[0], *args, **kwargs))
    data = [_data(s, dtype) for s in shapes]
    return g, data, {0: torch_fn(*data).contiguous()}


_LAYOUT_DTYPES = (DType.float32, DType.float16, DType.bfloat16, DType.bool, DType.int64, DType.int32)


def _layout_cases() -> list[Case]:
    part = functools.partial
    specs = [  # (op in OPS, builder method, shapes, its args, torch)
        ("permute", "permute", [(2, 3, 5)], ((2, 0, 1),), lambda x: x.permute(2, 0, 1)),
        ("permute", "permute", [(2, 3, 5, 7)], ((0, 2, 1, -1),), lambda x: x.permute(0, 2, 1, 3)),
        ("permute", "transpose", [(7, 33)], (0, 1), lambda x: x.t()),
        ("expand", "expand", [(3, 1)], ((2, 3, 33),), lambda x: x.expand(2, 3, 33)),
        ("expand", "expand", [(1, 5)], ((-1, 5),), lambda x: x.expand(-1, 5)),
        ("expand", "broadcast_to", [(4, 1, 6)], ((4, 5, 6),), lambda x: x.expand(4, 5, 6)),
        ("slice", "slice", [(7, 33)], (1, 3, 30, 2), lambda x: x[:, 3:30:2]),
        ("slice", "slice", [(9, 4, 5)], (0, -4, None), lambda x: x[-4:]),
        ("slice", "slice", [(3, 4097)], (-1, 1, 4097, 7), lambda x: x[:, 1::7]),
        ("select", "select", [(7, 33)], (1, -1), lambda x: x[:, -1]),
        ("select", "select", [(2, 3, 5)], (1, 2), lambda x: x[:, 2]),
        ("select", "select", [(5,)], (0, 3), lambda x: x[3]),
        ("cat", "cat", [(2, 5), (3, 5), (1, 5)], (0,), lambda *xs: torch.cat(xs, 0)),
        ("cat", "cat", [(2, 3, 4), (2, 1, 4)], (1,), lambda *xs: torch.cat(xs, 1)),
        ("cat", "cat", [(3, 4097), (3, 2)], (-1,), lambda *xs: torch.cat(xs, -1)),
        ("pad", "pad", [(2, 3, 5)], ([(0, 0), (1, 2), (0, 1)], 0.0), lambda x: F.pad(x, (0, 1, 1, 2))),
        ("pad", "pad", [(1, 4, 9, 7)], ([(0, 0), (0, 0), (0, 1), (0, 1)], -1.5),
         lambda x: F.pad(x, (0, 1, 0, 1), value=-1.5)),
    ]
    cases = []
    for op, method, shapes, args, fn in specs:
        for d in _LAYOUT_DTYPES if shapes[0] in ((2, 3, 5), (7, 33), (2, 5)) else (DType.float32,):
            name = f"{method} {'+'.join(map(_dims, shapes))} {args} {d.value}"
            cases.append(Case(op, name, part(_layout, method, shapes, d, fn, *args), tol=(0.0, 0.0)))
    return cases


def _indexing(op: str, shape, dim: int, index_shape, dtype: DType) -> Built:
    """``index_select`` (1-d index) or ``gather`` (an index of x's rank) of x [shape] along ``dim``
    with random in-range indices (repeats included) against torch."""
    g = new_kernel_graph()
    x, i = g.new_input(shape, dtype), g.new_input(index_shape, DType.int64)
    g.mark_output(getattr(g, op)(x, dim, i))
    data = [_data(shape, dtype), torch.randint(0, shape[dim], index_shape)]
    fn = torch.index_select if op == "index_select" else torch.gather
    return g, data, {0: fn(data[0], dim, data[1])}


def _indexing_cases() -> list[Case]:
    part = functools.partial
    specs = [  # (op, x shape, dim, index shape)
        ("index_select", (7, 33), 0, (5,)),
        ("index_select", (7, 33), -1, (40,)),
        ("index_select", (3, 5, 9), 1, (1,)),
        ("index_select", (3, 4097), 1, (3,)),
        ("gather", (7, 33), 1, (7, 5)),
        ("gather", (7, 33), 0, (11, 33)),
        ("gather", (3, 5, 9), 1, (2, 4, 9)),
        ("gather", (3, 5, 9), -1, (3, 5, 1)),
    ]
    cases = []
    for op, shape, dim, ishape in specs:
        for d in _LAYOUT_DTYPES if shape == (7, 33) else (DType.float32,):
            name = f"{_dims(shape)} dim {dim} index {_dims(ishape)} {d.value}"
            cases.append(Case(op, name, part(_indexing, op, shape, dim, ishape, d), tol=(0.0, 0.0)))
    return cases


def _row_cases() -> list[Case]:
    cases = [Case(op, _dims((R, D)), functools.partial(_rows, op, R, D), tol=(1e-4, 1e-4))
             for op in ("reduction", "rms_norm", "softmax") for R, D in SIZES]
    cases.append(Case("rms_norm", "2x3x5x8 over 5x8", _rms_norm_3d))
    cases += [Case("layer_norm", f"{_dims(s)}{' affine' if a else ''}", functools.partial(_layer_norm, s, n, a),
                   tol=(1e-4, 1e-4))
              for s, n, a in [((1, 1), (1,), True), ((7, 33), (33,), True), ((3, 4097), (4097,), False),
                              ((2, 3, 5, 8), (5, 8), True)]]
    return cases


# ---- fused patterns ---------------------------------------------------------------------------

def _norm_silu_softmax(dtype: DType) -> Built:
    """silu(rms_norm(x) * w) and its softmax: one kernel, in a half type."""
    g = new_kernel_graph()
    x, w = g.new_input((7, 129), dtype), g.new_input((129,), dtype)
    y = g.silu(g.mul(g.rms_norm(x, (129,)), w))
    g.mark_output(y)
    g.mark_output(g.softmax(y, -1))
    return g, [torch.randn(7, 129).to(dtype.torch_dtype), torch.randn(129).to(dtype.torch_dtype)], {}


def _residual_layer_norm_gelu() -> Built:
    """BERT's layer_norm(x + residual) * w + b, then GELU (tanh): one kernel."""
    g = new_kernel_graph()
    x, r, w, b = g.new_input((5, 96)), g.new_input((5, 96)), g.new_input((96,)), g.new_input((96,))
    g.mark_output(g.gelu_tanh(g.layer_norm(g.add(x, r), (96,), w, b)))
    data = [torch.randn(5, 96), torch.randn(5, 96), torch.randn(96), torch.randn(96)]
    want = F.gelu(F.layer_norm(data[0] + data[1], (96,), data[2], data[3]), approximate="tanh")
    return g, data, {0: want}


def _elementwise_chain() -> Built:
    """clamp(square(silu(x) * y - b) / c, ...) with broadcast row and column inputs."""
    g = new_kernel_graph()
    x, y, b, c = g.new_input((9, 65)), g.new_input((9, 65)), g.new_input((65,)), g.new_input((9, 1))
    g.mark_output(g.clamp(g.div(g.square(g.sub(g.mul(g.silu(x), y), b)), c), -2.0, 3.0))
    data = [torch.randn(9, 65), torch.randn(9, 65), torch.randn(65), torch.rand(9, 1) + 0.5]
    x_, y_, b_, c_ = data
    return g, data, {0: ((F.silu(x_) * y_ - b_).square() / c_).clamp(-2.0, 3.0)}


def _gated_mlp_epilogue() -> Built:
    """silu(x @ W1) * (x @ W3): the row kernel sinks after both GEMMs."""
    g = new_kernel_graph()
    x, w1, w3 = g.new_input((7, 45)), g.new_input((45, 27)), g.new_input((45, 27))
    g.mark_output(g.mul(g.silu(g.matmul(x, w1)), g.matmul(x, w3)))
    data = [torch.randn(7, 45), torch.randn(45, 27), torch.randn(45, 27)]
    return g, data, {0: F.silu(data[0] @ data[1]) * (data[0] @ data[2])}


def _scores_softmax() -> Built:
    """softmax(scale(q k^T)) v, batched over heads: GEMM, row kernel, GEMM."""
    g = new_kernel_graph()
    q, kt, v = g.new_input((3, 5, 16)), g.new_input((3, 16, 11)), g.new_input((3, 11, 16))
    g.mark_output(g.matmul(g.softmax(g.scale(g.matmul(q, kt), 0.25), -1), v))
    data = [torch.randn(3, 5, 16), torch.randn(3, 16, 11), torch.randn(3, 11, 16)]
    return g, data, {0: torch.softmax(data[0] @ data[1] * 0.25, -1) @ data[2]}


def _rows_of_one() -> Built:
    """D == 1: a per-row value has the row's shape, so row ops may read one."""
    g = new_kernel_graph()
    x, c = g.new_input((7, 1)), g.new_input((7, 1))
    s = g.reduction(x, 1)
    t = g.reduction(g.exp(s), -1)
    g.mark_output(t)
    g.mark_output(g.softmax(g.add(t, c), -1))
    g.mark_output(g.rms_norm(s, (1,)))
    return g, [torch.randn(7, 1), torch.randn(7, 1)], {}


def _value_and_its_cast() -> Built:
    """One value stored to two outputs (itself and its float16 cast) from one statement."""
    g = new_kernel_graph()
    e = g.exp(g.new_input((7, 33)))
    g.mark_output(e)
    g.mark_output(g.cast(e, DType.float16))
    g.mark_output(g.reduction(e, -1))
    g.mark_output(g.cast(g.reduction(e, -1), DType.bfloat16))
    return g, [torch.randn(7, 33)], {}


def _masked_softmax_rows() -> Built:
    """The fully-masked-row guard transformers puts after an SDPA softmax: softmax, then rows
    whose scores are all -inf zeroed (comparisons, ``any`` as cast + amax, where). Here the
    load of ``z`` comes late and its kernel input number (4) is the id of a statement of a
    later loop, which once broke the C++ row program (codegen/cpp.py read it as that statement)."""
    g = new_kernel_graph()
    x, y = g.new_input((6, 12)), g.new_input((6, 12))
    neg_inf, zero, z = g.new_input((1,)), g.new_input((1,)), g.new_input((6, 12))
    s = g.softmax(g.add(x, y), -1)
    keep = g.logical_not(g.eq(g.add(x, y), neg_inf))
    dead = g.logical_not(g.ne(g.amax(g.cast(keep, DType.float32), [-1], keepdim=True), zero))
    g.mark_output(g.where(dead, z, s))
    data = [torch.randn(6, 12), torch.randn(6, 12), torch.tensor([float("-inf")]), torch.tensor([0.0]),
            torch.zeros(6, 12)]
    data[0][2] = float("-inf")
    p = torch.softmax(data[0] + data[1], -1)
    return g, data, {0: torch.where(torch.isinf(data[0]).all(-1, keepdim=True), 0.0, p)}


def _fused_cases() -> list[Case]:
    return [Case("fused: rms_norm*w, silu, softmax", d.value, functools.partial(_norm_silu_softmax, d))
            for d in (DType.float16, DType.bfloat16)] + [
        Case("fused: residual, layer_norm, gelu_tanh", "5x96", _residual_layer_norm_gelu, tol=(1e-4, 1e-4)),
        Case("fused: elementwise chain", "9x65", _elementwise_chain, tol=(1e-5, 1e-4)),
        Case("fused: matmul epilogue", "7x45 @ 45x27", _gated_mlp_epilogue, tol=(1e-4, 1e-4)),
        Case("fused: scale, softmax between matmuls", "3x5x16", _scores_softmax, tol=(1e-4, 1e-4)),
        Case("fused: rows of one element", "7x1", _rows_of_one),
        Case("fused: a value and its cast as outputs", "7x33", _value_and_its_cast, tol=(1e-4, 2e-3)),
        Case("fused: softmax with fully masked rows zeroed", "6x12", _masked_softmax_rows, tol=(1e-5, 1e-5)),
    ] + [Case("fused: tanh, sigmoid, erf, log, exp2, abs, reciprocal, pow, where", d.value,
              functools.partial(_new_elementwise_fused, d), tol=(1e-4, 1e-4) if d == DType.float32 else None)
         for d in _HALF_AND_FLOAT]


# ---- library ops ------------------------------------------------------------------------------

def _matmul(a_shape, b_shape) -> Built:
    g = new_kernel_graph()
    g.mark_output(g.matmul(g.new_input(a_shape), g.new_input(b_shape)))
    a, b = torch.randn(a_shape), torch.randn(b_shape)
    return g, [a, b], {0: a @ b}


def quantized(shape, dtype: DType) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 storage, float32 values) of ``shape`` in the GGML block format ``dtype``: standard
    normal weights quantized by the gguf package where it can (q4_0, q4_1, q5_0, q5_1, q8_0),
    else (k-quants, IQ types) random bytes with finite fp16 scales (normals * 0.01); the values
    decoded by gguf (``ir.ops.dequantize``)."""
    import gguf
    import numpy as np

    if dtype in PLAIN_TYPES:   # a plain format's blocks, rows regrouped (a CPU kernel layout)
        storage, values = quantized(shape, PLAIN_TYPES[dtype])
        return to_row_groups(storage, PLAIN_TYPES[dtype]), values
    rng = np.random.default_rng(0)
    per, nbytes = dtype.block
    kind = gguf.GGMLQuantizationType[dtype.value.upper()]
    try:
        raw = gguf.quants.quantize(rng.standard_normal(shape).astype(np.float32), kind)
    except NotImplementedError:
        raw = rng.integers(0, 256, size=(math.prod(shape) // per, nbytes), dtype=np.uint8)
        for off in dtype.scale_offsets:
            scales = (rng.standard_normal(raw.shape[0]) * 0.01).astype(np.float16)
            raw[:, off:off + 2] = scales.view(np.uint8).reshape(-1, 2)
    storage = torch.from_numpy(np.ascontiguousarray(raw)).reshape(dtype.storage_shape(shape))
    return storage, dequantize(storage, dtype, tuple(shape))


def _weight(shape, dtype: DType) -> tuple[torch.Tensor, torch.Tensor]:
    if dtype.is_quantized:
        return quantized(shape, dtype)
    w = torch.randn(shape)
    return w, w


def _linear(M: int, N: int, K: int, dtype: DType) -> Built:
    """linear with and without bias (GEMV for M = 1, GEMM otherwise)."""
    storage, wf = _weight((N, K), dtype)
    g = new_kernel_graph()
    x, w, b = g.new_input((M, K)), g.new_input((N, K), dtype), g.new_input((N,))
    g.mark_output(g.linear(x, w, b))
    g.mark_output(g.linear(x, w))
    xs, bias = torch.randn(M, K), torch.randn(N)
    return g, [xs, storage, bias], {0: F.linear(xs, wf, bias), 1: F.linear(xs, wf)}


def _linear_kn(M: int, N: int, K: int, dtype: DType) -> Built:
    """linear with a [K, N] weight (``weight_layout='kn'``: x @ w + bias, GPT-2's Conv1D)."""
    g = new_kernel_graph()
    x, w, b = g.new_input((M, K), dtype), g.new_input((K, N), dtype), g.new_input((N,), dtype)
    g.mark_output(g.linear(x, w, b, weight_layout="kn"))
    g.mark_output(g.linear(x, w, weight_layout="kn"))
    td = dtype.torch_dtype
    xs, ws, bias = torch.randn(M, K).to(td), torch.randn(K, N).to(td), torch.randn(N).to(td)
    ref = xs.float() @ ws.float()
    return g, [xs, ws, bias], {0: (ref + bias.float()).to(td), 1: ref.to(td)}


def _linear_bf16_weight(M: int, N: int, K: int) -> Built:
    """float32 x with a bfloat16 weight: a bfloat16 GEMM (x rounded to bfloat16, float32 sums
    rounded to bfloat16, float32 bias), as torch's bfloat16 linear computes it."""
    w = torch.randn(N, K).to(torch.bfloat16)
    g = new_kernel_graph()
    x, wt, b = g.new_input((M, K)), g.new_input((N, K), DType.bfloat16), g.new_input((N,))
    g.mark_output(g.linear(x, wt, b))
    xs, bias = torch.randn(M, K), torch.randn(N)
    return g, [xs, w, bias], {0: F.linear(xs.to(torch.bfloat16), w).float() + bias}


def _linear_quant_bf16(M: int, N: int, K: int, dtype: DType) -> Built:
    """A block-quantized weight with compute_dtype='bfloat16': the decoded weight and x rounded to
    bfloat16, float32 sums rounded to bfloat16, float32 bias (LLM prefill's bfloat16 GEMM)."""
    storage, wf = _weight((N, K), dtype)
    g = new_kernel_graph()
    x, w, b = g.new_input((M, K)), g.new_input((N, K), dtype), g.new_input((N,))
    g.mark_output(g.linear(x, w, b, compute_dtype="bfloat16"))
    xs, bias = torch.randn(M, K), torch.randn(N)
    return g, [xs, storage, bias], {0: F.linear(xs.to(torch.bfloat16), wf.to(torch.bfloat16)).float() + bias}


def _linear_quant_int8(M: int, N: int, K: int, dtype: DType) -> Built:
    """A q4_1/q8_0 weight with compute_dtype='int8': x quantized per block of 32 values (scale
    amax / 127, round half to even; llama.cpp's decode activations) times the decoded weight,
    float32 bias. x holds a zero block and blocks of very different magnitudes."""
    storage, wf = _weight((N, K), dtype)
    g = new_kernel_graph()
    x, w, b = g.new_input((M, K)), g.new_input((N, K), dtype), g.new_input((N,))
    g.mark_output(g.linear(x, w, b, compute_dtype="int8"))
    xs, bias = torch.randn(M, K) * torch.logspace(-1, 1, K // 32).repeat_interleave(32), torch.randn(N)
    xs[0, :32] = 0.0
    blocks = xs.reshape(M, K // 32, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    xq = torch.where(scale > 0, torch.round(blocks / scale), 0.0) * scale
    return g, [xs, storage, bias], {0: F.linear(xq.reshape(M, K).double(), wf.double()).float() + bias}


def _linear_f32_bf16_compute(M: int, N: int, K: int, layout: str) -> Built:
    """A float32 weight ([N, K] or [K, N]) with compute_dtype='bfloat16' (torch.compile's
    ``dtype='bfloat16'`` option): x and the weight rounded to bfloat16, float32 sums rounded to
    bfloat16, float32 bias."""
    wf = torch.randn((N, K))
    stored = wf.t().contiguous() if layout == "kn" else wf
    g = new_kernel_graph()
    x, w, b = g.new_input((M, K)), g.new_input(tuple(stored.shape)), g.new_input((N,))
    g.mark_output(g.linear(x, w, b, compute_dtype="bfloat16", weight_layout=layout))
    xs, bias = torch.randn(M, K), torch.randn(N)
    return g, [xs, stored, bias], {0: F.linear(xs.to(torch.bfloat16), wf.to(torch.bfloat16)).float() + bias}


def _linear_stack(M: int, N: int, K: int, parts: int, layout: str, bias: bool, dtype: DType) -> Built:
    """``linear_stack``: ``parts`` weights ([N, K], or [K, N] with layout 'kn') of one x, with or
    without biases; the reference is torch.stack of F.linear in float32."""
    ws = [torch.randn(N, K) / K ** 0.5 for _ in range(parts)]
    bs = [torch.randn(N) for _ in range(parts)] if bias else []
    stored = [w.t().contiguous() if layout == "kn" else w for w in ws]
    g = new_kernel_graph()
    x = g.new_input((M, K), dtype)
    wi = [g.new_input(tuple(w.shape), dtype) for w in stored]
    bi = [g.new_input((N,), dtype) for _ in bs] or None
    g.mark_output(g.linear_stack(x, wi, bi, weight_layout=layout))
    xs = torch.randn(M, K)
    want = torch.stack([F.linear(xs, w, b) for w, b in zip(ws, bs or [None] * parts)])
    cast = [t.to(dtype.torch_dtype) for t in [xs, *stored, *bs]]
    return g, cast, {0: want.to(dtype.torch_dtype)}


def _parallel_linears(M: int, D: int) -> Built:
    """q/k/v projections of one x ([1, M, D], three [D, D] linears with biases) feeding what
    attention does with them: the graph a transformer layer makes, which transforms/parallel.py
    may turn into one ``linear_stack`` (by the backend's measurement); same outputs either way."""
    g = new_kernel_graph()
    x = g.new_input((1, M, D))
    ws, bs = [g.new_input((D, D)) for _ in range(3)], [g.new_input((D,)) for _ in range(3)]
    q, k, v = (g.linear(x, w, b) for w, b in zip(ws, bs))
    g.merge_parallel_ops = True   # as torch.compile's partitions are: the backend decides
    g.mark_output(g.add(g.mul(q, k), v))
    g.mark_output(g.relu(k))
    data = [torch.randn(1, M, D)] + [torch.randn(D, D) / D ** 0.5 for _ in range(3)] + [torch.randn(D) for _ in range(3)]
    qs, ks, vs = (F.linear(data[0], data[1 + i], data[4 + i]) for i in range(3))
    return g, data, {0: qs * ks + vs, 1: ks.relu()}


def _embedding(V: int, D: int, dtype: DType) -> Built:
    storage, table = _weight((V, D), dtype)
    g = new_kernel_graph()
    g.mark_output(g.embedding(g.new_input((7,), DType.int64), g.new_input((V, D), dtype)))
    ids = torch.tensor([0, V - 1, 3, 3, V // 2, 1, 2])
    return g, [ids, storage], {0: table[ids]}


_GGML_EXTRA = (DType.q4_0, DType.q5_0, DType.q5_1, DType.q2_k, DType.q3_k, DType.q4_k, DType.q5_k, DType.q6_k,
               DType.iq4_nl, DType.iq4_xs)


def _weight_cases() -> list[Case]:
    cases = [Case("linear", f"{d.value} M={M}", functools.partial(_linear, M, 33, 96, d), tol=(1e-4, 1e-4))
             for d in (DType.q4_1, DType.q8_0, DType.float32) for M in (1, 7, 20)]
    cases += [Case("linear", f"{d.value} M=3", functools.partial(_linear, 3, 17, 256, d), tol=(1e-4, 1e-4))
              for d in _GGML_EXTRA]
    cases += [Case("linear", f"{d.value} M={M}", functools.partial(_linear, M, 48, 96, d), tol=(1e-4, 1e-4))
              for d in PLAIN_TYPES for M in (1, 7, 20)]
    cases += [Case("linear", f"[K, N] weight {d.value} M={M}", functools.partial(_linear_kn, M, 40, 72, d),
                   tol=(1e-4, 1e-4) if d == DType.float32 else (2e-2, 2e-2))
              for d in (DType.float32, DType.bfloat16) for M in (1, 20)]
    # a sum may round to the neighbouring bfloat16 in another summation order: one ulp, 2^-8
    cases += [Case("linear", f"float32 x, bfloat16 weight M={M}", functools.partial(_linear_bf16_weight, M, 40, 96),
                   tol=(8e-3, 8e-3)) for M in (1, 9)]
    cases += [Case("linear", f"{d.value} weight, bfloat16 compute M={M}",
                   functools.partial(_linear_quant_bf16, M, 40, 256, d), tol=(8e-3, 8e-3))
              for d in (DType.q4_1, DType.q4_k) for M in (3, 20)]
    cases += [Case("linear", f"{d.value} weight, int8 activations M={M}",
                   functools.partial(_linear_quant_int8, M, 40, 256, d), tol=(1e-4, 1e-4))
              for d in (DType.q4_1, DType.q8_0) for M in (1, 3)]
    cases += [Case("linear", f"{d.value} weight, int8 activations M={M}",
                   functools.partial(_linear_quant_int8, M, 48, 256, d), tol=(1e-4, 1e-4))
              for d in PLAIN_TYPES for M in (1, 3)]
    cases += [Case("linear", f"float32 {layout} weight, bfloat16 compute M={M}",
                   functools.partial(_linear_f32_bf16_compute, M, 40, 96, layout), tol=(8e-3, 8e-3))
              for layout in ("nk", "kn") for M in (3, 20)]
    cases += [Case("linear_stack", f"x{k} {layout}{' bias' if b else ''} {d.value} M={M} N={N}",
                   functools.partial(_linear_stack, M, N, 48, k, layout, b, d),
                   tol=(1e-4, 1e-4) if d == DType.float32 else (2e-2, 2e-2))
              for k, layout, b, d, M, N in [(3, "nk", True, DType.float32, 7, 64), (2, "kn", False, DType.float32, 20, 40),
                                            (3, "nk", True, DType.bfloat16, 5, 32)]]
    cases += [Case("linear", f"q/k/v of one x M={M}", functools.partial(_parallel_linears, M, 64), tol=(1e-4, 1e-4))
              for M in (3, 17)]
    cases += [Case("embedding", d.value, functools.partial(_embedding, 50, 64, d), tol=(0.0, 0.0))
              for d in (DType.q4_1, DType.q8_0, DType.float32)]
    cases += [Case("embedding", "q8_0r16", functools.partial(_embedding, 48, 64, DType.q8_0r16), tol=(0.0, 0.0))]
    cases += [Case("embedding", d.value, functools.partial(_embedding, 9, 256, d), tol=(0.0, 0.0))
              for d in _GGML_EXTRA]
    return cases


def _linear_w8a8(M: int, K: int, N: int, group: int, bias: bool) -> Built:
    g = new_kernel_graph()
    x, w, s = g.new_input((M, K)), g.new_input((K, N), DType.int8), g.new_input((N,))
    b = [g.new_input((N,))] if bias else []
    g.mark_output(g.linear_w8a8(x, w, s, *b, group_size=group))
    data = [torch.randn(M, K), torch.randint(-127, 128, (K, N), dtype=torch.int8), torch.rand(N) / 100 + 1e-3]
    return g, data + ([torch.randn(N)] if bias else []), {}


def _rope(T: int, start: int) -> Built:
    H, Dh, S = 3, 16, 12
    g = new_kernel_graph()
    x, c, s = g.new_input((T, H, Dh)), g.new_input((S, Dh // 2)), g.new_input((S, Dh // 2))
    g.mark_output(g.rope(x, c, s, g.new_input((1,), DType.int64)))
    freqs = torch.arange(S).float()[:, None] * torch.rand(Dh // 2)[None]
    return g, [torch.randn(T, H, Dh), freqs.cos(), freqs.sin(), torch.tensor([start])], {}


def _attention(T: int, start: int, window: int, dtype: DType = DType.float32, cache: DType | None = None) -> Built:
    """GQA (4 query heads, 2 KV heads) over a KV cache of 32 rows whose first ``start`` rows hold
    earlier keys and values; the graph appends T rows and attends. ``cache``: the caches' dtype
    (default ``dtype``; float16 with float32 activations is a float16 KV cache)."""
    Hq, Hkv, Dh, S = 4, 2, 16, 32
    cache = cache or dtype
    g = new_kernel_graph()
    q, k, v = g.new_input((T, Hq, Dh), dtype), g.new_input((T, Hkv, Dh), dtype), g.new_input((T, Hkv, Dh), dtype)
    kc, vc = g.new_input((S, Hkv, Dh), cache), g.new_input((S, Hkv, Dh), cache)
    g.mark_output(g.attention(q, k, v, kc, vc, g.new_input((1,), DType.int64), window=window))
    td = dtype.torch_dtype
    caches = [torch.zeros(S, Hkv, Dh, dtype=cache.torch_dtype) for _ in range(2)]
    for c in caches:
        c[:start] = torch.randn(start, Hkv, Dh).to(c.dtype)
    qkv = [torch.randn(T, h, Dh).to(td) for h in (Hq, Hkv, Hkv)]
    return g, [*qkv, *caches, torch.tensor([start])], {}


def _rope_rows(positions: list[int]) -> Built:
    """Rows at their own positions (repeats and out-of-order ones included), against plain torch."""
    T, H, Dh, S = len(positions), 3, 18, 13
    g = new_kernel_graph()
    x, c, s = g.new_input((T, H, Dh)), g.new_input((S, Dh // 2)), g.new_input((S, Dh // 2))
    g.mark_output(g.rope_rows(x, c, s, g.new_input((T,), DType.int64)))
    freqs = torch.arange(S).float()[:, None] * torch.rand(Dh // 2)[None]
    data, pos = torch.randn(T, H, Dh), torch.tensor(positions)
    cs, sn = freqs.cos()[pos][:, None], freqs.sin()[pos][:, None]
    x1, x2 = data[..., :Dh // 2], data[..., Dh // 2:]
    want = torch.cat([x1 * cs - x2 * sn, x2 * cs + x1 * sn], -1)
    return g, [data, freqs.cos(), freqs.sin(), pos], {0: want}


def _attention_rows(rows: list[tuple[int, int]], window: int, dtype: DType = DType.float32,
                    cache: DType | None = None) -> Built:
    """GQA (6 query heads, 2 KV heads, Dh 12) over caches of 4 slots x 17 positions holding earlier
    keys and values; ``rows`` are (slot, position): decode rows, prefill chunks, a padding row.
    ``cache``: the caches' dtype, as in ``_attention``."""
    Hq, Hkv, Dh, N, S = 6, 2, 12, 4, 17
    T = len(rows)
    cache = cache or dtype
    g = new_kernel_graph()
    q, k, v = g.new_input((T, Hq, Dh), dtype), g.new_input((T, Hkv, Dh), dtype), g.new_input((T, Hkv, Dh), dtype)
    kc, vc = g.new_input((N, S, Hkv, Dh), cache), g.new_input((N, S, Hkv, Dh), cache)
    slots, pos = g.new_input((T,), DType.int64), g.new_input((T,), DType.int64)
    g.mark_output(g.attention_rows(q, k, v, kc, vc, slots, pos, window=window))
    td = dtype.torch_dtype
    caches = [torch.randn(N, S, Hkv, Dh).to(cache.torch_dtype) for _ in range(2)]
    qkv = [torch.randn(T, h, Dh).to(td) for h in (Hq, Hkv, Hkv)]
    return g, [*qkv, *caches, torch.tensor([r[0] for r in rows]), torch.tensor([r[1] for r in rows])], {}


#: (slot, position) rows of a continuous-batching step: a decode row of slot 0, a prefill chunk of
#: slot 2 (positions 4..6), a decode row of slot 1 near the cache end, a padding row of slot 3
_BATCH_ROWS = [(0, 6), (2, 4), (2, 5), (2, 6), (1, 16), (3, 0)]


def _llm_layer(dtype: DType) -> Built:
    """What an LLM in a half type runs: q8_0 linear, RoPE and attention."""
    T, H, Dh, S = 3, 2, 16, 8
    storage, _ = quantized((H * Dh, 64), DType.q8_0)
    g = new_kernel_graph()
    x, w = g.new_input((T, 64), dtype), g.new_input((H * Dh, 64), DType.q8_0)
    c, s = g.new_input((S, Dh // 2)), g.new_input((S, Dh // 2))
    kc, vc, pos = g.new_input((S, H, Dh), dtype), g.new_input((S, H, Dh), dtype), g.new_input((1,), DType.int64)
    q = g.rope(g.reshape(g.linear(x, w), (T, H, Dh)), c, s, pos)
    g.mark_output(g.attention(q, q, q, kc, vc, pos))
    freqs = torch.arange(S).float()[:, None] * torch.rand(Dh // 2)[None]
    td = dtype.torch_dtype
    # x / 8 keeps q around 1 (w is standard normal): the tolerance is relative to that scale
    return g, [(torch.randn(T, 64) / 8).to(td), storage, freqs.cos(), freqs.sin(), torch.zeros(S, H, Dh, dtype=td),
               torch.zeros(S, H, Dh, dtype=td), torch.tensor([2])], {}


def _attention_varlen(lengths: list[int], pad: int) -> Built:
    """Sentences of ``lengths`` packed back to back, then ``pad`` rows of bucket padding."""
    H, Dh = 2, 8
    T = sum(lengths) + pad
    g = new_kernel_graph()
    g.mark_output(g.attention_varlen(g.new_input((T, 3 * H * Dh)), g.new_input((len(lengths) + 1,), DType.int64), H))
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return g, [torch.randn(T, 3 * H * Dh), offsets], {}


def _attention_bidir() -> Built:
    """Two sequences of 5, the second with its last two keys masked out (padding)."""
    B, S, H, Dh = 2, 5, 2, 8
    g = new_kernel_graph()
    g.mark_output(g.attention_bidir(g.new_input((B, S, 3 * H * Dh)), g.new_input((B, S)), H))
    mask = torch.zeros(B, S)
    mask[1, 3:] = -math.inf
    return g, [torch.randn(B, S, 3 * H * Dh), mask], {}


def _argmax(R: int, D: int) -> Built:
    """Ties (the first index wins) and a random row."""
    g = new_kernel_graph()
    g.mark_output(g.argmax(g.new_input((R, D)), -1))
    data = torch.zeros(R, D)
    data[R // 2, D // 3] = data[R // 2, D - 1] = 1.0
    data[-1] = torch.randn(D)
    return g, [data], {0: torch.argmax(data, -1)}


def _allreduce(shape: tuple[int, ...]) -> Built:
    """One process (no group): the sum over one rank is the tensor itself. The sums over 2 gloo
    ranks are tests/engines/test_tensor_parallel.py's."""
    g = new_kernel_graph()
    g.mark_output(g.exp(g.allreduce(g.new_input(shape))))
    data = torch.randn(shape)
    return g, [data], {0: torch.exp(data)}


def _views(op: str) -> Built:
    """A view feeding a fused kernel: exp of rows 2..4, or softmax of a 33x7 reshape of 7x33."""
    g = new_kernel_graph()
    x = g.new_input((7, 33))
    data = torch.randn(7, 33)
    if op == "slice_rows":
        g.mark_output(g.exp(g.slice_rows(x, 2, 5)))
        return g, [data], {0: data[2:5].exp()}
    g.mark_output(g.softmax(g.reshape(x, (33, 7)), -1))
    return g, [data], {0: torch.softmax(data.reshape(33, 7), -1)}


def _customized() -> Built:
    """Mirage's gated-MLP block graph: two accumulated matmuls, silu(a1) * a3 after the loop."""
    M, K, N = 7, 45, 27
    g = new_kernel_graph()
    X, W1, W3 = g.new_input((M, K)), g.new_input((K, N)), g.new_input((K, N))
    tb = threadblock.new_threadblock_graph(grid_dim=(3, 1, 1), block_dim=(128, 1, 1), forloop_range=5,
                                           reduction_dimx=64)
    tX = tb.new_input(X, (-1, -1, -1), 1)
    tW1, tW3 = tb.new_input(W1, (1, -1, -1), 0), tb.new_input(W3, (1, -1, -1), 0)
    tb.new_output(tb.mul(tb.silu(tb.forloop_accum(tb.matmul(tX, tW1))), tb.forloop_accum(tb.matmul(tX, tW3))),
                  (1, -1, -1))
    g.mark_output(g.customized([X, W1, W3], tb)[0])
    x, w1, w3 = torch.randn(M, K), torch.randn(K, N), torch.randn(K, N)
    return g, [x, w1, w3], {0: F.silu(x @ w1) * (x @ w3)}


def _sdpa(B: int, H: int, Hk: int, S: int, T: int, mask_shape, causal: bool, scale, D: int = 16) -> Built:
    """``sdpa`` against attention written out: softmax(q k^T * scale + mask, causal) v, with the
    k/v heads repeated for GQA; head dim ``D``."""
    g = new_kernel_graph()
    q, k, v = g.new_input((B, H, S, D)), g.new_input((B, Hk, T, D)), g.new_input((B, Hk, T, D))
    m = g.new_input(mask_shape) if mask_shape else None
    g.mark_output(g.sdpa(q, k, v, m, causal=causal, scale=scale))
    qs, ks, vs = torch.randn(B, H, S, D), torch.randn(B, Hk, T, D), torch.randn(B, Hk, T, D)
    ms = torch.randn(mask_shape) if mask_shape else None
    kr, vr = ks.repeat_interleave(H // Hk, dim=1), vs.repeat_interleave(H // Hk, dim=1)
    scores = qs @ kr.transpose(-1, -2) * (D ** -0.5 if scale is None else scale)
    if ms is not None:
        scores = scores + ms
    if causal:
        scores = scores.masked_fill(torch.ones(S, T, dtype=torch.bool).triu(1), float("-inf"))
    want = torch.softmax(scores, dim=-1) @ vr
    return g, [qs, ks, vs] + ([ms] if ms is not None else []), {0: want}


def _rotary_emb(x_shape, table_shape, heads_of_bshd: bool, dtype: DType = DType.float32) -> Built:
    """``rotary_emb`` against transformers' formula written out (x * cos + rotate_half(x) * sin);
    ``heads_of_bshd``: x is the heads of a [B, S, H, D] input permuted in the graph (a strided
    view on backends that take one)."""
    g = new_kernel_graph()
    td = dtype.torch_dtype
    if heads_of_bshd:
        B, H, S, D = x_shape
        xi = g.new_input((B, S, H, D), dtype)
        x = g.permute(xi, (0, 2, 1, 3))
        data = torch.randn(B, S, H, D).to(td)
        xs = data.permute(0, 2, 1, 3).float()
    else:
        x = xi = g.new_input(x_shape, dtype)
        data = torch.randn(x_shape).to(td)
        xs = data.float()
    c, s_ = g.new_input(table_shape, dtype), g.new_input(table_shape, dtype)
    g.mark_output(g.rotary_emb(x, c, s_))
    angles = torch.rand(table_shape) * 6.3
    cos, sin = angles.cos().to(td), angles.sin().to(td)
    half = xs.shape[-1] // 2
    want = xs * cos.float() + torch.cat([-xs[..., half:], xs[..., :half]], dim=-1) * sin.float()
    return g, [data, cos, sin], {0: want.to(td)}


def _library_cases() -> list[Case]:
    part = functools.partial
    return [
        *(Case("matmul", f"{_dims(a)} @ {_dims(b)}", part(_matmul, a, b), tol=(1e-4, 1e-4))
          for a, b in [((7, 33), (33, 5)), ((2, 1, 4, 8), (3, 8, 1)), ((1, 1), (1, 4097))]),
        *_weight_cases(),
        *(Case("linear_w8a8", f"M={M} K={K} N={N} group={G}{' bias' if b else ''}", part(_linear_w8a8, M, K, N, G, b),
               tol=(1e-4, 1e-5)) for M, K, N, G, b in [(1, 64, 40, 0, True), (7, 96, 33, 0, False),
                                                         (5, 96, 17, 16, True)]),
        *(Case("sdpa", name, part(_sdpa, *spec), tol=(1e-4, 1e-4)) for name, spec in [
            ("mask [B,1,1,T]", (2, 4, 4, 9, 9, (2, 1, 1, 9), False, None)),
            ("causal", (1, 2, 2, 7, 7, None, True, None)),
            ("GQA, mask [1,H,S,T], scale 0.3", (2, 4, 2, 5, 6, (1, 4, 5, 6), False, 0.3)),
            ("GQA, causal, mask [B,1,S,T], 40 queries, D=32", (1, 2, 1, 40, 40, (1, 1, 40, 40), True, None, 32))]),
        Case("rope", "T=3 start=2", part(_rope, 3, 2)),
        Case("rope", "T=1 start=11", part(_rope, 1, 11)),
        Case("attention", "prefill T=7", part(_attention, 7, 0, 0)),
        Case("attention", "decode start=7", part(_attention, 1, 7, 0)),
        Case("attention", "chunk T=3 start=5", part(_attention, 3, 5, 0)),
        Case("attention", "window=3 T=4 start=6", part(_attention, 4, 6, 3)),
        Case("attention", "bfloat16 decode start=9", part(_attention, 1, 9, 0, DType.bfloat16)),
        Case("attention", "float16 KV cache prefill T=7", part(_attention, 7, 0, 0, cache=DType.float16)),
        Case("attention", "float16 KV cache decode start=9", part(_attention, 1, 9, 0, cache=DType.float16)),
        Case("attention", "float16 KV cache window=3 T=4 start=6", part(_attention, 4, 6, 3, cache=DType.float16)),
        Case("rotary_emb", "heads of [2,5,3,8], cos [2,1,5,8]", part(_rotary_emb, (2, 3, 5, 8), (2, 1, 5, 8), True)),
        Case("rotary_emb", "7x16, cos 7x16", part(_rotary_emb, (7, 16), (7, 16), False)),
        Case("rotary_emb", "1x4x6x64, cos 1x1x6x64 bfloat16", part(_rotary_emb, (1, 4, 6, 64), (1, 1, 6, 64), False,
                                                                    DType.bfloat16), tol=(2e-2, 2e-2)),
        Case("rotary_emb", "heads of [1,6,2,32], cos [1,1,6,32] float16", part(_rotary_emb, (1, 2, 6, 32), (1, 1, 6, 32),
                                                                               True, DType.float16), tol=(2e-3, 2e-3)),
        Case("rope_rows", "T=5 positions 3,0,12,4,4", part(_rope_rows, [3, 0, 12, 4, 4])),
        Case("rope_rows", "T=1 position 7", part(_rope_rows, [7])),
        Case("attention_rows", "decode + prefill chunk + pad", part(_attention_rows, _BATCH_ROWS, 0)),
        Case("attention_rows", "window=3", part(_attention_rows, _BATCH_ROWS, 3)),
        Case("attention_rows", "one decode row", part(_attention_rows, [(1, 9)], 0)),
        Case("attention_rows", "bfloat16", part(_attention_rows, _BATCH_ROWS, 0, DType.bfloat16)),
        Case("attention_rows", "float16 KV cache", part(_attention_rows, _BATCH_ROWS, 0, cache=DType.float16)),
        *(Case("fused: q8_0 linear, rope, attention", d.value, part(_llm_layer, d)) for d in (DType.float16,
                                                                                            DType.bfloat16)),
        Case("attention_varlen", "3,0,5 pad 2", part(_attention_varlen, [3, 0, 5], 2), tol=(1e-5, 1e-4)),
        Case("attention_varlen", "1", part(_attention_varlen, [1], 0), tol=(1e-5, 1e-4)),
        # the embedding engine's plans: as many sentences as token rows, the unused ones empty
        Case("attention_varlen", "5,3 then 14 empty, pad 6", part(_attention_varlen, [5, 3] + [0] * 14, 6),
             tol=(1e-5, 1e-4)),
        Case("attention_bidir", "2x5 masked", _attention_bidir, tol=(1e-5, 1e-4)),
        Case("argmax", "3x4097 ties", part(_argmax, 3, 4097)),
        Case("argmax", "5x7 ties", part(_argmax, 5, 7)),
        Case("allreduce", "1x576 one rank", part(_allreduce, (1, 576))),
        Case("slice_rows", "7x33 rows 2..4", part(_views, "slice_rows")),
        Case("reshape", "7x33 as 33x7", part(_views, "reshape")),
        Case("customized", "gated MLP 7x45 @ 45x27", _customized, tol=(2e-4, 2e-4)),
    ]


def _conv2d(N, C, H, W, O, k, stride, padding, dilation, groups, bias, dtype) -> Built:
    """conv2d against F.conv2d (float32 accumulation)."""
    g = new_kernel_graph()
    x, w = g.new_input((N, C, H, W), dtype), g.new_input((O, C // groups, k, k), dtype)
    b = g.new_input((O,), dtype) if bias else None
    g.mark_output(g.conv2d(x, w, b, stride, padding, dilation, groups))
    xs, ws = torch.randn(N, C, H, W).to(dtype.torch_dtype), (torch.randn(O, C // groups, k, k) / k).to(dtype.torch_dtype)
    bs = torch.randn(O).to(dtype.torch_dtype) if bias else None
    want = F.conv2d(xs.float(), ws.float(), None if bs is None else bs.float(), stride, padding, dilation, groups)
    return g, [xs, ws, *([bs] if bias else [])], {0: want.to(dtype.torch_dtype)}


def _pool(op, shape, kwargs, dtype) -> Built:
    """max_pool2d / avg_pool2d / adaptive_avg_pool2d against torch.nn.functional."""
    g = new_kernel_graph()
    g.mark_output(getattr(g, op)(g.new_input(shape, dtype), **kwargs))
    xs = torch.randn(shape).to(dtype.torch_dtype)
    torch_kwargs = {"kernel_size": "kernel_size", "stride": "stride", "padding": "padding", "dilation": "dilation",
                    "count_include_pad": "count_include_pad", "output_size": "output_size"}
    want = getattr(F, op)(xs.float(), **{torch_kwargs[k]: v for k, v in kwargs.items()})
    return g, [xs], {0: want.to(dtype.torch_dtype)}


def _batch_norm(shape, affine, dtype, stats_in_x_dtype=False) -> Built:
    """Inference batch_norm against F.batch_norm(training=False); the statistics float32, or in
    x's dtype (a model converted with ``.to(torch.bfloat16)``)."""
    C = shape[1]
    sd = dtype if stats_in_x_dtype else DType.float32
    g = new_kernel_graph()
    ins = [g.new_input(shape, dtype), *(g.new_input((C,), sd) for _ in range(4 if affine else 2))]
    g.mark_output(g.batch_norm(*ins[:3], *(ins[3:] if affine else []), eps=1e-3))
    xs = torch.randn(shape).to(dtype.torch_dtype)
    stats = [t.to(sd.torch_dtype) for t in (torch.randn(C), torch.rand(C) + 0.5, *(
        [torch.randn(C), torch.randn(C)] if affine else []))]
    f = [t.float() for t in stats]
    want = F.batch_norm(xs.float(), f[0], f[1], *(f[2:] or [None, None]), training=False, eps=1e-3)
    return g, [xs, *stats], {0: want.to(dtype.torch_dtype)}


def _activation(g, y, ref, act):
    """``act`` (None, "relu", "relu6" or "silu") applied to the graph value ``y`` and to its
    expected tensor ``ref``: the pair after it."""
    if act == "relu":
        return g.relu(y), ref.relu()
    if act == "relu6":
        return g.clamp(y, 0.0, 6.0), ref.clamp(0, 6)
    if act == "silu":
        return g.silu(y), F.silu(ref)
    return y, ref


def _conv_block(N, C, H, W, O, k, stride, groups, shortcut, act, dtype) -> Built:
    """A residual block as conv nets write it: conv -> BatchNorm -> + shortcut -> activation,
    where the shortcut is x itself (``shortcut="identity"``), a strided 1x1 conv -> BatchNorm
    (``"conv"``) or absent (None); then a 3x3 max pool and a spatial mean. The convolution
    passes (transforms/conv.py) fuse each chain into one conv2d and keep it NHWC; the
    expected output is torch.nn.functional on float32 copies."""
    g = new_kernel_graph()
    x = g.new_input((N, C, H, W), dtype)
    w = g.new_input((O, C // groups, k, k), dtype)
    bn = [g.new_input((O,)) for _ in range(4)]
    xs = torch.randn(N, C, H, W).to(dtype.torch_dtype)
    ws = (torch.randn(O, C // groups, k, k) / k).to(dtype.torch_dtype)
    stats = [torch.randn(O), torch.rand(O) + 0.5, torch.randn(O), torch.randn(O)]
    ins = [xs, ws, *stats]
    y = g.batch_norm(g.conv2d(x, w, None, stride, k // 2, 1, groups), *bn, eps=1e-3)
    want = F.batch_norm(F.conv2d(xs.float(), ws.float(), None, stride, k // 2, 1, groups), *stats,
                        training=False, eps=1e-3)
    if shortcut == "identity":
        y, want = g.add(y, x), want + xs.float()
    elif shortcut == "conv":
        w2, b2 = g.new_input((O, C, 1, 1), dtype), [g.new_input((O,)) for _ in range(4)]
        ws2, stats2 = (torch.randn(O, C, 1, 1)).to(dtype.torch_dtype), [torch.randn(O), torch.rand(O) + 0.5,
                                                                        torch.randn(O), torch.randn(O)]
        ins += [ws2, *stats2]
        y = g.add(y, g.batch_norm(g.conv2d(x, w2, None, stride), *b2, eps=1e-3))
        want = want + F.batch_norm(F.conv2d(xs.float(), ws2.float(), None, stride), *stats2, training=False,
                                   eps=1e-3)
    y, want = _activation(g, y, want, act)
    g.mark_output(y)
    g.mark_output(g.mean(g.max_pool2d(y, 3, 2, 1), dim=(2, 3)))
    want = want.to(dtype.torch_dtype)
    pooled = F.max_pool2d(want.float(), 3, 2, 1).mean((2, 3)).to(dtype.torch_dtype)
    return g, ins, {0: want, 1: pooled}


#: the branches _parallel_convs builds, in turn: (BatchNorm, bias, activation)
_BRANCHES = ((True, False, "relu"), (False, True, "relu6"), (True, False, None), (False, False, "silu"))


def _parallel_convs(N, C, H, W, widths, k, stacked) -> Built:
    """Branches of one x, as an Inception module's (or a ResNet stage's first 1x1 convolution and
    its projection shortcut): ``len(widths)`` k x k convolutions (padding k // 2) each with its
    own epilogue (``_BRANCHES``: BatchNorm then ReLU, a bias then ReLU6, BatchNorm alone, SiLU).
    ``stacked``: the convolution passes applied and the branches merged into one
    ``conv2d_stack`` whatever the backend would measure (``merge_parallel_convs`` forced on);
    else the plain graph with ``merge_parallel_ops`` set, as torch.compile's partitions are (the
    backend decides). float32; the expected outputs are torch.nn.functional's."""
    from ..transforms.conv import optimize_convolutions
    from ..transforms.parallel import merge_parallel_convs
    g = new_kernel_graph()
    x = g.new_input((N, C, H, W))
    xs = torch.randn(N, C, H, W)
    data, want = [xs], {}
    for i, O in enumerate(widths):
        bn, bias, act = _BRANCHES[i % len(_BRANCHES)]
        ws = torch.randn(O, C, k, k) / (C * k * k) ** 0.5
        data.append(ws)
        y = g.conv2d(x, g.new_input(tuple(ws.shape)), g.new_input((O,)) if bias else None, 1, k // 2)
        bs = torch.randn(O) if bias else None
        data += [bs] if bias else []
        ref = F.conv2d(xs, ws, bs, 1, k // 2)
        if bn:
            stats = [torch.randn(O), torch.rand(O) + 0.5, torch.randn(O), torch.randn(O)]
            data += stats
            y = g.batch_norm(y, *(g.new_input((O,)) for _ in range(4)), eps=1e-3)
            ref = F.batch_norm(ref, *stats, training=False, eps=1e-3)
        y, ref = _activation(g, y, ref, act)
        g.mark_output(y)
        want[i] = ref
    if stacked:
        g = merge_parallel_convs(optimize_convolutions(g, channels_last=True), lambda case: True)
        assert [n.op for n in g.ops].count("conv2d_stack") == 1, "the branches did not stack"
    else:
        g.merge_parallel_ops = True
    return g, data, want


def _conv_net_cases() -> list[Case]:
    """The conv-net ops at odd sizes: 1x1, 3x3 stride 2 with padding, 7x7 stride 2, depthwise,
    grouped and dilated convolutions, batch 1 and 3, non-square images; pooling windows that
    clip at the border; BatchNorm with and without affine parameters."""
    part = functools.partial
    f32, f16, bf16 = DType.float32, DType.float16, DType.bfloat16
    convs = [  # (N, C, H, W, O, k, stride, padding, dilation, groups, bias)
        ("1x1", (3, 8, 5, 7, 6, 1, 1, 0, 1, 1, True)),
        ("3x3 s2 p1", (1, 5, 9, 11, 7, 3, 2, 1, 1, 1, True)),
        ("7x7 s2 p3", (2, 3, 17, 13, 8, 7, 2, 3, 1, 1, False)),
        ("depthwise 3x3", (2, 12, 10, 9, 12, 3, 1, 1, 1, 12, True)),
        ("grouped 3x3 g2", (1, 8, 7, 7, 6, 3, 1, 1, 1, 2, True)),
        ("dilated 3x3 d2", (1, 4, 11, 12, 5, 3, 1, 2, 2, 1, False)),
    ]
    cases = [Case("conv2d", f"{name} {d.value}", part(_conv2d, *args, d), tol=(1e-4, 1e-4) if d == f32 else None)
             for name, args in convs for d in (f32,)]
    cases += [Case("conv2d", f"3x3 s2 p1 {d.value}", part(_conv2d, 1, 5, 9, 11, 7, 3, 2, 1, 1, 1, True, d),
                   tol=(3e-2, 3e-2)) for d in (f16, bf16)]
    pools = [("max_pool2d", "3x3 s2 p1", (2, 3, 11, 9), {"kernel_size": 3, "stride": 2, "padding": 1}),
             ("max_pool2d", "2x2", (1, 4, 8, 6), {"kernel_size": 2}),
             ("max_pool2d", "3x3 d2", (1, 2, 9, 9), {"kernel_size": 3, "stride": 1, "dilation": 2}),
             ("avg_pool2d", "3x3 s2 p1", (2, 3, 11, 9), {"kernel_size": 3, "stride": 2, "padding": 1}),
             ("avg_pool2d", "3x3 s2 p1 no pad count", (2, 3, 11, 9),
              {"kernel_size": 3, "stride": 2, "padding": 1, "count_include_pad": False}),
             ("adaptive_avg_pool2d", "7x5 -> 1x1", (2, 6, 7, 5), {"output_size": 1}),
             ("adaptive_avg_pool2d", "7x5 -> 3x2", (1, 3, 7, 5), {"output_size": (3, 2)})]
    cases += [Case(op, f"{name} {d.value}", part(_pool, op, shape, kw, d)) for op, name, shape, kw in pools
              for d in (f32, bf16)]
    cases += [Case("batch_norm", f"{'affine' if a else 'plain'} {d.value}", part(_batch_norm, (2, 5, 3, 7), a, d))
              for a in (True, False) for d in (f32, f16)]
    cases += [Case("batch_norm", "affine, bfloat16 statistics", part(_batch_norm, (2, 5, 3, 7), True, bf16, True))]
    blocks = [  # (N, C, H, W, O, k, stride, groups, shortcut, activation)
        ("3x3 + identity, relu", (2, 8, 9, 7, 8, 3, 1, 1, "identity", "relu")),
        ("3x3 s2 + conv shortcut, relu", (1, 6, 11, 10, 8, 3, 2, 1, "conv", "relu")),
        ("depthwise 3x3, relu6", (2, 12, 8, 9, 12, 3, 1, 12, None, "relu6")),
        ("1x1, silu", (3, 5, 6, 7, 9, 1, 1, 1, None, "silu")),
        ("7x7 s2 no activation", (1, 3, 17, 15, 6, 7, 2, 1, None, None)),
    ]
    cases += [Case("conv2d", f"block {name} {d.value}", part(_conv_block, *args, d),
                   tol=(1e-4, 1e-4) if d == f32 else (5e-2, 5e-2)) for name, args in blocks for d in (f32,)]
    cases += [Case("conv2d", f"block 3x3 + identity, relu {d.value}", part(_conv_block, *blocks[0][1], d),
                   tol=(5e-2, 5e-2)) for d in (bf16,)]
    stacks = [  # (N, C, H, W, widths, k)
        ("1x1 x3 widths 48/16/64", (2, 40, 5, 7, (48, 16, 64), 1)),
        ("1x1 x2 widths 64/256", (1, 64, 9, 6, (64, 256), 1)),
        ("1x1 x4 widths 33/32/7/70", (3, 24, 4, 5, (33, 32, 7, 70), 1)),
        ("3x3 x2 widths 12/20", (2, 8, 7, 9, (12, 20), 3)),
    ]
    cases += [Case("conv2d_stack", name, part(_parallel_convs, *args, True), tol=(1e-4, 1e-4)) for name, args in stacks]
    cases += [Case("conv2d", f"branches of one x {name}", part(_parallel_convs, *args, False), tol=(1e-4, 1e-4))
              for name, args in stacks[:2]]
    return cases


#: every case, in the order they run (ids unique: tests/tools/test_conformance.py checks)
CASES: tuple[Case, ...] = (*_unary_cases(), *_binary_cases(), *_minmax_pow_cases(), *_bool_cases(),
                           *_elementwise_attr_cases(), *_cast_cases(),
                           *_row_cases(), *_any_dim_cases(), *_layout_cases(), *_indexing_cases(), *_fused_cases(),
                           *_library_cases(), *_conv_net_cases())


def summarize(results: Iterable[CaseResult]) -> dict[str, dict[str, int]]:
    """Counts per backend ('-' for coverage failures): passed, failed, errors, and how many
    passing cases ran some library op as its torch reference (``fallback``)."""
    summary: dict[str, dict[str, int]] = {}
    for r in results:
        s = summary.setdefault(r.backend, {"passed": 0, "failed": 0, "errors": 0, "fallback": 0})
        s[{"PASS": "passed", "FAIL": "failed", "ERROR": "errors"}[r.status]] += 1
        s["fallback"] += bool(r.status == "PASS" and r.fallback)
    return summary
