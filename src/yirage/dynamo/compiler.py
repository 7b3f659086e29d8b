"""The torch.compile backend (compiler side): dynamo's FX graph -> AOTAutograd -> partitions -> yirage.

``YirageBackend(mode, options)`` is what ``torch.compile(m, backend=...)`` calls with each
graph dynamo captures. It runs AOTAutograd with the core ATen decomposition table
(inference only), hands the ATen graph to ``partition.lower_graph`` and returns the
partitioned GraphModule's ``forward``.

Gradients: yirage compiles inference graphs only. A graph that needs gradients (grad mode on
and an input or parameter that requires grad) runs eager: dynamo's own GraphModule, with ONE
``YirageFallbackWarning`` per compiled graph saying why and what to do (``torch.no_grad()`` /
``torch.inference_mode()``); with ``fallback="raise"`` it is a ``TorchCompileError``.

Parameters and buffers (``options.freeze``, the default): AOTAutograd passes them as graph
inputs, which dynamo marks static (``fw_metadata.static_input_indices``). Those the graph does
not mutate are declared constant to the backend when a partition first runs
(``BackendImpl.declare_constant``), which lets it keep them prepacked for the kernels it
chooses by measurement; a weight written later is repacked (its version changes), so
writes stay visible.

``verify=True`` runs the first call of each compiled graph through the unpartitioned ATen
graph too (eager) and raises ``TorchCompileError`` naming the output and the error when
they differ beyond the dtype's tolerance.

This module must never run a partition's ops itself nor decide which ops lower (that is the
lowering table's business).
"""
from __future__ import annotations

import warnings

import torch
from torch._decomp import core_aten_decompositions
from torch._dynamo.backends.common import aot_autograd
from torch.fx import GraphModule

from ..config import logger
from ..errors import TorchCompileError
from .lowering import LOWERINGS
from .options import CompileOptions, parse_options
from .partition import GraphReport, YirageFallbackWarning, lower_graph

#: verify's tolerances (rtol, atol) per output dtype: float32 tight, half types looser
TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.float16: (1e-2, 1e-2), torch.bfloat16: (2e-2, 2e-2)}


def decompositions() -> dict:
    """The core ATen decomposition table less the ops the lowering table lowers whole (silu,
    gelu, ...: decomposed, they would reach the partitioner as several ops, some without a
    lowering). An op kept whole that a lowering then declines still runs in torch."""
    return {op: fn for op, fn in core_aten_decompositions().items() if op not in LOWERINGS}


def needs_grad(example_inputs) -> bool:
    """Whether a graph with these inputs would need gradients: grad mode is on and a tensor
    input (parameters included: dynamo passes them as inputs) requires grad."""
    return torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs)


def own_recompiles() -> dict:
    """``{"isolate_recompiles": True}`` where ``torch.compile`` takes it (torch >= 2.13), else {}.

    Every ``yr.compile`` and ``yr.explain`` call brings its own ``YirageBackend``, which
    dynamo's BACKEND_MATCH guard tells apart, so each one compiles anew on a code object that
    others compiled before: every instance of a class, and every transformers model, whose
    ``forward`` sits behind one shared decorator's wrapper. Counted together, the ninth such
    call hit ``torch._dynamo.config.recompile_limit`` (8) and ran eager with only a log line
    to say so. With ``isolate_recompiles`` each call counts its own recompiles (dynamo's
    ``accumulated_recompile_limit``, 256, still caps them all)."""
    import inspect
    return {"isolate_recompiles": True} if "isolate_recompiles" in inspect.signature(torch.compile).parameters else {}


