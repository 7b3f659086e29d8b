"""``g.visualize(path)`` (ir/visualize.py): the DOT text of a kernel graph names every input,
op and output, draws each customized op's block graph as a cluster (grid_dim, forloop_range,
input/output maps), escapes any tensor name and parses as DOT (with the ``graphviz`` package
or the ``dot`` binary when present, always with the small DOT parser below); ``.dot`` files
are written as text, ``.svg`` is rendered when Graphviz is installed and falls back to
``.dot`` otherwise, and any other suffix raises GraphError."""
import re
import shutil
import subprocess

import pytest

import yirage as yr
from yirage.errors import GraphError
from yirage.ir import visualize as viz
from yirage.ir.visualize import render, to_dot

F32 = yr.float32


# ---- a small DOT parser: the grammar subset of https://graphviz.org/doc/info/lang.html -------

_TOKEN = re.compile(r'\s+|(?P<q>"(?:[^"\\]|\\.)*")|(?P<arrow>->|--)|(?P<p>[{}\[\]=;,])'
                    r'|(?P<id>[A-Za-z_][A-Za-z_0-9]*|-?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?))', re.S)


def _tokens(text: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        assert m, f"unexpected character {text[pos]!r} at {pos}: {text[pos:pos + 40]!r}"
        pos = m.end()
        if m.lastgroup == "q":  # what Graphviz shows: \" -> ", \\ -> \, \n -> line break
            body = re.sub(r'\\(.)', lambda e: {"n": "\n", '"': '"', "\\": "\\"}.get(e[1], "\\" + e[1]),
                          m[0][1:-1])
            out.append(("id", body))
        elif m.lastgroup:
            out.append((m.lastgroup, m[0]))
    return out


def parse_dot(text: str) -> dict:
    """Parse a DOT digraph: {"nodes": {name: attrs}, "edges": [(src, dst, attrs)],
    "clusters": {name: {"attrs": {...}, "nodes": {names}}}}; AssertionError if malformed."""
    toks, i = _tokens(text), 0
    g = {"nodes": {}, "edges": [], "clusters": {}}

    def peek(k=0):
        return toks[i + k] if i + k < len(toks) else ("eof", "")

    def take(kind=None, value=None):
        nonlocal i
        tok = peek()
        assert (kind is None or tok[0] == kind) and (value is None or tok[1] == value), \
            f"expected {value or kind}, got {tok!r} (token {i})"
        i += 1
        return tok[1]

    def attr_list() -> dict:
        attrs = {}
        while peek() == ("p", "["):
            take()
            while peek() != ("p", "]"):
                k = take("id")
                take("p", "=")
                attrs[k] = take("id")
                if peek() in (("p", ","), ("p", ";")):
                    take()
            take("p", "]")
        return attrs

    def stmts(cluster) -> None:
        while peek() != ("p", "}"):
            if peek() == ("id", "subgraph"):
                take()
                name = take("id") if peek()[0] == "id" else f"anon{i}"
                sub = g["clusters"].setdefault(name, {"attrs": {}, "nodes": set()})
                take("p", "{")
                stmts(sub)
                take("p", "}")
            elif peek()[0] == "id" and peek()[1] in ("graph", "node", "edge") and peek(1) == ("p", "["):
                take()
                attr_list()
            elif peek()[0] == "id" and peek(1) == ("p", "="):
                k = take()
                take()
                (cluster or {"attrs": {}})["attrs"][k] = take("id")
            else:
                chain = [take("id")]
                while peek()[0] == "arrow":
                    assert take() == "->", "a digraph uses -> edges"
                    chain.append(take("id"))
                attrs = attr_list()
                if len(chain) == 1:
                    g["nodes"].setdefault(chain[0], {}).update(attrs)
                else:
                    for n in chain:
                        g["nodes"].setdefault(n, {})
                    g["edges"] += [(a, b, attrs) for a, b in zip(chain, chain[1:])]
                if cluster is not None:
                    cluster["nodes"].update(chain)
            if peek() == ("p", ";"):
                take()

    take("id", "digraph")
    if peek()[0] == "id":
        take()
    take("p", "{")
    stmts(None)
    take("p", "}")
    take("eof")
    return g


def check_parses(text: str) -> dict:
    """``text`` parses with the DOT parser above and, where installed, with the ``graphviz``
    package and Graphviz's own ``dot``; returns the parse."""
    parsed = parse_dot(text)
    try:
        import graphviz
    except ImportError:
        graphviz = None
    if graphviz is not None:
        assert "digraph" in graphviz.Source(text).source
    if shutil.which("dot"):
        proc = subprocess.run(["dot", "-Tcanon"], input=text, capture_output=True, text=True)
        assert proc.returncode == 0 and "syntax error" not in proc.stderr, proc.stderr
    return parsed


def _labels(parsed: dict) -> list[str]:
    return [a.get("label", "") for a in parsed["nodes"].values()]


# ---- graphs -----------------------------------------------------------------------------------

def _mlp_graph():
    """silu(rms_norm(x) @ w) with named inputs."""
    g = yr.new_kernel_graph()
    X = g.new_input(dims=(8, 96), dtype=F32, name="x")
    W = g.new_input(dims=(96, 64), dtype=F32, name="w")
    g.mark_output(g.silu(g.matmul(g.rms_norm(X, normalized_shape=(96,)), W)))
    return g


def _customized_graph(two_outputs=False):
    """Mirage's RMSNorm + matmul µGraph (tests/ir/test_threadblock.py), then a silu; with
    ``two_outputs`` the block graph also writes the plain matmul, giving two customized ops."""
    M, K, N, F = 5, 33, 21, 3
    g = yr.new_kernel_graph()
    X, W = g.new_input(dims=(M, K), dtype=F32, name="X"), g.new_input(dims=(K, N), dtype=F32, name="W")
    tb = yr.new_threadblock_graph(grid_dim=(3, 1, 1), block_dim=(128, 1, 1), forloop_range=F, reduction_dimx=64)
    tX = tb.new_input(dtensor=X, input_map=(-1, -1, -1), forloop_dim=1)
    tW = tb.new_input(dtensor=W, input_map=(1, -1, -1), forloop_dim=0)
    tAccX = tb.forloop_accum(tX, "rms")
    tAccM = tb.forloop_accum(tb.matmul(tX, tW))
    tb.new_output(stensor=tb.div(tAccM, tAccX), output_map=(1, -1, -1))
    if two_outputs:
        tb.new_output(stensor=tAccM, output_map=(1, -1, -1))
    outs = g.customized([X, W], tb)
    for o in outs:
        g.mark_output(g.silu(o))
    return g


# ---- tests ------------------------------------------------------------------------------------

def test_dot_names_every_input_op_and_output():
    g = _mlp_graph()
    text = to_dot(g)
    assert text.startswith("digraph ")
    parsed = check_parses(text)
    labels = _labels(parsed)
    for op in ("rms_norm", "matmul", "silu"):  # one node per op
        assert sum(lab.split("\n")[0] == op for lab in labels) == 1, (op, labels)
    assert any("normalized_shape=(96,)" in lab and "eps=1e-06" in lab for lab in labels)
    for tid, name, shape in ((0, "x", "(8, 96)"), (1, "w", "(96, 64)")):  # inputs: name, shape, dtype
        lab = parsed["nodes"][f"t{tid}"]["label"]
        assert name in lab and shape in lab and "float32" in lab
    out = [lab for lab in labels if lab.startswith("output 0")]
    assert out == ["output 0\n(8, 64) float32"]
    assert parsed["nodes"]["out0"]["shape"] == "doubleoctagon"
    # edges follow the tensors: x -> rms_norm -> matmul <- w, matmul -> silu -> output
    edges = {(a, b): e.get("label") for a, b, e in parsed["edges"]}
    assert edges == {("t0", "op0"): "(8, 96) float32", ("op0", "op1"): "(8, 96) float32",
                     ("t1", "op1"): "(96, 64) float32", ("op1", "op2"): "(8, 64) float32",
                     ("op2", "out0"): None}
    assert parsed["clusters"] == {}


def test_customized_op_draws_its_block_graph_as_a_cluster():
    g = _customized_graph()
    parsed = check_parses(to_dot(g))
    assert list(parsed["clusters"]) == ["cluster_tb0"]
    cluster = parsed["clusters"]["cluster_tb0"]
    header = cluster["attrs"]["label"]
    assert "grid_dim=(3, 1, 1)" in header and "forloop_range=3" in header
    assert "block_dim=(128, 1, 1)" in header and "reduction_dimx=64" in header
    nodes = parsed["nodes"]
    assert cluster["nodes"] == {"tb0_in0", "tb0_in1", "tb0_op0", "tb0_op1", "tb0_op2", "tb0_op3", "tb0_out0"}
    assert "X (t0)" in nodes["tb0_in0"]["label"]
    assert "input_map=(-1, -1, -1), forloop_dim=1" in nodes["tb0_in0"]["label"]
    assert "tile (5, 11)" in nodes["tb0_in0"]["label"]
    assert "input_map=(1, -1, -1), forloop_dim=0" in nodes["tb0_in1"]["label"]
    assert "tile (11, 7)" in nodes["tb0_in1"]["label"]
    ops = [nodes[f"tb0_op{i}"]["label"].split("\n") for i in range(4)]
    assert [o[0] for o in ops] == ["forloop_accum", "matmul", "forloop_accum", "div"]
    assert ops[0][1] == "acc=rms" and ops[3][-1] == "[after loop]" and ops[1][-1] == "[in loop]"
    assert "output_map=(1, -1, -1)" in nodes["tb0_out0"]["label"] and "(5, 21)" in nodes["tb0_out0"]["label"]
    # the kernel-level op names its block graph, and the block graph's output links to it
    assert nodes["op0"]["label"].startswith("customized\nblock graph tb0, output 0")
    edges = {(a, b): e for a, b, e in parsed["edges"]}
    assert edges[("tb0_out0", "op0")]["style"] == "dashed"
    assert ("tb0_op3", "tb0_out0") in edges and ("tb0_op1", "tb0_op2") in edges
    assert ("t0", "op0") in edges and ("t1", "op0") in edges and ("op0", "op1") in edges


def test_a_block_graph_with_two_outputs_is_drawn_once():
    g = _customized_graph(two_outputs=True)
    parsed = check_parses(to_dot(g))
    assert list(parsed["clusters"]) == ["cluster_tb0"]
    edges = {(a, b) for a, b, _ in parsed["edges"]}
    assert {("tb0_out0", "op0"), ("tb0_out1", "op1")} <= edges
    assert parsed["nodes"]["op1"]["label"].startswith("customized\nblock graph tb0, output 1")


def test_labels_are_escaped():
    g = yr.new_kernel_graph()
    name = 'a "quoted" {brace} [x]; <y> back\\slash\nsecond line'
    X = g.new_input(dims=(4, 8), dtype=F32, name=name)
    g.mark_output(g.relu(X))
    text = to_dot(g)
    assert r'a \"quoted\" {brace}' in text and r"back\\slash\nsecond line" in text
    parsed = check_parses(text)
    assert parsed["nodes"]["t0"]["label"] == f"input 0: {name} (t0)\n(4, 8) float32"


def test_visualize_dot_writes_the_text(tmp_path):
    g = _customized_graph()
    for target in (tmp_path / "g.dot", str(tmp_path / "h.GV")):
        written = g.visualize(target)
        assert written == str(target)
        assert open(written, encoding="utf-8").read() == to_dot(g)
    assert render(_mlp_graph(), tmp_path / "m.dot") == str(tmp_path / "m.dot")
    check_parses((tmp_path / "m.dot").read_text())


@pytest.mark.parametrize("name", ["g.pdf", "g.jpg", "g", "g.svg.txt"])
def test_an_unsupported_suffix_raises(tmp_path, name):
    with pytest.raises(GraphError, match=r"\.dot.*\.svg.*\.png"):
        _mlp_graph().visualize(tmp_path / name)
    assert list(tmp_path.iterdir()) == []


def test_to_dot_needs_a_kernel_graph():
    tb = yr.new_threadblock_graph(grid_dim=(1, 1, 1))
    with pytest.raises(GraphError, match="kernel graph"):
        to_dot(tb)


def test_an_image_without_graphviz_falls_back_to_dot(tmp_path, monkeypatch):
    """No ``dot`` binary: ``g.svg`` writes the DOT text to ``g.dot`` and returns that path."""
    monkeypatch.setattr(viz.shutil, "which", lambda name: None)
    g = _mlp_graph()
    for suffix in (".svg", ".png"):
        written = g.visualize(tmp_path / f"g{suffix}")
        assert written == str(tmp_path / "g.dot")
        assert not (tmp_path / f"g{suffix}").exists()
        assert (tmp_path / "g.dot").read_text() == to_dot(g)


def test_svg_renders_with_graphviz(tmp_path):
    if shutil.which("dot") is None:
        pytest.skip("the Graphviz `dot` binary is not on PATH")
    pytest.importorskip("graphviz", reason="the `graphviz` Python package is not installed")
    g = _customized_graph()
    written = g.visualize(tmp_path / "g.svg")
    assert written == str(tmp_path / "g.svg")
    svg = (tmp_path / "g.svg").read_text()
    assert "<svg" in svg and "cluster_tb0" in svg and "forloop_accum" in svg and "customized" in svg
    assert not (tmp_path / "g.dot").exists()
