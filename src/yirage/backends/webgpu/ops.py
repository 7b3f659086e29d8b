"""WebGPU library kernels for a decoder step's ops besides its GEMMs, float32: ``embedding``,
``rope``, ``rope_rows``, ``rotary_emb``, ``attention``, ``attention_rows`` and ``argmax``.

``OPS`` maps each op to ``(supports, bind)``: ``supports(node, graph) -> bool`` says whether
this module has a kernel for the node (dtypes and attributes it handles; never raises for a
node of that op), ``bind(node, graph, args, out, status) -> thunk`` records its launches
(the contract of ``BackendImpl.bind_library_op``, backends/base.py). Nodes ``supports``
refuses (float16/bfloat16 activations, a float16 KV cache, quantized embedding tables) keep
running as their torch references on the host.

The kernels are WGSL source files shipped with the package (``kernels/webgpu``):

- ``index_check.wgsl``: the run-time index check of every op with ``OpDef.index_input``:
  one workgroup scans the ids / start_pos / positions / slots (int64 read as u32 word pairs,
  int32 sign-extended) and records the first out-of-range value in the op's status slot as
  the int64 ``[1, value, lo, hi]`` (valid range ``[lo, hi)``, as ``ir.ops.index_error``
  reports it), claiming word 0 with a compare-exchange so that the first violation stays;
  the executor raises ``IndexOutOfRangeError`` after the run.
- ``embedding.wgsl``: a row gather, one thread per output element.
- ``rope.wgsl``: rotate-half RoPE at start_pos + t (``rope``) or positions[t] (``rope_rows``).
- ``rotary_emb.wgsl``: rotate-half RoPE with per-element cos/sin broadcast to x (up to 4 dims).
- ``kv_append.wgsl`` then ``attention.wgsl``: attention's KV-cache append (the caches, inputs
  3 and 4, are updated in place: ``OpDef.mutates``), then causal GQA attention with an online
  softmax, one workgroup per (row, query head), optionally in a sliding window; ``attention``
  over one sequence's cache, ``attention_rows`` over each row's slot of a batched cache.
- ``argmax.wgsl``: a workgroup reduction per row, int64 indices (torch.argmax's ties and NaNs).

Every kernel also checks the indices it uses itself and skips an access out of range: no
kernel reads or writes outside a tensor, whatever the inputs. A KV append after a violation
writes nothing (``attention_rows`` reads its status word 0, which its check set before).

Buffers are bound whole (``runtime.webgpu``): every shader adds the tensors' element offsets
(u32 word offsets for int64 tensors), passed in its ``u32`` parameters. WebGPU forbids binding
one buffer as both read-only and writable storage in one dispatch, so when a written tensor
(an output, a cache, the status) lies in an input's buffer the inputs are bound writable too
(the ``{{IN_ACCESS}}`` placeholder); a written tensor overlapping an input's elements is refused
(YirageError). Each dispatch binds at most 7 storage buffers (WebGPU's default limit is 8).

This module may import the runtime, ir, dtypes and errors layers and library.py (the
kernel sources); it must never import the front end (kernel, dynamo, engines, models) or
another device's backend, and must never fall back to the host itself: a node it cannot run,
``supports`` refuses.
"""
from __future__ import annotations

import struct
from typing import Callable, Sequence

import torch

from ...dtypes import DType
from ...errors import YirageError
from ...runtime import webgpu as wg
from .library import render

Thunk = Callable[[], None]

#: the largest head dim ``attention`` / ``attention_rows`` take (q staged in workgroup memory)
MAX_HEAD_DIM = 1024
_ATTN_THREADS = 64   # attention.wgsl's NT


# ---- helpers ----------------------------------------------------------------------------------
def _types(node, graph):
    return [graph.tensors[i] for i in node.inputs]


def _span(t: wg.DeviceTensor) -> tuple[int, int]:
    es = t.element_size()
    return t.offset * es, (t.offset + t.numel()) * es


