"""Fused kernels with float16 tensors on the webgpu backend, both storages: native ``array<f16>``
where the device has ``shader-f16`` (lavapipe has it), and the packed ``u32`` words with atomic
stores where it does not (forced here with ``YIRAGE_WEBGPU_F16=0`` and a new device). Every case
runs on both, asserts which one ran (the kernel's ``f16`` flag and its source), and equals torch
eager on the CPU (float32 arithmetic from the float16 inputs, rounded to float16 once, as torch's
float16 ops do) at the conformance suite's float16 tolerance. Sizes are odd: R and D are no
multiples of a workgroup, and D is odd, so rows share u32 words in the packed storage."""
import pytest
import torch

import yirage as yr
from yirage.backends import get_backend_info

if not yr.is_backend_available("webgpu"):
    pytest.skip(f"webgpu unavailable: {get_backend_info('webgpu').reason}", allow_module_level=True)

from yirage.codegen import wgsl  # noqa: E402
from yirage.runtime import webgpu as W  # noqa: E402
from yirage.runtime.wgsl_kernels import WGSLKernel  # noqa: E402

F16 = yr.float16
TOL = dict(atol=2e-3, rtol=2e-3)   # tools/conformance.py's float16 tolerance


@pytest.fixture(scope="module", params=["native", "packed"])
def path(request):
    """The float16 storage the device gets: 'native' (shader-f16) or 'packed' (forced off)."""
    if request.param == "native" and "shader-f16" not in W.adapter().features:
        pytest.skip("the adapter has no shader-f16")
    mp = pytest.MonkeyPatch()
    if request.param == "packed":
        mp.setenv(W.F16_ENV, "0")
    else:
        mp.delenv(W.F16_ENV, raising=False)
    W.release_device()   # the next call makes a device with (or without) shader-f16
    assert W.has_f16() == (request.param == "native")
    yield request.param
    mp.undo()
    W.release_device()


def _run(g, inputs: list[torch.Tensor], path: str) -> list[torch.Tensor]:
    """``g`` on webgpu; asserts every fused kernel with float16 tensors took ``path``."""
    cg = g.compile("webgpu")
    out = cg(inputs)
    halves = [k for k in cg.kernels.values() if wgsl.uses_float16(k.kernel)]
    assert halves and all(isinstance(k, WGSLKernel) for k in cg.kernels.values())   # none on the host
    for k in halves:
        native = path == "native"
        assert k.f16 == native and ("enable f16;" in k.source) == native
        assert k.name.endswith("_f16") == native
        if native:
            assert "atomic" not in k.source and "unpack2x16float" not in k.source
    return out


def _halves(*shape, scale=3.0):
    return (torch.randn(*shape) * scale).half()


@pytest.mark.parametrize("R,D", [(37, 9), (3, 301), (1, 1)])
def test_elementwise_add_mul_silu(path, R, D):
    g = yr.new_kernel_graph()
    x, y, w = g.new_input((R, D), dtype=F16), g.new_input((R, D), dtype=F16), g.new_input((D,), dtype=F16)
    g.mark_output(g.add(x, y))
    g.mark_output(g.mul(g.silu(x), w))          # w broadcast along the rows
    g.mark_output(g.sub(g.mul(x, y), g.silu(y)))
    xs, ys, ws = _halves(R, D), _halves(R, D), _halves(D)
    got = _run(g, [xs, ys, ws], path)
    x32, y32, w32 = xs.float(), ys.float(), ws.float()
    want = [x32 + y32, torch.nn.functional.silu(x32) * w32, x32 * y32 - torch.nn.functional.silu(y32)]
    for a, b in zip(got, want):
        assert a.dtype == torch.float16
        torch.testing.assert_close(a, b.half(), **TOL)


