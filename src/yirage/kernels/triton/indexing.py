"""Indexing with run-time indices: ``index_select`` and ``gather`` (the IR ops of those names).

One kernel for both, over the contiguous output's elements (``BLOCK`` per program): output
coordinate m reads ``src[sum_{d != dim} m[d] * src_strides[d] + v * src_strides[dim]]`` with
``v = index[m[dim]]`` (index_select, a 1-d index) or ``v = index[flat(m)]`` (gather, an index
of the output's shape). Each v is compared with ``[0, n)`` in int64 before it forms an address:
an element whose index is out of range is written as zero, nothing read for it, and the
violation is reported into ``status`` (see ``_common.report_violation``). Any dtype: elements
are moved, never computed on (bool as bytes).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_tensors, report_violation, status_arg

#: most dims the kernel handles
MAX_DIMS = 8


@triton.jit
def _index_copy_kernel(src_ptr, index_ptr, dst_ptr, meta_ptr, status_ptr, total, dim, n, NDIM: tl.constexpr,
                       GATHER: tl.constexpr, HAS_STATUS: tl.constexpr, BLOCK: tl.constexpr):
    # meta: output sizes, then source strides (NDIM each, int64)
    flat = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = flat < total
    rem = flat
    s_at = tl.zeros([BLOCK], dtype=tl.int64)
    m_dim = tl.zeros([BLOCK], dtype=tl.int64)
    for k in tl.static_range(NDIM):
        d = NDIM - 1 - k
        size = tl.load(meta_ptr + d)
        i = rem % size
        rem = rem // size
        s_at += tl.where(d == dim, 0, i * tl.load(meta_ptr + NDIM + d))
        m_dim = tl.where(d == dim, i, m_dim)
    if GATHER:
        v = tl.load(index_ptr + flat, mask=mask, other=0).to(tl.int64)
    else:
        v = tl.load(index_ptr + m_dim, mask=mask, other=0).to(tl.int64)
    ok = (v >= 0) & (v < n) & mask
    if HAS_STATUS:
        bad = ((v < 0) | (v >= n)) & mask
        if tl.max(bad.to(tl.int32), axis=0) > 0:
            first = tl.min(tl.where(bad, flat, total), axis=0)
            report_violation(status_ptr, tl.sum(tl.where(flat == first, v, 0), axis=0), 0, n)
    safe = tl.where(ok, v, 0)                      # a bad index never forms an address
    src_at = s_at + safe * tl.load(meta_ptr + NDIM + dim)
    vals = tl.load(src_ptr + src_at, mask=ok, other=0)
    tl.store(dst_ptr + flat, vals, mask=mask)


def index_copy_meta(out_sizes, src_strides, device) -> torch.Tensor:
    """The int64 [2 * ndim] metadata ``index_copy`` takes (made once, at bind time)."""
    return torch.tensor([*out_sizes, *src_strides], dtype=torch.int64, device=device)


def index_copy(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor, meta: torch.Tensor, dim: int,
               gather: bool, status: torch.Tensor | None = None) -> None:
    """``index_select`` (``gather=False``: index int64 [K]) or ``gather`` (``gather=True``: index
    int64 of out's shape) of contiguous ``src`` along ``dim`` into contiguous ``out`` (src's
    dtype), with ``meta`` from ``index_copy_meta(out.shape, src strides)``.

    ``status``: None, or an int64 (4,) tensor zero on entry; an index outside
    ``[0, src.shape[dim])`` sets it to ``[1, index, 0, n]`` (its element of out is zero).
    ValueError for more than ``MAX_DIMS`` dims, mismatched dtypes, a non-int64 index,
    non-contiguous tensors or tensors on two devices."""
    check_tensors("index_copy", src=src, index=index, out=out)
    status_ptr, has_status = status_arg("index_copy", status, index)
    ndim = meta.numel() // 2
    if ndim > MAX_DIMS or src.dtype != out.dtype or index.dtype != torch.int64 or ndim != out.dim():
        raise ValueError(f"index_copy: at most {MAX_DIMS} dims, one dtype and an int64 index, got {ndim} dims, "
                         f"{src.dtype} -> {out.dtype}, index {index.dtype}")
    s, d = (src.view(torch.uint8), out.view(torch.uint8)) if src.dtype == torch.bool else (src, out)
    total = out.numel()
    if total == 0:
        return
    block = 1024
    _index_copy_kernel[(triton.cdiv(total, block),)](s, index, d, meta, status_ptr, total, dim, src.shape[dim],
                                                     NDIM=ndim, GATHER=bool(gather), HAS_STATUS=has_status,
                                                     BLOCK=block)
