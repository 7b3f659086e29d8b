"""Drawing kernel graphs: Graphviz DOT text, rendered to SVG/PNG when Graphviz is installed.

    g.visualize("model.svg")   # KernelGraph.visualize -> render(g, "model.svg")
    text = to_dot(g)           # the DOT text itself

The drawing has one node per graph input (name, shape, dtype), one per op (op name and its
key attrs), edges along tensors labelled with their shape and dtype, and one node per marked
output. Each threadblock graph (µGraph, ir/threadblock.py) held by ``customized`` ops (an
optimized graph's fused kernels) is drawn once, as a ``subgraph cluster_tb<n>`` holding its
grid_dim, block_dim, forloop_range and reduction_dimx, its inputs (kernel tensor, input_map,
forloop_dim, tile shape), its block ops (with their stage: in the loop, accumulated, after the
loop) and its outputs (output_map, kernel shape); a dashed edge joins each block-graph output
to the ``customized`` op that produces it. This follows Mirage's ``graph.visualize``.

Rendering uses the ``graphviz`` Python package and its ``dot`` binary, both optional: without
them ``render`` writes the DOT text instead (see ``render``).

This module is IR: it must never import a backend, the runtime or code generation.
"""
from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

from ..errors import GraphError

DOT_SUFFIXES = (".dot", ".gv")  # written as DOT text
IMAGE_SUFFIXES = (".svg", ".png")  # rendered with Graphviz when it is available
SUPPORTED_SUFFIXES = DOT_SUFFIXES + IMAGE_SUFFIXES

_STAGE_NAMES = {"loop": "in loop", "accum": "accumulated", "post": "after loop"}


def _quote(text) -> str:
    """``text`` as a DOT double-quoted string: backslashes and double quotes escaped, newlines
    as Graphviz's centred line break ``\\n``. Braces, brackets, ``;`` and ``<>`` are literal
    inside quotes (the drawing uses no record or HTML labels), so they need no escaping."""
    s = str(text).replace("\\", "\\\\").replace('"', '\\"')
    s = s.replace("\r\n", "\n").replace("\r", "\n").replace("\n", "\\n")
    return f'"{s}"'


def _fmt(value) -> str:
    """A short, readable attribute value: floats with 6 significant digits, sequences as
    tuples, dtypes by name, anything else by ``str`` (cut to 40 characters)."""
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, float):
        return f"{value:.6g}" if math.isfinite(value) else str(value)
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_fmt(v) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if hasattr(value, "value") and isinstance(getattr(value, "value"), str):  # enums (DType)
        return value.value
    s = str(value)
    return s if len(s) <= 40 else s[:37] + "..."