class YirageBackend:
    """A torch.compile backend (``torch.compile(model, backend=YirageBackend(...))``).

    Args:
        mode, options: as ``yr.compile``; checked at once (``options.parse_options``).

    Calling it with ``(gm, example_inputs)`` (dynamo's graph and its example tensors) returns
    the callable dynamo runs instead of ``gm``. ``reports`` collects one ``GraphReport`` per
    graph compiled (``yr.explain`` prints them).

    Raises TorchCompileError for bad options, or (``fallback="raise"``) a graph that needs
    gradients or a partition that fails.
    """

    def __init__(self, mode: str | None = None, options: dict | None = None):
        self.options: CompileOptions = parse_options(mode, options)
        self.reports: list[GraphReport] = []

    def __call__(self, gm: GraphModule, example_inputs):
        if needs_grad(example_inputs):
            return self._eager_for_grad(gm)
        compiler = aot_autograd(fw_compiler=self._compile_inference, decompositions=decompositions())
        return compiler(gm, example_inputs)

    def _eager_for_grad(self, gm: GraphModule):
        reason = ("the graph needs gradients (grad mode is on and an input or parameter requires "
                  "grad); yirage compiles inference only: call the model under torch.no_grad() or "
                  "torch.inference_mode()")
        self.reports.append(GraphReport(reason=reason))
        if self.options.fallback == "raise":
            raise TorchCompileError(reason + " (fallback='raise')")
        logger.debug("yirage torch.compile: %s; running it eager", reason)
        warnings.warn(reason + "; this graph runs eager", YirageFallbackWarning, stacklevel=2)
        return gm.forward

    def _compile_inference(self, gm: GraphModule, example_inputs):
        """AOTAutograd's forward compiler: partition and compile the ATen graph. Under torch's
        ``aot_compile`` (``yr.compile``'s precompiled path) it returns a serializable
        ``precompile.YirageOutputCode`` holding the partitioned graph."""
        from . import precompile
        reference = _copy(gm) if self.options.verify else None
        static, constant = static_inputs(self.options)
        lowered, report = lower_graph(gm, self.options, static, constant)
        self.reports.append(report)
        run = lowered.forward if reference is None else _verified(lowered.forward, reference.forward)
        if precompile.in_aot_compile():
            return precompile.output_code(lowered, run, self.options)
        return run


def static_inputs(options: CompileOptions) -> tuple[frozenset[int], frozenset[int]]:
    """(static, frozen): the positions of the graph inputs AOTAutograd's metadata marks static
    (parameters and buffers: the same tensors every call), and of those to freeze (with
    ``options.freeze``: the static inputs the graph does not mutate)."""
    ctx = torch._guards.TracingContext.try_get()
    meta = getattr(ctx, "fw_metadata", None)
    if meta is None:
        return frozenset(), frozenset()
    static = frozenset(meta.static_input_indices)
    mutated = {i for i, m in enumerate(meta.input_info) if m.mutates_data or m.mutates_metadata}
    return static, (frozenset(i for i in static if i not in mutated) if options.freeze else frozenset())


def _copy(gm: GraphModule) -> GraphModule:
    """A GraphModule over a copy of ``gm``'s graph (sharing its attributes), which partitioning
    ``gm`` in place leaves as it was."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return GraphModule(gm, graph)


def _verified(run, reference):
    """``run``, whose first call is checked against ``reference`` (the same graph in eager)."""
    checked = False

    def call(*args):
        nonlocal checked
        outs = run(*args)
        if not checked:
            check_close(outs, reference(*args))
            checked = True
        return outs
    return call


def check_close(actual, expected) -> None:
    """TorchCompileError naming the first output of ``actual`` (a tuple or list of tensors)
    that differs from ``expected`` beyond ``TOLERANCES``."""
    for i, (a, b) in enumerate(zip(actual, expected)):
        if not isinstance(b, torch.Tensor):
            continue
        rtol, atol = TOLERANCES.get(b.dtype, (0.0, 0.0))
        try:
            torch.testing.assert_close(a, b, rtol=rtol, atol=atol)
        except AssertionError as e:
            raise TorchCompileError(f"verify: output {i} of the yirage-compiled graph differs from eager "
                                    f"(rtol={rtol}, atol={atol}): {e}") from None


def backend(gm: GraphModule, example_inputs, mode: str | None = None, options: dict | None = None):
    """The function registered as torch.compile's "yirage" backend (entry point
    ``torch_dynamo_backends``: ``yirage = "yirage.dynamo:backend"``). ``torch.compile(m,
    backend="yirage", mode=..., options=...)`` passes ``mode``/``options`` through; see
    ``yr.compile`` for them. Raises TorchCompileError for bad options."""
    return YirageBackend(mode, options)(gm, example_inputs)
