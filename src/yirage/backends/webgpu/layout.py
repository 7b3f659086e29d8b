"""WebGPU kernels for the IR's layout and indexing ops and for reductions over a dim that is not
the last: ``permute``, ``expand``, ``slice``, ``select``, ``cat``, ``pad``, ``index_select``,
``gather``, ``cumsum``, and the library forms (not fusable: not over the trailing dims) of
``sum``, ``mean``, ``amax``, ``amin``, ``var``, ``reduction``, ``softmax`` and ``log_softmax``.

``OPS`` maps each op to ``(supports, bind)`` with the contract of ``backends/webgpu/ops.py``
(``BackendImpl.bind_library_op``): ``supports(node, graph) -> bool`` never raises for a node
of its op; ``bind(node, graph, args, out, status) -> thunk`` records the launches.

The kernels (``kernels/webgpu``):

- ``strided_copy.wgsl``: one thread per element of a logical index space of up to
  ``MAX_DIMS`` dims, each mapped to an input and an output element through per-dim strides
  (in the uniform parameters): permute (permuted strides), expand (stride 0), slice (start
  offset, step-scaled stride), select (offset, the dim dropped), cat (one dispatch per input
  into its part of the output: output strides), pad (per-dim lower pads and bounds: outside,
  the pad value), index_select and gather (one dim's coordinate read from the int64 index;
  ids out of range are checked first by ``index_check.wgsl`` into the op's status slot, as
  ``ops.check_indices`` does, and never read through). Elements move as raw bits, 8, 16, 32 or
  64 wide, so every dtype of these ops is covered (float32, float16, bfloat16, bool, int32,
  int64, int8); sub-word elements are written with atomicAnd / atomicOr on their own bits
  (``strided_copy_bits.wgsl`` in front of the walk). Where the device has ``shader-f16``,
  float16 moves as ``array<f16>`` instead (``strided_copy_f16.wgsl``: plain stores, no atomics;
  the pipeline's label, ``strided_copy_f16``, says so).
- ``cumsum.wgsl``: one thread per line along the dim (float32 accumulation for float dtypes,
  written in x's dtype; int64 for bool, int32, int64).
- ``reduce_dim.wgsl``: one thread per column of x viewed as [outer, n, inner]: sum, mean,
  amax/amin (NaN wins, tested on its bits), var (two passes, ``correction``), softmax and
  log_softmax; float32 arithmetic, float32 / float16 / bfloat16 storage.

Buffers are bound whole (``runtime.webgpu``); shaders add the element offsets. When the output
lies in an input's buffer the inputs are bound writable too (``{{IN_ACCESS}}``); an output
overlapping an input's elements is refused (YirageError).

This module may import the runtime, ir, dtypes and errors layers and its sibling kernel modules
(library.py's sources, ops.py's helpers); it never imports the front end or another backend,
and never falls back to the host itself: a node it cannot run, ``supports`` refuses.
"""
from __future__ import annotations

import math
import struct
from typing import Callable, Sequence

import torch

from ...dtypes import DType
from ...errors import YirageError
from ...runtime import webgpu as wg
from .library import render
from .ops import _access, _groups, _pipeline, _seq, _status_slot, check_indices

Thunk = Callable[[], None]

#: the most dims ``strided_copy.wgsl`` walks
MAX_DIMS = 6
_NONE = 0xFFFFFFFF
_NT = 256

#: element width in bits of the dtypes the copies move
_BITS = {DType.float32: 32, DType.int32: 32, DType.float16: 16, DType.bfloat16: 16, DType.bool: 8,
         DType.int8: 8, DType.int64: 64}
_TORCH_BITS = {torch.float32: 32, torch.int32: 32, torch.float16: 16, torch.bfloat16: 16, torch.bool: 8,
               torch.int8: 8, torch.uint8: 8, torch.int64: 64}
#: cumsum.wgsl's KIND by input dtype
_CUMSUM_KIND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.bool: 3, torch.int32: 4, torch.int64: 5}
#: reduce_dim.wgsl's KIND and OP
_FLOAT_KIND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_REDUCE_OP = {"sum": 0, "reduction": 0, "mean": 1, "amax": 2, "amin": 3, "var": 4, "softmax": 5, "log_softmax": 6}


