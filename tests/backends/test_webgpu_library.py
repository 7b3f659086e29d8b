"""WebGPU library kernels for float32 linear and matmul (backends/webgpu/library.py, the WGSL
of kernels/webgpu): each against torch on the CPU at odd sizes (M, N, K not multiples of any
tile), both weight layouts, with and without bias, every tile configuration pinned, tensors at
nonzero element offsets (and sharing one buffer, as a plan's arena does), batched matmul with
the broadcasts it supports, and the configuration chosen by measurement under a key naming
the adapter.

Without wgpu or a WebGPU adapter (no Vulkan, Metal or D3D12 driver) the module is skipped. On
Mesa's lavapipe (a CPU driver) it runs in a few seconds: sizes stay small."""
import pytest
import torch
import torch.nn.functional as F

from yirage.errors import BackendUnavailableError, YirageError

try:
    from yirage.runtime import webgpu as wg
    wg.adapter()
except BackendUnavailableError as e:
    pytest.skip(f"no WebGPU: {e}", allow_module_level=True)

from yirage.backends.webgpu import library as L  # noqa: E402
from yirage.ir.graph import KernelGraph  # noqa: E402
from yirage.tuning import profile as tuning  # noqa: E402

TOL = dict(atol=1e-4, rtol=1e-4)


@pytest.fixture(autouse=True)
def _fixed_configs(monkeypatch):
    """Fixed default configurations (no first-use timing) unless a test turns it back on."""
    monkeypatch.setenv("YIRAGE_TUNE", "off")


def _linear_graph(M, N, K, bias, layout, dtype="float32", w_dtype="float32", **kw):
    g = KernelGraph()
    x = g.new_input((M, K), dtype)
    w = g.new_input((K, N) if layout == "kn" else (N, K), w_dtype)
    b = g.new_input((N,), dtype) if bias else None
    g.linear(x, w, b, weight_layout=layout, **kw)
    return g, g.ops[-1]


def _linear_case(M, N, K, bias, layout):
    x = torch.randn(M, K)
    w = torch.randn((K, N) if layout == "kn" else (N, K)) / K ** 0.5
    b = torch.randn(N) if bias else None
    want = F.linear(x, w.t() if layout == "kn" else w, b)
    return [x, w] + ([b] if bias else []), want


def _run_linear(M, N, K, bias, layout, config=None):
    g, node = _linear_graph(M, N, K, bias, layout)
    host, want = _linear_case(M, N, K, bias, layout)
    args = [wg.DeviceTensor.from_host(t) for t in host]
    out = wg.DeviceTensor.empty((M, N), torch.float32)
    thunk = L.bind_linear(node, g, args, out, None, config=config)
    thunk()
    torch.testing.assert_close(out.to_host(), want, **TOL)
    return thunk


@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("M", [1, 3, 17, 70])
def test_linear_matches_torch(M, bias, layout):
    for K in (1, 5, 64, 129):
        for N in (1, 7, 33, 256):
            thunk = _run_linear(M, N, K, bias, layout)
            assert thunk.provider.startswith("webgpu-v" if M == 1 else "webgpu-g"), thunk.provider


@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_every_configuration(layout):
    """Each tile configuration, pinned, at sizes that cover several partial tiles (and GEMV
    configurations at M > 1: each row one batch over the shared weight)."""
    for name in [*L.GEMM_CONFIGS, *L.GEMV_CONFIGS[layout]]:
        for M, N, K in ((1, 33, 129), (70, 71, 37)):
            _run_linear(M, N, K, True, layout, config=name)
    with pytest.raises(YirageError, match="no configuration"):
        _run_linear(3, 7, 5, False, layout, config="g1x1")


def test_linear_leading_dims():
    g = KernelGraph()
    x, w = g.new_input((2, 3, 9)), g.new_input((10, 9))
    g.linear(x, w)
    xs, ws = torch.randn(2, 3, 9), torch.randn(10, 9)
    out = wg.DeviceTensor.empty((2, 3, 10), torch.float32)
    L.bind_linear(g.ops[-1], g, [wg.DeviceTensor.from_host(xs), wg.DeviceTensor.from_host(ws)], out, None)()
    torch.testing.assert_close(out.to_host(), F.linear(xs, ws), **TOL)


@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize("M", [1, 3])
def test_linear_at_offsets(M, layout):
    """x, W, bias and out as slices of larger buffers (``big[2:2+M]``): every index adds the
    element offsets; the elements around the output stay untouched."""
    N, K = 7, 5
    g, node = _linear_graph(M, N, K, True, layout)
    (x, w, b), want = _linear_case(M, N, K, True, layout)
    bigx = wg.DeviceTensor.from_host(torch.cat([torch.randn(2, K), x, torch.randn(3, K)]))
    bigw = wg.DeviceTensor.from_host(torch.cat([torch.randn(1, w.shape[1]), w]))
    bigb = wg.DeviceTensor.from_host(torch.stack([torch.randn(N), b]))
    fill = torch.randn(M + 5, N)
    bigo = wg.DeviceTensor.from_host(fill)
    args = [bigx[2:2 + M], bigw[1:], bigb[1]]
    L.bind_linear(node, g, args, bigo[2:2 + M], None)()
    got = bigo.to_host()
    torch.testing.assert_close(got[2:2 + M], want, **TOL)
    torch.testing.assert_close(got[:2], fill[:2], atol=0, rtol=0)
    torch.testing.assert_close(got[2 + M:], fill[2 + M:], atol=0, rtol=0)


