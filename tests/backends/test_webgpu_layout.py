"""WebGPU kernels for the layout and indexing ops and the reductions over a dim that is not the
last (backends/webgpu/layout.py; kernels/webgpu strided_copy.wgsl, cumsum.wgsl,
reduce_dim.wgsl): every conformance case of permute, expand, slice, select, cat, pad,
index_select, gather, cumsum, sum, mean, amax, amin, var, reduction, softmax and log_softmax
run on webgpu (PASS, no torch-reference fallback, and the layout kernels bound wherever the op
is a library step), the kernels bound directly on tensors at odd element offsets (sub-word
dtypes packed in shared words, neighbours untouched, an output in its input's buffer), and
run-time indices out of range raising IndexOutOfRangeError.

The backend's ``supports`` / ``bind_library_op`` are patched here to consult
``webgpu.layout.OPS`` first (the ``kernels`` fixture). Without wgpu or a WebGPU adapter the
module is skipped. On Mesa's lavapipe it runs in seconds."""
import math

import pytest
from webgpu_kernels import bound_ops
import torch
import torch.nn.functional as F

import yirage as yr
from yirage.backends import get_backend_info

if not yr.is_backend_available("webgpu"):
    pytest.skip(f"webgpu unavailable: {get_backend_info('webgpu').reason}", allow_module_level=True)

from yirage.backends.webgpu import layout as L  # noqa: E402
from yirage.runtime import webgpu as wg  # noqa: E402
from yirage.tools.conformance import CASES, run_case  # noqa: E402
from yirage.transforms.fusion import LibraryStep  # noqa: E402


@pytest.fixture(autouse=True)
def kernels(monkeypatch):
    """The ops the webgpu backend bound to this module's kernels (the backend consults them itself)."""
    return bound_ops(monkeypatch, L.OPS)


# ---- the conformance cases ----------------------------------------------------------------------
_CASES = [c for c in CASES if c.op in L.OPS]


def test_every_op_has_cases():
    assert {c.op for c in _CASES} == set(L.OPS)


_OTHER_DTYPES = ("float16", "bfloat16", "bool", "int32", "int64")


def _float32(case) -> bool:
    """A float32 case: its name says so, or names no dtype (the default, float32)."""
    return "float32" in case.name or not any(d in case.name for d in _OTHER_DTYPES)


def _library_ops(case) -> set[str]:
    """The ops ``case``'s graph runs as library steps on webgpu (not fused row kernels)."""
    with torch.random.fork_rng(devices=[]):
        graph = case.build()[0]
    cg = graph.compile("webgpu")
    return {s.node.op for s in cg.steps if isinstance(s, LibraryStep)}


@pytest.mark.parametrize("case", _CASES, ids=lambda c: c.id)
def test_conformance_case(case, kernels):
    result = run_case(case, "webgpu")
    assert result.status == "PASS", result.message
    assert result.fallback == ()
    if case.op in _library_ops(case):   # fused (trailing-dim) reductions never reach bind_library_op
        assert case.op in kernels, f"{case.id}: the layout kernel was not bound ({kernels})"
    elif _float32(case):
        assert case.op in ("sum", "mean", "amax", "amin", "var", "softmax", "log_softmax", "reduction")


def test_float32_cases_bind_the_kernels(kernels):
    """Every op of layout.OPS is bound by at least one float32 case."""
    for case in _CASES:
        if _float32(case):
            run_case(case, "webgpu")
    assert set(kernels) == set(L.OPS)


# ---- direct binds at odd offsets ------------------------------------------------------------------
def _data(shape, dtype):
    if dtype == torch.bool:
        return torch.randn(shape) > 0
    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    return torch.randint(-50, 50, shape, dtype=dtype)


class _Arena:
    """One buffer holding tensors at chosen element offsets, the rest filled with a sentinel
    pattern (to see that nothing outside a tensor is written)."""

    def __init__(self, n, dtype):
        self.fill = _data((n,), dtype)
        self.whole = wg.DeviceTensor.from_host(self.fill)
        self.dtype = dtype

    def put(self, offset, x):
        t = wg.DeviceTensor(self.whole.buffer, tuple(x.shape), self.dtype, offset)
        t.upload(x)
        self.fill[offset:offset + x.numel()] = x.reshape(-1)
        return t

    def out(self, offset, shape):
        return wg.DeviceTensor(self.whole.buffer, tuple(shape), self.dtype, offset)

    def check_outside(self, offset, n):
        got = self.whole.to_host()
        keep = torch.ones(got.numel(), dtype=torch.bool)
        keep[offset:offset + n] = False
        torch.testing.assert_close(got[keep], self.fill[keep], atol=0, rtol=0, equal_nan=True,
                                   msg="an element outside the output was written")


