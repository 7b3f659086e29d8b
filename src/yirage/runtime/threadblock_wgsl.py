"""Threadblock graphs as WebGPU kernels: outputs of a block graph rendered as WGSL
(codegen/threadblock_wgsl.py), compiled through ``runtime.webgpu.Pipeline`` (once per shader
text and device) and bound to device tensors.

``bind_threadblock_wgsl(tb, k, inputs, outs)`` returns a zero-argument thunk recording one
dispatch of ``tb.grid_dim`` workgroups; it never allocates the tensors it is bound to. The
rendered source is remembered per block graph (rendering costs about a millisecond; a graph
called again and again binds a new plan per call).

This module must never import a backend.
"""
from __future__ import annotations

import math
import weakref
from typing import Callable, Sequence

import torch

from ..codegen.threadblock_wgsl import bound_inputs, render_threadblock_wgsl, unsupported_reason
from ..errors import YirageError
from . import webgpu as wg

Thunk = Callable[[], None]

# per block graph: {(outputs, input access, op count, output count): WGSL source}
_SOURCES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _ks(k) -> tuple[int, ...]:
    return tuple(k) if isinstance(k, (tuple, list)) else (k,)


def threadblock_source(tb, k, in_access: str = "read") -> str:
    """The WGSL of output(s) ``k`` of ``tb`` (remembered per block graph, its op and output
    counts, should it grow). NotImplementedError for what codegen cannot render."""
    key = (_ks(k), in_access, len(tb.ops), len(tb.outputs))
    cache = _SOURCES.setdefault(tb, {})
    if key not in cache:
        cache[key] = render_threadblock_wgsl(tb, _ks(k), in_access=in_access)
    return cache[key]


def device_reason(tb, k) -> str | None:
    """Why output(s) ``k`` of ``tb`` cannot run on this device (None when they can): what
    codegen cannot render within WebGPU's guaranteed limits, or more storage buffers than the
    device has."""
    why = unsupported_reason(tb, k, max_storage_buffers=wg.limit("max-storage-buffers-per-shader-stage"))
    if why is None and max(tb.grid_dim) > wg.limit("max-compute-workgroups-per-dimension"):
        why = f"grid {tb.grid_dim} passes this adapter's max-compute-workgroups-per-dimension"
    return why


def bind_threadblock_wgsl(tb, k, inputs: Sequence[wg.DeviceTensor], outs) -> Thunk:
    """A thunk recording the kernel of output ``k`` of ``tb`` (or of every output of the tuple
    ``k``) over ``inputs`` (one float32 DeviceTensor per ``new_input``, in order) into
    ``outs`` (a DeviceTensor, or a list of them in ``k``'s order).

    When an output lies in an input's buffer, the inputs are bound writable (WebGPU refuses a
    buffer bound read-only and writable in one dispatch). Raises YirageError for tensors that
    are not float32 DeviceTensors of the block graph's shapes, an output overlapping an input's
    elements, or a block graph this device cannot run (``device_reason``).
    """
    ks = _ks(k)
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    if len(inputs) != len(tb.inputs) or len(outs) != len(ks):
        raise YirageError(f"webgpu threadblock: {len(tb.inputs)} inputs and {len(ks)} outputs expected, got "
                          f"{len(inputs)} and {len(outs)}")
    why = device_reason(tb, ks)
    if why is not None:
        raise YirageError(f"webgpu threadblock: cannot run this block graph ({why})")
    want = [inp.dshape for inp in tb.inputs] + [tb.outputs[j].dshape for j in ks]
    for t, shape in zip([*inputs, *outs], want):
        if not isinstance(t, wg.DeviceTensor) or t.dtype != torch.float32 or t.numel() != math.prod(shape):
            raise YirageError(f"webgpu threadblock: expected a float32 DeviceTensor of shape {shape}, got {t!r}")
    used = [inputs[n] for n in bound_inputs(tb, ks)]
    aliased = False
    for o in outs:
        for t in used:
            if t.buffer is o.buffer:
                aliased = True
                if t.numel() and o.numel() and t.offset < o.offset + o.numel() and o.offset < t.offset + t.numel():
                    raise YirageError(f"webgpu threadblock: an output (elements {o.offset}..{o.offset + o.numel()}) "
                                      f"overlaps an input (elements {t.offset}..{t.offset + t.numel()}) in one "
                                      "buffer; a block graph cannot run in place")
    source = threadblock_source(tb, ks, "read_write" if aliased else "read")
    pipeline = wg.Pipeline(source)
    params = [t.offset for t in used] + [o.offset for o in outs]
    return pipeline.bind(used + outs, params, tuple(tb.grid_dim))


__all__ = ["bind_threadblock_wgsl", "threadblock_source", "device_reason"]
