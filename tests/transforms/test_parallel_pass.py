"""Merging parallel linear layers (transforms/parallel.py): which groups merge, the graph made
of them, and that it computes what the original graph computes (the reference interpreter, and
the CPU and Triton kernels with the merge forced on)."""
import pytest
import torch

import yirage as yr
from yirage.backends import cpu_embed, get_backend_impl
from yirage.ir.interpret import interpret
from yirage.runtime.executor import CompiledGraph
from yirage.tools import conformance
from yirage.transforms.parallel import LinearGroup, merge_parallel_linears


def _ops(g):
    return [n.op for n in g.ops]


def _qkv():
    g, inputs, want = conformance._parallel_linears(9, 64)
    return g, inputs, want


def test_qkv_projections_become_one_stacked_linear_with_views_for_its_planes():
    g, inputs, want = _qkv()
    seen = []
    ng = merge_parallel_linears(g, lambda case: seen.append(case) or True)
    assert seen == [LinearGroup(M=9, N=64, K=64, parts=3, dtype="float32", layout="nk", bias=True)]
    assert _ops(ng)[:7] == ["linear_stack", "slice_rows", "reshape", "slice_rows", "reshape", "slice_rows",
                            "reshape"]
    assert "linear" not in _ops(ng)
    for a, b in zip(interpret(ng, inputs), interpret(g, inputs)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for i, w in want.items():
        torch.testing.assert_close(interpret(ng, inputs)[i], w, rtol=1e-4, atol=1e-4)


def test_the_backend_decides_and_a_refusal_keeps_the_graph():
    g, _, _ = _qkv()
    assert merge_parallel_linears(g, lambda case: False) is g


def test_linears_that_cannot_merge_stay_apart():
    """Different weight shapes, a weight computed in the graph, a quantized weight, or a
    single linear: nothing to merge (``decide`` is never asked)."""
    g = yr.new_kernel_graph()
    x = g.new_input((4, 64))
    w1, w2 = g.new_input((64, 64)), g.new_input((32, 64))
    wq = g.new_input((64, 64), yr.q8_0)
    computed = g.relu(g.new_input((64, 64)))
    for w in (w1, w2, wq, computed):
        g.mark_output(g.linear(x, w))
    asked = []
    assert merge_parallel_linears(g, lambda case: asked.append(case) or True) is g and not asked


@pytest.mark.parametrize("constant", [True, False], ids=["constant", "plain"])
def test_a_forced_merge_computes_the_graph_on_the_kernels(backend, constant):
    """The merged graph on every backend's kernels (the CPU's stacked packed GEMM when the
    weights are constant, each part as its linear otherwise) equals plain torch."""
    g, inputs, want = _qkv()
    if constant:
        for t in inputs[1:]:
            cpu_embed.mark_constant(t)
    ng = merge_parallel_linears(g, lambda case: True)
    impl = get_backend_impl(backend)
    out = CompiledGraph(ng, impl)([t.to(impl.torch_device) for t in inputs])
    for i, w in want.items():
        torch.testing.assert_close(out[i].cpu(), w, rtol=1e-4, atol=1e-4)


def test_linears_of_separate_reshapes_of_one_tensor_merge():
    """torch.compile's graphs flatten x once per linear: reshapes of one tensor to one shape,
    through any chain of reshapes, count as the same input."""
    g = yr.new_kernel_graph()
    x = g.new_input((2, 5, 32))
    ws = [g.new_input((32, 32)) for _ in range(3)]
    flat = [g.reshape(x, (10, 32)) for _ in range(2)] + [g.reshape(x, (5, 64))]
    outs = [g.linear(flat[0], ws[0]), g.linear(flat[1], ws[1]), g.linear(g.reshape(flat[2], (10, 32)), ws[2])]
    for o in outs:
        g.mark_output(o)
    seen = []
    ng = merge_parallel_linears(g, lambda case: seen.append(case) or True)
    assert [c.parts for c in seen] == [3] and _ops(ng).count("linear_stack") == 1
    inputs = [torch.randn(2, 5, 32)] + [torch.randn(32, 32) for _ in range(3)]
    for a, b in zip(interpret(ng, inputs), interpret(g, inputs)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
