"""WebGPU devices through ``wgpu`` (wgpu-native): the adapter, device memory that torch does not
own, compute pipelines and their dispatch.

- ``adapter()`` / ``device()``: the process's one adapter ("high-performance" preference) and
  one device on it, made on first use, with the adapter's own limits asked for (storage
  buffers per stage, buffer and binding sizes, workgroup memory), not WebGPU's defaults, and
  ``shader-f16`` where the adapter has it (``has_f16()``: fused kernels then store float16
  natively); ``YIRAGE_WEBGPU_F16=0``, read when the device is made, leaves it off (the packed
  float16 path everywhere). ``release_device()`` drops the device, so the next call makes a
  new one (reading the variable again).
- ``DeviceTensor``: a contiguous tensor in a ``wgpu`` storage buffer: shape, torch dtype, and an
  element offset into its buffer. It has the little of torch's tensor interface the executor's
  buffer plan uses (``view``/``reshape``, ``[i]`` and ``[a:b]`` on the first dim, ``numel``,
  ``zero_``); data crosses with ``upload`` / ``to_host``.
- ``Pipeline``: a WGSL module compiled once per source (by hash), dispatched with whole buffers
  bound and a uniform block of ``u32`` parameters (element offsets, sizes), so a view at any
  offset binds without WebGPU's offset alignment.
- Launches are recorded into one command encoder and submitted together: ``flush`` submits,
  and every host read or write flushes first, so the queue sees them in program order.

Every dtype is stored as torch lays it out, contiguous, so sub-word dtypes (bool, float16,
bfloat16) share ``u32`` words: kernels read them packed from the words, or float16 as
``array<f16>`` where the device has ``shader-f16`` (element offsets then in 2-byte units). A
buffer's byte size is rounded up to a multiple of 4 (WebGPU's copy granularity).

This module must never import torch's device backends or pick a backend: backends/webgpu/backend.py
does that. It raises ``BackendUnavailableError`` when wgpu or an adapter is missing and
``YirageError`` when a size passes the device's limits (naming the limit).
"""
from __future__ import annotations

import hashlib
import math
import os
import threading
from typing import Sequence

import numpy as np
import torch

from ..errors import BackendUnavailableError, YirageError

#: limits asked of the device, up to what the adapter has
_LIMITS = ("max-storage-buffers-per-shader-stage", "max-storage-buffer-binding-size", "max-buffer-size",
           "max-compute-workgroup-storage-size", "max-compute-invocations-per-workgroup",
           "max-compute-workgroup-size-x", "max-compute-workgroups-per-dimension", "max-bind-groups",
           "max-uniform-buffers-per-shader-stage")
#: optional features used where the adapter has them
_FEATURES = ("shader-f16", "timestamp-query")
#: ``YIRAGE_WEBGPU_F16=0`` (read when the device is made): never ask for ``shader-f16``
F16_ENV = "YIRAGE_WEBGPU_F16"

_lock = threading.RLock()
_state: dict = {}


def wgpu_module():
    """The ``wgpu`` package. Raises BackendUnavailableError when it is not installed."""
    try:
        import wgpu
    except ImportError as e:
        raise BackendUnavailableError(f"the wgpu package is not installed ({e}); pip install 'yirage[webgpu]'") from None
    return wgpu


