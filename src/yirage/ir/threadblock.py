"""Threadblock graphs (µGraphs): Mirage's block-level programs and their reference interpreter.

    g = yr.new_kernel_graph()
    X = g.new_input(dims=(8, 96), dtype=yr.float32); W = g.new_input(dims=(96, 64), dtype=yr.float32)
    tb = yr.new_threadblock_graph(grid_dim=(4, 1, 1), block_dim=(128, 1, 1), forloop_range=3,
                                  reduction_dimx=64)
    tX = tb.new_input(X, input_map=(-1, -1, -1), forloop_dim=1)   # tile [8, 32] per iteration
    tW = tb.new_input(W, input_map=(1, -1, -1), forloop_dim=0)    # tile [32, 16] of block x's columns
    tO = tb.forloop_accum(tb.matmul(tX, tW))                      # [8, 16], summed over the loop
    tb.new_output(tO, output_map=(1, -1, -1))                     # block x writes columns 16x..16x+15
    O, = g.customized([X, W], tb)                                 # O: [8, 64]

Semantics (Mirage, Wu et al., "Mirage: A Multi-Level Superoptimizer for Tensor Programs",
OSDI 2025; python/mirage/threadblock.py): a grid of ``grid_dim = (x, y, z)`` blocks runs the
same block graph. ``input_map[i] = d`` (imap) means grid dim ``i`` partitions tensor dim ``d``
into ``grid_dim[i]`` equal chunks, block ``b_i`` taking chunk ``b_i``; ``-1`` means the tensor
is replicated along grid dim ``i``. Inside a block a sequential for-loop of ``forloop_range``
iterations further cuts ``forloop_dim`` (fmap; ``-1``: the whole block tile every iteration).
Ops on those tiles run every iteration; the ``forloop_accum*`` ops carry values across
iterations, and what is computed from accumulated values runs once after the loop. Outputs
are written after the loop: ``output_map[i] = d`` places block ``b_i``'s tile at chunk
``b_i`` of output dim ``d`` (so the output's dim ``d`` is the tile's times ``grid_dim[i]``).

``reduction_max(x, dim)`` is a *running* max over the loop (Mirage's online-softmax form): it
returns ``(m, diff)`` with ``m = max(m_prev, max_dim(x))`` and ``diff = m_prev - m`` (``m_prev``
starts at -inf), so ``forloop_accum_rescale(y, exp(diff))`` (``acc = acc * exp(diff) + y``)
keeps a sum relative to the current max, as flash attention does.

Shapes are checked when an op is added: ``GraphError`` naming the op and the rule broken.
``block_dim`` and ``reduction_dimx`` are recorded as Mirage has them; code generation
(C++: codegen/threadblock_cpp.py, Triton: codegen/threadblock_triton.py) ignores ``block_dim``. ``g.customized`` adds one kernel-graph op
``customized`` per output, each holding the block graph (op attrs ``tb`` and ``output``); its
torch reference is ``run_threadblock``, which runs the grid and the loop literally.

This module is IR: it must never generate code, build or launch anything.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F

from ..dtypes import DType
from ..errors import GraphError
from .graph import DTensor, _real
from .ops import TensorType, _register

LOOP, ACCUM, POST = "loop", "accum", "post"  # op stages: every iteration / carried / after the loop
UNARY_OPS = ("exp", "silu", "gelu", "relu", "square", "sqrt")
BINARY_OPS = ("add", "mul", "div", "sub")
ACCUM_KINDS = (None, "sum", "mean", "rms", "sum_todimx")


@dataclass(eq=False)
class STensor:
    """A block tile of a threadblock graph (a value, not data): ``shape``/``dims`` per block,
    ``after_accum`` True once it is computed from for-loop accumulators (after the loop)."""

    graph: "TBGraph"
    id: int
    shape: tuple[int, ...]
    after_accum: bool

    @property
    def dims(self) -> tuple[int, ...]:
        return self.shape

    def __repr__(self) -> str:
        return f"STensor(s{self.id}, shape={self.shape}, {'after' if self.after_accum else 'in'} loop)"


@dataclass
class TBInput:
    """``new_input``: kernel tensor ``tid`` (shape ``dshape``) tiled into stensor ``sid``."""

    tid: int
    dshape: tuple[int, ...]
    dtype: DType
    input_map: tuple[int, int, int]
    forloop_dim: int
    sid: int


@dataclass
class TBOutput:
    """``new_output``: stensor ``sid`` written at chunk b_i of dim output_map[i]; ``dshape``."""

    sid: int
    output_map: tuple[int, int, int]
    forloop_dim: int
    dshape: tuple[int, ...]


@dataclass
class TBOp:
    """One block op: ``op`` name, stensor ids in and out, attrs, and its stage (loop/accum/post)."""

    op: str
    inputs: list[int]
    outputs: list[int]
    attrs: dict = field(default_factory=dict)
    stage: str = LOOP


def _int(op: str, what: str, v) -> int:
    if isinstance(v, (bool, float)) or not isinstance(v, (int,)) and not hasattr(v, "__index__"):
        raise GraphError(f"{op}: {what} must be an integer, got {v!r}")
    return int(v)


def _dim3(op: str, what: str, v, positive: bool) -> tuple[int, int, int]:
    if isinstance(v, (str, bytes)) or not hasattr(v, "__iter__"):
        raise GraphError(f"{op}: {what} must be a tuple of 3 integers, got {v!r}")
    t = tuple(_int(op, what, x) for x in v)
    if not 1 <= len(t) <= 3:
        raise GraphError(f"{op}: {what} must have 1 to 3 entries (x, y, z), got {v!r}")
    fill = 1 if positive else -1
    t = t + (fill,) * (3 - len(t))
    if positive and min(t) < 1:
        raise GraphError(f"{op}: {what} must be positive integers, got {v!r}")
    return t


class TBGraph:
    """A threadblock graph (Mirage's ``TBGraph``): a block program run on a grid of blocks,
    each with a sequential for-loop over tiles. Build it with ``new_input``, the block ops and
    ``new_output``; add it to a kernel graph with ``KernelGraph.customized(inputs, tb)``.

    Args:
        grid_dim: (x, y, z) number of blocks per grid dim (1 to 3 positive ints).
        block_dim: (x, y, z) threads per block: Triton launches x*y*z/32 warps per program
            (at least 1; the default 128 is Triton's default of 4 warps); the CPU ignores it.
        forloop_range: iterations of the block's for-loop (positive int).
        reduction_dimx: the last-dim width of ``forloop_accum(x, "sum_todimx")`` (positive int).
        cpu_threads: OpenMP threads running the grid on the CPU; 0 (default): OpenMP's default
            (every core torch may use). A yirage addition, for the search's thread widths.

    Raises GraphError on non-integer or non-positive arguments.
    """

    def __init__(self, grid_dim, block_dim=(128, 1, 1), forloop_range: int = 1, reduction_dimx: int = 64,
                 cpu_threads: int = 0):
        op = "new_threadblock_graph"
        self.grid_dim = _dim3(op, "grid_dim", grid_dim, positive=True)
        self.block_dim = _dim3(op, "block_dim", block_dim, positive=True)
        self.forloop_range = _int(op, "forloop_range", forloop_range)
        self.reduction_dimx = _int(op, "reduction_dimx", reduction_dimx)
        self.cpu_threads = _int(op, "cpu_threads", cpu_threads)
        if self.forloop_range < 1 or self.reduction_dimx < 1:
            raise GraphError(f"{op}: forloop_range and reduction_dimx must be positive, got "
                             f"{forloop_range!r} and {reduction_dimx!r}")
        if self.cpu_threads < 0:
            raise GraphError(f"{op}: cpu_threads must be >= 0 (0: OpenMP's default), got {cpu_threads!r}")
        self.tensors: list[STensor] = []
        self.inputs: list[TBInput] = []
        self.outputs: list[TBOutput] = []
        self.ops: list[TBOp] = []
        self.kgraph = None  # the kernel graph the inputs belong to

    # ---- tensors --------------------------------------------------------------------------
    def _new(self, shape, after_accum: bool) -> STensor:
        t = STensor(self, len(self.tensors), tuple(int(s) for s in shape), after_accum)
        self.tensors.append(t)
        return t

    def _check(self, op: str, *xs) -> None:
        for i, x in enumerate(xs):
            if not isinstance(x, STensor) or x.graph is not self:
                raise GraphError(f"{op}: input {i} must be an STensor of this threadblock graph, got {x!r}")

    def _partition(self, op: str, shape, imap, fdim) -> list[int]:
        """The per-block, per-iteration tile shape of a tensor of ``shape`` under (imap, fdim)."""
        tile = list(shape)
        seen = set()
        for i, d in enumerate(imap):
            if d == -1:
                continue
            if not 0 <= d < len(shape):
                raise GraphError(f"{op}: map entry {d} (grid dim {i}) is not -1 or a dim of the "
                                 f"{len(shape)}-d tensor {tuple(shape)}")
            if d in seen:
                raise GraphError(f"{op}: tensor dim {d} is partitioned by two grid dims; map {imap}")
            seen.add(d)
            if tile[d] % self.grid_dim[i]:
                raise GraphError(f"{op}: dim {d} of size {shape[d]} is not divisible by grid_dim[{i}] = "
                                 f"{self.grid_dim[i]}")
            tile[d] //= self.grid_dim[i]
        if fdim != -1:
            if not 0 <= fdim < len(shape):
                raise GraphError(f"{op}: forloop_dim {fdim} is not -1 or a dim of the "
                                 f"{len(shape)}-d tensor {tuple(shape)}")
            if tile[fdim] % self.forloop_range:
                raise GraphError(f"{op}: dim {fdim} (block tile {tile[fdim]}) is not divisible by "
                                 f"forloop_range = {self.forloop_range}")
            tile[fdim] //= self.forloop_range
        return tile

    def new_input(self, dtensor, input_map, forloop_dim: int, store_in_dmem: bool = False) -> STensor:
        """A block tile of kernel tensor ``dtensor`` (a DTensor): grid dim i cuts tensor dim
        ``input_map[i]`` (-1: replicated), the for-loop cuts ``forloop_dim`` (-1: none).

        Returns an STensor of the per-iteration tile shape. Raises GraphError for a map entry
        that is not -1 or a dim, a dim partitioned twice, a size not divisible by its grid dim
        or by ``forloop_range``, a non-float dtype, or a tensor of another kernel graph.
        ``store_in_dmem`` is accepted for Mirage compatibility and ignored.
        """
        op = "new_input"
        if not isinstance(dtensor, DTensor):
            raise GraphError(f"{op}: dtensor must be a DTensor of a kernel graph, got {dtensor!r}")
        if self.kgraph is not None and dtensor.graph is not self.kgraph:
            raise GraphError(f"{op}: every input of a threadblock graph must come from one kernel graph")
        if not dtensor.dtype.is_float:
            raise GraphError(f"{op}: needs a floating-point tensor, got {dtensor.dtype.value}")
        if self.inputs and dtensor.dtype != self.inputs[0].dtype:
            raise GraphError(f"{op}: dtypes must match, got {dtensor.dtype.value} and "
                             f"{self.inputs[0].dtype.value}")
        imap = _dim3(op, "input_map", input_map, positive=False)
        fdim = _int(op, "forloop_dim", forloop_dim)
        tile = self._partition(op, dtensor.shape, imap, fdim)
        self.kgraph = dtensor.graph
        t = self._new(tile, after_accum=False)
        self.inputs.append(TBInput(dtensor.id, tuple(dtensor.shape), dtensor.dtype, imap, fdim, t.id))
        return t

    def new_output(self, stensor: STensor, output_map, forloop_dim: int = -1) -> None:
        """Write ``stensor`` (computed after the for-loop) to a new kernel tensor: grid dim i
        places the tile along output dim ``output_map[i]``.

        Raises GraphError when ``stensor`` is not accumulated (use ``forloop_accum``), a map
        entry is not -1 or a dim, a dim is mapped twice, a grid dim > 1 is not mapped (blocks
        would overwrite each other) or ``forloop_dim`` is not -1 (not supported yet).
        """
        op = "new_output"
        self._check(op, stensor)
        if not stensor.after_accum:
            raise GraphError(f"{op}: {stensor!r} is computed inside the for-loop; accumulate it "
                             "with forloop_accum first")
        omap = _dim3(op, "output_map", output_map, positive=False)
        if _int(op, "forloop_dim", forloop_dim) != -1:
            raise GraphError(f"{op}: forloop_dim must be -1 (outputs are written after the loop)")
        shape = list(stensor.shape)
        seen = set()
        for i, d in enumerate(omap):
            if d == -1:
                if self.grid_dim[i] > 1:
                    raise GraphError(f"{op}: grid dim {i} has {self.grid_dim[i]} blocks but output_map "
                                     f"{omap} does not place them: they would write the same tile")
                continue
            if not 0 <= d < len(shape) or d in seen:
                raise GraphError(f"{op}: output_map entry {d} is not a dim of the {len(shape)}-d tile "
                                 f"{stensor.shape} or is mapped twice")
            seen.add(d)
            shape[d] *= self.grid_dim[i]
        self.outputs.append(TBOutput(stensor.id, omap, -1, tuple(shape)))

    # ---- block ops ------------------------------------------------------------------------
    def _op(self, op: str, inputs, shapes, stage=None, **attrs):
        self._check(op, *inputs)
        posts = {x.after_accum for x in inputs}
        if stage is None:
            if len(posts) > 1:
                raise GraphError(f"{op}: mixes tiles from inside the for-loop and after it "
                                 f"({', '.join(map(repr, inputs))})")
            stage = POST if posts == {True} else LOOP
        elif True in posts:
            raise GraphError(f"{op}: its inputs must be computed inside the for-loop (before any "
                             f"forloop_accum), got {', '.join(map(repr, inputs))}")
        outs = [self._new(s, after_accum=stage != LOOP) for s in shapes]
        self.ops.append(TBOp(op, [x.id for x in inputs], [o.id for o in outs], attrs, stage))
        return outs[0] if len(outs) == 1 else tuple(outs)

    def _dim(self, op: str, x: STensor, dim) -> int:
        d = _int(op, "dim", dim)
        if not -len(x.shape) <= d < len(x.shape):
            raise GraphError(f"{op}: dim {d} is out of range for the {len(x.shape)}-d tile {x.shape}")
        return d % len(x.shape)

    def exp(self, A): """Elementwise exp."""; return self._unary("exp", A)
    def silu(self, A): """Elementwise x * sigmoid(x)."""; return self._unary("silu", A)
    def gelu(self, A): """Elementwise exact (erf) GELU."""; return self._unary("gelu", A)
    def relu(self, A): """Elementwise max(x, 0)."""; return self._unary("relu", A)
    def square(self, A): """Elementwise x * x."""; return self._unary("square", A)
    def sqrt(self, A): """Elementwise square root."""; return self._unary("sqrt", A)

    def _unary(self, op, A):
        self._check(op, A)
        return self._op(op, [A], [A.shape])

    def clamp(self, A, min_val: float, max_val: float):
        """Elementwise min(max(x, min_val), max_val) (+-inf allowed); GraphError if min_val > max_val,
        either is NaN or not a real number."""
        lo, hi = _real("clamp", "min_val", min_val, finite=False), _real("clamp", "max_val", max_val, finite=False)
        if not lo <= hi:
            raise GraphError(f"clamp: need min_val <= max_val, got {min_val!r} and {max_val!r}")
        self._check("clamp", A)
        return self._op("clamp", [A], [A.shape], min_val=lo, max_val=hi)

    def mul_scalar(self, A, scalar: float):
        """Elementwise x * scalar (a finite real number, GraphError otherwise)."""
        s = _real("mul_scalar", "scalar", scalar)
        self._check("mul_scalar", A)
        return self._op("mul_scalar", [A], [A.shape], scalar=s)

    def add_scalar(self, A, scalar: float):
        """Elementwise x + scalar (a finite real number, GraphError otherwise), e.g. the eps
        of an RMSNorm whose mean of squares was accumulated over the for-loop."""
        s = _real("add_scalar", "scalar", scalar)
        self._check("add_scalar", A)
        return self._op("add_scalar", [A], [A.shape], scalar=s)

    def add(self, A, B): """Elementwise A + B (torch broadcasting)."""; return self._binary("add", A, B)
    def mul(self, A, B): """Elementwise A * B (torch broadcasting)."""; return self._binary("mul", A, B)
    def div(self, A, B): """Elementwise A / B (torch broadcasting)."""; return self._binary("div", A, B)
    def sub(self, A, B): """Elementwise A - B (torch broadcasting)."""; return self._binary("sub", A, B)

    def _binary(self, op, A, B):
        self._check(op, A, B)
        if len(A.shape) != len(B.shape):
            raise GraphError(f"{op}: tiles {A.shape} and {B.shape} must have the same rank")
        for x, y in zip(A.shape, B.shape):
            if x != y and 1 not in (x, y):
                raise GraphError(f"{op}: tiles {A.shape} and {B.shape} do not broadcast")
        return self._op(op, [A, B], [tuple(max(x, y) for x, y in zip(A.shape, B.shape))])

    def matmul(self, A, B):
        """Tile matmul over the last two dims, ``[..., M, K] @ [..., K, N] -> [..., M, N]``;
        leading dims must be equal. GraphError otherwise."""
        self._check("matmul", A, B)
        if len(A.shape) < 2 or len(A.shape) != len(B.shape) or A.shape[:-2] != B.shape[:-2] \
                or A.shape[-1] != B.shape[-2]:
            raise GraphError(f"matmul: tiles {A.shape} @ {B.shape}: need [..., M, K] @ [..., K, N] with "
                             "equal leading dims")
        return self._op("matmul", [A, B], [A.shape[:-1] + B.shape[-1:]])

    def reduction(self, A, dim: int):
        """Sum over ``dim``, kept with size 1."""
        self._check("reduction", A)
        d = self._dim("reduction", A, dim)
        return self._op("reduction", [A], [A.shape[:d] + (1,) + A.shape[d + 1:]], dim=d)

    def reduction_max(self, A, dim: int):
        """Running max over ``dim`` and the for-loop: returns ``(m, diff)``, both with ``dim`` of
        size 1, ``m = max(m_prev, max_dim(A))``, ``diff = m_prev - m`` (m_prev = -inf at the first
        iteration). GraphError for a tile computed after the loop."""
        self._check("reduction_max", A)
        if A.after_accum:
            raise GraphError("reduction_max: is a running max over the for-loop; apply it inside the loop")
        d = self._dim("reduction_max", A, dim)
        s = A.shape[:d] + (1,) + A.shape[d + 1:]
        return self._op("reduction_max", [A], [s, s], dim=d)

    def rms_norm(self, A, eps: float = 0.0):
        """``x / sqrt(mean(x^2) + eps)`` over the last dim (Mirage's block rms_norm; ``eps`` is
        a yirage addition, default 0 as in Mirage; GraphError unless a finite number >= 0)."""
        self._check("rms_norm", A)
        e = _real("rms_norm", "eps", eps)
        if e < 0:
            raise GraphError(f"rms_norm: eps must be >= 0, got {eps!r}")
        return self._op("rms_norm", [A], [A.shape], eps=e)

    def concat(self, A, B, dim: int):
        """Concatenate along ``dim``; the other dims must match."""
        self._check("concat", A, B)
        d = self._dim("concat", A, dim)
        if len(A.shape) != len(B.shape) or any(x != y for i, (x, y) in enumerate(zip(A.shape, B.shape)) if i != d):
            raise GraphError(f"concat: tiles {A.shape} and {B.shape} differ outside dim {d}")
        s = list(A.shape)
        s[d] += B.shape[d]
        return self._op("concat", [A, B], [tuple(s)], dim=d)

    def _accum_shape(self, op, A, acc):
        if acc not in ACCUM_KINDS:
            raise GraphError(f"{op}: acc must be one of {ACCUM_KINDS}, got {acc!r}")
        if acc is None:
            return A.shape
        if acc == "sum_todimx":
            if A.shape[-1] % self.reduction_dimx:
                raise GraphError(f"{op}: last dim {A.shape[-1]} is not a multiple of reduction_dimx "
                                 f"{self.reduction_dimx}")
            return A.shape[:-1] + (self.reduction_dimx,)
        return A.shape[:-1] + (1,)

    def forloop_accum(self, A, acc: str | None = None):
        """Accumulate ``A`` over the for-loop. ``acc``: None (elementwise sum), ``"sum"`` (sum of
        the last dim too, size 1), ``"mean"`` (that over the last dim's total length, tile width x
        forloop_range), ``"rms"`` (sqrt of the mean of squares), ``"sum_todimx"`` (last dim summed
        down to ``reduction_dimx`` columns: out[j] = sum_k x[k * reduction_dimx + j]). The result
        is available after the loop. GraphError if ``A`` is already after the loop."""
        self._check("forloop_accum", A)
        return self._op("forloop_accum", [A], [self._accum_shape("forloop_accum", A, acc)], ACCUM, acc=acc)

    def forloop_accum_rescale(self, A, B, acc: str | None = None):
        """``acc = acc * B + A`` every iteration (``acc`` None) or ``acc = acc * B + sum_last(A)``
        (``"sum"``); ``B`` broadcasts to the accumulator (e.g. [M, 1]): flash attention's rescale."""
        self._check("forloop_accum_rescale", A, B)
        if acc not in (None, "sum"):
            raise GraphError(f"forloop_accum_rescale: acc must be None or 'sum', got {acc!r}")
        out = self._accum_shape("forloop_accum_rescale", A, acc)
        if len(B.shape) != len(out) or any(b not in (1, o) for b, o in zip(B.shape, out)):
            raise GraphError(f"forloop_accum_rescale: scale {B.shape} does not broadcast to {out}")
        return self._op("forloop_accum_rescale", [A, B], [out], ACCUM, acc=acc)

    def forloop_accum_max(self, A):
        """Elementwise max over the for-loop iterations (starts at -inf)."""
        self._check("forloop_accum_max", A)
        return self._op("forloop_accum_max", [A], [A.shape], ACCUM)

    # ---- JSON ----------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """The block graph as plain JSON data (lists, numbers, strings); ``from_dict`` reads it."""
        return {"grid_dim": list(self.grid_dim), "block_dim": list(self.block_dim),
                "forloop_range": self.forloop_range, "reduction_dimx": self.reduction_dimx,
                "cpu_threads": self.cpu_threads,
                "tensors": [[list(t.shape), t.after_accum] for t in self.tensors],
                "inputs": [[i.tid, list(i.dshape), i.dtype.value, list(i.input_map), i.forloop_dim, i.sid]
                           for i in self.inputs],
                "outputs": [[o.sid, list(o.output_map), o.forloop_dim, list(o.dshape)] for o in self.outputs],
                "ops": [[o.op, o.inputs, o.outputs, o.attrs, o.stage] for o in self.ops]}

    @classmethod
    def from_dict(cls, d: dict, kgraph=None) -> "TBGraph":
        """Rebuild a block graph from ``to_dict`` data (inputs refer to tensor ids of ``kgraph``).
        ValueError when ``d`` is malformed."""
        try:
            tb = cls(d["grid_dim"], d["block_dim"], d["forloop_range"], d["reduction_dimx"],
                     d.get("cpu_threads", 0))
            tb.tensors = [STensor(tb, n, tuple(s), bool(a)) for n, (s, a) in enumerate(d["tensors"])]
            tb.inputs = [TBInput(t, tuple(ds), DType(dt), tuple(m), f, s) for t, ds, dt, m, f, s in d["inputs"]]
            tb.outputs = [TBOutput(s, tuple(m), f, tuple(ds)) for s, m, f, ds in d["outputs"]]
            tb.ops = [TBOp(op, list(i), list(o), dict(a), st) for op, i, o, a, st in d["ops"]]
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"malformed threadblock graph in JSON: {e!r}") from None
        tb.kgraph = kgraph
        return tb

    def __repr__(self) -> str:
        return (f"TBGraph(grid_dim={self.grid_dim}, forloop_range={self.forloop_range}, "
                f"{len(self.inputs)} inputs, {len(self.ops)} ops, {len(self.outputs)} outputs)")


def new_threadblock_graph(grid_dim, block_dim=(128, 1, 1), forloop_range: int = 1,
                          reduction_dimx: int = 64, cpu_threads: int = 0) -> TBGraph:
    """Create an empty threadblock graph (Mirage's ``mi.new_threadblock_graph``); see TBGraph."""
    return TBGraph(grid_dim, block_dim, forloop_range, reduction_dimx, cpu_threads)


# ---- the reference interpreter ------------------------------------------------------------

def tile_slices(shape, imap, fdim, grid_dim, forloop_range, block, it) -> tuple[slice, ...]:
    """Index of block ``block`` (bx, by, bz), iteration ``it`` (None: whole block tile) in a
    tensor of ``shape`` partitioned by ``imap``/``fdim``."""
    start, size = [0] * len(shape), list(shape)
    for i, d in enumerate(imap):
        if d >= 0:
            size[d] //= grid_dim[i]
            start[d] += block[i] * size[d]
    if fdim >= 0 and it is not None:
        size[fdim] //= forloop_range
        start[fdim] += it * size[fdim]
    return tuple(slice(s, s + n) for s, n in zip(start, size))


_TORCH_UNARY = {"exp": torch.exp, "silu": F.silu, "gelu": F.gelu, "relu": torch.relu,
                "square": torch.square, "sqrt": torch.sqrt}
_TORCH_BINARY = {"add": torch.add, "mul": torch.mul, "div": torch.div, "sub": torch.sub}


def _eval(op: TBOp, args: list[torch.Tensor]) -> list[torch.Tensor]:
    a = op.attrs
    if op.op in _TORCH_UNARY:
        return [_TORCH_UNARY[op.op](args[0])]
    if op.op in _TORCH_BINARY:
        return [_TORCH_BINARY[op.op](*args)]
    if op.op == "clamp":
        return [torch.clamp(args[0], a["min_val"], a["max_val"])]
    if op.op == "mul_scalar":
        return [args[0] * a["scalar"]]
    if op.op == "add_scalar":
        return [args[0] + a["scalar"]]
    if op.op == "matmul":
        return [torch.matmul(*args)]
    if op.op == "reduction":
        return [args[0].sum(a["dim"], keepdim=True)]
    if op.op == "rms_norm":
        x = args[0]
        return [x / torch.sqrt(x.square().mean(-1, keepdim=True) + a["eps"])]
    if op.op == "concat":
        return [torch.cat(args, a["dim"])]
    raise AssertionError(op.op)


def _accum_term(x: torch.Tensor, acc, rdx: int) -> torch.Tensor:
    if acc is None:
        return x
    if acc == "sum_todimx":
        return x.reshape(*x.shape[:-1], -1, rdx).sum(-2)
    return (x.square() if acc == "rms" else x).sum(-1, keepdim=True)


def run_threadblock(tb: TBGraph, inputs: Sequence[torch.Tensor],
                    outputs: Sequence[int] | None = None) -> list[torch.Tensor]:
    """Run ``tb`` on kernel tensors ``inputs`` (one per ``new_input``, in order) literally: for
    each block of the grid, for each loop iteration, slice the input tiles, run the loop ops,
    update the accumulators; then run the ops after the loop and write the output tiles.

    Computes in float32 and returns the outputs (indices ``outputs``, default all) in the
    inputs' dtype on their device. This defines what a threadblock graph means.
    """
    want = range(len(tb.outputs)) if outputs is None else outputs
    dev = inputs[0].device if inputs else torch.device("cpu")
    dtype = inputs[0].dtype if inputs else torch.float32
    res = {k: torch.empty(tb.outputs[k].dshape, dtype=dtype, device=dev) for k in want}
    xs = [x.float() for x in inputs]
    loop_ops = [o for o in tb.ops if o.stage != POST]
    post_ops = [o for o in tb.ops if o.stage == POST]
    F_ = tb.forloop_range
    for block in itertools.product(*(range(n) for n in tb.grid_dim)):
        env: dict[int, torch.Tensor] = {}
        state: dict[int, torch.Tensor] = {}
        for it in range(F_):
            for inp, x in zip(tb.inputs, xs):
                env[inp.sid] = x[tile_slices(inp.dshape, inp.input_map, inp.forloop_dim,
                                             tb.grid_dim, F_, block, it)]
            for op in loop_ops:
                args = [env[i] for i in op.inputs]
                if op.stage == LOOP and op.op != "reduction_max":
                    env.update(zip(op.outputs, _eval(op, args)))
                elif op.op == "reduction_max":
                    m = args[0].amax(op.attrs["dim"], keepdim=True)
                    prev = state.get(op.outputs[0], torch.full_like(m, -math.inf))
                    new = torch.maximum(prev, m)
                    state[op.outputs[0]] = new
                    env[op.outputs[0]], env[op.outputs[1]] = new, prev - new
                elif op.op == "forloop_accum_max":
                    prev = state.get(op.outputs[0])
                    state[op.outputs[0]] = args[0].clone() if prev is None else torch.maximum(prev, args[0])
                else:
                    term = _accum_term(args[0], op.attrs.get("acc"), tb.reduction_dimx)
                    prev = state.get(op.outputs[0])
                    if op.op == "forloop_accum_rescale" and prev is not None:
                        prev = prev * args[1]
                    state[op.outputs[0]] = term.clone() if prev is None else prev + term
        for op in loop_ops:
            if op.stage == ACCUM:
                v, acc = state[op.outputs[0]], op.attrs.get("acc")
                width = tb.tensors[op.inputs[0]].shape[-1] * F_
                if acc == "mean":
                    v = v / width
                elif acc == "rms":
                    v = torch.sqrt(v / width)
                env[op.outputs[0]] = v
        for op in post_ops:
            env.update(zip(op.outputs, _eval(op, [env[i] for i in op.inputs])))
        for k in want:
            out = tb.outputs[k]
            res[k][tile_slices(out.dshape, out.output_map, -1, tb.grid_dim, F_, block, None)] = \
                env[out.sid].to(dtype)
    return [res[k] for k in want]


# ---- the kernel-graph op ``customized`` -----------------------------------------------------

def _customized_infer(ts: list[TensorType], attrs: dict) -> TensorType:
    tb: TBGraph = attrs["tb"]
    if len(ts) != len(tb.inputs):
        raise GraphError(f"customized: the threadblock graph has {len(tb.inputs)} inputs, got {len(ts)}")
    for i, (t, inp) in enumerate(zip(ts, tb.inputs)):
        if tuple(t.shape) != inp.dshape or t.dtype != inp.dtype:
            raise GraphError(f"customized: input {i} has shape {tuple(t.shape)} ({t.dtype.value}), the "
                             f"threadblock graph's new_input {i} {inp.dshape} ({inp.dtype.value})")
    k = attrs["output"]
    return TensorType(tb.outputs[k].dshape, tb.inputs[0].dtype)


def _customized_ref(args, attrs):
    return run_threadblock(attrs["tb"], args, [attrs["output"]])[0]


_register("customized", "library", -1, _customized_infer, _customized_ref)


def add_customized(kgraph, inputs: Sequence, tb: TBGraph) -> list:
    """``kgraph.customized(inputs, tb)``: one ``customized`` op per output of ``tb`` (attrs
    ``tb`` and ``output``); returns their DTensors in ``new_output`` order.

    Raises GraphError unless ``tb`` is a TBGraph with at least one output and ``inputs`` are
    the DTensors given to its ``new_input`` calls, in the same order.
    """
    if not isinstance(tb, TBGraph):
        raise GraphError(f"customized: expected a threadblock graph (yr.new_threadblock_graph), got {tb!r}")
    inputs = list(inputs)
    kgraph._check_tensors("customized", inputs)
    if [x.id for x in inputs] != [i.tid for i in tb.inputs] or (inputs and tb.kgraph is not kgraph):
        raise GraphError("customized: inputs must be the kernel tensors passed to the threadblock graph's "
                         f"new_input, in order ({len(tb.inputs)} of them)")
    if not tb.outputs:
        raise GraphError("customized: the threadblock graph has no output (call tb.new_output)")
    return [kgraph._add("customized", inputs, tb=tb, output=k) for k in range(len(tb.outputs))]
