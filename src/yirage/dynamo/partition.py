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
import operator
import os
import threading
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupportBase

from ..backends import get_backend_impl, resolve_backend
from ..backends.cpu.precision import warn_if_emulated
from ..config import logger
from ..dtypes import as_dtype
from ..errors import TorchCompileError, YirageFallbackWarning
from ..kernel import KNGraph
from . import cache
from .lowering import (LOWERINGS, VIEW_TARGETS, Emitter, drop_legacy_empty_cat_inputs, rewrite_gelu_tanh,
                       rewrite_linear, rewrite_rotary_emb)
from .options import CompileOptions, op_name
from .specialize import is_symbolic, signature, specialize

#: the name prefix of the partitions' submodules in a lowered graph
PARTITION_PREFIX = "yirage_partition_"


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
    symbolic: bool = False   # compiled per input signature (dynamic shapes)
    variants: int = 0        # signatures compiled or loaded so far
    cache_hits: int = 0      # variants loaded from the compile cache (cache.py)
    cache_misses: int = 0    # variants lowered and compiled here (and stored)

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


def _kept_in_torch(options: CompileOptions, name: str) -> bool:
    """Is the op ``name`` ("aten.gelu.default") listed in ``torch_executed_ops``, as its
    overload or its packet ("aten.gelu")?"""
    return name in options.torch_executed_ops or name.rsplit(".", 1)[0] in options.torch_executed_ops


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
            if name.startswith(("_c10d_functional.", "c10d_functional.", "_dtensor.")):
                # a DTensor model's collectives (tensor parallelism): torch.distributed runs them
                # between the yirage partitions on either side
                return f"a collective ({name}): torch.distributed runs it between partitions"
            return f"no lowering for {name}"
        if _kept_in_torch(self.options, name):
            return "listed in torch_executed_ops"
        return lowering.check(node)

    def is_node_supported(self, submodules, node: Node) -> bool:
        if node.op != "call_function":
            return False
        why = self.reason(node)
        if why:
            self.declined[node.name] = why
        return why is None


def lower_graph(gm: GraphModule, options: CompileOptions, static_inputs: frozenset[int] = frozenset(),
                constant_inputs: frozenset[int] = frozenset()) -> tuple[GraphModule, GraphReport]:
    """Partition ``gm`` (an ATen inference graph with ``meta["val"]`` on its nodes) in place
    and compile each partition; returns the module (partitions as ``YiragePartition``
    submodules) and its report. ``static_inputs``: positions of ``gm``'s placeholders that are
    the same tensors at every call (parameters and buffers); ``constant_inputs``: those that
    hold frozen weights, which partitions declare constant to the backend
    (compiler.static_inputs).

    Raises TorchCompileError (``fallback="raise"``) when a partition cannot be lowered or
    compiled; BackendUnavailableError for an unavailable ``options.backend``."""
    backend = resolve_backend(options.backend).value
    if options.dtype == "bfloat16" and backend == "cpu":
        warn_if_emulated("bfloat16", "torch.compile(options={'dtype': 'bfloat16'})")

    def in_torch(target) -> bool:
        return _kept_in_torch(options, op_name(target))
    rewrite_linear(gm, in_torch)
    rewrite_rotary_emb(gm, in_torch)
    rewrite_gelu_tanh(gm, in_torch)
    drop_legacy_empty_cat_inputs(gm)
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
        partitioner.fuse_partitions(kept, prefix=PARTITION_PREFIX)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    frozen = {placeholders[i] for i in constant_inputs if i < len(placeholders)}
    static = {placeholders[i] for i in static_inputs if i < len(placeholders)}
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and node.target.startswith(PARTITION_PREFIX):
            part = _wrap_partition(gm, node, backend, options, [j for j, a in enumerate(node.args) if a in frozen],
                                   [j for j, a in enumerate(node.args) if a in static])
            report.partitions.append(part.report)
        elif node.op == "call_function" and node.target is operator.getitem:
            pass   # picks one output of a torch op (a multi-output op stays in torch whole)
        elif node.op == "call_function":
            why = (support.declined.get(node.name) or support.reason(node)
                   or "lowers, but the partitioner left it out of every partition")
            if isinstance(node.meta.get("val"), (torch.SymInt, torch.SymBool, torch.SymFloat)):
                why = f"a size computation on symbolic dims (host integer arithmetic; {why})"
            report.torch_ops.append(TorchOp(node.name, node_op(node), why))
            logger.debug("yirage torch.compile: %s (%s) stays in torch: %s", node.name, node_op(node), why)
    gm.recompile()
    return gm, report


