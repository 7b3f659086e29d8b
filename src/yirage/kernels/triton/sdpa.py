"""Scaled dot-product attention over [B, H, S, D] tensors: the IR's ``sdpa`` (torch's
``F.scaled_dot_product_attention`` with an additive mask, ``is_causal``, ``scale`` and GQA).

FlashAttention's forward pass (Dao et al. 2022, "FlashAttention: fast and memory-efficient
exact attention with IO-awareness"): program ``(m, b * H + h)`` owns a tile of ``BLOCK_M``
queries of one head and walks the keys in tiles of ``BLOCK_N``, keeping the running row max,
the running denominator and the float32 output accumulator (online softmax, in base 2: the
scores and the mask are scaled by log2(e) once). A mask element is read at
``mask[b*smb + h*smh + i*smi + j]`` (a stride 0 broadcasts that dim). ``is_causal`` hides key
``j > i`` (top-left aligned, as torch). A query that sees no key (every score -inf) gets 0, as
torch's fused kernels give. No run-time indices: nothing to check.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._common import autotune, dot_upcast, fp32_score_tiles, mma, pow2_bucket, to_out

_CONFIGS = [
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=4, num_stages=2),
    triton.Config({"BLOCK_M": 32, "BLOCK_N": 32}, num_warps=4, num_stages=2),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=2),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 32}, num_warps=4, num_stages=3),
]


@autotune(configs=_CONFIGS, key=["S_KEY", "T_KEY", "D", "G"], prune=fp32_score_tiles("q_ptr"))
@triton.jit
def _sdpa_kernel(q_ptr, k_ptr, v_ptr, m_ptr, o_ptr, qk_scale, S, T, S_KEY, T_KEY, H, G, D, smb, smh, smi,
                 sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sob, soh, sos,
                 HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    kvh = h // G                                           # GQA: the key/value head of query head h
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask, d_mask = offs_m < S, offs_d < D
    q_off = b * sqb + h * sqh + offs_m.to(tl.int64)[:, None] * sqs + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    k_base = k_ptr + b * skb + kvh * skh
    v_base = v_ptr + b * svb + kvh * svh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    hi = tl.minimum(T, (pid_m + 1) * BLOCK_M) if CAUSAL else T
    for n0 in range(0, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < T
        k = tl.load(k_base + offs_n.to(tl.int64)[None, :] * sks + offs_d[:, None],
                    mask=d_mask[:, None] & n_mask[None, :], other=0.0)             # [BLOCK_D, BLOCK_N]
        qk = mma(q, k, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), UPCAST) * qk_scale
        if HAS_MASK:
            bias = tl.load(m_ptr + b * smb + h * smh + offs_m.to(tl.int64)[:, None] * smi + offs_n[None, :],
                           mask=m_mask[:, None] & n_mask[None, :], other=0.0).to(tl.float32)
            qk += bias * 1.4426950408889634                                      # log2(e): base-2 scores
        visible = n_mask[None, :]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= offs_m[:, None])
        qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # a row with no visible key yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(qk - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + offs_n.to(tl.int64)[:, None] * svs + offs_d[None, :],
                    mask=n_mask[:, None] & d_mask[None, :], other=0.0)             # [BLOCK_N, BLOCK_D]
        acc = mma(p.to(v_ptr.dtype.element_ty), v, acc * alpha[:, None], UPCAST)
        m_i = m_new
    o = tl.where(l_i[:, None] > 0, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
    o_off = b * sob + h * soh + offs_m.to(tl.int64)[:, None] * sos + offs_d[None, :]
    tl.store(o_ptr + o_off, to_out(o, o_ptr), mask=m_mask[:, None] & d_mask[None, :])


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, out: torch.Tensor,
         causal: bool, scale: float | None) -> None:
    """``out`` = softmax(scale * q k^T + mask (+ causal)) v, as ``ir.ops.sdpa_reference``.

    Args:
        q: [B, H, S, D]; k, v: [B, Hk, T, D] with Hk dividing H (GQA); one float dtype. Any strides
            over the first three dims (e.g. the heads of a [B, S, H, D] buffer), the last dim
            contiguous.
        mask: None or an additive float mask of q's dtype, [B or 1, H or 1, S or 1, T], its last dim
            contiguous.
        out: [B, H, S, D] of q's dtype, strided as q may be; written only.
        causal: hide key j > query i (top-left aligned, as torch's ``is_causal``).
        scale: the softmax scale (None: D ** -0.5).

    Raises ValueError for a last dim that is not contiguous, tensors on two devices, or v's
    head dim differing from q's.
    """
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out), ("mask", mask)):
        if t is not None and (t.dim() != 4 or (t.stride(3) != 1 and t.shape[3] > 1) or t.device != q.device):
            raise ValueError(f"sdpa: {name} must be 4-d with a contiguous last dim on {q.device}, got "
                             f"{tuple(t.shape)} strides {tuple(t.stride())} on {t.device}")
    B, H, S, D = q.shape
    Hk, T = k.shape[1], k.shape[2]
    if v.shape[3] != D or H % Hk:
        raise ValueError(f"sdpa: needs v's head dim equal to q's and Hk dividing H, got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    strides = [0, 0, 0]
    if mask is not None:
        strides = [0 if mask.shape[i] == 1 else mask.stride(i) for i in range(3)]
    s = D ** -0.5 if scale is None else float(scale)
    grid = lambda meta: (triton.cdiv(S, meta["BLOCK_M"]), B * H)   # noqa: E731
    _sdpa_kernel[grid](q, k, v, q if mask is None else mask, out, s * math.log2(math.e), S, T, pow2_bucket(S),
                       pow2_bucket(T), H, H // Hk, D, *strides,
                       *(st for t in (q, k, v, out) for st in t.stride()[:3]),
                       HAS_MASK=mask is not None, CAUSAL=bool(causal),
                       UPCAST=dot_upcast(q), BLOCK_D=max(16, triton.next_power_of_2(D)))