# ---- helpers ----------------------------------------------------------------------------------
def _types(node, graph):
    return [graph.tensors[i] for i in node.inputs]


def _out_type(node, graph):
    return graph.tensors[node.output]


def _strides(shape: Sequence[int]) -> list[int]:
    out, acc = [0] * len(shape), 1
    for i in range(len(shape) - 1, -1, -1):
        out[i] = acc
        acc *= shape[i]
    return out


def _bits(t: wg.DeviceTensor, what: str) -> int:
    bits = _TORCH_BITS.get(t.dtype)
    if bits is None:
        raise YirageError(f"webgpu {what}: no copy kernel for {t.dtype}")
    return bits


def _u32(v: int, what: str) -> int:
    if not 0 <= v < 2 ** 32:
        raise YirageError(f"webgpu {what}: a size or offset ({v}) is outside 0..2^32")
    return v


def _value_bits(value, dtype: torch.dtype) -> tuple[int, int]:
    """The raw bits of ``value`` converted to ``dtype`` as (low word, high word)."""
    t = torch.tensor([value], dtype=torch.float64).to(dtype)
    raw = bytes(t.view(torch.uint8).numpy().tobytes()) + bytes(8)
    return struct.unpack("<II", raw[:8])


def _copy(what: str, x: wg.DeviceTensor, out: wg.DeviceTensor, sizes: Sequence[int], in_strides: Sequence[int],
          out_strides: Sequence[int], in_off: int, out_off: int, *, lo: Sequence[int] | None = None,
          in_size: Sequence[int] | None = None, pad: tuple[int, int] | None = None,
          index: wg.DeviceTensor | None = None, gather_dim: int = _NONE, idx_strides: Sequence[int] | None = None,
          bound: int = 0) -> Thunk | None:
    """A thunk recording one ``strided_copy.wgsl`` dispatch (None for an empty index space).
    Offsets and strides are in elements; ``index`` int64."""
    n = math.prod(sizes)
    if n == 0:
        return None
    nd = len(sizes)
    if nd > MAX_DIMS:
        raise YirageError(f"webgpu {what}: {nd} dims, more than the {MAX_DIMS} the copy kernel walks")
    bits = _bits(x, what)
    if _bits(out, what) != bits:
        raise YirageError(f"webgpu {what}: x {x.dtype} and out {out.dtype} differ")

    def pad6(v, fill=0):
        v = list(v) if v is not None else [fill] * nd
        return [_u32(int(a), what) for a in v] + [fill] * (MAX_DIMS - nd)
    params = [n, nd, in_off, out_off, int(pad is not None), *(pad or (0, 0)), gather_dim,
              2 * index.offset if index is not None else 0, bound, 0, 0]
    params += pad6(sizes, 1) + pad6(in_strides) + pad6(out_strides) + pad6(lo) + pad6(in_size, _NONE)
    params += pad6(idx_strides)
    params = [_u32(int(p), what) for p in params]
    reads = [x] + ([index] if index is not None else [])
    access = _access(what, reads, [out])
    return _copy_pipeline(x.dtype, bits, access).bind([x, index if index is not None else x, out], params,
                                                      _groups(n, _NT))


def _copy_pipeline(dtype: torch.dtype, bits: int, access: str) -> wg.Pipeline:
    """``strided_copy.wgsl`` behind its storage: float16 as ``array<f16>`` where the device has
    ``shader-f16``, else raw bits in u32 words (labelled ``strided_copy_f16`` / ``_bits<BITS>``)."""
    if dtype == torch.float16 and wg.has_f16():
        storage, label = render("strided_copy_f16.wgsl", IN_ACCESS=access), "strided_copy_f16"
    else:
        storage, label = render("strided_copy_bits.wgsl", IN_ACCESS=access, BITS=bits), f"strided_copy_bits{bits}"
    return wg.Pipeline(storage + "\n" + render("strided_copy.wgsl"), label=label)


def _check_out(what: str, out: wg.DeviceTensor, shape: Sequence[int], dtype: torch.dtype) -> None:
    if out.numel() != math.prod(shape) or out.dtype != dtype:
        raise YirageError(f"webgpu {what}: out {tuple(out.shape)} {out.dtype} must hold {tuple(shape)} {dtype}")


