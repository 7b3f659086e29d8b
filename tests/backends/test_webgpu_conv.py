"""WebGPU kernels for the conv-net ops (backends/webgpu/conv.py, the WGSL of kernels/webgpu):
conv2d with its fused epilogue, conv2d_stack, max/avg/adaptive-average pooling and inference
batch_norm, float32.

Every conformance case of those ops runs on the webgpu backend with this module's kernels
tried first (the backend instance's ``supports`` / ``bind_library_op`` patched, as the backend
will wire them), and must PASS with the float32 ones run by these kernels, never the torch
reference. Then the kernels themselves against torch on the CPU: every conv kernel
configuration pinned in both layouts with every epilogue, activations (NaN through ReLU and
hardtanh, large arguments of tanh and silu), pooling in both layouts (NaN wins a max window),
batch_norm of any rank and in place, tensors at element offsets of one shared buffer (a plan's
arena), overlapping outputs refused, BatchNorm statistics written between runs seen, and what
``supports`` turns down.

Without wgpu or a WebGPU adapter the module is skipped. On Mesa's lavapipe (a CPU driver) it
runs in well under a minute: sizes stay small."""
import collections

import pytest
import torch
import torch.nn.functional as F

import yirage

if not yirage.is_backend_available("webgpu"):
    from yirage.backends import get_backend_info
    pytest.skip(f"webgpu unavailable: {get_backend_info('webgpu').reason}", allow_module_level=True)

from yirage.backends import get_backend_impl  # noqa: E402
from yirage.backends.webgpu import conv as C  # noqa: E402
from yirage.dtypes import DType  # noqa: E402
from yirage.errors import YirageError  # noqa: E402
from yirage.ir.graph import KernelGraph  # noqa: E402
from yirage.runtime import webgpu as wg  # noqa: E402
from yirage.tools.conformance import CASES, run_case  # noqa: E402

D = wg.DeviceTensor
TOL = dict(atol=1e-4, rtol=1e-4)
CONV_NET_OPS = ("conv2d", "conv2d_stack", "max_pool2d", "avg_pool2d", "adaptive_avg_pool2d", "batch_norm")


# ---- the conformance cases, with these kernels wired into the backend ---------------------------
@pytest.fixture
def wired(monkeypatch):
    """The webgpu backend with this module's kernels tried first; a Counter of the binds and of
    the thunk runs per op (``op`` and ``op/run``), and of the ops bound as their torch
    reference (``reference/op``)."""
    impl = get_backend_impl("webgpu")
    supports0, bind0 = impl.supports, impl.bind_library_op
    counts = collections.Counter()

    def supports(node, graph):
        return C.supports(node, graph) or supports0(node, graph)

    def bind_library_op(node, graph, args, out, status=None):
        if not C.supports(node, graph):
            return bind0(node, graph, args, out, status)
        counts[node.op] += 1
        thunk = C.bind(node, graph, args, out, status)

        def run():
            counts[node.op + "/run"] += 1
            thunk()
        return run

    reference0 = impl.bind_reference

    def bind_reference(node, args, out):
        counts["reference/" + node.op] += 1
        return reference0(node, args, out)

    monkeypatch.setattr(impl, "supports", supports)
    monkeypatch.setattr(impl, "bind_library_op", bind_library_op)
    monkeypatch.setattr(impl, "bind_reference", bind_reference)
    return counts


def _all_float32(case) -> bool:
    with torch.random.fork_rng(devices=[]):
        graph = case.build()[0]
    return all(graph.tensors[t].dtype == DType.float32 for t in graph.inputs)


CONV_CASES = [c for c in CASES if c.op in C.OPS]


def test_every_conv_net_op_has_cases():
    assert set(CONV_NET_OPS) <= set(C.OPS)
    assert {c.op for c in CONV_CASES} == set(CONV_NET_OPS)


@pytest.mark.parametrize("case", CONV_CASES, ids=[c.id for c in CONV_CASES])
def test_conformance_case_passes_on_these_kernels(case, wired):
    result = run_case(case, "webgpu")
    assert result.status == "PASS", result.message
    if _all_float32(case):
        # (not result.fallback: it looks the compiled graph's nodes up in the graph as built,
        # whose tensor ids differ once the convolution passes have rewritten it)
        ours = {k for k in wired if k.startswith("reference/") and k.split("/")[1] in C.OPS}
        assert not ours, f"ran as the torch reference: {sorted(ours)}"
        assert wired[case.op] >= 1 and wired[case.op + "/run"] >= 1, dict(wired)