@pytest.mark.parametrize("M", [1, 4])
def test_output_in_an_input_buffer(M):
    """x and out in one buffer (a plan's arena) at elements of their own: bound writable both,
    which WebGPU allows (read-only and writable would fail at the flush); overlapping elements
    are refused."""
    N = K = 6
    g, node = _linear_graph(M, N, K, False, "nk")
    (x, w), want = _linear_case(M, N, K, False, "nk")
    arena = wg.DeviceTensor.from_host(torch.cat([x, torch.zeros(M + 1, K)]))
    out = arena[M + 1:2 * M + 1]
    L.bind_linear(node, g, [arena[:M], wg.DeviceTensor.from_host(w)], out, None)()
    torch.testing.assert_close(out.to_host(), want, **TOL)
    torch.testing.assert_close(arena[:M].to_host(), x, atol=0, rtol=0)
    with pytest.raises(YirageError, match="overlaps"):
        L.bind_linear(node, g, [arena[:M], wg.DeviceTensor.from_host(w)], arena[M - 1:2 * M - 1], None)


def test_supports_linear():
    assert L.supports_linear(_linear_graph(3, 4, 5, True, "nk")[1], _linear_graph(3, 4, 5, True, "nk")[0])
    for g, node in (_linear_graph(3, 4, 32, False, "nk", w_dtype="bfloat16"),
                    _linear_graph(3, 4, 32, False, "nk", compute_dtype="bfloat16"),
                    _linear_graph(3, 4, 32, False, "nk", w_dtype="q8_0"),
                    _linear_graph(3, 4, 32, False, "nk", dtype="float16", w_dtype="float16")):
        assert not L.supports_linear(node, g)


def _matmul(a_shape, b_shape):
    g = KernelGraph()
    g.matmul(g.new_input(a_shape), g.new_input(b_shape))
    return g, g.ops[-1]


@pytest.mark.parametrize("a_shape,b_shape", [
    ((3, 17, 5), (3, 5, 33)),        # batched
    ((2, 3, 5, 9), (2, 3, 9, 6)),    # two batch dims
    ((4, 1, 64), (4, 64, 7)),        # M = 1 per batch: the GEMV
    ((2, 3, 7, 5), (5, 33)),         # b shared: a's batches fold into rows
    ((1, 7, 5), (3, 5, 33)),         # a shared by b's batches
    ((1, 5), (2, 5, 3)),             # a shared, M = 1
    ((70, 129), (129, 256)),         # plain 2-d
])
def test_matmul_matches_torch(a_shape, b_shape):
    g, node = _matmul(a_shape, b_shape)
    assert L.supports_matmul(node, g)
    a, b = torch.randn(a_shape), torch.randn(b_shape)
    want = torch.matmul(a, b)
    out = wg.DeviceTensor.empty(want.shape, torch.float32)
    L.bind_matmul(node, g, [wg.DeviceTensor.from_host(a), wg.DeviceTensor.from_host(b)], out, None)()
    torch.testing.assert_close(out.to_host(), want, **TOL)


def test_matmul_at_offsets_every_configuration():
    g, node = _matmul((3, 9, 11), (3, 11, 13))
    a, b = torch.randn(3, 9, 11), torch.randn(3, 11, 13)
    big_a = wg.DeviceTensor.from_host(torch.cat([torch.randn(2, 9, 11), a]))
    big_b = wg.DeviceTensor.from_host(torch.cat([torch.randn(1, 11, 13), b]))
    big_o = wg.DeviceTensor.from_host(torch.zeros(5, 9, 13))
    for name in L.GEMM_CONFIGS:
        L.bind_matmul(node, g, [big_a[2:5], big_b[1:4]], big_o[2:5], None, config=name)()
        torch.testing.assert_close(big_o[2:5].to_host(), torch.matmul(a, b), **TOL)
    assert big_o[:2].to_host().abs().max() == 0
    with pytest.raises(YirageError, match="no configuration"):
        L.bind_matmul(node, g, [big_a[2:5], big_b[1:4]], big_o[2:5], None, config="v64x4")


def test_supports_matmul_refuses_mixed_broadcast():
    assert not L.supports_matmul(*reversed(_matmul((2, 1, 4, 5), (1, 3, 5, 6))))
    assert not L.supports_matmul(*reversed(_matmul((3, 1, 4, 5), (3, 2, 5, 6))))
    assert L.supports_matmul(*reversed(_matmul((1, 1, 4, 5), (3, 2, 5, 6))))
    g = KernelGraph()
    g.matmul(g.new_input((3, 4, 5), "float16"), g.new_input((3, 5, 6), "float16"))
    assert not L.supports_matmul(g.ops[-1], g)


@pytest.mark.parametrize("M", [1, 70])
def test_configuration_chosen_by_measurement(monkeypatch, M):
    """With YIRAGE_TUNE on, the first bind of a shape class times its candidate configurations
    (the queue waited on after each sample) and records the fastest under a key naming the
    adapter; the next bind reads the choice back."""
    monkeypatch.setenv("YIRAGE_TUNE", "on")
    N, K = 256, 64
    thunk = _run_linear(M, N, K, True, "nk")
    key = tuning.shape_class("linear", f"{L.device_tag()}/float32/bias", M, N, K, 0)
    entry = tuning.active_profile().entries[key]
    assert set(entry["median_s"]) == set(L._gemv_candidates(N, False) if M == 1 else L._gemm_candidates(M, N))
    assert thunk.provider == f"webgpu-{entry['choice']} (measured)"
    assert _run_linear(M, N, K, True, "nk").provider == f"webgpu-{entry['choice']} (profile)"
