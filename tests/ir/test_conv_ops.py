"""The conv-net ops (ir/conv.py): a small CNN built with the builder runs on the CPU's kernels
(no op on its torch reference) and equals the same network in torch eager; bad attributes are
one clear GraphError."""
import pytest
import torch
import torch.nn as nn

import yirage as yr
from yirage.backends import Backend, get_backend_impl
from yirage.errors import GraphError


def _cnn():
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(3, 2, 1),
        nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        nn.AvgPool2d(2), nn.Conv2d(8, 6, 1), nn.AdaptiveAvgPool2d(1)).eval()
    for m in net:
        if isinstance(m, nn.BatchNorm2d):   # non-trivial statistics and affine parameters
            m.running_mean.normal_(), m.running_var.uniform_(0.5, 2.0), m.weight.data.normal_(), m.bias.data.normal_()
    return net


def test_a_small_cnn_matches_torch_eager_on_cpu_kernels():
    net = _cnn()
    x = torch.randn(2, 3, 23, 19)
    g = yr.new_kernel_graph(backend="cpu")
    X = g.new_input(tuple(x.shape))
    inputs, h = [x], X

    def inp(t):
        inputs.append(t.detach())
        return g.new_input(tuple(t.shape))
    for m in net:
        if isinstance(m, nn.Conv2d):
            h = g.conv2d(h, inp(m.weight), inp(m.bias) if m.bias is not None else None, m.stride, m.padding,
                         m.dilation, m.groups)
        elif isinstance(m, nn.BatchNorm2d):
            h = g.batch_norm(h, inp(m.running_mean), inp(m.running_var), inp(m.weight), inp(m.bias), m.eps)
        elif isinstance(m, nn.ReLU):
            h = g.relu(h)
        elif isinstance(m, nn.MaxPool2d):
            h = g.max_pool2d(h, m.kernel_size, m.stride, m.padding)
        elif isinstance(m, nn.AvgPool2d):
            h = g.avg_pool2d(h, m.kernel_size)
        else:
            h = g.adaptive_avg_pool2d(h, m.output_size)
    g.mark_output(h)
    impl = get_backend_impl(Backend.CPU)
    assert all(impl.supports(n, g) for n in g.ops if n.op != "relu")   # every conv-net op has a CPU kernel
    with torch.no_grad():
        torch.testing.assert_close(g(inputs)[0], net(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("build, message", [
    (lambda g, x: g.conv2d(x, g.new_input((6, 3, 3, 3)), groups=2), "groups=2 must divide"),
    (lambda g, x: g.conv2d(x, g.new_input((6, 4, 9, 9))), "does not fit"),
    (lambda g, x: g.conv2d(x, g.new_input((6, 4, 3, 3)), stride=0), "stride must be an integer or a pair"),
    (lambda g, x: g.conv2d(x, g.new_input((6, 4, 3, 3), dtype=yr.bfloat16)), "in x's dtype"),
    (lambda g, x: g.max_pool2d(x, 3, padding=2), "at most half the kernel"),
    (lambda g, x: g.avg_pool2d(x, (2, 2, 2)), "kernel_size must be an integer or a pair"),
    (lambda g, x: g.adaptive_avg_pool2d(x, 0), "output_size must be an integer or a pair of integers >= 1"),
    (lambda g, x: g.batch_norm(x, g.new_input((4,)), g.new_input((4,)), g.new_input((4,))), "both weight and bias"),
    (lambda g, x: g.batch_norm(x, g.new_input((3,)), g.new_input((3,))), "must be [4] (C) in float32 or x's dtype"),
])
def test_bad_attributes_are_one_clear_error(build, message):
    g = yr.new_kernel_graph(backend="cpu")
    with pytest.raises(GraphError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        build(g, g.new_input((2, 4, 7, 5)))
