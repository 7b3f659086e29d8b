"""The convolution passes (transforms/conv.py): what they make of conv-net graphs, and that the
result computes what the original graph computes (the reference interpreter on both)."""
import torch

import yirage as yr
from yirage.ir.interpret import interpret
from yirage.tools import conformance
from yirage.transforms.conv import optimize_convolutions


def _ops(g):
    return [n.op for n in g.ops]


def _same_outputs(g, ng, inputs):
    for a, b in zip(interpret(ng, inputs), interpret(g, inputs)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_residual_block_becomes_two_fused_convolutions_in_nhwc():
    """conv -> BN -> + (shortcut conv -> BN) -> relu: each chain one conv2d (BN folded, the add
    and relu in the epilogue), NHWC from the input's one permute to the outputs' conversions."""
    g, inputs, _ = conformance._conv_block(1, 6, 11, 10, 8, 3, 2, 1, "conv", "relu", yr.float32)
    ng = optimize_convolutions(g, channels_last=True)
    ops = _ops(ng)
    assert ops.count("conv2d") == 2 and not {"batch_norm", "add", "relu"} & set(ops)
    convs = [n for n in ng.ops if n.op == "conv2d"]
    assert all(n.attrs["layout"] == "nhwc" and n.attrs["bn"] for n in convs)
    assert [n.attrs.get("activation") for n in convs] == [None, "relu"] and convs[1].attrs["residual"]
    assert ops.count("permute") == 2   # x to NHWC; the block's output back to NCHW
    assert ops.index("max_pool2d") > ops.index("conv2d") and ng.ops[ops.index("max_pool2d")].attrs["layout"] == "nhwc"
    _same_outputs(g, ng, inputs)


def test_without_channels_last_the_epilogue_still_fuses_in_nchw():
    g, inputs, _ = conformance._conv_block(2, 12, 8, 9, 12, 3, 1, 12, None, "relu6", yr.float32)
    ng = optimize_convolutions(g, channels_last=False)
    conv = next(n for n in ng.ops if n.op == "conv2d")
    assert "permute" not in _ops(ng) and "layout" not in conv.attrs
    assert conv.attrs["activation"] == "hardtanh" and conv.attrs["act_args"] == [0.0, 6.0]
    _same_outputs(g, ng, inputs)


def test_a_value_used_twice_is_not_fused_and_a_graph_without_conv_is_returned_as_is():
    g = yr.new_kernel_graph()
    x, w = g.new_input((1, 4, 6, 6)), g.new_input((4, 4, 3, 3))
    y = g.conv2d(x, w, None, 1, 1)
    g.mark_output(g.relu(y))
    g.mark_output(y)   # the conv's output is needed as it is: relu cannot join it
    ng = optimize_convolutions(g, channels_last=True)
    assert _ops(ng).count("relu") == 1 and "activation" not in next(n for n in ng.ops if n.op == "conv2d").attrs
    _same_outputs(g, ng, [torch.randn(1, 4, 6, 6), torch.randn(4, 4, 3, 3)])
    h = yr.new_kernel_graph()
    h.mark_output(h.relu(h.new_input((2, 3))))
    assert optimize_convolutions(h, channels_last=True) is h


def test_convnext_style_permutes_cost_nothing():
    """ConvNeXt: depthwise conv -> permute(0, 2, 3, 1) -> LayerNorm over channels -> linear ->
    permute(0, 3, 1, 2) -> + x. In NHWC the model's permutes are the values themselves: the only
    copies left are the input's and the output's conversions."""
    g = yr.new_kernel_graph()
    x, w, b = g.new_input((2, 8, 7, 7)), g.new_input((8, 1, 7, 7)), g.new_input((8,))
    lw, lb, fw = g.new_input((8,)), g.new_input((8,)), g.new_input((8, 8))
    h = g.permute(g.conv2d(x, w, b, 1, 3, 1, 8), (0, 2, 3, 1))
    h = g.linear(g.layer_norm(h, (8,), lw, lb, eps=1e-6), fw)
    g.mark_output(g.add(x, g.permute(h, (0, 3, 1, 2))))
    ng = optimize_convolutions(g, channels_last=True)
    assert _ops(ng).count("permute") == 2
    inputs = [torch.randn(2, 8, 7, 7), torch.randn(8, 1, 7, 7), torch.randn(8), torch.randn(8), torch.randn(8),
              torch.randn(8, 8)]
    _same_outputs(g, ng, inputs)
    torch.testing.assert_close(g.compile("cpu")(inputs)[0], interpret(g, inputs)[0], rtol=1e-4, atol=1e-4)


def test_tensorflow_same_padding_folds_into_the_conv_or_pads_in_nhwc():
    """MobileNetV2's explicit zero pads: a symmetric one becomes the next convolution's padding;
    an asymmetric one (stride 2 on an even size) stays a pad, done on the NHWC value."""
    g = yr.new_kernel_graph()
    x, w1, w2 = g.new_input((1, 4, 8, 8)), g.new_input((4, 1, 3, 3)), g.new_input((4, 1, 3, 3))
    y = g.relu(g.conv2d(g.pad(x, [(0, 0), (0, 0), (1, 1), (1, 1)]), w1, None, 1, 0, 1, 4))
    g.mark_output(g.conv2d(g.pad(y, [(0, 0), (0, 0), (0, 1), (0, 1)]), w2, None, 2, 0, 1, 4))
    ng = optimize_convolutions(g, channels_last=True)
    convs = [n for n in ng.ops if n.op == "conv2d"]
    assert [list(n.attrs["padding"]) for n in convs] == [[1, 1], [0, 0]]
    pads = [n for n in ng.ops if n.op == "pad"]
    assert len(pads) == 1 and pads[0].attrs["pads"] == [[0, 0], [0, 1], [0, 1], [0, 0]]
    assert _ops(ng).count("permute") == 2
    inputs = [torch.randn(1, 4, 8, 8), torch.randn(4, 1, 3, 3), torch.randn(4, 1, 3, 3)]
    _same_outputs(g, ng, inputs)
    torch.testing.assert_close(g.compile("cpu")(inputs)[0], interpret(g, inputs)[0], rtol=1e-4, atol=1e-4)
