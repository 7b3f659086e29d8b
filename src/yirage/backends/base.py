"""The contract every backend module implements, and the records it reports.

A backend is one device kind (CPU, an NVIDIA/AMD/Intel GPU, Apple silicon, a WebGPU adapter).
Where torch owns the device's memory (every backend but webgpu), a plan's buffers are torch
tensors; a backend with memory of its own allocates them itself (``alloc``) and moves a graph's
inputs and outputs across as torch CPU tensors (``stage_inputs``, ``fetch``). ``BackendImpl`` is the contract the
compiler and executor talk to: availability, description and memory, which library ops the
backend has kernels for (``supports``), compiling fused kernels (``compile`` -> ``Kernel``),
binding library ops (``bind_library_op``) and ``synchronize``.

This module must never pick a backend, fall back from one backend to another, or touch a
device: it only defines ``Backend``, ``BackendInfo``, ``MemoryInfo``, ``Kernel`` and
``BackendImpl``.
"""
from __future__ import annotations

import dataclasses
import enum
import math
import platform
from abc import ABC, abstractmethod
from typing import Any, Callable, ClassVar, Protocol

import torch

from yirage.codegen.eager import EagerKernel
from yirage.dtypes import DType
from yirage.errors import BackendUnavailableError

#: A launch with everything bound: calling it runs one kernel (or library call).
Thunk = Callable[[], None]


class Backend(enum.Enum):
    """The device kinds yirage knows; ``.value`` is the lower-case name ('cpu', 'cuda', ...).

    ``WEBGPU`` is any adapter wgpu finds (Metal, Vulkan, D3D12), kernels in WGSL.
    ``TRITON_INTERPRET`` is Triton's CPU interpreter running the GPU kernels on CPU tensors:
    a testing backend, available only with ``TRITON_INTERPRET=1``, never chosen by 'auto'.
    """

    CPU = "cpu"
    CUDA = "cuda"
    ROCM = "rocm"
    XPU = "xpu"
    MPS = "mps"
    WEBGPU = "webgpu"
    TRITON_INTERPRET = "triton-interpret"


@dataclasses.dataclass
class BackendInfo:
    """What a backend is running on.

    For an unavailable backend only ``name``, ``available`` (False), ``reason`` and
    ``versions`` are filled; the device fields are None and ``isa_flags`` is empty.
    ``memory_total_bytes`` is in bytes. ``compute_units`` is usable CPU cores for the CPU
    and streaming multiprocessors / compute units for a GPU. ``details`` holds
    backend-specific extras (thread counts, device index, ...). ``kernels`` says how fused
    kernels run there: 'compiled (cpp)', 'compiled (triton)' or 'torch ops'.
    """

    name: Backend
    available: bool
    reason: str | None = None
    device_name: str | None = None
    compute_units: int | None = None
    memory_total_bytes: int | None = None
    isa_flags: list[str] = dataclasses.field(default_factory=list)
    compute_capability: str | None = None
    versions: dict[str, str] = dataclasses.field(default_factory=dict)
    details: dict[str, Any] = dataclasses.field(default_factory=dict)
    kernels: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; ``name`` becomes its string value."""
        data = dataclasses.asdict(self)
        data["name"] = self.name.value
        return data


@dataclasses.dataclass
class MemoryInfo:
    """Device memory in bytes: ``total_bytes``, ``free_bytes`` and ``used_bytes``.

    ``free_bytes`` and ``used_bytes`` are None where the platform does not report them.
    """

    total_bytes: int
    free_bytes: int | None
    used_bytes: int | None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of the three fields."""
        return dataclasses.asdict(self)


def unavailable_error(requested: str, why: str) -> BackendUnavailableError:
    """The error for a backend that is unknown or unusable.

    ``why`` completes "backend '<requested>' is ..." (e.g. "unavailable: <reason>");
    the message ends with the list of backends that are available here.
    """
    from yirage.backends import get_available_backends  # the registry imports this module

    available = ", ".join(b.value for b in get_available_backends())
    return BackendUnavailableError(
        f"backend {requested!r} is {why}. Available backends: {available}"
    )


