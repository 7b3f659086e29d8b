"""Mirage's benchmark graphs on the CPU, float32: torch eager, torch.compile, yirage fixed fusion and
yirage superoptimized, side by side in one run; prints one JSON object.

The graphs are those of Mirage's ``benchmark/`` directory (gated_mlp.py, rmsnorm.py, lora.py,
group_query_attention.py, norm_transformer.py, qknorm_gqa.py), at decode-like shapes, float32:

- ``gated_mlp``: X [8, 4096], W1, W2 [4096, 4096]: ``silu(X @ W1) * (X @ W2)``.
- ``rmsnorm_matmul``: X [2, 4096], W [4096, 6144]: ``rms_norm(X) @ W`` (RMSNorm over 4096, no weight).
- ``lora``: X [16, 256], W [256, 256], A [256, 16], B [16, 256]: ``X @ W + (X @ A) @ B``.
- ``gqa``: decode step of group-query attention, batch 1, 32 query heads, 8 KV heads, head dim
  128, one query token, KV length 4096. Q [32, 128] is reshaped to [8, 4, 128] (the 4 query heads
  of each KV head in a row), K^T [8, 128, 4096], V [8, 4096, 128]:
  ``softmax(scale(Q @ K^T, 1/sqrt(128))) @ V`` reshaped back to [32, 128].
- ``norm_transformer``: a simplified nGPT block (Loshchilov et al. 2024, "nGPT"; Mirage's
  norm_transformer.py has the same normalize / lerp / normalize structure without the matmul):
  X, alpha [8, 4096], W [4096, 4096]: ``H = X @ W; O = rms_norm(X + alpha * (rms_norm(H) - X))``
  (RMSNorm, no weight, stands in for nGPT's L2 normalization, as in Mirage).
- ``qknorm_gqa``: ``gqa`` with q and k RMS-normalized over the head dim first. q goes through
  ``rms_norm`` (eps 1e-6); K comes transposed ([8, 128, 4096], head dim not last) and the graph
  has no transpose, so k's norm is written out: ``rsqrt(reduction(square(K^T), -2) / 128)``
  ([8, 1, 4096], eps 0) multiplies the scores column by column, which equals
  ``q . rms_norm(k_j)`` for every key j.

``--small`` divides the big dims (4096, 6144, KV length) by 8 for a quick run (LoRA is unchanged).

Columns, per graph, timed by ``yirage.runtime.timing.compare`` (yirage's one measurement
harness): interleaved rounds, each round one sample (a batch of calls lasting at least
``--min-time / --rounds`` seconds) of every column in an order rotated from round to round, so
load from other processes hits them alike; each ``us`` figure is the median over the rounds of
microseconds per call, after warm-up, and each speedup the median over the rounds of the ratio
of the two columns' times in the same round. All columns run in this one process (unlike
decode.py's and embed.py's sides): they are torch functions and yirage graphs built here, not
external engines whose crash the others must survive.

- ``torch_eager``: the graph written as plain torch ops.
- ``torch_compile``: ``torch.compile`` of that function (Inductor, default mode), warmed up
  (compile time reported apart).
- ``yirage_fixed``: ``g(inputs=[...], backend="cpu")``, yirage's fixed fusion rules
  (``g.compile("cpu")`` first; its time reported apart).
- ``yirage_superopt``: ``opt = g.superoptimize(backend="cpu", time_budget_s=..., warmup_iters=...,
  profile_iters=...)``, then ``opt(inputs=[...])``. ``search_s`` is the wall clock of that call,
  made with ``use_cached_graphs=False`` (the winner is cached on disk, so an earlier run would
  otherwise make it a cache hit; ``--reuse-cache`` allows that), ``cached_call_s`` that of a
  second call with the cache allowed (which should hit it), ``report`` is ``opt.report``
  (``cached_report`` the second call's). When ``g.superoptimize`` does not exist (or fails)
  the column says why and the other columns still run.

Two more columns (``--no-plans`` leaves them out): ``yirage_fixed_plan`` and
``yirage_superopt_plan`` run a plan bound once to the inputs (``g.compile("cpu").plan(inputs).run``,
``opt.compile().plan(inputs).run``), as a decode loop does and as the search times its
candidates: the ``g(inputs=...)`` / ``opt(inputs=...)`` call builds a new plan (buffers, launch
thunks) every call, and for these microsecond-sized graphs that cost can dominate.

Every graph is checked first: ``g.interpret`` (yirage's torch reference) must match the eager
function (assert close). ``max_abs_err`` gives each yirage column's (and torch.compile's) largest
difference from torch eager. Speedups are time ratios, > 1 means the yirage column is faster:
``speedup_superopt_vs_compile`` = torch.compile time / superoptimized time (median of the
paired ratios), per graph, with its
geometric mean and minimum over the graphs in ``summary`` (the same for ``yirage_fixed`` and for
the plan columns: ``speedup_superopt_plan_vs_compile``, ``speedup_superopt_plan_vs_fixed_plan``).

    PYTHONPATH=src python benchmarks/superoptimize.py [--small] [--graphs gqa,lora] [--threads 2]
        [--time-budget 60] [--warmup-iters N] [--profile-iters N] [--reuse-cache] [--no-plans]
        [--min-time 1.0] [--rounds 15]

``machine`` is ``yirage.runtime.machine.machine_record()``.
The machine may be shared with other jobs: figures are noisy; compare within one run.
"""
from __future__ import annotations

