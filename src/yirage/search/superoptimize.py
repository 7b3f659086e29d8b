"""``g.superoptimize()``: search equivalent µGraphs of a kernel graph, verify, time, keep the fastest.

The search follows Mirage (Wu et al., "Mirage: A Multi-Level Superoptimizer for Tensor
Programs", OSDI 2025): generate candidate programs at the kernel and block levels, prove each
equivalent to the input before it may be timed, time the survivors on the target backend and
keep the fastest. Here:

1. Candidates. The input graph as yirage's fixed fusion compiles it (always candidate 0), and,
   for graphs of the shared-row-matmul family (search/mugraph.py: gated MLP, RMSNorm +
   matmul, LoRA, a matmul with an elementwise epilogue; the rest of a larger graph left to
   the fixed fusion as a second kernel), one block graph per schedule: grid partition of N,
   for-loop range over K, with RMSNorm's scale moved across the matmuls;
   for attention (search/attention.py: ``softmax(c * Q K^T) V``, optionally with the key
   norm of QK-norm attention), Mirage's flash-decoding pair of block graphs per schedule:
   key splits over the grid, for-loop tiles, softmax's 1/sum moved across the matmul with V.
   Thread widths (``_widths``): the three most promising schedules are also tried on one
   CPU thread (OpenMP ``num_threads``), or on GPUs with 256 and 64 threads per block (8 and
   2 warps). Schedules are tried most promising first until ``time_budget_s`` runs out. On GPU
   backends a schedule's tiles must fit ``GPU_TILE_BYTES`` (shared memory), and a candidate
   the backend fails to build is dropped and counted (``report["build_errors"]``).
2. Verification. Each candidate runs on ``VERIFY_DRAWS`` independent draws of random inputs
   (uniform in [-1, 1]) and must equal the reference interpreter (torch, float64 where the
   ops allow, see ``_reference``) within a tolerance scaled to float32: |y - ref| <=
   ``RTOL`` * max(1, max|ref|) at every element. False accepts: a candidate that computes a
   different function differs from the reference at almost every input of the continuous
   draw (its difference is a nonzero piecewise-analytic function, zero only on a set of
   measure zero), and the differences a wrong tiling or rewrite makes (a missing block, a
   partial sum, a misplaced scale) are of the order of the outputs, about 10^4 times the
   tolerance; what two draws can miss is a deviation smaller than 1e-4 of the outputs'
   magnitude on both draws, e.g. a different eps in a norm. A candidate that fails is dropped
   and counted (``report["rejected"]``), never timed.
3. Timing, with a guard: the fixed fusion is never replaced by noise. Each survivor is bound to
   one set of inputs (a ``Plan``) and timed *paired with the fixed fusion*: interleaved rounds
   of both (``runtime/timing.py``; ``profile_iters`` calls per candidate in all, after
   ``warmup_iters``), each round giving the ratio of the candidate's time to the fixed
   fusion's in that round. The ``FINALISTS`` candidates with the lowest median ratio below 1
   and the fixed fusion are then re-timed together over ``FINAL_ROUNDS`` interleaved rounds. A
   candidate replaces the fixed fusion only if, over *all* the rounds it was timed in
   (screening and final), the median of its paired ratios is at most ``1 - WIN_MARGIN`` and it
   was faster in at least ``WIN_CONSISTENCY`` of them; the lowest median ratio among those
   wins. Sequential timings taken far apart, or one disturbed round, cannot decide (on an
   Intel Xeon the single final round of an earlier search measured the fixed fusion once at
   2.3x its real time and chose a µGraph 2.5x slower than it). The report keeps every round
   (``report["rounds"]``) and each candidate's ratios (``report["ratios_vs_fixed"]``).
4. Cache. The winner (its kernel-graph JSON) is stored under ``cache_dir()/superopt``, keyed
   by the SHA-256 of the input graph's JSON (structure, shapes, dtypes), the backend, the
   machine (CPU model and ISA flags, or the GPU's name), torch's thread count and a format
   version; written to a temporary file and renamed into place (atomic on POSIX), so
   concurrent processes never read a partial entry (two searching at once both store a
   valid winner; the last rename stays). With ``use_cached_graphs`` a hit skips the search.

This module compiles and times candidates through the runtime and the backends; it sits
below the front end (yirage/kernel.py ``KNGraph.superoptimize``) and never imports it.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Sequence

import torch

from ..backends import get_backend_impl, get_backend_info, resolve_backend
from ..config import cache_dir
from ..errors import GraphError
from ..ir.graph import KernelGraph
from ..ir.serialize import from_json, to_json
from ..runtime import timing
from ..runtime.machine import all_isa_flags, cpu_model_name
from ..runtime.executor import CompiledGraph
from . import attention, mugraph

VERIFY_DRAWS = 2
FIXED = "fixed fusion"   # candidate 0, the baseline every other candidate is paired with
RTOL = 1e-4               # of max(1, max |reference|), float32
CACHE_VERSION = 2   # 2: winners chosen by the guarded paired comparison


class OptimizedGraph:
    """The result of ``superoptimize``: call it like a kernel graph, ``opt(inputs=[...])``.

    Attributes:
        graph: the chosen kernel graph (a ``KernelGraph``; same inputs and outputs as the
            input graph; its ``customized`` ops hold the block graphs).
        description: what the chosen candidate is (e.g. 'fixed fusion' or 'µGraph grid=16
            loop=8: ...').
        report: the search: candidates generated, verified, rejected, timed; each timed
            candidate's median seconds (``times_s``) and paired ratios to the fixed fusion
            (``ratios_vs_fixed``, screening and final rounds); every round's samples
            (``rounds``); the best, its seconds, search seconds, whether it came from the cache.
    """

    def __init__(self, graph: KernelGraph, backend: str, description: str, report: dict):
        self.graph, self.backend, self.description, self.report = graph, backend, description, report
        self._compiled = None

    def compile(self) -> CompiledGraph:
        """The chosen graph compiled for the backend (cached)."""
        if self._compiled is None:
            self._compiled = CompiledGraph(self.graph, get_backend_impl(self.backend))
        return self._compiled

    def __call__(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Run on ``inputs`` (as ``g(inputs=...)``); returns the outputs. GraphError for
        inputs that do not match the graph."""
        return self.compile()(inputs)

    def visualize(self, path) -> str:
        """Draw the chosen graph and its block graphs (see ``KernelGraph.visualize``)."""
        return self.graph.visualize(path)


def _machine(backend: str) -> str:
    """CPU model and ISA flags (``runtime.machine``), and the device of ``backend`` when it is
    not the CPU (a GPU's or a WebGPU adapter's name: a winner found on lavapipe is never read on
    a real GPU of the same host)."""
    parts = [platform.machine(), cpu_model_name(), ",".join(all_isa_flags())]
    if backend != "cpu":
        parts.append(str(get_backend_impl(backend).info().device_name))
    return "|".join(parts)


def cache_key(graph: KernelGraph, backend: str) -> str:
    """SHA-256 over the graph's JSON (names dropped), the backend, the machine, torch's thread
    count and the cache format version."""
    doc = json.loads(to_json(graph))
    for t in doc["tensors"]:
        t.pop("name", None)
    doc.pop("backend", None)
    text = json.dumps([CACHE_VERSION, doc, backend, _machine(backend), torch.get_num_threads()], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _cache_path(key: str) -> Path:
    return cache_dir() / "superopt" / f"{key}.json"


def _load_cached(key: str, cls) -> tuple[KernelGraph, str, dict] | None:
    path = _cache_path(key)
    try:
        doc = json.loads(path.read_text())
        return from_json(doc["graph"], cls), doc["description"], doc["report"]
    except (OSError, ValueError, KeyError, TypeError):
        return None   # missing, or unreadable (an older format): search again


def _store(key: str, graph: KernelGraph, description: str, report: dict) -> None:
    path = _cache_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"graph": to_json(graph), "description": description, "report": report})
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)       # atomic: readers see the old entry or the new one
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _random_inputs(graph: KernelGraph, gen: torch.Generator, device) -> list[torch.Tensor]:
    out = []
    for t in graph.inputs:
        tt = graph.tensors[t]
        if tt.dtype.is_quantized or not tt.dtype.torch_dtype.is_floating_point:
            raise GraphError(f"superoptimize: input t{t} has dtype {tt.dtype.value}; the search draws random "
                             "floating-point inputs and supports float graphs only")
        x = torch.rand(tt.shape, generator=gen, dtype=torch.float32) * 2 - 1
        out.append(x.to(device=device, dtype=tt.dtype.torch_dtype))
    return out


