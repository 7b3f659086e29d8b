"""Tensor element types of the kernel-graph IR.

Plain types map 1:1 to torch dtypes. Block-quantized types follow the GGML/GGUF block
formats (llama.cpp ``ggml/src/ggml-common.h``; values as gguf-py's ``gguf.quants.dequantize``):
a tensor of logical shape ``(..., K)`` is stored as ``uint8`` of shape
``(..., K // weights_per_block * block_bytes)``, K a whole number of blocks.

- ``q8_0`` (32 weights, 34 bytes): fp16 scale ``d`` then 32 int8 ``q``; w = d * q.
- ``q4_1`` (32, 20): fp16 ``d``, fp16 ``m``, 16 bytes of nibbles (low nibbles are weights
  0..15, high nibbles 16..31); w = d * q + m.
- ``q4_1r16`` (32, 20), ``q8_0r16`` (32, 34): q4_1's / q8_0's blocks with the rows reordered in
  groups of 16, for the CPU's decode GEMVs (``kernels/cpu/row_groups.h`` gives the layout;
  ``ir.ops.to_row_groups`` makes it). Rows a multiple of 16; q4_1r16 is a ``linear`` weight only,
  q8_0r16 also an embedding table (a tied LM head's).
- ``q4_0`` (32, 18): ``d``, nibbles as q4_1; w = d * (q - 8).
- ``q5_0`` (32, 22): ``d``, 32 bits ``qh`` (the fifth bit of weight j is bit j), nibbles; w = d * (q - 16).
- ``q5_1`` (32, 24): ``d``, ``m``, ``qh``, nibbles; w = d * q + m.
- K-quants, super-blocks of 256 weights with 6- or 4-bit sub-block scales: ``q2_k`` (84
  bytes), ``q3_k`` (110), ``q4_k`` (144), ``q5_k`` (176), ``q6_k`` (210).
- Non-linear 4-bit (a nibble indexes the 16-entry table ``kvalues_iq4nl``, -127 .. 113):
  ``iq4_nl`` (32, 18): ``d``, nibbles as q4_0; w = d * kv[q]. ``iq4_xs`` (256, 136): ``d``,
  uint16 ``scales_h``, 4 bytes ``scales_l``, 128 bytes of nibbles; 8 sub-blocks of 32 with
  6-bit scales ``ls`` (low 4 bits in ``scales_l``, high 2 in ``scales_h``); w = d * (ls - 32) * kv[q].

This module must never depend on a backend.
"""
from __future__ import annotations

import enum

import torch


class DType(enum.Enum):
    """Element type of an IR tensor. ``.value`` is the name used in JSON."""

    float32 = "float32"
    float16 = "float16"
    bfloat16 = "bfloat16"
    int32 = "int32"
    int64 = "int64"
    int8 = "int8"  # per-channel int8 weights (linear_w8a8)
    bool = "bool"  # torch.bool storage (one byte, 0 or 1): comparisons, masks, where's condition
    q8_0 = "q8_0"
    q4_1 = "q4_1"
    q4_1r16 = "q4_1r16"  # q4_1 rows in groups of 16 (a CPU kernel layout, see the module docstring)
    q8_0r16 = "q8_0r16"  # q8_0 rows in groups of 16
    q4_0 = "q4_0"
    q5_0 = "q5_0"
    q5_1 = "q5_1"
    q2_k = "q2_k"
    q3_k = "q3_k"
    q4_k = "q4_k"
    q5_k = "q5_k"
    q6_k = "q6_k"
    iq4_nl = "iq4_nl"
    iq4_xs = "iq4_xs"

    @property
    def is_quantized(self) -> bool:
        return self in _BLOCK

    @property
    def is_float(self) -> bool:
        return self in (DType.float32, DType.float16, DType.bfloat16)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype that holds this type's storage (``uint8`` for quantized types)."""
        return _TORCH[self]

    @property
    def block(self) -> tuple[int, int]:
        """(weights per block, bytes per block) of a quantized type."""
        if self not in _BLOCK:
            raise ValueError(f"{self.value} is not a block-quantized type")
        return _BLOCK[self]

    @property
    def scale_offsets(self) -> tuple[int, ...]:
        """Byte offsets in a block of its fp16 scales (``d``, and ``m`` / ``dmin`` where the
        format has one): the only bytes of a block that can hold inf or NaN."""
        if self not in _SCALES:
            raise ValueError(f"{self.value} is not a block-quantized type")
        return _SCALES[self]

    def storage_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Shape of the torch storage that holds a tensor of logical ``shape``."""
        if not self.is_quantized:
            return tuple(shape)
        per, nbytes = self.block
        if not shape or shape[-1] % per:
            raise ValueError(f"{self.value} needs a last dim divisible by {per}, got shape {tuple(shape)}")
        return (*shape[:-1], shape[-1] // per * nbytes)


_TORCH = {
    DType.float32: torch.float32,
    DType.float16: torch.float16,
    DType.bfloat16: torch.bfloat16,
    DType.int32: torch.int32,
    DType.int64: torch.int64,
    DType.int8: torch.int8,
    DType.bool: torch.bool,
}
#: (weights per block, bytes per block) of each block-quantized type (llama.cpp ggml-common.h)
_BLOCK = {DType.q8_0: (32, 34), DType.q4_1: (32, 20), DType.q4_1r16: (32, 20), DType.q8_0r16: (32, 34),
          DType.q4_0: (32, 18), DType.q5_0: (32, 22), DType.q5_1: (32, 24), DType.q2_k: (256, 84), DType.q3_k: (256, 110), DType.q4_k: (256, 144),
          DType.q5_k: (256, 176), DType.q6_k: (256, 210), DType.iq4_nl: (32, 18), DType.iq4_xs: (256, 136)}
_TORCH.update(dict.fromkeys(_BLOCK, torch.uint8))
_SCALES = {DType.q8_0: (0,), DType.q4_1: (0, 2), DType.q4_0: (0,), DType.q5_0: (0,), DType.q5_1: (0, 2),
           DType.q2_k: (80, 82), DType.q3_k: (108,), DType.q4_k: (0, 2), DType.q5_k: (0, 2), DType.q6_k: (208,),
           DType.iq4_nl: (0,), DType.iq4_xs: (0,)}

float32, float16, bfloat16 = DType.float32, DType.float16, DType.bfloat16
int32, int64, int8, q8_0, q4_1 = DType.int32, DType.int64, DType.int8, DType.q8_0, DType.q4_1
bool_ = DType.bool  # ``yr.bool_`` (numpy's spelling: ``bool`` is Python's); ``yr.DType.bool`` too
q4_0, q5_0, q5_1 = DType.q4_0, DType.q5_0, DType.q5_1
q2_k, q3_k, q4_k, q5_k, q6_k = DType.q2_k, DType.q3_k, DType.q4_k, DType.q5_k, DType.q6_k
iq4_nl, iq4_xs = DType.iq4_nl, DType.iq4_xs


def as_dtype(x: "DType | str | torch.dtype") -> DType:
    """Turn a DType, its name, or a plain torch dtype into a DType; ValueError otherwise."""
    if isinstance(x, DType):
        return x
    if isinstance(x, str):
        try:
            return DType(x)
        except ValueError:
            pass
    if isinstance(x, torch.dtype):
        for d, t in _TORCH.items():
            if t == x and not d.is_quantized:
                return d
    raise ValueError(f"unknown dtype {x!r}; use one of {[d.value for d in DType]}")
