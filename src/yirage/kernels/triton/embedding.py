"""Embedding lookup ``out[t, :] = table[ids[t], :]`` for float or GGUF block-quantized tables.

Quantized rows (q8_0, q4_1; llama.cpp ``ggml-common.h`` layouts, see ``_common``) are decoded
to float32 on the fly; float rows are copied in the table's dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import QK, W_FLOAT, check_tensors, dequant_block_tile, report_violation, status_arg, weight_type

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _embedding_kernel(ids_ptr, table_ptr, out_ptr, status_ptr, D, V, row_bytes,
                      W_TYPE: tl.constexpr, BYTES: tl.constexpr, NB: tl.constexpr, HAS_STATUS: tl.constexpr):
    """Grid (T, cdiv(D, NB * 32)): one token and NB * 32 columns of its row per program.

    An id outside ``[0, V)`` (compared in int64) makes its row zeros, nothing read from the
    table; the token's first column program reports it when ``HAS_STATUS``.
    """
    t = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1) * NB + tl.arange(0, NB)[:, None]       # [NB, 1] block of 32 columns
    j = tl.arange(0, 32)[None, :]
    col = blk * 32 + j                                            # [NB, 32]
    mask = col < D
    idx = tl.load(ids_ptr + t).to(tl.int64)
    ok = (idx >= 0) & (idx < V)
    if HAS_STATUS:
        if ((idx < 0) | (idx >= V)) & (tl.program_id(1) == 0):
            report_violation(status_ptr, idx, 0, V)
    row = tl.where(ok, idx, 0)                                    # a bad id never forms an address
    # Masks come from comparing against a limit zeroed for a bad id (not `mask & ok`: the
    # interpreter mistypes a broadcast scalar compare), the same cost on a GPU.
    if W_TYPE == 0:
        vals = tl.load(table_ptr + row * D + col, mask=col < tl.where(ok, D, 0), other=0.0)
    else:
        kb = blk[None, :, :]                                      # [1, NB, 1]
        kb_mask = kb < D // 32
        w = dequant_block_tile(table_ptr, row * row_bytes, kb < tl.where(ok, D // 32, 0), kb, kb_mask,
                               W_TYPE, BYTES)
        vals = tl.reshape(w, [NB, 32])
    tl.store(out_ptr + t * D + col, vals, mask=mask)


def embedding(ids: torch.Tensor, table: torch.Tensor, out: torch.Tensor, table_type: str,
              status: torch.Tensor | None = None) -> None:
    """Gather rows of an embedding table: ``out[t, :] = table[ids.flatten()[t], :]``.

    Args:
        ids: int32 or int64, any shape (flattened to T ids); each must lie in ``[0, V)``. Checked
            on the device (two int64 compares per program): the row of an id outside ``[0, V)``
            is written as zeros and nothing is read from the table for it.
        table: ``"float"``: ``[V, D]`` float32/float16/bfloat16. ``"q8_0"``/``"q4_1"``: uint8
            ``[V, D//32*34]`` / ``[V, D//32*20]`` GGUF blocks (llama.cpp ggml-common.h), D % 32 == 0.
        out: ``[*ids.shape, D]`` (T * D elements), contiguous; the table's dtype for "float",
            float32 for quantized tables. Written only.
        table_type: "float", "q8_0" or "q4_1".
        status: None, or an int64 ``(4,)`` tensor on the same device, zero on entry. If any id
            is out of range it is set to ``[1, id, 0, V]`` for one of the bad ids (whichever
            program wins the ``atomic_cas`` on ``status[0]``; a status already flagged is kept).
            Read it after the launch; without it bad ids are still zeroed, just unreported.

    Memory traffic: reads T ids and T table rows, writes T * D outputs.

    Raises:
        ValueError: unknown ``table_type``, wrong dtypes, shapes that don't agree, or a bad
            ``status`` tensor.
    """
    check_tensors("embedding", ids=ids, table=table, out=out)
    status_ptr, has_status = status_arg("embedding", status, ids)
    code, nbytes = weight_type(table_type)
    if ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"embedding: ids must be int32 or int64, got {ids.dtype}")
    if table.dim() != 2:
        raise ValueError(f"embedding: table must be 2-d, got {tuple(table.shape)}")
    if code == W_FLOAT:
        if table.dtype not in _FLOATS:
            raise ValueError(f"embedding: float table must be float32/float16/bfloat16, got {table.dtype}")
        D, row_bytes, out_dtype = table.shape[1], table.shape[1], table.dtype
    else:
        if table.dtype != torch.uint8 or table.shape[1] % nbytes:
            raise ValueError(f"embedding: {table_type} table must be uint8 [V, D//32*{nbytes}], "
                             f"got {table.dtype} {tuple(table.shape)}")
        row_bytes = table.shape[1]
        D, out_dtype = row_bytes // nbytes * QK, torch.float32
    T = ids.numel()
    if out.dtype != out_dtype or out.numel() != T * D or (out.dim() and out.shape[-1] != D):
        raise ValueError(f"embedding: out must hold [{T}, {D}] of {out_dtype}, got {tuple(out.shape)} {out.dtype}")
    if T == 0 or D == 0:
        return
    NB = min(triton.next_power_of_2(triton.cdiv(D, QK)), 32)  # up to 1024 columns per program
    _embedding_kernel[(T, triton.cdiv(D, NB * QK))](ids, table, out, status_ptr, D, table.shape[0], row_bytes,
                                                   W_TYPE=code, BYTES=max(nbytes, 1), NB=NB,
                                                   HAS_STATUS=has_status, num_warps=4)
