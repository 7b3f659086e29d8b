"""The webgpu backend's own parts: the adapter and 'auto', device memory that torch does not own
(DeviceTensor views, packed dtypes, the size limit), weights kept resident, and a fused kernel's
WGSL against torch. Runs where wgpu finds an adapter (Mesa's lavapipe here); the shared op suite
(tests/backends/test_ops.py) runs every conformance case on it too."""
import pytest
import torch

import yirage as yr
from yirage.backends import Backend, get_backend_impl, get_backend_info, resolve_backend
from yirage.errors import YirageError

if not yr.is_backend_available("webgpu"):
    pytest.skip(f"webgpu unavailable: {get_backend_info('webgpu').reason}", allow_module_level=True)

from yirage.runtime import webgpu as W  # noqa: E402


def test_info_names_the_adapter_its_backend_type_and_limits():
    info = get_backend_info("webgpu")
    rec = W.adapter_record()
    assert info.available and info.device_name == rec["device"] and info.kernels == "compiled (wgsl)"
    assert info.details["backend_type"] in ("Vulkan", "Metal", "D3D12", "OpenGL")
    assert info.details["limits"]["max-storage-buffer-binding-size"] > 0
    assert yr.get_memory_info("webgpu").total_bytes == info.memory_total_bytes > 0


def test_auto_never_picks_a_software_adapter(monkeypatch):
    impl = get_backend_impl("webgpu")
    real = W.adapter_record()
    monkeypatch.setattr(W, "adapter_record", lambda: {**real, "adapter_type": "CPU"})
    assert not impl.auto_eligible()
    assert resolve_backend("auto") != Backend.WEBGPU
    monkeypatch.setattr(W, "adapter_record", lambda: {**real, "adapter_type": "DiscreteGPU"})
    monkeypatch.setattr(W, "hardware_adapter_possible", lambda: True)
    assert impl.auto_eligible()
    assert resolve_backend("auto") in (Backend.CUDA, Backend.ROCM, Backend.XPU, Backend.WEBGPU)
    # no GPU device node: not eligible, whatever the adapter would say
    monkeypatch.setattr(W, "hardware_adapter_possible", lambda: False)
    assert not impl.auto_eligible()


def test_auto_without_a_gpu_device_node_never_loads_wgpu():
    """'auto' on a machine with no GPU device node (this one, in a container) picks without
    probing the adapter: wgpu is never imported (the probe cost ~0.8 s per process)."""
    import os
    import subprocess
    import sys

    if W.hardware_adapter_possible():
        pytest.skip("this machine has a GPU device node: 'auto' probes the adapter here")
    code = ("import sys; from yirage.backends import resolve_backend; "
            "print(resolve_backend('auto').value, 'wgpu' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k != "YIRAGE_BACKEND"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    backend, loaded = out.stdout.split()
    assert backend != "webgpu" and loaded == "False", out.stdout


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.bool, torch.int64,
                                   torch.uint8, torch.int32])
def test_device_tensors_round_trip_at_odd_offsets(dtype):
    """Sub-word dtypes share u32 words with their neighbours: writing a slice keeps them."""
    full = (torch.randn(5, 7) * 50).to(dtype)
    dev = W.DeviceTensor.from_host(full)
    part = (torch.randn(3, 7) * 50).to(dtype)
    dev[1:4].upload(part)
    want = full.clone()
    want[1:4] = part
    assert torch.equal(dev.to_host(), want)
    assert torch.equal(dev[2].to_host(), want[2])
    assert torch.equal(dev[1:2].view(7).to_host(), want[1])


def test_a_view_must_keep_the_element_count():
    dev = W.DeviceTensor.empty((4, 6), torch.float32)
    assert tuple(dev.view(3, 8).shape) == (3, 8) and tuple(dev.reshape(-1).shape) == (24,)
    with pytest.raises(ValueError, match="element counts differ"):
        dev.view(5, 5)
    with pytest.raises(ValueError, match="outside the first dim"):
        dev[4]


