"""Candidate µGraphs for attention: ``softmax(c * Q K^T) V`` as Mirage's flash-decoding pair of
threadblock graphs.

Mirage's group-query-attention µGraph (Wu et al., OSDI 2025, section 7 and its
``benchmark/group_query_attention.py``; Dao et al., "Flash-Decoding for long-context
inference", 2023) splits the keys of each batch entry (a KV head with its G query rows) over
grid dim y, walks each split in for-loop tiles and moves softmax's 1/sum across the matmul
with V: block graph 1 keeps, per split, the running max m of the scores, the rescaled
numerator sum_j exp(s_j - m) v_j and denominator sum_j exp(s_j - m) (``reduction_max``,
``forloop_accum_rescale``); block graph 2 combines the splits the same way and divides. K and
V are read once, and the scores never leave the block.

The kernel graph matched here (``match``), with every intermediate used only by the next op:

    S = matmul(Q, Kt)            Q [B, G, D] (any tensor), Kt [B, D, T] and V [B, T, Dv] inputs
    S = mul(S, inv)              optional: the key norm of QK-norm attention,
                                 inv = rsqrt(scale(reduction(square(Kt), dim=-2), f))  [B, 1, T]
    S = scale(S, c)              optional
    P = softmax(S, dim=-1)
    O = matmul(P, V)             [B, G, Dv]; what reads O, and what computes Q (a reshape, a
                                 query RMSNorm), stays in the kernel graph as it was.

The key norm is folded into block graph 1 (the tile of Kt holds all D rows of its columns, so
their sum of squares is local to the tile): the fixed fusion reads Kt twice for it, the µGraph
once. ``lower(graph, p, splits, loop)`` builds the rewritten kernel graph; ``schedules``
lists the (splits, loop) pairs worth timing. Everything here builds graphs and never runs them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..dtypes import DType
from ..ir.graph import KernelGraph
from ..ir.threadblock import new_threadblock_graph
from .mugraph import _divisors


@dataclass
class AttentionPattern:
    """Where the attention sits in the graph (tensor ids) and its sizes.

    Attributes:
        q, kt, v: Q [B, G, D] (any tensor), Kt [B, D, T] and V [B, T, Dv] (graph inputs).
        out: O [B, G, Dv], the result of ``matmul(P, V)``.
        chain: ids of the ops replaced (the matmuls, softmax, scale and the key-norm ops).
        scale: the score factor c (1.0 when there is no ``scale``).
        knorm: None, or the factor f of the key norm (rsqrt(f * sum_d Kt[d, j]^2)).
        B, G, D, T, Dv: the sizes.
    """

    q: int
    kt: int
    v: int
    out: int
    chain: frozenset
    scale: float
    knorm: float | None
    B: int
    G: int
    D: int
    T: int
    Dv: int

    def describe(self) -> str:
        extra = ", key norm in the loop" if self.knorm is not None else ""
        return f"attention B={self.B} G={self.G} T={self.T} D={self.D}, flash-decoding{extra}"


def match(graph: KernelGraph) -> AttentionPattern | None:
    """The attention of ``graph`` (module doc), or None. float32 graphs only."""
    tt = graph.tensors
    if any(t.dtype != DType.float32 for t in tt):
        return None
    inputs = set(graph.inputs)
    producer = {n.output: n for n in graph.ops}
    users: dict[int, list] = {}
    for n in graph.ops:
        for i in n.inputs:
            users.setdefault(i, []).append(n)
    outputs = set(graph.outputs)

    def private(t: int) -> bool:      # read by exactly one op, not an output
        return len(users.get(t, ())) == 1 and t not in outputs

    def op(t: int, name: str):
        n = producer.get(t)
        return n if n is not None and n.op == name else None

    for pv in graph.ops:
        if pv.op != "matmul":
            continue
        p_id, v = pv.inputs
        sm = op(p_id, "softmax")
        if sm is None or v not in inputs or len(tt[v].shape) != 3 or not private(p_id):
            continue
        if sm.attrs.get("dim", -1) not in (-1, len(tt[p_id].shape) - 1):
            continue
        chain = [pv, sm]
        s = sm.inputs[0]
        c = 1.0
        sc = op(s, "scale")
        if sc is not None and private(s):
            c, s = float(sc.attrs["factor"]), sc.inputs[0]
            chain.append(sc)
        knorm = None
        mul = op(s, "mul")
        if mul is not None and private(s):
            found = _key_norm(mul, producer, private, inputs, tt)
            if found is None:
                continue
            s, knorm, norm_ops, knorm_kt = found
            chain += [mul, *norm_ops]
        qk = op(s, "matmul")
        if qk is None or not private(s):
            continue
        chain.append(qk)
        q, kt = qk.inputs
        if kt not in inputs or len(tt[kt].shape) != 3 or len(tt[q].shape) != 3:
            continue
        if knorm is not None and kt != knorm_kt:   # the norm must be of the same K
            continue
        (B, G, D), (_, _, T), (_, _, Dv) = tt[q].shape, tt[kt].shape, tt[v].shape
        if tt[kt].shape != (B, D, T) or tt[v].shape != (B, T, Dv):
            continue
        return AttentionPattern(q, kt, v, pv.output, frozenset(id(n) for n in chain), c, knorm, B, G, D, T, Dv)
    return None


def _key_norm(mul, producer, private, inputs, tt):
    """(scores id, f, ops, Kt id) when ``mul`` multiplies scores by rsqrt(scale(reduction(
    square(Kt), -2), f)) of a 3-d input Kt; else None."""
    for s, inv in (mul.inputs, mul.inputs[::-1]):
        t, ops = inv, []
        for name in ("rsqrt", "scale", "reduction", "square"):
            n = producer.get(t)
            if n is None or n.op != name or not private(t):
                break
            ops.append(n)
            t = n.inputs[0]
        else:
            red, kt = ops[2], t
            dim = red.attrs.get("dim")
            if kt in inputs and len(tt[kt].shape) == 3 and dim in (-2, 1) and private(inv):
                return s, float(ops[1].attrs["factor"]), ops, kt
    return None


def tile_bytes(p: AttentionPattern, splits: int, loop: int, elem: int = 4) -> int:
    """Bytes of one for-loop iteration's tiles in a block of graph 1: Q [G, D], Kt [D, t],
    V [t, Dv] and the scores [G, t], with t = T / (splits * loop) keys."""
    t = p.T // (splits * loop)
    return elem * (p.G * p.D + p.D * t + t * p.Dv + p.G * t)


def schedules(p: AttentionPattern, threads: int, max_tile_bytes: int | None = None) -> list[tuple[int, int]]:
    """(splits, loop) pairs to try, most promising first: key splits per batch entry (at
    least ``threads`` blocks overall where T allows, at most 64 splits) and for-loop tiles of
    32-512 keys; ordered by how far they are from 2 blocks per thread and 128-key tiles.
    With ``max_tile_bytes`` only the pairs whose :func:`tile_bytes` fit."""
    pairs = []
    for sp in _divisors(p.T):
        if sp > 64:
            break
        for lp in _divisors(p.T // sp):
            t = p.T // (sp * lp)
            if 32 <= t <= 512 and (max_tile_bytes is None or tile_bytes(p, sp, lp) <= max_tile_bytes):
                pairs.append((sp, lp))

    def cost(pair):
        sp, lp = pair
        blocks = p.B * sp
        return abs(math.log2(blocks / (2 * threads))) + abs(math.log2(p.T // (sp * lp) / 128))

    return sorted(pairs, key=cost)


def lower(graph: KernelGraph, p: AttentionPattern, splits: int, loop: int, cls=KernelGraph,
          cpu_threads: int = 0, block: int = 128) -> KernelGraph:
    """The graph with the attention replaced by the two block graphs (module doc), with
    ``block`` threads per block (Triton: block/32 warps) and ``cpu_threads`` OpenMP threads
    (0: all): same inputs in the same order, same outputs. GraphError (from the builders) if
    sizes do not divide."""
    g = cls(graph.backend)
    new = {t: g.new_input(graph.tensors[t].shape, graph.tensors[t].dtype, graph.names.get(t))
           for t in graph.inputs}
    for n in graph.ops:
        if id(n) in p.chain:
            if n.output == p.out:
                new[p.out] = _attention_blocks(g, p, new[p.q], new[p.kt], new[p.v], splits, loop,
                                               cpu_threads, block)
            continue
        new[n.output] = g._add(n.op, [new[i] for i in n.inputs], **n.attrs)
    for o in graph.outputs:
        g.mark_output(new[o])
    return g


def _attention_blocks(g, p: AttentionPattern, Q, Kt, V, splits: int, loop: int, cpu_threads: int, block: int):
    t1 = new_threadblock_graph(grid_dim=(p.B, splits, 1), block_dim=(block, 1, 1), forloop_range=loop,
                               reduction_dimx=64, cpu_threads=cpu_threads)
    bQ = t1.new_input(Q, (0, -1, -1), -1)
    bK = t1.new_input(Kt, (0, 2, -1), 2)
    bV = t1.new_input(V, (0, 1, -1), 1)
    s = t1.matmul(bQ, bK)                                        # [1, G, t]
    if p.scale != 1.0:
        s = t1.mul_scalar(s, p.scale)
    if p.knorm is not None:   # s_j * rsqrt(f * sum_d K[d, j]^2): the tile holds every d of its keys
        s = t1.div(s, t1.sqrt(t1.mul_scalar(t1.reduction(t1.square(bK), 1), p.knorm)))
    m, diff = t1.reduction_max(s, 2)
    e = t1.exp(t1.sub(s, m))
    rescale = t1.exp(diff)
    for o in (t1.forloop_accum_rescale(t1.matmul(e, bV), rescale),
              t1.forloop_accum_rescale(e, rescale, "sum"), t1.forloop_accum_max(m)):
        t1.new_output(o, (0, 2, -1))
    num, den, mx = g.customized([Q, Kt, V], t1)                # [B, G, Dv*splits], [B, G, splits] x2

    t2 = new_threadblock_graph(grid_dim=(p.B, 1, 1), block_dim=(block, 1, 1), forloop_range=splits,
                               reduction_dimx=64, cpu_threads=cpu_threads)
    bN, bD, bM = (t2.new_input(x, (0, -1, -1), 2) for x in (num, den, mx))
    m2, d2 = t2.reduction_max(bM, 2)
    w = t2.exp(t2.sub(bM, m2))
    r = t2.exp(d2)
    n2 = t2.forloop_accum_rescale(t2.mul(bN, w), r)
    dd = t2.forloop_accum_rescale(t2.mul(bD, w), r, "sum")
    t2.new_output(t2.div(n2, dd), (0, -1, -1))
    out, = g.customized([num, den, mx], t2)
    return out
