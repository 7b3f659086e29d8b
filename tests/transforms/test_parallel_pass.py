"""Merging parallel linear layers and convolutions (transforms/parallel.py): which groups merge,
the graph made of them, and that it computes what the original graph computes (the reference
interpreter, and the CPU and Triton kernels with the merge forced on)."""
import pytest
import torch
import torch.nn.functional as F

import yirage as yr
from yirage.backends import get_backend_impl
from yirage.backends.cpu import embed as cpu_embed
from yirage.ir.interpret import interpret
from yirage.runtime.executor import CompiledGraph
from yirage.tools import conformance
from yirage.transforms.conv import optimize_convolutions
from yirage.transforms.parallel import LinearGroup, merge_parallel_convs, merge_parallel_linears


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


# ---- parallel convolutions -------------------------------------------------------------------

def _branches(widths=(48, 16, 64), k=1):
    g, inputs, want = conformance._parallel_convs(2, 40, 5, 7, widths, k, stacked=False)
    return optimize_convolutions(g, channels_last=True), inputs, want


def test_branches_of_one_x_become_one_conv2d_stack_with_a_view_per_branch():
    """Three 1x1 branches with different widths and epilogues (BatchNorm + ReLU, bias + ReLU6,
    BatchNorm alone): ``decide`` gets their shapes and epilogues, the graph one
    ``conv2d_stack`` whose slices are the branches' outputs, and it computes what the original
    does (the reference interpreter) and what torch does."""
    g, inputs, want = _branches()
    seen = []
    ng = merge_parallel_convs(g, lambda case: seen.append(case) or True)
    (case,) = seen
    assert case.x_shape == (2, 5, 7, 40) and case.dtype == "float32"
    assert case.weights == ((48, 40, 1, 1), (16, 40, 1, 1), (64, 40, 1, 1))
    assert [(p.get("activation"), bool(p.get("bn")), p["bias"]) for p in case.parts] == [
        ("relu", True, False), ("hardtanh", False, True), (None, True, False)]
    assert _ops(ng).count("conv2d_stack") == 1 and "conv2d" not in _ops(ng)
    assert _ops(ng).count("slice_rows") == 3
    got = interpret(ng, inputs)
    for a, b in zip(got, interpret(g, inputs)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for i, w in want.items():
        torch.testing.assert_close(got[i], w, rtol=1e-4, atol=1e-4)


def test_convolutions_that_cannot_merge_stay_apart():
    """Different strides or windows, a residual (computed after the branches), a weight
    computed in the graph, or different inputs: nothing to merge (``decide`` is never asked),
    and a refusal keeps the graph."""
    g = yr.new_kernel_graph()
    x, x2 = g.new_input((1, 8, 6, 6)), g.new_input((1, 8, 6, 6))
    w = [g.new_input((4, 8, 1, 1)) for _ in range(4)]
    g.mark_output(g.conv2d(x, w[0]))
    g.mark_output(g.conv2d(x, w[1], stride=2))
    g.mark_output(g.conv2d(x, g.new_input((4, 8, 3, 3)), padding=1))
    g.mark_output(g.conv2d(x, g.relu(w[2])))
    g.mark_output(g.conv2d(x2, w[3]))
    g.mark_output(g.add(g.conv2d(x, w[0]), g.new_input((1, 4, 6, 6))))   # a residual
    opt = optimize_convolutions(g, channels_last=True)
    asked = []
    assert merge_parallel_convs(opt, lambda case: asked.append(case) or True) is opt and not asked
    g2, _, _ = _branches()
    assert merge_parallel_convs(g2, lambda case: False) is g2


@pytest.mark.parametrize("k", [1, 3], ids=["1x1", "3x3"])
def test_a_forced_conv_merge_computes_the_graph_on_the_kernels(backend, k):
    """The stacked graph on every backend's kernels (the CPU's one GEMM for 1x1 branches, each
    part as its conv2d otherwise) equals torch; with constant weights as torch.compile makes
    them, and after a BatchNorm statistic is written (the CPU repacks its folded weights)."""
    g, inputs, want = _branches(k=k)
    for t in inputs[1:]:
        cpu_embed.mark_constant(t)
    ng = merge_parallel_convs(g, lambda case: True)
    impl = get_backend_impl(backend)
    dev = [t.to(impl.torch_device) for t in inputs]
    compiled = CompiledGraph(ng, impl)
    with conformance.ieee_float32():   # cuDNN's TF32 convolutions (torch's default) are 1e-3 off float32
        for i, w in want.items():
            torch.testing.assert_close(compiled(dev)[i].cpu(), w, rtol=1e-4, atol=1e-4)
        dev[2].mul_(2.0)   # the first branch's BatchNorm running mean
        mean, var, bw, bb = (t.cpu() for t in dev[2:6])
        ref = F.batch_norm(F.conv2d(inputs[0], inputs[1], None, 1, k // 2), mean, var, bw, bb, training=False,
                           eps=1e-3).relu()
        torch.testing.assert_close(compiled(dev)[0].cpu(), ref, rtol=1e-4, atol=1e-4)
