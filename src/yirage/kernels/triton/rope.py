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