def _access(what: str, reads: Sequence[wg.DeviceTensor], writes: Sequence[wg.DeviceTensor]) -> str:
    """The inputs' access mode for one dispatch: 'read_write' when a written tensor shares a
    buffer with one it reads (WebGPU forbids a buffer bound read-only and writable in one
    dispatch, a validation error at the next flush that would lose every launch recorded with
    it, but allows it writable twice), else 'read'. Raises YirageError when a written tensor
    overlaps the elements of one it reads, or of another written tensor (the same tensor twice
    is allowed: two caches given as one)."""
    aliased = False
    for i, w in enumerate(writes):
        others = [(r, "an input") for r in reads] + [(o, "another output") for o in writes[i + 1:] if o is not w]
        for r, role in others:
            if r.buffer is not w.buffer:
                continue
            aliased = aliased or role == "an input"
            (a0, a1), (b0, b1) = _span(w), _span(r)
            if a0 < a1 and b0 < b1 and a0 < b1 and b0 < a1:
                raise YirageError(f"webgpu {what}: a written tensor (bytes {a0}..{a1}) overlaps {role} "
                                  f"(bytes {b0}..{b1}) in one buffer; it cannot be computed in place")
    return "read_write" if aliased else "read"


def _words(t: wg.DeviceTensor) -> tuple[int, int]:
    """(u32 word offset, words per element) of an int64 or int32 tensor."""
    if t.dtype == torch.int64:
        return 2 * t.offset, 2
    if t.dtype == torch.int32:
        return t.offset, 1
    raise YirageError(f"webgpu: indices must be int64 or int32, got {t.dtype}")


def _f32(t: wg.DeviceTensor, what: str) -> None:
    if t.dtype != torch.float32:
        raise YirageError(f"webgpu {what}: float32 tensors only, got {t.dtype}")


def _status_slot(status: wg.DeviceTensor | None) -> wg.DeviceTensor:
    """The status slot to record in: ``status`` (int64, 4 elements), or a private zeroed one
    when None (violations are then skipped but not reported)."""
    if status is None:
        return wg.DeviceTensor.empty((4,), torch.int64)   # WebGPU zeroes new buffers
    if status.dtype != torch.int64 or status.numel() < 4:
        raise YirageError(f"webgpu: the status slot must be int64 [4], got {status!r}")
    return status


def _pipeline(name: str, access: str, **values) -> wg.Pipeline:
    return wg.Pipeline(render(name, IN_ACCESS=access, **values))


def _seq(*thunks: Thunk, provider: str) -> Thunk:
    """One thunk running ``thunks`` in order, labelled with ``provider``."""
    def run():
        for t in thunks:
            t()
    run.provider = provider
    return run


def _two_words(v: int) -> tuple[int, int]:
    """An int64 as its (low, high) u32 words (two's complement)."""
    v &= (1 << 64) - 1
    return v & 0xFFFFFFFF, v >> 32


