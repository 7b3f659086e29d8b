"""The WebGPU backend: yirage's kernels in WGSL, on any adapter ``wgpu`` finds (Metal on Apple
silicon, Vulkan on AMD, Intel, NVIDIA and Android, Direct3D 12; Mesa's lavapipe on a machine
with no GPU).

Unlike every other backend, torch does not own this device's memory. A plan's buffers are
``runtime.webgpu.DeviceTensor``s that this backend allocates (``alloc``); a graph's inputs and
outputs cross as torch CPU tensors (``stage_inputs`` uploads the callers' tensors before each
run and writes back the ones the graph updates in place; ``fetch`` downloads outputs);
weights declared constant (``declare_constant``) are uploaded once and stay resident,
uploaded again only when written (their version or storage changes); intermediates never
leave the device.

Fused row kernels compile to WGSL (codegen/wgsl.py, runtime/wgsl_kernels.py); float32 GEMMs and
GEMVs (``linear``, ``matmul``) are WGSL library kernels (kernels/webgpu, backends/webgpu/library.py).
A library op without a WGSL kernel here runs as its torch reference on the host (its inputs downloaded, its
output uploaded: correct, slow, logged once per op as on every backend), as does a fused kernel
of a dtype WGSL cannot hold.

Available where wgpu is installed (``pip install 'yirage[webgpu]'``) and finds an adapter. 'auto'
picks it only on a real GPU adapter (discrete or integrated), never a software one (lavapipe
reports adapter type CPU). It must never touch a device before ``unavailable_reason`` is asked.
"""
from __future__ import annotations

import functools
import math
import threading
import weakref

import torch

from yirage.backends.base import Backend, BackendImpl, BackendInfo, MemoryInfo, Thunk
from yirage.codegen.eager import EagerKernel
from yirage.config import logger
from yirage.errors import BackendUnavailableError


def _rt():
    from yirage.runtime import webgpu
    return webgpu


class _HostKernel:
    """A fused kernel WGSL cannot express (a dtype it does not hold): run as torch ops on the host,
    its inputs downloaded and its outputs uploaded."""

    def __init__(self, kernel, why: str):
        self.kernel, self.eager = kernel, EagerKernel(kernel)
        logger.debug("webgpu: a fused kernel runs on the host as torch ops (%s)", why)

    def bind(self, tensors, rows: int) -> Thunk:
        n_in = len(self.kernel.inputs)

        def run():
            host = [t.to_host() for t in tensors]
            self.eager._run(host[:n_in], host[n_in:], rows)
            for dev, h in zip(tensors[n_in:], host[n_in:]):
                dev.upload(h)
        return run


@functools.lru_cache(maxsize=1)
def _library_kernels() -> dict[str, list[tuple]]:
    """{op: [(supports, bind), ...]}: the WGSL library kernels, tried in order:
    float32 ``linear``/``matmul`` (library: tiled GEMM, GEMV) and the GGUF block-quantized
    ``linear`` (quant: q4_0, q4_1, q8_0, q4_K, q5_K, q6_K dequantized in registers), and
    the conv nets' ops (conv: conv2d as an implicit GEMM with its epilogue, conv2d_stack,
    max/avg/adaptive pooling, batch_norm), the LLM ops (ops: embedding, RoPE, attention over
    the KV cache with GQA and sliding windows, the continuous-batching rows forms, argmax; every
    run-time index checked into the status record), the encoders' attention (encoder:
    attention_varlen over packed sentences, attention_bidir, sdpa) and linear_stack, the layout
    ops (layout: permute, expand, slice, select, cat, pad, index_select, gather as one strided
    copy, cumsum, and reductions over a dim that is not the last), and
    threadblock graphs (``customized``:
    threadblock, a workgroup per block, ``var<workgroup>`` shared memory)."""
    from . import conv, encoder, layout, library as lib, ops, qembed, quant, threadblock as tb

    kernels = {"linear": [(lib.supports_linear, lib.bind_linear),
                          (quant.supports_quantized_linear, quant.bind_quantized_linear)],
               "matmul": [(lib.supports_matmul, lib.bind_matmul)]}
    for op, pair in conv.OPS.items():   # conv2d (implicit GEMM), conv2d_stack, pooling, batch_norm
        kernels.setdefault(op, []).append(pair)
    for op, pair in ops.OPS.items():   # embedding, rope, rope_rows, rotary_emb, attention(_rows), argmax
        kernels.setdefault(op, []).append(pair)
    for op, pair in qembed.OPS.items():   # embedding over a q4_0/q4_1/q8_0/q4_K/q5_K/q6_K table
        kernels.setdefault(op, []).append(pair)
    for op, pair in encoder.OPS.items():   # attention_varlen, attention_bidir, sdpa, linear_stack
        kernels.setdefault(op, []).append(pair)
    for op, pair in layout.OPS.items():   # strided copies, index_select/gather, cumsum, reductions over a dim
        kernels.setdefault(op, []).append(pair)
    kernels["customized"] = [(tb.customized_ok, tb.bind_customized)]   # threadblock graphs
    return kernels


