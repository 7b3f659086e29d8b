"""Runs a compiled kernel graph as one task graph on persistent CPU worker threads.

This is the executor of ``yr.PersistentKernel`` on the CPU (Mirage's persistent kernel, MPK,
carried to a multicore CPU; the scheduler is ``kernels/cpu/persistent.cpp``). Where
``Plan`` launches one kernel after another (each an OpenMP fork/join), ``TaskGraphPlan``
asks the backend for each step's *task form* (``TaskOp``: a C task function, its int64
argument block and the slices of its work, e.g. GEMV row ranges or attention (KV head,
KV split) pairs), derives the dependencies between ops from the buffers they read and
write (read-after-write, write-after-read, write-after-write; views share their base
buffer), and hands the whole step to the scheduler in one foreign call. Steps the backend
has no task form for (an op running as a torch reference, a broadcast copy) run in Python
between task-graph *segments*; a graph made only of task ops is one segment, so a decode
step costs Python one call.

This module must never import a backend: task forms come through the backend contract
(``BackendImpl.bind_library_task``, ``Kernel.task``).
"""
from __future__ import annotations

import atexit
import ctypes
import dataclasses
import functools
import os
import threading
from typing import Sequence

import torch

from ..errors import GraphError
from ..ir.ops import OPS
from ..transforms.fusion import VIEW_OPS, FusedKernel
from .executor import Plan
from .toolchain import load_kernel_library

_P, _I = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {
    "yr_pk_pool_create": ((_I, _I), _P),
    "yr_pk_pool_destroy": ((_P,), None),
    "yr_pk_pool_width": ((_P,), _I),
    "yr_pk_graph_create": ((_P, _I, _P, _I, _P, _I, _P), _P),
    "yr_pk_graph_destroy": ((_P,), None),
    "yr_pk_graph_set_profiler": ((_P, _P, _I), None),
    "yr_pk_graph_profiled": ((_P,), _I),
    "yr_pk_run": ((_P, _P, _I, _P), _I),
    "yr_pk_test_task": ((_P, _I, _I), None),
    "yr_pk_test_redo_task": ((_P, _I, _I), None),
}
#: Columns of a profiler row (``profiler_tensor`` int64 [capacity, 6]).
PROFILE_FIELDS = ("worker", "step", "task", "start_ns", "end_ns", "op")


@functools.lru_cache(maxsize=1)
def scheduler() -> ctypes.CDLL:
    """The persistent-kernel scheduler library (built once, cached on disk).

    Raises ToolchainError when no C++ compiler is installed or the build fails."""
    lib = load_kernel_library("persistent", symbols=tuple(_SIGNATURES))
    for name, (args, res) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = list(args), res
    return lib


@dataclasses.dataclass
class TaskOp:
    """One op of a task graph, as a backend describes it.

    Attributes:
        name: what the op is (shown in traces), e.g. 'linear q4_1 576x576'.
        fn: address of a C function ``void fn(const int64_t* args, int64_t lo, int64_t hi)``.
        args: int64 tensor [n], the function's argument block (pointers and sizes).
        ranges: the op's tasks, one ``(lo, hi)`` slice of its work each (at least one).
        keep: tensors that must outlive the op (scratch buffers the args point into).
        redo_arg: -1, or (a *redoable* op) the index in ``args`` of the pointer to its only
            output, of which each task writes elements [lo, hi) of ``elem`` bytes, reading
            nothing it writes. The scheduler may then run a task on a second worker when the
            first one is held up (preempted), each into its own scratch, and keep the first
            finished: see kernels/cpu/persistent.cpp.
        elem: bytes per output element of a redoable op (1, 2, 4 or 8).
    """

    name: str
    fn: int
    args: torch.Tensor
    ranges: list[tuple[int, int]]
    keep: list = dataclasses.field(default_factory=list)
    redo_arg: int = -1
    elem: int = 0


def task_op(name: str, fn: int, args: Sequence[int], ranges: Sequence[tuple[int, int]], keep=(),
            redo_arg: int = -1, elem: int = 0) -> TaskOp:
    """A ``TaskOp`` with its argument block built from ints (pointers, sizes)."""
    return TaskOp(name, int(fn), torch.tensor([int(a) for a in args], dtype=torch.int64),
                  [(int(lo), int(hi)) for lo, hi in ranges], list(keep), int(redo_arg), int(elem))


