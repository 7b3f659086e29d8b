"""WebGPU library kernel for ``embedding`` over a GGUF block-quantized table: q4_0, q4_1, q8_0,
q4_K, q5_K, q6_K, q5_0, q5_1, q2_K and q3_K.

The table stays in its block storage on the device (the graph input's ``uint8`` bytes,
``DType.storage_shape`` of ``w_shape`` [V, H]); only the rows the ids name are decoded, in
registers, by ``qblocks.wgsl`` (the decoders ``quant.py``'s quantized ``linear`` uses, put in
front of ``qembedding.wgsl``), computing what ``ir.ops._embedding_ref`` does: the rows of the
table decoded as gguf-py decodes it, float32.

The ids (int64 or int32) are checked first by ``ops.check_indices`` (``index_check.wgsl``): an
id outside ``[0, V)`` is recorded in the op's status slot as ``[1, id, 0, V]`` (the executor
raises ``IndexOutOfRangeError``) and the gather never reads through it.

Other quantized types (q5_0, q5_1, q2_K, q3_K, IQ types) and the CPU's row-group layouts
(q8_0r16, q4_1r16) are refused by ``supports`` and keep running as the torch reference on the
host. Float tables are ``ops.py``'s ``embedding``.

Buffers are bound whole: the shader adds the ids' word offset, the table's byte offset and the
output's element offset (``u32`` parameters). When ``out`` lies in an input's buffer the inputs
are bound writable too (``{{IN_ACCESS}}``); an ``out`` overlapping an input's bytes is refused
(YirageError).

This module may import the runtime, ir, dtypes and errors layers and the WebGPU backend's
library, ops and quant modules; it must never import the front end or another backend.
"""
from __future__ import annotations

from typing import Callable

import torch

from ...dtypes import DType
from ...errors import YirageError
from ...runtime import webgpu as wg
from . import ops as _ops
from .library import render
from .quant import QTYPES, block_row_bytes

Thunk = Callable[[], None]

_NT = 256   # qembedding.wgsl's NT


def supports(node, graph) -> bool:
    """An ``embedding`` node with int64 or int32 ids, a table of a format in ``QTYPES`` (the
    ``w_dtype`` attr, [V, H] in ``w_shape``, H a multiple of the format's block) and a float32
    output. Never raises; False for any other node."""
    try:
        attrs = node.attrs
        if node.op != "embedding" or len(node.inputs) != 2 or not attrs.get("w_dtype"):
            return False
        qtype = DType(attrs["w_dtype"])
        if qtype not in QTYPES or len(attrs.get("w_shape", ())) != 2:
            return False
        ids, table = (graph.tensors[i] for i in node.inputs)
        V, H = (int(v) for v in attrs["w_shape"])
        return (ids.dtype in (DType.int64, DType.int32) and table.dtype == qtype
                and tuple(table.shape) == (V, H) and H % qtype.block[0] == 0
                and graph.tensors[node.output].dtype == DType.float32)
    except Exception:  # noqa: BLE001 - a malformed node is simply not ours
        return False


def bind(node, graph, args: list[wg.DeviceTensor], out: wg.DeviceTensor,
         status: wg.DeviceTensor | None) -> Thunk:
    """A thunk recording ``out[..., :] = dequantize(table)[ids[...], :]`` for a node that
    ``supports`` accepts.

    Args:
        args: [ids, table]: ids int64 or int32 [...] (T of them), table the [V, H] table's block
            storage (uint8, ``DType.storage_shape``) of type ``w_dtype``.
        out: float32 [..., H] (T x H elements).
        status: the op's int64 [4] status slot: an id outside [0, V) is recorded as
            [1, id, 0, V] and never read through; None: a private slot (violations skipped,
            unreported).

    Raises YirageError for a format without a kernel here, other dtypes, shapes that disagree,
    an output overlapping an input, or sizes past 2^32."""
    ids, table = args
    qtype = DType(node.attrs.get("w_dtype") or "float32")
    if qtype not in QTYPES:
        raise YirageError(f"webgpu quantized embedding: no kernel for a {qtype.value} table")
    if table.dtype != torch.uint8:
        raise YirageError(f"webgpu quantized embedding: the table must be its uint8 block storage, got {table.dtype}")
    if out.dtype != torch.float32:
        raise YirageError(f"webgpu quantized embedding: float32 output only, got {out.dtype}")
    V, H = (int(v) for v in node.attrs["w_shape"])
    row_bytes = block_row_bytes(qtype, V, H, table, "webgpu quantized embedding", "table")
    if table.offset + table.numel() >= 2 ** 32:
        raise YirageError("webgpu quantized embedding: the table's bytes pass 2^32")
    T = ids.numel()
    if out.numel() != T * H:
        raise YirageError(f"webgpu quantized embedding: out {tuple(out.shape)} must hold {T} x {H} elements")
    status = _ops._status_slot(status)
    ids_off, wide = _ops._words(ids)
    access = _ops._access("quantized embedding", [ids, table], [out])
    if T * H == 0:
        return _ops._seq(provider="webgpu-wgsl (empty)")
    check = _ops.check_indices(ids, T, V, status)
    n = T * H // 8
    source = render("qblocks.wgsl", QTYPE=QTYPES[qtype]) + "\n" + \
        render("qembedding.wgsl", QTYPE=QTYPES[qtype], IN_ACCESS=access)
    run = wg.Pipeline(source).bind([ids, table, out],
                                   [n, H, V, wide, ids_off, table.offset, out.offset, row_bytes],
                                   wg.grid(-(-n // _NT)))
    return _ops._seq(check, run, provider=f"webgpu-wgsl (embedding, {qtype.value} table)")


def _bind(node, graph, args, out, status=None) -> Thunk:
    # looks ``bind`` up at each call, so that tests can replace it (the backend caches OPS' pairs)
    return bind(node, graph, args, out, status)


OPS = {"embedding": (supports, _bind)}

__all__ = ["OPS", "supports", "bind"]