def test_a_buffer_past_the_adapter_limit_is_refused_naming_it(monkeypatch):
    real = W.limit
    monkeypatch.setattr(W, "limit", lambda name: 1024 if "buffer" in name else real(name))
    with pytest.raises(YirageError, match="max-storage-buffer-binding-size"):
        W.DeviceTensor.empty((1000,), torch.float32)


def test_constant_weights_are_uploaded_once_and_again_when_written(monkeypatch):
    """A weight declared constant stays on the device across calls; a write to it is seen."""
    impl = get_backend_impl("webgpu")
    g = yr.new_kernel_graph()
    x, w = g.new_input((3, 8)), g.new_input((8,))
    g.mark_output(g.mul(g.silu(x), w))
    xs, ws = torch.randn(3, 8), torch.randn(8)
    impl.declare_constant([ws])
    uploads = []
    real = W.DeviceTensor.upload

    def counting(self, t):
        uploads.append(t.numel())
        return real(self, t)
    monkeypatch.setattr(W.DeviceTensor, "upload", counting)
    for _ in range(3):
        out = g(inputs=[xs, ws], backend="webgpu")[0]
        torch.testing.assert_close(out, torch.nn.functional.silu(xs) * ws)
    assert uploads.count(8) == 1 and uploads.count(24) == 3   # the weight once, x at every call
    ws.mul_(2.0)
    out = g(inputs=[xs, ws], backend="webgpu")[0]
    torch.testing.assert_close(out, torch.nn.functional.silu(xs) * ws)
    assert uploads.count(8) == 2


def test_a_fused_row_kernel_wider_than_a_workgroup_matches_torch():
    """softmax and rms-norm style rows of 1000 columns: the workgroup loop and its reductions."""
    g = yr.new_kernel_graph()
    x = g.new_input((5, 1000))
    s = g.softmax(x, -1)
    g.mark_output(s)
    g.mark_output(g.div(x, g.sqrt(g.add(g.mean(g.mul(x, x), -1, keepdim=True), g.amax(g.abs(x), -1, keepdim=True)))))
    xs = torch.randn(5, 1000) * 3
    xs[2, 17] = float("nan")
    got = g(inputs=[xs], backend="webgpu")
    want = g.interpret([xs])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert torch.isnan(got[0][2]).all() and not torch.isnan(got[0][1]).any()


def _softmax_graph():
    g = yr.new_kernel_graph()
    x = g.new_input((4, 9))
    g.mark_output(g.softmax(x, -1))
    return g


def test_a_lost_device_is_one_clear_error_and_a_new_graph_runs_on_a_new_device():
    xs = torch.randn(4, 9)
    g = _softmax_graph()
    torch.testing.assert_close(g(inputs=[xs], backend="webgpu")[0], torch.softmax(xs, -1))
    W.device().destroy()   # what a driver reset or an unplugged GPU does
    with pytest.raises(YirageError, match="device was lost"):
        g(inputs=[xs], backend="webgpu")
    torch.testing.assert_close(_softmax_graph()(inputs=[xs], backend="webgpu")[0], torch.softmax(xs, -1))


def test_an_adapter_binding_too_few_storage_buffers_is_an_error_naming_the_limit(monkeypatch):
    """A fused kernel of 3 inputs and 1 output on an adapter that binds 3 storage buffers."""
    from yirage.runtime import wgsl_kernels

    real = W.limit
    monkeypatch.setattr(wgsl_kernels, "limit",
                        lambda name: 3 if name == "max-storage-buffers-per-shader-stage" else real(name))
    g = yr.new_kernel_graph()
    a, b, c = (g.new_input((4, 5)) for _ in range(3))
    g.mark_output(g.add(g.mul(a, b), c))
    with pytest.raises(YirageError, match="max-storage-buffers-per-shader-stage is 3"):
        g(inputs=[torch.randn(4, 5) for _ in range(3)], backend="webgpu")
