"""Executes a compiled kernel graph: buffers, kernel launches, library calls.

``CompiledGraph`` = schedule (transforms.fusion) + the backend's compiled fused kernels.
``CompiledGraph.plan(inputs)`` binds concrete input tensors and allocates every
intermediate once (buffers are reused by liveness), producing a ``Plan`` whose ``run()``
is a flat list of thunks: a decode step re-runs the same plan after updating its input
tensors in place (token ids, start position), with no allocation and no Python graph walk.

The executor talks to its backend only through the backend contract
(backends/base.py ``BackendImpl``): ``compile`` for fused kernels, ``supports`` and
``bind_library_op`` for library ops (GEMM/GEMV, embedding, RoPE, attention, argmax). A
library op the backend does not support runs as the op's torch reference on the backend's
device: explicit, and logged once per (backend, op) at DEBUG.

Ops that index with run-time values (embedding ids, RoPE/attention positions) get a slot
of the plan's int64 status buffer [n, 4]: their kernels check every index before using it
and record a violation there; ``Plan.run`` reads the buffer after the launches and raises
``IndexOutOfRangeError`` naming the op, the value and the valid range.

This module must never change a graph, import a backend, or ask which backend it runs on.
"""
from __future__ import annotations

import math
import operator
import threading
from typing import Callable, Sequence

import torch

from ..config import logger
from ..errors import GraphError
from ..ir.interpret import check_inputs
from ..ir.ops import OPS, index_error
from ..transforms.fusion import VIEW_OPS, FusedKernel, LibraryStep, alias_roots, schedule


_logged_fallbacks: set[tuple[str, str]] = set()

#: a graph's call with the same inputs as its previous calls, this many times in a row, captures
#: the plan on backends that capture (the first calls compile, autotune and warm up)
CAPTURE_AFTER = 3


def layout_aliases(steps: list, graph, impl) -> tuple[dict, dict]:
    """Permutes that need no copy because the op next to them takes strided views
    (``impl.strided_io``: attention reading [B, S, H, D] rows as [B, H, S, D] heads):

    - *viewed*: a permute all of whose readers take strided inputs becomes a view of its input,
      ``{permute output: (its input, dims)}``;
    - *written*: an op taking a strided output whose only reader is a permute (through
      reshapes to the same shape) writes straight into the permute's buffer,
      ``{op output: (permute output, inverse dims, [the reshapes' outputs])}``.

    Graph outputs stay copies. Returns (viewed, written).
    """
    readers: dict[int, list] = {}
    for st in steps:
        for tid in ([i.tid for i in st.inputs] if isinstance(st, FusedKernel) else st.node.inputs):
            readers.setdefault(tid, []).append(st)
    outputs = set(graph.outputs)

    def node_of(st):
        return st.node if isinstance(st, LibraryStep) else None

    def same_shape_reshape(n) -> bool:
        return (n is not None and n.op == "reshape"
                and graph.tensors[n.output].shape == graph.tensors[n.inputs[0]].shape)

    viewed: dict[int, tuple] = {}
    written: dict[int, tuple] = {}
    taken: set[int] = set()
    for st in steps:
        n = node_of(st)
        if n is None or n.op in VIEW_OPS or n.output in outputs or not impl.strided_io(n, graph):
            continue
        chain, tid = [], n.output
        while True:   # follow same-shape reshapes to the one reader
            rs = readers.get(tid, [])
            if len(rs) != 1 or tid in outputs:
                break
            r = node_of(rs[0])
            if same_shape_reshape(r):
                chain.append(r.output)
                tid = r.output
                continue
            if r is not None and r.op == "permute" and r.inputs[0] == tid:
                dims = list(r.attrs["dims"])
                inverse = [dims.index(d) for d in range(len(dims))]
                written[n.output] = (r.output, inverse, chain)
                taken.add(r.output)
            break
    for st in steps:
        n = node_of(st)
        if n is None or n.op != "permute" or n.output in outputs or n.output in taken:
            continue
        rs = readers.get(n.output, [])
        if rs and all(node_of(r) is not None and node_of(r).op not in VIEW_OPS and impl.strided_io(node_of(r), graph)
                      for r in rs):
            viewed[n.output] = (n.inputs[0], list(n.attrs["dims"]))
    return viewed, written


def _written_tids(g) -> set[int]:
    """The tensors some op of ``g`` writes in place (``OpDef.mutates``: a KV cache)."""
    return {node.inputs[m] for node in g.ops for m in OPS[node.op].mutates}