# ---- permute, expand, slice, select, cat, pad -------------------------------------------------
_LAYOUT = ("permute", "expand", "slice", "select", "cat", "pad")


def supports_layout(node, graph) -> bool:
    """Any dtype of ``_BITS`` (float32, float16, bfloat16, bool, int8, int32, int64), input and
    output of at most ``MAX_DIMS`` dims."""
    if node.op not in _LAYOUT or not node.inputs:
        return False
    ts = _types(node, graph) + [_out_type(node, graph)]
    return all(t.dtype in _BITS and len(t.shape) <= MAX_DIMS for t in ts)


def bind_layout(node, graph, args: list[wg.DeviceTensor], out: wg.DeviceTensor,
                status: wg.DeviceTensor | None = None) -> Thunk:
    """A thunk recording a layout op (``permute``, ``expand``, ``slice``, ``select``, ``cat``,
    ``pad``) as ``strided_copy.wgsl`` dispatches (one per input for ``cat``).

    Args:
        args: the op's inputs (contiguous DeviceTensors of one dtype, shapes as the graph's).
        out: the output, the graph's shape and dtype.
        status: unused (nothing is indexed at run time).

    Raises YirageError for shapes or dtypes that disagree with the node, an output overlapping
    an input, or sizes past 2^32 elements."""
    op, attrs = node.op, node.attrs
    x = args[0]
    xs = tuple(graph.tensors[node.inputs[0]].shape)
    oshape = tuple(_out_type(node, graph).shape)
    _check_out(op, out, oshape, x.dtype)
    for a, tid in zip(args, node.inputs):
        if a.numel() != math.prod(graph.tensors[tid].shape) or a.dtype != x.dtype:
            raise YirageError(f"webgpu {op}: an input {a!r} does not match the graph's {graph.tensors[tid].shape}")
    st = _strides(xs)
    ost = _strides(oshape)
    runs: list = []
    if op == "permute":
        dims = [d % len(xs) for d in attrs["dims"]]
        runs.append(_copy(op, x, out, oshape, [st[d] for d in dims], ost, x.offset, out.offset))
    elif op == "expand":
        lead = len(oshape) - len(xs)
        ins = [0] * lead + [0 if xs[i] == 1 and oshape[i + lead] != 1 else st[i] for i in range(len(xs))]
        runs.append(_copy(op, x, out, oshape, ins, ost, x.offset, out.offset))
    elif op == "slice":
        d = attrs["dim"] % len(xs)
        step = attrs["step"]
        ins = list(st)
        ins[d] = st[d] * step
        runs.append(_copy(op, x, out, oshape, ins, ost, x.offset + attrs["start"] * st[d], out.offset))
    elif op == "select":
        d = attrs["dim"] % len(xs)
        index = attrs["index"] % xs[d]
        ins = st[:d] + st[d + 1:]
        runs.append(_copy(op, x, out, oshape, ins, ost, x.offset + index * st[d], out.offset))
    elif op == "cat":
        d = attrs["dim"] % len(xs)
        at = 0
        for a, tid in zip(args, node.inputs):
            ashape = tuple(graph.tensors[tid].shape)
            runs.append(_copy(op, a, out, ashape, _strides(ashape), ost, a.offset, out.offset + at * ost[d]))
            at += ashape[d]
    elif op == "pad":
        pads = attrs["pads"]
        runs.append(_copy(op, x, out, oshape, st, ost, x.offset, out.offset, lo=[p[0] for p in pads], in_size=xs,
                          pad=_value_bits(attrs["value"], x.dtype)))
    else:
        raise YirageError(f"webgpu layout: no kernel for {op}")
    return _seq(*[r for r in runs if r is not None], provider=f"webgpu-wgsl ({op}, strided copy)")


# ---- index_select, gather -------------------------------------------------------------------------
def supports_indexing(node, graph) -> bool:
    """x of any dtype of ``_BITS`` with at most ``MAX_DIMS`` dims, an int64 index."""
    if node.op not in ("index_select", "gather") or len(node.inputs) != 2:
        return False
    x, index = _types(node, graph)
    return (x.dtype in _BITS and index.dtype == DType.int64 and 1 <= len(x.shape) <= MAX_DIMS
            and len(index.shape) <= MAX_DIMS)


