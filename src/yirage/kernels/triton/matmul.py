"""Batched matrix multiply with ``torch.matmul`` broadcasting: ``out[*B, M, N] = a @ b``.

The kernel is the Triton matmul tutorial's tiled GEMM (grouped tile ordering for L2 reuse)
with a batch index folded into the first grid axis. Broadcast batch dims get stride 0, so a
and b are never expanded in memory; the host merges adjacent batch dims that share one
stride pattern, leaving at most three (decomposed in the kernel).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import autotune, check_tensors, dot_upcast, mma, pow2_bucket, to_out

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)

# The first config is the one the interpreter runs; all compile for sm_90 without spills for
# the dtypes _prune lets through.
_CONFIGS = [
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 8}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32, "GROUP_M": 8}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=8, num_stages=3),
    # skinny M (decode-like activations, M <= 16): narrow N tiles for more programs, long K
    # steps for more bytes of B in flight per program
    triton.Config({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "GROUP_M": 8}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 8}, num_warps=2, num_stages=4),
]


def _prune(configs, args):
    """fp32 multiplies on CUDA cores (IEEE, no tensor cores): keep the short-K tiles."""
    if args["a_ptr"].dtype != torch.float32:
        return configs
    return [c for c in configs if c.kwargs["BLOCK_K"] <= 32]


@autotune(configs=_CONFIGS, key=["M_KEY", "N", "K", "BATCH_KEY"], prune=_prune)
@triton.jit
def _bmm_kernel(a_ptr, b_ptr, out_ptr, M, N, K, M_KEY, BATCH_KEY,
                B1, B2, sa0, sa1, sa2, sb0, sb1, sb2,
                UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] tile of one batch entry per program.

    Grid (batch * tiles,). Batch index z = (z0 * B1 + z1) * B2 + z2 with element strides
    (sa0, sa1, sa2) in a and (sb0, sb1, sb2) in b (0 where broadcast).
    """
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    tiles = num_m * num_n
    z = (pid // tiles).to(tl.int64)
    t = pid % tiles
    group = GROUP_M * num_n
    first_m = (t // group) * GROUP_M
    group_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + ((t % group) % group_m)
    pid_n = (t % group) // group_m

    z2 = z % B2
    z1 = (z // B2) % B1
    z0 = z // (B2 * B1)
    a_base = a_ptr + z0 * sa0 + z1 * sa1 + z2 * sa2
    b_base = b_ptr + z0 * sb0 + z1 * sb1 + z2 * sb2

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    a_ptrs = a_base + offs_m.to(tl.int64)[:, None] * K + offs_k[None, :]
    b_ptrs = b_base + offs_k.to(tl.int64)[:, None] * N + offs_n[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + offs_k) < K
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = mma(a, b, acc, UPCAST)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * N
    out_ptrs = out_ptr + z * M * N + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    tl.store(out_ptrs, to_out(acc, out_ptr), mask=m_mask[:, None] & n_mask[None, :])


def _batch_layout(batch, a_batch, b_batch, a_mat, b_mat):
    """(sizes, a_strides, b_strides) of the broadcast batch dims, size-1 dims dropped and
    adjacent dims merged where both tensors allow it; padded to exactly three dims."""
    a_sh = (1,) * (len(batch) - len(a_batch)) + tuple(a_batch)
    b_sh = (1,) * (len(batch) - len(b_batch)) + tuple(b_batch)

    def strides(shape, mat):  # contiguous element strides, 0 where the dim is broadcast
        out, acc = [], mat
        for n in reversed(shape):
            out.append(acc if n != 1 else 0)
            acc *= n
        return out[::-1]

    sa, sb = strides(a_sh, a_mat), strides(b_sh, b_mat)
    dims = [(n, x, y) for n, x, y in zip(batch, sa, sb) if n != 1]
    merged = []
    for n, x, y in dims:
        if merged:
            pn, px, py = merged[-1]
            if px == x * n and py == y * n:
                merged[-1] = (pn * n, x, y)
                continue
        merged.append((n, x, y))
    if len(merged) > 3:
        raise ValueError(f"matmul: batch broadcast pattern {tuple(a_batch)} x {tuple(b_batch)} is too irregular "
                         "(more than 3 batch dims remain after merging)")
    merged = [(1, 0, 0)] * (3 - len(merged)) + merged
    return [m[0] for m in merged], [m[1] for m in merged], [m[2] for m in merged]


def matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """``out = torch.matmul(a, b)`` for a ``[..., M, K]`` and b ``[..., K, N]`` (>= 2 dims each).

    Args:
        a, b: contiguous, same dtype (float32/float16/bfloat16); batch dims broadcast like torch.
        out: contiguous ``[*broadcast(batch_a, batch_b), M, N]`` of that dtype; written only.

    Memory traffic: each a tile is read once per column of output tiles, each b tile once per
    row of output tiles (L2 helps via grouped ordering); out written once. fp32 accumulation;
    fp32 inputs use IEEE products (no TF32). No allocation, no host sync.

    Raises:
        ValueError: fewer than 2 dims, dtype mismatch/unsupported, K mismatch, batch dims that
            don't broadcast, or an out of the wrong shape/dtype.
    """
    check_tensors("matmul", a=a, b=b, out=out)
    if a.dim() < 2 or b.dim() < 2:
        raise ValueError(f"matmul: both operands need >= 2 dims, got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype not in _FLOATS or b.dtype != a.dtype or out.dtype != a.dtype:
        raise ValueError(f"matmul: a, b and out must share one float dtype, got {a.dtype}, {b.dtype}, {out.dtype}")
    M, K = a.shape[-2:]
    K2, N = b.shape[-2:]
    if K != K2:
        raise ValueError(f"matmul: inner dims differ: {tuple(a.shape)} @ {tuple(b.shape)}")
    try:
        batch = tuple(torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
    except RuntimeError:
        raise ValueError(f"matmul: batch dims don't broadcast: {tuple(a.shape)} @ {tuple(b.shape)}") from None
    if tuple(out.shape) != (*batch, M, N):
        raise ValueError(f"matmul: out must be {(*batch, M, N)}, got {tuple(out.shape)}")
    nbatch = 1
    for n in batch:
        nbatch *= n
    if out.numel() == 0:
        return
    (_, B1, B2), sa, sb = _batch_layout(batch, a.shape[:-2], b.shape[:-2], M * K, K * N)
    grid = lambda META: (nbatch * triton.cdiv(M, META["BLOCK_M"]) * triton.cdiv(N, META["BLOCK_N"]),)  # noqa: E731
    _bmm_kernel[grid](a, b, out, M, N, K, pow2_bucket(M), pow2_bucket(nbatch, 1 << 20),
                      B1, B2, *sa, *sb, UPCAST=dot_upcast(a))
