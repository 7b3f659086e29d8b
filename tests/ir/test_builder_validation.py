"""The kernel-graph builder and graph calls reject bad arguments with one GraphError naming
the op (or the input) and the rule; valid edge values build graphs that match torch."""
import math

import numpy as np
import pytest
import torch

import yirage as yr


@pytest.fixture
def g():
    return yr.new_kernel_graph()


@pytest.fixture
def x(g):
    return g.new_input((4, 8))


BAD_BUILDS = [
    # dims: positive integers, never truncated
    (lambda g, x: g.new_input((2.7, 8)), r"new_input: dims must be positive integers, got \(2\.7, 8\): dim 0 is 2\.7"),
    (lambda g, x: g.new_input((8.0, 8)), r"dim 0 is 8\.0 \(float\); use int\(8\.0\)"),
    (lambda g, x: g.new_input((True, 8)), r"dim 0 is True \(bool\)"),
    (lambda g, x: g.new_input((4, 0)), r"dim 1 is 0"),
    (lambda g, x: g.new_input((4, -2)), r"dim 1 is -2"),
    (lambda g, x: g.new_input((4, np.float64(8))), r"dim 1 is"),
    (lambda g, x: g.new_input("48"), r"new_input: dims must be a tuple of positive integers"),
    (lambda g, x: g.new_input(None), r"new_input: dims must be a tuple of positive integers"),
    (lambda g, x: g.new_input((4, 8), "float8"), r"new_input: unknown dtype 'float8'"),
    (lambda g, x: g.new_input((4, 33), yr.q4_1), r"new_input: q4_1 needs a last dim divisible by 32"),
    (lambda g, x: g.linear(g.new_input((2, 32)), g.new_input((40, 32), yr.DType.q4_1r16)),
     r"linear: .*q4_1r16 weight needs out_features a multiple of 16, got 40"),
    (lambda g, x: g.embedding(g.new_input((3,), yr.int64), g.new_input((48, 32), yr.DType.q4_1r16)),
     r"embedding: .*q4_1r16 is a linear weight layout; keep an embedding table in q4_1"),
    (lambda g, x: g.new_input((4, 8), name=3), r"new_input: name must be a string"),
    # clamp: bounds never NaN, min <= max
    (lambda g, x: g.clamp(x, math.nan, math.nan), r"clamp: min_val must not be NaN"),
    (lambda g, x: g.clamp(x, 0.0, math.nan), r"clamp: max_val must not be NaN"),
    (lambda g, x: g.clamp(x, 2.0, 1.0), r"clamp: min_val 2\.0 is greater than max_val 1\.0"),
    (lambda g, x: g.clamp(x, "0", 1.0), r"clamp: min_val must be a real number"),
    (lambda g, x: g.clamp(x, None, 1.0), r"clamp: min_val must be a real number"),
    # scale, eps, attention scale: finite numbers
    (lambda g, x: g.scale(x, math.inf), r"scale: factor must be finite"),
    (lambda g, x: g.scale(x, math.nan), r"scale: factor must not be NaN"),
    (lambda g, x: g.scale(x, True), r"scale: factor must be a real number"),
    (lambda g, x: g.rms_norm(x, (8,), eps=-1e-6), r"rms_norm: eps must be >= 0"),
    (lambda g, x: g.rms_norm(x, (8,), eps=math.inf), r"rms_norm: eps must be finite"),
    (lambda g, x: g.rms_norm(x, (8,), eps=math.nan), r"rms_norm: eps must not be NaN"),
    (lambda g, x: g.rms_norm(x, (8.0,)), r"rms_norm: normalized_shape must be positive integers"),
    # dims of ops: integers
    (lambda g, x: g.softmax(x, 1.0), r"softmax: dim must be an integer, got 1\.0"),
    (lambda g, x: g.softmax(x, None), r"softmax: dim must be an integer"),
    (lambda g, x: g.reduction(x, "1"), r"reduction: dim must be an integer"),
    (lambda g, x: g.argmax(x, True), r"argmax: dim must be an integer, got True"),
    (lambda g, x: g.softmax(x, 2), r"softmax: .*out of range"),
    (lambda g, x: g.reshape(x, (2, 16.0)), r"reshape: shape must be positive integers"),
    (lambda g, x: g.reshape(x, (-1, 8)), r"reshape: shape must be positive integers"),
    (lambda g, x: g.slice_rows(x, 2, 2), r"slice_rows: .*need 0 <= start < end <= 4"),
    (lambda g, x: g.slice_rows(x, 3, 1), r"slice_rows: .*need 0 <= start < end"),
    (lambda g, x: g.slice_rows(x, 0.5, 2), r"slice_rows: start must be an integer"),
    # inputs: DTensors of this graph
    (lambda g, x: g.add(x, yr.new_kernel_graph().new_input((4, 8))), r"add: input 1 .* belongs to another graph"),
    (lambda g, x: g.exp(torch.randn(4, 8)), r"exp: input 0 must be a tensor of this graph .* torch\.Tensor"),
    (lambda g, x: g.mul(x, 2.0), r"mul: input 1 must be a tensor of this graph"),
    (lambda g, x: g.linear(x, np.zeros((3, 8))), r"linear: input 1 must be a tensor of this graph.* ndarray of shape \(3, 8\)"),
    (lambda g, x: g.embedding([1, 2], x), r"embedding: input 0 must be a tensor of this graph"),
    (lambda g, x: g.attention(None, x, x, x, x, x), r"attention: input 0 must be a tensor of this graph"),
    (lambda g, x: g.mark_output(yr.new_kernel_graph().new_input((1,))), r"mark_output: .* belongs to another graph"),
    (lambda g, x: g.mark_output("x"), r"mark_output: input 0 must be a tensor of this graph"),
    (lambda g, x: g.cast(x, "float8"), r"cast: unknown dtype"),
    (lambda g, x: g.cast(x, yr.int32), r"cast: target dtype must be floating point"),
]