def _node(build):
    """(graph, its one op) of a kernel graph built by ``build(g)``."""
    g = yr.new_kernel_graph()
    g.mark_output(build(g))
    return g, g.ops[-1]


_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.bool, torch.int32, torch.int64]
_YR = {torch.float32: yr.float32, torch.float16: yr.float16, torch.bfloat16: yr.bfloat16, torch.bool: yr.bool,
       torch.int32: yr.int32, torch.int64: yr.int64}


def _layout_specs(d):
    """(build(g, x), x shape, torch function) per layout op."""
    return [
        (lambda g, x: g.permute(x, (2, 0, 1)), (3, 5, 7), lambda x: x.permute(2, 0, 1)),
        (lambda g, x: g.expand(x, (2, 3, 7)), (3, 1), lambda x: x.expand(2, 3, 7)),
        (lambda g, x: g.slice(x, 1, 1, 6, 2), (3, 7), lambda x: x[:, 1:6:2]),
        (lambda g, x: g.select(x, 1, 2), (3, 5, 3), lambda x: x[:, 2]),
        (lambda g, x: g.pad(x, [(1, 0), (2, 1)], 1.0), (3, 5), lambda x: F.pad(x, (2, 1, 1, 0), value=1.0)),
    ]


@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
@pytest.mark.parametrize("which", range(5), ids=["permute", "expand", "slice", "select", "pad"])
@pytest.mark.parametrize("offsets", [(1, 200), (3, 141)], ids=["x1-out200", "x3-out141"])
def test_layout_at_odd_offsets_in_one_buffer(which, dtype, offsets, kernels):
    build, shape, fn = _layout_specs(dtype)[which]
    if dtype == torch.bool and which == 4:
        fn = lambda x: F.pad(x.to(torch.uint8), (2, 1, 1, 0), value=1).bool()  # noqa: E731
    x = _data(shape, dtype)
    want = fn(x).contiguous()
    g, node = _node(lambda g: build(g, g.new_input(shape, _YR[dtype])))
    arena = _Arena(400, dtype)
    xd = arena.put(offsets[0], x)
    out = arena.out(offsets[1], want.shape)
    L.OPS[node.op][1](node, g, [xd], out, None)()
    assert torch.equal(out.to_host(), want)
    arena.check_outside(offsets[1], want.numel())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bool, torch.int64], ids=str)
def test_cat_at_odd_offsets(dtype, kernels):
    a, b = _data((2, 3, 5), dtype), _data((2, 1, 5), dtype)
    g, node = _node(lambda g: g.cat([g.new_input((2, 3, 5), _YR[dtype]), g.new_input((2, 1, 5), _YR[dtype])], 1))
    arena = _Arena(200, dtype)
    ad, bd = arena.put(3, a), arena.put(37, b)
    out = arena.out(51, (2, 4, 5))
    L.OPS["cat"][1](node, g, [ad, bd], out, None)()
    assert torch.equal(out.to_host(), torch.cat([a, b], 1))
    arena.check_outside(51, 40)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool, torch.int64], ids=str)
@pytest.mark.parametrize("op", ["index_select", "gather"])
def test_indexing_at_odd_offsets(op, dtype, kernels):
    x = _data((5, 7), dtype)
    index = torch.randint(0, 7, (9,)) if op == "index_select" else torch.randint(0, 7, (4, 6))
    want = torch.index_select(x, 1, index) if op == "index_select" else torch.gather(x, 1, index)
    g, node = _node(lambda g: getattr(g, op)(g.new_input((5, 7), _YR[dtype]), 1,
                                             g.new_input(tuple(index.shape), yr.int64)))
    arena = _Arena(200, dtype)
    xd = arena.put(1, x)
    out = arena.out(77, want.shape)
    ibuf = wg.DeviceTensor.from_host(torch.cat([torch.zeros(3, dtype=torch.int64), index.reshape(-1)]))
    idx = ibuf[3:].view(tuple(index.shape))
    status = wg.DeviceTensor.from_host(torch.zeros(2, 4, dtype=torch.int64))[1]
    L.OPS[op][1](node, g, [xd, idx], out, status)()
    assert torch.equal(out.to_host(), want)
    assert torch.equal(status.to_host(), torch.zeros(4, dtype=torch.int64))
    arena.check_outside(77, want.numel())


