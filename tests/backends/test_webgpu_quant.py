"""WebGPU kernels for ``linear`` over GGUF block-quantized weights (backends/webgpu/quant.py,
kernels/webgpu/qblocks.wgsl, qgemv.wgsl, qmatmul.wgsl): q4_0, q4_1, q8_0, q4_K, q5_K and q6_K,
the weight kept in its block storage on the device.

Each format's weight is made as the conformance cases make it (``tools.conformance.quantized``:
normal weights quantized by gguf where it can, random blocks with finite scales for the
K-quants); kernel graphs run on the webgpu backend with these kernels patched into its
instance (``supports`` / ``bind_library_op`` try them first) against the reference interpreter,
at M 1 and 3, N odd, K a few blocks; then every configuration pinned, with the tensors at odd
offsets (the weight at each byte alignment, x, bias and out in one buffer), ``supports`` on what
it refuses, and a configuration chosen by measurement under a key naming the adapter.

Without wgpu or a WebGPU adapter (no Vulkan, Metal or D3D12 driver) the module is skipped. On
Mesa's lavapipe (a CPU driver) it runs in about ten seconds: sizes stay small."""
import pytest
import torch
import torch.nn.functional as F

import yirage as yr

if not yr.is_backend_available("webgpu"):
    from yirage.backends import get_backend_impl   # noqa: E402

    try:
        _why = get_backend_impl("webgpu").unavailable_reason()
    except Exception as e:  # noqa: BLE001 - an unknown or broken backend: say so
        _why = f"{type(e).__name__}: {e}"
    pytest.skip(f"no WebGPU: {_why}", allow_module_level=True)

from yirage.backends import get_backend_impl  # noqa: E402
from yirage.backends.webgpu import library as L  # noqa: E402
from yirage.backends.webgpu import quant as Q  # noqa: E402
from yirage.dtypes import DType  # noqa: E402
from yirage.errors import YirageError  # noqa: E402
from yirage.ir.graph import KernelGraph  # noqa: E402
from yirage.runtime import webgpu as wg  # noqa: E402
from yirage.tools.conformance import quantized  # noqa: E402
from yirage.tuning import profile as tuning  # noqa: E402

TYPES = list(Q.QTYPES)


def _close(got, want, tol=1e-4):
    """Equal within tol of the output's scale (a dot product of K terms rounds its own way)."""
    scale = max(want.abs().max().item(), 1.0)
    torch.testing.assert_close(got, want, atol=tol * scale, rtol=tol)


@pytest.fixture(autouse=True)
def _fixed_configs(monkeypatch):
    """Fixed default configurations (no first-use timing) unless a test turns it back on."""
    monkeypatch.setenv("YIRAGE_TUNE", "off")


@pytest.fixture
def patched(monkeypatch):
    """The webgpu backend instance with these kernels tried first; yields the providers of the
    thunks they bound."""
    impl = get_backend_impl("webgpu")
    supports, bind = impl.supports, impl.bind_library_op
    bound = []

    def supports_first(node, graph):
        return Q.supports_quantized_linear(node, graph) or supports(node, graph)

    def bind_first(node, graph, args, out, status=None):
        if Q.supports_quantized_linear(node, graph):
            thunk = Q.bind_quantized_linear(node, graph, args, out, status)
            bound.append(thunk.provider)
            return thunk
        return bind(node, graph, args, out, status)
    monkeypatch.setattr(impl, "supports", supports_first)
    monkeypatch.setattr(impl, "bind_library_op", bind_first)
    return bound


def _k(dtype: DType, blocks: int) -> int:
    return blocks * dtype.block[0]


@pytest.mark.parametrize("dtype", TYPES, ids=[d.value for d in TYPES])
def test_graph_linear_matches_interpreter(patched, dtype):
    """g.linear(x, w_quantized, bias) and without bias, run by the webgpu backend, against the
    reference interpreter (the weight decoded by gguf), M 1 (decode) and 3, K one and two blocks
    (K-quants) or three (the rest)."""
    N = 33
    for K in ((256, 512) if dtype.block[0] == 256 else (96,)):
        storage, _ = quantized((N, K), dtype)
        for M in (1, 3):
            g = yr.new_kernel_graph()
            x, w, b = g.new_input((M, K)), g.new_input((N, K), dtype), g.new_input((N,))
            g.mark_output(g.linear(x, w, b))
            g.mark_output(g.linear(x, w))
            inputs = [torch.randn(M, K), storage, torch.randn(N)]
            want = g.interpret(inputs)
            before = len(patched)
            got = g(inputs=inputs, backend="webgpu")
            assert len(patched) - before == 2, patched
            for o, r in zip(got, want):
                _close(o, r)


