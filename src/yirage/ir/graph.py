"""The kernel-graph builder: a Mirage-compatible front end that records typed ops.

    g = yr.new_kernel_graph()
    X = g.new_input(dims=(8, 4096), dtype=yr.float32)
    W = g.new_input(dims=(4096, 4096), dtype=yr.float32)
    O = g.silu(g.matmul(g.rms_norm(X, normalized_shape=(4096,)), W))
    g.mark_output(O)

Shapes and dtypes are inferred and checked when an op is added (``ValueError`` naming the
op, the shapes and the rule). Semantics follow Mirage (python/mirage/kernel.py): ``matmul``
multiplies the last two dims and batches over the leading ones, ``reduction(x, dim)`` sums
over ``dim`` keeping it with size 1, binary ops broadcast like torch.

This module is the IR: it must never generate code, run kernels or know a backend.
``interpret`` runs the reference interpreter; compiling and calling a graph is the front
end's (yirage/kernel.py ``KNGraph``), JSON is ir/serialize.py's.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from ..dtypes import DType, as_dtype
from .interpret import interpret
from .ops import OPS, TensorType


@dataclass(eq=False)
class DTensor:
    """A tensor of a kernel graph (a value, not data). ``dims``/``shape`` and ``dtype`` are static."""

    graph: "KernelGraph"
    id: int
    type: TensorType
    name: str | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.type.shape

    dims = shape

    @property
    def dtype(self) -> DType:
        return self.type.dtype

    def __repr__(self) -> str:
        return f"DTensor(t{self.id}, shape={self.shape}, dtype={self.dtype.value})"


@dataclass
class OpNode:
    """One op: ``op`` names an entry of ``ir.ops.OPS``; inputs/output are tensor ids."""

    op: str
    inputs: list[int]
    attrs: dict = field(default_factory=dict)
    output: int = -1


class KernelGraph:
    """A DAG of ops over typed tensors, built in topological order.

    Args:
        backend: name of the backend the graph runs on when called (None: the default
            backend, see ``yr.set_backend``).
    """

    def __init__(self, backend: str | None = None):
        self.backend = backend
        self.tensors: list[TensorType] = []
        self.names: dict[int, str] = {}
        self.ops: list[OpNode] = []
        self.inputs: list[int] = []
        self.outputs: list[int] = []
        self._compiled = {}  # derived state of front ends (compiled plans); cleared on any edit

    # ---- building -------------------------------------------------------------------------
    def _new_tensor(self, ttype: TensorType, name: str | None = None) -> DTensor:
        self.tensors.append(ttype)
        tid = len(self.tensors) - 1
        if name:
            self.names[tid] = name
        self._compiled.clear()
        return DTensor(self, tid, ttype, name)

    def new_input(self, dims: Sequence[int], dtype=DType.float32, name: str | None = None) -> DTensor:
        """Declare a graph input of logical shape ``dims``.

        For block-quantized dtypes (``yr.q4_1``, ``yr.q8_0``) the tensor passed at run time
        is the raw ``uint8`` storage of shape ``dtype.storage_shape(dims)``.
        """
        dims = tuple(int(d) for d in dims)
        if any(d <= 0 for d in dims):
            raise ValueError(f"new_input: every dim must be positive, got {dims}")
        dtype = as_dtype(dtype)
        dtype.storage_shape(dims)  # validates block alignment
        t = self._new_tensor(TensorType(dims, dtype), name)
        self.inputs.append(t.id)
        return t

    def _add(self, op: str, inputs: Sequence[DTensor], **attrs) -> DTensor:
        for x in inputs:
            if not isinstance(x, DTensor) or x.graph is not self:
                raise ValueError(f"{op}: inputs must be tensors of this graph, got {x!r}")
        if OPS[op].arity >= 0 and len(inputs) != OPS[op].arity:
            raise ValueError(f"{op}: takes {OPS[op].arity} inputs, got {len(inputs)}")
        ttype = OPS[op].infer([x.type for x in inputs], attrs)
        out = self._new_tensor(ttype)
        self.ops.append(OpNode(op, [x.id for x in inputs], attrs, out.id))
        return out

    def mark_output(self, t: DTensor) -> None:
        """Make ``t`` an output: ``g(inputs)`` returns outputs in the order they were marked."""
        if not isinstance(t, DTensor) or t.graph is not self:
            raise ValueError(f"mark_output: expected a tensor of this graph, got {t!r}")
        self.outputs.append(t.id)
        self._compiled.clear()

    # elementwise
    def add(self, a, b): return self._add("add", [a, b])
    def sub(self, a, b): return self._add("sub", [a, b])
    def mul(self, a, b): return self._add("mul", [a, b])
    def div(self, a, b): return self._add("div", [a, b])
    def exp(self, x): return self._add("exp", [x])
    def sqrt(self, x): return self._add("sqrt", [x])
    def rsqrt(self, x): return self._add("rsqrt", [x])
    def square(self, x): return self._add("square", [x])
    def neg(self, x): return self._add("neg", [x])
    def silu(self, x): return self._add("silu", [x])
    def gelu(self, x): return self._add("gelu", [x])
    def relu(self, x): return self._add("relu", [x])

    def clamp(self, x, min_val: float, max_val: float):
        """Elementwise ``min(max(x, min_val), max_val)``."""
        if min_val > max_val:
            raise ValueError(f"clamp: min_val {min_val} is greater than max_val {max_val}")
        return self._add("clamp", [x], min_val=float(min_val), max_val=float(max_val))

    def cast(self, x, dtype):
        """Elementwise conversion to another floating-point ``dtype`` (yr.float32/float16/
        bfloat16; to half types rounding to nearest even, like torch's ``Tensor.to``)."""
        dtype = as_dtype(dtype)
        if not dtype.is_float:
            raise ValueError(f"cast: target dtype must be floating point, got {dtype.value}")
        return self._add("cast", [x], dtype=dtype.value)

    def scale(self, x, factor: float):
        """Elementwise ``x * factor`` for a Python number ``factor``."""
        return self._add("scale", [x], factor=float(factor))

    # reductions and normalizations
    def reduction(self, x, dim: int):
        """Sum over ``dim``, keeping it with size 1 (Mirage semantics)."""
        return self._add("reduction", [x], dim=int(dim))

    def rms_norm(self, x, normalized_shape: Sequence[int], eps: float = 1e-6):
        """RMSNorm without weight (Zhang & Sennrich 2019): x / sqrt(mean(x^2) + eps) over
        the trailing dims ``normalized_shape``. Multiply by a weight with ``mul``."""
        return self._add("rms_norm", [x], normalized_shape=tuple(int(d) for d in normalized_shape),
                         eps=float(eps))

    def softmax(self, x, dim: int = -1):
        """Softmax over ``dim`` (computed in float32)."""
        return self._add("softmax", [x], dim=int(dim))

    # library ops
    def matmul(self, a, b):
        """``a @ b`` over the last two dims, batched (with broadcasting) over leading dims."""
        return self._add("matmul", [a, b])

    def linear(self, x, w, bias=None):
        """``x @ w.T (+ bias)``: x [..., K], w [N, K] (float, or q4_1/q8_0 blocks), bias [N]."""
        attrs = {"w_dtype": w.dtype.value, "w_shape": list(w.shape)} if w.dtype.is_quantized else {}
        return self._add("linear", [x, w] + ([bias] if bias is not None else []), **attrs)

    def embedding(self, ids, table):
        """Rows of ``table`` [vocab, D] (float or q4_1/q8_0) at integer ``ids`` [...]: [..., D]."""
        attrs = {"w_dtype": table.dtype.value, "w_shape": list(table.shape)} if table.dtype.is_quantized else {}
        return self._add("embedding", [ids, table], **attrs)

    def rope(self, x, cos, sin, start_pos):
        """Rotate-half RoPE of x [T, H, Dh] at positions start_pos[0] + t, with tables
        cos/sin [max_seq, Dh/2] (float32). Source: Su et al. 2021; transformers' Llama."""
        return self._add("rope", [x, cos, sin, start_pos])

    def attention(self, q, k, v, k_cache, v_cache, start_pos, scale: float | None = None):
        """Causal grouped-query attention over a KV cache.

        q [T, Hq, Dh]; k, v [T, Hkv, Dh]; caches [max_seq, Hkv, Dh] (updated in place at
        rows start_pos[0] .. start_pos[0]+T-1); start_pos int64 (1,). Returns [T, Hq, Dh].
        """
        scale = float(scale if scale is not None else q.shape[-1] ** -0.5)
        return self._add("attention", [q, k, v, k_cache, v_cache, start_pos], scale=scale)

    def argmax(self, x, dim: int = -1):
        """Index of the maximum over the last dim (int64)."""
        return self._add("argmax", [x], dim=int(dim))

    def reshape(self, x, shape: Sequence[int]):
        """Same elements, new shape (a view of contiguous data)."""
        return self._add("reshape", [x], shape=tuple(int(d) for d in shape))

    def slice_rows(self, x, start: int, end: int):
        """Rows ``start:end`` of the first dim (a view; no copy)."""
        return self._add("slice_rows", [x], start=int(start), end=int(end))

    # ---- the reference ----------------------------------------------------------------------
    def interpret(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Run the reference interpreter (torch eager); see ir/interpret.py."""
        return interpret(self, inputs)