@pytest.mark.parametrize("op", ["index_select", "gather"])
@pytest.mark.parametrize("bad", [7, -1, 2 ** 40])
def test_index_out_of_range_is_recorded_in_the_status(op, bad, kernels):
    x = torch.randn(5, 7)
    index = torch.tensor([0, 3, bad, 6]) if op == "index_select" else torch.tensor([[0, 3], [bad, 6]])
    g, node = _node(lambda g: getattr(g, op)(g.new_input((5, 7)), 1, g.new_input(tuple(index.shape), yr.int64)))
    out_shape = tuple(g.tensors[node.output].shape)
    out = wg.DeviceTensor.from_host(torch.full(out_shape, 9.0))
    status = wg.DeviceTensor.from_host(torch.zeros(4, dtype=torch.int64))
    L.OPS[op][1](node, g, [wg.DeviceTensor.from_host(x), wg.DeviceTensor.from_host(index)], out, status)()
    assert status.to_host().tolist() == [1, bad, 0, 7]
    got = out.to_host()
    bad_mask = (index == bad)
    if op == "gather":   # the bad position keeps its old value, the others are gathered
        assert got[bad_mask].eq(9.0).all()
        assert torch.equal(got[~bad_mask], torch.gather(x, 1, index.clamp(0, 6))[~bad_mask])
    else:
        assert got[:, bad_mask].eq(9.0).all()
        assert torch.equal(got[:, ~bad_mask], x[:, index[~bad_mask]])


@pytest.mark.parametrize("op", ["index_select", "gather"])
@pytest.mark.parametrize("bad", [7, -3])
def test_index_out_of_range_raises(op, bad, kernels):
    g = yr.new_kernel_graph()
    index = torch.tensor([1, bad, 2]) if op == "index_select" else torch.tensor([[1, 2], [bad, 0], [4, 4]])
    g.mark_output(getattr(g, op)(g.new_input((3, 7)), 1, g.new_input(tuple(index.shape), yr.int64)))
    x = torch.randn(3, 7)
    with pytest.raises(yr.IndexOutOfRangeError, match=rf"{op}: index {bad} is out of range \[0, 7\)"):
        g(inputs=[x, index], backend="webgpu")
    assert op in kernels
    good = index.clamp(0, 6)
    out = g(inputs=[x, good], backend="webgpu")[0]   # the plan recovers
    assert torch.equal(out, g.interpret([x, good])[0])


@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
def test_cumsum_at_odd_offsets(dtype, kernels):
    x = _data((3, 5, 4), dtype)
    want = torch.cumsum(x, 1)
    g, node = _node(lambda g: g.cumsum(g.new_input((3, 5, 4), _YR[dtype]), 1))
    xbuf = _Arena(100, dtype)
    xd = xbuf.put(3, x)
    oarena = _Arena(150, want.dtype)
    out = oarena.out(7, want.shape)
    L.OPS["cumsum"][1](node, g, [xd], out, None)()
    torch.testing.assert_close(out.to_host(), want, atol=2e-2, rtol=2e-2)
    oarena.check_outside(7, want.numel())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("op", ["sum", "mean", "amax", "amin", "var", "softmax", "log_softmax", "reduction"])
def test_reduce_dim_at_odd_offsets_in_one_buffer(op, dtype, kernels):
    shape = (3, 4, 5, 6)
    x = torch.randn(shape).to(dtype)
    x[1, 2, 3, 4] = math.nan if op in ("amax", "amin") else x[1, 2, 3, 4]

    def build(g):
        xi = g.new_input(shape, _YR[dtype])
        if op in ("softmax", "log_softmax"):
            return getattr(g, op)(xi, 1)
        if op == "reduction":
            return g.reduction(xi, 1)
        kw = {"correction": 1} if op == "var" else {}
        return getattr(g, op)(xi, (1, 2), keepdim=True, **kw)
    g, node = _node(build)
    want = g.interpret([x])[0]
    arena = _Arena(1200, dtype)
    xd = arena.put(1, x)
    out = arena.out(727, want.shape)
    L.OPS[op][1](node, g, [xd], out, None)()
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.to_host(), want, equal_nan=True, **tol)
    arena.check_outside(727, want.numel())


def test_output_overlapping_the_input_is_refused(kernels):
    g, node = _node(lambda g: g.permute(g.new_input((4, 5)), (1, 0)))
    buf = wg.DeviceTensor.from_host(torch.randn(30))
    with pytest.raises(yr.YirageError, match="overlaps"):
        L.OPS["permute"][1](node, g, [buf[0:20].view(4, 5)], buf[10:30].view(5, 4), None)


def test_supports_refuses_what_it_cannot_run():
    g = yr.new_kernel_graph()
    x = g.new_input((2, 3, 4), yr.int32)
    g.mark_output(g.cumsum(x, 1))
    g.mark_output(g.permute(g.new_input((1, 1, 1, 1, 1, 1, 2)), (6, 5, 4, 3, 2, 1, 0)))
    cumsum, permute = [n for n in g.ops if n.op in ("cumsum", "permute")]
    assert L.supports_cumsum(cumsum, g)
    assert not L.supports_layout(permute, g)   # 7 dims: more than MAX_DIMS
    assert not L.supports_reduce_dim(cumsum, g)
