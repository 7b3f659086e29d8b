"""``yirage benchmark`` and ``yr.benchmark_backends()``: yirage's kernels against torch eager,
op by op, on every backend at hand (YiRage's ``multi_backend_benchmark.py``, made real).

Each case is one op (matmul, linear, LayerNorm, RMSNorm, softmax, encoder attention, a
transformer block, a GGUF-quantized GEMV) at one shape, built as a yirage kernel graph,
compiled for one backend and bound to its inputs once (``g.compile(backend).plan(inputs)``).
Before it is timed, its output is checked against torch eager computing the same thing in
float32 on the CPU; a case outside its tolerance is reported ``wrong`` and not timed. Then
yirage's plan and torch eager (same inputs, same device, the case's dtype) are timed by the
one measurement harness (``runtime/timing.py`` ``compare``: interleaved rounds, the median
of the paired ratios is the speedup), synchronized with the backend's ``synchronize``.

This module must never substitute one backend or kernel for another: a case whose library op
has no kernel on the backend (the executor would run torch's own reference there, so the
figure would not be yirage's) is reported ``skipped`` with the reason, and a case that fails
to build or run is reported ``error``; neither stops the other cases. It never asserts or
decides anything about speed; it measures and reports.
"""
from __future__ import annotations

import itertools
import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import gguf
import numpy as np
import torch
import torch.nn.functional as F

from ..backends import Backend, get_available_backends, get_backend_impl, get_backend_info, resolve_backend
from ..dtypes import DType
from ..errors import BenchmarkError
from ..ir.ops import OPS as IR_OPS
from ..kernel import KNGraph, new_kernel_graph
from ..runtime.machine import machine_record
from ..runtime.timing import MIN_SAMPLE_S, compare
from ..transforms.fusion import VIEW_OPS

#: seconds of timing in all when neither ``duration_seconds`` nor ``iterations`` is given
DEFAULT_DURATION_S = 10.0
#: a case above this many GFLOP per call is skipped (say so with ``max_gflop``)
DEFAULT_MAX_GFLOP = 25.0
#: rounds per case in duration mode: at least (once its share of the time is spent) and at most
MIN_ROUNDS, MAX_ROUNDS = 3, 100
#: activation dtypes a benchmark runs in
DTYPES = ("float32", "bfloat16", "float16")
#: GGUF block types of the quantized GEMV (those gguf-py's ``quants.quantize`` can make)
QUANT_TYPES = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0")
#: max |yirage - reference| allowed, relative to max(1, max |reference|), per dtype
TOLERANCE = {"float32": 2e-4, "float16": 1e-2, "bfloat16": 5e-2}
#: head size of the attention ops; the hidden size must be a multiple of it
HEAD_DIM = 64
EPS = 1e-5


@dataclass
class Workload:
    """One op at one shape, ready to run both ways.

    ``graph`` (yirage) takes ``inputs``; ``eager(*torch_inputs)`` is torch eager doing the same
    thing (its inputs may differ: a dequantized weight); both on the CPU here, moved to the
    backend's device by ``_run_case``. ``torch_side`` says in words what torch runs."""

    graph: KNGraph
    inputs: list[torch.Tensor]
    torch_inputs: list[torch.Tensor]
    eager: Callable[..., torch.Tensor]
    torch_side: str


@dataclass(frozen=True)
class OpSpec:
    """A benchmarked op: ``dims(batch, seq, hidden)`` names its shape, ``flops(dims)`` counts
    its multiply-adds x 2 per call, ``build(dims, dtype, quant, gen)`` makes the ``Workload``,
    ``needs`` is a divisibility rule on the hidden size (or 1), ``shown`` the dims its shape
    label names (default all)."""

    dims: Callable[[int, int, int], dict]
    flops: Callable[[dict], float]
    build: Callable[[dict, torch.dtype, str, torch.Generator], Workload]
    needs: int = 1
    shown: tuple[str, ...] | None = None

    def label(self, dims: dict) -> str:
        """The shape as ``name=size`` pairs, e.g. 'M=128 K=768 N=768'."""
        return " ".join(f"{k}={v}" for k, v in dims.items() if self.shown is None or k in self.shown)