def _wrap_partition(gm: GraphModule, node: Node, backend: str, options: CompileOptions,
                    constant_positions: list[int], static_positions: list[int]) -> YiragePartition:
    """Replace the fused submodule that ``node`` calls by a ``YiragePartition`` (compiled now
    when its shapes are static) and return it."""
    part = YiragePartition(node.target, getattr(gm, node.target), [a.meta.get("val") for a in node.args],
                           backend, options, constant_positions, static_positions)
    setattr(gm, node.target, part)
    return part


def restore_partitions(gm: GraphModule, options: CompileOptions, layout: dict[str, tuple[list[int], list[int]]]
                       ) -> GraphReport:
    """Turn a partitioned graph stored without its ``YiragePartition`` modules (each fused
    submodule as its torch ops, precompile.py) back into a running one: ``layout`` maps each
    partition's name to its (constant, static) input positions, as ``lower_graph`` chose
    them. Each partition compiles as in ``lower_graph`` (normally a hit in the compile cache).
    Returns the report of its partitions. Raises as ``lower_graph`` does."""
    backend = resolve_backend(options.backend).value
    report = GraphReport()
    for node in gm.graph.nodes:
        if node.op == "call_module" and node.target in layout:
            constant, static = layout[node.target]
            report.partitions.append(_wrap_partition(gm, node, backend, options, list(constant), list(static)).report)
    return report


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


#: compiled variants (input signatures) a partition keeps, least recently used dropped first
MAX_VARIANTS = 16


@dataclass
class _Variant:
    """One compiled signature of a partition: what runs it and its constant inputs."""

    runner: object                 # a CompiledGraph or a superoptimize OptimizedGraph
    constants: list[torch.Tensor]
    tuple_out: bool
    tensor_inputs: list[int]       # positions of the partition's inputs that are tensors
    calls: int = 0                 # the first call declares the frozen weights constant
    #: the variant's own buffers for the inputs that are not static (activations), made on the
    #: first call: each call copies its activations there, so the runner sees the same tensors
    #: every call and reuses its plan (binding a plan costs ~40 us per launch)
    staging: dict[int, torch.Tensor] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)   # guards ``staging``

    def run(self, inputs, static: set[int]) -> list[torch.Tensor]:
        """The runner's outputs (new tensors) for the partition's ``inputs``: staged, or as they
        are while another thread holds the staging buffers (the runner then binds a plan of
        its own, as ``CompiledGraph`` does for concurrent callers)."""
        if not self.lock.acquire(blocking=False):
            return self.runner([*(inputs[i] for i in self.tensor_inputs), *self.constants])
        try:
            return self.runner([*self._staged(inputs, static), *self.constants])
        finally:
            self.lock.release()

    def _staged(self, inputs, static: set[int]) -> list[torch.Tensor]:
        """The runner's tensor inputs: static ones as they are, the rest copied into ``staging``."""
        if not self.staging:
            self.staging = {i: torch.empty(inputs[i].shape, dtype=inputs[i].dtype, device=inputs[i].device)
                            for i in self.tensor_inputs if i not in static}
        out = []
        for i in self.tensor_inputs:
            buf = self.staging.get(i)
            out.append(inputs[i] if buf is None else buf.copy_(inputs[i]))
        return out