class CompiledGraph:
    """A KernelGraph fused and compiled for one backend.

    Args:
        graph: an ``ir.graph.KernelGraph``.
        impl: the backend (a ``backends.base.BackendImpl``), already known to be available.

    Raises ToolchainError when the backend's generated code cannot be built.
    """

    def __init__(self, graph, impl):
        self.graph = graph
        self.impl = impl
        self.steps = schedule(graph)
        fused = [s for s in self.steps if isinstance(s, FusedKernel)]
        self.kernels = dict(zip(map(id, fused), self.impl.compile(fused)))
        self._last: list | None = None       # [input key, Plan, calls] of the last call, reused
        self._last_lock = threading.Lock()

    @property
    def num_kernels(self) -> int:
        """Number of launches per run: fused kernels plus library calls (reshapes excluded)."""
        return sum(1 for s in self.steps if not (isinstance(s, LibraryStep) and s.node.op in VIEW_OPS))

    @staticmethod
    def _same_tensors(entry: list, inputs) -> bool:
        """Whether ``inputs`` are the very tensor objects the last plan was bound to, still on
        the same storage (then their shapes and dtypes were checked when it was bound): a
        partition's frozen weights and staged activations, called again and again."""
        bound = entry[3]
        return (bound is not None and len(inputs) == len(bound) and all(map(operator.is_, inputs, bound))
                and [x.data_ptr() for x in inputs] == entry[4])

    def check(self, inputs: Sequence[torch.Tensor]) -> None:
        """GraphError if inputs do not match the graph (see ``ir.interpret.check_inputs``) or are
        not on the backend's device."""
        check_inputs(self.graph, inputs)
        dev = self.impl.torch_device
        for i, x in enumerate(inputs):
            if x.device.type != dev.type:
                raise GraphError(f"input {i} is on {x.device}, but backend '{self.impl.name.value}' "
                                 f"runs on {dev.type}: move it with .to('{dev.type}')")

    def check_bindable(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``check`` plus contiguity (a plan binds its inputs in place); returns them as a list."""
        self.check(inputs)
        for i, x in enumerate(inputs):
            if not x.is_contiguous():
                raise GraphError(f"plan: input {i} must be contiguous (call .contiguous() first)")
        return list(inputs)

    def plan(self, inputs: Sequence[torch.Tensor]) -> "Plan":
        """Bind ``inputs`` (contiguous, on the backend's device) and allocate buffers."""
        return Plan(self, self.check_bindable(inputs))

    def __call__(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Run once and return the outputs as new tensors; non-contiguous inputs are copied
        first (KV caches must be contiguous, since attention updates them in place).

        A call with the same input tensors as the previous one (same storage, shapes,
        dtypes) reuses its plan (buffers and bound launches: building them costs tens of
        microseconds, as much as a small graph's run) and returns copies of its outputs; a
        call made while another thread runs that plan gets a plan of its own. On a backend
        that ``captures`` (CUDA graphs), the plan's ``CAPTURE_AFTER``-th call with the same
        inputs captures its launches and later ones replay them: one launch instead of one
        per kernel, whose host cost dominates small graphs (Triton's launch takes tens of
        microseconds). A capture that fails leaves the plan launching kernel by kernel."""
        if not self._last_lock.acquire(blocking=False):
            self.check(inputs)
            return Plan(self, [x.contiguous() for x in inputs]).run()
        try:
            entry = self._last
            if not (entry is not None and self._same_tensors(entry, inputs)):
                self.check(inputs)
                xs = [x.contiguous() for x in inputs]
                key = tuple((x.data_ptr(), tuple(x.shape), x.dtype, x.device) for x in xs)
                if entry is None or entry[0] != key:
                    self._last = None
                    entry = self._last = [key, Plan(self, xs), 0, None, None]
                if all(map(operator.is_, xs, inputs)):   # the same tensor objects: next time, a quick check
                    entry[3], entry[4] = list(xs), [x.data_ptr() for x in xs]
            entry[2] += 1
            if entry[2] == CAPTURE_AFTER and getattr(self.impl, "captures", False):
                try:
                    entry[1].capture()
                except Exception as e:  # noqa: BLE001 - e.g. an op that syncs with the host
                    logger.debug("plan not captured (%s: %s); it keeps launching kernel by kernel",
                                 type(e).__name__, e)
            return [o.clone() for o in entry[1].run()]
        finally:
            self._last_lock.release()


class Plan:
    """Concrete buffers and launch thunks for one set of input tensors."""

    def __init__(self, cg: CompiledGraph, inputs: list[torch.Tensor]):
        self.cg = cg
        g = cg.graph
        self.device = cg.impl.torch_device
        impl = cg.impl
        mutated = _written_tids(g)
        written = {i for i, tid in enumerate(g.inputs) if tid in mutated}
        staged, self._before, self._after = impl.stage_inputs(inputs, written)
        self.env: dict[int, torch.Tensor] = dict(zip(g.inputs, staged))
        self.thunks: list[Callable[[], None]] = []
        self._pool: dict[tuple, list[torch.Tensor]] = {}
        self._root = alias_roots(g)  # view outputs -> the buffer they share
        checked = [s.node for s in cg.steps
                   if isinstance(s, LibraryStep) and OPS[s.node.op].index_input is not None]
        self._status = impl.alloc(len(checked) * 4, torch.int64).view(len(checked), 4).zero_() if checked else None
        self._status_nodes: list = []  # status slot -> the op it belongs to
        # permutes that become strided views (no copy) next to ops that take them
        self._viewed, self._written = layout_aliases(cg.steps, g, cg.impl) if self.strided_views else ({}, {})
        for out, (src, _) in self._viewed.items():
            self._root[out] = self._root.get(src, src)
        self._absorbed = {dst for dst, _, _ in self._written.values()}   # permutes bound with their op
        for out, (dst, _, chain) in self._written.items():
            for tid in (out, *chain):
                self._root[tid] = dst
        for tid, r in list(self._root.items()):   # views of what became a view
            while r in self._root and self._root[r] != r:
                r = self._root[r]
            self._root[tid] = r
        last_use = self._last_uses()
        keep = set(g.outputs) | set(g.inputs)
        self._bound: set[int] = set()  # outputs already bound with a sibling (customized groups)
        epilogues: set[int] = set()   # steps bound as the row epilogue of the step before
        for i, step in enumerate(cg.steps):
            if i in epilogues:
                pass
            elif isinstance(step, LibraryStep) and self._bind_layout_alias(step.node):
                pass
            elif self._bind_with_epilogue(i):
                epilogues.add(i + 1)
            elif isinstance(step, FusedKernel):
                self._bind_fused(step)
            elif step.node.output in self._bound:
                pass
            elif step.node.op == "customized" and self._bind_customized_group(step.node):
                pass
            else:
                self._bind_library(step.node)
            # each buffer once: a step may read several views of one buffer (attention's q, k
            # and v as slices of one stacked projection), and a buffer pooled twice would be
            # handed to two live tensors
            for root in dict.fromkeys(self._root.get(tid, tid) for tid in self._reads(step)):
                if last_use.get(root) == i and root not in keep:
                    self._release(root)
        self.outputs = [self.env[o] for o in g.outputs]
        self._run: Callable[[], None] = self._launch_all
        if self._before is not None:
            self.thunks.insert(0, self._before)
        if self._after is not None:
            self.thunks.append(self._after)

    def run(self) -> list[torch.Tensor]:
        """Launch every kernel in order (or replay the captured launches, see ``capture``);
        returns the output tensors (owned by the plan).

        Raises IndexOutOfRangeError when a kernel met a run-time index outside its buffer
        (that access was skipped; the outputs of this run are then meaningless).
        """
        self._run()
        if self._status is not None:
            status = self.cg.impl.fetch([self._status])[0]
            if bool(status[:, 0].any()):
                self._raise_index_error(status)
        return self.cg.impl.fetch(self.outputs)

    def _raise_index_error(self, status: torch.Tensor):
        slot = int(torch.nonzero(status[:, 0])[0, 0])
        value, lo, hi = status[slot, 1:].tolist()
        self._status.zero_()
        raise index_error(self._status_nodes[slot].op, value, lo, hi)

    #: may a permute become a strided view read or written by the op next to it (backends'
    #: ``strided_io``)? The persistent kernel's plan tracks its buffers whole, so it keeps copies.
    strided_views = True

    def _bind_layout_alias(self, node) -> bool:
        """Bind a permute that ``layout_aliases`` made a view (True): over its input's buffer,
        or, for one an op writes through, nothing (its buffer was allocated with that op);
        an op writing through a permute gets the permute's buffer seen in its own shape."""
        if node.output in self._viewed:
            src, dims = self._viewed[node.output]
            self.env[node.output] = self.env[src].permute(*dims)
            return True
        if node.output in self._written:
            dst, inverse, chain = self._written[node.output]
            view = self._alloc(dst).permute(*inverse)
            for tid in (node.output, *chain):
                self.env[tid] = view
            return False   # the op itself is bound as usual, into that view
        return node.output in self._absorbed

    def _launch_all(self) -> None:
        for thunk in self.thunks:
            thunk()

    def capture(self) -> None:
        """Let the backend record this plan's launches once and replay them from now on
        (CUDA graphs on CUDA/ROCm; no change on backends without capture). Runs the plan
        twice while capturing, so inputs updated in place (the KV cache) see two extra steps
        at the current positions."""
        self._run = self.cg.impl.capture(self._launch_all)

    # ---- buffers --------------------------------------------------------------------------
    def _reads(self, step) -> list[int]:
        return [i.tid for i in step.inputs] if isinstance(step, FusedKernel) else step.node.inputs

    def _last_uses(self) -> dict[int, int]:
        """Index of the last step that reads each buffer (graph outputs: past the end)."""
        last, root = {}, self._root
        for i, step in enumerate(self.cg.steps):
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
        buf = pool.pop() if pool else self.cg.impl.alloc(key[1], key[0])
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
                x, fill = self.cg.impl.bind_expand(x, tuple(k.shape))
                self.thunks.append(fill)
            ins.append(x)
        outs = [self._alloc(tid) for _, tid, _ in k.outputs]
        self.thunks.append(self.cg.kernels[id(k)].bind(ins + outs, k.R))

    #: may a library op and the fused row kernel after it be bound as one thunk (epilogue
    #: fusion)? The persistent kernel's plan binds every step as its own task.
    epilogue_fusion = True

    def _bind_with_epilogue(self, i: int) -> bool:
        """Bind step ``i`` (a library op) and step ``i + 1`` (a fused row kernel over the op's
        output rows, reading them whole) as one thunk when the backend fuses them
        (``bind_library_op_epilogue``). The row kernel's outputs are allocated before the op's
        inputs are released, so they never share memory with what the op still reads. False:
        nothing bound, bind them apart."""
        steps, impl, g = self.cg.steps, self.cg.impl, self.cg.graph
        if (not self.epilogue_fusion or i + 1 >= len(steps) or isinstance(steps[i], FusedKernel)
                or not isinstance(steps[i + 1], FusedKernel)):
            return False
        node, k = steps[i].node, steps[i + 1]
        if (node.op in VIEW_OPS or node.output in self._bound or OPS[node.op].index_input is not None
                or node.output in self._viewed or node.output in self._written or not impl.supports(node, g)):
            return False
        shape = g.tensors[node.output].shape
        reads = [inp for inp in k.inputs if inp.tid == node.output]
        if (not reads or any(inp.mode != "full" for inp in reads) or any(inp.mode == "expand" for inp in k.inputs)
                or k.D != shape[-1] or k.R * k.D != math.prod(shape)
                or any(inp.tid != node.output and inp.tid not in self.env for inp in k.inputs)):
            return False
        args = [self.env[t] for t in node.inputs]
        out = self._alloc(node.output)
        outs = [self._alloc(tid) for _, tid, _ in k.outputs]
        ins = [self.env[inp.tid] for inp in k.inputs]
        thunk = impl.bind_library_op_epilogue(node, g, args, out, self.cg.kernels[id(k)], ins + outs)
        if thunk is None:   # not fused: hand the buffers back
            for tid in (node.output, *(tid for _, tid, _ in k.outputs)):
                self._release(tid)
                del self.env[tid]
            return False
        self.thunks.append(thunk)
        return True

    def _bind_customized_group(self, node) -> bool:
        """Bind every ``customized`` op of ``node``'s block graph (same inputs) as one kernel
        when the backend has one (``bind_customized_group``); their outputs are allocated now.
        False when ``node`` stands alone or the backend binds each output by itself."""
        tb = node.attrs["tb"]
        group = sorted((n for n in self.cg.graph.ops
                        if n.op == "customized" and n.attrs["tb"] is tb and n.inputs == node.inputs),
                       key=lambda n: n.attrs["output"])
        impl, graph = self.cg.impl, self.cg.graph
        if (len(group) < 2 or any(n.output in self.env for n in group)
                or not all(impl.supports(n, graph) for n in group)):
            return False
        args = [self.env[i] for i in node.inputs]
        outs = [self._alloc(n.output) for n in group]
        thunk = impl.bind_customized_group(group, graph, args, outs)
        if thunk is None:
            for n in group:
                self._release(n.output)
                del self.env[n.output]
            return False
        self.thunks.append(thunk)
        self._bound.update(n.output for n in group)
        return True

    def _bind_library(self, node) -> None:
        if node.op in VIEW_OPS:
            if node.output in self.env:   # a reshape of a layout alias's chain, bound with it
                return
            src = self.env[node.inputs[0]]
            self.env[node.output] = OPS[node.op].reference([src], node.attrs)
            return
        args = [self.env[i] for i in node.inputs]
        out = self.env[node.output] if node.output in self._written else self._alloc(node.output)
        impl = self.cg.impl
        if impl.supports(node, self.cg.graph):
            status = None
            if OPS[node.op].index_input is not None:
                status = self._status[len(self._status_nodes)]
                self._status_nodes.append(node)
            self.thunks.append(impl.bind_library_op(node, self.cg.graph, args, out, status))
            return
        if (impl.name.value, node.op) not in _logged_fallbacks:
            _logged_fallbacks.add((impl.name.value, node.op))
            logger.debug("backend %s has no kernel for this %s: running its torch reference on %s",
                         impl.name.value, node.op, self.device)
        self.thunks.append(impl.bind_reference(node, args, out))