# ---- conv2d against torch -------------------------------------------------------------------------
def _nhwc(t):
    return t.permute(0, 2, 3, 1).contiguous()


ACT = {None: lambda t: t, "relu": torch.relu, "hardtanh": lambda t: t.clamp(-0.5, 0.75), "silu": F.silu,
       "sigmoid": torch.sigmoid, "tanh": torch.tanh}


def _conv_case(N, Cin, H, W, O, k, stride, padding, dilation, groups, *, bias=True, bn=None, residual=False,
               act=None, nhwc=False, config=None, scale=1.0):
    """Run ``C.conv2d`` on fresh tensors and compare with torch; ``bn``: None, 'affine' or
    'plain'. Returns the thunk."""
    x = torch.randn(N, Cin, H, W) * scale
    w = torch.randn(O, Cin // groups, k, k) / k
    b = torch.randn(O) if bias else None
    y = F.conv2d(x, w, b, stride, padding, dilation, groups)
    stats = None
    if bn:
        stats = [torch.randn(O), torch.rand(O) + 0.5, *([torch.randn(O), torch.randn(O)] if bn == "affine" else
                                                        [None, None])]
        y = F.batch_norm(y, *stats, training=False, eps=1e-3)
    r = torch.randn_like(y) if residual else None
    if residual:
        y = y + r
    y = ACT[act](y)
    lay = _nhwc if nhwc else (lambda t: t)
    out = D.empty(tuple(lay(y).shape), torch.float32)
    dev_bn = None
    if bn:
        dev_bn = (*(None if t is None else D.from_host(t) for t in stats), 1e-3)
    thunk = C.conv2d(D.from_host(lay(x)), D.from_host(w), out, stride=stride, padding=padding, dilation=dilation,
                     groups=groups, bias=D.from_host(b) if bias else None, bn=dev_bn,
                     residual=D.from_host(lay(r)) if residual else None, activation=act,
                     act_args=(-0.5, 0.75) if act == "hardtanh" else (), nhwc=nhwc, config=config)
    thunk()
    torch.testing.assert_close(out.to_host(), lay(y), **TOL)
    return thunk


@pytest.mark.parametrize("nhwc", [False, True])
@pytest.mark.parametrize("config", [C.DIRECT, *C.CONV_CONFIGS])
def test_every_conv_configuration_in_both_layouts(config, nhwc):
    """Partial tiles everywhere (M, OG, KG not multiples of any tile), strides, padding,
    dilation, groups, and the full epilogue."""
    _conv_case(2, 6, 9, 7, 10, 3, 2, 1, 1, 1, config=config, nhwc=nhwc)
    _conv_case(1, 6, 11, 10, 18, 3, (1, 2), (2, 1), 2, 2, bn="affine", residual=True, act="relu", config=config,
               nhwc=nhwc)
    _conv_case(1, 3, 8, 9, 70, 5, 1, 2, 1, 1, bias=False, bn="plain", act="silu", config=config, nhwc=nhwc)


@pytest.mark.parametrize("act", list(ACT))
def test_each_activation_and_the_chosen_kernel(act):
    thunk = _conv_case(2, 12, 7, 6, 12, 3, 1, 1, 1, 12 if act == "relu" else 1, act=act, scale=20.0)
    assert thunk.provider == f"webgpu-conv-{C.conv_config(2 * 7 * 6, 1 if act == 'relu' else 12)}"


def test_the_kernel_choice():
    assert C.conv_config(100, 1) == C.DIRECT
    assert C.conv_config(100, 12) == "c64x16k16r4x1"
    assert C.conv_config(100, 64) == "c64x64k16r4x4"
    assert C.conv_config(20, 64) == "c32x32k16r2x2"
    with pytest.raises(YirageError, match="no configuration"):
        _conv_case(1, 2, 3, 3, 2, 1, 1, 0, 1, 1, config="nope")


def test_nan_passes_through_relu_and_hardtanh():
    x = torch.full((1, 1, 2, 2), float("nan"))
    w = torch.ones(1, 1, 1, 1)
    for act, args in (("relu", ()), ("hardtanh", (0.0, 6.0))):
        out = D.empty((1, 1, 2, 2), torch.float32)
        C.conv2d(D.from_host(x), D.from_host(w), out, activation=act, act_args=args)()
        assert out.to_host().isnan().all(), act


def test_tensors_at_offsets_of_one_buffer():
    """x, w, bias, residual and out as views of one arena (the inputs then bound writable)."""
    x, w, b = torch.randn(2, 4, 6, 5), torch.randn(6, 4, 3, 3) / 3, torch.randn(6)
    want = F.conv2d(x, w, b, 1, 1)
    r = torch.randn_like(want)
    sizes = [x.numel(), w.numel(), b.numel(), r.numel(), want.numel()]
    arena = D.empty((sum(sizes) + 7,), torch.float32)
    views, off = [], 3
    for t, n in zip((x, w, b, r, want), sizes):
        views.append(arena[off:off + n].view(t.shape))
        off += n
    for v, t in zip(views[:4], (x, w, b, r)):
        v.upload(t.contiguous())
    xv, wv, bv, rv, ov = views
    for config in (C.DIRECT, "c32x32k16r2x2"):
        C.conv2d(xv, wv, ov, padding=1, bias=bv, residual=rv, activation="relu", config=config)()
        torch.testing.assert_close(ov.to_host(), torch.relu(want + r), **TOL)
    with pytest.raises(YirageError, match="overlaps an input"):
        C.conv2d(xv, wv, arena[5:5 + want.numel()].view(want.shape), padding=1)


def test_batch_norm_statistics_written_between_runs_are_seen():
    x, w = torch.randn(1, 3, 5, 5), torch.randn(4, 3, 1, 1)
    stats = [torch.randn(4), torch.rand(4) + 0.5, torch.randn(4), torch.randn(4)]
    dev = [D.from_host(t) for t in stats]
    out = D.empty((1, 4, 5, 5), torch.float32)
    thunk = C.conv2d(D.from_host(x), D.from_host(w), out, bn=(*dev, 1e-5))
    for _ in range(2):
        thunk()
        torch.testing.assert_close(out.to_host(), F.batch_norm(F.conv2d(x, w), *stats, training=False), **TOL)
        stats[0] = stats[0] + 1.0
        dev[0].upload(stats[0])


def test_conv_shape_errors_and_empty_outputs():
    x, w = D.from_host(torch.randn(1, 4, 5, 5)), D.from_host(torch.randn(6, 4, 3, 3))
    with pytest.raises(YirageError, match="do not fit"):
        C.conv2d(x, w, D.empty((1, 6, 5, 5), torch.float32))
    with pytest.raises(YirageError, match="do not fit"):
        C.conv2d(x, w, D.empty((1, 6, 3, 3), torch.float32), groups=3)
    with pytest.raises(YirageError, match="float32"):
        C.conv2d(D.from_host(torch.randn(1, 4, 5, 5).half()), D.from_host(torch.randn(6, 4, 3, 3).half()),
                 D.empty((1, 6, 3, 3), torch.float16))
    with pytest.raises(YirageError, match="activation"):
        C.conv2d(x, w, D.empty((1, 6, 3, 3), torch.float32), activation="gelu")
    C.conv2d(D.empty((0, 4, 5, 5), torch.float32), w, D.empty((0, 6, 3, 3), torch.float32))()


# ---- pooling and batch_norm against torch ---------------------------------------------------------
@pytest.mark.parametrize("nhwc", [False, True])
def test_pooling_in_both_layouts(nhwc):
    lay = _nhwc if nhwc else (lambda t: t)
    for shape, k, s, p, d in (((2, 3, 11, 9), 3, 2, 1, 1), ((1, 4, 8, 6), 2, 2, 0, 1), ((1, 2, 9, 9), 3, 1, 0, 2),
                              ((1, 3, 10, 7), (3, 2), (2, 1), (1, 1), (2, 1))):
        x = torch.randn(shape)
        want = F.max_pool2d(x, k, s, p, d)
        out = D.empty(tuple(lay(want).shape), torch.float32)
        C.pool2d(D.from_host(lay(x)), out, kernel=k, stride=s, padding=p, dilation=d, nhwc=nhwc)()
        torch.testing.assert_close(out.to_host(), lay(want), atol=0, rtol=0)
        if d != 1:
            continue
        for cip in (True, False):
            want = F.avg_pool2d(x, k, s, p, count_include_pad=cip)
            out = D.empty(tuple(lay(want).shape), torch.float32)
            C.pool2d(D.from_host(lay(x)), out, kernel=k, stride=s, padding=p, is_max=False, count_include_pad=cip,
                     nhwc=nhwc)()
            torch.testing.assert_close(out.to_host(), lay(want), atol=1e-6, rtol=1e-6)


def test_a_nan_wins_a_max_window():
    x = torch.randn(1, 2, 6, 6)
    x[0, 0, 1, 1] = float("nan")
    x[0, 1, 4, 4] = float("inf")
    want = F.max_pool2d(x, 3, 2, 1)
    out = D.empty(tuple(want.shape), torch.float32)
    C.pool2d(D.from_host(x), out, kernel=3, stride=2, padding=1)()
    torch.testing.assert_close(out.to_host(), want, equal_nan=True, atol=0, rtol=0)


def test_adaptive_average_pooling():
    for shape, size in (((2, 6, 7, 5), (1, 1)), ((1, 3, 7, 5), (3, 2)), ((2, 3, 10, 13), (4, 5)),
                        ((1, 1, 3, 3), (5, 7))):
        x = torch.randn(shape)
        want = F.adaptive_avg_pool2d(x, size)
        out = D.empty(tuple(want.shape), torch.float32)
        C.adaptive_avg_pool2d(D.from_host(x), out)()
        torch.testing.assert_close(out.to_host(), want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("shape", [(2, 5, 3, 7), (4, 6), (2, 3, 4), (1, 3, 2, 2, 2)])
def test_batch_norm_any_rank_and_in_place(shape):
    C_ = shape[1]
    for affine in (True, False):
        x = torch.randn(shape)
        st = [torch.randn(C_), torch.rand(C_) + 0.5, *([torch.randn(C_), torch.randn(C_)] if affine else [None, None])]
        want = F.batch_norm(x, *st, training=False, eps=1e-3)
        dev = [None if t is None else D.from_host(t) for t in st]
        out = D.empty(shape, torch.float32)
        C.batch_norm(D.from_host(x), *dev, out, 1e-3)()
        torch.testing.assert_close(out.to_host(), want, atol=1e-5, rtol=1e-5)
        xd = D.from_host(x)
        C.batch_norm(xd, *dev, xd, 1e-3)()   # in place
        torch.testing.assert_close(xd.to_host(), want, atol=1e-5, rtol=1e-5)
    arena = D.from_host(torch.randn(2 * x.numel()))
    with pytest.raises(YirageError, match="overlaps an input"):
        C.batch_norm(arena[0:x.numel()].view(shape), *dev, arena[1:1 + x.numel()].view(shape), 1e-3)


# ---- supports -----------------------------------------------------------------------------------
def _node(g):
    return g.ops[-1]


def test_supports_takes_float32_and_turns_down_the_rest():
    g = KernelGraph()
    x = g.new_input((1, 4, 8, 8))
    g.conv2d(x, g.new_input((6, 4, 3, 3)), None, 1, 1)
    assert C.supports(_node(g), g)
    g.max_pool2d(x, 3, 2, 1)
    assert C.supports(_node(g), g)
    g.avg_pool2d(x, 3, 2, 1, count_include_pad=False)
    assert C.supports(_node(g), g)
    g.adaptive_avg_pool2d(x, 2)
    assert C.supports(_node(g), g)
    g.batch_norm(x, g.new_input((4,)), g.new_input((4,)))
    assert C.supports(_node(g), g)

    h = KernelGraph()
    xb = h.new_input((1, 4, 8, 8), DType.bfloat16)
    h.conv2d(xb, h.new_input((6, 4, 3, 3), DType.bfloat16), None, 1, 1)
    assert not C.supports(_node(h), h)
    h.max_pool2d(xb, 2)
    assert not C.supports(_node(h), h)
    h.batch_norm(xb, h.new_input((4,)), h.new_input((4,)))
    assert not C.supports(_node(h), h)
    node = _node(g)
    node.op = "linear"
    assert not C.supports(node, g)
    g.max_pool2d(x, 2)
    _node(g).attrs["ceil_mode"] = True
    assert not C.supports(_node(g), g)