def bind_linear_stack_parts(node, graph, args, out, status, bind_linear: Callable) -> Thunk:
    """A ``linear_stack`` as the ``linear`` ops it stands for, each bound by the backend's
    ``bind_linear(node, graph, args, out, status)`` into its output plane ``out[i]``; one
    thunk running them in order."""
    from yirage.transforms.parallel import linear_stack_parts

    parts = [bind_linear(part, graph, [args[p] for p in pos], out[i], status)
             for i, (part, pos) in enumerate(linear_stack_parts(node))]

    def run():
        for p in parts:
            p()
    return run


def bind_conv2d_stack_parts(node, graph, args, out, status, bind_conv: Callable) -> Thunk:
    """A ``conv2d_stack`` as the ``conv2d`` ops it stands for, each bound by the backend's
    ``bind_conv(node, graph, args, out, status)`` into its view of the flat ``out`` (part i's
    output shape, at element offset sum(numel[:i])); one thunk running them in order."""
    from yirage.ir.conv import conv2d_stack_parts
    from yirage.ir.graph import OpNode
    from yirage.ir.ops import OPS

    thunks, off = [], 0
    for (attrs, ids), (_, ins) in zip(conv2d_stack_parts(node.inputs, node.attrs),
                                      conv2d_stack_parts(list(args), node.attrs)):
        shape = OPS["conv2d"].infer([graph.tensors[t] for t in ids], attrs).shape
        n = math.prod(shape)
        thunks.append(bind_conv(OpNode("conv2d", ids, attrs, node.output), graph, ins, out[off:off + n].view(shape),
                                status))
        off += n

    def run():
        for t in thunks:
            t()
    return run


def base_versions() -> dict[str, str]:
    """Versions every backend reports: torch and python."""
    return {"torch": torch.__version__, "python": platform.python_version()}


class Kernel(Protocol):
    """A fused kernel compiled for one backend (what ``BackendImpl.compile`` returns)."""

    def bind(self, tensors: list[torch.Tensor], rows: int) -> Thunk:
        """A thunk that runs the kernel over ``rows`` rows of ``tensors``.

        ``tensors`` are the kernel's inputs then its outputs (``FusedKernel.inputs`` and
        ``.outputs`` order), contiguous, on the backend's device. The thunk does no work
        beyond the launch (no allocation, no host synchronization).
        """
        ...

    # Optional: ``task(tensors, rows, num_workers) -> runtime.task_graph.TaskOp`` gives the
    # kernel's task form for the persistent kernel (the CPU's CppKernel has it).


