"""Linear layer ``out = x @ W^T (+ bias)`` with float or GGUF block-quantized weights.

Weights are ``[N, K]`` (``out_features x in_features``, the layout GGUF and ``torch.nn.Linear``
store). Quantized weights stay packed in memory and are decoded in registers, one tile at a
time, per llama.cpp's ``ggml-common.h`` block layouts (q8_0, q4_1; see ``_common``).

Two kernels, picked by the number of rows M of x:

- ``M <= GEMV_MAX_M`` (decode): GEMV. One program per (block of N output rows, row of x); it
  walks K in ``[BLOCK_N, NB, 32]`` tiles, multiplies by x and reduces with ``tl.sum``. Every
  weight byte is read once per row of x (the few rows of a decode step hit L2).
- larger M (prefill): tiled GEMM (the Triton matmul tutorial's grouped ordering) whose
  ``[BLOCK_K, BLOCK_N]`` weight tile is dequantized to x's dtype before ``tl.dot``.

Both accumulate in float32 (fp32 dots use ``input_precision="ieee"``: no TF32) and store in
x's dtype, rounding to nearest even. With fp16/bf16 x, decoded quantized weights are rounded to
x's dtype first in both kernels (``dequantize(w).to(x.dtype)``, as the IR reference does).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (QK, W_FLOAT, acc_per_thread, autotune, cast_rtne, check_tensors, dequant_block_tile,
                      dequant_gather, dot_upcast, mma, pow2_bucket, to_out, weight_type)

#: Largest M handled by the GEMV kernel; larger M goes to the tl.dot GEMM.
GEMV_MAX_M = 8
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


# NB = blocks of 32 along K per tile (BLOCK_K = 32 * NB). The first config of each list is the
# one the interpreter runs; every config was checked to compile for sm_90 without spills for
# the dtypes its prune function lets through.
_GEMV_CONFIGS = [
    triton.Config({"BLOCK_N": 16, "NB": 8}, num_warps=4),
    triton.Config({"BLOCK_N": 8, "NB": 8}, num_warps=4),
    triton.Config({"BLOCK_N": 16, "NB": 4}, num_warps=4),
    triton.Config({"BLOCK_N": 8, "NB": 4}, num_warps=4),
    triton.Config({"BLOCK_N": 4, "NB": 16}, num_warps=4),
    triton.Config({"BLOCK_N": 16, "NB": 8}, num_warps=8),
    triton.Config({"BLOCK_N": 32, "NB": 4}, num_warps=4),
    triton.Config({"BLOCK_N": 32, "NB": 8}, num_warps=8),
    triton.Config({"BLOCK_N": 64, "NB": 4}, num_warps=8),
    triton.Config({"BLOCK_N": 64, "NB": 2}, num_warps=4),
]


@autotune(configs=_GEMV_CONFIGS, key=["N", "K", "M_KEY"])
@triton.jit
def _linear_gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, M_KEY, row_bytes,
                        W_TYPE: tl.constexpr, BYTES: tl.constexpr, HAS_BIAS: tl.constexpr,
                        BLOCK_N: tl.constexpr, NB: tl.constexpr):
    """out[m, n0:n0+BLOCK_N] = x[m] . W[n0:n0+BLOCK_N]; grid (cdiv(N, BLOCK_N), M)."""
    pid_n = tl.program_id(0)
    m = tl.program_id(1).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask3 = (offs_n < N)[:, None, None]
    j = tl.arange(0, 32)[None, None, :]
    blk = tl.arange(0, NB)[None, :, None]
    x_row = x_ptr + m * K
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    if W_TYPE == 0:
        w_rows = w_ptr + offs_n.to(tl.int64)[:, None, None] * K
    else:
        row_off = offs_n.to(tl.int64)[:, None, None] * row_bytes
    for k0 in range(0, K, NB * 32):
        offs_k = k0 + blk * 32 + j                      # [1, NB, 32]
        k_mask = offs_k < K
        x = tl.load(x_row + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        if W_TYPE == 0:
            w = tl.load(w_rows + offs_k, mask=n_mask3 & k_mask, other=0.0).to(tl.float32)
        else:
            kb = k0 // 32 + blk
            w = dequant_block_tile(w_ptr, row_off, n_mask3, kb, kb < K // 32, W_TYPE, BYTES)
            if x_ptr.dtype.element_ty != tl.float32:  # as the GEMM: decoded weights in x's dtype
                w = cast_rtne(w, x_ptr.dtype.element_ty).to(tl.float32)
        acc += tl.sum(tl.sum(w * x, axis=2), axis=1)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * N + offs_n, to_out(acc, out_ptr), mask=offs_n < N)


_GEMM_CONFIGS = [
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "NB": 1, "GROUP_M": 8}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 32, "BLOCK_N": 64, "NB": 1, "GROUP_M": 8}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_M": 16, "BLOCK_N": 64, "NB": 1, "GROUP_M": 8}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "NB": 1, "GROUP_M": 8}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 32, "NB": 1, "GROUP_M": 8}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "NB": 1, "GROUP_M": 8}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "NB": 1, "GROUP_M": 8}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "NB": 2, "GROUP_M": 8}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "NB": 2, "GROUP_M": 8}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "NB": 2, "GROUP_M": 8}, num_warps=4, num_stages=4),
]


def _prune_gemm(configs, args):
    """fp32 x multiplies on CUDA cores (IEEE, no tensor cores): keep tiles that fit registers."""
    if args["x_ptr"].dtype != torch.float32:
        return configs
    limit = 32 if args["W_TYPE"] == W_FLOAT else 16
    return [c for c in configs if c.kwargs["NB"] == 1 and acc_per_thread(c) <= limit]


@autotune(configs=_GEMM_CONFIGS, key=["N", "K", "M_KEY"], prune=_prune_gemm)
@triton.jit
def _linear_gemm_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, M_KEY, row_bytes,
                        W_TYPE: tl.constexpr, BYTES: tl.constexpr, HAS_BIAS: tl.constexpr,
                        UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        NB: tl.constexpr, GROUP_M: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] tile of out per program; grid (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N),)."""
    BLOCK_K: tl.constexpr = NB * 32
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * num_n
    first_m = (pid // group) * GROUP_M
    group_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + ((pid % group) % group_m)
    pid_n = (pid % group) // group_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * K + offs_k[None, :]
    if W_TYPE == 0:
        w_ptrs = w_ptr + offs_n.to(tl.int64)[None, :] * K + offs_k[:, None]   # [BLOCK_K, BLOCK_N]
    else:
        row_off = offs_n.to(tl.int64)[None, :] * row_bytes                    # [1, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + offs_k) < K
        x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]
        if W_TYPE == 0:
            w = tl.load(w_ptrs, mask=w_mask, other=0.0)
            w_ptrs += BLOCK_K
        else:
            w32 = dequant_gather(w_ptr, row_off, (k0 + offs_k)[:, None], w_mask, W_TYPE, BYTES)
            w = cast_rtne(w32, x_ptr.dtype.element_ty)
        acc = mma(x, w, acc, UPCAST)
        x_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    tl.store(out_ptrs, to_out(acc, out_ptr), mask=m_mask[:, None] & n_mask[None, :])


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, w_type: str) -> None:
    """``out[M, N] = x[M, K] @ W[N, K]^T (+ bias[N])``, W float or GGUF q8_0/q4_1.

    Args:
        x: float32/float16/bfloat16 ``[..., K]``, contiguous; M = ``x.numel() // K`` rows.
        w: ``w_type == "float"``: ``[N, K]`` of x's dtype. ``"q8_0"``: uint8 ``[N, K//32*34]``;
            ``"q4_1"``: uint8 ``[N, K//32*20]`` (llama.cpp ggml-common.h blocks; K % 32 == 0).
        bias: ``[N]`` of x's dtype, or None.
        out: ``[..., N]`` (M * N elements) of x's dtype, contiguous; written, never read.
        w_type: "float", "q8_0" or "q4_1".

    Memory traffic: reads W once per program column (M <= 8: once per row of x, from L2 after
    the first), x once per weight tile, writes out once. No allocation, no host sync.

    Raises:
        ValueError: unknown ``w_type``, dtype mismatches, or shapes that don't agree.
    """
    check_tensors("linear", x=x, w=w, bias=bias, out=out)
    code, nbytes = weight_type(w_type)
    if x.dtype not in _FLOATS:
        raise ValueError(f"linear: x must be float32/float16/bfloat16, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"linear: x must be [..., K] with K > 0, got {tuple(x.shape)}")
    K = x.shape[-1]
    M = x.numel() // K
    if w.dim() != 2:
        raise ValueError(f"linear: w must be 2-d, got {tuple(w.shape)}")
    N = w.shape[0]
    if code == W_FLOAT:
        if w.dtype != x.dtype:
            raise ValueError(f"linear: float weight must have x's dtype {x.dtype}, got {w.dtype}")
        if w.shape[1] != K:
            raise ValueError(f"linear: w is {tuple(w.shape)}, expected [N, {K}]")
        row_bytes = K
    else:
        if w.dtype != torch.uint8:
            raise ValueError(f"linear: {w_type} weight must be uint8 blocks, got {w.dtype}")
        if K % QK:
            raise ValueError(f"linear: {w_type} needs K divisible by {QK}, got K={K}")
        row_bytes = K // QK * nbytes
        if w.shape[1] != row_bytes:
            raise ValueError(f"linear: {w_type} weight for K={K} must be [N, {row_bytes}], got {tuple(w.shape)}")
    if bias is not None and (bias.shape != (N,) or bias.dtype != x.dtype):
        raise ValueError(f"linear: bias must be [{N}] of {x.dtype}, got {tuple(bias.shape)} {bias.dtype}")
    if out.dtype != x.dtype or out.numel() != M * N or (out.dim() and out.shape[-1] != N):
        raise ValueError(f"linear: out must hold [{M}, {N}] of {x.dtype}, got {tuple(out.shape)} {out.dtype}")
    if M == 0 or N == 0:
        return
    b = bias if bias is not None else out  # never read when HAS_BIAS is False
    args = (x, w, b, out, M, N, K, pow2_bucket(M), row_bytes)
    meta = dict(W_TYPE=code, BYTES=max(nbytes, 1), HAS_BIAS=bias is not None)
    if M <= GEMV_MAX_M:
        grid = lambda META: (triton.cdiv(N, META["BLOCK_N"]), M)  # noqa: E731
        _linear_gemv_kernel[grid](*args, **meta)
    else:
        grid = lambda META: (triton.cdiv(M, META["BLOCK_M"]) * triton.cdiv(N, META["BLOCK_N"]),)  # noqa: E731
        _linear_gemm_kernel[grid](*args, **meta, UPCAST=dot_upcast(x))