def hardware_adapter_possible() -> bool:
    """Whether a hardware (GPU) WebGPU adapter could exist here, answered without loading wgpu
    or a driver: on Linux, only where a GPU device node is (``/dev/dri/renderD*`` for Mesa's
    AMD and Intel drivers, ``/dev/nvidia<N>`` for NVIDIA's, ``/dev/dxg`` for WSL's); elsewhere
    (macOS: Metal, Windows: D3D12) always. 'auto' asks this before probing the adapter, which
    costs ~0.8 s (wgpu, Triton and the driver loaded) and on a machine without those nodes can
    only find a software adapter, which 'auto' never picks."""
    import glob
    import sys

    if not sys.platform.startswith("linux"):
        return True
    return bool(glob.glob("/dev/dri/renderD*") or glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/dxg"))


def _load_triton_first() -> None:
    """Import Triton (where installed) before the adapter loads its driver. Mesa's lavapipe
    links LLVM 15; Triton's libtriton carries an LLVM of its own and crashes the process when
    it is loaded after lavapipe (seen with Triton 3.x), while the other order works."""
    import importlib.util

    if importlib.util.find_spec("triton") is not None:
        try:
            import triton  # noqa: F401
        except Exception:  # noqa: BLE001 - a broken Triton is the Triton backends' concern
            pass


def adapter():
    """The process's WebGPU adapter (``request_adapter_sync``, high-performance preference).

    Raises BackendUnavailableError when wgpu is missing or finds no adapter (no Vulkan, Metal or
    D3D12 driver: on Linux without a GPU, Mesa's lavapipe, Debian's ``mesa-vulkan-drivers``)."""
    with _lock:
        if "adapter" not in _state:
            wgpu = wgpu_module()
            os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")   # Mesa's Vulkan loader warns without it
            _load_triton_first()
            try:
                found = wgpu.gpu.request_adapter_sync(power_preference="high-performance")
            except Exception as e:  # noqa: BLE001 - wgpu-native reports a missing driver many ways
                found, why = None, f"{type(e).__name__}: {e}"
            else:
                why = "request_adapter_sync returned none"
            if found is None:
                raise BackendUnavailableError(f"no WebGPU adapter ({why}); install a Vulkan driver "
                                              "(Linux without a GPU: Debian's mesa-vulkan-drivers)")
            _state["adapter"] = found
        return _state["adapter"]


def adapter_record() -> dict:
    """The adapter as ``yirage info`` shows it: name, vendor, backend type (Vulkan, Metal,
    D3D12), adapter type (DiscreteGPU, IntegratedGPU, CPU, ...), driver, its limits and
    features."""
    a = adapter()
    info = dict(a.info)
    return {"device": info.get("device"), "vendor": info.get("vendor"), "description": info.get("description"),
            "backend_type": info.get("backend_type"), "adapter_type": info.get("adapter_type"),
            "limits": {k: a.limits[k] for k in _LIMITS if k in a.limits},
            "features": sorted(a.features)}


def f16_wanted() -> bool:
    """Whether ``device()`` asks for ``shader-f16`` (where the adapter has it): not when
    ``YIRAGE_WEBGPU_F16`` is 0 / false / off / no."""
    return os.environ.get(F16_ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def device():
    """The process's WebGPU device on ``adapter()``, with the adapter's limits and the optional
    features it has (``shader-f16`` unless ``YIRAGE_WEBGPU_F16=0``). A lost device is replaced
    on the next call."""
    with _lock:
        dev = _state.get("device")
        if dev is None:
            a = adapter()
            limits = {k: a.limits[k] for k in _LIMITS if k in a.limits}
            features = [f for f in _FEATURES if f in a.features and (f != "shader-f16" or f16_wanted())]
            dev = _state["device"] = a.request_device_sync(required_features=features, required_limits=limits)
            _state["queue"] = Queue(dev)
            _state["generation"] = _state.get("generation", 0) + 1
        return dev


def release_device() -> None:
    """Drop the process's device: the next ``device()`` makes a new one (reading
    ``YIRAGE_WEBGPU_F16`` again). Tensors, pipelines and plans made on the old one must not be
    used after; caches keyed on ``device_generation()`` make theirs again."""
    with _lock:
        _state.pop("device", None)
        _state.pop("queue", None)


def device_generation() -> int:
    """Which device of this process ``device()`` is: 1 for the first, one more after each loss
    (what caches of device objects key on; an ``id()`` could be reused by a later device)."""
    device()
    return _state["generation"]


def queue() -> "Queue":
    """The device's command recorder (``Queue``)."""
    device()
    return _state["queue"]


def has_f16() -> bool:
    """Does the device have ``shader-f16`` (float16 arithmetic and storage in WGSL)? False where
    the adapter lacks it or ``YIRAGE_WEBGPU_F16=0`` was set when the device was made."""
    return "shader-f16" in device().features


def limit(name: str) -> int:
    """One of the device's limits (e.g. 'max-storage-buffer-binding-size', bytes)."""
    return int(device().limits[name])


class device_errors:
    """Turns wgpu's errors inside the block into one YirageError that says what happened: a lost
    device (the driver reset or removed it: the process's device is dropped, so the next call
    makes a new one, and plans built on the old one must be built again), memory exhausted, or
    a validation error (a yirage bug: the message is wgpu's)."""

    def __init__(self, what: str):
        self.what = what

    def __enter__(self):
        return self

    def __exit__(self, kind, error, tb):
        if error is None:
            return False
        wgpu = wgpu_module()
        if not isinstance(error, wgpu.GPUError):
            return False
        text = " ".join(str(error).split())
        if "lost" in text.lower():
            release_device()
            raise YirageError(f"webgpu: the device was lost during {self.what} ({text}); build the graph or "
                              "model again to run on a new device") from None
        if isinstance(error, wgpu.GPUOutOfMemoryError):
            raise YirageError(f"webgpu: out of device memory during {self.what} ({text}); use a smaller "
                              "model or batch") from None
        raise YirageError(f"webgpu: {self.what} failed ({type(error).__name__}: {text})") from None


class Queue:
    """Launches recorded into one command encoder, submitted together (``flush``). Host reads
    and writes flush first, so they see (and are seen by) every launch recorded before them."""

    def __init__(self, dev):
        self.dev = dev
        self._encoder = None
        self._sync = None
        self.lock = threading.RLock()

    def dispatch(self, pipeline, bind_group, groups: tuple[int, int, int]) -> None:
        with self.lock, device_errors("recording a launch"):
            if self._encoder is None:
                self._encoder = self.dev.create_command_encoder()
            cp = self._encoder.begin_compute_pass()
            cp.set_pipeline(pipeline)
            cp.set_bind_group(0, bind_group)
            cp.dispatch_workgroups(*groups)
            cp.end()

    def flush(self) -> None:
        with self.lock, device_errors("a submit"):
            if self._encoder is not None:
                enc, self._encoder = self._encoder, None
                self.dev.queue.submit([enc.finish()])

    def wait(self) -> None:
        """Submit what is recorded and wait until the device has run it (a 4-byte read: wgpu
        0.32's on_submitted_work_done_sync fails with this wgpu-native)."""
        with self.lock:
            if self._sync is None:   # on this queue's device (a new device has a new queue)
                self._sync = new_buffer(4, "sync word")
            self.read(self._sync, 0, 4)

    def write(self, buffer, offset: int, data) -> None:
        with self.lock:
            self.flush()
            with device_errors("an upload"):
                self.dev.queue.write_buffer(buffer, offset, data)

    def read(self, buffer, offset: int, size: int) -> memoryview:
        with self.lock:
            self.flush()
            with device_errors("a download"):
                return self.dev.queue.read_buffer(buffer, offset, size)


def _nbytes(numel: int, dtype: torch.dtype) -> int:
    return numel * torch.empty((), dtype=dtype).element_size()


def _word_bytes(n: int) -> int:
    return max(4, -(-n // 4) * 4)


def new_buffer(nbytes: int, what: str = "buffer"):
    """A storage buffer of at least ``nbytes`` (rounded up to 4). Raises YirageError naming the
    device limit when it is larger than ``max-buffer-size`` or ``max-storage-buffer-binding-size``
    (split the tensor, or use another backend)."""
    size = _word_bytes(nbytes)
    cap = min(limit("max-buffer-size"), limit("max-storage-buffer-binding-size"))
    if size > cap:
        raise YirageError(f"webgpu: a {what} of {size} bytes is larger than this adapter's "
                          f"max-storage-buffer-binding-size / max-buffer-size ({cap} bytes); "
                          "use a smaller model or batch, or another backend")
    wgpu = wgpu_module()
    usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
    with device_errors(f"allocating a {what} of {size} bytes"):
        return device().create_buffer(size=size, usage=usage)


class DeviceTensor:
    """A contiguous tensor in a WebGPU storage buffer.

    Args:
        buffer: the ``wgpu`` buffer (``new_buffer``).
        shape: the tensor's shape.
        dtype: its torch dtype (float32, float16, bfloat16, bool, int32, int64, uint8, ...).
        offset: its first element's index in the buffer, in elements of ``dtype``.

    Raises ValueError for a view whose element count differs, or an index outside the first
    dim."""

    def __init__(self, buffer, shape: Sequence[int], dtype: torch.dtype, offset: int = 0):
        self.buffer, self.shape, self.dtype, self.offset = buffer, torch.Size(shape), dtype, int(offset)

    @classmethod
    def empty(cls, shape: Sequence[int], dtype: torch.dtype) -> "DeviceTensor":
        """A new tensor (contents undefined: zeroed by WebGPU)."""
        return cls(new_buffer(_nbytes(math.prod(shape), dtype), "tensor"), shape, dtype)

    @classmethod
    def from_host(cls, x: torch.Tensor) -> "DeviceTensor":
        """A new tensor holding a copy of ``x`` (a CPU tensor)."""
        t = cls.empty(tuple(x.shape), x.dtype)
        t.upload(x)
        return t

    # -- the torch-like surface the executor uses --------------------------------------------
    device = torch.device("cpu")   # what torch sees of it: inputs and outputs cross as CPU tensors

    def numel(self) -> int:
        return math.prod(self.shape)

    def dim(self) -> int:
        return len(self.shape)

    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def is_contiguous(self) -> bool:
        return True

    @property
    def nbytes(self) -> int:
        return self.numel() * self.element_size()

    def view(self, *shape) -> "DeviceTensor":
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)) else shape
        if -1 in shape:
            known = math.prod(s for s in shape if s != -1)
            shape = tuple(self.numel() // max(known, 1) if s == -1 else s for s in shape)
        if math.prod(shape) != self.numel():
            raise ValueError(f"cannot view {tuple(self.shape)} as {shape}: element counts differ")
        return DeviceTensor(self.buffer, shape, self.dtype, self.offset)

    reshape = view

    def __getitem__(self, index) -> "DeviceTensor":
        rows = self.shape[0]
        inner = math.prod(self.shape[1:])
        if isinstance(index, int):
            if not -rows <= index < rows:
                raise ValueError(f"index {index} is outside the first dim of {tuple(self.shape)}")
            index %= rows
            return DeviceTensor(self.buffer, self.shape[1:], self.dtype, self.offset + index * inner)
        if isinstance(index, slice) and index.step in (None, 1):
            start, stop, _ = index.indices(rows)
            return DeviceTensor(self.buffer, (max(stop - start, 0), *self.shape[1:]), self.dtype,
                                self.offset + start * inner)
        raise ValueError(f"a DeviceTensor takes an int or a contiguous slice of its first dim, not {index!r}")

    # -- host <-> device -----------------------------------------------------------------------
    def _byte_range(self) -> tuple[int, int]:
        es = self.element_size()
        return self.offset * es, self.numel() * es

    def upload(self, x: torch.Tensor) -> None:
        """Copy ``x`` (CPU, same element count and dtype) into this tensor."""
        if x.numel() != self.numel() or x.dtype != self.dtype:
            raise ValueError(f"upload: {tuple(x.shape)} {x.dtype} into {tuple(self.shape)} {self.dtype}")
        start, n = self._byte_range()
        data = x.detach().contiguous().view(-1).view(torch.uint8).numpy()
        if start % 4 or n % 4:   # WebGPU writes whole words: merge with the words' other bytes
            lo, hi = start // 4 * 4, _word_bytes(start + n) if (start + n) % 4 else start + n
            words = np.frombuffer(queue().read(self.buffer, lo, hi - lo), dtype=np.uint8).copy()
            words[start - lo:start - lo + n] = data
            queue().write(self.buffer, lo, words)
        else:
            queue().write(self.buffer, start, data)

    def zero_(self) -> "DeviceTensor":
        self.upload(torch.zeros(self.shape, dtype=self.dtype))
        return self

    def to_host(self) -> torch.Tensor:
        """A new CPU tensor with this tensor's values (waits for the launches recorded so far)."""
        start, n = self._byte_range()
        if n == 0:
            return torch.empty(self.shape, dtype=self.dtype)
        lo = start // 4 * 4
        hi = -(-(start + n) // 4) * 4
        raw = np.frombuffer(queue().read(self.buffer, lo, hi - lo), dtype=np.uint8)[start - lo:start - lo + n]
        return torch.from_numpy(raw.copy()).view(self.dtype).reshape(self.shape)

    def __repr__(self) -> str:
        return f"DeviceTensor(shape={tuple(self.shape)}, dtype={self.dtype}, offset={self.offset})"


class Pipeline:
    """A WGSL compute shader, compiled once per source text (by hash) on the device.

    The shader's bindings are ``@group(0) @binding(0) var<uniform> P`` (a struct of ``u32``
    fields, ``n_params`` of them) then one storage buffer per tensor argument, in order.
    ``label`` names the shader module and pipeline in wgpu's messages and is part of the cache
    key (a fused kernel's label says whether its float16 storage is native)."""

    _cache: dict[tuple, object] = {}

    def __init__(self, source: str, entry: str = "main", label: str = ""):
        with _lock:
            dev = device()
            # a new device compiles again
            key = (device_generation(), label, hashlib.sha256(source.encode()).hexdigest())
            compiled = Pipeline._cache.get(key)
            if compiled is None:
                try:
                    module = dev.create_shader_module(label=label, code=source)
                    compiled = dev.create_compute_pipeline(label=label, layout="auto",
                                                           compute={"module": module, "entry_point": entry})
                except Exception as e:  # noqa: BLE001 - wgpu reports WGSL errors as its own types
                    raise YirageError(f"webgpu: a generated shader did not compile ({type(e).__name__}: {e})") from None
                Pipeline._cache[key] = compiled
        self.pipeline, self.label = compiled, label

    def bind(self, tensors: Sequence[DeviceTensor], params: Sequence[int], groups: tuple[int, int, int]):
        """A thunk that records one dispatch of ``groups`` workgroups over ``tensors`` (bound
        whole, in binding order 1..n) with the uniform ``params`` (u32 each) at binding 0."""
        wgpu = wgpu_module()
        dev = device()
        words = np.asarray(list(params) or [0], dtype=np.uint32)
        words = np.concatenate([words, np.zeros(-len(words) % 4, dtype=np.uint32)])   # 16-byte uniform rows
        if np.any(np.asarray(list(params) or [0], dtype=np.int64) >= 2 ** 32):
            raise YirageError("webgpu: a size or offset passes 2^32 elements")
        ubuf = dev.create_buffer_with_data(data=words.tobytes(), usage=wgpu.BufferUsage.UNIFORM)
        layout = self.pipeline.get_bind_group_layout(0)
        entries = [{"binding": 0, "resource": {"buffer": ubuf, "offset": 0, "size": ubuf.size}}]
        entries += [{"binding": i + 1, "resource": {"buffer": t.buffer, "offset": 0, "size": t.buffer.size}}
                    for i, t in enumerate(tensors)]
        group = dev.create_bind_group(layout=layout, entries=entries)
        q, pipeline = queue(), self.pipeline
        keep = (ubuf, tensors)   # the buffers live as long as the thunk

        def run():
            _ = keep
            q.dispatch(pipeline, group, groups)
        return run


def grid(n_groups: int) -> tuple[int, int, int]:
    """``n_groups`` workgroups as an (x, y, 1) grid within max-compute-workgroups-per-dimension
    (the shader computes its index as ``x + y * X``; the extra groups of the last row return)."""
    cap = limit("max-compute-workgroups-per-dimension")
    if n_groups <= cap:
        return max(n_groups, 1), 1, 1
    y = -(-n_groups // cap)
    if y > cap:
        raise YirageError(f"webgpu: {n_groups} workgroups pass this adapter's grid ({cap} x {cap})")
    return cap, y, 1


__all__ = ["device_errors", "device_generation", "adapter", "adapter_record", "device", "queue", "has_f16", "f16_wanted",
           "release_device", "F16_ENV", "limit", "DeviceTensor", "Pipeline",
           "new_buffer", "grid", "wgpu_module"]
