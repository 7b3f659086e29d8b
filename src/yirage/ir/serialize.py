"""JSON form of a KernelGraph: ``to_json(graph)`` and ``from_json(text)`` round-trip exactly.

Schema: {"version": 1, "backend", "tensors": [{"shape", "dtype", "name"?}],
"inputs": [ids], "ops": [{"op", "inputs": [ids], "attrs", "output"}], "outputs": [ids]}.
Loading re-runs every shape rule, so a hand-edited file gets the same errors as the builder.
A ``customized`` op's threadblock graph is stored in its attrs as ``TBGraph.to_dict()``.
"""
from __future__ import annotations

import json

from ..dtypes import DType
from .graph import KernelGraph, OpNode
from .ops import OPS, TensorType

VERSION = 1


def to_json(graph: KernelGraph) -> str:
    """The graph as a JSON document (schema above)."""
    tensors = []
    for tid, t in enumerate(graph.tensors):
        entry = {"shape": list(t.shape), "dtype": t.dtype.value}
        if tid in graph.names:
            entry["name"] = graph.names[tid]
        tensors.append(entry)
    ops = [{"op": n.op, "inputs": n.inputs, "attrs": _jsonable(n.attrs), "output": n.output}
           for n in graph.ops]
    return json.dumps({"version": VERSION, "backend": graph.backend, "tensors": tensors,
                       "inputs": graph.inputs, "ops": ops, "outputs": graph.outputs})


def _jsonable(attrs: dict) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v.to_dict() if hasattr(v, "to_dict") else v
            for k, v in attrs.items()}


def from_json(text: str, cls: type[KernelGraph] = KernelGraph) -> KernelGraph:
    """Rebuild a graph as an instance of ``cls`` (a KernelGraph subclass, e.g. the front
    end's KNGraph); ValueError if the document is malformed or breaks a shape rule."""
    doc = json.loads(text)
    if doc.get("version") != VERSION:
        raise ValueError(f"unsupported kernel-graph JSON version {doc.get('version')!r}, expected {VERSION}")
    g = cls(doc.get("backend"))
    types = [TensorType(tuple(t["shape"]), DType(t["dtype"])) for t in doc["tensors"]]
    g.tensors = list(types)
    g.names = {i: t["name"] for i, t in enumerate(doc["tensors"]) if "name" in t}
    g.inputs = list(doc["inputs"])
    for o in doc["ops"]:
        attrs = {k: tuple(v) if k in ("normalized_shape", "shape") else v for k, v in o["attrs"].items()}
        if o["op"] == "customized":  # a threadblock graph (ir/threadblock.py)
            from .threadblock import TBGraph
            attrs["tb"] = TBGraph.from_dict(attrs["tb"], g)
        inferred = OPS[o["op"]].infer([types[i] for i in o["inputs"]], attrs)
        if inferred != types[o["output"]]:
            raise ValueError(f"{o['op']}: stored output type {types[o['output']]} != inferred {inferred}")
        g.ops.append(OpNode(o["op"], list(o["inputs"]), attrs, o["output"]))
    g.outputs = list(doc["outputs"])
    return g