@pytest.mark.parametrize("build,pattern", BAD_BUILDS, ids=[p for _, p in BAD_BUILDS])
def test_bad_build_is_one_graph_error(g, x, build, pattern):
    with pytest.raises(yr.GraphError, match=pattern) as info:
        build(g, x)
    assert isinstance(info.value, ValueError) and "\n" not in str(info.value)


def test_attention_scale_must_be_finite(g):
    q = g.new_input((2, 4, 8))
    kv = g.new_input((2, 2, 8))
    cache = g.new_input((16, 2, 8))
    pos = g.new_input((1,), yr.int64)
    for bad, pattern in [(math.inf, "finite"), (math.nan, "NaN"), ("0.1", "real number")]:
        with pytest.raises(yr.GraphError, match=f"attention: scale .*{pattern}"):
            g.attention(q, kv, kv, cache, cache, pos, scale=bad)
    g.attention(q, kv, kv, cache, cache, pos, scale=0.125)


def test_integer_scalars_and_edge_values_are_accepted_and_correct():
    g = yr.new_kernel_graph()
    a = g.new_input((np.int64(4), torch.tensor(8)))  # numpy / torch integer scalars
    b = g.new_input(torch.Size([4, 8]))
    assert a.shape == b.shape == (4, 8) and type(a.shape[0]) is int
    g.mark_output(g.clamp(a, -math.inf, 0.5))  # one-sided clamp: infinite bounds are fine
    g.mark_output(g.rms_norm(b, 8, eps=0))  # a lone int like torch; eps 0 is allowed
    g.mark_output(g.softmax(g.scale(a, np.float32(2.0)), np.int32(-1)))
    g.mark_output(g.slice_rows(a, np.int64(1), 3))
    x, y = torch.randn(4, 8), torch.rand(4, 8) + 0.1
    got = g(inputs=[x, y])
    torch.testing.assert_close(got[0], x.clamp(max=0.5))
    torch.testing.assert_close(got[1], torch.nn.functional.rms_norm(y, (8,), eps=0.0), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[2], torch.softmax(x * 2.0, -1))
    torch.testing.assert_close(got[3], x[1:3])


def test_clamp_with_equal_bounds_matches_torch():
    g = yr.new_kernel_graph()
    a = g.new_input((4, 8))
    g.mark_output(g.clamp(a, 0.25, 0.25))
    x = torch.randn(4, 8)
    torch.testing.assert_close(g(inputs=[x])[0], torch.clamp(x, 0.25, 0.25))


@pytest.fixture
def graph():
    g = yr.new_kernel_graph()
    x = g.new_input((4, 8), name="x")
    ids = g.new_input((3,), yr.int64)
    g.mark_output(g.embedding(ids, g.exp(x)))
    return g


def test_the_call_graph_runs(graph):
    x, ids = torch.randn(4, 8), torch.tensor([3, 0, 1])
    torch.testing.assert_close(graph(inputs=[x, ids])[0], x.exp()[ids])


BAD_CALLS = [
    ([torch.randn(4, 8)], r"the graph has 2 inputs, got 1 tensors: pass one tensor per new_input"),
    ([torch.randn(4, 8), torch.zeros(3, dtype=torch.int64), torch.randn(1)], r"the graph has 2 inputs, got 3"),
    ([torch.randn(4, 9), torch.zeros(3, dtype=torch.int64)],
     r"input 0 \('x'\): expected a tensor of shape \(4, 8\) and dtype torch\.float32 \(float32\), got shape \(4, 9\)"),
    ([torch.randn(4, 8).double(), torch.zeros(3, dtype=torch.int64)],
     r"input 0 \('x'\): expected .* got shape \(4, 8\) and dtype torch\.float64"),
    ([torch.randn(4, 8), torch.zeros(3, dtype=torch.int32)],
     r"input 1: expected a tensor of shape \(3,\) and dtype torch\.int64 \(int64\), got shape \(3,\) and dtype torch\.int32"),
    ([np.zeros((4, 8), np.float32), torch.zeros(3, dtype=torch.int64)], r"input 0 \('x'\): .* got ndarray \(not a torch tensor\)"),
    ([[1.0] * 8, torch.zeros(3, dtype=torch.int64)], r"input 0 .* got list \(not a torch tensor\)"),
    (torch.randn(4, 8), r"inputs must be a list of tensors.* got Tensor: wrap a single tensor in a list"),
    (None, r"inputs must be a list of tensors"),
]


@pytest.mark.parametrize("inputs,pattern", BAD_CALLS, ids=[p for _, p in BAD_CALLS])
def test_bad_call_is_one_graph_error(graph, inputs, pattern):
    with pytest.raises(yr.GraphError, match=pattern):
        graph(inputs=inputs)  # compiled for the default backend
    with pytest.raises(yr.GraphError, match=pattern):
        graph.interpret(inputs)  # the reference interpreter checks the same


def test_input_on_another_device_and_non_contiguous_plan():
    g = yr.new_kernel_graph()
    a = g.new_input((4, 8))
    g.mark_output(g.exp(a))
    cg = g.compile("cpu")
    with pytest.raises(yr.GraphError, match=r"input 0 is on meta, but backend 'cpu' runs on cpu: move it with \.to\('cpu'\)"):
        cg([torch.empty(4, 8, device="meta")])
    with pytest.raises(yr.GraphError, match=r"plan: input 0 must be contiguous"):
        cg.plan([torch.randn(8, 4).t()])
    x = torch.randn(8, 4).t()
    torch.testing.assert_close(cg([x])[0], x.exp())  # a one-off call copies it instead
