"""Candidate µGraphs for ``superoptimize``: kernel graphs rewritten into threadblock graphs.

The family covered here is the one Mirage's paper builds its case on (Wu et al., "Mirage: A
Multi-Level Superoptimizer for Tensor Programs", OSDI 2025, sections 2 and 7): every matmul
of the graph multiplies the same row operand X [M, K] (a graph input, optionally RMS-
normalized over K) by a weight W_i [K, N_i], and what follows is elementwise. That is the
gated MLP (silu(X W1) * (X W3)), RMSNorm + matmul, a matmul with any elementwise epilogue,
and LoRA (X W + (X A) B, whose low-rank product is accumulated in the loop as sum_k (X_k A_k) B,
by linearity). One block graph then computes the whole graph:

- grid dim x partitions N (each block owns N / grid columns of every output and weight);
- the for-loop walks K in ``loop`` tiles: every matmul's partial product is accumulated
  (``forloop_accum``), so X is read once per block and every weight once overall;
- algebraic rewrite: RMSNorm's row scale is moved across the matmuls, (X / rms(X)) W =
  (X W) / rms(X), with rms(X) accumulated in the same loop (``forloop_accum(x, "rms")``, then
  sqrt(rms^2 + eps)); without it the norm would need all of K before the first product;
- the elementwise epilogue runs once per block after the loop, on the accumulators.

A graph may hold more than the family: ops that read the block's values but cannot be
finished inside a block of N columns (a norm over the whole row, a softmax, a matmul of the
results) stay in the kernel graph after the block graph, for the fixed fusion to compile: a
partition of the graph into two kernels (Mirage's kernel-level search; nGPT's block, where the
matmul becomes the block graph and the two RMSNorms and the lerp a fused row kernel).

``match(graph)`` recognizes the family (None otherwise); ``lower(graph, pattern, grid,
loop)`` builds the rewritten kernel graph (same inputs, same outputs, one ``customized``
op); ``schedules(pattern, threads)`` lists the (grid, loop) pairs worth timing, best guesses
first. Everything here is IR: it builds graphs and never compiles or runs them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..dtypes import DType
from ..ir.graph import KernelGraph, OpNode
from ..ir.threadblock import BINARY_OPS, UNARY_OPS, new_threadblock_graph

#: kernel-graph elementwise ops with a block-graph equivalent (scale -> mul_scalar)
_UNARY = set(UNARY_OPS) | {"scale", "clamp"}
_BINARY = set(BINARY_OPS)


@dataclass
class Pattern:
    """A graph of the shared-row-matmul family (see the module doc).

    Attributes:
        x: tensor id of X [M, K] (a graph input).
        rms_eps: None, or the eps of the RMSNorm of X over K that feeds the matmuls.
        matmuls: (weight input id, result tensor id) per matmul of X, N columns each.
        lora: (A input id [K, R], B input id [R, N], result id) per low-rank product (X A) B.
        epilogue: the elementwise ops after the matmuls, in graph order.
        M, K, N: the sizes.
        rest: the graph's other ops (kept in the kernel graph, after the block graph).
        exports: the block's values that are graph outputs or read by ``rest``.
    """

    x: int
    rms_eps: float | None
    matmuls: list[tuple[int, int]]
    lora: list[tuple[int, int, int]] = field(default_factory=list)
    epilogue: list[OpNode] = field(default_factory=list)
    M: int = 0
    K: int = 0
    N: int = 0
    rest: list[OpNode] = field(default_factory=list)
    exports: list[int] = field(default_factory=list)

    def describe(self) -> str:
        parts = [f"{len(self.matmuls)} matmul(s) of X [{self.M}, {self.K}] -> [.., {self.N}]"]
        if self.rms_eps is not None:
            parts.append("RMSNorm moved across the matmuls")
        if self.lora:
            parts.append(f"{len(self.lora)} low-rank product(s)")
        if self.epilogue:
            parts.append("epilogue " + "+".join(n.op for n in self.epilogue))
        if self.rest:
            parts.append(f"then {len(self.rest)} op(s) in the fixed fusion")
        return ", ".join(parts)


def match(graph: KernelGraph) -> Pattern | None:
    """The graph's matmul family as a ``Pattern``, or None when there is none (no matmul of a
    2-d input X by 2-d input weights, a dtype other than float32, X used both normalized and
    not, ...). The family is the block graph's part; ops outside it that read its values (a
    row norm over all N, a softmax, another matmul) stay in the kernel graph (``Pattern.rest``):
    a partition of the graph into the block graph and the fixed fusion of the rest."""
    tt = graph.tensors
    if not graph.ops or not graph.outputs or any(t.dtype != DType.float32 for t in tt):
        return None
    inputs = set(graph.inputs)
    users: dict[int, list[OpNode]] = {}
    for n in graph.ops:
        for i in n.inputs:
            users.setdefault(i, []).append(n)
    x: int | None = None
    norm: tuple[int, float] | None = None        # (id of rms_norm(X), eps)
    modes: set[bool] = set()                     # per matmul of X: reads the normalized X
    matmuls: list[tuple[int, int]] = []
    inner: dict[int, int] = {}                   # id of X A (to be multiplied by B) -> A
    lora: list[tuple[int, int, int]] = []
    epilogue: list[OpNode] = []
    rest: list[OpNode] = []
    values: set[int] = set()                     # the [M, N] values of the block

    def is_x(t: int) -> bool:                    # t is X (the same input every time)
        nonlocal x
        if t not in inputs or len(tt[t].shape) != 2:
            return False
        x = t if x is None else x
        return t == x

    for n in graph.ops:
        if n.op == "rms_norm":
            a = n.inputs[0]
            feeds_matmuls = all(u.op == "matmul" and u.inputs[0] == n.output and u.inputs[1] in inputs
                                for u in users.get(n.output, ())) and n.output not in graph.outputs
            if (norm is None and feeds_matmuls and is_x(a)
                    and tuple(n.attrs.get("normalized_shape", ())) == (tt[a].shape[1],)):
                norm = (n.output, float(n.attrs.get("eps", 1e-6)))
            else:
                rest.append(n)
        elif n.op == "matmul":
            a, w = n.inputs
            if a in inner and w in inputs and len(tt[w].shape) == 2:   # (X A) B
                lora.append((inner.pop(a), w, n.output))
                values.add(n.output)
                continue
            normalized = norm is not None and a == norm[0]
            if (w not in inputs or len(tt[w].shape) != 2 or not (normalized or is_x(a))
                    or tt[w].shape[0] != tt[x].shape[1]):
                rest.append(n)
                continue
            modes.add(normalized)
            us = users.get(n.output, [])
            if (not normalized and len(us) == 1 and us[0].op == "matmul" and us[0].inputs[0] == n.output
                    and n.output not in graph.outputs):
                inner[n.output] = w
            else:
                matmuls.append((w, n.output))
                values.add(n.output)
        elif n.op in _UNARY and n.inputs[0] in values:
            epilogue.append(n)
            values.add(n.output)
        elif n.op in _BINARY and all(i in values for i in n.inputs):
            epilogue.append(n)
            values.add(n.output)
        else:
            rest.append(n)
    if x is None or not (matmuls or lora) or inner or len(modes) > 1 or (norm is not None and lora):
        return None
    if norm is not None and modes != {True}:
        return None                                  # the norm's output feeds no matmul
    M, K = tt[x].shape
    N = tt[next(iter(values))].shape[1]
    if {tt[t].shape for t in values} != {(M, N)}:
        return None
    exports = [t for t in sorted(values)
               if t in graph.outputs or any(u in rest for u in users.get(t, ()))]
    if any(t not in values and t not in {r.output for r in rest} and t not in inputs for t in graph.outputs):
        return None
    return Pattern(x, norm[1] if norm else None, matmuls, lora, epilogue, M, K, N, rest, exports)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def tile_bytes(p: Pattern, grid: int, loop: int, elem: int = 4) -> int:
    """Bytes of one for-loop iteration's input tiles in a block: X [M, K/loop] and a weight
    tile [K/loop, N/grid] per matmul (the low-rank pairs' rank-R tiles are left out: small)."""
    kt, nt = p.K // loop, p.N // grid
    n = p.M * kt + len(p.matmuls) * kt * nt
    return elem * n


def schedules(p: Pattern, threads: int, max_tile_bytes: int | None = None) -> list[tuple[int, int]]:
    """(grid, loop) pairs to try, most promising first: grid splits N into tiles of 8-512
    columns (at least ``threads`` blocks where N allows), loop splits K into tiles of 32-1024
    rows; ordered by how far they are from a tile of 64 columns x 256 rows of K. With
    ``max_tile_bytes`` (GPUs: a block's tiles live in shared memory), only the pairs whose
    :func:`tile_bytes` fit."""
    grids = [g for g in _divisors(p.N) if 8 <= p.N // g <= 512] or [1]
    loops = [f for f in _divisors(p.K) if 32 <= p.K // f <= 1024] or [1]
    pairs = [(g, f) for g in grids for f in loops
             if max_tile_bytes is None or tile_bytes(p, g, f) <= max_tile_bytes]

    def cost(gf):
        g, f = gf
        under = 0 if g >= threads else 4 * (threads - g)
        return abs(math.log2((p.N // g) / 64)) + abs(math.log2((p.K // f) / 256)) + under

    return sorted(pairs, key=cost)


def lower(graph: KernelGraph, p: Pattern, grid: int, loop: int, cls=KernelGraph, cpu_threads: int = 0,
          block: int = 128) -> KernelGraph:
    """The graph rewritten as one block graph with ``grid`` blocks over N and ``loop``
    iterations over K (see the module doc), ``block`` threads per block (Triton: block/32
    warps) and ``cpu_threads`` OpenMP threads (0: all); same inputs in the same order, same
    outputs. GraphError (from the builders) if the sizes do not divide."""
    g = cls(graph.backend)
    new = {t: g.new_input(graph.tensors[t].shape, graph.tensors[t].dtype, graph.names.get(t))
           for t in graph.inputs}
    tb = new_threadblock_graph(grid_dim=(grid, 1, 1), block_dim=(block, 1, 1), forloop_range=loop,
                               reduction_dimx=64, cpu_threads=cpu_threads)
    used: list[int] = []

    def tb_input(t, imap, fdim):
        used.append(t)
        return tb.new_input(new[t], imap, fdim)

    tX = tb_input(p.x, (-1, -1, -1), 1)
    vals = {}
    for w, out in p.matmuls:
        vals[out] = tb.forloop_accum(tb.matmul(tX, tb_input(w, (1, -1, -1), 0)))
    for a, b, out in p.lora:
        # (X A) B = sum over the K tiles of (X_k A_k) B (Mirage's LoRA µGraph, by linearity)
        low = tb.matmul(tX, tb_input(a, (-1, -1, -1), 0))
        vals[out] = tb.forloop_accum(tb.matmul(low, tb_input(b, (1, -1, -1), -1)))
    if p.rms_eps is not None:
        # (X / rms(X)) W = (X W) / rms(X); the low-rank products are never normalized here
        # (match() only takes LoRA without a norm)
        rms = tb.forloop_accum(tX, "rms")                        # sqrt(mean of squares)
        if p.rms_eps:
            rms = tb.sqrt(tb.add_scalar(tb.square(rms), p.rms_eps))
        for w, out in p.matmuls:
            vals[out] = tb.div(vals[out], rms)
    for n in p.epilogue:
        ins = [vals[i] for i in n.inputs]
        if n.op == "scale":
            vals[n.output] = tb.mul_scalar(ins[0], n.attrs["factor"])
        elif n.op == "clamp":
            vals[n.output] = tb.clamp(ins[0], n.attrs["min_val"], n.attrs["max_val"])
        else:
            vals[n.output] = getattr(tb, n.op)(*ins)
    exports = p.exports or list(graph.outputs)
    for o in exports:
        tb.new_output(vals[o], (1, -1, -1))
    outs = g.customized([new[t] for t in dict.fromkeys(used)], tb)
    new.update(zip(exports, outs))
    for n in p.rest:                       # the partition's other kernel: as the graph had it
        new[n.output] = g._add(n.op, [new[i] for i in n.inputs], **n.attrs)
    for o in graph.outputs:
        g.mark_output(new[o])
    return g
