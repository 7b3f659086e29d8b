"""WebGPU library kernels for encoder attention and stacked linears, float32:
``attention_varlen``, ``attention_bidir``, ``sdpa`` and ``linear_stack``.

``OPS`` maps each op to ``(supports, bind)``, the contract of ops.py's ``OPS``:
``supports(node, graph) -> bool`` (never raises for a node of that op), ``bind(node, graph,
args, out, status) -> thunk`` (``BackendImpl.bind_library_op``, backends/base.py). Nodes
``supports`` refuses (float16/bfloat16, head dims past ``MAX_HEAD_DIM``, an sdpa with no keys)
keep running as their torch references on the host.

The kernels are WGSL source files shipped with the package (``kernels/webgpu``):

- ``attention_varlen.wgsl``: multi-head attention with an online softmax, one workgroup per
  (query row, head), its tensors described by element strides, so one kernel runs the three
  attention ops: ``attention_varlen`` (qkv [T, 3 H Dh] of packed sentences, each row attending
  its own sentence, found by a binary search of the offsets, every offset clamped into [0, T];
  rows in no sentence are zero), ``attention_bidir`` (qkv [B, S, 3 H Dh] and an additive
  key mask [B, S]) and ``sdpa`` (q [B, H, S, D], k [B, Hk, T, D], v [B, Hk, T, Dv], GQA, an
  additive mask broadcast from [B or 1, H or 1, S or 1, T], ``causal`` top-left aligned as
  torch's is_causal, ``scale`` defaulting to D ** -0.5). A mask value of -inf drops its key; a
  row that keeps none is NaN for ``attention_bidir`` (its reference's softmax) and zero for
  ``sdpa`` (torch's scaled_dot_product_attention, torch 2.13).
- ``offsets_check.wgsl``: ``attention_varlen``'s run-time check of its offsets (the op's
  ``index_input``): the first that is not 0, then non-decreasing up to T, is recorded in the
  op's status slot as [1, value, previous offset, T + 1] (``ir.ops.check_offsets``' error);
  the executor raises ``IndexOutOfRangeError`` after the run.
- ``linear_stack``: its parts bound one by one with library.py's ``bind_linear`` into their
  planes of ``out`` (``backends.base.bind_linear_stack_parts``), when ``supports_linear``
  holds for each.

Buffers are bound whole (``runtime.webgpu``): shaders add the tensors' element offsets. When
``out`` lies in an input's buffer (a plan's arena) the inputs are bound writable too (ops.py's
``_access``); an ``out`` overlapping an input's elements is refused (YirageError).

This module may import the runtime, ir, dtypes and errors layers and its sibling kernel modules
(library.py, ops.py); it must never import the front end (kernel, dynamo, engines, models) or
another device's backend, and never falls back to the host itself.
"""
from __future__ import annotations

import math
import struct
from typing import Callable

import torch

from ...dtypes import DType
from ...errors import YirageError
from ...runtime import webgpu as wg
from . import library as lib
from .ops import _access, _f32, _pipeline, _seq, _status_slot, _two_words, _types

Thunk = Callable[[], None]

#: the largest head dim (q.k length and output width) the attention kernel takes
MAX_HEAD_DIM = 1024
_NT = 64   # attention_varlen.wgsl's NT


def _real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", float(x)))[0]


