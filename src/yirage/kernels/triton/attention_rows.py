"""Attention of rows from several sequences, each over its own slot of a KV cache (the IR's
``attention_rows``: the continuous-batching step, where decode rows and prefill chunks of many
sequences run in one batch), as ``yirage.ir.ops.attention_rows_reference``.

Three launches, in stream order, so that nothing is written when any index is bad and every
row sees the keys the step's other rows write:

1. one program checks every row's slot and position (``[0, num_slots)``, ``[0, max_seq)``) and
   records the first violation in ``status`` (a device tensor; no host sync);
2. one program per KV head writes each row's k, v into ``cache[slot, position]``, rows in order
   (a later row naming the same place wins, as in the reference), unless a violation was found;
3. program ``(t, kv head)`` attends row t's query heads of that KV head (GQA) over the keys
   ``j <= position`` of its slot (``j > position - window`` with a window), with the decode
   kernel's key loop (attention.py ``attend_key_range``: ``tl.dot`` tiles of the query heads
   padded to 16, online softmax in float32), unless a violation was found (out untouched).

Not yet run on a GPU (tested under ``TRITON_INTERPRET=1``).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._common import check_tensors, dot_upcast, report_violation, status_arg, to_out
from .attention import attend_key_range, kv_dtypes_ok


@triton.jit
def _check_rows_kernel(slots_ptr, pos_ptr, status_ptr, T, NUM_SLOTS, MAX_SEQ, HAS_STATUS: tl.constexpr):
    for t in range(0, T):
        s = tl.load(slots_ptr + t).to(tl.int64)
        p = tl.load(pos_ptr + t).to(tl.int64)
        if HAS_STATUS:
            if (s < 0) | (s >= NUM_SLOTS):
                report_violation(status_ptr, s, 0, NUM_SLOTS)
            if (p < 0) | (p >= MAX_SEQ):
                report_violation(status_ptr, p, 0, MAX_SEQ)


@triton.jit
def _write_rows_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slots_ptr, pos_ptr, status_ptr, T, HKV, D, NUM_SLOTS, MAX_SEQ,
                       BLOCK_D: tl.constexpr):
    h = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    if tl.load(status_ptr) == 0:
        for t in range(0, T):
            s = tl.load(slots_ptr + t).to(tl.int64)
            p = tl.load(pos_ptr + t).to(tl.int64)
            ok = (s >= 0) & (s < NUM_SLOTS) & (p >= 0) & (p < MAX_SEQ)   # guards the stores without a status
            src = (t * HKV + h) * D + offs_d
            dst = ((tl.where(ok, s, 0) * MAX_SEQ + tl.where(ok, p, 0)) * HKV + h) * D + offs_d
            m = d_mask & ((offs_d * 0 + ok.to(tl.int32)) > 0)
            tl.store(kc_ptr + dst, tl.load(k_ptr + src, mask=d_mask), mask=m)
            tl.store(vc_ptr + dst, tl.load(v_ptr + src, mask=d_mask), mask=m)


@triton.jit
def _attend_rows_kernel(q_ptr, kc_ptr, vc_ptr, slots_ptr, pos_ptr, out_ptr, status_ptr, qk_scale, HQ, HKV, G, D,
                        NUM_SLOTS, MAX_SEQ, WINDOW, UPCAST: tl.constexpr, BLOCK_G: tl.constexpr,
                        BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    s = tl.load(slots_ptr + t).to(tl.int64)
    p = tl.load(pos_ptr + t).to(tl.int64)
    ok = (tl.load(status_ptr) == 0) & (s >= 0) & (s < NUM_SLOTS) & (p >= 0) & (p < MAX_SEQ)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask, d_mask = offs_g < G, offs_d < D
    heads = kvh * G + offs_g
    q_off = (t * HQ + heads)[:, None] * D + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    lo = tl.where(WINDOW > 0, tl.maximum(p - WINDOW + 1, 0), 0)
    hi = tl.where(ok, p + 1, 0)                         # no key (no read) for a bad row
    base = (tl.where(ok, s, 0) * MAX_SEQ * HKV + kvh) * D
    _, l_i, acc = attend_key_range(q, kc_ptr + base, vc_ptr + base, HKV * D, lo, hi, qk_scale, offs_d, d_mask,
                                   UPCAST, BLOCK_G, BLOCK_D, BLOCK_N)
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    ok_row = (offs_g * 0 + ok.to(tl.int32)) > 0
    tl.store(out_ptr + q_off, to_out(o, out_ptr), mask=(g_mask & ok_row)[:, None] & d_mask[None, :])


def attention_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slots: torch.Tensor, positions: torch.Tensor, out: torch.Tensor, scale: float, window: int = 0,
                   status: torch.Tensor | None = None) -> None:
    """Writes each row's k, v into its slot at its position, then ``out[t]`` = causal GQA
    attention of ``q[t]`` over its slot's keys ``j <= positions[t]`` (and ``j > positions[t] -
    window`` for ``window >= 1``), as ``yirage.ir.ops.attention_rows_reference``.

    Args:
        q: [T, Hq, Dh]; k, v: [T, Hkv, Dh]; k_cache, v_cache: [num_slots, max_seq, Hkv, Dh]; one
            float dtype, or float16 caches with float32 q, k, v (a float16 KV cache: k, v rounded
            as they are written); contiguous, Hkv dividing Hq.
        slots, positions: int64 [T] on the device, read inside the kernels. A slot outside
            [0, num_slots) or a position outside [0, max_seq) anywhere: nothing is written (caches
            and out as they were) and, with ``status``, the first one in row order is recorded
            there as ``[1, value, 0, bound]``.
        out: [T, Hq, Dh] of q's dtype.
        scale: softmax scale; window: 0 (full causal) or the sliding window's length.
        status: None, or an int64 (4,) tensor on the device, zero on entry.

    Raises ValueError for shapes or dtypes that do not agree, non-contiguous tensors, or a bad
    ``status``.
    """
    check_tensors("attention_rows", q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, slots=slots,
                  positions=positions, out=out)
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    if (k.shape != v.shape or k.shape[0] != T or k.shape[2] != D or Hq % Hkv or k_cache.shape != v_cache.shape
            or k_cache.dim() != 4 or tuple(k_cache.shape[2:]) != (Hkv, D) or out.shape != q.shape
            or not kv_dtypes_ok(q, k, v, k_cache, v_cache, out)
            or slots.shape != (T,) or positions.shape != (T,)
            or slots.dtype != torch.int64 or positions.dtype != torch.int64):
        raise ValueError(f"attention_rows: needs q [T, Hq, Dh], k/v [T, Hkv, Dh], caches [slots, max_seq, Hkv, Dh] "
                         f"of one float dtype (or float16 caches with the rest float32) and int64 slots/positions "
                         f"[T]; got q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)}, "
                         f"caches {tuple(k_cache.shape)}")
    if T == 0:
        return
    status_ptr, has_status = status_arg("attention_rows", status, slots)
    if not has_status:   # the later launches read a status: a zeroed one of our own
        status_ptr = torch.zeros(4, dtype=torch.int64, device=q.device)
    n_slots, max_seq = k_cache.shape[:2]
    block_d = triton.next_power_of_2(D)
    _check_rows_kernel[(1,)](slots, positions, status_ptr, T, n_slots, max_seq, HAS_STATUS=True)
    _write_rows_kernel[(Hkv,)](k, v, k_cache, v_cache, slots, positions, status_ptr, T, Hkv, D, n_slots, max_seq,
                               BLOCK_D=block_d)
    G = Hq // Hkv
    _attend_rows_kernel[(T, Hkv)](q, k_cache, v_cache, slots, positions, out, status_ptr,
                                  float(scale) * math.log2(math.e), Hq, Hkv, G, D, n_slots, max_seq, int(window),
                                  UPCAST=dot_upcast(q), BLOCK_G=max(16, triton.next_power_of_2(G)),   # tl.dot tiles
                                  BLOCK_D=max(16, block_d), BLOCK_N=32)