def test_leading_dims(patched):
    """x [2, 3, K]: its rows are the M of one product."""
    N, K = 33, 256
    storage, _ = quantized((N, K), DType.q4_k)
    g = yr.new_kernel_graph()
    x, w = g.new_input((2, 3, K)), g.new_input((N, K), DType.q4_k)
    g.mark_output(g.linear(x, w))
    inputs = [torch.randn(2, 3, K), storage]
    got, = g(inputs=inputs, backend="webgpu")
    assert got.shape == (2, 3, N) and patched
    _close(got, g.interpret(inputs)[0])


def _node(M, N, K, dtype, bias=True, **kw):
    g = KernelGraph()
    x = g.new_input((M, K))
    w = g.new_input((N, K), dtype)
    b = g.new_input((N,)) if bias else None
    g.linear(x, w, b, **kw)
    return g, g.ops[-1]


@pytest.mark.parametrize("dtype", TYPES, ids=[d.value for d in TYPES])
def test_every_configuration_at_offsets(dtype):
    """Every configuration pinned, at M 1 and 5 (partial tiles, partial row chunks), the weight at
    byte offsets 0..3 of a larger buffer (unaligned blocks), x, bias and out in one buffer at odd
    element offsets (bound writable: a plan's arena)."""
    N, K = 17, _k(dtype, 1 if dtype.block[0] == 256 else 2)
    storage, wf = quantized((N, K), dtype)
    names = [*Q.QGEMV_CONFIGS, *Q.QGEMM_CONFIGS]
    for i, M in enumerate((1, 5)):
        g, node = _node(M, N, K, dtype)
        x, b = torch.randn(M, K), torch.randn(N)
        want = F.linear(x, wf, b)
        arena = wg.DeviceTensor.from_host(torch.randn(3 + M * K + 5 + N + M * N))
        xd, bd = arena[3:3 + M * K].view(M, K), arena[8 + M * K:8 + M * K + N]
        od = arena[8 + M * K + N:].view(M, N)
        xd.upload(x)
        bd.upload(b)
        for j, name in enumerate(names):
            woff = (i + j) % 4
            raw = torch.randint(0, 256, (storage.numel() + 8,), dtype=torch.uint8)
            raw[woff:woff + storage.numel()] = storage.view(-1)
            wd = wg.DeviceTensor.from_host(raw)[woff:woff + storage.numel()].view(storage.shape)
            od.zero_()
            thunk = Q.bind_quantized_linear(node, g, [xd, wd, bd], od, config=name)
            thunk()
            assert thunk.provider == f"webgpu-{name} (pinned)"
            _close(od.to_host(), want)
        assert xd.to_host().equal(x) and bd.to_host().equal(b)


def test_defaults_and_errors():
    """The unpinned kernel at several M (GEMV, rows GEMV, GEMM defaults), an empty x, and the
    errors: unknown configuration, overlapping output, a weight of the wrong size."""
    dtype, N, K = DType.q8_0, 40, 64
    storage, wf = quantized((N, K), dtype)
    wd = wg.DeviceTensor.from_host(storage)
    for M, kind in ((1, "qv"), (3, "qv"), (7, "qv"), (12, "qg"), (40, "qg")):
        g, node = _node(M, N, K, dtype, bias=False)
        x = torch.randn(M, K)
        out = wg.DeviceTensor.empty((M, N), torch.float32)
        thunk = Q.bind_quantized_linear(node, g, [wg.DeviceTensor.from_host(x), wd], out)
        thunk()
        assert thunk.provider.startswith(f"webgpu-{kind}"), thunk.provider
        _close(out.to_host(), F.linear(x, wf))
    g, node = _node(2, N, K, dtype, bias=False)
    xd = wg.DeviceTensor.from_host(torch.randn(2, K))
    with pytest.raises(YirageError, match="no configuration"):
        Q.bind_quantized_linear(node, g, [xd, wd], wg.DeviceTensor.empty((2, N), torch.float32), config="g32x32k16r2x2")
    arena = wg.DeviceTensor.from_host(torch.randn(2 * K + 2 * N))
    with pytest.raises(YirageError, match="overlaps"):
        Q.bind_quantized_linear(node, g, [arena[:2 * K].view(2, K), wd], arena[2 * K - 1:2 * K - 1 + 2 * N].view(2, N),
                                config="qv8x32m4")
    with pytest.raises(YirageError, match="bytes"):
        Q.bind_quantized_linear(node, g, [xd, wd[:N - 1]], wg.DeviceTensor.empty((2, N), torch.float32),
                                config="qv8x32m4")