class WebGPUBackend(BackendImpl):
    """WebGPU adapters through wgpu (torch device type 'cpu': data crosses as CPU tensors)."""

    name = Backend.WEBGPU
    codegen = "wgsl"
    device_type = "cpu"

    def __init__(self):
        self._reason: str | None = None
        self._checked = False
        self._resident: dict[int, tuple] = {}   # id(weight) -> (stamp, DeviceTensor)
        self._lock = threading.Lock()

    # ---- availability and description ----------------------------------------------------
    def unavailable_reason(self) -> str | None:
        if not self._checked:
            try:
                _rt().adapter()
            except BackendUnavailableError as e:
                self._reason = str(e)
            self._checked = True
        return self._reason

    def auto_eligible(self) -> bool:
        """Only a hardware adapter (never a software one such as lavapipe, adapter type CPU);
        where no GPU device node exists (``runtime.webgpu.hardware_adapter_possible``) without
        probing the adapter at all."""
        return (_rt().hardware_adapter_possible() and self.is_available()
                and _rt().adapter_record()["adapter_type"] not in ("CPU", "cpu"))

    def versions(self) -> dict[str, str]:
        versions = super().versions()
        try:
            import wgpu
            versions["wgpu"] = wgpu.__version__
        except ImportError:
            pass
        return versions

    def _device_info(self) -> BackendInfo:
        rec = _rt().adapter_record()
        return BackendInfo(name=self.name, available=True, device_name=rec["device"],
                           memory_total_bytes=self._device_memory_info().total_bytes, compute_capability=f"{rec['backend_type']}, {rec['adapter_type']} adapter", versions={**self.versions(), "driver": rec["description"] or ""},
                           details={"backend_type": rec["backend_type"], "adapter_type": rec["adapter_type"],
                                    "vendor": rec["vendor"], "limits": rec["limits"], "features": rec["features"],
                                    "auto": "picked by 'auto'" if self.auto_eligible()
                                    else "not picked by 'auto' (a software adapter)"})

    def _device_memory_info(self) -> MemoryInfo:
        """WebGPU does not report device memory. A CPU or integrated adapter shares the host's
        memory (reported as the host's); for a discrete one ``total_bytes`` is the largest
        buffer it allows (max-buffer-size, a lower bound), free and used unknown (None)."""
        from yirage.backends.cpu import system_memory

        if _rt().adapter_record()["adapter_type"] in ("CPU", "IntegratedGPU"):
            return system_memory()
        return MemoryInfo(_rt().limit("max-buffer-size"), None, None)

    def _device_synchronize(self) -> None:
        _rt().queue().wait()

    # ---- kernels --------------------------------------------------------------------------
    def _kernel_for(self, node, graph):
        """The WGSL library kernel's binder for ``node``, or None (the op then runs as its torch
        reference on the host). The first of the op's kernels whose ``supports`` holds."""
        for supports, bind in _library_kernels().get(node.op, ()):
            if supports(node, graph):
                return bind
        return None

    def supports(self, node, graph) -> bool:
        """The library ops with a WGSL kernel for ``node``'s dtypes and attributes
        (``_library_kernels``); every other one runs as its torch reference on the host
        (``bind_reference``)."""
        return self._kernel_for(node, graph) is not None

    def bind_library_op(self, node, graph, args, out, status=None) -> Thunk:
        return self._kernel_for(node, graph)(node, graph, args, out, status)

    def bind_customized_group(self, nodes, graph, args, outs):
        """All outputs of one threadblock graph as one WGSL kernel (threadblock.py), or
        None when they do not fit one."""
        from . import ops, threadblock as tb

        return tb.bind_customized_group(nodes, graph, args, outs)

    def compile(self, kernels: list) -> list:
        from yirage.runtime.wgsl_kernels import WGSLKernel

        out = []
        for k in kernels:
            try:
                out.append(WGSLKernel(k))
            except NotImplementedError as e:
                out.append(_HostKernel(k, str(e)))
        return out

    def bind_reference(self, node, args: list, out) -> Thunk:
        from yirage.ir.ops import OPS

        op = OPS[node.op]
        DeviceTensor = _rt().DeviceTensor

        def run():
            host = [a.to_host() if isinstance(a, DeviceTensor) else a for a in args]
            out.upload(op.reference(host, node.attrs).to(out.dtype).contiguous())
            for m in op.mutates:   # an op updating an input in place (a KV cache): write it back
                if isinstance(args[m], DeviceTensor):
                    args[m].upload(host[m])
        return run

    def bind_expand(self, x, shape: tuple[int, ...]):
        full = _rt().DeviceTensor.empty(shape, x.dtype)
        return full, (lambda: full.upload(x.to_host().expand(shape).contiguous()))

    # ---- memory ----------------------------------------------------------------------------
    def alloc(self, numel: int, dtype: torch.dtype):
        return _rt().DeviceTensor.empty((numel,), dtype)

    def declare_constant(self, tensors: list[torch.Tensor]) -> None:
        """Keep ``tensors`` (CPU) resident on the device: uploaded on first use, again only when
        written (version or storage changed)."""
        with self._lock:
            for t in tensors:
                if id(t) not in self._resident:
                    self._resident[id(t)] = (None, None)
                    weakref.finalize(t, self._resident.pop, id(t), None)

    def _stamp(self, x: torch.Tensor) -> tuple:
        # the device too: after a device loss, resident weights are uploaded to the new one
        return x.data_ptr(), x._version, tuple(x.shape), x.dtype, _rt().device_generation()

    def _device_copy(self, x: torch.Tensor):
        """The resident copy of constant weight ``x`` (uploaded now if missing or stale), or None
        when ``x`` was not declared constant."""
        with self._lock:
            held = self._resident.get(id(x))
            if held is None:
                return None
            stamp, dev = held
            if stamp != self._stamp(x):
                dev = _rt().DeviceTensor.from_host(x.contiguous())
                self._resident[id(x)] = (self._stamp(x), dev)
            return dev

    def _refresh(self, x: torch.Tensor, dev) -> None:
        """Upload constant ``x`` into its resident copy ``dev`` again if it was written since."""
        with self._lock:
            held = self._resident.get(id(x))
            if held is not None and held[0] != self._stamp(x):
                dev.upload(x.contiguous())
                self._resident[id(x)] = (self._stamp(x), dev)

    def stage_inputs(self, inputs, written):
        DeviceTensor = _rt().DeviceTensor
        staged, moving = [], []
        for i, x in enumerate(inputs):
            if isinstance(x, DeviceTensor):
                staged.append(x)
                continue
            resident = None if i in written else self._device_copy(x)
            if resident is not None:
                staged.append(resident)
                moving.append((x, resident, True))
            else:
                dev = DeviceTensor.empty(tuple(x.shape), x.dtype)
                staged.append(dev)
                moving.append((x, dev, False))

        def before():
            for x, dev, constant in moving:
                if constant:
                    self._refresh(x, dev)
                elif x.numel():
                    dev.upload(x.contiguous())

        back = [(inputs[i], staged[i]) for i in sorted(written) if not isinstance(inputs[i], DeviceTensor)]

        def after():
            for x, dev in back:
                x.copy_(dev.to_host().view(x.shape))
        return staged, (before if moving else None), (after if back else None)

    def fetch(self, tensors: list) -> list[torch.Tensor]:
        DeviceTensor = _rt().DeviceTensor
        return [t.to_host() if isinstance(t, DeviceTensor) else t for t in tensors]

    def capture(self, run: Thunk) -> Thunk:
        """The plan's launches as recorded; the queue submits them together at the next read."""
        return run


__all__ = ["WebGPUBackend"]
