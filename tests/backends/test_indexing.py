"""index_select and gather with run-time indices on every backend: the conformance cases run in
test_ops.py; here what one graph call cannot show there: an index out of range raises
IndexOutOfRangeError naming the op, the value and the range (the reference says the same), an
index out of range never forms an address, and the plan recovers on the next call."""
import pytest
import torch

import yirage as yr
from yirage.backends import get_backend_impl


def _graph(op, shape, dim, ishape, dtype=yr.float32):
    g = yr.new_kernel_graph()
    x, i = g.new_input(shape, dtype), g.new_input(ishape, yr.int64)
    g.mark_output(getattr(g, op)(x, dim, i))
    return g


@pytest.mark.parametrize("op, ishape", [("index_select", (4,)), ("gather", (3, 4))])
@pytest.mark.parametrize("bad", [-1, 5, 10**9, -(2**62)])
def test_index_out_of_range_raises(op, ishape, bad, backend):
    g, dev = _graph(op, (3, 5), 1, ishape), get_backend_impl(backend).torch_device
    x = torch.randn(3, 5)
    idx = torch.randint(0, 5, ishape)
    idx.view(-1)[2] = bad
    with pytest.raises(yr.IndexOutOfRangeError, match=rf"{op}: index {bad} is out of range \[0, 5\)"):
        g(inputs=[x.to(dev), idx.to(dev)], backend=backend)
    with pytest.raises(yr.IndexOutOfRangeError, match=rf"{op}: index {bad} "):
        g.interpret([x, idx])
    idx.view(-1)[2] = 4
    ok = g(inputs=[x.to(dev), idx.to(dev)], backend=backend)  # the plan recovers
    fn = torch.index_select if op == "index_select" else torch.gather
    torch.testing.assert_close(ok[0].cpu(), fn(x, 1, idx), rtol=0, atol=0)


def test_shape_rules_reject_bad_graphs():
    g = yr.new_kernel_graph()
    x = g.new_input((3, 5))
    with pytest.raises(yr.GraphError, match="index must be int64"):
        g.index_select(x, 0, g.new_input((2,), yr.int32))
    with pytest.raises(yr.GraphError, match="index must be 1-d"):
        g.index_select(x, 0, g.new_input((2, 2), yr.int64))
    with pytest.raises(yr.GraphError, match="rank"):
        g.gather(x, 0, g.new_input((2,), yr.int64))
    with pytest.raises(yr.GraphError, match="no dim larger"):
        g.gather(x, 0, g.new_input((2, 6), yr.int64))
    with pytest.raises(yr.GraphError, match="out of range"):
        g.gather(x, 2, g.new_input((3, 5), yr.int64))
    assert g.gather(x, 0, g.new_input((7, 2), yr.int64)).shape == (7, 2)
    assert g.index_select(x, -1, g.new_input((9,), yr.int64)).shape == (3, 9)