def bind_indexing(node, graph, args: list[wg.DeviceTensor], out: wg.DeviceTensor,
                  status: wg.DeviceTensor | None) -> Thunk:
    """A thunk recording ``index_select`` (``out`` = the slices of x along ``dim`` at a 1-d
    index) or ``gather`` (``out[p]`` = x at p with coordinate ``dim`` replaced by index[p]):
    the index check, then one ``strided_copy.wgsl`` dispatch.

    Args:
        args: [x, index]: x any dtype of ``_BITS``; index int64 (1-d for index_select, x's rank
            for gather).
        out: x's dtype, the graph's output shape.
        status: the op's int64 [4] status slot: the first index outside [0, x.shape[dim]) is
            recorded as [1, index, 0, x.shape[dim]] (the executor raises IndexOutOfRangeError)
            and never read through (its output elements are left as they were). None: a
            private slot (violations skipped, unreported).

    Raises YirageError for shapes or dtypes that disagree, an output overlapping an input, or
    sizes past 2^32 elements."""
    x, index = args
    op = node.op
    xs = tuple(graph.tensors[node.inputs[0]].shape)
    ishape = tuple(graph.tensors[node.inputs[1]].shape)
    oshape = tuple(_out_type(node, graph).shape)
    if index.dtype != torch.int64 or index.numel() != math.prod(ishape) or x.numel() != math.prod(xs):
        raise YirageError(f"webgpu {op}: x {x!r} and index {index!r} must be {xs} and int64 {ishape}")
    _check_out(op, out, oshape, x.dtype)
    d = node.attrs["dim"] % len(xs)
    status = _status_slot(status)
    check = check_indices(index, index.numel(), xs[d], status) if index.numel() else None
    st = _strides(xs)
    if op == "index_select":
        idx_strides = [1 if k == d else 0 for k in range(len(oshape))]
    else:
        idx_strides = _strides(ishape)
    run = _copy(op, x, out, oshape, st, _strides(oshape), x.offset, out.offset, index=index, gather_dim=d,
                idx_strides=idx_strides, bound=min(xs[d], _NONE))
    return _seq(*[t for t in (check, run) if t is not None], provider=f"webgpu-wgsl ({op}, strided copy)")


# ---- cumsum -------------------------------------------------------------------------------------
def supports_cumsum(node, graph) -> bool:
    """float32, float16, bfloat16 (summed in float32), bool, int32 or int64 (summed in int64)."""
    if node.op != "cumsum" or len(node.inputs) != 1:
        return False
    (x,) = _types(node, graph)
    return x.dtype in (DType.float32, DType.float16, DType.bfloat16, DType.bool, DType.int32, DType.int64) \
        and len(x.shape) >= 1


def _outer_n_inner(shape: Sequence[int], d0: int, d1: int) -> tuple[int, int, int]:
    """x [shape] as [outer, n, inner] with dims d0..d1 (inclusive) in the middle."""
    return math.prod(shape[:d0]), math.prod(shape[d0:d1 + 1]), math.prod(shape[d1 + 1:])


def bind_cumsum(node, graph, args: list[wg.DeviceTensor], out: wg.DeviceTensor,
                status: wg.DeviceTensor | None = None) -> Thunk:
    """A thunk recording ``out = torch.cumsum(x, dim)`` (``cumsum.wgsl``): float dtypes into x's
    dtype (float32 accumulation), bool / int32 / int64 into int64. Raises YirageError for
    shapes or dtypes that disagree, an output overlapping x, or sizes past 2^32 elements."""
    (x,) = args
    xs = tuple(graph.tensors[node.inputs[0]].shape)
    kind = _CUMSUM_KIND.get(x.dtype)
    if kind is None:
        raise YirageError(f"webgpu cumsum: no kernel for {x.dtype}")
    _check_out("cumsum", out, xs, x.dtype if kind <= 2 else torch.int64)
    d = node.attrs["dim"] % len(xs)
    outer, n, inner = _outer_n_inner(xs, d, d)
    lines = outer * inner
    if lines * n == 0:
        return _seq(provider="webgpu-wgsl (cumsum, empty)")
    access = _access("cumsum", [x], [out])
    params = [_u32(v, "cumsum") for v in (lines, n, inner, x.offset, out.offset)]
    run = _pipeline("cumsum.wgsl", access, KIND=kind).bind([x, out], params, _groups(lines, _NT))
    return _seq(run, provider="webgpu-wgsl (cumsum)")