def _randn(gen: torch.Generator, *shape: int, scale: float = 1.0, dtype=torch.float32) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def _graph(shapes: Sequence[tuple], dtypes: Sequence) -> tuple[KNGraph, list]:
    g = new_kernel_graph()
    return g, [g.new_input(s, d) for s, d in zip(shapes, dtypes)]


def _yr_dtype(dt: torch.dtype) -> DType:
    return {torch.float32: DType.float32, torch.bfloat16: DType.bfloat16, torch.float16: DType.float16}[dt]


# ---- the ops ---------------------------------------------------------------------------------
def _build_matmul(d, dt, quant, gen) -> Workload:
    M, K, N = d["M"], d["K"], d["N"]
    g, (a, b) = _graph([(M, K), (K, N)], [_yr_dtype(dt)] * 2)
    g.mark_output(g.matmul(a, b))
    xs = [_randn(gen, M, K, dtype=dt), _randn(gen, K, N, scale=K ** -0.5, dtype=dt)]
    return Workload(g, xs, xs, torch.matmul, "torch.matmul(a, b)")


def _build_linear(d, dt, quant, gen) -> Workload:
    M, K, N = d["M"], d["K"], d["N"]
    g, (x, w, b) = _graph([(M, K), (N, K), (N,)], [_yr_dtype(dt)] * 3)
    g.mark_output(g.linear(x, w, b))
    xs = [_randn(gen, M, K, dtype=dt), _randn(gen, N, K, scale=K ** -0.5, dtype=dt), _randn(gen, N, dtype=dt)]
    return Workload(g, xs, xs, F.linear, "F.linear(x, w, bias)")


def _build_layer_norm(d, dt, quant, gen) -> Workload:
    M, N = d["M"], d["N"]
    g, (x, w, b) = _graph([(M, N), (N,), (N,)], [_yr_dtype(dt)] * 3)
    g.mark_output(g.layer_norm(x, (N,), w, b, eps=EPS))
    xs = [_randn(gen, M, N, dtype=dt), _randn(gen, N, dtype=dt), _randn(gen, N, dtype=dt)]
    return Workload(g, xs, xs, lambda x, w, b: F.layer_norm(x, (N,), w, b, EPS),
                    "F.layer_norm(x, (N,), weight, bias, eps=1e-5)")


def _build_rms_norm(d, dt, quant, gen) -> Workload:
    M, N = d["M"], d["N"]
    g, (x, w) = _graph([(M, N), (N,)], [_yr_dtype(dt)] * 2)
    g.mark_output(g.mul(g.rms_norm(x, (N,), eps=EPS), w))
    xs = [_randn(gen, M, N, dtype=dt), _randn(gen, N, dtype=dt)]
    return Workload(g, xs, xs, lambda x, w: F.rms_norm(x, (N,), w, EPS), "F.rms_norm(x, (N,), weight, eps=1e-5)")


def _build_softmax(d, dt, quant, gen) -> Workload:
    M, N = d["M"], d["N"]
    g, (x,) = _graph([(M, N)], [_yr_dtype(dt)])
    g.mark_output(g.softmax(x, -1))
    xs = [_randn(gen, M, N, dtype=dt)]
    return Workload(g, xs, xs, lambda x: torch.softmax(x, -1), "torch.softmax(x, dim=-1)")


def _sdpa(qkv: torch.Tensor, B: int, S: int, heads: int) -> torch.Tensor:
    """torch's fused attention over B sentences of S tokens: qkv [B*S, 3*H] -> [B*S, H]."""
    H = qkv.shape[1] // 3
    q, k, v = qkv.view(B, S, 3, heads, H // heads).permute(2, 0, 3, 1, 4)  # [B, heads, S, Dh] views
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B * S, H)


