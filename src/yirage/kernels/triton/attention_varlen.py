"""Bidirectional multi-head attention over sentences packed back to back (the semantics of
``yirage.ir.ops.attention_varlen_reference``).

qkv ``[T, 3 * H * Dh]`` holds B sentences one after the other (row t: q heads, then k heads,
then v heads, each ``H * Dh`` wide, head h at columns ``h * Dh .. h * Dh + Dh - 1`` of its part);
sentence b is rows ``offsets[b] .. offsets[b + 1] - 1``. Each token attends every token of its
own sentence: ``softmax(scale * q k^T) v`` per head. Rows ``offsets[B] .. T - 1`` (padding of a
bucketed T) are written as zeros, as the reference does.

Kernel: FlashAttention forward (Dao et al. 2022, "FlashAttention: Fast and Memory-Efficient
Exact Attention with IO-Awareness"; FlashAttention-2 loop order, Dao 2023) over a *flat* grid
``(cdiv(T, BLOCK_M), H)``: one program per tile of BLOCK_M consecutive token rows and one head,
whatever sentences the tile covers. Each row finds its sentence ``[s, e)`` by a binary search
of ``offsets`` (``ceil(log2 B) + 1`` vector loads), the program streams the key tiles from the
first row's ``s`` to the last row's ``e`` with an online softmax (fp32 max, sum and
accumulator; exp2 with log2(e) folded into the scale) and masks each score to keys of the
query's own sentence. A tile inside one long sentence reads exactly that sentence's keys; a
tile over many short sentences reads at most its own rows plus the two boundary sentences, so
1-token and 512-token sentences both keep the tiles full. ``q @ k^T`` and ``p @ v`` are
``tl.dot`` with fp32 accumulation (IEEE products for fp32, p rounded to the qkv dtype for
fp16/bf16 as in FlashAttention); Dh is padded to a power of two >= 16 with masks (Dh = 8, 32,
48, 64, ... all work).

The grid depends only on T and H, never on the offsets' values, so the launch reads no device
value on the host when ``check_offsets=False`` (a CUDA graph can capture it). The kernel never
trusts the offsets: every sentence bound is clamped into ``[0, T]`` before it forms an address,
so bad offsets cannot make it read or write outside qkv and out (the output is then
meaningless; rows outside their clamped sentence come out zero). With ``status`` program
(0, 0) also checks the offsets on the device and reports the first bad one (the value, the
previous offset and T + 1, as ``ir.ops.check_offsets`` would name it). The default,
``check_offsets=True``, validates them on the host first (one device-to-host copy of B + 1
int64) and raises ``IndexOutOfRangeError``, as the reference and the CPU kernel do.

Status: checked against the reference under Triton's CPU interpreter, and on an NVIDIA H100
(Triton 3.6, torch 2.11; 2026-11-26), where every case passed except those with a single
sentence (B = 1): those now run as two sentences, the second empty (see ``attention_varlen``),
which has not run on a GPU yet.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ...errors import GraphError
from ._common import (autotune, cast_rtne, dot_upcast, fp32_score_tiles, mma, pow2_bucket, report_violation,
                      status_arg, to_out)

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_LOG2E = 1.4426950408889634

# The first config is the one the interpreter runs (few, large programs).
_CONFIGS = [
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=2),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=4, num_stages=2),
    triton.Config({"BLOCK_M": 32, "BLOCK_N": 32}, num_warps=4, num_stages=2),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=8, num_stages=2),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 32}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 128}, num_warps=8, num_stages=2),
]


_prune = fp32_score_tiles("qkv_ptr")


@triton.jit
def _check_offsets(off_ptr, status_ptr, T, B, BLOCK_B: tl.constexpr):
    """Report the first bad offset (offsets[0] != 0, a decrease, or above T) as
    ``[1, offsets[i], offsets[i - 1] (0 for i = 0), T + 1]``."""
    first = tl.full([], B + 1, tl.int64)
    for b0 in range(0, B + 1, BLOCK_B):
        i = b0 + tl.arange(0, BLOCK_B).to(tl.int64)
        live = i <= B
        o = tl.load(off_ptr + i, mask=live, other=0)
        prev = tl.load(off_ptr + i - 1, mask=live & (i > 0), other=0)
        bad = live & ((o < prev) | (o > T) | ((i == 0) & (o != 0)))
        first = tl.minimum(first, tl.min(tl.where(bad, i, B + 1), axis=0))
    if first <= B:
        value = tl.load(off_ptr + first)
        lo = tl.load(off_ptr + tl.maximum(first - 1, 0))
        lo = tl.where(first > 0, lo, 0)
        report_violation(status_ptr, value, lo, T + 1)


@autotune(configs=_CONFIGS, key=["T_KEY", "Dh", "H"], prune=_prune)
@triton.jit
def _varlen_kernel(qkv_ptr, off_ptr, out_ptr, status_ptr, qk_scale, T, T_KEY, B, H, Dh,
                   STEPS: tl.constexpr, UPCAST: tl.constexpr, HAS_STATUS: tl.constexpr, BLOCK_B: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Grid (cdiv(T, BLOCK_M), H): FlashAttention forward for BLOCK_M token rows of one head,
    each query row seeing only the keys of its own sentence."""
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    if HAS_STATUS:
        if (pid_m == 0) & (h == 0):
            _check_offsets(off_ptr, status_ptr, T, B, BLOCK_B)
    HD = H * Dh
    row_stride = 3 * HD
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)     # [BLOCK_M]
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < Dh
    # the sentence of each row: the largest b < B with offsets[b] <= row (binary search)
    lo_b = tl.zeros([BLOCK_M], dtype=tl.int64)
    hi_b = tl.zeros([BLOCK_M], dtype=tl.int64) + (B - 1)
    for _ in tl.static_range(STEPS):
        active = lo_b < hi_b
        mid = (lo_b + hi_b + 1) // 2
        o_mid = tl.load(off_ptr + mid, mask=active, other=0)
        go_up = o_mid <= rows
        lo_b = tl.where(active & go_up, mid, lo_b)
        hi_b = tl.where(active & (o_mid > rows), mid - 1, hi_b)
    has_b = lo_b < B                                                               # B == 0: none
    start = tl.load(off_ptr + lo_b, mask=has_b, other=0)
    end = tl.load(off_ptr + lo_b + 1, mask=has_b, other=0)
    start = tl.minimum(tl.maximum(start, 0), T)                                    # never trusted
    end = tl.minimum(tl.maximum(end, start), T)
    valid = (rows >= start) & (rows < end)       # false for padding rows and rows past T
    start = tl.where(valid, start, T)
    end = tl.where(valid, end, 0)
    k_lo = tl.min(start, axis=0) // BLOCK_N * BLOCK_N
    k_hi = tl.max(end, axis=0)

    q_off = rows[:, None] * row_stride + h * Dh + offs_d[None, :]
    q = tl.load(qkv_ptr + q_off, mask=valid[:, None] & d_mask[None, :], other=0.0)   # [BLOCK_M, BLOCK_D]
    k_base = qkv_ptr + HD + h * Dh
    v_base = qkv_ptr + 2 * HD + h * Dh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for s0 in range(k_lo, k_hi, BLOCK_N):
        keys = s0 + tl.arange(0, BLOCK_N).to(tl.int64)
        k_mask = (keys >= 0) & (keys < k_hi)
        k = tl.load(k_base + keys[None, :] * row_stride + offs_d[:, None],
                    mask=d_mask[:, None] & k_mask[None, :], other=0.0)               # [BLOCK_D, BLOCK_N]
        qk = mma(q, k, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), UPCAST) * qk_scale
        visible = (keys[None, :] >= start[:, None]) & (keys[None, :] < end[:, None])
        qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # a row with no key (yet)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(qk - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + keys[:, None] * row_stride + offs_d[None, :],
                    mask=k_mask[:, None] & d_mask[None, :], other=0.0)               # [BLOCK_N, BLOCK_D]
        acc = mma(cast_rtne(p, qkv_ptr.dtype.element_ty), v, acc * alpha[:, None], UPCAST)
        m_i = m_new
    l_i = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_i[:, None]                       # rows with no key: acc = 0, so zeros
    o_off = rows[:, None] * HD + h * Dh + offs_d[None, :]
    tl.store(out_ptr + o_off, to_out(o, out_ptr), mask=(rows[:, None] < T) & d_mask[None, :])