def _attend(what: str, q, k, v, mask, offsets, out, *, NB, H, S, grp, D, Dv, T, q_st, k_st, v_st, o_st,
            m_st=(0, 0, 0), causal=False, empty_nan=False, scale: float) -> Thunk:
    """One dispatch of attention_varlen.wgsl. ``*_st`` are (element offset, batch, head, row)
    strides; ``offsets`` None: dense keys [0, T) (mode 0), else the sentence of each row."""
    if not 0 < D <= MAX_HEAD_DIM or not 0 < Dv <= MAX_HEAD_DIM:
        raise YirageError(f"webgpu {what}: head dims {D}, {Dv} are not in 1..{MAX_HEAD_DIM}")
    reads = [t for t in (q, k, v, mask, offsets) if t is not None]
    access = _access(what, reads, [out])
    varlen = offsets is not None
    params = [NB, H, S, grp, D, Dv, T, int(varlen), *q_st, *k_st, *v_st, *o_st,
              mask.offset if mask is not None else 0, *m_st, int(mask is not None), int(causal),
              2 * offsets.offset if varlen else 0, offsets.numel() - 1 if varlen else 0, int(empty_nan), _bits(scale)]
    pipe = _pipeline("attention_varlen.wgsl", access, QPT=-(-D // _NT), DPT=-(-Dv // _NT))
    # unused bindings get a buffer already bound (never read)
    return pipe.bind([q, k, v, mask if mask is not None else q, offsets if varlen else q, out], params,
                     wg.grid(NB * H * S))


# ---- attention_varlen --------------------------------------------------------------------------
def _packed_ok(node, qkv, dims: int) -> bool:
    h = node.attrs.get("num_heads")
    if not isinstance(h, int) or h <= 0 or not _real(node.attrs.get("scale")):
        return False
    if qkv.dtype != DType.float32 or len(qkv.shape) != dims or qkv.shape[-1] % (3 * h):
        return False
    return 0 < qkv.shape[-1] // (3 * h) <= MAX_HEAD_DIM


def supports_attention_varlen(node, graph) -> bool:
    """float32 qkv [T, 3 * H * Dh] (Dh in 1..``MAX_HEAD_DIM``), int64 offsets [B + 1]."""
    if node.op != "attention_varlen" or len(node.inputs) != 2:
        return False
    qkv, offsets = _types(node, graph)
    return _packed_ok(node, qkv, 2) and offsets.dtype == DType.int64 and len(offsets.shape) == 1 \
        and offsets.shape[0] >= 2


def check_offsets(offsets: wg.DeviceTensor, T: int, status: wg.DeviceTensor) -> Thunk:
    """A thunk recording one dispatch of ``offsets_check.wgsl``: the first offset that breaks
    ``0 = offsets[0] <= offsets[1] <= ... <= T`` is recorded in ``status`` (int64 [4]) as
    ``[1, value, previous (0 for the first), T + 1]`` unless it already holds a violation."""
    if offsets.dtype != torch.int64:
        raise YirageError(f"webgpu attention_varlen: offsets must be int64, got {offsets.dtype}")
    hi_lo, hi_hi = _two_words(T + 1)
    params = [offsets.numel(), 2 * offsets.offset, T, 2 * status.offset, hi_lo, hi_hi]
    return _pipeline("offsets_check.wgsl", _access("attention_varlen", [offsets], [status])).bind(
        [offsets, status], params, (1, 1, 1))


def bind_attention_varlen(node, graph, args: list[wg.DeviceTensor], out: wg.DeviceTensor,
                          status: wg.DeviceTensor | None) -> Thunk:
    """A thunk recording ``ir.ops.attention_varlen_reference``: the offsets check, then the
    attention (two dispatches).

    Args:
        args: [qkv, offsets]: qkv float32 [T, 3 * H * Dh], offsets int64 [B + 1].
        out: float32 [T, H * Dh]; rows in no sentence (past offsets[B]) are written as zeros.
        status: the op's int64 [4] status slot: bad offsets are recorded as [1, value,
            previous offset, T + 1] (the executor raises IndexOutOfRangeError); the attention
            clamps every offset into [0, T], so nothing is read or written out of range.
            None: a private slot (violations unreported).

    Attributes: ``num_heads``, ``scale``. Raises YirageError for other dtypes, shapes that
    disagree, an output overlapping qkv, or sizes past 2^32 elements."""
    qkv, offsets = args
    _f32(qkv, "attention_varlen")
    _f32(out, "attention_varlen")
    H, scale = node.attrs["num_heads"], node.attrs["scale"]
    if qkv.dim() != 2 or qkv.shape[1] % (3 * H):
        raise YirageError(f"webgpu attention_varlen: qkv {tuple(qkv.shape)} must be [T, 3 * {H} * Dh]")
    T, HD = qkv.shape[0], qkv.shape[1] // 3
    Dh = HD // H
    if out.numel() != T * HD:
        raise YirageError(f"webgpu attention_varlen: out {tuple(out.shape)} must hold {T} x {HD} elements")
    if offsets.dim() != 1 or offsets.numel() < 2:
        raise YirageError(f"webgpu attention_varlen: offsets {tuple(offsets.shape)} must be int64 [B + 1]")
    status = _status_slot(status)
    check = check_offsets(offsets, T, status)
    if T == 0:
        return _seq(check, provider="webgpu-wgsl (attention_varlen, empty)")
    row = 3 * HD
    run = _attend("attention_varlen", qkv, qkv, qkv, None, offsets, out, NB=1, H=H, S=T, grp=1, D=Dh, Dv=Dh, T=T,
                  q_st=(qkv.offset, 0, Dh, row), k_st=(qkv.offset + HD, 0, Dh, row),
                  v_st=(qkv.offset + 2 * HD, 0, Dh, row), o_st=(out.offset, 0, Dh, HD), scale=scale)
    return _seq(check, run, provider="webgpu-wgsl (attention_varlen)")


# ---- attention_bidir -----------------------------------------------------------------------------
def supports_attention_bidir(node, graph) -> bool:
    """float32 qkv [B, S, 3 * H * Dh] (Dh in 1..``MAX_HEAD_DIM``) and float32 key_mask [B, S]."""
    if node.op != "attention_bidir" or len(node.inputs) != 2:
        return False
    qkv, mask = _types(node, graph)
    return _packed_ok(node, qkv, 3) and mask.dtype == DType.float32 and tuple(mask.shape) == tuple(qkv.shape[:2])


def bind_attention_bidir(node, graph, args: list[wg.DeviceTensor], out: wg.DeviceTensor,
                         status: wg.DeviceTensor | None = None) -> Thunk:
    """A thunk recording ``ir.ops.attention_bidir_reference``: softmax(q k^T * scale +
    key_mask) v per batch and head, qkv float32 [B, S, 3 * H * Dh], key_mask float32 [B, S]
    (-inf drops a key; a row keeping none is NaN, as the reference), out float32 [B, S, H * Dh]. ``status``:
    unused. Raises YirageError for other dtypes, shapes that disagree or an output overlapping
    an input."""
    qkv, mask = args
    for t in (qkv, mask, out):
        _f32(t, "attention_bidir")
    H, scale = node.attrs["num_heads"], node.attrs["scale"]
    if qkv.dim() != 3 or qkv.shape[2] % (3 * H) or tuple(mask.shape) != tuple(qkv.shape[:2]):
        raise YirageError(f"webgpu attention_bidir: qkv {tuple(qkv.shape)} must be [B, S, 3 * {H} * Dh] and "
                          f"key_mask {tuple(mask.shape)} [B, S]")
    B, S, three = qkv.shape
    HD = three // 3
    Dh = HD // H
    if out.numel() != B * S * HD:
        raise YirageError(f"webgpu attention_bidir: out {tuple(out.shape)} must hold {B} x {S} x {HD} elements")
    if B * S == 0:
        return _seq(provider="webgpu-wgsl (attention_bidir, empty)")
    run = _attend("attention_bidir", qkv, qkv, qkv, mask, None, out, NB=B, H=H, S=S, grp=1, D=Dh, Dv=Dh, T=S,
                  q_st=(qkv.offset, S * three, Dh, three), k_st=(qkv.offset + HD, S * three, Dh, three),
                  v_st=(qkv.offset + 2 * HD, S * three, Dh, three), o_st=(out.offset, S * HD, Dh, HD),
                  m_st=(S, 0, 0), empty_nan=True, scale=scale)
    return _seq(run, provider="webgpu-wgsl (attention_bidir)")


# ---- sdpa ----------------------------------------------------------------------------------------
def supports_sdpa(node, graph) -> bool:
    """float32 q [B, H, S, D], k [B, Hk, T, D], v [B, Hk, T, Dv] (Hk dividing H, T >= 1, D and
    Dv in 1..``MAX_HEAD_DIM``), an optional float32 additive mask [B or 1, H or 1, S or 1, T],
    ``causal``, ``scale`` None or finite."""
    if node.op != "sdpa" or len(node.inputs) not in (3, 4):
        return False
    ts = _types(node, graph)
    if any(t.dtype != DType.float32 or len(t.shape) != 4 for t in ts):
        return False
    q, k, v = ts[:3]
    (B, H, S, D), (Bk, Hk, T, Dk), (Bv, Hv, Tv, Dv) = q.shape, k.shape, v.shape
    if (Bk, Dk) != (B, D) or (Bv, Hv, Tv) != (B, Hk, T) or Hk == 0 or H % Hk or T == 0:
        return False
    if not (0 < D <= MAX_HEAD_DIM and 0 < Dv <= MAX_HEAD_DIM):
        return False
    if len(ts) == 4:
        m = ts[3].shape
        if m[3] != T or any(n not in (1, full) for n, full in zip(m[:3], (B, H, S))):
            return False
    scale = node.attrs.get("scale")
    return scale is None or _real(scale)


def bind_sdpa(node, graph, args: list[wg.DeviceTensor], out: wg.DeviceTensor,
              status: wg.DeviceTensor | None = None) -> Thunk:
    """A thunk recording ``ir.ops.sdpa_reference`` (torch's scaled_dot_product_attention with
    GQA): args [q, k, v] or [q, k, v, mask] as ``supports_sdpa`` describes them, out float32
    [B, H, S, Dv]. ``causal``: query s sees keys j <= s (with a mask too: both apply); a mask
    value of -inf drops its key; a row keeping no key is zero (as torch's). ``status``: unused. Raises
    YirageError for other dtypes, shapes that disagree or an output overlapping an input."""
    q, k, v = args[:3]
    mask = args[3] if len(args) == 4 else None
    for t in (*args, out):
        _f32(t, "sdpa")
    if any(t.dim() != 4 for t in args):
        raise YirageError("webgpu sdpa: q, k, v and the mask must be 4-d")
    B, H, S, D = q.shape
    Hk, T, Dv = k.shape[1], k.shape[2], v.shape[3]
    if (tuple(k.shape) != (B, Hk, T, D) or tuple(v.shape[:3]) != (B, Hk, T) or Hk == 0 or H % Hk
            or tuple(out.shape) != (B, H, S, Dv)):
        raise YirageError(f"webgpu sdpa: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} and out "
                          f"{tuple(out.shape)} disagree")
    m_st = (0, 0, 0)
    if mask is not None:
        mb, mh, ms, mt = mask.shape
        if mt != T or any(n not in (1, full) for n, full in zip((mb, mh, ms), (B, H, S))):
            raise YirageError(f"webgpu sdpa: mask {tuple(mask.shape)} does not broadcast to {(B, H, S, T)}")
        m_st = (mh * ms * T if mb != 1 else 0, ms * T if mh != 1 else 0, T if ms != 1 else 0)
    if B * H * S == 0:
        return _seq(provider="webgpu-wgsl (sdpa, empty)")
    scale = node.attrs.get("scale")
    scale = D ** -0.5 if scale is None else scale
    run = _attend("sdpa", q, k, v, mask, None, out, NB=B, H=H, S=S, grp=H // Hk, D=D, Dv=Dv, T=T,
                  q_st=(q.offset, H * S * D, S * D, D), k_st=(k.offset, Hk * T * D, T * D, D),
                  v_st=(v.offset, Hk * T * Dv, T * Dv, Dv), o_st=(out.offset, H * S * Dv, S * Dv, Dv),
                  m_st=m_st, causal=bool(node.attrs.get("causal")), scale=scale)
    return _seq(run, provider="webgpu-wgsl (sdpa)")


# ---- linear_stack --------------------------------------------------------------------------------
def _stack_parts(node):
    from ...transforms.parallel import linear_stack_parts   # the parts' definition (as backends/base.py)
    return linear_stack_parts(node)


def supports_linear_stack(node, graph) -> bool:
    """Every part (a ``linear`` of x) float32 and accepted by library.py's ``supports_linear``."""
    if node.op != "linear_stack":
        return False
    try:
        parts = _stack_parts(node)
    except (KeyError, IndexError, TypeError):
        return False
    return bool(parts) and all(lib.supports_linear(p, graph) for p, _ in parts)


def bind_linear_stack(node, graph, args: list[wg.DeviceTensor], out: wg.DeviceTensor,
                      status: wg.DeviceTensor | None = None) -> Thunk:
    """A thunk recording each part's ``linear`` (library.py's ``bind_linear``: GEMM or GEMV)
    into its plane ``out[i]`` of out [k, ..., N] (``backends.base.bind_linear_stack_parts``)."""
    from ..base import bind_linear_stack_parts

    run = bind_linear_stack_parts(node, graph, args, out, status, lib.bind_linear)
    return _seq(run, provider="webgpu-wgsl (linear_stack)")


#: op -> (supports(node, graph) -> bool, bind(node, graph, args, out, status) -> thunk)
OPS: dict[str, tuple[Callable, Callable]] = {
    "attention_varlen": (supports_attention_varlen, bind_attention_varlen),
    "attention_bidir": (supports_attention_bidir, bind_attention_bidir),
    "sdpa": (supports_sdpa, bind_sdpa),
    "linear_stack": (supports_linear_stack, bind_linear_stack),
}

__all__ = ["OPS", "MAX_HEAD_DIM", "check_offsets", "supports_attention_varlen", "bind_attention_varlen",
           "supports_attention_bidir", "bind_attention_bidir", "supports_sdpa", "bind_sdpa",
           "supports_linear_stack", "bind_linear_stack"]