def _offsets(B: int, S: int) -> torch.Tensor:
    return torch.arange(0, (B + 1) * S, S, dtype=torch.int64)


def _build_attention(d, dt, quant, gen) -> Workload:
    B, S, heads = d["B"], d["S"], d["heads"]
    H = heads * d["head_dim"]
    g, (qkv, offsets) = _graph([(B * S, 3 * H), (B + 1,)], [_yr_dtype(dt), DType.int64])
    g.mark_output(g.attention_varlen(qkv, offsets, heads))
    xs = [_randn(gen, B * S, 3 * H, dtype=dt), _offsets(B, S)]
    return Workload(g, xs, xs, lambda qkv, offsets: _sdpa(qkv, B, S, heads),
                    "F.scaled_dot_product_attention per sentence ([B, heads, S, head_dim] views of the packed "
                    "qkv); yirage: attention_varlen over the B sentences packed back to back")


def _block_inputs(d, dt, gen) -> list[torch.Tensor]:
    """x [T, H], offsets, then the layer's weights (torch's [out, in] layout) and norms."""
    B, S, H, Fh = d["B"], d["S"], d["H"], d["ffn"]
    w = lambda n, k: _randn(gen, n, k, scale=k ** -0.5, dtype=dt)  # noqa: E731
    b = lambda n: _randn(gen, n, scale=0.1, dtype=dt)  # noqa: E731
    ones = torch.ones(H, dtype=dt)
    return [_randn(gen, B * S, H, dtype=dt), _offsets(B, S), w(3 * H, H), b(3 * H), w(H, H), b(H), ones, b(H),
            w(Fh, H), b(Fh), w(H, Fh), b(H), ones.clone(), b(H)]


def _build_block(d, dt, quant, gen) -> Workload:
    """A BERT encoder layer (post-norm; Devlin et al. 2019) as one kernel graph:
    h = LN(x + attn(x) Wo), out = LN(h + GELU(h W1) W2), attention over packed sentences."""
    B, S, H, heads = d["B"], d["S"], d["H"], d["heads"]
    xs = _block_inputs(d, dt, gen)
    g = new_kernel_graph()
    x, offsets, wqkv, bqkv, wo, bo, n1w, n1b, w1, b1, w2, b2, n2w, n2b = [
        g.new_input(tuple(t.shape), DType.int64 if t.dtype == torch.int64 else _yr_dtype(dt)) for t in xs]
    a = g.attention_varlen(g.linear(x, wqkv, bqkv), offsets, heads)
    h = g.layer_norm(g.add(x, g.linear(a, wo, bo)), (H,), n1w, n1b, eps=EPS)
    f = g.linear(g.gelu(g.linear(h, w1, b1)), w2, b2)
    g.mark_output(g.layer_norm(g.add(h, f), (H,), n2w, n2b, eps=EPS))

    def eager(x, offsets, wqkv, bqkv, wo, bo, n1w, n1b, w1, b1, w2, b2, n2w, n2b):
        h = F.layer_norm(x + F.linear(_sdpa(F.linear(x, wqkv, bqkv), B, S, heads), wo, bo), (H,), n1w, n1b, EPS)
        return F.layer_norm(h + F.linear(F.gelu(F.linear(h, w1, b1)), w2, b2), (H,), n2w, n2b, EPS)
    return Workload(g, xs, xs, eager, "F.linear, F.scaled_dot_product_attention, F.gelu, F.layer_norm "
                                      "(the same BERT layer, op by op)")