import os
import sys


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _threads  # noqa: E402,F401  (sets OMP_NUM_THREADS from --threads before torch loads)
from _plot import add_plot_option, figure, save  # noqa: E402

import argparse  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import yirage as yr  # noqa: E402
from yirage.runtime import timing  # noqa: E402
from yirage.runtime.machine import machine_record  # noqa: E402

EPS = 1e-6


def _rms(x: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """RMSNorm over the last dim, no weight (yirage's rms_norm)."""
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


def _randn(*shape, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float32) * scale


# ---- the graphs: each builder returns (kernel graph, input tensors, eager function, shapes) -------
def gated_mlp(d: int):
    M, K, N = 8, 4096 // d, 4096 // d
    g = yr.new_kernel_graph()
    X = g.new_input(dims=(M, K), dtype=yr.float32)
    W1 = g.new_input(dims=(K, N), dtype=yr.float32)
    W2 = g.new_input(dims=(K, N), dtype=yr.float32)
    g.mark_output(g.mul(g.silu(g.matmul(X, W1)), g.matmul(X, W2)))

    def eager(x, w1, w2):
        return F.silu(x @ w1) * (x @ w2)
    inputs = [_randn(M, K), _randn(K, N, scale=K ** -0.5), _randn(K, N, scale=K ** -0.5)]
    return g, inputs, eager, {"X": [M, K], "W1": [K, N], "W2": [K, N]}


def rmsnorm_matmul(d: int):
    M, K, N = 2, 4096 // d, 6144 // d
    g = yr.new_kernel_graph()
    X = g.new_input(dims=(M, K), dtype=yr.float32)
    W = g.new_input(dims=(K, N), dtype=yr.float32)
    g.mark_output(g.matmul(g.rms_norm(X, normalized_shape=(K,), eps=EPS), W))

    def eager(x, w):
        return _rms(x) @ w
    return g, [_randn(M, K), _randn(K, N, scale=K ** -0.5)], eager, {"X": [M, K], "W": [K, N]}


def lora(d: int):
    M, K, N, R = 16, 256, 256, 16
    g = yr.new_kernel_graph()
    X = g.new_input(dims=(M, K), dtype=yr.float32)
    W = g.new_input(dims=(K, N), dtype=yr.float32)
    A = g.new_input(dims=(K, R), dtype=yr.float32)
    B = g.new_input(dims=(R, N), dtype=yr.float32)
    g.mark_output(g.add(g.matmul(X, W), g.matmul(g.matmul(X, A), B)))

    def eager(x, w, a, b):
        return x @ w + (x @ a) @ b
    inputs = [_randn(M, K), _randn(K, N, scale=K ** -0.5), _randn(K, R, scale=K ** -0.5), _randn(R, N, scale=R ** -0.5)]
    return g, inputs, eager, {"X": [M, K], "W": [K, N], "A": [K, R], "B": [R, N]}


HQ, HKV, DH = 32, 8, 128


def _gqa(d: int, qknorm: bool):
    S, G = 4096 // d, HQ // HKV
    g = yr.new_kernel_graph()
    Q = g.new_input(dims=(HQ, DH), dtype=yr.float32)
    Kt = g.new_input(dims=(HKV, DH, S), dtype=yr.float32)
    V = g.new_input(dims=(HKV, S, DH), dtype=yr.float32)
    q = g.reshape(Q, (HKV, G, DH))
    if qknorm:
        q = g.rms_norm(q, normalized_shape=(DH,), eps=EPS)
    s = g.matmul(q, Kt)                                                   # [HKV, G, S]
    if qknorm:   # k_j / rms(k_j) over the head dim (dim -2 of K^T): scale score column j
        inv = g.rsqrt(g.scale(g.reduction(g.square(Kt), -2), 1.0 / DH))  # [HKV, 1, S]
        s = g.mul(s, inv)
    p = g.softmax(g.scale(s, DH ** -0.5), dim=-1)
    g.mark_output(g.reshape(g.matmul(p, V), (HQ, DH)))

    def eager(q, kt, v):
        q = q.reshape(HKV, G, DH)
        if qknorm:
            q = _rms(q)
            kt = kt * torch.rsqrt(kt.square().mean(-2, keepdim=True))
        p = torch.softmax((q @ kt) * DH ** -0.5, dim=-1)
        return (p @ v).reshape(HQ, DH)
    inputs = [_randn(HQ, DH), _randn(HKV, DH, S), _randn(HKV, S, DH)]
    return g, inputs, eager, {"Q": [HQ, DH], "K_t": [HKV, DH, S], "V": [HKV, S, DH]}


def gqa(d: int):
    return _gqa(d, qknorm=False)


def qknorm_gqa(d: int):
    return _gqa(d, qknorm=True)


def norm_transformer(d: int):
    M, D = 8, 4096 // d
    g = yr.new_kernel_graph()
    X = g.new_input(dims=(M, D), dtype=yr.float32)
    W = g.new_input(dims=(D, D), dtype=yr.float32)
    alpha = g.new_input(dims=(M, D), dtype=yr.float32)
    h = g.rms_norm(g.matmul(X, W), normalized_shape=(D,), eps=EPS)
    c = g.add(X, g.mul(alpha, g.sub(h, X)))
    g.mark_output(g.rms_norm(c, normalized_shape=(D,), eps=EPS))

    def eager(x, w, a):
        return _rms(x + a * (_rms(x @ w) - x))
    inputs = [_rms(_randn(M, D)), _randn(D, D, scale=D ** -0.5), torch.rand(M, D) * 0.1]
    return g, inputs, eager, {"X": [M, D], "W": [D, D], "alpha": [M, D]}


GRAPHS = {"gated_mlp": gated_mlp, "rmsnorm_matmul": rmsnorm_matmul, "lora": lora, "gqa": gqa,
          "norm_transformer": norm_transformer, "qknorm_gqa": qknorm_gqa}


# ---- timing ---------------------------------------------------------------------------------------
def _bench(contenders: dict, args) -> timing.Comparison:
    """The contenders in ``args.rounds`` interleaved rounds of at least ``args.min_time /
    args.rounds`` seconds per sample, after 3 warm-up calls each (caches, thread pools)."""
    return timing.compare(contenders, rounds=args.rounds, min_sample_s=args.min_time / args.rounds, warmup=3)


def _err(out, ref: torch.Tensor) -> float:
    if isinstance(out, (list, tuple)):
        out = out[0]
    return float((out.float() - ref).abs().max())


def _jsonable(x):
    """``opt.report`` as JSON: dicts/lists walked, numbers and strings kept, anything else repr'd."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return repr(x)


def _superoptimize(g, args) -> tuple[object, dict]:
    """(opt or None, the JSON fields of the superoptimized column apart from its timing)."""
    if not hasattr(g, "superoptimize"):
        return None, {"skipped": "g.superoptimize not available"}
    kw = dict(backend="cpu", time_budget_s=args.time_budget)
    if args.warmup_iters is not None:
        kw["warmup_iters"] = args.warmup_iters
    if args.profile_iters is not None:
        kw["profile_iters"] = args.profile_iters
    first = dict(kw)
    if not args.reuse_cache and "use_cached_graphs" in inspect.signature(g.superoptimize).parameters:
        first["use_cached_graphs"] = False   # the winner is cached on disk: search afresh
    col: dict = {}
    try:
        t0 = time.perf_counter()
        opt = g.superoptimize(**first)
        col["search_s"] = round(time.perf_counter() - t0, 3)
        col["report"] = _jsonable(getattr(opt, "report", None))
    except Exception as e:  # the search is new: report its failure, keep the other columns
        return None, {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=6)}
    try:
        t0 = time.perf_counter()
        opt2 = g.superoptimize(**kw)           # use_cached_graphs left at its default (True)
        col["cached_call_s"] = round(time.perf_counter() - t0, 4)
        col["cached_report"] = _jsonable(getattr(opt2, "report", None))
    except Exception as e:
        col["cached_call_error"] = f"{type(e).__name__}: {e}"
    return opt, col


def run_graph(name: str, args) -> dict:
    torch.manual_seed(0)
    g, inputs, eager, shapes = GRAPHS[name](8 if args.small else 1)
    res: dict = {"shapes": {k: "x".join(map(str, v)) for k, v in shapes.items()}}
    with torch.no_grad():
        ref = eager(*inputs)
        # the graph is the function: yirage's reference interpreter matches torch eager
        torch.testing.assert_close(g.interpret(inputs)[0], ref, rtol=1e-4, atol=1e-4)

        t0 = time.perf_counter()
        compiled = torch.compile(eager)
        out_c = compiled(*inputs)
        res["torch_compile_first_call_s"] = round(time.perf_counter() - t0, 3)

        t0 = time.perf_counter()
        cg = g.compile("cpu")
        res["yirage_fixed_compile_s"] = round(time.perf_counter() - t0, 3)
        res["yirage_fixed_kernels"] = cg.num_kernels
        out_f = g(inputs=inputs, backend="cpu")

        opt, sup = _superoptimize(g, args)
        out_s = None
        if opt is not None:
            try:
                out_s = opt(inputs=inputs)
            except Exception as e:
                sup["run_error"] = f"{type(e).__name__}: {e}"
                sup["traceback"] = traceback.format_exc(limit=6)
                opt = None

        contenders = {"torch_eager": lambda: eager(*inputs), "torch_compile": lambda: compiled(*inputs),
                      "yirage_fixed": lambda: g(inputs=inputs, backend="cpu")}
        if opt is not None:
            contenders["yirage_superopt"] = lambda: opt(inputs=inputs)
        if args.plans:
            contenders["yirage_fixed_plan"] = cg.plan(inputs).run
            if opt is not None and hasattr(opt, "compile"):
                try:
                    contenders["yirage_superopt_plan"] = opt.compile().plan(inputs).run
                except Exception as e:
                    sup["plan_error"] = f"{type(e).__name__}: {e}"
        try:
            cmp = _bench(contenders, args)
        except Exception as e:   # e.g. the superoptimized graph fails on a later call: time without it
            sup["run_error"] = f"{type(e).__name__}: {e}"
            contenders.pop("yirage_superopt", None)
            contenders.pop("yirage_superopt_plan", None)
            opt, out_s = None, None
            cmp = _bench(contenders, args)

    t = {name: cmp.median(name) for name in cmp.names}
    res["us"] = {k: round(v * 1e6, 2) for k, v in t.items()}
    res["max_abs_err"] = {"torch_compile": _err(out_c, ref), "yirage_fixed": _err(out_f, ref)}
    if out_s is not None:
        res["max_abs_err"]["yirage_superopt"] = _err(out_s, ref)
    res["max_abs_ref"] = float(ref.abs().max())
    speedups = {"fixed_vs_compile": ("torch_compile", "yirage_fixed"),
                "superopt_vs_compile": ("torch_compile", "yirage_superopt"),
                "superopt_vs_fixed": ("yirage_fixed", "yirage_superopt"),
                "superopt_vs_eager": ("torch_eager", "yirage_superopt"),
                "superopt_plan_vs_compile": ("torch_compile", "yirage_superopt_plan"),
                "superopt_plan_vs_fixed_plan": ("yirage_fixed_plan", "yirage_superopt_plan")}
    for key, (slow, fast) in speedups.items():
        if slow in t and fast in t:   # slow's time over fast's, median of the paired ratios
            res[f"speedup_{key}"] = round(cmp.ratio(slow, fast), 3)
    res["yirage_superopt"] = sup
    return res


def _summary(results: dict, key: str) -> dict | None:
    vals = [r[key] for r in results.values() if key in r]
    if not vals:
        return None
    gm = math.exp(sum(math.log(v) for v in vals) / len(vals))
    worst = min(results, key=lambda n: results[n].get(key, math.inf))
    return {"graphs": len(vals), "geomean": round(gm, 3), "min": round(min(vals), 3), "min_graph": worst}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--graphs", default=",".join(GRAPHS),
                    help=f"comma-separated subset of: {', '.join(GRAPHS)}")
    ap.add_argument("--small", action="store_true", help="big dims / 8: a quick run")
    ap.add_argument("--time-budget", type=float, default=60.0, help="time_budget_s of g.superoptimize")
    ap.add_argument("--warmup-iters", type=int, default=None,
                    help="warmup_iters of g.superoptimize (default: its own default)")
    ap.add_argument("--profile-iters", type=int, default=None,
                    help="profile_iters of g.superoptimize (default: its own default)")
    ap.add_argument("--reuse-cache", action="store_true",
                    help="let the first superoptimize call return a winner cached by an earlier run "
                         "(default: use_cached_graphs=False, so search_s times a real search)")
    ap.add_argument("--min-time", type=float, default=1.0, help="seconds of timed calls per column and graph")
    ap.add_argument("--no-plans", dest="plans", action="store_false",
                    help="leave out the yirage_*_plan columns (prebound plans)")
    ap.add_argument("--rounds", type=int, default=15, help="interleaved rounds (the median is over these)")
    add_plot_option(ap)
    return ap


def main() -> None:
    ap = parser()
    args = ap.parse_args()
    names = [n.strip() for n in args.graphs.split(",") if n.strip()]
    unknown = [n for n in names if n not in GRAPHS]
    if unknown:
        ap.error(f"unknown graph(s) {unknown}; choose from {list(GRAPHS)}")
    torch.set_num_threads(args.threads)

    results = {}
    for n in names:
        results[n] = run_graph(n, args)
        print(f"[superoptimize bench] {n}: {results[n]['us']}", file=sys.stderr, flush=True)
    out = {
        "machine": machine_record(),
        "dtype": "float32",
        "small": args.small,
        "superoptimize_available": hasattr(yr.new_kernel_graph(), "superoptimize"),
        "superoptimize_args": {"backend": "cpu", "time_budget_s": args.time_budget,
                               "warmup_iters": args.warmup_iters if args.warmup_iters is not None else "default",
                               "profile_iters": args.profile_iters if args.profile_iters is not None else "default",
                               "first_call_use_cached_graphs": bool(args.reuse_cache)},
        "min_time_s": args.min_time,
        "rounds": args.rounds,
        "graphs": results,
        "summary": {"speedup_superopt_vs_compile": _summary(results, "speedup_superopt_vs_compile"),
                    "speedup_fixed_vs_compile": _summary(results, "speedup_fixed_vs_compile"),
                    "speedup_superopt_vs_fixed": _summary(results, "speedup_superopt_vs_fixed"),
                    "speedup_superopt_plan_vs_compile": _summary(results, "speedup_superopt_plan_vs_compile"),
                    "speedup_superopt_plan_vs_fixed_plan": _summary(results, "speedup_superopt_plan_vs_fixed_plan")},
    }
    print(json.dumps(out, indent=1))
    if args.plot:
        save(plot_figure(out), args.plot)


#: the peers of the superoptimized graph in a figure: (key of speedup_superopt_vs_*, label)
PLOT_PEERS = (("eager", "torch eager"), ("compile", "torch.compile"), ("fixed", "yirage fixed fusion"))


def plot_figure(out: dict) -> dict | None:
    """The figure (``benchmarks/_plot.py``): the superoptimized graph's speed over torch eager's,
    torch.compile's and yirage's own fixed fusion's, per graph (medians of the paired ratios)."""
    bars = [{"group": name, "series": f"vs {label}", "ratio": r[f"speedup_superopt_vs_{key}"]}
            for name, r in out["graphs"].items() for key, label in PLOT_PEERS if r.get(f"speedup_superopt_vs_{key}")]
    return figure("superoptimize", "superoptimized graphs (Mirage's benchmark graphs) over each peer, float32"
                  + (" (--small)" if out["small"] else ""), out["machine"], bars) if bars else None


if __name__ == "__main__":
    main()
