"""``yr.explain(model, *inputs)``: what torch.compile with yirage does to a model, as a report.

It compiles ``model`` with a recording ``YirageBackend``, runs it once on ``inputs`` under
``torch.no_grad()`` and returns an ``ExplainReport``: for each graph dynamo captured, its
partitions (their ops, where they run) and every op that stayed in torch with the reason.

This module must never change the model or its parameters, nor reset dynamo's caches.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .compiler import YirageBackend, own_recompiles
from .partition import GraphReport


#: what a report without graphs says: dynamo ran the call without handing yirage a graph
NO_GRAPH = ("dynamo gave yirage no graph: the call ran eager (a function without tensor ops, "
            "torch._dynamo.disable, or a dynamo recompile limit; TORCH_LOGS=recompiles,graph_breaks shows which)")


@dataclass
class ExplainReport:
    """The partitions and torch ops of every graph of one compiled model.

    Attributes:
        graphs: one ``GraphReport`` per graph dynamo captured (several after graph breaks).
        outputs: what the compiled model returned on the example inputs.
    """

    graphs: list[GraphReport]
    outputs: object = None

    @property
    def partitions(self):
        """Every partition of every graph (``PartitionReport``)."""
        return [p for g in self.graphs for p in g.partitions]

    @property
    def yirage_partitions(self):
        """The partitions that run on yirage (not fallen back)."""
        return [p for p in self.partitions if p.runs_in == "yirage"]

    @property
    def torch_ops(self):
        """Every op that runs in torch (``TorchOp``: node, op, reason), including the ops of
        partitions that fell back."""
        ops = [t for g in self.graphs for t in g.torch_ops]
        for p in self.partitions:
            if p.runs_in != "yirage":
                ops += [_fallen(p, op) for op in p.ops]
        return ops

    @property
    def cache_hits(self) -> int:
        """Partition variants loaded from the compile cache (dynamo/cache.py) while compiling."""
        return sum(p.cache_hits for p in self.partitions)

    @property
    def cache_misses(self) -> int:
        """Partition variants lowered and compiled (then stored in the compile cache)."""
        return sum(p.cache_misses for p in self.partitions)

    @property
    def num_yirage_ops(self) -> int:
        """ATen ops (reshapes included) that run inside yirage partitions."""
        return sum(len(p.ops) for p in self.yirage_partitions)

    def to_dict(self) -> dict:
        """The report as plain data (JSON-serializable)."""
        return {"cache_hits": self.cache_hits, "cache_misses": self.cache_misses,
                "graphs": [{"reason": g.reason,
                            "partitions": [{"name": p.name, "runs_in": p.runs_in, "reason": p.reason,
                                            "compiled_as": p.compiled_as, "symbolic": p.symbolic,
                                            "variants": p.variants, "cache_hits": p.cache_hits,
                                            "cache_misses": p.cache_misses,
                                            "ops": list(p.ops)} for p in g.partitions],
                            "torch_ops": [{"node": t.node, "op": t.op, "reason": t.reason} for t in g.torch_ops]}
                           for g in self.graphs]}

    def __str__(self) -> str:
        lines = [f"yirage explain: {len(self.graphs)} graph(s), {len(self.yirage_partitions)} partition(s) "
                 f"on yirage with {self.num_yirage_ops} op(s), {len(self.torch_ops)} op(s) in torch; "
                 f"compile cache: {self.cache_hits} hit(s), {self.cache_misses} miss(es)"]
        if not self.graphs:
            lines.append(NO_GRAPH)
        for i, g in enumerate(self.graphs):
            lines.append(f"graph {i}" + (f": runs eager: {g.reason}" if g.reason else ""))
            if g.partitions:
                lines.append(f"  {'partition':<22} {'runs in':<8} {'ops':>4}  op list / reason")
                for p in g.partitions:
                    detail = ", ".join(_short(o) for o in p.ops)
                    lines.append(f"  {p.name:<22} {p.runs_in:<8} {len(p.ops):>4}  {detail}")
                    if p.reason:
                        lines.append(f"  {'':<36}why: {p.reason}")
                    elif p.compiled_as:
                        shapes = f"; {p.variants} input signature(s), symbolic shapes" if p.symbolic else ""
                        lines.append(f"  {'':<36}as {p.compiled_as}{shapes}")
            if g.torch_ops:
                lines.append(f"  {'torch node':<22} {'op':<28} why not in yirage")
                for t in g.torch_ops:
                    lines.append(f"  {t.node:<22} {_short(t.op):<28} {t.reason}")
        return "\n".join(lines)


def _short(op: str) -> str:
    return op[len("aten."):] if op.startswith("aten.") else op


def _fallen(p, op: str):
    from .partition import TorchOp
    return TorchOp(p.name, op, f"partition {p.name} fell back: {p.reason}")


def explain(model, *inputs, mode: str | None = None, options: dict | None = None, **kwargs) -> ExplainReport:
    """Compile ``model`` (a ``torch.nn.Module`` or function) for yirage, run it once on
    ``inputs`` (and keyword ``kwargs``) under ``torch.no_grad()``, and report what ran where.

    Returns an ``ExplainReport``; ``print(report)`` shows a table of the partitions (ops, where
    they run) and of every op left in torch with the reason.

    Raises TorchCompileError for bad ``mode``/``options`` (see ``yr.compile``), and whatever
    the model raises on ``inputs``.
    """
    be = YirageBackend(mode, options)
    compiled = torch.compile(model, backend=be, **own_recompiles())
    with torch.no_grad():
        outputs = compiled(*inputs, **kwargs)
    return ExplainReport(list(be.reports), outputs)