@pytest.mark.parametrize("R,D", [(5, 129), (3, 7), (66, 65)])
def test_rows_rms_norm_softmax_and_a_row_max(path, R, D):
    g = yr.new_kernel_graph()
    x, w = g.new_input((R, D), dtype=F16), g.new_input((D,), dtype=F16)
    g.mark_output(g.mul(g.rms_norm(x, [D], eps=1e-6), w))
    g.mark_output(g.softmax(x, -1))
    g.mark_output(g.amax(x, -1, keepdim=True))   # a row value, stored once per row
    xs, ws = _halves(R, D), _halves(D, scale=1.0)
    xs[R // 2, D // 3] = float("nan")
    got = _run(g, [xs, ws], path)
    x32 = xs.float()
    rms = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6) * ws.float()
    want = [rms, torch.softmax(x32, -1), x32.amax(-1, keepdim=True)]
    for a, b in zip(got, want):
        assert a.dtype == torch.float16
        torch.testing.assert_close(a, b.half(), equal_nan=True, **TOL)
    assert torch.isnan(got[1][R // 2]).all() and torch.isnan(got[2][R // 2]).all()


def test_casts_round_as_torch_does(path):
    """float32 -> float16 rounds to nearest even, past the range to inf, NaN kept, subnormals
    kept; float16 -> float32 is exact: both equal torch's ``.to`` bit for bit."""
    R, D = 7, 45
    g = yr.new_kernel_graph()
    x, h = g.new_input((R, D)), g.new_input((R, D), dtype=F16)
    g.mark_output(g.cast(x, F16))
    g.mark_output(g.cast(h, yr.float32))
    g.mark_output(g.cast(g.mul(g.cast(h, yr.float32), x), F16))
    xs = torch.randn(R, D) * 100
    xs[0, :8] = torch.tensor([65504.0, 65519.0, 65520.0, 70000.0, -1e9, float("inf"), float("nan"), 1e-6])
    xs[1, :4] = torch.tensor([-65519.9, 6.1e-5, -3e-8, 2049.0])
    hs = _halves(R, D)
    hs[2, :3] = torch.tensor([float("inf"), float("nan"), 6e-8]).half()
    got = _run(g, [xs, hs], path)
    assert [t.dtype for t in got] == [torch.float16, torch.float32, torch.float16]
    assert torch.equal(got[0].view(torch.int16), xs.half().view(torch.int16))
    assert torch.equal(got[1].nan_to_num(nan=7.0), hs.float().nan_to_num(nan=7.0))
    torch.testing.assert_close(got[2], (hs.float() * xs).half(), equal_nan=True, **TOL)


def test_outputs_in_a_shared_buffer_keep_their_neighbours(path):
    """Odd-sized float16 outputs at odd element offsets of one buffer (as the executor's arena
    places them): each kernel writes its own halves only."""
    from yirage.runtime.wgsl_kernels import compile_wgsl
    from yirage.transforms.fusion import FusedKernel, schedule

    R, D = 5, 7
    g = yr.new_kernel_graph()
    x = g.new_input((R, D), dtype=F16)
    g.mark_output(g.neg(x))
    (k,) = [s for s in schedule(g) if isinstance(s, FusedKernel)]
    (kernel,) = compile_wgsl([k])
    xs = _halves(R, D)
    arena = W.DeviceTensor.from_host(torch.full((2 * R * D + 3,), 9.0, dtype=torch.float16))
    first, second = arena[1:1 + R * D].view(R, D), arena[2 + R * D:2 + 2 * R * D].view(R, D)
    kernel.bind([W.DeviceTensor.from_host(xs), first], R)()
    kernel.bind([W.DeviceTensor.from_host(xs * 2), second], R)()
    want = torch.full((2 * R * D + 3,), 9.0, dtype=torch.float16)
    want[1:1 + R * D] = -xs.view(-1)
    want[2 + R * D:2 + 2 * R * D] = -(xs * 2).view(-1)
    assert torch.equal(arena.to_host(), want)
    assert kernel.f16 == (path == "native")


def test_layout_copies_move_float16_natively_too(path, monkeypatch):
    """permute, pad, cat and index_select of float16 (backends/webgpu/layout.py's strided copy):
    ``strided_copy_f16`` where the device has shader-f16, else the packed bits; equal to torch
    bit for bit, pad values and infinities included."""
    from yirage.backends.webgpu import layout

    labels = []
    real = layout._copy_pipeline

    def spy(*args):
        pipeline = real(*args)
        labels.append(pipeline.label)
        return pipeline
    monkeypatch.setattr(layout, "_copy_pipeline", spy)
    g = yr.new_kernel_graph()
    x, y = g.new_input((3, 5, 7), dtype=F16), g.new_input((3, 2, 7), dtype=F16)
    idx = g.new_input((9,), dtype=yr.int64)
    g.mark_output(g.permute(x, (2, 0, 1)))
    g.mark_output(g.pad(x, [(0, 0), (1, 0), (2, 1)], -2.5))
    g.mark_output(g.cat([x, y], 1))
    g.mark_output(g.index_select(x, 2, idx))
    xs, ys = _halves(3, 5, 7), _halves(3, 2, 7)
    xs[0, 0, :3] = torch.tensor([float("inf"), -float("inf"), 6e-8]).half()
    ids = torch.tensor([6, 0, 3, 3, 1, 5, 2, 4, 6])
    got = g.compile("webgpu")([xs, ys, ids])
    want = [xs.permute(2, 0, 1), torch.nn.functional.pad(xs, (2, 1, 1, 0), value=-2.5), torch.cat([xs, ys], 1),
            torch.index_select(xs, 2, ids)]
    for a, b in zip(got, want):
        assert torch.equal(a, b.contiguous())
    native = path == "native"
    assert labels and set(labels) == {"strided_copy_f16" if native else "strided_copy_bits16"}