class YiragePartition(torch.nn.Module):
    """One partition of a torch.compile'd graph, run as compiled yirage kernel graphs.

    Args:
        name: the submodule's name in the parent graph.
        torch_module: the partition as torch ops (the fused ``GraphModule``); it runs when
            the partition falls back.
        input_vals: the example values (fake tensors, SymInts) of the partition's inputs.
        backend: the yirage backend name the µGraphs are compiled for.
        options: the checked ``CompileOptions``.
        constant_positions: positions of the inputs that are frozen weights (parameters and
            buffers the graph does not mutate); declared constant to the backend on each
            variant's first call (``BackendImpl.declare_constant``).
        static_positions: positions of the inputs that are the same tensors every call
            (parameters and buffers); the others (activations) are copied into the variant's
            own buffers at each call, so that its plan is bound once.

    Shapes may be symbolic (dynamic shapes): the partition is compiled per input signature
    (each tensor input's shape and dtype, each integer input's value; see specialize.py),
    on the first call with that signature, and keeps up to ``MAX_VARIANTS`` of them (least
    recently used dropped). A partition whose shapes are all static is compiled here, at
    once. Each variant is looked up in, and stored to, the compile cache (cache.py) first;
    the C++ of a graph with symbolic shapes takes its row width at run time, so a new
    sequence length reuses the kernels already built.

    ``forward(*inputs)`` takes what the parent graph passes (tensors of any strides, made
    contiguous; ints) and returns one tensor or a tuple, like ``torch_module``.

    Raises TorchCompileError with ``fallback="raise"`` when lowering, compiling or the first
    call of a variant fails; with ``fallback="eager"`` it warns once
    (``YirageFallbackWarning``) and runs ``torch_module`` from then on.
    """

    def __init__(self, name: str, torch_module: GraphModule, input_vals: list, backend: str,
                 options: CompileOptions, constant_positions: list[int] | None = None,
                 static_positions: list[int] | None = None):
        super().__init__()
        self.constant_positions = list(constant_positions or [])
        self.static_positions = set(static_positions or [])
        self.torch_module = torch_module
        self.options = options
        self.backend = backend
        calls = [n for n in torch_module.graph.nodes if n.op == "call_function"]
        self.report = PartitionReport(name, [node_op(n) for n in calls])
        self.symbolic = any(is_symbolic(v) for v in input_vals) or any(
            is_symbolic(n.meta.get("val")) for n in calls)
        self.report.symbolic = self.symbolic
        self._variants: OrderedDict[tuple, _Variant] = OrderedDict()
        self._failed = False
        self._code = torch_module.code
        if not self.symbolic:
            try:
                self._variant(input_vals)
            except Exception as e:  # noqa: BLE001 - any failure is a fallback, reported below
                self._fall_back("could not be lowered or compiled", e)

    # ---- building one variant -----------------------------------------------------------
    def _variant(self, inputs) -> _Variant:
        """The compiled variant for the signature of ``inputs`` (built or loaded on a miss). A
        partition with static shapes has one (dynamo's guards keep the shapes it was traced
        with), so its calls skip computing the signature."""
        if not self.symbolic and len(self._variants) == 1:
            return next(iter(self._variants.values()))
        sig = signature(inputs)
        v = self._variants.get(sig)
        if v is not None:
            self._variants.move_to_end(sig)
            return v
        with _cache_dir(self.options.cache_dir), unset_fake_temporarily():
            v = self._load_or_build(sig, inputs)
        self._variants[sig] = v
        while len(self._variants) > MAX_VARIANTS:
            self._variants.popitem(last=False)
        self.report.variants += 1
        return v

    def _load_or_build(self, sig: tuple, inputs) -> _Variant:
        emitters = [LOWERINGS[n.target].emit for n in self.torch_module.graph.nodes
                    if n.op == "call_function" and n.target in LOWERINGS]
        k = cache.key(self._code, sig, self.options, self.backend, emitters)
        entry, status = cache.load(k)
        tensor_inputs = [i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor)]
        if entry is not None:
            try:
                v = self._from_entry(entry, tensor_inputs)
                self.report.cache_hits += 1
                return v
            except Exception as e:  # noqa: BLE001 - a damaged entry is rebuilt, never fatal
                cache.reject(k, None, e)
        self.report.cache_misses += 1
        v, entry = self._build(inputs, tensor_inputs)
        cache.store(k, entry)
        return v

    def _graph(self, g: KNGraph) -> KNGraph:
        g.runtime_row_width = self.symbolic   # transforms/fusion.py: C++ takes D at run time
        # transforms/parallel.py on static shapes only: a measured choice per size would give a
        # symbolic partition a new structure (and C++ builds) at some sizes
        g.merge_parallel_ops = not self.symbolic
        return g

    def _from_entry(self, entry: cache.Entry, tensor_inputs: list[int]) -> _Variant:
        impl = get_backend_impl(self.backend)
        g = self._graph(KNGraph.from_json(entry.graph))
        g.backend = self.backend
        consts = [c.to(impl.torch_device) for c in entry.constant_tensors()]
        if len(g.inputs) != len(tensor_inputs) + len(consts):
            raise ValueError(f"the cached graph has {len(g.inputs)} inputs, the partition passes "
                             f"{len(tensor_inputs) + len(consts)}")
        if entry.winner is not None and self.options.mode == "max-autotune":
            from ..search.superoptimize import OptimizedGraph
            win = self._graph(KNGraph.from_json(entry.winner["graph"]))
            runner = OptimizedGraph(win, self.backend, str(entry.winner["description"]),
                                    dict(entry.winner.get("report") or {}, cached=True))
            runner.compile()
            self.report.compiled_as = f"superoptimize: {runner.description} (cached)"
        else:
            runner = g.compile(self.backend)
            self.report.compiled_as = f"fixed fusion: {runner.num_kernels} launch(es)"
        return _Variant(runner, consts, entry.tuple_out, tensor_inputs)

    def _build(self, inputs, tensor_inputs: list[int]) -> tuple[_Variant, cache.Entry]:
        impl = get_backend_impl(self.backend)
        gm = specialize(self.torch_module, inputs) if self.symbolic else self.torch_module
        g = self._graph(KNGraph(self.backend))
        e = Emitter(g, self.options.dtype)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        for i in tensor_inputs:
            node, val = placeholders[i], inputs[i]
            if val.device.type != impl.torch_device.type:
                raise TorchCompileError(f"input {node.name} is on {val.device}, backend {self.backend} "
                                        f"runs on {impl.torch_device.type}")
            if "val" in node.meta and tuple(node.meta["val"].shape) != tuple(val.shape):
                raise TorchCompileError(f"input {node.name}: shape {tuple(val.shape)} differs from the "
                                        f"graph's {tuple(node.meta['val'].shape)}")
            e.env[node] = g.new_input(tuple(val.shape), dtype=as_dtype(val.dtype), name=node.name)
        out_arg = None
        for node in gm.graph.nodes:
            if node.op == "call_function":
                e.env[node] = LOWERINGS[node.target].emit(e, node)
            elif node.op == "output":
                out_arg = node.args[0]
            elif node.op != "placeholder":
                raise TorchCompileError(f"unexpected {node.op} node {node.name} in a partition")
        tuple_out = isinstance(out_arg, (tuple, list))
        for o in (out_arg if tuple_out else [out_arg]):
            g.mark_output(e[o])
        consts = [c.to(impl.torch_device) for c in e.constants]
        entry = cache.Entry(g.to_json(), cache.Entry.constants_of(e.constants), tuple_out)
        if self.options.mode == "max-autotune":
            runner = g.superoptimize(backend=self.backend, time_budget_s=self.options.time_budget_s)
            self._graph(runner.graph)
            runner.compile()
            entry.winner = {"graph": runner.graph.to_json(), "description": runner.description,
                            "report": runner.report}
            self.report.compiled_as = f"superoptimize: {runner.description}"
        else:
            runner = g.compile(self.backend)
            self.report.compiled_as = f"fixed fusion: {runner.num_kernels} launch(es)"
        return _Variant(runner, consts, tuple_out, tensor_inputs), entry

    def _fall_back(self, what: str, error: Exception) -> None:
        ops = ", ".join(dict.fromkeys(self.report.ops))
        reason = f"{what}: {type(error).__name__}: {error}"
        self.report.runs_in, self.report.reason = "torch", reason
        self._failed = True
        self._variants.clear()
        message = f"yirage partition {self.report.name} ({ops}) {reason}"
        if self.options.fallback == "raise":
            raise TorchCompileError(message + " (fallback='raise'; use fallback='eager' to run it in torch)") from error
        logger.debug("%s; running its torch ops", message)
        warnings.warn(message + "; running its torch ops instead", YirageFallbackWarning, stacklevel=2)

    @property
    def runs_in_yirage(self) -> bool:
        """Whether calls run compiled µGraphs (False after a fallback)."""
        return not self._failed

    def forward(self, *inputs):
        """Run the partition on what the parent graph passes (in the order of the torch
        module's placeholders); returns what the torch module would (one tensor or a
        tuple)."""
        if self._failed:
            return self.torch_module(*inputs)
        try:
            v = self._variant(inputs)
        except Exception as e:  # noqa: BLE001
            self._fall_back("could not be lowered or compiled" + (
                f" for input signature {_describe(inputs)}" if self.symbolic else ""), e)
            return self.torch_module(*inputs)
        if v.calls == 0 and self.constant_positions:
            get_backend_impl(self.backend).declare_constant(
                [inputs[i] for i in self.constant_positions if isinstance(inputs[i], torch.Tensor)])
        v.calls += 1
        try:
            outs = v.run(inputs, self.static_positions)
        except Exception as e:  # noqa: BLE001
            if v.calls > 1:
                raise
            self._fall_back("failed on its first call", e)
            return self.torch_module(*inputs)
        return tuple(outs) if v.tuple_out else outs[0]


def _describe(inputs) -> str:
    return "(" + ", ".join(str(tuple(x.shape)) if isinstance(x, torch.Tensor) else repr(x) for x in inputs) + ")"