def _reference(graph: KernelGraph, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The reference interpreter's outputs on the CPU."""
    return [o.float().cpu() for o in graph.interpret([x.cpu() for x in inputs])]


def verify(graph: KernelGraph, candidate: CompiledGraph, seed: int, draws: int = VERIFY_DRAWS) -> float:
    """The largest error of ``candidate`` against ``graph``'s reference interpreter over
    ``draws`` independent random draws, relative to max(1, max|reference|); inf if an
    output's shape differs or is not finite where the reference is."""
    worst = 0.0
    for d in range(draws):
        gen = torch.Generator().manual_seed(seed * 7919 + d)
        xs = _random_inputs(graph, gen, candidate.impl.torch_device)
        ref = _reference(graph, xs)
        got = [o.float().cpu() for o in candidate(xs)]
        if len(got) != len(ref):
            return float("inf")
        for a, b in zip(got, ref):
            if a.shape != b.shape or not torch.equal(torch.isfinite(a), torch.isfinite(b)):
                return float("inf")
            fin = torch.isfinite(b)
            err = float((a[fin] - b[fin]).abs().max()) if fin.any() else 0.0
            worst = max(worst, err / max(1.0, float(b[fin].abs().max()) if fin.any() else 1.0))
    return worst


#: candidates re-timed with the fixed fusion at the end of a search, and in how many rounds
FINALISTS, FINAL_ROUNDS = 3, 7
#: a candidate must take at most 1 - WIN_MARGIN of the fixed fusion's time (median of paired
#: ratios) and be faster in WIN_CONSISTENCY of the rounds to replace it
WIN_MARGIN, WIN_CONSISTENCY = 0.03, 2 / 3
#: interleaved rounds of a candidate's screening against the fixed fusion
SCREEN_ROUNDS = 3


def _runner(desc: str, compiled: CompiledGraph, inputs: list[torch.Tensor]):
    """A zero-argument callable running ``compiled`` once on a plan bound to ``inputs`` (what
    is timed; a seam for tests that disturb one candidate's timing)."""
    return compiled.plan(inputs).run


def _screen(desc: str, run, fixed_run, impl, warmup: int, iters: int) -> timing.Comparison:
    """``run`` and the fixed fusion's ``fixed_run`` timed in ``SCREEN_ROUNDS`` interleaved
    rounds of ``iters // SCREEN_ROUNDS`` calls each (at least 1), after ``warmup`` calls."""
    for _ in range(warmup):
        run()
    calls = max(1, iters // SCREEN_ROUNDS)
    return timing.compare({desc: run, FIXED: fixed_run}, rounds=SCREEN_ROUNDS, sync=impl.synchronize,
                          warmup=0, calls={desc: calls, FIXED: calls})


def _final(runs: dict, impl, iters: int, deadline: float) -> timing.Comparison:
    """The finalists and the fixed fusion (``runs``: {description: callable}) in up to
    ``FINAL_ROUNDS`` interleaved rounds (at least 3, fewer past ``deadline``)."""
    calls = max(3, iters // FINAL_ROUNDS)
    return timing.compare(runs, rounds=FINAL_ROUNDS, sync=impl.synchronize, warmup=1, deadline=deadline,
                          calls=dict.fromkeys(runs, calls))


def _decide(ratios: dict[str, list[float]]) -> str:
    """The winner: the candidate with the lowest median paired ratio among those that beat the
    fixed fusion by the margin over all their rounds (``timing.beats``), else the fixed fusion."""
    winners = [d for d, rs in ratios.items() if timing.beats(rs, WIN_MARGIN, WIN_CONSISTENCY)]
    return min(winners, key=lambda d: statistics.median(ratios[d])) if winners else FIXED


#: a block's for-loop tiles on a GPU backend must fit shared memory with Triton's pipelining
#: (2-3 stages of the tiles; an H100 has 227 KiB per block): the CPU has no such bound
GPU_TILE_BYTES = 64 * 1024


def _widths(backend: str) -> list[tuple[int, int, str]]:
    """(cpu_threads, block threads, label) per thread width to try, the default first: on the
    CPU all of torch's threads or one (a small block graph may not repay waking a second);
    on GPUs 128 threads per block (4 warps, or a workgroup of 128 invocations in WGSL), then
    256 and 64."""
    if backend == "cpu":
        return [(0, 128, "")] + ([(1, 128, " threads=1")] if torch.get_num_threads() > 1 else [])
    if get_backend_info(backend).kernels == "compiled (wgsl)":   # known without the device (tests pass 'cuda')
        return [(0, 128, ""), (0, 256, " workgroup=256"), (0, 64, " workgroup=64")]
    return [(0, 128, ""), (0, 256, " warps=8"), (0, 64, " warps=2")]


def _with_widths(schedules: list, backend: str, top: int = 3) -> list:
    """(schedule, width) pairs in trial order: the default width over the ``top`` schedules,
    the other widths over those, then the default width over the rest."""
    ws = _widths(backend)
    return ([(s, ws[0]) for s in schedules[:top]] + [(s, w) for w in ws[1:] for s in schedules[:top]]
            + [(s, ws[0]) for s in schedules[top:]])


def _candidates(graph: KernelGraph, cls, backend: str = "cpu"):
    """(description, kernel graph) pairs, the fixed fusion first."""
    yield "fixed fusion", graph
    limit = None if backend == "cpu" else GPU_TILE_BYTES
    threads = torch.get_num_threads()
    a = attention.match(graph)   # 3-d operands: never the 2-d matmul family as well
    family, p, fmt = (attention, a, "splits={} loop={}") if a is not None else (mugraph, mugraph.match(graph),
                                                                              "grid={} loop={}")
    if p is None:
        return
    for (split, loop), (cpu_threads, block, label) in _with_widths(family.schedules(p, threads, limit), backend):
        try:
            cand = family.lower(graph, p, split, loop, cls, cpu_threads, block)
        except GraphError:
            continue
        yield f"µGraph {fmt.format(split, loop)}{label}: {p.describe()}", cand


def _build_and_verify(graph: KernelGraph, desc: str, cand: KernelGraph, impl, seed: int, report: dict, say):
    """(compiled candidate or None, its verification error: inf when it cannot run). A µGraph
    the backend cannot build (Triton's OutOfResources for shared memory, say) is dropped and
    its reason kept in ``report["build_errors"]``; the fixed fusion's own failure propagates,
    as ``g(inputs)`` would raise it."""
    try:
        host = sorted({n.op for n in cand.ops if n.op == "customized" and not impl.supports(n, cand)})
        if cand is not graph and host:   # it would run as torch references: no µGraph of this backend
            report.setdefault("build_errors", {})[desc] = "its block graphs do not compile for this backend"
            say(f"[superoptimize] {desc}: its block graphs do not compile for this backend (dropped)")
            return None, float("inf")
        compiled = CompiledGraph(cand, impl)
        return compiled, verify(graph, compiled, seed=seed)
    except GraphError as e:
        say(f"[superoptimize] {desc}: cannot run ({e})")
    except Exception as e:  # noqa: BLE001
        if cand is graph:
            raise
        report.setdefault("build_errors", {})[desc] = f"{type(e).__name__}: {str(e)[:200]}"
        say(f"[superoptimize] {desc}: the backend cannot build it ({type(e).__name__}: {e})")
    return None, float("inf")


def superoptimize(graph: KernelGraph, config=None, backend: str | None = None, warmup_iters: int = 16,
                  profile_iters: int = 100, use_cached_graphs: bool = True, save_codes: bool = False,
                  verbose: bool = False, time_budget_s: float = 60.0) -> OptimizedGraph:
    """Search, verify and time candidate programs of ``graph``; return the fastest.

    Args:
        graph: a kernel graph with at least one output; its inputs must be floating point.
        config: Mirage's search-config name; accepted for compatibility and recorded in the
            report (the candidate family is chosen from the graph itself).
        backend: where candidates are compiled and timed (default: the graph's, else
            ``yr.get_backend()``).
        warmup_iters: untimed runs per candidate.
        profile_iters: timed runs per candidate; they are spread over interleaved rounds,
            each paired with as many runs of the fixed fusion.
        use_cached_graphs: return the cached winner for this graph, backend and machine if
            there is one (the search is skipped).
        save_codes: write the winner's kernel-graph JSON and the C++ of its block graphs to
            ``cache_dir()/superopt/<key>/``.
        verbose: print the search's progress.
        time_budget_s: stop generating and timing candidates when the next one would likely
            end past this many seconds (1.5x the mean candidate so far); the fixed fusion is
            always timed.

    Returns: an ``OptimizedGraph`` (callable as ``opt(inputs=[...])``).
    Raises: GraphError for a graph without outputs, non-float inputs or bad arguments;
        BackendUnavailableError for an unknown or unavailable backend.
    """
    if not graph.outputs:
        raise GraphError("superoptimize: the graph has no outputs (call mark_output first)")
    for name, v in (("warmup_iters", warmup_iters), ("profile_iters", profile_iters)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0 or (name == "profile_iters" and v < 1):
            raise GraphError(f"superoptimize: {name} must be a non-negative integer (profile_iters >= 1), got {v!r}")
    if isinstance(time_budget_s, bool) or not isinstance(time_budget_s, (int, float)) or not time_budget_s > 0:
        raise GraphError(f"superoptimize: time_budget_s must be a positive number of seconds, got {time_budget_s!r}")
    name = resolve_backend(backend or graph.backend).value
    impl = get_backend_impl(name)
    cls = type(graph)
    say = print if verbose else (lambda *a, **k: None)
    t_start = time.perf_counter()
    key = cache_key(graph, name)
    if use_cached_graphs:
        hit = _load_cached(key, cls)
        if hit is not None:
            g, desc, report = hit
            report = dict(report, cached=True)
            say(f"[superoptimize] cache hit: {desc}")
            return OptimizedGraph(g, name, desc, report)

    gen = torch.Generator().manual_seed(0)
    bench_inputs = _random_inputs(graph, gen, impl.torch_device)
    report = {"config": config, "backend": name, "candidates": 0, "verified": 0, "rejected": 0, "timed": 0,
              "times_s": {}, "ratios_vs_fixed": {}, "rounds": {"screening": {}}, "cached": False}
    fixed_run = None
    screened: dict[str, tuple[KernelGraph, object]] = {}   # description -> (graph, timed callable)
    ratios: dict[str, list[float]] = {}                    # description -> paired ratios to the fixed fusion
    longest = 0.0
    for i, (desc, cand) in enumerate(_candidates(graph, cls, name)):
        spent = time.perf_counter() - t_start
        # stop when the next candidate (as long as the longest so far) and the final round
        # (about one candidate's timing) would likely end past the budget
        if i > 0 and spent + 2.0 * max(spent / i, longest) > time_budget_s:
            say(f"[superoptimize] time budget of {time_budget_s} s spent after {i} candidates")
            break
        t_cand = time.perf_counter()
        report["candidates"] += 1
        compiled, err = _build_and_verify(graph, desc, cand, impl, i, report, say)
        if (i == 0) != (desc == FIXED) or (desc == FIXED and not err <= RTOL):
            raise GraphError("superoptimize: the fixed fusion must come first and pass verification; this is a "
                             "yirage bug: please report it with the graph's to_json()")
        if not err <= RTOL:
            report["rejected"] += 1
            say(f"[superoptimize] rejected {desc}: error {err:.3g} > {RTOL}")
            continue
        report["verified"] += 1
        run = _runner(desc, compiled, bench_inputs)
        if fixed_run is None:
            fixed_run = run
            for _ in range(warmup_iters):
                run()
            report["times_s"][FIXED] = timing.bench(run, SCREEN_ROUNDS, sync=impl.synchronize)
        else:
            c = _screen(desc, run, fixed_run, impl, warmup_iters, profile_iters)
            report["rounds"]["screening"][desc] = c.to_dict()
            report["times_s"][desc] = c.median(desc)
            ratios[desc] = c.ratios(desc, FIXED)
            screened[desc] = (cand, run)
        report["timed"] += 1
        longest = max(longest, time.perf_counter() - t_cand)
        say(f"[superoptimize] {report['candidates']} generated, {report['verified']} verified, "
            f"{report['rejected']} rejected; {desc}: {report['times_s'][desc] * 1e6:.1f} us"
            + (f" ({statistics.median(ratios[desc]):.3f}x the fixed fusion's time)" if desc in ratios else ""))
    hopefuls = sorted((d for d in ratios if statistics.median(ratios[d]) < 1.0),
                      key=lambda d: statistics.median(ratios[d]))[:FINALISTS]
    best_s = report["times_s"][FIXED]
    if hopefuls:
        final = _final({FIXED: fixed_run, **{d: screened[d][1] for d in hopefuls}}, impl, profile_iters,
                       t_start + time_budget_s)
        report["rounds"]["final"] = final.to_dict()
        report["final_round_s"] = {d: final.median(d) for d in final.names}
        for d in hopefuls:
            ratios[d] = ratios[d] + final.ratios(d, FIXED)
        say("[superoptimize] final round: " + ", ".join(f"{d}: {final.median(d) * 1e6:.1f} us"
                                                        for d in final.names))
    report["ratios_vs_fixed"] = ratios
    desc = _decide({d: ratios[d] for d in hopefuls})
    chosen = graph if desc == FIXED else screened[desc][0]
    if hopefuls:
        best_s = report["final_round_s"][desc]
    report.update(best=desc, best_s=best_s, fixed_fusion_s=report["times_s"][FIXED],
                  search_s=time.perf_counter() - t_start)
    _store(key, chosen, desc, report)
    if save_codes:
        _save_codes(key, chosen, impl.codegen)
    say(f"[superoptimize] chose {desc} in {report['search_s']:.1f} s")
    return OptimizedGraph(chosen, name, desc, report)


def _save_codes(key: str, graph: KernelGraph, codegen: str | None) -> Path:
    """Write the graph's JSON and each customized op's outputs in the backend's kernel language
    (``codegen``: C++, Triton or WGSL; C++ for a backend without one); returns the folder."""
    from ..codegen.threadblock_cpp import render_threadblock
    from ..codegen.threadblock_triton import render_threadblock_triton
    from ..codegen.threadblock_wgsl import render_threadblock_wgsl

    render, suffix = {"triton": (render_threadblock_triton, "py"),
                      "wgsl": (lambda tb, k, name: render_threadblock_wgsl(tb, k), "wgsl")}.get(
        codegen, (render_threadblock, "cpp"))
    folder = cache_dir() / "superopt" / key
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "graph.json").write_text(to_json(graph))
    seen = set()
    for n in graph.ops:
        if n.op == "customized" and id(n.attrs["tb"]) not in seen:
            seen.add(id(n.attrs["tb"]))
            tb = n.attrs["tb"]
            for k in range(len(tb.outputs)):
                (folder / f"tb{len(seen) - 1}_out{k}.{suffix}").write_text(render(tb, k, f"yr_tb{k}"))
    return folder
