"""Partitioning an ATen FX graph: supported ops become yirage partitions, the rest stays torch.

``lower_graph(gm, options)`` takes the inference graph AOTAutograd made (core ATen ops,
parameters and buffers as placeholders), asks the lowering table (lowering.py) which nodes
lower, lets torch.fx's ``CapabilityBasedPartitioner`` group them into partitions (no cycles
through torch ops), leaves partitions of fewer than ``min_block_size`` compute ops to torch,
and replaces each remaining partition by a ``YiragePartition``: its µGraph built as a
``KNGraph`` and compiled for the chosen backend. The rest of the GraphModule stays torch
ops, so the module always runs.

A partition that fails to lower, compile or run its first call runs its torch ops instead,
with one ``YirageFallbackWarning`` naming the ops and the reason (``fallback="eager"``), or
raises ``TorchCompileError`` (``fallback="raise"``); never silently. Every node left in
torch is recorded with its reason in the ``GraphReport`` that ``yr.explain`` prints.

This module must never change what a graph computes: a node is either run by torch as
traced or by the IR its lowering emitted.
"""
from __future__ import annotations

import contextlib
import os
import warnings
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupportBase

from ..backends import get_backend_impl, resolve_backend
from ..config import logger
from ..dtypes import as_dtype
from ..errors import TorchCompileError, YirageFallbackWarning
from ..kernel import KNGraph
from .lowering import LOWERINGS, VIEW_TARGETS, Emitter, rewrite_linear
from .options import CompileOptions, op_name


@dataclass
class PartitionReport:
    """One partition: ``name`` (its submodule, e.g. "yirage_partition_0"), the ATen ops in
    it, where it runs ("yirage" or "torch"), for "torch" why (``reason``), and for "yirage"
    how its µGraph was compiled (``compiled_as``)."""

    name: str
    ops: list[str]
    runs_in: str = "yirage"
    reason: str | None = None
    compiled_as: str = ""  # "fixed fusion: N launch(es)" or "superoptimize: <the winner>"

    @property
    def num_compute_ops(self) -> int:
        """Ops other than reshapes/getitems."""
        return sum(1 for o in self.ops if o not in _VIEW_NAMES)


@dataclass
class TorchOp:
    """A node of the graph that runs in torch: its FX name, its op and why it is not in yirage."""

    node: str
    op: str
    reason: str


@dataclass
class GraphReport:
    """What happened to one graph dynamo captured: its partitions and its torch ops. ``reason``
    is set when the whole graph ran eager (it needs gradients)."""

    partitions: list[PartitionReport] = field(default_factory=list)
    torch_ops: list[TorchOp] = field(default_factory=list)
    reason: str | None = None


_VIEW_NAMES = {op_name(t) for t in VIEW_TARGETS if hasattr(t, "overloadpacket")} | {"getitem"}


def node_op(node: Node) -> str:
    """The op name of a call_function node: "aten.gelu.default", or "getitem"."""
    return op_name(node.target) if hasattr(node.target, "overloadpacket") else getattr(node.target, "__name__", str(node.target))


class _Support(OperatorSupportBase):
    """Operator support from the lowering table; remembers why each node was declined."""

    def __init__(self, options: CompileOptions):
        self.options = options
        self.declined: dict[str, str] = {}  # node name -> reason (fusing copies the nodes)

    def reason(self, node: Node) -> str | None:
        """Why the call_function ``node`` stays in torch, or None when it lowers."""
        name = node_op(node)
        lowering = LOWERINGS.get(node.target)
        if lowering is None:
            return f"no lowering for {name}"
        if name in self.options.torch_executed_ops or name.rsplit(".", 1)[0] in self.options.torch_executed_ops:
            return "listed in torch_executed_ops"
        return lowering.check(node)

    def is_node_supported(self, submodules, node: Node) -> bool:
        if node.op != "call_function":
            return False
        why = self.reason(node)
        if why:
            self.declined[node.name] = why
        return why is None


def lower_graph(gm: GraphModule, options: CompileOptions) -> tuple[GraphModule, GraphReport]:
    """Partition ``gm`` (an ATen inference graph with ``meta["val"]`` on its nodes) in place
    and compile each partition; returns the module (partitions as ``YiragePartition``
    submodules) and its report.

    Raises TorchCompileError (``fallback="raise"``) when a partition cannot be lowered or
    compiled; BackendUnavailableError for an unavailable ``options.backend``."""
    backend = resolve_backend(options.backend).value
    rewrite_linear(gm)
    support = _Support(options)
    partitioner = CapabilityBasedPartitioner(gm, support, allows_single_node_partition=True)
    report = GraphReport()
    kept = []
    for p in partitioner.propose_partitions():
        nodes = [n for n in gm.graph.nodes if n in p.nodes]
        compute = sum(1 for n in nodes if n.target not in VIEW_TARGETS)
        if compute < options.min_block_size:
            for n in nodes:
                support.declined[n.name] = (f"in a partition of {compute} compute op(s), fewer than "
                                            f"min_block_size={options.min_block_size}")
        else:
            kept.append(p)
    if kept:
        partitioner.fuse_partitions(kept, prefix="yirage_partition_")
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and node.target.startswith("yirage_partition_"):
            sub = getattr(gm, node.target)
            part = YiragePartition(node.target, sub, [a.meta.get("val") for a in node.args], backend, options)
            setattr(gm, node.target, part)
            report.partitions.append(part.report)
        elif node.op == "call_function":
            why = (support.declined.get(node.name) or support.reason(node)
                   or "lowers, but the partitioner left it out of every partition")
            report.torch_ops.append(TorchOp(node.name, node_op(node), why))
            logger.debug("yirage torch.compile: %s (%s) stays in torch: %s", node.name, node_op(node), why)
    gm.recompile()
    symbolic = [t.node for t in report.torch_ops if "symbolic shape" in t.reason]
    if symbolic:
        warnings.warn(f"yirage: {len(symbolic)} op(s) of this graph ({', '.join(symbolic[:3])}"
                      f"{', ...' if len(symbolic) > 3 else ''}) have symbolic (dynamic) shapes, which "
                      "yirage does not lower yet: they run in torch. torch.compile(..., dynamic=False) "
                      "(yr.compile's default) compiles each shape statically instead",
                      YirageFallbackWarning, stacklevel=2)
    return gm, report


