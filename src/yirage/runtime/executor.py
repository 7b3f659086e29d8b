"""Executes a compiled kernel graph: buffers, kernel launches, library calls.

``CompiledGraph`` = schedule (transforms.fusion) + the backend's compiled fused kernels.
``CompiledGraph.plan(inputs)`` binds concrete input tensors and allocates every
intermediate once (buffers are reused by liveness), producing a ``Plan`` whose ``run()``
is a flat list of thunks: a decode step re-runs the same plan after updating its input
tensors in place (token ids, start position), with no allocation and no Python graph walk.

Library ops (GEMM/GEMV, embedding, RoPE, attention, argmax) run the CPU backend's
hand-written C++ kernels (codegen/cpp_library.py) where one exists, else torch (BLAS for
float matmuls). On other backends they run as torch ops on the backend's device.

This module must never change a graph or pick a different backend than it was given.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

from ..backends import Backend, get_backend_impl
from ..ir.interpret import check_inputs
from ..ir.ops import OPS
from ..transforms.fusion import FusedKernel, LibraryStep, schedule


VIEW_OPS = ("reshape", "slice_rows")  # alias their input's buffer; no launch


class CompiledGraph:
    """A KernelGraph fused and compiled for one backend.

    Raises ToolchainError (CPU) when the generated C++ cannot be built.
    """

    def __init__(self, graph, backend: Backend):
        self.graph = graph
        self.backend = backend
        self.impl = get_backend_impl(backend)
        self.steps = schedule(graph)
        fused = [s for s in self.steps if isinstance(s, FusedKernel)]
        self.kernels = dict(zip(map(id, fused), self.impl.compile(fused)))

    @property
    def num_kernels(self) -> int:
        """Number of launches per run: fused kernels plus library calls (reshapes excluded)."""
        return sum(1 for s in self.steps if not (isinstance(s, LibraryStep) and s.node.op in VIEW_OPS))

    def check(self, inputs: Sequence[torch.Tensor]) -> None:
        """ValueError if inputs do not match the graph or are not on the backend's device."""
        check_inputs(self.graph, inputs)
        dev = self.impl.torch_device
        for i, x in enumerate(inputs):
            if x.device.type != dev.type:
                raise ValueError(f"input {i} is on {x.device}, but backend '{self.backend.value}' "
                                 f"runs on {dev.type}: move it with .to('{dev.type}')")

    def plan(self, inputs: Sequence[torch.Tensor]) -> "Plan":
        """Bind ``inputs`` (contiguous, on the backend's device) and allocate buffers."""
        self.check(inputs)
        for i, x in enumerate(inputs):
            if not x.is_contiguous():
                raise ValueError(f"plan: input {i} must be contiguous (call .contiguous() first)")
        return Plan(self, list(inputs))

    def __call__(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Run once; non-contiguous inputs are copied first (KV caches must be contiguous,
        since attention updates them in place)."""
        self.check(inputs)
        return Plan(self, [x.contiguous() for x in inputs]).run()


class Plan:
    """Concrete buffers and launch thunks for one set of input tensors."""

    def __init__(self, cg: CompiledGraph, inputs: list[torch.Tensor]):
        self.cg = cg
        g = cg.graph
        self.device = cg.impl.torch_device
        self.env: dict[int, torch.Tensor] = dict(zip(g.inputs, inputs))
        self.thunks: list[Callable[[], None]] = []
        self._pool: dict[tuple, list[torch.Tensor]] = {}
        self._root: dict[int, int] = {}
        last_use = self._last_uses()
        keep = set(g.outputs) | set(g.inputs)
        for i, step in enumerate(cg.steps):
            if isinstance(step, FusedKernel):
                self._bind_fused(step)
            else:
                self._bind_library(step.node)
            for tid in self._reads(step):
                root = self._root.get(tid, tid)
                if last_use.get(root) == i and root not in keep:
                    self._release(root)
        self.outputs = [self.env[o] for o in g.outputs]

    def run(self) -> list[torch.Tensor]:
        """Launch every kernel in order; returns the output tensors (owned by the plan)."""
        for thunk in self.thunks:
            thunk()
        return self.outputs

    # ---- buffers --------------------------------------------------------------------------
    def _reads(self, step) -> list[int]:
        return [i.tid for i in step.inputs] if isinstance(step, FusedKernel) else step.node.inputs

    def _last_uses(self) -> dict[int, int]:
        last, root = {}, {}
        for i, step in enumerate(self.cg.steps):
            if isinstance(step, LibraryStep) and step.node.op in VIEW_OPS:
                root[step.node.output] = root.get(step.node.inputs[0], step.node.inputs[0])
            for tid in self._reads(step):
                last[root.get(tid, tid)] = i
        for o in self.cg.graph.outputs:
            last[root.get(o, o)] = len(self.cg.steps)
        return last

    def _alloc(self, tid: int) -> torch.Tensor:
        t = self.cg.graph.tensors[tid]
        shape = t.dtype.storage_shape(t.shape)
        key = (t.dtype.torch_dtype, math.prod(shape))
        pool = self._pool.get(key)
        buf = pool.pop() if pool else torch.empty(key[1], dtype=key[0], device=self.device)
        self.env[tid] = buf.view(shape)
        return self.env[tid]

    def _release(self, tid: int) -> None:
        buf = self.env[tid]
        self._pool.setdefault((buf.dtype, buf.numel()), []).append(buf.reshape(-1))

    # ---- steps ----------------------------------------------------------------------------
    def _bind_fused(self, k: FusedKernel) -> None:
        ins = []
        for inp in k.inputs:
            x = self.env[inp.tid]
            if inp.mode == "expand":  # materialize a broadcast the row view cannot index
                full = torch.empty(k.shape, dtype=x.dtype, device=self.device)
                self.thunks.append(lambda full=full, x=x: full.copy_(x.expand(full.shape)))
                x = full
            ins.append(x)
        outs = [self._alloc(tid) for _, tid, _ in k.outputs]
        self.thunks.append(self.cg.kernels[id(k)].bind(ins + outs, k.R))

    def _bind_library(self, node) -> None:
        if node.op in VIEW_OPS:
            src = self.env[node.inputs[0]]
            self.env[node.output] = OPS[node.op].reference([src], node.attrs)
            self._root[node.output] = self._root.get(node.inputs[0], node.inputs[0])
            return
        args = [self.env[i] for i in node.inputs]
        out = self._alloc(node.output)
        thunk = None
        if self.cg.backend == Backend.CPU:
            from .cpu_library import bind_cpu_library
            thunk = bind_cpu_library(node, args, out, self.cg.graph)
        if thunk is None:
            ref = OPS[node.op].reference
            thunk = lambda ref=ref, args=args, out=out, attrs=node.attrs: out.copy_(ref(args, attrs))
        self.thunks.append(thunk)
