"""Rotary position embedding (RoPE), rotate-half form.

Su et al. 2021 (RoFormer), in the rotate-half layout of transformers' Llama: for each head the
first and second halves of the head dim form the (x, y) pairs. Positions come from a device
tensor, so a decode step can be captured in a CUDA graph. ``rope_rows`` gives every row its own
position (the continuous-batching step).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_tensors, report_violation, status_arg, to_out

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, pos_ptr, out_ptr, status_ptr, H, HALF, LAST,
                 BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, HAS_STATUS: tl.constexpr,
                 ROWS: tl.constexpr):
    """Grid (T, cdiv(H, BLOCK_H)): heads h0..h0+BLOCK_H of token t; both halves in registers.

    Without ``ROWS`` token t sits at ``pos[0] + t`` and ``LAST`` = S - T is the largest valid
    start position: outside ``[0, LAST]`` (compared in int64) no program reads or writes
    anything (out is left as it was); program (0, 0) reports it when ``HAS_STATUS``. With
    ``ROWS`` token t sits at its own ``pos[t]`` and ``LAST`` = S - 1: a row out of range is not
    read or written, and its programs over head block 0 report it.
    """
    t = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_i = tl.arange(0, BLOCK_HALF)
    p0 = tl.load(pos_ptr + t).to(tl.int64) if ROWS else tl.load(pos_ptr).to(tl.int64)
    ok = (p0 >= 0) & (p0 <= LAST)
    if HAS_STATUS:
        if ((p0 < 0) | (p0 > LAST)) & ((t == 0) | ROWS) & (tl.program_id(1) == 0):
            report_violation(status_ptr, p0, 0, LAST + 1)
    pos_i = tl.full([BLOCK_HALF], 0, tl.int64) + tl.where(ok, p0, 0) + (0 if ROWS else t)
    i_mask = offs_i < tl.where(ok, HALF, 0)           # all False when out of range
    c = tl.load(cos_ptr + pos_i * HALF + offs_i, mask=i_mask, other=1.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + pos_i * HALF + offs_i, mask=i_mask, other=0.0).to(tl.float32)[None, :]
    mask = (offs_h < H)[:, None] & i_mask[None, :]
    off = (t.to(tl.int64) * H + offs_h[:, None]) * (2 * HALF) + offs_i[None, :]
    x1 = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + off + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + off, to_out(x1 * c - x2 * s, out_ptr), mask=mask)
    tl.store(out_ptr + off + HALF, to_out(x2 * c + x1 * s, out_ptr), mask=mask)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start_pos: torch.Tensor, out: torch.Tensor,
         status: torch.Tensor | None = None) -> None:
    """Rotate-half RoPE: token t sits at position ``start_pos[0] + t``.

    ``out[..., i] = x[i]*c_i - x[i+Dh/2]*s_i`` and ``out[..., i+Dh/2] = x[i+Dh/2]*c_i + x[i]*s_i``
    with ``c = cos[pos]``, ``s = sin[pos]`` (same as ``yirage.ir.ops.rope_reference``).

    Args:
        x: ``[T, H, Dh]`` float32/float16/bfloat16, contiguous, Dh even. Computed in float32.
        cos, sin: ``[S, Dh//2]`` float32 tables.
        start_pos: int64 tensor of shape (1,) on x's device, read inside the kernel; must satisfy
            ``0 <= start_pos <= S - T``. Checked on the device (the host can't see it without a
            sync): out of range, the kernel reads and writes nothing (no table row, no token):
            ``out`` is left as it was (so an in-place call leaves x unchanged).
        out: like x; may be x itself (each program reads its elements before writing them).
        status: None, or an int64 ``(4,)`` tensor on x's device, zero on entry. An out-of-range
            start_pos sets it to ``[1, start_pos, 0, S - T + 1]`` unless already flagged (one
            writer, elected by ``atomic_cas`` on ``status[0]``). Without it the check still
            guards the tables, unreported.

    Memory traffic: reads x, T rows of cos and sin; writes out. No allocation, no host sync.

    Raises:
        ValueError: wrong ranks/dtypes, odd Dh, shapes that don't agree, or a bad ``status``.
    """
    check_tensors("rope", x=x, cos=cos, sin=sin, start_pos=start_pos, out=out)
    status_ptr, has_status = status_arg("rope", status, start_pos)
    if x.dim() != 3 or x.dtype not in _FLOATS:
        raise ValueError(f"rope: x must be [T, H, Dh] float32/float16/bfloat16, got {tuple(x.shape)} {x.dtype}")
    T, H, Dh = x.shape
    if Dh % 2:
        raise ValueError(f"rope: head dim must be even, got {Dh}")
    half = Dh // 2
    for name, tab in (("cos", cos), ("sin", sin)):
        if tab.dim() != 2 or tab.shape[1] != half or tab.dtype != torch.float32:
            raise ValueError(f"rope: {name} must be float32 [max_seq, {half}], got {tuple(tab.shape)} {tab.dtype}")
    if cos.shape != sin.shape:
        raise ValueError(f"rope: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} differ")
    if start_pos.shape != (1,) or start_pos.dtype != torch.int64:
        raise ValueError(f"rope: start_pos must be an int64 tensor of shape (1,), got {start_pos.dtype} "
                         f"{tuple(start_pos.shape)}")
    if out.shape != x.shape or out.dtype != x.dtype:
        raise ValueError(f"rope: out must be {tuple(x.shape)} {x.dtype}, got {tuple(out.shape)} {out.dtype}")
    _launch(x, cos, sin, start_pos, out, status_ptr, has_status, cos.shape[0] - T, rows=False)


def _launch(x, cos, sin, pos, out, status_ptr, has_status: bool, last: int, rows: bool) -> None:
    """One launch of ``_rope_kernel`` over x [T, H, Dh] (checked by the caller)."""
    if x.numel() == 0:
        return
    T, H, Dh = x.shape
    half = Dh // 2
    BLOCK_HALF = triton.next_power_of_2(half)
    BLOCK_H = min(triton.next_power_of_2(H), max(1, 4096 // BLOCK_HALF))
    _rope_kernel[(T, triton.cdiv(H, BLOCK_H))](x, cos, sin, pos, out, status_ptr, H, half, last, BLOCK_H=BLOCK_H,
                                               BLOCK_HALF=BLOCK_HALF, HAS_STATUS=has_status, ROWS=rows, num_warps=4)


def rope_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, out: torch.Tensor,
              status: torch.Tensor | None = None) -> None:
    """Rotate-half RoPE with a position per row (continuous batching: rows of many sequences),
    as ``yirage.ir.ops.rope_rows_reference``: row t is rotated by ``cos/sin[positions[t]]``.

    Args:
        x: ``[T, H, Dh]`` float32/float16/bfloat16, contiguous, Dh even. Computed in float32.
        cos, sin: ``[S, Dh//2]`` float32 tables.
        positions: int64 ``(T,)`` on x's device, read inside the kernel; each must be in
            ``[0, S)``. A row out of range is neither read nor written (its out rows are left
            as they were) and, with ``status``, reported there as ``[1, position, 0, S]``.
        out: like x; may be x itself.
        status: None, or an int64 ``(4,)`` tensor on x's device, zero on entry (one writer).

    Raises:
        ValueError: wrong ranks/dtypes, odd Dh, shapes that don't agree, or a bad ``status``.
    """
    check_tensors("rope_rows", x=x, cos=cos, sin=sin, positions=positions, out=out)
    status_ptr, has_status = status_arg("rope_rows", status, positions)
    if x.dim() != 3 or x.dtype not in _FLOATS or x.shape[2] % 2:
        raise ValueError(f"rope_rows: x must be [T, H, Dh] float32/float16/bfloat16 with Dh even, got "
                         f"{tuple(x.shape)} {x.dtype}")
    T, H, Dh = x.shape
    half = Dh // 2
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != half or cos.dtype != torch.float32 or (
            sin.dtype != torch.float32):
        raise ValueError(f"rope_rows: cos and sin must be float32 [max_seq, {half}], got {tuple(cos.shape)} "
                         f"{cos.dtype} and {tuple(sin.shape)} {sin.dtype}")
    if positions.shape != (T,) or positions.dtype != torch.int64:
        raise ValueError(f"rope_rows: positions must be int64 of shape ({T},), got {positions.dtype} "
                         f"{tuple(positions.shape)}")
    if out.shape != x.shape or out.dtype != x.dtype:
        raise ValueError(f"rope_rows: out must be {tuple(x.shape)} {x.dtype}, got {tuple(out.shape)} {out.dtype}")
    _launch(x, cos, sin, positions, out, status_ptr, has_status, cos.shape[0] - 1, rows=True)


@triton.jit
def _rotary_emb_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, N1, N2, ROWS, HALF,
                       xs0, xs1, xs2, cs0, cs1, cs2, ss0, ss1, ss2,
                       BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Grid (cdiv(ROWS, BLOCK_R),): rows r = (i0, i1, i2) of an [N0, N1, N2, 2 * HALF] view;
    x, cos and sin at their strides over the three row dims (stride 0 broadcasts), the last dim
    contiguous; out contiguous. Offsets in int64."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    i2 = r % N2
    i1 = (r // N2) % N1
    i0 = r // (N2 * N1)
    offs = tl.arange(0, BLOCK_HALF)
    mask = (r < ROWS)[:, None] & (offs < HALF)[None, :]
    xo = (i0 * xs0 + i1 * xs1 + i2 * xs2)[:, None] + offs[None, :]
    co = (i0 * cs0 + i1 * cs1 + i2 * cs2)[:, None] + offs[None, :]
    so = (i0 * ss0 + i1 * ss1 + i2 * ss2)[:, None] + offs[None, :]
    oo = r[:, None] * (2 * HALF) + offs[None, :]
    a = tl.load(x_ptr + xo, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(x_ptr + xo + HALF, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(cos_ptr + co, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + co + HALF, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + so, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + so + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + oo, to_out(a * c1 - b * s1, out_ptr), mask=mask)
    tl.store(out_ptr + oo + HALF, to_out(b * c2 + a * s2, out_ptr), mask=mask)


def rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor) -> None:
    """Rotate-half RoPE with per-element tables, as ``yirage.ir.ops.rotary_emb_reference``
    (transformers' ``apply_rotary_pos_emb``): ``out = x * cos + rotate_half(x) * sin``, computed in
    float32.

    Args:
        x: ``[..., D]`` (1 to 4 dims, D even) float32/float16/bfloat16; any strides over the
            leading dims (e.g. the heads of a [B, S, H, D] buffer seen as [B, H, S, D]), the last
            dim contiguous.
        cos, sin: x's dtype, broadcasting to x's shape with last dim D (read through the strides
            of that broadcast: no copy), the last dim contiguous.
        out: x's shape and dtype, contiguous.

    Memory traffic: reads x and the rows of cos and sin each row uses; writes out. No
    allocation, no host sync.

    Raises:
        ValueError: wrong ranks, dtypes or shapes, a last dim that is not contiguous, or tensors on
            different devices.
    """
    check_tensors("rotary_emb", out=out)
    if not 1 <= x.dim() <= 4 or x.dtype not in _FLOATS or x.shape[-1] % 2:
        raise ValueError(f"rotary_emb: x must have 1 to 4 dims, an even last dim and a float dtype, got "
                         f"{tuple(x.shape)} {x.dtype}")
    try:
        cb, sb = cos.expand(x.shape), sin.expand(x.shape)
    except RuntimeError:
        raise ValueError(f"rotary_emb: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must broadcast to x's "
                         f"shape {tuple(x.shape)}") from None
    for name, t in (("x", x), ("cos", cb), ("sin", sb)):
        if t.dtype != x.dtype or t.device != x.device or (t.stride(-1) != 1 and t.shape[-1] > 1):
            raise ValueError(f"rotary_emb: {name} must be {x.dtype} on {x.device} with a contiguous last dim, got "
                             f"{t.dtype} on {t.device}, strides {tuple(t.stride())}")
    if out.shape != x.shape or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(f"rotary_emb: out must be {tuple(x.shape)} {x.dtype}, got {tuple(out.shape)} {out.dtype}")
    if x.numel() == 0:
        return
    pad = 4 - x.dim()
    n = [1] * pad + list(x.shape)
    st = [[0] * pad + list(t.stride()) for t in (x, cb, sb)]
    rows, half = n[0] * n[1] * n[2], n[3] // 2
    BLOCK_HALF = triton.next_power_of_2(half)
    BLOCK_R = max(1, min(64, 4096 // BLOCK_HALF))
    _rotary_emb_kernel[(triton.cdiv(rows, BLOCK_R),)](x, cos, sin, out, n[1], n[2], rows, half,
                                                      *st[0][:3], *st[1][:3], *st[2][:3],
                                                      BLOCK_R=BLOCK_R, BLOCK_HALF=BLOCK_HALF, num_warps=4)