def _groups(n: int, per: int) -> tuple[int, int, int]:
    return wg.grid(-(-n // per))


def check_indices(values: wg.DeviceTensor, n: int, bound: int, status: wg.DeviceTensor,
                  hi: int | None = None) -> Thunk:
    """A thunk recording one dispatch of ``index_check.wgsl``: the first of the ``n`` integers
    of ``values`` (int64 or int32) outside ``[0, bound)`` is recorded in ``status`` (int64 [4])
    as ``[1, value, 0, hi]`` (``hi`` defaults to ``bound``; it may be negative, then every value
    is out of range), unless ``status`` already holds a violation. Raises YirageError for
    another dtype or sizes past 2^32."""
    off, wide = _words(values)
    hi = bound if hi is None else hi
    hi_lo, hi_hi = _two_words(hi)
    st_off = 2 * status.offset
    params = [n, off, wide, max(0, min(bound, 2 ** 32 - 1)), st_off, hi_lo, hi_hi]
    access = _access("index check", [values], [status])
    return _pipeline("index_check.wgsl", access).bind([values, status], params, (1, 1, 1))


# ---- embedding ----------------------------------------------------------------------------------
def supports_embedding(node, graph) -> bool:
    """int64 or int32 ids [...] and a float32 table [V, H] (not quantized)."""
    if node.op != "embedding" or len(node.inputs) != 2 or node.attrs.get("w_dtype"):
        return False
    ids, table = _types(node, graph)
    return ids.dtype in (DType.int64, DType.int32) and table.dtype == DType.float32 and len(table.shape) == 2


def bind_embedding(node, graph, args: list[wg.DeviceTensor], out: wg.DeviceTensor,
                   status: wg.DeviceTensor | None) -> Thunk:
    """A thunk recording ``out[..., :] = table[ids[...], :]``.

    Args:
        args: [ids, table]: ids int64 or int32 [...] (T of them), table float32 [V, H].
        out: float32 [..., H] (T x H elements).
        status: the op's int64 [4] status slot: an id outside [0, V) is recorded as
            [1, id, 0, V] (the executor raises IndexOutOfRangeError: "embedding: token id ...")
            and never read through; None: a private slot (violations skipped, unreported).

    Raises YirageError for other dtypes, shapes that disagree, an output overlapping an input,
    or sizes past 2^32 elements."""
    ids, table = args
    _f32(table, "embedding")
    _f32(out, "embedding")
    if table.dim() != 2:
        raise YirageError(f"webgpu embedding: the table must be [V, H], got {tuple(table.shape)}")
    V, H = table.shape
    T = ids.numel()
    if out.numel() != T * H:
        raise YirageError(f"webgpu embedding: out {tuple(out.shape)} must hold {T} x {H} elements")
    status = _status_slot(status)
    ids_off, wide = _words(ids)
    if T * H == 0:
        return _seq(provider="webgpu-wgsl (empty)")
    check = check_indices(ids, T, V, status)
    access = _access("embedding", [ids, table], [out])
    run = _pipeline("embedding.wgsl", access).bind(
        [ids, table, out], [T * H, H, V, wide, ids_off, table.offset, out.offset], _groups(T * H, 256))
    return _seq(check, run, provider="webgpu-wgsl (embedding)")


# ---- rope, rope_rows ------------------------------------------------------------------------------
def supports_rope(node, graph) -> bool:
    """``rope`` / ``rope_rows``: float32 x [T, H, Dh], float32 cos/sin [S, Dh/2], int64 start_pos
    (1,) or positions [T]."""
    if node.op not in ("rope", "rope_rows") or len(node.inputs) != 4:
        return False
    x, cos, sin, pos = _types(node, graph)
    return (x.dtype == cos.dtype == sin.dtype == DType.float32 and pos.dtype == DType.int64
            and len(x.shape) == 3)


def bind_rope(node, graph, args: list[wg.DeviceTensor], out: wg.DeviceTensor,
              status: wg.DeviceTensor | None) -> Thunk:
    """A thunk recording rotate-half RoPE (``ir.ops.rope_reference`` /
    ``rope_rows_reference``) of a ``rope`` or ``rope_rows`` node.

    Args:
        args: [x, cos, sin, pos]: x float32 [T, H, Dh] (Dh even), cos and sin float32
            [S, Dh/2]; pos int64: ``rope``'s start_pos (1,) (rows start_pos .. start_pos + T - 1
            of the tables), ``rope_rows``' positions [T] (row t at positions[t]).
        out: float32 [T, H, Dh].
        status: the op's int64 [4] status slot: ``rope`` records a start_pos outside
            [0, S - T + 1) as [1, start, 0, S - T + 1], ``rope_rows`` the first position outside
            [0, S) as [1, position, 0, S]; such rows are never read. None: a private slot.

    Raises YirageError for other dtypes, shapes that disagree, an output overlapping an input,
    or sizes past 2^32 elements."""
    x, cos, sin, pos = args
    per_row = node.op == "rope_rows"
    for t in (x, cos, sin, out):
        _f32(t, node.op)
    if x.dim() != 3 or x.shape[-1] % 2 or tuple(out.shape) != tuple(x.shape):
        raise YirageError(f"webgpu {node.op}: x {tuple(x.shape)} must be [T, H, even Dh] and out the same, "
                          f"got out {tuple(out.shape)}")
    T, H, Dh = x.shape
    half = Dh // 2
    S = cos.shape[0] if cos.dim() == 2 else 0
    if cos.dim() != 2 or tuple(cos.shape) != tuple(sin.shape) or cos.shape[1] != half:
        raise YirageError(f"webgpu {node.op}: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must be [S, {half}]")
    if pos.dtype != torch.int64 or pos.numel() != (T if per_row else 1):
        raise YirageError(f"webgpu {node.op}: positions must be int64 with {T if per_row else 1} element(s)")
    status = _status_slot(status)
    if per_row:
        check = check_indices(pos, T, S, status)
    else:
        check = check_indices(pos, 1, S - T + 1 if S >= T else 0, status, hi=S - T + 1)
    n = T * H * half
    if n == 0:
        return _seq(check, provider=f"webgpu-wgsl ({node.op}, empty)")
    access = _access(node.op, [x, cos, sin, pos], [out])
    params = [n, T, H, half, S, x.offset, cos.offset, sin.offset, 2 * pos.offset, out.offset, int(per_row)]
    run = _pipeline("rope.wgsl", access).bind([x, cos, sin, pos, out], params, _groups(n, 256))
    return _seq(check, run, provider=f"webgpu-wgsl ({node.op})")


# ---- rotary_emb -------------------------------------------------------------------------------------
def supports_rotary_emb(node, graph) -> bool:
    """float32 x [..., D] (1 to 4 dims) and float32 cos, sin broadcasting to x's shape."""
    if node.op != "rotary_emb" or len(node.inputs) != 3:
        return False
    x, cos, sin = _types(node, graph)
    return x.dtype == cos.dtype == sin.dtype == DType.float32 and 1 <= len(x.shape) <= 4


def _broadcast_strides(t: wg.DeviceTensor, shape4: tuple[int, ...]) -> list[int]:
    """Element strides of contiguous ``t`` broadcast to ``shape4`` (0 along broadcast dims)."""
    dims = [1] * (4 - t.dim()) + list(t.shape)
    strides, acc = [0] * 4, 1
    for i in range(3, -1, -1):
        if dims[i] != shape4[i] and dims[i] != 1:
            raise YirageError(f"webgpu rotary_emb: {tuple(t.shape)} does not broadcast to {shape4}")
        strides[i] = acc if dims[i] != 1 else 0
        acc *= dims[i]
    return strides


def bind_rotary_emb(node, graph, args: list[wg.DeviceTensor], out: wg.DeviceTensor,
                    status: wg.DeviceTensor | None = None) -> Thunk:
    """A thunk recording ``out = x * cos + rotate_half(x) * sin`` (``ir.ops.rotary_emb_reference``).

    Args:
        args: [x, cos, sin]: float32, x [..., D] (1 to 4 dims, D even), cos and sin
            broadcasting to x's shape.
        out: float32, x's shape.
        status: unused (rotary_emb indexes nothing at run time).

    Raises YirageError for other dtypes, shapes that do not broadcast, an output overlapping
    an input, or sizes past 2^32 elements."""
    x, cos, sin = args
    for t in (x, cos, sin, out):
        _f32(t, "rotary_emb")
    if not 1 <= x.dim() <= 4 or x.shape[-1] % 2 or out.numel() != x.numel():
        raise YirageError(f"webgpu rotary_emb: x {tuple(x.shape)} must have 1 to 4 dims, an even last dim, and "
                          f"out {tuple(out.shape)} its size")
    shape4 = tuple([1] * (4 - x.dim()) + list(x.shape))
    cs, ss = _broadcast_strides(cos, shape4), _broadcast_strides(sin, shape4)
    n = x.numel()
    if n == 0:
        return _seq(provider="webgpu-wgsl (rotary_emb, empty)")
    access = _access("rotary_emb", [x, cos, sin], [out])
    params = [n, *shape4[1:], x.offset, cos.offset, sin.offset, out.offset, *cs, *ss]
    run = _pipeline("rotary_emb.wgsl", access).bind([x, cos, sin, out], params, _groups(n, 256))
    return _seq(run, provider="webgpu-wgsl (rotary_emb)")


# ---- attention, attention_rows ------------------------------------------------------------------------
def supports_attention(node, graph) -> bool:
    """``attention`` / ``attention_rows`` with float32 q, k, v and float32 caches (not a float16
    KV cache), head dim at most ``MAX_HEAD_DIM``, any window."""
    rows = node.op == "attention_rows"
    if node.op not in ("attention", "attention_rows") or len(node.inputs) != (7 if rows else 6):
        return False
    ts = _types(node, graph)
    q, k, v, kc, vc = ts[:5]
    window = node.attrs.get("window", 0) or 0
    return (all(t.dtype == DType.float32 for t in (q, k, v, kc, vc)) and all(t.dtype == DType.int64 for t in ts[5:])
            and len(q.shape) == 3 and 0 < q.shape[-1] <= MAX_HEAD_DIM and isinstance(window, int) and window >= 0
            and "scale" in node.attrs)


def bind_attention(node, graph, args: list[wg.DeviceTensor], out: wg.DeviceTensor,
                   status: wg.DeviceTensor | None) -> Thunk:
    """A thunk recording causal GQA attention over a KV cache that it first appends to
    (``ir.ops.attention_reference`` / ``attention_rows_reference``): three dispatches, the
    index check, ``kv_append.wgsl``, ``attention.wgsl``.

    Args:
        args: ``attention``: [q, k, v, k_cache, v_cache, start_pos]; ``attention_rows``:
            [q, k, v, k_cache, v_cache, slots, positions]. q float32 [T, Hq, Dh], k and v
            float32 [T, Hkv, Dh] (Hkv divides Hq: query head h reads KV head h // (Hq / Hkv));
            the caches float32 [S, Hkv, Dh] (``attention``) or [num_slots, S, Hkv, Dh]
            (``attention_rows``), written in place; start_pos int64 (1,); slots, positions
            int64 [T].
        out: float32 [T, Hq, Dh].
        status: the op's int64 [4] status slot: ``attention`` records a start_pos outside
            [0, S - T + 1) as [1, start, 0, S - T + 1]; ``attention_rows`` the first slot
            outside [0, num_slots) as [1, slot, 0, num_slots], else the first position outside
            [0, S) as [1, position, 0, S]. Then nothing is written to the caches. None: a
            private slot (violations skipped, unreported).

    Attributes: ``scale`` (q.k multiplier), ``window`` (0: full causal; W >= 1: keys
    p - W < j <= p).

    Raises YirageError for other dtypes, shapes that disagree, a head dim past
    ``MAX_HEAD_DIM``, a written tensor overlapping an input, or sizes past 2^32 elements."""
    rows = node.op == "attention_rows"
    what = node.op
    q, k, v, kc, vc = args[:5]
    for t in (q, k, v, kc, vc, out):
        _f32(t, what)
    if q.dim() != 3 or k.dim() != 3 or tuple(k.shape) != tuple(v.shape) or tuple(out.shape) != tuple(q.shape):
        raise YirageError(f"webgpu {what}: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} and out "
                          f"{tuple(out.shape)} must be [T, Hq, Dh], [T, Hkv, Dh] twice and q's shape")
    T, Hq, Dh = q.shape
    Hkv = k.shape[1]
    cache_dims = 4 if rows else 3
    if (k.shape[0] != T or k.shape[2] != Dh or Hkv == 0 or Hq % Hkv or kc.dim() != cache_dims
            or tuple(kc.shape) != tuple(vc.shape) or tuple(kc.shape[-2:]) != (Hkv, Dh)):
        raise YirageError(f"webgpu {what}: k/v {tuple(k.shape)} and caches {tuple(kc.shape)}, {tuple(vc.shape)} do "
                          f"not fit q {tuple(q.shape)}")
    if not 0 < Dh <= MAX_HEAD_DIM:
        raise YirageError(f"webgpu {what}: head dim {Dh} is not in 1..{MAX_HEAD_DIM}")
    n_slots, S = (kc.shape[0], kc.shape[1]) if rows else (1, kc.shape[0])
    idx = list(args[5:])
    for t in idx:
        if t.dtype != torch.int64 or t.numel() != (T if rows else 1):
            raise YirageError(f"webgpu {what}: {'slots and positions' if rows else 'start_pos'} must be int64 "
                              f"with {T if rows else 1} element(s)")
    slots, pos = (idx[0], idx[1]) if rows else (idx[0], idx[0])   # no slots: pos bound again, never read
    status = _status_slot(status)
    if rows:
        checks = [check_indices(slots, T, n_slots, status), check_indices(pos, T, S, status)]
    else:
        checks = [check_indices(pos, 1, S - T + 1 if S >= T else 0, status, hi=S - T + 1)]
    if T * Hq == 0:
        return _seq(*checks, provider=f"webgpu-wgsl ({what}, empty)")
    scale = node.attrs["scale"]
    window = int(node.attrs.get("window", 0) or 0)
    reads_append = [k, v, slots, pos]
    append = _pipeline("kv_append.wgsl", _access(what, reads_append, [kc, vc, status])).bind(
        [k, v, slots, pos, kc, vc, status],
        [T, Hkv, Dh, S, n_slots, k.offset, v.offset, kc.offset, vc.offset, 2 * slots.offset, 2 * pos.offset,
         int(rows), 2 * status.offset],
        wg.grid(T))
    scale_bits = struct.unpack("<I", struct.pack("<f", float(scale)))[0]
    dpt = -(-Dh // _ATTN_THREADS)
    attend = _pipeline("attention.wgsl", _access(what, [q, kc, vc, slots, pos], [out]), DPT=dpt).bind(
        [q, kc, vc, slots, pos, out],
        [T, Hq, Hkv, Dh, S, n_slots, q.offset, kc.offset, vc.offset, 2 * slots.offset, 2 * pos.offset,
         out.offset, int(rows), window, scale_bits],
        wg.grid(T * Hq))
    return _seq(*checks, append, attend, provider=f"webgpu-wgsl ({what})")


# ---- argmax ------------------------------------------------------------------------------------------
def supports_argmax(node, graph) -> bool:
    """float32 x [..., D] with D >= 1, over the last dim (the only one the IR allows)."""
    if node.op != "argmax" or len(node.inputs) != 1:
        return False
    (x,) = _types(node, graph)
    if x.dtype != DType.float32 or not x.shape or x.shape[-1] == 0:
        return False
    dim = node.attrs.get("dim", -1)
    return isinstance(dim, int) and dim % len(x.shape) == len(x.shape) - 1


def bind_argmax(node, graph, args: list[wg.DeviceTensor], out: wg.DeviceTensor,
                status: wg.DeviceTensor | None = None) -> Thunk:
    """A thunk recording ``out = torch.argmax(x, dim=-1)``.

    Args:
        args: [x], float32 [..., D], D >= 1.
        out: int64 [...] (x's shape without its last dim).
        status: unused.

    The first of equal maxima wins; a NaN counts as the largest (the first NaN wins), as in
    torch. Raises YirageError for other dtypes, shapes that disagree, an output overlapping x,
    or sizes past 2^32 elements."""
    (x,) = args
    _f32(x, "argmax")
    if x.dim() == 0 or x.shape[-1] == 0 or out.dtype != torch.int64 or out.numel() != x.numel() // x.shape[-1]:
        raise YirageError(f"webgpu argmax: x {tuple(x.shape)} (float32, last dim >= 1) and out {tuple(out.shape)} "
                          f"{out.dtype} (int64, x's leading dims) disagree")
    D = x.shape[-1]
    R = x.numel() // D
    if R == 0:
        return _seq(provider="webgpu-wgsl (argmax, empty)")
    access = _access("argmax", [x], [out])
    run = _pipeline("argmax.wgsl", access).bind([x, out], [R, D, x.offset, 2 * out.offset], wg.grid(R))
    return _seq(run, provider="webgpu-wgsl (argmax)")


#: op -> (supports(node, graph) -> bool, bind(node, graph, args, out, status) -> thunk)
OPS: dict[str, tuple[Callable, Callable]] = {
    "embedding": (supports_embedding, bind_embedding),
    "rope": (supports_rope, bind_rope),
    "rope_rows": (supports_rope, bind_rope),
    "rotary_emb": (supports_rotary_emb, bind_rotary_emb),
    "attention": (supports_attention, bind_attention),
    "attention_rows": (supports_attention, bind_attention),
    "argmax": (supports_argmax, bind_argmax),
}

__all__ = ["OPS", "MAX_HEAD_DIM", "check_indices", "supports_embedding", "bind_embedding", "supports_rope",
           "bind_rope", "supports_rotary_emb", "bind_rotary_emb", "supports_attention", "bind_attention",
           "supports_argmax", "bind_argmax"]
