"""W8A8 linear layer (``ir.ops.linear_w8a8_reference``): int8 weights, int8 activations
quantized per token (and per group of features) at run time, exact int32 dot products.

Two kernels, launched back to back by :func:`linear_w8a8`:

1. ``_quantize_kernel``: one program per (row, group) of x float32 ``[M, K]``: ``amax`` of
   ``|x|`` over the group, ``s = amax / 127`` (1 for an all-zero group), ``q = round(x / s)``
   (round half to even) clamped to ``[-127, 127]``, written as int8 ``[M, K]`` plus float32
   scales ``[M, K // G]`` (``G = K`` when ungrouped). Divisions are correctly rounded
   (``div_rn``, what torch computes; Triton's plain ``/`` is approximate on NVIDIA GPUs) and the
   rounding uses the fp32 ``+ 1.5 * 2**23`` trick, exact for ``|v| < 2**22``, so the int8 values
   and scales are bit-identical to ``quantize_rows_int8`` on every target.
2. ``_gemm_kernel``: one program per ``[BLOCK_M, BLOCK_N]`` output tile. ``tl.dot`` of int8
   tiles with ``out_dtype=tl.int32`` accumulates each group's dot product exactly (|acc| <=
   127**2 * K, fine for K < 133,000); the group's int32 sum is converted to float32 and times
   the group's x scale, summed over groups in float32, then ``* w_scale[n] (+ bias[n])`` as the
   reference does. Ungrouped (``G = K``), the whole of K is one int32 sum and is scaled once.
   Groups of G >= 32 features are walked in ``BLOCK_K`` chunks (the last chunk of a group
   masked at the group's end). Smaller groups (G < 32, e.g. 8) would make a ``tl.dot`` too
   small for the GPU's int8 MMA (K >= 32), so a tile packs ``GPT`` whole groups, each padded
   to ``GPAD = next_pow2(G)`` columns (zeros), and runs one full-size dot per group on the
   tile with the other groups' columns zeroed: exact, GPT times the MMA work.

Results equal the reference up to float32 summation order over groups (bit-equal int8 values,
scales and int32 dots). Status: checked under Triton's CPU interpreter only; these kernels
have NOT been run on a GPU yet (block sizes are fixed, not autotuned).

The int8/scale workspace is allocated once by :func:`linear_w8a8_workspace` (bind time); the
launch function allocates nothing and never syncs with the host.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._common import check_tensors

#: Output tile and K chunk of the GEMM (int8 tl.dot needs every dim >= 16 and K >= 32 on GPUs).
BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64
#: Groups smaller than this take the packed small-group path of the GEMM.
MIN_DOT_K = 32
#: Largest chunk of a row (group) the quantize kernel holds at once.
QUANT_BLOCK = 1024
#: 1.5 * 2**23: adding and subtracting it rounds an fp32 |v| < 2**22 to an integer, ties to even.
_RNE_MAGIC = tl.constexpr(12582912.0)


@dataclass
class W8A8Workspace:
    """Run-time buffers of :func:`linear_w8a8` for ``M`` rows of ``K`` features in groups of ``G``.

    ``q``: int8 ``[M, K]`` (quantized x), ``scale``: float32 ``[M, K // G]`` (per row and group).
    """

    q: torch.Tensor
    scale: torch.Tensor
    group: int


def _group(K: int, group_size: int) -> int:
    if not isinstance(group_size, int) or group_size < 0 or (group_size and K % group_size):
        raise ValueError(f"linear_w8a8: group_size must be 0 or divide K={K}, got {group_size!r}")
    return group_size or K


def linear_w8a8_workspace(x: torch.Tensor, group_size: int = 0) -> W8A8Workspace:
    """Allocate the workspace for inputs shaped like ``x`` (float32 ``[..., K]``), on x's device.

    Raises:
        ValueError: ``x`` has no last dim, or ``group_size`` is not 0 or a divisor of K.
    """
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"linear_w8a8: x must be [..., K] with K > 0, got {tuple(x.shape)}")
    K = x.shape[-1]
    G = _group(K, group_size)
    M = x.numel() // K
    return W8A8Workspace(q=torch.empty(M, K, dtype=torch.int8, device=x.device),
                         scale=torch.empty(M, K // G, dtype=torch.float32, device=x.device), group=G)


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, s_ptr, K, G, NG, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr):
    """Quantize group ``program_id(1)`` of row ``program_id(0)``; grid (M, K // G)."""
    m = tl.program_id(0).to(tl.int64)
    grp = tl.program_id(1)
    base = m * K + grp.to(tl.int64) * G
    offs = tl.arange(0, BLOCK)
    if ONE_PASS:  # the whole group in registers: one read of x
        mask = offs < G
        x = tl.load(x_ptr + base + offs, mask=mask, other=0.0)
        amax = tl.max(tl.abs(x), axis=0)
    else:
        vmax = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(0, G, BLOCK):
            xk = tl.load(x_ptr + base + k0 + offs, mask=(k0 + offs) < G, other=0.0)
            vmax = tl.maximum(vmax, tl.abs(xk))
        amax = tl.max(vmax, axis=0)
    s = tl.math.div_rn(amax, 127.0)
    s = tl.where(s > 0, s, 1.0)
    tl.store(s_ptr + m * NG + grp, s)
    if ONE_PASS:
        v = tl.math.div_rn(x, s)
        r = (v + _RNE_MAGIC) - _RNE_MAGIC
        r = tl.minimum(tl.maximum(r, -127.0), 127.0)
        tl.store(q_ptr + base + offs, r.to(tl.int8), mask=mask)
    else:
        for k0 in range(0, G, BLOCK):
            kmask = (k0 + offs) < G
            xk = tl.load(x_ptr + base + k0 + offs, mask=kmask, other=0.0)
            v = tl.math.div_rn(xk, s)
            r = (v + _RNE_MAGIC) - _RNE_MAGIC
            r = tl.minimum(tl.maximum(r, -127.0), 127.0)
            tl.store(q_ptr + base + k0 + offs, r.to(tl.int8), mask=kmask)


@triton.jit
def _gemm_kernel(q_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, out_ptr, M, N, K, G, NG,
                 HAS_BIAS: tl.constexpr, SMALL_G: tl.constexpr, GPAD: tl.constexpr, GPT: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out tile [BLOCK_M, BLOCK_N]; grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)).

    SMALL_G: BLOCK_K == GPT * GPAD, each tile holds GPT groups padded to GPAD columns.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    j = tl.arange(0, BLOCK_K)
    q_rows = q_ptr + offs_m.to(tl.int64)[:, None] * K        # [BLOCK_M, 1]
    xs_rows = xs_ptr + offs_m.to(tl.int64) * NG              # [BLOCK_M]
    w_cols = w_ptr + offs_n.to(tl.int64)[None, :]            # [1, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if SMALL_G:
        sub = j // GPAD                                      # group of each tile column
        within = j % GPAD
        for g0 in range(0, NG, GPT):
            grp = g0 + sub
            valid = (within < G) & (grp < NG)
            k = grp * G + within
            a = tl.load(q_rows + k[None, :], mask=m_mask[:, None] & valid[None, :], other=0)
            b = tl.load(w_cols + k.to(tl.int64)[:, None] * N, mask=valid[:, None] & n_mask[None, :], other=0)
            for s in tl.static_range(GPT):
                a_s = tl.where((sub == s)[None, :], a, tl.zeros_like(a))
                d = tl.dot(a_s, b, out_dtype=tl.int32)
                gs = g0 + s
                xs = tl.load(xs_rows + gs, mask=m_mask & ((offs_m * 0 + gs) < NG), other=0.0)
                acc += d.to(tl.float32) * xs[:, None]
    else:
        for g in range(0, NG):
            k_end = (g + 1) * G
            iacc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
            for k0 in range(g * G, k_end, BLOCK_K):
                k = k0 + j
                k_mask = k < k_end
                a = tl.load(q_rows + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0)
                b = tl.load(w_cols + k.to(tl.int64)[:, None] * N, mask=k_mask[:, None] & n_mask[None, :], other=0)
                iacc = tl.dot(a, b, iacc, out_dtype=tl.int32)
            xs = tl.load(xs_rows + g, mask=m_mask, other=0.0)
            acc += iacc.to(tl.float32) * xs[:, None]
    acc = acc * tl.load(ws_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    tl.store(out_ptrs, acc, mask=m_mask[:, None] & n_mask[None, :])


def linear_w8a8(x: torch.Tensor, w_t: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                out: torch.Tensor, workspace: W8A8Workspace) -> None:
    """``out = linear_w8a8_reference(x, w_t, w_scale, bias, group_size)`` (see the module doc).

    Args:
        x: float32 ``[..., K]``, contiguous; M = ``x.numel() // K`` rows (tokens).
        w_t: int8 ``[K, N]`` (the transposed weight: in_features x out_features), contiguous.
        w_scale: float32 ``[N]`` per-output-channel weight scales.
        bias: float32 ``[N]`` or None.
        out: float32 ``[..., N]`` (M * N elements), contiguous; written, never read.
        workspace: from :func:`linear_w8a8_workspace` for M rows of K features (its ``group``
            is the group size G; G = K means ungrouped); overwritten.

    Raises:
        ValueError: dtype, shape or device mismatches (host checks only; no device sync).
    """
    check_tensors("linear_w8a8", x=x, w_t=w_t, w_scale=w_scale, bias=bias, out=out,
                  q=workspace.q, scale=workspace.scale)
    if x.dtype != torch.float32 or x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"linear_w8a8: x must be float32 [..., K] with K > 0, got {x.dtype} {tuple(x.shape)}")
    K = x.shape[-1]
    M = x.numel() // K
    if w_t.dtype != torch.int8 or w_t.dim() != 2 or w_t.shape[0] != K:
        raise ValueError(f"linear_w8a8: w_t must be int8 [{K}, N], got {w_t.dtype} {tuple(w_t.shape)}")
    N = w_t.shape[1]
    for name, t in (("w_scale", w_scale), ("bias", bias)):
        if t is not None and (t.dtype != torch.float32 or tuple(t.shape) != (N,)):
            raise ValueError(f"linear_w8a8: {name} must be float32 [{N}], got {t.dtype} {tuple(t.shape)}")
    if out.dtype != torch.float32 or out.numel() != M * N or (out.dim() and out.shape[-1] != N):
        raise ValueError(f"linear_w8a8: out must hold float32 [{M}, {N}], got {out.dtype} {tuple(out.shape)}")
    G = workspace.group
    if G <= 0 or K % G:
        raise ValueError(f"linear_w8a8: the workspace's group size {G} does not divide K={K}")
    NG = K // G
    q, xs = workspace.q, workspace.scale
    if q.dtype != torch.int8 or tuple(q.shape) != (M, K) or xs.dtype != torch.float32 or tuple(xs.shape) != (M, NG):
        raise ValueError(f"linear_w8a8: workspace must be int8 [{M}, {K}] and float32 [{M}, {NG}], got "
                         f"{q.dtype} {tuple(q.shape)} and {xs.dtype} {tuple(xs.shape)}")
    if M == 0 or N == 0:
        return
    qblock = min(triton.next_power_of_2(G), QUANT_BLOCK)
    _quantize_kernel[(M, NG)](x, q, xs, K, G, NG, BLOCK=qblock, ONE_PASS=qblock >= G)
    small = G < MIN_DOT_K
    gpad = triton.next_power_of_2(G) if small else 1
    gpt = max(MIN_DOT_K // gpad, 1) if small else 1
    block_k = gpad * gpt if small else BLOCK_K
    b = bias if bias is not None else w_scale  # never read when HAS_BIAS is False
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
    _gemm_kernel[grid](q, xs, w_t, w_scale, b, out, M, N, K, G, NG, HAS_BIAS=bias is not None,
                       SMALL_G=small, GPAD=gpad, GPT=gpt, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=block_k)