def split_range(n: int, tasks: int, multiple: int = 1) -> list[tuple[int, int]]:
    """[0, n) cut into at most ``tasks`` slices of equal size rounded up to ``multiple``."""
    tasks = max(1, min(tasks, n))
    size = -(-n // tasks)
    size = -(-size // multiple) * multiple
    return [(lo, min(n, lo + size)) for lo in range(0, n, size)] or [(0, 0)]


class WorkerPool:
    """``num_workers`` persistent workers (the calling thread plus ``num_workers - 1``
    threads) that run task graphs; they sleep between steps.

    ``adaptive``: time the step with fewer workers now and then and keep the fastest width
    (off by default: a preempted worker's tasks are redone or taken over by the others).

    Raises GraphError if num_workers is not in 1..1024; ToolchainError if the scheduler
    cannot be built.
    """

    def __init__(self, num_workers: int, adaptive: bool = False):
        if not isinstance(num_workers, int) or not 1 <= num_workers <= 1024:
            raise GraphError(f"num_workers must be an integer in 1..1024, got {num_workers!r}")
        self.num_workers = num_workers
        self.adaptive = bool(adaptive)
        self.pid = os.getpid()  # the threads exist in this process only (not in a fork's child)
        self.lib = scheduler()
        self.handle = self.lib.yr_pk_pool_create(num_workers, int(adaptive))
        if not self.handle:
            raise GraphError(f"could not create a pool of {num_workers} workers")
        self._lock = threading.Lock()  # one step at a time per pool

    @property
    def width(self) -> int:
        """Workers the pool uses now (its adaptive choice)."""
        return int(self.lib.yr_pk_pool_width(self.handle))

    def close(self) -> None:
        """Stop and join the worker threads (idempotent)."""
        if self.handle:
            self.lib.yr_pk_pool_destroy(self.handle)
            self.handle = None


_pools: dict[tuple[int, bool], WorkerPool] = {}
if hasattr(os, "register_at_fork"):
    # A forked child has none of the parent's worker threads: it must never run on (or join)
    # the parent's pools; it makes its own on first use (see TaskGraphPlan._live_pool).
    os.register_at_fork(after_in_child=_pools.clear)


def default_num_workers() -> int:
    """The cores this process may run on (``os.sched_getaffinity``; ``os.cpu_count`` where
    that does not exist)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def get_pool(num_workers: int | None = None, adaptive: bool = False) -> WorkerPool:
    """The process's shared pool of ``num_workers`` (default: ``default_num_workers()``)."""
    key = (num_workers or default_num_workers(), bool(adaptive))
    if key not in _pools or _pools[key].pid != os.getpid():
        _pools[key] = WorkerPool(*key)
    return _pools[key]


@atexit.register
def _close_pools() -> None:
    for pool in _pools.values():
        pool.close()


class _Segment:
    """Consecutive task ops compiled into one scheduler graph. ``buffers``: the tensors the
    ops read and write; they live as long as the graph (whose destruction first waits for
    any worker still running a task that another worker redid)."""

    def __init__(self, ops: list[TaskOp], deps: list[set[int]], buffers: Sequence[torch.Tensor] = ()):
        self.ops = ops
        self.buffers = list(buffers)
        lib = scheduler()
        rows, op_rows, dep_list = [], [], []
        for o, op in enumerate(ops):
            op_rows.append((len(op.ranges), len(dep_list), len(dep_list) + len(deps[o])))
            dep_list.extend(sorted(deps[o]))
            rows.extend((op.fn, op.args.data_ptr(), op.args.numel(), lo, hi, o, op.redo_arg, op.elem)
                        for lo, hi in op.ranges)
        self.task_names = [op.name for op in ops for _ in op.ranges]
        self.tasks = torch.tensor(rows, dtype=torch.int64).reshape(-1, 8)
        self.op_table = torch.tensor(op_rows, dtype=torch.int64).reshape(-1, 3)
        self.dep_table = torch.tensor(dep_list or [0], dtype=torch.int64)
        err = ctypes.c_int64(0)
        self.handle = lib.yr_pk_graph_create(self.tasks.data_ptr(), len(rows), self.op_table.data_ptr(), len(ops),
                                             self.dep_table.data_ptr(), len(dep_list), ctypes.byref(err))
        if not self.handle:
            raise GraphError(f"the task graph is malformed (scheduler error {err.value}); this is a yirage bug")
        self._destroy = lib.yr_pk_graph_destroy

    def __del__(self):
        if getattr(self, "handle", None):
            self._destroy(self.handle)
            self.handle = None


class TaskGraphPlan(Plan):
    """A ``Plan`` whose steps run as task graphs on a ``WorkerPool``.

    Args:
        cg: a ``CompiledGraph`` (its backend must provide task forms, see the module doc).
        inputs: contiguous input tensors on the backend's device (bound, not copied).
        pool: the workers.

    ``run()`` runs one step (returns the outputs, raises IndexOutOfRangeError like
    ``Plan.run``); ``run_steps(max_steps, meta)`` runs the decode loop inside the scheduler
    (see ``PersistentKernel``). ``segments`` is the number of scheduler graphs (1 when
    every step has a task form).
    """

    epilogue_fusion = False  # every step is its own task (dependencies by buffer)
    strided_views = False    # its buffers are tracked whole: permutes stay copies

    def __init__(self, cg, inputs: list[torch.Tensor], pool: WorkerPool):
        self.pool = pool
        self._items: list[tuple[str, object, list, list]] = []  # (kind, TaskOp | thunk, reads, writes)
        super().__init__(cg, inputs)
        self._segments: list = self._build_segments()
        self.segments = sum(isinstance(s, _Segment) for s in self._segments)
        self._run = self._run_segments
        self._profiler: torch.Tensor | None = None

    # ---- binding: record task ops (or host thunks) with the buffers they touch ----------
    def _bind_fused(self, k: FusedKernel) -> None:
        kernel = self.cg.kernels[id(k)]
        task = getattr(kernel, "task", None)
        if task is None or any(i.mode == "expand" for i in k.inputs):
            n = len(self.thunks)
            super()._bind_fused(k)
            for thunk in self.thunks[n:]:
                self._items.append(("host", thunk, [self.env[i.tid] for i in k.inputs],
                                    [self.env[tid] for _, tid, _ in k.outputs]))
            return
        ins = [self.env[i.tid] for i in k.inputs]
        outs = [self._alloc(tid) for _, tid, _ in k.outputs]
        op = task(ins + outs, k.R, self.pool.num_workers)
        self._items.append(("task", [op], ins, outs))

    def _bind_library(self, node) -> None:
        if node.op in VIEW_OPS:
            return super()._bind_library(node)
        impl = self.cg.impl
        args = [self.env[i] for i in node.inputs]
        writes = [args[i] for i in OPS[node.op].mutates]
        bind_task = getattr(impl, "bind_library_task", None)
        if bind_task is not None and impl.supports(node, self.cg.graph):
            out = self._alloc(node.output)
            status = None
            if OPS[node.op].index_input is not None:
                status = self._status[len(self._status_nodes)]
                self._status_nodes.append(node)
            ops = bind_task(node, self.cg.graph, args, out, status, self.pool.num_workers)
            if ops is not None:
                self._items.append(("task", ops, args, [out, *writes]))
                return
            # no task form for this case: a plain launch (reuses the status slot)
            self.thunks.append(impl.bind_library_op(node, self.cg.graph, args, out, status))
            self._items.append(("host", self.thunks[-1], args, [out, *writes]))
            return
        n = len(self.thunks)
        super()._bind_library(node)
        for thunk in self.thunks[n:]:
            self._items.append(("host", thunk, args, [self.env[node.output], *writes]))

    # ---- segments ---------------------------------------------------------------------
    def _build_segments(self) -> list:
        segments: list = []
        ops: list[TaskOp] = []
        deps: list[set[int]] = []
        last_writer: dict[int, int] = {}
        readers: dict[int, set[int]] = {}
        buffers: list[torch.Tensor] = []

        def key(t: torch.Tensor) -> int:
            return t.untyped_storage().data_ptr()

        def flush():
            if ops:
                segments.append(_Segment(list(ops), list(deps), list(buffers)))
                ops.clear(), deps.clear(), last_writer.clear(), readers.clear(), buffers.clear()

        for kind, what, reads, writes in self._items:
            if kind == "host":
                flush()
                segments.append(what)
                continue
            first = len(ops)
            buffers.extend(reads), buffers.extend(writes)
            need: set[int] = set()
            for t in reads:
                if key(t) in last_writer:
                    need.add(last_writer[key(t)])
            for t in writes:
                if key(t) in last_writer:
                    need.add(last_writer[key(t)])
                need |= readers.get(key(t), set())
            for j, op in enumerate(what):
                ops.append(op)
                deps.append(need if j == 0 else {first + j - 1})
            last = len(ops) - 1
            for t in reads:
                readers.setdefault(key(t), set()).add(last)
            for t in writes:
                last_writer[key(t)] = last
                readers[key(t)] = set()
        flush()
        return segments

    # ---- running ------------------------------------------------------------------------
    def _live_pool(self) -> WorkerPool:
        """The plan's pool, or after a fork (the parent's threads are gone in the child) a
        pool of this process with the same settings."""
        if self.pool.pid != os.getpid():
            self.pool = get_pool(self.pool.num_workers, self.pool.adaptive)
        return self.pool

    def _run_segments(self) -> None:
        pool = self._live_pool()
        lib = pool.lib
        with pool._lock:
            for seg in self._segments:
                if isinstance(seg, _Segment):
                    lib.yr_pk_run(pool.handle, seg.handle, 1, None)
                else:
                    seg()

    def capture(self) -> None:
        """Nothing to capture: a step is already one call per segment."""

    def set_profiler(self, buffer: torch.Tensor | None) -> None:
        """Record every task's worker, step, start and end (ns) into ``buffer`` (int64
        [capacity, 6], columns ``PROFILE_FIELDS``) until it is full; None stops recording.

        Raises GraphError when the buffer is not a contiguous int64 CPU tensor [n, 6], or the
        plan has more than one segment (tasks of later segments would overwrite rows)."""
        segs = [s for s in self._segments if isinstance(s, _Segment)]
        if buffer is None:
            for s in segs:
                self.pool.lib.yr_pk_graph_set_profiler(s.handle, None, 0)
            self._profiler = None
            return
        if (buffer.dtype != torch.int64 or buffer.dim() != 2 or buffer.shape[1] != len(PROFILE_FIELDS)
                or not buffer.is_contiguous() or buffer.device.type != "cpu"):
            raise GraphError("profiler_tensor must be a contiguous int64 CPU tensor of shape "
                             f"[capacity, {len(PROFILE_FIELDS)}], got {tuple(buffer.shape)} {buffer.dtype}")
        if len(segs) != 1:
            raise GraphError("profiling needs a task graph of one segment; this one has "
                             f"{len(segs)} (some ops run outside the scheduler)")
        self._profiler = buffer
        self.pool.lib.yr_pk_graph_set_profiler(segs[0].handle, buffer.data_ptr(), buffer.shape[0])

    def profiled_rows(self) -> int:
        """Rows of the profiler buffer written so far."""
        segs = [s for s in self._segments if isinstance(s, _Segment)]
        return int(self.pool.lib.yr_pk_graph_profiled(segs[0].handle)) if self._profiler is not None else 0

    @property
    def task_names(self) -> list[str]:
        """Name of each task of the (single) segment, by task index (for traces)."""
        segs = [s for s in self._segments if isinstance(s, _Segment)]
        return segs[0].task_names if len(segs) == 1 else []

    @property
    def num_tasks(self) -> int:
        """Tasks per step over all segments."""
        return sum(len(s.tasks) for s in self._segments if isinstance(s, _Segment))

    def run_steps(self, max_steps: int, meta: torch.Tensor) -> int:
        """Run up to ``max_steps`` decode steps inside the scheduler (see
        kernels/cpu/persistent.cpp ``yr_pk_run`` for the int64 ``meta`` block); returns the
        steps run. Raises GraphError if the plan is not a single segment, and
        IndexOutOfRangeError like ``run``."""
        if len(self._segments) != 1 or not isinstance(self._segments[0], _Segment):
            raise GraphError("the decode loop needs every op of the step in the task graph; this step "
                             f"has {len(self._segments)} segments")
        pool = self._live_pool()
        with pool._lock:
            ran = int(pool.lib.yr_pk_run(pool.handle, self._segments[0].handle, max_steps, meta.data_ptr()))
        if self._status is not None and bool(self._status[:, 0].any()):
            self._raise_index_error(self._status)
        return ran


def compiled_task_graph(cg, inputs: Sequence[torch.Tensor], pool: WorkerPool) -> TaskGraphPlan:
    """``TaskGraphPlan`` of ``cg`` bound to ``inputs`` (checked like ``CompiledGraph.plan``)."""
    return TaskGraphPlan(cg, cg.check_bindable(inputs), pool)

