"""Reductions, softmax and running sums over the middle dim of a contiguous tensor viewed as
[outer, n, inner]: the IR's ``reduction``/``sum``/``mean``/``amax``/``amin``/``var`` and
``softmax``/``log_softmax`` over a dim that is not the last one (over the trailing dims they are
fused row programs), and ``cumsum`` along any dim (``tl.cumsum`` per tile plus a carry).

Program ``(o, c)`` owns inner columns ``c*BLOCK_I ..`` of outer index ``o`` and walks n in chunks of
``BLOCK_N`` rows, accumulating a float32 ``[BLOCK_N, BLOCK_I]`` tile (two passes for var: mean,
then squared deviations; three for softmax: max, sum of exp, output). Loads convert to float32,
stores to the output's dtype. No run-time indices: nothing to check.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_tensors

#: reduction codes (``reduction`` is a sum)
REDUCE_CODES = {"reduction": 0, "sum": 0, "mean": 1, "amax": 2, "amin": 3, "var": 4}


@triton.jit
def _reduce_mid_kernel(x_ptr, out_ptr, n, inner, correction, OP: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_I: tl.constexpr):
    o = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)[None, :]
    cmask = cols < inner
    base = x_ptr + o * n * inner
    if OP == 2:
        acc = tl.full([BLOCK_N, BLOCK_I], float("-inf"), tl.float32)
    elif OP == 3:
        acc = tl.full([BLOCK_N, BLOCK_I], float("inf"), tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_I], dtype=tl.float32)
    for j in range(0, n, BLOCK_N):
        rows = j + tl.arange(0, BLOCK_N)[:, None]
        m = (rows < n) & cmask
        if OP == 2:
            v = tl.load(base + rows * inner + cols, mask=m, other=float("-inf")).to(tl.float32)
            acc = tl.where(v != v, v, tl.where(acc != acc, acc, tl.maximum(acc, v)))  # NaN wins
        elif OP == 3:
            v = tl.load(base + rows * inner + cols, mask=m, other=float("inf")).to(tl.float32)
            acc = tl.where(v != v, v, tl.where(acc != acc, acc, tl.minimum(acc, v)))
        else:
            acc += tl.load(base + rows * inner + cols, mask=m, other=0.0).to(tl.float32)
    if OP == 2:
        r = tl.max(acc, axis=0, keep_dims=True)
        r = tl.where(tl.sum(tl.where(acc != acc, 1.0, 0.0), axis=0, keep_dims=True) > 0, float("nan"), r)
    elif OP == 3:
        r = tl.min(acc, axis=0, keep_dims=True)
        r = tl.where(tl.sum(tl.where(acc != acc, 1.0, 0.0), axis=0, keep_dims=True) > 0, float("nan"), r)
    else:
        r = tl.sum(acc, axis=0, keep_dims=True)
    if OP == 1:
        r = r / n
    if OP == 4:  # squared deviations from the mean, over max(0, n - correction)
        mean = r / n
        acc = tl.zeros([BLOCK_N, BLOCK_I], dtype=tl.float32)
        for j in range(0, n, BLOCK_N):
            rows = j + tl.arange(0, BLOCK_N)[:, None]
            m = (rows < n) & cmask
            d = tl.load(base + rows * inner + cols, mask=m, other=0.0).to(tl.float32) - mean
            acc += tl.where(m, d * d, 0.0)
        r = tl.sum(acc, axis=0, keep_dims=True) / tl.maximum(n - correction, 0.0)
    tl.store(out_ptr + o * inner + cols, r.to(out_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def _softmax_mid_kernel(x_ptr, out_ptr, n, inner, LOG: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_I: tl.constexpr):
    o = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)[None, :]
    cmask = cols < inner
    base = o * n * inner
    mx = tl.full([BLOCK_N, BLOCK_I], float("-inf"), tl.float32)
    for j in range(0, n, BLOCK_N):
        rows = j + tl.arange(0, BLOCK_N)[:, None]
        m = (rows < n) & cmask
        mx = tl.maximum(mx, tl.load(x_ptr + base + rows * inner + cols, mask=m, other=float("-inf")).to(tl.float32))
    mcol = tl.max(mx, axis=0, keep_dims=True)
    acc = tl.zeros([BLOCK_N, BLOCK_I], dtype=tl.float32)
    for j in range(0, n, BLOCK_N):
        rows = j + tl.arange(0, BLOCK_N)[:, None]
        m = (rows < n) & cmask
        v = tl.load(x_ptr + base + rows * inner + cols, mask=m, other=0.0).to(tl.float32)
        acc += tl.where(m, tl.exp(v - mcol), 0.0)
    s = tl.sum(acc, axis=0, keep_dims=True)
    for j in range(0, n, BLOCK_N):
        rows = j + tl.arange(0, BLOCK_N)[:, None]
        m = (rows < n) & cmask
        v = tl.load(x_ptr + base + rows * inner + cols, mask=m, other=0.0).to(tl.float32) - mcol
        y = v - tl.log(s) if LOG else tl.exp(v) / s
        tl.store(out_ptr + base + rows * inner + cols, y.to(out_ptr.dtype.element_ty), mask=m)


def _blocks(n: int, inner: int) -> tuple[int, int]:
    block_i = min(triton.next_power_of_2(max(inner, 1)), 128)
    block_n = min(triton.next_power_of_2(max(n, 1)), max(1, 4096 // block_i))
    return block_n, block_i


def reduce_mid(x: torch.Tensor, out: torch.Tensor, outer: int, n: int, inner: int, op: str,
               correction: float = 0.0) -> None:
    """``out[o, i] = op_j x[o, j, i]`` for contiguous x (``outer * n * inner`` elements) and out
    (``outer * inner``) of one float dtype; ``op`` a key of ``REDUCE_CODES`` (``var`` divides by
    ``max(0, n - correction)``). ValueError for non-contiguous tensors or tensors on two devices."""
    check_tensors("reduce_mid", x=x, out=out)
    block_n, block_i = _blocks(n, inner)
    _reduce_mid_kernel[(outer, triton.cdiv(inner, block_i))](x, out, n, inner, float(correction),
                                                            OP=REDUCE_CODES[op], BLOCK_N=block_n, BLOCK_I=block_i)


def softmax_mid(x: torch.Tensor, out: torch.Tensor, outer: int, n: int, inner: int, log: bool) -> None:
    """Softmax (``log``: log_softmax) over the middle dim of contiguous x viewed as [outer, n,
    inner] into out of the same shape and float dtype. ValueError as ``reduce_mid``."""
    check_tensors("softmax_mid", x=x, out=out)
    block_n, block_i = _blocks(n, inner)
    _softmax_mid_kernel[(outer, triton.cdiv(inner, block_i))](x, out, n, inner, LOG=bool(log),
                                                             BLOCK_N=block_n, BLOCK_I=block_i)


@triton.jit
def _cumsum_mid_kernel(x_ptr, out_ptr, n, inner, INT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_I: tl.constexpr):
    # a [BLOCK_N, BLOCK_I] tile at a time: its prefix sums down the rows plus the running carry
    o = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)[None, :]
    cmask = cols < inner
    base = o * n * inner
    if INT:
        carry = tl.zeros([1, BLOCK_I], dtype=tl.int64)
    else:
        carry = tl.zeros([1, BLOCK_I], dtype=tl.float32)
    for j in range(0, n, BLOCK_N):
        rows = j + tl.arange(0, BLOCK_N)[:, None]
        m = (rows < n) & cmask
        v = tl.load(x_ptr + base + rows * inner + cols, mask=m, other=0)
        v = v.to(tl.int64) if INT else v.to(tl.float32)
        y = tl.cumsum(v, axis=0) + carry
        tl.store(out_ptr + base + rows * inner + cols, y.to(out_ptr.dtype.element_ty), mask=m)
        carry += tl.sum(v, axis=0, keep_dims=True)


def cumsum_mid(x: torch.Tensor, out: torch.Tensor, outer: int, n: int, inner: int) -> None:
    """``out[o, i, :] = x[o, 0, :] + ... + x[o, i, :]`` over contiguous x viewed as [outer, n,
    inner]: float x into out of its dtype (float32 sums), bool/int32/int64 x into int64 out
    (exact, wrapping). ValueError as ``reduce_mid``, or for an output dtype that does not follow."""
    check_tensors("cumsum_mid", x=x, out=out)
    integer = not x.dtype.is_floating_point
    if out.dtype != (torch.int64 if integer else x.dtype):
        raise ValueError(f"cumsum_mid: {x.dtype} sums into {torch.int64 if integer else x.dtype}, got {out.dtype}")
    xs = x.view(torch.uint8) if x.dtype == torch.bool else x
    block_n, block_i = _blocks(n, inner)
    _cumsum_mid_kernel[(outer, triton.cdiv(inner, block_i))](xs, out, n, inner, INT=integer, BLOCK_N=block_n,
                                                            BLOCK_I=block_i)


#: most dims a strided copy handles
MAX_DIMS = 8


@triton.jit
def _strided_copy_kernel(src_ptr, dst_ptr, meta_ptr, total, src_offset, dst_offset, NDIM: tl.constexpr,
                         IDX32: tl.constexpr, BLOCK: tl.constexpr):
    # meta: sizes, src strides, dst strides (NDIM each, int64). IDX32: every index fits in int32,
    # whose division and remainder a GPU computes several times faster than int64's
    if IDX32:
        flat = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        s_at = tl.zeros([BLOCK], dtype=tl.int32) + src_offset
        d_at = tl.zeros([BLOCK], dtype=tl.int32) + dst_offset
    else:
        flat = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        s_at = tl.zeros([BLOCK], dtype=tl.int64) + src_offset
        d_at = tl.zeros([BLOCK], dtype=tl.int64) + dst_offset
    mask = flat < total
    rem = flat
    for k in tl.static_range(NDIM):
        d = NDIM - 1 - k
        if IDX32:
            size = tl.load(meta_ptr + d).to(tl.int32)
            i = rem % size
            rem = rem // size
            s_at += i * tl.load(meta_ptr + NDIM + d).to(tl.int32)
            d_at += i * tl.load(meta_ptr + 2 * NDIM + d).to(tl.int32)
        else:
            size = tl.load(meta_ptr + d)
            i = rem % size
            rem = rem // size
            s_at += i * tl.load(meta_ptr + NDIM + d)
            d_at += i * tl.load(meta_ptr + 2 * NDIM + d)
    tl.store(dst_ptr + d_at, tl.load(src_ptr + s_at, mask=mask), mask=mask)


def fits_int32(sizes, src_strides, dst_strides, src_offset: int, dst_offset: int) -> bool:
    """Does every element index of a strided copy (both sides, and the flat count) fit in int32?"""
    def span(strides, offset):
        return offset + sum((n - 1) * abs(st) for n, st in zip(sizes, strides))
    total = 1
    for n in sizes:
        total *= n
    return max(total, span(src_strides, src_offset), span(dst_strides, dst_offset)) < 2 ** 31 - 1024


def strided_copy_meta(sizes, src_strides, dst_strides, device) -> torch.Tensor:
    """The int64 [3 * ndim] metadata ``strided_copy`` takes (made once, at bind time)."""
    return torch.tensor([*sizes, *src_strides, *dst_strides], dtype=torch.int64, device=device)


def strided_copy(src: torch.Tensor, dst: torch.Tensor, meta: torch.Tensor, total: int, src_offset: int,
                 dst_offset: int, idx32: bool = False) -> None:
    """``dst[dst_offset + m . dst_strides] = src[src_offset + m . src_strides]`` for every index m
    of ``sizes`` (``meta`` from ``strided_copy_meta``; ``total`` the product of sizes), element
    strides, any dtype shared by src and dst (bool copied as bytes); ``idx32``: int32 index
    arithmetic, for copies whose indices all fit (``fits_int32``). ValueError for more than
    ``MAX_DIMS`` dims, mismatched dtypes, non-contiguous tensors or two devices."""
    check_tensors("strided_copy", src=src, dst=dst)
    ndim = meta.numel() // 3
    if ndim > MAX_DIMS or src.dtype != dst.dtype:
        raise ValueError(f"strided_copy: at most {MAX_DIMS} dims and one dtype, got {ndim} dims, "
                         f"{src.dtype} -> {dst.dtype}")
    s, d = (src.view(torch.uint8), dst.view(torch.uint8)) if src.dtype == torch.bool else (src, dst)
    block = 1024
    _strided_copy_kernel[(triton.cdiv(total, block),)](s, d, meta, total, src_offset, dst_offset, NDIM=ndim,
                                                       IDX32=bool(idx32), BLOCK=block)
