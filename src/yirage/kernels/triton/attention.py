"""Causal grouped-query attention over a KV cache, full or in a sliding window (the semantics
of ``yirage.ir.ops.attention_reference``).

Sliding window ``W >= 1``: the query at absolute position ``p`` attends keys ``p - W < j <= p``
(transformers' ``masking_utils.sliding_window_causal_mask_function``); ``W = 0`` is full
causal. The host passes the kernels ``WINDOW = W`` if ``0 < W < max_seq`` else ``max_seq``,
which every query (``p < max_seq``) reads as full causal, so the kernels have one rule:
``j > p - WINDOW``.

Every call first copies this step's k, v into the caches at rows ``start_pos .. start_pos+T-1``
(a small kernel; the attention kernels then read keys only from the caches), then:

- T == 1 (decode): flash-decoding (Dao, Haziza, Massa, Sizov 2023, "Flash-Decoding for
  long-context inference"). The cache length is cut into fixed chunks; one program per
  (kv head, chunk) handles all query heads of the GQA group at once (K/V read once per
  group), writing a partial max, sum and unnormalised value vector to a workspace; a reduce
  kernel per query head rescales and combines the partials. The grid is fixed by ``max_seq``
  (chunks past the current length, or before the window's first key, do no work and are
  ignored by the reduce), so with the position in a device tensor the launch can be captured
  in a CUDA graph.
- T > 1 (prefill, also chunked prefill at ``start_pos > 0``): FlashAttention forward
  (Dao et al. 2022; Dao 2023 FlashAttention-2 loop order): one program per (query tile,
  query head) streams key tiles with an online softmax and the causal mask
  ``start_pos + t - WINDOW < key <= start_pos + t``, starting at the tile's first visible key;
  the kv head is ``h // (Hq // Hkv)``.

Scores and softmax are fp32 (max subtracted; exp2 with log2(e) folded into the scale);
``q @ k^T`` and ``p @ v`` use ``tl.dot`` with fp32 accumulation (IEEE products for fp32, p
rounded to q's dtype for fp16/bf16 as in FlashAttention). A float16 KV cache under float32
q, k, v: k, v are rounded to float16 as they are written, and keys and values are read back as
float32 (then everything runs as in float32).

``start_pos`` is checked on the device: every kernel computes ``ok = 0 <= start_pos <=
max_seq - T`` (int64) from the same value and masks all its cache and output accesses with it,
so a bad position touches neither cache nor ``out``; the cache-write kernel, which runs first,
reports it (no extra launch).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._common import (autotune, cast_rtne, check_tensors, dot_upcast, fp32_score_tiles, mma, pow2_bucket,
                      report_violation, status_arg, to_out)

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_LOG2E = 1.4426950408889634


@dataclass
class AttentionWorkspace:
    """Flash-decoding partials for one (Hq, Dh, max_seq) shape, allocated once at bind time.

    m, l: float32 ``[Hq, num_chunks]`` running max (log2 domain) and sum of each chunk;
    acc: float32 ``[Hq, num_chunks, Dh]`` unnormalised weighted values; chunk: keys per chunk.
    """
    m: torch.Tensor
    l: torch.Tensor
    acc: torch.Tensor
    chunk: int

    @property
    def num_chunks(self) -> int:
        """Chunks the decode grid has per kv head (``cdiv(max_seq, chunk)``)."""
        return self.m.shape[1]


def kv_dtypes_ok(q, k, v, k_cache, v_cache, out) -> bool:
    """One float dtype for all, or float16 caches with the rest float32 (a float16 KV cache:
    the kernels read keys and values in q's dtype and write k, v rounded to the caches')."""
    if q.dtype not in _FLOATS or any(t.dtype != q.dtype for t in (k, v, out)) or k_cache.dtype != v_cache.dtype:
        return False
    return k_cache.dtype == q.dtype or (q.dtype == torch.float32 and k_cache.dtype == torch.float16)


def _default_chunk(max_seq: int) -> int:
    """Keys per decode chunk: about 64 chunks over max_seq, 32 to 2048 keys each."""
    return max(32, min(2048, triton.next_power_of_2(triton.cdiv(max_seq, 64))))


def attention_workspace(q: torch.Tensor, k_cache: torch.Tensor, chunk: int | None = None) -> AttentionWorkspace:
    """Allocate the decode (T == 1) workspace for queries like ``q`` over caches like ``k_cache``.

    Args:
        q: ``[T, Hq, Dh]`` (only Hq, Dh and the device are used).
        k_cache: ``[max_seq, Hkv, Dh]``.
        chunk: keys per flash-decoding chunk (default: about max_seq / 64, at least 32).
    Returns: an :class:`AttentionWorkspace` (``Hq * num_chunks * (Dh + 2)`` float32).
    Raises: ValueError on mismatched shapes or a non-positive chunk.
    """
    if q.dim() != 3 or k_cache.dim() != 3 or q.shape[2] != k_cache.shape[2]:
        raise ValueError(f"attention_workspace: q must be [T, Hq, Dh] and k_cache [max_seq, Hkv, Dh], "
                         f"got {tuple(q.shape)} and {tuple(k_cache.shape)}")
    _, hq, dh = q.shape
    max_seq = k_cache.shape[0]
    chunk = _default_chunk(max_seq) if chunk is None else int(chunk)
    if chunk <= 0:
        raise ValueError(f"attention_workspace: chunk must be positive, got {chunk}")
    n = max(1, triton.cdiv(max_seq, chunk))
    dev = q.device
    return AttentionWorkspace(m=torch.empty(hq, n, dtype=torch.float32, device=dev),
                              l=torch.empty(hq, n, dtype=torch.float32, device=dev),
                              acc=torch.empty(hq, n, dh, dtype=torch.float32, device=dev), chunk=chunk)


@triton.jit
def _start_ok(pos_ptr, LAST):
    """(start_pos as int64, whether ``0 <= start_pos <= LAST``), LAST = max_seq - T."""
    p0 = tl.load(pos_ptr).to(tl.int64)
    return p0, (p0 >= 0) & (p0 <= LAST)


@triton.jit
def _cache_write_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, pos_ptr, status_ptr, ROW, LAST, BLOCK: tl.constexpr,
                        HAS_STATUS: tl.constexpr):
    """Grid (T, cdiv(ROW, BLOCK)): caches[start_pos + t] = k[t], v[t] (ROW = Hkv * Dh).

    Writes nothing unless ``0 <= start_pos <= LAST`` (= max_seq - T); program (0, 0) reports a
    bad start_pos when ``HAS_STATUS``.
    """
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    p0, ok = _start_ok(pos_ptr, LAST)
    if HAS_STATUS:
        if ((p0 < 0) | (p0 > LAST)) & (t == 0) & (tl.program_id(1) == 0):
            report_violation(status_ptr, p0, 0, LAST + 1)
    row = tl.full([BLOCK], 0, tl.int64) + tl.where(ok, p0, 0) + t
    mask = offs < tl.where(ok, ROW, 0)                # nothing when out of range
    src = t.to(tl.int64) * ROW + offs
    dst = row * ROW + offs
    k = tl.load(k_ptr + src, mask=mask).to(tl.float32)
    v = tl.load(v_ptr + src, mask=mask).to(tl.float32)
    tl.store(kc_ptr + dst, to_out(k, kc_ptr), mask=mask)
    tl.store(vc_ptr + dst, to_out(v, vc_ptr), mask=mask)


def _prune_decode(configs, args):
    """Key tiles no longer than a chunk; fp32 (CUDA-core dots) without the 128-key tiles."""
    keep = [c for c in configs if c.kwargs["BLOCK_S"] <= max(16, args["CHUNK"])]
    if args["q_ptr"].dtype == torch.float32:
        keep = [c for c in keep if c.kwargs["BLOCK_S"] <= 64]
    return keep


# The first config of each list is the one the interpreter runs; all compile for sm_90 (Dh 64
# and 128) without spills for the dtypes the prune functions let through.
@triton.jit
def attend_key_range(q, kc_base, vc_base, row, lo, hi, qk_scale, offs_d, d_mask, UPCAST: tl.constexpr,
                     BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    """The query heads ``q`` [BLOCK_G, BLOCK_D] of one KV head over its keys ``lo .. hi - 1``
    (key j's row at ``kc_base + j * row``, its value's at ``vc_base + j * row``), in tiles of
    BLOCK_S keys with the online softmax (FlashAttention's recurrence) in base 2 (``qk_scale``
    includes log2(e)). Returns float32 (row max, denominator, unnormalized output
    [BLOCK_G, BLOCK_D]); a head with no key keeps max -inf, denominator 0 and output 0."""
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for s0 in range(lo, hi, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        s_mask = offs_s < hi
        k = tl.load(kc_base + offs_s[None, :] * row + offs_d[:, None], mask=d_mask[:, None] & s_mask[None, :],
                    other=0.0).to(q.dtype)                                         # [BLOCK_D, BLOCK_S]
        qk = mma(q, k, tl.zeros([BLOCK_G, BLOCK_S], dtype=tl.float32), UPCAST) * qk_scale
        qk = tl.where(s_mask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(vc_base + offs_s[:, None] * row + offs_d[None, :], mask=s_mask[:, None] & d_mask[None, :],
                    other=0.0).to(q.dtype)                                         # [BLOCK_S, BLOCK_D]
        acc = mma(cast_rtne(p, q.dtype), v, acc * alpha[:, None], UPCAST)
        m_i = m_new
    return m_i, l_i, acc


_DECODE_CONFIGS = [
    triton.Config({"BLOCK_S": 32}, num_warps=4, num_stages=2),
    triton.Config({"BLOCK_S": 16}, num_warps=4, num_stages=2),
    triton.Config({"BLOCK_S": 64}, num_warps=4, num_stages=2),
    triton.Config({"BLOCK_S": 64}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_S": 32}, num_warps=8, num_stages=2),
    triton.Config({"BLOCK_S": 128}, num_warps=4, num_stages=2),
    triton.Config({"BLOCK_S": 128}, num_warps=8, num_stages=3),
]


@autotune(configs=_DECODE_CONFIGS, key=["Dh", "G", "CHUNK", "NCH"], prune=_prune_decode)
@triton.jit
def _decode_partial_kernel(q_ptr, kc_ptr, vc_ptr, pos_ptr, m_ptr, l_ptr, acc_ptr, qk_scale,
                           Hkv, G, Dh, max_seq, CHUNK, NCH, WINDOW,
                           UPCAST: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                           BLOCK_S: tl.constexpr):
    """Grid (Hkv, NCH): partial softmax stats of the G query heads of one kv head over the
    part of one chunk inside the window (keys start_pos - WINDOW < j <= start_pos)."""
    kvh = tl.program_id(0)
    c = tl.program_id(1)
    p0, ok = _start_ok(pos_ptr, max_seq - 1)
    L = tl.where(ok, p0 + 1, 0)                      # keys .. start_pos; none if out of range
    first = tl.maximum(L - WINDOW, 0)                # first key in the window
    c_lo = c.to(tl.int64) * CHUNK
    lo = tl.maximum(c_lo, first)
    hi = tl.minimum(c_lo + CHUNK, L)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < G
    d_mask = offs_d < Dh
    h = kvh * G + offs_g                             # query heads of this group
    q = tl.load(q_ptr + h[:, None] * Dh + offs_d[None, :], mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    m_i, l_i, acc = attend_key_range(q, kc_ptr + kvh * Dh, vc_ptr + kvh * Dh, Hkv * Dh, lo, hi, qk_scale, offs_d,
                                     d_mask, UPCAST, BLOCK_G, BLOCK_D, BLOCK_S)
    ws = h.to(tl.int64) * NCH + c
    live = g_mask & (tl.full([BLOCK_G], 0, tl.int64) + lo < hi)
    tl.store(m_ptr + ws, m_i, mask=live)
    tl.store(l_ptr + ws, l_i, mask=live)
    tl.store(acc_ptr + ws[:, None] * Dh + offs_d[None, :], acc, mask=live[:, None] & d_mask[None, :])


@triton.jit
def _decode_reduce_kernel(pos_ptr, m_ptr, l_ptr, acc_ptr, out_ptr, Dh, max_seq, CHUNK, NCH, WINDOW,
                          BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr):
    """Grid (Hq,): out[0, h] = sum_c 2^(m_c - M) acc_c / sum_c 2^(m_c - M) l_c over live chunks
    (those holding a key start_pos - WINDOW < j <= start_pos).

    A start_pos outside [0, max_seq) reads no chunk and leaves out as it was.
    """
    h = tl.program_id(0).to(tl.int64)
    p0, ok = _start_ok(pos_ptr, max_seq - 1)
    L = tl.where(ok, p0 + 1, 0)
    n = tl.minimum((L + CHUNK - 1) // CHUNK, NCH)
    c_first = tl.maximum(L - WINDOW, 0) // CHUNK      # the chunk of the window's first key
    offs_c = tl.arange(0, BLOCK_C)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < Dh
    mx = tl.full([BLOCK_C], float("-inf"), tl.float32)
    for c0 in range(c_first, n, BLOCK_C):
        cm = (c0 + offs_c) < n
        mx = tl.maximum(mx, tl.load(m_ptr + h * NCH + c0 + offs_c, mask=cm, other=float("-inf")))
    top = tl.max(mx, axis=0)
    l_sum = tl.zeros([BLOCK_C], dtype=tl.float32)
    acc = tl.zeros([BLOCK_C, BLOCK_D], dtype=tl.float32)
    for c0 in range(c_first, n, BLOCK_C):
        offs = c0 + offs_c
        cm = offs < n
        w = tl.where(cm, tl.exp2(tl.load(m_ptr + h * NCH + offs, mask=cm, other=float("-inf")) - top), 0.0)
        l_sum += w * tl.load(l_ptr + h * NCH + offs, mask=cm, other=0.0)
        a = tl.load(acc_ptr + (h * NCH + offs)[:, None] * Dh + offs_d[None, :], mask=cm[:, None] & d_mask[None, :],
                    other=0.0)
        acc += w[:, None] * a
    total = tl.sum(l_sum, axis=0)
    total = tl.where(total > 0, total, 1.0)
    o = tl.sum(acc, axis=0) / total
    tl.store(out_ptr + h * Dh + offs_d, to_out(o, out_ptr), mask=offs_d < tl.where(ok, Dh, 0))


_PREFILL_CONFIGS = [
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=8, num_stages=2),
    triton.Config({"BLOCK_M": 32, "BLOCK_N": 32}, num_warps=4, num_stages=2),
    triton.Config({"BLOCK_M": 16, "BLOCK_N": 64}, num_warps=4, num_stages=2),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=2),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 32}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 128}, num_warps=8, num_stages=2),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128}, num_warps=8, num_stages=2),
]


_prune_prefill = fp32_score_tiles("q_ptr")


@autotune(configs=_PREFILL_CONFIGS, key=["T_KEY", "Dh", "G"], prune=_prune_prefill)
@triton.jit
def _prefill_kernel(q_ptr, kc_ptr, vc_ptr, pos_ptr, out_ptr, qk_scale, T, T_KEY, Hq, Hkv, G, Dh, max_seq, WINDOW,
                    UPCAST: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Grid (cdiv(T, BLOCK_M), Hq): FlashAttention forward for one query tile of one head
    (query at position p sees keys p - WINDOW < j <= p).

    A start_pos outside [0, max_seq - T] reads no cache row and leaves out as it was.
    """
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // G
    p0, ok = _start_ok(pos_ptr, max_seq - T)
    p0 = tl.where(ok, p0, 0)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < tl.where(ok, T, 0)                  # no query (no load/store) when out of range
    d_mask = offs_d < Dh
    q_off = (offs_m.to(tl.int64)[:, None] * Hq + h) * Dh + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    q_pos = p0 + offs_m                                   # absolute position of each query
    # keys this tile can see: first key of its first query's window .. p0 + its last query
    # (inside the cache when ok); the key tiles start at a multiple of BLOCK_N
    hi = tl.where(ok, tl.minimum(p0 + (pid_m + 1) * BLOCK_M, p0 + T), 0)
    lo = tl.maximum(p0 + pid_m * BLOCK_M - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
    row = Hkv * Dh
    kc_base = kc_ptr + kvh * Dh
    vc_base = vc_ptr + kvh * Dh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for s0 in range(lo, hi, BLOCK_N):
        offs_s = s0 + tl.arange(0, BLOCK_N)
        s_mask = offs_s < hi
        k = tl.load(kc_base + offs_s.to(tl.int64)[None, :] * row + offs_d[:, None],
                    mask=d_mask[:, None] & s_mask[None, :], other=0.0).to(q.dtype)  # [BLOCK_D, BLOCK_N]
        qk = mma(q, k, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), UPCAST) * qk_scale
        visible = (s_mask[None, :] & (offs_s[None, :] <= q_pos[:, None])
                   & (offs_s[None, :] > q_pos[:, None] - WINDOW))
        qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # a row with no key yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(qk - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(vc_base + offs_s.to(tl.int64)[:, None] * row + offs_d[None, :],
                    mask=s_mask[:, None] & d_mask[None, :], other=0.0).to(q.dtype)  # [BLOCK_N, BLOCK_D]
        acc = mma(cast_rtne(p, q.dtype), v, acc * alpha[:, None], UPCAST)
        m_i = m_new
    l_i = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_i[:, None]
    tl.store(out_ptr + q_off, to_out(o, out_ptr), mask=m_mask[:, None] & d_mask[None, :])


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              start_pos: torch.Tensor, out: torch.Tensor, scale: float,
              workspace: AttentionWorkspace | None = None, status: torch.Tensor | None = None,
              window: int = 0) -> None:
    """Causal GQA attention over a KV cache, as ``yirage.ir.ops.attention_reference``.

    Writes ``k_cache[p0:p0+T] = k``, ``v_cache[p0:p0+T] = v`` (p0 = ``start_pos[0]``), then
    ``out[t, h] = softmax_s(scale * q[t, h] . k_cache[s, h // (Hq // Hkv)], lo <= s <= p0 + t) @ v_cache``
    with ``lo = 0`` for ``window`` 0 and ``lo = p0 + t - window + 1`` for a sliding window.

    Args:
        q: ``[T, Hq, Dh]``; k, v: ``[T, Hkv, Dh]``; k_cache, v_cache: ``[max_seq, Hkv, Dh]``;
            all contiguous, one dtype (float32/float16/bfloat16), Hq divisible by Hkv, any Dh.
        start_pos: int64 ``(1,)`` on the device, read inside the kernels; must satisfy
            ``0 <= start_pos <= max_seq - T``. Checked on the device (the host can't see it
            without a sync): out of range, the caches are neither written nor read, the decode
            workspace is not touched, and ``out`` is left as it was.
        out: ``[T, Hq, Dh]`` of q's dtype; written only. Must not alias q.
        scale: softmax scale (usually ``Dh ** -0.5``).
        workspace: from :func:`attention_workspace` (used when T == 1); allocated here if None.
        status: None, or an int64 ``(4,)`` tensor on the device, zero on entry. An out-of-range
            start_pos sets it to ``[1, start_pos, 0, max_seq - T + 1]`` unless already flagged
            (one writer, elected by ``atomic_cas`` on ``status[0]``, in the cache-write kernel).
            Without it the check still guards every access, unreported.
        window: 0 (full causal) or ``W >= 1``: the query at position p attends keys
            ``p - W < j <= p`` (transformers' sliding-window causal mask).

    Memory traffic: writes T rows of each cache; decode reads the cache rows of the window
    (the first p0+1 when full causal) once per kv head, writes/reads ``Hq * chunks * (Dh + 2)``
    fp32 partials; prefill reads the visible cache rows (from the window's first key of each
    query tile) once per (query tile, query head). No host sync; nothing allocated when a
    workspace is given.

    Raises:
        ValueError: shape/dtype mismatches, a workspace made for other shapes, or a bad ``status``.
    """
    check_tensors("attention", q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, start_pos=start_pos, out=out,
                  workspace=workspace.acc if workspace is not None else None)
    status_ptr, has_status = status_arg("attention", status, start_pos)
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"attention: q must be [T, Hq, Dh] and k, v [T, Hkv, Dh], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    T, hq, dh = q.shape
    hkv = k.shape[1]
    if k.shape[0] != T or k.shape[2] != dh or hkv == 0 or hq % hkv:
        raise ValueError(f"attention: k/v {tuple(k.shape)} must have q's T and Dh {T, dh} and Hq divisible by Hkv")
    if k_cache.shape != v_cache.shape or k_cache.dim() != 3 or tuple(k_cache.shape[1:]) != (hkv, dh):
        raise ValueError(f"attention: caches must both be [max_seq, {hkv}, {dh}], got {tuple(k_cache.shape)} "
                         f"and {tuple(v_cache.shape)}")
    if not kv_dtypes_ok(q, k, v, k_cache, v_cache, out):
        raise ValueError(f"attention: q, k, v, caches and out must share one float dtype (or the caches be "
                         f"float16 with float32 q, k, v, out), got {sorted({str(t.dtype) for t in (q, k, v, k_cache, v_cache, out)})}")
    if start_pos.shape != (1,) or start_pos.dtype != torch.int64:
        raise ValueError(f"attention: start_pos must be an int64 tensor of shape (1,), got {start_pos.dtype} "
                         f"{tuple(start_pos.shape)}")
    if out.shape != q.shape:
        raise ValueError(f"attention: out must be {tuple(q.shape)}, got {tuple(out.shape)}")
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"attention: window must be 0 or a positive int, got {window!r}")
    if T == 0 or hq == 0 or dh == 0:
        return
    max_seq = k_cache.shape[0]
    wk = window if 0 < window < max_seq else max_seq   # 0 or >= max_seq: every key j <= p is in it
    G = hq // hkv
    qk_scale = float(scale) * _LOG2E
    BLOCK_D = max(16, triton.next_power_of_2(dh))
    upcast = dot_upcast(q)

    if T == 1:  # the workspace is checked before the cache is written: a bad call changes nothing
        ws = workspace if workspace is not None else attention_workspace(q, k_cache)
        n = triton.cdiv(max_seq, ws.chunk)
        if tuple(ws.acc.shape) != (hq, n, dh) or ws.m.shape != (hq, n) or ws.l.shape != (hq, n):
            raise ValueError(f"attention: workspace {tuple(ws.acc.shape)} doesn't fit Hq={hq}, Dh={dh}, "
                             f"max_seq={max_seq} (chunk {ws.chunk})")

    row = hkv * dh
    wblock = min(triton.next_power_of_2(row), 4096)
    _cache_write_kernel[(T, triton.cdiv(row, wblock))](k, v, k_cache, v_cache, start_pos, status_ptr, row,
                                                       max_seq - T, BLOCK=wblock, HAS_STATUS=has_status,
                                                       num_warps=4)
    if T == 1:
        BLOCK_G = max(16, triton.next_power_of_2(G))
        _decode_partial_kernel[(hkv, n)](q, k_cache, v_cache, start_pos, ws.m, ws.l, ws.acc, qk_scale,
                                         hkv, G, dh, max_seq, ws.chunk, n, wk,
                                         UPCAST=upcast, BLOCK_G=BLOCK_G, BLOCK_D=BLOCK_D)
        BLOCK_C = min(triton.next_power_of_2(n), max(1, 8192 // BLOCK_D))
        _decode_reduce_kernel[(hq,)](start_pos, ws.m, ws.l, ws.acc, out, dh, max_seq, ws.chunk, n, wk,
                                     BLOCK_C=BLOCK_C, BLOCK_D=BLOCK_D, num_warps=4)
    else:
        grid = lambda META: (triton.cdiv(T, META["BLOCK_M"]), hq)  # noqa: E731
        _prefill_kernel[grid](q, k_cache, v_cache, start_pos, out, qk_scale, T, pow2_bucket(T), hq, hkv, G, dh,
                              max_seq, wk, UPCAST=upcast, BLOCK_D=BLOCK_D)