@contextlib.contextmanager
def _cache_dir(path: str | None):
    """``YIRAGE_CACHE_DIR`` set to ``path`` while kernels compile (unchanged when None)."""
    if path is None:
        yield
        return
    before = os.environ.get("YIRAGE_CACHE_DIR")
    os.environ["YIRAGE_CACHE_DIR"] = path
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("YIRAGE_CACHE_DIR", None)
        else:
            os.environ["YIRAGE_CACHE_DIR"] = before


class YiragePartition(torch.nn.Module):
    """One partition of a torch.compile'd graph, run as a compiled yirage kernel graph.

    Args:
        name: the submodule's name in the parent graph.
        torch_module: the partition as torch ops (the fused ``GraphModule``); it runs when
            the partition falls back.
        input_vals: the example values (fake tensors) of the partition's inputs, in order.
        backend: the yirage backend name the µGraph is compiled for.
        options: the checked ``CompileOptions``.

    ``forward(*inputs)`` takes the tensors the parent graph passes (any strides; they are
    made contiguous) and returns one tensor or a tuple, like ``torch_module``.

    Raises TorchCompileError with ``fallback="raise"`` when lowering, compiling or the first
    call fails; with ``fallback="eager"`` it warns once (``YirageFallbackWarning``) and runs
    ``torch_module`` from then on.
    """

    def __init__(self, name: str, torch_module: GraphModule, input_vals: list, backend: str,
                 options: CompileOptions):
        super().__init__()
        self.torch_module = torch_module
        self.options = options
        self.backend = backend
        calls = [n for n in torch_module.graph.nodes if n.op == "call_function"]
        self.report = PartitionReport(name, [node_op(n) for n in calls])
        self._runner = None
        self._constants: list[torch.Tensor] = []
        self._tuple_out = True
        self._calls = 0
        try:
            with _cache_dir(options.cache_dir), unset_fake_temporarily():
                self._build(input_vals)
        except Exception as e:  # noqa: BLE001 - any failure is a fallback, reported below
            self._fall_back("could not be lowered or compiled", e)

    def _build(self, input_vals: list) -> None:
        impl = get_backend_impl(self.backend)
        g = KNGraph(self.backend)
        e = Emitter(g)
        placeholders = [n for n in self.torch_module.graph.nodes if n.op == "placeholder"]
        for node, val in zip(placeholders, input_vals):
            if not isinstance(val, torch.Tensor):
                raise TorchCompileError(f"input {node.name} is not a tensor ({type(val).__name__})")
            if val.device.type != impl.torch_device.type:
                raise TorchCompileError(f"input {node.name} is on {val.device}, backend {self.backend} "
                                        f"runs on {impl.torch_device.type}")
            e.env[node] = g.new_input(tuple(val.shape), dtype=as_dtype(val.dtype), name=node.name)
        out_arg = None
        for node in self.torch_module.graph.nodes:
            if node.op == "call_function":
                e.env[node] = LOWERINGS[node.target].emit(e, node)
            elif node.op == "output":
                out_arg = node.args[0]
            elif node.op != "placeholder":
                raise TorchCompileError(f"unexpected {node.op} node {node.name} in a partition")
        self._tuple_out = isinstance(out_arg, (tuple, list))
        for o in (out_arg if self._tuple_out else [out_arg]):
            g.mark_output(e[o])
        self._constants = [c.to(impl.torch_device) for c in e.constants]
        if self.options.mode == "max-autotune":
            self._runner = g.superoptimize(backend=self.backend, time_budget_s=self.options.time_budget_s)
            self.report.compiled_as = f"superoptimize: {self._runner.description}"
        else:
            self._runner = g.compile(self.backend)
            self.report.compiled_as = f"fixed fusion: {self._runner.num_kernels} launch(es)"

    def _fall_back(self, what: str, error: Exception) -> None:
        ops = ", ".join(dict.fromkeys(self.report.ops))
        reason = f"{what}: {type(error).__name__}: {error}"
        self.report.runs_in, self.report.reason = "torch", reason
        self._runner = None
        message = f"yirage partition {self.report.name} ({ops}) {reason}"
        if self.options.fallback == "raise":
            raise TorchCompileError(message + " (fallback='raise'; use fallback='eager' to run it in torch)") from error
        logger.debug("%s; running its torch ops", message)
        warnings.warn(message + "; running its torch ops instead", YirageFallbackWarning, stacklevel=2)

    @property
    def runs_in_yirage(self) -> bool:
        """Whether calls run the compiled µGraph (False after a fallback)."""
        return self._runner is not None

    def forward(self, *inputs):
        """Run the partition on the tensors the parent graph passes (in the order of the
        torch module's placeholders); returns what the torch module would (one tensor or a
        tuple)."""
        if self._runner is None:
            return self.torch_module(*inputs)
        self._calls += 1
        try:
            outs = self._runner([*inputs, *self._constants])
        except Exception as e:  # noqa: BLE001
            if self._calls > 1:
                raise
            self._fall_back("failed on its first call", e)
            return self.torch_module(*inputs)
        return tuple(outs) if self._tuple_out else outs[0]