class BackendImpl(ABC):
    """One device kind behind the backend contract (ggml-backend's device table, in Python).

    What the compiler and the executor may ask of a backend:

    - ``availability()`` -> (usable?, why not); ``info()``; ``memory_info()``;
    - ``torch_device``: where tensors for this backend live (torch allocates them);
    - ``supports(node, graph)``: does the backend have a kernel of its own for a library op
      (GEMM/GEMV, embedding, RoPE, attention, argmax, ...)? The executor runs an op that is
      not supported as its torch reference on ``torch_device`` (logged once per op);
    - ``compile(kernels)``: fused row kernels (transforms.fusion.FusedKernel) -> ``Kernel``s;
    - ``bind_library_op(node, graph, args, out, status)``: a thunk computing a supported op
      into ``out``; ops that index with run-time values (``OpDef.index_input``) get an int64
      ``status[4]`` on the device, where the kernel records an out-of-range index as
      ``[1, value, lo, hi]`` instead of accessing it (the executor raises after the run);
    - ``bind_library_op_epilogue(...)``: optionally, a library op and the fused row kernel
      after it as one thunk (the row kernel run on each block of finished rows);
    - ``capture(run)``: record a plan's launches once and return a replay (CUDA graphs);
      ``captures`` says whether it does (the executor then captures a plan that a graph's
      repeated calls reuse);
    - ``synchronize()``: wait for queued device work;
    - ``channels_last``: whether convolution chains should run in NHWC (kernel.py then applies
      transforms/conv.py's layout pass before compiling);
    - ``merge_linears(case)``: whether parallel linear layers of one input
      (transforms.parallel.LinearGroup) should run as one ``linear_stack`` (kernel.py applies
      transforms/parallel.py before compiling), and ``merge_convs(case)`` the same for parallel
      convolutions (``ConvGroup``, one ``conv2d_stack``). The defaults say no.

    Subclasses set ``name``, ``device_type`` (the torch device type) and ``codegen`` (the
    language fused kernels are compiled to: 'cpp', 'triton', or None when they run as torch
    ops), and implement ``unavailable_reason`` plus the ``_device_*`` methods, which are only
    called once the backend is known to be available.
    """

    name: ClassVar[Backend]
    codegen: ClassVar[str | None] = None
    device_type: ClassVar[str]
    captures: ClassVar[bool] = False   # capture() records launches for replay
    channels_last: ClassVar[bool] = False   # convolutions in NHWC (transforms/conv.py)

    # ---- availability and description -----------------------------------------------
    @abstractmethod
    def unavailable_reason(self) -> str | None:
        """Why this backend cannot be used here, or None when it can."""

    @abstractmethod
    def _device_info(self) -> BackendInfo:
        """``info()`` of an available backend."""

    @abstractmethod
    def _device_memory_info(self) -> MemoryInfo:
        """``memory_info()`` of an available backend."""

    def _device_synchronize(self) -> None:
        """Wait for queued device work; nothing to wait for by default."""

    def versions(self) -> dict[str, str]:
        """Runtime versions relevant to this backend (torch, python, driver stack)."""
        return base_versions()

    def availability(self) -> tuple[bool, str | None]:
        """(True, None) when usable here, else (False, the reason)."""
        reason = self.unavailable_reason()
        return reason is None, reason

    def is_available(self) -> bool:
        """True when this torch build and this machine can run the backend."""
        return self.unavailable_reason() is None

    @property
    def kernel_mode(self) -> str:
        """How fused kernels run: 'compiled (cpp)', 'compiled (triton)' or 'torch ops'."""
        return f"compiled ({self.codegen})" if self.codegen else "torch ops"

    @property
    def torch_device(self) -> torch.device:
        """The torch device that tensors for this backend live on."""
        return torch.device(self.device_type)

    def require_available(self) -> None:
        """Raises BackendUnavailableError (with the reason) unless the backend is available."""
        if not self.is_available():
            reason = self.unavailable_reason() or "is_available() returned False"
            raise unavailable_error(self.name.value, f"unavailable: {reason}")

    def info(self) -> BackendInfo:
        """Describe the device; never raises for an unavailable backend.

        Returns a BackendInfo with ``available=False``, the reason and empty device
        fields when the backend cannot be used here.
        """
        if not self.is_available():
            reason = self.unavailable_reason() or "is_available() returned False"
            info = BackendInfo(self.name, False, reason, versions=self.versions())
        else:
            info = self._device_info()
        info.kernels = self.kernel_mode
        return info

    def memory_info(self) -> MemoryInfo:
        """Device memory in bytes. Raises BackendUnavailableError if unavailable."""
        self.require_available()
        return self._device_memory_info()

    def synchronize(self) -> None:
        """Wait until queued work on the device is done. Raises if unavailable."""
        self.require_available()
        self._device_synchronize()

    # ---- compiling and binding --------------------------------------------------------
    def supports(self, node, graph) -> bool:
        """True if this backend has its own kernel for library op ``node`` (an
        ``ir.graph.OpNode`` of ``graph``, whose tensor types it may inspect).

        The default supports nothing: every library op runs as its torch reference.
        """
        return False

    def strided_io(self, node, graph) -> bool:
        """True if ``bind_library_op`` for ``node`` (a supported op) takes its inputs and its
        output as strided views whose last dim is contiguous (e.g. attention reading the heads
        of a [B, S, H, D] buffer as [B, H, S, D]): the executor then binds the permutes next to
        it as views instead of copies (``runtime.executor.layout_aliases``). The default,
        False: every buffer the op sees is contiguous."""
        return False

    def compile(self, kernels: list) -> list[Kernel]:
        """Compile fused kernels (transforms.fusion.FusedKernel), one ``Kernel`` each.

        The default renders them as torch ops on this backend's device
        (codegen/eager.py); backends with a code generator override it.
        """
        return [EagerKernel(k) for k in kernels]

    def bind_library_op(self, node, graph, args: list[torch.Tensor], out: torch.Tensor,
                        status: torch.Tensor | None = None) -> Thunk:
        """A thunk computing ``node`` from ``args`` into ``out`` (both on ``torch_device``).

        Only called for ops where ``supports(node, graph)`` is True. It must not allocate
        per call; whatever it needs (workspaces, pointer arrays) is made here, once.
        ``status`` (int64 [4], zero, on the device) is given to ops with run-time indices:
        the kernel must check every index before any read or write and record the first
        violation as ``[1, value, lo, hi]`` (valid range ``[lo, hi)``).
        """
        raise NotImplementedError(f"{type(self).__name__} does not support {node.op}")

    def bind_library_task(self, node, graph, args: list[torch.Tensor], out: torch.Tensor,
                          status: torch.Tensor | None, num_workers: int) -> list | None:
        """The task form of ``node`` for the persistent kernel (``runtime.task_graph``): a
        list of ``runtime.task_graph.TaskOp`` stages, each depending on the one before (e.g.
        attention = append to the KV cache, partial softmax per KV split, combine), with
        their work cut for ``num_workers`` workers; or None when this backend runs the op
        only as a launch (``bind_library_op``). Arguments as for ``bind_library_op``. The
        default: None (backends without a task scheduler)."""
        return None

    def bind_customized_group(self, nodes, graph, args: list[torch.Tensor],
                              outs: list[torch.Tensor]) -> Thunk | None:
        """One thunk computing every output of one threadblock graph: ``nodes`` are its
        ``customized`` ops in output order (all supported, sharing ``args``), ``outs`` their
        buffers. None (the default) binds each node alone with ``bind_library_op``, which
        recomputes the ops the outputs share once per output."""
        return None

    def bind_library_op_epilogue(self, node, graph, args: list[torch.Tensor], out: torch.Tensor, kernel,
                                 kernel_args: list[torch.Tensor]) -> Thunk | None:
        """One thunk computing library op ``node`` into ``out`` *and* the fused row kernel after
        it (``kernel``, this backend's compiled ``Kernel`` of a row program over the rows of
        ``out``, bound to ``kernel_args``: its inputs, ``out`` among them, then its outputs),
        the row program run on each block of rows as soon as the op has finished them
        (epilogue fusion: the residual + LayerNorm or the GELU after a GEMM, while the rows are
        in cache). None (the default) binds the two apart. Only asked for ops without a
        status slot."""
        return None

    def merge_convs(self, case) -> bool:
        """Should the parallel convolutions ``case`` (transforms.parallel.ConvGroup: k conv2d of
        one input and one geometry) run as one ``conv2d_stack``? The default, False, keeps them
        apart; a backend answers by measurement once it has a kernel worth it."""
        return False

    def merge_linears(self, case) -> bool:
        """Should the parallel linear layers ``case`` (transforms.parallel.LinearGroup: k linears
        of one input, M rows, N out features each) run as one stacked GEMM? The default, False,
        keeps them apart; a backend answers by measurement once it has a kernel worth it."""
        return False

    def linear_weight_layout(self, data: torch.Tensor, dtype: DType, compute_dtype: str | None,
                             embedding: bool = False) -> tuple[torch.Tensor, DType]:
        """The storage and dtype in which a model keeps a ``linear`` weight (``data``: storage of
        ``dtype``, [N, ...]) whose decode steps compute with ``compute_dtype`` (the activation
        dtype's name, or 'int8' for int8-quantized activations); ``embedding``: the ``embedding``
        op reads it too (a tied LM head's table). A backend may return the same values in a layout
        of its kernels (a new tensor; the caller drops the old one). The default keeps
        ``(data, dtype)``."""
        return data, dtype

    def declare_constant(self, tensors: list[torch.Tensor]) -> None:
        """Declare ``tensors`` (a model's parameters and buffers, on ``torch_device``) constant
        weights: kernels may then keep them in their own layout (a packed copy, made once and
        remade when a tensor's version or storage changes, so writes stay visible). The
        default does nothing (kernels read the tensors as they are)."""

    def capture(self, run: Thunk) -> Thunk:
        """A thunk that replays the device work of ``run`` (a plan's launches) with less
        launch overhead; the default returns ``run`` itself.

        ``run`` must read every changing value (token ids, positions) from device tensors that
        the caller updates in place between calls.
        """
        return run

    def default_dtype(self) -> DType:
        """The activation dtype LLMs use here when the user names none: float32 by default."""
        return DType.float32

    # ---- device memory (the executor's buffers and the data that crosses) -------------------
    # A backend whose memory torch owns (every one but webgpu) keeps these defaults: buffers are
    # torch tensors on ``torch_device`` and inputs and outputs are used as they are. A backend
    # with memory of its own (backends/webgpu/backend.py: wgpu buffers) returns its own tensor type
    # from ``alloc``, which has the part of torch's tensor interface the plan uses (``view``,
    # ``reshape``, ``[i]`` and ``[a:b]`` on the first dim, ``numel``, ``dtype``, ``zero_``), and
    # moves data across in ``stage_inputs`` / ``fetch``.
    def auto_eligible(self) -> bool:
        """May 'auto' pick this backend when it is available? True by default (webgpu: only on
        a real GPU adapter, never a software one)."""
        return True

    def alloc(self, numel: int, dtype: torch.dtype):
        """A new flat buffer of ``numel`` elements of ``dtype`` for a plan (contents undefined).
        The default: ``torch.empty`` on ``torch_device``."""
        return torch.empty(numel, dtype=dtype, device=self.torch_device)

    def stage_inputs(self, inputs: list[torch.Tensor], written: set[int]) -> tuple[list, Thunk | None, Thunk | None]:
        """A plan's inputs as its kernels see them, and two thunks run around each of its runs
        (None: nothing to do): ``before`` brings the callers' current values in, ``after``
        writes back the inputs at positions ``written`` (the ones the graph updates in place,
        such as a KV cache). The default: the tensors themselves, no thunks."""
        return list(inputs), None, None

    def fetch(self, tensors: list) -> list[torch.Tensor]:
        """A plan's outputs (or its status record) as torch tensors the caller may read: the
        buffers themselves by default (owned by the plan: callers copy what they keep)."""
        return list(tensors)

    def bind_reference(self, node, args: list, out) -> Thunk:
        """A thunk computing an op this backend has no kernel for as its torch reference into
        ``out`` (``OPS[node.op].reference``). The default runs it on ``torch_device``."""
        from yirage.ir.ops import OPS

        ref = OPS[node.op].reference
        return lambda: out.copy_(ref(args, node.attrs))

    def bind_expand(self, x, shape: tuple[int, ...]):
        """(a buffer of ``shape``, a thunk filling it with ``x`` broadcast to ``shape``): a
        fused kernel's broadcast input that its row view cannot index."""
        full = torch.empty(shape, dtype=x.dtype, device=self.torch_device)
        return full, (lambda: full.copy_(x.expand(full.shape)))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name.value!r}, codegen={self.codegen!r})"