def _shape(shape) -> str:
    return "(" + ", ".join(str(int(d)) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def _attrs(attrs: dict, skip=()) -> str:
    return ", ".join(f"{k}={_fmt(v)}" for k, v in attrs.items() if k not in skip)


def _line(name: str, attrs: dict) -> str:
    """``  name [k="v", ...];`` with every value quoted."""
    return f"  {name} [" + ", ".join(f"{k}={_quote(v)}" for k, v in attrs.items()) + "];"


def _block_graph(lines: list[str], n: int, tb, tensor_label) -> None:
    """Append ``subgraph cluster_tb<n>`` drawing threadblock graph ``tb`` to ``lines``."""
    p = f"tb{n}_"
    header = (f"block graph tb{n}\ngrid_dim={_fmt(tb.grid_dim)}, block_dim={_fmt(tb.block_dim)}\n"
              f"forloop_range={tb.forloop_range}, reduction_dimx={tb.reduction_dimx}")
    lines.append(f"  subgraph cluster_tb{n} {{")
    lines.append(f"    label={_quote(header)};")
    lines.append('    style="rounded,dashed"; color="gray40"; fontname="Helvetica";')
    producer: dict[int, str] = {}  # stensor id -> DOT node making it
    for j, inp in enumerate(tb.inputs):
        name = f"{p}in{j}"
        tile = tb.tensors[inp.sid].shape
        label = (f"input {j}: {tensor_label(inp.tid)}\ninput_map={_fmt(inp.input_map)}, "
                 f"forloop_dim={inp.forloop_dim}\ntile {_shape(tile)} {inp.dtype.value}")
        lines.append("  " + _line(name, {"label": label, "shape": "box", "style": "filled",
                                         "fillcolor": "lightblue"}))
        producer[inp.sid] = name
    for i, op in enumerate(tb.ops):
        name = f"{p}op{i}"
        attrs = _attrs(op.attrs)
        label = op.op + (f"\n{attrs}" if attrs else "") + f"\n[{_STAGE_NAMES.get(op.stage, op.stage)}]"
        lines.append("  " + _line(name, {"label": label, "shape": "ellipse"}))
        for sid in op.inputs:
            if sid in producer:
                t = tb.tensors[sid]
                lines.append("  " + f"  {producer[sid]} -> {name} [label={_quote(_shape(t.shape))}];")
        for sid in op.outputs:
            producer[sid] = name
    for k, out in enumerate(tb.outputs):
        name = f"{p}out{k}"
        label = (f"output {k}\noutput_map={_fmt(out.output_map)}, forloop_dim={out.forloop_dim}\n"
                 f"{_shape(out.dshape)}")
        lines.append("  " + _line(name, {"label": label, "shape": "box", "style": "filled",
                                         "fillcolor": "lightyellow"}))
        if out.sid in producer:
            t = tb.tensors[out.sid]
            lines.append("  " + f"  {producer[out.sid]} -> {name} [label={_quote(_shape(t.shape))}];")
    lines.append("  }")


def to_dot(graph) -> str:
    """Graphviz DOT text drawing kernel graph ``graph`` (a ``KernelGraph``/``KNGraph``).

    Nodes: ``t<id>`` per input (name, shape, dtype), ``op<i>`` per op (name and attrs; a
    ``customized`` op names its block graph and output), ``out<k>`` per marked output; edges
    along tensors, labelled ``shape dtype``. Every distinct threadblock graph of the
    ``customized`` ops is a ``subgraph cluster_tb<n>`` (see the module docstring). Labels are
    quoted and escaped, so any tensor name is safe.

    Returns the DOT text (a ``digraph``). Raises GraphError when ``graph`` is not a kernel graph.
    """
    from .graph import KernelGraph
    if not isinstance(graph, KernelGraph):
        raise GraphError(f"visualize: expected a kernel graph (yr.new_kernel_graph), got "
                         f"{type(graph).__name__}")

    def tensor_label(tid: int) -> str:
        t = graph.tensors[tid]
        name = graph.names.get(tid)
        return (f"{name} (t{tid})" if name else f"t{tid}") + f" {_shape(t.shape)} {t.dtype.value}"

    lines = ["digraph kernel_graph {", '  graph [rankdir="TB", fontname="Helvetica", compound="true"];',
             '  node [fontname="Helvetica", fontsize="11"];', '  edge [fontname="Helvetica", fontsize="9"];']
    producer: dict[int, str] = {}  # kernel tensor id -> DOT node making it
    for k, tid in enumerate(graph.inputs):
        t = graph.tensors[tid]
        name = graph.names.get(tid)
        label = f"input {k}: " + (f"{name} (t{tid})" if name else f"t{tid}") + \
            f"\n{_shape(t.shape)} {t.dtype.value}"
        lines.append(_line(f"t{tid}", {"label": label, "shape": "box", "style": "filled",
                                       "fillcolor": "lightblue"}))
        producer[tid] = f"t{tid}"

    blocks: dict[int, int] = {}  # id(TBGraph) -> n, in order of first use
    tbs = []
    links = []  # (block-graph output node, customized op node)
    for i, node in enumerate(graph.ops):
        if node.op == "customized" and "tb" in node.attrs:
            tb = node.attrs["tb"]
            if id(tb) not in blocks:
                blocks[id(tb)] = len(tbs)
                tbs.append(tb)
            n, k = blocks[id(tb)], node.attrs.get("output", 0)
            label = (f"customized\nblock graph tb{n}, output {k}\ngrid_dim={_fmt(tb.grid_dim)}, "
                     f"forloop_range={tb.forloop_range}")
            links.append((f"tb{n}_out{k}", f"op{i}"))
            style = {"shape": "box3d", "style": "filled", "fillcolor": "palegreen"}
        else:
            attrs = _attrs(node.attrs)
            label = node.op + (f"\n{attrs}" if attrs else "")
            style = {"shape": "ellipse"}
        lines.append(_line(f"op{i}", {"label": label, **style}))
        for tid in node.inputs:
            t = graph.tensors[tid]
            src = producer.get(tid, f"t{tid}")
            lines.append(f"  {src} -> op{i} [label={_quote(_shape(t.shape) + ' ' + t.dtype.value)}];")
        producer[node.output] = f"op{i}"

    for k, tid in enumerate(graph.outputs):
        t = graph.tensors[tid]
        lines.append(_line(f"out{k}", {"label": f"output {k}\n{_shape(t.shape)} {t.dtype.value}",
                                       "shape": "doubleoctagon", "style": "filled",
                                       "fillcolor": "lightyellow"}))
        lines.append(f"  {producer.get(tid, f't{tid}')} -> out{k};")

    for n, tb in enumerate(tbs):
        _block_graph(lines, n, tb, tensor_label)
    for src, dst in links:
        lines.append(f'  {src} -> {dst} [style="dashed", color="gray40", constraint="false"];')
    lines.append("}")
    return "\n".join(lines) + "\n"


def _renderer():
    """The ``graphviz`` module when it is importable and the ``dot`` binary is on PATH, else None."""
    if shutil.which("dot") is None:
        return None
    try:
        import graphviz
    except ImportError:
        return None
    return graphviz


def render(graph, path) -> str:
    """Draw kernel graph ``graph`` into the file ``path`` (a str or path-like).

    By the suffix of ``path`` (case-insensitive):

    * ``.dot`` or ``.gv``: the DOT text of ``to_dot(graph)``.
    * ``.svg`` or ``.png``: the drawing rendered by Graphviz, when the ``graphviz`` Python
      package is importable and the ``dot`` binary is on PATH. Without them the DOT text is
      written instead, to ``path`` with its suffix replaced by ``.dot`` (``g.svg`` ->
      ``g.dot``), so an image file never holds text; render it later with
      ``dot -Tsvg g.dot -o g.svg``.

    Returns the path written, as a str (check it: it ends in ``.dot`` when Graphviz was
    missing). Raises GraphError for any other suffix (naming the supported ones) or when
    ``graph`` is not a kernel graph; OSError when the file cannot be written; Graphviz's own
    errors if ``dot`` fails.
    """
    path = Path(os.fspath(path))
    suffix = path.suffix.lower()
    if suffix not in SUPPORTED_SUFFIXES:
        raise GraphError(f"visualize: cannot write {str(path)!r}: the file name must end in one of "
                         f"{', '.join(SUPPORTED_SUFFIXES)} (got {suffix or 'no suffix'!r})")
    text = to_dot(graph)
    if suffix in IMAGE_SUFFIXES:
        graphviz = _renderer()
        if graphviz is not None:
            try:
                data = graphviz.Source(text).pipe(format=suffix[1:])
            except graphviz.ExecutableNotFound:
                pass  # `dot` vanished or is not runnable: fall back to the DOT text
            else:
                path.write_bytes(data)
                return str(path)
        path = path.with_suffix(".dot")
    path.write_text(text, encoding="utf-8")
    return str(path)