def attention_varlen(qkv: torch.Tensor, offsets: torch.Tensor, out: torch.Tensor, num_heads: int, scale: float,
                     status: torch.Tensor | None = None, check_offsets: bool = True) -> None:
    """Bidirectional attention of packed sentences into ``out``, as
    ``yirage.ir.ops.attention_varlen_reference``.

    ``out[t, h*Dh:(h+1)*Dh] = softmax_j(scale * q[t, h] . k[j, h]) @ v[j, h]`` over the rows j
    of t's sentence ``offsets[b] <= j < offsets[b + 1]``; zeros for rows ``t >= offsets[B]``.

    Args:
        qkv: ``[T, 3 * H * Dh]`` float32/float16/bfloat16, contiguous: per row the H q heads,
            then the H k heads, then the H v heads, Dh each (any Dh >= 1).
        offsets: int64 ``[B + 1]`` on qkv's device (B >= 0): the first row of each sentence,
            then the end. Must start at 0, never decrease and end at most at T (empty
            sentences are allowed). Sentence lengths are not limited (the kernel streams keys).
        out: ``[T, H * Dh]`` of qkv's dtype, contiguous, not overlapping qkv. Written only
            (every row, padding included).
        num_heads: H, a positive int dividing ``qkv.shape[1] / 3``.
        scale: the softmax scale (usually ``Dh ** -0.5``), finite.
        status: None, or an int64 ``(4,)`` tensor on the device, zero on entry: bad offsets set
            it to ``[1, offsets[i], offsets[i - 1] (0 for i = 0), T + 1]`` for the first bad i
            (checked on the device, unless already flagged). Without it bad offsets still never
            make the kernel access memory outside qkv and out.
        check_offsets: validate the offsets on the host before the launch (a device-to-host copy
            of B + 1 values, i.e. a sync on a GPU; such a launch cannot be captured in a CUDA
            graph). False skips it: no host sync, the grid depends only on T and H.

    Memory traffic: per (tile of BLOCK_M rows, head) q once and the k, v rows from its first
    row's sentence start to its last row's sentence end; out written once. Nothing allocated.

    Raises:
        GraphError (a YirageError and a ValueError): wrong shapes, dtypes, devices, layouts,
            ``num_heads``, ``scale`` or ``status``.
        IndexOutOfRangeError (a YirageError): with ``check_offsets``, offsets that do not start
            at 0, decrease or exceed T; nothing is launched.
    """
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads <= 0:
        raise GraphError(f"attention_varlen: num_heads must be a positive int, got {num_heads!r}")
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 2 or qkv.shape[1] % (3 * num_heads):
        got = tuple(qkv.shape) if isinstance(qkv, torch.Tensor) else type(qkv).__name__
        raise GraphError(f"attention_varlen: qkv must be [T, 3 * H * Dh] with H = num_heads = {num_heads}, got {got}")
    if qkv.dtype not in _FLOATS:
        raise GraphError(f"attention_varlen: qkv must be float32/float16/bfloat16, got {qkv.dtype}")
    if not isinstance(offsets, torch.Tensor) or offsets.dtype != torch.int64 or offsets.dim() != 1 \
            or offsets.numel() < 1:
        got = f"{offsets.dtype} {tuple(offsets.shape)}" if isinstance(offsets, torch.Tensor) else type(offsets).__name__
        raise GraphError(f"attention_varlen: offsets must be int64 [B + 1] (the first row of each sentence, "
                         f"then the end), got {got}")
    T, three_hd = qkv.shape
    HD = three_hd // 3
    Dh = HD // num_heads
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (T, HD) or out.dtype != qkv.dtype:
        got = f"{out.dtype} {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise GraphError(f"attention_varlen: out must be {qkv.dtype} [{T}, {HD}], got {got}")
    for name, t in (("qkv", qkv), ("offsets", offsets), ("out", out)):
        if not t.is_contiguous():
            raise GraphError(f"attention_varlen: {name} must be contiguous (got strides {tuple(t.stride())})")
    devices = {qkv.device, offsets.device, out.device}
    if len(devices) > 1:
        raise GraphError(f"attention_varlen: qkv, offsets and out are on different devices: "
                         f"{sorted(map(str, devices))}")
    if out.numel() and qkv.numel():
        o0, o1 = out.data_ptr(), out.data_ptr() + out.numel() * out.element_size()
        q0, q1 = qkv.data_ptr(), qkv.data_ptr() + qkv.numel() * qkv.element_size()
        if o0 < q1 and q0 < o1:
            raise GraphError("attention_varlen: out must not overlap qkv")
    try:
        scale = float(scale)
    except (TypeError, ValueError):
        raise GraphError(f"attention_varlen: scale must be a real number, got {scale!r}") from None
    if not math.isfinite(scale):
        raise GraphError(f"attention_varlen: scale must be finite, got {scale}")
    try:
        status_ptr, has_status = status_arg("attention_varlen", status, offsets)
    except ValueError as error:
        raise GraphError(str(error)) from None
    if check_offsets:
        from ...ir.ops import check_offsets as check  # IndexOutOfRangeError, the reference's message
        check([int(o) for o in offsets.tolist()], T)
    if T == 0 or HD == 0:
        return
    if offsets.numel() == 2:
        # One sentence (B = 1) computed wrong on an H100 (Triton 3.6, 2026-11-26; cause not
        # established: B = 1 is the only case where Triton specializes B as a constant and the
        # search takes one step). An empty sentence at the end is the same attention and takes
        # the B = 2 path that passed there; a device op, so no host sync and capturable.
        offsets = torch.cat([offsets, offsets[1:]])
    B = offsets.numel() - 1
    STEPS = max(1, (max(B, 1) - 1).bit_length() + 1)   # binary search over B candidates
    BLOCK_B = min(triton.next_power_of_2(B + 1), 1024)
    BLOCK_D = max(16, triton.next_power_of_2(Dh))
    grid = lambda META: (triton.cdiv(T, META["BLOCK_M"]), num_heads)  # noqa: E731
    _varlen_kernel[grid](qkv, offsets, out, status_ptr, scale * _LOG2E, T, pow2_bucket(T), B, num_heads, Dh,
                         STEPS=STEPS, UPCAST=dot_upcast(qkv), HAS_STATUS=has_status, BLOCK_B=BLOCK_B,
                         BLOCK_D=BLOCK_D)
