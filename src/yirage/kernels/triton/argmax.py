"""Row-wise argmax with ``torch.argmax`` semantics: the first maximum, and NaN beats all.

One program per row scans it in tiles, keeping per lane the best value and its first index
(a lane that saw a NaN keeps its first NaN), then reduces across lanes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_tensors

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _argmax_kernel(x_ptr, out_ptr, D, BLOCK: tl.constexpr):
    """Grid (R,): out[r] = first index of the max (or first NaN) of x[r, :D]."""
    r = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    NONE: tl.constexpr = 2147483647
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.full([BLOCK], NONE, tl.int32)
    best_nan = tl.zeros([BLOCK], dtype=tl.int1)
    row = x_ptr + r * D
    for d0 in range(0, D, BLOCK):
        idx = d0 + offs
        valid = idx < D
        v = tl.load(row + idx, mask=valid, other=float("-inf")).to(tl.float32)
        is_nan = v != v
        # indices only grow, so strict '>' keeps the first of equal values
        take = valid & ~best_nan & (is_nan | (v > best) | (best_i == NONE))
        best = tl.where(take, v, best)
        best_i = tl.where(take, idx, best_i)
        best_nan = best_nan | (take & is_nan)
    nan_i = tl.min(tl.where(best_nan, best_i, NONE), axis=0)
    v = tl.where(best_nan, float("-inf"), best)
    top = tl.max(v, axis=0)
    top_i = tl.min(tl.where((v == top) & (best_i != NONE), best_i, NONE), axis=0)
    tl.store(out_ptr + r, tl.where(nan_i != NONE, nan_i, top_i).to(tl.int64))


def argmax(x: torch.Tensor, out: torch.Tensor) -> None:
    """``out[r] = torch.argmax(x[r, :])``: index of the first maximum; the first NaN wins.

    Args:
        x: ``[R, D]`` float32/float16/bfloat16, contiguous, D >= 1 (x may be ``[..., D]``:
            R = numel // D rows).
        out: int64 with R elements; written only.

    Memory traffic: reads x once, writes R int64. No allocation, no host sync.

    Raises:
        ValueError: unsupported dtype, empty rows, or out of the wrong size/dtype.
    """
    check_tensors("argmax", x=x, out=out)
    if x.dtype not in _FLOATS or x.dim() < 1:
        raise ValueError(f"argmax: x must be float32/float16/bfloat16 [R, D], got {x.dtype} {tuple(x.shape)}")
    D = x.shape[-1]
    if D == 0:
        raise ValueError("argmax: rows are empty (D == 0)")
    R = x.numel() // D
    if out.dtype != torch.int64 or out.numel() != R:
        raise ValueError(f"argmax: out must be int64 with {R} elements, got {out.dtype} {tuple(out.shape)}")
    if R == 0:
        return
    BLOCK = min(triton.next_power_of_2(D), 4096)
    _argmax_kernel[(R,)](x, out, D, BLOCK=BLOCK, num_warps=8 if BLOCK >= 2048 else 4)
