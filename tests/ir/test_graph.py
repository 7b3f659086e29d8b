"""Builder checks: shape/dtype errors at op-add time, JSON round trip, input validation."""
import pytest
import torch

import yirage as yr


def test_shape_errors_name_op_shapes_and_rule():
    g = yr.new_kernel_graph()
    a, b = g.new_input((4, 8)), g.new_input((5, 8))
    with pytest.raises(ValueError, match=r"add: .*\(4, 8\).*\(5, 8\).*broadcast"):
        g.add(a, b)
    with pytest.raises(ValueError, match=r"matmul: .*inner dims"):
        g.matmul(a, b)
    with pytest.raises(ValueError, match=r"rms_norm: .*normalized_shape"):
        g.rms_norm(a, (4,))
    with pytest.raises(ValueError, match=r"dtypes must match"):
        g.add(a, g.new_input((4, 8), yr.float16))
    with pytest.raises(ValueError, match=r"reduction: .*out of range"):
        g.reduction(a, 2)
    with pytest.raises(ValueError, match=r"divisible by 32"):
        g.new_input((4, 33), yr.q4_1)


def test_wrong_inputs_at_call():
    g = yr.new_kernel_graph()
    x = g.new_input((4, 8))
    g.mark_output(g.exp(x))
    with pytest.raises(ValueError, match=r"expected a tensor of shape \(4, 8\)"):
        g(inputs=[torch.randn(4, 9)])
    with pytest.raises(ValueError, match="1 inputs, got 2"):
        g(inputs=[torch.randn(4, 8), torch.randn(4, 8)])


def test_json_round_trip_gives_same_results():
    g = yr.new_kernel_graph()
    X = g.new_input((8, 64), yr.float32, name="x")
    W = g.new_input((64, 32))
    O = g.silu(g.matmul(g.rms_norm(X, normalized_shape=(64,)), W))
    g.mark_output(O)
    g.mark_output(g.clamp(g.reduction(O, 1), -1.0, 1.0))
    text = g.to_json()
    g2 = yr.KernelGraph.from_json(text)
    assert g2.to_json() == text
    x, w = torch.randn(8, 64), torch.randn(64, 32)
    for a, b in zip(g(inputs=[x, w]), g2(inputs=[x, w])):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_json_rejects_a_broken_shape_rule():
    g = yr.new_kernel_graph()
    a = g.new_input((4, 8))
    g.mark_output(g.exp(a))
    text = g.to_json().replace('"shape": [4, 8], "dtype": "float32"}]', '"shape": [4, 9], "dtype": "float32"}]')
    with pytest.raises(ValueError, match="exp"):
        yr.KernelGraph.from_json(text)


def test_mirage_example_from_architecture():
    g = yr.new_kernel_graph()
    X = g.new_input(dims=(8, 256), dtype=yr.float32)
    W = g.new_input(dims=(256, 256), dtype=yr.float32)
    O = g.silu(g.matmul(g.rms_norm(X, normalized_shape=(256,)), W))
    g.mark_output(O)
    x, w = torch.randn(8, 256), torch.randn(256, 256)
    out = g(inputs=[x, w])[0]
    expect = torch.nn.functional.silu(torch.nn.functional.rms_norm(x, (256,), eps=1e-6) @ w)
    torch.testing.assert_close(out, expect, atol=1e-4, rtol=1e-4)
