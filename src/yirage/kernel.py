"""The kernel graph users build and run: ``yr.new_kernel_graph()`` returns a ``KNGraph``.

    g = yr.new_kernel_graph()
    X = g.new_input(dims=(8, 4096), dtype=yr.float32)
    W = g.new_input(dims=(4096, 4096), dtype=yr.float32)
    g.mark_output(g.silu(g.matmul(g.rms_norm(X, normalized_shape=(4096,)), W)))
    out = g(inputs=[x, w])          # fused + compiled for the backend on first call

``KNGraph`` is the IR graph (ir/graph.py ``KernelGraph``: the builder, shape rules and the
reference interpreter) plus what needs a backend: ``compile``, ``__call__`` and JSON. The
split follows Mirage's python/mirage/kernel.py, whose ``KNGraph`` wraps the core graph.
It sits above the backends in the import layers, so the IR never imports a backend.

Compiling applies the convolution passes first (transforms/conv.py: conv epilogues fused, and
NHWC where the backend asks for it), then hands the graph to the executor.

This module must never fuse, generate code or launch kernels itself: it hands a graph to
the executor (runtime/executor.py) with the backend the registry resolves.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .backends import get_backend_impl, resolve_backend
from .ir.graph import KernelGraph
from .ir.serialize import from_json, to_json
from .runtime.executor import CompiledGraph
from .transforms.conv import optimize_convolutions
from .transforms.parallel import merge_parallel_convs, merge_parallel_linears


class KNGraph(KernelGraph):
    """A kernel graph that compiles and runs on a backend.

    Args:
        backend: the backend the graph runs on when called (a name, 'auto', or None for
            the default backend at call time, see ``yr.set_backend``).
    """

    #: run transforms/parallel.py (linear layers of one input as one ``linear_stack``, and
    #: convolutions of one input as one ``conv2d_stack``, where the backend's measurement says
    #: so) when compiling; set by front ends that want it
    merge_parallel_ops: bool = False

    def compile(self, backend: str | None = None) -> CompiledGraph:
        """Fuse and compile for ``backend`` (default: the graph's, else ``yr.get_backend()``),
        after the graph passes: parallel linears, convolutions, then parallel convolutions (the
        last and the first with ``merge_parallel_ops``).

        Returns a ``runtime.executor.CompiledGraph``, cached per backend until the graph changes.

        Raises:
            BackendUnavailableError: unknown or unavailable backend.
            ToolchainError: the backend's generated code cannot be built.
        """
        name = resolve_backend(backend or self.backend)
        if name not in self._compiled:
            impl = get_backend_impl(name)
            graph = merge_parallel_linears(self, impl.merge_linears) if self.merge_parallel_ops else self
            graph = optimize_convolutions(graph, impl.channels_last)
            if self.merge_parallel_ops:
                graph = merge_parallel_convs(graph, impl.merge_convs)
            self._compiled[name] = CompiledGraph(graph, impl)
        return self._compiled[name]

    def __call__(self, inputs: Sequence[torch.Tensor], backend: str | None = None) -> list[torch.Tensor]:
        """Run the graph on ``inputs`` (torch tensors, one per ``new_input``, in order, on the
        backend's device) and return the marked outputs as new tensors on that device.

        Raises ValueError when the inputs do not match the declared shapes/dtypes/device.
        """
        return self.compile(backend)(inputs)

    def superoptimize(self, config=None, backend: str | None = None, warmup_iters: int = 16,
                      profile_iters: int = 100, use_cached_graphs: bool = True, save_codes: bool = False,
                      verbose: bool = False, time_budget_s: float = 60.0):
        """Search equivalent µGraphs of this graph, verify each against the reference
        interpreter, time the survivors on ``backend`` and return the fastest as a callable
        (``opt(inputs=[...])``); Mirage's ``graph.superoptimize``. See
        yirage/search/superoptimize.py for the candidates, the verification and the cache.

        Returns a ``search.superoptimize.OptimizedGraph``. Raises GraphError for a graph
        without outputs, non-float inputs or bad arguments; BackendUnavailableError for an
        unavailable backend."""
        from .search.superoptimize import superoptimize
        return superoptimize(self, config=config, backend=backend, warmup_iters=warmup_iters,
                             profile_iters=profile_iters, use_cached_graphs=use_cached_graphs,
                             save_codes=save_codes, verbose=verbose, time_budget_s=time_budget_s)

    def to_json(self) -> str:
        """The graph as JSON (ir/serialize.py); ``KNGraph.from_json`` reads it back."""
        return to_json(self)

    @classmethod
    def from_json(cls, text: str) -> "KNGraph":
        """Rebuild a graph from ``to_json`` output; ValueError if it is malformed."""
        return from_json(text, cls)


def new_kernel_graph(backend: str | None = None) -> KNGraph:
    """Create an empty kernel graph (Mirage's ``mi.new_kernel_graph()``).

    Args:
        backend: backend name or 'auto' to run on; None follows ``yr.get_backend()``.
    """
    return KNGraph(backend)
