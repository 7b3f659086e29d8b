"""Tensor element types of the kernel-graph IR.

Plain types map 1:1 to torch dtypes. Block-quantized types (``q4_1``, ``q8_0``) follow
the GGML/GGUF block formats (llama.cpp ``ggml-common.h``): a tensor of logical shape
``(..., K)`` is stored as ``uint8`` of shape ``(..., K // 32 * block_bytes)``.

- ``q8_0``: blocks of 32 weights: fp16 scale ``d`` then 32 int8 ``q``; w = d * q.
- ``q4_1``: blocks of 32 weights: fp16 ``d``, fp16 ``m``, 16 bytes of nibbles
  (low nibbles are weights 0..15, high nibbles 16..31); w = d * q + m.

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
    q8_0 = "q8_0"
    q4_1 = "q4_1"

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
    DType.q8_0: torch.uint8,
    DType.q4_1: torch.uint8,
}
_BLOCK = {DType.q8_0: (32, 34), DType.q4_1: (32, 20)}

float32, float16, bfloat16 = DType.float32, DType.float16, DType.bfloat16
int32, int64, q8_0, q4_1 = DType.int32, DType.int64, DType.q8_0, DType.q4_1


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