def _build_quantized_gemv(d, dt, quant, gen) -> Workload:
    """x [1, K] times a GGUF block-quantized weight [N, K] (made by gguf-py's quantizer)."""
    K, N = d["K"], d["N"]
    qtype = gguf.GGMLQuantizationType[quant.upper()]
    w = _randn(gen, N, K, scale=K ** -0.5).numpy()
    blocks = np.ascontiguousarray(gguf.quants.quantize(w, qtype))
    w_deq = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(blocks, qtype))).to(dt)
    g, (x, wq) = _graph([(1, K), (N, K)], [_yr_dtype(dt), DType(quant)])
    g.mark_output(g.linear(x, wq))
    x0 = _randn(gen, 1, K, dtype=dt)
    return Workload(g, [x0, torch.from_numpy(blocks)], [x0, w_deq], F.linear,
                    f"F.linear(x, w) on the weight dequantized once before timing (gguf.quants.dequantize, as "
                    f"transformers loads a GGUF file); yirage reads the {quant} blocks in place")


def _rows(b, s, h):
    return {"M": b * s, "N": h}


def _heads(h):
    return {"heads": h // HEAD_DIM, "head_dim": HEAD_DIM}


#: op name -> its spec, in report order
OPS: dict[str, OpSpec] = {
    "matmul": OpSpec(lambda b, s, h: {"M": b * s, "K": h, "N": h}, lambda d: 2.0 * d["M"] * d["K"] * d["N"],
                     _build_matmul),
    "linear": OpSpec(lambda b, s, h: {"M": b * s, "K": h, "N": 4 * h}, lambda d: 2.0 * d["M"] * d["K"] * d["N"],
                     _build_linear),
    "layer_norm": OpSpec(_rows, lambda d: 8.0 * d["M"] * d["N"], _build_layer_norm),
    "rms_norm": OpSpec(_rows, lambda d: 4.0 * d["M"] * d["N"], _build_rms_norm),
    "softmax": OpSpec(_rows, lambda d: 4.0 * d["M"] * d["N"], _build_softmax),
    "attention": OpSpec(lambda b, s, h: {"B": b, "S": s, **_heads(h)},
                        lambda d: 4.0 * d["B"] * d["S"] ** 2 * d["heads"] * d["head_dim"], _build_attention, HEAD_DIM),
    "transformer_block": OpSpec(lambda b, s, h: {"B": b, "S": s, "H": h, "ffn": 4 * h, **_heads(h)},
                                lambda d: 24.0 * d["B"] * d["S"] * d["H"] ** 2 + 4.0 * d["B"] * d["S"] ** 2 * d["H"],
                                _build_block, HEAD_DIM, ("B", "S", "H")),
    "quantized_gemv": OpSpec(lambda b, s, h: {"M": 1, "K": h, "N": 4 * h},
                             lambda d: 2.0 * d["K"] * d["N"], _build_quantized_gemv, 32),
}


# ---- arguments -------------------------------------------------------------------------------
def _positive_ints(what: str, values) -> list[int]:
    values = [values] if isinstance(values, int) else list(values or [])
    if not values:
        raise BenchmarkError(f"{what}: give at least one size")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise BenchmarkError(f"{what}: sizes must be positive integers, got {v!r}")
    return [int(v) for v in values]


def _names(values) -> list[str]:
    """A name, a comma-separated string or a sequence of names -> the names, stripped."""
    items = [values] if isinstance(values, (str, Backend)) else list(values)
    out = []
    for item in items:
        out += [item.value] if isinstance(item, Backend) else [n.strip() for n in str(item).split(",") if n.strip()]
    return out


def _ops(ops) -> list[str]:
    names = list(OPS) if ops is None else _names(ops)
    bad = [n for n in names if n not in OPS]
    if bad or not names:
        raise BenchmarkError(f"unknown op {bad[0] if bad else '(none given)'!r}: choose from {', '.join(OPS)}")
    return list(dict.fromkeys(names))


def _backends(backends, dtype: str) -> list[Backend]:
    """'all' or None: every available backend but 'triton-interpret' (Triton's slow CPU
    interpreter: name it to run it). Named ones are checked: BackendUnavailableError for an
    unknown or unavailable one, BenchmarkError for one whose device cannot hold ``dtype``."""
    names = _names("all" if backends is None else backends)
    if not names:
        raise BenchmarkError("backends: give 'all' or at least one backend name")
    found: list[Backend] = []
    for name in names:
        if name.lower() == "all":
            found += [b for b in get_available_backends() if b != Backend.TRITON_INTERPRET]
            continue
        b = resolve_backend(name)
        problem = _dtype_problem(b, dtype)
        if problem:
            raise BenchmarkError(f"{problem}: choose another --dtype ({', '.join(DTYPES)})")
        found.append(b)
    return list(dict.fromkeys(found))


def _dtype_problem(backend: Backend, dtype: str) -> str | None:
    """Why ``backend``'s device cannot compute in ``dtype``, or None when it can."""
    try:
        torch.ones(2, dtype=getattr(torch, dtype), device=get_backend_impl(backend).torch_device).sum()
    except (RuntimeError, TypeError) as e:
        return f"backend {backend.value} cannot hold {dtype} tensors ({' '.join(str(e).split())})"
    return None


def _timing_mode(duration_seconds, iterations) -> tuple[float | None, int | None]:
    if duration_seconds is not None and iterations is not None:
        raise BenchmarkError("give a duration (duration_seconds, --duration) or a number of iterations "
                             "(iterations, --iterations), not both")
    if iterations is not None:
        if isinstance(iterations, bool) or not isinstance(iterations, (int, np.integer)) or iterations < 1:
            raise BenchmarkError(f"iterations must be a positive integer (rounds per case), got {iterations!r}")
        return None, int(iterations)
    d = DEFAULT_DURATION_S if duration_seconds is None else duration_seconds
    if isinstance(d, bool) or not isinstance(d, (int, float)) or not math.isfinite(d) or d <= 0:
        raise BenchmarkError(f"duration must be a positive number of seconds, got {duration_seconds!r}")
    return float(d), None


def _check_choice(what: str, value, choices: Sequence[str]) -> str:
    if value not in choices:
        raise BenchmarkError(f"unknown {what} {value!r}: choose from {', '.join(choices)}")
    return value


def _check_gflop(max_gflop) -> float:
    if isinstance(max_gflop, bool) or not isinstance(max_gflop, (int, float)) or not max_gflop > 0:
        raise BenchmarkError(f"max_gflop must be a positive number, got {max_gflop!r}")
    return float(max_gflop)


# ---- one case --------------------------------------------------------------------------------
def _plan_cases(backends, ops, batch_sizes, seq_lengths, hidden_sizes, dtype) -> list[dict]:
    """Every (backend, op, shape) to run, each shape once per op (the GEMV's does not
    depend on batch and sequence length)."""
    cases, seen = [], set()
    for backend, op, b, s, h in itertools.product(backends, ops, batch_sizes, seq_lengths, hidden_sizes):
        dims = OPS[op].dims(b, s, h)
        if (backend, op, tuple(dims.items())) in seen:
            continue
        seen.add((backend, op, tuple(dims.items())))
        cases.append({"backend": backend.value, "op": op, "shape": OPS[op].label(dims), "dims": dims,
                      "hidden_size": h, "dtype": dtype, "flops": OPS[op].flops(dims), "status": None})
    return cases


def _skip_reason(case: dict, max_gflop: float) -> str | None:
    """Why ``case`` is not run at all (too big, a hidden size the op cannot split, a dtype the
    backend's device cannot hold), or None."""
    gflop = case["flops"] / 1e9
    if gflop > max_gflop:
        return f"{gflop:.1f} GFLOP per call is above the cap of {max_gflop:g} GFLOP (max_gflop, --max-gflop)"
    need, h = OPS[case["op"]].needs, case["hidden_size"]
    if h % need:
        unit = f"attention heads of {HEAD_DIM}" if need == HEAD_DIM else "GGUF blocks of 32"
        return f"hidden size {h} is not a multiple of {need} ({unit})"
    return _dtype_problem(Backend(case["backend"]), case["dtype"])


def _unsupported(graph, impl) -> str | None:
    """Why the backend would not run one of ``graph``'s library ops with a kernel of its own
    (the executor would run torch's reference: not a yirage figure), or None."""
    for node in graph.ops:
        if IR_OPS[node.op].kind == "library" and node.op not in VIEW_OPS and not impl.supports(node, graph):
            kinds = ", ".join(dict.fromkeys(graph.tensors[i].dtype.value for i in node.inputs))
            return (f"backend {impl.name.value} has no {node.op} kernel for ({kinds}) inputs: the executor would run "
                    "torch's reference, which is not a yirage figure")
    return None


def _check_output(case: dict, out: torch.Tensor, w: Workload, torch_inputs: list[torch.Tensor]) -> bool:
    """Record yirage's and torch's max abs error against torch eager in float32 on the CPU
    (the case's inputs upcast) and the tolerance; False (status ``wrong``) when yirage is
    outside it or not finite."""
    ref = w.eager(*[t.float() if t.is_floating_point() else t for t in w.torch_inputs])
    scale = max(1.0, float(ref.abs().max()))
    err = float((out.detach().float().cpu() - ref).abs().max())
    torch_err = float((w.eager(*torch_inputs).float().cpu() - ref).abs().max())
    tol = TOLERANCE[case["dtype"]] * scale
    case.update(max_abs_error=err, torch_max_abs_error=torch_err, tolerance=tol)
    if err <= tol:
        return True
    case.update(status="wrong", reason=f"max |yirage - torch eager in float32| = {err:.3g} exceeds the tolerance "
                                       f"{tol:.3g}: not timed")
    return False


def _measure(case: dict, quant: str, rounds: int, share_s: float | None) -> None:
    """Build, check and time one case; fills ``case`` in place."""
    impl = get_backend_impl(case["backend"])
    w = OPS[case["op"]].build(case["dims"], getattr(torch, case["dtype"]), quant, torch.Generator().manual_seed(0))
    case["torch_side"] = w.torch_side
    why = _unsupported(w.graph, impl)
    if why:
        case.update(status="skipped", reason=why)
        return
    dev = impl.torch_device
    xs, ts = [t.to(dev) for t in w.inputs], [t.to(dev) for t in w.torch_inputs]
    plan = w.graph.compile(case["backend"]).plan(xs)
    case["yirage_kernels"] = plan.cg.num_kernels
    if not _check_output(case, plan.run()[0], w, ts):
        return
    deadline = None if share_s is None else time.perf_counter() + share_s
    cmp = compare({"yirage": plan.run, "torch": lambda: w.eager(*ts)}, rounds=rounds, sync=impl.synchronize,
                  deadline=deadline, min_rounds=MIN_ROUNDS)
    case.update(status="ok", yirage_s=cmp.median("yirage"), torch_s=cmp.median("torch"),
                speedup=statistics.median(cmp.ratios("torch", "yirage")), rounds=len(cmp.rounds),
                calls_per_sample=dict(cmp.calls))


def _run_case(case: dict, max_gflop: float, quant: str, rounds: int, share_s: float | None) -> None:
    """``_measure`` unless the case is skipped; a failure to build or run it is recorded as
    status ``error`` (with the exception) and the run goes on."""
    skip = _skip_reason(case, max_gflop)
    if skip:
        case.update(status="skipped", reason=skip)
        return
    try:
        _measure(case, quant, rounds, share_s)
    except Exception as e:  # noqa: BLE001 - one case's failure is reported; the others still run
        case.update(status="error", reason=f"{type(e).__name__}: {' '.join(str(e).split())}")


# ---- the run ---------------------------------------------------------------------------------
def benchmark_backends(duration_seconds: float | None = None, backends=None, *, iterations: int | None = None,
                       ops=None, batch_sizes=(1,), seq_lengths=(128,), hidden_sizes=(768,), dtype: str = "float32",
                       quant_type: str = "q4_0", max_gflop: float = DEFAULT_MAX_GFLOP,
                       progress: Callable[[dict], None] | None = None) -> dict:
    """Benchmark yirage against torch eager, op by op, on each backend (module docstring).

    Args:
        duration_seconds: seconds of timing in all, shared equally among the cases (building,
            compiling and checking come on top; each timed case takes at least 3 rounds, at
            most 100). Default 10 s unless ``iterations`` is given; not both.
        backends: 'all' or None (every available backend but 'triton-interpret', which must
            be named), a name, a comma-separated string or a list of names.
        iterations: interleaved rounds per case instead of a duration (each round is one
            sample of each side; a sample lasts >= ``runtime.timing.MIN_SAMPLE_S``).
        ops: names from ``OPS`` (default all): matmul, linear, layer_norm, rms_norm, softmax,
            attention (encoder attention over packed sentences), transformer_block (a BERT
            encoder layer), quantized_gemv (M = 1, a ``quant_type`` GGUF weight).
        batch_sizes: positive integers; each combination of batch size, sequence length and
            hidden size gives one shape per op (rows = batch x seq for the row ops; hidden
            sizes that are not a multiple of 64 skip the attention ops, of 32 the GEMV).
        seq_lengths: positive integers (see ``batch_sizes``).
        hidden_sizes: positive integers (see ``batch_sizes``).
        dtype: activation dtype, one of ``DTYPES``.
        quant_type: the GEMV's weight type, one of ``QUANT_TYPES``.
        max_gflop: cases above this many GFLOP (1e9 floating-point operations) per call are
            skipped and say so.
        progress: called with each case's dict once it is done.

    Returns: a JSON-ready dict: ``machine`` (``runtime.machine.machine_record()``),
    ``arguments``, ``backends`` (each one's ``BackendInfo``), ``timing`` (how), ``cases``
    (per case: backend, op, shape, dims, dtype, flops, status ok|wrong|skipped|error,
    reason, yirage_s and torch_s (median seconds per call), speedup (torch / yirage, the median
    of the paired per-round ratios), max_abs_error, torch_max_abs_error, tolerance,
    torch_side) and ``summary`` (per backend: counts by status, geometric mean speedup).

    Raises BenchmarkError for bad arguments; BackendUnavailableError for an unknown or
    unavailable backend. A case that fails is reported in its status, never raised.
    """
    share_total, rounds = _timing_mode(duration_seconds, iterations)
    dtype = _check_choice("dtype", dtype, DTYPES)
    quant_type = _check_choice("quantization type", quant_type, QUANT_TYPES)
    sizes = [_positive_ints(w, v) for w, v in (("batch sizes", batch_sizes), ("sequence lengths", seq_lengths),
                                               ("hidden sizes", hidden_sizes))]
    chosen, op_names, cap = _backends(backends, dtype), _ops(ops), _check_gflop(max_gflop)
    cases = _plan_cases(chosen, op_names, *sizes, dtype)
    share_s = None if share_total is None else share_total / max(1, len(cases))
    for case in cases:
        _run_case(case, cap, quant_type, rounds or MAX_ROUNDS, share_s)
        if progress is not None:
            progress(case)
    arguments = {"backends": [b.value for b in chosen], "ops": op_names, "batch_sizes": sizes[0],
                 "seq_lengths": sizes[1], "hidden_sizes": sizes[2], "dtype": dtype, "quant_type": quant_type,
                 "duration_seconds": share_total, "iterations": iterations, "max_gflop": cap}
    return {"machine": machine_record(), "arguments": arguments,
            "backends": {b.value: get_backend_info(b).to_dict() for b in chosen},
            "timing": {"harness": "yirage.runtime.timing.compare", "min_sample_s": MIN_SAMPLE_S,
                       "speedup": "median over interleaved rounds of torch's time / yirage's time in that round",
                       "reference": "torch eager in float32 on the CPU, from the same inputs",
                       "tolerance": "TOLERANCE[dtype] * max(1, max |reference|)"},
            "cases": cases, "summary": _summary(cases)}


def _summary(cases: list[dict]) -> dict:
    """Per backend: how many cases ended in each status, and the geometric mean speedup of
    the timed ones (None when none was timed)."""
    out: dict[str, dict] = {}
    for c in cases:
        s = out.setdefault(c["backend"], {"ok": 0, "wrong": 0, "skipped": 0, "error": 0, "geomean_speedup": None})
        s[c["status"]] += 1
    for name, s in out.items():
        ups = [c["speedup"] for c in cases if c["backend"] == name and c["status"] == "ok"]
        s["geomean_speedup"] = math.exp(statistics.fmean(map(math.log, ups))) if ups else None
    return out


# ---- reports ---------------------------------------------------------------------------------
def _seconds(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1e6:.1f} us" if s < 1e-3 else f"{s * 1e3:.2f} ms"


def results_table(result: dict):
    """A ``rich.table.Table`` of ``benchmark_backends``'s cases: backend, op, shape, both
    median times, speedup, max abs error, status (with the reason of a case not timed)."""
    from rich.table import Table

    table = Table(title=f"yirage vs torch eager, {result['arguments']['dtype']} (speedup: torch time / yirage "
                        "time, median of paired rounds)")
    for col in ("backend", "op", "shape", "yirage", "torch", "speedup", "max error", "status"):
        table.add_column(col, justify="right" if col in ("yirage", "torch", "speedup", "max error") else "left")
    for c in result["cases"]:
        err = c.get("max_abs_error")
        status = c["status"] if c["status"] == "ok" else f"{c['status']}: {c.get('reason', '')}"
        table.add_row(c["backend"], c["op"], c["shape"], _seconds(c.get("yirage_s")), _seconds(c.get("torch_s")),
                      f"{c['speedup']:.2f}x" if c.get("speedup") else "-", "-" if err is None else f"{err:.1e}",
                      status)
    return table


def plot_speedups(result: dict, path: str) -> str:
    """Draw the timed cases' speedups as a bar chart (one group per op and shape, one bar per
    backend, a line at 1x) into ``path`` with matplotlib; its suffix picks the format (.png).
    Returns ``path``. Raises BenchmarkError when matplotlib is missing (``pip install
    'yirage[plot]'``), the format is unknown or the file cannot be written."""
    try:
        import matplotlib  # noqa: F401  (first: a cached matplotlib.figure must not hide its absence)
        from matplotlib.figure import Figure
    except ImportError:
        raise BenchmarkError("plotting needs matplotlib, which is not installed: pip install 'yirage[plot]'") from None
    timed = [c for c in result["cases"] if c["status"] == "ok"]
    groups = list(dict.fromkeys(f"{c['op']} {c['shape']}" for c in timed))
    backends = list(dict.fromkeys(c["backend"] for c in timed))
    fig = Figure(figsize=(max(6.0, 0.8 * len(groups) + 2), 4.5))
    ax = fig.subplots()
    width = 0.8 / max(1, len(backends))
    for i, b in enumerate(backends):
        mine = [c for c in timed if c["backend"] == b]
        xs = [groups.index(f"{c['op']} {c['shape']}") + (i - (len(backends) - 1) / 2) * width for c in mine]
        ax.bar(xs, [c["speedup"] for c in mine], width, label=b)
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax.set_xticks(range(len(groups)), groups, fontsize=7, rotation=30, ha="right")
    ax.set_ylabel("speedup over torch eager (x)")
    ax.set_title(f"yirage vs torch eager, {result['arguments']['dtype']}, {result['machine']['cpu']}"
                 + ("" if timed else ": no case was timed"), fontsize=9)
    if backends:
        ax.legend()
    try:
        fig.savefig(path, dpi=120, bbox_inches="tight")
    except (OSError, ValueError) as e:
        raise BenchmarkError(f"cannot write the plot to {path}: {' '.join(str(e).split())}") from None
    return str(path)


__all__ = ["benchmark_backends", "results_table", "plot_speedups", "OPS", "DTYPES", "QUANT_TYPES",
           "DEFAULT_DURATION_S", "DEFAULT_MAX_GFLOP"]