def test_supports():
    """Accepted: the formats in TYPES, float32 x, 'nk'. Refused: compute_dtype, other formats
    (IQ types, the row-group layouts), float weights, half x, other ops."""
    for dtype in TYPES:
        g, node = _node(3, 32, _k(dtype, 1), dtype)
        assert Q.supports_quantized_linear(node, g), dtype
        assert not L.supports_linear(node, g)
    for kw in ({"compute_dtype": "bfloat16"}, {"compute_dtype": "int8"}):
        g, node = _node(3, 32, 64, DType.q8_0, **kw)
        assert not Q.supports_quantized_linear(node, g), kw
    for dtype in (DType.iq4_nl, DType.iq4_xs, DType.q4_1r16, DType.q8_0r16, DType.float32):
        g, node = _node(1, 32, 256, dtype)
        assert not Q.supports_quantized_linear(node, g), dtype
    g = KernelGraph()
    x, w = g.new_input((1, 64), "float16"), g.new_input((32, 64), DType.q8_0)
    g.linear(x, w)
    assert not Q.supports_quantized_linear(g.ops[-1], g)
    g = KernelGraph()
    g.matmul(g.new_input((2, 3)), g.new_input((3, 4)))
    assert not Q.supports_quantized_linear(g.ops[-1], g)


@pytest.mark.parametrize("M", [1, 3])
def test_configuration_chosen_by_measurement(monkeypatch, M):
    """With tuning on, the first bind times the candidates and records the choice under a key
    naming the adapter and the format; the next bind reads it from the profile."""
    monkeypatch.setenv("YIRAGE_TUNE", "on")
    dtype, N, K = DType.q4_0, 65, 128
    storage, wf = quantized((N, K), dtype)
    g, node = _node(M, N, K, dtype)
    x, b = torch.randn(M, K), torch.randn(N)
    args = [wg.DeviceTensor.from_host(t) for t in (x, storage, b)]
    for _ in range(2):
        out = wg.DeviceTensor.empty((M, N), torch.float32)
        thunk = Q.bind_quantized_linear(node, g, args, out)
        thunk()
        _close(out.to_host(), F.linear(x, wf, b))
    key = tuning.shape_class("linear", f"{L.device_tag()}/float32/q4_0/bias", M, N, K, 0)
    entry = tuning.active_profile().entries[key]
    assert entry["choice"] in Q.candidates(M, N)
    assert thunk.provider == f"webgpu-{entry['choice']} (profile)"


def test_block_row_bytes_checks_the_layout():
    """The quantized linear and embedding kernels index by the row bytes it returns: a row that is
    not whole blocks, or a tensor whose size disagrees, is refused naming the sizes."""
    from yirage.backends.webgpu.quant import block_row_bytes
    from yirage.dtypes import DType

    per, nbytes = DType.q4_0.block                    # 32 values in 18 bytes (gguf-py's layout)
    assert block_row_bytes(DType.q4_0, 3, 64, torch.zeros(3 * 2 * nbytes, dtype=torch.uint8), "t") == 2 * nbytes
    with pytest.raises(YirageError, match=f"a multiple of {per} values, got 48"):
        block_row_bytes(DType.q4_0, 3, 48, torch.zeros(3 * 36, dtype=torch.uint8), "t")
    with pytest.raises(YirageError, match=r"\[3, 64\] is 108 bytes, got a tensor of 100"):
        block_row_bytes(DType.q4_0, 3, 64, torch.zeros(100, dtype=torch.uint8), "t")