# ---- reductions and softmax over any dim ------------------------------------------------------------
def _reduce_dims(node, rank: int) -> tuple[int, int] | None:
    if "dims" in node.attrs:
        dims = sorted(d % rank for d in node.attrs["dims"])
        if not dims or dims != list(range(dims[0], dims[0] + len(dims))):
            return None
        return dims[0], dims[-1]
    d = node.attrs.get("dim")
    if not isinstance(d, int):
        return None
    return d % rank, d % rank


def supports_reduce_dim(node, graph) -> bool:
    """``sum``/``mean``/``amax``/``amin``/``var`` over adjacent dims, ``reduction``,
    ``softmax``/``log_softmax`` over one dim: float32, float16 or bfloat16 x (computed in
    float32)."""
    if node.op not in _REDUCE_OP or len(node.inputs) != 1:
        return False
    (x,) = _types(node, graph)
    if x.dtype not in (DType.float32, DType.float16, DType.bfloat16) or not x.shape:
        return False
    if node.op == "var" and "correction" not in node.attrs:
        return False
    try:
        dims = _reduce_dims(node, len(x.shape))
    except (TypeError, ZeroDivisionError):
        return False
    # a reduction over zero elements (torch: 0, NaN, or an error) stays with the reference
    return dims is not None and (node.op in ("softmax", "log_softmax") or math.prod(x.shape[dims[0]:dims[1] + 1]) > 0)


def bind_reduce_dim(node, graph, args: list[wg.DeviceTensor], out: wg.DeviceTensor,
                    status: wg.DeviceTensor | None = None) -> Thunk:
    """A thunk recording a reduction (``sum``, ``mean``, ``amax``, ``amin``, ``var``,
    ``reduction``: the reduced dims kept with size 1) or ``softmax`` / ``log_softmax`` over
    any dim (``reduce_dim.wgsl``, one thread per column of x as [outer, n, inner]). Raises
    YirageError for shapes or dtypes that disagree, an output overlapping x, or sizes past 2^32
    elements."""
    (x,) = args
    op = node.op
    xs = tuple(graph.tensors[node.inputs[0]].shape)
    kind = _FLOAT_KIND.get(x.dtype)
    if kind is None:
        raise YirageError(f"webgpu {op}: float32, float16 or bfloat16 only, got {x.dtype}")
    d0, d1 = _reduce_dims(node, len(xs))
    outer, n, inner = _outer_n_inner(xs, d0, d1)
    softmax = op in ("softmax", "log_softmax")
    _check_out(op, out, xs if softmax else (outer, inner), x.dtype)
    cols = outer * inner
    if cols == 0 or (softmax and n == 0):
        return _seq(provider=f"webgpu-wgsl ({op}, empty)")
    if n == 0:   # an empty reduction: torch's identity (sum 0, mean / var NaN); amax/amin raise in torch
        raise YirageError(f"webgpu {op}: a reduction over zero elements")
    corr = struct.unpack("<I", struct.pack("<f", float(node.attrs.get("correction", 0))))[0]
    access = _access(op, [x], [out])
    params = [_u32(v, op) for v in (cols, n, inner, x.offset, out.offset)] + [corr]
    run = _pipeline("reduce_dim.wgsl", access, KIND=kind, OP=_REDUCE_OP[op]).bind([x, out], params,
                                                                                 _groups(cols, _NT))
    return _seq(run, provider=f"webgpu-wgsl ({op}, over dims {d0}..{d1})")


#: op -> (supports(node, graph) -> bool, bind(node, graph, args, out, status) -> thunk)
OPS: dict[str, tuple[Callable, Callable]] = {
    **{op: (supports_layout, bind_layout) for op in _LAYOUT},
    "index_select": (supports_indexing, bind_indexing),
    "gather": (supports_indexing, bind_indexing),
    "cumsum": (supports_cumsum, bind_cumsum),
    **{op: (supports_reduce_dim, bind_reduce_dim) for op in _REDUCE_OP},
}

__all__ = ["OPS", "MAX_DIMS", "supports_layout", "bind_layout", "supports_indexing", "bind_indexing",
           "supports_cumsum", "bind_cumsum", "supports_reduce_dim", "bind_reduce_dim"]
